/* argmax: out[i] = index of the largest of x[i, 0..cols), the first one on
 * ties, NaN never winning (0 when no element is a number); i < n.
 *
 * Two kernels: grid (nb, n) blocks each reduce a slice of a row to its best
 * (value, index) in scratch, then one block per row reduces the nb partials.
 * The order of comparison is total ("larger value, else smaller index"), so
 * the result does not depend on how the row is sliced. A decode step's
 * 128K-entry logits take two short launches and 4 bytes come back to the
 * host instead of 512 KB. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define AM_THREADS 256
#define AM_PER_BLOCK 4096 /* elements a first-pass block covers (at least) */
#define AM_MAX_BLOCKS 128
#define AM_NONE 0x7fffffff /* index of "no candidate yet" */

typedef struct {
    float v;
    int32_t i;
} am_pair;

/* a beats b: larger value, or the same value at a smaller index */
ST_DEV bool am_better(float av, int32_t ai, float bv, int32_t bi) { return av > bv || (av == bv && ai < bi); }

ST_DEV void am_take(float v, int32_t i, float &bv, int32_t &bi) {
    if (!isnan(v) && am_better(v, i, bv, bi)) bv = v, bi = i;
}

/* Block-wide reduction; thread 0 gets the result. */
ST_DEV void am_block_reduce(float &bv, int32_t &bi) {
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int32_t si[AM_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (am_better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sv[warp] = bv, si[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (am_better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    }
}

/* grid (nb, n): block b of row r covers [b len, (b + 1) len) of the row. */
static __global__ void __launch_bounds__(AM_THREADS) argmax_part_kernel(const float *__restrict__ x, int64_t cols,
                                                                       int64_t len, bool vec,
                                                                       am_pair *__restrict__ part) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t r = blockIdx.y;
    const float *row = x + r * cols;
    const int64_t b0 = (int64_t)blockIdx.x * len, b1 = min(cols, b0 + len);
    float bv = -INFINITY;
    int32_t bi = AM_NONE;
    if (vec) { /* row and slice 16-byte aligned (cols % 4 == 0, len % 4 == 0) */
        for (int64_t c = b0 / 4 + threadIdx.x; c < b1 / 4; c += blockDim.x) {
            const float4 q = __ldg((const float4 *)row + c);
            am_take(q.x, (int32_t)(4 * c), bv, bi);
            am_take(q.y, (int32_t)(4 * c + 1), bv, bi);
            am_take(q.z, (int32_t)(4 * c + 2), bv, bi);
            am_take(q.w, (int32_t)(4 * c + 3), bv, bi);
        }
    } else {
        for (int64_t c = b0 + threadIdx.x; c < b1; c += blockDim.x) am_take(__ldg(row + c), (int32_t)c, bv, bi);
    }
    am_block_reduce(bv, bi);
    if (threadIdx.x == 0) part[r * gridDim.x + blockIdx.x] = am_pair{bv, bi};
}

/* grid (n): row r's nb partials -> out[r]. */
static __global__ void __launch_bounds__(AM_THREADS) argmax_final_kernel(const am_pair *__restrict__ part, int nb,
                                                                        int32_t *__restrict__ out) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t r = blockIdx.x;
    float bv = -INFINITY;
    int32_t bi = AM_NONE;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        const am_pair p = part[r * nb + b];
        if (am_better(p.v, p.i, bv, bi)) bv = p.v, bi = p.i;
    }
    am_block_reduce(bv, bi);
    if (threadIdx.x == 0) out[r] = bi == AM_NONE ? 0 : bi;
}

strata_status st_cuda_op_argmax(st_backend *be, st_cuda_stream *s, const float *x, int64_t n, int64_t cols,
                                int32_t *out) {
    if (n > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda argmax: n = %lld rows is too many", (long long)n);
    int64_t nb = (cols + AM_PER_BLOCK - 1) / AM_PER_BLOCK;
    if (nb > AM_MAX_BLOCKS) nb = AM_MAX_BLOCKS;
    int64_t len = (cols + nb - 1) / nb;
    len = (len + 3) / 4 * 4;
    nb = (cols + len - 1) / len;
    const bool vec = cols % 4 == 0 && st_cuda_aligned(x, 16);
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_SMALL, (size_t)(n * nb) * sizeof(am_pair), &p);
    if (st != STRATA_OK) return st;
    const bool pdl = st_cuda_of(be)->pdl;
    ST_CUDA_TRY(st_launch(pdl, argmax_part_kernel, dim3((unsigned)nb, (unsigned)n), dim3(AM_THREADS), 0, s->s, x, cols,
                          len, vec, (am_pair *)p));
    ST_CUDA_TRY(st_launch(pdl, argmax_final_kernel, dim3((unsigned)n), dim3(AM_THREADS), 0, s->s, (const am_pair *)p,
                          (int)nb, out));
    return STRATA_OK;
}

/* rope: rotates x [n, n_heads, head_dim] in place; token i at position pos[i],
 * pair j (< head_dim/2) by the angle pos[i] * inv_freq[j].
 *
 * Precision: the angle is the one every backend uses (backend/rope_angle.h):
 * the exact product pos * inv_freq as hi + lo in double (hi the rounded
 * product, lo its error by fma; lo = 0 below pos = 2^29), CUDA's double
 * sincos of hi (it reduces the argument exactly, however large), lo added to
 * first order; only cos/sin are rounded to float. So the angle is exact for
 * every int32 position; an fp32 angle would be off by whole radians past
 * 2^24. Hopper runs fp64 at half the fp32 rate and each (token, pair)
 * computes its sincos once per block of heads, so this costs nothing
 * measurable. The rotation itself is fp32 without fused multiply-adds, as on
 * the CPU backend:
 *   interleaved:  (x[2j], x[2j+1]);  rotate-half: (x[j], x[j + head_dim/2])
 *   x0' = x0*cos - x1*sin;  x1' = x0*sin + x1*cos. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"
#include "backend/rope_angle.h"

/* grid (n, ceil(n_heads / hpb)): block (i, b) rotates heads [b hpb, +hpb) of
 * token i. Its first `half` threads compute cos/sin of the token's angles
 * (double) into shared memory; then each thread rotates one pair of one head
 * (one load and one store of each element, all in flight at once: a decode
 * step's single token costs one memory round trip). */
static __global__ void __launch_bounds__(1024) rope_kernel(float *x, const int32_t *__restrict__ pos, int n_heads,
                                                           int half, int hpb, const float *__restrict__ inv_freq,
                                                           bool interleaved) {
    extern __shared__ float cs[]; /* [half] cos, [half] sin */
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    if (threadIdx.x < half) {
        double hi, lo, sd, cd;
        st_rope_angle(__ldg(pos + i), __ldg(inv_freq + threadIdx.x), &hi, &lo);
        sincos(hi, &sd, &cd);
        st_rope_fix(lo, &cd, &sd);
        cs[threadIdx.x] = (float)cd;
        cs[half + threadIdx.x] = (float)sd;
    }
    __syncthreads();
    const int h = blockIdx.y * hpb + threadIdx.x / half, j = threadIdx.x % half;
    if (threadIdx.x >= hpb * half || h >= n_heads) return;
    const float c = cs[j], s = cs[half + j];
    const int hd = 2 * half;
    const int o0 = interleaved ? 2 * j : j, o1 = interleaved ? 2 * j + 1 : j + half;
    float *v = x + (i * (int64_t)n_heads + h) * hd;
    const float x0 = v[o0], x1 = v[o1];
    v[o0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    v[o1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

strata_status st_cuda_op_rope(st_backend *be, st_cuda_stream *s, float *x, const int32_t *pos,
                              int64_t n, int64_t n_heads, int64_t head_dim, const float *inv_freq,
                              bool interleaved) {
    if (n_heads > 65535 * 1024 || head_dim > 2048 || n > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda rope: sizes too large");
    const int half = (int)(head_dim / 2);
    const int hpb = 1024 / half < n_heads ? 1024 / half : (int)n_heads; /* heads per block */
    const int64_t gy = (n_heads + hpb - 1) / hpb;
    const int threads = (hpb * half + 31) / 32 * 32;
    if (gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda rope: %lld heads is too many", (long long)n_heads);
    ST_CUDA_TRY(st_launch(st_cuda_of(be)->pdl, rope_kernel, dim3((unsigned)n, (unsigned)gy), dim3(threads),
                          (size_t)2 * half * sizeof(float), s->s, x, pos, (int)n_heads, half, hpb, inv_freq,
                          interleaved));
    return STRATA_OK;
}

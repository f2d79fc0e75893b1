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
/* cos and sin of pair j's angle at position p, into cs[j] and cs[half + j] */
ST_DEV void rope_cs(int32_t p, float f, int half, int j, float *cs) {
    double hi, lo, sd, cd;
    st_rope_angle(p, f, &hi, &lo);
    sincos(hi, &sd, &cd);
    st_rope_fix(lo, &cd, &sd);
    cs[j] = (float)cd;
    cs[half + j] = (float)sd;
}

/* Pair j of one head (v: its hd = 2 half values) turned by (c, s); the new
 * values are also returned (a0 at offset o0, a1 at o1). */
ST_DEV void rope_pair(float *v, int j, int half, bool interleaved, float c, float s, float &a0, float &a1, int &o0,
                      int &o1) {
    o0 = interleaved ? 2 * j : j, o1 = interleaved ? 2 * j + 1 : j + half;
    const float x0 = v[o0], x1 = v[o1];
    a0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    a1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    v[o0] = a0;
    v[o1] = a1;
}

static __global__ void __launch_bounds__(1024) rope_kernel(float *x, const int32_t *__restrict__ pos, int n_heads,
                                                           int half, int hpb, const float *__restrict__ inv_freq,
                                                           bool interleaved) {
    extern __shared__ float cs[]; /* [half] cos, [half] sin */
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    if (threadIdx.x < half) rope_cs(__ldg(pos + i), __ldg(inv_freq + threadIdx.x), half, threadIdx.x, cs);
    __syncthreads();
    const int h = blockIdx.y * hpb + threadIdx.x / half, j = threadIdx.x % half;
    if (threadIdx.x >= hpb * half || h >= n_heads) return;
    float a0, a1;
    int o0, o1;
    rope_pair(x + (i * (int64_t)n_heads + h) * 2 * half, j, half, interleaved, cs[j], cs[half + j], a0, a1, o0, o1);
}

/* A K/V value as kv_store_paged stores it: f32 as is, bf16 rounded to nearest even */
template <typename T>
ST_DEV T kv_val(float x) {
    if constexpr (sizeof(T) == 4) return x;
    else return __float2bfloat16_rn(x);
}

/* rope_kv_store, f32 / bf16 caches: grid (n, ceil((H + Hkv) / hpb)): block
 * (i, b) turns heads [b hpb, (b + 1) hpb) of token i's q heads followed by
 * its k heads, one pair a thread, after computing the token's cos / sin as
 * rope_kernel does; k's new values also go to the token's slot, and the
 * block stores its share of v's row; each value converted as
 * kv_store_paged converts it: the bytes of rope, rope, kv_store_paged. */
template <typename T>
static __global__ void __launch_bounds__(256)
    rope_kv_store_kernel(float *q, float *k, const float *__restrict__ v, const int32_t *__restrict__ pos, int H,
                         int Hkv, int half, int hpb, const float *__restrict__ inv_freq, bool interleaved,
                         T *__restrict__ kc, T *__restrict__ vc, int64_t n_slots, const int64_t *__restrict__ slots) {
    extern __shared__ float cs[]; /* [half] cos, [half] sin */
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int32_t p = __ldg(pos + i);
    for (int j = threadIdx.x; j < half; j += blockDim.x) rope_cs(p, __ldg(inv_freq + j), half, j, cs);
    __syncthreads();
    const int hd = 2 * half;
    const int64_t r = __ldg((const long long *)slots + i), cols = (int64_t)Hkv * hd;
    const bool store = r >= 0 && r < n_slots; /* else kv_store_paged skips the token */
    const int h0 = (int)blockIdx.y * hpb, h1 = min(H + Hkv, h0 + hpb);
    for (int e = threadIdx.x; e < (h1 - h0) * half; e += blockDim.x) {
        const int h = h0 + e / half, j = e % half;
        float a0, a1;
        int o0, o1;
        if (h < H) {
            rope_pair(q + (i * H + h) * hd, j, half, interleaved, cs[j], cs[half + j], a0, a1, o0, o1);
        } else {
            rope_pair(k + (i * Hkv + h - H) * hd, j, half, interleaved, cs[j], cs[half + j], a0, a1, o0, o1);
            if (store) {
                T *d = kc + r * cols + (int64_t)(h - H) * hd;
                d[o0] = kv_val<T>(a0);
                d[o1] = kv_val<T>(a1);
            }
        }
    }
    if (store) {
        const int64_t per = (cols + gridDim.y - 1) / gridDim.y, e0 = (int64_t)blockIdx.y * per;
        const int64_t e1 = min(cols, e0 + per);
        for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) vc[r * cols + e] = kv_val<T>(__ldg(v + i * cols + e));
    }
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

strata_status st_cuda_op_rope_kv_store(st_backend *be, st_cuda_stream *s, float *q, float *k, const float *v,
                                       const int32_t *pos, int64_t n, int64_t n_heads, int64_t head_dim,
                                       const float *inv_freq, bool interleaved, const st_kv_layer *c,
                                       const int64_t *slots) {
    const int64_t Hkv = c->n_kv_heads;
    if (c->dtype == ST_KV_FP8) { /* the fp8 rows' scales need the whole rotated row: the three ops */
        strata_status st = st_cuda_op_rope(be, s, q, pos, n, n_heads, head_dim, inv_freq, interleaved);
        if (st == STRATA_OK) st = st_cuda_op_rope(be, s, k, pos, n, Hkv, head_dim, inv_freq, interleaved);
        return st == STRATA_OK ? st_cuda_op_kv_store_paged(be, s, c, k, v, slots, n) : st;
    }
    if (n > INT32_MAX || n_heads + Hkv > INT32_MAX / 1024 || head_dim > 2048)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda rope_kv_store: n = %lld, heads %lld + %lld, head_dim %lld: too large",
                      (long long)n, (long long)n_heads, (long long)Hkv, (long long)head_dim);
    const size_t es = st_kv_dtype_size(c->dtype);
    if (!st_cuda_aligned(c->k, es) || !st_cuda_aligned(c->v, es))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda rope_kv_store: cache.k = %p / cache.v = %p are not %zu-byte aligned "
                      "(%s)", c->k, c->v, es, st_kv_dtype_name(c->dtype));
    const int half = (int)(head_dim / 2);
    const int hpb = half >= 256 ? 1 : 256 / half; /* heads per block: a pair per thread */
    const int64_t gy = (n_heads + Hkv + hpb - 1) / hpb;
    if (gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda rope_kv_store: %lld heads is too many", (long long)(n_heads + Hkv));
    const dim3 grid((unsigned)n, (unsigned)gy);
    const int threads = hpb * half >= 256 ? 256 : (hpb * half + 31) / 32 * 32;
    const bool pdl = st_cuda_of(be)->pdl;
    const size_t smem = (size_t)2 * half * sizeof(float);
    if (c->dtype == ST_KV_F32)
        ST_CUDA_TRY(st_launch(pdl, rope_kv_store_kernel<float>, grid, dim3(threads), smem, s->s, q, k, v, pos,
                              (int)n_heads, (int)Hkv, half, hpb, inv_freq, interleaved, (float *)c->k, (float *)c->v,
                              c->n_slots, slots));
    else
        ST_CUDA_TRY(st_launch(pdl, rope_kv_store_kernel<__nv_bfloat16>, grid, dim3(threads), smem, s->s, q, k, v, pos,
                              (int)n_heads, (int)Hkv, half, hpb, inv_freq, interleaved, (__nv_bfloat16 *)c->k,
                              (__nv_bfloat16 *)c->v, c->n_slots, slots));
    return STRATA_OK;
}

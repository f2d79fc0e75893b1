/* rope: rotates x [n, n_heads, head_dim] in place; token i at position pos[i],
 * pair j (< head_dim/2) by the angle pos[i] * inv_freq[j].
 *
 * Precision: the angle is formed and reduced in double precision
 * ((double)pos * (double)inv_freq[j], then CUDA's double sincos, which reduces
 * the argument exactly), and only cos/sin are rounded to float. The product of
 * a 31-bit integer and a 24-bit mantissa is exact to 2^-53 relative, so the
 * angle is right to ~1e-7 rad even at pos = 2^31 - 1; an fp32 angle would be
 * off by whole radians past 2^24. Hopper runs fp64 at half the fp32 rate and
 * each (token, pair) computes its sincos once for all heads, so this costs
 * nothing measurable. The rotation itself is fp32 without fused multiply-adds,
 * as on the CPU backend:
 *   interleaved:  (x[2j], x[2j+1]);  rotate-half: (x[j], x[j + head_dim/2])
 *   x0' = x0*cos - x1*sin;  x1' = x0*sin + x1*cos. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

static __global__ void __launch_bounds__(128) rope_kernel(float *x, const int32_t *__restrict__ pos, int64_t n,
                                                          int n_heads, int half,
                                                          const float *__restrict__ inv_freq,
                                                          bool interleaved) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * half) return;
    const int64_t i = idx / half;
    const int j = (int)(idx % half);
    const double theta = (double)__ldg(pos + i) * (double)__ldg(inv_freq + j);
    double sd, cd;
    sincos(theta, &sd, &cd);
    const float c = (float)cd, s = (float)sd;
    const int hd = 2 * half;
    const int o0 = interleaved ? 2 * j : j, o1 = interleaved ? 2 * j + 1 : j + half;
    float *xi = x + i * (int64_t)n_heads * hd;
    for (int h = 0; h < n_heads; h++) {
        float *v = xi + (int64_t)h * hd;
        const float x0 = v[o0], x1 = v[o1];
        v[o0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        v[o1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

strata_status st_cuda_op_rope(st_backend *be, st_cuda_stream *s, float *x, const int32_t *pos,
                              int64_t n, int64_t n_heads, int64_t head_dim, const float *inv_freq,
                              bool interleaved) {
    if (n_heads > INT32_MAX || head_dim > INT32_MAX || n > INT64_MAX / head_dim)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda rope: sizes too large");
    const int half = (int)(head_dim / 2);
    const int64_t work = n * half;
    const int64_t blocks = (work + 127) / 128;
    if (blocks > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda rope: n = %lld is too large", (long long)n);
    rope_kernel<<<(unsigned)blocks, 128, 0, s->s>>>(x, pos, n, (int)n_heads, half, inv_freq, interleaved);
    ST_CUDA_LAUNCHED("rope_kernel");
    return STRATA_OK;
}

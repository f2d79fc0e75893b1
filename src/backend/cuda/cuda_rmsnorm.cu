/* rmsnorm: if residual: x += residual (in place); then
 * out[i, :] = (x[i, :] * (1 / sqrt(mean(x[i, :]^2) + eps))) * w.
 * One block per row, fp32 throughout (sum of squares per thread, then a block
 * tree), the same rounding steps as the CPU backend otherwise (no fused
 * multiply-adds in the scaling). w (1 x d) may be any dtype; it is decoded
 * element by element, exactly. out may alias x. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

template <int T>
static __global__ void __launch_bounds__(256) rmsnorm_kernel(float *__restrict__ x, const float *__restrict__ res,
                                                             const uint8_t *__restrict__ w, float eps,
                                                             int64_t d, float *out) {
    __shared__ float red[32];
    float *xr = x + blockIdx.x * d;
    float *orow = out + blockIdx.x * d;
    float ss = 0.0f;
    if (res) {
        const float *rr = res + blockIdx.x * d;
        for (int64_t k = threadIdx.x; k < d; k += blockDim.x) {
            const float v = __fadd_rn(xr[k], __ldg(rr + k));
            xr[k] = v;
            ss = __fmaf_rn(v, v, ss);
        }
    } else {
        for (int64_t k = threadIdx.x; k < d; k += blockDim.x) {
            const float v = xr[k];
            ss = __fmaf_rn(v, v, ss);
        }
    }
    ss = st_block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps); /* IEEE division and sqrt */
    for (int64_t k = threadIdx.x; k < d; k += blockDim.x)
        orow[k] = __fmul_rn(__fmul_rn(xr[k], inv), st_dq1<T>(w, k));
}

strata_status st_cuda_op_rmsnorm(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                 const st_weight *w, float eps, int64_t n, int64_t d, float *out) {
    if (n > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda rmsnorm: n = %lld is too large", (long long)n);
    const int threads = d >= 4096 ? 256 : d >= 1024 ? 128 : 64;
    ST_DTYPE_SWITCH(w->dtype, T, {
        rmsnorm_kernel<T><<<(unsigned)n, threads, 0, s->s>>>(x, residual, (const uint8_t *)w->data, eps, d,
                                                             out);
        ST_CUDA_LAUNCHED("rmsnorm_kernel");
        return STRATA_OK;
    });
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda rmsnorm: weight dtype %s", st_dtype_name(w->dtype));
}

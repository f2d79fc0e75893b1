/* rmsnorm: if residual: x += residual (in place); then
 * out[i, :] = (x[i, :] * (1 / sqrt(mean(x[i, :]^2) + eps))) * w.
 * One block per row, fp32 throughout (sum of squares per thread, then a block
 * tree), the same rounding steps as the CPU backend otherwise (no fused
 * multiply-adds in the scaling). w (1 x d) may be any dtype; it is decoded
 * element by element, exactly. out may alias x.
 *
 * Two kernels:
 *   vec (d % 4 == 0, x / residual / out 16-byte aligned, d <= 4 * 4 * 1024):
 *     up to 1024 threads, each holds at most 4 float4 of the row in
 *     registers: one load of x (and of the residual) per element, all issued
 *     before the reduction, then one store. A decode step's rows (n = 1) are
 *     latency bound: one round trip instead of one per loop iteration.
 *   scalar: any d, a loop per thread (x re-read for the scaling). */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define RN_VEC_PER 4 /* float4 per thread at most */

template <int T>
static __global__ void __launch_bounds__(1024) rmsnorm_vec_kernel(float *x, const float *res,
                                                                  const uint8_t *__restrict__ w, float eps,
                                                                  int64_t d, float *out) {
    __shared__ float red[32];
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t d4 = d / 4;
    float4 *xr = (float4 *)(x + blockIdx.x * d);
    float4 v[RN_VEC_PER];
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < RN_VEC_PER; i++) {
        const int64_t c = threadIdx.x + (int64_t)i * blockDim.x;
        v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < d4) {
            v[i] = xr[c];
            if (res) {
                const float4 r = __ldg((const float4 *)(res + blockIdx.x * d) + c);
                v[i].x = __fadd_rn(v[i].x, r.x), v[i].y = __fadd_rn(v[i].y, r.y);
                v[i].z = __fadd_rn(v[i].z, r.z), v[i].w = __fadd_rn(v[i].w, r.w);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RN_VEC_PER; i++) {
        const int64_t c = threadIdx.x + (int64_t)i * blockDim.x;
        if (c < d4) {
            if (res) xr[c] = v[i];
            ss = __fmaf_rn(v[i].x, v[i].x, ss);
            ss = __fmaf_rn(v[i].y, v[i].y, ss);
            ss = __fmaf_rn(v[i].z, v[i].z, ss);
            ss = __fmaf_rn(v[i].w, v[i].w, ss);
        }
    }
    ss = st_block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps); /* IEEE division and sqrt */
    float4 *orow = (float4 *)(out + blockIdx.x * d);
#pragma unroll
    for (int i = 0; i < RN_VEC_PER; i++) {
        const int64_t c = threadIdx.x + (int64_t)i * blockDim.x;
        if (c < d4) {
            const int64_t k = 4 * c;
            orow[c] = make_float4(__fmul_rn(__fmul_rn(v[i].x, inv), st_dq1<T>(w, k)),
                                  __fmul_rn(__fmul_rn(v[i].y, inv), st_dq1<T>(w, k + 1)),
                                  __fmul_rn(__fmul_rn(v[i].z, inv), st_dq1<T>(w, k + 2)),
                                  __fmul_rn(__fmul_rn(v[i].w, inv), st_dq1<T>(w, k + 3)));
        }
    }
}

template <int T>
static __global__ void __launch_bounds__(256) rmsnorm_kernel(float *__restrict__ x, const float *__restrict__ res,
                                                             const uint8_t *__restrict__ w, float eps,
                                                             int64_t d, float *out) {
    __shared__ float red[32];
    st_pdl_wait();
    st_pdl_trigger();
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
    const bool vec = d % 4 == 0 && d / 4 <= (int64_t)RN_VEC_PER * 1024 && st_cuda_aligned(x, 16) &&
                     st_cuda_aligned(out, 16) && (!residual || st_cuda_aligned(residual, 16));
    if (vec) {
        /* as few threads as hold the row in RN_VEC_PER float4 each, a multiple of 32 */
        int64_t threads = (d / 4 + RN_VEC_PER - 1) / RN_VEC_PER;
        if (threads < 128) threads = d / 4 < 128 ? d / 4 : 128;
        threads = (threads + 31) / 32 * 32;
        if (threads > 1024) threads = 1024;
        ST_DTYPE_SWITCH(w->dtype, T, {
            ST_CUDA_TRY(st_launch(st_cuda_of(be)->pdl, rmsnorm_vec_kernel<T>, dim3((unsigned)n), dim3((unsigned)threads),
                                  0, s->s, x, residual, (const uint8_t *)w->data, eps, d, out));
            return STRATA_OK;
        });
    } else {
        const int threads = d >= 4096 ? 256 : d >= 1024 ? 128 : 64;
        ST_DTYPE_SWITCH(w->dtype, T, {
            ST_CUDA_TRY(st_launch(st_cuda_of(be)->pdl, rmsnorm_kernel<T>, dim3((unsigned)n), dim3(threads), 0, s->s, x,
                                  residual, (const uint8_t *)w->data, eps, d, out));
            return STRATA_OK;
        });
    }
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda rmsnorm: weight dtype %s", st_dtype_name(w->dtype));
}

/* rmsnorm: if residual: x += residual (in place); then
 * out[i, :] = (x[i, :] * (1 / sqrt(mean(x[i, :]^2) + eps))) * w.
 * One block per row, fp32 throughout (sum of squares per thread, then a block
 * tree), the same rounding steps as the CPU backend otherwise (no fused
 * multiply-adds in the scaling). w (1 x d) may be any dtype; it is decoded
 * element by element, exactly. out may alias x.
 *
 * Two kernels:
 *   vec (d % 4 == 0, x / residual / out 16-byte aligned, d <= 4 * 4 * 1024;
 *     st_cuda_rmsnorm_q: the same kernel also writing out's int8
 *     quantization for the decode GEMV, rmsnorm_matmul's fused path):
 *     up to 1024 threads, each holds at most 4 float4 of the row in
 *     registers: one load of x (and of the residual) per element, all issued
 *     before the reduction, then one store; the weight is read before the
 *     PDL wait. A decode step's rows (n = 1) are latency bound: one round
 *     trip instead of one per loop iteration.
 *   scalar: any d, a loop per thread (x re-read for the scaling). */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define RN_VEC_PER 4 /* float4 per thread at most */

/* Q: out's int8 quantization too (xq, xd, xs as st_cuda_gemv2_quant_x: the
 * same arithmetic on the same fp32 values, so the same bytes; d % 32 == 0,
 * the 8 lanes of a 32-block share its scale through shuffles). */
template <int T, bool Q>
static __global__ void __launch_bounds__(1024) rmsnorm_vec_kernel(float *x, const float *res,
                                                                  const uint8_t *__restrict__ w, float eps,
                                                                  int64_t d, float *out, int8_t *xq, float *xd,
                                                                  float *xs) {
    __shared__ float red[32];
    const int64_t d4 = d / 4;
    /* the weight before the PDL wait (never written by kernels): its load
     * overlaps the previous kernel's tail instead of following the reduction */
    float4 wv[RN_VEC_PER];
#pragma unroll
    for (int i = 0; i < RN_VEC_PER; i++) {
        const int64_t k = 4 * (threadIdx.x + (int64_t)i * blockDim.x);
        if (k < d) wv[i] = make_float4(st_dq1<T>(w, k), st_dq1<T>(w, k + 1), st_dq1<T>(w, k + 2), st_dq1<T>(w, k + 3));
    }
    st_pdl_wait();
    st_pdl_trigger();
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
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < d4) {
            o = make_float4(__fmul_rn(__fmul_rn(v[i].x, inv), wv[i].x), __fmul_rn(__fmul_rn(v[i].y, inv), wv[i].y),
                            __fmul_rn(__fmul_rn(v[i].z, inv), wv[i].z), __fmul_rn(__fmul_rn(v[i].w, inv), wv[i].w));
            orow[c] = o;
        }
        if constexpr (Q) { /* every lane of the warp (shuffles); d4 % 8 == 0: whole 32-blocks in or out */
            float m = fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w)));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
            const float dq = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
            const float e[4] = {o.x, o.y, o.z, o.w};
            uint32_t wq = 0;
            int sum = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int q = min(127, max(-127, __float2int_rn(e[k] * id)));
                sum += q;
                wq |= ((uint32_t)q & 0xffu) << (8 * k);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            sum += __shfl_xor_sync(0xffffffffu, sum, 4);
            if (c < d4) {
                const int64_t e0 = blockIdx.x * d + 4 * c;
                ((uint32_t *)xq)[e0 / 4] = wq;
                if ((threadIdx.x & 7) == 0) {
                    xd[e0 / 32] = dq;
                    if (xs) xs[e0 / 32] = __fmul_rn(dq, (float)sum);
                }
            }
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

/* The vec kernel's conditions, and its threads: as few as hold the row in
 * RN_VEC_PER float4 each, a multiple of 32 (0 where it does not apply). */
static int64_t vec_threads(const float *x, const float *residual, int64_t d, const float *out) {
    const bool vec = d % 4 == 0 && d / 4 <= (int64_t)RN_VEC_PER * 1024 && st_cuda_aligned(x, 16) &&
                     st_cuda_aligned(out, 16) && (!residual || st_cuda_aligned(residual, 16));
    if (!vec) return 0;
    int64_t threads = (d / 4 + RN_VEC_PER - 1) / RN_VEC_PER;
    if (threads < 128) threads = d / 4 < 128 ? d / 4 : 128;
    threads = (threads + 31) / 32 * 32;
    return threads > 1024 ? 1024 : threads;
}

strata_status st_cuda_rmsnorm_q(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                const st_weight *w, float eps, int64_t n, int64_t d, float *out, int8_t *xq,
                                float *xd, float *xs, bool *done) {
    *done = false;
    const int64_t threads = vec_threads(x, residual, d, out);
    if (!threads || d % 32 || n > INT32_MAX || !st_cuda_aligned(xq, 16)) return STRATA_OK;
    ST_DTYPE_SWITCH(w->dtype, T, {
        ST_CUDA_TRY(st_launch(st_cuda_of(be)->pdl, rmsnorm_vec_kernel<T, true>, dim3((unsigned)n),
                              dim3((unsigned)threads), 0, s->s, x, residual, (const uint8_t *)w->data, eps, d, out,
                              xq, xd, xs));
        *done = true;
        return STRATA_OK;
    });
    return STRATA_OK;
}

strata_status st_cuda_op_rmsnorm(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                 const st_weight *w, float eps, int64_t n, int64_t d, float *out) {
    if (n > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda rmsnorm: n = %lld is too large", (long long)n);
    const int64_t threads = vec_threads(x, residual, d, out);
    if (threads) {
        ST_DTYPE_SWITCH(w->dtype, T, {
            ST_CUDA_TRY(st_launch(st_cuda_of(be)->pdl, rmsnorm_vec_kernel<T, false>, dim3((unsigned)n),
                                  dim3((unsigned)threads), 0, s->s, x, residual, (const uint8_t *)w->data, eps, d, out,
                                  (int8_t *)NULL, (float *)NULL, (float *)NULL));
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

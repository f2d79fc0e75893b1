/* kv_store_paged: cache row slots[i] of K gets k[i, :], that of V gets v[i, :]
 * for i < n (backend.h), converted to the cache's element type (st_kv_layer):
 * a batch's K/V rows written into one layer's paged pool at the slots the
 * scheduler chose. A slot of -1 skips its token; a slot outside [0, n_slots)
 * (the slots live on the device, so the host cannot check them) is skipped
 * too.
 *   f32: one block per token; 16-byte vectors when cols % 4 == 0 and every
 *     pointer is 16-byte aligned.
 *   bf16: the same, each value rounded by __float2bfloat16_rn (cvt.rn.bf16.f32:
 *     round to nearest even, NaN -> 0x7fff, as st_kv_f32_to_bf16).
 *   fp8: one warp per (token, kv head) row: max|x| over the row (fmaxf
 *     ignores NaN, as the CPU's comparison does; max is exact, so the
 *     reduction order does not matter), scale = __fdiv_rn(max, 448) (1 when 0),
 *     then __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3)
 *     (round to nearest even, saturating, NaN -> 0x7f): the same fp32
 *     operations as the CPU reference (st_kv_fp8_row_scale, st_kv_f32_to_fp8 of
 *     x / scale), so the same bytes and scales.
 * kv_gather (the reverse, into fp32 rows): one block per id, threads over the
 * row's elements; each value converted exactly as attention_paged reads it
 * (bf16: bits << 16; fp8: its fp32 value __fmul_rn its (slot, head) row's
 * scale); an id outside [0, n_slots) gives rows of NaN. */
#include <cuda_fp8.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

/* f32 / bf16: grid (n), one block per token, threads over the row's cols. */
template <typename T, bool VEC>
static __global__ void __launch_bounds__(256)
    kv_store_paged_kernel(T *__restrict__ kc, T *__restrict__ vc, int64_t n_slots, const float *__restrict__ k,
                          const float *__restrict__ v, const int64_t *__restrict__ slots, int64_t cols) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int64_t r = __ldg((const long long *)slots + i);
    if (r < 0 || r >= n_slots) return;
    T *dk = kc + r * cols, *dv = vc + r * cols;
    const float *sk = k + i * cols, *sv = v + i * cols;
    if constexpr (VEC) {
        for (int64_t c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 a = __ldg((const float4 *)sk + c), b = __ldg((const float4 *)sv + c);
            if constexpr (sizeof(T) == 4) {
                ((float4 *)dk)[c] = a;
                ((float4 *)dv)[c] = b;
            } else { /* 4 bf16 = 8 bytes */
                const __nv_bfloat162 a0 = __floats2bfloat162_rn(a.x, a.y), a1 = __floats2bfloat162_rn(a.z, a.w);
                const __nv_bfloat162 b0 = __floats2bfloat162_rn(b.x, b.y), b1 = __floats2bfloat162_rn(b.z, b.w);
                uint2 ua, ub;
                ua.x = *(const uint32_t *)&a0, ua.y = *(const uint32_t *)&a1;
                ub.x = *(const uint32_t *)&b0, ub.y = *(const uint32_t *)&b1;
                ((uint2 *)dk)[c] = ua;
                ((uint2 *)dv)[c] = ub;
            }
        }
    } else {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            if constexpr (sizeof(T) == 4) {
                dk[c] = __ldg(sk + c);
                dv[c] = __ldg(sv + c);
            } else {
                dk[c] = __float2bfloat16_rn(__ldg(sk + c));
                dv[c] = __float2bfloat16_rn(__ldg(sv + c));
            }
        }
    }
}

/* One (slot, head) row of hd values: its scale and bytes, by one warp. */
ST_DEV void kv_store_fp8_row(uint8_t *dst, float *scale, const float *x, int hd, int lane) {
    float mx = 0.0f;
    for (int d = lane; d < hd; d += 32) mx = fmaxf(mx, fabsf(__ldg(x + d)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sc = __fdiv_rn(mx, 448.0f);
    if (sc == 0.0f) sc = 1.0f;
    if (lane == 0) *scale = sc;
    for (int d = lane; d < hd; d += 32)
        dst[d] = (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(__ldg(x + d), sc), __NV_SATFINITE, __NV_E4M3);
}

/* fp8: grid (n), 128 threads; warp w takes heads w, w + 4, ... of the token. */
static __global__ void __launch_bounds__(128)
    kv_store_paged_fp8_kernel(uint8_t *__restrict__ kc, uint8_t *__restrict__ vc, float *__restrict__ ks,
                              float *__restrict__ vs, int64_t n_slots, const float *__restrict__ k,
                              const float *__restrict__ v, const int64_t *__restrict__ slots, int H, int hd) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int64_t r = __ldg((const long long *)slots + i);
    if (r < 0 || r >= n_slots) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t cols = (int64_t)H * hd;
    for (int h = warp; h < H; h += 4) {
        const int64_t row = r * H + h;
        kv_store_fp8_row(kc + row * hd, ks + row, k + i * cols + (int64_t)h * hd, hd, lane);
        kv_store_fp8_row(vc + row * hd, vs + row, v + i * cols + (int64_t)h * hd, hd, lane);
    }
}

strata_status st_cuda_op_kv_store_paged(st_backend *be, st_cuda_stream *s, const st_kv_layer *c, const float *k,
                                        const float *v, const int64_t *slots, int64_t n) {
    const char *op = "cuda kv_store_paged";
    if (n > INT32_MAX || c->n_kv_heads > INT32_MAX || c->head_dim > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld, cache.n_kv_heads = %lld, cache.head_dim = %lld: too large",
                      op, (long long)n, (long long)c->n_kv_heads, (long long)c->head_dim);
    const size_t es = st_kv_dtype_size(c->dtype);
    if (!st_cuda_aligned(c->k, es) || !st_cuda_aligned(c->v, es))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache.k = %p / cache.v = %p are not %zu-byte aligned (%s)", op,
                      c->k, c->v, es, st_kv_dtype_name(c->dtype));
    if (c->dtype == ST_KV_FP8 && (!st_cuda_aligned(c->k_scale, 4) || !st_cuda_aligned(c->v_scale, 4)))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache.k_scale / cache.v_scale are not 4-byte aligned", op);
    const int64_t cols = c->n_kv_heads * c->head_dim;
    const bool pdl = st_cuda_of(be)->pdl;
    const bool vec = cols % 4 == 0 && st_cuda_aligned(c->k, 16) && st_cuda_aligned(c->v, 16) &&
                     st_cuda_aligned(k, 16) && st_cuda_aligned(v, 16);
    const int threads = cols >= 1024 ? 256 : 128;
    const dim3 grid((unsigned)n);
    switch (c->dtype) {
    case ST_KV_F32:
        if (vec)
            ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<float, true>, grid, dim3(threads), 0, s->s,
                                  (float *)c->k, (float *)c->v, c->n_slots, k, v, slots, cols));
        else
            ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<float, false>, grid, dim3(threads), 0, s->s,
                                  (float *)c->k, (float *)c->v, c->n_slots, k, v, slots, cols));
        break;
    case ST_KV_BF16:
        if (vec)
            ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<__nv_bfloat16, true>, grid, dim3(threads), 0, s->s,
                                  (__nv_bfloat16 *)c->k, (__nv_bfloat16 *)c->v, c->n_slots, k, v, slots, cols));
        else
            ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<__nv_bfloat16, false>, grid, dim3(threads), 0, s->s,
                                  (__nv_bfloat16 *)c->k, (__nv_bfloat16 *)c->v, c->n_slots, k, v, slots, cols));
        break;
    case ST_KV_FP8:
        ST_CUDA_TRY(st_launch(pdl, kv_store_paged_fp8_kernel, grid, dim3(128), 0, s->s, (uint8_t *)c->k,
                              (uint8_t *)c->v, c->k_scale, c->v_scale, c->n_slots, k, v, slots, (int)c->n_kv_heads,
                              (int)c->head_dim));
        break;
    }
    return STRATA_OK;
}

template <int KT>
static __global__ void __launch_bounds__(128)
    kv_gather_kernel(const void *__restrict__ kc, const void *__restrict__ vc, const float *__restrict__ ks,
                     const float *__restrict__ vs, int64_t n_slots, const int32_t *__restrict__ ids, int heads,
                     int hd, float *__restrict__ k, float *__restrict__ v) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x, cols = (int64_t)heads * hd;
    const int32_t id = __ldg(ids + i);
    for (int64_t d = threadIdx.x; d < cols; d += blockDim.x) {
        float a, b;
        if (id < 0 || id >= n_slots) {
            a = b = __int_as_float(0x7fc00000);
        } else {
            const size_t e = (size_t)id * cols + d;
            if constexpr (KT == ST_KV_F32) {
                a = __ldg((const float *)kc + e), b = __ldg((const float *)vc + e);
            } else if constexpr (KT == ST_KV_BF16) {
                a = __uint_as_float((uint32_t)__ldg((const unsigned short *)kc + e) << 16);
                b = __uint_as_float((uint32_t)__ldg((const unsigned short *)vc + e) << 16);
            } else {
                const int64_t r = (int64_t)id * heads + d / hd;
                const __nv_fp8_storage_t x = (__nv_fp8_storage_t)__ldg((const unsigned char *)kc + e);
                const __nv_fp8_storage_t y = (__nv_fp8_storage_t)__ldg((const unsigned char *)vc + e);
                a = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(x, __NV_E4M3))), __ldg(ks + r));
                b = __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(y, __NV_E4M3))), __ldg(vs + r));
            }
        }
        k[i * cols + d] = a;
        v[i * cols + d] = b;
    }
}

strata_status st_cuda_op_kv_gather(st_backend *be, st_cuda_stream *s, const st_kv_layer *c, const int32_t *ids,
                                   int64_t n, float *k, float *v) {
    if (n > INT32_MAX || c->n_kv_heads > INT32_MAX || c->head_dim > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda kv_gather: n = %lld is too large", (long long)n);
    const size_t es = st_kv_dtype_size(c->dtype);
    if (!st_cuda_aligned(c->k, es) || !st_cuda_aligned(c->v, es))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda kv_gather: cache.k / cache.v are not %zu-byte aligned", es);
    const bool pdl = st_cuda_of(be)->pdl;
    const dim3 grid((unsigned)n);
    const int H = (int)c->n_kv_heads, hd = (int)c->head_dim;
    switch (c->dtype) {
    case ST_KV_F32:
        ST_CUDA_TRY(st_launch(pdl, kv_gather_kernel<ST_KV_F32>, grid, dim3(128), 0, s->s, (const void *)c->k,
                              (const void *)c->v, (const float *)nullptr, (const float *)nullptr, c->n_slots, ids, H,
                              hd, k, v));
        break;
    case ST_KV_BF16:
        ST_CUDA_TRY(st_launch(pdl, kv_gather_kernel<ST_KV_BF16>, grid, dim3(128), 0, s->s, (const void *)c->k,
                              (const void *)c->v, (const float *)nullptr, (const float *)nullptr, c->n_slots, ids, H,
                              hd, k, v));
        break;
    case ST_KV_FP8:
        ST_CUDA_TRY(st_launch(pdl, kv_gather_kernel<ST_KV_FP8>, grid, dim3(128), 0, s->s, (const void *)c->k,
                              (const void *)c->v, (const float *)c->k_scale, (const float *)c->v_scale, c->n_slots,
                              ids, H, hd, k, v));
        break;
    }
    return STRATA_OK;
}

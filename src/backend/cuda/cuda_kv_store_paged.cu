/* kv_store_paged: k_cache[slots[i], :] = k[i, :], v_cache[slots[i], :] = v[i, :]
 * for i < n (backend.h): a batch's K/V rows written into one layer's paged
 * pool at the slots the scheduler chose. One block per token; 16-byte
 * vectors when cols % 4 == 0 and every pointer is 16-byte aligned. A slot
 * of -1 skips its token; a slot outside [0, n_slots) (the slots live on the
 * device, so the host cannot check them) is skipped too. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

template <bool VEC>
static __global__ void __launch_bounds__(256)
    kv_store_paged_kernel(float *__restrict__ kc, float *__restrict__ vc, int64_t n_slots, const float *__restrict__ k,
                          const float *__restrict__ v, const int64_t *__restrict__ slots, int64_t cols) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int64_t r = __ldg((const long long *)slots + i);
    if (r < 0 || r >= n_slots) return;
    float *dk = kc + r * cols, *dv = vc + r * cols;
    const float *sk = k + i * cols, *sv = v + i * cols;
    if constexpr (VEC) {
        for (int64_t c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            ((float4 *)dk)[c] = __ldg((const float4 *)sk + c);
            ((float4 *)dv)[c] = __ldg((const float4 *)sv + c);
        }
    } else {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            dk[c] = __ldg(sk + c);
            dv[c] = __ldg(sv + c);
        }
    }
}

strata_status st_cuda_op_kv_store_paged(st_backend *be, st_cuda_stream *s, float *k_cache, float *v_cache,
                                        int64_t n_slots, const float *k, const float *v, const int64_t *slots,
                                        int64_t n, int64_t cols) {
    if (n > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda kv_store_paged: n = %lld is too large", (long long)n);
    const bool vec = cols % 4 == 0 && st_cuda_aligned(k_cache, 16) && st_cuda_aligned(v_cache, 16) &&
                     st_cuda_aligned(k, 16) && st_cuda_aligned(v, 16);
    const int threads = cols >= 1024 ? 256 : 128;
    const bool pdl = st_cuda_of(be)->pdl;
    if (vec)
        ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<true>, dim3((unsigned)n), dim3(threads), 0, s->s, k_cache,
                              v_cache, n_slots, k, v, slots, cols));
    else
        ST_CUDA_TRY(st_launch(pdl, kv_store_paged_kernel<false>, dim3((unsigned)n), dim3(threads), 0, s->s, k_cache,
                              v_cache, n_slots, k, v, slots, cols));
    return STRATA_OK;
}

/* set_rows: dst[idx[i], :] = src[i, :] for i < n, rows of `cols` floats (the
 * KV cache written at positions held on the device, so that a recorded
 * decode step stays valid as the sequence grows). One block per source row;
 * 16-byte vectors when cols % 4 == 0 and both pointers are 16-byte aligned.
 * An index outside [0, dst_rows) skips its row (indices live on the device,
 * so the host cannot check them). */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

template <bool VEC>
static __global__ void __launch_bounds__(256) set_rows_kernel(float *__restrict__ dst, int64_t dst_rows,
                                                              const float *__restrict__ src,
                                                              const int32_t *__restrict__ idx, int64_t cols) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int32_t r = __ldg(idx + i);
    if (r < 0 || r >= dst_rows) return;
    float *d = dst + (int64_t)r * cols;
    const float *s = src + i * cols;
    if constexpr (VEC) {
        for (int64_t c = threadIdx.x; c < cols / 4; c += blockDim.x)
            ((float4 *)d)[c] = __ldg((const float4 *)s + c);
    } else {
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) d[c] = __ldg(s + c);
    }
}

strata_status st_cuda_op_set_rows(st_backend *be, st_cuda_stream *s, float *dst, int64_t dst_rows,
                                  const float *src, const int32_t *idx, int64_t n, int64_t cols) {
    if (n > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda set_rows: n = %lld is too large", (long long)n);
    const bool vec = cols % 4 == 0 && st_cuda_aligned(dst, 16) && st_cuda_aligned(src, 16);
    const int threads = cols >= 1024 ? 256 : 128;
    const bool pdl = st_cuda_of(be)->pdl;
    if (vec) ST_CUDA_TRY(st_launch(pdl, set_rows_kernel<true>, dim3((unsigned)n), dim3(threads), 0, s->s, dst, dst_rows,
                                   src, idx, cols));
    else ST_CUDA_TRY(st_launch(pdl, set_rows_kernel<false>, dim3((unsigned)n), dim3(threads), 0, s->s, dst, dst_rows,
                               src, idx, cols));
    return STRATA_OK;
}

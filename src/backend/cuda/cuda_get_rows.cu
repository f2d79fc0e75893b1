/* get_rows: out[i, :] = dequant(w[ids[i], :]) for i < n (embedding lookup).
 * One block per output row; each thread decodes 8 elements at a time
 * (st_dq8: bit-exact with core/quant.c), or one at a time for plain types
 * whose rows are not a multiple of 8 elements. An id outside [0, w.rows)
 * (ids live in device memory, so they cannot be checked on the host) yields a
 * row of NaN, never an out-of-bounds read. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

template <int T, bool VEC>
static __global__ void __launch_bounds__(256) get_rows_kernel(const uint8_t *__restrict__ w, size_t row_bytes,
                                                              int64_t rows, int64_t cols,
                                                              const int32_t *__restrict__ ids,
                                                              float *__restrict__ out) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = blockIdx.x;
    const int32_t id = __ldg(ids + i);
    float *o = out + i * cols;
    if (id < 0 || id >= rows) {
        for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) o[k] = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t *row = w + (size_t)id * row_bytes;
    if constexpr (VEC) {
        /* out rows are 16-byte aligned here (checked by the launcher) */
        for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
            float v[8];
            st_dq8<T>(row, c, v);
            float4 *p = (float4 *)(o + 8 * c);
            p[0] = make_float4(v[0], v[1], v[2], v[3]);
            p[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
    } else {
        for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) o[k] = st_dq1<T>(row, k);
    }
}

template <int T>
static strata_status launch_get_rows(cudaStream_t s, bool pdl, const st_weight *w, const int32_t *ids, int64_t n,
                                     float *out) {
    const size_t rb = st_dtype_row_bytes(w->dtype, w->cols);
    const bool vec = w->cols % 8 == 0 && st_cuda_aligned(out, 16);
    const int threads = w->cols >= 2048 ? 256 : 128;
    if (vec) {
        ST_CUDA_TRY(st_launch(pdl, get_rows_kernel<T, true>, dim3((unsigned)n), dim3(threads), 0, s,
                              (const uint8_t *)w->data, rb, w->rows, w->cols, ids, out));
    } else {
        ST_CUDA_TRY(st_launch(pdl, get_rows_kernel<T, false>, dim3((unsigned)n), dim3(threads), 0, s,
                              (const uint8_t *)w->data, rb, w->rows, w->cols, ids, out));
    }
    ST_CUDA_LAUNCHED("get_rows_kernel");
    return STRATA_OK;
}

strata_status st_cuda_op_get_rows(st_backend *be, st_cuda_stream *s, const st_weight *w,
                                  const int32_t *ids, int64_t n, float *out) {
    if (n > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda get_rows: n = %lld is too large", (long long)n);
    ST_DTYPE_SWITCH(w->dtype, T, return launch_get_rows<T>(s->s, st_cuda_of(be)->pdl, w, ids, n, out));
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda get_rows: dtype %s", st_dtype_name(w->dtype));
}

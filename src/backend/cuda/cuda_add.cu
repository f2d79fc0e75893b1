/* add: x[i] += y[i] for i < n. 16-byte vectors when both pointers allow,
 * a grid-stride loop. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

template <bool VEC>
static __global__ void __launch_bounds__(256) add_kernel(float *x, const float *y, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        const int64_t n4 = n / 4;
        for (int64_t i = t; i < n4; i += stride) {
            float4 a = ((float4 *)x)[i];
            const float4 b = ((const float4 *)y)[i];
            a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
            ((float4 *)x)[i] = a;
        }
        for (int64_t i = 4 * n4 + t; i < n; i += stride) x[i] += y[i];
    } else {
        for (int64_t i = t; i < n; i += stride) x[i] += y[i];
    }
}

strata_status st_cuda_op_add(st_backend *be, st_cuda_stream *s, float *x, const float *y, int64_t n) {
    const bool vec = st_cuda_aligned(x, 16) && st_cuda_aligned(y, 16);
    const unsigned blocks = st_grid_for(vec ? (n + 3) / 4 : n, 256, (int64_t)st_cuda_of(be)->sm_count * 16);
    if (vec) add_kernel<true><<<blocks, 256, 0, s->s>>>(x, y, n);
    else add_kernel<false><<<blocks, 256, 0, s->s>>>(x, y, n);
    ST_CUDA_LAUNCHED("add_kernel");
    return STRATA_OK;
}

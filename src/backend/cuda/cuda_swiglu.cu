/* swiglu: out[i] = silu(gate[i]) * up[i] = (g / (1 + exp(-g))) * up[i],
 * fp32 with IEEE division and expf (as the CPU backend). out may alias gate
 * or up. 16-byte vectors when all three pointers allow, a grid-stride loop. */
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"


template <bool VEC>
static __global__ void __launch_bounds__(256) swiglu_kernel(const float *gate, const float *up, int64_t n,
                                                            float *out) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if constexpr (VEC) {
        const int64_t n4 = n / 4;
        for (int64_t i = t; i < n4; i += stride) {
            const float4 g = ((const float4 *)gate)[i], u = ((const float4 *)up)[i];
            ((float4 *)out)[i] = make_float4(st_silu_mul(g.x, u.x), st_silu_mul(g.y, u.y), st_silu_mul(g.z, u.z),
                                             st_silu_mul(g.w, u.w));
        }
        for (int64_t i = 4 * n4 + t; i < n; i += stride) out[i] = st_silu_mul(gate[i], up[i]);
    } else {
        for (int64_t i = t; i < n; i += stride) out[i] = st_silu_mul(gate[i], up[i]);
    }
}

strata_status st_cuda_op_swiglu(st_backend *be, st_cuda_stream *s, const float *gate, const float *up,
                                int64_t n, float *out) {
    const bool vec = st_cuda_aligned(gate, 16) && st_cuda_aligned(up, 16) && st_cuda_aligned(out, 16);
    const unsigned blocks = st_grid_for(vec ? (n + 3) / 4 : n, 256, (int64_t)st_cuda_of(be)->sm_count * 16);
    if (vec) swiglu_kernel<true><<<blocks, 256, 0, s->s>>>(gate, up, n, out);
    else swiglu_kernel<false><<<blocks, 256, 0, s->s>>>(gate, up, n, out);
    ST_CUDA_LAUNCHED("swiglu_kernel");
    return STRATA_OK;
}

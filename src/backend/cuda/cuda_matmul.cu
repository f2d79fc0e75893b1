/* matmul: y[n, N] = x[n, K] @ w[N, K]^T, x and y fp32 row-major, w any dtype;
 * also matmul_multi (several weights, one x) and matmul_swiglu (gate, up and
 * SwiGLU in one op), backend.h.
 *
 * Paths (chosen per call):
 *   GEMV, staged (default; cuda_gemv.cu): bf16, f16, q8_0, q4_0, q4_1 and q4_k
 *     weights whose rows are a multiple of 16 bytes (all real model shapes),
 *     same n limits as below: weight bytes copied to shared memory with
 *     coalesced 16-byte cp.async several stages ahead (the first ones before
 *     the PDL wait), block scales factored out of the dot products. The
 *     kernel below stays for the other cases (f32, q8_0, where it is faster,
 *     and other quantized types; rows not a multiple of 16 bytes).
 *   GEMV, int8 (fast mode: set_fast_prefill; cuda_gemv.cu): q4_0, q4_1, q4_k,
 *     and q8_0 from 2 tokens, rows of 16-byte multiples: x quantized once per
 *     call to int8 per 32-block (scratch slot XQ), dp4a against the packed
 *     weights; ~4e-3 of max|y| from the fp32 result, several tokens per pass
 *     at a fraction of the fp32 kernel's cost (bench/RESULTS.md).
 *   MMQ, int8 tensor cores (fast mode; cuda_mmq.cu): q8_0, q4_0, q4_1, q4_k,
 *     q6_k rows of 16-byte multiples, K % 128 == 0, n within [mmq_min_n,
 *     mmq_max_n] (MMQ_MIN_N, MMQ_MAX_N below, from bench_cuda_ops --only mmq):
 *     x quantized as for the int8 GEMV (plus block sums for q4_1 / q4_k),
 *     mma.sync m16n8k32 s8 on the weights' integers in their GGUF layout,
 *     each weight block loaded once for all of a tile's tokens. Also
 *     matmul_multi and matmul_swiglu (SwiGLU in its epilogue).
 *   GEMV (n <= 8 for f32/f16/bf16, n <= 32 for quantized types): a custom
 *     kernel that reads each weight row once at HBM speed and decodes it in
 *     registers (st_unit: 8 to 32 elements per thread, packed bytes loaded
 *     with the widest loads the layout allows, exact rounding), accumulating
 *     in fp32 against fp32 x. A block of up to 128 threads splits R rows
 *     (4 or 8) along K and adds the partial sums; up to 8 tokens per pass
 *     (grid.y covers more). x stays in L1 and is re-read once per R rows,
 *     which is what limits several tokens per pass. No rounding of x.
 *     One launch can cover several weights of one dtype and K (matmul_multi:
 *     q, k and v; the blocks are split between them), or the gate and up
 *     rows of matmul_swiglu together (each block does R rows of both and
 *     writes silu(gate) * up: the gate/up results never reach memory).
 *     Measured on an H200 (bench/bench_cuda_ops.c, copy roofline 4.2 TB/s):
 *     bf16 14336x4096 n=1 at 3.8 TB/s (89%), 4096x4096 at 66%, n=4 50%,
 *     n=8 30%; q8_0 61%, q6_k 40%, q4_0 38%, q4_k 31% of the roofline in
 *     weight bytes (the quantized ones are bound by x traffic and decoding,
 *     yet 1.2 to 1.5x faster than bf16 per token); gate + up with SwiGLU
 *     (2 x 14336x4096 bf16) 66 us, 85%. Launched with PDL (cuda_common.cuh).
 *     Error against the CPU backend ~2e-7.
 *   GEMM, f32 weights (n >= GEMM_MIN_N = 4): cuBLASLt with fp32 inputs and CUBLAS_COMPUTE_32F
 *     (no TF32): fp32 accuracy.
 *   GEMM, bf16 weights (n >= 4), default ("precise"): x is split into
 *     x_hi = bf16(x) and x_lo = bf16(x - x_hi), and the tensor cores compute
 *     W x_hi + W x_lo in fp32: up to STACK_MAX_N tokens as ONE cuBLASLt GEMM
 *     over the stacked [x_hi; x_lo] (2n columns, so a decode batch reads the
 *     weights once) whose halves stack_sum_kernel adds; above, two GEMMs (the
 *     second with beta = 1). Same rounding either way (one fp32 add). x_hi + x_lo carries 16 significant bits of x (relative
 *     error <= 2^-17 per element instead of 2^-9), the weight is exact, so the
 *     result is within ~1e-5 of the fp32 GEMV, at twice the tensor-core work.
 *     Measured against the CPU backend: 2e-6 to 7e-6, which is what the
 *     tensor cores' own fp32 accumulation leaves (it truncates: ~2^-24 per
 *     k-step of 4 products, biased toward zero), not the split.
 *   GEMM, f16 and quantized weights (n >= 4, or n >= 12 quantized), precise: the weight is
 *     dequantized exactly (fp32), split the same way into w_hi + w_lo (exact
 *     for f16; <= 2^-17 relative residue for the scale * q products of
 *     quantized blocks), a slab of rows at a time into scratch (<= 64 MiB),
 *     laid out as rows [w_hi | w_lo | w_hi] (3K) against x rows
 *     [x_hi | x_hi | x_lo]: one GEMM with 3K sums w_hi x_hi + w_lo x_hi +
 *     w_hi x_lo (the dropped w_lo x_lo is ~2^-18 of the product), then the
 *     slab's columns of y are done. Three times the tensor-core work.
 *   GEMM, fast mode (set_fast_prefill): x rounded to bf16 once, f16/quantized
 *     weights dequantized to bf16 once, one GEMM: relative errors ~1e-2
 *     against fp32 math (enough to flip the argmax of random test models whose
 *     top-2 logits are within 1e-3); about half the time of the precise path.
 *     Measured on an H200, 14336x4096 bf16 weight x 2048 tokens: 738 TFLOP/s
 *     fast, 323-337 TFLOP/s of useful work precise; 512 tokens: 626 / 317;
 *     q8_0 at 512 tokens: 401 / 142 (dequantization + 3K-deep GEMM).
 *   Plain weights whose K is not a multiple of 8 (rows not 16-byte aligned):
 *     a scalar GEMV, any n (slow, correct; no real model has such shapes).
 *
 * In cuBLAS's column-major terms, y^T [N, n] = W [K, N]^T . x^T [K, n]:
 * A = W with op T (lda = K), B = x with op N (ldb = K), C = y (ldc = N), the
 * "TN" layout cuBLASLt is fastest at. Plans (descriptors, layouts and the
 * heuristic's algorithm) are cached per shape and pointer alignment. */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_gemv.cuh"
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mmq.cuh"

#define MMV_WARPS 4          /* scalar fallback: rows per block */
#define GEMM_MIN_N 4          /* plain weights: GEMV below this (H200: the GEMV wins at n <= 3, the precise GEMM from n = 4: 38 vs 38 us at n = 4, 38 vs 101 us at n = 8 for 14336 x 4096) */
#define GEMM_MIN_N_QUANT 12   /* quantized weights: GEMV below this (dequantize + GEMM costs ~240 us for 14336 x 4096 at any n; the GEMV 155 us at n = 8, 306 us at n = 16) */
/* Fast mode, quantized weights (q8_0, q4_0, q4_1, q4_k): token counts that
 * take the int8 tensor-core kernel (cuda_mmq.cu) instead of the int8 GEMV
 * below and the dequantize + GEMM above (st_backend_params.mmq_min_n,
 * mmq_max_n), from bench_cuda_ops --only mmq on an H200 (8B shapes, q4_0 /
 * q8_0 / q4_1 / q4_k alike; bench/RESULTS.md, seventh session): at 4 tokens
 * the GEMV wins everywhere (q4_0 14336 x 4096: 25.9 vs 27.9 us), at 8 the
 * MMQ on every shape of 4096 rows or more (32.6 vs 43.0; 4096 x 14336 30.5
 * vs 41.8; 1024 x 4096 alone keeps the GEMV, 8.0 vs 9.0, but the model
 * fuses it with q), and from 5 tokens the GEMV already runs its 8-token
 * kernel while the MMQ's 8-token tile costs the same for 5 as for 8. Up to
 * 32 tokens the MMQ beats dequantize + GEMM on every shape (4096 x 4096 21.7
 * vs 30.9 us); at 64 it did only on launches of 8192 rows or more (14336 x
 * 4096 56.9 vs 95.1; 4096 rows: 34.4 vs 29.5, 64 blocks for 132 SMs) until
 * launches of fewer than two blocks per SM split K (cuda_mmq.cu,
 * mq_slices; fifteenth session: bench/RESULTS.md); at 128 on none (109.8 vs
 * 98.3). */
#define MMQ_MIN_N 5
#define MMQ_MAX_N 64
#define DQ_SLAB_BYTES ((size_t)64 << 20)
/* precise bf16 GEMMs with at most this many tokens run as ONE GEMM over the
 * stacked [x_hi; x_lo] (2n columns), so the weights are read once per step
 * (decode batches), instead of two GEMMs that each read them */
#define STACK_MAX_N 256
#define STACK_SLAB_BYTES ((size_t)32 << 20) /* fp32 [2n, rows] partial results per slab */
#define LT_WS_BYTES ((size_t)32 << 20)
#define LT_PLANS 64
#define MMV_MAX_W ST_GEMV_MAX_W /* weights one GEMV launch covers */

/* ---- GEMV ---------------------------------------------------------------------- */


/* One launch's weights (cuda_gemv.cuh): weight i owns blocks [b0[i], b0[i+1])
 * and writes y[i] (row stride N[i]). In SwiGLU mode w[0] is the gate, w[1]
 * the up projection, and every block covers rows of both. */
typedef st_gemv_args mmv_args;

/* Block b computes rows [R b', +R) (b' its index within its weight) for
 * tokens [NT by, +NT); its threads split the row into units (st_unit<T>) and
 * the block adds their partial sums. SW: RR = 2R row slots, gate then up. */
template <int T, int NT, int R, bool SW>
static __global__ void __launch_bounds__(128) mmv_kernel(const mmv_args a) {
    using Q = st_unit<T>;
    constexpr int RR = SW ? 2 * R : R;
    __shared__ float red[4][RR * NT];
    st_pdl_wait();
    st_pdl_trigger();
    /* this block's weight (compile-time indices only: the args stay in the parameter bank) */
    const uint8_t *w = a.w[0];
    float *y = a.y[0];
    int64_t N = a.N[0];
    unsigned b0 = 0;
    if (!SW) {
#pragma unroll
        for (int i = 1; i < MMV_MAX_W; i++)
            if (i < a.count && blockIdx.x >= a.b0[i]) w = a.w[i], y = a.y[i], N = a.N[i], b0 = a.b0[i];
    }
    const int64_t K = a.K;
    const int64_t row0 = (int64_t)(blockIdx.x - b0) * R;
    const int64_t t0 = (int64_t)blockIdx.y * NT;
    const int nt = (int)min((int64_t)NT, a.n - t0);
    const int nu = (int)(K / Q::U);
    const float *xt = a.x + t0 * K;
    const uint8_t *wr[RR];
#pragma unroll
    for (int r = 0; r < R; r++) {
        wr[r] = w + (size_t)min(row0 + r, N - 1) * a.rb;
        if (SW) wr[R + r] = a.w[1] + (size_t)min(row0 + r, N - 1) * a.rb;
    }
    float acc[RR][NT];
#pragma unroll
    for (int r = 0; r < RR; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

#pragma unroll 2
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
        typename Q::raw raw[RR];
#pragma unroll
        for (int r = 0; r < RR; r++) raw[r] = Q::load(wr[r], u);
#pragma unroll
        for (int j = 0; j < Q::RUNS; j++) {
            float v[RR][8];
#pragma unroll
            for (int r = 0; r < RR; r++) Q::expand(raw[r], j, v[r]);
            const int64_t e = Q::run_start(u, j);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const float4 *xp = (const float4 *)(xt + (int64_t)t * K + e);
                    const float4 p = __ldg(xp), q = __ldg(xp + 1);
#pragma unroll
                    for (int r = 0; r < RR; r++) {
                        float s = acc[r][t];
                        s = fmaf(v[r][0], p.x, s);
                        s = fmaf(v[r][1], p.y, s);
                        s = fmaf(v[r][2], p.z, s);
                        s = fmaf(v[r][3], p.w, s);
                        s = fmaf(v[r][4], q.x, s);
                        s = fmaf(v[r][5], q.y, s);
                        s = fmaf(v[r][6], q.z, s);
                        s = fmaf(v[r][7], q.w, s);
                        acc[r][t] = s;
                    }
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < RR; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const float v = st_warp_sum(acc[r][t]);
            if (lane == 0) red[warp][r * NT + t] = v;
        }
    __syncthreads();
    if (threadIdx.x < R * NT) {
        const int r = threadIdx.x / NT, t = threadIdx.x % NT;
        float v = red[0][threadIdx.x];
        for (int i = 1; i < nw; i++) v += red[i][threadIdx.x];
        if (SW) {
            float u = red[0][(R + r) * NT + t];
            for (int i = 1; i < nw; i++) u += red[i][(R + r) * NT + t];
            v = st_silu_mul(v, u);
        }
        if (t < nt && row0 + r < N) y[(t0 + t) * N + row0 + r] = v;
    }
}

/* Scalar fallback for plain types: one warp per row, 8 tokens per grid.y. */
template <int T>
static __global__ void __launch_bounds__(MMV_WARPS * 32)
    mmv_scalar_kernel(const uint8_t *__restrict__ w, size_t rb, int64_t N, int64_t K,
                      const float *__restrict__ x, int64_t n, float *__restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row = (int64_t)blockIdx.x * MMV_WARPS + warp;
    if (row >= N) return;
    const int64_t t0 = (int64_t)blockIdx.y * 8;
    const int nt = (int)min((int64_t)8, n - t0);
    const uint8_t *wr = w + (size_t)row * rb;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t k = lane; k < K; k += 32) {
        const float wv = st_dq1<T>(wr, k);
#pragma unroll
        for (int t = 0; t < 8; t++)
            if (t < nt) acc[t] = fmaf(wv, __ldg(x + (t0 + t) * K + k), acc[t]);
    }
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const float v = st_warp_sum(acc[t]);
        if (lane == 0 && t < nt) y[(t0 + t) * N + row] = v;
    }
}

/* Fills the block split of a (its w, y, N, count, rb, K, x, n set) for R rows
 * per block and launches. */
template <int T, int NT, int R, bool SW>
static strata_status launch_mmv(cudaStream_t s, bool pdl, mmv_args a) {
    int64_t blocks = 0;
    const int nw = SW ? 1 : a.count;
    for (int i = 0; i < nw; i++) {
        a.b0[i] = (unsigned)blocks;
        blocks += (a.N[i] + R - 1) / R;
    }
    const int64_t gy = (a.n + NT - 1) / NT;
    if (blocks > INT32_MAX || gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape too large");
    const int64_t nu = a.K / st_unit<T>::U;
    const int threads = nu >= 128 ? 128 : (int)((nu + 31) / 32 * 32);
    ST_CUDA_TRY(st_launch(pdl, mmv_kernel<T, NT, R, SW>, dim3((unsigned)blocks, (unsigned)gy), dim3(threads), 0, s, a));
    return STRATA_OK;
}

template <int T, bool SW>
static strata_status gemv_mmv(cudaStream_t s, bool pdl, const mmv_args &a) {
    /* R rows per block: x is re-read from L1 once per R rows, which bounds
     * the speed for several tokens; plain types have registers to spare.
     * SwiGLU blocks hold 2R rows, so R is halved where registers are short. */
    constexpr bool plain = T == ST_DTYPE_F32 || T == ST_DTYPE_F16 || T == ST_DTYPE_BF16;
    const int64_t n = a.n;
    if (n == 1) return launch_mmv<T, 1, 4, SW>(s, pdl, a);
    if (n == 2) return launch_mmv<T, 2, 4, SW>(s, pdl, a);
    if (n <= 4) return launch_mmv<T, 4, (plain && !SW) ? 8 : 4, SW>(s, pdl, a);
    return launch_mmv<T, 8, SW ? 2 : 4, SW>(s, pdl, a); /* R = 8 here spills (measured slower) */
}

template <int T>
static strata_status gemv_scalar(cudaStream_t s, const st_weight *w, const float *x, int64_t n, float *y) {
    const size_t rb = st_dtype_row_bytes(w->dtype, w->cols);
    const int64_t gx = (w->rows + MMV_WARPS - 1) / MMV_WARPS, gy = (n + 7) / 8;
    if (gx > INT32_MAX || gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape too large");
    mmv_scalar_kernel<T><<<dim3((unsigned)gx, (unsigned)gy), MMV_WARPS * 32, 0, s>>>(
        (const uint8_t *)w->data, rb, w->rows, w->cols, x, n, y);
    ST_CUDA_LAUNCHED("mmv_scalar_kernel");
    return STRATA_OK;
}

/* ---- conversions to bf16 for the GEMM path ---------------------------------------- */

ST_DEV uint32_t pack_bf16x2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b); /* a in the low half */
    return *(const uint32_t *)&h;
}

/* bf16 hi/lo split: hi = bf16(v), lo = bf16(v - hi) (v - hi is exact in fp32). */
ST_DEV void split8(const float v[8], uint4 &hi, uint4 &lo) {
    float h[8], l[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        h[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
        l[i] = __fsub_rn(v[i], h[i]);
    }
    hi = make_uint4(pack_bf16x2(h[0], h[1]), pack_bf16x2(h[2], h[3]), pack_bf16x2(h[4], h[5]), pack_bf16x2(h[6], h[7]));
    lo = make_uint4(pack_bf16x2(l[0], l[1]), pack_bf16x2(l[2], l[3]), pack_bf16x2(l[4], l[5]), pack_bf16x2(l[6], l[7]));
}

/* Layouts of converted activations, per token row of K elements:
 *   XL_HI:    out [n, K] = hi                               (fast mode)
 *   XL_PLANES: out [n, K] = hi, then a second plane [n, K] = lo (bf16 weights)
 *   XL_CAT3:  out [n, 3K] = [hi | hi | lo]                   (split weights) */
enum { XL_HI = 0, XL_PLANES = 1, XL_CAT3 = 2 };

/* x [n, K] fp32 (16-byte aligned, K % 8 == 0) -> bf16 in layout L. */
template <int L>
static __global__ void __launch_bounds__(256) x_to_bf16_kernel(const float *__restrict__ x, int64_t n, int64_t K,
                                                              __nv_bfloat16 *__restrict__ out) {
    const int64_t nc = K / 8, total = n * nc;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const float4 a = __ldg((const float4 *)x + 2 * i), b = __ldg((const float4 *)x + 2 * i + 1);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        uint4 hi, lo;
        split8(v, hi, lo);
        if (L == XL_HI || L == XL_PLANES) {
            ((uint4 *)out)[i] = hi;
            if (L == XL_PLANES) ((uint4 *)(out + n * K))[i] = lo;
        } else {
            const int64_t t = i / nc, c = i % nc;
            uint4 *row = (uint4 *)(out + t * 3 * K);
            row[c] = hi;
            row[nc + c] = hi;
            row[2 * nc + c] = lo;
        }
    }
}

/* y[t, r0 + r] = s[t, r] + s[n + t, r] for t < n, r < rows: the hi and lo
 * halves of a stacked GEMM (s: [2n, rows]) summed into columns of y (row
 * stride ldy). One rounding, as the beta = 1 epilogue of the two-GEMM path.
 * grid (x over the row, y = t); VEC: float4 (rows and ldy multiples of 4,
 * s and y 16-byte aligned). */
template <bool VEC>
static __global__ void __launch_bounds__(256) stack_sum_kernel(const float *__restrict__ s, int64_t n, int64_t rows,
                                                              float *__restrict__ y, int64_t ldy) {
    const int64_t t = blockIdx.y;
    const float *hi = s + t * rows, *lo = s + (n + t) * rows;
    float *dst = y + t * ldy;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    if (VEC) {
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows / 4; i += stride) {
            const float4 a = ((const float4 *)hi)[i], b = ((const float4 *)lo)[i];
            ((float4 *)dst)[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
    } else {
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += stride) dst[i] = hi[i] + lo[i];
    }
}

/* Weight rows [r0, r0 + rows) dequantized exactly, then as bf16: SPLIT: rows
 * of 3K = [hi | lo | hi]; else rows of K = bf16(w). K % 8 == 0. */
template <int T, bool SPLIT>
static __global__ void __launch_bounds__(256) dq_to_bf16_kernel(const uint8_t *__restrict__ w, size_t rb,
                                                               int64_t rows, int64_t K,
                                                               __nv_bfloat16 *__restrict__ out) {
    const int64_t nc = K / 8, total = rows * nc;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / nc, c = i % nc;
        float v[8];
        st_dq8<T>(w + (size_t)r * rb, c, v);
        uint4 hi, lo;
        split8(v, hi, lo);
        if (SPLIT) {
            uint4 *row = (uint4 *)(out + r * 3 * K);
            row[c] = hi;
            row[nc + c] = lo;
            row[2 * nc + c] = hi;
        } else {
            ((uint4 *)(out + r * K))[c] = hi;
        }
    }
}

/* ---- cuBLASLt plans ---------------------------------------------------------------- */

typedef struct {
    bool used;
    cudaDataType_t ab; /* type of A and B */
    int64_t m, n, k, ldc;
    uint32_t align_a, align_b, align_c;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} lt_plan;

struct st_cuda_lt_cache {
    lt_plan plans[LT_PLANS];
    int next_evict;
    st_gemv2_tune gemv2; /* the staged GEMV's grid sizing */
    int gemm_min_n, gemm_min_n_quant; /* token counts from which GEMMs replace the GEMV
                                         (st_backend_params; 0 there: GEMM_MIN_N, GEMM_MIN_N_QUANT) */
    int mmq_min_n, mmq_max_n;         /* fast mode: token counts of the MMQ kernels (st_backend_params;
                                         0 there: MMQ_MIN_N, MMQ_MAX_N; max -1: none) */
    int gemv1_rows;                   /* st_backend_params.gemv1_rows */
};

static void plan_clear(lt_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    memset(p, 0, sizeof *p);
}

strata_status st_cuda_matmul_setup(st_cuda *c, const st_backend_params *params) {
    c->lt_cache = (st_cuda_lt_cache *)st_calloc(1, sizeof *c->lt_cache);
    if (!c->lt_cache)
        return st_err(STRATA_ERR_NOMEM, "cuda matmul: out of memory for the cuBLASLt plan cache (%zu bytes)",
                      sizeof *c->lt_cache);
    /* params may move the switch points (tuning, benchmarks); checked by st_backend_cuda_init */
    c->lt_cache->gemm_min_n = params->gemm_min_n >= 2 ? params->gemm_min_n : GEMM_MIN_N;
    c->lt_cache->gemm_min_n_quant = params->gemm_min_n_quant >= 2 ? params->gemm_min_n_quant : GEMM_MIN_N_QUANT;
    c->lt_cache->mmq_min_n = params->mmq_min_n >= 1 ? params->mmq_min_n : MMQ_MIN_N;
    c->lt_cache->mmq_max_n = params->mmq_max_n < 0 ? 0 : params->mmq_max_n >= 1 ? params->mmq_max_n : MMQ_MAX_N;
    c->lt_cache->gemv1_rows = params->gemv1_rows;
    strata_status st = st_cuda_mmq_setup();
    if (st != STRATA_OK) return st;
    return st_cuda_gemv2_setup(&c->lt_cache->gemv2, c->sm_count);
}

void st_cuda_matmul_teardown(st_cuda *c) {
    if (!c->lt_cache) return;
    for (int i = 0; i < LT_PLANS; i++) plan_clear(&c->lt_cache->plans[i]);
    st_free(c->lt_cache);
    c->lt_cache = NULL;
}

static uint32_t align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

static strata_status plan_build(st_cuda *c, lt_plan *p) {
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    ST_CUBLAS_TRY(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    ST_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    ST_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    ST_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->la, p->ab, (uint64_t)p->k, (uint64_t)p->m, p->k));
    ST_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->lb, p->ab, (uint64_t)p->k, (uint64_t)p->n, p->k));
    ST_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, (uint64_t)p->m, (uint64_t)p->n, p->ldc));
    cublasLtMatmulPreference_t pref = NULL;
    ST_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = LT_WS_BYTES;
    cublasStatus_t e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            &ws, sizeof ws);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &p->align_a,
                                                 sizeof p->align_a);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &p->align_b,
                                                 sizeof p->align_b);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &p->align_c,
                                                 sizeof p->align_c);
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &p->align_c,
                                                 sizeof p->align_c);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (e == CUBLAS_STATUS_SUCCESS)
        e = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (e != CUBLAS_STATUS_SUCCESS)
        return st_err(STRATA_ERR_BACKEND, "cublasLt heuristic for a %lld x %lld x %lld GEMM failed: %s",
                      (long long)p->m, (long long)p->n, (long long)p->k, cublasLtGetStatusString(e));
    if (found < 1)
        return st_err(STRATA_ERR_UNSUPPORTED, "cublasLt has no algorithm for a %lld x %lld x %lld GEMM",
                      (long long)p->m, (long long)p->n, (long long)p->k);
    p->algo = res.algo;
    return STRATA_OK;
}

/* C[m, n] (col-major, ldc) = A[k, m]^T . B[k, n] + beta C, A and B of type ab. */
static strata_status lt_gemm(st_backend *be, st_cuda_stream *s, cudaDataType_t ab, const void *A, const void *B,
                             float *C, int64_t m, int64_t n, int64_t k, int64_t ldc, float beta) {
    st_cuda *c = st_cuda_of(be);
    void *ws = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_LT, LT_WS_BYTES, &ws);
    if (st != STRATA_OK) return st;
    const uint32_t aa = align_of(A), ab_ = align_of(B), ac = align_of(C);
    pthread_mutex_lock(&c->lt_mu);
    st_cuda_lt_cache *cache = c->lt_cache;
    lt_plan *p = NULL;
    for (int i = 0; i < LT_PLANS; i++) {
        lt_plan *q = &cache->plans[i];
        if (q->used && q->ab == ab && q->m == m && q->n == n && q->k == k && q->ldc == ldc && q->align_a == aa &&
            q->align_b == ab_ && q->align_c == ac) {
            p = q;
            break;
        }
    }
    if (!p) {
        for (int i = 0; i < LT_PLANS && !p; i++)
            if (!cache->plans[i].used) p = &cache->plans[i];
        if (!p) {
            p = &cache->plans[cache->next_evict];
            cache->next_evict = (cache->next_evict + 1) % LT_PLANS;
            plan_clear(p);
        }
        p->ab = ab, p->m = m, p->n = n, p->k = k, p->ldc = ldc;
        p->align_a = aa, p->align_b = ab_, p->align_c = ac;
        st = plan_build(c, p);
        if (st != STRATA_OK) {
            plan_clear(p);
            pthread_mutex_unlock(&c->lt_mu);
            return st;
        }
        p->used = true;
    }
    const float alpha = 1.0f;
    cublasStatus_t e = cublasLtMatmul(c->lt, p->op, &alpha, A, p->la, B, p->lb, &beta, C, p->lc, C, p->lc,
                                      &p->algo, ws, LT_WS_BYTES, s->s);
    pthread_mutex_unlock(&c->lt_mu);
    if (e != CUBLAS_STATUS_SUCCESS)
        return st_err(STRATA_ERR_BACKEND, "cublasLtMatmul(%lld x %lld x %lld) failed: %s at %s:%d in %s",
                      (long long)m, (long long)n, (long long)k, cublasLtGetStatusString(e), __FILE__, __LINE__,
                      __func__);
    return STRATA_OK;
}

/* ---- dispatch ------------------------------------------------------------------------ */

/* Fast mode, n within [mmq_min_n, mmq_max_n], a type and shape the MMQ
 * kernels take: the int8 tensor-core matmul. */
static bool use_mmq(const st_cuda *c, int dtype, size_t rb, int64_t K, int64_t n) {
    const st_cuda_lt_cache *l = c->lt_cache;
    return c->fast_prefill && n >= l->mmq_min_n && n <= l->mmq_max_n && st_cuda_mmq_supports(dtype, rb, K);
}

/* Rows per warp of the one-token int8 GEMV (cuda_gemv1.cu), 0 for the staged
 * kernel (st_backend_params.gemv1_rows -1). The rule, from bench_cuda_ops
 * --only gemv1 on an H100 (us for q|k|v / o / gate+up / down / LM head of
 * the 8B shape, rows 1 / 2 / 4 per warp): q4_0 13.8 / 9.7 / 29.8 / 22.8 /
 * 174.8, 10.2 / 7.9 / 28.1 / 18.4 / 105.4, 8.9 / 6.9 / 28.1 / 17.5 / 103.0
 * (the staged kernel 12.4 / 8.7 / 33.1 / 19.5 / 124.8); q4_1 and q4_k the
 * same order; q6_k 2 rows 14.9 / 10.4 / 44.4 / 27.7 / 171.1, 4 rows 13.0 /
 * 10.2 / 44.4 / 25.9 / 162.0 (the fp32 kernel 15.0 / 11.4 / 59.0 / 31.7 /
 * 216.9); q8_0 (34-byte blocks, twice the registers per row) 2 rows:
 * 14.4 / 10.6 / 47.3 / 29.4 / 194.6, 4 rows 14.6 / 11.0 / 47.5 / 29.3 /
 * 200.5. SwiGLU launches hold the gate and up rows: 4 means 2 of each. */
static int gemv1_rows(const st_cuda *c, int dtype) {
    const int p = c->lt_cache->gemv1_rows;
    if (p) return p < 0 ? 0 : p;
    return dtype == ST_DTYPE_Q8_0 ? 2 : 4;
}

/* a.xq, a.xd (and a.xs when sums) in the stream's XQ scratch, for x [a.n, a.K]. */
static strata_status xq_scratch(st_backend *be, st_cuda_stream *cs, bool sums, mmv_args *a) {
    const size_t qb = ((size_t)(a->n * a->K) + 15) / 16 * 16, db = (size_t)(a->n * (a->K / 32)) * 4;
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, cs, ST_CUDA_SCRATCH_XQ, qb + (sums ? 2 : 1) * db, &p);
    if (st != STRATA_OK) return st;
    a->xq = (const int8_t *)p;
    a->xd = (const float *)((uint8_t *)p + qb);
    a->xs = sums ? a->xd + db / 4 : NULL;
    return STRATA_OK;
}

/* The GEMV: the staged kernels (cuda_gemv.cu) where they apply (bf16, f16,
 * q4_0, q4_1, q4_k with 16-byte multiple rows: st_cuda_gemv2_supports), else
 * mmv_kernel above (f32, q8_0, the other quantized types, odd rows); in fast
 * mode the one-token int8 kernel (cuda_gemv1.cu) and, within the MMQ token
 * counts, the MMQ kernels (cuda_mmq.cu). */
template <int T, bool SW>
static strata_status gemv(st_backend *be, st_cuda_stream *cs, mmv_args a) {
    st_cuda *c = st_cuda_of(be);
    cudaStream_t s = cs->s;
    /* fast mode: x quantized to int8 once for every row (cuda_gemv.cu), one
     * token on the direct kernel (cuda_gemv1.cu) where K % 128 == 0; else not
     * q8_0 for one token, where the fp32 mmv kernel below is faster than the
     * staged int8 kernel (H100, 14336 x 4096: 25.6 vs 30.9 us) */
    const bool mmq = use_mmq(c, T, a.rb, a.K, a.n);
    const int g1 = c->fast_prefill && a.n == 1 && st_cuda_gemv1_supports(T, a.K) ? gemv1_rows(c, T) : 0;
    if (mmq || g1 ||
        (c->fast_prefill && st_cuda_gemv2_i8_supports(T, a.rb) && a.K % 32 == 0 && !(T == ST_DTYPE_Q8_0 && a.n == 1))) {
        const bool sums = (mmq && st_cuda_mmq_needs_sums(T)) || (g1 && st_cuda_gemv1_needs_sums(T));
        strata_status st = xq_scratch(be, cs, sums, &a);
        if (st != STRATA_OK) return st;
        if ((st = st_cuda_gemv2_quant_x(s, c->pdl, a.x, a.n, a.K, (int8_t *)a.xq, (float *)a.xd, (float *)a.xs)) !=
            STRATA_OK)
            return st;
        if (mmq) {
            const size_t pb = st_cuda_mmq_part_bytes(T, SW, a, c->sm_count);
            if (pb) {
                void *p = NULL;
                if ((st = st_cuda_scratch(be, cs, ST_CUDA_SCRATCH_MMQ, pb, &p)) != STRATA_OK) return st;
                a.part = (float *)p;
            }
            return st_cuda_mmq(s, c->pdl, T, SW, a, c->sm_count);
        }
        if (g1) return st_cuda_gemv1(s, c->pdl, T, SW, a, g1);
        return st_cuda_gemv2(s, c->pdl, T, SW, a, &c->lt_cache->gemv2);
    }
    if (st_cuda_gemv2_supports(T, a.rb)) return st_cuda_gemv2(s, c->pdl, T, SW, a, &c->lt_cache->gemv2);
    return gemv_mmv<T, SW>(s, c->pdl, a);
}

/* x [n, K] -> bf16 in scratch slot X, layout L (sizes: XL_HI n K, else 2 n K or 3 n K). */
template <int L>
static strata_status x_to_bf16(st_backend *be, st_cuda_stream *s, const float *x, int64_t n, int64_t K,
                               __nv_bfloat16 **out) {
    const size_t elems = (size_t)(n * K) * (L == XL_HI ? 1 : L == XL_PLANES ? 2 : 3);
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_X, elems * 2, &p);
    if (st != STRATA_OK) return st;
    x_to_bf16_kernel<L><<<st_grid_for(n * K / 8, 256, (int64_t)st_cuda_of(be)->sm_count * 8), 256, 0, s->s>>>(
        x, n, K, (__nv_bfloat16 *)p);
    ST_CUDA_LAUNCHED("x_to_bf16_kernel");
    *out = (__nv_bfloat16 *)p;
    return STRATA_OK;
}

/* One weight's GEMV arguments (count 1). */
static mmv_args mmv_one(const st_weight *w, const float *x, int64_t n, float *y) {
    mmv_args a;
    memset(&a, 0, sizeof a);
    a.w[0] = (const uint8_t *)w->data;
    a.y[0] = y;
    a.N[0] = w->rows;
    a.count = 1;
    a.rb = st_dtype_row_bytes(w->dtype, w->cols);
    a.K = w->cols;
    a.x = x;
    a.n = n;
    return a;
}

/* x with 16-byte aligned rows for the GEMV (a scratch copy when it is not). */
static strata_status gemv_x(st_backend *be, st_cuda_stream *s, const float *x, int64_t n, int64_t K,
                            const float **out) {
    *out = x;
    if (st_cuda_aligned(x, 16)) return STRATA_OK;
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_X, (size_t)(n * K) * 4, &p);
    if (st != STRATA_OK) return st;
    ST_CUDA_TRY(cudaMemcpyAsync(p, x, (size_t)(n * K) * 4, cudaMemcpyDeviceToDevice, s->s));
    *out = (const float *)p;
    return STRATA_OK;
}

/* The GEMV or the MMQ (both go by gemv()) rather than a GEMM. */
static bool use_gemv(const st_cuda *c, const st_weight *w, int64_t n) {
    return n < (st_dtype_get(w->dtype)->quantized ? c->lt_cache->gemm_min_n_quant : c->lt_cache->gemm_min_n) ||
           use_mmq(c, w->dtype, st_dtype_row_bytes(w->dtype, w->cols), w->cols, n);
}

template <int T>
static strata_status matmul_t(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w, int64_t n,
                              float *y) {
    const int64_t N = w->rows, K = w->cols;
    if (K % 8) {
        if (T == ST_DTYPE_F32 && !use_gemv(st_cuda_of(be), w, n)) return lt_gemm(be, s, CUDA_R_32F, w->data, x, y, N, n, K, N, 0.0f);
        return gemv_scalar<T>(s->s, w, x, n, y);
    }
    if (use_gemv(st_cuda_of(be), w, n)) {
        strata_status st = gemv_x(be, s, x, n, K, &x);
        if (st != STRATA_OK) return st;
        return gemv<T, false>(be, s, mmv_one(w, x, n, y));
    }
    if (T == ST_DTYPE_F32) return lt_gemm(be, s, CUDA_R_32F, w->data, x, y, N, n, K, N, 0.0f);
    if (!st_cuda_aligned(x, 16)) return gemv_scalar<T>(s->s, w, x, n, y); /* rare: the exact GEMV passes */
    const bool fast = st_cuda_of(be)->fast_prefill;
    __nv_bfloat16 *xb = NULL;
    strata_status st;

    if (T == ST_DTYPE_BF16) {
        if (fast) {
            if ((st = x_to_bf16<XL_HI>(be, s, x, n, K, &xb)) != STRATA_OK) return st;
            return lt_gemm(be, s, CUDA_R_16BF, w->data, xb, y, N, n, K, N, 0.0f);
        }
        if ((st = x_to_bf16<XL_PLANES>(be, s, x, n, K, &xb)) != STRATA_OK) return st;
        if (n <= STACK_MAX_N) { /* the planes as one [2n, K] operand: weights read once */
            int64_t slab = (int64_t)(STACK_SLAB_BYTES / ((size_t)n * 8)) / 64 * 64;
            if (slab < 64) slab = 64;
            if (slab > N) slab = N;
            void *sb = NULL;
            if ((st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_STACK, (size_t)(2 * n * slab) * 4, &sb)) != STRATA_OK)
                return st;
            const size_t rb = st_dtype_row_bytes(w->dtype, K);
            for (int64_t r0 = 0; r0 < N; r0 += slab) {
                const int64_t rows = N - r0 < slab ? N - r0 : slab;
                st = lt_gemm(be, s, CUDA_R_16BF, (const uint8_t *)w->data + (size_t)r0 * rb, xb, (float *)sb, rows,
                             2 * n, K, rows, 0.0f);
                if (st != STRATA_OK) return st;
                float *yd = y + r0;
                const bool vec = rows % 4 == 0 && N % 4 == 0 && st_cuda_aligned(yd, 16) && st_cuda_aligned(sb, 16);
                const int64_t per = vec ? rows / 4 : rows;
                const dim3 grid((unsigned)((per + 255) / 256 < 64 ? (per + 255) / 256 : 64), (unsigned)n);
                if (vec) stack_sum_kernel<true><<<grid, 256, 0, s->s>>>((const float *)sb, n, rows, yd, N);
                else stack_sum_kernel<false><<<grid, 256, 0, s->s>>>((const float *)sb, n, rows, yd, N);
                ST_CUDA_LAUNCHED("stack_sum_kernel");
            }
            return STRATA_OK;
        }
        if ((st = lt_gemm(be, s, CUDA_R_16BF, w->data, xb, y, N, n, K, N, 0.0f)) != STRATA_OK) return st;
        return lt_gemm(be, s, CUDA_R_16BF, w->data, xb + n * K, y, N, n, K, N, 1.0f);
    }

    /* f16 / quantized: dequantize a slab of rows at a time, then its GEMM */
    const int64_t kk = fast ? K : 3 * K; /* GEMM depth: K, or [hi | lo | hi] x [hi | hi | lo] */
    if (fast) st = x_to_bf16<XL_HI>(be, s, x, n, K, &xb);
    else st = x_to_bf16<XL_CAT3>(be, s, x, n, K, &xb);
    if (st != STRATA_OK) return st;
    int64_t slab = (int64_t)(DQ_SLAB_BYTES / ((size_t)kk * 2)) / 64 * 64;
    if (slab < 64) slab = 64;
    if (slab > N) slab = N;
    void *wb = NULL;
    st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_W, (size_t)slab * (size_t)kk * 2, &wb);
    if (st != STRATA_OK) return st;
    const size_t rb = st_dtype_row_bytes(w->dtype, K);
    for (int64_t r0 = 0; r0 < N; r0 += slab) {
        const int64_t rows = N - r0 < slab ? N - r0 : slab;
        const unsigned grid = st_grid_for(rows * (K / 8), 256, (int64_t)st_cuda_of(be)->sm_count * 16);
        const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * rb;
        if (fast) dq_to_bf16_kernel<T, false><<<grid, 256, 0, s->s>>>(src, rb, rows, K, (__nv_bfloat16 *)wb);
        else dq_to_bf16_kernel<T, true><<<grid, 256, 0, s->s>>>(src, rb, rows, K, (__nv_bfloat16 *)wb);
        ST_CUDA_LAUNCHED("dq_to_bf16_kernel");
        st = lt_gemm(be, s, CUDA_R_16BF, wb, xb, y + r0, rows, n, kk, N, 0.0f);
        if (st != STRATA_OK) return st;
    }
    return STRATA_OK;
}

static strata_status check_sizes(const st_weight *w, int64_t n) {
    if (n > INT32_MAX || w->rows > INT32_MAX || w->cols > INT32_MAX / 3)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape [%lld, %lld] x %lld tokens is too large",
                      (long long)w->rows, (long long)w->cols, (long long)n);
    return STRATA_OK;
}

strata_status st_cuda_op_matmul(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w, int64_t n,
                                float *y) {
    strata_status st = check_sizes(w, n);
    if (st != STRATA_OK) return st;
    ST_DTYPE_SWITCH(w->dtype, T, return matmul_t<T>(be, s, x, w, n, y));
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda matmul: dtype %s", st_dtype_name(w->dtype));
}

/* One GEMV launch when every weight qualifies for it (same dtype, K % 8 == 0,
 * few tokens); otherwise one matmul per weight. */
strata_status st_cuda_op_matmul_multi(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w,
                                      int count, int64_t n, float *const *y) {
    strata_status st;
    bool one = w[0].cols % 8 == 0 && use_gemv(st_cuda_of(be), &w[0], n);
    for (int i = 0; i < count; i++) {
        if ((st = check_sizes(&w[i], n)) != STRATA_OK) return st;
        one = one && w[i].dtype == w[0].dtype;
    }
    if (!one) {
        for (int i = 0; i < count; i++)
            if ((st = st_cuda_op_matmul(be, s, x, &w[i], n, y[i])) != STRATA_OK) return st;
        return STRATA_OK;
    }
    if ((st = gemv_x(be, s, x, n, w[0].cols, &x)) != STRATA_OK) return st;
    mmv_args a = mmv_one(&w[0], x, n, y[0]);
    a.count = count;
    for (int i = 1; i < count; i++) {
        a.w[i] = (const uint8_t *)w[i].data;
        a.y[i] = y[i];
        a.N[i] = w[i].rows;
    }
    ST_DTYPE_SWITCH(w[0].dtype, T, return gemv<T, false>(be, s, a));
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda matmul_multi: dtype %s", st_dtype_name(w[0].dtype));
}

/* Fast mode, one token, weights the direct int8 GEMV takes (and not the
 * MMQ, which a tuning may send single tokens to): the norm's kernel
 * quantizes out (st_cuda_rmsnorm_q, with the sums when any weight's type
 * needs them), then one GEMV launch per run of weights of one dtype (q4_K_M
 * files mix q4_k and q6_k in q|k|v); a launch fewer than rmsnorm,
 * quantization, GEMV per run, and the same bytes (a row's sums do not
 * depend on the launch it is in). Else rmsnorm, then matmul_multi /
 * matmul_swiglu. */
strata_status st_cuda_op_rmsnorm_matmul(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                        const st_weight *w_norm, float eps, int64_t n, int64_t d, float *out,
                                        const st_weight *w, int count, const st_weight *up, float *const *y) {
    st_cuda *c = st_cuda_of(be);
    bool fuse = c->fast_prefill && n == 1 && st_cuda_aligned(out, 16) && (!up || up->dtype == w[0].dtype);
    bool sums = false;
    for (int i = 0; i < count && fuse; i++) {
        const int T = w[i].dtype;
        fuse = st_cuda_gemv1_supports(T, d) && gemv1_rows(c, T) > 0 && check_sizes(&w[i], n) == STRATA_OK &&
               !use_mmq(c, T, st_dtype_row_bytes((st_dtype)T, d), d, n);
        sums = sums || st_cuda_gemv1_needs_sums(T);
    }
    strata_status st = STRATA_OK;
    if (fuse) {
        mmv_args q = mmv_one(&w[0], out, n, y[0]);
        if ((st = xq_scratch(be, s, sums, &q)) != STRATA_OK) return st;
        bool done = false;
        if ((st = st_cuda_rmsnorm_q(be, s, x, residual, w_norm, eps, n, d, out, (int8_t *)q.xq, (float *)q.xd,
                                    (float *)q.xs, &done)) != STRATA_OK)
            return st;
        for (int i = 0, j; done && i < count; i = j) {
            for (j = i + 1; j < count && w[j].dtype == w[i].dtype;) j++;
            mmv_args a = mmv_one(&w[i], out, n, y[i]);
            a.count = j - i;
            for (int k = i + 1; k < j; k++) {
                a.w[k - i] = (const uint8_t *)w[k].data;
                a.y[k - i] = y[k];
                a.N[k - i] = w[k].rows;
            }
            if (up) a.w[1] = (const uint8_t *)up->data;
            a.xq = q.xq, a.xd = q.xd, a.xs = q.xs;
            if ((st = st_cuda_gemv1(s->s, c->pdl, w[i].dtype, up != NULL, a, gemv1_rows(c, w[i].dtype))) != STRATA_OK)
                return st;
        }
        if (done) return STRATA_OK;
    }
    if ((st = st_cuda_op_rmsnorm(be, s, x, residual, w_norm, eps, n, d, out)) != STRATA_OK) return st;
    if (up) return st_cuda_op_matmul_swiglu(be, s, out, &w[0], up, n, y[0], NULL);
    return st_cuda_op_matmul_multi(be, s, out, w, count, n, y);
}

/* GEMV and MMQ sizes: one launch over the gate and up rows with SwiGLU in
 * its epilogue. GEMM sizes: gate into out, up into work (NULL: scratch),
 * then swiglu. */
strata_status st_cuda_op_matmul_swiglu(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *wg,
                                       const st_weight *wu, int64_t n, float *out, float *work) {
    strata_status st = check_sizes(wg, n);
    if (st != STRATA_OK) return st;
    if (wg->cols % 8 == 0 && use_gemv(st_cuda_of(be), wg, n)) {
        if ((st = gemv_x(be, s, x, n, wg->cols, &x)) != STRATA_OK) return st;
        mmv_args a = mmv_one(wg, x, n, out);
        a.w[1] = (const uint8_t *)wu->data;
        ST_DTYPE_SWITCH(wg->dtype, T, return gemv<T, true>(be, s, a));
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda matmul_swiglu: dtype %s", st_dtype_name(wg->dtype));
    }
    void *tmp = work;
    if (!tmp && (st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_TMP, (size_t)(n * wu->rows) * 4, &tmp)) != STRATA_OK)
        return st;
    if ((st = st_cuda_op_matmul(be, s, x, wg, n, out)) != STRATA_OK) return st;
    if ((st = st_cuda_op_matmul(be, s, x, wu, n, (float *)tmp)) != STRATA_OK) return st;
    return st_cuda_op_swiglu(be, s, out, (const float *)tmp, n * wu->rows, out);
}

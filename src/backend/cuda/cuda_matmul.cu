/* matmul: y[n, N] = x[n, K] @ w[N, K]^T, x and y fp32 row-major, w any dtype.
 *
 * Paths (chosen per call):
 *   GEMV (n <= 8 for f32/f16/bf16, n <= 32 for quantized types): a custom
 *     kernel that reads each weight row once at HBM speed and decodes it in
 *     registers (st_unit: 8 to 32 elements per thread, packed bytes loaded
 *     with the widest loads the layout allows, exact rounding), accumulating
 *     in fp32 against fp32 x. A block of up to 128 threads splits R rows
 *     (4 or 8) along K and adds the partial sums; up to 8 tokens per pass
 *     (grid.y covers more). x stays in L1 and is re-read once per R rows,
 *     which is what limits several tokens per pass. No rounding of x.
 *     Measured on an H200 (bench/bench_cuda_ops.c, copy roofline 4.2 TB/s):
 *     bf16 14336x4096 n=1 at 3.8 TB/s (89%), 4096x4096 at 66%, n=4 50%,
 *     n=8 30%; q8_0 61%, q6_k 40%, q4_0 38%, q4_k 31% of the roofline in
 *     weight bytes (the quantized ones are bound by x traffic and decoding,
 *     yet 1.2 to 1.5x faster than bf16 per token).
 *   GEMM, f32 weights (n > 8): cuBLASLt with fp32 inputs and CUBLAS_COMPUTE_32F
 *     (no TF32): fp32 accuracy.
 *   GEMM, bf16 weights (n > 8): x is rounded to bf16 in a scratch buffer, then
 *     cuBLASLt bf16 x bf16 -> fp32 with fp32 accumulation on the tensor cores.
 *   GEMM, f16 and quantized weights (n > 8, or n > 32): x to bf16 as above; the
 *     weight is dequantized (exactly, then rounded to bf16) into a scratch
 *     buffer of at most 64 MiB, a slab of rows at a time, each slab followed by
 *     its cuBLASLt GEMM into the matching columns of y. (f16 goes through bf16
 *     rather than converting x to f16, whose range activations can exceed.)
 *   Plain weights whose K is not a multiple of 8 (rows not 16-byte aligned):
 *     a scalar GEMV, any n (slow, correct; no real model has such shapes).
 * So GEMM results carry bf16 rounding of x (and of non-bf16 weights):
 * relative errors around 1e-3, where the GEMV and f32 paths are at ~1e-6.
 *
 * In cuBLAS's column-major terms, y^T [N, n] = W [K, N]^T . x^T [K, n]:
 * A = W with op T (lda = K), B = x with op N (ldb = K), C = y (ldc = N), the
 * "TN" layout cuBLASLt is fastest at. Plans (descriptors, layouts and the
 * heuristic's algorithm) are cached per shape and pointer alignment. */
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define MMV_WARPS 4          /* scalar fallback: rows per block */
#define GEMM_MIN_N 9          /* plain weights: GEMV below this */
#define GEMM_MIN_N_QUANT 33   /* quantized weights: GEMV below this */
#define DQ_SLAB_BYTES ((size_t)64 << 20)
#define LT_WS_BYTES ((size_t)32 << 20)
#define LT_PLANS 64

/* ---- GEMV ---------------------------------------------------------------------- */

/* Block b computes rows [R b, +R) for tokens [NT by, +NT); its threads split
 * the row into units (st_unit<T>) and the block adds their partial sums. */
template <int T, int NT, int R>
static __global__ void __launch_bounds__(128)
    mmv_kernel(const uint8_t *__restrict__ w, size_t rb, int64_t N, int64_t K, const float *__restrict__ x,
               int64_t n, float *__restrict__ y) {
    using Q = st_unit<T>;
    __shared__ float red[4][R * NT];
    const int64_t row0 = (int64_t)blockIdx.x * R;
    const int64_t t0 = (int64_t)blockIdx.y * NT;
    const int nt = (int)min((int64_t)NT, n - t0);
    const int nu = (int)(K / Q::U);
    const float *xt = x + t0 * K;
    const uint8_t *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (size_t)min(row0 + r, N - 1) * rb;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

#pragma unroll 2
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
        typename Q::raw raw[R];
#pragma unroll
        for (int r = 0; r < R; r++) raw[r] = Q::load(wr[r], u);
#pragma unroll
        for (int j = 0; j < Q::RUNS; j++) {
            float v[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) Q::expand(raw[r], j, v[r]);
            const int64_t e = Q::run_start(u, j);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < nt) {
                    const float4 *xp = (const float4 *)(xt + (int64_t)t * K + e);
                    const float4 a = __ldg(xp), b = __ldg(xp + 1);
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        float s = acc[r][t];
                        s = fmaf(v[r][0], a.x, s);
                        s = fmaf(v[r][1], a.y, s);
                        s = fmaf(v[r][2], a.z, s);
                        s = fmaf(v[r][3], a.w, s);
                        s = fmaf(v[r][4], b.x, s);
                        s = fmaf(v[r][5], b.y, s);
                        s = fmaf(v[r][6], b.z, s);
                        s = fmaf(v[r][7], b.w, s);
                        acc[r][t] = s;
                    }
                }
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < R; r++)
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

template <int T, int NT, int R>
static strata_status launch_mmv(cudaStream_t s, const st_weight *w, const float *x, int64_t n, float *y) {
    const size_t rb = st_dtype_row_bytes(w->dtype, w->cols);
    const int64_t gx = (w->rows + R - 1) / R, gy = (n + NT - 1) / NT;
    if (gx > INT32_MAX || gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape too large");
    const int64_t nu = w->cols / st_unit<T>::U;
    const int threads = nu >= 128 ? 128 : (int)((nu + 31) / 32 * 32);
    mmv_kernel<T, NT, R><<<dim3((unsigned)gx, (unsigned)gy), threads, 0, s>>>(
        (const uint8_t *)w->data, rb, w->rows, w->cols, x, n, y);
    ST_CUDA_LAUNCHED("mmv_kernel");
    return STRATA_OK;
}

template <int T>
static strata_status gemv(cudaStream_t s, const st_weight *w, const float *x, int64_t n, float *y) {
    /* R rows per block: x is re-read from L1 once per R rows, which bounds
     * the speed for several tokens; plain types have registers to spare */
    constexpr bool plain = T == ST_DTYPE_F32 || T == ST_DTYPE_F16 || T == ST_DTYPE_BF16;
    if (n == 1) return launch_mmv<T, 1, 4>(s, w, x, n, y);
    if (n == 2) return launch_mmv<T, 2, 4>(s, w, x, n, y);
    if (n <= 4) return launch_mmv<T, 4, plain ? 8 : 4>(s, w, x, n, y);
    return launch_mmv<T, 8, 4>(s, w, x, n, y); /* R = 8 here spills (measured slower) */
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

/* out[i] = bf16(x[i]), i < total (a multiple of 8, x 16-byte aligned). */
static __global__ void __launch_bounds__(256) x_to_bf16_kernel(const float *__restrict__ x, int64_t total,
                                                              __nv_bfloat16 *__restrict__ out) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total / 8; i += stride) {
        const float4 a = __ldg((const float4 *)x + 2 * i), b = __ldg((const float4 *)x + 2 * i + 1);
        ((uint4 *)out)[i] = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                                       pack_bf16x2(b.z, b.w));
    }
}

/* out[r, :] = bf16(dequant(w[r0 + r, :])), r < rows; K % 8 == 0. */
template <int T>
static __global__ void __launch_bounds__(256) dq_to_bf16_kernel(const uint8_t *__restrict__ w, size_t rb,
                                                               int64_t rows, int64_t K,
                                                               __nv_bfloat16 *__restrict__ out) {
    const int64_t nc = K / 8, total = rows * nc;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / nc, c = i % nc;
        float v[8];
        st_dq8<T>(w + (size_t)r * rb, c, v);
        ((uint4 *)(out + r * K))[c] = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                                 pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
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
};

static void plan_clear(lt_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
    memset(p, 0, sizeof *p);
}

strata_status st_cuda_matmul_setup(st_cuda *c) {
    c->lt_cache = (st_cuda_lt_cache *)st_calloc(1, sizeof *c->lt_cache);
    if (!c->lt_cache) return st_err(STRATA_ERR_NOMEM, "cuda matmul: out of memory");
    return STRATA_OK;
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

/* C[m, n] (col-major, ldc) = A[k, m]^T . B[k, n], A and B of type ab. */
static strata_status lt_gemm(st_backend *be, st_cuda_stream *s, cudaDataType_t ab, const void *A, const void *B,
                             float *C, int64_t m, int64_t n, int64_t k, int64_t ldc) {
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
    const float alpha = 1.0f, beta = 0.0f;
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

static strata_status x_to_bf16(st_backend *be, st_cuda_stream *s, const float *x, int64_t n, int64_t K,
                               __nv_bfloat16 **out) {
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_X, (size_t)(n * K) * 2, &p);
    if (st != STRATA_OK) return st;
    const int64_t total = n * K;
    x_to_bf16_kernel<<<st_grid_for(total / 8, 256, (int64_t)st_cuda_of(be)->sm_count * 8), 256, 0, s->s>>>(
        x, total, (__nv_bfloat16 *)p);
    ST_CUDA_LAUNCHED("x_to_bf16_kernel");
    *out = (__nv_bfloat16 *)p;
    return STRATA_OK;
}

template <int T>
static strata_status matmul_t(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w, int64_t n,
                              float *y) {
    const int64_t N = w->rows, K = w->cols;
    const bool quant = st_dtype_get(w->dtype)->quantized;
    if (K % 8) {
        if (T == ST_DTYPE_F32 && n >= GEMM_MIN_N) return lt_gemm(be, s, CUDA_R_32F, w->data, x, y, N, n, K, N);
        return gemv_scalar<T>(s->s, w, x, n, y);
    }
    if (n < (quant ? GEMM_MIN_N_QUANT : GEMM_MIN_N)) {
        if (!st_cuda_aligned(x, 16)) { /* rows of x must be 16-byte aligned: copy */
            void *p = NULL;
            strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_X, (size_t)(n * K) * 4, &p);
            if (st != STRATA_OK) return st;
            ST_CUDA_TRY(cudaMemcpyAsync(p, x, (size_t)(n * K) * 4, cudaMemcpyDeviceToDevice, s->s));
            x = (const float *)p;
        }
        return gemv<T>(s->s, w, x, n, y);
    }
    if (T == ST_DTYPE_F32) return lt_gemm(be, s, CUDA_R_32F, w->data, x, y, N, n, K, N);

    __nv_bfloat16 *xb = NULL;
    if (!st_cuda_aligned(x, 16)) { /* rare: fall back to the exact GEMV passes */
        return gemv_scalar<T>(s->s, w, x, n, y);
    }
    strata_status st = x_to_bf16(be, s, x, n, K, &xb);
    if (st != STRATA_OK) return st;
    if (T == ST_DTYPE_BF16) return lt_gemm(be, s, CUDA_R_16BF, w->data, xb, y, N, n, K, N);

    /* dequantize a slab of rows at a time, then its GEMM */
    int64_t slab = (int64_t)(DQ_SLAB_BYTES / ((size_t)K * 2)) / 64 * 64;
    if (slab < 64) slab = 64;
    if (slab > N) slab = N;
    void *wb = NULL;
    st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_W, (size_t)slab * (size_t)K * 2, &wb);
    if (st != STRATA_OK) return st;
    const size_t rb = st_dtype_row_bytes(w->dtype, K);
    for (int64_t r0 = 0; r0 < N; r0 += slab) {
        const int64_t rows = N - r0 < slab ? N - r0 : slab;
        dq_to_bf16_kernel<T><<<st_grid_for(rows * (K / 8), 256, (int64_t)st_cuda_of(be)->sm_count * 16), 256, 0,
                               s->s>>>((const uint8_t *)w->data + (size_t)r0 * rb, rb, rows, K,
                                       (__nv_bfloat16 *)wb);
        ST_CUDA_LAUNCHED("dq_to_bf16_kernel");
        st = lt_gemm(be, s, CUDA_R_16BF, wb, xb, y + r0, rows, n, K, N);
        if (st != STRATA_OK) return st;
    }
    return STRATA_OK;
}

strata_status st_cuda_op_matmul(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w, int64_t n,
                                float *y) {
    if (n > INT32_MAX || w->rows > INT32_MAX || w->cols > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape [%lld, %lld] x %lld tokens is too large",
                      (long long)w->rows, (long long)w->cols, (long long)n);
    ST_DTYPE_SWITCH(w->dtype, T, return matmul_t<T>(be, s, x, w, n, y));
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda matmul: dtype %s", st_dtype_name(w->dtype));
}

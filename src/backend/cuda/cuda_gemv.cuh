/* The decode GEMV's launch arguments and the staged GEMV kernels of
 * cuda_gemv.cu (CUDA C only; used by cuda_matmul.cu, which chooses the path).
 *
 * y_i[n, N_i] = x[n, K] @ w_i[N_i, K]^T for up to ST_GEMV_MAX_W weights of one
 * dtype and K sharing x (matmul_multi), or SwiGLU mode: w[0] the gate and
 * w[1] the up projection, y[0] = silu(x w0^T) * (x w1^T). */
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

#define ST_GEMV_MAX_W 4 /* weights one GEMV launch covers */

/* Weight i owns row groups [b0[i], b0[i+1]) (a group: the rows one block
 * computes at a time) and writes y[i] (row stride N[i]); the launcher fills b0
 * and groups (their total). */
struct st_gemv_args {
    const uint8_t *w[ST_GEMV_MAX_W]; /* [N_i, K] in the dtype, 16-byte aligned */
    float *y[ST_GEMV_MAX_W];         /* [n, N_i] */
    int64_t N[ST_GEMV_MAX_W];
    unsigned b0[ST_GEMV_MAX_W];
    unsigned groups;
    int count;
    size_t rb; /* bytes per weight row (same dtype and K for all) */
    int64_t K;
    const float *x; /* [n, K], 16-byte aligned */
    int64_t n;
    /* int8 path (fast mode; st_cuda_gemv2_i8_supports): x quantized by
     * st_cuda_gemv2_quant_x, NULL for the fp32 path */
    const int8_t *xq; /* [n, K] */
    const float *xd;  /* [n, K / 32] per-block scales */
    const float *xs;  /* [n, K / 32] d * sum x_q per block (MMQ of q4_1 / q4_k; NULL otherwise) */
};

/* True when the staged kernels handle this dtype and row size: bf16, f16,
 * q8_0, q4_0, q4_1, q4_k with rows a multiple of 16 bytes (every real model
 * shape; the caller keeps the older kernels for the rest). */
bool st_cuda_gemv2_supports(int dtype, size_t row_bytes);

/* How the staged GEMV sizes its grid, measured once per backend
 * (st_cuda_gemv2_setup): resident blocks per SM of every kernel variant
 * [dtype][tokens 1, 2, <= 4, <= 8, 1 with half the rows per block][SwiGLU].
 * For bf16 / f16 a launch has at most one wave of blocks, each walking
 * several row groups with one unbroken copy pipeline (the previous launch
 * shape, one block per row group, timed in bench/RESULTS.md, was removed). */
typedef struct {
    int sm_count;
    int bpsm[10][5][2]; /* dtypes: bf16, f16, q8_0, q4_0, q4_1, q4_k, then the int8 kernels of the last four */
} st_gemv2_tune;

/* True when the int8-activation kernels (fast mode) handle this dtype and
 * row size: q8_0, q4_0, q4_1, q4_k with rows a multiple of 16 bytes. */
bool st_cuda_gemv2_i8_supports(int dtype, size_t row_bytes);

/* x [n, K] fp32 (16-byte aligned, K % 32 == 0) -> xq [n, K] int8 and xd
 * [n, K / 32] scales: per 32-element block d = max|x| / 127, q = round(x / d)
 * (llama.cpp's q8_1), and when xs is not NULL xs [n, K / 32] = d * sum q
 * (the MMQ kernels of q4_1 / q4_k). Launched with PDL when pdl. */
strata_status st_cuda_gemv2_quant_x(cudaStream_t s, bool pdl, const float *x, int64_t n, int64_t K, int8_t *xq,
                                    float *xd, float *xs);

/* Launches the staged GEMV (swiglu: SwiGLU mode) on s, with PDL when pdl.
 * Needs st_cuda_gemv2_supports(dtype, a.rb), x and w 16-byte aligned; with
 * a.xq set, the int8 kernels (st_cuda_gemv2_i8_supports(dtype, a.rb)). */
strata_status st_cuda_gemv2(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a,
                            const st_gemv2_tune *t);

/* One-time kernel attributes (shared-memory carveout) and t's blocks per SM,
 * at backend init. */
strata_status st_cuda_gemv2_setup(st_gemv2_tune *t, int sm_count);

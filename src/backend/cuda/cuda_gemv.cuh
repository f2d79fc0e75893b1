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
#include "backend/cuda/cuda_common.cuh"

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
    const float *xs;  /* [n, K / 32] d * sum x_q per block (MMQ of q4_1 / q4_k, gemv1; NULL otherwise) */
    float *part;      /* MMQ split along K: the slices' partial sums (st_cuda_mmq_part_bytes; NULL otherwise) */
};

/* Row group g of a launch of groups of R rows (index over all its weights;
 * SwiGLU launches have one weight, the gate, whose rows the up rows mirror):
 * the group's weight, output, row count and first row. Compile-time indices
 * only, so that the args stay in the parameter bank. Shared by the GEMV
 * kernels and the MMQ (cuda_mmq.cu, whose tiles are its groups). */
struct st_gemv_group {
    const uint8_t *w;
    float *y;
    int64_t N, row0;
};
template <int R, bool SW>
ST_DEV st_gemv_group st_gemv_group_of(const st_gemv_args &a, unsigned g) {
    st_gemv_group r = {a.w[0], a.y[0], a.N[0], 0};
    unsigned b0 = 0;
    if (!SW) {
#pragma unroll
        for (int i = 1; i < ST_GEMV_MAX_W; i++)
            if (i < a.count && g >= a.b0[i]) r.w = a.w[i], r.y = a.y[i], r.N = a.N[i], b0 = a.b0[i];
    }
    r.row0 = (int64_t)(g - b0) * R;
    return r;
}

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

/* The one-token int8 GEMV (cuda_gemv1.cu, fast mode): q8_0, q4_0, q4_1, q6_k,
 * q4_k rows of K % 128 == 0 (16-byte aligned weights, x, xq, xd, xs). */
bool st_cuda_gemv1_supports(int dtype, int64_t K);
/* Whether it reads xs (d * sum x_q per block): every type but q8_0, q6_k. */
bool st_cuda_gemv1_needs_sums(int dtype);
/* Launches it for a.n == 1 with a.xq, a.xd (and a.xs where it needs sums)
 * from st_cuda_gemv2_quant_x; rows: rows per warp, 1, 2 or 4. */
strata_status st_cuda_gemv1(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a, int rows);

/* One-time kernel attributes (shared-memory carveout) and t's blocks per SM,
 * at backend init. */
strata_status st_cuda_gemv2_setup(st_gemv2_tune *t, int sm_count);

/* The int8 tensor-core matmul of fast mode for 2..256 tokens ("MMQ",
 * cuda_mmq.cu; CUDA C only, used by cuda_matmul.cu, which chooses the path).
 * Same arguments as the staged GEMV (cuda_gemv.cuh: several weights sharing
 * x, or SwiGLU mode), with x already quantized by st_cuda_gemv2_quant_x into
 * a.xq / a.xd, and a.xs (the blocks' d_x * sum x_q) for q4_1 and q4_k. */
#pragma once
#include "backend/cuda/cuda_gemv.cuh"

/* True when the MMQ kernels handle this dtype and row: q8_0, q4_0, q4_1,
 * q4_k, rows a multiple of 16 bytes and K a multiple of 128. */
bool st_cuda_mmq_supports(int dtype, size_t row_bytes, int64_t K);

/* True when the dtype's kernel needs a.xs (q4_1, q4_k: the weights' offsets
 * through the activations' block sums). */
bool st_cuda_mmq_needs_sums(int dtype);

/* The bytes of a.part the launch below needs for these arguments: small
 * launches (fewer than two blocks per SM) split K into slices whose partial
 * sums a second kernel adds in slice order; 0 when it does not. */
size_t st_cuda_mmq_part_bytes(int dtype, bool swiglu, const st_gemv_args &a, int sm_count);

/* Launches it on s (PDL when pdl). Needs st_cuda_mmq_supports, a.xq, a.xd
 * (and a.xs where st_cuda_mmq_needs_sums), a.part of st_cuda_mmq_part_bytes
 * bytes where that is not 0, 16-byte aligned w; sm_count (the device's SMs)
 * picks the tile height and the K slices. */
strata_status st_cuda_mmq(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a, int sm_count);

/* One-time kernel attributes (dynamic shared memory above 48 KiB), at backend init. */
strata_status st_cuda_mmq_setup(void);

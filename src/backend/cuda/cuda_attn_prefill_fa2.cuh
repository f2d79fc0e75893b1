/* The FlashAttention-2 style prefill attention kernel of the contiguous
 * attention op in fast mode (cuda_attn_prefill_fa2.cu), as cuda_attention.cu
 * calls it. CUDA C only (attn_out is a device-side struct of
 * cuda_attn_common.cuh). */
#pragma once
#include "backend/cuda/cuda_attn_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define ST_ATTN_FA2_BQ 128 /* rows (token, head) of one kv head per block: 8 warps x 16 */
/* The kernel is used when a kv head has at least this many rows (n G): it
 * first rounds the whole K and V (n_kv keys) to bf16, which pays for itself
 * only when enough rows share each key (below, the previous kernel, which
 * converts in its tiles). */
#define ST_ATTN_FA2_MIN_ROWS 512
/* Blocks resident per SM (the kernel's __launch_bounds__: 255 registers at
 * hd 128, 128 at hd 64), for sizing the KV split. */
#define ST_ATTN_FA2_BPSM(hd) ((hd) == 64 ? 2 : 1)

/* Once per backend: the kernels' shared-memory attributes. */
strata_status st_attn_fa2_setup(void);

/* Causal GQA attention (the contract of backend.h's attention) for head dim
 * hd (64 or 128), q/k/v/out 16-byte aligned: converts k and v to bf16 into
 * the stream's ST_CUDA_SCRATCH_ATTN_BF16 buffer, then runs the kernel on grid
 * (ceil(n G / ST_ATTN_FA2_BQ), Hkv, o->nsplit), writing o->out (nsplit 1) or
 * the partials of o (the caller merges them). qscale = scale * log2(e). */
strata_status st_attn_prefill_fa2(st_backend *be, st_cuda_stream *s, int hd, const float *q, const float *k,
                                  const float *v, const int32_t *pos, int64_t n, int64_t n_kv, int64_t H, int64_t Hkv,
                                  float qscale, const attn_out *o);

/* The FlashAttention-2 style prefill attention kernel of the contiguous
 * attention op in fast mode (cuda_attn_prefill_fa2.cu), as cuda_attention.cu
 * calls it. CUDA C only (attn_out is a device-side struct of
 * cuda_attn_common.cuh). */
#pragma once
#include "backend/cuda/cuda_attn_common.cuh"
#include "backend/cuda/cuda_internal.h"

/* The kernel is used when a kv head has at least this many rows (n G): it
 * first rounds the whole K and V (n_kv keys) to bf16, which pays for itself
 * only when enough rows share each key (below, the previous kernel, which
 * converts in its tiles). */
#define ST_ATTN_FA2_MIN_ROWS 512

/* Configurations of the kernel, chosen per backend by st_backend_params.attn_fa2
 * (read at init; the top of cuda_attn_prefill_fa2.cu describes them; auto,
 * the default: per call, st_attn_fa2_pick):
 *   b128w8   128 rows per block, 8 warps x 16 rows, Q fragments in registers
 *            (the first version)
 *   b128w8r  the same, blocks taken heaviest (causal) first
 *   b128w4   128 rows, 4 warps x 32 rows (two m-tiles share every K/V
 *            fragment), Q fragments from shared memory, heaviest first
 *   b256w8   256 rows, 8 warps x 32 rows, as b128w4 */
#define ST_ATTN_FA2_NVARIANTS 4
/* attn_fa2 names beyond the FA2 configurations: "wgmma", the Hopper kernel
 * (cuda_attn_prefill_wgmma.cuh; what auto runs where it applies: head dim
 * 128 on compute capability 9.0), and "wgmma-pp", the same with its consumer
 * warpgroups taking turns (pingpong; measured slower or equal, kept for
 * comparison). Where the Hopper kernel does not apply, both run the FA2
 * kernel as auto would. */
#define ST_ATTN_FA2_WGMMA 4
#define ST_ATTN_FA2_WGMMA_PP 5
#define ST_ATTN_FA2_DEFAULT "auto"

/* Once per backend: the kernels' shared-memory attributes. */
strata_status st_attn_fa2_setup(void);

/* name -> *variant (0 .. ST_ATTN_FA2_NVARIANTS - 1, ST_ATTN_FA2_WGMMA,
 * ST_ATTN_FA2_WGMMA_PP; -1 for auto, also NULL or ""); STRATA_ERR_INVALID_ARG
 * for an unknown name. */
strata_status st_attn_fa2_variant(const char *name, int *variant);
/* The FA2 configuration a call runs: variant itself, or for auto (-1, and
 * the wgmma names where the Hopper kernel does not apply) the one measured
 * fastest for this head dim and number of rows (n G) per kv head. */
int st_attn_fa2_pick(int variant, int hd, int64_t rows_per_kv_head);
/* The variant's name ("?" when out of range). */
const char *st_attn_fa2_name(int variant);
/* Rows (token, head) of one kv head per block. */
int st_attn_fa2_rows(int variant);
/* Blocks resident per SM (the kernel's __launch_bounds__), for sizing the KV split. */
int st_attn_fa2_bpsm(int variant, int hd);

/* Causal GQA attention (the contract of backend.h's attention) for head dim
 * hd (64 or 128), q/k/v/out 16-byte aligned, on configuration `variant`:
 * converts k and v to bf16 into the stream's ST_CUDA_SCRATCH_ATTN_BF16
 * buffer, then runs the kernel on grid (ceil(n G / rows), Hkv, o->nsplit)
 * (rows: st_attn_fa2_rows), writing o->out (nsplit 1) or the partials of o
 * (the caller merges them). qscale = scale * log2(e). part: the kernel's
 * attention_part instantiation (k, v one piece of keys from o->key0):
 * positions count from key0, and unsplit rows also write (or merge into)
 * o->lse (cuda_attn_common.cuh: st_attn_qpos, st_attn_store_row). */
strata_status st_attn_prefill_fa2(st_backend *be, st_cuda_stream *s, int variant, int hd, const float *q,
                                  const float *k, const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                  int64_t H, int64_t Hkv, float qscale, const attn_out *o, bool part);

/* The Hopper (sm_90a) prefill attention kernel of the contiguous attention op
 * in fast mode (cuda_attn_prefill_wgmma.cu), as cuda_attention.cu calls it:
 * wgmma with operands in shared memory, K/V tiles brought by the tensor copy
 * engine (TMA) into a two-stage pipeline, a producer warp and two consumer
 * warpgroups. Head dim 128 only (other dims: the FA2 kernel). CUDA C only
 * (attn_out is a device-side struct of cuda_attn_common.cuh). */
#pragma once
#include "backend/cuda/cuda_attn_common.cuh"
#include "backend/cuda/cuda_internal.h"

/* Rows (token, head) of one kv head per block; keys per tile (the split
 * granularity). */
#define ST_ATTN_WG_ROWS 128
#define ST_ATTN_WG_KEYS 128

/* Once per backend: whether the kernel can run on this device (compute
 * capability 9.0, whose sm_90a code the build holds; the driver's tensor-map
 * encoder found), into *ok, and the kernel's shared-memory attribute. */
strata_status st_attn_wgmma_setup(st_cuda *c, bool *ok);

/* Causal GQA attention (the contract of backend.h's attention), head dim 128,
 * q/k/v/out 16-byte aligned: converts k to bf16 and v to bf16 transposed
 * ([Hkv][128][n_kv rounded up to 8]) into the stream's
 * ST_CUDA_SCRATCH_ATTN_BF16 buffer, then runs the kernel on grid
 * (ceil(n G / 128), Hkv, o->nsplit), writing o->out (nsplit 1) or the
 * partials of o (the caller merges them). qscale = scale * log2(e). part:
 * attention_part's instantiation (k, v one piece of keys from o->key0).
 * pingpong: the two consumer warpgroups take turns issuing their matrix
 * products (one's softmax overlaps the other's products; attn_fa2
 * "wgmma-pp", off by default: measured no faster). */
strata_status st_attn_prefill_wgmma(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                    const float *v, const int32_t *pos, int64_t n, int64_t n_kv, int64_t H,
                                    int64_t Hkv, float qscale, const attn_out *o, bool part, bool pingpong);

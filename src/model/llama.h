/* model: the Llama forward pass, written once against backend.h.
 *
 * One sequence with a contiguous per-layer KV cache on the backend. The pass is
 * organised per weight group (weights/groups.h: embed, attn.l, ffn.l, output):
 * for each group it asks the weight manager (weights/manager.h) for the
 * group's device pointers, makes the compute stream wait on the group's ready
 * event, runs the ops, records the compute-done event and releases the group.
 * Where the weights live (device, pinned host, SSD) is the planner's choice
 * (weights/plan.h), made once at init from the device budget (the backend's
 * device_mem) and the host budget (weights.host_mem); the logits do not
 * depend on it. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "loader/loader.h"
#include "weights/manager.h"
#include "weights/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_llama st_llama;

/* Weight placement and streaming. Zero everywhere: the defaults below. */
typedef struct {
    size_t host_mem;          /* pinned host memory for the weights (host tier + staging);
                                 0: 80% of MemAvailable */
    size_t device_reserve;    /* device bytes kept for backend scratch (0: estimated; none on CPU) */
    int ring_slots;           /* device slots streamed groups pass through (0: 2) */
    size_t staging_chunk;     /* pinned staging buffer bytes (0: 8 MiB) */
    int staging_chunks;       /* staging buffers = reads in flight at most (0: 16) */
    int64_t prefill_tokens;   /* prompt length of the plan's prefill prediction (0: 2048) */
    st_wbw bw;                /* bandwidths given (0: measured at init when the device is capped) */
    const st_tier *placement; /* fixed placement, [2 * n_layers + 2] in group order (tests); NULL: planned */
    st_wm_params stream;      /* reader options and test hooks (its host_mem is set from host_mem) */
} st_llama_weight_opts;

typedef struct {
    int64_t max_ctx;        /* KV cache capacity in tokens (0: min(max_position_embeddings, 4096));
                               with the batched path: the most positions of one sequence */
    int64_t max_batch;      /* tokens per forward chunk (0: 512); longer inputs run in chunks;
                               st_llama_forward_batch takes at most this many tokens */
    st_llama_weight_opts weights;
    /* Batched serving (st_llama_forward_batch over an st_kv_cache, below). */
    int64_t kv_pool_tokens; /* device room the weight planner keeps for a paged KV pool of this many
                               token slots (the st_kv_cache the caller makes next); 0: none */
    bool no_seq_kv;         /* no contiguous single-sequence KV cache (max_ctx tokens per layer): the
                               model serves st_llama_forward_batch only; st_llama_forward and
                               st_llama_decode then return STRATA_ERR_UNSUPPORTED */
} st_llama_params;

/* Builds the model over the opened files on `be`. Borrows `files` and `be`
 * (both must outlive the model); the caller owns *out (st_llama_free).
 * The device budget is be->device_budget.cap (0: unlimited: every weight
 * resident; on CPU then used in place from the file mapping, as before).
 * A budget too small for any placement fails with STRATA_ERR_NOMEM saying
 * how much is needed. */
strata_status st_llama_init(const st_model_files *files, st_backend *be,
                            const st_llama_params *params, st_llama **out);
void st_llama_free(st_llama *m); /* NULL is a no-op */

/* The placement st_llama_init would make with these params on `be`
 * (bandwidths not given are measured now). The caller owns *groups
 * (st_wgroups_free) and *plan (st_wplan_free); on error both are empty. */
strata_status st_llama_plan(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_wgroups **groups, st_wplan *plan);
/* The model's weight manager: its plan (st_wm_plan) and stats. */
st_wm *st_llama_weights(st_llama *m);

/* Runs tokens[0..n) at positions n_past .. n_past+n-1 of the sequence, storing
 * their K/V. n_past must equal the number of tokens already run (st_llama_reset
 * starts over). logits (host memory): [n, vocab] when all_logits, else [vocab]
 * for the last token. On error the cache is left as before the call. */
strata_status st_llama_forward(st_llama *m, const int32_t *tokens, int64_t n, int64_t n_past,
                               bool all_logits, float *logits);
/* One token at position st_llama_n_past(m), as st_llama_forward(m, &token, 1,
 * n_past, false, logits), but both outputs are optional: logits (host
 * [vocab]) or NULL to leave them on the device, next = the argmax of the
 * logits (the greedy next token, computed on the device) or NULL. Where the
 * backend has graphs the step is recorded once and replayed (one launch and
 * one host sync per token). */
strata_status st_llama_decode(st_llama *m, int32_t token, float *logits, int32_t *next);
/* How single-token steps run now: "graph" (recorded and replayed) or
 * "direct (...why)". Static string. */
const char *st_llama_decode_mode(const st_llama *m);
void st_llama_reset(st_llama *m);
int64_t st_llama_n_past(const st_llama *m);
int64_t st_llama_max_ctx(const st_llama *m); /* KV capacity in tokens */
const st_config *st_llama_config(const st_llama *m);

/* ---- batched forward over a paged KV cache (continuous batching) -----------------------
 * Several sequences in one pass: every token of the batch goes through each
 * layer's matmuls together (rows are independent), its K/V row is stored at
 * its slot of the paged pool (kv_store_paged), and attention reads each
 * token's sequence through that sequence's block table (attention_paged).
 * Weight groups are acquired and released exactly as st_llama_forward does.
 *
 * Batch invariance: on the CPU backend a token's logits are bit-identical
 * whatever else is in the batch, however its prompt was chunked, and equal to
 * st_llama_forward's for the same tokens (every op computes a row with a
 * fixed reduction order; paged attention reproduces the contiguous op's
 * arithmetic). On CUDA, attention is batch-invariant bit for bit (one kernel
 * for every token, backend.h), but matmuls take the GEMV path for <= 8 rows
 * and the split-bf16 tensor-core path above, so logits agree across batch
 * compositions to ~1e-5 relative, not bit for bit. */

/* The paged KV pool: per layer a K and a V array of num_blocks * block_size
 * rows of n_kv_heads * head_dim floats (slot s = block * block_size + offset,
 * the same slot in every layer), plus the device and pinned host buffers a
 * batch's metadata travels through. Allocated on the model's backend and
 * counted in its device budget. */
typedef struct st_kv_cache st_kv_cache;

typedef struct {
    int64_t num_blocks;  /* >= 1 */
    int64_t block_size;  /* token slots per block, >= 1 */
} st_kv_cache_params;

/* Device bytes st_kv_cache_init takes for this pool (K and V of every layer
 * plus the batch metadata of a model with max_batch tokens and max_ctx
 * positions), each allocation rounded to 256 bytes. */
size_t st_kv_cache_device_bytes(const st_config *c, int64_t num_blocks, int64_t block_size, int64_t max_batch,
                                int64_t max_ctx);
/* Makes a pool for model m (borrowed: it must outlive the pool; one pool per
 * model at a time is the intended use). The caller owns *out
 * (st_kv_cache_free). INVALID_ARG for bad params, NOMEM when the device
 * budget or memory runs out (nothing left allocated). */
strata_status st_kv_cache_init(st_llama *m, const st_kv_cache_params *p, st_kv_cache **out);
void st_kv_cache_free(st_kv_cache *kv); /* NULL is a no-op; waits for the model's stream */
int64_t st_kv_cache_num_blocks(const st_kv_cache *kv);
int64_t st_kv_cache_block_size(const st_kv_cache *kv);

/* One forward pass's batch, all host memory (borrowed for the call). Token i
 * runs tokens[i] at position pos[i] of sequence seq[i]; its K/V row goes to
 * slot slots[i] of the pool (-1: not stored), and it attends over keys
 * 0..pos[i] of its sequence, found through row seq[i] of block_tables. */
typedef struct {
    int64_t n_tokens;             /* 1 .. the model's max_batch */
    const int32_t *tokens;        /* [n_tokens] ids in [0, vocab) */
    const int32_t *pos;           /* [n_tokens] positions, < ctx_lens[seq[i]] */
    const int32_t *seq;           /* [n_tokens] sequence index in [0, n_seqs) */
    const int64_t *slots;         /* [n_tokens] -1 or block_tables[seq][pos / bs] * bs + pos % bs */
    int64_t n_seqs;               /* 1 .. max_batch */
    const int32_t *block_tables;  /* [n_seqs, max_blocks] physical block ids (entries past a
                                     sequence's ceil(ctx_len / bs) blocks are not read) */
    int64_t max_blocks;           /* row stride, 1 .. ceil(max_ctx / bs) */
    const int32_t *ctx_lens;      /* [n_seqs] keys each sequence holds once this batch is stored
                                     (its last position + 1), <= the model's max_ctx */
    const int32_t *logit_rows;    /* [n_logits] tokens whose logits are wanted, increasing */
    int64_t n_logits;             /* 0 .. n_tokens */
} st_batch;

/* Runs batch b over pool kv: stores every token's K/V at its slot, and writes
 * logits[n_logits, vocab] (host memory) for the tokens of b->logit_rows, in
 * that order. The batch is validated on the host first (INVALID_ARG naming
 * the bad field; nothing runs). One host synchronization at the end, none
 * per layer. On another error the KV at the batch's slots is undefined (the
 * caller does not count them as computed). */
strata_status st_llama_forward_batch(st_llama *m, st_kv_cache *kv, const st_batch *b, float *logits);
int64_t st_llama_max_batch(const st_llama *m); /* tokens per forward_batch */

/* Batched passes as graphs. When every weight is device-resident and the
 * backend has graphs (CUDA), a pass of at most 256 tokens is recorded once
 * per shape (token count, logit rows, attention context bucket, device
 * sampling or not) and replayed: a step then costs a metadata copy, one graph launch and one sync
 * instead of ~25 launches per layer. The first pass of a shape runs directly
 * (it sizes the backend's scratch), the second is recorded; a failed
 * recording runs directly (3 tries per shape). Up to 16 shapes are kept
 * (least recently used dropped). Recordings are dropped when the device
 * budget sees a new allocation (a scratch buffer may have moved) and when
 * their KV pool is freed. Logits are bit-identical with and without graphs
 * (the same kernels with the same grids). STRATA_BATCH_GRAPH=0 (read at
 * st_llama_init) turns it off. The backend's fast-prefill precision is
 * recorded with a shape: after set_fast_prefill call st_llama_set_batch_graphs
 * (m, true) to drop the recordings. Streamed weights always run directly. */
typedef struct {
    int64_t replays;   /* passes run as a recorded graph */
    int64_t recorded;  /* graphs recorded */
    int64_t direct;    /* passes run op by op (first of a shape, failures, graphs off) */
    int64_t failed;    /* recordings that failed */
    int64_t dropped;   /* graphs dropped (invalidation, eviction, pool freed) */
} st_llama_graph_stats;
/* on = false: batched passes run directly from now on; on = true: graphs
 * allowed again (where the weights and backend allow them). Either way the
 * recorded graphs are dropped. */
void st_llama_set_batch_graphs(st_llama *m, bool on);
void st_llama_batch_graph_stats(const st_llama *m, st_llama_graph_stats *out);

/* As st_llama_forward_batch, and the next token of every logit row is drawn
 * on the device by the backend's `sample` op: ids[k] (host [n_logits]) = the
 * token drawn from row k with args[k] (host [n_logits]; -1 for a row the op
 * rejects: NaN, all -inf, see backend.h). logits (host [n_logits, vocab]) may
 * be NULL: then only the ids cross to the host (4 bytes a row instead of
 * 4 x vocab). The same single host synchronization. The first call allocates
 * a few small buffers (max_batch args and ids, device and pinned host). */
strata_status st_llama_forward_batch_sample(st_llama *m, st_kv_cache *kv, const st_batch *b,
                                            const st_sample_args *args, int32_t *ids, float *logits);

/* RoPE inverse frequencies [head_dim/2] as HF transformers computes them in
 * float32 (default, linear and llama3 scaling), divided element-wise by
 * `freq_divisors` when given (GGUF's rope_freqs tensor). */
void st_llama_rope_inv_freq(const st_config *c, const float *freq_divisors, float *inv_freq);

#ifdef __cplusplus
}
#endif

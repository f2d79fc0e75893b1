/* model: the Llama forward pass, written once against backend.h.
 *
 * One forward path: a batch of tokens of one or more sequences (st_batch)
 * runs through every layer together; each token's K/V row is stored at its
 * slot of the paged KV pool (kv/kv_pool.h) and attention reads each token's
 * sequence through that sequence's block table. A single sequence (strata
 * run, logits, bench) is a batch of one sequence; a decode step is a batch
 * of one token per sequence.
 *
 * Files: llama.c (init, the Llama-specific ops of the attention, FFN and
 * output groups), forward.c (the layer loop: acquire each weight group from
 * the weight manager and each layer's KV from the pool, make the compute
 * stream wait on their events, run the ops, record the done event, release;
 * batch validation and the metadata upload), graphs.c (recorded passes:
 * CUDA graphs per shape). Where the weights live (device, pinned host, SSD)
 * is the planner's choice (planner/planner.h), made once at init from the
 * explicit device budget; the logits do not depend on it.
 *
 * Batch invariance: on the CPU backend a token's logits are bit-identical
 * whatever else is in the batch and however its prompt was chunked (every op
 * computes a row with a fixed reduction order). On CUDA, attention is
 * batch-invariant bit for bit (backend.h), but matmuls take the GEMV path for
 * a few rows and the tensor-core path above, so logits agree across batch
 * compositions to ~1e-5 relative (precise mode) or bf16 rounding (fast
 * prefill), not bit for bit. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "kv/kv_pool.h"
#include "kv/kv_stream.h"
#include "loader/loader.h"
#include "planner/planner.h"
#include "weights/manager.h"
#include "weights/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_llama st_llama;

typedef struct {
    int64_t max_seq_len;      /* positions of one sequence (0: min(max_position_embeddings, 4096)) */
    int64_t max_tokens;       /* tokens of one forward pass (0: 512) */
    size_t device_mem;        /* the device budget the planner fills (0: unlimited: every weight resident) */
    size_t kv_bytes;          /* device bytes the caller's KV pool takes (kept out of the weights' room) */
    st_weight_opts weights;   /* placement and streaming (planner/planner.h) */
    bool no_graphs;           /* never record passes as graphs (measurements, checks) */
    int64_t attn_piece;       /* keys per attention piece of one sequence (planner.h st_plan_attn_piece;
                                 0: the default): the gather buffers' size and a streamed KV's ring slot */
    double cpu_attn;          /* a streamed sequence's passes of up to ST_PLAN_CPU_MAX_TOKENS tokens (its
                                 decode): this share of its earlier keys, the oldest, attended on the CPU
                                 from host memory while the device attends the rest (0: none; at most 1;
                                 < 0: planned at the first streamed pass, st_llama_cpu_attn). On the CPU
                                 backend 0 and < 0 mean 1: the decode's earlier host keys are read where
                                 they are, the same bits as through the ring */
} st_llama_params;

/* Startup: measures what the plan of these params needs and is not given
 * (planner/planner.h st_plan_measure: bandwidths, scratch reserve under a
 * budget), into params->weights. Call it before st_llama_init when
 * params->device_mem > 0 (init measures nothing); takes seconds. */
strata_status st_llama_measure(const st_model_files *files, st_backend *be, st_llama_params *params);

/* Builds the model over the opened files on `be`. Borrows `files` and `be`
 * (both must outlive the model); the caller owns *out (st_llama_free). The
 * weights are placed by the planner (st_plan_make) from params->device_mem
 * with the bandwidths in params->weights.bw (st_llama_measure; INVALID_ARG
 * when a budget is set and they are missing). A budget too small for any
 * placement fails with STRATA_ERR_NOMEM saying how much is needed. */
strata_status st_llama_init(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_llama **out);
void st_llama_free(st_llama *m); /* NULL is a no-op */

/* The placement st_llama_init would make with these params on `be`
 * (bandwidths and scratch not given are measured now: st_llama_measure). The caller owns *groups
 * (st_wgroups_free) and *plan (st_wplan_free); on error both are empty. */
strata_status st_llama_plan(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_wgroups **groups, st_wplan *plan);
/* The model's weight manager: its plan (st_wm_plan) and stats. */
st_wm *st_llama_weights(st_llama *m);
const st_config *st_llama_config(const st_llama *m);
int64_t st_llama_max_tokens(const st_llama *m);  /* tokens per forward pass */
st_stream *st_llama_stream(const st_llama *m);   /* the compute stream (the KV tiers order their copies with it) */
int64_t st_llama_max_seq_len(const st_llama *m); /* positions of one sequence */

/* The KV pool params this model's passes need, for a pool of num_blocks
 * blocks of block_size slots in `dtype`. */
st_kv_pool_params st_llama_kv_params(const st_llama *m, int64_t num_blocks, int64_t block_size, st_kv_dtype dtype);
/* The same from the files alone (before a model exists: sizing the pool for the plan). */
st_kv_pool_params st_llama_kv_params_for(const st_config *c, int64_t max_tokens, int64_t max_seq_len,
                                         int64_t num_blocks, int64_t block_size, st_kv_dtype dtype);

/* The params of a kv_stream (kv/kv_stream.h) for one sequence of up to
 * max_len keys in `dtype` run by this model (its layers, heads, pass size
 * and attention piece); host_mem: the cap on its host bytes (0: none). */
st_kv_stream_params st_llama_stream_params(const st_llama *m, int64_t max_len, st_kv_dtype dtype, size_t host_mem);

/* One forward pass's batch, all host memory (borrowed for the call). Token i
 * runs tokens[i] at position pos[i] of sequence seq[i]; its K/V row goes to
 * slot slots[i] of the pool (-1: not stored), and it attends over keys
 * 0..pos[i] of its sequence, found through row seq[i] of block_tables.
 * RoPE turns it by the angles of position pos[i] + pos_offset (0 unless set:
 * the positions and the KV layout stay pos[i]). RoPE depends only on the
 * distance between a query and a key, so a shift changes the logits by
 * rounding alone, however far: the angles are exact for every int32
 * position (backend/rope_angle.h); `strata logits --pos-offset` checks it. */
typedef struct {
    int64_t n_tokens;             /* 1 .. the model's max_tokens */
    const int32_t *tokens;        /* [n_tokens] ids in [0, vocab) */
    const int32_t *pos;           /* [n_tokens] positions, < ctx_lens[seq[i]] */
    const int32_t *seq;           /* [n_tokens] sequence index in [0, n_seqs) */
    const int64_t *slots;         /* [n_tokens] -1 or block_tables[seq][pos / bs] * bs + pos % bs */
    int64_t n_seqs;               /* 1 .. max_tokens */
    const int32_t *block_tables;  /* [n_seqs, max_blocks] physical block ids (entries past a
                                     sequence's ceil(ctx_len / bs) blocks are not read) */
    int64_t max_blocks;           /* row stride, 1 .. the pool's max_blocks */
    const int32_t *ctx_lens;      /* [n_seqs] keys each sequence holds once this batch is stored
                                     (its last position + 1), <= the model's max_seq_len */
    const int32_t *logit_rows;    /* [n_logits] tokens whose logits are wanted, increasing */
    int64_t n_logits;             /* 0 .. n_tokens */
    int64_t pos_offset;           /* added to every position for RoPE only; pos[i] + pos_offset in
                                     [0, 2^31 - 1] (RoPE positions are int32) */
} st_batch;

/* Runs batch b over pool kv: stores every token's K/V at its slot, and writes
 * logits[n_logits, vocab] (host memory) for the tokens of b->logit_rows, in
 * that order. The batch is validated on the host first (INVALID_ARG naming
 * the bad field; nothing runs). One host synchronization at the end, none
 * per layer. On another error the KV at the batch's slots is undefined (the
 * caller does not count them as computed). */
strata_status st_llama_forward(st_llama *m, st_kv_pool *kv, const st_batch *b, float *logits);

/* As st_llama_forward, and the next token of every logit row is drawn on the
 * device by the backend's `sample` op: ids[k] (host [n_logits]) = the token
 * drawn from row k with args[k] (host [n_logits]; -1 for a row the op
 * rejects: NaN, all -inf, see backend.h). logits (host [n_logits, vocab]) may
 * be NULL: then only the ids cross to the host (4 bytes a row instead of
 * 4 x vocab). The same single host synchronization. */
strata_status st_llama_forward_sample(st_llama *m, st_kv_pool *kv, const st_batch *b, const st_sample_args *args,
                                      int32_t *ids, float *logits);

/* One sequence that owns the whole pool (blocks 0, 1, 2, ... in order):
 * runs tokens[0..n) at positions n_past .. n_past+n-1 in passes of at most
 * max_tokens tokens (st_llama_forward; the KV of positions < n_past must
 * have been stored by earlier calls), and writes logits (host) [n, vocab]
 * when all_logits, else [vocab] of the last token. The batch builder of
 * `strata logits`, `bench` and the tests, not another forward path.
 * INVALID_ARG when n_past + n exceeds the pool or max_seq_len. */
strata_status st_llama_forward_seq(st_llama *m, st_kv_pool *kv, const int32_t *tokens, int64_t n, int64_t n_past,
                                   bool all_logits, float *logits);
/* The same with RoPE positions shifted by pos_offset (st_batch.pos_offset:
 * token i turns by the angles of position pos_offset + n_past + i; the KV
 * and the context check stay those of n_past + i). INVALID_ARG naming
 * pos_offset when it is negative or n_past + n - 1 + pos_offset exceeds
 * 2^31 - 1. Positions past the model's max_position_embeddings are allowed:
 * the shift is the point (strata logits --pos-offset). */
strata_status st_llama_forward_seq_at(st_llama *m, st_kv_pool *kv, const int32_t *tokens, int64_t n, int64_t n_past,
                                      int64_t pos_offset, bool all_logits, float *logits);

/* Recorded passes. When every weight is device-resident and the backend has
 * graphs (CUDA), a pass of at most 256 tokens is recorded once per shape
 * (token count and logit rows, both bucketed above 8 by padding the batch
 * with dummy tokens (forward.c), attention context bucket, device sampling or
 * not, pool) and replayed: a step then costs a metadata copy, one graph
 * launch and one sync instead of ~25 launches per layer. The first pass of a
 * shape runs directly (it sizes the backend's scratch), the second is
 * recorded; a failed recording runs directly (3 tries per shape). Up to 32
 * shapes are kept (least recently used dropped). Recordings are dropped when
 * the device budget sees a new allocation (a scratch buffer may have moved)
 * and when their pool is forgotten (st_llama_forget_pool). Logits are
 * bit-identical with and without graphs (the same kernels with the same
 * grids). The backend's fast-prefill precision is recorded with a shape:
 * after set_fast_prefill call st_llama_set_graphs(m, true) to drop the
 * recordings. Streamed weights always run directly. */
typedef struct {
    int64_t replays;   /* passes run as a recorded graph */
    int64_t recorded;  /* graphs recorded */
    int64_t direct;    /* passes run op by op (first of a shape, failures, graphs off) */
    int64_t failed;    /* recordings that failed */
    int64_t dropped;   /* graphs dropped (invalidation, eviction, pool forgotten) */
} st_llama_graph_stats;
/* on = false: passes run directly from now on; on = true: graphs allowed
 * again (where the weights and backend allow them). Either way the recorded
 * graphs are dropped. */
void st_llama_set_graphs(st_llama *m, bool on);
void st_llama_get_graph_stats(const st_llama *m, st_llama_graph_stats *out);
/* Drops the recordings that hold kv's pointers and waits for the model's
 * stream; call before st_kv_pool_free on a pool this model ran. */
void st_llama_forget_pool(st_llama *m, const st_kv_pool *kv);

/* RoPE inverse frequencies [head_dim/2] as HF transformers computes them in
 * float32 (default, linear and llama3 scaling), divided element-wise by
 * `freq_divisors` when given (GGUF's rope_freqs tensor). */
void st_llama_rope_inv_freq(const st_config *c, const float *freq_divisors, float *inv_freq);

/* One sequence whose KV lives in host memory (kv/kv_stream.h: longer than
 * the device pool, or than device memory): runs tokens[0..n) at positions
 * len .. len + n - 1 (len = st_kv_stream_len(ks) on entry) in passes of at
 * most max_tokens tokens, each layer's keys streamed up piece by piece
 * while the previous piece is attended and the pass's own K/V going down to
 * ks; len grows by n. RoPE positions shifted by pos_offset as in
 * st_llama_forward_seq_at. logits (host): [n, vocab] when all_logits, else
 * [vocab] of the last token. On the CPU the logits are bit-identical to
 * st_llama_forward_seq's over a pool that holds the sequence (same chunking
 * by max_tokens, same attention ranges). INVALID_ARG when ks was not made
 * for this model (st_llama_stream_params) or len + n exceeds its max_len
 * or max_seq_len; NOMEM naming --kv-stream-mem when its host rows do not fit (or
 * --kv-ssd-size / the file, with an SSD tier).
 * One host synchronization per pass. */
/* The CPU's share of a streamed decode's keys (params.cpu_attn) and, when
 * it was planned (cpu_attn < 0), the two rates it came from: the CPU's
 * attention over host rows of the stream's dtype and H2D, KV bytes per
 * second (0: not measured). Before the first streamed pass of a planned
 * split the share is 0. */
void st_llama_cpu_attn(const st_llama *m, double *share, double *cpu_bw, double *h2d_bw);

strata_status st_llama_forward_stream(st_llama *m, st_kv_stream *ks, const int32_t *tokens, int64_t n,
                                      int64_t pos_offset, bool all_logits, float *logits);

#ifdef __cplusplus
}
#endif

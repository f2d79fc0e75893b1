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
    int64_t max_ctx;        /* KV cache capacity in tokens (0: min(max_position_embeddings, 4096)) */
    int64_t max_batch;      /* tokens per forward chunk (0: 512); longer inputs run in chunks */
    st_llama_weight_opts weights;
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

/* RoPE inverse frequencies [head_dim/2] as HF transformers computes them in
 * float32 (default, linear and llama3 scaling), divided element-wise by
 * `freq_divisors` when given (GGUF's rope_freqs tensor). */
void st_llama_rope_inv_freq(const st_config *c, const float *freq_divisors, float *inv_freq);

#ifdef __cplusplus
}
#endif

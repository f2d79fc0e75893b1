/* engine/runner: executes the scheduler's decisions — continuous batching over
 * a paged KV cache, one step at a time.
 *
 * A runner owns the model (st_llama, built with no contiguous cache), the
 * paged KV pool (st_kv_cache), the block manager with its prefix cache, the
 * scheduler and one sampler per live sequence. One step (st_runner_step):
 *
 *   1. the scheduler decides the batch (decodes first, then prefill chunks
 *      under the token budget; admissions; preemption by recompute when
 *      blocks run out): st_scheduler_schedule;
 *   2. the runner turns the decision into one st_batch: token ids, positions,
 *      per-token sequence index, slot mapping (the decision's), per-sequence
 *      block tables and context lengths, the rows that need logits;
 *   3. st_llama_forward_batch runs it (every token's K/V stored at its slot);
 *   4. every item that needs logits is sampled by its sequence's own sampler
 *      (its own parameters and seed; history = the sequence's tokens); on
 *      CUDA a sampler without a repetition penalty draws on the device (the
 *      backend's sample op, with a uniform from the sampler's random state:
 *      the same token as on the host but for float rounding at a boundary),
 *      so only the token ids come back (STRATA_DEVICE_SAMPLE=0: always on
 *      the host; the on_logits hook also keeps it on the host);
 *   5. st_scheduler_update appends the tokens, commits the KV (full blocks
 *      enter the prefix cache) and finishes sequences at max_tokens /
 *      max_model_len; a sampled stop id finishes its sequence (STOP);
 *   6. events out: the token each sequence got, and which finished and why.
 *
 * Output does not depend on what else runs: on the CPU backend a sequence's
 * logits, hence its tokens for a given seed, are bit-identical alone or
 * among any others, whatever its chunking, preemptions (recompute) and
 * prefix-cache hits (model/llama.h says what holds on CUDA).
 *
 * Not thread safe: one thread calls every function (an engine hands requests
 * added or aborted on other threads over between steps). No printing; errors
 * through strata_status + st_err. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "kv/block_manager.h"
#include "loader/loader.h"
#include "model/llama.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_runner st_runner;

typedef struct {
    int64_t max_batch;        /* sequences running at once (0: 32) */
    int64_t max_model_len;    /* tokens of one sequence, prompt + generated (0: min(model's positions, 2048)) */
    int64_t max_batch_tokens; /* token budget of a step = tokens of one forward pass
                                 (0: 512; raised to max_batch when smaller) */
    int64_t prefill_chunk;    /* 0: prompt chunks fill the step's budget; > 0: aligned chunks
                                 (scheduler.h; then max_batch_tokens >= prefill_chunk + max_batch - 1) */
    int64_t block_size;       /* KV block, tokens (0: 16) */
    int64_t num_blocks;       /* KV pool blocks (0: from kv_mem) */
    size_t kv_mem;            /* pool bytes when num_blocks is 0 (0: room for max_batch sequences of
                                 max_model_len tokens, capped at 1 GiB); the pool always holds at
                                 least one sequence of max_model_len tokens */
    bool disable_prefix_cache;
    int64_t vocab;            /* ids samplers draw and prompts may hold: [0, vocab) (0: the model's;
                                 at most the model's) */
    st_llama_weight_opts weights;
    /* Inspection hook (tests, tools): called during st_runner_step for every
     * row of logits the step computed, before sampling: sequence id, the
     * position whose next token they predict, and the row (model vocab
     * floats, valid during the call). NULL: none. */
    void (*on_logits)(void *user, uint64_t id, int64_t pos, const float *logits, int64_t n_vocab);
    void *hook_user;
} st_runner_params;

/* A request. Everything is copied by st_runner_add. */
typedef struct {
    const int32_t *prompt;      /* [n_prompt] ids in [0, vocab) */
    int64_t n_prompt;           /* 1 .. max_model_len - 1 */
    st_sampler_params sampler;  /* its own random state, seeded from sampler.seed */
    int64_t max_tokens;         /* > 0: at most this many sampled tokens; 0: until max_model_len */
    const int32_t *stop_ids;    /* sampled ids that end the sequence (the id is reported, reason STOP) */
    int64_t n_stop_ids;
    void *user;                 /* handed back in its events */
} st_runner_request;

/* What happened to one sequence in a step. */
typedef struct {
    uint64_t id;
    void *user;
    int32_t token;              /* the token sampled this step; -1 when none (a sampler failure) */
    bool finished;              /* the sequence left the runner in this step (its id is free again) */
    st_seq_finish reason;       /* when finished: STOP (token is a stop id), MAX_TOKENS, CONTEXT, or
                                   ABORT when its sampler failed (failed = true) */
    bool failed;                /* the sampler rejected its logits (message logged at WARN level) */
    int64_t n_prompt, n_generated;
    int64_t n_cached;           /* prompt tokens the prefix cache served at its first admission */
    int64_t n_preemptions;
} st_runner_event;

/* One step's outcome. Owned by the runner; valid until its next call. */
typedef struct {
    const st_runner_event *events; /* [n_events]: one per sequence that sampled (or failed to) */
    int64_t n_events;
    int64_t n_tokens;              /* tokens the forward pass ran (0: nothing was runnable) */
    int64_t n_seqs;                /* sequences in the batch */
    int64_t n_decodes;             /* of which single-token decodes */
    int64_t n_preempted;           /* sequences sent back to waiting by this step */
} st_runner_step_info;

typedef struct {
    st_scheduler_stats sched;      /* prefill / decode tokens, cached tokens, preemptions, ... */
    st_bm_stats kv;                /* blocks used / cached / free, prefix-cache hits */
    int64_t steps;                 /* steps that ran a forward pass */
    double forward_s, sample_s;    /* time in forward passes and in sampling */
} st_runner_stats;

/* Builds the model over `files` on `be` (borrowed: both must outlive the
 * runner), its KV pool, block manager and scheduler. The caller owns *out
 * (st_runner_free); on error *out is NULL and the message says why. */
strata_status st_runner_init(const st_model_files *files, st_backend *be, const st_runner_params *params,
                             st_runner **out);
/* Drops every live sequence (no events) and frees everything. NULL: no-op. */
void st_runner_free(st_runner *r);

/* Queues request `id` (unique among live sequences; the caller's). Errors,
 * nothing queued: INVALID_ARG for a bad request (empty or too long prompt, an
 * id outside [0, vocab), bad sampler parameters, negative max_tokens, a live
 * id), NOMEM. */
strata_status st_runner_add(st_runner *r, uint64_t id, const st_runner_request *req);

/* One step (top of this file). *out: what it did (no events and n_tokens 0
 * when nothing was runnable). An error from the forward pass leaves every
 * sequence as it was (nothing counts as computed; the next step plans the
 * same work again). */
strata_status st_runner_step(st_runner *r, st_runner_step_info *out);

/* Ends live sequence `id` now, waiting or running (blocks released, no
 * event). NOT_FOUND when it is not live. finish: the caller's reason (STOP
 * for a stop string, ABORT for a cancelled request). */
strata_status st_runner_finish(st_runner *r, uint64_t id, st_seq_finish reason);
strata_status st_runner_abort(st_runner *r, uint64_t id); /* st_runner_finish(r, id, ST_SEQ_FINISH_ABORT) */

bool st_runner_has_work(const st_runner *r);
int64_t st_runner_num_running(const st_runner *r);
int64_t st_runner_num_waiting(const st_runner *r);
/* The live sequence `id` (tokens so far, KV table), read-only until the next
 * call; NULL when not live. */
const st_seq *st_runner_get_seq(const st_runner *r, uint64_t id);
void st_runner_get_stats(const st_runner *r, st_runner_stats *out);
/* The parameters in force (defaults filled in). */
const st_runner_params *st_runner_get_params(const st_runner *r);
st_llama *st_runner_model(st_runner *r);

#ifdef __cplusplus
}
#endif

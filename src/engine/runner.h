/* engine/runner: executes the scheduler's decisions — continuous batching over
 * a paged KV cache, one step at a time.
 *
 * A runner owns the model (st_llama), the
 * paged KV pool (kv/kv_pool.h), the block manager with its prefix cache and
 * the scheduler; the sequences (engine/seq.h records, each with its own
 * sampler) are lent to it by their creator. One step (st_runner_step):
 *
 *   0. with speculative decoding (params.spec, engine/spec.h), the drafter
 *      proposes drafts for every decoding sequence (prompt lookup, or the
 *      draft model's passes);
 *   1. the scheduler decides the batch (decodes first, then prefill chunks
 *      under the token budget; admissions; preemption by recompute when
 *      blocks run out): st_scheduler_schedule;
 *   2. the runner turns the decision into one st_batch: token ids, positions,
 *      per-token sequence index, slot mapping (the decision's), per-sequence
 *      block tables and context lengths, the rows that need logits;
 *   3. st_llama_forward runs it (every token's K/V stored at its slot);
 *   4. every item that needs logits is sampled by its sequence's own sampler
 *      (its own parameters and seed; history = the sequence's tokens); on
 *      CUDA a sampler without a repetition penalty draws on the device (the
 *      backend's sample op, with a uniform from the sampler's random state:
 *      the same token as on the host but for float rounding at a boundary),
 *      so only the token ids come back (params.host_sample: always on the
 *      host; the on_logits hook also keeps it on the host);
 *   5. st_scheduler_update appends the tokens, commits the KV (full blocks
 *      enter the prefix cache) and finishes sequences at max_tokens /
 *      max_model_len (LENGTH);
 *      A decode with drafts is verified row by row (st_sampler_verify, on
 *      the host): the accepted drafts and the first token that is not one
 *      are the step's tokens for it;
 *   6. st_seq_postprocess for every sampled token, in order: stop ids and
 *      stop strings (the one place they are checked; a stop finishes the
 *      sequence, STOP, and the tokens a verification accepted after it are
 *      dropped) and the new text (detokenized, stop strings held back);
 *   7. events out: the sequence, its tokens, whether it finished (seq->fin).
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
#include "engine/spec.h"
#include "engine/seq.h"
#include "kv/block_manager.h"
#include "kv/kv_tiers.h"
#include "loader/loader.h"
#include "model/llama.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_runner st_runner;

#define ST_KV_HOST_OFF (-1)
#define ST_KV_HOST_DEFAULT_CAP ((int64_t)32 << 30)
#define ST_KV_SSD_DEFAULT ((uint64_t)64 << 30)

/* The engine's parameters — one struct, one set of defaults, used by the
 * runner and the engine alike (resolved by st_engine_params_resolve). */
typedef struct {
    int64_t max_batch;       /* sequences running at once (0: 32; at most 4096) */
    int64_t max_model_len;   /* tokens per sequence, prompt + output (0: min(model's positions, 2048)) */
    int64_t prefill_chunk;   /* > 0: prompts run in chunks aligned to this many tokens, never cut by
                                the budget (batch-invariant chunk boundaries; scheduler.h) (0: 256);
                                -1: unaligned chunks that fill the step's budget (tests) */
    int64_t step_tokens;     /* token budget of a step: decodes + prompt chunks (0: prefill_chunk +
                                max_batch; unaligned: 512); at least prefill_chunk. The forward pass
                                takes up to max(step_tokens, max_batch, prefill_chunk + max_batch - 1)
                                tokens so the oldest prefill always runs beside the decodes */
    int64_t max_waiting;     /* engine: requests waiting for a slot before add refuses (0: 4096) */
    int64_t kv_block_size;   /* tokens of a KV block (0: 16) */
    int64_t kv_blocks;       /* blocks of the paged KV pool (0: from kv_mem) */
    size_t kv_mem;           /* pool bytes when kv_blocks is 0 (0: room for max_batch sequences of
                                max_model_len tokens in kv_dtype, capped at 1 GiB); never less than
                                one sequence of max_model_len tokens unless kv_stream */
    bool disable_prefix_cache; /* every prompt is computed in full (and no KV tiers) */
    /* KV tiers below the device pool (kv/kv_tiers.h; they need the prefix cache) */
    int64_t kv_host_mem;     /* host tier bytes (0: 1/8 of the memory available at startup, at most
                                ST_KV_HOST_DEFAULT_CAP; ST_KV_HOST_OFF: no host tier, so no tiers) */
    st_kv_offload kv_offload; /* full blocks go to the host tier as they fill (eager, the default) or
                                 when the device evicts them (lazy) */
    const char *kv_ssd_dir;  /* SSD tier directory (NULL: none); needs the host tier */
    uint64_t kv_ssd_size;    /* SSD tier bytes (0: ST_KV_SSD_DEFAULT; fewer when the disk has less room) */
    int64_t kv_ssd_fail_write_nth; /* tests: the Nth SSD write fails as on a full disk */
    size_t kv_landing_mem;   /* P-D decode node: device bytes blocks from a prefill node land in
                                (st_runner_land_*; 0: none, they land in the host tier) */
    bool host_sample;        /* sample on the host even on CUDA (no device sampling) */
    /* A sequence too long for the device pool alone runs with its KV in host
     * memory, streamed through the device layer by layer (kv/kv_stream.h;
     * one at a time: scheduler.h stream_tokens), instead of the pool being
     * raised to one max_model_len sequence. */
    bool kv_stream;
    double kv_cpu_attn;      /* that sequence's decode: the share of its earlier keys attended on the CPU
                                (model/llama.h cpu_attn) */
    int64_t kv_segment;      /* keys per host / SSD segment of that sequence (0: ST_KV_STREAM_SEG); its
                                segments go to kv_ssd_dir past kv_stream_mem */
    size_t kv_stream_mem;    /* host bytes of that sequence's KV at most (0: st_kv_stream_default_host_mem,
                                3/4 of the memory available at its first pass) */
    st_kv_dtype kv_dtype;    /* KV cache element type (0 = ST_KV_F32; the tools default to bf16) */
    size_t device_mem;       /* the device budget the planner fills (0: unlimited: every weight resident) */
    st_weight_opts weights;  /* weight placement and streaming (planner/planner.h; zero: defaults) */
    st_spec_params spec;     /* speculative decoding (engine/spec.h; zero: off) */
    /* Inspection hook (tests, tools): called during a step for every row of
     * logits it computed, before sampling: sequence id, the position whose
     * next token they predict, and the row (model vocab floats, valid during
     * the call); it keeps sampling on the host. NULL: none. */
    void (*on_logits)(void *user, uint64_t id, int64_t pos, const float *logits, int64_t n_vocab);
    void *hook_user;
} st_engine_params;

/* Fills in the defaults of *p for model config cfg and checks it
 * (INVALID_ARG naming the bad field). Idempotent. */
strata_status st_engine_params_resolve(st_engine_params *p, const st_config *cfg);

/* What happened to one sequence in a step. */
typedef struct {
    st_seq *seq;                /* the record (the caller's); seq->text / n_text: its new text */
    int32_t token;              /* the token sampled this step (the last one); -1 when none (a sampler
                                   failure) */
    int64_t n_tokens;           /* tokens the sequence gained this step: 1 + the drafts accepted (cut
                                   at a stop); 0 when token is -1 */
    bool finished;              /* the sequence left the runner in this step (FINISHED: seq->fin says
                                   why: STOP, LENGTH, or ERROR when its sampler failed); the record
                                   is the caller's again */
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
    st_bm_stats kv;                /* blocks used / cached / free, prefix-cache hits (device tier) */
    bool tiers;                    /* a host tier (and maybe an SSD tier) runs: `tier` is filled */
    st_kv_tiers_stats tier;        /* host and SSD tiers: blocks, hits, bytes moved */
    int64_t steps;                 /* steps that ran a forward pass */
    double forward_s, sample_s;    /* time in forward passes and in sampling */
} st_runner_stats;

/* Builds the model over `files` on `be` (borrowed: both must outlive the
 * runner), its KV pool, block manager and scheduler, with params (NULL: all
 * defaults; resolved: st_runner_get_params). The caller owns *out
 * (st_runner_free); on error *out is NULL and the message says why. */
strata_status st_runner_init(const st_model_files *files, st_backend *be, const st_engine_params *params,
                             st_runner **out);
/* Takes every live sequence out (blocks released, no events; the records
 * stay their creators') and frees everything. NULL: no-op. */
void st_runner_free(st_runner *r);
/* The model identity the SSD tier checks (a hash of the files' sizes,
 * headers and tensor tables, the config's shape, the KV layout); *text (may
 * be NULL) gets a readable line (st_free). */
uint64_t st_runner_model_identity(const st_model_files *f, const st_kv_pool_params *kp, char **text);
/* The KV tiers (NULL when none): benchmarks and tests drain or drop them. */
st_kv_tiers *st_runner_tiers(st_runner *r);
/* P-D: full blocks of tokens[0..n_tokens) the device prefix cache holds
 * (st_bm_lookup / block size; no side effects), and the shape of a block's
 * layer (layers, bytes: kv/kv_pool.h st_kv_block_layout). */
int64_t st_runner_prefix_blocks(const st_runner *r, const int32_t *tokens, int64_t n_tokens);
void st_runner_kv_layout(const st_runner *r, int64_t *n_layers, size_t *layer_bytes);
/* P-D: a decode node's adopted blocks brought to the device ahead of the
 * admission of their request: the host-tier blocks of tokens' full blocks
 * (after the device prefix) are copied into device blocks held privately;
 * st_runner_kv_preload_poll returns true once they are there (they are then
 * registered in the device prefix cache and released: the admission finds
 * them as a device hit, its pass loads nothing) and frees the preload.
 * *out NULL: nothing to bring (or no room in the pool: the admission loads
 * them as usual). st_runner_kv_preload_free drops one not done (shutdown). */
typedef struct st_runner_preload st_runner_preload;
strata_status st_runner_kv_preload(st_runner *r, const int32_t *tokens, int64_t n_tokens, st_runner_preload **out);
bool st_runner_kv_preload_poll(st_runner *r, st_runner_preload *p);
void st_runner_kv_preload_free(st_runner *r, st_runner_preload *p);
/* P-D, a decode node with kv_landing_mem: the landing arena, device memory
 * of kv_landing_mem / (layers x layer_bytes) block slots, layer-major: slot
 * s's layer l at base + l * stride + s * layer_bytes (so one transfer
 * message, a layer of consecutive blocks, is one contiguous region).
 * land_reserve takes n consecutive slots (NOMEM naming --pd-landing-mem when
 * no run is free); land_at gives slot0's layer-0 address and the stride (NULL:
 * no arena); land_release gives slots back (nothing may write them any more).
 * st_runner_kv_preload_landed is st_runner_kv_preload for landed blocks
 * [from_block, from_block + n) of tokens in slots [slot0, slot0 + n): they
 * are copied into device blocks held privately (the part after the device
 * prefix that exists now; none when that prefix ends before from_block) and
 * the slots go back once copied (or at once when nothing is copied). */
strata_status st_runner_land_reserve(st_runner *r, int64_t n, int64_t *slot0);
void st_runner_land_release(st_runner *r, int64_t slot0, int64_t n);
void *st_runner_land_at(const st_runner *r, int64_t slot0, size_t *stride);
int64_t st_runner_land_slots(const st_runner *r); /* 0: no arena */
strata_status st_runner_kv_preload_landed(st_runner *r, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                                          int64_t n, int64_t slot0, st_runner_preload **out);
/* st_runner_model_identity of this runner's files and pool (computed at init). */
uint64_t st_runner_kv_identity(const st_runner *r);
/* Drops every block of the device prefix cache that no sequence holds
 * (benchmarks: the next prompt hits a lower tier or nothing). */
void st_runner_clear_device_cache(st_runner *r);

/* The limits a request is checked against for this runner (st_seq_create):
 * max_model_len, vocab (the tokenizer's when tok is given, else the model's)
 * and tok. */
st_seq_limits st_runner_limits(const st_runner *r, const st_tokenizer *tok);

/* Lends sequence q (a WAITING record from st_seq_create with this runner's
 * limits) to the runner until it finishes (an event with finished, or
 * st_runner_finish). Errors, nothing queued: INVALID_ARG for an id already
 * live, NOMEM. */
strata_status st_runner_add(st_runner *r, st_seq *q);

/* One step (top of this file). *out: what it did (no events and n_tokens 0
 * when nothing was runnable). An error from the forward pass leaves every
 * sequence as it was (nothing counts as computed; the next step plans the
 * same work again). */
strata_status st_runner_step(st_runner *r, st_runner_step_info *out);

/* Ends live sequence `id` now, waiting or running (blocks released, no
 * event; the record FINISHED for `reason`: ABORT for a cancelled request,
 * ERROR...). NOT_FOUND when it is not live. */
strata_status st_runner_finish(st_runner *r, uint64_t id, st_finish_reason reason);

bool st_runner_has_work(const st_runner *r);
int64_t st_runner_num_running(const st_runner *r);
int64_t st_runner_num_waiting(const st_runner *r);
/* The live sequence `id`, read-only until the next call; NULL when not live. */
const st_seq *st_runner_get_seq(const st_runner *r, uint64_t id);
void st_runner_get_stats(const st_runner *r, st_runner_stats *out);
/* The parameters in force (defaults filled in). */
const st_engine_params *st_runner_get_params(const st_runner *r);
st_llama *st_runner_model(st_runner *r);

#ifdef __cplusplus
}
#endif

/* engine/engine: the serving engine facade — what the HTTP server (and later
 * the disaggregation layer) talks to.
 *
 *   st_engine_add(request, callbacks) ──► waiting (FIFO) ──► running ──► finished
 *                                              ▲                │
 *   st_engine_abort(id) ───────────────────────┴────────────────┘ (at the next step)
 *
 * A request is a prompt (token ids), sampling parameters with a seed, a token
 * budget and stop conditions. Every engine step:
 *   1. takes in what was added and aborted since the last step: aborted
 *      requests leave (their KV blocks are released), new ones are handed to
 *      the batched runner (engine/runner.h), which admits them first come
 *      first served;
 *   2. the runner's scheduler plans the step: one decode token for every
 *      running sequence that has finished its prompt, then prompt chunks
 *      aligned to prefill_chunk under the step's token budget, oldest request
 *      first (the oldest prefill always gets its chunk, so nothing starves).
 *      KV lives in one paged pool of kv_block_size-token blocks shared by all
 *      sequences, with a prefix cache (a prompt prefix already computed is not
 *      computed again); when blocks run out the newest running sequence is
 *      preempted (recompute) and resumes later with the same output;
 *   3. one batched forward pass (st_llama_forward) runs every sequence's
 *      tokens of the step on one shared st_llama;
 *   4. each sequence that produced logits is sampled with its own sampler;
 *      the runner's postprocess (st_seq_postprocess, the one place) applies
 *      stop ids and stop strings and detokenizes (never half a UTF-8
 *      character); the engine streams the new text to on_text and finishes
 *      the sequences that are done (on_finish), their blocks freed.
 * Every request is one record (engine/seq.h, st_seq) from st_engine_add to
 * on_finish: the engine creates it (the request is validated there, once),
 * the runner and its scheduler borrow it while it is live.
 * Requests join and leave between steps; a long prompt is spread over several
 * steps beside the others' decodes.
 *
 * Output is batch-invariant: a sequence's chunk boundaries depend only on its
 * own prompt (and prefix-cache hit), and its sampler state only on its own
 * seed, so on the CPU its tokens are the same whatever else runs
 * (tests/test_engine.c checks it).
 *
 * Threads: st_engine_add / st_engine_abort / st_engine_metrics may be called
 * from any thread at any time. The model runs only on the thread that steps
 * the engine: either the engine's own thread (st_engine_start .. _stop) or a
 * caller of st_engine_step (tests), never both. Callbacks run on that thread,
 * between the model's work; they must be quick and must not call
 * st_engine_step (they may call add/abort/metrics).
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/seq.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "tokenizer/tokenizer.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_engine st_engine;

/* st_engine_params (engine/runner.h): one parameter struct, one set of
 * defaults, shared with the runner (max_batch 32, max_model_len
 * min(model, 2048), prefill_chunk 256, ...). */

/* What a step of this model costs, for rooflines (fixed at init):
 * a forward pass of n tokens over sequences holding c keys in all reads
 * about weight_bytes + c * kv_bytes_per_token bytes and computes
 * n * flops_per_token + (query, key) pairs * attn_flops_per_pair FLOPs. */
typedef struct {
    double weight_bytes;        /* weight bytes one forward pass reads: every layer matrix and norm,
                                   the final norm and lm_head (the embedding table only for the
                                   rows it gathers, not counted, unless it is lm_head) */
    double kv_bytes_per_token;  /* K and V of every layer, as the pool stores them (its kv_dtype) */
    double flops_per_token;     /* 2 x the elements of every matrix a token goes through
                                   (lm_head included: decodes need the logits of every token) */
    double attn_flops_per_pair; /* 4 x heads x head_dim x layers: scores and the weighted sum */
} st_engine_costs;

/* The request, what on_finish receives and the callbacks are the request
 * record's types (engine/seq.h): st_request (prompt, sampler parameters,
 * max_tokens, stop strings and ids, ignore_eos), st_finish_info (reason
 * STOP / LENGTH / ABORT / ERROR with its detail, usage, times from
 * st_engine_add) and st_seq_callbacks (on_text, on_finish, user; called on
 * the stepping thread; on_finish exactly once for every request
 * st_engine_add accepted, last; after it the engine never touches `user`
 * again). */
typedef st_request st_engine_request;
typedef st_finish_info st_engine_finish;
typedef st_seq_callbacks st_engine_callbacks;

/* A cumulative histogram with fixed upper bounds (Prometheus style):
 * counts[i] = observations <= bounds[i]; the last bucket is +Inf. */
#define ST_ENGINE_HIST_MAX 24
typedef struct {
    int n_bounds;
    double bounds[ST_ENGINE_HIST_MAX];
    int64_t counts[ST_ENGINE_HIST_MAX + 1]; /* not cumulative: counts[i] in (bounds[i-1], bounds[i]] */
    int64_t count;
    double sum;
} st_engine_hist;

/* A snapshot of the engine's counters. */
typedef struct {
    int64_t running;                 /* sequences holding a slot */
    int64_t waiting;                 /* requests waiting for a slot */
    int64_t max_batch, max_model_len;
    int64_t requests_added;          /* accepted by st_engine_add */
    int64_t requests_finished[ST_FINISH_COUNT_];
    int64_t prompt_tokens;           /* prompt tokens computed (prefilled; recomputes after preemption
                                        count, prefix-cache hits do not) */
    int64_t generation_tokens;       /* tokens sampled */
    int64_t steps;                   /* steps that ran the model */
    int64_t step_tokens;             /* tokens those steps' forward passes ran (prompt chunks + decodes) */
    double step_seconds;             /* wall time of those steps (st_engine_step, sampling and
                                        callbacks included; not the idle time between steps) */
    double forward_seconds;          /* of which in the runner's forward passes (device sampling
                                        included); the rest is scheduling, host sampling, streaming */
    /* Decode-only steps (every sequence in the batch ran one token: no prompt
     * chunk), the ones whose rate is the decode throughput: how many, the
     * sequences they ran (= tokens), the keys those sequences attended over
     * (their context lengths summed over the steps), and their wall time. */
    int64_t decode_steps, decode_tokens, decode_kv_tokens;
    double decode_seconds;
    int64_t preemptions;             /* sequences sent back to waiting when KV blocks ran out */
    /* The paged KV pool, in blocks of kv_block_size tokens: blocks held by
     * live sequences (shared prefix blocks count once), and the pool size. */
    int64_t kv_block_size, kv_blocks_used, kv_blocks_total;
    /* Prefix cache, in prompt tokens: looked up / found already computed (in any
     * tier), and the hits by tier (device, host, SSD). */
    int64_t prefix_cache_queries, prefix_cache_hits;
    int64_t prefix_hits_device, prefix_hits_host, prefix_hits_ssd;
    int64_t kv_blocks_cached, kv_blocks_free; /* device pool: unheld blocks kept for prefix hits / empty */
    bool kv_tiers;                   /* a host tier (maybe an SSD tier) runs: kv_tier is filled */
    st_kv_tiers_stats kv_tier;
    int64_t kv_swaps;                /* preempted sequences whose KV came back from a lower tier */
    int64_t spec_drafted, spec_accepted; /* speculative drafts verified / accepted */
    int64_t pd_adopted, pd_cancelled; /* P-D tickets resolved each way */
    st_engine_hist ttft;             /* seconds from add to the first sampled token */
    st_engine_hist tbt;              /* seconds between consecutive sampled tokens of a request */
    st_engine_hist e2e;              /* seconds from add to finish */
} st_engine_metrics;

/* Builds an engine over an opened model: one st_llama shared by every request,
 * a paged KV pool (kv_blocks blocks), block manager, prefix cache and
 * scheduler (engine/runner.h), all made up front and reused.
 * Borrows files, be and tok: they must outlive the engine. The caller owns
 * *out (st_engine_free). On error *out is NULL and the message says why
 * (a bad parameter, or the model that could not be built). */
strata_status st_engine_init(const st_model_files *files, st_backend *be, const st_tokenizer *tok,
                             const st_engine_params *params, st_engine **out);

/* Stops the engine thread if running, finishes every pending request with
 * ST_FINISH_ABORT (on_finish runs on the calling thread), frees everything.
 * NULL is a no-op. */
void st_engine_free(st_engine *e);

/* The parameters in force (defaults filled in). */
const st_engine_params *st_engine_get_params(const st_engine *e);
/* The model's step costs (above). */
const st_engine_costs *st_engine_get_costs(const st_engine *e);
/* What samplers draw from: the tokenizer's vocabulary (<= the model's). */
int64_t st_engine_vocab(const st_engine *e);

/* Queues a request (everything is copied). On success *id is its id (> 0) and
 * the callbacks will be called (on_finish exactly once). Errors, with no
 * callback ever called: INVALID_ARG for a bad request (empty prompt, a prompt
 * of max_model_len tokens or more, ids outside the vocabulary, bad sampler
 * parameters, empty stop strings; the message names it), NOMEM when the
 * waiting queue is full, UNSUPPORTED after st_engine_stop. Thread-safe. */
strata_status st_engine_add(st_engine *e, const st_engine_request *req, const st_engine_callbacks *cb,
                            uint64_t *id);

/* Asks for request `id` to end: at the start of the next step it leaves the
 * queue or its slot (resources freed) and gets on_finish(ST_FINISH_ABORT).
 * NOT_FOUND when no such request is pending (unknown or finished). Thread-safe;
 * safe to call more than once. */
strata_status st_engine_abort(st_engine *e, uint64_t id);

/* One engine step (see the top of this file), on the calling thread. Must not
 * be called while the engine thread runs. *worked (may be NULL): whether
 * there was anything to do. Per-request failures finish that request with
 * ST_FINISH_ERROR; the step itself returns an error only when misused. */
strata_status st_engine_step(st_engine *e, bool *worked);

/* Whether a request is waiting or running. Thread-safe. */
bool st_engine_has_work(st_engine *e);

/* Starts the engine thread, which steps while there is work and sleeps
 * otherwise. INVALID_ARG when already started. */
strata_status st_engine_start(st_engine *e);
/* Stops and joins the engine thread (the step in progress completes), then
 * finishes every pending request with ST_FINISH_ABORT on the calling thread.
 * After it, st_engine_add refuses (UNSUPPORTED). Safe when not started. */
void st_engine_stop(st_engine *e);

/* ---- P-D: KV blocks computed by a prefill node ---------------------------------------------
 * A decode node reserves host-tier blocks (kv/kv_tiers.h) for the full
 * blocks of a prompt that neither its device nor its host tier holds (all
 * but the blocks of the last token, which it computes itself), lets the
 * transfer write them, then adopts them (they enter the host tier's index:
 * the admission of the request finds them as a prefix hit) or cancels the
 * reservation (the request computes its prompt itself). A request added
 * with kv_ticket waits, holding nothing, until its ticket is resolved. */
typedef struct {
    uint64_t ticket;          /* 0: nothing to transfer (n_blocks 0), no ticket */
    int64_t n_tokens, block_tokens;
    int64_t cached_blocks;    /* leading full blocks the node holds (device, then host tier) */
    int64_t n_blocks;         /* blocks [cached_blocks, cached_blocks + n_blocks) to receive */
    int64_t n_layers;
    size_t layer_bytes;       /* one layer of one block (kv/kv_pool.h st_kv_block_layout) */
    void *const *blocks;      /* [n_blocks]: block k's layer l at blocks[k] + l * layer_bytes; valid until
                                 the ticket is resolved; NULL when landing is set: */
    void *landing;            /* device memory (a landing arena: runner.h): block k's layer l at landing +
                                 l * landing_stride + k * layer_bytes */
    size_t landing_stride;
} st_engine_kv_reservation;
/* Called on the stepping thread: st != OK (NOMEM: the host tier is full;
 * the message says so) with res NULL, or the reservation. */
typedef void (*st_engine_reserve_fn)(void *user, strata_status st, const st_engine_kv_reservation *res);
/* Queues a reservation for tokens[0..n_tokens) (copied), made at the start
 * of the next step: in the landing arena when the engine has one, else in
 * the host tier. UNSUPPORTED without either or once stopped,
 * INVALID_ARG for ids outside the vocabulary. Thread-safe. */
strata_status st_engine_kv_reserve(st_engine *e, const int32_t *tokens, int64_t n_tokens, st_engine_reserve_fn fn,
                                   void *user);
/* Queues the end of a ticket: adopt (every block landed; nothing may write
 * them any more) or cancel (the caller made sure nothing writes them any
 * more). Unknown tickets are ignored. Thread-safe. */
strata_status st_engine_kv_resolve(st_engine *e, uint64_t ticket, bool adopt);

/* The KV layout of a transfer: layers, bytes of one layer of one block, and
 * the model + KV layout identity (st_runner_model_identity). */
void st_engine_kv_layout(const st_engine *e, int64_t *n_layers, size_t *layer_bytes, uint64_t *identity);
/* Block slots of the runner's landing arena (0: none). */
int64_t st_engine_kv_landing_blocks(const st_engine *e);

/* Copies the counters. Thread-safe. */
void st_engine_metrics_get(st_engine *e, st_engine_metrics *out);

#ifdef __cplusplus
}
#endif

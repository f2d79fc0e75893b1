/* engine/seq: the request record — one struct per request, shared by the
 * engine, the runner and the scheduler (nano-vllm's Sequence).
 *
 * It holds the request's token ids (tokens[0..n_prompt) the prompt,
 * tokens[n_prompt..n_tokens) the generated ids, in order), its sampling
 * parameters and its own sampler, its stop ids and stop strings, max_tokens,
 * its status, its KV block table, counters, how it finished, and the
 * caller's callbacks / user pointer.
 *
 * kv.n_computed tokens have their KV in the cache, so tokens[kv.n_computed ..
 * n_tokens) are "pending": they must run through the model before the next
 * token can be sampled. A decoding sequence has exactly one pending token
 * (the last sampled one); a prefilling one has more (the rest of its prompt,
 * or after a preemption its prompt and generated tokens, all recomputed).
 *
 * Life: st_seq_create checks the request once (the only validation: the
 * runner and the scheduler assert) and makes a WAITING record. Its creator
 * owns it (st_seq_free) and lends it to the runner / scheduler
 * (st_runner_add, st_scheduler_add) until it is FINISHED: then it has left
 * them (blocks released) and fin says why. Who does what:
 *   - the scheduler: status, KV table, n_cached, n_preemptions, appending
 *     sampled ids, finishing at max_tokens / max_model_len (LENGTH);
 *   - the runner: sampling (sampler), then st_seq_postprocess — the one
 *     place where stop ids and stop strings are checked and the new text is
 *     made (detokenizer, never half a UTF-8 character; stop-string filter);
 *   - the engine: callbacks, timing, the finish info it hands to on_finish.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"
#include "engine/sampler.h"
#include "engine/stop.h"
#include "kv/block_manager.h"
#include "tokenizer/tokenizer.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ST_SEQ_WAITING = 0, /* not admitted yet, or preempted: holds no KV blocks */
    ST_SEQ_RUNNING,     /* admitted: holds blocks for kv.n_slots positions */
    ST_SEQ_FINISHED,    /* left the scheduler (blocks released); fin says why */
} st_seq_status;

/* Why a request ended: the one finish-reason enum (the detail is in
 * st_finish_info: which stop id / stop string, max_tokens or the context). */
typedef enum {
    ST_FINISH_STOP = 0, /* a stop id (EOS, end of turn, the request's ids) or a stop string */
    ST_FINISH_LENGTH,   /* max_tokens reached, or the sequence filled max_model_len */
    ST_FINISH_ABORT,    /* cancelled (st_engine_abort, the engine stopped) */
    ST_FINISH_ERROR,    /* the forward pass or the sampler failed (message in error) */
    ST_FINISH_COUNT_
} st_finish_reason;

const char *st_finish_reason_name(st_finish_reason r); /* "stop", "length", "abort", "error" */

/* How a request ended, as on_finish receives it. Times are seconds from
 * st_engine_add (0 outside the engine). */
typedef struct {
    st_finish_reason reason;
    int32_t stop_id;           /* STOP by a sampled stop id: the id (its text is not emitted); else -1 */
    int stop_string;           /* STOP by a stop string: its index in the request's list; else -1 */
    bool context_full;         /* LENGTH: the sequence filled max_model_len (false: max_tokens) */
    int64_t prompt_tokens;
    int64_t completion_tokens; /* tokens sampled (a final stop id counts) */
    int64_t cached_tokens;     /* prompt tokens served from the prefix cache instead of computed
                                  (at its first admission) */
    int64_t preemptions;       /* times it was sent back to waiting (recompute) */
    double queue_s;            /* until it got a slot */
    double ttft_s;             /* until its first sampled token (< 0: none) */
    double total_s;
    const char *error;         /* ERROR: why; else NULL. Valid during the callback only */
} st_finish_info;

/* The detail as a word: "eos" (a stop id), "stop_string", "max_tokens",
 * "context_full", "abort" or "error". Static string. */
const char *st_finish_detail(const st_finish_info *f);

/* P-D: one layer of a run of blocks of a prefill-only request's prompt, on its
 * way to a decode node (kv/kv_pool.h st_kv_block_layout: block k's part at
 * data + k * layer_bytes). */
typedef struct {
    int64_t layer, first_block, n_blocks; /* blocks of the prompt (block i = tokens [i*bs, (i+1)*bs)) */
    void *data;                           /* from kv_buffer: the callee's from on_kv on */
    size_t bytes;                         /* n_blocks * layer_bytes */
} st_kv_piece;

/* The caller's callbacks (the engine calls them on its stepping thread).
 * on_text gets each new piece of output text (complete UTF-8, len > 0, not
 * NUL-terminated, valid during the call); on_finish is called exactly once,
 * last. `user` is handed back to both. */
typedef struct {
    void (*on_text)(void *user, const char *text, size_t len);
    void (*on_finish)(void *user, const st_finish_info *fin);
    void *user;
    /* A request with export_kv: kv_buffer gives memory for one
     * piece (NULL: the request ends with an error; the stepping thread, before
     * a pass), on_kv hands the filled piece over (its data is the callee's
     * from then on) on the runner's export thread, as soon as that layer's
     * copy completed while the pass computes the next layers. */
    void *(*kv_buffer)(void *user, size_t bytes);
    void (*on_kv)(void *user, const st_kv_piece *piece);
} st_seq_callbacks;

/* A request, as a caller gives it (everything is copied by st_seq_create). */
typedef struct {
    const int32_t *prompt;     /* [n_prompt] token ids in [0, vocab) */
    int64_t n_prompt;          /* >= 1 and < max_model_len */
    st_sampler_params sampler; /* its own random state, seeded from sampler.seed */
    int64_t max_tokens;        /* > 0: at most this many sampled tokens; 0: until max_model_len is full */
    const char *const *stop;   /* stop strings (non-empty, valid UTF-8); may be NULL. Need a tokenizer */
    int n_stop;
    const int32_t *stop_ids;   /* ids that end the request (beside the tokenizer's) */
    int n_stop_ids;
    bool ignore_eos;           /* the tokenizer's stop ids do not end it (benchmarks); stop_ids still do */
    /* P-D. prefill_only: the prompt's KV is computed (prefix cache, chunks as
     * usual), nothing is sampled; the request ends STOP once the whole prompt
     * is computed. export_kv (prefill_only only): after
     * each step, every layer of the full prompt blocks from that one on that
     * became computed goes to on_kv (callbacks), in block order per layer.
     * kv_ticket != 0: the request waits, holding nothing, until the engine's
     * transfer `kv_ticket` is adopted or cancelled (engine.h). */
    bool prefill_only;
    bool export_kv;
    int64_t export_from_block;
    uint64_t kv_ticket;
} st_request;

/* What a request is checked against at admission. */
typedef struct {
    int64_t vocab;             /* prompt ids and sampled ids: [0, vocab), >= 1 */
    int64_t max_model_len;     /* prompt + output, >= 2 */
    const st_tokenizer *tok;   /* NULL: no text (no detokenizer, no stop strings, no tokenizer stop
                                  ids); else borrowed: it must outlive the record */
} st_seq_limits;

typedef struct st_seq {
    uint64_t id;               /* the caller's id, unique among live sequences */
    uint64_t arrival;          /* scheduler: add order, FCFS priority, smaller = older = first */
    st_seq_status status;
    int32_t *tokens;           /* [n_tokens] prompt then generated ids; owned */
    int64_t n_tokens, cap;
    int64_t n_prompt;
    /* the request */
    st_sampler_params sampling;
    st_sampler *sampler;       /* owned; draws from [0, limits.vocab) */
    int64_t max_tokens;        /* > 0: at most this many generated tokens; 0: until max_model_len */
    int32_t *stop_ids;         /* [n_stop_ids] the tokenizer's (unless ignore_eos) + the request's; owned */
    int n_stop_ids;
    st_stop_filter *stop;      /* the stop strings and the text held back; owned */
    st_detok *detok;           /* NULL without a tokenizer; owned */
    /* output of the last st_seq_postprocess: the new text (not NUL-terminated) */
    char *text;
    size_t n_text, text_cap;
    /* KV and counters (scheduler) */
    st_block_table kv;         /* its KV blocks (see kv/block_manager.h) */
    int64_t n_preemptions;     /* times it was sent back to waiting */
    int64_t n_cached;          /* prompt tokens found in the prefix cache at its first admission (-1: not yet) */
    int64_t plan;              /* scheduler scratch: this step's plan entry, -1 none */
    /* the end: fin.reason etc. once FINISHED */
    st_finish_info fin;
    char error[256];           /* ERROR: the message fin.error points to */
    /* the caller's */
    st_seq_callbacks cb;
    double t_add, t_admit, t_first, t_last; /* engine timing (st_time_now) */
    struct st_seq *next, *prev;             /* engine lists */
    bool abort;                             /* engine: abort asked (under its lock) */
    /* P-D (st_request) */
    bool prefill_only;
    int64_t export_from;                    /* -1: none */
    int64_t exported;                       /* runner: blocks [export_from, exported) went to on_kv */
    uint64_t kv_ticket;                     /* engine: the transfer it waits for (0: none) */
    /* speculative decoding (engine/spec.h): n_draft drafts proposed for the next step wait at
     * tokens[n_tokens .. n_tokens + n_draft) (room reserved; not tokens of the sequence yet) */
    int64_t n_draft;
    struct {
        double accepted, judged;            /* decayed counts: drafts accepted / accepted or rejected */
        int32_t slot;                       /* the draft model's KV slot (-1: none) */
        int64_t draft_done;                 /* positions [0, draft_done) are in the draft model's KV */
    } spec;
} st_seq;

/* Checks req against lim — the only validation of a request (INVALID_ARG
 * naming the bad field: empty prompt, a prompt of max_model_len tokens or
 * more, ids outside the vocabulary, negative max_tokens, bad sampler
 * parameters, bad stop lists or strings, stop strings without a tokenizer)
 * and makes a WAITING record with copies of everything, its sampler, stop
 * filter and detokenizer. cb may be NULL. The caller owns *out
 * (st_seq_free); NULL on error. */
strata_status st_seq_create(const st_request *req, const st_seq_limits *lim, const st_seq_callbacks *cb,
                            uint64_t id, st_seq **out);
/* Frees the record; it must not be live in a scheduler (its blocks released).
 * NULL: no-op. */
void st_seq_free(st_seq *s);

/* Makes room for n_tokens ids in tokens (NOMEM, s unchanged, on failure). */
strata_status st_seq_reserve(st_seq *s, int64_t n_tokens);
/* Appends one generated id; room must have been reserved (asserted). */
void st_seq_append(st_seq *s, int32_t token);

/* After `token` was sampled and appended (st_scheduler_update): checks the
 * stop ids and the stop strings (the one place they are checked) and adds
 * to the new text in s->text / s->n_text (the caller empties it before a
 * step's tokens): the token's text through the detokenizer and the stop
 * filter, plus, when the sequence ends here (a stop, or `last` — the step's
 * last token — of a sequence already FINISHED by the scheduler for LENGTH),
 * what they held back.
 * *stop: the sequence stops now (fin.reason = STOP, with stop_id or
 * stop_string set; when the scheduler had finished it for LENGTH and a stop
 * string completes in its last text, the reason becomes STOP). The status is
 * not changed: the caller (runner) takes a stopped live sequence out of its
 * scheduler (st_scheduler_finish, which makes it FINISHED). NOMEM. */
strata_status st_seq_postprocess(st_seq *s, int32_t token, bool last, bool *stop);

/* Marks s FINISHED for `reason` (fin.reason; ERROR: the message copied from
 * `error`, may be NULL). Does not touch the scheduler. */
void st_seq_set_finished(st_seq *s, st_finish_reason reason, const char *error);

static inline int64_t st_seq_n_generated(const st_seq *s) { return s->n_tokens - s->n_prompt; }
static inline int64_t st_seq_n_pending(const st_seq *s) { return s->n_tokens - s->kv.n_computed; }

#ifdef __cplusplus
}
#endif

/* The serving engine: request queue, per-step planning, per-slot execution,
 * sampling and stop handling. See engine.h.
 *
 * Locking: e->mu guards the waiting queue, the slot table (which sequence
 * holds which slot), every sequence's abort flag, the counters and the
 * stopped/started flags. A sequence's generation state (tokens, sampler,
 * detokenizer, stop filter, positions) belongs to the stepping thread alone,
 * and callbacks are called without the lock held. */
#include "engine/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/llama.h"

#define DEF_MAX_BATCH 8
#define DEF_MAX_MODEL_LEN 2048
#define DEF_PREFILL_CHUNK 256
#define DEF_MAX_WAITING 4096
#define KV_BLOCK_TOKENS 16

const char *st_finish_reason_name(st_finish_reason r) {
    switch (r) {
    case ST_FINISH_STOP: return "stop";
    case ST_FINISH_LENGTH: return "length";
    case ST_FINISH_ABORT: return "abort";
    case ST_FINISH_ERROR: return "error";
    case ST_FINISH_COUNT_: break;
    }
    return "?";
}

/* ---- one request ------------------------------------------------------------------*/
typedef struct seq {
    uint64_t id;
    struct seq *next;          /* waiting queue link */
    st_engine_callbacks cb;
    /* tokens[0..n_prompt) the prompt, then the sampled tokens (stop ids not kept) */
    int32_t *tokens;
    int64_t n_prompt, n_tokens, cap;
    int64_t n_computed;        /* tokens whose K/V the slot holds */
    int64_t budget;            /* most tokens to sample: min(max_tokens, max_model_len - n_prompt) */
    bool budget_is_max_tokens; /* the budget came from max_tokens (finish detail MAX_TOKENS) */
    int64_t n_sampled;         /* a final stop id counts */
    int32_t *stop_ids;         /* the tokenizer's (unless ignore_eos) + the request's */
    int n_stop_ids;
    st_sampler *sampler;
    st_detok *detok;
    st_stop_filter *filter;
    int slot;                  /* -1 while waiting */
    bool abort;                /* under e->mu */
    double t_add, t_admit, t_first, t_last;
} seq;

typedef struct {
    st_llama *model;   /* its own contiguous KV cache of max_model_len tokens */
    float *logits;     /* [model vocab], host */
    seq *s;            /* the holder, NULL when free (under e->mu) */
} slot;

/* One unit of a step's work: tokens[pos .. pos+n) of a sequence. */
typedef struct {
    seq *s;
    int64_t pos, n;
    bool sample;       /* the chunk ends the prompt, or it is a decode: sample after it */
} work;

struct st_engine {
    const st_model_files *files;
    st_backend *be;
    const st_tokenizer *tok;
    st_engine_params p;
    int64_t vocab;        /* tokenizer's: what samplers draw from, what prompts may hold */
    int64_t model_vocab;  /* logits row length */
    const int32_t *tok_stop_ids;
    int n_tok_stop_ids;

    slot *slots;          /* [max_batch] */
    work *plan;           /* [max_batch] scratch of the stepping thread */
    seq **order;          /* [max_batch] scratch */

    pthread_mutex_t mu;
    pthread_cond_t cv;    /* work arrived, or stop */
    seq *wait_head, *wait_tail;
    int64_t n_waiting, n_running;
    uint64_t next_id;
    bool stopped;         /* add refuses */
    bool thread_on, thread_stop;
    pthread_t thread;
    st_engine_metrics m;  /* counters (running/waiting filled on read) */
};

/* ---- histograms --------------------------------------------------------------------*/
static void hist_init(st_engine_hist *h, const double *bounds, int n) {
    memset(h, 0, sizeof *h);
    ST_ASSERT(n <= ST_ENGINE_HIST_MAX);
    h->n_bounds = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof *bounds);
}

static void hist_observe(st_engine_hist *h, double v) {
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

/* ---- sequences ----------------------------------------------------------------------*/
static void seq_free(seq *s) {
    if (!s) return;
    st_free(s->tokens);
    st_free(s->stop_ids);
    st_sampler_free(s->sampler);
    st_detok_free(s->detok);
    st_stop_filter_free(s->filter);
    st_free(s);
}

static int64_t kv_blocks(int64_t n) { return (n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS; }

/* Calls on_finish and frees s. The caller has already taken s out of the
 * queue / its slot (under the lock) and updated nothing else. */
static void seq_finish(st_engine *e, seq *s, st_finish_reason reason, st_stop_reason stop, const char *error) {
    const double now = st_time_now();
    st_engine_finish fin = {
        .reason = reason,
        .stop = stop,
        .prompt_tokens = s->n_prompt,
        .completion_tokens = s->n_sampled,
        .cached_tokens = 0,
        .queue_s = (s->t_admit > 0 ? s->t_admit : now) - s->t_add,
        .ttft_s = s->t_first > 0 ? s->t_first - s->t_add : -1.0,
        .total_s = now - s->t_add,
        .error = error,
    };
    if (fin.queue_s < 0) fin.queue_s = 0;
    pthread_mutex_lock(&e->mu);
    e->m.requests_finished[reason]++;
    hist_observe(&e->m.e2e, fin.total_s);
    pthread_mutex_unlock(&e->mu);
    if (s->cb.on_finish) s->cb.on_finish(s->cb.user, &fin);
    seq_free(s);
}

/* ---- init / free --------------------------------------------------------------------*/
static const double TTFT_BOUNDS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                     1.0,  1.5,   2.0,  2.5,   5.0, 7.5,  10.0, 20.0, 40.0, 80.0};
static const double TBT_BOUNDS[] = {0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                                    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5,  5.0,   10.0};
static const double E2E_BOUNDS[] = {0.1, 0.25, 0.5,  1.0,  2.5,  5.0,  10.0,  15.0,
                                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0};
#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))

strata_status st_engine_init(const st_model_files *files, st_backend *be, const st_tokenizer *tok,
                             const st_engine_params *params, st_engine **out) {
    *out = NULL;
    if (!files || !be || !tok) return st_err(STRATA_ERR_INVALID_ARG, "engine: no model, backend or tokenizer");
    st_engine_params p = params ? *params : (st_engine_params){0};
    const st_config *cfg = &files->config;
    if (p.max_batch < 0 || p.max_model_len < 0 || p.prefill_chunk < 0 || p.step_tokens < 0 || p.max_waiting < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "engine: negative parameter");
    if (p.max_batch == 0) p.max_batch = DEF_MAX_BATCH;
    if (p.max_batch > 4096) return st_err(STRATA_ERR_INVALID_ARG, "engine: max_batch %lld > 4096", (long long)p.max_batch);
    if (p.max_model_len == 0) {
        p.max_model_len = DEF_MAX_MODEL_LEN;
        if (cfg->max_position_embeddings > 0 && cfg->max_position_embeddings < p.max_model_len)
            p.max_model_len = cfg->max_position_embeddings;
    }
    if (p.max_model_len < 2) return st_err(STRATA_ERR_INVALID_ARG, "engine: max_model_len %lld < 2", (long long)p.max_model_len);
    if (cfg->max_position_embeddings > 0 && p.max_model_len > cfg->max_position_embeddings)
        st_log(STRATA_LOG_WARN, "engine: max_model_len %lld is beyond the model's %lld positions",
               (long long)p.max_model_len, (long long)cfg->max_position_embeddings);
    if (p.prefill_chunk == 0) p.prefill_chunk = DEF_PREFILL_CHUNK;
    if (p.prefill_chunk > p.max_model_len) p.prefill_chunk = p.max_model_len;
    if (p.step_tokens == 0) p.step_tokens = p.prefill_chunk + p.max_batch;
    if (p.step_tokens < p.prefill_chunk)
        return st_err(STRATA_ERR_INVALID_ARG, "engine: step_tokens %lld < prefill_chunk %lld",
                      (long long)p.step_tokens, (long long)p.prefill_chunk);
    if (p.max_waiting == 0) p.max_waiting = DEF_MAX_WAITING;

    st_engine *e = st_calloc(1, sizeof *e);
    if (!e) return st_err(STRATA_ERR_NOMEM, "engine: out of memory");
    e->files = files;
    e->be = be;
    e->tok = tok;
    e->p = p;
    e->model_vocab = cfg->vocab_size;
    e->vocab = st_tokenizer_vocab_size(tok);
    e->next_id = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->n_tok_stop_ids = st_tokenizer_stop_ids(tok, &e->tok_stop_ids);
    e->m.max_batch = p.max_batch;
    e->m.max_model_len = p.max_model_len;
    e->m.kv_block_size = KV_BLOCK_TOKENS;
    e->m.kv_blocks_total = p.max_batch * kv_blocks(p.max_model_len);
    hist_init(&e->m.ttft, TTFT_BOUNDS, NELEM(TTFT_BOUNDS));
    hist_init(&e->m.tbt, TBT_BOUNDS, NELEM(TBT_BOUNDS));
    hist_init(&e->m.e2e, E2E_BOUNDS, NELEM(E2E_BOUNDS));
    if (e->vocab > e->model_vocab) {
        strata_status st = st_err(STRATA_ERR_MISMATCH, "engine: the tokenizer has %lld tokens, the model %lld",
                                  (long long)e->vocab, (long long)e->model_vocab);
        st_engine_free(e);
        return st;
    }

    e->slots = st_calloc((size_t)p.max_batch, sizeof *e->slots);
    e->plan = st_calloc((size_t)p.max_batch, sizeof *e->plan);
    e->order = st_calloc((size_t)p.max_batch, sizeof *e->order);
    if (!e->slots || !e->plan || !e->order) {
        st_engine_free(e);
        return st_err(STRATA_ERR_NOMEM, "engine: out of memory");
    }
    const st_llama_params lp = {.max_ctx = p.max_model_len, .max_batch = p.prefill_chunk};
    for (int64_t i = 0; i < p.max_batch; i++) {
        strata_status st = st_llama_init(files, be, &lp, &e->slots[i].model);
        if (st == STRATA_OK && !(e->slots[i].logits = st_malloc((size_t)e->model_vocab * sizeof(float))))
            st = st_err(STRATA_ERR_NOMEM, "engine: out of memory for logits");
        if (st != STRATA_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            st_engine_free(e);
            return st_err(st, "engine: sequence slot %lld of %lld: %s", (long long)i + 1, (long long)p.max_batch, msg);
        }
    }
    *out = e;
    return STRATA_OK;
}

/* Takes every pending request out (under the lock) and finishes it with ABORT. */
static void abort_all(st_engine *e) {
    seq *list = NULL;
    pthread_mutex_lock(&e->mu);
    e->stopped = true;
    for (seq *s = e->wait_head; s;) {
        seq *nx = s->next;
        s->next = list;
        list = s;
        s = nx;
    }
    e->wait_head = e->wait_tail = NULL;
    e->n_waiting = 0;
    if (e->slots)
        for (int64_t i = 0; i < e->p.max_batch; i++)
            if (e->slots[i].s) {
                seq *s = e->slots[i].s;
                e->slots[i].s = NULL;
                e->n_running--;
                s->next = list;
                list = s;
                st_llama_reset(e->slots[i].model);
            }
    e->m.kv_blocks_used = 0;
    pthread_mutex_unlock(&e->mu);
    while (list) {
        seq *nx = list->next;
        seq_finish(e, list, ST_FINISH_ABORT, ST_STOP_NONE, NULL);
        list = nx;
    }
}

void st_engine_free(st_engine *e) {
    if (!e) return;
    st_engine_stop(e);
    if (e->slots)
        for (int64_t i = 0; i < e->p.max_batch; i++) {
            st_llama_free(e->slots[i].model);
            st_free(e->slots[i].logits);
        }
    st_free(e->slots);
    st_free(e->plan);
    st_free(e->order);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    st_free(e);
}

const st_engine_params *st_engine_get_params(const st_engine *e) { return &e->p; }
int64_t st_engine_vocab(const st_engine *e) { return e->vocab; }

/* ---- add / abort ------------------------------------------------------------------------*/
strata_status st_engine_add(st_engine *e, const st_engine_request *req, const st_engine_callbacks *cb,
                            uint64_t *id) {
    if (id) *id = 0;
    if (!req || !cb || !id) return st_err(STRATA_ERR_INVALID_ARG, "engine add: no request, callbacks or id");
    if (req->n_prompt < 1 || !req->prompt) return st_err(STRATA_ERR_INVALID_ARG, "the prompt is empty");
    if (req->n_prompt >= e->p.max_model_len)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "the prompt has %lld tokens; the context holds %lld (prompt and output together)",
                      (long long)req->n_prompt, (long long)e->p.max_model_len);
    for (int64_t i = 0; i < req->n_prompt; i++)
        if (req->prompt[i] < 0 || req->prompt[i] >= e->vocab)
            return st_err(STRATA_ERR_INVALID_ARG, "prompt token %lld: id %d is outside the vocabulary [0, %lld)",
                          (long long)i, req->prompt[i], (long long)e->vocab);
    if (req->max_tokens < 0) return st_err(STRATA_ERR_INVALID_ARG, "max_tokens %lld < 0", (long long)req->max_tokens);
    if (req->n_stop < 0 || req->n_stop_ids < 0 || (req->n_stop_ids > 0 && !req->stop_ids))
        return st_err(STRATA_ERR_INVALID_ARG, "engine add: bad stop lists");

    seq *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "engine add: out of memory");
    s->slot = -1;
    s->cb = *cb;
    s->n_prompt = req->n_prompt;
    const int64_t ctx_budget = e->p.max_model_len - req->n_prompt;
    s->budget = ctx_budget;
    if (req->max_tokens > 0 && req->max_tokens <= ctx_budget) {
        s->budget = req->max_tokens;
        s->budget_is_max_tokens = true;
    }
    s->cap = req->n_prompt + (s->budget < 256 ? s->budget : 256);
    strata_status st = STRATA_OK;
    if (!(s->tokens = st_malloc((size_t)s->cap * sizeof *s->tokens))) goto oom;
    memcpy(s->tokens, req->prompt, (size_t)req->n_prompt * sizeof *s->tokens);
    s->n_tokens = req->n_prompt;
    const int n_ids = (req->ignore_eos ? 0 : e->n_tok_stop_ids) + req->n_stop_ids;
    if (n_ids > 0) {
        if (!(s->stop_ids = st_malloc((size_t)n_ids * sizeof *s->stop_ids))) goto oom;
        if (!req->ignore_eos)
            for (int i = 0; i < e->n_tok_stop_ids; i++) s->stop_ids[s->n_stop_ids++] = e->tok_stop_ids[i];
        for (int i = 0; i < req->n_stop_ids; i++) s->stop_ids[s->n_stop_ids++] = req->stop_ids[i];
    }
    if ((st = st_sampler_init(&req->sampler, e->vocab, &s->sampler))) goto fail;
    if ((st = st_detok_init(e->tok, true, &s->detok))) goto fail;
    if ((st = st_stop_filter_init(req->stop, req->n_stop, &s->filter))) goto fail;

    pthread_mutex_lock(&e->mu);
    if (e->stopped) {
        pthread_mutex_unlock(&e->mu);
        st = st_err(STRATA_ERR_UNSUPPORTED, "the engine is stopped");
        goto fail;
    }
    if (e->n_waiting >= e->p.max_waiting) {
        pthread_mutex_unlock(&e->mu);
        st = st_err(STRATA_ERR_NOMEM, "the engine's queue is full (%lld requests waiting)", (long long)e->n_waiting);
        goto fail;
    }
    s->id = e->next_id++;
    s->t_add = st_time_now();
    if (e->wait_tail) e->wait_tail->next = s;
    else e->wait_head = s;
    e->wait_tail = s;
    e->n_waiting++;
    e->m.requests_added++;
    *id = s->id;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return STRATA_OK;
oom:
    st = st_err(STRATA_ERR_NOMEM, "engine add: out of memory");
fail:
    seq_free(s);
    return st;
}

strata_status st_engine_abort(st_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    bool found = false;
    for (seq *s = e->wait_head; s && !found; s = s->next)
        if (s->id == id) s->abort = found = true;
    for (int64_t i = 0; i < e->p.max_batch && !found; i++)
        if (e->slots[i].s && e->slots[i].s->id == id) e->slots[i].s->abort = found = true;
    if (found) pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return found ? STRATA_OK : st_err(STRATA_ERR_NOT_FOUND, "no pending request %llu", (unsigned long long)id);
}

static bool has_work_locked(const st_engine *e) { return e->n_waiting > 0 || e->n_running > 0; }

bool st_engine_has_work(st_engine *e) {
    pthread_mutex_lock(&e->mu);
    bool w = has_work_locked(e);
    pthread_mutex_unlock(&e->mu);
    return w;
}

void st_engine_metrics_get(st_engine *e, st_engine_metrics *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->m;
    out->running = e->n_running;
    out->waiting = e->n_waiting;
    pthread_mutex_unlock(&e->mu);
}

/* ---- one step ------------------------------------------------------------------------*/

/* Frees slot i (under the lock): the next holder starts with an empty cache. */
static void slot_release_locked(st_engine *e, int64_t i) {
    e->slots[i].s = NULL;
    e->n_running--;
    st_llama_reset(e->slots[i].model);
}

/* Ids grow with add order: a smaller id is an older request. */
static int by_age(const void *a, const void *b) {
    const uint64_t x = (*(seq *const *)a)->id, y = (*(seq *const *)b)->id;
    return x < y ? -1 : x > y;
}

/* Part 1: aborts out, waiting requests into free slots (FCFS). Fills
 * e->order with the running sequences, oldest first; returns their count. */
static int64_t step_admit(st_engine *e, seq **aborted) {
    *aborted = NULL;
    pthread_mutex_lock(&e->mu);
    /* aborted waiting requests leave the queue */
    seq **pp = &e->wait_head;
    e->wait_tail = NULL;
    while (*pp) {
        seq *s = *pp;
        if (s->abort) {
            *pp = s->next;
            s->next = *aborted;
            *aborted = s;
            e->n_waiting--;
        } else {
            e->wait_tail = s;
            pp = &s->next;
        }
    }
    /* aborted running ones leave their slot */
    for (int64_t i = 0; i < e->p.max_batch; i++) {
        seq *s = e->slots[i].s;
        if (s && s->abort) {
            slot_release_locked(e, i);
            s->next = *aborted;
            *aborted = s;
        }
    }
    /* admit, first come first served */
    const double now = st_time_now();
    for (int64_t i = 0; i < e->p.max_batch && e->wait_head; i++) {
        if (e->slots[i].s) continue;
        seq *s = e->wait_head;
        e->wait_head = s->next;
        if (!e->wait_head) e->wait_tail = NULL;
        s->next = NULL;
        e->n_waiting--;
        s->slot = (int)i;
        s->t_admit = now;
        e->slots[i].s = s;
        e->n_running++;
        e->m.prefix_cache_queries += s->n_prompt; /* no prefix cache with per-slot KV: never a hit */
    }
    int64_t n = 0;
    for (int64_t i = 0; i < e->p.max_batch; i++)
        if (e->slots[i].s) e->order[n++] = e->slots[i].s;
    pthread_mutex_unlock(&e->mu);
    qsort(e->order, (size_t)n, sizeof *e->order, by_age); /* oldest first */
    return n;
}

/* Part 2: the plan. Decodes first (one token each), then prompt chunks under
 * the token budget, oldest first; the oldest prefill always runs. A chunk
 * starts at a multiple of prefill_chunk, so its boundaries depend on the
 * prompt alone (batch invariance). */
static int64_t step_plan(st_engine *e, int64_t n_running, int64_t *n_tokens) {
    int64_t n = 0, used = 0;
    for (int64_t i = 0; i < n_running; i++) {
        seq *s = e->order[i];
        if (s->n_computed >= s->n_prompt) {
            e->plan[n++] = (work){.s = s, .pos = s->n_computed, .n = 1, .sample = true};
            used++;
        }
    }
    bool first_prefill = true;
    for (int64_t i = 0; i < n_running; i++) {
        seq *s = e->order[i];
        if (s->n_computed >= s->n_prompt) continue;
        int64_t k = s->n_prompt - s->n_computed;
        if (k > e->p.prefill_chunk) k = e->p.prefill_chunk;
        if (!first_prefill && used + k > e->p.step_tokens) continue; /* a later step */
        first_prefill = false;
        e->plan[n++] = (work){.s = s, .pos = s->n_computed, .n = k, .sample = s->n_computed + k == s->n_prompt};
        used += k;
    }
    *n_tokens = used;
    return n;
}

/* Takes sequence s out of its slot (under the lock). */
static void seq_leave(st_engine *e, seq *s) {
    pthread_mutex_lock(&e->mu);
    if (s->slot >= 0 && e->slots[s->slot].s == s) slot_release_locked(e, s->slot);
    pthread_mutex_unlock(&e->mu);
}

/* Detokenized text -> stop filter -> on_text. *stopped: a stop string appeared. */
static strata_status emit(seq *s, const char *text, size_t len, bool *stopped) {
    *stopped = false;
    if (len == 0) return STRATA_OK;
    const char *out;
    size_t n;
    strata_status st = st_stop_filter_push(s->filter, text, len, &out, &n, stopped);
    if (st) return st;
    if (n > 0 && s->cb.on_text) s->cb.on_text(s->cb.user, out, n);
    return STRATA_OK;
}

/* End of output (stop id or length): what the detokenizer and the stop
 * filter still hold. *stopped: the held text completed a stop string. */
static strata_status emit_end(seq *s, bool *stopped) {
    const char *text;
    size_t len;
    strata_status st = st_detok_flush(s->detok, &text, &len);
    if (st) return st;
    if ((st = emit(s, text, len, stopped))) return st;
    if (*stopped) return STRATA_OK;
    st_stop_filter_flush(s->filter, &text, &len);
    if (len > 0 && s->cb.on_text) s->cb.on_text(s->cb.user, text, len);
    return STRATA_OK;
}

/* Part 4 for one sequence whose logits are ready: sample, stream, stop.
 * Returns true when s finished (and was freed). */
static bool seq_sample(st_engine *e, seq *s, const float *logits, int64_t *n_sampled) {
    int32_t t;
    strata_status st = st_sampler_sample(s->sampler, logits, s->tokens, s->n_tokens, &t);
    if (st) goto error;
    const double now = st_time_now();
    pthread_mutex_lock(&e->mu);
    if (s->n_sampled == 0) hist_observe(&e->m.ttft, now - s->t_add);
    else hist_observe(&e->m.tbt, now - s->t_last);
    pthread_mutex_unlock(&e->mu);
    if (s->n_sampled == 0) s->t_first = now;
    s->t_last = now;
    s->n_sampled++;
    (*n_sampled)++;
    bool stopped = false;
    for (int i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] == t) {
            if ((st = emit_end(s, &stopped))) goto error;
            seq_leave(e, s);
            seq_finish(e, s, ST_FINISH_STOP, stopped ? ST_STOP_STRING : ST_STOP_EOS, NULL);
            return true;
        }
    if (s->n_tokens == s->cap) {
        int64_t cap = s->cap * 2;
        if (cap > s->n_prompt + s->budget) cap = s->n_prompt + s->budget;
        if (cap <= s->cap) cap = s->cap + 1;
        int32_t *nt = st_realloc(s->tokens, (size_t)cap * sizeof *nt);
        if (!nt) {
            st = st_err(STRATA_ERR_NOMEM, "out of memory for the sequence's tokens");
            goto error;
        }
        s->tokens = nt;
        s->cap = cap;
    }
    s->tokens[s->n_tokens++] = t;
    const char *text;
    size_t len;
    if ((st = st_detok_push(s->detok, t, &text, &len))) goto error;
    if ((st = emit(s, text, len, &stopped))) goto error;
    if (stopped) {
        seq_leave(e, s);
        seq_finish(e, s, ST_FINISH_STOP, ST_STOP_STRING, NULL);
        return true;
    }
    if (s->n_sampled >= s->budget) {
        if ((st = emit_end(s, &stopped))) goto error;
        seq_leave(e, s);
        seq_finish(e, s, stopped ? ST_FINISH_STOP : ST_FINISH_LENGTH,
                   stopped ? ST_STOP_STRING : s->budget_is_max_tokens ? ST_STOP_MAX_TOKENS : ST_STOP_CONTEXT, NULL);
        return true;
    }
    return false;
error: {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        seq_leave(e, s);
        seq_finish(e, s, ST_FINISH_ERROR, ST_STOP_NONE, msg);
        return true;
    }
}

strata_status st_engine_step(st_engine *e, bool *worked) {
    if (worked) *worked = false;
    seq *aborted;
    const int64_t n_running = step_admit(e, &aborted);
    while (aborted) {
        seq *nx = aborted->next;
        seq_finish(e, aborted, ST_FINISH_ABORT, ST_STOP_NONE, NULL);
        aborted = nx;
        if (worked) *worked = true;
    }
    if (n_running == 0) {
        pthread_mutex_lock(&e->mu);
        e->m.kv_blocks_used = 0;
        pthread_mutex_unlock(&e->mu);
        return STRATA_OK;
    }
    if (worked) *worked = true;

    int64_t n_tokens = 0;
    const int64_t n_work = step_plan(e, n_running, &n_tokens);
    int64_t prompt_done = 0, sampled = 0;
    /* Part 3: execution, one slot at a time (the batched paged forward goes here). */
    for (int64_t w = 0; w < n_work; w++) {
        work *wk = &e->plan[w];
        seq *s = wk->s;
        slot *sl = &e->slots[s->slot];
        strata_status st = st_llama_forward(sl->model, s->tokens + wk->pos, wk->n, wk->pos, false, sl->logits);
        if (st != STRATA_OK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            st_log(STRATA_LOG_ERROR, "engine: request %llu: %s", (unsigned long long)s->id, msg);
            seq_leave(e, s);
            seq_finish(e, s, ST_FINISH_ERROR, ST_STOP_NONE, msg);
            continue;
        }
        s->n_computed += wk->n;
        if (wk->pos < s->n_prompt) prompt_done += wk->n;
        /* Part 4 */
        if (wk->sample) seq_sample(e, s, sl->logits, &sampled);
    }
    pthread_mutex_lock(&e->mu);
    e->m.steps++;
    e->m.prompt_tokens += prompt_done;
    e->m.generation_tokens += sampled;
    int64_t blocks = 0;
    for (int64_t i = 0; i < e->p.max_batch; i++)
        if (e->slots[i].s) blocks += kv_blocks(e->slots[i].s->n_computed);
    e->m.kv_blocks_used = blocks;
    pthread_mutex_unlock(&e->mu);
    return STRATA_OK;
}

/* ---- the engine thread ----------------------------------------------------------------*/
static void *engine_thread(void *arg) {
    st_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->thread_stop && !has_work_locked(e)) pthread_cond_wait(&e->cv, &e->mu);
        const bool stop = e->thread_stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        st_engine_step(e, NULL);
    }
    return NULL;
}

strata_status st_engine_start(st_engine *e) {
    pthread_mutex_lock(&e->mu);
    if (e->thread_on || e->stopped) {
        pthread_mutex_unlock(&e->mu);
        return st_err(STRATA_ERR_INVALID_ARG, "engine: already started or stopped");
    }
    e->thread_stop = false;
    int rc = pthread_create(&e->thread, NULL, engine_thread, e);
    if (rc == 0) e->thread_on = true;
    pthread_mutex_unlock(&e->mu);
    return rc == 0 ? STRATA_OK : st_err(STRATA_ERR_INTERNAL, "engine: cannot start its thread (%d)", rc);
}

void st_engine_stop(st_engine *e) {
    pthread_mutex_lock(&e->mu);
    const bool on = e->thread_on;
    e->thread_stop = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (on) pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->mu);
    e->thread_on = false;
    pthread_mutex_unlock(&e->mu);
    abort_all(e);
}

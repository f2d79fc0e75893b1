/* The serving engine: thread-safe request queue, hand-over to the batched
 * runner (scheduler + paged KV + st_llama_forward_batch), detokenization and
 * stop handling. See engine.h.
 *
 * Locking: e->mu guards the pending queue (added, not yet handed to the
 * runner), the live list (handed to the runner, not finished), every
 * request's abort flag, the counters and the stopped/started flags. The
 * runner, and a request's generation state (detokenizer, stop filter,
 * counts), belong to the stepping thread alone; callbacks are called without
 * the lock held. */
#include "engine/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/runner.h"
#include "model/llama.h"
#include "weights/groups.h"

#define DEF_MAX_BATCH 8
#define DEF_MAX_MODEL_LEN 2048
#define DEF_PREFILL_CHUNK 256
#define DEF_MAX_WAITING 4096
#define DEF_KV_BLOCK 16

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
    struct seq *next, *prev;   /* pending queue (next) or live list (next/prev) */
    st_engine_callbacks cb;
    int32_t *prompt;           /* [n_prompt], until handed to the runner */
    int64_t n_prompt;
    st_sampler_params sp;
    int64_t budget;            /* most tokens to sample: min(max_tokens, max_model_len - n_prompt) */
    bool budget_is_max_tokens; /* the budget came from max_tokens (finish detail MAX_TOKENS) */
    int64_t n_sampled;         /* a final stop id counts */
    int64_t n_cached;          /* prompt tokens the prefix cache served */
    int32_t *stop_ids;         /* the tokenizer's (unless ignore_eos) + the request's */
    int n_stop_ids;
    st_detok *detok;
    st_stop_filter *filter;
    bool in_runner;            /* handed to the runner (live list) */
    bool refused;              /* the runner refused it (finished with an error) */
    bool abort;                /* under e->mu */
    double t_add, t_admit, t_first, t_last;
} seq;

struct st_engine {
    const st_model_files *files;
    st_backend *be;
    const st_tokenizer *tok;
    st_engine_params p;
    st_engine_costs costs;
    int64_t vocab;        /* tokenizer's: what samplers draw from, what prompts may hold */
    const int32_t *tok_stop_ids;
    int n_tok_stop_ids;

    st_runner *runner;    /* stepping thread only */
    st_runner_event *ev;  /* [max_batch] a step's events, copied */
    int64_t prefill_seen; /* runner's prefill tokens already counted */

    pthread_mutex_t mu;
    pthread_cond_t cv;    /* work arrived, or stop */
    seq *wait_head, *wait_tail; /* pending: not yet in the runner */
    seq *live;            /* in the runner */
    int64_t n_pending, n_live;
    int64_t n_running, n_waiting; /* the runner's, as of the last step, + n_pending */
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
    st_free(s->prompt);
    st_free(s->stop_ids);
    st_detok_free(s->detok);
    st_stop_filter_free(s->filter);
    st_free(s);
}

/* Calls on_finish and frees s. The caller has already taken s out of the
 * pending queue / the live list (under the lock) and out of the runner. */
static void seq_finish(st_engine *e, seq *s, st_finish_reason reason, st_stop_reason stop, const char *error) {
    const double now = st_time_now();
    st_engine_finish fin = {
        .reason = reason,
        .stop = stop,
        .prompt_tokens = s->n_prompt,
        .completion_tokens = s->n_sampled,
        .cached_tokens = s->n_cached,
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

/* Unlinks s from the live list (under the lock). */
static void live_unlink_locked(st_engine *e, seq *s) {
    if (s->prev) s->prev->next = s->next;
    else e->live = s->next;
    if (s->next) s->next->prev = s->prev;
    s->next = s->prev = NULL;
    s->in_runner = false;
    e->n_live--;
}

/* Takes s out of the runner (when `in_runner_too`) and the live list. */
static void seq_leave(st_engine *e, seq *s, bool in_runner_too, st_seq_finish why) {
    if (in_runner_too) st_runner_finish(e->runner, s->id, why);
    pthread_mutex_lock(&e->mu);
    if (s->in_runner) live_unlink_locked(e, s);
    pthread_mutex_unlock(&e->mu);
}

/* ---- init / free --------------------------------------------------------------------*/
static const double TTFT_BOUNDS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                     1.0,  1.5,   2.0,  2.5,   5.0, 7.5,  10.0, 20.0, 40.0, 80.0};
static const double TBT_BOUNDS[] = {0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                                    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5,  5.0,   10.0};
static const double E2E_BOUNDS[] = {0.1, 0.25, 0.5,  1.0,  2.5,  5.0,  10.0,  15.0,
                                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0};
#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The model's step costs (engine.h) from its weight groups and config. */
static strata_status costs_init(const st_model_files *files, st_engine_costs *out) {
    const st_config *c = &files->config;
    st_wgroups *g = NULL;
    strata_status st = st_wgroups_build(files, &g);
    if (st != STRATA_OK) return st;
    memset(out, 0, sizeof *out);
    for (int i = 1; i < g->n; i++) { /* group 0 (embed) is gathered, a few rows per step */
        out->weight_bytes += (double)g->g[i].bytes;
        for (int t = 0; t < g->g[i].n_tensors; t++) {
            const st_tensor_desc *d = g->g[i].t[t].desc;
            if (d && d->n_dims == 2) out->flops_per_token += 2.0 * (double)d->shape[0] * (double)d->shape[1];
        }
    }
    st_wgroups_free(g);
    /* the paged pool's layout (model/llama.h): fp32 K and V rows of n_kv_heads * head_dim per layer */
    out->kv_bytes_per_token = 2.0 * (double)c->n_layers * (double)(c->n_kv_heads * c->head_dim) * sizeof(float);
    out->attn_flops_per_pair = 4.0 * (double)c->n_heads * (double)c->head_dim * (double)c->n_layers;
    return STRATA_OK;
}

strata_status st_engine_init(const st_model_files *files, st_backend *be, const st_tokenizer *tok,
                             const st_engine_params *params, st_engine **out) {
    *out = NULL;
    if (!files || !be || !tok) return st_err(STRATA_ERR_INVALID_ARG, "engine: no model, backend or tokenizer");
    st_engine_params p = params ? *params : (st_engine_params){0};
    const st_config *cfg = &files->config;
    if (p.max_batch < 0 || p.max_model_len < 0 || p.prefill_chunk < 0 || p.step_tokens < 0 || p.max_waiting < 0 ||
        p.kv_block_size < 0 || p.kv_blocks < 0)
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
    if (p.kv_block_size == 0) p.kv_block_size = DEF_KV_BLOCK;

    st_engine *e = st_calloc(1, sizeof *e);
    if (!e) return st_err(STRATA_ERR_NOMEM, "engine: out of memory");
    e->files = files;
    e->be = be;
    e->tok = tok;
    e->vocab = st_tokenizer_vocab_size(tok);
    e->next_id = 1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->n_tok_stop_ids = st_tokenizer_stop_ids(tok, &e->tok_stop_ids);
    hist_init(&e->m.ttft, TTFT_BOUNDS, NELEM(TTFT_BOUNDS));
    hist_init(&e->m.tbt, TBT_BOUNDS, NELEM(TBT_BOUNDS));
    hist_init(&e->m.e2e, E2E_BOUNDS, NELEM(E2E_BOUNDS));
    if (e->vocab > cfg->vocab_size) {
        strata_status st = st_err(STRATA_ERR_MISMATCH, "engine: the tokenizer has %lld tokens, the model %lld",
                                  (long long)e->vocab, (long long)cfg->vocab_size);
        st_engine_free(e);
        return st;
    }
    /* the forward pass always has room for the oldest prefill's chunk beside
     * every decode (aligned chunks: output independent of the batch) */
    int64_t batch_tokens = p.step_tokens;
    if (batch_tokens < p.prefill_chunk + p.max_batch - 1) batch_tokens = p.prefill_chunk + p.max_batch - 1;
    const st_runner_params rp = {.max_batch = p.max_batch, .max_model_len = p.max_model_len,
                                 .max_batch_tokens = batch_tokens, .prefill_chunk = p.prefill_chunk,
                                 .block_size = p.kv_block_size, .num_blocks = p.kv_blocks, .kv_mem = p.kv_mem,
                                 .disable_prefix_cache = p.disable_prefix_cache, .vocab = e->vocab,
                                 .weights = p.weights};
    strata_status st = costs_init(files, &e->costs);
    if (st == STRATA_OK) st = st_runner_init(files, be, &rp, &e->runner);
    if (st == STRATA_OK && !(e->ev = st_calloc((size_t)p.max_batch, sizeof *e->ev)))
        st = st_err(STRATA_ERR_NOMEM, "engine: out of memory");
    if (st != STRATA_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        st_engine_free(e);
        return st_err(st, "engine: %s", msg);
    }
    p.kv_blocks = st_runner_get_params(e->runner)->num_blocks;
    {
        const int64_t seq_tokens = p.kv_blocks * p.kv_block_size;
        if (seq_tokens < p.max_batch * p.max_model_len)
            st_log(STRATA_LOG_WARN,
                   "engine: the KV pool holds %lld tokens (%lld blocks, %.2f GiB): %.1f sequences of max_model_len "
                   "%lld for max_batch %lld; longer ones are preempted when it fills (give more KV memory)",
                   (long long)seq_tokens, (long long)p.kv_blocks,
                   (double)seq_tokens * e->costs.kv_bytes_per_token / 1073741824.0,
                   (double)seq_tokens / (double)p.max_model_len, (long long)p.max_model_len, (long long)p.max_batch);
    }
    e->p = p;
    e->m.max_batch = p.max_batch;
    e->m.max_model_len = p.max_model_len;
    e->m.kv_block_size = p.kv_block_size;
    e->m.kv_blocks_total = p.kv_blocks;
    *out = e;
    return STRATA_OK;
}

/* Takes every pending and live request out and finishes it with `reason`. */
static void finish_all(st_engine *e, bool stop_adds, st_finish_reason reason, const char *error) {
    seq *list = NULL;
    pthread_mutex_lock(&e->mu);
    if (stop_adds) e->stopped = true;
    for (seq *s = e->wait_head; s;) {
        seq *nx = s->next;
        s->next = list;
        list = s;
        s = nx;
    }
    e->wait_head = e->wait_tail = NULL;
    e->n_pending = 0;
    while (e->live) {
        seq *s = e->live;
        live_unlink_locked(e, s);
        if (e->runner) st_runner_finish(e->runner, s->id, ST_SEQ_FINISH_ABORT);
        s->next = list;
        list = s;
    }
    e->n_running = e->n_waiting = 0;
    if (e->runner) {
        st_runner_stats rs;
        st_runner_get_stats(e->runner, &rs);
        e->m.kv_blocks_used = rs.kv.used;
    }
    pthread_mutex_unlock(&e->mu);
    /* oldest first */
    seq *rev = NULL;
    while (list) {
        seq *nx = list->next;
        list->next = rev;
        rev = list;
        list = nx;
    }
    while (rev) {
        seq *nx = rev->next;
        seq_finish(e, rev, reason, ST_STOP_NONE, error);
        rev = nx;
    }
}

static void abort_all(st_engine *e) { finish_all(e, true, ST_FINISH_ABORT, NULL); }

void st_engine_free(st_engine *e) {
    if (!e) return;
    st_engine_stop(e);
    st_runner_free(e->runner);
    st_free(e->ev);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    st_free(e);
}

const st_engine_params *st_engine_get_params(const st_engine *e) { return &e->p; }
const st_engine_costs *st_engine_get_costs(const st_engine *e) { return &e->costs; }
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
    s->cb = *cb;
    s->n_prompt = req->n_prompt;
    s->sp = req->sampler;
    const int64_t ctx_budget = e->p.max_model_len - req->n_prompt;
    s->budget = ctx_budget;
    if (req->max_tokens > 0 && req->max_tokens <= ctx_budget) {
        s->budget = req->max_tokens;
        s->budget_is_max_tokens = true;
    }
    strata_status st = STRATA_OK;
    if (!(s->prompt = st_malloc((size_t)req->n_prompt * sizeof *s->prompt))) goto oom;
    memcpy(s->prompt, req->prompt, (size_t)req->n_prompt * sizeof *s->prompt);
    const int n_ids = (req->ignore_eos ? 0 : e->n_tok_stop_ids) + req->n_stop_ids;
    if (n_ids > 0) {
        if (!(s->stop_ids = st_malloc((size_t)n_ids * sizeof *s->stop_ids))) goto oom;
        if (!req->ignore_eos)
            for (int i = 0; i < e->n_tok_stop_ids; i++) s->stop_ids[s->n_stop_ids++] = e->tok_stop_ids[i];
        for (int i = 0; i < req->n_stop_ids; i++) s->stop_ids[s->n_stop_ids++] = req->stop_ids[i];
    }
    {
        /* the sampler itself lives in the runner; this checks its parameters now */
        st_sampler *probe = NULL;
        if ((st = st_sampler_init(&req->sampler, e->vocab, &probe))) goto fail;
        st_sampler_free(probe);
    }
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
    e->n_pending++;
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
    for (seq *s = e->live; s && !found; s = s->next)
        if (s->id == id) s->abort = found = true;
    if (found) pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return found ? STRATA_OK : st_err(STRATA_ERR_NOT_FOUND, "no pending request %llu", (unsigned long long)id);
}

static bool has_work_locked(const st_engine *e) { return e->n_pending > 0 || e->n_live > 0; }

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

/* Part 1: aborted requests out (pending ones from the queue, live ones from
 * the runner), new ones into the runner (in add order). Returns the aborted
 * ones, oldest first, to be finished without the lock. */
static seq *step_intake(st_engine *e) {
    seq *aborted = NULL, **atail = &aborted;
    pthread_mutex_lock(&e->mu);
    /* live ones that were aborted leave the runner (blocks released) */
    for (seq *s = e->live; s;) {
        seq *nx = s->next;
        if (s->abort) {
            live_unlink_locked(e, s);
            st_runner_abort(e->runner, s->id);
            *atail = s;
            atail = &s->next;
        }
        s = nx;
    }
    /* the pending queue: aborted ones leave, the rest join the runner */
    seq *s = e->wait_head;
    e->wait_head = e->wait_tail = NULL;
    e->n_pending = 0;
    while (s) {
        seq *nx = s->next;
        s->next = NULL;
        if (s->abort) {
            *atail = s;
            atail = &s->next;
            s = nx;
            continue;
        }
        const st_runner_request rq = {.prompt = s->prompt, .n_prompt = s->n_prompt, .sampler = s->sp,
                                      .max_tokens = s->budget, .stop_ids = s->stop_ids,
                                      .n_stop_ids = s->n_stop_ids, .user = s};
        if (st_runner_add(e->runner, s->id, &rq) != STRATA_OK) {
            /* not expected (add checked the request): it fails alone */
            st_log(STRATA_LOG_ERROR, "engine: request %llu: %s", (unsigned long long)s->id, st_last_error());
            s->refused = true; /* finished with an error below */
            *atail = s;
            atail = &s->next;
            s = nx;
            continue;
        }
        st_free(s->prompt);
        s->prompt = NULL;
        s->in_runner = true;
        s->prev = NULL;
        s->next = e->live;
        if (e->live) e->live->prev = s;
        e->live = s;
        e->n_live++;
        s = nx;
    }
    e->n_running = st_runner_num_running(e->runner);
    e->n_waiting = st_runner_num_waiting(e->runner);
    pthread_mutex_unlock(&e->mu);
    return aborted;
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

/* Part 4 for one event: the token the runner sampled for s. Stream, stop.
 * `gone`: the runner already let the sequence go (finished in the step). */
static void seq_token(st_engine *e, seq *s, const st_runner_event *ev, int64_t *n_sampled) {
    const bool gone = ev->finished;
    strata_status st = STRATA_OK;
    if (ev->failed || ev->token < 0) {
        seq_leave(e, s, !gone, ST_SEQ_FINISH_ABORT);
        seq_finish(e, s, ST_FINISH_ERROR, ST_STOP_NONE, "the sampler rejected the logits");
        return;
    }
    const int32_t t = ev->token;
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
            seq_leave(e, s, !gone, ST_SEQ_FINISH_STOP);
            seq_finish(e, s, ST_FINISH_STOP, stopped ? ST_STOP_STRING : ST_STOP_EOS, NULL);
            return;
        }
    const char *text;
    size_t len;
    if ((st = st_detok_push(s->detok, t, &text, &len))) goto error;
    if ((st = emit(s, text, len, &stopped))) goto error;
    if (stopped) {
        seq_leave(e, s, !gone, ST_SEQ_FINISH_STOP);
        seq_finish(e, s, ST_FINISH_STOP, ST_STOP_STRING, NULL);
        return;
    }
    if (gone || s->n_sampled >= s->budget) {
        if (!gone || ev->reason == ST_SEQ_FINISH_MAX_TOKENS || ev->reason == ST_SEQ_FINISH_CONTEXT) {
            if ((st = emit_end(s, &stopped))) goto error;
            seq_leave(e, s, !gone, stopped ? ST_SEQ_FINISH_STOP : ST_SEQ_FINISH_MAX_TOKENS);
            seq_finish(e, s, stopped ? ST_FINISH_STOP : ST_FINISH_LENGTH,
                       stopped ? ST_STOP_STRING : s->budget_is_max_tokens ? ST_STOP_MAX_TOKENS : ST_STOP_CONTEXT,
                       NULL);
        } else {
            /* the runner ended it for a reason the engine did not see (not expected) */
            seq_leave(e, s, false, ST_SEQ_FINISH_ABORT);
            seq_finish(e, s, ST_FINISH_ERROR, ST_STOP_NONE, "the sequence ended unexpectedly");
        }
    }
    return;
error: {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        seq_leave(e, s, !gone, ST_SEQ_FINISH_ABORT);
        seq_finish(e, s, ST_FINISH_ERROR, ST_STOP_NONE, msg);
    }
}

/* Counters from the runner, under the lock. */
static void sync_metrics_locked(st_engine *e) {
    st_runner_stats rs;
    st_runner_get_stats(e->runner, &rs);
    e->m.prompt_tokens += rs.sched.prefill_tokens - e->prefill_seen;
    e->prefill_seen = rs.sched.prefill_tokens;
    e->m.preemptions = rs.sched.preemptions;
    e->m.forward_seconds = rs.forward_s;
    e->m.kv_blocks_used = rs.kv.used;
    e->m.prefix_cache_queries = rs.kv.queried_tokens;
    e->m.prefix_cache_hits = rs.kv.hit_tokens;
    e->n_running = st_runner_num_running(e->runner);
    e->n_waiting = st_runner_num_waiting(e->runner) + e->n_pending;
}

strata_status st_engine_step(st_engine *e, bool *worked) {
    if (worked) *worked = false;
    const double t_step = st_time_now();
    seq *aborted = step_intake(e);
    while (aborted) {
        seq *nx = aborted->next;
        if (aborted->refused) seq_finish(e, aborted, ST_FINISH_ERROR, ST_STOP_NONE, "the runner refused the request");
        else seq_finish(e, aborted, ST_FINISH_ABORT, ST_STOP_NONE, NULL);
        aborted = nx;
        if (worked) *worked = true;
    }
    if (!st_runner_has_work(e->runner)) {
        pthread_mutex_lock(&e->mu);
        sync_metrics_locked(e);
        pthread_mutex_unlock(&e->mu);
        return STRATA_OK;
    }
    if (worked) *worked = true;

    /* Parts 2-3 (and the sampling of 4): the runner's step */
    st_runner_step_info info;
    strata_status st = st_runner_step(e->runner, &info);
    if (st != STRATA_OK) {
        /* the forward pass failed: every live request ends with the error
         * (the runner left them as they were; retrying would loop) */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        st_log(STRATA_LOG_ERROR, "engine: step failed: %s", msg);
        seq *list = NULL;
        pthread_mutex_lock(&e->mu);
        while (e->live) {
            seq *s = e->live;
            live_unlink_locked(e, s);
            st_runner_finish(e->runner, s->id, ST_SEQ_FINISH_ABORT);
            s->next = list;
            list = s;
        }
        sync_metrics_locked(e);
        pthread_mutex_unlock(&e->mu);
        while (list) {
            seq *nx = list->next;
            seq_finish(e, list, ST_FINISH_ERROR, ST_STOP_NONE, msg);
            list = nx;
        }
        return STRATA_OK;
    }
    /* events copied: finishing a sequence calls the runner */
    const int64_t n_ev = info.n_events;
    ST_ASSERT(n_ev <= e->p.max_batch);
    if (n_ev > 0) memcpy(e->ev, info.events, (size_t)n_ev * sizeof *e->ev);
    /* queue time and prefix-cache hits of the newly admitted */
    const double now = st_time_now();
    pthread_mutex_lock(&e->mu);
    for (seq *s = e->live; s; s = s->next)
        if (s->t_admit <= 0) {
            const st_seq *q = st_runner_get_seq(e->runner, s->id);
            if (q && q->n_cached >= 0) {
                s->t_admit = now;
                s->n_cached = q->n_cached;
            }
        }
    pthread_mutex_unlock(&e->mu);
    /* a decode-only step: every sequence ran one token and sampled; the keys
     * each attended over are its context after the step less the new token */
    const bool decode_only = info.n_tokens > 0 && info.n_decodes == info.n_seqs && info.n_tokens == info.n_seqs &&
                             n_ev == info.n_seqs;
    int64_t kv_keys = 0;
    for (int64_t k = 0; k < n_ev && decode_only; k++)
        kv_keys += e->ev[k].n_prompt + e->ev[k].n_generated - (e->ev[k].failed ? 0 : 1);
    int64_t sampled = 0;
    for (int64_t k = 0; k < n_ev; k++) {
        seq *s = e->ev[k].user;
        if (s->t_admit <= 0) s->t_admit = now;
        if (e->ev[k].finished || e->ev[k].n_cached > 0) s->n_cached = e->ev[k].n_cached;
        seq_token(e, s, &e->ev[k], &sampled);
    }
    const double dt = st_time_now() - t_step;
    pthread_mutex_lock(&e->mu);
    if (info.n_tokens > 0) {
        e->m.steps++;
        e->m.step_tokens += info.n_tokens;
        e->m.step_seconds += dt;
        if (decode_only) {
            e->m.decode_steps++;
            e->m.decode_tokens += info.n_tokens;
            e->m.decode_kv_tokens += kv_keys;
            e->m.decode_seconds += dt;
        }
    }
    e->m.generation_tokens += sampled;
    sync_metrics_locked(e);
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

/* The serving engine: thread-safe request queue, hand-over to the batched
 * runner (scheduler + paged KV + st_llama_forward), detokenization and
 * stop handling. See engine.h.
 *
 * Locking: e->mu guards the pending queue (added, not yet handed to the
 * runner), the live list (handed to the runner, not finished), every
 * request's abort flag, the counters and the stopped/started flags. The
 * runner, and a request's record (engine/seq.h) once handed to it, belong to
 * the stepping thread alone; callbacks are called without the lock held. */
#include "engine/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "engine/runner.h"
#include "model/llama.h"
#include "weights/groups.h"

/* P-D: a command for the stepping thread (the KV tiers are its alone). */
typedef struct kv_cmd {
    enum { CMD_RESERVE, CMD_ADOPT, CMD_CANCEL } kind;
    int32_t *tokens;                /* RESERVE: owned copy */
    int64_t n_tokens;
    uint64_t ticket;                /* ADOPT / CANCEL */
    st_engine_reserve_fn fn;
    void *user;
    struct kv_cmd *next;
} kv_cmd;

/* P-D: a reservation of host-tier blocks for blocks [from, from + n) of
 * tokens, until adopted or cancelled (stepping thread only). */
typedef struct kv_ticket {
    uint64_t id;
    int32_t *tokens;
    int64_t n_tokens, from, n;
    int64_t *hb;                    /* [n] host blocks (NULL: landing slots) */
    void **ptrs;                    /* [n] their memory */
    int64_t slot0;                  /* landing: slots [slot0, slot0 + n) of the runner's arena */
    st_runner_preload *preload;     /* adopted: its blocks on their way to the device (requests stay parked) */
    struct kv_ticket *next;
} kv_ticket;

struct st_engine {
    const st_model_files *files;
    st_backend *be;
    const st_tokenizer *tok;
    st_engine_params p;
    st_engine_costs costs;
    int64_t vocab;        /* tokenizer's: what samplers draw from, what prompts may hold */
    st_seq_limits limits; /* what st_engine_add checks requests against */

    st_runner *runner;    /* stepping thread only */
    st_runner_event *ev;  /* [max_batch] a step's events, copied */
    int64_t prefill_seen; /* runner's prefill tokens already counted */

    pthread_mutex_t mu;
    pthread_cond_t cv;    /* work arrived, or stop */
    st_seq *wait_head, *wait_tail; /* pending: not yet in the runner */
    st_seq *live;         /* in the runner */
    int64_t n_pending, n_live;
    int64_t n_running, n_waiting; /* the runner's, as of the last step, + n_pending */
    uint64_t next_id;
    bool stopped;         /* add refuses */
    bool thread_on, thread_stop;
    pthread_t thread;
    st_engine_metrics m;  /* counters (running/waiting filled on read) */
    /* P-D */
    kv_cmd *cmd_head, *cmd_tail;    /* under mu */
    int64_t n_cmds;                 /* under mu */
    st_seq *parked;                 /* requests waiting for their ticket (under mu) */
    int64_t n_parked;               /* under mu */
    bool parked_abort;              /* one of them was aborted (under mu) */
    int64_t n_preloading;           /* adopted tickets whose blocks are on their way to the device (under mu) */
    kv_ticket *tickets;             /* stepping thread */
    uint64_t next_ticket;           /* stepping thread: a counter, hashed into ticket ids */
    uint64_t ticket_key;            /* random at init: ticket ids are not guessable from outside */
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

/* Fills s's finish info (its reason is set), calls on_finish and frees s.
 * The caller has already taken s out of the pending queue / the live list
 * (under the lock) and out of the runner. */
static void seq_finish(st_engine *e, st_seq *s) {
    ST_ASSERT(s->status == ST_SEQ_FINISHED);
    const double now = st_time_now();
    st_finish_info *f = &s->fin;
    f->prompt_tokens = s->n_prompt;
    f->completion_tokens = st_seq_n_generated(s);
    f->cached_tokens = s->n_cached < 0 ? 0 : s->n_cached;
    f->preemptions = s->n_preemptions;
    f->queue_s = (s->t_admit > 0 ? s->t_admit : now) - s->t_add;
    if (f->queue_s < 0) f->queue_s = 0;
    f->ttft_s = s->t_first > 0 ? s->t_first - s->t_add : -1.0;
    f->total_s = now - s->t_add;
    f->error = f->reason == ST_FINISH_ERROR ? s->error : NULL;
    pthread_mutex_lock(&e->mu);
    e->m.requests_finished[f->reason]++;
    hist_observe(&e->m.e2e, f->total_s);
    pthread_mutex_unlock(&e->mu);
    if (s->cb.on_finish) s->cb.on_finish(s->cb.user, f);
    st_seq_free(s);
}

/* Unlinks s from the live list (under the lock). */
static void live_unlink_locked(st_engine *e, st_seq *s) {
    if (s->prev) s->prev->next = s->next;
    else e->live = s->next;
    if (s->next) s->next->prev = s->prev;
    s->next = s->prev = NULL;
    e->n_live--;
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
static strata_status costs_init(const st_model_files *files, st_kv_dtype kv_dtype, st_engine_costs *out) {
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
    /* the paged pool's layout (kv/kv_pool.h): K and V rows of n_kv_heads * head_dim per layer in kv_dtype */
    out->kv_bytes_per_token = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, kv_dtype);
    out->attn_flops_per_pair = 4.0 * (double)c->n_heads * (double)c->head_dim * (double)c->n_layers;
    return STRATA_OK;
}

static void sync_metrics_locked(st_engine *e);

strata_status st_engine_init(const st_model_files *files, st_backend *be, const st_tokenizer *tok,
                             const st_engine_params *params, st_engine **out) {
    *out = NULL;
    if (!files || !be || !tok) return st_err(STRATA_ERR_INVALID_ARG, "engine: no model, backend or tokenizer");
    st_engine_params p = params ? *params : (st_engine_params){0};
    const st_config *cfg = &files->config;
    strata_status st = st_engine_params_resolve(&p, cfg);
    if (st) {
        char msg[512]; /* st_err must not read the buffer it writes */
        snprintf(msg, sizeof msg, "%s", st_last_error());
        return st_err(st, "engine: %s", msg);
    }
    if (cfg->max_position_embeddings > 0 && p.max_model_len > cfg->max_position_embeddings)
        st_log(STRATA_LOG_WARN, "engine: max_model_len %lld is beyond the model's %lld positions",
               (long long)p.max_model_len, (long long)cfg->max_position_embeddings);

    st_engine *e = st_calloc(1, sizeof *e);
    if (!e) return st_err(STRATA_ERR_NOMEM, "engine: out of memory for its state (%zu bytes)", sizeof *e);
    e->files = files;
    e->be = be;
    e->tok = tok;
    e->vocab = st_tokenizer_vocab_size(tok);
    e->next_id = 1;
    if (getrandom(&e->ticket_key, sizeof e->ticket_key, 0) != (ssize_t)sizeof e->ticket_key) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        e->ticket_key = ((uint64_t)ts.tv_sec * 1000000007ull) ^ ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)(uintptr_t)e;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    hist_init(&e->m.ttft, TTFT_BOUNDS, NELEM(TTFT_BOUNDS));
    hist_init(&e->m.tbt, TBT_BOUNDS, NELEM(TBT_BOUNDS));
    hist_init(&e->m.e2e, E2E_BOUNDS, NELEM(E2E_BOUNDS));
    if (e->vocab > cfg->vocab_size) {
        st = st_err(STRATA_ERR_MISMATCH, "engine: the tokenizer has %lld tokens, the model %lld",
                                  (long long)e->vocab, (long long)cfg->vocab_size);
        st_engine_free(e);
        return st;
    }
    st = costs_init(files, p.kv_dtype, &e->costs);
    if (st == STRATA_OK) st = st_runner_init(files, be, &p, &e->runner);
    if (st == STRATA_OK && !(e->ev = st_calloc((size_t)p.max_batch, sizeof *e->ev)))
        st = st_err(STRATA_ERR_NOMEM, "engine: out of memory for the events of %lld sequences (%zu bytes)",
                    (long long)p.max_batch, (size_t)p.max_batch * sizeof *e->ev);
    if (st != STRATA_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        st_engine_free(e);
        return st_err(st, "engine: %s", msg);
    }
    p = *st_runner_get_params(e->runner);
    e->limits = st_runner_limits(e->runner, tok);
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
    pthread_mutex_lock(&e->mu);
    sync_metrics_locked(e); /* the tiers' sizes and what the SSD tier found, before any step */
    pthread_mutex_unlock(&e->mu);
    *out = e;
    return STRATA_OK;
}

/* Takes every pending and live request out and finishes it with `reason`. */
static void finish_all(st_engine *e, bool stop_adds, st_finish_reason reason, const char *error) {
    st_seq *list = NULL;
    pthread_mutex_lock(&e->mu);
    if (stop_adds) e->stopped = true;
    for (st_seq *s = e->wait_head; s;) {
        st_seq *nx = s->next;
        st_seq_set_finished(s, reason, error);
        s->next = list;
        list = s;
        s = nx;
    }
    e->wait_head = e->wait_tail = NULL;
    e->n_pending = 0;
    while (e->parked) {
        st_seq *s = e->parked;
        e->parked = s->next;
        st_seq_set_finished(s, reason, error);
        s->next = list;
        list = s;
    }
    e->n_parked = 0;
    kv_cmd *cmds = e->cmd_head; /* reservations not made are refused */
    e->cmd_head = e->cmd_tail = NULL;
    e->n_cmds = 0;
    while (e->live) {
        st_seq *s = e->live;
        live_unlink_locked(e, s);
        if (e->runner) st_runner_finish(e->runner, s->id, reason);
        st_seq_set_finished(s, reason, error);
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
    while (cmds) {
        kv_cmd *nx = cmds->next;
        if (cmds->kind == CMD_RESERVE)
            cmds->fn(cmds->user, st_err(STRATA_ERR_UNSUPPORTED, "the engine is stopped"), NULL);
        st_free(cmds->tokens);
        st_free(cmds);
        cmds = nx;
    }
    /* oldest first */
    st_seq *rev = NULL;
    while (list) {
        st_seq *nx = list->next;
        list->next = rev;
        rev = list;
        list = nx;
    }
    while (rev) {
        st_seq *nx = rev->next;
        rev->next = NULL;
        seq_finish(e, rev);
        rev = nx;
    }
}

static void abort_all(st_engine *e) { finish_all(e, true, ST_FINISH_ABORT, NULL); }

static void ticket_free(kv_ticket *t) {
    if (!t) return;
    ST_ASSERT(!t->preload);
    st_free(t->tokens);
    st_free(t->hb);
    st_free(t->ptrs);
    st_free(t);
}

void st_engine_free(st_engine *e) {
    if (!e) return;
    st_engine_stop(e);
    while (e->tickets) { /* the tiers go with the runner: nothing to give back */
        kv_ticket *t = e->tickets;
        e->tickets = t->next;
        if (t->preload && st_runner_tiers(e->runner)) st_kv_tiers_drain(st_runner_tiers(e->runner));
        st_runner_kv_preload_free(e->runner, t->preload); /* landed copies: synchronized there */
        t->preload = NULL;
        ticket_free(t);
    }
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
    if (!e || !req || !cb || !id) return st_err(STRATA_ERR_INVALID_ARG, "engine add: no request, callbacks or id");
    /* the one validation of a request: st_seq_create (the runner and the scheduler assert) */
    st_seq *s = NULL;
    strata_status st = st_seq_create(req, &e->limits, cb, 0, &s);
    if (st) return st;
    pthread_mutex_lock(&e->mu);
    if (e->stopped) {
        pthread_mutex_unlock(&e->mu);
        st_seq_free(s);
        return st_err(STRATA_ERR_UNSUPPORTED, "the engine is stopped");
    }
    if (e->n_waiting >= e->p.max_waiting) {
        const long long n = (long long)e->n_waiting;
        pthread_mutex_unlock(&e->mu);
        st_seq_free(s);
        return st_err(STRATA_ERR_NOMEM, "the engine's queue is full (%lld requests waiting)", n);
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
}

strata_status st_engine_abort(st_engine *e, uint64_t id) {
    pthread_mutex_lock(&e->mu);
    bool found = false;
    for (st_seq *s = e->wait_head; s && !found; s = s->next)
        if (s->id == id) s->abort = found = true;
    for (st_seq *s = e->live; s && !found; s = s->next)
        if (s->id == id) s->abort = found = true;
    for (st_seq *s = e->parked; s && !found; s = s->next)
        if (s->id == id) s->abort = found = e->parked_abort = true;
    if (found) pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return found ? STRATA_OK : st_err(STRATA_ERR_NOT_FOUND, "no pending request %llu", (unsigned long long)id);
}

static bool has_work_locked(const st_engine *e) {
    /* parked requests wait for a command (adopt / cancel), which wakes the thread */
    return e->n_pending > 0 || e->n_live > 0 || e->n_cmds > 0 || (e->n_parked > 0 && e->parked_abort) ||
           e->n_preloading > 0;
}

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

/* ---- P-D: reservations of blocks pushed by a prefill node ---------------------------------*/

void st_engine_kv_layout(const st_engine *e, int64_t *n_layers, size_t *layer_bytes, uint64_t *identity) {
    st_runner_kv_layout(e->runner, n_layers, layer_bytes);
    *identity = st_runner_kv_identity(e->runner);
}

static kv_ticket *ticket_find(st_engine *e, uint64_t id) {
    for (kv_ticket *t = e->tickets; t; t = t->next)
        if (t->id == id) return t;
    return NULL;
}

static strata_status cmd_push(st_engine *e, kv_cmd *c) {
    pthread_mutex_lock(&e->mu);
    if (e->stopped) {
        pthread_mutex_unlock(&e->mu);
        st_free(c->tokens);
        st_free(c);
        return st_err(STRATA_ERR_UNSUPPORTED, "the engine is stopped");
    }
    if (e->cmd_tail) e->cmd_tail->next = c;
    else e->cmd_head = c;
    e->cmd_tail = c;
    e->n_cmds++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return STRATA_OK;
}

strata_status st_engine_kv_reserve(st_engine *e, const int32_t *tokens, int64_t n_tokens, st_engine_reserve_fn fn,
                                   void *user) {
    if (!e || !tokens || n_tokens < 1 || !fn) return st_err(STRATA_ERR_INVALID_ARG, "kv reserve: bad arguments");
    if (!st_runner_tiers(e->runner) && !st_runner_land_at(e->runner, 0, NULL))
        return st_err(STRATA_ERR_UNSUPPORTED, "kv reserve: blocks from a prefill node land in the KV host tier or "
                                              "the landing memory, and this engine has neither (--kv-host-mem, "
                                              "--pd-landing-mem)");
    for (int64_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= e->vocab)
            return st_err(STRATA_ERR_INVALID_ARG, "kv reserve: token %lld: id %d is outside the vocabulary",
                          (long long)i, tokens[i]);
    kv_cmd *c = st_calloc(1, sizeof *c);
    if (c) c->tokens = st_malloc((size_t)n_tokens * sizeof *tokens);
    if (!c || !c->tokens) {
        if (c) st_free(c);
        return st_err(STRATA_ERR_NOMEM, "kv reserve: out of memory for a copy of %lld prompt tokens (%zu bytes)",
                      (long long)n_tokens, (size_t)n_tokens * sizeof *tokens);
    }
    memcpy(c->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    c->kind = CMD_RESERVE;
    c->n_tokens = n_tokens;
    c->fn = fn;
    c->user = user;
    return cmd_push(e, c);
}

strata_status st_engine_kv_resolve(st_engine *e, uint64_t ticket, bool adopt) {
    if (!e || !ticket) return st_err(STRATA_ERR_INVALID_ARG, "kv resolve: no engine or ticket");
    kv_cmd *c = st_calloc(1, sizeof *c);
    if (!c) return st_err(STRATA_ERR_NOMEM, "kv resolve: out of memory for its state (%zu bytes)", sizeof *c);
    c->kind = adopt ? CMD_ADOPT : CMD_CANCEL;
    c->ticket = ticket;
    return cmd_push(e, c);
}

/* A reservation (stepping thread): the blocks the device and host tiers
 * hold already, host blocks for the rest of the full blocks before the last
 * token. */
static void do_reserve(st_engine *e, kv_cmd *c) {
    st_kv_tiers *tiers = st_runner_tiers(e->runner);
    const int64_t bs = e->p.kv_block_size, full = (c->n_tokens - 1) / bs;
    st_engine_kv_reservation res = {.n_tokens = c->n_tokens, .block_tokens = bs};
    st_runner_kv_layout(e->runner, &res.n_layers, &res.layer_bytes);
    const int64_t dev = st_runner_prefix_blocks(e->runner, c->tokens, c->n_tokens);
    /* landing: the blocks go straight on to the device after the device prefix, so only that counts */
    const bool land = st_runner_land_at(e->runner, 0, NULL) != NULL;
    res.cached_blocks = dev + (land ? 0 : st_kv_tiers_lookup(tiers, c->tokens, c->n_tokens, dev));
    res.n_blocks = full - res.cached_blocks;
    if (res.n_blocks <= 0) { /* everything is here already: no transfer, no ticket */
        res.n_blocks = 0;
        c->fn(c->user, STRATA_OK, &res);
        return;
    }
    kv_ticket *t = st_calloc(1, sizeof *t);
    strata_status st = STRATA_OK;
    if (!t || (!land && (!(t->hb = st_malloc((size_t)res.n_blocks * sizeof *t->hb)) ||
                         !(t->ptrs = st_malloc((size_t)res.n_blocks * sizeof *t->ptrs)))))
        st = st_err(STRATA_ERR_NOMEM, "kv reserve: out of memory for the ticket of %lld blocks (%zu bytes)",
                    (long long)res.n_blocks, sizeof *t + (size_t)res.n_blocks * (sizeof *t->hb + sizeof *t->ptrs));
    else if (land)
        st = st_runner_land_reserve(e->runner, res.n_blocks, &t->slot0);
    else
        st = st_kv_tiers_reserve(tiers, res.n_blocks, t->hb);
    if (st) {
        ticket_free(t);
        c->fn(c->user, st, NULL);
        return;
    }
    if (land)
        res.landing = st_runner_land_at(e->runner, t->slot0, &res.landing_stride);
    else
        for (int64_t k = 0; k < res.n_blocks; k++) t->ptrs[k] = st_kv_tiers_host_block(tiers, t->hb[k]);
    do { /* splitmix64 of a keyed counter: unique (a bijection of the counter), never 0 */
        uint64_t z = e->ticket_key + ++e->next_ticket * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        t->id = z ^ (z >> 31);
    } while (t->id == 0);
    t->tokens = c->tokens;
    c->tokens = NULL;
    t->n_tokens = c->n_tokens;
    t->from = res.cached_blocks;
    t->n = res.n_blocks;
    t->next = e->tickets;
    e->tickets = t;
    res.ticket = t->id;
    res.blocks = t->ptrs;
    c->fn(c->user, STRATA_OK, &res);
}

/* Adopt (the blocks all landed) or cancel a ticket; its parked requests go
 * to the head of the pending queue, in the order they came. */
static void unpark(st_engine *e, kv_ticket *t);

static void do_resolve(st_engine *e, kv_cmd *c) {
    kv_ticket **pp = &e->tickets;
    while (*pp && (*pp)->id != c->ticket) pp = &(*pp)->next;
    kv_ticket *t = *pp;
    if (!t || t->preload) return; /* resolved already, or never was */
    st_kv_tiers *tiers = st_runner_tiers(e->runner);
    if (!t->hb) { /* landing slots: adopted, they go on to the device (the preload owns them); cancelled, back */
        if (c->kind == CMD_CANCEL) st_runner_land_release(e->runner, t->slot0, t->n);
    } else if (c->kind == CMD_ADOPT) {
        st_kv_tiers_adopt(tiers, t->tokens, t->n_tokens, t->from, t->n, t->hb);
    } else {
        st_kv_tiers_unreserve(tiers, t->hb, t->n);
    }
    pthread_mutex_lock(&e->mu);
    if (c->kind == CMD_ADOPT) e->m.pd_adopted++;
    else e->m.pd_cancelled++;
    pthread_mutex_unlock(&e->mu);
    /* adopted: the blocks go on to the device now, between passes; the requests waiting for
     * them stay parked until they are there, so that their admission's pass loads nothing */
    if (c->kind == CMD_ADOPT &&
        (t->hb ? st_runner_kv_preload(e->runner, t->tokens, t->n_tokens, &t->preload)
               : st_runner_kv_preload_landed(e->runner, t->tokens, t->n_tokens, t->from, t->n, t->slot0,
                                             &t->preload)) != STRATA_OK)
        st_log(STRATA_LOG_WARN, "engine: kv preload: %s (the admission loads or computes the blocks)",
               st_last_error());
    if (t->preload) {
        pthread_mutex_lock(&e->mu);
        e->n_preloading++;
        pthread_mutex_unlock(&e->mu);
        return;
    }
    *pp = t->next;
    unpark(e, t);
}

/* Ticket t is over (taken out of the list): its parked requests to the head of the
 * pending queue, in the order they came; t freed. */
static void unpark(st_engine *e, kv_ticket *t) {
    pthread_mutex_lock(&e->mu);
    st_seq *mine = NULL, **mtail = &mine; /* newest first, like parked: pushed below, they end oldest first */
    for (st_seq **sp = &e->parked; *sp;) {
        st_seq *s = *sp;
        if (s->kv_ticket != t->id) {
            sp = &s->next;
            continue;
        }
        *sp = s->next;
        e->n_parked--;
        s->kv_ticket = 0;
        s->next = NULL;
        *mtail = s;
        mtail = &s->next;
    }
    while (mine) {
        st_seq *s = mine;
        mine = s->next;
        s->next = e->wait_head;
        e->wait_head = s;
        if (!e->wait_tail) e->wait_tail = s;
        e->n_pending++;
    }
    pthread_mutex_unlock(&e->mu);
    ticket_free(t);
}

static void step_commands(st_engine *e) {
    /* adopted tickets whose blocks reached the device: their requests go on */
    for (kv_ticket **pp = &e->tickets; *pp;) {
        kv_ticket *t = *pp;
        if (!t->preload || !st_runner_kv_preload_poll(e->runner, t->preload)) {
            pp = &t->next;
            continue;
        }
        t->preload = NULL;
        *pp = t->next;
        pthread_mutex_lock(&e->mu);
        e->n_preloading--;
        pthread_mutex_unlock(&e->mu);
        unpark(e, t);
    }
    pthread_mutex_lock(&e->mu);
    kv_cmd *c = e->cmd_head;
    e->cmd_head = e->cmd_tail = NULL;
    e->n_cmds = 0;
    pthread_mutex_unlock(&e->mu);
    while (c) {
        kv_cmd *nx = c->next;
        if (c->kind == CMD_RESERVE) do_reserve(e, c);
        else do_resolve(e, c);
        st_free(c->tokens);
        st_free(c);
        c = nx;
    }
}

/* ---- one step ------------------------------------------------------------------------*/

/* Part 1: aborted requests out (pending ones from the queue, live ones from
 * the runner), new ones into the runner (in add order). Returns the ones to
 * finish (aborted, or refused by the runner), oldest first, to be finished
 * without the lock. */
static st_seq *step_intake(st_engine *e) {
    st_seq *out = NULL, **otail = &out;
    pthread_mutex_lock(&e->mu);
    /* live ones that were aborted leave the runner (blocks released) */
    for (st_seq *s = e->live; s;) {
        st_seq *nx = s->next;
        if (s->abort) {
            live_unlink_locked(e, s);
            ST_ASSERT(st_runner_finish(e->runner, s->id, ST_FINISH_ABORT) == STRATA_OK);
            *otail = s;
            otail = &s->next;
        }
        s = nx;
    }
    /* parked ones (waiting for a transfer) that were aborted leave */
    if (e->parked_abort) {
        e->parked_abort = false;
        for (st_seq **pp = &e->parked; *pp;) {
            st_seq *s = *pp;
            if (!s->abort) {
                pp = &s->next;
                continue;
            }
            *pp = s->next;
            e->n_parked--;
            st_seq_set_finished(s, ST_FINISH_ABORT, NULL);
            s->next = NULL;
            *otail = s;
            otail = &s->next;
        }
    }
    /* the pending queue: aborted ones leave, those waiting for a transfer park, the rest join the runner */
    st_seq *s = e->wait_head;
    e->wait_head = e->wait_tail = NULL;
    e->n_pending = 0;
    while (s) {
        st_seq *nx = s->next;
        s->next = NULL;
        if (s->abort) {
            st_seq_set_finished(s, ST_FINISH_ABORT, NULL);
            *otail = s;
            otail = &s->next;
            s = nx;
            continue;
        }
        if (s->kv_ticket && ticket_find(e, s->kv_ticket)) {
            s->next = e->parked;
            e->parked = s;
            e->n_parked++;
            s = nx;
            continue;
        }
        s->kv_ticket = 0; /* adopted or cancelled already (or unknown): runs now */
        if (st_runner_add(e->runner, s) != STRATA_OK) {
            /* not expected (ids are unique; NOMEM): it fails alone */
            st_log(STRATA_LOG_ERROR, "engine: request %llu: %s", (unsigned long long)s->id, st_last_error());
            st_seq_set_finished(s, ST_FINISH_ERROR, "the runner refused the request");
            *otail = s;
            otail = &s->next;
            s = nx;
            continue;
        }
        s->prev = NULL;
        s->next = e->live;
        if (e->live) e->live->prev = s;
        e->live = s;
        e->n_live++;
        s = nx;
    }
    e->n_running = st_runner_num_running(e->runner);
    e->n_waiting = st_runner_num_waiting(e->runner) + e->n_parked;
    pthread_mutex_unlock(&e->mu);
    return out;
}

/* Part 4 for one event: timing, the new text to on_text, and the finish
 * when the runner let the sequence go. */
static void seq_event(st_engine *e, const st_runner_event *ev, int64_t *n_sampled) {
    st_seq *s = ev->seq;
    if (ev->token >= 0) {
        const double now = st_time_now();
        const bool first = s->t_first <= 0;
        pthread_mutex_lock(&e->mu);
        if (first) hist_observe(&e->m.ttft, now - s->t_add);
        else hist_observe(&e->m.tbt, now - s->t_last);
        pthread_mutex_unlock(&e->mu);
        if (first) s->t_first = now;
        s->t_last = now;
        *n_sampled += ev->n_tokens; /* several with speculative decoding */
        if (s->n_text > 0 && s->cb.on_text) s->cb.on_text(s->cb.user, s->text, s->n_text);
    }
    if (!ev->finished) return;
    pthread_mutex_lock(&e->mu);
    live_unlink_locked(e, s);
    pthread_mutex_unlock(&e->mu);
    seq_finish(e, s);
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
    e->m.prefix_cache_hits = rs.sched.cached_tokens;
    e->m.prefix_hits_device = rs.kv.hit_tokens;
    e->m.prefix_hits_host = rs.tiers ? rs.tier.hit_tokens_host : 0;
    e->m.prefix_hits_ssd = rs.tiers ? rs.tier.hit_tokens_ssd : 0;
    e->m.kv_blocks_cached = rs.kv.cached;
    e->m.kv_blocks_free = rs.kv.free;
    e->m.kv_tiers = rs.tiers;
    e->m.kv_tier = rs.tier;
    e->m.kv_swaps = rs.sched.swaps;
    e->m.spec_drafted = rs.sched.drafted;
    e->m.spec_accepted = rs.sched.accepted;
    e->n_running = st_runner_num_running(e->runner);
    e->n_waiting = st_runner_num_waiting(e->runner) + e->n_pending + e->n_parked;
}

strata_status st_engine_step(st_engine *e, bool *worked) {
    if (worked) *worked = false;
    const double t_step = st_time_now();
    step_commands(e);
    st_seq *gone = step_intake(e);
    while (gone) {
        st_seq *nx = gone->next;
        gone->next = NULL;
        seq_finish(e, gone);
        gone = nx;
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
        st_seq *list = NULL;
        pthread_mutex_lock(&e->mu);
        while (e->live) {
            st_seq *s = e->live;
            live_unlink_locked(e, s);
            st_runner_finish(e->runner, s->id, ST_FINISH_ERROR);
            st_seq_set_finished(s, ST_FINISH_ERROR, msg);
            s->next = list;
            list = s;
        }
        sync_metrics_locked(e);
        pthread_mutex_unlock(&e->mu);
        while (list) {
            st_seq *nx = list->next;
            list->next = NULL;
            seq_finish(e, list);
            list = nx;
        }
        return STRATA_OK;
    }
    /* events copied: finishing a sequence calls the runner */
    const int64_t n_ev = info.n_events;
    ST_ASSERT(n_ev <= e->p.max_batch);
    if (n_ev > 0) memcpy(e->ev, info.events, (size_t)n_ev * sizeof *e->ev);
    /* queue time of the newly admitted: until the start of the step that admitted them */
    const double now = t_step;
    pthread_mutex_lock(&e->mu);
    for (st_seq *s = e->live; s; s = s->next)
        if (s->t_admit <= 0 && s->n_cached >= 0) s->t_admit = now;
    pthread_mutex_unlock(&e->mu);
    /* a decode-only step: every sequence ran one token and sampled; the keys
     * each attended over are its context after the step less the new token */
    const bool decode_only = info.n_tokens > 0 && info.n_decodes == info.n_seqs && info.n_tokens == info.n_seqs &&
                             n_ev == info.n_seqs;
    int64_t kv_keys = 0;
    for (int64_t k = 0; k < n_ev && decode_only; k++)
        kv_keys += e->ev[k].seq->n_tokens - (e->ev[k].token >= 0 ? 1 : 0);
    int64_t sampled = 0;
    for (int64_t k = 0; k < n_ev; k++) {
        if (e->ev[k].seq->t_admit <= 0) e->ev[k].seq->t_admit = now;
        seq_event(e, &e->ev[k], &sampled);
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
        bool worked = false;
        st_engine_step(e, &worked);
        if (!worked) usleep(200); /* only copies in flight (a P-D preload): poll, not spin */
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

int64_t st_engine_kv_landing_blocks(const st_engine *e) { return st_runner_land_slots(e->runner); }

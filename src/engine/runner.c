/* engine/runner: see runner.h.
 *
 * Per live sequence the runner keeps a small struct (its sampler and stop
 * ids), handed to the scheduler as the sequence's `user` pointer, so every
 * decision item and finished record leads back to it. The batch arrays are
 * allocated once at init for the largest step (max_batch_tokens tokens,
 * max_batch sequences with tables of ceil(max_model_len / block_size)
 * blocks), so a step allocates nothing. */
#include "engine/runner.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEF_MAX_BATCH 32
#define DEF_MAX_MODEL_LEN 2048
#define DEF_BATCH_TOKENS 512
#define DEF_BLOCK 16
#define DEF_KV_CAP ((size_t)1 << 30)

typedef struct {
    uint64_t id;
    void *user;              /* the request's */
    st_sampler *sampler;
    int32_t *stop_ids;       /* [n_stop] */
    int64_t n_stop;
} rseq;

struct st_runner {
    st_runner_params p;
    st_backend *be;
    st_llama *model;
    st_kv_cache *kv;
    st_block_manager *bm;
    st_scheduler *sched;
    int64_t model_vocab;
    int64_t table_w;         /* widest block-table row: ceil(max_model_len / block_size) */

    /* one step's batch (host) */
    int32_t *tokens, *pos, *seq, *logit_rows; /* [max_batch_tokens] */
    int32_t *tables;         /* [max_batch * table_w] */
    int32_t *ctx_lens;       /* [max_batch] */
    int32_t *next;           /* [max_batch] sampled token per item (-1: none) */
    int64_t *logit_item;     /* [max_batch] item of each logit row */
    float *logits;           /* [max_batch, model vocab] */
    bool dev_sample;         /* CUDA: draw on the device the tokens of samplers without a penalty */
    st_sample_args *sargs;   /* [max_batch] the sample op's args, one per logit row */
    int32_t *sids;           /* [max_batch] the tokens it drew */
    st_runner_event *events; /* [max_batch] */
    rseq **done;             /* [max_batch] sequences to free after the step */

    st_runner_stats stats;
};

static void rseq_free(rseq *q) {
    if (!q) return;
    st_sampler_free(q->sampler);
    st_free(q->stop_ids);
    st_free(q);
}

/* ---- init / free -------------------------------------------------------------------*/

strata_status st_runner_init(const st_model_files *files, st_backend *be, const st_runner_params *params,
                             st_runner **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "runner: out is NULL");
    *out = NULL;
    if (!files || !be) return st_err(STRATA_ERR_INVALID_ARG, "runner: no model files or backend");
    st_runner_params p = params ? *params : (st_runner_params){0};
    const st_config *cfg = &files->config;
    if (p.max_batch < 0 || p.max_model_len < 0 || p.max_batch_tokens < 0 || p.prefill_chunk < 0 ||
        p.block_size < 0 || p.num_blocks < 0 || p.vocab < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "runner: negative parameter");
    if (p.max_batch == 0) p.max_batch = DEF_MAX_BATCH;
    if (p.max_model_len == 0) {
        p.max_model_len = DEF_MAX_MODEL_LEN;
        if (cfg->max_position_embeddings > 0 && cfg->max_position_embeddings < p.max_model_len)
            p.max_model_len = cfg->max_position_embeddings;
    }
    if (p.max_model_len < 2 || p.max_model_len > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "runner: max_model_len %lld (2 to 2^31-1)", (long long)p.max_model_len);
    if (p.max_batch_tokens == 0) p.max_batch_tokens = DEF_BATCH_TOKENS;
    if (p.max_batch_tokens < p.max_batch) p.max_batch_tokens = p.max_batch;
    if (p.block_size == 0) p.block_size = DEF_BLOCK;
    if (p.vocab == 0 || p.vocab > cfg->vocab_size) {
        if (p.vocab > cfg->vocab_size)
            return st_err(STRATA_ERR_INVALID_ARG, "runner: vocab %lld exceeds the model's %lld", (long long)p.vocab,
                          (long long)cfg->vocab_size);
        p.vocab = cfg->vocab_size;
    }
    const int64_t kv_dim = cfg->n_kv_heads * cfg->head_dim;
    const size_t tok_bytes = 2 * (size_t)cfg->n_layers * (size_t)kv_dim * sizeof(float);
    const int64_t seq_blocks = (p.max_model_len - 1 + p.block_size - 1) / p.block_size;
    if (p.num_blocks == 0) {
        size_t mem = p.kv_mem;
        if (mem == 0) {
            const double want = (double)tok_bytes * (double)p.max_batch * (double)p.max_model_len;
            mem = want < (double)DEF_KV_CAP ? (size_t)want : DEF_KV_CAP;
        }
        p.num_blocks = (int64_t)(mem / (tok_bytes * (size_t)p.block_size));
        if (p.num_blocks < seq_blocks) p.num_blocks = seq_blocks;
    }

    st_runner *r = st_calloc(1, sizeof *r);
    if (!r) return st_err(STRATA_ERR_NOMEM, "runner: out of memory");
    r->p = p;
    r->be = be;
    r->model_vocab = cfg->vocab_size;
    r->table_w = (p.max_model_len + p.block_size - 1) / p.block_size;
    strata_status st;
    {
        st_llama_params lp = {.max_ctx = p.max_model_len, .max_batch = p.max_batch_tokens, .weights = p.weights,
                              .kv_pool_tokens = p.num_blocks * p.block_size, .no_seq_kv = true};
        if ((st = st_llama_init(files, be, &lp, &r->model))) goto fail;
        ST_ASSERT(st_llama_max_batch(r->model) == p.max_batch_tokens);
        const st_kv_cache_params kp = {.num_blocks = p.num_blocks, .block_size = p.block_size};
        if ((st = st_kv_cache_init(r->model, &kp, &r->kv))) goto fail;
        const st_bm_params bp = {.num_blocks = p.num_blocks, .block_size = p.block_size,
                                 .disable_prefix_cache = p.disable_prefix_cache};
        if ((st = st_bm_init(&bp, &r->bm))) goto fail;
        const st_scheduler_params sp = {.max_num_batched_tokens = p.max_batch_tokens, .max_batch = p.max_batch,
                                        .max_model_len = p.max_model_len, .prefill_chunk = p.prefill_chunk};
        if ((st = st_scheduler_init(&sp, r->bm, &r->sched))) goto fail;
    }
    const size_t T = (size_t)p.max_batch_tokens, B = (size_t)p.max_batch;
    r->tokens = st_malloc(T * sizeof *r->tokens);
    r->pos = st_malloc(T * sizeof *r->pos);
    r->seq = st_malloc(T * sizeof *r->seq);
    r->logit_rows = st_malloc(T * sizeof *r->logit_rows);
    r->tables = st_malloc(B * (size_t)r->table_w * sizeof *r->tables);
    r->ctx_lens = st_malloc(B * sizeof *r->ctx_lens);
    r->next = st_malloc(B * sizeof *r->next);
    r->logit_item = st_malloc(B * sizeof *r->logit_item);
    r->logits = st_malloc(B * (size_t)r->model_vocab * sizeof *r->logits);
    r->events = st_calloc(B, sizeof *r->events);
    r->done = st_calloc(B, sizeof *r->done);
    r->sargs = st_malloc(B * sizeof *r->sargs);
    r->sids = st_malloc(B * sizeof *r->sids);
    {   /* device sampling: CUDA, rows of the samplers' width; STRATA_DEVICE_SAMPLE=0 turns it off */
        const char *ds = getenv("STRATA_DEVICE_SAMPLE");
        r->dev_sample = be->kind == ST_BACKEND_CUDA && p.vocab == r->model_vocab && !(ds && strcmp(ds, "0") == 0);
    }
    if (!r->tokens || !r->pos || !r->seq || !r->logit_rows || !r->tables || !r->ctx_lens || !r->next ||
        !r->logit_item || !r->logits || !r->events || !r->done || !r->sargs || !r->sids) {
        st = st_err(STRATA_ERR_NOMEM, "runner: out of memory for the batch arrays");
        goto fail;
    }
    *out = r;
    return STRATA_OK;
fail:;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    st_runner_free(r);
    return st_err(st, "runner: %s", msg);
}

/* Frees the runner state of every live sequence (the scheduler frees its own). */
static void free_live(st_runner *r) {
    if (!r->sched) return;
    for (int pass = 0; pass < 2; pass++)
        for (int64_t i = 0;; i++) {
            const st_seq *q = pass == 0 ? st_scheduler_running(r->sched, i) : st_scheduler_waiting(r->sched, i);
            if (!q) break;
            rseq_free(q->user);
        }
}

void st_runner_free(st_runner *r) {
    if (!r) return;
    free_live(r);
    st_scheduler_free(r->sched);
    st_bm_free(r->bm);
    st_kv_cache_free(r->kv);
    st_llama_free(r->model);
    st_free(r->tokens);
    st_free(r->pos);
    st_free(r->seq);
    st_free(r->logit_rows);
    st_free(r->tables);
    st_free(r->ctx_lens);
    st_free(r->next);
    st_free(r->logit_item);
    st_free(r->logits);
    st_free(r->events);
    st_free(r->done);
    st_free(r->sargs);
    st_free(r->sids);
    st_free(r);
}

/* ---- requests ----------------------------------------------------------------------*/

strata_status st_runner_add(st_runner *r, uint64_t id, const st_runner_request *req) {
    if (!r || !req) return st_err(STRATA_ERR_INVALID_ARG, "runner add: no runner or request");
    if (!req->prompt || req->n_prompt < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "runner add: request %llu has an empty prompt", (unsigned long long)id);
    if (req->n_prompt >= r->p.max_model_len)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "runner add: request %llu: the prompt has %lld tokens, max_model_len is %lld (prompt and output)",
                      (unsigned long long)id, (long long)req->n_prompt, (long long)r->p.max_model_len);
    for (int64_t i = 0; i < req->n_prompt; i++)
        if (req->prompt[i] < 0 || req->prompt[i] >= r->p.vocab)
            return st_err(STRATA_ERR_INVALID_ARG, "runner add: request %llu: prompt token %lld is %d, outside [0, %lld)",
                          (unsigned long long)id, (long long)i, req->prompt[i], (long long)r->p.vocab);
    if (req->n_stop_ids < 0 || (req->n_stop_ids > 0 && !req->stop_ids))
        return st_err(STRATA_ERR_INVALID_ARG, "runner add: request %llu: bad stop ids", (unsigned long long)id);
    rseq *q = st_calloc(1, sizeof *q);
    if (!q) return st_err(STRATA_ERR_NOMEM, "runner add: out of memory");
    q->id = id;
    q->user = req->user;
    strata_status st = st_sampler_init(&req->sampler, r->p.vocab, &q->sampler);
    if (st) goto fail;
    if (req->n_stop_ids > 0) {
        q->stop_ids = st_malloc((size_t)req->n_stop_ids * sizeof *q->stop_ids);
        if (!q->stop_ids) {
            st = st_err(STRATA_ERR_NOMEM, "runner add: out of memory");
            goto fail;
        }
        memcpy(q->stop_ids, req->stop_ids, (size_t)req->n_stop_ids * sizeof *q->stop_ids);
        q->n_stop = req->n_stop_ids;
    }
    const st_seq_params sp = {.prompt = req->prompt, .n_prompt = req->n_prompt, .max_tokens = req->max_tokens,
                              .user = q};
    if ((st = st_scheduler_add(r->sched, id, &sp))) goto fail;
    return STRATA_OK;
fail:
    rseq_free(q);
    return st;
}

strata_status st_runner_finish(st_runner *r, uint64_t id, st_seq_finish reason) {
    const st_seq *s = st_scheduler_get_seq(r->sched, id);
    if (!s) return st_err(STRATA_ERR_NOT_FOUND, "runner: no live sequence %llu", (unsigned long long)id);
    rseq *q = s->user;
    strata_status st = st_scheduler_finish(r->sched, id, reason);
    if (st == STRATA_OK) rseq_free(q);
    return st;
}

strata_status st_runner_abort(st_runner *r, uint64_t id) { return st_runner_finish(r, id, ST_SEQ_FINISH_ABORT); }

/* ---- one step ------------------------------------------------------------------------*/

static bool is_stop(const rseq *q, int32_t t) {
    for (int64_t i = 0; i < q->n_stop; i++)
        if (q->stop_ids[i] == t) return true;
    return false;
}

/* The decision as one st_batch (arrays of r). */
static void build_batch(st_runner *r, const st_sched_decision *d, st_batch *b) {
    const int64_t bs = r->p.block_size;
    int64_t width = 1, n_out = 0;
    for (int64_t i = 0; i < d->n_items; i++) {
        const int64_t need = (d->items[i].pos0 + d->items[i].n + bs - 1) / bs;
        if (need > width) width = need;
    }
    ST_ASSERT(width <= r->table_w);
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        const int64_t off = it->slot_offset, ctx = it->pos0 + it->n, nb = (ctx + bs - 1) / bs;
        ST_ASSERT(nb <= it->n_blocks && off + it->n <= d->n_tokens);
        for (int64_t k = 0; k < it->n; k++) {
            r->tokens[off + k] = it->tokens[k];
            r->pos[off + k] = (int32_t)(it->pos0 + k);
            r->seq[off + k] = (int32_t)i;
        }
        int32_t *row = r->tables + i * width;
        memcpy(row, it->block_table, (size_t)nb * sizeof *row);
        for (int64_t k = nb; k < width; k++) row[k] = 0; /* not read */
        r->ctx_lens[i] = (int32_t)ctx;
        if (it->need_logits) {
            r->logit_item[n_out] = i;
            r->logit_rows[n_out++] = (int32_t)(off + it->n - 1);
        }
    }
    *b = (st_batch){.n_tokens = d->n_tokens, .tokens = r->tokens, .pos = r->pos, .seq = r->seq,
                    .slots = d->slot_mapping, .n_seqs = d->n_items, .block_tables = r->tables,
                    .max_blocks = width, .ctx_lens = r->ctx_lens, .logit_rows = r->logit_rows,
                    .n_logits = n_out};
}

static void fill_event(st_runner_event *e, const rseq *q, int32_t token) {
    memset(e, 0, sizeof *e);
    e->id = q->id;
    e->user = q->user;
    e->token = token;
}

strata_status st_runner_step(st_runner *r, st_runner_step_info *out) {
    if (!r || !out) return st_err(STRATA_ERR_INVALID_ARG, "runner step: no runner or out");
    memset(out, 0, sizeof *out);
    out->events = r->events;
    const st_sched_decision *d = NULL;
    strata_status st = st_scheduler_schedule(r->sched, &d);
    if (st) return st;
    out->n_preempted = d->n_preempted;
    if (d->n_items == 0) return STRATA_OK;
    out->n_tokens = d->n_tokens;
    out->n_seqs = d->n_items;
    out->n_decodes = d->n_decodes;

    /* 2-3: the batch through the model */
    st_batch b;
    build_batch(r, d, &b);
    /* Device sampling (CUDA, no on_logits hook): rows whose sampler has no
     * penalty get their token from the backend's sample op (the u it draws
     * with comes from the sampler's own random state now), and the logits
     * cross to the host only when some other row needs them. */
    const bool dev = r->dev_sample && !r->p.on_logits && b.n_logits > 0;
    bool need_logits = !dev;
    if (dev)
        for (int64_t k = 0; k < b.n_logits; k++) {
            st_sampler *sm = ((rseq *)d->items[r->logit_item[k]].user)->sampler;
            if (st_sampler_device_ok(sm)) {
                st_sampler_next_args(sm, &r->sargs[k]);
            } else { /* sampled on the host; the op's token for it is ignored */
                r->sargs[k] = (st_sample_args){.temperature = 0.0f, .top_p = 1.0f};
                need_logits = true;
            }
        }
    double t0 = st_time_now();
    if (dev) st = st_llama_forward_batch_sample(r->model, r->kv, &b, r->sargs, r->sids, need_logits ? r->logits : NULL);
    else st = st_llama_forward_batch(r->model, r->kv, &b, r->logits);
    if (st) return st;
    double t1 = st_time_now();
    r->stats.forward_s += t1 - t0;
    r->stats.steps++;

    /* 4: sample every item that needs logits, with its own sampler */
    const int64_t V = r->model_vocab;
    int64_t n_ev = 0, n_done = 0;
    for (int64_t i = 0; i < d->n_items; i++) r->next[i] = -1;
    for (int64_t k = 0; k < b.n_logits; k++) {
        const int64_t i = r->logit_item[k];
        const st_sched_item *it = &d->items[i];
        rseq *q = it->user;
        const float *row = r->logits + k * V;
        if (r->p.on_logits) r->p.on_logits(r->p.hook_user, it->seq_id, it->pos0 + it->n - 1, row, V);
        const st_seq *s = st_scheduler_get_seq(r->sched, it->seq_id);
        ST_ASSERT(s && s->user == q);
        int32_t t = -1;
        st_runner_event *e = &r->events[n_ev++];
        strata_status sst;
        if (dev && st_sampler_device_ok(q->sampler)) {
            t = r->sids[k];
            sst = t >= 0 ? STRATA_OK
                         : st_err(STRATA_ERR_INVALID_ARG, "sampler: the logits hold a NaN or +inf, or only -inf "
                                                          "(sampled on the device)");
        } else {
            sst = st_sampler_sample(q->sampler, row, s->tokens, s->n_tokens, &t);
        }
        if (sst != STRATA_OK) {
            st_log(STRATA_LOG_WARN, "runner: sequence %llu: %s", (unsigned long long)q->id, st_last_error());
            fill_event(e, q, -1);
            e->failed = true;
            e->finished = true;
            e->reason = ST_SEQ_FINISH_ABORT;
            e->n_prompt = s->n_prompt;
            e->n_generated = st_seq_n_generated(s);
            e->n_cached = s->n_cached < 0 ? 0 : s->n_cached;
            e->n_preemptions = s->n_preemptions;
            /* safe between schedule and update: update skips its item */
            ST_ASSERT(st_scheduler_finish(r->sched, q->id, ST_SEQ_FINISH_ABORT) == STRATA_OK);
            r->done[n_done++] = q;
            continue;
        }
        r->next[i] = t;
        fill_event(e, q, t);
    }
    r->stats.sample_s += st_time_now() - t1;

    /* 5: the scheduler appends, commits, finishes at max_tokens / max_model_len */
    const st_sched_finished *fin = NULL;
    int64_t n_fin = 0;
    if ((st = st_scheduler_update(r->sched, r->next, &fin, &n_fin))) return st;
    /* (d and its items are stale from here) */
    for (int64_t f = 0; f < n_fin; f++) {
        rseq *q = fin[f].user;
        for (int64_t k = 0; k < n_ev; k++) {
            st_runner_event *e = &r->events[k];
            if (e->id != q->id || e->failed) continue;
            e->finished = true;
            e->reason = is_stop(q, e->token) ? ST_SEQ_FINISH_STOP : fin[f].reason;
            e->n_prompt = fin[f].n_prompt;
            e->n_generated = fin[f].n_generated;
            e->n_cached = fin[f].n_cached;
            e->n_preemptions = fin[f].n_preemptions;
        }
        r->done[n_done++] = q;
    }
    /* 5b: stop ids, and the counters of the sequences that go on */
    for (int64_t k = 0; k < n_ev; k++) {
        st_runner_event *e = &r->events[k];
        if (e->finished) continue;
        const st_seq *s = st_scheduler_get_seq(r->sched, e->id);
        ST_ASSERT(s);
        e->n_prompt = s->n_prompt;
        e->n_generated = st_seq_n_generated(s);
        e->n_cached = s->n_cached < 0 ? 0 : s->n_cached;
        e->n_preemptions = s->n_preemptions;
        rseq *q = s->user;
        if (is_stop(q, e->token)) {
            ST_ASSERT(st_scheduler_finish(r->sched, e->id, ST_SEQ_FINISH_STOP) == STRATA_OK);
            e->finished = true;
            e->reason = ST_SEQ_FINISH_STOP;
            r->done[n_done++] = q;
        }
    }
    for (int64_t k = 0; k < n_done; k++) rseq_free(r->done[k]);
    out->n_events = n_ev;
    return STRATA_OK;
}

/* ---- queries -------------------------------------------------------------------------*/

bool st_runner_has_work(const st_runner *r) { return st_scheduler_has_work(r->sched); }
int64_t st_runner_num_running(const st_runner *r) { return st_scheduler_num_running(r->sched); }
int64_t st_runner_num_waiting(const st_runner *r) { return st_scheduler_num_waiting(r->sched); }
const st_seq *st_runner_get_seq(const st_runner *r, uint64_t id) { return st_scheduler_get_seq(r->sched, id); }
const st_runner_params *st_runner_get_params(const st_runner *r) { return &r->p; }
st_llama *st_runner_model(st_runner *r) { return r->model; }

void st_runner_get_stats(const st_runner *r, st_runner_stats *out) {
    *out = r->stats;
    st_scheduler_get_stats(r->sched, &out->sched);
    st_bm_get_stats(r->bm, &out->kv);
}

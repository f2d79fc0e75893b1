/* model/graphs: recorded passes (llama.h, "Recorded passes").
 * st_llama_batch_run replays, records or runs directly. Validity: a
 * recording holds the scratch buffers' addresses of the compute stream; a
 * buffer grows (and moves) only through a device allocation, which bumps
 * be->device_budget.takes, so every recording is dropped when takes changed
 * since the last pass (the shapes stay known: scratch only grows, so a known
 * shape records without growing anything). */
#include "model/model_internal.h"

#define BG_MAX_FAILS 3       /* failed recordings of a shape before it always runs directly */
#define BG_MAX_DROPS 256     /* invalidations (device allocations between steps) before graphs are given up */

static void bg_drop(st_llama *m, batch_graph *e) {
    if (e->g) {
        m->be->ops->graph_destroy(m->be, e->g);
        e->g = NULL;
        m->bg_stats.dropped++;
    }
}

static void bg_drop_all(st_llama *m) {
    for (int i = 0; i < BG_SLOTS; i++) bg_drop(m, &m->bg[i]);
}

void st_llama_set_graphs(st_llama *m, bool on) {
    (void)m->be->ops->stream_sync(m->be, m->stream); /* no replay in flight */
    bg_drop_all(m);
    m->bg_off = !on;
}

void st_llama_get_graph_stats(const st_llama *m, st_llama_graph_stats *out) { *out = m->bg_stats; }

/* The cache entry of this shape; a new one (the least recently used evicted)
 * when the shape is not known: *fresh = true then. */
static batch_graph *bg_find(st_llama *m, const st_kv_pool *kv, const batch_dev *d, int64_t n, int64_t n_logits,
                            bool sample, bool *fresh) {
    batch_graph *lru = &m->bg[0];
    *fresh = false;
    for (int i = 0; i < BG_SLOTS; i++) {
        batch_graph *e = &m->bg[i];
        if (e->used && e->kv == kv && e->n == n && e->n_logits == n_logits && e->max_ctx == d->pk.max_ctx &&
            e->sample == sample)
            return e;
        if (!e->used || (lru->used && e->last_use < lru->last_use)) lru = e;
    }
    bg_drop(m, lru);
    *lru = (batch_graph){.used = true, .n = n, .n_logits = n_logits, .max_ctx = d->pk.max_ctx, .sample = sample,
                         .kv = kv};
    *fresh = true;
    return lru;
}

strata_status st_llama_batch_run(st_llama *m, st_kv_pool *kv, batch_dev *d, const st_batch *b, bool sample) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const int64_t n = b->n_tokens, nl = b->n_logits;
    /* a gathered prefill passes its context length by value: never recorded;
     * nor a pass whose layers wait on KV arriving from the lower tiers */
    if (m->bg_off || n > BG_MAX_TOKENS || !st_wm_all_resident(m->wm) || d->gather_ctx > 0 ||
        st_kv_pool_has_ready(kv)) {
        m->bg_stats.direct++;
        return st_llama_batch_ops(m, kv, d, b->tokens, n, nl, sample);
    }
    if (be->device_budget.takes != m->bg_takes) { /* something was allocated: scratch may have moved */
        bool any = false;
        for (int i = 0; i < BG_SLOTS; i++) any = any || m->bg[i].g;
        if (any) {
            bg_drop_all(m);
            if (++m->bg_invalid > BG_MAX_DROPS) { /* allocations between steps, again and again */
                m->bg_off = true;
                st_log(STRATA_LOG_WARN, "batched passes: recorded graphs invalidated %d times by device "
                       "allocations between steps; running directly from now on", m->bg_invalid);
            }
        }
        m->bg_takes = be->device_budget.takes;
    }
    bool fresh = false;
    batch_graph *e = bg_find(m, kv, d, n, nl, sample, &fresh);
    e->last_use = ++m->bg_clock;
    if (!e->g && !fresh && e->fails < BG_MAX_FAILS && !m->bg_off) {
        strata_status st = o->graph_begin(be, m->stream);
        if (st == STRATA_ERR_UNSUPPORTED) {
            m->bg_off = true; /* CPU: every pass runs directly */
        } else if (st == STRATA_OK) {
            st_graph *g = NULL;
            st = st_llama_batch_ops(m, kv, d, b->tokens, n, nl, sample);
            const strata_status st2 = o->graph_end(be, m->stream, st == STRATA_OK ? &g : NULL);
            if (st == STRATA_OK && st2 == STRATA_OK && g) {
                e->g = g;
                m->bg_stats.recorded++;
                st_log(STRATA_LOG_DEBUG, "batched pass recorded: %lld tokens, %lld logit rows, context bound %lld%s",
                       (long long)n, (long long)nl, (long long)d->pk.max_ctx, sample ? ", sampling" : "");
            } else {
                o->graph_destroy(be, g);
                e->fails++;
                m->bg_stats.failed++;
                st_log(STRATA_LOG_DEBUG, "batched pass of %lld tokens not recorded (try %d): %s", (long long)n,
                       e->fails, st_last_error());
            }
        } else {
            e->fails++;
            m->bg_stats.failed++;
        }
        /* a recording that allocated (none should) invalidates itself at the next pass */
    }
    if (e->g) {
        m->bg_stats.replays++;
        return o->graph_launch(be, m->stream, e->g);
    }
    m->bg_stats.direct++;
    return st_llama_batch_ops(m, kv, d, b->tokens, n, nl, sample);
}


void st_llama_forget_pool(st_llama *m, const st_kv_pool *kv) {
    (void)m->be->ops->stream_sync(m->be, m->stream); /* nothing may still use the pool */
    for (int i = 0; i < BG_SLOTS; i++) /* recorded passes over this pool hold its pointers */
        if (m->bg[i].used && m->bg[i].kv == kv) {
            bg_drop(m, &m->bg[i]);
            m->bg[i] = (batch_graph){0};
        }
}

void st_llama_graphs_free(st_llama *m) {
    for (int i = 0; i < BG_SLOTS; i++) m->be->ops->graph_destroy(m->be, m->bg[i].g);
}

/* weights/manager: resident groups, the device ring, the reader / copier /
 * pinner threads (see manager.h for the protocol).
 *
 * Shared state is guarded by one mutex and one condition variable (every
 * change broadcasts; the waits are few per group, so contention is nil):
 *   use_done      sequences < use_done are released or skipped (compute side)
 *   holding       compute holds (or waits for) sequence held_seq
 *   fetched       the copier enqueued (or dropped) every sequence < fetched
 *   desc[]        sequences the reader published for the copier, in order
 *   ch[].state    staging chunk FREE -> READING (reader) -> FILLED (reader, on
 *                 completion) -> FREE (copier, after enqueueing its copies and
 *                 recording ch.ev; the reader syncs ch.ev before reuse)
 *   host_ready[]  host-tier group pinned and filled (pinner)
 * Slot s of sequence k is written only when use_done > k - ring_slots, after
 * the copy stream waited on slot_done[s] (recorded by compute before the
 * release of sequence k - ring_slots). */
#include "weights/manager.h"

#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* SRC_CPU: a CPU-tier group in the streamed order while stream_cpu
 * (prefill): copied whole from host memory like a host-tier group.
 * SRC_PART: a split CPU-tier group in the decode order: the device's part
 * of it (groups.h st_wg_split) copied from host memory. */
enum { SRC_HOST = 1, SRC_SSD = 2, SRC_CPU = 3, SRC_PART = 4 };
enum { CH_FREE = 0, CH_READING, CH_FILLED };
#define DESC_RING 64

typedef struct {
    uint64_t seq;
    int group;
    int source;
    uint64_t first_piece;
    uint64_t n_pieces;
} seq_desc;

typedef struct {
    int state;
    uint64_t piece;            /* piece number it holds */
    uint64_t img_off, len;     /* the image range of that piece */
    st_event *ev;              /* copies out of it, on the copy stream */
    bool ev_pending;
} chunk;

struct st_wm {
    st_backend *be;
    const st_model_files *files;
    const st_wgroups *groups;
    st_wplan plan; /* tier[] owned */
    st_wm_params p;
    int n;

    void **res_block;                          /* [n] device blocks (NULL: zero copy / not resident) */
    const void *(*res_ptr)[ST_WG_MAX_TENSORS]; /* [n] */

    /* the streamed order in use: every non-resident group while stream_cpu (order_all), else all but the
     * CPU tier's (order_dev): a CPU-tier group then takes no place in the ring's look-ahead */
    int n_order;
    int *order;     /* [n_order] streamed groups in cyclic order (order_all or order_dev) */
    int *order_pos; /* [n] position in order, -1 (pos_all or pos_dev) */
    int n_all, n_dev;
    int *order_all, *pos_all, *order_dev, *pos_dev;
    int n_slots;
    void **slot;
    st_event **slot_ready, **slot_done;
    bool *slot_used;
    int *slot_src;  /* SRC_HOST / SRC_SSD of what the copier put in the slot (under mu) */
    st_stream *copy;

    int n_chunks;
    size_t chunk_bytes;
    void *stg_raw;
    uint8_t *stg;
    chunk *ch;
    int depth;

    void **host_raw;
    uint8_t **host_img;
    bool *host_ready;
    size_t *host_size;

    void *rows_dev;
    int32_t *ids_dev;
    void *rows_host;
    size_t rows_host_bytes;
    st_event *rows_ev[2];
    bool rows_pending[2];
    int rows_next;

    st_ssd_files *sf;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool sync_init;
    pthread_t reader, copier, pinner;
    bool reader_on, copier_on, pinner_on;
    bool stop;
    strata_status failed;
    char errmsg[1024];

    bool stream_cpu; /* CPU-tier groups are streamed to the device (st_wm_stream_cpu) */
    uint64_t use_done;
    uint64_t published; /* the reader published every sequence < published */
    bool holding;
    uint64_t held_seq;
    int held_group;
    uint64_t fetched;
    seq_desc desc[DESC_RING];
    uint64_t desc_head, desc_tail;

    st_budget host_budget;
    st_wm_stats stats;
};

/* Whether group g is a split CPU-tier group, and its split. */
static bool split_of(const st_wm *wm, int g, st_wg_split *sp) {
    return wm->plan.tier[g] == ST_TIER_CPU && wm->plan.split_rows > 0 &&
           st_wg_split_of(&wm->groups->g[g], wm->plan.split_rows, sp);
}

static uint8_t *align_ptr(void *p) {
    return (uint8_t *)(((uintptr_t)p + ST_WG_ALIGN - 1) / ST_WG_ALIGN * ST_WG_ALIGN);
}

/* ---- failure (sticky) ---- */

/* Records the calling thread's last error as the manager's failure. */
static void wm_fail(st_wm *wm, strata_status st) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    pthread_mutex_lock(&wm->mu);
    bool first = wm->failed == STRATA_OK;
    if (first) {
        wm->failed = st;
        snprintf(wm->errmsg, sizeof wm->errmsg, "%s", msg);
    }
    pthread_cond_broadcast(&wm->cv);
    pthread_mutex_unlock(&wm->mu);
    if (first) st_log(STRATA_LOG_ERROR, "weight streaming stopped: %s", msg);
}

/* Under the lock: the sticky failure as this thread's error. */
static strata_status failed_err(st_wm *wm) { return st_err(wm->failed, "%s", wm->errmsg); }

/* The calling thread's last error prefixed with what it was allocating
 * ("weights: ring slot 2 of 2 (1.7 MB): <the backend's message>"). */
static strata_status alloc_failed(strata_status st, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static strata_status alloc_failed(strata_status st, size_t n, const char *fmt, ...) {
    char msg[768], what[160], b[32];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return st_err(st, "weights: %s (%s): %s", what, st_fmt_bytes((double)n, b, sizeof b), msg);
}

static strata_status host_take(st_wm *wm, size_t n, const char *what) {
    pthread_mutex_lock(&wm->mu);
    strata_status st = st_budget_take(&wm->host_budget, n, what);
    pthread_mutex_unlock(&wm->mu);
    return st;
}

static void host_give(st_wm *wm, size_t n) {
    pthread_mutex_lock(&wm->mu);
    st_budget_give(&wm->host_budget, n);
    pthread_mutex_unlock(&wm->mu);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- reader ---- */

typedef struct {
    st_wm *wm;
    st_ssd_queue *q;
} reader_ctx;

/* Takes one finished read (blocking) and marks its chunk filled. */
static bool reap_one(reader_ctx *rc, bool wait) {
    st_wm *wm = rc->wm;
    bool got = false;
    uint64_t tag = 0;
    strata_status st = st_ssd_reap(rc->q, wait, &got, &tag);
    if (st != STRATA_OK) {
        wm_fail(wm, st);
        return false;
    }
    if (got) {
        pthread_mutex_lock(&wm->mu);
        chunk *c = &wm->ch[tag % (uint64_t)wm->n_chunks];
        ST_ASSERT(c->state == CH_READING && c->piece == tag);
        c->state = CH_FILLED;
        pthread_cond_broadcast(&wm->cv);
        pthread_mutex_unlock(&wm->mu);
    }
    return true;
}

typedef bool (*wm_pred)(const st_wm *wm, uint64_t arg);
static bool pred_desc_space(const st_wm *wm, uint64_t arg) {
    return wm->n_order > 0 && wm->desc_head - wm->desc_tail < DESC_RING; /* an empty order: decode on the CPU tier */
}
static bool pred_chunk_free(const st_wm *wm, uint64_t c) { return wm->ch[c].state == CH_FREE; }

/* Waits until pred holds, reaping finished reads meanwhile (the copier may be
 * waiting for them). false on stop or failure. */
static bool reader_wait(reader_ctx *rc, wm_pred pred, uint64_t arg) {
    st_wm *wm = rc->wm;
    for (;;) {
        pthread_mutex_lock(&wm->mu);
        if (wm->stop || wm->failed) {
            pthread_mutex_unlock(&wm->mu);
            return false;
        }
        if (pred(wm, arg)) {
            pthread_mutex_unlock(&wm->mu);
            return true;
        }
        if (st_ssd_queue_inflight(rc->q) == 0) {
            pthread_cond_wait(&wm->cv, &wm->mu);
            pthread_mutex_unlock(&wm->mu);
            continue;
        }
        pthread_mutex_unlock(&wm->mu);
        if (!reap_one(rc, true)) return false;
    }
}

static uint64_t group_pieces(const st_wm *wm, const st_wgroup *g) {
    uint64_t n = 0;
    for (int e = 0; e < g->n_extents; e++) n += (g->ext[e].len + wm->chunk_bytes - 1) / wm->chunk_bytes;
    return n;
}

/* Submits every piece of group g (sequence k) into staging. */
static bool read_group(reader_ctx *rc, const st_wgroup *g, uint64_t *piece) {
    st_wm *wm = rc->wm;
    strata_status st = st_ssd_files_check(wm->sf);
    if (st != STRATA_OK) {
        wm_fail(wm, st);
        return false;
    }
    for (int e = 0; e < g->n_extents; e++) {
        const st_wg_extent *x = &g->ext[e];
        for (uint64_t off = 0; off < x->len; off += wm->chunk_bytes) {
            const uint64_t len = x->len - off < wm->chunk_bytes ? x->len - off : wm->chunk_bytes;
            const uint64_t need = x->need > off ? (x->need - off < len ? x->need - off : len) : 0;
            const uint64_t ci = *piece % (uint64_t)wm->n_chunks;
            if (!reader_wait(rc, pred_chunk_free, ci)) return false;
            pthread_mutex_lock(&wm->mu);
            chunk *c = &wm->ch[ci];
            const bool pending = c->ev_pending;
            c->ev_pending = false;
            pthread_mutex_unlock(&wm->mu);
            if (pending && (st = wm->be->ops->event_sync(wm->be, c->ev)) != STRATA_OK) { /* its copy-out */
                wm_fail(wm, st);
                return false;
            }
            pthread_mutex_lock(&wm->mu);
            c->state = CH_READING;
            c->piece = *piece;
            c->img_off = x->img_off + off;
            c->len = len;
            wm->stats.ssd_read_bytes += len;
            wm->stats.ssd_reads++;
            pthread_mutex_unlock(&wm->mu);
            st = st_ssd_submit(rc->q, x->file, x->file_off + off, len, need, wm->stg + ci * wm->chunk_bytes, *piece);
            if (st != STRATA_OK) {
                wm_fail(wm, st);
                return false;
            }
            (*piece)++;
            while (st_ssd_queue_inflight(rc->q) > 0) { /* take what finished already, without blocking */
                const int before = st_ssd_queue_inflight(rc->q);
                if (!reap_one(rc, false)) return false;
                if (st_ssd_queue_inflight(rc->q) == before) break;
            }
        }
    }
    return true;
}

static void *reader_main(void *arg) {
    st_wm *wm = arg;
    reader_ctx rc = {wm, NULL};
    strata_status st = st_ssd_queue_init(wm->sf, wm->depth, wm->p.use_pread, &rc.q);
    if (st != STRATA_OK) {
        wm_fail(wm, st);
        return NULL;
    }
    pthread_mutex_lock(&wm->mu);
    wm->stats.uring = st_ssd_queue_uring(rc.q);
    pthread_mutex_unlock(&wm->mu);
    uint64_t k = 0, piece = 0;
    for (;;) {
        if (!reader_wait(&rc, pred_desc_space, 0)) break;
        pthread_mutex_lock(&wm->mu);
        if (k < wm->use_done) k = wm->use_done; /* skipped meanwhile: no need to read those */
        const int g = wm->order[k % (uint64_t)wm->n_order];
        const bool cpu = wm->plan.tier[g] == ST_TIER_CPU; /* host memory (pinned, or the file mapping) */
        const bool host = cpu || (wm->plan.tier[g] == ST_TIER_HOST && wm->host_ready[g]);
        seq_desc *d = &wm->desc[wm->desc_head % DESC_RING];
        d->seq = k;
        d->group = g;
        d->source = cpu ? (wm->stream_cpu ? SRC_CPU : SRC_PART) : host ? SRC_HOST : SRC_SSD;
        d->first_piece = piece;
        d->n_pieces = host ? 0 : group_pieces(wm, &wm->groups->g[g]);
        wm->desc_head++;
        wm->published = k + 1;
        pthread_cond_broadcast(&wm->cv);
        pthread_mutex_unlock(&wm->mu);
        if (!host && !read_group(&rc, &wm->groups->g[g], &piece)) break;
        k++;
    }
    st_ssd_queue_free(rc.q); /* waits for reads in flight: staging stays valid until then */
    return NULL;
}

/* ---- copier ---- */

static bool copier_wait_filled(st_wm *wm, uint64_t piece) {
    chunk *c = &wm->ch[piece % (uint64_t)wm->n_chunks];
    pthread_mutex_lock(&wm->mu);
    while (!wm->stop && !wm->failed && !(c->state == CH_FILLED && c->piece == piece))
        pthread_cond_wait(&wm->cv, &wm->mu);
    bool ok = !wm->stop && !wm->failed;
    pthread_mutex_unlock(&wm->mu);
    return ok;
}

static void chunk_release(st_wm *wm, uint64_t piece, bool pending) {
    pthread_mutex_lock(&wm->mu);
    chunk *c = &wm->ch[piece % (uint64_t)wm->n_chunks];
    c->state = CH_FREE;
    c->ev_pending = pending;
    pthread_cond_broadcast(&wm->cv);
    pthread_mutex_unlock(&wm->mu);
}

/* Enqueues the copies of sequence d into its slot. */
static strata_status copy_seq(st_wm *wm, const seq_desc *d, int s) {
    st_backend *be = wm->be;
    const st_backend_ops *o = be->ops;
    const st_wgroup *g = &wm->groups->g[d->group];
    uint8_t *dst = wm->slot[s];
    strata_status st;
    if (wm->slot_used[s] && (st = o->stream_wait_event(be, wm->copy, wm->slot_done[s])) != STRATA_OK) return st;
    if (d->source == SRC_HOST || d->source == SRC_CPU || d->source == SRC_PART) { /* from host memory */
        st_wg_split sp;
        const bool part = d->source == SRC_PART && split_of(wm, d->group, &sp); /* the device's part */
        ST_ASSERT(part == (d->source == SRC_PART));
        pthread_mutex_lock(&wm->mu);
        const uint8_t *src = wm->host_ready[d->group] ? wm->host_img[d->group] : NULL;
        pthread_mutex_unlock(&wm->mu);
        for (int i = 0; i < g->n_tensors; i++) {
            const uint8_t *t = src ? src + g->t[i].img_off : (const uint8_t *)st_tensor_data(wm->files, g->t[i].desc);
            uint8_t *to = dst + g->t[i].slot_off;
            st = !part               ? o->copy_h2d(be, wm->copy, to, t, g->t[i].desc->nbytes)
                 : sp.height[i] == 1 ? o->copy_h2d(be, wm->copy, to, t + sp.src_off[i], sp.width[i])
                                     : o->copy_2d(be, wm->copy, to, sp.width[i], t + sp.src_off[i], sp.pitch[i],
                                                  sp.width[i], sp.height[i]);
            if (st != STRATA_OK) return st;
        }
    } else {
        for (uint64_t p = d->first_piece; p < d->first_piece + d->n_pieces; p++) {
            if (!copier_wait_filled(wm, p)) return STRATA_OK; /* stop or failure: the caller sees it */
            const uint64_t ci = p % (uint64_t)wm->n_chunks;
            const chunk *c = &wm->ch[ci];
            const uint8_t *src = wm->stg + ci * wm->chunk_bytes;
            const uint64_t a = c->img_off, b = c->img_off + c->len;
            for (int i = 0; i < g->n_tensors; i++) {
                const uint64_t t0 = g->t[i].img_off, t1 = t0 + g->t[i].desc->nbytes;
                const uint64_t lo = a > t0 ? a : t0, hi = b < t1 ? b : t1;
                if (lo >= hi) continue;
                if ((st = o->copy_h2d(be, wm->copy, dst + g->t[i].slot_off + (lo - t0), src + (lo - a), hi - lo)))
                    return st;
            }
            if ((st = o->event_record(be, c->ev, wm->copy)) != STRATA_OK) return st;
            chunk_release(wm, p, true);
        }
    }
    if ((st = o->event_record(be, wm->slot_ready[s], wm->copy)) != STRATA_OK) return st;
    wm->slot_used[s] = true;
    return STRATA_OK;
}

static void *copier_main(void *arg) {
    st_wm *wm = arg;
    for (;;) {
        pthread_mutex_lock(&wm->mu);
        while (!wm->stop && !wm->failed && wm->desc_tail == wm->desc_head) pthread_cond_wait(&wm->cv, &wm->mu);
        if (wm->stop || wm->failed) {
            pthread_mutex_unlock(&wm->mu);
            break;
        }
        const seq_desc d = wm->desc[wm->desc_tail % DESC_RING];
        wm->desc_tail++;
        pthread_cond_broadcast(&wm->cv);
        /* the slot is free once sequence seq - ring_slots is released (or skipped) */
        while (!wm->stop && !wm->failed && d.seq >= wm->use_done && wm->use_done + (uint64_t)wm->n_slots <= d.seq)
            pthread_cond_wait(&wm->cv, &wm->mu);
        if (wm->stop || wm->failed) {
            pthread_mutex_unlock(&wm->mu);
            break;
        }
        const bool skipped = d.seq < wm->use_done;
        pthread_mutex_unlock(&wm->mu);
        if (skipped) { /* drop what was read for it */
            bool ok = true;
            for (uint64_t p = d.first_piece; ok && p < d.first_piece + d.n_pieces; p++)
                if ((ok = copier_wait_filled(wm, p))) chunk_release(wm, p, false);
            if (!ok) break;
            pthread_mutex_lock(&wm->mu);
            wm->fetched = d.seq + 1;
            wm->stats.seq_skipped++;
            pthread_cond_broadcast(&wm->cv);
            pthread_mutex_unlock(&wm->mu);
            continue;
        }
        const int s = (int)(d.seq % (uint64_t)wm->n_slots);
        strata_status st = copy_seq(wm, &d, s);
        if (st != STRATA_OK) {
            wm_fail(wm, st);
            break;
        }
        pthread_mutex_lock(&wm->mu);
        if (wm->stop || wm->failed) {
            pthread_mutex_unlock(&wm->mu);
            break;
        }
        wm->fetched = d.seq + 1;
        wm->stats.copied++;
        wm->slot_src[s] = d.source == SRC_CPU || d.source == SRC_PART ? SRC_HOST : d.source;
        pthread_cond_broadcast(&wm->cv);
        pthread_mutex_unlock(&wm->mu);
    }
    return NULL;
}

/* ---- pinner: the host tier ---- */

static void pin_all(st_wm *wm) {
    st_ssd_queue *q = NULL;
    strata_status st = st_ssd_queue_init(wm->sf, 8, wm->p.use_pread, &q);
    if (st != STRATA_OK) {
        wm_fail(wm, st);
        return;
    }
    const double t0 = st_time_now();
    uint64_t done = 0, total = wm->stats.pin_total_bytes, next_log = total / 10;
    char b[3][32];
    for (int j = 0; j < wm->n_all; j++) { /* in the order the groups are first needed */
        const int gi = wm->order_all[j];
        if (wm->plan.tier[gi] != ST_TIER_HOST && wm->plan.tier[gi] != ST_TIER_CPU) continue;
        pthread_mutex_lock(&wm->mu);
        const bool stop = wm->stop || wm->failed;
        pthread_mutex_unlock(&wm->mu);
        if (stop) break;
        if (wm->p.pin_delay_ms > 0) sleep_ms(wm->p.pin_delay_ms);
        const st_wgroup *g = &wm->groups->g[gi];
        const size_t size = (size_t)g->img_bytes + ST_WG_ALIGN;
        if ((st = host_take(wm, size, "pinned host tier")) != STRATA_OK) {
            st_log(STRATA_LOG_WARN, "cannot pin weight group %s (%s): it is read from the file instead", g->name,
                   st_last_error());
            continue;
        }
        void *raw = NULL;
        if ((st = wm->be->ops->host_alloc(wm->be, size, &raw)) != STRATA_OK) {
            host_give(wm, size);
            st_log(STRATA_LOG_WARN, "cannot pin weight group %s (%s): it is read from the file instead", g->name,
                   st_last_error());
            continue;
        }
        uint8_t *img = align_ptr(raw);
        if ((st = st_ssd_files_check(wm->sf)) == STRATA_OK)
            for (int e = 0; e < g->n_extents && st == STRATA_OK; e++)
                st = st_ssd_read(q, g->ext[e].file, g->ext[e].file_off, g->ext[e].len, g->ext[e].need,
                                 img + g->ext[e].img_off, wm->chunk_bytes);
        if (st != STRATA_OK) {
            wm->be->ops->host_dealloc(wm->be, raw);
            host_give(wm, size);
            wm_fail(wm, st);
            break;
        }
        done += g->img_bytes;
        pthread_mutex_lock(&wm->mu);
        wm->host_raw[gi] = raw;
        wm->host_img[gi] = img;
        wm->host_size[gi] = size;
        wm->host_ready[gi] = true;
        wm->stats.pinned_bytes = done;
        wm->stats.pinned_groups++;
        pthread_mutex_unlock(&wm->mu);
        if (done >= next_log && done < total) {
            const double dt = st_time_now() - t0;
            st_log(STRATA_LOG_INFO, "pinning the host tier: %s of %s (%.0f%%), %.2f GB/s",
                   st_fmt_bytes((double)done, b[0], 32), st_fmt_bytes((double)total, b[1], 32),
                   100.0 * (double)done / (double)total, dt > 0 ? (double)done / dt / 1e9 : 0.0);
            next_log = done + total / 10;
        }
    }
    st_ssd_queue_free(q);
    const double dt = st_time_now() - t0;
    pthread_mutex_lock(&wm->mu);
    wm->stats.pin_done = true;
    wm->stats.pin_seconds = dt;
    const int groups = wm->stats.pinned_groups;
    pthread_cond_broadcast(&wm->cv);
    pthread_mutex_unlock(&wm->mu);
    if (total)
        st_log(STRATA_LOG_INFO, "host tier pinned: %d groups, %s in %.2f s (%.2f GB/s)", groups,
               st_fmt_bytes((double)done, b[2], 32), dt, dt > 0 ? (double)done / dt / 1e9 : 0.0);
}

static void *pinner_main(void *arg) {
    pin_all(arg);
    return NULL;
}

/* ---- init / free ---- */

static strata_status load_resident(st_wm *wm) {
    st_backend *be = wm->be;
    const st_wgroups *gs = wm->groups;
    /* CPU backend with an unlimited "device": weights are used in place from
     * the file mapping, as the loader promises (no copy, no budget). */
    const bool zero_copy = be->kind == ST_BACKEND_CPU && be->device_budget.cap == 0;
    size_t total = 0;
    int count = 0;
    strata_status st;
    for (int i = 0; i < wm->n; i++) {
        const st_wgroup *g = &gs->g[i];
        if (wm->plan.tier[i] != ST_TIER_DEVICE || g->slot_bytes == 0) continue;
        if (zero_copy) {
            for (int t = 0; t < g->n_tensors; t++) wm->res_ptr[i][t] = st_tensor_data(wm->files, g->t[t].desc);
            continue;
        }
        if ((st = be->ops->alloc(be, g->slot_bytes, &wm->res_block[i])) != STRATA_OK)
            return alloc_failed(st, g->slot_bytes, "device block of the resident weight group %s", g->name);
        uint8_t *blk = wm->res_block[i];
        for (int t = 0; t < g->n_tensors; t++) {
            if ((st = be->ops->copy_h2d(be, wm->copy, blk + g->t[t].slot_off, st_tensor_data(wm->files, g->t[t].desc),
                                        g->t[t].desc->nbytes)) != STRATA_OK)
                return st;
            wm->res_ptr[i][t] = blk + g->t[t].slot_off;
        }
        total += g->slot_bytes;
        count++;
    }
    if (count) {
        char b[32];
        st_log(STRATA_LOG_INFO, "loaded %d resident weight groups (%s) onto the device", count,
               st_fmt_bytes((double)total, b, sizeof b));
    }
    if (gs->tied && wm->plan.tier[0] == ST_TIER_DEVICE)
        wm->res_ptr[0][0] = wm->res_ptr[st_wg_output_id(gs)][ST_WG_LM_HEAD];
    return be->ops->stream_sync(be, wm->copy);
}

static strata_status init_streaming(st_wm *wm) {
    st_backend *be = wm->be;
    const st_backend_ops *o = be->ops;
    strata_status st;
    wm->n_slots = wm->plan.ring_slots;
    if (wm->n_slots < 2 || wm->plan.slot_bytes == 0)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: plan streams groups with %d ring slots of %zu bytes",
                      wm->n_slots, wm->plan.slot_bytes);
    wm->slot = st_calloc((size_t)wm->n_slots, sizeof *wm->slot);
    wm->slot_ready = st_calloc((size_t)wm->n_slots, sizeof *wm->slot_ready);
    wm->slot_done = st_calloc((size_t)wm->n_slots, sizeof *wm->slot_done);
    wm->slot_used = st_calloc((size_t)wm->n_slots, sizeof *wm->slot_used);
    wm->slot_src = st_calloc((size_t)wm->n_slots, sizeof *wm->slot_src);
    wm->n_chunks = wm->plan.staging_chunks;
    wm->chunk_bytes = wm->plan.staging_chunk;
    wm->ch = st_calloc((size_t)wm->n_chunks, sizeof *wm->ch);
    if (!wm->slot || !wm->slot_ready || !wm->slot_done || !wm->slot_used || !wm->slot_src || !wm->ch)
        return st_err(STRATA_ERR_NOMEM, "weight manager: out of memory for the tables of %d ring slots and %d "
                      "staging chunks", wm->n_slots, (int)wm->n_chunks);
    for (int s = 0; s < wm->n_slots; s++) {
        if ((st = o->alloc(be, wm->plan.slot_bytes, &wm->slot[s])) != STRATA_OK)
            return alloc_failed(st, wm->plan.slot_bytes, "device ring slot %d of %d for streamed weights", s + 1,
                                wm->n_slots);
        if ((st = o->event_create(be, &wm->slot_ready[s])) != STRATA_OK) return st;
        if ((st = o->event_create(be, &wm->slot_done[s])) != STRATA_OK) return st;
    }
    const size_t stg = (size_t)wm->n_chunks * wm->chunk_bytes + ST_WG_ALIGN;
    if ((st = host_take(wm, stg, "pinned staging")) != STRATA_OK) return st;
    if ((st = o->host_alloc(be, stg, &wm->stg_raw)) != STRATA_OK) {
        host_give(wm, stg);
        return alloc_failed(st, stg, "pinned staging buffers for weight reads (%d x %zu bytes)", wm->n_chunks,
                            wm->chunk_bytes);
    }
    wm->stg = align_ptr(wm->stg_raw);
    for (int c = 0; c < wm->n_chunks; c++)
        if ((st = o->event_create(be, &wm->ch[c].ev)) != STRATA_OK) return st;
    wm->depth = wm->p.queue_depth > 0 ? wm->p.queue_depth : wm->n_chunks;
    if (wm->depth > wm->n_chunks) wm->depth = wm->n_chunks;
    return STRATA_OK;
}

static strata_status init_rows(st_wm *wm) {
    st_backend *be = wm->be;
    const st_backend_ops *o = be->ops;
    const int64_t T = wm->plan.prefill_chunk;
    const size_t rb = (size_t)wm->groups->embed_row_bytes;
    strata_status st;
    if ((st = o->alloc(be, ((size_t)T * rb + 255) / 256 * 256, &wm->rows_dev)) != STRATA_OK)
        return alloc_failed(st, ((size_t)T * rb + 255) / 256 * 256, "device buffer of embedding rows");
    if ((st = o->alloc(be, ((size_t)T * 4 + 255) / 256 * 256, (void **)&wm->ids_dev)) != STRATA_OK)
        return alloc_failed(st, ((size_t)T * 4 + 255) / 256 * 256, "device buffer of embedding row ids");
    wm->rows_host_bytes = 2 * (size_t)T * rb;
    if ((st = host_take(wm, wm->rows_host_bytes, "pinned embedding rows")) != STRATA_OK) {
        wm->rows_host_bytes = 0;
        return st;
    }
    if ((st = o->host_alloc(be, wm->rows_host_bytes, &wm->rows_host)) != STRATA_OK)
        return alloc_failed(st, wm->rows_host_bytes, "pinned embedding rows");
    for (int b = 0; b < 2; b++)
        if ((st = o->event_create(be, &wm->rows_ev[b])) != STRATA_OK) return st;
    int32_t *iota = wm->rows_host; /* staging for the ids: [0, T) */
    if ((size_t)T * 4 > wm->rows_host_bytes) return st_err(STRATA_ERR_INTERNAL, "embedding rows staging too small");
    for (int64_t i = 0; i < T; i++) iota[i] = (int32_t)i;
    if ((st = o->copy_h2d(be, wm->copy, wm->ids_dev, iota, (size_t)T * 4)) != STRATA_OK) return st;
    return o->stream_sync(be, wm->copy);
}

/* Starts a worker; *on is set under the lock (the workers read their
 * neighbours in the struct under it). */
static strata_status start_thread(st_wm *wm, pthread_t *t, bool *on, void *(*fn)(void *), const char *what) {
    pthread_mutex_lock(&wm->mu);
    const int e = pthread_create(t, NULL, fn, wm);
    if (e == 0) *on = true;
    pthread_mutex_unlock(&wm->mu);
    if (e != 0) return st_err(STRATA_ERR_INTERNAL, "weight manager: cannot start the %s thread: %s", what, strerror(e));
    return STRATA_OK;
}

strata_status st_wm_init(st_backend *be, const st_model_files *files, const st_wgroups *groups,
                         const st_wplan *plan, const st_wm_params *params, st_wm **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "weight manager: out is NULL");
    *out = NULL;
    if (!be || !files || !groups || !plan || !plan->tier || plan->n_groups != groups->n)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: bad arguments");
    st_wm *wm = st_calloc(1, sizeof *wm);
    if (!wm) return st_err(STRATA_ERR_NOMEM, "weight manager: out of memory for its state (%zu bytes)", sizeof *wm);
    wm->be = be;
    wm->files = files;
    wm->groups = groups;
    wm->n = groups->n;
    if (params) wm->p = *params;
    wm->plan = *plan;
    wm->plan.tier = st_calloc((size_t)wm->n, sizeof *wm->plan.tier);
    wm->res_block = st_calloc((size_t)wm->n, sizeof *wm->res_block);
    wm->res_ptr = st_calloc((size_t)wm->n, sizeof *wm->res_ptr);
    wm->order_all = st_calloc((size_t)wm->n, sizeof *wm->order_all);
    wm->pos_all = st_calloc((size_t)wm->n, sizeof *wm->pos_all);
    wm->order_dev = st_calloc((size_t)wm->n, sizeof *wm->order_dev);
    wm->pos_dev = st_calloc((size_t)wm->n, sizeof *wm->pos_dev);
    wm->host_raw = st_calloc((size_t)wm->n, sizeof *wm->host_raw);
    wm->host_img = st_calloc((size_t)wm->n, sizeof *wm->host_img);
    wm->host_ready = st_calloc((size_t)wm->n, sizeof *wm->host_ready);
    wm->host_size = st_calloc((size_t)wm->n, sizeof *wm->host_size);
    if (!wm->plan.tier || !wm->res_block || !wm->res_ptr || !wm->order_all || !wm->pos_all || !wm->order_dev ||
        !wm->pos_dev || !wm->host_raw ||
        !wm->host_img || !wm->host_ready || !wm->host_size) {
        st_free(wm->plan.tier);
        wm->plan.tier = NULL;
        st_wm_free(wm);
        return st_err(STRATA_ERR_NOMEM, "weight manager: out of memory for the tables of %d weight groups",
                      (int)groups->n);
    }
    memcpy(wm->plan.tier, plan->tier, (size_t)wm->n * sizeof *wm->plan.tier);
    pthread_mutex_init(&wm->mu, NULL);
    pthread_cond_init(&wm->cv, NULL);
    wm->sync_init = true;
    wm->host_budget.cap = wm->p.host_mem;
    strata_status st;
    if ((st = be->ops->stream_create(be, true, &wm->copy)) != STRATA_OK) goto fail;
    if ((st = st_ssd_files_open(files, !wm->p.no_direct, &wm->p.faults, &wm->sf)) != STRATA_OK) goto fail;
    wm->stats.direct = st_ssd_files_direct(wm->sf);

    for (int i = 0; i < wm->n; i++) wm->pos_all[i] = wm->pos_dev[i] = -1;
    for (int i = 1; i < wm->n; i++)
        if (wm->plan.tier[i] != ST_TIER_DEVICE) {
            wm->pos_all[i] = wm->n_all;
            wm->order_all[wm->n_all++] = i;
            if (wm->plan.tier[i] != ST_TIER_CPU || wm->plan.split_rows > 0) { /* a split group's device part */
                wm->pos_dev[i] = wm->n_dev;
                wm->order_dev[wm->n_dev++] = i;
            }
            if (wm->plan.tier[i] == ST_TIER_HOST || wm->plan.tier[i] == ST_TIER_CPU) {
                wm->stats.pin_total_bytes += groups->g[i].img_bytes;
                wm->stats.pin_total_groups++;
            }
        }
    wm->order = wm->order_dev; /* stream_cpu starts off */
    wm->order_pos = wm->pos_dev;
    wm->n_order = wm->n_dev;
    if ((st = load_resident(wm)) != STRATA_OK) goto fail;
    if (wm->n_all > 0 && (st = init_streaming(wm)) != STRATA_OK) goto fail;
    if (wm->plan.embed_gather && (st = init_rows(wm)) != STRATA_OK) goto fail;

    if (wm->stats.pin_total_groups == 0) {
        wm->stats.pin_done = true;
    } else if (wm->p.pin_sync) {
        pin_all(wm);
        if (wm->failed) {
            st = failed_err(wm);
            goto fail;
        }
    } else if ((st = start_thread(wm, &wm->pinner, &wm->pinner_on, pinner_main, "pinning")) != STRATA_OK) {
        goto fail;
    }
    if (wm->n_all > 0 && ((st = start_thread(wm, &wm->reader, &wm->reader_on, reader_main, "reader")) != STRATA_OK ||
                            (st = start_thread(wm, &wm->copier, &wm->copier_on, copier_main, "copy")) != STRATA_OK))
        goto fail;
    char sum[512];
    st_wplan_summary(&wm->plan, sum, sizeof sum);
    st_log(STRATA_LOG_INFO, "weights: %s", sum);
    *out = wm;
    return STRATA_OK;
fail:
    st_wm_free(wm);
    return st;
}

void st_wm_free(st_wm *wm) {
    if (!wm) return;
    st_backend *be = wm->be;
    const st_backend_ops *o = be->ops;
    if (wm->sync_init) {
        pthread_mutex_lock(&wm->mu);
        wm->stop = true;
        pthread_cond_broadcast(&wm->cv);
        pthread_mutex_unlock(&wm->mu);
    }
    if (wm->reader_on) pthread_join(wm->reader, NULL);
    if (wm->copier_on) pthread_join(wm->copier, NULL);
    if (wm->pinner_on) pthread_join(wm->pinner, NULL);
    if (wm->copy) (void)o->stream_sync(be, wm->copy);
    if (wm->slot)
        for (int s = 0; s < wm->n_slots; s++) {
            if (wm->slot[s]) o->dealloc(be, wm->slot[s]);
            if (wm->slot_ready && wm->slot_ready[s]) o->event_destroy(be, wm->slot_ready[s]);
            if (wm->slot_done && wm->slot_done[s]) o->event_destroy(be, wm->slot_done[s]);
        }
    if (wm->ch)
        for (int c = 0; c < wm->n_chunks; c++)
            if (wm->ch[c].ev) o->event_destroy(be, wm->ch[c].ev);
    if (wm->stg_raw) {
        o->host_dealloc(be, wm->stg_raw);
        st_budget_give(&wm->host_budget, (size_t)wm->n_chunks * wm->chunk_bytes + ST_WG_ALIGN);
    }
    if (wm->res_block)
        for (int i = 0; i < wm->n; i++)
            if (wm->res_block[i]) o->dealloc(be, wm->res_block[i]);
    if (wm->host_raw)
        for (int i = 0; i < wm->n; i++)
            if (wm->host_raw[i]) {
                o->host_dealloc(be, wm->host_raw[i]);
                st_budget_give(&wm->host_budget, wm->host_size[i]);
            }
    if (wm->rows_dev) o->dealloc(be, wm->rows_dev);
    if (wm->ids_dev) o->dealloc(be, wm->ids_dev);
    if (wm->rows_host) o->host_dealloc(be, wm->rows_host);
    if (wm->rows_host_bytes) st_budget_give(&wm->host_budget, wm->rows_host_bytes);
    for (int b = 0; b < 2; b++)
        if (wm->rows_ev[b]) o->event_destroy(be, wm->rows_ev[b]);
    if (wm->copy) o->stream_destroy(be, wm->copy);
    st_ssd_files_close(wm->sf);
    if (wm->sync_init) {
        pthread_mutex_destroy(&wm->mu);
        pthread_cond_destroy(&wm->cv);
    }
    st_free(wm->slot);
    st_free(wm->slot_ready);
    st_free(wm->slot_done);
    st_free(wm->slot_used);
    st_free(wm->slot_src);
    st_free(wm->ch);
    st_free(wm->res_block);
    st_free(wm->res_ptr);
    st_free(wm->order_all);
    st_free(wm->pos_all);
    st_free(wm->order_dev);
    st_free(wm->pos_dev);
    st_free(wm->host_raw);
    st_free(wm->host_img);
    st_free(wm->host_ready);
    st_free(wm->host_size);
    st_wplan_free(&wm->plan);
    st_free(wm);
}

/* ---- the compute side ---- */

strata_status st_wm_begin(st_wm *wm) {
    pthread_mutex_lock(&wm->mu);
    if (wm->failed) {
        strata_status st = failed_err(wm);
        pthread_mutex_unlock(&wm->mu);
        return st;
    }
    pthread_mutex_unlock(&wm->mu);
    strata_status st = st_ssd_files_check(wm->sf);
    if (st != STRATA_OK) wm_fail(wm, st);
    return st;
}

strata_status st_wm_acquire(st_wm *wm, int group, st_wm_view *out) {
    if (group < 0 || group >= wm->n || !out)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: acquire of group %d (of %d)", group, wm->n);
    memset(out, 0, sizeof *out);
    const st_wgroup *g = &wm->groups->g[group];
    if (wm->plan.tier[group] == ST_TIER_DEVICE) {
        for (int i = 0; i < g->n_tensors; i++) out->data[i] = wm->res_ptr[group][i];
        return STRATA_OK;
    }
    if (wm->order_pos[group] < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: group %s is not streamed (%s)", g->name,
                      group == 0 ? "use st_wm_embed" : "a cpu-tier group: st_wm_acquire_host, or st_wm_stream_cpu first");
    pthread_mutex_lock(&wm->mu);
    strata_status st = STRATA_OK;
    if (wm->failed) {
        st = failed_err(wm);
        goto out;
    }
    if (wm->holding) {
        st = st_err(STRATA_ERR_INVALID_ARG, "weight manager: acquire of %s while %s is held", g->name,
                    wm->groups->g[wm->held_group].name);
        goto out;
    }
    const uint64_t n = (uint64_t)wm->n_order, base = wm->use_done;
    const uint64_t k = base + ((uint64_t)wm->order_pos[group] + n - base % n) % n;
    wm->use_done = k; /* everything before k is skipped */
    wm->holding = true;
    wm->held_seq = k;
    wm->held_group = group;
    pthread_cond_broadcast(&wm->cv);
    const double t0 = st_time_now();
    while (!wm->failed && wm->fetched <= k) pthread_cond_wait(&wm->cv, &wm->mu);
    wm->stats.acquire_wait_s += st_time_now() - t0;
    if (wm->failed) {
        wm->holding = false;
        st = failed_err(wm);
        goto out;
    }
    const int s = (int)(k % (uint64_t)wm->n_slots);
    /* counted here, as used (what the copier fetched ahead is not yet) */
    st_wg_split sp;
    wm->stats.h2d_bytes += !wm->stream_cpu && split_of(wm, group, &sp) ? sp.dev_bytes : g->bytes;
    if (wm->slot_src[s] == SRC_HOST) {
        wm->stats.seq_host++;
    } else {
        wm->stats.seq_ssd++;
        wm->stats.ssd_group_bytes += g->img_bytes;
    }
    for (int i = 0; i < g->n_tensors; i++) out->data[i] = (const uint8_t *)wm->slot[s] + g->t[i].slot_off;
    out->ready = wm->slot_ready[s];
    out->done = wm->slot_done[s];
out:
    pthread_mutex_unlock(&wm->mu);
    return st;
}

strata_status st_wm_release(st_wm *wm, int group, st_event *done) {
    if (group < 0 || group >= wm->n)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: release of group %d (of %d)", group, wm->n);
    if (wm->plan.tier[group] == ST_TIER_DEVICE) return STRATA_OK;
    pthread_mutex_lock(&wm->mu);
    strata_status st = STRATA_OK;
    if (!wm->holding || wm->held_group != group) {
        st = st_err(STRATA_ERR_INVALID_ARG, "weight manager: release of %s, which is not held",
                    wm->groups->g[group].name);
        pthread_mutex_unlock(&wm->mu);
        return st;
    }
    const int s = (int)(wm->held_seq % (uint64_t)wm->n_slots);
    wm->holding = false;
    wm->use_done = wm->held_seq + 1;
    if (done != wm->slot_done[s] && !wm->failed) {
        wm->failed = STRATA_ERR_INTERNAL;
        snprintf(wm->errmsg, sizeof wm->errmsg,
                 "weight manager: group %s released without its compute-done event; its slot cannot be reused",
                 wm->groups->g[group].name);
        st = failed_err(wm);
    }
    pthread_cond_broadcast(&wm->cv);
    pthread_mutex_unlock(&wm->mu);
    return st;
}

void st_wm_stream_cpu(st_wm *wm, bool on) {
    pthread_mutex_lock(&wm->mu);
    if (wm->stream_cpu != on) {
        ST_ASSERT(!wm->holding);
        wm->stream_cpu = on;
        if (wm->n_all != wm->n_dev || wm->plan.split_rows > 0) {
            /* the order (or what a split group's sequence copies) changes: what was published for the old one
             * is skipped */
            wm->order = on ? wm->order_all : wm->order_dev;
            wm->order_pos = on ? wm->pos_all : wm->pos_dev;
            wm->n_order = on ? wm->n_all : wm->n_dev;
            if (wm->published > wm->use_done) wm->use_done = wm->published;
        }
        pthread_cond_broadcast(&wm->cv);
    }
    pthread_mutex_unlock(&wm->mu);
}

strata_status st_wm_acquire_host(st_wm *wm, int group, const void **data) {
    if (group < 0 || group >= wm->n || !data || wm->plan.tier[group] != ST_TIER_CPU)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: host acquire of group %d, which is not on the cpu tier",
                      group);
    const st_wgroup *g = &wm->groups->g[group];
    pthread_mutex_lock(&wm->mu);
    strata_status st = STRATA_OK;
    if (wm->failed) {
        st = failed_err(wm);
    } else if (wm->holding) {
        st = st_err(STRATA_ERR_INVALID_ARG, "weight manager: host acquire of %s while %s is held", g->name,
                    wm->groups->g[wm->held_group].name);
    } else if (wm->stream_cpu) {
        st = st_err(STRATA_ERR_INVALID_ARG, "weight manager: host acquire of %s while the cpu tier streams "
                    "(st_wm_stream_cpu)", g->name);
    } else { /* not in the streamed order: the ring's look-ahead is not touched */
        const uint8_t *img = wm->host_ready[group] ? wm->host_img[group] : NULL;
        for (int i = 0; i < g->n_tensors; i++)
            data[i] = img ? img + g->t[i].img_off : st_tensor_data(wm->files, g->t[i].desc);
        st_wg_split sp;
        wm->stats.seq_cpu++;
        wm->stats.cpu_bytes += split_of(wm, group, &sp) ? sp.cpu_bytes : g->bytes;
        pthread_cond_broadcast(&wm->cv);
    }
    pthread_mutex_unlock(&wm->mu);
    return st;
}

strata_status st_wm_embed(st_wm *wm, st_stream *s, const int32_t *tokens, int64_t n, st_weight *w,
                          const int32_t **ids) {
    const st_wgroups *gs = wm->groups;
    const st_tensor_desc *t = gs->g[0].t[0].desc;
    *w = (st_weight){.dtype = gs->embed_dtype, .cols = gs->embed_cols}; /* dense: no stride */
    if (!wm->plan.embed_gather) {
        w->data = wm->res_ptr[0][0];
        w->rows = t->shape[0];
        *ids = NULL;
        return STRATA_OK;
    }
    if (n <= 0 || n > wm->plan.prefill_chunk)
        return st_err(STRATA_ERR_INVALID_ARG, "weight manager: %lld embedding rows (at most %lld)", (long long)n,
                      (long long)wm->plan.prefill_chunk);
    const st_backend_ops *o = wm->be->ops;
    const int b = wm->rows_next;
    wm->rows_next ^= 1;
    strata_status st;
    if (wm->rows_pending[b] && (st = o->event_sync(wm->be, wm->rows_ev[b])) != STRATA_OK) return st;
    const size_t rb = (size_t)gs->embed_row_bytes;
    uint8_t *stage = (uint8_t *)wm->rows_host + (size_t)b * (size_t)wm->plan.prefill_chunk * rb;
    const uint8_t *table = st_tensor_data(wm->files, t);
    for (int64_t i = 0; i < n; i++) memcpy(stage + (size_t)i * rb, table + (size_t)tokens[i] * rb, rb);
    if ((st = o->copy_h2d(wm->be, s, wm->rows_dev, stage, (size_t)n * rb)) != STRATA_OK) return st;
    if ((st = o->event_record(wm->be, wm->rows_ev[b], s)) != STRATA_OK) return st;
    wm->rows_pending[b] = true;
    pthread_mutex_lock(&wm->mu);
    wm->stats.gather_bytes += (uint64_t)n * rb;
    pthread_mutex_unlock(&wm->mu);
    w->data = wm->rows_dev;
    w->rows = n;
    *ids = wm->ids_dev;
    return STRATA_OK;
}

strata_status st_wm_wait_pinned(st_wm *wm) {
    pthread_mutex_lock(&wm->mu);
    while (!wm->stats.pin_done && !wm->failed) pthread_cond_wait(&wm->cv, &wm->mu);
    strata_status st = wm->failed ? failed_err(wm) : STRATA_OK;
    pthread_mutex_unlock(&wm->mu);
    return st;
}

void st_wm_note_cpu(st_wm *wm, double wait_s, double compute_s) {
    pthread_mutex_lock(&wm->mu);
    wm->stats.cpu_wait_s += wait_s;
    wm->stats.cpu_compute_s += compute_s;
    pthread_mutex_unlock(&wm->mu);
}

void st_wm_stats_get(st_wm *wm, st_wm_stats *out) {
    pthread_mutex_lock(&wm->mu);
    *out = wm->stats;
    out->host_used = wm->host_budget.used;
    out->host_peak = wm->host_budget.peak;
    pthread_mutex_unlock(&wm->mu);
}

const st_wplan *st_wm_plan(const st_wm *wm) { return &wm->plan; }
int st_wm_streamed(const st_wm *wm) { return wm->n_all; }
bool st_wm_all_resident(const st_wm *wm) { return wm->n_all == 0 && !wm->plan.embed_gather; }

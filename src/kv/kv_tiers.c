/* kv/kv_tiers: see kv_tiers.h.
 *
 * Bookkeeping:
 *   entries   one per block the tiers know: hash, parent hash, token ids,
 *             host block (NIL: none), SSD slot holding it (NIL: none), SSD
 *             slot being written (NIL: none), pins (loads of this step), and
 *             the links of the host LRU (entries with a host block) and the
 *             SSD LRU (entries with a slot). An entry lives while it has a
 *             host block, a slot or a write in flight.
 *   tickets   every batch of copies on the copy stream ends with an event and
 *             gets the next ticket; done_ticket is the newest whose event has
 *             completed (polled with event_query, in order). host_busy[h]: the
 *             ticket after which no copy touches host block h any more.
 *   host pool chunks of host blocks taken when the free ones run out, up to
 *             the capacity (pinned ahead by the pinner thread on CUDA,
 *             allocated there and then on the CPU); free blocks are never busy.
 *   reads     SSD-only blocks of a waiting prompt are read by the reader
 *             thread into host blocks attached to their entries (`reading`:
 *             not evictable, no copy reads them) and taken back by
 *             reads_poll on the stepping thread.
 *   SSD FIFO  entries whose host copy must be written to the SSD tier, in the
 *             order their device copies were issued (so their tickets grow). */
#include "kv/kv_tiers.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/block_manager.h"
#include "kv/kv_ssd.h"

#define NIL (-1)
#define RING 64                         /* copy batches in flight before the oldest is waited for */
#define CHUNK_BYTES ((size_t)256 << 20) /* host pool growth step */
#define ALIGN 4096

typedef struct {
    uint64_t hash, parent;
    int64_t host;        /* host block or NIL */
    int64_t ssd;         /* slot holding the block, or NIL */
    int64_t ssd_pending; /* slot being written, or NIL */
    int32_t pins;        /* loads of this step */
    bool live, to_ssd;   /* to_ssd: in the SSD FIFO */
    bool reading;        /* its host block is being read from its slot (the reader thread) */
    bool fetched;        /* its host copy came from the SSD tier for a hit not yet taken (counts as an SSD hit) */
    uint64_t ready;      /* ticket after which the host copy is complete */
    int64_t hprev, hnext, sprev, snext, bnext;
} entry;

typedef struct {
    int32_t dev;
    int64_t host;
} xfer;

typedef struct {
    st_event *e;
    uint64_t ticket;
} ring_ev;

/* One batch of SSD reads for the reader thread. */
typedef struct read_job {
    int64_t n;
    int64_t *ent, *slot;
    uint64_t *hash;
    void **buf;
    bool *ok;
    struct read_job *next;
} read_job;

struct st_kv_tiers {
    st_kv_tiers_params p;
    st_kv_pool *pool;
    st_backend *be;
    st_stream *cs;            /* copy stream */
    int64_t L, bs, n_planes;  /* planes per layer: K, V (+ K, V scales) */
    size_t plane_row[4];      /* bytes of one slot in each plane */
    size_t plane_off[4];      /* offset of each plane inside a layer's part of a block */
    size_t layer_bytes;       /* one layer's part of a block */
    size_t B;                 /* block bytes, rounded to ALIGN */

    /* entries and their index */
    entry *ent;
    int32_t *tok;             /* [cap_ent * bs] */
    int64_t cap_ent, *free_ent, n_free_ent;
    int64_t *bucket;
    uint64_t bucket_mask;
    int64_t hlru_head, hlru_tail, slru_head, slru_tail;

    /* host pool */
    int64_t n_host, n_alloc;  /* capacity, blocks with memory */
    int64_t chunk_blocks;
    void **chunks;            /* [ceil(n_host / chunk_blocks)] raw allocations */
    uint8_t **chunk_base;     /* aligned bases */
    int64_t *host_ent;        /* [n_host] entry or NIL */
    uint64_t *host_busy;      /* [n_host] */
    int64_t *free_host, n_free_host;
    int64_t n_reserved;       /* host blocks taken by st_kv_tiers_reserve, not adopted or given back */
    bool grow_failed;
    /* the pinner: a thread that allocates the whole host pool, chunk by chunk,
     * from init on (pinning runs at ~1.5 GB/s on the H100 machine, slower than
     * a prefill offloads: pinned on demand, a 32K-token prefill took 2.4x as
     * long), so that a step waits for it only while it is still catching up */
    pthread_t pinner;
    bool pinner_on;
    pthread_mutex_t pmu;
    pthread_cond_t pcv;
    int64_t chunks_ready;     /* chunks [0, chunks_ready) allocated (pmu) */
    bool pinner_done;         /* it stopped: all allocated, or an allocation failed (pmu) */
    atomic_bool pinner_stop;

    /* copy tickets */
    ring_ev ring[RING];
    int64_t ring_head, ring_n;
    uint64_t next_ticket, done_ticket, last_d2h;
    uint64_t *dev_ticket;     /* [device blocks] the batch copying each device block down (0: none) */
    bool must_wait;           /* a device block with a copy down in flight was handed to new content */
    st_event *ev_compute, *ev_d2h, **ev_layer;

    /* this step's work */
    xfer *d2h, *h2d;
    int64_t n_d2h, n_h2d, cap_xfer;
    int64_t *pinned, n_pinned;

    /* SSD tier */
    st_kv_ssd *ssd;
    int64_t n_slots, *slot_ent, *free_slot, n_free_slot, n_bad;
    int64_t *fifo, fifo_head, fifo_n; /* ring of entries, capacity n_host */
    int64_t ssd_busy;
    st_kv_ssd_done *done_buf;

    st_stream *compute;       /* the model's stream (before_forward's) */
    /* the reader: a thread that reads SSD-tier blocks into host blocks for
     * st_kv_tiers_prefetch; jobs go in `todo`, come back in `done` (rmu) */
    pthread_t reader;
    bool reader_on, reader_stop;
    pthread_mutex_t rmu;
    pthread_cond_t rcv, rdone_cv;
    struct read_job *todo, *done;
    int64_t reads_in_flight;  /* blocks in jobs not yet taken back (stepping thread) */
    int64_t *fetched, n_fetched; /* entries read for an admission that has not taken them yet: kept from
                                    eviction until the next admission's load */
    st_kv_tiers_stats st;
};

const char *st_kv_offload_name(st_kv_offload m) { return m == ST_KV_OFFLOAD_LAZY ? "lazy" : "eager"; }

bool st_kv_offload_parse(const char *s, st_kv_offload *out) {
    if (!s) return false;
    if (!strcmp(s, "eager")) *out = ST_KV_OFFLOAD_EAGER;
    else if (!strcmp(s, "lazy")) *out = ST_KV_OFFLOAD_LAZY;
    else return false;
    return true;
}

static void layout(const st_kv_pool_params *p, size_t row[4], size_t off[4], int64_t *n_planes, size_t *lb) {
    st_kv_block_layout lo;
    st_kv_block_layout_get(p, &lo);
    memcpy(row, lo.row, sizeof lo.row);
    memcpy(off, lo.off, sizeof lo.off);
    *n_planes = lo.n_planes;
    *lb = lo.layer_bytes;
}

size_t st_kv_tiers_block_bytes(const st_kv_pool_params *p) {
    size_t row[4], off[4], lb;
    int64_t np;
    layout(p, row, off, &np, &lb);
    const size_t b = lb * (size_t)p->n_layers;
    return (b + ALIGN - 1) / ALIGN * ALIGN;
}

/* ---- entries ---------------------------------------------------------------------*/

static uint64_t bucket_of(const st_kv_tiers *t, uint64_t h) { return (h * 0x9E3779B97F4A7C15ull) >> 20 & t->bucket_mask; }

static int64_t find(const st_kv_tiers *t, uint64_t h, uint64_t parent, const int32_t *tokens) {
    for (int64_t e = t->bucket[bucket_of(t, h)]; e != NIL; e = t->ent[e].bnext)
        if (t->ent[e].hash == h && t->ent[e].parent == parent &&
            !memcmp(t->tok + e * t->bs, tokens, (size_t)t->bs * sizeof(int32_t)))
            return e;
    return NIL;
}

static int64_t ent_new(st_kv_tiers *t, uint64_t h, uint64_t parent, const int32_t *tokens) {
    if (t->n_free_ent == 0) return NIL;
    const int64_t e = t->free_ent[--t->n_free_ent];
    t->ent[e] = (entry){.hash = h, .parent = parent, .host = NIL, .ssd = NIL, .ssd_pending = NIL, .live = true,
                        .hprev = NIL, .hnext = NIL, .sprev = NIL, .snext = NIL};
    memcpy(t->tok + e * t->bs, tokens, (size_t)t->bs * sizeof(int32_t));
    const uint64_t b = bucket_of(t, h);
    t->ent[e].bnext = t->bucket[b];
    t->bucket[b] = e;
    return e;
}

static void ent_free(st_kv_tiers *t, int64_t e) {
    entry *x = &t->ent[e];
    ST_ASSERT(x->live && x->host == NIL && x->ssd == NIL && x->ssd_pending == NIL && !x->to_ssd && x->pins == 0);
    int64_t *pp = &t->bucket[bucket_of(t, x->hash)];
    while (*pp != e) pp = &t->ent[*pp].bnext;
    *pp = x->bnext;
    x->live = false;
    t->free_ent[t->n_free_ent++] = e;
}

#define LRU_FNS(name, head, tail, prev, next)                                                \
    static void name##_push(st_kv_tiers *t, int64_t e) {                                     \
        t->ent[e].prev = t->tail;                                                            \
        t->ent[e].next = NIL;                                                                \
        if (t->tail != NIL) t->ent[t->tail].next = e;                                        \
        else t->head = e;                                                                    \
        t->tail = e;                                                                         \
    }                                                                                        \
    static void name##_remove(st_kv_tiers *t, int64_t e) {                                   \
        const int64_t p = t->ent[e].prev, n = t->ent[e].next;                                \
        if (p != NIL) t->ent[p].next = n;                                                    \
        else t->head = n;                                                                    \
        if (n != NIL) t->ent[n].prev = p;                                                    \
        else t->tail = p;                                                                    \
        t->ent[e].prev = t->ent[e].next = NIL;                                               \
    }                                                                                        \
    static void name##_touch(st_kv_tiers *t, int64_t e) {                                    \
        name##_remove(t, e);                                                                 \
        name##_push(t, e);                                                                   \
    }
LRU_FNS(hlru, hlru_head, hlru_tail, hprev, hnext)
LRU_FNS(slru, slru_head, slru_tail, sprev, snext)

/* Chains: a block is useful only with all its ancestors, so within a tier a
 * block is evicted before its parent. A block entering a tier (or refreshed
 * there) is placed right before its parent in the LRU order when the parent is
 * in that tier, at the most recent end when it is a first block, and at the
 * least recent end when its parent is not there (it cannot be hit anyway). A
 * hit refreshes its chain last block first, so the chain's head ends most
 * recent. */
static int64_t parent_in(const st_kv_tiers *t, int64_t e, bool ssd) {
    const uint64_t ph = t->ent[e].parent;
    for (int64_t p = t->bucket[bucket_of(t, ph)]; p != NIL; p = t->ent[p].bnext)
        if (p != e && t->ent[p].hash == ph && (ssd ? t->ent[p].ssd : t->ent[p].host) != NIL) return p;
    return NIL;
}

#define LRU_PLACE(name, head, tail, prev, next, ssd)                                         \
    static void name##_place(st_kv_tiers *t, int64_t e) {                                    \
        if (t->ent[e].parent == t->p.hash_seed) {                                            \
            name##_push(t, e);                                                               \
            return;                                                                          \
        }                                                                                    \
        const int64_t p = parent_in(t, e, ssd);                                              \
        const int64_t before = p != NIL ? t->ent[p].prev : NIL; /* insert between before and p */ \
        const int64_t after = p != NIL ? p : t->head;                                        \
        t->ent[e].prev = before;                                                             \
        t->ent[e].next = after;                                                              \
        if (before != NIL) t->ent[before].next = e;                                          \
        else t->head = e;                                                                    \
        if (after != NIL) t->ent[after].prev = e;                                            \
        else t->tail = e;                                                                    \
    }
LRU_PLACE(hlru, hlru_head, hlru_tail, hprev, hnext, false)
LRU_PLACE(slru, slru_head, slru_tail, sprev, snext, true)

/* ---- host pool -------------------------------------------------------------------*/

static uint8_t *host_ptr(const st_kv_tiers *t, int64_t h) {
    return t->chunk_base[h / t->chunk_blocks] + (size_t)(h % t->chunk_blocks) * t->B;
}

static int64_t n_chunks_of(const st_kv_tiers *t) { return (t->n_host + t->chunk_blocks - 1) / t->chunk_blocks; }

static int64_t chunk_nb(const st_kv_tiers *t, int64_t c) {
    const int64_t rest = t->n_host - c * t->chunk_blocks;
    return rest < t->chunk_blocks ? rest : t->chunk_blocks;
}

static void *pinner_main(void *arg) {
    st_kv_tiers *t = arg;
    const int64_t n = n_chunks_of(t);
    for (int64_t c = 0; c < n && !atomic_load(&t->pinner_stop); c++) {
        void *raw = NULL;
        if (t->be->ops->host_alloc(t->be, (size_t)chunk_nb(t, c) * t->B + ALIGN, &raw) != STRATA_OK) {
            st_log(STRATA_LOG_WARN, "kv host tier: could not allocate more host memory after %lld of %lld blocks "
                   "(%.1f of %.1f MiB): %s; the tier stays this size", (long long)(c * t->chunk_blocks),
                   (long long)t->n_host, (double)(c * t->chunk_blocks) * (double)t->B / 1048576.0,
                   (double)t->n_host * (double)t->B / 1048576.0, st_last_error());
            break;
        }
        pthread_mutex_lock(&t->pmu);
        t->chunks[c] = raw;
        t->chunk_base[c] = (uint8_t *)(((uintptr_t)raw + ALIGN - 1) / ALIGN * ALIGN);
        t->chunks_ready = c + 1;
        pthread_cond_broadcast(&t->pcv);
        pthread_mutex_unlock(&t->pmu);
    }
    pthread_mutex_lock(&t->pmu);
    t->pinner_done = true;
    pthread_cond_broadcast(&t->pcv);
    pthread_mutex_unlock(&t->pmu);
    return NULL;
}

/* The next chunk's blocks onto the free stack; false when the pool cannot
 * grow. */
static bool grow(st_kv_tiers *t) {
    if (t->n_alloc >= t->n_host || t->grow_failed) return false;
    const int64_t c = t->n_alloc / t->chunk_blocks, nb = chunk_nb(t, c);
    if (!t->pinner_on) { /* plain host memory (the CPU backend): allocated when needed, here */
        void *raw = NULL;
        if (t->be->ops->host_alloc(t->be, (size_t)nb * t->B + ALIGN, &raw) != STRATA_OK) {
            st_log(STRATA_LOG_WARN, "kv host tier: could not allocate more host memory after %lld of %lld blocks: "
                   "%s; the tier stays this size", (long long)t->n_alloc, (long long)t->n_host, st_last_error());
            t->grow_failed = true;
            return false;
        }
        t->chunks[c] = raw;
        t->chunk_base[c] = (uint8_t *)(((uintptr_t)raw + ALIGN - 1) / ALIGN * ALIGN);
    } else { /* the pinner's next chunk, waiting for it when it is behind */
        pthread_mutex_lock(&t->pmu);
        while (t->chunks_ready <= c && !t->pinner_done) pthread_cond_wait(&t->pcv, &t->pmu);
        const bool ok = t->chunks_ready > c;
        pthread_mutex_unlock(&t->pmu);
        if (!ok) {
            t->grow_failed = true;
            return false;
        }
    }
    for (int64_t h = t->n_alloc + nb - 1; h >= t->n_alloc; h--) t->free_host[t->n_free_host++] = h; /* pops ascend */
    t->n_alloc += nb;
    t->st.host_allocated = t->n_alloc;
    return true;
}

/* The host block of entry e goes back to the pool (not busy: callers check). */
static void host_release(st_kv_tiers *t, int64_t e) {
    entry *x = &t->ent[e];
    const int64_t h = x->host;
    ST_ASSERT(h != NIL && t->host_busy[h] <= t->done_ticket);
    hlru_remove(t, e);
    t->host_ent[h] = NIL;
    t->free_host[t->n_free_host++] = h;
    x->host = NIL;
    t->st.host_cached--;
    if (x->ssd == NIL && x->ssd_pending == NIL) ent_free(t, e);
}

static bool evictable(const st_kv_tiers *t, int64_t e) {
    const entry *x = &t->ent[e];
    return x->pins == 0 && !x->to_ssd && !x->reading && !x->fetched && x->ssd_pending == NIL &&
           t->host_busy[x->host] <= t->done_ticket;
}

/* A free host block (not busy): a free one, a new chunk, or the least
 * recently used evictable block. NIL when none can be had. */
static int64_t host_take(st_kv_tiers *t) {
    if (t->n_free_host == 0 && !grow(t)) {
        int64_t e = t->hlru_head;
        while (e != NIL && !evictable(t, e)) e = t->ent[e].hnext;
        if (e == NIL) return NIL;
        host_release(t, e);
    }
    return t->free_host[--t->n_free_host];
}

static void host_attach(st_kv_tiers *t, int64_t e, int64_t h) {
    t->ent[e].host = h;
    t->host_ent[h] = e;
    hlru_place(t, e);
    t->st.host_cached++;
}

/* ---- copies and tickets ----------------------------------------------------------*/

static strata_status poll_copies(st_kv_tiers *t) {
    while (t->ring_n > 0) {
        ring_ev *r = &t->ring[t->ring_head];
        bool done = false;
        strata_status st = t->be->ops->event_query(t->be, r->e, &done);
        if (st) return st;
        if (!done) break;
        t->done_ticket = r->ticket;
        t->ring_head = (t->ring_head + 1) % RING;
        t->ring_n--;
    }
    return STRATA_OK;
}

/* Ends a batch of copies on the copy stream: its ticket. */
static strata_status end_batch(st_kv_tiers *t, uint64_t *ticket) {
    strata_status st;
    if (t->ring_n == RING) { /* many batches in flight: wait for the oldest */
        ring_ev *r = &t->ring[t->ring_head];
        if ((st = t->be->ops->event_sync(t->be, r->e))) return st;
        t->done_ticket = r->ticket;
        t->ring_head = (t->ring_head + 1) % RING;
        t->ring_n--;
    }
    ring_ev *r = &t->ring[(t->ring_head + t->ring_n) % RING];
    if ((st = t->be->ops->event_record(t->be, r->e, t->cs))) return st;
    r->ticket = *ticket = t->next_ticket++;
    t->ring_n++;
    return STRATA_OK;
}

/* The device pointer of plane p of layer l at block `block`. */
static uint8_t *dev_ptr(const st_kv_tiers *t, int64_t l, int p, int64_t block) {
    const st_kv_layer *L = st_kv_pool_layer(t->pool, l);
    void *base = p == 0 ? L->k : p == 1 ? L->v : p == 2 ? (void *)L->k_scale : (void *)L->v_scale;
    return (uint8_t *)base + (size_t)block * (size_t)t->bs * t->plane_row[p];
}

/* Length of the run starting at x[i]: consecutive device blocks landing in
 * consecutive host blocks of one chunk. */
static int64_t run_len(const st_kv_tiers *t, const xfer *x, int64_t i, int64_t n) {
    int64_t j = i + 1;
    while (j < n && x[j].dev == x[j - 1].dev + 1 && x[j].host == x[j - 1].host + 1 &&
           x[j].host / t->chunk_blocks == x[i].host / t->chunk_blocks)
        j++;
    return j - i;
}

/* Copies of layer l's planes for x[0..n): to the host (to_host) or the device. */
static strata_status copy_layer(st_kv_tiers *t, const xfer *x, int64_t n, int64_t l, bool to_host, int64_t *calls) {
    const st_backend_ops *o = t->be->ops;
    for (int64_t i = 0; i < n;) {
        const int64_t k = run_len(t, x, i, n);
        for (int p = 0; p < t->n_planes; p++) {
            const size_t w = (size_t)t->bs * t->plane_row[p];
            uint8_t *h = host_ptr(t, x[i].host) + (size_t)l * t->layer_bytes + t->plane_off[p];
            uint8_t *d = dev_ptr(t, l, p, x[i].dev);
            strata_status st = to_host ? o->copy_2d(t->be, t->cs, h, t->B, d, w, w, (size_t)k)
                                       : o->copy_2d(t->be, t->cs, d, w, h, t->B, w, (size_t)k);
            if (st) return st;
            (*calls)++;
        }
        i += k;
    }
    return STRATA_OK;
}

/* The queued device -> host copies, after everything `compute` has enqueued. */
static strata_status flush_d2h(st_kv_tiers *t, st_stream *compute) {
    if (t->n_d2h == 0) return STRATA_OK;
    const st_backend_ops *o = t->be->ops;
    strata_status st;
    if ((st = o->event_record(t->be, t->ev_compute, compute))) return st;
    if ((st = o->stream_wait_event(t->be, t->cs, t->ev_compute))) return st;
    for (int64_t l = 0; l < t->L; l++)
        if ((st = copy_layer(t, t->d2h, t->n_d2h, l, true, &t->st.copies_d2h))) return st;
    uint64_t ticket;
    if ((st = end_batch(t, &ticket))) return st;
    if ((st = o->event_record(t->be, t->ev_d2h, t->cs))) return st;
    t->last_d2h = ticket;
    for (int64_t i = 0; i < t->n_d2h; i++) {
        const int64_t h = t->d2h[i].host, e = t->host_ent[h];
        t->dev_ticket[t->d2h[i].dev] = ticket;
        t->host_busy[h] = ticket;
        t->ent[e].ready = ticket;
        if (t->ssd && !t->ent[e].to_ssd && t->ent[e].ssd == NIL && t->ent[e].ssd_pending == NIL) {
            ST_ASSERT(t->fifo_n < t->n_host);
            t->fifo[(t->fifo_head + t->fifo_n++) % t->n_host] = e;
            t->ent[e].to_ssd = true;
        }
    }
    t->st.bytes_d2h += (uint64_t)t->n_d2h * (uint64_t)(t->layer_bytes * (size_t)t->L);
    t->n_d2h = 0;
    return STRATA_OK;
}

/* ---- the SSD tier ----------------------------------------------------------------*/

static void ssd_free_slot(st_kv_tiers *t, int64_t e) {
    entry *x = &t->ent[e];
    slru_remove(t, e);
    t->slot_ent[x->ssd] = NIL;
    t->free_slot[t->n_free_slot++] = x->ssd;
    x->ssd = NIL;
    t->st.ssd_cached--;
    if (x->host == NIL && x->ssd_pending == NIL && x->pins == 0) ent_free(t, e);
}

/* A slot to write: a free one, or the least recently used block's. */
static int64_t ssd_take(st_kv_tiers *t) {
    if (t->n_free_slot == 0) {
        int64_t e = t->slru_head;
        while (e != NIL && t->ent[e].pins > 0) e = t->ent[e].snext;
        if (e == NIL) return NIL;
        ssd_free_slot(t, e);
    }
    return t->free_slot[--t->n_free_slot];
}

static void ssd_poll(st_kv_tiers *t) {
    if (!t->ssd) return;
    int64_t n;
    while ((n = st_kv_ssd_poll(t->ssd, t->done_buf, 64)) > 0) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t slot = t->done_buf[i].slot, e = t->slot_ent[slot];
            ST_ASSERT(e != NIL && t->ent[e].ssd_pending == slot);
            entry *x = &t->ent[e];
            x->ssd_pending = NIL;
            t->ssd_busy--;
            if (t->done_buf[i].ok) {
                x->ssd = slot;
                slru_place(t, e);
                t->st.ssd_cached++;
                t->st.bytes_h2ssd += t->B;
            } else {
                t->slot_ent[slot] = NIL; /* given up: a full disk means fewer slots */
                t->n_bad++;
                t->st.ssd_write_failures++;
                if (x->host == NIL && x->pins == 0) ent_free(t, e);
            }
        }
    }
}

/* Writes the FIFO's entries whose host copy is complete, while the writer takes them. */
static void ssd_feed(st_kv_tiers *t) {
    while (t->fifo_n > 0) {
        const int64_t e = t->fifo[t->fifo_head];
        entry *x = &t->ent[e];
        if (x->ready > t->done_ticket) break; /* its device copy is still in flight */
        const int64_t slot = ssd_take(t);
        if (slot == NIL) {
            if (t->ssd_busy == 0 && t->n_free_slot == 0 && t->slru_head == NIL) {
                /* every slot failed (a full disk): nothing more goes to the SSD tier */
                while (t->fifo_n > 0) {
                    t->ent[t->fifo[t->fifo_head]].to_ssd = false;
                    t->fifo_head = (t->fifo_head + 1) % t->n_host;
                    t->fifo_n--;
                }
            }
            break;
        }
        const strata_status st = st_kv_ssd_write(t->ssd, slot, x->hash, x->parent, t->tok + e * t->bs,
                                                 host_ptr(t, x->host));
        if (st == STRATA_ERR_BUSY) { /* the writer's queue is full: later */
            t->free_slot[t->n_free_slot++] = slot;
            break;
        }
        x->to_ssd = false;
        t->fifo_head = (t->fifo_head + 1) % t->n_host;
        t->fifo_n--;
        if (st != STRATA_OK) { /* cannot happen (slot, buffer and alignment are ours): not cached */
            st_log(STRATA_LOG_WARN, "kv SSD tier: %s", st_last_error());
            t->free_slot[t->n_free_slot++] = slot;
            continue;
        }
        x->ssd_pending = slot;
        t->slot_ent[slot] = e;
        t->ssd_busy++;
    }
}

static void on_scan(int64_t slot, uint64_t hash, uint64_t parent, const int32_t *tokens, int64_t n_tokens,
                    void *user) {
    st_kv_tiers *t = user;
    if (n_tokens != t->bs || slot < 0 || slot >= t->n_slots || t->slot_ent[slot] != NIL) return;
    if (find(t, hash, parent, tokens) != NIL) return; /* a duplicate: its slot stays free */
    const int64_t e = ent_new(t, hash, parent, tokens);
    if (e == NIL) return;
    t->ent[e].ssd = slot;
    t->slot_ent[slot] = e;
    slru_push(t, e);
    t->st.ssd_cached++;
    t->st.ssd_found_at_start++;
}

/* ---- SSD reads in the background -----------------------------------------------*/

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t chain_to(const st_kv_tiers *t, const int32_t *tokens, int64_t n_blocks) {
    uint64_t h = t->p.hash_seed;
    for (int64_t i = 0; i < n_blocks; i++) h = st_kv_hash_tokens(tokens + i * t->bs, t->bs, h);
    return h;
}


static void job_free(read_job *j) {
    if (!j) return;
    st_free(j->ent);
    st_free(j->slot);
    st_free(j->hash);
    st_free(j->buf);
    st_free(j->ok);
    st_free(j);
}

static void *reader_main(void *arg) {
    st_kv_tiers *t = arg;
    pthread_mutex_lock(&t->rmu);
    for (;;) {
        while (!t->todo && !t->reader_stop) pthread_cond_wait(&t->rcv, &t->rmu);
        if (!t->todo) break; /* stopping, nothing left */
        read_job *j = t->todo;
        t->todo = j->next;
        pthread_mutex_unlock(&t->rmu);
        if (st_kv_ssd_read(t->ssd, j->slot, j->hash, j->buf, j->n, j->ok) != STRATA_OK)
            for (int64_t i = 0; i < j->n; i++) j->ok[i] = false;
        pthread_mutex_lock(&t->rmu);
        j->next = t->done;
        t->done = j;
        pthread_cond_broadcast(&t->rdone_cv);
    }
    pthread_mutex_unlock(&t->rmu);
    return NULL;
}

/* Takes the finished reads back: a block read whole becomes a host-tier block;
 * a torn, corrupt or unreadable one is dropped (its slot freed). `wait`:
 * blocks until at least one job is back when reads are in flight. */
static void reads_poll(st_kv_tiers *t, bool wait) {
    if (!t->reader_on) return;
    pthread_mutex_lock(&t->rmu);
    if (wait && t->reads_in_flight > 0 && !t->done) pthread_cond_wait(&t->rdone_cv, &t->rmu);
    read_job *j = t->done;
    t->done = NULL;
    pthread_mutex_unlock(&t->rmu);
    while (j) {
        read_job *next = j->next;
        for (int64_t i = 0; i < j->n; i++) {
            const int64_t e = j->ent[i];
            entry *x = &t->ent[e];
            x->reading = false;
            x->pins--;
            t->host_busy[x->host] = 0;
            if (j->ok[i]) {
                t->st.bytes_ssd2h += t->B;
                x->fetched = true;
                t->fetched[t->n_fetched++] = e;
                continue;
            }
            t->st.ssd_read_failures++;
            host_release(t, e); /* keeps the entry: it still has its slot */
            ssd_free_slot(t, e);
        }
        t->reads_in_flight -= j->n;
        job_free(j);
        j = next;
    }
}

int64_t st_kv_tiers_prefetch(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block) {
    if (!t || !t->reader_on || !tokens || from_block < 0) return 0;
    reads_poll(t, false);
    const int64_t bs = t->bs, max_blocks = n_tokens > 0 ? (n_tokens - 1) / bs : 0;
    uint64_t h = chain_to(t, tokens, from_block);
    int64_t pending = 0, n_new = 0;
    /* count what the chain holds from here: blocks being read, SSD-only blocks to read */
    for (int64_t i = from_block; i < max_blocks; i++) {
        const uint64_t hi = st_kv_hash_tokens(tokens + i * bs, bs, h);
        const int64_t e = find(t, hi, h, tokens + i * bs);
        if (e == NIL) break;
        const entry *x = &t->ent[e];
        if (x->reading) pending++;
        else if (x->host == NIL && x->ssd != NIL) n_new++;
        else if (x->host == NIL) break;
        h = hi;
    }
    if (n_new == 0) return pending;
    read_job *j = st_calloc(1, sizeof *j);
    if (j) {
        j->ent = st_malloc((size_t)n_new * sizeof *j->ent);
        j->slot = st_malloc((size_t)n_new * sizeof *j->slot);
        j->hash = st_malloc((size_t)n_new * sizeof *j->hash);
        j->buf = st_malloc((size_t)n_new * sizeof *j->buf);
        j->ok = st_malloc((size_t)n_new * sizeof *j->ok);
    }
    if (!j || !j->ent || !j->slot || !j->hash || !j->buf || !j->ok) {
        job_free(j);
        return pending;
    }
    /* the host blocks first, ascending (long runs up later), then the entries in chain order */
    int64_t n_hb = 0;
    while (n_hb < n_new) {
        const int64_t hb = host_take(t);
        if (hb == NIL) break;
        j->slot[n_hb++] = hb; /* the host blocks for now; slots are filled below */
    }
    if (n_hb > 1) qsort(j->slot, (size_t)n_hb, sizeof *j->slot, cmp_i64);
    h = chain_to(t, tokens, from_block);
    int64_t m = 0;
    for (int64_t i = from_block; i < max_blocks && m < n_hb; i++) {
        const uint64_t hi = st_kv_hash_tokens(tokens + i * bs, bs, h);
        const int64_t e = find(t, hi, h, tokens + i * bs);
        h = hi;
        if (e == NIL) break;
        entry *x = &t->ent[e];
        if (x->reading || x->host != NIL) continue;
        const int64_t hb = j->slot[m];
        host_attach(t, e, hb);
        t->host_busy[hb] = UINT64_MAX; /* written by the reader: no copy reads it before it is back */
        x->reading = true;
        x->pins++;
        j->ent[m] = e;
        j->buf[m] = host_ptr(t, hb);
        m++;
    }
    for (int64_t k = m; k < n_hb; k++) t->free_host[t->n_free_host++] = j->slot[k]; /* not needed after all */
    for (int64_t k = 0; k < m; k++) {
        j->slot[k] = t->ent[j->ent[k]].ssd;
        j->hash[k] = t->ent[j->ent[k]].hash;
    }
    j->n = m;
    if (m == 0) {
        job_free(j);
        return pending;
    }
    t->reads_in_flight += m;
    pthread_mutex_lock(&t->rmu);
    read_job **tail = &t->todo;
    while (*tail) tail = &(*tail)->next;
    *tail = j;
    pthread_cond_signal(&t->rcv);
    pthread_mutex_unlock(&t->rmu);
    return pending + m;
}

/* ---- init / free -----------------------------------------------------------------*/

static strata_status issue_loads(void *user);

strata_status st_kv_tiers_init(st_kv_pool *pool, const st_kv_tiers_params *p, st_kv_tiers **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "kv tiers: out is NULL");
    *out = NULL;
    if (!pool || !p) return st_err(STRATA_ERR_INVALID_ARG, "kv tiers: no pool or params");
    const st_kv_pool_params *pp = st_kv_pool_get_params(pool);
    const size_t B = st_kv_tiers_block_bytes(pp);
    const bool want_ssd = p->ssd_dir && p->ssd_dir[0];
    if (p->host_bytes < B)
        return st_err(STRATA_ERR_INVALID_ARG, "--kv-host-mem %zu bytes is less than one KV block (%zu bytes)%s",
                      p->host_bytes, B, want_ssd ? "; the SSD tier (--kv-ssd-dir) needs the host tier" : "");
    if (want_ssd && p->ssd_bytes == 0)
        return st_err(STRATA_ERR_INVALID_ARG, "--kv-ssd-size must be > 0 with --kv-ssd-dir %s", p->ssd_dir);
    st_kv_tiers *t = st_calloc(1, sizeof *t);
    if (!t) return st_err(STRATA_ERR_NOMEM, "kv tiers: out of memory for its state (%zu bytes)", sizeof *t);
    strata_status st = STRATA_OK;
    t->p = *p;
    t->p.ssd_dir = NULL;
    t->p.identity_text = NULL;
    t->pool = pool;
    t->be = st_kv_pool_backend(pool);
    t->L = pp->n_layers;
    t->bs = pp->block_size;
    layout(pp, t->plane_row, t->plane_off, &t->n_planes, &t->layer_bytes);
    t->B = B;
    t->n_host = (int64_t)(p->host_bytes / B);
    t->chunk_blocks = (int64_t)(CHUNK_BYTES / B);
    if (t->chunk_blocks < 1) t->chunk_blocks = 1;
    t->hlru_head = t->hlru_tail = t->slru_head = t->slru_tail = NIL;
    t->next_ticket = 1;
    t->st.block_bytes = (int64_t)B;
    t->st.block_tokens = t->bs;
    t->st.host_blocks = t->n_host;

    if (want_ssd) {
        const st_kv_ssd_params sp = {.dir = p->ssd_dir, .max_bytes = p->ssd_bytes, .payload_bytes = B,
                                     .block_tokens = t->bs, .identity = p->identity,
                                     .identity_text = p->identity_text, .force_pread = p->ssd_force_pread,
                                     .max_writes = 1024, .fail_write_nth = p->ssd_fail_write_nth};
        if ((st = st_kv_ssd_open(&sp, &t->ssd))) goto fail;
        t->n_slots = st_kv_ssd_slots(t->ssd);
        if (t->n_slots == 0) { /* no room on the disk (the store warned): no SSD tier */
            st_kv_ssd_close(t->ssd);
            t->ssd = NULL;
        }
        t->st.ssd_slots = t->n_slots;
    }
    t->cap_ent = t->n_host + t->n_slots;
    uint64_t nb = 16;
    while (nb < (uint64_t)t->cap_ent * 2) nb <<= 1;
    t->bucket_mask = nb - 1;
    const int64_t n_chunks = (t->n_host + t->chunk_blocks - 1) / t->chunk_blocks;
    t->cap_xfer = t->n_host; /* one step never moves more blocks than the host tier holds */
    t->ent = st_calloc((size_t)t->cap_ent, sizeof *t->ent);
    t->tok = st_malloc((size_t)t->cap_ent * (size_t)t->bs * sizeof *t->tok);
    t->free_ent = st_malloc((size_t)t->cap_ent * sizeof *t->free_ent);
    t->bucket = st_malloc(nb * sizeof *t->bucket);
    t->chunks = st_calloc((size_t)n_chunks, sizeof *t->chunks);
    t->chunk_base = st_calloc((size_t)n_chunks, sizeof *t->chunk_base);
    t->host_ent = st_malloc((size_t)t->n_host * sizeof *t->host_ent);
    t->host_busy = st_calloc((size_t)t->n_host, sizeof *t->host_busy);
    t->free_host = st_malloc((size_t)t->n_host * sizeof *t->free_host);
    t->d2h = st_malloc((size_t)t->cap_xfer * sizeof *t->d2h);
    t->h2d = st_malloc((size_t)t->cap_xfer * sizeof *t->h2d);
    t->pinned = st_malloc((size_t)t->cap_xfer * sizeof *t->pinned);
    t->ev_layer = st_calloc((size_t)t->L, sizeof *t->ev_layer);
    t->fifo = st_malloc((size_t)t->n_host * sizeof *t->fifo);
    t->fetched = st_malloc((size_t)t->n_host * sizeof *t->fetched);
    t->dev_ticket = st_calloc((size_t)pp->num_blocks, sizeof *t->dev_ticket);
    if (t->n_slots) {
        t->slot_ent = st_malloc((size_t)t->n_slots * sizeof *t->slot_ent);
        t->free_slot = st_malloc((size_t)t->n_slots * sizeof *t->free_slot);
        t->done_buf = st_malloc(64 * sizeof *t->done_buf);
    }
    if (!t->ent || !t->tok || !t->free_ent || !t->bucket || !t->chunks || !t->chunk_base || !t->host_ent ||
        !t->host_busy || !t->free_host || !t->d2h || !t->h2d || !t->pinned || !t->ev_layer || !t->fifo || !t->fetched || !t->dev_ticket ||
        (t->n_slots && (!t->slot_ent || !t->free_slot || !t->done_buf))) {
        st = st_err(STRATA_ERR_NOMEM, "kv tiers: out of memory for the index of %lld blocks", (long long)t->cap_ent);
        goto fail;
    }
    for (int64_t e = t->cap_ent - 1; e >= 0; e--) t->free_ent[t->n_free_ent++] = e;
    for (uint64_t b = 0; b < nb; b++) t->bucket[b] = NIL;
    for (int64_t h = 0; h < t->n_host; h++) t->host_ent[h] = NIL;
    for (int64_t s = 0; s < t->n_slots; s++) t->slot_ent[s] = NIL;
    if (t->be->kind != ST_BACKEND_CPU) { /* pinned memory: pinned ahead by a thread (slow to pin) */
        pthread_mutex_init(&t->pmu, NULL);
        pthread_cond_init(&t->pcv, NULL);
        if (pthread_create(&t->pinner, NULL, pinner_main, t) != 0) {
            pthread_mutex_destroy(&t->pmu);
            pthread_cond_destroy(&t->pcv);
            st = st_err(STRATA_ERR_INTERNAL, "kv host tier: cannot start its allocation thread");
            goto fail;
        }
        t->pinner_on = true;
    }
    st_kv_pool_set_pass_hook(pool, issue_loads, t);
    const st_backend_ops *o = t->be->ops;
    if ((st = o->stream_create(t->be, false, &t->cs))) goto fail;
    if ((st = o->event_create(t->be, &t->ev_compute)) || (st = o->event_create(t->be, &t->ev_d2h))) goto fail;
    for (int i = 0; i < RING; i++)
        if ((st = o->event_create(t->be, &t->ring[i].e))) goto fail;
    for (int64_t l = 0; l < t->L; l++)
        if ((st = o->event_create(t->be, &t->ev_layer[l]))) goto fail;
    if (t->ssd) {
        int64_t found = 0;
        if ((st = st_kv_ssd_scan(t->ssd, on_scan, t, &found))) goto fail;
        for (int64_t s = t->n_slots - 1; s >= 0; s--)
            if (t->slot_ent[s] == NIL) t->free_slot[t->n_free_slot++] = s;
        pthread_mutex_init(&t->rmu, NULL);
        pthread_cond_init(&t->rcv, NULL);
        pthread_cond_init(&t->rdone_cv, NULL);
        if (pthread_create(&t->reader, NULL, reader_main, t) != 0) {
            st = st_err(STRATA_ERR_INTERNAL, "kv SSD tier: cannot start its reader thread");
            pthread_mutex_destroy(&t->rmu);
            pthread_cond_destroy(&t->rcv);
            pthread_cond_destroy(&t->rdone_cv);
            goto fail;
        }
        t->reader_on = true;
        if (t->st.ssd_found_at_start > 0)
            st_log(STRATA_LOG_INFO, "kv SSD tier: %lld blocks (%lld tokens) of earlier runs found in %s",
                   (long long)t->st.ssd_found_at_start, (long long)(t->st.ssd_found_at_start * t->bs), p->ssd_dir);
    }
    *out = t;
    return STRATA_OK;
fail:;
    char msg[640];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    st_kv_tiers_free(t);
    return st_err(st, "%s", msg);
}

void st_kv_tiers_free(st_kv_tiers *t) {
    if (!t) return;
    if (t->cs) (void)st_kv_tiers_drain(t);
    if (t->reader_on) {
        pthread_mutex_lock(&t->rmu);
        t->reader_stop = true;
        pthread_cond_broadcast(&t->rcv);
        pthread_mutex_unlock(&t->rmu);
        pthread_join(t->reader, NULL);
        for (read_job *j = t->done, *n; j; j = n) n = j->next, job_free(j);
        for (read_job *j = t->todo, *n; j; j = n) n = j->next, job_free(j);
        pthread_mutex_destroy(&t->rmu);
        pthread_cond_destroy(&t->rcv);
        pthread_cond_destroy(&t->rdone_cv);
    }
    st_kv_ssd_close(t->ssd);
    st_kv_pool_clear_ready(t->pool);
    st_kv_pool_set_pass_hook(t->pool, NULL, NULL);
    const st_backend_ops *o = t->be->ops;
    if (t->cs) o->stream_destroy(t->be, t->cs);
    if (t->ev_compute) o->event_destroy(t->be, t->ev_compute);
    if (t->ev_d2h) o->event_destroy(t->be, t->ev_d2h);
    for (int i = 0; i < RING; i++)
        if (t->ring[i].e) o->event_destroy(t->be, t->ring[i].e);
    for (int64_t l = 0; t->ev_layer && l < t->L; l++)
        if (t->ev_layer[l]) o->event_destroy(t->be, t->ev_layer[l]);
    if (t->pinner_on) {
        pthread_mutex_lock(&t->pmu);
        atomic_store(&t->pinner_stop, true);
        pthread_cond_broadcast(&t->pcv);
        pthread_mutex_unlock(&t->pmu);
        pthread_join(t->pinner, NULL);
        pthread_mutex_destroy(&t->pmu);
        pthread_cond_destroy(&t->pcv);
    }
    const int64_t n_chunks = n_chunks_of(t);
    for (int64_t c = 0; t->chunks && c < n_chunks; c++)
        if (t->chunks[c]) o->host_dealloc(t->be, t->chunks[c]);
    st_free(t->ent);
    st_free(t->tok);
    st_free(t->free_ent);
    st_free(t->bucket);
    st_free(t->chunks);
    st_free(t->chunk_base);
    st_free(t->host_ent);
    st_free(t->host_busy);
    st_free(t->free_host);
    st_free(t->d2h);
    st_free(t->h2d);
    st_free(t->pinned);
    st_free(t->ev_layer);
    st_free(t->fifo);
    st_free(t->fetched);
    st_free(t->dev_ticket);
    st_free(t->slot_ent);
    st_free(t->free_slot);
    st_free(t->done_buf);
    st_free(t);
}

/* ---- block manager hooks ---------------------------------------------------------*/

/* Makes sure device block `block` (hash, parent, tokens) has a host copy:
 * queues its device -> host copy into a new host block. */
static void ensure(st_kv_tiers *t, int32_t block, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    int64_t e = find(t, hash, parent, tokens);
    if (e != NIL && t->ent[e].host != NIL) {
        hlru_remove(t, e);
        hlru_place(t, e);
        return;
    }
    if (e != NIL && t->ent[e].ssd != NIL) { /* on the SSD only: a host copy too (no rewrite) */
        slru_remove(t, e);
        slru_place(t, e);
    }
    if (t->n_d2h == t->cap_xfer) {
        t->st.offloads_skipped++;
        return;
    }
    const int64_t h = host_take(t);
    if (h == NIL) {
        t->st.offloads_skipped++;
        return;
    }
    if (e == NIL && (e = ent_new(t, hash, parent, tokens)) == NIL) { /* cannot happen: one entry per block */
        t->free_host[t->n_free_host++] = h;
        t->st.offloads_skipped++;
        return;
    }
    host_attach(t, e, h);
    t->host_busy[h] = UINT64_MAX; /* until its copy is issued (flush_d2h): never evicted before */
    t->ent[e].ready = UINT64_MAX;
    t->d2h[t->n_d2h++] = (xfer){.dev = block, .host = h};
}

void st_kv_tiers_on_register(int32_t block, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                             int64_t n_tokens, void *tiers) {
    st_kv_tiers *t = tiers;
    ST_ASSERT(n_tokens == t->bs);
    if (t->p.offload == ST_KV_OFFLOAD_EAGER) {
        ensure(t, block, hash, parent_hash, tokens);
        return;
    }
    const int64_t e = find(t, hash, parent_hash, tokens); /* lazy: only refresh what the tiers hold */
    if (e != NIL && t->ent[e].host != NIL) {
        hlru_remove(t, e);
        hlru_place(t, e);
    }
}

void st_kv_tiers_on_evict(int32_t block, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                          int64_t n_tokens, void *tiers) {
    st_kv_tiers *t = tiers;
    ST_ASSERT(n_tokens == t->bs);
    if (t->dev_ticket[block] > t->done_ticket) t->must_wait = true; /* its copy down may still be running */
    ensure(t, block, hash, parent_hash, tokens);
}

void st_kv_tiers_device_dropped(st_kv_tiers *t) {
    if (t) t->must_wait = true;
}

/* ---- admissions ------------------------------------------------------------------*/

int64_t st_kv_tiers_lookup(const st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block) {
    if (!t || !tokens || from_block < 0) return 0;
    const int64_t bs = t->bs, max_blocks = n_tokens > 0 ? (n_tokens - 1) / bs : 0;
    uint64_t h = chain_to(t, tokens, from_block);
    int64_t n = 0;
    for (int64_t i = from_block; i < max_blocks; i++) {
        const uint64_t hi = st_kv_hash_tokens(tokens + i * bs, bs, h);
        const int64_t e = find(t, hi, h, tokens + i * bs);
        if (e == NIL || t->ent[e].host == NIL || t->ent[e].reading) break; /* SSD-only: st_kv_tiers_prefetch */
        n++;
        h = hi;
    }
    return n;
}

int64_t st_kv_tiers_load(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                         int64_t n_blocks, const int32_t *dev_blocks) {
    if (!t || n_blocks <= 0) return 0;
    const int64_t bs = t->bs, avail = st_kv_tiers_lookup(t, tokens, n_tokens, from_block);
    if (n_blocks > avail) n_blocks = avail;
    if (n_blocks > t->cap_xfer - t->n_h2d) n_blocks = t->cap_xfer - t->n_h2d;
    if (n_blocks <= 0) return 0;
    /* the entries (all in the host tier), pinned until the step's copies are issued */
    int64_t *ents = t->pinned + t->n_pinned;
    uint64_t h = chain_to(t, tokens, from_block);
    for (int64_t k = 0; k < n_blocks; k++) {
        const int32_t *blk = tokens + (from_block + k) * bs;
        const uint64_t hi = st_kv_hash_tokens(blk, bs, h);
        ents[k] = find(t, hi, h, blk);
        ST_ASSERT(ents[k] != NIL && t->ent[ents[k]].host != NIL && !t->ent[ents[k]].reading);
        t->ent[ents[k]].pins++;
        t->h2d[t->n_h2d++] = (xfer){.dev = dev_blocks[k], .host = t->ent[ents[k]].host};
        h = hi;
    }
    t->n_pinned += n_blocks;
    for (int64_t k = n_blocks - 1; k >= 0; k--) { /* the chain refreshed last block first: its head most recent */
        entry *x = &t->ent[ents[k]];
        hlru_touch(t, ents[k]);
        if (x->ssd != NIL) slru_touch(t, ents[k]);
        if (x->fetched) t->st.hit_tokens_ssd += bs;
        else t->st.hit_tokens_host += bs;
        x->fetched = false;
    }
    for (int64_t i = 0; i < t->n_fetched; i++) t->ent[t->fetched[i]].fetched = false; /* the rest: evictable again */
    t->n_fetched = 0;
    return n_blocks;
}

/* ---- P-D: blocks that arrive from another node ---------------------------------*/

strata_status st_kv_tiers_reserve(st_kv_tiers *t, int64_t n, int64_t *host_blocks) {
    if (!t || n < 0 || (n > 0 && !host_blocks)) return st_err(STRATA_ERR_INVALID_ARG, "kv tiers reserve: bad arguments");
    for (int64_t k = 0; k < n; k++) {
        const int64_t h = host_take(t);
        if (h == NIL) {
            st_kv_tiers_unreserve(t, host_blocks, k);
            return st_err(STRATA_ERR_NOMEM,
                          "the KV host tier has no room for %lld more blocks (%lld blocks, %lld of them busy or "
                          "reserved; --kv-host-mem)",
                          (long long)n, (long long)t->n_host, (long long)(t->n_host - t->n_free_host));
        }
        host_blocks[k] = h;
        t->n_reserved++;
    }
    return STRATA_OK;
}

void st_kv_tiers_unreserve(st_kv_tiers *t, const int64_t *host_blocks, int64_t n) {
    if (!t) return;
    for (int64_t k = n - 1; k >= 0; k--) {
        ST_ASSERT(host_blocks[k] >= 0 && host_blocks[k] < t->n_alloc && t->host_ent[host_blocks[k]] == NIL);
        t->free_host[t->n_free_host++] = host_blocks[k];
        t->n_reserved--;
    }
}

void *st_kv_tiers_host_block(const st_kv_tiers *t, int64_t host_block) {
    return t && host_block >= 0 && host_block < t->n_alloc ? host_ptr(t, host_block) : NULL;
}

int64_t st_kv_tiers_adopt(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block, int64_t n,
                          const int64_t *host_blocks) {
    if (!t || n <= 0) return 0;
    const int64_t bs = t->bs;
    ST_ASSERT(from_block >= 0 && (from_block + n) * bs <= n_tokens);
    uint64_t h = chain_to(t, tokens, from_block);
    int64_t adopted = 0;
    for (int64_t k = 0; k < n; k++) {
        const int32_t *blk = tokens + (from_block + k) * bs;
        const uint64_t hi = st_kv_hash_tokens(blk, bs, h);
        const int64_t hb = host_blocks[k];
        ST_ASSERT(hb >= 0 && hb < t->n_alloc && t->host_ent[hb] == NIL);
        t->n_reserved--;
        int64_t e = find(t, hi, h, blk);
        if ((e != NIL && t->ent[e].host != NIL) || (e == NIL && (e = ent_new(t, hi, h, blk)) == NIL)) {
            t->free_host[t->n_free_host++] = hb; /* held already (or no entry left): the copy is not needed */
        } else {
            host_attach(t, e, hb);
            t->host_busy[hb] = 0;
            t->ent[e].ready = 0;
            if (t->ssd && !t->ent[e].to_ssd && t->ent[e].ssd == NIL && t->ent[e].ssd_pending == NIL) {
                ST_ASSERT(t->fifo_n < t->n_host);
                t->fifo[(t->fifo_head + t->fifo_n++) % t->n_host] = e;
                t->ent[e].to_ssd = true;
            }
            adopted++;
        }
        h = hi;
    }
    t->st.blocks_adopted += adopted;
    return adopted;
}

/* ---- ahead of an admission: host blocks into device blocks now ------------------------*/

strata_status st_kv_tiers_preload(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                                  int64_t n, const int32_t *dev_blocks, uint64_t *ticket) {
    *ticket = 0;
    if (!t || n <= 0) return STRATA_OK;
    ST_ASSERT(n <= st_kv_tiers_lookup(t, tokens, n_tokens, from_block));
    xfer *x = st_malloc((size_t)n * sizeof *x);
    if (!x)
        return st_err(STRATA_ERR_NOMEM, "kv tiers preload: out of memory for %lld block transfers (%zu bytes)",
                      (long long)n, (size_t)n * sizeof *x);
    uint64_t h = chain_to(t, tokens, from_block);
    for (int64_t k = 0; k < n; k++) {
        const int32_t *blk = tokens + (from_block + k) * t->bs;
        const uint64_t hi = st_kv_hash_tokens(blk, t->bs, h);
        const int64_t e = find(t, hi, h, blk);
        ST_ASSERT(e != NIL && t->ent[e].host != NIL);
        x[k] = (xfer){.dev = dev_blocks[k], .host = t->ent[e].host};
        hlru_touch(t, e);
        h = hi;
    }
    strata_status st = STRATA_OK;
    int64_t calls = 0;
    for (int64_t l = 0; l < t->L && !st; l++) st = copy_layer(t, x, n, l, false, &calls);
    uint64_t tk = 0;
    if (!st) st = end_batch(t, &tk);
    if (!st) {
        for (int64_t k = 0; k < n; k++) t->host_busy[x[k].host] = tk; /* read until the batch completes */
        t->st.copies_h2d += calls;
        t->st.bytes_h2d += (uint64_t)n * (uint64_t)(t->layer_bytes * (size_t)t->L);
        *ticket = tk;
    }
    st_free(x);
    return st;
}

bool st_kv_tiers_copied(st_kv_tiers *t, uint64_t ticket) {
    if (!t) return true;
    if (poll_copies(t) != STRATA_OK) return false;
    return t->done_ticket >= ticket;
}

/* ---- around a pass ---------------------------------------------------------------*/

/* This step's loads, layer by layer, each layer's event handed to the pool;
 * then the entries are unpinned. Called by the model once the pass's metadata
 * upload is enqueued (the pool's pass hook), or by after_step when no pass ran. */
static strata_status issue_loads(void *user) {
    st_kv_tiers *t = user;
    const st_backend_ops *o = t->be->ops;
    strata_status st;
    if (t->n_h2d > 0) {
        if ((st = o->event_record(t->be, t->ev_compute, t->compute))) return st;
        if ((st = o->stream_wait_event(t->be, t->cs, t->ev_compute))) return st;
        for (int64_t l = 0; l < t->L; l++) {
            if ((st = copy_layer(t, t->h2d, t->n_h2d, l, false, &t->st.copies_h2d))) return st;
            if ((st = o->event_record(t->be, t->ev_layer[l], t->cs))) return st;
            st_kv_pool_set_ready(t->pool, l, t->ev_layer[l]);
        }
        uint64_t ticket;
        if ((st = end_batch(t, &ticket))) return st;
        for (int64_t i = 0; i < t->n_h2d; i++) t->host_busy[t->h2d[i].host] = ticket;
        t->st.bytes_h2d += (uint64_t)t->n_h2d * (uint64_t)(t->layer_bytes * (size_t)t->L);
        t->n_h2d = 0;
    }
    for (int64_t i = 0; i < t->n_pinned; i++)
        if (t->pinned[i] != NIL) t->ent[t->pinned[i]].pins--;
    t->n_pinned = 0;
    return STRATA_OK;
}

strata_status st_kv_tiers_before_forward(st_kv_tiers *t, st_stream *compute) {
    strata_status st;
    t->compute = compute;
    const bool evicted = t->n_d2h > 0; /* lazy: blocks this step's allocations evicted, copied down now */
    if ((st = flush_d2h(t, compute))) return st;
    if ((st = poll_copies(t))) return st;
    /* the pass writes into blocks whose copy down may still be running: it waits for the copies (a pass
     * that only writes fresh blocks does not: eager copies overlap the next chunk's pass) */
    if ((evicted || t->must_wait) && t->last_d2h > t->done_ticket &&
        (st = t->be->ops->stream_wait_event(t->be, compute, t->ev_d2h)))
        return st;
    t->must_wait = false;
    return STRATA_OK; /* the loads: issue_loads, from the pass */
}

strata_status st_kv_tiers_after_step(st_kv_tiers *t, st_stream *compute) {
    strata_status st;
    t->compute = compute;
    if ((t->n_h2d > 0 || t->n_pinned > 0) && (st = issue_loads(t))) return st; /* no pass ran: the KV still lands */
    st_kv_pool_clear_ready(t->pool);
    if ((st = flush_d2h(t, compute))) return st; /* blocks registered by this step (eager) */
    if ((st = poll_copies(t))) return st;
    if (t->ssd) {
        reads_poll(t, false);
        ssd_poll(t);
        ssd_feed(t);
    }
    return STRATA_OK;
}

bool st_kv_tiers_reading(const st_kv_tiers *t) { return t && t->reads_in_flight > 0; }

void st_kv_tiers_wait_reads(st_kv_tiers *t) {
    if (t) reads_poll(t, true);
}

strata_status st_kv_tiers_drain(st_kv_tiers *t) {
    if (!t) return STRATA_OK;
    strata_status st = t->be->ops->stream_sync(t->be, t->cs);
    if (st) return st;
    if ((st = poll_copies(t))) return st;
    t->done_ticket = t->next_ticket - 1;
    t->ring_n = 0;
    while (t->reads_in_flight > 0) reads_poll(t, true);
    while (t->ssd) {
        ssd_poll(t);
        ssd_feed(t);
        if (t->fifo_n == 0 && t->ssd_busy == 0) break;
        const int64_t before = t->fifo_n + t->ssd_busy;
        st_kv_ssd_flush(t->ssd);
        ssd_poll(t);
        if (t->fifo_n + t->ssd_busy == before && t->fifo_n > 0 && t->n_free_slot == 0 && t->slru_head == NIL)
            break; /* no slot can be had (every one failed): the rest stays host-only */
    }
    return STRATA_OK;
}

void st_kv_tiers_drop_host(st_kv_tiers *t, bool all) {
    if (!t) return;
    (void)st_kv_tiers_drain(t);
    for (int64_t e = t->hlru_tail; e != NIL;) { /* most recent first: the free blocks pop oldest first */
        const int64_t next = t->ent[e].hprev;
        if ((all || t->ent[e].ssd != NIL) && evictable(t, e)) host_release(t, e);
        e = next;
    }
}

void st_kv_tiers_get_stats(const st_kv_tiers *t, st_kv_tiers_stats *out) {
    *out = t->st;
    out->host_busy = t->fifo_n + t->ssd_busy + t->n_pinned; /* waiting for / under an SSD write, loading */
    out->ssd_busy = t->ssd_busy;
    out->ssd_bad = t->n_bad;
    out->host_reserved = t->n_reserved;
}

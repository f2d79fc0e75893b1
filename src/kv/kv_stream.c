/* kv/kv_stream: the KV of one sequence longer than the device (kv_stream.h). */
#include "kv/kv_stream.h"

#include <stdlib.h>
#include <string.h>

#include "core/core.h"

#define TRY(x) do { strata_status st_ = (x); if (st_ != STRATA_OK) return st_; } while (0)

struct st_kv_stream {
    st_backend *be;
    st_kv_stream_params p;
    size_t prow[4];             /* bytes of one key's row in each plane: K, V (then, fp8: K and V scales) */
    int np_;                    /* planes: 2, or 4 with fp8's scales */
    int64_t area_rows;          /* ST_ATTN_RANGE + max_tokens */
    /* host: seg[(l * 2 + plane) * max_segs + s] */
    void **seg;
    int64_t max_segs, n_segs;   /* segments allocated per (layer, plane) */
    size_t host_used;
    /* device */
    void *ring[2][4];           /* [slot][plane] */
    void *area[2][4];           /* [layer parity][plane] */
    int32_t *iota;
    void *meta_h, *meta_d;      /* a pass's metadata: pinned host staging and its device copy */
    size_t meta_bytes;
    st_stream *compute, *copy;
    st_event *ready[2], *freed[2], *tail_ready, *stored[2], *area_free[2];
    /* the pass */
    int64_t len, n;             /* keys on the host; tokens of the pass (0: none) */
    int64_t ts, np;             /* tail start; pieces per layer */
    int64_t next;               /* the next item (layer * np + piece) to issue */
    int64_t cur;                /* the item the compute stream reads */
    uint64_t h2d, d2h;
};

static size_t r256(size_t x) { return (x + 255) / 256 * 256; }

/* Bytes of one key's row in plane pl (K, V, then fp8's K and V scales: a float per kv head), 0 past the
 * planes of the dtype. */
static size_t plane_row(const st_kv_stream_params *p, int pl) {
    if (pl < 2) return (size_t)(p->n_kv_heads * p->head_dim) * st_kv_dtype_size(p->dtype);
    return p->dtype == ST_KV_FP8 ? (size_t)p->n_kv_heads * sizeof(float) : 0;
}

/* Bytes of one key in every plane. */
static size_t key_bytes(const st_kv_stream_params *p) {
    size_t b = 0;
    for (int pl = 0; pl < 4; pl++) b += plane_row(p, pl);
    return b;
}

size_t st_kv_stream_device_bytes(const st_kv_stream_params *p) {
    const size_t area = (size_t)(ST_ATTN_RANGE + p->max_tokens);
    const size_t ids = (size_t)p->piece > area ? (size_t)p->piece : area;
    size_t b = 0;
    for (int pl = 0; pl < 4; pl++)
        if (plane_row(p, pl)) b += 2 * r256((size_t)p->piece * plane_row(p, pl)) + 2 * r256(area * plane_row(p, pl));
    return b + r256(ids * 4) +
           r256((size_t)p->max_tokens * ST_KV_STREAM_META_PER_TOKEN);
}

size_t st_kv_stream_host_bytes(const st_kv_stream_params *p, int64_t len) {
    const int64_t segs = (len + ST_KV_STREAM_SEG - 1) / ST_KV_STREAM_SEG;
    return (size_t)(segs * p->n_layers) * ST_KV_STREAM_SEG * key_bytes(p);
}

#define BAD(...) return st_err(STRATA_ERR_INVALID_ARG, "kv_stream: " __VA_ARGS__)

static strata_status check_params(const st_kv_stream_params *p) {
    if (p->n_layers < 1 || p->n_kv_heads < 1 || p->head_dim < 1)
        BAD("n_layers = %lld, n_kv_heads = %lld, head_dim = %lld (>= 1 each)", (long long)p->n_layers,
            (long long)p->n_kv_heads, (long long)p->head_dim);
    if (p->dtype != ST_KV_BF16 && p->dtype != ST_KV_F32 && p->dtype != ST_KV_FP8) BAD("dtype %d", (int)p->dtype);
    if (p->piece < ST_ATTN_RANGE || p->piece % ST_ATTN_RANGE || ST_KV_STREAM_SEG % p->piece)
        BAD("piece = %lld (a multiple of %d dividing %d)", (long long)p->piece, ST_ATTN_RANGE, ST_KV_STREAM_SEG);
    if (p->max_tokens < 1) BAD("max_tokens = %lld", (long long)p->max_tokens);
    if (p->max_len < 1 || p->max_len > INT32_MAX) BAD("max_len = %lld (1 to 2^31 - 1)", (long long)p->max_len);
    return STRATA_OK;
}

strata_status st_kv_stream_init(st_backend *be, const st_kv_stream_params *p, st_kv_stream **out) {
    if (!be || !p || !out) BAD("NULL argument");
    *out = NULL;
    TRY(check_params(p));
    st_kv_stream *ks = st_calloc(1, sizeof *ks);
    if (!ks) return st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory for its state (%zu bytes)", sizeof *ks);
    ks->be = be;
    ks->p = *p;
    ks->np_ = p->dtype == ST_KV_FP8 ? 4 : 2;
    for (int pl = 0; pl < 4; pl++) ks->prow[pl] = plane_row(p, pl);
    ks->area_rows = ST_ATTN_RANGE + p->max_tokens;
    ks->max_segs = (p->max_len + ST_KV_STREAM_SEG - 1) / ST_KV_STREAM_SEG;
    ks->seg = st_calloc((size_t)(ks->max_segs * 4 * p->n_layers), sizeof *ks->seg);
    const st_backend_ops *o = be->ops;
    strata_status st = ks->seg ? STRATA_OK
                               : st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory for the segment table");
    for (int s = 0; s < 2 && st == STRATA_OK; s++)
        for (int pl = 0; pl < ks->np_ && st == STRATA_OK; pl++) {
            st = o->alloc(be, (size_t)p->piece * ks->prow[pl], &ks->ring[s][pl]);
            if (st != STRATA_OK) {
                st = st_err_what(st, "kv_stream: device ring piece %d.%d (%zu bytes)", s, pl,
                                 (size_t)p->piece * ks->prow[pl]);
                break;
            }
            st = o->alloc(be, (size_t)ks->area_rows * ks->prow[pl], &ks->area[s][pl]);
            if (st != STRATA_OK)
                st = st_err_what(st, "kv_stream: device area %d.%d (%zu bytes)", s, pl,
                                 (size_t)ks->area_rows * ks->prow[pl]);
        }
    const int64_t ids = p->piece > ks->area_rows ? p->piece : ks->area_rows;
    int32_t *h = st == STRATA_OK ? st_malloc((size_t)ids * 4) : NULL;
    if (st == STRATA_OK && !h)
        st = st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory for %lld row ids (%zu bytes)", (long long)ids,
                    (size_t)ids * 4);
    if (st == STRATA_OK) {
        for (int64_t i = 0; i < ids; i++) h[i] = (int32_t)i;
        st = o->alloc(be, (size_t)ids * 4, (void **)&ks->iota);
        if (st != STRATA_OK) st = st_err_what(st, "kv_stream: device row ids (%zu bytes)", (size_t)ids * 4);
        if (st == STRATA_OK) st = o->copy_h2d(be, NULL, ks->iota, h, (size_t)ids * 4);
        if (st == STRATA_OK) st = o->stream_sync(be, NULL);
    }
    st_free(h);
    ks->meta_bytes = (size_t)p->max_tokens * ST_KV_STREAM_META_PER_TOKEN;
    if (st == STRATA_OK && (st = o->alloc(be, ks->meta_bytes, &ks->meta_d)) != STRATA_OK)
        st = st_err_what(st, "kv_stream: the pass's metadata on the device (%zu bytes)", ks->meta_bytes);
    if (st == STRATA_OK && (st = o->host_alloc(be, ks->meta_bytes, &ks->meta_h)) != STRATA_OK)
        st = st_err_what(st, "kv_stream: the pass's metadata in pinned host memory (%zu bytes)", ks->meta_bytes);
    if (st == STRATA_OK) st = o->stream_create(be, false, &ks->copy);
    st_event **evs[] = {&ks->ready[0], &ks->ready[1], &ks->freed[0],    &ks->freed[1],
                        &ks->tail_ready, &ks->stored[0], &ks->stored[1], &ks->area_free[0], &ks->area_free[1]};
    for (size_t i = 0; i < sizeof evs / sizeof evs[0] && st == STRATA_OK; i++) st = o->event_create(be, evs[i]);
    if (st != STRATA_OK) {
        st_kv_stream_free(ks);
        return st;
    }
    *out = ks;
    return STRATA_OK;
}

void st_kv_stream_free(st_kv_stream *ks) {
    if (!ks) return;
    st_backend *be = ks->be;
    const st_backend_ops *o = be->ops;
    if (ks->copy) {
        (void)o->stream_sync(be, ks->copy);
        o->stream_destroy(be, ks->copy);
    }
    st_event *evs[] = {ks->ready[0], ks->ready[1], ks->freed[0],    ks->freed[1],
                       ks->tail_ready, ks->stored[0], ks->stored[1], ks->area_free[0], ks->area_free[1]};
    for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
        if (evs[i]) o->event_destroy(be, evs[i]);
    for (int s = 0; s < 2; s++)
        for (int pl = 0; pl < 4; pl++) {
            if (ks->ring[s][pl]) o->dealloc(be, ks->ring[s][pl]);
            if (ks->area[s][pl]) o->dealloc(be, ks->area[s][pl]);
        }
    if (ks->iota) o->dealloc(be, ks->iota);
    if (ks->meta_d) o->dealloc(be, ks->meta_d);
    if (ks->meta_h) o->host_dealloc(be, ks->meta_h);
    if (ks->seg)
        for (int64_t i = 0; i < ks->max_segs * 4 * ks->p.n_layers; i++)
            if (ks->seg[i]) o->host_dealloc(be, ks->seg[i]);
    st_free(ks->seg);
    st_free(ks);
}

const st_kv_stream_params *st_kv_stream_get_params(const st_kv_stream *ks) { return &ks->p; }
int64_t st_kv_stream_len(const st_kv_stream *ks) { return ks->len; }
void st_kv_stream_meta(st_kv_stream *ks, void **host, void **dev, size_t *bytes) {
    *host = ks->meta_h;
    *dev = ks->meta_d;
    *bytes = ks->meta_bytes;
}
size_t st_kv_stream_host_used(const st_kv_stream *ks) { return ks->host_used; }
void st_kv_stream_reset(st_kv_stream *ks) { ks->len = 0; }
void st_kv_stream_bytes(const st_kv_stream *ks, uint64_t *h2d, uint64_t *d2h) {
    if (h2d) *h2d = ks->h2d;
    if (d2h) *d2h = ks->d2h;
}

/* Host row of key j of (layer l, plane pl). */
static uint8_t *host_row(st_kv_stream *ks, int64_t l, int pl, int64_t j) {
    uint8_t *s = ks->seg[(l * 4 + pl) * ks->max_segs + j / ST_KV_STREAM_SEG];
    return s + (size_t)(j % ST_KV_STREAM_SEG) * ks->prow[pl];
}

static st_kv_layer view(const st_kv_stream *ks, void *const *planes, int64_t rows) {
    return (st_kv_layer){.k = planes[0], .v = planes[1], .k_scale = planes[2], .v_scale = planes[3],
                         .dtype = ks->p.dtype, .n_slots = rows, .n_kv_heads = ks->p.n_kv_heads,
                         .head_dim = ks->p.head_dim};
}

/* Copies keys [a, e) of layer l between the host and `dev` planes (rows from dev_row0), up or down. */
static strata_status move_rows(st_kv_stream *ks, int64_t l, int64_t a, int64_t e, void *const *dev, int64_t dev_row0,
                               bool up) {
    st_backend *be = ks->be;
    for (int pl = 0; pl < ks->np_; pl++) {
        uint8_t *d = (uint8_t *)dev[pl] + (size_t)dev_row0 * ks->prow[pl];
        const size_t n = (size_t)(e - a) * ks->prow[pl];
        TRY(up ? be->ops->copy_h2d(be, ks->copy, d, host_row(ks, l, pl, a), n)
               : be->ops->copy_d2h(be, ks->copy, host_row(ks, l, pl, a), d, n));
        if (up) ks->h2d += n;
        else ks->d2h += n;
    }
    return STRATA_OK;
}

/* Issues item g of the pass (layer g / np, piece g % np) into slot g % 2 once
 * the compute stream has read what the slot held. */
static strata_status issue(st_kv_stream *ks, int64_t g) {
    st_backend *be = ks->be;
    const st_backend_ops *o = be->ops;
    const int slot = (int)(g % 2);
    const int64_t l = g / ks->np, k = g % ks->np, a = k * ks->p.piece;
    const int64_t e = a + ks->p.piece < ks->ts ? a + ks->p.piece : ks->ts;
    TRY(o->stream_wait_event(be, ks->copy, ks->freed[slot]));
    TRY(move_rows(ks, l, a, e, ks->ring[slot], 0, true));
    return o->event_record(be, ks->ready[slot], ks->copy);
}

strata_status st_kv_stream_reserve(st_kv_stream *ks, int64_t end) {
    if (end > ks->p.max_len)
        BAD("%lld keys, past the sequence's %lld", (long long)end, (long long)ks->p.max_len);
    const int64_t segs = (end + ST_KV_STREAM_SEG - 1) / ST_KV_STREAM_SEG;
    if (segs > ks->n_segs) {
        const size_t want = st_kv_stream_host_bytes(&ks->p, end);
        if (ks->p.host_mem && want > ks->p.host_mem)
            return st_err(STRATA_ERR_NOMEM,
                          "kv_stream: %lld tokens of KV take %.1f MB of host memory (segments of %d tokens), "
                          "more than the %.1f MB allowed (--kv-host-mem)", (long long)end, want / 1e6,
                          ST_KV_STREAM_SEG, ks->p.host_mem / 1e6);
        for (int64_t s = ks->n_segs; s < segs; s++)
            for (int64_t i = 0; i < 4 * ks->p.n_layers; i++) {
                const size_t bytes = (size_t)ST_KV_STREAM_SEG * ks->prow[i % 4];
                if (!bytes) continue;
                void **slot = &ks->seg[i * ks->max_segs + s];
                strata_status st = ks->be->ops->host_alloc(ks->be, bytes, slot);
                if (st != STRATA_OK)
                    return st_err(STRATA_ERR_NOMEM, "kv_stream: pinning %.1f MB of host memory for %lld tokens "
                                  "of KV failed (--kv-host-mem caps it): %s", want / 1e6, (long long)end,
                                  st_last_error());
                ks->host_used += bytes;
            }
        ks->n_segs = segs;
    }
    return STRATA_OK;
}

strata_status st_kv_stream_begin(st_kv_stream *ks, st_stream *compute, int64_t n) {
    if (n < 1 || n > ks->p.max_tokens)
        BAD("%lld tokens in a pass (1 to max_tokens = %lld)", (long long)n, (long long)ks->p.max_tokens);
    TRY(st_kv_stream_reserve(ks, ks->len + n));
    ks->compute = compute;
    ks->n = n;
    ks->ts = ks->len / ST_ATTN_RANGE * ST_ATTN_RANGE;
    ks->np = (ks->ts + ks->p.piece - 1) / ks->p.piece;
    ks->next = ks->cur = 0;
    /* the ring's events from the previous pass are complete (its host sync) */
    const int64_t total = ks->np * ks->p.n_layers;
    for (; ks->next < 2 && ks->next < total; ks->next++) TRY(issue(ks, ks->next));
    return STRATA_OK;
}

int64_t st_kv_stream_tail_start(const st_kv_stream *ks) { return ks->ts; }
int64_t st_kv_stream_n_pieces(const st_kv_stream *ks) { return ks->np; }
const int32_t *st_kv_stream_iota(const st_kv_stream *ks) { return ks->iota; }

strata_status st_kv_stream_layer_begin(st_kv_stream *ks, int64_t l, st_kv_layer *area) {
    st_backend *be = ks->be;
    const st_backend_ops *o = be->ops;
    const int a = (int)(l % 2);
    /* the area's previous layer went down before its rows are overwritten */
    TRY(o->stream_wait_event(be, ks->copy, ks->area_free[a]));
    if (ks->len > ks->ts) {
        TRY(move_rows(ks, l, ks->ts, ks->len, ks->area[a], 0, true));
    }
    TRY(o->event_record(be, ks->tail_ready, ks->copy));
    TRY(o->stream_wait_event(be, ks->compute, ks->tail_ready));
    *area = view(ks, ks->area[a], ks->area_rows);
    return STRATA_OK;
}

strata_status st_kv_stream_piece(st_kv_stream *ks, int64_t l, int64_t k, st_kv_layer *slot, int64_t *key0,
                                 int64_t *n) {
    const int64_t g = l * ks->np + k;
    ST_ASSERT(g == ks->cur && g < ks->next && k < ks->np);
    const int s = (int)(g % 2);
    TRY(ks->be->ops->stream_wait_event(ks->be, ks->compute, ks->ready[s]));
    const int64_t a = k * ks->p.piece, e = a + ks->p.piece < ks->ts ? a + ks->p.piece : ks->ts;
    *slot = view(ks, ks->ring[s], ks->p.piece);
    *key0 = a;
    *n = e - a;
    return STRATA_OK;
}

strata_status st_kv_stream_piece_read(st_kv_stream *ks) {
    const int s = (int)(ks->cur % 2);
    TRY(ks->be->ops->event_record(ks->be, ks->freed[s], ks->compute));
    ks->cur++;
    if (ks->next < ks->np * ks->p.n_layers) TRY(issue(ks, ks->next++));
    return STRATA_OK;
}

strata_status st_kv_stream_layer_end(st_kv_stream *ks, int64_t l) {
    st_backend *be = ks->be;
    const st_backend_ops *o = be->ops;
    const int a = (int)(l % 2);
    TRY(o->event_record(be, ks->stored[a], ks->compute));
    TRY(o->stream_wait_event(be, ks->copy, ks->stored[a]));
    TRY(move_rows(ks, l, ks->len, ks->len + ks->n, ks->area[a], ks->len - ks->ts, false));
    TRY(o->event_record(be, ks->area_free[a], ks->copy));
    /* the last layer: the compute stream waits for the copy stream's last copy (its FIFO: every copy of the
     * pass), so the pass's own host sync also covers the rows going down; commit needs no sync of its own */
    return l == ks->p.n_layers - 1 ? o->stream_wait_event(be, ks->compute, ks->area_free[a]) : STRATA_OK;
}

strata_status st_kv_stream_commit(st_kv_stream *ks) {
    if (ks->n == 0) BAD("commit without a pass");
    ks->len += ks->n; /* its rows are on the host: the last layer_end made the compute stream wait for them */
    ks->n = 0;
    return STRATA_OK;
}

void st_kv_stream_abort(st_kv_stream *ks) {
    (void)ks->be->ops->stream_sync(ks->be, ks->copy);
    ks->n = 0;
}

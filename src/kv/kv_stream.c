/* kv/kv_stream: the KV of one sequence longer than the device (kv_stream.h). */
#include "kv/kv_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/aio.h"
#include "core/core.h"

#define TRY(x) do { strata_status st_ = (x); if (st_ != STRATA_OK) return st_; } while (0)

struct st_kv_stream {
    st_backend *be;
    st_kv_stream_params p;
    size_t prow[4];             /* bytes of one key's row in each plane: K, V (then, fp8: K and V scales) */
    int np_;                    /* planes: 2, or 4 with fp8's scales */
    int64_t area_rows;          /* ST_ATTN_RANGE + max_tokens */
    /* host: seg[(l * 4 + plane) * max_segs + s], NULL where segment s is on the SSD (or not placed) */
    void **seg;
    int64_t segk;               /* keys per segment */
    int64_t max_segs, n_segs;   /* segments [0, n_segs) are placed: on the host or the SSD */
    int64_t *loc;               /* per segment: -1 on the host, else its slot in the SSD file */
    int64_t n_host;             /* segments on the host */
    size_t set_bytes;           /* one segment of every layer and plane (host bytes: n_host x set_bytes) */
    /* the SSD tier (opened at the first segment that goes there) */
    char *dir;                  /* params.ssd_dir (NULL: no SSD tier) */
    int fd;
    char *path;                 /* the file's name (unlinked at once), for messages */
    bool direct;
    st_aio *aio;
    int64_t n_ssd;              /* file slots in use: 0 .. n_ssd - 1 (a slot: set_bytes) */
    void *stage[2][4];          /* pinned staging of a ring slot's piece read from the file */
    bool staged[2];             /* the slot's last copy up read its staging */
    uint64_t ssd_read, ssd_written;
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
    int64_t cpu;                /* keys [0, cpu) the caller attends from host memory (a multiple of
                                   ST_ATTN_RANGE); the ring's first piece starts there */
    int64_t next;               /* the next item (layer * np + piece) to issue */
    int64_t cur;                /* the item the compute stream reads */
    uint64_t h2d, d2h;
};

static size_t r256(size_t x) { return (x + 255) / 256 * 256; }
static int64_t seg_keys(const st_kv_stream_params *p) { return p->seg ? p->seg : ST_KV_STREAM_SEG; }

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

size_t st_kv_stream_default_host_mem(void) { return st_mem_available() / 4 * 3; }

size_t st_kv_stream_host_bytes(const st_kv_stream_params *p, int64_t len) {
    const int64_t segs = (len + seg_keys(p) - 1) / seg_keys(p);
    return (size_t)(segs * p->n_layers * seg_keys(p)) * key_bytes(p);
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
    if (p->seg && (p->seg < 0 || p->seg % p->piece || p->seg % ST_AIO_ALIGN))
        BAD("seg = %lld (--kv-segment: a multiple of the attention piece, %lld, and of %u)", (long long)p->seg,
            (long long)p->piece, ST_AIO_ALIGN);
    if (p->ssd_dir && !p->ssd_dir[0]) BAD("ssd_dir is empty (--kv-ssd-dir)");
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
    ks->segk = seg_keys(p);
    ks->set_bytes = (size_t)(ks->segk * p->n_layers) * key_bytes(p);
    ks->fd = -1;
    ks->dir = p->ssd_dir ? st_strdup(p->ssd_dir) : NULL; /* borrowed until init returns: copied here */
    ks->p.ssd_dir = ks->dir;
    ks->max_segs = (p->max_len + ks->segk - 1) / ks->segk;
    ks->seg = st_calloc((size_t)(ks->max_segs * 4 * p->n_layers), sizeof *ks->seg);
    ks->loc = st_calloc((size_t)ks->max_segs, sizeof *ks->loc);
    const st_backend_ops *o = be->ops;
    strata_status st = ks->seg && ks->loc && (ks->dir || !p->ssd_dir)
                           ? STRATA_OK
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
    st_aio_free(ks->aio);
    if (ks->fd >= 0) close(ks->fd);
    for (int s = 0; s < 2; s++)
        for (int pl = 0; pl < 4; pl++)
            if (ks->stage[s][pl]) o->host_dealloc(be, ks->stage[s][pl]);
    st_free(ks->path);
    st_free(ks->dir);
    st_free(ks->loc);
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
size_t st_kv_stream_host_used(const st_kv_stream *ks) { return (size_t)ks->n_host * ks->set_bytes; }
/* len = 0: the SSD file's slots are free again, the host segments become segments 0, 1, ... */
void st_kv_stream_reset(st_kv_stream *ks) {
    ks->len = 0;
    ks->n_ssd = 0;
    int64_t h = 0;
    for (int64_t s = 0; s < ks->n_segs; s++) {
        if (ks->loc[s] >= 0) continue;
        for (int64_t i = 0; i < 4 * ks->p.n_layers; i++) {
            void **row = &ks->seg[i * ks->max_segs];
            void *b = row[s];
            row[s] = NULL;
            row[h] = b;
        }
        h++;
    }
    for (int64_t s = 0; s < ks->n_segs; s++) ks->loc[s] = -1;
    ks->n_segs = h;
}
void st_kv_stream_ssd(const st_kv_stream *ks, st_kv_stream_ssd_stats *out) {
    /* a segment goes to the file once and never comes back (until reset): one slot each */
    *out = (st_kv_stream_ssd_stats){.read = ks->ssd_read, .written = ks->ssd_written,
                                    .file_bytes = (uint64_t)ks->n_ssd * ks->set_bytes, .ssd_segs = ks->n_ssd,
                                    .host_segs = ks->n_host};
}
void st_kv_stream_bytes(const st_kv_stream *ks, uint64_t *h2d, uint64_t *d2h) {
    if (h2d) *h2d = ks->h2d;
    if (d2h) *d2h = ks->d2h;
}

/* Host row of key j of (layer l, plane pl): its segment is on the host. */
static uint8_t *host_row(st_kv_stream *ks, int64_t l, int pl, int64_t j) {
    uint8_t *s = ks->seg[(l * 4 + pl) * ks->max_segs + j / ks->segk];
    ST_ASSERT(s != NULL);
    return s + (size_t)(j % ks->segk) * ks->prow[pl];
}

static st_kv_layer view(const st_kv_stream *ks, void *const *planes, int64_t rows) {
    return (st_kv_layer){.k = planes[0], .v = planes[1], .k_scale = planes[2], .v_scale = planes[3],
                         .dtype = ks->p.dtype, .n_slots = rows, .n_kv_heads = ks->p.n_kv_heads,
                         .head_dim = ks->p.head_dim};
}

/* Copies keys [a, e) of layer l (on the host) between the host and `dev` planes (rows from dev_row0), up or
 * down, a copy per plane and segment. */
static strata_status move_rows(st_kv_stream *ks, int64_t l, int64_t a, int64_t e, void *const *dev, int64_t dev_row0,
                               bool up) {
    st_backend *be = ks->be;
    for (int64_t j = a; j < e;) {
        const int64_t je = e < (j / ks->segk + 1) * ks->segk ? e : (j / ks->segk + 1) * ks->segk;
        for (int pl = 0; pl < ks->np_; pl++) {
            uint8_t *d = (uint8_t *)dev[pl] + (size_t)(dev_row0 + j - a) * ks->prow[pl];
            const size_t n = (size_t)(je - j) * ks->prow[pl];
            TRY(up ? be->ops->copy_h2d(be, ks->copy, d, host_row(ks, l, pl, j), n)
                   : be->ops->copy_d2h(be, ks->copy, host_row(ks, l, pl, j), d, n));
            if (up) ks->h2d += n;
            else ks->d2h += n;
        }
        j = je;
    }
    return STRATA_OK;
}

/* ---- the SSD tier ---- */

#define IO_CHUNK ((uint64_t)16 << 20) /* bytes of one file request */
#define IO_DEPTH 16

/* File offset of keys [key, ...) of (layer l, plane pl) of the segment in file slot `slot`. */
static uint64_t file_off(const st_kv_stream *ks, int64_t slot, int64_t l, int pl, int64_t key) {
    uint64_t off = (uint64_t)slot * ks->set_bytes + (uint64_t)(l * ks->segk) * key_bytes(&ks->p);
    for (int q = 0; q < pl; q++) off += (uint64_t)ks->segk * ks->prow[q];
    return off + (uint64_t)(key % ks->segk) * ks->prow[pl];
}

/* Opens the private file in the SSD directory (made if missing), unlinked at once, and its I/O queue. */
static strata_status ssd_open(st_kv_stream *ks) {
    const char *dir = ks->dir;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return st_err(STRATA_ERR_IO, "kv_stream: cannot create the SSD directory %s (--kv-ssd-dir): %s", dir,
                      strerror(errno));
    const size_t n = strlen(dir) + 40;
    char *path = st_malloc(n);
    if (!path) return st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory");
    /* O_DIRECT where every request is a multiple of 4096 bytes at such an offset (segments always; pieces
     * when piece x row is) and the file system takes it */
    bool direct = true;
    for (int pl = 0; pl < ks->np_; pl++) direct &= (ks->p.piece * ks->prow[pl]) % ST_AIO_ALIGN == 0;
    int fd = -1;
    for (int attempt = direct ? 0 : 1; attempt < 2 && fd < 0; attempt++) {
        snprintf(path, n, "%s/strata-kv-stream-XXXXXX", dir);
        fd = mkostemp(path, O_CLOEXEC | (attempt == 0 ? O_DIRECT : 0));
        if (fd < 0 && (attempt == 1 || errno != EINVAL)) {
            const int e = errno;
            st_free(path);
            return st_err(STRATA_ERR_IO, "kv_stream: cannot create a file in %s (--kv-ssd-dir): %s", dir,
                          strerror(e));
        }
        direct = fd >= 0 && attempt == 0;
    }
    (void)unlink(path); /* private to this stream: gone when it closes, even after a crash */
    strata_status st = st_aio_init(IO_DEPTH, false, "KV stream SSD", &ks->aio);
    if (st) {
        close(fd);
        st_free(path);
        return st;
    }
    ks->fd = fd;
    ks->direct = direct;
    ks->path = path;
    st_log(STRATA_LOG_INFO, "kv_stream: segments past --kv-stream-mem go to %s (unlinked; %s)", path,
           direct ? "O_DIRECT" : "through the page cache");
    return STRATA_OK;
}

typedef struct {
    void *buf;
    uint64_t off, len;
} io_span;

/* Reads or writes the spans, in requests of at most IO_CHUNK, IO_DEPTH in flight; waits for all. A write
 * the disk has no room for (ENOSPC, EDQUOT, EFBIG) is NOMEM naming the file; other failures IO. */
static strata_status file_io(st_kv_stream *ks, bool write, const io_span *sp, int n) {
    strata_status first = STRATA_OK;
    int err = 0;
    int i = 0;
    uint64_t done = 0; /* of span i */
    for (;;) {
        while (first == STRATA_OK && i < n && st_aio_inflight(ks->aio) < st_aio_depth(ks->aio)) {
            const uint64_t len = sp[i].len - done < IO_CHUNK ? sp[i].len - done : IO_CHUNK;
            const st_aio_req r = {.fd = ks->fd, .name = ks->path, .write = write, .direct = ks->direct,
                                  .off = sp[i].off + done, .len = len, .need = len,
                                  .buf = (uint8_t *)sp[i].buf + done};
            if ((first = st_aio_submit(ks->aio, &r)) != STRATA_OK) break;
            if ((done += len) == sp[i].len) i++, done = 0;
        }
        if (st_aio_inflight(ks->aio) == 0) break;
        bool got = false;
        st_aio_result res;
        const strata_status st = st_aio_reap(ks->aio, true, &got, &res);
        if (st && first == STRATA_OK) first = st, err = res.err;
        if (got && !st) *(write ? &ks->ssd_written : &ks->ssd_read) += res.done;
    }
    if (first && write && (err == ENOSPC || err == EDQUOT || err == EFBIG))
        return st_err(STRATA_ERR_NOMEM, "kv_stream: the SSD tier is full (--kv-ssd-dir): %s", st_last_error());
    return first;
}

strata_status st_kv_stream_ssd_probe(st_kv_stream *ks, double *bytes_per_s) {
    *bytes_per_s = 0;
    const uint64_t file = (uint64_t)ks->n_ssd * ks->set_bytes;
    uint64_t chunk = (uint64_t)4 << 20; /* a small file: IO_DEPTH requests of a 4096-multiple */
    if (file < chunk * IO_DEPTH) chunk = file / IO_DEPTH / ST_AIO_ALIGN * ST_AIO_ALIGN;
    if (chunk < ST_AIO_ALIGN) chunk = ST_AIO_ALIGN;
    const uint64_t total = (file < ((uint64_t)512 << 20) ? file : (uint64_t)512 << 20) / chunk * chunk;
    if (total == 0) return STRATA_OK;
    void *buf = NULL;
    if (posix_memalign(&buf, ST_AIO_ALIGN, (size_t)(chunk * IO_DEPTH)) != 0)
        return st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory for the SSD probe");
    io_span sp[IO_DEPTH];
    const uint64_t read0 = ks->ssd_read;
    const double t0 = st_time_now();
    strata_status st = STRATA_OK;
    for (uint64_t off = 0; off < total && st == STRATA_OK;) {
        int n = 0;
        for (; n < IO_DEPTH && off < total; n++, off += chunk)
            sp[n] = (io_span){.buf = (uint8_t *)buf + (size_t)n * chunk, .off = off, .len = chunk};
        st = file_io(ks, false, sp, n);
    }
    const double t = st_time_now() - t0;
    ks->ssd_read = read0;
    free(buf);
    if (st == STRATA_OK && t > 0) *bytes_per_s = (double)total / t;
    return st;
}

/* Segment `victim` (sealed, on the host) goes to a new file slot; its host memory becomes segment s's. */
static strata_status evict(st_kv_stream *ks, int64_t victim, int64_t s) {
    if (ks->p.ssd_mem && (uint64_t)(ks->n_ssd + 1) * ks->set_bytes > ks->p.ssd_mem)
        return st_err(STRATA_ERR_NOMEM, "kv_stream: the SSD tier holds %lld segment(s) of %lld tokens (%.1f MB "
                      "each); --kv-ssd-size %.1f MB has no room for another", (long long)ks->n_ssd,
                      (long long)ks->segk, ks->set_bytes / 1e6, ks->p.ssd_mem / 1e6);
    if (ks->fd < 0) TRY(ssd_open(ks));
    /* the ring slots' staging: a piece of every plane */
    for (int r = 0; r < 2; r++)
        for (int pl = 0; pl < ks->np_; pl++)
            if (!ks->stage[r][pl] &&
                ks->be->ops->host_alloc(ks->be, (size_t)ks->p.piece * ks->prow[pl], &ks->stage[r][pl]) != STRATA_OK)
                return st_err(STRATA_ERR_NOMEM, "kv_stream: pinning the SSD tier's staging (%zu bytes) failed: %s",
                              (size_t)ks->p.piece * ks->prow[pl], st_last_error());
    const int64_t slot = ks->n_ssd;
    io_span *sp = st_malloc((size_t)(4 * ks->p.n_layers) * sizeof *sp);
    if (!sp) return st_err(STRATA_ERR_NOMEM, "kv_stream: out of memory");
    int n = 0;
    for (int64_t l = 0; l < ks->p.n_layers; l++)
        for (int pl = 0; pl < ks->np_; pl++)
            sp[n++] = (io_span){.buf = ks->seg[(l * 4 + pl) * ks->max_segs + victim],
                                .off = file_off(ks, slot, l, pl, 0), .len = (uint64_t)ks->segk * ks->prow[pl]};
    const strata_status st = file_io(ks, true, sp, n);
    st_free(sp);
    if (st) return st; /* nothing moved: the segment is still on the host */
    for (int64_t i = 0; i < 4 * ks->p.n_layers; i++) {
        void **row = &ks->seg[i * ks->max_segs];
        row[s] = row[victim];
        row[victim] = NULL;
    }
    ks->loc[victim] = slot;
    ks->loc[s] = -1;
    ks->n_ssd++;
    return STRATA_OK;
}

/* Pins segment s's host memory: one segment of every layer and plane (nothing kept on failure). */
static strata_status host_seg(st_kv_stream *ks, int64_t s, int64_t end) {
    for (int64_t i = 0; i < 4 * ks->p.n_layers; i++) {
        const size_t bytes = (size_t)ks->segk * ks->prow[i % 4];
        if (!bytes) continue;
        void **slot = &ks->seg[i * ks->max_segs + s];
        if (ks->be->ops->host_alloc(ks->be, bytes, slot) != STRATA_OK) {
            const strata_status st =
                st_err(STRATA_ERR_NOMEM, "kv_stream: pinning %.1f MB of host memory for %lld tokens of KV failed "
                       "(--kv-stream-mem caps it): %s", ks->set_bytes / 1e6, (long long)end, st_last_error());
            for (int64_t k = 0; k < i; k++) {
                void **b = &ks->seg[k * ks->max_segs + s];
                if (*b) ks->be->ops->host_dealloc(ks->be, *b);
                *b = NULL;
            }
            return st;
        }
    }
    ks->loc[s] = -1;
    ks->n_host++;
    return STRATA_OK;
}

/* Places the segments of keys up to `end`: on the host while host_mem allows, then (with an SSD tier and
 * `spill`) in the host memory of the newest sealed segment, which goes to the file; without `spill` it
 * stops at the cap. */
static strata_status place(st_kv_stream *ks, int64_t end, bool spill) {
    if (end > ks->p.max_len)
        BAD("%lld keys, past the sequence's %lld", (long long)end, (long long)ks->p.max_len);
    const int64_t segs = (end + ks->segk - 1) / ks->segk;
    for (int64_t s = ks->n_segs; s < segs; s++) {
        if (!ks->p.host_mem || (size_t)(ks->n_host + 1) * ks->set_bytes <= ks->p.host_mem) {
            TRY(host_seg(ks, s, end));
        } else if (!ks->dir) {
            return st_err(STRATA_ERR_NOMEM,
                          "kv_stream: %lld tokens of KV take %.1f MB of host memory (segments of %lld tokens), "
                          "more than the %.3f MB allowed (--kv-stream-mem; --kv-ssd-dir takes the rest)",
                          (long long)end, st_kv_stream_host_bytes(&ks->p, end) / 1e6, (long long)ks->segk,
                          ks->p.host_mem / 1e6);
        } else if (!spill) {
            break;
        } else {
            int64_t victim = -1;
            for (int64_t v = s - 1; v >= 0 && victim < 0; v--)
                if (ks->loc[v] == -1 && (v + 1) * ks->segk <= ks->len) victim = v;
            if (victim < 0)
                return st_err(STRATA_ERR_NOMEM,
                              "kv_stream: --kv-stream-mem %.1f MB holds %lld segment(s) of %lld tokens (%.1f MB "
                              "each), too few for a pass at %lld tokens reaching %lld: the segments it writes "
                              "stay on the host (raise --kv-stream-mem)", ks->p.host_mem / 1e6, (long long)ks->n_host,
                              (long long)ks->segk, ks->set_bytes / 1e6, (long long)ks->len, (long long)end);
            TRY(evict(ks, victim, s));
        }
        ks->n_segs = s + 1;
    }
    return STRATA_OK;
}

/* Copies piece [a, e) of layer l (its segment in the file) up into `dev` through ring slot r's staging: the
 * staging is free once the slot's previous copy up completed. */
static strata_status piece_from_ssd(st_kv_stream *ks, int r, int64_t l, int64_t a, int64_t e, void *const *dev) {
    st_backend *be = ks->be;
    if (ks->staged[r]) TRY(be->ops->event_sync(be, ks->ready[r]));
    io_span sp[4];
    for (int pl = 0; pl < ks->np_; pl++)
        sp[pl] = (io_span){.buf = ks->stage[r][pl], .off = file_off(ks, ks->loc[a / ks->segk], l, pl, a),
                           .len = (uint64_t)(e - a) * ks->prow[pl]};
    TRY(file_io(ks, false, sp, ks->np_));
    for (int pl = 0; pl < ks->np_; pl++) {
        TRY(be->ops->copy_h2d(be, ks->copy, dev[pl], ks->stage[r][pl], sp[pl].len));
        ks->h2d += sp[pl].len;
    }
    ks->staged[r] = true;
    return STRATA_OK;
}

/* Keys [*a, *e) of the pass's piece k: the k-th of the pieces of `piece` keys counted from key 0 that meet
 * [cpu, ts), cut to it (so that a piece never crosses a segment). */
static void piece_keys(const st_kv_stream *ks, int64_t k, int64_t *a, int64_t *e) {
    const int64_t p0 = (ks->cpu / ks->p.piece + k) * ks->p.piece;
    *a = p0 > ks->cpu ? p0 : ks->cpu;
    *e = p0 + ks->p.piece < ks->ts ? p0 + ks->p.piece : ks->ts;
}

/* Issues item g of the pass (layer g / np, piece g % np) into slot g % 2 once
 * the compute stream has read what the slot held. */
static strata_status issue(st_kv_stream *ks, int64_t g) {
    st_backend *be = ks->be;
    const st_backend_ops *o = be->ops;
    const int slot = (int)(g % 2);
    const int64_t l = g / ks->np, k = g % ks->np;
    int64_t a, e;
    piece_keys(ks, k, &a, &e);
    TRY(o->stream_wait_event(be, ks->copy, ks->freed[slot]));
    if (ks->loc[a / ks->segk] >= 0) TRY(piece_from_ssd(ks, slot, l, a, e, ks->ring[slot]));
    else TRY(move_rows(ks, l, a, e, ks->ring[slot], 0, true));
    return o->event_record(be, ks->ready[slot], ks->copy);
}

strata_status st_kv_stream_reserve(st_kv_stream *ks, int64_t end) { return place(ks, end, false); }

strata_status st_kv_stream_begin(st_kv_stream *ks, st_stream *compute, int64_t n, int64_t cpu_keys) {
    if (n < 1 || n > ks->p.max_tokens)
        BAD("%lld tokens in a pass (1 to max_tokens = %lld)", (long long)n, (long long)ks->p.max_tokens);
    TRY(place(ks, ks->len + n, true));
    ks->compute = compute;
    ks->n = n;
    ks->ts = ks->len / ST_ATTN_RANGE * ST_ATTN_RANGE;
    int64_t c = cpu_keys < ks->ts ? cpu_keys : ks->ts;
    for (int64_t s = 0; s * ks->segk < c; s++) /* the host segments before the first one in the file */
        if (ks->loc[s] >= 0) c = s * ks->segk;
    ks->cpu = c > 0 ? c / ST_ATTN_RANGE * ST_ATTN_RANGE : 0;
    ks->np = ks->cpu >= ks->ts ? 0 : (ks->ts + ks->p.piece - 1) / ks->p.piece - ks->cpu / ks->p.piece;
    ks->next = ks->cur = 0;
    /* the ring's events from the previous pass are complete (its host sync) */
    const int64_t total = ks->np * ks->p.n_layers;
    for (; ks->next < 2 && ks->next < total; ks->next++) TRY(issue(ks, ks->next));
    return STRATA_OK;
}

int64_t st_kv_stream_tail_start(const st_kv_stream *ks) { return ks->ts; }
int64_t st_kv_stream_cpu_keys(const st_kv_stream *ks) { return ks->cpu; }

strata_status st_kv_stream_host_rows(st_kv_stream *ks, int64_t l, int64_t key, st_kv_layer *rows, int64_t *n) {
    if (l < 0 || l >= ks->p.n_layers || key < 0 || key >= ks->cpu)
        BAD("host rows of layer %lld from key %lld (the pass's CPU keys: %lld)", (long long)l, (long long)key,
            (long long)ks->cpu);
    const int64_t end = (key / ks->segk + 1) * ks->segk < ks->cpu ? (key / ks->segk + 1) * ks->segk : ks->cpu;
    void *pl[4] = {0};
    for (int p = 0; p < ks->np_; p++) pl[p] = host_row(ks, l, p, key);
    *rows = view(ks, pl, end - key);
    *n = end - key;
    return STRATA_OK;
}
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
    int64_t a, e;
    piece_keys(ks, k, &a, &e);
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

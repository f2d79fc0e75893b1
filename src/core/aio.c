/* core/aio: aligned reads and writes through io_uring, with a pread / pwrite
 * fallback (aio.h). */
#include "core/aio.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"

#ifdef STRATA_HAVE_URING
#include <liburing.h>
#endif

typedef struct {
    st_aio_req r;     /* the request as submitted */
    bool busy;
    bool finished;    /* result ready (pread / pwrite mode, injected failure) */
    uint64_t done;    /* bytes transferred so far */
    int err;          /* errno of a failed transfer, 0 */
} aio_ent;

struct st_aio {
    int depth;
    int inflight;     /* entries busy */
    aio_ent *ent;     /* [depth] */
    bool uring;
#ifdef STRATA_HAVE_URING
    struct io_uring ring;
#endif
};

strata_status st_aio_init(int depth, bool force_pread, const char *what, st_aio **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "aio queue: out is NULL");
    *out = NULL;
    if (!what) what = "file I/O";
    if (depth < 1) depth = 1;
    if (depth > 4096) depth = 4096;
    st_aio *q = st_calloc(1, sizeof *q);
    if (!q) return st_err(STRATA_ERR_NOMEM, "aio queue (%s): out of memory", what);
    q->ent = st_calloc((size_t)depth, sizeof *q->ent);
    if (!q->ent) {
        st_free(q);
        return st_err(STRATA_ERR_NOMEM, "aio queue (%s): out of memory", what);
    }
    q->depth = depth;
#ifdef STRATA_HAVE_URING
    if (!force_pread) {
        int e = io_uring_queue_init((unsigned)depth, &q->ring, 0);
        if (e == 0)
            q->uring = true;
        else
            st_log(STRATA_LOG_WARN, "io_uring unavailable (%s): %s use pread/pwrite, one request at a time",
                   strerror(-e), what);
    }
#else
    if (!force_pread)
        st_log(STRATA_LOG_WARN, "built without liburing: %s use pread/pwrite, one request at a time", what);
#endif
    *out = q;
    return STRATA_OK;
}

bool st_aio_uring(const st_aio *q) { return q->uring; }
int st_aio_inflight(const st_aio *q) { return q->inflight; }
int st_aio_depth(const st_aio *q) { return q->depth; }

/* The bytes that must be transferred for the request to succeed. */
static uint64_t want(const aio_ent *e) { return e->r.write ? e->r.len : e->r.need; }

static strata_status ent_error(const aio_ent *e) {
    const st_aio_req *r = &e->r;
    const char *op = r->write ? "write" : "read";
    if (e->err)
        return st_err(STRATA_ERR_IO, "%s of %s at offset %llu (%llu bytes) failed: %s", op, r->name,
                      (unsigned long long)r->off, (unsigned long long)r->len, strerror(e->err));
    if (r->write)
        return st_err(STRATA_ERR_IO, "short write of %s at offset %llu: %llu of %llu bytes went out", r->name,
                      (unsigned long long)r->off, (unsigned long long)e->done, (unsigned long long)r->len);
    return st_err(STRATA_ERR_IO,
                  "short read of %s at offset %llu: %llu of %llu bytes came back (the file ends early: "
                  "truncated or changed while in use?)",
                  r->name, (unsigned long long)r->off, (unsigned long long)e->done, (unsigned long long)r->need);
}

/* Whether a transfer that stopped at e->done may go on from there. */
static bool can_continue(const aio_ent *e) {
    return e->done < want(e) && (!e->r.direct || e->done % ST_AIO_ALIGN == 0);
}

/* pread / pwrite until the request is done (or an error, end of file, or a
 * position O_DIRECT cannot continue from). */
static void do_sync(aio_ent *e) {
    st_aio_req *r = &e->r;
    uint8_t *buf = r->buf;
    while (can_continue(e)) {
        const size_t n = (size_t)(r->len - e->done);
        const off_t at = (off_t)(r->off + e->done);
        ssize_t k = r->write ? pwrite(r->fd, buf + e->done, n, at) : pread(r->fd, buf + e->done, n, at);
        if (k < 0) {
            if (errno == EINTR) continue;
            e->err = errno;
            break;
        }
        if (k == 0) break;
        if (r->fail_short && !r->write) {
            e->done = (r->need / 2) / ST_AIO_ALIGN * ST_AIO_ALIGN;
            break;
        }
        e->done += (uint64_t)k;
    }
    e->finished = true;
}

#ifdef STRATA_HAVE_URING
/* Queues what is left of e (from e->done) on the ring; sets e->err on failure. */
static bool uring_queue(st_aio *q, aio_ent *e) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    if (!sqe) {
        int s = io_uring_submit(&q->ring); /* make room, then try once more */
        sqe = s >= 0 ? io_uring_get_sqe(&q->ring) : NULL;
        if (!sqe) {
            e->err = s < 0 ? -s : EAGAIN;
            return false;
        }
    }
    st_aio_req *r = &e->r;
    uint8_t *buf = (uint8_t *)r->buf + e->done;
    const unsigned n = (unsigned)(r->len - e->done);
    if (r->write)
        io_uring_prep_write(sqe, r->fd, buf, n, r->off + e->done);
    else
        io_uring_prep_read(sqe, r->fd, buf, n, r->off + e->done);
    io_uring_sqe_set_data(sqe, e);
    int s = io_uring_submit(&q->ring);
    if (s < 0) {
        e->err = -s;
        return false;
    }
    return true;
}
#endif

strata_status st_aio_submit(st_aio *q, const st_aio_req *r) {
    if (!q || !r) return st_err(STRATA_ERR_INVALID_ARG, "aio submit: NULL queue or request");
    const char *name = r->name ? r->name : "(unnamed file)";
    const char *op = r->write ? "write" : "read";
    if (r->len == 0 || r->len > ST_AIO_MAX_LEN || (!r->write && r->need > r->len) || !r->buf || r->fd < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "%s of %s: %llu bytes (need %llu), buffer %p, fd %d", op, name,
                      (unsigned long long)r->len, (unsigned long long)r->need, r->buf, r->fd);
    if (r->direct && (r->off % ST_AIO_ALIGN || r->len % ST_AIO_ALIGN || (uintptr_t)r->buf % ST_AIO_ALIGN))
        return st_err(STRATA_ERR_INVALID_ARG, "%s of %s: offset %llu, length %llu or buffer %p not aligned to %u", op,
                      name, (unsigned long long)r->off, (unsigned long long)r->len, r->buf, ST_AIO_ALIGN);
    aio_ent *e = NULL;
    for (int i = 0; i < q->depth && !e; i++)
        if (!q->ent[i].busy) e = &q->ent[i];
    if (!e) return st_err(STRATA_ERR_INTERNAL, "%s of %s: %d requests already in flight", op, name, q->depth);
    memset(e, 0, sizeof *e);
    e->r = *r;
    e->r.name = name;
    e->busy = true;
    q->inflight++;
    if (r->fail_errno) { /* injected failure: never reaches the file */
        e->err = r->fail_errno;
        e->finished = true;
        return STRATA_OK;
    }
#ifdef STRATA_HAVE_URING
    if (q->uring) {
        if (!uring_queue(q, e)) {
            strata_status st = ent_error(e);
            e->busy = false;
            q->inflight--;
            return st;
        }
        return STRATA_OK;
    }
#endif
    do_sync(e);
    return STRATA_OK;
}

/* Finishes e: frees its entry, returns its status. */
static strata_status finish(st_aio *q, aio_ent *e, st_aio_result *res) {
    res->tag = e->r.tag;
    res->err = e->err;
    res->done = e->done;
    strata_status st = (e->err || e->done < want(e)) ? ent_error(e) : STRATA_OK;
    e->busy = false;
    q->inflight--;
    return st;
}

strata_status st_aio_reap(st_aio *q, bool wait, bool *got, st_aio_result *res) {
    *got = false;
    memset(res, 0, sizeof *res);
    for (int i = 0; i < q->depth; i++) /* pread / pwrite results and injected failures first */
        if (q->ent[i].busy && q->ent[i].finished) {
            *got = true;
            return finish(q, &q->ent[i], res);
        }
#ifdef STRATA_HAVE_URING
    if (!q->uring) return STRATA_OK;
    for (;;) {
        if (q->inflight == 0) return STRATA_OK;
        struct io_uring_cqe *cqe = NULL;
        int e = wait ? io_uring_wait_cqe(&q->ring, &cqe) : io_uring_peek_cqe(&q->ring, &cqe);
        if (e == -EAGAIN || (!wait && e == -EINTR)) return STRATA_OK;
        if (e == -EINTR) continue;
        if (e < 0) return st_err(STRATA_ERR_IO, "io_uring wait failed: %s", strerror(-e));
        aio_ent *r = io_uring_cqe_get_data(cqe);
        const int k = cqe->res;
        io_uring_cqe_seen(&q->ring, cqe);
        ST_ASSERT(r && r->busy);
        if (k < 0) {
            if (k == -EAGAIN || k == -EINTR) { /* retry as it was */
                if (!uring_queue(q, r)) {
                    *got = true;
                    return finish(q, r, res);
                }
                continue;
            }
            r->err = -k;
        } else if (r->r.fail_short && !r->r.write) {
            r->done = (r->r.need / 2) / ST_AIO_ALIGN * ST_AIO_ALIGN;
        } else {
            r->done += (uint64_t)k;
            if (k > 0 && can_continue(r)) { /* a partial transfer: continue where it stopped */
                if (!uring_queue(q, r)) {
                    *got = true;
                    return finish(q, r, res);
                }
                continue;
            }
        }
        *got = true;
        return finish(q, r, res);
    }
#else
    (void)wait;
    return STRATA_OK;
#endif
}

void st_aio_free(st_aio *q) {
    if (!q) return;
    while (q->inflight > 0) {
        bool got = false;
        st_aio_result res;
        (void)st_aio_reap(q, true, &got, &res);
        if (!got) break;
    }
#ifdef STRATA_HAVE_URING
    if (q->uring) io_uring_queue_exit(&q->ring);
#endif
    st_free(q->ent);
    st_free(q);
}

/* weights/ssd: O_DIRECT reads through io_uring, with a pread fallback (ssd.h). */
#include "weights/ssd.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "weights/groups.h"

#ifdef STRATA_HAVE_URING
#include <liburing.h>
#endif

typedef struct {
    int fd;
    bool direct;
    const char *path; /* borrowed from the model files */
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
} ssd_file;

struct st_ssd_files {
    ssd_file *f;
    int n;
    st_ssd_faults faults;
    atomic_llong reads;
};

static strata_status file_identity(const char *path, int fd, struct stat *sb) {
    if (fstat(fd, sb) != 0) return st_err(STRATA_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    return STRATA_OK;
}

strata_status st_ssd_files_open(const st_model_files *m, bool direct, const st_ssd_faults *faults,
                                st_ssd_files **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "ssd files: out is NULL");
    *out = NULL;
    st_ssd_files *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "ssd files: out of memory");
    s->f = st_calloc((size_t)(m->n_files > 0 ? m->n_files : 1), sizeof *s->f);
    if (!s->f) {
        st_free(s);
        return st_err(STRATA_ERR_NOMEM, "ssd files: out of memory");
    }
    if (faults) s->faults = *faults;
    atomic_init(&s->reads, 0);
    strata_status st = STRATA_OK;
    for (int i = 0; i < m->n_files; i++) {
        ssd_file *f = &s->f[i];
        const st_mapped_file *mf = &m->files[i];
        f->path = mf->path;
        f->fd = -1;
        int fd = -1;
        if (direct) {
            fd = open(mf->path, O_RDONLY | O_CLOEXEC | O_DIRECT);
            if (fd < 0 && errno == EINVAL)
                st_log(STRATA_LOG_WARN, "%s: the file system refuses O_DIRECT; weights are read through the page cache",
                       mf->path);
            else if (fd >= 0)
                f->direct = true;
        }
        if (fd < 0) fd = open(mf->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            st = st_err(STRATA_ERR_IO, "%s: cannot open for reading: %s", mf->path, strerror(errno));
            s->n = i;
            goto fail;
        }
        f->fd = fd;
        s->n = i + 1;
        struct stat now, mapped;
        if ((st = file_identity(mf->path, fd, &now))) goto fail;
        if (mf->fd >= 0 && (st = file_identity(mf->path, mf->fd, &mapped))) goto fail;
        if ((uint64_t)now.st_size != mf->size || (mf->fd >= 0 && (now.st_ino != mapped.st_ino ||
                                                                  now.st_dev != mapped.st_dev))) {
            st = st_err(STRATA_ERR_IO, "%s: the file changed since it was loaded (%llu bytes then, %llu now%s)",
                        mf->path, (unsigned long long)mf->size, (unsigned long long)now.st_size,
                        mf->fd >= 0 && now.st_ino != mapped.st_ino ? ", another inode" : "");
            goto fail;
        }
        f->dev = now.st_dev;
        f->ino = now.st_ino;
        f->size = now.st_size;
        f->mtime = now.st_mtim;
    }
    *out = s;
    return STRATA_OK;
fail:
    st_ssd_files_close(s);
    return st;
}

void st_ssd_files_close(st_ssd_files *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++)
        if (s->f[i].fd >= 0) close(s->f[i].fd);
    st_free(s->f);
    st_free(s);
}

strata_status st_ssd_files_check(st_ssd_files *s) {
    for (int i = 0; i < s->n; i++) {
        const ssd_file *f = &s->f[i];
        struct stat now;
        strata_status st = file_identity(f->path, f->fd, &now);
        if (st) return st;
        if (now.st_size != f->size || now.st_mtim.tv_sec != f->mtime.tv_sec ||
            now.st_mtim.tv_nsec != f->mtime.tv_nsec)
            return st_err(STRATA_ERR_IO,
                          "%s: the model file changed while in use (size %lld -> %lld bytes, mtime %lld.%09ld -> "
                          "%lld.%09ld); reload the model",
                          f->path, (long long)f->size, (long long)now.st_size, (long long)f->mtime.tv_sec,
                          f->mtime.tv_nsec, (long long)now.st_mtim.tv_sec, now.st_mtim.tv_nsec);
    }
    return STRATA_OK;
}

bool st_ssd_files_direct(const st_ssd_files *s) {
    for (int i = 0; i < s->n; i++)
        if (!s->f[i].direct) return false;
    return s->n > 0;
}

int64_t st_ssd_files_reads(const st_ssd_files *s) { return atomic_load(&s->reads); }

/* ---- queue ---- */

typedef struct {
    bool busy;
    bool inject_short;
    int file;
    uint64_t off, len, need, done;
    uint8_t *dst;
    uint64_t tag;
    int err;          /* errno of a failed read, 0 */
    bool finished;    /* result ready (pread mode, injected failure) */
} ssd_req;

struct st_ssd_queue {
    st_ssd_files *files;
    int depth;
    int inflight;    /* requests busy */
    ssd_req *req;    /* [depth] */
    bool uring;
#ifdef STRATA_HAVE_URING
    struct io_uring ring;
#endif
};

strata_status st_ssd_queue_init(st_ssd_files *f, int depth, bool force_pread, st_ssd_queue **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "ssd queue: out is NULL");
    *out = NULL;
    if (depth < 1) depth = 1;
    if (depth > 4096) depth = 4096;
    st_ssd_queue *q = st_calloc(1, sizeof *q);
    if (!q) return st_err(STRATA_ERR_NOMEM, "ssd queue: out of memory");
    q->req = st_calloc((size_t)depth, sizeof *q->req);
    if (!q->req) {
        st_free(q);
        return st_err(STRATA_ERR_NOMEM, "ssd queue: out of memory");
    }
    q->files = f;
    q->depth = depth;
#ifdef STRATA_HAVE_URING
    if (!force_pread) {
        int e = io_uring_queue_init((unsigned)depth, &q->ring, 0);
        if (e == 0)
            q->uring = true;
        else
            st_log(STRATA_LOG_WARN, "io_uring unavailable (%s): weights are read with pread, one request at a time",
                   strerror(-e));
    }
#else
    if (!force_pread)
        st_log(STRATA_LOG_WARN, "built without liburing: weights are read with pread, one request at a time");
#endif
    *out = q;
    return STRATA_OK;
}

bool st_ssd_queue_uring(const st_ssd_queue *q) { return q->uring; }
int st_ssd_queue_inflight(const st_ssd_queue *q) { return q->inflight; }
int st_ssd_queue_depth(const st_ssd_queue *q) { return q->depth; }

static strata_status req_error(st_ssd_queue *q, ssd_req *r) {
    const char *path = q->files->f[r->file].path;
    if (r->err)
        return st_err(STRATA_ERR_IO, "read of %s at offset %llu (%llu bytes) failed: %s", path,
                      (unsigned long long)r->off, (unsigned long long)r->len, strerror(r->err));
    return st_err(STRATA_ERR_IO,
                  "short read of %s at offset %llu: %llu of %llu bytes came back (the file ends early: "
                  "truncated or changed while in use?)",
                  path, (unsigned long long)r->off, (unsigned long long)r->done, (unsigned long long)r->need);
}

/* pread until `need` bytes are in (or an error / end of file). */
static void do_pread(st_ssd_queue *q, ssd_req *r) {
    const int fd = q->files->f[r->file].fd;
    while (r->done < r->need) {
        ssize_t k = pread(fd, r->dst + r->done, (size_t)(r->len - r->done), (off_t)(r->off + r->done));
        if (k < 0) {
            if (errno == EINTR) continue;
            r->err = errno;
            break;
        }
        if (k == 0) break;
        if (r->inject_short) {
            r->done = (r->need / 2) / ST_WG_ALIGN * ST_WG_ALIGN;
            break;
        }
        r->done += (uint64_t)k;
    }
    r->finished = true;
}

#ifdef STRATA_HAVE_URING
static strata_status uring_queue(st_ssd_queue *q, ssd_req *r) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    if (!sqe) return st_err(STRATA_ERR_INTERNAL, "io_uring: no submission entry free");
    io_uring_prep_read(sqe, q->files->f[r->file].fd, r->dst + r->done, (unsigned)(r->len - r->done),
                       r->off + r->done);
    io_uring_sqe_set_data(sqe, r);
    int e = io_uring_submit(&q->ring);
    if (e < 0) {
        r->err = -e;
        return req_error(q, r);
    }
    return STRATA_OK;
}
#endif

strata_status st_ssd_submit(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                            uint64_t tag) {
    if (file < 0 || file >= q->files->n)
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read: file %d of %d", file, q->files->n);
    if (len == 0 || len > ((uint64_t)1 << 30) || need > len || !dst)
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read: %llu bytes (need %llu) of %s", (unsigned long long)len,
                      (unsigned long long)need, q->files->f[file].path);
    if (q->files->f[file].direct &&
        (off % ST_WG_ALIGN || len % ST_WG_ALIGN || (uintptr_t)dst % ST_WG_ALIGN))
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read of %s: offset %llu, length %llu or buffer %p not aligned to %u",
                      q->files->f[file].path, (unsigned long long)off, (unsigned long long)len, dst, ST_WG_ALIGN);
    ssd_req *r = NULL;
    for (int i = 0; i < q->depth && !r; i++)
        if (!q->req[i].busy) r = &q->req[i];
    if (!r) return st_err(STRATA_ERR_INTERNAL, "ssd read: %d reads already in flight", q->depth);
    memset(r, 0, sizeof *r);
    r->busy = true;
    r->file = file;
    r->off = off;
    r->len = len;
    r->need = need;
    r->dst = dst;
    r->tag = tag;
    q->inflight++;
    const long long nth = atomic_fetch_add(&q->files->reads, 1) + 1;
    if (q->files->faults.fail_nth == nth) { /* injected I/O error: never reaches the disk */
        r->err = EIO;
        r->finished = true;
        return STRATA_OK;
    }
    r->inject_short = q->files->faults.short_nth == nth;
#ifdef STRATA_HAVE_URING
    if (q->uring) {
        strata_status st = uring_queue(q, r);
        if (st != STRATA_OK) {
            r->busy = false;
            q->inflight--;
        }
        return st;
    }
#endif
    do_pread(q, r);
    return STRATA_OK;
}

/* Finishes r: frees its entry, returns its status. */
static strata_status finish(st_ssd_queue *q, ssd_req *r, uint64_t *tag) {
    *tag = r->tag;
    strata_status st = (r->err || r->done < r->need) ? req_error(q, r) : STRATA_OK;
    r->busy = false;
    q->inflight--;
    return st;
}

strata_status st_ssd_reap(st_ssd_queue *q, bool wait, bool *got, uint64_t *tag) {
    *got = false;
    *tag = 0;
    for (int i = 0; i < q->depth; i++) /* pread results and injected failures first */
        if (q->req[i].busy && q->req[i].finished) {
            *got = true;
            return finish(q, &q->req[i], tag);
        }
#ifdef STRATA_HAVE_URING
    if (!q->uring) return STRATA_OK;
    for (;;) {
        bool any = false;
        for (int i = 0; i < q->depth; i++) any = any || q->req[i].busy;
        if (!any) return STRATA_OK;
        struct io_uring_cqe *cqe = NULL;
        int e = wait ? io_uring_wait_cqe(&q->ring, &cqe) : io_uring_peek_cqe(&q->ring, &cqe);
        if (e == -EAGAIN || (!wait && e == -EINTR)) return STRATA_OK;
        if (e == -EINTR) continue;
        if (e < 0) return st_err(STRATA_ERR_IO, "io_uring wait failed: %s", strerror(-e));
        ssd_req *r = io_uring_cqe_get_data(cqe);
        const int res = cqe->res;
        io_uring_cqe_seen(&q->ring, cqe);
        ST_ASSERT(r && r->busy);
        if (res < 0) {
            if (res == -EAGAIN || res == -EINTR) { /* retry as it was */
                strata_status st = uring_queue(q, r);
                if (st) {
                    *got = true;
                    finish(q, r, tag);
                    return st;
                }
                continue;
            }
            r->err = -res;
        } else if (r->inject_short) {
            r->done = (r->need / 2) / ST_WG_ALIGN * ST_WG_ALIGN;
        } else {
            r->done += (uint64_t)res;
            const bool direct = q->files->f[r->file].direct;
            if (res > 0 && r->done < r->need && (!direct || r->done % ST_WG_ALIGN == 0)) {
                strata_status st = uring_queue(q, r); /* a partial read: continue where it stopped */
                if (st) {
                    *got = true;
                    finish(q, r, tag);
                    return st;
                }
                continue;
            }
        }
        *got = true;
        return finish(q, r, tag);
    }
#else
    (void)wait;
    return STRATA_OK;
#endif
}

void st_ssd_queue_free(st_ssd_queue *q) {
    if (!q) return;
    while (q->inflight > 0) {
        bool got = false;
        uint64_t tag;
        (void)st_ssd_reap(q, true, &got, &tag);
        if (!got) break;
    }
#ifdef STRATA_HAVE_URING
    if (q->uring) io_uring_queue_exit(&q->ring);
#endif
    st_free(q->req);
    st_free(q);
}

strata_status st_ssd_read(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                          uint64_t piece) {
    if (piece == 0 || piece % ST_WG_ALIGN) piece = (uint64_t)8 << 20;
    strata_status first = STRATA_OK;
    char msg[1024] = "";
    uint64_t pos = 0;
    for (;;) {
        while (first == STRATA_OK && pos < len && q->inflight < q->depth) {
            const uint64_t k = len - pos < piece ? len - pos : piece;
            const uint64_t nd = need > pos ? (need - pos < k ? need - pos : k) : 0;
            strata_status st = st_ssd_submit(q, file, off + pos, k, nd, (uint8_t *)dst + pos, pos);
            if (st) {
                first = st;
                snprintf(msg, sizeof msg, "%s", st_last_error());
                break;
            }
            pos += k;
        }
        if (q->inflight == 0 && (first != STRATA_OK || pos >= len)) break;
        bool got = false;
        uint64_t tag;
        strata_status st = st_ssd_reap(q, true, &got, &tag);
        if (st != STRATA_OK && first == STRATA_OK) { /* keep the first failure's message */
            first = st;
            snprintf(msg, sizeof msg, "%s", st_last_error());
        }
        if (!got && q->inflight == 0) break;
    }
    if (first != STRATA_OK) return st_err(first, "%s", msg);
    return STRATA_OK;
}

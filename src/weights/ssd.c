/* weights/ssd: the model files opened for O_DIRECT reads, and a read queue
 * over core/aio with the files' fault injection (ssd.h). */
#include "weights/ssd.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/aio.h"
#include "weights/groups.h"

_Static_assert(ST_WG_ALIGN == ST_AIO_ALIGN, "the weight groups' alignment is the aio queue's");

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
    if (!s) return st_err(STRATA_ERR_NOMEM, "ssd files: out of memory for its state (%zu bytes)", sizeof *s);
    s->f = st_calloc((size_t)(m->n_files > 0 ? m->n_files : 1), sizeof *s->f);
    if (!s->f) {
        st_free(s);
        return st_err(STRATA_ERR_NOMEM, "ssd files: out of memory for %d file entries", (int)m->n_files);
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

/* ---- queue: core/aio with the files' identity and fault counter ---- */

/* A read held back by the slow-read fault: issued to the aio queue at `due`. */
typedef struct {
    st_aio_req r;
    double due; /* st_time_now() seconds */
} deferred_read;

struct st_ssd_queue {
    st_ssd_files *files;
    st_aio *aio;
    deferred_read *def; /* [depth] FIFO ring of slow reads not yet issued (faults.delay_ms) */
    int def_head, n_def;
};

strata_status st_ssd_queue_init(st_ssd_files *f, int depth, bool force_pread, st_ssd_queue **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "ssd queue: out is NULL");
    *out = NULL;
    st_ssd_queue *q = st_calloc(1, sizeof *q);
    if (!q) return st_err(STRATA_ERR_NOMEM, "ssd queue: out of memory for its state (%zu bytes)", sizeof *q);
    strata_status st = st_aio_init(depth, force_pread, "weights", &q->aio);
    if (st) {
        st_free(q);
        return st;
    }
    q->files = f;
    if (f->faults.delay_ms > 0 && !(q->def = st_calloc((size_t)st_aio_depth(q->aio), sizeof *q->def))) {
        st_ssd_queue_free(q);
        return st_err(STRATA_ERR_NOMEM, "ssd queue: out of memory for %d delayed reads", st_aio_depth(q->aio));
    }
    *out = q;
    return STRATA_OK;
}

bool st_ssd_queue_uring(const st_ssd_queue *q) { return st_aio_uring(q->aio); }
int st_ssd_queue_inflight(const st_ssd_queue *q) { return st_aio_inflight(q->aio) + q->n_def; }
int st_ssd_queue_depth(const st_ssd_queue *q) { return st_aio_depth(q->aio); }

strata_status st_ssd_submit(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                            uint64_t tag) {
    if (file < 0 || file >= q->files->n)
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read: file %d of %d", file, q->files->n);
    const ssd_file *f = &q->files->f[file];
    if (len == 0 || len > ((uint64_t)1 << 30) || need > len || !dst)
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read: %llu bytes (need %llu) of %s", (unsigned long long)len,
                      (unsigned long long)need, f->path);
    if (f->direct && (off % ST_WG_ALIGN || len % ST_WG_ALIGN || (uintptr_t)dst % ST_WG_ALIGN))
        return st_err(STRATA_ERR_INVALID_ARG, "ssd read of %s: offset %llu, length %llu or buffer %p not aligned to %u",
                      f->path, (unsigned long long)off, (unsigned long long)len, dst, ST_WG_ALIGN);
    if (st_ssd_queue_inflight(q) >= st_aio_depth(q->aio))
        return st_err(STRATA_ERR_INTERNAL, "ssd read: %d reads already in flight", st_aio_depth(q->aio));
    const long long nth = atomic_fetch_add(&q->files->reads, 1) + 1;
    const st_aio_req r = {
        .fd = f->fd,
        .name = f->path,
        .direct = f->direct,
        .off = off,
        .len = len,
        .need = need,
        .buf = dst,
        .tag = tag,
        .fail_errno = q->files->faults.fail_nth == nth ? EIO : 0, /* injected I/O error: never reaches the disk */
        .fail_short = q->files->faults.short_nth == nth,
    };
    if (q->def) { /* slow reads: the buffer holds poison until the read is issued, delay_ms from now */
        memset(dst, 0xA5, len);
        const int depth = st_aio_depth(q->aio);
        q->def[(q->def_head + q->n_def) % depth] =
            (deferred_read){.r = r, .due = st_time_now() + q->files->faults.delay_ms * 1e-3};
        q->n_def++;
        return STRATA_OK;
    }
    return st_aio_submit(q->aio, &r);
}

/* Issues the oldest held-back read (slow-read fault), after sleeping until it
 * is due when `wait`; false when it is not due yet (and !wait). */
static bool issue_deferred(st_ssd_queue *q, bool wait, strata_status *st) {
    deferred_read *d = &q->def[q->def_head];
    const double left = d->due - st_time_now();
    if (left > 0) {
        if (!wait) return false;
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    const st_aio_req r = d->r;
    q->def_head = (q->def_head + 1) % st_aio_depth(q->aio);
    q->n_def--;
    *st = st_aio_submit(q->aio, &r);
    return true;
}

strata_status st_ssd_reap(st_ssd_queue *q, bool wait, bool *got, uint64_t *tag) {
    st_aio_result res = {0};
    *got = false;
    *tag = 0;
    strata_status st = STRATA_OK;
    /* slow reads: issue those that are due; with nothing else in flight, wait for the next one */
    while (q->n_def > 0 && (st_aio_inflight(q->aio) == 0 || q->def[q->def_head].due <= st_time_now()))
        if (!issue_deferred(q, wait, &st) || st != STRATA_OK) break;
    if (st != STRATA_OK) return st;
    st = st_aio_reap(q->aio, wait, got, &res);
    *tag = res.tag;
    return st;
}

void st_ssd_queue_free(st_ssd_queue *q) {
    if (!q) return;
    st_aio_free(q->aio); /* waits for reads in flight (held-back slow reads are dropped) */
    st_free(q->def);
    st_free(q);
}

strata_status st_ssd_read(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                          uint64_t piece) {
    if (piece == 0 || piece % ST_WG_ALIGN) piece = (uint64_t)8 << 20;
    strata_status first = STRATA_OK;
    char msg[1024] = "";
    uint64_t pos = 0;
    for (;;) {
        while (first == STRATA_OK && pos < len && st_ssd_queue_inflight(q) < st_ssd_queue_depth(q)) {
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
        if (st_ssd_queue_inflight(q) == 0 && (first != STRATA_OK || pos >= len)) break;
        bool got = false;
        uint64_t tag;
        strata_status st = st_ssd_reap(q, true, &got, &tag);
        if (st != STRATA_OK && first == STRATA_OK) { /* keep the first failure's message */
            first = st;
            snprintf(msg, sizeof msg, "%s", st_last_error());
        }
        if (!got && st_ssd_queue_inflight(q) == 0) break;
    }
    if (first != STRATA_OK) return st_err(first, "%s", msg);
    return STRATA_OK;
}

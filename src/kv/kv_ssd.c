/* kv/kv_ssd: the KV cache's SSD tier as a file of fixed-size slots (kv_ssd.h). */
#include "kv/kv_ssd.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <xxhash.h>

#include "core/aio.h"

#define KV_MAGIC 0x544f4c53564b5453ull /* "STKVSLOT" little-endian */
#define KV_VERSION 1u
#define HDR ST_KV_SSD_HEADER_BYTES
#define READ_DEPTH 64                  /* requests in flight on the read queue */

/* The slot header; the rest of its 4096 bytes is zero. */
typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    uint64_t identity;
    int64_t slot;
    uint64_t hash;
    uint64_t parent_hash;
    uint64_t payload_bytes;
    int64_t n_tokens;
    uint64_t payload_sum;  /* XXH3_64bits of the payload_bytes payload bytes */
    uint64_t header_sum;   /* XXH3_64bits of the 4096 header bytes with this field 0 */
    int32_t tokens[];      /* n_tokens */
} kv_hdr;
_Static_assert(sizeof(kv_hdr) == 80, "the header's fixed part is what ST_KV_SSD_MAX_TOKENS assumes");
_Static_assert(ST_KV_SSD_HEADER_BYTES == ST_AIO_ALIGN, "a header is one aligned block");

typedef enum { J_FREE = 0, J_QUEUED, J_RUNNING, J_DONE } job_state;

typedef struct {
    job_state state;       /* under mu */
    uint64_t seq;          /* order of st_kv_ssd_write calls */
    int64_t slot;
    const uint8_t *payload;
    uint8_t *hdr;          /* HDR bytes, aligned: the header to write */
    bool inject;           /* tests: fails with ENOSPC without reaching the file */
    /* writer thread only */
    int pending;           /* aio requests not reaped */
    bool failed;
    int err;               /* errno of the first failure (0: short or submit failure) */
    char msg[256];         /* its message */
    /* under mu, from J_DONE */
    bool ok;
} kv_job;

struct st_kv_ssd {
    st_kv_ssd_params p;
    char *dir;
    char *path;             /* the .blocks file */
    int fd;
    bool direct;
    int64_t slots;
    uint64_t alloc;         /* payload rounded up to 4096 */
    uint64_t slot_bytes;

    /* writes */
    pthread_mutex_t mu;
    pthread_cond_t work;    /* writer: jobs queued, or stop */
    pthread_cond_t idle;    /* flush: a job finished */
    kv_job *jobs;           /* [max_writes] */
    int max_writes;
    int n_queued;           /* J_QUEUED */
    int n_active;           /* J_QUEUED + J_RUNNING */
    uint64_t next_seq;
    int64_t n_submitted;    /* writes accepted (fault counter) */
    bool stop;
    bool thread_started;
    pthread_t writer;
    int *take;              /* writer thread: jobs taken in one round */
    st_aio *waio;           /* the writer thread's queue */
    void *whdr_raw;         /* job headers, one aligned block each */
    int warned_errno[16];   /* writer thread: kinds of failure warned about already */
    int n_warned;
    bool warned_short;

    /* reads and scans */
    pthread_mutex_t rmu;
    st_aio *raio;
    void *rhdr_raw;
    uint8_t *rhdr;          /* READ_DEPTH aligned headers */

    _Atomic uint64_t bytes_written, bytes_read;
    _Atomic int64_t writes, write_failures, reads, read_failures;
};

static uint8_t *align_up_ptr(void *p) {
    return (uint8_t *)(((uintptr_t)p + ST_AIO_ALIGN - 1) / ST_AIO_ALIGN * ST_AIO_ALIGN);
}

/* ---- headers ---- */

static uint64_t header_sum(const uint8_t *h) {
    uint8_t copy[HDR];
    memcpy(copy, h, HDR);
    memset(copy + offsetof(kv_hdr, header_sum), 0, sizeof(uint64_t));
    return XXH3_64bits(copy, HDR);
}

/* NULL when the header at h is a valid block of this store in `slot`, else why not. */
static const char *header_invalid(const st_kv_ssd *s, const uint8_t *h, int64_t slot) {
    kv_hdr k;
    memcpy(&k, h, sizeof k);
    if (k.magic != KV_MAGIC) return "no block header (magic)";
    if (k.version != KV_VERSION || k.header_bytes != HDR) return "another header version";
    if (k.identity != s->p.identity) return "another identity";
    if (k.payload_bytes != s->p.payload_bytes || k.n_tokens != s->p.block_tokens) return "another block geometry";
    if (k.slot != slot) return "the header names another slot";
    if (k.header_sum != header_sum(h)) return "header checksum mismatch";
    return NULL;
}

/* ---- writer thread ---- */

static void job_failed(kv_job *j, int err, const char *msg) {
    if (j->failed) return;
    j->failed = true;
    j->err = err;
    snprintf(j->msg, sizeof j->msg, "%s", msg);
}

/* Warns about j's failure unless a failure of its kind was warned about already. */
static void warn_once(st_kv_ssd *s, const kv_job *j) {
    if (j->err == 0) {
        if (s->warned_short) return;
        s->warned_short = true;
    } else {
        for (int i = 0; i < s->n_warned; i++)
            if (s->warned_errno[i] == j->err) return;
        if (s->n_warned < (int)(sizeof s->warned_errno / sizeof s->warned_errno[0]))
            s->warned_errno[s->n_warned++] = j->err;
    }
    const bool full = j->err == ENOSPC || j->err == EFBIG || j->err == EDQUOT;
    st_log(STRATA_LOG_WARN, "KV cache on SSD: writing the block of slot %" PRId64 " failed: %s%s; blocks whose "
           "writes fail so are not cached (said once per kind of failure)",
           j->slot, j->msg, full ? " (the disk or the file size limit is full)" : "");
}

static void job_done(st_kv_ssd *s, kv_job *j) {
    if (j->failed) {
        atomic_fetch_add(&s->write_failures, 1);
        warn_once(s, j);
    } else {
        atomic_fetch_add(&s->bytes_written, s->slot_bytes);
    }
    atomic_fetch_add(&s->writes, 1);
    pthread_mutex_lock(&s->mu);
    j->ok = !j->failed;
    j->state = J_DONE;
    s->n_active--;
    pthread_cond_broadcast(&s->idle);
    pthread_mutex_unlock(&s->mu);
}

/* Checksums j's header and submits its two writes (tags 2 * index + 0 / 1). */
static void job_start(st_kv_ssd *s, int ji) {
    kv_job *j = &s->jobs[ji];
    j->pending = 0;
    j->failed = false;
    j->err = 0;
    j->msg[0] = 0;
    kv_hdr *h = (kv_hdr *)j->hdr;
    h->payload_sum = XXH3_64bits(j->payload, s->p.payload_bytes);
    h->header_sum = header_sum(j->hdr);
    const uint64_t off = (uint64_t)j->slot * s->slot_bytes;
    const st_aio_req parts[2] = {
        {.fd = s->fd, .name = s->path, .write = true, .direct = s->direct, .off = off, .len = HDR,
         .buf = j->hdr, .tag = (uint64_t)ji * 2, .fail_errno = j->inject ? ENOSPC : 0},
        {.fd = s->fd, .name = s->path, .write = true, .direct = s->direct, .off = off + HDR, .len = s->alloc,
         .buf = (void *)j->payload, .tag = (uint64_t)ji * 2 + 1, .fail_errno = j->inject ? ENOSPC : 0},
    };
    for (int k = 0; k < 2; k++) {
        if (st_aio_submit(s->waio, &parts[k]) == STRATA_OK)
            j->pending++;
        else
            job_failed(j, EIO, st_last_error());
    }
    if (j->pending == 0) job_done(s, j);
}

/* Takes finished writes: blocks for the first one when `wait`. */
static void writer_reap(st_kv_ssd *s, bool wait) {
    for (;;) {
        bool got = false;
        st_aio_result res;
        strata_status st = st_aio_reap(s->waio, wait, &got, &res);
        if (!got) {
            if (st != STRATA_OK && wait) { /* the ring itself failed: fail everything in flight */
                char msg[256];
                snprintf(msg, sizeof msg, "%s", st_last_error());
                for (int i = 0; i < s->max_writes; i++)
                    if (s->jobs[i].pending > 0) {
                        s->jobs[i].pending = 0;
                        job_failed(&s->jobs[i], EIO, msg);
                        job_done(s, &s->jobs[i]);
                    }
            }
            return;
        }
        wait = false;
        kv_job *j = &s->jobs[res.tag / 2];
        ST_ASSERT(j->pending > 0);
        if (st != STRATA_OK) job_failed(j, res.err, st_last_error());
        if (--j->pending == 0) job_done(s, j);
    }
}

static void *writer_main(void *arg) {
    st_kv_ssd *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && s->n_queued == 0 && st_aio_inflight(s->waio) == 0) pthread_cond_wait(&s->work, &s->mu);
        if (s->n_queued == 0 && st_aio_inflight(s->waio) == 0) { /* stopped, nothing left */
            pthread_mutex_unlock(&s->mu);
            break;
        }
        int nt = 0;
        for (uint64_t lo = 0;;) { /* take the queued jobs, oldest first */
            int best = -1;
            for (int i = 0; i < s->max_writes; i++)
                if (s->jobs[i].state == J_QUEUED && s->jobs[i].seq >= lo &&
                    (best < 0 || s->jobs[i].seq < s->jobs[best].seq))
                    best = i;
            if (best < 0) break;
            s->jobs[best].state = J_RUNNING;
            lo = s->jobs[best].seq + 1;
            s->take[nt++] = best;
        }
        s->n_queued -= nt;
        pthread_mutex_unlock(&s->mu);
        for (int k = 0; k < nt; k++) job_start(s, s->take[k]);
        if (st_aio_inflight(s->waio) > 0) writer_reap(s, true);
    }
    return NULL;
}

/* ---- open / close ---- */

/* How many strata-kv-*.blocks files in dir are not `own`. */
static int other_files(const char *dir, const char *own) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    const size_t pre = strlen("strata-kv-"), suf = strlen(".blocks");
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        const size_t len = strlen(e->d_name);
        if (len > pre + suf && !strncmp(e->d_name, "strata-kv-", pre) && !strcmp(e->d_name + len - suf, ".blocks") &&
            strcmp(e->d_name, own) != 0)
            n++;
    }
    closedir(d);
    return n;
}

/* Writes identity_text beside the file; a failure is only warned about. */
static void write_identity_text(const st_kv_ssd *s) {
    if (!s->p.identity_text) return;
    char path[4200];
    snprintf(path, sizeof path, "%s/strata-kv-%016" PRIx64 ".txt", s->dir, s->p.identity);
    FILE *f = fopen(path, "w");
    bool ok = f && fprintf(f, "%s\n", s->p.identity_text) >= 0;
    if (f && fclose(f) != 0) ok = false;
    if (!ok) st_log(STRATA_LOG_WARN, "KV cache on SSD: cannot write %s: %s", path, strerror(errno));
}

static void *aligned_alloc_raw(size_t n, void **raw) {
    *raw = st_calloc(1, n + ST_AIO_ALIGN);
    return *raw ? align_up_ptr(*raw) : NULL;
}

strata_status st_kv_ssd_open(const st_kv_ssd_params *p, st_kv_ssd **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: out is NULL");
    *out = NULL;
    if (!p || !p->dir || !p->dir[0])
        return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: no directory given (params or dir NULL or empty)");
    if (p->payload_bytes == 0 || p->payload_bytes > ST_AIO_MAX_LEN)
        return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: payload_bytes %" PRIu64 " out of range (1 .. %u)",
                      p->payload_bytes, ST_AIO_MAX_LEN);
    if (p->block_tokens < 1 || p->block_tokens > ST_KV_SSD_MAX_TOKENS)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "KV cache on SSD: block_tokens %" PRId64 " does not fit the %u-byte slot header (1 .. %" PRId64
                      " token ids)",
                      p->block_tokens, HDR, ST_KV_SSD_MAX_TOKENS);
    if (p->max_writes < 0 || p->max_writes > 1024)
        return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: max_writes %d out of range (0: %d, else 1 .. 1024)",
                      p->max_writes, ST_KV_SSD_MAX_WRITES);
    const uint64_t alloc = (p->payload_bytes + ST_AIO_ALIGN - 1) / ST_AIO_ALIGN * ST_AIO_ALIGN;
    const uint64_t slot_bytes = HDR + alloc;
    if (p->max_bytes < slot_bytes)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "--kv-ssd-size of %" PRIu64 " bytes holds no KV block: the minimum is %" PRIu64
                      " bytes (one slot: a %u-byte header + %" PRIu64 " bytes of payload)",
                      p->max_bytes, slot_bytes, HDR, alloc);
    if (mkdir(p->dir, 0755) != 0 && errno != EEXIST)
        return st_err(STRATA_ERR_IO, "KV cache on SSD: cannot create the directory %s: %s", p->dir, strerror(errno));
    struct stat sb;
    if (stat(p->dir, &sb) != 0)
        return st_err(STRATA_ERR_IO, "KV cache on SSD: cannot stat the directory %s: %s", p->dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return st_err(STRATA_ERR_IO, "KV cache on SSD: %s exists and is not a directory", p->dir);

    st_kv_ssd *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "KV cache on SSD: out of memory for its state (%zu bytes)", sizeof *s);
    s->p = *p;
    s->p.identity_text = NULL; /* borrowed only during open */
    s->fd = -1;
    s->alloc = alloc;
    s->slot_bytes = slot_bytes;
    s->max_writes = p->max_writes ? p->max_writes : ST_KV_SSD_MAX_WRITES;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->rmu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->idle, NULL);
    strata_status st = STRATA_OK;
    char name[64];
    snprintf(name, sizeof name, "strata-kv-%016" PRIx64 ".blocks", p->identity);
    const size_t plen = strlen(p->dir) + 1 + strlen(name) + 1;
    s->dir = st_strdup(p->dir);
    s->path = st_malloc(plen);
    s->jobs = st_calloc((size_t)s->max_writes, sizeof *s->jobs);
    s->take = st_calloc((size_t)s->max_writes, sizeof *s->take);
    uint8_t *whdr = aligned_alloc_raw((size_t)s->max_writes * HDR, &s->whdr_raw);
    s->rhdr = aligned_alloc_raw((size_t)READ_DEPTH * HDR, &s->rhdr_raw);
    if (!s->dir || !s->path || !s->jobs || !s->take || !whdr || !s->rhdr) {
        st = st_err(STRATA_ERR_NOMEM, "KV cache on SSD: out of memory for the paths, %d write jobs and the block "
                    "headers (%zu bytes)", (int)s->max_writes,
                    2 * plen + (size_t)s->max_writes * (sizeof *s->jobs + sizeof *s->take + HDR) +
                        (size_t)READ_DEPTH * HDR);
        goto fail;
    }
    snprintf(s->path, plen, "%s/%s", p->dir, name);
    for (int i = 0; i < s->max_writes; i++) s->jobs[i].hdr = whdr + (size_t)i * HDR;

    const int others = other_files(p->dir, name);
    if (others > 0)
        st_log(STRATA_LOG_WARN,
               "KV cache on SSD: %s holds %d strata-kv-*.blocks file%s of other model identities: ignored, left as "
               "they are",
               p->dir, others, others == 1 ? "" : "s");

    int fd = open(s->path, O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
    if (fd >= 0) s->direct = true;
    else if (errno == EINVAL) fd = open(s->path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = st_err(STRATA_ERR_IO, "KV cache on SSD: cannot open %s for reading and writing: %s", s->path,
                    strerror(errno));
        goto fail;
    }
    s->fd = fd;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        st = st_err(STRATA_ERR_IO, "KV cache on SSD: %s is %s", s->path,
                    errno == EWOULDBLOCK ? "in use by another KV cache store (locked): give each server its own "
                                           "directory"
                                         : strerror(errno));
        goto fail;
    }
    struct stat fs;
    if (fstat(fd, &fs) != 0) {
        st = st_err(STRATA_ERR_IO, "KV cache on SSD: cannot stat %s: %s", s->path, strerror(errno));
        goto fail;
    }
    const uint64_t size = (uint64_t)fs.st_size;
    const int64_t want = (int64_t)(p->max_bytes / slot_bytes);
    s->slots = want;
    struct statvfs vfs;
    if (statvfs(p->dir, &vfs) == 0) {
        const uint64_t room = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize + size;
        if (room / slot_bytes < (uint64_t)want) {
            s->slots = (int64_t)(room / slot_bytes);
            st_log(STRATA_LOG_WARN,
                   "KV cache on SSD: --kv-ssd-size asks %" PRIu64 " bytes but %s has room for %" PRIu64
                   " (free space + the file's %" PRIu64 "): %" PRId64 " block slots instead of %" PRId64 "%s",
                   p->max_bytes, p->dir, room, size, s->slots, want, s->slots == 0 ? ": nothing is cached" : "");
        }
    }
    if (size > (uint64_t)s->slots * slot_bytes && ftruncate(fd, (off_t)((uint64_t)s->slots * slot_bytes)) != 0) {
        st = st_err(STRATA_ERR_IO, "KV cache on SSD: cannot truncate %s to %" PRIu64 " bytes: %s", s->path,
                    (uint64_t)s->slots * slot_bytes, strerror(errno));
        goto fail;
    }
    s->p.identity_text = p->identity_text;
    write_identity_text(s);
    s->p.identity_text = NULL;

    if ((st = st_aio_init(2 * s->max_writes, p->force_pread, "KV cache SSD writes", &s->waio))) goto fail;
    if ((st = st_aio_init(READ_DEPTH, p->force_pread || !st_aio_uring(s->waio), "KV cache SSD reads", &s->raio)))
        goto fail;
    int e = pthread_create(&s->writer, NULL, writer_main, s);
    if (e != 0) {
        st = st_err(STRATA_ERR_INTERNAL, "KV cache on SSD: cannot start the writer thread: %s", strerror(e));
        goto fail;
    }
    s->thread_started = true;
    st_log(STRATA_LOG_INFO, "KV cache on SSD: %s, %" PRId64 " block slots of %" PRIu64 " bytes, %s, %s", s->path,
           s->slots, slot_bytes,
           s->direct ? "O_DIRECT" : "through the page cache (the file system refuses O_DIRECT)",
           st_aio_uring(s->waio) ? "io_uring" : "pread/pwrite");
    *out = s;
    return STRATA_OK;
fail:
    st_kv_ssd_close(s);
    return st;
}

void st_kv_ssd_close(st_kv_ssd *s) {
    if (!s) return;
    if (s->thread_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        pthread_cond_signal(&s->work);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->writer, NULL);
    }
    st_aio_free(s->waio);
    st_aio_free(s->raio);
    if (s->fd >= 0) close(s->fd); /* releases the lock */
    pthread_cond_destroy(&s->idle);
    pthread_cond_destroy(&s->work);
    pthread_mutex_destroy(&s->rmu);
    pthread_mutex_destroy(&s->mu);
    st_free(s->rhdr_raw);
    st_free(s->whdr_raw);
    st_free(s->take);
    st_free(s->jobs);
    st_free(s->path);
    st_free(s->dir);
    st_free(s);
}

int64_t st_kv_ssd_slots(const st_kv_ssd *s) { return s->slots; }
size_t st_kv_ssd_payload_alloc_bytes(const st_kv_ssd *s) { return (size_t)s->alloc; }
uint64_t st_kv_ssd_slot_bytes(const st_kv_ssd *s) { return s->slot_bytes; }
const char *st_kv_ssd_path(const st_kv_ssd *s) { return s->path; }

/* ---- writes ---- */

strata_status st_kv_ssd_write(st_kv_ssd *s, int64_t slot, uint64_t hash, uint64_t parent_hash,
                              const int32_t *tokens, const void *payload) {
    if (!s) return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: write: store is NULL");
    if (slot < 0 || slot >= s->slots)
        return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: write to slot %" PRId64 " of %s: it has %" PRId64
                      " slots", slot, s->path, s->slots);
    if (!tokens || !payload || (uintptr_t)payload % ST_AIO_ALIGN)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "KV cache on SSD: write to slot %" PRId64 ": tokens %p or payload %p NULL or the payload not "
                      "%u-aligned",
                      slot, (const void *)tokens, payload, ST_AIO_ALIGN);
    pthread_mutex_lock(&s->mu);
    int fi = -1;
    for (int i = 0; i < s->max_writes; i++) {
        const kv_job *j = &s->jobs[i];
        if (j->state == J_FREE && fi < 0) fi = i;
        if ((j->state == J_QUEUED || j->state == J_RUNNING) && j->slot == slot) {
            pthread_mutex_unlock(&s->mu);
            return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: write to slot %" PRId64
                          " while a write to it is queued or in flight", slot);
        }
    }
    if (fi < 0) {
        pthread_mutex_unlock(&s->mu);
        return st_err(STRATA_ERR_BUSY,
                      "KV cache on SSD: %d writes queued, in flight or not yet polled: slot %" PRId64 " not written",
                      s->max_writes, slot);
    }
    kv_job *j = &s->jobs[fi];
    memset(j->hdr, 0, HDR);
    kv_hdr h = {.magic = KV_MAGIC, .version = KV_VERSION, .header_bytes = HDR, .identity = s->p.identity,
                .slot = slot, .hash = hash, .parent_hash = parent_hash, .payload_bytes = s->p.payload_bytes,
                .n_tokens = s->p.block_tokens};
    memcpy(j->hdr, &h, sizeof h);
    memcpy(j->hdr + sizeof h, tokens, (size_t)s->p.block_tokens * sizeof(int32_t));
    j->slot = slot;
    j->payload = payload;
    j->seq = s->next_seq++;
    j->inject = ++s->n_submitted == s->p.fail_write_nth;
    j->ok = false;
    j->state = J_QUEUED;
    s->n_queued++;
    s->n_active++;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    return STRATA_OK;
}

int64_t st_kv_ssd_poll(st_kv_ssd *s, st_kv_ssd_done *out, int64_t max) {
    if (!s || !out || max <= 0) return 0;
    int64_t n = 0;
    pthread_mutex_lock(&s->mu);
    while (n < max) {
        int best = -1;
        for (int i = 0; i < s->max_writes; i++)
            if (s->jobs[i].state == J_DONE && (best < 0 || s->jobs[i].seq < s->jobs[best].seq)) best = i;
        if (best < 0) break;
        out[n].slot = s->jobs[best].slot;
        out[n].ok = s->jobs[best].ok;
        n++;
        s->jobs[best].state = J_FREE;
        s->jobs[best].payload = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void st_kv_ssd_flush(st_kv_ssd *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    while (s->n_active > 0) pthread_cond_wait(&s->idle, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* ---- reads ---- */

/* Submits a read of `len` bytes at `off` into buf; false when it could not be queued. */
static bool read_submit(st_kv_ssd *s, uint64_t off, uint64_t len, void *buf, uint64_t tag) {
    const st_aio_req r = {.fd = s->fd, .name = s->path, .direct = s->direct, .off = off, .len = len, .need = len,
                          .buf = buf, .tag = tag};
    return st_aio_submit(s->raio, &r) == STRATA_OK;
}

enum { READ_PAIRS = READ_DEPTH / 2 };

typedef struct {
    bool used;
    int64_t i;     /* index into the caller's arrays */
    int pending;
    bool bad;      /* a part could not be read */
} read_pair;

static void read_finish(st_kv_ssd *s, read_pair *rp, int k, const int64_t *slots, const uint64_t *expect,
                        void *const *payloads, bool *ok) {
    const int64_t i = rp->i;
    const uint8_t *h = s->rhdr + (size_t)k * HDR;
    const char *why = rp->bad ? "unreadable (short or failed read)" : header_invalid(s, h, slots[i]);
    kv_hdr hd;
    memcpy(&hd, h, sizeof hd);
    if (!why && hd.hash != expect[i]) why = "the slot holds another block (hash)";
    if (!why && XXH3_64bits(payloads[i], s->p.payload_bytes) != hd.payload_sum) why = "payload checksum mismatch";
    ok[i] = why == NULL;
    atomic_fetch_add(&s->reads, 1);
    atomic_fetch_add(&s->bytes_read, s->slot_bytes);
    if (why) {
        atomic_fetch_add(&s->read_failures, 1);
        st_log(STRATA_LOG_DEBUG, "KV cache on SSD: slot %" PRId64 " of %s not read back: %s", slots[i], s->path,
               why);
    }
    rp->used = false;
}

strata_status st_kv_ssd_read(st_kv_ssd *s, const int64_t *slots, const uint64_t *expect_hash,
                             void *const *payloads, int64_t n, bool *ok) {
    if (!s || n < 0 || (n > 0 && (!slots || !expect_hash || !payloads || !ok)))
        return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: read of %" PRId64 " slots: a NULL argument", n);
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= s->slots)
            return st_err(STRATA_ERR_INVALID_ARG,
                          "KV cache on SSD: read of slot %" PRId64 " (entry %" PRId64 ") of %s: it has %" PRId64
                          " slots",
                          slots[i], i, s->path, s->slots);
        if (!payloads[i] || (uintptr_t)payloads[i] % ST_AIO_ALIGN)
            return st_err(STRATA_ERR_INVALID_ARG,
                          "KV cache on SSD: read of slot %" PRId64 " (entry %" PRId64 "): payload buffer %p NULL or "
                          "not %u-aligned",
                          slots[i], i, payloads[i], ST_AIO_ALIGN);
    }
    pthread_mutex_lock(&s->rmu);
    read_pair rp[READ_PAIRS];
    memset(rp, 0, sizeof rp);
    int64_t next = 0, finished = 0;
    while (finished < n) {
        for (int k = 0; k < READ_PAIRS && next < n; k++) {
            if (rp[k].used) continue;
            const int64_t i = next++;
            const uint64_t off = (uint64_t)slots[i] * s->slot_bytes;
            rp[k] = (read_pair){.used = true, .i = i};
            if (read_submit(s, off, HDR, s->rhdr + (size_t)k * HDR, (uint64_t)k * 2)) rp[k].pending++;
            else rp[k].bad = true;
            if (read_submit(s, off + HDR, s->alloc, payloads[i], (uint64_t)k * 2 + 1)) rp[k].pending++;
            else rp[k].bad = true;
            if (rp[k].pending == 0) {
                read_finish(s, &rp[k], k, slots, expect_hash, payloads, ok);
                finished++;
            }
        }
        if (finished >= n) break;
        bool wait = true;
        for (;;) {
            bool got = false;
            st_aio_result res;
            strata_status st = st_aio_reap(s->raio, wait, &got, &res);
            if (!got) {
                if (wait && st != STRATA_OK) /* the ring failed: what is in flight counts as unreadable */
                    for (int k = 0; k < READ_PAIRS; k++)
                        if (rp[k].used && rp[k].pending > 0) {
                            rp[k].pending = 0;
                            rp[k].bad = true;
                            read_finish(s, &rp[k], k, slots, expect_hash, payloads, ok);
                            finished++;
                        }
                break;
            }
            wait = false;
            const int k = (int)(res.tag / 2);
            ST_ASSERT(k < READ_PAIRS && rp[k].used && rp[k].pending > 0);
            if (st != STRATA_OK) rp[k].bad = true;
            if (--rp[k].pending == 0) {
                read_finish(s, &rp[k], k, slots, expect_hash, payloads, ok);
                finished++;
            }
        }
    }
    pthread_mutex_unlock(&s->rmu);
    return STRATA_OK;
}

strata_status st_kv_ssd_scan(st_kv_ssd *s, st_kv_ssd_scan_fn cb, void *user, int64_t *n_found) {
    if (n_found) *n_found = 0;
    if (!s || !n_found) return st_err(STRATA_ERR_INVALID_ARG, "KV cache on SSD: scan: store or n_found is NULL");
    pthread_mutex_lock(&s->rmu);
    struct stat fs;
    int64_t n_scan = 0;
    if (fstat(s->fd, &fs) == 0 && (uint64_t)fs.st_size >= HDR)
        n_scan = (int64_t)(((uint64_t)fs.st_size - HDR) / s->slot_bytes) + 1;
    if (n_scan > s->slots) n_scan = s->slots;
    int64_t found = 0, invalid = 0;
    for (int64_t base = 0; base < n_scan; base += READ_DEPTH) { /* in waves: callbacks in slot order */
        const int nw = n_scan - base < READ_DEPTH ? (int)(n_scan - base) : READ_DEPTH;
        bool bad[READ_DEPTH];
        for (int k = 0; k < nw; k++)
            bad[k] = !read_submit(s, (uint64_t)(base + k) * s->slot_bytes, HDR, s->rhdr + (size_t)k * HDR,
                                  (uint64_t)k);
        while (st_aio_inflight(s->raio) > 0) {
            bool got = false;
            st_aio_result res;
            strata_status st = st_aio_reap(s->raio, true, &got, &res);
            if (!got) { /* the ring failed: nothing more comes back */
                for (int k = 0; k < nw; k++) bad[k] = true;
                break;
            }
            if (st != STRATA_OK) bad[res.tag] = true;
        }
        for (int k = 0; k < nw; k++) {
            const uint8_t *h = s->rhdr + (size_t)k * HDR;
            if (bad[k] || header_invalid(s, h, base + k)) {
                invalid++;
                continue;
            }
            kv_hdr hd;
            memcpy(&hd, h, sizeof hd);
            found++;
            if (cb) cb(base + k, hd.hash, hd.parent_hash, (const int32_t *)(h + sizeof hd), hd.n_tokens, user);
        }
    }
    pthread_mutex_unlock(&s->rmu);
    st_log(STRATA_LOG_INFO, "KV cache on SSD: %s: %" PRId64 " blocks found in %" PRId64 " slots (%" PRId64
           " empty or invalid)", s->path, found, n_scan, invalid);
    *n_found = found;
    return STRATA_OK;
}

void st_kv_ssd_get_stats(const st_kv_ssd *s, st_kv_ssd_stats *out) {
    memset(out, 0, sizeof *out);
    if (!s) return;
    st_kv_ssd *m = (st_kv_ssd *)s; /* atomic loads of C11 take non-const pointers */
    out->bytes_written = atomic_load(&m->bytes_written);
    out->bytes_read = atomic_load(&m->bytes_read);
    out->writes = atomic_load(&m->writes);
    out->write_failures = atomic_load(&m->write_failures);
    out->reads = atomic_load(&m->reads);
    out->read_failures = atomic_load(&m->read_failures);
    out->slots = s->slots;
    out->direct = s->direct;
    out->uring = s->waio && st_aio_uring(s->waio);
}

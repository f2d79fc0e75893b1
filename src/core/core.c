/* core: errors, logging, assertions, allocation, file mapping, time. */

#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

const char *strata_status_str(strata_status st) {
    switch (st) {
    case STRATA_OK: return "ok";
    case STRATA_ERR_INVALID_ARG: return "invalid argument";
    case STRATA_ERR_IO: return "I/O error";
    case STRATA_ERR_FORMAT: return "bad format";
    case STRATA_ERR_UNSUPPORTED: return "unsupported";
    case STRATA_ERR_NOMEM: return "out of memory";
    case STRATA_ERR_NOT_FOUND: return "not found";
    case STRATA_ERR_MISMATCH: return "mismatch";
    case STRATA_ERR_BACKEND: return "backend error";
    case STRATA_ERR_INTERNAL: return "internal error";
    case STRATA_ERR_BUSY: return "busy";
    }
    return "unknown status";
}

/* ---- errors ---- */
static _Thread_local char g_err_msg[1024];

strata_status st_err(strata_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err_msg, sizeof g_err_msg, fmt, ap);
    va_end(ap);
    st_log(STRATA_LOG_DEBUG, "error (%s): %s", strata_status_str(st), g_err_msg);
    return st;
}

strata_status st_err_what(strata_status st, const char *fmt, ...) {
    char what[256], prev[sizeof g_err_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(prev, sizeof prev, "%s", g_err_msg);
    return st_err(st, "%s: %s", what, prev[0] ? prev : strata_status_str(st));
}

const char *st_last_error(void) { return g_err_msg; }
void st_clear_error(void) { g_err_msg[0] = '\0'; }

/* ---- logging ----
 * The sink is process-wide configuration set once by the embedding program
 * (like ggml's log callback), not state that carries computation. */
static strata_log_fn g_log_fn;
static void *g_log_user;
static strata_log_level g_log_min = STRATA_LOG_INFO;

void st_log_set(strata_log_fn fn, void *user, strata_log_level min_level) {
    g_log_fn = fn;
    g_log_user = user;
    g_log_min = min_level;
}

void st_log(strata_log_level level, const char *fmt, ...) {
    if (!g_log_fn || level < g_log_min) return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    g_log_fn(level, buf, g_log_user);
}

void st_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "strata: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* ---- allocation ---- */
void *st_malloc(size_t n) { return malloc(n ? n : 1); }
void *st_calloc(size_t count, size_t size) { return calloc(count ? count : 1, size ? size : 1); }
void *st_realloc(void *p, size_t n) { return realloc(p, n ? n : 1); }
void st_free(void *p) { free(p); }
char *st_strdup(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

strata_status st_budget_take(st_budget *b, size_t n, const char *what) {
    if (b->cap && (n > b->cap || b->used > b->cap - n))
        return st_err(STRATA_ERR_NOMEM,
                      "%s: needs %zu bytes but only %zu of the %zu-byte budget are free",
                      what ? what : "allocation", n, b->cap - b->used, b->cap);
    b->used += n;
    if (b->used > b->peak) b->peak = b->used;
    b->takes++;
    return STRATA_OK;
}

void st_budget_give(st_budget *b, size_t n) {
    ST_ASSERT(n <= b->used);
    b->used -= n;
}

/* ---- files ---- */
strata_status st_file_map(const char *path, st_mapped_file *f) {
    memset(f, 0, sizeof *f);
    f->fd = -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return st_err(STRATA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return st_err(STRATA_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return st_err(STRATA_ERR_IO, "%s: not a regular file", path);
    }
    const uint8_t *data = NULL;
    if (sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return st_err(STRATA_ERR_IO, "%s: cannot map: %s", path, strerror(e));
        }
        data = p;
    }
    f->path = st_strdup(path);
    if (!f->path) {
        if (data) munmap((void *)data, (size_t)sb.st_size);
        close(fd);
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    }
    f->fd = fd;
    f->size = (uint64_t)sb.st_size;
    f->data = data;
    return STRATA_OK;
}

void st_file_unmap(st_mapped_file *f) {
    if (!f) return;
    if (f->data && !f->borrowed) munmap((void *)f->data, (size_t)f->size);
    if (f->fd >= 0) close(f->fd);
    st_free(f->path);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

strata_status st_file_read_all(const char *path, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    FILE *fp = fopen(path, "rb");
    if (!fp) return st_err(STRATA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = st_malloc(cap);
    if (!buf) {
        fclose(fp);
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    }
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = st_realloc(buf, cap * 2);
            if (!nb) {
                st_free(buf);
                fclose(fp);
                return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - 1 - n, fp);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (bad) {
        st_free(buf);
        return st_err(STRATA_ERR_IO, "%s: read error", path);
    }
    buf[n] = '\0';
    *out = buf;
    if (len) *len = n;
    return STRATA_OK;
}

double st_time_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

size_t st_mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return kb > (unsigned long long)(SIZE_MAX / 1024) ? SIZE_MAX : (size_t)(kb * 1024ull);
}

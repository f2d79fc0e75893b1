/* core: status + error messages, logging, assertions, allocation, file mapping.
 * core includes nothing else of strata but the public header. */
#pragma once
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ---------------------------------------------------------------
 * A failing function returns a strata_status and records a human-readable
 * message (naming the file / field / parameter) with st_err(). The message is
 * per thread and stays until the next st_err() on that thread. */
strata_status st_err(strata_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *st_last_error(void);  /* "" when none */
/* Puts "WHAT: " (formatted) before the message a failed call left (e.g. the
 * allocation it was for) and returns st. */
strata_status st_err_what(strata_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void st_clear_error(void);

/* ---- logging: the library never prints -------------------------------------*/
void st_log_set(strata_log_fn fn, void *user, strata_log_level min_level);
void st_log(strata_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- invariants: abort with file:line ---------------------------------------*/
void st_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define ST_ASSERT(x) do { if (!(x)) st_assert_fail(#x, __FILE__, __LINE__); } while (0)

/* ---- allocation ---------------------------------------------------------------
 * Plain wrappers (NULL on failure, st_free(NULL) is a no-op), plus a budget that
 * counts bytes against a cap and remembers its peak. */
void *st_malloc(size_t n);
void *st_calloc(size_t count, size_t size);
void *st_realloc(void *p, size_t n);
void st_free(void *p);
char *st_strdup(const char *s);

typedef struct {
    size_t cap;   /* 0: unlimited */
    size_t used;
    size_t peak;
    uint64_t takes; /* successful st_budget_take calls: changes whenever anything new is allocated
                       (model/llama.c drops its recorded graphs then: a scratch buffer may have moved) */
} st_budget;
/* Takes n bytes from the budget; STRATA_ERR_NOMEM (with a message naming
 * `what`) when it would exceed the cap. */
strata_status st_budget_take(st_budget *b, size_t n, const char *what);
void st_budget_give(st_budget *b, size_t n);

/* ---- read-only file mapping ------------------------------------------------*/
typedef struct {
    char *path;          /* owned copy */
    int fd;              /* -1 when closed */
    uint64_t size;
    const uint8_t *data; /* mmap of the whole file (NULL for an empty file) */
    bool borrowed;       /* data is the caller's memory, not a mapping (fd -1): never unmapped
                            (st_gguf_open_mem) */
} st_mapped_file;

/* Maps `path` read-only. On error: a message naming the path, *f zeroed. */
strata_status st_file_map(const char *path, st_mapped_file *f);
void st_file_unmap(st_mapped_file *f); /* safe on a zeroed struct */

/* Reads a whole (small) file into a NUL-terminated heap buffer. */
strata_status st_file_read_all(const char *path, char **out, size_t *len);

/* Overflow-checked helpers for parsers. */
static inline bool st_mul_ovf_u64(uint64_t a, uint64_t b, uint64_t *r) {
    return __builtin_mul_overflow(a, b, r);
}
static inline bool st_add_ovf_u64(uint64_t a, uint64_t b, uint64_t *r) {
    return __builtin_add_overflow(a, b, r);
}

/* Monotonic time in seconds. */
/* MemAvailable of /proc/meminfo in bytes (what the machine can still give without
 * swapping); 0 when unknown. */
size_t st_mem_available(void);
double st_time_now(void);

#ifdef __cplusplus
}
#endif

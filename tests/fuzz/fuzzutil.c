/* See fuzzutil.h. */
#include "fuzzutil.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef STRATA_SOURCE_DIR
#error "STRATA_SOURCE_DIR must be defined (CMake does)"
#endif

void fuzz_fail(const char *file, int line, const char *cond, const char *fmt, ...) {
    fprintf(stderr, "%s:%d: fuzz invariant failed: %s: ", file, line, cond);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

void fuzz_check_error(strata_status st, const char *what) {
    if (st == STRATA_OK) return;
    const char *msg = st_last_error();
    FUZZ_CHECK(msg[0] != '\0', "status %s without a message", strata_status_str(st));
    if (what) FUZZ_CHECK(strstr(msg, what) != NULL, "the message does not name %s: %s", what, msg);
}

size_t fuzz_split(const uint8_t *data, size_t size, fuzz_part *parts, size_t max) {
    const size_t sl = strlen(FUZZ_SEP);
    size_t n = 0, start = 0;
    if (max == 0) return 0;
    for (size_t i = 0; n + 1 < max && i + sl <= size;) {
        if (memcmp(data + i, FUZZ_SEP, sl) == 0) {
            parts[n++] = (fuzz_part){data + start, i - start};
            i += sl;
            start = i;
        } else {
            i++;
        }
    }
    parts[n++] = (fuzz_part){data + start, size - start};
    return n;
}

char *fuzz_strndup(const void *p, size_t n) {
    char *s = malloc(n + 1);
    FUZZ_CHECK(s != NULL, "out of memory copying %zu bytes", n);
    if (n) memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

static char g_dir[64];

static void remove_dir(void) {
    if (!g_dir[0]) return;
    DIR *d = opendir(g_dir);
    if (d) {
        struct dirent *e;
        char path[512];
        while ((e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            snprintf(path, sizeof path, "%s/%s", g_dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(g_dir);
}

const char *fuzz_dir(void) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/strata-fuzz-XXXXXX");
        FUZZ_CHECK(mkdtemp(g_dir) != NULL, "cannot make a directory %s", g_dir);
        atexit(remove_dir);
    }
    return g_dir;
}

static const char *dir_path(const char *name) {
    static char bufs[4][512];
    static int k;
    char *b = bufs[k++ % 4];
    snprintf(b, sizeof bufs[0], "%s/%s", fuzz_dir(), name);
    return b;
}

const char *fuzz_write(const char *name, const void *data, size_t n) {
    const char *path = dir_path(name);
    FILE *f = fopen(path, "wb");
    FUZZ_CHECK(f != NULL, "cannot write %s", path);
    FUZZ_CHECK(n == 0 || fwrite(data, 1, n, f) == n, "cannot write %s", path);
    FUZZ_CHECK(fclose(f) == 0, "cannot write %s", path);
    return path;
}

void fuzz_remove(const char *name) { unlink(dir_path(name)); }

const char *fuzz_src_path(const char *rel) {
    static char bufs[4][1024];
    static int k;
    char *b = bufs[k++ % 4];
    snprintf(b, sizeof bufs[0], "%s/%s", STRATA_SOURCE_DIR, rel);
    return b;
}

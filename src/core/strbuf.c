/* core: growable string. */
#include "core/strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"

bool st_strbuf_add(st_strbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->len + n + 1) c *= 2;
        char *np = st_realloc(b->p, c);
        if (!np) return false;
        b->p = np;
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}

bool st_strbuf_printf(st_strbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return false;
    if ((size_t)n < sizeof tmp) return st_strbuf_add(b, tmp, (size_t)n);
    char *big = st_malloc((size_t)n + 1);
    if (!big) return false;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    bool ok = st_strbuf_add(b, big, (size_t)n);
    st_free(big);
    return ok;
}

void st_strbuf_free(st_strbuf *b) {
    st_free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

/* engine/stop: the stop-string filter. See stop.h. */
#include "engine/stop.h"
#include "tokenizer/tokenizer.h"

#include <stdint.h>
#include <string.h>

/* ---- stop strings -------------------------------------------------------------*/
struct st_stop_filter {
    char **stop;
    size_t *stop_len;
    int n_stop;
    char *buf; /* held text */
    size_t len, cap;
    char *out; /* what the last call releases */
    size_t out_cap;
    bool stopped;
    int hit; /* index of the stop string found, -1 */
};

void st_stop_filter_free(st_stop_filter *f) {
    if (!f) return;
    for (int i = 0; i < f->n_stop; i++) st_free(f->stop[i]);
    st_free(f->stop);
    st_free(f->stop_len);
    st_free(f->buf);
    st_free(f->out);
    st_free(f);
}

strata_status st_stop_filter_init(const char *const *stop, int n_stop, st_stop_filter **out) {
    *out = NULL;
    if (n_stop < 0 || (n_stop > 0 && !stop))
        return st_err(STRATA_ERR_INVALID_ARG, "stop strings: bad list (%d)", n_stop);
    for (int i = 0; i < n_stop; i++) {
        if (!stop[i] || !stop[i][0])
            return st_err(STRATA_ERR_INVALID_ARG, "stop string %d is empty", i + 1);
        if (!st_utf8_valid(stop[i], strlen(stop[i])))
            return st_err(STRATA_ERR_INVALID_ARG, "stop string %d is not valid UTF-8", i + 1);
    }
    st_stop_filter *f = st_calloc(1, sizeof *f);
    if (!f) return st_err(STRATA_ERR_NOMEM, "stop strings: out of memory for the filter (%zu bytes)", sizeof *f);
    f->n_stop = 0;
    f->hit = -1;
    if (n_stop > 0) {
        f->stop = st_calloc((size_t)n_stop, sizeof *f->stop);
        f->stop_len = st_calloc((size_t)n_stop, sizeof *f->stop_len);
        if (!f->stop || !f->stop_len) goto oom;
        for (int i = 0; i < n_stop; i++) {
            if (!(f->stop[i] = st_strdup(stop[i]))) goto oom;
            f->stop_len[i] = strlen(stop[i]);
            f->n_stop = i + 1;
        }
    }
    *out = f;
    return STRATA_OK;
oom:
    st_stop_filter_free(f);
    return st_err(STRATA_ERR_NOMEM, "stop strings: out of memory for a copy of %d stop strings", n_stop);
}

static bool grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *np = st_realloc(*p, c);
    if (!np) return false;
    *p = np;
    *cap = c;
    return true;
}

/* Moves buf[0..n) to out and shifts the rest of buf down. */
static strata_status release(st_stop_filter *f, size_t n, const char **out, size_t *out_len) {
    if (!grow(&f->out, &f->out_cap, n + 1))
        return st_err(STRATA_ERR_NOMEM, "stop strings: out of memory for %zu bytes of released text", n + 1);
    memcpy(f->out, f->buf, n);
    f->out[n] = '\0';
    memmove(f->buf, f->buf + n, f->len - n);
    f->len -= n;
    *out = f->out;
    *out_len = n;
    return STRATA_OK;
}

strata_status st_stop_filter_push(st_stop_filter *f, const char *text, size_t len, const char **out,
                                  size_t *out_len, bool *stopped) {
    *out = "";
    *out_len = 0;
    *stopped = f->stopped;
    if (f->stopped) return STRATA_OK;
    if (!grow(&f->buf, &f->cap, f->len + len + 1))
        return st_err(STRATA_ERR_NOMEM, "stop strings: out of memory for %zu bytes of held-back text",
                      f->len + len + 1);
    memcpy(f->buf + f->len, text, len);
    f->len += len;
    /* the earliest complete stop string */
    size_t first = SIZE_MAX;
    int which = -1;
    for (int i = 0; i < f->n_stop; i++) {
        const char *hit = memmem(f->buf, f->len, f->stop[i], f->stop_len[i]);
        if (hit && (size_t)(hit - f->buf) < first) {
            first = (size_t)(hit - f->buf);
            which = i;
        }
    }
    if (first != SIZE_MAX) {
        f->stopped = true;
        f->hit = which;
        *stopped = true;
        f->len = first;
        return release(f, first, out, out_len);
    }
    /* hold back the longest tail that is a proper prefix of a stop string */
    size_t hold = 0;
    for (int i = 0; i < f->n_stop; i++) {
        size_t max = f->stop_len[i] - 1 < f->len ? f->stop_len[i] - 1 : f->len;
        for (size_t l = max; l > hold; l--)
            if (!memcmp(f->buf + f->len - l, f->stop[i], l)) {
                hold = l;
                break;
            }
    }
    return release(f, f->len - hold, out, out_len);
}

void st_stop_filter_flush(st_stop_filter *f, const char **out, size_t *out_len) {
    *out = "";
    *out_len = 0;
    if (f->stopped || f->len == 0) return;
    if (release(f, f->len, out, out_len) != STRATA_OK) { /* OOM: drop the tail */
        *out = "";
        *out_len = 0;
        f->len = 0;
    }
}

int st_stop_filter_hit(const st_stop_filter *f) { return f ? f->hit : -1; }
int st_stop_filter_count(const st_stop_filter *f) { return f ? f->n_stop : 0; }

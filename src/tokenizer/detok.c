/* Decoding: token ids -> bytes (precomputed per token at load) -> a streaming
 * UTF-8 validator that holds back an incomplete character and turns each
 * maximal invalid subpart into U+FFFD, so every chunk it emits is valid UTF-8. */
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

struct st_detok {
    const st_tokenizer *t;
    bool skip_special;
    bool strip_space; /* SPM: drop the leading space of the next text piece */
    uint8_t pend[4];
    int npend, need;
    char *buf;
    size_t len, cap;
};

strata_status st_detok_init(const st_tokenizer *t, bool skip_special, st_detok **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "st_detok_init: NULL out");
    *out = NULL;
    if (!t) return st_err(STRATA_ERR_INVALID_ARG, "st_detok_init: NULL tokenizer");
    st_detok *d = st_calloc(1, sizeof *d);
    if (!d) return st_err(STRATA_ERR_NOMEM, "st_detok_init: out of memory for its state (%zu bytes)", sizeof *d);
    d->t = t;
    d->skip_special = skip_special;
    d->strip_space = t->type == ST_TOK_SPM && t->add_space_prefix;
    *out = d;
    return STRATA_OK;
}

void st_detok_free(st_detok *d) {
    if (!d) return;
    st_free(d->buf);
    st_free(d);
}

static strata_status reserve(st_detok *d, size_t extra) {
    if (d->len + extra <= d->cap) return STRATA_OK;
    size_t c = d->cap ? d->cap : 64;
    while (c < d->len + extra) c *= 2;
    char *b = st_realloc(d->buf, c);
    if (!b) return st_err(STRATA_ERR_NOMEM, "detokenizer: out of memory (%zu bytes)", c);
    d->buf = b;
    d->cap = c;
    return STRATA_OK;
}

static void put_fffd(st_detok *d) {
    memcpy(d->buf + d->len, "\xEF\xBF\xBD", 3);
    d->len += 3;
}

/* Feeds one byte; the caller reserved 3 bytes per byte fed plus 4. */
static void feed(st_detok *d, uint8_t b) {
    for (;;) {
        if (d->npend == 0) {
            int n = st_utf8_seq_len(b);
            if (n == 1) {
                d->buf[d->len++] = (char)b;
            } else if (n == 0) {
                put_fffd(d);
            } else {
                d->pend[0] = b;
                d->npend = 1;
                d->need = n;
            }
            return;
        }
        if (st_utf8_cont_ok(d->pend[0], d->npend, b)) {
            d->pend[d->npend++] = b;
            if (d->npend == d->need) {
                memcpy(d->buf + d->len, d->pend, (size_t)d->need);
                d->len += (size_t)d->need;
                d->npend = 0;
            }
            return;
        }
        /* the pending bytes can never complete: one U+FFFD, then b afresh */
        put_fffd(d);
        d->npend = 0;
    }
}

strata_status st_detok_push(st_detok *d, int32_t id, const char **out, size_t *out_len) {
    if (!d || !out || !out_len) return st_err(STRATA_ERR_INVALID_ARG, "st_detok_push: NULL argument");
    *out = "";
    *out_len = 0;
    const st_tokenizer *t = d->t;
    if (id < 0 || id >= t->n_vocab)
        return st_err(STRATA_ERR_INVALID_ARG, "st_detok_push: token id %d is out of range [0, %lld)",
                      id, (long long)t->n_vocab);
    d->len = 0;
    uint8_t a = t->attr[id];
    bool spm = t->type == ST_TOK_SPM;
    const char *s = t->dec_pool + t->dec_off[id];
    size_t n = t->dec_len[id];
    if (spm && (a & ST_TA_CONTROL)) {
        /* the encoder puts a space in front of the text after a control token */
        d->strip_space = t->add_space_prefix;
    } else if (spm) {
        if (d->strip_space && !(a & (ST_TA_BYTE | ST_TA_UNKNOWN)) && n > 0 && s[0] == ' ') {
            s++;
            n--;
        }
        d->strip_space = false;
    }
    if (d->skip_special && (a & (ST_TA_CONTROL | ST_TA_UNKNOWN))) n = 0;
    strata_status st = reserve(d, n * 3 + 8);
    if (st) return st;
    for (size_t i = 0; i < n; i++) feed(d, (uint8_t)s[i]);
    d->buf[d->len] = '\0';
    *out = d->buf;
    *out_len = d->len;
    return STRATA_OK;
}

strata_status st_detok_flush(st_detok *d, const char **out, size_t *out_len) {
    if (!d || !out || !out_len) return st_err(STRATA_ERR_INVALID_ARG, "st_detok_flush: NULL argument");
    *out = "";
    *out_len = 0;
    d->len = 0;
    strata_status st = reserve(d, 8);
    if (st) return st;
    if (d->npend) put_fffd(d);
    d->npend = 0;
    d->strip_space = d->t->type == ST_TOK_SPM && d->t->add_space_prefix;
    d->buf[d->len] = '\0';
    *out = d->buf;
    *out_len = d->len;
    return STRATA_OK;
}

strata_status st_tokenizer_decode(const st_tokenizer *t, const int32_t *ids, int64_t n,
                                  bool skip_special, char **out) {
    size_t len;
    return st_tokenizer_decode_len(t, ids, n, skip_special, out, &len);
}

strata_status st_tokenizer_decode_len(const st_tokenizer *t, const int32_t *ids, int64_t n,
                                      bool skip_special, char **out, size_t *out_len) {
    if (!out || !out_len) return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_decode: NULL out");
    *out = NULL;
    *out_len = 0;
    if (!t || (!ids && n > 0) || n < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_decode: bad arguments");
    st_detok *d;
    strata_status st = st_detok_init(t, skip_special, &d);
    if (st) return st;
    char *res = NULL;
    size_t len = 0, cap = 0;
    for (int64_t i = 0; i <= n; i++) {
        const char *piece;
        size_t pl;
        st = i < n ? st_detok_push(d, ids[i], &piece, &pl) : st_detok_flush(d, &piece, &pl);
        if (st) break;
        if (len + pl + 1 > cap) {
            size_t c = cap ? cap : 64;
            while (c < len + pl + 1) c *= 2;
            char *r = st_realloc(res, c);
            if (!r) {
                st = st_err(STRATA_ERR_NOMEM, "st_tokenizer_decode: out of memory (%zu bytes)", c);
                break;
            }
            res = r;
            cap = c;
        }
        memcpy(res + len, piece, pl);
        len += pl;
    }
    st_detok_free(d);
    if (st) {
        st_free(res);
        return st;
    }
    if (!res) {
        res = st_malloc(1);
        if (!res) return st_err(STRATA_ERR_NOMEM, "st_tokenizer_decode: out of memory for an empty text (1 byte)");
    }
    res[len] = '\0';
    *out = res;
    *out_len = len;
    return STRATA_OK;
}

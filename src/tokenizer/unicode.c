/* UTF-8 decoding (maximal subparts) and category lookup. */
#include "tokenizer/unicode.h"

#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "tokenizer/tokenizer.h"

uint8_t st_ucat(uint32_t cp) {
    if (cp < 256) return st_ucat_latin1[cp];
    if (cp > 0x10FFFF) return 0;
    /* last run whose start <= cp */
    int32_t lo = 0, hi = st_ucat_n_runs - 1;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        if (st_ucat_run_start[mid] <= cp) lo = mid;
        else hi = mid - 1;
    }
    return st_ucat_run_flags[lo];
}

int st_utf8_seq_len(uint8_t b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

bool st_utf8_cont_ok(uint8_t lead, int k, uint8_t b) {
    if (k == 1) {
        switch (lead) {
        case 0xE0: return b >= 0xA0 && b <= 0xBF;
        case 0xED: return b >= 0x80 && b <= 0x9F;
        case 0xF0: return b >= 0x90 && b <= 0xBF;
        case 0xF4: return b >= 0x80 && b <= 0x8F;
        default: break;
        }
    }
    return b >= 0x80 && b <= 0xBF;
}

size_t st_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp, bool *ok) {
    uint8_t b = s[0];
    int n = st_utf8_seq_len(b);
    if (n == 1) {
        *cp = b;
        *ok = true;
        return 1;
    }
    if (n == 0) {
        *cp = ST_UTF8_REPLACEMENT;
        *ok = false;
        return 1;
    }
    uint32_t c = b & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
    for (int k = 1; k < n; k++) {
        if ((size_t)k >= len || !st_utf8_cont_ok(b, k, s[k])) {
            *cp = ST_UTF8_REPLACEMENT;
            *ok = false;
            return (size_t)k;
        }
        c = (c << 6) | (s[k] & 0x3F);
    }
    *cp = c;
    *ok = true;
    return (size_t)n;
}

int st_utf8_encode(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

bool st_utf8_valid(const char *s, size_t len) {
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < len) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        i += st_utf8_decode(p + i, len - i, &cp, &ok);
        if (!ok) return false;
    }
    return true;
}

strata_status st_utf8_sanitize(const char *s, size_t len, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (!s && len) return st_err(STRATA_ERR_INVALID_ARG, "st_utf8_sanitize: NULL text");
    /* each invalid byte (1 byte) becomes at most 3 bytes */
    if (len > (SIZE_MAX - 1) / 3) return st_err(STRATA_ERR_NOMEM, "st_utf8_sanitize: text too long");
    char *o = st_malloc(len * 3 + 1);
    if (!o) return st_err(STRATA_ERR_NOMEM, "st_utf8_sanitize: out of memory (%zu bytes)", len * 3 + 1);
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0, k = 0;
    while (i < len) {
        if (p[i] < 0x80) {
            o[k++] = (char)p[i++];
            continue;
        }
        uint32_t cp;
        bool ok;
        size_t n = st_utf8_decode(p + i, len - i, &cp, &ok);
        if (ok) {
            memcpy(o + k, p + i, n);
            k += n;
        } else {
            o[k++] = (char)0xEF;
            o[k++] = (char)0xBF;
            o[k++] = (char)0xBD;
        }
        i += n;
    }
    o[k] = '\0';
    *out = o;
    *out_len = k;
    return STRATA_OK;
}

/* ---- NFC ------------------------------------------------------------------------
 * UAX #15: full canonical decomposition (table + Hangul arithmetic), canonical
 * ordering of combining marks (stable by class), then canonical composition
 * (a mark composes with the last starter unless blocked by a mark of the same
 * or higher class; adjacent starters compose too). */
enum { SBASE = 0xAC00, LBASE = 0x1100, VBASE = 0x1161, TBASE = 0x11A7, LCOUNT = 19,
       VCOUNT = 21, TCOUNT = 28, NCOUNT = VCOUNT * TCOUNT, SCOUNT = LCOUNT * NCOUNT };

uint8_t st_ccc(uint32_t cp) {
    if (cp < 0x300) return 0;
    int32_t lo = 0, hi = st_ccc_n_runs - 1;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        if (st_ccc_run_start[mid] <= cp) lo = mid;
        else hi = mid - 1;
    }
    return st_ccc_run_value[lo];
}

static const uint32_t *nfd_find(uint32_t cp) {
    int32_t lo = 0, hi = st_nfd_n - 1;
    while (lo <= hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (st_nfd_map[mid][0] == cp) return st_nfd_map[mid];
        if (st_nfd_map[mid][0] < cp) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

static uint32_t nfc_compose(uint32_t a, uint32_t b) {
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE &&
        b < TBASE + TCOUNT)
        return a + (b - TBASE);
    int32_t lo = 0, hi = st_nfc_n - 1;
    while (lo <= hi) {
        int32_t mid = lo + (hi - lo) / 2;
        const uint32_t *e = st_nfc_map[mid];
        if (e[0] == a && e[1] == b) return e[2];
        if (e[0] < a || (e[0] == a && e[1] < b)) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

typedef struct {
    uint32_t *v;
    size_t n, cap;
} cpvec;

static bool cp_push(cpvec *c, uint32_t cp) {
    if (c->n == c->cap) {
        size_t nc = c->cap ? c->cap * 2 : 64;
        uint32_t *p = st_realloc(c->v, nc * sizeof *p);
        if (!p) return false;
        c->v = p;
        c->cap = nc;
    }
    c->v[c->n++] = cp;
    return true;
}

static bool decompose(cpvec *c, uint32_t cp, int depth) {
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
        uint32_t s = cp - SBASE, t = s % TCOUNT;
        if (!cp_push(c, LBASE + s / NCOUNT) || !cp_push(c, VBASE + (s % NCOUNT) / TCOUNT)) return false;
        return t == 0 || cp_push(c, TBASE + t);
    }
    const uint32_t *d = depth < 8 ? nfd_find(cp) : NULL;
    if (!d) return cp_push(c, cp);
    if (!decompose(c, d[1], depth + 1)) return false;
    return d[2] == 0 || decompose(c, d[2], depth + 1);
}

strata_status st_utf8_nfc(const char *s, size_t len, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    if (!s && len) return st_err(STRATA_ERR_INVALID_ARG, "st_utf8_nfc: NULL text");
    const uint8_t *p = (const uint8_t *)s;
    bool simple = true; /* everything below U+0300 is NFC and composes with nothing */
    for (size_t i = 0; i < len; i++)
        if (p[i] >= 0xCC) simple = false;
    if (simple) {
        if (!st_utf8_valid(s, len))
            return st_err(STRATA_ERR_INVALID_ARG, "st_utf8_nfc: invalid UTF-8");
        char *o = st_malloc(len + 1);
        if (!o) return st_err(STRATA_ERR_NOMEM, "st_utf8_nfc: out of memory for a copy of %zu bytes", len + 1);
        if (len) memcpy(o, s, len);
        o[len] = '\0';
        *out = o;
        *out_len = len;
        return STRATA_OK;
    }
    cpvec c = {0};
    strata_status st = STRATA_OK;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        bool ok;
        i += st_utf8_decode(p + i, len - i, &cp, &ok);
        if (!ok) {
            st = st_err(STRATA_ERR_INVALID_ARG, "st_utf8_nfc: invalid UTF-8");
            goto done;
        }
        if (!decompose(&c, cp, 0)) goto nomem;
    }
    /* canonical ordering: stable insertion sort of each run of non-starters */
    for (size_t i = 1; i < c.n; i++) {
        uint8_t ci = st_ccc(c.v[i]);
        if (ci == 0) continue;
        uint32_t x = c.v[i];
        size_t j = i;
        while (j > 0) {
            uint8_t cj = st_ccc(c.v[j - 1]);
            if (cj == 0 || cj <= ci) break;
            c.v[j] = c.v[j - 1];
            j--;
        }
        c.v[j] = x;
    }
    /* composition */
    if (c.n > 0) {
        size_t starter = 0, w = 1;
        int last = st_ccc(c.v[0]) ? 256 : 0;
        bool have_starter = last == 0;
        for (size_t r = 1; r < c.n; r++) {
            uint32_t ch = c.v[r];
            int cc = st_ccc(ch);
            uint32_t comp = have_starter ? nfc_compose(c.v[starter], ch) : 0;
            if (comp && (last < cc || last == 0)) {
                c.v[starter] = comp;
                continue;
            }
            if (cc == 0) {
                starter = w;
                have_starter = true;
            }
            last = cc;
            c.v[w++] = ch;
        }
        c.n = w;
    }
    {
        char *o = st_malloc(c.n * 4 + 1);
        if (!o) goto nomem;
        size_t k = 0;
        for (size_t i = 0; i < c.n; i++) k += (size_t)st_utf8_encode(c.v[i], (uint8_t *)o + k);
        o[k] = '\0';
        *out = o;
        *out_len = k;
    }
    goto done;
nomem:
    st = st_err(STRATA_ERR_NOMEM, "st_utf8_nfc: out of memory normalizing %zu bytes of text", len);
done:
    st_free(c.v);
    return st;
}

/* Pre-tokenizers: the regexes of GPT-2, Llama-3, Qwen2 and SmolLM written out
 * as matchers over code points and their Unicode categories (no regex engine).
 *
 * Each matcher gives, at code point i of a run [i, end), the end of the match
 * the regex would find there. The alternatives are tried in the regex's order
 * (leftmost-first, like Oniguruma / PCRE / Python's regex); every code point is
 * covered by some alternative, so the matches tile the text.
 *
 * GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * Llama-3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *          ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Qwen2:  as Llama-3 with \p{N} for \p{N}{1,3}.
 * SmolLM: HF Digits(individual_digits): each \p{N} is a piece of its own; the
 *         runs between them are cut with the GPT-2 pattern, each run on its own
 *         (so a lookahead at the end of a run sees the end of the text).
 * \s is the White_Space property; (?i) folds ASCII only.
 */
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

#define F_L ST_UCAT_L
#define F_N ST_UCAT_N
#define F_WS ST_UCAT_WS

static inline bool is_other(uint8_t f) { return !(f & (F_L | F_N | F_WS)); }
static inline bool is_nl(uint32_t c) { return c == '\r' || c == '\n'; }

static inline int64_t run_mask(const uint8_t *fl, int64_t i, int64_t end, uint8_t mask) {
    while (i < end && (fl[i] & mask)) i++;
    return i;
}
static inline int64_t run_other(const uint8_t *fl, int64_t i, int64_t end) {
    while (i < end && is_other(fl[i])) i++;
    return i;
}
static inline uint32_t fold(uint32_t c, bool on) {
    return (on && c >= 'A' && c <= 'Z') ? c + 32 : c;
}

/* 's|'t|'re|'ve|'m|'ll|'d at i: the match length (0: none). */
static int64_t contraction(const uint32_t *cp, int64_t i, int64_t end, bool icase) {
    if (cp[i] != '\'' || i + 1 >= end) return 0;
    uint32_t a = fold(cp[i + 1], icase);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 < end) {
        uint32_t b = fold(cp[i + 2], icase);
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    }
    return 0;
}

/* \s+(?!\S)|\s+ at i (cp[i] is whitespace). */
static int64_t match_space(const uint8_t *fl, int64_t i, int64_t end) {
    int64_t r = run_mask(fl, i, end, F_WS);
    if (r == end) return r;   /* followed by the end: all of it */
    if (r - i >= 2) return r - 1; /* leave the last one to prefix the next word */
    return i + 1;
}

static int64_t match_gpt2(const uint32_t *cp, const uint8_t *fl, int64_t i, int64_t end) {
    int64_t c = contraction(cp, i, end, false);
    if (c) return i + c;
    uint8_t f0 = fl[i];
    bool sp = cp[i] == ' ' && i + 1 < end;
    uint8_t f1 = sp ? fl[i + 1] : 0;
    if (f0 & F_L) return run_mask(fl, i, end, F_L);
    if (sp && (f1 & F_L)) return run_mask(fl, i + 1, end, F_L);
    if (f0 & F_N) return run_mask(fl, i, end, F_N);
    if (sp && (f1 & F_N)) return run_mask(fl, i + 1, end, F_N);
    if (is_other(f0)) return run_other(fl, i, end);
    if (sp && is_other(f1)) return run_other(fl, i + 1, end);
    return match_space(fl, i, end);
}

static int64_t match_llama3(const uint32_t *cp, const uint8_t *fl, int64_t i, int64_t end,
                            int max_digits) {
    int64_t c = contraction(cp, i, end, true);
    if (c) return i + c;
    uint8_t f0 = fl[i];
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (f0 & F_L) return run_mask(fl, i, end, F_L);
    if (!is_nl(cp[i]) && !(f0 & (F_L | F_N)) && i + 1 < end && (fl[i + 1] & F_L))
        return run_mask(fl, i + 1, end, F_L);
    /* \p{N}{1,max} */
    if (f0 & F_N) {
        int64_t k = i;
        while (k < end && k - i < max_digits && (fl[k] & F_N)) k++;
        return k;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    int64_t k = -1;
    if (is_other(f0)) k = run_other(fl, i, end);
    else if (cp[i] == ' ' && i + 1 < end && is_other(fl[i + 1])) k = run_other(fl, i + 1, end);
    if (k >= 0) {
        while (k < end && is_nl(cp[k])) k++;
        return k;
    }
    /* \s*[\r\n]+ : up to and including the last newline of the whitespace run */
    int64_t r = run_mask(fl, i, end, F_WS), last = -1;
    for (int64_t p = i; p < r; p++)
        if (is_nl(cp[p])) last = p;
    if (last >= 0) return last + 1;
    return match_space(fl, i, end);
}

static int64_t match_at(st_pretok pre, const uint32_t *cp, const uint8_t *fl, int64_t i,
                        int64_t end) {
    switch (pre) {
    case ST_PRETOK_LLAMA3: return match_llama3(cp, fl, i, end, 3);
    case ST_PRETOK_QWEN2: return match_llama3(cp, fl, i, end, 1);
    case ST_PRETOK_GPT2:
    case ST_PRETOK_SMOLLM: break;
    }
    return match_gpt2(cp, fl, i, end);
}

strata_status st_scratch_reserve(void **p, size_t *cap, size_t n, size_t elem) {
    if (n <= *cap) return STRATA_OK;
    size_t c = *cap ? *cap : 64;
    while (c < n) c *= 2;
    if (c > SIZE_MAX / elem) return st_err(STRATA_ERR_NOMEM, "tokenizer: scratch too large");
    void *q = st_realloc(*p, c * elem);
    if (!q) return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory (%zu bytes)", c * elem);
    *p = q;
    *cap = c;
    return STRATA_OK;
}

static strata_status reserve_cps(st_enc_scratch *s, size_t n) {
    if (n <= s->cp_cap) return STRATA_OK;
    size_t c = s->cp_cap ? s->cp_cap : 256;
    while (c < n) c *= 2;
    uint32_t *a = st_realloc(s->cps, c * sizeof *a);
    if (!a) goto nomem;
    s->cps = a;
    uint8_t *f = st_realloc(s->flags, c);
    if (!f) goto nomem;
    s->flags = f;
    size_t *o = st_realloc(s->offs, c * sizeof *o);
    if (!o) goto nomem;
    s->offs = o;
    s->cp_cap = c;
    return STRATA_OK;
nomem:
    return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for %zu code points", n);
}

strata_status st_pretok_run(st_pretok pre, const char *text, size_t len, st_enc_scratch *s,
                            int64_t *n_pieces) {
    strata_status st;
    *n_pieces = 0;
    if ((st = reserve_cps(s, len + 1))) return st;
    const uint8_t *p = (const uint8_t *)text;
    int64_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        bool ok = true;
        size_t k = p[i] < 0x80 ? (cp = p[i], 1) : st_utf8_decode(p + i, len - i, &cp, &ok);
        if (!ok) return st_err(STRATA_ERR_INVALID_ARG, "pre-tokenizer: invalid UTF-8 at byte %zu", i);
        s->cps[n] = cp;
        s->flags[n] = cp < 256 ? st_ucat_latin1[cp] : st_ucat(cp);
        s->offs[n] = i;
        n++;
        i += k;
    }
    s->offs[n] = len;
    /* at most one piece per code point, plus the leading 0 */
    if ((st = st_scratch_reserve((void **)&s->bounds, &s->bounds_cap, (size_t)n + 1, sizeof(int64_t))))
        return st;
    int64_t np = 0;
    s->bounds[0] = 0;
    const uint32_t *cps = s->cps;
    const uint8_t *fl = s->flags;
    for (int64_t i = 0; i < n;) {
        int64_t end = n;
        if (pre == ST_PRETOK_SMOLLM) {
            if (fl[i] & F_N) {
                s->bounds[++np] = (int64_t)s->offs[i + 1];
                i++;
                continue;
            }
            end = i;
            while (end < n && !(fl[end] & F_N)) end++;
        }
        while (i < end) {
            int64_t j = match_at(pre, cps, fl, i, end);
            ST_ASSERT(j > i && j <= end);
            s->bounds[++np] = (int64_t)s->offs[j];
            i = j;
        }
    }
    *n_pieces = np;
    return STRATA_OK;
}

bool st_pretok_from_name(const char *name, st_pretok *out) {
    static const struct { const char *n; st_pretok p; } names[] = {
        {"gpt2", ST_PRETOK_GPT2}, {"llama3", ST_PRETOK_LLAMA3},
        {"qwen2", ST_PRETOK_QWEN2}, {"smollm", ST_PRETOK_SMOLLM},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].n)) {
            *out = names[i].p;
            return true;
        }
    return false;
}

const char *st_pretok_name(st_pretok p) {
    switch (p) {
    case ST_PRETOK_GPT2: return "gpt2";
    case ST_PRETOK_LLAMA3: return "llama3";
    case ST_PRETOK_QWEN2: return "qwen2";
    case ST_PRETOK_SMOLLM: return "smollm";
    }
    return "?";
}

strata_status st_pretok_split(st_pretok pre, const char *text, size_t len, size_t **lens,
                              int64_t *n) {
    *lens = NULL;
    *n = 0;
    if (!text && len) return st_err(STRATA_ERR_INVALID_ARG, "st_pretok_split: NULL text");
    if ((unsigned)pre > ST_PRETOK_SMOLLM)
        return st_err(STRATA_ERR_INVALID_ARG, "st_pretok_split: unknown pre-tokenizer %d", (int)pre);
    st_enc_scratch s;
    memset(&s, 0, sizeof s);
    int64_t np = 0;
    strata_status st = st_pretok_run(pre, text, len, &s, &np);
    if (!st) {
        size_t *l = st_malloc((size_t)(np ? np : 1) * sizeof *l);
        if (!l) {
            st = st_err(STRATA_ERR_NOMEM, "st_pretok_split: out of memory for the lengths of %lld pieces",
                        (long long)np);
        } else {
            for (int64_t i = 0; i < np; i++) l[i] = (size_t)(s.bounds[i + 1] - s.bounds[i]);
            *lens = l;
            *n = np;
        }
    }
    st_enc_scratch_free(&s);
    return st;
}

void st_enc_scratch_free(st_enc_scratch *s) {
    st_free(s->sym);
    st_free(s->heap);
    st_free(s->buf);
    st_free(s->cps);
    st_free(s->flags);
    st_free(s->offs);
    st_free(s->bounds);
    memset(s, 0, sizeof *s);
}

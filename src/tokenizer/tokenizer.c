/* Tokenizer core: storage, hash maps, the byte-level map, load dispatch, the
 * encode driver (added/special tokens first, then the model), accessors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

/* ---- GPT-2 byte <-> unicode map ---------------------------------------------------
 * Printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves; the
 * other 68 bytes, in increasing order, become U+0100, U+0101, ... */
static bool printable_byte(int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t st_bytelevel_char(uint8_t b) {
    if (printable_byte(b)) return b;
    uint32_t k = 0;
    for (int i = 0; i < b; i++)
        if (!printable_byte(i)) k++;
    return 0x100 + k;
}

int st_bytelevel_byte(uint32_t cp) {
    if (cp < 0x100) return printable_byte((int)cp) ? (int)cp : -1;
    if (cp >= 0x100 + 68) return -1;
    uint32_t k = cp - 0x100;
    for (int i = 0; i < 256; i++)
        if (!printable_byte(i) && k-- == 0) return i;
    return -1;
}

/* ---- hashing -----------------------------------------------------------------------*/
static uint32_t hash_bytes(const char *s, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 16777619u;
    }
    return h;
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c *= 2;
    return c;
}

strata_status st_tok_add_merge(st_tokenizer *t, const char *a, size_t al, const char *b, size_t bl, int32_t rank,
                               const char **missing) {
    *missing = NULL;
    char small[256], *cat = al + bl <= sizeof small ? small : st_malloc(al + bl);
    if (!cat) return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for a merge of %zu bytes", al + bl);
    memcpy(cat, a, al);
    memcpy(cat + al, b, bl);
    const int32_t ia = st_tok_lookup(t, a, al), ib = st_tok_lookup(t, b, bl), im = st_tok_lookup(t, cat, al + bl);
    if (cat != small) st_free(cat);
    if (ia < 0 || ib < 0 || im < 0) {
        *missing = ia < 0 ? "its first part" : ib < 0 ? "its second part" : "the merged token";
        return STRATA_ERR_FORMAT;
    }
    st_pairmap_put(&t->merges, ia, ib, rank, im);
    return STRATA_OK;
}

int32_t st_tok_lookup(const st_tokenizer *t, const char *s, size_t len) {
    const st_strmap *m = &t->vocab;
    if (!m->cap) return -1;
    uint32_t h = hash_bytes(s, len);
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        int32_t id = m->slots[i];
        if (id < 0) return -1;
        if (m->hashes[i] == h && t->text_len[id] == len &&
            memcmp(t->pool + t->text_off[id], s, len) == 0)
            return id;
    }
}

static strata_status strmap_build(st_tokenizer *t, const char *what) {
    st_strmap *m = &t->vocab;
    m->cap = pow2_at_least((size_t)t->n_vocab * 2 + 1);
    m->slots = st_malloc(m->cap * sizeof *m->slots);
    m->hashes = st_malloc(m->cap * sizeof *m->hashes);
    if (!m->slots || !m->hashes)
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory for the vocabulary map", what);
    for (size_t i = 0; i < m->cap; i++) m->slots[i] = -1;
    size_t mask = m->cap - 1;
    for (int64_t id = 0; id < t->n_vocab; id++) {
        if ((t->attr[id] & ST_TA_UNUSED) && t->text_len[id] == 0) continue; /* gap */
        const char *s = t->pool + t->text_off[id];
        size_t len = t->text_len[id];
        if (st_tok_lookup(t, s, len) >= 0) continue; /* duplicate: the first id wins */
        uint32_t h = hash_bytes(s, len);
        size_t i = h & mask;
        while (m->slots[i] >= 0) i = (i + 1) & mask;
        m->slots[i] = (int32_t)id;
        m->hashes[i] = h;
    }
    return STRATA_OK;
}

strata_status st_pairmap_init(st_pairmap *m, size_t n) {
    memset(m, 0, sizeof *m);
    m->cap = pow2_at_least(n * 2 + 1);
    m->keys = st_calloc(m->cap, sizeof *m->keys);
    m->rank = st_malloc(m->cap * sizeof *m->rank);
    m->merged = st_malloc(m->cap * sizeof *m->merged);
    if (!m->keys || !m->rank || !m->merged) {
        st_pairmap_free(m);
        return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for %zu merges", n);
    }
    return STRATA_OK;
}

void st_pairmap_put(st_pairmap *m, int32_t l, int32_t r, int32_t rank, int32_t merged) {
    uint64_t key = (((uint64_t)(uint32_t)l << 32) | (uint32_t)r) + 1;
    size_t mask = m->cap - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == key) return; /* the first (lowest rank) wins */
        if (m->keys[i] == 0) {
            m->keys[i] = key;
            m->rank[i] = rank;
            m->merged[i] = merged;
            return;
        }
    }
}

bool st_pairmap_get(const st_pairmap *m, int32_t l, int32_t r, int32_t *rank, int32_t *merged) {
    if (!m->cap) return false;
    uint64_t key = (((uint64_t)(uint32_t)l << 32) | (uint32_t)r) + 1;
    size_t mask = m->cap - 1;
    for (size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
        if (m->keys[i] == key) {
            *rank = m->rank[i];
            *merged = m->merged[i];
            return true;
        }
        if (m->keys[i] == 0) return false;
    }
}

void st_pairmap_free(st_pairmap *m) {
    st_free(m->keys);
    st_free(m->rank);
    st_free(m->merged);
    memset(m, 0, sizeof *m);
}

/* ---- building ----------------------------------------------------------------------*/
strata_status st_tok_alloc(st_tokenizer **out, st_tok_type type, int64_t n_vocab,
                           size_t pool_bytes, const char *what) {
    *out = NULL;
    if (n_vocab <= 0 || n_vocab > INT32_MAX / 2)
        return st_err(STRATA_ERR_FORMAT, "%s: vocabulary size %lld is out of range", what,
                      (long long)n_vocab);
    st_tokenizer *t = st_calloc(1, sizeof *t);
    if (!t) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", what);
    t->type = type;
    t->n_vocab = n_vocab;
    t->bos = t->eos = t->unk = -1;
    t->add_space_prefix = type == ST_TOK_SPM;
    size_t n = (size_t)n_vocab;
    t->pool = st_malloc(pool_bytes + 1);
    t->text_off = st_calloc(n, sizeof *t->text_off);
    t->text_len = st_calloc(n, sizeof *t->text_len);
    t->attr = st_malloc(n);
    if (type == ST_TOK_SPM) t->scores = st_calloc(n, sizeof *t->scores);
    if (!t->pool || !t->text_off || !t->text_len || !t->attr || (type == ST_TOK_SPM && !t->scores)) {
        st_tokenizer_free(t);
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory for %lld tokens", what, (long long)n_vocab);
    }
    memset(t->attr, ST_TA_UNUSED, n); /* every id starts as a gap */
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    *out = t;
    return STRATA_OK;
}

void st_tok_set_text(st_tokenizer *t, int32_t id, const char *s, size_t len, size_t *pool_pos) {
    memcpy(t->pool + *pool_pos, s, len);
    t->text_off[id] = *pool_pos;
    t->text_len[id] = (uint32_t)len;
    *pool_pos += len;
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* Bytes a token decodes to; writes them to out when not NULL; returns the count. */
static size_t token_decoded(const st_tokenizer *t, int64_t id, char *out) {
    const char *s = t->pool + t->text_off[id];
    size_t n = t->text_len[id];
    uint8_t a = t->attr[id];
    if (t->type == ST_TOK_SPM) {
        if (a & ST_TA_BYTE) {
            /* exactly "<0xHH>" (the pool is not NUL-terminated: no sscanf, whose
             * input is a C string, read past the token to the end of the pool
             * and beyond it) */
            int hi, lo;
            if (n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && (hi = hex_digit(s[3])) >= 0 &&
                (lo = hex_digit(s[4])) >= 0) {
                if (out) out[0] = (char)(hi << 4 | lo);
                return 1;
            }
        } else if (!(a & (ST_TA_CONTROL | ST_TA_UNKNOWN))) {
            size_t k = 0;
            for (size_t i = 0; i < n;) {
                if (i + 3 <= n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) {
                    if (out) out[k] = ' ';
                    k++;
                    i += 3;
                } else {
                    if (out) out[k] = s[i];
                    k++;
                    i++;
                }
            }
            return k;
        }
    } else if (!(a & (ST_TA_CONTROL | ST_TA_USER))) {
        /* byte-level: every character must be a mapped byte, else the raw text
         * (as HF's ByteLevel decoder does) */
        size_t k = 0, i = 0;
        const uint8_t *p = (const uint8_t *)s;
        while (i < n) {
            uint32_t cp;
            bool ok;
            i += st_utf8_decode(p + i, n - i, &cp, &ok);
            int b = ok ? st_bytelevel_byte(cp) : -1;
            if (b < 0) break;
            if (out) out[k] = (char)b;
            k++;
        }
        if (i >= n) return k;
    }
    if (out) memcpy(out, s, n);
    return n;
}

typedef struct {
    uint8_t first;
    uint32_t len;
    int32_t id;
} split_entry;

static int split_cmp(const void *a, const void *b) {
    const split_entry *x = a, *y = b;
    if (x->first != y->first) return (int)x->first - (int)y->first;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

strata_status st_tok_finish(st_tokenizer *t, const char *what) {
    strata_status st;
    if ((st = strmap_build(t, what))) return st;

    /* byte tokens */
    char buf[8];
    for (int b = 0; b < 256; b++) {
        if (t->type == ST_TOK_BPE) {
            int n = st_utf8_encode(st_bytelevel_char((uint8_t)b), (uint8_t *)buf);
            t->byte_id[b] = st_tok_lookup(t, buf, (size_t)n);
        } else {
            snprintf(buf, sizeof buf, "<0x%02X>", b);
            int32_t id = st_tok_lookup(t, buf, 6);
            if (id >= 0 && !(t->attr[id] & (ST_TA_CONTROL | ST_TA_USER))) {
                t->attr[id] = ST_TA_BYTE;
                t->byte_id[b] = id;
            }
        }
    }

    /* decoded bytes of every token */
    size_t total = 0;
    for (int64_t id = 0; id < t->n_vocab; id++) total += token_decoded(t, id, NULL);
    t->dec_pool = st_malloc(total + 1);
    t->dec_off = st_malloc((size_t)t->n_vocab * sizeof *t->dec_off);
    t->dec_len = st_malloc((size_t)t->n_vocab * sizeof *t->dec_len);
    if (!t->dec_pool || !t->dec_off || !t->dec_len)
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory for decoded tokens", what);
    size_t pos = 0;
    for (int64_t id = 0; id < t->n_vocab; id++) {
        size_t k = token_decoded(t, id, t->dec_pool + pos);
        t->dec_off[id] = pos;
        t->dec_len[id] = (uint32_t)k;
        pos += k;
    }

    /* tokens cut out of the text first, bucketed by first byte, longest first */
    size_t ns = 0;
    for (int64_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & (ST_TA_CONTROL | ST_TA_USER)) && t->text_len[id] > 0) ns++;
    split_entry *e = st_malloc((ns ? ns : 1) * sizeof *e);
    t->split_ids = st_malloc((ns ? ns : 1) * sizeof *t->split_ids);
    if (!e || !t->split_ids) {
        st_free(e);
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory", what);
    }
    size_t k = 0;
    for (int64_t id = 0; id < t->n_vocab; id++)
        if ((t->attr[id] & (ST_TA_CONTROL | ST_TA_USER)) && t->text_len[id] > 0)
            e[k++] = (split_entry){(uint8_t)t->pool[t->text_off[id]], t->text_len[id], (int32_t)id};
    qsort(e, ns, sizeof *e, split_cmp);
    for (int b = 0, i = 0; b <= 256; b++) {
        while ((size_t)i < ns && e[i].first < b) i++;
        t->split_start[b] = i;
    }
    for (size_t i = 0; i < ns; i++) t->split_ids[i] = e[i].id;
    st_free(e);

    if (t->type == ST_TOK_SPM) snprintf(t->kind, sizeof t->kind, "spm");
    else snprintf(t->kind, sizeof t->kind, "bpe/%s", st_pretok_name(t->pre));
    return STRATA_OK;
}

static strata_status add_stop(st_tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return STRATA_OK;
    for (int i = 0; i < t->n_stop; i++)
        if (t->stop[i] == id) return STRATA_OK;
    int32_t *s = st_realloc(t->stop, (size_t)(t->n_stop + 1) * sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for %d stop ids", t->n_stop + 1);
    t->stop = s;
    t->stop[t->n_stop++] = id;
    return STRATA_OK;
}

strata_status st_tok_add_stop(st_tokenizer *t, int32_t id) { return add_stop(t, id); }

strata_status st_tok_build_stops(st_tokenizer *t) {
    static const char *const eog[] = {
        "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>",
        "</s>", "<end_of_turn>", "<|end|>", "<|return|>", "<|EOT|>", "<EOT>",
    };
    strata_status st;
    if ((st = add_stop(t, t->eos))) return st;
    for (size_t i = 0; i < sizeof eog / sizeof eog[0]; i++) {
        int32_t id = st_tok_lookup(t, eog[i], strlen(eog[i]));
        if (id >= 0 && (t->attr[id] & ST_TA_CONTROL) && (st = add_stop(t, id))) return st;
    }
    return STRATA_OK;
}

/* ---- public: load / free ------------------------------------------------------------*/
strata_status st_tokenizer_load(const st_model_files *m, st_tokenizer **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_load: NULL out");
    *out = NULL;
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_load: NULL model");
    if (m->format == ST_FORMAT_GGUF) return st_tok_load_gguf(m, out);
    size_t n = strlen(m->path) + 64;
    char *tj = st_malloc(n), *tc = st_malloc(n), *tt = st_malloc(n);
    strata_status st;
    if (!tj || !tc || !tt) {
        st = st_err(STRATA_ERR_NOMEM, "st_tokenizer_load: out of memory for three paths of %zu bytes", n);
        goto done;
    }
    snprintf(tj, n, "%s/tokenizer.json", m->path);
    snprintf(tc, n, "%s/tokenizer_config.json", m->path);
    snprintf(tt, n, "%s/chat_template.jinja", m->path);
    FILE *f = fopen(tj, "rb");
    if (!f) {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: no tokenizer.json in the model directory (needed to "
                    "turn text into tokens)", tj);
        goto done;
    }
    fclose(f);
    f = fopen(tc, "rb");
    if (f) fclose(f);
    if ((st = st_tok_load_json_file(tj, f ? tc : NULL, out))) goto done;
    /* newer transformers save the template beside the config */
    f = (*out)->chat_template ? NULL : fopen(tt, "rb");
    if (f) {
        fclose(f);
        char *text;
        size_t len;
        if ((st = st_file_read_all(tt, &text, &len))) {
            st_tokenizer_free(*out);
            *out = NULL;
            goto done;
        }
        (*out)->chat_template = text;
    }
done:
    st_free(tj);
    st_free(tc);
    st_free(tt);
    return st;
}

strata_status st_tokenizer_load_json(const char *tokenizer_json, const char *tokenizer_config_json,
                                     st_tokenizer **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_load_json: NULL out");
    *out = NULL;
    if (!tokenizer_json) return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_load_json: NULL path");
    return st_tok_load_json_file(tokenizer_json, tokenizer_config_json, out);
}

void st_tokenizer_free(st_tokenizer *t) {
    if (!t) return;
    st_free(t->pool);
    st_free(t->text_off);
    st_free(t->text_len);
    st_free(t->attr);
    st_free(t->scores);
    st_free(t->dec_pool);
    st_free(t->dec_off);
    st_free(t->dec_len);
    st_free(t->vocab.slots);
    st_free(t->vocab.hashes);
    st_pairmap_free(&t->merges);
    st_free(t->stop);
    st_free(t->chat_template);
    st_free(t->split_ids);
    st_free(t);
}

/* ---- encoding -------------------------------------------------------------------------*/
strata_status st_idvec_push(st_idvec *v, int32_t id) {
    if (v->n == v->cap) {
        int64_t c = v->cap ? v->cap * 2 : 64;
        int32_t *p = st_realloc(v->v, (size_t)c * sizeof *p);
        if (!p) return st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for %lld ids", (long long)c);
        v->v = p;
        v->cap = c;
    }
    v->v[v->n++] = id;
    return STRATA_OK;
}

static strata_status encode_text(const st_tokenizer *t, const char *s, size_t len,
                                 st_enc_scratch *sc, st_idvec *out) {
    if (len == 0) return STRATA_OK;
    if (t->type == ST_TOK_SPM) return st_spm_encode_fragment(t, s, len, sc, out);
    strata_status st;
    char *norm = NULL;
    if (t->nfc) {
        size_t nl;
        if ((st = st_utf8_nfc(s, len, &norm, &nl))) return st;
        s = norm;
        len = nl;
    }
    int64_t np;
    st = st_pretok_run(t->pre, s, len, sc, &np);
    /* the bounds live in sc and BPE does not touch them */
    for (int64_t i = 0; !st && i < np; i++) {
        size_t b = (size_t)sc->bounds[i], e = (size_t)sc->bounds[i + 1];
        st = st_bpe_encode_piece(t, s + b, e - b, sc, out);
    }
    st_free(norm);
    return st;
}

/* Whether [pos, pos + tl) lies inside one of the sorted, disjoint spans
 * (pairs of [start, end) offsets); *k is a cursor that only moves forward. */
static bool in_spans(const size_t *spans, int64_t n_spans, int64_t *k, size_t pos, size_t tl) {
    while (*k < n_spans && spans[2 * *k + 1] <= pos) (*k)++;
    return *k < n_spans && spans[2 * *k] <= pos && pos + tl <= spans[2 * *k + 1];
}

static strata_status encode_impl(const st_tokenizer *t, const char *text, size_t len, bool add_special,
                                 bool parse_special, const size_t *spans, int64_t n_spans, int32_t **ids,
                                 int64_t *n) {
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!t || !ids || !n || (!text && len) || (spans && n_spans < 0) || (!spans && n_spans > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_encode: NULL argument");
    char *clean = NULL;
    strata_status st = STRATA_OK;
    if (len && !st_utf8_valid(text, len)) {
        size_t cl;
        if ((st = st_utf8_sanitize(text, len, &clean, &cl))) return st;
        text = clean;
        len = cl;
    }
    st_idvec out = {0};
    st_enc_scratch sc;
    memset(&sc, 0, sizeof sc);
    if (add_special && t->add_bos && t->bos >= 0 && (st = st_idvec_push(&out, t->bos))) goto done;

    /* cut out added / special tokens: leftmost, longest first */
    uint8_t mask = parse_special ? ST_TA_CONTROL : 0;
    if (t->type == ST_TOK_BPE) mask |= ST_TA_USER; /* SPM matches user tokens itself */
    size_t last = 0, pos = 0;
    int64_t span_k = 0;
    while (pos < len) {
        uint8_t b = (uint8_t)text[pos];
        int32_t hit = -1;
        for (int32_t k = t->split_start[b]; mask && k < t->split_start[b + 1]; k++) {
            int32_t id = t->split_ids[k];
            size_t tl = t->text_len[id];
            if ((t->attr[id] & mask) && tl <= len - pos &&
                memcmp(text + pos, t->pool + t->text_off[id], tl) == 0 &&
                (!spans || !(t->attr[id] & ST_TA_CONTROL) || in_spans(spans, n_spans, &span_k, pos, tl))) {
                hit = id;
                break;
            }
        }
        if (hit < 0) {
            pos++;
            continue;
        }
        if ((st = encode_text(t, text + last, pos - last, &sc, &out))) goto done;
        if ((st = st_idvec_push(&out, hit))) goto done;
        pos += t->text_len[hit];
        last = pos;
    }
    if ((st = encode_text(t, text + last, len - last, &sc, &out))) goto done;
    if (add_special && t->add_eos && t->eos >= 0 && (st = st_idvec_push(&out, t->eos))) goto done;

done:
    st_enc_scratch_free(&sc);
    st_free(clean);
    if (st) {
        st_free(out.v);
        return st;
    }
    *ids = out.v;
    *n = out.n;
    return STRATA_OK;
}

strata_status st_tokenizer_encode(const st_tokenizer *t, const char *text, size_t len,
                                  bool add_special, bool parse_special, int32_t **ids, int64_t *n) {
    return encode_impl(t, text, len, add_special, parse_special, NULL, 0, ids, n);
}

strata_status st_tokenizer_encode_spans(const st_tokenizer *t, const char *text, size_t len, bool add_special,
                                        const size_t *spans, int64_t n_spans, int32_t **ids, int64_t *n) {
    static const size_t none[2] = {0, 0};
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!spans) n_spans = 0;
    if (!t || !ids || !n || (!text && len) || n_spans < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_encode_spans: NULL argument");
    for (int64_t k = 0; k < n_spans; k++)
        if (spans[2 * k] > spans[2 * k + 1] || spans[2 * k + 1] > len || (k > 0 && spans[2 * k] < spans[2 * k - 1]))
            return st_err(STRATA_ERR_INVALID_ARG, "st_tokenizer_encode_spans: span %lld is out of order or range",
                          (long long)k);
    if (!len || st_utf8_valid(text, len))
        return encode_impl(t, text, len, add_special, true, n_spans ? spans : none, n_spans, ids, n);
    /* invalid UTF-8: each piece (inside and outside the spans) is sanitized on its own, so
     * that the spans still delimit the same text */
    strata_status st = STRATA_OK;
    char *clean = NULL, *piece = NULL;
    size_t *ns = st_malloc((size_t)(n_spans ? n_spans : 1) * 2 * sizeof *ns);
    size_t cap = len * 3 + 1, used = 0; /* each bad byte becomes at most 3 */
    if (!ns || !(clean = st_malloc(cap))) {
        st = st_err(STRATA_ERR_NOMEM, "tokenizer: out of memory for the clean copy of %zu bytes of text", cap);
        goto out;
    }
    size_t pos = 0;
    for (int64_t k = 0; k <= n_spans && !st; k++) {
        const size_t bounds[2][2] = {{pos, k < n_spans ? spans[2 * k] : len},
                                     {k < n_spans ? spans[2 * k] : len, k < n_spans ? spans[2 * k + 1] : len}};
        for (int j = 0; j < 2 && !st; j++) {
            const size_t a = bounds[j][0], e = bounds[j][1];
            size_t pl = 0;
            if (j == 1 && k < n_spans) ns[2 * k] = used;
            if (e > a) {
                if ((st = st_utf8_sanitize(text + a, e - a, &piece, &pl))) break;
                memcpy(clean + used, piece, pl);
                used += pl;
                st_free(piece);
                piece = NULL;
            }
            if (j == 1 && k < n_spans) ns[2 * k + 1] = used;
        }
        if (k < n_spans) pos = spans[2 * k + 1];
    }
    if (!st) st = encode_impl(t, clean, used, add_special, true, n_spans ? ns : none, n_spans, ids, n);
out:
    st_free(piece);
    st_free(clean);
    st_free(ns);
    return st;
}

/* ---- accessors -------------------------------------------------------------------------*/
int64_t st_tokenizer_vocab_size(const st_tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t st_tokenizer_bos(const st_tokenizer *t) { return t ? t->bos : -1; }
int32_t st_tokenizer_eos(const st_tokenizer *t) { return t ? t->eos : -1; }
int32_t st_tokenizer_unk(const st_tokenizer *t) { return t ? t->unk : -1; }
bool st_tokenizer_adds_bos(const st_tokenizer *t) { return t && t->add_bos && t->bos >= 0; }
bool st_tokenizer_adds_eos(const st_tokenizer *t) { return t && t->add_eos && t->eos >= 0; }

int st_tokenizer_stop_ids(const st_tokenizer *t, const int32_t **ids) {
    if (ids) *ids = t ? t->stop : NULL;
    return t ? t->n_stop : 0;
}

int32_t st_tokenizer_find(const st_tokenizer *t, const char *token_text) {
    if (!t || !token_text) return -1;
    return st_tok_lookup(t, token_text, strlen(token_text));
}

const char *st_tokenizer_token(const st_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_vocab) return NULL;
    if (len) *len = t->text_len[id];
    return t->pool + t->text_off[id];
}

bool st_tokenizer_is_special(const st_tokenizer *t, int32_t id) {
    if (!t || id < 0 || id >= t->n_vocab) return false;
    return (t->attr[id] & (ST_TA_CONTROL | ST_TA_UNKNOWN)) != 0;
}

const char *st_tokenizer_chat_template(const st_tokenizer *t) { return t ? t->chat_template : NULL; }
const char *st_tokenizer_kind(const st_tokenizer *t) { return t ? t->kind : NULL; }

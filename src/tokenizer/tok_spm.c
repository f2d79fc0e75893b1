/* SentencePiece BPE of one text fragment (the text between control tokens).
 *
 * As sentencepiece's BPE model does: the fragment gets a leading space when
 * add_space_prefix, spaces become U+2581 "▁"; the string is cut into UTF-8
 * characters, except that user-defined pieces are matched first at each
 * position (longest) and never merge. Adjacent symbols whose concatenation is a
 * vocabulary piece (normal, user-defined or unused) are candidates; the one with
 * the highest score merges first, the leftmost among equal scores. A final
 * symbol that is not a piece falls back to its <0xXX> byte tokens, or to the
 * unknown token when the vocabulary has no byte tokens. */
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

typedef struct {
    uint32_t start, len; /* bytes of the escaped text; len 0 = merged away */
    int32_t prev, next;
    bool frozen;
} ssym;

typedef struct {
    float score;
    int32_t l, r;
    uint32_t size; /* bytes of the merged piece */
} spair;

static inline bool spair_before(const spair *a, const spair *b) {
    return a->score > b->score || (a->score == b->score && a->l < b->l);
}

static void heap_push(spair *h, size_t *n, spair v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!spair_before(&v, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static spair heap_pop(spair *h, size_t *n) {
    spair top = h[0], v = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && spair_before(&h[c + 1], &h[c])) c++;
        if (!spair_before(&h[c], &v)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = v;
    return top;
}

/* id of a piece that merges may produce / symbols may map to, or -1 */
static int32_t piece_id(const st_tokenizer *t, const char *s, size_t len) {
    int32_t id = st_tok_lookup(t, s, len);
    if (id < 0 || (t->attr[id] & (ST_TA_CONTROL | ST_TA_BYTE | ST_TA_UNKNOWN))) return -1;
    return id;
}

static void try_pair(const st_tokenizer *t, const char *txt, const ssym *sym, int32_t l,
                     spair *heap, size_t *nh) {
    if (l < 0) return;
    int32_t r = sym[l].next;
    if (r < 0 || sym[l].frozen || sym[r].frozen) return;
    uint32_t size = sym[l].len + sym[r].len;
    int32_t id = piece_id(t, txt + sym[l].start, size);
    if (id >= 0) heap_push(heap, nh, (spair){t->scores[id], l, r, size});
}

strata_status st_spm_encode_fragment(const st_tokenizer *t, const char *p, size_t len,
                                     st_enc_scratch *s, st_idvec *out) {
    strata_status st;
    if (len == 0) return STRATA_OK;
    if (len > INT32_MAX / 8) return st_err(STRATA_ERR_INVALID_ARG, "tokenizer: text too long");
    /* escape: "▁" prefix, ' ' -> "▁" (3 bytes) */
    size_t cap = len * 3 + 3;
    if ((st = st_scratch_reserve((void **)&s->buf, &s->buf_cap, cap, 1))) return st;
    char *txt = s->buf;
    size_t n = 0;
    if (t->add_space_prefix) {
        memcpy(txt, "\xE2\x96\x81", 3);
        n = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (p[i] == ' ') {
            memcpy(txt + n, "\xE2\x96\x81", 3);
            n += 3;
        } else {
            txt[n++] = p[i];
        }
    }

    /* symbols: user-defined pieces (longest) or single characters */
    if ((st = st_scratch_reserve(&s->sym, &s->sym_cap, n, sizeof(ssym)))) return st;
    ssym *sym = s->sym;
    int32_t ns = 0;
    for (size_t i = 0; i < n;) {
        uint8_t b = (uint8_t)txt[i];
        size_t l = 0;
        bool frozen = false;
        for (int32_t k = t->split_start[b]; k < t->split_start[b + 1]; k++) {
            int32_t id = t->split_ids[k];
            size_t tl = t->text_len[id];
            if ((t->attr[id] & ST_TA_USER) && tl <= n - i &&
                memcmp(txt + i, t->pool + t->text_off[id], tl) == 0) {
                l = tl;
                frozen = true;
                break;
            }
        }
        if (!l) {
            int sl = st_utf8_seq_len(b);
            l = sl > 0 && (size_t)sl <= n - i ? (size_t)sl : 1;
        }
        sym[ns] = (ssym){(uint32_t)i, (uint32_t)l, ns - 1, -1, frozen};
        if (ns > 0) sym[ns - 1].next = ns;
        ns++;
        i += l;
    }

    if ((st = st_scratch_reserve(&s->heap, &s->heap_cap, (size_t)ns * 2 + 2, sizeof(spair)))) return st;
    spair *heap = s->heap;
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < ns; i++) try_pair(t, txt, sym, i, heap, &nh);
    while (nh) {
        spair top = heap_pop(heap, &nh);
        int32_t l = top.l, r = top.r;
        if (sym[l].len == 0 || sym[r].len == 0 || sym[l].next != r ||
            sym[l].len + sym[r].len != top.size)
            continue; /* stale */
        sym[l].len += sym[r].len;
        sym[r].len = 0;
        sym[l].next = sym[r].next;
        if (sym[r].next >= 0) sym[sym[r].next].prev = l;
        if (nh + 2 > s->heap_cap) {
            if ((st = st_scratch_reserve(&s->heap, &s->heap_cap, nh + 2, sizeof(spair)))) return st;
            heap = s->heap;
        }
        try_pair(t, txt, sym, sym[l].prev, heap, &nh);
        try_pair(t, txt, sym, l, heap, &nh);
    }

    for (int32_t i = ns ? 0 : -1; i >= 0; i = sym[i].next) {
        const char *sp = txt + sym[i].start;
        int32_t id = sym[i].frozen ? st_tok_lookup(t, sp, sym[i].len) : piece_id(t, sp, sym[i].len);
        if (id >= 0) {
            if ((st = st_idvec_push(out, id))) return st;
            continue;
        }
        for (uint32_t k = 0; k < sym[i].len; k++) {
            int32_t bid = t->byte_id[(uint8_t)sp[k]];
            if (bid < 0) {
                if (t->unk >= 0 && (st = st_idvec_push(out, t->unk))) return st;
                break; /* one unknown for the whole symbol */
            }
            if ((st = st_idvec_push(out, bid))) return st;
        }
    }
    return STRATA_OK;
}

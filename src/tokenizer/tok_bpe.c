/* Byte-level BPE of one pre-token piece.
 *
 * The piece's bytes start as one symbol each (the token of the byte's mapped
 * character). Candidate pairs (adjacent symbols whose merge exists) sit in a
 * min-heap keyed by (merge rank, position); the lowest rank is merged first and
 * among equal ranks the leftmost, as HF tokenizers does. Symbols form a linked
 * list, so a merge is O(log n): stale heap entries are recognised on pop by
 * checking the two symbols are still adjacent with the ids they had. */
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/unicode.h"

typedef struct {
    int32_t id;
    int32_t prev, next; /* -1 at the ends */
} bsym;

typedef struct {
    int32_t rank;
    int32_t pos;     /* left symbol */
    int32_t l, r;    /* ids when pushed */
    int32_t merged;
} bpair;

static inline bool pair_less(const bpair *a, const bpair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(bpair *h, size_t *n, bpair v) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!pair_less(&v, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static bpair heap_pop(bpair *h, size_t *n) {
    bpair top = h[0], v = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && pair_less(&h[c + 1], &h[c])) c++;
        if (!pair_less(&h[c], &v)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = v;
    return top;
}

static void try_pair(const st_tokenizer *t, const bsym *sym, int32_t a, bpair *heap, size_t *nh) {
    if (a < 0) return;
    int32_t b = sym[a].next;
    if (b < 0 || sym[a].id < 0 || sym[b].id < 0) return;
    int32_t rank, merged;
    if (st_pairmap_get(&t->merges, sym[a].id, sym[b].id, &rank, &merged))
        heap_push(heap, nh, (bpair){rank, a, sym[a].id, sym[b].id, merged});
}

strata_status st_bpe_encode_piece(const st_tokenizer *t, const char *p, size_t len,
                                  st_enc_scratch *s, st_idvec *out) {
    strata_status st;
    if (len == 0) return STRATA_OK;
    const uint8_t *u = (const uint8_t *)p;
    if (len == 1) return t->byte_id[u[0]] >= 0 ? st_idvec_push(out, t->byte_id[u[0]]) : STRATA_OK;
    if (len > INT32_MAX / 4) return st_err(STRATA_ERR_INVALID_ARG, "tokenizer: piece too long");

    if (t->ignore_merges) {
        /* a piece that is a whole token is taken as is */
        if ((st = st_scratch_reserve((void **)&s->buf, &s->buf_cap, len * 2, 1))) return st;
        size_t k = 0;
        for (size_t i = 0; i < len; i++)
            k += (size_t)st_utf8_encode(st_bytelevel_char(u[i]), (uint8_t *)s->buf + k);
        int32_t id = st_tok_lookup(t, s->buf, k);
        if (id >= 0) return st_idvec_push(out, id);
    }

    if ((st = st_scratch_reserve(&s->sym, &s->sym_cap, len, sizeof(bsym)))) return st;
    if ((st = st_scratch_reserve(&s->heap, &s->heap_cap, len * 2, sizeof(bpair)))) return st;
    bsym *sym = s->sym;
    bpair *heap = s->heap;
    int32_t n = (int32_t)len;
    for (int32_t i = 0; i < n; i++) {
        sym[i].id = t->byte_id[u[i]];
        sym[i].prev = i - 1;
        sym[i].next = i + 1 < n ? i + 1 : -1;
    }
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < n; i++) try_pair(t, sym, i, heap, &nh);
    while (nh) {
        bpair top = heap_pop(heap, &nh);
        int32_t a = top.pos, b = sym[a].next;
        if (sym[a].id != top.l || b < 0 || sym[b].id != top.r) continue; /* stale */
        sym[a].id = top.merged;
        sym[a].next = sym[b].next;
        if (sym[b].next >= 0) sym[sym[b].next].prev = a;
        sym[b].id = -2; /* dead */
        /* each merge adds at most two pairs and removes one symbol: the heap
         * never holds more than 2 * len entries */
        if (nh + 2 > s->heap_cap) {
            if ((st = st_scratch_reserve(&s->heap, &s->heap_cap, nh + 2, sizeof(bpair)))) return st;
            heap = s->heap;
        }
        try_pair(t, sym, sym[a].prev, heap, &nh);
        try_pair(t, sym, a, heap, &nh);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next)
        if (sym[i].id >= 0 && (st = st_idvec_push(out, sym[i].id))) return st;
    return STRATA_OK;
}

/* Fuzzes encoding arbitrary bytes with real tokenizers and decoding the ids
 * back (src/tokenizer: the UTF-8 sanitizer, NFC, the pre-tokenizers, byte-level
 * BPE, SentencePiece BPE, added/special token cutting, spans, the streaming
 * decoder). The tokenizers are loaded once from tests/data/tokenizer: the real
 * SmolLM2 tokenizer.json (bpe/smollm), the four tiny byte-level BPE GGUFs (one
 * per pre-tokenizer: gpt2, llama3, qwen2, smollm) and the SentencePiece GGUF.
 *
 * Input: byte 0 picks the tokenizer (low 3 bits, modulo the count) and the
 * flags (0x08 add_special, 0x10 parse_special, 0x20 skip_special on decode,
 * 0x40 spans cut from the text's own bytes); the rest is the text.
 * Checked beyond memory safety: ids in range; the streamed decode equals the
 * whole one; decode(encode(text)) == the text with invalid UTF-8 replaced by
 * U+FFFD, less the bytes the vocabulary has no token for (and what is left of
 * their characters then replaced as well: byte-level BPE, nothing special
 * added or parsed); encode_spans with
 * the whole text as one span == encode with parse_special, with no span ==
 * encode without. Seeds: tests/fuzz/corpus/tokenize/. */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "loader/loader.h"
#include "tokenizer/tok_internal.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

#define N_TOK 6
static st_tokenizer *g_tok[N_TOK];
/* byte-level BPE: whether byte b has its token (SmolLM2's vocabulary lacks 21
 * of the 256, e.g. 0x1d: such a byte is dropped, as Hugging Face's BPE drops a
 * character with no token and no unk_token) */
static bool g_has_byte[N_TOK][256];

static st_tokenizer *load_gguf(const char *rel) {
    st_model_files *m = NULL;
    st_tokenizer *t = NULL;
    const char *path = fuzz_src_path(rel);
    FUZZ_CHECK(st_model_open(path, &m) == STRATA_OK, "%s: %s", path, st_last_error());
    FUZZ_CHECK(st_tokenizer_load(m, &t) == STRATA_OK, "%s: %s", path, st_last_error());
    st_model_close(m);
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *tj = fuzz_src_path("tests/data/tokenizer/smollm2/tokenizer.json");
    const char *tc = fuzz_src_path("tests/data/tokenizer/smollm2/tokenizer_config.json");
    FUZZ_CHECK(st_tokenizer_load_json(tj, tc, &g_tok[0]) == STRATA_OK, "%s: %s", tj, st_last_error());
    g_tok[1] = load_gguf("tests/data/tokenizer/tiny_bpe_gpt2.gguf");
    g_tok[2] = load_gguf("tests/data/tokenizer/tiny_bpe_llama-bpe.gguf");
    g_tok[3] = load_gguf("tests/data/tokenizer/tiny_bpe_qwen2.gguf");
    g_tok[4] = load_gguf("tests/data/tokenizer/tiny_bpe_smollm.gguf");
    g_tok[5] = load_gguf("tests/data/tokenizer/spm.gguf");
    for (int k = 0; k < N_TOK; k++)
        for (int b = 0; b < 256; b++) {
            char c[8];
            int n = st_utf8_encode(st_bytelevel_char((uint8_t)b), (uint8_t *)c);
            c[n] = '\0';
            g_has_byte[k][b] = st_tokenizer_find(g_tok[k], c) >= 0;
        }
    return 0;
}

static bool same_ids(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, (size_t)na * sizeof *a) == 0);
}

/* Whole and streamed decodes agree; returns the whole one (malloc'd). */
static char *decode(const st_tokenizer *t, const int32_t *ids, int64_t n, bool skip, size_t *len) {
    char *whole = NULL;
    FUZZ_CHECK(st_tokenizer_decode_len(t, ids, n, skip, &whole, len) == STRATA_OK, "decode: %s", st_last_error());
    st_detok *d = NULL;
    FUZZ_CHECK(st_detok_init(t, skip, &d) == STRATA_OK, "detok: %s", st_last_error());
    size_t at = 0;
    for (int64_t i = 0; i <= n; i++) {
        const char *o;
        size_t ol;
        FUZZ_CHECK((i < n ? st_detok_push(d, ids[i], &o, &ol) : st_detok_flush(d, &o, &ol)) == STRATA_OK,
                   "detok of id %lld: %s", (long long)i, st_last_error());
        FUZZ_CHECK(at + ol <= *len && memcmp(whole + at, o, ol) == 0,
                   "%s: streamed decode differs from the whole decode at byte %zu", st_tokenizer_kind(t), at);
        at += ol;
    }
    FUZZ_CHECK(at == *len, "%s: streamed decode has %zu bytes, the whole %zu", st_tokenizer_kind(t), at, *len);
    st_detok_free(d);
    return whole;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t flags = data[0];
    const int tk = (flags & 7) % N_TOK;
    const st_tokenizer *t = g_tok[tk];
    const bool add = flags & 0x08, parse = flags & 0x10, skip = flags & 0x20, cut = flags & 0x40;
    const char *text = (const char *)data + 1;
    const size_t len = size - 1;
    const int64_t nv = st_tokenizer_vocab_size(t);
    const char *kind = st_tokenizer_kind(t);

    int32_t *ids = NULL;
    int64_t n = 0;
    FUZZ_CHECK(st_tokenizer_encode(t, text, len, add, parse, &ids, &n) == STRATA_OK, "%s: encode: %s", kind,
               st_last_error());
    for (int64_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < nv, "%s: id %d", kind, ids[i]);
    size_t dl;
    char *dec = decode(t, ids, n, skip, &dl);

    if (!add && !parse && !skip && strncmp(kind, "bpe/", 4) == 0) {
        char *clean = NULL;
        size_t cl;
        FUZZ_CHECK(st_utf8_sanitize(text, len, &clean, &cl) == STRATA_OK, "sanitize: %s", st_last_error());
        size_t k = 0;
        for (size_t i = 0; i < cl; i++)
            if (g_has_byte[tk][(uint8_t)clean[i]]) clean[k++] = clean[i];
        if (k < cl) { /* what is left of a character dropped in part decodes as U+FFFD */
            char *again = NULL;
            FUZZ_CHECK(st_utf8_sanitize(clean, k, &again, &cl) == STRATA_OK, "sanitize: %s", st_last_error());
            free(clean);
            clean = again;
        }
        FUZZ_CHECK(dl == cl && memcmp(dec, clean, cl) == 0, "%s: decode(encode(text)) is not the text (%zu bytes "
                   "back for %zu)", kind, dl, cl);
        free(clean);
    }
    free(dec);

    /* spans: the whole text, none, or cut at bytes of the text */
    int32_t *sids = NULL, *ref = NULL;
    int64_t sn = 0, rn = 0;
    size_t whole[2] = {0, len};
    FUZZ_CHECK(st_tokenizer_encode_spans(t, text, len, add, whole, 1, &sids, &sn) == STRATA_OK, "%s: spans: %s",
               kind, st_last_error());
    FUZZ_CHECK(st_tokenizer_encode(t, text, len, add, true, &ref, &rn) == STRATA_OK, "encode: %s", st_last_error());
    FUZZ_CHECK(same_ids(sids, sn, ref, rn), "%s: one span over the whole text != parse_special", kind);
    free(sids), free(ref);
    FUZZ_CHECK(st_tokenizer_encode_spans(t, text, len, add, NULL, 0, &sids, &sn) == STRATA_OK, "%s: spans: %s",
               kind, st_last_error());
    FUZZ_CHECK(st_tokenizer_encode(t, text, len, add, false, &ref, &rn) == STRATA_OK, "encode: %s", st_last_error());
    FUZZ_CHECK(same_ids(sids, sn, ref, rn), "%s: no span != no parse_special", kind);
    free(sids), free(ref);
    if (cut && len) {
        /* span bounds at the positions of the bytes '|' in the text */
        size_t *sp = malloc((len + 2) * sizeof *sp);
        FUZZ_CHECK(sp != NULL, "out of memory");
        int64_t k = 0;
        for (size_t i = 0; i < len; i++)
            if (text[i] == '|') sp[k++] = i;
        if (k % 2) sp[k++] = len;
        FUZZ_CHECK(st_tokenizer_encode_spans(t, text, len, add, sp, k / 2, &sids, &sn) == STRATA_OK,
                   "%s: spans: %s", kind, st_last_error());
        for (int64_t i = 0; i < sn; i++) FUZZ_CHECK(sids[i] >= 0 && sids[i] < nv, "%s: id %d", kind, sids[i]);
        free(sids);
        free(sp);
    }
    free(ids);
    return 0;
}

/* Fuzzes loading a Hugging Face tokenizer.json (+ tokenizer_config.json)
 * (src/tokenizer/tok_load_json.c, the vocabulary / merge tables of
 * tokenizer.c) and, when one loads, uses it: encode a few fixed texts with
 * and without special tokens, decode them whole and streamed, the accessors
 * over every id, the chat template's recognition.
 *
 * Input: tokenizer.json, optionally followed by a line "--8<--" and
 * tokenizer_config.json. Seeds: tests/fuzz/corpus/tokenizer_json/
 * (tests/fuzz/make_corpus.sh). */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

static const char *const g_texts[] = {
    "Hello world",
    " \t\n  a1234 b'll <|im_start|>user\nhi<|im_end|></s><s>",
    "\xC3\xA9t\xC3\xA9 \xE2\x96\x81 \xF0\x9F\x98\x80 \xFF\xC0\x80 e\xCC\x81",
};

static void roundtrip(const st_tokenizer *t, const char *text, size_t len, bool special) {
    const int64_t nv = st_tokenizer_vocab_size(t);
    int32_t *ids = NULL;
    int64_t n = 0;
    st_clear_error();
    strata_status st = st_tokenizer_encode(t, text, len, special, special, &ids, &n);
    fuzz_check_error(st, NULL);
    if (st != STRATA_OK) return;
    for (int64_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < nv, "id %d of %lld", ids[i], (long long)nv);
    char *whole = NULL;
    size_t wl = 0;
    st = st_tokenizer_decode_len(t, ids, n, false, &whole, &wl);
    fuzz_check_error(st, NULL);
    st_detok *d = NULL;
    if (st == STRATA_OK && st_detok_init(t, false, &d) == STRATA_OK) {
        size_t at = 0;
        for (int64_t i = 0; i <= n; i++) {
            const char *o;
            size_t ol;
            FUZZ_CHECK((i < n ? st_detok_push(d, ids[i], &o, &ol) : st_detok_flush(d, &o, &ol)) == STRATA_OK,
                       "detok of id %lld: %s", (long long)i, st_last_error());
            FUZZ_CHECK(at + ol <= wl && memcmp(whole + at, o, ol) == 0,
                       "streamed decode differs from the whole decode at byte %zu", at);
            at += ol;
        }
        FUZZ_CHECK(at == wl, "streamed decode has %zu bytes, the whole %zu", at, wl);
    }
    st_detok_free(d);
    free(whole);
    free(ids);
}

static void use(const st_tokenizer *t) {
    for (size_t i = 0; i < sizeof g_texts / sizeof g_texts[0]; i++) {
        roundtrip(t, g_texts[i], strlen(g_texts[i]), false);
        roundtrip(t, g_texts[i], strlen(g_texts[i]), true);
    }
    const int64_t nv = st_tokenizer_vocab_size(t);
    for (int64_t id = 0; id < nv && id < 4096; id++) {
        size_t len;
        const char *s = st_tokenizer_token(t, (int32_t)id, &len);
        FUZZ_CHECK(s != NULL, "no text for id %lld", (long long)id);
        (void)st_tokenizer_is_special(t, (int32_t)id);
    }
    FUZZ_CHECK(st_tokenizer_token(t, (int32_t)nv, &(size_t){0}) == NULL, "a text past the vocabulary");
    const int32_t *stops;
    int ns = st_tokenizer_stop_ids(t, &stops);
    for (int i = 0; i < ns; i++) FUZZ_CHECK(stops[i] >= 0 && stops[i] < nv, "stop id %d", stops[i]);
    const int32_t bos = st_tokenizer_bos(t), eos = st_tokenizer_eos(t), unk = st_tokenizer_unk(t);
    FUZZ_CHECK(bos >= -1 && bos < nv && eos >= -1 && eos < nv && unk >= -1 && unk < nv, "bos %d eos %d unk %d",
               bos, eos, unk);
    st_chat_template ct;
    if (st_chat_detect(st_tokenizer_chat_template(t), &ct) == STRATA_OK) st_chat_template_clear(&ct);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_part parts[2];
    size_t np = fuzz_split(data, size, parts, 2);
    const char *tj = fuzz_write("tokenizer.json", parts[0].p, parts[0].n);
    const char *cj = np > 1 ? fuzz_write("tokenizer_config.json", parts[1].p, parts[1].n) : NULL;
    st_tokenizer *t = NULL;
    st_clear_error();
    strata_status st = st_tokenizer_load_json(tj, cj, &t);
    if (st != STRATA_OK) {
        FUZZ_CHECK(t == NULL, "a failed load returned a tokenizer");
        fuzz_check_error(st, fuzz_dir());
        return 0;
    }
    use(t);
    st_tokenizer_free(t);
    return 0;
}

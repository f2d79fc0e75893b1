/* Tokenizers against references nobody here wrote (tests/data/tokenizer/, made
 * by tools/ref/make_tokenizer_refs.py with HF `tokenizers`, sentencepiece and
 * Python's `regex`):
 *  - ids for every corpus case, plain (no BOS/EOS, specials as text) and special
 *    (BOS/EOS, specials parsed), for the real SmolLM2 tokenizer.json, three
 *    pre-tokenizer variants of it (gpt2, llama3, qwen2), four tiny byte-level BPE
 *    GGUFs (one per tokenizer.ggml.pre) and a SentencePiece BPE GGUF;
 *  - decodes against the references' decodes, decode(encode(x)) == x (after
 *    invalid UTF-8 -> U+FFFD), streaming decode == whole decode with every chunk
 *    valid UTF-8;
 *  - pre-tokenizer splits against Python's `regex` on the published patterns;
 *  - error messages for broken inputs;
 *  - the real SmolLM2 GGUF when present ($STRATA_SMOLLM2_GGUF, /tmp/smol/...,
 *    ~/.cache/strata/...), against the same ids;
 *  - encode speed (printed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/json.h"
#include "loader/loader.h"
#include "testutil.h"
#include "tokenizer/tok_internal.h"
#include "tokenizer/tokenizer.h"

#define DATA "tests/data/tokenizer/"

typedef struct {
    char *name;
    char *raw;
    size_t raw_len;
    char *clean;
    size_t clean_len;
    char *nfc;
    size_t nfc_len;
} tcase;

static tcase *g_cases;
static int g_n_cases;
static cJSON *g_expected;

static char *hex_decode(const char *hex, size_t *len) {
    size_t n = strlen(hex) / 2;
    char *out = malloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(hex + 2 * i, "%2x", &v);
        out[i] = (char)v;
    }
    out[n] = 0;
    *len = n;
    return out;
}

static cJSON *read_json(const char *rel) {
    char *text;
    size_t len;
    cJSON *j = NULL;
    const char *path = test_src_path(rel);
    if (st_file_read_all(path, &text, &len) || st_json_parse(text, len, path, &j)) {
        fprintf(stderr, "cannot read %s: %s\n", path, st_last_error());
        exit(1);
    }
    free(text);
    return j;
}

static void load_corpus(void) {
    cJSON *c = read_json(DATA "corpus.json");
    const cJSON *cases = st_json_field(c, "cases");
    g_n_cases = cJSON_GetArraySize(cases);
    g_cases = calloc((size_t)g_n_cases, sizeof *g_cases);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, cases) {
        tcase *k = &g_cases[i++];
        k->name = strdup(st_json_field(it, "name")->valuestring);
        k->raw = hex_decode(st_json_field(it, "hex")->valuestring, &k->raw_len);
        k->clean = hex_decode(st_json_field(it, "clean_hex")->valuestring, &k->clean_len);
        k->nfc = hex_decode(st_json_field(it, "nfc_hex")->valuestring, &k->nfc_len);
    }
    cJSON_Delete(c);
}

static bool ids_equal(const int32_t *got, int64_t n, const cJSON *want, char *why, size_t whylen) {
    int64_t wn = cJSON_GetArraySize(want);
    int64_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, want) {
        if (i >= n || got[i] != (int32_t)it->valuedouble) {
            snprintf(why, whylen, "at %lld: got %d, want %d (got %lld ids, want %lld)", (long long)i,
                     i < n ? got[i] : -1, (int)it->valuedouble, (long long)n, (long long)wn);
            return false;
        }
        i++;
    }
    if (n != wn) {
        snprintf(why, whylen, "got %lld ids, want %lld", (long long)n, (long long)wn);
        return false;
    }
    return true;
}

static int32_t *json_ids(const cJSON *a, int64_t *n) {
    *n = cJSON_GetArraySize(a);
    int32_t *v = malloc((size_t)(*n ? *n : 1) * sizeof *v);
    int64_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, a) v[i++] = (int32_t)it->valuedouble;
    return v;
}

/* Streams ids one at a time; each chunk must be valid UTF-8; the concatenation
 * must equal the whole decode. */
static void check_stream(const st_tokenizer *t, const int32_t *ids, int64_t n, bool skip,
                         const char *whole, size_t whole_len, const char *label) {
    st_detok *d;
    CHECK(st_detok_init(t, skip, &d) == STRATA_OK);
    size_t cap = whole_len + 64, len = 0;
    char *acc = malloc(cap);
    bool chunks_ok = true;
    for (int64_t i = 0; i <= n; i++) {
        const char *piece;
        size_t pl;
        strata_status st = i < n ? st_detok_push(d, ids[i], &piece, &pl) : st_detok_flush(d, &piece, &pl);
        CHECK(st == STRATA_OK);
        if (st) break;
        if (!st_utf8_valid(piece, pl)) chunks_ok = false;
        if (len + pl + 1 > cap) {
            cap = (len + pl + 1) * 2;
            acc = realloc(acc, cap);
        }
        memcpy(acc + len, piece, pl);
        len += pl;
    }
    CHECK_MSG(chunks_ok, "%s: a streamed chunk is not valid UTF-8", label);
    CHECK_MSG(len == whole_len && !memcmp(acc, whole, len), "%s: streamed decode differs", label);
    free(acc);
    st_detok_free(d);
}

/* Decodes ids and compares with the hex reference `ref_hex` (NULL: no
 * reference) and with want/want_len (NULL: none); then streams. */
static void check_decode(const st_tokenizer *t, const int32_t *ids, int64_t n, bool skip,
                         const char *ref_hex, const char *want, size_t want_len, const char *label,
                         const char *cname) {
    char *s = NULL;
    size_t sl = 0;
    CHECK(st_tokenizer_decode_len(t, ids, n, skip, &s, &sl) == STRATA_OK);
    if (!s) return;
    CHECK(s[sl] == '\0');
    if (ref_hex) {
        size_t rl;
        char *ref = hex_decode(ref_hex, &rl);
        CHECK_MSG(sl == rl && !memcmp(s, ref, sl), "%s/%s: decode (skip=%d) \"%s\" != reference \"%s\"",
                  label, cname, skip, s, ref);
        free(ref);
    }
    if (want)
        CHECK_MSG(sl == want_len && !memcmp(s, want, sl), "%s/%s: decode (skip=%d) \"%s\" != \"%.*s\"",
                  label, cname, skip, s, (int)want_len, want);
    check_stream(t, ids, n, skip, s, sl, label);
    free(s);
}

static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = st_json_field(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int jint(const cJSON *o, const char *k) {
    const cJSON *v = st_json_field(o, k);
    return cJSON_IsNumber(v) ? (int)v->valuedouble : -1;
}

/* Checks every case of entry `e` against tokenizer t. */
static void check_tokenizer(const st_tokenizer *t, const cJSON *e, const char *label) {
    const cJSON *ids = st_json_field(e, "ids"), *dec = st_json_field(e, "decoded");
    const cJSON *plain = st_json_field(ids, "plain"), *special = st_json_field(ids, "special");
    CHECK(cJSON_GetArraySize(plain) == g_n_cases && cJSON_GetArraySize(special) == g_n_cases);
    CHECK_MSG(!strcmp(st_tokenizer_kind(t), jstr(e, "kind")), "%s: kind %s, want %s", label,
              st_tokenizer_kind(t), jstr(e, "kind"));
    CHECK_MSG(st_tokenizer_vocab_size(t) == jint(e, "vocab_size"), "%s: vocab %lld", label,
              (long long)st_tokenizer_vocab_size(t));
    CHECK_MSG(st_tokenizer_bos(t) == jint(e, "bos"), "%s: bos %d", label, st_tokenizer_bos(t));
    CHECK_MSG(st_tokenizer_eos(t) == jint(e, "eos"), "%s: eos %d", label, st_tokenizer_eos(t));
    CHECK(st_tokenizer_adds_bos(t) == cJSON_IsTrue(st_json_field(e, "add_bos")));
    CHECK(st_tokenizer_adds_eos(t) == cJSON_IsTrue(st_json_field(e, "add_eos")));
    bool spm = !strcmp(jstr(e, "kind"), "spm");
    bool nfc = jstr(e, "normalizer") && !strcmp(jstr(e, "normalizer"), "NFC");
    int bad = 0;
    for (int c = 0; c < g_n_cases; c++) {
        const tcase *k = &g_cases[c];
        for (int mode = 0; mode < 2; mode++) {
            int32_t *got = NULL;
            int64_t n = 0;
            strata_status st = st_tokenizer_encode(t, k->raw, k->raw_len, mode == 1, mode == 1, &got, &n);
            CHECK_MSG(st == STRATA_OK, "%s/%s: encode failed: %s", label, k->name, st_last_error());
            char why[160];
            const cJSON *want = cJSON_GetArrayItem(mode ? special : plain, c);
            bool ok = ids_equal(got, n, want, why, sizeof why);
            CHECK_MSG(ok, "%s/%s/%s: ids differ %s", label, k->name, mode ? "special" : "plain", why);
            if (!ok) bad++;
            free(got);
        }

        /* decodes of the reference ids */
        int64_t np, ns;
        int32_t *pids = json_ids(cJSON_GetArrayItem(plain, c), &np);
        int32_t *sids = json_ids(cJSON_GetArrayItem(special, c), &ns);
        /* decode(encode(x)) == x (x after invalid UTF-8 -> U+FFFD, and NFC when the
         * tokenizer normalizes) and == the reference */
        check_decode(t, pids, np, false, cJSON_GetArrayItem(st_json_field(dec, "plain"), c)->valuestring,
                     nfc ? k->nfc : k->clean, nfc ? k->nfc_len : k->clean_len, label, k->name);
        if (!spm) {
            check_decode(t, sids, ns, false,
                         cJSON_GetArrayItem(st_json_field(dec, "special"), c)->valuestring, NULL, 0,
                         label, k->name);
            check_decode(t, sids, ns, true,
                         cJSON_GetArrayItem(st_json_field(dec, "special_skip"), c)->valuestring, NULL,
                         0, label, k->name);
        } else {
            /* SPM with specials: decode(skip=false) gives the clean text back with
             * the parsed control tokens in it (BOS "<s>" in front); skip=true the
             * text without them */
            char *w = malloc(k->clean_len + 4);
            memcpy(w, "<s>", 3);
            memcpy(w + 3, k->clean, k->clean_len);
            check_decode(t, sids, ns, false, NULL, w, k->clean_len + 3, label, k->name);
            free(w);
            check_decode(t, sids, ns, true, NULL, NULL, 0, label, k->name);
        }
        free(pids);
        free(sids);
    }
    if (bad) fprintf(stderr, "%s: %d encodings differ\n", label, bad);
}

static void time_encode(const st_tokenizer *t, const char *label) {
    int64_t tokens = 0, bytes = 0;
    double t0 = st_time_now(), t1 = t0;
    int reps = 0;
    while (t1 - t0 < 0.3 || reps < 2) {
        for (int c = 0; c < g_n_cases; c++) {
            int32_t *ids;
            int64_t n;
            if (st_tokenizer_encode(t, g_cases[c].raw, g_cases[c].raw_len, false, true, &ids, &n)) continue;
            tokens += n;
            bytes += (int64_t)g_cases[c].raw_len;
            free(ids);
        }
        reps++;
        t1 = st_time_now();
    }
    printf("encode %-14s %8.0f tokens/s  %6.2f MB/s  (corpus x%d, %.3f s)\n", label,
           (double)tokens / (t1 - t0), (double)bytes / (t1 - t0) / 1e6, reps, t1 - t0);
}

/* tokenizer.json of a variant: the variant file with model.vocab and
 * model.merges spliced back from the base tokenizer.json. */
static const char *write_variant(const char *variant_rel, const char *base_rel, const char *dir,
                                 const char *name) {
    static char path[1100];
    cJSON *v = read_json(variant_rel), *b = read_json(base_rel);
    cJSON *vm = cJSON_GetObjectItemCaseSensitive(v, "model");
    cJSON *bm = cJSON_GetObjectItemCaseSensitive(b, "model");
    cJSON_AddItemToObject(vm, "vocab", cJSON_DetachItemFromObjectCaseSensitive(bm, "vocab"));
    cJSON_AddItemToObject(vm, "merges", cJSON_DetachItemFromObjectCaseSensitive(bm, "merges"));
    char *s = cJSON_PrintUnformatted(v);
    snprintf(path, sizeof path, "%s/%s.tokenizer.json", dir, name);
    CHECK(test_write_file(path, s, strlen(s)));
    free(s);
    cJSON_Delete(v);
    cJSON_Delete(b);
    return path;
}

static void check_splits(void) {
    const cJSON *splits = st_json_field(g_expected, "splits");
    const cJSON *it;
    int checked = 0;
    cJSON_ArrayForEach(it, splits) {
        st_pretok pre;
        CHECK_MSG(st_pretok_from_name(it->string, &pre), "unknown pre-tokenizer %s", it->string);
        for (int c = 0; c < g_n_cases; c++) {
            size_t *lens;
            int64_t n;
            CHECK(st_pretok_split(pre, g_cases[c].clean, g_cases[c].clean_len, &lens, &n) == STRATA_OK);
            char why[160];
            const cJSON *want = cJSON_GetArrayItem(it, c);
            int32_t *l32 = malloc((size_t)(n ? n : 1) * sizeof *l32);
            for (int64_t i = 0; i < n; i++) l32[i] = (int32_t)lens[i];
            CHECK_MSG(ids_equal(l32, n, want, why, sizeof why), "split %s/%s: piece lengths %s",
                      it->string, g_cases[c].name, why);
            free(l32);
            free(lens);
            checked++;
        }
    }
    CHECK(checked == 4 * g_n_cases);
    /* invalid UTF-8 is refused by the splitter */
    size_t *lens;
    int64_t n;
    CHECK_ERR(st_pretok_split(ST_PRETOK_GPT2, "a\xff", 2, &lens, &n), STRATA_ERR_INVALID_ARG, "UTF-8");
}

/* "0041 0301" -> UTF-8 */
static size_t cps_to_utf8(const char *hex, char *out) {
    size_t k = 0;
    char *end;
    for (const char *p = hex; *p;) {
        while (*p == ' ') p++;
        if (!*p) break;
        unsigned long cp = strtoul(p, &end, 16);
        p = end;
        if (cp < 0x80) out[k++] = (char)cp;
        else if (cp < 0x800) {
            out[k++] = (char)(0xC0 | (cp >> 6));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[k++] = (char)(0xE0 | (cp >> 12));
            out[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else {
            out[k++] = (char)(0xF0 | (cp >> 18));
            out[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
            out[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[k] = 0;
    return k;
}

/* NFC against Unicode's NormalizationTest.txt (c2 = NFC(c1) = NFC(c2) = NFC(c3))
 * and against Python's unicodedata on the corpus. */
static void check_nfc(void) {
    char *text;
    size_t len;
    CHECK(st_file_read_all(test_src_path(DATA "nfc_tests.txt"), &text, &len) == STRATA_OK);
    int lines = 0, bad = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] == '#') continue;
        char *f2 = strchr(line, ';'), *f3 = f2 ? strchr(f2 + 1, ';') : NULL;
        if (!f3) continue;
        *f2++ = 0;
        *f3++ = 0;
        char c[3][256];
        size_t cl[3] = {cps_to_utf8(line, c[0]), cps_to_utf8(f2, c[1]), cps_to_utf8(f3, c[2])};
        for (int k = 0; k < 3; k++) {
            char *o;
            size_t ol;
            if (st_utf8_nfc(c[k], cl[k], &o, &ol) != STRATA_OK) {
                bad++;
                continue;
            }
            if (ol != cl[1] || memcmp(o, c[1], ol)) {
                if (bad < 5) fprintf(stderr, "NFC(c%d) of [%s] != [%s]\n", k + 1, k == 0 ? line : k == 1 ? f2 : f3, f2);
                bad++;
            }
            free(o);
        }
        lines++;
    }
    free(text);
    CHECK_MSG(bad == 0, "%d NormalizationTest results differ", bad);
    CHECK(lines > 4000);
    for (int c = 0; c < g_n_cases; c++) {
        char *o;
        size_t ol;
        CHECK(st_utf8_nfc(g_cases[c].clean, g_cases[c].clean_len, &o, &ol) == STRATA_OK);
        CHECK_MSG(ol == g_cases[c].nfc_len && !memcmp(o, g_cases[c].nfc, ol), "NFC of %s differs",
                  g_cases[c].name);
        free(o);
    }
}

static void check_sanitize(void) {
    for (int c = 0; c < g_n_cases; c++) {
        char *s;
        size_t n;
        CHECK(st_utf8_sanitize(g_cases[c].raw, g_cases[c].raw_len, &s, &n) == STRATA_OK);
        CHECK_MSG(n == g_cases[c].clean_len && !memcmp(s, g_cases[c].clean, n),
                  "sanitize %s differs from Python's decode('utf-8', 'replace')", g_cases[c].name);
        CHECK(st_utf8_valid(s, n));
        CHECK(st_utf8_valid(g_cases[c].raw, g_cases[c].raw_len) == (strncmp(g_cases[c].name, "invalid", 7) != 0));
        free(s);
    }
}

/* Byte-level pieces that split a character across tokens; invalid bytes. */
static void check_stream_bytes(const st_tokenizer *t) {
    /* GPT-2 byte map (HF ByteLevel of U+1F600 is "ðŁĺĢ"): 0xF0 -> U+00F0 "ð",
     * 0x9F -> U+0141 "Ł", 0x98 -> U+013A "ĺ", 0x80 -> U+0122 "Ģ" */
    int32_t f0 = st_tokenizer_find(t, "\xC3\xB0"), x9f = st_tokenizer_find(t, "\xC5\x81");
    int32_t x98 = st_tokenizer_find(t, "\xC4\xBA"), x80 = st_tokenizer_find(t, "\xC4\xA2");
    int32_t a = st_tokenizer_find(t, "a");
    CHECK(f0 >= 0 && x9f >= 0 && x98 >= 0 && x80 >= 0 && a >= 0);
    st_detok *d;
    CHECK(st_detok_init(t, true, &d) == STRATA_OK);
    const char *o;
    size_t n;
    /* U+1F600 byte by byte: nothing until the last byte */
    int32_t seq[] = {f0, x9f, x98, x80};
    for (int i = 0; i < 4; i++) {
        CHECK(st_detok_push(d, seq[i], &o, &n) == STRATA_OK);
        CHECK(i < 3 ? n == 0 : (n == 4 && !memcmp(o, "\xF0\x9F\x98\x80", 4)));
    }
    /* a truncated sequence becomes one U+FFFD as soon as it is known bad */
    CHECK(st_detok_push(d, f0, &o, &n) == STRATA_OK && n == 0);
    CHECK(st_detok_push(d, x9f, &o, &n) == STRATA_OK && n == 0);
    CHECK(st_detok_push(d, a, &o, &n) == STRATA_OK);
    CHECK(n == 4 && !memcmp(o, "\xEF\xBF\xBD" "a", 4));
    /* a lone continuation byte: U+FFFD at once */
    CHECK(st_detok_push(d, x80, &o, &n) == STRATA_OK && n == 3 && !memcmp(o, "\xEF\xBF\xBD", 3));
    /* pending at the end: flush gives U+FFFD */
    CHECK(st_detok_push(d, f0, &o, &n) == STRATA_OK && n == 0);
    CHECK(st_detok_flush(d, &o, &n) == STRATA_OK && n == 3 && !memcmp(o, "\xEF\xBF\xBD", 3));
    CHECK(st_detok_flush(d, &o, &n) == STRATA_OK && n == 0);
    CHECK_ERR(st_detok_push(d, (int32_t)st_tokenizer_vocab_size(t), &o, &n), STRATA_ERR_INVALID_ARG,
              "out of range");
    st_detok_free(d);
}

static void check_smollm2_api(const st_tokenizer *t) {
    CHECK(st_tokenizer_find(t, "<|im_start|>") == 1);
    CHECK(st_tokenizer_find(t, "<|im_end|>") == 2);
    CHECK(st_tokenizer_find(t, "no-such-token-here") == -1);
    CHECK(st_tokenizer_is_special(t, 1) && !st_tokenizer_is_special(t, 19556));
    size_t len;
    const char *tx = st_tokenizer_token(t, 19556, &len);
    CHECK(tx && len == 5 && !memcmp(tx, "Hello", 5));
    CHECK(st_tokenizer_token(t, -1, &len) == NULL);
    const char *ct = st_tokenizer_chat_template(t);
    CHECK(ct && strstr(ct, "<|im_start|>"));
    const int32_t *stop;
    int ns = st_tokenizer_stop_ids(t, &stop);
    bool has2 = false, has0 = false;
    for (int i = 0; i < ns; i++) {
        has2 |= stop[i] == 2;
        has0 |= stop[i] == 0;
    }
    CHECK_MSG(has2 && has0, "stop ids should hold <|im_end|> (2) and <|endoftext|> (0)");
    /* empty text */
    int32_t *ids;
    int64_t n;
    CHECK(st_tokenizer_encode(t, "", 0, true, true, &ids, &n) == STRATA_OK && n == 0);
    free(ids);
    CHECK_ERR(st_tokenizer_encode(t, NULL, 3, false, false, &ids, &n), STRATA_ERR_INVALID_ARG, "NULL");
}

static void check_errors(void) {
    const char *dir = test_tmpdir("tokenizer-bad");
    char p[1200], q[1200];
    st_tokenizer *t = (st_tokenizer *)1;

    snprintf(p, sizeof p, "%s/invalid.json", dir);
    test_write_file(p, "{\"model\": {\"vocab\": ", 20);
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_FORMAT, "invalid.json");
    CHECK(t == NULL);

    snprintf(p, sizeof p, "%s/novocab.json", dir);
    const char *nov = "{\"model\": {\"type\": \"BPE\", \"merges\": []}, \"pre_tokenizer\": "
                      "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}}";
    test_write_file(p, nov, strlen(nov));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_NOT_FOUND, "novocab.json", "model.vocab");

    snprintf(p, sizeof p, "%s/unknown_pre.json", dir);
    const char *unk = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                      "\"pre_tokenizer\": {\"type\": \"Whitespace\"}}";
    test_write_file(p, unk, strlen(unk));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_UNSUPPORTED, "unknown_pre.json",
              "Whitespace");

    snprintf(p, sizeof p, "%s/unknown_regex.json", dir);
    const char *urx = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                      "\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": "
                      "\"Split\", \"pattern\": {\"Regex\": \"\\\\w+|[^\\\\w\\\\s]+\"}, \"behavior\": "
                      "\"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", \"use_regex\": false}]}}";
    test_write_file(p, urx, strlen(urx));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_UNSUPPORTED, "unknown_regex.json",
              "pattern.Regex", "\\w+");

    snprintf(p, sizeof p, "%s/badmerge.json", dir);
    const char *bm = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": "
                     "[\"a b\"]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    test_write_file(p, bm, strlen(bm));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_FORMAT, "badmerge.json",
              "model.merges[0]", "merged token");

    snprintf(p, sizeof p, "%s/wordpiece.json", dir);
    const char *wp = "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}";
    test_write_file(p, wp, strlen(wp));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_UNSUPPORTED, "wordpiece.json",
              "WordPiece");

    /* a few tokens with huge ids (dense tables: gigabytes) are refused; gaps up to
       the token count + 65536 are not */
    snprintf(p, sizeof p, "%s/hugeid.json", dir);
    const char *hi = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 94444443}, \"merges\": []}, "
                     "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    test_write_file(p, hi, strlen(hi));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_FORMAT, "hugeid.json", "model.vocab[\"b\"]",
              "94444443", "2 tokens");
    CHECK(t == NULL);
    snprintf(p, sizeof p, "%s/hugeadded.json", dir);
    const char *ha = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                     "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, "
                     "\"added_tokens\": [{\"id\": 70000, \"content\": \"<x>\", \"special\": true}]}";
    test_write_file(p, ha, strlen(ha));
    CHECK_ERR(st_tokenizer_load_json(p, NULL, &t), STRATA_ERR_FORMAT, "hugeadded.json", "added_tokens[0].id",
              "70000");
    snprintf(p, sizeof p, "%s/gaps.json", dir);
    const char *gp = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                     "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}, "
                     "\"added_tokens\": [{\"id\": 65537, \"content\": \"<x>\", \"special\": true}]}";
    test_write_file(p, gp, strlen(gp));
    CHECK_MSG(st_tokenizer_load_json(p, NULL, &t) == STRATA_OK, "gaps.json: %s", st_last_error());
    if (t) CHECK(st_tokenizer_vocab_size(t) == 65538 && st_tokenizer_find(t, "<x>") == 65537);
    st_tokenizer_free(t);
    t = NULL;

    /* config naming a token the vocabulary lacks */
    snprintf(p, sizeof p, "%s/ok.json", dir);
    const char *ok = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, "
                     "\"merges\": [[\"a\", \"b\"]]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
    test_write_file(p, ok, strlen(ok));
    snprintf(q, sizeof q, "%s/tokenizer_config.json", dir);
    const char *cfg = "{\"bos_token\": {\"content\": \"<s>\"}}";
    test_write_file(q, cfg, strlen(cfg));
    CHECK_ERR(st_tokenizer_load_json(p, q, &t), STRATA_ERR_NOT_FOUND, "tokenizer_config.json",
              "bos_token", "<s>");
    CHECK(st_tokenizer_load_json(p, NULL, &t) == STRATA_OK);
    if (t) {
        int32_t *ids;
        int64_t n;
        CHECK(st_tokenizer_encode(t, "abba", 4, true, true, &ids, &n) == STRATA_OK);
        /* bytes missing from this toy vocabulary are dropped, "ab" merges */
        CHECK(n == 3 && ids[0] == 2 && ids[1] == 1 && ids[2] == 0);
        free(ids);
        st_tokenizer_free(t);
    }

    st_model_files *m = NULL;
    CHECK(st_model_open(test_src_path(DATA "bad_notokens.gguf"), &m) == STRATA_OK);
    if (m) {
        CHECK_ERR(st_tokenizer_load(m, &t), STRATA_ERR_NOT_FOUND, "bad_notokens.gguf",
                  "tokenizer.ggml.tokens");
        st_model_close(m);
    }
    m = NULL;
    CHECK(st_model_open(test_src_path(DATA "bad_pre.gguf"), &m) == STRATA_OK);
    if (m) {
        CHECK_ERR(st_tokenizer_load(m, &t), STRATA_ERR_UNSUPPORTED, "bad_pre.gguf", "tokenizer.ggml.pre",
                  "mystery-pre");
        st_model_close(m);
    }
    /* a HF directory without tokenizer.json */
    m = NULL;
    CHECK(st_model_open(test_src_path("tests/data/models/gqa_f32"), &m) == STRATA_OK);
    if (m) {
        CHECK_ERR(st_tokenizer_load(m, &t), STRATA_ERR_NOT_FOUND, "gqa_f32/tokenizer.json");
        st_model_close(m);
    }
    CHECK_ERR(st_tokenizer_load_json(test_src_path(DATA "does-not-exist.json"), NULL, &t),
              STRATA_ERR_IO, "does-not-exist.json");
    st_tokenizer_free(NULL);
    st_detok_free(NULL);
}

/* SentencePiece byte tokens decode to their byte only when exactly "<0xHH>",
 * the last token of the text pool included (the pool is not NUL-terminated:
 * the decoder must not read past the token's 6 bytes). */
static void check_spm_byte_tokens(void) {
    static const char *const texts[] = {"<unk>", "\u2581a", "<0x 4>", "<0x4g>", "<0x+4>", "<0x7e>", "<0x41>"};
    const int n = (int)(sizeof texts / sizeof texts[0]);
    size_t pool = 0;
    for (int i = 0; i < n; i++) pool += strlen(texts[i]);
    st_tokenizer *t = NULL;
    CHECK(st_tok_alloc(&t, ST_TOK_SPM, n, pool, "bytes") == STRATA_OK);
    if (!t) return;
    size_t pos = 0;
    for (int i = 0; i < n; i++) {
        st_tok_set_text(t, i, texts[i], strlen(texts[i]), &pos);
        t->attr[i] = i == 0 ? ST_TA_UNKNOWN : i == 1 ? 0 : ST_TA_BYTE;
    }
    t->unk = 0;
    CHECK(st_tok_finish(t, "bytes") == STRATA_OK);
    static const struct {
        int32_t id;
        const char *want;
        size_t len;
    } cases[] = {{6, "A", 1}, {5, "~", 1}, {2, "<0x 4>", 6}, {3, "<0x4g>", 6}, {4, "<0x+4>", 6}, {1, " a", 2}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char *out = NULL;
        size_t len = 0;
        /* after "\xE2\x96\x81a", which decodes to "a" at the start (the encoder's space dropped) */
        const int32_t ids[2] = {1, cases[k].id};
        CHECK(st_tokenizer_decode_len(t, ids, 2, false, &out, &len) == STRATA_OK);
        CHECK_MSG(out && len == 1 + cases[k].len && out[0] == 'a' && !memcmp(out + 1, cases[k].want, cases[k].len),
                  "id %d decodes to %zu bytes '%.*s'", cases[k].id, len, (int)len, out ? out : "");
        free(out);
    }
    st_tokenizer_free(t);
}

/* st_tokenizer_load on a HF directory: the tiny test model's weights (linked)
 * with the SmolLM2 tokenizer files beside them. */
static void check_hf_dir(void) {
    const char *dir = test_tmpdir("tokenizer-hfdir");
    char a[1200], b[1200];
    const char *files[][2] = {
        {"tests/data/models/gqa_f32/config.json", "config.json"},
        {"tests/data/models/gqa_f32/model.safetensors", "model.safetensors"},
        {DATA "smollm2/tokenizer.json", "tokenizer.json"},
        {DATA "smollm2/tokenizer_config.json", "tokenizer_config.json"},
    };
    for (int i = 0; i < 4; i++) {
        const char *src = test_src_path(files[i][0]);
        snprintf(b, sizeof b, "%s/%s", dir, files[i][1]);
        unlink(b);
        if (src[0] != '/') {
            char cwd[600];
            CHECK(getcwd(cwd, sizeof cwd) != NULL);
            snprintf(a, sizeof a, "%s/%s", cwd, src);
            src = a;
        }
        CHECK_MSG(symlink(src, b) == 0, "symlink %s -> %s", b, src);
    }
    st_model_files *m = NULL;
    st_tokenizer *t = NULL;
    CHECK(st_model_open(dir, &m) == STRATA_OK);
    if (m) CHECK_MSG(st_tokenizer_load(m, &t) == STRATA_OK, "%s", st_last_error());
    st_model_close(m);
    if (t) {
        CHECK(!strcmp(st_tokenizer_kind(t), "bpe/smollm"));
        CHECK(st_tokenizer_bos(t) == 1 && st_tokenizer_eos(t) == 2 && !st_tokenizer_adds_bos(t));
        CHECK(st_tokenizer_chat_template(t) != NULL);
        int32_t *ids;
        int64_t n;
        CHECK(st_tokenizer_encode(t, "Hello world", 11, true, true, &ids, &n) == STRATA_OK);
        CHECK(n == 2 && ids[0] == 19556 && ids[1] == 905);
        free(ids);
        st_tokenizer_free(t);
    }
}

int main(void) {
    load_corpus();
    g_expected = read_json(DATA "expected.json");
    check_sanitize();
    check_splits();
    check_nfc();
    check_spm_byte_tokens();

    const char *tmp = test_tmpdir("tokenizer");
    const cJSON *e;
    const cJSON *smol_entry = NULL;
    cJSON_ArrayForEach(e, st_json_field(g_expected, "tokenizers")) {
        const char *name = jstr(e, "name");
        st_tokenizer *t = NULL;
        strata_status st;
        if (jstr(e, "json")) {
            char cfg[1024] = "";
            char rel[256];
            if (jstr(e, "config")) {
                snprintf(rel, sizeof rel, DATA "%s", jstr(e, "config"));
                snprintf(cfg, sizeof cfg, "%s", test_src_path(rel));
            }
            snprintf(rel, sizeof rel, DATA "%s", jstr(e, "json"));
            double t0 = st_time_now();
            st = st_tokenizer_load_json(test_src_path(rel), cfg[0] ? cfg : NULL, &t);
            printf("load %-14s %.1f ms\n", name, (st_time_now() - t0) * 1e3);
        } else if (jstr(e, "json_variant")) {
            char rel_v[256], rel_b[256];
            snprintf(rel_v, sizeof rel_v, DATA "%s", jstr(e, "json_variant"));
            snprintf(rel_b, sizeof rel_b, DATA "%s", jstr(e, "json_base"));
            st = st_tokenizer_load_json(write_variant(rel_v, rel_b, tmp, name), NULL, &t);
        } else {
            char rel[256];
            snprintf(rel, sizeof rel, DATA "%s", jstr(e, "gguf"));
            st_model_files *m = NULL;
            st = st_model_open(test_src_path(rel), &m);
            if (!st) st = st_tokenizer_load(m, &t);
            st_model_close(m); /* the tokenizer must not depend on the model */
        }
        CHECK_MSG(st == STRATA_OK, "%s: load failed: %s", name, st_last_error());
        if (!t) continue;
        check_tokenizer(t, e, name);
        if (!strcmp(name, "smollm2")) {
            smol_entry = e;
            check_smollm2_api(t);
            check_stream_bytes(t);
            time_encode(t, name);
        }
        if (!strcmp(name, "llama3") || !strcmp(name, "spm")) time_encode(t, name);
        if (!strcmp(name, "spm")) {
            CHECK(st_tokenizer_chat_template(t) && strstr(st_tokenizer_chat_template(t), "[INST]"));
            CHECK(st_tokenizer_unk(t) == 0 && st_tokenizer_is_special(t, 0) && st_tokenizer_is_special(t, 1));
            CHECK(st_tokenizer_find(t, "<0x41>") >= 0 && !st_tokenizer_is_special(t, st_tokenizer_find(t, "<0x41>")));
        }
        st_tokenizer_free(t);
    }

    const char *real = test_default_model_path();
    if (real && smol_entry) {
        st_model_files *m = NULL;
        st_tokenizer *t = NULL;
        CHECK(st_model_open(real, &m) == STRATA_OK);
        if (m) CHECK_MSG(st_tokenizer_load(m, &t) == STRATA_OK, "%s: %s", real, st_last_error());
        st_model_close(m);
        if (t) {
            printf("real SmolLM2 GGUF: %s\n", real);
            check_tokenizer(t, smol_entry, "smollm2-gguf");
            check_smollm2_api(t);
            st_tokenizer_free(t);
        }
    } else {
        CHECK_MSG(real != NULL, "the real SmolLM2 GGUF is missing: run scripts/fetch-default-model.sh "
                                "(or set STRATA_SMOLLM2_GGUF)");
    }

    check_errors();
    check_hf_dir();
    for (int c = 0; c < g_n_cases; c++) {
        free(g_cases[c].name);
        free(g_cases[c].raw);
        free(g_cases[c].clean);
        free(g_cases[c].nfc);
    }
    free(g_cases);
    cJSON_Delete(g_expected);
    return test_finish("test_tokenizer");
}

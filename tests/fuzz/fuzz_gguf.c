/* Fuzzes the GGUF reader (src/loader/gguf.c) on file images in memory
 * (st_gguf_open_mem: a read past the end of the input is an ASan report), then
 * what reads an opened GGUF: every key's value and array elements, the
 * recommended sampling (general.sampling.*), the tokenizer
 * (src/tokenizer/tok_load_gguf.c) and, when it loads, one encode/decode and
 * the chat template's recognition.
 * Seeds: tests/fuzz/corpus/gguf/ (tests/fuzz/make_corpus.sh). */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "loader/gguf.h"
#include "loader/loader.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

#define NAME "fuzz.gguf"

static volatile uint8_t g_sink;

static void walk_keys(const st_gguf_meta *g) {
    for (int64_t i = 0; i < st_gguf_n_keys(g); i++) {
        const char *key = st_gguf_key_name(g, i);
        if (i < 256) /* a linear search: not for every key of a file of thousands */
            FUZZ_CHECK(st_gguf_find_key(g, key) == i, "key '%s' found at another index", key);
        const uint8_t *raw;
        uint64_t raw_len;
        st_gguf_key_raw(g, i, &raw, &raw_len);
        if (raw_len) g_sink ^= raw[0] ^ raw[raw_len - 1];
        st_gguf_type ty = st_gguf_key_type(g, i);
        if (ty == ST_GGUF_TYPE_STRING) {
            const char *s;
            uint64_t len;
            FUZZ_CHECK(st_gguf_get_str(g, key, &s, &len) == STRATA_OK, "string key '%s'", key);
            FUZZ_CHECK(s[len] == '\0', "string key '%s' not terminated", key);
        } else if (ty == ST_GGUF_TYPE_ARRAY) {
            int64_t ki;
            st_gguf_type et;
            uint64_t n;
            FUZZ_CHECK(st_gguf_get_arr(g, key, &ki, &et, &n) == STRATA_OK && ki == i, "array key '%s'", key);
            for (uint64_t k = 0; k < n; k++) {
                if (k == 64 && n > 128) k = n - 64; /* the ends of long arrays */
                const char *s;
                uint64_t len;
                int64_t v;
                double d;
                if (et == ST_GGUF_TYPE_STRING) {
                    FUZZ_CHECK(st_gguf_arr_str(g, ki, k, &s, &len), "'%s'[%llu]", key, (unsigned long long)k);
                    if (len) g_sink ^= (uint8_t)(s[0] ^ s[len - 1]);
                } else {
                    FUZZ_CHECK(st_gguf_arr_f64(g, ki, k, &d), "'%s'[%llu]", key, (unsigned long long)k);
                    if (st_gguf_arr_i64(g, ki, k, &v)) g_sink ^= (uint8_t)v;
                }
            }
            FUZZ_CHECK(!st_gguf_arr_f64(g, ki, n, &(double){0}), "'%s': element past the end", key);
        } else {
            int64_t v;
            double d;
            bool b;
            (void)st_gguf_get_i64(g, key, &v);
            (void)st_gguf_get_f64(g, key, &d);
            (void)st_gguf_get_bool(g, key, &b);
        }
    }
}

static void use_tokenizer(const st_tokenizer *t) {
    static const char text[] = "Hello, world! <|im_start|>user\n  12345 \xC3\xA9t\xC3\xA9 \xE2\x96\x81x <s></s>\xFF";
    int32_t *ids = NULL;
    int64_t n = 0;
    strata_status st = st_tokenizer_encode(t, text, sizeof text - 1, true, true, &ids, &n);
    fuzz_check_error(st, NULL);
    if (st == STRATA_OK) {
        for (int64_t i = 0; i < n; i++)
            FUZZ_CHECK(ids[i] >= 0 && ids[i] < st_tokenizer_vocab_size(t), "id %d out of range", ids[i]);
        char *s = NULL;
        size_t len = 0;
        st = st_tokenizer_decode_len(t, ids, n, false, &s, &len);
        fuzz_check_error(st, NULL);
        free(s);
    }
    free(ids);
    st_chat_template ct;
    if (st_chat_detect(st_tokenizer_chat_template(t), &ct) == STRATA_OK) st_chat_template_clear(&ct);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    st_model_files *m = NULL;
    st_clear_error();
    strata_status st = st_gguf_open_mem(data, size, NAME, &m);
    if (st != STRATA_OK) {
        FUZZ_CHECK(m == NULL, "a failed open returned a model");
        fuzz_check_error(st, NAME);
        return 0;
    }
    /* every tensor lies inside the file */
    for (int64_t i = 0; i < m->n_tensors; i++) {
        const st_tensor_desc *t = &m->tensors[i];
        FUZZ_CHECK(t->file == 0 && t->offset <= size && t->nbytes <= size - t->offset,
                   "tensor '%s' [%llu, +%llu) outside the %zu bytes", t->name, (unsigned long long)t->offset,
                   (unsigned long long)t->nbytes, size);
        if (t->nbytes) {
            const uint8_t *p = st_tensor_data(m, t);
            g_sink ^= p[0] ^ p[t->nbytes - 1];
        }
    }
    walk_keys(m->gguf);
    st_sampling_defaults sd;
    fuzz_check_error(st_sampling_defaults_read(m, &sd), NAME);
    st_tokenizer *t = NULL;
    st_clear_error();
    st = st_tokenizer_load(m, &t);
    fuzz_check_error(st, NAME);
    if (st == STRATA_OK) use_tokenizer(t);
    st_tokenizer_free(t);
    st_model_close(m);
    return 0;
}

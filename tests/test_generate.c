/* Generation loop and stop strings:
 *  - the stop-string filter: a stop string split across pieces, the earliest
 *    of several, a held-back prefix released when it turns out not to be one,
 *    overlapping prefixes, UTF-8 stop strings, errors;
 *  - st_generate on a tiny GGUF llama with a real BPE vocabulary
 *    (tests/data/tokenizer/tiny_bpe_smollm.gguf): greedy ids equal a
 *    hand-written prefill + argmax loop over st_llama_forward; the streamed
 *    text equals the decode of those ids, piece by piece valid UTF-8; the KV
 *    cache holds prompt + n_fed tokens; continuing with last_token gives the
 *    same tokens as one long run; max_tokens, stop strings, the callback's
 *    stop and a full context end generation with the right reason; seeded
 *    sampling repeats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/generate.h"
#include "testutil.h"

/* ---- stop filter --------------------------------------------------------------*/
typedef struct {
    char text[512];
    size_t len;
    bool stopped;
} sink;

static void push(st_stop_filter *f, sink *s, const char *piece) {
    const char *out;
    size_t n;
    bool stopped;
    CHECK(st_stop_filter_push(f, piece, strlen(piece), &out, &n, &stopped) == STRATA_OK);
    CHECK(s->len + n < sizeof s->text);
    memcpy(s->text + s->len, out, n);
    s->len += n;
    s->text[s->len] = 0;
    s->stopped = stopped;
}

static void flush(st_stop_filter *f, sink *s) {
    const char *out;
    size_t n;
    st_stop_filter_flush(f, &out, &n);
    memcpy(s->text + s->len, out, n);
    s->len += n;
    s->text[s->len] = 0;
}

/* Feeds pieces, returns what came out (and whether it stopped). */
static void run_filter(const char *const *stop, int n_stop, const char *const *pieces, sink *s,
                       const char *want, bool want_stop) {
    memset(s, 0, sizeof *s);
    st_stop_filter *f = NULL;
    CHECK(st_stop_filter_init(stop, n_stop, &f) == STRATA_OK);
    for (int i = 0; pieces[i]; i++) push(f, s, pieces[i]);
    bool stopped = s->stopped;
    flush(f, s);
    CHECK_MSG(!strcmp(s->text, want), "got '%s', want '%s'", s->text, want);
    CHECK_MSG(stopped == want_stop, "stopped %d for '%s'", stopped, want);
    st_stop_filter_free(f);
}

static void test_stop_filter(void) {
    sink s;
    const char *stop1[] = {"\nUser:"};
    run_filter(stop1, 1, (const char *const[]){"Hello", " there\nUs", "er: hi", NULL}, &s, "Hello there", true);
    run_filter(stop1, 1, (const char *const[]){"Hello\nUs", "e", "d to it", NULL}, &s, "Hello\nUsed to it", false);
    /* the held prefix is released as soon as it is decided */
    {
        st_stop_filter *f = NULL;
        CHECK(st_stop_filter_init(stop1, 1, &f) == STRATA_OK);
        memset(&s, 0, sizeof s);
        push(f, &s, "ab\nUs");
        CHECK(!strcmp(s.text, "ab"));
        push(f, &s, "x");
        CHECK(!strcmp(s.text, "ab\nUsx"));
        push(f, &s, "\n");
        CHECK(!strcmp(s.text, "ab\nUsx"));
        push(f, &s, "User:");
        CHECK(s.stopped && !strcmp(s.text, "ab\nUsx"));
        push(f, &s, "more");
        CHECK(s.stopped && !strcmp(s.text, "ab\nUsx"));
        flush(f, &s);
        CHECK(!strcmp(s.text, "ab\nUsx"));
        st_stop_filter_free(f);
    }
    /* several: the earliest occurrence wins, whichever string it is */
    const char *stop2[] = {"END", "##"};
    run_filter(stop2, 2, (const char *const[]){"a ## b END", NULL}, &s, "a ", true);
    run_filter(stop2, 2, (const char *const[]){"a #", "#", NULL}, &s, "a ", true);
    run_filter(stop2, 2, (const char *const[]){"a E", "N", "# x", NULL}, &s, "a EN# x", false);
    /* overlapping: "aab" inside "aaab" */
    const char *stop3[] = {"aab"};
    run_filter(stop3, 1, (const char *const[]){"a", "a", "a", "b", "c", NULL}, &s, "a", true);
    /* the whole text is a prefix: held, then released at the end */
    run_filter(stop3, 1, (const char *const[]){"a", "a", NULL}, &s, "aa", false);
    /* UTF-8 stop string: never a split character */
    const char *stop4[] = {"\xc3\xa9!"};
    run_filter(stop4, 1, (const char *const[]){"caf", "\xc3\xa9", "!!", NULL}, &s, "caf", true);
    run_filter(stop4, 1, (const char *const[]){"caf", "\xc3\xa9", "?", NULL}, &s, "caf\xc3\xa9?", false);
    /* no stop strings: everything passes at once */
    run_filter(NULL, 0, (const char *const[]){"x", "yz", NULL}, &s, "xyz", false);
    /* errors */
    st_stop_filter *f = (st_stop_filter *)1;
    const char *bad1[] = {"ok", ""};
    CHECK_ERR(st_stop_filter_init(bad1, 2, &f), STRATA_ERR_INVALID_ARG, "stop string 2", "empty");
    CHECK(f == NULL);
    const char *bad2[] = {"\xff"};
    CHECK_ERR(st_stop_filter_init(bad2, 1, &f), STRATA_ERR_INVALID_ARG, "UTF-8");
    st_stop_filter_free(NULL);
}

/* ---- st_generate on a tiny model ---------------------------------------------------*/
typedef struct {
    char *text;
    size_t len, cap;
    int pieces;
    int stop_after; /* > 0: return false after this many pieces */
    bool bad_utf8;
} collector;

static bool collect(const char *t, size_t n, void *user) {
    collector *c = user;
    if (n == 0 || !st_utf8_valid(t, n)) c->bad_utf8 = true;
    if (c->len + n + 1 > c->cap) {
        c->cap = (c->len + n + 1) * 2;
        c->text = realloc(c->text, c->cap);
    }
    memcpy(c->text + c->len, t, n);
    c->len += n;
    c->text[c->len] = 0;
    c->pieces++;
    return !(c->stop_after > 0 && c->pieces >= c->stop_after);
}

typedef struct {
    st_model_files *files;
    st_backend *be;
    st_llama *model;
    st_tokenizer *tok;
    int64_t vocab, n_ctx;
} tiny;

static bool tiny_open(tiny *t) {
    memset(t, 0, sizeof *t);
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 1};
    if (st_model_open(test_src_path("tests/data/tokenizer/tiny_bpe_smollm.gguf"), &t->files) ||
        st_backend_init(&bp, &t->be) || st_llama_init(t->files, t->be, NULL, &t->model) ||
        st_tokenizer_load(t->files, &t->tok)) {
        fprintf(stderr, "tiny model: %s\n", st_last_error());
        return false;
    }
    t->vocab = st_llama_config(t->model)->vocab_size;
    t->n_ctx = st_llama_config(t->model)->max_position_embeddings; /* 64: the default context */
    return true;
}

static void tiny_close(tiny *t) {
    st_tokenizer_free(t->tok);
    st_llama_free(t->model);
    st_backend_free(t->be);
    st_model_close(t->files);
}

/* Greedy reference straight over st_llama_forward. */
static void greedy_ref(tiny *t, const int32_t *prompt, int64_t n_prompt, int32_t *out, int n) {
    st_llama_reset(t->model);
    float *logits = malloc((size_t)t->vocab * sizeof *logits);
    CHECK(st_llama_forward(t->model, prompt, n_prompt, 0, false, logits) == STRATA_OK);
    for (int i = 0; i < n; i++) {
        int32_t b = 0;
        for (int64_t v = 1; v < t->vocab; v++)
            if (logits[v] > logits[b]) b = (int32_t)v;
        out[i] = b;
        if (i + 1 < n) CHECK(st_llama_forward(t->model, &b, 1, st_llama_n_past(t->model), false, logits) == STRATA_OK);
    }
    free(logits);
    st_llama_reset(t->model);
}

static void test_generate(void) {
    tiny t;
    if (!tiny_open(&t)) {
        CHECK(!"tiny model");
        return;
    }
    const char *prompt_text = "The quick brown fox jumps over the lazy dog.";
    int32_t *prompt = NULL;
    int64_t n_prompt = 0;
    CHECK(st_tokenizer_encode(t.tok, prompt_text, strlen(prompt_text), false, false, &prompt, &n_prompt) == STRATA_OK);
    CHECK_MSG(n_prompt > 3 && n_prompt < 32, "%lld prompt tokens", (long long)n_prompt);
    const int32_t *stop_ids;
    int n_stop_ids = st_tokenizer_stop_ids(t.tok, &stop_ids);

    enum { N = 24 };
    int32_t ref[N];
    greedy_ref(&t, prompt, n_prompt, ref, N);
    int n_ref = N; /* up to a stop id */
    for (int i = 0; i < N; i++)
        for (int k = 0; k < n_stop_ids; k++)
            if (ref[i] == stop_ids[k] && n_ref == N) n_ref = i;
    printf("tiny model: %d greedy tokens before any stop id\n", n_ref);
    char *ref_text = NULL;
    CHECK(st_tokenizer_decode(t.tok, ref, n_ref, true, &ref_text) == STRATA_OK);

    st_sampler_params gp = st_sampler_params_default();
    gp.temperature = 0;
    st_sampler *greedy = NULL;
    CHECK(st_sampler_init(&gp, t.vocab, &greedy) == STRATA_OK);

    /* 1. max_tokens, greedy: same ids as the reference, text = decode(ids) */
    collector c = {0};
    st_generate_params p = {.max_tokens = N, .n_ctx = t.n_ctx};
    st_generate_stats gs;
    CHECK(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p, collect, &c, &gs) == STRATA_OK);
    CHECK(gs.prompt_tokens == n_prompt && gs.prompt_s > 0 && gs.gen_s > 0);
    if (n_ref == N) {
        CHECK(gs.stop == ST_STOP_MAX_TOKENS && gs.gen_tokens == N && gs.last_token == ref[N - 1]);
        CHECK(gs.n_fed == N - 1);
    } else {
        CHECK(gs.stop == ST_STOP_EOS && gs.gen_tokens == n_ref + 1);
    }
    CHECK(st_llama_n_past(t.model) == n_prompt + gs.n_fed);
    CHECK_MSG(c.text && !strcmp(c.text, ref_text), "streamed '%s' != decoded '%s'", c.text ? c.text : "",
              ref_text);
    CHECK(!c.bad_utf8);
    printf("tiny model greedy: %d pieces \"%s\"\n", c.pieces, c.text ? c.text : "");

    /* 2. continue: feed last_token, then 4 more == ref[N..] of a longer run */
    if (n_ref == N) {
        enum { M = N + 4 };
        int32_t ref2[M];
        greedy_ref(&t, prompt, n_prompt, ref2, M);
        /* redo the first part (greedy_ref reset the cache) */
        CHECK(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p, NULL, NULL, &gs) == STRATA_OK);
        st_generate_params p2 = {.max_tokens = 4, .n_ctx = t.n_ctx};
        const int32_t last = gs.last_token; /* gs is rewritten by the call */
        CHECK(last == ref2[N - 1]);
        CHECK(st_generate(t.model, t.tok, greedy, &last, 1, &p2, NULL, NULL, &gs) == STRATA_OK);
        CHECK(gs.prompt_tokens == 1 && gs.gen_tokens == 4 && gs.last_token == ref2[M - 1]);
        CHECK(st_llama_n_past(t.model) == n_prompt + N + 3);
    }

    /* 3. stop string: a piece of the reference text; output stops before it */
    if (c.len >= 8) {
        char stop[4];
        memcpy(stop, c.text + 5, 3);
        stop[3] = 0;
        if (st_utf8_valid(stop, 3)) {
            const char *stops[] = {"never-appears", stop};
            const char *first = strstr(c.text, stop);
            collector c2 = {0};
            st_llama_reset(t.model);
            st_generate_params p3 = {.max_tokens = N, .n_ctx = t.n_ctx, .stop = stops, .n_stop = 2};
            CHECK(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p3, collect, &c2, &gs) == STRATA_OK);
            CHECK(gs.stop == ST_STOP_STRING);
            CHECK(c2.len == (size_t)(first - c.text) && (c2.len == 0 || !memcmp(c2.text, c.text, c2.len)));
            CHECK(!c2.text || !strstr(c2.text, stop));
            free(c2.text);
        }
    }

    /* 4. the callback stops it */
    {
        collector c3 = {.stop_after = 2};
        st_llama_reset(t.model);
        CHECK(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p, collect, &c3, &gs) == STRATA_OK);
        if (n_ref > 4) CHECK(gs.stop == ST_STOP_CALLBACK && c3.pieces == 2);
        free(c3.text);
    }

    /* 5. a full context: no max_tokens, n_ctx 64 */
    {
        st_llama_reset(t.model);
        st_generate_params p4 = {.max_tokens = 0, .n_ctx = t.n_ctx};
        CHECK(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p4, NULL, NULL, &gs) == STRATA_OK);
        if (gs.stop != ST_STOP_EOS) {
            CHECK(gs.stop == ST_STOP_CONTEXT);
            CHECK_MSG(gs.gen_tokens == t.n_ctx - n_prompt + 1, "%lld tokens", (long long)gs.gen_tokens);
            CHECK(st_llama_n_past(t.model) == t.n_ctx);
        }
        /* nothing fits any more */
        CHECK_ERR(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &p4, NULL, NULL, &gs),
                  STRATA_ERR_INVALID_ARG, "does not fit the context");
        CHECK(gs.gen_tokens == 0);
    }

    /* 6. seeded sampling repeats; another seed differs */
    {
        st_sampler_params sp = st_sampler_params_default();
        sp.temperature = 1.5f;
        char *texts[3] = {0};
        uint64_t seeds[3] = {7, 7, 8};
        for (int i = 0; i < 3; i++) {
            st_sampler *s = NULL;
            sp.seed = seeds[i];
            CHECK(st_sampler_init(&sp, t.vocab, &s) == STRATA_OK);
            collector cs = {0};
            st_llama_reset(t.model);
            st_generate_params p5 = {.max_tokens = 30, .n_ctx = t.n_ctx, .emit_special = true};
            CHECK(st_generate(t.model, t.tok, s, prompt, n_prompt, &p5, collect, &cs, &gs) == STRATA_OK);
            texts[i] = cs.text ? cs.text : calloc(1, 1);
            st_sampler_free(s);
        }
        CHECK(!strcmp(texts[0], texts[1]));
        CHECK_MSG(strcmp(texts[0], texts[2]) != 0, "seeds 7 and 8 gave the same text '%s'", texts[0]);
        for (int i = 0; i < 3; i++) free(texts[i]);
    }

    /* 7. errors */
    st_llama_reset(t.model);
    CHECK_ERR(st_generate(t.model, t.tok, greedy, prompt, 0, &p, NULL, NULL, &gs), STRATA_ERR_INVALID_ARG, "empty prompt");
    st_sampler *big = NULL;
    CHECK(st_sampler_init(&gp, t.vocab + 5, &big) == STRATA_OK);
    CHECK_ERR(st_generate(t.model, t.tok, big, prompt, n_prompt, &p, NULL, NULL, &gs), STRATA_ERR_INVALID_ARG,
              "sampler draws from");
    st_sampler_free(big);
    const char *empty_stop[] = {""};
    st_generate_params pe = {.max_tokens = 3, .stop = empty_stop, .n_stop = 1};
    CHECK_ERR(st_generate(t.model, t.tok, greedy, prompt, n_prompt, &pe, NULL, NULL, &gs), STRATA_ERR_INVALID_ARG,
              "stop string 1");
    CHECK(!strcmp(st_stop_reason_name(ST_STOP_EOS), "eos"));

    free(c.text);
    free(ref_text);
    free(prompt);
    st_sampler_free(greedy);
    tiny_close(&t);
}

int main(void) {
    test_stop_filter();
    test_generate();
    return test_finish("test_generate");
}

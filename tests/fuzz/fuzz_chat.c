/* Fuzzes chat templates (src/tokenizer/chat.c): recognising a template's
 * Jinja source (st_chat_detect) and formatting conversations built from the
 * input (st_chat_format / st_chat_format_spans), then tokenizing the prompt
 * with the real SmolLM2 tokenizer (tests/data/tokenizer/smollm2) through its
 * spans, as the server does.
 *
 * Input: byte 0 holds flags: bits 0-1 the template (0: detected from the
 * first part, a Jinja source; 1 chatml, 2 llama3, 3 llama2), 0x04
 * add_generation_prompt, 0x08 a Llama-3.1 date, 0x10 a ChatML default system
 * message. The rest is cut into parts at lines "--8<--": each part one
 * message, "role:content" (no ':': role "user", the whole part the content).
 * Checked beyond memory safety: st_chat_format == st_chat_format_spans; the
 * spans are sorted, disjoint, non-empty and inside the prompt; no content or
 * role can forge a control token: the prompt's control tokens (encoded through
 * the spans) are those of the same conversation with every content "x" and
 * every role that is not a plain lower-case word "x".
 * Seeds: tests/fuzz/corpus/chat/. */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

#define MAX_MSGS 64
static st_tokenizer *g_tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *tj = fuzz_src_path("tests/data/tokenizer/smollm2/tokenizer.json");
    const char *tc = fuzz_src_path("tests/data/tokenizer/smollm2/tokenizer_config.json");
    FUZZ_CHECK(st_tokenizer_load_json(tj, tc, &g_tok) == STRATA_OK, "%s: %s", tj, st_last_error());
    return 0;
}

/* The control (special) ids of text encoded through its spans; *n their count. */
static int32_t *specials(const char *text, const size_t *spans, int64_t n_spans, int64_t *n) {
    int32_t *ids = NULL;
    int64_t ni = 0;
    FUZZ_CHECK(st_tokenizer_encode_spans(g_tok, text, strlen(text), false, spans, n_spans, &ids, &ni) == STRATA_OK,
               "encode_spans: %s", st_last_error());
    int64_t k = 0;
    for (int64_t i = 0; i < ni; i++)
        if (st_tokenizer_is_special(g_tok, ids[i])) ids[k++] = ids[i];
    *n = k;
    return ids;
}

static bool plain_word(const char *s) {
    if (!*s) return false;
    for (; *s; s++)
        if (*s < 'a' || *s > 'z') return false;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const uint8_t flags = data[0];
    const size_t first = (flags & 3) == 0; /* the template source comes first */
    fuzz_part parts[MAX_MSGS + 1];
    size_t np = fuzz_split(data + 1, size - 1, parts, MAX_MSGS + first);

    st_chat_template t = {0};
    static const st_chat_kind kinds[4] = {ST_CHAT_NONE, ST_CHAT_CHATML, ST_CHAT_LLAMA3, ST_CHAT_LLAMA2};
    if ((flags & 3) == 0) {
        char *jinja = fuzz_strndup(parts[0].p, parts[0].n);
        st_clear_error();
        strata_status st = st_chat_detect(jinja, &t);
        fuzz_check_error(st, NULL);
        free(jinja);
        if (st != STRATA_OK) return 0;
        FUZZ_CHECK(st_chat_kind_name(t.kind)[0] != '?', "kind %d", (int)t.kind);
    } else {
        t.kind = kinds[flags & 3];
        if ((flags & 0x08) && t.kind == ST_CHAT_LLAMA3) t.date = strdup("26 Jul 2024");
        if ((flags & 0x10) && t.kind == ST_CHAT_CHATML) t.default_system = strdup("You are a fuzzer.");
    }
    const bool gen = flags & 0x04;

    st_chat_msg msgs[MAX_MSGS], plain[MAX_MSGS];
    char *owned[2 * MAX_MSGS];
    int64_t n = 0;
    for (size_t i = first; i < np; i++, n++) {
        const char *colon = memchr(parts[i].p, ':', parts[i].n);
        size_t rl = colon ? (size_t)(colon - (const char *)parts[i].p) : 0;
        char *role = colon ? fuzz_strndup(parts[i].p, rl) : fuzz_strndup("user", 4);
        char *content = colon ? fuzz_strndup(colon + 1, parts[i].n - rl - 1) : fuzz_strndup(parts[i].p, parts[i].n);
        owned[2 * n] = role;
        owned[2 * n + 1] = content;
        msgs[n] = (st_chat_msg){role, content};
        plain[n] = (st_chat_msg){plain_word(role) ? role : "x", "x"};
    }

    char *out = NULL, *out2 = NULL, *ref = NULL;
    size_t *spans = NULL, *ref_spans = NULL;
    int64_t n_spans = 0, n_ref_spans = 0;
    st_clear_error();
    strata_status st = st_chat_format(&t, msgs, n, gen, &out);
    fuzz_check_error(st, NULL);
    strata_status st2 = st_chat_format_spans(&t, msgs, n, gen, &out2, &spans, &n_spans);
    FUZZ_CHECK(st == st2, "format %d, format_spans %d", (int)st, (int)st2);
    if (st == STRATA_OK) {
        const size_t len = strlen(out);
        FUZZ_CHECK(!strcmp(out, out2), "format and format_spans differ");
        for (int64_t k = 0; k < n_spans; k++)
            FUZZ_CHECK(spans[2 * k] < spans[2 * k + 1] && spans[2 * k + 1] <= len &&
                           (k == 0 || spans[2 * k] > spans[2 * k - 1]),
                       "span %lld [%zu, %zu) of %zu bytes", (long long)k, spans[2 * k], spans[2 * k + 1], len);
        FUZZ_CHECK(st_chat_format_spans(&t, plain, n, gen, &ref, &ref_spans, &n_ref_spans) == STRATA_OK,
                   "the plain conversation does not format: %s", st_last_error());
        int64_t na, nb;
        int32_t *a = specials(out, spans, n_spans, &na), *b = specials(ref, ref_spans, n_ref_spans, &nb);
        FUZZ_CHECK(na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof *a)),
                   "%s: the conversation's control tokens (%lld) differ from the plain one's (%lld)",
                   st_chat_kind_name(t.kind), (long long)na, (long long)nb);
        free(a);
        free(b);
    }
    for (int64_t i = 0; i < n; i++) {
        size_t a, e, cl = strlen(msgs[i].content);
        st_chat_strip(msgs[i].content, cl, &a, &e);
        FUZZ_CHECK(a <= e && e <= cl, "strip [%zu, %zu) of %zu", a, e, cl);
    }
    free(out), free(out2), free(ref), free(spans), free(ref_spans);
    for (int64_t i = 0; i < 2 * n; i++) free(owned[i]);
    st_chat_template_clear(&t);
    return 0;
}

/* Chat templates against Hugging Face transformers' renders of the real
 * templates (tests/data/chat, made by tools/ref/make_chat_refs.py):
 *  - st_chat_detect on each template's Jinja source: kind, default system
 *    message, Llama-3.1+ date;
 *  - st_chat_format == the render, byte for byte, for every conversation (one
 *    turn, multi-turn, with and without system, whitespace and Unicode edges,
 *    with and without the generation prompt), and an error where the template
 *    raised;
 *  - unrecognised templates: an error naming their markers;
 *  - default-system extraction from other quoting styles; Python strip(). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "testutil.h"
#include "tokenizer/chat.h"

#define DATA "tests/data/chat/"

static char *read_text(const char *rel) {
    char *text = NULL;
    size_t len;
    if (st_file_read_all(test_src_path(rel), &text, &len)) {
        fprintf(stderr, "cannot read %s: %s\n", rel, st_last_error());
        return NULL;
    }
    return text;
}

static const char *json_str(const cJSON *o, const char *key) {
    const cJSON *v = st_json_field(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool streq_null(const char *a, const char *b) {
    return (!a && !b) || (a && b && !strcmp(a, b));
}

static void print_escaped(const char *label, const char *s) {
    fprintf(stderr, "  %s: \"", label);
    for (const unsigned char *p = (const unsigned char *)s; p && *p; p++) {
        if (*p == '\n') fputs("\\n", stderr);
        else if (*p < 0x20) fprintf(stderr, "\\x%02x", *p);
        else fputc(*p, stderr);
    }
    fputs("\"\n", stderr);
}

static void test_references(void) {
    char *text = read_text(DATA "expected.json");
    CHECK(text != NULL);
    if (!text) return;
    cJSON *doc = NULL;
    CHECK(st_json_parse(text, strlen(text), DATA "expected.json", &doc) == STRATA_OK);
    free(text);
    if (!doc) return;

    /* detection */
    const cJSON *tpls = st_json_field(doc, "templates");
    int n_tpl = 0;
    for (const cJSON *t = tpls ? tpls->child : NULL; t; t = t->next) {
        char rel[256];
        snprintf(rel, sizeof rel, DATA "%s", json_str(t, "file"));
        char *src = read_text(rel);
        CHECK(src != NULL);
        if (!src) continue;
        st_chat_template ct;
        strata_status st = st_chat_detect(src, &ct);
        CHECK_MSG(st == STRATA_OK, "%s: %s", t->string, st_last_error());
        st_chat_kind want;
        CHECK(st_chat_kind_from_name(json_str(t, "kind"), &want));
        CHECK_MSG(ct.kind == want, "%s: kind %s, want %s", t->string, st_chat_kind_name(ct.kind),
                  json_str(t, "kind"));
        CHECK_MSG(streq_null(ct.default_system, json_str(t, "default_system")),
                  "%s: default_system '%s'", t->string, ct.default_system ? ct.default_system : "(null)");
        CHECK_MSG(streq_null(ct.date, json_str(t, "date")), "%s: date '%s'", t->string,
                  ct.date ? ct.date : "(null)");
        CHECK(ct.date_from_clock == cJSON_IsTrue(st_json_field(t, "date_from_clock")));
        st_chat_template_clear(&ct);
        free(src);
        n_tpl++;
    }
    CHECK(n_tpl == 5);

    /* formatting */
    int n_ok = 0, n_err = 0;
    const cJSON *cases = st_json_field(doc, "cases");
    for (const cJSON *c = cases ? cases->child : NULL; c; c = c->next) {
        const char *tname = json_str(c, "template");
        const cJSON *t = st_json_field(tpls, tname);
        char rel[256];
        snprintf(rel, sizeof rel, DATA "%s", json_str(t, "file"));
        char *src = read_text(rel);
        if (!src) {
            CHECK(src != NULL);
            continue;
        }
        st_chat_template ct;
        CHECK(st_chat_detect(src, &ct) == STRATA_OK);
        free(src);
        const char *date = json_str(c, "date_string");
        if (date) {
            st_free(ct.date);
            ct.date = st_strdup(date);
        }
        const cJSON *msgs = st_json_field(c, "messages");
        int n = cJSON_GetArraySize(msgs);
        st_chat_msg *m = calloc((size_t)n, sizeof *m);
        for (int i = 0; i < n; i++) {
            const cJSON *pair = cJSON_GetArrayItem(msgs, i);
            m[i].role = cJSON_GetArrayItem(pair, 0)->valuestring;
            m[i].content = cJSON_GetArrayItem(pair, 1)->valuestring;
        }
        const bool gen = cJSON_IsTrue(st_json_field(c, "add_generation_prompt"));
        char *out = NULL;
        strata_status st = st_chat_format(&ct, m, n, gen, &out);
        const char *want = json_str(c, "expected");
        if (want) {
            CHECK_MSG(st == STRATA_OK, "%s/%s: %s", tname, json_str(c, "name"), st_last_error());
            bool same = out && !strcmp(out, want);
            CHECK_MSG(same, "%s/%s gen=%d: output differs", tname, json_str(c, "name"), gen);
            if (!same) {
                print_escaped("got ", out);
                print_escaped("want", want);
            }
            n_ok++;
        } else {
            CHECK_MSG(st == STRATA_ERR_INVALID_ARG && !out, "%s/%s: expected an error", tname,
                      json_str(c, "name"));
            CHECK(strstr(st_last_error(), "alternating") != NULL);
            n_err++;
        }
        free(out);
        free(m);
        st_chat_template_clear(&ct);
    }
    printf("chat: %d renders matched byte for byte, %d rejections matched\n", n_ok, n_err);
    CHECK(n_ok >= 100 && n_err == 6);
    cJSON_Delete(doc);
}

static void test_unknown(void) {
    static const struct {
        const char *src;
        const char *markers[3];
    } cases[] = {
        /* Gemma */
        {"{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + "
         "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}",
         {"<start_of_turn>", "<end_of_turn>", NULL}},
        /* Mistral: [INST] without <<SYS>> */
        {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
         "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}"
         "{% endif %}{% endfor %}",
         {"[INST]", "[/INST]", "Mistral"}},
        /* Phi-3 */
        {"{% for message in messages %}{{'<|' + message['role'] + '|>\\n' + message['content'] + "
         "'<|end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
         {"<|end|>", "<|assistant|>", NULL}},
        /* Qwen3-like: ChatML with <think> */
        {"{{'<|im_start|>' + message.role + '\\n' + content + '<|im_end|>'}}{{ '<think>\\n\\n</think>' }}",
         {"<think>", "<|im_start|>", NULL}},
        /* no markers at all */
        {"{% for m in messages %}{{ m.content }}\n{% endfor %}", {"{% for m in messages %}", NULL, NULL}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        st_chat_template ct;
        memset(&ct, 0x5a, sizeof ct);
        strata_status st = st_chat_detect(cases[i].src, &ct);
        CHECK_MSG(st == STRATA_ERR_UNSUPPORTED, "case %zu: %d", i, (int)st);
        CHECK(ct.kind == ST_CHAT_NONE && !ct.default_system && !ct.date);
        CHECK(strstr(st_last_error(), "unrecognised chat template") != NULL);
        for (int k = 0; k < 3; k++)
            if (cases[i].markers[k])
                CHECK_MSG(strstr(st_last_error(), cases[i].markers[k]) != NULL, "case %zu: '%s' not in: %s",
                          i, cases[i].markers[k], st_last_error());
    }
    /* no template at all: kind NONE, not an error */
    st_chat_template ct;
    CHECK(st_chat_detect(NULL, &ct) == STRATA_OK && ct.kind == ST_CHAT_NONE);
    CHECK(st_chat_detect("", &ct) == STRATA_OK && ct.kind == ST_CHAT_NONE);
    st_chat_msg m = {"user", "hi"};
    char *out = (char *)1;
    CHECK_ERR(st_chat_format(&ct, &m, 1, true, &out), STRATA_ERR_INVALID_ARG, "no chat template");
    CHECK(out == NULL);
}

static void test_detect_variants(void) {
    /* Qwen2.5 style: double quotes, escaped \n, the system text in an else branch
     * after a concatenated (non-default) one. */
    const char *qwen25 =
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {{- \"<|im_start|>system\\n\" + messages[0]['content'] + \"<|im_end|>\\n\" }}\n"
        "{%- else %}\n"
        "    {{- \"<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a \\\"helpful\\\" "
        "assistant.<|im_end|>\\n\" }}\n"
        "{%- endif %}{% for message in messages %}{{'<|im_start|>' + message.role + '\\n' + "
        "message.content + '<|im_end|>\\n'}}{% endfor %}";
    st_chat_template ct;
    CHECK(st_chat_detect(qwen25, &ct) == STRATA_OK);
    CHECK(ct.kind == ST_CHAT_CHATML);
    CHECK_MSG(ct.default_system &&
                  !strcmp(ct.default_system,
                          "You are Qwen, created by Alibaba Cloud. You are a \"helpful\" assistant."),
              "got '%s'", ct.default_system ? ct.default_system : "(null)");
    /* the default system message is used only when the first message is not a system one */
    st_chat_msg m[2] = {{"system", "S"}, {"user", "U"}};
    char *out = NULL;
    CHECK(st_chat_format(&ct, m, 2, false, &out) == STRATA_OK);
    CHECK(out && !strcmp(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"));
    free(out);
    CHECK(st_chat_format(&ct, m + 1, 1, true, &out) == STRATA_OK);
    CHECK(out && strstr(out, "<|im_start|>system\nYou are Qwen") == out &&
          strstr(out, "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"));
    free(out);
    st_chat_template_clear(&ct);
    st_chat_template_clear(&ct); /* twice: fine */
    st_chat_template_clear(NULL);

    /* Llama-3.1 form without strftime_now: the template's date, not from the clock */
    const char *l31 = "{%- if not date_string is defined %}{%- set date_string = '23 Jul 2024' %}{%- endif %}"
                      "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
                      "{{- \"Cutting Knowledge Date: December 2023\\n\" }}{{ '<|eot_id|>' }}";
    CHECK(st_chat_detect(l31, &ct) == STRATA_OK);
    CHECK(ct.kind == ST_CHAT_LLAMA3 && ct.date && !strcmp(ct.date, "23 Jul 2024") && !ct.date_from_clock);
    st_chat_msg u = {"user", " hi "};
    CHECK(st_chat_format(&ct, &u, 1, true, &out) == STRATA_OK);
    CHECK(out && !strcmp(out, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                              "Cutting Knowledge Date: December 2023\nToday Date: 23 Jul 2024\n\n<|eot_id|>"
                              "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>\n\n"));
    free(out);
    st_chat_msg tool[2] = {{"user", "x"}, {"tool", "{}"}};
    CHECK_ERR(st_chat_format(&ct, tool, 2, true, &out), STRATA_ERR_UNSUPPORTED, "tool");
    st_chat_template_clear(&ct);

    /* names */
    st_chat_kind k;
    CHECK(st_chat_kind_from_name("chatml", &k) && k == ST_CHAT_CHATML);
    CHECK(st_chat_kind_from_name("llama3", &k) && k == ST_CHAT_LLAMA3);
    CHECK(st_chat_kind_from_name("llama2", &k) && k == ST_CHAT_LLAMA2);
    CHECK(!st_chat_kind_from_name("vicuna", &k) && !st_chat_kind_from_name(NULL, &k));
    CHECK(!strcmp(st_chat_kind_name(ST_CHAT_LLAMA2), "llama2"));

    /* bad messages */
    st_chat_template chatml = {.kind = ST_CHAT_CHATML};
    st_chat_msg bad = {"user", NULL};
    CHECK_ERR(st_chat_format(&chatml, &bad, 1, true, &out), STRATA_ERR_INVALID_ARG, "message 0", "content");
    CHECK_ERR(st_chat_format(&chatml, &bad, 0, true, &out), STRATA_ERR_INVALID_ARG, "no messages");
}

static void test_strip(void) {
    static const struct {
        const char *in, *out;
    } c[] = {
        {"", ""},
        {"   ", ""},
        {" a ", "a"},
        {"\t\n\v\f\r a b \x1c\x1d\x1e\x1f", "a b"},
        {"\xc2\xa0x\xc2\x85", "x"},                      /* U+00A0, U+0085 */
        {"\xe3\x80\x80x\xe2\x80\xa8\xe2\x80\xaf", "x"}, /* U+3000, U+2028, U+202F */
        {"\xe2\x80\x8bx\xe2\x80\x8b", "\xe2\x80\x8bx\xe2\x80\x8b"}, /* U+200B is not whitespace */
        {"\xff x \xff", "\xff x \xff"},                  /* invalid bytes are not whitespace */
        {"\xc3\xa9 ", "\xc3\xa9"},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        size_t a, e;
        st_chat_strip(c[i].in, strlen(c[i].in), &a, &e);
        CHECK_MSG(e - a == strlen(c[i].out) && !memcmp(c[i].in + a, c[i].out, e - a), "case %zu", i);
    }
}

int main(void) {
    test_references();
    test_unknown();
    test_detect_variants();
    test_strip();
    return test_finish("test_chat");
}

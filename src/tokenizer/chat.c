/* Chat templates: recognising a template's Jinja source by its markers, and
 * formatting conversations the way the recognised template renders them.
 * See chat.h for the formats. */
#include "tokenizer/chat.h"

#include <stdio.h>
#include <string.h>

/* ---- a growable string -------------------------------------------------------*/
typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
    /* the template's own text: [start, end) pairs (sb_tpl), adjacent ones merged */
    size_t *spans;
    int64_t n_spans, cap_spans;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = st_realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_puts(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* Appends text of the template itself (its control tokens count as such). */
static void sb_tpl(sbuf *b, const char *s) {
    const size_t start = b->len;
    sb_puts(b, s);
    if (b->oom || b->len == start) return;
    if (b->n_spans > 0 && b->spans[2 * b->n_spans - 1] == start) {
        b->spans[2 * b->n_spans - 1] = b->len;
        return;
    }
    if (b->n_spans == b->cap_spans) {
        int64_t cap = b->cap_spans ? b->cap_spans * 2 : 16;
        size_t *np = st_realloc(b->spans, (size_t)cap * 2 * sizeof *np);
        if (!np) {
            b->oom = true;
            return;
        }
        b->spans = np;
        b->cap_spans = cap;
    }
    b->spans[2 * b->n_spans] = start;
    b->spans[2 * b->n_spans + 1] = b->len;
    b->n_spans++;
}

/* Appends Python's s.strip(). */
static void sb_add_stripped(sbuf *b, const char *s) {
    size_t a, e;
    st_chat_strip(s, strlen(s), &a, &e);
    sb_add(b, s + a, e - a);
}

/* ---- names -------------------------------------------------------------------*/
bool st_chat_kind_from_name(const char *name, st_chat_kind *out) {
    static const struct {
        const char *name;
        st_chat_kind kind;
    } names[] = {{"none", ST_CHAT_NONE}, {"chatml", ST_CHAT_CHATML}, {"llama3", ST_CHAT_LLAMA3},
                 {"llama2", ST_CHAT_LLAMA2}};
    if (!name) return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *out = names[i].kind;
            return true;
        }
    return false;
}

const char *st_chat_kind_name(st_chat_kind kind) {
    switch (kind) {
    case ST_CHAT_NONE: return "none";
    case ST_CHAT_CHATML: return "chatml";
    case ST_CHAT_LLAMA3: return "llama3";
    case ST_CHAT_LLAMA2: return "llama2";
    }
    return "?";
}

/* ---- Python str.strip() --------------------------------------------------------
 * Whitespace as str.isspace(): U+0009..000D, U+001C..001F, U+0020, U+0085,
 * U+00A0, U+1680, U+2000..200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
static bool cp_is_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
           c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Decodes the (well-formed) UTF-8 sequence at s[i..len); returns its length,
 * 0 when it is not well-formed (then it is not whitespace either). */
static size_t utf8_at(const char *s, size_t len, size_t i, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    unsigned c = u[i];
    size_t n;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if (c >= 0xC2 && c < 0xE0) {
        n = 2;
        v = c & 0x1F;
    } else if (c >= 0xE0 && c < 0xF0) {
        n = 3;
        v = c & 0x0F;
    } else if (c >= 0xF0 && c < 0xF5) {
        n = 4;
        v = c & 0x07;
    } else {
        return 0;
    }
    if (i + n > len) return 0;
    for (size_t k = 1; k < n; k++) {
        if ((u[i + k] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (u[i + k] & 0x3F);
    }
    *cp = v;
    return n;
}

void st_chat_strip(const char *s, size_t len, size_t *start, size_t *end) {
    size_t a = 0;
    while (a < len) {
        uint32_t cp;
        size_t n = utf8_at(s, len, a, &cp);
        if (!n || !cp_is_space(cp)) break;
        a += n;
    }
    size_t e = len;
    while (e > a) {
        /* step back to the start of the last character */
        size_t b = e - 1;
        while (b > a && ((unsigned char)s[b] & 0xC0) == 0x80 && e - b < 4) b--;
        uint32_t cp;
        size_t n = utf8_at(s, e, b, &cp);
        if (!n || b + n != e || !cp_is_space(cp)) break;
        e = b;
    }
    *start = a;
    *end = e;
}

/* ---- detection -------------------------------------------------------------------*/
void st_chat_template_clear(st_chat_template *t) {
    if (!t) return;
    st_free(t->default_system);
    st_free(t->date);
    memset(t, 0, sizeof *t);
}

/* Decodes the Jinja string literal whose opening quote is at src[q]; *out is
 * malloc'd (NULL when the literal is unterminated or on OOM). Escapes as in
 * Python: \n \t \r \\ \' \" ; any other backslash is kept as it is. */
static char *jinja_literal(const char *src, size_t q) {
    const char quote = src[q];
    sbuf b = {0};
    for (size_t i = q + 1; src[i]; i++) {
        char c = src[i];
        if (c == quote) {
            if (!b.p) sb_add(&b, "", 0);
            if (b.oom) return NULL;
            return b.p;
        }
        if (c == '\\' && src[i + 1]) {
            char e = src[i + 1];
            const char *rep = e == 'n' ? "\n" : e == 't' ? "\t" : e == 'r' ? "\r"
                            : e == '\\' ? "\\" : e == '\'' ? "'" : e == '"' ? "\"" : NULL;
            if (rep) {
                sb_add(&b, rep, 1);
                i++;
                continue;
            }
        }
        sb_add(&b, &c, 1);
    }
    st_free(b.p);
    return NULL;
}

/* ChatML: the first string literal that holds a whole literal system turn,
 * '<|im_start|>system\n{TEXT}<|im_end|>', gives the default system message. */
static strata_status chatml_default_system(const char *jinja, char **out) {
    static const char head[] = "<|im_start|>system";
    static const char turn[] = "<|im_start|>system\n";
    *out = NULL;
    for (const char *p = strstr(jinja, head); p; p = strstr(p + 1, head)) {
        size_t q = (size_t)(p - jinja);
        if (q == 0 || (jinja[q - 1] != '\'' && jinja[q - 1] != '"')) continue;
        char *lit = jinja_literal(jinja, q - 1);
        if (!lit) continue;
        char *end;
        if (!strncmp(lit, turn, sizeof turn - 1) && (end = strstr(lit, "<|im_end|>")) &&
            end > lit + sizeof turn - 1) {
            size_t n = (size_t)(end - (lit + sizeof turn - 1));
            memmove(lit, lit + sizeof turn - 1, n);
            lit[n] = '\0';
            *out = lit;
            return STRATA_OK;
        }
        st_free(lit);
    }
    return STRATA_OK;
}

/* Llama-3.1+: the fallback date of `set date_string = "..."`. */
static char *llama3_date(const char *jinja) {
    for (const char *p = strstr(jinja, "date_string"); p; p = strstr(p + 1, "date_string")) {
        const char *s = p + strlen("date_string");
        while (*s == ' ') s++;
        if (*s != '=' ) continue;
        s++;
        while (*s == ' ') s++;
        if (*s != '"' && *s != '\'') continue;
        char *lit = jinja_literal(jinja, (size_t)(s - jinja));
        if (lit && *lit) return lit;
        st_free(lit);
    }
    return st_strdup("26 Jul 2024");
}

/* Collects up to 6 distinct special-looking markers of a template for a
 * message: <|...|>, <word>, [WORD], in order of appearance. */
static void describe_markers(const char *jinja, char *buf, size_t cap) {
    char found[6][40];
    int n = 0;
    buf[0] = '\0';
    for (const char *p = jinja; *p && n < 6; p++) {
        char close;
        if (*p == '<') close = '>';
        else if (*p == '[') close = ']';
        else continue;
        size_t k = 1;
        bool ok = true;
        while (p[k] && p[k] != close && k < 36) {
            char c = p[k];
            bool word = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                        c == '_' || c == '|' || c == '/' || c == '-' || c == '.' || c == '!';
            if (!word) {
                ok = false;
                break;
            }
            k++;
        }
        if (!ok || p[k] != close || k < 3) continue;
        /* [..] only when upper case (INST, SYS ...), <..> must hold a letter */
        if (close == ']') {
            bool upper = true;
            for (size_t i = 1; i < k; i++)
                if (p[i] >= 'a' && p[i] <= 'z') upper = false;
            if (!upper) continue;
        }
        char m[40];
        memcpy(m, p, k + 1);
        m[k + 1] = '\0';
        bool dup = false;
        for (int i = 0; i < n; i++)
            if (!strcmp(found[i], m)) dup = true;
        if (dup) continue;
        memcpy(found[n++], m, k + 2);
        p += k;
    }
    size_t used = 0;
    for (int i = 0; i < n && used + 1 < cap; i++) {
        int w = snprintf(buf + used, cap - used, "%s%s", i ? ", " : "", found[i]);
        if (w < 0) break;
        used += (size_t)w;
        if (used >= cap) {
            buf[cap - 1] = '\0';
            break;
        }
    }
}

static strata_status unknown_template(const char *jinja, const char *why) {
    char markers[256];
    describe_markers(jinja, markers, sizeof markers);
    if (markers[0])
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "unrecognised chat template%s%s (it uses %s); known: chatml, llama3, llama2",
                      why ? ": " : "", why ? why : "", markers);
    /* no markers: show the beginning of the source */
    char head[64];
    size_t i = 0;
    for (const char *p = jinja; *p && i + 3 < sizeof head; p++) {
        if (*p == '\n') {
            head[i++] = '\\';
            head[i++] = 'n';
        } else {
            head[i++] = *p;
        }
    }
    head[i] = '\0';
    return st_err(STRATA_ERR_UNSUPPORTED,
                  "unrecognised chat template%s%s (it begins \"%s%s\"); known: chatml, llama3, llama2",
                  why ? ": " : "", why ? why : "", head, strlen(jinja) > i ? "..." : "");
}

strata_status st_chat_detect(const char *jinja, st_chat_template *out) {
    memset(out, 0, sizeof *out);
    if (!jinja || !*jinja) return STRATA_OK;
    strata_status st;
    if (strstr(jinja, "<|im_start|>") && strstr(jinja, "<|im_end|>")) {
        if (strstr(jinja, "<think>"))
            return unknown_template(jinja, "ChatML with <think> reasoning blocks is not supported");
        if (strstr(jinja, "<|im_sep|>"))
            return unknown_template(jinja, "ChatML with <|im_sep|> (Phi-4) is not supported");
        out->kind = ST_CHAT_CHATML;
        if ((st = chatml_default_system(jinja, &out->default_system))) return st;
        return STRATA_OK;
    }
    if (strstr(jinja, "<|start_header_id|>") && strstr(jinja, "<|end_header_id|>") &&
        strstr(jinja, "<|eot_id|>")) {
        out->kind = ST_CHAT_LLAMA3;
        if (strstr(jinja, "Cutting Knowledge Date")) {
            if (!(out->date = llama3_date(jinja))) {
                memset(out, 0, sizeof *out);
                return st_err(STRATA_ERR_NOMEM, "chat template: out of memory for the llama3 template's date");
            }
            out->date_from_clock = strstr(jinja, "strftime_now") != NULL;
        }
        return STRATA_OK;
    }
    if (strstr(jinja, "[INST]") && strstr(jinja, "[/INST]")) {
        if (!strstr(jinja, "<<SYS>>"))
            return unknown_template(jinja, "an [INST] template without <<SYS>> (Mistral-style) is not supported");
        out->kind = ST_CHAT_LLAMA2;
        return STRATA_OK;
    }
    return unknown_template(jinja, NULL);
}

/* ---- formatting ------------------------------------------------------------------*/
static void format_chatml(const st_chat_template *t, const st_chat_msg *m, int64_t n, bool gen,
                          sbuf *b) {
    if (n > 0 && t->default_system && strcmp(m[0].role, "system") != 0) {
        sb_tpl(b, "<|im_start|>system\n");
        sb_tpl(b, t->default_system);
        sb_tpl(b, "<|im_end|>\n");
    }
    for (int64_t i = 0; i < n; i++) {
        sb_tpl(b, "<|im_start|>");
        sb_puts(b, m[i].role);
        sb_tpl(b, "\n");
        sb_puts(b, m[i].content);
        sb_tpl(b, "<|im_end|>\n");
    }
    if (gen) sb_tpl(b, "<|im_start|>assistant\n");
}

static strata_status format_llama3(const st_chat_template *t, const st_chat_msg *m, int64_t n,
                                   bool gen, sbuf *b) {
    sb_tpl(b, "<|begin_of_text|>");
    int64_t i = 0;
    if (t->date) {
        /* Llama-3.1+: the system turn is always there */
        sb_tpl(b, "<|start_header_id|>system<|end_header_id|>\n\n"
                   "Cutting Knowledge Date: December 2023\nToday Date: ");
        sb_puts(b, t->date);
        sb_tpl(b, "\n\n");
        if (n > 0 && !strcmp(m[0].role, "system")) {
            sb_add_stripped(b, m[0].content);
            i = 1;
        }
        sb_tpl(b, "<|eot_id|>");
    }
    for (; i < n; i++) {
        if (t->date && (!strcmp(m[i].role, "tool") || !strcmp(m[i].role, "ipython")))
            return st_err(STRATA_ERR_UNSUPPORTED,
                          "chat: message %lld: role '%s' (tool output) is not supported by the llama3 format",
                          (long long)i, m[i].role);
        sb_tpl(b, "<|start_header_id|>");
        sb_puts(b, m[i].role);
        sb_tpl(b, "<|end_header_id|>\n\n");
        sb_add_stripped(b, m[i].content);
        sb_tpl(b, "<|eot_id|>");
    }
    if (gen) sb_tpl(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return STRATA_OK;
}

static strata_status format_llama2(const st_chat_msg *m, int64_t n, sbuf *b) {
    const char *system = NULL;
    int64_t first = 0;
    if (n > 0 && !strcmp(m[0].role, "system")) {
        system = m[0].content;
        first = 1;
    }
    for (int64_t i = first; i < n; i++) {
        const int64_t k = i - first; /* loop.index0 */
        const bool user = !strcmp(m[i].role, "user");
        if (user != (k % 2 == 0))
            return st_err(STRATA_ERR_INVALID_ARG,
                          "chat: message %lld has role '%s': the llama2 format needs roles alternating "
                          "user/assistant/user/... (after an optional first system message)",
                          (long long)i, m[i].role);
        if (user) {
            sb_tpl(b, "<s>[INST] ");
            if (k == 0 && system) {
                /* strip() applies to the whole "<<SYS>>\n...\n<</SYS>>\n\n" + content */
                sbuf c = {0};
                sb_puts(&c, "<<SYS>>\n");
                sb_puts(&c, system);
                sb_puts(&c, "\n<</SYS>>\n\n");
                sb_puts(&c, m[i].content);
                if (c.oom) {
                    st_free(c.p);
                    b->oom = true;
                    return STRATA_OK;
                }
                sb_add_stripped(b, c.p);
                st_free(c.p);
            } else {
                sb_add_stripped(b, m[i].content);
            }
            sb_tpl(b, " [/INST]");
        } else if (!strcmp(m[i].role, "assistant")) {
            sb_tpl(b, " ");
            sb_add_stripped(b, m[i].content);
            sb_tpl(b, " </s>");
        }
        /* other roles at odd positions: the template writes nothing */
    }
    return STRATA_OK;
}

strata_status st_chat_format(const st_chat_template *t, const st_chat_msg *msgs, int64_t n,
                             bool add_generation_prompt, char **out) {
    return st_chat_format_spans(t, msgs, n, add_generation_prompt, out, NULL, NULL);
}

strata_status st_chat_format_spans(const st_chat_template *t, const st_chat_msg *msgs, int64_t n,
                                   bool add_generation_prompt, char **out, size_t **spans, int64_t *n_spans) {
    *out = NULL;
    if (spans) *spans = NULL;
    if (n_spans) *n_spans = 0;
    if (!t || t->kind == ST_CHAT_NONE)
        return st_err(STRATA_ERR_INVALID_ARG, "chat: no chat template to format with");
    if (n < 1 || !msgs) return st_err(STRATA_ERR_INVALID_ARG, "chat: no messages to format");
    for (int64_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return st_err(STRATA_ERR_INVALID_ARG, "chat: message %lld has no %s", (long long)i,
                          msgs[i].role ? "content" : "role");
    sbuf b = {0};
    strata_status st = STRATA_OK;
    switch (t->kind) {
    case ST_CHAT_CHATML: format_chatml(t, msgs, n, add_generation_prompt, &b); break;
    case ST_CHAT_LLAMA3: st = format_llama3(t, msgs, n, add_generation_prompt, &b); break;
    case ST_CHAT_LLAMA2: st = format_llama2(msgs, n, &b); break;
    default: st = st_err(STRATA_ERR_INVALID_ARG, "chat: unknown template kind %d", (int)t->kind);
    }
    if (!st && b.oom) st = st_err(STRATA_ERR_NOMEM, "chat: out of memory formatting %lld messages", (long long)n);
    if (!st && !b.p) sb_add(&b, "", 0);
    if (!st && b.oom) st = st_err(STRATA_ERR_NOMEM, "chat: out of memory for the empty prompt");
    if (st) {
        st_free(b.p);
        st_free(b.spans);
        return st;
    }
    *out = b.p;
    if (spans && n_spans) {
        *spans = b.spans;
        *n_spans = b.n_spans;
    } else {
        st_free(b.spans);
    }
    return STRATA_OK;
}

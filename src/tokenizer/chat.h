/* tokenizer/chat: chat templates — a conversation -> the prompt text a chat
 * model was trained on.
 *
 * Models ship their template as Jinja source (tokenizer_config.json's
 * chat_template, GGUF tokenizer.chat_template). strata does not run Jinja: it
 * recognises the template families real Llama-family models use, by markers in
 * the source, and formats them in C, byte for byte as Hugging Face
 * transformers' apply_chat_template renders them (checked against renders of
 * the real template texts: tests/data/chat, tools/ref/make_chat_refs.py).
 *
 *  ST_CHAT_CHATML  (SmolLM2, Qwen2, many fine-tunes)
 *      <|im_start|>{role}\n{content}<|im_end|>\n ...
 *      generation prompt: <|im_start|>assistant\n
 *      Content is not trimmed; any role is passed through. A template that
 *      writes a literal system turn ("<|im_start|>system\nYou are ...<|im_end|>")
 *      inserts it when the first message is not a system one: default_system.
 *  ST_CHAT_LLAMA3  (Llama-3 / 3.1 / 3.2 / 3.3 Instruct)
 *      <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\n\n{trim(content)}<|eot_id|> ...
 *      generation prompt: <|start_header_id|>assistant<|end_header_id|>\n\n
 *      Llama-3.1 and later (templates with "Cutting Knowledge Date") always
 *      open with a system turn:
 *        <|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date:
 *        December 2023\nToday Date: {date}\n\n{trim(system message or "")}<|eot_id|>
 *      (date: st_chat_template.date).
 *  ST_CHAT_LLAMA2  (Llama-2-chat)
 *      <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s><s>[INST] {user} [/INST]
 *      where the first [INST] block's whole content and every answer are
 *      strip()ped; roles after the optional system message must alternate
 *      user/assistant starting with user; there is no separate generation
 *      prompt (a prompt ending in [/INST] is one).
 *
 * trim/strip are Python's str.strip(): Unicode whitespace at both ends.
 * The BOS/EOS strings are the families' own ("<|begin_of_text|>", "<s>",
 * "</s>"); the formatted text is meant to be encoded with parse_special=true
 * and add_special=false (the template already holds BOS).
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ST_CHAT_NONE = 0, /* no template: the prompt is used as it is */
    ST_CHAT_CHATML,
    ST_CHAT_LLAMA3,
    ST_CHAT_LLAMA2,
} st_chat_kind;

typedef struct {
    const char *role;    /* "system", "user", "assistant" (ChatML/Llama-3 pass others through) */
    const char *content; /* UTF-8, NUL-terminated */
} st_chat_msg;

/* A recognised template. Strings are owned (st_chat_template_clear frees them). */
typedef struct {
    st_chat_kind kind;
    /* ChatML: the system message the template inserts when the conversation
     * does not start with one; NULL: none. */
    char *default_system;
    /* Llama-3 only: non-NULL selects the Llama-3.1+ form, whose system turn
     * always starts with "Cutting Knowledge Date: ...\nToday Date: {date}\n\n".
     * st_chat_detect sets the template's fallback date ("26 Jul 2024"). */
    char *date;
    /* The template asks for today's date (strftime_now("%d %b %Y")) when its
     * host provides it, as transformers does; the caller may replace `date`
     * with today's date in that form. The library never reads the clock. */
    bool date_from_clock;
} st_chat_template;

/* "chatml", "llama3", "llama2" (and "none") <-> kind. */
bool st_chat_kind_from_name(const char *name, st_chat_kind *out);
const char *st_chat_kind_name(st_chat_kind kind);

/* Recognises a chat template's Jinja source. NULL or "" -> kind ST_CHAT_NONE
 * (STRATA_OK). An unrecognised template -> STRATA_ERR_UNSUPPORTED with a message
 * naming the markers found in it (e.g. "<start_of_turn>, <end_of_turn>").
 * On success *out holds owned strings (st_chat_template_clear); on error *out
 * is zeroed. */
strata_status st_chat_detect(const char *jinja, st_chat_template *out);

/* Frees the strings and zeroes t. NULL and a zeroed struct are fine. */
void st_chat_template_clear(st_chat_template *t);

/* Formats msgs[0..n) (n >= 1) with the template. add_generation_prompt appends
 * the assistant header (ChatML, Llama-3; Llama-2 has none). On success *out is
 * a malloc'd NUL-terminated string (caller frees); on error (kind NONE, a NULL
 * role/content, roles Llama-2 does not accept, tool messages on Llama-3.1+)
 * *out is NULL and the message says why. */
strata_status st_chat_format(const st_chat_template *t, const st_chat_msg *msgs, int64_t n,
                             bool add_generation_prompt, char **out);

/* The same, and where the template's own text is: *spans (malloc'd, the
 * caller frees; NULL when none) holds *n_spans sorted, disjoint [start, end)
 * byte ranges of *out written by the template (its markers, control tokens,
 * default system message), not taken from the messages (roles, contents) or
 * the date. Tokenize with st_tokenizer_encode_spans so that control token
 * strings inside contents stay text. */
strata_status st_chat_format_spans(const st_chat_template *t, const st_chat_msg *msgs, int64_t n,
                                   bool add_generation_prompt, char **out, size_t **spans, int64_t *n_spans);

/* Python's str.strip() on UTF-8 s[0..len): *start / *end delimit the result. */
void st_chat_strip(const char *s, size_t len, size_t *start, size_t *end);

#ifdef __cplusplus
}
#endif

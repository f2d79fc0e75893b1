/* server/openai: the OpenAI-compatible request and response bodies, apart
 * from HTTP. Parsing checks every field it knows (type and range) and turns a
 * request into a prompt (text or token ids) plus generation parameters; the
 * builders write the answers (whole or as stream chunks) and error bodies.
 *
 * Fields and their rules (both endpoints unless said):
 *   model                     string, optional: absent is the served model; another name
 *                             gets 404 model_not_found (checked by the server)
 *   messages (chat)           non-empty array of {role, content}; role system|developer|user|
 *                             assistant|tool; content a string, an array of {"type":"text","text"}
 *                             parts (joined with "\n"), or null (assistant only); contents are
 *                             text: control token strings in them ("<|im_end|>") stay text,
 *                             only the template writes control tokens (strata_chat_tokenize)
 *   prompt (completions)      a string, an array of one string, or an array of token ids
 *   max_tokens, max_completion_tokens   integer >= 1 (absent: until the context is full)
 *   temperature               number in [0, 2] (default 1; 0: greedy); numbers must be finite
 *   top_p                     number in (0, 1] (default 1)
 *   top_k                     integer >= -1 (0 or -1: off)       (extension, as vLLM)
 *   min_p                     number in [0, 1]                   (extension)
 *   repetition_penalty        number in (0, 2]                   (extension)
 *   seed                      integer in [0, 2^53]; -1 or absent: a fresh seed per request
 *                             (every range as strata run's: strata.h; a positive top_p or
 *                             repetition_penalty below the float range is the smallest float)
 *   stop                      string or array of at most 16 non-empty strings
 *   n                         1 only
 *   stream                    boolean; stream_options {include_usage: boolean} only with stream
 *   ignore_eos                boolean                            (extension, for benchmarks)
 *   presence_penalty, frequency_penalty   0 only (not implemented: other values are refused)
 *   logprobs, top_logprobs, echo, best_of > 1, suffix, tools, functions, logit_bias,
 *   response_format other than text: refused (400) when they ask for something.
 * Any other field is ignored, as OpenAI-compatible servers commonly do.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

#define SRV_MAX_STOP 16

typedef enum { SRV_CHAT = 0, SRV_COMPLETIONS } srv_kind;

/* A parsed generation request. Strings are owned (srv_gen_clear). */
typedef struct {
    srv_kind kind;
    char *model;            /* the "model" field (NULL: absent) */
    char *prompt_text;      /* completions: the prompt text (tokenized with its control tokens, BOS added) */
    int32_t *prompt_ids;    /* chat: the conversation's tokens (strata_chat_tokenize: control tokens only
                               from the template); completions given token ids (else NULL) */
    int64_t n_prompt_ids;
    strata_request_params sp; /* the sampling fields only: temperature, top_k, top_p, min_p,
                                 repetition_penalty, seed (prompt and stop are the fields above) */
    bool seed_given;
    int64_t max_tokens;     /* 0: not given */
    char *stop[SRV_MAX_STOP];
    int n_stop;
    bool stream, include_usage, ignore_eos;
} srv_gen;

/* An OpenAI-style error: {"error": {"message", "type", "param", "code"}}. */
typedef struct {
    int status;             /* HTTP status */
    const char *type;       /* "invalid_request_error", "authentication_error", "server_error", ... */
    const char *code;       /* NULL: JSON null */
    char param[64];         /* "": JSON null */
    char message[768];
} srv_error;

/* Fills e (status 400 unless set otherwise by the helpers). */
void srv_error_set(srv_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* Parses a request body. model: formats chat conversations with its chat
 * template (strata_chat_apply; NULL, or a template "none": chat is refused).
 * On success fills *g (caller clears it) and returns true; on a bad
 * request returns false with *e filled (*g left cleared). */
bool srv_parse_gen(srv_kind kind, const char *body, size_t len, const strata_model *model, srv_gen *g,
                   srv_error *e);
void srv_gen_clear(srv_gen *g);

/* ---- answers: malloc'd NUL-terminated JSON text (NULL when out of memory) ----*/
typedef struct {
    const char *id;         /* "chatcmpl-..." / "cmpl-..." */
    const char *model;
    long long created;      /* unix seconds */
    srv_kind kind;
} srv_answer_meta;

/* finish: "stop" / "length" (NULL: JSON null, for stream chunks) */
char *srv_json_answer(const srv_answer_meta *m, const char *text, size_t len, const char *finish,
                      const strata_finish *usage);
/* One stream chunk. role: put "role":"assistant" in the delta (chat's first
 * chunk). text may be NULL (no content field in a chat delta). finish may be
 * NULL. with_usage_null: "usage": null (stream_options.include_usage). */
char *srv_json_chunk(const srv_answer_meta *m, bool role, const char *text, size_t len, const char *finish,
                     bool with_usage_null);
/* The last chunk of include_usage: empty choices and the usage. */
char *srv_json_usage_chunk(const srv_answer_meta *m, const strata_finish *usage);
char *srv_json_error(const srv_error *e);
/* GET /v1/models */
char *srv_json_models(const char *model, long long created, int64_t max_model_len);

#ifdef __cplusplus
}
#endif

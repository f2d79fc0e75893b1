/* engine/generate: text generation for one sequence — the engine in its
 * simplest form (the scheduler with batching comes later).
 *
 *   prompt ids --prefill--> logits --sample--> token --decode step--> ...
 *
 * The prompt is run at the end of what the model's KV cache already holds
 * (st_llama_n_past), so a caller can continue a conversation by passing only
 * the new turn's tokens, or start over with st_llama_reset first. Each new
 * token goes through the streaming detokenizer (never half a UTF-8 character)
 * and the stop-string filter before the callback sees it.
 *
 * Stops at, whichever comes first:
 *   - max_tokens generated tokens;
 *   - a stop id of the tokenizer (EOS, <|im_end|>, <|eot_id|> ...): not fed to
 *     the model, its text not emitted;
 *   - a user stop string: the text is emitted up to (not including) its first
 *     occurrence; text that could be the start of a stop string is held back
 *     until it is decided;
 *   - the model's context being full (n_ctx);
 *   - the callback returning false.
 * A sampled token is fed to the model only when another one is to follow, so
 * after the call the cache holds the prompt and every generated token but the
 * last sampled one (st_generate_stats.n_fed counts those fed). A caller that
 * continues the sequence feeds last_token first unless the stop was
 * ST_STOP_EOS (a stop id never enters the cache).
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "engine/sampler.h"
#include "model/llama.h"
#include "tokenizer/tokenizer.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t max_tokens;           /* > 0: at most this many generated tokens; 0: until the context is full */
    int64_t n_ctx;                /* the model's context (tokens); 0: unknown (generation stops when a step fails) */
    const char *const *stop;      /* user stop strings (non-empty, valid UTF-8), may be NULL */
    int n_stop;
    bool emit_special;            /* false (default): special tokens' text is not emitted */
} st_generate_params;

typedef enum {
    ST_STOP_NONE = 0,
    ST_STOP_MAX_TOKENS,
    ST_STOP_EOS,       /* a tokenizer stop id was sampled */
    ST_STOP_STRING,    /* a user stop string appeared */
    ST_STOP_CONTEXT,   /* the context is full */
    ST_STOP_CALLBACK,  /* the callback asked to stop */
} st_stop_reason;

const char *st_stop_reason_name(st_stop_reason r);

typedef struct {
    int64_t prompt_tokens;   /* tokens prefilled by this call */
    double prompt_s;         /* prefill time, up to the first logits */
    int64_t gen_tokens;      /* tokens sampled (a final stop id counts, it is a decode step's result) */
    double gen_s;            /* from the first logits to the end */
    int64_t n_fed;           /* generated tokens fed to the model (now in the KV cache) */
    st_stop_reason stop;
    int32_t last_token;      /* the last sampled token (-1: none) */
} st_generate_stats;

/* Called with each new piece of text (complete UTF-8, len > 0, not
 * NUL-terminated). Return false to stop generation. */
typedef bool (*st_generate_text_fn)(const char *text, size_t len, void *user);

/* Runs prompt[0..n_prompt) (n_prompt >= 1) after the cache's current content,
 * then samples up to max_tokens tokens with `sampler`, streaming their text to
 * `on_text` (may be NULL). The repetition penalty sees this call's prompt and
 * generated tokens. Borrows everything; on error (a forward or sampling
 * failure, bad params) returns its status with the stats so far (*stats is
 * always written) — text already passed to on_text stays passed. */
strata_status st_generate(st_llama *model, const st_tokenizer *tok, st_sampler *sampler,
                          const int32_t *prompt, int64_t n_prompt, const st_generate_params *params,
                          st_generate_text_fn on_text, void *user, st_generate_stats *stats);

/* ---- the stop-string filter, exposed for tests ----------------------------------
 * Feeds text through and releases what can no longer be part of a stop
 * string. */
typedef struct st_stop_filter st_stop_filter;
/* Copies the strings; empty strings are INVALID_ARG. *out owned by the caller. */
strata_status st_stop_filter_init(const char *const *stop, int n_stop, st_stop_filter **out);
void st_stop_filter_free(st_stop_filter *f); /* NULL: no-op */
/* Appends text; *out, *out_len: what may be emitted now (buffer owned by f,
 * valid until the next call); *stopped: a stop string was found (the output
 * ends just before it; everything after it is dropped and later pushes emit
 * nothing). */
strata_status st_stop_filter_push(st_stop_filter *f, const char *text, size_t len, const char **out,
                                  size_t *out_len, bool *stopped);
/* End of text: releases what was held back (nothing after a stop). */
void st_stop_filter_flush(st_stop_filter *f, const char **out, size_t *out_len);

#ifdef __cplusplus
}
#endif

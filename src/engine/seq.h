/* engine/seq: one sequence (a request's token stream) as the scheduler sees it.
 *
 * tokens[0..n_prompt) is the prompt, tokens[n_prompt..n_tokens) the generated
 * ids, in order. kv is its KV block table; kv.n_computed tokens have their KV
 * in the cache, so tokens[kv.n_computed .. n_tokens) are "pending": they must
 * run through the model before the next token can be sampled. A decoding
 * sequence has exactly one pending token (the last sampled one); a prefilling
 * one has more (the rest of its prompt, or after a preemption its prompt and
 * generated tokens, all recomputed).
 *
 * The scheduler owns its st_seq structs; callers get const pointers
 * (st_scheduler_get_seq) and treat them as read-only.
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#include "kv/block_manager.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ST_SEQ_WAITING = 0, /* in the waiting queue: holds no KV blocks */
    ST_SEQ_RUNNING,     /* admitted: holds blocks for kv.n_slots positions */
} st_seq_state;

/* Why a sequence left the scheduler. */
typedef enum {
    ST_SEQ_FINISH_NONE = 0,
    ST_SEQ_FINISH_MAX_TOKENS, /* max_tokens tokens generated */
    ST_SEQ_FINISH_CONTEXT,    /* it holds max_model_len tokens (prompt + generated) */
    ST_SEQ_FINISH_STOP,       /* the caller saw a stop id / stop string (st_scheduler_finish) */
    ST_SEQ_FINISH_ABORT,      /* st_scheduler_abort */
} st_seq_finish;

const char *st_seq_finish_name(st_seq_finish r); /* "max_tokens", "context", "stop", "abort", "none" */

typedef struct {
    const int32_t *prompt; /* [n_prompt] ids (>= 0), copied */
    int64_t n_prompt;      /* >= 1 */
    int64_t max_tokens;    /* > 0: at most this many generated tokens; 0: until max_model_len */
    void *user;            /* the caller's per-request state, handed back in every item */
} st_seq_params;

typedef struct {
    uint64_t id;           /* the caller's id, unique among live sequences */
    uint64_t arrival;      /* add order: FCFS priority, smaller = older = first */
    st_seq_state state;
    int32_t *tokens;       /* [n_tokens] prompt then generated ids; owned */
    int64_t n_tokens, cap;
    int64_t n_prompt;
    int64_t max_tokens;
    void *user;
    st_block_table kv;     /* its KV blocks (see kv/block_manager.h) */
    int64_t n_preemptions; /* times it was sent back to waiting */
    int64_t n_cached;      /* prompt tokens found in the prefix cache at its first admission (-1: not admitted yet) */
    int64_t plan;          /* scheduler scratch: this step's plan entry, -1 none */
} st_seq;

/* Checks p (INVALID_ARG naming the bad field) and makes a WAITING sequence
 * with a copy of the prompt. The caller owns *out (st_seq_free); NULL on error. */
strata_status st_seq_init(const st_seq_params *p, uint64_t id, uint64_t arrival, st_seq **out);
/* Frees the memory; the sequence's blocks must have been released to their
 * block manager first (st_bm_seq_free). NULL: no-op. */
void st_seq_free(st_seq *s);

/* Makes room for n_tokens ids in tokens (NOMEM, s unchanged, on failure). */
strata_status st_seq_reserve(st_seq *s, int64_t n_tokens);
/* Appends one generated id; room must have been reserved (asserted). */
void st_seq_append(st_seq *s, int32_t token);

static inline int64_t st_seq_n_generated(const st_seq *s) { return s->n_tokens - s->n_prompt; }
static inline int64_t st_seq_n_pending(const st_seq *s) { return s->n_tokens - s->kv.n_computed; }

#ifdef __cplusplus
}
#endif

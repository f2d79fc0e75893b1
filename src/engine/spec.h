/* engine/spec: speculative decoding — who proposes the draft tokens a
 * decoding sequence's next step verifies, and how many.
 *
 * A step of a sequence that has drafts d1..dk runs its last token and the k
 * drafts in one item (scheduler.h: a decode item of 1 + n_draft tokens); the
 * runner then verifies them row by row with the sequence's own sampler
 * (st_sampler_verify): greedy accepts d(i+1) when it is the argmax of row i,
 * sampling accepts it with the target probability p_i(d(i+1)) and otherwise
 * draws from p_i without it (the rejection rule for a draft that is a
 * single token, which keeps the target distribution). The first rejected
 * row's token, or the row after the last draft when all were accepted, is
 * the step's new token: a step yields 1 .. k + 1 tokens, and greedy output is
 * the same token for token as plain decoding (bit for bit on the CPU, whose
 * logits do not depend on the batch).
 *
 * Drafts come from
 *   - prompt lookup (ST_SPEC_LOOKUP): the longest suffix of the sequence's
 *     tokens (ngram_max down to ngram_min tokens) that occurred before; the
 *     tokens that followed its latest occurrence are the drafts. No model,
 *     no device work;
 *   - a draft model (ST_SPEC_DRAFT): a smaller model of the same vocabulary
 *     on the same backend, with a KV cache of its own (one fixed slot of
 *     blocks per sequence it drafts for, ceil(max_model_len / block) blocks);
 *     each step it catches up on the sequence's tokens it has not seen (the
 *     prompt, then the tokens the last verification accepted) and runs k
 *     greedy single-token passes, batched over the sequences.
 *
 * The number of drafts adapts per sequence: the acceptance rate a (decayed
 * counts of accepted / proposed-and-judged drafts) gives the expected tokens
 * of a step with k drafts, (1 - a^(k+1)) / (1 - a), against its cost, 1 +
 * c k in units of a one-token step; k is the best of 0..k_max (0: drafts do
 * not pay). c is measured (st_drafter_step_time): of every 16 steps the first
 * proposes no drafts (the plain decode step's forward time, t0) and the steps
 * with drafts give (time / t0 - 1) / drafts; the ninth proposes at least one
 * draft for every sequence, so that a sequence whose drafts stopped paying
 * is judged again. Until measured, c is 0.1; params.step_cost > 0 fixes it
 * (nothing measured).
 *
 * Owned by the runner (one st_drafter); called on the runner's thread only. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "core/core.h"
#include "engine/seq.h"
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ST_SPEC_OFF = 0, ST_SPEC_LOOKUP, ST_SPEC_DRAFT } st_spec_mode;

const char *st_spec_mode_name(st_spec_mode m); /* "off", "lookup", "draft" */

typedef struct {
    st_spec_mode mode;
    int k_max;                         /* most drafts per step (0: 7, so a pass is at most 8 tokens:
                                          the decode GEMV's widest pass, the CPU tier's default
                                          cpu_max_tokens; at most 32) */
    int ngram_min, ngram_max;          /* lookup: suffix lengths tried, longest first (0: 1, 3) */
    double step_cost;                  /* one more verified token, in units of a one-token step: > 0
                                          fixed; 0 (default): measured as the steps run (0.1 until
                                          then) */
    const st_model_files *draft;       /* ST_SPEC_DRAFT: the draft model (borrowed; same vocabulary); its KV
                                          cache: room for every running sequence at max_model_len, at
                                          most 1 GiB, at least one sequence */
} st_spec_params;

/* Fills the defaults and checks p (INVALID_ARG naming the field). */
strata_status st_spec_params_resolve(st_spec_params *p);

/* Prompt lookup: the drafts after tokens[0..n): at most k tokens into out,
 * their count returned (0: no suffix of ngram_min..ngram_max tokens occurred
 * before). Pure; tests call it directly. */
int64_t st_spec_lookup(const int32_t *tokens, int64_t n, int ngram_min, int ngram_max, int64_t k, int32_t *out);

/* The number of drafts (0..k_max) that maximises the expected tokens per
 * unit of step cost at acceptance rate a in [0, 1]; 0 when no k gives more
 * than one token per unit. */
int st_spec_best_k(double a, int k_max, double step_cost);

typedef struct st_drafter st_drafter;

/* Makes the drafter for sequences of at most max_model_len tokens, at most
 * max_batch running (ST_SPEC_DRAFT: the draft model on `be`, its KV pool in
 * kv_dtype, the model's: a model drafting for itself proposes its own argmax).
 * p resolved (st_spec_params_resolve). The caller owns *out. */
strata_status st_drafter_init(const st_spec_params *p, st_backend *be, int64_t vocab, int64_t max_batch,
                              int64_t max_model_len, st_kv_dtype kv_dtype, st_drafter **out);
void st_drafter_free(st_drafter *d); /* NULL: no-op */
/* Device bytes the drafter will take with these arguments (ST_SPEC_DRAFT: the
 * draft model's weights, its activations and KV pool; else 0): the runner
 * keeps them out of the model's device budget. */
size_t st_drafter_device_bytes(const st_spec_params *p, const st_backend *be, int64_t max_batch,
                               int64_t max_model_len, st_kv_dtype kv_dtype);

/* Proposes drafts for the decoding sequences seqs[0..n) (each with exactly
 * one pending token): q->n_draft drafts at q->tokens[q->n_tokens ..] (room
 * reserved here), at most max_drafts[i] for seqs[i] (what max_tokens and
 * max_model_len leave). A sequence without drafts gets n_draft 0. Errors
 * (a draft pass failed) leave every n_draft 0. */
strata_status st_drafter_propose(st_drafter *d, st_seq *const *seqs, const int64_t *max_drafts, int64_t n);

/* After verification: q ran n_draft drafts and the first `accepted` were
 * accepted (q->n_draft is cleared). Adapts its k and its draft KV. */
void st_drafter_verified(st_drafter *d, st_seq *q, int64_t accepted);

/* After a decode-only step's forward pass: its time and the drafts it ran (the
 * cost model above). */
void st_drafter_step_time(st_drafter *d, int64_t drafts, double forward_s);

/* q left the runner (finished, preempted or aborted): its draft state goes
 * (a draft-model slot is freed; a preempted sequence catches up again). */
void st_drafter_forget(st_drafter *d, st_seq *q);

#ifdef __cplusplus
}
#endif

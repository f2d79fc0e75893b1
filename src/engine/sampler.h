/* engine/sampler: next-token choice from a sequence's last logits.
 *
 * One st_sampler per sequence: it holds its parameters, its own random state
 * (xoshiro256** seeded from `seed` through splitmix64; the same seed gives the
 * same draws on every machine) and scratch space for `vocab` tokens. There is
 * no shared state: samplers of different sequences may run on different
 * threads.
 *
 * Steps, in this order (Hugging Face transformers' semantics for each):
 *   1. repetition penalty: every distinct token of the history (the last
 *      repeat_last_n ids, 0: all) has its logit divided by the penalty when
 *      positive, multiplied by it when negative (HF
 *      RepetitionPenaltyLogitsProcessor);
 *   2. temperature: logits / T; T == 0 -> greedy: the argmax (lowest id on a
 *      tie) after the penalty, no random draw;
 *   3. top-k: keep the tokens whose logit is >= the k-th largest (ties at the
 *      boundary kept, as HF does);
 *   4. top-p: softmax over what is left, sorted by probability; keep the
 *      smallest prefix whose mass reaches top_p (at least one token);
 *   5. min-p: drop tokens whose probability is below min_p x the top one;
 *   6. draw from what is left, renormalised: with u uniform in [0, 1) (one
 *      draw of the random state), the first kept token in increasing id
 *      whose cumulative probability exceeds u (the backends' `sample` op
 *      walks the same way, so it gives the same token for the same u).
 * A step with its neutral value (penalty 1, top_k 0, top_p 1, min_p 0) is
 * skipped; tokens it removes can never be drawn. A +inf logit is an error
 * unless greedy.
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    float temperature;     /* 0: greedy; else > 0 */
    int32_t top_k;         /* 0: off */
    float top_p;           /* (0, 1]; 1: off */
    float min_p;           /* [0, 1]; 0: off */
    float repeat_penalty;  /* > 0; 1: off */
    int64_t repeat_last_n; /* history tokens the penalty looks at, newest first; 0: all */
    uint64_t seed;
} st_sampler_params;

/* Neutral parameters: temperature 1, no truncation, no penalty, seed 0
 * (plain sampling from softmax(logits)). */
st_sampler_params st_sampler_params_default(void);

typedef struct st_sampler st_sampler;

/* Checks the parameters (INVALID_ARG naming the bad one) and allocates the
 * state for a vocabulary of `vocab` tokens; its vocabulary-sized work buffers
 * come at the first host draw (st_sampler_sample, _sample_u, _probs: NOMEM
 * there). The caller owns *out (st_sampler_free); *out is NULL on error. */
strata_status st_sampler_init(const st_sampler_params *p, int64_t vocab, st_sampler **out);
void st_sampler_free(st_sampler *s); /* NULL: no-op */

/* Chooses the next token from logits[0..vocab) given the sequence so far
 * (history[0..n_history), oldest first; may be NULL when n_history is 0;
 * used only by the repetition penalty). Advances the random state (except when
 * greedy). INVALID_ARG when a logit is NaN, every logit is -inf, or a history
 * id is outside the vocabulary. logits are not modified. */
strata_status st_sampler_sample(st_sampler *s, const float *logits, const int32_t *history,
                                int64_t n_history, int32_t *out);

/* As st_sampler_sample with the uniform draw given (u in [0, 1), else
 * INVALID_ARG): the random state is not touched. */
strata_status st_sampler_sample_u(st_sampler *s, const float *logits, const int32_t *history,
                                  int64_t n_history, double u, int32_t *out);

/* Speculative decoding: judges a draft token against the logits of its
 * position (history as for st_sampler_sample, the accepted drafts before it
 * included). Greedy: *accepted when the draft is the argmax, *out = the
 * argmax. Sampling (steps 1-5 as above give p): *accepted with probability
 * p(draft) (one draw), *out = draft; else *out is drawn (a second draw) from
 * p without the draft, renormalised — the rejection rule for a draft that
 * is one token (a draft distribution that is one-hot), which makes *out
 * distributed as p overall. Errors as st_sampler_sample. */
strata_status st_sampler_verify(st_sampler *s, const float *logits, const int32_t *history, int64_t n_history,
                                int32_t draft, bool *accepted, int32_t *out);
/* Sampling on the device (the backend's `sample` op does steps 2-6): true
 * when this sampler has nothing else to do (repetition penalty off), so that
 * the op with st_sampler_next_args' args picks what st_sampler_sample would. */
bool st_sampler_device_ok(const st_sampler *s);
/* The op's args for this sampler's next token: its parameters, and u drawn
 * from its random state when not greedy (exactly the draw st_sampler_sample
 * would make; greedy: u = 0 and no draw). */
void st_sampler_next_args(st_sampler *s, st_sample_args *out);

/* Restarts the random sequence from `seed`. */
void st_sampler_reseed(st_sampler *s, uint64_t seed);
const st_sampler_params *st_sampler_get_params(const st_sampler *s);
/* The vocabulary size it was made for: it draws ids in [0, vocab) and reads
 * that many logits. */
int64_t st_sampler_vocab(const st_sampler *s);

/* The distribution step 6 draws from (after steps 1-5), for tests and tools:
 * probs[0..vocab) sums to 1 (zeros for removed tokens; greedy: a one-hot).
 * Does not touch the random state. Errors as st_sampler_sample. */
strata_status st_sampler_probs(st_sampler *s, const float *logits, const int32_t *history,
                               int64_t n_history, float *probs);

#ifdef __cplusplus
}
#endif

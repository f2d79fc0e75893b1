/* model: the Llama forward pass, written once against backend.h.
 *
 * One sequence with a contiguous per-layer KV cache on the backend. The pass is
 * organised per layer group (attn, ffn) so that the weight manager can later
 * supply each group's weights (acquire/release with events) without changing
 * the math. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_llama st_llama;

typedef struct {
    int64_t max_ctx;        /* KV cache capacity in tokens (0: min(max_position_embeddings, 4096)) */
    int64_t max_batch;      /* tokens per forward chunk (0: 512); longer inputs run in chunks */
} st_llama_params;

/* Builds the model over the opened files on `be`. Borrows `files` and `be`
 * (both must outlive the model); the caller owns *out (st_llama_free).
 * On CPU the weights are used in place from the file mapping. */
strata_status st_llama_init(const st_model_files *files, st_backend *be,
                            const st_llama_params *params, st_llama **out);
void st_llama_free(st_llama *m); /* NULL is a no-op */

/* Runs tokens[0..n) at positions n_past .. n_past+n-1 of the sequence, storing
 * their K/V. n_past must equal the number of tokens already run (st_llama_reset
 * starts over). logits (host memory): [n, vocab] when all_logits, else [vocab]
 * for the last token. On error the cache is left as before the call. */
strata_status st_llama_forward(st_llama *m, const int32_t *tokens, int64_t n, int64_t n_past,
                               bool all_logits, float *logits);
void st_llama_reset(st_llama *m);
int64_t st_llama_n_past(const st_llama *m);
int64_t st_llama_max_ctx(const st_llama *m); /* KV capacity in tokens */
const st_config *st_llama_config(const st_llama *m);

/* RoPE inverse frequencies [head_dim/2] as HF transformers computes them in
 * float32 (default, linear and llama3 scaling), divided element-wise by
 * `freq_divisors` when given (GGUF's rope_freqs tensor). */
void st_llama_rope_inv_freq(const st_config *c, const float *freq_divisors, float *inv_freq);

#ifdef __cplusplus
}
#endif

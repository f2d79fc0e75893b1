/* loader: model files -> config + tensor descriptors. Never touches a device.
 *
 * A model is either a Hugging Face directory (config.json + model.safetensors or
 * model.safetensors.index.json with shards) or one GGUF v3 file. Files are
 * mapped read-only; tensor data is reached through the mapping, never copied
 * or expanded.
 *
 * Canonical tensor names are the Hugging Face ones; the GGUF reader renames:
 *   token_embd.weight        -> model.embed_tokens.weight          [vocab, hidden]
 *   blk.N.attn_norm.weight   -> model.layers.N.input_layernorm.weight  [hidden]
 *   blk.N.attn_q.weight      -> model.layers.N.self_attn.q_proj.weight [heads*hd, hidden]
 *   blk.N.attn_k.weight      -> model.layers.N.self_attn.k_proj.weight [kv*hd, hidden]
 *   blk.N.attn_v.weight      -> model.layers.N.self_attn.v_proj.weight [kv*hd, hidden]
 *   blk.N.attn_output.weight -> model.layers.N.self_attn.o_proj.weight [hidden, heads*hd]
 *   blk.N.ffn_norm.weight    -> model.layers.N.post_attention_layernorm.weight [hidden]
 *   blk.N.ffn_gate.weight    -> model.layers.N.mlp.gate_proj.weight [inter, hidden]
 *   blk.N.ffn_up.weight      -> model.layers.N.mlp.up_proj.weight   [inter, hidden]
 *   blk.N.ffn_down.weight    -> model.layers.N.mlp.down_proj.weight [hidden, inter]
 *   output_norm.weight       -> model.norm.weight                   [hidden]
 *   output.weight            -> lm_head.weight                      [vocab, hidden]
 * Shapes are outermost first (PyTorch order): a linear weight is [out, in] and
 * its rows are contiguous (GGUF's ne[] is reversed into this order).
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#include "core/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ST_MAX_DIMS 4
#define ST_MAX_EOS 8

typedef enum {
    ST_ROPE_SCALING_NONE = 0,
    ST_ROPE_SCALING_LLAMA3,
    ST_ROPE_SCALING_LINEAR,
} st_rope_scaling;

typedef struct {
    int64_t vocab_size;
    int64_t hidden_size;
    int64_t intermediate_size;
    int64_t n_layers;
    int64_t n_heads;
    int64_t n_kv_heads;
    int64_t head_dim;            /* may differ from hidden/heads */
    int64_t max_position_embeddings;
    float rms_norm_eps;
    double rope_theta;
    st_rope_scaling rope_scaling;
    double rope_factor;          /* llama3 / linear */
    double rope_low_freq_factor; /* llama3 */
    double rope_high_freq_factor;/* llama3 */
    int64_t rope_original_max_pos; /* llama3 */
    bool tie_word_embeddings;
    /* GGUF stores Q/K rows permuted for interleaved pairs (2i, 2i+1);
     * HF uses rotate-half pairs (i, i + hd/2). Both give the same logits. */
    bool rope_interleaved;
    int32_t bos_token_id;        /* -1: none */
    int32_t eos_token_ids[ST_MAX_EOS];
    int n_eos;
} st_config;

typedef struct {
    char *name;                  /* canonical (HF) name, owned */
    st_dtype dtype;
    int n_dims;
    int64_t shape[ST_MAX_DIMS];  /* outermost first */
    int file;                    /* index into st_model_files.files */
    uint64_t offset;             /* absolute byte offset in that file */
    uint64_t nbytes;
} st_tensor_desc;

typedef enum { ST_FORMAT_SAFETENSORS = 0, ST_FORMAT_GGUF } st_model_format;

typedef struct st_gguf_meta st_gguf_meta; /* GGUF key/values (tokenizer etc.) */

typedef struct {
    st_model_format format;
    char *path;                  /* what was opened (dir or .gguf file) */
    st_mapped_file *files;
    int n_files;
    st_tensor_desc *tensors;
    int64_t n_tensors;
    st_config config;
    st_gguf_meta *gguf;          /* NULL for HF directories */
} st_model_files;

/* Opens a HF directory or a .gguf file (by what `path` is), parses and validates
 * everything (st_model_validate included). The caller owns *out and frees it
 * with st_model_close. On error *out is NULL and st_last_error() names the
 * file and what is wrong. */
strata_status st_model_open(const char *path, st_model_files **out);
void st_model_close(st_model_files *m); /* NULL is a no-op */

/* The format-specific openers behind st_model_open (they validate too). */
strata_status st_safetensors_open_dir(const char *dir, st_model_files **out);
strata_status st_gguf_open(const char *path, st_model_files **out);
/* st_gguf_open of a GGUF file image already in memory: data[0..size) is
 * borrowed (it must outlive *out and is never freed or unmapped), `name`
 * stands for the path (messages, m->path). The model's file has no descriptor,
 * so its weights cannot be streamed from disk: for tests and fuzzing (where
 * the sanitizers see a read past the end of the buffer, as they cannot past
 * the end of a file inside its mapping's last page). */
strata_status st_gguf_open_mem(const void *data, size_t size, const char *name, st_model_files **out);

/* Parses a HF config.json text into *cfg. `path` is only used in messages.
 * Accepts transformers v4 `rope_scaling` and v5 `rope_parameters`. */
strata_status st_config_parse_json(const char *text, const char *path, st_config *cfg);

/* The names a format gives the config's keys, for st_config_check's messages. */
typedef struct {
    const char *vocab_size, *hidden_size, *intermediate_size, *n_layers, *n_heads, *n_kv_heads,
        *head_dim, *max_position_embeddings, *rms_norm_eps, *rope_theta, *rope_factor, *rope_dim,
        *bos_token_id, *eos_token_id;
    const char *eos_keys[ST_MAX_EOS]; /* per end token, when they come from different keys (else NULL) */
} st_config_keys;
extern const st_config_keys st_config_keys_json; /* config.json (transformers' names) */
extern const st_config_keys st_config_keys_gguf; /* GGUF llama.* / tokenizer.ggml.* keys */

#define ST_CONFIG_MAX_CONTEXT ((int64_t)1 << 26) /* positions: more is taken as corrupt */
#define ST_CONFIG_MAX_DIM INT32_MAX              /* any size or count */

/* The one set of range and consistency rules both formats' hyperparameters
 * must pass (config.json and GGUF alike; called by both readers): sizes and
 * counts positive (and <= ST_CONFIG_MAX_DIM), num_attention_heads a multiple of
 * num_key_value_heads, head_dim even, rope_dim (the dimensions per head RoPE
 * rotates, < 0: not given) equal to head_dim (the forward pass rotates whole
 * heads), max_position_embeddings in [2, ST_CONFIG_MAX_CONTEXT], rms_norm_eps
 * in (0, 1), rope_theta (and a scaling factor) finite and positive, bos / eos
 * ids inside the vocabulary. Errors: STRATA_ERR_FORMAT with a message naming
 * `path` and the key (by its name in `keys`). */
strata_status st_config_check(const st_config *c, const char *path, const st_config_keys *keys,
                              int64_t rope_dim);

/* The sampling settings a model recommends: a HF directory's
 * generation_config.json (temperature, top_p, top_k, min_p,
 * repetition_penalty; do_sample false means greedy: temperature 0), a GGUF
 * file's general.sampling.* keys (temp, top_p, top_k, min_p, penalty_repeat).
 * Only what is present is set (has_*). */
typedef struct {
    bool has_temperature, has_top_p, has_top_k, has_min_p, has_repetition_penalty;
    double temperature;        /* >= 0 (0: greedy) */
    double top_p;              /* (0, 1] */
    int64_t top_k;             /* >= 0 (0: off) */
    double min_p;              /* [0, 1] */
    double repetition_penalty; /* > 0 */
    char source[1100];         /* the file (GGUF: "FILE general.sampling.*"); "" when nothing was found */
} st_sampling_defaults;

/* Reads m's recommended sampling into *out (zeroed first). A missing
 * generation_config.json (or no general.sampling.* key) is no error: nothing
 * is set. A file that cannot be parsed, a value of the wrong type or out of
 * range: STRATA_ERR_FORMAT (or IO) naming the file and the key. */
strata_status st_sampling_defaults_read(const st_model_files *m, st_sampling_defaults *out);

/* Checks that every tensor a Llama model needs is present, with dtype and
 * shape consistent with the config (lm_head optional when tied). */
strata_status st_model_validate(const st_model_files *m);

/* NULL when absent. */
const st_tensor_desc *st_model_find(const st_model_files *m, const char *name);
/* Pointer into the mapping of the tensor's file. */
const void *st_tensor_data(const st_model_files *m, const st_tensor_desc *t);

/* Frees a tensor table and the files; used by the format readers. */
void st_model_files_free_parts(st_model_files *m);

#ifdef __cplusplus
}
#endif

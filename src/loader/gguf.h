/* GGUF: metadata access for an opened GGUF model, and the GGUF writer.
 *
 * st_gguf_open (declared in loader.h) maps a GGUF v3 file and fills an
 * st_model_files whose `gguf` member holds every key/value of the file; this
 * header is how the tokenizer (and anything else) reads those values. The byte
 * layout is documented at the top of gguf.c.
 *
 * Values point into the file mapping or into the st_gguf_meta: they stay valid
 * until st_model_close of the model they came from. Array strings are NOT
 * NUL-terminated (a length comes with them); scalar strings are.
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#include "core/dtype.h"
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

/* GGUF value types (the u32 stored before each value). */
typedef enum {
    ST_GGUF_TYPE_UINT8 = 0,
    ST_GGUF_TYPE_INT8 = 1,
    ST_GGUF_TYPE_UINT16 = 2,
    ST_GGUF_TYPE_INT16 = 3,
    ST_GGUF_TYPE_UINT32 = 4,
    ST_GGUF_TYPE_INT32 = 5,
    ST_GGUF_TYPE_FLOAT32 = 6,
    ST_GGUF_TYPE_BOOL = 7,
    ST_GGUF_TYPE_STRING = 8,
    ST_GGUF_TYPE_ARRAY = 9,
    ST_GGUF_TYPE_UINT64 = 10,
    ST_GGUF_TYPE_INT64 = 11,
    ST_GGUF_TYPE_FLOAT64 = 12,
    ST_GGUF_TYPE_COUNT
} st_gguf_type;

/* ggml tensor type numbers that strata reads (others are UNSUPPORTED). */
enum {
    ST_GGML_TYPE_F32 = 0,
    ST_GGML_TYPE_F16 = 1,
    ST_GGML_TYPE_Q4_0 = 2,
    ST_GGML_TYPE_Q4_1 = 3,
    ST_GGML_TYPE_Q8_0 = 8,
    ST_GGML_TYPE_Q4_K = 12,
    ST_GGML_TYPE_Q6_K = 14,
    ST_GGML_TYPE_BF16 = 30,
};

#define ST_GGUF_DEFAULT_ALIGNMENT 32

/* "uint8", "string", "array", ...; "?" for an invalid value. */
const char *st_gguf_type_name(uint32_t t);
/* ggml type number <-> st_dtype; false when strata has no such dtype. */
bool st_gguf_dtype_from_ggml(uint32_t ggml_type, st_dtype *out);
uint32_t st_gguf_dtype_to_ggml(st_dtype t);

/* Tensor name mapping (the table in loader.h). Both return a malloc'd string
 * the caller frees. st_gguf_name_to_hf returns a copy of the name itself when
 * it has no mapping (e.g. "rope_freqs.weight"); st_gguf_name_from_hf returns
 * NULL for a name that has no GGUF equivalent (and NULL when out of memory). */
char *st_gguf_name_to_hf(const char *gguf_name);
char *st_gguf_name_from_hf(const char *hf_name);

/* Frees the metadata of a GGUF model (st_model_close calls it). NULL: no-op.
 * Does not touch the file mapping. */
void st_gguf_meta_free(st_gguf_meta *g);

/* ---- file-level facts ---- */
uint32_t st_gguf_version(const st_gguf_meta *g);
uint32_t st_gguf_alignment(const st_gguf_meta *g);
/* Absolute offset of the data section in the file. */
uint64_t st_gguf_data_offset(const st_gguf_meta *g);

/* ---- keys: by index in file order, 0 <= i < st_gguf_n_keys ---- */
int64_t st_gguf_n_keys(const st_gguf_meta *g);
/* Index of `key`, or -1 when absent (or g is NULL). */
int64_t st_gguf_find_key(const st_gguf_meta *g, const char *key);
const char *st_gguf_key_name(const st_gguf_meta *g, int64_t i);
st_gguf_type st_gguf_key_type(const st_gguf_meta *g, int64_t i);

/* ---- typed getters by key name --------------------------------------------
 * STRATA_ERR_NOT_FOUND when the key is absent, STRATA_ERR_FORMAT when its type
 * does not fit (integer getters accept any integer type whose value is in
 * range; float getters accept FLOAT32/FLOAT64); both with a message naming the
 * key. *out is written only on success. */
strata_status st_gguf_get_u32(const st_gguf_meta *g, const char *key, uint32_t *out);
strata_status st_gguf_get_i32(const st_gguf_meta *g, const char *key, int32_t *out);
strata_status st_gguf_get_u64(const st_gguf_meta *g, const char *key, uint64_t *out);
strata_status st_gguf_get_i64(const st_gguf_meta *g, const char *key, int64_t *out);
strata_status st_gguf_get_f32(const st_gguf_meta *g, const char *key, float *out);
strata_status st_gguf_get_f64(const st_gguf_meta *g, const char *key, double *out);
strata_status st_gguf_get_bool(const st_gguf_meta *g, const char *key, bool *out);
/* *out is NUL-terminated (owned by g); *len (may be NULL) excludes the NUL.
 * A string containing NUL bytes is still returned whole through *len. */
strata_status st_gguf_get_str(const st_gguf_meta *g, const char *key, const char **out,
                              uint64_t *len);

/* ---- arrays ----------------------------------------------------------------
 * st_gguf_get_arr: NOT_FOUND / FORMAT (not an array) as above; on success the
 * key's index, element type and element count. Element access is O(1) by the
 * key index; out-of-range indices or a wrong element type return false. */
strata_status st_gguf_get_arr(const st_gguf_meta *g, const char *key, int64_t *key_index,
                              st_gguf_type *elem_type, uint64_t *count);
/* i-th string of a string array: pointer into the mapping, NOT NUL-terminated. */
bool st_gguf_arr_str(const st_gguf_meta *g, int64_t key_index, uint64_t i, const char **s,
                     uint64_t *len);
/* i-th element of a numeric (or bool) array, converted. _i64 fails for floats
 * and for u64 values above INT64_MAX; _f64 accepts every numeric type. */
bool st_gguf_arr_i64(const st_gguf_meta *g, int64_t key_index, uint64_t i, int64_t *out);
bool st_gguf_arr_f64(const st_gguf_meta *g, int64_t key_index, uint64_t i, double *out);

/* The raw encoded value of key i exactly as stored in the file (for an array:
 * u32 elem type, u64 count, elements; for a string: u64 len, bytes); points
 * into the mapping. Used to copy values verbatim between files. */
void st_gguf_key_raw(const st_gguf_meta *g, int64_t i, const uint8_t **data, uint64_t *len);

/* ---- writer ------------------------------------------------------------------
 * Writes `src` (any opened model: HF directory or GGUF) as a llama GGUF v3 file
 * at out_path: llama.* metadata from src->config (plus the tokenizer.* keys of
 * a GGUF source, copied verbatim), tensors under their GGUF names, 2-D weights
 * converted to `type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1; a matrix whose rows are
 * not a multiple of the block falls back to F16), 1-D tensors as F32, the Q and
 * K rows permuted into llama.cpp's interleaved-RoPE order (unless the source is
 * already interleaved), and for llama3 rope scaling a "rope_freqs.weight" F32
 * tensor [head_dim/2] of frequency divisors. Tied models get no output.weight.
 * The caller keeps ownership of src. On error the partial file is removed and
 * st_last_error() names out_path (or the tensor) and what went wrong. */
strata_status st_gguf_write_model(const st_model_files *src, st_dtype type,
                                  const char *out_path);

/* The llama3 rope frequency divisors that st_gguf_write_model stores in
 * rope_freqs.weight: out[i] = inv_freq_i / scaled_inv_freq_i for
 * inv_freq_i = theta^(-2i/head_dim), i < head_dim/2 (HF transformers'
 * llama3 formula). cfg must have rope_scaling == ST_ROPE_SCALING_LLAMA3. */
void st_gguf_llama3_rope_divisors(const st_config *cfg, float *out);

#ifdef __cplusplus
}
#endif

/* Element types of weights and activations, and their block layouts.
 * Quantized types follow the GGUF/ggml block formats (little-endian):
 *   Q8_0 : 32 elems, 34 B  = f16 d; int8 qs[32];                 x = d*q
 *   Q4_0 : 32 elems, 18 B  = f16 d; u8 qs[16] (lo nibble: elems 0..15,
 *                             hi nibble: 16..31);                  x = d*(q-8)
 *   Q4_1 : 32 elems, 20 B  = f16 d, f16 m; u8 qs[16] (as Q4_0);   x = d*q + m
 *   Q4_K : 256 elems, 144 B = f16 d, f16 dmin; u8 scales[12] (8 sub-blocks of 32,
 *                             6-bit scale+min packed); u8 qs[128]
 *   Q6_K : 256 elems, 210 B = u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ST_DTYPE_F32 = 0,
    ST_DTYPE_F16,
    ST_DTYPE_BF16,
    ST_DTYPE_Q8_0,
    ST_DTYPE_Q4_0,
    ST_DTYPE_Q4_1,
    ST_DTYPE_Q4_K,
    ST_DTYPE_Q6_K,
    ST_DTYPE_COUNT
} st_dtype;

typedef struct {
    const char *name;     /* "f32", "bf16", "q8_0", ... */
    int64_t block_elems;  /* 1 for plain types */
    size_t block_bytes;
    bool quantized;
} st_dtype_info;

const st_dtype_info *st_dtype_get(st_dtype t); /* NULL for an invalid value */
const char *st_dtype_name(st_dtype t);         /* "?" for an invalid value */
/* Bytes of one row of n elements; 0 when n is not a multiple of the block. */
size_t st_dtype_row_bytes(st_dtype t, int64_t n);
/* Parses "f32", "F16", "bf16", "q8_0", ...; false when unknown. */
bool st_dtype_parse(const char *s, st_dtype *out);

/* Scalar conversions (round-to-nearest-even for the narrowing ones). */
static inline float st_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v; v.u = (uint32_t)h << 16; return v.f;
}
static inline uint16_t st_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v; v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    uint32_t r = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + r) >> 16);
}
float st_f16_to_f32(uint16_t h);
uint16_t st_f32_to_f16(float f);

#ifdef __cplusplus
}
#endif

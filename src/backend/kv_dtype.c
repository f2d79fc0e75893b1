/* kv_dtype: the element types of a paged KV pool (backend.h, st_kv_dtype /
 * st_kv_layer): names, sizes and the reference conversions every backend
 * matches bit for bit (the CUDA kernels use cuda_bf16.h / cuda_fp8.h, which
 * round the same way). */
#include <math.h>
#include <string.h>

#include "backend/backend.h"

const char *st_kv_dtype_name(st_kv_dtype t) {
    switch (t) {
    case ST_KV_F32: return "f32";
    case ST_KV_BF16: return "bf16";
    case ST_KV_FP8: return "fp8";
    }
    return "?";
}

bool st_kv_dtype_parse(const char *s, st_kv_dtype *out) {
    static const st_kv_dtype all[] = {ST_KV_F32, ST_KV_BF16, ST_KV_FP8};
    if (!s || !out) return false;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(s, st_kv_dtype_name(all[i])) == 0) {
            *out = all[i];
            return true;
        }
    return false;
}

size_t st_kv_dtype_size(st_kv_dtype t) {
    switch (t) {
    case ST_KV_F32: return 4;
    case ST_KV_BF16: return 2;
    case ST_KV_FP8: return 1;
    }
    return 0;
}

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Round to nearest even on the upper 16 bits; NaN -> the canonical 0x7fff
 * (what cvt.rn.bf16.f32 gives). Infinities stay infinite; values past the
 * largest bf16 round to infinity, as IEEE rounding does. */
/* core's round to nearest even, but every NaN becomes 0x7fff (CUDA's __float2bfloat16_rn) */
uint16_t st_kv_f32_to_bf16(float x) { return x != x ? 0x7fff : st_f32_to_bf16(x); }

float st_kv_bf16_to_f32(uint16_t b) { return st_bf16_to_f32(b); }

/* e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN =
 * S.1111.111; largest finite 448 (S.1111.110), smallest subnormal 2^-9.
 * Round to nearest even; |x| >= 448 after rounding (infinities too)
 * saturates to +-448; NaN -> 0x7f (cvt.rn.satfinite.e4m3x2.f32's results). */
uint8_t st_kv_f32_to_fp8(float x) {
    const uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7f;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7e;
    uint32_t code;
    if (a < 0.015625f) {
        /* subnormal range (below 2^-6): multiples of 2^-9; a * 512 is exact, and
         * rounding it to an integer (ties to even, the default mode) gives the
         * code directly (8 = the smallest normal, 1.0 x 2^-6) */
        code = (uint32_t)nearbyintf(a * 512.0f);
    } else {
        /* normal: keep 3 of the 23 mantissa bits, ties to even; a carry runs
         * into the exponent, as it should */
        const uint32_t ua = f32_bits(a);
        const uint32_t r = (ua + 0x7ffffu + ((ua >> 20) & 1u)) >> 20; /* exponent(8) mantissa(3) */
        code = r - ((127u - 7u) << 3);
        if (code > 0x7eu) code = 0x7e; /* (440, 448) cannot round past 448, kept for safety */
    }
    return sign | (uint8_t)code;
}

float st_kv_fp8_to_f32(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
    float v;
    if (e == 0xf && m == 7) v = NAN;
    else if (e == 0) v = (float)m * 0.001953125f; /* m x 2^-9, exact */
    else v = f32_of(((e + 127u - 7u) << 23) | (m << 20));
    return (b & 0x80) ? -v : v;
}

float st_kv_fp8_row_scale(const float *x, int64_t n) {
    float mx = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        mx = a > mx ? a : mx; /* a NaN compares false: ignored (as fmaxf on CUDA) */
    }
    const float s = mx / 448.0f;
    return s == 0.0f ? 1.0f : s;
}

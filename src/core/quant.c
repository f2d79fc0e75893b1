/* Reference (scalar) conversion of rows between fp32 and every st_dtype.
 *
 * Block layouts (little-endian, ggml's formats; see core/dtype.h):
 *   Q8_0 (32 elems, 34 B): f16 d | int8 q[32]                x[j] = d*q[j]
 *   Q4_0 (32 elems, 18 B): f16 d | u8 qs[16]                 x[j] = d*((qs[j] & 15) - 8),
 *                                                            x[j+16] = d*((qs[j] >> 4) - 8)
 *   Q4_1 (32 elems, 20 B): f16 d | f16 m | u8 qs[16]         x[j] = d*(qs nibble) + m
 *   Q4_K (256 elems, 144 B): f16 d | f16 dmin | u8 sc[12] | u8 qs[128]
 *        8 sub-blocks of 32 elements, each with a 6-bit scale s_i and a 6-bit
 *        min m_i packed in sc[12]: for i < 4: s_i = sc[i] & 63, m_i = sc[i+4] & 63;
 *        else s_i = (sc[i+4] & 15) | ((sc[i-4] >> 6) << 4),
 *             m_i = (sc[i+4] >> 4) | ((sc[i]   >> 6) << 4).
 *        Element e of 64-element chunk c (0..3) reads qs[32c + (e & 31)]: the low
 *        nibble for e < 32 (sub-block 2c), the high nibble for e >= 32 (2c+1).
 *        x = (d*s_i)*q - (dmin*m_i)
 *   Q6_K (256 elems, 210 B): u8 ql[128] | u8 qh[64] | int8 sc[16] | f16 d
 *        Two halves of 128 elements; half h uses ql[64h..], qh[32h..], sc[8h..].
 *        Within a half, element e = 32g + l (g = 0..3, l = 0..31):
 *          low 4 bits  = ql[l + 32(g & 1)] low nibble for g < 2, high for g >= 2
 *          high 2 bits = (qh[l] >> 2g) & 3
 *          q = (low | high << 4) - 32;  x = (d*sc[8h + 2g + l/16]) * q
 * The arithmetic (including which products are rounded to fp32 first) matches
 * gguf-py's numpy dequantizers bit for bit; the quantizers match ggml's
 * reference ones (round half away from zero for Q8_0, truncation after +8.5 /
 * +0.5 for Q4_0 / Q4_1, the scale computed from the fp32 values). */
#include "core/quant.h"

#include <math.h>
#include <string.h>

#include "core/core.h"

/* Bit-exactness against the reference requires that a*b+c is never fused. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

static inline float rd_f16(const uint8_t *p) { return st_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }
static inline void wr_f16(uint8_t *p, float f) {
    uint16_t h = st_f32_to_f16(f);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = rd_f16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
}

static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 15) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void deq_q4_1(const uint8_t *b, float *y) {
    const float d = rd_f16(b), m = rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 15) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static void q4k_scale_min(const uint8_t *sc, int i, int *s, int *m) {
    if (i < 4) {
        *s = sc[i] & 63;
        *m = sc[i + 4] & 63;
    } else {
        *s = (sc[i + 4] & 15) | ((sc[i - 4] >> 6) << 4);
        *m = (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *sc = b + 4, *qs = b + 16;
    for (int c = 0; c < 4; c++) {
        int s0, m0, s1, m1;
        q4k_scale_min(sc, 2 * c, &s0, &m0);
        q4k_scale_min(sc, 2 * c + 1, &s1, &m1);
        const float d0 = d * (float)s0, dm0 = dmin * (float)m0;
        const float d1 = d * (float)s1, dm1 = dmin * (float)m1;
        const uint8_t *q = qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            y[64 * c + l] = d0 * (float)(q[l] & 15) - dm0;
            y[64 * c + 32 + l] = d1 * (float)(q[l] >> 4) - dm1;
        }
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_f16(b + 208);
    for (int h = 0; h < 2; h++) {
        for (int g = 0; g < 4; g++) {
            for (int l = 0; l < 32; l++) {
                int lo = ql[64 * h + l + 32 * (g & 1)];
                lo = g < 2 ? (lo & 15) : (lo >> 4);
                int hi = (qh[32 * h + l] >> (2 * g)) & 3;
                int q = (lo | (hi << 4)) - 32;
                float ds = d * (float)sc[8 * h + 2 * g + l / 16];
                y[128 * h + 32 * g + l] = ds * (float)q;
            }
        }
    }
}

void st_dequantize_row(st_dtype t, const void *x, float *y, int64_t n) {
    const st_dtype_info *info = st_dtype_get(t);
    ST_ASSERT(info != NULL);
    ST_ASSERT(n >= 0 && n % info->block_elems == 0);
    const uint8_t *b = x;
    const int64_t nb = n / info->block_elems;
    switch (t) {
    case ST_DTYPE_F32: memcpy(y, x, (size_t)n * sizeof(float)); return;
    case ST_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) y[i] = rd_f16(b + 2 * i);
        return;
    case ST_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) y[i] = st_bf16_to_f32((uint16_t)(b[2 * i] | (b[2 * i + 1] << 8)));
        return;
    case ST_DTYPE_Q8_0:
        for (int64_t i = 0; i < nb; i++) deq_q8_0(b + 34 * i, y + 32 * i);
        return;
    case ST_DTYPE_Q4_0:
        for (int64_t i = 0; i < nb; i++) deq_q4_0(b + 18 * i, y + 32 * i);
        return;
    case ST_DTYPE_Q4_1:
        for (int64_t i = 0; i < nb; i++) deq_q4_1(b + 20 * i, y + 32 * i);
        return;
    case ST_DTYPE_Q4_K:
        for (int64_t i = 0; i < nb; i++) deq_q4_k(b + 144 * i, y + 256 * i);
        return;
    case ST_DTYPE_Q6_K:
        for (int64_t i = 0; i < nb; i++) deq_q6_k(b + 210 * i, y + 256 * i);
        return;
    case ST_DTYPE_COUNT: break;
    }
    ST_ASSERT(!"unreachable dtype");
}

/* ---- quantization ---- */

/* Conversions that equal C's truncating casts on the values finite inputs
 * produce, and stay defined (no UB) on NaN/inf inputs. */
static inline int to_q8(float r) { /* r = roundf(...) */
    return (r >= -128.0f && r <= 127.0f) ? (int)r : 0;
}
static inline int to_q4(float v) { /* min(15, (int8_t)v) for v in [0, 16.5] */
    if (!(v > 0.0f)) return 0;
    return v >= 15.0f ? 15 : (int)v;
}

static void quant_q8_0(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    wr_f16(b, d);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)to_q8(roundf(x[j] * id));
}

static void quant_q4_0(const float *x, uint8_t *b) {
    float amax = 0.0f, max = 0.0f; /* the value of largest magnitude, sign kept */
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    wr_f16(b, d);
    for (int j = 0; j < 16; j++) {
        int q0 = to_q4(x[j] * id + 8.5f);
        int q1 = to_q4(x[j + 16] * id + 8.5f);
        b[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

static void quant_q4_1(const float *x, uint8_t *b) {
    float min = x[0], max = x[0];
    for (int j = 1; j < 32; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    wr_f16(b, d);
    wr_f16(b + 2, min);
    for (int j = 0; j < 16; j++) {
        int q0 = to_q4((x[j] - min) * id + 0.5f);
        int q1 = to_q4((x[j + 16] - min) * id + 0.5f);
        b[4 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

bool st_quantize_row(st_dtype t, const float *x, void *y, int64_t n) {
    const st_dtype_info *info = st_dtype_get(t);
    ST_ASSERT(info != NULL);
    ST_ASSERT(n >= 0 && n % info->block_elems == 0);
    uint8_t *b = y;
    const int64_t nb = n / info->block_elems;
    switch (t) {
    case ST_DTYPE_F32: memcpy(y, x, (size_t)n * sizeof(float)); return true;
    case ST_DTYPE_F16:
        for (int64_t i = 0; i < n; i++) wr_f16(b + 2 * i, x[i]);
        return true;
    case ST_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = st_f32_to_bf16(x[i]);
            b[2 * i] = (uint8_t)h;
            b[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return true;
    case ST_DTYPE_Q8_0:
        for (int64_t i = 0; i < nb; i++) quant_q8_0(x + 32 * i, b + 34 * i);
        return true;
    case ST_DTYPE_Q4_0:
        for (int64_t i = 0; i < nb; i++) quant_q4_0(x + 32 * i, b + 18 * i);
        return true;
    case ST_DTYPE_Q4_1:
        for (int64_t i = 0; i < nb; i++) quant_q4_1(x + 32 * i, b + 20 * i);
        return true;
    case ST_DTYPE_Q4_K:
    case ST_DTYPE_Q6_K:
    case ST_DTYPE_COUNT: break;
    }
    return false;
}

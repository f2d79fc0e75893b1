/* dtype table and scalar half-precision conversions. */
#include "core/dtype.h"

#include <string.h>
#include <strings.h>

static const st_dtype_info g_info[ST_DTYPE_COUNT] = {
    [ST_DTYPE_F32] = {"f32", 1, 4, false},
    [ST_DTYPE_F16] = {"f16", 1, 2, false},
    [ST_DTYPE_BF16] = {"bf16", 1, 2, false},
    [ST_DTYPE_Q8_0] = {"q8_0", 32, 34, true},
    [ST_DTYPE_Q4_0] = {"q4_0", 32, 18, true},
    [ST_DTYPE_Q4_1] = {"q4_1", 32, 20, true},
    [ST_DTYPE_Q4_K] = {"q4_k", 256, 144, true},
    [ST_DTYPE_Q6_K] = {"q6_k", 256, 210, true},
};

const st_dtype_info *st_dtype_get(st_dtype t) {
    if ((int)t < 0 || t >= ST_DTYPE_COUNT) return NULL;
    return &g_info[t];
}

const char *st_dtype_name(st_dtype t) {
    const st_dtype_info *i = st_dtype_get(t);
    return i ? i->name : "?";
}

size_t st_dtype_row_bytes(st_dtype t, int64_t n) {
    const st_dtype_info *i = st_dtype_get(t);
    if (!i || n < 0 || n % i->block_elems) return 0;
    return (size_t)(n / i->block_elems) * i->block_bytes;
}

bool st_dtype_parse(const char *s, st_dtype *out) {
    for (int t = 0; t < ST_DTYPE_COUNT; t++) {
        if (strcasecmp(s, g_info[t].name) == 0) {
            *out = (st_dtype)t;
            return true;
        }
    }
    return false;
}

float st_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t st_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf (incl. rounding) */
    if (absx < 0x38800000u) { /* subnormal or zero in f16 */
        if (absx < 0x33000000u) return (uint16_t)sign; /* < half of smallest subnormal */
        uint32_t man = (absx & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(absx >> 23); /* 14 + (113 - e) ... */
        /* value = man * 2^(e-150); f16 subnormal unit = 2^-24 -> q = man >> (126 - e) */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = absx + 0xfffu + ((absx >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
}

/* Private to the CPU backend: 8-lane float vectors (GCC/Clang vector
 * extensions, lowered to SSE pairs, AVX or NEON by the compiler) and the
 * reduction helpers every kernel shares.
 *
 * Reduction order (what makes results independent of the thread count, of
 * the token batching and of the instruction set): a dot product of length K
 * accumulates w[k]*x[k] (rounded product, then rounded sum: multiply-adds
 * are never fused) into lane k % 8, in increasing k, the last partial vector
 * zero-padded; the lanes are then summed as ((l0+l4)+(l2+l6)) +
 * ((l1+l5)+(l3+l7)). Every kernel that produces one output element follows
 * exactly this order, so the portable and the AVX2 builds of a kernel give
 * the same bits.
 *
 * The functions are always_inline so that a caller compiled for another
 * target (AVX2) gets them compiled for that target. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) /* GCC and Clang */
/* 32-byte vectors returned from always-inline helpers: no ABI is involved. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF /* GCC's -std=c11 already implies -ffp-contract=off */
#endif

#define ST_AI static inline __attribute__((always_inline))

typedef float st_v8f __attribute__((vector_size(32)));
typedef int32_t st_v8i __attribute__((vector_size(32)));
typedef uint32_t st_v8u __attribute__((vector_size(32)));
typedef uint16_t st_v8u16 __attribute__((vector_size(16)));
typedef uint8_t st_v8u8 __attribute__((vector_size(8)));

ST_AI st_v8f st_v8f_splat(float f) { return (st_v8f){f, f, f, f, f, f, f, f}; }
ST_AI st_v8f st_v8f_load(const float *p) {
    st_v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* Loads m (< 8) floats, zero in the other lanes. */
ST_AI st_v8f st_v8f_load_part(const float *p, int64_t m) {
    st_v8f v = st_v8f_splat(0.0f);
    memcpy(&v, p, (size_t)m * sizeof(float));
    return v;
}
/* Vectors go into helpers by pointer or through macros: 32-byte vector
 * parameters draw GCC's ABI note on non-AVX builds. */
#define ST_V8F_STORE(p, expr)                                                      \
    do {                                                                           \
        const st_v8f v_ = (expr);                                                  \
        memcpy((p), &v_, sizeof v_);                                               \
    } while (0)

ST_AI float st_v8f_hsum(const st_v8f *v) {
    const st_v8f a = *v;
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* dot(a, b) of length K in the documented order. */
ST_AI float st_dot_f32(const float *a, const float *b, int64_t K) {
    st_v8f acc = st_v8f_splat(0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) acc += st_v8f_load(a + k) * st_v8f_load(b + k);
    if (k < K) acc += st_v8f_load_part(a + k, K - k) * st_v8f_load_part(b + k, K - k);
    return st_v8f_hsum(&acc);
}

/* y[0..K) += s * x[0..K) (element-wise, no reduction). */
ST_AI void st_axpy_f32(float *y, float s, const float *x, int64_t K) {
    const st_v8f sv = st_v8f_splat(s);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) ST_V8F_STORE(y + k, st_v8f_load(y + k) + sv * st_v8f_load(x + k));
    for (; k < K; k++) y[k] += s * x[k];
}

/* ---- GGUF block fields ---- */

/* Scalar f16 -> f32, exact: exponent+mantissa shifted into place and rescaled
 * by 2^112 (right for normals and subnormals), inf/NaN and the sign patched. */
ST_AI float st_ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t em = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16, b = em << 13;
    float f;
    memcpy(&f, &b, 4);
    f *= 0x1p112f;
    memcpy(&b, &f, 4);
    if (em >= 0x7c00u) b = (em << 13) | 0x7f800000u;
    b |= sign;
    memcpy(&f, &b, 4);
    return f;
}

/* 8 f16 -> f32 exactly, by the method of st_ld_f16. */
ST_AI st_v8f st_v8f_from_f16(st_v8u16 h16) {
    const st_v8u h = __builtin_convertvector(h16, st_v8u);
    const st_v8u em = h & 0x7fffu;
    const st_v8u sign = (h & 0x8000u) << 16;
    const st_v8f f = (st_v8f)(em << 13) * st_v8f_splat(0x1p112f);
    const st_v8u special = (st_v8u)(em >= 0x7c00u); /* all ones where inf/NaN */
    const st_v8u bits = ((st_v8u)f & ~special) | (((em << 13) | 0x7f800000u) & special);
    return (st_v8f)(bits | sign);
}

/* 8 u16 / the first 8 of 16 u8 widened to u32, the portable forms (the CPU attention's AVX2 build
 * takes intrinsics instead: what GCC makes of these depends on its version, one vpmovzx with GCC 12,
 * a movzwl / vpinsrd per lane with GCC 13). */
ST_AI st_v8u st_v8u_from_u16(st_v8u16 h) { return (st_v8u){h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]}; }
typedef uint8_t st_v16u8 __attribute__((vector_size(16)));
ST_AI st_v8u st_v8u_from_u8(st_v16u8 b) { return (st_v8u){b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]}; }

/* 8 fp8 e4m3 (b: zero-extended to 32 bits) -> f32 exactly, as st_kv_fp8_to_f32 (NaN for S.1111.111),
 * in integer moves and one exact subtraction, no f32 subnormal on the way (Intel cores take a
 * microcode assist per subnormal operand: a multiply by 2^120 of the bits in place ran 2-3x slower
 * there than a table): a normal's exponent e + 120 and mantissa m are f32's bits; a subnormal
 * (e = 0, m x 2^-9) is 2^-6 (1 + m/8) - 2^-6. The sign is put back last. */
ST_AI st_v8f st_v8f_from_e4m3(st_v8u b) {
    const st_v8u em = b & 0x7fu;
    const st_v8u sub = (st_v8u)(em < 8u);    /* all ones where e = 0 */
    const st_v8u nan = (st_v8u)(em == 0x7fu); /* all ones where NaN */
    const st_v8f f = (st_v8f)((em << 20) + ((120u << 23) + (sub & (1u << 23)))) -
                     (st_v8f)(sub & 0x3c800000u); /* 2^-6 where e = 0, else +0 */
    const st_v8u bits = ((st_v8u)f & ~nan) | (0x7fc00000u & nan);
    return (st_v8f)(bits | ((b & 0x80u) << 24));
}

/* Q4_K's 6-bit scale and min of sub-block i (0..7) from its 12 packed bytes. */
ST_AI void st_q4k_sm(const uint8_t *sc, int i, int *s, int *m) {
    if (i < 4) {
        *s = sc[i] & 63;
        *m = sc[i + 4] & 63;
    } else {
        *s = (sc[i + 4] & 15) | ((sc[i - 4] >> 6) << 4);
        *m = (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define ST_CPU_HAVE_AVX2_PATH 1
#define ST_TARGET_AVX2 __attribute__((target("avx2")))
/* the integer matmul's levels (cpu_qi.h, cpu_qi_<level>.c) */
#define ST_TARGET_AVX2_F16C __attribute__((target("avx2,f16c")))
#define ST_TARGET_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define ST_TARGET_AVXVNNI __attribute__((target("avx2,f16c,avxvnni")))
#else
#define ST_CPU_HAVE_AVX2_PATH 0
#endif

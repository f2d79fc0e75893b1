/* CPU matmul of the quantized dtypes (q4_0, q4_1, q8_0, q4_K, q6_K) with
 * integer dot products: y[n, N] = x[n, K] @ w[N, K]^T.
 *
 * Two activation precisions (st_cpu.act8, from st_backend_params.cpu_act;
 * `strata --cpu-act precise|int8`): precise (default), QMAX = 2^22 - 1,
 * and int8, QMAX = 127 (q8-style, as llama.cpp's). Both follow the
 * arithmetic below; only QMAX and the way the integer sums are formed differ.
 *
 * Arithmetic (the same bits at every ISA level, n and thread count):
 *
 * 1. Activations, once per call: each token's row is cut into 32-element
 *    blocks b; amax = max |x| over the block, dx_b = amax / QMAX (one float
 *    division, round to nearest even), a = x / dx_b rounded to the nearest
 *    integer, ties to even, clamped to [-QMAX, QMAX]; sx_b = dx_b *
 *    (float)sum(a). Precise: QMAX = 2^22 - 1, for q8_0 2^19 - 1 (so that
 *    every sum below fits int32); int8: 127. A block whose dx_b is 0 (zeros,
 *    or underflow) gets a = 0, dx_b = 0; one holding inf or NaN gets a = 0,
 *    dx_b = NaN.
 * 2. Weights are read as units of 32 integers w with a float scale dw and,
 *    for the dtypes with mins, a float mw; the dequantized weight is
 *    dw * w + mw, as core/quant.c computes it:
 *      q8_0  unit = block,      w = q,       dw = d
 *      q4_0  unit = block,      w = q - 8,   dw = d
 *      q4_1  unit = block,      w = q,       dw = d,        mw = m
 *      q4_K  unit = sub-block,  w = q,       dw = d * s_j,  mw = -(dmin * m_j)
 *      q6_K  unit = 16-group,   w = q - 32 in the group's half of its
 *            32-block and 0 in the other half,  dw = d * sc_g
 *    (two q6_K units per activation block, one per scale).
 * 3. Per output (token, row) and unit u over activation block b:
 *      S_u = sum of w * a over the unit's 32 elements, exact in int32
 *            (|S_u| <= 32 * 15 * (2^22 - 1) < 2^31; q8_0: 32 * 128 * (2^19 - 1))
 *      f_u = (dw_u * dx_b) * (float)S_u  [ + mw_u * sx_b ]
 *      acc[u % 8] += f_u, in increasing u, each acc starting at +0
 *      y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
 *    with no fused multiply-adds. The integer sums are exact however a level
 *    forms them and every float operation is element-wise over outputs, so
 *    the levels need only agree on the integers.
 *
 * The integers, precise: a is kept as two int16 planes, hi = a >> 8 and lo
 * = a & 255, and S_u = 256 * sum(w * hi) + sum(w * lo): four 16-element pair
 * products (vpmaddwd on AVX2, vpdpwssd on AVX-512 VNNI) per unit where int16
 * activations (QMAX 32767) would take two.
 *
 * The integers, int8: a is one int8 per element (per token: the K bytes,
 * then dx, sx, and the sums of a over each 16-element half of each block).
 * The weights go in as unsigned bytes, w + o: q4_0 the nibbles (o = 8), q6_K
 * the 6-bit values (o = 32; a unit's 16 in its half of the block, zeros in
 * the other), q4_1 and q4_K the nibbles (o = 0); S_u = sum((w + o) * a) -
 * o * sum(a over the unit). u8 x s8 products: vpdpbusd (AVX-512 VNNI, and
 * the VEX encoding of AVX-VNNI) or vpmaddubsw + vpmaddwd (AVX2): one
 * instruction per 32 weights and row. q8_0's signed bytes by the sign trick,
 * |w| x (a * sign(w)) (|w| <= 128, |a| <= 127: vpmaddubsw's pair sums stay
 * under 2^15), except in the AVX-512 token-group kernel, which takes them
 * as w + 128 (o = 128). Portable C forms the same sums in int32 lanes.
 *
 * Precision: y is the product of the dequantized weights with the
 * activations rounded to QMAX steps of their block's max, up to the float
 * rounding of the combination. Max |y - f32 dequantized product| / max |y|
 * on realistic shapes (K = 576 and 1536, N up to 49152, Gaussian activations
 * with 20x outlier channels): precise 4.8e-7 (q8_0: 3.3e-6);
 * tests/test_backend_cpu.c measures up to 2.3e-6 (q8_0: 8.7e-6) on small
 * shapes. int8: 0.8e-2 to 2.3e-2 there (N >= 13; up to 7.8e-2 for a single
 * output row, which can nearly cancel), far above the 1e-4 that the CPU's
 * logits checks against HF allow: hence an option, not the default. (int16
 * activations would give 6e-5, 2e-4 on the default model's logits.)
 *
 * Work (both precisions): an item is (token tile, 8 weight rows). One token reads its units
 * straight from the weights, prefetching the next row block as one stream;
 * the 8 rows' partial sums of a unit go through a reduction tree (vphaddd)
 * into one vector of 8 totals, so the float combination runs 8 rows wide.
 * Longer tiles unpack their 8 rows once into the thread's scratch (int16
 * units; scales laid out [unit][row]) and run every token over them: on
 * AVX-512 by groups of 8 tokens in the lanes (each weight pair broadcast
 * against the 8 tokens' activation pairs; no tree), elsewhere one token at a
 * time through the tree. int8 unpacks to bytes (q8_0 as w + 128 for the
 * group kernel), and its group kernel broadcasts each row's weight quad
 * against the 8 tokens' activation quads (vpdpbusd). The int8 path reads
 * the 8 rows' scales by 8 scalar loads (vpgatherdd cost more). Passes of
 * 2..8 tokens (QI_STREAM: a speculative verification pass) skip the
 * unpacking: each unit of the 8 rows is read from the weights once and
 * multiplied against every token (dot_tokens, dot_tokens8), so the weights
 * stream as for one token, in one tile whatever K (precise: 2..8 tokens at every
 * level, the AVX-512 group kernel only past 8 (it unpacks and lays the activations
 * out in groups: a pass of 8 tokens of the default model took 52-66 ms with it, 33
 * without, on the 2-core EPYC); int8: 2..4 tokens where a group kernel takes the
 * longer tiles); on
 * AVX-512, 2..8 tokens (st_cpu.w16_min..8) go instead to W16 (dot16_tokens:
 * items of 16 rows, lanes = rows, no reduction tree; see there). Where
 * AMX-INT8 is usable (st_cpu.amx), int8's token groups sum on tiles instead
 * (dot_group8_amx: A = 8 unpacked rows x 32 bytes, B = the group's activation
 * block as laid out, C = 8 rows x 8 tokens int32), with token tiles of up to
 * A8_AMX_TILE_BYTES of activations. One token's
 * rows are split over the threads as whole 8-row blocks (guided chunks of
 * contiguous blocks, at least ~64K multiply-adds each): each thread streams
 * its own contiguous stretch of the weights (8 rows, software prefetch of
 * the next 8 rows spread over the units) and writes disjoint outputs.
 *
 * Layout: this header holds the arithmetic as always-inline templates over an
 * ISA table; cpu_qi_<level>.c instantiate them, one pool function per level
 * and activation precision; cpu_matmul_int.c lays out the activations and
 * picks the level (st_cpu.isa, st_cpu.amx) at run time. */
#ifndef STRATA_CPU_QI_H
#define STRATA_CPU_QI_H

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif


#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"

#if ST_CPU_HAVE_AVX2_PATH
#include <immintrin.h>
#endif

#define QI_ROWS 8              /* weight rows per work item (the lanes of a sum vector) */
#define QI_QMAX 4194303.0f     /* activation integers in [-QI_QMAX, QI_QMAX]: 2^22 - 1 */
#define QI_QMAX_Q8 524287.0f   /* q8_0's: 2^19 - 1, so that 32 * 128 * QMAX < 2^31 */
#define QI_TILE_BYTES 131072   /* quantized activation bytes per token tile */
#define QI_TILE_MAX 64
/* int8 on AMX: token tiles up to 1 MiB of activations (L2), so that each 8-row block is
 * unpacked once per ~170 tokens of K = 4096, not per ~21 (the tile sums cost less than the
 * unpacking there) */
#define A8_AMX_TILE_BYTES 1048576
#define A8_AMX_TILE_MAX 256

typedef int16_t st_v16i16 __attribute__((vector_size(32)));
typedef int32_t st_v16i32 __attribute__((vector_size(64)));
typedef uint8_t st_v16u8 __attribute__((vector_size(16)));
typedef int8_t st_v16i8 __attribute__((vector_size(16)));
typedef int16_t st_v8i16 __attribute__((vector_size(16)));

ST_AI st_v16i16 ld16(const int16_t *p) {
    st_v16i16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---- activations ---- */

/* Per token: for each block, hi[32] then lo[32] int16 (a = 256 * hi + lo,
 * lo in [0, 255]), then dx[nb], sx[nb] floats (nb = K / 32). */
typedef struct {
    int64_t K, nb;
    size_t stride; /* bytes per token */
} qact_layout;

ST_AI st_v8f v8f_max(st_v8f a, st_v8f b) {
    const st_v8i gt = (st_v8i)(a > b);
    return (st_v8f)(((st_v8i)a & gt) | ((st_v8i)b & ~gt));
}
ST_AI st_v8f v8f_min(st_v8f a, st_v8f b) {
    const st_v8i lt = (st_v8i)(a < b);
    return (st_v8f)(((st_v8i)a & lt) | ((st_v8i)b & ~lt));
}

ST_AI void quant_block(const float *x, float qmax, int16_t *a, float *dx, float *sx) {
    st_v8f v[4], amax = st_v8f_splat(0.0f);
    st_v8i bad = {0};
    for (int i = 0; i < 4; i++) {
        v[i] = st_v8f_load(x + 8 * i);
        const st_v8f ab = (st_v8f)((st_v8u)v[i] & 0x7fffffffu);
        bad |= (st_v8i)(v[i] * 0.0f != 0.0f); /* inf or NaN */
        amax = v8f_max(amax, ab);
    }
    float m = 0.0f;
    int any_bad = 0;
    for (int l = 0; l < 8; l++) {
        m = amax[l] > m ? amax[l] : m;
        any_bad |= bad[l];
    }
    const float d = any_bad ? __builtin_nanf("") : m / qmax;
    if (any_bad || !(d > 0.0f)) {
        memset(a, 0, 64 * sizeof *a);
        *dx = d;
        *sx = 0.0f;
        return;
    }
    const st_v8f dv = st_v8f_splat(d), magic = st_v8f_splat(0x1.8p23f);
    const st_v8f hi = st_v8f_splat(qmax), lo = st_v8f_splat(-qmax);
    st_v8i sum = {0};
    for (int i = 0; i < 4; i++) {
        st_v8f f = (v[i] / dv + magic) - magic; /* round to nearest even (|f| < 2^22 or inf) */
        f = v8f_min(v8f_max(f, lo), hi);
        const st_v8i q = __builtin_convertvector(f, st_v8i);
        sum += q;
        const st_v8i16 h = __builtin_convertvector(q >> 8, st_v8i16); /* arithmetic: floor(q / 256) */
        const st_v8i16 r = __builtin_convertvector(q & 255, st_v8i16);
        memcpy(a + 8 * i, &h, sizeof h);
        memcpy(a + 32 + 8 * i, &r, sizeof r);
    }
    int32_t s = 0;
    for (int l = 0; l < 8; l++) s += sum[l];
    *dx = d;
    *sx = d * (float)s;
}

/* The token-group layout (AVX-512 level, n > 1), lanes = 8 tokens: group g
 * of tokens 8g..8g+7 holds, per block b and element pair j (elements 2j,
 * 2j+1), the hi pairs of the 8 tokens then their lo pairs (32 int16), then
 * dx[nb][8] and sx[nb][8]; tokens past n are zeros. */
#define QI_GROUP 8
ST_AI size_t group_stride(int64_t nb) { return (size_t)nb * (512 * sizeof(int16_t) + 2 * QI_GROUP * sizeof(float)); }

typedef struct {
    const float *x;
    uint8_t *q;     /* per-token layout */
    uint8_t *grp;   /* token-group layout, or NULL */
    qact_layout L;
    float qmax;
} qa_ctx;

ST_AI void quant_rows(const qa_ctx *c, int64_t begin, int64_t end) {
    const int64_t nb = c->L.nb;
    for (int64_t t = begin; t < end; t++) {
        uint8_t *base = c->q + (size_t)t * c->L.stride;
        int16_t *a = (int16_t *)base;
        float *dx = (float *)(base + 2 * (size_t)c->L.K * sizeof(int16_t)), *sx = dx + nb;
        for (int64_t b = 0; b < nb; b++)
            quant_block(c->x + t * c->L.K + 32 * b, c->qmax, a + 64 * b, dx + b, sx + b);
        if (!c->grp) continue;
        uint8_t *g = c->grp + (size_t)(t / QI_GROUP) * group_stride(nb);
        const int lane = (int)(t % QI_GROUP);
        int16_t *ga = (int16_t *)g;
        float *gdx = (float *)(g + (size_t)nb * 512 * sizeof(int16_t)), *gsx = gdx + QI_GROUP * nb;
        for (int64_t b = 0; b < nb; b++) {
            for (int j = 0; j < 16; j++) /* one 32-bit pair per plane */
                for (int pl = 0; pl < 2; pl++)
                    memcpy(ga + 512 * b + 32 * j + 16 * pl + 2 * lane, a + 64 * b + 32 * pl + 2 * j, 4);
            gdx[QI_GROUP * b + lane] = dx[b];
            gsx[QI_GROUP * b + lane] = sx[b];
        }
    }
}

/* ---- per-level primitives ----
 * widen, widen_s8: 16 bytes -> 16 int16, zero- or sign-extended; gather: the 32-bit words at
 * base + idx[r] + off; f16: the low 16 bits of each lane, f16 -> f32 exactly;
 * prow: one row's partial sums of w * a over a unit (lanes of any partition:
 * the sums are exact); tree: the 8 rows' partials -> their totals (lane r). */

typedef struct {
    st_v16i16 hi[2], lo[2];
} qa_unit;

typedef struct {
    st_v16i16 (*widen)(const uint8_t *p);
    st_v16i16 (*widen_s8)(const uint8_t *p);
    st_v8i (*gather)(const uint8_t *base, st_v8i idx, int64_t off);
    st_v8f (*f16)(st_v8i h);
    st_v8i (*prow)(const st_v16i16 w[2], const qa_unit *a);
    st_v8i (*tree)(const st_v8i p[QI_ROWS]);
    /* the AVX-512 level's token-group kernel (NULL elsewhere): ctx is a
     * qi_ctx, block a qblock */
    void (*group)(const void *ctx, st_dtype t, const void *block, const uint8_t *grp, float out[QI_ROWS][8]);
} qi_isa;

ST_AI st_v16i16 widen_portable(const uint8_t *p) {
    st_v16u8 q;
    memcpy(&q, p, 16);
    return __builtin_convertvector(q, st_v16i16);
}

ST_AI st_v16i16 widen_s8_portable(const uint8_t *p) {
    st_v16i8 q;
    memcpy(&q, p, 16);
    return __builtin_convertvector(q, st_v16i16);
}

ST_AI st_v8i gather_portable(const uint8_t *base, st_v8i idx, int64_t off) {
    st_v8i v;
    for (int r = 0; r < QI_ROWS; r++) memcpy((int32_t *)&v + r, base + idx[r] + off, 4);
    return v;
}

ST_AI st_v8f f16_portable(st_v8i h) { return st_v8f_from_f16(__builtin_convertvector(h & 0xffff, st_v8u16)); }

ST_AI st_v8i prow_portable(const st_v16i16 w[2], const qa_unit *a) {
    st_v16i32 hi = {0}, lo = {0};
    for (int h = 0; h < 2; h++) {
        const st_v16i32 wv = __builtin_convertvector(w[h], st_v16i32);
        hi += wv * __builtin_convertvector(a->hi[h], st_v16i32);
        lo += wv * __builtin_convertvector(a->lo[h], st_v16i32);
    }
    const st_v16i32 t = (hi << 8) + lo;
    st_v8i p;
    for (int l = 0; l < 8; l++) p[l] = t[l] + t[l + 8];
    return p;
}

ST_AI st_v8i tree_portable(const st_v8i p[QI_ROWS]) {
    st_v8i s;
    for (int r = 0; r < QI_ROWS; r++) {
        int32_t t = 0;
        for (int l = 0; l < 8; l++) t += p[r][l];
        s[r] = t;
    }
    return s;
}

#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2_F16C ST_AI st_v16i16 widen_avx2(const uint8_t *p) {
    return (st_v16i16)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}

ST_TARGET_AVX2_F16C ST_AI st_v16i16 widen_s8_avx2(const uint8_t *p) {
    return (st_v16i16)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

ST_TARGET_AVX2_F16C ST_AI st_v8i gather_avx2(const uint8_t *base, st_v8i idx, int64_t off) {
    return (st_v8i)_mm256_i32gather_epi32((const int *)(base + off), (__m256i)idx, 1);
}

ST_TARGET_AVX2_F16C ST_AI st_v8f f16_avx2(st_v8i h) {
    const __m256i lo16 = _mm256_shuffle_epi8((__m256i)h, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                           0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i packed = _mm256_permute4x64_epi64(lo16, 0x08); /* qwords 0, 2 */
    return (st_v8f)_mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

ST_TARGET_AVX512 ST_AI st_v8f f16_avx512(st_v8i h) {
    return (st_v8f)_mm256_cvtph_ps(_mm256_cvtepi32_epi16((__m256i)h));
}

ST_TARGET_AVX2_F16C ST_AI st_v8i prow_avx2(const st_v16i16 w[2], const qa_unit *a) {
    const __m256i w0 = (__m256i)w[0], w1 = (__m256i)w[1];
    const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(w0, (__m256i)a->hi[0]), _mm256_madd_epi16(w1, (__m256i)a->hi[1]));
    const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(w0, (__m256i)a->lo[0]), _mm256_madd_epi16(w1, (__m256i)a->lo[1]));
    return (st_v8i)_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo);
}

ST_TARGET_AVX512 ST_AI st_v8i prow_vnni(const st_v16i16 w[2], const qa_unit *a) {
    const __m256i w0 = (__m256i)w[0], w1 = (__m256i)w[1];
    __m256i hi = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w0, (__m256i)a->hi[0]);
    hi = _mm256_dpwssd_epi32(hi, w1, (__m256i)a->hi[1]);
    const __m256i lo = _mm256_dpwssd_epi32(_mm256_slli_epi32(hi, 8), w0, (__m256i)a->lo[0]);
    return (st_v8i)_mm256_dpwssd_epi32(lo, w1, (__m256i)a->lo[1]);
}

ST_TARGET_AVX2_F16C ST_AI st_v8i tree_avx2(const st_v8i p[QI_ROWS]) {
    const __m256i h01 = _mm256_hadd_epi32((__m256i)p[0], (__m256i)p[1]);
    const __m256i h23 = _mm256_hadd_epi32((__m256i)p[2], (__m256i)p[3]);
    const __m256i h45 = _mm256_hadd_epi32((__m256i)p[4], (__m256i)p[5]);
    const __m256i h67 = _mm256_hadd_epi32((__m256i)p[6], (__m256i)p[7]);
    const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    return (st_v8i)_mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                                    _mm256_permute2x128_si256(h0123, h4567, 0x31));
}
#endif

/* ---- weight units ---- */

/* The 32 integers of unit u of a row, elements 0..15 in w[0], 16..31 in w[1]. */
ST_AI void load_unit(st_dtype t, const uint8_t *row, int64_t u, st_v16i16 w[2], qi_isa I) {
    switch (t) {
    case ST_DTYPE_Q8_0:
        w[0] = I.widen_s8(row + 34 * u + 2), w[1] = I.widen_s8(row + 34 * u + 18);
        return;
    case ST_DTYPE_Q4_0: {
        const st_v16i16 v = I.widen(row + 18 * u + 2);
        w[0] = (v & 15) - 8, w[1] = (v >> 4) - 8;
        return;
    }
    case ST_DTYPE_Q4_1: {
        const st_v16i16 v = I.widen(row + 20 * u + 4);
        w[0] = v & 15, w[1] = v >> 4;
        return;
    }
    case ST_DTYPE_Q4_K: {
        const uint8_t *qs = row + 144 * (u >> 3) + 16 + 32 * ((u & 7) >> 1);
        const st_v16i16 v0 = I.widen(qs), v1 = I.widen(qs + 16);
        if (u & 1)
            w[0] = v0 >> 4, w[1] = v1 >> 4;
        else
            w[0] = v0 & 15, w[1] = v1 & 15;
        return;
    }
    case ST_DTYPE_Q6_K: {
        const uint8_t *sb = row + 210 * (u >> 4);
        const int g16 = (int)(u & 15), h = g16 >> 3, g = (g16 >> 1) & 3, hf = g16 & 1;
        const st_v16i16 lv = I.widen(sb + 64 * h + 32 * (g & 1) + 16 * hf);
        const st_v16i16 hv = I.widen(sb + 128 + 32 * h + 16 * hf);
        const st_v16i16 lo = g < 2 ? (lv & 15) : (lv >> 4);
        const st_v16i16 v = (lo | (((hv >> (2 * g)) & 3) << 4)) - 32, z = {0};
        w[hf] = v, w[1 - hf] = z;
        return;
    }
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
}

/* dw and mw of unit u for the 8 rows at base + (*idxp)[r] (mw only for the
 * dtypes with mins). Every f16 is read as the low or high half of a 32-bit
 * word inside its block. No vector passes by value in or out: an ISA-targeted
 * caller (dot16_tokens) may call it, which clang allows only so. */
ST_AI void load_scales(st_dtype t, const uint8_t *base, const st_v8i *idxp, int64_t u, st_v8f *dw, st_v8f *mw, qi_isa I) {
    const st_v8i idx = *idxp;
    switch (t) {
    case ST_DTYPE_Q8_0: *dw = I.f16(I.gather(base, idx, 34 * u)); return;
    case ST_DTYPE_Q4_0: *dw = I.f16(I.gather(base, idx, 18 * u)); return;
    case ST_DTYPE_Q4_1: {
        const st_v8i g = I.gather(base, idx, 20 * u);
        *dw = I.f16(g);
        *mw = I.f16(g >> 16);
        return;
    }
    case ST_DTYPE_Q4_K: {
        const int64_t sb = 144 * (u >> 3);
        const st_v8i g = I.gather(base, idx, sb);
        st_v8f s, mn;
        for (int r = 0; r < QI_ROWS; r++) {
            int si, mi;
            st_q4k_sm(base + idx[r] + sb + 4, (int)(u & 7), &si, &mi);
            s[r] = (float)si, mn[r] = (float)mi;
        }
        *dw = I.f16(g) * s;
        *mw = -(I.f16(g >> 16) * mn);
        return;
    }
    case ST_DTYPE_Q6_K: {
        const int64_t sb = 210 * (u >> 4);
        st_v8f sc;
        for (int r = 0; r < QI_ROWS; r++) sc[r] = (float)(int8_t)base[idx[r] + sb + 192 + (u & 15)];
        *dw = I.f16(I.gather(base, idx, sb + 206) >> 16) * sc;
        return;
    }
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
}

/* ---- work items ---- */

#define QI_MULTI 4 /* weights per call at most (matmul_multi) */

typedef struct {
    int nw;                   /* weights sharing x (same dtype and cols) */
    const uint8_t *w[QI_MULTI]; /* [N] rows of row_bytes each */
    float *ys[QI_MULTI];      /* their outputs [n, N] */
    int64_t Ns[QI_MULTI];
    int64_t rb0[QI_MULTI + 1]; /* first row block of each weight, then the total */
    st_dtype dtype;
    size_t row_bytes;
    const uint8_t *q;   /* quantized activations, per-token layout */
    const uint8_t *grp; /* and token-group layout, or NULL */
    qact_layout L;
    int64_t n;
    int64_t nu;    /* units per row */
    int64_t tile;  /* tokens per tile */
    int64_t n_rb;  /* row blocks */
    float *const *scratch;
    const int32_t *corr; /* W16: [n][nb] -off * sum(a) of each token's block (the unsigned weights' offset) */
} qi_ctx;

/* A row block's units: read from the weights (rows base + idx[r]) or
 * unpacked in scratch: wsc[QI_ROWS][32 * nu] int16, dsc/msc[nu][QI_ROWS]. */
typedef struct {
    const uint8_t *base;
    st_v8i idx;
    int16_t *wsc;
    float *dsc, *msc;
} qblock;

ST_AI bool has_mins(st_dtype t) { return t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K; }

/* A few tokens (2..QI_STREAM: a speculative verification pass) go straight from the weights,
 * each unit of 8 rows read once for all of them (dot_tokens, dot_tokens8) ... */
#define QI_STREAM 8
/* ... and up to this many where a token-group kernel exists (AVX-512, AMX): on the Xeon (16
 * threads) 2..4 tokens streamed beat the groups, 8 did not (bench/RESULTS.md, seventh session) */
#define QI_STREAM_GROUPED 4

/* The 8 rows' outputs for one token, in the documented order. */
ST_AI void dot_token(const qi_ctx *m, st_dtype t, const qblock *B, bool unpacked, const uint8_t *qa,
                     float out[QI_ROWS], qi_isa I) {
    const int ushift = t == ST_DTYPE_Q6_K ? 1 : 0;
    const int16_t *a = (const int16_t *)qa;
    const float *dx = (const float *)(qa + 2 * (size_t)m->L.K * sizeof(int16_t)), *sx = dx + m->L.nb;
    st_v8f acc[8];
    for (int l = 0; l < 8; l++) acc[l] = st_v8f_splat(0.0f);
    for (int64_t u0 = 0; u0 < m->nu; u0 += 8)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) { /* unit u0 + j into acc[j]: a register */
        const int64_t u = u0 + j;
        if (u >= m->nu) break;
        const int64_t b = u >> ushift;
        const qa_unit A = {{ld16(a + 64 * b), ld16(a + 64 * b + 16)}, {ld16(a + 64 * b + 32), ld16(a + 64 * b + 48)}};
        st_v8i p[QI_ROWS];
        for (int r = 0; r < QI_ROWS; r++) {
            st_v16i16 w[2];
            if (unpacked) {
                const int16_t *ws = B->wsc + (size_t)r * 32 * m->nu + 32 * u;
                w[0] = ld16(ws), w[1] = ld16(ws + 16);
            } else {
                const uint8_t *row = B->base + B->idx[r];
                load_unit(t, row, u, w, I);
            }
            p[r] = I.prow(w, &A);
        }
        if (!unpacked) { /* the next row block, a unit's share of it per unit: one stream ahead */
            const int64_t span = QI_ROWS * (int64_t)m->row_bytes;
            for (int64_t o = span * u / m->nu; o < span * (u + 1) / m->nu; o += 64) __builtin_prefetch(B->base + span + o);
        }
        const st_v8i s = I.tree(p);
        st_v8f dw, mw = st_v8f_splat(0.0f);
        if (unpacked) {
            dw = st_v8f_load(B->dsc + QI_ROWS * u);
            if (has_mins(t)) mw = st_v8f_load(B->msc + QI_ROWS * u);
        } else {
            load_scales(t, B->base, &B->idx, u, &dw, &mw, I);
        }
        st_v8f f = (dw * dx[b]) * __builtin_convertvector(s, st_v8f); /* vector * scalar: lane-wise */
        if (has_mins(t)) f = f + mw * sx[b];
        acc[j] += f;
    }
    const st_v8f y = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    memcpy(out, &y, sizeof y);
}

/* 2..QI_STREAM tokens (one tile) x the 8 rows, straight from the weights: each unit of the 8
 * rows is read and widened once, then every token's sums go through the tree and the
 * documented combination (the bits of dot_token, token by token). */
ST_AI void dot_tokens(const qi_ctx *m, st_dtype t, const qblock *B, const uint8_t *qa0, int nt,
                      float out[QI_STREAM][QI_ROWS], qi_isa I) {
    const int ushift = t == ST_DTYPE_Q6_K ? 1 : 0;
    const size_t stride = m->L.stride;
    const int64_t span = QI_ROWS * (int64_t)m->row_bytes;
    const uint64_t pf_q16 = ((uint64_t)span << 16) / (uint64_t)m->nu;
    int64_t pf = 0;
    st_v8f acc[QI_STREAM][8];
    for (int tk = 0; tk < nt; tk++)
        for (int l = 0; l < 8; l++) acc[tk][l] = st_v8f_splat(0.0f);
    for (int64_t u = 0; u < m->nu; u++) {
        const int64_t b = u >> ushift;
        st_v16i16 w[QI_ROWS][2];
        for (int r = 0; r < QI_ROWS; r++) load_unit(t, B->base + B->idx[r], u, w[r], I);
        const int64_t pf_end = (int64_t)(((uint64_t)(u + 1) * pf_q16) >> 16); /* the next row block */
        for (; pf < pf_end; pf += 64) __builtin_prefetch(B->base + span + pf);
        st_v8f dw, mw = st_v8f_splat(0.0f);
        load_scales(t, B->base, &B->idx, u, &dw, &mw, I);
        for (int tk = 0; tk < nt; tk++) {
            const uint8_t *qa = qa0 + (size_t)tk * stride;
            const int16_t *a = (const int16_t *)qa;
            const float *dx = (const float *)(qa + 2 * (size_t)m->L.K * sizeof(int16_t)), *sx = dx + m->L.nb;
            const qa_unit A = {{ld16(a + 64 * b), ld16(a + 64 * b + 16)}, {ld16(a + 64 * b + 32), ld16(a + 64 * b + 48)}};
            st_v8i p[QI_ROWS];
            for (int r = 0; r < QI_ROWS; r++) p[r] = I.prow(w[r], &A);
            const st_v8i s = I.tree(p);
            st_v8f f = (dw * dx[b]) * __builtin_convertvector(s, st_v8f);
            if (has_mins(t)) f = f + mw * sx[b];
            acc[tk][u & 7] += f;
        }
    }
    for (int tk = 0; tk < nt; tk++) {
        const st_v8f *c = acc[tk];
        const st_v8f y = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
        memcpy(out[tk], &y, sizeof y);
    }
}

ST_AI void qi_items_t(const qi_ctx *m, st_dtype t, int64_t begin, int64_t end, int ti, qi_isa I) {
    float *buf = m->scratch[ti];
    qblock B = {.wsc = (int16_t *)buf, .dsc = buf + 16 * QI_ROWS * m->nu};
    B.msc = B.dsc + QI_ROWS * m->nu;
    for (int64_t it = begin; it < end; it++) {
        const int64_t tile = it / m->n_rb, rbg = it % m->n_rb;
        int wi = 0;
        while (rbg >= m->rb0[wi + 1]) wi++;
        const int64_t N = m->Ns[wi], r0 = (rbg - m->rb0[wi]) * QI_ROWS;
        float *y = m->ys[wi];
        const int64_t nr = N - r0 < QI_ROWS ? N - r0 : QI_ROWS;
        /* padding rows repeat row r0; their outputs are dropped */
        B.base = m->w[wi] + (size_t)r0 * m->row_bytes;
        for (int r = 0; r < QI_ROWS; r++) B.idx[r] = (int32_t)((r < nr ? r : 0) * (int64_t)m->row_bytes);
        const int64_t t0 = tile * m->tile;
        const int64_t t1 = t0 + m->tile < m->n ? t0 + m->tile : m->n;
        float out[QI_ROWS];
        if (t1 - t0 == 1) { /* one token: straight from the weights */
            dot_token(m, t, &B, false, m->q + (size_t)t0 * m->L.stride, out, I);
            memcpy(y + t0 * N + r0, out, (size_t)nr * sizeof(float));
            continue;
        }
        for (int64_t u = 0; u < m->nu; u++) { /* unpack once per item */
            for (int r = 0; r < QI_ROWS; r++) {
                st_v16i16 w[2];
                load_unit(t, B.base + B.idx[r], u, w, I);
                memcpy(B.wsc + (size_t)r * 32 * m->nu + 32 * u, w, sizeof w);
            }
            st_v8f dw, mw = st_v8f_splat(0.0f);
            load_scales(t, B.base, &B.idx, u, &dw, &mw, I);
            memcpy(B.dsc + QI_ROWS * u, &dw, sizeof dw);
            memcpy(B.msc + QI_ROWS * u, &mw, sizeof mw);
        }
        if (I.group && m->grp) {
            for (int64_t g0 = t0; g0 < t1; g0 += QI_GROUP) {
                float og[QI_ROWS][QI_GROUP];
                I.group(m, t, &B, m->grp + (size_t)(g0 / QI_GROUP) * group_stride(m->L.nb), og);
                for (int64_t tk = g0; tk < t1 && tk < g0 + QI_GROUP; tk++)
                    for (int r = 0; r < nr; r++) y[tk * N + r0 + r] = og[r][tk - g0];
            }
            continue;
        }
        for (int64_t tk = t0; tk < t1; tk++) {
            dot_token(m, t, &B, true, m->q + (size_t)tk * m->L.stride, out, I);
            memcpy(y + tk * N + r0, out, (size_t)nr * sizeof(float));
        }
    }
}

/* Items [begin, end) of a call whose one tile holds 2..QI_STREAM tokens (dot_tokens). A loop of
 * its own: inside qi_items_t's, it made GCC's code for one token ~20% slower. */
ST_AI void qi_tokens_t(const qi_ctx *m, st_dtype t, int64_t begin, int64_t end, qi_isa I) {
    qblock B = {0};
    for (int64_t it = begin; it < end; it++) {
        int wi = 0;
        while (it >= m->rb0[wi + 1]) wi++;
        const int64_t N = m->Ns[wi], r0 = (it - m->rb0[wi]) * QI_ROWS;
        float *y = m->ys[wi];
        const int64_t nr = N - r0 < QI_ROWS ? N - r0 : QI_ROWS;
        B.base = m->w[wi] + (size_t)r0 * m->row_bytes;
        for (int r = 0; r < QI_ROWS; r++) B.idx[r] = (int32_t)((r < nr ? r : 0) * (int64_t)m->row_bytes);
        float os[QI_STREAM][QI_ROWS];
        dot_tokens(m, t, &B, m->q, (int)m->n, os, I);
        for (int64_t tk = 0; tk < m->n; tk++) memcpy(y + tk * N + r0, os[tk], (size_t)nr * sizeof(float));
    }
}

/* A call's items of dtype t: a few tokens in one tile (one read of the weights), or not. */
ST_AI void qi_items_dt(const qi_ctx *m, st_dtype t, int64_t begin, int64_t end, int ti, qi_isa I) {
    if (m->n > 1 && m->n <= QI_STREAM && m->tile == m->n && !m->grp)
        qi_tokens_t(m, t, begin, end, I);
    else
        qi_items_t(m, t, begin, end, ti, I);
}

/* One copy per dtype, so that the unit and scale loaders inline their case. */
ST_AI void qi_items(const qi_ctx *m, int64_t begin, int64_t end, int ti, qi_isa I) {
    switch (m->dtype) {
    case ST_DTYPE_Q8_0: qi_items_dt(m, ST_DTYPE_Q8_0, begin, end, ti, I); return;
    case ST_DTYPE_Q4_0: qi_items_dt(m, ST_DTYPE_Q4_0, begin, end, ti, I); return;
    case ST_DTYPE_Q4_1: qi_items_dt(m, ST_DTYPE_Q4_1, begin, end, ti, I); return;
    case ST_DTYPE_Q4_K: qi_items_dt(m, ST_DTYPE_Q4_K, begin, end, ti, I); return;
    case ST_DTYPE_Q6_K: qi_items_dt(m, ST_DTYPE_Q6_K, begin, end, ti, I); return;
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
}

#if ST_CPU_HAVE_AVX2_PATH
/* Tokens of a group x the 8 unpacked rows of B (AVX-512 level): lanes are
 * tokens, so each (row, unit) sum comes out whole, no tree: per element pair,
 * the row's weight pair broadcast against the 8 tokens' activation pairs. The
 * float combination is the documented one, lane-wise over tokens. */
ST_TARGET_AVX512 ST_AI void dot_group_vnni(const void *ctx, st_dtype t, const void *block, const uint8_t *grp,
                                           float out[QI_ROWS][QI_GROUP]) {
    const qi_ctx *m = ctx;
    const qblock *B = block;
    const int ushift = t == ST_DTYPE_Q6_K ? 1 : 0;
    const int64_t nb = m->L.nb, nu = m->nu;
    const int16_t *ga = (const int16_t *)grp;
    const float *gdx = (const float *)(grp + (size_t)nb * 512 * sizeof(int16_t)), *gsx = gdx + QI_GROUP * nb;
    st_v8f acc[QI_ROWS][8];
    for (int r = 0; r < QI_ROWS; r++)
        for (int l = 0; l < 8; l++) acc[r][l] = (st_v8f){0};
    for (int64_t u = 0; u < nu; u++) {
        const int64_t b = u >> ushift;
        const int16_t *a = ga + 512 * b;
        __m256i H[QI_ROWS], L[QI_ROWS];
        for (int r = 0; r < QI_ROWS; r++) H[r] = L[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const __m256i ah = _mm256_loadu_si256((const __m256i *)(a + 32 * j));
            const __m256i al = _mm256_loadu_si256((const __m256i *)(a + 32 * j + 16));
#pragma GCC unroll 8
            for (int r = 0; r < QI_ROWS; r++) {
                int32_t wp;
                memcpy(&wp, B->wsc + (size_t)r * 32 * nu + 32 * u + 2 * j, 4);
                const __m256i wv = _mm256_set1_epi32(wp);
                H[r] = _mm256_dpwssd_epi32(H[r], wv, ah);
                L[r] = _mm256_dpwssd_epi32(L[r], wv, al);
            }
        }
        st_v8f dxv, sxv;
        memcpy(&dxv, gdx + QI_GROUP * b, sizeof dxv);
        memcpy(&sxv, gsx + QI_GROUP * b, sizeof sxv);
        for (int r = 0; r < QI_ROWS; r++) {
            const st_v8i S = (st_v8i)_mm256_add_epi32(_mm256_slli_epi32(H[r], 8), L[r]);
            st_v8f f = (B->dsc[QI_ROWS * u + r] * dxv) * __builtin_convertvector(S, st_v8f);
            if (has_mins(t)) f = f + B->msc[QI_ROWS * u + r] * sxv;
            acc[r][u & 7] += f;
        }
    }
    for (int r = 0; r < QI_ROWS; r++) {
        const st_v8f *c = acc[r];
        const st_v8f y = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
        memcpy(out[r], &y, sizeof y);
    }
}
#endif


/* ==== int8 activations (st_cpu.act8) ==== */

typedef uint8_t v32u8 __attribute__((vector_size(32)));
typedef int8_t v32i8 __attribute__((vector_size(32)));
typedef int32_t v32i32 __attribute__((vector_size(128)));
typedef int8_t st_v8i8 __attribute__((vector_size(8)));

#define A8_QMAX 127.0f

/* Per token: qs[K] int8, then dx[nb], sx[nb] floats, then hs[2 * nb] int32
 * (the sums of a over each block's halves, elements 0..15 and 16..31). */
ST_AI size_t a8_stride(int64_t K) { return ((size_t)K + (size_t)(K / 32) * 16 + 63) & ~(size_t)63; }

/* The token-group layout (AVX-512 level, n > 1), lanes = 8 tokens: per
 * block b and element quad j (elements 4j..4j+3), the 8 tokens' quads (32
 * bytes), then dx[nb][8], sx[nb][8], hs[2 * nb][8]; tokens past n zero. */
ST_AI size_t a8_group_stride(int64_t nb) { return (size_t)nb * (256 + 32 + 32 + 64); }

ST_AI v32u8 ld32u8(const uint8_t *p) {
    v32u8 v;
    memcpy(&v, p, 32);
    return v;
}
ST_AI st_v16u8 ld16u8(const uint8_t *p) {
    st_v16u8 v;
    memcpy(&v, p, 16);
    return v;
}
/* (through memory, two 16-byte stores and a 32-byte load stall store forwarding) */
ST_AI v32u8 cat16(st_v16u8 lo, st_v16u8 hi) {
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                   22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

ST_AI void quant_block8(const float *x, int8_t *a, float *dx, float *sx, int32_t *hs) {
    st_v8f v[4], amax = st_v8f_splat(0.0f);
    st_v8i bad = {0};
    for (int i = 0; i < 4; i++) {
        v[i] = st_v8f_load(x + 8 * i);
        const st_v8f ab = (st_v8f)((st_v8u)v[i] & 0x7fffffffu);
        bad |= (st_v8i)(v[i] * 0.0f != 0.0f); /* inf or NaN */
        amax = v8f_max(amax, ab);
    }
    float m = 0.0f;
    int any_bad = 0;
    for (int l = 0; l < 8; l++) {
        m = amax[l] > m ? amax[l] : m;
        any_bad |= bad[l];
    }
    const float d = any_bad ? __builtin_nanf("") : m / A8_QMAX;
    if (any_bad || !(d > 0.0f)) {
        memset(a, 0, 32);
        *dx = d;
        *sx = 0.0f;
        hs[0] = hs[1] = 0;
        return;
    }
    const st_v8f dv = st_v8f_splat(d), magic = st_v8f_splat(0x1.8p23f);
    const st_v8f hi = st_v8f_splat(A8_QMAX), lo = st_v8f_splat(-A8_QMAX);
    st_v8i sum[2] = {{0}, {0}};
    for (int i = 0; i < 4; i++) {
        st_v8f f = (v[i] / dv + magic) - magic; /* round to nearest even */
        f = v8f_min(v8f_max(f, lo), hi);
        const st_v8i q = __builtin_convertvector(f, st_v8i);
        sum[i >> 1] += q;
        const st_v8i8 q8 = __builtin_convertvector(q, st_v8i8);
        memcpy(a + 8 * i, &q8, 8);
    }
    int32_t s0 = 0, s1 = 0;
    for (int l = 0; l < 8; l++) s0 += sum[0][l], s1 += sum[1][l];
    *dx = d;
    *sx = d * (float)(s0 + s1);
    hs[0] = s0, hs[1] = s1;
}

typedef struct {
    const float *x;
    uint8_t *q, *grp;
    int64_t K, nb;
    size_t stride;
} qa8_ctx;

ST_AI void quant_rows8(const qa8_ctx *c, int64_t begin, int64_t end) {
    const int64_t nb = c->nb, K = c->K;
    for (int64_t t = begin; t < end; t++) {
        uint8_t *base = c->q + (size_t)t * c->stride;
        int8_t *a = (int8_t *)base;
        float *dx = (float *)(base + K), *sx = dx + nb;
        int32_t *hs = (int32_t *)(sx + nb);
        for (int64_t b = 0; b < nb; b++) quant_block8(c->x + t * K + 32 * b, a + 32 * b, dx + b, sx + b, hs + 2 * b);
        if (!c->grp) continue;
        uint8_t *g = c->grp + (size_t)(t / QI_GROUP) * a8_group_stride(nb);
        const int lane = (int)(t % QI_GROUP);
        float *gdx = (float *)(g + (size_t)nb * 256), *gsx = gdx + QI_GROUP * nb;
        int32_t *ghs = (int32_t *)(gsx + QI_GROUP * nb);
        for (int64_t b = 0; b < nb; b++) {
            for (int j = 0; j < 8; j++) memcpy(g + 256 * b + 32 * j + 4 * lane, a + 32 * b + 4 * j, 4);
            gdx[QI_GROUP * b + lane] = dx[b];
            gsx[QI_GROUP * b + lane] = sx[b];
            ghs[QI_GROUP * 2 * b + lane] = hs[2 * b];
            ghs[QI_GROUP * (2 * b + 1) + lane] = hs[2 * b + 1];
        }
    }
}

/* The 32 weight bytes of unit u of a row, as multiplied against the block's
 * 32 activations: unsigned w + off8(t) (q8_0: the signed w; q6_K: the
 * unit's 16 in its half of the block, zeros in the other). */
ST_AI int off8(st_dtype t) { return t == ST_DTYPE_Q4_0 ? 8 : t == ST_DTYPE_Q6_K ? 32 : 0; }

ST_AI v32u8 load_unit8(st_dtype t, const uint8_t *row, int64_t u) {
    switch (t) {
    case ST_DTYPE_Q8_0: return ld32u8(row + 34 * u + 2);
    case ST_DTYPE_Q4_0: {
        const st_v16u8 q = ld16u8(row + 18 * u + 2);
        return cat16(q & 15, q >> 4);
    }
    case ST_DTYPE_Q4_1: {
        const st_v16u8 q = ld16u8(row + 20 * u + 4);
        return cat16(q & 15, q >> 4);
    }
    case ST_DTYPE_Q4_K: {
        const v32u8 v = ld32u8(row + 144 * (u >> 3) + 16 + 32 * ((u & 7) >> 1));
        return (u & 1) ? v >> 4 : v & 15;
    }
    case ST_DTYPE_Q6_K: {
        const uint8_t *sb = row + 210 * (u >> 4);
        const int g16 = (int)(u & 15), h = g16 >> 3, g = (g16 >> 1) & 3, hf = g16 & 1;
        const st_v16u8 lv = ld16u8(sb + 64 * h + 32 * (g & 1) + 16 * hf);
        const st_v16u8 hv = ld16u8(sb + 128 + 32 * h + 16 * hf);
        const st_v16u8 lo = g < 2 ? (lv & 15) : (lv >> 4);
        const st_v16u8 v = lo | (((hv >> (2 * g)) & 3) << 4), z = {0};
        return hf ? cat16(z, v) : cat16(v, z);
    }
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
    return (v32u8){0};
}

/* prow8: one row's partial sums of w * a over a unit, w unsigned (signed
 * when sgn: q8_0), in 8 lanes of any partition (the sums are exact). */
ST_AI st_v8i prow8_portable(v32u8 w, v32i8 a, bool sgn) {
    const v32i32 wv = sgn ? __builtin_convertvector((v32i8)w, v32i32) : __builtin_convertvector(w, v32i32);
    const v32i32 p = wv * __builtin_convertvector(a, v32i32);
    st_v8i q[4];
    memcpy(q, &p, sizeof p);
    return (q[0] + q[1]) + (q[2] + q[3]);
}

#if ST_CPU_HAVE_AVX2_PATH
/* u8 x s8 products; q8_0's signed weights by the sign trick: |w| x a sign(w)
 * (|a| <= 127, |w| <= 128: vpmaddubsw's pair sums stay below 2^15). */
ST_TARGET_AVX2_F16C ST_AI st_v8i prow8_avx2(v32u8 w, v32i8 a, bool sgn) {
    __m256i wv = (__m256i)w, av = (__m256i)a;
    if (sgn) av = _mm256_sign_epi8(av, wv), wv = _mm256_sign_epi8(wv, wv);
    return (st_v8i)_mm256_madd_epi16(_mm256_maddubs_epi16(wv, av), _mm256_set1_epi16(1));
}
ST_TARGET_AVXVNNI ST_AI st_v8i prow8_avxvnni(v32u8 w, v32i8 a, bool sgn) {
    __m256i wv = (__m256i)w, av = (__m256i)a;
    if (sgn) av = _mm256_sign_epi8(av, wv), wv = _mm256_sign_epi8(wv, wv);
    return (st_v8i)_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), wv, av);
}
ST_TARGET_AVX512 ST_AI st_v8i prow8_vnni(v32u8 w, v32i8 a, bool sgn) {
    __m256i wv = (__m256i)w, av = (__m256i)a;
    if (sgn) av = _mm256_sign_epi8(av, wv), wv = _mm256_sign_epi8(wv, wv);
    return (st_v8i)_mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, av);
}
ST_TARGET_AVXVNNI ST_AI st_v8i tree_avxvnni(const st_v8i p[QI_ROWS]) { return tree_avx2(p); }
ST_TARGET_AVXVNNI ST_AI st_v8f f16_avxvnni(st_v8i h) { return f16_avx2(h); }
#endif

/* (the scales' gather as 8 scalar loads at every level: vpgatherdd cost more here, and is slower still
 * on Intel CPUs under the GDS microcode mitigation) */
typedef struct {
    st_v8i (*gather)(const uint8_t *base, st_v8i idx, int64_t off);
    st_v8f (*f16)(st_v8i h);
    st_v8i (*prow8)(v32u8 w, v32i8 a, bool sgn);
    st_v8i (*tree)(const st_v8i p[QI_ROWS]);
    void (*group8)(const void *ctx, st_dtype t, const void *block, const uint8_t *grp, float out[QI_ROWS][8]);
    bool q8u; /* prow8 takes q8_0 as unsigned w + 128 (no saturation: vpdpbusd, C), not by the sign trick */
} qi8_isa;

/* The 8 rows' outputs for one token, in the documented order. */
ST_AI void dot_token8(const qi_ctx *m, st_dtype t, const qblock *B, bool unpacked, const uint8_t *qa,
                      float out[QI_ROWS], qi8_isa I) {
    const int ushift = t == ST_DTYPE_Q6_K ? 1 : 0;
    const int64_t K = m->L.K, nb = m->L.nb;
    const float *dx = (const float *)(qa + K), *sx = dx + nb;
    const int32_t *hs = (const int32_t *)(sx + nb);
    const uint8_t *ws8 = (const uint8_t *)B->wsc;
    const int64_t span = QI_ROWS * (int64_t)m->row_bytes;
    const uint64_t pf_q16 = ((uint64_t)span << 16) / (uint64_t)m->nu; /* prefetch bytes per unit, 16.16 */
    int64_t pf = 0;
    const bool q8u = I.q8u && t == ST_DTYPE_Q8_0; /* q8_0 as unsigned w + 128 */
    const int off = q8u ? 128 : off8(t);
    st_v8f acc[8];
    for (int l = 0; l < 8; l++) acc[l] = st_v8f_splat(0.0f);
    for (int64_t u0 = 0; u0 < m->nu; u0 += 8)
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const int64_t u = u0 + j;
        if (u >= m->nu) break;
        const int64_t b = u >> ushift;
        v32i8 A;
        memcpy(&A, qa + 32 * b, 32);
        st_v8i p[QI_ROWS];
        for (int r = 0; r < QI_ROWS; r++) {
            const v32u8 w = unpacked ? ld32u8(ws8 + (size_t)r * 32 * m->nu + 32 * u) : load_unit8(t, B->base + B->idx[r], u);
            p[r] = q8u ? I.prow8(w ^ 0x80, A, false) : I.prow8(w, A, t == ST_DTYPE_Q8_0);
        }
        if (!unpacked) { /* the next row block, a unit's share of it per unit: one stream ahead */
            const int64_t pf_end = (int64_t)(((uint64_t)(u + 1) * pf_q16) >> 16);
            for (; pf < pf_end; pf += 64) __builtin_prefetch(B->base + span + pf);
        }
        st_v8i s = I.tree(p);
        if (off) s -= off * (t == ST_DTYPE_Q6_K ? hs[u] : hs[2 * b] + hs[2 * b + 1]);
        st_v8f dw, mw = st_v8f_splat(0.0f);
        if (unpacked) {
            dw = st_v8f_load(B->dsc + QI_ROWS * u);
            if (has_mins(t)) mw = st_v8f_load(B->msc + QI_ROWS * u);
        } else {
            load_scales(t, B->base, &B->idx, u, &dw, &mw, (qi_isa){.gather = I.gather, .f16 = I.f16});
        }
        st_v8f f = (dw * dx[b]) * __builtin_convertvector(s, st_v8f);
        if (has_mins(t)) f = f + mw * sx[b];
        acc[j] += f;
    }
    const st_v8f y = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    memcpy(out, &y, sizeof y);
}

/* A few tokens (2..QI_STREAM) at once straight from the weights: each unit
 * of the 8 rows is read (and widened) once and multiplied against every
 * token's activations, then each token's sums go through the tree and the
 * documented combination (the bits of dot_token8, token by token). */
ST_AI void dot_tokens8(const qi_ctx *m, st_dtype t, const qblock *B, const uint8_t *qa0, int nt,
                       float out[QI_STREAM][QI_ROWS], qi8_isa I) {
    const int ushift = t == ST_DTYPE_Q6_K ? 1 : 0;
    const int64_t K = m->L.K, nb = m->L.nb;
    const size_t stride = m->L.stride;
    const int64_t span = QI_ROWS * (int64_t)m->row_bytes;
    const uint64_t pf_q16 = ((uint64_t)span << 16) / (uint64_t)m->nu;
    int64_t pf = 0;
    const bool q8u = I.q8u && t == ST_DTYPE_Q8_0; /* q8_0 as unsigned w + 128 */
    const int off = q8u ? 128 : off8(t);
    st_v8f acc[QI_STREAM][8];
    for (int tk = 0; tk < nt; tk++)
        for (int l = 0; l < 8; l++) acc[tk][l] = st_v8f_splat(0.0f);
    for (int64_t u = 0; u < m->nu; u++) {
        const int64_t b = u >> ushift;
        v32u8 w[QI_ROWS];
        for (int r = 0; r < QI_ROWS; r++) w[r] = load_unit8(t, B->base + B->idx[r], u) ^ (uint8_t)(q8u ? 0x80 : 0);
        const int64_t pf_end = (int64_t)(((uint64_t)(u + 1) * pf_q16) >> 16);
        for (; pf < pf_end; pf += 64) __builtin_prefetch(B->base + span + pf);
        st_v8f dw, mw = st_v8f_splat(0.0f);
        load_scales(t, B->base, &B->idx, u, &dw, &mw, (qi_isa){.gather = I.gather, .f16 = I.f16});
        for (int tk = 0; tk < nt; tk++) {
            const uint8_t *qa = qa0 + (size_t)tk * stride;
            const float *dx = (const float *)(qa + K), *sx = dx + nb;
            const int32_t *hs = (const int32_t *)(sx + nb);
            v32i8 A;
            memcpy(&A, qa + 32 * b, 32);
            st_v8i p[QI_ROWS];
            for (int r = 0; r < QI_ROWS; r++) p[r] = I.prow8(w[r], A, t == ST_DTYPE_Q8_0 && !q8u);
            st_v8i s = I.tree(p);
            if (off) s -= off * (t == ST_DTYPE_Q6_K ? hs[u] : hs[2 * b] + hs[2 * b + 1]);
            st_v8f f = (dw * dx[b]) * __builtin_convertvector(s, st_v8f);
            if (has_mins(t)) f = f + mw * sx[b];
            acc[tk][u & 7] += f;
        }
    }
    for (int tk = 0; tk < nt; tk++) {
        const st_v8f *c = acc[tk];
        const st_v8f y = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
        memcpy(out[tk], &y, sizeof y);
    }
}

ST_AI void qi8_items_t(const qi_ctx *m, st_dtype t, int64_t begin, int64_t end, int ti, qi8_isa I) {
    float *buf = m->scratch[ti];
    qblock B = {.wsc = (int16_t *)buf, .dsc = buf + 16 * QI_ROWS * m->nu};
    B.msc = B.dsc + QI_ROWS * m->nu;
    uint8_t *ws8 = (uint8_t *)buf;
    const bool grouped = I.group8 && m->grp;
    for (int64_t it = begin; it < end; it++) {
        const int64_t tile = it / m->n_rb, rbg = it % m->n_rb;
        int wi = 0;
        while (rbg >= m->rb0[wi + 1]) wi++;
        const int64_t N = m->Ns[wi], r0 = (rbg - m->rb0[wi]) * QI_ROWS;
        float *y = m->ys[wi];
        const int64_t nr = N - r0 < QI_ROWS ? N - r0 : QI_ROWS;
        B.base = m->w[wi] + (size_t)r0 * m->row_bytes;
        for (int r = 0; r < QI_ROWS; r++) B.idx[r] = (int32_t)((r < nr ? r : 0) * (int64_t)m->row_bytes);
        const int64_t t0 = tile * m->tile;
        const int64_t t1 = t0 + m->tile < m->n ? t0 + m->tile : m->n;
        float out[QI_ROWS];
        if (t1 - t0 == 1 && !grouped) {
            dot_token8(m, t, &B, false, m->q + (size_t)t0 * m->L.stride, out, I);
            memcpy(y + t0 * N + r0, out, (size_t)nr * sizeof(float));
            continue;
        }
        if (t1 - t0 <= (I.group8 ? QI_STREAM_GROUPED : QI_STREAM)) { /* a few tokens: one read of the weights,
                                                                         no unpacking */
            float os[QI_STREAM][QI_ROWS];
            dot_tokens8(m, t, &B, m->q + (size_t)t0 * m->L.stride, (int)(t1 - t0), os, I);
            for (int64_t tk = t0; tk < t1; tk++) memcpy(y + tk * N + r0, os[tk - t0], (size_t)nr * sizeof(float));
            continue;
        }
        /* q8_0's bytes go to the group kernel offset to unsigned (w + 128) */
        const uint8_t flip = grouped && t == ST_DTYPE_Q8_0 ? 0x80 : 0;
        for (int64_t u = 0; u < m->nu; u++) {
            for (int r = 0; r < QI_ROWS; r++) {
                const v32u8 w = load_unit8(t, B.base + B.idx[r], u) ^ flip;
                memcpy(ws8 + (size_t)r * 32 * m->nu + 32 * u, &w, 32);
            }
            st_v8f dw, mw = st_v8f_splat(0.0f);
            load_scales(t, B.base, &B.idx, u, &dw, &mw, (qi_isa){.gather = I.gather, .f16 = I.f16});
            memcpy(B.dsc + QI_ROWS * u, &dw, sizeof dw);
            memcpy(B.msc + QI_ROWS * u, &mw, sizeof mw);
        }
        if (grouped) {
            for (int64_t g0 = t0; g0 < t1; g0 += QI_GROUP) {
                float og[QI_ROWS][QI_GROUP];
                I.group8(m, t, &B, m->grp + (size_t)(g0 / QI_GROUP) * a8_group_stride(m->L.nb), og);
                for (int64_t tk = g0; tk < t1 && tk < g0 + QI_GROUP; tk++)
                    for (int r = 0; r < nr; r++) y[tk * N + r0 + r] = og[r][tk - g0];
            }
            continue;
        }
        for (int64_t tk = t0; tk < t1; tk++) {
            dot_token8(m, t, &B, true, m->q + (size_t)tk * m->L.stride, out, I);
            memcpy(y + tk * N + r0, out, (size_t)nr * sizeof(float));
        }
    }
}

ST_AI void qi8_items(const qi_ctx *m, int64_t begin, int64_t end, int ti, qi8_isa I) {
    switch (m->dtype) {
    case ST_DTYPE_Q8_0: qi8_items_t(m, ST_DTYPE_Q8_0, begin, end, ti, I); return;
    case ST_DTYPE_Q4_0: qi8_items_t(m, ST_DTYPE_Q4_0, begin, end, ti, I); return;
    case ST_DTYPE_Q4_1: qi8_items_t(m, ST_DTYPE_Q4_1, begin, end, ti, I); return;
    case ST_DTYPE_Q4_K: qi8_items_t(m, ST_DTYPE_Q4_K, begin, end, ti, I); return;
    case ST_DTYPE_Q6_K: qi8_items_t(m, ST_DTYPE_Q6_K, begin, end, ti, I); return;
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
}

#if ST_CPU_HAVE_AVX2_PATH
/* Tokens of a group x the 8 unpacked rows of B (AVX-512 level), lanes =
 * tokens: per element quad, the row's 4 weight bytes (unsigned: q8_0's
 * offset by 128) broadcast against the 8 tokens' activation quads
 * (vpdpbusd), then S = sum - off * sum(a) per token. */
ST_TARGET_AVX512 ST_AI void dot_group8_vnni(const void *ctx, st_dtype t, const void *block, const uint8_t *grp,
                                            float out[QI_ROWS][QI_GROUP]) {
    const qi_ctx *m = ctx;
    const qblock *B = block;
    const bool q6 = t == ST_DTYPE_Q6_K;
    const int ushift = q6 ? 1 : 0;
    const int off = t == ST_DTYPE_Q8_0 ? 128 : off8(t);
    const int64_t nb = m->L.nb, nu = m->nu;
    const uint8_t *ws8 = (const uint8_t *)B->wsc;
    const float *gdx = (const float *)(grp + (size_t)nb * 256), *gsx = gdx + QI_GROUP * nb;
    const int32_t *ghs = (const int32_t *)(gsx + QI_GROUP * nb);
    st_v8f acc[QI_ROWS][8];
    for (int r = 0; r < QI_ROWS; r++)
        for (int l = 0; l < 8; l++) acc[r][l] = (st_v8f){0};
    for (int64_t u = 0; u < nu; u++) {
        const int64_t b = u >> ushift;
        const uint8_t *a = grp + 256 * b;
        const int j0 = q6 ? 4 * (int)(u & 1) : 0;
        __m256i H[QI_ROWS];
        for (int r = 0; r < QI_ROWS; r++) H[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int jj = 0; jj < 8; jj++) {
            if (q6 && jj >= 4) break;
            const int j = j0 + jj;
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + 32 * j));
#pragma GCC unroll 8
            for (int r = 0; r < QI_ROWS; r++) {
                int32_t wq;
                memcpy(&wq, ws8 + (size_t)r * 32 * nu + 32 * u + 4 * j, 4);
                H[r] = _mm256_dpbusd_epi32(H[r], _mm256_set1_epi32(wq), av);
            }
        }
        st_v8i corr = {0};
        if (off) {
            st_v8i h0, h1;
            memcpy(&h0, ghs + QI_GROUP * (q6 ? u : 2 * b), sizeof h0);
            if (q6) {
                corr = off * h0;
            } else {
                memcpy(&h1, ghs + QI_GROUP * (2 * b + 1), sizeof h1);
                corr = off * (h0 + h1);
            }
        }
        st_v8f dxv, sxv;
        memcpy(&dxv, gdx + QI_GROUP * b, sizeof dxv);
        memcpy(&sxv, gsx + QI_GROUP * b, sizeof sxv);
        for (int r = 0; r < QI_ROWS; r++) {
            const st_v8i S = (st_v8i)H[r] - corr;
            st_v8f f = (B->dsc[QI_ROWS * u + r] * dxv) * __builtin_convertvector(S, st_v8f);
            if (has_mins(t)) f = f + B->msc[QI_ROWS * u + r] * sxv;
            acc[r][u & 7] += f;
        }
    }
    for (int r = 0; r < QI_ROWS; r++) {
        const st_v8f *c = acc[r];
        const st_v8f y = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
        memcpy(out[r], &y, sizeof y);
    }
}
#endif

/* ---- AMX tiles (st_cpu.amx) ----
 * The token-group kernel's integer sums on Intel AMX: per unit, one tdpbusd
 * of A = the 8 unpacked rows' 32 weight bytes (unsigned, as the group kernel
 * takes them; rows 32 * nu bytes apart in the thread's scratch) by B = the
 * group's activation block (8 quad rows of 8 tokens x 4 signed bytes: the
 * token-group layout as it is) into C[row][token] int32, stored and then
 * combined exactly as dot_group8_vnni does (the same integers, the same
 * float operations in the same order: the same bits). Two units per step
 * (tiles 0-1 A, 2-3 B, 4-5 C) so that one's tdpbusd overlaps the other's
 * loads. Every tile is 8 rows x 32 bytes (one configuration, loaded per
 * chunk of work, released after it). EMULATED does the tile instructions in
 * plain C (tests). */
typedef void (*amx_step_fn)(const uint8_t *a0, const uint8_t *a1, int64_t astride, const uint8_t *b0,
                            const uint8_t *b1, int32_t c[2][QI_ROWS][QI_GROUP]);

/* c[i][r][t] = sum over k < 32 of a_i[r * astride + k] (u8) x b_i[32 * (k / 4) + 4 t + k % 4] (s8);
 * a1 NULL: the first only. */
ST_AI void amx_step_emu(const uint8_t *a0, const uint8_t *a1, int64_t astride, const uint8_t *b0,
                        const uint8_t *b1, int32_t c[2][QI_ROWS][QI_GROUP]) {
    for (int i = 0; i < (a1 ? 2 : 1); i++) {
        const uint8_t *a = i ? a1 : a0;
        const int8_t *b = (const int8_t *)(i ? b1 : b0);
        for (int r = 0; r < QI_ROWS; r++)
            for (int t = 0; t < QI_GROUP; t++) {
                int32_t s = 0;
                for (int k = 0; k < 32; k++) s += (int32_t)a[r * astride + k] * (int32_t)b[32 * (k / 4) + 4 * t + k % 4];
                c[i][r][t] = s;
            }
    }
}

typedef float st_v16f __attribute__((vector_size(64)));
/* lanes 0-7: v[a], lanes 8-15: v[b] */
#define PAIR16(v, a, b) __builtin_shufflevector((v), (v), a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
ST_AI st_v16f pair16(st_v8f v, int r2) {
    switch (r2) {
    case 0: return PAIR16(v, 0, 1);
    case 1: return PAIR16(v, 2, 3);
    case 2: return PAIR16(v, 4, 5);
    default: return PAIR16(v, 6, 7);
    }
}
ST_AI st_v16f dup16f(st_v8f v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7); }
ST_AI st_v16i32 dup16i(st_v8i v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7); }

/* The float side two rows at a time (16 lanes: row 2 r2's 8 tokens, then
 * row 2 r2 + 1's), and the units in the order j = u % 8, then u: acc[j]
 * still sums its units in increasing u, and stays in registers. */
ST_AI void dot_group8_amx(const qi_ctx *m, st_dtype t, const qblock *B, const uint8_t *grp,
                          float out[QI_ROWS][QI_GROUP], amx_step_fn step) {
    const bool q6 = t == ST_DTYPE_Q6_K;
    const int ushift = q6 ? 1 : 0;
    const int off = t == ST_DTYPE_Q8_0 ? 128 : off8(t);
    const int64_t nb = m->L.nb, nu = m->nu;
    const uint8_t *ws8 = (const uint8_t *)B->wsc;
    const float *gdx = (const float *)(grp + (size_t)nb * 256), *gsx = gdx + QI_GROUP * nb;
    const int32_t *ghs = (const int32_t *)(gsx + QI_GROUP * nb);
    /* steps (units u0 and u0 + 8) in the order j = 0..7, u0 = j, j + 16, ...; the next step's tiles
     * are issued before this one's sums are combined (two C buffers), so that the tile stores are
     * done by the time their sums are read */
    int32_t C[2][2][QI_ROWS][QI_GROUP] __attribute__((aligned(64)));
    st_v16f accs[8][QI_ROWS / 2], acc[QI_ROWS / 2];
    for (int j = 0; j < 8; j++)
        for (int r2 = 0; r2 < QI_ROWS / 2; r2++) accs[j][r2] = (st_v16f){0};
    for (int r2 = 0; r2 < QI_ROWS / 2; r2++) acc[r2] = (st_v16f){0};
#define AMX_ISSUE(u0_, c_)                                                                                        \
    step(ws8 + 32 * (u0_), (u0_) + 8 < nu ? ws8 + 32 * ((u0_) + 8) : NULL, 32 * nu, grp + 256 * ((u0_) >> ushift), \
         (u0_) + 8 < nu ? grp + 256 * (((u0_) + 8) >> ushift) : NULL, C[c_])
    int j = 0, cur = 0;
    int64_t u0 = 0;
    AMX_ISSUE(u0, cur);
    for (;;) {
        int nj = j;
        int64_t nu0 = u0 + 16;
        if (nu0 >= nu) nj = j + 1, nu0 = nj;
        const bool more = nj < 8 && nu0 < nu;
        if (more) AMX_ISSUE(nu0, cur ^ 1);
        for (int h = 0; h < (u0 + 8 < nu ? 2 : 1); h++) {
            const int64_t u = u0 + 8 * h, b = u >> ushift;
            st_v8i corr = {0};
            if (off) {
                st_v8i h0, h1;
                memcpy(&h0, ghs + QI_GROUP * (q6 ? u : 2 * b), sizeof h0);
                if (q6) {
                    corr = off * h0;
                } else {
                    memcpy(&h1, ghs + QI_GROUP * (2 * b + 1), sizeof h1);
                    corr = off * (h0 + h1);
                }
            }
            const st_v16i32 corr16 = dup16i(corr);
            const st_v16f dx16 = dup16f(st_v8f_load(gdx + QI_GROUP * b));
            const st_v16f sx16 = dup16f(st_v8f_load(gsx + QI_GROUP * b));
            const st_v8f dw = st_v8f_load(B->dsc + QI_ROWS * u);
            const st_v8f mw = has_mins(t) ? st_v8f_load(B->msc + QI_ROWS * u) : st_v8f_splat(0.0f);
#pragma GCC unroll 4
            for (int r2 = 0; r2 < QI_ROWS / 2; r2++) {
                st_v16i32 S;
                memcpy(&S, C[cur][h][2 * r2], sizeof S);
                S -= corr16;
                st_v16f f = (pair16(dw, r2) * dx16) * __builtin_convertvector(S, st_v16f);
                if (has_mins(t)) f = f + pair16(mw, r2) * sx16;
                acc[r2] += f;
            }
        }
        if (!more || nj != j) {
            memcpy(accs[j], acc, sizeof acc);
            for (int r2 = 0; r2 < QI_ROWS / 2; r2++) acc[r2] = (st_v16f){0};
        }
        if (!more) break;
        j = nj, u0 = nu0, cur ^= 1;
    }
#undef AMX_ISSUE
    for (int r2 = 0; r2 < QI_ROWS / 2; r2++) {
        const st_v16f y = ((accs[0][r2] + accs[4][r2]) + (accs[2][r2] + accs[6][r2])) +
                          ((accs[1][r2] + accs[5][r2]) + (accs[3][r2] + accs[7][r2]));
        memcpy(out[2 * r2], &y, sizeof y); /* rows 2 r2 and 2 r2 + 1: adjacent in out */
    }
}

ST_AI void dot_group8_amxemu(const void *ctx, st_dtype t, const void *block, const uint8_t *grp,
                             float out[QI_ROWS][QI_GROUP]) {
    dot_group8_amx(ctx, t, block, grp, out, amx_step_emu);
}

#if ST_CPU_HAVE_AVX2_PATH
#define ST_TARGET_AMX __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

ST_TARGET_AMX ST_AI void amx_step(const uint8_t *a0, const uint8_t *a1, int64_t astride, const uint8_t *b0,
                                   const uint8_t *b1, int32_t c[2][QI_ROWS][QI_GROUP]) {
    __asm__ volatile("" ::: "memory"); /* tileloadd declares no memory input */
    _tile_zero(4);
    _tile_loadd(0, a0, astride);
    _tile_loadd(2, b0, 32);
    if (a1) {
        _tile_zero(5);
        _tile_loadd(1, a1, astride);
        _tile_loadd(3, b1, 32);
    }
    _tile_dpbusd(4, 0, 2);
    if (a1) _tile_dpbusd(5, 1, 3);
    _tile_stored(4, c[0], 32);
    if (a1) _tile_stored(5, c[1], 32);
}

ST_TARGET_AMX ST_AI void dot_group8_amxreal(const void *ctx, st_dtype t, const void *block, const uint8_t *grp,
                                             float out[QI_ROWS][QI_GROUP]) {
    dot_group8_amx(ctx, t, block, grp, out, amx_step);
}
#endif

#if ST_CPU_HAVE_AVX2_PATH
/* ---- a few tokens x 16 rows straight from the weights (AVX-512 VNNI: W16) ----
 * For 1..QI_STREAM tokens (a decode step, a speculative verification pass) with the lanes = 16
 * weight rows: per unit, the 16 rows' 32 weight bytes are loaded once and transposed so that
 * vector q holds element quad q (elements 4q..4q+3) of every row (W[q], lane r = row r), and
 * each token's S_u is 8 vpdpbusd of W[q] against the token's activation quad q broadcast, the
 * accumulator starting at -off * sum(a) (the offset of unsigned weights taken out): exact
 * integers for 16 rows in the lanes, no reduction tree. The float side is the documented one,
 * lane-wise over rows: f = (dw * dx_b) * S [+ mw * sx_b], acc[u % 8] += f; the units are taken
 * in the order j = u % 8, then u (acc[j] still sums its units in increasing u), so that only
 * the tokens' acc[j] live in registers. Same bits as dot_token8. Weights in the units' byte
 * order: q4_0 / q4_1 16 bytes of nibble pairs (byte i: elements i and i + 16), q8_0 32 signed
 * bytes (as w + 128), q4_K 32 bytes whose low (even unit) or high (odd) nibbles are the unit. */
#define W16_ROWS 16

ST_AI bool w16_dtype(st_dtype t) {
    return t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_K;
}

/* D[d] (d < 4): dword d of the 16 bytes at p[r] + off, lane r, for the 16 rows. */
ST_TARGET_AVX512 ST_AI void w16_transpose4(const uint8_t *const p[W16_ROWS], int64_t off, __m512i D[4]) {
    __m512i Z[4];
    for (int k = 0; k < 4; k++) { /* lane L of Z[k]: row 4 L + k */
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[k] + off)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[k + 4] + off)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[k + 8] + off)), 2);
        Z[k] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[k + 12] + off)), 3);
    }
    const __m512i T0 = _mm512_unpacklo_epi32(Z[0], Z[1]), T1 = _mm512_unpackhi_epi32(Z[0], Z[1]);
    const __m512i T2 = _mm512_unpacklo_epi32(Z[2], Z[3]), T3 = _mm512_unpackhi_epi32(Z[2], Z[3]);
    D[0] = _mm512_unpacklo_epi64(T0, T2), D[1] = _mm512_unpackhi_epi64(T0, T2);
    D[2] = _mm512_unpacklo_epi64(T1, T3), D[3] = _mm512_unpackhi_epi64(T1, T3);
}

/* W[q]: element quad q of unit u of the 16 rows, unsigned (q8_0 as w + 128). */
ST_TARGET_AVX512 ST_AI void w16_load(st_dtype t, const uint8_t *const p[W16_ROWS], int64_t u, __m512i W[8]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i D[8];
    switch (t) {
    case ST_DTYPE_Q4_0:
    case ST_DTYPE_Q4_1:
        w16_transpose4(p, t == ST_DTYPE_Q4_0 ? 18 * u + 2 : 20 * u + 4, D);
        for (int q = 0; q < 4; q++) {
            W[q] = _mm512_and_si512(D[q], m4);
            W[q + 4] = _mm512_and_si512(_mm512_srli_epi16(D[q], 4), m4);
        }
        return;
    case ST_DTYPE_Q8_0: {
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        w16_transpose4(p, 34 * u + 2, D);
        w16_transpose4(p, 34 * u + 18, D + 4);
        for (int q = 0; q < 8; q++) W[q] = _mm512_xor_si512(D[q], x80);
        return;
    }
    case ST_DTYPE_Q4_K: {
        const int64_t o = 144 * (u >> 3) + 16 + 32 * ((u & 7) >> 1);
        w16_transpose4(p, o, D);
        w16_transpose4(p, o + 16, D + 4);
        for (int q = 0; q < 8; q++) W[q] = _mm512_and_si512((u & 1) ? _mm512_srli_epi16(D[q], 4) : D[q], m4);
        return;
    }
    default: break;
    }
    ST_ASSERT(!"not a W16 dtype");
}

/* Tokens 0..NT-1 (qa0 + tk * stride) x the 16 rows p[r]: out[tk][r]. NT a constant. */
/* pf_base: the next 16 rows (row_bytes apart, their first `dense` bytes used), prefetched
 * over the units. */
ST_TARGET_AVX512 ST_AI void dot16_tokens(const qi_ctx *m, st_dtype t, const uint8_t *const p[W16_ROWS],
                                          const uint8_t *pf_base, int64_t dense, const uint8_t *const qa[QI_STREAM],
                                          int NT, float out[QI_STREAM][W16_ROWS]) {
    const int64_t K = m->L.K, nb = m->L.nb, nu = m->nu, stride = (int64_t)m->row_bytes;
    const int off = t == ST_DTYPE_Q8_0 ? 128 : off8(t);
    const uint64_t pf_q16 = ((uint64_t)(W16_ROWS * dense) << 16) / (uint64_t)nu; /* prefetch bytes per unit, 16.16 */
    int64_t pf = 0, pf_row = 0, pf_col = 0, done = 0;
    st_v8i lo8, hi8; /* row offsets from p[0], for load_scales */
    for (int r = 0; r < 8; r++) lo8[r] = (int32_t)(p[r] - p[0]), hi8[r] = (int32_t)(p[r + 8] - p[0]);
    const qi_isa S = {.gather = gather_portable, .f16 = f16_avx512};
    st_v16f accs[8][QI_STREAM];
    for (int j = 0; j < 8; j++) {
        st_v16f acc[QI_STREAM];
        for (int tk = 0; tk < NT; tk++) acc[tk] = (st_v16f){0};
        for (int64_t u = j; u < nu; u += 8, done++) {
            __m512i W[8];
            w16_load(t, p, u, W);
            st_v8f dl, dh, ml = {0}, mh = {0};
            load_scales(t, p[0], &lo8, u, &dl, &ml, S);
            load_scales(t, p[0], &hi8, u, &dh, &mh, S);
            const st_v16f dw = __builtin_shufflevector(dl, dh, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const st_v16f mw = __builtin_shufflevector(ml, mh, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            const int64_t pf_end = (int64_t)(((uint64_t)(done + 1) * pf_q16) >> 16); /* the next rows, spread */
            for (; pf < pf_end; pf += 64) { /* (a weight with a row stride: only the rows' used bytes) */
                __builtin_prefetch(pf_base + pf_row * stride + pf_col, 0, 2);
                if ((pf_col += 64) >= dense) pf_col -= dense, pf_row++;
            }
#pragma GCC unroll 8
            for (int tk = 0; tk < NT; tk++) {
                const uint8_t *a = qa[tk];
                const float *dx = (const float *)(a + K), *sx = dx + nb;
                /* two chains of 4 where few tokens leave the vpdpbusd latency exposed */
                __m512i s = off ? _mm512_set1_epi32(m->corr[tk * nb + u]) : _mm512_setzero_si512();
                __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) {
                    int32_t aq;
                    memcpy(&aq, a + 32 * u + 4 * q, 4);
                    if (NT <= 2 && (q & 1))
                        s1 = _mm512_dpbusd_epi32(s1, W[q], _mm512_set1_epi32(aq));
                    else
                        s = _mm512_dpbusd_epi32(s, W[q], _mm512_set1_epi32(aq));
                }
                if (NT <= 2) s = _mm512_add_epi32(s, s1);
                st_v16f f = (dw * dx[u]) * __builtin_convertvector((st_v16i32)s, st_v16f);
                if (has_mins(t)) f = f + mw * sx[u];
                acc[tk] += f;
            }
        }
        for (int tk = 0; tk < NT; tk++) accs[j][tk] = acc[tk];
    }
    for (int tk = 0; tk < NT; tk++) {
        const st_v16f y = ((accs[0][tk] + accs[4][tk]) + (accs[2][tk] + accs[6][tk])) +
                            ((accs[1][tk] + accs[5][tk]) + (accs[3][tk] + accs[7][tk]));
        memcpy(out[tk], &y, sizeof y);
    }
}

/* Items [begin, end) of 16-row blocks (m->rb0 in 16-row blocks), all m->n tokens. */
ST_TARGET_AVX512 ST_AI void qi8_w16_t(const qi_ctx *m, st_dtype t, int64_t begin, int64_t end) {
    const int64_t n = m->n, dense = (int64_t)st_dtype_row_bytes(t, m->L.K);
    const uint8_t *qa[QI_STREAM];
    for (int64_t tk = 0; tk < QI_STREAM; tk++) qa[tk] = m->q + (size_t)(tk < n ? tk : 0) * m->L.stride;
    for (int64_t it = begin; it < end; it++) {
        int wi = 0;
        while (it >= m->rb0[wi + 1]) wi++;
        const int64_t N = m->Ns[wi], r0 = (it - m->rb0[wi]) * W16_ROWS;
        const int64_t nr = N - r0 < W16_ROWS ? N - r0 : W16_ROWS;
        const uint8_t *base = m->w[wi] + (size_t)r0 * m->row_bytes, *p[W16_ROWS];
        for (int r = 0; r < W16_ROWS; r++) p[r] = base + (size_t)(r < nr ? r : 0) * m->row_bytes; /* padding: row r0 */
        const uint8_t *next = base + W16_ROWS * m->row_bytes;
        float out[QI_STREAM][W16_ROWS];
        /* every token count a constant of its own (a pass of 5 computed as 8, token 0 repeated, cost
         * 1.6x its multiply-adds) */
        switch (n) {
        case 1: dot16_tokens(m, t, p, next, dense, qa, 1, out); break;
        case 2: dot16_tokens(m, t, p, next, dense, qa, 2, out); break;
        case 3: dot16_tokens(m, t, p, next, dense, qa, 3, out); break;
        case 4: dot16_tokens(m, t, p, next, dense, qa, 4, out); break;
        case 5: dot16_tokens(m, t, p, next, dense, qa, 5, out); break;
        case 6: dot16_tokens(m, t, p, next, dense, qa, 6, out); break;
        case 7: dot16_tokens(m, t, p, next, dense, qa, 7, out); break;
        default: dot16_tokens(m, t, p, next, dense, qa, 8, out); break;
        }
        float *y = m->ys[wi];
        for (int64_t tk = 0; tk < n; tk++) memcpy(y + tk * N + r0, out[tk], (size_t)nr * sizeof(float));
    }
}

#endif

/* ---- the levels' pool functions (st_pool_fn over a qi_ctx, qa_ctx or qa8_ctx) ----
 * Each level's instantiations of the templates above live in a source of their own
 * (cpu_qi_<level>.c), so that the slowest sources of the build compile in parallel. */
void st_qi_fn_portable(void *ctx, int64_t begin, int64_t end, int ti);  /* cpu_qi_portable.c */
void st_qa_fn_portable(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_portable(void *ctx, int64_t begin, int64_t end, int ti); /* cpu_qi8_portable.c */
void st_qa8_fn_portable(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_amxemu(void *ctx, int64_t begin, int64_t end, int ti);   /* cpu_qi8_amxemu.c */
#if ST_CPU_HAVE_AVX2_PATH
void st_qi_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti);      /* cpu_qi_avx2.c */
void st_qa_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_avxvnni(void *ctx, int64_t begin, int64_t end, int ti);
void st_qa8_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi_fn_avx512(void *ctx, int64_t begin, int64_t end, int ti);    /* cpu_qi_avx512.c */
void st_qi8_fn_avx512(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_w16(void *ctx, int64_t begin, int64_t end, int ti);
void st_qi8_fn_amx(void *ctx, int64_t begin, int64_t end, int ti);      /* cpu_qi8_amx.c */
#endif

#endif

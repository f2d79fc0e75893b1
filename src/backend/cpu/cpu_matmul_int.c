/* CPU matmul of the quantized dtypes (q4_0, q4_1, q8_0, q4_K, q6_K) with
 * integer dot products: y[n, N] = x[n, K] @ w[N, K]^T.
 *
 * Arithmetic (every level, every n, every thread count: the same bits).
 *
 * 1. Activations, once per call: each token's row is cut into 32-element
 *    blocks b; amax = max |x| over the block, dx_b = amax / 32767 (float
 *    division, rounded to nearest even), a = x / dx_b rounded to the nearest
 *    integer, ties to even, clamped to [-32767, 32767] (int16); sx_b =
 *    dx_b * (float)sum(a). A block of zeros (or with dx_b underflowing to 0)
 *    gets dx_b = 0 and a = 0; one holding inf or NaN gets dx_b = NaN.
 * 2. Weights are read as "units" of 32 integers w with a float scale dw and,
 *    for the dtypes with mins, a float mw, such that the dequantized weight is
 *    dw * w + mw (as core/quant.c computes it):
 *      q8_0  unit = block,      w = q,          dw = d
 *      q4_0  unit = block,      w = q - 8,      dw = d
 *      q4_1  unit = block,      w = q,          dw = d,        mw = m
 *      q4_K  unit = sub-block,  w = q,          dw = d * s_j,  mw = -(dmin * m_j)
 *      q6_K  unit = 16-group,   w = q - 32 in the group's half of its
 *            32-block, 0 in the other half;      dw = d * sc_g
 *    (two q6_K units per activation block, one per scale.)
 * 3. Per output (token t, row r) and unit u over activation block b:
 *      S_u = sum over the unit's 32 elements of w * a   (exact in int32:
 *            |S_u| <= 32 * 128 * 32767 < 2^28)
 *      f_u = (dw_u * dx_b) * (float)S_u  [ + mw_u * sx_b ]
 *      acc[u % 8] += f_u, in increasing u, acc starting at +0
 *      y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
 *    (no fused multiply-adds: every operation is one rounded float op).
 *    The integer sums are exact however a level forms them, and every float
 *    operation is element-wise over outputs, so the portable, AVX2 and
 *    AVX-512 VNNI builds, any n and any thread count give the same bits.
 *
 * Precision: y equals the product of the dequantized weights with the
 * activations rounded to 16 bits per block, up to the float rounding of the
 * combination. Against the f32 product of the dequantized weights, the max
 * |error| / max |y| measured over realistic shapes (K = 576, 1536, N up to
 * 49152, Gaussian activations with 20x outliers) is 6e-5 (int8 activations,
 * QMAX 127: 1.3e-2, too coarse for the CPU's 1e-4 logits checks).
 *
 * Work: an item is (token tile, 8 weight rows). It unpacks its 8 rows once
 * into the thread's scratch (int16 units, scales laid out [unit][row]) and
 * runs every token of the tile over them: per unit the 8 rows' sums S_u come
 * out as one 8-lane vector (AVX2: vpmaddwd and a vphaddd tree; AVX-512:
 * vpdpwssd), so the float combination runs 8 outputs wide. Decode (n = 1)
 * is the same code with one token per tile. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3")
#endif

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"

#if ST_CPU_HAVE_AVX2_PATH
#include <immintrin.h>
#endif

#define QI_ROWS 8             /* weight rows per work item (the lanes of a sum vector) */
#define QI_QMAX 4194303.0f   /* activation integers in [-QI_QMAX, QI_QMAX]: 2^22 - 1 */
#define QI_QMAX_Q8 524287.0f /* q8_0's: 2^19 - 1, so that 32 * 128 * QMAX < 2^31 */
#define QI_TILE_BYTES 131072  /* quantized activation bytes per token tile */
#define QI_TILE_MAX 64

typedef int16_t st_v16i16 __attribute__((vector_size(32)));
typedef uint8_t st_v16u8 __attribute__((vector_size(16)));
typedef int8_t st_v16i8 __attribute__((vector_size(16)));

/* ---- activations ---- */

/* Per token: a[2K] int16 (pairs), then dx[nb], sx[nb] floats (nb = K / 32). */
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

/* The pair layout of 16 integers v (one half of a unit or block): with
 * p = (256 * v for weights, v >> 8 for activations) and r = (v for weights,
 * v & 255 for activations), out = (p0 r0 p1 r1 p2 r2 p3 r3 p8 r8 .. p11 r11 |
 * p4 r4 .. p7 r7 p12 r12 .. p15 r15): what vpunpcklwd / vpunpckhwd make, so
 * that every pair of int16 lanes holds one element and vpmaddwd / vpdpwssd
 * sum 256 * w * (a >> 8) + w * (a & 255) = w * a. */
ST_AI void put_pairs(int16_t *out, st_v16i16 p, st_v16i16 r) {
    const st_v16i16 lo = __builtin_shuffle(p, r, (st_v16i16){0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27});
    const st_v16i16 hi = __builtin_shuffle(p, r, (st_v16i16){4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31});
    memcpy(out, &lo, 32);
    memcpy(out + 16, &hi, 32);
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
    st_v8i q[4], sum = {0};
    for (int i = 0; i < 4; i++) {
        st_v8f f = (v[i] / dv + magic) - magic; /* round to nearest even (|f| < 2^22 or inf) */
        f = v8f_min(v8f_max(f, lo), hi);
        q[i] = __builtin_convertvector(f, st_v8i);
        sum += q[i];
    }
    for (int h = 0; h < 2; h++) {
        st_v16i16 p, r;
        for (int l = 0; l < 16; l++) {
            const int32_t e = q[2 * h + l / 8][l % 8];
            p[l] = (int16_t)(e >> 8); /* arithmetic shift: floor(e / 256) */
            r[l] = (int16_t)(e & 255);
        }
        put_pairs(a + 32 * h, p, r);
    }
    int32_t s = 0;
    for (int l = 0; l < 8; l++) s += sum[l];
    *dx = d;
    *sx = d * (float)s;
}

typedef struct {
    const float *x;
    uint8_t *q;
    qact_layout L;
    float qmax;
} qa_ctx;

ST_AI void quant_rows(const qa_ctx *c, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
        uint8_t *base = c->q + (size_t)t * c->L.stride;
        int16_t *a = (int16_t *)base;
        float *dx = (float *)(base + 2 * (size_t)c->L.K * sizeof(int16_t)), *sx = dx + c->L.nb;
        for (int64_t b = 0; b < c->L.nb; b++)
            quant_block(c->x + t * c->L.K + 32 * b, c->qmax, a + 64 * b, dx + b, sx + b);
    }
}

/* ---- weight units ---- */

/* Unpacked row block: w16[QI_ROWS][ldw] int16, dw[nu][QI_ROWS], mw[nu][QI_ROWS]. */
typedef struct {
    int16_t *w16;
    float *dw, *mw;
    int64_t ldw;
} qrows;

/* 16 weight integers of a half unit, as pairs. */
ST_AI void put_w(int16_t *w, st_v16i16 v) { put_pairs(w, v * 256, v); }

ST_AI void put_nibbles(int16_t *w, const uint8_t *qs, int16_t off) {
    st_v16u8 q;
    memcpy(&q, qs, 16);
    const st_v16i16 v = __builtin_convertvector(q, st_v16i16);
    put_w(w, (v & 15) - off);
    put_w(w + 32, (v >> 4) - off);
}

/* Unpacks row `src` (K elements) into row r of the block. */
ST_AI void unpack_row(st_dtype t, const uint8_t *src, int64_t K, const qrows *q, int r) {
    int16_t *w = q->w16 + (size_t)r * q->ldw;
    float *dw = q->dw + r, *mw = q->mw + r;
    switch (t) {
    case ST_DTYPE_Q8_0:
        for (int64_t b = 0; b < K / 32; b++, src += 34, w += 64) {
            dw[QI_ROWS * b] = st_ld_f16(src);
            for (int h = 0; h < 2; h++) {
                st_v16i8 v;
                memcpy(&v, src + 2 + 16 * h, 16);
                put_w(w + 32 * h, __builtin_convertvector(v, st_v16i16));
            }
        }
        return;
    case ST_DTYPE_Q4_0:
        for (int64_t b = 0; b < K / 32; b++, src += 18, w += 64) {
            dw[QI_ROWS * b] = st_ld_f16(src);
            put_nibbles(w, src + 2, 8);
        }
        return;
    case ST_DTYPE_Q4_1:
        for (int64_t b = 0; b < K / 32; b++, src += 20, w += 64) {
            dw[QI_ROWS * b] = st_ld_f16(src);
            mw[QI_ROWS * b] = st_ld_f16(src + 2);
            put_nibbles(w, src + 4, 0);
        }
        return;
    case ST_DTYPE_Q4_K:
        for (int64_t sb = 0; sb < K / 256; sb++, src += 144) {
            const float d = st_ld_f16(src), dmin = st_ld_f16(src + 2);
            for (int j = 0; j < 8; j++, w += 64) {
                int s, m;
                st_q4k_sm(src + 4, j, &s, &m);
                dw[QI_ROWS * (8 * sb + j)] = d * (float)s;
                mw[QI_ROWS * (8 * sb + j)] = -(dmin * (float)m);
                st_v16u8 q0, q1;
                memcpy(&q0, src + 16 + 32 * (j / 2), 16);
                memcpy(&q1, src + 16 + 32 * (j / 2) + 16, 16);
                st_v16i16 v0 = __builtin_convertvector(q0, st_v16i16), v1 = __builtin_convertvector(q1, st_v16i16);
                if (j & 1) {
                    v0 >>= 4, v1 >>= 4;
                } else {
                    v0 &= 15, v1 &= 15;
                }
                put_w(w, v0);
                put_w(w + 32, v1);
            }
        }
        return;
    case ST_DTYPE_Q6_K:
        for (int64_t sb = 0; sb < K / 256; sb++, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            const float d = st_ld_f16(src + 208);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++)       /* 32-group g of half h */
                    for (int hf = 0; hf < 2; hf++, w += 64) { /* its 16-halves: one unit each */
                        const int u = 16 * (int)sb + 8 * h + 2 * g + hf;
                        dw[QI_ROWS * u] = d * (float)sc[8 * h + 2 * g + hf];
                        st_v16u8 l8, h8;
                        memcpy(&l8, ql + 64 * h + 32 * (g & 1) + 16 * hf, 16);
                        memcpy(&h8, qh + 32 * h + 16 * hf, 16);
                        const st_v16i16 lv = __builtin_convertvector(l8, st_v16i16);
                        const st_v16i16 hv = __builtin_convertvector(h8, st_v16i16);
                        const st_v16i16 lo = g < 2 ? (lv & 15) : (lv >> 4);
                        const st_v16i16 v = (lo | (((hv >> (2 * g)) & 3) << 4)) - 32;
                        put_w(w + 32 * hf, v);
                        memset(w + 32 * (1 - hf), 0, 32 * sizeof *w);
                    }
        }
        return;
    default: break;
    }
    ST_ASSERT(!"not a quantized dtype");
}

/* ---- integer sums: S[r] for the 8 rows of one unit ---- */

typedef st_v8i (*isum_fn)(const int16_t *w, int64_t ldw, const int16_t *a);

ST_AI st_v8i isum_portable(const int16_t *w, int64_t ldw, const int16_t *a) {
    st_v8i s;
    for (int r = 0; r < QI_ROWS; r++) {
        int32_t acc = 0;
        for (int i = 0; i < 64; i++) acc += (int32_t)w[r * ldw + i] * a[i];
        s[r] = acc;
    }
    return s;
}

#if ST_CPU_HAVE_AVX2_PATH
/* 8 vectors of 8 partial sums -> their 8 totals (lane r = vector r). */
ST_TARGET_AVX2 ST_AI __m256i hsum8x8(const __m256i v[QI_ROWS]) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                            _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

#define LDQ(p) _mm256_loadu_si256((const __m256i *)(p))
ST_TARGET_AVX2 ST_AI st_v8i isum_avx2(const int16_t *w, int64_t ldw, const int16_t *a) {
    const __m256i a0 = LDQ(a), a1 = LDQ(a + 16), a2 = LDQ(a + 32), a3 = LDQ(a + 48);
    __m256i p[QI_ROWS];
    for (int r = 0; r < QI_ROWS; r++) {
        const int16_t *wr = w + r * ldw;
        p[r] = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(LDQ(wr), a0), _mm256_madd_epi16(LDQ(wr + 16), a1)),
                                _mm256_add_epi32(_mm256_madd_epi16(LDQ(wr + 32), a2), _mm256_madd_epi16(LDQ(wr + 48), a3)));
    }
    return (st_v8i)hsum8x8(p);
}

ST_TARGET_AVX512 ST_AI st_v8i isum_vnni(const int16_t *w, int64_t ldw, const int16_t *a) {
    const __m256i a0 = LDQ(a), a1 = LDQ(a + 16), a2 = LDQ(a + 32), a3 = LDQ(a + 48);
    __m256i p[QI_ROWS];
    for (int r = 0; r < QI_ROWS; r++) {
        const int16_t *wr = w + r * ldw;
        p[r] = _mm256_dpwssd_epi32(_mm256_setzero_si256(), LDQ(wr), a0);
        p[r] = _mm256_dpwssd_epi32(p[r], LDQ(wr + 16), a1);
        p[r] = _mm256_dpwssd_epi32(p[r], LDQ(wr + 32), a2);
        p[r] = _mm256_dpwssd_epi32(p[r], LDQ(wr + 48), a3);
    }
    return (st_v8i)hsum8x8(p);
}
#undef LDQ
#endif

/* ---- work items ---- */

typedef struct {
    const uint8_t *w; /* [N] rows of row_bytes */
    st_dtype dtype;
    size_t row_bytes;
    const uint8_t *q; /* quantized activations */
    qact_layout L;
    float *y; /* [n, N] */
    int64_t n, N;
    int64_t nu;    /* units per row */
    int ushift;    /* log2(units per activation block) */
    bool mins;
    int64_t tile;  /* tokens per tile */
    int64_t n_rb;  /* row blocks */
    int64_t ldw;   /* unpacked row stride (int16) */
    float *const *scratch;
} qi_ctx;

/* The 8 rows' outputs for one token, in the documented order. */
ST_AI void dot_rows(const qi_ctx *m, const qrows *R, const uint8_t *qa, float out[QI_ROWS], isum_fn isum) {
    const int16_t *a = (const int16_t *)qa;
    const float *dx = (const float *)(qa + 2 * (size_t)m->L.K * sizeof(int16_t)), *sx = dx + m->L.nb;
    st_v8f acc[8];
    for (int l = 0; l < 8; l++) acc[l] = st_v8f_splat(0.0f);
    for (int64_t u = 0; u < m->nu; u++) {
        const int64_t b = u >> m->ushift;
        const int16_t *wu = R->w16 + 64 * u, *ab = a + 64 * b;
        const st_v8i s = isum(wu, R->ldw, ab);
        st_v8f f = (st_v8f_load(R->dw + QI_ROWS * u) * st_v8f_splat(dx[b])) * __builtin_convertvector(s, st_v8f);
        if (m->mins) f = f + st_v8f_load(R->mw + QI_ROWS * u) * st_v8f_splat(sx[b]);
        acc[u & 7] += f;
    }
    const st_v8f y = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    memcpy(out, &y, sizeof y);
}

ST_AI void qi_items(const qi_ctx *m, int64_t begin, int64_t end, int ti, isum_fn isum) {
    float *buf = m->scratch[ti];
    const qrows R = {
        .w16 = (int16_t *)buf,
        .dw = buf + QI_ROWS * m->ldw / 2,
        .mw = buf + QI_ROWS * m->ldw / 2 + QI_ROWS * m->nu,
        .ldw = m->ldw,
    };
    for (int64_t it = begin; it < end; it++) {
        const int64_t tile = it / m->n_rb, rb = it % m->n_rb;
        const int64_t r0 = rb * QI_ROWS;
        const int64_t nr = m->N - r0 < QI_ROWS ? m->N - r0 : QI_ROWS;
        /* unpack once per item (padding rows repeat row r0; their outputs are dropped) */
        for (int r = 0; r < QI_ROWS; r++)
            unpack_row(m->dtype, m->w + (size_t)(r0 + (r < nr ? r : 0)) * m->row_bytes, m->L.K, &R, r);
        const int64_t t0 = tile * m->tile;
        const int64_t t1 = t0 + m->tile < m->n ? t0 + m->tile : m->n;
        for (int64_t t = t0; t < t1; t++) {
            float out[QI_ROWS];
            dot_rows(m, &R, m->q + (size_t)t * m->L.stride, out, isum);
            memcpy(m->y + t * m->N + r0, out, (size_t)nr * sizeof(float));
        }
    }
}

static void qi_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti, isum_portable);
}
static void qa_fn_portable(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows(ctx, begin, end);
}
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 static void qi_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti, isum_avx2);
}
ST_TARGET_AVX512 static void qi_fn_avx512(void *ctx, int64_t begin, int64_t end, int ti) {
    qi_items(ctx, begin, end, ti, isum_vnni);
}
ST_TARGET_AVX2 static void qa_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    quant_rows(ctx, begin, end);
}
#endif

strata_status st_cpu_matmul_int(st_cpu *c, const float *x, const st_weight *w, int64_t n, float *y) {
    const int64_t K = w->cols, N = w->rows;
    if (n == 0 || N == 0) return STRATA_OK;
    qi_ctx m = {
        .w = w->data, .dtype = w->dtype, .row_bytes = st_dtype_row_bytes(w->dtype, K),
        .L = {.K = K, .nb = K / 32, .stride = 2 * (size_t)K * sizeof(int16_t) + 2 * (size_t)(K / 32) * sizeof(float)},
        .y = y, .n = n, .N = N,
        .ushift = w->dtype == ST_DTYPE_Q6_K ? 1 : 0,
        .mins = w->dtype == ST_DTYPE_Q4_1 || w->dtype == ST_DTYPE_Q4_K,
        .n_rb = (N + QI_ROWS - 1) / QI_ROWS,
    };
    m.nu = m.L.nb << m.ushift;
    m.ldw = 64 * m.nu;
    m.L.stride = (m.L.stride + 63) & ~(size_t)63;

    strata_status st = st_cpu_qact_reserve(c, m.L.stride * (size_t)n);
    if (st == STRATA_OK)
        st = st_cpu_scratch_reserve(c, (size_t)(QI_ROWS * m.ldw / 2 + 2 * QI_ROWS * m.nu));
    if (st != STRATA_OK) return st;
    m.q = c->qact;
    m.scratch = c->scratch;

    /* quantize the activations: a few thousand elements per chunk */
    qa_ctx qa = {.x = x, .q = c->qact, .L = m.L, .qmax = w->dtype == ST_DTYPE_Q8_0 ? QI_QMAX_Q8 : QI_QMAX};
    int64_t qgrain = 16384 / K;
    if (qgrain < 1) qgrain = 1;
    st_pool_fn qa_fn = qa_fn_portable, qi_fn = qi_fn_portable;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->isa >= ST_CPU_ISA_AVX2) qa_fn = qa_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVX2) qi_fn = qi_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVX512) qi_fn = qi_fn_avx512;
#endif
    if (n <= qgrain)
        qa_fn(&qa, 0, n, 0);
    else
        st_pool_parallel_for(c->pool, n, qgrain, qa_fn, &qa);

    int64_t tile_max = QI_TILE_BYTES / (int64_t)m.L.stride;
    if (tile_max < 1) tile_max = 1;
    if (tile_max > QI_TILE_MAX) tile_max = QI_TILE_MAX;
    const int64_t n_tiles = (n + tile_max - 1) / tile_max;
    m.tile = (n + n_tiles - 1) / n_tiles; /* balanced tiles */
    /* At least ~64K multiply-adds per chunk, so tiny products stay on one thread. */
    const int64_t macs = QI_ROWS * K * (n < m.tile ? n : m.tile);
    int64_t grain = 65536 / (macs > 0 ? macs : 1);
    if (grain < 1) grain = 1;
    const int64_t n_items = n_tiles * m.n_rb;
    st_pool_parallel_for(c->pool, n_items, grain, qi_fn, &m);
    return STRATA_OK;
}

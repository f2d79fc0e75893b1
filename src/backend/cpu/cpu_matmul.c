/* CPU matmul: y[n, N] = x[n, K] @ w[N, K]^T. The quantized dtypes go to
 * the integer path (cpu_matmul_int.c); here the float ones (f32, f16, bf16),
 * and the row dequantizers that get_rows uses for every dtype.
 *
 * Work item = (token tile, block of 4 weight rows). An item converts its
 * 4 rows (F32 rows are read in place) into the thread's scratch, 4*K floats,
 * and multiplies them with every token of the tile, two tokens at a time (a
 * 4x2 register tile: 8 vector accumulators). The token tile is sized so that
 * its slice of x stays in L2 (<= 256 KiB); each weight row is therefore
 * dequantized once per tile, never materialised beyond one row block.
 * Items are numbered tile-major, so the pool's contiguous chunks walk the
 * rows of one tile (x stays hot) and decode (n = 1) is split over rows.
 * Decode with bf16 weights skips the scratch: the 4x1 tile converts in
 * registers (same values, same order, same bits).
 *
 * Every y element is produced by one item with the reduction order of
 * cpu_simd.h, so results depend neither on the thread count, nor on n, nor
 * on whether the portable or the AVX2 build of the kernels ran (no fused
 * multiply-adds anywhere; dequantization equals st_dequantize_row exactly).
 * Measured on AMD EPYC (Zen), the unfused 4x2 tile beat FMA tiles as GCC 12
 * compiles them. */
#if defined(__GNUC__) && !defined(__clang__)
/* GCC 12's -O2 vectorizer (very-cheap cost model) leaves the int8/nibble
 * widening loops below scalar; -O3 vectorizes them. */
#pragma GCC optimize("O3")
#endif

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"

#define MM_ROWS 4            /* weight rows per work item */
#define MM_TILE_BYTES 262144 /* x bytes per token tile */
#define MM_TILE_MAX 64

/* ---- row dequantization (8 lanes at a time) ---- */

ST_AI st_v8f cvt_bf16x8(const uint8_t *p) {
    st_v8u16 h;
    memcpy(&h, p, sizeof h);
    st_v8u u = __builtin_convertvector(h, st_v8u) << 16;
    return (st_v8f)u;
}

ST_AI st_v8f cvt_f16x8(const uint8_t *p) {
    st_v8u16 h16;
    memcpy(&h16, p, sizeof h16);
    return st_v8f_from_f16(h16);
}

/* Block dequantizers: plain loops with constant trip counts, which GCC
 * vectorizes at -O3 (`restrict` spares the aliasing checks between the byte
 * loads and the float stores), or explicit vectors where GCC 12's widening of
 * nibbles goes scalar. The arithmetic is that of core/quant.c, product by
 * product (q - 8 is exact in float: d * ((float)q - 8) == d * (float)(q - 8)). */
ST_AI void dq_q8_0(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
        const float d = st_ld_f16(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
    }
}

/* Nibbles of 8 bytes as floats. Masking the byte vector first (also for the
 * high nibble: & 0xF0, then >> 4 on 32-bit lanes) keeps GCC's widening in
 * vector registers; x86 has no byte shifts. */
ST_AI st_v8f nib_lo(st_v8u8 q) { return __builtin_convertvector(__builtin_convertvector(q & 0x0F, st_v8i), st_v8f); }
ST_AI st_v8f nib_hi(st_v8u8 q) { return __builtin_convertvector(__builtin_convertvector(q & 0xF0, st_v8i) >> 4, st_v8f); }

ST_AI void dq_q4_0(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    const st_v8f eight = st_v8f_splat(8.0f);
    for (int64_t i = 0; i < nb; i++, b += 18, y += 32) {
        const st_v8f d = st_v8f_splat(st_ld_f16(b));
        for (int j = 0; j < 16; j += 8) {
            st_v8u8 q;
            memcpy(&q, b + 2 + j, 8);
            ST_V8F_STORE(y + j, d * (nib_lo(q) - eight));
            ST_V8F_STORE(y + 16 + j, d * (nib_hi(q) - eight));
        }
    }
}

ST_AI void dq_q4_1(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 20, y += 32) {
        const st_v8f d = st_v8f_splat(st_ld_f16(b)), m = st_v8f_splat(st_ld_f16(b + 2));
        for (int j = 0; j < 16; j += 8) {
            st_v8u8 q;
            memcpy(&q, b + 4 + j, 8);
            ST_V8F_STORE(y + j, d * nib_lo(q) + m);
            ST_V8F_STORE(y + 16 + j, d * nib_hi(q) + m);
        }
    }
}

ST_AI void dq_q4_k(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 144, y += 256) {
        const float d = st_ld_f16(b), dmin = st_ld_f16(b + 2);
        const uint8_t *sc = b + 4, *qs = b + 16;
        for (int c = 0; c < 4; c++) {
            int s0, m0, s1, m1;
            st_q4k_sm(sc, 2 * c, &s0, &m0);
            st_q4k_sm(sc, 2 * c + 1, &s1, &m1);
            const float d0 = d * (float)s0, dm0 = dmin * (float)m0;
            const float d1 = d * (float)s1, dm1 = dmin * (float)m1;
            const uint8_t *q = qs + 32 * c;
            float *yc = y + 64 * c;
            for (int l = 0; l < 32; l++) yc[l] = d0 * (float)(q[l] & 15) - dm0;
            for (int l = 0; l < 32; l++) yc[32 + l] = d1 * (float)(q[l] >> 4) - dm1;
        }
    }
}

/* Q6_K two ways, same values: plain loops (what the portable build
 * vectorizes best) and explicit vectors (what the AVX2 build does best). */
ST_AI void dq_q6_k_loop(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = st_ld_f16(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l4 = ql + 64 * h, *h2 = qh + 32 * h;
            const int8_t *s = sc + 8 * h;
            float *yh = y + 128 * h;
            for (int g = 0; g < 8; g++) { /* 16-element groups sharing a scale */
                const float ds = d * (float)s[g];
                const int half = g & 1, grp = g >> 1; /* 32-element group grp, half of it */
                const uint8_t *lo = l4 + 32 * (grp & 1) + 16 * half, *hi = h2 + 16 * half;
                const int lo_shift = grp < 2 ? 0 : 4, hi_shift = 2 * grp;
                float *yg = yh + 32 * grp + 16 * half;
                for (int l = 0; l < 16; l++) {
                    const int q = (((lo[l] >> lo_shift) & 15) | (((hi[l] >> hi_shift) & 3) << 4)) - 32;
                    yg[l] = ds * (float)q;
                }
            }
        }
    }
}

ST_AI void dq_q6_k_vec(const uint8_t *restrict b, float *restrict y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = st_ld_f16(b + 208);
        for (int h = 0; h < 2; h++) {
            for (int g = 0; g < 4; g++) {     /* 32-element group g of half h */
                for (int l = 0; l < 32; l += 8) {
                    st_v8u8 lo8, hi8;
                    memcpy(&lo8, ql + 64 * h + 32 * (g & 1) + l, 8);
                    memcpy(&hi8, qh + 32 * h + l, 8);
                    /* byte masks first, shifts on 32-bit lanes (see nib_lo) */
                    const st_v8i lo = g < 2 ? __builtin_convertvector(lo8 & 0x0F, st_v8i)
                                            : __builtin_convertvector(lo8 & 0xF0, st_v8i) >> 4;
                    const st_v8i hi = __builtin_convertvector(hi8 & (uint8_t)(3u << (2 * g)), st_v8i) >> (2 * g);
                    const st_v8i q = (lo | (hi << 4)) - 32;
                    const st_v8f ds = st_v8f_splat(d * (float)sc[8 * h + 2 * g + l / 16]);
                    ST_V8F_STORE(y + 128 * h + 32 * g + l, ds * __builtin_convertvector(q, st_v8f));
                }
            }
        }
    }
}

ST_AI void dequant_row(st_dtype t, const uint8_t *src, float *y, int64_t K, bool avx2) {
    int64_t k = 0;
    switch (t) {
    case ST_DTYPE_F32: memcpy(y, src, (size_t)K * sizeof(float)); return;
    case ST_DTYPE_BF16:
        for (; k + 8 <= K; k += 8) ST_V8F_STORE(y + k, cvt_bf16x8(src + 2 * k));
        for (; k < K; k++) {
            uint16_t h;
            memcpy(&h, src + 2 * k, 2);
            y[k] = st_bf16_to_f32(h);
        }
        return;
    case ST_DTYPE_F16:
        for (; k + 8 <= K; k += 8) ST_V8F_STORE(y + k, cvt_f16x8(src + 2 * k));
        for (; k < K; k++) y[k] = st_ld_f16(src + 2 * k);
        return;
    case ST_DTYPE_Q8_0: dq_q8_0(src, y, K / 32); return;
    case ST_DTYPE_Q4_0: dq_q4_0(src, y, K / 32); return;
    case ST_DTYPE_Q4_1: dq_q4_1(src, y, K / 32); return;
    case ST_DTYPE_Q4_K: dq_q4_k(src, y, K / 256); return;
    case ST_DTYPE_Q6_K:
        if (avx2)
            dq_q6_k_vec(src, y, K / 256);
        else
            dq_q6_k_loop(src, y, K / 256);
        return;
    case ST_DTYPE_COUNT: break;
    }
    ST_ASSERT(!"bad dtype");
}

static void dequant_row_generic(st_dtype t, const void *src, float *y, int64_t K) {
    dequant_row(t, src, y, K, false);
}
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 static void dequant_row_avx2(st_dtype t, const void *src, float *y, int64_t K) {
    dequant_row(t, src, y, K, true);
}
#endif

void st_cpu_dequant_row(st_dtype t, const void *row, float *out, int64_t cols, bool simd) {
#if ST_CPU_HAVE_AVX2_PATH
    if (simd) {
        dequant_row_avx2(t, row, out, cols);
        return;
    }
#endif
    dequant_row_generic(t, row, out, cols);
}

/* ---- register tiles ---- */

#define LD(p) st_v8f_load((p) + k)
#define LDP(p) st_v8f_load_part((p) + k, m)

/* y{a,b}[r] = dot(w_r, x{a,b}) for r < 4: 8 accumulators; with the
 * products' temporaries this fills the 16 AVX2 registers. */
ST_AI void tile_4x2(const float *const w[MM_ROWS], const float *xa, const float *xb, int64_t K,
                    float ya[MM_ROWS], float yb[MM_ROWS]) {
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const st_v8f z = st_v8f_splat(0.0f);
    st_v8f a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    int64_t k = 0;
#define STEP(L)                                                                  \
    do {                                                                         \
        const st_v8f va = L(xa), vb = L(xb);                                     \
        st_v8f wv;                                                               \
        wv = L(w0), a0 += wv * va, b0 += wv * vb;                                \
        wv = L(w1), a1 += wv * va, b1 += wv * vb;                                \
        wv = L(w2), a2 += wv * va, b2 += wv * vb;                                \
        wv = L(w3), a3 += wv * va, b3 += wv * vb;                                \
    } while (0)
    for (; k + 8 <= K; k += 8) STEP(LD);
    if (k < K) {
        const int64_t m = K - k;
        STEP(LDP);
    }
#undef STEP
    ya[0] = st_v8f_hsum(&a0), ya[1] = st_v8f_hsum(&a1), ya[2] = st_v8f_hsum(&a2), ya[3] = st_v8f_hsum(&a3);
    yb[0] = st_v8f_hsum(&b0), yb[1] = st_v8f_hsum(&b1), yb[2] = st_v8f_hsum(&b2), yb[3] = st_v8f_hsum(&b3);
}

/* One token, fp32 rows. */
ST_AI void tile_4x1(const float *const w[MM_ROWS], const float *xa, int64_t K, float ya[MM_ROWS]) {
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const st_v8f z = st_v8f_splat(0.0f);
    st_v8f a0 = z, a1 = z, a2 = z, a3 = z;
    int64_t k = 0;
#define STEP(L)                                                                  \
    do {                                                                         \
        const st_v8f va = L(xa);                                                 \
        a0 += L(w0) * va, a1 += L(w1) * va, a2 += L(w2) * va, a3 += L(w3) * va;  \
    } while (0)
    for (; k + 8 <= K; k += 8) STEP(LD);
    if (k < K) {
        const int64_t m = K - k;
        STEP(LDP);
    }
#undef STEP
    ya[0] = st_v8f_hsum(&a0), ya[1] = st_v8f_hsum(&a1), ya[2] = st_v8f_hsum(&a2), ya[3] = st_v8f_hsum(&a3);
}

/* One token, bf16 rows converted in registers (the values dequant_row gives;
 * K % 8 == 0): the bits of tile_4x1 on dequantized rows. */
ST_AI void tile_4x1_bf16(const uint8_t *const w[MM_ROWS], const float *xa, int64_t K, float ya[MM_ROWS]) {
    const uint8_t *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const st_v8f z = st_v8f_splat(0.0f);
    st_v8f a0 = z, a1 = z, a2 = z, a3 = z;
    for (int64_t k = 0; k < K; k += 8) {
        const st_v8f va = LD(xa);
        a0 += cvt_bf16x8(w0 + 2 * k) * va;
        a1 += cvt_bf16x8(w1 + 2 * k) * va;
        a2 += cvt_bf16x8(w2 + 2 * k) * va;
        a3 += cvt_bf16x8(w3 + 2 * k) * va;
    }
    ya[0] = st_v8f_hsum(&a0), ya[1] = st_v8f_hsum(&a1), ya[2] = st_v8f_hsum(&a2), ya[3] = st_v8f_hsum(&a3);
}
#undef LD
#undef LDP

/* ---- work items ---- */

typedef struct {
    const float *x;   /* [n, K] */
    const uint8_t *w; /* [N] rows of row_bytes */
    st_dtype dtype;
    size_t row_bytes;
    float *y; /* [n, N] */
    int64_t n, K, N;
    int64_t tile;  /* tokens per tile */
    int64_t n_rb;  /* row blocks */
    int64_t ldw;   /* scratch row stride (floats) */
    float *const *scratch;
} mm_ctx;

ST_AI void mm_items(const mm_ctx *m, int64_t begin, int64_t end, int ti, bool avx2) {
    const int64_t K = m->K, N = m->N;
    float *wbuf = m->scratch[ti];
    /* decode with bf16 weights: convert in registers, no scratch round trip */
    const bool fused = m->n == 1 && m->dtype == ST_DTYPE_BF16 && K % 8 == 0;
    for (int64_t it = begin; it < end; it++) {
        const int64_t tile = it / m->n_rb, rb = it % m->n_rb;
        const int64_t r0 = rb * MM_ROWS;
        const int64_t nr = N - r0 < MM_ROWS ? N - r0 : MM_ROWS;
        float ya[MM_ROWS], yb[MM_ROWS];
        if (fused) {
            const uint8_t *wb[MM_ROWS];
            for (int r = 0; r < MM_ROWS; r++) wb[r] = m->w + (size_t)(r0 + (r < nr ? r : 0)) * m->row_bytes;
            tile_4x1_bf16(wb, m->x, K, ya);
            memcpy(m->y + r0, ya, (size_t)nr * sizeof(float));
            continue;
        }
        const float *w[MM_ROWS];
        for (int r = 0; r < MM_ROWS; r++) {
            const uint8_t *src = m->w + (size_t)(r0 + r) * m->row_bytes;
            if (r >= nr) { /* padding rows: recompute row 0, results dropped */
                w[r] = w[0];
            } else if (m->dtype == ST_DTYPE_F32) {
                w[r] = (const float *)src;
            } else {
                float *dst = wbuf + r * m->ldw;
                dequant_row(m->dtype, src, dst, K, avx2);
                w[r] = dst;
            }
        }
        const int64_t t0 = tile * m->tile;
        const int64_t t1 = t0 + m->tile < m->n ? t0 + m->tile : m->n;
        int64_t t = t0;
        for (; t + 2 <= t1; t += 2) {
            tile_4x2(w, m->x + t * K, m->x + (t + 1) * K, K, ya, yb);
            memcpy(m->y + t * N + r0, ya, (size_t)nr * sizeof(float));
            memcpy(m->y + (t + 1) * N + r0, yb, (size_t)nr * sizeof(float));
        }
        if (t < t1) {
            tile_4x1(w, m->x + t * K, K, ya);
            memcpy(m->y + t * N + r0, ya, (size_t)nr * sizeof(float));
        }
    }
}

static void mm_fn_generic(void *ctx, int64_t begin, int64_t end, int ti) {
    mm_items(ctx, begin, end, ti, false);
}
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 static void mm_fn_avx2(void *ctx, int64_t begin, int64_t end, int ti) {
    mm_items(ctx, begin, end, ti, true);
}
#endif

strata_status st_cpu_matmul(st_cpu *c, const float *x, const st_weight *w, int64_t n, float *y) {
    if (w->dtype != ST_DTYPE_F32 && w->dtype != ST_DTYPE_F16 && w->dtype != ST_DTYPE_BF16)
        return st_cpu_matmul_int(c, x, w, 1, n, &y);
    const int64_t K = w->cols, N = w->rows;
    mm_ctx m = {
        .x = x, .w = w->data, .dtype = w->dtype, .row_bytes = st_weight_stride(w),
        .y = y, .n = n, .K = K, .N = N,
        .n_rb = (N + MM_ROWS - 1) / MM_ROWS,
        .ldw = (K + 15) & ~(int64_t)15,
    };
    int64_t tile_max = MM_TILE_BYTES / (K * (int64_t)sizeof(float));
    if (tile_max < 2) tile_max = 2;
    if (tile_max > MM_TILE_MAX) tile_max = MM_TILE_MAX;
    const int64_t n_tiles = (n + tile_max - 1) / tile_max;
    m.tile = (n + n_tiles - 1) / n_tiles; /* balanced tiles */
    if ((m.tile & 1) && m.tile < n) m.tile++; /* even: token pairs stay within a tile */

    if (w->dtype != ST_DTYPE_F32) {
        strata_status st = st_cpu_scratch_reserve(c, (size_t)(MM_ROWS * m.ldw));
        if (st != STRATA_OK) return st;
    }
    m.scratch = c->scratch;
    /* At least ~64K multiply-adds per chunk, so tiny products stay on one thread. */
    int64_t macs = MM_ROWS * K * (n < m.tile ? n : m.tile);
    int64_t grain = 65536 / (macs > 0 ? macs : 1);
    if (grain < 1) grain = 1;
    const int64_t n_items = ((n + m.tile - 1) / m.tile) * m.n_rb;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->simd) {
        st_pool_parallel_for(c->pool, n_items, grain, mm_fn_avx2, &m);
        return STRATA_OK;
    }
#endif
    st_pool_parallel_for(c->pool, n_items, grain, mm_fn_generic, &m);
    return STRATA_OK;
}

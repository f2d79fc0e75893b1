/* CPU causal grouped-query attention: of one sequence over a contiguous
 * cache (attention), over one piece of its keys merged into a running
 * result (attention_part), or of a batch of sequences over a paged cache
 * (attention_paged: the same items, each key's row found through its
 * sequence's block table, so the same bits for the same keys).
 *
 * Work item = (block b of ATTN_TOKEN_BLOCK consecutive tokens, kv head g),
 * numbered b * n_kv_heads + g: the `group` query heads that read kv head g, of
 * every token of the block, are computed together, so each key's K and V rows
 * are read once per item, not once per query head nor per token (a block whose
 * tokens belong to different sequences of a paged batch goes token by token);
 * each token's heads get exactly the operations of an item of their own. An item's keys are cut into ranges at the multiples of
 * ST_ATTN_RANGE (from key 0); each range [r0, r1) is a two-pass softmax in
 * fp32, for each query head h of the group:
 *   s[j] = scale * dot(q_i,h, k_j)         j = r0..r1-1 (cpu_simd.h's order)
 *   p[j] = attn_exp(s[j] - max s)           8 keys at a time
 *   Z    = sum p                            (lane (j - r0) % 8, then st_v8f_hsum)
 *   o    = (sum_j p[j] v_j) * (1 / Z)       (accumulated in increasing j)
 *   lse  = max s + log Z
 * and the ranges are merged in increasing order (backend.h, attention_part):
 *   M = max(lse, lse_r), a = exp(lse - M), b = exp(lse_r - M),
 *   o = (o a + o_r b) * (1 / (a + b)), lse = M + log(a + b).
 * The first range of a call without merge is assigned, not merged. So a
 * sequence of attention_part calls over consecutive pieces performs exactly
 * the operations of one call over all keys: the same bits.
 *
 * Threads: the items go over the pool. When there are fewer than
 * ATTN_ITEMS_PER_THREAD items per thread or at most ATTN_SPLIT_ITEMS (a decode
 * step: n_kv_heads items) and more than one range, every range of every item is a pool item of its
 * own (split over the keys, numbered range-major): each writes its tokens'
 * (o, lse) to c->attn_part, and then each query head's ranges are merged in
 * increasing order (a pool item per head), the very operations an item
 * performs when it merges its ranges itself. Either way each range is
 * computed by one thread in a fixed order: results do not depend on the
 * thread count nor on the split.
 *
 * A bf16 or fp8 cache (st_kv_layer): each row is converted 8 values at a time
 * (exactly: backend.h) as the dot or the accumulation reads it, so the bits
 * equal those of an f32 cache holding the converted values. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"

#if ST_CPU_HAVE_AVX2_PATH
#include <immintrin.h>
#endif

/* Fewer items than this per thread: split the keys (see above). */
#define ATTN_ITEMS_PER_THREAD 4
/* At most this many items (a decode step, a verification pass) are split over the keys whatever
 * the threads: unsplit, a thread's (kv head, all keys) item reads a strided part of every row of
 * the layer, and each thread goes through all the rows (split: 1.9x on the EPYC at 64K keys, one
 * or two threads; the Xeon of the GPU machine was as fast either way). */
#define ATTN_SPLIT_ITEMS 32
/* Multiply-adds per pool chunk below which a chunk is not worth a thread. */
#define ATTN_GRAIN_MACS 32768
/* Keys ahead whose K and V rows the pass over K asks the caches for: the
 * rows of one kv head are strided in the cache, and a decode step finds them
 * in DRAM (the weights passed through the caches since this layer's last
 * step). The V rows are then still cached for the pass over V. */
#define ATTN_PREFETCH 8
/* Consecutive tokens of one sequence whose heads share one pass over the keys (a verification
 * pass, a prefill): each K and V row is read once for them, not once per token. */
#define ATTN_TOKEN_BLOCK 4
/* Query heads whose dots or accumulations share one pass over a row. */
#define ATTN_HEADS_BLOCK 4 /* (the loops over them say "unroll 4": their accumulators stay in registers) */

/* e^x in 8 lanes (*xp) for x <= 88 (the softmax takes s - max s <= 0): x = k ln2 +
 * r with |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, k ln2_hi exact), e^r
 * by Cephes' degree-7 polynomial for expf, times 2^k through the exponent
 * bits. Within 2 ulp of e^x; 0 below -87 (e^-87 < 2^-125, nothing beside the
 * maximum's e^0 = 1); NaN stays NaN. Separately rounded vector operations
 * only, so every build gives the same bits. */
ST_AI st_v8f attn_exp(const st_v8f *xp) {
    st_v8f x = *xp;
    const st_v8f lo = st_v8f_splat(-87.0f), magic = st_v8f_splat(12582912.0f); /* 1.5 * 2^23 */
    const st_v8i tiny = x < lo;
    x = (st_v8f)(((st_v8i)x & ~tiny) | ((st_v8i)lo & tiny));
    const st_v8f t = x * st_v8f_splat(1.44269504088896341f) + magic; /* k in the low mantissa bits */
    const st_v8f k = t - magic;
    const st_v8f r = (x - k * st_v8f_splat(0.693359375f)) - k * st_v8f_splat(-2.12194440e-4f);
    st_v8f p = st_v8f_splat(1.9875691500e-4f);
    p = p * r + st_v8f_splat(1.3981999507e-3f);
    p = p * r + st_v8f_splat(8.3334519073e-3f);
    p = p * r + st_v8f_splat(4.1665795894e-2f);
    p = p * r + st_v8f_splat(1.6666665459e-1f);
    p = p * r + st_v8f_splat(5.0000001201e-1f);
    p = p * (r * r) + r + st_v8f_splat(1.0f);
    const st_v8i e = (((st_v8i)t - (st_v8i)magic) + 127) << 23;
    const st_v8f y = p * (st_v8f)e;
    return (st_v8f)((st_v8i)y & ~tiny);
}

/* Where the keys and values are: rows of n_kv_heads x hd elements of type t
 * (fp8 with one scale per (row, kv head)). */
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale; /* ST_KV_FP8 */
    int64_t n_kv_heads, hd;
} kv_src;

/* The widening of a row's 8 bf16 / fp8 values to 32-bit lanes, per build: the kernels take it as
 * an argument (a constant where inlined), so the AVX2 build uses one vpmovzx. GCC's code for the
 * portable forms depends on its version: GCC 12 made one vpmovzxwd of 8 lanes written one by one,
 * the GPU machine's compiler a movzwl / vpinsrd per lane (the Xeon's decode attention ran at
 * ~2.5 GB/s a core). */
typedef struct {
    st_v8u (*w16)(const uint16_t *p); /* 8 u16 at p, zero-extended */
    st_v8u (*w8)(const uint8_t *p);   /* 8 u8 at p, zero-extended */
    st_v8f (*splat)(float f);         /* f in 8 lanes (GCC 12's AVX2 code for the portable form: 4
                                         vinsertps and a vinsertf128, in the loops over the keys) */
} attn_isa;

ST_AI st_v8u w16_portable(const uint16_t *p) {
    st_v8u16 h;
    memcpy(&h, p, sizeof h);
    return st_v8u_from_u16(h);
}
ST_AI st_v8u w8_portable(const uint8_t *p) {
    st_v16u8 b = {0};
    memcpy(&b, p, 8);
    return st_v8u_from_u8(b);
}
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 ST_AI st_v8f splat_avx2(float f) { return (st_v8f)_mm256_set1_ps(f); }
ST_TARGET_AVX2 ST_AI st_v8u w16_avx2(const uint16_t *p) {
    return (st_v8u)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
ST_TARGET_AVX2 ST_AI st_v8u w8_avx2(const uint8_t *p) {
    return (st_v8u)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#endif

/* Values d .. d + m - 1 (m <= 8; zero in the lanes past m) of a row of type t,
 * as fp32: the exact conversions of backend.h. sc: the row's fp8 scale. */
ST_AI st_v8f kv_load(st_kv_dtype t, const void *row, st_v8f sc, int64_t d, int64_t m, attn_isa I) {
    switch (t) {
    case ST_KV_BF16: { /* bf16 -> fp32 is the bits shifted up */
        const uint16_t *p = (const uint16_t *)row + d;
        uint16_t tmp[8] = {0};
        if (m < 8) p = memcpy(tmp, p, (size_t)m * sizeof(uint16_t));
        return (st_v8f)(I.w16(p) << 16);
    }
    case ST_KV_FP8: { /* vector bit moves: lane by lane through a table was ~5x slower than bf16 */
        const uint8_t *p = (const uint8_t *)row + d;
        uint8_t tmp[8] = {0};
        if (m < 8) p = memcpy(tmp, p, (size_t)m);
        return st_v8f_from_e4m3(I.w8(p)) * sc;
    }
    case ST_KV_F32: break;
    }
    return m == 8 ? st_v8f_load((const float *)row + d) : st_v8f_load_part((const float *)row + d, m);
}

/* Bytes per element of type t (a constant where t is). */
ST_AI int64_t kv_esize(st_kv_dtype t) { return t == ST_KV_F32 ? 4 : t == ST_KV_BF16 ? 2 : 1; }

typedef float attn_v4f __attribute__((vector_size(16)));

/* st_v8f_hsum's sum, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), in 4-lane vector adds (the
 * same operations, so the same bits): GCC lowered st_v8f_hsum here to ~20 scalar operations per head
 * and key. */
ST_AI float attn_hsum(const st_v8f *v) {
    const attn_v4f lo = __builtin_shufflevector(*v, *v, 0, 1, 2, 3), hi = __builtin_shufflevector(*v, *v, 4, 5, 6, 7);
    const attn_v4f s = lo + hi;                                      /* l0+l4, l1+l5, l2+l6, l3+l7 */
    const attn_v4f t = s + __builtin_shufflevector(s, s, 2, 3, 0, 1); /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    return t[0] + t[1];
}

/* s[h * ld] = scale * dot(q + h * hd, row) for heads h < nh (nh <= ATTN_HEADS_BLOCK, a
 * constant where inlined), in cpu_simd.h's order; the row is read once. */
ST_AI void attn_dots(int nh, st_kv_dtype t, attn_isa I, const float *q, const void *row, st_v8f sc, int64_t hd,
                     float scale, float *s, int64_t ld) {
    st_v8f acc[ATTN_HEADS_BLOCK];
    #pragma GCC unroll 4
    for (int h = 0; h < nh; h++) acc[h] = st_v8f_splat(0.0f);
    int64_t d = 0;
    for (; d + 8 <= hd; d += 8) {
        const st_v8f kv = kv_load(t, row, sc, d, 8, I);
        #pragma GCC unroll 4
        for (int h = 0; h < nh; h++) acc[h] += st_v8f_load(q + h * hd + d) * kv;
    }
    if (d < hd) {
        const st_v8f kv = kv_load(t, row, sc, d, hd - d, I);
        #pragma GCC unroll 4
        for (int h = 0; h < nh; h++) acc[h] += st_v8f_load_part(q + h * hd + d, hd - d) * kv;
    }
    #pragma GCC unroll 4
    for (int h = 0; h < nh; h++) s[h * ld] = attn_hsum(&acc[h]) * scale;
}

/* o[h * hd + d .. + 8 * nc] = sum over the keys j < nk of p[h * ld + j] * v_j (element-wise: multiply,
 * then add, from 0, in increasing j) for heads h < nh and the nc (1 or 2,
 * constants where inlined) chunks of 8 values from d, m1 values in the last; the accumulators stay in
 * registers over the keys, so o is written once. rows[j]: key j's row index in src->v. */
ST_AI void attn_pv_chunks(int nh, int nc, st_kv_dtype t, attn_isa I, const kv_src *src, const int64_t *rows, int64_t nk,
                          const float *p, int64_t ld, float *o, int64_t hd, int64_t d, int64_t m1) {
    const int64_t row_bytes = hd * kv_esize(t);
    st_v8f a[ATTN_HEADS_BLOCK][2];
    #pragma GCC unroll 4
    for (int h = 0; h < nh; h++) a[h][0] = a[h][1] = st_v8f_splat(0.0f);
    for (int64_t j = 0; j < nk; j++) {
        const int64_t r = rows[j];
        const void *row = (const char *)src->v + r * row_bytes;
        const st_v8f sc = I.splat(t == ST_KV_FP8 ? src->v_scale[r] : 1.0f);
        st_v8f v[2];
        v[0] = kv_load(t, row, sc, d, nc == 1 ? m1 : 8, I);
        if (nc == 2) v[1] = kv_load(t, row, sc, d + 8, m1, I);
        #pragma GCC unroll 4
        for (int h = 0; h < nh; h++) { /* vector x scalar: GCC broadcasts it (a splat of 8 lanes became
                                          8 vinsertps in one of the unrolled heads) */
            const float ph = p[h * ld + j];
            a[h][0] += v[0] * ph;
            if (nc == 2) a[h][1] += v[1] * ph;
        }
    }
    #pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < nc; c++) {
            const int64_t m = c == nc - 1 ? m1 : 8;
            if (m == 8) ST_V8F_STORE(o + h * hd + d + 8 * c, a[h][c]);
            else memcpy(o + h * hd + d + 8 * c, &a[h][c], (size_t)m * sizeof(float));
        }
}

/* attn_pv_chunks over all hd values: 16 at a time, then the rest. */
ST_AI void attn_pv(int nh, st_kv_dtype t, attn_isa I, const kv_src *src, const int64_t *rows, int64_t nk, const float *p,
                   int64_t ld, float *o, int64_t hd) {
    int64_t d = 0;
    for (; d + 16 <= hd; d += 16) attn_pv_chunks(nh, 2, t, I, src, rows, nk, p, ld, o, hd, d, 8);
    if (hd - d > 8) attn_pv_chunks(nh, 2, t, I, src, rows, nk, p, ld, o, hd, d, hd - d - 8);
    else if (hd > d) attn_pv_chunks(nh, 1, t, I, src, rows, nk, p, ld, o, hd, d, hd - d);
}

/* The row of key j: j - base for a contiguous piece starting at key `base`
 * (table NULL), else the paged slot table[j / bs] * bs + j % bs. Walked key by
 * key from r0 without a division per key. */
typedef struct {
    const int32_t *table;
    int64_t bs, blk, off, row;
} row_iter;

ST_AI row_iter row_start(const int32_t *table, int64_t bs, int64_t base, int64_t r0) {
    row_iter it = {table, bs, 0, 0, r0 - base};
    if (table) {
        it.blk = r0 / bs;
        it.off = r0 % bs;
    }
    return it;
}
ST_AI int64_t row_next(row_iter *it) {
    if (!it->table) return it->row++;
    const int64_t r = (int64_t)it->table[it->blk] * it->bs + it->off;
    if (++it->off == it->bs) {
        it->off = 0;
        it->blk++;
    }
    return r;
}

/* Calls body(nh, h0) over the group's heads in blocks of at most
 * ATTN_HEADS_BLOCK, nh a constant in each call. */
#define ATTN_HEAD_BLOCKS(G, body)                                                                                 \
    do {                                                                                                          \
        int64_t h0_ = 0;                                                                                          \
        for (; h0_ + ATTN_HEADS_BLOCK <= (G); h0_ += ATTN_HEADS_BLOCK) body(ATTN_HEADS_BLOCK, h0_);              \
        switch ((G) - h0_) {                                                                                      \
        case 3: body(3, h0_); break;                                                                              \
        case 2: body(2, h0_); break;                                                                              \
        case 1: body(1, h0_); break;                                                                              \
        default: break;                                                                                           \
        }                                                                                                         \
    } while (0)

/* Keys [r0, r0 + nk[x]) (one range) for the G query heads q[x] ([G, hd]) of kv head kvh, for
 * the T tokens x < T of one sequence (T <= ATTN_TOKEN_BLOCK): o[x] ([G, hd]) their normalized
 * outputs, lse[x] ([G]) their log-sum-exps. Each key's K and V rows are read once for all the
 * tokens whose range holds it; each token's heads see exactly the operations of a range of
 * that token alone. s: [T * G * ST_ATTN_RANGE] scores; inv_z: [T * G] scratch. Rows as
 * row_start. */
ST_AI void attn_range(st_kv_dtype t, attn_isa I, const kv_src *src, int64_t kvh, int64_t G, int T, const float *const *q,
                      int64_t r0, const int64_t *nks, int64_t base, const int32_t *table, int64_t bs, float scale,
                      float *s, float *inv_z, float *const *o, float *const *lse) {
    const int64_t hd = src->hd, R = ST_ATTN_RANGE, nkv = src->n_kv_heads;
    int64_t nk = 0; /* the range's keys: the longest token's */
    for (int x = 0; x < T; x++) nk = nks[x] > nk ? nks[x] : nk;
    const int64_t row_bytes = hd * kv_esize(t);
    row_iter it = row_start(table, bs, base, r0);
    row_iter ahead = row_start(table, bs, base, r0); /* ATTN_PREFETCH keys ahead of `it` */
    for (int64_t j = 0; j < ATTN_PREFETCH && j < nk; j++) row_next(&ahead);
    for (int64_t j = 0; j < nk; j++) {
        const int64_t r = row_next(&it) * nkv + kvh;
        if (j + ATTN_PREFETCH < nk) { /* this K row and the V row are far in memory: fetch them early */
            const int64_t ra = row_next(&ahead) * nkv + kvh;
            for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch((const char *)src->k + ra * row_bytes + b);
                __builtin_prefetch((const char *)src->v + ra * row_bytes + b);
            }
        }
        const void *row = (const char *)src->k + r * row_bytes;
        const st_v8f sc = I.splat(t == ST_KV_FP8 ? src->k_scale[r] : 1.0f);
        for (int x = 0; x < T; x++) {
            if (j >= nks[x]) continue;
            float *sx = s + x * G * R;
#define DOTS(nh, h0) attn_dots(nh, t, I, q[x] + (h0) * hd, row, sc, hd, scale, sx + (h0) * R + j, R)
            ATTN_HEAD_BLOCKS(G, DOTS);
#undef DOTS
        }
    }
    for (int64_t xh = 0; xh < T * G; xh++) {
        const int64_t nkx = nks[xh / G];
        if (!nkx) continue; /* no key of this range for this token: nothing written */
        float *sh = s + xh * R, mx = -INFINITY;
        { /* the largest score, 8 lanes at a time (a max is exact: the lanes' order does not matter; a
           * NaN is never taken, as in the scalar loop). The scalar loop alone kept mx in memory, a
           * dependent load and store per key (~7% of the decode attention's time on the EPYC). */
            st_v8f mv = st_v8f_splat(-INFINITY);
            int64_t j = 0;
            for (; j + 8 <= nkx; j += 8) {
                const st_v8f v = st_v8f_load(sh + j);
                const st_v8i gt = (st_v8i)(v > mv);
                mv = (st_v8f)(((st_v8i)v & gt) | ((st_v8i)mv & ~gt));
            }
            for (int l = 0; l < 8; l++) mx = mv[l] > mx ? mv[l] : mx;
            for (; j < nkx; j++) mx = sh[j] > mx ? sh[j] : mx;
        }
        const st_v8f m = st_v8f_splat(mx);
        st_v8f zs = st_v8f_splat(0.0f);
        int64_t j = 0;
        for (; j + 8 <= nkx; j += 8) {
            const st_v8f x = st_v8f_load(sh + j) - m, p = attn_exp(&x);
            ST_V8F_STORE(sh + j, p);
            zs += p;
        }
        if (j < nkx) {
            const st_v8f x = st_v8f_load_part(sh + j, nkx - j) - m, p = attn_exp(&x);
            memcpy(sh + j, &p, (size_t)(nkx - j) * sizeof(float));
            for (int64_t l = 0; j + l < nkx; l++) zs[l] += p[l];
        }
        const float z = st_v8f_hsum(&zs);
        inv_z[xh] = 1.0f / z;
        lse[xh / G][xh % G] = mx + logf(z);
    }
    int64_t rows[ST_ATTN_RANGE]; /* the range's V rows, found once */
    it = row_start(table, bs, base, r0);
    for (int64_t j = 0; j < nk; j++) rows[j] = row_next(&it) * nkv + kvh;
    for (int x = 0; x < T; x++) {
        if (!nks[x]) continue;
        const float *sx = s + x * G * R;
#define PV(nh, h0) attn_pv(nh, t, I, src, rows, nks[x], sx + (h0) * R, R, o[x] + (h0) * hd, hd)
        ATTN_HEAD_BLOCKS(G, PV);
#undef PV
    }
    for (int64_t xh = 0; xh < T * G; xh++) {
        if (!nks[xh / G]) continue;
        const st_v8f iz = st_v8f_splat(inv_z[xh]);
        float *oh = o[xh / G] + (xh % G) * hd;
        int64_t d = 0;
        for (; d + 8 <= hd; d += 8) ST_V8F_STORE(oh + d, st_v8f_load(oh + d) * iz);
        for (; d < hd; d++) oh[d] = oh[d] * inv_z[xh];
    }
}

/* (o, *lse) <- the merge of (o, *lse) with a later range's (o_r, lse_r). */
static void attn_merge(float *o, float *lse, const float *o_r, float lse_r, int64_t hd) {
    const float m = *lse > lse_r ? *lse : lse_r, a = expf(*lse - m), b = expf(lse_r - m), inv = 1.0f / (a + b);
    for (int64_t d = 0; d < hd; d++) o[d] = (o[d] * a + o_r[d] * b) * inv;
    *lse = m + logf(a + b);
}

typedef struct {
    const float *q;
    kv_src src;
    st_kv_dtype t;                  /* of k and v */
    const int32_t *pos;
    int64_t n_heads, group, hd;
    float scale;
    float *out;
    float *lse;                     /* [n, n_heads] or NULL (attention_part) */
    int64_t key0;                   /* the first key of a contiguous piece (0 for `attention`) */
    int64_t key_end;                /* keys past the piece (key0 + n_kv; INT64_MAX when paged) */
    bool merge;                     /* attention_part: merge into out / lse */
    float *const *scratch;          /* per thread: attn_scratch floats */
    int64_t n;                      /* tokens */
    int64_t n_ranges;               /* split over the keys: ranges per item (0: not split) */
    int64_t n_groups;               /* split: items before the split (blocks x kv heads) */
    float *part;                    /* split: [items, n_ranges] blocks of ATTN_PART floats */
    /* paged (attention_paged): NULL tables for the contiguous ops */
    const int32_t *seq;             /* [n] token -> sequence */
    const int32_t *tables;          /* [n_seqs, max_blocks] */
    int64_t max_blocks, bs;
} attn_ctx;

/* One range's result in attn_ctx.part: G x hd outputs, then G log-sum-exps. */
#define ATTN_PART(a) ((a)->group * ((a)->hd + 1))

/* Scratch floats per thread, for a block of ATTN_TOKEN_BLOCK tokens: scores of one range for
 * their G heads each, then G x hd each (a range's outputs before a merge), then 3 x G each
 * (inv_z, lse, lse of a range). */
static size_t attn_scratch(int64_t G, int64_t hd) {
    return (size_t)(ATTN_TOKEN_BLOCK * G * (ST_ATTN_RANGE + hd + 3));
}

/* Keys of token i in this call: [key0, k1). */
ST_AI int64_t attn_k1(const attn_ctx *a, int64_t i) {
    return (int64_t)a->pos[i] + 1 < a->key_end ? (int64_t)a->pos[i] + 1 : a->key_end;
}

ST_AI const int32_t *attn_table(const attn_ctx *a, int64_t i) {
    return a->tables ? a->tables + (int64_t)a->seq[i] * a->max_blocks : NULL;
}

/* Tokens of block blk: [*i0, *i1); true when they share their rows (one sequence, or a
 * contiguous cache), so that one pass over the keys serves them all. */
ST_AI bool attn_block(const attn_ctx *a, int64_t n, int64_t blk, int64_t *i0, int64_t *i1) {
    *i0 = blk * ATTN_TOKEN_BLOCK;
    *i1 = *i0 + ATTN_TOKEN_BLOCK < n ? *i0 + ATTN_TOKEN_BLOCK : n;
    if (!a->tables) return true;
    for (int64_t i = *i0 + 1; i < *i1; i++)
        if (a->seq[i] != a->seq[*i0]) return false;
    return true;
}

/* Items [begin, end): (block of tokens, kv head) over all their keys, each token merging its
 * ranges in order, or (split) (block, kv head, range) into a->part. Tokens of a block that do
 * not share their rows go one at a time. */
ST_AI void attn_items_t(const attn_ctx *a, st_kv_dtype t, attn_isa I, int64_t begin, int64_t end, int ti) {
    const int64_t hd = a->hd, G = a->group, R = ST_ATTN_RANGE, nkv = a->src.n_kv_heads, TB = ATTN_TOKEN_BLOCK;
    float *s = a->scratch[ti], *tmp = s + TB * G * R, *inv_z = tmp + TB * G * hd, *l = inv_z + TB * G,
          *lr = l + TB * G;
    for (int64_t it = begin; it < end; it++) {
        /* split: range-major, so that the threads at work read the same keys' rows, each a different
         * kv head's part of them (kv head by kv head, a thread touched 1/n_kv_heads of every row it
         * read and the rows went through DRAM once per kv head) */
        const int64_t r = a->n_ranges ? it / a->n_groups : 0, ig = a->n_ranges ? it % a->n_groups : it;
        const int64_t blk = ig / nkv, g = ig % nkv;
        int64_t b0, b1;
        const bool shared = attn_block(a, a->n, blk, &b0, &b1);
        for (int64_t c0 = b0; c0 < b1;) { /* runs of tokens that share their rows: the block, or one */
            const int64_t c1 = shared ? b1 : c0 + 1;
            const int T = (int)(c1 - c0);
            const int32_t *table = attn_table(a, c0);
            const float *q[ATTN_TOKEN_BLOCK];
            float *o[ATTN_TOKEN_BLOCK], *lp[ATTN_TOKEN_BLOCK];
            int64_t k1[ATTN_TOKEN_BLOCK], nks[ATTN_TOKEN_BLOCK], kmax = a->key0;
            for (int x = 0; x < T; x++) {
                const int64_t i = c0 + x, h = i * a->n_heads + g * G;
                q[x] = a->q + h * hd;
                k1[x] = attn_k1(a, i);
                kmax = k1[x] > kmax ? k1[x] : kmax;
            }
            if (a->n_ranges) {
                const int64_t r0 = a->key0 + r * R;
                for (int x = 0; x < T; x++) {
                    const int64_t i = c0 + x, r1 = r0 + R < k1[x] ? r0 + R : k1[x];
                    nks[x] = r1 > r0 ? r1 - r0 : 0;
                    float *P = a->part + ((i * nkv + g) * a->n_ranges + r) * ATTN_PART(a);
                    o[x] = P, lp[x] = P + G * hd;
                }
                if (r0 < kmax)
                    attn_range(t, I, &a->src, g, G, T, q, r0, nks, a->key0, table, a->bs, a->scale, s, inv_z, o, lp);
                c0 = c1;
                continue;
            }
            bool have[ATTN_TOKEN_BLOCK];
            for (int x = 0; x < T; x++) {
                const int64_t h = (c0 + x) * a->n_heads + g * G;
                have[x] = a->merge;
                if (have[x])
                    for (int64_t y = 0; y < G; y++) l[x * G + y] = a->lse[h + y];
            }
            for (int64_t r0 = a->key0; r0 < kmax; r0 += R) {
                /* a token's first range straight into its outputs, later ones into tmp, then merged */
                for (int x = 0; x < T; x++) {
                    const int64_t h = (c0 + x) * a->n_heads + g * G, r1 = r0 + R < k1[x] ? r0 + R : k1[x];
                    nks[x] = r1 > r0 ? r1 - r0 : 0;
                    o[x] = have[x] ? tmp + x * G * hd : a->out + h * hd;
                    lp[x] = have[x] ? lr + x * G : l + x * G;
                }
                attn_range(t, I, &a->src, g, G, T, q, r0, nks, a->key0, table, a->bs, a->scale, s, inv_z, o, lp);
                for (int x = 0; x < T; x++) {
                    if (!nks[x]) continue;
                    if (have[x]) {
                        float *ox = a->out + ((c0 + x) * a->n_heads + g * G) * hd;
                        for (int64_t y = 0; y < G; y++)
                            attn_merge(ox + y * hd, &l[x * G + y], tmp + (x * G + y) * hd, lr[x * G + y], hd);
                    }
                    have[x] = true;
                }
            }
            if (a->lse)
                for (int x = 0; x < T; x++) {
                    const int64_t h = (c0 + x) * a->n_heads + g * G;
                    for (int64_t y = 0; y < G; y++) a->lse[h + y] = l[x * G + y];
                }
            c0 = c1;
        }
    }
}

ST_AI void attn_items(const attn_ctx *a, int64_t begin, int64_t end, int ti, attn_isa I) {
    switch (a->t) {
    case ST_KV_F32: attn_items_t(a, ST_KV_F32, I, begin, end, ti); break;
    case ST_KV_BF16: attn_items_t(a, ST_KV_BF16, I, begin, end, ti); break;
    case ST_KV_FP8: attn_items_t(a, ST_KV_FP8, I, begin, end, ti); break;
    }
}

static void attn_fn_generic(void *ctx, int64_t b, int64_t e, int ti) {
    attn_items(ctx, b, e, ti, (attn_isa){w16_portable, w8_portable, st_v8f_splat});
}
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 static void attn_fn_avx2(void *ctx, int64_t b, int64_t e, int ti) {
    attn_items(ctx, b, e, ti, (attn_isa){w16_avx2, w8_avx2, splat_avx2});
}
#endif

/* After a split run: each item's ranges merged in increasing order into out
 * (and lse), the operations attn_items_t performs unsplit; items [begin, end)
 * of the n x n_heads query heads, on the pool (one head's chain of merges on
 * one thread, so the bits do not depend on the threads). */
static void attn_merge_parts(void *ctx, int64_t begin, int64_t end, int ti) {
    (void)ti;
    const attn_ctx *a = ctx;
    const int64_t hd = a->hd, G = a->group, nkv = a->src.n_kv_heads, R = ST_ATTN_RANGE;
    for (int64_t ih = begin; ih < end; ih++) {
        const int64_t i = ih / a->n_heads, g = ih % a->n_heads / G, x = ih % G, h = i * a->n_heads + g * G;
        const int64_t nr = (attn_k1(a, i) - a->key0 + R - 1) / R;
        const float *P0 = a->part + (i * nkv + g) * a->n_ranges * ATTN_PART(a);
        float *o = a->out + (h + x) * hd, l = a->merge ? a->lse[h + x] : 0.0f;
        for (int64_t r = 0; r < nr; r++) {
            const float *P = P0 + r * ATTN_PART(a);
            if (r == 0 && !a->merge) {
                memcpy(o, P + x * hd, (size_t)hd * sizeof(float));
                l = P[G * hd + x];
            } else {
                attn_merge(o, &l, P + x * hd, P[G * hd + x], hd);
            }
        }
        if (a->lse) a->lse[h + x] = l;
    }
}

/* Runs the n x n_kv_heads items of `a` (keys up to max_k1, from a->key0) on
 * the pool, split over the keys when there are few: the AVX2 build where
 * enabled, else the portable one. */
static strata_status attn_run(st_cpu *c, attn_ctx *a, int64_t n, int64_t max_k1) {
    const int64_t nkv = a->src.n_kv_heads, R = ST_ATTN_RANGE;
    const int64_t n_blocks = (n + ATTN_TOKEN_BLOCK - 1) / ATTN_TOKEN_BLOCK, items = n_blocks * nkv;
    const int64_t n_ranges = (max_k1 - a->key0 + R - 1) / R;
    a->n = n;
    strata_status st = st_cpu_scratch_reserve(c, attn_scratch(a->group, a->hd));
    if (st != STRATA_OK) return st;
    a->scratch = c->scratch;
    int64_t n_items = items, keys = max_k1 - a->key0; /* keys of the largest item */
    if (n_ranges > 1 && (items < ATTN_ITEMS_PER_THREAD * c->n_threads || items <= ATTN_SPLIT_ITEMS)) {
        const size_t need = (size_t)(n * nkv * n_ranges * ATTN_PART(a)); /* per token */
        if (need > c->attn_part_floats) {
            float *p = NULL;
            if (posix_memalign((void **)&p, 64, need * sizeof(float)) != 0)
                return st_err(STRATA_ERR_NOMEM, "cpu attention: cannot allocate %zu bytes of range results",
                              need * sizeof(float));
            free(c->attn_part);
            c->attn_part = p;
            c->attn_part_floats = need;
        }
        a->n_ranges = n_ranges;
        a->n_groups = items;
        a->part = c->attn_part;
        n_items = items * n_ranges;
        keys = R;
    }
    int64_t grain = ATTN_GRAIN_MACS / (keys * (n < ATTN_TOKEN_BLOCK ? n : ATTN_TOKEN_BLOCK) * a->group * a->hd * 2 + 1);
    if (grain < 1) grain = 1;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->simd)
        st_pool_parallel_for(c->pool, n_items, grain, attn_fn_avx2, a);
    else
#endif
        st_pool_parallel_for(c->pool, n_items, grain, attn_fn_generic, a);
    if (a->n_ranges) /* a few thousand multiply-adds a chunk at least */
        st_pool_parallel_for(c->pool, n * a->n_heads, 1 + 2048 / (n_ranges * a->hd), attn_merge_parts, a);
    return STRATA_OK;
}

strata_status st_cpu_attention_part(st_cpu *c, const float *q, const float *k, const float *v, const int32_t *pos,
                                    int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                    int64_t head_dim, float scale, bool merge, float *out, float *lse) {
    attn_ctx a = {.q = q, .src = {.k = k, .v = v, .n_kv_heads = n_kv_heads, .hd = head_dim}, .t = ST_KV_F32,
                  .pos = pos, .n_heads = n_heads, .group = n_heads / n_kv_heads, .hd = head_dim, .scale = scale,
                  .out = out, .lse = lse, .key0 = key0, .key_end = key0 + n_kv, .merge = merge, .bs = 1};
    int64_t max_k1 = key0 + 1;
    for (int64_t i = 0; i < n; i++)
        if (attn_k1(&a, i) > max_k1) max_k1 = attn_k1(&a, i);
    return attn_run(c, &a, n, max_k1);
}

strata_status st_cpu_attention_rows(st_cpu *c, const float *q, const st_kv_layer *rows, const int32_t *pos,
                                    int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                    int64_t head_dim, float scale, bool merge, float *out, float *lse) {
    attn_ctx a = {.q = q, .t = rows->dtype, .pos = pos, .n_heads = n_heads, .group = n_heads / n_kv_heads,
                  .hd = head_dim, .scale = scale, .out = out, .lse = lse, .key0 = key0, .key_end = key0 + n_kv,
                  .merge = merge, .bs = 1};
    a.src = (kv_src){.k = rows->k, .v = rows->v, .k_scale = rows->k_scale, .v_scale = rows->v_scale,
                     .n_kv_heads = n_kv_heads, .hd = head_dim};
    int64_t max_k1 = key0 + 1;
    for (int64_t i = 0; i < n; i++)
        if (attn_k1(&a, i) > max_k1) max_k1 = attn_k1(&a, i);
    return attn_run(c, &a, n, max_k1);
}

void st_cpu_attn_merge(float *out, float *lse, const float *out2, const float *lse2, int64_t rows, int64_t hd) {
    for (int64_t r = 0; r < rows; r++) attn_merge(out + r * hd, lse + r, out2 + r * hd, lse2[r], hd);
}

strata_status st_cpu_attention(st_cpu *c, const float *q, const float *k, const float *v,
                               const int32_t *pos, int64_t n, int64_t n_kv, int64_t n_heads,
                               int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    return st_cpu_attention_part(c, q, k, v, pos, n, 0, n_kv, n_heads, n_kv_heads, head_dim, scale, false, out, NULL);
}

strata_status st_cpu_attention_paged(st_cpu *c, const float *q, const st_paged_kv *kv, const int32_t *seq,
                                     const int32_t *pos, int64_t n, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, float scale, float *out) {
    int64_t max_k1 = 1;
    for (int64_t i = 0; i < n; i++)
        if ((int64_t)pos[i] + 1 > max_k1) max_k1 = (int64_t)pos[i] + 1;
    const st_kv_layer *L = &kv->cache;
    attn_ctx a = {.q = q, .t = L->dtype, .pos = pos, .n_heads = n_heads, .group = n_heads / n_kv_heads,
                  .hd = head_dim, .scale = scale, .out = out, .key_end = INT64_MAX, .seq = seq,
                  .tables = kv->block_tables, .max_blocks = kv->max_blocks, .bs = kv->block_size};
    a.src = (kv_src){.k = L->k, .v = L->v, .k_scale = L->k_scale, .v_scale = L->v_scale,
                     .n_kv_heads = n_kv_heads, .hd = head_dim};
    return attn_run(c, &a, n, max_k1);
}

/* CPU causal grouped-query attention: of one sequence over a contiguous
 * cache (attention), over one piece of its keys merged into a running
 * result (attention_part), or of a batch of sequences over a paged cache
 * (attention_paged: the same items, each key's row found through its
 * sequence's block table, so the same bits for the same keys).
 *
 * Work item = (token i, head h), numbered i * n_heads + h so that the heads
 * sharing a KV head are neighbours (their keys stay in cache). An item's
 * keys are cut into ranges at the multiples of ST_ATTN_RANGE (from key 0);
 * each range [r0, r1) is a two-pass softmax in fp32, in the thread's scratch:
 *   s[j] = scale * dot(q_i,h, k_j)            j = r0..r1-1
 *   p[j] = exp(s[j] - max s);  Z = sum p      (lane order of cpu_simd.h)
 *   o    = (sum_j p[j] v_j) * (1 / Z)         (accumulated in increasing j)
 *   lse  = max s + log Z
 * and the ranges are merged in increasing order (backend.h, attention_part):
 *   M = max(lse, lse_r), a = exp(lse - M), b = exp(lse_r - M),
 *   o = (o a + o_r b) * (1 / (a + b)), lse = M + log(a + b).
 * The first range of a call without merge is assigned, not merged. So a
 * sequence of attention_part calls over consecutive pieces performs exactly
 * the operations of one call over all keys: the same bits. Each item runs on
 * one thread in this fixed order: results do not depend on the thread count.
 *
 * A paged cache in bf16 or fp8 (st_kv_layer): each key's K (then V) row of
 * the item's kv head is dequantized into the thread's scratch (exactly:
 * backend.h) before the same dot / axpy, so the bits equal those of an f32
 * cache holding the dequantized values. */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"

/* Where one work item's keys and values are: rows of kv head kvh in a cache of
 * `t` elements ([rows, n_kv_heads, hd], fp8 with one scale per (row, head)). */
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale; /* ST_KV_FP8 */
    const float *lut;               /* ST_KV_FP8: the 256 fp8 values as fp32 */
    st_kv_dtype t;
    int64_t kvh, n_kv_heads, hd;
} kv_src;

/* Row `row` of base (K or V of src) as hd fp32 values: a pointer into the
 * cache for f32, else `buf` holding the dequantized values. */
ST_AI const float *kv_row(const kv_src *src, const void *base, const float *scales, int64_t row, float *buf) {
    const int64_t r = row * src->n_kv_heads + src->kvh, hd = src->hd;
    switch (src->t) {
    case ST_KV_F32: break;
    case ST_KV_BF16: { /* bf16 -> fp32 is the bits shifted up: 8 lanes at a time */
        const uint16_t *p = (const uint16_t *)base + r * hd;
        int64_t d = 0;
        for (; d + 8 <= hd; d += 8) {
            st_v8u16 h;
            memcpy(&h, p + d, sizeof h);
            const st_v8u u = __builtin_convertvector(h, st_v8u) << 16;
            memcpy(buf + d, &u, sizeof u);
        }
        for (; d < hd; d++) {
            const uint32_t u = (uint32_t)p[d] << 16;
            memcpy(buf + d, &u, 4);
        }
        return buf;
    }
    case ST_KV_FP8: {
        const uint8_t *p = (const uint8_t *)base + r * hd;
        const float sc = scales[r];
        for (int64_t d = 0; d < hd; d++) buf[d] = src->lut[p[d]] * sc;
        return buf;
    }
    }
    return (const float *)base + r * hd;
}

/* Keys [r0, r1) of one work item (one range): query qv (hd floats)
 * against kv head src->kvh; key j's K and V rows are rows row(j) of the
 * cache, row(j) = j - base when table is NULL (a contiguous piece starting at
 * key `base`), else the paged slot table[j / bs] * bs + j % bs. s: [r1 - r0]
 * scores, acc, buf: [hd] scratch; o: [hd] output (normalized), *lse its
 * log-sum-exp. The arithmetic, and so the bits, do not depend on the layout
 * or on the element type (the values once dequantized). */
ST_AI void attn_range(const float *qv, const kv_src *src, int64_t r0, int64_t r1, int64_t base, const int32_t *table,
                      int64_t bs, float scale, float *s, float *acc, float *buf, float *o, float *lse) {
#define ROW(j) (table ? (int64_t)table[(j) / bs] * bs + (j) % bs : (j) - base)
    const int64_t hd = src->hd, nk = r1 - r0;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nk; j++) {
        s[j] = st_dot_f32(qv, kv_row(src, src->k, src->k_scale, ROW(r0 + j), buf), hd) * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    st_v8f zs = st_v8f_splat(0.0f);
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8) {
        st_v8f p;
        for (int l = 0; l < 8; l++) p[l] = expf(s[j + l] - mx);
        ST_V8F_STORE(s + j, p);
        zs += p;
    }
    for (int l = 0; j + l < nk; l++) {
        s[j + l] = expf(s[j + l] - mx);
        zs[l] += s[j + l];
    }
    const float z = st_v8f_hsum(&zs), inv_z = 1.0f / z;
    for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
    for (j = 0; j < nk; j++) st_axpy_f32(acc, s[j], kv_row(src, src->v, src->v_scale, ROW(r0 + j), buf), hd);
    for (int64_t d = 0; d < hd; d++) o[d] = acc[d] * inv_z;
    *lse = mx + logf(z);
#undef ROW
}

/* (o, *lse) <- the merge of (o, *lse) with a later range's (o_r, lse_r). */
ST_AI void attn_merge(float *o, float *lse, const float *o_r, float lse_r, int64_t hd) {
    const float m = *lse > lse_r ? *lse : lse_r, a = expf(*lse - m), b = expf(lse_r - m), inv = 1.0f / (a + b);
    for (int64_t d = 0; d < hd; d++) o[d] = (o[d] * a + o_r[d] * b) * inv;
    *lse = m + logf(a + b);
}

/* One work item over keys [k0, k1) (k0 a multiple of ST_ATTN_RANGE, or 0):
 * its ranges, merged into (o, *lse) when `merge` (they hold the result over
 * the keys before k0), else the first one assigned. lse may be NULL when
 * !merge. s: [ST_ATTN_RANGE] scores; acc, buf, tmp: [hd] scratch. */
ST_AI void attn_one(const float *qv, const kv_src *src, int64_t k0, int64_t k1, int64_t base, const int32_t *table,
                    int64_t bs, float scale, bool merge, float *s, float *acc, float *buf, float *tmp, float *o,
                    float *lse) {
    float l = merge ? *lse : 0.0f;
    bool have = merge;
    for (int64_t r0 = k0; r0 < k1;) {
        const int64_t r1 = (r0 / ST_ATTN_RANGE + 1) * ST_ATTN_RANGE < k1 ? (r0 / ST_ATTN_RANGE + 1) * ST_ATTN_RANGE : k1;
        if (!have) {
            attn_range(qv, src, r0, r1, base, table, bs, scale, s, acc, buf, o, &l);
            have = true;
        } else {
            float lr;
            attn_range(qv, src, r0, r1, base, table, bs, scale, s, acc, buf, tmp, &lr);
            attn_merge(o, &l, tmp, lr, src->hd);
        }
        r0 = r1;
    }
    if (lse) *lse = l;
}

typedef struct {
    const float *q;
    const void *k, *v;
    const float *k_scale, *v_scale; /* ST_KV_FP8 */
    st_kv_dtype t;                  /* of k and v */
    const int32_t *pos;
    int64_t n_heads, n_kv_heads, group, hd;
    float scale;
    float *out;
    float *lse;                     /* [n, n_heads] or NULL (attention_part) */
    int64_t key0;                   /* the first key of a contiguous piece (0 for `attention`) */
    int64_t key_end;                /* keys past the piece (key0 + n_kv; INT64_MAX when paged) */
    bool merge;                     /* attention_part: merge into out / lse */
    float *const *scratch;          /* per thread: ST_ATTN_RANGE scores | acc | buf | tmp (hd each) */
    /* paged (attention_paged): NULL tables for the contiguous op */
    const int32_t *seq;          /* [n] token -> sequence */
    const int32_t *tables;       /* [n_seqs, max_blocks] */
    int64_t max_blocks, bs;
    float fp8_lut[256]; /* ST_KV_FP8: st_kv_fp8_to_f32 of every byte */
} attn_ctx;

ST_AI void attn_items(const attn_ctx *a, int64_t begin, int64_t end, int ti) {
    const int64_t hd = a->hd;
    float *s = a->scratch[ti];
    float *acc = s + ST_ATTN_RANGE, *buf = acc + hd, *tmp = buf + hd;
    for (int64_t it = begin; it < end; it++) {
        const int64_t i = it / a->n_heads, h = it % a->n_heads;
        const kv_src src = {a->k, a->v, a->k_scale, a->v_scale, a->fp8_lut, a->t, h / a->group, a->n_kv_heads, hd};
        const int32_t *table = a->tables ? a->tables + (int64_t)a->seq[i] * a->max_blocks : NULL;
        const int64_t k1 = (int64_t)a->pos[i] + 1 < a->key_end ? (int64_t)a->pos[i] + 1 : a->key_end;
        attn_one(a->q + it * hd, &src, a->key0, k1, a->key0, table, a->bs, a->scale, a->merge, s, acc, buf, tmp,
                 a->out + it * hd, a->lse ? a->lse + it : NULL);
    }
}

static void attn_fn_generic(void *ctx, int64_t b, int64_t e, int ti) { attn_items(ctx, b, e, ti); }
#if ST_CPU_HAVE_AVX2_PATH
ST_TARGET_AVX2 static void attn_fn_avx2(void *ctx, int64_t b, int64_t e, int ti) {
    attn_items(ctx, b, e, ti);
}
#endif

/* Runs the n x n_heads work items of `a` on the pool: the AVX2 path where
 * built and enabled, else the generic one. Items read up to max_keys keys
 * (about max_keys / 2 on average for a causal prefill): ~64K floats per grain. */
static void attn_run(st_cpu *c, attn_ctx *a, int64_t n, int64_t max_keys) {
    const int64_t work = (max_keys / 2 + 1) * a->hd * 4;
    int64_t grain = 65536 / work;
    if (grain < 1) grain = 1;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->simd) {
        st_pool_parallel_for(c->pool, n * a->n_heads, grain, attn_fn_avx2, a);
        return;
    }
#endif
    st_pool_parallel_for(c->pool, n * a->n_heads, grain, attn_fn_generic, a);
}

/* Scratch floats per thread: the scores of one range, then acc, buf, tmp. */
static size_t attn_scratch(int64_t hd) { return (size_t)(ST_ATTN_RANGE + 3 * hd); }

strata_status st_cpu_attention_part(st_cpu *c, const float *q, const float *k, const float *v, const int32_t *pos,
                                    int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                    int64_t head_dim, float scale, bool merge, float *out, float *lse) {
    strata_status st = st_cpu_scratch_reserve(c, attn_scratch(head_dim));
    if (st != STRATA_OK) return st;
    attn_ctx a = {.q = q, .k = k, .v = v, .t = ST_KV_F32, .pos = pos, .n_heads = n_heads, .n_kv_heads = n_kv_heads,
                  .group = n_heads / n_kv_heads, .hd = head_dim, .scale = scale, .out = out, .lse = lse,
                  .key0 = key0, .key_end = key0 + n_kv, .merge = merge, .scratch = c->scratch, .bs = 1};
    attn_run(c, &a, n, n_kv);
    return STRATA_OK;
}

strata_status st_cpu_attention(st_cpu *c, const float *q, const float *k, const float *v,
                               const int32_t *pos, int64_t n, int64_t n_kv, int64_t n_heads,
                               int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    return st_cpu_attention_part(c, q, k, v, pos, n, 0, n_kv, n_heads, n_kv_heads, head_dim, scale, false, out, NULL);
}

strata_status st_cpu_attention_paged(st_cpu *c, const float *q, const st_paged_kv *kv, const int32_t *seq,
                                     const int32_t *pos, int64_t n, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, float scale, float *out) {
    int64_t max_nk = 1;
    for (int64_t i = 0; i < n; i++)
        if ((int64_t)pos[i] + 1 > max_nk) max_nk = (int64_t)pos[i] + 1;
    strata_status st = st_cpu_scratch_reserve(c, attn_scratch(head_dim));
    if (st != STRATA_OK) return st;
    const st_kv_layer *L = &kv->cache;
    attn_ctx a = {.q = q, .k = L->k, .v = L->v, .k_scale = L->k_scale, .v_scale = L->v_scale, .t = L->dtype,
                  .pos = pos, .n_heads = n_heads, .n_kv_heads = n_kv_heads, .group = n_heads / n_kv_heads,
                  .hd = head_dim, .scale = scale, .out = out, .key_end = INT64_MAX, .scratch = c->scratch,
                  .seq = seq, .tables = kv->block_tables, .max_blocks = kv->max_blocks, .bs = kv->block_size};
    if (L->dtype == ST_KV_FP8)
        for (int b = 0; b < 256; b++) a.fp8_lut[b] = st_kv_fp8_to_f32((uint8_t)b);
    attn_run(c, &a, n, max_nk);
    return STRATA_OK;
}

/* The CPU backend's paged-KV ops (backend.h: kv_store_paged, attention_paged):
 *  - kv_store_paged writes each token's K and V rows at its slot, skips -1,
 *    and rejects an out-of-range slot before writing anything;
 *  - attention_paged against a naive double-precision reference (1e-5), and
 *    bit for bit against the contiguous `attention` op run on each sequence's
 *    keys laid out contiguously (same arithmetic, gathered through the block
 *    table), for several head layouts (MHA, GQA 3 and 4, odd head_dim),
 *    shuffled physical blocks, block sizes 1, 16 and 7;
 *  - batch invariance: a token's output is bit-identical alone, in a batch of
 *    other sequences (in any order), with 1 or 3 worker threads (a token
 *    alone over several ranges of keys on 3 threads: split over its keys),
 *    and with the portable or the AVX2 build of the kernels;
 *  - argument checks: a bad sequence index, a position beyond its
 *    sequence's keys, a block id outside the pool, ctx_lens above max_ctx.
 * For each KV element type (st_kv_dtype: f32, bf16, fp8):
 *  - the conversions against known values (1, 0.1, 448, saturation, e4m3
 *    subnormals, -0, NaN, ties to even) and every fp8 code round trip;
 *  - kv_store_paged stores exactly those conversions, fp8 with its own scale
 *    per (slot, kv head) row;
 *  - attention_paged over a bf16 / fp8 pool gives the bits of the f32 path
 *    over the dequantized values (the naive reference over them within 1e-5,
 *    the contiguous op bit for bit), is batch invariant as above, and stays
 *    within a stated bound of the attention over the unrounded fp32 keys
 *    (max|err| / max|out| per token, worst case over these batches: bf16
 *    measured 3.9e-3, bound 1e-2; fp8 measured 5.8e-2, bound 8e-2: e4m3
 *    keeps 3 mantissa bits, a relative step of up to 1/16 per value).
 * The CUDA backend runs the same ops against this one in
 * tests/gpu/gpu_check_ops.c. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_internal.h"
#include "testutil.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static float f32_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* The conversions against values worked out by hand. */
static void test_conversions(void) {
    /* names and sizes */
    st_kv_dtype t = ST_KV_F32;
    CHECK(st_kv_dtype_parse("bf16", &t) && t == ST_KV_BF16);
    CHECK(st_kv_dtype_parse("fp8", &t) && t == ST_KV_FP8);
    CHECK(st_kv_dtype_parse("f32", &t) && t == ST_KV_F32);
    CHECK(!st_kv_dtype_parse("fp16", &t) && !st_kv_dtype_parse("BF16", &t) && !st_kv_dtype_parse("", &t) &&
          !st_kv_dtype_parse(NULL, &t));
    CHECK(strcmp(st_kv_dtype_name(ST_KV_BF16), "bf16") == 0 && strcmp(st_kv_dtype_name(ST_KV_FP8), "fp8") == 0 &&
          strcmp(st_kv_dtype_name(ST_KV_F32), "f32") == 0);
    CHECK(st_kv_dtype_size(ST_KV_F32) == 4 && st_kv_dtype_size(ST_KV_BF16) == 2 && st_kv_dtype_size(ST_KV_FP8) == 1);

    /* bf16: round to nearest, ties to even */
    static const struct { uint32_t in; uint16_t out; } bf[] = {
        {0x3f800000u, 0x3f80}, /* 1 */
        {0x3dcccccdu, 0x3dcd}, /* 0.1: lower half 0xcccd > 0x8000 rounds up */
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: a tie, to the even 0x3f80 */
        {0x3f818000u, 0x3f82}, /* a tie, to the even 0x3f82 */
        {0x3f817fffu, 0x3f81}, /* just below a tie */
        {0x80000000u, 0x8000}, /* -0 */
        {0x7f800000u, 0x7f80}, /* inf */
        {0xff800000u, 0xff80}, /* -inf */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x00000001u, 0x0000}, /* the smallest subnormal rounds to 0 */
        {0x00018000u, 0x0002}, /* subnormal tie, to even */
        {0xc0490fdbu, 0xc049}, /* -pi */
    };
    for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++) {
        const uint16_t got = st_kv_f32_to_bf16(f32_of(bf[i].in));
        CHECK_MSG(got == bf[i].out, "bf16(0x%08x) = 0x%04x, want 0x%04x", bf[i].in, got, bf[i].out);
    }
    CHECK(isnan(st_kv_bf16_to_f32(st_kv_f32_to_bf16(NAN))) && st_kv_f32_to_bf16(NAN) == 0x7fff);
    CHECK(st_kv_f32_to_bf16(f32_of(0xffc00001u)) == 0x7fff); /* any NaN: the canonical one */
    for (uint32_t b = 0; b < 65536; b++) { /* every non-NaN bf16 comes back unchanged */
        const float x = st_kv_bf16_to_f32((uint16_t)b);
        if (!isnan(x)) CHECK_MSG(st_kv_f32_to_bf16(x) == b, "bf16 0x%04x does not round trip", b);
    }

    /* fp8 e4m3fn */
    static const struct { float in; uint8_t out; } f8[] = {
        {1.0f, 0x38},
        {0.1f, 0x1d},           /* 1.6 x 2^-4: mantissa 4.8/8 rounds to 5 -> 0.1015625 */
        {448.0f, 0x7e},         /* the largest finite */
        {500.0f, 0x7e},         /* saturates */
        {464.0f, 0x7e},         /* the tie between 448 and (unrepresentable) 480: saturates */
        {-500.0f, 0xfe},
        {INFINITY, 0x7e},       /* satfinite: infinities to +-448 */
        {-INFINITY, 0xfe},
        {1.0625f, 0x38},        /* a tie between 1 and 1.125: to even */
        {1.1875f, 0x3a},        /* a tie between 1.125 and 1.25: to even */
        {0.001953125f, 0x01},   /* 2^-9: the smallest subnormal */
        {0.005859375f, 0x03},   /* 3 x 2^-9 */
        {0.0009765625f, 0x00},  /* 2^-10: the tie between 0 and 2^-9, to even */
        {0.0029296875f, 0x02},  /* 1.5 x 2^-9: a tie, to even 2 */
        {0.0146484375f, 0x08},  /* 7.5 x 2^-9: a tie, to even 8 = 2^-6 (the smallest normal) */
        {0.013671875f, 0x07},   /* 7 x 2^-9: the largest subnormal */
        {0.015625f, 0x08},      /* 2^-6 */
        {-0.0f, 0x80},
        {0.0f, 0x00},
        {1e-30f, 0x00},
        {-3.0f, 0xc4},          /* -1.5 x 2^1 */
        {240.0f, 0x77},         /* 1.875 x 2^7 */
    };
    for (size_t i = 0; i < sizeof f8 / sizeof f8[0]; i++) {
        const uint8_t got = st_kv_f32_to_fp8(f8[i].in);
        CHECK_MSG(got == f8[i].out, "fp8(%.9g) = 0x%02x, want 0x%02x", (double)f8[i].in, got, f8[i].out);
    }
    CHECK(st_kv_f32_to_fp8(NAN) == 0x7f && st_kv_f32_to_fp8(-NAN) == 0x7f);
    CHECK(isnan(st_kv_fp8_to_f32(0x7f)) && isnan(st_kv_fp8_to_f32(0xff)));
    CHECK(st_kv_fp8_to_f32(0x7e) == 448.0f && st_kv_fp8_to_f32(0x01) == 0.001953125f &&
          st_kv_fp8_to_f32(0x1d) == 0.1015625f && st_kv_fp8_to_f32(0xc4) == -3.0f);
    CHECK(signbit(st_kv_fp8_to_f32(0x80)) && st_kv_fp8_to_f32(0x80) == 0.0f);
    for (int b = 0; b < 256; b++) { /* every non-NaN code comes back unchanged */
        const float x = st_kv_fp8_to_f32((uint8_t)b);
        if (!isnan(x)) CHECK_MSG(st_kv_f32_to_fp8(x) == b, "fp8 0x%02x (%g) does not round trip", b, (double)x);
    }
    /* values between neighbouring codes go to the nearer one */
    for (int b = 0; b < 0x7e; b++) {
        const float lo = st_kv_fp8_to_f32((uint8_t)b), hi = st_kv_fp8_to_f32((uint8_t)(b + 1));
        const float below = nextafterf(lo + (hi - lo) / 2, -INFINITY), above = nextafterf(lo + (hi - lo) / 2, INFINITY);
        CHECK_MSG(st_kv_f32_to_fp8(below) == b && st_kv_f32_to_fp8(above) == b + 1, "fp8 between 0x%02x and 0x%02x",
                  b, b + 1);
    }
    /* row scales */
    const float r1[4] = {1.0f, -896.0f, 3.0f, NAN}, r0[3] = {0.0f, -0.0f, 0.0f};
    CHECK(st_kv_fp8_row_scale(r1, 4) == 2.0f); /* NaN ignored */
    CHECK(st_kv_fp8_row_scale(r0, 3) == 1.0f);
    const float tiny[1] = {FLT_TRUE_MIN}; /* max / 448 underflows to 0: scale 1 */
    CHECK(st_kv_fp8_row_scale(tiny, 1) == 1.0f);
}

/* A layer of n_slots x H x hd elements of t (host memory: the CPU backend's
 * device memory), filled with random bytes. */
static st_kv_layer layer_make(st_kv_dtype t, int64_t n_slots, int64_t H, int64_t hd) {
    const size_t n = (size_t)(n_slots * H * hd), bytes = n * st_kv_dtype_size(t);
    st_kv_layer L = {.k = malloc(bytes), .v = malloc(bytes), .dtype = t, .n_slots = n_slots, .n_kv_heads = H,
                     .head_dim = hd};
    for (size_t i = 0; i < bytes; i++) ((uint8_t *)L.k)[i] = (uint8_t)test_rand_u32(&g_rng);
    for (size_t i = 0; i < bytes; i++) ((uint8_t *)L.v)[i] = (uint8_t)test_rand_u32(&g_rng);
    if (t == ST_KV_F32) /* finite garbage */
        for (size_t i = 0; i < n; i++) ((float *)L.k)[i] = ((float *)L.v)[i] = (float)(i % 13) - 6.0f;
    if (t == ST_KV_FP8) {
        L.k_scale = malloc((size_t)(n_slots * H) * sizeof(float));
        L.v_scale = malloc((size_t)(n_slots * H) * sizeof(float));
        for (int64_t i = 0; i < n_slots * H; i++) L.k_scale[i] = L.v_scale[i] = 0.5f;
    }
    return L;
}

static void layer_free(st_kv_layer *L) { free(L->k), free(L->v), free(L->k_scale), free(L->v_scale); }

static size_t layer_bytes(const st_kv_layer *L) {
    return (size_t)(L->n_slots * L->n_kv_heads * L->head_dim) * st_kv_dtype_size(L->dtype);
}

/* Element i of K or V of L dequantized (backend.h: exact). */
static float layer_get(const st_kv_layer *L, bool v, int64_t i) {
    const void *p = v ? L->v : L->k;
    switch (L->dtype) {
    case ST_KV_F32: return ((const float *)p)[i];
    case ST_KV_BF16: return f32_of((uint32_t)((const uint16_t *)p)[i] << 16);
    case ST_KV_FP8: return st_kv_fp8_to_f32(((const uint8_t *)p)[i]) * (v ? L->v_scale : L->k_scale)[i / L->head_dim];
    }
    return NAN;
}

/* kv_store_paged writes its rows (as the conversions give them, fp8 with the
 * row's own scale), skips -1, and checks every slot before writing. */
static void test_kv_store(st_backend *be, st_kv_dtype t) {
    const int64_t n_slots = 40, H = 3, hd = 4, cols = H * hd, n = 5;
    st_kv_layer L = layer_make(t, n_slots, H, hd);
    const size_t bytes = layer_bytes(&L);
    uint8_t *k0 = malloc(bytes), *v0 = malloc(bytes);
    memcpy(k0, L.k, bytes);
    memcpy(v0, L.v, bytes);
    float *k = test_rand_floats(&g_rng, n * cols, 2.0f), *v = test_rand_floats(&g_rng, n * cols, 2.0f);
    /* heads of very different magnitudes (each fp8 row gets its own scale), a zero row */
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < cols; c++) k[i * cols + c] *= c / hd == 0 ? 1e-3f : c / hd == 1 ? 50.0f : 1.0f;
    for (int64_t c = 0; c < hd; c++) v[2 * cols + hd + c] = 0.0f; /* token 2 (slot 0), head 1 of V */
    const int64_t slots[5] = {39, -1, 0, 17, 18};
    CHECK(be->ops->kv_store_paged(be, NULL, &L, k, v, slots, n) == STRATA_OK);
    const size_t es = st_kv_dtype_size(t), rowb = (size_t)hd * es;
    for (int64_t r = 0; r < n_slots; r++) {
        int64_t src = -1;
        for (int64_t i = 0; i < n; i++)
            if (slots[i] == r) src = i;
        for (int64_t h = 0; h < H; h++) {
            const size_t off = (size_t)(r * H + h) * rowb;
            if (src < 0) {
                CHECK_MSG(memcmp((uint8_t *)L.k + off, k0 + off, rowb) == 0 &&
                              memcmp((uint8_t *)L.v + off, v0 + off, rowb) == 0,
                          "%s: row (%lld, %lld) was written", st_kv_dtype_name(t), (long long)r, (long long)h);
                continue;
            }
            for (int kvi = 0; kvi < 2; kvi++) {
                const float *x = (kvi ? v : k) + src * cols + h * hd;
                const void *base = kvi ? L.v : L.k;
                float sc = 1.0f, mx = 0.0f;
                if (t == ST_KV_FP8) {
                    for (int64_t d = 0; d < hd; d++) mx = fabsf(x[d]) > mx ? fabsf(x[d]) : mx;
                    sc = mx > 0.0f ? mx / 448.0f : 1.0f;
                    const float got = (kvi ? L.v_scale : L.k_scale)[r * H + h];
                    CHECK_MSG(got == sc, "fp8 %c scale of (slot %lld, head %lld) = %g, want %g", kvi ? 'V' : 'K',
                              (long long)r, (long long)h, (double)got, (double)sc);
                }
                for (int64_t d = 0; d < hd; d++) {
                    const int64_t e = (r * H + h) * hd + d;
                    bool ok;
                    switch (t) {
                    case ST_KV_F32: ok = ((const float *)base)[e] == x[d]; break;
                    case ST_KV_BF16: ok = ((const uint16_t *)base)[e] == st_kv_f32_to_bf16(x[d]); break;
                    default: ok = ((const uint8_t *)base)[e] == st_kv_f32_to_fp8(x[d] / sc); break;
                    }
                    CHECK_MSG(ok, "%s: %c (slot %lld, head %lld, dim %lld)", st_kv_dtype_name(t), kvi ? 'V' : 'K',
                              (long long)r, (long long)h, (long long)d);
                    /* the dequantized value is close to the stored one */
                    const float back = layer_get(&L, kvi, e);
                    const float tol = t == ST_KV_F32 ? 0.0f : t == ST_KV_BF16 ? fabsf(x[d]) / 256 : sc * 16;
                    CHECK_MSG(fabsf(back - x[d]) <= tol, "%s: %g stored as %g", st_kv_dtype_name(t), (double)x[d],
                              (double)back);
                }
                if (t == ST_KV_FP8 && mx > 0.0f) { /* the row's largest value maps to +-448 (or just below) */
                    int big = 0;
                    for (int64_t d = 0; d < hd; d++) big |= (((const uint8_t *)base)[(r * H + h) * hd + d] & 0x7f) >= 0x7d;
                    CHECK_MSG(big, "fp8 row (slot %lld, head %lld) does not use its range", (long long)r, (long long)h);
                }
            }
        }
    }
    if (t == ST_KV_FP8) { /* the zero row: scale 1, zero bytes */
        CHECK(L.v_scale[0 * H + 1] == 1.0f);
        for (int64_t d = 0; d < hd; d++) CHECK(((const uint8_t *)L.v)[(0 * H + 1) * hd + d] == 0);
    }
    {   /* kv_gather: rows of any slots (repeats too) back as fp32, the values attention reads, bit for bit */
        const int32_t ids[6] = {39, 0, 17, 5, 39, 18};
        float *gk = malloc(6 * (size_t)cols * sizeof(float)), *gv = malloc(6 * (size_t)cols * sizeof(float));
        CHECK(be->ops->kv_gather(be, NULL, &L, ids, 6, gk, gv) == STRATA_OK);
        int bad_at = -1;
        for (int64_t i = 0; i < 6 && bad_at < 0; i++)
            for (int64_t c = 0; c < cols; c++) {
                const int64_t e = (int64_t)ids[i] * cols + c;
                const float wk = layer_get(&L, false, e), wv = layer_get(&L, true, e);
                if (memcmp(&gk[i * cols + c], &wk, 4) || memcmp(&gv[i * cols + c], &wv, 4)) bad_at = (int)i;
            }
        CHECK_MSG(bad_at < 0, "%s: kv_gather row %d differs from the dequantized cache", st_kv_dtype_name(t), bad_at);
        const int32_t out[2] = {3, 40};
        memset(gk, 0, 6 * (size_t)cols * sizeof(float));
        CHECK_ERR(be->ops->kv_gather(be, NULL, &L, out, 2, gk, gv), STRATA_ERR_INVALID_ARG, "ids[1] = 40");
        CHECK(gk[0] == 0.0f); /* nothing written */
        free(gk), free(gv);
    }
    memcpy(k0, L.k, bytes);
    const int64_t bad[2] = {3, 40};
    CHECK_ERR(be->ops->kv_store_paged(be, NULL, &L, k, v, bad, 2), STRATA_ERR_INVALID_ARG, "slots[1] = 40");
    const int64_t neg[1] = {-2};
    CHECK_ERR(be->ops->kv_store_paged(be, NULL, &L, k, v, neg, 1), STRATA_ERR_INVALID_ARG, "outside");
    CHECK(memcmp(L.k, k0, bytes) == 0); /* nothing written */
    CHECK(be->ops->kv_store_paged(be, NULL, &L, k, v, slots, 0) == STRATA_OK);
    layer_free(&L);
    free(k0), free(v0), free(k), free(v);
}

/* A batch: n_seqs sequences of ctx[s] keys each, scattered over a pool of
 * shuffled blocks; tokens: for each sequence its last nq[s] positions. */
typedef struct {
    int64_t H, Hkv, hd, bs, n_seqs, max_blocks, n_slots, n;
    float *kc, *vc;       /* pool [n_slots, Hkv*hd] */
    float **kseq, **vseq; /* contiguous per sequence [ctx, Hkv*hd] */
    int32_t *tables, *ctx;
    int32_t *seq, *pos;   /* [n] */
    float *q;             /* [n, H, hd] */
    int64_t max_ctx;
} batch;

static void batch_make(batch *b, int64_t H, int64_t Hkv, int64_t hd, int64_t bs, int64_t n_seqs, const int32_t *ctx,
                       const int32_t *nq) {
    memset(b, 0, sizeof *b);
    b->H = H, b->Hkv = Hkv, b->hd = hd, b->bs = bs, b->n_seqs = n_seqs;
    const int64_t kvd = Hkv * hd;
    int64_t total_blocks = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t nb = (ctx[s] + bs - 1) / bs;
        total_blocks += nb;
        if (nb > b->max_blocks) b->max_blocks = nb;
        if (ctx[s] > b->max_ctx) b->max_ctx = ctx[s];
        b->n += nq[s];
    }
    total_blocks += 3; /* unused blocks in the pool */
    b->n_slots = total_blocks * bs;
    b->kc = test_rand_floats(&g_rng, b->n_slots * kvd, 1.0f); /* garbage where no sequence lives */
    b->vc = test_rand_floats(&g_rng, b->n_slots * kvd, 1.0f);
    /* a random permutation of the physical blocks */
    int32_t *perm = malloc((size_t)total_blocks * sizeof(int32_t));
    for (int64_t i = 0; i < total_blocks; i++) perm[i] = (int32_t)i;
    for (int64_t i = total_blocks - 1; i > 0; i--) {
        const int64_t j = test_rand_u32(&g_rng) % (uint32_t)(i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    b->tables = malloc((size_t)(n_seqs * b->max_blocks) * sizeof(int32_t));
    for (int64_t i = 0; i < n_seqs * b->max_blocks; i++) b->tables[i] = -7; /* never read */
    b->ctx = malloc((size_t)n_seqs * sizeof(int32_t));
    b->kseq = calloc((size_t)n_seqs, sizeof(float *));
    b->vseq = calloc((size_t)n_seqs, sizeof(float *));
    b->seq = malloc((size_t)b->n * sizeof(int32_t));
    b->pos = malloc((size_t)b->n * sizeof(int32_t));
    int64_t next = 0, t = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        b->ctx[s] = ctx[s];
        b->kseq[s] = test_rand_floats(&g_rng, ctx[s] * kvd, 1.0f);
        b->vseq[s] = test_rand_floats(&g_rng, ctx[s] * kvd, 1.0f);
        for (int64_t blk = 0; blk < (ctx[s] + bs - 1) / bs; blk++) b->tables[s * b->max_blocks + blk] = perm[next++];
        for (int64_t j = 0; j < ctx[s]; j++) {
            const int64_t slot = (int64_t)b->tables[s * b->max_blocks + j / bs] * bs + j % bs;
            memcpy(b->kc + slot * kvd, b->kseq[s] + j * kvd, (size_t)kvd * sizeof(float));
            memcpy(b->vc + slot * kvd, b->vseq[s] + j * kvd, (size_t)kvd * sizeof(float));
        }
        for (int64_t i = 0; i < nq[s]; i++, t++) {
            b->seq[t] = (int32_t)s;
            b->pos[t] = (int32_t)(ctx[s] - nq[s] + i);
        }
    }
    b->q = test_rand_floats(&g_rng, b->n * H * hd, 2.0f);
    free(perm);
}

static void batch_free(batch *b) {
    for (int64_t s = 0; s < b->n_seqs; s++) free(b->kseq[s]), free(b->vseq[s]);
    free(b->kseq), free(b->vseq), free(b->kc), free(b->vc), free(b->tables), free(b->ctx), free(b->seq),
        free(b->pos), free(b->q);
}

static st_paged_kv batch_kv(const batch *b) {
    return (st_paged_kv){.cache = {.k = b->kc, .v = b->vc, .dtype = ST_KV_F32, .n_slots = b->n_slots,
                                   .n_kv_heads = b->Hkv, .head_dim = b->hd},
                         .block_size = b->bs,
                         .block_tables = b->tables, .max_blocks = b->max_blocks, .ctx_lens = b->ctx,
                         .n_seqs = b->n_seqs, .max_ctx = b->max_ctx};
}

/* out[H, hd] for token t by the definition, in double. */
static void naive_token(const batch *b, int64_t t, float scale, double *out) {
    const int64_t s = b->seq[t], nk = b->pos[t] + 1, kvd = b->Hkv * b->hd, G = b->H / b->Hkv;
    double *p = malloc((size_t)nk * sizeof(double));
    for (int64_t h = 0; h < b->H; h++) {
        const float *qv = b->q + (t * b->H + h) * b->hd;
        const int64_t kvh = h / G;
        double mx = -INFINITY, z = 0;
        for (int64_t j = 0; j < nk; j++) {
            double d = 0;
            for (int64_t c = 0; c < b->hd; c++) d += (double)qv[c] * b->kseq[s][j * kvd + kvh * b->hd + c];
            p[j] = d * scale;
            if (p[j] > mx) mx = p[j];
        }
        for (int64_t j = 0; j < nk; j++) z += (p[j] = exp(p[j] - mx));
        for (int64_t c = 0; c < b->hd; c++) {
            double a = 0;
            for (int64_t j = 0; j < nk; j++) a += p[j] * b->vseq[s][j * kvd + kvh * b->hd + c];
            out[h * b->hd + c] = a / z;
        }
    }
    free(p);
}

/* Worst errors of the bf16 / fp8 paths against the attention over the
 * unrounded keys, over every case (printed at the end). */
static double g_worst_q[3];

/* The pool of b stored as t through kv_store_paged (every slot, garbage
 * included); b's pools and per-sequence keys then hold the dequantized
 * values, and *uk / *uv get the previous per-sequence K / V arrays. */
static st_kv_layer batch_quantize(st_backend *be, batch *b, st_kv_dtype t, float ***uk, float ***uv) {
    const int64_t kvd = b->Hkv * b->hd;
    st_kv_layer L = layer_make(t, b->n_slots, b->Hkv, b->hd);
    int64_t *slots = malloc((size_t)b->n_slots * sizeof(int64_t));
    for (int64_t i = 0; i < b->n_slots; i++) slots[i] = b->n_slots - 1 - i; /* any order */
    float *rk = malloc((size_t)(b->n_slots * kvd) * sizeof(float)), *rv = malloc((size_t)(b->n_slots * kvd) * sizeof(float));
    for (int64_t i = 0; i < b->n_slots; i++) {
        memcpy(rk + i * kvd, b->kc + slots[i] * kvd, (size_t)kvd * sizeof(float));
        memcpy(rv + i * kvd, b->vc + slots[i] * kvd, (size_t)kvd * sizeof(float));
    }
    CHECK_MSG(be->ops->kv_store_paged(be, NULL, &L, rk, rv, slots, b->n_slots) == STRATA_OK, "%s", st_last_error());
    for (int64_t i = 0; i < b->n_slots * kvd; i++) b->kc[i] = layer_get(&L, false, i), b->vc[i] = layer_get(&L, true, i);
    *uk = b->kseq, *uv = b->vseq;
    b->kseq = calloc((size_t)b->n_seqs, sizeof(float *));
    b->vseq = calloc((size_t)b->n_seqs, sizeof(float *));
    for (int64_t s = 0; s < b->n_seqs; s++) {
        b->kseq[s] = malloc((size_t)(b->ctx[s] * kvd) * sizeof(float));
        b->vseq[s] = malloc((size_t)(b->ctx[s] * kvd) * sizeof(float));
        for (int64_t j = 0; j < b->ctx[s]; j++) {
            const int64_t slot = (int64_t)b->tables[s * b->max_blocks + j / b->bs] * b->bs + j % b->bs;
            memcpy(b->kseq[s] + j * kvd, b->kc + slot * kvd, (size_t)kvd * sizeof(float));
            memcpy(b->vseq[s] + j * kvd, b->vc + slot * kvd, (size_t)kvd * sizeof(float));
        }
    }
    free(slots), free(rk), free(rv);
    return L;
}

static void check_paged(st_backend *be, st_backend *be3, st_kv_dtype kt, int64_t H, int64_t Hkv, int64_t hd,
                        int64_t bs, int64_t n_seqs, const int32_t *ctx, const int32_t *nq) {
    batch b;
    batch_make(&b, H, Hkv, hd, bs, n_seqs, ctx, nq);
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t row = H * hd;
    st_paged_kv kv = batch_kv(&b);
    st_kv_layer L = {0};
    float **uk = NULL, **uv = NULL; /* the unrounded keys */
    if (kt != ST_KV_F32) {
        L = batch_quantize(be, &b, kt, &uk, &uv);
        kv.cache = L;
    }
    float *out = malloc((size_t)(b.n * row) * sizeof(float));
    float *alt = malloc((size_t)(b.n * row) * sizeof(float));
    float *one = malloc((size_t)row * sizeof(float));
    double *ref = malloc((size_t)row * sizeof(double));
    strata_status st = be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, H, Hkv, hd, scale, out);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    /* naive reference */
    double worst = 0;
    for (int64_t t = 0; t < b.n; t++) {
        naive_token(&b, t, scale, ref);
        for (int64_t i = 0; i < row; i++) {
            const double e = fabs(out[t * row + i] - ref[i]);
            if (!(e <= worst)) worst = e;
        }
    }
    CHECK_MSG(worst <= 1e-5, "%s H %lld/%lld hd %lld bs %lld: max err %.3g vs the naive reference",
              st_kv_dtype_name(kt), (long long)H, (long long)Hkv, (long long)hd, (long long)bs, worst);
    if (kt != ST_KV_F32) {
        /* the f32 path over the dequantized pool: the same bits */
        const st_paged_kv kf = batch_kv(&b);
        CHECK(be->ops->attention_paged(be, NULL, b.q, &kf, b.seq, b.pos, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
        CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0, "%s != f32 over its values",
                  st_kv_dtype_name(kt));
        /* against the unrounded keys: |err| <= bound x max|ref| of the token */
        float **rk = b.kseq, **rv = b.vseq;
        b.kseq = uk, b.vseq = uv;
        double rel = 0;
        for (int64_t t = 0; t < b.n; t++) {
            naive_token(&b, t, scale, ref);
            double mref = 0, merr = 0;
            for (int64_t i = 0; i < row; i++) {
                mref = fmax(mref, fabs(ref[i]));
                merr = fmax(merr, fabs(out[t * row + i] - ref[i]));
            }
            rel = fmax(rel, merr / mref);
        }
        g_worst_q[kt] = fmax(g_worst_q[kt], rel);
        const double bound = kt == ST_KV_BF16 ? 1e-2 : 8e-2;
        CHECK_MSG(rel <= bound, "%s H %lld/%lld hd %lld bs %lld: error %.3g (of max|out|) vs unrounded keys > %g",
                  st_kv_dtype_name(kt), (long long)H, (long long)Hkv, (long long)hd, (long long)bs, rel, bound);
        for (int64_t s = 0; s < n_seqs; s++) free(uk[s]), free(uv[s]);
        free(uk), free(uv);
        b.kseq = rk, b.vseq = rv;
    }
    /* bit-identical to the contiguous op on each sequence, and to the token alone */
    int64_t t = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t n_s = nq[s];
        CHECK(be->ops->attention(be, NULL, b.q + t * row, b.kseq[s], b.vseq[s], b.pos + t, n_s, ctx[s], H, Hkv, hd,
                                 scale, alt + t * row) == STRATA_OK);
        t += n_s;
    }
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0,
              "%s paged != contiguous (H %lld/%lld hd %lld bs %lld)", st_kv_dtype_name(kt), (long long)H,
              (long long)Hkv, (long long)hd, (long long)bs);
    for (t = 0; t < b.n; t++) {
        CHECK(be->ops->attention_paged(be, NULL, b.q + t * row, &kv, b.seq + t, b.pos + t, 1, H, Hkv, hd, scale,
                                       one) == STRATA_OK);
        CHECK_MSG(memcmp(one, out + t * row, (size_t)row * sizeof(float)) == 0, "%s: token %lld alone differs",
                  st_kv_dtype_name(kt), (long long)t);
        /* alone on 3 threads: split over its keys when it has more than one range */
        CHECK(be3->ops->attention_paged(be3, NULL, b.q + t * row, &kv, b.seq + t, b.pos + t, 1, H, Hkv, hd, scale,
                                        one) == STRATA_OK);
        CHECK_MSG(memcmp(one, out + t * row, (size_t)row * sizeof(float)) == 0,
                  "%s: token %lld alone on 3 threads differs", st_kv_dtype_name(kt), (long long)t);
    }
    /* reversed token order: each token's row the same */
    int32_t *rs = malloc((size_t)b.n * sizeof(int32_t)), *rp = malloc((size_t)b.n * sizeof(int32_t));
    float *rq = malloc((size_t)(b.n * row) * sizeof(float));
    for (t = 0; t < b.n; t++) {
        rs[t] = b.seq[b.n - 1 - t], rp[t] = b.pos[b.n - 1 - t];
        memcpy(rq + t * row, b.q + (b.n - 1 - t) * row, (size_t)row * sizeof(float));
    }
    CHECK(be->ops->attention_paged(be, NULL, rq, &kv, rs, rp, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
    bool same = true;
    for (t = 0; t < b.n; t++) same &= memcmp(alt + t * row, out + (b.n - 1 - t) * row, (size_t)row * sizeof(float)) == 0;
    CHECK_MSG(same, "%s: reversed batch differs", st_kv_dtype_name(kt));
    /* 3 threads, and the other kernel build */
    CHECK(be3->ops->attention_paged(be3, NULL, b.q, &kv, b.seq, b.pos, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0, "%s: 3 threads differ", st_kv_dtype_name(kt));
    const bool was = st_backend_cpu_set_simd(be3, false);
    CHECK(be3->ops->attention_paged(be3, NULL, b.q, &kv, b.seq, b.pos, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0, "%s: portable build differs", st_kv_dtype_name(kt));
    st_backend_cpu_set_simd(be3, was);
    free(rs), free(rp), free(rq);
    free(out), free(alt), free(one), free(ref);
    if (kt != ST_KV_F32) layer_free(&L);
    batch_free(&b);
}

static void test_errors(st_backend *be) {
    const int32_t ctx[2] = {20, 5}, nq[2] = {3, 1};
    batch b;
    batch_make(&b, 4, 2, 8, 4, 2, ctx, nq);
    st_paged_kv kv = batch_kv(&b);
    float *out = malloc((size_t)(b.n * 32) * sizeof(float));
    const float sc = 0.3f;
    b.seq[1] = 2;
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "seq[1] = 2");
    b.seq[1] = 0;
    b.pos[3] = 5; /* sequence 1 holds 5 keys */
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "pos[3] = 5");
    b.pos[3] = 4;
    const int32_t saved = b.tables[1];
    b.tables[1] = (int32_t)(b.n_slots / 4);
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "block_tables[0][1]");
    b.tables[1] = saved;
    kv.max_ctx = 19;
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "ctx_lens[0] = 20");
    kv.max_ctx = 20;
    kv.cache.n_slots = 7; /* not a multiple of the block size */
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "multiple of block_size");
    kv = batch_kv(&b);
    CHECK_ERR(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 6, 4, 8, sc, out),
              STRATA_ERR_INVALID_ARG, "multiple of n_kv_heads");
    CHECK(be->ops->attention_paged(be, NULL, b.q, &kv, b.seq, b.pos, b.n, 4, 2, 8, sc, out) == STRATA_OK);
    free(out);
    batch_free(&b);
}

int main(void) {
    st_backend *be = NULL, *be3 = NULL;
    st_backend_params p = {.kind = ST_BACKEND_CPU, .n_threads = 1};
    if (st_backend_init(&p, &be) != STRATA_OK) return 2;
    p.n_threads = 3;
    if (st_backend_init(&p, &be3) != STRATA_OK) return 2;
    test_conversions();
    test_errors(be);
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++) {
        test_kv_store(be, (st_kv_dtype)kt);
        {   /* a decode among prefill chunks, one sequence per layout */
            const int32_t ctx[4] = {1, 37, 300, 64}, nq[4] = {1, 5, 1, 64};
            check_paged(be, be3, kt, 4, 4, 16, 16, 4, ctx, nq);  /* MHA */
            check_paged(be, be3, kt, 9, 3, 64, 16, 4, ctx, nq);  /* SmolLM2's layout */
            check_paged(be, be3, kt, 8, 2, 8, 1, 4, ctx, nq);    /* one-slot blocks */
            check_paged(be, be3, kt, 6, 2, 12, 7, 4, ctx, nq);   /* odd block size and head_dim */
        }
        {   /* long decodes (several ranges each) */
            const int32_t ctx[3] = {700, 1000, 257}, nq[3] = {1, 1, 2};
            check_paged(be, be3, kt, 9, 3, 64, 16, 3, ctx, nq);
        }
        {   /* many decodes */
            int32_t ctx[12], nq[12];
            for (int i = 0; i < 12; i++) ctx[i] = (int32_t)(1 + test_rand_u32(&g_rng) % 200), nq[i] = 1;
            check_paged(be, be3, kt, 8, 2, 32, 16, 12, ctx, nq);
        }
    }
    fprintf(stderr, "error vs the unrounded keys (of max|out| per token): bf16 %.3g, fp8 %.3g\n", g_worst_q[1],
            g_worst_q[2]);
    st_backend_free(be);
    st_backend_free(be3);
    return test_finish("test_backend_paged");
}

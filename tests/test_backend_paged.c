/* The CPU backend's paged-KV ops (backend.h: kv_store_paged, attention_paged):
 *  - kv_store_paged writes each token's K and V rows at its slot, skips -1,
 *    and rejects an out-of-range slot before writing anything;
 *  - attention_paged against a naive double-precision reference (1e-5), and
 *    bit for bit against the contiguous `attention` op run on each sequence's
 *    keys laid out contiguously (same arithmetic, gathered through the block
 *    table), for several head layouts (MHA, GQA 3 and 4, odd head_dim),
 *    shuffled physical blocks, block sizes 1, 16 and 7;
 *  - batch invariance: a token's output is bit-identical alone, in a batch of
 *    other sequences (in any order), with 1 or 3 worker threads, and with the
 *    portable or the AVX2 build of the kernels;
 *  - argument checks: a bad sequence index, a position beyond its
 *    sequence's keys, a block id outside the pool, ctx_lens above max_ctx.
 * The CUDA backend runs the same ops against this one in
 * tests/gpu/gpu_check_ops.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_internal.h"
#include "testutil.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static void test_kv_store(st_backend *be) {
    const int64_t n_slots = 40, cols = 12, n = 5;
    float *kc = test_rand_floats(&g_rng, n_slots * cols, 1.0f), *vc = test_rand_floats(&g_rng, n_slots * cols, 1.0f);
    float *k0 = malloc((size_t)(n_slots * cols) * sizeof(float)), *v0 = malloc((size_t)(n_slots * cols) * sizeof(float));
    memcpy(k0, kc, (size_t)(n_slots * cols) * sizeof(float));
    memcpy(v0, vc, (size_t)(n_slots * cols) * sizeof(float));
    float *k = test_rand_floats(&g_rng, n * cols, 2.0f), *v = test_rand_floats(&g_rng, n * cols, 2.0f);
    const int64_t slots[5] = {39, -1, 0, 17, 18};
    CHECK(be->ops->kv_store_paged(be, NULL, kc, vc, n_slots, k, v, slots, n, cols) == STRATA_OK);
    for (int64_t r = 0; r < n_slots; r++) {
        const float *wk = k0 + r * cols, *wv = v0 + r * cols;
        for (int64_t i = 0; i < n; i++)
            if (slots[i] == r) wk = k + i * cols, wv = v + i * cols;
        CHECK_MSG(memcmp(kc + r * cols, wk, (size_t)cols * sizeof(float)) == 0, "K row %lld", (long long)r);
        CHECK_MSG(memcmp(vc + r * cols, wv, (size_t)cols * sizeof(float)) == 0, "V row %lld", (long long)r);
    }
    memcpy(k0, kc, (size_t)(n_slots * cols) * sizeof(float));
    const int64_t bad[2] = {3, 40};
    CHECK_ERR(be->ops->kv_store_paged(be, NULL, kc, vc, n_slots, k, v, bad, 2, cols), STRATA_ERR_INVALID_ARG,
              "slots[1] = 40");
    const int64_t neg[1] = {-2};
    CHECK_ERR(be->ops->kv_store_paged(be, NULL, kc, vc, n_slots, k, v, neg, 1, cols), STRATA_ERR_INVALID_ARG,
              "outside");
    CHECK(memcmp(kc, k0, (size_t)(n_slots * cols) * sizeof(float)) == 0); /* nothing written */
    CHECK(be->ops->kv_store_paged(be, NULL, kc, vc, n_slots, k, v, slots, 0, cols) == STRATA_OK);
    free(kc), free(vc), free(k0), free(v0), free(k), free(v);
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
    return (st_paged_kv){.k_cache = b->kc, .v_cache = b->vc, .n_slots = b->n_slots, .block_size = b->bs,
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

static void check_paged(st_backend *be, st_backend *be3, int64_t H, int64_t Hkv, int64_t hd, int64_t bs,
                        int64_t n_seqs, const int32_t *ctx, const int32_t *nq) {
    batch b;
    batch_make(&b, H, Hkv, hd, bs, n_seqs, ctx, nq);
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t row = H * hd;
    const st_paged_kv kv = batch_kv(&b);
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
    CHECK_MSG(worst <= 1e-5, "H %lld/%lld hd %lld bs %lld: max err %.3g vs the naive reference", (long long)H,
              (long long)Hkv, (long long)hd, (long long)bs, worst);
    /* bit-identical to the contiguous op on each sequence, and to the token alone */
    int64_t t = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t n_s = nq[s];
        CHECK(be->ops->attention(be, NULL, b.q + t * row, b.kseq[s], b.vseq[s], b.pos + t, n_s, ctx[s], H, Hkv, hd,
                                 scale, alt + t * row) == STRATA_OK);
        t += n_s;
    }
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0,
              "paged != contiguous (H %lld/%lld hd %lld bs %lld)", (long long)H, (long long)Hkv, (long long)hd,
              (long long)bs);
    for (t = 0; t < b.n; t++) {
        CHECK(be->ops->attention_paged(be, NULL, b.q + t * row, &kv, b.seq + t, b.pos + t, 1, H, Hkv, hd, scale,
                                       one) == STRATA_OK);
        CHECK_MSG(memcmp(one, out + t * row, (size_t)row * sizeof(float)) == 0, "token %lld alone differs",
                  (long long)t);
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
    CHECK_MSG(same, "reversed batch differs");
    /* 3 threads, and the other kernel build */
    CHECK(be3->ops->attention_paged(be3, NULL, b.q, &kv, b.seq, b.pos, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0, "3 threads differ");
    const bool was = st_backend_cpu_set_simd(be3, false);
    CHECK(be3->ops->attention_paged(be3, NULL, b.q, &kv, b.seq, b.pos, b.n, H, Hkv, hd, scale, alt) == STRATA_OK);
    CHECK_MSG(memcmp(out, alt, (size_t)(b.n * row) * sizeof(float)) == 0, "portable build differs");
    st_backend_cpu_set_simd(be3, was);
    free(rs), free(rp), free(rq);
    free(out), free(alt), free(one), free(ref);
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
    kv.n_slots = 7; /* not a multiple of the block size */
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
    test_kv_store(be);
    test_errors(be);
    {   /* a decode among prefill chunks, one sequence per layout */
        const int32_t ctx[4] = {1, 37, 300, 64}, nq[4] = {1, 5, 1, 64};
        check_paged(be, be3, 4, 4, 16, 16, 4, ctx, nq);  /* MHA */
        check_paged(be, be3, 9, 3, 64, 16, 4, ctx, nq);  /* SmolLM2's layout */
        check_paged(be, be3, 8, 2, 8, 1, 4, ctx, nq);    /* one-slot blocks */
        check_paged(be, be3, 6, 2, 12, 7, 4, ctx, nq);   /* odd block size and head_dim */
    }
    {   /* many decodes */
        int32_t ctx[12], nq[12];
        for (int i = 0; i < 12; i++) ctx[i] = (int32_t)(1 + test_rand_u32(&g_rng) % 200), nq[i] = 1;
        check_paged(be, be3, 8, 2, 32, 16, 12, ctx, nq);
    }
    st_backend_free(be);
    st_backend_free(be3);
    return test_finish("test_backend_paged");
}

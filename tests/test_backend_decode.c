/* The CPU backend's decode-step ops (argmax, matmul_multi,
 * matmul_swiglu, rmsnorm_matmul, rope_kv_store, graphs: backend.h) against references written here, and the
 * model's decode steps through the one forward path (greedy on the device
 * against the host argmax).
 * The CUDA backend runs the same ops against this CPU backend in
 * tests/gpu/gpu_check_ops.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/quant.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "testutil.h"

static uint64_t g_rng = 0x2545f4914f6cdd1dull;

static void test_argmax(st_backend *be) {
    const int64_t n = 6, cols = 1001;
    float *x = test_rand_floats(&g_rng, n * cols, 10.0f);
    x[0 * cols + 500] = 50.0f;                         /* row 0: a clear maximum */
    x[1 * cols + 7] = 60.0f, x[1 * cols + 900] = 60.0f; /* row 1: a tie -> the first */
    x[2 * cols + 3] = NAN, x[2 * cols + 4] = 70.0f;    /* row 2: NaN never wins */
    x[2 * cols + 0] = NAN;
    for (int64_t j = 0; j < cols; j++) x[3 * cols + j] = NAN; /* row 3: all NaN -> 0 */
    for (int64_t j = 0; j < cols; j++) x[4 * cols + j] = -INFINITY; /* row 4: all -inf -> 0 */
    x[4 * cols + 1000] = -1e30f;
    x[5 * cols + 1000] = 99.0f;                        /* row 5: the last element */
    int32_t out[6] = {-1, -1, -1, -1, -1, -1};
    CHECK(be->ops->argmax(be, NULL, x, n, cols, out) == STRATA_OK);
    CHECK(out[0] == 500);
    CHECK(out[1] == 7);
    CHECK(out[2] == 4);
    CHECK(out[3] == 0);
    CHECK(out[4] == 1000);
    CHECK(out[5] == 1000);
    for (int64_t j = 0; j < cols; j++) x[4 * cols + j] = -INFINITY;
    CHECK(be->ops->argmax(be, NULL, x + 4 * cols, 1, cols, out) == STRATA_OK && out[0] == 0);
    CHECK_ERR(be->ops->argmax(be, NULL, x, 1, 0, out), STRATA_ERR_INVALID_ARG, "cols");
    free(x);
}

/* A rows x cols weight of dtype t with random values (quantized from f32). */
static void *make_weight(st_dtype t, int64_t rows, int64_t cols) {
    float *f = test_rand_floats(&g_rng, rows * cols, 0.5f);
    const size_t rb = st_dtype_row_bytes(t, cols);
    uint8_t *w = malloc(rb * (size_t)rows);
    for (int64_t r = 0; r < rows; r++)
        CHECK(st_quantize_row(t, f + r * cols, w + (size_t)r * rb, cols));
    free(f);
    return w;
}

static void test_fused_matmuls(st_backend *be) {
    const st_dtype types[] = {ST_DTYPE_F32, ST_DTYPE_BF16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const st_dtype t = types[ti];
        const int64_t K = 256, n = 3;
        const int64_t rows[3] = {40, 8, 8};
        void *wd[3];
        st_weight w[3];
        float *x = test_rand_floats(&g_rng, n * K, 1.0f), *y[3], *yr[3];
        for (int i = 0; i < 3; i++) {
            wd[i] = make_weight(t, rows[i], K);
            w[i] = (st_weight){wd[i], t, rows[i], K, 0};
            y[i] = malloc((size_t)(n * rows[i]) * sizeof(float));
            yr[i] = malloc((size_t)(n * rows[i]) * sizeof(float));
            CHECK(be->ops->matmul(be, NULL, x, &w[i], n, yr[i]) == STRATA_OK);
        }
        CHECK(be->ops->matmul_multi(be, NULL, x, w, 3, n, y) == STRATA_OK);
        for (int i = 0; i < 3; i++)
            CHECK_MSG(memcmp(y[i], yr[i], (size_t)(n * rows[i]) * sizeof(float)) == 0, "%s weight %d",
                      st_dtype_name(t), i);
        /* swiglu: gate = w[1], up = w[2] (same shape) */
        float *sw = malloc((size_t)(n * 8) * sizeof(float)), *ref = malloc((size_t)(n * 8) * sizeof(float));
        CHECK(be->ops->matmul_swiglu(be, NULL, x, &w[1], &w[2], n, sw, NULL) == STRATA_OK);
        CHECK(be->ops->swiglu(be, NULL, yr[1], yr[2], n * 8, ref) == STRATA_OK);
        CHECK_MSG(memcmp(sw, ref, (size_t)(n * 8) * sizeof(float)) == 0, "%s swiglu", st_dtype_name(t));
        /* with a work buffer: the same output, and (the CPU never fuses) the up projection there */
        {
            float *wk = malloc((size_t)(n * 8) * sizeof(float)), *sw2 = malloc((size_t)(n * 8) * sizeof(float));
            CHECK(be->ops->matmul_swiglu(be, NULL, x, &w[1], &w[2], n, sw2, wk) == STRATA_OK);
            CHECK_MSG(memcmp(sw2, ref, (size_t)(n * 8) * sizeof(float)) == 0, "%s swiglu with work", st_dtype_name(t));
            CHECK_MSG(memcmp(wk, yr[2], (size_t)(n * 8) * sizeof(float)) == 0, "%s swiglu: work holds x @ up^T",
                      st_dtype_name(t));
            CHECK_ERR(be->ops->matmul_swiglu(be, NULL, x, &w[1], &w[2], n, sw2, sw2 + 1), STRATA_ERR_INVALID_ARG,
                      "work overlaps x or out");
            free(wk);
            free(sw2);
        }
        /* and against a double reference of silu(g) * u */
        for (int64_t i = 0; i < n * 8; i++) {
            const double g = yr[1][i], u = yr[2][i];
            const double want = g / (1.0 + exp(-g)) * u;
            CHECK(fabs(sw[i] - want) <= 1e-5 * (fabs(want) + 1e-3));
        }
        CHECK_ERR(be->ops->matmul_swiglu(be, NULL, x, &w[0], &w[1], n, sw, NULL), STRATA_ERR_INVALID_ARG, "gate is");
        /* rmsnorm_matmul: the same bytes as rmsnorm (residual added in place), then matmul_multi / matmul_swiglu */
        {
            float *nw = test_rand_floats(&g_rng, K, 1.0f), *res = test_rand_floats(&g_rng, n * K, 1.0f);
            const st_weight wn = {nw, ST_DTYPE_F32, 1, K, 0};
            float *xa = malloc((size_t)(n * K) * sizeof(float)), *xb = malloc((size_t)(n * K) * sizeof(float));
            float *na = malloc((size_t)(n * K) * sizeof(float)), *nb = malloc((size_t)(n * K) * sizeof(float));
            for (int sw_mode = 0; sw_mode < 2; sw_mode++) {
                memcpy(xa, x, (size_t)(n * K) * sizeof(float));
                memcpy(xb, x, (size_t)(n * K) * sizeof(float));
                CHECK(be->ops->rmsnorm(be, NULL, xa, res, &wn, 1e-5f, n, K, na) == STRATA_OK);
                if (sw_mode) CHECK(be->ops->matmul_swiglu(be, NULL, na, &w[1], &w[2], n, yr[0], NULL) == STRATA_OK);
                else CHECK(be->ops->matmul_multi(be, NULL, na, w, 3, n, yr) == STRATA_OK);
                CHECK(be->ops->rmsnorm_matmul(be, NULL, xb, res, &wn, 1e-5f, n, K, nb, sw_mode ? &w[1] : w,
                                              sw_mode ? 1 : 3, sw_mode ? &w[2] : NULL, y) == STRATA_OK);
                CHECK_MSG(memcmp(xa, xb, (size_t)(n * K) * sizeof(float)) == 0 &&
                              memcmp(na, nb, (size_t)(n * K) * sizeof(float)) == 0,
                          "%s rmsnorm_matmul: x and the norm", st_dtype_name(t));
                for (int i = 0; i < (sw_mode ? 1 : 3); i++)
                    CHECK_MSG(memcmp(y[i], yr[i], (size_t)(n * (sw_mode ? 8 : rows[i])) * sizeof(float)) == 0,
                              "%s rmsnorm_matmul %s, output %d", st_dtype_name(t), sw_mode ? "swiglu" : "multi", i);
            }
            free(nw);
            free(res);
            free(xa);
            free(xb);
            free(na);
            free(nb);
        }
        free(sw);
        free(ref);
        st_weight bad[2] = {w[0], w[1]};
        bad[1].cols = 128;
        CHECK_ERR(be->ops->matmul_multi(be, NULL, x, bad, 2, n, y), STRATA_ERR_INVALID_ARG, "cols");
        CHECK_ERR(be->ops->matmul_multi(be, NULL, x, w, 5, n, y), STRATA_ERR_INVALID_ARG, "count");
        for (int i = 0; i < 3; i++) {
            free(wd[i]);
            free(y[i]);
            free(yr[i]);
        }
        free(x);
    }
}

/* rope_kv_store: the bytes of rope (q), rope (k), kv_store_paged, for each
 * cache type (a skipped slot of -1 among them) */
static void test_rope_kv_store(st_backend *be) {
    const int64_t H = 4, Hkv = 2, hd = 8, n = 3, n_slots = 6, kvd = Hkv * hd;
    const int32_t pos[3] = {0, 17, 100000};
    const int64_t slots[3] = {4, -1, 0};
    float inv[4];
    for (int j = 0; j < 4; j++) inv[j] = powf(10000.0f, -(float)(2 * j) / (float)hd);
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++)
        for (int il = 0; il < 2; il++) {
            float *q = test_rand_floats(&g_rng, n * H * hd, 2.0f), *k = test_rand_floats(&g_rng, n * kvd, 2.0f);
            float *v = test_rand_floats(&g_rng, n * kvd, 2.0f);
            float *q2 = malloc((size_t)(n * H * hd) * sizeof(float)), *k2 = malloc((size_t)(n * kvd) * sizeof(float));
            memcpy(q2, q, (size_t)(n * H * hd) * sizeof(float));
            memcpy(k2, k, (size_t)(n * kvd) * sizeof(float));
            const size_t cb = (size_t)(n_slots * kvd) * st_kv_dtype_size((st_kv_dtype)kt);
            uint8_t *c1 = calloc(4, cb), *c2 = calloc(4, cb); /* K | V of each */
            float *sc1 = calloc(4 * (size_t)(n_slots * Hkv), sizeof(float)), *sc2 = calloc(4 * (size_t)(n_slots * Hkv), sizeof(float));
            const bool f8 = kt == ST_KV_FP8;
            const st_kv_layer L1 = {c1, c1 + cb, f8 ? sc1 : NULL, f8 ? sc1 + n_slots * Hkv : NULL, (st_kv_dtype)kt,
                                    n_slots, Hkv, hd};
            const st_kv_layer L2 = {c2, c2 + cb, f8 ? sc2 : NULL, f8 ? sc2 + n_slots * Hkv : NULL, (st_kv_dtype)kt,
                                    n_slots, Hkv, hd};
            CHECK(be->ops->rope(be, NULL, q, pos, n, H, hd, inv, il) == STRATA_OK);
            CHECK(be->ops->rope(be, NULL, k, pos, n, Hkv, hd, inv, il) == STRATA_OK);
            CHECK(be->ops->kv_store_paged(be, NULL, &L1, k, v, slots, n) == STRATA_OK);
            CHECK(be->ops->rope_kv_store(be, NULL, q2, k2, v, pos, n, H, hd, inv, il, &L2, slots) == STRATA_OK);
            CHECK_MSG(memcmp(q, q2, (size_t)(n * H * hd) * sizeof(float)) == 0 &&
                          memcmp(k, k2, (size_t)(n * kvd) * sizeof(float)) == 0 && memcmp(c1, c2, 2 * cb) == 0 &&
                          memcmp(sc1, sc2, 2 * (size_t)(n_slots * Hkv) * sizeof(float)) == 0,
                      "rope_kv_store, cache %s, %s: q, k, the cache's bytes", st_kv_dtype_name((st_kv_dtype)kt),
                      il ? "interleaved" : "rotate-half");
            /* slot 0 holds token 2's rotated k (not its input) */
            CHECK(kt != ST_KV_F32 || memcmp(c2, k2 + 2 * kvd, (size_t)kvd * sizeof(float)) == 0);
            free(q), free(k), free(v), free(q2), free(k2), free(c1), free(c2), free(sc1), free(sc2);
        }
}

static void test_graphs(st_backend *be) {
    st_stream *s = NULL;
    CHECK(be->ops->stream_create(be, false, &s) == STRATA_OK);
    CHECK_ERR(be->ops->graph_begin(be, s), STRATA_ERR_UNSUPPORTED, "no graphs");
    st_graph *g = (st_graph *)&g;
    CHECK(be->ops->graph_end(be, s, &g) != STRATA_OK && g == NULL);
    be->ops->graph_destroy(be, NULL);
    be->ops->set_fast_prefill(be, true); /* no effect on the CPU */
    be->ops->set_fast_prefill(be, false);
    be->ops->stream_destroy(be, s);
}

/* Decode steps through the one forward path over a reference model: a
 * prompt then 12 greedy steps, (a) one token per st_llama_forward_seq call
 * with the argmax taken on the host from the logits, (b) one-token batches
 * through st_llama_forward_sample (temperature 0: the sample op's argmax,
 * logits copied back every other step): the same tokens, the same logits bit
 * for bit, and a full context is a clear error. */
static void test_llama_decode(st_backend *be, const char *model) {
    st_model_files *f = NULL;
    st_llama *m = NULL;
    st_kv_pool *kv = NULL;
    CHECK(st_model_open(test_src_path(model), &f) == STRATA_OK);
    if (!f) return;
    st_llama_params lp = {.max_seq_len = 40, .max_tokens = 8};
    CHECK(st_llama_init(f, be, &lp, &m) == STRATA_OK);
    const st_kv_pool_params kp = m ? st_llama_kv_params(m, 3, 16, ST_KV_F32) : (st_kv_pool_params){0};
    CHECK(m && st_kv_pool_init(be, &kp, &kv) == STRATA_OK);
    if (!m || !kv) {
        st_llama_free(m);
        st_model_close(f);
        return;
    }
    const int64_t V = st_llama_config(m)->vocab_size;
    float *la = malloc((size_t)V * sizeof(float)), *lb = malloc((size_t)V * sizeof(float));
    const int32_t prompt[5] = {1, 17, 42, 9, 100 % (int32_t)V};
    int32_t seq_a[12], seq_b[12];
    /* a: prefill + decode with host logits and a host argmax */
    CHECK(st_llama_forward_seq(m, kv, prompt, 5, 0, false, la) == STRATA_OK);
    for (int i = 0; i < 12; i++) {
        int32_t b = 0;
        for (int64_t v = 1; v < V; v++)
            if (la[v] > la[b]) b = (int32_t)v;
        seq_a[i] = b;
        CHECK(st_llama_forward_seq(m, kv, &b, 1, 5 + i, false, la) == STRATA_OK);
    }
    /* b: the same positions again, the greedy token drawn by the sample op */
    CHECK(st_llama_forward_seq(m, kv, prompt, 5, 0, false, lb) == STRATA_OK);
    int32_t next = -1;
    for (int64_t v = 1, b = 0; v <= V; v++) {
        if (v == V) next = (int32_t)b;
        else if (lb[v] > lb[b]) b = v;
    }
    const int32_t table[3] = {0, 1, 2}, seq = 0, row = 0;
    const st_sample_args greedy = {.temperature = 0.0f, .top_p = 1.0f};
    for (int i = 0; i < 12; i++) {
        seq_b[i] = next;
        const int32_t pos = 5 + i, ctx = pos + 1;
        const int64_t slot = pos;
        const st_batch bt = {.n_tokens = 1, .tokens = &seq_b[i], .pos = &pos, .seq = &seq, .slots = &slot,
                             .n_seqs = 1, .block_tables = table, .max_blocks = 3, .ctx_lens = &ctx,
                             .logit_rows = &row, .n_logits = 1};
        CHECK(st_llama_forward_sample(m, kv, &bt, &greedy, &next, (i % 2) ? lb : NULL) == STRATA_OK);
    }
    CHECK(memcmp(seq_a, seq_b, sizeof seq_a) == 0);
    CHECK(memcmp(la, lb, (size_t)V * sizeof(float)) == 0); /* step 12's logits (i = 11 copied them) */
    const int32_t bad = (int32_t)V;
    CHECK_ERR(st_llama_forward_seq(m, kv, &bad, 1, 17, false, la), STRATA_ERR_INVALID_ARG, "vocabulary");
    /* the context (40 positions) fills up: a clear error */
    const int32_t three = 3;
    CHECK(st_llama_forward_seq(m, kv, &three, 1, 39, false, la) == STRATA_OK);
    CHECK_ERR(st_llama_forward_seq(m, kv, &three, 1, 40, false, la), STRATA_ERR_INVALID_ARG, "context of 40");
    free(la);
    free(lb);
    st_llama_forget_pool(m, kv);
    st_kv_pool_free(kv);
    st_llama_free(m);
    st_model_close(f);
}

int main(void) {
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2};
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    if (!be) return test_finish("test_backend_decode");
    test_argmax(be);
    test_fused_matmuls(be);
    test_rope_kv_store(be);
    { /* the same with int8 activations (the few-token kernels: weights in 8- or 16-row blocks) */
        st_backend_params bp8 = {.kind = ST_BACKEND_CPU, .n_threads = 2, .cpu_act = ST_CPU_ACT_INT8};
        st_backend *be8 = NULL;
        CHECK(st_backend_init(&bp8, &be8) == STRATA_OK);
        if (be8) test_fused_matmuls(be8);
        st_backend_free(be8);
    }
    test_graphs(be);
    test_llama_decode(be, "tests/data/models/gqa_f32");
    test_llama_decode(be, "tests/data/models/llama3_bf16");
    test_llama_decode(be, "tests/data/models/mha_tied_f32");
    st_backend_free(be);
    return test_finish("test_backend_decode");
}

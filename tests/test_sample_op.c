/* The CPU backend's `sample` op (backend.h) against the host sampler
 * (engine/sampler.h): for the same uniform draw u it must pick the same token,
 * on many random rows (vocabularies of 7 to 128256 tokens; sharp, flat and
 * tie-heavy logits, some -inf) and parameter mixes (temperature 0 / 0.7 /
 * 1.5, top_k 0 / 1 / 40 / vocab, top_p 0.05 .. 1, min_p); the token it picks
 * has a non-zero probability in st_sampler_probs; greedy rows give the
 * argmax op's token; st_sampler_next_args draws the same u as
 * st_sampler_sample; the id-order draw rule on a hand-made row; invalid rows
 * give -1; bad arguments are errors that write nothing.
 * The CUDA op is checked against this one in tests/gpu/gpu_check_ops.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "testutil.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;

static double urand(void) { return (double)test_rand_u32(&g_rng) / 4294967296.0; }
static float nrand(void) {
    double u = urand(), v = urand();
    if (u < 1e-12) u = 1e-12;
    return (float)(sqrt(-2 * log(u)) * cos(2 * M_PI * v));
}

/* One row of logits of a given kind: 0 gaussian (std 3), 1 sharp (a few
 * tokens far above), 2 flat (std 0.3), 3 ties (multiples of 0.5), 4 gaussian
 * with 10% -inf. */
static void make_row(float *x, int64_t V, int kind) {
    for (int64_t i = 0; i < V; i++) {
        float v = nrand();
        switch (kind) {
        case 0: v *= 3.0f; break;
        case 1: v = v * 2.0f + (test_rand_u32(&g_rng) % 1000 == 0 ? 15.0f : 0.0f); break;
        case 2: v *= 0.3f; break;
        case 3: v = roundf(v * 4.0f) * 0.5f; break;
        default: v = test_rand_u32(&g_rng) % 10 == 0 ? -INFINITY : v * 3.0f; break;
        }
        x[i] = v;
    }
    if (kind == 4) x[V / 2] = 1.0f; /* at least one finite */
}

typedef struct {
    float t;
    int32_t k; /* -1: the vocabulary size */
    float p, minp;
} mix;

static const mix g_mixes[] = {
    {0.0f, 0, 1.0f, 0.0f},   {0.7f, 0, 1.0f, 0.0f},   {1.5f, 0, 1.0f, 0.0f},  {0.7f, 1, 1.0f, 0.0f},
    {0.7f, 40, 1.0f, 0.0f},  {1.0f, 40, 0.9f, 0.0f},  {0.7f, -1, 0.9f, 0.0f}, {1.5f, 0, 0.05f, 0.0f},
    {0.7f, 0, 0.5f, 0.0f},   {1.0f, 0, 0.95f, 0.0f},  {1.0f, 0, 1.0f, 0.05f}, {0.7f, 40, 0.9f, 0.1f},
    {1.5f, 0, 0.99f, 0.01f}, {0.0f, 40, 0.9f, 0.05f}, {1.0f, 0, 0.3f, 0.0f},  {0.7f, 1000, 0.8f, 0.0f},
};
#define N_MIXES ((int)(sizeof g_mixes / sizeof g_mixes[0]))

/* Rows of vocabulary V, every mix on every row kind, a fresh u each: op vs sampler. */
static void check_vocab(st_backend *be, int64_t V, int kinds, int reps) {
    const int64_t n = (int64_t)kinds * N_MIXES * reps;
    float *x = malloc((size_t)(n * V) * sizeof *x);
    float *probs = malloc((size_t)V * sizeof *probs);
    st_sample_args *args = malloc((size_t)n * sizeof *args);
    int32_t *out = malloc((size_t)n * sizeof *out), *am = malloc((size_t)n * sizeof *am);
    int64_t r = 0;
    for (int rep = 0; rep < reps; rep++)
        for (int kind = 0; kind < kinds; kind++)
            for (int m = 0; m < N_MIXES; m++, r++) {
                make_row(x + r * V, V, kind);
                const mix *mx = &g_mixes[m];
                args[r] = (st_sample_args){.u = urand(), .temperature = mx->t,
                                           .top_k = mx->k < 0 ? (int32_t)V : mx->k, .top_p = mx->p,
                                           .min_p = mx->minp};
                if (rep == 0 && m == 1) args[r].u = 0.0;                 /* the edges of [0, 1) */
                if (rep == 0 && m == 2) args[r].u = 1.0 - 0x1.0p-53;
            }
    for (int64_t i = 0; i < n; i++) out[i] = -7;
    CHECK(be->ops->sample(be, NULL, x, n, V, args, out) == STRATA_OK);
    CHECK(be->ops->argmax(be, NULL, x, n, V, am) == STRATA_OK);
    int mismatch = 0, zero_prob = 0, greedy_bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const st_sampler_params sp = {.temperature = args[i].temperature, .top_k = args[i].top_k,
                                      .top_p = args[i].top_p, .min_p = args[i].min_p, .repeat_penalty = 1.0f,
                                      .seed = 1};
        st_sampler *s = NULL;
        CHECK(st_sampler_init(&sp, V, &s) == STRATA_OK);
        if (!s) break;
        int32_t t = -9;
        CHECK(st_sampler_sample_u(s, x + i * V, NULL, 0, args[i].u, &t) == STRATA_OK);
        if (t != out[i]) {
            if (mismatch < 5)
                fprintf(stderr, "V %lld row %lld (T %g k %d p %g minp %g u %.17g): op %d, sampler %d\n", (long long)V,
                        (long long)i, (double)args[i].temperature, args[i].top_k, (double)args[i].top_p,
                        (double)args[i].min_p, args[i].u, out[i], t);
            mismatch++;
        }
        CHECK(st_sampler_probs(s, x + i * V, NULL, 0, probs) == STRATA_OK);
        if (out[i] < 0 || out[i] >= V || !(probs[out[i]] > 0)) zero_prob++;
        if (args[i].temperature == 0.0f && out[i] != am[i]) greedy_bad++;
        st_sampler_free(s);
    }
    CHECK_MSG(mismatch == 0, "vocab %lld: %d of %lld tokens differ from st_sampler_sample_u", (long long)V, mismatch,
              (long long)n);
    CHECK_MSG(zero_prob == 0, "vocab %lld: %d tokens outside the kept set", (long long)V, zero_prob);
    CHECK_MSG(greedy_bad == 0, "vocab %lld: %d greedy rows differ from argmax", (long long)V, greedy_bad);
    free(x);
    free(probs);
    free(args);
    free(out);
    free(am);
}

/* st_sampler_next_args + the op == st_sampler_sample, step after step (same seed). */
static void check_next_args(st_backend *be) {
    const int64_t V = 5000;
    float *x = malloc((size_t)V * sizeof *x);
    const st_sampler_params sp = {.temperature = 0.8f, .top_k = 50, .top_p = 0.9f, .min_p = 0.02f,
                                  .repeat_penalty = 1.0f, .seed = 1234};
    st_sampler *a = NULL, *b = NULL;
    CHECK(st_sampler_init(&sp, V, &a) == STRATA_OK && st_sampler_init(&sp, V, &b) == STRATA_OK);
    CHECK(st_sampler_device_ok(a));
    int bad = 0;
    for (int step = 0; step < 50 && a && b; step++) {
        make_row(x, V, step % 4);
        st_sample_args args;
        st_sampler_next_args(a, &args);
        CHECK(args.u >= 0 && args.u < 1 && args.top_k == 50 && args.temperature == 0.8f);
        int32_t t_op = -1, t_host = -2;
        CHECK(be->ops->sample(be, NULL, x, 1, V, &args, &t_op) == STRATA_OK);
        CHECK(st_sampler_sample(b, x, NULL, 0, &t_host) == STRATA_OK);
        bad += t_op != t_host;
    }
    CHECK_MSG(bad == 0, "next_args + op differ from st_sampler_sample %d times in 50", bad);
    /* greedy: no draw */
    const st_sampler_params gp = {.temperature = 0.0f, .top_p = 1.0f, .repeat_penalty = 1.0f};
    st_sampler *g = NULL;
    CHECK(st_sampler_init(&gp, V, &g) == STRATA_OK);
    st_sample_args ga;
    st_sampler_next_args(g, &ga);
    CHECK(ga.u == 0.0 && ga.temperature == 0.0f);
    /* a penalty: not for the device */
    const st_sampler_params pp = {.temperature = 1.0f, .top_p = 1.0f, .repeat_penalty = 1.1f};
    st_sampler *ps = NULL;
    CHECK(st_sampler_init(&pp, V, &ps) == STRATA_OK);
    CHECK(!st_sampler_device_ok(ps));
    st_sampler_free(a);
    st_sampler_free(b);
    st_sampler_free(g);
    st_sampler_free(ps);
    free(x);
}

/* The draw rule by hand: kept tokens in increasing id, the first whose
 * cumulative mass exceeds u x total. */
static void check_rule(st_backend *be) {
    const float x[6] = {0.0f, 0.0f, -INFINITY, 0.0f, 0.0f, (float)log(2.0)}; /* masses 1 1 - 1 1 2 */
    const double us[] = {0.0, 0.1666, 0.1667, 0.4999, 0.5001, 0.6666, 0.6667, 0.9999};
    const int32_t want[] = {0, 0, 1, 3, 4, 4, 5, 5};
    for (int i = 0; i < 8; i++) {
        const st_sample_args a = {.u = us[i], .temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
        int32_t t = -1;
        CHECK(be->ops->sample(be, NULL, x, 1, 6, &a, &t) == STRATA_OK);
        CHECK_MSG(t == want[i], "u %g: %d, want %d", us[i], t, want[i]);
    }
    /* top-p with ties at the boundary: masses 1 1 1 1 2 (desc: 5, then 0 1 3 4
     * by id), top_p 0.45 of 6 = 2.7: token 5 (2) + token 0 (3): {0, 5} */
    const st_sample_args tp[2] = {{.u = 0.3, .temperature = 1.0f, .top_p = 0.45f},
                                  {.u = 0.4, .temperature = 1.0f, .top_p = 0.45f}};
    int32_t t2[2] = {-1, -1};
    CHECK(be->ops->sample(be, NULL, x, 1, 6, &tp[0], &t2[0]) == STRATA_OK);
    CHECK(be->ops->sample(be, NULL, x, 1, 6, &tp[1], &t2[1]) == STRATA_OK);
    CHECK_MSG(t2[0] == 0 && t2[1] == 5, "top-p ties: %d %d, want 0 5", t2[0], t2[1]);
    /* top-k 2 with a tie at the boundary keeps all of 0 1 3 4 5 (k-th largest is 0) */
    const st_sample_args tk = {.u = 0.3, .temperature = 1.0f, .top_k = 2, .top_p = 1.0f};
    int32_t t3 = -1;
    CHECK(be->ops->sample(be, NULL, x, 1, 6, &tk, &t3) == STRATA_OK && t3 == 1);
    /* min_p 0.6: only token 5 (1 / 2 < 0.6) */
    const st_sample_args mp = {.u = 0.01, .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.6f};
    CHECK(be->ops->sample(be, NULL, x, 1, 6, &mp, &t3) == STRATA_OK && t3 == 5);
}

static void check_invalid(st_backend *be) {
    enum { V = 8 };
    float x[4 * V];
    for (int i = 0; i < 4 * V; i++) x[i] = (float)(i % 5);
    x[0 * V + 3] = NAN;                                     /* row 0: NaN -> -1 */
    for (int i = 0; i < V; i++) x[1 * V + i] = -INFINITY;   /* row 1: all -inf -> -1 */
    x[2 * V + 6] = INFINITY;                                /* row 2: +inf, sampling -> -1 */
    x[3 * V + 2] = INFINITY, x[3 * V + 6] = INFINITY;       /* row 3: +inf, greedy -> the first */
    st_sample_args a[4];
    for (int i = 0; i < 4; i++)
        a[i] = (st_sample_args){.u = 0.5, .temperature = i == 3 ? 0.0f : 1.0f, .top_k = 0, .top_p = 0.9f};
    int32_t out[4] = {9, 9, 9, 9};
    CHECK(be->ops->sample(be, NULL, x, 4, V, a, out) == STRATA_OK);
    CHECK(out[0] == -1 && out[1] == -1 && out[2] == -1 && out[3] == 2);
    /* bad arguments: errors naming the op, nothing written */
    int32_t o[2] = {77, 77};
    st_sample_args b[2] = {a[0], a[0]};
    CHECK_ERR(be->ops->sample(be, NULL, NULL, 1, V, b, o), STRATA_ERR_INVALID_ARG, "cpu sample", "logits");
    CHECK_ERR(be->ops->sample(be, NULL, x, 1, V, NULL, o), STRATA_ERR_INVALID_ARG, "cpu sample", "args");
    CHECK_ERR(be->ops->sample(be, NULL, x, 1, V, b, NULL), STRATA_ERR_INVALID_ARG, "cpu sample", "out");
    CHECK_ERR(be->ops->sample(be, NULL, x, -1, V, b, o), STRATA_ERR_INVALID_ARG, "cpu sample", "n = -1");
    CHECK_ERR(be->ops->sample(be, NULL, x, 1, 0, b, o), STRATA_ERR_INVALID_ARG, "cpu sample", "vocab = 0");
    b[1].top_p = 0.0f;
    CHECK_ERR(be->ops->sample(be, NULL, x, 2, V, b, o), STRATA_ERR_INVALID_ARG, "args[1].top_p");
    b[1] = a[0], b[1].temperature = -1.0f;
    CHECK_ERR(be->ops->sample(be, NULL, x, 2, V, b, o), STRATA_ERR_INVALID_ARG, "args[1].temperature");
    b[1] = a[0], b[1].u = 1.0;
    CHECK_ERR(be->ops->sample(be, NULL, x, 2, V, b, o), STRATA_ERR_INVALID_ARG, "args[1].u");
    b[1] = a[0], b[1].top_k = -3;
    CHECK_ERR(be->ops->sample(be, NULL, x, 2, V, b, o), STRATA_ERR_INVALID_ARG, "args[1].top_k");
    b[1] = a[0], b[1].min_p = 1.5f;
    CHECK_ERR(be->ops->sample(be, NULL, x, 2, V, b, o), STRATA_ERR_INVALID_ARG, "args[1].min_p");
    CHECK(o[0] == 77 && o[1] == 77);
    CHECK(be->ops->sample(be, NULL, x, 0, V, b, o) == STRATA_OK && o[0] == 77);
    /* the host sampler agrees that these rows are invalid */
    const st_sampler_params sp = {.temperature = 1.0f, .top_p = 0.9f, .repeat_penalty = 1.0f};
    st_sampler *s = NULL;
    CHECK(st_sampler_init(&sp, V, &s) == STRATA_OK);
    int32_t t;
    for (int r = 0; r < 3; r++) CHECK(st_sampler_sample_u(s, x + r * V, NULL, 0, 0.5, &t) == STRATA_ERR_INVALID_ARG);
    CHECK_ERR(st_sampler_sample_u(s, x + 4, NULL, 0, 1.0, &t), STRATA_ERR_INVALID_ARG, "u = 1");
    st_sampler_free(s);
}

int main(void) {
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2};
    st_backend *be = NULL;
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    if (!be) return test_finish("test_sample_op");
    check_rule(be);
    check_invalid(be);
    check_next_args(be);
    check_vocab(be, 7, 5, 6);
    check_vocab(be, 1000, 5, 4);
    check_vocab(be, 49152, 5, 1);
    check_vocab(be, 128256, 5, 1);
    st_backend_free(be);
    return test_finish("test_sample_op");
}

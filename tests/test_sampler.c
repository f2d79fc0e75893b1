/* Sampler: greedy = argmax; temperature 0 and top-k 1 are greedy; the empirical
 * distribution of 20000 seeded draws matches softmax(logits / T) restricted as
 * top-k / top-p / min-p say (computed here independently, the way HF
 * transformers' logits warpers write it), and removed tokens are never drawn;
 * the repetition penalty changes exactly the seen tokens; seeds are
 * reproducible; parameter and input errors; speed on a real vocabulary size. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/sampler.h"
#include "testutil.h"

/* deterministic test data */
static uint64_t g_lcg = 12345;
static double urand(void) {
    g_lcg = g_lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_lcg >> 11) * 0x1.0p-53;
}
static float nrand(void) { /* Box-Muller */
    double u = urand(), v = urand();
    if (u < 1e-300) u = 1e-300;
    return (float)(sqrt(-2 * log(u)) * cos(2 * M_PI * v));
}

static int32_t argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int32_t)b;
}

static int cmp_desc_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x > y ? -1 : x < y;
}
typedef struct {
    double p;
    int id;
} pid;
static int cmp_pid_asc(const void *a, const void *b) {
    const pid *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? -1 : 1;
    return x->id > y->id ? -1 : x->id < y->id; /* ties: higher id first (removed first) */
}

/* HF-style reference: penalty, temperature, TopK, TopP (ascending cumsum,
 * remove cum <= 1 - p, keep the last), MinP, softmax. */
static void reference(const float *logits, int V, const st_sampler_params *p, const int32_t *hist,
                      int n_hist, double *out) {
    double *x = malloc((size_t)V * sizeof *x);
    bool *mask = calloc((size_t)V, 1); /* true: removed */
    for (int i = 0; i < V; i++) x[i] = logits[i];
    if (p->repeat_penalty != 1.0f) {
        bool *seen = calloc((size_t)V, 1);
        int from = p->repeat_last_n > 0 && n_hist > p->repeat_last_n ? n_hist - (int)p->repeat_last_n : 0;
        for (int i = from; i < n_hist; i++) seen[hist[i]] = true;
        for (int i = 0; i < V; i++)
            if (seen[i]) x[i] = logits[i] < 0 ? logits[i] * p->repeat_penalty : logits[i] / p->repeat_penalty;
        free(seen);
    }
    /* the penalty is applied in float by the sampler: round the same way */
    for (int i = 0; i < V; i++) x[i] = (float)x[i];
    for (int i = 0; i < V; i++) x[i] /= p->temperature;
    if (p->top_k > 0 && p->top_k < V) {
        double *s = malloc((size_t)V * sizeof *s);
        memcpy(s, x, (size_t)V * sizeof *s);
        qsort(s, (size_t)V, sizeof *s, cmp_desc_d);
        double kth = s[p->top_k - 1];
        for (int i = 0; i < V; i++)
            if (x[i] < kth) mask[i] = true;
        free(s);
    }
    double mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (!mask[i] && x[i] > mx) mx = x[i];
    double *pr = malloc((size_t)V * sizeof *pr);
#define SOFTMAX()                                                     \
    do {                                                              \
        double z = 0;                                                 \
        for (int i = 0; i < V; i++) {                                 \
            pr[i] = mask[i] ? 0 : exp(x[i] - mx);                     \
            z += pr[i];                                               \
        }                                                             \
        for (int i = 0; i < V; i++) pr[i] /= z;                       \
    } while (0)
    if (p->top_p < 1.0f) {
        SOFTMAX();
        pid *a = malloc((size_t)V * sizeof *a);
        for (int i = 0; i < V; i++) a[i] = (pid){pr[i], i};
        qsort(a, (size_t)V, sizeof *a, cmp_pid_asc);
        double cum = 0;
        for (int j = 0; j < V; j++) {
            cum += a[j].p;
            if (cum <= 1.0 - p->top_p && j < V - 1) mask[a[j].id] = true;
        }
        free(a);
    }
    if (p->min_p > 0.0f) {
        SOFTMAX();
        double top = 0;
        for (int i = 0; i < V; i++)
            if (pr[i] > top) top = pr[i];
        for (int i = 0; i < V; i++)
            if (pr[i] < p->min_p * top) mask[i] = true;
    }
    SOFTMAX();
#undef SOFTMAX
    for (int i = 0; i < V; i++) out[i] = pr[i];
    free(pr);
    free(mask);
    free(x);
}

static void test_greedy(void) {
    enum { V = 300 };
    float logits[V];
    st_sampler_params gp = st_sampler_params_default();
    gp.temperature = 0;
    st_sampler_params k1 = st_sampler_params_default();
    k1.top_k = 1;
    k1.temperature = 1.5f;
    st_sampler *g = NULL, *s = NULL;
    CHECK(st_sampler_init(&gp, V, &g) == STRATA_OK);
    CHECK(st_sampler_init(&k1, V, &s) == STRATA_OK);
    int bad_g = 0, bad_k = 0;
    for (int it = 0; it < 200; it++) {
        for (int i = 0; i < V; i++) logits[i] = 3 * nrand();
        int32_t want = argmax(logits, V), a = -1, b = -1;
        CHECK(st_sampler_sample(g, logits, NULL, 0, &a) == STRATA_OK);
        CHECK(st_sampler_sample(s, logits, NULL, 0, &b) == STRATA_OK);
        bad_g += a != want;
        bad_k += b != want;
    }
    CHECK_MSG(bad_g == 0, "greedy != argmax %d times", bad_g);
    CHECK_MSG(bad_k == 0, "top_k=1 != argmax %d times", bad_k);
    /* ties: the lowest id */
    for (int i = 0; i < V; i++) logits[i] = 0;
    logits[7] = logits[200] = 5;
    int32_t t = -1;
    CHECK(st_sampler_sample(g, logits, NULL, 0, &t) == STRATA_OK && t == 7);
    /* a vanishing temperature is greedy too, without NaNs */
    st_sampler_params tiny = st_sampler_params_default();
    tiny.temperature = 1e-30f;
    st_sampler *ts = NULL;
    CHECK(st_sampler_init(&tiny, V, &ts) == STRATA_OK);
    logits[200] = 4.999f;
    for (int i = 0; i < 20; i++) {
        CHECK(st_sampler_sample(ts, logits, NULL, 0, &t) == STRATA_OK);
        CHECK(t == 7);
    }
    st_sampler_free(ts);
    st_sampler_free(g);
    st_sampler_free(s);
}

/* 20000 draws against the reference: every token's frequency within 5 sigma
 * (+ 2 counts), removed tokens never, and a chi-square bound. draft >= 0:
 * the draws are speculative verifications of that draft token
 * (st_sampler_verify): the token they give must still follow the reference,
 * and the draft be accepted at the rate p(draft). */
static void check_distribution_draft(const char *name, const st_sampler_params *p, const float *logits, int V,
                                     const int32_t *hist, int n_hist, int32_t draft) {
    enum { N = 20000 };
    double *ref = malloc((size_t)V * sizeof *ref);
    reference(logits, V, p, hist, n_hist, ref);
    int *count = calloc((size_t)V, sizeof *count);
    st_sampler *s = NULL;
    CHECK(st_sampler_init(p, V, &s) == STRATA_OK);
    if (!s) return;
    /* st_sampler_probs agrees with the reference */
    float *probs = malloc((size_t)V * sizeof *probs);
    CHECK(st_sampler_probs(s, logits, hist, n_hist, probs) == STRATA_OK);
    double max_perr = 0;
    for (int i = 0; i < V; i++) max_perr = fmax(max_perr, fabs(probs[i] - ref[i]));
    CHECK_MSG(max_perr < 1e-5, "%s: st_sampler_probs differs from the reference by %g", name, max_perr);
    for (int i = 0; i < V; i++) CHECK((probs[i] == 0) == (ref[i] == 0));
    int n_acc = 0;
    for (int d = 0; d < N; d++) {
        int32_t t = -1;
        bool ok = false;
        const strata_status st = draft >= 0 ? st_sampler_verify(s, logits, hist, n_hist, draft, &ok, &t)
                                            : st_sampler_sample(s, logits, hist, n_hist, &t);
        if (st != STRATA_OK || t < 0 || t >= V) {
            CHECK(!"sample failed");
            break;
        }
        if (draft >= 0) CHECK(ok == (t == draft));
        n_acc += ok;
        count[t]++;
    }
    if (draft >= 0) {
        const double pa = ref[draft], fa = (double)n_acc / N, sa = sqrt(pa * (1 - pa) / N);
        printf("  %-28s draft %d accepted %.4f of the time, p(draft) %.4f\n", name, draft, fa, pa);
        CHECK_MSG(fabs(fa - pa) <= 5 * sa + 2.0 / N, "%s: draft %d accepted at %.4f, p = %.4f", name, draft, fa, pa);
    }
    int kept = 0, bad = 0, drawn_removed = 0;
    double chi2 = 0, max_err = 0;
    int dof = -1;
    for (int i = 0; i < V; i++) {
        double f = (double)count[i] / N;
        if (ref[i] == 0) {
            drawn_removed += count[i];
            continue;
        }
        kept++;
        double sigma = sqrt(ref[i] * (1 - ref[i]) / N);
        if (fabs(f - ref[i]) > 5 * sigma + 2.0 / N) bad++;
        max_err = fmax(max_err, fabs(f - ref[i]));
        if (ref[i] * N >= 5) {
            chi2 += (count[i] - ref[i] * N) * (count[i] - ref[i] * N) / (ref[i] * N);
            dof++;
        }
    }
    /* chi-square: mean dof, sd sqrt(2 dof); allow 5 sd */
    double chi2_max = dof + 5 * sqrt(2.0 * (dof > 0 ? dof : 1)) + 5;
    printf("  %-28s kept %3d of %d, max |freq - p| %.4f, chi2 %.1f (dof %d, bound %.1f)\n", name, kept, V,
           max_err, chi2, dof, chi2_max);
    CHECK_MSG(drawn_removed == 0, "%s: removed tokens drawn %d times", name, drawn_removed);
    CHECK_MSG(bad == 0, "%s: %d tokens outside 5 sigma", name, bad);
    CHECK_MSG(chi2 <= chi2_max, "%s: chi2 %.1f > %.1f", name, chi2, chi2_max);
    st_sampler_free(s);
    free(probs);
    free(count);
    free(ref);
}

static void check_distribution(const char *name, const st_sampler_params *p, const float *logits, int V,
                               const int32_t *hist, int n_hist) {
    check_distribution_draft(name, p, logits, V, hist, n_hist, -1);
}

static void test_distributions(void) {
    enum { V = 64 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 1.5f * nrand();
    logits[10] = logits[11] = 2.5f; /* a tie at the top-k boundary below */
    int32_t hist[] = {3, 10, 3, 40, 41, 63, 0, 10};
    const int n_hist = (int)(sizeof hist / sizeof hist[0]);
    struct {
        const char *name;
        st_sampler_params p;
        bool with_hist;
    } cfg[] = {
        {"T=1", {1.0f, 0, 1.0f, 0.0f, 1.0f, 0, 1}, false},
        {"T=0.7 top_k=10", {0.7f, 10, 1.0f, 0.0f, 1.0f, 0, 2}, false},
        {"T=1.3 top_p=0.8", {1.3f, 0, 0.8f, 0.0f, 1.0f, 0, 3}, false},
        {"T=1 min_p=0.1", {1.0f, 0, 1.0f, 0.1f, 1.0f, 0, 4}, false},
        {"T=2 top_p=0.5", {2.0f, 0, 0.5f, 0.0f, 1.0f, 0, 5}, false},
        {"T=1 top_p=0.9995 (long tail)", {1.0f, 0, 0.9995f, 0.0f, 1.0f, 0, 8}, false},
        {"T=0.8 k=20 p=0.9 min_p=.05 rp", {0.8f, 20, 0.9f, 0.05f, 1.3f, 0, 6}, true},
        {"T=1 penalty 2, last 4", {1.0f, 0, 1.0f, 0.0f, 2.0f, 4, 7}, true},
    };
    /* top-k at a tie: the 2.5 pair should be the k-th and (k+1)-th largest */
    int above = 0;
    for (int i = 0; i < V; i++) above += logits[i] > 2.5f;
    cfg[1].p.top_k = above + 1; /* threshold falls on the tie: both kept */
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
        check_distribution(cfg[i].name, &cfg[i].p, logits, V, cfg[i].with_hist ? hist : NULL,
                           cfg[i].with_hist ? n_hist : 0);
    double ref[V];
    reference(logits, V, &cfg[1].p, NULL, 0, ref);
    CHECK(ref[10] > 0 && ref[11] > 0);
    /* speculative verification keeps each distribution: drafts likely (the top token), unlikely,
     * and removed by top-k / top-p (never accepted) */
    int top = 0, low = 0;
    for (int i = 1; i < V; i++) {
        if (logits[i] > logits[top]) top = i;
        if (logits[i] < logits[low]) low = i;
    }
    const int drafts[] = {top, 10, low};
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++)
        for (int k = 0; k < 3; k++)
            check_distribution_draft(cfg[i].name, &cfg[i].p, logits, V, cfg[i].with_hist ? hist : NULL,
                                     cfg[i].with_hist ? n_hist : 0, drafts[k]);
    /* greedy: accepted exactly when the draft is the argmax */
    st_sampler_params gp = cfg[0].p;
    gp.temperature = 0;
    st_sampler *g = NULL;
    CHECK(st_sampler_init(&gp, V, &g) == STRATA_OK);
    for (int k = 0; k < 3 && g; k++) {
        bool ok = true;
        int32_t t = -1;
        CHECK(st_sampler_verify(g, logits, NULL, 0, drafts[k], &ok, &t) == STRATA_OK);
        CHECK(t == top && ok == (drafts[k] == top));
    }
    st_sampler_free(g);
}

static void test_penalty(void) {
    enum { V = 32 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 2 * nrand();
    logits[5] = 1.5f;
    logits[6] = -1.5f;
    logits[7] = 0.0f;
    logits[0] = 0.25f; /* the unseen reference token */
    int32_t hist[] = {5, 6, 7, 5, 5, 20};
    st_sampler_params p = st_sampler_params_default();
    p.repeat_penalty = 1.7f;
    st_sampler *s = NULL;
    CHECK(st_sampler_init(&p, V, &s) == STRATA_OK);
    float probs[V];
    CHECK(st_sampler_probs(s, logits, hist, 6, probs) == STRATA_OK);
    /* recover the penalised logits relative to token 0 */
    int wrong = 0;
    for (int i = 0; i < V; i++) {
        bool seen = i == 5 || i == 6 || i == 7 || i == 20;
        float want = !seen ? logits[i] : logits[i] < 0 ? logits[i] * 1.7f : logits[i] / 1.7f;
        double got = log((double)probs[i] / probs[0]) + logits[0];
        if (fabs(got - want) > 1e-4) {
            wrong++;
            fprintf(stderr, "  token %d: penalised logit %.5f, want %.5f (seen %d)\n", i, got, want, seen);
        }
    }
    CHECK_MSG(wrong == 0, "%d tokens penalised wrongly", wrong);
    /* penalty 1 or empty history: no change; logits untouched */
    float before[V];
    memcpy(before, logits, sizeof before);
    float p2[V];
    CHECK(st_sampler_probs(s, logits, NULL, 0, p2) == STRATA_OK);
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(logits[i] - logits[argmax(logits, V)]);
    for (int i = 0; i < V; i++)
        CHECK(fabs(p2[i] - exp(logits[i] - logits[argmax(logits, V)]) / z) < 1e-6);
    CHECK(!memcmp(before, logits, sizeof before));
    /* greedy sees the penalty: token 5 is top, penalty makes 9 win */
    for (int i = 0; i < V; i++) logits[i] = -3;
    logits[5] = 2.0f;
    logits[9] = 1.5f;
    st_sampler_params g = st_sampler_params_default();
    g.temperature = 0;
    g.repeat_penalty = 1.5f;
    st_sampler *gs = NULL;
    CHECK(st_sampler_init(&g, V, &gs) == STRATA_OK);
    int32_t t = -1;
    CHECK(st_sampler_sample(gs, logits, NULL, 0, &t) == STRATA_OK && t == 5);
    CHECK(st_sampler_sample(gs, logits, hist, 1, &t) == STRATA_OK && t == 9);
    st_sampler_free(gs);
    st_sampler_free(s);
}

static void draw_seq(uint64_t seed, const float *logits, int V, int32_t *out, int n) {
    st_sampler_params p = st_sampler_params_default();
    p.seed = seed;
    p.top_k = 40;
    st_sampler *s = NULL;
    CHECK(st_sampler_init(&p, V, &s) == STRATA_OK);
    for (int i = 0; i < n; i++) CHECK(st_sampler_sample(s, logits, out, i, &out[i]) == STRATA_OK);
    st_sampler_free(s);
}

static void test_seeds(void) {
    enum { V = 100, N = 500 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = nrand();
    static int32_t a[N], b[N], c[N];
    draw_seq(42, logits, V, a, N);
    draw_seq(42, logits, V, b, N);
    draw_seq(43, logits, V, c, N);
    CHECK(!memcmp(a, b, sizeof a));
    int same = 0;
    for (int i = 0; i < N; i++) same += a[i] == c[i];
    CHECK_MSG(same < N / 4, "seeds 42 and 43 agree on %d of %d draws", same, N);
    /* reseed restarts the sequence */
    st_sampler_params p = st_sampler_params_default();
    p.seed = 42;
    p.top_k = 40;
    st_sampler *s = NULL;
    CHECK(st_sampler_init(&p, V, &s) == STRATA_OK);
    int32_t x[10];
    for (int i = 0; i < 10; i++) CHECK(st_sampler_sample(s, logits, a, i, &x[i]) == STRATA_OK);
    st_sampler_reseed(s, 42);
    for (int i = 0; i < 10; i++) {
        int32_t y;
        CHECK(st_sampler_sample(s, logits, a, i, &y) == STRATA_OK && y == x[i]);
    }
    CHECK(st_sampler_get_params(s)->seed == 42 && st_sampler_get_params(s)->top_k == 40);
    st_sampler_free(s);
}

static void test_errors(void) {
    st_sampler *s = (st_sampler *)1;
    st_sampler_params p = st_sampler_params_default();
    p.temperature = -1;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "temperature");
    CHECK(s == NULL);
    p = st_sampler_params_default();
    p.temperature = NAN;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "temperature");
    p = st_sampler_params_default();
    p.top_k = -2;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "top_k");
    p = st_sampler_params_default();
    p.top_p = 0;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "top_p");
    p.top_p = 1.5f;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "top_p");
    p = st_sampler_params_default();
    p.min_p = -0.1f;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "min_p");
    p = st_sampler_params_default();
    p.repeat_penalty = 0;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "repeat_penalty");
    p = st_sampler_params_default();
    p.repeat_last_n = -1;
    CHECK_ERR(st_sampler_init(&p, 10, &s), STRATA_ERR_INVALID_ARG, "repeat_last_n");
    CHECK_ERR(st_sampler_init(NULL, 0, &s), STRATA_ERR_INVALID_ARG, "vocabulary");
    st_sampler_free(NULL);

    p = st_sampler_params_default();
    p.repeat_penalty = 1.2f;
    CHECK(st_sampler_init(&p, 4, &s) == STRATA_OK);
    float l[4] = {0, 1, NAN, 2};
    int32_t t = -7;
    CHECK_ERR(st_sampler_sample(s, l, NULL, 0, &t), STRATA_ERR_INVALID_ARG, "NaN", "token 2");
    float inf[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    CHECK_ERR(st_sampler_sample(s, inf, NULL, 0, &t), STRATA_ERR_INVALID_ARG, "-inf");
    float ok[4] = {0, 1, 2, 3};
    int32_t h[2] = {1, 4};
    CHECK_ERR(st_sampler_sample(s, ok, h, 2, &t), STRATA_ERR_INVALID_ARG, "history token 4");
    /* -inf logits are never drawn */
    float some[4] = {-INFINITY, 0, -INFINITY, 0};
    for (int i = 0; i < 200; i++) {
        CHECK(st_sampler_sample(s, some, NULL, 0, &t) == STRATA_OK);
        CHECK(t == 1 || t == 3);
    }
    st_sampler_free(s);
}

static void test_speed(void) {
    enum { V = 49152 };
    float *logits = malloc(V * sizeof *logits);
    for (int i = 0; i < V; i++) logits[i] = 4 * nrand();
    int32_t hist[256];
    for (int i = 0; i < 256; i++) hist[i] = (int32_t)(urand() * V);
    struct {
        const char *name;
        st_sampler_params p;
    } cfg[] = {
        {"greedy", {0.0f, 0, 1.0f, 0.0f, 1.0f, 0, 1}},
        {"T=0.7 k=40 p=0.95 min_p=0.05", {0.7f, 40, 0.95f, 0.05f, 1.0f, 0, 1}},
        {"T=0.7 top_p=0.95, no top-k", {0.7f, 0, 0.95f, 0.0f, 1.1f, 0, 1}},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        st_sampler *s = NULL;
        CHECK(st_sampler_init(&cfg[c].p, V, &s) == STRATA_OK);
        double t0 = st_time_now();
        int n = 50;
        for (int i = 0; i < n; i++) {
            int32_t t;
            CHECK(st_sampler_sample(s, logits, hist, 256, &t) == STRATA_OK);
        }
        printf("  vocab %d, %-30s %.3f ms per token\n", V, cfg[c].name, (st_time_now() - t0) * 1e3 / n);
        st_sampler_free(s);
    }
    free(logits);
}

int main(void) {
    test_greedy();
    test_distributions();
    test_penalty();
    test_seeds();
    test_errors();
    test_speed();
    return test_finish("test_sampler");
}

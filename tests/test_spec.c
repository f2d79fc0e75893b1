/* Speculative decoding's pieces (src/engine/spec.h) without a model: prompt
 * lookup (the longest suffix n-gram, its latest earlier occurrence, what
 * followed it, cut to k), the adaptive draft count, the parameter checks.
 * The whole path (drafts verified in the runner, output equal to plain
 * decoding) is tests/test_runner.c (g); the scheduler's side is
 * tests/test_scheduler.c; the rejection rule is tests/test_sampler.c. */
#include <stdio.h>
#include <string.h>

#include "engine/spec.h"
#include "testutil.h"

static void check_lookup(const char *what, const int32_t *toks, int64_t n, int gmin, int gmax, int64_t k,
                         const int32_t *want, int64_t n_want) {
    int32_t out[64];
    memset(out, 0xff, sizeof out);
    const int64_t got = st_spec_lookup(toks, n, gmin, gmax, k, out);
    CHECK_MSG(got == n_want && (n_want == 0 || memcmp(out, want, (size_t)n_want * sizeof *out) == 0),
              "%s: %lld drafts (want %lld)",
              what, (long long)got, (long long)n_want);
    CHECK_MSG(out[got] == -1, "%s: wrote past its drafts", what);
}

static void test_lookup(void) {
    const int32_t a[] = {1, 2, 3, 4, 1, 2};
    const int32_t wa[] = {3, 4, 1, 2};
    check_lookup("bigram, all that followed", a, 6, 1, 3, 8, wa, 4);
    check_lookup("cut to k", a, 6, 1, 3, 2, wa, 2);
    const int32_t b[] = {5, 6, 7, 5, 6, 8, 5, 6};
    const int32_t wb[] = {8, 5, 6};
    check_lookup("latest occurrence", b, 8, 1, 3, 8, wb, 3);
    /* the longest n-gram wins over a later shorter one: [9 5 6] occurred at 0, [5 6] later */
    const int32_t c[] = {9, 5, 6, 1, 5, 6, 2, 9, 5, 6};
    const int32_t wc[] = {1, 5, 6, 2};
    check_lookup("longest n-gram first", c, 10, 1, 3, 4, wc, 4);
    const int32_t wc2[] = {2, 9, 5, 6};
    check_lookup("bigrams only", c, 10, 2, 2, 4, wc2, 4);
    const int32_t d[] = {1, 2, 3, 4, 5};
    check_lookup("no repeat", d, 5, 1, 3, 8, NULL, 0);
    const int32_t e[] = {7};
    check_lookup("one token", e, 1, 1, 3, 8, NULL, 0);
    const int32_t f[] = {3, 3, 3, 3};
    const int32_t wf[] = {3};
    check_lookup("a run: what followed the trigram's latest occurrence", f, 4, 1, 3, 8, wf, 1);
    check_lookup("k = 0", a, 6, 1, 3, 0, NULL, 0);
    printf("  prompt lookup: 9 cases\n");
}

static void test_best_k(void) {
    CHECK(st_spec_best_k(0.0, 8, 0.1) == 0);
    CHECK(st_spec_best_k(1.0, 8, 0.1) == 8);
    int prev = 0;
    for (double a = 0.05; a < 1.0; a += 0.05) {
        const int k = st_spec_best_k(a, 8, 0.1);
        CHECK_MSG(k >= prev && k >= 0 && k <= 8, "acceptance %.2f: k %d after %d", a, k, prev);
        prev = k;
    }
    /* drafts that do not pay: a verification pass of 1 draft costing 4 one-token steps (the CPU's)
     * needs more than 3 extra tokens from one draft: never */
    CHECK(st_spec_best_k(0.9, 8, 3.0) == 0);
    CHECK(st_spec_best_k(0.1, 8, 0.1) == 0); /* 1.1 tokens for 1.1 of cost: no gain */
    CHECK(st_spec_best_k(0.2, 8, 0.1) == 1);
    /* costlier verification, fewer drafts */
    CHECK(st_spec_best_k(0.8, 16, 0.5) < st_spec_best_k(0.8, 16, 0.02));
    /* the formula at a = 0.8, cost 0.1: (1 - 0.8^(k+1)) / 0.2 / (1 + 0.1 k) is 2.459 at k = 5,
     * 2.470 at k = 6 (the best), 2.448 at k = 7 */
    CHECK(st_spec_best_k(0.8, 16, 0.1) == 6);
    printf("  adaptive k: 0.8 acceptance -> %d drafts (cost 0.1), %d (cost 0.5), %d (cost 0.02)\n",
           st_spec_best_k(0.8, 16, 0.1), st_spec_best_k(0.8, 16, 0.5), st_spec_best_k(0.8, 16, 0.02));
}

static void test_params(void) {
    st_spec_params p = {.mode = ST_SPEC_LOOKUP};
    CHECK(st_spec_params_resolve(&p) == STRATA_OK && p.k_max == 7 && p.ngram_min == 1 && p.ngram_max == 3 &&
          p.step_cost == 0);
    p = (st_spec_params){.mode = ST_SPEC_LOOKUP, .step_cost = -1};
    CHECK_ERR(st_spec_params_resolve(&p), STRATA_ERR_INVALID_ARG, "--spec-cost -1");
    p = (st_spec_params){.mode = ST_SPEC_LOOKUP, .k_max = 33};
    CHECK_ERR(st_spec_params_resolve(&p), STRATA_ERR_INVALID_ARG, "--spec-k 33");
    p = (st_spec_params){.mode = ST_SPEC_DRAFT};
    CHECK_ERR(st_spec_params_resolve(&p), STRATA_ERR_INVALID_ARG, "needs the model (--draft)");
    p = (st_spec_params){.mode = ST_SPEC_LOOKUP, .ngram_min = 4, .ngram_max = 2};
    CHECK_ERR(st_spec_params_resolve(&p), STRATA_ERR_INVALID_ARG, "n-gram lengths 4..2");
    CHECK(strcmp(st_spec_mode_name(ST_SPEC_DRAFT), "draft") == 0);
}

int main(void) {
    test_lookup();
    test_best_k();
    test_params();
    return test_finish("test_spec");
}

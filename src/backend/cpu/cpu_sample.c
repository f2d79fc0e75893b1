/* sample (CPU): backend.h's `sample` op, in double precision with the
 * arithmetic of engine/sampler.c's steps 2-6, so that it picks the same token
 * as st_sampler_sample for the same uniform draw u (tests/test_sample_op.c
 * checks it; the CUDA op is checked against this one).
 *
 * Per row: the first maximum (NaN -> -1, all -inf -> -1); greedy -> it;
 * +inf -> -1; the top_k-th largest logit by an exact radix select over the
 * floats' ordered bits; candidates (logit >= that, not -inf) with
 * prob = exp(x/T - max/T); top-p over the candidates in decreasing logit
 * (ties by id), found among the most probable ones first instead of sorting
 * the whole vocabulary; min-p; then the kept tokens back in increasing id and
 * the draw: the first whose cumulative prob exceeds u x their total. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"

/* SSE-sized vectors: this file is compiled for the baseline ISA */
typedef float smp_v4f __attribute__((vector_size(16)));
typedef int32_t smp_v4i __attribute__((vector_size(16)));

typedef struct {
    int32_t id;
    double logit; /* x / T */
    double prob;  /* exp(logit - top) */
} smp_cand;

static int by_id(const void *a, const void *b) {
    const smp_cand *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int by_prob_desc(const void *a, const void *b) {
    const smp_cand *x = a, *y = b;
    if (x->logit > y->logit) return -1;
    if (x->logit < y->logit) return 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* float -> uint32 in the same order (NaN excluded by the caller) */
static uint32_t fkey(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static float fkey_value(uint32_t k) {
    const uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* The k-th largest of x[0..n) (1 <= k <= n, no NaN), counting repeats:
 * 4 rounds of 8 bits over the ordered keys. */
static float kth_largest(const float *x, int64_t n, int64_t k) {
    uint32_t prefix = 0;
    int64_t need = k; /* rank still wanted among the keys that share the prefix */
    for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int64_t i = 0; i < n; i++) {
            const uint32_t key = fkey(x[i]);
            if ((key & hi_mask) == (prefix & hi_mask)) hist[(key >> shift) & 255u]++;
        }
        int b = 255;
        for (; b > 0; b--) {
            if (hist[b] >= need) break;
            need -= hist[b];
        }
        prefix |= (uint32_t)b << shift;
    }
    return fkey_value(prefix);
}

/* One row; *out = the token or -1. c: [vocab] scratch. */
static void sample_row(const float *x, int64_t V, const st_sample_args *a, smp_cand *c, int32_t *out) {
    /* the first index of the largest value (-1 on a NaN): the max and a NaN flag in 4 x 4 lanes
     * (branch-free), then the first index holding it. 4-lane vectors: this file is built for the
     * baseline ISA (SSE2), where GCC spilled the 8-lane ones to the stack lane by lane (~106 us a
     * step at a 49K vocabulary on the EPYC, 623 us at 128K on the Xeon, ninth/tenth sessions). */
    smp_v4f mx[4], v;
    smp_v4i nan = {0, 0, 0, 0};
    for (int k = 0; k < 4; k++) mx[k] = (smp_v4f){-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t i = 0;
    for (; i + 16 <= V; i += 16)
        for (int k = 0; k < 4; k++) {
            memcpy(&v, x + i + 4 * k, sizeof v);
            nan |= (smp_v4i)(v != v);
            const smp_v4i gt = (smp_v4i)(v > mx[k]);
            mx[k] = (smp_v4f)(((smp_v4i)v & gt) | ((smp_v4i)mx[k] & ~gt));
        }
    float m = -INFINITY;
    bool has_nan = false;
    for (int l = 0; l < 4; l++) {
        has_nan |= nan[l] != 0;
        for (int k = 0; k < 4; k++) m = mx[k][l] > m ? mx[k][l] : m;
    }
    for (; i < V; i++) {
        has_nan |= isnan(x[i]);
        m = x[i] > m ? x[i] : m;
    }
    if (has_nan) {
        *out = -1;
        return;
    }
    int64_t best = 0;
    const smp_v4f mv = {m, m, m, m};
    for (; best + 4 <= V; best += 4) { /* the first 4 holding m, then the lane */
        memcpy(&v, x + best, sizeof v);
        const smp_v4i eq = (smp_v4i)(v == mv);
        if (eq[0] | eq[1] | eq[2] | eq[3]) break;
    }
    while (best < V - 1 && x[best] != m) best++;
    if (x[best] == -INFINITY) {
        *out = -1;
        return;
    }
    if (a->temperature == 0.0f) {
        *out = (int32_t)best;
        return;
    }
    if (x[best] == INFINITY) {
        *out = -1;
        return;
    }
    const double temp = (double)a->temperature;
    const float thresh = a->top_k > 0 && a->top_k < V ? kth_largest(x, V, a->top_k) : -INFINITY;
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        if (x[i] < thresh || x[i] == -INFINITY) continue;
        c[n].id = (int32_t)i;
        c[n].logit = (double)x[i] / temp;
        n++;
    }
    const double top = (double)x[best] / temp;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        c[i].prob = exp(c[i].logit - top);
        sum += c[i].prob;
    }
    if (a->top_p < 1.0f) {
        const double target = (double)a->top_p * sum;
        /* the nucleus is a prefix of the decreasing order: bring the tokens of
         * prob >= tau to the front, lowering tau until they hold the target */
        int64_t front = 0;
        double front_mass = 0;
        for (double tau = 1e-3; front < n; tau *= 1e-3) {
            if (tau < 1e-300) tau = 0;
            for (int64_t i = front; i < n; i++) {
                if (c[i].prob >= tau) {
                    const smp_cand t = c[front];
                    c[front] = c[i];
                    c[i] = t;
                    front_mass += c[front].prob;
                    front++;
                }
            }
            if (front_mass >= target || tau == 0) break;
        }
        qsort(c, (size_t)front, sizeof *c, by_prob_desc);
        double cum = 0;
        int64_t keep = 0;
        while (keep < front) {
            cum += c[keep].prob;
            keep++;
            if (cum >= target) break;
        }
        n = keep;
    }
    if (a->min_p > 0.0f) {
        const double floor_p = (double)a->min_p;
        int64_t w = 0;
        for (int64_t i = 0; i < n; i++)
            if (c[i].prob >= floor_p) c[w++] = c[i];
        n = w;
    }
    if (a->top_p < 1.0f) qsort(c, (size_t)n, sizeof *c, by_id);
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += c[i].prob;
    const double thr = a->u * total;
    double cum = 0;
    for (int64_t i = 0; i < n; i++) {
        cum += c[i].prob;
        if (cum > thr) {
            *out = c[i].id;
            return;
        }
    }
    *out = c[n - 1].id; /* u x total rounded up to the total */
}

strata_status st_cpu_sample(st_cpu *c, const float *logits, int64_t n, int64_t vocab, const st_sample_args *args,
                            int32_t *out) {
    const char *op = "cpu sample";
    for (int64_t i = 0; i < n; i++) {
        const st_sample_args *a = &args[i];
        if (!isfinite(a->temperature) || a->temperature < 0)
            return st_err(STRATA_ERR_INVALID_ARG, "%s: args[%lld].temperature = %g (>= 0; 0: greedy)", op,
                          (long long)i, (double)a->temperature);
        if (a->top_k < 0)
            return st_err(STRATA_ERR_INVALID_ARG, "%s: args[%lld].top_k = %d (>= 0; 0: off)", op, (long long)i,
                          (int)a->top_k);
        if (!(a->top_p > 0 && a->top_p <= 1))
            return st_err(STRATA_ERR_INVALID_ARG, "%s: args[%lld].top_p = %g (in (0, 1])", op, (long long)i,
                          (double)a->top_p);
        if (!(a->min_p >= 0 && a->min_p <= 1))
            return st_err(STRATA_ERR_INVALID_ARG, "%s: args[%lld].min_p = %g (in [0, 1])", op, (long long)i,
                          (double)a->min_p);
        if (!(a->u >= 0 && a->u < 1))
            return st_err(STRATA_ERR_INVALID_ARG, "%s: args[%lld].u = %g (in [0, 1))", op, (long long)i, a->u);
    }
    /* candidates (24 bytes a token of the vocabulary) only where a row samples: greedy rows,
     * a decode step's usual case, need none (no allocation in their step) */
    bool sampled = false;
    for (int64_t i = 0; i < n; i++) sampled |= args[i].temperature > 0.0f;
    smp_cand *cand = sampled ? st_malloc((size_t)vocab * sizeof *cand) : NULL;
    if (sampled && !cand)
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory for a vocabulary of %lld", op, (long long)vocab);
    for (int64_t i = 0; i < n; i++) sample_row(logits + i * vocab, vocab, &args[i], cand, &out[i]);
    st_free(cand);
    return STRATA_OK;
}

/* Sampler: repetition penalty -> temperature -> top-k -> top-p -> min-p ->
 * draw. See sampler.h. */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t id;
    double logit; /* after penalty and temperature */
    double prob;  /* filled once the candidate set is known */
} cand;

struct st_sampler {
    st_sampler_params p;
    int64_t vocab;
    uint64_t rng[4];   /* xoshiro256** */
    float *x;          /* [vocab] working logits */
    uint32_t *seen;    /* [vocab] stamp of the last call that penalised the token */
    uint32_t stamp;
    cand *c;           /* [vocab] candidates */
    float *sel;        /* [vocab] scratch for the k-th largest selection */
};

/* ---- random numbers: splitmix64 seeds xoshiro256** --------------------------------*/
static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4]) {
    const uint64_t r = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* uniform in [0, 1) with 53 random bits */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

void st_sampler_reseed(st_sampler *s, uint64_t seed) {
    uint64_t sm = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&sm);
}

/* ---- parameters -----------------------------------------------------------------------*/
st_sampler_params st_sampler_params_default(void) {
    return (st_sampler_params){.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                               .repeat_penalty = 1.0f, .repeat_last_n = 0, .seed = 0};
}

static strata_status check_params(const st_sampler_params *p, int64_t vocab) {
    if (vocab < 1 || vocab > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: vocabulary size %lld out of range", (long long)vocab);
    if (!isfinite(p->temperature) || p->temperature < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: temperature %g must be >= 0 (0: greedy)",
                      (double)p->temperature);
    if (p->top_k < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: top_k %d must be >= 0 (0: off)", (int)p->top_k);
    if (!(p->top_p > 0 && p->top_p <= 1))
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: top_p %g must be in (0, 1] (1: off)", (double)p->top_p);
    if (!(p->min_p >= 0 && p->min_p <= 1))
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: min_p %g must be in [0, 1] (0: off)", (double)p->min_p);
    if (!isfinite(p->repeat_penalty) || !(p->repeat_penalty > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: repeat_penalty %g must be > 0 (1: off)",
                      (double)p->repeat_penalty);
    if (p->repeat_last_n < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: repeat_last_n %lld must be >= 0 (0: all)",
                      (long long)p->repeat_last_n);
    return STRATA_OK;
}

strata_status st_sampler_init(const st_sampler_params *p, int64_t vocab, st_sampler **out) {
    *out = NULL;
    st_sampler_params def = st_sampler_params_default();
    if (!p) p = &def;
    strata_status st = check_params(p, vocab);
    if (st) return st;
    st_sampler *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "sampler: out of memory for its state (%zu bytes)", sizeof *s);
    s->p = *p;
    s->vocab = vocab;
    st_sampler_reseed(s, p->seed);
    *out = s;
    return STRATA_OK;
}

void st_sampler_free(st_sampler *s) {
    if (!s) return;
    st_free(s->x);
    st_free(s->seen);
    st_free(s->c);
    st_free(s->sel);
    st_free(s);
}

const st_sampler_params *st_sampler_get_params(const st_sampler *s) { return &s->p; }
int64_t st_sampler_vocab(const st_sampler *s) { return s->vocab; }

/* ---- the pipeline ------------------------------------------------------------------------*/
static int cand_by_id(const void *a, const void *b) {
    const cand *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int cand_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit > y->logit) return -1;
    if (x->logit < y->logit) return 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The k-th largest of v[0..n) (1 <= k <= n); reorders v. Quickselect. */
static float kth_largest(float *v, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want];
    }
    return v[want];
}

/* The vocabulary-sized work buffers, allocated at the first draw on the host
 * rather than by st_sampler_init: that runs on the submitting thread (one of
 * the HTTP server's few pool threads, whose malloc arenas then held the
 * buffers of every queued request), a request waiting for a slot holds none,
 * and one sampled on the device never needs them. */
static strata_status sampler_buffers(st_sampler *s) {
    if (s->x) return STRATA_OK;
    const size_t V = (size_t)s->vocab;
    s->seen = st_calloc(V, sizeof *s->seen);
    s->c = st_malloc(V * sizeof *s->c);
    s->sel = st_malloc(V * sizeof *s->sel);
    s->x = st_malloc(V * sizeof *s->x); /* last: set means all are */
    if (s->x && s->seen && s->c && s->sel) return STRATA_OK;
    st_free(s->x);
    st_free(s->seen);
    st_free(s->c);
    st_free(s->sel);
    s->x = NULL;
    s->seen = NULL;
    s->c = NULL;
    s->sel = NULL;
    return st_err(STRATA_ERR_NOMEM, "sampler: out of memory for a vocabulary of %lld", (long long)s->vocab);
}

/* Runs steps 1-5. Greedy: *greedy_id >= 0 and nothing else. Otherwise
 * s->c[0..*n_out) are the surviving candidates in increasing id, prob =
 * exp(logit - top) (not normalised). */
static strata_status prepare(st_sampler *s, const float *logits, const int32_t *hist, int64_t n_hist,
                             int32_t *greedy_id, int64_t *n_out) {
    const int64_t V = s->vocab;
    const st_sampler_params *p = &s->p;
    *greedy_id = -1;
    *n_out = 0;
    if (n_hist < 0 || (n_hist > 0 && !hist))
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: bad history (%lld ids)", (long long)n_hist);
    strata_status st = sampler_buffers(s);
    if (st) return st;
    float *x = s->x;
    for (int64_t i = 0; i < V; i++) {
        if (isnan(logits[i]))
            return st_err(STRATA_ERR_INVALID_ARG, "sampler: logit of token %lld is NaN", (long long)i);
        x[i] = logits[i];
    }
    /* 1. repetition penalty, once per distinct token */
    if (p->repeat_penalty != 1.0f && n_hist > 0) {
        int64_t from = p->repeat_last_n > 0 && n_hist > p->repeat_last_n ? n_hist - p->repeat_last_n : 0;
        if (++s->stamp == 0) { /* wrapped: clear the stamps */
            memset(s->seen, 0, (size_t)V * sizeof *s->seen);
            s->stamp = 1;
        }
        for (int64_t i = from; i < n_hist; i++) {
            int32_t t = hist[i];
            if (t < 0 || t >= V)
                return st_err(STRATA_ERR_INVALID_ARG, "sampler: history token %d (index %lld) is outside the vocabulary [0, %lld)",
                              (int)t, (long long)i, (long long)V);
            if (s->seen[t] == s->stamp) continue;
            s->seen[t] = s->stamp;
            x[t] = x[t] < 0 ? x[t] * p->repeat_penalty : x[t] / p->repeat_penalty;
        }
    } else {
        for (int64_t i = 0; i < n_hist; i++)
            if (hist[i] < 0 || hist[i] >= V)
                return st_err(STRATA_ERR_INVALID_ARG, "sampler: history token %d (index %lld) is outside the vocabulary [0, %lld)",
                              (int)hist[i], (long long)i, (long long)V);
    }
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (x[i] > x[best]) best = i;
    if (x[best] == -INFINITY)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: every logit is -inf");
    /* 2. temperature (0: greedy) */
    if (p->temperature == 0.0f) {
        *greedy_id = (int32_t)best;
        return STRATA_OK;
    }
    if (x[best] == INFINITY)
        return st_err(STRATA_ERR_INVALID_ARG, "sampler: a logit is +inf (no distribution to sample)");
    const double temp = (double)p->temperature;
    /* 3. top-k: the threshold is the k-th largest logit (temperature keeps the order) */
    float thresh = -INFINITY;
    if (p->top_k > 0 && p->top_k < V) {
        memcpy(s->sel, x, (size_t)V * sizeof *x);
        thresh = kth_largest(s->sel, V, p->top_k);
    }
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
        if (x[i] < thresh || x[i] == -INFINITY) continue;
        s->c[n].id = (int32_t)i;
        s->c[n].logit = (double)x[i] / temp;
        n++;
    }
    const double top = (double)x[best] / temp;
    /* softmax over the candidates */
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        s->c[i].prob = exp(s->c[i].logit - top);
        sum += s->c[i].prob;
    }
    /* 4. top-p over the candidates sorted by probability */
    if (p->top_p < 1.0f) {
        const double target = (double)p->top_p * sum;
        /* Sorting the whole vocabulary is slow (~10 ms for 50k tokens); the
         * nucleus is a prefix of the sorted order, so if the tokens with
         * prob >= tau already hold `target`, it lies among them. Move those
         * to the front, lowering tau until they do. */
        int64_t front = 0;
        double front_mass = 0;
        for (double tau = 1e-3; front < n; tau *= 1e-3) {
            if (tau < 1e-300) tau = 0;
            for (int64_t i = front; i < n; i++) {
                if (s->c[i].prob >= tau) {
                    cand t = s->c[front];
                    s->c[front] = s->c[i];
                    s->c[i] = t;
                    front_mass += s->c[front].prob;
                    front++;
                }
            }
            if (front_mass >= target || tau == 0) break;
        }
        qsort(s->c, (size_t)front, sizeof *s->c, cand_desc);
        n = front;
        double cum = 0;
        int64_t keep = 0;
        while (keep < n) {
            cum += s->c[keep].prob;
            keep++;
            if (cum >= target) break;
        }
        n = keep;
    }
    /* 5. min-p: relative to the most probable token (the same before or after
     * renormalisation) */
    if (p->min_p > 0.0f) {
        const double floor_p = (double)p->min_p; /* prob of the top token is exp(0) = 1 */
        int64_t w = 0;
        for (int64_t i = 0; i < n; i++) {
            if (s->c[i].prob < floor_p) continue;
            s->c[w++] = s->c[i];
        }
        n = w;
    }
    /* back to increasing id (top-p reordered them): the draw walks in id order */
    if (p->top_p < 1.0f) qsort(s->c, (size_t)n, sizeof *s->c, cand_by_id);
    *n_out = n;
    return STRATA_OK;
}

/* The kept mass, summed in id order (the order the draw walks). */
static double kept_total(const st_sampler *s, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += s->c[i].prob;
    return sum;
}

/* Steps 1-5, then the draw with u: the first kept token (in increasing id)
 * whose cumulative mass exceeds u x the kept total. */
static strata_status sample_with(st_sampler *s, const float *logits, const int32_t *history, int64_t n_history,
                                 bool draw, double u, int32_t *out) {
    int32_t g;
    int64_t n;
    strata_status st = prepare(s, logits, history, n_history, &g, &n);
    if (st) return st;
    if (g >= 0) {
        *out = g;
        return STRATA_OK;
    }
    if (draw) u = rng_uniform(s->rng);
    const double thr = u * kept_total(s, n);
    double cum = 0;
    for (int64_t i = 0; i < n; i++) {
        cum += s->c[i].prob;
        if (cum > thr) {
            *out = s->c[i].id;
            return STRATA_OK;
        }
    }
    *out = s->c[n - 1].id; /* u x total rounded up to the total */
    return STRATA_OK;
}

strata_status st_sampler_sample(st_sampler *s, const float *logits, const int32_t *history,
                                int64_t n_history, int32_t *out) {
    return sample_with(s, logits, history, n_history, true, 0.0, out);
}

strata_status st_sampler_sample_u(st_sampler *s, const float *logits, const int32_t *history,
                                  int64_t n_history, double u, int32_t *out) {
    if (!(u >= 0.0 && u < 1.0)) return st_err(STRATA_ERR_INVALID_ARG, "sampler: u = %g is outside [0, 1)", u);
    return sample_with(s, logits, history, n_history, false, u, out);
}

strata_status st_sampler_verify(st_sampler *s, const float *logits, const int32_t *history, int64_t n_history,
                                int32_t draft, bool *accepted, int32_t *out) {
    *accepted = false;
    int32_t g;
    int64_t n;
    strata_status st = prepare(s, logits, history, n_history, &g, &n);
    if (st) return st;
    if (g >= 0) { /* greedy: the draft is accepted when it is the argmax */
        *accepted = g == draft;
        *out = g;
        return STRATA_OK;
    }
    const double total = kept_total(s, n);
    double pd = 0;
    for (int64_t i = 0; i < n; i++)
        if (s->c[i].id == draft) pd = s->c[i].prob;
    /* accepted with probability p(draft) */
    if (rng_uniform(s->rng) * total < pd) {
        *accepted = true;
        *out = draft;
        return STRATA_OK;
    }
    /* rejected: a draw from p without the draft, renormalised (the residual max(0, p - q) of a one-hot q) */
    const double thr = rng_uniform(s->rng) * (total - pd);
    double cum = 0;
    int32_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        if (s->c[i].id == draft) continue;
        last = s->c[i].id;
        cum += s->c[i].prob;
        if (cum > thr) {
            *out = s->c[i].id;
            return STRATA_OK;
        }
    }
    if (last < 0) { /* p was all on the draft (rounding): it is accepted after all */
        *accepted = true;
        last = draft;
    }
    *out = last;
    return STRATA_OK;
}

bool st_sampler_device_ok(const st_sampler *s) { return s->p.repeat_penalty == 1.0f; }

void st_sampler_next_args(st_sampler *s, st_sample_args *out) {
    const st_sampler_params *p = &s->p;
    *out = (st_sample_args){.u = 0.0, .temperature = p->temperature, .top_k = p->top_k, .top_p = p->top_p,
                            .min_p = p->min_p};
    if (p->temperature != 0.0f) out->u = rng_uniform(s->rng);
}

strata_status st_sampler_probs(st_sampler *s, const float *logits, const int32_t *history,
                               int64_t n_history, float *probs) {
    int32_t g;
    int64_t n;
    strata_status st = prepare(s, logits, history, n_history, &g, &n);
    if (st) return st;
    memset(probs, 0, (size_t)s->vocab * sizeof *probs);
    if (g >= 0) {
        probs[g] = 1.0f;
        return STRATA_OK;
    }
    const double sum = kept_total(s, n);
    for (int64_t i = 0; i < n; i++) probs[s->c[i].id] = (float)(s->c[i].prob / sum);
    return STRATA_OK;
}

/* Exact RoPE positions (issue 13, item 4): the angles stay exact far past
 * 2^24 tokens, up to the last int32 position.
 *
 * (1) The rope op of the CPU backend at positions 0 .. 2^31 - 1 against an
 *     independent double reference of the angle: pos = ph * 2^16 + pl, both
 *     parts times inv_freq exact in double, cos/sin of the sum by the
 *     addition formulas (libm reduces each part exactly). Each pair is
 *     rotated from (1, 0), so the op's output is (cos, sin) as floats and
 *     atan2 of it is the angle the op used. Its error must stay within what
 *     rounding cos and sin to float allows (2^-24 rad, ~6e-8). Measured in
 *     the same loop, and asserted to fail that bound:
 *       - a float32 angle, float(pos) * inv_freq in float (how an fp32
 *         implementation forms it): off by up to ~1 rad at 2^24, ~3 rad
 *         (whole turns lost) at 2^26;
 *       - the double product pos * inv_freq alone (the formula before
 *         backend/rope_angle.h added its rounding error lo): exact below
 *         2^29, ~1e-7 rad past 2^30.
 *     Below 2^29 the op's bits must equal those of the double product alone
 *     (lo = 0 there: nothing changed for the positions used so far).
 * (2) End to end: logits of the tiny test models (default RoPE, Llama-3
 *     scaling, tied embeddings, bf16 weights, linear scaling on a config
 *     changed in memory) on the CPU with an f32 KV cache, a 20-token
 *     sequence starting at RoPE position 0, 3, 2^24 - 5, 2^26 + 3 and
 *     2^31 - 20 (st_llama_forward_seq_at: 16 tokens as one gathered prefill
 *     chunk, then 4 decode steps through the paged attention), against a
 *     float64 forward pass of the same model written here with the exact
 *     angles, within REL_TOL. The same float64 pass with float32 angles
 *     (everything else exact) must miss REL_TOL at 2^24 and beyond, and is
 *     within it at the small control positions: the tolerance is tight
 *     enough to see the old formula and loose enough for fp32 arithmetic.
 * (3) The bounds: pos_offset outside [0, 2^31 - 1 - last position] is
 *     INVALID_ARG naming pos_offset (forward_seq_at and st_batch).
 * Error measure for logits: max|got - ref| / max|ref| over all rows. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kv/kv_pool.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "testutil.h"

#define PI2 6.283185307179586476925286766559

/* a in (-pi, pi] */
static double wrap(double a) {
    a = fmod(a, PI2);
    if (a > PI2 / 2) a -= PI2;
    if (a <= -PI2 / 2) a += PI2;
    return a;
}

/* cos and sin of pos * f (f a float), independently of backend/rope_angle.h:
 * pos = ph * 2^16 + pl; ph * 2^16 * f (<= 15 + 24 bits) and pl * f (<= 16 +
 * 24 bits) are exact doubles; the addition formulas join them. */
static void ref_cos_sin(int64_t pos, float f, double *c, double *s) {
    const double a = (double)(pos >> 16) * 65536.0 * (double)f, b = (double)(pos & 0xffff) * (double)f;
    const double ca = cos(a), sa = sin(a), cb = cos(b), sb = sin(b);
    *c = ca * cb - sa * sb;
    *s = sa * cb + ca * sb;
}

/* The angle (float32) an fp32 implementation would use. */
static float f32_angle(int64_t pos, float f) {
    volatile float p = (float)pos; /* volatile: no excess precision, no contraction */
    volatile float a = p * f;
    return a;
}

static void inv_freq_of(const st_config *c, float *inv) { st_llama_rope_inv_freq(c, NULL, inv); }

/* ---- (1) the rope op against the angle reference --------------------------------------- */

static void test_rope_angles(st_backend *be) {
    static const int64_t ps[] = {0,
                                 1,
                                 5,
                                 1000,
                                 65537,
                                 (1 << 24) - 1,
                                 1 << 24,
                                 (1 << 24) + 1,
                                 (1 << 24) + 3,
                                 (1 << 26) - 1,
                                 (1 << 26) + 5,
                                 (1 << 26) + 77,
                                 (1 << 29) + 1,
                                 (1 << 30) + 12345,
                                 2147483645,
                                 2147483647};
    enum { NP = sizeof ps / sizeof ps[0] };
    /* bands reported: [lo, hi) */
    static const struct { const char *name; int64_t lo, hi; } bands[] = {
        {"< 2^17", 0, 1 << 17},
        {"~2^24", (1 << 24) - 1, (1 << 24) + 4},
        {"~2^26", (1 << 26) - 1, (1 << 26) + 78},
        {"2^29..2^31", 1 << 29, (int64_t)1 << 31},
    };
    enum { NB = sizeof bands / sizeof bands[0] };
    static const double thetas[] = {10000.0, 500000.0};
    const int64_t hd = 128, half = hd / 2;
    double err_new[NB] = {0}, err_f32[NB] = {0}, err_dbl[NB] = {0};
    for (int ti = 0; ti < 2; ti++) {
        st_config c = {.head_dim = hd, .rope_theta = thetas[ti]};
        float inv[64];
        inv_freq_of(&c, inv);
        int32_t pos[NP];
        for (int i = 0; i < NP; i++) pos[i] = (int32_t)ps[i];
        for (int il = 0; il < 2; il++) {
            float *x = malloc((size_t)(NP * hd) * sizeof(float));
            for (int64_t i = 0; i < NP; i++)
                for (int64_t j = 0; j < half; j++) {
                    const int64_t o0 = il ? 2 * j : j, o1 = il ? 2 * j + 1 : j + half;
                    x[i * hd + o0] = 1.0f;
                    x[i * hd + o1] = 0.0f;
                }
            CHECK(be->ops->rope(be, NULL, x, pos, NP, 1, hd, inv, il) == STRATA_OK);
            for (int64_t i = 0; i < NP; i++) {
                int b = -1;
                for (int k = 0; k < NB; k++)
                    if (ps[i] >= bands[k].lo && ps[i] < bands[k].hi) b = k;
                bool same_as_double = true;
                double worst = 0;
                int64_t worst_j = 0;
                for (int64_t j = 0; j < half; j++) {
                    const int64_t o0 = il ? 2 * j : j, o1 = il ? 2 * j + 1 : j + half;
                    const float cf = x[i * hd + o0], sf = x[i * hd + o1];
                    double rc, rs;
                    ref_cos_sin(ps[i], inv[j], &rc, &rs);
                    const double ref = atan2(rs, rc);
                    const double e_new = fabs(wrap(atan2((double)sf, (double)cf) - ref));
                    const double e_f32 = fabs(wrap((double)f32_angle(ps[i], inv[j]) - ref));
                    const double d = (double)ps[i] * (double)inv[j]; /* the double product alone */
                    const float dc = (float)cos(d), ds = (float)sin(d);
                    const double e_dbl = fabs(wrap(atan2((double)ds, (double)dc) - ref));
                    if (!(e_new <= worst)) worst = e_new, worst_j = j; /* NaN sticks */
                    if (ps[i] < (1 << 29)) same_as_double = same_as_double && cf == dc && sf == ds;
                    if (b >= 0) {
                        if (e_new > err_new[b]) err_new[b] = e_new;
                        if (e_f32 > err_f32[b]) err_f32[b] = e_f32;
                        if (e_dbl > err_dbl[b]) err_dbl[b] = e_dbl;
                    }
                }
                CHECK_MSG(worst <= 6.0e-8, "rope angle at pos %lld: error %.3g rad at inv_freq[%lld] = %.9g",
                          (long long)ps[i], worst, (long long)worst_j, (double)inv[worst_j]);
                CHECK_MSG(same_as_double, "rope at pos %lld (< 2^29): not the bits of the double product",
                          (long long)ps[i]);
            }
            free(x);
        }
    }
    printf("RoPE angle error (rad, max over pairs of head_dim 128, theta 1e4 and 5e5; cos/sin rounded to float):\n");
    printf("  %-12s %-14s %-22s %s\n", "positions", "float32 angle", "double product alone", "now (rope_angle.h)");
    for (int k = 0; k < NB; k++)
        printf("  %-12s %-14.3g %-22.3g %.3g\n", bands[k].name, err_f32[k], err_dbl[k], err_new[k]);
    /* the test can fail: the old formulas miss the bound the op meets */
    CHECK_MSG(err_f32[1] > 0.1 && err_f32[2] > 1.0, "float32 angles should be off by radians: %.3g at 2^24, %.3g at 2^26",
              err_f32[1], err_f32[2]);
    CHECK_MSG(err_f32[0] < 1e-2, "float32 angles are near enough below 2^17: %.3g", err_f32[0]);
    CHECK_MSG(err_dbl[3] > 6.0e-8, "the double product alone should miss 6e-8 past 2^30: %.3g", err_dbl[3]);
}

/* ---- (2) a float64 forward pass of the tiny models -------------------------------------- */

typedef struct {
    const st_config *c;
    double *embed, *lm_head, *norm;
    double **in_norm, **post_norm, **wq, **wk, **wv, **wo, **wg, **wu, **wd;
    float inv[1024];
} ref_model;

static double *tensor_f64(const st_model_files *f, const char *name, int64_t count) {
    const st_tensor_desc *t = st_model_find(f, name);
    CHECK_MSG(t != NULL, "%s: no tensor %s", f->path, name);
    if (!t) return NULL;
    double *out = malloc((size_t)count * sizeof(double));
    const void *p = st_tensor_data(f, t);
    if (t->dtype == ST_DTYPE_F32 && t->nbytes == (uint64_t)count * 4) {
        for (int64_t i = 0; i < count; i++) {
            float v;
            memcpy(&v, (const char *)p + i * 4, 4);
            out[i] = v;
        }
    } else if (t->dtype == ST_DTYPE_BF16 && t->nbytes == (uint64_t)count * 2) {
        for (int64_t i = 0; i < count; i++) {
            uint16_t h;
            memcpy(&h, (const char *)p + i * 2, 2);
            out[i] = st_bf16_to_f32(h);
        }
    } else {
        CHECK_MSG(0, "%s: tensor %s is not f32/bf16 of %lld elements", f->path, name, (long long)count);
        free(out);
        return NULL;
    }
    return out;
}

static double *layer_t(const st_model_files *f, int64_t l, const char *what, int64_t count) {
    char name[128];
    snprintf(name, sizeof name, "model.layers.%lld.%s.weight", (long long)l, what);
    return tensor_f64(f, name, count);
}

static void ref_load(const st_model_files *f, const st_config *c, ref_model *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    const int64_t H = c->hidden_size, V = c->vocab_size, I = c->intermediate_size, L = c->n_layers;
    const int64_t q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
    r->embed = tensor_f64(f, "model.embed_tokens.weight", V * H);
    r->lm_head = c->tie_word_embeddings ? r->embed : tensor_f64(f, "lm_head.weight", V * H);
    r->norm = tensor_f64(f, "model.norm.weight", H);
    double ***all[] = {&r->in_norm, &r->post_norm, &r->wq, &r->wk, &r->wv, &r->wo, &r->wg, &r->wu, &r->wd};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) *all[k] = calloc((size_t)L, sizeof(double *));
    for (int64_t l = 0; l < L; l++) {
        r->in_norm[l] = layer_t(f, l, "input_layernorm", H);
        r->post_norm[l] = layer_t(f, l, "post_attention_layernorm", H);
        r->wq[l] = layer_t(f, l, "self_attn.q_proj", q * H);
        r->wk[l] = layer_t(f, l, "self_attn.k_proj", kv * H);
        r->wv[l] = layer_t(f, l, "self_attn.v_proj", kv * H);
        r->wo[l] = layer_t(f, l, "self_attn.o_proj", H * q);
        r->wg[l] = layer_t(f, l, "mlp.gate_proj", I * H);
        r->wu[l] = layer_t(f, l, "mlp.up_proj", I * H);
        r->wd[l] = layer_t(f, l, "mlp.down_proj", H * I);
    }
    inv_freq_of(c, r->inv);
}

static void ref_free(ref_model *r) {
    if (r->lm_head != r->embed) free(r->lm_head);
    free(r->embed);
    free(r->norm);
    double **all[] = {r->in_norm, r->post_norm, r->wq, r->wk, r->wv, r->wo, r->wg, r->wu, r->wd};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) {
        for (int64_t l = 0; all[k] && l < r->c->n_layers; l++) free(all[k][l]);
        free(all[k]);
    }
}

static bool ref_ok(const ref_model *r) {
    if (!r->embed || !r->lm_head || !r->norm) return false;
    for (int64_t l = 0; l < r->c->n_layers; l++)
        if (!r->in_norm[l] || !r->post_norm[l] || !r->wq[l] || !r->wk[l] || !r->wv[l] || !r->wo[l] || !r->wg[l] ||
            !r->wu[l] || !r->wd[l])
            return false;
    return true;
}

/* y[n, out] = x[n, in] @ w[out, in]^T */
static void mm(const double *x, const double *w, int64_t n, int64_t in, int64_t out, double *y) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t o = 0; o < out; o++) {
            double a = 0;
            for (int64_t k = 0; k < in; k++) a += x[i * in + k] * w[o * in + k];
            y[i * out + o] = a;
        }
}

static void rmsnorm(const double *x, const double *w, int64_t n, int64_t d, double eps, double *y) {
    for (int64_t i = 0; i < n; i++) {
        double ss = 0;
        for (int64_t k = 0; k < d; k++) ss += x[i * d + k] * x[i * d + k];
        const double r = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t k = 0; k < d; k++) y[i * d + k] = x[i * d + k] * r * w[k];
    }
}

enum { ANGLE_EXACT, ANGLE_F32 };

/* x [n, heads, hd], token i at RoPE position p0 + i, pairs as the config says */
static void rope(const ref_model *r, double *x, int64_t n, int64_t heads, int64_t p0, int mode) {
    const int64_t hd = r->c->head_dim, half = hd / 2;
    const bool il = r->c->rope_interleaved;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < half; j++) {
            double c, s;
            if (mode == ANGLE_EXACT) {
                ref_cos_sin(p0 + i, r->inv[j], &c, &s);
            } else {
                const double a = f32_angle(p0 + i, r->inv[j]);
                c = cos(a), s = sin(a);
            }
            for (int64_t h = 0; h < heads; h++) {
                double *v = x + (i * heads + h) * hd;
                const int64_t o0 = il ? 2 * j : j, o1 = il ? 2 * j + 1 : j + half;
                const double x0 = v[o0], x1 = v[o1];
                v[o0] = x0 * c - x1 * s;
                v[o1] = x0 * s + x1 * c;
            }
        }
}

/* logits [n, V] of tokens at RoPE positions p0 .. p0 + n - 1 (causal);
 * k0 [n, n_kv_heads * head_dim]: layer 0's rotated keys (what the KV cache holds) */
static void ref_forward(const ref_model *r, const int32_t *tok, int64_t n, int64_t p0, int mode, double *logits,
                        double *k0) {
    const st_config *c = r->c;
    const int64_t H = c->hidden_size, I = c->intermediate_size, hd = c->head_dim, nh = c->n_heads,
                  nkv = c->n_kv_heads, Q = nh * hd, KV = nkv * hd;
    double *x = malloc((size_t)(n * H) * sizeof(double)), *xn = malloc((size_t)(n * H) * sizeof(double));
    double *q = malloc((size_t)(n * Q) * sizeof(double)), *k = malloc((size_t)(n * KV) * sizeof(double));
    double *v = malloc((size_t)(n * KV) * sizeof(double)), *att = malloc((size_t)(n * Q) * sizeof(double));
    double *tmp = malloc((size_t)(n * H) * sizeof(double)), *g = malloc((size_t)(n * I) * sizeof(double));
    double *u = malloc((size_t)(n * I) * sizeof(double)), *p = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) memcpy(x + i * H, r->embed + (int64_t)tok[i] * H, (size_t)H * sizeof(double));
    const double eps = c->rms_norm_eps, scale = 1.0 / sqrt((double)hd);
    for (int64_t l = 0; l < c->n_layers; l++) {
        rmsnorm(x, r->in_norm[l], n, H, eps, xn);
        mm(xn, r->wq[l], n, H, Q, q);
        mm(xn, r->wk[l], n, H, KV, k);
        mm(xn, r->wv[l], n, H, KV, v);
        rope(r, q, n, nh, p0, mode);
        rope(r, k, n, nkv, p0, mode);
        if (l == 0) memcpy(k0, k, (size_t)(n * KV) * sizeof(double));
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < nh; h++) {
                const int64_t kh = h / (nh / nkv);
                const double *qv = q + (t * nh + h) * hd;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= t; j++) {
                    double d = 0;
                    for (int64_t e = 0; e < hd; e++) d += qv[e] * k[(j * nkv + kh) * hd + e];
                    p[j] = d * scale;
                    if (p[j] > mx) mx = p[j];
                }
                for (int64_t j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                double *o = att + (t * nh + h) * hd;
                for (int64_t e = 0; e < hd; e++) {
                    double a = 0;
                    for (int64_t j = 0; j <= t; j++) a += p[j] * v[(j * nkv + kh) * hd + e];
                    o[e] = a / sum;
                }
            }
        mm(att, r->wo[l], n, Q, H, tmp);
        for (int64_t i = 0; i < n * H; i++) x[i] += tmp[i];
        rmsnorm(x, r->post_norm[l], n, H, eps, xn);
        mm(xn, r->wg[l], n, H, I, g);
        mm(xn, r->wu[l], n, H, I, u);
        for (int64_t i = 0; i < n * I; i++) g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        mm(g, r->wd[l], n, I, H, tmp);
        for (int64_t i = 0; i < n * H; i++) x[i] += tmp[i];
    }
    rmsnorm(x, r->norm, n, H, eps, xn);
    mm(xn, r->lm_head, n, H, c->vocab_size, logits);
    free(x), free(xn), free(q), free(k), free(v), free(att), free(tmp), free(g), free(u), free(p);
}

static double rel_err_f(const float *got, const double *ref, int64_t count) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < count; i++) {
        const double d = fabs((double)got[i] - ref[i]);
        if (!(d <= num)) num = d; /* NaN sticks */
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return num / den;
}

static double rel_err_d(const double *a, const double *ref, int64_t count) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < count; i++) {
        if (fabs(a[i] - ref[i]) > num) num = fabs(a[i] - ref[i]);
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return num / den;
}

/* fp32 arithmetic against float64 on these models: ~1e-6 (measured below);
 * float32 angles move the logits by 1e-3 .. 1 at 2^24 and beyond. */
#define REL_TOL 2e-5
#define N_TOK 20
#define N_PREFILL 16 /* one gathered prefill chunk (forward.c: 16 tokens or more), then decode steps */

static const int64_t g_offsets[] = {0, 3, (1 << 24) - 5, (1 << 26) + 3, 2147483647 - (N_TOK - 1)};
enum { N_OFF = sizeof g_offsets / sizeof g_offsets[0], FIRST_FAR = 2 };

static void test_model(st_backend *be, const char *dir, const char *label, bool linear4) {
    st_model_files *f = NULL;
    CHECK(st_model_open(test_src_path(dir), &f) == STRATA_OK);
    if (!f) return;
    if (linear4) { /* linear scaling, factor 4: positions divided by 4 (no tiny model has it on file) */
        f->config.rope_scaling = ST_ROPE_SCALING_LINEAR;
        f->config.rope_factor = 4.0;
    }
    const st_config *c = &f->config;
    ref_model r;
    ref_load(f, c, &r);
    st_llama_params lp = {.max_seq_len = 64, .max_tokens = 32};
    st_llama *m = NULL;
    st_kv_pool *kv = NULL;
    CHECK(test_llama_open(f, be, &lp, ST_KV_F32, &m, &kv) == STRATA_OK);
    if (!m || !ref_ok(&r)) {
        test_llama_close(m, kv);
        ref_free(&r);
        st_model_close(f);
        return;
    }
    const int64_t V = c->vocab_size;
    int32_t tok[N_TOK];
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N_TOK; i++) tok[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
    float *got = malloc((size_t)(N_TOK * V) * sizeof(float)), *got0 = malloc((size_t)(N_TOK * V) * sizeof(float));
    double *ref = malloc((size_t)(N_TOK * V) * sizeof(double)), *ref32 = malloc((size_t)(N_TOK * V) * sizeof(double));
    const int64_t KV = c->n_kv_heads * c->head_dim;
    double *k0 = malloc((size_t)(N_TOK * KV) * sizeof(double)), *k032 = malloc((size_t)(N_TOK * KV) * sizeof(double));
    float *kc = malloc((size_t)(N_TOK * KV) * sizeof(float));
    printf("%s (head_dim %lld, theta %g%s): rel error of logits vs float64 with exact angles\n", label,
           (long long)c->head_dim, c->rope_theta,
           c->rope_scaling == ST_ROPE_SCALING_LLAMA3   ? ", llama3 scaling"
           : c->rope_scaling == ST_ROPE_SCALING_LINEAR ? ", linear scaling x4"
                                                       : "");
    for (int oi = 0; oi < N_OFF; oi++) {
        const int64_t off = g_offsets[oi];
        strata_status st = st_llama_forward_seq_at(m, kv, tok, N_PREFILL, 0, off, true, got);
        for (int64_t i = N_PREFILL; st == STRATA_OK && i < N_TOK; i++)
            st = st_llama_forward_seq_at(m, kv, tok + i, 1, i, off, true, got + i * V);
        CHECK_MSG(st == STRATA_OK, "%s: forward at pos_offset %lld: %s", label, (long long)off, st_last_error());
        if (st != STRATA_OK) continue;
        if (oi == 0) memcpy(got0, got, (size_t)(N_TOK * V) * sizeof(float));
        ref_forward(&r, tok, N_TOK, off, ANGLE_EXACT, ref, k0);
        ref_forward(&r, tok, N_TOK, off, ANGLE_F32, ref32, k032);
        const double e = rel_err_f(got, ref, N_TOK * V), e32 = rel_err_d(ref32, ref, N_TOK * V);
        /* The logits cannot tell whether the shift was applied at all (RoPE is
         * relative); the cache can: layer 0's keys (slots 0.., f32) hold k
         * turned by the angles of positions off + i. */
        st_kv_layer cache;
        st_event *ready = NULL;
        double ek = INFINITY, ek32 = 0;
        if (st_kv_pool_acquire(kv, 0, &cache, &ready) == STRATA_OK) {
            CHECK(cache.dtype == ST_KV_F32 && cache.n_slots >= N_TOK);
            if (be->ops->copy_d2h(be, st_llama_stream(m), kc, cache.k, (size_t)(N_TOK * KV) * sizeof(float)) ==
                    STRATA_OK &&
                be->ops->stream_sync(be, st_llama_stream(m)) == STRATA_OK) {
                ek = rel_err_f(kc, k0, N_TOK * KV);
                ek32 = rel_err_d(k032, k0, N_TOK * KV);
            }
            st_kv_pool_release(kv, 0, NULL);
        }
        CHECK_MSG(ek <= 1e-5, "%s at pos_offset %lld: layer 0's cached keys off by %.3g", label, (long long)off, ek);
        if (oi >= FIRST_FAR)
            CHECK_MSG(ek32 > 1e-2, "%s at pos_offset %lld: float32 angles should miss the keys: %.3g", label,
                      (long long)off, ek32);
        double shift = 0, den = 0; /* RoPE sees distances only: the same logits as at offset 0 */
        for (int64_t i = 0; i < N_TOK * V; i++) {
            if (fabs((double)got[i] - got0[i]) > shift) shift = fabs((double)got[i] - got0[i]);
            if (fabs((double)got0[i]) > den) den = fabs((double)got0[i]);
        }
        shift /= den;
        printf("  pos_offset %-10lld strata %.2e (float32 angles: %.2e)  keys %.2e (%.2e)  vs offset 0: %.2e\n",
               (long long)off, e, e32, ek, ek32, shift);
        CHECK_MSG(e <= REL_TOL, "%s at pos_offset %lld: logits off by %.3g (tol %.1g)", label, (long long)off, e,
                  REL_TOL);
        CHECK_MSG(shift <= REL_TOL, "%s at pos_offset %lld: %.3g from the logits at offset 0", label, (long long)off,
                  shift);
        if (oi >= FIRST_FAR)
            CHECK_MSG(e32 > 10 * REL_TOL, "%s at pos_offset %lld: float32 angles should fail the tolerance: %.3g",
                      label, (long long)off, e32);
        else
            CHECK_MSG(e32 <= REL_TOL, "%s at pos_offset %lld: float32 angles should pass here: %.3g", label,
                      (long long)off, e32);
    }
    /* (3) the bounds */
    const int64_t last_ok = 2147483647 - (N_TOK - 1);
    CHECK_ERR(st_llama_forward_seq_at(m, kv, tok, N_TOK, 0, last_ok + 1, true, got), STRATA_ERR_INVALID_ARG,
              "pos_offset = 2147483629", "2147483648");
    CHECK_ERR(st_llama_forward_seq_at(m, kv, tok, 1, 0, -1, true, got), STRATA_ERR_INVALID_ARG, "pos_offset = -1");
    {
        const int32_t pos = 3, seq = 0, table = 0, ctx = 4, row = 0;
        const int64_t slot = 3;
        st_batch b = {.n_tokens = 1, .tokens = tok, .pos = &pos, .seq = &seq, .slots = &slot, .n_seqs = 1,
                      .block_tables = &table, .max_blocks = 1, .ctx_lens = &ctx, .logit_rows = &row,
                      .n_logits = 1, .pos_offset = 2147483647 - 2};
        CHECK_ERR(st_llama_forward(m, kv, &b, got), STRATA_ERR_INVALID_ARG, "pos[0] + pos_offset");
        b.pos_offset = -7;
        CHECK_ERR(st_llama_forward(m, kv, &b, got), STRATA_ERR_INVALID_ARG, "pos_offset = -7");
        b.pos_offset = 2147483647 - 3; /* the last position exactly */
        CHECK(st_llama_forward(m, kv, &b, got) == STRATA_OK);
    }
    free(got), free(got0), free(ref), free(ref32), free(k0), free(k032), free(kc);
    test_llama_close(m, kv);
    ref_free(&r);
    st_model_close(f);
}

int main(void) {
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2};
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    if (!be) return test_finish("test_rope_positions");
    test_rope_angles(be);
    test_model(be, "tests/data/models/gqa_f32", "gqa_f32", false);
    test_model(be, "tests/data/models/llama3_f32", "llama3_f32", false);
    test_model(be, "tests/data/models/mha_tied_f32", "mha_tied_f32", false);
    test_model(be, "tests/data/models/headdim_f32", "headdim_f32", false);
    test_model(be, "tests/data/models/llama3_bf16", "llama3_bf16", false);
    test_model(be, "tests/data/models/gqa_f32", "gqa_f32 + linear x4", true);
    st_backend_free(be);
    return test_finish("test_rope_positions");
}

/* CPU element-wise and row-wise ops: get_rows, rmsnorm, rope, swiglu, add.
 * All parallel over rows (or chunks) with the backend's pool; each output
 * element is computed by one thread in a fixed order, so results do not
 * depend on the thread count. */
#include <math.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"
#include "backend/rope_angle.h"

/* Splits [0, n) into items of at least ~`work` scalar operations each. */
static int64_t grain_for(int64_t work_per_item) {
    int64_t g = 32768 / (work_per_item > 0 ? work_per_item : 1);
    return g < 1 ? 1 : g;
}

/* ---- get_rows ---- */

typedef struct {
    const uint8_t *data;
    st_dtype dtype;
    size_t row_bytes;
    int64_t cols;
    const int32_t *ids;
    float *out;
    bool simd;
} get_rows_ctx;

static void get_rows_fn(void *ctx, int64_t b, int64_t e, int ti) {
    const get_rows_ctx *g = ctx;
    for (int64_t i = b; i < e; i++)
        st_cpu_dequant_row(g->dtype, g->data + (size_t)g->ids[i] * g->row_bytes, g->out + i * g->cols,
                           g->cols, g->simd);
}

strata_status st_cpu_get_rows(st_cpu *c, const st_weight *w, const int32_t *ids, int64_t n,
                              float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->rows)
            return st_err(STRATA_ERR_INVALID_ARG, "cpu get_rows: ids[%lld] = %d is outside [0, %lld)",
                          (long long)i, ids[i], (long long)w->rows);
    get_rows_ctx g = {w->data, w->dtype, st_dtype_row_bytes(w->dtype, w->cols), w->cols, ids, out,
                      c->simd};
    st_pool_parallel_for(c->pool, n, grain_for(w->cols), get_rows_fn, &g);
    return STRATA_OK;
}

/* ---- rmsnorm ---- */

typedef struct {
    float *x;
    const float *residual;
    const float *w;
    float eps;
    int64_t d;
    float *out;
} rmsnorm_ctx;

static void rmsnorm_fn(void *ctx, int64_t b, int64_t e, int ti) {
    const rmsnorm_ctx *r = ctx;
    const int64_t d = r->d;
    for (int64_t i = b; i < e; i++) {
        float *xi = r->x + i * d;
        float *oi = r->out + i * d;
        if (r->residual) {
            const float *ri = r->residual + i * d;
            for (int64_t j = 0; j < d; j++) xi[j] += ri[j];
        }
        const float ss = st_dot_f32(xi, xi, d);
        const float inv = 1.0f / sqrtf(ss / (float)d + r->eps);
        for (int64_t j = 0; j < d; j++) oi[j] = (xi[j] * inv) * r->w[j];
    }
}

strata_status st_cpu_rmsnorm(st_cpu *c, float *x, const float *residual, const st_weight *w,
                             float eps, int64_t n, int64_t d, float *out) {
    const float *wf = w->data;
    if (w->dtype != ST_DTYPE_F32) { /* dequantize the (1 x d) weight once */
        strata_status st = st_cpu_scratch_reserve(c, (size_t)d);
        if (st != STRATA_OK) return st;
        st_cpu_dequant_row(w->dtype, w->data, c->scratch[0], d, c->simd);
        wf = c->scratch[0];
    }
    rmsnorm_ctx r = {x, residual, wf, eps, d, out};
    st_pool_parallel_for(c->pool, n, grain_for(3 * d), rmsnorm_fn, &r);
    return STRATA_OK;
}

/* ---- rope ---- */

typedef struct {
    float *x;
    const int32_t *pos;
    int64_t n_heads, head_dim;
    const float *inv_freq;
    bool interleaved;
    float *const *scratch;
} rope_ctx;

static void rope_fn(void *ctx, int64_t b, int64_t e, int ti) {
    const rope_ctx *r = ctx;
    const int64_t hd = r->head_dim, half = hd / 2;
    float *cs = r->scratch[ti], *sn = cs + half;
    for (int64_t i = b; i < e; i++) {
        for (int64_t j = 0; j < half; j++) { /* the angle: backend/rope_angle.h */
            double hi, lo;
            st_rope_angle(r->pos[i], r->inv_freq[j], &hi, &lo);
            double c = cos(hi), s = sin(hi);
            st_rope_fix(lo, &c, &s);
            cs[j] = (float)c;
            sn[j] = (float)s;
        }
        for (int64_t h = 0; h < r->n_heads; h++) {
            float *v = r->x + (i * r->n_heads + h) * hd;
            if (r->interleaved) {
                for (int64_t j = 0; j < half; j++) {
                    const float x0 = v[2 * j], x1 = v[2 * j + 1];
                    v[2 * j] = x0 * cs[j] - x1 * sn[j];
                    v[2 * j + 1] = x0 * sn[j] + x1 * cs[j];
                }
            } else {
                for (int64_t j = 0; j < half; j++) {
                    const float x0 = v[j], x1 = v[j + half];
                    v[j] = x0 * cs[j] - x1 * sn[j];
                    v[j + half] = x0 * sn[j] + x1 * cs[j];
                }
            }
        }
    }
}

strata_status st_cpu_rope(st_cpu *c, float *x, const int32_t *pos, int64_t n, int64_t n_heads,
                          int64_t head_dim, const float *inv_freq, bool interleaved) {
    strata_status st = st_cpu_scratch_reserve(c, (size_t)head_dim);
    if (st != STRATA_OK) return st;
    rope_ctx r = {x, pos, n_heads, head_dim, inv_freq, interleaved, c->scratch};
    st_pool_parallel_for(c->pool, n, grain_for(head_dim * (n_heads * 3 + 20)), rope_fn, &r);
    return STRATA_OK;
}

/* ---- swiglu and add ---- */

#define EW_CHUNK 4096 /* elements per pool item */

typedef struct {
    const float *a;
    const float *b;
    float *out;
    int64_t n;
} ew_ctx;

/* swiglu's items: ~1K expf each (~5 us), chunks of at least 3 (~15 us: far above a wake-up),
 * so that a decode step's 14336 (an 8B FFN) go over 5 threads, not 1, while a small model's
 * 1536 stay on the caller */
#define SWIGLU_CHUNK 1024
#define SWIGLU_GRAIN 3

static void swiglu_fn(void *ctx, int64_t b, int64_t e, int ti) {
    const ew_ctx *w = ctx;
    const int64_t i1 = e * SWIGLU_CHUNK < w->n ? e * SWIGLU_CHUNK : w->n;
    for (int64_t i = b * SWIGLU_CHUNK; i < i1; i++) {
        const float g = w->a[i];
        w->out[i] = (g / (1.0f + expf(-g))) * w->b[i];
    }
}

strata_status st_cpu_swiglu(st_cpu *c, const float *gate, const float *up, int64_t n, float *out) {
    ew_ctx w = {gate, up, out, n};
    st_pool_parallel_for(c->pool, (n + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK, SWIGLU_GRAIN, swiglu_fn, &w);
    return STRATA_OK;
}

static void add_fn(void *ctx, int64_t b, int64_t e, int ti) {
    const ew_ctx *w = ctx;
    const int64_t i1 = e * EW_CHUNK < w->n ? e * EW_CHUNK : w->n;
    for (int64_t i = b * EW_CHUNK; i < i1; i++) w->out[i] += w->b[i];
}

strata_status st_cpu_add(st_cpu *c, float *x, const float *y, int64_t n) {
    ew_ctx w = {NULL, y, x, n};
    st_pool_parallel_for(c->pool, (n + EW_CHUNK - 1) / EW_CHUNK, 16, add_fn, &w);
    return STRATA_OK;
}

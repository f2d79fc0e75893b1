/* CPU backend, thread pool and scalar conversions.
 * Every op is checked against a naive double-precision reference written
 * here, on awkward sizes, with NaN-poisoned outputs; 1 and 2 threads must
 * give bit-identical results; matmul must also give the same bits for a token
 * whatever the batch it is in; both the portable and (when the CPU has it) the
 * SIMD kernels are run, and the quantized dtypes' integer matmul at every ISA
 * level (portable, AVX2, AVX-512 VNNI) against a scalar reference of its
 * documented arithmetic, bit for bit. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_simd.h"
#include "core/pool.h"
#include "core/quant.h"
#include "testutil.h"

/* ---- helpers ---- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd_u32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}
static float rnd_f(void) { return (float)((double)rnd_u32() / 4294967296.0 * 2.0 - 1.0); } /* [-1, 1) */

static float *alloc_f(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }
static float *rand_f(int64_t n, float scale) {
    float *p = alloc_f(n);
    for (int64_t i = 0; i < n; i++) p[i] = rnd_f() * scale;
    return p;
}
static void poison(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
}
static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* max|a - ref| / max|ref| (1 when a holds a NaN). */
static double nerr(const float *a, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return 1.0;
        double e = fabs((double)a[i] - ref[i]);
        if (e > num) num = e;
        if (fabs(ref[i]) > den) den = fabs(ref[i]);
    }
    return den > 0 ? num / den : num;
}

/* max|a - ref| / max(mag): for sums, mag[i] = sum of |terms| of element i,
 * the scale fp32 accumulation error is proportional to (a plain max|ref|
 * would be meaningless for a single element that cancels to ~0). */
static double nerr_mag(const float *a, const double *ref, const double *mag, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return 1.0;
        double e = fabs((double)a[i] - ref[i]);
        if (e > num) num = e;
        if (mag[i] > den) den = mag[i];
    }
    return den > 0 ? num / den : num;
}

/* Worst normalized errors seen, printed at the end. */
enum { W_MATMUL, W_RMSNORM, W_ROPE, W_ATTN, W_SWIGLU, W_COUNT };
static double g_worst[W_COUNT];
static double worst(int which, double e) {
    if (e > g_worst[which]) g_worst[which] = e;
    return e;
}

static bool same_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static st_backend *make_cpu(int threads, size_t cap) {
    st_backend_params p = {.kind = ST_BACKEND_CPU, .n_threads = threads, .device_mem = cap};
    st_backend *be = NULL;
    strata_status st = st_backend_init(&p, &be);
    CHECK_MSG(st == STRATA_OK && be, "cpu init: %s", st_last_error());
    return be;
}

static void set_f16(uint8_t *p, float f) {
    uint16_t h = st_f32_to_f16(f);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* A rows x cols weight of dtype t holding values of magnitude ~scale. K-quants
 * have no quantizer here: random bytes with sane scale fields. */
static uint8_t *make_weight(st_dtype t, int64_t rows, int64_t cols, float scale) {
    size_t rb = st_dtype_row_bytes(t, cols);
    uint8_t *w = malloc(rb * (size_t)rows);
    if (t == ST_DTYPE_Q4_K || t == ST_DTYPE_Q6_K) {
        for (size_t i = 0; i < rb * (size_t)rows; i++) w[i] = (uint8_t)rnd_u32();
        const size_t bb = st_dtype_get(t)->block_bytes;
        for (size_t b = 0; b < rb * (size_t)rows / bb; b++) {
            uint8_t *blk = w + b * bb;
            if (t == ST_DTYPE_Q4_K) {
                set_f16(blk, scale * (0.5f + 0.5f * fabsf(rnd_f())) / 900.0f);
                set_f16(blk + 2, scale * fabsf(rnd_f()) / 60.0f);
            } else {
                set_f16(blk + 208, scale * (0.5f + 0.5f * fabsf(rnd_f())) / 4000.0f);
            }
        }
        return w;
    }
    float *x = rand_f(cols, scale);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) x[i] = rnd_f() * scale;
        CHECK(st_quantize_row(t, x, w + (size_t)r * rb, cols));
    }
    free(x);
    return w;
}

static double *dequant_all(st_dtype t, const uint8_t *w, int64_t rows, int64_t cols) {
    size_t rb = st_dtype_row_bytes(t, cols);
    float *tmp = alloc_f(cols);
    double *out = malloc((size_t)(rows * cols) * sizeof(double));
    for (int64_t r = 0; r < rows; r++) {
        st_dequantize_row(t, w + (size_t)r * rb, tmp, cols);
        for (int64_t i = 0; i < cols; i++) out[r * cols + i] = tmp[i];
    }
    free(tmp);
    return out;
}

/* ---- scalar conversions ---- */

static void test_half_conversions(void) {
    /* the CPU attention's vector fp8 conversion: every byte, NaN and subnormals included, gives the bits
     * of the scalar one */
    for (int b0 = 0; b0 < 256; b0 += 8) {
        st_v16u8 v = {0};
        for (int l = 0; l < 8; l++) v[l] = (uint8_t)(b0 + l);
        const st_v8f f = st_v8f_from_e4m3(st_v8u_from_u8(v));
        for (int l = 0; l < 8; l++)
            CHECK_MSG(f2u(f[l]) == f2u(st_kv_fp8_to_f32((uint8_t)(b0 + l))), "fp8 %02x -> %08x (scalar %08x)",
                      b0 + l, f2u(f[l]), f2u(st_kv_fp8_to_f32((uint8_t)(b0 + l))));
    }
    static const struct { uint16_t h; uint32_t f; } f16_exact[] = {
        {0x0000, 0x00000000}, {0x8000, 0x80000000}, {0x3c00, 0x3f800000}, {0xc000, 0xc0000000},
        {0x0001, 0x33800000}, /* smallest subnormal 2^-24 */
        {0x8001, 0xb3800000}, {0x03ff, 0x387fc000}, /* largest subnormal */
        {0x0400, 0x38800000}, /* smallest normal 2^-14 */
        {0x7bff, 0x477fe000}, /* 65504 */
        {0x7c00, 0x7f800000}, {0xfc00, 0xff800000}, {0x3555, 0x3eaaa000},
    };
    for (size_t i = 0; i < sizeof f16_exact / sizeof f16_exact[0]; i++) {
        CHECK_MSG(f2u(st_f16_to_f32(f16_exact[i].h)) == f16_exact[i].f, "f16 %04x -> %08x",
                  f16_exact[i].h, f2u(st_f16_to_f32(f16_exact[i].h)));
        CHECK_MSG(st_f32_to_f16(u2f(f16_exact[i].f)) == f16_exact[i].h, "f32 %08x -> f16 %04x",
                  f16_exact[i].f, st_f32_to_f16(u2f(f16_exact[i].f)));
    }
    static const struct { uint32_t f; uint16_t h; } f16_round[] = {
        {0x3f801000, 0x3c00}, /* 1 + 2^-11: tie -> even (down) */
        {0x3f803000, 0x3c02}, /* 1 + 3*2^-11: tie -> even (up) */
        {0x3f801001, 0x3c01}, /* just above the tie */
        {0x477fefff, 0x7bff}, /* just below 65520 */
        {0x477ff000, 0x7c00}, /* 65520: tie -> even = inf */
        {0x7f7fffff, 0x7c00}, /* FLT_MAX -> inf */
        {0xff7fffff, 0xfc00},
        {0x33000000, 0x0000}, /* 2^-25: tie between 0 and the smallest subnormal -> 0 */
        {0x33000001, 0x0001},
        {0x33a00000, 0x0001}, /* 1.25 * 2^-24 */
        {0x33c00000, 0x0002}, /* 1.5 * 2^-24: tie -> even */
        {0x387fe000, 0x0400}, /* tie between largest subnormal and smallest normal -> even */
        {0x00000001, 0x0000}, /* f32 subnormal */
        {0x80000001, 0x8000},
    };
    for (size_t i = 0; i < sizeof f16_round / sizeof f16_round[0]; i++)
        CHECK_MSG(st_f32_to_f16(u2f(f16_round[i].f)) == f16_round[i].h, "f32 %08x -> f16 %04x, want %04x",
                  f16_round[i].f, st_f32_to_f16(u2f(f16_round[i].f)), f16_round[i].h);
    /* NaN stays NaN both ways */
    uint16_t hn = st_f32_to_f16(NAN);
    CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x03ff) != 0);
    CHECK(isnan(st_f16_to_f32(0x7e00)) && isnan(st_f16_to_f32(0xfc01)));
    uint16_t hs = st_f32_to_f16(u2f(0x7f800001)); /* signalling NaN whose payload is all low bits */
    CHECK((hs & 0x7c00) == 0x7c00 && (hs & 0x03ff) != 0);
    /* Every non-NaN f16 round-trips through f32 exactly. */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
        if (st_f32_to_f16(st_f16_to_f32((uint16_t)h)) != h) bad++;
    }
    CHECK_MSG(bad == 0, "%d f16 values do not round-trip", bad);

    static const struct { uint32_t f; uint16_t b; } bf16[] = {
        {0x3f800000, 0x3f80}, {0x3f808000, 0x3f80}, /* tie -> even (down) */
        {0x3f818000, 0x3f82}, /* tie -> even (up) */
        {0x3f808001, 0x3f81}, {0xbf80ffff, 0xbf81},
        {0x7f7fffff, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
        {0x00000001, 0x0000}, {0x00008000, 0x0000}, /* subnormal tie -> even */
        {0x00018000, 0x0002}, {0x80000000, 0x8000},
        {0x7fc00000, 0x7fc0}, /* quiet NaN */
        {0x7f800001, 0x7fc0}, /* signalling NaN: quieted, not rounded to inf */
        {0xff800001, 0xffc0},
    };
    for (size_t i = 0; i < sizeof bf16 / sizeof bf16[0]; i++)
        CHECK_MSG(st_f32_to_bf16(u2f(bf16[i].f)) == bf16[i].b, "f32 %08x -> bf16 %04x, want %04x",
                  bf16[i].f, st_f32_to_bf16(u2f(bf16[i].f)), bf16[i].b);
    CHECK(f2u(st_bf16_to_f32(0x3f80)) == 0x3f800000);
    CHECK(f2u(st_bf16_to_f32(0x0001)) == 0x00010000); /* subnormal */
    CHECK(f2u(st_bf16_to_f32(0xff80)) == 0xff800000);
    bad = 0;
    for (uint32_t b = 0; b < 65536; b++) {
        if ((b & 0x7f80) == 0x7f80 && (b & 0x7f)) continue;
        if (st_f32_to_bf16(st_bf16_to_f32((uint16_t)b)) != b) bad++;
    }
    CHECK_MSG(bad == 0, "%d bf16 values do not round-trip", bad);
}

/* ---- pool ---- */

typedef struct {
    int *hits;
    int max_index;
    int n_threads;
} pool_ctx;

static void pool_fn(void *ctx, int64_t b, int64_t e, int ti) {
    pool_ctx *c = ctx;
    for (int64_t i = b; i < e; i++) __atomic_fetch_add(&c->hits[i], 1, __ATOMIC_RELAXED);
    if (ti < 0 || ti >= c->n_threads) __atomic_store_n(&c->max_index, 1 << 30, __ATOMIC_RELAXED);
}

typedef struct {
    int64_t grain;
    int64_t min_chunk;
    int64_t n;
} grain_ctx;
static void grain_fn(void *ctx, int64_t b, int64_t e, int ti) {
    grain_ctx *g = ctx;
    /* every chunk but the last is at least `grain` long */
    if (e != g->n && e - b < g->grain) __atomic_store_n(&g->min_chunk, e - b, __ATOMIC_RELAXED);
}

typedef struct {
    int seen[4];
} who_ctx;
static void who_fn(void *ctx, int64_t b, int64_t e, int ti) {
    who_ctx *w = ctx;
    volatile double acc = 0;
    for (int64_t i = b; i < e; i++)
        for (int k = 0; k < 20000; k++) acc = acc + 1e-9 * k;
    __atomic_store_n(&w->seen[ti], 1, __ATOMIC_RELAXED);
}

static void test_pool(void) {
    for (int nt = 1; nt <= 3; nt++) {
        st_pool *p = NULL;
        CHECK(st_pool_init(nt, &p) == STRATA_OK);
        CHECK(st_pool_threads(p) == nt);
        const int64_t sizes[] = {0, 1, 2, 7, 100, 1000, 4097};
        for (int rep = 0; rep < 200; rep++) {
            int64_t n = sizes[rep % 7];
            int *hits = calloc((size_t)n + 1, sizeof(int));
            pool_ctx c = {hits, 0, nt};
            st_pool_parallel_for(p, n, 1 + rep % 5, pool_fn, &c);
            int ok = 1;
            for (int64_t i = 0; i < n; i++) ok &= hits[i] == 1;
            CHECK_MSG(ok, "threads %d n %lld: an item was not run exactly once", nt, (long long)n);
            CHECK(c.max_index == 0);
            free(hits);
        }
        grain_ctx g = {50, 1 << 30, 1000};
        st_pool_parallel_for(p, 1000, 50, grain_fn, &g);
        CHECK(g.min_chunk == 1 << 30);
        st_pool_free(p);
    }
    /* with long items, the worker joins at least once in a few tries */
    {
        st_pool *p = NULL;
        CHECK(st_pool_init(2, &p) == STRATA_OK);
        bool both = false;
        for (int rep = 0; rep < 50 && !both; rep++) {
            who_ctx w = {{0}};
            st_pool_parallel_for(p, 64, 1, who_fn, &w);
            both = w.seen[0] && w.seen[1];
        }
        CHECK_MSG(both, "the pool's worker never took part");
        /* an idle pool sleeps: its spinning is bounded in time (well under
         * 20 ms of CPU over 100 ms idle), and a sleeping worker is woken */
        struct timespec c0, c1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
        usleep(100000);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
        const double idle_cpu = (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec);
        CHECK_MSG(idle_cpu < 0.02, "an idle pool used %.3f s of CPU in 0.1 s", idle_cpu);
        both = false;
        for (int rep = 0; rep < 50 && !both; rep++) {
            usleep(1000); /* past the spin: the worker sleeps */
            who_ctx w = {{0}};
            st_pool_parallel_for(p, 64, 1, who_fn, &w);
            both = w.seen[0] && w.seen[1];
        }
        CHECK_MSG(both, "the pool's sleeping worker never took part");
        st_pool_free(p);
    }
    st_pool *p = NULL;
    CHECK(st_pool_init(0, &p) == STRATA_OK);
    CHECK(st_pool_threads(p) >= 1);
    st_pool_free(p);
    st_pool_free(NULL);
}

/* ---- memory, streams, init ---- */

static void test_memory_and_streams(void) {
    st_backend *be = make_cpu(2, 1000);
    if (!be) return;
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK(be->ops->alloc(be, 600, &a) == STRATA_OK && a);
    CHECK(((uintptr_t)a & 63) == 0);
    memset(a, 0xab, 600);
    CHECK_ERR(be->ops->alloc(be, 600, &b), STRATA_ERR_NOMEM, "600", "1000");
    CHECK(b == NULL);
    CHECK(be->device_budget.used == 600 && be->device_budget.peak == 600);
    CHECK(be->ops->alloc(be, 400, &b) == STRATA_OK && b);
    CHECK(((uintptr_t)b & 63) == 0);
    CHECK(be->device_budget.used == 1000 && be->device_budget.peak == 1000);
    CHECK_ERR(be->ops->alloc(be, 1, &c), STRATA_ERR_NOMEM, "budget");
    be->ops->dealloc(be, a);
    CHECK(be->device_budget.used == 400);
    CHECK(be->ops->alloc(be, 0, &c) == STRATA_OK && c);
    be->ops->dealloc(be, c);
    be->ops->dealloc(be, b);
    be->ops->dealloc(be, NULL);
    CHECK(be->device_budget.used == 0 && be->device_budget.peak == 1000);

    void *h = NULL;
    CHECK(be->ops->host_alloc(be, 12345, &h) == STRATA_OK && h && ((uintptr_t)h & 63) == 0);
    CHECK(be->device_budget.used == 0); /* host memory is not counted */
    float src[37], dst[37];
    for (int i = 0; i < 37; i++) src[i] = (float)i * 0.5f;
    void *dev = NULL;
    bool owned = true;
    CHECK(be->ops->upload(be, src, sizeof src, &dev, &owned) == STRATA_OK);
    CHECK(dev == (void *)src && !owned);

    st_stream *s1 = NULL, *s2 = NULL;
    st_event *ev = NULL;
    CHECK(be->ops->stream_create(be, false, &s1) == STRATA_OK && s1);
    CHECK(be->ops->stream_create(be, true, &s2) == STRATA_OK && s2);
    CHECK(be->ops->event_create(be, &ev) == STRATA_OK && ev);
    CHECK(be->ops->copy_h2d(be, s1, h, src, sizeof src) == STRATA_OK);
    CHECK(be->ops->event_record(be, ev, s1) == STRATA_OK);
    CHECK(be->ops->stream_wait_event(be, s2, ev) == STRATA_OK);
    CHECK(be->ops->copy_d2d(be, s2, (char *)h + 4096, h, sizeof src) == STRATA_OK);
    CHECK(be->ops->copy_d2h(be, s2, dst, (char *)h + 4096, sizeof src) == STRATA_OK);
    CHECK(be->ops->event_sync(be, ev) == STRATA_OK);
    CHECK(be->ops->stream_sync(be, s1) == STRATA_OK && be->ops->stream_sync(be, s2) == STRATA_OK);
    CHECK(memcmp(src, dst, sizeof src) == 0);
    be->ops->event_destroy(be, ev);
    be->ops->stream_destroy(be, s1);
    be->ops->stream_destroy(be, s2);
    be->ops->stream_destroy(be, NULL);
    be->ops->event_destroy(be, NULL);
    be->ops->host_dealloc(be, h);
    be->ops->host_dealloc(be, NULL);
    st_backend_free(be);

    /* unlimited */
    be = make_cpu(1, 0);
    if (!be) return;
    CHECK(be->ops->alloc(be, 64u << 20, &a) == STRATA_OK);
    CHECK(be->device_budget.peak == 64u << 20);
    be->ops->dealloc(be, a);
    CHECK(strcmp(be->ops->name, "cpu") == 0 && be->kind == ST_BACKEND_CPU);
    st_backend_free(be);
    st_backend_free(NULL);
}

static void test_init(void) {
    CHECK(st_backend_available(ST_BACKEND_CPU));
    st_backend_params p = {.kind = ST_BACKEND_CUDA};
    st_backend sentinel;
    st_backend *be = &sentinel; /* must be reset to NULL on failure */
#ifndef STRATA_HAVE_CUDA
    CHECK(!st_backend_available(ST_BACKEND_CUDA));
    CHECK_ERR(st_backend_init(&p, &be), STRATA_ERR_UNSUPPORTED, "CUDA backend not built");
    CHECK(be == NULL);
#endif
    p.kind = (st_backend_kind)42;
    CHECK_ERR(st_backend_init(&p, &be), STRATA_ERR_INVALID_ARG, "kind");
    CHECK(be == NULL);
}

/* ---- matmul ---- */

static void ref_matmul(const float *x, const double *w, int64_t n, int64_t N, int64_t K, double *y,
                       double *mag) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < N; r++) {
            double s = 0, m = 0;
            for (int64_t k = 0; k < K; k++) {
                s += (double)x[t * K + k] * w[r * K + k];
                m += fabs((double)x[t * K + k] * w[r * K + k]);
            }
            y[t * N + r] = s;
            mag[t * N + r] = m;
        }
}

static void run_matmul(st_backend *be, const float *x, const st_weight *w, int64_t n, float *y) {
    poison(y, n * w->rows);
    strata_status st = be->ops->matmul(be, NULL, x, w, n, y);
    CHECK_MSG(st == STRATA_OK, "matmul: %s", st_last_error());
}

static void check_matmul_case(st_backend *b1, st_backend *b2, st_dtype t, int64_t n, int64_t N, int64_t K,
                              const char *mode) {
    uint8_t *wd = make_weight(t, N, K, 1.0f);
    st_weight w = {wd, t, N, K, 0};
    float *x = rand_f(n * K, 1.0f);
    double *wref = dequant_all(t, wd, N, K);
    double *yref = malloc((size_t)(n * N) * sizeof(double)), *mag = malloc((size_t)(n * N) * sizeof(double));
    ref_matmul(x, wref, n, N, K, yref, mag);
    float *y1 = alloc_f(n * N), *y2 = alloc_f(n * N), *y3 = alloc_f(N);
    run_matmul(b1, x, &w, n, y1);
    run_matmul(b2, x, &w, n, y2);
    double e = worst(W_MATMUL, nerr_mag(y1, yref, mag, n * N));
    CHECK_MSG(e < 1e-6, "matmul %s %s n=%lld N=%lld K=%lld: error %.3g", mode, st_dtype_name(t),
              (long long)n, (long long)N, (long long)K, e);
    CHECK_MSG(same_bits(y1, y2, n * N), "matmul %s %s n=%lld N=%lld K=%lld: 1 and 2 threads differ", mode,
              st_dtype_name(t), (long long)n, (long long)N, (long long)K);
    /* batch invariance: token t alone gives the same bits */
    const int64_t probe[] = {0, n / 2, n - 1};
    for (int i = 0; i < 3; i++) {
        int64_t tk = probe[i];
        run_matmul(b2, x + tk * K, &w, 1, y3);
        CHECK_MSG(same_bits(y3, y1 + tk * N, N), "matmul %s %s n=%lld K=%lld: token %lld alone differs",
                  mode, st_dtype_name(t), (long long)n, (long long)K, (long long)tk);
    }
    free(wd);
    free(x);
    free(wref);
    free(yref);
    free(mag);
    free(y1);
    free(y2);
    free(y3);
}

static void test_matmul(st_backend *b1, st_backend *b2, const char *mode) {
    static const int64_t ns[] = {1, 3, 17, 64};
    static const int64_t Ns[] = {1, 5, 67};
    for (int t = 0; t < ST_DTYPE_COUNT; t++) {
        const st_dtype dt = (st_dtype)t;
        const int64_t be = st_dtype_get(dt)->block_elems;
        int64_t Ks[4];
        int nk = 0;
        if (be == 1) { Ks[0] = 7; Ks[1] = 33; Ks[2] = 96; Ks[3] = 288; nk = 4; }
        else if (be == 32) { Ks[0] = 32; Ks[1] = 96; Ks[2] = 288; nk = 3; }
        else { Ks[0] = 256; Ks[1] = 768; nk = 2; }
        for (int ki = 0; ki < nk; ki++)
            for (int ni = 0; ni < 4; ni++)
                for (int ri = 0; ri < 3; ri++) check_matmul_case(b1, b2, dt, ns[ni], Ns[ri], Ks[ki], mode);
    }
    /* several token tiles (K = 2048 -> 32-token tiles), many row blocks */
    check_matmul_case(b1, b2, ST_DTYPE_Q8_0, 75, 130, 2048, mode);
    check_matmul_case(b1, b2, ST_DTYPE_BF16, 70, 9, 2050, mode);
    check_matmul_case(b1, b2, ST_DTYPE_F32, 129, 33, 4099, mode);

    /* argument errors */
    float x[64], y[64];
    uint8_t wd[64] = {0};
    st_weight w = {wd, ST_DTYPE_Q8_0, 1, 33, 0};
    CHECK_ERR(b1->ops->matmul(b1, NULL, x, &w, 1, y), STRATA_ERR_INVALID_ARG, "multiple");
    w.dtype = (st_dtype)99;
    CHECK_ERR(b1->ops->matmul(b1, NULL, x, &w, 1, y), STRATA_ERR_INVALID_ARG, "dtype");
    w = (st_weight){NULL, ST_DTYPE_F32, 2, 4, 0};
    CHECK_ERR(b1->ops->matmul(b1, NULL, x, &w, 1, y), STRATA_ERR_INVALID_ARG, "NULL");
    w.data = wd;
    CHECK(b1->ops->matmul(b1, NULL, x, &w, 0, y) == STRATA_OK);
    CHECK_ERR(b1->ops->matmul(b1, NULL, x, &w, 2, x + 3), STRATA_ERR_INVALID_ARG, "overlaps");
}

/* ---- the quantized dtypes' integer matmul (cpu_qi.h, cpu_matmul_int.c) ----
 * A scalar reference of its documented arithmetic, matched bit for bit at
 * every ISA level, thread count and n; and its error against the f32 product
 * of the dequantized weights on activations with outliers. */

static float ld_h(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return st_f16_to_f32(h);
}

/* Units of one row: w[nu][32] integers, dw, mw (see cpu_qi.h). */
static int64_t ref_units(st_dtype t, const uint8_t *row, int64_t K, int32_t *w, float *dw, float *mw) {
    int64_t nu = 0;
    if (t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1) {
        const int64_t bb = t == ST_DTYPE_Q8_0 ? 34 : t == ST_DTYPE_Q4_0 ? 18 : 20;
        for (int64_t b = 0; b < K / 32; b++, nu++) {
            const uint8_t *blk = row + bb * b;
            dw[nu] = ld_h(blk);
            mw[nu] = t == ST_DTYPE_Q4_1 ? ld_h(blk + 2) : 0.0f;
            for (int i = 0; i < 32; i++) {
                if (t == ST_DTYPE_Q8_0) {
                    w[32 * nu + i] = (int8_t)blk[2 + i];
                } else {
                    const uint8_t q = blk[(t == ST_DTYPE_Q4_0 ? 2 : 4) + i % 16];
                    w[32 * nu + i] = (i < 16 ? q & 15 : q >> 4) - (t == ST_DTYPE_Q4_0 ? 8 : 0);
                }
            }
        }
    } else if (t == ST_DTYPE_Q4_K) {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *blk = row + 144 * sb, *sc = blk + 4;
            for (int j = 0; j < 8; j++, nu++) {
                int s, m;
                if (j < 4) {
                    s = sc[j] & 63, m = sc[j + 4] & 63;
                } else {
                    s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
                    m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                }
                dw[nu] = ld_h(blk) * (float)s;
                mw[nu] = -(ld_h(blk + 2) * (float)m);
                for (int l = 0; l < 32; l++) {
                    const uint8_t q = blk[16 + 32 * (j / 2) + l];
                    w[32 * nu + l] = j % 2 ? q >> 4 : q & 15;
                }
            }
        }
    } else {
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *blk = row + 210 * sb;
            for (int g16 = 0; g16 < 16; g16++, nu++) {
                const int h = g16 / 8, g = (g16 / 2) % 4, hf = g16 % 2;
                dw[nu] = ld_h(blk + 208) * (float)(int8_t)blk[192 + g16];
                mw[nu] = 0.0f;
                for (int i = 0; i < 32; i++) w[32 * nu + i] = 0;
                for (int l = 0; l < 16; l++) {
                    const int lo = (blk[64 * h + 32 * (g % 2) + 16 * hf + l] >> (g < 2 ? 0 : 4)) & 15;
                    const int hi = (blk[128 + 32 * h + 16 * hf + l] >> (2 * g)) & 3;
                    w[32 * nu + 16 * hf + l] = (lo | (hi << 4)) - 32;
                }
            }
        }
    }
    return nu;
}

/* The documented arithmetic, one output at a time, in plain C; act8: int8
 * activations (QMAX 127). */
static void ref_matmul_int(st_dtype t, const uint8_t *wd, const float *x, int64_t n, int64_t N, int64_t K, float *y,
                           bool act8) {
    const float qmax = act8 ? 127.0f : t == ST_DTYPE_Q8_0 ? 524287.0f : 4194303.0f;
    const int64_t nb = K / 32, ups = t == ST_DTYPE_Q6_K ? 2 : 1;
    int32_t *a = malloc((size_t)K * sizeof *a), *w = malloc((size_t)K * 2 * sizeof *w);
    float *dx = alloc_f(nb), *sx = alloc_f(nb), *dw = alloc_f(2 * nb), *mw = alloc_f(2 * nb);
    const size_t rb = st_dtype_row_bytes(t, K);
    for (int64_t tk = 0; tk < n; tk++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + tk * K + 32 * b;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
            const float d = amax / qmax;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                float q = d > 0.0f ? rintf(xb[i] / d) : 0.0f;
                q = q < -qmax ? -qmax : q > qmax ? qmax : q;
                a[32 * b + i] = (int32_t)q;
                sum += (int32_t)q;
            }
            dx[b] = d > 0.0f ? d : 0.0f;
            sx[b] = d > 0.0f ? d * (float)sum : 0.0f;
        }
        for (int64_t r = 0; r < N; r++) {
            const int64_t nu = ref_units(t, wd + (size_t)r * rb, K, w, dw, mw);
            float acc[8] = {0};
            for (int64_t u = 0; u < nu; u++) {
                const int64_t b = u / ups;
                int32_t S = 0;
                for (int i = 0; i < 32; i++) S += w[32 * u + i] * a[32 * b + i];
                float f = (dw[u] * dx[b]) * (float)S;
                if (t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K) f = f + mw[u] * sx[b];
                acc[u % 8] += f;
            }
            y[tk * N + r] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        }
    }
    free(a);
    free(w);
    free(dx);
    free(sx);
    free(dw);
    free(mw);
}

static bool is_int_dtype(st_dtype t) {
    return t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K || t == ST_DTYPE_Q6_K;
}

/* Activations shaped like a model's hidden states: mostly small, a few
 * channels 20x larger. */
static float *outlier_acts(int64_t n, int64_t K) {
    float *x = rand_f(n * K, 1.0f);
    for (int64_t k = 0; k < K; k += 37) /* fixed outlier channels */
        for (int64_t t = 0; t < n; t++) x[t * K + k] *= 20.0f;
    return x;
}

static double g_int_err[2][ST_DTYPE_COUNT];

/* Every level of each activation precision gives the bits of the scalar
 * reference (n = 1..9 and 64, N not a multiple of 8, 1 and 2 threads), and
 * the reference is within its bound of the f32 dequantized product. */
static void test_matmul_int(st_backend *b1, st_backend *b2) {
    static const int64_t ns[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 64};
    static const int64_t Ns[] = {1, 13};
    static const char *lvl[] = {"portable", "avx2", "avxvnni", "avx512"};
    const st_cpu_isa best = st_cpu_isa_supported();
    st_backend_cpu_set_amx(b1, ST_CPU_AMX_OFF); /* the levels' own kernels first */
    st_backend_cpu_set_amx(b2, ST_CPU_AMX_OFF);
    for (int act8 = 0; act8 < 2; act8++)
    for (int ti = 0; ti < ST_DTYPE_COUNT; ti++) {
        const st_dtype t = (st_dtype)ti;
        if (!is_int_dtype(t)) continue;
        const bool kq = st_dtype_get(t)->block_elems == 256;
        const int64_t Ks[] = {kq ? 256 : 32, kq ? 768 : 96, kq ? 256 : 288};
        st_backend_cpu_set_act8(b1, act8);
        st_backend_cpu_set_act8(b2, act8);
        for (int ki = 0; ki < 3; ki++)
            for (int ri = 0; ri < 2; ri++) {
                const int64_t K = Ks[ki], N = Ns[ri] + (ki == 2 ? 64 : 0), nmax = 64;
                uint8_t *wd = make_weight(t, N, K, 1.0f);
                st_weight w = {wd, t, N, K, 0};
                float *x = outlier_acts(nmax, K), *yr = alloc_f(nmax * N), *y = alloc_f(nmax * N), *y1 = alloc_f(N);
                ref_matmul_int(t, wd, x, nmax, N, K, yr, act8);
                /* error of the documented arithmetic vs the f32 dequantized product */
                double *wref = dequant_all(t, wd, N, K), num = 0, den = 0;
                for (int64_t i = 0; i < nmax * N; i++) {
                    double s = 0;
                    for (int64_t k = 0; k < K; k++) s += (double)x[(i / N) * K + k] * wref[(i % N) * K + k];
                    if (fabs(yr[i] - s) > num) num = fabs(yr[i] - s);
                    if (fabs(s) > den) den = fabs(s);
                }
                const double e = num / den;
                if (e > g_int_err[act8][t]) g_int_err[act8][t] = e;
                /* activations rounded to 22 bits (q8_0: 19) of their block's max, or to int8 (127 steps;
                 * measured 0.8e-2..2.3e-2 at N >= 13, up to 7.8e-2 for one output, N = 1) */
                const double bound = act8 ? (N > 1 ? 5e-2 : 0.15) : t == ST_DTYPE_Q8_0 ? 3e-5 : 5e-6;
                CHECK_MSG(e < bound, "int matmul %s %s N=%lld K=%lld: rel error %.3g vs the f32 dequantized product",
                          act8 ? "int8" : "precise", st_dtype_name(t), (long long)N, (long long)K, e);
                for (int li = 0; li <= (int)best; li++) {
                    if (!st_cpu_isa_has((st_cpu_isa)li)) continue;
                    for (int bi = 0; bi < 2; bi++) {
                        st_backend *be = bi ? b2 : b1;
                        CHECK(st_backend_cpu_set_isa(be, (st_cpu_isa)li) == (st_cpu_isa)li);
                        for (int ni = 0; ni < (int)(sizeof ns / sizeof *ns); ni++) {
                            const int64_t n = ns[ni];
                            run_matmul(be, x, &w, n, y);
                            CHECK_MSG(same_bits(y, yr, n * N), "int matmul %s %s %s threads=%d n=%lld N=%lld K=%lld: "
                                      "differs from the scalar reference", act8 ? "int8" : "precise", lvl[li],
                                      st_dtype_name(t), bi + 1, (long long)n, (long long)N, (long long)K);
                        }
                        run_matmul(be, x + 5 * K, &w, 1, y1); /* token 5 alone */
                        CHECK_MSG(same_bits(y1, yr + 5 * N, N), "int matmul %s %s %s: token alone differs",
                                  act8 ? "int8" : "precise", lvl[li], st_dtype_name(t));
                    }
                }
                st_backend_cpu_set_isa(b1, best);
                st_backend_cpu_set_isa(b2, best);
                /* int8 on AVX-512: the 16-row few-token kernel also at one token (1), and not at all
                 * (0: the 8-row kernels at 2..8 tokens): the bits of the reference */
                for (int w16 = 0; act8 && best == ST_CPU_ISA_AVX512 && w16 < 2; w16++)
                    for (int bi = 0; bi < 2; bi++) {
                        st_backend *be = bi ? b2 : b1;
                        CHECK(st_backend_cpu_set_w16(be, w16) == ST_CPU_W16_MIN);
                        for (int ni = 0; ni < (int)(sizeof ns / sizeof *ns); ni++) {
                            const int64_t n = ns[ni];
                            run_matmul(be, x, &w, n, y);
                            CHECK_MSG(same_bits(y, yr, n * N), "int matmul int8 w16=%d %s threads=%d n=%lld N=%lld "
                                      "K=%lld: differs from the scalar reference", w16, st_dtype_name(t), bi + 1,
                                      (long long)n, (long long)N, (long long)K);
                        }
                        st_backend_cpu_set_w16(be, ST_CPU_W16_MIN);
                    }
                /* int8 on AMX tiles (where usable; ON elsewhere must fall back to OFF) and the
                 * same kernel with the tile instructions emulated: the bits of the reference */
                for (int am = ST_CPU_AMX_ON; act8 && am <= ST_CPU_AMX_EMULATED; am++)
                    for (int bi = 0; bi < 2; bi++) {
                        st_backend *be = bi ? b2 : b1;
                        const st_cpu_amx want = am == ST_CPU_AMX_ON && !st_cpu_amx_usable() ? ST_CPU_AMX_OFF
                                                                                            : (st_cpu_amx)am;
                        CHECK(st_backend_cpu_set_amx(be, (st_cpu_amx)am) == want);
                        for (int ni = 0; ni < (int)(sizeof ns / sizeof *ns); ni++) {
                            const int64_t n = ns[ni];
                            run_matmul(be, x, &w, n, y);
                            CHECK_MSG(same_bits(y, yr, n * N), "int matmul int8 amx %s %s threads=%d n=%lld N=%lld "
                                      "K=%lld: differs from the scalar reference", want == ST_CPU_AMX_ON ? "on" :
                                      want == ST_CPU_AMX_OFF ? "refused" : "emulated", st_dtype_name(t), bi + 1,
                                      (long long)n, (long long)N, (long long)K);
                        }
                        st_backend_cpu_set_amx(be, ST_CPU_AMX_OFF);
                    }
                free(wd);
                free(x);
                free(yr);
                free(y);
                free(y1);
                free(wref);
            }
    }
    st_backend_cpu_set_act8(b1, false);
    st_backend_cpu_set_act8(b2, false);
    for (int li = 0; li <= (int)ST_CPU_ISA_AVX512; li++)
        if (!st_cpu_isa_has((st_cpu_isa)li))
            printf("test_backend_cpu: this CPU lacks ISA level %s; not tested\n", lvl[li]);
    printf("test_backend_cpu: AMX-INT8 %s\n", st_cpu_amx_usable() ? "usable: tested (and emulated)"
                                                                 : "not usable here: refusal and emulation tested");
    const st_cpu_amx dflt = st_cpu_amx_usable() ? ST_CPU_AMX_ON : ST_CPU_AMX_OFF;
    st_backend_cpu_set_amx(b1, dflt);
    st_backend_cpu_set_amx(b2, dflt);
    for (int act8 = 0; act8 < 2; act8++)
        printf("int matmul (%s activations) rel error vs f32 dequantized (outlier activations): q4_0 %.2g, "
               "q4_1 %.2g, q8_0 %.2g, q4_K %.2g, q6_K %.2g\n", act8 ? "int8" : "22-bit",
               g_int_err[act8][ST_DTYPE_Q4_0], g_int_err[act8][ST_DTYPE_Q4_1], g_int_err[act8][ST_DTYPE_Q8_0],
               g_int_err[act8][ST_DTYPE_Q4_K], g_int_err[act8][ST_DTYPE_Q6_K]);
}

/* ---- get_rows ---- */

static void test_get_rows(st_backend *b1, st_backend *b2, const char *mode) {
    for (int t = 0; t < ST_DTYPE_COUNT; t++) {
        const st_dtype dt = (st_dtype)t;
        const int64_t cols = st_dtype_get(dt)->block_elems == 256 ? 512 : (dt <= ST_DTYPE_BF16 ? 37 : 96);
        const int64_t rows = 11, n = 9;
        uint8_t *wd = make_weight(dt, rows, cols, 2.0f);
        st_weight w = {wd, dt, rows, cols, 0};
        int32_t ids[9] = {3, 0, 10, 3, 7, 1, 10, 0, 5};
        float *o1 = alloc_f(n * cols), *o2 = alloc_f(n * cols), *ref = alloc_f(cols);
        poison(o1, n * cols);
        poison(o2, n * cols);
        CHECK(b1->ops->get_rows(b1, NULL, &w, ids, n, o1) == STRATA_OK);
        CHECK(b2->ops->get_rows(b2, NULL, &w, ids, n, o2) == STRATA_OK);
        bool exact = true;
        for (int64_t i = 0; i < n; i++) {
            st_dequantize_row(dt, wd + (size_t)ids[i] * st_dtype_row_bytes(dt, cols), ref, cols);
            exact &= same_bits(o1 + i * cols, ref, cols);
        }
        CHECK_MSG(exact, "get_rows %s %s differs from st_dequantize_row", mode, st_dtype_name(dt));
        CHECK(same_bits(o1, o2, n * cols));
        ids[4] = (int32_t)rows;
        CHECK_ERR(b1->ops->get_rows(b1, NULL, &w, ids, n, o1), STRATA_ERR_INVALID_ARG, "ids[4]");
        ids[4] = -1;
        CHECK_ERR(b1->ops->get_rows(b1, NULL, &w, ids, n, o1), STRATA_ERR_INVALID_ARG, "ids[4]");
        free(wd);
        free(o1);
        free(o2);
        free(ref);
    }
    /* the backend's f16 conversion on every bit pattern */
    uint16_t *all = malloc(65536 * 2);
    for (uint32_t h = 0; h < 65536; h++) all[h] = (uint16_t)h;
    float *o = alloc_f(65536);
    st_weight w = {all, ST_DTYPE_F16, 1, 65536, 0};
    int32_t id = 0;
    CHECK(b2->ops->get_rows(b2, NULL, &w, &id, 1, o) == STRATA_OK);
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) bad += f2u(o[h]) != f2u(st_f16_to_f32((uint16_t)h));
    CHECK_MSG(bad == 0, "get_rows %s f16: %d bit patterns convert differently", mode, bad);
    w.dtype = ST_DTYPE_BF16;
    CHECK(b2->ops->get_rows(b2, NULL, &w, &id, 1, o) == STRATA_OK);
    bad = 0;
    for (uint32_t h = 0; h < 65536; h++) bad += f2u(o[h]) != f2u(st_bf16_to_f32((uint16_t)h));
    CHECK_MSG(bad == 0, "get_rows %s bf16: %d bit patterns convert differently", mode, bad);
    free(all);
    free(o);
}

/* ---- rmsnorm ---- */

static void test_rmsnorm(st_backend *b1, st_backend *b2, const char *mode) {
    static const int64_t ds[] = {7, 33, 576};
    static const int64_t ns[] = {1, 3, 17};
    for (int di = 0; di < 3; di++)
        for (int ni = 0; ni < 3; ni++)
            for (int variant = 0; variant < 3; variant++) { /* f32 w; bf16 w + residual; in place */
                const int64_t d = ds[di], n = ns[ni];
                const st_dtype wt = variant == 1 ? ST_DTYPE_BF16 : ST_DTYPE_F32;
                uint8_t *wd = make_weight(wt, 1, d, 1.5f);
                st_weight w = {wd, wt, 1, d, 0};
                float *wf = alloc_f(d);
                st_dequantize_row(wt, wd, wf, d);
                float *x0 = rand_f(n * d, 3.0f), *res = variant == 1 ? rand_f(n * d, 2.0f) : NULL;
                float *x1 = alloc_f(n * d), *x2 = alloc_f(n * d);
                memcpy(x1, x0, (size_t)(n * d) * sizeof(float));
                memcpy(x2, x0, (size_t)(n * d) * sizeof(float));
                float *o1 = variant == 2 ? x1 : alloc_f(n * d), *o2 = variant == 2 ? x2 : alloc_f(n * d);
                if (variant != 2) {
                    poison(o1, n * d);
                    poison(o2, n * d);
                }
                const float eps = 1e-5f;
                CHECK(b1->ops->rmsnorm(b1, NULL, x1, res, &w, eps, n, d, o1) == STRATA_OK);
                CHECK(b2->ops->rmsnorm(b2, NULL, x2, res, &w, eps, n, d, o2) == STRATA_OK);
                double *ref = malloc((size_t)(n * d) * sizeof(double));
                bool x_ok = true;
                for (int64_t i = 0; i < n; i++) {
                    double ss = 0;
                    for (int64_t j = 0; j < d; j++) {
                        float xv = x0[i * d + j];
                        if (res) xv += res[i * d + j]; /* the residual add is exact fp32 */
                        if (variant != 2) x_ok &= f2u(x1[i * d + j]) == f2u(xv);
                        ss += (double)xv * xv;
                    }
                    double inv = 1.0 / sqrt(ss / (double)d + eps);
                    for (int64_t j = 0; j < d; j++) {
                        float xv = x0[i * d + j];
                        if (res) xv += res[i * d + j];
                        ref[i * d + j] = xv * inv * wf[j];
                    }
                }
                CHECK_MSG(x_ok, "rmsnorm %s: x was not updated to x + residual", mode);
                double e = worst(W_RMSNORM, nerr(o1, ref, n * d));
                CHECK_MSG(e < 1e-6, "rmsnorm %s d=%lld n=%lld variant %d: error %.3g", mode, (long long)d,
                          (long long)n, variant, e);
                CHECK(same_bits(o1, o2, n * d));
                free(wd);
                free(wf);
                free(x0);
                free(res);
                free(ref);
                if (variant != 2) {
                    free(o1);
                    free(o2);
                }
                free(x1);
                free(x2);
            }
    float x[4] = {1, 2, 3, 4}, o[4];
    st_weight w = {x, ST_DTYPE_F32, 1, 3, 0};
    CHECK_ERR(b1->ops->rmsnorm(b1, NULL, x, NULL, &w, 1e-5f, 1, 4, o), STRATA_ERR_INVALID_ARG, "[1, 4]");
}

/* ---- rope ---- */

static void test_rope(st_backend *b1, st_backend *b2, const char *mode) {
    static const int64_t hds[] = {2, 6, 64};
    static const int64_t ns[] = {1, 3, 17};
    for (int hi = 0; hi < 3; hi++)
        for (int ni = 0; ni < 3; ni++)
            for (int il = 0; il < 2; il++) {
                const int64_t hd = hds[hi], n = ns[ni], H = 3, half = hd / 2;
                float *inv = alloc_f(half);
                for (int64_t j = 0; j < half; j++) inv[j] = (float)pow(500000.0, -2.0 * (double)j / (double)hd);
                int32_t *pos = malloc((size_t)n * sizeof(int32_t));
                for (int64_t i = 0; i < n; i++)
                    pos[i] = i == 0 ? 0 : i == 1 ? (1 << 25) + 3 : i == 2 ? 1000003 : (int32_t)(rnd_u32() % 100000);
                float *x0 = rand_f(n * H * hd, 2.0f), *x1 = alloc_f(n * H * hd), *x2 = alloc_f(n * H * hd);
                memcpy(x1, x0, (size_t)(n * H * hd) * sizeof(float));
                memcpy(x2, x0, (size_t)(n * H * hd) * sizeof(float));
                CHECK(b1->ops->rope(b1, NULL, x1, pos, n, H, hd, inv, il) == STRATA_OK);
                CHECK(b2->ops->rope(b2, NULL, x2, pos, n, H, hd, inv, il) == STRATA_OK);
                double *ref = malloc((size_t)(n * H * hd) * sizeof(double));
                for (int64_t i = 0; i < n; i++)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t j = 0; j < half; j++) {
                            double th = (double)pos[i] * (double)inv[j];
                            int64_t a = il ? 2 * j : j, b = il ? 2 * j + 1 : j + half;
                            const float *v = x0 + (i * H + h) * hd;
                            double *r = ref + (i * H + h) * hd;
                            r[a] = v[a] * cos(th) - v[b] * sin(th);
                            r[b] = v[a] * sin(th) + v[b] * cos(th);
                        }
                double e = worst(W_ROPE, nerr(x1, ref, n * H * hd));
                CHECK_MSG(e < 1e-6, "rope %s hd=%lld n=%lld interleaved=%d: error %.3g", mode, (long long)hd,
                          (long long)n, il, e);
                CHECK(same_bits(x1, x2, n * H * hd));
                free(inv);
                free(pos);
                free(x0);
                free(x1);
                free(x2);
                free(ref);
            }
    float x[8];
    int32_t pos = 0;
    float inv = 1;
    CHECK_ERR(b1->ops->rope(b1, NULL, x, &pos, 1, 1, 7, &inv, false), STRATA_ERR_INVALID_ARG, "even");
}

/* ---- attention ---- */

static void ref_attention(const float *q, const float *k, const float *v, const int32_t *pos, int64_t n,
                          int64_t H, int64_t Hkv, int64_t hd, float scale, double *out, double *mag) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kvh = h / (H / Hkv), nk = pos[i] + 1;
            const float *qv = q + (i * H + h) * hd;
            double *s = malloc((size_t)nk * sizeof(double)), mx = -INFINITY, z = 0;
            for (int64_t j = 0; j < nk; j++) {
                double d = 0;
                for (int64_t c = 0; c < hd; c++) d += (double)qv[c] * k[(j * Hkv + kvh) * hd + c];
                s[j] = d * scale;
                if (s[j] > mx) mx = s[j];
            }
            for (int64_t j = 0; j < nk; j++) z += (s[j] = exp(s[j] - mx));
            for (int64_t c = 0; c < hd; c++) {
                double a = 0, m = 0;
                for (int64_t j = 0; j < nk; j++) {
                    a += s[j] * v[(j * Hkv + kvh) * hd + c];
                    m += s[j] * fabs(v[(j * Hkv + kvh) * hd + c]);
                }
                out[(i * H + h) * hd + c] = a / z;
                mag[(i * H + h) * hd + c] = m / z;
            }
            free(s);
        }
}

static void test_attention(st_backend *b1, st_backend *b2, const char *mode) {
    static const int64_t heads[][2] = {{4, 2}, {3, 3}, {6, 1}};
    static const int64_t ns[] = {1, 3, 17, 64};
    static const int64_t hds[] = {7, 64};
    for (int hi = 0; hi < 3; hi++)
        for (int ni = 0; ni < 4; ni++)
            for (int di = 0; di < 2; di++)
                for (int layout = 0; layout < 2; layout++) { /* prefill at the end / scattered positions */
                    const int64_t H = heads[hi][0], Hkv = heads[hi][1], n = ns[ni], hd = hds[di];
                    const int64_t n_kv = layout ? n + 40 : n + 5;
                    int32_t *pos = malloc((size_t)n * sizeof(int32_t));
                    for (int64_t i = 0; i < n; i++)
                        pos[i] = layout ? (int32_t)(rnd_u32() % n_kv) : (int32_t)(n_kv - n + i);
                    float *q = rand_f(n * H * hd, 1.0f), *k = rand_f(n_kv * Hkv * hd, 1.0f);
                    float *v = rand_f(n_kv * Hkv * hd, 1.0f);
                    float *o1 = alloc_f(n * H * hd), *o2 = alloc_f(n * H * hd);
                    poison(o1, n * H * hd);
                    poison(o2, n * H * hd);
                    const float scale = 2.0f / sqrtf((float)hd); /* peaky enough to matter */
                    CHECK(b1->ops->attention(b1, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, scale, o1) == STRATA_OK);
                    CHECK(b2->ops->attention(b2, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, scale, o2) == STRATA_OK);
                    double *ref = malloc((size_t)(n * H * hd) * sizeof(double));
                    double *mag = malloc((size_t)(n * H * hd) * sizeof(double));
                    ref_attention(q, k, v, pos, n, H, Hkv, hd, scale, ref, mag);
                    double e = worst(W_ATTN, nerr_mag(o1, ref, mag, n * H * hd));
                    CHECK_MSG(e < 1e-6, "attention %s H=%lld/%lld n=%lld hd=%lld layout %d: error %.3g", mode,
                              (long long)H, (long long)Hkv, (long long)n, (long long)hd, layout, e);
                    CHECK(same_bits(o1, o2, n * H * hd));
                    free(pos);
                    free(q);
                    free(k);
                    free(v);
                    free(o1);
                    free(o2);
                    free(ref);
                    free(mag);
                }
    /* one long context through the pool (decode over 3000 keys) */
    {
        const int64_t H = 8, Hkv = 2, hd = 64, n_kv = 3000, n = 2;
        int32_t pos[2] = {2998, 2999};
        float *q = rand_f(n * H * hd, 1.0f), *k = rand_f(n_kv * Hkv * hd, 1.0f), *v = rand_f(n_kv * Hkv * hd, 1.0f);
        float *o1 = alloc_f(n * H * hd), *o2 = alloc_f(n * H * hd);
        poison(o1, n * H * hd);
        CHECK(b1->ops->attention(b1, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, 0.125f, o1) == STRATA_OK);
        CHECK(b2->ops->attention(b2, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, 0.125f, o2) == STRATA_OK);
        double *ref = malloc((size_t)(n * H * hd) * sizeof(double));
        double *mag = malloc((size_t)(n * H * hd) * sizeof(double));
        ref_attention(q, k, v, pos, n, H, Hkv, hd, 0.125f, ref, mag);
        double e = worst(W_ATTN, nerr_mag(o1, ref, mag, n * H * hd));
        CHECK_MSG(e < 1e-6, "attention %s long: error %.3g", mode, e);
        CHECK(same_bits(o1, o2, n * H * hd));
        int32_t bad = 3000;
        CHECK_ERR(b1->ops->attention(b1, NULL, q, k, v, &bad, 1, n_kv, H, Hkv, hd, 0.125f, o1),
                  STRATA_ERR_INVALID_ARG, "pos[0] = 3000");
        CHECK_ERR(b1->ops->attention(b1, NULL, q, k, v, pos, 1, n_kv, 6, 4, hd, 0.125f, o1),
                  STRATA_ERR_INVALID_ARG, "multiple of n_kv_heads");
        free(q);
        free(k);
        free(v);
        free(o1);
        free(o2);
        free(ref);
        free(mag);
    }
}

/* Decode-shaped attention (few (token, kv head) items, many ranges of
 * ST_ATTN_RANGE keys: split over the keys when there are several threads):
 * the same bits with 1, 2 and 3 threads and in either kernel build, the same
 * bits from attention_part over pieces cut at multiples of ST_ATTN_RANGE
 * (merged in increasing order, on 1 or 3 threads), and within 1e-6 (of the
 * magnitude, nerr_mag) of the float64 reference. */
static void test_attention_split(void) {
    st_backend *bt[3] = {make_cpu(1, 0), make_cpu(2, 0), make_cpu(3, 0)};
    if (!bt[0] || !bt[1] || !bt[2]) goto done;
    static const int64_t cases[][5] = {/* H, Hkv, hd, n, n_kv */
                                       {9, 3, 64, 1, 1000}, {8, 1, 64, 2, 777}, {6, 6, 7, 1, 513},
                                       {12, 2, 72, 3, 300}, {5, 1, 16, 1, 2049}};
    for (int ci = 0; ci < 5; ci++) {
        const int64_t H = cases[ci][0], Hkv = cases[ci][1], hd = cases[ci][2], n = cases[ci][3], n_kv = cases[ci][4];
        const int64_t m = n * H * hd, kvd = Hkv * hd;
        int32_t pos[3];
        for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(n_kv - n + i);
        float *q = rand_f(m, 1.0f), *k = rand_f(n_kv * kvd, 1.0f), *v = rand_f(n_kv * kvd, 1.0f);
        float *o[3], *op = alloc_f(m), lse[3 * 12];
        const float scale = 2.0f / sqrtf((float)hd);
        for (int t = 0; t < 3; t++) {
            o[t] = alloc_f(m);
            poison(o[t], m);
            CHECK(bt[t]->ops->attention(bt[t], NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, scale, o[t]) == STRATA_OK);
            CHECK_MSG(same_bits(o[0], o[t], m), "attention H=%lld/%lld n_kv=%lld: %d threads differ from 1",
                      (long long)H, (long long)Hkv, (long long)n_kv, t + 1);
        }
        if (n == 1) { /* the same token last in a batch of enough items not to be split: the same bits */
            const int64_t nb = 4 * (32 / Hkv + 1), mb = nb * H * hd;
            float *qb = rand_f(mb, 1.0f), *ob = alloc_f(mb);
            int32_t *pb = malloc((size_t)nb * sizeof(int32_t));
            memcpy(qb + mb - m, q, (size_t)m * sizeof(float));
            for (int64_t i = 0; i < nb; i++) pb[i] = (int32_t)(n_kv - nb + i);
            CHECK(bt[0]->ops->attention(bt[0], NULL, qb, k, v, pb, nb, n_kv, H, Hkv, hd, scale, ob) == STRATA_OK);
            CHECK_MSG(same_bits(o[0], ob + mb - m, m), "attention H=%lld/%lld n_kv=%lld: split differs from "
                      "unsplit", (long long)H, (long long)Hkv, (long long)n_kv);
            free(qb), free(ob), free(pb);
        }
        st_backend_cpu_set_simd(bt[2], false); /* the others run the AVX2 build where the CPU has it */
        CHECK(bt[2]->ops->attention(bt[2], NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, scale, op) == STRATA_OK);
        CHECK_MSG(same_bits(o[0], op, m), "attention n_kv=%lld: the portable build differs", (long long)n_kv);
        st_backend_cpu_set_simd(bt[2], true);
        /* pieces [0, 256), [256, 768), [768, n_kv) (the last may be empty) */
        for (int t = 0; t < 3; t += 2) {
            const int64_t cut[4] = {0, ST_ATTN_RANGE, 3 * ST_ATTN_RANGE, n_kv};
            poison(op, m);
            for (int pc = 0; pc < 3; pc++) {
                const int64_t k0 = cut[pc], k1 = cut[pc + 1] < n_kv ? cut[pc + 1] : n_kv;
                if (k1 <= k0) continue;
                CHECK(bt[t]->ops->attention_part(bt[t], NULL, q, k + k0 * kvd, v + k0 * kvd, pos, n, k0, k1 - k0, H,
                                                 Hkv, hd, scale, pc > 0, op, lse) == STRATA_OK);
            }
            CHECK_MSG(same_bits(o[0], op, m), "attention n_kv=%lld: pieces on %d threads differ from one call",
                      (long long)n_kv, t + 1);
        }
        double *ref = malloc((size_t)m * sizeof(double)), *mag = malloc((size_t)m * sizeof(double));
        ref_attention(q, k, v, pos, n, H, Hkv, hd, scale, ref, mag);
        const double e = worst(W_ATTN, nerr_mag(o[0], ref, mag, m));
        CHECK_MSG(e < 1e-6, "attention H=%lld/%lld n_kv=%lld: error %.3g", (long long)H, (long long)Hkv,
                  (long long)n_kv, e);
        for (int t = 0; t < 3; t++) free(o[t]);
        free(op), free(q), free(k), free(v), free(ref), free(mag);
    }
done:
    for (int t = 0; t < 3; t++) st_backend_free(bt[t]);
}

/* ---- swiglu, add ---- */

static void test_elementwise(st_backend *b1, st_backend *b2, const char *mode) {
    static const int64_t ns[] = {1, 7, 33, 40000};
    for (int ni = 0; ni < 4; ni++) {
        const int64_t n = ns[ni];
        float *g = rand_f(n, 8.0f), *u = rand_f(n, 3.0f);
        if (n > 2) {
            g[0] = -100.0f; /* exp(100) overflows to inf: silu -> -0 */
            g[1] = 100.0f;
        }
        float *o1 = alloc_f(n), *o2 = alloc_f(n);
        poison(o1, n);
        poison(o2, n);
        CHECK(b1->ops->swiglu(b1, NULL, g, u, n, o1) == STRATA_OK);
        CHECK(b2->ops->swiglu(b2, NULL, g, u, n, o2) == STRATA_OK);
        double *ref = malloc((size_t)n * sizeof(double));
        for (int64_t i = 0; i < n; i++) ref[i] = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        double e = worst(W_SWIGLU, nerr(o1, ref, n));
        CHECK_MSG(e < 1e-6, "swiglu %s n=%lld: error %.3g", mode, (long long)n, e);
        CHECK(same_bits(o1, o2, n));

        memcpy(o1, g, (size_t)n * sizeof(float));
        memcpy(o2, g, (size_t)n * sizeof(float));
        CHECK(b1->ops->add(b1, NULL, o1, u, n) == STRATA_OK);
        CHECK(b2->ops->add(b2, NULL, o2, u, n) == STRATA_OK);
        bool ok = true;
        for (int64_t i = 0; i < n; i++) ok &= f2u(o1[i]) == f2u(g[i] + u[i]);
        CHECK_MSG(ok, "add %s n=%lld", mode, (long long)n);
        CHECK(same_bits(o1, o2, n));
        free(g);
        free(u);
        free(o1);
        free(o2);
        free(ref);
    }
    CHECK(b1->ops->swiglu(b1, NULL, NULL, NULL, 0, NULL) == STRATA_OK);
    CHECK_ERR(b1->ops->add(b1, NULL, NULL, NULL, 3), STRATA_ERR_INVALID_ARG, "NULL");
}

/* The portable and the best builds of the kernels give the same bits. */
static void test_simd_equivalence(st_backend *be) {
    if (!st_backend_cpu_set_simd(be, true)) return;
    for (int t = 0; t < ST_DTYPE_COUNT; t++) {
        const st_dtype dt = (st_dtype)t;
        const int64_t K = st_dtype_get(dt)->block_elems == 256 ? 512 : (dt <= ST_DTYPE_BF16 ? 201 : 320);
        const int64_t N = 37;
        const int64_t ns[] = {1, 9};
        uint8_t *wd = make_weight(dt, N, K, 1.0f);
        st_weight w = {wd, dt, N, K, 0};
        for (int i = 0; i < 2; i++) {
            const int64_t n = ns[i];
            float *x = rand_f(n * K, 1.0f), *ya = alloc_f(n * N), *yb = alloc_f(n * N);
            st_backend_cpu_set_simd(be, false);
            run_matmul(be, x, &w, n, ya);
            st_backend_cpu_set_simd(be, true);
            run_matmul(be, x, &w, n, yb);
            CHECK_MSG(same_bits(ya, yb, n * N), "matmul %s n=%lld: portable and simd kernels differ",
                      st_dtype_name(dt), (long long)n);
            free(x);
            free(ya);
            free(yb);
        }
        free(wd);
    }
    const int64_t n = 5, n_kv = 300, H = 4, Hkv = 2, hd = 72;
    int32_t pos[5] = {0, 7, 150, 298, 299};
    float *q = rand_f(n * H * hd, 1.0f), *k = rand_f(n_kv * Hkv * hd, 1.0f), *v = rand_f(n_kv * Hkv * hd, 1.0f);
    float *oa = alloc_f(n * H * hd), *ob = alloc_f(n * H * hd);
    st_backend_cpu_set_simd(be, false);
    CHECK(be->ops->attention(be, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, 0.3f, oa) == STRATA_OK);
    st_backend_cpu_set_simd(be, true);
    CHECK(be->ops->attention(be, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, 0.3f, ob) == STRATA_OK);
    CHECK_MSG(same_bits(oa, ob, n * H * hd), "attention: portable and simd kernels differ");
    free(q);
    free(k);
    free(v);
    free(oa);
    free(ob);
}

/* A row stride (the CPU tier's share of a split FFN's down projection): the
 * first K columns of a wider matrix, read in place, give the bits of a dense
 * copy of those columns, for every weight dtype and 1..9 tokens (precise
 * and int8 activations; one thread and two); other ops refuse a
 * stride. */
static void test_matmul_stride(st_backend *be) {
    static const st_dtype dts[] = {ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q8_0, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K,
                                   ST_DTYPE_BF16, ST_DTYPE_F32};
    int same = 0, runs = 0;
    for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
        const st_dtype t = dts[di];
        const int64_t blk = st_dtype_get(t)->block_elems < 32 ? 32 : st_dtype_get(t)->block_elems;
        const int64_t N = 37, K = 2 * blk, W = 5 * blk; /* K columns of a W-column matrix */
        uint8_t *wide = make_weight(t, N, W, 1.0f);
        const size_t wrb = st_dtype_row_bytes(t, W), rb = st_dtype_row_bytes(t, K);
        uint8_t *dense = malloc(rb * (size_t)N);
        for (int64_t r = 0; r < N; r++) memcpy(dense + (size_t)r * rb, wide + (size_t)r * wrb, rb);
        for (int act8 = 0; act8 < 2; act8++) /* and int8 activations: 5 tokens take W16 on AVX-512 */
            for (int64_t n = 1; n <= 9; n += 4) {
                st_backend_cpu_set_act8(be, act8);
                float *x = rand_f(n * K, 1.0f), *y1 = malloc((size_t)(n * N) * 4), *y2 = malloc((size_t)(n * N) * 4);
                const st_weight ws = {wide, t, N, K, wrb}, wd = {dense, t, N, K, 0};
                CHECK(be->ops->matmul(be, NULL, x, &ws, n, y1) == STRATA_OK);
                CHECK(be->ops->matmul(be, NULL, x, &wd, n, y2) == STRATA_OK);
                const bool ok = !memcmp(y1, y2, (size_t)(n * N) * 4);
                CHECK_MSG(ok, "strided matmul %s %s, %lld tokens: differs from the dense copy", st_dtype_name(t),
                          act8 ? "int8" : "precise", (long long)n);
                same += ok, runs++;
                free(x), free(y1), free(y2);
                st_backend_cpu_set_act8(be, false);
            }
        const st_weight ws = {wide, t, 1, K, wrb};
        float out[4096];
        int32_t id = 0;
        CHECK_ERR(be->ops->get_rows(be, NULL, &ws, &id, 1, out), STRATA_ERR_UNSUPPORTED, "row stride", "get_rows");
        free(wide), free(dense);
    }
    printf("strided matmuls: %d/%d bit-identical to dense copies\n", same, runs);
}

int main(void) {
    test_half_conversions();
    test_pool();
    test_memory_and_streams();
    test_init();

    st_backend *b1 = make_cpu(1, 0), *b2 = make_cpu(2, 0);
    if (!b1 || !b2) return test_finish("test_backend_cpu");
    test_matmul_int(b1, b2);
    test_matmul_stride(b1);
    test_matmul_stride(b2);
    for (int simd = 0; simd < 2; simd++) {
        const char *mode = simd ? "simd" : "portable";
        bool on1 = st_backend_cpu_set_simd(b1, simd), on2 = st_backend_cpu_set_simd(b2, simd);
        CHECK(on1 == on2);
        if (simd && !on1) {
            printf("test_backend_cpu: this CPU has no AVX2; SIMD kernels not tested\n");
            break;
        }
        test_matmul(b1, b2, mode);
        test_get_rows(b1, b2, mode);
        test_rmsnorm(b1, b2, mode);
        test_rope(b1, b2, mode);
        test_attention(b1, b2, mode);
        test_elementwise(b1, b2, mode);
    }
    test_simd_equivalence(b2);
    test_attention_split();
    st_backend_free(b1);
    st_backend_free(b2);
    printf("worst normalized errors: matmul %.2g, rmsnorm %.2g, rope %.2g, attention %.2g, swiglu %.2g\n",
           g_worst[W_MATMUL], g_worst[W_RMSNORM], g_worst[W_ROPE], g_worst[W_ATTN], g_worst[W_SWIGLU]);
    return test_finish("test_backend_cpu");
}

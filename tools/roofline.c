/* Device roofline probes (roofline.h), shared by strata bench and strata serve. */
#include "roofline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

double tool_measure_copy_bw(st_backend *be, st_stream *s) {
    const size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    double best = 0;
    if (be->ops->alloc(be, n, &a) || be->ops->alloc(be, n, &b)) goto out;
    for (int r = 0; r < 6; r++) {
        double t0 = st_time_now();
        if (be->ops->copy_d2d(be, s, b, a, n) || be->ops->stream_sync(be, s)) goto out;
        double bw = 2.0 * (double)n / (st_time_now() - t0);
        if (r > 0 && bw > best) best = bw; /* the first is a warm-up */
    }
out:
    if (a) be->ops->dealloc(be, a);
    if (b) be->ops->dealloc(be, b);
    return best;
}

/* Fills n bytes of device memory at d with pseudo-random numbers in (-1, 1)
 * from an LCG, fp32 or bf16 (two per 32-bit word); never zeros (a GEMM on
 * zeros runs faster than on real data). */
static bool fill_random(st_backend *be, st_stream *s, void *d, size_t n, bool bf16) {
    const size_t chunk = (size_t)1 << 24;
    uint32_t *h = malloc(chunk);
    if (!h) return false;
    uint32_t x = 12345u;
    bool ok = true;
    for (size_t off = 0; off < n && ok; off += chunk) {
        const size_t k = n - off < chunk ? n - off : chunk;
        for (size_t i = 0; i < k / 4; i++) {
            uint32_t v[2];
            for (int j = 0; j < 2; j++) {
                x = x * 1664525u + 1013904223u;
                const float f = (float)(x >> 8) / 8388608.0f - 1.0f + 1.0f / 16777216.0f; /* never 0 */
                memcpy(&v[j], &f, 4);
            }
            h[i] = bf16 ? (v[0] >> 16) | (v[1] & 0xffff0000u) : v[0]; /* bf16: the top halves */
        }
        ok = be->ops->copy_h2d(be, s, (char *)d + off, h, k) == STRATA_OK && be->ops->stream_sync(be, s) == STRATA_OK;
    }
    free(h);
    return ok;
}

double tool_measure_matmul_rate(st_backend *be, st_stream *s, int64_t dim, int64_t n, bool fast) {
    void *w = NULL, *x = NULL, *y = NULL;
    double best = 0;
    if (be->ops->alloc(be, (size_t)(dim * dim) * 2, &w) ||
        be->ops->alloc(be, (size_t)(n * dim) * 4, &x) || be->ops->alloc(be, (size_t)(n * dim) * 4, &y))
        goto out;
    if (!fill_random(be, s, w, (size_t)(dim * dim) * 2, true) || !fill_random(be, s, x, (size_t)(n * dim) * 4, false))
        goto out;
    be->ops->set_fast_prefill(be, fast);
    st_weight wt = {w, ST_DTYPE_BF16, dim, dim, 0};
    for (int r = 0; r < 4; r++) {
        double t0 = st_time_now();
        if (be->ops->matmul(be, s, x, &wt, n, y) || be->ops->stream_sync(be, s)) goto out;
        double rate = 2.0 * (double)dim * (double)dim * (double)n / (st_time_now() - t0);
        if (r > 0 && rate > best) best = rate;
    }
out:
    be->ops->set_fast_prefill(be, false);
    if (w) be->ops->dealloc(be, w);
    if (x) be->ops->dealloc(be, x);
    if (y) be->ops->dealloc(be, y);
    return best;
}

bool tool_measure_device_rooflines(const st_backend_params *bp, tool_rooflines *out) {
    memset(out, 0, sizeof *out);
    if (bp->kind != ST_BACKEND_CUDA) return true;
    st_backend_params pp = {.kind = ST_BACKEND_CUDA, .device_mem = (size_t)3 << 30, .device_index = bp->device_index};
    st_backend *be = NULL;
    st_stream *st = NULL;
    bool ok = false;
    if (st_backend_init(&pp, &be) != STRATA_OK || be->ops->stream_create(be, false, &st) != STRATA_OK) {
        tool_print_error("roofline probes");
        goto out;
    }
    /* HBM bandwidth: bytes read + written per second by a large copy (a decode
     * step's GEMVs stream at about that rate, reads only) */
    out->copy_bw = tool_measure_copy_bw(be, st);
    out->gemm_fast = tool_measure_matmul_rate(be, st, 8192, 4096, true);
    out->gemm_precise = tool_measure_matmul_rate(be, st, 8192, 4096, false);
    ok = out->copy_bw > 0 && out->gemm_fast > 0 && out->gemm_precise > 0;
    if (!ok) tool_print_error("roofline probes");
out:
    if (st) be->ops->stream_destroy(be, st);
    st_backend_free(be);
    return ok;
}

double tool_measure_h2d_bw(st_backend *be, size_t width, size_t pitch) {
    const size_t n = (size_t)1 << 30;
    const size_t rows = width ? n / pitch : 0, bytes = width ? rows * width : n;
    void *h = NULL, *d = NULL;
    st_stream *s = NULL;
    double best = 0;
    if (be->ops->host_alloc(be, n, &h) || be->ops->alloc(be, bytes, &d) || be->ops->stream_create(be, false, &s))
        goto out;
    memset(h, 1, n);
    for (int i = 0; i < 4; i++) {
        const double t0 = st_time_now();
        const strata_status st = width ? be->ops->copy_2d(be, s, d, width, h, pitch, width, rows)
                                       : be->ops->copy_h2d(be, s, d, h, n);
        if (st || be->ops->stream_sync(be, s)) goto out;
        const double bw = (double)bytes / (st_time_now() - t0);
        if (bw > best) best = bw;
    }
out:
    if (s) be->ops->stream_destroy(be, s);
    if (d) be->ops->dealloc(be, d);
    if (h) be->ops->host_dealloc(be, h);
    return best;
}

typedef struct {
    const float *buf;
    int64_t per_item;   /* floats per item */
    double *sums;       /* per thread */
} bw_ctx;

static void bw_read(void *ctx, int64_t begin, int64_t end, int thread) {
    bw_ctx *c = ctx;
    float acc[16] = {0};
    for (int64_t it = begin; it < end; it++) {
        const float *p = c->buf + it * c->per_item;
        for (int64_t i = 0; i < c->per_item; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += p[i + j];
    }
    double s = 0;
    for (int j = 0; j < 16; j++) s += acc[j];
    c->sums[thread] += s;
}

double tool_measure_read_bw(st_pool *pool, size_t bytes) {
    const int64_t per_item = 1 << 16; /* 256 KiB chunks */
    int64_t items = (int64_t)(bytes / (per_item * sizeof(float)));
    float *buf = malloc((size_t)(items * per_item) * sizeof(float));
    if (!buf) return 0;
    for (int64_t i = 0; i < items * per_item; i++) buf[i] = (float)(i & 7);
    double sums[1024] = {0};
    bw_ctx c = {buf, per_item, sums};
    double best = 0;
    for (int r = 0; r < 5; r++) {
        double t0 = st_time_now();
        st_pool_parallel_for(pool, items, 1, bw_read, &c);
        double dt = st_time_now() - t0;
        double bw = (double)(items * per_item) * sizeof(float) / dt;
        if (bw > best) best = bw;
    }
    if (sums[0] == -1.0) fprintf(stderr, "!"); /* keeps the reads alive */
    free(buf);
    return best;
}

int tool_bench_threads(char *arg, int *threads, int max) {
    int n = 0;
    if (arg) {
        for (char *s = strtok(arg, ","); s && n < max; s = strtok(NULL, ",")) threads[n++] = atoi(s);
        return n;
    }
    threads[n++] = 1;
    st_pool *p = NULL;
    if (st_pool_init(0, &p) == STRATA_OK) {
        const int all = st_pool_threads(p);
        if (all > 1 && n < max) threads[n++] = all;
        st_pool_free(p);
    }
    return n;
}

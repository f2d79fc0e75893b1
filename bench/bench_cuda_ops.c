/* bench_cuda_ops: CUDA backend kernel lab. Times decode matmul (GEMV) over
 * bf16 and quantized weights, a prefill GEMM, and attention (decode over a
 * long KV cache, and a causal prefill), each beside its roofline measured in
 * the same run: device-to-device copy bandwidth (bytes read + written) for the
 * memory-bound ops.
 *
 * Timing: the ops are enqueued back to back on one stream, the host waits
 * once, and the time per op is the median over 7 batches. Weights rotate over
 * enough copies (>= 512 MiB) that they cannot sit in L2. Bytes counted are
 * the fewest the op must move: the weight once (decode matmul), K and V once
 * (decode attention). Usage: bench_cuda_ops [device_index] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/quant.h"

static st_backend *be;
static st_stream *s;

static void die(const char *what) {
    fprintf(stderr, "bench_cuda_ops: %s: %s\n", what, st_last_error());
    exit(2);
}
#define TRY(x) do { if ((x) != STRATA_OK) die(#x); } while (0)

static uint64_t rng = 88172645463325252ull;
static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void *dev_random(size_t bytes) {
    /* random bytes, then fixed up by the caller where they must be valid numbers */
    void *d = NULL;
    TRY(be->ops->alloc(be, bytes, &d));
    return d;
}

static void *upload(const void *h, size_t n) {
    void *d = NULL;
    bool owned;
    TRY(be->ops->upload(be, h, n, &d, &owned));
    return d;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Seconds per call of fn(i), the median of 7 batches of `iters`. */
typedef void (*op_fn)(int i, void *ctx);
static double time_op(op_fn fn, void *ctx, int iters) {
    for (int i = 0; i < 3; i++) fn(i, ctx);
    TRY(be->ops->stream_sync(be, s));
    double t[7];
    for (int b = 0; b < 7; b++) {
        double t0 = st_time_now();
        for (int i = 0; i < iters; i++) fn(i, ctx);
        TRY(be->ops->stream_sync(be, s));
        t[b] = (st_time_now() - t0) / iters;
    }
    qsort(t, 7, sizeof t[0], cmp_d);
    return t[3];
}

/* ---- copy roofline ---- */
typedef struct { void *a, *b; size_t n; } copy_ctx;
static void copy_fn(int i, void *p) {
    copy_ctx *c = p;
    TRY(be->ops->copy_d2d(be, s, (i & 1) ? c->a : c->b, (i & 1) ? c->b : c->a, c->n));
}

/* ---- matmul ---- */
typedef struct {
    st_weight w[64];
    int copies;
    const float *x;
    float *y;
    int64_t n;
} mm_ctx;
static void mm_fn(int i, void *p) {
    mm_ctx *m = p;
    TRY(be->ops->matmul(be, s, m->x, &m->w[i % m->copies], m->n, m->y));
}

static uint8_t *host_weight(st_dtype t, int64_t rows, int64_t cols) {
    const size_t rb = st_dtype_row_bytes(t, cols);
    uint8_t *w = malloc(rb * (size_t)rows);
    float *f = malloc((size_t)cols * sizeof(float));
    if (!w || !f) die("host memory");
    if (t == ST_DTYPE_Q4_K || t == ST_DTYPE_Q6_K) {
        for (size_t i = 0; i < rb * (size_t)rows; i++) w[i] = (uint8_t)(frand() * 127 + 128);
        const size_t bb = st_dtype_get(t)->block_bytes;
        for (size_t b = 0; b < rb * (size_t)rows / bb; b++) {
            uint16_t d = st_f32_to_f16(0.001f);
            memcpy(w + b * bb + (t == ST_DTYPE_Q4_K ? 0 : 208), &d, 2);
            if (t == ST_DTYPE_Q4_K) memcpy(w + b * bb + 2, &d, 2);
        }
    } else {
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) f[c] = frand() * 0.05f;
            st_quantize_row(t, f, w + (size_t)r * rb, cols);
        }
    }
    free(f);
    return w;
}

static void bench_matmul(st_dtype t, int64_t N, int64_t K, int64_t n, double copy_bw) {
    mm_ctx m = {.n = n};
    const size_t wbytes = st_dtype_row_bytes(t, K) * (size_t)N;
    m.copies = (int)((((size_t)512 << 20) + wbytes - 1) / wbytes);
    if (m.copies < 2) m.copies = 2;
    if (m.copies > 64) m.copies = 64;
    uint8_t *hw = host_weight(t, N, K);
    void *dws[64];
    for (int c = 0; c < m.copies; c++) {
        dws[c] = upload(hw, wbytes);
        m.w[c] = (st_weight){dws[c], t, N, K};
    }
    free(hw);
    float *hx = malloc((size_t)(n * K) * 4);
    for (int64_t i = 0; i < n * K; i++) hx[i] = frand();
    float *dx = upload(hx, (size_t)(n * K) * 4);
    free(hx);
    TRY(be->ops->alloc(be, (size_t)(n * N) * 4, (void **)&m.y));
    m.x = dx;
    const double sec = time_op(mm_fn, &m, n == 1 ? 200 : 20);
    const double gbs = (double)wbytes / sec / 1e9, tfl = 2.0 * (double)n * N * K / sec / 1e12;
    if (n <= 32)
        printf("matmul %-5s %6lld x %-6lld n=%-4lld %8.1f us  %7.0f GB/s of weight  (%.0f%% of copy bw)\n",
               st_dtype_name(t), (long long)N, (long long)K, (long long)n, sec * 1e6, gbs, 100.0 * gbs * 1e9 / copy_bw);
    else
        printf("matmul %-5s %6lld x %-6lld n=%-4lld %8.1f us  %7.1f TFLOP/s\n", st_dtype_name(t), (long long)N,
               (long long)K, (long long)n, sec * 1e6, tfl);
    for (int c = 0; c < m.copies; c++) be->ops->dealloc(be, dws[c]);
    be->ops->dealloc(be, dx);
    be->ops->dealloc(be, m.y);
}

/* ---- attention ---- */
typedef struct {
    const float *q, *k, *v;
    const int32_t *pos;
    float *out;
    int64_t n, n_kv, H, Hkv, hd;
} at_ctx;
static void at_fn(int i, void *p) {
    at_ctx *a = p;
    TRY(be->ops->attention(be, s, a->q, a->k, a->v, a->pos, a->n, a->n_kv, a->H, a->Hkv, a->hd,
                           1.0f / sqrtf((float)a->hd), a->out));
}

static float *dev_floats(int64_t n, float scale) {
    float *h = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) h[i] = frand() * scale;
    float *d = upload(h, (size_t)n * 4);
    free(h);
    return d;
}

static void bench_attention(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd, double copy_bw) {
    at_ctx a = {.n = n, .n_kv = n_kv, .H = H, .Hkv = Hkv, .hd = hd};
    a.q = dev_floats(n * H * hd, 1.0f);
    a.k = dev_floats(n_kv * Hkv * hd, 1.0f);
    a.v = dev_floats(n_kv * Hkv * hd, 1.0f);
    int32_t *hp = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) hp[i] = (int32_t)(n_kv - n + i);
    a.pos = upload(hp, (size_t)n * 4);
    free(hp);
    TRY(be->ops->alloc(be, (size_t)(n * H * hd) * 4, (void **)&a.out));
    const double sec = time_op(at_fn, &a, n == 1 ? 100 : 10);
    const double kv_bytes = 2.0 * (double)n_kv * Hkv * hd * 4;
    /* causal: query i sees n_kv - n + i + 1 keys; 4 flops per key and dim (QK and PV) */
    double keys = 0;
    for (int64_t i = 0; i < n; i++) keys += (double)(n_kv - n + i + 1);
    const double flops = 4.0 * keys * hd * H;
    if (n <= 16)
        printf("attention n=%-4lld n_kv=%-6lld heads %lld/%lld hd %lld  %8.1f us  %7.0f GB/s of K+V (%.0f%% of copy bw)\n",
               (long long)n, (long long)n_kv, (long long)H, (long long)Hkv, (long long)hd, sec * 1e6,
               kv_bytes / sec / 1e9, 100.0 * kv_bytes / sec / copy_bw);
    else
        printf("attention n=%-4lld n_kv=%-6lld heads %lld/%lld hd %lld  %8.1f us  %7.1f TFLOP/s (causal)\n",
               (long long)n, (long long)n_kv, (long long)H, (long long)Hkv, (long long)hd, sec * 1e6,
               flops / sec / 1e12);
    be->ops->dealloc(be, (void *)a.q);
    be->ops->dealloc(be, (void *)a.k);
    be->ops->dealloc(be, (void *)a.v);
    be->ops->dealloc(be, (void *)a.pos);
    be->ops->dealloc(be, a.out);
}

int main(int argc, char **argv) {
    st_backend_params p = {.kind = ST_BACKEND_CUDA, .device_index = argc > 1 ? atoi(argv[1]) : 0};
    TRY(st_backend_init(&p, &be));
    TRY(be->ops->stream_create(be, false, &s));

    copy_ctx c = {.n = (size_t)1 << 30};
    c.a = dev_random(c.n);
    c.b = dev_random(c.n);
    const double csec = time_op(copy_fn, &c, 10);
    const double copy_bw = 2.0 * (double)c.n / csec;
    printf("roofline: device-to-device copy %.0f GB/s (bytes read + written)\n", copy_bw / 1e9);
    be->ops->dealloc(be, c.a);
    be->ops->dealloc(be, c.b);

    bench_matmul(ST_DTYPE_BF16, 4096, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_BF16, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_BF16, 4096, 14336, 1, copy_bw);
    bench_matmul(ST_DTYPE_BF16, 4096, 4096, 4, copy_bw);
    bench_matmul(ST_DTYPE_BF16, 4096, 4096, 8, copy_bw);
    bench_matmul(ST_DTYPE_F16, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_Q8_0, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_Q4_0, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_Q4_K, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_Q6_K, 14336, 4096, 1, copy_bw);
    bench_matmul(ST_DTYPE_Q4_K, 14336, 4096, 16, copy_bw);
    /* prefill GEMMs (the 8B shapes at a 512-token chunk), precise (default) and fast */
    for (int fast = 0; fast < 2; fast++) {
        be->ops->set_fast_prefill(be, fast);
        printf("-- prefill matmuls, %s\n", fast ? "fast (bf16 operands)" : "precise (hi+lo bf16 operands)");
        bench_matmul(ST_DTYPE_BF16, 4096, 4096, 512, copy_bw);
        bench_matmul(ST_DTYPE_BF16, 1024, 4096, 512, copy_bw);
        bench_matmul(ST_DTYPE_BF16, 14336, 4096, 512, copy_bw);
        bench_matmul(ST_DTYPE_BF16, 4096, 14336, 512, copy_bw);
        bench_matmul(ST_DTYPE_BF16, 14336, 4096, 2048, copy_bw);
        bench_matmul(ST_DTYPE_Q8_0, 14336, 4096, 512, copy_bw);
        bench_matmul(ST_DTYPE_Q4_K, 14336, 4096, 512, copy_bw);
    }
    be->ops->set_fast_prefill(be, false);

    bench_attention(1, 32768, 32, 8, 128, copy_bw);
    bench_attention(1, 32768, 64, 8, 128, copy_bw);
    bench_attention(4, 32768, 32, 8, 128, copy_bw);
    bench_attention(1, 4096, 32, 8, 128, copy_bw);
    for (int fast = 0; fast < 2; fast++) {
        be->ops->set_fast_prefill(be, fast);
        printf("-- prefill attention, %s\n", fast ? "fast (bf16 operands)" : "precise (hi+lo bf16 operands)");
        bench_attention(512, 4096, 32, 8, 128, copy_bw);
        bench_attention(4096, 4096, 32, 8, 128, copy_bw);
        bench_attention(16384, 16384, 32, 8, 128, copy_bw);
    }
    be->ops->set_fast_prefill(be, false);
    printf("peak device memory %.1f MiB\n", (double)be->device_budget.peak / 1048576.0);

    be->ops->stream_destroy(be, s);
    st_backend_free(be);
    return 0;
}

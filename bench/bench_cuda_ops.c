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
 * (decode attention).
 *
 * Usage: bench_cuda_ops [--device N] [--only prefill-attn|attn-part|sample|gemv|gemv1|batch|mmq|paged-decode]
 *                       [--gemm-min-n N] [--gemm-min-n-quant N] [--no-pdl] [--mmq-type T]
 *   --only SECTION      one section alone: the prefill attention kernels,
 *                       attention_part (a context attended piece by piece,
 *                       beside one attention call over it), the sample op,
 *                       the decode GEMV over every dtype and shape, the
 *                       one-token int8 GEMV's variants (staged kernel, rows
 *                       per warp; not in the full run), or the
 *                       batched decode matmuls (GEMV / GEMM switch), or the
 *                       quantized matmuls' GEMV / MMQ / GEMM switch points
 *                       (fast mode, n = 1 .. 256: the table MMQ_MIN_N and
 *                       MMQ_MAX_N come from; not in the full run), or the
 *                       attention of decode steps (1 / 8 / 64 sequences: the
 *                       default, the block- and the warp-per-item decode kernels
 *                       and the tile kernel; not in the full run)
 *   --mmq-type T        the mmq section for one weight type (q4_0, q8_0, q4_1, q4_k, q6_k)
 *   --gemm-min-n N, --gemm-min-n-quant N   st_backend_params' GEMV / GEMM switch
 *                       points (2: time the GEMM at every n of the batch section)
 *   --no-pdl            kernels launched without programmatic dependent launch
 * (a bare number is taken as --device, as before). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/quant.h"

static st_backend *be;
static st_stream *s;
static st_backend_params g_params = {.kind = ST_BACKEND_CUDA}; /* every backend of the run, from the options */

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

/* n bytes of host memory copied to backend b's memory. */
static void *upload_to(st_backend *b, const void *h, size_t n) {
    void *d = NULL;
    bool owned;
    TRY(b->ops->upload(b, h, n, &d, &owned));
    return d;
}
static void *upload(const void *h, size_t n) { return upload_to(be, h, n); }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Seconds per call of fn(i) on backend b's stream st, the median of 7
 * batches of `iters` (3 calls first, outside the timing). */
typedef void (*op_fn)(int i, void *ctx);
static double time_on(st_backend *b, st_stream *st, op_fn fn, void *ctx, int iters) {
    for (int i = 0; i < 3; i++) fn(i, ctx);
    TRY(b->ops->stream_sync(b, st));
    double t[7];
    for (int k = 0; k < 7; k++) {
        double t0 = st_time_now();
        for (int i = 0; i < iters; i++) fn(i, ctx);
        TRY(b->ops->stream_sync(b, st));
        t[k] = (st_time_now() - t0) / iters;
    }
    qsort(t, 7, sizeof t[0], cmp_d);
    return t[3];
}
static double time_op(op_fn fn, void *ctx, int iters) { return time_on(be, s, fn, ctx, iters); }

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
        m.w[c] = (st_weight){dws[c], t, N, K, 0};
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
    if (n <= 64)
        printf("matmul %-5s %6lld x %-6lld n=%-4lld %8.1f us  %7.0f GB/s of weight  (%.0f%% of copy bw)  %6.1f TFLOP/s\n",
               st_dtype_name(t), (long long)N, (long long)K, (long long)n, sec * 1e6, gbs, 100.0 * gbs * 1e9 / copy_bw,
               tfl);
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

static double time_attention(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd);

static void bench_attention(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd, double copy_bw) {
    const double sec = time_attention(n, n_kv, H, Hkv, hd);
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
}


/* ---- prefill attention: precise and fast mode on the default kernels, then
 * fast mode on every configuration of the FA2 kernel (st_backend_params.attn_fa2),
 * each on a backend of its own (read at backend init), side by side,
 * against the rate of a fast-mode bf16 GEMM (8192^3, cuBLAS) measured in the
 * same run. Causal, n = n_kv; TFLOP/s count the causal half (4 flops per key
 * and dim). */
static double gemm_rate_fast(void) {
    const int64_t N = 8192, K = 8192, n = 8192;
    mm_ctx m = {.n = n, .copies = 4};
    const size_t wbytes = st_dtype_row_bytes(ST_DTYPE_BF16, K) * (size_t)N;
    uint8_t *hw = host_weight(ST_DTYPE_BF16, N, K);
    void *dws[4];
    for (int c = 0; c < m.copies; c++) {
        dws[c] = upload(hw, wbytes);
        m.w[c] = (st_weight){dws[c], ST_DTYPE_BF16, N, K, 0};
    }
    free(hw);
    m.x = dev_floats(n * K, 1.0f);
    TRY(be->ops->alloc(be, (size_t)(n * N) * 4, (void **)&m.y));
    be->ops->set_fast_prefill(be, true);
    const double sec = time_op(mm_fn, &m, 10);
    be->ops->set_fast_prefill(be, false);
    for (int c = 0; c < m.copies; c++) be->ops->dealloc(be, dws[c]);
    be->ops->dealloc(be, (void *)m.x);
    be->ops->dealloc(be, m.y);
    return 2.0 * (double)n * N * K / sec;
}

static void bench_prefill_attention(double copy_bw) {
    for (int fast = 0; fast < 2; fast++) {
        be->ops->set_fast_prefill(be, fast);
        printf("-- prefill attention, %s\n", fast ? "fast (bf16 operands)" : "precise (hi+lo bf16 operands)");
        bench_attention(512, 4096, 32, 8, 128, copy_bw);
        bench_attention(4096, 4096, 32, 8, 128, copy_bw);
        bench_attention(16384, 16384, 32, 8, 128, copy_bw);
    }
    be->ops->set_fast_prefill(be, false);
    const double gemm = gemm_rate_fast();
    printf("roofline: fast-mode bf16 GEMM 8192^3 (cuBLAS) %.1f TFLOP/s; 50%% = %.1f\n", gemm / 1e12, gemm / 2e12);
    static const int64_t cs[][4] = {{2048, 32, 8, 128}, {4096, 32, 8, 128}, {16384, 32, 8, 128}, {16384, 32, 8, 64}};
    /* the FA2 configurations (cuda_attn_prefill_fa2.cuh) and the Hopper kernel
     * without and with its warpgroups' turns (cuda_attn_prefill_wgmma.cuh; head
     * dim 128 on compute capability 9.0, else they run FA2's auto choice) */
    static const char *const vars[] = {"b128w8", "b128w8r", "b128w4", "b256w8", "wgmma", "wgmma-pp"};
    enum { NC = sizeof cs / sizeof cs[0], NV = sizeof vars / sizeof vars[0] };
    double t[NV][NC];
    st_backend *saved = be;
    st_stream *saved_s = s;
    for (int v = 0; v < NV; v++) {
        st_backend_params p = g_params;
        p.attn_fa2 = vars[v];
        TRY(st_backend_init(&p, &be));
        TRY(be->ops->stream_create(be, false, &s));
        be->ops->set_fast_prefill(be, true);
        for (int i = 0; i < NC; i++) t[v][i] = time_attention(cs[i][0], cs[i][0], cs[i][1], cs[i][2], cs[i][3]);
        be->ops->stream_destroy(be, s);
        st_backend_free(be);
        be = saved, s = saved_s;
    }
    printf("-- prefill attention, fast: kernels by st_backend_params.attn_fa2 (FA2 configurations, the Hopper "
           "wgmma kernel), causal; TFLOP/s (ms)\n");
    printf("%-34s", "case");
    for (int v = 0; v < NV; v++) printf(" | %-17s", vars[v]);
    printf(" | best\n");
    for (int i = 0; i < NC; i++) {
        const double n = (double)cs[i][0];
        const double flops = 4.0 * n * (n + 1) / 2.0 * (double)cs[i][3] * (double)cs[i][1];
        char label[64];
        snprintf(label, sizeof label, "prefill attn fast n=%lld %lld/%lld hd %lld", (long long)cs[i][0],
                 (long long)cs[i][1], (long long)cs[i][2], (long long)cs[i][3]);
        printf("%-34s", label);
        int best = 0;
        for (int v = 0; v < NV; v++) {
            printf(" | %6.1f (%7.3f)", flops / t[v][i] / 1e12, t[v][i] * 1e3);
            if (t[v][i] < t[best][i]) best = v;
        }
        printf(" | %s %.1f TFLOP/s = %.0f%% of the GEMM, %.2fx b128w8\n", vars[best], flops / t[best][i] / 1e12,
               100.0 * flops / t[best][i] / gemm, t[0][i] / t[best][i]);
    }
}

/* ---- attention kernels ----
 * Decode over 4K / 32K / 128K keys (32/8 heads, hd 128): K+V bytes / copy bw.
 * attention_paged prefill of one 512- / 2048-token sequence (block size 16,
 * blocks in shuffled order) vs the contiguous op on the same keys (causal,
 * precise mode), and one paged decode over 32K keys. */
typedef struct {
    const float *q;
    st_paged_kv kv;
    const int32_t *seq, *pos;
    float *out;
    int64_t n, H, Hkv, hd;
} pa_ctx;
static void pa_fn(int i, void *p) {
    pa_ctx *a = p;
    TRY(be->ops->attention_paged(be, s, a->q, &a->kv, a->seq, a->pos, a->n, a->H, a->Hkv, a->hd,
                                 1.0f / sqrtf((float)a->hd), a->out));
}

/* S sequences of ctx keys each in a shuffled pool of bs-slot blocks, cache
 * type kt (arbitrary bytes: timing only); the last n positions of each are
 * queried. batch_seqs: the kv's host hint (1 makes a batch of decodes look
 * like a prefill to the CUDA backend: the tile kernel, the same bits). */
static double bench_paged_sq(st_kv_dtype kt, int64_t S, int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t hd,
                             int64_t bs, int64_t batch_seqs) {
    const int64_t nt = S * n;
    pa_ctx a = {.n = nt, .H = H, .Hkv = Hkv, .hd = hd};
    const int64_t nbs = (ctx + bs - 1) / bs, nb = nbs * S, n_slots = nb * bs;
    int32_t *tab = malloc((size_t)nb * 4), *hs = malloc((size_t)nt * 4), *hp = malloc((size_t)nt * 4),
            *cl = malloc((size_t)S * 4);
    for (int64_t i = 0; i < nb; i++) tab[i] = (int32_t)i;
    for (int64_t i = nb - 1; i > 0; i--) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        const int64_t j = (int64_t)(rng % (uint64_t)(i + 1));
        const int32_t t = tab[i];
        tab[i] = tab[j], tab[j] = t;
    }
    for (int64_t q = 0; q < S; q++) {
        cl[q] = (int32_t)ctx;
        for (int64_t i = 0; i < n; i++) hs[q * n + i] = (int32_t)q, hp[q * n + i] = (int32_t)(ctx - n + i);
    }
    const int64_t nel = (n_slots * Hkv * hd * (int64_t)st_kv_dtype_size(kt) + 3) / 4; /* floats of bytes */
    a.kv = (st_paged_kv){{dev_floats(nel, 1.0f), dev_floats(nel, 1.0f), NULL, NULL, kt, n_slots, Hkv, hd}, bs,
                         upload(tab, (size_t)nb * 4), nbs, upload(cl, (size_t)S * 4), S, ctx, batch_seqs};
    if (kt == ST_KV_FP8) a.kv.cache.k_scale = dev_floats(n_slots * Hkv, 1.0f), a.kv.cache.v_scale = dev_floats(n_slots * Hkv, 1.0f);
    a.q = dev_floats(nt * H * hd, 1.0f);
    a.seq = upload(hs, (size_t)nt * 4);
    a.pos = upload(hp, (size_t)nt * 4);
    TRY(be->ops->alloc(be, (size_t)(nt * H * hd) * 4, (void **)&a.out));
    const double sec = time_op(pa_fn, &a, nt <= 64 ? 50 : 5);
    be->ops->dealloc(be, a.kv.cache.k);
    be->ops->dealloc(be, a.kv.cache.v);
    if (a.kv.cache.k_scale) be->ops->dealloc(be, a.kv.cache.k_scale), be->ops->dealloc(be, a.kv.cache.v_scale);
    be->ops->dealloc(be, (void *)a.kv.block_tables);
    be->ops->dealloc(be, (void *)a.kv.ctx_lens);
    be->ops->dealloc(be, (void *)a.q);
    be->ops->dealloc(be, (void *)a.seq);
    be->ops->dealloc(be, (void *)a.pos);
    be->ops->dealloc(be, a.out);
    free(tab), free(hs), free(hp), free(cl);
    return sec;
}

/* One sequence: the last n of its ctx positions queried. */
static double bench_paged_t(st_kv_dtype kt, int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t hd, int64_t bs) {
    return bench_paged_sq(kt, 1, n, ctx, H, Hkv, hd, bs, 0);
}

static double bench_paged(int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t hd, int64_t bs) {
    return bench_paged_t(ST_KV_F32, n, ctx, H, Hkv, hd, bs);
}

/* Paged attention per cache type (32/8 heads, hd 128, bs 16): a decode over
 * 32K keys (GB/s of the type's K+V bytes) and a 2048-token prefill. */
static void bench_paged_dtypes(double copy_bw) {
    printf("-- attention_paged per KV cache type; 32/8 heads, hd 128, bs 16\n");
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++) {
        const double dec = bench_paged_t((st_kv_dtype)kt, 1, 32768, 32, 8, 128, 16);
        const double pre = bench_paged_t((st_kv_dtype)kt, 2048, 2048, 32, 8, 128, 16);
        const double bytes = 2.0 * 32768.0 * 8 * 128 * (double)st_kv_dtype_size((st_kv_dtype)kt);
        const double flops = 4.0 * 2048.0 * 2049.0 / 2.0 * 128 * 32;
        printf("paged %-4s decode n_kv=32768 %8.1f us  %5.0f GB/s of K+V  %3.0f%% of copy bw | prefill n=2048 "
               "%8.3f ms  %6.1f TFLOP/s\n",
               st_kv_dtype_name((st_kv_dtype)kt), dec * 1e6, bytes / dec / 1e9, 100.0 * bytes / dec / copy_bw,
               pre * 1e3, flops / pre / 1e12);
    }
}

/* A decode step's attention: S sequences of ctx keys each, one token each
 * at the last position, 32/8 heads, hd 128, bs 16. */
static double bench_paged_step(st_kv_dtype kt, int64_t S, int64_t ctx, bool tile) {
    return bench_paged_sq(kt, S, 1, ctx, 32, 8, 128, 16, tile ? 1 : 0);
}

/* --only paged-decode: decode steps' attention (the decode kernel and its
 * merge), K+V bytes read / time against the copy roofline: by the default
 * rule, then on backends that take the block-per-item and the warp-per-item
 * kernel for every batch (st_backend_params.paged_dec 1, 2), and, from 8
 * sequences, the same batch through the 64-row tile kernel (batch_seqs = 1
 * makes it look like a prefill: the bits are the same). */
static void bench_paged_decode(double copy_bw) {
    printf("-- attention_paged, decode steps: S sequences x 1 token at context ctx, 32/8 heads, hd 128, bs 16; "
           "us and %% of copy bw %.0f GB/s (K+V bytes / time): default | block per item | warp per item | tile kernel\n",
           copy_bw / 1e9);
    st_backend *alt[2] = {NULL, NULL};
    st_stream *alt_s[2] = {NULL, NULL};
    for (int v = 0; v < 2; v++) {
        st_backend_params bp = g_params;
        bp.paged_dec = v + 1;
        TRY(st_backend_init(&bp, &alt[v]));
        TRY(alt[v]->ops->stream_create(alt[v], false, &alt_s[v]));
    }
    const int64_t seqs[3] = {1, 8, 64}, ctxs[3] = {576, 4096, 32768};
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++)
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) {
                if (seqs[i] * ctxs[j] > 64 * 4096) continue; /* pool size */
                const double bytes = 2.0 * (double)(seqs[i] * ctxs[j]) * 8 * 128 * (double)st_kv_dtype_size((st_kv_dtype)kt);
                const double t = bench_paged_step((st_kv_dtype)kt, seqs[i], ctxs[j], false);
                printf("paged-decode %-4s S=%-3lld ctx=%-6lld %8.1f us %3.0f%%", st_kv_dtype_name((st_kv_dtype)kt),
                       (long long)seqs[i], (long long)ctxs[j], t * 1e6, 100.0 * bytes / t / copy_bw);
                st_backend *be0 = be;
                st_stream *s0 = s;
                for (int v = 0; v < 2; v++) {
                    be = alt[v], s = alt_s[v];
                    const double tv = bench_paged_step((st_kv_dtype)kt, seqs[i], ctxs[j], false);
                    printf(" | %8.1f us %3.0f%%", tv * 1e6, 100.0 * bytes / tv / copy_bw);
                }
                be = be0, s = s0;
                if (seqs[i] > 2) {
                    const double tt = bench_paged_step((st_kv_dtype)kt, seqs[i], ctxs[j], true);
                    printf(" | %8.1f us %3.0f%% (%.2fx the default)", tt * 1e6, 100.0 * bytes / tt / copy_bw, tt / t);
                }
                printf("\n");
            }
    for (int v = 0; v < 2; v++) {
        alt[v]->ops->stream_destroy(alt[v], alt_s[v]);
        st_backend_free(alt[v]);
    }
}

static double time_attention(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd) {
    at_ctx a = {.n = n, .n_kv = n_kv, .H = H, .Hkv = Hkv, .hd = hd};
    a.q = dev_floats(n * H * hd, 1.0f);
    a.k = dev_floats(n_kv * Hkv * hd, 1.0f);
    a.v = dev_floats(n_kv * Hkv * hd, 1.0f);
    int32_t *hp = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) hp[i] = (int32_t)(n_kv - n + i);
    a.pos = upload(hp, (size_t)n * 4);
    free(hp);
    TRY(be->ops->alloc(be, (size_t)(n * H * hd) * 4, (void **)&a.out));
    const double sec = time_op(at_fn, &a, n == 1 ? 100 : 5);
    be->ops->dealloc(be, (void *)a.q);
    be->ops->dealloc(be, (void *)a.k);
    be->ops->dealloc(be, (void *)a.v);
    be->ops->dealloc(be, (void *)a.pos);
    be->ops->dealloc(be, a.out);
    return sec;
}

/* ---- attention_part: a context in pieces, beside attention ----
 * The queries (the last n positions of ctx keys) attend the context piece by
 * piece (piece starts `step` apart, the last piece holding the queries'
 * positions: attention_part, merging from the second piece on), timed as one
 * op, beside `attention` over the same pieces (positions shifted on the host
 * beforehand, no lse, no merge: the same kernels and work, so the difference
 * is attention_part's own cost) and `attention` over the whole context (one
 * call). The per-piece pair is timed twice, alternating, so that a drift of
 * the clocks shows. */
#define AP_MAXP 64
typedef struct {
    at_ctx a;
    float *lse;
    int64_t step;
    int np;
    int32_t *ppos[AP_MAXP]; /* per piece: min(pos - k0, len - 1) */
} ap_ctx;
static int64_t ap_k0(const ap_ctx *c, int pi) { return pi * c->step; }
static int64_t ap_len(const ap_ctx *c, int pi) { return pi + 1 < c->np ? c->step : c->a.n_kv - ap_k0(c, pi); }
static void ap_fn(int i, void *p) {
    ap_ctx *c = p;
    at_ctx *a = &c->a;
    const int64_t row = a->Hkv * a->hd;
    for (int pi = 0; pi < c->np; pi++) {
        const int64_t k0 = ap_k0(c, pi);
        TRY(be->ops->attention_part(be, s, a->q, a->k + k0 * row, a->v + k0 * row, a->pos, a->n, k0, ap_len(c, pi),
                                    a->H, a->Hkv, a->hd, 1.0f / sqrtf((float)a->hd), pi > 0, a->out, c->lse));
    }
}
static void ap_att_fn(int i, void *p) {
    ap_ctx *c = p;
    at_ctx *a = &c->a;
    const int64_t row = a->Hkv * a->hd;
    for (int pi = 0; pi < c->np; pi++) {
        const int64_t k0 = ap_k0(c, pi);
        TRY(be->ops->attention(be, s, a->q, a->k + k0 * row, a->v + k0 * row, c->ppos[pi], a->n, ap_len(c, pi), a->H,
                               a->Hkv, a->hd, 1.0f / sqrtf((float)a->hd), a->out));
    }
}

static void bench_attn_part_one(int64_t n, int64_t ctx, int64_t step, int64_t H, int64_t Hkv, int64_t hd,
                                double copy_bw) {
    ap_ctx c = {.a = {.n = n, .n_kv = ctx, .H = H, .Hkv = Hkv, .hd = hd}, .step = step};
    at_ctx *a = &c.a;
    for (int64_t k0 = 0; k0 <= ctx - n && c.np < AP_MAXP; k0 += step) c.np++;
    a->q = dev_floats(n * H * hd, 1.0f);
    a->k = dev_floats(ctx * Hkv * hd, 1.0f);
    a->v = dev_floats(ctx * Hkv * hd, 1.0f);
    int32_t *hp = malloc((size_t)n * 4), *hq = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) hp[i] = (int32_t)(ctx - n + i);
    a->pos = upload(hp, (size_t)n * 4);
    for (int pi = 0; pi < c.np; pi++) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = hp[i] - ap_k0(&c, pi), last = ap_len(&c, pi) - 1;
            hq[i] = (int32_t)(r < last ? r : last);
        }
        c.ppos[pi] = upload(hq, (size_t)n * 4);
    }
    free(hp), free(hq);
    TRY(be->ops->alloc(be, (size_t)(n * H * hd) * 4, (void **)&a->out));
    TRY(be->ops->alloc(be, (size_t)(n * H) * 4, (void **)&c.lse));
    const int iters = n == 1 ? 100 : 5;
    const double t_one = time_op(at_fn, a, iters);
    const double t_att1 = time_op(ap_att_fn, &c, iters), t_part1 = time_op(ap_fn, &c, iters);
    const double t_att2 = time_op(ap_att_fn, &c, iters), t_part2 = time_op(ap_fn, &c, iters);
    const double t_att = t_att1 < t_att2 ? t_att1 : t_att2, t_part = t_part1 < t_part2 ? t_part1 : t_part2;
    const double kv_bytes = 2.0 * (double)ctx * Hkv * hd * 4;
    double keys = 0;
    for (int64_t i = 0; i < n; i++) keys += (double)(ctx - n + i + 1);
    const double flops = 4.0 * keys * hd * H;
    printf("n=%-5lld ctx=%-6lld hd %-3lld %d x %-5lld: attention one call %8.1f us | pieces: attention %8.1f / %8.1f us, "
           "attention_part %8.1f / %8.1f us (%+5.1f%%)  ",
           (long long)n, (long long)ctx, (long long)hd, c.np, (long long)step, t_one * 1e6, t_att1 * 1e6, t_att2 * 1e6,
           t_part1 * 1e6, t_part2 * 1e6, 100.0 * (t_part / t_att - 1.0));
    if (n <= 16) printf("%.0f GB/s of K+V (copy bw %.0f)\n", kv_bytes / t_part / 1e9, copy_bw / 1e9);
    else printf("%.1f TFLOP/s\n", flops / t_part / 1e12);
    be->ops->dealloc(be, (void *)a->q);
    be->ops->dealloc(be, (void *)a->k);
    be->ops->dealloc(be, (void *)a->v);
    be->ops->dealloc(be, (void *)a->pos);
    for (int pi = 0; pi < c.np; pi++) be->ops->dealloc(be, c.ppos[pi]);
    be->ops->dealloc(be, a->out);
    be->ops->dealloc(be, c.lse);
}

static void bench_attn_part(double copy_bw) {
    printf("-- attention_part: a context in pieces (attention_part, beside attention over the same pieces, each\n"
           "   timed twice, and one attention call over it); 32/8 heads; (%%): the better of each pair\n");
    bench_attn_part_one(1, 32768, 32768, 32, 8, 128, copy_bw); /* one piece: lse only */
    bench_attn_part_one(1, 32768, 16384, 32, 8, 128, copy_bw);
    bench_attn_part_one(1, 131072, 16384, 32, 8, 128, copy_bw);
    bench_attn_part_one(4, 32768, 16384, 32, 8, 128, copy_bw);
    bench_attn_part_one(1, 32768, 16384, 32, 8, 64, copy_bw);
    for (int fast = 0; fast < 2; fast++) {
        be->ops->set_fast_prefill(be, fast);
        printf("-- attention_part, prefill, %s\n", fast ? "fast (bf16 operands)" : "precise (hi+lo bf16 operands)");
        bench_attn_part_one(4096, 4096, 4096, 32, 8, 128, copy_bw);   /* one piece: lse only */
        bench_attn_part_one(2048, 16384, 4096, 32, 8, 128, copy_bw);  /* 4 pieces */
        bench_attn_part_one(2048, 32768, 16384, 32, 8, 128, copy_bw); /* 2 pieces */
        bench_attn_part_one(512, 32768, 16384, 32, 8, 128, copy_bw);
        bench_attn_part_one(2048, 16384, 4096, 32, 8, 64, copy_bw);
        bench_attn_part_one(4096, 4096, 4096, 32, 8, 64, copy_bw);
    }
    be->ops->set_fast_prefill(be, false);
}

static void bench_attention_kernels(double copy_bw) {
    double dec[3], pre[2], cpre[2];
    const int64_t dkv[3] = {4096, 32768, 131072}, pn[2] = {512, 2048};
    for (int i = 0; i < 3; i++) dec[i] = time_attention(1, dkv[i], 32, 8, 128);
    for (int i = 0; i < 2; i++) {
        pre[i] = bench_paged(pn[i], pn[i], 32, 8, 128, 16);
        cpre[i] = time_attention(pn[i], pn[i], 32, 8, 128);
    }
    const double pdec = bench_paged(1, 32768, 32, 8, 128, 16);
    printf("-- attention kernels; 32/8 heads, hd 128\n");
    for (int i = 0; i < 3; i++) {
        const double bytes = 2.0 * (double)dkv[i] * 8 * 128 * 4;
        printf("attn decode n_kv=%-6lld %8.1f us  %5.0f GB/s of K+V  %3.0f%% of copy bw%s\n", (long long)dkv[i],
               dec[i] * 1e6, bytes / dec[i] / 1e9, 100.0 * bytes / dec[i] / copy_bw,
               dkv[i] == 32768 ? "  (goal 80%)" : "");
    }
    {
        const double bytes = 2.0 * 32768.0 * 8 * 128 * 4;
        printf("paged decode n_kv=32768 bs 16 %8.1f us  %5.0f GB/s of K+V  %3.0f%% of copy bw\n", pdec * 1e6,
               bytes / pdec / 1e9, 100.0 * bytes / pdec / copy_bw);
    }
    for (int i = 0; i < 2; i++) {
        const double flops = 4.0 * (double)pn[i] * (double)(pn[i] + 1) / 2.0 * 128 * 32;
        printf("paged prefill n=%-5lld bs 16 %8.3f ms  %6.1f TFLOP/s | contiguous (tensor cores) %8.3f ms"
               "  %6.1f TFLOP/s | paged / contiguous %.2fx%s\n",
               (long long)pn[i], pre[i] * 1e3, flops / pre[i] / 1e12, cpre[i] * 1e3, flops / cpre[i] / 1e12,
               pre[i] / cpre[i], pn[i] == 2048 ? "  (goal <= ~2x)" : "");
    }
}

/* ---- decode GEMV ----
 * Every dtype over the 8B shapes (weights rotated over >= 512 MiB of copies
 * so they come from HBM) for n = 1, 2, 8 tokens: bytes = the weight once;
 * fraction of the copy roofline. */
typedef struct {
    st_backend *b;
    st_stream *s;
    st_weight w[64];
    int copies;
    const float *x;
    float *y;
    int64_t n;
} gv_ctx;
static void gv_fn(int i, void *p) {
    gv_ctx *m = p;
    TRY(m->b->ops->matmul(m->b, m->s, m->x, &m->w[i % m->copies], m->n, m->y));
}
static double gv_time(gv_ctx *m, int iters) { return time_on(m->b, m->s, gv_fn, m, iters); }

static void bench_gemv(double copy_bw) {
    printf("-- decode GEMV: weight bytes / time, %% of copy bw %.0f GB/s\n", copy_bw / 1e9);
    const st_dtype types[] = {ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1,
                              ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    const int64_t shapes[4][2] = {{14336, 4096}, {4096, 14336}, {4096, 4096}, {1024, 4096}};
    const int64_t ns[4] = {1, 2, 5, 8};
    st_backend *b = be;
    const char *qo = getenv("BENCH_GEMV_INT8_ONLY"); /* set: only the types with int8 kernels */
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const st_dtype t = types[ti];
        if (qo && *qo && !(t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K))
            continue;
        for (int sh = 0; sh < 4; sh++) {
            const int64_t N = shapes[sh][0], K = shapes[sh][1];
            const size_t wbytes = st_dtype_row_bytes(t, K) * (size_t)N;
            int copies = (int)((((size_t)512 << 20) + wbytes - 1) / wbytes);
            copies = copies < 2 ? 2 : copies > 64 ? 64 : copies;
            uint8_t *hw = host_weight(t, N, K);
            void *dws[64];
            gv_ctx m = {.b = be, .s = s, .copies = copies};
            for (int c = 0; c < copies; c++) {
                dws[c] = upload(hw, wbytes);
                m.w[c] = (st_weight){dws[c], t, N, K, 0};
            }
            free(hw);
            float *hx = malloc((size_t)(8 * K) * 4);
            for (int64_t i = 0; i < 8 * K; i++) hx[i] = frand();
            float *dx = upload(hx, (size_t)(8 * K) * 4);
            free(hx);
            float *dy = NULL;
            TRY(b->ops->alloc(b, (size_t)(8 * N) * 4, (void **)&dy));
            m.x = dx, m.y = dy;
            /* the quantized types again in fast mode: the int8 kernels (x quantized per 32-block, dp4a) */
            const bool i8 = t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K;
            for (int fast = 0; fast < (i8 ? 2 : 1); fast++) {
                b->ops->set_fast_prefill(b, fast);
                for (int k = 0; k < 4; k++) {
                    m.n = ns[k];
                    const double sec = gv_time(&m, ns[k] == 1 ? 200 : 50);
                    printf("gemv %-5s %5lld x %-5lld n=%lld  %7.1f us %5.0f GB/s %3.0f%%%s\n", st_dtype_name(t),
                           (long long)N, (long long)K, (long long)ns[k], sec * 1e6, (double)wbytes / sec / 1e9,
                           100.0 * (double)wbytes / sec / copy_bw, fast ? "  int8 (fast)" : "");
                }
            }
            b->ops->set_fast_prefill(b, false);
            for (int c = 0; c < copies; c++) b->ops->dealloc(b, dws[c]);
            b->ops->dealloc(b, dx);
            b->ops->dealloc(b, dy);
        }
    }
}

/* ---- one-token int8 GEMV variants ----
 * Fast mode, one token, the 8B decode step's matmuls as the model issues
 * them (q|k|v in one matmul_multi, gate and up in one matmul_swiglu, o,
 * down, the LM head) for q8_0, q4_0, q4_1, q4_k, q6_k, on backends that
 * differ only in st_backend_params.gemv1_rows: the staged kernel (-1; the
 * fp32 kernels for q8_0 and q6_k), the direct
 * kernel with 1, 2, 4 rows per warp, and the default rule (0). Each time
 * includes the activation's quantization; weights rotate over >= 512 MiB
 * of copies (HBM, not L2); % of the copy roofline. cuda_matmul.cu's
 * gemv1_rows rule comes from this table. */
typedef struct {
    st_backend *b;
    st_stream *s;
    st_weight w[64][3];
    int copies, kind; /* 0 plain, 1 q|k|v, 2 gate + up */
    const float *x;
    float *y[3];
} g1_ctx;
static void g1_fn(int i, void *p) {
    g1_ctx *m = p;
    const st_weight *w = m->w[i % m->copies];
    if (m->kind == 1) TRY(m->b->ops->matmul_multi(m->b, m->s, m->x, w, 3, 1, m->y));
    else if (m->kind == 2) TRY(m->b->ops->matmul_swiglu(m->b, m->s, m->x, &w[0], &w[1], 1, m->y[0], NULL));
    else TRY(m->b->ops->matmul(m->b, m->s, m->x, &w[0], 1, m->y[0]));
}
static void bench_gemv1(double copy_bw) {
    static const st_dtype types[] = {ST_DTYPE_Q4_0, ST_DTYPE_Q8_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    static const struct {
        const char *name;
        int kind;
        int64_t N[3], K;
    } ops[] = {{"q|k|v", 1, {4096, 1024, 1024}, 4096}, {"o", 0, {4096}, 4096},
               {"gate+up", 2, {14336, 14336}, 4096},  {"down", 0, {4096}, 14336},
               {"lm_head", 0, {128256}, 4096}};
    static const int rows[] = {-1, 1, 2, 4, 0};
    static const char *rn[] = {"staged", "rows 1", "rows 2", "rows 4", "default"};
    enum { NV = 5 };
    st_backend *bs[NV];
    st_stream *ss[NV];
    for (int v = 0; v < NV; v++) {
        st_backend_params bp = g_params;
        bp.gemv1_rows = rows[v];
        TRY(st_backend_init(&bp, &bs[v]));
        TRY(bs[v]->ops->stream_create(bs[v], false, &ss[v]));
        bs[v]->ops->set_fast_prefill(bs[v], true);
    }
    printf("-- one-token int8 GEMV (fast mode), us and %% of copy bw %.0f GB/s: staged kernel / direct kernel "
           "with 1, 2, 4 rows per warp / default\n", copy_bw / 1e9);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t oi = 0; oi < sizeof ops / sizeof ops[0]; oi++) {
            const st_dtype t = types[ti];
            const int nw = ops[oi].kind == 1 ? 3 : ops[oi].kind == 2 ? 2 : 1;
            const int64_t K = ops[oi].K;
            size_t wbytes = 0;
            for (int i = 0; i < nw; i++) wbytes += st_dtype_row_bytes(t, K) * (size_t)ops[oi].N[i];
            int copies = (int)((((size_t)512 << 20) + wbytes - 1) / wbytes);
            copies = copies < 2 ? 2 : copies > 64 ? 64 : copies;
            printf("gemv1 %-5s %-7s", st_dtype_name(t), ops[oi].name);
            for (int v = 0; v < NV; v++) {
                st_backend *b = bs[v];
                g1_ctx m = {.b = b, .s = ss[v], .copies = copies, .kind = ops[oi].kind};
                void *dws[64][3];
                for (int i = 0; i < nw; i++) {
                    uint8_t *hw = host_weight(t, ops[oi].N[i], K);
                    const size_t ib = st_dtype_row_bytes(t, K) * (size_t)ops[oi].N[i];
                    for (int c = 0; c < copies; c++) {
                        dws[c][i] = upload_to(b, hw, ib);
                        m.w[c][i] = (st_weight){dws[c][i], t, ops[oi].N[i], K, 0};
                    }
                    free(hw);
                }
                float *hx = malloc((size_t)K * 4);
                for (int64_t i = 0; i < K; i++) hx[i] = frand();
                float *dx = upload_to(b, hx, (size_t)K * 4);
                free(hx);
                for (int i = 0; i < nw; i++) TRY(b->ops->alloc(b, (size_t)ops[oi].N[i] * 4, (void **)&m.y[i]));
                m.x = dx;
                const double sec = time_on(b, ss[v], g1_fn, &m, 100);
                printf("  %s %6.1f us %3.0f%%", rn[v], sec * 1e6, 100.0 * (double)wbytes / sec / copy_bw);
                for (int c = 0; c < copies; c++)
                    for (int i = 0; i < nw; i++) b->ops->dealloc(b, dws[c][i]);
                b->ops->dealloc(b, dx);
                for (int i = 0; i < nw; i++) b->ops->dealloc(b, m.y[i]);
            }
            printf("\n");
        }
    for (int v = 0; v < NV; v++) {
        bs[v]->ops->stream_destroy(bs[v], ss[v]);
        st_backend_free(bs[v]);
    }
}

/* ---- MMQ switch points ----
 * Fast mode, quantized weights, the 8B shapes, n = 1 .. 256: the same
 * matmul on three backends that differ only in where their tuning
 * (st_backend_params) sends it: the GEMV at every n (gemm_min_n_quant 2^20,
 * MMQ off; int8, but fp32 for q6_k, which has no int8 GEMV above one
 * token), the int8 tensor-core MMQ at every n (mmq_min_n 1), and
 * dequantize + cuBLAS GEMM (gemm_min_n_quant 2, MMQ off; n = 1 stays the
 * GEMV there, not shown). Each line gives the three times, the fastest, and
 * the weights' bytes once at the copy bandwidth (the floor while memory
 * bound). cuda_matmul.cu's MMQ_MIN_N / MMQ_MAX_N come from this table. */
static int g_mmq_type = -1; /* --mmq-type: that dtype's rows alone */
static void bench_mmq(double copy_bw) {
    static const st_dtype types[] = {ST_DTYPE_Q4_0, ST_DTYPE_Q8_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    static const int64_t shapes[][2] = {{4096, 4096}, {14336, 4096}, {4096, 14336}, {1024, 4096}};
    static const int64_t ns[] = {1, 2, 4, 5, 8, 12, 16, 32, 48, 64, 128, 256};
    enum { NTY = 5, NSH = 4, NN = 12 };
    static double tm[3][NTY][NSH][NN];
    st_backend *be0 = be;
    st_stream *s0 = s;
    for (int p = 0; p < 3; p++) {
        st_backend_params bp = g_params;
        bp.gemm_min_n_quant = p == 2 ? 2 : 1 << 20;
        bp.mmq_min_n = p == 1 ? 1 : 0;
        bp.mmq_max_n = p == 1 ? 1 << 20 : -1;
        TRY(st_backend_init(&bp, &be));
        TRY(be->ops->stream_create(be, false, &s));
        be->ops->set_fast_prefill(be, true);
        for (int ti = 0; ti < NTY; ti++)
            for (int sh = 0; sh < NSH; sh++) {
                const st_dtype t = types[ti];
                if (g_mmq_type >= 0 && (int)t != g_mmq_type) continue;
                const int64_t N = shapes[sh][0], K = shapes[sh][1];
                const size_t wbytes = st_dtype_row_bytes(t, K) * (size_t)N;
                int copies = (int)((((size_t)256 << 20) + wbytes - 1) / wbytes);
                copies = copies < 2 ? 2 : copies > 64 ? 64 : copies;
                uint8_t *hw = host_weight(t, N, K);
                void *dws[64];
                gv_ctx m = {.b = be, .s = s, .copies = copies};
                for (int c = 0; c < copies; c++) {
                    dws[c] = upload(hw, wbytes);
                    m.w[c] = (st_weight){dws[c], t, N, K, 0};
                }
                free(hw);
                const int64_t nmax = ns[NN - 1];
                float *hx = malloc((size_t)(nmax * K) * 4);
                for (int64_t i = 0; i < nmax * K; i++) hx[i] = frand();
                float *dx = upload(hx, (size_t)(nmax * K) * 4), *dy = NULL;
                free(hx);
                TRY(be->ops->alloc(be, (size_t)(nmax * N) * 4, (void **)&dy));
                m.x = dx, m.y = dy;
                for (int k = 0; k < NN; k++) {
                    m.n = ns[k];
                    if (p == 2 && m.n == 1) {
                        tm[p][ti][sh][k] = NAN;
                        continue;
                    }
                    double t0 = st_time_now(); /* a first estimate sizes the batches (~5 ms each) */
                    for (int i = 0; i < 3; i++) gv_fn(i, &m);
                    TRY(be->ops->stream_sync(be, s));
                    const double est = (st_time_now() - t0) / 3;
                    int iters = (int)(5e-3 / est);
                    iters = iters < 3 ? 3 : iters > 200 ? 200 : iters;
                    tm[p][ti][sh][k] = gv_time(&m, iters);
                }
                for (int c = 0; c < copies; c++) be->ops->dealloc(be, dws[c]);
                be->ops->dealloc(be, dx);
                be->ops->dealloc(be, dy);
            }
        be->ops->stream_destroy(be, s);
        st_backend_free(be);
    }
    be = be0, s = s0;
    static const char *pn[3] = {"gemv", "mmq", "gemm"};
    printf("-- quantized matmuls, fast mode: GEMV (int8; q6_k fp32) / int8 tensor-core MMQ / dequantize + GEMM "
           "(us)\n");
    for (int ti = 0; ti < NTY; ti++)
        for (int sh = 0; sh < NSH; sh++) {
            if (g_mmq_type >= 0 && (int)types[ti] != g_mmq_type) continue;
            const int64_t N = shapes[sh][0], K = shapes[sh][1];
            const double floor_us = (double)(st_dtype_row_bytes(types[ti], K) * (size_t)N) / copy_bw * 1e6;
            for (int k = 0; k < NN; k++) {
                int best = 0;
                for (int p = 1; p < 3; p++)
                    if (tm[p][ti][sh][k] < tm[best][ti][sh][k]) best = p; /* NaN never wins */
                const double mq = tm[1][ti][sh][k];
                printf("mmq-table %-5s %5lld x %-5lld n=%-3lld  gemv %8.1f  mmq %8.1f  gemm %8.1f  best %-4s  "
                       "(weights at copy bw %5.1f us; mmq %5.1f TOP/s)\n",
                       st_dtype_name(types[ti]), (long long)N, (long long)K, (long long)ns[k], tm[0][ti][sh][k] * 1e6,
                       mq * 1e6, tm[2][ti][sh][k] * 1e6, pn[best], floor_us,
                       2.0 * (double)N * (double)K * (double)ns[k] / mq / 1e12);
            }
        }
}

/* ---- sample: 64 rows x 128256 logits (Llama 3 vocabulary) ----
 * Per call, for a few parameter mixes, beside two references measured here:
 * one read of the logits at the copy roofline, and copying them to pinned
 * host memory (what host sampling needs before it can start). */
typedef struct {
    const float *x;
    const st_sample_args *args;
    int32_t *out;
    int64_t n, V;
    void *host;
} smp_ctx;
static void smp_fn(int i, void *p) {
    smp_ctx *c = p;
    TRY(be->ops->sample(be, s, c->x, c->n, c->V, c->args, c->out));
}
static void smp_d2h_fn(int i, void *p) {
    smp_ctx *c = p;
    TRY(be->ops->copy_d2h(be, s, c->host, c->x, (size_t)(c->n * c->V) * sizeof(float)));
}

static void bench_sample(double copy_bw) {
    const int64_t n = 64, V = 128256;
    float *h = malloc((size_t)(n * V) * sizeof *h);
    for (int64_t i = 0; i < n * V; i++) { /* roughly gaussian, std ~3 */
        const float a = frand(), b = frand(), c = frand();
        h[i] = 3.0f * (a + b + c);
    }
    smp_ctx c = {.n = n, .V = V};
    c.x = upload(h, (size_t)(n * V) * sizeof *h);
    TRY(be->ops->alloc(be, (size_t)n * sizeof(int32_t), (void **)&c.out));
    TRY(be->ops->host_alloc(be, (size_t)(n * V) * sizeof(float), &c.host));
    const double bytes = (double)(n * V) * sizeof(float);
    const double d2h = time_op(smp_d2h_fn, &c, 5);
    printf("-- sample %lld rows x %lld: one read of the logits at copy bw %.1f us; their copy to the host %.1f us\n",
           (long long)n, (long long)V, bytes / copy_bw * 1e6, d2h * 1e6);
    static const struct {
        const char *name;
        float t;
        int32_t k;
        float p, minp;
    } mix[] = {{"greedy (T 0)", 0.0f, 0, 1.0f, 0.0f},          {"T 0.7, top_k 40", 0.7f, 40, 1.0f, 0.0f},
               {"T 1, top_k 40, top_p 0.9", 1.0f, 40, 0.9f, 0.0f}, {"T 1, top_p 0.9", 1.0f, 0, 0.9f, 0.0f},
               {"T 1, top_p 0.95, min_p 0.05", 1.0f, 0, 0.95f, 0.05f}, {"T 1 (no truncation)", 1.0f, 0, 1.0f, 0.0f},
               {"mixed: rows cycle the above", -1.0f, 0, 0.0f, 0.0f}};
    const int nm = (int)(sizeof mix / sizeof mix[0]);
    st_sample_args *a = malloc((size_t)n * sizeof *a);
    for (int m = 0; m < nm; m++) {
        for (int64_t r = 0; r < n; r++) {
            const int j = mix[m].t < 0 ? (int)(r % (nm - 1)) : m;
            a[r] = (st_sample_args){.u = (frand() + 1.0) * 0.5 * 0.999, .temperature = mix[j].t, .top_k = mix[j].k,
                                    .top_p = mix[j].p, .min_p = mix[j].minp};
        }
        c.args = upload(a, (size_t)n * sizeof *a);
        const double t = time_op(smp_fn, &c, 20);
        printf("sample %-30s %8.1f us per call  (%.2fx one read of the logits; %.1fx faster than copying them out)\n",
               mix[m].name, t * 1e6, t / (bytes / copy_bw), d2h / t);
        be->ops->dealloc(be, (void *)c.args);
    }
    be->ops->dealloc(be, (void *)c.x);
    be->ops->dealloc(be, c.out);
    be->ops->host_dealloc(be, c.host);
    free(a);
    free(h);
}

static void usage(FILE *f) {
    fprintf(f, "usage: bench_cuda_ops [--device N] [--only prefill-attn|attn-part|sample|gemv|gemv1|batch|mmq|paged-decode] [--gemm-min-n N]\n"
               "                      [--gemm-min-n-quant N] [--no-pdl] [--mmq-type q4_0|q8_0|q4_1|q4_k|q6_k]\n");
}

/* A whole decimal number in [lo, hi] or exit(2). */
static int int_arg(const char *opt, const char *v, int lo, int hi) {
    char *end = NULL;
    const long x = v ? strtol(v, &end, 10) : 0;
    if (!v || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "bench_cuda_ops: %s takes an integer in [%d, %d]\n", opt, lo, hi);
        usage(stderr);
        exit(2);
    }
    return (int)x;
}

int main(int argc, char **argv) {
    const char *only = NULL; /* one section alone */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--device")) {
            g_params.device_index = int_arg(a, v, 0, 1024), i++;
        } else if (!strcmp(a, "--only")) {
            if (!v || (strcmp(v, "prefill-attn") && strcmp(v, "attn-part") && strcmp(v, "sample") && strcmp(v, "gemv") &&
                       strcmp(v, "gemv1") && strcmp(v, "batch") && strcmp(v, "mmq") && strcmp(v, "paged-decode"))) {
                fprintf(stderr, "bench_cuda_ops: --only takes prefill-attn, attn-part, sample, gemv, gemv1, batch, mmq or paged-decode\n");
                return 2;
            }
            only = v, i++;
        } else if (!strcmp(a, "--gemm-min-n")) {
            g_params.gemm_min_n = int_arg(a, v, 2, 1 << 20), i++;
        } else if (!strcmp(a, "--gemm-min-n-quant")) {
            g_params.gemm_min_n_quant = int_arg(a, v, 2, 1 << 20), i++;
        } else if (!strcmp(a, "--no-pdl")) {
            g_params.pdl = -1;
        } else if (!strcmp(a, "--mmq-type")) {
            static const st_dtype mt[] = {ST_DTYPE_Q4_0, ST_DTYPE_Q8_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
            for (size_t k = 0; v && k < sizeof mt / sizeof mt[0]; k++)
                if (!strcmp(v, st_dtype_name(mt[k]))) g_mmq_type = (int)mt[k];
            if (g_mmq_type < 0) {
                fprintf(stderr, "bench_cuda_ops: --mmq-type takes q4_0, q8_0, q4_1, q4_k or q6_k\n");
                return 2;
            }
            i++;
        } else if (a[0] >= '0' && a[0] <= '9') { /* the device index, as the first version took it */
            g_params.device_index = int_arg("device", a, 0, 1024);
        } else {
            fprintf(stderr, "bench_cuda_ops: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    TRY(st_backend_init(&g_params, &be));
    TRY(be->ops->stream_create(be, false, &s));

    copy_ctx c = {.n = (size_t)1 << 30};
    c.a = dev_random(c.n);
    c.b = dev_random(c.n);
    const double csec = time_op(copy_fn, &c, 10);
    const double copy_bw = 2.0 * (double)c.n / csec;
    printf("roofline: device-to-device copy %.0f GB/s (bytes read + written)\n", copy_bw / 1e9);
    be->ops->dealloc(be, c.a);
    be->ops->dealloc(be, c.b);
    if (only && !strcmp(only, "prefill-attn")) {
        bench_prefill_attention(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "attn-part")) {
        bench_attn_part(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "sample")) {
        bench_sample(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "gemv")) {
        bench_gemv(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "gemv1")) {
        bench_gemv1(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "paged-decode")) {
        bench_paged_decode(copy_bw);
        st_backend_free(be);
        return 0;
    }
    if (only && !strcmp(only, "mmq")) {
        bench_mmq(copy_bw);
        st_backend_free(be);
        return 0;
    }
    const bool only_batch = only && !strcmp(only, "batch");
    if (!only_batch) {
        bench_gemv(copy_bw);
        bench_sample(copy_bw);
    }

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
    for (int fast = 0; fast < 2 && !only_batch; fast++) {
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
    /* batched decode sizes: where the GEMV should hand over to the GEMM (run
     * once more with --gemm-min-n 2 --gemm-min-n-quant 2 to time the GEMM at
     * every n); --only batch runs this section alone */
    char mn[16] = "4", mq[16] = "12"; /* the backend's defaults (cuda_matmul.cu GEMM_MIN_N, _QUANT) */
    if (g_params.gemm_min_n) snprintf(mn, sizeof mn, "%d", g_params.gemm_min_n);
    if (g_params.gemm_min_n_quant) snprintf(mq, sizeof mq, "%d", g_params.gemm_min_n_quant);
    printf("-- batched decode matmuls (GEMV below n=%s, quantized below n=%s)\n", mn, mq);
    {
        static const int64_t ns[] = {2, 4, 8, 16, 32, 64};
        static const st_dtype ts[] = {ST_DTYPE_BF16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0};
        for (int ti = 0; ti < 3; ti++)
            for (int ni = 0; ni < 6; ni++) {
                bench_matmul(ts[ti], 14336, 4096, ns[ni], copy_bw);
                if (ts[ti] == ST_DTYPE_BF16) bench_matmul(ts[ti], 4096, 4096, ns[ni], copy_bw);
            }
    }
    if (only_batch) {
        st_backend_free(be);
        return 0;
    }

    bench_attention(1, 32768, 32, 8, 128, copy_bw);
    bench_attention(1, 32768, 64, 8, 128, copy_bw);
    bench_attention(4, 32768, 32, 8, 128, copy_bw);
    bench_attention(1, 4096, 32, 8, 128, copy_bw);
    bench_prefill_attention(copy_bw);
    bench_attention_kernels(copy_bw);
    bench_attn_part(copy_bw);
    bench_paged_dtypes(copy_bw);
    printf("peak device memory %.1f MiB\n", (double)be->device_budget.peak / 1048576.0);

    be->ops->stream_destroy(be, s);
    st_backend_free(be);
    return 0;
}

/* gpu_check_ops: every op of the CUDA backend against the CPU backend, on
 * random inputs of awkward sizes, plus the backend's memory, copies, streams
 * and events. Needs a GPU, so it is built with the CUDA backend but not
 * registered with CTest; tests/gpu/run_gpu_checks.sh runs it (and
 * tests/gpu/run_gpu_attn_prefill.sh, which sums up its "-- prefill
 * attention, fast mode: <configuration>" sections). Paths of the test
 * models: $STRATA_SRC/tests/data/models (default: the current directory).
 *
 * Error measure: max|gpu - cpu| / max|cpu| over the output (a NaN anywhere
 * fails). CUDA outputs are poisoned with 0xFF bytes (NaN) before each op, so
 * an element the op forgot to write fails the check. Thresholds per path:
 *   exact ops (get_rows, add):                    1e-6 (get_rows), 0 (add)
 *   fp32 ops (rmsnorm, rope, swiglu):             1e-5
 *   fp32 accumulation (GEMV path of matmul below
 *   the switch points, f32 GEMM, decode and
 *   generic attention):                           1e-5
 *   precise tensor-core paths (hi + lo bf16:
 *   matmul GEMM from gemm_min_n tokens, 4 by
 *   default, gemm_min_n_quant, 12, for quantized
 *   weights; prefill attention kernel):           1e-4
 *   fast mode (bf16 operands rounded once):       1e-2
 *   int8 activations (fast-mode GEMV, MMQ):       1.5e-2
 * RoPE at positions near 2^24, 2^26, 2^30 and 2^31 is checked against the
 * exact angle (computed here in double, independently of
 * backend/rope_angle.h), and the angle each backend used within 6e-8 rad. The decode-step ops (argmax,
 * matmul_multi, matmul_swiglu) are checked against the CPU backend,
 * and a graph recorded once and replayed with new inputs against the same
 * ops run directly. The sample op against the CPU's (same rows, same u: a
 * token may differ only within 1e-5 of a decision boundary). The paged-KV
 * ops, for each cache type (f32, bf16, fp8): kv_store_paged stores the CPU's
 * bytes and fp8 scales exactly (with -1 and out-of-range slots, a zero row,
 * a NaN), attention_paged within 1e-5 of the CPU over shuffled blocks
 * (decodes among prefill chunks, block sizes 1, 7, 16, GQA 1 to 12, head
 * dims 32/64/80/128, 40000 keys with sub-batched partials), bf16 / fp8
 * bit-identical to the f32 path over the dequantized pool, and
 * bit-identical on the GPU for a token alone, in a reversed batch and with a
 * larger max_ctx.
 * The CUDA backend's tuning comes through st_backend_params (read at init),
 * so the checks that depend on it run again on extra backends made with
 * other values: the decode GEMV kernels (every dtype, n = 1..8); the
 * GEMV / GEMM switch points (gemm_min_n, gemm_min_n_quant: the defaults, GEMM
 * from 2 tokens, GEMV up to 15 / 32 tokens; each matmul checked at the
 * threshold of the path its n takes); the decode-path kernels with
 * programmatic dependent launch off (pdl = -1); init refusing bad values.
 * The attention kernels (long decode, paged tiles of 1/7/64/300 tokens with
 * block sizes 16 and 32, GQA 4/1/12/96, a 42-sequence batch); fast-mode
 * prefill attention (bf16 operands, 1e-2) on the FA2 kernel in its default
 * configuration (auto) and in each of the others (st_backend_params.attn_fa2
 * = b128w8, b128w8r, b128w4, b256w8; check_attention_fast: partial blocks,
 * n_kv > n, GQA 1/3/4/8, hd 64/128, split and unsplit grids, keys past the
 * last position poisoned, descending positions, sizes below the FA2
 * threshold).
 * attention_part (check_attention_part, precise then fast mode): a context
 * of up to 40000 keys attended piece by piece (pieces of 1024 / 16384 keys
 * or uneven multiples of ST_ATTN_RANGE, the last holding the queries'
 * positions causally; merge from the second piece on) by 1, 4, 64, 600 and
 * 2048 queries, hd 64 and 128, GQA 32/8, against the CPU's single
 * `attention` over all keys at the attention thresholds above, and each
 * row's lse against a double-precision value (2e-5 on the fp32 decode
 * kernel, 1e-4 precise, 1e-2 fast).
 * The model (src/model), each backend with its own paged KV pool (f32 unless
 * said otherwise): st_llama_forward on a batch of 3 sequences (two prefill
 * chunks and a decode, then three decodes) within 1e-4 of the CPU, and on the
 * GPU a decode alone vs in the batch within 1e-5. Last, the whole forward
 * pass over the models of tests/data/models: decoding one token per pass
 * from an empty pool (st_llama_forward_sample, greedy, with the logits:
 * GEMV and fp32 attention) within 1e-4, the CUDA token the argmax of its own
 * logits and the CPU's wherever the CPU's top-2 gap is clear; a 12-token
 * prefill from position 0 over the same pool (st_llama_forward_seq,
 * overwriting it; tensor-core GEMM and attention) within 1e-4 (5e-2 in fast
 * mode); decoding on top of it (one-token st_llama_forward_seq calls) within
 * the same. Graphs are on (the default), so on CUDA the one-token passes
 * after the second of a shape replay a recorded graph: the check wants
 * replays in both decode phases (st_llama_get_graph_stats). The same again
 * with the KV pool in bf16: both backends store the same bf16 bytes, so the
 * difference stays at the f32 level and the f32 bounds apply.
 * Prints one line per check, then "N passed, M failed"; exits 1 on any
 * failure, 2 when a backend cannot be created. --only-attention: the
 * attention ops alone (attention, attention_part, kv_store_paged,
 * rope_kv_store and attention_paged, the fast-mode FA2 configurations);
 * --only-model: the models on both backends alone. --only-gemv: the
 * decode GEMV checks (fp32 and int8 kernels, rows-per-warp variants,
 * rmsnorm_matmul) and the MMQ's; --only-mmq: the int8 tensor-core matmul
 * of fast mode alone (check_mmq: 1.5e-2, as the int8 GEMV) and the
 * backend-parameter checks; --only-paged: the paged KV ops alone
 * (kv_store_paged, rope_kv_store, attention_paged, the decode kernels
 * forced), a subset of --only-attention. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/quant.h"
#include "loader/loader.h"
#include "model/llama.h"

static st_backend *g_cpu, *g_gpu;
static bool g_fast; /* the GPU backend is in fast-prefill mode */
/* the GPU backend's GEMV / GEMM switch points (st_backend_params.gemm_min_n,
 * gemm_min_n_quant; 0 there: these defaults of cuda_matmul.cu) */
static int g_min_n = 4, g_min_n_quant = 12;
/* its MMQ token counts in fast mode (st_backend_params.mmq_min_n, mmq_max_n;
 * 0 there: these defaults of cuda_matmul.cu; max 0 here: none) */
static int g_mmq_min = 5, g_mmq_max = 64;
static bool g_gemv1 = true; /* one token in fast mode on the direct int8 kernel (st_backend_params.gemv1_rows
                               not -1) */
static st_stream *g_s; /* a created GPU stream; some checks use NULL (the default) */
static int g_pass, g_fail;
static double g_t0;

/* ---- helpers ---- */

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint32_t rnd_u32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}
static float rnd_f(void) { return (float)((double)rnd_u32() / 4294967296.0 * 2.0 - 1.0); } /* [-1, 1) */

static void die(const char *what) {
    fprintf(stderr, "gpu_check_ops: %s: %s\n", what, st_last_error());
    exit(2);
}
#define TRY(x) do { if ((x) != STRATA_OK) die(#x); } while (0)

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "gpu_check_ops: out of host memory\n");
        exit(2);
    }
    return p;
}
static float *rand_f(int64_t n, float scale) {
    float *p = xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = rnd_f() * scale;
    return p;
}

static void check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s  ", ok ? "PASS" : "FAIL");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    if (ok) g_pass++;
    else g_fail++;
}

/* max|a - ref| / max|ref|; INFINITY when a or ref holds a NaN or inf. */
static double nerr(const float *a, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(ref[i])) return INFINITY;
        double e = fabs((double)a[i] - (double)ref[i]);
        if (e > num) num = e;
        if (fabs((double)ref[i]) > den) den = fabs((double)ref[i]);
    }
    return den > 0 ? num / den : num;
}

/* GPU memory helpers (abort on failure: the harness, not the checks). */
static void *g_alloc(size_t n) {
    void *p = NULL;
    TRY(g_gpu->ops->alloc(g_gpu, n, &p));
    return p;
}
static void g_sync(void) { TRY(g_gpu->ops->stream_sync(g_gpu, g_s)); }
static void *g_up(const void *h, size_t n) {
    void *p = g_alloc(n);
    TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, p, h, n));
    g_sync();
    return p;
}
static void g_poison(void *d, size_t n) {
    void *h = xmalloc(n);
    memset(h, 0xff, n);
    TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, d, h, n));
    g_sync();
    free(h);
}
static void *g_poisoned(size_t n) {
    void *p = g_alloc(n);
    g_poison(p, n);
    return p;
}
static void g_down(void *h, const void *d, size_t n) {
    TRY(g_gpu->ops->copy_d2h(g_gpu, g_s, h, d, n));
    g_sync();
}
static void g_free(void *d) { g_gpu->ops->dealloc(g_gpu, d); }

/* ---- weights ---- */

static uint16_t f16_bits(float f) { return st_f32_to_f16(f); }

/* Random rows x cols weight in dtype t (host bytes, caller frees). */
static uint8_t *make_weight(st_dtype t, int64_t rows, int64_t cols, float scale) {
    const size_t rb = st_dtype_row_bytes(t, cols);
    uint8_t *w = xmalloc(rb * (size_t)rows);
    if (t == ST_DTYPE_Q4_K || t == ST_DTYPE_Q6_K) { /* random blocks with sane scales */
        const st_dtype_info *info = st_dtype_get(t);
        const int64_t nb = rows * cols / info->block_elems;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *p = w + (size_t)b * info->block_bytes;
            for (size_t i = 0; i < info->block_bytes; i++) p[i] = (uint8_t)rnd_u32();
            if (t == ST_DTYPE_Q4_K) {
                uint16_t d = f16_bits(scale * (0.0005f + 0.001f * (rnd_f() + 1.0f))),
                         dm = f16_bits(scale * (0.0005f + 0.0005f * (rnd_f() + 1.0f)));
                memcpy(p, &d, 2);
                memcpy(p + 2, &dm, 2);
            } else {
                uint16_t d = f16_bits(scale * (0.0002f + 0.0003f * (rnd_f() + 1.0f)));
                memcpy(p + 208, &d, 2);
            }
        }
        return w;
    }
    float *f = rand_f(cols, scale);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) f[c] = rnd_f() * scale;
        if (!st_quantize_row(t, f, w + (size_t)r * rb, cols)) {
            fprintf(stderr, "gpu_check_ops: cannot quantize to %s\n", st_dtype_name(t));
            exit(2);
        }
    }
    free(f);
    return w;
}

static const st_dtype k_all[] = {ST_DTYPE_F32, ST_DTYPE_F16, ST_DTYPE_BF16, ST_DTYPE_Q8_0,
                                 ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};

/* ---- memory, copies, streams, events ---- */

static void check_memory(void) {
    const size_t base = g_gpu->device_budget.used;
    const size_t sizes[] = {1, 255, 256, 257, 4096, 1 << 20, (3 << 20) + 17, 0};
    void *p[8];
    bool aligned = true;
    for (int i = 0; i < 8; i++) {
        TRY(g_gpu->ops->alloc(g_gpu, sizes[i], &p[i]));
        aligned = aligned && ((uintptr_t)p[i] % 256 == 0);
    }
    size_t want = 0;
    for (int i = 0; i < 8; i++) want += (sizes[i] + 255) / 256 * 256 + (sizes[i] ? 0 : 256);
    check(aligned, "memory: blocks are 256-byte aligned");
    check(g_gpu->device_budget.used - base == want, "memory: budget counts %zu bytes (expected %zu)",
          g_gpu->device_budget.used - base, want);
    for (int i = 0; i < 8; i += 2) g_free(p[i]); /* free every other one, then the rest: coalescing */
    for (int i = 1; i < 8; i += 2) g_free(p[i]);
    check(g_gpu->device_budget.used == base, "memory: budget back to %zu after frees (now %zu)", base,
          g_gpu->device_budget.used);
    void *big = NULL;
    TRY(g_gpu->ops->alloc(g_gpu, (5u << 20), &big)); /* reuses the coalesced space */
    g_free(big);
    check(g_gpu->device_budget.peak >= base + want, "memory: peak %zu recorded", g_gpu->device_budget.peak);

    /* a capped backend refuses what exceeds its cap, with a message */
    st_backend_params cp = {.kind = ST_BACKEND_CUDA, .device_mem = 64u << 20, .device_index = 0};
    st_backend *capped = NULL;
    TRY(st_backend_init(&cp, &capped));
    void *a = NULL, *b = NULL;
    strata_status s1 = capped->ops->alloc(capped, 32u << 20, &a);
    strata_status s2 = capped->ops->alloc(capped, 40u << 20, &b);
    check(s1 == STRATA_OK && s2 == STRATA_ERR_NOMEM && b == NULL && strlen(st_last_error()) > 0,
          "memory: device_mem cap of 64 MiB refuses 32+40 MiB (%s)", st_last_error());
    check(capped->device_budget.peak == (32u << 20), "memory: capped peak = %zu", capped->device_budget.peak);
    capped->ops->dealloc(capped, a);
    st_backend_free(capped);

    /* upload, d2d, d2h round trip through pinned memory */
    const size_t n = (1 << 20) + 12;
    uint8_t *h = xmalloc(n);
    for (size_t i = 0; i < n; i++) h[i] = (uint8_t)rnd_u32();
    void *d = NULL, *d2 = g_alloc(n);
    bool owned = false;
    TRY(g_gpu->ops->upload(g_gpu, h, n, &d, &owned));
    TRY(g_gpu->ops->copy_d2d(g_gpu, g_s, d2, d, n));
    uint8_t *pinned = NULL;
    TRY(g_gpu->ops->host_alloc(g_gpu, n, (void **)&pinned));
    TRY(g_gpu->ops->copy_d2h(g_gpu, g_s, pinned, d2, n));
    g_sync();
    check(owned && memcmp(pinned, h, n) == 0, "memory: upload -> copy_d2d -> copy_d2h (pinned) round trip");
    g_gpu->ops->host_dealloc(g_gpu, pinned);
    g_free(d);
    g_free(d2);
    free(h);
}

static void check_streams(void) {
    const int64_t n = 1 << 22;
    float *x = rand_f(n, 1.0f), *y = rand_f(n, 1.0f), *r = xmalloc((size_t)n * 4), *ref = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) ref[i] = x[i] + y[i];
    float *dx = g_up(x, (size_t)n * 4), *dy = g_up(y, (size_t)n * 4);
    st_stream *a = NULL, *b = NULL;
    st_event *e = NULL;
    TRY(g_gpu->ops->stream_create(g_gpu, false, &a));
    TRY(g_gpu->ops->stream_create(g_gpu, true, &b)); /* high priority copy stream */
    TRY(g_gpu->ops->event_create(g_gpu, &e));
    for (int rep = 0; rep < 3; rep++) {
        TRY(g_gpu->ops->copy_h2d(g_gpu, a, dx, x, (size_t)n * 4));
        TRY(g_gpu->ops->add(g_gpu, a, dx, dy, n));
        TRY(g_gpu->ops->event_record(g_gpu, e, a));
        TRY(g_gpu->ops->stream_wait_event(g_gpu, b, e));
        TRY(g_gpu->ops->copy_d2h(g_gpu, b, r, dx, (size_t)n * 4));
        TRY(g_gpu->ops->stream_sync(g_gpu, b));
    }
    TRY(g_gpu->ops->event_sync(g_gpu, e));
    check(nerr(r, ref, n) == 0, "streams: add on stream A, event, copy on high-priority stream B");
    g_gpu->ops->event_destroy(g_gpu, e);
    g_gpu->ops->stream_destroy(g_gpu, a);
    g_gpu->ops->stream_destroy(g_gpu, b);
    g_free(dx);
    g_free(dy);
    free(x), free(y), free(r), free(ref);
}

/* ---- get_rows ---- */

static void check_get_rows(st_dtype t, int64_t rows, int64_t cols, int64_t n) {
    uint8_t *w = make_weight(t, rows, cols, 1.0f);
    const size_t wb = st_dtype_row_bytes(t, cols) * (size_t)rows;
    int32_t *ids = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(rnd_u32() % rows);
    ids[0] = (int32_t)(rows - 1);
    float *ref = xmalloc((size_t)(n * cols) * 4), *got = xmalloc((size_t)(n * cols) * 4);
    st_weight cw = {w, t, rows, cols, 0};
    TRY(g_cpu->ops->get_rows(g_cpu, NULL, &cw, ids, n, ref));
    void *dw = g_up(w, wb);
    int32_t *dids = g_up(ids, (size_t)n * 4);
    float *dout = g_poisoned((size_t)(n * cols) * 4);
    st_weight gw = {dw, t, rows, cols, 0};
    strata_status st = g_gpu->ops->get_rows(g_gpu, g_s, &gw, dids, n, dout);
    g_down(got, dout, (size_t)(n * cols) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * cols) : INFINITY;
    check(e <= 1e-6, "get_rows %-5s rows=%lld cols=%lld n=%lld  err=%.2e (thr 1e-6)", st_dtype_name(t),
          (long long)rows, (long long)cols, (long long)n, e);
    g_free(dw), g_free(dids), g_free(dout);
    free(w), free(ids), free(ref), free(got);
}

/* ---- rmsnorm ---- */

static void check_rmsnorm(st_dtype wt, int64_t n, int64_t d, bool residual) {
    float *x = rand_f(n * d, 3.0f), *res = rand_f(n * d, 1.0f);
    uint8_t *w = make_weight(wt, 1, d, 1.0f);
    float *xc = xmalloc((size_t)(n * d) * 4), *ref = xmalloc((size_t)(n * d) * 4);
    float *gx = xmalloc((size_t)(n * d) * 4), *got = xmalloc((size_t)(n * d) * 4);
    memcpy(xc, x, (size_t)(n * d) * 4);
    st_weight cw = {w, wt, 1, d, 0};
    TRY(g_cpu->ops->rmsnorm(g_cpu, NULL, xc, residual ? res : NULL, &cw, 1e-5f, n, d, ref));
    float *dx = g_up(x, (size_t)(n * d) * 4), *dr = g_up(res, (size_t)(n * d) * 4);
    void *dw = g_up(w, st_dtype_row_bytes(wt, d));
    float *dout = g_poisoned((size_t)(n * d) * 4);
    st_weight gw = {dw, wt, 1, d, 0};
    strata_status st = g_gpu->ops->rmsnorm(g_gpu, g_s, dx, residual ? dr : NULL, &gw, 1e-5f, n, d, dout);
    g_down(got, dout, (size_t)(n * d) * 4);
    g_down(gx, dx, (size_t)(n * d) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * d) : INFINITY;
    const double ex = st == STRATA_OK ? nerr(gx, xc, n * d) : INFINITY;
    check(e <= 1e-5 && ex <= 1e-6, "rmsnorm w=%-4s n=%lld d=%lld residual=%d  err=%.2e x_err=%.2e (thr 1e-5)",
          st_dtype_name(wt), (long long)n, (long long)d, residual, e, ex);
    g_free(dx), g_free(dr), g_free(dw), g_free(dout);
    free(x), free(res), free(w), free(xc), free(ref), free(gx), free(got);
}

/* ---- matmul ---- */

/* The path the CUDA backend takes (see cuda_matmul.cu): the GEMV (fp32 math)
 * below the backend's switch points (g_min_n, g_min_n_quant), the fp32
 * cuBLASLt GEMM for f32 weights, a scalar GEMV for plain rows whose K is not
 * a multiple of 8; else the tensor-core GEMM. */
static bool matmul_gemv(st_dtype t, int64_t n, int64_t K) {
    if (t != ST_DTYPE_F32 && K % 8) return true;
    return n < (st_dtype_get(t)->quantized ? g_min_n_quant : g_min_n);
}
/* The GEMV of fast mode, x quantized to int8 per 32-block: for one token
 * the direct kernel (cuda_gemv1.cu: q8_0, q4_0, q4_1, q4_k, q6_k, K % 128 ==
 * 0), else the staged kernel (cuda_gemv.cu: q8_0 from 2 tokens, q4_0, q4_1,
 * q4_k, rows of 16-byte multiples). */
static bool matmul_int8(st_dtype t, int64_t n, int64_t K) {
    if (!g_fast || !matmul_gemv(t, n, K)) return false;
    const bool q4 = t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K;
    if (n == 1 && g_gemv1 && K % 128 == 0 && (q4 || t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q6_K)) return true;
    return (q4 || (t == ST_DTYPE_Q8_0 && n > 1)) && K % 32 == 0 && st_dtype_row_bytes(t, K) % 16 == 0;
}
/* The int8 tensor-core kernel of fast mode (cuda_mmq.cu) for q8_0, q4_0,
 * q4_1, q4_k, q6_k (rows of 16-byte multiples, K % 128 == 0) within the backend's
 * MMQ token counts: x quantized the same way. */
static bool matmul_mmq(st_dtype t, int64_t n, int64_t K) {
    const bool ty = t == ST_DTYPE_Q8_0 || t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1 || t == ST_DTYPE_Q4_K ||
                    t == ST_DTYPE_Q6_K;
    return g_fast && ty && K % 128 == 0 && st_dtype_row_bytes(t, K) % 16 == 0 && n >= g_mmq_min && n <= g_mmq_max;
}
/* ... which decides the threshold: the int8 GEMV and MMQ 1.5e-2 (measured:
 * ~2e-3 to 6e-3 typically on these random inputs, up to 1.1e-2 in a few of
 * ~3000 checks: q4_k 13 x 256 with 3 tokens, q4_0 333 x 1024 after a norm;
 * a wrong scale or offset gives O(1)). */
static double matmul_thr(st_dtype t, int64_t n, int64_t K) {
    if (matmul_mmq(t, n, K) || matmul_int8(t, n, K)) return 1.5e-2;
    if (t == ST_DTYPE_F32 || matmul_gemv(t, n, K)) return 1e-5;
    return g_fast ? 1e-2 : 1e-4;
}
/* SwiGLU's outputs carry the errors of both projections (silu(g) u: about
 * the sum of their relative errors), so twice the matmul's threshold where
 * its activations are int8 (1.59e-2 seen once, q4_k 1000 x 1024 after a
 * norm); the matmul's elsewhere. */
static double swiglu_thr(double thr, st_dtype t, int64_t n, int64_t K) {
    return matmul_int8(t, n, K) || matmul_mmq(t, n, K) ? 2 * thr : thr;
}
static const char *matmul_path(st_dtype t, int64_t n, int64_t K) {
    return matmul_mmq(t, n, K) ? "mmq int8"
         : matmul_int8(t, n, K) ? "gemv int8"
         : matmul_gemv(t, n, K) ? "gemv"
         : t == ST_DTYPE_F32    ? "gemm f32"
         : g_fast               ? "gemm fast"
                                : "gemm hi+lo";
}

static void check_matmul_ex(st_dtype t, int64_t N, int64_t K, int64_t n, int x_off, st_stream *s) {
    uint8_t *w = make_weight(t, N, K, 1.0f);
    const size_t wb = st_dtype_row_bytes(t, K) * (size_t)N;
    float *x = rand_f(n * K + x_off, 1.0f);
    float *ref = xmalloc((size_t)(n * N) * 4), *got = xmalloc((size_t)(n * N) * 4);
    st_weight cw = {w, t, N, K, 0};
    TRY(g_cpu->ops->matmul(g_cpu, NULL, x + x_off, &cw, n, ref));
    void *dw = g_up(w, wb);
    float *dx = g_up(x, (size_t)(n * K + x_off) * 4);
    float *dy = g_poisoned((size_t)(n * N) * 4);
    st_weight gw = {dw, t, N, K, 0};
    strata_status st = g_gpu->ops->matmul(g_gpu, s, dx + x_off, &gw, n, dy);
    if (st != STRATA_OK) fprintf(stderr, "  matmul: %s\n", st_last_error());
    TRY(g_gpu->ops->stream_sync(g_gpu, s));
    g_down(got, dy, (size_t)(n * N) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * N) : INFINITY;
    const double thr = matmul_thr(t, n, K);
    check(e <= thr, "matmul %-5s N=%lld K=%lld n=%lld%s (%s)  err=%.2e (thr %.0e)", st_dtype_name(t), (long long)N,
          (long long)K, (long long)n, x_off ? " x unaligned" : "", matmul_path(t, n, K), e, thr);
    g_free(dw), g_free(dx), g_free(dy);
    free(w), free(x), free(ref), free(got);
}
static void check_matmul(st_dtype t, int64_t N, int64_t K, int64_t n) { check_matmul_ex(t, N, K, n, 0, g_s); }

/* ---- rope ---- */

static void make_inv_freq(float *f, int64_t hd, double theta) {
    for (int64_t j = 0; j < hd / 2; j++) f[j] = (float)(1.0 / pow(theta, (double)(2 * j) / (double)hd));
}

static void check_rope(int64_t n, int64_t heads, int64_t hd, bool inter) {
    float *x = rand_f(n * heads * hd, 1.0f), *ref = xmalloc((size_t)(n * heads * hd) * 4);
    float *got = xmalloc((size_t)(n * heads * hd) * 4), *f = xmalloc((size_t)hd * 2);
    int32_t *pos = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(rnd_u32() % 1000000);
    make_inv_freq(f, hd, 500000.0);
    memcpy(ref, x, (size_t)(n * heads * hd) * 4);
    TRY(g_cpu->ops->rope(g_cpu, NULL, ref, pos, n, heads, hd, f, inter));
    float *dx = g_up(x, (size_t)(n * heads * hd) * 4), *df = g_up(f, (size_t)hd * 2);
    int32_t *dp = g_up(pos, (size_t)n * 4);
    strata_status st = g_gpu->ops->rope(g_gpu, g_s, dx, dp, n, heads, hd, df, inter);
    g_down(got, dx, (size_t)(n * heads * hd) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * heads * hd) : INFINITY;
    check(e <= 1e-5, "rope n=%lld heads=%lld hd=%lld %s  err=%.2e (thr 1e-5)", (long long)n, (long long)heads,
          (long long)hd, inter ? "interleaved" : "rotate-half", e);
    g_free(dx), g_free(df), g_free(dp);
    free(x), free(ref), free(got), free(f), free(pos);
}

/* cos and sin of the exact angle pos * f: pos = ph * 2^16 + pl, both parts
 * times f exact in double, joined by the addition formulas (independent of
 * backend/rope_angle.h, which both backends use). */
static void rope_ref_cos_sin(int64_t pos, float f, double *c, double *s) {
    const double a = (double)(pos >> 16) * 65536.0 * (double)f, b = (double)(pos & 0xffff) * (double)f;
    const double ca = cos(a), sa = sin(a), cb = cos(b), sb = sin(b);
    *c = ca * cb - sa * sb;
    *s = sa * cb + ca * sb;
}

/* Positions around 2^24, 2^26 and 2^31 against the exact angle in double;
 * also reports what an fp32 angle (pos * inv_freq in float) would give. Then
 * the angle itself: pairs (1, 0) rotate to (cos, sin) as floats, whose atan2
 * must be within 6e-8 rad (float rounding of cos / sin) of the exact angle on
 * both backends, and the two backends' bits are compared (counted: CUDA's
 * double sincos and glibc's may round a value the other way). */
static void check_rope_far(bool inter) {
    const int64_t hd = 128, heads = 2;
    const int32_t ps[] = {(1 << 24) - 1, 1 << 24, (1 << 24) + 1, (1 << 24) + 3, (1 << 26) - 1, (1 << 26) + 5,
                          (1 << 26) + 77, (1 << 30) + 12345, 2147483645, 2147483647};
    const int64_t n = (int64_t)(sizeof ps / sizeof ps[0]);
    float *x = rand_f(n * heads * hd, 1.0f), *got = xmalloc((size_t)(n * heads * hd) * 4);
    float *ref = xmalloc((size_t)(n * heads * hd) * 4), *naive = xmalloc((size_t)(n * heads * hd) * 4);
    float *cpu = xmalloc((size_t)(n * heads * hd) * 4);
    float f[64];
    make_inv_freq(f, hd, 500000.0);
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < half; j++) {
                const int64_t o0 = inter ? 2 * j : j, o1 = inter ? 2 * j + 1 : j + half;
                const float *v = x + (i * heads + h) * hd;
                double ca, sa;
                rope_ref_cos_sin(ps[i], f[j], &ca, &sa);
                const double x0 = v[o0], x1 = v[o1];
                ref[(i * heads + h) * hd + o0] = (float)(x0 * ca - x1 * sa);
                ref[(i * heads + h) * hd + o1] = (float)(x0 * sa + x1 * ca);
                const float af = (float)ps[i] * f[j];
                naive[(i * heads + h) * hd + o0] = v[o0] * cosf(af) - v[o1] * sinf(af);
                naive[(i * heads + h) * hd + o1] = v[o0] * sinf(af) + v[o1] * cosf(af);
            }
    memcpy(cpu, x, (size_t)(n * heads * hd) * 4);
    TRY(g_cpu->ops->rope(g_cpu, NULL, cpu, ps, n, heads, hd, f, inter));
    float *dx = g_up(x, (size_t)(n * heads * hd) * 4), *df = g_up(f, (size_t)hd * 2);
    int32_t *dp = g_up(ps, (size_t)n * 4);
    strata_status st = g_gpu->ops->rope(g_gpu, g_s, dx, dp, n, heads, hd, df, inter);
    g_down(got, dx, (size_t)(n * heads * hd) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * heads * hd) : INFINITY;
    const double ec = nerr(cpu, ref, n * heads * hd), en = nerr(naive, ref, n * heads * hd);
    check(e <= 1e-5, "rope far positions (2^24-1 .. 2^31-1) %s vs exact reference  err=%.2e (thr 1e-5; cpu %.2e;"
          " an fp32 angle would give %.2e)", inter ? "interleaved" : "rotate-half", e, ec, en);
    g_free(dx), g_free(dp);
    /* the angles: rotate (1, 0) */
    for (int64_t i = 0; i < n * heads; i++)
        for (int64_t j = 0; j < half; j++) {
            x[i * hd + (inter ? 2 * j : j)] = 1.0f;
            x[i * hd + (inter ? 2 * j + 1 : j + half)] = 0.0f;
        }
    memcpy(cpu, x, (size_t)(n * heads * hd) * 4);
    TRY(g_cpu->ops->rope(g_cpu, NULL, cpu, ps, n, heads, hd, f, inter));
    dx = g_up(x, (size_t)(n * heads * hd) * 4);
    dp = g_up(ps, (size_t)n * 4);
    st = g_gpu->ops->rope(g_gpu, g_s, dx, dp, n, heads, hd, df, inter);
    g_down(got, dx, (size_t)(n * heads * hd) * 4);
    double ag = st == STRATA_OK ? 0 : INFINITY, ac = 0;
    int64_t differ = 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < half; j++) {
                const int64_t o0 = (i * heads + h) * hd + (inter ? 2 * j : j),
                              o1 = (i * heads + h) * hd + (inter ? 2 * j + 1 : j + half);
                double rc, rs;
                rope_ref_cos_sin(ps[i], f[j], &rc, &rs);
                const double r = atan2(rs, rc);
                double dg = fabs(remainder(atan2((double)got[o1], (double)got[o0]) - r, 2 * M_PI));
                double dc = fabs(remainder(atan2((double)cpu[o1], (double)cpu[o0]) - r, 2 * M_PI));
                if (!(dg <= ag)) ag = dg;
                if (dc > ac) ac = dc;
                differ += got[o0] != cpu[o0] || got[o1] != cpu[o1];
            }
    check(ag <= 6e-8 && ac <= 6e-8, "rope far positions %s: angle error gpu %.2e cpu %.2e rad (thr 6e-8); "
          "%lld of %lld pairs differ in bits between them", inter ? "interleaved" : "rotate-half", ag, ac,
          (long long)differ, (long long)(n * heads * half));
    g_free(dx), g_free(df), g_free(dp);
    free(x), free(got), free(ref), free(naive), free(cpu);
}

/* ---- attention ---- */

/* Query positions of check_attention_ex: the last n of the n_kv keys
 * (ATT_POS_END), the same ending `slack` keys earlier with the keys past the
 * largest position poisoned with NaN (ATT_POS_SLACK: n_kv is then only an
 * upper bound, as in a recorded decode step), or descending from n_kv - 1
 * (ATT_POS_REVERSED: positions need not grow with the row). */
enum { ATT_POS_END, ATT_POS_SLACK, ATT_POS_REVERSED };

static void check_attention_ex(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd, int mode, int64_t slack) {
    const int64_t qn = n * H * hd, kn = n_kv * Hkv * hd;
    float *q = rand_f(qn, 2.0f), *k = rand_f(kn, 1.0f), *v = rand_f(kn, 1.0f);
    float *ref = xmalloc((size_t)qn * 4), *got = xmalloc((size_t)qn * 4);
    int32_t *pos = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
        pos[i] = (int32_t)(mode == ATT_POS_REVERSED ? n_kv - 1 - i : mode == ATT_POS_SLACK ? n_kv - slack - n + i : n_kv - n + i);
    if (mode == ATT_POS_SLACK)
        for (int64_t i = (n_kv - slack) * Hkv * hd; i < kn; i++) k[i] = v[i] = NAN; /* never seen */
    const float scale = 1.0f / sqrtf((float)hd);
    TRY(g_cpu->ops->attention(g_cpu, NULL, q, k, v, pos, n, n_kv, H, Hkv, hd, scale, ref));
    float *dq = g_up(q, (size_t)qn * 4), *dk = g_up(k, (size_t)kn * 4), *dv = g_up(v, (size_t)kn * 4);
    int32_t *dp = g_up(pos, (size_t)n * 4);
    float *dout = g_poisoned((size_t)qn * 4);
    strata_status st = g_gpu->ops->attention(g_gpu, g_s, dq, dk, dv, dp, n, n_kv, H, Hkv, hd, scale, dout);
    if (st != STRATA_OK) fprintf(stderr, "  attention: %s\n", st_last_error());
    g_down(got, dout, (size_t)qn * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, qn) : INFINITY;
    /* the path cuda_attention.cu takes (the FA2 kernel: fast mode, >= ST_ATTN_FA2_MIN_ROWS = 512 rows per kv
     * head) */
    const bool tc = (hd == 64 || hd == 128) && n * (H / Hkv) > 16;
    const bool fa2 = tc && g_fast && n * (H / Hkv) >= 512;
    /* fp32 sums over more than 64K keys: reordering noise grows with the length */
    const double thr = tc ? (g_fast ? 1e-2 : 1e-4) : n_kv > 65536 ? 2e-5 : 1e-5;
    check(e <= thr, "attention n=%lld n_kv=%lld heads=%lld/%lld hd=%lld%s (%s)  err=%.2e (thr %.0e)", (long long)n,
          (long long)n_kv, (long long)H, (long long)Hkv, (long long)hd,
          mode == ATT_POS_SLACK ? " pos ends early" : mode == ATT_POS_REVERSED ? " pos reversed" : "",
          fa2 ? "tensor cores, fast, fa2 or wgmma" : tc ? (g_fast ? "tensor cores, fast" : "tensor cores, hi+lo") : "fp32", e,
          thr);
    g_free(dq), g_free(dk), g_free(dv), g_free(dp), g_free(dout);
    free(q), free(k), free(v), free(ref), free(got), free(pos);
}

static void check_attention(int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, int64_t hd) {
    check_attention_ex(n, n_kv, H, Hkv, hd, ATT_POS_END, 0);
}

/* Fast-mode prefill attention (bf16 operands) on the backend g_gpu (`ver`
 * names its FA2 configuration, st_backend_params.attn_fa2): rows per kv head
 * not a multiple of 128 (the last block partly or mostly padding), n_kv > n,
 * GQA 1, 3, 4, 8, hd 64 and 128, grids split over the KV length and not, n_kv
 * past the largest position (poisoned keys), descending positions, and the
 * sizes just below the FA2 threshold (the mma prefill kernel in fast mode).
 * Blocks of 256 rows (b256w8): the 130-token case's last block holds 8 rows,
 * the 513-token one's a single row. */
static void check_attention_fast(const char *ver) {
    printf("-- prefill attention, fast mode: %s\n", ver);
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    check_attention(300, 300, 32, 8, 128);  /* G 4, 1200 rows: 10 blocks, split */
    check_attention(130, 130, 16, 4, 128);  /* 520 rows: the 5th block has 8 */
    check_attention(128, 4096, 32, 8, 128); /* a chunk over a long cache: 4 blocks per kv head, many splits */
    check_attention(127, 4096, 32, 8, 128); /* 508 rows: below the FA2 threshold (mma kernel) */
    check_attention(2100, 2100, 32, 8, 128); /* 528 blocks: no split */
    check_attention(1100, 1300, 32, 32, 128); /* G 1, 288 blocks: no split */
    check_attention(300, 350, 6, 2, 128);   /* G 3: tokens straddle warps and blocks */
    check_attention(300, 300, 64, 8, 128);  /* G 8 */
    check_attention(600, 700, 8, 8, 64);    /* hd 64, G 1, split */
    check_attention(513, 513, 4, 4, 64);    /* hd 64, the last block one row */
    check_attention(700, 1500, 16, 4, 64);  /* hd 64, G 4, n_kv > n, split */
    check_attention(3000, 3100, 32, 8, 64); /* hd 64, 752 blocks: no split */
    check_attention_ex(500, 2000, 32, 8, 128, ATT_POS_SLACK, 700);
    check_attention_ex(700, 1500, 16, 4, 64, ATT_POS_SLACK, 333);
    check_attention_ex(600, 600, 8, 2, 128, ATT_POS_REVERSED, 0);
    check_attention_ex(1000, 1000, 32, 32, 64, ATT_POS_REVERSED, 0);
    check_attention(64, 4096, 32, 8, 128);  /* 256 rows: the mma kernel */
    check_attention(64, 100, 64, 8, 128);   /* 512 rows over 100 keys: under one wgmma tile (FA2 then) */
    check_attention(1000, 1000, 8, 8, 128); /* G 1: 8 blocks of 125 tokens, causal, the last tile 104 keys */
    check_attention(64, 100, 4, 4, 64);
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* ---- attention_part: a context attended piece by piece ---- */

/* The log-sum-exp of query token t, head h over keys 0..pos (q [n, H, hd], k
 * [ctx, Hkv, hd]), in double from the float inputs: ln sum_j e^(scale q.k_j). */
static double lse_ref(const float *q, const float *k, int64_t t, int64_t h, int64_t pos, int64_t H, int64_t Hkv,
                      int64_t hd, float scale) {
    const float *qv = q + (t * H + h) * hd;
    const int64_t kvh = h / (H / Hkv);
    double mx = -INFINITY, sum = 0;
    double *sc = xmalloc((size_t)(pos + 1) * sizeof(double));
    for (int64_t j = 0; j <= pos; j++) {
        const float *kr = k + (j * Hkv + kvh) * hd;
        double d = 0;
        for (int64_t c = 0; c < hd; c++) d += (double)qv[c] * (double)kr[c];
        sc[j] = d * (double)scale;
        if (sc[j] > mx) mx = sc[j];
    }
    for (int64_t j = 0; j <= pos; j++) sum += exp(sc[j] - mx);
    free(sc);
    return mx + log(sum);
}

/* attention_part on the GPU over a context of ctx keys cut into pieces
 * starting at starts[0] = 0 < starts[1] < ... (multiples of ST_ATTN_RANGE, the
 * last <= ctx - n: it holds the queries' own positions ctx - n .. ctx - 1,
 * causally), the first call with merge false, the others merging into its
 * (out, lse); k and v of a piece are views into the context's buffers (a key
 * read past a piece would be another piece's). out against the CPU's single
 * `attention` over all keys, at the thresholds of the attention checks; lse
 * against a double-precision value (every query for n <= 16, else 16 of them
 * spread over the chunk, every head): 2e-5 absolute on the fp32 decode
 * kernel, 1e-4 on the precise tensor-core kernel, 1e-2 in fast mode.
 * lse_null: one piece, merge false, lse NULL (out only, as `attention`). */
static void check_attention_part_ex(int64_t n, int64_t ctx, int64_t H, int64_t Hkv, int64_t hd, const int64_t *starts,
                                    int np, bool lse_null, const char *what) {
    const int64_t qn = n * H * hd, kn = ctx * Hkv * hd, row = Hkv * hd;
    float *q = rand_f(qn, 2.0f), *k = rand_f(kn, 1.0f), *v = rand_f(kn, 1.0f);
    float *ref = xmalloc((size_t)qn * 4), *got = xmalloc((size_t)qn * 4), *lse = xmalloc((size_t)(n * H) * 4);
    int32_t *pos = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(ctx - n + i);
    const float scale = 1.0f / sqrtf((float)hd);
    TRY(g_cpu->ops->attention(g_cpu, NULL, q, k, v, pos, n, ctx, H, Hkv, hd, scale, ref));
    float *dq = g_up(q, (size_t)qn * 4), *dk = g_up(k, (size_t)kn * 4), *dv = g_up(v, (size_t)kn * 4);
    int32_t *dp = g_up(pos, (size_t)n * 4);
    float *dout = g_poisoned((size_t)qn * 4), *dlse = g_poisoned((size_t)(n * H) * 4);
    strata_status st = STRATA_OK;
    char cuts[160];
    int cl = 0;
    for (int p = 0; p < np && st == STRATA_OK; p++) {
        const int64_t k0 = starts[p], k1 = p + 1 < np ? starts[p + 1] : ctx;
        cl += snprintf(cuts + cl, sizeof cuts - (size_t)cl, "%s%lld", p ? "," : "", (long long)(k1 - k0));
        if (cl >= (int)sizeof cuts) cl = (int)sizeof cuts - 1;
        st = g_gpu->ops->attention_part(g_gpu, g_s, dq, dk + k0 * row, dv + k0 * row, dp, n, k0, k1 - k0, H, Hkv, hd,
                                        scale, p > 0, dout, lse_null ? NULL : dlse);
        if (st != STRATA_OK) fprintf(stderr, "  attention_part: %s\n", st_last_error());
    }
    g_down(got, dout, (size_t)qn * 4);
    g_down(lse, dlse, (size_t)(n * H) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, qn) : INFINITY;
    double le = 0;
    if (st != STRATA_OK) le = INFINITY;
    else if (!lse_null) {
        const int64_t nt = n <= 16 ? n : 16;
        for (int64_t s = 0; s < nt; s++) {
            const int64_t t = n <= 16 ? s : s * (n - 1) / (nt - 1);
            for (int64_t h = 0; h < H; h++) {
                const double r = lse_ref(q, k, t, h, pos[t], H, Hkv, hd, scale);
                const double d = fabs((double)lse[t * H + h] - r);
                if (!(d <= le)) le = isnan(d) ? INFINITY : d;
            }
        }
    }
    const int64_t rows = n * (H / Hkv);
    const bool tc = rows > 16;
    const bool fa2 = tc && g_fast && rows >= 512;
    const double thr = tc ? (g_fast ? 1e-2 : 1e-4) : 1e-5;
    const double lthr = tc ? (g_fast ? 1e-2 : 1e-4) : 2e-5;
    check(e <= thr && le <= lthr,
          "attention_part n=%lld ctx=%lld heads=%lld/%lld hd=%lld pieces %s%s%s (%s)  err=%.2e (thr %.0e)  lse err=%.2e "
          "(thr %.0e)",
          (long long)n, (long long)ctx, (long long)H, (long long)Hkv, (long long)hd, cuts, lse_null ? ", lse NULL" : "",
          what, fa2 ? "tensor cores, fast, fa2 or wgmma" : tc ? (g_fast ? "tensor cores, fast" : "tensor cores, hi+lo") : "fp32",
          e, thr, le, lthr);
    g_free(dq), g_free(dk), g_free(dv), g_free(dp), g_free(dout), g_free(dlse);
    free(q), free(k), free(v), free(ref), free(got), free(lse), free(pos);
}

/* Piece starts for a context of ctx keys and n queries at its end: every
 * `step` keys (a multiple of ST_ATTN_RANGE), or at the given uneven starts,
 * keeping those <= ctx - n (the queries' positions lie in the last piece). */
static int part_starts(int64_t ctx, int64_t n, int64_t step, const int64_t *uneven, int nu, int64_t *out) {
    int np = 0;
    if (step > 0) {
        for (int64_t b = 0; b <= ctx - n && np < 64; b += step) out[np++] = b;
    } else {
        for (int i = 0; i < nu && np < 64; i++)
            if (uneven[i] <= ctx - n) out[np++] = uneven[i];
    }
    return np;
}

/* attention_part (backend.h) on the kernels of the current mode (g_fast):
 * decode (n 1, 4: fp32 kernel, split, and unsplit for a last piece of 60
 * keys), prefill chunks (n 64: split grids; 600, 2048: unsplit or split as
 * the kernels size them, FA2 in fast mode), hd 64 and 128, GQA 32/8, a
 * context of 4096 keys in pieces of 1024 and in uneven pieces (multiples of
 * ST_ATTN_RANGE), contexts of 3900 / 3000 keys (a short last piece), a long
 * decode (40000 keys in pieces of 16384), a single piece with lse NULL. */
static void check_attention_part(void) {
    printf("-- attention_part, %s mode\n", g_fast ? "fast" : "precise");
    const int64_t uneven[] = {0, 768, 1792, 2304, 3328, 3840};
    const int64_t ns[] = {1, 4, 64, 600, 2048};
    int64_t st[64];
    for (int hi = 0; hi < 2; hi++) {
        const int64_t hd = hi ? 128 : 64;
        for (int i = 0; i < 5; i++) {
            int np = part_starts(4096, ns[i], 1024, NULL, 0, st);
            check_attention_part_ex(ns[i], 4096, 32, 8, hd, st, np, false, "");
            np = part_starts(4096, ns[i], 0, uneven, 6, st);
            check_attention_part_ex(ns[i], 4096, 32, 8, hd, st, np, false, " (uneven)");
        }
    }
    int64_t st5[] = {0, 1024, 2048, 3072, 3840};
    check_attention_part_ex(1, 3900, 32, 8, 128, st5, 5, false, " (last piece unsplit)");
    check_attention_part_ex(4, 3900, 32, 8, 64, st5, 5, false, " (last piece unsplit)");
    int64_t st3[] = {0, 1280, 2560};
    check_attention_part_ex(64, 3000, 32, 8, 128, st3, 3, false, "");
    int64_t st3b[] = {0, 512, 2304};
    check_attention_part_ex(600, 3000, 32, 8, 64, st3b, 3, false, "");
    int64_t stl[] = {0, 16384, 32768};
    check_attention_part_ex(1, 40000, 32, 8, 128, stl, 3, false, " (long decode)");
    int64_t st1[] = {0};
    check_attention_part_ex(64, 700, 32, 8, 128, st1, 1, true, "");
    check_attention_part_ex(600, 700, 32, 8, 128, st1, 1, true, "");
    check_attention_part_ex(600, 700, 32, 8, 128, st1, 1, false, " (one piece)");
}

/* attn_merge (a streamed decode's CPU part merged with the device's): the CUDA kernel against the CPU's
 * loop on random results whose log-sum-exps differ by up to +-20 (one side dominating, and about equal);
 * the rule in fp32, so within 1e-6 relative. */
static void check_attn_merge(int64_t rows, int64_t hd) {
    const int64_t n = rows * hd;
    float *o = rand_f(n, 1.0f), *o2 = rand_f(n, 1.0f), *l = rand_f(rows, 20.0f), *l2 = rand_f(rows, 20.0f);
    float *ref = xmalloc((size_t)n * 4), *lref = xmalloc((size_t)rows * 4);
    float *got = xmalloc((size_t)n * 4), *lgot = xmalloc((size_t)rows * 4);
    memcpy(ref, o, (size_t)n * 4);
    memcpy(lref, l, (size_t)rows * 4);
    TRY(g_cpu->ops->attn_merge(g_cpu, NULL, ref, lref, o2, l2, rows, hd));
    float *d_o = g_up(o, (size_t)n * 4), *d_l = g_up(l, (size_t)rows * 4), *d_o2 = g_up(o2, (size_t)n * 4),
          *d_l2 = g_up(l2, (size_t)rows * 4);
    const strata_status st = g_gpu->ops->attn_merge(g_gpu, g_s, d_o, d_l, d_o2, d_l2, rows, hd);
    g_down(got, d_o, (size_t)n * 4);
    g_down(lgot, d_l, (size_t)rows * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n) : INFINITY, le = st == STRATA_OK ? nerr(lgot, lref, rows)
                                                                                           : INFINITY;
    check(e <= 1e-6 && le <= 1e-6, "attn_merge rows=%lld hd=%lld  err=%.2e lse err=%.2e (thr 1e-06)", (long long)rows,
          (long long)hd, e, le);
    g_free(d_o), g_free(d_l), g_free(d_o2), g_free(d_l2);
    free(o), free(o2), free(l), free(l2), free(ref), free(lref), free(got), free(lgot);
}

/* The attention_part checks in fast mode alone, on the backend g_gpu (`ver`
 * names its attn_fa2 configuration). */
static void check_attention_part_fast(const char *ver) {
    printf("-- attention_part on %s\n", ver);
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    check_attention_part();
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* The attention_part checks in precise, then fast mode. */
static void check_attention_part_modes(void) {
    check_attention_part();
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    check_attention_part();
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* ---- swiglu, add ---- */

static void check_swiglu(int64_t n, int off, bool in_place) {
    float *g = rand_f(n + off, 6.0f), *u = rand_f(n + off, 2.0f);
    float *ref = xmalloc((size_t)n * 4), *got = xmalloc((size_t)n * 4);
    TRY(g_cpu->ops->swiglu(g_cpu, NULL, g + off, u + off, n, ref));
    float *dg = g_up(g, (size_t)(n + off) * 4), *du = g_up(u, (size_t)(n + off) * 4);
    float *dout = in_place ? dg : g_poisoned((size_t)(n + off) * 4);
    strata_status st = g_gpu->ops->swiglu(g_gpu, g_s, dg + off, du + off, n, dout + off);
    g_down(got, dout + off, (size_t)n * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n) : INFINITY;
    check(e <= 1e-5, "swiglu n=%lld%s%s  err=%.2e (thr 1e-5)", (long long)n, off ? " unaligned" : "",
          in_place ? " in place" : "", e);
    g_free(dg), g_free(du);
    if (!in_place) g_free(dout);
    free(g), free(u), free(ref), free(got);
}

static void check_add(int64_t n, int off) {
    float *x = rand_f(n + off, 1.0f), *y = rand_f(n + off, 1.0f), *got = xmalloc((size_t)n * 4);
    float *dx = g_up(x, (size_t)(n + off) * 4), *dy = g_up(y, (size_t)(n + off) * 4);
    TRY(g_cpu->ops->add(g_cpu, NULL, x + off, y + off, n));
    strata_status st = g_gpu->ops->add(g_gpu, g_s, dx + off, dy + off, n);
    g_down(got, dx + off, (size_t)n * 4);
    const double e = st == STRATA_OK ? nerr(got, x + off, n) : INFINITY;
    check(e == 0, "add n=%lld%s  err=%.2e (thr 0: exact)", (long long)n, off ? " unaligned" : "", e);
    g_free(dx), g_free(dy);
    free(x), free(y), free(got);
}

/* ---- decode-step ops and graphs ---- */

static void check_argmax(int64_t n, int64_t cols, int off) {
    float *x = rand_f(n * cols + off, 10.0f);
    for (int64_t i = 0; i < n; i++) {
        float *r = x + off + i * cols;
        if (i % 4 == 1) r[cols / 3] = r[cols - 1] = 1e3f;                 /* a tie: the first */
        if (i % 4 == 2) r[0] = NAN, r[cols / 2] = 2e3f;                  /* NaN never wins */
        if (i % 4 == 3) for (int64_t j = 0; j < cols; j++) r[j] = NAN;   /* all NaN: 0 */
    }
    int32_t *ref = xmalloc((size_t)n * 4), *got = xmalloc((size_t)n * 4);
    TRY(g_cpu->ops->argmax(g_cpu, NULL, x + off, n, cols, ref));
    float *dx = g_up(x, (size_t)(n * cols + off) * 4);
    int32_t *dout = g_poisoned((size_t)n * 4);
    strata_status st = g_gpu->ops->argmax(g_gpu, g_s, dx + off, n, cols, dout);
    g_down(got, dout, (size_t)n * 4);
    const bool ok = st == STRATA_OK && memcmp(got, ref, (size_t)n * 4) == 0;
    check(ok, "argmax n=%lld cols=%lld%s  %s", (long long)n, (long long)cols, off ? " unaligned" : "",
          ok ? "same indices" : "DIFFERS");
    g_free(dx), g_free(dout);
    free(x), free(ref), free(got);
}

/* matmul_multi (q, k, v shapes) and matmul_swiglu against the CPU backend. */
static void check_fused(st_dtype t, int64_t K, int64_t n) {
    const int64_t rows[3] = {K, K / 4, K / 4}, I = 3 * K;
    uint8_t *wh[3];
    void *wd[3];
    st_weight cw[3], gw[3];
    float *x = rand_f(n * K, 1.0f), *dx = g_up(x, (size_t)(n * K) * 4);
    double e = 0;
    float *dy[3], *ref[3];
    for (int i = 0; i < 3; i++) {
        wh[i] = make_weight(t, rows[i], K, 1.0f);
        const size_t b = st_dtype_row_bytes(t, K) * (size_t)rows[i];
        wd[i] = g_up(wh[i], b);
        cw[i] = (st_weight){wh[i], t, rows[i], K, 0};
        gw[i] = (st_weight){wd[i], t, rows[i], K, 0};
        ref[i] = xmalloc((size_t)(n * rows[i]) * 4);
        TRY(g_cpu->ops->matmul(g_cpu, NULL, x, &cw[i], n, ref[i]));
        dy[i] = g_poisoned((size_t)(n * rows[i]) * 4);
    }
    strata_status st = g_gpu->ops->matmul_multi(g_gpu, g_s, dx, gw, 3, n, dy);
    for (int i = 0; i < 3 && st == STRATA_OK; i++) {
        float *got = xmalloc((size_t)(n * rows[i]) * 4);
        g_down(got, dy[i], (size_t)(n * rows[i]) * 4);
        const double ei = nerr(got, ref[i], n * rows[i]);
        e = ei > e || isnan(ei) ? ei : e;
        free(got);
    }
    if (st != STRATA_OK) e = INFINITY;
    const double thr = matmul_thr(t, n, K); /* the same in fast mode for swiglu's */
    check(e <= thr, "matmul_multi %-5s 3 weights K=%lld n=%lld  err=%.2e (thr %.0e)", st_dtype_name(t), (long long)K,
          (long long)n, e, thr);
    /* swiglu over [I, K] gate and up */
    uint8_t *hg = make_weight(t, I, K, 1.0f), *hu = make_weight(t, I, K, 1.0f);
    const size_t b = st_dtype_row_bytes(t, K) * (size_t)I;
    void *dg = g_up(hg, b), *du = g_up(hu, b);
    st_weight cg = {hg, t, I, K, 0}, cu = {hu, t, I, K, 0}, gg = {dg, t, I, K, 0}, gu = {du, t, I, K, 0};
    float *r = xmalloc((size_t)(n * I) * 4), *got = xmalloc((size_t)(n * I) * 4);
    TRY(g_cpu->ops->matmul_swiglu(g_cpu, NULL, x, &cg, &cu, n, r, NULL));
    float *dout = g_poisoned((size_t)(n * I) * 4);
    st = g_gpu->ops->matmul_swiglu(g_gpu, g_s, dx, &gg, &gu, n, dout, NULL);
    g_down(got, dout, (size_t)(n * I) * 4);
    e = st == STRATA_OK ? nerr(got, r, n * I) : INFINITY;
    const double sthr = swiglu_thr(thr, t, n, K);
    check(e <= sthr, "matmul_swiglu %-5s I=%lld K=%lld n=%lld  err=%.2e (thr %.1e)", st_dtype_name(t), (long long)I,
          (long long)K, (long long)n, e, sthr);
    /* with a work buffer (the model's e->up): the same bytes */
    float *dwork = g_poisoned((size_t)(n * I) * 4), *dout2 = g_poisoned((size_t)(n * I) * 4);
    float *got2 = xmalloc((size_t)(n * I) * 4);
    st = g_gpu->ops->matmul_swiglu(g_gpu, g_s, dx, &gg, &gu, n, dout2, dwork);
    g_down(got2, dout2, (size_t)(n * I) * 4);
    check(st == STRATA_OK && memcmp(got, got2, (size_t)(n * I) * 4) == 0,
          "matmul_swiglu %-5s I=%lld K=%lld n=%lld with a work buffer: the same bytes", st_dtype_name(t),
          (long long)I, (long long)K, (long long)n);
    g_free(dwork), g_free(dout2);
    free(got2);
    g_free(dg), g_free(du), g_free(dout);
    free(hg), free(hu), free(r), free(got);
    for (int i = 0; i < 3; i++) {
        g_free(wd[i]), g_free(dy[i]);
        free(wh[i]), free(ref[i]);
    }
    g_free(dx);
    free(x);
}

/* rmsnorm_matmul (q|k|v-like weights of rows 333, 64, 64, or SwiGLU's gate
 * and up of 1000 rows; residual added in place) on the GPU: the same bytes
 * as its rmsnorm then matmul_multi / matmul_swiglu on the GPU (x, the norm's
 * output, y), and within matmul_thr of the CPU's rmsnorm_matmul. In fast
 * mode for one token the op takes its fused path (the norm's kernel
 * quantizes for the direct int8 GEMV: cuda_matmul.cu) where the dtypes take
 * it; equal bytes are the point of that path, so this check cannot tell
 * which path ran (the profile's launch counts can: profile_decode.sh). */
static void check_rmsnorm_matmul(st_dtype t, st_dtype t3, int64_t K, int64_t n, bool sw) {
    const int nw = sw ? 2 : 3;
    const int64_t rows[3] = {sw ? 1000 : 333, sw ? 1000 : 64, 64};
    const int ny = sw ? 1 : 3;
    uint8_t *wh[3];
    void *wd[3];
    st_weight cw[3], gw[3];
    for (int i = 0; i < nw; i++) {
        const st_dtype ti = i == 2 ? t3 : t; /* the third (v-like) weight's type may differ, as in q4_K_M files */
        wh[i] = make_weight(ti, rows[i], K, 1.0f);
        wd[i] = g_up(wh[i], st_dtype_row_bytes(ti, K) * (size_t)rows[i]);
        cw[i] = (st_weight){wh[i], ti, rows[i], K, 0};
        gw[i] = (st_weight){wd[i], ti, rows[i], K, 0};
    }
    float *nh = rand_f(K, 1.0f), *x = rand_f(n * K, 1.0f), *res = rand_f(n * K, 1.0f);
    void *nd = g_up(nh, (size_t)K * 4);
    const st_weight cn = {nh, ST_DTYPE_F32, 1, K, 0}, gn = {nd, ST_DTYPE_F32, 1, K, 0};
    const size_t xb = (size_t)(n * K) * 4;
    float *dres = g_up(res, xb), *dxa = g_up(x, xb), *dxb = g_up(x, xb), *dna = g_poisoned(xb), *dnb = g_poisoned(xb);
    float *dya[3], *dyb[3], *ref[3], *cx = xmalloc(xb), *cn_out = xmalloc(xb);
    memcpy(cx, x, xb);
    for (int i = 0; i < ny; i++) {
        dya[i] = g_poisoned((size_t)(n * rows[i]) * 4);
        dyb[i] = g_poisoned((size_t)(n * rows[i]) * 4);
        ref[i] = xmalloc((size_t)(n * rows[i]) * 4);
    }
    TRY(g_cpu->ops->rmsnorm_matmul(g_cpu, NULL, cx, res, &cn, 1e-5f, n, K, cn_out, cw, sw ? 1 : 3, sw ? &cw[1] : NULL,
                                   ref));
    strata_status st = g_gpu->ops->rmsnorm(g_gpu, g_s, dxa, dres, &gn, 1e-5f, n, K, dna);
    if (st == STRATA_OK)
        st = sw ? g_gpu->ops->matmul_swiglu(g_gpu, g_s, dna, &gw[0], &gw[1], n, dya[0], NULL)
                : g_gpu->ops->matmul_multi(g_gpu, g_s, dna, gw, 3, n, dya);
    if (st == STRATA_OK)
        st = g_gpu->ops->rmsnorm_matmul(g_gpu, g_s, dxb, dres, &gn, 1e-5f, n, K, dnb, gw, sw ? 1 : 3,
                                        sw ? &gw[1] : NULL, dyb);
    bool same = st == STRATA_OK;
    double e = st == STRATA_OK ? 0 : INFINITY;
    const size_t hbytes = xb > (size_t)(n * 1000) * 4 ? xb : (size_t)(n * 1000) * 4;
    float *ha = xmalloc(hbytes), *hb = xmalloc(hbytes);
    if (st == STRATA_OK) {
        g_down(ha, dxa, xb), g_down(hb, dxb, xb);
        same = same && memcmp(ha, hb, xb) == 0 && memcmp(hb, cx, xb) == 0; /* x += residual: exact on both */
        g_down(ha, dna, xb), g_down(hb, dnb, xb);
        same = same && memcmp(ha, hb, xb) == 0;
        for (int i = 0; i < ny; i++) {
            const size_t yb = (size_t)(n * rows[i]) * 4;
            g_down(ha, dya[i], yb), g_down(hb, dyb[i], yb);
            same = same && memcmp(ha, hb, yb) == 0;
            const double ei = nerr(hb, ref[i], n * rows[i]);
            e = ei > e || isnan(ei) ? ei : e;
        }
    }
    double thr = fmax(matmul_thr(t, n, K), matmul_thr(t3, n, K));
    if (sw) thr = swiglu_thr(thr, t, n, K);
    check(same && e <= thr, "rmsnorm_matmul %-5s%s%s %s K=%lld n=%lld%s  same bytes as rmsnorm + %s: %s, err=%.2e "
          "(thr %.1e)", st_dtype_name(t), t3 != t ? "+" : "", t3 != t ? st_dtype_name(t3) : "",
          sw ? "swiglu" : "multi ", (long long)K, (long long)n, g_fast ? " fast" : "",
          sw ? "matmul_swiglu" : "matmul_multi", same ? "yes" : "no", e, thr);
    for (int i = 0; i < nw; i++) g_free(wd[i]), free(wh[i]);
    for (int i = 0; i < ny; i++) g_free(dya[i]), g_free(dyb[i]), free(ref[i]);
    g_free(nd), g_free(dres), g_free(dxa), g_free(dxb), g_free(dna), g_free(dnb);
    free(nh), free(x), free(res), free(cx), free(cn_out), free(ha), free(hb);
}
static void check_rmsnorm_matmuls(void) {
    printf("-- rmsnorm_matmul (the norm and the matmuls after it; fused in fast mode for one token)\n");
    const st_dtype ts[] = {ST_DTYPE_Q4_0, ST_DTYPE_Q8_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K, ST_DTYPE_BF16};
    for (int fast = 0; fast < 2; fast++) {
        g_fast = fast;
        g_gpu->ops->set_fast_prefill(g_gpu, fast);
        for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++)
            for (int64_t n = 1; n <= 2; n++)
                for (int sw = 0; sw < 2; sw++)
                    check_rmsnorm_matmul(ts[ti], ts[ti], ts[ti] == ST_DTYPE_Q6_K ? 1280 : 1024, n, sw);
        /* q|k|v of two types (q4_K_M): one quantization, a GEMV launch per type */
        check_rmsnorm_matmul(ST_DTYPE_Q4_K, ST_DTYPE_Q6_K, 1280, 1, false);
        check_rmsnorm_matmul(ST_DTYPE_Q6_K, ST_DTYPE_Q8_0, 1280, 1, false);
        check_rmsnorm_matmul(ST_DTYPE_Q4_0, ST_DTYPE_BF16, 1024, 1, false); /* bf16 has no int8 GEMV: unfused */
    }
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    check_rmsnorm_matmul(ST_DTYPE_Q4_0, ST_DTYPE_Q4_0, 4096, 1, false); /* the 8B shape's norm: 256 threads of 4 float4 */
    check_rmsnorm_matmul(ST_DTYPE_Q4_0, ST_DTYPE_Q4_0, 4096 + 128, 1, true); /* 4 float4 per thread, a partial warp */
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* The ops of check_graph: H2D of a token id from pinned memory, get_rows,
 * matmul, argmax, D2H of the index to pinned memory. */
static strata_status graph_ops(st_backend *b, const st_weight *ge, const st_weight *gw, int32_t *pin, int32_t *did,
                               float *dx, float *dl, int64_t V) {
    strata_status st = b->ops->copy_h2d(b, g_s, did, pin, 4);
    if (st == STRATA_OK) st = b->ops->get_rows(b, g_s, ge, did, 1, dx);
    if (st == STRATA_OK) st = b->ops->matmul(b, g_s, dx, gw, 1, dl);
    if (st == STRATA_OK) st = b->ops->argmax(b, g_s, dl, 1, V, did + 1);
    if (st == STRATA_OK) st = b->ops->copy_d2h(b, g_s, pin + 1, did + 1, 4);
    return st;
}

/* Those ops recorded once and replayed with new ids: each replay equals the
 * CPU running them; a recording that needs scratch growth fails cleanly and
 * the stream stays usable (the ops are then run once directly and recorded
 * again). */
static void check_graph(void) {
    const int64_t V = 1000, K = 256;
    uint8_t *emb = make_weight(ST_DTYPE_BF16, V, K, 1.0f), *wh = make_weight(ST_DTYPE_Q8_0, V, K, 1.0f);
    void *demb = g_up(emb, st_dtype_row_bytes(ST_DTYPE_BF16, K) * (size_t)V);
    void *dw = g_up(wh, st_dtype_row_bytes(ST_DTYPE_Q8_0, K) * (size_t)V);
    st_weight ge = {demb, ST_DTYPE_BF16, V, K, 0}, gw = {dw, ST_DTYPE_Q8_0, V, K, 0};
    st_weight ce = {emb, ST_DTYPE_BF16, V, K, 0}, cw = {wh, ST_DTYPE_Q8_0, V, K, 0};
    int32_t *pin = NULL, *did = g_alloc(8);
    float *dx = g_alloc((size_t)K * 4), *dl = g_alloc((size_t)V * 4);
    TRY(g_gpu->ops->host_alloc(g_gpu, 8, (void **)&pin));
    st_backend *b = g_gpu;
    st_graph *g = NULL;
    pin[0] = 5;
    strata_status st = b->ops->graph_begin(b, g_s);
    if (st == STRATA_OK) st = graph_ops(b, &ge, &gw, pin, did, dx, dl, V);
    strata_status st2 = b->ops->graph_end(b, g_s, st == STRATA_OK ? &g : NULL);
    if (st != STRATA_OK || st2 != STRATA_OK || !g) {
        printf("note  graph: first recording failed (%s); recording again after a direct run\n", st_last_error());
        TRY(graph_ops(b, &ge, &gw, pin, did, dx, dl, V));
        g_sync();
        st = b->ops->graph_begin(b, g_s);
        if (st == STRATA_OK) st = graph_ops(b, &ge, &gw, pin, did, dx, dl, V);
        st2 = b->ops->graph_end(b, g_s, st == STRATA_OK ? &g : NULL);
    }
    bool ok = st == STRATA_OK && st2 == STRATA_OK && g;
    if (!ok) fprintf(stderr, "  graph: %s\n", st_last_error());
    float *x = xmalloc((size_t)K * 4), *l = xmalloc((size_t)V * 4);
    int replays = 0;
    for (int r = 0; ok && r < 20; r++) {
        const int32_t id = (int32_t)(rnd_u32() % (uint32_t)V);
        pin[0] = id;
        pin[1] = -1;
        if (b->ops->graph_launch(b, g_s, g) != STRATA_OK) {
            ok = false;
            break;
        }
        g_sync();
        int32_t want = -1;
        TRY(g_cpu->ops->get_rows(g_cpu, NULL, &ce, &id, 1, x));
        TRY(g_cpu->ops->matmul(g_cpu, NULL, x, &cw, 1, l));
        TRY(g_cpu->ops->argmax(g_cpu, NULL, l, 1, V, &want));
        if (pin[1] != want) {
            fprintf(stderr, "  graph replay %d: id %d -> %d, the CPU -> %d\n", r, id, pin[1], want);
            ok = false;
        }
        replays++;
    }
    check(ok, "graph: recorded once, %d replays with new pinned inputs match the CPU", replays);
    check(b->ops->graph_begin(b, NULL) != STRATA_OK, "graph: recording the default stream is refused");
    b->ops->graph_destroy(b, g);
    b->ops->host_dealloc(b, pin);
    g_free(demb), g_free(dw), g_free(did), g_free(dx), g_free(dl);
    free(emb), free(wh), free(x), free(l);
}

/* ---- paged KV cache: kv_store_paged, attention_paged, the batched forward ---- */

/* Bytes of a layer's K (or V) and of its fp8 scales. */
static size_t kv_bytes(st_kv_dtype t, int64_t n_slots, int64_t H, int64_t hd) {
    return (size_t)(n_slots * H * hd) * st_kv_dtype_size(t);
}
static size_t kv_scale_bytes(st_kv_dtype t, int64_t n_slots, int64_t H) {
    return t == ST_KV_FP8 ? (size_t)(n_slots * H) * 4 : 0;
}

/* The same layer (same dtype and shape) on the CPU (host memory) and the GPU;
 * `off` elements into their allocations (an unaligned cache when off > 0).
 * Both start from the same random bytes (fp8 scales 0.5). */
typedef struct {
    st_kv_layer c, g;
    void *ck, *cv, *gk, *gv; /* the allocations */
} kv_pair;

static void kv_pair_make(kv_pair *p, st_kv_dtype t, int64_t n_slots, int64_t H, int64_t hd, int off) {
    const size_t es = st_kv_dtype_size(t), nb = kv_bytes(t, n_slots, H, hd) + (size_t)off * es;
    const size_t sb = kv_scale_bytes(t, n_slots, H);
    uint8_t *init = xmalloc(nb);
    for (size_t i = 0; i < nb; i++) init[i] = (uint8_t)rnd_u32();
    if (t == ST_KV_F32) /* finite garbage */
        for (size_t i = 0; i < nb / 4; i++) ((float *)init)[i] = rnd_f();
    memset(p, 0, sizeof *p);
    p->ck = xmalloc(nb), p->cv = xmalloc(nb);
    memcpy(p->ck, init, nb), memcpy(p->cv, init, nb);
    p->gk = g_up(init, nb), p->gv = g_up(init, nb);
    const st_kv_layer base = {.dtype = t, .n_slots = n_slots, .n_kv_heads = H, .head_dim = hd};
    p->c = base, p->g = base;
    p->c.k = (char *)p->ck + off * es, p->c.v = (char *)p->cv + off * es;
    p->g.k = (char *)p->gk + off * es, p->g.v = (char *)p->gv + off * es;
    if (sb) {
        float *half = xmalloc(sb);
        for (size_t i = 0; i < sb / 4; i++) half[i] = 0.5f;
        p->c.k_scale = xmalloc(sb), p->c.v_scale = xmalloc(sb);
        memcpy(p->c.k_scale, half, sb), memcpy(p->c.v_scale, half, sb);
        p->g.k_scale = g_up(half, sb), p->g.v_scale = g_up(half, sb);
        free(half);
    }
    free(init);
}

static void kv_pair_free(kv_pair *p) {
    free(p->ck), free(p->cv), free(p->c.k_scale), free(p->c.v_scale);
    g_free(p->gk), g_free(p->gv);
    if (p->g.k_scale) g_free(p->g.k_scale), g_free(p->g.v_scale);
}

/* The GPU layer's K, V (and scales) equal the CPU layer's byte for byte. */
static bool kv_pair_same(const kv_pair *p) {
    const st_kv_layer *c = &p->c;
    const size_t nb = kv_bytes(c->dtype, c->n_slots, c->n_kv_heads, c->head_dim);
    const size_t sb = kv_scale_bytes(c->dtype, c->n_slots, c->n_kv_heads);
    uint8_t *h = xmalloc(nb > sb ? nb : sb);
    bool same = true;
    g_down(h, p->g.k, nb);
    same = same && memcmp(h, c->k, nb) == 0;
    g_down(h, p->g.v, nb);
    same = same && memcmp(h, c->v, nb) == 0;
    if (sb) {
        g_down(h, p->g.k_scale, sb);
        same = same && memcmp(h, c->k_scale, sb) == 0;
        g_down(h, p->g.v_scale, sb);
        same = same && memcmp(h, c->v_scale, sb) == 0;
    }
    free(h);
    return same;
}

/* kv_store_paged on both backends from the same rows (-1 slots; on the GPU one
 * more, out of range, which it skips; rows of mixed magnitudes, a zero row
 * and a NaN): the stored bytes (and fp8 scales) are identical. */
static void check_kv_store_paged(st_kv_dtype t, int64_t n_slots, int64_t H, int64_t hd, int64_t n, int off) {
    const int64_t cols = H * hd;
    kv_pair p;
    kv_pair_make(&p, t, n_slots, H, hd, off);
    float *k = rand_f(n * cols + off, 1.0f), *v = rand_f(n * cols + off, 1.0f);
    for (int64_t i = 0; i < n * cols; i++) k[off + i] *= (i / hd) % 3 == 0 ? 300.0f : (i / hd) % 3 == 1 ? 1e-3f : 1.0f;
    for (int64_t d = 0; d < hd; d++) v[off + d] = 0.0f; /* token 0, head 0 of V: a zero row */
    if (n * cols > 5) k[off + 5] = NAN;
    int64_t *slots = xmalloc((size_t)(n + 1) * 8);
    for (int64_t i = 0; i < n; i++) slots[i] = i % 5 == 3 ? -1 : (i * 7 + 3) % n_slots; /* distinct when n_slots >= 7n */
    float *dsk = g_up(k, (size_t)(n * cols + off) * 4), *dsv = g_up(v, (size_t)(n * cols + off) * 4);
    slots[n] = n_slots; /* out of range: the GPU skips it (the CPU rejects it, so it is not run there) */
    int64_t *dslots = g_up(slots, (size_t)(n + 1) * 8);
    TRY(g_cpu->ops->kv_store_paged(g_cpu, NULL, &p.c, k + off, v + off, slots, n));
    strata_status st = g_gpu->ops->kv_store_paged(g_gpu, g_s, &p.g, dsk + off, dsv + off, dslots, n + 1);
    if (st != STRATA_OK) fprintf(stderr, "  kv_store_paged: %s\n", st_last_error());
    g_sync();
    const bool ok = st == STRATA_OK && kv_pair_same(&p);
    check(ok, "kv_store_paged %s slots=%lld heads=%lld hd=%lld n=%lld%s (-1 slots, +1 out of range, a zero row, "
              "a NaN)  %s",
          st_kv_dtype_name(t), (long long)n_slots, (long long)H, (long long)hd, (long long)n,
          off ? " unaligned" : "", ok ? "same bytes" : "DIFFERS");
    {   /* kv_gather of every slot (and, on the GPU, one out of range: a NaN row) from the same bytes: same bits */
        const int64_t ng = n_slots + 1;
        int32_t *ids = xmalloc((size_t)ng * 4);
        for (int64_t i = 0; i < n_slots; i++) ids[i] = (int32_t)((i * 5 + 1) % n_slots);
        ids[n_slots] = (int32_t)n_slots;
        float *ck = xmalloc((size_t)(ng * cols) * 4), *cv = xmalloc((size_t)(ng * cols) * 4);
        float *hk = xmalloc((size_t)(ng * cols) * 4), *hv = xmalloc((size_t)(ng * cols) * 4);
        int32_t *dids = g_up(ids, (size_t)ng * 4);
        float *dk = g_up(hk, (size_t)(ng * cols) * 4), *dv = g_up(hv, (size_t)(ng * cols) * 4);
        TRY(g_cpu->ops->kv_gather(g_cpu, NULL, &p.c, ids, n_slots, ck, cv));
        strata_status sg = g_gpu->ops->kv_gather(g_gpu, g_s, &p.g, dids, ng, dk, dv);
        g_sync();
        g_down(hk, dk, (size_t)(ng * cols) * 4), g_down(hv, dv, (size_t)(ng * cols) * 4);
        bool same = sg == STRATA_OK; /* bit for bit, but NaN (the random bytes of unwritten fp8 slots hold NaN
                                        codes; the two backends' NaN payloads differ) */
        for (int64_t i = 0; i < n_slots * cols; i++)
            same = same && (memcmp(&hk[i], &ck[i], 4) == 0 || (isnan(hk[i]) && isnan(ck[i]))) &&
                   (memcmp(&hv[i], &cv[i], 4) == 0 || (isnan(hv[i]) && isnan(cv[i])));
        for (int64_t c = 0; c < cols; c++) same = same && isnan(hk[n_slots * cols + c]) && isnan(hv[n_slots * cols + c]);
        check(same, "kv_gather %s slots=%lld heads=%lld hd=%lld%s: every slot, +1 out of range (NaN)  %s (NaN = NaN)",
              st_kv_dtype_name(t), (long long)n_slots, (long long)H, (long long)hd, off ? " unaligned" : "",
              same ? "same bits" : "DIFFERS");
        g_free(dids), g_free(dk), g_free(dv);
        free(ids), free(ck), free(cv), free(hk), free(hv);
    }
    g_free(dsk), g_free(dsv), g_free(dslots);
    kv_pair_free(&p);
    free(k), free(v), free(slots);
}

/* The GPU layer's K, V and scales, downloaded into h (kv_bytes x 2 + scale bytes x 2). */
static void kv_layer_down(uint8_t *h, const st_kv_layer *g) {
    const size_t nb = kv_bytes(g->dtype, g->n_slots, g->n_kv_heads, g->head_dim);
    const size_t sb = kv_scale_bytes(g->dtype, g->n_slots, g->n_kv_heads);
    g_down(h, g->k, nb), g_down(h + nb, g->v, nb);
    if (sb) g_down(h + 2 * nb, g->k_scale, sb), g_down(h + 2 * nb + sb, g->v_scale, sb);
}

/* rope_kv_store on the GPU (one launch for f32 / bf16 caches) against rope,
 * rope and kv_store_paged on the GPU from the same bytes: q, k and the
 * cache (-1 slots, one out of range) byte for byte. */
static void check_rope_kv_store(st_kv_dtype t, int64_t n_slots, int64_t H, int64_t Hkv, int64_t hd, int64_t n,
                                bool inter) {
    const int64_t m = n + 1, qn = m * H * hd, kn = m * Hkv * hd; /* m: one more token, its slot out of range */
    kv_pair p;
    kv_pair_make(&p, t, n_slots, Hkv, hd, 0);
    const size_t nb = kv_bytes(t, n_slots, Hkv, hd), sb = kv_scale_bytes(t, n_slots, Hkv), lb = 2 * nb + 2 * sb;
    float *q = rand_f(qn, 2.0f), *k = rand_f(kn, 2.0f), *v = rand_f(kn, 2.0f), *f = xmalloc((size_t)hd * 2);
    int32_t *pos = xmalloc((size_t)m * 4);
    int64_t *slots = xmalloc((size_t)m * 8);
    for (int64_t i = 0; i < m; i++) {
        pos[i] = (int32_t)(rnd_u32() % 100000);
        slots[i] = i == n ? n_slots : i % 5 == 3 ? -1 : (i * 7 + 3) % n_slots; /* distinct when n_slots >= 7n */
    }
    make_inv_freq(f, hd, 500000.0);
    float *dv = g_up(v, (size_t)kn * 4), *df = g_up(f, (size_t)hd * 2);
    int32_t *dp = g_up(pos, (size_t)m * 4);
    int64_t *ds = g_up(slots, (size_t)m * 8);
    float *q1 = xmalloc((size_t)qn * 4), *k1 = xmalloc((size_t)kn * 4), *q2 = xmalloc((size_t)qn * 4),
          *k2 = xmalloc((size_t)kn * 4);
    uint8_t *c1 = xmalloc(lb), *c2 = xmalloc(lb);
    bool ok = true;
    for (int fused = 0; fused < 2; fused++) {
        if (fused) { /* the cache's first bytes again (the CPU side still holds them) */
            TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, p.g.k, p.c.k, nb));
            TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, p.g.v, p.c.v, nb));
            if (sb) {
                TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, p.g.k_scale, p.c.k_scale, sb));
                TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, p.g.v_scale, p.c.v_scale, sb));
            }
        }
        float *dq = g_up(q, (size_t)qn * 4), *dk = g_up(k, (size_t)kn * 4);
        strata_status st;
        if (fused) {
            st = g_gpu->ops->rope_kv_store(g_gpu, g_s, dq, dk, dv, dp, m, H, hd, df, inter, &p.g, ds);
        } else {
            st = g_gpu->ops->rope(g_gpu, g_s, dq, dp, m, H, hd, df, inter);
            if (st == STRATA_OK) st = g_gpu->ops->rope(g_gpu, g_s, dk, dp, m, Hkv, hd, df, inter);
            if (st == STRATA_OK) st = g_gpu->ops->kv_store_paged(g_gpu, g_s, &p.g, dk, dv, ds, m);
        }
        if (st != STRATA_OK) fprintf(stderr, "  %s: %s\n", fused ? "rope_kv_store" : "rope + kv_store_paged", st_last_error());
        ok = ok && st == STRATA_OK;
        g_down(fused ? q2 : q1, dq, (size_t)qn * 4), g_down(fused ? k2 : k1, dk, (size_t)kn * 4);
        kv_layer_down(fused ? c2 : c1, &p.g);
        g_free(dq), g_free(dk);
    }
    const bool same = ok && memcmp(q1, q2, (size_t)qn * 4) == 0 && memcmp(k1, k2, (size_t)kn * 4) == 0 &&
                      memcmp(c1, c2, lb) == 0;
    check(same, "rope_kv_store %s slots=%lld heads %lld/%lld hd=%lld n=%lld %s (-1 slots, +1 out of range): q, k and "
                "the cache as rope, rope, kv_store_paged  %s",
          st_kv_dtype_name(t), (long long)n_slots, (long long)H, (long long)Hkv, (long long)hd, (long long)n,
          inter ? "interleaved" : "rotate-half", same ? "same bytes" : "DIFFER");
    g_free(dv), g_free(df), g_free(dp), g_free(ds);
    kv_pair_free(&p);
    free(q), free(k), free(v), free(f), free(pos), free(slots), free(q1), free(k1), free(q2), free(k2), free(c1),
        free(c2);
}

/* A batch of n_seqs sequences (ctx[s] keys, the last nq[s] positions as
 * queries) over a pool of shuffled blocks in the cache type t, run on both
 * backends. The pool's fp32 rows are stored on each backend by its own
 * kv_store_paged (bf16 / fp8: the stored bytes must match). Checks: GPU vs
 * CPU (fp32 arithmetic over the same dequantized values: 1e-5); bf16 / fp8:
 * the GPU's bits equal its f32 path over the dequantized pool; GPU batch
 * invariance bit for bit: every token alone, the batch in reverse order,
 * and a larger max_ctx (more split slots in the grid) give the same bits as
 * the batch. */
static void check_attention_paged_t(st_kv_dtype kt, int64_t H, int64_t Hkv, int64_t hd, int64_t bs, int64_t n_seqs,
                                    const int32_t *ctx, const int32_t *nq, const char *what) {
    const int64_t kvd = Hkv * hd, row = H * hd;
    int64_t n = 0, max_blocks = 0, total_blocks = 3, max_ctx = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        const int64_t nb = (ctx[s] + bs - 1) / bs;
        total_blocks += nb;
        if (nb > max_blocks) max_blocks = nb;
        if (ctx[s] > max_ctx) max_ctx = ctx[s];
        n += nq[s];
    }
    max_blocks += 2; /* room for the larger max_ctx below */
    const int64_t n_slots = total_blocks * bs;
    float *kc = rand_f(n_slots * kvd, 1.0f), *vc = rand_f(n_slots * kvd, 1.0f), *q = rand_f(n * row, 2.0f);
    int32_t *perm = xmalloc((size_t)total_blocks * 4), *tables = xmalloc((size_t)(n_seqs * max_blocks) * 4);
    int32_t *seq = xmalloc((size_t)n * 4), *pos = xmalloc((size_t)n * 4);
    for (int64_t i = 0; i < total_blocks; i++) perm[i] = (int32_t)i;
    for (int64_t i = total_blocks - 1; i > 0; i--) {
        const int64_t j = rnd_u32() % (uint32_t)(i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int64_t next = 0, t = 0;
    for (int64_t s = 0; s < n_seqs; s++) {
        for (int64_t b = 0; b < max_blocks; b++)
            tables[s * max_blocks + b] = b < (ctx[s] + bs - 1) / bs ? perm[next++] : 0;
        for (int64_t i = 0; i < nq[s]; i++, t++) seq[t] = (int32_t)s, pos[t] = ctx[s] - nq[s] + (int32_t)i;
    }
    const float scale = 1.0f / sqrtf((float)hd);
    /* the pool in type kt on both backends, every slot stored by kv_store_paged */
    kv_pair lp;
    kv_pair_make(&lp, kt, n_slots, Hkv, hd, 0);
    {
        int64_t *sl = xmalloc((size_t)n_slots * 8);
        for (int64_t i = 0; i < n_slots; i++) sl[i] = i;
        float *dkc = g_up(kc, (size_t)(n_slots * kvd) * 4), *dvc = g_up(vc, (size_t)(n_slots * kvd) * 4);
        int64_t *dsl = g_up(sl, (size_t)n_slots * 8);
        TRY(g_cpu->ops->kv_store_paged(g_cpu, NULL, &lp.c, kc, vc, sl, n_slots));
        TRY(g_gpu->ops->kv_store_paged(g_gpu, g_s, &lp.g, dkc, dvc, dsl, n_slots));
        g_sync();
        g_free(dkc), g_free(dvc), g_free(dsl);
        free(sl);
    }
    const bool same_bytes = kv_pair_same(&lp);
    /* the dequantized pool as f32 (what the bf16 / fp8 paths must compute over) */
    float *dqk = xmalloc((size_t)(n_slots * kvd) * 4), *dqv = xmalloc((size_t)(n_slots * kvd) * 4);
    for (int64_t i = 0; i < n_slots * kvd; i++) {
        for (int w = 0; w < 2; w++) {
            const void *b = w ? lp.c.v : lp.c.k;
            float x;
            switch (kt) {
            case ST_KV_F32: x = ((const float *)b)[i]; break;
            case ST_KV_BF16: x = st_kv_bf16_to_f32(((const uint16_t *)b)[i]); break;
            default: x = st_kv_fp8_to_f32(((const uint8_t *)b)[i]) * (w ? lp.c.v_scale : lp.c.k_scale)[i / hd]; break;
            }
            (w ? dqv : dqk)[i] = x;
        }
    }
    st_paged_kv ck = {lp.c, bs, tables, max_blocks, ctx, n_seqs, max_ctx, 0};
    float *ref = xmalloc((size_t)(n * row) * 4), *got = xmalloc((size_t)(n * row) * 4), *alt = xmalloc((size_t)(n * row) * 4);
    TRY(g_cpu->ops->attention_paged(g_cpu, NULL, q, &ck, seq, pos, n, H, Hkv, hd, scale, ref));
    float *dk = g_up(dqk, (size_t)(n_slots * kvd) * 4), *dv = g_up(dqv, (size_t)(n_slots * kvd) * 4);
    float *dq = g_up(q, (size_t)(n * row) * 4);
    int32_t *dt = g_up(tables, (size_t)(n_seqs * max_blocks) * 4), *dc = g_up(ctx, (size_t)n_seqs * 4);
    int32_t *dsq = g_up(seq, (size_t)n * 4), *dp = g_up(pos, (size_t)n * 4);
    float *dout = g_poisoned((size_t)(n * row) * 4);
    st_paged_kv gk = {lp.g, bs, dt, max_blocks, dc, n_seqs, max_ctx, 0};
    strata_status st = g_gpu->ops->attention_paged(g_gpu, g_s, dq, &gk, dsq, dp, n, H, Hkv, hd, scale, dout);
    if (st != STRATA_OK) fprintf(stderr, "  attention_paged: %s\n", st_last_error());
    g_down(got, dout, (size_t)(n * row) * 4);
    const double e = st == STRATA_OK ? nerr(got, ref, n * row) : INFINITY;
    /* bf16 / fp8: the f32 path over the dequantized pool gives the same bits */
    bool as_f32 = true;
    if (kt != ST_KV_F32) {
        st_paged_kv gf = gk;
        gf.cache = (st_kv_layer){.k = dk, .v = dv, .dtype = ST_KV_F32, .n_slots = n_slots, .n_kv_heads = Hkv,
                                 .head_dim = hd};
        g_poison(dout, (size_t)(n * row) * 4);
        as_f32 = g_gpu->ops->attention_paged(g_gpu, g_s, dq, &gf, dsq, dp, n, H, Hkv, hd, scale, dout) == STRATA_OK;
        g_down(alt, dout, (size_t)(n * row) * 4);
        as_f32 = as_f32 && memcmp(alt, got, (size_t)(n * row) * 4) == 0;
    }
    /* invariance: each token alone */
    bool alone = st == STRATA_OK;
    for (int64_t i = 0; i < n && alone; i++) {
        g_poison(dout, (size_t)row * 4);
        alone = g_gpu->ops->attention_paged(g_gpu, g_s, dq + i * row, &gk, dsq + i, dp + i, 1, H, Hkv, hd, scale,
                                            dout) == STRATA_OK;
        g_down(alt, dout, (size_t)row * 4);
        alone = alone && memcmp(alt, got + i * row, (size_t)row * 4) == 0;
    }
    /* reversed order, and max_ctx raised to the tables' capacity */
    int32_t *rs = xmalloc((size_t)n * 4), *rp = xmalloc((size_t)n * 4);
    float *rq = xmalloc((size_t)(n * row) * 4);
    for (int64_t i = 0; i < n; i++) {
        rs[i] = seq[n - 1 - i], rp[i] = pos[n - 1 - i];
        memcpy(rq + i * row, q + (n - 1 - i) * row, (size_t)row * 4);
    }
    int32_t *drs = g_up(rs, (size_t)n * 4), *drp = g_up(rp, (size_t)n * 4);
    float *drq = g_up(rq, (size_t)(n * row) * 4);
    g_poison(dout, (size_t)(n * row) * 4);
    bool rev = g_gpu->ops->attention_paged(g_gpu, g_s, drq, &gk, drs, drp, n, H, Hkv, hd, scale, dout) == STRATA_OK;
    g_down(alt, dout, (size_t)(n * row) * 4);
    for (int64_t i = 0; i < n && rev; i++) rev = memcmp(alt + i * row, got + (n - 1 - i) * row, (size_t)row * 4) == 0;
    st_paged_kv gk2 = gk;
    gk2.max_ctx = max_blocks * bs;
    g_poison(dout, (size_t)(n * row) * 4);
    bool wide = g_gpu->ops->attention_paged(g_gpu, g_s, dq, &gk2, dsq, dp, n, H, Hkv, hd, scale, dout) == STRATA_OK;
    g_down(alt, dout, (size_t)(n * row) * 4);
    wide = wide && memcmp(alt, got, (size_t)(n * row) * 4) == 0;
    check(e <= 1e-5 && alone && rev && wide && same_bytes && as_f32,
          "attention_paged %s %s: heads %lld/%lld hd %lld bs %lld, %lld seqs, %lld tokens, max ctx %lld  err=%.2e "
          "(thr 1e-5); stored bytes %s; bit-identical alone %s, reversed %s, wider max_ctx %s, f32 over the "
          "dequantized pool %s",
          st_kv_dtype_name(kt), what, (long long)H, (long long)Hkv, (long long)hd, (long long)bs, (long long)n_seqs,
          (long long)n, (long long)max_ctx, e, same_bytes ? "same" : "DIFFER", alone ? "yes" : "NO",
          rev ? "yes" : "NO", wide ? "yes" : "NO", kt == ST_KV_F32 ? "-" : as_f32 ? "yes" : "NO");
    kv_pair_free(&lp);
    free(dqk), free(dqv);
    g_free(dk), g_free(dv), g_free(dq), g_free(dt), g_free(dc), g_free(dsq), g_free(dp), g_free(dout), g_free(drs),
        g_free(drp), g_free(drq);
    free(kc), free(vc), free(q), free(perm), free(tables), free(seq), free(pos), free(ref), free(got), free(alt),
        free(rs), free(rp), free(rq);
}

/* check_attention_paged_t for every cache type. */
static void check_attention_paged(int64_t H, int64_t Hkv, int64_t hd, int64_t bs, int64_t n_seqs, const int32_t *ctx,
                                  const int32_t *nq, const char *what) {
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++)
        check_attention_paged_t((st_kv_dtype)kt, H, Hkv, hd, bs, n_seqs, ctx, nq, what);
}

/* The attention kernels: contiguous decode over long KV (split sizing and
 * merge), and attention_paged over batches whose sequences give the tile
 * kernel full, partial and single-token tiles (1, 7, 64, 300 tokens mixed
 * with decodes), block sizes 16 and 32, GQA 4, 1, 12 and 96 (head chunks),
 * 8 and 3 (the decode kernel's two row counts, full and partial):
 * each within 1e-5 of the CPU and bit-identical for a token alone (the
 * decode kernel, against the tile kernel that ran the batch), in the
 * reversed batch and with a wider max_ctx (check_attention_paged); and a
 * batch of decodes alone (the decode kernel for all of it). */
static void check_attention_kernels(void) {
    printf("-- attention kernels\n");
    check_attention(1, 32768, 32, 8, 128);
    check_attention(1, 131072, 32, 8, 128);
    check_attention(1, 4096, 32, 8, 128);
    check_attention(4, 32768, 32, 8, 128);
    check_attention(1, 5000, 16, 8, 64);
    const int32_t ct[6] = {1, 40, 64, 700, 2000, 5}, qt[6] = {1, 7, 64, 300, 1, 5};
    const int64_t cfg[][3] = {{32, 8, 128}, {8, 8, 64}, {24, 2, 128}, {96, 1, 64}, {64, 8, 128}, {9, 3, 64}};
    const int64_t bss[2] = {16, 32};
    for (int c = 0; c < 6; c++)
        for (int b = 0; b < 2; b++)
            check_attention_paged(cfg[c][0], cfg[c][1], cfg[c][2], bss[b], 6, ct, qt, "tiles 1/7/64/300 + decodes");
    /* a big batch: 40 decodes around two prefill chunks */
    int32_t cb[42], qb[42];
    for (int i = 0; i < 42; i++) cb[i] = (int32_t)(1 + rnd_u32() % 1500), qb[i] = 1;
    cb[7] = 513, qb[7] = 200;
    cb[30] = 300, qb[30] = 300;
    check_attention_paged(32, 8, 128, 16, 42, cb, qb, "big batch (40 decodes, 2 chunks)");
    for (int i = 0; i < 42; i++) qb[i] = 1;
    cb[7] = 4097, cb[30] = 64;
    check_attention_paged(32, 8, 128, 16, 42, cb, qb, "42 decodes");
    check_attention_paged(64, 8, 128, 32, 42, cb, qb, "42 decodes");
}

/* The decode kernels forced (st_backend_params.paged_dec 1: a block per
 * item, 2: a warp per item) on batches of decodes and, alone, against the
 * tile kernel's bits (check_attention_paged): GQA 4, 8, 3 and 1. */
static void check_paged_decode(const char *what) {
    printf("-- attention_paged's decode kernel: %s\n", what);
    const int32_t ct[6] = {1, 40, 64, 700, 2000, 5}, qt[6] = {1, 7, 64, 300, 1, 5};
    const int64_t cfg[][3] = {{32, 8, 128}, {64, 8, 128}, {9, 3, 64}, {8, 8, 64}};
    int32_t cb[42], qb[42];
    for (int i = 0; i < 42; i++) cb[i] = (int32_t)(1 + rnd_u32() % 3000), qb[i] = 1;
    for (int c = 0; c < 4; c++) {
        check_attention_paged(cfg[c][0], cfg[c][1], cfg[c][2], 16, 6, ct, qt, "tiles 1/7/64/300 + decodes");
        check_attention_paged(cfg[c][0], cfg[c][1], cfg[c][2], 16, 42, cb, qb, "42 decodes");
    }
}

/* ---- the model: st_llama_forward, st_llama_forward_sample, st_llama_forward_seq ---- */

/* The model over mf on `be` with params lp (its kv_bytes set here) and a KV
 * pool of nb blocks of bs slots in type kt, sized for lp's max_tokens and
 * max_seq_len. Both or neither: on failure *m and *kv stay NULL (the message
 * in st_last_error). */
static strata_status model_open(const st_model_files *mf, st_backend *be, st_llama_params lp, int64_t nb, int64_t bs,
                                st_kv_dtype kt, st_llama **m, st_kv_pool **kv) {
    *m = NULL;
    *kv = NULL;
    const st_kv_pool_params kp = st_llama_kv_params_for(&mf->config, lp.max_tokens, lp.max_seq_len, nb, bs, kt);
    lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    strata_status st = st_llama_init(mf, be, &lp, m);
    if (st == STRATA_OK && (st = st_kv_pool_init(be, &kp, kv)) != STRATA_OK) {
        st_llama_free(*m);
        *m = NULL;
    }
    return st;
}

/* Frees what model_open made (NULLs are no-ops): recordings over the pool first. */
static void model_close(st_llama *m, st_kv_pool *kv) {
    if (m && kv) st_llama_forget_pool(m, kv);
    st_kv_pool_free(kv);
    st_llama_free(m);
}

/* st_llama_forward on both backends (f32 KV pools of 16 blocks of 16 slots,
 * shuffled block tables): 3 sequences (two prefill chunks and a decode, then
 * three decodes), logits within 1e-4 of the CPU's; and on the GPU, each
 * sequence's decode logits alone vs in the batch (reported: bitwise or the
 * difference, within 1e-5). */
static void check_forward_batch(const char *name) {
    const char *src = getenv("STRATA_SRC") ? getenv("STRATA_SRC") : ".";
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/models/%s", src, name);
    st_model_files *mf = NULL;
    st_llama *mc = NULL, *mg = NULL;
    st_kv_pool *kc = NULL, *kg = NULL;
    const int64_t bs = 16, nb = 16;
    const st_llama_params lp = {.max_seq_len = 64, .max_tokens = 64};
    if (st_model_open(path, &mf) != STRATA_OK || model_open(mf, g_cpu, lp, nb, bs, ST_KV_F32, &mc, &kc) != STRATA_OK ||
        model_open(mf, g_gpu, lp, nb, bs, ST_KV_F32, &mg, &kg) != STRATA_OK) {
        check(false, "forward_batch %s: cannot load: %s", name, st_last_error());
        goto out;
    }
    {
        const int64_t V = mf->config.vocab_size;
        /* sequence s uses 4 blocks (64 positions: the pools' max_blocks) */
        int32_t tables[3 * 4];
        for (int i = 0; i < 12; i++) tables[i] = (int32_t)((i * 5) % 16);
        int32_t tok[3][40];
        for (int s = 0; s < 3; s++)
            for (int i = 0; i < 40; i++) tok[s][i] = (int32_t)(rnd_u32() % (uint32_t)V);
        /* step 1: seq 0 [0, 20), seq 1 [0, 1), seq 2 [0, 33); step 2: one decode each */
        const int64_t lens[3] = {20, 1, 33};
        double e1 = 0, e2 = 0, inv = 0;
        int bitwise = 0;
        for (int step = 0; step < 2; step++) {
            int32_t bt[64], bp[64], bsq[64], ctx[3], lr[64];
            int64_t slots[64];
            int64_t n = 0, n_lr = 0;
            for (int s = 0; s < 3; s++) {
                const int64_t a = step == 0 ? 0 : lens[s], b = step == 0 ? lens[s] : lens[s] + 1;
                for (int64_t p = a; p < b; p++) {
                    bt[n] = tok[s][p], bp[n] = (int32_t)p, bsq[n] = s;
                    slots[n] = (int64_t)tables[s * 4 + p / bs] * bs + p % bs;
                    if (step == 0 || p == b - 1) lr[n_lr++] = (int32_t)n;
                    n++;
                }
                ctx[s] = (int32_t)b;
            }
            const st_batch b = {.n_tokens = n, .tokens = bt, .pos = bp, .seq = bsq, .slots = slots, .n_seqs = 3,
                                .block_tables = tables, .max_blocks = 4, .ctx_lens = ctx, .logit_rows = lr,
                                .n_logits = n_lr};
            float *lc = xmalloc((size_t)(n_lr * V) * 4), *lg = xmalloc((size_t)(n_lr * V) * 4);
            if (st_llama_forward(mc, kc, &b, lc) != STRATA_OK || st_llama_forward(mg, kg, &b, lg) != STRATA_OK) {
                fprintf(stderr, "  forward_batch: %s\n", st_last_error());
                *(step ? &e2 : &e1) = INFINITY;
            } else {
                const double e = nerr(lg, lc, n_lr * V);
                if (step) e2 = e; else e1 = e;
            }
            if (step == 1) { /* each decode alone on the GPU (its KV is in place: the same slot is rewritten) */
                for (int s = 0; s < 3; s++) {
                    int32_t ctx1 = ctx[s], seq0 = 0, lr0 = 0;
                    const st_batch b1 = {.n_tokens = 1, .tokens = &bt[s], .pos = &bp[s], .seq = &seq0,
                                         .slots = &slots[s], .n_seqs = 1, .block_tables = tables + s * 4,
                                         .max_blocks = 4, .ctx_lens = &ctx1, .logit_rows = &lr0, .n_logits = 1};
                    float *one = xmalloc((size_t)V * 4);
                    if (st_llama_forward(mg, kg, &b1, one) == STRATA_OK) {
                        bitwise += memcmp(one, lg + s * V, (size_t)V * 4) == 0;
                        const double e = nerr(one, lg + s * V, V);
                        inv = e > inv || isnan(e) ? e : inv;
                    } else {
                        fprintf(stderr, "  forward_batch (alone): %s\n", st_last_error());
                        inv = INFINITY;
                    }
                    free(one);
                }
            }
            free(lc), free(lg);
        }
        check(e1 <= 1e-4 && e2 <= 1e-4 && inv <= 1e-5,
              "forward_batch %s: prefill chunks + decode err=%.2e, decodes err=%.2e (thr 1e-4); GPU decode alone vs in"
              " a batch of 3: %d/3 bitwise, max diff %.2e (thr 1e-5)",
              name, e1, e2, bitwise, inv);
    }
out:
    model_close(mc, kc);
    model_close(mg, kg);
    st_model_close(mf);
}

/* ---- the whole forward pass ---- */

static double max_err(double acc, double e) { return e > acc || isnan(e) ? e : acc; }

/* st_llama_forward_seq of tok[0..n) at n_past .. on both backends (each over
 * its own pool): the logits' error (all n rows or the last one). */
static double logits_err(st_llama *mc, st_kv_pool *kc, st_llama *mg, st_kv_pool *kg, const int32_t *tok, int64_t n,
                         int64_t past, bool all, int64_t V) {
    const int64_t cnt = all ? n * V : V;
    float *lc = xmalloc((size_t)cnt * 4), *lg = xmalloc((size_t)cnt * 4);
    memset(lg, 0xff, (size_t)cnt * 4);
    double e = INFINITY;
    if (st_llama_forward_seq(mc, kc, tok, n, past, all, lc) != STRATA_OK)
        fprintf(stderr, "  cpu: %s\n", st_last_error());
    else if (st_llama_forward_seq(mg, kg, tok, n, past, all, lg) != STRATA_OK)
        fprintf(stderr, "  cuda: %s\n", st_last_error());
    else
        e = nerr(lg, lc, cnt);
    free(lc), free(lg);
    return e;
}

/* One decode step: token tok at position pos of the one sequence that owns
 * the pool, blocks 0, 1, ... in order (st_llama_forward_seq's layout, so the
 * two mix), through st_llama_forward_sample with greedy args: *id and the
 * logits [V]. */
static strata_status decode_sample(st_llama *m, st_kv_pool *kv, int32_t tok, int64_t pos, int32_t *id,
                                   float *logits) {
    const int64_t mb = st_kv_pool_max_blocks(kv);
    int32_t *table = xmalloc((size_t)mb * 4);
    for (int64_t b = 0; b < mb; b++) table[b] = (int32_t)b;
    const int32_t p = (int32_t)pos, sq = 0, ctx = (int32_t)(pos + 1), row = 0;
    const int64_t slot = pos; /* table[b] = b: position pos is slot pos */
    const st_batch b = {.n_tokens = 1, .tokens = &tok, .pos = &p, .seq = &sq, .slots = &slot, .n_seqs = 1,
                        .block_tables = table, .max_blocks = mb, .ctx_lens = &ctx, .logit_rows = &row,
                        .n_logits = 1};
    const st_sample_args greedy = {.u = 0.0, .temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    *id = -2;
    const strata_status st = st_llama_forward_sample(m, kv, &b, &greedy, id, logits);
    free(table);
    return st;
}

/* The first index of the largest of x[0..n) (the greedy token), and the gap
 * to the second largest. */
static int32_t top1(const float *x, int64_t n, double *gap) {
    int64_t a = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[a]) a = i;
    double second = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (i != a && x[i] > second) second = x[i];
    *gap = (double)x[a] - second;
    return (int32_t)a;
}

/* The forward pass on both backends over model `name`, with pools of 4
 * blocks of 16 slots in type kt (64 positions): decoding from an empty pool
 * (10 steps of st_llama_forward_sample, greedy), a 12-token prefill from
 * position 0 (st_llama_forward_seq, all logits; it overwrites the pool's
 * first positions), then 8 one-token st_llama_forward_seq steps on top.
 * Graphs on (the default): on CUDA the one-token passes replay a recorded
 * graph from the second of their shape on. */
static void check_model(const char *name, st_kv_dtype kt) {
    const char *src = getenv("STRATA_SRC") ? getenv("STRATA_SRC") : ".";
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/models/%s", src, name);
    st_model_files *mf = NULL;
    st_llama *mc = NULL, *mg = NULL;
    st_kv_pool *kc = NULL, *kg = NULL;
    const st_llama_params lp = {.max_seq_len = 64, .max_tokens = 32};
    if (st_model_open(path, &mf) != STRATA_OK || model_open(mf, g_cpu, lp, 4, 16, kt, &mc, &kc) != STRATA_OK ||
        model_open(mf, g_gpu, lp, 4, 16, kt, &mg, &kg) != STRATA_OK) {
        check(false, "model %s (kv %s): cannot load: %s", name, st_kv_dtype_name(kt), st_last_error());
        goto out;
    }
    {
        const int64_t V = mf->config.vocab_size;
        enum { N_DEC = 10, N_PRE = 12, N_ALL = 20 };
        int32_t tok[N_ALL];
        for (int i = 0; i < N_ALL; i++) tok[i] = (int32_t)(rnd_u32() % (uint32_t)V);
        /* 1. one token per pass from an empty pool, sampled on the device (greedy): GEMV + fp32 attention */
        float *lc = xmalloc((size_t)V * 4), *lg = xmalloc((size_t)V * 4);
        double ed = 0;
        int own = 0, same = 0, clear = 0, clear_same = 0;
        for (int i = 0; i < N_DEC; i++) {
            int32_t ic = -2, ig = -2;
            memset(lg, 0xff, (size_t)V * 4);
            if (decode_sample(mc, kc, tok[i], i, &ic, lc) != STRATA_OK) {
                fprintf(stderr, "  cpu: %s\n", st_last_error());
                ed = INFINITY;
                continue;
            }
            if (decode_sample(mg, kg, tok[i], i, &ig, lg) != STRATA_OK) {
                fprintf(stderr, "  cuda: %s\n", st_last_error());
                ed = INFINITY;
                continue;
            }
            ed = max_err(ed, nerr(lg, lc, V));
            double gap_c, gap_g, amax = 0;
            const int32_t want_c = top1(lc, V, &gap_c), want_g = top1(lg, V, &gap_g);
            (void)gap_g;
            for (int64_t j = 0; j < V; j++) amax = fmax(amax, fabs((double)lc[j]));
            own += ig == want_g && ic == want_c; /* each backend's token: the argmax of its own logits */
            same += ig == ic;
            if (gap_c > 1e-3 * amax) { /* a clear top-2 gap: a 1e-4 error cannot flip it */
                clear++;
                clear_same += ig == ic;
            }
        }
        free(lc), free(lg);
        st_llama_graph_stats g1 = {0}, g2 = {0};
        st_llama_get_graph_stats(mg, &g1);
        /* 2. prefill from position 0 over the same pool: bf16 GEMM, tensor-core attention */
        const double ep = logits_err(mc, kc, mg, kg, tok, N_PRE, 0, true, V);
        /* 3. one token per st_llama_forward_seq call on top of that */
        double ep2 = 0;
        for (int i = N_PRE; i < N_ALL; i++) ep2 = max_err(ep2, logits_err(mc, kc, mg, kg, tok + i, 1, i, false, V));
        st_llama_get_graph_stats(mg, &g2);
        const bool f32 = mf->tensors[0].dtype == ST_DTYPE_F32;
        /* a bf16 pool rounds each backend's K/V rows, ~1e-6 apart in fp32,
         * independently: a value near a rounding boundary goes to neighbouring
         * bf16 codes (2^-8 relative), so the logits agree to the bf16 level
         * (measured on an H100: up to 2.2e-3), not the f32 one; the stored bytes
         * of one row are checked equal by the paged checks above */
        const double dthr = kt == ST_KV_BF16 ? 1e-2 : 1e-4;
        const double thr = g_fast ? 5e-2 : dthr;
        const bool ids_ok = own == N_DEC && clear_same == clear;
        const bool graphs_ok = g1.replays > 0 && g2.replays > g1.replays;
        check(ed <= dthr && ep <= thr && ep2 <= thr && ids_ok && graphs_ok,
              "model %s (%s, %lld layers, heads %lld/%lld, hd %lld, kv %s%s): decode err=%.2e (thr %.0e), greedy "
              "tokens: %d/%d the argmax of their logits, %d/%d equal to the CPU's (%d/%d where its top-2 gap is "
              "clear); prefill err=%.2e, decode after prefill err=%.2e (thr %.0e); graphs: %lld replays in the "
              "first decode, %lld after the prefill (%lld recorded, %lld direct, %lld failed)",
              name, f32 ? "f32" : "bf16", (long long)mf->config.n_layers, (long long)mf->config.n_heads,
              (long long)mf->config.n_kv_heads, (long long)mf->config.head_dim, st_kv_dtype_name(kt),
              g_fast ? ", fast prefill" : "", ed, dthr, own, N_DEC, same, N_DEC, clear_same, clear, ep, ep2, thr,
              (long long)g1.replays, (long long)(g2.replays - g1.replays), (long long)g2.recorded,
              (long long)g2.direct, (long long)g2.failed);
    }
out:
    model_close(mc, kc);
    model_close(mg, kg);
    st_model_close(mf);
}

/* ---- decode GEMV kernels, switch points, decode path without PDL ----
 * The decode GEMV kernels: the staged GEMV (src/backend/cuda/cuda_gemv.cu)
 * for bf16, f16, q8_0, q4_0, q4_1, q4_k rows of a multiple of 16 bytes, the
 * mmv kernel of cuda_matmul.cu for the rest: every dtype, n = 1..8 tokens,
 * row counts that are not a multiple of the rows per block (13, 333), K from
 * one block to 4096 + a block (rows of 16-byte multiples or not, partial last
 * stages), more row groups than a wave of blocks, matmul_multi and
 * matmul_swiglu, against the CPU within 1e-5 where n is below the backend's
 * switch points (the rest at the GEMM's threshold: matmul_thr). `ver` names
 * the backend (main runs it on the default one and on one with
 * gemm_min_n = 9, where every n up to 8 takes the GEMV). */
static void check_gemv_version(const char *ver) {
    printf("-- decode GEMV kernels: %s\n", ver);
    for (size_t ti = 0; ti < sizeof k_all / sizeof k_all[0]; ti++) {
        const st_dtype t = k_all[ti];
        const int64_t be = st_dtype_get(t)->block_elems;
        const int64_t kp[4] = {32, 64, 776, 4096 + 8}, kq[4] = {32, 64, 512, 4096 + 256},
                      kk[4] = {256, 512, 1280, 4096 + 256}, kq2[1] = {4096 + 32};
        const int64_t *ks = be == 1 ? kp : be == 32 ? kq : kk;
        const int64_t rows[2] = {13, 333};
        for (int k = 0; k < 4; k++)
            for (int r = 0; r < 2; r++)
                for (int64_t n = 1; n <= 8; n++) check_matmul(t, rows[r], ks[k], n);
        if (be == 32)
            for (int64_t n = 1; n <= 8; n += 7) check_matmul(t, 333, kq2[0], n); /* rows not 16-byte multiples */
        /* one weight row, 8 tokens: 8 outputs, so that max|ref| is not one
         * dot product that happens to cancel (a single output near 0 turns
         * fp32 reordering noise into a large relative error) */
        check_matmul(t, 1, ks[1], 8);
        check_matmul(t, 7, ks[0], 3);
    }
    check_matmul(ST_DTYPE_Q4_0, 4096, 4096, 1);
    check_matmul(ST_DTYPE_Q4_1, 4096, 4096, 2);
    check_matmul(ST_DTYPE_Q8_0, 1024, 14336, 1);
    check_matmul(ST_DTYPE_Q4_0, 1024, 14336, 8);
    check_matmul(ST_DTYPE_BF16, 1024, 14336, 1);
    check_matmul(ST_DTYPE_Q4_K, 1024, 14336, 4);
    check_matmul(ST_DTYPE_Q4_0, 333, 4096, 20); /* 3 token groups of 8 */
    /* more row groups than one wave of blocks holds: each block walks several
     * groups, its copies running on across them (K = 256 bf16: one stage per
     * row, so three of the four warps have no stage at all) */
    check_matmul(ST_DTYPE_BF16, 20011, 256, 1);
    check_matmul(ST_DTYPE_BF16, 20011, 4096, 3);
    check_matmul(ST_DTYPE_Q4_0, 20011, 512, 1);
    check_matmul(ST_DTYPE_Q8_0, 20011, 512, 2);
    check_matmul(ST_DTYPE_Q4_K, 20011, 512, 8);
    check_fused(ST_DTYPE_Q4_0, 4096, 1);
    check_fused(ST_DTYPE_BF16, 4096, 2);
    const st_dtype ft[] = {ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K};
    const int64_t fn[] = {1, 2, 5, 8};
    for (size_t ti = 0; ti < sizeof ft / sizeof ft[0]; ti++)
        for (int i = 0; i < 4; i++) check_fused(ft[ti], ft[ti] == ST_DTYPE_Q4_K ? 1280 : 1024, fn[i]);
}

/* The int8 decode GEMV (fast mode: x quantized to int8 per 32-block, dp4a
 * against the packed weights; cuda_gemv.cu, cuda_gemv1.cu) for q8_0, q4_0,
 * q4_1, q4_k and (one token) q6_k:
 * n = 1..8, partial stages and row groups, rows not 16-byte multiples (the
 * fp32 kernels then), model shapes, matmul_multi and matmul_swiglu; within
 * 1.5e-2 of the CPU's fp32 result (max|y - ref| / max|ref|). */
static void check_gemv_int8(void) {
    printf("-- decode GEMV kernels, fast mode (int8 activations)\n");
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    const st_dtype ts[] = {ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++) {
        const st_dtype t = ts[ti];
        const bool kq = t == ST_DTYPE_Q4_K || t == ST_DTYPE_Q6_K;
        const int64_t ks[3] = {kq ? 256 : 32, kq ? 1280 : 512, 4096 + (kq ? 256 : 32)};
        const int64_t rows[2] = {13, 333};
        for (int k = 0; k < 3; k++)
            for (int r = 0; r < 2; r++)
                for (int64_t n = 1; n <= 8; n++) check_matmul(t, rows[r], ks[k], n);
        check_matmul(t, 4096, 4096, 1);
        check_matmul(t, 1024, 14336, 5);
        check_matmul(t, 20011, 512, 2);
        check_matmul(t, 20011, 512, 1); /* one token: the direct kernel (cuda_gemv1.cu), many warps' groups */
        check_matmul(t, 333, kq ? 768 : 384, 1); /* an odd number of 128-element units: rows 8-byte aligned (q4_0,
                                                    q8_0), 2-byte (q6_k) */
        check_matmul(t, 333, 4096, 11); /* two token groups */
        const int64_t fn[] = {1, 2, 5, 8};
        for (int i = 0; i < 4; i++) check_fused(t, kq ? 1280 : 1024, fn[i]);
    }
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* The int8 tensor-core matmul (MMQ, fast mode; cuda_mmq.cu) on the backend
 * g_gpu for q8_0, q4_0, q4_1, q4_k, q6_k: every tile configuration (token counts
 * 2..256: 8-, 16-, 32- and 64-token tiles, 32- and 64-row tiles), ragged
 * token counts and row counts (13, 333, 20011: partial tiles, many tiles),
 * K from one stage to 4096 + a stage (q4_1: + half a stage, a partial last
 * stage; q6_k: 2048 and 6144, stages at every offset in a 16-byte chunk,
 * and 1280, whose rows are not 16-byte multiples: not the MMQ), model shapes, matmul_multi and matmul_swiglu; within 1e-2 of the
 * CPU's fp32 result. `what` names the backend (main runs it on the default
 * one, 5..64 tokens, and on one whose MMQ takes every n from 1 to 1000: 1
 * and 300 tokens, every tile). */
static void check_mmq(const char *what) {
    printf("-- int8 tensor-core matmul (MMQ), fast mode: %s (MMQ for %d..%d tokens)\n", what, g_mmq_min, g_mmq_max);
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    const st_dtype ts[] = {ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    const int64_t ns[] = {1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64, 65, 100, 256, 300};
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++) {
        const st_dtype t = ts[ti];
        const bool kq = t == ST_DTYPE_Q4_K, k6 = t == ST_DTYPE_Q6_K;
        const int64_t h = t == ST_DTYPE_Q4_1 ? 128 : 0; /* q4_1: a half stage at the end */
        /* q6_k: 210-byte super-blocks, rows of 16-byte multiples from 8 of them (2048 elements; 1280: not the MMQ) */
        const int64_t ks[3] = {k6 ? 2048 : 256, kq || k6 ? 1280 : 768 - h, k6 ? 6144 : 4096 + 256 - h};
        const int64_t rows[2] = {13, 333};
        for (int k = 0; k < 3; k++)
            for (int r = 0; r < 2; r++)
                for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
                    const int64_t n = ns[i];
                    if (!(n >= g_mmq_min && n <= g_mmq_max) && n != g_mmq_min - 1 && n != g_mmq_max + 1) continue;
                    if (k == 2 && r == 1 && n > 64) continue; /* the CPU reference's time */
                    check_matmul(t, rows[r], ks[k], n);
                }
        check_matmul(t, 4096, 4096, 64);
        check_matmul(t, 1024, 14336, 8);
        check_matmul(t, 14336, 4096, 33);
        check_matmul(t, 20011, 512, 40);
        check_matmul(t, 7, 1024, 256);
        check_matmul_ex(t, 333, 1024, 12, 1, g_s); /* x not 16-byte aligned: an aligned copy first */
        /* past the MMQ's last count: the GEMM path, whose up projection goes to matmul_swiglu's work */
        const int64_t fn[] = {4, 16, 40, 64, g_mmq_max + 1};
        for (int i = 0; i < 5; i++)
            if (fn[i] <= 300) check_fused(t, k6 ? 2048 : kq ? 1280 : 1024 + (t == ST_DTYPE_Q4_1 ? 128 : 0), fn[i]);
    }
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}
static void check_mmq_default(void) { check_mmq("default"); }
static void check_gemv_int8_on(const char *what) {
    printf("-- (%s)\n", what);
    check_gemv_int8();
}
static void on_backend(const st_backend_params *p, void (*fn)(const char *), const char *what);
/* The one-token int8 GEMV with every rows-per-warp count, and the staged
 * kernel it replaced for one token (st_backend_params.gemv1_rows). */
static void check_gemv1_variants(void) {
    on_backend(&(st_backend_params){.gemv1_rows = 1}, check_gemv_int8_on, "gemv1_rows 1");
    on_backend(&(st_backend_params){.gemv1_rows = 4}, check_gemv_int8_on, "gemv1_rows 4");
    on_backend(&(st_backend_params){.gemv1_rows = -1}, check_gemv_int8_on, "gemv1_rows -1 (staged kernel)");
}

/* The GEMV / GEMM switch points of the backend g_gpu (g_min_n,
 * g_min_n_quant: st_backend_params.gemm_min_n, gemm_min_n_quant): matmul,
 * matmul_multi and matmul_swiglu on both sides of them and of the defaults
 * (4, 12), each at the threshold of the path its n takes. */
static void check_switch_points(const char *what) {
    printf("-- matmul switch points: %s (GEMM from %d tokens, %d for quantized weights)\n", what, g_min_n,
           g_min_n_quant);
    const st_dtype ts[] = {ST_DTYPE_F32, ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_K};
    const int64_t ns[] = {1, 2, 3, 4, 5, 8, 9, 11, 12, 13, 15, 16, 17, 31, 32, 33};
    for (size_t ti = 0; ti < sizeof ts / sizeof ts[0]; ti++) {
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) check_matmul(ts[ti], 333, 512, ns[i]);
        const int64_t fn[] = {2, g_min_n - 1, g_min_n, g_min_n_quant - 1, g_min_n_quant};
        for (int i = 0; i < 5; i++)
            if (fn[i] >= 1) check_fused(ts[ti], 512, fn[i]);
    }
}

/* The decode-path kernels (GEMV, fused GEMV, decode attention, paged decode
 * attention, a recorded graph) on the backend g_gpu (`what` names it: main
 * runs this on one made with pdl = -1, programmatic dependent launch off). */
static void check_decode_path(const char *what) {
    printf("-- decode-path kernels: %s\n", what);
    for (size_t ti = 0; ti < sizeof k_all / sizeof k_all[0]; ti++) {
        const st_dtype t = k_all[ti];
        const int64_t K = st_dtype_get(t)->block_elems == 256 ? 1280 : 1024;
        check_matmul(t, 333, K, 1);
        check_matmul(t, 4096, K, 2);
    }
    check_fused(ST_DTYPE_BF16, 1024, 1);
    check_fused(ST_DTYPE_Q4_0, 1024, 2);
    check_fused(ST_DTYPE_Q8_0, 1024, 1);
    check_attention(1, 4096, 32, 8, 128);
    check_attention(1, 32768, 32, 8, 128);
    check_attention(4, 1000, 16, 8, 64);
    int32_t cd[32], qd[32];
    for (int i = 0; i < 32; i++) cd[i] = (int32_t)(1 + rnd_u32() % 3000), qd[i] = 1;
    check_attention_paged(32, 8, 128, 16, 32, cd, qd, "32 decodes");
    check_graph();
}

/* st_backend_init refuses bad tuning values (INVALID_ARG, the message naming them, nothing made) and takes
 * good ones. */
static void check_backend_params(void) {
    const struct {
        st_backend_params p;
        const char *what;
    } bad[] = {
        {{.kind = ST_BACKEND_CUDA, .attn_fa2 = "b64w2"}, "attn_fa2 \"b64w2\""},
        {{.kind = ST_BACKEND_CUDA, .gemm_min_n = 1}, "gemm_min_n 1"},
        {{.kind = ST_BACKEND_CUDA, .gemm_min_n_quant = -3}, "gemm_min_n_quant -3"},
        {{.kind = ST_BACKEND_CUDA, .pdl = 2}, "pdl 2"},
        {{.kind = ST_BACKEND_CUDA, .mmq_min_n = -1}, "mmq_min_n -1"},
        {{.kind = ST_BACKEND_CUDA, .mmq_max_n = -2}, "mmq_max_n -2"},
        {{.kind = ST_BACKEND_CUDA, .mmq_min_n = 9, .mmq_max_n = 8}, "mmq_min_n 9, mmq_max_n 8"},
        {{.kind = ST_BACKEND_CUDA, .gemv1_rows = 3}, "gemv1_rows 3"},
        {{.kind = ST_BACKEND_CUDA, .gemv1_rows = -2}, "gemv1_rows -2"},
        {{.kind = ST_BACKEND_CUDA, .paged_dec = 3}, "paged_dec 3"},
        {{.kind = ST_BACKEND_CUDA, .paged_dec = -1}, "paged_dec -1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        st_backend *b = NULL;
        const strata_status st = st_backend_init(&bad[i].p, &b);
        const bool ok = st == STRATA_ERR_INVALID_ARG && b == NULL;
        check(ok, "backend params: %s refused (%s)", bad[i].what, st_last_error());
        if (st == STRATA_OK) st_backend_free(b);
    }
    st_backend_params good = {.kind = ST_BACKEND_CUDA, .attn_fa2 = "auto", .pdl = 1, .gemm_min_n = 2,
                              .gemm_min_n_quant = 64, .mmq_min_n = 1, .mmq_max_n = -1};
    st_backend *b = NULL;
    const strata_status st = st_backend_init(&good, &b);
    check(st == STRATA_OK && b, "backend params: attn_fa2 \"auto\", pdl 1, gemm_min_n 2, gemm_min_n_quant 64, "
                                "mmq_min_n 1, mmq_max_n -1 accepted%s%s", st == STRATA_OK ? "" : ": ",
          st == STRATA_OK ? "" : st_last_error());
    st_backend_free(b);
}

/* ---- sample: the CUDA op against the CPU op (same rows, same u) ----------------------
 * The CPU op computes in double (the host sampler's arithmetic); the CUDA op
 * in fp32 with fixed-point sums, so a token may differ only where a decision
 * is within rounding: u x total within 1e-5 (relative) of a cumulative
 * boundary of the kept tokens, or the top-p cut or a min-p test that close.
 * Such rows are counted; any other difference fails. */
typedef struct {
    float t;
    int32_t k; /* -1: vocab */
    float p, minp;
} smp_mix;

static float smp_nrand(void) {
    double u = (double)rnd_u32() / 4294967296.0, v = (double)rnd_u32() / 4294967296.0;
    if (u < 1e-12) u = 1e-12;
    return (float)(sqrt(-2 * log(u)) * cos(2 * M_PI * v));
}

/* kind: 0 gaussian (std 3), 1 sharp, 2 flat (std 0.3), 3 ties (multiples of
 * 0.5), 4 10% -inf, 5 invalid (NaN / all -inf / +inf, by row) */
static void smp_row(float *x, int64_t V, int kind, int64_t row) {
    for (int64_t i = 0; i < V; i++) {
        float v = smp_nrand();
        switch (kind) {
        case 0: v *= 3.0f; break;
        case 1: v = v * 2.0f + (rnd_u32() % 1000 == 0 ? 15.0f : 0.0f); break;
        case 2: v *= 0.3f; break;
        case 3: v = roundf(v * 4.0f) * 0.5f; break;
        default: v = rnd_u32() % 10 == 0 ? -INFINITY : v * 3.0f; break;
        }
        x[i] = v;
    }
    if (kind >= 4) x[V / 2] = 1.0f;
    if (kind == 5) {
        if (row % 3 == 0) x[V - 1] = NAN;
        else if (row % 3 == 1) for (int64_t i = 0; i < V; i++) x[i] = -INFINITY;
        else x[V / 3] = INFINITY;
    }
}

typedef struct {
    int32_t id;
    double x, p;
} smp_c;
static int smp_desc(const void *a, const void *b) {
    const smp_c *u = a, *v = b;
    if (u->x != v->x) return u->x > v->x ? -1 : 1;
    return u->id < v->id ? -1 : u->id > v->id;
}
static int smp_by_id(const void *a, const void *b) {
    const smp_c *u = a, *v = b;
    return u->id < v->id ? -1 : u->id > v->id;
}

/* The smallest relative distance of a decision of row x (args a) to its
 * threshold, in double: top-p cut, min-p tests, and u x total against the
 * cumulative masses of the kept tokens. */
static double smp_margin(const float *x, int64_t V, const st_sample_args *a) {
    smp_c *c = xmalloc((size_t)V * sizeof *c);
    double m = -INFINITY;
    for (int64_t i = 0; i < V; i++) m = x[i] > m ? x[i] : m;
    double tau = -INFINITY;
    if (a->top_k > 0 && a->top_k < V) {
        smp_c *t = xmalloc((size_t)V * sizeof *t);
        for (int64_t i = 0; i < V; i++) t[i].x = x[i], t[i].id = (int32_t)i;
        qsort(t, (size_t)V, sizeof *t, smp_desc);
        tau = t[a->top_k - 1].x;
        free(t);
    }
    int64_t n = 0;
    double sum = 0;
    for (int64_t i = 0; i < V; i++)
        if (x[i] != -INFINITY && x[i] >= tau) {
            c[n].id = (int32_t)i, c[n].x = x[i];
            c[n].p = exp(((double)x[i] - m) / (double)a->temperature);
            sum += c[n++].p;
        }
    double margin = INFINITY;
    qsort(c, (size_t)n, sizeof *c, smp_desc);
    if (a->top_p < 1.0f) {
        const double target = (double)a->top_p * sum;
        double cum = 0;
        int64_t keep = 0;
        while (keep < n) {
            const double before = cum;
            cum += c[keep++].p;
            if (cum >= target) {
                margin = fmin(fabs(target - before), fabs(cum - target)) / sum;
                break;
            }
        }
        n = keep;
    }
    if (a->min_p > 0.0f) {
        int64_t w = 0;
        for (int64_t i = 0; i < n; i++) {
            margin = fmin(margin, fabs(c[i].p - (double)a->min_p));
            if (c[i].p >= (double)a->min_p) c[w++] = c[i];
        }
        n = w;
    }
    qsort(c, (size_t)n, sizeof *c, smp_by_id);
    double total = 0;
    for (int64_t i = 0; i < n; i++) total += c[i].p;
    double cum = 0;
    for (int64_t i = 0; i < n; i++) {
        cum += c[i].p;
        margin = fmin(margin, fabs(cum - a->u * total) / total);
    }
    free(c);
    return margin;
}

static void check_sample(int64_t V, int64_t n, int off, const smp_mix *mixes, int n_mixes) {
    float *x = xmalloc((size_t)(n * V + off) * sizeof *x);
    st_sample_args *args = xmalloc((size_t)n * sizeof *args);
    for (int64_t r = 0; r < n; r++) {
        const int kind = (int)(r % 6);
        smp_row(x + off + r * V, V, kind, r / 6);
        const smp_mix *mx = &mixes[(r / 6 + r) % n_mixes];
        args[r] = (st_sample_args){.u = (double)rnd_u32() / 4294967296.0, .temperature = mx->t,
                                   .top_k = mx->k < 0 ? (int32_t)V : mx->k, .top_p = mx->p, .min_p = mx->minp};
    }
    int32_t *ref = xmalloc((size_t)n * 4), *got = xmalloc((size_t)n * 4);
    TRY(g_cpu->ops->sample(g_cpu, NULL, x + off, n, V, args, ref));
    float *dx = g_up(x, (size_t)(n * V + off) * sizeof *x);
    st_sample_args *dargs = g_up(args, (size_t)n * sizeof *args);
    int32_t *dout = g_alloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) got[i] = 0x5a5a5a5a; /* poison: not a token, not -1 */
    TRY(g_gpu->ops->copy_h2d(g_gpu, g_s, dout, got, (size_t)n * 4));
    const double t0 = st_time_now();
    strata_status st = g_gpu->ops->sample(g_gpu, g_s, dx + off, n, V, dargs, dout);
    g_sync();
    const double dt = st_time_now() - t0;
    g_down(got, dout, (size_t)n * 4);
    int64_t same = 0, near = 0, bad = 0, greedy = 0, invalid = 0;
    double worst = INFINITY;
    for (int64_t r = 0; r < n; r++) {
        if (args[r].temperature == 0.0f) greedy++;
        if (ref[r] < 0) invalid++;
        if (got[r] == ref[r]) {
            same++;
            continue;
        }
        const double mg = ref[r] < 0 || got[r] < 0 || got[r] >= V || args[r].temperature == 0.0f
                              ? INFINITY
                              : smp_margin(x + off + r * V, V, &args[r]);
        if (mg < 1e-5) {
            near++;
        } else {
            bad++;
            if (bad <= 3)
                printf("      row %lld (T %g k %d p %g minp %g u %.9f): cuda %d, cpu %d, margin %.2e\n", (long long)r,
                       (double)args[r].temperature, args[r].top_k, (double)args[r].top_p, (double)args[r].min_p,
                       args[r].u, got[r], ref[r], mg);
        }
        worst = fmin(worst, mg);
    }
    check(st == STRATA_OK && bad == 0,
          "sample V=%lld n=%lld%s  %lld same (%lld greedy, %lld invalid rows), %lld differ within 1e-5 of a "
          "boundary, %lld differ  (%.0f us incl. sync)",
          (long long)V, (long long)n, off ? " unaligned" : "", (long long)same, (long long)greedy, (long long)invalid,
          (long long)near, (long long)bad, dt * 1e6);
    g_free(dx), g_free(dargs), g_free(dout);
    free(x), free(args), free(ref), free(got);
}

static void check_sample_all(void) {
    static const smp_mix mixes[] = {
        {0.7f, 40, 1.0f, 0.0f}, {1.0f, 40, 0.9f, 0.0f},  {1.0f, 0, 0.9f, 0.0f},   {1.5f, 0, 1.0f, 0.0f},
        {0.7f, 0, 0.95f, 0.05f}, {0.0f, 40, 0.9f, 0.0f}, {1.0f, -1, 0.5f, 0.0f},  {0.7f, 1, 1.0f, 0.0f},
        {1.0f, 0, 0.05f, 0.0f}, {1.5f, 1000, 0.99f, 0.01f}, {0.7f, 0, 1.0f, 0.1f}, {1.0f, 40, 0.3f, 0.2f},
    };
    const int nm = (int)(sizeof mixes / sizeof mixes[0]);
    check_sample(128256, 64, 0, mixes, nm);
    check_sample(49152, 36, 1, mixes, nm);   /* unaligned rows: scalar loads */
    check_sample(151936, 12, 0, mixes, nm);
    check_sample(262144, 12, 0, mixes, nm);  /* 256K */
    check_sample(300001, 6, 0, mixes, nm);   /* > 256K: two tiles per group, odd vocab */
    check_sample(1000, 1000, 0, mixes, nm);  /* many rows */
    check_sample(7, 48, 0, mixes, nm);
    check_sample(1, 6, 0, mixes, nm);
    /* bad arguments */
    int32_t *dout = g_alloc(16);
    float *dx = g_alloc(64);
    st_sample_args *da = g_alloc(64);
    const bool e1 = g_gpu->ops->sample(g_gpu, g_s, NULL, 1, 8, da, dout) == STRATA_ERR_INVALID_ARG &&
                    strstr(st_last_error(), "cuda sample");
    const bool e2 = g_gpu->ops->sample(g_gpu, g_s, dx, 1, 0, da, dout) == STRATA_ERR_INVALID_ARG;
    const bool e3 = g_gpu->ops->sample(g_gpu, g_s, dx, -1, 8, da, dout) == STRATA_ERR_INVALID_ARG;
    const bool e4 = g_gpu->ops->sample(g_gpu, g_s, dx, 1, 8, NULL, dout) == STRATA_ERR_INVALID_ARG;
    const bool e5 = g_gpu->ops->sample(g_gpu, g_s, dx, 0, 8, da, dout) == STRATA_OK;
    check(e1 && e2 && e3 && e4 && e5, "sample bad arguments  %s", e1 && e2 && e3 && e4 && e5 ? "errors" : "NOT CAUGHT");
    g_free(dout), g_free(dx), g_free(da);
}

/* Runs fn(what) with g_gpu / g_s swapped for a second CUDA backend made with
 * the tuning fields of p (st_backend_params: read at init) and a stream on
 * it, g_min_n / g_min_n_quant set to its switch points; frees them after. */
static void on_backend(const st_backend_params *p, void (*fn)(const char *), const char *what) {
    st_backend *gpu0 = g_gpu;
    st_stream *s0 = g_s;
    const int mn0 = g_min_n, mq0 = g_min_n_quant, mm0 = g_mmq_min, mx0 = g_mmq_max;
    st_backend_params bp = *p;
    bp.kind = ST_BACKEND_CUDA;
    TRY(st_backend_init(&bp, &g_gpu));
    TRY(g_gpu->ops->stream_create(g_gpu, false, &g_s));
    g_min_n = bp.gemm_min_n ? bp.gemm_min_n : 4;
    g_min_n_quant = bp.gemm_min_n_quant ? bp.gemm_min_n_quant : 12;
    g_mmq_min = bp.mmq_min_n ? bp.mmq_min_n : 5;
    g_mmq_max = bp.mmq_max_n < 0 ? 0 : bp.mmq_max_n ? bp.mmq_max_n : 64;
    const bool g10 = g_gemv1;
    g_gemv1 = bp.gemv1_rows != -1;
    fn(what);
    g_gemv1 = g10;
    g_gpu->ops->stream_destroy(g_gpu, g_s);
    st_backend_free(g_gpu);
    g_gpu = gpu0, g_s = s0;
    g_min_n = mn0, g_min_n_quant = mq0, g_mmq_min = mm0, g_mmq_max = mx0;
}

/* ---- main ---- */

/* The model on both backends (batched forward, the models' logits and
 * tokens with f32 and bf16 KV pools, fast mode): the full run and --only-model. */
static void check_models(void) {
    const char *pmodels[] = {"gqa_f32", "llama3_bf16", "headdim_f32", "mha_tied_f32"};
    for (size_t i = 0; i < sizeof pmodels / sizeof pmodels[0]; i++) check_forward_batch(pmodels[i]);

    const char *models[] = {"llama3_f32", "llama3_bf16", "gqa_f32", "gqa_tied_bf16", "gqa_sharded_f32",
                            "headdim_f32", "mha_tied_f32"};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) check_model(models[i], ST_KV_F32);
    /* the KV pool in bf16: the same bytes on both backends, the same bounds */
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) check_model(models[i], ST_KV_BF16);

    /* fast prefill mode: bf16 operands on the tensor cores */
    g_fast = true;
    g_gpu->ops->set_fast_prefill(g_gpu, true);
    const st_dtype fast_t[] = {ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_K};
    for (size_t ti = 0; ti < sizeof fast_t / sizeof fast_t[0]; ti++) {
        check_matmul(fast_t[ti], 1000, 512, 64);
        check_matmul(fast_t[ti], 300, 1024, 300);
    }
    check_model("llama3_bf16", ST_KV_F32);
    check_model("gqa_f32", ST_KV_F32);
    g_gpu->ops->set_fast_prefill(g_gpu, false);
    g_fast = false;
}

/* The paged KV ops: store, RoPE with the store, attention_paged (mixed batches, decodes, long). */
static void check_paged(void) {
    for (int kt = ST_KV_F32; kt <= ST_KV_FP8; kt++) {
        check_kv_store_paged((st_kv_dtype)kt, 100, 9, 64, 13, 0);
        check_kv_store_paged((st_kv_dtype)kt, 100, 8, 128, 13, 0);
        check_kv_store_paged((st_kv_dtype)kt, 37, 1, 19, 5, 1);
        check_kv_store_paged((st_kv_dtype)kt, 37, 3, 40, 5, 3);
        check_rope_kv_store((st_kv_dtype)kt, 100, 32, 8, 128, 13, false);
        check_rope_kv_store((st_kv_dtype)kt, 100, 9, 3, 64, 13, true);
        check_rope_kv_store((st_kv_dtype)kt, 300, 64, 8, 128, 40, false);
    }
    {
        const int32_t c4[4] = {1, 37, 300, 64}, q4[4] = {1, 5, 1, 64};
        const int64_t pcfg[][3] = {{4, 4, 64}, {9, 3, 64}, {8, 2, 128}, {32, 8, 128}, {24, 2, 128}, {8, 2, 80}, {6, 3, 32}};
        for (int c = 0; c < 7; c++) check_attention_paged(pcfg[c][0], pcfg[c][1], pcfg[c][2], 16, 4, c4, q4, "mixed");
        check_attention_paged(9, 3, 64, 1, 4, c4, q4, "one-slot blocks");
        check_attention_paged(8, 2, 128, 7, 4, c4, q4, "odd block size");
        int32_t cd[32], qd[32];
        for (int i = 0; i < 32; i++) cd[i] = (int32_t)(1 + rnd_u32() % 3000), qd[i] = 1;
        check_attention_paged(32, 8, 128, 16, 32, cd, qd, "32 decodes");
        check_attention_paged(9, 3, 64, 16, 32, cd, qd, "32 decodes");
        const int32_t cl[2] = {5000, 40000}, ql[2] = {300, 1};
        check_attention_paged(32, 8, 128, 16, 2, cl, ql, "long (sub-batched partials)");
    }
}

int main(int argc, char **argv) {
    /* --only-attention: the attention ops alone (attention, attention_part, attention_paged) */
    /* --only-gemv: the decode GEMV checks alone (default backend, then fast mode's int8 kernels and MMQ) */
    /* --only-mmq: the MMQ checks alone */
    /* --only-paged: the paged KV ops and the decode kernels forced (a subset of --only-attention) */
    const bool only_attn = argc > 1 && !strcmp(argv[1], "--only-attention");
    const bool only_gemv = argc > 1 && !strcmp(argv[1], "--only-gemv");
    const bool only_mmq = argc > 1 && !strcmp(argv[1], "--only-mmq");
    const bool only_model = argc > 1 && !strcmp(argv[1], "--only-model");
    const bool only_paged = argc > 1 && !strcmp(argv[1], "--only-paged");
    if (argc > 1 && !only_attn && !only_gemv && !only_mmq && !only_model && !only_paged) {
        fprintf(stderr, "usage: gpu_check_ops [--only-attention | --only-gemv | --only-mmq | --only-model | --only-paged]\n");
        return 2;
    }
    g_t0 = st_time_now();
    st_backend_params cpu_p = {.kind = ST_BACKEND_CPU, .n_threads = 0};
    st_backend_params gpu_p = {.kind = ST_BACKEND_CUDA, .device_mem = 0, .device_index = 0};
    TRY(st_backend_init(&cpu_p, &g_cpu));
    TRY(st_backend_init(&gpu_p, &g_gpu));
    TRY(g_gpu->ops->stream_create(g_gpu, false, &g_s));
    if (only_gemv || only_mmq) {
        if (only_gemv) check_gemv_version("default");
        if (only_gemv) check_gemv_int8();
        if (only_gemv) on_backend(&(st_backend_params){.mmq_max_n = -1}, check_gemv_int8_on, "mmq_max_n -1");
        if (only_gemv) check_gemv1_variants();
        if (only_gemv) check_rmsnorm_matmuls();
        check_mmq_default();
        on_backend(&(st_backend_params){.mmq_min_n = 1, .mmq_max_n = 1000}, check_mmq, "mmq_min_n 1, mmq_max_n 1000");
        if (only_mmq) check_backend_params();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (only_model) {
        check_models();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (only_paged) {
        check_paged();
        on_backend(&(st_backend_params){.paged_dec = 1}, check_paged_decode, "paged_dec 1 (a block per item)");
        on_backend(&(st_backend_params){.paged_dec = 2}, check_paged_decode, "paged_dec 2 (a warp per item)");
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }

    if (!only_attn) {
        check_memory();
        check_streams();

        for (size_t ti = 0; ti < sizeof k_all / sizeof k_all[0]; ti++) {
            const st_dtype t = k_all[ti];
            const int64_t be = st_dtype_get(t)->block_elems;
            const int64_t cols_plain[] = {96, 1000, 1001}, cols_q[] = {96, 288, 576}, cols_k[] = {256, 768};
            const int64_t *cols = be == 1 ? cols_plain : be == 32 ? cols_q : cols_k;
            const int nc = be == 256 ? 2 : 3;
            const int64_t gn[] = {1, 17, 300};
            for (int c = 0; c < nc; c++)
                for (int i = 0; i < 3; i++) check_get_rows(t, 300, cols[c], gn[i]);
        }

        const int64_t rn[] = {1, 3, 17, 300};
        const int64_t rd[] = {96, 288, 1000, 4096};
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++) check_rmsnorm(ST_DTYPE_F32, rn[a], rd[b], (a + b) % 2 == 0);
        check_rmsnorm(ST_DTYPE_F32, 17, 1000, false);
        check_rmsnorm(ST_DTYPE_F32, 17, 1000, true);
        check_rmsnorm(ST_DTYPE_BF16, 3, 4096, true);
        check_rmsnorm(ST_DTYPE_F16, 17, 576, false);
        check_rmsnorm(ST_DTYPE_Q8_0, 3, 288, true);

        const int64_t mn[] = {1, 3, 8, 17, 64, 300};
        for (size_t ti = 0; ti < sizeof k_all / sizeof k_all[0]; ti++) {
            const st_dtype t = k_all[ti];
            const int64_t be = st_dtype_get(t)->block_elems;
            int64_t shapes[3][2];
            if (be == 1) {
                int64_t s[3][2] = {{96, 288}, {1000, 576}, {288, 1000}};
                memcpy(shapes, s, sizeof s);
            } else if (be == 32) {
                int64_t s[3][2] = {{96, 288}, {1000, 576}, {300, 1024}};
                memcpy(shapes, s, sizeof s);
            } else {
                int64_t s[3][2] = {{96, 256}, {300, 768}, {1000, 512}};
                memcpy(shapes, s, sizeof s);
            }
            for (int sh = 0; sh < 3; sh++)
                for (int i = 0; i < 6; i++) check_matmul(t, shapes[sh][0], shapes[sh][1], mn[i]);
        }
        /* odd K for plain types (scalar path), unaligned x, the default stream, decode-sized weights */
        check_matmul(ST_DTYPE_F32, 64, 1001, 3);
        check_matmul(ST_DTYPE_F32, 64, 1001, 17);
        check_matmul(ST_DTYPE_BF16, 64, 1001, 17);
        check_matmul(ST_DTYPE_F16, 64, 1001, 5);
        check_matmul_ex(ST_DTYPE_BF16, 288, 576, 3, 1, g_s);
        check_matmul_ex(ST_DTYPE_Q4_0, 288, 576, 3, 1, g_s);
        check_matmul_ex(ST_DTYPE_Q8_0, 288, 576, 64, 1, g_s);
        check_matmul_ex(ST_DTYPE_BF16, 288, 576, 64, 0, NULL);
        check_matmul(ST_DTYPE_BF16, 4096, 4096, 1);
        check_matmul(ST_DTYPE_Q4_K, 4096, 4096, 1);
        check_matmul(ST_DTYPE_Q8_0, 4096, 4096, 2);
        check_matmul(ST_DTYPE_BF16, 1024, 4096, 512);

        const int64_t pn[] = {1, 17, 300};
        for (int a = 0; a < 3; a++)
            for (int hdi = 0; hdi < 2; hdi++)
                for (int inter = 0; inter < 2; inter++) check_rope(pn[a], a == 1 ? 3 : 8, hdi ? 128 : 64, inter);
        check_rope(5, 4, 96, false);
        check_rope_far(false);
        check_rope_far(true);
    }

    /* attention: (heads, kv heads, head_dim) with GQA ratios 1, 3, 4, 8 */
    const int64_t cfg[][3] = {{4, 4, 64}, {6, 2, 128}, {8, 2, 128}, {12, 4, 64}, {32, 8, 128}, {16, 2, 128}};
    const int64_t dkv[] = {1, 17, 1000, 4096};
    for (int c = 0; c < 6; c++)
        for (int i = 0; i < 4; i++) check_attention(1, dkv[i], cfg[c][0], cfg[c][1], cfg[c][2]);
    for (int c = 0; c < 6; c++) check_attention(3, 1000, cfg[c][0], cfg[c][1], cfg[c][2]);
    const int64_t an[] = {17, 64, 300};
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 3; i++) {
            check_attention(an[i], an[i], cfg[c][0], cfg[c][1], cfg[c][2]);
            check_attention(an[i], an[i] + 100, cfg[c][0], cfg[c][1], cfg[c][2]);
        }
    check_attention(64, 4096, 32, 8, 128); /* a prefill chunk over a long cache: split KV */
    check_attention(300, 300, 32, 8, 128);
    check_attention(1, 1000, 8, 2, 80);    /* other head dims: generic kernel */
    check_attention(17, 100, 6, 3, 32);
    check_attention(1, 5000, 4, 1, 96);

    if (!only_attn) {
        const int64_t sn[] = {1, 3, 17, 1000, 12345, 1 << 20};
        for (int i = 0; i < 6; i++) {
            check_swiglu(sn[i], 0, false);
            check_add(sn[i], 0);
        }
        check_swiglu(12345, 1, false);
        check_swiglu(12345, 0, true);
        check_add(12345, 3);

        check_argmax(1, 128256, 0);
        check_argmax(5, 1000, 1);
        check_argmax(3, 3, 0);
        check_sample_all();
        const st_dtype fused_t[] = {ST_DTYPE_F32, ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_K};
        const int64_t fused_n[] = {1, 3, 8, 40};
        for (size_t ti = 0; ti < sizeof fused_t / sizeof fused_t[0]; ti++)
            for (int i = 0; i < 4; i++) check_fused(fused_t[ti], 512, fused_n[i]);
        check_graph();
    }

    check_paged();
    if (!only_attn) {
        /* the decode GEMV kernels on the default backend, then on one where every n <= 8 takes the GEMV */
        check_gemv_version("default");
        check_gemv_int8();
        check_mmq_default();
        on_backend(&(st_backend_params){.mmq_min_n = 1, .mmq_max_n = 1000}, check_mmq, "mmq_min_n 1, mmq_max_n 1000");
        /* the int8 GEMV at every n it may take (the MMQ off) */
        on_backend(&(st_backend_params){.mmq_max_n = -1}, check_gemv_int8_on, "mmq_max_n -1");
        check_gemv1_variants();
        check_rmsnorm_matmuls();
        on_backend(&(st_backend_params){.gemm_min_n = 9}, check_gemv_version, "gemm_min_n = 9");
        /* the GEMV / GEMM switch points (st_backend_params.gemm_min_n, gemm_min_n_quant, read at init) */
        check_switch_points("default");
        on_backend(&(st_backend_params){.gemm_min_n = 2, .gemm_min_n_quant = 2}, check_switch_points,
                   "gemm_min_n = 2, gemm_min_n_quant = 2");
        on_backend(&(st_backend_params){.gemm_min_n = 16, .gemm_min_n_quant = 33}, check_switch_points,
                   "gemm_min_n = 16, gemm_min_n_quant = 33");
        /* programmatic dependent launch off (st_backend_params.pdl = -1) */
        on_backend(&(st_backend_params){.pdl = -1}, check_decode_path, "pdl = -1 (off)");
        check_backend_params();
    }

    check_attention_kernels();
    on_backend(&(st_backend_params){.paged_dec = 1}, check_paged_decode, "paged_dec 1 (a block per item)");
    on_backend(&(st_backend_params){.paged_dec = 2}, check_paged_decode, "paged_dec 2 (a warp per item)");
    check_attention_part_modes();
    check_attn_merge(1 * 32, 128);
    check_attn_merge(8 * 9, 64);
    check_attn_merge(3, 200);
    /* fast-mode prefill attention: the FA2 kernel in its default configuration
     * (auto: per call), then in every configuration (st_backend_params.attn_fa2,
     * read at init; cuda_attn_prefill_fa2.cuh), on the same cases */
    check_attention_fast("fa2 auto (default)");
    static const char *const fa2_vars[][2] = {{"b128w8", "fa2 b128w8 (attn_fa2 = b128w8)"},
                                              {"b128w8r", "fa2 b128w8r (attn_fa2 = b128w8r)"},
                                              {"b128w4", "fa2 b128w4 (attn_fa2 = b128w4)"},
                                              {"b256w8", "fa2 b256w8 (attn_fa2 = b256w8)"},
                                              {"wgmma", "wgmma (attn_fa2 = wgmma; FA2 where it does not apply)"},
                                              {"wgmma-pp", "wgmma with turns (attn_fa2 = wgmma-pp)"}};
    for (size_t i = 0; i < sizeof fa2_vars / sizeof fa2_vars[0]; i++)
        on_backend(&(st_backend_params){.attn_fa2 = fa2_vars[i][0]}, check_attention_fast, fa2_vars[i][1]);
    /* attention_part's pieces (causal and not) on the Hopper kernel with its
     * turns and on FA2 (the default backend above ran the auto choice) */
    on_backend(&(st_backend_params){.attn_fa2 = "wgmma-pp"}, check_attention_part_fast, "attn_fa2 = wgmma-pp");
    on_backend(&(st_backend_params){.attn_fa2 = "b128w8r"}, check_attention_part_fast, "attn_fa2 = b128w8r (FA2)");
    if (!only_attn) check_models();

    g_gpu->ops->stream_destroy(g_gpu, g_s);
    /* what remains is the default stream's scratch (one matmul ran on it) */
    const size_t left = g_gpu->device_budget.used, peak = g_gpu->device_budget.peak;
    st_backend_free(g_gpu);
    st_backend_free(g_cpu);
    printf("device memory: peak %.1f MiB, %.1f MiB held by the default stream's scratch at the end; %.1f s\n",
           (double)peak / 1048576.0, (double)left / 1048576.0, st_time_now() - g_t0);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

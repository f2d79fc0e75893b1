/* strata bench MODEL: prefill and decode speed, each beside its roofline
 * measured in the same run.
 *
 * CPU backend: decode is bounded by reading every weight byte (and the KV
 * cache) once per token from DRAM, so the floor is
 *     (weight bytes read per token + KV bytes) / measured DRAM read bandwidth,
 * with the bandwidth measured here by the same number of threads summing a
 * buffer much larger than the caches. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "common.h"
#include "core/pool.h"

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: strata bench MODEL [--prompt N] [--gen N] [--reps N] [options]\n"
            "Times a prefill of N random prompt tokens and N greedy decode steps, and prints\n"
            "each beside its roofline measured in the same run.\n\n"
            "  --prompt N       prompt tokens (default 128)\n"
            "  --gen N          decode steps (default 64)\n"
            "  --reps N         timed prefills, the best one reported (default 3)\n"
            "  --fast-prefill   bf16-rounded operands in prefill's tensor-core matmuls and attention\n"
            "                   (about twice as fast, ~1e-2 relative error; default: hi+lo split, ~1e-5)\n"
            "  --prefill-only   one prefill and nothing else (no warm-up, rooflines or decode): for profilers\n"
            "  (here --batch defaults to the prompt length, up to 4096: the prompt in one chunk)\n"
            TOOL_MODEL_OPTS_HELP);
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

/* Best-of-5 read bandwidth (bytes/s) of `bytes` of host memory with the pool. */
static double measure_read_bw(st_pool *pool, size_t bytes) {
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

/* Device memory bandwidth (bytes read + written per second): best of 5 copies
 * of a 1 GiB buffer with the backend's own copy, timed to completion. */
static double measure_device_copy_bw(st_backend *be, st_stream *s) {
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

/* Matrix rate (FLOP/s) of the backend's matmul on a random bf16 [dim, dim]
 * weight with `n` tokens, best of 3 after a warm-up: the GEMM a prefill runs.
 * fast: one bf16 GEMM (the tensor cores' rate, the roofline); else the
 * default precise path (two GEMMs for bf16 weights). */
static double measure_matmul_rate(st_backend *be, st_stream *s, int64_t dim, int64_t n, bool fast) {
    void *w = NULL, *x = NULL, *y = NULL;
    double best = 0;
    if (be->ops->alloc(be, (size_t)(dim * dim) * 2, &w) ||
        be->ops->alloc(be, (size_t)(n * dim) * 4, &x) || be->ops->alloc(be, (size_t)(n * dim) * 4, &y))
        goto out;
    if (!fill_random(be, s, w, (size_t)(dim * dim) * 2, true) || !fill_random(be, s, x, (size_t)(n * dim) * 4, false))
        goto out;
    be->ops->set_fast_prefill(be, fast);
    st_weight wt = {w, ST_DTYPE_BF16, dim, dim};
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

/* For a CUDA run (as the model options select it): HBM bandwidth (copy) and the
 * matmul rate in both prefill precisions, on a temporary backend with a 3 GiB
 * pool, destroyed before the model loads. Nothing to do for the CPU. */
static bool measure_device_rooflines(const tool_model_opts *mo, double *bw, double *rate_fast,
                                     double *rate_precise) {
    const char *dev = mo->device ? mo->device : "auto";
    bool cuda = !strcmp(dev, "cuda") || (!strcmp(dev, "auto") && st_backend_available(ST_BACKEND_CUDA));
    if (!cuda) return true;
    st_backend_params bp = {.kind = ST_BACKEND_CUDA, .device_mem = (size_t)3 << 30};
    st_backend *be = NULL;
    st_stream *st = NULL;
    bool ok = false;
    if (st_backend_init(&bp, &be) != STRATA_OK || be->ops->stream_create(be, false, &st) != STRATA_OK) {
        tool_print_error("bench");
        goto out;
    }
    /* HBM bandwidth: bytes read + written per second by a large copy (a decode
     * step's GEMVs stream at about that rate, reads only) */
    *bw = measure_device_copy_bw(be, st);
    *rate_fast = measure_matmul_rate(be, st, 8192, 4096, true);
    *rate_precise = measure_matmul_rate(be, st, 8192, 4096, false);
    ok = *bw > 0 && *rate_fast > 0 && *rate_precise > 0;
    if (!ok) tool_print_error("bench (roofline probes)");
out:
    if (st) be->ops->stream_destroy(be, st);
    st_backend_free(be);
    return ok;
}

static int argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int)b;
}

int cmd_bench(int argc, char **argv) {
    tool_model_opts mo = {0};
    const char *path = NULL;
    int64_t n_prompt = 128, n_gen = 64, reps = 3;
    bool fast = false, prefill_only = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int r = tool_parse_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--prompt")) {
            if (!tool_parse_i64(val, 1, 1 << 20, "--prompt", &n_prompt)) return 2;
            i++;
        } else if (!strcmp(a, "--gen")) {
            if (!tool_parse_i64(val, 1, 1 << 20, "--gen", &n_gen)) return 2;
            i++;
        } else if (!strcmp(a, "--reps")) {
            if (!tool_parse_i64(val, 1, 1000, "--reps", &reps)) return 2;
            i++;
        } else if (!strcmp(a, "--fast-prefill")) {
            fast = true;
        } else if (!strcmp(a, "--prefill-only")) {
            prefill_only = true;
        } else if (!tool_take_positional("bench", a, &path, bench_usage)) {
            return 2;
        }
    }
    if (!path) {
        bench_usage(stderr);
        return 2;
    }
    if (mo.ctx == 0) mo.ctx = n_prompt + (n_gen > 2 ? n_gen : 2);
    /* the prompt in one forward chunk unless --batch says otherwise (up to 4096 tokens) */
    if (mo.batch == 0) mo.batch = n_prompt < 4096 ? n_prompt : 4096;
    /* Device rooflines first, on a probe backend of their own: the engine's
     * backend may be filled to its --device-mem budget once the model is in. */
    double probe_bw = 0, probe_rate = 0, probe_rate_precise = 0;
    if (!measure_device_rooflines(&mo, &probe_bw, &probe_rate, &probe_rate_precise)) return 1;
    tool_model tm;
    if (!tool_model_open(path, &mo, &tm)) return 1;
    st_wm_stats ws; /* weight streaming: timings start once the host tier is pinned */
    tool_weights_settle(&tm, &ws);
    const st_config *c = &tm.files->config;
    const int64_t V = c->vocab_size;
    const bool on_cpu = tm.be->kind == ST_BACKEND_CPU;
    st_backend *be = tm.be;
    be->ops->set_fast_prefill(be, fast);

    /* bytes a decode step reads: every matrix once; the embedding table only
     * one row unless it doubles as lm_head */
    uint64_t weight_bytes = 0;
    for (int64_t i = 0; i < tm.files->n_tensors; i++) {
        const st_tensor_desc *t = &tm.files->tensors[i];
        if (!strcmp(t->name, "model.embed_tokens.weight") && !c->tie_word_embeddings)
            weight_bytes += t->nbytes / (uint64_t)V;
        else
            weight_bytes += t->nbytes;
    }
    const double kv_row = (double)(c->n_kv_heads * c->head_dim) * 2 * sizeof(float) * (double)c->n_layers;

    int32_t *ids = malloc((size_t)(n_prompt + n_gen) * sizeof(int32_t));
    float *logits = malloc((size_t)V * sizeof(float));
    int rc = 1;
    if (!ids || !logits) goto done;
    uint32_t s = 7;
    for (int64_t i = 0; i < n_prompt; i++) {
        s = s * 1664525u + 1013904223u;
        ids[i] = (int32_t)((s >> 8) % (uint32_t)V);
    }
    if (prefill_only) {
        double t0 = st_time_now();
        if (st_llama_forward(tm.model, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
        printf("prefill      %lld tokens in %.4f s (one pass, no warm-up)\n", (long long)n_prompt,
               st_time_now() - t0);
        rc = 0;
        goto done;
    }
    /* warm-up: a whole prefill (matmul plans, scratch sizes, kernels loaded)
     * and two decode steps (the second records the decode graph); then the
     * timed prefills, each from an empty cache */
    if (st_llama_forward(tm.model, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
    int32_t next = argmax(logits, V);
    for (int i = 0; i < 2; i++)
        if (st_llama_decode(tm.model, next, NULL, &next) != STRATA_OK) goto fail;
    double t_prefill = 1e30;
    for (int64_t r = 0; r < reps; r++) {
        st_llama_reset(tm.model);
        double t0 = st_time_now();
        if (st_llama_forward(tm.model, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
        const double t = st_time_now() - t0;
        if (t < t_prefill) t_prefill = t;
    }
    /* greedy decode with the argmax on the device: no logits cross to the host */
    next = argmax(logits, V);
    tool_weights_settle(&tm, &ws);
    double t0 = st_time_now();
    for (int64_t g = 0; g < n_gen; g++) {
        ids[n_prompt + g] = next;
        if (st_llama_decode(tm.model, next, NULL, &next) != STRATA_OK) goto fail;
    }
    double t_decode = st_time_now() - t0;
    const size_t peak = be->device_budget.peak;

    double bw = 0, gemm_rate = 0, gemm_rate_precise = 0, t_prefill_other = 0;
    int n_threads = 0;
    size_t probe = 0;
    if (on_cpu) {
        st_pool *pool = NULL;
        if (st_pool_init(mo.threads > 0 ? mo.threads : 0, &pool) != STRATA_OK) goto fail;
        probe = 4 * (size_t)weight_bytes;
        if (probe < ((size_t)1 << 30)) probe = (size_t)1 << 30;
        bw = measure_read_bw(pool, probe);
        n_threads = st_pool_threads(pool);
        st_pool_free(pool);
    } else {
        /* the prefill in the other precision, for comparison (second run timed) */
        be->ops->set_fast_prefill(be, !fast);
        for (int r = 0; r < 2; r++) {
            st_llama_reset(tm.model);
            double t1 = st_time_now();
            if (st_llama_forward(tm.model, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
            t_prefill_other = st_time_now() - t1;
        }
        be->ops->set_fast_prefill(be, fast);
        bw = probe_bw;
        gemm_rate = probe_rate;
        gemm_rate_precise = probe_rate_precise;
        if (bw <= 0 || gemm_rate <= 0) goto fail;
    }

    const double avg_ctx = (double)n_prompt + (double)n_gen / 2.0;
    const double step_bytes = (double)weight_bytes + avg_ctx * kv_row;
    const double floor_s = step_bytes / bw;
    const double step_s = t_decode / (double)n_gen;
    printf("model        %s (%s, %.1f MB of weights read per decode step)\n", tm.files->path, be->ops->name,
           weight_bytes / 1e6);
    if (on_cpu) {
        printf("threads      %d\n", n_threads);
        printf("memory read  %.2f GB/s (measured now, %d threads, %.0f MB buffer)\n", bw / 1e9, n_threads,
               probe / 1e6);
        printf("prefill      %lld tokens in %.3f s: %.1f tok/s\n", (long long)n_prompt, t_prefill,
               (double)n_prompt / t_prefill);
    } else {
        printf("HBM          %.0f GB/s (device-to-device copy of 1 GiB, bytes read + written, measured now)\n",
               bw / 1e9);
        printf("matmul rate  %.0f TFLOP/s (one bf16 GEMM, 8192x8192 random weight x 4096 tokens, measured now);"
               " the precise path (x = hi + lo, two GEMMs) gives %.0f TFLOP/s of useful work\n",
               gemm_rate / 1e12, gemm_rate_precise / 1e12);
        /* prefill FLOPs: 2 per weight element per token for the layers' matrices,
         * lm_head for the last token only (the one whose logits are computed),
         * attention 2 x 2 x heads x head_dim per (query, key) pair, causal */
        double mat_flops = 0;
        for (int64_t i = 0; i < tm.files->n_tensors; i++) {
            const st_tensor_desc *t = &tm.files->tensors[i];
            if (t->n_dims == 2 && strcmp(t->name, "model.embed_tokens.weight") && strcmp(t->name, "lm_head.weight"))
                mat_flops += 2.0 * (double)t->shape[0] * (double)t->shape[1];
        }
        const double head_flops = 2.0 * (double)V * (double)c->hidden_size;
        const double attn_flops = 2.0 * 2.0 * (double)c->n_heads * (double)c->head_dim * (double)n_prompt *
                                  ((double)n_prompt + 1.0) / 2.0 * (double)c->n_layers;
        const double flops = (double)n_prompt * mat_flops + head_flops + attn_flops;
        const double pf_floor = flops / gemm_rate;
        printf("roofline     prefill floor %.4f s = %.2f TFLOP (matrices %.2f, attention %.2f, lm_head of the last"
               " token) / %.0f TFLOP/s -> %.0f tok/s\n",
               pf_floor, flops / 1e12, (double)n_prompt * mat_flops / 1e12, attn_flops / 1e12, gemm_rate / 1e12,
               (double)n_prompt / pf_floor);
        for (int m = 0; m < 2; m++) {
            const bool f = m == 0 ? fast : !fast;
            const double t = m == 0 ? t_prefill : t_prefill_other;
            printf("prefill      %lld tokens in %.4f s (chunks of %lld): %.0f tok/s (%s); reached %.0f%% of the floor\n",
                   (long long)n_prompt, t, (long long)mo.batch, (double)n_prompt / t,
                   f ? "fast: bf16 operands, ~1e-2 error" : "precise: hi+lo bf16 operands, ~1e-5 error",
                   100.0 * pf_floor / t);
        }
    }
    printf("decode       %lld tokens in %.3f s: %.2f tok/s, %.3f ms/token (steps: %s; greedy, argmax on the "
           "device)\n", (long long)n_gen, t_decode, (double)n_gen / t_decode, step_s * 1e3,
           st_llama_decode_mode(tm.model));
    printf("roofline     decode floor %.3f ms/token = %.1f MB (weights + KV at context %.0f) / %.2f GB/s "
           "-> %.1f tok/s; reached %.0f%%\n",
           floor_s * 1e3, step_bytes / 1e6, avg_ctx, bw / 1e9, 1.0 / floor_s, 100.0 * floor_s / step_s);
    printf("device mem   peak %.1f MB of backend allocations (%sKV cache, activations, scratch)\n", peak / 1e6,
           on_cpu ? "" : "weights, ");
    tool_print_weights(&tm, &ws, n_gen, step_s, n_prompt, t_prefill);
    rc = 0;
    goto done;
fail:
    tool_print_error("bench");
done:
    free(ids);
    free(logits);
    tool_model_close(&tm);
    return rc;
}

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
            "  --prompt N   prompt tokens (default 128)\n"
            "  --gen N      decode steps (default 64)\n"
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

/* Matrix rate (FLOP/s) of the backend's matmul on a bf16 [dim, dim] weight with
 * `n` tokens: the path a prefill takes. */
static double measure_matmul_rate(st_backend *be, st_stream *s, int64_t dim, int64_t n) {
    void *w = NULL, *x = NULL, *y = NULL;
    double best = 0;
    if (be->ops->alloc(be, (size_t)(dim * dim) * 2, &w) ||
        be->ops->alloc(be, (size_t)(n * dim) * 4, &x) || be->ops->alloc(be, (size_t)(n * dim) * 4, &y))
        goto out;
    /* zero weights and inputs: the rate does not depend on the values */
    {
        size_t chunk = (size_t)1 << 24;
        void *zero = calloc(1, chunk);
        if (!zero) goto out;
        for (size_t off = 0; off < (size_t)(dim * dim) * 2; off += chunk) {
            size_t k = (size_t)(dim * dim) * 2 - off < chunk ? (size_t)(dim * dim) * 2 - off : chunk;
            be->ops->copy_h2d(be, s, (char *)w + off, zero, k);
        }
        for (size_t off = 0; off < (size_t)(n * dim) * 4; off += chunk) {
            size_t k = (size_t)(n * dim) * 4 - off < chunk ? (size_t)(n * dim) * 4 - off : chunk;
            be->ops->copy_h2d(be, s, (char *)x + off, zero, k);
        }
        be->ops->stream_sync(be, s);
        free(zero);
    }
    st_weight wt = {w, ST_DTYPE_BF16, dim, dim};
    for (int r = 0; r < 4; r++) {
        double t0 = st_time_now();
        if (be->ops->matmul(be, s, x, &wt, n, y) || be->ops->stream_sync(be, s)) goto out;
        double rate = 2.0 * (double)dim * (double)dim * (double)n / (st_time_now() - t0);
        if (r > 0 && rate > best) best = rate;
    }
out:
    if (w) be->ops->dealloc(be, w);
    if (x) be->ops->dealloc(be, x);
    if (y) be->ops->dealloc(be, y);
    return best;
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
    int64_t n_prompt = 128, n_gen = 64;
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
        } else if (a[0] == '-') {
            fprintf(stderr, "strata bench: unknown option '%s'\n", a);
            bench_usage(stderr);
            return 2;
        } else if (!path) {
            path = a;
        } else {
            fprintf(stderr, "strata bench: unexpected argument '%s'\n", a);
            return 2;
        }
    }
    if (!path) {
        bench_usage(stderr);
        return 2;
    }
    if (mo.ctx == 0) mo.ctx = n_prompt + n_gen;
    tool_model tm;
    if (!tool_model_open(path, &mo, &tm)) return 1;
    const st_config *c = &tm.files->config;
    const int64_t V = c->vocab_size;

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
    /* warm-up: page the weights in, then start over */
    if (st_llama_forward(tm.model, ids, 1, 0, false, logits) != STRATA_OK) goto fail;
    st_llama_reset(tm.model);

    double t0 = st_time_now();
    if (st_llama_forward(tm.model, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
    double t_prefill = st_time_now() - t0;
    ids[n_prompt] = argmax(logits, V);
    t0 = st_time_now();
    for (int64_t g = 0; g < n_gen; g++) {
        if (st_llama_forward(tm.model, ids + n_prompt + g, 1, n_prompt + g, false, logits) != STRATA_OK)
            goto fail;
        if (g + 1 < n_gen) ids[n_prompt + g + 1] = argmax(logits, V);
    }
    double t_decode = st_time_now() - t0;

    const bool on_cpu = tm.be->kind == ST_BACKEND_CPU;
    double bw = 0, gemm_rate = 0;
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
        st_stream *s = NULL;
        if (tm.be->ops->stream_create(tm.be, false, &s) != STRATA_OK) goto fail;
        /* HBM bandwidth: bytes read + written per second by a large copy
         * (a decode step's GEMVs stream at about that rate, reads only) */
        bw = measure_device_copy_bw(tm.be, s);
        gemm_rate = measure_matmul_rate(tm.be, s, 8192, 4096);
        tm.be->ops->stream_destroy(tm.be, s);
        if (bw <= 0 || gemm_rate <= 0) goto fail;
    }

    const double avg_ctx = (double)n_prompt + (double)n_gen / 2.0;
    const double step_bytes = (double)weight_bytes + avg_ctx * kv_row;
    const double floor_s = step_bytes / bw;
    const double step_s = t_decode / (double)n_gen;
    printf("model        %s (%s, %.1f MB of weights read per decode step)\n", tm.files->path,
           tm.be->ops->name, weight_bytes / 1e6);
    if (on_cpu) {
        printf("threads      %d\n", n_threads);
        printf("memory read  %.2f GB/s (measured now, %d threads, %.0f MB buffer)\n", bw / 1e9, n_threads,
               probe / 1e6);
    } else {
        printf("HBM          %.0f GB/s (device-to-device copy of 1 GiB, bytes read + written, measured now)\n",
               bw / 1e9);
        printf("matmul rate  %.0f TFLOP/s (backend matmul, bf16 8192x8192 weight, 4096 tokens)\n",
               gemm_rate / 1e12);
        /* prefill: matrix FLOPs (2 per weight element per token) + attention (causal) */
        double mat_flops = 0;
        for (int64_t i = 0; i < tm.files->n_tensors; i++) {
            const st_tensor_desc *t = &tm.files->tensors[i];
            if (t->n_dims == 2 && strcmp(t->name, "model.embed_tokens.weight"))
                mat_flops += 2.0 * (double)t->shape[0] * (double)t->shape[1];
        }
        if (c->tie_word_embeddings) mat_flops += 2.0 * (double)V * (double)c->hidden_size;
        const double attn_flops = 2.0 * 2.0 * (double)c->n_heads * (double)c->head_dim *
                                  (double)n_prompt * (double)n_prompt / 2.0 * (double)c->n_layers;
        const double pf_floor = ((double)n_prompt * mat_flops + attn_flops) / gemm_rate;
        printf("roofline     prefill floor %.4f s = %.2f TFLOP / %.0f TFLOP/s -> %.0f tok/s; reached %.0f%%\n",
               pf_floor, ((double)n_prompt * mat_flops + attn_flops) / 1e12, gemm_rate / 1e12,
               (double)n_prompt / pf_floor, 100.0 * pf_floor / t_prefill);
    }
    printf("prefill      %lld tokens in %.3f s: %.1f tok/s\n", (long long)n_prompt, t_prefill,
           (double)n_prompt / t_prefill);
    printf("decode       %lld tokens in %.3f s: %.2f tok/s, %.2f ms/token\n", (long long)n_gen, t_decode,
           (double)n_gen / t_decode, step_s * 1e3);
    printf("roofline     decode floor %.2f ms/token = %.1f MB (weights + KV at context %.0f) / %.2f GB/s "
           "-> %.1f tok/s; reached %.0f%%\n",
           floor_s * 1e3, step_bytes / 1e6, avg_ctx, bw / 1e9, 1.0 / floor_s, 100.0 * floor_s / step_s);
    printf("device mem   peak %.1f MB of backend allocations (KV cache + activations)\n",
           tm.be->device_budget.peak / 1e6);
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

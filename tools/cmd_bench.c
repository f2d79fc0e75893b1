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
#include "backend/cpu/cpu_internal.h"
#include "core/pool.h"
#include "roofline.h"

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: strata bench MODEL [--prompt N] [--gen N] [--reps N] [options]\n"
            "Times a prefill of N random prompt tokens and N greedy decode steps, and prints\n"
            "each beside its roofline measured in the same run.\n\n"
            "  --prompt N       prompt tokens (default 128)\n"
            "  --gen N          decode steps (default 64)\n"
            "  --reps N         timed prefills, the best one reported (default 3)\n"
            "  --prefill-only   one prefill and nothing else (no warm-up, rooflines or decode): for profilers\n"
            "  --seqs B[,B...]  then decode B sequences at once (e.g. 1,8,32), one token each per pass:\n"
            "                   --gen steps each (the first a warm-up), tok/s beside the bound\n"
            "  --seq-prompt N   prompt tokens of each of those sequences (default 32)\n"
            "  --verify K[,K...]  then the cost of a speculative verification pass: the sequence's\n"
            "                   token and K drafts in one pass, the logits of every row to the host,\n"
            "                   beside a one-token decode step\n"
            "  --op-times       CPU: then a prefill, --gen decode steps (and each --verify pass) again, every\n"
            "                   op timed: per op and shape, calls, us per call, ms per step, share of\n"
            "                   the step, the matmuls' GB/s of weights; and the time outside the ops\n"
            "  --kv-stream      the sequence's KV in host memory, streamed through the device layer by\n"
            "                   layer (contexts longer than the device, up to 1M tokens): one prefill\n"
            "                   and --gen decode steps, beside their rooflines, and the device memory peak;\n"
            "                   also chosen when the KV of --ctx tokens takes over half of --device-mem\n"
            "  --kv-stream-mem SIZE  with a streamed KV: the host memory it takes at most, in whole segments\n"
            "                   (default 3/4 of the memory available; more than is available is refused)\n"
            "  --kv-ssd-dir DIR     with a streamed KV: past --kv-stream-mem, whole segments go to a private\n"
            "                   file in DIR (unlinked; --kv-ssd-size caps it); the decode's floor then counts\n"
            "                   the SSD's share at the file's read rate, measured after the run\n"
            "  --kv-segment N   tokens per host / SSD segment (a power of two from 4096; default 65536)\n"
            "  --kv-cpu-attn auto|F  with a streamed KV: the decode attends share F of the earlier keys on the\n"
            "                   CPU from host memory (auto: planned from rates measured at the first pass)\n"
            "  (--kv-offload and --kv-host-mem, the prefix cache's tiers, are for run and serve)\n"
            "  (here --batch defaults to the prompt length, up to 4096: the prompt in one chunk;\n"
            "  on CUDA the prefill is also timed in the other precision, --precise or --fast-prefill)\n"
            TOOL_MODEL_OPTS_HELP);
}

static int argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int)b;
}

/* One greedy decode step of the single sequence in tm->kv: `tok` at
 * position `pos`, the next token drawn on the device (temperature 0). */
static strata_status decode_one(tool_model *tm, int32_t tok, int64_t pos, int32_t *next) {
    const int64_t bs = st_kv_pool_block_size(tm->kv), nb = pos / bs + 1;
    int32_t table[nb > 0 ? nb : 1];
    for (int64_t b = 0; b < nb; b++) table[b] = (int32_t)b;
    const int32_t p = (int32_t)pos, seq = 0, ctx = (int32_t)(pos + 1), row = 0;
    const int64_t slot = pos;
    const st_sample_args greedy = {.temperature = 0.0f, .top_p = 1.0f};
    const st_batch b = {.n_tokens = 1, .tokens = &tok, .pos = &p, .seq = &seq, .slots = &slot, .n_seqs = 1,
                        .block_tables = table, .max_blocks = nb, .ctx_lens = &ctx, .logit_rows = &row, .n_logits = 1};
    return st_llama_forward_sample(tm->model, tm->kv, &b, &greedy, next, NULL);
}

/* A speculative verification pass of the single sequence: its token and k drafts at positions
 * pos .. pos + k, the logits of every row to the host (logits: [k + 1, V]). */
static strata_status verify_pass(tool_model *tm, const int32_t *toks, int64_t k, int64_t pos, float *logits) {
    const int64_t n = k + 1, bs = st_kv_pool_block_size(tm->kv), nb = (pos + n - 1) / bs + 1;
    int32_t table[nb], p[n], seq[n], rows[n];
    int64_t slots[n];
    for (int64_t b = 0; b < nb; b++) table[b] = (int32_t)b;
    for (int64_t i = 0; i < n; i++) {
        p[i] = (int32_t)(pos + i);
        seq[i] = 0;
        rows[i] = (int32_t)i;
        slots[i] = pos + i;
    }
    const int32_t ctx = (int32_t)(pos + n);
    const st_batch b = {.n_tokens = n, .tokens = toks, .pos = p, .seq = seq, .slots = slots, .n_seqs = 1,
                        .block_tables = table, .max_blocks = nb, .ctx_lens = &ctx, .logit_rows = rows, .n_logits = n};
    return st_llama_forward(tm->model, tm->kv, &b, logits);
}

/* ---- decode of several sequences at once (--seqs) ----------------------------------
 * Sequence s (of the largest batch) has its own random prompt of P tokens
 * (the same in every batch size) and the blocks [s * bps, (s + 1) * bps) of
 * one paged pool. For each batch size B: the B prompts are prefilled through
 * st_llama_forward (whole sequences packed into passes of at most
 * max_tokens tokens), then `gen` greedy steps run the B sequences together,
 * one token each per pass (the first step is a warm-up, the next
 * gen are timed). The greedy choice is the backend's sample op (temperature
 * 0: the argmax), so only token ids come back, as when serving. */

typedef struct {
    st_kv_pool *kv;
    int64_t P, gen, bps, bs, maxB;
    int32_t *toks;       /* [maxB, P + gen + 1]: prompt, then the generated tokens */
    bool *have;          /* [maxB]: toks of s hold a previous batch's output */
    int64_t mismatch;    /* sequences whose tokens differ from a smaller batch's */
    int64_t compared;
} seqs_state;

static strata_status seqs_forward(st_llama *m, seqs_state *S, int64_t n, const int32_t *tokens, const int32_t *pos,
                                  const int32_t *seq, int64_t n_seqs, const int32_t *ctx_lens, const int32_t *tables,
                                  const int32_t *logit_rows, int64_t n_logits, const st_sample_args *greedy,
                                  int32_t *ids, int64_t *slots) {
    for (int64_t i = 0; i < n; i++)
        slots[i] = (int64_t)tables[seq[i] * S->bps + pos[i] / S->bs] * S->bs + pos[i] % S->bs;
    const st_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq = seq, .slots = slots, .n_seqs = n_seqs,
                        .block_tables = tables, .max_blocks = S->bps, .ctx_lens = ctx_lens,
                        .logit_rows = logit_rows, .n_logits = n_logits};
    return st_llama_forward_sample(m, S->kv, &b, greedy, ids, NULL);
}

/* One batch size: fills *step_s (seconds per decode step). */
static strata_status seqs_run(tool_model *tm, seqs_state *S, int64_t B, double *step_s) {
    st_llama *m = tm->model;
    const int64_t T = st_llama_max_tokens(m), W = S->P + S->gen + 1;
    const int64_t cap = T > B ? T : B;
    int32_t *tok = malloc((size_t)cap * 4), *pos = malloc((size_t)cap * 4), *seq = malloc((size_t)cap * 4);
    int32_t *ctx = malloc((size_t)B * 4), *tab = malloc((size_t)(B * S->bps) * 4), *rows = malloc((size_t)B * 4);
    int64_t *slots = malloc((size_t)cap * 8);
    st_sample_args *greedy = calloc((size_t)cap, sizeof *greedy); /* temperature 0: argmax */
    int32_t *ids = malloc((size_t)cap * 4);
    int32_t *out = malloc((size_t)(B * (S->gen + 1)) * 4);
    strata_status st = STRATA_OK;
    if (!tok || !pos || !seq || !ctx || !tab || !rows || !slots || !greedy || !ids || !out) {
        st = st_err(STRATA_ERR_NOMEM, "bench --seqs: out of memory for the batch of %lld tokens", (long long)cap);
        goto out;
    }
    for (int64_t i = 0; i < cap; i++) greedy[i].top_p = 1.0f; /* neutral; temperature 0 decides */
    for (int64_t s = 0; s < B; s++)
        for (int64_t j = 0; j < S->bps; j++) tab[s * S->bps + j] = (int32_t)(s * S->bps + j);
    /* prefill: whole prompts packed into batches of at most T tokens */
    for (int64_t s0 = 0; s0 < B && st == STRATA_OK;) {
        int64_t n = 0, ns = 0, nl = 0;
        while (s0 + ns < B && n + S->P <= T) {
            const int64_t s = s0 + ns;
            for (int64_t j = 0; j < S->P; j++) {
                tok[n] = S->toks[s * W + j];
                pos[n] = (int32_t)j;
                seq[n] = (int32_t)ns;
                n++;
            }
            ctx[ns] = (int32_t)S->P;
            rows[nl++] = (int32_t)(n - 1);
            ns++;
        }
        st = seqs_forward(m, S, n, tok, pos, seq, ns, ctx, tab + s0 * S->bps, rows, nl, greedy, ids, slots);
        for (int64_t r = 0; r < nl && st == STRATA_OK; r++) out[(s0 + r) * (S->gen + 1)] = ids[r];
        s0 += ns;
    }
    /* decode: a warm-up step, then gen timed ones */
    double t0 = 0;
    for (int64_t g = 0; g < S->gen && st == STRATA_OK; g++) {
        if (g == 1) t0 = st_time_now();
        for (int64_t s = 0; s < B; s++) {
            tok[s] = out[s * (S->gen + 1) + g];
            pos[s] = (int32_t)(S->P + g);
            seq[s] = (int32_t)s;
            ctx[s] = (int32_t)(S->P + g + 1);
            rows[s] = (int32_t)s;
        }
        st = seqs_forward(m, S, B, tok, pos, seq, B, ctx, tab, rows, B, greedy, ids, slots);
        for (int64_t s = 0; s < B && st == STRATA_OK; s++) out[s * (S->gen + 1) + g + 1] = ids[s];
    }
    *step_s = S->gen > 1 ? (st_time_now() - t0) / (double)(S->gen - 1) : 0;
    /* the same sequence in a smaller batch generated the same tokens? */
    for (int64_t s = 0; s < B && st == STRATA_OK; s++) {
        int32_t *mine = S->toks + s * W + S->P;
        if (S->have[s]) {
            S->compared++;
            if (memcmp(mine, out + s * (S->gen + 1), (size_t)(S->gen + 1) * 4)) S->mismatch++;
        } else {
            memcpy(mine, out + s * (S->gen + 1), (size_t)(S->gen + 1) * 4);
            S->have[s] = true;
        }
    }
out:
    free(tok);
    free(pos);
    free(seq);
    free(ctx);
    free(tab);
    free(rows);
    free(slots);
    free(greedy);
    free(ids);
    free(out);
    return st;
}

/* Runs every batch size of `list` and prints a line for each beside its
 * bound: streamed weights: the plan's decode step (the weights cross PCIe /
 * come from the SSD once per step whatever the batch); resident: weights +
 * the batch's KV over the memory bandwidth `bw`. */
static bool seqs_bench(tool_model *tm, const int64_t *list, int n_list, int64_t P, int64_t gen, double bw,
                       uint64_t weight_bytes) {
    st_llama *m = tm->model;
    const st_config *c = &tm->files->config;
    seqs_state S = {0};
    S.P = P;
    S.gen = gen;
    S.kv = tm->kv; /* tool_model_open made it for maxB sequences of the context */
    S.bs = st_kv_pool_block_size(S.kv);
    S.bps = st_kv_pool_max_blocks(S.kv);
    for (int i = 0; i < n_list; i++)
        if (list[i] > S.maxB) S.maxB = list[i];
    const int64_t W = P + gen + 1, V = c->vocab_size;
    S.toks = calloc((size_t)(S.maxB * W), 4);
    S.have = calloc((size_t)S.maxB, sizeof *S.have);
    bool ok = S.toks && S.have;
    uint32_t x = 99;
    for (int64_t i = 0; ok && i < S.maxB * W; i++) {
        x = x * 1664525u + 1013904223u;
        S.toks[i] = (int32_t)((x >> 8) % (uint32_t)V);
    }
    if (ok && st_kv_pool_num_blocks(S.kv) < S.maxB * S.bps) {
        fprintf(stderr, "strata bench --seqs: the KV pool holds %lld blocks, %lld sequences need %lld\n",
                (long long)st_kv_pool_num_blocks(S.kv), (long long)S.maxB, (long long)(S.maxB * S.bps));
        ok = false;
    }
    st_wm *wm = st_llama_weights(m);
    const st_wplan *p = st_wm_plan(wm);
    const bool streamed = st_wm_streamed(wm) > 0;
    const double kv_tok = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim,
                                                     st_kv_pool_get_params(S.kv)->dtype);
    double tps1 = 0;
    for (int i = 0; ok && i < n_list; i++) {
        const int64_t B = list[i];
        double step = 0;
        if (seqs_run(tm, &S, B, &step) != STRATA_OK) {
            tool_print_error("bench --seqs");
            ok = false;
            break;
        }
        const double tps = step > 0 ? (double)B / step : 0;
        if (i == 0) tps1 = tps;
        double bound;
        char what[160];
        if (streamed) {
            bound = p->t_decode;
            snprintf(what, sizeof what, "%s: weights streamed once per step, SSD %.3f ms, PCIe %.3f ms",
                     st_wbound_name(p->decode_bound), p->t_ssd * 1e3, p->t_pcie * 1e3);
        } else {
            const double bytes = (double)weight_bytes + (double)B * ((double)P + (double)gen / 2) * kv_tok;
            bound = bw > 0 ? bytes / bw : 0;
            snprintf(what, sizeof what, "memory: %.1f MB of weights + KV / %.2f GB/s", bytes / 1e6, bw / 1e9);
        }
        printf("decode batch %3lld sequences x %lld steps (prompt %lld): %.3f ms/step, %.1f tok/s (%.2fx batch %lld); "
               "bound %.3f ms/step (%s): %.0f%%\n",
               (long long)B, (long long)(gen - 1), (long long)P, step * 1e3, tps, tps1 > 0 ? tps / tps1 : 0.0,
               (long long)list[0], bound * 1e3, what, step > 0 ? 100.0 * bound / step : 0.0);
    }
    if (ok && S.compared > 0)
        printf("decode batch tokens: %lld of %lld sequences generated the same tokens as in a smaller batch%s\n",
               (long long)(S.compared - S.mismatch), (long long)S.compared,
               S.mismatch ? " (CUDA: GEMV below 9 rows, tensor-core GEMM above: ~1e-5 apart, near-ties may flip)" : "");
    free(S.toks);
    free(S.have);
    return ok;
}

/* "1,8,32" -> list (each in [1, 4096]); false (message printed) otherwise. */
static bool parse_list(const char *v, int64_t *list, int *n) {
    *n = 0;
    char buf[256];
    if (!v || strlen(v) >= sizeof buf) {
        fprintf(stderr, "strata: --seqs needs a list like 1,8,32\n");
        return false;
    }
    strcpy(buf, v);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (*n == 16) {
            fprintf(stderr, "strata: --seqs: at most 16 batch sizes\n");
            return false;
        }
        if (!tool_parse_i64(t, 1, 4096, "--seqs", &list[*n])) return false;
        (*n)++;
    }
    if (*n == 0) fprintf(stderr, "strata: --seqs needs a list like 1,8,32\n");
    return *n > 0;
}

/* ---- --kv-stream: one sequence whose KV lives in host memory ------------------------- */

static double matrix_flops(const st_model_files *f) {
    double mat = 0;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const st_tensor_desc *t = &f->tensors[i];
        if (t->n_dims == 2 && strcmp(t->name, "model.embed_tokens.weight") && strcmp(t->name, "lm_head.weight"))
            mat += 2.0 * (double)t->shape[0] * (double)t->shape[1];
    }
    return mat;
}

/* Prefill n_prompt tokens, then n_gen greedy decode steps, through
 * st_llama_forward_stream; a warm-up pass of one chunk first (on a stream
 * reset afterwards). Prints each beside its floor: prefill FLOPs / the GEMM
 * rate; a decode step max(KV bytes from the host / H2D, weights / HBM), all
 * measured in this run; and the device memory peak. */
static bool stream_bench(tool_model *tm, const tool_model_opts *mo, int32_t *ids, int64_t n_prompt, int64_t n_gen,
                         const tool_rooflines *roof, uint64_t weight_bytes) {
    st_backend *be = tm->be;
    const st_config *c = &tm->files->config;
    const int64_t V = c->vocab_size;
    const size_t host_cap = tool_stream_params(mo, c).host_mem; /* --kv-stream-mem or its default */
    st_kv_stream_params sp = st_llama_stream_params(tm->model, n_prompt + n_gen, mo->kv_dtype, host_cap);
    sp.seg = mo->kv_segment;
    sp.ssd_dir = mo->kv_ssd_dir;
    sp.ssd_mem = mo->kv_ssd_size;
    st_kv_stream *ks = NULL;
    float *logits = malloc((size_t)V * sizeof(float));
    bool ok = false;
    if (!logits || st_kv_stream_init(be, &sp, &ks) != STRATA_OK) goto out;
    const double h2d = be->kind == ST_BACKEND_CPU ? 0 : tool_measure_h2d_bw(be, 0, 0);
    const int64_t T = st_llama_max_tokens(tm->model);
    if (st_llama_forward_stream(tm->model, ks, ids, n_prompt < T ? n_prompt : T, 0, false, logits) != STRATA_OK)
        goto out;
    st_kv_stream_reset(ks);
    double t0 = st_time_now();
    if (st_kv_stream_reserve(ks, n_prompt + n_gen) != STRATA_OK) goto out;
    const double t_pin = st_time_now() - t0;
    be->device_budget.peak = be->device_budget.used;
    fprintf(stderr, "strata bench: prefilling %lld tokens (KV: %.1f GB, to host memory%s)...\n", (long long)n_prompt,
            st_kv_stream_host_bytes(&sp, n_prompt + n_gen) / 1e9, sp.ssd_dir ? " and past its cap the SSD" : "");
    t0 = st_time_now();
    if (st_llama_forward_stream(tm->model, ks, ids, n_prompt, 0, false, logits) != STRATA_OK) goto out;
    const double t_prefill = st_time_now() - t0;
    uint64_t up0 = 0, up1 = 0;
    st_kv_stream_bytes(ks, &up0, NULL);
    st_kv_stream_ssd_stats ss0, ss1;
    st_kv_stream_ssd(ks, &ss0);
    t0 = st_time_now();
    for (int64_t g = 0; g < n_gen; g++) {
        int32_t next = argmax(logits, V);
        if (st_llama_forward_stream(tm->model, ks, &next, 1, 0, false, logits) != STRATA_OK) goto out;
    }
    const double t_decode = st_time_now() - t0;
    st_kv_stream_bytes(ks, &up1, NULL);
    st_kv_stream_ssd(ks, &ss1);
    double share = 0, cpu_bw = 0, cpu_h2d = 0; /* the decode's CPU part (--kv-cpu-attn) */
    st_llama_cpu_attn(tm->model, &share, &cpu_bw, &cpu_h2d);
    const int64_t cpu_keys = st_kv_stream_cpu_keys(ks); /* of the last step */
    const double cpu_step = (double)cpu_keys * (double)st_kv_stream_host_bytes(&sp, 1) /
                            (double)(sp.seg ? sp.seg : ST_KV_STREAM_SEG);
    double ssd_bw = 0; /* the SSD tier's read rate, on its own file, now */
    if (ss1.ssd_segs > 0 && st_kv_stream_ssd_probe(ks, &ssd_bw) != STRATA_OK) goto out;
    const size_t peak = be->device_budget.peak;
    const double attn = 2.0 * 2.0 * (double)c->n_heads * (double)c->head_dim * (double)n_prompt *
                        ((double)n_prompt + 1.0) / 2.0 * (double)c->n_layers;
    const double flops = (double)n_prompt * matrix_flops(tm->files) + 2.0 * (double)V * c->hidden_size + attn;
    const bool fast = tool_fast_prefill(mo, tm->files);
    const double rate = fast ? roof->gemm_fast : roof->gemm_precise;
    printf("model        %s (%s, KV %s streamed from host memory, pieces of %lld keys, passes of %lld tokens)\n",
           tm->files->path, be->ops->name, st_kv_dtype_name(sp.dtype), (long long)sp.piece, (long long)T);
    printf("context      %lld prompt + %lld generated tokens: %.2f GB of KV in host memory (allocated%s in %.1f s "
           "before the timed runs)\n", (long long)n_prompt, (long long)n_gen, st_kv_stream_host_used(ks) / 1e9,
           be->kind == ST_BACKEND_CPU ? "" : " and pinned", t_pin);
    if (sp.ssd_dir)
        printf("ssd tier     %lld of %lld segments of %lld tokens in a file in %s (%.1f MB written, %.1f MB read "
               "in prefill); %lld on the host (--kv-stream-mem)\n", (long long)ss1.ssd_segs,
               (long long)(ss1.ssd_segs + ss1.host_segs), (long long)(sp.seg ? sp.seg : ST_KV_STREAM_SEG), sp.ssd_dir,
               ss1.written / 1e6, ss0.read / 1e6, (long long)ss1.host_segs);
    if (rate > 0) {
        const double floor = flops / rate;
        printf("prefill      %lld tokens in %.2f s: %.0f tok/s (%s); floor %.2f s = %.1f TFLOP (attention %.1f) / "
               "%.0f TFLOP/s (GEMM, measured now): reached %.0f%%\n",
               (long long)n_prompt, t_prefill, n_prompt / t_prefill, fast ? "fast" : "precise", floor, flops / 1e12,
               attn / 1e12, rate / 1e12, 100.0 * floor / t_prefill);
    } else {
        printf("prefill      %lld tokens in %.2f s: %.1f tok/s\n", (long long)n_prompt, t_prefill,
               n_prompt / t_prefill);
    }
    if (ss0.read > 0 && ssd_bw > 0) /* every prefill pass reads the earlier segments in the file */
        printf("ssd prefill  %.1f MB read from the SSD tier in prefill at %.2f GB/s (the file's read rate, measured "
               "now): floor %.4f s, reached %.0f%%\n", ss0.read / 1e6, ssd_bw / 1e9, ss0.read / ssd_bw,
               100.0 * ss0.read / ssd_bw / t_prefill);
    const double step = t_decode / (double)n_gen, kv_step = (double)(up1 - up0) / (double)n_gen;
    const double ssd_step = (double)(ss1.read - ss0.read) / (double)n_gen;
    printf("decode       %lld tokens in %.3f s: %.3f s/token, %.2f tok/s; %.3f MB of KV up per token\n",
           (long long)n_gen, t_decode, step, 1.0 / step, kv_step / 1e6);
    if (ssd_step > 0)
        printf("ssd read     %.3f MB of that a token from the SSD tier at %.2f GB/s (the file's read rate, measured "
               "now): floor %.4f s/token, reached %.0f%%\n", ssd_step / 1e6, ssd_bw / 1e9,
               ssd_bw > 0 ? ssd_step / ssd_bw : 0.0, ssd_bw > 0 ? 100.0 * ssd_step / ssd_bw / step : 0.0);
    if (cpu_keys > 0)
        printf("cpu attn     the last step attended its oldest %lld keys (%.1f MB of KV) on the CPU from host memory "
               "(share %.2f%s)", (long long)cpu_keys, cpu_step / 1e6, share,
               mo->kv_cpu_attn < 0 ? ", planned" : mo->kv_cpu_attn > 0 ? ", --kv-cpu-attn"
               : ": the device is the CPU");
    if (cpu_keys > 0 && cpu_bw > 0)
        printf(": the CPU reads KV at %.1f GB/s, H2D %.1f GB/s (measured at the first pass)", cpu_bw / 1e9,
               cpu_h2d / 1e9);
    if (cpu_keys > 0) printf("\n");
    if (h2d > 0 && roof->copy_bw > 0) {
        const double f_kv = kv_step / h2d, f_w = (double)weight_bytes / roof->copy_bw;
        const double f_ssd = ssd_bw > 0 ? ssd_step / ssd_bw : 0, f_cpu = cpu_bw > 0 ? cpu_step / cpu_bw : 0;
        double bound = f_kv > f_w ? f_kv : f_w;
        bound = bound > f_ssd ? bound : f_ssd;
        bound = bound > f_cpu ? bound : f_cpu;
        printf("roofline     decode bound %.3f s/token = max(KV %.1f MB / H2D %.1f GB/s, weights %.1f MB / HBM "
               "%.0f GB/s%s%s), measured now: %.2fx of it\n",
               bound, kv_step / 1e6, h2d / 1e9, weight_bytes / 1e6, roof->copy_bw / 1e9,
               f_ssd > 0 ? ", KV from the SSD / its read rate" : "",
               f_cpu > 0 ? ", KV on the CPU / its rate" : "", step / bound);
    }
    if (be->kind == ST_BACKEND_CPU) { /* the floor: a step reads the weights and its KV once from memory (the
                                         ring's copies and gathers are overhead there), the file's share at
                                         the file's rate; as the pool's CPU bench counts it */
        st_pool *pool = NULL;
        double mem_bw = 0;
        if (st_pool_init(mo->threads > 0 ? mo->threads : 0, &pool) == STRATA_OK) {
            mem_bw = tool_measure_read_bw(pool, 4 * (size_t)weight_bytes > ((size_t)1 << 30) ? 4 * (size_t)weight_bytes
                                                                                              : (size_t)1 << 30);
            st_pool_free(pool);
        }
        const double key_bytes = (double)st_kv_stream_host_bytes(&sp, 1) / (double)(sp.seg ? sp.seg : ST_KV_STREAM_SEG);
        const double kv_mem = ((double)n_prompt + ((double)n_gen + 1.0) / 2.0) * key_bytes - ssd_step;
        if (mem_bw > 0) {
            const double f_mem = ((double)weight_bytes + kv_mem) / mem_bw, f_ssd = ssd_bw > 0 ? ssd_step / ssd_bw : 0;
            const double bound = f_mem > f_ssd ? f_mem : f_ssd;
            printf("roofline     decode floor %.4f s/token = max((weights %.1f MB + KV in memory %.1f MB) / memory "
                   "read %.2f GB/s%s), measured now: reached %.0f%%\n", bound, weight_bytes / 1e6, kv_mem / 1e6,
                   mem_bw / 1e9, f_ssd > 0 ? ", KV from the SSD / its read rate" : "", 100.0 * bound / step);
        }
    }
    printf("device mem   peak %.1f MB of backend allocations (weights, KV ring and areas %.1f MB, activations, "
           "scratch): independent of the context\n", peak / 1e6, st_kv_stream_device_bytes(&sp) / 1e6);
    ok = true;
out:
    if (!ok) tool_print_error("bench");
    st_kv_stream_free(ks);
    free(logits);
    return ok;
}

int cmd_bench(int argc, char **argv) {
    tool_model_opts mo = TOOL_ENGINE_OPTS_INIT; /* --kv-stream-mem, --kv-ssd-dir (with --kv-stream) */
    const char *path = NULL;
    int64_t n_prompt = 128, n_gen = 64, reps = 3;
    bool prefill_only = false, op_times = false;
    int64_t seqs[16], seq_prompt = 32, verify[16];
    int n_seqs = 0, n_verify = 0;
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
        } else if (!strcmp(a, "--prefill-only")) {
            prefill_only = true;
        } else if (!strcmp(a, "--op-times")) {
            op_times = true;
        } else if (!strcmp(a, "--seqs")) {
            if (!parse_list(val, seqs, &n_seqs)) return 2;
            i++;
        } else if (!strcmp(a, "--verify")) {
            if (!parse_list(val, verify, &n_verify)) return 2;
            for (int k = 0; k < n_verify; k++)
                if (verify[k] > 32) {
                    fprintf(stderr, "strata bench: --verify %lld: at most 32 drafts\n", (long long)verify[k]);
                    return 2;
                }
            i++;
        } else if (!strcmp(a, "--seq-prompt")) {
            if (!tool_parse_i64(val, 1, 1 << 20, "--seq-prompt", &seq_prompt)) return 2;
            i++;
        } else if (!tool_take_positional("bench", a, &path, bench_usage)) {
            return 2;
        }
    }
    if (!path) {
        bench_usage(stderr);
        return 2;
    }
    if ((mo.kv_ssd_dir && !mo.kv_stream) || mo.kv_offload_lazy) {
        fprintf(stderr, "strata bench: --kv-offload, and --kv-ssd-dir without --kv-stream, are for run and serve\n");
        return 2;
    }
    if (mo.kv_host_mem) { /* the prefix cache's host tier: bench has no prefix cache */
        fprintf(stderr, "strata bench: --kv-host-mem is the prefix cache's host tier of run and serve; %s\n",
                mo.kv_stream ? "the host memory of a streamed KV is --kv-stream-mem"
                             : "bench has no prefix cache (a streamed KV's host share is --kv-stream-mem)");
        return 2;
    }
    if (mo.kv_stream && (n_seqs > 0 || prefill_only)) {
        fprintf(stderr, "strata bench: --kv-stream runs one sequence: not with --seqs or --prefill-only\n");
        return 2;
    }
    int64_t max_verify = 0;
    for (int k = 0; k < n_verify; k++) max_verify = verify[k] > max_verify ? verify[k] : max_verify;
    if (mo.kv_stream && n_verify > 0) {
        fprintf(stderr, "strata bench: --verify runs on the paged KV cache: not with --kv-stream\n");
        return 2;
    }
    if (mo.ctx == 0) mo.ctx = n_prompt + (n_gen > 2 ? n_gen : 2) + max_verify + 1;
    /* the prompt in one forward chunk unless --batch says otherwise (up to 4096 tokens) */
    const bool batch_given = mo.batch != 0;
    if (mo.batch == 0) mo.batch = n_prompt < 4096 ? n_prompt : 4096;
    if (mo.batch < max_verify + 1) mo.batch = max_verify + 1; /* a verification pass in one forward */
    if (n_seqs > 0) { /* the batched decode: max_batch >= the batch, a paged pool planned for */
        if (n_gen < 2) {
            fprintf(stderr, "strata bench: --seqs needs --gen 2 or more\n");
            return 2;
        }
        int64_t maxB = 0;
        for (int i = 0; i < n_seqs; i++) maxB = seqs[i] > maxB ? seqs[i] : maxB;
        if (mo.batch < maxB) mo.batch = maxB;
        if (seq_prompt > mo.batch && !batch_given) mo.batch = seq_prompt < 4096 ? seq_prompt : 4096;
        if (seq_prompt > mo.batch) { /* each prompt is prefilled in one chunk */
            fprintf(stderr, "strata bench: --seq-prompt %lld is cut to the batch of %lld tokens\n",
                    (long long)seq_prompt, (long long)mo.batch);
            seq_prompt = mo.batch;
        }
        if (mo.ctx < seq_prompt + n_gen + 1) mo.ctx = seq_prompt + n_gen + 1;
        mo.kv_seqs = maxB;
    }
    /* Device rooflines first, on a probe backend of their own: the engine's
     * backend may be filled to its --device-mem budget once the model is in. */
    tool_rooflines roof;
    const st_backend_params probe_bp = tool_backend_params(&mo);
    if (!tool_measure_device_rooflines(&probe_bp, &roof)) return 1;
    const double probe_bw = roof.copy_bw, probe_rate = roof.gemm_fast, probe_rate_precise = roof.gemm_precise;
    tool_model tm;
    if (!tool_model_open(path, &mo, &tm)) return 1;
    st_wm_stats ws; /* weight streaming: timings start once the host tier is pinned */
    tool_weights_settle(&tm, &ws);
    const st_config *c = &tm.files->config;
    const int64_t V = c->vocab_size;
    const bool on_cpu = tm.be->kind == ST_BACKEND_CPU;
    st_backend *be = tm.be;
    const bool fast = tool_fast_prefill(&mo, tm.files); /* the precision tool_model_open set */

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
    const double kv_row = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, mo.kv_dtype);

    int32_t *ids = malloc((size_t)(n_prompt + n_gen) * sizeof(int32_t));
    float *logits = malloc((size_t)V * sizeof(float));
    int rc = 1;
    if (!ids || !logits) goto done;
    uint32_t s = 7;
    for (int64_t i = 0; i < n_prompt; i++) {
        s = s * 1664525u + 1013904223u;
        ids[i] = (int32_t)((s >> 8) % (uint32_t)V);
    }
    if (tool_kv_streamed(&mo, c)) { /* --kv-stream, or a --device-mem the KV would take half of */
        rc = stream_bench(&tm, &mo, ids, n_prompt, n_gen, &roof, weight_bytes) ? 0 : 1;
        goto done;
    }
    if (mo.kv_stream_mem) {
        fprintf(stderr, "strata bench: --kv-stream-mem is for a sequence whose KV is streamed from host memory "
                        "(--kv-stream)\n");
        goto done;
    }
    if (prefill_only) {
        double t0 = st_time_now();
        if (st_llama_forward_seq(tm.model, tm.kv, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
        printf("prefill      %lld tokens in %.4f s (one pass, no warm-up)\n", (long long)n_prompt,
               st_time_now() - t0);
        rc = 0;
        goto done;
    }
    /* warm-up: a whole prefill (matmul plans, scratch sizes, kernels loaded)
     * and two decode steps (the second records the step's graph); then the
     * timed prefills, each over the same positions (the KV is rewritten) */
    if (st_llama_forward_seq(tm.model, tm.kv, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
    int32_t next = argmax(logits, V);
    for (int i = 0; i < 2; i++)
        if (decode_one(&tm, next, n_prompt + i, &next) != STRATA_OK) goto fail;
    double t_prefill = 1e30;
    for (int64_t r = 0; r < reps; r++) {
        double t0 = st_time_now();
        if (st_llama_forward_seq(tm.model, tm.kv, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
        const double t = st_time_now() - t0;
        if (t < t_prefill) t_prefill = t;
    }
    /* greedy decode, one sequence through the one forward path, the greedy
     * token drawn on the device: no logits cross to the host */
    next = argmax(logits, V);
    tool_weights_settle(&tm, &ws);
    double t0 = st_time_now();
    for (int64_t g = 0; g < n_gen; g++) {
        ids[n_prompt + g] = next;
        if (decode_one(&tm, next, n_prompt + g, &next) != STRATA_OK) goto fail;
    }
    double t_decode = st_time_now() - t0;
    st_wm_stats ws_after; /* the decode steps' counters, before anything else runs */
    st_wm_stats_get(st_llama_weights(tm.model), &ws_after);
    const size_t peak = be->device_budget.peak;

    double bw = 0, gemm_rate = 0, gemm_rate_precise = 0, t_prefill_other = 0;
    int n_threads = 0;
    size_t probe = 0;
    if (on_cpu) {
        st_pool *pool = NULL;
        if (st_pool_init(mo.threads > 0 ? mo.threads : 0, &pool) != STRATA_OK) goto fail;
        probe = 4 * (size_t)weight_bytes;
        if (probe < ((size_t)1 << 30)) probe = (size_t)1 << 30;
        bw = tool_measure_read_bw(pool, probe);
        n_threads = st_pool_threads(pool);
        st_pool_free(pool);
    } else {
        /* the prefill in the other precision, for comparison (second run timed) */
        be->ops->set_fast_prefill(be, !fast);
        st_llama_set_graphs(tm.model, true); /* recordings hold the precision */
        for (int r = 0; r < 2; r++) {
            double t1 = st_time_now();
            if (st_llama_forward_seq(tm.model, tm.kv, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
            t_prefill_other = st_time_now() - t1;
        }
        be->ops->set_fast_prefill(be, fast);
        st_llama_set_graphs(tm.model, true);
        bw = probe_bw;
        gemm_rate = probe_rate;
        gemm_rate_precise = probe_rate_precise;
        if (bw <= 0 || gemm_rate <= 0) goto fail;
    }

    /* step g (from 0) reads the keys of positions 0 .. n_prompt + g */
    const double avg_ctx = (double)n_prompt + ((double)n_gen + 1.0) / 2.0;
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
    st_llama_graph_stats gs;
    st_llama_get_graph_stats(tm.model, &gs);
    printf("decode       %lld tokens in %.3f s: %.2f tok/s, %.3f ms/token (one sequence, greedy on the %s; "
           "%lld passes replayed as graphs, %lld direct; KV %s)\n",
           (long long)n_gen, t_decode, (double)n_gen / t_decode, step_s * 1e3, on_cpu ? "CPU" : "device",
           (long long)gs.replays,
           (long long)gs.direct, st_kv_dtype_name(mo.kv_dtype));
    printf("roofline     decode floor %.3f ms/token = %.1f MB (weights + KV at context %.0f) / %.2f GB/s "
           "-> %.1f tok/s; reached %.0f%%\n",
           floor_s * 1e3, step_bytes / 1e6, avg_ctx, bw / 1e9, 1.0 / floor_s, 100.0 * floor_s / step_s);
    printf("device mem   peak %.1f MB of backend allocations (%sKV cache, activations, scratch)\n", peak / 1e6,
           on_cpu ? "" : "weights, ");
    tool_print_weights(&tm, &ws, &ws_after, n_gen, step_s, n_prompt, t_prefill);
    if (op_times && on_cpu) { /* one prefill and the same steps again (the KV rewritten), every op timed */
        st_backend_cpu_prof(be, true);
        const double t2 = st_time_now();
        if (st_llama_forward_seq(tm.model, tm.kv, ids, n_prompt, 0, false, logits) != STRATA_OK) goto fail;
        const double tpf = st_time_now() - t2;
        st_backend_cpu_prof(be, false);
        printf("op time      a prefill of %lld tokens again with op times: %.3f s\n", (long long)n_prompt, tpf);
        st_backend_cpu_prof_print(be, stdout, 1, tpf);
        st_backend_cpu_prof(be, true);
        const double t1 = st_time_now();
        for (int64_t g = 0; g < n_gen; g++)
            if (decode_one(&tm, ids[n_prompt + g], n_prompt + g, &next) != STRATA_OK) goto fail;
        const double tp = (st_time_now() - t1) / (double)n_gen;
        st_backend_cpu_prof(be, false);
        printf("op time      %lld decode steps again with op times: %.3f ms/step\n", (long long)n_gen, tp * 1e3);
        st_backend_cpu_prof_print(be, stdout, n_gen, tp);
    } else if (op_times) {
        printf("op time      --op-times: the CPU backend only\n");
    }
    if (n_verify > 0) {
        /* each K: a warm-up pass, then passes over the same positions (the KV rewritten) */
        float *vl = malloc((size_t)(max_verify + 1) * (size_t)V * sizeof *vl);
        int32_t vt[33];
        if (!vl) goto fail;
        for (int64_t i = 0; i <= max_verify; i++) vt[i] = ids[(n_prompt + i) % (n_prompt + n_gen)];
        const int64_t at = n_prompt + n_gen, passes = 8;
        for (int k = 0; k < n_verify; k++) {
            if (verify_pass(&tm, vt, verify[k], at, vl) != STRATA_OK) {
                free(vl);
                goto fail;
            }
            const double t1 = st_time_now();
            for (int64_t r = 0; r < passes; r++)
                if (verify_pass(&tm, vt, verify[k], at, vl) != STRATA_OK) {
                    free(vl);
                    goto fail;
                }
            const double tv = (st_time_now() - t1) / (double)passes;
            printf("verify       %lld drafts + 1 token in one pass, %lld logit rows to the host: %.3f ms = %.2fx "
                   "a one-token decode step (%.3f ms); all accepted would give %.1f tok/s\n",
                   (long long)verify[k], (long long)verify[k] + 1, tv * 1e3, tv / step_s, step_s * 1e3,
                   (double)(verify[k] + 1) / tv);
            if (op_times && on_cpu) {
                st_backend_cpu_prof(be, true);
                const double t2 = st_time_now();
                for (int64_t r = 0; r < passes; r++)
                    if (verify_pass(&tm, vt, verify[k], at, vl) != STRATA_OK) {
                        free(vl);
                        goto fail;
                    }
                const double tp = (st_time_now() - t2) / (double)passes;
                st_backend_cpu_prof(be, false);
                printf("op time      %lld passes of %lld tokens again with op times: %.3f ms/pass\n", (long long)passes,
                       (long long)verify[k] + 1, tp * 1e3);
                st_backend_cpu_prof_print(be, stdout, passes, tp);
            }
        }
        free(vl);
    }
    if (n_seqs > 0 && !seqs_bench(&tm, seqs, n_seqs, seq_prompt, n_gen, bw, weight_bytes)) goto done;
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

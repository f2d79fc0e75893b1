/* GPU check: batched forward passes replayed as CUDA graphs give the same bits
 * as the same passes run op by op, and how much faster they are.
 *
 *   gpu_check_batch_graph [MODEL ...]        correctness (default: the test
 *       models llama3_bf16, gqa_f32 and, when present, models/ *.gguf)
 *   gpu_check_batch_graph --time MODEL [P] [G]  ms per decode step, graphs
 *       off vs on, for batches of 1, 8 and 64 sequences with prompts of P
 *       tokens (512), G steps (32), and the logits of every step compared
 *
 * Correctness, per model: two models on one CUDA backend, one made with
 * no_graphs (direct) and one with graphs; 8 sequences in
 * non-contiguous blocks; chunked prefill (mixed chunks of several
 * sequences), then 300 decode steps whose batch size changes (8, 3, 1, 5,
 * ...) and whose contexts cross the attention buckets (256, 512 keys), a
 * stretch with device sampling (st_llama_forward_sample: ids and logits), and a
 * multi-token step. Every step's logits must be bitwise equal (memcmp), the
 * graph model must have replayed graphs, the direct one none.
 * Prints PASS / FAIL lines; exit status 1 on any failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "loader/loader.h"
#include "model/llama.h"

static int g_fail;

#define CHECK(cond, ...)                                \
    do {                                                \
        const int ok_ = (cond);                         \
        printf("%s ", ok_ ? "PASS" : "FAIL");           \
        printf(__VA_ARGS__);                            \
        printf("\n");                                   \
        fflush(stdout);                                 \
        if (!ok_) g_fail++;                             \
    } while (0)

static uint32_t g_rng = 12345;
static uint32_t rnd(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return g_rng >> 8;
}

static void *xcalloc(size_t n, size_t s) {
    void *p = calloc(n ? n : 1, s);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static int32_t argmax(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int32_t)b;
}

static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* ---- a small serving simulation over a paged pool ------------------------------------ */

#define NS 8        /* sequences */
#define BS 16       /* block size */
#define BPS 64      /* blocks per sequence: 1024 positions */
#define MAXB 128    /* tokens per pass */

typedef struct {
    int32_t tables[NS * BPS]; /* seq s, block j -> j * NS + s (interleaved, non-contiguous) */
    int32_t len[NS];          /* keys held */
    int32_t prompt[NS];
    int32_t *hist[NS];        /* token history [1024] */
} sim;

/* One batch: entries (seq, count) run tokens hist[s][len .. len+count) of
 * each; the last token of every entry gives logits. */
typedef struct {
    int n_ent;
    int ent_seq[NS];
    int ent_cnt[NS];
} plan;

typedef struct {
    int32_t tok[MAXB], pos[MAXB], seq[MAXB], ctx[NS], rows[NS], tab[NS * BPS];
    int64_t slots[MAXB];
    st_batch b;
} built;

static void build(const sim *S, const plan *p, built *o) {
    int64_t n = 0;
    for (int e = 0; e < p->n_ent; e++) {
        const int s = p->ent_seq[e];
        for (int i = 0; i < p->ent_cnt[e]; i++) {
            const int32_t q = S->len[s] + i;
            o->tok[n] = S->hist[s][q];
            o->pos[n] = q;
            o->seq[n] = e;
            o->slots[n] = (int64_t)S->tables[s * BPS + q / BS] * BS + q % BS;
            n++;
        }
        o->rows[e] = (int32_t)(n - 1);
        o->ctx[e] = S->len[s] + p->ent_cnt[e];
        memcpy(o->tab + e * BPS, S->tables + s * BPS, BPS * sizeof(int32_t));
    }
    o->b = (st_batch){.n_tokens = n, .tokens = o->tok, .pos = o->pos, .seq = o->seq, .slots = o->slots,
                      .n_seqs = p->n_ent, .block_tables = o->tab, .max_blocks = BPS, .ctx_lens = o->ctx,
                      .logit_rows = o->rows, .n_logits = p->n_ent};
}

typedef struct {
    int steps, mismatches, errors, id_mismatches;
} tally;

/* Runs plan p on both models (and samples when args); compares; advances the
 * sequences and appends each entry's next token (argmax, or the sampled id). */
static void step(sim *S, const plan *p, st_llama *ma, st_kv_pool *ka, st_llama *mb, st_kv_pool *kb, int64_t V,
                 bool sample, bool append, tally *t) {
    built bl;
    build(S, p, &bl);
    const int64_t nl = bl.b.n_logits;
    float *la = xcalloc((size_t)(nl * V), 4), *lb = xcalloc((size_t)(nl * V), 4);
    int32_t ia[NS], ib[NS];
    st_sample_args args[NS];
    for (int e = 0; e < NS; e++)
        args[e] = (st_sample_args){.u = (double)(rnd() % 100000) / 100000.0, .temperature = e % 3 ? 0.8f : 0.0f,
                                   .top_k = e % 2 ? 40 : 0, .top_p = 0.9f, .min_p = 0.0f};
    strata_status sa, sb;
    if (sample) {
        sa = st_llama_forward_sample(ma, ka, &bl.b, args, ia, la);
        sb = st_llama_forward_sample(mb, kb, &bl.b, args, ib, lb);
    } else {
        sa = st_llama_forward(ma, ka, &bl.b, la);
        sb = st_llama_forward(mb, kb, &bl.b, lb);
    }
    t->steps++;
    if (sa != STRATA_OK || sb != STRATA_OK) {
        fprintf(stderr, "  step %d: forward failed: %s\n", t->steps, st_last_error());
        t->errors++;
    } else {
        if (memcmp(la, lb, (size_t)(nl * V) * 4)) {
            if (t->mismatches < 3) {
                double md = 0;
                for (int64_t i = 0; i < nl * V; i++) md = fmax(md, fabs((double)la[i] - (double)lb[i]));
                fprintf(stderr, "  step %d (%lld tokens, %lld seqs): logits differ, max |diff| %.3e\n", t->steps,
                        (long long)bl.b.n_tokens, (long long)nl, md);
            }
            t->mismatches++;
        }
        if (sample && memcmp(ia, ib, (size_t)nl * 4)) t->id_mismatches++;
    }
    for (int e = 0; e < p->n_ent; e++) {
        const int s = p->ent_seq[e];
        S->len[s] += p->ent_cnt[e];
        if (append && S->len[s] < BPS * BS) {
            int32_t nx = sample && ia[e] >= 0 ? ia[e] : argmax(la + e * V, V);
            S->hist[s][S->len[s]] = nx;
        }
    }
    free(la);
    free(lb);
}

static void print_stats(const char *what, const st_llama_graph_stats *g) {
    printf("  %s: replays %lld, recorded %lld, direct %lld, failed recordings %lld, dropped %lld\n", what,
           (long long)g->replays, (long long)g->recorded, (long long)g->direct, (long long)g->failed,
           (long long)g->dropped);
}

static void check_model(st_backend *be, const char *path) {
    st_model_files *mf = NULL;
    st_llama *ma = NULL, *mb = NULL;
    st_kv_pool *ka = NULL, *kb = NULL;
    st_llama_params lp = {.max_seq_len = BPS * BS, .max_tokens = MAXB, .no_graphs = true};
    sim S;
    memset(&S, 0, sizeof S);
    strata_status st = st_model_open(path, &mf);
    const st_kv_pool_params kp = st == STRATA_OK ? st_llama_kv_params_for(&mf->config, MAXB, BPS * BS, NS * BPS, BS,
                                                                          ST_KV_BF16)
                                                 : (st_kv_pool_params){0};
    lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    if (st == STRATA_OK) st = st_llama_init(mf, be, &lp, &ma); /* graphs off */
    lp.no_graphs = false;
    if (st == STRATA_OK) st = st_llama_init(mf, be, &lp, &mb);
    if (st == STRATA_OK) st = st_kv_pool_init(be, &kp, &ka);
    if (st == STRATA_OK) st = st_kv_pool_init(be, &kp, &kb);
    if (st != STRATA_OK) {
        CHECK(false, "batch graph %s: cannot load: %s", path, st_last_error());
        goto out;
    }
    {
        const int64_t V = mf->config.vocab_size;
        for (int s = 0; s < NS; s++) {
            for (int j = 0; j < BPS; j++) S.tables[s * BPS + j] = j * NS + s;
            S.prompt[s] = 100 + 37 * s;
            S.hist[s] = xcalloc(BPS * BS, sizeof(int32_t));
            for (int i = 0; i < S.prompt[s]; i++) S.hist[s][i] = (int32_t)(rnd() % (uint32_t)V);
        }
        tally t = {0};
        /* prefill: chunks of at most MAXB tokens over the sequences in order */
        int cur = 0;
        while (cur < NS) {
            plan p = {0};
            int budget = MAXB;
            for (int s = cur; s < NS && budget > 0; s++) {
                const int left = S.prompt[s] - S.len[s];
                const int k = left < budget ? left : budget;
                p.ent_seq[p.n_ent] = s, p.ent_cnt[p.n_ent] = k, p.n_ent++;
                budget -= k;
            }
            /* a chunk ending mid-prompt gets no next token; only whole prompts append */
            step(&S, &p, ma, ka, mb, kb, V, false, false, &t);
            while (cur < NS && S.len[cur] == S.prompt[cur]) cur++;
        }
        for (int s = 0; s < NS; s++) S.hist[s][S.len[s]] = (int32_t)(rnd() % (uint32_t)V); /* first decode input */
        const int prefill_steps = t.steps;
        /* decode: batch sizes change; sampling for a stretch; one multi-token step */
        static const int pattern[] = {8, 8, 8, 3, 8, 1, 8, 5, 8, 8, 2, 8};
        for (int d = 0; d < 300; d++) {
            plan p = {0};
            const int nact = pattern[d % (int)(sizeof pattern / sizeof pattern[0])];
            const int cnt = d == 150 ? 12 : 1;
            for (int s = 0; s < nact; s++) {
                if (S.len[s] + cnt + 1 >= BPS * BS) continue;
                p.ent_seq[p.n_ent] = s, p.ent_cnt[p.n_ent] = cnt, p.n_ent++;
                if (cnt > 1) /* tokens of the multi-token step */
                    for (int i = 1; i < cnt; i++) S.hist[s][S.len[s] + i] = (int32_t)(rnd() % (uint32_t)V);
            }
            if (p.n_ent == 0) continue;
            step(&S, &p, ma, ka, mb, kb, V, d >= 100 && d < 140, true, &t);
        }
        st_llama_graph_stats ga, gb;
        st_llama_get_graph_stats(ma, &ga);
        st_llama_get_graph_stats(mb, &gb);
        int maxlen = 0;
        for (int s = 0; s < NS; s++) maxlen = S.len[s] > maxlen ? S.len[s] : maxlen;
        CHECK(t.errors == 0 && t.mismatches == 0 && t.id_mismatches == 0 && gb.replays > 0 && ga.replays == 0 &&
                  ga.recorded == 0,
              "batch graph %s: %d passes (%d prefill chunks, longest context %d): logits bitwise equal in %d, "
              "sampled ids differ in %d, errors %d; graph model replayed %lld (recorded %lld), direct model "
              "replayed %lld",
              path, t.steps, prefill_steps, maxlen, t.steps - t.mismatches - t.errors, t.id_mismatches, t.errors,
              (long long)gb.replays, (long long)gb.recorded, (long long)ga.replays);
        print_stats("graphs", &gb);
        print_stats("no_graphs", &ga);
        for (int s = 0; s < NS; s++) free(S.hist[s]);
    }
out:
    if (ma && ka) st_llama_forget_pool(ma, ka);
    if (mb && kb) st_llama_forget_pool(mb, kb);
    st_kv_pool_free(ka);
    st_kv_pool_free(kb);
    st_llama_free(ma);
    st_llama_free(mb);
    st_model_close(mf);
}

/* ---- timing: one model, graphs off then on, the same steps --------------------------- */

static void time_model(st_backend *be, const char *path, int64_t P, int64_t G) {
    static const int64_t batches[] = {1, 8, 64};
    const int64_t maxB = 64, bps = (P + G + 1 + BS - 1) / BS;
    st_model_files *mf = NULL;
    st_llama *m = NULL;
    st_kv_pool *kv = NULL;
    st_llama_params lp = {.max_seq_len = bps * BS, .max_tokens = P > maxB ? P : maxB};
    strata_status st = st_model_open(path, &mf);
    const st_kv_pool_params kp = st == STRATA_OK ? st_llama_kv_params_for(&mf->config, lp.max_tokens, bps * BS,
                                                                          maxB * bps, BS, ST_KV_BF16)
                                                 : (st_kv_pool_params){0};
    lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    if (st == STRATA_OK) st = st_llama_init(mf, be, &lp, &m);
    if (st == STRATA_OK) st = st_kv_pool_init(be, &kp, &kv);
    if (st != STRATA_OK) {
        CHECK(false, "batch graph timing %s: cannot load: %s", path, st_last_error());
        goto out;
    }
    {
        const int64_t V = mf->config.vocab_size;
        int32_t *tab = xcalloc((size_t)(maxB * bps), 4), *tok = xcalloc((size_t)P, 4);
        int32_t *bt = xcalloc((size_t)maxB, 4), *bp = xcalloc((size_t)maxB, 4), *bq = xcalloc((size_t)maxB, 4);
        int32_t *ctx = xcalloc((size_t)maxB, 4), *rows = xcalloc((size_t)maxB, 4);
        int32_t *next = xcalloc((size_t)(maxB * (G + 1)), 4);
        int64_t *slots = xcalloc((size_t)(P > maxB ? P : maxB), 8);
        float *logits = xcalloc((size_t)(maxB * V), 4);
        uint64_t *hash = xcalloc((size_t)G, 8);
        for (int64_t i = 0; i < maxB * bps; i++) tab[i] = (int32_t)i;
        /* prefill every sequence (one pass each, graphs off: each is run once) */
        st_llama_set_graphs(m, false);
        for (int64_t s = 0; s < maxB && st == STRATA_OK; s++) {
            for (int64_t i = 0; i < P; i++) {
                tok[i] = (int32_t)(rnd() % (uint32_t)V);
                slots[i] = (int64_t)tab[s * bps + i / BS] * BS + i % BS;
            }
            int32_t *pos = xcalloc((size_t)P, 4), *sq = xcalloc((size_t)P, 4), len = (int32_t)P, row = (int32_t)(P - 1);
            for (int64_t i = 0; i < P; i++) pos[i] = (int32_t)i;
            const st_batch b = {.n_tokens = P, .tokens = tok, .pos = pos, .seq = sq, .slots = slots, .n_seqs = 1,
                                .block_tables = tab + s * bps, .max_blocks = bps, .ctx_lens = &len,
                                .logit_rows = &row, .n_logits = 1};
            st = st_llama_forward(m, kv, &b, logits);
            next[s * (G + 1)] = argmax(logits, V);
            free(pos);
            free(sq);
        }
        if (st != STRATA_OK) {
            CHECK(false, "batch graph timing %s: prefill: %s", path, st_last_error());
        }
        for (size_t bi = 0; bi < sizeof batches / sizeof batches[0] && st == STRATA_OK; bi++) {
            const int64_t B = batches[bi];
            double ms[2] = {0, 0};
            int same = 0, errs = 0;
            for (int mode = 0; mode < 2 && st == STRATA_OK; mode++) {
                st_llama_set_graphs(m, mode == 1);
                double t0 = 0;
                for (int64_t g = 0; g < G; g++) {
                    if (g == 2) t0 = st_time_now(); /* graphs: pass 0 direct, 1 recorded, 2.. replayed */
                    for (int64_t s = 0; s < B; s++) {
                        bt[s] = next[s * (G + 1) + g];
                        bp[s] = (int32_t)(P + g);
                        bq[s] = (int32_t)s;
                        ctx[s] = (int32_t)(P + g + 1);
                        rows[s] = (int32_t)s;
                        slots[s] = (int64_t)tab[s * bps + (P + g) / BS] * BS + (P + g) % BS;
                    }
                    const st_batch b = {.n_tokens = B, .tokens = bt, .pos = bp, .seq = bq, .slots = slots,
                                        .n_seqs = B, .block_tables = tab, .max_blocks = bps, .ctx_lens = ctx,
                                        .logit_rows = rows, .n_logits = B};
                    if ((st = st_llama_forward(m, kv, &b, logits)) != STRATA_OK) {
                        errs++;
                        break;
                    }
                    const uint64_t h = fnv(logits, (size_t)(B * V) * 4);
                    if (mode == 0) {
                        hash[g] = h;
                        for (int64_t s = 0; s < B; s++) next[s * (G + 1) + g + 1] = argmax(logits + s * V, V);
                    } else {
                        same += h == hash[g];
                    }
                }
                ms[mode] = G > 2 ? (st_time_now() - t0) * 1e3 / (double)(G - 2) : 0;
            }
            st_llama_graph_stats gs;
            st_llama_get_graph_stats(m, &gs);
            CHECK(st == STRATA_OK && errs == 0 && same == G && gs.replays >= G - 2,
                  "batch graph timing %s: batch %lld, prompt %lld: direct %.3f ms/step, graphs %.3f ms/step "
                  "(%.2fx); logits of %d/%lld steps bitwise equal; replays %lld",
                  path, (long long)B, (long long)P, ms[0], ms[1], ms[1] > 0 ? ms[0] / ms[1] : 0.0, same,
                  (long long)G, (long long)gs.replays);
        }
        free(tab), free(tok), free(bt), free(bp), free(bq), free(ctx), free(rows), free(next), free(slots);
        free(logits), free(hash);
    }
out:
    if (m && kv) st_llama_forget_pool(m, kv);
    st_kv_pool_free(kv);
    st_llama_free(m);
    st_model_close(mf);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!st_backend_available(ST_BACKEND_CUDA)) {
        printf("FAIL no CUDA device\n");
        return 1;
    }
    st_backend *be = NULL;
    const st_backend_params bp = {.kind = ST_BACKEND_CUDA, .device_mem = 0, .device_index = 0};
    if (st_backend_init(&bp, &be) != STRATA_OK) {
        printf("FAIL cuda backend: %s\n", st_last_error());
        return 1;
    }
    if (argc >= 3 && !strcmp(argv[1], "--time")) {
        const int64_t P = argc > 3 ? atoll(argv[3]) : 512, G = argc > 4 ? atoll(argv[4]) : 32;
        time_model(be, argv[2], P > 0 ? P : 512, G > 3 ? G : 32);
    } else if (argc > 1) {
        for (int i = 1; i < argc; i++) check_model(be, argv[i]);
    } else {
        const char *src = getenv("STRATA_SRC") ? getenv("STRATA_SRC") : ".";
        const char *names[] = {"tests/data/models/llama3_bf16", "tests/data/models/gqa_f32",
                               "models/SmolLM2-135M-Instruct.Q4_1.gguf"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            char path[1024];
            snprintf(path, sizeof path, "%s/%s", src, names[i]);
            FILE *f = fopen(path, "rb");
            if (!f && i == 2) {
                printf("NOTE %s not present: skipped\n", path);
                continue;
            }
            if (f) fclose(f);
            check_model(be, path);
        }
    }
    st_backend_free(be);
    printf("%s: %d failure(s)\n", g_fail ? "FAILED" : "ALL PASSED", g_fail);
    return g_fail ? 1 : 0;
}

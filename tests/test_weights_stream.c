/* Weight streaming on the CPU backend (the "device" is a capped arena):
 *  - logits bit-identical (memcmp) to the fully resident run (zero copy from
 *    the mapping) for every placement mix: all device (arena copies), all
 *    host, all SSD, two mixed patterns (one with 3 ring slots), three with
 *    FFN groups on the CPU tier (computed by the model's second CPU backend
 *    from host memory: every pass; or the 4-token prefill chunks streaming
 *    them to the device and the smaller passes computing them, switching
 *    both ways; or pinned in the background, read from the file mapping
 *    meanwhile), the planner's
 *    own choice at a tight budget, pread + page cache instead of io_uring +
 *    O_DIRECT, and a host tier pinned in the background while the model runs;
 *    for a chunked prefill (all logits) and token-by-token decode; on every
 *    reference model (tests/data/models: tied, sharded, bf16, f32), a
 *    generated 8-layer model whose tensors sit at offsets not page-aligned, in an
 *    order that scatters each group over the file, and the default SmolLM2
 *    GGUF when present (30 layers: the ring cycles 30 times a step);
 *  - measured peaks: the backend's device peak and the manager's pinned host
 *    peak never exceed the budgets, which are set to exactly what the plan
 *    says it needs;
 *  - bytes: per step, the groups read from the file add up to the plan's
 *    predicted SSD bytes, exactly; the CPU tier's groups are computed on the
 *    CPU once per small pass (their bytes: the plan's) and cross to the
 *    device only in the passes that stream them;
 *  - budgets too small: STRATA_ERR_NOMEM naming the minimum;
 *  - faults: an injected I/O error or short read (in prefill, in decode, in
 *    background pinning, in synchronous pinning) is a clear STRATA_ERR_IO
 *    naming the file and offset, stays an error, never hangs, and every
 *    logit returned before it is right;
 *  - a model file changed underneath (mtime, truncation) is detected, when
 *    streaming and when fully resident. */
#include <fcntl.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/llama.h"
#include "weights/measure.h"
#include "testutil.h"

#define N_PROMPT 10
#define N_DECODE 4
#define BATCH 4

static const st_wbw k_bw = {.h2d = 10e9, .ssd = 1e9, .dev_read = 10e9, .gemm = 1e10};

typedef struct {
    float *prefill; /* [N_PROMPT, V] */
    float *decode;  /* [N_DECODE, V] */
    int64_t vocab;
} logits_t;

static void logits_free(logits_t *l) {
    free(l->prefill);
    free(l->decode);
    memset(l, 0, sizeof *l);
}

static int32_t tok(int64_t i, int64_t vocab) { return (int32_t)((i * 7919 + 13) % vocab); }

/* Runs a prefill of N_PROMPT tokens (all logits, chunks of BATCH) and
 * N_DECODE single-token steps. Stops at the first error (returned). */
static st_kv_pool *g_kv; /* the pool of the model at hand (test_llama_open) */

static strata_status run(st_llama *m, int64_t V, logits_t *out, int *forwards) {
    out->vocab = V;
    out->prefill = calloc((size_t)(N_PROMPT * V), sizeof(float));
    out->decode = calloc((size_t)(N_DECODE * V), sizeof(float));
    int32_t ids[N_PROMPT + N_DECODE];
    for (int i = 0; i < N_PROMPT + N_DECODE; i++) ids[i] = tok(i, V);
    *forwards = 0;
    strata_status st = st_llama_forward_seq(m, g_kv, ids, N_PROMPT, 0, true, out->prefill);
    if (st) return st;
    *forwards += (N_PROMPT + BATCH - 1) / BATCH;
    for (int i = 0; i < N_DECODE; i++) {
        st = st_llama_forward_seq(m, g_kv, ids + N_PROMPT + i, 1, N_PROMPT + i, false, out->decode + i * V);
        if (st) return st;
        (*forwards)++;
    }
    return STRATA_OK;
}

static bool g_big; /* the model at hand is large: default staging pieces */

static st_llama_params base_params(void) {
    st_llama_params lp;
    memset(&lp, 0, sizeof lp);
    lp.max_seq_len = 32;
    lp.max_tokens = BATCH;
    lp.weights.bw = k_bw;
    lp.weights.staging_chunk = g_big ? 0 : 8192; /* many pieces per group, tensors split across them */
    lp.weights.staging_chunks = 3;
    lp.weights.stream.pin_sync = true;
    return lp;
}

static st_backend *cpu(size_t cap) {
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2, .device_mem = cap};
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    return be;
}

typedef enum { P_DEVICE, P_HOST, P_SSD, P_MIX1, P_MIX2, P_PLANNED, P_PREAD, P_BGPIN, P_CPU1, P_CPU2, P_CPU3,
               P_SPLIT, P_COUNT } pattern;
static const char *k_names[] = {"all-device", "all-host", "all-ssd", "mixed", "mixed-3-slots",
                                "planned-tight", "ssd-pread-pagecache", "host-pinned-in-background",
                                "cpu-tier-mixed", "cpu-tier-prefill-streamed", "cpu-tier-pinned-in-background",
                                "cpu-tier-split"};

/* The CPU tier (hybrid): passes of at most this many tokens compute the
 * CPU-tier FFN groups on the model's second CPU backend; cpu-tier-prefill-
 * streamed sets 2, so that its prefill chunks of 4 tokens stream them to
 * the "device" like host-tier groups (its last chunk of 2 and the decode
 * steps compute them on the CPU): switching both ways between passes.
 * cpu-tier-split: the same placement with each CPU-tier group split half and
 * half (cpu_split 0.5): passes on the CPU compute the device's half of each
 * from a streamed copy and the CPU's in place; the sums differ in rounding
 * only (the logits within SPLIT_TOL of the largest). */
#define SPLIT_TOL 1e-5
static int64_t cpu_max_of(pattern p) { return p == P_CPU2 || p == P_SPLIT ? 2 : 8; }
static bool is_cpu(pattern p) { return p == P_CPU1 || p == P_CPU2 || p == P_CPU3 || p == P_SPLIT; }

/* The largest |a - b| over n floats, relative to the largest |b|. */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (fabs((double)a[i] - b[i]) > d) d = fabs((double)a[i] - b[i]);
        if (fabs((double)b[i]) > m) m = fabs((double)b[i]);
    }
    return m > 0 ? d / m : d;
}

static void fill_pattern(pattern p, int n, st_tier *t) {
    for (int i = 0; i < n; i++) {
        switch (p) {
        case P_DEVICE: t[i] = ST_TIER_DEVICE; break;
        case P_HOST: case P_BGPIN: t[i] = i == 0 ? ST_TIER_SSD : ST_TIER_HOST; break;
        case P_SSD: case P_PREAD: t[i] = ST_TIER_SSD; break;
        case P_MIX1: t[i] = (st_tier)(i % 3); break;
        case P_MIX2: t[i] = i == 0 ? ST_TIER_SSD : (st_tier)((n - i) % 3); break;
        case P_CPU1: case P_CPU3: /* ffn: cpu, host, cpu, ...; attn: ssd / device; the table gathered */
            t[i] = i == 0 ? ST_TIER_SSD : i == n - 1 ? ST_TIER_DEVICE
                   : i % 2 ? (i % 4 == 1 ? ST_TIER_SSD : ST_TIER_DEVICE)
                           : ((i - 2) / 2 % 3 == 1 ? ST_TIER_HOST : ST_TIER_CPU);
            break;
        case P_CPU2: case P_SPLIT: /* ffn.0 resident, every other ffn on the cpu tier; attn device / host / ssd */
            t[i] = i == 0 ? ST_TIER_DEVICE : i == n - 1 ? ST_TIER_SSD
                   : i % 2 ? (st_tier)((i - 1) / 2 % 3)
                           : (i == 2 ? ST_TIER_DEVICE : ST_TIER_CPU);
            break;
        default: t[i] = ST_TIER_SSD;
        }
    }
}

/* Whether io_uring can be used here (containers may forbid it). */
static bool uring_available(const st_model_files *files) {
    st_ssd_files *f = NULL;
    st_ssd_queue *q = NULL;
    bool yes = st_ssd_files_open(files, false, NULL, &f) == STRATA_OK && st_ssd_queue_init(f, 2, false, &q) == STRATA_OK &&
               st_ssd_queue_uring(q);
    st_ssd_queue_free(q);
    st_ssd_files_close(f);
    return yes;
}

/* One placement of one model: logits equal the reference, peaks within the
 * exact budgets, file bytes per step as predicted. */
static void check_case(const char *model, st_model_files *files, pattern pat, const logits_t *ref) {
    const int64_t V = files->config.vocab_size;
    const int n = 2 * (int)files->config.n_layers + 2;
    st_tier *tiers = calloc((size_t)n, sizeof *tiers);
    fill_pattern(pat, n, tiers);
    st_llama_params lp = base_params();
    if (pat != P_PLANNED) lp.weights.placement = tiers;
    if (pat == P_MIX2) lp.weights.ring_slots = 3;
    if (pat == P_PREAD) lp.weights.stream.use_pread = lp.weights.stream.no_direct = true;
    if (pat == P_BGPIN || pat == P_CPU3) {
        lp.weights.stream.pin_sync = false;
        lp.weights.stream.pin_delay_ms = 40;
    }
    lp.weights.cpu_max_tokens = cpu_max_of(pat);
    lp.weights.cpu_split = pat == P_SPLIT ? 0.5 : 0;
    lp.weights.cpu_threads = 2;
    /* budgets: exactly what the plan needs (the planned case: the least
     * device memory any placement needs, and a host budget of staging plus
     * one group, so that it must mix tiers) */
    st_backend *probe = cpu((size_t)1 << 34);
    lp.device_mem = (size_t)1 << 34;
    st_wgroups *g = NULL;
    st_wplan plan;
    lp.weights.host_mem = (size_t)1 << 34;
    const st_kv_pool_params kp = test_kv_params(files, &lp, ST_KV_F32);
    lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    strata_status st = st_llama_plan(files, probe, &lp, &g, &plan);
    CHECK_MSG(st == STRATA_OK, "%s %s: plan: %s", model, k_names[pat], st_last_error());
    st_backend_free(probe);
    if (st) {
        free(tiers);
        return;
    }
    size_t dev = plan.device_need, host = plan.host_need;
    if (pat == P_PLANNED) {
        dev = plan.device_min;
        host = plan.host_min + g->max_slot_bytes / 2;
    }
    st_wplan_free(&plan);
    st_wgroups_free(g);
    if (host == 0) host = 1; /* 0 would mean "auto" */
    lp.weights.host_mem = host;

    st_backend *be = cpu(dev);
    lp.device_mem = dev; /* the planner's budget, the backend's cap */
    st_llama *m = NULL;
    st = test_llama_open(files, be, &lp, ST_KV_F32, &m, &g_kv);
    CHECK_MSG(st == STRATA_OK, "%s %s: init with device %zu, host %zu: %s", model, k_names[pat], dev, host,
              st_last_error());
    if (st == STRATA_OK) {
        st_wm *wm = st_llama_weights(m);
        const st_wplan *pl = st_wm_plan(wm);
        logits_t out = {0};
        int fw = 0;
        st = run(m, V, &out, &fw);
        CHECK_MSG(st == STRATA_OK, "%s %s: %s", model, k_names[pat], st_last_error());
        const double d_pf = rel_diff(out.prefill, ref->prefill, N_PROMPT * V);
        const double d_dec = rel_diff(out.decode, ref->decode, N_DECODE * V);
        const double tol = pat == P_SPLIT ? SPLIT_TOL : 0; /* else bit-identical */
        CHECK_MSG(d_pf <= tol, "%s %s: prefill logits differ from the resident run by %g of the largest", model,
                  k_names[pat], d_pf);
        CHECK_MSG(d_dec <= tol, "%s %s: decode logits differ from the resident run by %g of the largest", model,
                  k_names[pat], d_dec);
        CHECK_MSG(pat != P_SPLIT || (pl->split_rows > 0 && pl->step_split_bytes > 0),
                  "%s %s: no split (%lld rows)", model, k_names[pat], (long long)pl->split_rows);
        st_wm_stats s;
        CHECK(st_wm_wait_pinned(wm) == STRATA_OK);
        st_wm_stats_get(wm, &s);
        CHECK_MSG(be->device_budget.peak <= dev, "%s %s: device peak %zu > budget %zu", model, k_names[pat],
                  be->device_budget.peak, dev);
        CHECK_MSG(s.host_peak <= host, "%s %s: pinned host peak %zu > budget %zu", model, k_names[pat], s.host_peak,
                  host);
        const uint64_t streamed = (uint64_t)st_wm_streamed(wm);
        /* passes that compute the CPU tier on the CPU: the decode steps and the prefill chunks of at most
         * cpu_max tokens (chunks of BATCH, the last one shorter) */
        int cpu_passes = N_DECODE;
        for (int p0 = 0; p0 < N_PROMPT; p0 += BATCH)
            cpu_passes += (N_PROMPT - p0 < BATCH ? N_PROMPT - p0 : BATCH) <= cpu_max_of(pat);
        const uint64_t n_cpu = (uint64_t)pl->groups[ST_TIER_CPU];
        if (is_cpu(pat)) {
            CHECK_MSG(n_cpu > 0 && s.seq_cpu == (uint64_t)cpu_passes * n_cpu &&
                          s.cpu_bytes == (uint64_t)cpu_passes * pl->step_cpu_bytes,
                      "%s %s: %llu groups (%llu bytes) computed on the CPU in %d passes, plan %llu (%llu bytes)",
                      model, k_names[pat], (unsigned long long)s.seq_cpu, (unsigned long long)s.cpu_bytes,
                      cpu_passes, (unsigned long long)n_cpu, (unsigned long long)pl->step_cpu_bytes);
            /* the streamed ones that were not computed on the CPU went to the device (a split one's part too) */
            const uint64_t parts = pl->split_rows > 0 ? (uint64_t)cpu_passes * n_cpu : 0;
            CHECK_MSG(s.seq_ssd + s.seq_host + s.seq_cpu == (uint64_t)fw * streamed + parts,
                      "%s %s: %llu + %llu + %llu groups in %d passes of %llu", model, k_names[pat],
                      (unsigned long long)s.seq_ssd, (unsigned long long)s.seq_host, (unsigned long long)s.seq_cpu,
                      fw, (unsigned long long)streamed);
            /* a pass on the CPU copies the split groups' parts (in step_host_bytes), one streaming the cpu
             * tier copies those groups whole instead */
            CHECK_MSG(s.h2d_bytes == (uint64_t)fw * (pl->step_ssd_bytes + pl->step_host_bytes) +
                                         (uint64_t)(fw - cpu_passes) *
                                             (pl->bytes[ST_TIER_CPU] - pl->step_split_bytes),
                      "%s %s: %llu bytes copied to the device in %d passes (%d on the CPU)", model, k_names[pat],
                      (unsigned long long)s.h2d_bytes, fw, cpu_passes);
        } else
        CHECK_MSG(n_cpu == 0 && s.seq_ssd + s.seq_host == (uint64_t)fw * streamed && s.seq_skipped == 0,
                  "%s %s: %llu + %llu groups streamed in %d passes of %llu", model, k_names[pat],
                  (unsigned long long)s.seq_ssd, (unsigned long long)s.seq_host, fw, (unsigned long long)streamed);
        if (pat != P_BGPIN && pat != P_CPU3)
            CHECK_MSG(s.ssd_group_bytes == (uint64_t)fw * pl->step_ssd_img_bytes,
                      "%s %s: %llu bytes from the file in %d steps, plan %llu per step", model, k_names[pat],
                      (unsigned long long)s.ssd_group_bytes, fw, (unsigned long long)pl->step_ssd_img_bytes);
        /* every streamed group used crosses to the device once per pass, whatever its source */
        if (!is_cpu(pat))
        CHECK_MSG(s.h2d_bytes == (uint64_t)fw * (pl->step_ssd_bytes + pl->step_host_bytes),
                  "%s %s: %llu bytes copied to the device in %d steps, plan %llu per step", model, k_names[pat],
                  (unsigned long long)s.h2d_bytes, fw,
                  (unsigned long long)(pl->step_ssd_bytes + pl->step_host_bytes));
        if (pat == P_BGPIN) {
            /* pinning lagged behind: early steps read host groups from the file */
            CHECK_MSG(s.seq_ssd > 0, "%s: nothing served from the file while pinning", model);
            CHECK(s.pin_done && s.pinned_groups == s.pin_total_groups);
            /* once pinned, after one more pass (what was read ahead before the
             * pins landed is used first), nothing comes from the file */
            for (int r = 0; r < 2; r++) {
                st_wm_stats before = s;
                logits_t again = {0};
                CHECK(run(m, V, &again, &fw) == STRATA_OK);
                CHECK(!memcmp(again.prefill, ref->prefill, (size_t)(N_PROMPT * V) * sizeof(float)));
                CHECK(!memcmp(again.decode, ref->decode, (size_t)(N_DECODE * V) * sizeof(float)));
                st_wm_stats_get(wm, &s);
                if (r == 1)
                    CHECK_MSG(s.seq_ssd == before.seq_ssd, "%s: groups still read from the file once pinned", model);
                logits_free(&again);
            }
        }
        if (pat == P_HOST) CHECK(s.seq_ssd == 0 && s.ssd_group_bytes == 0);
        if (pat == P_SSD || pat == P_PREAD) CHECK(s.seq_host == 0 && s.ssd_group_bytes > 0);
        if (pat == P_PREAD) CHECK(!s.uring && !s.direct);
        if (pat == P_SSD) CHECK(s.uring == uring_available(files)); /* seccomp may forbid it: pread then */
        if (pat == P_PLANNED)
            printf("  %-16s planned at device %zu, host %zu: %d device / %d host / %d ssd groups, ring %d x %zu\n",
                   model, dev, host, pl->groups[0], pl->groups[1], pl->groups[2], pl->ring_slots, pl->slot_bytes);
        logits_free(&out);
    }
    test_llama_close(m, g_kv);
    g_kv = NULL;
    CHECK(be->device_budget.used == 0);
    st_backend_free(be);
    free(tiers);
}

static bool resident_run(st_model_files *files, logits_t *ref) {
    st_backend *be = cpu(0);
    st_llama_params lp = base_params();
    st_llama *m = NULL;
    strata_status st = test_llama_open(files, be, &lp, ST_KV_F32, &m, &g_kv);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    int fw;
    if (st == STRATA_OK) {
        CHECK(st_wm_all_resident(st_llama_weights(m)));
        st = run(m, files->config.vocab_size, ref, &fw);
        CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    }
    test_llama_close(m, g_kv);
    g_kv = NULL;
    st_backend_free(be);
    return st == STRATA_OK;
}

static void check_model(const char *name, const char *path) {
    st_model_files *files = NULL;
    strata_status st = st_model_open(path, &files);
    CHECK_MSG(st == STRATA_OK, "%s: %s", path, st_last_error());
    if (st) return;
    logits_t ref = {0};
    if (resident_run(files, &ref))
        for (int p = 0; p < P_COUNT; p++) check_case(name, files, (pattern)p, &ref);
    logits_free(&ref);
    st_model_close(files);
}

/* ---- several sequences at once on streamed weights ----
 * NSEQ sequences, each its own prompt, decoded together through
 * st_llama_forward (one token each per pass) on a streamed placement,
 * then each alone in other blocks of the same pool: the logits of every
 * step are bit-identical (the CPU backend is batch-invariant), so are the
 * tokens, and the bytes streamed per pass are the plan's. */

#define NSEQ 4
#define SEQ_PROMPT 6
#define SEQ_GEN 5
#define SEQ_BS 4

typedef struct {
    st_llama *m;
    st_kv_pool *kv;
    int64_t V, bps;
    int passes;
    int64_t cpu_max; /* passes of more tokens stream the CPU tier */
    int big_passes;  /* passes of more than cpu_max tokens */
} seq_run;

/* One pass: token i of `n` is tokens[i] at pos[i] of local sequence seq[i]
 * whose blocks are rows[seq[i]]; logits of every sequence's last token. */
static strata_status seq_pass(seq_run *r, int64_t n, const int32_t *tokens, const int32_t *pos, const int32_t *seq,
                              int64_t n_seqs, const int32_t *ctx, const int32_t *tables, float *logits) {
    int64_t slots[NSEQ * SEQ_PROMPT];
    int32_t rows[NSEQ];
    for (int64_t i = 0; i < n; i++)
        slots[i] = (int64_t)tables[seq[i] * r->bps + pos[i] / SEQ_BS] * SEQ_BS + pos[i] % SEQ_BS;
    int64_t nl = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == n - 1 || seq[i + 1] != seq[i]) rows[nl++] = (int32_t)i;
    const st_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq = seq, .slots = slots, .n_seqs = n_seqs,
                        .block_tables = tables, .max_blocks = r->bps, .ctx_lens = ctx, .logit_rows = rows,
                        .n_logits = nl};
    r->passes++;
    r->big_passes += n > r->cpu_max;
    return st_llama_forward(r->m, r->kv, &b, logits);
}

static int32_t arg_max(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int32_t)b;
}

/* Runs sequences first..first+B-1 (pool rows first.., prompts by sequence
 * number) together: prefill (each prompt in passes of at most BATCH tokens,
 * one sequence per pass) then SEQ_GEN decode passes of B tokens. Logits of
 * decode step g of sequence s go to out[(s * SEQ_GEN + g) * V], tokens to
 * toks[s * SEQ_GEN + g]. */
static strata_status seq_group(seq_run *r, int first, int B, int row0, float *out, int32_t *toks) {
    const int64_t V = r->V;
    int32_t tables[NSEQ * 8], tk[NSEQ * SEQ_PROMPT], pos[NSEQ * SEQ_PROMPT], seq[NSEQ * SEQ_PROMPT], ctx[NSEQ];
    float *l = malloc((size_t)(NSEQ * V) * sizeof(float));
    int32_t next[NSEQ];
    strata_status st = STRATA_OK;
    for (int s = 0; s < B; s++)
        for (int64_t j = 0; j < r->bps; j++) tables[s * r->bps + j] = (int32_t)((row0 + s) * r->bps + j);
    for (int s = 0; s < B && st == STRATA_OK; s++) /* prefill, one sequence per pass, chunks of BATCH */
        for (int p0 = 0; p0 < SEQ_PROMPT && st == STRATA_OK; p0 += BATCH) {
            const int k = SEQ_PROMPT - p0 < BATCH ? SEQ_PROMPT - p0 : BATCH;
            for (int i = 0; i < k; i++) {
                tk[i] = tok((first + s) * 1000 + p0 + i, V);
                pos[i] = p0 + i;
                seq[i] = 0;
            }
            ctx[0] = p0 + k;
            st = seq_pass(r, k, tk, pos, seq, 1, ctx, tables + s * r->bps, l);
            if (st == STRATA_OK && p0 + k == SEQ_PROMPT) next[s] = arg_max(l, V);
        }
    for (int g = 0; g < SEQ_GEN && st == STRATA_OK; g++) {
        for (int s = 0; s < B; s++) {
            tk[s] = next[s];
            pos[s] = SEQ_PROMPT + g;
            seq[s] = s;
            ctx[s] = SEQ_PROMPT + g + 1;
        }
        st = seq_pass(r, B, tk, pos, seq, B, ctx, tables, l);
        for (int s = 0; s < B && st == STRATA_OK; s++) {
            memcpy(out + ((size_t)(first + s) * SEQ_GEN + g) * V, l + (size_t)s * V, (size_t)V * sizeof(float));
            toks[(first + s) * SEQ_GEN + g] = next[s] = arg_max(l + (size_t)s * V, V);
        }
    }
    free(l);
    return st;
}

static void check_batched(const char *name, st_model_files *files, pattern pat) {
    const int64_t V = files->config.vocab_size;
    const int n = 2 * (int)files->config.n_layers + 2;
    st_tier *tiers = calloc((size_t)n, sizeof *tiers);
    fill_pattern(pat, n, tiers);
    st_llama_params lp = base_params();
    lp.weights.placement = tiers;
    lp.weights.host_mem = (size_t)1 << 30;
    lp.weights.probe_scratch = true; /* the backend scratch probe exercised on the CPU */
    lp.weights.cpu_max_tokens = cpu_max_of(pat);
    lp.weights.cpu_split = pat == P_SPLIT ? 0.5 : 0;
    lp.weights.cpu_threads = 2;
    const int64_t bps = (SEQ_PROMPT + SEQ_GEN + SEQ_BS - 1) / SEQ_BS;
    lp.max_seq_len = bps * SEQ_BS;
    const st_kv_pool_params kp = st_llama_kv_params_for(&files->config, BATCH, lp.max_seq_len, 2 * NSEQ * bps, SEQ_BS,
                                                        ST_KV_F32);
    lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    st_backend *be = cpu((size_t)1 << 30);
    lp.device_mem = (size_t)1 << 30;
    seq_run r = {NULL, NULL, V, bps, 0, cpu_max_of(pat), 0};
    strata_status st = st_llama_measure(files, be, &lp); /* the scratch probe runs (forced on the CPU: 0 bytes) */
    CHECK_MSG(st == STRATA_OK, "%s batched %s: measure: %s", name, k_names[pat], st_last_error());
    if (st == STRATA_OK) st = st_llama_init(files, be, &lp, &r.m);
    CHECK_MSG(st == STRATA_OK, "%s batched %s: init: %s", name, k_names[pat], st_last_error());
    if (st == STRATA_OK) st = st_kv_pool_init(be, &kp, &r.kv);
    CHECK_MSG(st == STRATA_OK, "%s batched %s: kv: %s", name, k_names[pat], st_last_error());
    float *a = calloc((size_t)(NSEQ * SEQ_GEN * V), sizeof(float)), *b = calloc((size_t)(NSEQ * SEQ_GEN * V), sizeof(float));
    int32_t ta[NSEQ * SEQ_GEN], tb[NSEQ * SEQ_GEN];
    if (st == STRATA_OK) {
        st_wm *wm = st_llama_weights(r.m);
        CHECK(st_wm_streamed(wm) > 0);
        st_wm_stats s0, s1;
        st_wm_stats_get(wm, &s0);
        r.passes = r.big_passes = 0;
        st = seq_group(&r, 0, NSEQ, 0, a, ta); /* all at once */
        CHECK_MSG(st == STRATA_OK, "%s batched %s: %s", name, k_names[pat], st_last_error());
        for (int s = 0; s < NSEQ && st == STRATA_OK; s++) { /* each alone, in other blocks */
            st = seq_group(&r, s, 1, NSEQ + s, b, tb);
            CHECK_MSG(st == STRATA_OK, "%s batched %s alone: %s", name, k_names[pat], st_last_error());
        }
        if (st == STRATA_OK) {
            CHECK_MSG(!memcmp(ta, tb, sizeof ta), "%s batched %s: tokens of %d sequences at once differ from each alone",
                      name, k_names[pat], NSEQ);
            /* a split one: 4-token decode steps stream the cpu tier whole, 1-token ones split it */
            const double d = rel_diff(a, b, NSEQ * SEQ_GEN * V);
            CHECK_MSG(d <= (pat == P_SPLIT ? SPLIT_TOL : 0),
                      "%s batched %s: logits of %d sequences at once differ from each alone by %g of the largest",
                      name, k_names[pat], NSEQ, d);
            st_wm_stats_get(wm, &s1);
            const st_wplan *pl = st_wm_plan(wm);
            CHECK_MSG(s1.h2d_bytes - s0.h2d_bytes == (uint64_t)r.passes * (pl->step_ssd_bytes + pl->step_host_bytes) +
                                                         (uint64_t)r.big_passes *
                                                             (pl->bytes[ST_TIER_CPU] - pl->step_split_bytes) &&
                          s1.cpu_bytes - s0.cpu_bytes == (uint64_t)(r.passes - r.big_passes) * pl->step_cpu_bytes &&
                          s1.ssd_group_bytes - s0.ssd_group_bytes == (uint64_t)r.passes * pl->step_ssd_img_bytes,
                      "%s batched %s: %llu / %llu bytes in %d passes, plan %llu / %llu per pass", name, k_names[pat],
                      (unsigned long long)(s1.h2d_bytes - s0.h2d_bytes),
                      (unsigned long long)(s1.ssd_group_bytes - s0.ssd_group_bytes), r.passes,
                      (unsigned long long)(pl->step_ssd_bytes + pl->step_host_bytes),
                      (unsigned long long)pl->step_ssd_img_bytes);
        }
    }
    free(a);
    free(b);
    if (r.m && r.kv) st_llama_forget_pool(r.m, r.kv);
    st_kv_pool_free(r.kv);
    st_llama_free(r.m);
    CHECK(be->device_budget.used == 0);
    st_backend_free(be);
    free(tiers);
}

/* ---- a generated model: 8 layers, tensors at unaligned offsets, scattered ---- */

enum { G_VOCAB = 384, G_HID = 64, G_HEADS = 4, G_KV = 2, G_HD = 16, G_INTER = 192, G_LAYERS = 8 };

static uint32_t g_rng = 99;
static float frand(void) {
    g_rng = g_rng * 1664525u + 1013904223u;
    return (float)((g_rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static bool write_model(const char *dir) {
    struct { char name[96]; int64_t r, c; bool f32; } d[3 + 9 * G_LAYERS];
    int nd = 0;
#define ADD(nm, rr, cc, ff) do { snprintf(d[nd].name, sizeof d[nd].name, "%s", nm); d[nd].r = rr; \
        d[nd].c = cc; d[nd].f32 = ff; nd++; } while (0)
    /* by tensor kind first, then layer: each group's tensors lie far apart */
    static const char *sfx[] = {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                                "self_attn.k_proj.weight", "mlp.gate_proj.weight", "self_attn.v_proj.weight",
                                "post_attention_layernorm.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight"};
    const int64_t rows[] = {G_HEADS * G_HD, G_HID, 1, G_KV * G_HD, G_INTER, G_KV * G_HD, 1, G_HID, G_INTER};
    const int64_t cols[] = {G_HID, G_INTER, G_HID, G_HID, G_HID, G_HID, G_HID, G_HEADS * G_HD, G_HID};
    ADD("lm_head.weight", G_VOCAB, G_HID, false);
    for (int k = 0; k < 9; k++)
        for (int l = G_LAYERS - 1; l >= 0; l--) {
            char n[96];
            snprintf(n, sizeof n, "model.layers.%d.%s", l, sfx[k]);
            ADD(n, rows[k], cols[k], rows[k] == 1);
        }
    ADD("model.norm.weight", 1, G_HID, true);
    ADD("model.embed_tokens.weight", G_VOCAB, G_HID, false);
    char *hdr = malloc(1 << 16);
    size_t hl = 0;
    uint64_t off = 0;
    hl += (size_t)snprintf(hdr + hl, 1 << 16, "{");
    for (int i = 0; i < nd; i++) {
        const uint64_t nb = (uint64_t)(d[i].r * d[i].c) * (d[i].f32 ? 4 : 2);
        char shape[64];
        if (d[i].r == 1) snprintf(shape, sizeof shape, "[%lld]", (long long)d[i].c);
        else snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)d[i].r, (long long)d[i].c);
        hl += (size_t)snprintf(hdr + hl, (1 << 16) - hl, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%llu,%llu]}",
                               i ? "," : "", d[i].name, d[i].f32 ? "F32" : "BF16", shape, (unsigned long long)off,
                               (unsigned long long)(off + nb));
        off += nb;
    }
    hdr[hl++] = '}';
    /* data starts 8 bytes short of a page: no tensor is page-aligned (O_DIRECT
     * reads the enclosing pages), every one is aligned to its element size
     * (as HF's writer pads the header; the CPU ops load f32 weights as floats) */
    while ((8 + hl) % 4096 != 4088) hdr[hl++] = ' ';
    char path[1100];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    const uint64_t hlen = hl;
    fwrite(&hlen, 8, 1, f);
    fwrite(hdr, 1, hl, f);
    free(hdr);
    for (int i = 0; i < nd; i++)
        for (int64_t j = 0; j < d[i].r * d[i].c; j++) {
            const float v = d[i].r == 1 ? 1.0f + 0.1f * frand() : 0.08f * frand();
            if (d[i].f32) {
                fwrite(&v, 4, 1, f);
            } else {
                const uint16_t h = st_f32_to_bf16(v);
                fwrite(&h, 2, 1, f);
            }
        }
    if (fclose(f) != 0) return false;
    snprintf(path, sizeof path, "%s/config.json", dir);
    char cfg[1024];
    const int cl = snprintf(cfg, sizeof cfg,
                            "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":%d,"
                            "\"hidden_size\":%d,\"intermediate_size\":%d,\"num_hidden_layers\":%d,"
                            "\"num_attention_heads\":%d,\"num_key_value_heads\":%d,\"head_dim\":%d,"
                            "\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,\"max_position_embeddings\":128,"
                            "\"tie_word_embeddings\":false,\"bos_token_id\":1,\"eos_token_id\":2}",
                            G_VOCAB, G_HID, G_INTER, G_LAYERS, G_HEADS, G_KV, G_HD);
    return test_write_file(path, cfg, (size_t)cl);
}

/* ---- faults ---- */

static st_llama_params ssd_params(int n, st_tier *tiers) {
    st_llama_params lp = base_params();
    for (int i = 0; i < n; i++) tiers[i] = ST_TIER_SSD;
    lp.weights.placement = tiers;
    lp.weights.host_mem = (size_t)1 << 30;
    return lp;
}

/* A run that fails: the error is STRATA_ERR_IO naming `want`, it repeats on
 * the next call, and whatever logits came back before it are right. */
static void check_fault(const char *what, st_model_files *files, const st_llama_params *lp, const logits_t *ref,
                        const char *want) {
    const int64_t V = files->config.vocab_size;
    st_backend *be = cpu((size_t)1 << 30);
    st_llama *m = NULL;
    st_llama_params lpc = *lp;
    lpc.device_mem = (size_t)1 << 30;
    strata_status st = test_llama_open(files, be, &lpc, ST_KV_F32, &m, &g_kv);
    if (st != STRATA_OK) { /* failed while pinning at init: also fine, if clear */
        CHECK_ERR(st, STRATA_ERR_IO, want, files->files[0].path);
        st_backend_free(be);
        return;
    }
    logits_t out = {0};
    int fw = 0;
    st = run(m, V, &out, &fw);
    CHECK_MSG(st == STRATA_ERR_IO, "%s: status %d (%s)", what, st, st_last_error());
    CHECK_ERR(st, STRATA_ERR_IO, want, files->files[0].path);
    if (strstr(want, "read")) CHECK_MSG(strstr(st_last_error(), "offset") != NULL, "%s: %s", what, st_last_error());
    printf("  %-28s -> %s\n", what, st_last_error());
    if (fw >= (N_PROMPT + BATCH - 1) / BATCH) {
        CHECK(!memcmp(out.prefill, ref->prefill, (size_t)(N_PROMPT * V) * sizeof(float)));
        const int done = fw - (N_PROMPT + BATCH - 1) / BATCH;
        CHECK(!memcmp(out.decode, ref->decode, (size_t)(done * V) * sizeof(float)));
    }
    int32_t t = 1;
    float *l = malloc((size_t)V * sizeof(float));
    CHECK_ERR(st_llama_forward_seq(m, g_kv, &t, 1, 0, false, l), STRATA_ERR_IO, want);
    free(l);
    logits_free(&out);
    test_llama_close(m, g_kv);
    g_kv = NULL;
    CHECK(be->device_budget.used == 0);
    st_backend_free(be);
}

static bool copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    bool ok = a && b;
    char buf[65536];
    size_t k;
    while (ok && (k = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, k, b) == k;
    if (a) fclose(a);
    if (b && fclose(b) != 0) ok = false;
    return ok;
}

/* A model file changed after loading: the next forward reports it. */
static void check_changed(const char *dir, bool streaming, bool truncate_it) {
    const char *tmp = test_tmpdir(streaming ? (truncate_it ? "changed_trunc" : "changed_stream") : "changed_res");
    char a[1100], b[1100];
    snprintf(a, sizeof a, "%s/config.json", dir);
    snprintf(b, sizeof b, "%s/config.json", tmp);
    CHECK(copy_file(a, b));
    snprintf(a, sizeof a, "%s/model.safetensors", dir);
    snprintf(b, sizeof b, "%s/model.safetensors", tmp);
    CHECK(copy_file(a, b));
    st_model_files *files = NULL;
    CHECK(st_model_open(tmp, &files) == STRATA_OK);
    if (!files) return;
    const int n = 2 * (int)files->config.n_layers + 2;
    st_tier tiers[2 * G_LAYERS + 2];
    st_llama_params lp = streaming ? ssd_params(n, tiers) : base_params();
    st_backend *be = cpu(streaming ? (size_t)1 << 30 : 0);
    lp.device_mem = streaming ? (size_t)1 << 30 : 0;
    st_llama *m = NULL;
    CHECK(test_llama_open(files, be, &lp, ST_KV_F32, &m, &g_kv) == STRATA_OK);
    if (m) {
        const int64_t V = files->config.vocab_size;
        float *l = malloc((size_t)V * sizeof(float));
        int32_t t = 5;
        CHECK(st_llama_forward_seq(m, g_kv, &t, 1, 0, false, l) == STRATA_OK);
        if (truncate_it) {
            CHECK(truncate(b, 4096 * 3) == 0);
        } else {
            struct timespec ts[2] = {{1000000000, 0}, {1000000000, 0}}; /* another mtime, same bytes */
            CHECK(utimensat(AT_FDCWD, b, ts, 0) == 0);
        }
        strata_status st = st_llama_forward_seq(m, g_kv, &t, 1, 0, false, l);
        CHECK_ERR(st, STRATA_ERR_IO, "changed", "model.safetensors");
        printf("  changed (%s%s) -> %s\n", streaming ? "streaming" : "resident", truncate_it ? ", truncated" : "",
               st_last_error());
        free(l);
    }
    test_llama_close(m, g_kv);
    g_kv = NULL;
    st_backend_free(be);
    st_model_close(files);
}

/* The ring's look-ahead in decode holds only groups the device computes: with
 * the ffn groups alternating host tier / CPU tier (attention resident) and
 * 2 ring slots, once the first streamed group is released and the CPU
 * computes the next CPU-tier group, the copier fills BOTH slots (the next
 * two host-tier groups), not one (a CPU-tier group taking a place in the
 * look-ahead); and with the CPU tier streamed (prefill) every non-resident
 * group is in the order again, the switch skipping what was prepared. */
static void check_lookahead(st_model_files *files) {
    st_wgroups *g = NULL;
    CHECK(st_wgroups_build(files, &g) == STRATA_OK);
    if (!g) return;
    const int n = g->n, L = (n - 2) / 2;
    CHECK(L >= 6);
    st_tier *t = calloc((size_t)n, sizeof *t);
    for (int i = 0; i < n; i++) t[i] = ST_TIER_DEVICE;
    for (int l = 0; l < L; l++) t[st_wg_ffn_id(l)] = l % 2 ? ST_TIER_CPU : ST_TIER_HOST;
    st_wplan_params pp = {.device_mem = 0, .host_mem = (size_t)1 << 30, .ring_slots = 2, .bw = k_bw, .force = t,
                          .cpu_ffn = 0, .staging_chunk = 8192, .staging_chunks = 3};
    st_wplan plan;
    CHECK(st_wplan_make(g, &pp, &plan) == STRATA_OK);
    st_backend *be = cpu(0);
    st_wm *wm = NULL;
    const st_wm_params wp = {.host_mem = (size_t)1 << 30, .pin_sync = true};
    CHECK(st_wm_init(be, files, g, &plan, &wp, &wm) == STRATA_OK);
    if (wm) {
        CHECK(st_wm_streamed(wm) == L); /* host and cpu tier: every ffn group */
        st_stream *s = NULL;
        CHECK(be->ops->stream_create(be, false, &s) == STRATA_OK);
        st_wm_view v;
        /* layer 0's ffn (host tier): acquired and released */
        CHECK(st_wm_acquire(wm, st_wg_ffn_id(0), &v) == STRATA_OK);
        CHECK(be->ops->event_record(be, v.done, s) == STRATA_OK);
        CHECK(st_wm_release(wm, st_wg_ffn_id(0), v.done) == STRATA_OK);
        /* layer 1's (cpu tier) computed on the CPU: meanwhile the copier fills layers 2 and 4 */
        const void *data[ST_WG_MAX_TENSORS];
        CHECK(st_wm_acquire_host(wm, st_wg_ffn_id(1), data) == STRATA_OK);
        st_wm_stats st;
        const double t0 = st_time_now();
        do st_wm_stats_get(wm, &st);
        while (st.copied < 3 && st_time_now() - t0 < 5);
        CHECK_MSG(st.copied == 3, "%llu groups copied while the CPU computes (want 1 used + 2 ahead)",
                  (unsigned long long)st.copied);
        CHECK_ERR(st_wm_acquire(wm, st_wg_ffn_id(3), &v), STRATA_ERR_INVALID_ARG, "not streamed", "cpu-tier");
        /* prefill: every ffn group streams, the CPU tier's too */
        st_wm_stream_cpu(wm, true);
        CHECK_ERR(st_wm_acquire_host(wm, st_wg_ffn_id(3), data), STRATA_ERR_INVALID_ARG, "streams");
        for (int l = 0; l < L; l++) {
            CHECK(st_wm_acquire(wm, st_wg_ffn_id(l), &v) == STRATA_OK);
            const st_wgroup *gr = &g->g[st_wg_ffn_id(l)];
            if (v.ready) CHECK(be->ops->stream_wait_event(be, s, v.ready) == STRATA_OK);
            CHECK(be->ops->stream_sync(be, s) == STRATA_OK);
            CHECK_MSG(!memcmp(v.data[0], st_tensor_data(files, gr->t[0].desc), gr->t[0].desc->nbytes),
                      "ffn %d: the slot's bytes differ from the file's", l);
            CHECK(be->ops->event_record(be, v.done, s) == STRATA_OK);
            CHECK(st_wm_release(wm, st_wg_ffn_id(l), v.done) == STRATA_OK);
        }
        st_wm_stats_get(wm, &st);
        CHECK_MSG(st.seq_host == (uint64_t)L + 1 && st.seq_cpu == 1, "host %llu, cpu %llu",
                  (unsigned long long)st.seq_host, (unsigned long long)st.seq_cpu);
        be->ops->stream_destroy(be, s);
        st_wm_free(wm);
    }
    st_backend_free(be);
    st_wplan_free(&plan);
    free(t);
    st_wgroups_free(g);
    printf("  look-ahead: the CPU tier's groups take no place in the ring while computed on the CPU\n");
}

int main(void) {
    /* every reference model */
    static const char *refs[] = {"gqa_f32", "gqa_sharded_f32", "gqa_tied_bf16", "headdim_f32",
                                 "llama3_bf16", "llama3_f32", "mha_tied_f32"};
    char rel[256];
    for (size_t i = 0; i < sizeof refs / sizeof refs[0]; i++) {
        snprintf(rel, sizeof rel, "tests/data/models/%s", refs[i]);
        check_model(refs[i], test_src_path(rel));
    }
    /* the generated one */
    char gdir[1024];
    snprintf(gdir, sizeof gdir, "%s", test_tmpdir("stream_model"));
    CHECK(write_model(gdir));
    check_model("generated-8-layer", gdir);
    { /* several sequences at once, streamed (and the backend scratch probe exercised on the CPU) */
        st_model_files *files = NULL;
        CHECK(st_model_open(gdir, &files) == STRATA_OK);
        for (int p = P_SSD; files && p <= P_MIX1; p++) check_batched("generated-8-layer", files, (pattern)p);
        check_batched("generated-8-layer", files, P_CPU1); /* the CPU tier: every pass on the CPU */
        check_batched("generated-8-layer", files, P_CPU2); /* 4-token passes stream it, the others compute it */
        check_batched("generated-8-layer", files, P_SPLIT); /* the same, split half and half */
        if (files) check_lookahead(files);
        st_wgroups *g = NULL;
        if (files && st_wgroups_build(files, &g) == STRATA_OK) { /* the CPU tier's rate probe */
            st_wbw bw = {0};
            CHECK(st_wbw_measure_cpu(files, g, 2, ST_CPU_ACT_PRECISE, 1, NULL, &bw) == STRATA_OK);
            CHECK_MSG(bw.cpu > 0 && bw.measured[4] && bw.h2d_shared == 0 && bw.cpu_shared == 0 && !bw.measured[5],
                      "cpu %g B/s, shared %g + %g", bw.cpu, bw.h2d_shared, bw.cpu_shared);
            /* a verification pass's rate (--cpu-pass-tokens): 5 tokens' activations and outputs (ASan
             * watches their buffers), int8 (the few-token kernels) */
            bw = (st_wbw){0};
            CHECK(st_wbw_measure_cpu(files, g, 2, ST_CPU_ACT_INT8, 5, NULL, &bw) == STRATA_OK);
            CHECK_MSG(bw.cpu > 0 && bw.measured[4], "cpu %g B/s at 5 tokens", bw.cpu);
            st_backend *be = cpu(0); /* a CPU "device": no shared probe either */
            bw = (st_wbw){.cpu = 7};
            CHECK(st_wbw_measure_cpu(files, g, 2, ST_CPU_ACT_PRECISE, 1, be, &bw) == STRATA_OK);
            CHECK(bw.cpu > 0 && bw.cpu != 7 && bw.h2d_shared == 0);
            st_backend_free(be);
            st_wgroups_free(g);
        }
        st_model_close(files);
        printf("  generated-8-layer: %d sequences at once = each alone (tokens, logits, bytes per pass)\n", NSEQ);
    }
    /* SmolLM2 (GGUF, q4_1, 30 layers) when fetched */
    const char *smol = test_src_path("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    g_big = true;
    if (access(smol, R_OK) == 0) check_model("smollm2-135m", smol);
    else printf("  (models/SmolLM2-135M-Instruct.Q4_1.gguf absent: not checked)\n");
    g_big = false;

    /* budgets too small */
    {
        st_model_files *files = NULL;
        CHECK(st_model_open(gdir, &files) == STRATA_OK);
        if (files) {
            st_backend *be = cpu(64 << 10);
            st_llama_params lp = base_params();
            lp.device_mem = 64 << 10;
            lp.weights.host_mem = 1 << 30;
            st_llama *m = NULL;
            CHECK_ERR(st_llama_init(files, be, &lp, &m), STRATA_ERR_NOMEM, "device budget", "at least", "KV cache");
            printf("  too small -> %s\n", st_last_error());
            CHECK(m == NULL && be->device_budget.used == 0);
            st_backend_free(be);
            be = cpu(300 << 10);
            lp.device_mem = 300 << 10;
            lp.weights.host_mem = 4096;
            CHECK_ERR(st_llama_init(files, be, &lp, &m), STRATA_ERR_NOMEM, "host budget", "at least");
            printf("  too small -> %s\n", st_last_error());
            st_backend_free(be);

            /* faults on the generated model */
            logits_t ref = {0};
            CHECK(resident_run(files, &ref));
            const int n = 2 * G_LAYERS + 2;
            st_tier tiers[2 * G_LAYERS + 2];
            lp = ssd_params(n, tiers);
            lp.weights.stream.faults.fail_nth = 5;
            check_fault("I/O error in prefill", files, &lp, &ref, "failed");
            lp.weights.stream.faults.fail_nth = 0;
            lp.weights.stream.faults.short_nth = 7;
            check_fault("short read in prefill", files, &lp, &ref, "short read");
            lp.weights.stream.use_pread = true;
            check_fault("short read (pread)", files, &lp, &ref, "short read");
            lp.weights.stream.use_pread = false;
            lp.weights.stream.faults.short_nth = 0;
            /* in decode: 3/4 into a clean run's reads (the prefill is 3 of 7 passes) */
            {
                st_backend *b2 = cpu((size_t)1 << 30);
                lp.device_mem = (size_t)1 << 30;
                st_llama *m2 = NULL;
                CHECK(test_llama_open(files, b2, &lp, ST_KV_F32, &m2, &g_kv) == STRATA_OK);
                logits_t o2 = {0};
                int fw = 0;
                st_wm_stats s2 = {0};
                if (m2) {
                    CHECK(run(m2, files->config.vocab_size, &o2, &fw) == STRATA_OK);
                    st_wm_stats_get(st_llama_weights(m2), &s2);
                }
                logits_free(&o2);
                test_llama_close(m2, g_kv);
                g_kv = NULL;
                st_backend_free(b2);
                lp.weights.stream.faults.fail_nth = (int64_t)(s2.ssd_reads * 3 / 4);
                check_fault("I/O error in decode", files, &lp, &ref, "failed");
            }
            /* while pinning the host tier, at init and in the background */
            for (int i = 1; i < n; i++) tiers[i] = ST_TIER_HOST;
            lp.weights.stream.faults.fail_nth = 4;
            check_fault("I/O error pinning at init", files, &lp, &ref, "failed");
            lp.weights.stream.pin_sync = false;
            check_fault("I/O error pinning (bg)", files, &lp, &ref, "failed");
            logits_free(&ref);
            st_model_close(files);
        }
    }
    /* files changed underneath */
    check_changed(gdir, true, false);
    check_changed(gdir, true, true);
    check_changed(gdir, false, false);
    return test_finish("test_weights_stream");
}

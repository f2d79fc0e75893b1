/* Contexts longer than the device (issue 13): a sequence whose KV lives in
 * host memory (kv/kv_stream.h), streamed through a device ring of a few
 * MB, gives the logits of a run whose KV fits the pool, bit for bit on the
 * CPU backend.
 *
 * (1) Long: a tiny model (tests/data/models/llama3_f32: 2 layers, 2 kv heads
 *     of 16) at N_LONG prompt tokens (prefilled in passes of 512) then
 *     N_DEC decode steps, bf16 KV, the host holding 2 segments of 4096 keys
 *     and the SSD tier (a file in a test directory) the other 11: the
 *     logits of the last prompt position and
 *     of every decode step from st_llama_forward_stream equal (memcmp)
 *     those of st_llama_forward_seq over a pool that holds the whole
 *     sequence. Attention pieces of 4096 keys (many pieces per layer, the
 *     ring's two slots reused across layers). The device memory the streamed
 *     run takes (the backend's budget peak, beyond the model) stays under
 *     KV_BUDGET, while the fitting run's pool takes N x 2 x 2 x 16 x 2 bytes
 *     (~13 MB); the stream moved exactly the bytes its plan says.
 * (2) Short, f32 KV, odd lengths and small passes: prompt 700 in passes of
 *     64 (the tail range and the pass straddle range boundaries), decode 5,
 *     all logits of every position compared.
 * On a GPU machine the same runs (short, 20K tokens, fp8) also on CUDA,
 * within 1e-4 of the largest logit instead of bit for bit.
 * (2b) fp8 KV: 9000 tokens (2 segments of 4096 on the host, 1 on the SSD),
 *     the K/V scales streamed with the rows: the same bits as the fitting fp8 pool (whose prefill chunks gather with kv_gather
 *     and whose decodes read the pool through attention_paged).
 * (3) Errors: a stream not made for the model, a context past max_len, host
 *     memory past its cap (NOMEM naming --kv-stream-mem, nothing stored), a
 *     piece size that is not a multiple of ST_ATTN_RANGE. The SSD tier's:
 *     a pass writing into more segments than the host holds, the file's
 *     cap, a directory that cannot be made (nothing stored, the stream goes
 *     on with a host-only stream's bits where it can).
 * (4) Bounded activations: one pass of 6000 tokens (its FFN in sub-chunks of
 *     ST_PLAN_FFN_ROWS = 4096 rows) gives the logits of passes of 512, bit for
 *     bit, and the planner's activation bytes grow from passes of 4096 to
 *     16384 tokens by the same amount whatever the FFN's width.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kv/kv_pool.h"
#include "kv/kv_stream.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "testutil.h"

/* 50K tokens take ~2 minutes on 2 cores (the attention is quadratic: both
 * runs); the sanitizer builds (-O0) check the same code at 8K */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define N_LONG 8192
#else
#define N_LONG 50000
#endif
#define N_DEC 3
#define KV_BUDGET ((size_t)4 << 20)

typedef struct {
    int64_t prompt, dec, max_tokens, piece;
    st_kv_dtype dtype;
    bool all_logits;
    double tol; /* 0: bit-identical (CPU); else max |a - b| / max |a| (CUDA: other kernels for decode) */
    int64_t seg;       /* the streamed run's segment (0: the default) */
    int64_t host_segs; /* > 0: host memory for this many segments, the rest on the SSD tier (a directory) */
    double cpu_attn;   /* the streamed run's share of earlier keys attended on the CPU (decode passes) */
    bool cpu_tier;     /* the streamed model's last FFN on the CPU tier: its CPU backend attends the CPU's
                          keys concurrently with the device's part, merged after it (the path of a GPU) */
} run_cfg;

/* logits: [rows, V] of the fitting run (fit) and the streamed one (str):
 * all prompt rows or the last one, then one per decode step. */
static void run_both(st_backend *be, st_model_files *f, const run_cfg *rc, const char *label) {
    const int64_t total = rc->prompt + rc->dec, V = f->config.vocab_size;
    const int64_t rows = (rc->all_logits ? rc->prompt : 1) + rc->dec;
    int32_t *tok = malloc((size_t)total * sizeof *tok);
    float *fit = calloc((size_t)(rows * V), sizeof(float)), *str = calloc((size_t)(rows * V), sizeof(float));
    uint64_t rng = 0x243f6a8885a308d3ull ^ (uint64_t)rc->prompt;
    for (int64_t i = 0; i < total; i++) tok[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
    st_llama_params lp = {.max_seq_len = total, .max_tokens = rc->max_tokens, .attn_piece = rc->piece};

    /* the fitting run */
    st_llama *m = NULL;
    st_kv_pool *kv = NULL;
    CHECK(test_llama_open(f, be, &lp, rc->dtype, &m, &kv) == STRATA_OK);
    if (!m) goto out;
    const size_t pool_bytes = st_kv_pool_device_bytes(st_kv_pool_get_params(kv));
    strata_status st = st_llama_forward_seq(m, kv, tok, rc->prompt, 0, rc->all_logits, fit);
    for (int64_t i = 0; st == STRATA_OK && i < rc->dec; i++)
        st = st_llama_forward_seq(m, kv, tok + rc->prompt + i, 1, rc->prompt + i, false,
                                  fit + ((rc->all_logits ? rc->prompt : 1) + i) * V);
    CHECK_MSG(st == STRATA_OK, "%s: fitting run: %s", label, st_last_error());
    test_llama_close(m, kv);
    m = NULL;

    /* the streamed run: no pool */
    const size_t used0 = be->device_budget.used;
    lp.cpu_attn = rc->cpu_attn;
    st_tier tiers[64] = {0}; /* device, but the last layer's FFN group */
    if (rc->cpu_tier) {
        tiers[2 * f->config.n_layers] = ST_TIER_CPU;
        lp.weights.placement = tiers;
        lp.weights.bw = (st_wbw){.h2d = 10e9, .ssd = 1e9, .dev_read = 10e9, .gemm = 1e10};
        lp.weights.host_mem = (size_t)1 << 30;
        lp.weights.cpu_threads = 2;
    }
    CHECK(st_llama_init(f, be, &lp, &m) == STRATA_OK);
    if (!m) goto out;
    const size_t model_bytes = be->device_budget.used - used0;
    be->device_budget.peak = be->device_budget.used;
    st_kv_stream *ks = NULL;
    st_kv_stream_params sp = st_llama_stream_params(m, total, rc->dtype, 0);
    sp.seg = rc->seg;
    if (rc->host_segs) {
        sp.host_mem = (size_t)rc->host_segs * st_kv_stream_host_bytes(&sp, 1);
        sp.ssd_dir = test_tmpdir("kv_stream_ssd");
    }
    CHECK(sp.piece == rc->piece);
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    if (!ks) goto out;
    st = st_llama_forward_stream(m, ks, tok, rc->prompt, 0, rc->all_logits, str);
    for (int64_t i = 0; st == STRATA_OK && i < rc->dec; i++)
        st = st_llama_forward_stream(m, ks, tok + rc->prompt + i, 1, 0, false,
                                     str + ((rc->all_logits ? rc->prompt : 1) + i) * V);
    CHECK_MSG(st == STRATA_OK, "%s: streamed run: %s", label, st_last_error());
    const size_t peak = be->device_budget.peak - used0 - model_bytes;
    CHECK(st_kv_stream_len(ks) == total);
    int64_t bad = -1;
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (bad < 0 && memcmp(fit + r * V, str + r * V, (size_t)V * sizeof(float))) bad = r;
        for (int64_t j = 0; j < V; j++) {
            const double d = fabs((double)fit[r * V + j] - str[r * V + j]);
            if (!(d <= num)) num = d;
            if (fabs(fit[r * V + j]) > den) den = fabs(fit[r * V + j]);
        }
    }
    if (rc->tol == 0)
        CHECK_MSG(bad < 0, "%s: logits row %lld of %lld differ between the fitting and the streamed run (%g vs %g)",
                  label, (long long)bad, (long long)rows, bad >= 0 ? fit[bad * V] : 0.0,
                  bad >= 0 ? str[bad * V] : 0.0);
    else
        CHECK_MSG(num / den <= rc->tol && den > 0, "%s: logits differ by %g (relative to max %g), more than %g", label,
                  num / den, den, rc->tol);
    if (rc->tol > 0) printf("%s: max relative difference of the logits %.3g (tolerance %g)\n", label, num / den, rc->tol);
    /* what crossed: every pass reads keys [0, len) of every layer (pieces, then the tail range) and writes
     * its own rows; K and V */
    uint64_t up = 0, down = 0, want_up = 0;
    const size_t row = (size_t)(sp.n_kv_heads * sp.head_dim) * st_kv_dtype_size(sp.dtype) +
                       (sp.dtype == ST_KV_FP8 ? (size_t)sp.n_kv_heads * 4 : 0); /* fp8: its scales too */
    /* every pass reads keys [0, len) of every layer, but those the CPU attends from host memory in a pass of
     * at most ST_PLAN_CPU_MAX_TOKENS: [0, c), c = the share of len rounded down to 256, at most the tail start
     * and the host segments before the first in the file; the share 1 on the CPU backend unless given (the
     * device is the CPU), else only when given */
    const bool cpu_dev = be->kind == ST_BACKEND_CPU;
    const double share = rc->cpu_attn > 0 ? rc->cpu_attn : cpu_dev ? 1.0 : 0.0;
    const int64_t segk = rc->seg ? rc->seg : ST_KV_STREAM_SEG;
    int64_t cpu_keys = 0;
    for (int64_t len = 0; len < total;) {
        const int64_t n = len < rc->prompt ? (rc->prompt - len < rc->max_tokens ? rc->prompt - len : rc->max_tokens)
                                           : 1;
        const int64_t ts = len / ST_ATTN_RANGE * ST_ATTN_RANGE;
        /* a segment is in the file once a pass needs more than host_segs: from then on the host keeps
         * segments 0 .. host_segs - 2 below it */
        const int64_t host_keys =
            rc->host_segs && (len + n + segk - 1) / segk > rc->host_segs ? (rc->host_segs - 1) * segk : INT64_MAX;
        int64_t c = n <= ST_PLAN_CPU_MAX_TOKENS ? (int64_t)(share * (double)len) : 0;
        c = c < ts ? c : ts;
        c = c < host_keys ? c : host_keys;
        c = c / ST_ATTN_RANGE * ST_ATTN_RANGE;
        cpu_keys += c;
        want_up += (uint64_t)(len - c);
        len += n;
    }
    want_up *= 2 * (uint64_t)sp.n_layers * row;
    st_kv_stream_bytes(ks, &up, &down);
    if (share > 0) {
        CHECK_MSG(cpu_keys > 0, "%s: no key attended on the CPU", label);
        printf("%s: the passes attended %lld keys of each layer on the CPU from host memory (share %g)\n", label,
               (long long)cpu_keys, share);
    }
    CHECK_MSG(up == want_up && down == 2 * (uint64_t)sp.n_layers * row * (uint64_t)total,
              "%s: moved up %llu (want %llu), down %llu", label, (unsigned long long)up,
              (unsigned long long)want_up, (unsigned long long)down);
    printf("%s: %lld tokens, %lld logit rows %s; device KV: streamed %.2f MB (ring, areas, iota, "
           "metadata) vs a fitting pool %.2f MB; host %.2f MB; moved up %.1f MB, down %.1f MB\n",
           label, (long long)total, (long long)rows, rc->tol == 0 ? "bit-identical" : "compared", peak / 1e6,
           pool_bytes / 1e6,
           st_kv_stream_host_used(ks) / 1e6, up / 1e6, down / 1e6);
    /* the SSD tier: the host holds host_segs segments, every other one whole in the file; each went there
     * once (written once), and every pass read the pieces of those it found there */
    st_kv_stream_ssd_stats ss;
    st_kv_stream_ssd(ks, &ss);
    if (rc->host_segs) {
        const int64_t segk = rc->seg ? rc->seg : ST_KV_STREAM_SEG, segs = (total + segk - 1) / segk;
        const size_t set = st_kv_stream_host_bytes(&sp, 1);
        CHECK_MSG(ss.host_segs == rc->host_segs && ss.ssd_segs == segs - rc->host_segs &&
                      st_kv_stream_host_used(ks) == (size_t)rc->host_segs * set &&
                      ss.written == (uint64_t)ss.ssd_segs * set && ss.file_bytes == ss.written,
                  "%s: %lld segments on the host (want %lld), %lld on the SSD (want %lld), %llu bytes written "
                  "(want %llu), host %zu", label, (long long)ss.host_segs, (long long)rc->host_segs,
                  (long long)ss.ssd_segs, (long long)(segs - rc->host_segs), (unsigned long long)ss.written,
                  (unsigned long long)(ss.ssd_segs * set), st_kv_stream_host_used(ks));
        /* reads: a segment goes to the SSD when the first pass past it begins (with passes of max_tokens
         * dividing the segment, at len = its end rounded up to a pass... every later pass reads it) */
        uint64_t want_read = 0;
        int64_t on_ssd = 0; /* segments [.., on_ssd) in the file, newest sealed first: all but host_segs - 1 */
        int64_t len = 0;
        for (int64_t i = 0; len < total; i++) {
            const int64_t n = len < rc->prompt ? (rc->prompt - len < rc->max_tokens ? rc->prompt - len
                                                                                      : rc->max_tokens) : 1;
            const int64_t need = (len + n + segk - 1) / segk; /* segments placed after begin */
            const int64_t sealed_ssd = need > rc->host_segs ? need - rc->host_segs : 0;
            on_ssd = sealed_ssd > on_ssd ? sealed_ssd : on_ssd;
            const int64_t ts = len / ST_ATTN_RANGE * ST_ATTN_RANGE;
            /* the file holds segments host_segs - 1 .. host_segs - 2 + on_ssd: whole pieces below ts */
            for (int64_t sgm = rc->host_segs - 1; sgm < rc->host_segs - 1 + on_ssd; sgm++) {
                const int64_t a = sgm * segk, e = (sgm + 1) * segk < ts ? (sgm + 1) * segk : ts;
                if (e > a) want_read += (uint64_t)(e - a);
            }
            len += n;
        }
        want_read *= 2 * (uint64_t)sp.n_layers * row;
        CHECK_MSG(ss.read == want_read, "%s: read %llu bytes from the SSD, want %llu", label,
                  (unsigned long long)ss.read, (unsigned long long)want_read);
        printf("%s: SSD tier: %lld of %lld segments of %lld tokens in the file (%.2f MB), read %.1f MB; host %lld "
               "segments\n", label, (long long)ss.ssd_segs, (long long)segs, (long long)segk, ss.file_bytes / 1e6,
               ss.read / 1e6, (long long)ss.host_segs);
    } else {
        CHECK(ss.ssd_segs == 0 && ss.read == 0 && ss.written == 0);
    }
    CHECK_MSG(peak <= st_kv_stream_device_bytes(&sp), "%s: the streamed run took %zu device bytes beyond the model, "
              "more than the stream's %zu", label, peak, st_kv_stream_device_bytes(&sp));
    if (rc->prompt >= 8192) {
        CHECK_MSG(peak <= KV_BUDGET, "%s: streamed device KV %zu > budget %zu", label, peak, KV_BUDGET);
        if (rc->prompt >= 50000) /* the sanitizer builds' 8K: a 3 MB pool */
            CHECK_MSG(pool_bytes > 3 * KV_BUDGET, "%s: the fitting pool (%zu bytes) is not much larger than the budget",
                      label, pool_bytes);
    }
    st_kv_stream_free(ks);
out:
    st_llama_free(m);
    free(tok);
    free(fit);
    free(str);
}

static void test_errors(st_backend *be, st_model_files *f) {
    st_llama_params lp = {.max_seq_len = 4096, .max_tokens = 64, .attn_piece = 256};
    st_llama *m = NULL;
    CHECK(st_llama_init(f, be, &lp, &m) == STRATA_OK);
    if (!m) return;
    int32_t tok[64] = {0};
    float *lg = malloc((size_t)f->config.vocab_size * sizeof(float));
    st_kv_stream *ks = NULL;
    /* another piece size: not this model's */
    st_kv_stream_params sp = st_llama_stream_params(m, 100, ST_KV_BF16, 0);
    sp.piece = 512;
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 8, 0, false, lg), STRATA_ERR_INVALID_ARG, "not made for this model");
    st_kv_stream_free(ks);
    ks = NULL;
    /* past max_len */
    sp = st_llama_stream_params(m, 100, ST_KV_BF16, 0);
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    CHECK(st_llama_forward_stream(m, ks, tok, 64, 0, false, lg) == STRATA_OK);
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 40, 0, false, lg), STRATA_ERR_INVALID_ARG, "exceed the context");
    CHECK(st_kv_stream_len(ks) == 64);
    st_kv_stream_free(ks);
    ks = NULL;
    /* host memory past the cap: one segment is more than 1 KB */
    sp = st_llama_stream_params(m, 100, ST_KV_BF16, 1024);
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 8, 0, false, lg), STRATA_ERR_NOMEM, "--kv-stream-mem");
    CHECK(st_kv_stream_len(ks) == 0 && st_kv_stream_host_used(ks) == 0);
    st_kv_stream_free(ks);
    ks = NULL;
    sp = st_llama_stream_params(m, 100, ST_KV_BF16, 0);
    sp.piece = 300;
    CHECK_ERR(st_kv_stream_init(be, &sp, &ks), STRATA_ERR_INVALID_ARG, "piece");
    free(lg);
    st_llama_free(m);
}

/* The SSD tier's limits: a pass whose segments do not all fit the host (the segments a pass writes stay
 * there), the file's cap, a directory that cannot be made; each NOMEM / IO names what to change, the
 * pass is not begun (len unchanged), and the stream goes on where it can with the bits of a host-only one. */
static void test_ssd_errors(st_backend *be, st_model_files *f) {
    st_llama_params lp = {.max_seq_len = 16384, .max_tokens = 512, .attn_piece = 4096};
    st_llama *m = NULL;
    CHECK(st_llama_init(f, be, &lp, &m) == STRATA_OK);
    if (!m) return;
    const int64_t V = f->config.vocab_size;
    int32_t tok[512];
    for (int i = 0; i < 512; i++) tok[i] = (int32_t)((i * 7919) % V);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    st_kv_stream *ks = NULL, *ref = NULL;
    st_kv_stream_params sp = st_llama_stream_params(m, 16384, ST_KV_BF16, 0);
    sp.seg = 4096;
    CHECK(st_kv_stream_init(be, &sp, &ref) == STRATA_OK);
    const size_t set = st_kv_stream_host_bytes(&sp, 1);
    sp.host_mem = set; /* one segment */
    sp.ssd_dir = test_tmpdir("kv_stream_ssd_errors");
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    if (!ks || !ref) goto out;
    for (int i = 0; i < 8; i++) { /* to 4000 */
        CHECK(st_llama_forward_stream(m, ks, tok, 500, 0, false, a) == STRATA_OK);
        CHECK(st_llama_forward_stream(m, ref, tok, 500, 0, false, b) == STRATA_OK);
    }
    /* 4000 + 200 would write into segments 0 and 1: two on the host, one allowed */
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 200, 0, false, a), STRATA_ERR_NOMEM, "raise --kv-stream-mem");
    CHECK(st_kv_stream_len(ks) == 4000);
    /* to 4096, then past it: segment 0 is sealed and goes to the file */
    CHECK(st_llama_forward_stream(m, ks, tok, 96, 0, false, a) == STRATA_OK);
    CHECK(st_llama_forward_stream(m, ref, tok, 96, 0, false, b) == STRATA_OK);
    for (int i = 0; i < 3; i++) {
        CHECK(st_llama_forward_stream(m, ks, tok + i, 1, 0, false, a) == STRATA_OK);
        CHECK(st_llama_forward_stream(m, ref, tok + i, 1, 0, false, b) == STRATA_OK);
        CHECK_MSG(!memcmp(a, b, (size_t)V * sizeof(float)), "decode %d over a segment in the file differs from the "
                  "host-only stream", i);
    }
    st_kv_stream_ssd_stats ss;
    st_kv_stream_ssd(ks, &ss);
    CHECK(ss.ssd_segs == 1 && ss.host_segs == 1 && ss.written == set && ss.read > 0);
    /* a new sequence (reset): the file's slot is free, the host segment is segment 0; it goes on as before */
    st_kv_stream_reset(ks);
    st_kv_stream_reset(ref);
    st_kv_stream_ssd(ks, &ss);
    CHECK(ss.ssd_segs == 0 && ss.host_segs == 1 && ss.file_bytes == 0);
    for (int i = 0; i < 9; i++) { /* to 4608: segment 0 to the file again at 4096 */
        CHECK(st_llama_forward_stream(m, ks, tok, 512, 0, false, a) == STRATA_OK);
        CHECK(st_llama_forward_stream(m, ref, tok, 512, 0, false, b) == STRATA_OK);
    }
    CHECK_MSG(!memcmp(a, b, (size_t)V * sizeof(float)), "after a reset, the stream over the file differs");
    st_kv_stream_ssd(ks, &ss);
    CHECK(ss.ssd_segs == 1 && ss.host_segs == 1 && ss.file_bytes == set && ss.written == 2 * set);
    st_kv_stream_free(ks);
    ks = NULL;
    /* the file's cap: one segment; the second one has no room (the segment stays on the host) */
    sp.ssd_mem = set;
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    for (int i = 0; i < 16 && ks; i++) CHECK(st_llama_forward_stream(m, ks, tok, 512, 0, false, a) == STRATA_OK);
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 512, 0, false, a), STRATA_ERR_NOMEM, "--kv-ssd-size");
    CHECK(st_kv_stream_len(ks) == 8192);
    st_kv_stream_ssd(ks, &ss);
    CHECK(ss.ssd_segs == 1 && ss.host_segs == 1 && ss.written == set);
    st_kv_stream_free(ks);
    ks = NULL;
    /* a directory that cannot be made: IO naming --kv-ssd-dir, when the first segment would go there */
    sp.ssd_mem = 0;
    sp.ssd_dir = "/dev/null/strata";
    CHECK(st_kv_stream_init(be, &sp, &ks) == STRATA_OK);
    for (int i = 0; i < 8 && ks; i++) CHECK(st_llama_forward_stream(m, ks, tok, 512, 0, false, a) == STRATA_OK);
    CHECK_ERR(st_llama_forward_stream(m, ks, tok, 512, 0, false, a), STRATA_ERR_IO, "--kv-ssd-dir");
    CHECK(st_kv_stream_len(ks) == 4096);
    /* a segment that is not a multiple of 4096 keys */
    st_kv_stream *bad = NULL;
    sp.seg = 8192 + 4096 / 2;
    CHECK_ERR(st_kv_stream_init(be, &sp, &bad), STRATA_ERR_INVALID_ARG, "seg");
out:
    st_kv_stream_free(ks);
    st_kv_stream_free(ref);
    free(a);
    free(b);
    st_llama_free(m);
}

static void test_ffn_chunks(st_backend *be, st_model_files *f) {
    const int64_t N = 6000, V = f->config.vocab_size;
    int32_t *tok = malloc((size_t)N * sizeof *tok);
    float *a = malloc((size_t)V * sizeof(float)), *b = malloc((size_t)V * sizeof(float));
    uint64_t rng = 77;
    for (int64_t i = 0; i < N; i++) tok[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
    const int64_t T[2] = {N, 512};
    float *out[2] = {a, b};
    for (int r = 0; r < 2; r++) {
        st_llama_params lp = {.max_seq_len = N, .max_tokens = T[r]};
        st_llama *m = NULL;
        st_kv_pool *kv = NULL;
        CHECK(test_llama_open(f, be, &lp, ST_KV_BF16, &m, &kv) == STRATA_OK);
        if (m) CHECK_MSG(st_llama_forward_seq(m, kv, tok, N, 0, false, out[r]) == STRATA_OK, "%s", st_last_error());
        test_llama_close(m, kv);
    }
    CHECK_MSG(memcmp(a, b, (size_t)V * sizeof(float)) == 0,
              "one pass of %lld tokens (FFN in sub-chunks of %d) differs from passes of 512", (long long)N,
              ST_PLAN_FFN_ROWS);
    /* the growth from 4096 to 16384 tokens a pass does not depend on the intermediate size: the FFN's
     * buffers stay at 4096 rows (with an intermediate of 2^20 they would grow by 100 GB) */
    st_config c = f->config, big = f->config;
    big.intermediate_size = (int64_t)1 << 20;
    const size_t a4 = st_plan_act_bytes(be, &c, 4096, 16384, 0), a16 = st_plan_act_bytes(be, &c, 16384, 16384, 0);
    const size_t b4 = st_plan_act_bytes(be, &big, 4096, 16384, 0), b16 = st_plan_act_bytes(be, &big, 16384, 16384, 0);
    CHECK_MSG(a16 - a4 == b16 - b4, "activations grow by %zu bytes from 4096 to 16384 tokens a pass, %zu with an "
              "intermediate of 2^20: the FFN grows with the pass", a16 - a4, b16 - b4);
    printf("bounded activations: a pass of %lld tokens (FFN in sub-chunks of %d rows) gives the logits of passes "
           "of 512 bit for bit; from 4096 to 16384 tokens a pass the activations grow by %zu bytes whatever the "
           "FFN's width\n", (long long)N, ST_PLAN_FFN_ROWS, a16 - a4);
    free(tok);
    free(a);
    free(b);
}

int main(int argc, char **argv) {
    const bool cuda_only = argc > 1 && !strcmp(argv[1], "--cuda-only"); /* the GPU script: the CPU half ran in CI */
    st_backend *be = NULL;
    CHECK(st_backend_init(&(st_backend_params){.kind = ST_BACKEND_CPU, .n_threads = 2}, &be) == STRATA_OK);
    st_model_files *f = NULL;
    CHECK(st_model_open(test_src_path("tests/data/models/llama3_f32"), &f) == STRATA_OK);
    if (!be || !f) return test_finish("test_long_context");
    if (cuda_only) goto cuda;
    run_both(be, f, &(run_cfg){.prompt = 700, .dec = 5, .max_tokens = 64, .piece = 256, .dtype = ST_KV_F32,
                               .all_logits = true},
             "short, f32 KV, passes of 64, pieces of 256");
    /* (2b), its segments past 2 x 4096 keys in the file */
    run_both(be, f, &(run_cfg){.prompt = 9000, .dec = 4, .max_tokens = 256, .piece = 1024, .dtype = ST_KV_FP8,
                               .seg = 4096, .host_segs = 2},
             "fp8 KV (scales streamed too), passes of 256, pieces of 1024, 2 segments of 4096 on the host");
    /* every run here attends its host keys on the CPU backend first, in key order (the device is the CPU:
     * bit for bit). These two take the path of a GPU: the CPU tier's own backend attends the oldest keys
     * while the model's attends the rest, merged after it: the merge is regrouped (CPU part + (pieces +
     * area) instead of one chain), so within rounding */
    run_both(be, f, &(run_cfg){.prompt = 9000, .dec = 5, .max_tokens = 512, .piece = 1024, .dtype = ST_KV_BF16,
                               .cpu_attn = 0.5, .tol = 4e-6, .cpu_tier = true},
             "bf16 KV, half the earlier keys attended on the CPU tier's backend");
    run_both(be, f, &(run_cfg){.prompt = 9000, .dec = 3, .max_tokens = 256, .piece = 1024, .dtype = ST_KV_FP8,
                               .seg = 4096, .host_segs = 2, .cpu_attn = 1.0, .tol = 4e-6, .cpu_tier = true},
             "fp8 KV, every host key before the SSD's attended on the CPU tier's backend");
    run_both(be, f, &(run_cfg){.prompt = N_LONG, .dec = N_DEC, .max_tokens = 512, .piece = 4096,
                               .dtype = ST_KV_BF16, .seg = 4096, .host_segs = 2},
             "long, bf16 KV, passes of 512, pieces of 4096, 2 segments of 4096 on the host, the rest on the SSD");
    test_errors(be, f);
    test_ssd_errors(be, f);
    test_ffn_chunks(be, f);
cuda:
    st_backend_free(be);
    /* on a GPU machine (tests/gpu/run_gpu_long_context.sh): the same runs on CUDA, within a tolerance (the
     * fitting run's decode takes the paged kernel, the streamed one the contiguous kernels) */
    be = NULL;
    if (st_backend_available(ST_BACKEND_CUDA) &&
        st_backend_init(&(st_backend_params){.kind = ST_BACKEND_CUDA}, &be) == STRATA_OK) {
        run_both(be, f, &(run_cfg){.prompt = 700, .dec = 5, .max_tokens = 64, .piece = 256, .dtype = ST_KV_F32,
                                   .all_logits = true, .tol = 1e-4},
                 "cuda: short, f32 KV");
        run_both(be, f, &(run_cfg){.prompt = 20000, .dec = 3, .max_tokens = 2048, .piece = 4096,
                                   .dtype = ST_KV_BF16, .tol = 1e-4, .seg = 8192, .host_segs = 2},
                 "cuda: 20K, bf16 KV, 2 segments of 8192 on the host, the rest on the SSD");
        run_both(be, f, &(run_cfg){.prompt = 3000, .dec = 3, .max_tokens = 256, .piece = 1024, .dtype = ST_KV_FP8,
                                   .tol = 1e-4},
                 "cuda: fp8 KV");
        st_backend_free(be);
    }
    st_model_close(f);
    return test_finish("test_long_context");
}

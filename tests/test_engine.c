/* The serving engine (engine/engine.h) on a tiny GGUF llama with a real BPE
 * vocabulary (tests/data/tokenizer/tiny_bpe_smollm.gguf, context 64):
 *  - the stop-string filter (engine/stop.h): a stop string split across
 *    pieces, the earliest of several, a held-back prefix released, UTF-8;
 *  - every request's text, finish reason and usage equal a reference written
 *    here (a single-sequence loop over st_llama_forward with a
 *    one-sequence batch, its own sampler, detokenizer and stop checks) for
 *    the same prompt and sampler (greedy and seeded sampling), whether it runs
 *    alone, among 11 others (more than the 4 slots: some wait), or joining
 *    while others are mid-way (batch invariance), with prefix-cache hits,
 *    without the prefix cache, and with a KV pool so small that sequences
 *    are preempted (recompute);
 *  - prompts longer than the chunk are prefilled over several steps, the
 *    oldest prefill first, beside running decodes, under the step budget;
 *  - stop strings, stop ids, max_tokens, a full context, ignore_eos;
 *  - abort of a waiting and of a running request: on_finish(abort), the slot
 *    is free again; unknown ids; bad requests (no callback ever called);
 *  - metrics: tokens, finished counts, histograms, KV blocks back to 0,
 *    prefix-cache queries / hits, preemptions;
 *  - the engine thread: adds from 4 threads at once, the same outputs; stop
 *    with requests pending finishes them with abort; add after stop refuses. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "engine/stop.h"
#include "testutil.h"

typedef struct {
    st_model_files *files;
    st_backend *be;
    st_tokenizer *tok;
    int64_t vocab, n_ctx;
} tiny;

static bool tiny_open(tiny *t) {
    memset(t, 0, sizeof *t);
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 1};
    if (st_model_open(test_src_path("tests/data/tokenizer/tiny_bpe_smollm.gguf"), &t->files) ||
        st_backend_init(&bp, &t->be) || st_tokenizer_load(t->files, &t->tok)) {
        fprintf(stderr, "tiny model: %s\n", st_last_error());
        return false;
    }
    t->vocab = st_tokenizer_vocab_size(t->tok);
    t->n_ctx = t->files->config.max_position_embeddings; /* 64 */
    return true;
}

static void tiny_close(tiny *t) {
    st_tokenizer_free(t->tok);
    st_backend_free(t->be);
    st_model_close(t->files);
}

/* ---- what one request produced --------------------------------------------------------*/
typedef struct {
    pthread_mutex_t *mu; /* NULL: single-threaded */
    pthread_cond_t *cv;
    char text[4096];
    size_t len;
    int pieces;
    bool bad_utf8;
    int finished; /* on_finish calls */
    st_engine_finish fin;
    char error[256];
} result;

static void on_text(void *user, const char *t, size_t n) {
    result *r = user;
    if (n == 0 || !st_utf8_valid(t, n)) r->bad_utf8 = true;
    if (r->len + n < sizeof r->text) {
        memcpy(r->text + r->len, t, n);
        r->len += n;
        r->text[r->len] = 0;
    }
    r->pieces++;
}

static void on_finish(void *user, const st_engine_finish *f) {
    result *r = user;
    if (r->mu) pthread_mutex_lock(r->mu);
    r->fin = *f;
    snprintf(r->error, sizeof r->error, "%s", f->error ? f->error : "");
    r->fin.error = NULL;
    r->finished++;
    if (r->mu) {
        pthread_cond_broadcast(r->cv);
        pthread_mutex_unlock(r->mu);
    }
}

/* ---- the stop-string filter ----------------------------------------------------------*/
typedef struct {
    char text[512];
    size_t len;
    bool stopped;
} sink;

static void run_filter(const char *const *stop, int n_stop, const char *const *pieces, const char *want,
                       bool want_stop, int want_hit) {
    sink s = {0};
    st_stop_filter *f = NULL;
    CHECK(st_stop_filter_init(stop, n_stop, &f) == STRATA_OK);
    if (!f) return;
    for (int i = 0; pieces[i]; i++) {
        const char *out;
        size_t n;
        bool stopped;
        CHECK(st_stop_filter_push(f, pieces[i], strlen(pieces[i]), &out, &n, &stopped) == STRATA_OK);
        CHECK(s.len + n < sizeof s.text);
        memcpy(s.text + s.len, out, n);
        s.len += n;
        s.stopped = stopped;
    }
    const char *out;
    size_t n;
    st_stop_filter_flush(f, &out, &n);
    memcpy(s.text + s.len, out, n);
    s.len += n;
    s.text[s.len] = 0;
    CHECK_MSG(!strcmp(s.text, want), "got '%s', want '%s'", s.text, want);
    CHECK_MSG(s.stopped == want_stop && st_stop_filter_hit(f) == want_hit, "stopped %d hit %d for '%s'", s.stopped,
              st_stop_filter_hit(f), want);
    st_stop_filter_free(f);
}

static void test_stop_filter(void) {
    const char *one[] = {"STOP"};
    run_filter(one, 1, (const char *[]){"hello ", "ST", "O", "P world", NULL}, "hello ", true, 0);
    run_filter(one, 1, (const char *[]){"hello ST", "ORM", NULL}, "hello STORM", false, -1);
    run_filter(one, 1, (const char *[]){"hello ST", NULL}, "hello ST", false, -1); /* released at the end */
    const char *two[] = {"world", "lo w"};
    run_filter(two, 2, (const char *[]){"hel", "lo world", NULL}, "hel", true, 1); /* the earliest */
    const char *utf[] = {"\xc3\xa9t\xc3\xa9"};
    run_filter(utf, 1, (const char *[]){"un \xc3\xa9", "t\xc3\xa9 chaud", NULL}, "un ", true, 0);
    run_filter(NULL, 0, (const char *[]){"a", "b", NULL}, "ab", false, -1);
    st_stop_filter *f = NULL;
    const char *empty[] = {""};
    CHECK_ERR(st_stop_filter_init(empty, 1, &f), STRATA_ERR_INVALID_ARG, "stop string 1 is empty");
    const char *bad[] = {"\xff"};
    CHECK_ERR(st_stop_filter_init(bad, 1, &f), STRATA_ERR_INVALID_ARG, "UTF-8");
}

/* ---- the reference: one sequence over st_llama_forward ------------------------------------*/
typedef struct {
    const char *prompt_text;
    int32_t *prompt;
    int64_t n_prompt;
    st_sampler_params sp;
    int64_t max_tokens;
    const char *stop[2];
    int n_stop;
    bool ignore_eos;
    /* expected */
    char text[4096];
    size_t len;
    st_finish_reason reason;
    const char *detail; /* st_finish_detail's word */
    int64_t completion_tokens;
} job;

/* The earliest stop string in j->text: cut there. */
static bool ref_stop_string(job *j) {
    size_t first = SIZE_MAX;
    for (int i = 0; i < j->n_stop; i++) {
        const char *hit = strstr(j->text, j->stop[i]);
        if (hit && (size_t)(hit - j->text) < first) first = (size_t)(hit - j->text);
    }
    if (first == SIZE_MAX) return false;
    j->len = first;
    j->text[first] = 0;
    return true;
}

static void ref_text(job *j, const char *t, size_t n) {
    CHECK(j->len + n < sizeof j->text);
    memcpy(j->text + j->len, t, n);
    j->len += n;
    j->text[j->len] = 0;
}

/* Runs the job alone: prompt in chunks of `chunk` tokens, then one token a
 * step, on a model of its own with a one-sequence paged pool (one block of
 * the whole context: block table {0}, slot = position); the same sampler,
 * greedy or seeded; stop ids (the tokenizer's unless ignore_eos), stop
 * strings, max_tokens and the context as engine.h says. */
static void make_reference(tiny *t, int64_t chunk, job *j) {
    st_llama *m = NULL;
    const st_kv_pool_params kp = st_llama_kv_params_for(&t->files->config, chunk, t->n_ctx, 1, t->n_ctx, ST_KV_F32);
    const st_llama_params lp = {.max_seq_len = t->n_ctx, .max_tokens = chunk, .kv_bytes = st_kv_pool_device_bytes(&kp)};
    CHECK(st_llama_init(t->files, t->be, &lp, &m) == STRATA_OK);
    st_kv_pool *kv = NULL;
    CHECK(st_kv_pool_init(t->be, &kp, &kv) == STRATA_OK);
    st_sampler *s = NULL;
    CHECK(st_sampler_init(&j->sp, t->vocab, &s) == STRATA_OK);
    st_detok *dt = NULL;
    CHECK(st_detok_init(t->tok, true, &dt) == STRATA_OK);
    const int32_t *stop_ids = NULL;
    const int n_stop_ids = j->ignore_eos ? 0 : st_tokenizer_stop_ids(t->tok, &stop_ids);
    const int64_t V = st_llama_config(m)->vocab_size;
    float *logits = malloc((size_t)V * sizeof *logits);
    int32_t *toks = malloc((size_t)t->n_ctx * sizeof *toks);
    int32_t pos[64], tab[1] = {0}, ctx_len[1], seq0[64] = {0}, row[1];
    int64_t slots[64];
    memcpy(toks, j->prompt, (size_t)j->n_prompt * sizeof *toks);
    int64_t n_tok = j->n_prompt, done = 0;
    j->len = 0;
    j->text[0] = 0;
    j->completion_tokens = 0;
    bool stopped = false;
    for (;;) {
        /* run toks[done .. n_tok) in chunks; logits of the last one */
        while (done < n_tok) {
            const int64_t n = n_tok - done < chunk ? n_tok - done : chunk;
            for (int64_t k = 0; k < n; k++) pos[k] = (int32_t)(done + k), slots[k] = done + k;
            ctx_len[0] = (int32_t)(done + n);
            row[0] = (int32_t)(n - 1);
            const st_batch b = {.n_tokens = n, .tokens = toks + done, .pos = pos, .seq = seq0, .slots = slots,
                                .n_seqs = 1, .block_tables = tab, .max_blocks = 1, .ctx_lens = ctx_len,
                                .logit_rows = row, .n_logits = done + n == n_tok ? 1 : 0};
            CHECK(st_llama_forward(m, kv, &b, logits) == STRATA_OK);
            done += n;
        }
        int32_t tk;
        CHECK(st_sampler_sample(s, logits, toks, n_tok, &tk) == STRATA_OK);
        toks[n_tok++] = tk;
        j->completion_tokens++;
        bool is_stop = false;
        for (int i = 0; i < n_stop_ids; i++) is_stop |= stop_ids[i] == tk;
        const char *out;
        size_t n;
        if (is_stop) {
            j->reason = ST_FINISH_STOP;
            j->detail = "eos";
            break;
        }
        CHECK(st_detok_push(dt, tk, &out, &n) == STRATA_OK);
        ref_text(j, out, n);
        if ((stopped = ref_stop_string(j))) break;
        if (j->max_tokens > 0 && j->completion_tokens >= j->max_tokens) {
            j->reason = ST_FINISH_LENGTH;
            j->detail = "max_tokens";
            break;
        }
        if (n_tok >= t->n_ctx) {
            j->reason = ST_FINISH_LENGTH;
            j->detail = "context_full";
            break;
        }
    }
    if (!stopped) {
        const char *out;
        size_t n;
        CHECK(st_detok_flush(dt, &out, &n) == STRATA_OK);
        ref_text(j, out, n);
        stopped = ref_stop_string(j);
    }
    if (stopped) {
        j->reason = ST_FINISH_STOP;
        j->detail = "stop_string";
    }
    free(toks);
    free(logits);
    st_detok_free(dt);
    st_sampler_free(s);
    if (m && kv) st_llama_forget_pool(m, kv);
    st_kv_pool_free(kv);
    st_llama_free(m);
}

static void job_request(const job *j, st_engine_request *r) {
    *r = (st_engine_request){.prompt = j->prompt, .n_prompt = j->n_prompt, .sampler = j->sp,
                             .max_tokens = j->max_tokens, .stop = j->stop, .n_stop = j->n_stop,
                             .ignore_eos = j->ignore_eos};
}

static void check_result(const job *j, const result *r, const char *what) {
    CHECK_MSG(r->finished == 1, "%s: on_finish called %d times", what, r->finished);
    CHECK_MSG(r->len == j->len && !memcmp(r->text, j->text, j->len), "%s: '%s' != reference '%s'", what, r->text,
              j->text);
    CHECK_MSG(r->fin.reason == j->reason && !strcmp(st_finish_detail(&r->fin), j->detail),
              "%s: finish %s/%s, reference %s/%s", what, st_finish_reason_name(r->fin.reason),
              st_finish_detail(&r->fin), st_finish_reason_name(j->reason), j->detail);
    CHECK_MSG(r->fin.completion_tokens == j->completion_tokens, "%s: %lld tokens, reference %lld", what,
              (long long)r->fin.completion_tokens, (long long)j->completion_tokens);
    CHECK(r->fin.prompt_tokens == j->n_prompt);
    CHECK(r->fin.total_s >= r->fin.queue_s && r->fin.ttft_s >= 0 && r->fin.ttft_s <= r->fin.total_s);
    CHECK(!r->bad_utf8);
}

static int run_until_idle(st_engine *e) {
    int steps = 0;
    bool worked = true;
    while (worked) {
        CHECK(st_engine_step(e, &worked) == STRATA_OK);
        if (worked) steps++;
        if (steps > 10000) {
            CHECK(!"the engine never went idle");
            break;
        }
    }
    return steps;
}

enum { NJOBS = 12, CHUNK = 8, SLOTS = 4 };
static const char *PROMPTS[] = {
    "The quick brown fox jumps over the lazy dog.",
    "Hello",
    "Once upon a time, in a land far away, there lived a king who had three daughters and one very old cat.",
    "1 2 3 4 5 6 7 8 9 10",
    "What is the capital of France?",
    "a",
};

static void make_jobs(tiny *t, job *jobs) {
    for (int i = 0; i < NJOBS; i++) {
        job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->prompt_text = PROMPTS[i % 6];
        CHECK(st_tokenizer_encode(t->tok, j->prompt_text, strlen(j->prompt_text), false, false, &j->prompt,
                                  &j->n_prompt) == STRATA_OK);
        j->sp = st_sampler_params_default();
        if (i % 3 == 0) {
            j->sp.temperature = 0; /* greedy */
        } else {
            j->sp.temperature = 0.9f;
            j->sp.top_p = 0.95f;
            j->sp.seed = 1000 + (uint64_t)i;
        }
        j->max_tokens = i == 5 ? 0 : 6 + i; /* job 5: until the context is full */
        make_reference(t, CHUNK, j);
    }
}

static st_engine *make_engine_p(tiny *t, const st_engine_params *p) {
    st_engine *e = NULL;
    CHECK(st_engine_init(t->files, t->be, t->tok, p, &e) == STRATA_OK);
    return e;
}

static st_engine *make_engine(tiny *t, int64_t step_tokens) {
    st_engine_params p = {.max_batch = SLOTS, .max_model_len = t->n_ctx, .prefill_chunk = CHUNK,
                          .step_tokens = step_tokens};
    st_engine *e = NULL;
    CHECK(st_engine_init(t->files, t->be, t->tok, &p, &e) == STRATA_OK);
    return e;
}

/* All at once (12 requests for 4 slots), then each alone, then staggered. */
static void test_invariance(tiny *t, job *jobs) {
    st_engine *e = make_engine(t, 0);
    if (!e) return;
    static result res[NJOBS];
    st_engine_callbacks cb[NJOBS];
    uint64_t ids[NJOBS];
    int64_t sum_prompt = 0, sum_completion = 0;
    /* all at once */
    memset(res, 0, sizeof res);
    for (int i = 0; i < NJOBS; i++) {
        st_engine_request r;
        job_request(&jobs[i], &r);
        cb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &res[i]};
        CHECK(st_engine_add(e, &r, &cb[i], &ids[i]) == STRATA_OK);
        CHECK(ids[i] > 0 && (i == 0 || ids[i] > ids[i - 1]));
        sum_prompt += jobs[i].n_prompt;
        sum_completion += jobs[i].completion_tokens;
    }
    st_engine_metrics m;
    st_engine_metrics_get(e, &m);
    CHECK(m.waiting == NJOBS && m.running == 0);
    /* the scheduler admits (FCFS) while the step's token budget lasts: at
     * most SLOTS run, the rest wait, and at some point every slot is taken */
    CHECK(st_engine_step(e, NULL) == STRATA_OK);
    st_engine_metrics_get(e, &m);
    CHECK(m.kv_blocks_used > 0 && m.kv_blocks_total == SLOTS * (t->n_ctx / 16));
    int64_t max_running = 0;
    for (int k = 0; k < 1000 && st_engine_has_work(e); k++) {
        st_engine_metrics_get(e, &m);
        int done = 0;
        for (int i = 0; i < NJOBS; i++) done += res[i].finished;
        CHECK_MSG(m.running <= SLOTS && m.running + m.waiting + done == NJOBS, "running %lld waiting %lld done %d",
                  (long long)m.running, (long long)m.waiting, done);
        if (m.running > max_running) max_running = m.running;
        CHECK(st_engine_step(e, NULL) == STRATA_OK);
    }
    CHECK_MSG(max_running == SLOTS, "at most %lld running", (long long)max_running);
    run_until_idle(e);
    char what[64];
    int64_t sum_cached = 0;
    for (int i = 0; i < NJOBS; i++) {
        snprintf(what, sizeof what, "all at once, job %d", i);
        check_result(&jobs[i], &res[i], what);
        /* jobs i and i + 6 share a prompt: the later one may find its full blocks cached */
        CHECK(res[i].fin.cached_tokens >= 0 && res[i].fin.cached_tokens % 16 == 0 &&
              res[i].fin.cached_tokens < jobs[i].n_prompt);
        if (i < 6) CHECK(res[i].fin.cached_tokens == 0);
        sum_cached += res[i].fin.cached_tokens;
    }
    st_engine_metrics_get(e, &m);
    CHECK(m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0);
    CHECK(m.requests_added == NJOBS);
    CHECK(m.requests_finished[ST_FINISH_STOP] + m.requests_finished[ST_FINISH_LENGTH] == NJOBS);
    CHECK(m.preemptions == 0); /* the pool holds SLOTS full sequences */
    CHECK_MSG(m.prompt_tokens + sum_cached == sum_prompt, "prompt tokens %lld + cached %lld, want %lld",
              (long long)m.prompt_tokens, (long long)sum_cached, (long long)sum_prompt);
    CHECK(m.generation_tokens == sum_completion);
    CHECK(m.ttft.count == NJOBS && m.e2e.count == NJOBS);
    CHECK(m.tbt.count == sum_completion - NJOBS);
    CHECK_MSG(m.prefix_cache_queries == sum_prompt && m.prefix_cache_hits == sum_cached, "queries %lld hits %lld",
              (long long)m.prefix_cache_queries, (long long)m.prefix_cache_hits);
    CHECK(sum_cached > 0); /* the long prompt (job 2, job 8) spans full blocks */
    int64_t in_buckets = 0;
    for (int b = 0; b <= m.ttft.n_bounds; b++) in_buckets += m.ttft.counts[b];
    CHECK(in_buckets == m.ttft.count && m.ttft.sum > 0);

    /* each alone */
    for (int i = 0; i < NJOBS; i++) {
        memset(&res[i], 0, sizeof res[i]);
        st_engine_request r;
        job_request(&jobs[i], &r);
        CHECK(st_engine_add(e, &r, &cb[i], &ids[i]) == STRATA_OK);
        run_until_idle(e);
        snprintf(what, sizeof what, "alone, job %d", i);
        check_result(&jobs[i], &res[i], what);
    }

    /* staggered: one more joins every step, in reverse order */
    memset(res, 0, sizeof res);
    for (int i = NJOBS - 1; i >= 0; i--) {
        st_engine_request r;
        job_request(&jobs[i], &r);
        CHECK(st_engine_add(e, &r, &cb[i], &ids[i]) == STRATA_OK);
        CHECK(st_engine_step(e, NULL) == STRATA_OK);
    }
    run_until_idle(e);
    for (int i = 0; i < NJOBS; i++) {
        snprintf(what, sizeof what, "staggered, job %d", i);
        check_result(&jobs[i], &res[i], what);
    }
    st_engine_free(e);
}

/* Long prompts over several steps; the budget. */
static void test_chunks(tiny *t, job *jobs) {
    /* step budget = one chunk (the forward pass: chunk + max_batch - 1 = 9
     * tokens): besides decodes only the oldest prefill runs */
    const st_engine_params cp = {.max_batch = 2, .max_model_len = t->n_ctx, .prefill_chunk = CHUNK,
                                 .step_tokens = CHUNK};
    st_engine *e = make_engine_p(t, &cp);
    if (!e) return;
    const job *lj = &jobs[2]; /* the long prompt */
    CHECK_MSG(lj->n_prompt > 3 * CHUNK, "long prompt: %lld tokens", (long long)lj->n_prompt);
    result r1 = {0}, r2 = {0};
    st_engine_callbacks c1 = {.on_text = on_text, .on_finish = on_finish, .user = &r1}, c2 = {.on_text = on_text, .on_finish = on_finish, .user = &r2};
    st_engine_request rq;
    job_request(lj, &rq);
    uint64_t id1, id2;
    CHECK(st_engine_add(e, &rq, &c1, &id1) == STRATA_OK);
    CHECK(st_engine_add(e, &rq, &c2, &id2) == STRATA_OK);
    st_engine_metrics m;
    const int64_t n_chunks = (lj->n_prompt + CHUNK - 1) / CHUNK;
    /* the first request's prompt goes first, one chunk a step; the second waits its turn */
    for (int64_t k = 1; k <= n_chunks; k++) {
        CHECK(st_engine_step(e, NULL) == STRATA_OK);
        st_engine_metrics_get(e, &m);
        int64_t want = k * CHUNK < lj->n_prompt ? k * CHUNK : lj->n_prompt;
        CHECK_MSG(m.prompt_tokens == want, "step %lld: %lld prompt tokens, want %lld", (long long)k,
                  (long long)m.prompt_tokens, (long long)want);
        CHECK(m.generation_tokens == (k == n_chunks ? 1 : 0));
        CHECK(m.steps == k);
    }
    /* now one decode + the second prompt's first chunk (over the budget: the oldest prefill always runs) */
    CHECK(st_engine_step(e, NULL) == STRATA_OK);
    st_engine_metrics_get(e, &m);
    CHECK(m.prompt_tokens == lj->n_prompt + CHUNK);
    CHECK(m.generation_tokens == 2 || r1.finished);
    run_until_idle(e);
    check_result(lj, &r1, "chunked 1");
    check_result(lj, &r2, "chunked 2");
    /* the second found the first's full blocks in the prefix cache */
    CHECK_MSG(r1.fin.cached_tokens == 0 && r2.fin.cached_tokens == (lj->n_prompt - 1) / 16 * 16,
              "cached %lld / %lld", (long long)r1.fin.cached_tokens, (long long)r2.fin.cached_tokens);
    st_engine_free(e);

    /* a KV pool of one sequence (4 blocks of 16 for a context of 64): the
     * running sequences outgrow it, preemption by recompute, the same
     * outputs; and then no prefix cache at all */
    for (int variant = 0; variant < 2; variant++) {
        const st_engine_params sp = {.max_batch = SLOTS, .max_model_len = t->n_ctx, .prefill_chunk = CHUNK,
                                     .kv_blocks = variant == 0 ? 4 : 0, .disable_prefix_cache = variant == 1};
        e = make_engine_p(t, &sp);
        if (!e) return;
        static result res[NJOBS];
        st_engine_callbacks cb[NJOBS];
        memset(res, 0, sizeof res);
        int64_t sum_prompt = 0;
        for (int i = 0; i < NJOBS; i++) {
            st_engine_request r;
            job_request(&jobs[i], &r);
            cb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &res[i]};
            uint64_t id;
            CHECK(st_engine_add(e, &r, &cb[i], &id) == STRATA_OK);
            sum_prompt += jobs[i].n_prompt;
        }
        run_until_idle(e);
        st_engine_metrics_get(e, &m);
        char what[64];
        for (int i = 0; i < NJOBS; i++) {
            snprintf(what, sizeof what, "%s, job %d", variant ? "no prefix cache" : "small pool", i);
            check_result(&jobs[i], &res[i], what);
        }
        CHECK(m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0 && m.kv_blocks_total == (variant ? 16 : 4));
        if (variant == 0) CHECK_MSG(m.preemptions > 0, "preemptions %lld", (long long)m.preemptions);
        else CHECK(m.prefix_cache_hits == 0 && m.prompt_tokens == sum_prompt && m.preemptions == 0);
        st_engine_free(e);
    }
}

/* Stop strings, stop ids, ignore_eos, the context. */
static void test_stops(tiny *t, job *jobs) {
    st_engine *e = make_engine(t, 0);
    if (!e) return;
    /* a stop string from the middle of a greedy reference */
    job j = jobs[0];
    j.max_tokens = 24;
    make_reference(t, CHUNK, &j);
    if (j.len >= 8) {
        static char stop[4];
        memcpy(stop, j.text + 5, 3);
        stop[3] = 0;
        if (st_utf8_valid(stop, 3)) {
            job js = j;
            js.stop[0] = "never-appears";
            js.stop[1] = stop;
            js.n_stop = 2;
            make_reference(t, CHUNK, &js);
            CHECK(js.reason == ST_FINISH_STOP && !strcmp(js.detail, "stop_string"));
            CHECK(js.len == (size_t)(strstr(j.text, stop) - j.text));
            result r = {0};
            st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &r};
            st_engine_request rq;
            job_request(&js, &rq);
            uint64_t id;
            CHECK(st_engine_add(e, &rq, &cb, &id) == STRATA_OK);
            run_until_idle(e);
            check_result(&js, &r, "stop string");
        }
    }
    /* a stop id: the 3rd greedy token of the reference ends it after 3 sampled tokens */
    {
        int32_t *ids = NULL;
        int64_t n = 0;
        CHECK(st_tokenizer_encode(t->tok, j.text, j.len, false, false, &ids, &n) == STRATA_OK);
        result r = {0};
        st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &r};
        st_engine_request rq;
        job_request(&j, &rq);
        if (n >= 3) {
            /* the 3rd sampled id: run greedy for 3 tokens, record the ids through the usage */
            rq.max_tokens = 24;
            rq.stop_ids = &ids[2];
            rq.n_stop_ids = 1;
            uint64_t id;
            CHECK(st_engine_add(e, &rq, &cb, &id) == STRATA_OK);
            run_until_idle(e);
            CHECK(r.finished == 1 && r.fin.reason == ST_FINISH_STOP);
            CHECK(r.fin.completion_tokens <= 24);
            CHECK(r.len <= j.len && !memcmp(r.text, j.text, r.len));
        }
        free(ids);
    }
    /* ignore_eos with no max_tokens: exactly max_model_len - prompt tokens */
    {
        job jc = jobs[0];
        result r = {0};
        st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &r};
        st_engine_request rq;
        job_request(&jc, &rq);
        rq.max_tokens = 0;
        rq.ignore_eos = true;
        uint64_t id;
        CHECK(st_engine_add(e, &rq, &cb, &id) == STRATA_OK);
        run_until_idle(e);
        CHECK(r.fin.reason == ST_FINISH_LENGTH && r.fin.context_full);
        CHECK_MSG(r.fin.completion_tokens == t->n_ctx - jc.n_prompt, "%lld tokens",
                  (long long)r.fin.completion_tokens);
        /* and max_tokens beyond the context is capped by it */
        memset(&r, 0, sizeof r);
        rq.max_tokens = 1000;
        CHECK(st_engine_add(e, &rq, &cb, &id) == STRATA_OK);
        run_until_idle(e);
        CHECK(r.fin.reason == ST_FINISH_LENGTH && r.fin.context_full);
        CHECK(r.fin.completion_tokens == t->n_ctx - jc.n_prompt);
    }
    st_engine_free(e);
}

/* Aborts and bad requests. */
static void test_abort(tiny *t, job *jobs) {
    st_engine *e = make_engine(t, 0);
    if (!e) return;
    result r[SLOTS + 2];
    memset(r, 0, sizeof r);
    uint64_t ids[SLOTS + 2];
    st_engine_callbacks cb[SLOTS + 2];
    for (int i = 0; i < SLOTS + 2; i++) {
        st_engine_request rq;
        job_request(&jobs[1], &rq); /* a short prompt: all four start in the first step */
        rq.max_tokens = 0;
        rq.ignore_eos = true;
        cb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &r[i]};
        CHECK(st_engine_add(e, &rq, &cb[i], &ids[i]) == STRATA_OK);
    }
    for (int k = 0; k < 4; k++) CHECK(st_engine_step(e, NULL) == STRATA_OK);
    st_engine_metrics m;
    st_engine_metrics_get(e, &m);
    CHECK_MSG(m.running == SLOTS && m.waiting == 2 && m.kv_blocks_used >= SLOTS, "running %lld waiting %lld blocks %lld", (long long)m.running, (long long)m.waiting, (long long)m.kv_blocks_used);
    /* one running, one waiting */
    CHECK(st_engine_abort(e, ids[1]) == STRATA_OK);
    CHECK(st_engine_abort(e, ids[1]) == STRATA_OK); /* twice is fine until it is gone */
    CHECK(st_engine_abort(e, ids[SLOTS + 1]) == STRATA_OK);
    CHECK(r[1].finished == 0); /* takes effect at the next step */
    CHECK(st_engine_step(e, NULL) == STRATA_OK);
    CHECK_MSG(r[1].finished == 1 && r[1].fin.reason == ST_FINISH_ABORT && r[1].fin.completion_tokens > 0, "finished %d reason %d tokens %lld", r[1].finished, r[1].fin.reason, (long long)r[1].fin.completion_tokens);
    CHECK(r[SLOTS + 1].finished == 1 && r[SLOTS + 1].fin.reason == ST_FINISH_ABORT &&
          r[SLOTS + 1].fin.completion_tokens == 0 && r[SLOTS + 1].fin.ttft_s < 0);
    CHECK_ERR(st_engine_abort(e, ids[1]), STRATA_ERR_NOT_FOUND, "no pending request");
    CHECK_ERR(st_engine_abort(e, 999999), STRATA_ERR_NOT_FOUND, "999999");
    st_engine_metrics_get(e, &m);
    CHECK(m.running == SLOTS && m.waiting == 0); /* the freed slot went to the waiting one */
    CHECK(m.requests_finished[ST_FINISH_ABORT] == 2);
    /* abort everything: the gauges return to 0 */
    for (int i = 0; i < SLOTS + 2; i++) st_engine_abort(e, ids[i]);
    run_until_idle(e);
    st_engine_metrics_get(e, &m);
    CHECK(m.running == 0 && m.waiting == 0 && m.kv_blocks_used == 0);
    CHECK(m.requests_finished[ST_FINISH_ABORT] == SLOTS + 2);
    for (int i = 0; i < SLOTS + 2; i++) CHECK(r[i].finished == 1);
    /* a slot used by an aborted request gives the same output as a fresh one */
    {
        result rr = {0};
        st_engine_callbacks c = {.on_text = on_text, .on_finish = on_finish, .user = &rr};
        st_engine_request rq;
        job_request(&jobs[3], &rq);
        uint64_t id;
        CHECK(st_engine_add(e, &rq, &c, &id) == STRATA_OK);
        run_until_idle(e);
        check_result(&jobs[3], &rr, "after aborts");
    }

    /* bad requests: refused, no callback */
    result bad = {0};
    st_engine_callbacks bcb = {.on_text = on_text, .on_finish = on_finish, .user = &bad};
    st_engine_request rq;
    uint64_t id = 5;
    job_request(&jobs[0], &rq);
    rq.n_prompt = 0;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "empty");
    CHECK(id == 0);
    int32_t *longp = calloc((size_t)t->n_ctx, sizeof *longp);
    rq.prompt = longp;
    rq.n_prompt = t->n_ctx;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "64 tokens", "context holds 64");
    free(longp);
    job_request(&jobs[0], &rq);
    int32_t bad_ids[2] = {1, (int32_t)t->vocab};
    rq.prompt = bad_ids;
    rq.n_prompt = 2;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "outside the vocabulary");
    job_request(&jobs[0], &rq);
    rq.sampler.temperature = -1;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "temperature");
    job_request(&jobs[0], &rq);
    const char *empty[] = {""};
    rq.stop = empty;
    rq.n_stop = 1;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "stop string 1");
    job_request(&jobs[0], &rq);
    rq.max_tokens = -1;
    CHECK_ERR(st_engine_add(e, &rq, &bcb, &id), STRATA_ERR_INVALID_ARG, "max_tokens");
    run_until_idle(e);
    CHECK(bad.finished == 0 && bad.pieces == 0);

    /* free with requests pending: each gets abort */
    result p[3];
    memset(p, 0, sizeof p);
    st_engine_callbacks pcb[3];
    for (int i = 0; i < 3; i++) {
        job_request(&jobs[i], &rq);
        pcb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &p[i]};
        CHECK(st_engine_add(e, &rq, &pcb[i], &id) == STRATA_OK);
    }
    CHECK(st_engine_step(e, NULL) == STRATA_OK);
    st_engine_free(e);
    for (int i = 0; i < 3; i++) CHECK(p[i].finished == 1 && p[i].fin.reason == ST_FINISH_ABORT);

    /* bad parameters */
    st_engine_params bp = {.prefill_chunk = 16, .step_tokens = 8, .max_model_len = 64};
    CHECK_ERR(st_engine_init(t->files, t->be, t->tok, &bp, &e), STRATA_ERR_INVALID_ARG, "step_tokens");
    CHECK(e == NULL);
    bp = (st_engine_params){.max_batch = -1};
    CHECK_ERR(st_engine_init(t->files, t->be, t->tok, &bp, &e), STRATA_ERR_INVALID_ARG, "negative");
    CHECK(!strcmp(st_finish_reason_name(ST_FINISH_LENGTH), "length"));
    st_engine_free(NULL);
}

/* ---- the engine thread, adds from several threads ----------------------------------------*/
typedef struct {
    st_engine *e;
    job *jobs;
    result *res;
    st_engine_callbacks *cb;
    int first, step;
    int failed; /* adds refused (checked by the main thread: CHECK is not thread-safe) */
} adder;

static void *add_thread(void *arg) {
    adder *a = arg;
    for (int i = a->first; i < NJOBS; i += a->step) {
        st_engine_request rq;
        job_request(&a->jobs[i], &rq);
        uint64_t id;
        if (st_engine_add(a->e, &rq, &a->cb[i], &id) != STRATA_OK) a->failed++;
    }
    return NULL;
}

static void test_thread(tiny *t, job *jobs) {
    st_engine *e = make_engine(t, 0);
    if (!e) return;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    static result res[NJOBS];
    st_engine_callbacks cb[NJOBS];
    memset(res, 0, sizeof res);
    for (int i = 0; i < NJOBS; i++) {
        res[i].mu = &mu;
        res[i].cv = &cv;
        cb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &res[i]};
    }
    CHECK(st_engine_start(e) == STRATA_OK);
    CHECK_ERR(st_engine_start(e), STRATA_ERR_INVALID_ARG, "already");
    pthread_t th[4];
    adder ad[4];
    for (int k = 0; k < 4; k++) {
        ad[k] = (adder){e, jobs, res, cb, k, 4, 0};
        pthread_create(&th[k], NULL, add_thread, &ad[k]);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
        CHECK(ad[k].failed == 0);
    }
    pthread_mutex_lock(&mu);
    for (int i = 0; i < NJOBS; i++)
        while (!res[i].finished) pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    char what[64];
    for (int i = 0; i < NJOBS; i++) {
        snprintf(what, sizeof what, "engine thread, job %d", i);
        check_result(&jobs[i], &res[i], what);
    }
    /* stop with work pending: all finish with abort, later adds refuse */
    result p[SLOTS + 3];
    memset(p, 0, sizeof p);
    st_engine_callbacks pcb[SLOTS + 3];
    for (int i = 0; i < SLOTS + 3; i++) {
        st_engine_request rq;
        job_request(&jobs[0], &rq);
        rq.max_tokens = 0;
        rq.ignore_eos = true;
        pcb[i] = (st_engine_callbacks){.on_text = on_text, .on_finish = on_finish, .user = &p[i]};
        uint64_t id;
        CHECK(st_engine_add(e, &rq, &pcb[i], &id) == STRATA_OK);
    }
    st_engine_stop(e);
    for (int i = 0; i < SLOTS + 3; i++) CHECK(p[i].finished == 1);
    int aborted = 0;
    for (int i = 0; i < SLOTS + 3; i++) aborted += p[i].fin.reason == ST_FINISH_ABORT;
    CHECK(aborted >= 3); /* the waiting ones at least */
    st_engine_request rq;
    job_request(&jobs[0], &rq);
    uint64_t id;
    result late = {0};
    st_engine_callbacks lcb = {.on_text = on_text, .on_finish = on_finish, .user = &late};
    CHECK_ERR(st_engine_add(e, &rq, &lcb, &id), STRATA_ERR_UNSUPPORTED, "stopped");
    st_engine_metrics m;
    st_engine_metrics_get(e, &m);
    CHECK(m.running == 0 && m.waiting == 0);
    st_engine_free(e);
    CHECK(late.finished == 0);
}

int main(void) {
    test_stop_filter();
    tiny t;
    if (!tiny_open(&t)) {
        CHECK(!"tiny model");
        return test_finish("test_engine");
    }
    static job jobs[NJOBS];
    make_jobs(&t, jobs);
    int greedy_done = 0;
    for (int i = 0; i < NJOBS; i++) greedy_done += jobs[i].completion_tokens > 0;
    CHECK(greedy_done == NJOBS);
    printf("reference: job 0 greedy \"%s\" (%lld tokens, %s)\n", jobs[0].text, (long long)jobs[0].completion_tokens,
           jobs[0].detail);
    test_invariance(&t, jobs);
    test_chunks(&t, jobs);
    test_stops(&t, jobs);
    test_abort(&t, jobs);
    test_thread(&t, jobs);
    for (int i = 0; i < NJOBS; i++) free(jobs[i].prompt);
    tiny_close(&t);
    return test_finish("test_engine");
}

/* Scheduler (no model at all): a fake model executes every decision the way
 * the runner will — it writes each token's "KV" (its id and a digest of the
 * whole prefix up to it) into the slots of the decision's slot mapping, then,
 * for every item that needs logits, reads the sequence's whole context back
 * through its block table, checks every position, and "samples" a token that
 * is a function of the prefix digest it read. So a request's output depends
 * only on its prompt, and any bookkeeping bug (a wrong prefix hit, a block in
 * two places, a lost or overwritten block, a wrong recompute after
 * preemption) changes the output or trips the KV check.
 *
 * Every step also checks the decision itself: the token budget and max_batch,
 * decodes first and one token each, positions continuing the computed prefix,
 * need_logits exactly at a sequence's last token, slot mapping == block table
 * arithmetic, all slots distinct and in private blocks, FCFS (every running
 * sequence arrived before every waiting one), and st_scheduler_validate (block
 * refcounts == table entries, lists and hash table consistent).
 *
 * Tests: parameters; over-long prompts rejected at add; a 1000-token prompt
 * with a 256 budget takes 4 steps (alone, and mixed with running decodes that
 * keep every step at exactly 256 tokens); prefix reuse cuts prefill tokens;
 * preemption when blocks run out (the newest goes, to the front of the queue,
 * and its recompute covers prompt + generated tokens; its output is unchanged);
 * abort and finish (waiting, running, between schedule and update); FCFS
 * head-of-line blocking (no newer request overtakes a waiting one that does
 * not fit yet, and it is admitted as soon as it fits); a dropped decision is
 * planned again; and randomized workloads (arrivals over time, shared
 * prefixes, a pool small enough to preempt often, EOS stops, aborts) where
 * every request finishes with exactly the tokens it would get alone — also
 * with speculative drafts (right or wrong at random) verified by the fake
 * model: decode items carry them within the budget and the free blocks,
 * update appends the accepted ones, and the output is still the solo one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/scheduler.h"
#include "testutil.h"

/* ---- the fake model ------------------------------------------------------------------*/

#define EOS 0
#define MAX_REQ 512

static uint64_t digest_step(uint64_t h, int32_t tok) {
    return (h ^ (uint64_t)(uint32_t)tok) * 1099511628211ull + 0x9e3779b97f4a7c15ull;
}
static const uint64_t DIGEST0 = 1469598103934665603ull;

/* the "model": the next token from the digest of the whole prefix (0 is EOS) */
static int32_t next_token(uint64_t digest, bool eos) {
    int32_t t = (int32_t)((digest >> 23) % 40);
    if (!eos && t == EOS) t = 40;
    return t;
}

/* how a request ended, in the test's words (the record says LENGTH with
 * context_full, STOP, ABORT) */
typedef enum { ST_SEQ_FINISH_NONE, ST_SEQ_FINISH_MAX_TOKENS, ST_SEQ_FINISH_CONTEXT, ST_SEQ_FINISH_STOP,
               ST_SEQ_FINISH_ABORT } st_seq_finish;
static const char *st_seq_finish_name(st_seq_finish r) {
    static const char *n[] = {"none", "max_tokens", "context", "stop", "abort"};
    return n[r];
}
static st_seq_finish why(const st_seq *q) {
    switch (q->fin.reason) {
    case ST_FINISH_LENGTH: return q->fin.context_full ? ST_SEQ_FINISH_CONTEXT : ST_SEQ_FINISH_MAX_TOKENS;
    case ST_FINISH_STOP: return ST_SEQ_FINISH_STOP;
    default: return ST_SEQ_FINISH_ABORT;
    }
}
#define VOCAB 65536

typedef struct {
    st_seq *seq;           /* the record (the test's: created by sim_add, freed by sim_free) */
    int32_t *prompt;
    int64_t n_prompt, max_tokens;
    int32_t *gen;
    int64_t n_gen, cap_gen;
    bool added, done, aborted;
    st_seq_finish reason;
    int64_t add_step, first_token_step, done_step;
} req;

typedef struct {
    int64_t n_items, n_decodes, n_tokens, n_preempted;
    uint64_t ids[64];
    int64_t pos0[64], n[64], n_cached[64];
    bool decode[64], logits[64];
    uint64_t preempted[64];
} step_info;

typedef struct {
    st_block_manager *bm;
    st_scheduler *s;
    st_scheduler_params p;
    int64_t bs, pool_slots;
    int32_t *kv_tok;
    uint64_t *kv_dig;
    uint8_t *slot_used; /* per-step scratch */
    bool eos;
    int64_t step;
    req reqs[MAX_REQ];
    int n_reqs;
    int64_t kv_errors, decision_errors;
    int spec;              /* > 0: decoding sequences get up to `spec` drafts each step (right at 70%) */
    int32_t rowtok[64][33]; /* the fake model's token of each logit row of each item */
} sim;

static void sim_init_chunked(sim *m, int64_t num_blocks, int64_t bs, int64_t budget, int64_t max_batch,
                             int64_t max_model_len, bool prefix_cache, int64_t prefill_chunk) {
    memset(m, 0, sizeof *m);
    st_bm_params bp = {.num_blocks = num_blocks, .block_size = bs, .disable_prefix_cache = !prefix_cache};
    CHECK(st_bm_init(&bp, &m->bm) == STRATA_OK);
    m->p = (st_scheduler_params){.max_num_batched_tokens = budget, .max_batch = max_batch,
                                 .max_model_len = max_model_len, .prefill_chunk = prefill_chunk};
    strata_status st = st_scheduler_init(&m->p, m->bm, &m->s);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    m->bs = bs;
    m->pool_slots = num_blocks * bs;
    m->kv_tok = malloc((size_t)m->pool_slots * sizeof *m->kv_tok);
    m->kv_dig = calloc((size_t)m->pool_slots, sizeof *m->kv_dig);
    m->slot_used = calloc((size_t)m->pool_slots, 1);
    for (int64_t i = 0; i < m->pool_slots; i++) m->kv_tok[i] = -1;
}

static void sim_init(sim *m, int64_t num_blocks, int64_t bs, int64_t budget, int64_t max_batch,
                     int64_t max_model_len, bool prefix_cache) {
    sim_init_chunked(m, num_blocks, bs, budget, max_batch, max_model_len, prefix_cache, 0);
}

static void sim_free(sim *m) {
    st_scheduler_free(m->s);
    st_bm_stats bs;
    st_bm_get_stats(m->bm, &bs);
    CHECK(bs.used == 0); /* freeing the scheduler gives every block back */
    st_bm_free(m->bm);
    for (int i = 0; i < m->n_reqs; i++) {
        st_seq_free(m->reqs[i].seq);
        free(m->reqs[i].prompt);
        free(m->reqs[i].gen);
    }
    free(m->kv_tok);
    free(m->kv_dig);
    free(m->slot_used);
}

/* Adds request `id` (== its index) with this prompt. */
static strata_status sim_add(sim *m, const int32_t *prompt, int64_t n, int64_t max_tokens) {
    ST_ASSERT(m->n_reqs < MAX_REQ);
    int id = m->n_reqs;
    const st_request rq = {.prompt = prompt, .n_prompt = n, .max_tokens = max_tokens,
                           .sampler = {.temperature = 0, .top_p = 1, .repeat_penalty = 1}};
    const st_seq_limits lim = {.vocab = VOCAB, .max_model_len = m->p.max_model_len};
    const st_seq_callbacks cb = {.user = &m->reqs[id]};
    st_seq *q = NULL;
    strata_status st = st_seq_create(&rq, &lim, &cb, (uint64_t)id, &q);
    if (st) return st;
    if ((st = st_scheduler_add(m->s, q))) {
        st_seq_free(q);
        return st;
    }
    req *r = &m->reqs[m->n_reqs++];
    memset(r, 0, sizeof *r);
    r->seq = q;
    r->prompt = malloc((size_t)n * sizeof *r->prompt);
    memcpy(r->prompt, prompt, (size_t)n * sizeof *r->prompt);
    r->n_prompt = n;
    r->max_tokens = max_tokens;
    r->added = true;
    r->add_step = m->step;
    r->first_token_step = -1;
    return STRATA_OK;
}

static void req_push(req *r, int32_t t) {
    if (r->n_gen == r->cap_gen) {
        r->cap_gen = r->cap_gen ? r->cap_gen * 2 : 16;
        r->gen = realloc(r->gen, (size_t)r->cap_gen * sizeof *r->gen);
    }
    r->gen[r->n_gen++] = t;
}

/* What the request must produce alone: (tokens, reason). */
static int64_t expected_output(const sim *m, const req *r, int32_t *out, int64_t cap, st_seq_finish *reason) {
    uint64_t d = DIGEST0;
    for (int64_t i = 0; i < r->n_prompt; i++) d = digest_step(d, r->prompt[i]);
    int64_t n = 0;
    for (;;) {
        int32_t t = next_token(d, m->eos);
        ST_ASSERT(n < cap);
        out[n++] = t;
        d = digest_step(d, t);
        /* the scheduler's limits are applied in update, the caller's EOS after it */
        if (r->max_tokens > 0 && n >= r->max_tokens) { *reason = ST_SEQ_FINISH_MAX_TOKENS; break; }
        if (r->n_prompt + n >= m->p.max_model_len) { *reason = ST_SEQ_FINISH_CONTEXT; break; }
        if (m->eos && t == EOS) { *reason = ST_SEQ_FINISH_STOP; break; }
    }
    return n;
}

static void check_fcfs(sim *m) {
    int64_t nr = st_scheduler_num_running(m->s), nw = st_scheduler_num_waiting(m->s);
    if (nr > 0 && nw > 0) {
        const st_seq *newest_running = st_scheduler_running(m->s, nr - 1);
        const st_seq *oldest_waiting = st_scheduler_waiting(m->s, 0);
        CHECK_MSG(newest_running->arrival < oldest_waiting->arrival,
                  "step %lld: running seq %llu (arrival %llu) overtook waiting seq %llu (arrival %llu)",
                  (long long)m->step, (unsigned long long)newest_running->id,
                  (unsigned long long)newest_running->arrival, (unsigned long long)oldest_waiting->id,
                  (unsigned long long)oldest_waiting->arrival);
    }
}

/* Checks decision d against the scheduler's state. */
static void check_decision(sim *m, const st_sched_decision *d) {
    const int64_t bs = m->bs;
    int64_t errs = 0;
#define DCHECK(c, ...) do { if (!(c)) { errs++; CHECK_MSG(c, __VA_ARGS__); } } while (0)
    DCHECK(d->n_tokens <= m->p.max_num_batched_tokens, "step %lld: %lld tokens > budget", (long long)m->step, (long long)d->n_tokens);
    DCHECK(d->n_items <= m->p.max_batch, "step %lld: %lld items", (long long)m->step, (long long)d->n_items);
    DCHECK(d->block_size == bs, "block size");
    int64_t sum = 0;
    memset(m->slot_used, 0, (size_t)m->pool_slots);
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        DCHECK(it->slot_offset == sum, "item %lld: slot offset %lld, want %lld", (long long)i, (long long)it->slot_offset, (long long)sum);
        sum += it->n;
        DCHECK(it->n >= 1, "item %lld: n %lld", (long long)i, (long long)it->n);
        DCHECK(it->is_decode == (i < d->n_decodes), "item %lld: decode flag out of order", (long long)i);
        if (it->is_decode) DCHECK(it->n == 1 + it->n_draft, "decode item %lld runs %lld tokens with %lld drafts",
                                  (long long)i, (long long)it->n, (long long)it->n_draft);
        else DCHECK(it->n_draft == 0, "prefill item %lld has drafts", (long long)i);
        for (int64_t j = 0; j < i; j++) DCHECK(d->items[j].seq_id != it->seq_id, "seq %llu twice", (unsigned long long)it->seq_id);
        const st_seq *q = st_scheduler_get_seq(m->s, it->seq_id);
        DCHECK(q != NULL, "item %lld: seq %llu not live", (long long)i, (unsigned long long)it->seq_id);
        if (!q) continue;
        DCHECK(q->status == ST_SEQ_RUNNING, "item seq not running");
        DCHECK(it->seq && it->seq->cb.user == &m->reqs[it->seq_id] && it->seq->id == it->seq_id, "record");
        DCHECK(it->pos0 == q->kv.n_computed, "item %lld: pos0 %lld, computed %lld", (long long)i, (long long)it->pos0, (long long)q->kv.n_computed);
        DCHECK(it->pos0 + it->n - it->n_draft <= q->n_tokens, "item %lld runs past the known tokens", (long long)i);
        DCHECK(it->n_draft <= q->n_draft, "item %lld: %lld drafts of %lld proposed", (long long)i,
               (long long)it->n_draft, (long long)q->n_draft);
        DCHECK(it->need_logits == (it->pos0 + it->n - it->n_draft == q->n_tokens), "item %lld: need_logits %d",
               (long long)i, it->need_logits);
        /* an accepted draft is a token: never past max_tokens or max_model_len */
        DCHECK(q->n_tokens + it->n_draft < m->p.max_model_len &&
                   (q->max_tokens == 0 || st_seq_n_generated(q) + it->n_draft < q->max_tokens),
               "item %lld: %lld drafts past the sequence's limits", (long long)i, (long long)it->n_draft);
        DCHECK(it->tokens == q->tokens + it->pos0, "item tokens pointer");
        const int64_t pc = m->p.prefill_chunk;
        if (pc > 0 && !it->is_decode) {
            DCHECK(it->pos0 % pc == 0 || it->pos0 == it->n_cached, "item %lld: chunk starts at %lld", (long long)i, (long long)it->pos0);
            DCHECK((it->pos0 + it->n) % pc == 0 || it->pos0 + it->n == q->n_tokens, "item %lld: chunk ends at %lld",
                   (long long)i, (long long)(it->pos0 + it->n));
        }
        DCHECK(it->block_table == q->kv.blocks && it->n_blocks == q->kv.n_blocks, "item block table");
        DCHECK(it->n_blocks * bs >= it->pos0 + it->n, "item %lld: %lld blocks for %lld positions", (long long)i, (long long)it->n_blocks, (long long)(it->pos0 + it->n));
        for (int64_t k = 0; k < it->n && it->slot_offset + k < d->n_tokens; k++) {
            int64_t p = it->pos0 + k, slot = d->slot_mapping[it->slot_offset + k];
            DCHECK(slot == (int64_t)it->block_table[p / bs] * bs + p % bs, "slot of position %lld", (long long)p);
            DCHECK(slot >= 0 && slot < m->pool_slots, "slot %lld out of the pool", (long long)slot);
            if (slot < 0 || slot >= m->pool_slots) continue;
            DCHECK(!m->slot_used[slot], "step %lld: slot %lld written twice", (long long)m->step, (long long)slot);
            m->slot_used[slot] = 1;
            st_bm_block_info info;
            CHECK(st_bm_get_block(m->bm, (int32_t)(slot / bs), &info) == STRATA_OK);
            DCHECK(info.refcount == 1 && !info.registered, "step %lld: slot %lld is in a shared or cached block (ref %d, reg %d)",
                   (long long)m->step, (long long)slot, info.refcount, info.registered);
        }
    }
    DCHECK(sum == d->n_tokens, "items sum to %lld tokens, decision says %lld", (long long)sum, (long long)d->n_tokens);
    strata_status vst = st_scheduler_validate(m->s);
    DCHECK(vst == STRATA_OK, "step %lld: %s", (long long)m->step, st_last_error());
    check_fcfs(m);
    m->decision_errors += errs;
#undef DCHECK
}

/* The fake forward: writes the KV of every item, then reads every context
 * that needs logits and samples. tokens[i] for items with need_logits. */
static void fake_forward(sim *m, const st_sched_decision *d, int32_t *tokens) {
    const int64_t bs = m->bs;
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        const st_seq *q = st_scheduler_get_seq(m->s, it->seq_id);
        uint64_t h = DIGEST0;
        for (int64_t p = 0; p < it->pos0; p++) h = digest_step(h, q->tokens[p]);
        for (int64_t k = 0; k < it->n; k++) {
            h = digest_step(h, it->tokens[k]);
            int64_t slot = d->slot_mapping[it->slot_offset + k];
            m->kv_tok[slot] = it->tokens[k];
            m->kv_dig[slot] = h;
        }
    }
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        tokens[i] = -1;
        if (!it->need_logits) continue;
        const st_seq *q = st_scheduler_get_seq(m->s, it->seq_id);
        uint64_t h = DIGEST0, read = 0;
        const int64_t L = it->pos0 + it->n;
        for (int64_t p = 0; p < L; p++) {
            h = digest_step(h, q->tokens[p]);
            int64_t slot = (int64_t)it->block_table[p / bs] * bs + p % bs;
            if (m->kv_tok[slot] != q->tokens[p] || m->kv_dig[slot] != h) {
                if (m->kv_errors++ < 5)
                    fprintf(stderr, "step %lld: seq %llu position %lld: KV holds (%d, %llx), want (%d, %llx)\n",
                            (long long)m->step, (unsigned long long)q->id, (long long)p, m->kv_tok[slot],
                            (unsigned long long)m->kv_dig[slot], q->tokens[p], (unsigned long long)h);
            }
            read = m->kv_dig[slot];
            const int64_t row = p - (L - 1 - it->n_draft); /* a logit row: the last token's and the drafts' */
            if (row >= 0) m->rowtok[i][row] = next_token(read, m->eos);
        }
        tokens[i] = next_token(read, m->eos);
    }
}

static uint64_t g_rng;
static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

/* Drafts for every decoding sequence, as the runner's drafter would leave them: up to m->spec
 * tokens after its last, each the fake model's next token 70% of the time (the first wrong one
 * makes the rest wrong too), sometimes more than the limits allow (the scheduler cuts them). */
static void propose_drafts(sim *m) {
    for (int64_t i = 0; i < st_scheduler_num_running(m->s); i++) {
        st_seq *q = (st_seq *)st_scheduler_running(m->s, i);
        q->n_draft = 0;
        if (st_seq_n_pending(q) != 1) continue;
        const int64_t k = (int64_t)(rnd() % (uint64_t)(m->spec + 1));
        CHECK(st_seq_reserve(q, q->n_tokens + k + 1) == STRATA_OK);
        uint64_t h = DIGEST0;
        for (int64_t p = 0; p < q->n_tokens; p++) h = digest_step(h, q->tokens[p]);
        for (int64_t j = 0; j < k; j++) {
            int32_t t = next_token(h, m->eos);
            if (rnd() % 10 >= 7) t = 41 + (int32_t)(rnd() % 20); /* never the model's */
            q->tokens[q->n_tokens + j] = t;
            h = digest_step(h, t);
        }
        q->n_draft = k;
    }
}

/* One engine step. *info (may be NULL) gets a copy of the decision. Returns
 * whether anything ran. */
static bool sim_step(sim *m, step_info *info, bool abort_between) {
    m->step++;
    if (m->spec) propose_drafts(m);
    const st_sched_decision *d = NULL;
    strata_status st = st_scheduler_schedule(m->s, &d);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (st) return false;
    check_decision(m, d);
    if (info) {
        memset(info, 0, sizeof *info);
        info->n_items = d->n_items;
        info->n_decodes = d->n_decodes;
        info->n_tokens = d->n_tokens;
        info->n_preempted = d->n_preempted;
        for (int64_t i = 0; i < d->n_items && i < 64; i++) {
            info->ids[i] = d->items[i].seq_id;
            info->pos0[i] = d->items[i].pos0;
            info->n[i] = d->items[i].n;
            info->n_cached[i] = d->items[i].n_cached;
            info->decode[i] = d->items[i].is_decode;
            info->logits[i] = d->items[i].need_logits;
        }
        for (int64_t i = 0; i < d->n_preempted && i < 64; i++) info->preempted[i] = d->preempted[i];
    }
    const bool ran = d->n_items > 0;
    int32_t tokens[64];
    int64_t acc[64] = {0};
    ST_ASSERT(d->n_items <= 64);
    fake_forward(m, d, tokens);
    uint64_t ids[64];
    bool logits[64];
    int32_t accepted[64][33];
    const int64_t n_items = d->n_items;
    for (int64_t i = 0; i < n_items; i++) {
        ids[i] = d->items[i].seq_id;
        logits[i] = d->items[i].need_logits;
        /* verification, as the runner does it: drafts accepted while each is the row's token; the
         * first that is not (or an EOS draft) gives the token; all accepted: the last row's */
        const st_sched_item *it = &d->items[i];
        for (int64_t j = 0; j <= it->n_draft && logits[i]; j++) {
            tokens[i] = m->rowtok[i][j];
            if (j == it->n_draft || tokens[i] != it->tokens[1 + j] || (m->eos && tokens[i] == EOS)) break;
            accepted[i][acc[i]++] = tokens[i];
        }
    }
    if (abort_between && n_items > 0) { /* a client goes away after the forward, before the update */
        req *r = &m->reqs[ids[0]];
        CHECK(st_scheduler_abort(m->s, ids[0]) == STRATA_OK);
        r->done = r->aborted = true;
        r->reason = ST_SEQ_FINISH_ABORT;
        r->done_step = m->step;
    }
    st_seq *const *fin = NULL;
    int64_t n_fin = -1;
    st = st_scheduler_update(m->s, tokens, acc, &fin, &n_fin);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    for (int64_t i = 0; i < n_items; i++) {
        if (!logits[i]) continue;
        req *r = &m->reqs[ids[i]];
        if (r->done) continue; /* aborted between schedule and update */
        for (int64_t j = 0; j < acc[i]; j++) req_push(r, accepted[i][j]);
        req_push(r, tokens[i]);
        if (r->first_token_step < 0) r->first_token_step = m->step;
    }
    for (int64_t f = 0; f < n_fin; f++) {
        req *r = fin[f]->cb.user;
        CHECK(r == &m->reqs[fin[f]->id] && fin[f]->status == ST_SEQ_FINISHED);
        CHECK(!r->done);
        CHECK(st_seq_n_generated(fin[f]) == r->n_gen && fin[f]->n_prompt == r->n_prompt &&
              fin[f]->fin.completion_tokens == r->n_gen);
        r->done = true;
        r->reason = why(fin[f]);
        r->done_step = m->step;
        CHECK(st_scheduler_get_seq(m->s, fin[f]->id) == NULL && fin[f]->kv.n_blocks == 0);
    }
    /* the engine's own stops: an EOS ends the request */
    for (int64_t i = 0; i < n_items; i++) {
        req *r = &m->reqs[ids[i]];
        if (!logits[i] || r->done || !m->eos || r->gen[r->n_gen - 1] != EOS) continue;
        CHECK(st_scheduler_finish(m->s, ids[i], ST_FINISH_STOP) == STRATA_OK);
        r->done = true;
        r->reason = ST_SEQ_FINISH_STOP;
        r->done_step = m->step;
    }
    strata_status vst = st_scheduler_validate(m->s);
    CHECK_MSG(vst == STRATA_OK, "after update, step %lld: %s", (long long)m->step, st_last_error());
    check_fcfs(m);
    return ran;
}

/* Every request that was not aborted produced exactly its solo output. */
static void check_outputs(sim *m) {
    int32_t *want = malloc(4096 * sizeof *want);
    for (int i = 0; i < m->n_reqs; i++) {
        req *r = &m->reqs[i];
        CHECK_MSG(r->done, "request %d never finished", i);
        if (!r->done || r->aborted) continue;
        st_seq_finish reason;
        int64_t n = expected_output(m, r, want, 4096, &reason);
        CHECK_MSG(r->reason == reason, "request %d finished for %s, want %s", i, st_seq_finish_name(r->reason),
                  st_seq_finish_name(reason));
        CHECK_MSG(r->n_gen == n, "request %d: %lld tokens, want %lld", i, (long long)r->n_gen, (long long)n);
        if (r->n_gen == n) CHECK_MSG(memcmp(r->gen, want, (size_t)n * sizeof *want) == 0, "request %d: output differs", i);
    }
    free(want);
    CHECK_MSG(m->kv_errors == 0, "%lld KV positions read wrong", (long long)m->kv_errors);
    CHECK(m->decision_errors == 0);
}

static void run_to_end(sim *m, int64_t max_steps) {
    while (st_scheduler_has_work(m->s) && m->step < max_steps) sim_step(m, NULL, false);
    CHECK_MSG(!st_scheduler_has_work(m->s), "work left after %lld steps", (long long)m->step);
}

static void fill(int32_t *t, int64_t n, int32_t base) {
    for (int64_t i = 0; i < n; i++) t[i] = base + (int32_t)(i % 97);
}

/* ---- tests ------------------------------------------------------------------------------*/

static void test_params(void) {
    st_bm_params bp = {.num_blocks = 16, .block_size = 16};
    st_block_manager *bm = NULL;
    CHECK(st_bm_init(&bp, &bm) == STRATA_OK);
    st_scheduler *s = (st_scheduler *)1;
    st_scheduler_params p = {.max_num_batched_tokens = 4, .max_batch = 8, .max_model_len = 128};
    CHECK_ERR(st_scheduler_init(&p, bm, &s), STRATA_ERR_INVALID_ARG, "max_num_batched_tokens 4 < max_batch 8");
    CHECK(s == NULL);
    p = (st_scheduler_params){.max_num_batched_tokens = 64, .max_batch = 0, .max_model_len = 128};
    CHECK_ERR(st_scheduler_init(&p, bm, &s), STRATA_ERR_INVALID_ARG, "max_batch");
    p = (st_scheduler_params){.max_num_batched_tokens = 64, .max_batch = 4, .max_model_len = 1};
    CHECK_ERR(st_scheduler_init(&p, bm, &s), STRATA_ERR_INVALID_ARG, "max_model_len");
    /* 16 blocks of 16 = 256 slots: a sequence of 257 tokens runs 256 positions: fits; 258 does not */
    p = (st_scheduler_params){.max_num_batched_tokens = 64, .max_batch = 4, .max_model_len = 258};
    CHECK_ERR(st_scheduler_init(&p, bm, &s), STRATA_ERR_INVALID_ARG, "needs 17 KV blocks", "the pool has 16");
    p.max_model_len = 257;
    CHECK(st_scheduler_init(&p, bm, &s) == STRATA_OK);
    CHECK(st_scheduler_get_params(s)->max_model_len == 257);
    st_scheduler *s2 = NULL;
    CHECK_ERR(st_scheduler_init(&p, NULL, &s2), STRATA_ERR_INVALID_ARG, "block manager");
    CHECK_ERR(st_scheduler_update(s, NULL, NULL, NULL, NULL), STRATA_ERR_INVALID_ARG, "without a scheduled step");
    st_scheduler_free(s);
    st_scheduler_free(NULL);
    st_bm_free(bm);
}

static void test_reject_and_lengths(void) {
    sim m;
    sim_init(&m, 64, 16, 256, 4, 100, true);
    int32_t t[128];
    fill(t, 128, 1);
    /* the request is checked once, by st_seq_create: nothing reaches the scheduler */
    CHECK_ERR(sim_add(&m, t, 100, 5), STRATA_ERR_INVALID_ARG, "100 tokens", "context holds 100");
    CHECK_ERR(sim_add(&m, t, 120, 0), STRATA_ERR_INVALID_ARG, "120 tokens");
    CHECK_ERR(sim_add(&m, t, 0, 5), STRATA_ERR_INVALID_ARG, "empty");
    int32_t neg[2] = {3, -1};
    CHECK_ERR(sim_add(&m, neg, 2, 5), STRATA_ERR_INVALID_ARG, "outside the vocabulary");
    CHECK_ERR(sim_add(&m, t, 5, -1), STRATA_ERR_INVALID_ARG, "max_tokens");
    st_scheduler_stats ss;
    st_scheduler_get_stats(m.s, &ss);
    CHECK(ss.rejected == 0 && ss.added == 0 && !st_scheduler_has_work(m.s));
    /* 99 tokens: one generated token fills the context */
    CHECK(sim_add(&m, t, 99, 0) == STRATA_OK);
    {
        const st_request dq = {.prompt = t, .n_prompt = 3, .sampler = {.top_p = 1, .repeat_penalty = 1}};
        const st_seq_limits lim = {.vocab = VOCAB, .max_model_len = 100};
        st_seq *dup = NULL;
        CHECK(st_seq_create(&dq, &lim, NULL, 0, &dup) == STRATA_OK);
        CHECK_ERR(st_scheduler_add(m.s, dup), STRATA_ERR_INVALID_ARG, "already live");
        st_seq_free(dup);
    }
    /* max_tokens 0: until the context is full (100 - 90 = 10 tokens) */
    CHECK(sim_add(&m, t + 1, 90, 0) == STRATA_OK);
    CHECK(sim_add(&m, t + 2, 10, 3) == STRATA_OK);
    run_to_end(&m, 100);
    CHECK(m.reqs[0].reason == ST_SEQ_FINISH_CONTEXT && m.reqs[0].n_gen == 1);
    CHECK(m.reqs[1].reason == ST_SEQ_FINISH_CONTEXT && m.reqs[1].n_gen == 10);
    CHECK(m.reqs[2].reason == ST_SEQ_FINISH_MAX_TOKENS && m.reqs[2].n_gen == 3);
    check_outputs(&m);
    st_scheduler_get_stats(m.s, &ss);
    CHECK(ss.finished == 3 && ss.generated_tokens == 14);
    sim_free(&m);
}

/* A 1000-token prompt with a 256 budget: 4 steps alone (256, 256, 256, 232,
 * logits only after the last), and beside two running decodes every step is
 * exactly 256 tokens, decodes first. */
static void test_chunked_prefill(void) {
    sim m;
    sim_init(&m, 256, 16, 256, 8, 2048, true);
    int32_t t[1000];
    fill(t, 1000, 100);
    CHECK(sim_add(&m, t, 1000, 3) == STRATA_OK);
    step_info si;
    const int64_t want[4] = {256, 256, 256, 232};
    for (int k = 0; k < 4; k++) {
        sim_step(&m, &si, false);
        CHECK(si.n_items == 1 && si.n_decodes == 0 && si.n_tokens == want[k]);
        CHECK(si.pos0[0] == 256 * k && si.n[0] == want[k] && !si.decode[0]);
        CHECK(si.logits[0] == (k == 3));
        CHECK(m.reqs[0].n_gen == (k == 3 ? 1 : 0));
    }
    sim_step(&m, &si, false);
    CHECK(si.n_items == 1 && si.decode[0] && si.pos0[0] == 1000 && si.n[0] == 1 && si.logits[0]);
    run_to_end(&m, 100);
    CHECK(m.reqs[0].n_gen == 3);

    /* two short requests decoding, then the long prompt arrives */
    int32_t a[10], b[12];
    fill(a, 10, 7);
    fill(b, 12, 9);
    CHECK(sim_add(&m, a, 10, 50) == STRATA_OK); /* id 1 */
    CHECK(sim_add(&m, b, 12, 50) == STRATA_OK); /* id 2 */
    sim_step(&m, &si, false);
    CHECK(si.n_items == 2 && si.n_tokens == 22 && si.logits[0] && si.logits[1]);
    t[0] = 5; /* not a prefix hit of the first run */
    CHECK(sim_add(&m, t, 1000, 2) == STRATA_OK); /* id 3 */
    int64_t done = 0, steps = 0;
    while (done < 1000) {
        sim_step(&m, &si, false);
        steps++;
        CHECK(si.n_decodes == 2 && si.decode[0] && si.decode[1] && si.ids[0] == 1 && si.ids[1] == 2);
        CHECK(si.n_items == 3 && si.ids[2] == 3 && !si.decode[2] && si.pos0[2] == done);
        int64_t chunk = 1000 - done < 254 ? 1000 - done : 254;
        CHECK(si.n[2] == chunk);
        CHECK(si.n_tokens == 2 + chunk);
        if (done + chunk < 1000) CHECK(si.n_tokens == 256);
        CHECK(si.logits[2] == (done + chunk == 1000));
        done += si.n[2];
        if (steps > 10) break;
    }
    CHECK(steps == 4); /* 254 + 254 + 254 + 238 */
    run_to_end(&m, 500);
    check_outputs(&m);
    st_scheduler_stats ss;
    st_scheduler_get_stats(m.s, &ss);
    CHECK(ss.prefill_tokens == 1000 + 22 + 1000 && ss.preemptions == 0);
    sim_free(&m);
}

/* Aligned chunks (prefill_chunk 256): boundaries at multiples of 256 whatever
 * runs beside; a prefix hit starts the first chunk at the hit and ends it at
 * the next boundary; a chunk that does not fit the budget left waits whole,
 * and nobody newer is admitted before it. */
static void test_aligned_chunks(void) {
    sim m;
    st_bm_params bp = {.num_blocks = 16, .block_size = 16};
    st_block_manager *bm = NULL;
    CHECK(st_bm_init(&bp, &bm) == STRATA_OK);
    st_scheduler *s = NULL;
    st_scheduler_params bad = {.max_num_batched_tokens = 262, .max_batch = 8, .max_model_len = 64, .prefill_chunk = 256};
    CHECK_ERR(st_scheduler_init(&bad, bm, &s), STRATA_ERR_INVALID_ARG, "prefill_chunk 256 + max_batch 8 - 1");
    bad.prefill_chunk = -1;
    CHECK_ERR(st_scheduler_init(&bad, bm, &s), STRATA_ERR_INVALID_ARG, "prefill_chunk -1");
    st_bm_free(bm);

    sim_init_chunked(&m, 512, 16, 263, 8, 2048, true, 256);
    int32_t a[10], b[12], t[1000], u[600];
    fill(a, 10, 7);
    fill(b, 12, 9);
    fill(t, 1000, 100);
    CHECK(sim_add(&m, a, 10, 60) == STRATA_OK); /* 0 */
    CHECK(sim_add(&m, b, 12, 60) == STRATA_OK); /* 1 */
    step_info si;
    sim_step(&m, &si, false);
    CHECK(sim_add(&m, t, 1000, 2) == STRATA_OK); /* 2 */
    const int64_t want[4] = {256, 256, 256, 232};
    for (int k = 0; k < 4; k++) {
        sim_step(&m, &si, false);
        CHECK(si.n_decodes == 2 && si.n_items == 3 && si.ids[2] == 2);
        CHECK(si.pos0[2] == 256 * k && si.n[2] == want[k] && si.n_tokens == 2 + want[k]);
    }
    /* shares 300 tokens with request 2: 288 cached, then chunks [288, 512), [512, 600) */
    memcpy(u, t, 300 * sizeof *u);
    for (int i = 300; i < 600; i++) u[i] = 3000 + i;
    CHECK(sim_add(&m, u, 600, 2) == STRATA_OK); /* 3 */
    sim_step(&m, &si, false);
    CHECK(si.n_items == 4 && si.ids[3] == 3 && si.n_cached[3] == 288 && si.pos0[3] == 288 && si.n[3] == 224);
    sim_step(&m, &si, false);
    CHECK(si.ids[si.n_items - 1] == 3 && si.pos0[si.n_items - 1] == 512 && si.n[si.n_items - 1] == 88);
    run_to_end(&m, 500);
    /* two long prompts at once: the second never gets a cut chunk; it waits until the first's
     * chunks leave room, and the short request behind it is not admitted before it */
    CHECK(sim_add(&m, t + 1, 600, 1) == STRATA_OK); /* 4 */
    CHECK(sim_add(&m, u + 1, 590, 1) == STRATA_OK); /* 5 */
    CHECK(sim_add(&m, a + 1, 5, 1) == STRATA_OK);   /* 6 */
    int64_t first5 = -1;
    while (st_scheduler_has_work(m.s) && m.step < 1000) {
        sim_step(&m, &si, false);
        for (int64_t i = 0; i < si.n_items; i++) {
            if (si.decode[i]) continue;
            CHECK(si.pos0[i] == si.n_cached[i] || si.pos0[i] % 256 == 0);
            CHECK(si.pos0[i] + si.n[i] == (si.ids[i] == 4 ? 600 : si.ids[i] == 5 ? 590 : 5) || (si.pos0[i] + si.n[i]) % 256 == 0);
            if (si.ids[i] == 5 && first5 < 0) first5 = m.step;
            if (si.ids[i] == 6) CHECK_MSG(first5 >= 0, "request 6 overtook request 5");
        }
    }
    CHECK(first5 > 0);
    check_outputs(&m);
    sim_free(&m);
}

/* Aligned chunks let an older sequence still be prefilling while a newer one
 * decodes: when the older one's chunk needs blocks, the newer one is preempted
 * and its decode, already planned for this step, is dropped from it. */
static void test_preempt_planned_decode(void) {
    sim m;
    sim_init_chunked(&m, 4, 4, 9, 2, 17, true, 8);
    int32_t a[16], b[1] = {77};
    fill(a, 16, 30);
    CHECK(sim_add(&m, a, 16, 1) == STRATA_OK); /* 0 */
    CHECK(sim_add(&m, b, 1, 3) == STRATA_OK);  /* 1 */
    step_info si;
    sim_step(&m, &si, false); /* a [0, 8): 2 blocks; b's 1-token prompt in the budget left: 1 block */
    CHECK(si.n_items == 2 && si.ids[0] == 0 && si.n[0] == 8 && si.ids[1] == 1 && si.n[1] == 1);
    sim_step(&m, &si, false); /* b's decode is planned first, then a [8, 16) needs 2 blocks of 1 free */
    CHECK(si.n_preempted == 1 && si.preempted[0] == 1);
    CHECK(si.n_items == 1 && si.ids[0] == 0 && si.pos0[0] == 8 && si.n[0] == 8 && si.n_tokens == 8);
    run_to_end(&m, 50);
    check_outputs(&m);
    sim_free(&m);
}

/* A second request sharing a 256-token prefix computes only the rest; an
 * identical prompt computes only its last partial block (at least one token). */
static void test_prefix_reuse(void) {
    sim m;
    sim_init(&m, 128, 16, 512, 4, 1024, true);
    int32_t base[300], other[300];
    fill(base, 300, 1000);
    memcpy(other, base, sizeof other);
    for (int i = 256; i < 300; i++) other[i] = 5000 + i;
    step_info si;
    CHECK(sim_add(&m, base, 300, 4) == STRATA_OK);
    sim_step(&m, &si, false);
    CHECK(si.n_items == 1 && si.n[0] == 300 && si.n_cached[0] == 0);
    run_to_end(&m, 50); /* finished: its full blocks stay cached */
    st_scheduler_stats s0;
    st_scheduler_get_stats(m.s, &s0);
    CHECK(sim_add(&m, other, 300, 4) == STRATA_OK);
    sim_step(&m, &si, false);
    CHECK(si.n_items == 1 && si.n_cached[0] == 256 && si.pos0[0] == 256 && si.n[0] == 44 && si.logits[0]);
    run_to_end(&m, 50);
    st_scheduler_stats s1;
    st_scheduler_get_stats(m.s, &s1);
    CHECK(s1.prefill_tokens - s0.prefill_tokens == 44 && s1.cached_tokens == 256);
    /* the same prompt again: 18 full blocks (288 tokens) of 300, the last 12 computed */
    CHECK(sim_add(&m, base, 300, 4) == STRATA_OK);
    sim_step(&m, &si, false);
    CHECK(si.n_cached[0] == 288 && si.n[0] == 12);
    /* a prompt of exactly 256 shared tokens: the last block is computed again for its logits */
    CHECK(sim_add(&m, base, 256, 2) == STRATA_OK);
    run_to_end(&m, 50);
    check_outputs(&m);
    st_bm_stats bs;
    st_bm_get_stats(m.bm, &bs);
    CHECK(bs.hit_tokens == 256 + 288 + 240);
    CHECK(bs.queried_tokens == 300 * 3 + 256);
    sim_free(&m);
}

/* A pool of 8 blocks of 4 tokens: two sequences that both want to grow to
 * 28 tokens cannot; the newer is preempted, recomputes prompt + generated
 * tokens, and both end with their solo outputs. */
static void test_preemption(bool prefix_cache) {
    sim m;
    sim_init(&m, 8, 4, 64, 4, 32, prefix_cache);
    int32_t a[8], b[8];
    fill(a, 8, 10);
    fill(b, 8, 20);
    CHECK(sim_add(&m, a, 8, 20) == STRATA_OK);
    CHECK(sim_add(&m, b, 8, 20) == STRATA_OK);
    step_info si;
    int64_t preempt_step = -1, b_gen_at_preempt = -1;
    bool saw_recompute = false;
    while (st_scheduler_has_work(m.s) && m.step < 200) {
        sim_step(&m, &si, false);
        for (int64_t i = 0; i < si.n_preempted; i++) {
            CHECK(si.preempted[i] == 1); /* always the newer one */
            if (preempt_step < 0) {
                preempt_step = m.step;
                b_gen_at_preempt = m.reqs[1].n_gen;
                const st_seq *q = st_scheduler_get_seq(m.s, 1);
                CHECK(q && q->status == ST_SEQ_WAITING && q->kv.n_blocks == 0 && q->n_preemptions == 1);
                CHECK(q->n_tokens == 8 + b_gen_at_preempt);
                CHECK(st_scheduler_waiting(m.s, 0) == q); /* the front of the queue */
            }
        }
        for (int64_t i = 0; i < si.n_items; i++) {
            if (si.ids[i] != 1 || preempt_step < 0 || si.decode[i] || saw_recompute) continue;
            /* the first item of b after its preemption: recompute from the cached prefix
             * (or from 0) up to and including its last generated token */
            saw_recompute = true;
            CHECK(si.pos0[i] == si.n_cached[i] && si.pos0[i] % 4 == 0);
            if (!prefix_cache) CHECK(si.pos0[i] == 0);
            CHECK(si.pos0[i] + si.n[i] == 8 + b_gen_at_preempt && si.logits[i]);
        }
    }
    CHECK(preempt_step > 0 && saw_recompute);
    check_outputs(&m);
    CHECK(m.reqs[0].n_gen == 20 && m.reqs[1].n_gen == 20);
    CHECK(m.reqs[0].done_step < m.reqs[1].done_step);
    st_scheduler_stats ss;
    st_scheduler_get_stats(m.s, &ss);
    CHECK(ss.preemptions >= 1);
    printf("preemption (prefix cache %s): %lld preemptions, %lld prefill tokens (prompts: 16), %lld cached, %lld steps\n",
           prefix_cache ? "on" : "off", (long long)ss.preemptions, (long long)ss.prefill_tokens,
           (long long)ss.cached_tokens, (long long)m.step);
    sim_free(&m);
}

/* The newest running sequence preempts itself when it is the one that needs a
 * block; the older one's decode still runs. Its recompute then starts after
 * its own cached blocks. */
static void test_self_preemption(void) {
    sim m;
    sim_init(&m, 4, 4, 16, 2, 16, true); /* 16 slots */
    int32_t a[5], b[8];
    fill(a, 5, 40);
    fill(b, 8, 60);
    CHECK(sim_add(&m, a, 5, 3) == STRATA_OK); /* 0: 2 blocks, positions 5, 6 fit in them */
    CHECK(sim_add(&m, b, 8, 4) == STRATA_OK); /* 1: 2 full blocks; position 8 needs a third */
    step_info si;
    sim_step(&m, &si, false);
    CHECK(si.n_items == 2 && si.n_tokens == 13);
    st_bm_stats bs;
    st_bm_get_stats(m.bm, &bs);
    CHECK(bs.used == 4 && bs.free == 0);
    sim_step(&m, &si, false);
    CHECK(si.n_preempted == 1 && si.preempted[0] == 1);
    CHECK(si.n_items == 1 && si.ids[0] == 0 && si.decode[0] && si.pos0[0] == 5);
    const st_seq *q = st_scheduler_get_seq(m.s, 1);
    CHECK(q->status == ST_SEQ_WAITING && q->n_tokens == 9 && q->n_preemptions == 1);
    st_bm_get_stats(m.bm, &bs);
    CHECK(bs.cached == 2); /* b's two computed blocks stay findable */
    /* a finishes (3 tokens), then b comes back: 8 tokens cached, only its generated token recomputed */
    sim_step(&m, &si, false);
    CHECK(m.reqs[0].done && si.n_items == 1 && si.ids[0] == 0);
    sim_step(&m, &si, false);
    CHECK(si.n_items == 1 && si.ids[0] == 1 && !si.decode[0]);
    CHECK(si.n_cached[0] == 8 && si.pos0[0] == 8 && si.n[0] == 1 && si.logits[0]);
    run_to_end(&m, 50);
    check_outputs(&m);
    CHECK(m.reqs[1].n_gen == 4);
    sim_free(&m);
}

static void test_abort(void) {
    sim m;
    sim_init(&m, 32, 4, 32, 2, 64, true);
    int32_t t[40];
    fill(t, 40, 3);
    CHECK(sim_add(&m, t, 10, 30) == STRATA_OK);     /* 0 */
    CHECK(sim_add(&m, t + 1, 10, 30) == STRATA_OK); /* 1 */
    CHECK(sim_add(&m, t + 2, 10, 30) == STRATA_OK); /* 2: waits (max_batch 2) */
    step_info si;
    sim_step(&m, &si, false);
    CHECK(st_scheduler_num_running(m.s) == 2 && st_scheduler_num_waiting(m.s) == 1);
    /* abort the waiting one */
    CHECK(st_scheduler_abort(m.s, 2) == STRATA_OK);
    m.reqs[2].done = m.reqs[2].aborted = true;
    CHECK(st_scheduler_num_waiting(m.s) == 0);
    CHECK_ERR(st_scheduler_abort(m.s, 2), STRATA_ERR_NOT_FOUND, "no live sequence 2");
    CHECK_ERR(st_scheduler_abort(m.s, 77), STRATA_ERR_NOT_FOUND, "77");
    /* abort a running one: its blocks go back */
    st_bm_stats b0, b1;
    st_bm_get_stats(m.bm, &b0);
    const st_seq *q = st_scheduler_get_seq(m.s, 1);
    int64_t its_blocks = q->kv.n_blocks;
    CHECK(its_blocks == 3);
    CHECK(st_scheduler_abort(m.s, 1) == STRATA_OK);
    m.reqs[1].done = m.reqs[1].aborted = true;
    st_bm_get_stats(m.bm, &b1);
    CHECK(b1.used == b0.used - its_blocks);
    CHECK(b1.cached == b0.cached + 2); /* its two full computed blocks stay findable */
    CHECK(st_scheduler_validate(m.s) == STRATA_OK);
    /* abort between schedule and update: update skips it */
    sim_step(&m, &si, true);
    CHECK(m.reqs[0].aborted && !st_scheduler_has_work(m.s));
    st_bm_get_stats(m.bm, &b1);
    CHECK(b1.used == 0);
    /* finish by the caller (a stop string) */
    CHECK(sim_add(&m, t, 12, 30) == STRATA_OK); /* 3 */
    sim_step(&m, &si, false);
    sim_step(&m, &si, false);
    CHECK(m.reqs[3].n_gen == 2);
    CHECK_ERR(st_scheduler_finish(m.s, 3, ST_FINISH_COUNT_), STRATA_ERR_INVALID_ARG, "reason");
    CHECK(st_scheduler_finish(m.s, 3, ST_FINISH_STOP) == STRATA_OK);
    m.reqs[3].done = m.reqs[3].aborted = true; /* not checked against a solo run */
    st_scheduler_stats ss;
    st_scheduler_get_stats(m.s, &ss);
    CHECK(ss.aborted == 3 && ss.finished == 1);
    st_bm_get_stats(m.bm, &b1);
    CHECK(b1.used == 0);
    CHECK(st_scheduler_validate(m.s) == STRATA_OK);
    sim_free(&m);
}

/* FCFS with head-of-line blocking: a long request at the head of the queue
 * that does not fit yet is not overtaken by short ones behind it, and is
 * admitted as soon as it fits. */
static void test_fcfs_no_overtaking(void) {
    sim m;
    sim_init(&m, 16, 4, 64, 8, 64, false); /* 64 slots */
    int32_t t[64];
    fill(t, 64, 11);
    CHECK(sim_add(&m, t, 30, 8) == STRATA_OK); /* 0: holds 8..10 blocks while it runs */
    step_info si;
    sim_step(&m, &si, false);
    CHECK(sim_add(&m, t + 1, 40, 2) == STRATA_OK); /* 1: needs 10 blocks: cannot fit beside 0 */
    for (int k = 0; k < 6; k++) CHECK(sim_add(&m, t + 2 + k, 2, 2) == STRATA_OK); /* 2..7: tiny */
    int64_t admitted_1 = -1;
    while (st_scheduler_has_work(m.s) && m.step < 200) {
        sim_step(&m, &si, false);
        for (int64_t i = 0; i < si.n_items; i++) {
            if (si.ids[i] == 1 && admitted_1 < 0) admitted_1 = m.step;
            if (si.ids[i] >= 2) CHECK_MSG(admitted_1 >= 0, "request %llu overtook request 1", (unsigned long long)si.ids[i]);
        }
    }
    CHECK(admitted_1 == m.reqs[0].done_step + 1); /* the step after 0 freed its blocks */
    check_outputs(&m);
    sim_free(&m);
}

/* A decision that is not followed by an update (the forward failed) is
 * planned again, identically. */
static void test_dropped_decision(void) {
    sim m;
    sim_init(&m, 32, 4, 8, 2, 64, true);
    int32_t t[20];
    fill(t, 20, 5);
    CHECK(sim_add(&m, t, 20, 3) == STRATA_OK);
    const st_sched_decision *d;
    CHECK(st_scheduler_schedule(m.s, &d) == STRATA_OK);
    CHECK(d->n_items == 1 && d->items[0].n == 8 && d->items[0].pos0 == 0);
    int64_t s0[8];
    memcpy(s0, d->slot_mapping, sizeof s0);
    CHECK(st_scheduler_validate(m.s) == STRATA_OK);
    CHECK(st_scheduler_schedule(m.s, &d) == STRATA_OK); /* dropped: again */
    CHECK(d->n_items == 1 && d->items[0].n == 8 && d->items[0].pos0 == 0);
    CHECK(memcmp(s0, d->slot_mapping, sizeof s0) == 0);
    CHECK(st_scheduler_validate(m.s) == STRATA_OK);
    int32_t none[1] = {-1};
    fake_forward(&m, d, none);
    CHECK(st_scheduler_update(m.s, none, NULL, NULL, NULL) == STRATA_OK); /* no logits needed */
    none[0] = -1;
    CHECK_ERR(st_scheduler_update(m.s, none, NULL, NULL, NULL), STRATA_ERR_INVALID_ARG, "without a scheduled step");
    m.step = 1;
    run_to_end(&m, 50);
    check_outputs(&m);
    /* a missing sampled token is refused, nothing changes */
    CHECK(sim_add(&m, t, 3, 3) == STRATA_OK);
    CHECK(st_scheduler_schedule(m.s, &d) == STRATA_OK && d->items[0].need_logits);
    CHECK_ERR(st_scheduler_update(m.s, none, NULL, NULL, NULL), STRATA_ERR_INVALID_ARG, "needs a sampled token");
    CHECK(st_scheduler_get_seq(m.s, 1)->kv.n_computed == 0);
    st_scheduler_abort(m.s, 1);
    m.reqs[1].done = m.reqs[1].aborted = true;
    sim_free(&m);
}

/* ---- randomized workloads ----------------------------------------------------------------*/


static void random_workload(uint64_t seed, int n_requests, int64_t num_blocks, int64_t bs, int64_t budget,
                            int64_t max_batch, int64_t max_model_len, bool prefix_cache, int64_t prefill_chunk,
                            int spec) {
    g_rng = seed;
    sim m;
    sim_init_chunked(&m, num_blocks, bs, budget, max_batch, max_model_len, prefix_cache, prefill_chunk);
    m.eos = true;
    m.spec = spec;
    int32_t stems[4][512];
    for (int s = 0; s < 4; s++)
        for (int i = 0; i < 512; i++) stems[s][i] = 100 + (int32_t)(rnd() % 50);
    int added = 0;
    int64_t max_wait = 0, aborts = 0;
    int32_t prompt[512];
    const int failures0 = g_test_failures;
    while ((added < n_requests || st_scheduler_has_work(m.s)) && m.step < 20000) {
        /* arrivals: bursts and gaps */
        int burst = rnd() % 4 == 0 ? (int)(rnd() % 6) : 0;
        for (int k = 0; k < burst && added < n_requests; k++) {
            int64_t n = 1 + (int64_t)(rnd() % (uint64_t)(max_model_len - 1));
            if (rnd() % 3) n = 1 + (int64_t)(rnd() % 64); /* mostly short */
            int stem = (int)(rnd() % 4);
            int64_t shared = rnd() % 2 ? n : (int64_t)(rnd() % (uint64_t)(n + 1));
            for (int64_t i = 0; i < n; i++) prompt[i] = i < shared ? stems[stem][i] : (int32_t)(200 + rnd() % 50);
            int64_t max_tokens = rnd() % 8 == 0 ? 0 : 1 + (int64_t)(rnd() % 40);
            CHECK(sim_add(&m, prompt, n, max_tokens) == STRATA_OK);
            added++;
        }
        /* aborts: a random live request, sometimes between schedule and update */
        bool abort_between = false;
        if (rnd() % 50 == 0 && m.n_reqs > 0) {
            int id = (int)(rnd() % (uint64_t)m.n_reqs);
            if (!m.reqs[id].done) {
                CHECK(st_scheduler_abort(m.s, (uint64_t)id) == STRATA_OK);
                m.reqs[id].done = m.reqs[id].aborted = true;
                m.reqs[id].done_step = m.step;
                aborts++;
            }
        } else if (rnd() % 80 == 0) {
            abort_between = true;
            aborts++;
        }
        sim_step(&m, NULL, abort_between);
        if (m.kv_errors || m.decision_errors || g_test_failures > failures0) break;
    }
    CHECK_MSG(added == n_requests && !st_scheduler_has_work(m.s), "workload not done after %lld steps", (long long)m.step);
    check_outputs(&m);
    for (int i = 0; i < m.n_reqs; i++) {
        int64_t first = m.reqs[i].first_token_step >= 0 ? m.reqs[i].first_token_step : m.reqs[i].done_step;
        if (first - m.reqs[i].add_step > max_wait) max_wait = first - m.reqs[i].add_step;
    }
    st_scheduler_stats ss;
    st_scheduler_get_stats(m.s, &ss);
    st_bm_stats bs_;
    st_bm_get_stats(m.bm, &bs_);
    printf("random workload seed %llu (cache %s, chunk %lld, drafts %d: %lld of %lld accepted): %d requests in %lld "
           "steps, %lld preemptions, %lld aborts, "
           "%lld prefill + %lld decode tokens, hit rate %.3f, %lld evictions, %lld dedups, longest wait %lld steps\n",
           (unsigned long long)seed, prefix_cache ? "on" : "off", (long long)prefill_chunk, spec,
           (long long)ss.accepted, (long long)ss.drafted, n_requests, (long long)m.step,
           (long long)ss.preemptions, (long long)aborts, (long long)ss.prefill_tokens, (long long)ss.decode_tokens,
           st_bm_hit_rate(&bs_), (long long)bs_.evictions, (long long)bs_.dedups, (long long)max_wait);
    CHECK(ss.preemptions > 0); /* the pool is small enough to exercise preemption */
    if (spec) CHECK(ss.accepted > 0 && ss.drafted > ss.accepted);
    if (prefix_cache) CHECK(bs_.hit_tokens > 0);
    sim_free(&m);
}

int main(void) {
    test_params();
    test_reject_and_lengths();
    test_chunked_prefill();
    test_aligned_chunks();
    test_preempt_planned_decode();
    test_prefix_reuse();
    test_preemption(true);
    test_preemption(false);
    test_self_preemption();
    test_abort();
    test_fcfs_no_overtaking();
    test_dropped_decision();
    random_workload(1, 300, 48, 8, 48, 6, 256, true, 0, 0);
    random_workload(2, 300, 48, 8, 48, 6, 256, false, 0, 0);
    random_workload(3, 300, 40, 4, 32, 8, 128, true, 0, 0);
    random_workload(4, 200, 40, 16, 128, 16, 512, true, 0, 0);
    random_workload(5, 300, 48, 8, 40, 6, 256, true, 32, 0);
    random_workload(6, 300, 40, 4, 24, 8, 128, false, 16, 0);
    random_workload(7, 300, 48, 8, 48, 6, 256, true, 0, 4);
    random_workload(8, 300, 40, 4, 32, 8, 128, false, 0, 8);
    random_workload(9, 300, 48, 8, 40, 6, 256, true, 32, 6);
    return test_finish("test_scheduler");
}

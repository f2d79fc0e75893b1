/* engine/scheduler: see scheduler.h for the policy.
 *
 * State: `running` and `waiting` are arrays of sequences sorted by arrival
 * (oldest first). A step builds a plan (one entry per scheduled sequence) in
 * three passes, preempting from the end of `running` when blocks run out; a
 * preempted sequence's entry is marked dead and its tokens go back to the
 * budget. The decision (items, slot mapping) is built from the surviving
 * entries once every block is allocated, so the pointers it hands out are
 * never invalidated within the step.
 *
 * Capacities are fixed at init: at most max_batch sequences run, so a plan,
 * the items, the preempted list and the finished list have at most max_batch
 * entries, and the slot mapping at most max_num_batched_tokens. `waiting` is
 * grown at add time to hold every live sequence, so a preemption never
 * allocates.
 */
#include "engine/scheduler.h"

#include <string.h>

typedef struct {
    st_seq *seq;
    int64_t pos0, n;
    int64_t n_cached;
    int64_t n_draft;  /* decode: drafts after the pending token (n == 1 + n_draft) */
    bool decode;
    bool dead; /* its sequence was preempted later in the step */
} plan_entry;

struct st_scheduler {
    st_scheduler_params p;
    st_block_manager *bm;
    uint64_t next_arrival;

    st_seq **running; /* [max_batch] */
    int64_t n_running;
    st_seq **waiting;
    int64_t n_waiting, cap_waiting;

    plan_entry *plan; /* [max_batch] */
    int64_t n_plan;

    st_sched_decision dec;
    st_sched_item *items;  /* [max_batch] */
    st_seq **item_seq;     /* [max_batch] the items' sequences (NULL once finished / aborted) */
    int64_t *slots;        /* [max_num_batched_tokens] */
    uint64_t *preempted;   /* [max_batch] */
    bool pending;          /* dec awaits st_scheduler_update */

    st_seq **fin;          /* [max_batch + 1] sequences finished by the last update */
    int64_t n_fin;

    /* the streamed sequence (params.stream_tokens): running, not in `running`, no blocks */
    st_seq *streamed;
    int64_t stream_done;   /* its tokens whose KV is in host memory */
    st_sched_item stream_item;
    st_seq *stream_seq;    /* the stream item's sequence (NULL once finished / aborted) */

    st_scheduler_stats stats;
};

/* ---- init / free -------------------------------------------------------------------*/

strata_status st_scheduler_init(const st_scheduler_params *p, st_block_manager *bm, st_scheduler **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "scheduler: out is NULL");
    *out = NULL;
    if (!p || !bm) return st_err(STRATA_ERR_INVALID_ARG, "scheduler: params and block manager are required");
    if (p->max_batch < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: max_batch %lld < 1", (long long)p->max_batch);
    if (p->max_num_batched_tokens < p->max_batch)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "scheduler: max_num_batched_tokens %lld < max_batch %lld (every running sequence's decode must fit a step)",
                      (long long)p->max_num_batched_tokens, (long long)p->max_batch);
    if (p->max_model_len < 2)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: max_model_len %lld < 2", (long long)p->max_model_len);
    if (p->prefill_chunk < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: prefill_chunk %lld < 0", (long long)p->prefill_chunk);
    if (p->prefill_chunk > 0 && p->max_num_batched_tokens < p->prefill_chunk + p->max_batch - 1)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "scheduler: max_num_batched_tokens %lld < prefill_chunk %lld + max_batch %lld - 1 (the oldest "
                      "prefill's chunk must fit beside the other sequences' decodes)",
                      (long long)p->max_num_batched_tokens, (long long)p->prefill_chunk, (long long)p->max_batch);
    const int64_t bs = st_bm_block_size(bm);
    const int64_t seq_blocks = (p->max_model_len - 1 + bs - 1) / bs;
    if (p->stream_tokens < 0 || p->stream_align < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: stream_tokens %lld, stream_align %lld (< 0)",
                      (long long)p->stream_tokens, (long long)p->stream_align);
    if (seq_blocks > st_bm_num_blocks(bm) && p->stream_tokens == 0)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "scheduler: one sequence of max_model_len %lld tokens needs %lld KV blocks of %lld, the pool has %lld "
                      "(--kv-stream runs longer sequences from host memory)",
                      (long long)p->max_model_len, (long long)seq_blocks, (long long)bs,
                      (long long)st_bm_num_blocks(bm));
    st_scheduler *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "scheduler: out of memory for its state (%zu bytes)", sizeof *s);
    s->p = *p;
    s->bm = bm;
    const size_t B = (size_t)p->max_batch;
    s->running = st_calloc(B, sizeof *s->running);
    s->plan = st_calloc(B, sizeof *s->plan);
    s->items = st_calloc(B, sizeof *s->items);
    s->item_seq = st_calloc(B, sizeof *s->item_seq);
    s->slots = st_calloc((size_t)p->max_num_batched_tokens, sizeof *s->slots);
    s->preempted = st_calloc(B, sizeof *s->preempted);
    s->fin = st_calloc(B + 1, sizeof *s->fin);
    if (!s->running || !s->plan || !s->items || !s->item_seq || !s->slots || !s->preempted || !s->fin) {
        st_scheduler_free(s);
        return st_err(STRATA_ERR_NOMEM, "scheduler: out of memory for the tables of %lld sequences and %lld "
                      "batched tokens", (long long)B, (long long)p->max_num_batched_tokens);
    }
    s->dec.items = s->items;
    s->dec.slot_mapping = s->slots;
    s->dec.preempted = s->preempted;
    s->dec.block_size = bs;
    *out = s;
    return STRATA_OK;
}

void st_scheduler_free(st_scheduler *s) {
    if (!s) return;
    /* the records are their creators': only the blocks are released here */
    for (int64_t i = 0; i < s->n_running; i++) st_bm_seq_free(s->bm, &s->running[i]->kv);
    st_free(s->running);
    st_free(s->waiting);
    st_free(s->plan);
    st_free(s->items);
    st_free(s->item_seq);
    st_free(s->slots);
    st_free(s->preempted);
    st_free(s->fin);
    st_free(s);
}

/* ---- queues ----------------------------------------------------------------------------*/

/* Inserts q into arr[0..*n) keeping arrival order (room is guaranteed). */
static void insert_sorted(st_seq **arr, int64_t *n, st_seq *q) {
    int64_t i = 0;
    while (i < *n && arr[i]->arrival < q->arrival) i++;
    memmove(arr + i + 1, arr + i, (size_t)(*n - i) * sizeof *arr);
    arr[i] = q;
    (*n)++;
}

static bool remove_from(st_seq **arr, int64_t *n, const st_seq *q) {
    for (int64_t i = 0; i < *n; i++)
        if (arr[i] == q) {
            memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof *arr);
            (*n)--;
            return true;
        }
    return false;
}

bool st_scheduler_must_stream(const st_scheduler *s, const st_seq *q) {
    if (s->p.stream_tokens == 0) return false;
    int64_t len = q->max_tokens > 0 ? q->n_prompt + q->max_tokens : s->p.max_model_len;
    if (len > s->p.max_model_len) len = s->p.max_model_len;
    const int64_t bs = st_bm_block_size(s->bm);
    return (len - 1 + bs - 1) / bs > st_bm_num_blocks(s->bm); /* its last token is never run */
}

static st_seq *find_live(const st_scheduler *s, uint64_t id) {
    if (s->streamed && s->streamed->id == id) return s->streamed;
    for (int64_t i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id) return s->running[i];
    for (int64_t i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->id == id) return s->waiting[i];
    return NULL;
}

/* ---- add ----------------------------------------------------------------------------------*/

strata_status st_scheduler_add(st_scheduler *s, st_seq *q) {
    if (!s || !q) return st_err(STRATA_ERR_INVALID_ARG, "scheduler: add needs a scheduler and a sequence");
    /* checked at admission (st_seq_create): asserted here */
    ST_ASSERT(q->status == ST_SEQ_WAITING && q->n_tokens == q->n_prompt && q->n_prompt >= 1 &&
              q->n_prompt < s->p.max_model_len && q->kv.n_blocks == 0);
    const uint64_t id = q->id;
    if (find_live(s, id)) {
        s->stats.rejected++;
        return st_err(STRATA_ERR_INVALID_ARG, "request %llu: a sequence with this id is already live",
                      (unsigned long long)id);
    }
    /* room for every live sequence in `waiting`, so preemption never allocates */
    const int64_t need = s->n_waiting + s->n_running + 1;
    if (need > s->cap_waiting) {
        int64_t cap = s->cap_waiting ? s->cap_waiting * 2 : 64;
        while (cap < need) cap *= 2;
        st_seq **w = st_realloc(s->waiting, (size_t)cap * sizeof *w);
        if (!w) {
            s->stats.rejected++;
            return st_err(STRATA_ERR_NOMEM, "scheduler: cannot queue %lld requests", (long long)cap);
        }
        s->waiting = w;
        s->cap_waiting = cap;
    }
    q->arrival = s->next_arrival++;
    q->plan = -1;
    q->n_cached = -1;
    s->waiting[s->n_waiting++] = q;
    s->stats.added++;
    return STRATA_OK;
}

/* ---- schedule ----------------------------------------------------------------------------*/

/* Sends the newest running sequence v back to waiting: blocks released (full
 * computed blocks stay in the prefix cache), everything to be recomputed. Its
 * plan entry, if any, dies and gives its tokens back to the budget. */
static void preempt(st_scheduler *s, st_seq *v, int64_t *budget) {
    ST_ASSERT(s->n_running > 0 && s->running[s->n_running - 1] == v);
    s->n_running--;
    st_bm_seq_free(s->bm, &v->kv);
    if (v->plan >= 0) {
        plan_entry *e = &s->plan[v->plan];
        e->dead = true;
        *budget += e->n;
        v->plan = -1;
    }
    v->status = ST_SEQ_WAITING;
    v->n_preemptions++;
    s->stats.preemptions++;
    ST_ASSERT(s->n_waiting < s->cap_waiting);
    insert_sorted(s->waiting, &s->n_waiting, v);
    s->preempted[s->dec.n_preempted++] = v->id;
}

/* Gives running sequence q slots for positions [n_computed, n_computed + n),
 * preempting the newest running sequences while they do not fit. *gone: q
 * itself was preempted (it was the newest). */
static strata_status reserve_running(st_scheduler *s, st_seq *q, int64_t n, int64_t *budget, bool *gone) {
    *gone = false;
    const int64_t end = q->kv.n_computed + n;
    if (end == q->n_tokens) {
        strata_status st = st_seq_reserve(q, q->n_tokens + 1); /* room for the token update appends */
        if (st) return st;
    }
    const int64_t add = end > q->kv.n_slots ? end - q->kv.n_slots : 0;
    while (!st_bm_can_append(s->bm, &q->kv, add)) {
        st_seq *v = s->running[s->n_running - 1];
        preempt(s, v, budget);
        if (v == q) {
            *gone = true;
            return STRATA_OK;
        }
    }
    return st_bm_append_slots(s->bm, &q->kv, add);
}

/* The chunk a sequence with `computed` of `n_tokens` tokens computed runs
 * next with `budget` tokens left; 0 when it must wait (aligned chunks only). */
static int64_t chunk_for(const st_scheduler *s, int64_t computed, int64_t n_tokens, int64_t budget) {
    const int64_t pending = n_tokens - computed, pc = s->p.prefill_chunk;
    if (pc == 0) return pending < budget ? pending : budget;
    int64_t end = (computed / pc + 1) * pc;
    if (end > n_tokens) end = n_tokens;
    return end - computed <= budget ? end - computed : 0;
}

static void plan_add(st_scheduler *s, st_seq *q, int64_t n, bool decode, int64_t n_cached) {
    ST_ASSERT(s->n_plan < s->p.max_batch);
    q->plan = s->n_plan;
    s->plan[s->n_plan++] = (plan_entry){.seq = q, .pos0 = q->kv.n_computed, .n = n, .n_cached = n_cached,
                                        .n_draft = decode ? n - 1 : 0, .decode = decode};
}

/* The drafts decode q may run: its proposal, cut to what max_tokens and max_model_len leave (every
 * accepted draft is a token of the sequence), to `budget` and to the blocks free now (drafts never
 * preempt anyone). */
static int64_t drafts_for(const st_scheduler *s, const st_seq *q, int64_t budget) {
    int64_t k = q->n_draft;
    if (k <= 0) return 0;
    const int64_t len_room = s->p.max_model_len - q->n_tokens - 1;
    if (k > len_room) k = len_room;
    if (q->max_tokens > 0 && k > q->max_tokens - st_seq_n_generated(q) - 1)
        k = q->max_tokens - st_seq_n_generated(q) - 1;
    if (k > budget) k = budget;
    while (k > 0) {
        const int64_t end = q->kv.n_computed + 1 + k;
        if (st_bm_can_append(s->bm, &q->kv, end > q->kv.n_slots ? end - q->kv.n_slots : 0)) break;
        k--;
    }
    return k > 0 ? k : 0;
}

/* Admits the head of the waiting queue with a first chunk of at most `budget`
 * tokens. *admitted false: it does not fit now (state unchanged). */
static strata_status admit_head(st_scheduler *s, int64_t budget, int64_t *used, bool *admitted) {
    *admitted = false;
    st_seq *q = s->waiting[0];
    const int64_t bs = st_bm_block_size(s->bm);
    const int64_t cached = st_bm_lookup(s->bm, q->tokens, q->n_tokens, NULL);
    /* blocks the lower tiers hold after the device prefix */
    int64_t lower = 0;
    if (s->p.lower.lookup && cached % bs == 0) {
        lower = s->p.lower.lookup(s->p.lower.user, q->tokens, q->n_tokens, cached / bs);
        /* more of its prefix on its way from the SSD tier: the head waits for it */
        if (s->p.lower.prefetch && s->p.lower.prefetch(s->p.lower.user, q->tokens, q->n_tokens, cached / bs + lower) > 0)
            return STRATA_OK;
    }
    int64_t have = cached + lower * bs;
    int64_t chunk = chunk_for(s, have, q->n_tokens, budget);
    if (chunk == 0) return STRATA_OK;
    if (!st_bm_can_allocate(s->bm, q->tokens, q->n_tokens, have + chunk)) return STRATA_OK;
    strata_status st;
    if ((have + chunk == q->n_tokens || lower > 0) && (st = st_seq_reserve(q, q->n_tokens + 1))) return st;
    int64_t got = 0;
    if ((st = st_bm_seq_start(s->bm, &q->kv, q->tokens, q->n_tokens, &got))) return st;
    ST_ASSERT(got == cached);
    if ((st = st_bm_append_slots(s->bm, &q->kv, have - cached + chunk))) {
        st_bm_seq_free(s->bm, &q->kv);
        return st;
    }
    if (lower > 0) {
        const int64_t n_ok =
            s->p.lower.load(s->p.lower.user, q->tokens, q->n_tokens, cached / bs, lower, q->kv.blocks + cached / bs);
        ST_ASSERT(n_ok >= 0 && n_ok <= lower);
        if (n_ok < lower) { /* the rest is computed: the chunk starts earlier (its slots are there) */
            have = cached + n_ok * bs;
            const int64_t slots = q->kv.n_slots;
            chunk = chunk_for(s, have, q->n_tokens, budget);
            if (have + chunk > slots) chunk = slots - have;
        }
        if (n_ok > 0) {
            /* the loaded blocks count as computed and enter the device prefix cache */
            st = st_bm_commit(s->bm, &q->kv, q->tokens, have);
            ST_ASSERT(st == STRATA_OK);
            s->stats.lower_tokens += n_ok * bs;
            if (q->n_preemptions > 0) s->stats.swaps++;
        }
    }
    memmove(s->waiting, s->waiting + 1, (size_t)(s->n_waiting - 1) * sizeof *s->waiting);
    s->n_waiting--;
    q->status = ST_SEQ_RUNNING;
    insert_sorted(s->running, &s->n_running, q);
    if (q->n_cached < 0) q->n_cached = have;
    s->stats.cached_tokens += have;
    if (chunk > 0) plan_add(s, q, chunk, false, have); /* 0: an aligned chunk waits for the next step */
    *used = chunk;
    *admitted = true;
    return STRATA_OK;
}

static strata_status build_decision(st_scheduler *s) {
    st_sched_decision *d = &s->dec;
    int64_t off = 0, n = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t i = 0; i < s->n_plan; i++) {
            const plan_entry *e = &s->plan[i];
            if (e->dead || e->decode != (pass == 0)) continue;
            st_seq *q = e->seq;
            ST_ASSERT(e->pos0 == q->kv.n_computed && e->pos0 + e->n <= q->kv.n_slots && e->n >= 1);
            st_sched_item *it = &s->items[n];
            *it = (st_sched_item){
                .seq_id = q->id,
                .seq = q,
                .pos0 = e->pos0,
                .n = e->n,
                .tokens = q->tokens + e->pos0,
                .is_decode = e->decode,
                .n_draft = e->n_draft,
                .need_logits = e->pos0 + e->n - e->n_draft == q->n_tokens && !q->prefill_only,
                .n_cached = e->n_cached,
                .block_table = q->kv.blocks,
                .n_blocks = q->kv.n_blocks,
                .slot_offset = off,
            };
            ST_ASSERT(off + e->n <= s->p.max_num_batched_tokens);
            strata_status st = st_bm_slot_mapping(s->bm, &q->kv, e->pos0, e->n, s->slots + off);
            if (st) return st;
            s->item_seq[n] = q;
            off += e->n;
            n++;
        }
        if (pass == 0) d->n_decodes = n;
    }
    d->n_items = n;
    d->n_tokens = off;
    return STRATA_OK;
}

strata_status st_scheduler_schedule(st_scheduler *s, const st_sched_decision **out) {
    if (out) *out = NULL;
    if (!s || !out) return st_err(STRATA_ERR_INVALID_ARG, "scheduler: schedule needs a scheduler and out");
    st_sched_decision *d = &s->dec;
    s->pending = false;
    d->n_items = d->n_decodes = d->n_tokens = d->n_preempted = 0;
    d->step = ++s->stats.steps;
    s->n_plan = 0;
    for (int64_t i = 0; i < s->n_running; i++) s->running[i]->plan = -1;
    int64_t budget = s->p.max_num_batched_tokens;
    strata_status st = STRATA_OK;

    /* 1. decodes, oldest first; the budget left beside them goes to their drafts */
    int64_t n_dec = 0;
    for (int64_t i = 0; i < s->n_running; i++) n_dec += st_seq_n_pending(s->running[i]) == 1;
    for (int64_t i = 0; i < s->n_running; i++) {
        st_seq *q = s->running[i];
        if (st_seq_n_pending(q) != 1) {
            q->n_draft = 0;
            continue;
        }
        n_dec--; /* the decodes after this one */
        bool gone;
        if ((st = reserve_running(s, q, 1, &budget, &gone))) goto fail;
        if (gone) break; /* q was the newest: nothing after it */
        const int64_t k = drafts_for(s, q, budget - 1 - n_dec), end = q->kv.n_computed + 1 + k;
        q->n_draft = k;
        if (end > q->kv.n_slots && (st = st_bm_append_slots(s->bm, &q->kv, end - q->kv.n_slots))) goto fail;
        if (end < q->kv.n_slots && (st = st_bm_truncate_slots(s->bm, &q->kv, end))) goto fail; /* a dropped step's */
        plan_add(s, q, 1 + k, true, 0);
        budget -= 1 + k;
    }
    ST_ASSERT(budget >= 0);
    /* 2. prefill chunks of running sequences, oldest first */
    bool blocked = false; /* an aligned chunk had to wait: nobody newer goes first */
    for (int64_t i = 0; i < s->n_running && budget > 0; i++) {
        st_seq *q = s->running[i];
        if (q->plan >= 0) continue;
        ST_ASSERT(st_seq_n_pending(q) > 1);
        const int64_t chunk = chunk_for(s, q->kv.n_computed, q->n_tokens, budget);
        if (chunk == 0) {
            blocked = true;
            break;
        }
        bool gone;
        if ((st = reserve_running(s, q, chunk, &budget, &gone))) goto fail;
        if (gone) break;
        plan_add(s, q, chunk, false, 0);
        budget -= chunk;
    }
    /* 3. admissions, strictly FCFS, only in a step that preempted nobody */
    while (!blocked && d->n_preempted == 0 && s->n_waiting > 0 && s->n_running < s->p.max_batch && budget > 0 &&
           !st_scheduler_must_stream(s, s->waiting[0])) {
        bool admitted;
        int64_t used = 0;
        if ((st = admit_head(s, budget, &used, &admitted))) goto fail;
        if (!admitted) break;
        budget -= used;
    }
    /* 4. the streamed sequence: the head that must stream is admitted when none runs (FCFS: it is the head) */
    if (!s->streamed && s->n_waiting > 0 && st_scheduler_must_stream(s, s->waiting[0])) {
        st_seq *q = s->waiting[0];
        if ((st = st_seq_reserve(q, q->n_tokens + 1))) goto fail;
        memmove(s->waiting, s->waiting + 1, (size_t)(s->n_waiting - 1) * sizeof *s->waiting);
        s->n_waiting--;
        q->status = ST_SEQ_RUNNING;
        if (q->n_cached < 0) q->n_cached = 0;
        s->streamed = q;
        s->stream_done = 0;
    }
    d->stream = NULL;
    s->stream_seq = NULL;
    if (s->streamed) {
        st_seq *q = s->streamed;
        const int64_t pending = q->n_tokens - s->stream_done;
        ST_ASSERT(pending >= 1);
        if (pending == 1 && (st = st_seq_reserve(q, q->n_tokens + 1))) goto fail;
        int64_t n = pending < s->p.stream_tokens ? pending : s->p.stream_tokens;
        const int64_t seg_left = s->p.stream_align > 0 ? s->p.stream_align - s->stream_done % s->p.stream_align : n;
        n = n < seg_left ? n : seg_left;
        s->stream_item = (st_sched_item){.seq_id = q->id, .seq = q, .pos0 = s->stream_done, .n = n,
                                         .tokens = q->tokens + s->stream_done, .is_decode = pending == 1,
                                         .need_logits = s->stream_done + n == q->n_tokens};
        s->stream_seq = q;
        d->stream = &s->stream_item;
    }
    if ((st = build_decision(s))) goto fail;
    s->pending = true;
    *out = d;
    return STRATA_OK;
fail:
    /* Slots reserved so far stay with their sequences (they are reused by the
     * next schedule); nothing is marked computed. */
    d->n_items = d->n_decodes = d->n_tokens = 0;
    d->stream = NULL;
    return st;
}

/* ---- update / finish ---------------------------------------------------------------------*/

/* Removes live q (blocks released; the record stays its creator's, FINISHED
 * for `reason`); forgets it in the pending decision. */
static void drop_seq(st_scheduler *s, st_seq *q, st_finish_reason reason) {
    if (s->p.on_leave) s->p.on_leave(s->p.leave_user, q);
    if (q == s->streamed) {
        s->streamed = NULL;
        s->stream_done = 0;
        if (s->stream_seq == q) s->stream_seq = NULL;
    } else if (q->status == ST_SEQ_RUNNING) {
        ST_ASSERT(remove_from(s->running, &s->n_running, q));
        st_bm_seq_free(s->bm, &q->kv);
    } else {
        ST_ASSERT(remove_from(s->waiting, &s->n_waiting, q));
    }
    for (int64_t i = 0; i < s->dec.n_items; i++)
        if (s->item_seq[i] == q) s->item_seq[i] = NULL;
    q->fin.cached_tokens = q->n_cached < 0 ? 0 : q->n_cached;
    q->fin.preemptions = q->n_preemptions;
    q->fin.prompt_tokens = q->n_prompt;
    q->fin.completion_tokens = st_seq_n_generated(q);
    q->plan = -1;
    st_seq_set_finished(q, reason, NULL);
}

strata_status st_scheduler_update(st_scheduler *s, const int32_t *next_tokens, const int64_t *n_accepted,
                                  st_seq *const **finished, int64_t *n_finished) {
    if (finished) *finished = s ? s->fin : NULL;
    if (n_finished) *n_finished = 0;
    if (!s || !s->pending)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: update without a scheduled step to report");
    const st_sched_decision *d = &s->dec;
    for (int64_t i = 0; i < d->n_items; i++) {
        if (!s->item_seq[i] || !d->items[i].need_logits) continue;
        if (!next_tokens || next_tokens[i] < 0)
            return st_err(STRATA_ERR_INVALID_ARG, "scheduler: item %lld (seq %llu) needs a sampled token, got %d",
                          (long long)i, (unsigned long long)d->items[i].seq_id, next_tokens ? next_tokens[i] : -1);
        if (n_accepted && (n_accepted[i] < 0 || n_accepted[i] > d->items[i].n_draft))
            return st_err(STRATA_ERR_INVALID_ARG, "scheduler: item %lld (seq %llu): %lld of %lld drafts accepted",
                          (long long)i, (unsigned long long)d->items[i].seq_id, (long long)n_accepted[i],
                          (long long)d->items[i].n_draft);
    }
    if (d->stream && s->stream_seq && d->stream->need_logits && (!next_tokens || next_tokens[d->n_items] < 0))
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: the streamed sequence %llu needs a sampled token, got %d",
                      (unsigned long long)d->stream->seq_id, next_tokens ? next_tokens[d->n_items] : -1);
    s->pending = false;
    s->n_fin = 0;
    if (d->stream && s->stream_seq) {
        st_seq *q = s->stream_seq;
        const st_sched_item *it = d->stream;
        ST_ASSERT(s->stream_done == it->pos0);
        s->stream_done += it->n;
        if (it->is_decode) s->stats.decode_tokens += it->n;
        else s->stats.prefill_tokens += it->n;
        if (it->need_logits) {
            st_seq_append(q, next_tokens[d->n_items]);
            s->stats.generated_tokens++;
            const bool at_max = q->max_tokens > 0 && st_seq_n_generated(q) >= q->max_tokens;
            if (at_max || q->n_tokens >= s->p.max_model_len) {
                q->fin.context_full = !at_max;
                s->fin[s->n_fin++] = q;
                s->stats.finished++;
                drop_seq(s, q, ST_FINISH_LENGTH);
            }
        }
    }
    for (int64_t i = 0; i < d->n_items; i++) {
        st_seq *q = s->item_seq[i];
        if (!q) continue;
        const st_sched_item *it = &d->items[i];
        ST_ASSERT(q->kv.n_computed == it->pos0);
        /* drafts: the accepted ones become tokens (they are in place after the last); only their KV
         * counts, the rejected ones' slots go back */
        const int64_t acc = it->n_draft > 0 && n_accepted && it->need_logits ? n_accepted[i] : 0;
        if (it->n_draft > 0) {
            q->n_tokens += acc;
            s->stats.drafted += it->n_draft;
            s->stats.accepted += acc;
            s->stats.generated_tokens += acc;
            q->n_draft = 0;
        }
        strata_status st = st_bm_commit(s->bm, &q->kv, q->tokens, it->pos0 + it->n - (it->n_draft - acc));
        ST_ASSERT(st == STRATA_OK);
        if (it->n_draft > acc) {
            st = st_bm_truncate_slots(s->bm, &q->kv, q->kv.n_computed);
            ST_ASSERT(st == STRATA_OK);
        }
        if (it->is_decode) s->stats.decode_tokens += it->n;
        else s->stats.prefill_tokens += it->n;
        if (q->prefill_only && q->kv.n_computed == q->n_tokens) { /* P-D: the prompt's KV is all there */
            s->fin[s->n_fin++] = q;
            s->stats.finished++;
            drop_seq(s, q, ST_FINISH_STOP);
            continue;
        }
        if (!it->need_logits) continue;
        st_seq_append(q, next_tokens[i]);
        s->stats.generated_tokens++;
        const bool at_max = q->max_tokens > 0 && st_seq_n_generated(q) >= q->max_tokens;
        if (!at_max && q->n_tokens < s->p.max_model_len) continue;
        q->fin.context_full = !at_max;
        s->fin[s->n_fin++] = q;
        s->stats.finished++;
        drop_seq(s, q, ST_FINISH_LENGTH);
    }
    if (n_finished) *n_finished = s->n_fin;
    return STRATA_OK;
}

strata_status st_scheduler_finish(st_scheduler *s, uint64_t id, st_finish_reason reason) {
    if (!s || reason < 0 || reason >= ST_FINISH_COUNT_)
        return st_err(STRATA_ERR_INVALID_ARG, "scheduler: finish needs a scheduler and a reason");
    st_seq *q = find_live(s, id);
    if (!q) return st_err(STRATA_ERR_NOT_FOUND, "scheduler: no live sequence %llu", (unsigned long long)id);
    if (reason == ST_FINISH_ABORT) s->stats.aborted++;
    else s->stats.finished++;
    /* a STOP the caller decided (st_seq_postprocess) keeps its detail */
    drop_seq(s, q, reason);
    return STRATA_OK;
}

strata_status st_scheduler_abort(st_scheduler *s, uint64_t id) {
    return st_scheduler_finish(s, id, ST_FINISH_ABORT);
}

/* ---- queries -----------------------------------------------------------------------------*/

const st_seq *st_scheduler_get_seq(const st_scheduler *s, uint64_t id) { return find_live(s, id); }

const st_seq *st_scheduler_running(const st_scheduler *s, int64_t i) {
    return i >= 0 && i < s->n_running ? s->running[i] : NULL;
}

const st_seq *st_scheduler_waiting(const st_scheduler *s, int64_t i) {
    return i >= 0 && i < s->n_waiting ? s->waiting[i] : NULL;
}

int64_t st_scheduler_num_running(const st_scheduler *s) { return s->n_running; }
int64_t st_scheduler_num_waiting(const st_scheduler *s) { return s->n_waiting; }
bool st_scheduler_has_work(const st_scheduler *s) { return s->n_running + s->n_waiting > 0 || s->streamed; }
const st_scheduler_params *st_scheduler_get_params(const st_scheduler *s) { return &s->p; }

void st_scheduler_get_stats(const st_scheduler *s, st_scheduler_stats *out) {
    *out = s->stats;
    out->n_waiting = s->n_waiting;
    out->n_running = s->n_running + (s->streamed != NULL);
}

#define SFAIL(...) return st_err(STRATA_ERR_INTERNAL, "scheduler invariant: " __VA_ARGS__)

strata_status st_scheduler_validate(const st_scheduler *s) {
    if (s->n_running > s->p.max_batch)
        SFAIL("%lld running > max_batch %lld", (long long)s->n_running, (long long)s->p.max_batch);
    for (int pass = 0; pass < 2; pass++) {
        st_seq *const *arr = pass == 0 ? s->running : s->waiting;
        const int64_t n = pass == 0 ? s->n_running : s->n_waiting;
        const char *name = pass == 0 ? "running" : "waiting";
        for (int64_t i = 0; i < n; i++) {
            const st_seq *q = arr[i];
            if (i > 0 && arr[i - 1]->arrival >= q->arrival)
                SFAIL("%s queue out of arrival order at %lld", name, (long long)i);
            if (q->status != (pass == 0 ? ST_SEQ_RUNNING : ST_SEQ_WAITING))
                SFAIL("seq %llu in the %s queue has status %d", (unsigned long long)q->id, name, q->status);
            if (q->n_tokens < q->n_prompt || q->n_tokens >= s->p.max_model_len || q->n_tokens > q->cap)
                SFAIL("seq %llu holds %lld tokens (prompt %lld, max_model_len %lld)", (unsigned long long)q->id,
                      (long long)q->n_tokens, (long long)q->n_prompt, (long long)s->p.max_model_len);
            if (q->max_tokens > 0 && st_seq_n_generated(q) >= q->max_tokens)
                SFAIL("seq %llu is live with %lld of max %lld tokens generated", (unsigned long long)q->id,
                      (long long)st_seq_n_generated(q), (long long)q->max_tokens);
            if (pass == 1 && (q->kv.n_blocks || q->kv.n_slots || q->kv.n_computed))
                SFAIL("waiting seq %llu holds %lld KV blocks", (unsigned long long)q->id, (long long)q->kv.n_blocks);
            if (pass == 0 && (q->kv.n_computed >= q->n_tokens || q->kv.n_slots > q->n_tokens + q->n_draft))
                SFAIL("running seq %llu: %lld computed, %lld slots, %lld tokens", (unsigned long long)q->id,
                      (long long)q->kv.n_computed, (long long)q->kv.n_slots, (long long)q->n_tokens);
        }
    }
    const st_block_table **tables = st_malloc((size_t)(s->n_running + 1) * sizeof *tables);
    if (!tables)
        return st_err(STRATA_ERR_NOMEM, "scheduler: validate: out of memory for %lld block tables (%zu bytes)",
                      (long long)(s->n_running + 1), (size_t)(s->n_running + 1) * sizeof *tables);
    for (int64_t i = 0; i < s->n_running; i++) tables[i] = &s->running[i]->kv;
    strata_status st = st_bm_validate(s->bm, tables, s->n_running);
    st_free(tables);
    return st;
}

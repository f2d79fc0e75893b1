/* engine/scheduler: continuous batching over a paged KV cache: who runs
 * which tokens in the next step. It decides; it never executes. Host-only
 * logic (no model, no device): tests/test_scheduler.c drives it with a fake
 * model.
 *
 * The engine loop, one step:
 *
 *     st_scheduler_add(s, seq)              new requests (records made by st_seq_create,
 *                                           lent until they finish), any time between steps
 *     st_scheduler_schedule(s, &d)          the decision d for this step
 *     runner: for each item of d, run tokens[pos0 .. pos0+n) at positions
 *             pos0.., writing their K/V to d->slot_mapping[slot_offset ..
 *             slot_offset+n), attending over block_table (positions
 *             0 .. pos0+n-1); sample one token for each item with need_logits
 *     st_scheduler_update(s, next_tokens, &fin, &n_fin)
 *                                           marks the KV computed (full blocks
 *                                           enter the prefix cache), appends the
 *                                           sampled tokens, finishes sequences
 *                                           at max_tokens / max_model_len (LENGTH)
 *     st_scheduler_finish(s, id, ST_FINISH_STOP)   the caller's stops (stop ids and
 *                                                  strings: st_seq_postprocess)
 *     st_scheduler_abort(s, id)                        cancelled requests
 *
 * A step's plan (st_scheduler_schedule):
 *   1. Decodes: every running sequence with one pending token gets it (one
 *      token each), oldest first. The budget always covers them
 *      (max_num_batched_tokens >= max_batch). A sequence with speculative
 *      drafts (seq->n_draft, engine/spec.h) runs them after its token in the
 *      same item when the budget left beside the other decodes and the free
 *      blocks allow it without preempting anyone (else fewer, or none); never
 *      more than max_tokens and max_model_len leave room for.
 *   2. Prefill chunks of running sequences that are still prefilling (a long
 *      prompt, or a recompute after preemption), oldest first, each
 *      min(pending, budget left) tokens: a long prompt is split over several
 *      steps beside the decodes (chunked prefill) and the step's tokens never
 *      exceed max_num_batched_tokens. (With params.prefill_chunk, chunks are
 *      aligned instead: see there.)
 *   3. Admission from the waiting queue, strictly first come first served,
 *      while fewer than max_batch sequences run and budget is left: the head's
 *      cached prefix is taken from the prefix cache (st_bm_seq_start; the last
 *      token is always computed, for its logits) and its first chunk is
 *      min(rest, budget left). When the head's chunk does not fit in the free
 *      blocks it waits and nobody behind it is admitted (no overtaking). No
 *      admission in a step that preempted (the blocks are scarce; do not
 *      thrash), nor in one where an aligned chunk of a running sequence had
 *      to wait for budget.
 *   4. The streamed sequence (params.stream_tokens): the head of the waiting
 *      queue, when it cannot fit the pool alone and none streams now, is
 *      admitted without blocks; each step it runs one pass of at most
 *      stream_tokens tokens (d->stream), beside the batch.
 *   KV blocks for each chunk / decode come from the block manager. When a
 *   running sequence's tokens do not fit, the most recently arrived running
 *   sequence is preempted (by recompute: its blocks are released, full
 *   computed ones stay in the prefix cache, and it goes back to the waiting
 *   queue in arrival order, so ahead of every newer request, with its
 *   generated tokens to be recomputed after its prompt); repeat until it fits.
 *   When the sequence that needs room is itself the newest, it is the one
 *   preempted.
 *
 * Fairness / progress: priority is arrival order everywhere. The oldest
 * running sequence is never preempted by a newer one and always gets budget
 * (decodes take at most max_batch - 1 tokens of the budget beside it), and a
 * sequence alone always fits the pool (checked at init: ceil((max_model_len -
 * 1) / block_size) <= num_blocks; with stream_tokens, a sequence that would
 * not runs streamed instead and holds no blocks), so the oldest always
 * progresses; every
 * sequence finishes within max_model_len tokens; hence every request
 * eventually finishes, and a waiting request is never overtaken by a newer one.
 *
 * Lengths: a sequence holds at most max_model_len tokens (prompt + generated);
 * a prompt of max_model_len tokens or more is rejected by st_scheduler_add.
 * The last generated token is never run, so the KV holds at most
 * max_model_len - 1 positions.
 *
 * Not thread safe: the engine serialises every call (requests added or aborted
 * from other threads are handed over between steps).
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#include "engine/seq.h"
#include "kv/block_manager.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t max_num_batched_tokens; /* token budget of one step (decodes + prefill chunks), >= max_batch */
    int64_t max_batch;              /* most running sequences (so items per step), >= 1 */
    int64_t max_model_len;          /* most tokens of one sequence, prompt + generated, >= 2 */
    /* 0: a prefill chunk takes min(pending, budget left): the step is filled
     * exactly. > 0 (aligned chunks): a chunk ends at the next multiple of
     * prefill_chunk or at the sequence's last token, and is never cut by the
     * budget (a chunk that does not fit waits for the next step, and nobody
     * behind it goes first). Then a sequence's chunk boundaries depend only on
     * its own tokens and prefix-cache hit, never on what else runs (batch-
     * invariant numerics). Requires max_num_batched_tokens >= prefill_chunk +
     * max_batch - 1, so the oldest prefill always fits beside the decodes. */
    int64_t prefill_chunk;
    /* The KV tiers below the device (kv/kv_tiers.h through the runner; NULL
     * functions: none). At an admission, after the device prefix of c blocks:
     * lookup says how many more blocks (c, c+1, ...) the host tier holds;
     * prefetch, how many after those are on their way from the SSD tier (it
     * starts their reads): then the head waits (nobody overtakes it; running
     * sequences go on) and tries again at the next step; load brings n blocks
     * into the device blocks the sequence was just given and returns how many
     * leading ones will be there before the step's pass. Those count as cached:
     * the first chunk starts after them, and they enter the device prefix
     * cache. */
    struct {
        int64_t (*lookup)(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block);
        int64_t (*prefetch)(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block);
        int64_t (*load)(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block, int64_t n_blocks,
                        const int32_t *dev_blocks);
        void *user;
    } lower;
    /* Sequences longer than the device pool (model/llama.h
     * st_llama_forward_stream). 0: none: every sequence of max_model_len
     * tokens must fit the pool (checked at init). > 0: a sequence whose
     * longest possible length (prompt + max_tokens, at most max_model_len)
     * does not fit the pool alone runs *streamed*: its KV lives in host
     * memory and holds no device blocks; one at a time, in passes of at most
     * stream_tokens tokens, one pass per step beside the batch (the
     * decision's `stream` item). Admission stays first come first served: a
     * head that must stream waits while another streamed sequence runs, and
     * nobody overtakes it. A streamed sequence is never preempted. */
    int64_t stream_tokens;
    /* A pass of the streamed sequence ends at the next multiple of this many
     * tokens (its KV's host / SSD segment: a pass within one segment needs
     * only that segment on the host); 0: passes are not cut. */
    int64_t stream_align;
    /* Called when a sequence leaves the scheduler (finished, aborted; not
     * when preempted), with the record still live (NULL: none): the runner's
     * drafter forgets it. */
    void (*on_leave)(void *user, st_seq *q);
    void *leave_user;
} st_scheduler_params;

/* One sequence's work in a step: run tokens[0..n) at positions pos0 .. pos0+n-1. */
typedef struct {
    uint64_t seq_id;
    st_seq *seq;                /* the sequence (its record: sampler, callbacks, ...) */
    int64_t pos0;               /* == the sequence's computed tokens before this step */
    int64_t n;                  /* >= 1 */
    const int32_t *tokens;      /* [n] the ids to run (borrowed from the sequence) */
    bool is_decode;             /* a running sequence's single pending token (normally the token sampled
                                   in the previous step), followed by its n_draft drafts; else a
                                   prefill chunk */
    int64_t n_draft;            /* decode: speculative drafts after the pending token (n == 1 + n_draft;
                                   engine/spec.h): every row's logits are wanted, the runner verifies
                                   them and update is told how many were accepted */
    bool need_logits;           /* the chunk ends at the sequence's last known token: sample the next
                                   from the logits of position pos0 + n - 1; false for a prompt chunk
                                   that is not the last */
    int64_t n_cached;           /* tokens taken from the prefix cache when this item admitted the
                                   sequence (pos0 == n_cached then); 0 otherwise */
    const int32_t *block_table; /* [n_blocks] physical KV blocks of positions 0 .. pos0+n-1 (and maybe
                                   a few reserved beyond), borrowed */
    int64_t n_blocks;
    int64_t slot_offset;        /* this item's slots: slot_mapping[slot_offset .. slot_offset + n) */
} st_sched_item;

/* One step's decision. Owned by the scheduler; valid (with everything it
 * points to) until the next st_scheduler_* call that changes state (schedule,
 * update, add, finish, abort, free). */
typedef struct {
    uint64_t step;             /* counts schedule calls from 1 */
    st_sched_item *items;      /* [n_items]: decodes first (oldest first), then prefill chunks
                                  (running ones oldest first, then admissions) */
    int64_t n_items;           /* <= max_batch */
    int64_t n_decodes;         /* items[0 .. n_decodes) are the decodes */
    int64_t n_tokens;          /* sum of the items' n; <= max_num_batched_tokens */
    int64_t *slot_mapping;     /* [n_tokens] physical slot (block * block_size + offset) of every
                                  token, items concatenated in order; all distinct, all in blocks
                                  private to their sequence */
    uint64_t *preempted;       /* [n_preempted] sequences sent back to waiting in this step */
    int64_t n_preempted;
    int64_t block_size;
    /* the streamed sequence's pass (params.stream_tokens), NULL when none:
     * tokens [pos0, pos0 + n) through its host KV (no block table, no slots,
     * not counted in n_tokens); pos0 == 0 starts a new streamed sequence.
     * Its sampled token goes to next_tokens[n_items] in update. */
    const st_sched_item *stream;
} st_sched_decision;

typedef struct {
    int64_t n_waiting, n_running;
    uint64_t steps;
    int64_t drafted, accepted; /* speculative drafts run by decodes / accepted by update */
    int64_t prefill_tokens;    /* tokens run by prefill chunks (recomputes included), committed */
    int64_t decode_tokens;     /* tokens run by decodes, committed */
    int64_t generated_tokens;  /* tokens appended by update */
    int64_t cached_tokens;     /* tokens taken from the prefix cache at admissions (readmissions after
                                  a preemption included), every tier */
    int64_t lower_tokens;      /* of those, loaded from the lower tiers */
    int64_t swaps;             /* readmissions of preempted sequences whose KV came back from the lower
                                  tiers (at least one block) instead of being recomputed */
    int64_t preemptions;
    int64_t added, rejected, finished, aborted;
} st_scheduler_stats;

typedef struct st_scheduler st_scheduler;

/* Checks p against the pool (INVALID_ARG naming the bad value: the budget must
 * cover max_batch decodes, and one sequence of max_model_len tokens must fit
 * the pool) and makes an empty scheduler. Borrows bm (it must outlive the
 * scheduler, which is the only one to allocate from it). The caller owns *out
 * (st_scheduler_free); NULL on error. */
strata_status st_scheduler_init(const st_scheduler_params *p, st_block_manager *bm, st_scheduler **out);
/* Releases every live sequence's blocks to the block manager and frees the
 * scheduler (not the records: they are their creators'). NULL: no-op. */
void st_scheduler_free(st_scheduler *s);

/* Queues sequence q (FCFS position: the end), a WAITING record from
 * st_seq_create whose prompt is shorter than max_model_len (asserted: the
 * request was checked at its creation). The scheduler borrows q until it
 * finishes (update's finished list, st_scheduler_finish): then q is FINISHED,
 * holds no blocks and is the caller's again (it frees it). q->id must be
 * unique among live sequences. Errors, the scheduler unchanged: INVALID_ARG
 * for an id already live; NOMEM. */
strata_status st_scheduler_add(st_scheduler *s, st_seq *q);

/* Plans the next step (see the top of this file); *out is the decision (may
 * have no items when nothing is runnable). A previous decision not followed by
 * st_scheduler_update is dropped: nothing of it counts as computed, its tokens
 * are planned again (so a failed forward is retried by just scheduling again).
 * NOMEM when a sequence's arrays cannot grow (the state stays consistent). */
strata_status st_scheduler_schedule(st_scheduler *s, const st_sched_decision **out);

/* Reports the last decision executed: every item's tokens are computed (their
 * full blocks enter the prefix cache) and next_tokens[i] (>= 0) is the token
 * sampled for item i when items[i].need_logits (ignored otherwise; next_tokens
 * may be NULL when no item needs logits). A decode with drafts: its first
 * n_accepted[i] (0 .. n_draft) drafts were accepted: they and then
 * next_tokens[i] are appended, only the pending token and the accepted
 * drafts count as computed, and the slots of the rejected ones are given back
 * (n_accepted NULL: none accepted). Sequences that reach max_tokens or
 * max_model_len finish (FINISHED, fin.reason LENGTH, fin.context_full when
 * max_model_len did it, fin counters filled): their blocks are released and
 * they are listed in (*finished)[0 .. *n_finished) (the list is the
 * scheduler's, valid until the next state-changing call; the records are the
 * caller's; either pointer may be NULL). Items whose sequence was
 * finished or aborted after the schedule are skipped. INVALID_ARG (nothing
 * changed) when there is no decision to update or a needed token is
 * negative. */
strata_status st_scheduler_update(st_scheduler *s, const int32_t *next_tokens, const int64_t *n_accepted,
                                  st_seq *const **finished, int64_t *n_finished);
/* Whether a sequence of this record's longest possible length must stream
 * (params.stream_tokens > 0 and it does not fit the pool alone). */
bool st_scheduler_must_stream(const st_scheduler *s, const st_seq *q);

/* Ends a live sequence now (waiting or running; blocks released; the record
 * FINISHED for `reason`, with its fin counters, and the caller's again: the
 * scheduler never frees records). NOT_FOUND when `id` is not
 * live (unknown, already finished). Safe between schedule and update (the item
 * is skipped by update; the runner may still have written into its blocks,
 * which are not reused before the next schedule). */
strata_status st_scheduler_finish(st_scheduler *s, uint64_t id, st_finish_reason reason);
/* st_scheduler_finish(s, id, ST_FINISH_ABORT). */
strata_status st_scheduler_abort(st_scheduler *s, uint64_t id);

/* The live sequence `id` (read-only, valid until the next state-changing
 * call), or NULL. */
const st_seq *st_scheduler_get_seq(const st_scheduler *s, uint64_t id);
/* Live sequences in priority order: running ones oldest first, then waiting
 * ones (FCFS order). i in [0, n_running) / [0, n_waiting). */
const st_seq *st_scheduler_running(const st_scheduler *s, int64_t i);
const st_seq *st_scheduler_waiting(const st_scheduler *s, int64_t i);

int64_t st_scheduler_num_running(const st_scheduler *s);
int64_t st_scheduler_num_waiting(const st_scheduler *s);
bool st_scheduler_has_work(const st_scheduler *s);
const st_scheduler_params *st_scheduler_get_params(const st_scheduler *s);
void st_scheduler_get_stats(const st_scheduler *s, st_scheduler_stats *out);

/* Checks the scheduler's invariants and the block manager's over all running
 * tables (st_bm_validate): queues sorted by arrival, waiting sequences hold no
 * blocks, running ones hold slots for their computed tokens, at most max_batch
 * running. INTERNAL naming the first violation. For tests and debug builds. */
strata_status st_scheduler_validate(const st_scheduler *s);

#ifdef __cplusplus
}
#endif

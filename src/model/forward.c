/* model/forward: the layer loop of the one forward path (llama.h).
 *
 * A batch's metadata is packed into the pool's pinned staging buffer, copied
 * to the device in one transfer, and read there by the ops (token ids,
 * positions, sequence indices, slots, block tables, context lengths, the rows
 * that need logits). The layout is fixed (T = the model's max_tokens, B = the
 * pool's max_blocks), so that the device addresses of every field are the
 * same for every batch and a recorded pass (graphs.c) reads the new values:
 *   int64 slots[T] | int32 tokens[T] | pos[T] | seq[T] | logit_rows[T] |
 *   ctx_lens[T] | rope_pos[T] | block_tables[T * B] | key_slots[B * bs]
 * (rope_pos: pos + the batch's pos_offset, always written, so that a
 * recorded pass reads the shift of the batch it replays)
 * (key_slots: the slots of keys 0..ctx-1 of a gathered prefill chunk's
 * sequence, written and copied only for such a batch: see gather_ctx)
 * Only the batch's entries are written (ctx_lens past its sequences are 0:
 * sequences with no keys, never referenced by a token); the copy covers the
 * table rows of its sequences. Attention is told n_seqs = T and a context
 * bound rounded up to a bucket (batch_ctx_bucket), which changes nothing in
 * a token's arithmetic (backend.h: its reduction depends on its own keys).
 * The staging buffer is rewritten only by the next call, after this one's
 * final stream sync, so a copy still in flight never sees it change. */
#include "model/model_internal.h"

#include <string.h>

/* ---- weight groups: acquire -> (compute waits on ready) -> ops -> record done -> release */

typedef struct {
    int id;
    st_wm_view v;
    st_weight w[ST_WG_MAX_TENSORS]; /* in role order (weights/groups.h) */
} bound_group;

/* Ends the use of a group whose ops were enqueued with status `st` (returned
 * unless OK). The compute-done event is recorded even after a failed op, so
 * the group's slot is reused only after what was enqueued. */
static strata_status group_release(st_llama *m, bound_group *b, strata_status st) {
    st_event *done = b->v.done;
    if (done) {
        strata_status s2 = m->be->ops->event_record(m->be, done, m->stream);
        if (s2 != STRATA_OK) {
            if (st == STRATA_OK) st = s2;
            done = NULL; /* the manager then stops streaming: the slot's reuse cannot be ordered */
        }
    }
    strata_status s3 = st_wm_release(m->wm, b->id, done);
    return st != STRATA_OK ? st : s3;
}

static strata_status group_acquire(st_llama *m, int id, bound_group *b) {
    b->id = id;
    strata_status st = st_wm_acquire(m->wm, id, &b->v);
    if (st != STRATA_OK) return st;
    if (b->v.ready && (st = m->be->ops->stream_wait_event(m->be, m->stream, b->v.ready)) != STRATA_OK)
        return group_release(m, b, st);
    for (int i = 0; i < m->groups->g[id].n_tensors; i++) {
        b->w[i] = m->wshape[id][i];
        b->w[i].data = b->v.data[i];
    }
    return STRATA_OK;
}

/* The pool must have been made for this model's shapes and pass size. */
static strata_status pool_check(const st_llama *m, const st_kv_pool *kv) {
    const st_kv_pool_params *p = st_kv_pool_get_params(kv);
    const st_config *c = &m->cfg;
    if (p->n_layers != c->n_layers || p->n_kv_heads != c->n_kv_heads || p->head_dim != c->head_dim ||
        p->max_tokens < m->max_tokens || p->max_seq_len < m->max_seq_len || st_kv_pool_backend(kv) != m->be)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "forward: the KV pool (%lld layers x %lld kv heads x %lld, %lld tokens per pass, %lld positions) "
                      "was not made for this model (%lld x %lld x %lld, %lld, %lld) on its backend: use st_llama_kv_params",
                      (long long)p->n_layers, (long long)p->n_kv_heads, (long long)p->head_dim,
                      (long long)p->max_tokens, (long long)p->max_seq_len, (long long)c->n_layers,
                      (long long)c->n_kv_heads, (long long)c->head_dim, (long long)m->max_tokens,
                      (long long)m->max_seq_len);
    return STRATA_OK;
}

#define BAD(...) return st_err(STRATA_ERR_INVALID_ARG, "forward: " __VA_ARGS__)

static strata_status batch_check(const st_llama *m, const st_kv_pool *kv, const st_batch *b) {
    const int64_t n = b->n_tokens, bs = st_kv_pool_block_size(kv), nb = st_kv_pool_num_blocks(kv),
                  max_blocks = st_kv_pool_max_blocks(kv);
    if (n < 1 || n > m->max_tokens) BAD("%lld tokens (1 to max_tokens = %lld)", (long long)n, (long long)m->max_tokens);
    if (b->n_seqs < 1 || b->n_seqs > m->max_tokens)
        BAD("%lld sequences (1 to max_tokens = %lld)", (long long)b->n_seqs, (long long)m->max_tokens);
    if (b->max_blocks < 1 || b->max_blocks > max_blocks)
        BAD("max_blocks = %lld (1 to %lld: max_seq_len %lld / block_size %lld)", (long long)b->max_blocks,
            (long long)max_blocks, (long long)m->max_seq_len, (long long)bs);
    if (b->n_logits < 0 || b->n_logits > n) BAD("n_logits = %lld of %lld tokens", (long long)b->n_logits, (long long)n);
    if (b->pos_offset < 0 || b->pos_offset > INT32_MAX)
        BAD("pos_offset = %lld (0 to 2^31 - 1: RoPE positions are int32)", (long long)b->pos_offset);
    if (!b->tokens || !b->pos || !b->seq || !b->slots || !b->block_tables || !b->ctx_lens ||
        (b->n_logits > 0 && !b->logit_rows))
        BAD("a NULL array");
    for (int64_t s = 0; s < b->n_seqs; s++) {
        const int64_t len = b->ctx_lens[s];
        if (len < 1 || len > m->max_seq_len || len > b->max_blocks * bs)
            BAD("ctx_lens[%lld] = %lld (1 to min(max_seq_len = %lld, max_blocks * block_size = %lld))", (long long)s,
                (long long)len, (long long)m->max_seq_len, (long long)(b->max_blocks * bs));
        const int32_t *row = b->block_tables + s * b->max_blocks;
        for (int64_t j = 0; j < (len + bs - 1) / bs; j++)
            if (row[j] < 0 || row[j] >= nb)
                BAD("block_tables[%lld][%lld] = %d is outside the pool's %lld blocks", (long long)s, (long long)j,
                    row[j], (long long)nb);
    }
    for (int64_t i = 0; i < n; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->cfg.vocab_size)
            BAD("token %d (index %lld) is outside the vocabulary [0, %lld)", b->tokens[i], (long long)i,
                (long long)m->cfg.vocab_size);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            BAD("seq[%lld] = %d is outside [0, %lld)", (long long)i, b->seq[i], (long long)b->n_seqs);
        const int64_t p = b->pos[i], len = b->ctx_lens[b->seq[i]];
        if (p < 0 || p >= len)
            BAD("pos[%lld] = %lld is outside its sequence's %lld keys", (long long)i, (long long)p, (long long)len);
        if (p + b->pos_offset > INT32_MAX)
            BAD("pos[%lld] + pos_offset = %lld + %lld is past 2^31 - 1 (RoPE positions are int32)", (long long)i,
                (long long)p, (long long)b->pos_offset);
        const int64_t want = (int64_t)b->block_tables[b->seq[i] * b->max_blocks + p / bs] * bs + p % bs;
        if (b->slots[i] != -1 && b->slots[i] != want)
            BAD("slots[%lld] = %lld, but position %lld of its sequence is slot %lld", (long long)i,
                (long long)b->slots[i], (long long)p, (long long)want);
    }
    for (int64_t r = 0; r < b->n_logits; r++)
        if (b->logit_rows[r] < 0 || b->logit_rows[r] >= n || (r > 0 && b->logit_rows[r] <= b->logit_rows[r - 1]))
            BAD("logit_rows[%lld] = %d (increasing, in [0, %lld))", (long long)r, b->logit_rows[r], (long long)n);
    return STRATA_OK;
}

/* The attention context bound of a batch whose longest sequence holds
 * max_len keys: rounded up to 256-key ranges (a multiple of the CUDA kernel's split), then
 * to a power of two up to 8 ranges and a multiple of 8 ranges above, capped
 * at the pool's table width. Recorded passes are keyed on it: a sequence that
 * grows changes the key every 2048 keys at most. */
static int64_t batch_ctx_bucket(const st_kv_pool *kv, int64_t max_len) {
    int64_t r = (max_len + 255) / 256;
    if (r < 1) r = 1;
    if (r <= 8) {
        int64_t p = 1;
        while (p < r) p *= 2;
        r = p;
    } else {
        r = (r + 7) / 8 * 8;
    }
    const int64_t cap = st_kv_pool_max_blocks(kv) * st_kv_pool_block_size(kv);
    return r * 256 < cap ? r * 256 : cap;
}

/* Tokens of one sequence from which a chunk's attention runs gathered
 * (contiguous tensor-core kernels) rather than paged (SIMT tiles, one per
 * (token, kv head) range): a decode-sized batch stays paged. */
#define GATHER_MIN_TOKENS 16

/* Packs b into the staging buffer (the fixed layout above), copies it to the
 * device and points d at it. */
static strata_status batch_upload(st_llama *m, st_kv_pool *kv, const st_batch *b, batch_dev *d) {
    const int64_t n = b->n_tokens, T = m->max_tokens, B = st_kv_pool_max_blocks(kv), S = b->n_seqs;
    void *hv, *dv;
    size_t meta_bytes;
    st_kv_pool_meta(kv, &hv, &dv, &meta_bytes);
    uint8_t *h = hv;
    const size_t o_tok = (size_t)T * 8, o_pos = o_tok + (size_t)T * 4, o_seq = o_pos + (size_t)T * 4,
                 o_lr = o_seq + (size_t)T * 4, o_ctx = o_lr + (size_t)T * 4, o_rpos = o_ctx + (size_t)T * 4,
                 o_tab = o_rpos + (size_t)T * 4, total = o_tab + (size_t)(S * B) * 4;
    ST_ASSERT(o_tab + (size_t)(T * B) * 4 <= meta_bytes && S <= T && b->max_blocks <= B);
    memcpy(h, b->slots, (size_t)n * 8);
    memcpy(h + o_tok, b->tokens, (size_t)n * 4);
    memcpy(h + o_pos, b->pos, (size_t)n * 4);
    memcpy(h + o_seq, b->seq, (size_t)n * 4);
    if (b->n_logits) memcpy(h + o_lr, b->logit_rows, (size_t)b->n_logits * 4);
    memcpy(h + o_ctx, b->ctx_lens, (size_t)S * 4);
    memset(h + o_ctx + (size_t)S * 4, 0, (size_t)(T - S) * 4);
    int32_t *rpos = (int32_t *)(h + o_rpos);
    for (int64_t i = 0; i < n; i++) rpos[i] = (int32_t)(b->pos[i] + b->pos_offset); /* in range: batch_check */
    int32_t *tab = (int32_t *)(h + o_tab);
    for (int64_t s = 0; s < S; s++) /* the rest of a row is never read (past its sequence's blocks) */
        memcpy(tab + s * B, b->block_tables + s * b->max_blocks, (size_t)b->max_blocks * 4);
    TRY(m->be->ops->copy_h2d(m->be, m->stream, dv, h, total));
    const uint8_t *dm = dv;
    /* one sequence's prefill chunk (any pool dtype: kv_gather; int32 slot ids) */
    d->gather_ctx = 0;
    d->key_slots = NULL;
    d->ks = NULL;
    const st_kv_pool_params *kp = st_kv_pool_get_params(kv);
    if (S == 1 && n >= GATHER_MIN_TOKENS && kp->num_blocks * kp->block_size <= INT32_MAX) {
        const int64_t ctx = b->ctx_lens[0], bs = kp->block_size;
        const size_t o_key = o_tab + (size_t)(T * B) * 4;
        ST_ASSERT(o_key + (size_t)ctx * 4 <= meta_bytes && ctx <= m->max_seq_len);
        int32_t *keys = (int32_t *)(h + o_key);
        for (int64_t j = 0; j < ctx; j++) keys[j] = (int32_t)(b->block_tables[j / bs] * bs + j % bs);
        TRY(m->be->ops->copy_h2d(m->be, m->stream, (uint8_t *)dv + o_key, keys, (size_t)ctx * 4));
        d->gather_ctx = ctx;
        d->key_slots = (const int32_t *)(dm + o_key);
    }
    int64_t max_len = 0;
    for (int64_t s = 0; s < S; s++)
        if (b->ctx_lens[s] > max_len) max_len = b->ctx_lens[s];
    d->slots = (const int64_t *)dm;
    d->tokens = (const int32_t *)(dm + o_tok);
    d->pos = (const int32_t *)(dm + o_pos);
    d->rope_pos = (const int32_t *)(dm + o_rpos);
    d->seq = (const int32_t *)(dm + o_seq);
    d->logit_rows = (const int32_t *)(dm + o_lr);
    d->pk = (st_paged_kv){.block_size = st_kv_pool_block_size(kv),
                          .block_tables = (const int32_t *)(dm + o_tab), .max_blocks = B,
                          .ctx_lens = (const int32_t *)(dm + o_ctx), .n_seqs = T,
                          .max_ctx = batch_ctx_bucket(kv, max_len), .batch_seqs = S};
    return STRATA_OK;
}

/* A CPU-tier FFN group computed on the CPU (a pass of at most
 * cpu_max_tokens tokens): x and tmp go down to pinned host memory on the
 * compute stream, the host waits for that copy alone (the event; the one
 * wait a CPU computation needs, no device-wide sync), the model's CPU
 * backend runs the group's ops from the weights in host memory, and x and
 * tmp go back up on the compute stream (enqueued after the CPU finished, so
 * stream order suffices). Meanwhile the weight manager's copier keeps
 * filling the ring with the next streamed groups.
 * A split group (plan split_rows; weights/groups.h st_wg_split): the
 * device's part (its intermediate rows, streamed through the ring) is
 * enqueued on the compute stream right after the copies down, so the device
 * computes it while the CPU computes the rest in place (down read with a
 * row stride); both update x alike, and the CPU's part of the down product
 * goes up into xn (free once the device's part ran) and is added to tmp. */
static strata_status ffn_on_cpu(st_llama *m, int id, int64_t n) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const size_t bytes = (size_t)(n * m->cfg.hidden_size) * sizeof(float);
    TRY(o->copy_d2h(be, m->stream, m->h_x, m->x, bytes));
    TRY(o->copy_d2h(be, m->stream, m->h_tmp, m->tmp, bytes));
    TRY(o->event_record(be, m->cpu_ev, m->stream));
    st_wg_split sp;
    const int64_t split_rows = st_wm_plan(m->wm)->split_rows;
    const bool split = split_rows > 0 && st_wg_split_of(&m->groups->g[id], split_rows, &sp);
    if (split) {
        bound_group g;
        TRY(group_acquire(m, id, &g));
        g.w[ST_WG_GATE].rows = g.w[ST_WG_UP].rows = g.w[ST_WG_DOWN].cols = sp.rows;
        TRY(group_release(m, &g, st_llama_ffn_ops(m, g.w, n)));
    }
    const void *data[ST_WG_MAX_TENSORS];
    TRY(st_wm_acquire_host(m->wm, id, data));
    st_weight w[ST_WG_MAX_TENSORS];
    for (int i = 0; i < m->groups->g[id].n_tensors; i++) {
        w[i] = m->wshape[id][i];
        w[i].data = data[i];
    }
    if (split) { /* rows [0, cpu_rows) of gate and up, the same columns of down, in place */
        w[ST_WG_DOWN].stride = st_weight_stride(&w[ST_WG_DOWN]);
        w[ST_WG_GATE].rows = w[ST_WG_UP].rows = w[ST_WG_DOWN].cols = sp.cpu_rows;
    }
    const double t0 = st_time_now();
    TRY(o->event_sync(be, m->cpu_ev));
    const double t1 = st_time_now();
    TRY(st_llama_ffn_ops_cpu(m, w, n));
    st_wm_note_cpu(m->wm, t1 - t0, st_time_now() - t1);
    if (split) {
        TRY(o->copy_h2d(be, m->stream, m->xn, m->h_tmp, bytes));
        return o->add(be, m->stream, m->tmp, m->xn, n * m->cfg.hidden_size);
    }
    TRY(o->copy_h2d(be, m->stream, m->x, m->h_x, bytes));
    return o->copy_h2d(be, m->stream, m->tmp, m->h_tmp, bytes);
}

/* The pass itself, from the metadata on the device (d) to the logits in
 * m->logits and, when `sample`, the sampled ids in m->h_sids (the args in
 * m->h_sargs). Per layer: the layer's KV from the pool and the attention
 * group from the weight manager (the stream waits on their events), the
 * attention ops, the releases; then the FFN group. Everything it enqueues can
 * be recorded as a graph when the weights are resident: no host reads or
 * writes but the pinned h_sargs / h_sids, no allocation once the shape ran.
 * `tokens` (host) is read only by the embedding gather of streamed weights. */
strata_status st_llama_batch_ops(st_llama *m, st_kv_pool *kv, batch_dev *d, const int32_t *tokens, int64_t n,
                                 int64_t n_logits, bool sample) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    {   /* embedding */
        st_weight w = {0};
        const int32_t *ids = NULL;
        TRY(st_wm_embed(m->wm, m->stream, tokens, n, &w, &ids));
        TRY(o->get_rows(be, m->stream, &w, ids ? ids : d->tokens, n, m->x));
    }
    bound_group g;
    /* CPU-tier groups: computed on the CPU in a small pass (decode), streamed to the device in a larger one */
    const bool on_cpu = m->cpu && n <= m->cpu_max_tokens;
    if (m->cpu) st_wm_stream_cpu(m->wm, !on_cpu);
    const st_tier *tier = st_wm_plan(m->wm)->tier;
    for (int64_t l = 0; l < c->n_layers; l++) {
        st_kv_layer cache = {0};
        st_event *kv_ready = NULL;
        if (kv) TRY(st_kv_pool_acquire(kv, l, &cache, &kv_ready)); /* else a streamed sequence (d->ks) */
        strata_status st = kv_ready ? o->stream_wait_event(be, m->stream, kv_ready) : STRATA_OK;
        if (st == STRATA_OK && (st = group_acquire(m, st_wg_attn_id((int)l), &g)) == STRATA_OK)
            st = group_release(m, &g, st_llama_attn_ops(m, g.w, &cache, d, n, l));
        if (kv) st_kv_pool_release(kv, l, NULL); /* the device tier moves nothing: no done event needed yet */
        TRY(st);
        if (kv) TRY(st_kv_pool_layer_done(kv, l, m->stream));
        const int f = st_wg_ffn_id((int)l);
        if (on_cpu && tier[f] == ST_TIER_CPU) { /* the group's executor: the CPU */
            TRY(ffn_on_cpu(m, f, n));
            continue;
        }
        TRY(group_acquire(m, f, &g));
        TRY(group_release(m, &g, st_llama_ffn_ops(m, g.w, n)));
    }
    if (n_logits > 0) {
        TRY(group_acquire(m, st_wg_output_id(m->groups), &g));
        TRY(group_release(m, &g, st_llama_output_ops(m, g.w, d, n, n_logits)));
        if (sample) {
            const size_t na = (size_t)n_logits;
            TRY(o->copy_h2d(be, m->stream, m->d_sargs, m->h_sargs, na * sizeof(st_sample_args)));
            TRY(o->sample(be, m->stream, m->logits, n_logits, c->vocab_size, m->d_sargs, m->d_sids));
            TRY(o->copy_d2h(be, m->stream, m->h_sids, m->d_sids, na * sizeof(int32_t)));
        }
    }
    return STRATA_OK;
}

/* ---- shape buckets ----------------------------------------------------------------------
 * Recorded passes are keyed by their token count and logit-row count, so a
 * scheduler producing every batch size from 1 to max_batch would record a
 * graph for each. On a backend with graphs (CUDA; whether this pass is
 * recorded or not, so that the numbers do not depend on it: a GEMM's row
 * results may depend on its row count), a batch of more than 8 tokens is
 * padded to its bucket (16, 24, 32, 48, 64, 96, 128, 192, 256) with dummy
 * tokens (token 0 at position 0 of the batch's first sequence, slot -1: no
 * K/V stored, nothing reads their output), and its logit rows likewise with
 * rows of those dummies (as many as there are). A dummy changes no real
 * token's arithmetic (attention is per token; every matmul row is computed
 * alone), so padding only costs the dummies' compute. Up to 8 tokens the
 * shapes stay exact (decode steps of a few sequences: the GEMV's sweet spot). A
 * single sequence's prefill chunk of GATHER_MIN_TOKENS or more is never padded
 * (it runs gathered and direct). */
static int64_t shape_bucket(int64_t n) {
    static const int64_t b[] = {16, 24, 32, 48, 64, 96, 128, 192, 256};
    if (n <= 8) return n;
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        if (n <= b[i]) return b[i];
    return n;
}

/* *out = b padded to its bucket in m's pad arrays (args too, when given:
 * dummies draw greedily); false when b runs as it is. */
static bool pad_batch(st_llama *m, const st_batch *b, const st_sample_args *args, st_batch *out) {
    const int64_t n = b->n_tokens, nl = b->n_logits;
    if (n <= 8 || n > BG_MAX_TOKENS || (b->n_seqs == 1 && n >= GATHER_MIN_TOKENS) || m->be->kind != ST_BACKEND_CUDA)
        return false;
    const int64_t np = shape_bucket(n);
    if (np == n || np > m->max_tokens) return false;
    int64_t nlp = shape_bucket(nl);
    if (nlp > nl + (np - n)) nlp = nl + (np - n);
    memcpy(m->pad_tokens, b->tokens, (size_t)n * sizeof(int32_t));
    memcpy(m->pad_pos, b->pos, (size_t)n * sizeof(int32_t));
    memcpy(m->pad_seq, b->seq, (size_t)n * sizeof(int32_t));
    memcpy(m->pad_slots, b->slots, (size_t)n * sizeof(int64_t));
    for (int64_t i = n; i < np; i++) {
        m->pad_tokens[i] = 0;
        m->pad_pos[i] = 0;
        m->pad_seq[i] = 0;
        m->pad_slots[i] = -1;
    }
    if (nl) memcpy(m->pad_rows, b->logit_rows, (size_t)nl * sizeof(int32_t));
    for (int64_t r = nl; r < nlp; r++) m->pad_rows[r] = (int32_t)(n + (r - nl));
    if (args)
        for (int64_t r = nl; r < nlp; r++) m->h_sargs[r] = (st_sample_args){.temperature = 0.0f, .top_p = 1.0f};
    *out = *b;
    out->n_tokens = np;
    out->tokens = m->pad_tokens;
    out->pos = m->pad_pos;
    out->seq = m->pad_seq;
    out->slots = m->pad_slots;
    out->logit_rows = m->pad_rows;
    out->n_logits = nlp;
    return true;
}

/* Enqueues the whole pass (st_llama_forward below synchronizes). logits: host
 * [n_logits, V] or NULL (not copied); args: host [n_logits] or NULL: the
 * sample op's ids land in m->h_sids. */
static strata_status forward_enqueue(st_llama *m, st_kv_pool *kv, const st_batch *b, float *logits,
                                           const st_sample_args *args) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const int64_t V = m->cfg.vocab_size;
    const bool sample = args && b->n_logits > 0;
    TRY(st_wm_begin(m->wm));
    if (sample) memcpy(m->h_sargs, args, (size_t)b->n_logits * sizeof *args);
    st_batch padded;
    const st_batch *rb = pad_batch(m, b, sample ? args : NULL, &padded) ? &padded : b; /* the real rows first */
    batch_dev d;
    TRY(batch_upload(m, kv, rb, &d));
    /* the lower KV tiers' loads go after the metadata upload (one copy engine
     * serves both: queued behind them, the pass would start when they end) */
    TRY(st_kv_pool_begin_pass(kv));
    TRY(st_llama_batch_run(m, kv, &d, rb, sample));
    if (b->n_logits > 0 && logits)
        TRY(o->copy_d2h(be, m->stream, logits, m->logits, (size_t)(b->n_logits * V) * sizeof(float)));
    return STRATA_OK;
}

strata_status st_llama_forward(st_llama *m, st_kv_pool *kv, const st_batch *b, float *logits) {
    if (!m || !kv || !b) return st_err(STRATA_ERR_INVALID_ARG, "forward: no model, pool or batch");
    TRY(pool_check(m, kv));
    TRY(batch_check(m, kv, b));
    if (b->n_logits > 0 && !logits) return st_err(STRATA_ERR_INVALID_ARG, "forward: logits is NULL");
    const strata_status st = forward_enqueue(m, kv, b, logits, NULL);
    /* the one host sync: logits readable, and the staging buffer free for the
     * next call even when an op failed after the metadata copy was enqueued */
    const strata_status s2 = m->be->ops->stream_sync(m->be, m->stream);
    return st != STRATA_OK ? st : s2;
}

strata_status st_llama_forward_sample(st_llama *m, st_kv_pool *kv, const st_batch *b, const st_sample_args *args,
                                      int32_t *ids, float *logits) {
    if (!m || !kv || !b) return st_err(STRATA_ERR_INVALID_ARG, "forward_sample: no model, pool or batch");
    TRY(pool_check(m, kv));
    TRY(batch_check(m, kv, b));
    if (b->n_logits > 0 && (!args || !ids))
        return st_err(STRATA_ERR_INVALID_ARG, "forward_sample: args or ids is NULL");
    const strata_status st = forward_enqueue(m, kv, b, logits, b->n_logits > 0 ? args : NULL);
    const strata_status s2 = m->be->ops->stream_sync(m->be, m->stream); /* the one host sync */
    if (st == STRATA_OK && s2 == STRATA_OK && b->n_logits > 0)
        memcpy(ids, m->h_sids, (size_t)b->n_logits * sizeof *ids);
    return st != STRATA_OK ? st : s2;
}

/* ---- one sequence ------------------------------------------------------------------- */

strata_status st_llama_forward_seq(st_llama *m, st_kv_pool *kv, const int32_t *tokens, int64_t n, int64_t n_past,
                                   bool all_logits, float *logits) {
    return st_llama_forward_seq_at(m, kv, tokens, n, n_past, 0, all_logits, logits);
}

strata_status st_llama_forward_seq_at(st_llama *m, st_kv_pool *kv, const int32_t *tokens, int64_t n, int64_t n_past,
                                      int64_t pos_offset, bool all_logits, float *logits) {
    if (!m || !kv || !tokens || n < 1 || n_past < 0 || !logits)
        return st_err(STRATA_ERR_INVALID_ARG, "forward_seq: no model, pool, tokens or logits, or n = %lld, n_past = %lld",
                      (long long)n, (long long)n_past);
    const int64_t bs = st_kv_pool_block_size(kv), room = st_kv_pool_num_blocks(kv) * bs;
    const int64_t end = n_past + n, cap = room < m->max_seq_len ? room : m->max_seq_len;
    if (end > cap)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "forward_seq: %lld tokens after %lld exceed the context of %lld tokens (--ctx)", (long long)n,
                      (long long)n_past, (long long)cap);
    if (pos_offset < 0 || pos_offset > (int64_t)INT32_MAX - (end - 1))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "forward_seq: pos_offset = %lld puts RoPE positions %lld .. %lld outside 0 .. 2^31 - 1",
                      (long long)pos_offset, (long long)(pos_offset + n_past), (long long)(pos_offset + end - 1));
    const int64_t T = m->max_tokens, nb = (end + bs - 1) / bs, V = m->cfg.vocab_size;
    int32_t *table = st_malloc((size_t)nb * sizeof *table), *pos = st_malloc((size_t)T * sizeof *pos);
    int32_t *seq = st_calloc((size_t)T, sizeof *seq), *rows = st_malloc((size_t)T * sizeof *rows);
    int64_t *slots = st_malloc((size_t)T * sizeof *slots);
    strata_status st = STRATA_OK;
    if (!table || !pos || !seq || !rows || !slots)
        st = st_err(STRATA_ERR_NOMEM, "forward_seq: out of memory for the batch of %lld tokens and %lld blocks "
                    "(%zu bytes)", (long long)T, (long long)nb,
                    (size_t)nb * sizeof *table + (size_t)T * (3 * sizeof(int32_t) + sizeof *slots));
    for (int64_t b = 0; st == STRATA_OK && b < nb; b++) table[b] = (int32_t)b;
    for (int64_t done = 0; st == STRATA_OK && done < n; done += T) {
        const int64_t k = n - done < T ? n - done : T, p0 = n_past + done;
        const bool last = done + k == n;
        for (int64_t i = 0; i < k; i++) {
            pos[i] = (int32_t)(p0 + i);
            slots[i] = p0 + i; /* block b holds positions b*bs.. */
            rows[i] = (int32_t)i;
        }
        const int32_t ctx = (int32_t)(p0 + k);
        const int64_t n_logits = all_logits ? k : last ? 1 : 0;
        const st_batch b = {.n_tokens = k, .tokens = tokens + done, .pos = pos, .seq = seq, .slots = slots,
                            .n_seqs = 1, .block_tables = table, .max_blocks = (ctx + bs - 1) / bs, .ctx_lens = &ctx,
                            .logit_rows = all_logits ? rows : rows + k - 1, .n_logits = n_logits,
                            .pos_offset = pos_offset};
        st = st_llama_forward(m, kv, &b, all_logits ? logits + done * V : logits);
    }
    st_free(table);
    st_free(pos);
    st_free(seq);
    st_free(rows);
    st_free(slots);
    return st;
}

/* ---- one streamed sequence ----------------------------------------------------------- */

/* The metadata of a streamed pass of k tokens at positions p0.. (tail start
 * ts) in ks's buffer, copied to the device: int64 slots[T] | int32 tokens[T] |
 * pos[T] | rope_pos[T] | logit_rows[T] (T = max_tokens; 32 bytes a token). */
static strata_status stream_upload(st_llama *m, st_kv_stream *ks, const int32_t *tokens, int64_t k, int64_t p0,
                                   int64_t pos_offset, int64_t n_logits, batch_dev *d) {
    const int64_t T = m->max_tokens, ts = st_kv_stream_tail_start(ks);
    void *hv, *dv;
    size_t bytes;
    st_kv_stream_meta(ks, &hv, &dv, &bytes);
    ST_ASSERT(bytes >= (size_t)T * 24 + (size_t)T * 8);
    uint8_t *h = hv;
    const size_t o_tok = (size_t)T * 8, o_pos = o_tok + (size_t)T * 4, o_rpos = o_pos + (size_t)T * 4,
                 o_lr = o_rpos + (size_t)T * 4;
    int64_t *slots = (int64_t *)h;
    int32_t *pos = (int32_t *)(h + o_pos), *rpos = (int32_t *)(h + o_rpos), *rows = (int32_t *)(h + o_lr);
    memcpy(h + o_tok, tokens, (size_t)k * 4);
    for (int64_t i = 0; i < k; i++) {
        slots[i] = p0 - ts + i;
        pos[i] = (int32_t)(p0 + i);
        rpos[i] = (int32_t)(p0 + i + pos_offset);
    }
    for (int64_t r = 0; r < n_logits; r++) rows[r] = (int32_t)(k - n_logits + r);
    TRY(m->be->ops->copy_h2d(m->be, m->stream, dv, h, o_lr + (size_t)T * 4));
    const uint8_t *dm = dv;
    *d = (batch_dev){.slots = (const int64_t *)dm, .tokens = (const int32_t *)(dm + o_tok),
                     .pos = (const int32_t *)(dm + o_pos), .rope_pos = (const int32_t *)(dm + o_rpos),
                     .logit_rows = (const int32_t *)(dm + o_lr), .ks = ks};
    return STRATA_OK;
}

/* Keys of a pass's CPU part (params.cpu_attn): that share of the keys before it (kv_stream rounds it down to
 * a multiple of 256 and keeps it to the host segments). */
static int64_t cpu_keys(const st_llama *m, const st_kv_stream *ks) {
    return (int64_t)(m->cpu_attn * (double)st_kv_stream_len(ks));
}

strata_status st_llama_forward_stream(st_llama *m, st_kv_stream *ks, const int32_t *tokens, int64_t n,
                                      int64_t pos_offset, bool all_logits, float *logits) {
    if (!m || !ks || !tokens || n < 1 || !logits)
        return st_err(STRATA_ERR_INVALID_ARG, "forward_stream: no model, stream, tokens or logits, or n = %lld",
                      (long long)n);
    const st_kv_stream_params *p = st_kv_stream_get_params(ks);
    const st_config *c = &m->cfg;
    if (p->n_layers != c->n_layers || p->n_kv_heads != c->n_kv_heads || p->head_dim != c->head_dim ||
        p->piece != m->piece || p->max_tokens != m->max_tokens)
        return st_err(STRATA_ERR_INVALID_ARG, "forward_stream: the KV stream was not made for this model (use "
                      "st_llama_stream_params)");
    const int64_t len = st_kv_stream_len(ks), cap = p->max_len < m->max_seq_len ? p->max_len : m->max_seq_len;
    if (len + n > cap)
        return st_err(STRATA_ERR_INVALID_ARG, "forward_stream: %lld tokens after %lld exceed the context of %lld "
                      "tokens (--ctx)", (long long)n, (long long)len, (long long)cap);
    if (pos_offset < 0 || pos_offset > (int64_t)INT32_MAX - (len + n - 1))
        return st_err(STRATA_ERR_INVALID_ARG, "forward_stream: pos_offset = %lld puts RoPE positions past 2^31 - 1",
                      (long long)pos_offset);
    const int64_t T = m->max_tokens, V = c->vocab_size;
    st_backend *be = m->be;
    TRY(st_llama_plan_cpu_attn(m, p->dtype)); /* params.cpu_attn < 0: once */
    for (int64_t done = 0; done < n;) {
        const int64_t k = n - done < T ? n - done : T, p0 = st_kv_stream_len(ks);
        const bool last = done + k == n;
        const int64_t n_logits = all_logits ? k : last ? 1 : 0;
        batch_dev d;
        strata_status st = st_wm_begin(m->wm);
        if (st == STRATA_OK) st = st_kv_stream_begin(ks, m->stream, k, k <= m->cpu_attn_tokens ? cpu_keys(m, ks) : 0);
        if (st != STRATA_OK) return st;
        st = stream_upload(m, ks, tokens + done, k, p0, pos_offset, n_logits, &d);
        if (st == STRATA_OK) st = st_llama_batch_ops(m, NULL, &d, tokens + done, k, n_logits, false);
        if (st == STRATA_OK && n_logits > 0)
            st = be->ops->copy_d2h(be, m->stream, all_logits ? logits + done * V : logits, m->logits,
                                   (size_t)(n_logits * V) * sizeof(float));
        const strata_status s2 = be->ops->stream_sync(be, m->stream); /* the pass's one host sync */
        if (st == STRATA_OK) st = s2;
        if (st != STRATA_OK) {
            st_kv_stream_abort(ks);
            return st;
        }
        TRY(st_kv_stream_commit(ks));
        done += k;
    }
    return STRATA_OK;
}

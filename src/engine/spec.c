/* engine/spec: see spec.h. */
#include "engine/spec.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kv/kv_pool.h"
#include "model/llama.h"
#include "planner/planner.h"

#define DEF_K_MAX 7
#define MAX_K 32
#define DEF_NGRAM_MIN 1
#define DEF_NGRAM_MAX 3
#define DEF_STEP_COST 0.1
#define DRAFT_BLOCK 16
#define DRAFT_KV_CAP ((size_t)1 << 30)
#define DRAFT_PASS_TOKENS 256
#define ACC_DECAY 0.9 /* the acceptance counts' decay per verification */
#define COST_EMA 0.3  /* weight of the newest measurement in the step-cost averages */
#define PHASES 16     /* of every 16 steps: the first runs no drafts (the plain step's time), the ninth
                         drafts for every sequence (acceptance and cost measured again) */

const char *st_spec_mode_name(st_spec_mode m) {
    return m == ST_SPEC_LOOKUP ? "lookup" : m == ST_SPEC_DRAFT ? "draft" : "off";
}

strata_status st_spec_params_resolve(st_spec_params *p) {
    if (p->mode != ST_SPEC_OFF && p->mode != ST_SPEC_LOOKUP && p->mode != ST_SPEC_DRAFT)
        return st_err(STRATA_ERR_INVALID_ARG, "speculative decoding: mode %d", (int)p->mode);
    if (p->k_max == 0) p->k_max = DEF_K_MAX;
    if (p->k_max < 1 || p->k_max > MAX_K)
        return st_err(STRATA_ERR_INVALID_ARG, "--spec-k %d: the drafts per step are 1 to %d", p->k_max, MAX_K);
    if (p->ngram_min == 0) p->ngram_min = DEF_NGRAM_MIN;
    if (p->ngram_max == 0) p->ngram_max = p->ngram_min > DEF_NGRAM_MAX ? p->ngram_min : DEF_NGRAM_MAX;
    if (p->ngram_min < 1 || p->ngram_max < p->ngram_min || p->ngram_max > 64)
        return st_err(STRATA_ERR_INVALID_ARG, "speculative decoding: n-gram lengths %d..%d (1 <= min <= max <= 64)",
                      p->ngram_min, p->ngram_max);
    if (!(p->step_cost >= 0 && p->step_cost <= 10))
        return st_err(STRATA_ERR_INVALID_ARG, "--spec-cost %g: 0 (measured) to 10", p->step_cost);
    if (p->mode == ST_SPEC_DRAFT && !p->draft)
        return st_err(STRATA_ERR_INVALID_ARG, "speculative decoding with a draft model needs the model (--draft)");
    if (p->mode != ST_SPEC_DRAFT && p->draft)
        return st_err(STRATA_ERR_INVALID_ARG, "a draft model (--draft) is given but the drafts come from %s",
                      st_spec_mode_name(p->mode));
    return STRATA_OK;
}

/* ---- prompt lookup -------------------------------------------------------------------------*/

int64_t st_spec_lookup(const int32_t *tokens, int64_t n, int ngram_min, int ngram_max, int64_t k, int32_t *out) {
    if (k < 1) return 0;
    for (int64_t g = ngram_max; g >= ngram_min; g--) {
        if (g >= n) continue;
        const int32_t *suf = tokens + n - g;
        /* the latest earlier occurrence: starts i in [0, n - g - 1] */
        for (int64_t i = n - g - 1; i >= 0; i--) {
            if (tokens[i] != suf[0] || memcmp(tokens + i, suf, (size_t)g * sizeof *tokens) != 0) continue;
            int64_t m = n - (i + g); /* tokens that followed it */
            if (m > k) m = k;
            memcpy(out, tokens + i + g, (size_t)m * sizeof *out);
            return m;
        }
    }
    return 0;
}

int st_spec_best_k(double a, int k_max, double step_cost) {
    if (!(a > 0)) return 0;
    if (a >= 1) return 1 + step_cost * k_max < k_max + 1 ? k_max : 0;
    int best = 0;
    double best_v = 1; /* no drafts: one token per unit of cost */
    for (int k = 1; k <= k_max; k++) {
        const double v = (1 - pow(a, k + 1)) / (1 - a) / (1 + step_cost * k);
        if (v > best_v + 1e-12) {
            best_v = v;
            best = k;
        }
    }
    return best;
}

/* ---- the drafter ---------------------------------------------------------------------------*/

struct st_drafter {
    st_spec_params p;
    st_backend *be;
    int64_t vocab, max_batch, max_model_len;
    /* the cost model, measured: a decode step's forward time without drafts (t0) and the extra
     * time of one draft relative to it (c); the default step_cost until measured */
    uint64_t proposals;
    double t0, c;
    bool have_t0, have_c;
    /* ST_SPEC_DRAFT */
    st_llama *dm;
    st_kv_pool *dkv;
    int64_t n_slots, slot_blocks;  /* slot s: blocks [s * slot_blocks, (s + 1) * slot_blocks) */
    uint64_t *slot_owner;          /* [n_slots] seq id + 1 (0: free) */
    int64_t pass_tokens;
    int32_t *tokens, *pos, *seq, *rows, *tables, *ctx; /* one draft pass's batch */
    int64_t *slots;
    float *logits;                 /* [max_batch, vocab] */
    st_seq **act;                  /* [max_batch] sequences drafting this step */
    int64_t *act_max;              /* [max_batch] their draft limit */
    int64_t *who, *row_of;         /* [max_batch] a pass's sequence j: act[who[j]], its logit row */
};

void st_drafter_free(st_drafter *d) {
    if (!d) return;
    if (d->dm && d->dkv) st_llama_forget_pool(d->dm, d->dkv);
    st_kv_pool_free(d->dkv);
    st_llama_free(d->dm);
    st_free(d->slot_owner);
    st_free(d->tokens);
    st_free(d->pos);
    st_free(d->seq);
    st_free(d->rows);
    st_free(d->tables);
    st_free(d->ctx);
    st_free(d->slots);
    st_free(d->logits);
    st_free(d->act);
    st_free(d->act_max);
    st_free(d->who);
    st_free(d->row_of);
    st_free(d);
}

/* The draft KV pool's shape: slots of a whole max_model_len sequence each, at most max_batch,
 * within 1 GiB. */
static void draft_shape(const st_spec_params *p, int64_t max_batch, int64_t max_model_len, st_kv_dtype kv_dtype,
                        int64_t *slot_blocks, int64_t *n_slots, int64_t *pass_tokens) {
    const st_config *c = &p->draft->config;
    *slot_blocks = (max_model_len + DRAFT_BLOCK - 1) / DRAFT_BLOCK;
    const size_t tok_bytes = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, kv_dtype);
    const size_t seq_bytes = tok_bytes * (size_t)(*slot_blocks * DRAFT_BLOCK);
    const double want = (double)seq_bytes * (double)max_batch;
    const size_t mem = want < (double)DRAFT_KV_CAP ? (size_t)want : DRAFT_KV_CAP;
    *n_slots = (int64_t)(mem / seq_bytes);
    if (*n_slots > max_batch) *n_slots = max_batch;
    if (*n_slots < 1) *n_slots = 1;
    *pass_tokens = DRAFT_PASS_TOKENS > max_batch ? DRAFT_PASS_TOKENS : max_batch;
}

size_t st_drafter_device_bytes(const st_spec_params *p, const st_backend *be, int64_t max_batch,
                               int64_t max_model_len, st_kv_dtype kv_dtype) {
    if (p->mode != ST_SPEC_DRAFT || !p->draft) return 0;
    int64_t sb, ns, pt;
    draft_shape(p, max_batch, max_model_len, kv_dtype, &sb, &ns, &pt);
    const st_config *c = &p->draft->config;
    size_t w = 0;
    for (int64_t i = 0; i < p->draft->n_tensors; i++) w += (size_t)p->draft->tensors[i].nbytes;
    const st_kv_pool_params kp = st_llama_kv_params_for(c, pt, sb * DRAFT_BLOCK, ns * sb, DRAFT_BLOCK, kv_dtype);
    return w + st_kv_pool_device_bytes(&kp) + st_plan_act_bytes(be, c, pt, sb * DRAFT_BLOCK, 0);
}

strata_status st_drafter_init(const st_spec_params *p, st_backend *be, int64_t vocab, int64_t max_batch,
                              int64_t max_model_len, st_kv_dtype kv_dtype, st_drafter **out) {
    *out = NULL;
    st_drafter *d = st_calloc(1, sizeof *d);
    if (!d) return st_err(STRATA_ERR_NOMEM, "speculative decoding: out of memory for the drafter");
    d->p = *p;
    d->be = be;
    d->vocab = vocab;
    d->max_batch = max_batch;
    d->max_model_len = max_model_len;
    d->act = st_calloc((size_t)max_batch, sizeof *d->act);
    d->act_max = st_calloc((size_t)max_batch, sizeof *d->act_max);
    d->who = st_calloc((size_t)max_batch, sizeof *d->who);
    d->row_of = st_calloc((size_t)max_batch, sizeof *d->row_of);
    if (!d->act || !d->act_max || !d->who || !d->row_of) {
        st_drafter_free(d);
        return st_err(STRATA_ERR_NOMEM, "speculative decoding: out of memory for the drafter");
    }
    if (p->mode != ST_SPEC_DRAFT) {
        *out = d;
        return STRATA_OK;
    }
    const st_config *c = &p->draft->config;
    strata_status st;
    if (c->vocab_size != vocab) {
        st = st_err(STRATA_ERR_INVALID_ARG, "the draft model %s has a vocabulary of %lld tokens, the model %lld: "
                    "drafts must come from the same tokenizer", p->draft->path ? p->draft->path : "?",
                    (long long)c->vocab_size, (long long)vocab);
        st_drafter_free(d);
        return st;
    }
    draft_shape(p, max_batch, max_model_len, kv_dtype, &d->slot_blocks, &d->n_slots, &d->pass_tokens);
    const st_llama_params lp = {.max_seq_len = d->slot_blocks * DRAFT_BLOCK, .max_tokens = d->pass_tokens};
    if ((st = st_llama_init(p->draft, be, &lp, &d->dm))) goto fail;
    const st_kv_pool_params kp = st_llama_kv_params_for(c, d->pass_tokens, d->slot_blocks * DRAFT_BLOCK,
                                                        d->n_slots * d->slot_blocks, DRAFT_BLOCK, kv_dtype);
    if ((st = st_kv_pool_init(be, &kp, &d->dkv))) goto fail;
    const size_t T = (size_t)d->pass_tokens, B = (size_t)max_batch;
    d->slot_owner = st_calloc((size_t)d->n_slots, sizeof *d->slot_owner);
    d->tokens = st_malloc(T * sizeof *d->tokens);
    d->pos = st_malloc(T * sizeof *d->pos);
    d->seq = st_malloc(T * sizeof *d->seq);
    d->slots = st_malloc(T * sizeof *d->slots);
    d->rows = st_malloc(B * sizeof *d->rows);
    d->ctx = st_malloc(B * sizeof *d->ctx);
    d->tables = st_malloc(B * (size_t)d->slot_blocks * sizeof *d->tables);
    d->logits = st_malloc(B * (size_t)vocab * sizeof *d->logits);
    if (!d->slot_owner || !d->tokens || !d->pos || !d->seq || !d->slots || !d->rows || !d->ctx || !d->tables ||
        !d->logits) {
        st = st_err(STRATA_ERR_NOMEM, "speculative decoding: out of memory for the draft model's batch (%lld tokens)",
                    (long long)d->pass_tokens);
        goto fail;
    }
    *out = d;
    return STRATA_OK;
fail:;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    st_drafter_free(d);
    return st_err(st, "draft model: %s", msg);
}


static double step_cost(const st_drafter *d) {
    return d->p.step_cost > 0 ? d->p.step_cost : d->have_c ? d->c : DEF_STEP_COST;
}


static int seq_k(const st_drafter *d, const st_seq *q, bool explore) {
    if (q->spec.judged <= 0) return d->p.k_max > 4 ? 4 : d->p.k_max; /* no evidence yet */
    const int k = st_spec_best_k(q->spec.accepted / q->spec.judged, d->p.k_max, step_cost(d));
    return k > 0 ? k : explore ? 1 : 0;
}

void st_drafter_step_time(st_drafter *d, int64_t drafts, double forward_s) {
    if (!(forward_s > 0) || d->p.step_cost > 0) return; /* a fixed cost: nothing to measure */
    if (drafts == 0) {
        d->t0 = d->have_t0 ? (1 - COST_EMA) * d->t0 + COST_EMA * forward_s : forward_s;
        d->have_t0 = true;
        return;
    }
    if (!d->have_t0) return;
    double c = (forward_s / d->t0 - 1) / (double)drafts;
    c = c < 0.001 ? 0.001 : c > 10 ? 10 : c;
    d->c = d->have_c ? (1 - COST_EMA) * d->c + COST_EMA * c : c;
    d->have_c = true;
}

/* A draft-model slot for q: its own, a free one, or none (-1: it does not speculate this step). */
static int64_t slot_of(st_drafter *d, st_seq *q) {
    if (q->spec.slot >= 0 && q->spec.slot < d->n_slots && d->slot_owner[q->spec.slot] == q->id + 1)
        return q->spec.slot;
    for (int64_t s = 0; s < d->n_slots; s++)
        if (!d->slot_owner[s]) {
            d->slot_owner[s] = q->id + 1;
            q->spec.slot = (int32_t)s;
            q->spec.draft_done = 0;
            return s;
        }
    return -1;
}

static int32_t argmax(const float *row, int64_t V) {
    int32_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (row[v] > row[best]) best = (int32_t)v;
    return best;
}

/* One draft-model pass over the batch in d's arrays: n tokens of n_seqs sequences (batch
 * sequence j is act[who[j]]), the logits of rows[0..n_rows). */
static strata_status draft_pass(st_drafter *d, int64_t n, int64_t n_seqs, int64_t n_rows) {
    for (int64_t j = 0; j < n_seqs; j++) {
        const int64_t s = d->act[d->who[j]]->spec.slot;
        for (int64_t b = 0; b < d->slot_blocks; b++)
            d->tables[j * d->slot_blocks + b] = (int32_t)(s * d->slot_blocks + b);
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t s = d->act[d->who[d->seq[t]]]->spec.slot;
        d->slots[t] = (s * d->slot_blocks + d->pos[t] / DRAFT_BLOCK) * DRAFT_BLOCK + d->pos[t] % DRAFT_BLOCK;
    }
    const st_batch b = {.n_tokens = n, .tokens = d->tokens, .pos = d->pos, .seq = d->seq, .slots = d->slots,
                        .n_seqs = n_seqs, .block_tables = d->tables, .max_blocks = d->slot_blocks,
                        .ctx_lens = d->ctx, .logit_rows = d->rows, .n_logits = n_rows};
    return st_llama_forward(d->dm, d->dkv, &b, n_rows ? d->logits : NULL);
}

/* Draft-model drafts for act[0..n): catch up on each one's unseen tokens (in passes of at most
 * pass_tokens), whose last logits give draft 1, then greedy single-token passes until each has
 * its act_max drafts. Draft j sits at position n_tokens - 1 + j. */
static strata_status draft_model(st_drafter *d, int64_t n) {
    const int64_t V = d->vocab;
    strata_status st;
    for (;;) { /* 1. catch-up */
        int64_t nt = 0, ns = 0, nr = 0;
        for (int64_t i = 0; i < n && nt < d->pass_tokens; i++) {
            st_seq *q = d->act[i];
            if (q->n_draft > 0 || q->spec.draft_done >= q->n_tokens) continue;
            int64_t take = q->n_tokens - q->spec.draft_done;
            if (take > d->pass_tokens - nt) take = d->pass_tokens - nt;
            for (int64_t t = 0; t < take; t++) {
                d->tokens[nt + t] = q->tokens[q->spec.draft_done + t];
                d->pos[nt + t] = (int32_t)(q->spec.draft_done + t);
                d->seq[nt + t] = (int32_t)ns;
            }
            nt += take;
            q->spec.draft_done += take;
            d->ctx[ns] = (int32_t)q->spec.draft_done;
            d->who[ns] = i;
            d->row_of[ns] = -1;
            if (q->spec.draft_done == q->n_tokens) {
                d->row_of[ns] = nr;
                d->rows[nr++] = (int32_t)(nt - 1);
            }
            ns++;
        }
        if (nt == 0) break;
        if ((st = draft_pass(d, nt, ns, nr))) return st;
        for (int64_t j = 0; j < ns; j++)
            if (d->row_of[j] >= 0) {
                st_seq *q = d->act[d->who[j]];
                q->tokens[q->n_tokens] = argmax(d->logits + d->row_of[j] * V, V);
                q->n_draft = 1;
            }
    }
    for (;;) { /* 2. one more draft per pass */
        int64_t ns = 0;
        for (int64_t i = 0; i < n; i++) {
            st_seq *q = d->act[i];
            if (q->n_draft < 1 || q->n_draft >= d->act_max[i]) continue;
            const int64_t p = q->n_tokens - 1 + q->n_draft; /* the newest draft's position */
            d->tokens[ns] = q->tokens[p];
            d->pos[ns] = (int32_t)p;
            d->seq[ns] = (int32_t)ns;
            d->ctx[ns] = (int32_t)(p + 1);
            d->rows[ns] = (int32_t)ns;
            d->who[ns] = i;
            q->spec.draft_done = p + 1;
            ns++;
        }
        if (ns == 0) break;
        if ((st = draft_pass(d, ns, ns, ns))) return st;
        for (int64_t j = 0; j < ns; j++) {
            st_seq *q = d->act[d->who[j]];
            q->tokens[q->n_tokens + q->n_draft] = argmax(d->logits + j * V, V);
            q->n_draft++;
        }
    }
    return STRATA_OK;
}

strata_status st_drafter_propose(st_drafter *d, st_seq *const *seqs, const int64_t *max_drafts, int64_t n) {
    int64_t na = 0;
    strata_status st = STRATA_OK;
    const uint64_t phase = d->p.step_cost > 0 ? 1 : d->proposals++ % PHASES; /* fixed cost: no plain steps */
    for (int64_t i = 0; i < n; i++) {
        st_seq *q = seqs[i];
        q->n_draft = 0;
        if (phase == 0) continue; /* a plain step: its time is the cost model's unit */
        int64_t k = seq_k(d, q, phase == PHASES / 2);
        if (k > max_drafts[i]) k = max_drafts[i];
        if (k < 1) continue;
        if ((st = st_seq_reserve(q, q->n_tokens + k + 1))) goto out;
        if (d->p.mode == ST_SPEC_LOOKUP) {
            q->n_draft = st_spec_lookup(q->tokens, q->n_tokens, d->p.ngram_min, d->p.ngram_max, k,
                                        q->tokens + q->n_tokens);
        } else if (d->p.mode == ST_SPEC_DRAFT && slot_of(d, q) >= 0) {
            /* its last token is run again (its logits give draft 1); KV past it is stale */
            if (q->spec.draft_done > q->n_tokens - 1) q->spec.draft_done = q->n_tokens - 1;
            ST_ASSERT(na < d->max_batch);
            d->act[na] = q;
            d->act_max[na++] = k;
        }
    }
    if (na > 0 && (st = draft_model(d, na)))
        for (int64_t i = 0; i < n; i++) { /* the draft KV of a failed pass is unknown: start over */
            seqs[i]->n_draft = 0;
            seqs[i]->spec.draft_done = 0;
        }
out:
    return st;
}

void st_drafter_verified(st_drafter *d, st_seq *q, int64_t accepted) {
    const int64_t k = q->n_draft;
    ST_ASSERT(accepted >= 0 && accepted <= k);
    if (k == 0) return;
    /* accepted drafts are successes; the first rejected one a failure; those after it were not judged */
    q->spec.accepted = q->spec.accepted * ACC_DECAY + (double)accepted;
    q->spec.judged = q->spec.judged * ACC_DECAY + (double)(accepted + (accepted < k ? 1 : 0));
    if (d->p.mode == ST_SPEC_DRAFT) {
        /* the draft KV holds the tokens up to the last one and drafts 1..k-1 after it; drafts past the
         * accepted ones are wrong (n_tokens here is before the update appends) */
        const int64_t valid = q->n_tokens + accepted;
        if (q->spec.draft_done > valid) q->spec.draft_done = valid;
    }
    q->n_draft = 0;
}

void st_drafter_forget(st_drafter *d, st_seq *q) {
    q->n_draft = 0;
    if (d->p.mode == ST_SPEC_DRAFT && q->spec.slot >= 0 && q->spec.slot < d->n_slots &&
        d->slot_owner[q->spec.slot] == q->id + 1)
        d->slot_owner[q->spec.slot] = 0;
    q->spec.slot = -1;
    q->spec.draft_done = 0;
}

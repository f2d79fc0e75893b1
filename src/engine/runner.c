/* engine/runner: see runner.h.
 *
 * Sequences are engine/seq.h records lent by their creator: the scheduler's
 * items point at them (sampler, stop ids, text state). The batch arrays are
 * allocated once at init for the largest step (max_batch_tokens tokens,
 * max_batch sequences with tables of ceil(max_model_len / block_size)
 * blocks), so a step allocates nothing. */
#include "engine/runner.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define DEF_MAX_BATCH 32
#define DEF_MAX_MODEL_LEN 2048
#define DEF_PREFILL_CHUNK 256
#define DEF_UNALIGNED_STEP 512
#define DEF_MAX_WAITING 4096
#define DEF_BLOCK 16
#define DEF_KV_CAP ((size_t)1 << 30)

struct st_runner {
    st_engine_params p;
    int64_t batch_tokens;    /* tokens of one forward pass = the scheduler's step budget */
    st_backend *be;
    st_llama *model;
    st_kv_pool *kv;
    st_block_manager *bm;
    st_kv_tiers *tiers;      /* NULL: the device tier alone */
    st_scheduler *sched;
    int64_t model_vocab;
    int64_t table_w;         /* widest block-table row: ceil(max_model_len / block_size) */

    /* one step's batch (host) */
    int32_t *tokens, *pos, *seq, *logit_rows; /* [batch_tokens] */
    int32_t *tables;         /* [max_batch * table_w] */
    int32_t *ctx_lens;       /* [max_batch] */
    int32_t *next;           /* [max_batch + 1] sampled token per item, then the streamed one's (-1: none) */
    int64_t rows_cap;        /* logit rows of a pass: max_batch, or with drafts up to batch_tokens */
    int64_t *logit_item;     /* [rows_cap] item of each logit row */
    int64_t *item_row;       /* [max_batch] the item's first logit row (-1: none) */
    int64_t *accepted;       /* [max_batch] drafts accepted per item */
    float *logits;           /* [rows_cap, model vocab] */
    st_drafter *drafter;     /* speculative decoding (NULL: off) */
    st_seq **dec_seqs;       /* [max_batch] decoding sequences a step proposes drafts for */
    int64_t *dec_max;        /* [max_batch] their room for drafts */
    bool dev_sample;         /* CUDA: draw on the device the tokens of samplers without a penalty */
    st_sample_args *sargs;   /* [rows_cap] the sample op's args, one per logit row */
    int32_t *sids;           /* [rows_cap] the tokens it drew */
    st_runner_event *events; /* [max_batch + 1]: the items', then the streamed sequence's */
    st_kv_stream *ks;        /* the streamed sequence's KV (made at its first pass; NULL: none yet) */
    float *stream_logits;    /* [model vocab] */

    st_runner_stats stats;
    uint64_t identity;       /* st_runner_model_identity of the files and the pool */
    size_t x_layer_bytes;    /* one layer of one block */

    /* P-D export (made at the first pass that exports): this pass's exports, a copy stream,
     * per-layer events, and the export thread that hands each layer's pieces to on_kv once
     * their copies completed, while the next layers compute */
    struct xjob *xj;         /* [max_batch] */
    int64_t n_xj;
    st_stream *xs;
    st_event **xev_c, **xev; /* [n_layers]: compute reached layer l / its copies are done */
    pthread_t xthr;
    bool xthr_on, xstop;
    pthread_mutex_t xmu;
    pthread_cond_t xcv;
    int64_t xnext, xhanded;  /* layers queued / handed over this pass (xmu) */
    strata_status xst;       /* the first copy failure of this pass (xmu) */

    /* P-D decode node: the landing arena (runner.h st_runner_land_*) and the stream its
     * blocks go into the pool on */
    uint8_t *land;
    int64_t land_slots;
    size_t land_stride;
    uint8_t *land_used;      /* [land_slots] */
    st_stream *ls;
};

/* One sequence's export in a pass: layer l of prompt blocks [b0, b0 + nb) into bufs[l]. */
typedef struct xjob {
    st_seq *q;
    int64_t b0, nb, full;
    const int32_t *blocks;
    void **bufs;             /* [n_layers] */
} xjob;

/* ---- init / free -------------------------------------------------------------------*/

static void export_free(st_runner *r);

static int64_t tiers_lookup(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block) {
    return st_kv_tiers_lookup(user, tokens, n_tokens, from_block);
}
static int64_t tiers_prefetch(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block) {
    return st_kv_tiers_prefetch(user, tokens, n_tokens, from_block);
}
static int64_t tiers_load(void *user, const int32_t *tokens, int64_t n_tokens, int64_t from_block, int64_t n_blocks,
                          const int32_t *dev_blocks) {
    return st_kv_tiers_load(user, tokens, n_tokens, from_block, n_blocks, dev_blocks);
}

static void drafter_leave(void *user, st_seq *q) { st_drafter_forget(user, q); }

/* The model's identity for the SSD tier: the files' sizes, their leading bytes
 * up to the first tensor's data (the header and tensor table; at most 16 MiB
 * each), the tensor table as parsed, the config's shape, and the KV layout. */
uint64_t st_runner_model_identity(const st_model_files *f, const st_kv_pool_params *kp, char **text) {
    XXH3_state_t *x = XXH3_createState();
    if (!x) return 0;
    XXH3_64bits_reset(x);
    for (int i = 0; i < f->n_files; i++) {
        uint64_t first = f->files[i].size;
        for (int64_t k = 0; k < f->n_tensors; k++)
            if (f->tensors[k].file == i && f->tensors[k].offset < first) first = f->tensors[k].offset;
        if (first > ((uint64_t)16 << 20)) first = (uint64_t)16 << 20;
        XXH3_64bits_update(x, &f->files[i].size, sizeof f->files[i].size);
        if (f->files[i].data && first) XXH3_64bits_update(x, f->files[i].data, (size_t)first);
    }
    for (int64_t k = 0; k < f->n_tensors; k++) {
        const st_tensor_desc *d = &f->tensors[k];
        XXH3_64bits_update(x, d->name, strlen(d->name));
        const int64_t v[] = {d->dtype, d->n_dims, d->shape[0], d->n_dims > 1 ? d->shape[1] : 0, d->file,
                             (int64_t)d->offset, (int64_t)d->nbytes};
        XXH3_64bits_update(x, v, sizeof v);
    }
    const st_config *c = &f->config;
    const int64_t v[] = {c->vocab_size, c->hidden_size, c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim,
                         kp->dtype, kp->block_size, kp->n_layers, kp->n_kv_heads, kp->head_dim};
    XXH3_64bits_update(x, v, sizeof v);
    const uint64_t h = XXH3_64bits_digest(x);
    XXH3_freeState(x);
    if (text) {
        char buf[1024];
        snprintf(buf, sizeof buf, "model %s (%d files, %lld tensors); KV %s, block %lld tokens, %lld layers x %lld "
                 "kv heads x %lld; identity %016llx\n", f->path ? f->path : "?", f->n_files,
                 (long long)f->n_tensors, st_kv_dtype_name(kp->dtype), (long long)kp->block_size,
                 (long long)kp->n_layers, (long long)kp->n_kv_heads, (long long)kp->head_dim, (unsigned long long)h);
        *text = st_malloc(strlen(buf) + 1);
        if (*text) memcpy(*text, buf, strlen(buf) + 1);
    }
    return h;
}

strata_status st_engine_params_resolve(st_engine_params *p, const st_config *cfg) {
    if (p->max_batch < 0 || p->max_model_len < 0 || p->prefill_chunk < -1 || p->step_tokens < 0 ||
        p->max_waiting < 0 || p->kv_block_size < 0 || p->kv_blocks < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: negative parameter (max_batch %lld, max_model_len %lld, "
                      "prefill_chunk %lld, step_tokens %lld, max_waiting %lld, kv_block_size %lld, kv_blocks %lld)",
                      (long long)p->max_batch, (long long)p->max_model_len, (long long)p->prefill_chunk,
                      (long long)p->step_tokens, (long long)p->max_waiting, (long long)p->kv_block_size,
                      (long long)p->kv_blocks);
    if (p->max_batch == 0) p->max_batch = DEF_MAX_BATCH;
    if (p->max_batch > 4096)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: max_batch %lld > 4096", (long long)p->max_batch);
    if (p->max_model_len == 0) {
        p->max_model_len = DEF_MAX_MODEL_LEN;
        if (cfg->max_position_embeddings > 0 && cfg->max_position_embeddings < p->max_model_len)
            p->max_model_len = cfg->max_position_embeddings;
    }
    if (p->max_model_len < 2 || p->max_model_len > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: max_model_len %lld (2 to 2^31-1)",
                      (long long)p->max_model_len);
    if (p->prefill_chunk == 0) p->prefill_chunk = DEF_PREFILL_CHUNK;
    if (p->prefill_chunk > p->max_model_len) p->prefill_chunk = p->max_model_len;
    if (p->step_tokens == 0) p->step_tokens = p->prefill_chunk > 0 ? p->prefill_chunk + p->max_batch : DEF_UNALIGNED_STEP;
    if (p->prefill_chunk > 0 && p->step_tokens < p->prefill_chunk)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: step_tokens %lld < prefill_chunk %lld",
                      (long long)p->step_tokens, (long long)p->prefill_chunk);
    if (p->max_waiting == 0) p->max_waiting = DEF_MAX_WAITING;
    strata_status sst = st_spec_params_resolve(&p->spec);
    if (sst) return sst;
    if (p->kv_host_mem < ST_KV_HOST_OFF)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: kv_host_mem %lld", (long long)p->kv_host_mem);
    if (p->kv_host_mem == 0) {
        const int64_t avail = (int64_t)(st_mem_available() / 8);
        p->kv_host_mem = avail < ST_KV_HOST_DEFAULT_CAP ? avail : ST_KV_HOST_DEFAULT_CAP;
        if (p->kv_host_mem <= 0) p->kv_host_mem = ST_KV_HOST_OFF;
    } else if (p->kv_host_mem > 0) {
        const size_t avail = st_mem_available();
        if (avail > 0 && (size_t)p->kv_host_mem > avail)
            return st_err(STRATA_ERR_INVALID_ARG, "--kv-host-mem %.1f GiB is more than this machine can pin "
                          "(%.1f GiB available)", (double)p->kv_host_mem / 1073741824.0, (double)avail / 1073741824.0);
    }
    if (p->disable_prefix_cache) p->kv_host_mem = ST_KV_HOST_OFF; /* blocks are named by the prefix cache */
    if (p->kv_ssd_dir && !p->kv_ssd_dir[0]) p->kv_ssd_dir = NULL;
    if (p->kv_ssd_dir && p->kv_host_mem == ST_KV_HOST_OFF)
        return st_err(STRATA_ERR_INVALID_ARG, "--kv-ssd-dir %s needs the host tier (--kv-host-mem > 0) and the "
                      "prefix cache", p->kv_ssd_dir);
    if (p->kv_ssd_dir && p->kv_ssd_size == 0) p->kv_ssd_size = ST_KV_SSD_DEFAULT;
    if (p->kv_offload != ST_KV_OFFLOAD_EAGER && p->kv_offload != ST_KV_OFFLOAD_LAZY)
        return st_err(STRATA_ERR_INVALID_ARG, "engine params: kv_offload %d", (int)p->kv_offload);
    if (p->kv_block_size == 0) p->kv_block_size = DEF_BLOCK;
    const size_t tok_bytes =
        (size_t)st_kv_pool_bytes_per_token(cfg->n_layers, cfg->n_kv_heads, cfg->head_dim, p->kv_dtype);
    const int64_t seq_blocks = (p->max_model_len - 1 + p->kv_block_size - 1) / p->kv_block_size;
    if (p->kv_blocks == 0) {
        size_t mem = p->kv_mem;
        if (mem == 0) {
            const double want = (double)tok_bytes * (double)p->max_batch * (double)p->max_model_len;
            mem = want < (double)DEF_KV_CAP ? (size_t)want : DEF_KV_CAP;
        }
        p->kv_blocks = (int64_t)(mem / (tok_bytes * (size_t)p->kv_block_size));
        if (p->kv_blocks < seq_blocks && !p->kv_stream) {
            if (p->kv_mem > 0) /* asked for: say that it was raised */
                st_log(STRATA_LOG_WARN, "engine: kv_mem (--kv-mem) %zu bytes holds %lld blocks of %lld tokens, less "
                       "than one sequence of max_model_len %lld: raised to %lld blocks (%.2f MiB)",
                       p->kv_mem, (long long)p->kv_blocks, (long long)p->kv_block_size,
                       (long long)p->max_model_len, (long long)seq_blocks,
                       (double)seq_blocks * (double)p->kv_block_size * (double)tok_bytes / 1048576.0);
            p->kv_blocks = seq_blocks;
        }
        if (p->kv_blocks < 1) p->kv_blocks = 1;
    }
    return STRATA_OK;
}

strata_status st_runner_init(const st_model_files *files, st_backend *be, const st_engine_params *params,
                             st_runner **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "runner: out is NULL");
    *out = NULL;
    if (!files || !be) return st_err(STRATA_ERR_INVALID_ARG, "runner: no model files or backend");
    st_engine_params p = params ? *params : (st_engine_params){0};
    const st_config *cfg = &files->config;
    strata_status st = st_engine_params_resolve(&p, cfg);
    if (st) return st;
    /* the forward pass always has room for the oldest prefill's aligned chunk
     * beside every decode (output independent of the batch) */
    int64_t batch_tokens = p.step_tokens;
    if (batch_tokens < p.max_batch) batch_tokens = p.max_batch;
    if (p.prefill_chunk > 0 && batch_tokens < p.prefill_chunk + p.max_batch - 1)
        batch_tokens = p.prefill_chunk + p.max_batch - 1;

    st_runner *r = st_calloc(1, sizeof *r);
    if (!r) return st_err(STRATA_ERR_NOMEM, "runner: out of memory for its state (%zu bytes)", sizeof *r);
    r->p = p;
    r->be = be;
    r->batch_tokens = batch_tokens;
    r->model_vocab = cfg->vocab_size;
    r->table_w = (p.max_model_len + p.kv_block_size - 1) / p.kv_block_size;
    {
        /* the pool first sized, so that the planner keeps its room out of the weights' */
        const st_kv_pool_params kp = st_llama_kv_params_for(cfg, batch_tokens, p.max_model_len, p.kv_blocks,
                                                            p.kv_block_size, p.kv_dtype);
        st_kv_block_layout klo;
        st_kv_block_layout_get(&kp, &klo);
        const size_t slot_bytes = klo.layer_bytes * (size_t)kp.n_layers;
        r->land_slots = (int64_t)(p.kv_landing_mem / slot_bytes);
        if (p.kv_landing_mem && r->land_slots < 1) {
            st = st_err(STRATA_ERR_INVALID_ARG, "--pd-landing-mem %zu bytes holds no block (one block: %zu bytes)",
                        p.kv_landing_mem, slot_bytes);
            goto fail;
        }
        /* the draft model (speculative decoding) shares the device budget: kept out of the weights' room */
        st_llama_params lp = {.max_seq_len = p.max_model_len, .max_tokens = batch_tokens, .weights = p.weights,
                              .device_mem = p.device_mem,
                              .attn_piece = p.kv_segment > 0 && p.kv_segment < ST_PLAN_ATTN_PIECE ? p.kv_segment : 0,
                              .cpu_attn = p.kv_stream ? p.kv_cpu_attn : 0,
                              .kv_bytes = st_kv_pool_device_bytes(&kp) + (size_t)r->land_slots * slot_bytes +
                                          st_drafter_device_bytes(&p.spec, be, p.max_batch, p.max_model_len,
                                                                  p.kv_dtype)};
        if ((st = st_llama_measure(files, be, &lp))) goto fail; /* startup: bandwidths, scratch (budgeted) */
        if ((st = st_llama_init(files, be, &lp, &r->model))) goto fail;
        ST_ASSERT(st_llama_max_tokens(r->model) == batch_tokens);
        if ((st = st_kv_pool_init(be, &kp, &r->kv))) goto fail;
        if (r->land_slots > 0) {
            r->land_stride = (size_t)r->land_slots * klo.layer_bytes;
            r->land_used = st_calloc((size_t)r->land_slots, 1);
            if (!r->land_used) {
                st = st_err(STRATA_ERR_NOMEM,
                            "runner: out of memory for the use map of %lld landing slots (%lld bytes)",
                            (long long)r->land_slots, (long long)r->land_slots);
                goto fail;
            }
            void *mem = NULL;
            if ((st = be->ops->alloc(be, r->land_stride * (size_t)kp.n_layers, &mem))) {
                st = st_err_what(st, "the landing memory of transferred KV blocks (%lld slots, %zu bytes)",
                                 (long long)r->land_slots, r->land_stride * (size_t)kp.n_layers);
                goto fail;
            }
            r->land = mem;
        }
        const uint64_t seed = 0;
        r->identity = st_runner_model_identity(files, &kp, NULL);
        if (p.kv_host_mem > 0) {
            char *id_text = NULL;
            const st_kv_tiers_params tp = {.host_bytes = (size_t)p.kv_host_mem, .offload = p.kv_offload,
                                           .hash_seed = seed, .ssd_dir = p.kv_ssd_dir, .ssd_bytes = p.kv_ssd_size,
                                           .identity = st_runner_model_identity(files, &kp, &id_text),
                                           .identity_text = id_text,
                                           .ssd_fail_write_nth = p.kv_ssd_fail_write_nth};
            st = st_kv_tiers_init(r->kv, &tp, &r->tiers);
            st_free(id_text);
            if (st) goto fail;
        }
        const st_bm_params bp = {.num_blocks = p.kv_blocks, .block_size = p.kv_block_size,
                                 .disable_prefix_cache = p.disable_prefix_cache, .hash_seed = seed,
                                 .on_register = r->tiers ? st_kv_tiers_on_register : NULL,
                                 .on_evict = r->tiers ? st_kv_tiers_on_evict : NULL, .tier_user = r->tiers};
        if ((st = st_bm_init(&bp, &r->bm))) goto fail;
        if (p.spec.mode != ST_SPEC_OFF &&
            (st = st_drafter_init(&p.spec, be, cfg->vocab_size, p.max_batch, p.max_model_len, p.kv_dtype, &r->drafter)))
            goto fail;
        const st_scheduler_params sp = {.max_num_batched_tokens = batch_tokens, .max_batch = p.max_batch,
                                        .max_model_len = p.max_model_len,
                                        .prefill_chunk = p.prefill_chunk > 0 ? p.prefill_chunk : 0,
                                        .stream_tokens = p.kv_stream ? batch_tokens : 0,
                                        .stream_align = p.kv_segment > 0 ? p.kv_segment : ST_KV_STREAM_SEG,
                                        .lower = {.lookup = r->tiers ? tiers_lookup : NULL,
                                                  .prefetch = r->tiers ? tiers_prefetch : NULL,
                                                  .load = r->tiers ? tiers_load : NULL, .user = r->tiers},
                                        .on_leave = r->drafter ? drafter_leave : NULL, .leave_user = r->drafter};
        if ((st = st_scheduler_init(&sp, r->bm, &r->sched))) goto fail;
    }
    const size_t T = (size_t)batch_tokens, B = (size_t)p.max_batch;
    r->rows_cap = p.max_batch;
    if (r->drafter) { /* a decode with k drafts wants k + 1 rows */
        const int64_t want = p.max_batch * (1 + p.spec.k_max);
        r->rows_cap = want < batch_tokens ? want : batch_tokens;
    }
    const size_t R = (size_t)r->rows_cap;
    r->tokens = st_malloc(T * sizeof *r->tokens);
    r->pos = st_malloc(T * sizeof *r->pos);
    r->seq = st_malloc(T * sizeof *r->seq);
    r->logit_rows = st_malloc(T * sizeof *r->logit_rows);
    r->tables = st_malloc(B * (size_t)r->table_w * sizeof *r->tables);
    r->ctx_lens = st_malloc(B * sizeof *r->ctx_lens);
    r->next = st_malloc((B + 1) * sizeof *r->next);
    r->logit_item = st_malloc(R * sizeof *r->logit_item);
    r->item_row = st_malloc(B * sizeof *r->item_row);
    r->accepted = st_calloc(B, sizeof *r->accepted);
    r->dec_seqs = st_malloc(B * sizeof *r->dec_seqs);
    r->dec_max = st_malloc(B * sizeof *r->dec_max);
    r->logits = st_malloc(R * (size_t)r->model_vocab * sizeof *r->logits);
    r->events = st_calloc(B + 1, sizeof *r->events);
    r->stream_logits = p.kv_stream ? st_malloc((size_t)r->model_vocab * sizeof *r->stream_logits) : NULL;
    r->sargs = st_malloc(R * sizeof *r->sargs);
    r->sids = st_malloc(R * sizeof *r->sids);
    r->dev_sample = be->kind == ST_BACKEND_CUDA && !p.host_sample; /* and per row: the sampler's width */
    if (!r->tokens || !r->pos || !r->seq || !r->logit_rows || !r->tables || !r->ctx_lens || !r->next ||
        !r->logit_item || !r->logits || !r->events || !r->sargs || !r->sids || (p.kv_stream && !r->stream_logits) ||
        !r->item_row || !r->accepted || !r->dec_seqs || !r->dec_max) {
        st = st_err(STRATA_ERR_NOMEM, "runner: out of memory for the batch arrays");
        goto fail;
    }
    *out = r;
    return STRATA_OK;
fail:;
    char msg[768];
    snprintf(msg, sizeof msg, "%s", st_last_error());
    st_runner_free(r);
    return st_err(st, "runner: %s", msg);
}

void st_runner_free(st_runner *r) {
    if (!r) return;
    export_free(r);
    if (r->ls) {
        r->be->ops->stream_sync(r->be, r->ls); /* no landed copy still reads or writes */
        r->be->ops->stream_destroy(r->be, r->ls);
    }
    if (r->land) r->be->ops->dealloc(r->be, r->land);
    st_free(r->land_used);
    st_scheduler_free(r->sched);
    st_drafter_free(r->drafter);
    st_bm_free(r->bm);
    st_kv_tiers_free(r->tiers); /* writes what the SSD tier lacks, so a restart finds it */
    st_kv_stream_free(r->ks);
    st_free(r->stream_logits);
    if (r->model && r->kv) st_llama_forget_pool(r->model, r->kv);
    st_kv_pool_free(r->kv);
    st_llama_free(r->model);
    st_free(r->tokens);
    st_free(r->pos);
    st_free(r->seq);
    st_free(r->logit_rows);
    st_free(r->tables);
    st_free(r->ctx_lens);
    st_free(r->next);
    st_free(r->logit_item);
    st_free(r->item_row);
    st_free(r->accepted);
    st_free(r->dec_seqs);
    st_free(r->dec_max);
    st_free(r->logits);
    st_free(r->events);
    st_free(r->sargs);
    st_free(r->sids);
    st_free(r);
}

/* ---- requests ----------------------------------------------------------------------*/

st_seq_limits st_runner_limits(const st_runner *r, const st_tokenizer *tok) {
    return (st_seq_limits){.vocab = tok ? st_tokenizer_vocab_size(tok) : r->model_vocab,
                           .max_model_len = r->p.max_model_len, .tok = tok};
}

strata_status st_runner_add(st_runner *r, st_seq *q) {
    if (!r || !q) return st_err(STRATA_ERR_INVALID_ARG, "runner add: no runner or sequence");
    /* checked at admission (st_seq_create with st_runner_limits) */
    ST_ASSERT(q->sampler && st_sampler_vocab(q->sampler) <= r->model_vocab && q->n_prompt < r->p.max_model_len);
    return st_scheduler_add(r->sched, q);
}

strata_status st_runner_finish(st_runner *r, uint64_t id, st_finish_reason reason) {
    return st_scheduler_finish(r->sched, id, reason);
}

/* ---- one step ------------------------------------------------------------------------*/

/* Whether an item's rows are drawn on the device (device sampling on): its sampler has nothing
 * the sample op lacks (no penalty) and, with drafts, is greedy (the op's argmax judges them;
 * sampled drafts are verified on the host). */
static bool dev_row(const st_runner *r, const st_sched_item *it) {
    const st_sampler *sm = it->seq->sampler;
    return st_sampler_device_ok(sm) && st_sampler_vocab(sm) == r->model_vocab &&
           (it->n_draft == 0 || st_sampler_get_params(sm)->temperature == 0.0f);
}

static bool seq_stop_id(const st_seq *q, int32_t t) {
    for (int i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] == t) return true;
    return false;
}

/* The decision as one st_batch (arrays of r). */
static void build_batch(st_runner *r, const st_sched_decision *d, st_batch *b) {
    const int64_t bs = r->p.kv_block_size;
    int64_t width = 1, n_out = 0;
    for (int64_t i = 0; i < d->n_items; i++) {
        const int64_t need = (d->items[i].pos0 + d->items[i].n + bs - 1) / bs;
        if (need > width) width = need;
    }
    ST_ASSERT(width <= r->table_w);
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        const int64_t off = it->slot_offset, ctx = it->pos0 + it->n, nb = (ctx + bs - 1) / bs;
        ST_ASSERT(nb <= it->n_blocks && off + it->n <= d->n_tokens);
        for (int64_t k = 0; k < it->n; k++) {
            r->tokens[off + k] = it->tokens[k];
            r->pos[off + k] = (int32_t)(it->pos0 + k);
            r->seq[off + k] = (int32_t)i;
        }
        int32_t *row = r->tables + i * width;
        memcpy(row, it->block_table, (size_t)nb * sizeof *row);
        for (int64_t k = nb; k < width; k++) row[k] = 0; /* not read */
        r->ctx_lens[i] = (int32_t)ctx;
        r->item_row[i] = -1;
        if (it->need_logits) { /* a decode with drafts: every row (the drafts are verified) */
            r->item_row[i] = n_out;
            for (int64_t k = it->n - 1 - it->n_draft; k < it->n; k++) {
                r->logit_item[n_out] = i;
                r->logit_rows[n_out++] = (int32_t)(off + k);
            }
        }
    }
    ST_ASSERT(n_out <= r->rows_cap); /* drafts: at most k_max per decode (the drafter's bound) */
    *b = (st_batch){.n_tokens = d->n_tokens, .tokens = r->tokens, .pos = r->pos, .seq = r->seq,
                    .slots = d->slot_mapping, .n_seqs = d->n_items, .block_tables = r->tables,
                    .max_blocks = width, .ctx_lens = r->ctx_lens, .logit_rows = r->logit_rows,
                    .n_logits = n_out};
}

/* Ends sequence q with an error during a step (safe between schedule and
 * update: update skips its item), its event finished, no text. */
static void fail_seq(st_runner *r, st_seq *q, st_runner_event *e, const char *what) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s: %s", what, st_last_error());
    st_log(STRATA_LOG_WARN, "runner: sequence %llu: %s", (unsigned long long)q->id, msg);
    ST_ASSERT(st_scheduler_finish(r->sched, q->id, ST_FINISH_ERROR) == STRATA_OK);
    st_seq_set_finished(q, ST_FINISH_ERROR, msg);
    q->n_text = 0;
    e->finished = true;
}

/* The streamed sequence's pass of this step (d->stream): its tokens through
 * its host KV (st_llama_forward_stream; the stream is made at the first such
 * pass, reset when a new sequence starts), then its token sampled on the
 * host into r->next[d->n_items] and an event. A pass its host memory cannot
 * hold (NOMEM: the machine's, or the cap) ends that sequence with an error
 * naming what was exceeded; other errors are the step's. */
static strata_status stream_pass(st_runner *r, const st_sched_decision *d, int64_t *n_ev) {
    const st_sched_item *it = d->stream;
    st_seq *q = it->seq;
    r->next[d->n_items] = -1;
    strata_status st = STRATA_OK;
    if (!r->ks) {
        const size_t host = r->p.kv_stream_mem ? r->p.kv_stream_mem : st_kv_stream_default_host_mem();
        st_kv_stream_params sp = st_llama_stream_params(r->model, r->p.max_model_len, r->p.kv_dtype, host);
        sp.seg = r->p.kv_segment;
        sp.ssd_dir = r->p.kv_ssd_dir; /* past the host's share, the SSD tier's directory takes the rest */
        sp.ssd_mem = r->p.kv_ssd_size;
        if ((st = st_kv_stream_init(r->be, &sp, &r->ks))) return st;
    }
    if (it->pos0 == 0) st_kv_stream_reset(r->ks);
    ST_ASSERT(st_kv_stream_len(r->ks) == it->pos0);
    const double t0 = st_time_now();
    st = st_llama_forward_stream(r->model, r->ks, it->tokens, it->n, 0, false, r->stream_logits);
    r->stats.forward_s += st_time_now() - t0;
    st_runner_event *e = &r->events[(*n_ev)++];
    *e = (st_runner_event){.seq = q, .token = -1};
    if (st == STRATA_ERR_NOMEM) {
        char what[96];
        snprintf(what, sizeof what, "the context of %lld tokens does not fit", (long long)(it->pos0 + it->n));
        fail_seq(r, q, e, what);
        return STRATA_OK;
    }
    if (st) return st;
    if (!it->need_logits) {
        (*n_ev)--; /* no token: no event */
        return STRATA_OK;
    }
    if (r->p.on_logits) r->p.on_logits(r->p.hook_user, it->seq_id, it->pos0 + it->n - 1, r->stream_logits,
                                       r->model_vocab);
    int32_t t = -1;
    if (st_sampler_sample(q->sampler, r->stream_logits, q->tokens, q->n_tokens, &t) != STRATA_OK) {
        fail_seq(r, q, e, "the sampler rejected the logits");
        return STRATA_OK;
    }
    r->next[d->n_items] = t;
    e->token = t;
    e->n_tokens = 1;
    return STRATA_OK;
}

/* ---- P-D: every layer of the prompt blocks a pass completes leaves as soon as that layer is
 * stored (kv_pool's layer hook), copied on a stream of its own, handed to on_kv by the export
 * thread once the copy completed: the transfer of layer l overlaps layers l+1.. */

static void *export_main(void *arg) {
    st_runner *r = arg;
    const int64_t L = st_kv_pool_get_params(r->kv)->n_layers;
    pthread_mutex_lock(&r->xmu);
    for (;;) {
        while (!r->xstop && r->xhanded >= r->xnext) pthread_cond_wait(&r->xcv, &r->xmu);
        if (r->xstop) break;
        const int64_t l = r->xhanded;
        pthread_mutex_unlock(&r->xmu);
        strata_status st = r->be->ops->event_sync(r->be, r->xev[l]);
        for (int64_t j = 0; j < r->n_xj; j++) {
            xjob *x = &r->xj[j];
            const st_kv_piece pc = {.layer = l, .first_block = x->b0, .n_blocks = st ? 0 : x->nb,
                                    .data = x->bufs[l], .bytes = st ? 0 : (size_t)x->nb * r->x_layer_bytes};
            x->bufs[l] = NULL; /* the callee's now */
            x->q->cb.on_kv(x->q->cb.user, &pc);
        }
        pthread_mutex_lock(&r->xmu);
        if (st && !r->xst) r->xst = st;
        r->xhanded = l + 1;
        if (r->xhanded == L) pthread_cond_broadcast(&r->xcv);
    }
    pthread_mutex_unlock(&r->xmu);
    return NULL;
}

static strata_status export_layer(void *user, int64_t l, st_stream *compute) {
    st_runner *r = user;
    const st_backend_ops *o = r->be->ops;
    strata_status st = o->event_record(r->be, r->xev_c[l], compute);
    if (!st) st = o->stream_wait_event(r->be, r->xs, r->xev_c[l]);
    for (int64_t j = 0; j < r->n_xj && !st; j++)
        st = st_kv_pool_export_layer(r->kv, r->xs, l, r->xj[j].blocks, r->xj[j].nb, r->xj[j].bufs[l]);
    if (!st) st = o->event_record(r->be, r->xev[l], r->xs);
    if (st) return st;
    pthread_mutex_lock(&r->xmu);
    r->xnext = l + 1;
    pthread_cond_signal(&r->xcv);
    pthread_mutex_unlock(&r->xmu);
    return STRATA_OK;
}

/* The copy stream, the events and the thread, at the first export. */
static strata_status export_init(st_runner *r) {
    if (r->xthr_on) return STRATA_OK;
    const st_backend_ops *o = r->be->ops;
    const int64_t L = st_kv_pool_get_params(r->kv)->n_layers;
    strata_status st = STRATA_OK;
    if (!(r->xj = st_calloc((size_t)r->p.max_batch, sizeof *r->xj)) ||
        !(r->xev_c = st_calloc((size_t)L, sizeof *r->xev_c)) || !(r->xev = st_calloc((size_t)L, sizeof *r->xev)))
        return st_err(STRATA_ERR_NOMEM, "KV export: out of memory for the jobs of %lld sequences and the events "
                      "of %lld layers", (long long)r->p.max_batch, (long long)L);
    if ((st = o->stream_create(r->be, false, &r->xs))) return st;
    for (int64_t l = 0; l < L && !st; l++)
        if (!(st = o->event_create(r->be, &r->xev_c[l]))) st = o->event_create(r->be, &r->xev[l]);
    if (st) return st;
    st_kv_block_layout lo;
    st_kv_block_layout_get(st_kv_pool_get_params(r->kv), &lo);
    r->x_layer_bytes = lo.layer_bytes;
    pthread_mutex_init(&r->xmu, NULL);
    pthread_cond_init(&r->xcv, NULL);
    if (pthread_create(&r->xthr, NULL, export_main, r) != 0) {
        pthread_cond_destroy(&r->xcv);
        pthread_mutex_destroy(&r->xmu);
        return st_err(STRATA_ERR_INTERNAL, "KV export: cannot start its thread");
    }
    r->xthr_on = true;
    return STRATA_OK;
}

static void export_free(st_runner *r) {
    if (r->xthr_on) {
        pthread_mutex_lock(&r->xmu);
        r->xstop = true;
        pthread_cond_broadcast(&r->xcv);
        pthread_mutex_unlock(&r->xmu);
        pthread_join(r->xthr, NULL);
        pthread_cond_destroy(&r->xcv);
        pthread_mutex_destroy(&r->xmu);
    }
    const int64_t L = r->kv ? st_kv_pool_get_params(r->kv)->n_layers : 0;
    for (int64_t l = 0; l < L; l++) {
        if (r->xev_c && r->xev_c[l]) r->be->ops->event_destroy(r->be, r->xev_c[l]);
        if (r->xev && r->xev[l]) r->be->ops->event_destroy(r->be, r->xev[l]);
    }
    if (r->xs) r->be->ops->stream_destroy(r->be, r->xs);
    st_free(r->xev_c);
    st_free(r->xev);
    st_free(r->xj);
}

/* Before the pass: the exports of its items (the full prompt blocks it completes that went
 * nowhere yet), their buffers (kv_buffer), and the layer hook. A sequence whose buffers
 * cannot be had ends with an error (its event in r->events, counted in *n_ev). */
static strata_status export_begin(st_runner *r, const st_sched_decision *d, int64_t *n_ev) {
    r->n_xj = 0;
    const int64_t bs = r->p.kv_block_size;
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        st_seq *q = it->seq;
        if (q->export_from < 0) continue;
        const int64_t done = it->pos0 + it->n, full = (done < q->n_prompt ? done : q->n_prompt) / bs;
        if (full <= q->exported) continue;
        strata_status st = export_init(r);
        if (st) return st;
        const int64_t L = st_kv_pool_get_params(r->kv)->n_layers;
        xjob *x = &r->xj[r->n_xj];
        *x = (xjob){.q = q, .b0 = q->exported, .nb = full - q->exported, .full = full,
                    .blocks = it->block_table + q->exported, .bufs = st_calloc((size_t)L, sizeof(void *))};
        const size_t bytes = (size_t)x->nb * r->x_layer_bytes;
        bool ok = x->bufs != NULL;
        for (int64_t l = 0; l < L && ok; l++) ok = (x->bufs[l] = q->cb.kv_buffer(q->cb.user, bytes)) != NULL;
        if (!ok) {
            for (int64_t l = 0; l < L && x->bufs; l++) /* handed back, as failed pieces */
                if (x->bufs[l]) {
                    const st_kv_piece pc = {.layer = l, .first_block = x->b0, .data = x->bufs[l]};
                    q->cb.on_kv(q->cb.user, &pc);
                }
            st_free(x->bufs);
            st_err(STRATA_ERR_NOMEM, "no buffer for %zu bytes", bytes);
            st_runner_event *e = &r->events[(*n_ev)++];
            *e = (st_runner_event){.seq = q, .token = -1};
            fail_seq(r, q, e, "the KV export failed");
            continue;
        }
        r->n_xj++;
    }
    if (r->n_xj == 0) return STRATA_OK;
    pthread_mutex_lock(&r->xmu);
    r->xnext = r->xhanded = 0;
    r->xst = STRATA_OK;
    pthread_mutex_unlock(&r->xmu);
    st_kv_pool_set_layer_hook(r->kv, export_layer, r);
    return STRATA_OK;
}

/* After the pass (it ran: pass_st OK; or failed): waits until every layer enqueued was handed
 * over, hands over (as failed) what was not, clears the hook; the sequences whose export
 * failed end with an error; the others count their blocks as exported. */
static void export_end(st_runner *r, strata_status pass_st, int64_t *n_ev) {
    if (r->n_xj == 0) return;
    st_kv_pool_set_layer_hook(r->kv, NULL, NULL);
    const int64_t L = st_kv_pool_get_params(r->kv)->n_layers;
    pthread_mutex_lock(&r->xmu);
    while (r->xhanded < r->xnext) pthread_cond_wait(&r->xcv, &r->xmu);
    strata_status st = r->xst ? r->xst : pass_st;
    if (r->xnext < L && !st) st = st_err(STRATA_ERR_INTERNAL, "KV export: %lld of %lld layers", (long long)r->xnext,
                                          (long long)L);
    pthread_mutex_unlock(&r->xmu);
    for (int64_t j = 0; j < r->n_xj; j++) {
        xjob *x = &r->xj[j];
        for (int64_t l = 0; l < L; l++) /* layers the pass never reached */
            if (x->bufs[l]) {
                const st_kv_piece pc = {.layer = l, .first_block = x->b0, .data = x->bufs[l]};
                x->bufs[l] = NULL;
                x->q->cb.on_kv(x->q->cb.user, &pc);
            }
        st_free(x->bufs);
        x->bufs = NULL;
        if (st) {
            if (pass_st) continue; /* the step fails: every sequence ends with its error */
            st_runner_event *e = &r->events[(*n_ev)++];
            *e = (st_runner_event){.seq = x->q, .token = -1};
            st_err(st, "a copy failed");
            fail_seq(r, x->q, e, "the KV export failed");
        } else {
            x->q->exported = x->full;
        }
    }
    r->n_xj = 0;
}

strata_status st_runner_step(st_runner *r, st_runner_step_info *out) {
    if (!r || !out) return st_err(STRATA_ERR_INVALID_ARG, "runner step: no runner or out");
    memset(out, 0, sizeof *out);
    out->events = r->events;
    strata_status st;
    /* 0: drafts for the decoding sequences (a failed draft pass is logged: the step runs without) */
    if (r->drafter) {
        int64_t n = 0;
        for (int64_t i = 0; i < st_scheduler_num_running(r->sched); i++) {
            st_seq *q = (st_seq *)st_scheduler_running(r->sched, i); /* lent to the runner */
            if (st_seq_n_pending(q) != 1) continue;
            int64_t room = r->p.max_model_len - q->n_tokens - 1;
            if (q->max_tokens > 0 && q->max_tokens - st_seq_n_generated(q) - 1 < room)
                room = q->max_tokens - st_seq_n_generated(q) - 1;
            r->dec_seqs[n] = q;
            r->dec_max[n++] = room;
        }
        if (n > 0 && (st = st_drafter_propose(r->drafter, r->dec_seqs, r->dec_max, n)))
            st_log(STRATA_LOG_WARN, "speculative decoding: no drafts this step: %s", st_last_error());
    }
    const st_sched_decision *d = NULL;
    st = st_scheduler_schedule(r->sched, &d);
    if (st) return st;
    out->n_preempted = d->n_preempted;
    if (d->n_items == 0 && !d->stream) { /* copies the schedule queued still go (none when nothing ran) */
        if (!r->tiers) return STRATA_OK;
        if ((st = st_kv_tiers_before_forward(r->tiers, st_llama_stream(r->model))) ||
            (st = st_kv_tiers_after_step(r->tiers, st_llama_stream(r->model))))
            return st;
        /* nothing runnable while a waiting prompt's blocks come from the SSD tier: wait for them */
        if (st_kv_tiers_reading(r->tiers)) st_kv_tiers_wait_reads(r->tiers);
        return STRATA_OK;
    }
    out->n_tokens = d->n_tokens + (d->stream ? d->stream->n : 0);
    out->n_seqs = d->n_items + (d->stream != NULL);
    out->n_decodes = d->n_decodes + (d->stream && d->stream->is_decode);
    int64_t n_ev = 0;
    strata_status sst0 = STRATA_OK;
    if (d->n_items == 0) { /* the streamed sequence alone */
        if ((st = stream_pass(r, d, &n_ev))) return st;
        r->stats.steps++;
        goto update;
    }

    /* 2-3: the batch through the model */
    st_batch b;
    build_batch(r, d, &b);
    /* Device sampling (CUDA, no on_logits hook): rows whose sampler has no
     * penalty get their token from the backend's sample op (the u it draws
     * with comes from the sampler's own random state now), and the logits
     * cross to the host only when some other row needs them (a penalty, or
     * sampled drafts to verify; greedy drafts are judged against the op's argmax). */
    const bool dev = r->dev_sample && !r->p.on_logits && b.n_logits > 0;
    bool need_logits = !dev;
    if (dev)
        for (int64_t k = 0; k < b.n_logits; k++) {
            const st_sched_item *it = &d->items[r->logit_item[k]];
            if (dev_row(r, it)) {
                st_sampler_next_args(it->seq->sampler, &r->sargs[k]);
            } else { /* sampled on the host; the op's token for it is ignored */
                r->sargs[k] = (st_sample_args){.temperature = 0.0f, .top_p = 1.0f};
                need_logits = true;
            }
        }
    double t0 = st_time_now();
    if (r->tiers && (st = st_kv_tiers_before_forward(r->tiers, st_llama_stream(r->model)))) return st;
    if ((st = export_begin(r, d, &n_ev))) return st;
    if (dev) st = st_llama_forward_sample(r->model, r->kv, &b, r->sargs, r->sids, need_logits ? r->logits : NULL);
    else st = st_llama_forward(r->model, r->kv, &b, r->logits);
    export_end(r, st, &n_ev);
    if (st) return st;
    double t1 = st_time_now();
    r->stats.forward_s += t1 - t0;
    r->stats.steps++;
    if (r->drafter && d->n_decodes == d->n_items && !d->stream) { /* the drafts' cost model */
        int64_t drafts = 0;
        for (int64_t i = 0; i < d->n_items; i++) drafts += d->items[i].n_draft;
        st_drafter_step_time(r->drafter, drafts, t1 - t0);
    }

    /* 4: sample every item that needs logits, with its own sampler; a decode's drafts are verified
     * row by row (history: the sequence and the drafts accepted before the row) */
    const int64_t V = r->model_vocab;
    for (int64_t i = 0; i < d->n_items; i++) {
        r->next[i] = -1;
        r->accepted[i] = 0;
    }
    for (int64_t i = 0; i < d->n_items; i++) {
        const st_sched_item *it = &d->items[i];
        const int64_t k0 = r->item_row[i];
        if (k0 < 0) continue;
        st_seq *q = it->seq;
        st_runner_event *e = &r->events[n_ev++];
        *e = (st_runner_event){.seq = q, .token = -1};
        int32_t t = -1;
        int64_t acc = 0;
        strata_status sst = STRATA_OK;
        const bool on_dev = dev && dev_row(r, it);
        for (int64_t j = 0; j <= it->n_draft; j++) {
            const float *row = r->logits + (k0 + j) * V;
            if (r->p.on_logits) r->p.on_logits(r->p.hook_user, it->seq_id, it->pos0 + it->n - 1 - it->n_draft + j, row, V);
            if (on_dev) { /* the device's token (greedy with drafts: the argmax, judged below) */
                t = r->sids[k0 + j];
                sst = t >= 0 ? STRATA_OK
                             : st_err(STRATA_ERR_INVALID_ARG, "sampler: the logits hold a NaN or +inf, or only -inf "
                                                              "(sampled on the device)");
                if (sst || j == it->n_draft || t != q->tokens[q->n_tokens + j] || seq_stop_id(q, t)) break;
                acc++;
                continue;
            }
            if (j < it->n_draft) {
                const int32_t draft = q->tokens[q->n_tokens + j];
                bool ok = false;
                if ((sst = st_sampler_verify(q->sampler, row, q->tokens, q->n_tokens + j, draft, &ok, &t))) break;
                if (!ok || seq_stop_id(q, t)) break; /* a stop id ends the step's tokens as it ends decoding */
                acc++;
                continue;
            }
            sst = st_sampler_sample(q->sampler, row, q->tokens, q->n_tokens + j, &t);
        }
        if (sst != STRATA_OK) {
            fail_seq(r, q, e, "the sampler rejected the logits");
            continue;
        }
        if (r->drafter && it->n_draft > 0) st_drafter_verified(r->drafter, q, acc);
        r->next[i] = t;
        r->accepted[i] = acc;
        e->token = t;
        e->n_tokens = acc + 1;
    }
    r->stats.sample_s += st_time_now() - t1;
    /* the streamed sequence's pass, after the batch's (one at a time, beside it) */
    if (d->stream && (sst0 = stream_pass(r, d, &n_ev))) return sst0;

update:;
    /* 5: the scheduler appends, commits, finishes at max_tokens / max_model_len */
    st_seq *const *fin = NULL;
    int64_t n_fin = 0;
    if ((st = st_scheduler_update(r->sched, r->next, r->accepted, &fin, &n_fin))) return st;
    /* sequences it finished without sampling (a prefill-only prompt done) get their event */
    for (int64_t j = 0; j < n_fin; j++) {
        bool seen = false;
        for (int64_t k = 0; k < n_ev && !seen; k++) seen = r->events[k].seq == fin[j];
        if (!seen) r->events[n_ev++] = (st_runner_event){.seq = fin[j], .token = -1, .finished = true};
    }
    /* the blocks this step completed go down to the host tier (eager) */
    if (r->tiers && (st = st_kv_tiers_after_step(r->tiers, st_llama_stream(r->model)))) return st;
    /* (d and its items are stale from here) */
    /* 6: stop ids, stop strings and the new text, in one place, token by token */
    for (int64_t k = 0; k < n_ev; k++) {
        st_runner_event *e = &r->events[k];
        if (e->token < 0) continue;
        st_seq *q = e->seq;
        const bool was_live = q->status != ST_SEQ_FINISHED;
        q->n_text = 0;
        const int64_t first = q->n_tokens - e->n_tokens;
        bool stop = false;
        strata_status pst = STRATA_OK;
        for (int64_t m = 0; m < e->n_tokens && !stop && !pst; m++) {
            const int32_t tok = q->tokens[first + m];
            pst = st_seq_postprocess(q, tok, m == e->n_tokens - 1, &stop);
            if (stop && m < e->n_tokens - 1) { /* accepted drafts after a stop string never happened */
                q->n_tokens = first + m + 1;
                e->n_tokens = m + 1;
                e->token = tok;
                if (!was_live) q->fin.completion_tokens = st_seq_n_generated(q);
            }
        }
        if (pst != STRATA_OK) {
            char msg[256];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            if (was_live) ST_ASSERT(st_runner_finish(r, q->id, ST_FINISH_ERROR) == STRATA_OK);
            st_seq_set_finished(q, ST_FINISH_ERROR, msg);
            e->finished = true;
            continue;
        }
        if (stop && was_live) {
            ST_ASSERT(st_scheduler_finish(r->sched, q->id, ST_FINISH_STOP) == STRATA_OK);
        }
        e->finished = q->status == ST_SEQ_FINISHED;
    }
    out->n_events = n_ev;
    return STRATA_OK;
}

/* ---- queries -------------------------------------------------------------------------*/

bool st_runner_has_work(const st_runner *r) { return st_scheduler_has_work(r->sched); }
int64_t st_runner_num_running(const st_runner *r) { return st_scheduler_num_running(r->sched); }
int64_t st_runner_num_waiting(const st_runner *r) { return st_scheduler_num_waiting(r->sched); }
const st_seq *st_runner_get_seq(const st_runner *r, uint64_t id) { return st_scheduler_get_seq(r->sched, id); }
const st_engine_params *st_runner_get_params(const st_runner *r) { return &r->p; }
st_llama *st_runner_model(st_runner *r) { return r->model; }

void st_runner_get_stats(const st_runner *r, st_runner_stats *out) {
    *out = r->stats;
    st_scheduler_get_stats(r->sched, &out->sched);
    st_bm_get_stats(r->bm, &out->kv);
    out->tiers = r->tiers != NULL;
    if (r->tiers) st_kv_tiers_get_stats(r->tiers, &out->tier);
}

st_kv_tiers *st_runner_tiers(st_runner *r) { return r ? r->tiers : NULL; }

void st_runner_clear_device_cache(st_runner *r) {
    if (!r) return;
    st_bm_clear_cache(r->bm);
    st_kv_tiers_device_dropped(r->tiers);
}

int64_t st_runner_prefix_blocks(const st_runner *r, const int32_t *tokens, int64_t n_tokens) {
    return st_bm_lookup(r->bm, tokens, n_tokens, NULL) / r->p.kv_block_size;
}

void st_runner_kv_layout(const st_runner *r, int64_t *n_layers, size_t *layer_bytes) {
    const st_kv_pool_params *kp = st_kv_pool_get_params(r->kv);
    st_kv_block_layout lo;
    st_kv_block_layout_get(kp, &lo);
    *n_layers = kp->n_layers;
    *layer_bytes = lo.layer_bytes;
}

uint64_t st_runner_kv_identity(const st_runner *r) { return r->identity; }

/* ---- P-D: adopted blocks to the device ahead of the admission --------------------------------*/
struct st_runner_preload {
    st_block_table tbl;      /* the device prefix taken + the preloaded blocks, held until there */
    int32_t *tokens;
    int64_t n_tokens, n_done; /* n_done: positions that will be computed (cached + preloaded) */
    uint64_t ticket;         /* from the host tier: its copy batch */
    st_event *ev;            /* from the landing arena: recorded after the copies */
    int64_t slot0, n_slots;  /* from the landing arena: its slots, released once copied */
};

strata_status st_runner_kv_preload(st_runner *r, const int32_t *tokens, int64_t n_tokens, st_runner_preload **out) {
    *out = NULL;
    if (!r->tiers) return STRATA_OK;
    st_runner_preload *p = st_calloc(1, sizeof *p);
    if (!p || !(p->tokens = st_malloc((size_t)n_tokens * sizeof *tokens))) {
        st_free(p);
        return st_err(STRATA_ERR_NOMEM, "kv preload: out of memory for a copy of %lld prompt tokens (%zu bytes)",
                      (long long)n_tokens, (size_t)n_tokens * sizeof *tokens);
    }
    memcpy(p->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    p->n_tokens = n_tokens;
    st_block_table_init(&p->tbl);
    const int64_t bs = r->p.kv_block_size;
    int64_t cached = 0;
    strata_status st = st_bm_seq_start(r->bm, &p->tbl, tokens, n_tokens, &cached);
    const int64_t avail = st ? 0 : st_kv_tiers_lookup(r->tiers, tokens, n_tokens, cached / bs);
    if (!st && avail > 0 && st_bm_can_append(r->bm, &p->tbl, avail * bs) &&
        (st = st_bm_append_slots(r->bm, &p->tbl, avail * bs)) == STRATA_OK) {
        st = st_kv_tiers_preload(r->tiers, tokens, n_tokens, cached / bs, avail, p->tbl.blocks + cached / bs,
                                 &p->ticket);
        if (!st) {
            p->n_done = cached + avail * bs;
            *out = p;
            return STRATA_OK;
        }
    }
    if (st) st_kv_tiers_drain(r->tiers); /* copies of a failed batch may have been issued: done before the blocks go */
    st_runner_kv_preload_free(r, p); /* nothing to bring, no room, or a copy error: the admission loads */
    return st;
}

bool st_runner_kv_preload_poll(st_runner *r, st_runner_preload *p) {
    if (p->ev) {
        bool done = false;
        if (r->be->ops->event_query(r->be, p->ev, &done) != STRATA_OK) {
            /* a failed copy: the blocks go back unregistered, the admission computes them */
            st_log(STRATA_LOG_WARN, "kv preload: landed blocks: %s", st_last_error());
            st_runner_kv_preload_free(r, p);
            return true;
        }
        if (!done) return false;
    } else if (!st_kv_tiers_copied(r->tiers, p->ticket)) {
        return false;
    }
    /* there: registered (the chain's hashes) and released, cached for the admission */
    ST_ASSERT(st_bm_commit(r->bm, &p->tbl, p->tokens, p->n_done) == STRATA_OK);
    st_runner_kv_preload_free(r, p);
    return true;
}

void st_runner_kv_preload_free(st_runner *r, st_runner_preload *p) {
    if (!p) return;
    if (p->ev) { /* copies of landed blocks: over before their blocks and slots go */
        r->be->ops->event_sync(r->be, p->ev);
        r->be->ops->event_destroy(r->be, p->ev);
    }
    if (p->n_slots) st_runner_land_release(r, p->slot0, p->n_slots);
    st_bm_seq_free(r->bm, &p->tbl); /* not committed: the preloaded blocks go back FREE */
    st_block_table_free(&p->tbl);
    st_free(p->tokens);
    st_free(p);
}

/* ---- P-D: the landing arena --------------------------------------------------------------*/
strata_status st_runner_land_reserve(st_runner *r, int64_t n, int64_t *slot0) {
    *slot0 = -1;
    if (!r->land || n < 1) return st_err(STRATA_ERR_INVALID_ARG, "kv landing: no arena, or %lld blocks", (long long)n);
    for (int64_t s = 0, run = 0; s < r->land_slots; s++) { /* first fit */
        run = r->land_used[s] ? 0 : run + 1;
        if (run == n) {
            *slot0 = s - n + 1;
            memset(r->land_used + *slot0, 1, (size_t)n);
            return STRATA_OK;
        }
    }
    return st_err(STRATA_ERR_NOMEM, "no run of %lld free blocks in the landing memory (--pd-landing-mem: %lld blocks)",
                  (long long)n, (long long)r->land_slots);
}

void st_runner_land_release(st_runner *r, int64_t slot0, int64_t n) {
    ST_ASSERT(slot0 >= 0 && n >= 0 && slot0 + n <= r->land_slots);
    memset(r->land_used + slot0, 0, (size_t)n);
}

int64_t st_runner_land_slots(const st_runner *r) { return r->land ? r->land_slots : 0; }

void *st_runner_land_at(const st_runner *r, int64_t slot0, size_t *stride) {
    if (stride) *stride = r->land_stride;
    return r->land ? r->land + (size_t)slot0 * (r->land_stride / (size_t)r->land_slots) : NULL;
}

strata_status st_runner_kv_preload_landed(st_runner *r, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                                          int64_t n, int64_t slot0, st_runner_preload **out) {
    *out = NULL;
    st_runner_preload *p = st_calloc(1, sizeof *p);
    if (!p || !(p->tokens = st_malloc((size_t)n_tokens * sizeof *tokens))) {
        st_free(p);
        st_runner_land_release(r, slot0, n);
        return st_err(STRATA_ERR_NOMEM, "kv preload: out of memory for a copy of %lld prompt tokens (%zu bytes)",
                      (long long)n_tokens, (size_t)n_tokens * sizeof *tokens);
    }
    memcpy(p->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
    p->n_tokens = n_tokens;
    p->slot0 = slot0;
    p->n_slots = n;
    st_block_table_init(&p->tbl);
    const int64_t bs = r->p.kv_block_size;
    const st_backend_ops *o = r->be->ops;
    int64_t cached = 0;
    strata_status st = st_bm_seq_start(r->bm, &p->tbl, tokens, n_tokens, &cached);
    const int64_t cb = cached / bs, skip = cb - from_block, avail = n - skip;
    /* the device prefix must reach the landed blocks (it may have shrunk since the reservation:
     * then the admission computes them) and stop inside them */
    if (!st && skip >= 0 && avail > 0 && st_bm_can_append(r->bm, &p->tbl, avail * bs) &&
        (st = st_bm_append_slots(r->bm, &p->tbl, avail * bs)) == STRATA_OK) {
        if (!r->ls) st = o->stream_create(r->be, false, &r->ls);
        if (!st) st = o->event_create(r->be, &p->ev);
        const st_kv_pool_params *kp = st_kv_pool_get_params(r->kv);
        const size_t lb = r->land_stride / (size_t)r->land_slots;
        for (int64_t l = 0; l < kp->n_layers && !st; l++)
            st = st_kv_pool_import_layer(r->kv, r->ls, l, p->tbl.blocks + cb, avail,
                                         r->land + (size_t)l * r->land_stride + (size_t)(slot0 + skip) * lb);
        if (!st) st = o->event_record(r->be, p->ev, r->ls);
        if (!st) {
            p->n_done = cached + avail * bs;
            *out = p;
            return STRATA_OK;
        }
    }
    if (st && r->ls) o->stream_sync(r->be, r->ls); /* copies of a failed batch may have been issued */
    if (p->ev && st) {
        o->event_destroy(r->be, p->ev);
        p->ev = NULL;
    }
    st_runner_kv_preload_free(r, p); /* nothing to bring, no room, or a copy error: the admission computes */
    return st;
}

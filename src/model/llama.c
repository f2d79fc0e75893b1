/* model/llama: init, and the Llama-specific ops of each weight group
 * (attention, FFN, output) over a batch of tokens. The layer loop that calls
 * them is forward.c; activations are fp32 on the backend; weights come from
 * the weight manager one group at a time, so the math does not know where
 * they live. */
#include "model/model_internal.h"
#include "weights/measure.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- setup ------------------------------------------------------------------ */

void st_llama_rope_inv_freq(const st_config *c, const float *freq_divisors, float *inv_freq) {
    const int64_t half = c->head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        /* as HF: base ** (arange(0, dim, 2) / dim) in float32, then 1 / that */
        float expo = (float)(2 * i) / (float)c->head_dim;
        float f = 1.0f / powf((float)c->rope_theta, expo);
        if (c->rope_scaling == ST_ROPE_SCALING_LINEAR) {
            f = f / (float)c->rope_factor;
        } else if (c->rope_scaling == ST_ROPE_SCALING_LLAMA3) {
            const float factor = (float)c->rope_factor;
            const float lo = (float)c->rope_low_freq_factor, hi = (float)c->rope_high_freq_factor;
            const float old_ctx = (float)c->rope_original_max_pos;
            const float low_wavelen = old_ctx / lo, high_wavelen = old_ctx / hi;
            const float wavelen = 2.0f * (float)M_PI / f;
            float g = wavelen > low_wavelen ? f / factor : f;
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
                float smooth = (old_ctx / wavelen - lo) / (hi - lo);
                g = (1.0f - smooth) * g / factor + smooth * g;
            }
            f = g;
        }
        if (freq_divisors) f = f / freq_divisors[i];
        inv_freq[i] = f;
    }
}

/* Records tensor `role` of group `gid` as a rows x cols weight, checking its size. */
static strata_status set_shape(st_llama *m, int gid, int role, int64_t rows, int64_t cols) {
    const st_tensor_desc *t = m->groups->g[gid].t[role].desc;
    size_t need = st_dtype_row_bytes(t->dtype, cols) * (size_t)rows;
    if (need == 0 || need != t->nbytes)
        return st_err(STRATA_ERR_MISMATCH, "%s: tensor %s holds %llu bytes, expected %zu for [%lld, %lld] %s",
                      m->files->path, t->name, (unsigned long long)t->nbytes, need, (long long)rows,
                      (long long)cols, st_dtype_name(t->dtype));
    st_weight *w = &m->wshape[gid][role];
    w->data = NULL;
    w->dtype = t->dtype;
    w->rows = rows;
    w->cols = cols;
    return STRATA_OK;
}

/* An activation buffer of count floats; a failure names it. */
static strata_status alloc_f32(st_llama *m, int64_t count, float **out, const char *what) {
    const size_t bytes = (size_t)count * sizeof(float);
    const strata_status st = m->be->ops->alloc(m->be, bytes, (void **)out);
    return st ? st_err_what(st, "activations: %s (%lld floats, %zu bytes)", what, (long long)count, bytes)
              : STRATA_OK;
}

static strata_status init_rope(st_llama *m) {
    const st_config *c = &m->cfg;
    const int64_t half = c->head_dim / 2;
    float divisors[1024], inv[1024];
    if (half > 1024) return st_err(STRATA_ERR_UNSUPPORTED, "head_dim %lld too large", (long long)c->head_dim);
    const float *div = NULL;
    const st_tensor_desc *t = st_model_find(m->files, "rope_freqs.weight");
    if (t) {
        if (t->dtype != ST_DTYPE_F32 || t->nbytes != (uint64_t)half * 4)
            return st_err(STRATA_ERR_MISMATCH, "%s: rope_freqs.weight must be f32 [%lld]",
                          m->files->path, (long long)half);
        memcpy(divisors, st_tensor_data(m->files, t), (size_t)half * 4);
        div = divisors;
    }
    st_llama_rope_inv_freq(c, div, inv);
    strata_status st = alloc_f32(m, half, &m->inv_freq, "RoPE inverse frequencies");
    if (st) return st;
    st = m->be->ops->copy_h2d(m->be, m->stream, m->inv_freq, inv, (size_t)half * 4);
    if (st) return st;
    return m->be->ops->stream_sync(m->be, m->stream);
}

/* The CPU's part of a streamed sequence's attention (params.cpu_attn):
 * its executor (the CPU tier's backend, the model's own backend when that
 * is the CPU, else a CPU backend of the model's own with weights.cpu_threads
 * threads), pinned host queries / outputs / log-sum-exps of a pass of up to
 * cpu_attn_tokens tokens, and the device buffers the outputs go up to. */
static strata_status init_cpu_attn(st_llama *m, const st_llama_params *p) {
    /* a model on the CPU backend: its device is the CPU, so a streamed decode reads its earlier host keys
     * where they are (share 1 unless one is given): no copy into the ring and no fp32 gather, the same bits
     * (the CPU's ranges chained in order, then merged with the area's as the ring's pieces would be). A
     * prefill chunk keeps the ring: its gather widens each key once for all its queries (18% faster at 512
     * tokens than widening per block of queries) */
    const bool cpu_dev = m->be->kind == ST_BACKEND_CPU;
    if (p->cpu_attn == 0 && !cpu_dev) return STRATA_OK;
    if (!(p->cpu_attn <= 1))
        return st_err(STRATA_ERR_INVALID_ARG, "model: cpu_attn = %g (--kv-cpu-attn: a share of the keys, 0 to 1)",
                      p->cpu_attn);
    st_backend *be = m->be;
    const st_config *c = &m->cfg;
    strata_status st;
    if (!be->ops->attn_merge)
        return st_err(STRATA_ERR_UNSUPPORTED, "model: the %s backend cannot merge attention results "
                      "(--kv-cpu-attn)", be->ops->name);
    m->cpu_attn = p->cpu_attn > 0 ? p->cpu_attn : cpu_dev ? 1.0 : -1.0;
    m->h2d_given = p->weights.bw.h2d;
    m->cpu_attn_tokens = ST_PLAN_CPU_MAX_TOKENS < m->max_tokens ? ST_PLAN_CPU_MAX_TOKENS : m->max_tokens;
    if (m->cpu && !(cpu_dev && p->cpu_attn == 0)) { /* the CPU tier's backend (on the CPU backend: a share
                                                       given, the GPU's path, which tests take there) */
        m->acpu = m->cpu, m->acpu_stream = m->cpu_stream;
    } else if (be->ops->attention_rows) {
        m->acpu = be, m->acpu_stream = m->stream;
    } else {
        const st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = p->weights.cpu_threads};
        if ((st = st_backend_init(&bp, &m->acpu))) return st;
        m->acpu_owned = true;
        if ((st = m->acpu->ops->stream_create(m->acpu, false, &m->acpu_stream))) return st;
    }
    const int64_t T = m->cpu_attn_tokens, qd = c->n_heads * c->head_dim;
    m->h_pos = st_malloc((size_t)T * sizeof(int32_t));
    if (!m->h_pos) return st_err(STRATA_ERR_NOMEM, "model: out of memory");
    if (m->acpu == be) return STRATA_OK; /* its part goes straight into att / lse (attn_streamed): no buffers */
    if ((st = be->ops->host_alloc(be, (size_t)(T * qd) * sizeof(float), (void **)&m->h_q)) ||
        (st = be->ops->host_alloc(be, (size_t)(T * qd) * sizeof(float), (void **)&m->h_att)) ||
        (st = be->ops->host_alloc(be, (size_t)(T * c->n_heads) * sizeof(float), (void **)&m->h_lse)))
        return st_err_what(st, "the CPU's attention part: pinned host buffers of %lld tokens", (long long)T);
    if ((st = alloc_f32(m, T * qd, &m->att2, "the CPU's attention part")) ||
        (st = alloc_f32(m, T * c->n_heads, &m->lse2, "the CPU's attention part's log-sum-exp")))
        return st;
    return be->ops->event_create(be, &m->q_ev);
}

/* The CPU tier's executor: a CPU backend of the model's own (its thread
 * count: weights.cpu_threads), pinned host copies of x and tmp (the main
 * backend's host memory: async copies), and the FFN scratch for passes of
 * up to cpu_max_tokens tokens. */
static strata_status init_cpu_exec(st_llama *m, const st_weight_opts *wo) {
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, I = c->intermediate_size;
    m->cpu_max_tokens = wo->cpu_max_tokens > 0 ? wo->cpu_max_tokens : ST_PLAN_CPU_MAX_TOKENS;
    if (m->cpu_max_tokens > m->max_tokens) m->cpu_max_tokens = m->max_tokens;
    const st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = wo->cpu_threads, .cpu_act = wo->cpu_act};
    strata_status st;
    if ((st = st_backend_init(&bp, &m->cpu))) return st;
    if ((st = m->cpu->ops->stream_create(m->cpu, false, &m->cpu_stream))) return st;
    const size_t xb = (size_t)(m->cpu_max_tokens * H) * sizeof(float);
    if ((st = m->be->ops->host_alloc(m->be, 2 * xb, (void **)&m->h_x))) return st;
    m->h_tmp = m->h_x + m->cpu_max_tokens * H;
    if ((st = m->cpu->ops->alloc(m->cpu, xb, (void **)&m->c_xn)) ||
        (st = m->cpu->ops->alloc(m->cpu, (size_t)(m->cpu_max_tokens * I) * sizeof(float), (void **)&m->c_gate)) ||
        (st = m->cpu->ops->alloc(m->cpu, (size_t)(m->cpu_max_tokens * I) * sizeof(float), (void **)&m->c_up)))
        return st;
    return m->be->ops->event_create(m->be, &m->cpu_ev);
}

static int64_t default_seq_len(const st_config *c, const st_llama_params *p) {
    return p && p->max_seq_len > 0 ? p->max_seq_len
           : (c->max_position_embeddings > 0 && c->max_position_embeddings < 4096 ? c->max_position_embeddings
                                                                                  : 4096);
}

static st_plan_params plan_params(const st_config *c, const st_llama_params *p) {
    return (st_plan_params){.device_mem = p->device_mem,
                            .max_tokens = p->max_tokens > 0 ? p->max_tokens : 512,
                            .max_seq_len = default_seq_len(c, p),
                            .attn_piece = p->attn_piece,
                            .kv_bytes = p->kv_bytes,
                            .weights = p->weights};
}

strata_status st_llama_plan(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_wgroups **groups, st_wplan *plan) {
    static const st_llama_params no_params;
    const st_llama_params *p = params ? params : &no_params;
    memset(plan, 0, sizeof *plan);
    *groups = NULL;
    st_plan_params pp = plan_params(&files->config, p);
    pp.measure_bw = true; /* the predictions are what a plan is for */
    strata_status st = st_plan_measure(files, be, &pp);
    if (st == STRATA_OK) st = st_wgroups_build(files, groups);
    if (st == STRATA_OK) st = st_plan_make(files, be, *groups, &pp, plan);
    if (st != STRATA_OK) {
        st_wgroups_free(*groups);
        *groups = NULL;
    }
    return st;
}

strata_status st_llama_measure(const st_model_files *files, st_backend *be, st_llama_params *params) {
    st_plan_params pp = plan_params(&files->config, params);
    const strata_status st = st_plan_measure(files, be, &pp);
    if (st == STRATA_OK) params->weights = pp.weights;
    return st;
}

st_wm *st_llama_weights(st_llama *m) { return m->wm; }
const st_config *st_llama_config(const st_llama *m) { return &m->cfg; }
int64_t st_llama_max_tokens(const st_llama *m) { return m->max_tokens; }
st_stream *st_llama_stream(const st_llama *m) { return m->stream; }
int64_t st_llama_max_seq_len(const st_llama *m) { return m->max_seq_len; }

st_kv_pool_params st_llama_kv_params_for(const st_config *c, int64_t max_tokens, int64_t max_seq_len,
                                         int64_t num_blocks, int64_t block_size, st_kv_dtype dtype) {
    return (st_kv_pool_params){.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                               .num_blocks = num_blocks, .block_size = block_size, .dtype = dtype,
                               .max_tokens = max_tokens, .max_seq_len = max_seq_len};
}

st_kv_stream_params st_llama_stream_params(const st_llama *m, int64_t max_len, st_kv_dtype dtype, size_t host_mem) {
    return (st_kv_stream_params){.n_layers = m->cfg.n_layers, .n_kv_heads = m->cfg.n_kv_heads,
                                 .head_dim = m->cfg.head_dim, .dtype = dtype, .piece = m->piece,
                                 .max_tokens = m->max_tokens, .max_len = max_len, .host_mem = host_mem};
}

st_kv_pool_params st_llama_kv_params(const st_llama *m, int64_t num_blocks, int64_t block_size, st_kv_dtype dtype) {
    return st_llama_kv_params_for(&m->cfg, m->max_tokens, m->max_seq_len, num_blocks, block_size, dtype);
}

strata_status st_llama_init(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_llama **out) {
    *out = NULL;
    static const st_llama_params no_params;
    const st_llama_params *opts = params ? params : &no_params;
    st_llama *m = st_calloc(1, sizeof *m);
    if (!m) return st_err(STRATA_ERR_NOMEM, "model: out of memory for its state (%zu bytes)", sizeof *m);
    m->files = files;
    m->be = be;
    m->cfg = files->config;
    const st_config *c = &m->cfg;
    const st_plan_params pp = plan_params(c, opts);
    m->max_seq_len = pp.max_seq_len;
    m->max_tokens = pp.max_tokens;
    m->bg_off = opts->no_graphs;
    strata_status st;
    const int64_t H = c->hidden_size, q_dim = c->n_heads * c->head_dim,
                  kv_dim = c->n_kv_heads * c->head_dim, I = c->intermediate_size,
                  V = c->vocab_size, T = m->max_tokens;
    if (c->head_dim % 2) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: odd head_dim %lld", files->path, (long long)c->head_dim);
        goto fail;
    }
    if ((st = be->ops->stream_create(be, false, &m->stream))) goto fail;

    /* weights: groups, shapes, placement, manager */
    if ((st = st_wgroups_build(files, &m->groups))) goto fail;
    m->wshape = st_calloc((size_t)m->groups->n, sizeof *m->wshape);
    if (!m->wshape) {
        st = st_err(STRATA_ERR_NOMEM, "model: out of memory for the shapes of %d weight groups (%zu bytes)",
                    (int)m->groups->n, (size_t)m->groups->n * sizeof *m->wshape);
        goto fail;
    }
    if ((st = set_shape(m, st_wg_embed_id(), ST_WG_EMBED_TABLE, V, H))) goto fail;
    for (int l = 0; l < (int)c->n_layers; l++) {
        const int a = st_wg_attn_id(l), f = st_wg_ffn_id(l);
        if ((st = set_shape(m, a, ST_WG_ATTN_NORM, 1, H)) || (st = set_shape(m, a, ST_WG_WQ, q_dim, H)) ||
            (st = set_shape(m, a, ST_WG_WK, kv_dim, H)) || (st = set_shape(m, a, ST_WG_WV, kv_dim, H)) ||
            (st = set_shape(m, a, ST_WG_WO, H, q_dim)) || (st = set_shape(m, f, ST_WG_FFN_NORM, 1, H)) ||
            (st = set_shape(m, f, ST_WG_GATE, I, H)) || (st = set_shape(m, f, ST_WG_UP, I, H)) ||
            (st = set_shape(m, f, ST_WG_DOWN, H, I)))
            goto fail;
    }
    if ((st = set_shape(m, st_wg_output_id(m->groups), ST_WG_OUT_NORM, 1, H)) ||
        (st = set_shape(m, st_wg_output_id(m->groups), ST_WG_LM_HEAD, V, H)))
        goto fail;
    {
        st_wplan plan;
        if ((st = st_plan_make(files, be, m->groups, &pp, &plan))) goto fail;
        st_wm_params wp = opts->weights.stream;
        wp.host_mem = plan.host_mem;
        const bool cpu_tier = plan.groups[ST_TIER_CPU] > 0;
        st = st_wm_init(be, files, m->groups, &plan, &wp, &m->wm);
        st_wplan_free(&plan);
        if (st) goto fail;
        if (cpu_tier && (st = init_cpu_exec(m, &opts->weights))) goto fail;
    }
    if ((st = init_cpu_attn(m, opts))) goto fail;
    /* the activations: exactly what st_plan_act_bytes counts */
    if ((st = alloc_f32(m, T * H, &m->x, "x"))) goto fail;
    if ((st = alloc_f32(m, T * H, &m->xn, "the normed x"))) goto fail;
    if ((st = alloc_f32(m, T * H, &m->tmp, "tmp"))) goto fail;
    if ((st = alloc_f32(m, T * q_dim, &m->q, "queries"))) goto fail;
    if ((st = alloc_f32(m, T * q_dim, &m->att, "attention output"))) goto fail;
    if ((st = alloc_f32(m, T * kv_dim, &m->k, "keys"))) goto fail;
    if ((st = alloc_f32(m, T * kv_dim, &m->v, "values"))) goto fail;
    m->ffn_rows = st_plan_ffn_rows(T);
    if ((st = alloc_f32(m, m->ffn_rows * I, &m->gate, "FFN gate"))) goto fail;
    if ((st = alloc_f32(m, m->ffn_rows * I, &m->up, "FFN up"))) goto fail;
    if ((st = alloc_f32(m, T * V, &m->logits, "logits"))) goto fail;
    if ((st = be->ops->alloc(be, (size_t)T * (sizeof(st_sample_args) + sizeof(int32_t)), (void **)&m->d_sargs))) {
        st = st_err_what(st, "sampling arguments of %lld tokens on the device", (long long)T);
        goto fail;
    }
    m->piece = st_plan_attn_piece(opts->attn_piece);
    m->gather_rows = st_plan_gather_rows(T, m->max_seq_len, m->piece);
    if ((st = alloc_f32(m, T * c->n_heads, &m->lse, "attention log-sum-exp")) ||
        (st = alloc_f32(m, m->gather_rows * kv_dim, &m->kg, "gathered keys")) ||
        (st = alloc_f32(m, m->gather_rows * kv_dim, &m->vg, "gathered values")))
        goto fail;
    m->d_sids = (int32_t *)(m->d_sargs + T);
    if ((st = be->ops->host_alloc(be, (size_t)T * (sizeof(st_sample_args) + sizeof(int32_t)), (void **)&m->h_sargs))) {
        st = st_err_what(st, "sampling arguments of %lld tokens in pinned host memory", (long long)T);
        goto fail;
    }
    m->h_sids = (int32_t *)(m->h_sargs + T);
    m->pad_tokens = st_malloc((size_t)T * sizeof(int32_t));
    m->pad_pos = st_malloc((size_t)T * sizeof(int32_t));
    m->pad_seq = st_malloc((size_t)T * sizeof(int32_t));
    m->pad_rows = st_malloc((size_t)T * sizeof(int32_t));
    m->pad_slots = st_malloc((size_t)T * sizeof(int64_t));
    if (!m->pad_tokens || !m->pad_pos || !m->pad_seq || !m->pad_rows || !m->pad_slots) {
        st = st_err(STRATA_ERR_NOMEM, "model: out of memory for the padded batch of %lld tokens (%zu bytes)",
                    (long long)T, (size_t)T * (4 * sizeof(int32_t) + sizeof(int64_t)));
        goto fail;
    }
    if ((st = init_rope(m))) goto fail;
    /* backends that record graphs: the compute stream's scratch grown once to
     * the largest shapes now, so that no later pass grows (moves) it under
     * the recorded graphs */
    if (be->kind == ST_BACKEND_CUDA && !m->bg_off && st_wm_all_resident(m->wm) &&
        st_plan_presize(be, m->stream, c, m->groups, m->max_tokens, m->max_seq_len) != STRATA_OK)
        st_log(STRATA_LOG_WARN, "compute stream scratch not pre-sized (%s): recorded passes may be re-recorded "
               "when a larger shape first runs", st_last_error());
    *out = m;
    return STRATA_OK;
fail:
    st_llama_free(m);
    return st;
}

void st_llama_free(st_llama *m) {
    if (!m) return;
    st_backend *be = m->be;
    if (m->stream) (void)be->ops->stream_sync(be, m->stream); /* nothing may still read a slot */
    st_llama_graphs_free(m);
    void *bufs[] = {m->x,      m->xn,     m->tmp, m->q,  m->att, m->k, m->v, m->gate, m->up, m->logits,
                    m->inv_freq, m->d_sargs, m->kg, m->vg, m->lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->dealloc(be, bufs[i]);
    if (m->h_sargs) be->ops->host_dealloc(be, m->h_sargs);
    st_wm_free(m->wm);
    if (m->h_x) be->ops->host_dealloc(be, m->h_x);
    if (m->cpu_ev) be->ops->event_destroy(be, m->cpu_ev);
    if (m->q_ev) be->ops->event_destroy(be, m->q_ev);
    float *ah[] = {m->h_q, m->h_att, m->h_lse};
    for (int i = 0; i < 3; i++)
        if (ah[i]) be->ops->host_dealloc(be, ah[i]);
    if (m->att2) be->ops->dealloc(be, m->att2);
    if (m->lse2) be->ops->dealloc(be, m->lse2);
    st_free(m->h_pos);
    if (m->acpu_owned) {
        if (m->acpu_stream) m->acpu->ops->stream_destroy(m->acpu, m->acpu_stream);
        st_backend_free(m->acpu);
    }
    if (m->cpu) {
        float *cb[] = {m->c_xn, m->c_gate, m->c_up};
        for (int i = 0; i < 3; i++)
            if (cb[i]) m->cpu->ops->dealloc(m->cpu, cb[i]);
        if (m->cpu_stream) m->cpu->ops->stream_destroy(m->cpu, m->cpu_stream);
        st_backend_free(m->cpu);
    }
    st_free(m->pad_tokens);
    st_free(m->pad_pos);
    st_free(m->pad_seq);
    st_free(m->pad_rows);
    st_free(m->pad_slots);
    st_free(m->wshape);
    st_wgroups_free(m->groups);
    if (m->stream) be->ops->stream_destroy(be, m->stream);
    st_free(m);
}

/* ---- the ops of each group -------------------------------------------------------- */

/* Attention group over the batch. On entry m->x is the residual stream and
 * m->tmp (for layer > 0) the previous group's output still to be added; on
 * exit m->tmp holds o_proj's output. q, k and v in one matmul_multi (one
 * launch where the backend can: the same results as three matmuls); the K/V
 * rows are stored at the batch's slots in the cache's dtype. Attention:
 *   - a batch of sequences, or a decode step: every token's sequence read
 *     through the block tables (attention_paged);
 *   - one sequence's prefill chunk (d->gather_ctx > 0): its keys gathered
 *     from the pool into contiguous fp32 rows (kv_gather dequantizes the
 *     pool's rows exactly, any dtype), m->piece keys at a time, attended piece by piece
 *     by attention_part (CUDA: its tensor-core kernels, which the paged op
 *     lacks; on the CPU each key widened once per layer instead of once per
 *     query, the same bits as the paged op);
 *   - a streamed sequence (d->ks): the same pieces, coming up from host
 *     memory through the stream's ring, then the last range and the pass's
 *     own keys from the stream's area (kv/kv_stream.h). */
static strata_status gather_piece(st_llama *m, const st_kv_layer *cache, const int32_t *ids, int64_t n_keys) {
    return m->be->ops->kv_gather(m->be, m->stream, cache, ids, n_keys, m->kg, m->vg);
}

/* `last`: no piece follows (its log-sum-exp is not needed unless merging) */
static strata_status attend_piece(st_llama *m, const batch_dev *d, int64_t n, int64_t key0, int64_t n_keys,
                                  bool merge, bool last) {
    const st_config *c = &m->cfg;
    const float scale = 1.0f / sqrtf((float)c->head_dim);
    return m->be->ops->attention_part(m->be, m->stream, m->q, m->kg, m->vg, d->pos, n, key0, n_keys, c->n_heads,
                                      c->n_kv_heads, c->head_dim, scale, merge, m->att,
                                      merge || !last ? m->lse : NULL);
}

void st_llama_cpu_attn(const st_llama *m, double *share, double *cpu_bw, double *h2d_bw) {
    *share = m->cpu_attn > 0 ? m->cpu_attn : 0;
    *cpu_bw = m->cpu_attn_bw;
    *h2d_bw = m->cpu_attn_h2d;
}

/* params.cpu_attn < 0 (a device other than the CPU: init_cpu_attn made it 1 there): the CPU's rate over
 * rows of the dtype (zeros written, so that they are not the kernel's shared zero page), 4x the last-level
 * cache and 256 MiB at least (the GPU machine's Xeon holds 256 MiB in its 300 MiB L3: the rate read there
 * was 55 GB/s, from DRAM 40), H2D (params' bw.h2d, else weights/measure's probe), and the share from them
 * (planner.h st_plan_cpu_attn_share). */
strata_status st_llama_plan_cpu_attn(st_llama *m, st_kv_dtype dtype) {
    if (m->cpu_attn >= 0) return STRATA_OK;
    st_backend *be = m->be;
    const st_config *c = &m->cfg;
    m->cpu_attn = 0; /* unless planned below */
    const size_t row = (size_t)(c->n_kv_heads * c->head_dim) * st_kv_dtype_size(dtype);
    const size_t llc4 = 4 * st_wbw_llc_bytes(), set = llc4 > ((size_t)256 << 20) ? llc4 : (size_t)256 << 20;
    int64_t keys = (int64_t)(set / (2 * row));
    keys = keys > ((int64_t)1 << 22) ? (int64_t)1 << 22 : keys < ST_ATTN_RANGE ? ST_ATTN_RANGE : keys;
    const size_t sc = dtype == ST_KV_FP8 ? (size_t)(keys * c->n_kv_heads) * sizeof(float) : 0;
    void *k = malloc((size_t)keys * row), *v = malloc((size_t)keys * row);
    float *ks = sc ? malloc(sc) : NULL, *vs = sc ? malloc(sc) : NULL;
    strata_status st = k && v && (!sc || (ks && vs)) ? STRATA_OK : st_err(STRATA_ERR_NOMEM, "model: out of memory");
    if (st == STRATA_OK) {
        memset(k, 0, (size_t)keys * row);
        memset(v, 0, (size_t)keys * row);
        if (sc) memset(ks, 0, sc), memset(vs, 0, sc);
        memset(m->h_q, 0, (size_t)(c->n_heads * c->head_dim) * sizeof(float));
        const st_kv_layer rows = {.k = k, .v = v, .k_scale = ks, .v_scale = vs, .dtype = dtype, .n_slots = keys,
                                  .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim};
        m->h_pos[0] = (int32_t)keys;
        for (int r = 0; r < 3 && st == STRATA_OK; r++) { /* one token over them, as attn_cpu_part; best of 3 */
            const double t0 = st_time_now();
            st = m->acpu->ops->attention_rows(m->acpu, m->acpu_stream, m->h_q, &rows, m->h_pos, 1, 0, keys,
                                              c->n_heads, c->n_kv_heads, c->head_dim, 1.0f / sqrtf((float)c->head_dim),
                                              false, m->h_att, m->h_lse);
            const double bw = (double)(2 * (size_t)keys * row + 2 * sc) / (st_time_now() - t0);
            if (st == STRATA_OK && bw > m->cpu_attn_bw) m->cpu_attn_bw = bw;
        }
    }
    free(k), free(v), free(ks), free(vs);
    if (st) return st;
    m->cpu_attn_h2d = m->h2d_given;
    if (m->cpu_attn_h2d <= 0) TRY(st_wbw_measure_h2d(be, m->stream, &m->cpu_attn_h2d));
    m->cpu_attn = st_plan_cpu_attn_share(m->cpu_attn_bw, m->cpu_attn_h2d);
    st_log(STRATA_LOG_INFO, "model: a streamed decode's oldest %.0f%% of keys attended on the CPU (it reads %s KV "
           "at %.1f GB/s, H2D %.1f GB/s)", 100.0 * m->cpu_attn, st_kv_dtype_name(dtype), m->cpu_attn_bw / 1e9,
           m->cpu_attn_h2d / 1e9);
    return STRATA_OK;
}

/* Keys [0, cpu) of the layer from the stream's host rows on the executor `be` (q, pos, out and lse in its
 * memory), segment by segment, the first into (out, lse) unless `merge`. */
static strata_status attn_rows(st_llama *m, st_backend *be, st_stream *s, st_kv_stream *ks, const float *q,
                               int64_t n, int64_t layer, int64_t cpu, bool merge, float *out, float *lse) {
    const st_config *c = &m->cfg;
    const int64_t p0 = st_kv_stream_len(ks);
    for (int64_t i = 0; i < n; i++) m->h_pos[i] = (int32_t)(p0 + i);
    for (int64_t a = 0; a < cpu;) {
        st_kv_layer rows;
        int64_t nr;
        TRY(st_kv_stream_host_rows(ks, layer, a, &rows, &nr));
        TRY(be->ops->attention_rows(be, s, q, &rows, m->h_pos, n, a, nr, c->n_heads, c->n_kv_heads, c->head_dim,
                                    1.0f / sqrtf((float)c->head_dim), merge || a > 0, out, lse));
        a += nr;
    }
    return STRATA_OK;
}

/* The CPU's part of a streamed pass's attention: keys [0, cpu) of the layer
 * from the stream's host rows, segment by segment (merged in order), once q
 * came down (the one wait: q_ev, recorded after q's copy, while the device
 * attends the keys from cpu on); then up and merged into att / lse on the
 * compute stream. The next layer's q comes down after this layer's copies
 * up on the same stream, so the host buffers are free again by its wait. */
static strata_status attn_cpu_part(st_llama *m, st_kv_stream *ks, int64_t n, int64_t layer, int64_t cpu) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t nh = c->n_heads, hd = c->head_dim;
    TRY(o->event_sync(be, m->q_ev));
    TRY(attn_rows(m, m->acpu, m->acpu_stream, ks, m->h_q, n, layer, cpu, false, m->h_att, m->h_lse));
    TRY(o->copy_h2d(be, m->stream, m->att2, m->h_att, (size_t)(n * nh * hd) * sizeof(float)));
    TRY(o->copy_h2d(be, m->stream, m->lse2, m->h_lse, (size_t)(n * nh) * sizeof(float)));
    return o->attn_merge(be, m->stream, m->att, m->lse, m->att2, m->lse2, n * nh, hd);
}

/* The pass's attention for one layer. Keys [0, cpu) (st_kv_stream_cpu_keys) are the CPU's: on a model whose
 * device is the CPU (acpu is its backend) attended first, straight into att / lse, so that the device's
 * pieces and area merge after them in key order (the bits of the ring alone); else concurrently with the
 * device's part and merged after it (attn_cpu_part). */
static strata_status attn_streamed(st_llama *m, batch_dev *d, int64_t n, int64_t layer) {
    st_kv_stream *ks = d->ks;
    const int64_t cpu = st_kv_stream_cpu_keys(ks);
    const bool first = cpu > 0 && m->acpu == m->be, after = cpu > 0 && !first;
    if (first) TRY(attn_rows(m, m->be, m->stream, ks, m->q, n, layer, cpu, false, m->att, m->lse));
    if (after) { /* q down for the CPU's part */
        TRY(m->be->ops->copy_d2h(m->be, m->stream, m->h_q, m->q,
                                 (size_t)(n * m->cfg.n_heads * m->cfg.head_dim) * sizeof(float)));
        TRY(m->be->ops->event_record(m->be, m->q_ev, m->stream));
    }
    st_kv_layer area;
    TRY(st_kv_stream_layer_begin(ks, layer, &area));
    TRY(m->be->ops->kv_store_paged(m->be, m->stream, &area, m->k, m->v, d->slots, n));
    const int64_t np = st_kv_stream_n_pieces(ks), ts = st_kv_stream_tail_start(ks);
    for (int64_t k = 0; k < np; k++) {
        st_kv_layer slot;
        int64_t key0, n_keys;
        TRY(st_kv_stream_piece(ks, layer, k, &slot, &key0, &n_keys));
        TRY(gather_piece(m, &slot, st_kv_stream_iota(ks), n_keys));
        TRY(st_kv_stream_piece_read(ks));
        TRY(attend_piece(m, d, n, key0, n_keys, first || k > 0, false));
    }
    const int64_t end = st_kv_stream_len(ks) + n;
    TRY(gather_piece(m, &area, st_kv_stream_iota(ks), end - ts));
    TRY(st_kv_stream_layer_end(ks, layer));
    TRY(attend_piece(m, d, n, ts, end - ts, first || np > 0, !after)); /* a CPU part after merges with lse */
    return after ? attn_cpu_part(m, ks, n, layer, cpu) : STRATA_OK;
}

strata_status st_llama_attn_ops(st_llama *m, const st_weight *w, const st_kv_layer *cache, batch_dev *d,
                                int64_t n, int64_t layer) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, hd = c->head_dim;
    const st_weight wqkv[3] = {w[ST_WG_WQ], w[ST_WG_WK], w[ST_WG_WV]};
    float *const yqkv[3] = {m->q, m->k, m->v};
    TRY(o->rmsnorm_matmul(be, m->stream, m->x, layer > 0 ? m->tmp : NULL, &w[ST_WG_ATTN_NORM], c->rms_norm_eps, n,
                          H, m->xn, wqkv, 3, NULL, yqkv));
    if (d->ks) {
        TRY(o->rope(be, m->stream, m->q, d->rope_pos, n, c->n_heads, hd, m->inv_freq, c->rope_interleaved));
        TRY(o->rope(be, m->stream, m->k, d->rope_pos, n, c->n_kv_heads, hd, m->inv_freq, c->rope_interleaved));
        TRY(attn_streamed(m, d, n, layer));
        return o->matmul(be, m->stream, m->att, &w[ST_WG_WO], n, m->tmp);
    }
    TRY(o->rope_kv_store(be, m->stream, m->q, m->k, m->v, d->rope_pos, n, c->n_heads, hd, m->inv_freq,
                         c->rope_interleaved, cache, d->slots));
    if (d->gather_ctx > 0) { /* any pool dtype: kv_gather dequantizes exactly */
        for (int64_t a = 0; a < d->gather_ctx; a += m->piece) {
            const int64_t len = d->gather_ctx - a < m->piece ? d->gather_ctx - a : m->piece;
            TRY(gather_piece(m, cache, d->key_slots + a, len));
            TRY(attend_piece(m, d, n, a, len, a > 0, a + len == d->gather_ctx));
        }
        return o->matmul(be, m->stream, m->att, &w[ST_WG_WO], n, m->tmp);
    }
    const float scale = 1.0f / sqrtf((float)hd);
    d->pk.cache = *cache;
    TRY(o->attention_paged(be, m->stream, m->q, &d->pk, d->seq, d->pos, n, c->n_heads, c->n_kv_heads, hd, scale,
                           m->att));
    return o->matmul(be, m->stream, m->att, &w[ST_WG_WO], n, m->tmp);
}

/* FFN group: x += tmp (attention output); xn = norm(x); tmp = down(silu(gate)
 * * up), in sub-chunks of at most m->ffn_rows rows (planner.h
 * ST_PLAN_FFN_ROWS: the intermediate does not grow with a larger pass; each
 * row's arithmetic is its own, so on the CPU the bits do not depend on it).
 * Gate, up and SwiGLU as one matmul_swiglu (on CUDA one GEMV or MMQ launch
 * up to the MMQ's token counts; beyond, gate and up into e->up, then the
 * SwiGLU; the same results), with the norm as one rmsnorm_matmul for fewer
 * than 4 tokens where the pass is one sub-chunk (CUDA: the norm's kernel
 * quantizes for the int8 GEMV). */
static strata_status ffn_math(st_llama *m, const st_ffn_exec *e, const st_weight *w, int64_t n) {
    st_backend *be = e->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size;
    if (n < 4 && n <= e->rows) { /* one sub-chunk: the norm, gate, up and SwiGLU as one op */
        float *const g[1] = {e->gate};
        TRY(o->rmsnorm_matmul(be, e->stream, e->x, e->tmp, &w[ST_WG_FFN_NORM], c->rms_norm_eps, n, H, e->xn,
                              &w[ST_WG_GATE], 1, &w[ST_WG_UP], g));
        return o->matmul(be, e->stream, e->gate, &w[ST_WG_DOWN], n, e->tmp);
    }
    TRY(o->rmsnorm(be, e->stream, e->x, e->tmp, &w[ST_WG_FFN_NORM], c->rms_norm_eps, n, H, e->xn));
    for (int64_t r0 = 0; r0 < n; r0 += e->rows) {
        const int64_t k = n - r0 < e->rows ? n - r0 : e->rows;
        const float *xn = e->xn + r0 * H;
        TRY(o->matmul_swiglu(be, e->stream, xn, &w[ST_WG_GATE], &w[ST_WG_UP], k, e->gate, e->up));
        TRY(o->matmul(be, e->stream, e->gate, &w[ST_WG_DOWN], k, e->tmp + r0 * H));
    }
    return STRATA_OK;
}

strata_status st_llama_ffn_ops(st_llama *m, const st_weight *w, int64_t n) {
    const st_ffn_exec e = {.be = m->be, .stream = m->stream, .x = m->x, .tmp = m->tmp, .xn = m->xn,
                           .gate = m->gate, .up = m->up, .rows = m->ffn_rows};
    return ffn_math(m, &e, w, n);
}

/* The same ops on the model's CPU backend over host copies of x and tmp
 * (forward.c moves them across): the CPU tier's executor. */
strata_status st_llama_ffn_ops_cpu(st_llama *m, const st_weight *w, int64_t n) {
    const st_ffn_exec e = {.be = m->cpu, .stream = m->cpu_stream, .x = m->h_x, .tmp = m->h_tmp, .xn = m->c_xn,
                           .gate = m->c_gate, .up = m->c_up, .rows = m->cpu_max_tokens};
    return ffn_math(m, &e, w, n);
}

/* Output group: x += tmp; xn = norm(x); logits[n_out, V] = the rows
 * logit_rows of xn (gathered into tmp unless they are all rows, then one
 * rmsnorm_matmul) @ lm_head^T. */
strata_status st_llama_output_ops(st_llama *m, const st_weight *w, const batch_dev *d, int64_t n, int64_t n_out) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size;
    if (n_out == n) { /* every row: the norm and the LM head as one op */
        float *const y[1] = {m->logits};
        return o->rmsnorm_matmul(be, m->stream, m->x, m->tmp, &w[ST_WG_OUT_NORM], c->rms_norm_eps, n, H, m->xn,
                                 &w[ST_WG_LM_HEAD], 1, NULL, y);
    }
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &w[ST_WG_OUT_NORM], c->rms_norm_eps, n, H, m->xn));
    const float *src = m->xn;
    if (n_out < n) { /* a gather through get_rows, xn seen as an fp32 table */
        const st_weight rows = {.data = m->xn, .dtype = ST_DTYPE_F32, .rows = n, .cols = H};
        TRY(o->get_rows(be, m->stream, &rows, d->logit_rows, n_out, m->tmp));
        src = m->tmp;
    }
    return o->matmul(be, m->stream, src, &w[ST_WG_LM_HEAD], n_out, m->logits);
}

/* Llama forward pass over backend.h: embedding -> per layer [attn group, ffn
 * group] -> final norm -> lm_head. Activations are fp32 on the backend. */
#include "model/llama.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    st_weight attn_norm; /* 1 x hidden */
    st_weight wq;        /* [heads*hd, hidden] */
    st_weight wk;        /* [kv*hd, hidden] */
    st_weight wv;        /* [kv*hd, hidden] */
    st_weight wo;        /* [hidden, heads*hd] */
    st_weight ffn_norm;  /* 1 x hidden */
    st_weight w_gate;    /* [inter, hidden] */
    st_weight w_up;      /* [inter, hidden] */
    st_weight w_down;    /* [hidden, inter] */
    float *k_cache;      /* [max_ctx, kv*hd] */
    float *v_cache;      /* [max_ctx, kv*hd] */
} llama_layer;

/* Device buffers a weight upload made (none on CPU: weights stay mapped). */
typedef struct {
    void **ptrs;
    int n, cap;
} owned_list;

struct st_llama {
    const st_model_files *files;
    st_backend *be;
    st_config cfg;
    int64_t max_ctx, max_batch;
    int64_t n_past;
    st_stream *stream;      /* compute stream */

    st_weight embed;        /* [vocab, hidden] */
    st_weight out_norm;     /* 1 x hidden */
    st_weight lm_head;      /* [vocab, hidden] (the embedding when tied) */
    llama_layer *layers;
    owned_list owned;

    /* activations, [max_batch, ...] each */
    int32_t *d_tokens, *d_pos;
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *logits;
    float *inv_freq;        /* [head_dim/2] */
    int32_t *h_pos;         /* host staging for positions */
};

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

static strata_status owned_push(owned_list *l, void *p) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        void **np = st_realloc(l->ptrs, (size_t)cap * sizeof *np);
        if (!np) return st_err(STRATA_ERR_NOMEM, "out of memory");
        l->ptrs = np;
        l->cap = cap;
    }
    l->ptrs[l->n++] = p;
    return STRATA_OK;
}

/* Makes tensor `name` usable on the backend as a rows x cols weight. */
static strata_status bind_weight(st_llama *m, const char *name, int64_t rows, int64_t cols,
                                 st_weight *w) {
    const st_tensor_desc *t = st_model_find(m->files, name);
    if (!t) return st_err(STRATA_ERR_NOT_FOUND, "%s: tensor %s is missing", m->files->path, name);
    size_t need = st_dtype_row_bytes(t->dtype, cols) * (size_t)rows;
    if (need == 0 || need != t->nbytes)
        return st_err(STRATA_ERR_MISMATCH, "%s: tensor %s holds %llu bytes, expected %zu for [%lld, %lld] %s",
                      m->files->path, name, (unsigned long long)t->nbytes, need, (long long)rows,
                      (long long)cols, st_dtype_name(t->dtype));
    void *dev = NULL;
    bool owned = false;
    strata_status st = m->be->ops->upload(m->be, st_tensor_data(m->files, t), need, &dev, &owned);
    if (st != STRATA_OK) return st;
    if (owned && (st = owned_push(&m->owned, dev)) != STRATA_OK) {
        m->be->ops->dealloc(m->be, dev);
        return st;
    }
    w->data = dev;
    w->dtype = t->dtype;
    w->rows = rows;
    w->cols = cols;
    return STRATA_OK;
}

static strata_status alloc_f32(st_llama *m, int64_t count, float **out) {
    return m->be->ops->alloc(m->be, (size_t)count * sizeof(float), (void **)out);
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
    strata_status st = alloc_f32(m, half, &m->inv_freq);
    if (st) return st;
    st = m->be->ops->copy_h2d(m->be, m->stream, m->inv_freq, inv, (size_t)half * 4);
    if (st) return st;
    return m->be->ops->stream_sync(m->be, m->stream);
}

strata_status st_llama_init(const st_model_files *files, st_backend *be,
                            const st_llama_params *params, st_llama **out) {
    *out = NULL;
    st_llama *m = st_calloc(1, sizeof *m);
    if (!m) return st_err(STRATA_ERR_NOMEM, "out of memory");
    m->files = files;
    m->be = be;
    m->cfg = files->config;
    const st_config *c = &m->cfg;
    m->max_ctx = params && params->max_ctx > 0 ? params->max_ctx
                 : (c->max_position_embeddings > 0 && c->max_position_embeddings < 4096
                        ? c->max_position_embeddings : 4096);
    m->max_batch = params && params->max_batch > 0 ? params->max_batch : 512;
    if (m->max_batch > m->max_ctx) m->max_batch = m->max_ctx;
    strata_status st;
    const int64_t H = c->hidden_size, q_dim = c->n_heads * c->head_dim,
                  kv_dim = c->n_kv_heads * c->head_dim, I = c->intermediate_size,
                  V = c->vocab_size, T = m->max_batch;
    if (c->head_dim % 2) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: odd head_dim %lld", files->path, (long long)c->head_dim);
        goto fail;
    }
    if ((st = be->ops->stream_create(be, false, &m->stream))) goto fail;

    if ((st = bind_weight(m, "model.embed_tokens.weight", V, H, &m->embed))) goto fail;
    if ((st = bind_weight(m, "model.norm.weight", 1, H, &m->out_norm))) goto fail;
    if (st_model_find(files, "lm_head.weight")) {
        if ((st = bind_weight(m, "lm_head.weight", V, H, &m->lm_head))) goto fail;
    } else if (c->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: lm_head.weight is missing and embeddings are not tied",
                    files->path);
        goto fail;
    }
    m->layers = st_calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) { st = st_err(STRATA_ERR_NOMEM, "out of memory"); goto fail; }
    for (int64_t l = 0; l < c->n_layers; l++) {
        llama_layer *L = &m->layers[l];
        char name[256];
#define BIND(field, suffix, r, cc)                                                       \
    snprintf(name, sizeof name, "model.layers.%lld.%s", (long long)l, suffix);           \
    if ((st = bind_weight(m, name, r, cc, &L->field))) goto fail;
        BIND(attn_norm, "input_layernorm.weight", 1, H);
        BIND(wq, "self_attn.q_proj.weight", q_dim, H);
        BIND(wk, "self_attn.k_proj.weight", kv_dim, H);
        BIND(wv, "self_attn.v_proj.weight", kv_dim, H);
        BIND(wo, "self_attn.o_proj.weight", H, q_dim);
        BIND(ffn_norm, "post_attention_layernorm.weight", 1, H);
        BIND(w_gate, "mlp.gate_proj.weight", I, H);
        BIND(w_up, "mlp.up_proj.weight", I, H);
        BIND(w_down, "mlp.down_proj.weight", H, I);
#undef BIND
        if ((st = alloc_f32(m, m->max_ctx * kv_dim, &L->k_cache))) goto fail;
        if ((st = alloc_f32(m, m->max_ctx * kv_dim, &L->v_cache))) goto fail;
    }
    if ((st = be->ops->alloc(be, (size_t)T * sizeof(int32_t), (void **)&m->d_tokens))) goto fail;
    if ((st = be->ops->alloc(be, (size_t)T * sizeof(int32_t), (void **)&m->d_pos))) goto fail;
    if ((st = alloc_f32(m, T * H, &m->x))) goto fail;
    if ((st = alloc_f32(m, T * H, &m->xn))) goto fail;
    if ((st = alloc_f32(m, T * H, &m->tmp))) goto fail;
    if ((st = alloc_f32(m, T * q_dim, &m->q))) goto fail;
    if ((st = alloc_f32(m, T * q_dim, &m->att))) goto fail;
    if ((st = alloc_f32(m, T * kv_dim, &m->k))) goto fail;
    if ((st = alloc_f32(m, T * kv_dim, &m->v))) goto fail;
    if ((st = alloc_f32(m, T * I, &m->gate))) goto fail;
    if ((st = alloc_f32(m, T * I, &m->up))) goto fail;
    if ((st = alloc_f32(m, T * V, &m->logits))) goto fail;
    m->h_pos = st_malloc((size_t)T * sizeof(int32_t));
    if (!m->h_pos) { st = st_err(STRATA_ERR_NOMEM, "out of memory"); goto fail; }
    if ((st = init_rope(m))) goto fail;
    *out = m;
    return STRATA_OK;
fail:
    st_llama_free(m);
    return st;
}

void st_llama_free(st_llama *m) {
    if (!m) return;
    st_backend *be = m->be;
    if (m->layers) {
        for (int64_t l = 0; l < m->cfg.n_layers; l++) {
            if (m->layers[l].k_cache) be->ops->dealloc(be, m->layers[l].k_cache);
            if (m->layers[l].v_cache) be->ops->dealloc(be, m->layers[l].v_cache);
        }
    }
    void *bufs[] = {m->d_tokens, m->d_pos, m->x, m->xn, m->tmp, m->q, m->att, m->k,
                    m->v, m->gate, m->up, m->logits, m->inv_freq};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->dealloc(be, bufs[i]);
    for (int i = 0; i < m->owned.n; i++) be->ops->dealloc(be, m->owned.ptrs[i]);
    st_free(m->owned.ptrs);
    if (m->stream) be->ops->stream_destroy(be, m->stream);
    st_free(m->layers);
    st_free(m->h_pos);
    st_free(m);
}

void st_llama_reset(st_llama *m) { m->n_past = 0; }
int64_t st_llama_n_past(const st_llama *m) { return m->n_past; }
int64_t st_llama_max_ctx(const st_llama *m) { return m->max_ctx; }
const st_config *st_llama_config(const st_llama *m) { return &m->cfg; }

/* ---- forward ------------------------------------------------------------------ */

#define TRY(x) do { strata_status st_ = (x); if (st_ != STRATA_OK) return st_; } while (0)

/* Attention group of layer l for n tokens at positions n_past.. (in m->d_pos).
 * On entry m->x is the residual stream and m->tmp (when residual_pending) the
 * previous group's output still to be added; on exit m->tmp holds o_proj's output. */
static strata_status attn_group(st_llama *m, const llama_layer *L, int64_t n, int64_t n_past,
                                bool residual_pending) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, hd = c->head_dim, kv_dim = c->n_kv_heads * hd;
    TRY(o->rmsnorm(be, m->stream, m->x, residual_pending ? m->tmp : NULL, &L->attn_norm,
                   c->rms_norm_eps, n, H, m->xn));
    TRY(o->matmul(be, m->stream, m->xn, &L->wq, n, m->q));
    TRY(o->matmul(be, m->stream, m->xn, &L->wk, n, m->k));
    TRY(o->matmul(be, m->stream, m->xn, &L->wv, n, m->v));
    TRY(o->rope(be, m->stream, m->q, m->d_pos, n, c->n_heads, hd, m->inv_freq, c->rope_interleaved));
    TRY(o->rope(be, m->stream, m->k, m->d_pos, n, c->n_kv_heads, hd, m->inv_freq, c->rope_interleaved));
    const size_t row = (size_t)kv_dim * sizeof(float);
    TRY(o->copy_d2d(be, m->stream, L->k_cache + n_past * kv_dim, m->k, (size_t)n * row));
    TRY(o->copy_d2d(be, m->stream, L->v_cache + n_past * kv_dim, m->v, (size_t)n * row));
    TRY(o->attention(be, m->stream, m->q, L->k_cache, L->v_cache, m->d_pos, n, n_past + n,
                     c->n_heads, c->n_kv_heads, hd, 1.0f / sqrtf((float)hd), m->att));
    TRY(o->matmul(be, m->stream, m->att, &L->wo, n, m->tmp));
    return STRATA_OK;
}

/* FFN group: x += tmp (attention output); xn = norm(x); tmp = down(silu(gate) * up). */
static strata_status ffn_group(st_llama *m, const llama_layer *L, int64_t n) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, I = c->intermediate_size;
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &L->ffn_norm, c->rms_norm_eps, n, H, m->xn));
    TRY(o->matmul(be, m->stream, m->xn, &L->w_gate, n, m->gate));
    TRY(o->matmul(be, m->stream, m->xn, &L->w_up, n, m->up));
    TRY(o->swiglu(be, m->stream, m->gate, m->up, n * I, m->gate));
    TRY(o->matmul(be, m->stream, m->gate, &L->w_down, n, m->tmp));
    return STRATA_OK;
}

/* Which logits a chunk produces. */
typedef enum { LOGITS_NONE, LOGITS_LAST, LOGITS_ALL } logits_mode;

/* One chunk of at most max_batch tokens. logits: host [n, vocab] (ALL) or [vocab] (LAST). */
static strata_status forward_chunk(st_llama *m, const int32_t *tokens, int64_t n, int64_t n_past,
                                   logits_mode mode, float *logits) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, V = c->vocab_size;
    for (int64_t i = 0; i < n; i++) m->h_pos[i] = (int32_t)(n_past + i);
    TRY(o->copy_h2d(be, m->stream, m->d_tokens, tokens, (size_t)n * sizeof(int32_t)));
    TRY(o->copy_h2d(be, m->stream, m->d_pos, m->h_pos, (size_t)n * sizeof(int32_t)));
    TRY(o->get_rows(be, m->stream, &m->embed, m->d_tokens, n, m->x));
    for (int64_t l = 0; l < c->n_layers; l++) {
        TRY(attn_group(m, &m->layers[l], n, n_past, l > 0));
        TRY(ffn_group(m, &m->layers[l], n));
    }
    if (mode == LOGITS_NONE) return STRATA_OK; /* the KV is what this chunk was for */
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &m->out_norm, c->rms_norm_eps, n, H, m->xn));
    const int64_t n_out = mode == LOGITS_ALL ? n : 1;
    const float *src = mode == LOGITS_ALL ? m->xn : m->xn + (n - 1) * H;
    TRY(o->matmul(be, m->stream, src, &m->lm_head, n_out, m->logits));
    TRY(o->copy_d2h(be, m->stream, logits, m->logits, (size_t)(n_out * V) * sizeof(float)));
    return o->stream_sync(be, m->stream); /* the caller reads logits now */
}

strata_status st_llama_forward(st_llama *m, const int32_t *tokens, int64_t n, int64_t n_past,
                               bool all_logits, float *logits) {
    const st_config *c = &m->cfg;
    if (n <= 0) return st_err(STRATA_ERR_INVALID_ARG, "forward: no tokens");
    if (n_past != m->n_past)
        return st_err(STRATA_ERR_INVALID_ARG, "forward: n_past %lld but the cache holds %lld tokens",
                      (long long)n_past, (long long)m->n_past);
    if (n_past + n > m->max_ctx)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "forward: %lld tokens after %lld exceed the context of %lld tokens (--ctx)",
                      (long long)n, (long long)n_past, (long long)m->max_ctx);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return st_err(STRATA_ERR_INVALID_ARG,
                          "forward: token %lld (index %lld) is outside the vocabulary [0, %lld)",
                          (long long)tokens[i], (long long)i, (long long)c->vocab_size);
    for (int64_t done = 0; done < n; done += m->max_batch) {
        const int64_t k = n - done < m->max_batch ? n - done : m->max_batch;
        const bool last = done + k == n;
        logits_mode mode = all_logits ? LOGITS_ALL : last ? LOGITS_LAST : LOGITS_NONE;
        float *dst = all_logits ? logits + done * c->vocab_size : logits;
        /* on error m->n_past is unchanged: K/V written past it are simply unused */
        TRY(forward_chunk(m, tokens + done, k, n_past + done, mode, dst));
    }
    m->n_past = n_past + n;
    return STRATA_OK;
}

/* Llama forward pass over backend.h: embedding -> per layer [attn group, ffn
 * group] -> final norm -> lm_head. Activations are fp32 on the backend.
 * Weights come from the weight manager, one group at a time (group_acquire /
 * group_release below); the math does not know where they live. */
#include "model/llama.h"

#include "weights/measure.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float *k_cache;      /* [max_ctx, kv*hd] */
    float *v_cache;      /* [max_ctx, kv*hd] */
} llama_layer;

/* One shape of batched pass (st_llama_forward_batch) and its recording. A
 * recording holds every pointer and launch configuration of the pass, so the
 * key is everything those depend on when the weights are resident: the token
 * count, the logit rows, the attention's bucketed context bound (its split
 * count), whether the sample op runs, and the KV pool. */
#define BG_SLOTS 16
#define BG_MAX_FAILS 3       /* failed recordings of a shape before it always runs directly */
#define BG_MAX_DROPS 256     /* invalidations (device allocations between steps) before graphs are given up */
#define BG_MAX_TOKENS 256    /* larger passes always run directly: their kernels are long enough to hide the
                                launches, and their shapes (prefill chunks) seldom repeat */
typedef struct {
    bool used;               /* the key is set: the shape ran directly at least once (its scratch is sized) */
    int64_t n, n_logits, max_ctx;
    bool sample;
    const void *kv;          /* st_kv_cache */
    st_graph *g;             /* NULL: not recorded (yet) */
    int fails;
    uint64_t last_use;
} batch_graph;

struct st_llama {
    const st_model_files *files;
    st_backend *be;
    st_config cfg;
    int64_t max_ctx, max_batch;
    int64_t n_past;
    bool no_seq_kv;         /* no contiguous cache: st_llama_forward_batch only */
    st_stream *stream;      /* compute stream */

    st_wgroups *groups;     /* weight groups: embed, attn.l, ffn.l, output */
    st_weight (*wshape)[ST_WG_MAX_TENSORS]; /* [groups->n]: each tensor's dtype and shape (no data):
                                               attn [norm 1 x H, q [heads*hd, H], k, v [kv*hd, H],
                                               o [H, heads*hd]]; ffn [norm 1 x H, gate, up [I, H],
                                               down [H, I]]; output [norm 1 x H, lm_head [V, H]] */
    st_wm *wm;              /* where the weights live: device, pinned host, SSD */
    llama_layer *layers;

    /* activations, [max_batch, ...] each */
    int32_t *d_tokens, *d_pos;
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *logits;
    float *inv_freq;        /* [head_dim/2] */
    int32_t *h_pos;         /* host staging for positions */

    /* single-token decode (decode_step): buffers made by its first call */
    st_graph *dec_graph;    /* the recorded step, replayed for every token */
    int dec_graph_fails;    /* failed recordings: no more tries after 3 */
    bool dec_no_graph;      /* no graph: the backend records none, or weights stream */
    int64_t dec_steps;      /* steps run */
    int32_t *h_dec;         /* pinned host [4]: token, position, argmax result */
    int32_t *d_dec;         /* device [4] */
    float *d_qkv;           /* device [q_dim + 2 kv_dim]: q | k | v of the token */

    /* device sampling of a batch's logits (st_llama_forward_batch_sample): made by its first call */
    st_sample_args *d_sargs, *h_sargs; /* device / pinned host [max_batch] */
    int32_t *d_sids, *h_sids;          /* device [max_batch] / pinned host (after h_sargs) [max_batch] */

    /* recorded batched passes (batch_run below) */
    batch_graph bg[BG_SLOTS];
    bool bg_off;            /* no batch graphs: STRATA_BATCH_GRAPH=0, st_llama_set_batch_graphs, a backend
                               without graphs, or too many invalidations */
    uint64_t bg_takes;      /* be->device_budget.takes when the cached graphs were last known valid */
    uint64_t bg_clock;      /* LRU clock */
    int bg_invalid;         /* times the recordings were dropped for a device allocation */
    uint64_t dec_takes;     /* be->device_budget.takes when dec_graph was recorded */
    st_llama_graph_stats bg_stats;
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

static size_t r256(size_t x) { return (x + 255) / 256 * 256; }

/* Block size assumed for the batch metadata of a paged pool the planner
 * reserves room for (the runner's default). */
#define PLAN_KV_BLOCK 16

/* Device bytes of the KV cache and of the activations this file allocates
 * (st_llama_init, and the decode path's first call), each allocation rounded
 * to 256 bytes (the CUDA pool's granularity; the CPU arena counts less).
 * The KV part: the contiguous cache (unless p->no_seq_kv) plus the paged pool
 * of p->kv_pool_tokens slots (st_kv_cache_init). */
static void device_needs(const st_config *c, int64_t max_ctx, int64_t T, const st_llama_params *p, size_t *kv,
                         size_t *act) {
    const int64_t H = c->hidden_size, q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim,
                  I = c->intermediate_size, V = c->vocab_size;
    *kv = p->no_seq_kv ? 0 : 2 * (size_t)c->n_layers * r256((size_t)(max_ctx * kv_dim) * 4);
    if (p->kv_pool_tokens > 0)
        *kv += st_kv_cache_device_bytes(c, (p->kv_pool_tokens + PLAN_KV_BLOCK - 1) / PLAN_KV_BLOCK, PLAN_KV_BLOCK, T,
                                        max_ctx);
    size_t a = 2 * r256((size_t)T * 4);                 /* d_tokens, d_pos */
    a += 3 * r256((size_t)(T * H) * 4);                 /* x, xn, tmp */
    a += 2 * r256((size_t)(T * q_dim) * 4);             /* q, att */
    a += 2 * r256((size_t)(T * kv_dim) * 4);            /* k, v */
    a += 2 * r256((size_t)(T * I) * 4);                 /* gate, up */
    a += r256((size_t)(T * V) * 4);                     /* logits */
    a += r256((size_t)(c->head_dim / 2) * 4);           /* inv_freq */
    a += r256(4 * sizeof(int32_t)) + r256((size_t)(q_dim + 2 * kv_dim) * 4); /* decode: d_dec, d_qkv */
    *act = a;
}

/* ---- the backend's scratch, measured --------------------------------------------------
 * Besides the buffers this file allocates, a backend takes device memory for
 * itself while ops run (CUDA: activations converted to bf16, weight slabs
 * dequantized for a GEMM, the cuBLASLt workspace, split-KV attention
 * partials, reduction partials). How much depends on the model's widths and
 * dtypes, the batch and the context, and on the kernels, so it is measured:
 * the ops a forward pass runs (every matmul shape at a prefill chunk of T
 * tokens and at one token, the decode step's fused matmuls, attention over
 * up to max_ctx keys, paged attention when a pool is planned, the argmax)
 * run once on a probe stream over zeroed buffers of the model's shapes, and
 * the growth of the device budget during the ops is the scratch. Probe
 * weights keep the tensor's dtype and width and at most 64 MiB of its rows
 * (what scratch depends on). Everything is released before the plan is made. */

#define PROBE_W_BYTES ((size_t)64 << 20)
#define PROBE_MAX_W 24

typedef struct {
    st_dtype dtype;
    int64_t cols, rows; /* rows: the largest of its tensors, capped to PROBE_W_BYTES */
    void *d;
} probe_weight;

typedef struct {
    st_backend *be;
    st_stream *s;
    void *bufs[PROBE_MAX_W + 8];
    int n_bufs;
    void *zeros;        /* host, ZERO_BYTES */
} probe_ctx;

#define ZERO_BYTES ((size_t)16 << 20)

/* A zeroed device buffer of n bytes, freed by probe_free. */
static strata_status probe_alloc(probe_ctx *p, size_t n, void **out) {
    const st_backend_ops *o = p->be->ops;
    strata_status st = o->alloc(p->be, n, out);
    if (st != STRATA_OK) return st;
    p->bufs[p->n_bufs++] = *out;
    for (size_t off = 0; off < n; off += ZERO_BYTES)
        if ((st = o->copy_h2d(p->be, p->s, (uint8_t *)*out + off, p->zeros, n - off < ZERO_BYTES ? n - off : ZERO_BYTES)))
            return st;
    return o->stream_sync(p->be, p->s);
}

static void probe_free(probe_ctx *p) {
    for (int i = 0; i < p->n_bufs; i++) p->be->ops->dealloc(p->be, p->bufs[i]);
    p->n_bufs = 0;
    free(p->zeros);
    p->zeros = NULL;
}

/* The probe weight holding tensor d's dtype and width, as a weight of d's rows (capped). */
static st_weight probe_w(const probe_weight *pw, int npw, const st_tensor_desc *d) {
    st_weight w = {0};
    for (int i = 0; i < npw; i++)
        if (pw[i].dtype == d->dtype && pw[i].cols == d->shape[1]) {
            w.data = pw[i].d;
            w.dtype = d->dtype;
            w.cols = d->shape[1];
            w.rows = d->shape[0] < pw[i].rows ? d->shape[0] : pw[i].rows;
        }
    return w;
}

static strata_status scratch_probe_run(probe_ctx *p, const st_config *c, const st_wgroups *g, int64_t T,
                                       int64_t max_ctx, bool seq_kv, bool paged, size_t *scratch) {
    st_backend *be = p->be;
    const st_backend_ops *o = be->ops;
    const int64_t H = c->hidden_size, hd = c->head_dim, q_dim = c->n_heads * hd, kv_dim = c->n_kv_heads * hd,
                  V = c->vocab_size;
    strata_status st;
    /* the distinct (dtype, width) of the matrices */
    probe_weight pw[PROBE_MAX_W];
    int npw = 0;
    int64_t kmax = H > q_dim ? H : q_dim, nmax = q_dim;
    for (int i = 1; i < g->n; i++)
        for (int t = 0; t < g->g[i].n_tensors; t++) {
            const st_tensor_desc *d = g->g[i].t[t].desc;
            if (d->n_dims != 2) continue;
            const size_t rb = st_dtype_row_bytes(d->dtype, d->shape[1]);
            if (rb == 0) continue;
            int64_t rows = d->shape[0];
            if ((size_t)rows * rb > PROBE_W_BYTES) rows = (int64_t)(PROBE_W_BYTES / rb) / 64 * 64;
            if (rows < 64) rows = d->shape[0] < 64 ? d->shape[0] : 64;
            int k = 0;
            while (k < npw && !(pw[k].dtype == d->dtype && pw[k].cols == d->shape[1])) k++;
            if (k == npw) {
                if (npw == PROBE_MAX_W) continue;
                pw[npw++] = (probe_weight){d->dtype, d->shape[1], rows, NULL};
            } else if (rows > pw[k].rows) {
                pw[k].rows = rows;
            }
            if (d->shape[1] > kmax) kmax = d->shape[1];
            if (rows > nmax) nmax = rows;
        }
    const int64_t Ta = T < max_ctx ? T : max_ctx; /* tokens of the attention probes */
    size_t ysz = (size_t)(T * nmax);
    if ((size_t)(3 * nmax) > ysz) ysz = (size_t)(3 * nmax);
    if ((size_t)V > ysz) ysz = (size_t)V;
    float *x = NULL, *y = NULL, *kc = NULL, *vc = NULL;
    int32_t *meta = NULL;
    for (int i = 0; i < npw; i++)
        if ((st = probe_alloc(p, (size_t)pw[i].rows * st_dtype_row_bytes(pw[i].dtype, pw[i].cols), &pw[i].d)))
            return st;
    if ((st = probe_alloc(p, (size_t)(T * kmax) * 4, (void **)&x)) || (st = probe_alloc(p, ysz * 4, (void **)&y)))
        return st;
    /* int32 metadata: pos at the end of the context [Ta] | pos from 0 [Ta] | seq [Ta] zeros |
     * ctx_lens [1] | argmax out [1] | block table [max_blocks] */
    const int64_t bs = PLAN_KV_BLOCK, max_blocks = (max_ctx + bs - 1) / bs;
    const int64_t n_meta = 3 * Ta + 2 + max_blocks;
    if (seq_kv || paged) {
        const size_t kvb = (size_t)((paged ? max_blocks * bs : max_ctx) * kv_dim) * 4;
        if ((st = probe_alloc(p, kvb, (void **)&kc)) || (st = probe_alloc(p, kvb, (void **)&vc))) return st;
    }
    if ((st = probe_alloc(p, (size_t)n_meta * 4, (void **)&meta))) return st;
    int32_t *h = st_calloc((size_t)n_meta, sizeof *h);
    if (!h) return st_err(STRATA_ERR_NOMEM, "scratch probe: out of memory");
    for (int64_t i = 0; i < Ta; i++) {
        h[i] = (int32_t)(max_ctx - Ta + i);
        h[Ta + i] = (int32_t)i;
    }
    h[3 * Ta] = (int32_t)max_ctx;
    for (int64_t b = 0; b < max_blocks; b++) h[3 * Ta + 2 + b] = (int32_t)b;
    st = o->copy_h2d(be, p->s, meta, h, (size_t)n_meta * 4);
    if (st == STRATA_OK) st = o->stream_sync(be, p->s);
    st_free(h);
    if (st != STRATA_OK) return st;
    const int32_t *pos_end = meta, *pos_0 = meta + Ta, *seq = meta + 2 * Ta, *ctx_lens = meta + 3 * Ta;
    int32_t *amax = meta + 3 * Ta + 1;
    const int32_t *tables = meta + 3 * Ta + 2;

    /* the ops, in the order a prefill chunk and then decode steps run them */
    st_budget *bud = &be->device_budget;
    const size_t u0 = bud->used, saved_peak = bud->peak;
    bud->peak = bud->used;
    const int64_t ns[2] = {T, 1};
    for (int r = 0; r < 2 && st == STRATA_OK; r++)
        for (int i = 0; i < npw && st == STRATA_OK; i++) {
            const st_weight w = {pw[i].d, pw[i].dtype, pw[i].rows, pw[i].cols};
            st = o->matmul(be, p->s, x, &w, ns[r], y);
        }
    const float scale = 1.0f / sqrtf((float)hd);
    if (st == STRATA_OK && seq_kv) { /* a chunk at the end of the context, a chunk at its start, a decode step */
        st = o->attention(be, p->s, x, kc, vc, pos_end, Ta, max_ctx, c->n_heads, c->n_kv_heads, hd, scale, y);
        if (st == STRATA_OK)
            st = o->attention(be, p->s, x, kc, vc, pos_0, Ta, Ta, c->n_heads, c->n_kv_heads, hd, scale, y);
        if (st == STRATA_OK)
            st = o->attention(be, p->s, x, kc, vc, pos_end + Ta - 1, 1, max_ctx, c->n_heads, c->n_kv_heads, hd,
                              scale, y);
    }
    if (st == STRATA_OK && paged) {
        const st_paged_kv pk = {.cache = {.k = (void *)kc, .v = (void *)vc, .dtype = ST_KV_F32,
                                          .n_slots = max_blocks * bs, .n_kv_heads = c->n_kv_heads, .head_dim = hd},
                                .block_size = bs,
                                .block_tables = tables, .max_blocks = max_blocks, .ctx_lens = ctx_lens,
                                .n_seqs = 1, .max_ctx = max_ctx};
        st = o->attention_paged(be, p->s, x, &pk, seq, pos_end, Ta, c->n_heads, c->n_kv_heads, hd, scale, y);
        if (st == STRATA_OK)
            st = o->attention_paged(be, p->s, x, &pk, seq, pos_end + Ta - 1, 1, c->n_heads, c->n_kv_heads, hd, scale,
                                    y);
    }
    if (st == STRATA_OK && c->n_layers > 0) { /* the decode step's fused matmuls (layer 0's shapes) */
        const st_wgroup *a = &g->g[st_wg_attn_id(0)], *f = &g->g[st_wg_ffn_id(0)];
        const st_weight qkv[3] = {probe_w(pw, npw, a->t[ST_WG_WQ].desc), probe_w(pw, npw, a->t[ST_WG_WK].desc),
                                  probe_w(pw, npw, a->t[ST_WG_WV].desc)};
        const st_weight wg = probe_w(pw, npw, f->t[ST_WG_GATE].desc), wu = probe_w(pw, npw, f->t[ST_WG_UP].desc);
        if (qkv[0].data && qkv[1].data && qkv[2].data && qkv[0].cols == qkv[1].cols && qkv[0].cols == qkv[2].cols) {
            float *const ys[3] = {y, y + qkv[0].rows, y + qkv[0].rows + qkv[1].rows};
            st = o->matmul_multi(be, p->s, x, qkv, 3, 1, ys);
        }
        if (st == STRATA_OK && wg.data && wu.data && wg.dtype == wu.dtype && wg.cols == wu.cols) {
            st_weight wg2 = wg, wu2 = wu; /* one shape for both */
            wg2.rows = wu2.rows = wg.rows < wu.rows ? wg.rows : wu.rows;
            st = o->matmul_swiglu(be, p->s, x, &wg2, &wu2, 1, y);
        }
    }
    if (st == STRATA_OK) st = o->argmax(be, p->s, y, 1, V, amax);
    if (st == STRATA_OK) st = o->stream_sync(be, p->s);
    *scratch = bud->peak > u0 ? bud->peak - u0 : 0;
    bud->peak = saved_peak;
    return st;
}

/* Device bytes to keep for the backend's scratch: 3x the measured scratch
 * (a scratch buffer grows by at least 1.5x at a time and frees the old one,
 * so the holes its earlier sizes leave in the pool add up to at most twice
 * its final size), plus 4 MiB for ops the probe does not run (each scratch
 * buffer is at least 1 MiB). CPU: its scratch lives outside the arena (0),
 * and the probe runs only when STRATA_SCRATCH_PROBE=1 (tests). A probe that
 * does not fit in the budget leaves the estimate from the shapes alone.
 * Without a device budget nothing is reserved (every weight is resident). */
static size_t device_reserve_estimate(st_backend *be, const st_config *c, const st_wgroups *g, int64_t T,
                                      int64_t max_ctx, const st_llama_params *lp) {
    const bool cpu = be->kind == ST_BACKEND_CPU;
    const char *force = getenv("STRATA_SCRATCH_PROBE");
    if (be->device_budget.cap == 0 || (cpu && !(force && !strcmp(force, "1")))) return 0; /* no budget: no plan */
    probe_ctx p = {be, NULL, {0}, 0, NULL};
    size_t scratch = 0;
    strata_status st = STRATA_OK;
    if (!(p.zeros = calloc(1, ZERO_BYTES))) st = st_err(STRATA_ERR_NOMEM, "scratch probe: out of memory");
    if (st == STRATA_OK) st = be->ops->stream_create(be, false, &p.s);
    if (st == STRATA_OK)
        st = scratch_probe_run(&p, c, g, T, max_ctx, !lp->no_seq_kv, lp->kv_pool_tokens > 0 || lp->no_seq_kv,
                               &scratch);
    if (p.s) {
        (void)be->ops->stream_sync(be, p.s);
        probe_free(&p); /* the buffers, then the stream and its scratch */
        be->ops->stream_destroy(be, p.s);
    } else {
        probe_free(&p);
    }
    if (st == STRATA_OK) {
        st_log(STRATA_LOG_DEBUG, "backend scratch measured: %zu bytes (batch %lld, context %lld)", scratch,
               (long long)T, (long long)max_ctx);
        return cpu && scratch == 0 ? 0 : 3 * scratch + ((size_t)4 << 20);
    }
    if (cpu) return 0;
    int64_t K = c->hidden_size;
    if (c->intermediate_size > K) K = c->intermediate_size;
    if (c->n_heads * c->head_dim > K) K = c->n_heads * c->head_dim;
    const size_t est = ((size_t)128 << 20) + 3 * (size_t)(T * K) * 4;
    st_log(STRATA_LOG_WARN, "backend scratch probe failed (%s); reserving %zu bytes from the shapes", st_last_error(),
           est);
    return est;
}

/* The placement for this model on `be` (bandwidths measured when `measure`
 * and not given). */
static strata_status make_plan(const st_model_files *files, st_backend *be, const st_config *c, int64_t max_ctx,
                               int64_t T, const st_llama_params *lp, const st_wgroups *g, bool measure,
                               st_wplan *plan) {
    const st_llama_weight_opts *wo = &lp->weights;
    st_wplan_params pp;
    memset(&pp, 0, sizeof pp);
    pp.device_mem = be->device_budget.cap;
    pp.host_mem = wo->host_mem ? wo->host_mem : st_wplan_host_auto();
    device_needs(c, max_ctx, T, lp, &pp.device_kv, &pp.device_act);
    pp.device_reserve = wo->device_reserve ? wo->device_reserve : device_reserve_estimate(be, c, g, T, max_ctx, lp);
    pp.ring_slots = wo->ring_slots;
    pp.staging_chunk = wo->staging_chunk;
    pp.staging_chunks = wo->staging_chunks;
    pp.max_batch = T;
    pp.prefill_tokens = wo->prefill_tokens;
    for (int i = 1; i < g->n; i++)
        for (int t = 0; t < g->g[i].n_tensors; t++) {
            const st_tensor_desc *d = g->g[i].t[t].desc;
            if (d->n_dims == 2) pp.flops_per_token += 2.0 * (double)d->shape[0] * (double)d->shape[1];
        }
    pp.attn_flops = 4.0 * (double)c->n_heads * (double)c->head_dim * (double)c->n_layers;
    pp.bw = wo->bw;
    pp.force = wo->placement;
    if (measure && (pp.bw.h2d <= 0 || pp.bw.ssd <= 0 || pp.bw.dev_read <= 0 || pp.bw.gemm <= 0)) {
        strata_status st = st_wbw_measure(be, files, g, T, !wo->stream.no_direct, &pp.bw);
        if (st != STRATA_OK) return st;
    }
    return st_wplan_make(g, &pp, plan);
}

static int64_t default_ctx(const st_config *c, const st_llama_params *p) {
    return p && p->max_ctx > 0 ? p->max_ctx
           : (c->max_position_embeddings > 0 && c->max_position_embeddings < 4096 ? c->max_position_embeddings
                                                                                  : 4096);
}

strata_status st_llama_plan(const st_model_files *files, st_backend *be, const st_llama_params *params,
                            st_wgroups **groups, st_wplan *plan) {
    static const st_llama_params no_params;
    const st_llama_params *p = params ? params : &no_params;
    memset(plan, 0, sizeof *plan);
    *groups = NULL;
    const st_config *c = &files->config;
    const int64_t max_ctx = default_ctx(c, p);
    int64_t T = p->max_batch > 0 ? p->max_batch : 512;
    if (T > max_ctx && !p->no_seq_kv) T = max_ctx;
    strata_status st = st_wgroups_build(files, groups);
    if (st == STRATA_OK) st = make_plan(files, be, c, max_ctx, T, p, *groups, true, plan);
    if (st != STRATA_OK) {
        st_wgroups_free(*groups);
        *groups = NULL;
    }
    return st;
}

st_wm *st_llama_weights(st_llama *m) { return m->wm; }

strata_status st_llama_init(const st_model_files *files, st_backend *be,
                            const st_llama_params *params, st_llama **out) {
    *out = NULL;
    static const st_llama_params no_params;
    const st_llama_params *opts = params ? params : &no_params;
    st_llama *m = st_calloc(1, sizeof *m);
    if (!m) return st_err(STRATA_ERR_NOMEM, "out of memory");
    m->files = files;
    m->be = be;
    m->cfg = files->config;
    const st_config *c = &m->cfg;
    m->max_ctx = default_ctx(c, params);
    m->max_batch = params && params->max_batch > 0 ? params->max_batch : 512;
    if (m->max_batch > m->max_ctx && !opts->no_seq_kv) m->max_batch = m->max_ctx; /* a batch may hold several sequences */
    strata_status st;
    const int64_t H = c->hidden_size, q_dim = c->n_heads * c->head_dim,
                  kv_dim = c->n_kv_heads * c->head_dim, I = c->intermediate_size,
                  V = c->vocab_size, T = m->max_batch;
    if (c->head_dim % 2) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: odd head_dim %lld", files->path, (long long)c->head_dim);
        goto fail;
    }
    if ((st = be->ops->stream_create(be, false, &m->stream))) goto fail;

    /* weights: groups, shapes, placement, manager */
    if ((st = st_wgroups_build(files, &m->groups))) goto fail;
    m->wshape = st_calloc((size_t)m->groups->n, sizeof *m->wshape);
    if (!m->wshape) { st = st_err(STRATA_ERR_NOMEM, "out of memory"); goto fail; }
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
        const st_llama_weight_opts *wo = &opts->weights;
        st_wplan plan;
        const bool measure = be->device_budget.cap > 0 || wo->placement;
        if ((st = make_plan(files, be, c, m->max_ctx, T, opts, m->groups, measure, &plan))) goto fail;
        st_wm_params wp = wo->stream;
        wp.host_mem = plan.host_mem;
        st = st_wm_init(be, files, m->groups, &plan, &wp, &m->wm);
        st_wplan_free(&plan);
        if (st) goto fail;
        /* a recorded decode step would hold the slots' pointers and cross-stream events */
        m->dec_no_graph = !st_wm_all_resident(m->wm);
    }
    {
        const char *bgv = getenv("STRATA_BATCH_GRAPH"); /* "0": batched passes never recorded */
        m->bg_off = bgv && !strcmp(bgv, "0");
    }

    m->layers = st_calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) { st = st_err(STRATA_ERR_NOMEM, "out of memory"); goto fail; }
    m->no_seq_kv = opts->no_seq_kv;
    for (int64_t l = 0; l < c->n_layers && !m->no_seq_kv; l++) {
        llama_layer *L = &m->layers[l];
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
    if (m->stream) (void)be->ops->stream_sync(be, m->stream); /* nothing may still read a slot */
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
    st_wm_free(m->wm);
    st_free(m->wshape);
    st_wgroups_free(m->groups);
    be->ops->graph_destroy(be, m->dec_graph);
    for (int i = 0; i < BG_SLOTS; i++) be->ops->graph_destroy(be, m->bg[i].g);
    if (m->d_dec) be->ops->dealloc(be, m->d_dec);
    if (m->d_qkv) be->ops->dealloc(be, m->d_qkv);
    if (m->h_dec) be->ops->host_dealloc(be, m->h_dec);
    if (m->d_sargs) be->ops->dealloc(be, m->d_sargs);
    if (m->d_sids) be->ops->dealloc(be, m->d_sids);
    if (m->h_sargs) be->ops->host_dealloc(be, m->h_sargs);
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

/* Attention group of layer l for n tokens at positions n_past.. (in m->d_pos).
 * On entry m->x is the residual stream and m->tmp (when residual_pending) the
 * previous group's output still to be added; on exit m->tmp holds o_proj's output. */
static strata_status attn_ops(st_llama *m, const st_weight *w, const llama_layer *L, int64_t n, int64_t n_past,
                              bool residual_pending) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, hd = c->head_dim, kv_dim = c->n_kv_heads * hd;
    TRY(o->rmsnorm(be, m->stream, m->x, residual_pending ? m->tmp : NULL, &w[ST_WG_ATTN_NORM],
                   c->rms_norm_eps, n, H, m->xn));
    TRY(o->matmul(be, m->stream, m->xn, &w[ST_WG_WQ], n, m->q));
    TRY(o->matmul(be, m->stream, m->xn, &w[ST_WG_WK], n, m->k));
    TRY(o->matmul(be, m->stream, m->xn, &w[ST_WG_WV], n, m->v));
    TRY(o->rope(be, m->stream, m->q, m->d_pos, n, c->n_heads, hd, m->inv_freq, c->rope_interleaved));
    TRY(o->rope(be, m->stream, m->k, m->d_pos, n, c->n_kv_heads, hd, m->inv_freq, c->rope_interleaved));
    const size_t row = (size_t)kv_dim * sizeof(float);
    TRY(o->copy_d2d(be, m->stream, L->k_cache + n_past * kv_dim, m->k, (size_t)n * row));
    TRY(o->copy_d2d(be, m->stream, L->v_cache + n_past * kv_dim, m->v, (size_t)n * row));
    TRY(o->attention(be, m->stream, m->q, L->k_cache, L->v_cache, m->d_pos, n, n_past + n,
                     c->n_heads, c->n_kv_heads, hd, 1.0f / sqrtf((float)hd), m->att));
    TRY(o->matmul(be, m->stream, m->att, &w[ST_WG_WO], n, m->tmp));
    return STRATA_OK;
}

static strata_status attn_group(st_llama *m, int64_t l, int64_t n, int64_t n_past, bool residual_pending) {
    bound_group b;
    TRY(group_acquire(m, st_wg_attn_id((int)l), &b));
    return group_release(m, &b, attn_ops(m, b.w, &m->layers[l], n, n_past, residual_pending));
}

/* FFN group: x += tmp (attention output); xn = norm(x); tmp = down(silu(gate) * up). */
static strata_status ffn_ops(st_llama *m, const st_weight *w, int64_t n) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, I = c->intermediate_size;
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &w[ST_WG_FFN_NORM], c->rms_norm_eps, n, H, m->xn));
    TRY(o->matmul(be, m->stream, m->xn, &w[ST_WG_GATE], n, m->gate));
    TRY(o->matmul(be, m->stream, m->xn, &w[ST_WG_UP], n, m->up));
    TRY(o->swiglu(be, m->stream, m->gate, m->up, n * I, m->gate));
    TRY(o->matmul(be, m->stream, m->gate, &w[ST_WG_DOWN], n, m->tmp));
    return STRATA_OK;
}

static strata_status ffn_group(st_llama *m, int64_t l, int64_t n) {
    bound_group b;
    TRY(group_acquire(m, st_wg_ffn_id((int)l), &b));
    return group_release(m, &b, ffn_ops(m, b.w, n));
}

/* Output group: x += tmp; xn = norm(x); logits[n_out, V] = xn[src rows] @ lm_head^T. */
static strata_status output_ops(st_llama *m, const st_weight *w, int64_t n, int64_t n_out, const float *src) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &w[ST_WG_OUT_NORM], c->rms_norm_eps, n, c->hidden_size, m->xn));
    return o->matmul(be, m->stream, src, &w[ST_WG_LM_HEAD], n_out, m->logits);
}

static strata_status output_group(st_llama *m, int64_t n, int64_t n_out, const float *src) {
    bound_group b;
    TRY(group_acquire(m, st_wg_output_id(m->groups), &b));
    return group_release(m, &b, output_ops(m, b.w, n, n_out, src));
}

/* x[n, H] = the embedding rows of tokens (host ids; d_tokens holds them on
 * the device) */
static strata_status embed_rows(st_llama *m, const int32_t *tokens, int64_t n) {
    st_weight w;
    const int32_t *ids = NULL;
    TRY(st_wm_embed(m->wm, m->stream, tokens, n, &w, &ids));
    return m->be->ops->get_rows(m->be, m->stream, &w, ids ? ids : m->d_tokens, n, m->x);
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
    TRY(st_wm_begin(m->wm));
    for (int64_t i = 0; i < n; i++) m->h_pos[i] = (int32_t)(n_past + i);
    TRY(o->copy_h2d(be, m->stream, m->d_tokens, tokens, (size_t)n * sizeof(int32_t)));
    TRY(o->copy_h2d(be, m->stream, m->d_pos, m->h_pos, (size_t)n * sizeof(int32_t)));
    TRY(embed_rows(m, tokens, n));
    for (int64_t l = 0; l < c->n_layers; l++) {
        TRY(attn_group(m, l, n, n_past, l > 0));
        TRY(ffn_group(m, l, n));
    }
    if (mode == LOGITS_NONE) return STRATA_OK; /* the KV is what this chunk was for */
    const int64_t n_out = mode == LOGITS_ALL ? n : 1;
    const float *src = mode == LOGITS_ALL ? m->xn : m->xn + (n - 1) * H;
    TRY(output_group(m, n, n_out, src));
    TRY(o->copy_d2h(be, m->stream, logits, m->logits, (size_t)(n_out * V) * sizeof(float)));
    return o->stream_sync(be, m->stream); /* the caller reads logits now */
}

/* ---- single-token decode ------------------------------------------------------------
 * One token at position n_past, recorded once as a backend graph (a CUDA
 * graph) and replayed for every later token, so that a step costs one launch
 * and one host sync instead of ~15 launches per layer. Everything that
 * changes from step to step is read on the device when the step runs: the
 * token and its position come from pinned host memory (h_dec, copied by the
 * step itself), the K/V rows are stored at that position (set_rows), and
 * attention is given the cache's capacity as n_kv and sees keys 0..pos (the
 * split of the keys over blocks is derived on the device). The step ends with
 * the argmax of the logits copied back (4 bytes); the logits stay on the
 * device unless the caller asks for them.
 * The first step runs without a graph (it sizes the backend's scratch and
 * loads its kernels); the second is recorded. When recording fails (an op
 * that cannot be recorded) the step runs directly and recording is retried,
 * at most 3 times. Backends without graphs (CPU) run every step directly.
 * The recording holds the weights' device pointers, so a step is recorded
 * only when every weight is resident (st_wm_all_resident); with streamed
 * weights every step runs directly, acquiring each group from the manager
 * (ring slots change from step to step and wait on the copy stream's
 * events). */

static strata_status decode_buffers(st_llama *m) {
    if (m->h_dec) return STRATA_OK;
    st_backend *be = m->be;
    const st_config *c = &m->cfg;
    const int64_t qkv = (c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
    strata_status st = be->ops->alloc(be, 4 * sizeof(int32_t), (void **)&m->d_dec);
    if (!st) st = alloc_f32(m, qkv, &m->d_qkv);
    if (!st) st = be->ops->host_alloc(be, 4 * sizeof(int32_t), (void **)&m->h_dec);
    if (st) return st;
    memset(m->h_dec, 0, 4 * sizeof(int32_t));
    return STRATA_OK;
}

/* Enqueues the step for the token and position in m->h_dec[0..1]; leaves the
 * logits in m->logits and their argmax in m->h_dec[2] (once the stream is
 * synchronized). */
static strata_status decode_attn_ops(st_llama *m, const st_weight *w, int64_t l) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    st_stream *s = m->stream;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, hd = c->head_dim, q_dim = c->n_heads * hd, kv_dim = c->n_kv_heads * hd;
    const llama_layer *L = &m->layers[l];
    float *q = m->d_qkv, *k = q + q_dim, *v = k + kv_dim;
    /* attention: x (+ the previous FFN's output) -> norm -> q|k|v -> rope
     * (q and k heads are adjacent: one call) -> cache -> attention -> o */
    TRY(o->rmsnorm(be, s, m->x, l > 0 ? m->tmp : NULL, &w[ST_WG_ATTN_NORM], c->rms_norm_eps, 1, H, m->xn));
    const st_weight wqkv[3] = {w[ST_WG_WQ], w[ST_WG_WK], w[ST_WG_WV]};
    float *const yqkv[3] = {q, k, v};
    TRY(o->matmul_multi(be, s, m->xn, wqkv, 3, 1, yqkv));
    TRY(o->rope(be, s, q, m->d_pos, 1, c->n_heads + c->n_kv_heads, hd, m->inv_freq, c->rope_interleaved));
    TRY(o->set_rows(be, s, L->k_cache, m->max_ctx, k, m->d_pos, 1, kv_dim));
    TRY(o->set_rows(be, s, L->v_cache, m->max_ctx, v, m->d_pos, 1, kv_dim));
    TRY(o->attention(be, s, q, L->k_cache, L->v_cache, m->d_pos, 1, m->max_ctx, c->n_heads,
                     c->n_kv_heads, hd, 1.0f / sqrtf((float)hd), m->att));
    return o->matmul(be, s, m->att, &w[ST_WG_WO], 1, m->tmp);
}

static strata_status decode_ffn_ops(st_llama *m, const st_weight *w) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    st_stream *s = m->stream;
    const st_config *c = &m->cfg;
    /* FFN: x += attention output -> norm -> silu(gate) * up -> down */
    TRY(o->rmsnorm(be, s, m->x, m->tmp, &w[ST_WG_FFN_NORM], c->rms_norm_eps, 1, c->hidden_size, m->xn));
    TRY(o->matmul_swiglu(be, s, m->xn, &w[ST_WG_GATE], &w[ST_WG_UP], 1, m->gate));
    return o->matmul(be, s, m->gate, &w[ST_WG_DOWN], 1, m->tmp);
}

static strata_status decode_enqueue(st_llama *m) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    st_stream *s = m->stream;
    const st_config *c = &m->cfg;
    bound_group b;
    TRY(o->copy_h2d(be, s, m->d_tokens, m->h_dec, sizeof(int32_t)));
    TRY(o->copy_h2d(be, s, m->d_pos, m->h_dec + 1, sizeof(int32_t)));
    TRY(embed_rows(m, m->h_dec, 1));
    for (int64_t l = 0; l < c->n_layers; l++) {
        TRY(group_acquire(m, st_wg_attn_id((int)l), &b));
        TRY(group_release(m, &b, decode_attn_ops(m, b.w, l)));
        TRY(group_acquire(m, st_wg_ffn_id((int)l), &b));
        TRY(group_release(m, &b, decode_ffn_ops(m, b.w)));
    }
    TRY(output_group(m, 1, 1, m->xn));
    TRY(o->argmax(be, s, m->logits, 1, c->vocab_size, m->d_dec + 2));
    TRY(o->copy_d2h(be, s, m->h_dec + 2, m->d_dec + 2, sizeof(int32_t)));
    return STRATA_OK;
}

/* Runs `token` at position m->n_past; logits (host [vocab]) and next (the
 * argmax) are optional outputs. The caller validated the token and the room. */
static strata_status decode_step(st_llama *m, int32_t token, float *logits, int32_t *next) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    TRY(st_wm_begin(m->wm));
    TRY(decode_buffers(m));
    m->h_dec[0] = token;
    m->h_dec[1] = (int32_t)m->n_past;
    if (m->dec_graph && be->device_budget.takes != m->dec_takes) {
        /* something was allocated since the recording: one of the stream's
         * scratch buffers may have grown and moved; record again */
        o->graph_destroy(be, m->dec_graph);
        m->dec_graph = NULL;
    }
    if (!m->dec_graph && !m->dec_no_graph && m->dec_steps > 0 && m->dec_graph_fails < 3) {
        strata_status st = o->graph_begin(be, m->stream);
        if (st == STRATA_ERR_UNSUPPORTED) {
            m->dec_no_graph = true;
        } else if (st == STRATA_OK) {
            st_graph *g = NULL;
            st = decode_enqueue(m);
            strata_status st2 = o->graph_end(be, m->stream, st == STRATA_OK ? &g : NULL);
            if (st == STRATA_OK && st2 == STRATA_OK && g) {
                m->dec_graph = g;
                m->dec_takes = be->device_budget.takes;
                st_log(STRATA_LOG_INFO, "decode step recorded as a graph (replayed for every token)");
            } else {
                o->graph_destroy(be, g);
                m->dec_graph_fails++;
                st_log(STRATA_LOG_DEBUG, "decode step not recorded (try %d): %s", m->dec_graph_fails,
                       st_last_error());
            }
        } else {
            m->dec_graph_fails++;
        }
    }
    if (m->dec_graph) TRY(o->graph_launch(be, m->stream, m->dec_graph));
    else TRY(decode_enqueue(m));
    if (logits)
        TRY(o->copy_d2h(be, m->stream, logits, m->logits, (size_t)m->cfg.vocab_size * sizeof(float)));
    TRY(o->stream_sync(be, m->stream)); /* the one host sync of the step */
    if (next) *next = m->h_dec[2];
    m->dec_steps++;
    m->n_past++;
    return STRATA_OK;
}

const char *st_llama_decode_mode(const st_llama *m) {
    if (m->dec_graph) return "graph";
    if (m->dec_no_graph) return "direct (no graphs: CPU backend or streamed weights)";
    if (m->dec_graph_fails >= 3) return "direct (recording failed)";
    return "direct (not recorded yet)";
}

strata_status st_llama_decode(st_llama *m, int32_t token, float *logits, int32_t *next) {
    const st_config *c = &m->cfg;
    if (m->no_seq_kv)
        return st_err(STRATA_ERR_UNSUPPORTED, "decode: this model has no single-sequence KV cache (no_seq_kv)");
    if (m->n_past + 1 > m->max_ctx)
        return st_err(STRATA_ERR_INVALID_ARG, "decode: the context of %lld tokens is full (--ctx)",
                      (long long)m->max_ctx);
    if (token < 0 || token >= c->vocab_size)
        return st_err(STRATA_ERR_INVALID_ARG, "decode: token %lld is outside the vocabulary [0, %lld)",
                      (long long)token, (long long)c->vocab_size);
    return decode_step(m, token, logits, next);
}

strata_status st_llama_forward(st_llama *m, const int32_t *tokens, int64_t n, int64_t n_past,
                               bool all_logits, float *logits) {
    const st_config *c = &m->cfg;
    if (m->no_seq_kv)
        return st_err(STRATA_ERR_UNSUPPORTED, "forward: this model has no single-sequence KV cache (no_seq_kv)");
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
    if (n == 1 && !all_logits) return decode_step(m, tokens[0], logits, NULL);
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

/* ---- batched forward over a paged KV cache ------------------------------------------
 * A batch's metadata is packed into the pool's pinned staging buffer, copied
 * to the device in one transfer, and read there by the ops (token ids,
 * positions, sequence indices, slots, block tables, context lengths, the rows
 * that need logits). The layout is fixed (T = the model's max_batch, B = the
 * pool's max_blocks), so that the device addresses of every field are the
 * same for every batch and a recorded pass (batch_run) reads the new values:
 *   int64 slots[T] | int32 tokens[T] | pos[T] | seq[T] | logit_rows[T] |
 *   ctx_lens[T] | block_tables[T * B]
 * Only the batch's entries are written (ctx_lens past its sequences are 0:
 * sequences with no keys, never referenced by a token); the copy covers the
 * table rows of its sequences. Attention is told n_seqs = T and a context
 * bound rounded up to a bucket (batch_ctx_bucket), which changes nothing in
 * a token's arithmetic (backend.h: its reduction depends on its own keys).
 * The staging buffer is rewritten only by the next call, after this one's
 * final stream sync, so a copy still in flight never sees it change. */

struct st_kv_cache {
    st_llama *m;
    int64_t num_blocks, block_size, n_slots;
    int64_t max_blocks;     /* ceil(max_ctx / block_size): the widest table row */
    float **k, **v;         /* [n_layers] device [n_slots, kv_dim] */
    size_t meta_bytes;      /* capacity of h_meta / d_meta */
    void *h_meta;           /* pinned host staging */
    void *d_meta;           /* device */
};

static void bg_drop(st_llama *m, batch_graph *e);

static size_t meta_capacity(int64_t T, int64_t max_blocks) {
    return (size_t)T * 8 + ((size_t)4 * T + (size_t)T + (size_t)T * (size_t)max_blocks) * 4;
}

size_t st_kv_cache_device_bytes(const st_config *c, int64_t num_blocks, int64_t block_size, int64_t max_batch,
                                int64_t max_ctx) {
    if (num_blocks <= 0 || block_size <= 0) return 0;
    const int64_t kv_dim = c->n_kv_heads * c->head_dim;
    const size_t layer = r256((size_t)(num_blocks * block_size * kv_dim) * sizeof(float));
    return 2 * (size_t)c->n_layers * layer + r256(meta_capacity(max_batch, (max_ctx + block_size - 1) / block_size));
}

strata_status st_kv_cache_init(st_llama *m, const st_kv_cache_params *p, st_kv_cache **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "kv cache: out is NULL");
    *out = NULL;
    if (!m || !p) return st_err(STRATA_ERR_INVALID_ARG, "kv cache: no model or params");
    if (p->num_blocks < 1 || p->block_size < 1 || p->num_blocks > INT32_MAX ||
        p->num_blocks > INT64_MAX / 4 / p->block_size)
        return st_err(STRATA_ERR_INVALID_ARG, "kv cache: num_blocks = %lld, block_size = %lld (both >= 1, ids int32)",
                      (long long)p->num_blocks, (long long)p->block_size);
    st_backend *be = m->be;
    const st_config *c = &m->cfg;
    st_kv_cache *kv = st_calloc(1, sizeof *kv);
    if (!kv) return st_err(STRATA_ERR_NOMEM, "kv cache: out of memory");
    kv->m = m;
    kv->num_blocks = p->num_blocks;
    kv->block_size = p->block_size;
    kv->n_slots = p->num_blocks * p->block_size;
    kv->max_blocks = (m->max_ctx + p->block_size - 1) / p->block_size;
    strata_status st = STRATA_OK;
    kv->k = st_calloc((size_t)c->n_layers, sizeof *kv->k);
    kv->v = st_calloc((size_t)c->n_layers, sizeof *kv->v);
    if (!kv->k || !kv->v) {
        st = st_err(STRATA_ERR_NOMEM, "kv cache: out of memory");
        goto fail;
    }
    const int64_t kv_dim = c->n_kv_heads * c->head_dim;
    for (int64_t l = 0; l < c->n_layers; l++) {
        if ((st = alloc_f32(m, kv->n_slots * kv_dim, &kv->k[l])) || (st = alloc_f32(m, kv->n_slots * kv_dim, &kv->v[l]))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            st = st_err(st, "kv cache of %lld blocks x %lld tokens (%.1f MiB per layer): %s", (long long)p->num_blocks,
                        (long long)p->block_size, (double)(2 * kv->n_slots * kv_dim * 4) / 1048576.0, msg);
            goto fail;
        }
    }
    kv->meta_bytes = meta_capacity(m->max_batch, kv->max_blocks);
    if ((st = be->ops->alloc(be, kv->meta_bytes, &kv->d_meta))) goto fail;
    if ((st = be->ops->host_alloc(be, kv->meta_bytes, &kv->h_meta))) goto fail;
    memset(kv->h_meta, 0, kv->meta_bytes); /* table entries a batch does not write are never read, but defined */
    *out = kv;
    return STRATA_OK;
fail:
    st_kv_cache_free(kv);
    return st;
}

void st_kv_cache_free(st_kv_cache *kv) {
    if (!kv) return;
    st_llama *m = kv->m;
    st_backend *be = m->be;
    (void)be->ops->stream_sync(be, m->stream); /* nothing may still use the pool */
    for (int i = 0; i < BG_SLOTS; i++) /* recorded passes over this pool hold its pointers */
        if (m->bg[i].used && m->bg[i].kv == kv) {
            bg_drop(m, &m->bg[i]);
            m->bg[i] = (batch_graph){0};
        }
    for (int64_t l = 0; l < m->cfg.n_layers; l++) {
        if (kv->k && kv->k[l]) be->ops->dealloc(be, kv->k[l]);
        if (kv->v && kv->v[l]) be->ops->dealloc(be, kv->v[l]);
    }
    if (kv->d_meta) be->ops->dealloc(be, kv->d_meta);
    if (kv->h_meta) be->ops->host_dealloc(be, kv->h_meta);
    st_free(kv->k);
    st_free(kv->v);
    st_free(kv);
}

int64_t st_kv_cache_num_blocks(const st_kv_cache *kv) { return kv->num_blocks; }
int64_t st_kv_cache_block_size(const st_kv_cache *kv) { return kv->block_size; }
int64_t st_llama_max_batch(const st_llama *m) { return m->max_batch; }

/* Device views of one batch's metadata (in kv->d_meta). */
typedef struct {
    const int64_t *slots;
    const int32_t *tokens, *pos, *seq, *logit_rows;
    st_paged_kv pk;      /* k_cache / v_cache set per layer */
} batch_dev;

#define BAD(...) return st_err(STRATA_ERR_INVALID_ARG, "forward_batch: " __VA_ARGS__)

static strata_status batch_check(const st_llama *m, const st_kv_cache *kv, const st_batch *b) {
    const int64_t n = b->n_tokens, bs = kv->block_size;
    if (n < 1 || n > m->max_batch) BAD("%lld tokens (1 to max_batch = %lld)", (long long)n, (long long)m->max_batch);
    if (b->n_seqs < 1 || b->n_seqs > m->max_batch)
        BAD("%lld sequences (1 to max_batch = %lld)", (long long)b->n_seqs, (long long)m->max_batch);
    if (b->max_blocks < 1 || b->max_blocks > kv->max_blocks)
        BAD("max_blocks = %lld (1 to %lld: max_ctx %lld / block_size %lld)", (long long)b->max_blocks,
            (long long)kv->max_blocks, (long long)m->max_ctx, (long long)bs);
    if (b->n_logits < 0 || b->n_logits > n) BAD("n_logits = %lld of %lld tokens", (long long)b->n_logits, (long long)n);
    if (!b->tokens || !b->pos || !b->seq || !b->slots || !b->block_tables || !b->ctx_lens ||
        (b->n_logits > 0 && !b->logit_rows))
        BAD("a NULL array");
    for (int64_t s = 0; s < b->n_seqs; s++) {
        const int64_t len = b->ctx_lens[s];
        if (len < 1 || len > m->max_ctx || len > b->max_blocks * bs)
            BAD("ctx_lens[%lld] = %lld (1 to min(max_ctx = %lld, max_blocks * block_size = %lld))", (long long)s,
                (long long)len, (long long)m->max_ctx, (long long)(b->max_blocks * bs));
        const int32_t *row = b->block_tables + s * b->max_blocks;
        for (int64_t j = 0; j < (len + bs - 1) / bs; j++)
            if (row[j] < 0 || row[j] >= kv->num_blocks)
                BAD("block_tables[%lld][%lld] = %d is outside the pool's %lld blocks", (long long)s, (long long)j,
                    row[j], (long long)kv->num_blocks);
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
 * max_len keys: rounded up to 256-key ranges (the CUDA kernel's split), then
 * to a power of two up to 8 ranges and a multiple of 8 ranges above, capped
 * at the pool's table width. Recorded passes are keyed on it: a sequence that
 * grows changes the key every 2048 keys at most. */
static int64_t batch_ctx_bucket(const st_kv_cache *kv, int64_t max_len) {
    int64_t r = (max_len + 255) / 256;
    if (r < 1) r = 1;
    if (r <= 8) {
        int64_t p = 1;
        while (p < r) p *= 2;
        r = p;
    } else {
        r = (r + 7) / 8 * 8;
    }
    const int64_t cap = kv->max_blocks * kv->block_size;
    return r * 256 < cap ? r * 256 : cap;
}

/* Packs b into the staging buffer (the fixed layout above), copies it to the
 * device and points d at it. */
static strata_status batch_upload(st_llama *m, st_kv_cache *kv, const st_batch *b, batch_dev *d) {
    const int64_t n = b->n_tokens, T = m->max_batch, B = kv->max_blocks, S = b->n_seqs;
    uint8_t *h = kv->h_meta;
    const size_t o_tok = (size_t)T * 8, o_pos = o_tok + (size_t)T * 4, o_seq = o_pos + (size_t)T * 4,
                 o_lr = o_seq + (size_t)T * 4, o_ctx = o_lr + (size_t)T * 4, o_tab = o_ctx + (size_t)T * 4,
                 total = o_tab + (size_t)(S * B) * 4;
    ST_ASSERT(o_tab + (size_t)(T * B) * 4 <= kv->meta_bytes && S <= T && b->max_blocks <= B);
    memcpy(h, b->slots, (size_t)n * 8);
    memcpy(h + o_tok, b->tokens, (size_t)n * 4);
    memcpy(h + o_pos, b->pos, (size_t)n * 4);
    memcpy(h + o_seq, b->seq, (size_t)n * 4);
    if (b->n_logits) memcpy(h + o_lr, b->logit_rows, (size_t)b->n_logits * 4);
    memcpy(h + o_ctx, b->ctx_lens, (size_t)S * 4);
    memset(h + o_ctx + (size_t)S * 4, 0, (size_t)(T - S) * 4);
    int32_t *tab = (int32_t *)(h + o_tab);
    for (int64_t s = 0; s < S; s++) /* the rest of a row is never read (past its sequence's blocks) */
        memcpy(tab + s * B, b->block_tables + s * b->max_blocks, (size_t)b->max_blocks * 4);
    TRY(m->be->ops->copy_h2d(m->be, m->stream, kv->d_meta, h, total));
    const uint8_t *dm = kv->d_meta;
    int64_t max_len = 0;
    for (int64_t s = 0; s < S; s++)
        if (b->ctx_lens[s] > max_len) max_len = b->ctx_lens[s];
    d->slots = (const int64_t *)dm;
    d->tokens = (const int32_t *)(dm + o_tok);
    d->pos = (const int32_t *)(dm + o_pos);
    d->seq = (const int32_t *)(dm + o_seq);
    d->logit_rows = (const int32_t *)(dm + o_lr);
    d->pk = (st_paged_kv){.cache = {.dtype = ST_KV_F32, .n_slots = kv->n_slots, .n_kv_heads = m->cfg.n_kv_heads,
                                    .head_dim = m->cfg.head_dim},
                          .block_size = kv->block_size,
                          .block_tables = (const int32_t *)(dm + o_tab), .max_blocks = B,
                          .ctx_lens = (const int32_t *)(dm + o_ctx), .n_seqs = T,
                          .max_ctx = batch_ctx_bucket(kv, max_len), .batch_seqs = S};
    return STRATA_OK;
}

/* Attention group of layer l over the batch: as attn_ops, with the K/V rows
 * stored at the batch's slots and attention read through the block tables.
 * q, k and v in one matmul_multi (one launch where the backend can: the same
 * results as three matmuls). */
static strata_status attn_batch_ops(st_llama *m, const st_weight *w, st_kv_cache *kv, int64_t l, batch_dev *d,
                                    int64_t n, bool residual_pending) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size, hd = c->head_dim;
    TRY(o->rmsnorm(be, m->stream, m->x, residual_pending ? m->tmp : NULL, &w[ST_WG_ATTN_NORM], c->rms_norm_eps, n,
                   H, m->xn));
    const st_weight wqkv[3] = {w[ST_WG_WQ], w[ST_WG_WK], w[ST_WG_WV]};
    float *const yqkv[3] = {m->q, m->k, m->v};
    TRY(o->matmul_multi(be, m->stream, m->xn, wqkv, 3, n, yqkv));
    TRY(o->rope(be, m->stream, m->q, d->pos, n, c->n_heads, hd, m->inv_freq, c->rope_interleaved));
    TRY(o->rope(be, m->stream, m->k, d->pos, n, c->n_kv_heads, hd, m->inv_freq, c->rope_interleaved));
    d->pk.cache.k = kv->k[l];
    d->pk.cache.v = kv->v[l];
    TRY(o->kv_store_paged(be, m->stream, &d->pk.cache, m->k, m->v, d->slots, n));
    TRY(o->attention_paged(be, m->stream, m->q, &d->pk, d->seq, d->pos, n, c->n_heads, c->n_kv_heads, hd,
                           1.0f / sqrtf((float)hd), m->att));
    return o->matmul(be, m->stream, m->att, &w[ST_WG_WO], n, m->tmp);
}

/* FFN group over the batch: ffn_ops, with gate, up and SwiGLU as one
 * matmul_swiglu for fewer than 4 tokens (one GEMV launch on CUDA; the same
 * results; above, CUDA's matmul_swiglu would need a scratch copy of up). */
static strata_status ffn_batch_ops(st_llama *m, const st_weight *w, int64_t n) {
    if (n >= 4) return ffn_ops(m, w, n);
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &w[ST_WG_FFN_NORM], c->rms_norm_eps, n, c->hidden_size, m->xn));
    TRY(o->matmul_swiglu(be, m->stream, m->xn, &w[ST_WG_GATE], &w[ST_WG_UP], n, m->gate));
    return o->matmul(be, m->stream, m->gate, &w[ST_WG_DOWN], n, m->tmp);
}

/* Output group over the batch: x += tmp; xn = norm(x); logits[n_out, V] =
 * the rows logit_rows of xn (gathered into tmp unless they are all rows) @ lm_head^T. */
static strata_status output_batch_ops(st_llama *m, const st_weight *w, const batch_dev *d, int64_t n,
                                      int64_t n_out) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    const int64_t H = c->hidden_size;
    TRY(o->rmsnorm(be, m->stream, m->x, m->tmp, &w[ST_WG_OUT_NORM], c->rms_norm_eps, n, H, m->xn));
    const float *src = m->xn;
    if (n_out < n) { /* a gather through get_rows, xn seen as an fp32 table */
        const st_weight rows = {.data = m->xn, .dtype = ST_DTYPE_F32, .rows = n, .cols = H};
        TRY(o->get_rows(be, m->stream, &rows, d->logit_rows, n_out, m->tmp));
        src = m->tmp;
    }
    return o->matmul(be, m->stream, src, &w[ST_WG_LM_HEAD], n_out, m->logits);
}

/* The pass itself, from the metadata on the device (d) to the logits in
 * m->logits and, when `sample`, the sampled ids in m->h_sids (the args in
 * m->h_sargs). Everything it enqueues can be recorded as a graph when the
 * weights are resident: no host reads or writes but the pinned h_sargs /
 * h_sids, no allocation once the shape ran. `tokens` (host) is read only by
 * the embedding gather of streamed weights. */
static strata_status batch_ops(st_llama *m, st_kv_cache *kv, batch_dev *d, const int32_t *tokens, int64_t n,
                               int64_t n_logits, bool sample) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const st_config *c = &m->cfg;
    {   /* embedding */
        st_weight w;
        const int32_t *ids = NULL;
        TRY(st_wm_embed(m->wm, m->stream, tokens, n, &w, &ids));
        TRY(o->get_rows(be, m->stream, &w, ids ? ids : d->tokens, n, m->x));
    }
    bound_group g;
    for (int64_t l = 0; l < c->n_layers; l++) {
        TRY(group_acquire(m, st_wg_attn_id((int)l), &g));
        TRY(group_release(m, &g, attn_batch_ops(m, g.w, kv, l, d, n, l > 0)));
        TRY(group_acquire(m, st_wg_ffn_id((int)l), &g));
        TRY(group_release(m, &g, ffn_batch_ops(m, g.w, n)));
    }
    if (n_logits > 0) {
        TRY(group_acquire(m, st_wg_output_id(m->groups), &g));
        TRY(group_release(m, &g, output_batch_ops(m, g.w, d, n, n_logits)));
        if (sample) {
            const size_t na = (size_t)n_logits;
            TRY(o->copy_h2d(be, m->stream, m->d_sargs, m->h_sargs, na * sizeof(st_sample_args)));
            TRY(o->sample(be, m->stream, m->logits, n_logits, c->vocab_size, m->d_sargs, m->d_sids));
            TRY(o->copy_d2h(be, m->stream, m->h_sids, m->d_sids, na * sizeof(int32_t)));
        }
    }
    return STRATA_OK;
}

/* ---- recorded batched passes --------------------------------------------------------
 * batch_run replays, records or runs directly (llama.h: "Batched passes as
 * graphs"). Validity: a recording holds the scratch buffers' addresses of
 * the compute stream; a buffer grows (and moves) only through a device
 * allocation, which bumps be->device_budget.takes, so every recording is
 * dropped when takes changed since the last pass (the shapes stay known:
 * scratch only grows, so a known shape records without growing anything). */

static void bg_drop(st_llama *m, batch_graph *e) {
    if (e->g) {
        m->be->ops->graph_destroy(m->be, e->g);
        e->g = NULL;
        m->bg_stats.dropped++;
    }
}

static void bg_drop_all(st_llama *m) {
    for (int i = 0; i < BG_SLOTS; i++) bg_drop(m, &m->bg[i]);
}

void st_llama_set_batch_graphs(st_llama *m, bool on) {
    (void)m->be->ops->stream_sync(m->be, m->stream); /* no replay in flight */
    bg_drop_all(m);
    m->bg_off = !on;
}

void st_llama_batch_graph_stats(const st_llama *m, st_llama_graph_stats *out) { *out = m->bg_stats; }

/* The cache entry of this shape; a new one (the least recently used evicted)
 * when the shape is not known: *fresh = true then. */
static batch_graph *bg_find(st_llama *m, const st_kv_cache *kv, const batch_dev *d, int64_t n, int64_t n_logits,
                            bool sample, bool *fresh) {
    batch_graph *lru = &m->bg[0];
    *fresh = false;
    for (int i = 0; i < BG_SLOTS; i++) {
        batch_graph *e = &m->bg[i];
        if (e->used && e->kv == kv && e->n == n && e->n_logits == n_logits && e->max_ctx == d->pk.max_ctx &&
            e->sample == sample)
            return e;
        if (!e->used || (lru->used && e->last_use < lru->last_use)) lru = e;
    }
    bg_drop(m, lru);
    *lru = (batch_graph){.used = true, .n = n, .n_logits = n_logits, .max_ctx = d->pk.max_ctx, .sample = sample,
                         .kv = kv};
    *fresh = true;
    return lru;
}

static strata_status batch_run(st_llama *m, st_kv_cache *kv, batch_dev *d, const st_batch *b, bool sample) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const int64_t n = b->n_tokens, nl = b->n_logits;
    if (m->bg_off || n > BG_MAX_TOKENS || !st_wm_all_resident(m->wm)) {
        m->bg_stats.direct++;
        return batch_ops(m, kv, d, b->tokens, n, nl, sample);
    }
    if (be->device_budget.takes != m->bg_takes) { /* something was allocated: scratch may have moved */
        bool any = false;
        for (int i = 0; i < BG_SLOTS; i++) any = any || m->bg[i].g;
        if (any) {
            bg_drop_all(m);
            if (++m->bg_invalid > BG_MAX_DROPS) { /* allocations between steps, again and again */
                m->bg_off = true;
                st_log(STRATA_LOG_WARN, "batched passes: recorded graphs invalidated %d times by device "
                       "allocations between steps; running directly from now on", m->bg_invalid);
            }
        }
        m->bg_takes = be->device_budget.takes;
    }
    bool fresh = false;
    batch_graph *e = bg_find(m, kv, d, n, nl, sample, &fresh);
    e->last_use = ++m->bg_clock;
    if (!e->g && !fresh && e->fails < BG_MAX_FAILS && !m->bg_off) {
        strata_status st = o->graph_begin(be, m->stream);
        if (st == STRATA_ERR_UNSUPPORTED) {
            m->bg_off = true; /* CPU: every pass runs directly */
        } else if (st == STRATA_OK) {
            st_graph *g = NULL;
            st = batch_ops(m, kv, d, b->tokens, n, nl, sample);
            const strata_status st2 = o->graph_end(be, m->stream, st == STRATA_OK ? &g : NULL);
            if (st == STRATA_OK && st2 == STRATA_OK && g) {
                e->g = g;
                m->bg_stats.recorded++;
                st_log(STRATA_LOG_DEBUG, "batched pass recorded: %lld tokens, %lld logit rows, context bound %lld%s",
                       (long long)n, (long long)nl, (long long)d->pk.max_ctx, sample ? ", sampling" : "");
            } else {
                o->graph_destroy(be, g);
                e->fails++;
                m->bg_stats.failed++;
                st_log(STRATA_LOG_DEBUG, "batched pass of %lld tokens not recorded (try %d): %s", (long long)n,
                       e->fails, st_last_error());
            }
        } else {
            e->fails++;
            m->bg_stats.failed++;
        }
        /* a recording that allocated (none should) invalidates itself at the next pass */
    }
    if (e->g) {
        m->bg_stats.replays++;
        return o->graph_launch(be, m->stream, e->g);
    }
    m->bg_stats.direct++;
    return batch_ops(m, kv, d, b->tokens, n, nl, sample);
}

/* Enqueues the whole pass (forward_batch below synchronizes). logits: host
 * [n_logits, V] or NULL (not copied); args: host [n_logits] or NULL: the
 * sample op's ids land in m->h_sids. */
static strata_status forward_batch_enqueue(st_llama *m, st_kv_cache *kv, const st_batch *b, float *logits,
                                           const st_sample_args *args) {
    st_backend *be = m->be;
    const st_backend_ops *o = be->ops;
    const int64_t V = m->cfg.vocab_size;
    const bool sample = args && b->n_logits > 0;
    TRY(st_wm_begin(m->wm));
    batch_dev d;
    TRY(batch_upload(m, kv, b, &d));
    if (sample) memcpy(m->h_sargs, args, (size_t)b->n_logits * sizeof *args);
    TRY(batch_run(m, kv, &d, b, sample));
    if (b->n_logits > 0 && logits)
        TRY(o->copy_d2h(be, m->stream, logits, m->logits, (size_t)(b->n_logits * V) * sizeof(float)));
    return STRATA_OK;
}

strata_status st_llama_forward_batch(st_llama *m, st_kv_cache *kv, const st_batch *b, float *logits) {
    if (!m || !kv || !b) return st_err(STRATA_ERR_INVALID_ARG, "forward_batch: no model, cache or batch");
    if (kv->m != m) return st_err(STRATA_ERR_INVALID_ARG, "forward_batch: the KV cache belongs to another model");
    TRY(batch_check(m, kv, b));
    if (b->n_logits > 0 && !logits) return st_err(STRATA_ERR_INVALID_ARG, "forward_batch: logits is NULL");
    const strata_status st = forward_batch_enqueue(m, kv, b, logits, NULL);
    /* the one host sync: logits readable, and the staging buffer free for the
     * next call even when an op failed after the metadata copy was enqueued */
    const strata_status s2 = m->be->ops->stream_sync(m->be, m->stream);
    return st != STRATA_OK ? st : s2;
}

/* ---- device sampling of the batch's logits ---------------------------------------------*/

static strata_status sample_buffers(st_llama *m) {
    st_backend *be = m->be;
    const size_t T = (size_t)m->max_batch;
    strata_status st = STRATA_OK;
    if (!m->d_sargs) st = be->ops->alloc(be, T * sizeof(st_sample_args), (void **)&m->d_sargs);
    if (!st && !m->d_sids) st = be->ops->alloc(be, T * sizeof(int32_t), (void **)&m->d_sids);
    if (!st && !m->h_sargs) {
        st = be->ops->host_alloc(be, T * (sizeof(st_sample_args) + sizeof(int32_t)), (void **)&m->h_sargs);
        if (!st) m->h_sids = (int32_t *)(m->h_sargs + T);
    }
    return st;
}

strata_status st_llama_forward_batch_sample(st_llama *m, st_kv_cache *kv, const st_batch *b,
                                            const st_sample_args *args, int32_t *ids, float *logits) {
    if (!m || !kv || !b) return st_err(STRATA_ERR_INVALID_ARG, "forward_batch_sample: no model, cache or batch");
    if (kv->m != m)
        return st_err(STRATA_ERR_INVALID_ARG, "forward_batch_sample: the KV cache belongs to another model");
    TRY(batch_check(m, kv, b));
    if (b->n_logits > 0 && (!args || !ids))
        return st_err(STRATA_ERR_INVALID_ARG, "forward_batch_sample: args or ids is NULL");
    if (b->n_logits > 0) TRY(sample_buffers(m));
    const strata_status st = forward_batch_enqueue(m, kv, b, logits, b->n_logits > 0 ? args : NULL);
    const strata_status s2 = m->be->ops->stream_sync(m->be, m->stream); /* the one host sync */
    if (st == STRATA_OK && s2 == STRATA_OK && b->n_logits > 0)
        memcpy(ids, m->h_sids, (size_t)b->n_logits * sizeof *ids);
    return st != STRATA_OK ? st : s2;
}

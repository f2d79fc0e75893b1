/* planner: see planner.h. */
#include "planner/planner.h"

#include "kv/kv_stream.h"
#include "weights/measure.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static size_t r256(size_t x) { return (x + 255) / 256 * 256; }

/* Keys of the probe's attention at most (its K/V buffers are that long). */
#define PROBE_MAX_CTX 131072
/* Block size of the probe's paged attention (the engines' default). */
#define PLAN_KV_BLOCK 16

int64_t st_plan_attn_piece(int64_t want) {
    int64_t p = ST_ATTN_RANGE;
    const int64_t w = want > 0 ? want : ST_PLAN_ATTN_PIECE;
    while (p < w && p < ST_KV_STREAM_SEG) p *= 2; /* ST_ATTN_RANGE and the segment are powers of two */
    return p;
}

double st_plan_cpu_attn_share(double cpu_bw, double h2d_bw) {
    return cpu_bw > 0 && h2d_bw > 0 ? cpu_bw / (cpu_bw + h2d_bw) : 0.0;
}

int64_t st_plan_ffn_rows(int64_t max_tokens) { return max_tokens < ST_PLAN_FFN_ROWS ? max_tokens : ST_PLAN_FFN_ROWS; }

int64_t st_plan_gather_rows(int64_t max_tokens, int64_t max_seq_len, int64_t piece) {
    const int64_t tail = ST_ATTN_RANGE + max_tokens, r = piece > tail ? piece : tail;
    return r < max_seq_len ? r : max_seq_len;
}

size_t st_plan_gather_bytes(const st_config *c, int64_t max_tokens, int64_t max_seq_len, int64_t piece) {
    const int64_t rows = st_plan_gather_rows(max_tokens, max_seq_len, piece);
    return 2 * r256((size_t)(rows * c->n_kv_heads * c->head_dim) * sizeof(float));
}

size_t st_plan_act_bytes(const st_backend *be, const st_config *c, int64_t T, int64_t max_seq_len, int64_t piece) {
    const int64_t H = c->hidden_size, q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim,
                  I = c->intermediate_size, V = c->vocab_size;
    size_t a = 3 * r256((size_t)(T * H) * 4);           /* x, xn, tmp */
    a += 2 * r256((size_t)(T * q_dim) * 4);             /* q, att */
    a += r256((size_t)(T * c->n_heads) * 4);            /* lse */
    a += 2 * r256((size_t)(T * kv_dim) * 4);            /* k, v */
    a += 2 * r256((size_t)(st_plan_ffn_rows(T) * I) * 4); /* gate, up */
    a += r256((size_t)(T * V) * 4);                     /* logits */
    a += r256((size_t)(c->head_dim / 2) * 4);           /* inv_freq */
    a += r256((size_t)T * (sizeof(st_sample_args) + sizeof(int32_t))); /* sample args, ids */
    return a + st_plan_gather_bytes(c, T, max_seq_len, piece);           /* kg, vg */
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
                                       int64_t max_ctx, size_t *scratch) {
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
     * ctx_lens [1] | unused [1] | block table [max_blocks] */
    const int64_t bs = PLAN_KV_BLOCK, max_blocks = (max_ctx + bs - 1) / bs;
    const int64_t n_meta = 3 * Ta + 2 + max_blocks;
    {
        const size_t kvb = (size_t)(max_blocks * bs * kv_dim) * 4;
        if ((st = probe_alloc(p, kvb, (void **)&kc)) || (st = probe_alloc(p, kvb, (void **)&vc))) return st;
    }
    if ((st = probe_alloc(p, (size_t)n_meta * 4, (void **)&meta))) return st;
    int32_t *h = st_calloc((size_t)n_meta, sizeof *h);
    if (!h)
        return st_err(STRATA_ERR_NOMEM, "scratch probe: out of memory for %lld metadata entries (%zu bytes)",
                      (long long)n_meta, (size_t)n_meta * sizeof *h);
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
    const int32_t *pos_end = meta, *seq = meta + 2 * Ta, *ctx_lens = meta + 3 * Ta;
    const int32_t *tables = meta + 3 * Ta + 2;

    /* the ops, in the order a prefill chunk and then decode steps run them */
    st_budget *bud = &be->device_budget;
    const size_t u0 = bud->used, saved_peak = bud->peak;
    bud->peak = bud->used;
    const int64_t ns[2] = {T, 1};
    for (int r = 0; r < 2 && st == STRATA_OK; r++)
        for (int i = 0; i < npw && st == STRATA_OK; i++) {
            const st_weight w = {pw[i].d, pw[i].dtype, pw[i].rows, pw[i].cols, 0};
            st = o->matmul(be, p->s, x, &w, ns[r], y);
        }
    const float scale = 1.0f / sqrtf((float)hd);
    if (st == STRATA_OK) { /* a gathered prefill chunk's last piece, at the end of the context (model/forward.c) */
        const int64_t rows = st_plan_gather_rows(T, max_ctx, st_plan_attn_piece(0)), key0 = (max_ctx - rows) /
                             ST_ATTN_RANGE * ST_ATTN_RANGE;
        float *lse = NULL;
        st = probe_alloc(p, (size_t)(Ta * c->n_heads) * 4, (void **)&lse);
        if (st == STRATA_OK)
            st = o->attention_part(be, p->s, x, kc, vc, pos_end, Ta, key0, max_ctx - key0, c->n_heads,
                                   c->n_kv_heads, hd, scale, key0 > 0, y, lse);
    }
    if (st == STRATA_OK) {
        const st_paged_kv pk = {.cache = {.k = kc, .v = vc, .dtype = ST_KV_F32, .n_slots = max_blocks * bs,
                                          .n_kv_heads = c->n_kv_heads, .head_dim = hd},
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
            st = o->matmul_swiglu(be, p->s, x, &wg2, &wu2, 1, y, NULL);
        }
    }
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
 * and the probe runs only when forced (tests). A probe that does not fit in
 * the budget leaves the estimate from the shapes alone. Without a device
 * budget nothing is reserved (every weight is resident). */
/* Runs the probe on `stream` (NULL: a probe stream of its own, destroyed
 * after, so that its scratch goes too); *scratch = the growth measured. */
static strata_status probe_on(st_backend *be, st_stream *stream, const st_config *c, const st_wgroups *g, int64_t T,
                              int64_t max_ctx, size_t *scratch) {
    probe_ctx p = {be, stream, {0}, 0, NULL};
    *scratch = 0;
    if (max_ctx > PROBE_MAX_CTX) max_ctx = PROBE_MAX_CTX; /* longer contexts take the same scratch (bounded pieces
                                                           and split-KV partials) */
    strata_status st = STRATA_OK;
    if (!(p.zeros = calloc(1, ZERO_BYTES)))
        st = st_err(STRATA_ERR_NOMEM, "scratch probe: out of memory for %d bytes of zeros", (int)ZERO_BYTES);
    if (st == STRATA_OK && !stream) st = be->ops->stream_create(be, false, &p.s);
    if (st == STRATA_OK) st = scratch_probe_run(&p, c, g, T, max_ctx, scratch);
    if (p.s) {
        (void)be->ops->stream_sync(be, p.s);
        probe_free(&p); /* the buffers, then (a stream of its own) the stream and its scratch */
        if (!stream) be->ops->stream_destroy(be, p.s);
    } else {
        probe_free(&p);
    }
    return st;
}

strata_status st_plan_presize(st_backend *be, st_stream *stream, const st_config *c, const st_wgroups *g,
                              int64_t max_tokens, int64_t max_seq_len) {
    size_t scratch = 0;
    strata_status st = probe_on(be, stream, c, g, max_tokens, max_seq_len, &scratch);
    if (st == STRATA_OK)
        st_log(STRATA_LOG_DEBUG, "compute stream scratch pre-sized: %zu bytes (batch %lld, context %lld)", scratch,
               (long long)max_tokens, (long long)max_seq_len);
    return st;
}

size_t st_plan_scratch(st_backend *be, const st_config *c, const st_wgroups *g, int64_t T, int64_t max_ctx,
                       bool force) {
    const bool cpu = be->kind == ST_BACKEND_CPU;
    if (!force && cpu) return 0;
    size_t scratch = 0;
    const strata_status st = probe_on(be, NULL, c, g, T, max_ctx, &scratch);
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


static bool bw_complete(const st_wbw *bw) { return bw->h2d > 0 && bw->ssd > 0 && bw->dev_read > 0 && bw->gemm > 0; }

strata_status st_plan_make(const st_model_files *files, st_backend *be, const st_wgroups *g,
                           const st_plan_params *p, st_wplan *plan) {
    memset(plan, 0, sizeof *plan);
    if (!p || p->max_tokens < 1 || p->max_seq_len < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "plan: max_tokens and max_seq_len must be >= 1");
    const st_config *c = &files->config;
    const st_weight_opts *wo = &p->weights;
    const int64_t T = p->max_tokens;
    st_wplan_params pp;
    memset(&pp, 0, sizeof pp);
    pp.device_mem = p->device_mem;
    pp.host_mem = wo->host_mem ? wo->host_mem : st_wplan_host_auto();
    pp.device_kv = p->kv_bytes;
    pp.device_act = st_plan_act_bytes(be, c, T, p->max_seq_len, st_plan_attn_piece(p->attn_piece));
    pp.device_reserve = wo->device_reserve;
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
    /* the CPU tier: never chosen on the CPU backend (everything runs there already); a forced count
     * places it there too (the model's second CPU backend computes it: the tests' way to run it) */
    pp.cpu_ffn = be->kind == ST_BACKEND_CPU && wo->cpu_ffn == 0 ? -1 : wo->cpu_ffn;
    pp.cpu_split = wo->cpu_split;
    pp.pass_tokens = wo->cpu_pass_tokens;
    if ((p->device_mem > 0 || wo->placement) && !bw_complete(&pp.bw))
        return pp.bw.skipped[0] /* the probe had no memory: say so, not that nobody measured */
                   ? st_err(STRATA_ERR_NOMEM, "plan: the matmul probe that a plan under a device budget needs "
                            "could not run: %s", pp.bw.skipped)
                   : st_err(STRATA_ERR_INVALID_ARG, "plan: a plan under a device budget needs the bandwidths "
                            "(PCIe %.3g, SSD %.3g, device read %.3g B/s, GEMM %.3g FLOP/s): measure them at "
                            "startup (st_plan_measure)", pp.bw.h2d, pp.bw.ssd, pp.bw.dev_read, pp.bw.gemm);
    return st_wplan_make(g, &pp, plan);
}

strata_status st_plan_measure(const st_model_files *files, st_backend *be, st_plan_params *p) {
    st_weight_opts *wo = &p->weights;
    const int64_t cpu_max = wo->cpu_max_tokens > 0 ? wo->cpu_max_tokens : ST_PLAN_CPU_MAX_TOKENS;
    if (wo->cpu_pass_tokens < 0 || wo->cpu_pass_tokens > cpu_max)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "plan: a decode pass of %lld tokens to balance (--cpu-pass-tokens) must be between 1 and "
                      "the %lld tokens up to which a pass computes on the CPU (--cpu-max-tokens)",
                      (long long)wo->cpu_pass_tokens, (long long)cpu_max);
    const bool need_bw = (p->device_mem > 0 || wo->placement || p->measure_bw) && !bw_complete(&wo->bw);
    const bool need_scratch = p->device_mem > 0 && wo->device_reserve == 0;
    const bool need_cpu = (p->device_mem > 0 || p->measure_bw) && be->kind != ST_BACKEND_CPU && wo->cpu_ffn >= 0 &&
                          !(wo->bw.cpu > 0) && !wo->placement;
    if (!need_bw && !need_scratch && !need_cpu) return STRATA_OK;
    const int64_t T = p->max_tokens > 0 ? p->max_tokens : 512;
    st_wgroups *g = NULL;
    strata_status st = st_wgroups_build(files, &g);
    if (st == STRATA_OK && need_bw) st = st_wbw_measure(be, files, g, T, !wo->stream.no_direct, &wo->bw);
    if (st == STRATA_OK && need_cpu)
        st = st_wbw_measure_cpu(files, g, wo->cpu_threads, wo->cpu_act, wo->cpu_pass_tokens, be, &wo->bw);
    if (st == STRATA_OK && need_scratch)
        wo->device_reserve = st_plan_scratch(be, &files->config, g, T, p->max_seq_len, wo->probe_scratch);
    st_wgroups_free(g);
    return st;
}

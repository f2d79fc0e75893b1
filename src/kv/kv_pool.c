/* kv/kv_pool: see kv_pool.h. */
#include "kv/kv_pool.h"

#include <stdio.h>
#include <string.h>

struct st_kv_pool {
    st_backend *be;
    st_kv_pool_params p;
    int64_t max_blocks;     /* ceil(max_seq_len / block_size) */
    st_kv_layer *layers;    /* [n_layers] device arrays */
    size_t meta_bytes;
    void *h_meta;           /* pinned host staging of one batch's metadata */
    void *d_meta;           /* its device copy */
    st_event **ready;       /* [n_layers] set by the tiers for one pass (NULL: resident) */
    int64_t n_ready;        /* layers with a ready event */
    st_kv_pool_pass_fn pass_fn;
    void *pass_user;
    st_kv_pool_layer_fn layer_fn;
    void *layer_user;
};

static size_t r256(size_t x) { return (x + 255) / 256 * 256; }

size_t st_kv_pool_meta_bytes(int64_t max_tokens, int64_t max_blocks, int64_t block_size) {
    /* int64 slots[T] | int32 tokens, pos, seq, logit_rows, ctx_lens, rope_pos [T each] | tables [T * B] |
     * key slots [B * bs] */
    return (size_t)max_tokens * 8 +
           ((size_t)6 * max_tokens + (size_t)max_tokens * (size_t)max_blocks + (size_t)(max_blocks * block_size)) * 4;
}

static bool params_ok(const st_kv_pool_params *p) {
    return p && p->n_layers >= 1 && p->n_kv_heads >= 1 && p->head_dim >= 1 && p->num_blocks >= 1 &&
           p->num_blocks <= INT32_MAX && p->block_size >= 1 && p->num_blocks <= INT64_MAX / 4 / p->block_size &&
           p->max_tokens >= 1 && p->max_seq_len >= 1 && st_kv_dtype_size(p->dtype) > 0;
}

double st_kv_pool_bytes_per_token(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, st_kv_dtype dtype) {
    double row = (double)(n_kv_heads * head_dim) * (double)st_kv_dtype_size(dtype);
    if (dtype == ST_KV_FP8) row += (double)n_kv_heads * sizeof(float);
    return 2.0 * (double)n_layers * row;
}

/* One layer's arrays: K, V (and the fp8 scales). */
static size_t layer_bytes(const st_kv_pool_params *p, size_t *data, size_t *scales) {
    const size_t slots = (size_t)(p->num_blocks * p->block_size);
    *data = r256(slots * (size_t)(p->n_kv_heads * p->head_dim) * st_kv_dtype_size(p->dtype));
    *scales = p->dtype == ST_KV_FP8 ? r256(slots * (size_t)p->n_kv_heads * sizeof(float)) : 0;
    return 2 * (*data + *scales);
}

size_t st_kv_pool_device_bytes(const st_kv_pool_params *p) {
    if (!params_ok(p)) return 0;
    size_t data, scales;
    const int64_t B = (p->max_seq_len + p->block_size - 1) / p->block_size;
    return (size_t)p->n_layers * layer_bytes(p, &data, &scales) + r256(st_kv_pool_meta_bytes(p->max_tokens, B, p->block_size));
}

strata_status st_kv_pool_init(st_backend *be, const st_kv_pool_params *p, st_kv_pool **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "kv pool: out is NULL");
    *out = NULL;
    if (!be || !p) return st_err(STRATA_ERR_INVALID_ARG, "kv pool: no backend or params");
    if (!params_ok(p))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "kv pool: bad parameters (n_layers %lld, n_kv_heads %lld, head_dim %lld, num_blocks %lld, "
                      "block_size %lld, dtype %d, max_tokens %lld, max_seq_len %lld: each >= 1, block ids int32)",
                      (long long)p->n_layers, (long long)p->n_kv_heads, (long long)p->head_dim,
                      (long long)p->num_blocks, (long long)p->block_size, (int)p->dtype, (long long)p->max_tokens,
                      (long long)p->max_seq_len);
    st_kv_pool *kv = st_calloc(1, sizeof *kv);
    if (!kv) return st_err(STRATA_ERR_NOMEM, "kv pool: out of memory for its state (%zu bytes)", sizeof *kv);
    kv->be = be;
    kv->p = *p;
    kv->max_blocks = (p->max_seq_len + p->block_size - 1) / p->block_size;
    strata_status st = STRATA_OK;
    kv->layers = st_calloc((size_t)p->n_layers, sizeof *kv->layers);
    kv->ready = st_calloc((size_t)p->n_layers, sizeof *kv->ready);
    if (!kv->layers || !kv->ready) {
        st = st_err(STRATA_ERR_NOMEM, "kv pool: out of memory for the tables of %lld layers (%zu bytes)",
                    (long long)p->n_layers, (size_t)p->n_layers * (sizeof *kv->layers + sizeof *kv->ready));
        goto fail;
    }
    size_t data, scales;
    const size_t per_layer = layer_bytes(p, &data, &scales);
    for (int64_t l = 0; l < p->n_layers; l++) {
        st_kv_layer *L = &kv->layers[l];
        *L = (st_kv_layer){.dtype = p->dtype, .n_slots = p->num_blocks * p->block_size,
                           .n_kv_heads = p->n_kv_heads, .head_dim = p->head_dim};
        if ((st = be->ops->alloc(be, data, &L->k)) || (st = be->ops->alloc(be, data, &L->v)) ||
            (scales && ((st = be->ops->alloc(be, scales, (void **)&L->k_scale)) ||
                        (st = be->ops->alloc(be, scales, (void **)&L->v_scale))))) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            st = st_err(st, "kv pool of %lld blocks x %lld tokens in %s (%.1f MiB per layer, %.1f MiB in all): %s",
                        (long long)p->num_blocks, (long long)p->block_size, st_kv_dtype_name(p->dtype),
                        (double)per_layer / 1048576.0, (double)st_kv_pool_device_bytes(p) / 1048576.0, msg);
            goto fail;
        }
    }
    kv->meta_bytes = st_kv_pool_meta_bytes(p->max_tokens, kv->max_blocks, p->block_size);
    if ((st = be->ops->alloc(be, kv->meta_bytes, &kv->d_meta))) {
        st = st_err_what(st, "kv pool: the batch's block tables and slots on the device (%zu bytes)", kv->meta_bytes);
        goto fail;
    }
    if ((st = be->ops->host_alloc(be, kv->meta_bytes, &kv->h_meta))) {
        st = st_err_what(st, "kv pool: the batch's block tables and slots in pinned host memory (%zu bytes)",
                         kv->meta_bytes);
        goto fail;
    }
    memset(kv->h_meta, 0, kv->meta_bytes); /* entries a batch does not write are never read, but defined */
    *out = kv;
    return STRATA_OK;
fail:
    st_kv_pool_free(kv);
    return st;
}

void st_kv_pool_free(st_kv_pool *kv) {
    if (!kv) return;
    st_backend *be = kv->be;
    for (int64_t l = 0; kv->layers && l < kv->p.n_layers; l++) {
        void *bufs[] = {kv->layers[l].k, kv->layers[l].v, kv->layers[l].k_scale, kv->layers[l].v_scale};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            if (bufs[i]) be->ops->dealloc(be, bufs[i]); /* dealloc waits for the device */
    }
    if (kv->d_meta) be->ops->dealloc(be, kv->d_meta);
    if (kv->h_meta) be->ops->host_dealloc(be, kv->h_meta);
    st_free(kv->layers);
    st_free(kv->ready);
    st_free(kv);
}

const st_kv_pool_params *st_kv_pool_get_params(const st_kv_pool *kv) { return &kv->p; }
int64_t st_kv_pool_num_blocks(const st_kv_pool *kv) { return kv->p.num_blocks; }
int64_t st_kv_pool_block_size(const st_kv_pool *kv) { return kv->p.block_size; }
int64_t st_kv_pool_max_blocks(const st_kv_pool *kv) { return kv->max_blocks; }
st_backend *st_kv_pool_backend(const st_kv_pool *kv) { return kv->be; }

strata_status st_kv_pool_acquire(st_kv_pool *kv, int64_t layer, st_kv_layer *out, st_event **ready) {
    if (layer < 0 || layer >= kv->p.n_layers)
        return st_err(STRATA_ERR_INVALID_ARG, "kv pool: layer %lld of %lld", (long long)layer,
                      (long long)kv->p.n_layers);
    *out = kv->layers[layer];
    *ready = kv->ready[layer]; /* NULL: nothing is moving into the layer's blocks */
    return STRATA_OK;
}

void st_kv_pool_release(st_kv_pool *kv, int64_t layer, st_event *done) {
    (void)kv;
    (void)layer;
    (void)done; /* nothing moves the device tier's blocks */
}

const st_kv_layer *st_kv_pool_layer(const st_kv_pool *kv, int64_t layer) {
    return layer >= 0 && layer < kv->p.n_layers ? &kv->layers[layer] : NULL;
}

void st_kv_pool_set_ready(st_kv_pool *kv, int64_t layer, st_event *ready) {
    ST_ASSERT(layer >= 0 && layer < kv->p.n_layers);
    if (!kv->ready[layer] && ready) kv->n_ready++;
    if (kv->ready[layer] && !ready) kv->n_ready--;
    kv->ready[layer] = ready;
}

void st_kv_pool_clear_ready(st_kv_pool *kv) {
    for (int64_t l = 0; l < kv->p.n_layers; l++) kv->ready[l] = NULL;
    kv->n_ready = 0;
}

bool st_kv_pool_has_ready(const st_kv_pool *kv) { return kv->n_ready > 0 || kv->layer_fn != NULL; }

void st_kv_pool_set_layer_hook(st_kv_pool *kv, st_kv_pool_layer_fn fn, void *user) {
    kv->layer_fn = fn;
    kv->layer_user = user;
}

strata_status st_kv_pool_layer_done(st_kv_pool *kv, int64_t layer, st_stream *compute) {
    return kv->layer_fn ? kv->layer_fn(kv->layer_user, layer, compute) : STRATA_OK;
}

void st_kv_pool_set_pass_hook(st_kv_pool *kv, st_kv_pool_pass_fn fn, void *user) {
    kv->pass_fn = fn;
    kv->pass_user = user;
}

strata_status st_kv_pool_begin_pass(st_kv_pool *kv) { return kv->pass_fn ? kv->pass_fn(kv->pass_user) : STRATA_OK; }

void st_kv_pool_meta(st_kv_pool *kv, void **host, void **dev, size_t *bytes) {
    *host = kv->h_meta;
    *dev = kv->d_meta;
    *bytes = kv->meta_bytes;
}

void st_kv_block_layout_get(const st_kv_pool_params *p, st_kv_block_layout *out) {
    const size_t bs = (size_t)p->block_size;
    const size_t data = (size_t)(p->n_kv_heads * p->head_dim) * st_kv_dtype_size(p->dtype);
    const size_t sc = p->dtype == ST_KV_FP8 ? (size_t)p->n_kv_heads * sizeof(float) : 0;
    memset(out, 0, sizeof *out);
    out->n_planes = sc ? 4 : 2;
    out->row[0] = out->row[1] = data;
    out->row[2] = out->row[3] = sc;
    size_t o = 0;
    for (int64_t i = 0; i < out->n_planes; i++) {
        out->off[i] = o;
        o += bs * out->row[i];
    }
    out->layer_bytes = o;
}

/* One layer of blocks[0..n) between the pool and `mem` (block k's part at
 * mem + k * layer_bytes): out: pool -> mem, else mem -> pool. */
static strata_status move_layer(st_kv_pool *kv, st_stream *stream, int64_t layer, const int32_t *blocks, int64_t n,
                                uint8_t *mem, bool out) {
    if (!kv || !blocks || !mem || layer < 0 || layer >= kv->p.n_layers || n < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "kv pool %s: bad arguments", out ? "export" : "import");
    st_kv_block_layout lo;
    st_kv_block_layout_get(&kv->p, &lo);
    const st_kv_layer *L = &kv->layers[layer];
    const size_t bs = (size_t)kv->p.block_size;
    for (int64_t i = 0; i < n;) {
        int64_t k = 1; /* a run of consecutive device blocks */
        while (i + k < n && blocks[i + k] == blocks[i + k - 1] + 1) k++;
        if (blocks[i] < 0 || blocks[i] + k > kv->p.num_blocks)
            return st_err(STRATA_ERR_INVALID_ARG, "kv pool %s: block %d outside the pool", out ? "export" : "import",
                          blocks[i]);
        for (int64_t p = 0; p < lo.n_planes; p++) {
            void *base = p == 0 ? L->k : p == 1 ? L->v : p == 2 ? (void *)L->k_scale : (void *)L->v_scale;
            const size_t w = bs * lo.row[p];
            uint8_t *dev = (uint8_t *)base + (size_t)blocks[i] * w;
            uint8_t *m = mem + (size_t)i * lo.layer_bytes + lo.off[p];
            strata_status st = out ? kv->be->ops->copy_2d(kv->be, stream, m, lo.layer_bytes, dev, w, w, (size_t)k)
                                   : kv->be->ops->copy_2d(kv->be, stream, dev, w, m, lo.layer_bytes, w, (size_t)k);
            if (st) return st;
        }
        i += k;
    }
    return STRATA_OK;
}

strata_status st_kv_pool_export_layer(st_kv_pool *kv, st_stream *stream, int64_t layer, const int32_t *blocks,
                                      int64_t n, void *dst) {
    return move_layer(kv, stream, layer, blocks, n, dst, true);
}

strata_status st_kv_pool_import_layer(st_kv_pool *kv, st_stream *stream, int64_t layer, const int32_t *blocks,
                                      int64_t n, const void *src) {
    return move_layer(kv, stream, layer, blocks, n, (uint8_t *)(uintptr_t)src, false);
}

/* backend: creation by kind, destruction, availability, and the validating
 * layer every backend's ops go through (backend.h: "Argument checks"). */
#include "backend/backend.h"

static void backend_wrap(st_backend *be);

strata_status st_backend_init(const st_backend_params *params, st_backend **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "backend init: out is NULL");
    *out = NULL;
    if (!params) return st_err(STRATA_ERR_INVALID_ARG, "backend init: params is NULL");
    strata_status st;
    switch (params->kind) {
    case ST_BACKEND_CPU: st = st_backend_cpu_init(params, out); break;
    case ST_BACKEND_CUDA:
#ifdef STRATA_HAVE_CUDA
        st = st_backend_cuda_init(params, out);
        break;
#else
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "CUDA backend not built (configure with CUDA available and -DSTRATA_CUDA=ON)");
#endif
    default:
        return st_err(STRATA_ERR_INVALID_ARG, "backend init: unknown backend kind %d", (int)params->kind);
    }
    if (st == STRATA_OK) backend_wrap(*out);
    return st;
}

void st_backend_free(st_backend *be) {
    if (!be) return;
    be->ops->destroy(be);
}

bool st_backend_available(st_backend_kind kind) {
    switch (kind) {
    case ST_BACKEND_CPU: return true;
    case ST_BACKEND_CUDA: {
#ifdef STRATA_HAVE_CUDA
        return st_backend_cuda_present();
#else
        return false;
#endif
    }
    }
    return false;
}

strata_status st_kv_layer_check(const st_kv_layer *c, int64_t n_kv_heads, int64_t head_dim, const char *op) {
    if (!c) return st_err(STRATA_ERR_INVALID_ARG, "%s: the KV layer (cache) is NULL", op);
    if (c->dtype != ST_KV_F32 && c->dtype != ST_KV_BF16 && c->dtype != ST_KV_FP8)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache.dtype = %d is not a KV dtype (f32, bf16, fp8)", op,
                      (int)c->dtype);
    if (!c->k || !c->v)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache.%s is NULL", op, !c->k ? "k" : "v");
    if (c->dtype == ST_KV_FP8 && (!c->k_scale || !c->v_scale))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache.%s is NULL (fp8 needs its row scales)", op,
                      !c->k_scale ? "k_scale" : "v_scale");
    if (c->n_slots < 1 || c->n_kv_heads < 1 || c->head_dim < 1)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: cache.n_slots = %lld, cache.n_kv_heads = %lld, cache.head_dim = %lld (all >= 1)", op,
                      (long long)c->n_slots, (long long)c->n_kv_heads, (long long)c->head_dim);
    if (c->n_kv_heads > INT64_MAX / c->head_dim ||
        c->n_slots > INT64_MAX / 4 / (c->n_kv_heads * c->head_dim))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: cache of %lld x %lld x %lld elements is too large", op,
                      (long long)c->n_slots, (long long)c->n_kv_heads, (long long)c->head_dim);
    if ((n_kv_heads > 0 && c->n_kv_heads != n_kv_heads) || (head_dim > 0 && c->head_dim != head_dim))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: cache.n_kv_heads = %lld, cache.head_dim = %lld differ from the op's n_kv_heads = %lld, "
                      "head_dim = %lld",
                      op, (long long)c->n_kv_heads, (long long)c->head_dim, (long long)n_kv_heads,
                      (long long)head_dim);
    return STRATA_OK;
}

strata_status st_paged_kv_check(const st_paged_kv *kv, const char *op) {
    if (!kv) return st_err(STRATA_ERR_INVALID_ARG, "%s: the paged KV description is NULL", op);
    strata_status st = st_kv_layer_check(&kv->cache, 0, 0, op);
    if (st != STRATA_OK) return st;
    if (!kv->block_tables || !kv->ctx_lens)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %s is NULL", op, !kv->block_tables ? "block_tables" : "ctx_lens");
    const int64_t n_slots = kv->cache.n_slots;
    if (kv->block_size < 1 || n_slots < kv->block_size || n_slots % kv->block_size)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: cache.n_slots = %lld must be a positive multiple of block_size = %lld", op,
                      (long long)n_slots, (long long)kv->block_size);
    if (n_slots / kv->block_size > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %lld blocks do not fit int32 block ids", op,
                      (long long)(n_slots / kv->block_size));
    if (kv->n_seqs < 1 || kv->max_blocks < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n_seqs = %lld, max_blocks = %lld (both >= 1)", op,
                      (long long)kv->n_seqs, (long long)kv->max_blocks);
    if (kv->batch_seqs < 0 || kv->batch_seqs > kv->n_seqs)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: batch_seqs = %lld is outside [0, n_seqs = %lld]", op,
                      (long long)kv->batch_seqs, (long long)kv->n_seqs);
    if (kv->max_blocks > INT64_MAX / kv->block_size || kv->max_ctx < 0 ||
        kv->max_ctx > kv->max_blocks * kv->block_size || kv->max_ctx > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: max_ctx = %lld is outside [0, max_blocks * block_size = %lld x %lld]", op,
                      (long long)kv->max_ctx, (long long)kv->max_blocks, (long long)kv->block_size);
    return STRATA_OK;
}

strata_status st_backend_check_weight(const st_weight *w, const char *op) {
    if (!w) return st_err(STRATA_ERR_INVALID_ARG, "%s: weight is NULL", op);
    const st_dtype_info *info = st_dtype_get(w->dtype);
    if (!info) return st_err(STRATA_ERR_INVALID_ARG, "%s: invalid weight dtype %d", op, (int)w->dtype);
    if (w->rows <= 0 || w->cols <= 0)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: weight shape [%lld, %lld] is empty", op,
                      (long long)w->rows, (long long)w->cols);
    if (w->cols % info->block_elems)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: weight cols %lld is not a multiple of the %s block (%lld)", op,
                      (long long)w->cols, info->name, (long long)info->block_elems);
    if (!w->data) return st_err(STRATA_ERR_INVALID_ARG, "%s: weight data is NULL", op);
    return STRATA_OK;
}

strata_status st_backend_check_heads(const char *op, int64_t n, int64_t n_kv, int64_t n_heads,
                                     int64_t n_kv_heads, int64_t head_dim) {
    if (n < 0 || n_kv < 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: n = %lld, n_kv = %lld, n_heads = %lld, n_kv_heads = %lld, head_dim = %lld"
                      " (n_heads must be a multiple of n_kv_heads)",
                      op, (long long)n, (long long)n_kv, (long long)n_heads, (long long)n_kv_heads,
                      (long long)head_dim);
    return STRATA_OK;
}

/* ---- the validating layer ----
 * One function per checked entry: the device-independent checks (backend.h
 * lists them), then the device's function. Only comparisons on the hot path:
 * no allocation, no device access, and the op's name is a table lookup. */

#define CHECKED_NAMES(X)                                                                     \
    X(alloc) X(host_alloc) X(upload) X(copy_h2d) X(copy_d2h) X(copy_d2d) X(copy_2d)          \
    X(stream_create) X(event_create) X(event_record) X(stream_wait_event) X(event_sync)      \
    X(event_query) X(get_rows)                                                               \
    X(rmsnorm) X(matmul) X(rope) X(attention) X(attention_part) X(swiglu) X(add) X(argmax)   \
    X(matmul_multi) X(matmul_swiglu) X(rmsnorm_matmul) X(kv_store_paged) X(rope_kv_store)    \
    X(kv_gather) X(attention_paged) X(sample)

enum {
#define X(o) OPN_##o,
    CHECKED_NAMES(X)
#undef X
    OPN_COUNT
};

/* "<backend> <op>", as the messages have always named them */
static const char *const k_op_names[2][OPN_COUNT] = {
#define X(o) "cpu " #o,
    [ST_BACKEND_CPU] = {CHECKED_NAMES(X)},
#undef X
#define X(o) "cuda " #o,
    [ST_BACKEND_CUDA] = {CHECKED_NAMES(X)},
#undef X
};

#define OPNAME(be, o) (k_op_names[(be)->kind][OPN_##o])

#define CHECK_PTR(p, op)                                                                     \
    do {                                                                                     \
        if (!(p)) return st_err(STRATA_ERR_INVALID_ARG, "%s: %s is NULL", op, #p);           \
    } while (0)

#define CHECK_N(n, op)                                                                       \
    do {                                                                                     \
        if ((n) < 0) return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld", op, (long long)(n)); \
    } while (0)

#define TRY(call)                                                                            \
    do {                                                                                     \
        strata_status st_ = (call);                                                          \
        if (st_ != STRATA_OK) return st_;                                                    \
    } while (0)

/* true when y [n, w.rows] overlaps x [n, w.cols] (fp32, n > 0, w checked):
 * y = x @ w^T is never in place */
static bool overlaps_x(const float *x, const float *y, int64_t n, const st_weight *w) {
    const uintptr_t px = (uintptr_t)x, py = (uintptr_t)y;
    const uint64_t nx = (uint64_t)n * (uint64_t)w->cols * sizeof(float);
    const uint64_t ny = (uint64_t)n * (uint64_t)w->rows * sizeof(float);
    return px < py + ny && py < px + nx;
}

/* memory, streams, events */

static strata_status chk_alloc(st_backend *be, size_t n, void **out) {
    CHECK_PTR(out, OPNAME(be, alloc));
    return be->dev_ops->alloc(be, n, out);
}

static strata_status chk_host_alloc(st_backend *be, size_t n, void **out) {
    CHECK_PTR(out, OPNAME(be, host_alloc));
    return be->dev_ops->host_alloc(be, n, out);
}

static strata_status chk_upload(st_backend *be, const void *host, size_t n, void **dev, bool *owned) {
    const char *op = OPNAME(be, upload);
    if (!dev || !owned) return st_err(STRATA_ERR_INVALID_ARG, "%s: NULL out parameter", op);
    *dev = NULL;
    *owned = false;
    if (!host && n) return st_err(STRATA_ERR_INVALID_ARG, "%s: host is NULL", op);
    return be->dev_ops->upload(be, host, n, dev, owned);
}

#define CHK_COPY(dir)                                                                        \
    static strata_status chk_copy_##dir(st_backend *be, st_stream *s, void *dst, const void *src, \
                                        size_t n) {                                          \
        if (n == 0) return STRATA_OK;                                                        \
        CHECK_PTR(dst, OPNAME(be, copy_##dir));                                              \
        CHECK_PTR(src, OPNAME(be, copy_##dir));                                              \
        return be->dev_ops->copy_##dir(be, s, dst, src, n);                                  \
    }
CHK_COPY(h2d)
CHK_COPY(d2h)
CHK_COPY(d2d)
#undef CHK_COPY

static strata_status chk_copy_2d(st_backend *be, st_stream *s, void *dst, size_t dpitch, const void *src,
                                  size_t spitch, size_t width, size_t height) {
    const char *op = OPNAME(be, copy_2d);
    if (width == 0 || height == 0) return STRATA_OK;
    CHECK_PTR(dst, op);
    CHECK_PTR(src, op);
    if (dpitch < width || spitch < width)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: pitches %zu / %zu below the row width %zu", op, dpitch, spitch,
                      width);
    return be->dev_ops->copy_2d(be, s, dst, dpitch, src, spitch, width, height);
}

static strata_status chk_stream_create(st_backend *be, bool high_priority, st_stream **out) {
    CHECK_PTR(out, OPNAME(be, stream_create));
    return be->dev_ops->stream_create(be, high_priority, out);
}

static strata_status chk_event_create(st_backend *be, st_event **out) {
    CHECK_PTR(out, OPNAME(be, event_create));
    return be->dev_ops->event_create(be, out);
}

static strata_status chk_event_record(st_backend *be, st_event *e, st_stream *s) {
    if (!e) return st_err(STRATA_ERR_INVALID_ARG, "%s: event is NULL", OPNAME(be, event_record));
    return be->dev_ops->event_record(be, e, s);
}

static strata_status chk_stream_wait_event(st_backend *be, st_stream *s, st_event *e) {
    if (!e) return st_err(STRATA_ERR_INVALID_ARG, "%s: event is NULL", OPNAME(be, stream_wait_event));
    return be->dev_ops->stream_wait_event(be, s, e);
}

static strata_status chk_event_sync(st_backend *be, st_event *e) {
    if (!e) return st_err(STRATA_ERR_INVALID_ARG, "%s: event is NULL", OPNAME(be, event_sync));
    return be->dev_ops->event_sync(be, e);
}

static strata_status chk_event_query(st_backend *be, st_event *e, bool *done) {
    if (!e || !done) return st_err(STRATA_ERR_INVALID_ARG, "%s: event or done is NULL", OPNAME(be, event_query));
    return be->dev_ops->event_query(be, e, done);
}

/* ops */

static strata_status chk_get_rows(st_backend *be, st_stream *s, const st_weight *w, const int32_t *ids,
                                  int64_t n, float *out) {
    const char *op = OPNAME(be, get_rows);
    TRY(st_backend_check_weight(w, op));
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(ids, op);
    CHECK_PTR(out, op);
    return be->dev_ops->get_rows(be, s, w, ids, n, out);
}

/* rmsnorm's checks under the name op (also rmsnorm_matmul's) */
static strata_status val_rmsnorm(const char *op, float *x, const st_weight *w, int64_t n, int64_t d, float *out) {
    TRY(st_backend_check_weight(w, op));
    if (n < 0 || d <= 0)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld, d = %lld", op, (long long)n, (long long)d);
    if (w->rows != 1 || w->cols != d)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: weight is [%lld, %lld], expected [1, %lld]", op,
                      (long long)w->rows, (long long)w->cols, (long long)d);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(out, op);
    return STRATA_OK;
}
static strata_status chk_rmsnorm(st_backend *be, st_stream *s, float *x, const float *residual,
                                 const st_weight *w, float eps, int64_t n, int64_t d, float *out) {
    TRY(val_rmsnorm(OPNAME(be, rmsnorm), x, w, n, d, out));
    if (n == 0) return STRATA_OK;
    return be->dev_ops->rmsnorm(be, s, x, residual, w, eps, n, d, out);
}

static strata_status chk_matmul(st_backend *be, st_stream *s, const float *x, const st_weight *w, int64_t n,
                                float *y) {
    const char *op = OPNAME(be, matmul);
    TRY(st_backend_check_weight(w, op));
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(y, op);
    if (overlaps_x(x, y, n, w))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: y overlaps x (matmul is not in place)", op);
    return be->dev_ops->matmul(be, s, x, w, n, y);
}

/* rope's checks under the name op of the rotated tensor xname (also
 * rope_kv_store's, for q and for k) */
static strata_status val_rope(const char *op, const char *xname, const float *x, const int32_t *pos, int64_t n,
                              int64_t n_heads, int64_t head_dim, const float *inv_freq) {
    if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld, n_heads = %lld, head_dim = %lld (must be even)",
                      op, (long long)n, (long long)n_heads, (long long)head_dim);
    if (n == 0) return STRATA_OK;
    if (!x) return st_err(STRATA_ERR_INVALID_ARG, "%s: %s is NULL", op, xname);
    CHECK_PTR(pos, op);
    CHECK_PTR(inv_freq, op);
    return STRATA_OK;
}
static strata_status chk_rope(st_backend *be, st_stream *s, float *x, const int32_t *pos, int64_t n,
                              int64_t n_heads, int64_t head_dim, const float *inv_freq, bool interleaved) {
    TRY(val_rope(OPNAME(be, rope), "x", x, pos, n, n_heads, head_dim, inv_freq));
    if (n == 0) return STRATA_OK;
    return be->dev_ops->rope(be, s, x, pos, n, n_heads, head_dim, inv_freq, interleaved);
}

static strata_status chk_attention(st_backend *be, st_stream *s, const float *q, const float *k, const float *v,
                                   const int32_t *pos, int64_t n, int64_t n_kv, int64_t n_heads,
                                   int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    const char *op = OPNAME(be, attention);
    TRY(st_backend_check_heads(op, n, n_kv, n_heads, n_kv_heads, head_dim));
    if (n == 0) return STRATA_OK;
    if (n_kv == 0) return st_err(STRATA_ERR_INVALID_ARG, "%s: no cached keys (n_kv = 0)", op);
    CHECK_PTR(q, op);
    CHECK_PTR(k, op);
    CHECK_PTR(v, op);
    CHECK_PTR(pos, op);
    CHECK_PTR(out, op);
    return be->dev_ops->attention(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, head_dim, scale, out);
}

static strata_status chk_attention_part(st_backend *be, st_stream *s, const float *q, const float *k,
                                        const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                        int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                        bool merge, float *out, float *lse) {
    const char *op = OPNAME(be, attention_part);
    TRY(st_backend_check_heads(op, n, n_kv, n_heads, n_kv_heads, head_dim));
    if (key0 < 0 || key0 % ST_ATTN_RANGE)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: key0 = %lld (a multiple of ST_ATTN_RANGE = %d, >= 0)", op,
                      (long long)key0, ST_ATTN_RANGE);
    if (n == 0) return STRATA_OK;
    if (n_kv == 0) return st_err(STRATA_ERR_INVALID_ARG, "%s: no keys in the piece (n_kv = 0)", op);
    CHECK_PTR(q, op);
    CHECK_PTR(k, op);
    CHECK_PTR(v, op);
    CHECK_PTR(pos, op);
    CHECK_PTR(out, op);
    if (merge) CHECK_PTR(lse, op);
    return be->dev_ops->attention_part(be, s, q, k, v, pos, n, key0, n_kv, n_heads, n_kv_heads, head_dim, scale,
                                       merge, out, lse);
}

static strata_status chk_swiglu(st_backend *be, st_stream *s, const float *gate, const float *up, int64_t n,
                                float *out) {
    const char *op = OPNAME(be, swiglu);
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(gate, op);
    CHECK_PTR(up, op);
    CHECK_PTR(out, op);
    return be->dev_ops->swiglu(be, s, gate, up, n, out);
}

static strata_status chk_add(st_backend *be, st_stream *s, float *x, const float *y, int64_t n) {
    const char *op = OPNAME(be, add);
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(y, op);
    return be->dev_ops->add(be, s, x, y, n);
}

static strata_status chk_argmax(st_backend *be, st_stream *s, const float *x, int64_t n, int64_t cols,
                                int32_t *out) {
    const char *op = OPNAME(be, argmax);
    if (n < 0 || cols <= 0 || cols > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld, cols = %lld", op, (long long)n, (long long)cols);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(out, op);
    return be->dev_ops->argmax(be, s, x, n, cols, out);
}

static strata_status val_matmul_multi(const char *op, const float *x, const st_weight *w, int count, int64_t n,
                                      float *const *y) {
    if (count < 1 || count > 4) return st_err(STRATA_ERR_INVALID_ARG, "%s: count = %d (1 to 4)", op, count);
    CHECK_PTR(w, op);
    for (int i = 0; i < count; i++) {
        TRY(st_backend_check_weight(&w[i], op));
        if (w[i].cols != w[0].cols)
            return st_err(STRATA_ERR_INVALID_ARG, "%s: weight %d has %lld cols, weight 0 has %lld", op, i,
                          (long long)w[i].cols, (long long)w[0].cols);
    }
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(y, op);
    for (int i = 0; i < count; i++) {
        if (!y[i]) return st_err(STRATA_ERR_INVALID_ARG, "%s: y[%d] is NULL", op, i);
        if (overlaps_x(x, y[i], n, &w[i]))
            return st_err(STRATA_ERR_INVALID_ARG, "%s: y[%d] overlaps x (matmul is not in place)", op, i);
    }
    return STRATA_OK;
}
static strata_status chk_matmul_multi(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                      int count, int64_t n, float *const *y) {
    TRY(val_matmul_multi(OPNAME(be, matmul_multi), x, w, count, n, y));
    if (n == 0) return STRATA_OK;
    return be->dev_ops->matmul_multi(be, s, x, w, count, n, y);
}

static strata_status val_matmul_swiglu(const char *op, const float *x, const st_weight *wg, const st_weight *wu,
                                       int64_t n, float *out) {
    TRY(st_backend_check_weight(wg, op));
    TRY(st_backend_check_weight(wu, op));
    if (wg->rows != wu->rows || wg->cols != wu->cols || wg->dtype != wu->dtype)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: gate is [%lld, %lld] %s, up is [%lld, %lld] %s", op,
                      (long long)wg->rows, (long long)wg->cols, st_dtype_name(wg->dtype), (long long)wu->rows,
                      (long long)wu->cols, st_dtype_name(wu->dtype));
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(x, op);
    CHECK_PTR(out, op);
    if (overlaps_x(x, out, n, wg))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: out overlaps x (the op is not in place)", op);
    return STRATA_OK;
}
static strata_status chk_matmul_swiglu(st_backend *be, st_stream *s, const float *x, const st_weight *wg,
                                       const st_weight *wu, int64_t n, float *out, float *work) {
    const char *op = OPNAME(be, matmul_swiglu);
    TRY(val_matmul_swiglu(op, x, wg, wu, n, out));
    if (n == 0) return STRATA_OK;
    st_weight sq = *wu; /* out and work are both [n, rows] */
    sq.cols = wu->rows;
    if (work && (overlaps_x(x, work, n, wu) || overlaps_x(out, work, n, &sq)))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: work overlaps x or out", op);
    return be->dev_ops->matmul_swiglu(be, s, x, wg, wu, n, out, work);
}

/* rmsnorm's and the matmul's checks (the matmul reading out, of d columns),
 * then the device's fused entry, or rmsnorm and the matmul in turn where it
 * has none. */
static strata_status chk_rmsnorm_matmul(st_backend *be, st_stream *s, float *x, const float *residual,
                                        const st_weight *w_norm, float eps, int64_t n, int64_t d, float *out,
                                        const st_weight *w, int count, const st_weight *up, float *const *y) {
    const char *op = OPNAME(be, rmsnorm_matmul);
    TRY(val_rmsnorm(op, x, w_norm, n, d, out));
    CHECK_PTR(w, op);
    if (up && count != 1) return st_err(STRATA_ERR_INVALID_ARG, "%s: count = %d with up (SwiGLU: 1)", op, count);
    if (up && n > 0) CHECK_PTR(y, op);
    if (up) TRY(val_matmul_swiglu(op, out, w, up, n, y ? y[0] : NULL));
    else TRY(val_matmul_multi(op, out, w, count, n, y));
    if (w[0].cols != d)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: the matmul's weight has %lld cols, the norm's rows %lld", op,
                      (long long)w[0].cols, (long long)d);
    if (n == 0) return STRATA_OK;
    if (be->dev_ops->rmsnorm_matmul)
        return be->dev_ops->rmsnorm_matmul(be, s, x, residual, w_norm, eps, n, d, out, w, count, up, y);
    TRY(be->dev_ops->rmsnorm(be, s, x, residual, w_norm, eps, n, d, out));
    if (up) return be->dev_ops->matmul_swiglu(be, s, out, w, up, n, y[0], NULL);
    return be->dev_ops->matmul_multi(be, s, out, w, count, n, y);
}

/* kv_store_paged's checks under the name op (also rope_kv_store's) */
static strata_status val_kv_store_paged(const char *op, const st_kv_layer *cache, const float *k, const float *v,
                                        const int64_t *slots, int64_t n) {
    if (n < 0) return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld", op, (long long)n);
    TRY(st_kv_layer_check(cache, 0, 0, op));
    if (n == 0) return STRATA_OK;
    CHECK_PTR(k, op);
    CHECK_PTR(v, op);
    CHECK_PTR(slots, op);
    return STRATA_OK;
}
static strata_status chk_kv_store_paged(st_backend *be, st_stream *s, const st_kv_layer *cache, const float *k,
                                        const float *v, const int64_t *slots, int64_t n) {
    TRY(val_kv_store_paged(OPNAME(be, kv_store_paged), cache, k, v, slots, n));
    if (n == 0) return STRATA_OK;
    return be->dev_ops->kv_store_paged(be, s, cache, k, v, slots, n);
}

/* rope's checks for q and for k (the cache's kv heads), kv_store_paged's,
 * head_dim against the cache's; then the device's fused entry, or the three
 * ops in turn where it has none. */
static strata_status chk_rope_kv_store(st_backend *be, st_stream *s, float *q, float *k, const float *v,
                                       const int32_t *pos, int64_t n, int64_t n_heads, int64_t head_dim,
                                       const float *inv_freq, bool interleaved, const st_kv_layer *cache,
                                       const int64_t *slots) {
    const char *op = OPNAME(be, rope_kv_store);
    TRY(val_kv_store_paged(op, cache, k, v, slots, n));
    if (cache->head_dim != head_dim)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: head_dim = %lld, the cache's %lld", op, (long long)head_dim,
                      (long long)cache->head_dim);
    TRY(val_rope(op, "q", q, pos, n, n_heads, head_dim, inv_freq));
    TRY(val_rope(op, "k", k, pos, n, cache->n_kv_heads, head_dim, inv_freq));
    if (n == 0) return STRATA_OK;
    if (be->dev_ops->rope_kv_store)
        return be->dev_ops->rope_kv_store(be, s, q, k, v, pos, n, n_heads, head_dim, inv_freq, interleaved, cache,
                                          slots);
    TRY(be->dev_ops->rope(be, s, q, pos, n, n_heads, head_dim, inv_freq, interleaved));
    TRY(be->dev_ops->rope(be, s, k, pos, n, cache->n_kv_heads, head_dim, inv_freq, interleaved));
    return be->dev_ops->kv_store_paged(be, s, cache, k, v, slots, n);
}

static strata_status chk_kv_gather(st_backend *be, st_stream *s, const st_kv_layer *cache, const int32_t *ids,
                                   int64_t n, float *k, float *v) {
    const char *op = OPNAME(be, kv_gather);
    CHECK_PTR(cache, op);
    TRY(st_kv_layer_check(cache, 0, 0, op));
    CHECK_N(n, op);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(ids, op);
    CHECK_PTR(k, op);
    CHECK_PTR(v, op);
    return be->dev_ops->kv_gather(be, s, cache, ids, n, k, v);
}

static strata_status chk_attention_paged(st_backend *be, st_stream *s, const float *q, const st_paged_kv *kv,
                                         const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    const char *op = OPNAME(be, attention_paged);
    TRY(st_backend_check_heads(op, n, 0, n_heads, n_kv_heads, head_dim));
    if (n == 0) return STRATA_OK;
    TRY(st_paged_kv_check(kv, op));
    TRY(st_kv_layer_check(&kv->cache, n_kv_heads, head_dim, op));
    CHECK_PTR(q, op);
    CHECK_PTR(seq, op);
    CHECK_PTR(pos, op);
    CHECK_PTR(out, op);
    return be->dev_ops->attention_paged(be, s, q, kv, seq, pos, n, n_heads, n_kv_heads, head_dim, scale, out);
}

static strata_status chk_sample(st_backend *be, st_stream *s, const float *logits, int64_t n, int64_t vocab,
                                const st_sample_args *args, int32_t *out) {
    const char *op = OPNAME(be, sample);
    if (n < 0 || vocab <= 0 || vocab > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n = %lld, vocab = %lld", op, (long long)n, (long long)vocab);
    if (n == 0) return STRATA_OK;
    CHECK_PTR(logits, op);
    CHECK_PTR(args, op);
    CHECK_PTR(out, op);
    return be->dev_ops->sample(be, s, logits, n, vocab, args, out);
}

/* be->ops = &be->checked: the device's table with the entries above replaced. */
static void backend_wrap(st_backend *be) {
    ST_ASSERT(be->kind == ST_BACKEND_CPU || be->kind == ST_BACKEND_CUDA); /* k_op_names has a row */
    be->dev_ops = be->ops;
    st_backend_ops *t = &be->checked;
    *t = *be->dev_ops;
#define X(o) t->o = chk_##o;
    CHECKED_NAMES(X)
#undef X
    be->ops = t;
}

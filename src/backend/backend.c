/* backend: creation by kind, destruction, availability. */
#include "backend/backend.h"

strata_status st_backend_init(const st_backend_params *params, st_backend **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "backend init: out is NULL");
    *out = NULL;
    if (!params) return st_err(STRATA_ERR_INVALID_ARG, "backend init: params is NULL");
    switch (params->kind) {
    case ST_BACKEND_CPU: return st_backend_cpu_init(params, out);
    case ST_BACKEND_CUDA:
#ifdef STRATA_HAVE_CUDA
        return st_backend_cuda_init(params, out);
#else
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "CUDA backend not built (configure with CUDA available and -DSTRATA_CUDA=ON)");
#endif
    }
    return st_err(STRATA_ERR_INVALID_ARG, "backend init: unknown backend kind %d", (int)params->kind);
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

strata_status st_paged_kv_check(const st_paged_kv *kv, const char *op) {
    if (!kv) return st_err(STRATA_ERR_INVALID_ARG, "%s: the paged KV description is NULL", op);
    if (!kv->k_cache || !kv->v_cache || !kv->block_tables || !kv->ctx_lens)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: a paged KV pointer (caches, block tables, ctx_lens) is NULL", op);
    if (kv->block_size < 1 || kv->n_slots < kv->block_size || kv->n_slots % kv->block_size)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "%s: n_slots = %lld must be a positive multiple of block_size = %lld", op,
                      (long long)kv->n_slots, (long long)kv->block_size);
    if (kv->n_slots / kv->block_size > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %lld blocks do not fit int32 block ids", op,
                      (long long)(kv->n_slots / kv->block_size));
    if (kv->n_seqs < 1 || kv->max_blocks < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: n_seqs = %lld, max_blocks = %lld (both >= 1)", op,
                      (long long)kv->n_seqs, (long long)kv->max_blocks);
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

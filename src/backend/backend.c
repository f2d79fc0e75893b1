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

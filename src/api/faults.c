/* api/faults: injected allocation failures (faults.h). */
#include "api/faults.h"

#include <stdatomic.h>

#include "core/core.h"

static struct {
    _Atomic(st_backend *) be; /* the backend carrying the faults (NULL: none) */
    strata_status (*alloc)(st_backend *be, size_t n, void **out);
    strata_status (*host_alloc)(st_backend *be, size_t n, void **out);
    int64_t device_nth, host_nth;
    atomic_llong n_device, n_host;
} g_faults;

static strata_status fault_alloc(st_backend *be, size_t n, void **out) {
    if (be == atomic_load(&g_faults.be) && g_faults.device_nth > 0) {
        const long long k = atomic_fetch_add(&g_faults.n_device, 1) + 1;
        if (k == g_faults.device_nth) {
            if (out) *out = NULL;
            return st_err(STRATA_ERR_NOMEM, "device allocation #%lld (%zu bytes) failed: out of device memory "
                          "(injected fault)", k, n);
        }
    }
    return g_faults.alloc(be, n, out);
}

static strata_status fault_host_alloc(st_backend *be, size_t n, void **out) {
    if (be == atomic_load(&g_faults.be) && g_faults.host_nth > 0) {
        const long long k = atomic_fetch_add(&g_faults.n_host, 1) + 1;
        if (k == g_faults.host_nth) {
            if (out) *out = NULL;
            return st_err(STRATA_ERR_NOMEM, "pinned host allocation #%lld (%zu bytes) failed: out of host "
                          "memory (injected fault)", k, n);
        }
    }
    return g_faults.host_alloc(be, n, out);
}

void st_backend_inject_alloc_faults(st_backend *be, int64_t device_nth, int64_t host_nth) {
    if (!be || (device_nth <= 0 && host_nth <= 0)) return;
    g_faults.alloc = be->checked.alloc;
    g_faults.host_alloc = be->checked.host_alloc;
    g_faults.device_nth = device_nth;
    g_faults.host_nth = host_nth;
    atomic_store(&g_faults.n_device, 0);
    atomic_store(&g_faults.n_host, 0);
    atomic_store(&g_faults.be, be);
    be->checked.alloc = fault_alloc;
    be->checked.host_alloc = fault_host_alloc;
}

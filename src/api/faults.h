/* api/faults: allocation failures injected into a backend, for tests (the
 * tools' --test-fault device-alloc:N / host-alloc:N in test builds, and
 * strata_model_params' device_alloc_fail_nth / host_alloc_fail_nth).
 *
 * st_backend_inject_alloc_faults replaces the backend's alloc and host_alloc
 * entries (its validating table) with counting wrappers: the Nth call of
 * each, counted from 1 over the backend's life, fails with STRATA_ERR_NOMEM
 * and a message naming the allocation ("device allocation #N (M bytes)
 * failed: ... (injected fault)"), as a real out-of-memory would, without
 * allocating; every other call goes to the backend. One backend per process
 * at a time carries faults (a test process loads one model); a later call
 * moves them to another backend. Thread-safe counters. */
#pragma once
#include <stdint.h>
#include "backend/backend.h"

void st_backend_inject_alloc_faults(st_backend *be, int64_t device_nth, int64_t host_nth);

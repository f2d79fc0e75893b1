/* A fixed pool of worker threads for data-parallel loops. */
#pragma once
#include <stdint.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_pool st_pool;

/* fn(ctx, begin, end, thread_index) processes items [begin, end). */
typedef void (*st_pool_fn)(void *ctx, int64_t begin, int64_t end, int thread_index);

/* n_threads <= 0: use the number of online CPUs. The caller owns the pool. */
strata_status st_pool_init(int n_threads, st_pool **out);
void st_pool_free(st_pool *p); /* NULL is a no-op; joins the workers */
int st_pool_threads(const st_pool *p);
/* Splits [0, n) into contiguous chunks of at least `grain` items (the last
 * perhaps fewer) over the threads (the caller's thread works too) and returns
 * when all are done; n <= grain runs on the caller alone, waking no worker.
 * Chunks shrink as the items run out (a share of those left, never below the
 * grain), so the threads finish together. Workers spin for a while after a
 * job (back-to-back ops wake no one), then sleep: an idle pool burns no core.
 * Not reentrant: one parallel_for at a time per pool. */
void st_pool_parallel_for(st_pool *p, int64_t n, int64_t grain, st_pool_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif

/* pool: a fixed set of worker threads for data-parallel loops.
 *
 * One job at a time; the caller thread takes part. All coordination goes
 * through one atomic word, ctl = job generation << 32 | CLOSED | active, where
 * `active` counts the workers that joined the current job:
 *   caller: under `mu`, writes the job fields and stores ctl = (gen+1) << 32
 *           (release), broadcasts `cv_work`; takes chunks itself; then sets
 *           CLOSED (no worker may join any more) and waits until `active` is 0
 *           (brief spin, then `cv_done` under `mu`).
 *   worker: waits for a new generation (brief spin on ctl, then `cv_work`
 *           under `mu`); joins by a CAS that increments `active` only while
 *           the generation is the one it saw and the job is not CLOSED; a
 *           joined worker takes chunks from the atomic cursor `next` until
 *           [0, n) is exhausted, then decrements `active`; the one that
 *           brings a CLOSED job to 0 signals `cv_done` under `mu`.
 * So a worker that wakes late (descheduled, oversubscribed machine) never
 * delays the caller: it finds the job closed and goes back to sleep without
 * touching the job fields.
 * Happens-before: job fields -> joined workers through the release store and
 * the acquire CAS on ctl; workers' writes -> caller through the acq_rel
 * decrement and the caller's acquire loads. The caller returns only when no
 * worker is joined, so job fields are never rewritten under a reader.
 * No lost wake-ups: ctl's generation and `stop` change under `mu` before the
 * broadcast, and sleepers re-check them under `mu`; the caller checks
 * `active` under `mu` and the last worker signals under `mu`. */
#include "core/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"

/* Spin iterations before blocking (each a pause instruction on x86, 10 to 140
 * cycles): up to tens of microseconds, enough to bridge back-to-back small ops
 * without burning a core while idle. */
#define POOL_SPIN 2000

#define CTL_CLOSED (1ull << 31)
#define CTL_ACTIVE (CTL_CLOSED - 1)

struct st_pool {
    int n_threads;      /* including the caller */
    pthread_t *threads; /* n_threads - 1 workers */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    atomic_uint_fast64_t ctl;
    atomic_bool stop;
    /* the current job (written by the caller before publishing ctl) */
    st_pool_fn fn;
    void *ctx;
    int64_t n;
    int64_t chunk;
    atomic_int_fast64_t next;
};

typedef struct {
    st_pool *p;
    int index;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_chunks(st_pool *p, int index) {
    const int64_t n = p->n, chunk = p->chunk;
    for (;;) {
        int64_t b = atomic_fetch_add_explicit(&p->next, chunk, memory_order_relaxed);
        if (b >= n) break;
        int64_t e = n - b < chunk ? n : b + chunk;
        p->fn(p->ctx, b, e, index);
    }
}

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    free(arg);
    st_pool *p = wa.p;
    uint64_t seen = 0; /* generation last seen */
    for (;;) {
        uint64_t c = atomic_load_explicit(&p->ctl, memory_order_acquire);
        for (int i = 0; (c >> 32) == seen && i < POOL_SPIN; i++) {
            if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
            cpu_relax();
            c = atomic_load_explicit(&p->ctl, memory_order_acquire);
        }
        if ((c >> 32) == seen) {
            pthread_mutex_lock(&p->mu);
            while (((c = atomic_load_explicit(&p->ctl, memory_order_acquire)) >> 32) == seen &&
                   !atomic_load_explicit(&p->stop, memory_order_acquire))
                pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
            if ((c >> 32) == seen) break; /* stop requested, no new job */
        }
        seen = c >> 32;
        bool joined = false;
        while (!(c & CTL_CLOSED) && (c >> 32) == seen) {
            if (atomic_compare_exchange_weak_explicit(&p->ctl, &c, c + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
                joined = true;
                break;
            }
        }
        if (!joined) continue; /* too late for that job */
        run_chunks(p, wa.index);
        uint64_t prev = atomic_fetch_sub_explicit(&p->ctl, 1, memory_order_acq_rel);
        if ((prev & CTL_CLOSED) && (prev & CTL_ACTIVE) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

strata_status st_pool_init(int n_threads, st_pool **out) {
    *out = NULL;
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    if (n_threads > 1024)
        return st_err(STRATA_ERR_INVALID_ARG, "pool: %d threads is more than the 1024 allowed",
                      n_threads);
    st_pool *p = st_calloc(1, sizeof *p);
    if (!p) return st_err(STRATA_ERR_NOMEM, "pool: out of memory");
    p->n_threads = n_threads;
    atomic_init(&p->ctl, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->next, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (n_threads > 1) {
        p->threads = st_calloc((size_t)(n_threads - 1), sizeof *p->threads);
        if (!p->threads) {
            st_pool_free(p);
            return st_err(STRATA_ERR_NOMEM, "pool: out of memory");
        }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = st_malloc(sizeof *wa);
        int rc = wa ? 0 : -1;
        if (wa) {
            wa->p = p;
            wa->index = i;
            rc = pthread_create(&p->threads[i - 1], NULL, worker_main, wa);
            if (rc != 0) free(wa);
        }
        if (rc != 0) {
            p->n_threads = i; /* only the workers started so far get joined */
            st_pool_free(p);
            return st_err(STRATA_ERR_INTERNAL, "pool: cannot start worker thread %d of %d: %s", i,
                          n_threads, rc > 0 ? strerror(rc) : "out of memory");
        }
    }
    *out = p;
    return STRATA_OK;
}

void st_pool_free(st_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store_explicit(&p->stop, true, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i - 1], NULL);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    st_free(p->threads);
    st_free(p);
}

int st_pool_threads(const st_pool *p) { return p ? p->n_threads : 1; }

void st_pool_parallel_for(st_pool *p, int64_t n, int64_t grain, st_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (!p || p->n_threads == 1 || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    /* About four chunks per thread for balance, never below the grain. */
    int64_t nt = p->n_threads;
    int64_t chunk = (n + 4 * nt - 1) / (4 * nt);
    if (chunk < grain) chunk = grain;

    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->chunk = chunk;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    const uint64_t gen = (atomic_load_explicit(&p->ctl, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&p->ctl, gen << 32, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);

    run_chunks(p, 0);

    uint64_t c = atomic_fetch_or_explicit(&p->ctl, CTL_CLOSED, memory_order_acq_rel);
    if ((c & CTL_ACTIVE) == 0) return;
    for (int i = 0; i < POOL_SPIN; i++) {
        if ((atomic_load_explicit(&p->ctl, memory_order_acquire) & CTL_ACTIVE) == 0) return;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while ((atomic_load_explicit(&p->ctl, memory_order_acquire) & CTL_ACTIVE) != 0)
        pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

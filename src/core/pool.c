/* pool: a fixed set of worker threads for data-parallel loops.
 *
 * One job at a time; the caller thread takes part. All coordination goes
 * through one atomic word, ctl = job generation << 32 | CLOSED | active, where
 * `active` counts the workers that joined the current job:
 *   caller: writes the job fields and stores ctl = (gen+1) << 32 (seq_cst,
 *           a release); if a worker sleeps (`sleepers` > 0, read after that
 *           store) broadcasts `cv_work` under `mu`; takes chunks itself; then
 *           sets CLOSED (no worker may join any more) and waits until
 *           `active` is 0 (spinning up to POOL_SPIN_NS, then `cv_done` under
 *           `mu`).
 *   worker: waits for a new generation (spinning on ctl up to POOL_SPIN_NS
 *           after its last job, then under `mu`: sleepers + 1, re-check,
 *           `cv_work`); joins by a CAS that increments `active` only while
 *           the generation is the one it saw and the job is not CLOSED; a
 *           joined worker takes chunks from the cursor `next` until [0, n)
 *           is exhausted, then decrements `active`; the one that brings a
 *           CLOSED job to 0 signals `cv_done` under `mu`.
 * Chunks are guided: each takes a 1/(2 x threads) share of the items left,
 * never fewer than the grain, so the last chunks are small and the threads
 * finish together.
 * So a worker that wakes late (descheduled, oversubscribed machine) never
 * delays the caller: it finds the job closed and goes back to waiting without
 * touching the job fields. Spinning is bounded in time, so an idle pool (a
 * server between requests) sleeps after POOL_SPIN_NS.
 * Happens-before: job fields -> joined workers through the release store and
 * the acquire CAS on ctl; workers' writes -> caller through the acq_rel
 * decrement and the caller's acquire loads. The caller returns only when no
 * worker is joined, so job fields are never rewritten under a reader.
 * No lost wake-ups: a sleeping worker increments `sleepers` and then reads
 * ctl, the caller stores ctl and then reads `sleepers`, all seq_cst, so one
 * of them sees the other's write: either the worker sees the new generation
 * and does not wait, or the caller broadcasts under `mu`, which the worker
 * holds from its increment until it waits. `stop` changes under `mu` before
 * a broadcast; the caller checks `active` under `mu` and the last worker
 * signals under `mu`. */
#include "core/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"

/* How long a worker spins for the next job after its last one, and the
 * caller for the workers' last chunks, before blocking: long enough to bridge
 * the serial gaps of a decode step and between steps (a worker put to sleep
 * costs tens of microseconds to wake), short enough not to burn a core while
 * the pool is idle nor to starve the thread it waits for on an
 * oversubscribed machine (bench/bench_pool: 200 us was slower than 50 us
 * there, and no faster on an idle one). */
#define POOL_SPIN_NS 50000
/* Pause instructions between two reads of the clock while spinning. */
#define POOL_SPIN_CHECK 64

#define CTL_CLOSED (1ull << 31)
#define CTL_ACTIVE (CTL_CLOSED - 1)

struct st_pool {
    int n_threads;      /* including the caller */
    pthread_t *threads; /* n_threads - 1 workers */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    atomic_uint_fast64_t ctl;
    atomic_int sleepers; /* workers about to wait or waiting on cv_work */
    atomic_bool stop;
    /* the current job (written by the caller before publishing ctl) */
    st_pool_fn fn;
    void *ctx;
    int64_t n;
    int64_t grain;
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

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins until done(p) or POOL_SPIN_NS have passed; returns done(p). */
static bool spin_until(st_pool *p, bool (*done)(st_pool *, void *), void *arg) {
    uint64_t t0 = 0;
    for (int i = 0;; i++) {
        if (done(p, arg)) return true;
        cpu_relax();
        if (i % POOL_SPIN_CHECK == 0) {
            const uint64_t t = now_ns();
            if (i == 0) t0 = t;
            if (t - t0 >= POOL_SPIN_NS) return done(p, arg);
        }
    }
}

static void run_chunks(st_pool *p, int index) {
    const int64_t n = p->n, grain = p->grain, share = 2 * (int64_t)p->n_threads;
    int64_t b = atomic_load_explicit(&p->next, memory_order_relaxed);
    while (b < n) {
        int64_t c = (n - b) / share;
        if (c < grain) c = grain;
        const int64_t e = n - b < c ? n : b + c;
        if (!atomic_compare_exchange_weak_explicit(&p->next, &b, e, memory_order_relaxed, memory_order_relaxed))
            continue; /* b reloaded */
        p->fn(p->ctx, b, e, index);
        b = atomic_load_explicit(&p->next, memory_order_relaxed);
    }
}

/* A new job (generation other than *seen) or stop. */
static bool new_job(st_pool *p, void *seen) {
    return (atomic_load_explicit(&p->ctl, memory_order_acquire) >> 32) != *(uint64_t *)seen ||
           atomic_load_explicit(&p->stop, memory_order_acquire);
}

/* No worker joined to the current job. */
static bool none_active(st_pool *p, void *unused) {
    (void)unused;
    return (atomic_load_explicit(&p->ctl, memory_order_acquire) & CTL_ACTIVE) == 0;
}

static void *worker_main(void *arg) {
    worker_arg wa = *(worker_arg *)arg;
    free(arg);
    st_pool *p = wa.p;
    uint64_t seen = 0; /* generation last seen */
    for (;;) {
        if (!spin_until(p, new_job, &seen)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
            while ((atomic_load_explicit(&p->ctl, memory_order_seq_cst) >> 32) == seen &&
                   !atomic_load_explicit(&p->stop, memory_order_relaxed)) /* stop: written under mu */
                pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_seq_cst);
            pthread_mutex_unlock(&p->mu);
        }
        uint64_t c = atomic_load_explicit(&p->ctl, memory_order_seq_cst);
        if ((c >> 32) == seen) break; /* stop requested, no new job */
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
    if (!p) return st_err(STRATA_ERR_NOMEM, "pool: out of memory for its state (%zu bytes)", sizeof *p);
    p->n_threads = n_threads;
    atomic_init(&p->ctl, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, false);
    atomic_init(&p->next, 0);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    if (n_threads > 1) {
        p->threads = st_calloc((size_t)(n_threads - 1), sizeof *p->threads);
        if (!p->threads) {
            st_pool_free(p);
            return st_err(STRATA_ERR_NOMEM, "pool: out of memory for %d threads", n_threads - 1);
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
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    const uint64_t gen = (atomic_load_explicit(&p->ctl, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&p->ctl, gen << 32, memory_order_seq_cst);
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }

    run_chunks(p, 0);

    uint64_t c = atomic_fetch_or_explicit(&p->ctl, CTL_CLOSED, memory_order_acq_rel);
    if ((c & CTL_ACTIVE) == 0 || spin_until(p, none_active, NULL)) return;
    pthread_mutex_lock(&p->mu);
    while ((atomic_load_explicit(&p->ctl, memory_order_acquire) & CTL_ACTIVE) != 0)
        pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

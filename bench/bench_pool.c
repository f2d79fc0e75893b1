/* The thread pool's cost per decode token (core/pool.h): wake-ups, chunk
 * hand-out and joins, with the op shapes of a small model's decode step.
 *
 *   bench_pool [THREADS] [NS_PER_MAC]
 *
 * One token = SmolLM2-135M's parallel ops (per layer: the q|k|v, o, gate|up
 * and down matmuls, 4 weight rows per item, and the attention's 3 items at
 * context 96; then lm_head; 151 calls), each item busy for its multiply-adds
 * x NS_PER_MAC (default 0.1, about an int8 kernel's rate) with the grain the
 * CPU backend gives it, and 2 us of serial work (the caller's small ops)
 * between calls. Tokens follow each other after a gap of serial work (0 to
 * 1000 us: the host's work between steps, or a pause in serving). Printed:
 * the median time per token beyond the ideal (the same token on one thread,
 * its parallel part divided by the threads), i.e. the pool's overhead per
 * token (wake-ups, joins, chunks ending unevenly). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/pool.h"

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Busy work of about `ns` nanoseconds (calibrated in main). */
static volatile double g_sink;
static double g_iters_per_ns = 1.0;
static void spin_work(double ns) {
    double acc = 0;
    const long n = (long)(ns * g_iters_per_ns);
    for (long i = 0; i < n; i++) acc = acc * 0.999 + 1.0;
    g_sink = acc;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    int64_t items, macs_per_item;
} op_shape;

static double g_ns_per_mac = 0.1;

static void item_fn(void *ctx, int64_t b, int64_t e, int ti) {
    (void)ti;
    spin_work((double)(e - b) * (double)((const op_shape *)ctx)->macs_per_item * g_ns_per_mac);
}

/* The CPU backend's grains: ~64K multiply-adds per matmul chunk, ~32K per
 * attention chunk (cpu_matmul.c, cpu_attention.c). */
static int64_t grain_of(const op_shape *s, int64_t per_chunk) {
    const int64_t g = per_chunk / s->macs_per_item;
    return g < 1 ? 1 : g;
}

/* d 576, ffn 1536, 9 / 3 heads of 64, vocab 49152: per layer q|k|v, the
 * attention at context 96, o, gate|up, down; then lm_head */
static const op_shape g_layer[5] = {{960 / 4, 4 * 576},  {3, 96 * 3 * 128},    {576 / 4, 4 * 576},
                                    {3072 / 4, 4 * 576}, {576 / 4, 4 * 1536}};
static const op_shape g_head = {49152 / 4, 4 * 576};

/* The median time of a token (50, after 10 of warm-up; the machine may be
 * shared), each after `gap_us` of serial work. */
static double median_token(st_pool *p, double gap_us) {
    enum { TOKENS = 60, WARM = 10 };
    double times[TOKENS - WARM];
    for (int t = 0; t < TOKENS; t++) {
        spin_work(gap_us * 1000);
        const double t0 = now_ns();
        for (int l = 0; l < 30; l++)
            for (int o = 0; o < 5; o++) {
                st_pool_parallel_for(p, g_layer[o].items, grain_of(&g_layer[o], o == 1 ? 32768 : 65536), item_fn,
                                     (void *)&g_layer[o]);
                spin_work(2000);
            }
        st_pool_parallel_for(p, g_head.items, grain_of(&g_head, 65536), item_fn, (void *)&g_head);
        spin_work(2000);
        if (t >= WARM) times[t - WARM] = now_ns() - t0;
    }
    qsort(times, TOKENS - WARM, sizeof times[0], cmp_double);
    return times[(TOKENS - WARM) / 2];
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    if (argc > 2) g_ns_per_mac = atof(argv[2]);
    {
        const double t0 = now_ns();
        const long n = 20000000;
        double acc = 0;
        for (long i = 0; i < n; i++) acc = acc * 0.999 + 1.0;
        g_sink = acc;
        g_iters_per_ns = (double)n / (now_ns() - t0);
    }
    st_pool *p = NULL, *p1 = NULL;
    if (st_pool_init(threads, &p) != STRATA_OK || st_pool_init(1, &p1) != STRATA_OK) return 1;
    printf("pool: %d threads; a token: SmolLM2-135M's 151 parallel calls at %.2f ns per multiply-add, 2 us of "
           "serial work after each\n", threads, g_ns_per_mac);
    /* the ideal: the same token on the caller alone (no pool at work), its
     * parallel part divided by the threads */
    const double serial = 151 * 2000.0, t1 = median_token(p1, 0);
    const double ideal = (t1 - serial) / threads + serial;
    printf("one thread: %.1f us per token; ideal on %d: %.1f us\n", t1 / 1000, threads, ideal / 1000);
    static const double gaps_us[] = {0, 50, 200, 1000};
    for (int g = 0; g < 4; g++) {
        const double med = median_token(p, gaps_us[g]);
        printf("gap between tokens %5.0f us: %8.1f us per token, %7.1f us (%4.1f%%) over the ideal\n", gaps_us[g],
               med / 1000, (med - ideal) / 1000, 100 * (med - ideal) / med);
    }
    st_pool_free(p1);
    st_pool_free(p);
    return 0;
}

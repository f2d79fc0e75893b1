/* The CPU backend's quantized matmul on the shapes of a 70B model's FFN in
 * decode (one token: gate/up N = 28672, K = 8192; down N = 8192, K = 28672),
 * beside the machine's memory read rate measured in the same run.
 *
 *   bench_cpu_matmul [THREADS[,THREADS...]] [REPS] [DTYPES] [n1]
 *
 * THREADS: comma-separated thread counts (default 1 and all cores); REPS:
 * timed calls per case, best taken (default 10); DTYPES: comma-separated
 * from q4_0, q8_0, q4_K, q4_1, q6_K (default q4_0). Per thread count: the
 * read rate of a 1 GiB buffer (strata bench's "memory read",
 * tools/roofline.c), then per shape, dtype and activation precision
 * (int8 on AMX tiles where the CPU has them, int8 on the ISA level's
 * kernels; on AVX-512 also without the 16-row few-token kernel and with it at
 * one token; precise) the time of one call with n = 1 token, and at n = 1, 2,
 * 4, 5 and 8 tokens (a speculative verification pass) the weight bytes read per
 * second and their fraction of the read rate; with 64 tokens the
 * multiply-add rate. Weights are random (scales fixed), over
 * 100 MB each, in copies that exceed 4x the last-level cache together (1 GiB at least), one
 * copy a call, so every call streams them from DRAM. Not run in CI. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_internal.h"
#include "core/pool.h"
#include "core/core.h"
#include "roofline.h"
#include "weights/measure.h"

static uint8_t *make_weight(st_dtype t, int64_t N, int64_t K) {
    const size_t rb = st_dtype_row_bytes(t, K), bytes = rb * (size_t)N;
    uint8_t *w = malloc(bytes);
    if (!w) return NULL;
    uint32_t x = 12345u;
    for (size_t i = 0; i < bytes; i += 4) {
        x = x * 1664525u + 1013904223u;
        memcpy(w + i, &x, bytes - i < 4 ? bytes - i : 4);
    }
    const st_dtype_info *di = st_dtype_get(t);
    const uint16_t h = 0x1c00; /* f16 2^-8: every scale and min */
    for (size_t b = 0; b < bytes; b += di->block_bytes) {
        switch (t) {
        case ST_DTYPE_Q4_0: case ST_DTYPE_Q8_0: memcpy(w + b, &h, 2); break;
        case ST_DTYPE_Q4_1: case ST_DTYPE_Q4_K: memcpy(w + b, &h, 2), memcpy(w + b + 2, &h, 2); break;
        case ST_DTYPE_Q6_K: memcpy(w + b + 208, &h, 2); break;
        default: break;
        }
    }
    return w;
}

/* The best of reps timed calls (after one warm-up), each on the next of the nw copies of the
 * weight (*next: the caller's rotation, carried across calls): copies enough to exceed the
 * last-level cache 4x, so each call reads from DRAM even where the cache holds one copy (the
 * GPU machine's Xeon: 300 MiB of L3). */
static double time_call(st_backend *be, const float *x, const st_weight *w, int nw, int *next, int64_t n, float *y,
                        int reps) {
    double best = 1e30;
    for (int r = 0; r < reps + 1; r++) {
        const double t0 = st_time_now();
        const st_weight *wc = &w[*next];
        *next = (*next + 1) % nw;
        if (be->ops->matmul(be, NULL, x, wc, n, y) != STRATA_OK) return 0;
        const double dt = st_time_now() - t0;
        if (r > 0 && dt < best) best = dt; /* the first is a warm-up */
    }
    return best;
}

int main(int argc, char **argv) {
    int threads[16];
    const int n_thr = tool_bench_threads(argc > 1 ? argv[1] : NULL, threads, 16);
    const int reps = argc > 2 ? atoi(argv[2]) : 10;
    const bool only_n1 = argc > 4 && !strcmp(argv[4], "n1"); /* 4th argument n1: one token only */
    st_dtype dts[8];
    int n_dt = 0;
    char dbuf[128] = "q4_0";
    if (argc > 3) snprintf(dbuf, sizeof dbuf, "%s", argv[3]);
    for (char *s = strtok(dbuf, ","); s && n_dt < 8; s = strtok(NULL, ",")) {
        if (!st_dtype_parse(s, &dts[n_dt])) {
            fprintf(stderr, "bench_cpu_matmul: unknown dtype %s\n", s);
            return 2;
        }
        n_dt++;
    }
    static const int64_t shapes[][2] = {{28672, 8192}, {8192, 28672}};
    const int64_t nmax = 64;
    float *x = malloc((size_t)nmax * 28672 * sizeof(float)), *y = malloc((size_t)nmax * 28672 * sizeof(float));
    uint32_t r = 777u;
    for (int64_t i = 0; i < nmax * 28672; i++) {
        r = r * 1664525u + 1013904223u;
        x[i] = (float)(r >> 8) / 8388608.0f - 1.0f;
    }
    for (int ti = 0; ti < n_thr; ti++) {
        st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = threads[ti]};
        st_backend *be = NULL;
        if (st_backend_init(&bp, &be) != STRATA_OK) {
            fprintf(stderr, "bench_cpu_matmul: backend init failed\n");
            return 1;
        }
        st_pool *pool = NULL;
        if (st_pool_init(threads[ti], &pool) != STRATA_OK) return 1;
        const double bw = tool_measure_read_bw(pool, (size_t)1 << 30);
        st_pool_free(pool);
        printf("threads %d: memory read %.2f GB/s (1 GiB buffer)\n", threads[ti], bw / 1e9);
        for (int di = 0; di < n_dt; di++)
            for (int si = 0; si < 2; si++) {
                const int64_t N = shapes[si][0], K = shapes[si][1];
                uint8_t *wd = make_weight(dts[di], N, K);
                if (!wd) return 1;
                const double bytes = (double)st_dtype_row_bytes(dts[di], K) * (double)N;
                const double llc4 = 4.0 * (double)st_wbw_llc_bytes();
                const double span = llc4 > (double)(1u << 30) ? llc4 : (double)(1u << 30);
                int nw = (int)(span / bytes) + 1;
                if (nw > 16) nw = 16;
                st_weight w[16];
                int next = 0;
                for (int c = 0; c < nw; c++) {
                    uint8_t *cp = c ? malloc((size_t)bytes) : wd;
                    if (!cp) return 1;
                    if (c) memcpy(cp, wd, (size_t)bytes);
                    w[c] = (st_weight){cp, dts[di], N, K, 0};
                }
                /* int8 on AMX tiles where usable, int8 on the ISA level's kernels, the same without
                 * the 16-row few-token kernel (the 8-row ones: before it) and with it at one token too,
                 * precise */
                static const char *mname[5] = {"int8-amx", "int8", "int8-w16off", "int8-w16n1", "precise"};
                for (int mode = 0; mode < 5; mode++) {
                    const bool act8 = mode < 4;
                    if (mode == 0 && !st_cpu_amx_usable()) continue;
                    if ((mode == 2 || mode == 3) && st_cpu_isa_supported() != ST_CPU_ISA_AVX512) continue;
                    st_backend_cpu_set_act8(be, act8);
                    st_backend_cpu_set_amx(be, mode == 0 ? ST_CPU_AMX_ON : ST_CPU_AMX_OFF);
                    st_backend_cpu_set_w16(be, mode == 2 ? 0 : mode == 3 ? 1 : ST_CPU_W16_MIN);
                    const int64_t ns[5] = {1, 2, 4, 5, 8};
                    double gbs[5], t1 = 0;
                    for (int i = 0; i < 5; i++) {
                        const int r = i ? (reps > 3 ? 3 : reps) : reps;
                        const double t = only_n1 && i ? 1e30 : time_call(be, x, w, nw, &next, ns[i], y, r);
                        if (!i) t1 = t;
                        gbs[i] = bytes / t / 1e9;
                    }
                    const double t64 = only_n1 ? 1e30 : time_call(be, x, w, nw, &next, 64, y, 1);
                    printf("  %-5s N=%-5lld K=%-5lld %-11s n=1: %7.3f ms, GB/s of weights (%% of the read rate):",
                           st_dtype_name(dts[di]), (long long)N, (long long)K, mname[mode], t1 * 1e3);
                    for (int i = 0; i < 5; i++)
                        printf(" n=%lld %6.2f (%3.0f%%)", (long long)ns[i], gbs[i], 100.0 * gbs[i] * 1e9 / bw);
                    printf(" | n=64: %6.1f GMAC/s\n", 64.0 * N * K / t64 / 1e9);
                    fflush(stdout);
                }
                for (int c = 0; c < nw; c++) free((void *)w[c].data);
            }
        st_backend_free(be);
    }
    free(x);
    free(y);
    return 0;
}

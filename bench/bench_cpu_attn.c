/* The CPU backend's decode attention over host KV rows (attention_rows: what
 * a streamed decode attends on the CPU, `--kv-cpu-attn`, and the paged
 * decode's per-key work) on a Llama-3-8B layer (32 query heads, 8 kv heads,
 * head dim 128), beside the machine's memory read rate measured in the same
 * run.
 *
 *   bench_cpu_attn [THREADS[,THREADS...]] [REPS] [KEYS[,KEYS...]] [N] [DTYPES]
 *
 * THREADS: comma-separated thread counts (default 1 and all cores); REPS:
 * timed calls per case, best taken (default 5); KEYS: comma-separated key
 * counts (default 65536 and 262144: 256 MiB and 1 GiB of bf16 K and V, the
 * second past any last-level cache); N: tokens per call (default 1, a decode
 * step; up to 8, a verification pass); DTYPES: bf16, fp8 or both (default
 * bf16,fp8). Per thread count: the read rate of a
 * 1 GiB buffer (strata bench's "memory read", tools/roofline.c), then per KV
 * dtype (bf16, fp8) and key count the time of one call and the KV bytes read
 * per second, with their fraction of the read rate. Not run in CI. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"
#include "core/pool.h"
#include "roofline.h"

enum { HEADS = 32, KV_HEADS = 8, HD = 128, MAX_N = 8 };

static void fill(uint8_t *p, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint8_t)(seed >> 24);
    }
}

int main(int argc, char **argv) {
    int threads[16];
    const int n_thr = tool_bench_threads(argc > 1 ? argv[1] : NULL, threads, 16);
    const int reps = argc > 2 ? atoi(argv[2]) : 5;
    int64_t keys[8] = {65536, 262144};
    int n_keys = 2;
    if (argc > 3) {
        n_keys = 0;
        for (char *s = strtok(argv[3], ","); s && n_keys < 8; s = strtok(NULL, ",")) keys[n_keys++] = atoll(s);
    }
    const int64_t n = argc > 4 ? atoll(argv[4]) : 1;
    const char *dts = argc > 5 ? argv[5] : "bf16,fp8";
    if (reps < 1 || n < 1 || n > MAX_N || n_thr == 0 || n_keys == 0) {
        fprintf(stderr, "usage: bench_cpu_attn [THREADS[,THREADS...]] [REPS >= 1] [KEYS[,KEYS...]] [N 1..8] [bf16,fp8]\n");
        return 2;
    }
    int64_t kmax = 0;
    for (int i = 0; i < n_keys; i++) {
        if (keys[i] < 1) {
            fprintf(stderr, "bench_cpu_attn: key count %lld\n", (long long)keys[i]);
            return 2;
        }
        kmax = keys[i] > kmax ? keys[i] : kmax;
    }
    const size_t row = (size_t)KV_HEADS * HD; /* elements per key */
    uint8_t *k = malloc(kmax * row * 2), *v = malloc(kmax * row * 2);
    float *ks = malloc((size_t)kmax * KV_HEADS * sizeof(float)), *vs = malloc((size_t)kmax * KV_HEADS * sizeof(float));
    float *q = malloc((size_t)MAX_N * HEADS * HD * sizeof(float)), *out = malloc((size_t)MAX_N * HEADS * HD * sizeof(float));
    float *lse = malloc((size_t)MAX_N * HEADS * sizeof(float));
    int32_t pos[MAX_N];
    if (!k || !v || !ks || !vs || !q || !out || !lse) {
        fprintf(stderr, "bench_cpu_attn: out of memory for %lld keys\n", (long long)kmax);
        return 1;
    }
    fill(k, kmax * row * 2, 1), fill(v, kmax * row * 2, 2);
    for (size_t i = 0; i < kmax * row; i++) { /* bf16 of modest magnitude: sign, exponent 2^-4..2^3 */
        ((uint16_t *)k)[i] = (uint16_t)((((uint16_t *)k)[i] & 0x807f) | ((123 + (((uint16_t *)k)[i] >> 7 & 7)) << 7));
        ((uint16_t *)v)[i] = (uint16_t)((((uint16_t *)v)[i] & 0x807f) | ((123 + (((uint16_t *)v)[i] >> 7 & 7)) << 7));
    }
    for (size_t i = 0; i < kmax * row * 2; i++) { /* read as fp8: no NaN byte (S.1111.111); a bf16's low byte */
        if ((k[i] & 0x7f) == 0x7f) k[i] ^= 1;
        if ((v[i] & 0x7f) == 0x7f) v[i] ^= 1;
    }
    for (int64_t i = 0; i < kmax * KV_HEADS; i++) ks[i] = vs[i] = 0.01f;
    fill((uint8_t *)q, (size_t)MAX_N * HEADS * HD * sizeof(float), 3);
    for (int64_t i = 0; i < MAX_N * HEADS * HD; i++) q[i] = (float)((int)(((uint32_t *)q)[i] >> 16) % 2001 - 1000) / 1000.0f;
    for (int ti = 0; ti < n_thr; ti++) {
        st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = threads[ti]};
        st_backend *be = NULL;
        st_stream *s = NULL;
        if (st_backend_init(&bp, &be) != STRATA_OK || be->ops->stream_create(be, false, &s) != STRATA_OK) {
            fprintf(stderr, "bench_cpu_attn: backend init failed: %s\n", st_last_error());
            return 1;
        }
        st_pool *pool = NULL;
        if (st_pool_init(threads[ti], &pool) != STRATA_OK) return 1;
        const double bw = tool_measure_read_bw(pool, (size_t)1 << 30);
        st_pool_free(pool);
        printf("threads %d: memory read %.2f GB/s (1 GiB buffer); %lld token(s) a call, %d/%d heads, head dim %d\n",
               threads[ti], bw / 1e9, (long long)n, HEADS, KV_HEADS, HD);
        for (int dt = 0; dt < 2; dt++) {
            const st_kv_dtype t = dt == 0 ? ST_KV_BF16 : ST_KV_FP8;
            if (!strstr(dts, st_kv_dtype_name(t))) continue;
            for (int ki = 0; ki < n_keys; ki++) {
                const int64_t nk = keys[ki];
                const st_kv_layer rows = {.k = k, .v = v, .k_scale = ks, .v_scale = vs, .dtype = t, .n_slots = nk,
                                          .n_kv_heads = KV_HEADS, .head_dim = HD};
                for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)(nk - n + i);
                const double bytes = (double)nk * row * st_kv_dtype_size(t) * 2 +
                                     (t == ST_KV_FP8 ? (double)nk * KV_HEADS * 2 * sizeof(float) : 0);
                double best = 1e30;
                for (int r = 0; r <= reps; r++) {
                    const double t0 = st_time_now();
                    if (be->ops->attention_rows(be, s, q, &rows, pos, n, 0, nk, HEADS, KV_HEADS, HD,
                                                1.0f / sqrtf((float)HD), false, out, lse) != STRATA_OK) {
                        fprintf(stderr, "bench_cpu_attn: attention_rows: %s\n", st_last_error());
                        return 1;
                    }
                    const double dtm = st_time_now() - t0;
                    if (r > 0 && dtm < best) best = dtm; /* the first is a warm-up */
                }
                double sum = 0;
                for (int64_t i = 0; i < n * HEADS * HD; i++) sum += out[i];
                printf("  %-4s keys %-7lld %8.3f ms  %7.2f GB/s of KV (%3.0f%% of the read rate)  checksum %.6e\n",
                       st_kv_dtype_name(t), (long long)nk, best * 1e3, bytes / best / 1e9, 100.0 * bytes / best / bw,
                       sum);
                fflush(stdout);
            }
        }
        be->ops->stream_destroy(be, s);
        st_backend_free(be);
    }
    free(k), free(v), free(ks), free(vs), free(q), free(out), free(lse);
    return 0;
}

/* Device rooflines measured in the same run as a benchmark (strata bench,
 * strata serve): HBM bandwidth and the backend's matrix rate, on a probe
 * backend of their own that is destroyed before the model loads (the
 * engine's backend may be filled to its --device-mem budget afterwards). */
#pragma once
#include <stdbool.h>
#include "backend/backend.h"
#include "core/pool.h"

typedef struct {
    double copy_bw;      /* bytes read + written per second: device-to-device copy of 1 GiB, best of 5 */
    double gemm_fast;    /* FLOP/s: one bf16 GEMM, random 8192x8192 weight x 4096 tokens (the tensor cores' rate) */
    double gemm_precise; /* FLOP/s of useful work on the default precise path (x = hi + lo: two GEMMs) */
} tool_rooflines;

/* Device memory bandwidth (bytes read + written per second) of the backend's
 * own copy of a 1 GiB buffer, best of 5 after a warm-up; 0 when it cannot run. */
double tool_measure_copy_bw(st_backend *be, st_stream *s);

/* Matrix rate (FLOP/s) of the backend's matmul on a random bf16 [dim, dim]
 * weight with `n` tokens, best of 3 after a warm-up (fast: one bf16 GEMM;
 * else the precise path); 0 when it cannot run. */
double tool_measure_matmul_rate(st_backend *be, st_stream *s, int64_t dim, int64_t n, bool fast);

/* For CUDA (bp->kind): all three figures on a temporary backend with a 3 GiB
 * pool on bp's device. Nothing to measure on the CPU: *out zeroed, true.
 * false (message printed to stderr) when a probe failed. */
bool tool_measure_device_rooflines(const st_backend_params *bp, tool_rooflines *out);
/* Pinned host -> device bandwidth: best of 4 copies of 1 GiB; with width > 0,
 * of 2-D copies instead (rows of `width` bytes every `pitch` bytes of the
 * host buffer, packed on the device: the KV host tier's shape). 0 when it
 * cannot run. */
double tool_measure_h2d_bw(st_backend *be, size_t width, size_t pitch);

/* Host memory read rate (bytes/s): best of 5 passes of the pool's threads
 * summing `bytes` of floats in 256 KiB chunks (strata bench --device cpu's
 * "memory read", bench/bench_cpu_matmul); 0 when the buffer cannot be had. */
double tool_measure_read_bw(st_pool *pool, size_t bytes);

/* The thread counts a CPU benchmark runs at (bench/bench_cpu_*): the
 * comma-separated list in arg (at most max), else 1 and all cores; returns how
 * many. arg is cut up (strtok). */
int tool_bench_threads(char *arg, int *threads, int max);

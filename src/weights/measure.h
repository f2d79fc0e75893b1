/* weights/measure: the bandwidths the planner predicts with, measured at
 * start-up on this machine:
 *   h2d       copy_h2d of a pinned buffer into device memory (best of 4);
 *   ssd       O_DIRECT reads of the largest model file itself (up to 256 MiB,
 *             8 MiB requests, 8 in flight through io_uring);
 *   dev_read  weight bytes per second of the backend's matmul at 1 token,
 *             on the dtype and width of the model's largest layer tensor;
 *   gemm      FLOP/s of the same matmul at a prefill batch. CPU: a slice of
 *             at most 32 MiB at up to 128 tokens (cheap); other backends: the
 *             whole tensor at the prefill chunk (`batch` tokens) on non-zero
 *             data, the GEMM a prefill really runs.
 * Figures already non-zero in *bw are kept (given by options or tests).
 * Device memory used meanwhile stays under the budget's free part (a
 * measurement that does not fit is skipped, leaving 0: unknown). */
#pragma once
#include "backend/backend.h"
#include "weights/groups.h"
#include "weights/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

/* The last-level cache's size in bytes (sysfs; 0 when unknown): probes read sets larger than it. */
size_t st_wbw_llc_bytes(void);

strata_status st_wbw_measure(st_backend *be, const st_model_files *files, const st_wgroups *g, int64_t batch,
                             bool direct, st_wbw *bw);
/* The h2d figure alone (best of 4 pinned host -> device copies of up to 256 MiB, at most half the
 * budget's free part; *out unchanged when there is no room), on stream s. */
strata_status st_wbw_measure_h2d(st_backend *be, st_stream *s, double *out);

/* bw->cpu: weight bytes per second of a CPU backend's matmul (`threads`
 * threads, 0: all cores) at `tokens` tokens (the decode pass the hybrid plan
 * balances: 1, or a speculative verification pass) over FFN tensors of the largest one's
 * dtype and shape, read in place from the model's file mapping (host
 * memory, as the CPU tier holds them), in turn, as many as make 8x the
 * last-level cache and 2 GiB (a server's L3 holds a whole 70B FFN tensor: one
 * tensor would measure the cache); the first pass pages them in, then the
 * best of 3. With `dev` (a device backend; NULL or the CPU backend:
 * skipped), also bw->h2d_shared and bw->cpu_shared: the same passes while a
 * thread copies a 512 MiB pinned buffer to the device piece by piece, in
 * three windows of at least 0.25 s; each rate over one window, the window
 * whose sum is the median: what each gets of host memory when the hybrid's
 * two readers run at once. */
strata_status st_wbw_measure_cpu(const st_model_files *files, const st_wgroups *g, int threads, st_cpu_act act,
                                 int64_t tokens, st_backend *dev, st_wbw *bw);

#ifdef __cplusplus
}
#endif

/* weights/measure: start-up bandwidth probes (measure.h). */
#include "weights/measure.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "weights/ssd.h"

#define PROBE_BYTES ((size_t)64 << 20)

static size_t device_free(const st_backend *be) {
    const st_budget *b = &be->device_budget;
    return b->cap ? (b->cap > b->used ? b->cap - b->used : 0) : (size_t)-1;
}

/* Best-of-4 pinned host -> device copy rate. */
strata_status st_wbw_measure_h2d(st_backend *be, st_stream *s, double *out) {
    const st_backend_ops *o = be->ops;
    size_t n = PROBE_BYTES;
    if (device_free(be) / 2 < n) n = device_free(be) / 2 / 4096 * 4096;
    if (n < ((size_t)1 << 20)) return STRATA_OK; /* no room: unknown */
    void *h = NULL, *d = NULL;
    strata_status st = o->host_alloc(be, n, &h);
    if (st == STRATA_OK) st = o->alloc(be, n, &d);
    if (st == STRATA_OK) {
        memset(h, 1, n);
        double best = 0;
        for (int r = 0; r < 5 && st == STRATA_OK; r++) {
            const double t0 = st_time_now();
            st = o->copy_h2d(be, s, d, h, n);
            if (st == STRATA_OK) st = o->stream_sync(be, s);
            const double dt = st_time_now() - t0;
            if (r > 0 && dt > 0 && (double)n / dt > best) best = (double)n / dt;
        }
        if (st == STRATA_OK) *out = best;
    }
    if (d) o->dealloc(be, d);
    if (h) o->host_dealloc(be, h);
    return st;
}

/* O_DIRECT read rate of the largest model file (up to 256 MiB of it). */
static strata_status measure_ssd(const st_model_files *files, bool direct, double *out, bool *was_direct) {
    int fi = 0;
    for (int i = 1; i < files->n_files; i++)
        if (files->files[i].size > files->files[fi].size) fi = i;
    uint64_t total = files->files[fi].size / 4096 * 4096;
    if (total > ((uint64_t)256 << 20)) total = (uint64_t)256 << 20;
    if (total == 0) return STRATA_OK;
    st_ssd_files *sf = NULL;
    st_ssd_queue *q = NULL;
    void *buf = NULL;
    strata_status st = st_ssd_files_open(files, direct, NULL, &sf);
    if (st == STRATA_OK) st = st_ssd_queue_init(sf, 8, false, &q);
    if (st == STRATA_OK && posix_memalign(&buf, 4096, PROBE_BYTES) != 0)
        st = st_err(STRATA_ERR_NOMEM, "ssd probe: out of memory for its aligned buffer (%zu bytes)",
                    (size_t)PROBE_BYTES);
    if (st == STRATA_OK) {
        const double t0 = st_time_now();
        for (uint64_t off = 0; off < total && st == STRATA_OK; off += PROBE_BYTES) {
            const uint64_t len = total - off < PROBE_BYTES ? total - off : PROBE_BYTES;
            st = st_ssd_read(q, fi, off, len, len, buf, (uint64_t)8 << 20);
        }
        const double dt = st_time_now() - t0;
        if (st == STRATA_OK && dt > 0) *out = (double)total / dt;
        *was_direct = st_ssd_files_direct(sf);
    }
    free(buf);
    st_ssd_queue_free(q);
    st_ssd_files_close(sf);
    return st;
}

/* Fills n bytes of device memory with a pattern whose every 16-bit half is
 * 0x3Cxx (xx pseudo-random): finite, non-zero values whatever the dtype
 * (f32, f16, bf16, quantized scales), so that the GEMM runs at its rate on
 * real data (zeros run faster). */
static strata_status fill_pattern(st_backend *be, st_stream *s, void *d, size_t n, uint16_t *h, size_t hn) {
    uint32_t x = 12345u;
    for (size_t i = 0; i < hn / 2; i++) {
        x = x * 1664525u + 1013904223u;
        h[i] = (uint16_t)(0x3C00u | ((x >> 16) & 0x03FFu));
    }
    strata_status st = STRATA_OK;
    for (size_t off = 0; off < n && st == STRATA_OK; off += hn)
        st = be->ops->copy_h2d(be, s, (uint8_t *)d + off, h, n - off < hn ? n - off : hn);
    return st == STRATA_OK ? be->ops->stream_sync(be, s) : st;
}

/* Matmul rates on the dtype and width of the largest layer tensor. CPU (kept
 * cheap): a slice of at most 32 MiB of its rows, at most 128 tokens, zeros.
 * Other backends: the whole tensor (when it fits in half the free budget,
 * else as many rows as do) at the prefill chunk of `batch` tokens, on
 * non-zero data: the GEMM a prefill really runs (a small probe runs far below
 * the device's rate), and a weight read larger than the caches. */
static strata_status measure_matmul(st_backend *be, st_stream *s, const st_wgroups *g, int64_t batch,
                                    double *read_bw, double *gemm) {
    const st_tensor_desc *big = NULL;
    for (int i = 1; i < g->n - 1; i++)
        for (int t = 0; t < g->g[i].n_tensors; t++) {
            const st_tensor_desc *d = g->g[i].t[t].desc;
            if (d->n_dims == 2 && (!big || d->nbytes > big->nbytes)) big = d;
        }
    if (!big) return STRATA_OK;
    const st_backend_ops *o = be->ops;
    const bool cpu = be->kind == ST_BACKEND_CPU;
    const int64_t K = big->shape[1];
    const size_t rb = st_dtype_row_bytes(big->dtype, K);
    if (rb == 0) return STRATA_OK;
    int64_t rows = big->shape[0];
    const int64_t T = batch < 1 ? 1 : cpu && batch > 128 ? 128 : batch;
    if (cpu) {
        if ((size_t)rows * rb > ((size_t)32 << 20)) rows = (int64_t)(((size_t)32 << 20) / rb);
    } else { /* weight + x + y (+ the backend's scratch, about x again) in half the free budget */
        const size_t room = device_free(be) / 2, xb = 2 * (size_t)(T * K) * 4;
        const size_t per_row = rb + (size_t)T * 4;
        if (room < xb + 4 * per_row) return STRATA_OK;
        if ((size_t)rows * per_row > room - xb) rows = (int64_t)((room - xb) / per_row);
    }
    rows = rows / 4 * 4;
    const size_t wb = (size_t)rows * rb, xb = (size_t)(T * K) * 4, yb = (size_t)(T * rows) * 4;
    if (rows < 4 || wb + xb + yb + 3 * 256 > device_free(be)) return STRATA_OK;
    void *w = NULL, *x = NULL, *y = NULL, *host = NULL;
    const size_t hn = (size_t)16 << 20;
    strata_status st = o->alloc(be, wb, &w);
    if (st == STRATA_OK) st = o->alloc(be, xb, &x);
    if (st == STRATA_OK) st = o->alloc(be, yb, &y);
    if (st == STRATA_OK && !(host = calloc(1, hn)))
        st = st_err(STRATA_ERR_NOMEM, "matmul probe: out of memory for its host buffer (%zu bytes)", hn);
    if (st == STRATA_OK && cpu) { /* zeros: cheap, and the CPU's rate does not depend on the values */
        for (size_t off = 0; off < wb && st == STRATA_OK; off += hn)
            st = o->copy_h2d(be, s, (uint8_t *)w + off, host, wb - off < hn ? wb - off : hn);
        for (size_t off = 0; off < xb && st == STRATA_OK; off += hn)
            st = o->copy_h2d(be, s, (uint8_t *)x + off, host, xb - off < hn ? xb - off : hn);
        if (st == STRATA_OK) st = o->stream_sync(be, s);
    } else if (st == STRATA_OK) {
        st = fill_pattern(be, s, w, wb, host, hn);
        if (st == STRATA_OK) st = fill_pattern(be, s, x, xb, host, hn);
    }
    const st_weight wt = {w, big->dtype, rows, K, 0};
    for (int pass = 0; pass < 2 && st == STRATA_OK; pass++) {
        const int64_t n = pass == 0 ? 1 : T;
        double best = 0;
        for (int r = 0; r < (pass == 0 ? 6 : 4) && st == STRATA_OK; r++) {
            const double t0 = st_time_now();
            st = o->matmul(be, s, x, &wt, n, y);
            if (st == STRATA_OK) st = o->stream_sync(be, s);
            const double dt = st_time_now() - t0;
            if (r > 0 && dt > 0) {
                const double v = pass == 0 ? (double)wb / dt : 2.0 * (double)rows * (double)K * (double)n / dt;
                if (v > best) best = v;
            }
        }
        if (st == STRATA_OK) *(pass == 0 ? read_bw : gemm) = best;
    }
    free(host);
    if (w) o->dealloc(be, w);
    if (x) o->dealloc(be, x);
    if (y) o->dealloc(be, y);
    return st;
}

strata_status st_wbw_measure(st_backend *be, const st_model_files *files, const st_wgroups *g, int64_t batch,
                             bool direct, st_wbw *bw) {
    const double t0 = st_time_now();
    st_stream *s = NULL;
    strata_status st = be->ops->stream_create(be, false, &s);
    if (st != STRATA_OK) return st;
    if (bw->h2d <= 0 && (st = st_wbw_measure_h2d(be, s, &bw->h2d)) == STRATA_OK) bw->measured[0] = bw->h2d > 0;
    if (st == STRATA_OK && bw->ssd <= 0 && (st = measure_ssd(files, direct, &bw->ssd, &bw->ssd_direct)) == STRATA_OK)
        bw->measured[1] = bw->ssd > 0;
    if (st == STRATA_OK && (bw->dev_read <= 0 || bw->gemm <= 0)) {
        double r = 0, f = 0;
        st = measure_matmul(be, s, g, batch, &r, &f);
        if (st == STRATA_ERR_NOMEM) { /* the backend's scratch did not fit beside the probe: unknown */
            st_log(STRATA_LOG_INFO, "matmul probe skipped: %s", st_last_error());
            snprintf(bw->skipped, sizeof bw->skipped, "%s", st_last_error()); /* for the plan's message */
            st = STRATA_OK;
            r = f = 0;
        }
        if (st == STRATA_OK) {
            if (bw->dev_read <= 0) bw->dev_read = r, bw->measured[2] = r > 0;
            if (bw->gemm <= 0) bw->gemm = f, bw->measured[3] = f > 0;
        }
    }
    be->ops->stream_destroy(be, s);
    if (st == STRATA_OK)
        st_log(STRATA_LOG_INFO,
               "bandwidths (%.2f s to measure): H2D %.2f GB/s, SSD %.2f GB/s (%s), matmul weight read %.2f GB/s, "
               "%.1f GFLOP/s",
               st_time_now() - t0, bw->h2d / 1e9, bw->ssd / 1e9, bw->ssd_direct ? "O_DIRECT" : "page cache",
               bw->dev_read / 1e9, bw->gemm / 1e9);
    return st;
}

/* A copier thread for the shared probe: copies piece after piece of a
 * pinned buffer to the device until told to stop, counting the bytes done. */
typedef struct {
    st_backend *be;
    st_stream *s;
    void *d;
    const uint8_t *h;
    size_t piece, pieces;
    atomic_uint_fast64_t done;
    atomic_bool stop;
    strata_status st;
} copier;

static void *copier_run(void *arg) {
    copier *c = arg;
    for (size_t i = 0; !atomic_load(&c->stop); i = (i + 1) % c->pieces) {
        c->st = c->be->ops->copy_h2d(c->be, c->s, c->d, c->h + i * c->piece, c->piece);
        if (c->st == STRATA_OK) c->st = c->be->ops->stream_sync(c->be, c->s);
        if (c->st != STRATA_OK) break;
        atomic_fetch_add(&c->done, c->piece);
    }
    return NULL;
}

/* The CPU probe's working set: FFN tensors of the largest one's dtype and
 * shape, in host memory where the CPU tier reads them (the file mapping),
 * cycled through so that the caches (a server's L3 holds a whole 70B FFN
 * tensor) do not serve them. */
typedef struct {
    st_weight w[64];
    int n;
    int64_t tokens; /* of each matmul */
    size_t bytes_each, bytes;
} probe_set;

static void probe_run_set(const probe_set *ps, st_backend *cpu, st_stream *s, const float *x, float *y,
                          strata_status *st) {
    for (int i = 0; i < ps->n && *st == STRATA_OK; i++) {
        *st = cpu->ops->matmul(cpu, s, x, &ps->w[i], ps->tokens, y);
        if (*st == STRATA_OK) *st = cpu->ops->stream_sync(cpu, s);
    }
}

/* bw->h2d_shared and bw->cpu_shared: passes over the CPU's working set
 * while a thread copies a pinned buffer larger than the caches to the
 * device; each rate over the same window. Skipped (left 0) when the device
 * or the host cannot give the buffers. */
static strata_status measure_shared(st_backend *dev, st_backend *cpu, st_stream *s, const float *x,
                                    const probe_set *ps, float *y, st_wbw *bw) {
    const size_t piece = (size_t)16 << 20, pieces = 32; /* 512 MiB of pinned memory, 16 MiB on the device */
    if (device_free(dev) / 2 < piece) return STRATA_OK;
    copier c = {.be = dev, .piece = piece, .pieces = pieces, .st = STRATA_OK};
    atomic_init(&c.done, 0);
    atomic_init(&c.stop, false);
    void *h = NULL;
    strata_status st = dev->ops->host_alloc(dev, piece * pieces, &h);
    if (st != STRATA_OK) { /* no pinned memory to spare: unknown, not an error */
        st_log(STRATA_LOG_INFO, "shared host-memory probe skipped: %s", st_last_error());
        return STRATA_OK;
    }
    memset(h, 1, piece * pieces);
    c.h = h;
    st = dev->ops->alloc(dev, piece, &c.d);
    if (st == STRATA_OK) st = dev->ops->stream_create(dev, false, &c.s);
    pthread_t th;
    bool started = false;
    if (st == STRATA_OK) started = pthread_create(&th, NULL, copier_run, &c) == 0;
    if (st == STRATA_OK && !started) st = st_err(STRATA_ERR_INTERNAL, "shared host-memory probe: no copier thread");
    if (st == STRATA_OK) {
        while (atomic_load(&c.done) < 2 * piece && c.st == STRATA_OK) /* the copier is running */
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        /* three windows of >= 0.25 s, the pair of the window whose sum is the median: one window
         * varied by up to 2x between runs on an H100 host (CPU 42-101 GB/s, tenth session) and the
         * plan's split follows these rates */
        double h2d[3] = {0}, cpu_r[3] = {0};
        int ok = 0;
        for (int wdw = 0; wdw < 3 && st == STRATA_OK; wdw++) {
            const uint64_t d0 = atomic_load(&c.done);
            const double t0 = st_time_now();
            int passes = 0;
            for (; st == STRATA_OK && (passes < 2 || st_time_now() - t0 < 0.25); passes++)
                probe_run_set(ps, cpu, s, x, y, &st);
            const double dt = st_time_now() - t0;
            const uint64_t d1 = atomic_load(&c.done);
            if (st == STRATA_OK && dt > 0 && d1 > d0) {
                h2d[ok] = (double)(d1 - d0) / dt;
                cpu_r[ok] = (double)passes * (double)ps->bytes / dt;
                ok++;
            }
        }
        if (st == STRATA_OK && ok > 0) {
            int ord[3] = {0, 1, 2}; /* the windows by sum; the median one (of two, the larger) */
            for (int a = 1; a < ok; a++)
                for (int b = a; b > 0 && h2d[ord[b]] + cpu_r[ord[b]] < h2d[ord[b - 1]] + cpu_r[ord[b - 1]]; b--) {
                    const int t = ord[b];
                    ord[b] = ord[b - 1], ord[b - 1] = t;
                }
            const int med = ord[ok / 2];
            bw->h2d_shared = h2d[med];
            bw->cpu_shared = cpu_r[med];
            bw->measured[5] = true;
            st_log(STRATA_LOG_INFO,
                   "shared host-memory probe: windows (CPU + H2D GB/s) %.1f + %.1f, %.1f + %.1f, %.1f + %.1f",
                   cpu_r[0] / 1e9, h2d[0] / 1e9, cpu_r[1] / 1e9, h2d[1] / 1e9, cpu_r[2] / 1e9, h2d[2] / 1e9);
        }
    }
    atomic_store(&c.stop, true);
    if (started) pthread_join(th, NULL);
    if (st == STRATA_OK && c.st != STRATA_OK) st = c.st;
    if (c.s) dev->ops->stream_destroy(dev, c.s);
    if (c.d) dev->ops->dealloc(dev, c.d);
    dev->ops->host_dealloc(dev, h);
    return st;
}

size_t st_wbw_llc_bytes(void) {
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(buf, sizeof buf, f)) {
            char *end = NULL;
            size_t v = (size_t)strtoull(buf, &end, 10);
            if (end && (*end == 'K' || *end == 'k')) v <<= 10;
            else if (end && (*end == 'M' || *end == 'm')) v <<= 20;
            if (v > best) best = v;
        }
        fclose(f);
    }
    return best;
}

strata_status st_wbw_measure_cpu(const st_model_files *files, const st_wgroups *g, int threads, st_cpu_act act,
                                 int64_t tokens, st_backend *dev, st_wbw *bw) {
    if (tokens < 1) tokens = 1;
    const st_tensor_desc *big = NULL; /* the largest FFN tensor: what the CPU tier reads */
    for (int i = 1; i < g->n - 1; i++)
        if (g->g[i].kind == ST_WG_FFN)
            for (int t = 0; t < g->g[i].n_tensors; t++) {
                const st_tensor_desc *d = g->g[i].t[t].desc;
                if (d->n_dims == 2 && (!big || d->nbytes > big->nbytes)) big = d;
            }
    if (!big) return STRATA_OK;
    const int64_t K = big->shape[1];
    const size_t rb = st_dtype_row_bytes(big->dtype, K);
    if (rb == 0 || big->shape[0] < 4) return STRATA_OK;
    /* the working set: tensors like it, at least 8x the last-level cache and 2 GiB (up to 64 of them):
     * what a decode step reads comes from DRAM, so the caches should serve as little of the set */
    size_t want = 8 * st_wbw_llc_bytes();
    if (want < ((size_t)2 << 30)) want = (size_t)2 << 30;
    probe_set ps = {.bytes_each = (size_t)big->shape[0] * rb, .tokens = tokens};
    for (int i = 1; i < g->n - 1 && ps.n < 64 && ps.bytes < want; i++)
        if (g->g[i].kind == ST_WG_FFN)
            for (int t = 0; t < g->g[i].n_tensors && ps.n < 64 && ps.bytes < want; t++) {
                const st_tensor_desc *d = g->g[i].t[t].desc;
                if (d->n_dims != 2 || d->dtype != big->dtype || d->shape[0] != big->shape[0] || d->shape[1] != K)
                    continue;
                ps.w[ps.n++] = (st_weight){st_tensor_data(files, d), d->dtype, d->shape[0], K, 0};
                ps.bytes += ps.bytes_each;
            }
    const double t0 = st_time_now();
    st_backend *cpu = NULL;
    st_stream *s = NULL;
    float *x = NULL, *y = NULL;
    const st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = threads, .cpu_act = act};
    strata_status st = st_backend_init(&bp, &cpu);
    if (st == STRATA_OK) st = cpu->ops->stream_create(cpu, false, &s);
    if (st == STRATA_OK) st = cpu->ops->alloc(cpu, (size_t)(tokens * K) * sizeof(float), (void **)&x);
    if (st == STRATA_OK) st = cpu->ops->alloc(cpu, (size_t)(tokens * big->shape[0]) * sizeof(float), (void **)&y);
    if (st == STRATA_OK) {
        for (int64_t i = 0; i < tokens * K; i++) x[i] = (float)((i % 7) - 3) * 0.125f;
        double best = 0;
        for (int r = 0; r < 4 && st == STRATA_OK; r++) { /* the first pass pages the set in, untimed */
            const double a = st_time_now();
            probe_run_set(&ps, cpu, s, x, y, &st);
            const double dt = st_time_now() - a;
            if (r > 0 && dt > 0 && (double)ps.bytes / dt > best) best = (double)ps.bytes / dt;
        }
        if (st == STRATA_OK) {
            bw->cpu = best;
            bw->measured[4] = best > 0;
        }
        if (st == STRATA_OK && dev && dev->kind != ST_BACKEND_CPU && !(bw->h2d_shared > 0 && bw->cpu_shared > 0))
            st = measure_shared(dev, cpu, s, x, &ps, y, bw);
        if (st == STRATA_OK)
            st_log(STRATA_LOG_INFO,
                   "CPU matmul weight read (%d threads, %s, %lld token%s, %d tensors of %.1f MB in turn): %.2f GB/s; "
                   "while H2D copies run: CPU %.2f GB/s + H2D %.2f GB/s = %.2f GB/s of host memory (%.2f s to measure)",
                   threads, st_dtype_name(big->dtype), (long long)tokens, tokens == 1 ? "" : "s", ps.n,
                   (double)ps.bytes_each / 1e6, best / 1e9,
                   bw->cpu_shared / 1e9, bw->h2d_shared / 1e9, (bw->cpu_shared + bw->h2d_shared) / 1e9,
                   st_time_now() - t0);
    }
    if (x) cpu->ops->dealloc(cpu, x);
    if (y) cpu->ops->dealloc(cpu, y);
    if (s) cpu->ops->stream_destroy(cpu, s);
    st_backend_free(cpu);
    return st;
}

/* CPU backend: creation, memory, streams/events, and the op table (the
 * device-independent argument checks are backend.c's; the host-index checks
 * here; kernels in cpu_matmul.c, cpu_attention.c, cpu_ops.c).
 *
 * "Device" memory is host memory counted against params.device_mem through
 * be->device_budget. Each device block carries a 64-byte header in front of
 * the returned (64-byte aligned) pointer:
 *   [0, 8)   size_t  requested size (given back to the budget on dealloc)
 *   [8, 16)  uint64  magic, cleared on dealloc (catches double frees)
 * Streams and events are small real objects; ops execute synchronously, so
 * every recorded event is complete and every sync returns at once. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define DEV_HDR 64
#define DEV_MAGIC 0x5354524154414456ull /* "STRATADV" */
#define STREAM_MAGIC 0x5354524d
#define EVENT_MAGIC 0x45564e54

typedef struct {
    uint32_t magic;
    bool high_priority;
} cpu_stream;

typedef struct {
    uint32_t magic;
    bool recorded;
} cpu_event;

/* ---- scratch ---- */

strata_status st_cpu_scratch_reserve(st_cpu *c, size_t floats) {
    if (floats <= c->scratch_floats) return STRATA_OK;
    floats = (floats + 15) & ~(size_t)15;
    if (floats > SIZE_MAX / sizeof(float))
        return st_err(STRATA_ERR_NOMEM, "cpu backend: scratch of %zu floats is too large", floats);
    for (int i = 0; i < c->n_threads; i++) {
        void *p = NULL;
        if (posix_memalign(&p, 64, floats * sizeof(float)) != 0)
            return st_err(STRATA_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes of scratch",
                          floats * sizeof(float));
        free(c->scratch[i]);
        c->scratch[i] = p;
    }
    c->scratch_floats = floats;
    return STRATA_OK;
}

strata_status st_cpu_qact_reserve(st_cpu *c, size_t bytes) {
    if (bytes <= c->qact_bytes) return STRATA_OK;
    bytes = (bytes + 63) & ~(size_t)63;
    void *p = NULL;
    if (bytes == 0 || posix_memalign(&p, 64, bytes) != 0)
        return st_err(STRATA_ERR_NOMEM, "cpu backend: cannot allocate %zu bytes of scratch", bytes);
    free(c->qact);
    c->qact = p;
    c->qact_bytes = bytes;
    return STRATA_OK;
}

/* ---- memory ---- */

static strata_status cpu_alloc(st_backend *be, size_t n, void **out) {
    *out = NULL;
    if (n > SIZE_MAX - DEV_HDR)
        return st_err(STRATA_ERR_NOMEM, "cpu alloc: %zu bytes is too large", n);
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->mem_mu);
    strata_status st = st_budget_take(&be->device_budget, n, "cpu backend device allocation");
    pthread_mutex_unlock(&c->mem_mu);
    if (st != STRATA_OK) return st;
    void *base = NULL;
    if (posix_memalign(&base, 64, DEV_HDR + n) != 0) {
        pthread_mutex_lock(&c->mem_mu);
        st_budget_give(&be->device_budget, n);
        pthread_mutex_unlock(&c->mem_mu);
        return st_err(STRATA_ERR_NOMEM, "cpu alloc: the system refused %zu bytes", n);
    }
    uint64_t magic = DEV_MAGIC;
    memcpy(base, &n, sizeof n);
    memcpy((char *)base + 8, &magic, sizeof magic);
    *out = (char *)base + DEV_HDR;
    return STRATA_OK;
}

static void cpu_dealloc(st_backend *be, void *p) {
    if (!p) return;
    char *base = (char *)p - DEV_HDR;
    size_t n;
    uint64_t magic;
    memcpy(&n, base, sizeof n);
    memcpy(&magic, base + 8, sizeof magic);
    ST_ASSERT(magic == DEV_MAGIC); /* not a device pointer of this backend, or freed twice */
    magic = 0;
    memcpy(base + 8, &magic, sizeof magic);
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->mem_mu);
    st_budget_give(&be->device_budget, n);
    pthread_mutex_unlock(&c->mem_mu);
    free(base);
}

static strata_status cpu_host_alloc(st_backend *be, size_t n, void **out) {
    *out = NULL;
    void *p = NULL;
    /* page-aligned from a page up: O_DIRECT reads and writes (the KV stream's SSD tier) take these buffers */
    if (posix_memalign(&p, n >= 4096 ? 4096 : 64, n ? n : 1) != 0)
        return st_err(STRATA_ERR_NOMEM, "cpu host_alloc: the system refused %zu bytes", n);
    *out = p;
    return STRATA_OK;
}

static void cpu_host_dealloc(st_backend *be, void *p) { free(p); }

static strata_status cpu_upload(st_backend *be, const void *host, size_t n, void **dev, bool *owned) {
    *dev = (void *)host; /* zero copy: the caller keeps owning `host` */
    *owned = false;
    return STRATA_OK;
}

static strata_status cpu_copy(st_backend *be, st_stream *s, void *dst, const void *src, size_t n) {
    memmove(dst, src, n);
    return STRATA_OK;
}

static strata_status cpu_copy_2d(st_backend *be, st_stream *s, void *dst, size_t dpitch, const void *src,
                                  size_t spitch, size_t width, size_t height) {
    for (size_t r = 0; r < height; r++) memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
    return STRATA_OK;
}

/* ---- streams and events ---- */

static strata_status cpu_stream_create(st_backend *be, bool high_priority, st_stream **out) {
    cpu_stream *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "cpu stream_create: out of memory for its state (%zu bytes)", sizeof *s);
    s->magic = STREAM_MAGIC;
    s->high_priority = high_priority;
    *out = (st_stream *)s;
    return STRATA_OK;
}

static void cpu_stream_destroy(st_backend *be, st_stream *s) {
    if (!s) return;
    cpu_stream *cs = (cpu_stream *)s;
    ST_ASSERT(cs->magic == STREAM_MAGIC);
    cs->magic = 0;
    st_free(cs);
}

static strata_status cpu_stream_sync(st_backend *be, st_stream *s) { return STRATA_OK; }

static strata_status cpu_event_create(st_backend *be, st_event **out) {
    cpu_event *e = st_calloc(1, sizeof *e);
    if (!e) return st_err(STRATA_ERR_NOMEM, "cpu event_create: out of memory for its state (%zu bytes)", sizeof *e);
    e->magic = EVENT_MAGIC;
    *out = (st_event *)e;
    return STRATA_OK;
}

static void cpu_event_destroy(st_backend *be, st_event *e) {
    if (!e) return;
    cpu_event *ce = (cpu_event *)e;
    ST_ASSERT(ce->magic == EVENT_MAGIC);
    ce->magic = 0;
    st_free(ce);
}

static strata_status cpu_event_record(st_backend *be, st_event *e, st_stream *s) {
    ((cpu_event *)e)->recorded = true; /* everything before it already ran */
    return STRATA_OK;
}

static strata_status cpu_stream_wait_event(st_backend *be, st_stream *s, st_event *e) { return STRATA_OK; }

static strata_status cpu_event_sync(st_backend *be, st_event *e) { return STRATA_OK; }

static strata_status cpu_event_query(st_backend *be, st_event *e, bool *done) {
    *done = true; /* every op ran when it was called */
    return STRATA_OK;
}

/* ---- ops: the kernel under op_mu ----
 * backend.c's validating layer has checked shapes, weights and pointers
 * (backend.h: "Argument checks"), and n > 0. What stays here is what the CPU
 * promises because its indices live on the host: the values of idx, slots,
 * pos, seq, ctx_lens and the block ids (get_rows ids: cpu_ops.c; sample
 * args: cpu_sample.c), checked before anything is written. */

/* Adds one call of dt seconds to the op-time table (op_mu held). */
static void prof_add(st_cpu *c, const char *op, int64_t rows, int64_t cols, int64_t n, double bytes, double dt) {
    st_cpu_prof *p = &c->prof;
    for (int i = 0; i < p->count; i++) {
        st_cpu_prof_entry *e = &p->e[i];
        if (!strcmp(e->op, op) && e->rows == rows && e->cols == cols && e->n == n) {
            e->calls++, e->s += dt;
            return;
        }
    }
    if (p->count == ST_CPU_PROF_MAX) {
        p->dropped++;
        return;
    }
    p->e[p->count++] = (st_cpu_prof_entry){op, rows, cols, n, bytes, 1, dt};
}

/* The op under op_mu; with op times on, timed under the key (op, rows, cols, n). */
#define RUN_LOCKED_K(be, op, rows, cols, n, bytes, call)                                        \
    do {                                                                                     \
        st_cpu *c_ = st_cpu_of(be);                                                          \
        const double t0_ = c_->prof.on ? st_time_now() : 0;                                  \
        pthread_mutex_lock(&c_->op_mu);                                                      \
        strata_status st_ = call;                                                            \
        if (c_->prof.on) prof_add(c_, op, rows, cols, n, bytes, st_time_now() - t0_);        \
        pthread_mutex_unlock(&c_->op_mu);                                                    \
        return st_;                                                                          \
    } while (0)
#define RUN_LOCKED(be, op, n, call) RUN_LOCKED_K(be, op, 0, 0, n, 0.0, call)

/* An op that runs outside op_mu: its time since t0, if op times are on. */
static void prof_note(st_backend *be, const char *op, int64_t n, double t0) {
    st_cpu *c = st_cpu_of(be);
    if (!c->prof.on) return;
    const double dt = st_time_now() - t0;
    pthread_mutex_lock(&c->op_mu);
    prof_add(c, op, 0, 0, n, 0.0, dt);
    pthread_mutex_unlock(&c->op_mu);
}

void st_backend_cpu_prof(st_backend *be, bool on) {
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->op_mu);
    if (on) memset(&c->prof, 0, sizeof c->prof);
    c->prof.on = on;
    pthread_mutex_unlock(&c->op_mu);
}

void st_backend_cpu_prof_print(st_backend *be, FILE *f, int64_t steps, double step_s) {
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->op_mu);
    const st_cpu_prof *p = &c->prof;
    int order[ST_CPU_PROF_MAX];
    for (int i = 0; i < p->count; i++) order[i] = i;
    for (int i = 1; i < p->count; i++) /* by time, largest first */
        for (int j = i; j > 0 && p->e[order[j]].s > p->e[order[j - 1]].s; j--) {
            const int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    double total = 0;
    for (int i = 0; i < p->count; i++) total += p->e[i].s;
    const double per = steps > 0 ? 1.0 / (double)steps : 1.0;
    for (int k = 0; k < p->count; k++) {
        const st_cpu_prof_entry *e = &p->e[order[k]];
        fprintf(f, "op time      %-15s", e->op);
        if (e->rows) fprintf(f, " %6lld x %-6lld", (long long)e->rows, (long long)e->cols);
        else fprintf(f, " %15s", "");
        fprintf(f, " n=%-5lld %6.2f calls/step %9.1f us/call %8.3f ms/step %5.1f%%", (long long)e->n,
                (double)e->calls * per, 1e6 * e->s / (double)e->calls, 1e3 * e->s * per,
                step_s > 0 ? 100.0 * e->s * per / step_s : 0.0);
        if (e->bytes > 0) fprintf(f, "  %6.1f GB/s of weights", e->bytes * (double)e->calls / e->s / 1e9);
        fputc('\n', f);
    }
    fprintf(f, "op time      all ops %.3f ms/step, outside the ops %.3f ms/step (of %.3f)%s\n", 1e3 * total * per,
            1e3 * (step_s - total * per), 1e3 * step_s, p->dropped ? " (some calls not counted: table full)" : "");
    pthread_mutex_unlock(&c->op_mu);
}

static double weight_bytes(const st_weight *w) { return (double)st_dtype_row_bytes(w->dtype, w->cols) * (double)w->rows; }

/* Only the matmuls take a weight with a row stride (backend.h). */
static strata_status strided(const st_weight *w, const char *op) {
    return st_err(STRATA_ERR_UNSUPPORTED, "%s: a weight with a row stride (%zu bytes) is for matmuls only", op,
                  w->stride);
}

static strata_status cpu_get_rows(st_backend *be, st_stream *s, const st_weight *w,
                                  const int32_t *ids, int64_t n, float *out) {
    if (!st_weight_dense(w)) return strided(w, "cpu get_rows");
    RUN_LOCKED(be, "get_rows", n, st_cpu_get_rows(c_, w, ids, n, out));
}

static strata_status cpu_rmsnorm(st_backend *be, st_stream *s, float *x, const float *residual,
                                 const st_weight *w, float eps, int64_t n, int64_t d, float *out) {
    if (!st_weight_dense(w)) return strided(w, "cpu rmsnorm");
    RUN_LOCKED(be, "rmsnorm", n, st_cpu_rmsnorm(c_, x, residual, w, eps, n, d, out));
}

static strata_status cpu_matmul(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                int64_t n, float *y) {
    RUN_LOCKED_K(be, "matmul", w->rows, w->cols, n, weight_bytes(w), st_cpu_matmul(c_, x, w, n, y));
}

static strata_status cpu_rope(st_backend *be, st_stream *s, float *x, const int32_t *pos, int64_t n,
                              int64_t n_heads, int64_t head_dim, const float *inv_freq,
                              bool interleaved) {
    RUN_LOCKED(be, "rope", n, st_cpu_rope(c_, x, pos, n, n_heads, head_dim, inv_freq, interleaved));
}

static strata_status cpu_attention(st_backend *be, st_stream *s, const float *q, const float *k,
                                   const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                   float scale, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (pos[i] < 0 || pos[i] >= n_kv)
            return st_err(STRATA_ERR_INVALID_ARG, "cpu attention: pos[%lld] = %d is outside the %lld cached keys",
                          (long long)i, pos[i], (long long)n_kv);
    RUN_LOCKED(be, "attention", n, st_cpu_attention(c_, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, head_dim, scale,
                                    out));
}

static strata_status cpu_swiglu(st_backend *be, st_stream *s, const float *gate, const float *up,
                                int64_t n, float *out) {
    RUN_LOCKED(be, "swiglu", n, st_cpu_swiglu(c_, gate, up, n, out));
}

static strata_status cpu_add(st_backend *be, st_stream *s, float *x, const float *y, int64_t n) {
    RUN_LOCKED(be, "add", n, st_cpu_add(c_, x, y, n));
}

/* ---- decode-step ops (backend.h) ---- */

static strata_status cpu_argmax(st_backend *be, st_stream *s, const float *x, int64_t n, int64_t cols,
                                int32_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *r = x + i * cols;
        int64_t b = -1;
        for (int64_t j = 0; j < cols; j++)
            if (!isnan(r[j]) && (b < 0 || r[j] > r[b])) b = j;
        out[i] = (int32_t)(b < 0 ? 0 : b);
    }
    return STRATA_OK;
}

static strata_status cpu_sample(st_backend *be, st_stream *s, const float *logits, int64_t n, int64_t vocab,
                                const st_sample_args *args, int32_t *out) {
    const double t0 = st_cpu_of(be)->prof.on ? st_time_now() : 0;
    const strata_status st = st_cpu_sample(st_cpu_of(be), logits, n, vocab, args, out);
    prof_note(be, "sample", n, t0);
    return st;
}

/* Weights of one quantized dtype share one integer matmul (x quantized once,
 * one parallel loop); others run one by one. */
static strata_status cpu_matmul_multi(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                      int count, int64_t n, float *const *y) {
    bool same_int = st_dtype_get(w[0].dtype)->quantized;
    for (int i = 1; i < count; i++) same_int &= w[i].dtype == w[0].dtype;
    if (same_int) {
        int64_t rows = 0;
        double bytes = 0;
        for (int i = 0; i < count; i++) rows += w[i].rows, bytes += weight_bytes(&w[i]);
        RUN_LOCKED_K(be, count == 1 ? "matmul" : "matmul_multi", rows, w->cols, n, bytes,
                     st_cpu_matmul_int(c_, x, w, count, n, y));
    }
    strata_status st = STRATA_OK;
    for (int i = 0; i < count && st == STRATA_OK; i++) st = cpu_matmul(be, s, x, &w[i], n, y[i]);
    return st;
}

static strata_status cpu_matmul_swiglu(st_backend *be, st_stream *s, const float *x, const st_weight *wg,
                                       const st_weight *wu, int64_t n, float *out, float *work) {
    float *tmp = work ? work : st_malloc((size_t)(n * wu->rows) * sizeof(float));
    if (!tmp)
        return st_err(STRATA_ERR_NOMEM, "cpu matmul_swiglu: out of memory for the up projection of %lld x %lld floats",
                      (long long)n, (long long)wu->rows);
    const st_weight w2[2] = {*wg, *wu};
    float *const y2[2] = {out, tmp};
    strata_status st = cpu_matmul_multi(be, s, x, w2, 2, n, y2);
    if (st == STRATA_OK) st = cpu_swiglu(be, s, out, tmp, n * wu->rows, out);
    if (!work) st_free(tmp);
    return st;
}

/* ---- paged KV cache (backend.h) ---- */

/* One row of cols fp32 values stored as `t` at dst (fp8: with *scale, the
 * row's scale, computed here). backend.h's st_kv_layer gives the rules. */
static void kv_store_row(st_kv_dtype t, void *dst, float *scale, const float *x, int64_t cols) {
    switch (t) {
    case ST_KV_F32: memcpy(dst, x, (size_t)cols * sizeof(float)); break;
    case ST_KV_BF16:
        for (int64_t d = 0; d < cols; d++) ((uint16_t *)dst)[d] = st_kv_f32_to_bf16(x[d]);
        break;
    case ST_KV_FP8: {
        const float sc = st_kv_fp8_row_scale(x, cols);
        *scale = sc;
        for (int64_t d = 0; d < cols; d++) ((uint8_t *)dst)[d] = st_kv_f32_to_fp8(x[d] / sc);
        break;
    }
    }
}

static strata_status kv_store_paged(st_backend *be, const st_kv_layer *c, const float *k, const float *v,
                                    const int64_t *slots, int64_t n);

static strata_status cpu_kv_store_paged(st_backend *be, st_stream *s, const st_kv_layer *c, const float *k,
                                        const float *v, const int64_t *slots, int64_t n) {
    const double t0 = st_cpu_of(be)->prof.on ? st_time_now() : 0;
    const strata_status st = kv_store_paged(be, c, k, v, slots, n);
    prof_note(be, "kv_store", n, t0);
    return st;
}

static strata_status kv_store_paged(st_backend *be, const st_kv_layer *c, const float *k, const float *v,
                                    const int64_t *slots, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < -1 || slots[i] >= c->n_slots)
            return st_err(STRATA_ERR_INVALID_ARG, "cpu kv_store_paged: slots[%lld] = %lld is outside [-1, %lld)",
                          (long long)i, (long long)slots[i], (long long)c->n_slots);
    const int64_t H = c->n_kv_heads, hd = c->head_dim, cols = H * hd;
    const size_t es = st_kv_dtype_size(c->dtype);
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        for (int64_t h = 0; h < H; h++) {
            const int64_t r = slots[i] * H + h; /* the (slot, head) row */
            const bool q8 = c->dtype == ST_KV_FP8;
            kv_store_row(c->dtype, (char *)c->k + (size_t)r * hd * es, q8 ? c->k_scale + r : NULL,
                         k + i * cols + h * hd, hd);
            kv_store_row(c->dtype, (char *)c->v + (size_t)r * hd * es, q8 ? c->v_scale + r : NULL,
                         v + i * cols + h * hd, hd);
        }
    }
    return STRATA_OK;
}

static strata_status cpu_kv_gather(st_backend *be, st_stream *s, const st_kv_layer *c, const int32_t *ids, int64_t n,
                                   float *k, float *v) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->n_slots)
            return st_err(STRATA_ERR_INVALID_ARG, "cpu kv_gather: ids[%lld] = %d is outside [0, %lld)", (long long)i,
                          ids[i], (long long)c->n_slots);
    const int64_t H = c->n_kv_heads, hd = c->head_dim, cols = H * hd;
    for (int64_t i = 0; i < n; i++)
        for (int pl = 0; pl < 2; pl++) {
            const void *base = pl ? c->v : c->k;
            const float *scales = pl ? c->v_scale : c->k_scale;
            float *o = (pl ? v : k) + i * cols;
            const int64_t r0 = (int64_t)ids[i] * H; /* its first (slot, head) row */
            switch (c->dtype) {
            case ST_KV_F32: memcpy(o, (const float *)base + r0 * hd, (size_t)cols * sizeof(float)); break;
            case ST_KV_BF16:
                for (int64_t d = 0; d < cols; d++) o[d] = st_kv_bf16_to_f32(((const uint16_t *)base)[r0 * hd + d]);
                break;
            case ST_KV_FP8: /* the value times its (slot, head) row's scale: the attention's arithmetic */
                for (int64_t d = 0; d < cols; d++)
                    o[d] = st_kv_fp8_to_f32(((const uint8_t *)base)[r0 * hd + d]) * scales[r0 + d / hd];
                break;
            }
        }
    return STRATA_OK;
}

static strata_status cpu_attention_part(st_backend *be, st_stream *s, const float *q, const float *k,
                                        const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                        int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                        bool merge, float *out, float *lse) {
    for (int64_t i = 0; i < n; i++)
        if (pos[i] < key0)
            return st_err(STRATA_ERR_INVALID_ARG,
                          "cpu attention_part: pos[%lld] = %d is before the piece's first key %lld", (long long)i,
                          pos[i], (long long)key0);
    RUN_LOCKED(be, "attention_part", n, st_cpu_attention_part(c_, q, k, v, pos, n, key0, n_kv, n_heads, n_kv_heads, head_dim, scale,
                                         merge, out, lse));
}

static strata_status cpu_attention_rows(st_backend *be, st_stream *s, const float *q, const st_kv_layer *rows,
                                        const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads,
                                        int64_t n_kv_heads, int64_t head_dim, float scale, bool merge, float *out,
                                        float *lse) {
    if (rows->n_kv_heads != n_kv_heads || rows->head_dim != head_dim || n_kv > rows->n_slots)
        return st_err(STRATA_ERR_INVALID_ARG, "cpu attention_rows: a view of %lld rows of %lld x %lld for %lld keys "
                      "of %lld x %lld", (long long)rows->n_slots, (long long)rows->n_kv_heads,
                      (long long)rows->head_dim, (long long)n_kv, (long long)n_kv_heads, (long long)head_dim);
    for (int64_t i = 0; i < n; i++)
        if (pos[i] < key0)
            return st_err(STRATA_ERR_INVALID_ARG,
                          "cpu attention_rows: pos[%lld] = %d is before the first key %lld", (long long)i, pos[i],
                          (long long)key0);
    RUN_LOCKED(be, "attention_rows", n, st_cpu_attention_rows(c_, q, rows, pos, n, key0, n_kv, n_heads, n_kv_heads,
                                                              head_dim, scale, merge, out, lse));
}

static strata_status cpu_attn_merge(st_backend *be, st_stream *s, float *out, float *lse, const float *out2,
                                    const float *lse2, int64_t rows, int64_t hd) {
    st_cpu_attn_merge(out, lse, out2, lse2, rows, hd);
    return STRATA_OK;
}

static strata_status cpu_attention_paged(st_backend *be, st_stream *s, const float *q, const st_paged_kv *kv,
                                         const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    const char *op = "cpu attention_paged";
    const int64_t bs = kv->block_size, n_blocks = kv->cache.n_slots / bs;
    for (int64_t sq = 0; sq < kv->n_seqs; sq++) {
        const int64_t len = kv->ctx_lens[sq];
        if (len < 0 || len > kv->max_ctx)
            return st_err(STRATA_ERR_INVALID_ARG, "%s: ctx_lens[%lld] = %lld is outside [0, max_ctx = %lld]", op,
                          (long long)sq, (long long)len, (long long)kv->max_ctx);
        const int32_t *row = kv->block_tables + sq * kv->max_blocks;
        for (int64_t b = 0; b < (len + bs - 1) / bs; b++)
            if (row[b] < 0 || row[b] >= n_blocks)
                return st_err(STRATA_ERR_INVALID_ARG, "%s: block_tables[%lld][%lld] = %d is outside [0, %lld)",
                              op, (long long)sq, (long long)b, row[b], (long long)n_blocks);
    }
    for (int64_t i = 0; i < n; i++) {
        if (seq[i] < 0 || seq[i] >= kv->n_seqs)
            return st_err(STRATA_ERR_INVALID_ARG, "%s: seq[%lld] = %d is outside [0, %lld)", op, (long long)i,
                          seq[i], (long long)kv->n_seqs);
        if (pos[i] < 0 || pos[i] >= kv->ctx_lens[seq[i]])
            return st_err(STRATA_ERR_INVALID_ARG,
                          "%s: pos[%lld] = %d is outside the %d keys of its sequence %d", op, (long long)i, pos[i],
                          kv->ctx_lens[seq[i]], seq[i]);
    }
    RUN_LOCKED(be, "attention_paged", n, st_cpu_attention_paged(c_, q, kv, seq, pos, n, n_heads, n_kv_heads, head_dim, scale, out));
}

/* No graphs: ops run as they are enqueued (backend.h: graph_begin says so). */
static strata_status cpu_graph_begin(st_backend *be, st_stream *s) {
    return st_err(STRATA_ERR_UNSUPPORTED, "cpu backend: no graphs (ops run as they are enqueued)");
}

static strata_status cpu_graph_end(st_backend *be, st_stream *s, st_graph **out) {
    if (out) *out = NULL;
    return st_err(STRATA_ERR_INVALID_ARG, "cpu graph_end: no recording was started");
}

static strata_status cpu_graph_launch(st_backend *be, st_stream *s, st_graph *g) {
    return st_err(STRATA_ERR_INVALID_ARG, "cpu graph_launch: the CPU backend records no graphs");
}

static void cpu_graph_destroy(st_backend *be, st_graph *g) {}

static void cpu_set_fast_prefill(st_backend *be, bool on) {}

/* ---- lifetime ---- */

static void cpu_destroy(st_backend *be) {
    if (!be) return;
    st_cpu *c = st_cpu_of(be);
    if (be->device_budget.used)
        st_log(STRATA_LOG_WARN, "cpu backend destroyed with %zu device bytes still allocated",
               be->device_budget.used);
    if (c) {
        st_pool_free(c->pool);
        if (c->scratch)
            for (int i = 0; i < c->n_threads; i++) free(c->scratch[i]);
        st_free(c->scratch);
        free(c->qact);
        free(c->attn_part);
        pthread_mutex_destroy(&c->op_mu);
        pthread_mutex_destroy(&c->mem_mu);
        st_free(c);
    }
    st_free(be);
}

static const st_backend_ops g_cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .dealloc = cpu_dealloc,
    .host_alloc = cpu_host_alloc,
    .host_dealloc = cpu_host_dealloc,
    .upload = cpu_upload,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_2d = cpu_copy_2d,
    .copy_d2d = cpu_copy,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .stream_sync = cpu_stream_sync,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait_event = cpu_stream_wait_event,
    .event_sync = cpu_event_sync,
    .event_query = cpu_event_query,
    .get_rows = cpu_get_rows,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .argmax = cpu_argmax,
    .matmul_multi = cpu_matmul_multi,
    .matmul_swiglu = cpu_matmul_swiglu,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .graph_launch = cpu_graph_launch,
    .graph_destroy = cpu_graph_destroy,
    .set_fast_prefill = cpu_set_fast_prefill,
    .kv_store_paged = cpu_kv_store_paged,
    .attention_paged = cpu_attention_paged,
    .attention_part = cpu_attention_part,
    .attention_rows = cpu_attention_rows,
    .attn_merge = cpu_attn_merge,
    .kv_gather = cpu_kv_gather,
    .sample = cpu_sample,
};

/* Which levels this CPU runs, bit per st_cpu_isa. */
static unsigned cpu_isa_mask(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* F16C (CPUID 1, ECX bit 29), AVX-512 VNNI (CPUID 7.0, ECX bit 11) and
     * AVX-VNNI (CPUID 7.1, EAX bit 4) straight from CPUID: not every
     * compiler's __builtin_cpu_supports knows them; avx2 and avx512vl/bw
     * there also mean the OS saves the vector state. */
    __builtin_cpu_init();
    unsigned a, b, c, d, mask = 1u << ST_CPU_ISA_PORTABLE;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
    if (!__builtin_cpu_supports("avx2") || !f16c) return mask;
    mask |= 1u << ST_CPU_ISA_AVX2;
    const bool vnni = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 11 & 1);
    if (vnni && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) mask |= 1u << ST_CPU_ISA_AVX512;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1)) mask |= 1u << ST_CPU_ISA_AVXVNNI;
    return mask;
#else
    return 1u << ST_CPU_ISA_PORTABLE;
#endif
}

bool st_cpu_isa_has(st_cpu_isa isa) { return cpu_isa_mask() >> isa & 1; }

st_cpu_isa st_cpu_isa_supported(void) {
    const unsigned m = cpu_isa_mask();
    st_cpu_isa best = ST_CPU_ISA_PORTABLE;
    for (int i = 0; i <= (int)ST_CPU_ISA_AVX512; i++)
        if (m >> i & 1) best = (st_cpu_isa)i;
    return best;
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define ST_ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a dynamically enabled state component */
#define ST_XFEATURE_XTILEDATA 18      /* the AMX tile data */
static bool g_amx_usable;             /* set once, by amx_probe (pthread_once): a property of the process */
static pthread_once_t g_amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return; /* AMX-TILE, AMX-INT8 */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return;                           /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return; /* XTILECFG, XTILEDATA enabled by the OS */
    /* Linux (5.16+) hands the tile data out on request; older kernels and
     * refusals (seccomp, a sigaltstack too small) leave AMX off */
    g_amx_usable = syscall(SYS_arch_prctl, ST_ARCH_REQ_XCOMP_PERM, ST_XFEATURE_XTILEDATA) == 0;
}

bool st_cpu_amx_usable(void) {
    pthread_once(&g_amx_once, amx_probe);
    return g_amx_usable;
}
#else
bool st_cpu_amx_usable(void) { return false; }
#endif

st_cpu_amx st_backend_cpu_set_amx(st_backend *be, st_cpu_amx mode) {
    st_cpu *c = st_cpu_of(be);
    if (mode == ST_CPU_AMX_ON && !st_cpu_amx_usable()) mode = ST_CPU_AMX_OFF;
    pthread_mutex_lock(&c->op_mu);
    c->amx = mode;
    pthread_mutex_unlock(&c->op_mu);
    return mode;
}

bool st_cpu_simd_supported(void) { return st_cpu_isa_supported() != ST_CPU_ISA_PORTABLE; }

static void cpu_set_isa(st_cpu *c, st_cpu_isa isa) {
    while (isa > ST_CPU_ISA_PORTABLE && !st_cpu_isa_has(isa)) isa = (st_cpu_isa)(isa - 1);
    c->isa = isa;
    c->simd = c->isa >= ST_CPU_ISA_AVX2;
}

st_cpu_isa st_backend_cpu_set_isa(st_backend *be, st_cpu_isa isa) {
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->op_mu);
    cpu_set_isa(c, isa);
    const st_cpu_isa r = c->isa;
    pthread_mutex_unlock(&c->op_mu);
    return r;
}

int st_backend_cpu_set_w16(st_backend *be, int min_n) {
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->op_mu);
    const int was = c->w16_min;
    c->w16_min = min_n;
    pthread_mutex_unlock(&c->op_mu);
    return was;
}

bool st_backend_cpu_set_act8(st_backend *be, bool on) {
    st_cpu *c = st_cpu_of(be);
    pthread_mutex_lock(&c->op_mu);
    const bool was = c->act8;
    c->act8 = on;
    pthread_mutex_unlock(&c->op_mu);
    return was;
}

bool st_backend_cpu_set_simd(st_backend *be, bool on) {
    return st_backend_cpu_set_isa(be, on ? ST_CPU_ISA_AVX512 : ST_CPU_ISA_PORTABLE) != ST_CPU_ISA_PORTABLE;
}

strata_status st_backend_cpu_init(const st_backend_params *params, st_backend **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "cpu backend init: out is NULL");
    *out = NULL;
    if (!params) return st_err(STRATA_ERR_INVALID_ARG, "cpu backend init: params is NULL");
    st_backend *be = st_calloc(1, sizeof *be);
    st_cpu *c = st_calloc(1, sizeof *c);
    if (!be || !c) {
        st_free(be);
        st_free(c);
        return st_err(STRATA_ERR_NOMEM, "cpu backend init: out of memory for its state (%zu bytes)",
                      sizeof *be + sizeof *c);
    }
    be->ops = &g_cpu_ops;
    be->kind = ST_BACKEND_CPU;
    be->device_budget.cap = params->device_mem;
    be->impl = c;
    pthread_mutex_init(&c->op_mu, NULL);
    pthread_mutex_init(&c->mem_mu, NULL);
    strata_status st = st_pool_init(params->n_threads, &c->pool);
    if (st != STRATA_OK) {
        cpu_destroy(be);
        return st;
    }
    c->n_threads = st_pool_threads(c->pool);
    c->scratch = st_calloc((size_t)c->n_threads, sizeof *c->scratch);
    if (!c->scratch) {
        cpu_destroy(be);
        return st_err(STRATA_ERR_NOMEM, "cpu backend init: out of memory for the scratch table of %d threads",
                      c->n_threads);
    }
    cpu_set_isa(c, ST_CPU_ISA_AVX512);
    c->act8 = params->cpu_act == ST_CPU_ACT_INT8;
    c->amx = st_cpu_amx_usable() ? ST_CPU_AMX_ON : ST_CPU_AMX_OFF;
    c->w16_min = ST_CPU_W16_MIN;
    *out = be;
    return STRATA_OK;
}

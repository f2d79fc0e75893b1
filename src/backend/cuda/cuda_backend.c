/* CUDA backend: creation, device memory (a pool, see cuda_pool.c), pinned host
 * memory, copies, streams and events, and the op table (the CUDA-specific
 * argument checks: backend.c's layer makes the others; kernels in one .cu
 * file per op).
 *
 * Device memory: params.device_mem > 0 carves one cudaMalloc of exactly that
 * many bytes at init (fails early when the GPU lacks it); 0 carves chunks of
 * 1 GiB (or the request) lazily, while the device keeps 1 GiB free. Every
 * block is counted in be->device_budget (cap = device_mem), scratch included,
 * so the peak is measurable. No cudaMalloc happens per step.
 *
 * Streams are non-blocking CUDA streams (ordering between them only through
 * events); a NULL st_stream means the legacy default stream. st_stream and
 * st_event point at small host structs. Events are created with
 * cudaEventDisableTiming. */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"

#define STREAM_MAGIC 0x43535452u /* "CSTR" */
#define EVENT_MAGIC 0x43455654u  /* "CEVT" */
#define LAZY_CHUNK ((size_t)1 << 30)
#define LAZY_MARGIN ((size_t)1 << 30)

typedef struct {
    uint32_t magic;
    cudaEvent_t e;
} cuda_event;

bool st_backend_cuda_present(void) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

/* ---- memory ---- */

static size_t round_align(size_t n) { return (n + ST_CUDA_ALIGN - 1) / ST_CUDA_ALIGN * ST_CUDA_ALIGN; }

/* alloc without the device selection (callers hold nothing). */
static strata_status pool_alloc(st_backend *be, size_t n, const char *what, void **out) {
    st_cuda *c = st_cuda_of(be);
    *out = NULL;
    if (n > SIZE_MAX - ST_CUDA_ALIGN)
        return st_err(STRATA_ERR_NOMEM, "cuda alloc: %zu bytes is too large", n);
    const size_t want = round_align(n ? n : 1);
    pthread_mutex_lock(&c->mem_mu);
    strata_status st = st_budget_take(&be->device_budget, want, what);
    if (st == STRATA_OK) {
        size_t got = 0;
        st = st_cuda_pool_alloc(c->pool, want, out, &got);
        if (st != STRATA_OK) st_budget_give(&be->device_budget, want);
        else ST_ASSERT(got == want);
    }
    pthread_mutex_unlock(&c->mem_mu);
    return st;
}

static void pool_release(st_backend *be, void *p) {
    st_cuda *c = st_cuda_of(be);
    size_t got = 0;
    pthread_mutex_lock(&c->mem_mu);
    bool ok = st_cuda_pool_release(c->pool, p, &got);
    if (ok) st_budget_give(&be->device_budget, got);
    pthread_mutex_unlock(&c->mem_mu);
    ST_ASSERT(ok); /* not a device pointer of this backend, or freed twice */
}

static strata_status cuda_alloc(st_backend *be, size_t n, void **out) {
    *out = NULL;
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    return pool_alloc(be, n, "cuda device allocation", out);
}

/* Waits for the device to be idle first, so a block never goes back to the
 * pool while queued work may still use it (as cudaFree does). */
static void cuda_dealloc(st_backend *be, void *p) {
    if (!p) return;
    ST_CUDA_LOG(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_LOG(cudaDeviceSynchronize());
    pool_release(be, p);
}

static strata_status cuda_host_alloc(st_backend *be, size_t n, void **out) {
    *out = NULL;
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, n ? n : 1);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return st_err(STRATA_ERR_NOMEM, "cudaMallocHost(&p, %zu) failed: %s at %s:%d in %s", n,
                      cudaGetErrorString(e), __FILE__, __LINE__, __func__);
    }
    *out = p;
    return STRATA_OK;
}

static void cuda_host_dealloc(st_backend *be, void *p) {
    if (!p) return;
    ST_CUDA_LOG(cudaFreeHost(p));
}

static strata_status cuda_upload(st_backend *be, const void *host, size_t n, void **dev, bool *owned) {
    *dev = NULL;
    *owned = false;
    void *d = NULL;
    strata_status st = cuda_alloc(be, n, &d);
    if (st != STRATA_OK) return st;
    if (n) {
        /* From pageable memory cudaMemcpy may return once the bytes are staged,
         * before the DMA lands, and the legacy stream it uses does not order
         * our non-blocking streams: wait for it, so the buffer is complete for
         * any stream (load time only, not the hot path). */
        cudaError_t e = cudaMemcpy(d, host, n, cudaMemcpyHostToDevice);
        if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
        if (e != cudaSuccess) {
            pool_release(be, d);
            return st_err(STRATA_ERR_BACKEND, "cuda upload: cudaMemcpy of %zu bytes to the device (and its wait) failed: %s at %s:%d in %s",
                          n, cudaGetErrorString(e), __FILE__, __LINE__, __func__);
        }
    }
    *dev = d;
    *owned = true;
    return STRATA_OK;
}

/* ---- streams ---- */

st_cuda_stream *st_cuda_stream_get(st_backend *be, st_stream *s) {
    if (!s) return &st_cuda_of(be)->def;
    st_cuda_stream *cs = (st_cuda_stream *)s;
    ST_ASSERT(cs->magic == STREAM_MAGIC);
    return cs;
}

strata_status st_cuda_scratch(st_backend *be, st_cuda_stream *s, st_cuda_scratch_slot slot,
                              size_t bytes, void **out) {
    st_cuda_buf *b = &s->scratch[slot];
    if (bytes <= b->n && b->p) {
        *out = b->p;
        return STRATA_OK;
    }
    if (s->owned) {
        enum cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        ST_CUDA_TRY(cudaStreamIsCapturing(s->s, &cap));
        if (cap != cudaStreamCaptureStatusNone)
            return st_err(STRATA_ERR_BACKEND, "cuda scratch: slot %d must grow to %zu bytes while the stream "
                          "is recorded into a graph (run the ops once without a graph first)", (int)slot, bytes);
    }
    size_t want = b->n + b->n / 2;
    if (want < bytes) want = bytes;
    if (want < ((size_t)1 << 20)) want = (size_t)1 << 20;
    if (b->p) { /* queued work may still read the old buffer */
        ST_CUDA_TRY(cudaStreamSynchronize(s->s));
        pool_release(be, b->p);
        b->p = NULL;
        b->n = 0;
    }
    void *p = NULL;
    strata_status st = pool_alloc(be, want, "cuda scratch", &p);
    if (st != STRATA_OK) return st;
    b->p = p;
    b->n = want;
    *out = p;
    return STRATA_OK;
}

static void scratch_release(st_backend *be, st_cuda_stream *s) {
    for (int i = 0; i < ST_CUDA_SCRATCH_COUNT; i++) {
        if (s->scratch[i].p) pool_release(be, s->scratch[i].p);
        s->scratch[i].p = NULL;
        s->scratch[i].n = 0;
    }
}

static strata_status cuda_stream_create(st_backend *be, bool high_priority, st_stream **out) {
    *out = NULL;
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    int least = 0, greatest = 0;
    ST_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    st_cuda_stream *cs = st_calloc(1, sizeof *cs);
    if (!cs) return st_err(STRATA_ERR_NOMEM, "cuda stream_create: out of memory for its state (%zu bytes)", sizeof *cs);
    cudaError_t e = cudaStreamCreateWithPriority(&cs->s, cudaStreamNonBlocking,
                                                 high_priority ? greatest : least);
    if (e != cudaSuccess) {
        st_free(cs);
        return st_err(STRATA_ERR_BACKEND, "cudaStreamCreateWithPriority(&cs->s, cudaStreamNonBlocking, %d) failed: %s at %s:%d in %s",
                      high_priority ? greatest : least, cudaGetErrorString(e), __FILE__, __LINE__, __func__);
    }
    cs->magic = STREAM_MAGIC;
    cs->owned = true;
    *out = (st_stream *)cs;
    return STRATA_OK;
}

static void cuda_stream_destroy(st_backend *be, st_stream *s) {
    if (!s) return;
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    ST_CUDA_LOG(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_LOG(cudaStreamSynchronize(cs->s));
    scratch_release(be, cs);
    ST_CUDA_LOG(cudaStreamDestroy(cs->s));
    cs->magic = 0;
    st_free(cs);
}

static strata_status cuda_stream_sync(st_backend *be, st_stream *s) {
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    ST_CUDA_TRY(cudaStreamSynchronize(cs->s));
    return STRATA_OK;
}

/* ---- copies (asynchronous on the stream; pageable host memory works, pinned
 * memory overlaps) ---- */

static strata_status cuda_copy(st_backend *be, st_stream *s, void *dst, const void *src, size_t n,
                               enum cudaMemcpyKind kind) {
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_TRY(cudaMemcpyAsync(dst, src, n, kind, cs->s));
    return STRATA_OK;
}

static strata_status cuda_copy_h2d(st_backend *be, st_stream *s, void *dst, const void *src, size_t n) {
    return cuda_copy(be, s, dst, src, n, cudaMemcpyHostToDevice);
}
static strata_status cuda_copy_d2h(st_backend *be, st_stream *s, void *dst, const void *src, size_t n) {
    return cuda_copy(be, s, dst, src, n, cudaMemcpyDeviceToHost);
}
static strata_status cuda_copy_d2d(st_backend *be, st_stream *s, void *dst, const void *src, size_t n) {
    return cuda_copy(be, s, dst, src, n, cudaMemcpyDeviceToDevice);
}

static strata_status cuda_copy_2d(st_backend *be, st_stream *s, void *dst, size_t dpitch, const void *src,
                                   size_t spitch, size_t width, size_t height) {
    st_cuda_stream *cs = st_cuda_stream_get(be, s);
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    ST_CUDA_TRY(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, cs->s));
    return STRATA_OK;
}

/* ---- events ---- */

static cuda_event *event_get(st_event *e) {
    cuda_event *ce = (cuda_event *)e;
    ST_ASSERT(ce->magic == EVENT_MAGIC);
    return ce;
}

static strata_status cuda_event_create(st_backend *be, st_event **out) {
    *out = NULL;
    ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));
    cuda_event *ce = st_calloc(1, sizeof *ce);
    if (!ce) return st_err(STRATA_ERR_NOMEM, "cuda event_create: out of memory for its state (%zu bytes)", sizeof *ce);
    cudaError_t e = cudaEventCreateWithFlags(&ce->e, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        st_free(ce);
        return st_err(STRATA_ERR_BACKEND, "cudaEventCreateWithFlags(&ce->e, cudaEventDisableTiming) failed: %s at %s:%d in %s",
                      cudaGetErrorString(e), __FILE__, __LINE__, __func__);
    }
    ce->magic = EVENT_MAGIC;
    *out = (st_event *)ce;
    return STRATA_OK;
}

static void cuda_event_destroy(st_backend *be, st_event *e) {
    if (!e) return;
    cuda_event *ce = event_get(e);
    ST_CUDA_LOG(cudaEventDestroy(ce->e));
    ce->magic = 0;
    st_free(ce);
}

static strata_status cuda_event_record(st_backend *be, st_event *e, st_stream *s) {
    ST_CUDA_TRY(cudaEventRecord(event_get(e)->e, st_cuda_stream_get(be, s)->s));
    return STRATA_OK;
}

static strata_status cuda_stream_wait_event(st_backend *be, st_stream *s, st_event *e) {
    ST_CUDA_TRY(cudaStreamWaitEvent(st_cuda_stream_get(be, s)->s, event_get(e)->e, 0));
    return STRATA_OK;
}

static strata_status cuda_event_sync(st_backend *be, st_event *e) {
    ST_CUDA_TRY(cudaEventSynchronize(event_get(e)->e));
    return STRATA_OK;
}

static strata_status cuda_event_query(st_backend *be, st_event *e, bool *done) {
    const cudaError_t r = cudaEventQuery(event_get(e)->e);
    if (r == cudaErrorNotReady) {
        *done = false;
        return STRATA_OK;
    }
    *done = true;
    ST_CUDA_TRY(r);
    return STRATA_OK;
}

/* ---- ops: the CUDA-specific checks, then the op's .cu file ----
 * backend.c's validating layer has checked shapes, weights and pointers
 * (backend.h: "Argument checks"), and n > 0. What stays here: alignment
 * (weight data 16 bytes, float pointers 4, args and slots 8); the launchers
 * in the .cu files check the sizes their grids and shared memory can take.
 * Token ids, positions, slots and block tables live on the device and are
 * not checked: the kernels clamp or skip them (backend.h). */

#define CHECK_W16(w, op)                                                                     \
    do {                                                                                     \
        if (!st_cuda_aligned((w)->data, 16))                                                 \
            return st_err(STRATA_ERR_INVALID_ARG, "%s: weight data %p is not 16-byte aligned", op, \
                          (w)->data);                                                        \
        if (!st_weight_dense(w))                                                             \
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: a weight with a row stride (%zu bytes) " \
                          "runs on the CPU backend's matmuls only", op, (w)->stride);                  \
    } while (0)

/* The float pointers of ops must at least be 4-byte aligned. */
#define CHECK_F32(p, op)                                                                     \
    do {                                                                                     \
        if (!st_cuda_aligned((p), 4))                                                        \
            return st_err(STRATA_ERR_INVALID_ARG, "%s: %s = %p is not 4-byte aligned", op, #p, \
                          (const void *)(p));                                                \
    } while (0)

#define RUN(be, s, call)                                                                     \
    do {                                                                                     \
        ST_CUDA_TRY(cudaSetDevice(st_cuda_of(be)->device));                                  \
        st_cuda_stream *cs_ = st_cuda_stream_get(be, s);                                     \
        return call;                                                                         \
    } while (0)

static strata_status cuda_get_rows(st_backend *be, st_stream *s, const st_weight *w,
                                   const int32_t *ids, int64_t n, float *out) {
    const char *op = "cuda get_rows";
    CHECK_W16(w, op);
    CHECK_F32(out, op);
    RUN(be, s, st_cuda_op_get_rows(be, cs_, w, ids, n, out));
}

static strata_status cuda_rmsnorm(st_backend *be, st_stream *s, float *x, const float *residual,
                                  const st_weight *w, float eps, int64_t n, int64_t d, float *out) {
    const char *op = "cuda rmsnorm";
    CHECK_W16(w, op);
    CHECK_F32(x, op);
    CHECK_F32(out, op);
    if (residual) CHECK_F32(residual, op);
    RUN(be, s, st_cuda_op_rmsnorm(be, cs_, x, residual, w, eps, n, d, out));
}

static strata_status cuda_matmul(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                 int64_t n, float *y) {
    const char *op = "cuda matmul";
    CHECK_W16(w, op);
    CHECK_F32(x, op);
    CHECK_F32(y, op);
    RUN(be, s, st_cuda_op_matmul(be, cs_, x, w, n, y));
}

static strata_status cuda_rope(st_backend *be, st_stream *s, float *x, const int32_t *pos, int64_t n,
                               int64_t n_heads, int64_t head_dim, const float *inv_freq,
                               bool interleaved) {
    const char *op = "cuda rope";
    CHECK_F32(x, op);
    CHECK_F32(inv_freq, op);
    RUN(be, s, st_cuda_op_rope(be, cs_, x, pos, n, n_heads, head_dim, inv_freq, interleaved));
}

/* pos lives in device memory, so unlike the CPU backend its values are not
 * checked here: the kernels clamp each query's keys to [0, min(pos, n_kv-1)]. */
static strata_status cuda_attention(st_backend *be, st_stream *s, const float *q, const float *k,
                                    const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                    int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                                    float scale, float *out) {
    const char *op = "cuda attention";
    CHECK_F32(q, op);
    CHECK_F32(k, op);
    CHECK_F32(v, op);
    CHECK_F32(out, op);
    RUN(be, s, st_cuda_op_attention(be, cs_, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, head_dim,
                                    scale, out));
}

static strata_status cuda_attention_part(st_backend *be, st_stream *s, const float *q, const float *k,
                                         const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                         int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                         bool merge, float *out, float *lse) {
    const char *op = "cuda attention_part";
    CHECK_F32(q, op);
    CHECK_F32(k, op);
    CHECK_F32(v, op);
    CHECK_F32(out, op);
    if (lse) CHECK_F32(lse, op);
    RUN(be, s, st_cuda_op_attention_part(be, cs_, q, k, v, pos, n, key0, n_kv, n_heads, n_kv_heads, head_dim,
                                         scale, merge, out, lse));
}

static strata_status cuda_swiglu(st_backend *be, st_stream *s, const float *gate, const float *up,
                                 int64_t n, float *out) {
    const char *op = "cuda swiglu";
    CHECK_F32(gate, op);
    CHECK_F32(up, op);
    CHECK_F32(out, op);
    RUN(be, s, st_cuda_op_swiglu(be, cs_, gate, up, n, out));
}

static strata_status cuda_attn_merge(st_backend *be, st_stream *s, float *out, float *lse, const float *out2,
                                     const float *lse2, int64_t rows, int64_t hd) {
    const char *op = "cuda attn_merge";
    CHECK_F32(out, op);
    CHECK_F32(lse, op);
    CHECK_F32(out2, op);
    CHECK_F32(lse2, op);
    RUN(be, s, st_cuda_op_attn_merge(be, cs_, out, lse, out2, lse2, rows, hd));
}

static strata_status cuda_add(st_backend *be, st_stream *s, float *x, const float *y, int64_t n) {
    const char *op = "cuda add";
    CHECK_F32(x, op);
    CHECK_F32(y, op);
    RUN(be, s, st_cuda_op_add(be, cs_, x, y, n));
}

static strata_status cuda_argmax(st_backend *be, st_stream *s, const float *x, int64_t n, int64_t cols,
                                 int32_t *out) {
    CHECK_F32(x, "cuda argmax");
    RUN(be, s, st_cuda_op_argmax(be, cs_, x, n, cols, out));
}

static strata_status cuda_sample(st_backend *be, st_stream *s, const float *logits, int64_t n, int64_t vocab,
                                 const st_sample_args *args, int32_t *out) {
    const char *op = "cuda sample";
    CHECK_F32(logits, op);
    if (!st_cuda_aligned(args, 8))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: args = %p is not 8-byte aligned", op, (const void *)args);
    RUN(be, s, st_cuda_op_sample(be, cs_, logits, n, vocab, args, out));
}

static strata_status cuda_matmul_multi(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                       int count, int64_t n, float *const *y) {
    const char *op = "cuda matmul_multi";
    for (int i = 0; i < count; i++) {
        CHECK_W16(&w[i], op);
        CHECK_F32(y[i], op);
    }
    CHECK_F32(x, op);
    RUN(be, s, st_cuda_op_matmul_multi(be, cs_, x, w, count, n, y));
}

static strata_status cuda_matmul_swiglu(st_backend *be, st_stream *s, const float *x, const st_weight *wg,
                                        const st_weight *wu, int64_t n, float *out, float *work) {
    const char *op = "cuda matmul_swiglu";
    CHECK_W16(wg, op);
    CHECK_W16(wu, op);
    CHECK_F32(x, op);
    CHECK_F32(out, op);
    if (work) CHECK_F32(work, op);
    RUN(be, s, st_cuda_op_matmul_swiglu(be, cs_, x, wg, wu, n, out, work));
}

static strata_status cuda_rmsnorm_matmul(st_backend *be, st_stream *s, float *x, const float *residual,
                                         const st_weight *w_norm, float eps, int64_t n, int64_t d, float *out,
                                         const st_weight *w, int count, const st_weight *up, float *const *y) {
    const char *op = "cuda rmsnorm_matmul";
    CHECK_W16(w_norm, op);
    CHECK_F32(x, op);
    CHECK_F32(out, op);
    if (residual) CHECK_F32(residual, op);
    for (int i = 0; i < count; i++) {
        CHECK_W16(&w[i], op);
        CHECK_F32(y[i], op);
    }
    if (up) CHECK_W16(up, op);
    RUN(be, s, st_cuda_op_rmsnorm_matmul(be, cs_, x, residual, w_norm, eps, n, d, out, w, count, up, y));
}

static void cuda_set_fast_prefill(st_backend *be, bool on) { st_cuda_of(be)->fast_prefill = on; }

/* ---- paged KV cache: slots, positions, block tables live on the device and
 * are not checked here (the kernels skip or clamp them, backend.h) ---- */

static strata_status cuda_kv_store_paged(st_backend *be, st_stream *s, const st_kv_layer *cache, const float *k,
                                         const float *v, const int64_t *slots, int64_t n) {
    const char *op = "cuda kv_store_paged";
    CHECK_F32(k, op);
    CHECK_F32(v, op);
    if (!st_cuda_aligned(slots, 8))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: slots = %p is not 8-byte aligned", op, (const void *)slots);
    /* the cache's alignment (by its element type): st_cuda_op_kv_store_paged */
    RUN(be, s, st_cuda_op_kv_store_paged(be, cs_, cache, k, v, slots, n));
}

static strata_status cuda_rope_kv_store(st_backend *be, st_stream *s, float *q, float *k, const float *v,
                                        const int32_t *pos, int64_t n, int64_t n_heads, int64_t head_dim,
                                        const float *inv_freq, bool interleaved, const st_kv_layer *cache,
                                        const int64_t *slots) {
    const char *op = "cuda rope_kv_store";
    CHECK_F32(q, op);
    CHECK_F32(k, op);
    CHECK_F32(v, op);
    CHECK_F32(inv_freq, op);
    if (!st_cuda_aligned(slots, 8))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: slots = %p is not 8-byte aligned", op, (const void *)slots);
    RUN(be, s, st_cuda_op_rope_kv_store(be, cs_, q, k, v, pos, n, n_heads, head_dim, inv_freq, interleaved, cache, slots));
}

static strata_status cuda_kv_gather(st_backend *be, st_stream *s, const st_kv_layer *cache, const int32_t *ids,
                                    int64_t n, float *k, float *v) {
    const char *op = "cuda kv_gather";
    CHECK_F32(k, op);
    CHECK_F32(v, op);
    RUN(be, s, st_cuda_op_kv_gather(be, cs_, cache, ids, n, k, v));
}

static strata_status cuda_attention_paged(st_backend *be, st_stream *s, const float *q, const st_paged_kv *kv,
                                          const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                          int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    const char *op = "cuda attention_paged";
    CHECK_F32(q, op);
    CHECK_F32(out, op); /* the cache's alignment (by its element type): st_cuda_op_attention_paged */
    RUN(be, s, st_cuda_op_attention_paged(be, cs_, q, kv, seq, pos, n, n_heads, n_kv_heads, head_dim, scale, out));
}

/* ---- lifetime ---- */

static void cuda_destroy(st_backend *be) {
    if (!be) return;
    st_cuda *c = st_cuda_of(be);
    if (c) {
        ST_CUDA_LOG(cudaSetDevice(c->device));
        ST_CUDA_LOG(cudaDeviceSynchronize());
        if (c->pool) scratch_release(be, &c->def);
        st_cuda_matmul_teardown(c);
        if (c->lt) {
            cublasStatus_t e = cublasLtDestroy(c->lt);
            if (e != CUBLAS_STATUS_SUCCESS)
                st_log(STRATA_LOG_ERROR, "cublasLtDestroy(c->lt) failed: %s", cublasLtGetStatusString(e));
        }
        if (be->device_budget.used)
            st_log(STRATA_LOG_WARN, "cuda backend destroyed with %zu device bytes still allocated",
                   be->device_budget.used);
        st_cuda_pool_free(c->pool);
        pthread_mutex_destroy(&c->mem_mu);
        pthread_mutex_destroy(&c->lt_mu);
        st_free(c);
    }
    st_free(be);
}

static const st_backend_ops g_cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .alloc = cuda_alloc,
    .dealloc = cuda_dealloc,
    .host_alloc = cuda_host_alloc,
    .host_dealloc = cuda_host_dealloc,
    .upload = cuda_upload,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_2d = cuda_copy_2d,
    .copy_d2d = cuda_copy_d2d,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .stream_wait_event = cuda_stream_wait_event,
    .event_sync = cuda_event_sync,
    .event_query = cuda_event_query,
    .get_rows = cuda_get_rows,
    .rmsnorm = cuda_rmsnorm,
    .matmul = cuda_matmul,
    .rope = cuda_rope,
    .attention = cuda_attention,
    .attention_part = cuda_attention_part,
    .attn_merge = cuda_attn_merge,
    .swiglu = cuda_swiglu,
    .add = cuda_add,
    .argmax = cuda_argmax,
    .matmul_multi = cuda_matmul_multi,
    .matmul_swiglu = cuda_matmul_swiglu,
    .rmsnorm_matmul = cuda_rmsnorm_matmul,
    .graph_begin = st_cuda_graph_begin,
    .graph_end = st_cuda_graph_end,
    .graph_launch = st_cuda_graph_launch,
    .graph_destroy = st_cuda_graph_destroy,
    .set_fast_prefill = cuda_set_fast_prefill,
    .kv_store_paged = cuda_kv_store_paged,
    .rope_kv_store = cuda_rope_kv_store,
    .kv_gather = cuda_kv_gather,
    .attention_paged = cuda_attention_paged,
    .sample = cuda_sample,
};

/* Creates the backend on device params->device_index. The caller owns *out
 * (st_backend_free). On error nothing is left allocated. */
strata_status st_backend_cuda_init(const st_backend_params *params, st_backend **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: out is NULL");
    *out = NULL;
    if (!params) return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: params is NULL");
    if (params->gemm_min_n < 0 || params->gemm_min_n == 1 || params->gemm_min_n_quant < 0 ||
        params->gemm_min_n_quant == 1)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: gemm_min_n %d, gemm_min_n_quant %d (0: the "
                      "default, else at least 2)", params->gemm_min_n, params->gemm_min_n_quant);
    if (params->mmq_min_n < 0 || params->mmq_max_n < -1 ||
        (params->mmq_max_n > 0 && params->mmq_max_n < (params->mmq_min_n ? params->mmq_min_n : 1)))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: mmq_min_n %d, mmq_max_n %d (0: the defaults; "
                      "mmq_max_n -1: no MMQ, else at least mmq_min_n)", params->mmq_min_n, params->mmq_max_n);
    if (params->pdl < -1 || params->pdl > 1)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: pdl %d is not -1, 0 or 1", params->pdl);
    if (params->gemv1_rows < -1 || params->gemv1_rows == 3 || params->gemv1_rows > 4)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: gemv1_rows %d is not -1, 0, 1, 2 or 4",
                      params->gemv1_rows);
    if (params->paged_dec < 0 || params->paged_dec > 2)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: paged_dec %d is not 0, 1 or 2", params->paged_dec);
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return st_err(STRATA_ERR_BACKEND, "cudaGetDeviceCount(&n_dev) failed: %s at %s:%d in %s (no usable GPU or driver)",
                      cudaGetErrorString(e), __FILE__, __LINE__, __func__);
    }
    if (params->device_index < 0 || params->device_index >= n_dev)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda backend init: device %d requested, %d present",
                      params->device_index, n_dev);
    st_backend *be = st_calloc(1, sizeof *be);
    st_cuda *c = st_calloc(1, sizeof *c);
    if (!be || !c) {
        st_free(be);
        st_free(c);
        return st_err(STRATA_ERR_NOMEM, "cuda backend init: out of memory for its state (%zu bytes)",
                      sizeof *be + sizeof *c);
    }
    be->ops = &g_cuda_ops;
    be->kind = ST_BACKEND_CUDA;
    be->device_budget.cap = params->device_mem;
    be->impl = c;
    c->device = params->device_index;
    pthread_mutex_init(&c->mem_mu, NULL);
    pthread_mutex_init(&c->lt_mu, NULL);
    c->def.magic = STREAM_MAGIC;
    c->def.s = 0;

    strata_status st = STRATA_OK;
#define INIT_TRY(call)                                                                       \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            st = st_err(STRATA_ERR_BACKEND, "%s failed: %s at %s:%d in %s", #call,           \
                        cudaGetErrorString(e_), __FILE__, __LINE__, __func__);               \
            goto fail;                                                                       \
        }                                                                                    \
    } while (0)
    INIT_TRY(cudaSetDevice(c->device));
    INIT_TRY(cudaFree(0)); /* creates the context now, so failures surface here */
    INIT_TRY(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, c->device));
    int optin = 0;
    INIT_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device));
    c->smem_optin = (size_t)optin;
#undef INIT_TRY
    {
        cublasStatus_t ce = cublasLtCreate(&c->lt);
        if (ce != CUBLAS_STATUS_SUCCESS) {
            c->lt = NULL;
            st = st_err(STRATA_ERR_BACKEND, "cublasLtCreate(&c->lt) failed: %s at %s:%d in %s",
                        cublasLtGetStatusString(ce), __FILE__, __LINE__, __func__);
            goto fail;
        }
    }
    if (params->device_mem) {
        /* a budget larger than the device holds is capped at what it has free
         * (minus the lazy pool's margin), said once in the log */
        size_t cap = params->device_mem, free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b > LAZY_MARGIN &&
            cap > free_b - LAZY_MARGIN) {
            st_log(STRATA_LOG_WARN, "device memory budget %zu bytes exceeds the %zu bytes free on the GPU: "
                   "using %zu", cap, free_b, free_b - LAZY_MARGIN);
            cap = free_b - LAZY_MARGIN;
            be->device_budget.cap = cap;
        }
        st = st_cuda_pool_init(cap, cap, 0, true, &c->pool);
    } else
        st = st_cuda_pool_init(0, LAZY_CHUNK, LAZY_MARGIN, false, &c->pool);
    if (st != STRATA_OK) goto fail;
    c->pdl = params->pdl >= 0; /* 0 (default) and 1: on; -1: off (a tuning switch for measurements) */
    c->paged_dec = params->paged_dec;
    if ((st = st_cuda_matmul_setup(c, params)) != STRATA_OK) goto fail;
    if ((st = st_cuda_attention_setup(c, params)) != STRATA_OK) goto fail;
    if ((st = st_cuda_sample_setup(c)) != STRATA_OK) goto fail;
    if ((st = st_cuda_attention_paged_setup(c)) != STRATA_OK) goto fail;
    *out = be;
    return STRATA_OK;
fail:
    cuda_destroy(be);
    return st;
}

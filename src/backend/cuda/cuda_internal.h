/* Private to the CUDA backend: its state, checked-call macros, the device
 * memory pool, per-stream scratch, and the ops' entry points (one .cu file
 * each). Included by C (cuda_backend.c, cuda_pool.c) and CUDA C (.cu) files.
 *
 * Threading: memory calls (alloc, dealloc, scratch growth) and the cuBLASLt
 * plan cache are guarded by mutexes, so several host threads may share a
 * backend. A stream's scratch buffers belong to that stream: one stream is
 * driven by one host thread at a time (the usual CUDA rule). */
#pragma once
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "backend/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

/* ---- checked calls -----------------------------------------------------------
 * Every CUDA / cuBLAS(Lt) call goes through one of these. The message names the
 * statement, the error string, file:line and the function. */
#define ST_CUDA_TRY(call)                                                                   \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess)                                                              \
            return st_err(STRATA_ERR_BACKEND, "%s failed: %s at %s:%d in %s", #call,        \
                          cudaGetErrorString(e_), __FILE__, __LINE__, __func__);            \
    } while (0)

#define ST_CUBLAS_TRY(call)                                                                 \
    do {                                                                                    \
        cublasStatus_t e_ = (call);                                                         \
        if (e_ != CUBLAS_STATUS_SUCCESS)                                                    \
            return st_err(STRATA_ERR_BACKEND, "%s failed: %s at %s:%d in %s", #call,        \
                          cublasLtGetStatusString(e_), __FILE__, __LINE__, __func__);       \
    } while (0)

/* After a kernel launch (<<<...>>>): catches bad configurations at once. */
#define ST_CUDA_LAUNCHED(kernel_name)                                                       \
    do {                                                                                    \
        cudaError_t e_ = cudaGetLastError();                                                \
        if (e_ != cudaSuccess)                                                              \
            return st_err(STRATA_ERR_BACKEND, "launch of %s failed: %s at %s:%d in %s",     \
                          kernel_name, cudaGetErrorString(e_), __FILE__, __LINE__, __func__);\
    } while (0)

/* For paths that cannot return a status (destroy, dealloc): logged as errors. */
#define ST_CUDA_LOG(call)                                                                   \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess)                                                              \
            st_log(STRATA_LOG_ERROR, "%s failed: %s at %s:%d in %s", #call,                 \
                   cudaGetErrorString(e_), __FILE__, __LINE__, __func__);                   \
    } while (0)

/* ---- device memory pool (cuda_pool.c) -----------------------------------------
 * Large chunks from cudaMalloc, carved with a first-fit free list (address
 * ordered, coalescing on free), 256-byte granularity. Chunks are only given
 * back to the driver by st_cuda_pool_free. Not thread safe: the backend holds
 * its mem_mu around every call. */
#define ST_CUDA_ALIGN 256

typedef struct st_cuda_pool st_cuda_pool;

/* cap: most bytes of chunks ever held (0: no cap; growth then stops when the
 * device would keep less than `margin` bytes free). chunk: preferred chunk
 * size. eager: carve one chunk of `cap` bytes now (cap must be > 0). */
strata_status st_cuda_pool_init(size_t cap, size_t chunk, size_t margin, bool eager,
                                st_cuda_pool **out);
void st_cuda_pool_free(st_cuda_pool *p); /* cudaFree of every chunk; NULL is a no-op */
/* *out = a block of at least n bytes (n rounded up to ST_CUDA_ALIGN; *got says
 * how many, the amount to count against the budget). STRATA_ERR_NOMEM when no
 * chunk has room and no new chunk can be made. */
strata_status st_cuda_pool_alloc(st_cuda_pool *p, size_t n, void **out, size_t *got);
/* Returns the block at p to the pool; *got = its size. false when p is not
 * the start of a live block of this pool. */
bool st_cuda_pool_release(st_cuda_pool *p, void *ptr, size_t *got);
size_t st_cuda_pool_chunk_bytes(const st_cuda_pool *p); /* bytes held from the driver */

/* ---- streams and scratch -------------------------------------------------------*/
typedef enum {
    ST_CUDA_SCRATCH_X = 0, /* activations converted to bf16 (matmul), aligned copies */
    ST_CUDA_SCRATCH_W,     /* weights dequantized to bf16 (matmul, prefill) */
    ST_CUDA_SCRATCH_ATTN,  /* split-KV partial results (attention) */
    ST_CUDA_SCRATCH_LT,    /* cuBLASLt workspace */
    ST_CUDA_SCRATCH_TMP,   /* an op's intermediate result (matmul_swiglu's up projection) */
    ST_CUDA_SCRATCH_SMALL, /* per-block partial results (argmax) */
    ST_CUDA_SCRATCH_STACK, /* stacked hi/lo GEMM results (precise bf16 matmul, <= 256 tokens) */
    ST_CUDA_SCRATCH_ATTN_BF16, /* K and V rounded to bf16 (fast prefill attention, FA2 kernel) */
    ST_CUDA_SCRATCH_XQ,    /* activations quantized to int8 + block scales (fast-mode decode GEMV) */
    ST_CUDA_SCRATCH_MMQ,   /* the MMQ's partial sums per K slice (small launches) */
    ST_CUDA_SCRATCH_COUNT
} st_cuda_scratch_slot;

typedef struct {
    void *p;
    size_t n;
} st_cuda_buf;

typedef struct {
    uint32_t magic;
    cudaStream_t s;     /* 0 (the legacy default stream) for the backend's own */
    bool owned;         /* s was created by stream_create */
    st_cuda_buf scratch[ST_CUDA_SCRATCH_COUNT]; /* pool blocks, owned by the stream */
} st_cuda_stream;

typedef struct st_cuda_lt_cache st_cuda_lt_cache; /* cuda_matmul.cu */

typedef struct {
    int device;
    int sm_count;
    size_t smem_optin;        /* max dynamic shared memory per block */
    st_cuda_pool *pool;
    pthread_mutex_t mem_mu;   /* pool + st_backend.device_budget */
    cublasLtHandle_t lt;
    pthread_mutex_t lt_mu;    /* the plan cache, held across cublasLtMatmul */
    st_cuda_lt_cache *lt_cache;
    st_cuda_stream def;       /* used when an op is given a NULL stream */
    bool fast_prefill;        /* set_fast_prefill: bf16-rounded operands in GEMMs and prefill attention */
    bool pdl;                 /* launch the decode-path kernels with programmatic dependent launch
                                 (st_backend_params.pdl = -1 turns it off) */
    int paged_dec;            /* st_backend_params.paged_dec: attention_paged's decode kernel (0: by the
                                 items per SM, 1: a block per item, 2: a warp per item) */
    int attn_fa2;             /* st_backend_params.attn_fa2 (read at init): the FA2 kernel's configuration
                                 (cuda_attn_prefill_fa2.cuh; -1: auto, the default; ST_ATTN_FA2_WGMMA /
                                 ST_ATTN_FA2_WGMMA_PP: the Hopper kernel, without or with its turns) */
    bool attn_wgmma;          /* the Hopper prefill attention kernel can run (compute capability 9.0:
                                 cuda_attn_prefill_wgmma.cu, st_attn_wgmma_setup) */
    void *tmap_encode;        /* the driver's cuTensorMapEncodeTiled (NULL: none; st_attn_wgmma_setup) */
    size_t sample_smem;       /* dynamic shared memory the sample kernel may use (st_cuda_sample_setup) */
    int attn_dec_bpsm[2][2][3]; /* blocks per SM of the contiguous decode attention kernel
                                   [attention, attention_part][hd 64, 128][rows 4, 8, 16]
                                   (st_cuda_attention_setup) */
} st_cuda;

static inline st_cuda *st_cuda_of(st_backend *be) { return (st_cuda *)be->impl; }

/* The stream an op runs on: s itself, or the backend's default for NULL. */
st_cuda_stream *st_cuda_stream_get(st_backend *be, st_stream *s);

/* *out = the stream's scratch buffer `slot`, at least `bytes` long. Grows
 * rarely (x1.5 and at least 1 MiB): the stream is synchronized before the old
 * buffer goes back to the pool, so work still queued never sees it reused.
 * Counted in be->device_budget. While the stream is being recorded into a
 * graph, growth is refused (STRATA_ERR_BACKEND): the caller drops the
 * recording, runs eagerly (which grows the buffer) and records again later. */
strata_status st_cuda_scratch(st_backend *be, st_cuda_stream *s, st_cuda_scratch_slot slot,
                              size_t bytes, void **out);

/* Same check on every op's weight and pointers (cuda_backend.c). */
static inline bool st_cuda_aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* ---- ops (arguments already checked by cuda_backend.c; n > 0) -------------------*/
strata_status st_cuda_op_get_rows(st_backend *be, st_cuda_stream *s, const st_weight *w,
                                  const int32_t *ids, int64_t n, float *out);
strata_status st_cuda_op_rmsnorm(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                 const st_weight *w, float eps, int64_t n, int64_t d, float *out);
/* rmsnorm that also writes out's int8 quantization (xq [n, d], xd, xs [n, d / 32]; xs may be NULL), the
 * same bytes as st_cuda_gemv2_quant_x of out; *done false (nothing launched) where its kernel does not
 * apply (d % 32, alignment). cuda_rmsnorm.cu */
strata_status st_cuda_rmsnorm_q(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                const st_weight *w, float eps, int64_t n, int64_t d, float *out, int8_t *xq,
                                float *xd, float *xs, bool *done);
strata_status st_cuda_op_matmul(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w,
                                int64_t n, float *y);
strata_status st_cuda_op_rope(st_backend *be, st_cuda_stream *s, float *x, const int32_t *pos,
                              int64_t n, int64_t n_heads, int64_t head_dim, const float *inv_freq,
                              bool interleaved);
/* attention_part (backend.h): cuda_attention.cu */
strata_status st_cuda_op_attn_merge(st_backend *be, st_cuda_stream *s, float *out, float *lse, const float *out2,
                                    const float *lse2, int64_t rows, int64_t hd);
strata_status st_cuda_op_attention_part(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                        const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                        int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                        bool merge, float *out, float *lse);
strata_status st_cuda_op_attention(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                   const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                   float *out);
strata_status st_cuda_op_swiglu(st_backend *be, st_cuda_stream *s, const float *gate, const float *up,
                                int64_t n, float *out);
strata_status st_cuda_op_add(st_backend *be, st_cuda_stream *s, float *x, const float *y, int64_t n);
strata_status st_cuda_op_argmax(st_backend *be, st_cuda_stream *s, const float *x, int64_t n, int64_t cols,
                                int32_t *out);
strata_status st_cuda_op_matmul_multi(st_backend *be, st_cuda_stream *s, const float *x, const st_weight *w,
                                      int count, int64_t n, float *const *y);
strata_status st_cuda_op_matmul_swiglu(st_backend *be, st_cuda_stream *s, const float *x,
                                       const st_weight *w_gate, const st_weight *w_up, int64_t n, float *out,
                                       float *work);
/* rmsnorm_matmul (backend.h): cuda_matmul.cu */
strata_status st_cuda_op_rmsnorm_matmul(st_backend *be, st_cuda_stream *s, float *x, const float *residual,
                                        const st_weight *w_norm, float eps, int64_t n, int64_t d, float *out,
                                        const st_weight *w, int count, const st_weight *up, float *const *y);

strata_status st_cuda_op_kv_store_paged(st_backend *be, st_cuda_stream *s, const st_kv_layer *cache,
                                        const float *k, const float *v, const int64_t *slots, int64_t n);
/* rope_kv_store (backend.h): cuda_rope.cu */
strata_status st_cuda_op_rope_kv_store(st_backend *be, st_cuda_stream *s, float *q, float *k, const float *v,
                                       const int32_t *pos, int64_t n, int64_t n_heads, int64_t head_dim,
                                       const float *inv_freq, bool interleaved, const st_kv_layer *cache,
                                       const int64_t *slots);
strata_status st_cuda_op_kv_gather(st_backend *be, st_cuda_stream *s, const st_kv_layer *cache, const int32_t *ids,
                                   int64_t n, float *k, float *v);
strata_status st_cuda_op_attention_paged(st_backend *be, st_cuda_stream *s, const float *q, const st_paged_kv *kv,
                                         const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, float scale, float *out);
strata_status st_cuda_op_sample(st_backend *be, st_cuda_stream *s, const float *logits, int64_t n, int64_t vocab,
                                const st_sample_args *args, int32_t *out);

/* Graphs (cuda_graph.c), backend.h's graph_* with the same contracts. */
strata_status st_cuda_graph_begin(st_backend *be, st_stream *s);
strata_status st_cuda_graph_end(st_backend *be, st_stream *s, st_graph **out);
strata_status st_cuda_graph_launch(st_backend *be, st_stream *s, st_graph *g);
void st_cuda_graph_destroy(st_backend *be, st_graph *g);

/* True when a CUDA device can be used (cudaGetDeviceCount > 0; no abort and
 * no error left behind when there is no driver). Defined in cuda_backend.c;
 * backend.h should declare it beside st_backend_cuda_init for backend.c's
 * st_backend_available. */
bool st_backend_cuda_present(void);

/* One-time setup of the ops (kernel attributes, the tuning fields of params)
 * and the matmul's plan cache. */
strata_status st_cuda_attention_setup(st_cuda *c, const st_backend_params *params); /* attn_fa2 */
strata_status st_cuda_sample_setup(st_cuda *c); /* sizes the kernel's shared memory */
strata_status st_cuda_attention_paged_setup(st_cuda *c);
strata_status st_cuda_matmul_setup(st_cuda *c, const st_backend_params *params); /* gemm_min_n* */
void st_cuda_matmul_teardown(st_cuda *c);

#ifdef __cplusplus
}
#endif

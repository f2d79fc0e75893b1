/* backend.h: the one interface every device implements.
 *
 * Memory: "device" buffers (on the CPU backend, plain host memory inside a
 * capped arena) and host buffers (pinned on CUDA).
 * Streams and events: every op is enqueued on a stream; ordering between
 * streams goes through events (record on one, wait on the other) - never
 * through the host. The CPU backend executes each op synchronously on the
 * calling thread (with its worker pool), so its streams/events are trivially
 * complete, but callers must use them exactly as on CUDA.
 * Ops: activations are fp32, row-major; weights are any st_dtype and are
 * dequantized inside the op. All pointers are device pointers of this backend.
 * CUDA specifics: token ids and positions live on the device, so the kernels
 * clamp them instead of the host checking them (callers validate first);
 * weight data must be 16-byte aligned; dealloc waits for the device.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"
#include "core/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_backend st_backend;
typedef struct st_stream st_stream;
typedef struct st_event st_event;
typedef struct st_graph st_graph; /* a recorded sequence of ops (CUDA graph) */

/* A weight matrix in device memory: rows x cols, row-major, each row
 * st_dtype_row_bytes(dtype, cols) bytes, rows contiguous. A vector is rows=1.
 * `stride` (bytes from one row's start to the next's; 0: the row's bytes)
 * lets a matmul read the first `cols` columns of a wider matrix in place (the
 * CPU tier's share of a split FFN's down projection): only the CPU backend's
 * matmuls take a stride; every other op and backend refuses one. */
typedef struct {
    const void *data;
    st_dtype dtype;
    int64_t rows;
    int64_t cols;
    size_t stride;
} st_weight;

/* Bytes from one row of w to the next. */
static inline size_t st_weight_stride(const st_weight *w) {
    return w->stride ? w->stride : st_dtype_row_bytes(w->dtype, w->cols);
}
/* Rows packed one after the other (no stride, or the row's own bytes). */
static inline bool st_weight_dense(const st_weight *w) {
    return w->stride == 0 || w->stride == st_dtype_row_bytes(w->dtype, w->cols);
}

/* Element type of a paged KV pool. */
typedef enum { ST_KV_F32 = 0, ST_KV_BF16 = 1, ST_KV_FP8 = 2 } st_kv_dtype;
/* "f32", "bf16", "fp8"; st_kv_dtype_parse returns false for anything else. */
const char *st_kv_dtype_name(st_kv_dtype t);
bool st_kv_dtype_parse(const char *s, st_kv_dtype *out);
/* Bytes of one element (4, 2, 1). */
size_t st_kv_dtype_size(st_kv_dtype t);

/* One layer's K/V storage in a paged pool: n_slots rows of n_kv_heads x head_dim
 * elements of `dtype`. FP8 (e4m3fn): every (slot, kv head) row of head_dim values
 * has its own float scale (value = fp8 * scale; scale = max|x| / 448 of that row,
 * 1 when the row is all zeros), in k_scale / v_scale [n_slots, n_kv_heads]; NULL for the other types.
 * Conversions from fp32 (kv_store_paged), identical on every backend:
 *   bf16: round to nearest even; NaN -> 0x7fff;
 *   fp8: scale = max|x_d| / 448 over the row (NaNs ignored; 1 when that is 0,
 *     i.e. an all-zero row or one whose max underflows), then e4m3fn of
 *     x_d / scale (fp32 division): round to nearest even, saturating to +-448
 *     (infinities too), NaN -> 0x7f.
 * Reads (attention_paged) dequantize exactly: bf16 -> fp32 bits << 16; fp8 ->
 * its fp32 value times the row's scale (one fp32 multiply). */
/* Keys per attention range: the CPU backend splits every query's keys at
 * its multiples and merges the ranges in order (attention_part), so that
 * attending a long context piece by piece gives the bits of one call. A
 * piece of keys starts at a multiple of it. */
#define ST_ATTN_RANGE 256

typedef struct {
    void *k, *v;               /* [n_slots, n_kv_heads, head_dim] */
    float *k_scale, *v_scale;  /* ST_KV_FP8: [n_slots, n_kv_heads]; else NULL */
    st_kv_dtype dtype;
    int64_t n_slots;
    int64_t n_kv_heads, head_dim;
} st_kv_layer;

/* Conversions of one value, the reference every backend matches bit for bit
 * (rules above): fp32 -> bf16 / e4m3fn bits and back (exact). */
uint16_t st_kv_f32_to_bf16(float x);
float st_kv_bf16_to_f32(uint16_t b);
uint8_t st_kv_f32_to_fp8(float x);
float st_kv_fp8_to_f32(uint8_t b);
/* The fp8 scale of a row of n values: max|x| / 448 (NaNs ignored), 1 when that is 0. */
float st_kv_fp8_row_scale(const float *x, int64_t n);

/* One layer's paged KV cache as attention_paged reads it (all pointers are
 * device pointers; the struct itself is host memory, read during the call).
 * The pool is cut into blocks of block_size token slots; slot r is row r of
 * cache.k / cache.v (st_kv_layer: cache.n_slots rows of n_kv_heads x head_dim
 * elements of cache.dtype, plus the fp8 scales). Sequence s of the batch holds
 * ctx_lens[s] keys: key j (position j) lives in slot
 *   block_tables[s * max_blocks + j / block_size] * block_size + j % block_size.
 * Entries of a row past ceil(ctx_lens[s] / block_size) are never read. */
typedef struct {
    st_kv_layer cache;           /* the layer's pool: n_slots = num_blocks * block_size rows */
    int64_t block_size;          /* token slots per block, >= 1 */
    const int32_t *block_tables; /* [n_seqs, max_blocks] int32 physical block ids */
    int64_t max_blocks;          /* row stride of block_tables */
    const int32_t *ctx_lens;     /* [n_seqs] int32: keys each sequence holds, <= max_blocks * block_size */
    int64_t n_seqs;
    int64_t max_ctx;             /* host: >= every ctx_lens[s] (an upper bound: the CUDA
                                    backend sizes its split-KV work with it) */
    int64_t batch_seqs;          /* host hint: sequences that have tokens in this call (0:
                                    unknown, taken as n_seqs); n_seqs may be larger (a fixed
                                    table). CUDA picks its decode kernel when the call holds
                                    about one token per sequence; results do not depend on it */
} st_paged_kv;

/* One row's parameters for the `sample` op (a device array of them, so that
 * a recorded graph reads new values each run). Hugging Face semantics, as
 * engine/sampler.h steps 2-6 (the repetition penalty is not applied here). */
typedef struct {
    double u;            /* the uniform draw in [0, 1) (the sequence's host RNG made it) */
    float temperature;   /* 0: greedy (argmax, lowest id on a tie; u unused); else > 0 */
    int32_t top_k;       /* 0 or >= vocab: off */
    float top_p;         /* (0, 1]; 1: off */
    float min_p;         /* [0, 1]; 0: off */
} st_sample_args;

typedef enum { ST_BACKEND_CPU = 0, ST_BACKEND_CUDA } st_backend_kind;

/* CPU: the activations of the matmuls over quantized weights (cpu_matmul_int.c) */
typedef enum {
    ST_CPU_ACT_PRECISE = 0, /* 22-bit integers per 32-block: ~1e-6 of the f32 dequantized product (default) */
    ST_CPU_ACT_INT8,        /* int8 per 32-block (q8-style, as llama.cpp): ~1e-2, vpdpbusd: faster */
} st_cpu_act;

typedef struct {
    st_backend_kind kind;
    int n_threads;        /* CPU: worker threads (<= 0: all cores) */
    st_cpu_act cpu_act;   /* CPU: quantized matmuls' activation precision */
    size_t device_mem;    /* cap on device allocations (0: unlimited) */
    int device_index;     /* CUDA */
    /* CUDA tuning, read once at init (zero / NULL: the measured defaults;
     * benchmarks and checks set them, the tools do not) */
    int gemm_min_n;       /* CUDA: tokens from which matmuls over plain (f32, f16, bf16) weights run as
                             a GEMM instead of the GEMV (0: 4; values below 2 other than 0: invalid) */
    int gemm_min_n_quant; /* CUDA: the same for quantized weights (0: 12) */
    int mmq_min_n;        /* CUDA, fast mode: fewest tokens whose q8_0 / q4_0 / q4_1 / q4_k / q6_k matmuls run
                             on the int8 tensor-core kernel (MMQ) rather than the GEMV (0: the default, 5) */
    int mmq_max_n;        /* CUDA, fast mode: most tokens for the MMQ, above it dequantize + GEMM
                             (0: the default, 64; -1: never the MMQ; else at least mmq_min_n) */
    const char *attn_fa2; /* CUDA: the fast-mode prefill attention kernel: NULL / "auto" (the Hopper
                             wgmma kernel for head dim 128 on compute capability 9.0, else the FA2
                             configuration measured fastest, per call), "wgmma" (the same), "wgmma-pp"
                             (the Hopper kernel with its warpgroups taking turns), or an FA2
                             configuration: "b128w8", "b128w8r", "b128w4", "b256w8"; an unknown
                             name fails init */
    int pdl;              /* CUDA: programmatic dependent launch of the decode-path kernels:
                             0 default (on), 1 on, -1 off */
    int gemv1_rows;       /* CUDA, fast mode: rows per warp of the one-token int8 GEMV of q8_0 / q4_0 /
                             q4_1 / q4_k / q6_k (cuda_gemv1.cu): 0 by the measured rule, 1, 2 or 4; -1: the
                             staged kernel instead (comparisons); other values fail init */
    int paged_dec;        /* CUDA: attention_paged's decode kernel (batches of about one token per
                             sequence): 0 by the rule (a block per (token, kv head, range) below 2
                             of them per SM, else a warp each), 1 a block each, 2 a warp each (the
                             same bits; comparisons); other values fail init */
} st_backend_params;

typedef struct {
    const char *name;
    void (*destroy)(st_backend *be);

    /* memory */
    strata_status (*alloc)(st_backend *be, size_t n, void **out);
    void (*dealloc)(st_backend *be, void *p);
    strata_status (*host_alloc)(st_backend *be, size_t n, void **out); /* pinned */
    void (*host_dealloc)(st_backend *be, void *p);
    /* Makes `n` bytes of host memory usable as device memory: on CPU the same
     * pointer (zero copy, *owned=false); elsewhere an allocation plus a copy
     * (*owned=true: release with dealloc). */
    strata_status (*upload)(st_backend *be, const void *host, size_t n, void **dev, bool *owned);
    strata_status (*copy_h2d)(st_backend *be, st_stream *s, void *dst, const void *src, size_t n);
    strata_status (*copy_d2h)(st_backend *be, st_stream *s, void *dst, const void *src, size_t n);
    strata_status (*copy_d2d)(st_backend *be, st_stream *s, void *dst, const void *src, size_t n);
    /* A strided copy, in any direction (host or device on either side; pinned
     * host memory overlaps): `height` rows of `width` bytes, row r from
     * src + r * spitch to dst + r * dpitch (pitches >= width). One DMA
     * operation on CUDA (cudaMemcpy2DAsync): the KV tiers move many blocks of
     * a layer in one call this way. */
    strata_status (*copy_2d)(st_backend *be, st_stream *s, void *dst, size_t dpitch, const void *src,
                             size_t spitch, size_t width, size_t height);

    /* streams and events */
    strata_status (*stream_create)(st_backend *be, bool high_priority, st_stream **out);
    void (*stream_destroy)(st_backend *be, st_stream *s);
    strata_status (*stream_sync)(st_backend *be, st_stream *s);
    strata_status (*event_create)(st_backend *be, st_event **out);
    void (*event_destroy)(st_backend *be, st_event *e);
    strata_status (*event_record)(st_backend *be, st_event *e, st_stream *s);
    strata_status (*stream_wait_event)(st_backend *be, st_stream *s, st_event *e);
    strata_status (*event_sync)(st_backend *be, st_event *e);
    /* Non-blocking: *done = whether everything before the event's last record
     * has completed (an event never recorded counts as completed). */
    strata_status (*event_query)(st_backend *be, st_event *e, bool *done);

    /* ops */
    /* out[i,:] = dequant(w[ids[i], :]) for i < n.   ids: [n] int32, out: [n, w.cols] */
    strata_status (*get_rows)(st_backend *be, st_stream *s, const st_weight *w,
                              const int32_t *ids, int64_t n, float *out);
    /* If residual != NULL: x += residual (in place, x: [n, d]).
     * Then out[i,:] = x[i,:] / sqrt(mean(x[i,:]^2) + eps) * w   (w: 1 x d) */
    strata_status (*rmsnorm)(st_backend *be, st_stream *s, float *x, const float *residual,
                             const st_weight *w, float eps, int64_t n, int64_t d, float *out);
    /* y[n, w.rows] = x[n, w.cols] @ w^T, fp32 accumulation. */
    strata_status (*matmul)(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                            int64_t n, float *y);
    /* Rotates x: [n, n_heads, head_dim] in place. Token i sits at position pos[i];
     * pair j (< head_dim/2) turns by the angle pos*inv_freq[j], exact for
     * every int32 position: every backend forms it as backend/rope_angle.h says
     * (double hi + lo, cos/sin in double, only they rounded to float).
     * interleaved: pairs (2j, 2j+1); else rotate-half pairs (j, j + head_dim/2). */
    strata_status (*rope)(st_backend *be, st_stream *s, float *x, const int32_t *pos, int64_t n,
                          int64_t n_heads, int64_t head_dim, const float *inv_freq, bool interleaved);
    /* Causal grouped-query attention of one sequence.
     * q: [n, n_heads, hd]; k, v: [n_kv, n_kv_heads, hd] (the cache, keys at
     * positions 0..n_kv-1); query i sits at position pos[i] and sees keys
     * 0..pos[i]; head h reads kv head h / (n_heads / n_kv_heads).
     * out: [n, n_heads, hd] = softmax(q k^T * scale) v. (= attention_part
     * with key0 = 0 and merge false; the CPU computes it so, bit for bit.) */
    strata_status (*attention)(st_backend *be, st_stream *s, const float *q, const float *k,
                               const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                               int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                               float *out);
    /* Attention of one sequence's queries over one piece of its keys, merged
     * into a running result: how a context longer than any one buffer is
     * attended, piece by piece (model/forward.c: keys gathered from the pool
     * or streamed from host memory in pieces of a bounded size).
     * k, v: [n_kv, n_kv_heads, hd] fp32 hold keys key0 .. key0 + n_kv - 1
     * (key0 >= 0, a multiple of ST_ATTN_RANGE); query i (q: [n, n_heads, hd])
     * sits at position pos[i] >= key0 (pos: [n] int32 on the device) and sees
     * keys key0 .. min(pos[i], key0 + n_kv - 1); head h reads kv head
     * h / (n_heads / n_kv_heads). With s_j = scale q . k_j over those keys:
     * out_p = softmax(s) v ([n, n_heads, hd]) and lse_p = log(sum_j exp(s_j))
     * (natural log, [n, n_heads] fp32).
     *   merge false: out = out_p, lse = lse_p (lse may be NULL: not written);
     *   merge true: out and lse hold the result over earlier keys (all before
     *     key0) and become the result over those and this piece's:
     *       M = max(lse, lse_p), a = exp(lse - M), b = exp(lse_p - M),
     *       out = (out a + out_p b) / (a + b), lse = M + log(a + b).
     * CPU: every query's keys are cut into ranges at the multiples of
     * ST_ATTN_RANGE counted from key 0 (so a piece holds whole ranges but
     * perhaps the last); each range is computed as `attention` computes an
     * item (two passes in fp32) and the ranges are merged in increasing
     * order by the rule above. `attention` and `attention_paged` compute the
     * same ranges the same way, so the bits of calls over consecutive pieces
     * (merge after the first) equal those of one call over all the keys, of
     * `attention`, and of `attention_paged` over the same keys.
     * CUDA: the kernels of `attention` (precise or fast mode, the same
     * error; other head dims or unaligned pointers: its generic fp32
     * kernel); results within fp32 rounding of the CPU's in
     * precise mode, not bit-equal. The CPU backend checks pos (>= key0, and
     * < 2^31) and returns STRATA_ERR_INVALID_ARG; CUDA clamps instead. */
    strata_status (*attention_part)(st_backend *be, st_stream *s, const float *q, const float *k,
                                    const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                    int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                    bool merge, float *out, float *lse);
    /* attention_part over keys key0 .. key0 + n_kv - 1 held as rows of a KV
     * view in its own dtype (rows->k / v / scales: row j is key key0 + j; any
     * st_kv_dtype, read as kv_gather would widen it), q, pos, out and lse in
     * this backend's memory: the same ranges and bits as kv_gather into fp32
     * then attention_part. CPU only (NULL elsewhere): a streamed sequence's
     * oldest keys attended from host memory (model/llama.c). */
    strata_status (*attention_rows)(st_backend *be, st_stream *s, const float *q, const st_kv_layer *rows,
                                    const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads,
                                    int64_t n_kv_heads, int64_t head_dim, float scale, bool merge, float *out,
                                    float *lse);
    /* Two attention results over disjoint keys merged, rows of hd outputs
     * and a log-sum-exp each (attention_part's rule): for r < rows,
     * (out_r, lse_r) becomes the result over both (out2_r, lse2_r) included.
     * The rule is symmetric: the bits do not depend on which side is which. */
    strata_status (*attn_merge)(st_backend *be, st_stream *s, float *out, float *lse, const float *out2,
                                const float *lse2, int64_t rows, int64_t hd);
    /* out[i] = silu(gate[i]) * up[i] for i < n. */
    strata_status (*swiglu)(st_backend *be, st_stream *s, const float *gate, const float *up,
                            int64_t n, float *out);
    /* x[i] += y[i] for i < n. */
    strata_status (*add)(st_backend *be, st_stream *s, float *x, const float *y, int64_t n);

    /* ---- decode-step ops and graphs ---- */
    /* out[i] = the index of the largest of x[i, 0..cols) for i < n: the first
     * one on ties; NaN never wins (0 when no element is a number). out: [n]
     * int32 on the device. */
    strata_status (*argmax)(st_backend *be, st_stream *s, const float *x, int64_t n, int64_t cols,
                            int32_t *out);
    /* y[i][n, w[i].rows] = x[n, cols] @ w[i]^T for i < count (<= 4): several
     * weights with the same cols applied to one x (q, k, v), in one launch
     * where the backend can. Same results as `count` matmul calls. */
    strata_status (*matmul_multi)(st_backend *be, st_stream *s, const float *x, const st_weight *w,
                                  int count, int64_t n, float *const *y);
    /* out[n, w_gate.rows] = silu(x @ w_gate^T) * (x @ w_up^T): the FFN's gate,
     * up and SwiGLU in one op (w_gate and w_up of one shape and dtype). Same
     * results as matmul, matmul, swiglu. out must not overlap x. work: NULL,
     * or [n, w_up.rows] floats the op may write where it does not fuse the
     * two products (then x @ w_up^T goes there rather than to a buffer of the
     * backend's own); must not overlap x or out. */
    strata_status (*matmul_swiglu)(st_backend *be, st_stream *s, const float *x,
                                   const st_weight *w_gate, const st_weight *w_up, int64_t n,
                                   float *out, float *work);
    /* rmsnorm and the matmuls that read its output, as one op: out as
     * rmsnorm(x, residual, w_norm, eps, n, d) writes it; then with up NULL
     * y[i] = out @ w[i]^T for i < count (as matmul_multi), else (count 1)
     * y[0] = silu(out @ w[0]^T) * (out @ up^T) (as matmul_swiglu); w's cols
     * = d. The same results as those ops in turn, which is what runs where a
     * device's entry is NULL (CPU); CUDA, in fast mode for one token,
     * quantizes out for its int8 GEMV in the norm's kernel instead of in a
     * launch of its own. */
    strata_status (*rmsnorm_matmul)(st_backend *be, st_stream *s, float *x, const float *residual,
                                    const st_weight *w_norm, float eps, int64_t n, int64_t d, float *out,
                                    const st_weight *w, int count, const st_weight *up, float *const *y);
    /* Graphs: ops enqueued on stream s (a created stream, not NULL) between
     * graph_begin and graph_end are recorded instead of run (CUDA: stream
     * capture), and graph_end returns them as *out, to be run any number of
     * times with graph_launch (each run reads the device and pinned host
     * buffers the ops were given, with the values they hold then). A backend
     * without graphs (CPU) returns STRATA_ERR_UNSUPPORTED from graph_begin:
     * run the ops directly. graph_end with out == NULL ends the recording and
     * drops it (after an error). Ops that cannot be recorded (a host sync,
     * scratch growth) fail while recording; the caller then drops the
     * recording and runs the ops without a graph. */
    strata_status (*graph_begin)(st_backend *be, st_stream *s);
    strata_status (*graph_end)(st_backend *be, st_stream *s, st_graph **out);
    strata_status (*graph_launch)(st_backend *be, st_stream *s, st_graph *g);
    void (*graph_destroy)(st_backend *be, st_graph *g); /* NULL is a no-op */
    /* Precision of the tensor-core paths that prefill-sized work takes
     * (matmul with n >= 4 tokens (12 for quantized weights), attention with more than 16 query rows per
     * KV head). false (the backend's initial state): each bf16 operand is
     * split into two bf16 parts (hi + lo), so results are within ~1e-5 of
     * fp32 math, at 2 to 3 times the tensor-core work. true: operands rounded
     * to bf16 once, fp32 accumulation, as serving engines compute (~1e-2
     * relative error on logits, enough to flip close argmaxes), about twice
     * as fast. The tools turn it on for models stored in bf16, f16 or a
     * quantized type and leave it off for f32 models (tool_fast_prefill in
     * tools/common.c; --precise / --fast-prefill override). No effect on the
     * CPU backend (always fp32). */
    void (*set_fast_prefill)(st_backend *be, bool on);

    /* ---- paged KV cache (continuous batching: a batch of sequences) ---- */
    /* For i < n with slots[i] >= 0: cache row slots[i] of K gets k[i, :] and
     * that of V gets v[i, :], converted to cache->dtype (st_kv_layer: bf16
     * rounded to nearest even, fp8 with the scale of each (slot, kv head) row,
     * written to k_scale / v_scale). k, v: [n, n_kv_heads * head_dim] fp32 rows
     * (the cache's shape). slots: [n] int64 on the device; -1 skips the token.
     * Other out-of-range slots (outside [0, cache->n_slots)): the CPU backend
     * returns STRATA_ERR_INVALID_ARG before writing anything; CUDA (whose slots
     * live on the device) skips them. Slots of one call must be distinct. The
     * stored bytes are the same on every backend. */
    strata_status (*kv_store_paged)(st_backend *be, st_stream *s, const st_kv_layer *cache,
                                    const float *k, const float *v, const int64_t *slots, int64_t n);
    /* A layer's new K/V in one op: rope of q [n, n_heads, head_dim] and of k
     * [n, cache.n_kv_heads, head_dim] in place (as rope), then
     * kv_store_paged(cache, k, v, slots, n); head_dim = cache.head_dim. The
     * same results as those three ops in turn, which is what runs where a
     * device's entry is NULL (CPU); CUDA runs them as one launch for f32 and
     * bf16 caches. */
    strata_status (*rope_kv_store)(st_backend *be, st_stream *s, float *q, float *k, const float *v,
                                   const int32_t *pos, int64_t n, int64_t n_heads, int64_t head_dim,
                                   const float *inv_freq, bool interleaved, const st_kv_layer *cache,
                                   const int64_t *slots);
    /* k[i, :] and v[i, :] = the K and V rows of slot ids[i] of `cache`,
     * dequantized to fp32 exactly (st_kv_layer's rules: the values
     * attention_paged reads), for i < n; rows of n_kv_heads x head_dim
     * floats. ids: [n] int32 on the device. An id outside [0, n_slots): the
     * CPU backend returns STRATA_ERR_INVALID_ARG before writing anything;
     * CUDA writes a row of NaN. (How one sequence's keys are gathered into
     * contiguous pieces for attention_part, model/llama.c.) */
    strata_status (*kv_gather)(st_backend *be, st_stream *s, const st_kv_layer *cache, const int32_t *ids,
                               int64_t n, float *k, float *v);
    /* Causal grouped-query attention of a batch of sequences over a paged KV
     * cache (st_paged_kv above). q: [n, n_heads, hd]; token i belongs to
     * sequence seq[i] (< kv->n_seqs), sits at position pos[i]
     * (< ctx_lens[seq[i]]) and sees that sequence's keys 0..pos[i]; head h
     * reads kv head h / (n_heads / n_kv_heads). out: [n, n_heads, hd] =
     * softmax(q k^T * scale) v. seq, pos: [n] int32 on the device.
     * n_kv_heads and head_dim must equal kv->cache's. The keys and values are
     * read in kv->cache.dtype and dequantized to fp32 (exactly: st_kv_layer),
     * then everything runs in fp32 as for an f32 cache holding those values
     * (on the CPU, the same bits as an f32 cache of the dequantized values).
     * Batch invariance: the result for a token depends only on its own q, its
     * position and its sequence's keys, never on the other tokens of the
     * batch, their number or the thread count:
     *   CPU: one work item per (token, head) in the order of `attention`
     *     (ranges of ST_ATTN_RANGE keys, each: scores by key, max, exp, sum in
     *     lanes, weighted sum by key; merged in order: attention_part), so the
     *     bits also equal `attention` over the same keys laid out contiguously;
     *   CUDA: one kernel for every token (decode or prefill alike); each
     *     (token, kv head) splits its keys into fixed 64-key ranges and merges
     *     them in order, so the reduction order depends only on its position.
     * The CPU backend checks every index (seq, pos, ctx_lens, the block ids
     * reached) and returns STRATA_ERR_INVALID_ARG; CUDA clamps them instead. */
    strata_status (*attention_paged)(st_backend *be, st_stream *s, const float *q, const st_paged_kv *kv,
                                     const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                     int64_t n_kv_heads, int64_t head_dim, float scale, float *out);

    /* ---- sampling ---- */
    /* out[i] = a token drawn from row i of logits [n, vocab] with args[i], for
     * i < n (logits fp32, args [n] and out [n] int32, all on the device).
     * Steps (engine/sampler.h's 2-6): temperature 0 -> the argmax (lowest id
     * on a tie); else the candidates are the tokens whose logit is >= the
     * top_k-th largest (ties kept) and not -inf; p_i = exp((x_i - max) / T);
     * top-p keeps the smallest prefix of the candidates in decreasing
     * probability (ties in increasing id) whose mass reaches top_p x their
     * total; min-p drops p_i < min_p. The draw walks the kept tokens in
     * increasing id and takes the first whose cumulative mass exceeds
     * u x the kept total. A row with a NaN, with every logit -inf, or (when
     * not greedy) with a +inf gets -1.
     * CPU: double precision, the same arithmetic as st_sampler_sample (the
     * same token for the same u); bad args give STRATA_ERR_INVALID_ARG before
     * anything is written. CUDA: one block per row, no sort (radix selects on
     * the logits' bits), fp32 probabilities summed in fixed point (the result
     * does not depend on the launch shape); args outside their ranges are
     * clamped. The two agree except where u x total lies within ~1e-6
     * (relative) of a cumulative boundary, or where a top-p / min-p decision
     * is that close. */
    strata_status (*sample)(st_backend *be, st_stream *s, const float *logits, int64_t n, int64_t vocab,
                            const st_sample_args *args, int32_t *out);
} st_backend_ops;

/* Argument checks: one validating layer for every backend.
 * st_backend_init wraps the device's table: be->ops points at be->checked, a
 * copy of the device's table whose entries below are replaced by validating
 * functions (backend.c) that check the arguments, then call be->dev_ops. The
 * other entries (name, destroy, dealloc, host_dealloc, stream_destroy,
 * stream_sync, event_destroy, graph_*, set_fast_prefill) are the device's own.
 * Messages name the backend and op ("cpu matmul: ...", "cuda matmul: ...")
 * and the bad parameter. Every backend gets from the wrapper:
 *   memory: NULL out parameters (alloc, host_alloc, upload, stream_create,
 *     event_create), NULL host with n > 0 (upload), NULL dst/src of copies
 *     (n = 0 returns STRATA_OK without calling the device; copy_2d: pitches
 *     >= width, width or height 0 is a no-op), NULL events (event_query: and done);
 *   ops: counts and shapes (n >= 0, d/cols/vocab > 0, cols and vocab <=
 *     INT32_MAX for argmax/sample, rope's even head_dim, matmul_multi's count
 *     in 1..4 and equal cols, matmul_swiglu's equal shapes and dtypes),
 *     st_backend_check_weight on every weight, rmsnorm's [1, d] weight,
 *     st_backend_check_heads, n_kv >= 1 for attention, st_kv_layer_check
 *     (kv_store_paged's cache; attention_paged's against its n_kv_heads /
 *     head_dim), st_paged_kv_check,
 *     NULL pointers, and y/out overlapping x (matmul, matmul_multi,
 *     matmul_swiglu). An op with n = 0 (after the shape checks) returns
 *     STRATA_OK without calling the device.
 * Left to each backend (the checks that depend on where data lives or on the
 * device's limits):
 *   CPU: the values of host-side indices it promises to check (get_rows ids,
 *     kv_store_paged slots, attention pos, attention_paged's
 *     ctx_lens / block ids / seq / pos, sample args);
 *   CUDA: alignment (weight data 16 bytes, float pointers 4, sample args and
 *     slots 8, KV caches their element's size, fp8 scales 4), sizes that overflow its int32 / 65535 launch grids, shared
 *     memory limits and unsupported dtypes (in the op's .cu file).
 * The device's functions may therefore assume the wrapper's checks passed
 * (st_backend_cpu_init / st_backend_cuda_init alone return an unwrapped
 * backend: create backends with st_backend_init). */
struct st_backend {
    const st_backend_ops *ops;     /* &checked once st_backend_init returns */
    const st_backend_ops *dev_ops; /* the device's own table (what `checked` calls) */
    st_backend_kind kind;
    st_budget device_budget; /* device allocations counted against device_mem */
    void *impl;
    st_backend_ops checked;  /* the validating table (backend.c) */
};

/* Checks the host-side fields of one layer's KV storage for `op` (names it and
 * the field in the message): a known dtype, non-NULL k / v, k_scale / v_scale
 * non-NULL for ST_KV_FP8 (ignored otherwise), n_slots >= 1, n_kv_heads and
 * head_dim >= 1, and when n_kv_heads / head_dim > 0 are given, equal to the
 * layer's. STRATA_ERR_INVALID_ARG otherwise. Reads no device memory. */
strata_status st_kv_layer_check(const st_kv_layer *c, int64_t n_kv_heads, int64_t head_dim, const char *op);

/* Checks the host-side fields of a paged KV description for `op` (names it in
 * the message): st_kv_layer_check on cache (any shape: attention_paged's
 * wrapper compares it with the op's n_kv_heads / head_dim), non-NULL block tables and ctx_lens, block_size >= 1, cache.n_slots a
 * positive multiple of block_size, n_seqs >= 1, max_blocks >= 1, 0 <= max_ctx
 * <= max_blocks * block_size. STRATA_ERR_INVALID_ARG otherwise. Reads no
 * device memory. */
strata_status st_paged_kv_check(const st_paged_kv *kv, const char *op);

/* Creates the backend named in params, its ops wrapped by the validating
 * layer (above). The caller owns *out (st_backend_free). */
strata_status st_backend_init(const st_backend_params *params, st_backend **out);
void st_backend_free(st_backend *be); /* NULL is a no-op */
bool st_backend_available(st_backend_kind kind);
/* Argument checks every backend makes on a weight before an op (NULL, dtype,
 * empty shape, cols not a multiple of the block, NULL data): STRATA_ERR_INVALID_ARG
 * with a message naming `op`. */
strata_status st_backend_check_weight(const st_weight *w, const char *op);
/* Attention shape checks every backend makes: n, n_kv >= 0 (pass 0 for n_kv when
 * the op has none), positive heads and head_dim, n_heads a multiple of n_kv_heads. */
strata_status st_backend_check_heads(const char *op, int64_t n, int64_t n_kv, int64_t n_heads,
                                     int64_t n_kv_heads, int64_t head_dim);

/* Implementations (each in its own directory): the device's raw table, no
 * wrapper (st_backend_init adds it). */
strata_status st_backend_cpu_init(const st_backend_params *params, st_backend **out);
strata_status st_backend_cuda_init(const st_backend_params *params, st_backend **out);
/* True when the CUDA runtime sees at least one device (no abort without a driver). */
bool st_backend_cuda_present(void);

#ifdef __cplusplus
}
#endif

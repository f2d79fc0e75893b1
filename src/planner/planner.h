/* planner: one memory plan from explicit budgets.
 *
 * Given the model files, the backend, the device budget (an explicit
 * parameter: 0 = unlimited), the host budget, the tokens of one forward pass,
 * the positions of one sequence and the device bytes of the KV pool, the
 * planner sizes what the device holds:
 *   device = KV pool + activations (st_plan_act_bytes) + backend scratch
 *            (measured: st_plan_scratch) + weights (resident groups and the
 *            ring streamed groups pass through: weights/plan.h);
 *   host   = pinned staging + host-tier weight groups.
 * The bandwidths the placement needs (PCIe, SSD, device reads, GEMM) and the
 * scratch reserve are measured by st_plan_measure, which startup code calls
 * (the engine's init, the tools, `strata plan`); the model's init only plans
 * with them.
 * Who may include it: the model and everything above (it includes core,
 * loader, backend.h, weights and kv). */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#include "loader/loader.h"
#include "weights/manager.h"
#include "weights/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Weight placement and streaming. Zero everywhere: the defaults below. */
typedef struct {
    size_t host_mem;          /* pinned host memory for the weights (host tier + staging);
                                 0: 80% of MemAvailable */
    size_t device_reserve;    /* device bytes kept for backend scratch (0: none; st_plan_measure fills it
                                 in under a budget) */
    int ring_slots;           /* device slots streamed groups pass through (0: 2) */
    size_t staging_chunk;     /* pinned staging buffer bytes (0: 8 MiB) */
    int staging_chunks;       /* staging buffers = reads in flight at most (0: 16) */
    int64_t prefill_tokens;   /* prompt length of the plan's prefill prediction (0: 2048) */
    st_wbw bw;                /* bandwidths (0: unknown; st_plan_measure fills them in) */
    const st_tier *placement; /* fixed placement, [2 * n_layers + 2] in group order (tests); NULL: planned */
    st_wm_params stream;      /* reader options and test hooks (its host_mem is set from host_mem) */
    bool probe_scratch;       /* measure the backend's scratch on the CPU too (tests: the CPU's is 0) */
    /* the CPU tier (weights/plan.h ST_TIER_CPU: FFN groups computed on the CPU from host memory in decode) */
    int cpu_ffn;              /* 0: auto (the least predicted decode step; never on the CPU backend, where
                                 everything runs on the CPU already), -1: off, N > 0: N FFN groups (of those
                                 the device does not hold; on the CPU backend too: tests) */
    double cpu_split;         /* of each CPU-tier group, the device's share in decode (weights/plan.h
                                 cpu_split: 0 auto, < 0 none, (0, 1) that share) */
    int cpu_threads;          /* the model's CPU backend threads (0: all cores); also those of the bw.cpu probe */
    st_cpu_act cpu_act;       /* the CPU tier's quantized matmuls' activations (the probe's too): int8 in
                                 fast mode on CUDA (its decode GEMV is int8 there too) or with
                                 --cpu-act int8; else precise */
    int64_t cpu_max_tokens;   /* passes of at most this many tokens compute CPU-tier groups on the CPU; larger
                                 ones (prefill) stream them to the device (0: ST_PLAN_CPU_MAX_TOKENS) */
    int64_t cpu_pass_tokens;  /* the decode pass the plan balances (0: 1 token, a decode step): the CPU's rate
                                 is probed at this many tokens, so that speculative decoding's verification
                                 passes of k drafts (k + 1 tokens: the CPU's integer kernels read fewer bytes
                                 per second than at one) get a split that gives the device more rows; at most
                                 cpu_max_tokens */
} st_weight_opts;
#define ST_PLAN_CPU_MAX_TOKENS 8

typedef struct {
    size_t device_mem;        /* the device budget (0: unlimited: every weight resident) */
    int64_t max_tokens;       /* tokens of one forward pass (>= 1) */
    int64_t max_seq_len;      /* positions of one sequence (>= 1) */
    int64_t attn_piece;       /* keys per attention piece (st_plan_attn_piece; 0: the default) */
    size_t kv_bytes;          /* device bytes of the KV pool (kv/kv_pool.h st_kv_pool_device_bytes) */
    bool measure_bw;          /* st_plan_measure measures the missing bandwidths even without a budget
                                 (`strata plan`: its predictions) */
    st_weight_opts weights;
} st_plan_params;

/* Keys per piece of a single sequence's attention (model/forward.c): its
 * keys are gathered from the paged pool, or streamed from host memory
 * (kv/kv_stream.h), into two fp32 buffers of bounded size, piece by piece,
 * and attended by the backend's attention_part (CUDA: its tensor-core
 * kernels; on the CPU each key dequantized once per layer instead of once
 * per query and head, the same bits). want: 0 for the default
 * (ST_PLAN_ATTN_PIECE), else rounded up to a multiple of ST_ATTN_RANGE and
 * then to a divisor of ST_KV_STREAM_SEG (a power of two). */
#define ST_PLAN_ATTN_PIECE 16384
int64_t st_plan_attn_piece(int64_t want);
/* Tokens of a pass whose FFN intermediate (gate, up: rows x intermediate
 * size fp32, 2 x 470 MB at 4096 rows for Llama-3-8B) is computed at once: a
 * larger pass runs its FFN in sub-chunks of this many rows (model/llama.c),
 * so the activations do not grow with the chunk past it. */
#define ST_PLAN_FFN_ROWS 4096
int64_t st_plan_ffn_rows(int64_t max_tokens);

/* The share of a streamed sequence's earlier keys its decode attends on the
 * CPU from host memory (model/llama.h cpu_attn) so that the CPU, reading
 * them at cpu_bw, and the copies up of the rest, at h2d_bw (both KV bytes
 * per second), take the same time: cpu_bw / (cpu_bw + h2d_bw); 0 when either
 * is unknown (0). The rest of a step (weights, the merge, the wait for q)
 * is not in it. */
double st_plan_cpu_attn_share(double cpu_bw, double h2d_bw);
/* Rows of those buffers: a piece, or the keys of a streamed pass's last
 * range and its tokens (ST_ATTN_RANGE + max_tokens) when larger, never more
 * than max_seq_len. */
int64_t st_plan_gather_rows(int64_t max_tokens, int64_t max_seq_len, int64_t piece);
/* Their device bytes: 2 x rows x kv_dim x 4, each rounded to 256. */
size_t st_plan_gather_bytes(const st_config *c, int64_t max_tokens, int64_t max_seq_len, int64_t piece);

/* Device bytes of the activations a model with these shapes allocates for
 * forward passes of max_tokens tokens on `be` (model/llama.c allocates exactly
 * these buffers, st_plan_gather_bytes included), each rounded to 256 bytes. */
size_t st_plan_act_bytes(const st_backend *be, const st_config *c, int64_t max_tokens, int64_t max_seq_len,
                         int64_t piece);

/* The device bytes the backend takes for its own scratch while the model's
 * ops run, measured by running every op shape of a forward pass once over
 * zeroed buffers (ops of max_tokens tokens and of one token, paged attention
 * over max_seq_len keys) on a probe stream, times 3 (a growing scratch
 * buffer leaves holes), plus 4 MiB. 0 on the CPU (its scratch is host
 * memory outside the arena) unless `force`. */
size_t st_plan_scratch(st_backend *be, const st_config *c, const st_wgroups *g, int64_t max_tokens,
                       int64_t max_seq_len, bool force);

/* Runs the same probe on `stream` and keeps what it grew: the backend's
 * scratch buffers of that stream are then as large as any pass of at most
 * max_tokens tokens over max_seq_len keys needs, so passes recorded as
 * graphs on it are not invalidated by a later, larger shape growing them.
 * The probe's own buffers are freed. */
strata_status st_plan_presize(st_backend *be, st_stream *stream, const st_config *c, const st_wgroups *g,
                              int64_t max_tokens, int64_t max_seq_len);

/* Measures what a plan with these params needs and is not given, in place:
 * the bandwidths (p->weights.bw entries <= 0: PCIe, SSD, device reads, GEMM;
 * weights/measure.h) when the plan places weights under a budget
 * (p->device_mem > 0), checks a forced placement, or predicts times
 * (p->measure_bw); and the backend scratch to reserve (p->weights.
 * device_reserve when 0, st_plan_scratch) under a budget. Startup code (the
 * engine's init, the tools, `strata plan`) calls it before the model is made;
 * the model's init only plans with what p holds. Takes seconds. */
strata_status st_plan_measure(const st_model_files *files, st_backend *be, st_plan_params *p);

/* Places the weight groups g of `files` on `be` within p's budgets: *plan
 * (the caller owns it: st_wplan_free; empty on error). A plan under a budget
 * or with a forced placement needs every bandwidth in p->weights.bw
 * (st_plan_measure): INVALID_ARG otherwise; the scratch reserve is
 * p->weights.device_reserve as given. NOMEM with what is needed when
 * no placement fits. */
strata_status st_plan_make(const st_model_files *files, st_backend *be, const st_wgroups *g,
                           const st_plan_params *p, st_wplan *plan);

#ifdef __cplusplus
}
#endif

/* Private to the CPU backend: its state and the ops' entry points.
 * Every op runs synchronously on the calling thread plus the worker pool;
 * ops on one backend are serialised by `op_mu` (the pool and the per-thread
 * scratch buffers are shared), so several host threads may share a backend. */
#pragma once
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>

#include "backend/backend.h"
#include "core/pool.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Instruction-set levels of the kernels, chosen at run time from the CPU's
 * features (one binary for every x86-64). Every level gives the same bits. */
typedef enum {
    ST_CPU_ISA_PORTABLE, /* plain C (GCC vector extensions at the baseline target) */
    ST_CPU_ISA_AVX2,     /* AVX2 builds of the kernels */
    ST_CPU_ISA_AVXVNNI,  /* AVX2 builds, the int8 matmul with AVX-VNNI (VEX vpdpbusd; Alder Lake and later,
                            Sapphire Rapids; not AMD Zen 4) */
    ST_CPU_ISA_AVX512,   /* AVX2 builds, the integer matmul with AVX-512 VNNI (vpdpwssd, vpdpbusd) */
} st_cpu_isa;

/* The int8 matmul's multi-token kernel on Intel AMX tiles (AMX-INT8: Sapphire
 * Rapids and later), beside the ISA level: OFF (the level's own kernel), ON
 * (tdpbusd; only where the CPU has AMX-INT8 and Linux grants the tile data),
 * EMULATED (the same kernel with the tile instructions done in plain C: a
 * test hook, so that the AMX path's data layout is checked on any CPU). Every
 * mode gives the same bits. */
typedef enum { ST_CPU_AMX_OFF, ST_CPU_AMX_ON, ST_CPU_AMX_EMULATED } st_cpu_amx;

/* Op times (st_backend_cpu_prof: `strata bench --op-times`): per op and shape, the
 * calls and the seconds spent in them, the lock and the pool included. */
#define ST_CPU_PROF_MAX 64
typedef struct {
    const char *op;
    int64_t rows, cols; /* matmuls: the weight's (summed over a multi's weights); else 0 */
    int64_t n;          /* tokens (rows of x) */
    double bytes;       /* weight bytes read per call (matmuls) */
    int64_t calls;
    double s;
} st_cpu_prof_entry;

typedef struct {
    bool on;
    int count;
    int64_t dropped; /* calls whose key found no free entry */
    st_cpu_prof_entry e[ST_CPU_PROF_MAX];
} st_cpu_prof;

typedef struct {
    st_pool *pool;
    int n_threads;
    pthread_mutex_t op_mu;   /* held for the whole of an op */
    pthread_mutex_t mem_mu;  /* guards st_backend.device_budget */
    float **scratch;         /* [n_threads] buffers of scratch_floats each, 64-B aligned */
    size_t scratch_floats;
    st_cpu_isa isa;          /* level of the kernels run (same results at every level) */
    bool simd;               /* isa >= ST_CPU_ISA_AVX2: the float kernels' AVX2 builds */
    bool act8;               /* the quantized matmuls' activations in int8 (st_backend_params.cpu_act) */
    st_cpu_amx amx;          /* int8 multi-token matmuls on AMX tiles (ON by default where usable) */
    int w16_min;             /* int8 on AVX-512: passes of w16_min..8 tokens on the 16-row kernel (0: never) */
    void *qact;              /* the integer matmul's quantized activations, 64-B aligned */
    size_t qact_bytes;
    float *attn_part;        /* attention split over the keys: each range's result (cpu_attention.c) */
    size_t attn_part_floats;
    st_cpu_prof prof;        /* op times, while prof.on */
} st_cpu;

static inline st_cpu *st_cpu_of(st_backend *be) { return (st_cpu *)be->impl; }

/* Makes every thread's scratch hold at least `floats` floats. Call with op_mu
 * held, before the parallel loop. STRATA_ERR_NOMEM on failure. */
strata_status st_cpu_scratch_reserve(st_cpu *c, size_t floats);

/* Makes c->qact hold at least `bytes` bytes (op_mu held). */
strata_status st_cpu_qact_reserve(st_cpu *c, size_t bytes);

/* The best level this CPU runs; whether it runs a given level (AVX-VNNI is
 * not implied by AVX-512 VNNI: AMD Zen 4 has the latter only). */
st_cpu_isa st_cpu_isa_supported(void);
bool st_cpu_isa_has(st_cpu_isa isa);
/* Whether AMX-INT8 is usable: the CPU has it (CPUID 7.0 EDX bits 24, 25),
 * the OS enables the tile state (XCR0 bits 17, 18) and, on Linux, grants
 * this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once;
 * a refusal leaves AMX off). */
bool st_cpu_amx_usable(void);
/* Test hook: sets the AMX mode of later ops on `be` (ON falls back to OFF
 * where AMX is not usable) and returns the mode in effect. */
st_cpu_amx st_backend_cpu_set_amx(st_backend *be, st_cpu_amx mode);
/* Test hook: int8 passes of min_n..8 tokens on the AVX-512 level take the 16-row
 * few-token kernel (cpu_qi.h, W16; 0: never, default ST_CPU_W16_MIN); returns
 * the previous setting. Same bits either way. */
#define ST_CPU_W16_MIN 2
int st_backend_cpu_set_w16(st_backend *be, int min_n);
/* True when this CPU can run the AVX2 builds of the kernels. */
bool st_cpu_simd_supported(void);
/* Test hooks, for later ops on `be` (a CPU backend): set_isa selects a level
 * (capped at what the CPU supports) and returns the level in effect;
 * set_simd(on) selects the best level or the portable one and returns whether
 * a SIMD level is in effect. Every level gives bit-identical results. */
st_cpu_isa st_backend_cpu_set_isa(st_backend *be, st_cpu_isa isa);
bool st_backend_cpu_set_simd(st_backend *be, bool on);
/* Selects int8 (on) or 22-bit activations for the quantized matmuls (as
 * st_backend_params.cpu_act); returns the previous setting. */
bool st_backend_cpu_set_act8(st_backend *be, bool on);

/* Op times: on clears the table and starts counting every op on `be` (its
 * calls and seconds, per op name and shape); off stops. prof_print writes the
 * table (ms per step over `steps` steps, share of `step_s`, matmuls' GB/s of
 * weights) and the time outside the ops. */
void st_backend_cpu_prof(st_backend *be, bool on);
void st_backend_cpu_prof_print(st_backend *be, FILE *f, int64_t steps, double step_s);

/* Dequantizes one row of `cols` elements into out: the backend's own fast
 * routine, bit-identical to st_dequantize_row. */
void st_cpu_dequant_row(st_dtype t, const void *row, float *out, int64_t cols, bool simd);

/* Op implementations (argument checks done by backend.c and cpu_backend.c,
 * op_mu held). */
strata_status st_cpu_matmul(st_cpu *c, const float *x, const st_weight *w, int64_t n, float *y);
/* The quantized dtypes' integer path (cpu_matmul_int.c): y[i] = x @ w[i]^T
 * for count (1..4) weights of one quantized dtype and equal cols, in one
 * parallel loop over their row blocks (x quantized once). */
strata_status st_cpu_matmul_int(st_cpu *c, const float *x, const st_weight *w, int count, int64_t n,
                                float *const *y);
strata_status st_cpu_attention(st_cpu *c, const float *q, const float *k, const float *v,
                               const int32_t *pos, int64_t n, int64_t n_kv, int64_t n_heads,
                               int64_t n_kv_heads, int64_t head_dim, float scale, float *out);
strata_status st_cpu_attention_rows(st_cpu *c, const float *q, const st_kv_layer *rows, const int32_t *pos,
                                    int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                    int64_t head_dim, float scale, bool merge, float *out, float *lse);
void st_cpu_attn_merge(float *out, float *lse, const float *out2, const float *lse2, int64_t rows, int64_t hd);
strata_status st_cpu_attention_part(st_cpu *c, const float *q, const float *k, const float *v, const int32_t *pos,
                                    int64_t n, int64_t key0, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                    int64_t head_dim, float scale, bool merge, float *out, float *lse);
strata_status st_cpu_attention_paged(st_cpu *c, const float *q, const st_paged_kv *kv, const int32_t *seq,
                                     const int32_t *pos, int64_t n, int64_t n_heads, int64_t n_kv_heads,
                                     int64_t head_dim, float scale, float *out);
strata_status st_cpu_get_rows(st_cpu *c, const st_weight *w, const int32_t *ids, int64_t n,
                              float *out);
strata_status st_cpu_rmsnorm(st_cpu *c, float *x, const float *residual, const st_weight *w,
                             float eps, int64_t n, int64_t d, float *out);
strata_status st_cpu_rope(st_cpu *c, float *x, const int32_t *pos, int64_t n, int64_t n_heads,
                          int64_t head_dim, const float *inv_freq, bool interleaved);
strata_status st_cpu_swiglu(st_cpu *c, const float *gate, const float *up, int64_t n, float *out);
strata_status st_cpu_add(st_cpu *c, float *x, const float *y, int64_t n);
/* backend.h's sample (cpu_sample.c); checks every row's args first. */
strata_status st_cpu_sample(st_cpu *c, const float *logits, int64_t n, int64_t vocab, const st_sample_args *args,
                            int32_t *out);

#ifdef __cplusplus
}
#endif

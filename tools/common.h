/* Shared pieces of the `strata` subcommands: option parsing helpers and the
 * "open a model on a backend" sequence every model-loading command uses. */
#pragma once
#include <stdbool.h>
#include <stdio.h>
#include <stdint.h>
#include "strata.h"
#include "backend/backend.h"
#include "loader/loader.h"
#include "model/llama.h"

/* Options every command that loads a model accepts; start from TOOL_MODEL_OPTS_INIT. */
typedef struct {
    const char *device;  /* "cpu" | "cuda" | "auto" */
    int threads;         /* 0: all cores */
    bool cpu_act8;       /* --cpu-act int8 (default precise) */
    int64_t ctx;         /* 0: model default */
    int64_t batch;       /* tokens per forward chunk, 0: default */
    size_t device_mem;   /* --device-mem / --gpu-mem: device budget in bytes (0: unlimited) */
    size_t host_mem;     /* --host-mem: pinned host budget for weights (0: 80% of available) */
    double h2d_bw;       /* --h2d-bw GB/s: given instead of measured (0: measure) */
    double ssd_bw;       /* --ssd-bw GB/s */
    int ring_slots;      /* --ring-slots N (0: 2) */
    int cpu_layers;      /* --cpu-layers auto|N: 0 auto, -1 (--cpu-layers 0) none, N */
    double cpu_split;    /* --cpu-split auto|F: 0 auto, -1 (--cpu-split 0) none, F in (0, 1) */
    int64_t cpu_max_tokens; /* --cpu-max-tokens N (0: 8) */
    int64_t cpu_pass_tokens; /* --cpu-pass-tokens N (0: 1) */
    st_kv_dtype kv_dtype;  /* --kv-dtype bf16|fp8|f32 (default bf16) */
    int64_t kv_seqs;       /* not an option: sequences of --ctx tokens the KV pool holds (0: 1; bench --seqs) */
    bool kv_stream;        /* --kv-stream: a sequence too long for the device pool keeps its KV in host
                              memory, streamed through the device (run, serve; bench and plan:
                              tool_kv_streamed) */
    int prefill;         /* --precise: -1, --fast-prefill: 1, 0: chosen by the weights' dtype (tool_fast_prefill) */
    const char *test_fault; /* --test-fault KIND:N, a hidden option of test builds (-DSTRATA_TESTING=ON):
                               read-error:N | short-read:N: the Nth weight read fails or comes back
                               short; slow-read:MS: every weight read lands MS ms late; device-alloc:N
                               | host-alloc:N: the Nth device / pinned host allocation fails;
                               kv-ssd-write:N: the Nth KV SSD-tier write fails as on a full disk */
    /* KV tiers: options of the commands that build an engine (run, serve, bench-kv) or plan one
     * (plan); they set kv_tier_opts before parsing, the others refuse these options */
    bool kv_tier_opts;
    int64_t kv_host_mem;   /* --kv-host-mem SIZE: 0 (unset): default share; -1 (--kv-host-mem 0): off */
    bool kv_offload_lazy;  /* --kv-offload lazy */
    const char *kv_ssd_dir; /* --kv-ssd-dir DIR */
    size_t kv_ssd_size;    /* --kv-ssd-size SIZE (0: 64 GiB) */
    int64_t kv_segment;    /* --kv-segment N: tokens per host / SSD segment of a streamed sequence (0: 65536) */
    size_t kv_stream_mem;  /* --kv-stream-mem SIZE: host bytes of a streamed sequence's KV at most (0:
                              st_kv_stream_default_host_mem, 3/4 of the memory available) */
    double kv_cpu_attn;    /* --kv-cpu-attn auto|F: a streamed decode's share of keys attended on the CPU
                              (0: none, -1: auto) */
    /* speculative decoding: options of run and serve (they set spec_opts before parsing) */
    bool spec_opts;
    strata_spec spec;      /* --spec off|lookup|draft (--draft MODEL implies draft) */
    int spec_k;            /* --spec-k N (0: 8) */
    double spec_cost;      /* --spec-cost C (0: measured) */
    const char *draft;     /* --draft MODEL */
} tool_model_opts;

/* The speculative decoding options (run, serve). */
#define TOOL_SPEC_OPTS_HELP \
    "  --spec lookup|draft|off  speculative decoding: each decode step also verifies drafts, in the\n" \
    "                           same pass; greedy output is unchanged token for token (on CUDA but\n" \
    "                           for near-ties), sampling keeps its distribution (rejection rule).\n" \
    "                           lookup: what followed the last n-gram's latest earlier occurrence in\n" \
    "                           the prompt or output (no second model); draft: a smaller model's\n" \
    "                           greedy tokens (--draft). Default off\n" \
    "  --draft MODEL            the draft model (same vocabulary; on the same device), implies\n" \
    "                           --spec draft\n" \
    "  --spec-k N               most drafts per step (default 7, 1 to 32); fewer while few are\n" \
    "                           accepted, none while a draft costs more than it brings\n" \
    "  --spec-cost C            one draft's cost in one-token steps, fixed (default: measured as\n" \
    "                           it runs, from steps with and without drafts)\n"

/* After parsing: --draft implies --spec draft; --spec draft needs --draft; --spec-k needs --spec.
 * False (message printed) on a contradiction. */
bool tool_spec_settle(tool_model_opts *o);

/* Sets the test fields of *mp that --test-fault asks for (none without it). */
void tool_test_faults(const tool_model_opts *o, strata_model_params *mp);
/* Whether --test-fault names this kind ("read-error", "kv-ssd-write", ...). */
bool tool_test_fault_is(const tool_model_opts *o, const char *kind);

#define TOOL_MODEL_OPTS_INIT {.kv_dtype = ST_KV_BF16}
/* TOOL_MODEL_OPTS_INIT for the commands that take the KV tier options */
#define TOOL_ENGINE_OPTS_INIT {.kv_dtype = ST_KV_BF16, .kv_tier_opts = true}

#define TOOL_MODEL_OPTS_HELP \
    "  --device cpu|cuda|auto   backend (default auto: CUDA when built and a GPU is present)\n" \
    "  --threads N              CPU worker threads (default: all cores); on CUDA, those of the\n"   \
    "                           CPU part of hybrid execution (--cpu-layers)\n"                      \
    "  --cpu-act precise|int8   CPU: activations of the matmuls over quantized weights as 22-bit\n" \
    "                           integers per 32-block (precise, default: ~1e-6 of the f32 product)\n" \
    "                           or int8 as llama.cpp (~1.5e-2 per matmul, ~5e-2 on logits;\n" \
    "                           prefill ~2x, decode ~1.3x faster on a 2-core AVX-512 machine)\n" \
    "  --ctx N                  context length to reserve KV for (default: model's, at most 4096)\n" \
    "  --batch N                tokens per forward chunk (default 512)\n"                      \
    "  --device-mem SIZE        device memory budget: weights, KV cache, activations, scratch\n" \
    "                           (alias --gpu-mem; K/M/G/T suffixes, powers of 1024; default: no\n" \
    "                           cap, every weight resident); weights that do not fit are streamed\n" \
    "  --host-mem SIZE          pinned host memory for streamed weights (host tier + staging;\n"   \
    "                           default 80%% of available memory); the rest is read from the file\n" \
    "  --h2d-bw GB/s, --ssd-bw GB/s   bandwidths for the plan instead of measuring them\n"        \
    "  --ring-slots N           device slots streamed weight groups pass through (default 2)\n"   \
    "  --cpu-layers auto|N      hybrid execution (CUDA, with weights streamed): the FFN groups of N\n" \
    "                           layers the device does not hold stay in host memory and are\n"     \
    "                           computed by the CPU in decode steps while PCIe streams the others\n" \
    "                           (default auto: the split with the least predicted step, from the\n" \
    "                           CPU's matmul rate measured at load; 0: off)\n"                      \
    "  --cpu-split auto|F       of each of those groups, the share F of its rows the GPU computes from\n" \
    "                           a streamed copy while the CPU computes the rest, both at once\n"    \
    "                           (default auto: the share with the least predicted step; 0: none,\n" \
    "                           the CPU computes whole groups)\n"                                   \
    "  --cpu-max-tokens N       passes of at most N tokens compute those groups on the CPU; larger\n" \
    "                           ones (prefill) stream them to the device (default 8)\n"          \
    "  --cpu-pass-tokens N      the decode pass the split balances: the CPU's rate is measured at N\n" \
    "                           tokens (default 1, a decode step; with speculative decoding of k\n" \
    "                           drafts, k + 1 balances its verification passes; at most\n"        \
    "                           --cpu-max-tokens)\n"                                              \
    "  --kv-dtype bf16|fp8|f32  KV cache element type (default bf16; fp8: e4m3 with a scale per\n" \
    "                           token and kv head; f32 for reference checks)\n"                \
    "  --precise                prefill matmuls and attention on the GPU with hi+lo split bf16\n"  \
    "                           operands (~1e-5 of fp32 math; for reference checks); default for\n" \
    "                           models stored in f32\n"                                           \
    "  --fast-prefill           bf16 operands, fp32 accumulation (~1e-2 relative error on logits,\n" \
    "                           about twice as fast); default for bf16, f16 and quantized models\n"

/* The KV tier options (run, serve, plan, bench-kv). */
#define TOOL_KV_TIER_OPTS_HELP \
    "  --kv-host-mem SIZE       host tier of the KV cache: full blocks are kept in (pinned) host\n"  \
    "                           memory and prompts that share a prefix load them back instead of\n" \
    "                           recomputing (default 1/8 of the available memory, at most 32G;\n"  \
    "                           0: off); more than the machine has available is refused\n"          \
    "  --kv-offload eager|lazy  blocks go to the host tier as they fill (eager, default) or when\n"  \
    "                           the device evicts them (lazy)\n"                                      \
    "  --kv-ssd-dir DIR         SSD tier under the host tier: blocks are written to DIR and found\n" \
    "                           again after a restart of the same model (another model's files\n"  \
    "                           there are ignored); needs the host tier\n"                            \
    "  --kv-ssd-size SIZE       SSD tier size (default 64G; less when the disk has less room)\n"
/* --kv-stream (run, serve, plan; bench lists it in its own words) */
#define TOOL_KV_STREAM_OPT_HELP \
    "  --kv-stream              a sequence too long for the device KV pool keeps its KV in host\n"  \
    "                           memory, streamed through the device layer by layer (one such\n"     \
    "                           sequence at a time): a sequence may then be\n"                         \
    "                           longer than the pool instead of the pool growing to hold one\n"     \
    "                           sequence of the full context; with --kv-ssd-dir, the part past\n"  \
    "                           --kv-stream-mem goes whole segments at a time to a private\n"     \
    "                           file there (unlinked; --kv-ssd-size caps it)\n"                     \
    "  --kv-stream-mem SIZE     host memory a streamed sequence's KV takes at most, in whole\n"    \
    "                           segments (default 3/4 of the memory available; not the prefix\n"  \
    "                           cache's --kv-host-mem); past it, its segments go to the file of\n" \
    "                           --kv-ssd-dir, or without one the sequence fails; more than the\n" \
    "                           machine has available is refused\n"                              \
    "  --kv-segment N           tokens per host / SSD segment of a streamed sequence, a power of\n" \
    "                           two from 4096 (default 65536; attention pieces shrink to it)\n"     \
    "  --kv-cpu-attn auto|F     a streamed sequence's decode attends share F (0 to 1) of its\n"     \
    "                           earlier keys, the oldest, on the CPU from host memory while the\n" \
    "                           device attends the rest; auto: from the CPU's and the copies'\n"  \
    "                           rates measured at the first pass (default 0: none; on the CPU\n"  \
    "                           backend 0 and auto mean 1: the keys are read where they are)\n"

/* If argv[*i] is one of the model options, consumes it (and its value) and
 * returns 1; returns 0 when it is not; -1 (message printed) on a bad value. */
int tool_parse_model_opt(int argc, char **argv, int *i, tool_model_opts *o);

/* The argument of a command that is not one of its options: the first such
 * becomes *path (MODEL); an unknown "-option" or a second positional prints a
 * message (and for an option, the usage) and returns false (exit status 2). */
bool tool_take_positional(const char *cmd, const char *arg, const char **path, void (*usage)(FILE *));

/* Parses a whole decimal integer in [lo, hi]; false (message printed, naming
 * `what`) otherwise. */
bool tool_parse_i64(const char *s, int64_t lo, int64_t hi, const char *what, int64_t *out);

/* Parses a whole finite decimal number in [lo, hi]; false (message printed,
 * naming `what`) otherwise. */
bool tool_parse_f64(const char *s, double lo, double hi, const char *what, double *out);

/* Parses a byte size: a number with an optional K/M/G/T suffix (powers of
 * 1024; "KB", "KiB", "k" accepted alike), e.g. 16G, 1.5G, 512M, 100000.
 * false (message printed, naming `what`) otherwise. */
bool tool_parse_size(const char *s, const char *what, size_t *out);

/* The llama params these options ask for on a model of config c (budgets,
 * bandwidths, the KV pool's device bytes: kv_seqs sequences of the context,
 * and in test builds the --test-fault injection). */
/* Whether one sequence's KV goes to host memory, streamed through the device
 * (kv/kv_stream.h) instead of a device pool: bench --kv-stream, or a device
 * budget (--device-mem) of which the KV of one --ctx sequence would take more
 * than half. tool_model_open then makes no pool (tm->kv NULL); the planner
 * counts the stream's ring instead. */
bool tool_kv_streamed(const tool_model_opts *o, const st_config *c);
/* The kv_stream params of such a sequence of --ctx tokens (--batch passes,
 * --kv-dtype, --kv-stream-mem or its default as the host's cap, --kv-segment,
 * --kv-ssd-dir / --kv-ssd-size; the model's piece is the default). */
st_kv_stream_params tool_stream_params(const tool_model_opts *o, const st_config *c);
st_llama_params tool_llama_params(const tool_model_opts *o, const st_model_files *files);
/* The KV pool of those options for model m (kv_seqs sequences of its max_seq_len). */
st_kv_pool_params tool_kv_params(const tool_model_opts *o, const st_llama *m);
/* The backend these options ask for (device_mem included). */
st_backend_params tool_backend_params(const tool_model_opts *o);
/* Whether prefill runs in fast mode (the backend's set_fast_prefill): --fast-prefill
 * or --precise when given, else true when a matrix of the model (a 2-D
 * tensor other than the token embedding) is stored in bf16, f16 or a
 * quantized type, false for f32 models (their f32 accuracy kept). CUDA only
 * in effect: the CPU backend computes in fp32 either way. */
bool tool_fast_prefill(const tool_model_opts *o, const st_model_files *files);

typedef struct {
    st_model_files *files;
    st_backend *be;
    st_llama *model;
    st_kv_pool *kv;      /* the paged KV pool the model's passes use (blocks 0.. in order for one sequence) */
    double load_s;
} tool_model;

/* Opens `path`, creates the backend, the model and its KV pool. Prints errors
 * to stderr and returns false on failure (everything released). */
/* Opens `path`, creates the backend (its prefill precision set by
 * tool_fast_prefill) and the model. Prints errors to stderr and returns false
 * on failure (everything released). */
bool tool_model_open(const char *path, const tool_model_opts *o, tool_model *tm);
void tool_model_close(tool_model *tm);

/* Weight streaming, for benchmarks: waits until the host tier is pinned
 * (steady state; says how long that took on stderr the first time) and
 * takes the manager's counters now. */
void tool_weights_settle(tool_model *tm, st_wm_stats *out);
/* Prints the weight plan and, when weights stream, the decode figures
 * measured between the counters `before` and `after` (taken around `steps`
 * decode steps of step_s seconds, nothing else run in between) beside the
 * plan's predictions: bytes from the file and bytes copied to the device per
 * step (also as exact byte counts: "bytes  per decode step: file N (plan
 * N), to the device N (plan N)"), step time and its bound; and the prefill of
 * n_prompt tokens in t_prefill seconds beside its prediction. */
void tool_print_weights(tool_model *tm, const st_wm_stats *before, const st_wm_stats *after, int64_t steps,
                        double step_s, int64_t n_prompt, double t_prefill);

/* Prints "strata CMD: <st_last_error()>" to stderr. */
void tool_print_error(const char *cmd);

/* weights/plan: where each weight group lives, and what that costs per step.
 *
 * Every forward pass reads the groups in the same cyclic order. For a cyclic
 * scan larger than a cache the best policy is a FIXED resident subset (a
 * window sliding with the current layer evicts exactly what the next step
 * needs first and ends up re-reading the whole model every token), so the
 * planner places each group once:
 *   DEVICE  resident in device memory, read in place;
 *   HOST    resident in pinned host memory, copied into a device ring slot
 *           each step (bytes / H2D bandwidth);
 *   SSD     read from its model file each step with O_DIRECT into pinned
 *           staging, then copied into a ring slot (image bytes / SSD bandwidth,
 *           and the tensor bytes cross PCIe too);
 *   CPU     (FFN groups only) resident in pinned host memory like HOST, and
 *           computed there by the model's CPU backend during decode (passes
 *           of at most cpu_max_tokens tokens: the hidden state crosses PCIe,
 *           a few KB a token, not the weights); a larger pass (prefill)
 *           streams it to the device like a HOST group. Bytes / the CPU's
 *           matmul read rate over host memory (bw.cpu).
 *
 * Device budget = other (KV cache, activations, backend scratch reserve: the
 * caller's figures) + ring (ring_slots x the largest streamed group) + embed
 * rows buffer (when the table is not resident) + resident groups.
 * Host budget (pinned) = staging (staging_chunks x staging_chunk, when any
 * group streams) + embed row staging + host-tier groups (their images).
 *
 * Placement: all groups but embed are read in full once per step, so a byte
 * kept resident saves the same time wherever it sits: the planner maximizes
 * resident bytes, then host bytes. Because ring slots must hold the largest
 * streamed group, it tries every "largest streamed size" c (groups larger
 * than c must then be resident, the ring is ring_slots x c) and keeps the one
 * with the least predicted step time; within one c it packs groups largest
 * first (equal-sized groups make this near-optimal: at most one group's worth
 * of budget is left unused). The embedding table is only gathered (a few rows
 * per step), so leaving it in the file costs almost nothing: it becomes
 * resident only with device room to spare, and never takes host-tier memory
 * (its rows are gathered from the file mapping into small pinned staging).
 *
 * With a possible CPU tier (bw.cpu known, cpu_ffn >= 0) the placements are
 * compared by the simulated step (t_step) instead, and each slot size is also
 * tried with the attention groups made resident first: then only FFN groups
 * stream, and a ring slot never holds a small group while the CPU computes
 * (the full-overlap model cannot tell these placements apart).
 *
 * CPU tier: once the device and host tiers are placed, up to every
 * non-resident FFN group (host tier first, then SSD ones while the host
 * budget has room for their images) may move to the CPU tier; the count
 * with the least predicted decode step wins (cpu_ffn: 0 auto, -1 none, N:
 * N of them), the chosen ones spread evenly over the layers (so that the
 * CPU's work alternates with the streamed groups' copies, which the ring
 * runs ahead of compute meanwhile).
 *
 * Split (cpu_split): a whole CPU-tier group leaves the device idle while the
 * CPU computes it, and the CPU idle while the device works, since each layer
 * waits for the one before. Splitting each CPU-tier group's intermediate
 * rows lets both compute every such layer at once: the device's share
 * streams through the ring (PCIe bytes), the CPU reads the rest in place.
 * The share is chosen with the count, by the simulated step, among values
 * around the one that gives the copies and the CPU equal times:
 *   phi = (cpu_bytes * h - other_streamed_bytes * c) / (cpu_bytes * (h + c))
 * (h, c: the shared rates where known). In auto, whole groups are a
 * candidate only where none of those shares is valid: the simulation does
 * not model the handover that leaves one side idle at each whole group, and
 * whole groups measured 1.11-1.23x slower than the split in every H100 run
 * that compared them, including plans that predicted them faster.
 *
 * Predicted decode step (full overlap: the SSD reader, the copy stream and
 * the compute stream are pipelined, each bounded by its own busy time; the
 * device's and the CPU's compute are serial, each layer's FFN waiting for
 * its attention and the next layer for it):
 *   max(ssd_img_bytes / ssd_bw, t_pcie, (read_bytes - cpu_bytes) / dev_read_bw + t_cpu)
 * with t_pcie = (host_bytes + ssd_bytes) / h2d_bw and t_cpu = cpu_bytes / cpu_bw
 * when only one of them reads host memory. With a CPU tier both do, from the
 * same DRAM, and neither gets its solo rate: when the shared rates are known
 * (bw.h2d_shared, bw.cpu_shared: measured together), both run at those until
 * the first is done, and the other finishes its bytes at its solo rate (two
 * phases; t_pcie and t_cpu are then each one's finishing time). Their sum,
 * (PCIe bytes + CPU bytes) / (h2d_shared + cpu_shared), is what host memory
 * gives at best: t_host, the hybrid's floor.
 * The serial sum of the three is also given as the pessimistic bound (no
 * overlap at all). Prefill of P tokens in chunks of T: each chunk streams the
 * non-resident groups once, so per chunk max(stream time, compute time) with
 * compute = T * flops_per_token / gemm_flops + attention.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "weights/groups.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ST_TIER_DEVICE = 0, ST_TIER_HOST, ST_TIER_SSD, ST_TIER_CPU, ST_TIER_COUNT } st_tier;
const char *st_tier_name(st_tier t); /* "device", "host", "ssd", "cpu" */

/* Bandwidths, bytes (or FLOP) per second; 0 where unknown. */
typedef struct {
    double h2d;        /* pinned host -> device copies */
    double ssd;        /* O_DIRECT reads of the model files */
    double dev_read;   /* weight bytes the backend's matmul reads per second at 1 token */
    double gemm;       /* FLOP/s of the backend's matmul at a prefill batch */
    double cpu;        /* weight bytes the CPU backend's matmul reads per second from host memory at
                          1 token, with the model's CPU threads (0: unknown: no CPU tier unless forced) */
    double h2d_shared; /* h2d and cpu again, measured while both read host memory at once (the copy engine */
    double cpu_shared; /* and the CPU draw on the same DRAM); 0: unknown (the solo rates are used) */
    bool ssd_direct;   /* the SSD figure was measured with O_DIRECT (false: page cache) */
    bool measured[6];  /* h2d, ssd, dev_read, gemm, cpu, the shared pair: measured now (false: given) */
    char skipped[192]; /* why the matmul probe did not run (no memory for it), or "" */
} st_wbw;

typedef struct {
    size_t device_mem;      /* device cap (0: unlimited: every group resident, no ring) */
    size_t host_mem;        /* pinned host cap for the weights (host tier + staging) */
    size_t device_kv;       /* device bytes of the KV cache */
    size_t device_act;      /* device bytes of activations */
    size_t device_reserve;  /* device bytes kept for backend scratch */
    int ring_slots;         /* device slots for streamed groups (0: 2; at least 2) */
    size_t staging_chunk;   /* bytes per staging buffer (0: 8 MiB; a multiple of 4096) */
    int staging_chunks;     /* staging buffers (0: 16) */
    int64_t max_batch;      /* tokens per forward chunk (embed rows buffer; prefill chunking) */
    int64_t prefill_tokens; /* prompt length of the prefill prediction (0: 2048) */
    double flops_per_token; /* matmul FLOPs of one token through the model */
    double attn_flops;      /* attention FLOPs of a prompt of P tokens = attn_flops * P * P / 2 */
    st_wbw bw;
    int cpu_ffn;            /* FFN groups on the CPU tier: 0 auto (the least predicted decode step;
                               none when bw.cpu is 0), -1 none, N > 0: N of the non-resident ones */
    double cpu_split;       /* of each CPU-tier FFN group, the share of its intermediate rows the device
                               computes during decode from a streamed copy of them, while the CPU computes
                               the rest (groups.h st_wg_split): 0 auto (the least simulated step, around
                               the share that gives host memory's two readers equal times; none only where
                               no such share is valid), < 0 none (the
                               CPU computes whole groups), (0, 1) that share (rounded to the split granule; a
                               share that rounds to no part for the device or the CPU is an error); a
                               forced placement (force) takes the share given, else none */
    const st_tier *force;   /* [groups->n] fixed placement (tests), or NULL */
    int64_t pass_tokens;    /* the tokens of the decode pass bw.cpu and bw.cpu_shared were measured at (0: 1;
                               planner.h cpu_pass_tokens): what the split balances; reported only */
} st_wplan_params;

typedef enum { ST_BOUND_NONE = 0, ST_BOUND_SSD, ST_BOUND_PCIE, ST_BOUND_COMPUTE, ST_BOUND_CPU } st_wbound;
const char *st_wbound_name(st_wbound b); /* "none", "SSD read", "PCIe (H2D)", "compute", "CPU compute" */

/* The two-phase finishing times of a and b bytes read from host memory at
 * once by the copy engine (h shared, H alone) and the CPU (c shared, C alone). */
void st_wplan_shared(double a, double b, double h, double H, double c, double C, double *t_a, double *t_b);

typedef struct {
    int n_groups;
    st_tier *tier;             /* [n_groups], owned */
    int ring_slots;            /* 0 when nothing streams */
    size_t slot_bytes;         /* bytes per ring slot */
    size_t staging_chunk;
    int staging_chunks;        /* 0 when nothing streams */
    bool embed_gather;         /* embedding rows gathered from the file (table not resident) */
    /* device budget breakdown */
    size_t device_mem, device_kv, device_act, device_reserve;
    size_t device_ring, device_embed_rows, device_resident, device_need;
    size_t device_min; /* the least device budget any placement fits in */
    /* host budget breakdown (pinned) */
    size_t host_mem, host_staging, host_embed_rows, host_tier, host_need;
    size_t host_cpu; /* of host_tier: the CPU tier's images */
    size_t host_min; /* what a plan at device_min needs (two staging chunks, the embedding rows) */
    /* tensor bytes and group counts per tier, and per kind */
    uint64_t bytes[ST_TIER_COUNT];
    int groups[ST_TIER_COUNT];
    int kind_groups[ST_TIER_COUNT][4]; /* [tier][st_wg_kind] */
    /* per decode step */
    uint64_t step_ssd_img_bytes;  /* read from the files (aligned images) */
    uint64_t step_ssd_bytes;      /* tensor bytes of SSD groups */
    uint64_t step_host_bytes;     /* tensor bytes copied from the host tier */
    uint64_t step_read_bytes;     /* weight bytes the math reads (all but the table; its rows) */
    uint64_t step_cpu_bytes;      /* of those, read by the CPU (CPU tier groups; their CPU part when split) */
    uint64_t step_split_bytes;    /* of step_host_bytes, the device parts of split CPU-tier groups */
    int64_t split_rows;           /* intermediate rows of each CPU-tier FFN group that the device computes in
                                     decode (groups.h st_wg_split; 0: the CPU computes whole groups) */
    int64_t pass_tokens;          /* the decode pass that split balances (st_wplan_params.pass_tokens; >= 1) */
    double t_ssd, t_pcie, t_compute;  /* seconds per decode step, each resource alone (t_compute: the
                                         device's reads, step_read_bytes - step_cpu_bytes) */
    double t_cpu;                 /* step_cpu_bytes / bw.cpu (shared: see the top comment) */
    double t_host;                /* (PCIe + CPU bytes) / (h2d_shared + cpu_shared): host memory's floor for a
                                     hybrid step; 0 without a CPU tier or the shared rates */
    double t_pcie_prefill;        /* a prefill chunk's PCIe time: the CPU tier streams too */
    double t_decode, t_decode_serial;
    double t_step;                /* the decode step simulated in order (st_wplan_simulate): 0 when a rate is unknown */
    st_wbound decode_bound;
    int64_t prefill_tokens, prefill_chunk;
    double t_prefill, t_prefill_stream, t_prefill_compute;
    st_wbound prefill_bound;
    double flops_per_token, attn_flops;
    st_wbw bw;
} st_wplan;

/* One decode step simulated group by group, in steady state (the second of
 * two steps): the copier loads the streamed groups in order into ring_slots
 * slots (a slot is free once the device computed the group that held it; an
 * SSD group's image must also have been read, the reader running ahead in
 * order), the device computes each group when its weights are there, and a
 * CPU-tier group is computed by the CPU while the device waits (the layer's
 * FFN between its attention and the next layer's; when split (split_rows),
 * the device's part streams through the ring like a host group and the
 * device computes it while the CPU computes the rest, the layer done when
 * both are). Rates: dev_read, h2d,
 * ssd, cpu; with a CPU tier the shared pair where known. What it adds to the
 * full-overlap t_decode: the ring's limited look-ahead, which lets the
 * copier idle while the CPU computes and the device wait afterwards. 0 when
 * a rate it needs is unknown. */
double st_wplan_simulate(const st_wgroups *g, const st_tier *tier, int64_t split_rows, const st_wbw *bw,
                         int ring_slots);

/* Places the groups (p->force: checks that placement instead). The caller
 * owns out->tier (st_wplan_free). A budget too small for any placement is
 * STRATA_ERR_NOMEM with a message saying how much is needed at least and
 * what it is made of. */
strata_status st_wplan_make(const st_wgroups *g, const st_wplan_params *p, st_wplan *out);
void st_wplan_free(st_wplan *p); /* safe on a zeroed struct */

/* Predicted prefill time of P tokens (in the plan's chunks) and its parts:
 * sums over chunks of the streaming time and of the compute time, and the
 * bound (the larger sum). */
double st_wplan_prefill(const st_wplan *p, int64_t P, double *t_stream, double *t_compute, st_wbound *bound);

/* One line: "device 3 groups 12.0 MB, host ..., ssd ..., cpu ...; decode 4.1 ms/token (SSD read)". */
void st_wplan_summary(const st_wplan *p, char *buf, size_t n);

/* 80% of the host's MemAvailable (/proc/meminfo); 0 when unknown. */
size_t st_wplan_host_auto(void);

/* Formats bytes as "12.3 MB" / "1.50 GB" (decimal units) into buf. */
const char *st_fmt_bytes(double bytes, char *buf, size_t n);

#ifdef __cplusplus
}
#endif

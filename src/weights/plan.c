/* weights/plan: the placement search and the step-time model (plan.h). */
#include "weights/plan.h"

#include <stdio.h>
#include <string.h>

#define DEFAULT_CHUNK ((size_t)8 << 20)
#define DEFAULT_CHUNKS 16
#define DEFAULT_PREFILL 2048

const char *st_tier_name(st_tier t) {
    switch (t) {
    case ST_TIER_DEVICE: return "device";
    case ST_TIER_HOST: return "host";
    case ST_TIER_SSD: return "ssd";
    case ST_TIER_CPU: return "cpu";
    default: return "?";
    }
}

const char *st_wbound_name(st_wbound b) {
    switch (b) {
    case ST_BOUND_SSD: return "SSD read";
    case ST_BOUND_PCIE: return "PCIe (H2D)";
    case ST_BOUND_COMPUTE: return "compute";
    case ST_BOUND_CPU: return "CPU compute";
    default: return "none";
    }
}

const char *st_fmt_bytes(double b, char *buf, size_t n) {
    if (b >= 1e9) snprintf(buf, n, "%.2f GB", b / 1e9);
    else if (b >= 1e6) snprintf(buf, n, "%.1f MB", b / 1e6);
    else if (b >= 1e3) snprintf(buf, n, "%.1f KB", b / 1e3);
    else snprintf(buf, n, "%.0f B", b);
    return buf;
}

size_t st_wplan_host_auto(void) { return st_mem_available() / 10 * 8; }

static size_t round256(size_t x) { return (x + 255) / 256 * 256; }

typedef struct {
    int ring_slots;
    size_t chunk;
    int chunks;
    int64_t max_batch;
} knobs;

/* Staging: chunks of 8 MiB (large O_DIRECT requests), or a quarter of the
 * largest group image when that is smaller (so that reading and copying a
 * group overlap), at least 64 KiB; 16 of them (reads in flight), fewer when
 * the host budget is short (at least 2). */
static knobs get_knobs(const st_wgroups *g, const st_tier *tier, const st_wplan_params *p) {
    knobs k;
    k.ring_slots = p->ring_slots > 2 ? p->ring_slots : 2;
    uint64_t big = 0; /* the largest streamed image (all groups when tier is NULL) */
    for (int i = 1; i < g->n; i++)
        if ((!tier || tier[i] != ST_TIER_DEVICE) && g->g[i].img_bytes > big) big = g->g[i].img_bytes;
    size_t def = (size_t)(big / 4 + ST_WG_ALIGN - 1) / ST_WG_ALIGN * ST_WG_ALIGN;
    if (def > DEFAULT_CHUNK) def = DEFAULT_CHUNK;
    if (def < ((size_t)64 << 10)) def = (size_t)64 << 10;
    k.chunk = p->staging_chunk ? (p->staging_chunk + ST_WG_ALIGN - 1) / ST_WG_ALIGN * ST_WG_ALIGN : def;
    k.chunks = p->staging_chunks > 0 ? p->staging_chunks : DEFAULT_CHUNKS;
    if (k.chunks < 2) k.chunks = 2;
    k.max_batch = p->max_batch > 0 ? p->max_batch : 512;
    return k;
}

static size_t embed_rows_device(const st_wgroups *g, const knobs *k) {
    return round256((size_t)k->max_batch * (size_t)g->embed_row_bytes) + round256((size_t)k->max_batch * 4);
}

static size_t embed_rows_host(const st_wgroups *g, const knobs *k) {
    return 2 * (size_t)k->max_batch * (size_t)g->embed_row_bytes;
}

static size_t staging_host(const knobs *k) { return (size_t)k->chunks * k->chunk + ST_WG_ALIGN; }

/* Fills every derived figure of `out` from out->tier. */
static void evaluate(const st_wgroups *g, const st_wplan_params *p, const knobs *k, st_wplan *out) {
    const int n = g->n;
    const int oid = st_wg_output_id(g);
    out->n_groups = n;
    if (g->tied) out->tier[0] = out->tier[oid] == ST_TIER_DEVICE ? ST_TIER_DEVICE : ST_TIER_SSD;
    size_t slot = 0, resident = 0, host_tier = 0, host_cpu = 0;
    uint64_t cpu_tensor = 0; /* the CPU tier's tensor bytes (a prefill chunk streams them all) */
    bool streams = false;
    memset(out->bytes, 0, sizeof out->bytes);
    memset(out->groups, 0, sizeof out->groups);
    memset(out->kind_groups, 0, sizeof out->kind_groups);
    out->step_ssd_img_bytes = out->step_ssd_bytes = out->step_host_bytes = out->step_read_bytes = 0;
    out->step_cpu_bytes = out->step_split_bytes = 0;
    for (int i = 0; i < n; i++) {
        const st_wgroup *gr = &g->g[i];
        const st_tier t = out->tier[i];
        out->bytes[t] += gr->bytes;
        out->groups[t]++;
        out->kind_groups[t][gr->kind]++;
        if (i == 0) continue; /* the table: resident or gathered, never streamed */
        out->step_read_bytes += gr->bytes;
        if (t == ST_TIER_DEVICE) {
            resident += gr->slot_bytes;
            continue;
        }
        streams = true;
        if (gr->slot_bytes > slot) slot = gr->slot_bytes;
        if (t == ST_TIER_HOST) {
            host_tier += gr->img_bytes + ST_WG_ALIGN;
            out->step_host_bytes += gr->bytes;
        } else if (t == ST_TIER_CPU) { /* pinned like the host tier; computed there (decode) */
            host_tier += gr->img_bytes + ST_WG_ALIGN;
            host_cpu += gr->img_bytes + ST_WG_ALIGN;
            cpu_tensor += gr->bytes;
            st_wg_split sp;
            if (out->split_rows > 0 && st_wg_split_of(gr, out->split_rows, &sp)) { /* the device's part streams */
                out->step_cpu_bytes += sp.cpu_bytes;
                out->step_host_bytes += sp.dev_bytes;
                out->step_split_bytes += sp.dev_bytes;
            } else {
                out->step_cpu_bytes += gr->bytes;
            }
        } else {
            out->step_ssd_bytes += gr->bytes;
            out->step_ssd_img_bytes += gr->img_bytes;
        }
    }
    out->step_read_bytes += g->embed_row_bytes;
    out->embed_gather = out->tier[0] != ST_TIER_DEVICE;
    if (out->tier[0] == ST_TIER_DEVICE) resident += g->g[0].slot_bytes;

    out->ring_slots = streams ? k->ring_slots : 0;
    out->slot_bytes = streams ? slot : 0;
    out->staging_chunk = k->chunk;
    out->staging_chunks = streams ? k->chunks : 0;
    out->device_mem = p->device_mem;
    out->device_kv = p->device_kv;
    out->device_act = p->device_act;
    out->device_reserve = p->device_reserve;
    out->device_ring = (size_t)out->ring_slots * out->slot_bytes;
    out->device_embed_rows = out->embed_gather ? embed_rows_device(g, k) : 0;
    out->device_resident = resident;
    out->device_need = p->device_kv + p->device_act + p->device_reserve + out->device_ring + out->device_embed_rows +
                       resident;
    out->host_mem = p->host_mem;
    out->host_staging = streams ? staging_host(k) : 0;
    out->host_embed_rows = out->embed_gather ? embed_rows_host(g, k) : 0;
    out->host_tier = host_tier;
    out->host_cpu = host_cpu;
    out->host_need = out->host_staging + out->host_embed_rows + host_tier;

    const st_wbw *bw = &p->bw;
    out->bw = *bw;
    out->t_ssd = bw->ssd > 0 ? (double)out->step_ssd_img_bytes / bw->ssd : 0;
    const double pcie_bytes = (double)(out->step_host_bytes + out->step_ssd_bytes);
    out->t_pcie = bw->h2d > 0 ? pcie_bytes / bw->h2d : 0;
    out->t_compute = bw->dev_read > 0 ? (double)(out->step_read_bytes - out->step_cpu_bytes) / bw->dev_read : 0;
    out->t_cpu = bw->cpu > 0 ? (double)out->step_cpu_bytes / bw->cpu : 0;
    out->t_host = 0;
    if (out->step_cpu_bytes > 0 && pcie_bytes > 0 && bw->h2d > 0 && bw->cpu > 0 && bw->h2d_shared > 0 &&
        bw->cpu_shared > 0) { /* both read host memory at once */
        st_wplan_shared(pcie_bytes, (double)out->step_cpu_bytes, bw->h2d_shared, bw->h2d, bw->cpu_shared, bw->cpu,
                        &out->t_pcie, &out->t_cpu);
        out->t_host = (pcie_bytes + (double)out->step_cpu_bytes) / (bw->h2d_shared + bw->cpu_shared);
    }
    out->t_pcie_prefill = bw->h2d > 0 ? (double)(out->step_host_bytes - out->step_split_bytes + out->step_ssd_bytes +
                                                 cpu_tensor) / bw->h2d
                                      : 0;
    out->t_decode = out->t_ssd;
    out->decode_bound = out->t_ssd > 0 ? ST_BOUND_SSD : ST_BOUND_NONE;
    if (out->t_pcie > out->t_decode) out->t_decode = out->t_pcie, out->decode_bound = ST_BOUND_PCIE;
    /* the device's compute and the CPU's are serial (each FFN waits for its attention) */
    const double comp = out->t_compute + out->t_cpu;
    if (comp > out->t_decode)
        out->t_decode = comp, out->decode_bound = out->t_cpu > out->t_compute ? ST_BOUND_CPU : ST_BOUND_COMPUTE;
    out->t_decode_serial = out->t_ssd + out->t_pcie + out->t_compute + out->t_cpu;
    out->t_step = st_wplan_simulate(g, out->tier, out->split_rows, bw, out->ring_slots);

    out->prefill_tokens = p->prefill_tokens > 0 ? p->prefill_tokens : DEFAULT_PREFILL;
    out->prefill_chunk = k->max_batch;
    out->flops_per_token = p->flops_per_token;
    out->pass_tokens = p->pass_tokens > 1 ? p->pass_tokens : 1;
    out->attn_flops = p->attn_flops;
    out->t_prefill = st_wplan_prefill(out, out->prefill_tokens, &out->t_prefill_stream, &out->t_prefill_compute,
                                      &out->prefill_bound);
}

double st_wplan_simulate(const st_wgroups *g, const st_tier *tier, int64_t split_rows, const st_wbw *bw,
                         int ring_slots) {
    bool cpu = false, ssd = false, streams = false;
    for (int i = 1; i < g->n; i++) {
        cpu = cpu || tier[i] == ST_TIER_CPU;
        ssd = ssd || tier[i] == ST_TIER_SSD;
        streams = streams || tier[i] == ST_TIER_HOST || tier[i] == ST_TIER_SSD ||
                  (tier[i] == ST_TIER_CPU && split_rows > 0); /* a split group's device part streams */
    }
    const bool shared = cpu && streams && bw->h2d_shared > 0 && bw->cpu_shared > 0;
    const double h = shared ? bw->h2d_shared : bw->h2d, c = shared ? bw->cpu_shared : bw->cpu;
    if (!(bw->dev_read > 0) || (streams && !(h > 0)) || (cpu && !(c > 0)) || (ssd && !(bw->ssd > 0))) return 0;
    enum { MAX_RING = 64 };
    const int R = ring_slots < 1 ? 1 : ring_slots > MAX_RING ? MAX_RING : ring_slots;
    double rel[MAX_RING] = {0}; /* when each slot was last freed */
    double t = 0, loaded = 0, read = 0, start = 0;
    int64_t j = 0; /* streamed groups so far */
    for (int step = 0; step < 2; step++) {
        if (step == 1) start = t;
        for (int i = 1; i < g->n; i++) {
            const double b = (double)g->g[i].bytes;
            st_wg_split sp;
            if (tier[i] == ST_TIER_DEVICE) {
                t += b / bw->dev_read;
            } else if (tier[i] == ST_TIER_CPU && split_rows > 0 && st_wg_split_of(&g->g[i], split_rows, &sp)) {
                /* the device's part through the ring, computed beside the CPU's */
                const double s = loaded > rel[j % R] ? loaded : rel[j % R], bd = (double)sp.dev_bytes;
                loaded = s + bd / h;
                const double dev = (t > loaded ? t : loaded) + bd / bw->dev_read;
                rel[j++ % R] = dev;
                const double cpu_done = t + (double)sp.cpu_bytes / c;
                t = dev > cpu_done ? dev : cpu_done;
            } else if (tier[i] == ST_TIER_CPU) {
                t += b / c;
            } else {
                double s = loaded > rel[j % R] ? loaded : rel[j % R];
                if (tier[i] == ST_TIER_SSD) {
                    read += (double)g->g[i].img_bytes / bw->ssd;
                    if (read > s) s = read; /* copies follow the reads (staging chunks pipeline them closely) */
                }
                loaded = s + b / h;
                t = (t > loaded ? t : loaded) + b / bw->dev_read;
                rel[j++ % R] = t;
            }
        }
    }
    return t - start;
}

void st_wplan_shared(double a, double b, double h, double H, double c, double C, double *t_a, double *t_b) {
    if (a / h <= b / c) { /* the copies finish first; the CPU then reads alone */
        *t_a = a / h;
        *t_b = *t_a + (b - c * *t_a) / C;
    } else {
        *t_b = b / c;
        *t_a = *t_b + (a - h * *t_b) / H;
    }
}

double st_wplan_prefill(const st_wplan *p, int64_t P, double *t_stream, double *t_compute, st_wbound *bound) {
    const int64_t T = p->prefill_chunk > 0 ? p->prefill_chunk : 512;
    /* prefill streams the CPU tier too (it is not computed on the CPU) */
    const double pcie = p->t_pcie_prefill > p->t_pcie ? p->t_pcie_prefill : p->t_pcie;
    const double stream = p->t_ssd > pcie ? p->t_ssd : pcie;
    double sum = 0, s_stream = 0, s_comp = 0;
    for (int64_t pos = 0; pos < P; pos += T) {
        const double t = (double)(P - pos < T ? P - pos : T);
        double comp = p->bw.gemm > 0
                          ? (t * p->flops_per_token + p->attn_flops * t * ((double)pos + t / 2)) / p->bw.gemm
                          : 0;
        if (p->t_compute > comp) comp = p->t_compute;
        sum += stream > comp ? stream : comp;
        s_stream += stream;
        s_comp += comp;
    }
    if (t_stream) *t_stream = s_stream;
    if (t_compute) *t_compute = s_comp;
    if (bound)
        *bound = s_stream == 0 && s_comp == 0 ? ST_BOUND_NONE
                 : s_comp >= s_stream         ? ST_BOUND_COMPUTE
                 : p->t_ssd > pcie            ? ST_BOUND_SSD
                                              : ST_BOUND_PCIE;
    return sum;
}

/* Greedy fill: among groups 1..n-1 still on SSD with slot_bytes <= c, makes
 * resident the largest first, spreading equal-sized picks evenly over the
 * layers (so that resident compute interleaves with streaming). */
static void fill_device(const st_wgroups *g, st_tier *tier, size_t c, size_t *avail) {
    const int n = g->n;
    for (;;) {
        size_t size = 0; /* the largest size class not yet considered that fits */
        for (int i = 1; i < n; i++)
            if (tier[i] == ST_TIER_SSD && g->g[i].slot_bytes <= c && g->g[i].slot_bytes <= *avail &&
                g->g[i].slot_bytes > size)
                size = g->g[i].slot_bytes;
        if (size == 0) return;
        int members[n], count = 0;
        for (int i = 1; i < n; i++)
            if (tier[i] == ST_TIER_SSD && g->g[i].slot_bytes == size) members[count++] = i;
        size_t take = *avail / size;
        if (take > (size_t)count) take = (size_t)count;
        for (size_t j = 0; j < take; j++) {
            int idx = (int)(((double)j + 0.5) * (double)count / (double)take);
            if (idx >= count) idx = count - 1;
            while (tier[members[idx]] != ST_TIER_SSD) idx = (idx + 1) % count;
            tier[members[idx]] = ST_TIER_DEVICE;
        }
        *avail -= take * size;
        if (take < (size_t)count) return; /* smaller classes may still fit in what is left */
    }
}

/* The attention groups (slot_bytes <= c) resident first, as many as fit,
 * spread evenly over the layers. */
static void fill_attn(const st_wgroups *g, st_tier *tier, size_t c, size_t *avail) {
    const int n = g->n;
    int members[n], count = 0;
    for (int i = 1; i < n; i++)
        if (g->g[i].kind == ST_WG_ATTN && tier[i] == ST_TIER_SSD && g->g[i].slot_bytes <= c) members[count++] = i;
    if (count == 0) return;
    size_t big = 0;
    for (int j = 0; j < count; j++)
        if (g->g[members[j]].slot_bytes > big) big = g->g[members[j]].slot_bytes;
    size_t take = *avail / big;
    if (take > (size_t)count) take = (size_t)count;
    for (size_t j = 0; j < take; j++) {
        int idx = (int)(((double)j + 0.5) * (double)count / (double)take);
        if (idx >= count) idx = count - 1;
        tier[members[idx]] = ST_TIER_DEVICE;
        *avail -= g->g[members[idx]].slot_bytes;
    }
}

static void fill_host(const st_wgroups *g, st_tier *tier, size_t avail) {
    const int n = g->n;
    for (;;) { /* largest image first */
        int best = -1;
        for (int i = 1; i < n; i++)
            if (tier[i] == ST_TIER_SSD && g->g[i].img_bytes + ST_WG_ALIGN <= avail &&
                (best < 0 || g->g[i].img_bytes > g->g[best].img_bytes))
                best = i;
        if (best < 0) return;
        tier[best] = ST_TIER_HOST;
        avail -= g->g[best].img_bytes + ST_WG_ALIGN;
    }
}

/* Whether placements are compared by the simulated step (a CPU tier is possible). */
static bool by_sim(const st_wplan_params *p) { return p->cpu_ffn >= 0 && p->bw.cpu > 0; }

/* What placements are compared by: the simulated step with a possible CPU
 * tier (when known), else the full-overlap prediction. */
static double cost(const st_wplan_params *p, const st_wplan *t) {
    return by_sim(p) && t->t_step > 0 ? t->t_step : t->t_decode;
}

/* Intermediate rows of the model's FFN groups (alike in a Llama model); 0 when they cannot be split
 * (no tensor descriptors: synthetic groups). */
static int64_t ffn_inter(const st_wgroups *g) {
    const st_wgroup *f = &g->g[st_wg_ffn_id(0)];
    return g->n_layers > 0 && st_wg_split_granule(f) > 0 ? f->t[ST_WG_GATE].desc->shape[0] : 0;
}

/* The device rows for a share phi of I: rounded to the split granule (groups.h; 256 rows at
 * least where I allows); 0 when that is no valid split of every FFN group. */
static int64_t split_rows_for(const st_wgroups *g, double phi) {
    const int64_t I = ffn_inter(g);
    if (I == 0 || !(phi > 0)) return 0;
    int64_t q = st_wg_split_granule(&g->g[st_wg_ffn_id(0)]);
    while (q < 256 && I % (2 * q) == 0 && I / (2 * q) >= 8) q *= 2; /* coarser steps on large layers */
    const int64_t r = (int64_t)(phi * (double)I / (double)q + 0.5) * q;
    st_wg_split sp;
    for (int l = 0; l < g->n_layers; l++)
        if (!st_wg_split_of(&g->g[st_wg_ffn_id(l)], r, &sp)) return 0;
    return r;
}

/* The candidate splits of a placement: p->cpu_split's share, none, or (auto) none and shares around
 * the one that gives the copies and the CPU equal times (plan.h). Returns the count. */
static int split_candidates(const st_wgroups *g, const st_wplan_params *p, const st_tier *tier, int64_t out[8]) {
    int nc = 0;
    out[nc++] = 0;
    if (p->cpu_split < 0 || ffn_inter(g) == 0) return nc;
    if (p->cpu_split > 0) { /* checked valid by st_wplan_make */
        out[0] = split_rows_for(g, p->cpu_split);
        return nc;
    }
    double cpu = 0, other = 0;
    for (int i = 1; i < g->n; i++) {
        if (tier[i] == ST_TIER_CPU) cpu += (double)g->g[i].bytes;
        else if (tier[i] != ST_TIER_DEVICE) other += (double)g->g[i].bytes;
    }
    const st_wbw *bw = &p->bw;
    const bool shared = bw->h2d_shared > 0 && bw->cpu_shared > 0;
    const double h = shared ? bw->h2d_shared : bw->h2d, c = shared ? bw->cpu_shared : bw->cpu;
    if (!(h > 0) || !(c > 0)) return nc;
    const double phi = (cpu * h - other * c) / (cpu * (h + c));
    static const double around[] = {0, -1.0 / 16, 1.0 / 16, -1.0 / 8, 1.0 / 8};
    int64_t shares[5];
    int ns = 0;
    for (size_t a = 0; a < sizeof around / sizeof around[0]; a++) {
        const int64_t r = split_rows_for(g, phi + around[a]);
        bool dup = r == 0;
        for (int j = 0; j < ns; j++) dup = dup || shares[j] == r;
        if (!dup) shares[ns++] = r;
    }
    /* whole groups only where no share is valid: the simulation leaves out the handover at each
     * whole CPU group (one side idle while the other computes), and it predicted whole groups
     * faster in some plans although they measured 1.11-1.23x slower than the split in every
     * H100 comparison (eighth and tenth sessions, 70B q4_0 at 16 GB) */
    if (ns == 0) return nc;
    memcpy(out, shares, (size_t)ns * sizeof *shares);
    return ns;
}

/* The CPU tier: moves j of the non-resident FFN groups (HOST or SSD) to it,
 * spread evenly over the layers, with a split of each (split_candidates), for
 * the j and split with the least predicted decode step (p->cpu_ffn: 0 auto,
 * -1 none, N: min(N, count)); SSD groups need host room for their images.
 * Auto where groups split: every one of them, split, first (the split share
 * balances PCIe against the CPU within each group); the other counts only when
 * that finds no split plan better than none (no share valid, no host room).
 * Fewer CPU-tier groups leave the rest streamed whole, one side idle at each;
 * the simulation does not see those handovers, and such plans measured 4-22%
 * slower than predicted on an H100 (70B q4_0, 16 GB, thirteenth session:
 * 252-305 ms per token with 4-7 whole groups streamed, 231-241 ms with all 58
 * on the CPU tier).
 * `tier` and *trial (evaluated) are updated to the choice; `work` is scratch
 * [g->n]. */
typedef struct { /* place_cpu's best so far */
    double t, serial;
    int64_t split;
    bool found;
} cpu_best;

/* place_cpu's candidates with `take` CPU-tier groups (spread evenly over members[count]) and each
 * split share; false when they need more host room than the budget (more would need more still). */
static bool try_take(const st_wgroups *g, const st_wplan_params *p, const knobs *k, const st_tier *tier,
                     const int *members, int count, int take, st_wplan *t, st_tier *chosen, cpu_best *b) {
    st_tier *work = t->tier;
    memcpy(work, tier, (size_t)g->n * sizeof *work);
    for (int j = 0; j < take; j++) {
        int idx = (int)(((double)j + 0.5) * (double)count / (double)take);
        if (idx >= count) idx = count - 1;
        work[members[idx]] = ST_TIER_CPU;
    }
    int64_t splits[8];
    const int ns = split_candidates(g, p, work, splits);
    for (int sj = 0; sj < ns; sj++) {
        t->split_rows = splits[sj];
        evaluate(g, p, k, t);
        if (t->host_need > p->host_mem) return false;
        /* the least step, then the least serial sum (an SSD-bound step still gains PCIe time) */
        const double tc = cost(p, t);
        if ((p->cpu_ffn > 0 && !b->found) || tc < b->t || (tc == b->t && t->t_decode_serial < b->serial)) {
            b->t = tc;
            b->serial = t->t_decode_serial;
            b->split = splits[sj];
            memcpy(chosen, work, (size_t)g->n * sizeof *work);
            b->found = true;
        }
    }
    return true;
}

static void place_cpu(const st_wgroups *g, const st_wplan_params *p, const knobs *k, st_tier *tier,
                      st_tier *work, st_wplan *trial) {
    trial->split_rows = 0;
    if (p->cpu_ffn < 0 || (p->cpu_ffn == 0 && !(p->bw.cpu > 0))) return;
    const int n = g->n;
    int members[n], count = 0;
    for (int i = 1; i < n; i++)
        if (g->g[i].kind == ST_WG_FFN && (tier[i] == ST_TIER_HOST || tier[i] == ST_TIER_SSD)) members[count++] = i;
    if (count == 0) return;
    const int lo = p->cpu_ffn > 0 ? (p->cpu_ffn < count ? p->cpu_ffn : count) : 1;
    const int hi = p->cpu_ffn > 0 ? lo : count;
    st_tier chosen[n];
    cpu_best b = {.t = cost(p, trial), .serial = trial->t_decode_serial};
    st_wplan t = *trial;
    t.tier = work;
    /* auto with splits: every group, split, first (see above) */
    const bool all_first = p->cpu_ffn == 0 && p->cpu_split >= 0 && ffn_inter(g) > 0;
    if (all_first) {
        const cpu_best none = b;
        if (!try_take(g, p, k, tier, members, count, hi, &t, chosen, &b) || !b.found || b.split == 0) b = none;
    }
    if (!b.found)
        for (int take = lo; take <= hi && try_take(g, p, k, tier, members, count, take, &t, chosen, &b); take++) {
        }
    if (b.found) {
        memcpy(tier, chosen, (size_t)n * sizeof *tier);
        trial->split_rows = b.split;
    }
    evaluate(g, p, k, trial); /* trial->tier is `tier` */
}

static bool better(const st_wplan_params *p, const st_wplan *a, const st_wplan *b) { /* a better than b */
    if (cost(p, a) != cost(p, b)) return cost(p, a) < cost(p, b);
    if (a->t_decode != b->t_decode) return a->t_decode < b->t_decode;
    if (a->t_decode_serial != b->t_decode_serial) return a->t_decode_serial < b->t_decode_serial;
    if (a->bytes[ST_TIER_SSD] != b->bytes[ST_TIER_SSD]) return a->bytes[ST_TIER_SSD] < b->bytes[ST_TIER_SSD];
    return a->device_need < b->device_need;
}

static strata_status too_small_device(const st_wgroups *g, const st_wplan_params *p, const knobs *k, size_t min_need,
                                      size_t min_c) {
    char b[8][32];
    size_t big = 0; /* groups that must stay resident because they exceed a slot */
    for (int i = 1; i < g->n; i++)
        if (g->g[i].slot_bytes > min_c) big += g->g[i].slot_bytes;
    return st_err(STRATA_ERR_NOMEM,
                  "device budget (--device-mem) of %s is too small for this model: at least %s is needed "
                  "(KV cache %s + activations %s + backend reserve %s + ring %d x %s + embedding rows %s%s%s)",
                  st_fmt_bytes((double)p->device_mem, b[0], 32), st_fmt_bytes((double)min_need, b[1], 32),
                  st_fmt_bytes((double)p->device_kv, b[2], 32), st_fmt_bytes((double)p->device_act, b[3], 32),
                  st_fmt_bytes((double)p->device_reserve, b[4], 32), k->ring_slots,
                  st_fmt_bytes((double)min_c, b[5], 32), st_fmt_bytes((double)embed_rows_device(g, k), b[6], 32),
                  big ? " + groups larger than a slot, resident " : "",
                  big ? st_fmt_bytes((double)big, b[7], 32) : "");
}

static strata_status too_small_host(const st_wgroups *g, const st_wplan_params *p, const knobs *k, size_t need,
                                    bool gather, size_t chunk) {
    char b[4][32];
    return st_err(STRATA_ERR_NOMEM,
                  "host budget (--host-mem) of %s is too small: streaming the weights needs at least %s of pinned "
                  "memory (staging %d x %s%s%s)",
                  st_fmt_bytes((double)p->host_mem, b[0], 32), st_fmt_bytes((double)need, b[1], 32), 2,
                  st_fmt_bytes((double)chunk, b[2], 32), gather ? " + embedding rows " : "",
                  gather ? st_fmt_bytes((double)embed_rows_host(g, k), b[3], 32) : "");
}

strata_status st_wplan_make(const st_wgroups *g, const st_wplan_params *p, st_wplan *out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "plan: out is NULL");
    memset(out, 0, sizeof *out);
    if (!g || !p) return st_err(STRATA_ERR_INVALID_ARG, "plan: NULL groups or params");
    const knobs k = get_knobs(g, p->force, p);
    const int n = g->n;
    out->n_groups = n;
    out->tier = st_calloc((size_t)n, sizeof *out->tier);
    st_tier *cand = st_calloc((size_t)n, sizeof *cand);
    st_tier *work = st_calloc((size_t)n, sizeof *work);
    if (!out->tier || !cand || !work) {
        st_free(cand);
        st_free(work);
        st_wplan_free(out);
        return st_err(STRATA_ERR_NOMEM, "plan: out of memory for the tiers of %d weight groups", (int)n);
    }
    const size_t other = p->device_kv + p->device_act + p->device_reserve;
    strata_status st = STRATA_OK;
    if (p->cpu_split > 0 && ffn_inter(g) > 0 && split_rows_for(g, p->cpu_split) == 0) {
        /* a share asked for that no split realizes: said, not ignored */
        st = st_err(STRATA_ERR_INVALID_ARG, "plan: a cpu split of %g of the FFN's %lld intermediate rows "
                    "leaves the device or the CPU no part (it moves in whole quantization blocks)",
                    p->cpu_split, (long long)ffn_inter(g));
        goto done;
    }

    if (p->force) {
        for (int i = 0; i < n; i++) {
            if (p->force[i] < 0 || p->force[i] >= ST_TIER_COUNT || (i == 0 && p->force[i] == ST_TIER_HOST) ||
                (p->force[i] == ST_TIER_CPU && g->g[i].kind != ST_WG_FFN)) {
                st = st_err(STRATA_ERR_INVALID_ARG, "plan: group %s cannot be placed on tier %d%s", g->g[i].name,
                            (int)p->force[i],
                            p->force[i] == ST_TIER_CPU ? " (cpu: only FFN groups are computed on the CPU)" : "");
                goto done;
            }
            out->tier[i] = p->force[i];
        }
        if (p->cpu_split > 0) out->split_rows = split_rows_for(g, p->cpu_split); /* else none */
        evaluate(g, p, &k, out);
        out->device_min = out->device_need;
        out->host_min = out->host_embed_rows + (out->ring_slots ? 2 * out->staging_chunk + ST_WG_ALIGN : 0);
        char b[3][32];
        if (p->device_mem && out->device_need > p->device_mem) {
            st = st_err(STRATA_ERR_NOMEM, "device budget (--device-mem) of %s is too small for this placement: %s needed",
                        st_fmt_bytes((double)p->device_mem, b[0], 32), st_fmt_bytes((double)out->device_need, b[1], 32));
            goto done;
        }
        if (out->host_need > p->host_mem && (out->host_need > 0)) {
            st = st_err(STRATA_ERR_NOMEM, "host budget (--host-mem) of %s is too small for this placement: %s needed",
                        st_fmt_bytes((double)p->host_mem, b[0], 32), st_fmt_bytes((double)out->host_need, b[1], 32));
            goto done;
        }
        goto done;
    }

    if (p->device_mem == 0) { /* unlimited: everything resident */
        for (int i = 0; i < n; i++) out->tier[i] = ST_TIER_DEVICE;
        evaluate(g, p, &k, out);
        goto done;
    }

    /* the least device memory any placement needs, and with which slot size */
    size_t all = 0;
    for (int i = 1; i < n; i++) all += g->g[i].slot_bytes;
    size_t min_need = other + all + (g->tied ? 0 : (g->g[0].slot_bytes < embed_rows_device(g, &k)
                                                        ? g->g[0].slot_bytes
                                                        : embed_rows_device(g, &k)));
    size_t min_c = 0;
    for (int i = 1; i < n; i++) {
        const size_t c = g->g[i].slot_bytes;
        size_t need = other + (size_t)k.ring_slots * c + embed_rows_device(g, &k);
        for (int j = 1; j < n; j++)
            if (g->g[j].slot_bytes > c) need += g->g[j].slot_bytes;
        if (need < min_need) min_need = need, min_c = c;
    }

    bool found = false, host_short = false;
    size_t host_short_need = 0;
    bool host_short_gather = false;
    size_t host_short_chunk = 0;
    st_wplan best = {0}, trial = {0};
    trial.tier = cand;
    /* candidates: c = 0 (nothing streams), then every distinct slot size */
    size_t *sizes = st_calloc((size_t)n + 1, sizeof *sizes);
    if (!sizes) {
        st = st_err(STRATA_ERR_NOMEM, "plan: out of memory for %d candidate slot sizes", (int)n + 1);
        goto done;
    }
    int n_sizes = 1; /* sizes[0] = 0 */
    for (int i = 1; i < n; i++) {
        bool dup = false;
        for (int j = 1; j < n_sizes; j++) dup = dup || sizes[j] == g->g[i].slot_bytes;
        if (!dup) sizes[n_sizes++] = g->g[i].slot_bytes;
    }
    /* each slot size c, and with a possible CPU tier also with the attention groups resident first */
    const int orders = by_sim(p) ? 2 : 1;
    for (int cj = 0; cj < n_sizes * orders; cj++) {
        const size_t c = sizes[cj / orders];
        const bool attn_first = cj % orders == 1;
        for (int i = 0; i < n; i++) cand[i] = ST_TIER_SSD;
        size_t fixed = other;
        if (c > 0) fixed += (size_t)k.ring_slots * c;
        size_t mand = 0;
        for (int i = 1; i < n; i++)
            if (c == 0 || g->g[i].slot_bytes > c) {
                cand[i] = ST_TIER_DEVICE;
                mand += g->g[i].slot_bytes;
            }
        if (fixed + mand > p->device_mem) continue;
        size_t avail = p->device_mem - fixed - mand;
        const size_t rows = embed_rows_device(g, &k);
        if (c > 0) {
            if (avail < rows) continue; /* the rows buffer, in case the table is not resident */
            avail -= rows;
            if (attn_first) fill_attn(g, cand, c, &avail);
            fill_device(g, cand, c, &avail);
            avail += rows;
        }
        bool any_stream = false;
        for (int i = 1; i < n; i++) any_stream = any_stream || cand[i] != ST_TIER_DEVICE;
        if (!any_stream && c > 0) continue; /* the same as c = 0, with a needless ring */
        /* the table: resident when it fits in place of its rows buffer */
        if (!g->tied) {
            if (g->g[0].slot_bytes <= avail) cand[0] = ST_TIER_DEVICE;
            else if (rows > avail) continue;
        } else if (cand[st_wg_output_id(g)] != ST_TIER_DEVICE && rows > avail) {
            continue;
        }
        /* host: staging (fewer chunks when the budget is short, 2 at least),
         * the embedding rows, then the host tier in what is left */
        knobs kc = get_knobs(g, cand, p);
        trial.split_rows = 0;
        evaluate(g, p, &kc, &trial);
        if (trial.ring_slots && trial.host_staging + trial.host_embed_rows > p->host_mem) {
            const size_t fixed = trial.host_embed_rows + ST_WG_ALIGN;
            const size_t fit = p->host_mem > fixed ? (p->host_mem - fixed) / kc.chunk : 0;
            kc.chunks = fit < 2 ? 2 : (int)fit;
            evaluate(g, p, &kc, &trial);
        }
        const size_t host_fixed = trial.host_staging + trial.host_embed_rows;
        if (host_fixed > p->host_mem) {
            if (!host_short || host_fixed < host_short_need) {
                host_short_need = host_fixed;
                host_short_gather = trial.embed_gather;
                host_short_chunk = kc.chunk;
            }
            host_short = true;
            continue;
        }
        fill_host(g, cand, p->host_mem - host_fixed);
        evaluate(g, p, &kc, &trial);
        place_cpu(g, p, &kc, cand, work, &trial);
        if (trial.device_need > p->device_mem || trial.host_need > p->host_mem) continue; /* cannot happen */
        if (!found || better(p, &trial, &best)) {
            st_tier *keep = best.tier;
            best = trial;
            best.tier = keep ? keep : st_calloc((size_t)n, sizeof *best.tier);
            if (!best.tier) {
                st_free(sizes);
                st = st_err(STRATA_ERR_NOMEM, "plan: out of memory for the tiers of %d weight groups", (int)n);
                goto done;
            }
            memcpy(best.tier, cand, (size_t)n * sizeof *cand);
            found = true;
        }
    }
    st_free(sizes);
    if (!found) {
        if (host_short) st = too_small_host(g, p, &k, host_short_need, host_short_gather, host_short_chunk);
        else st = too_small_device(g, p, &k, min_need, min_c);
        goto done;
    }
    {
        st_tier *mine = out->tier;
        memcpy(mine, best.tier, (size_t)n * sizeof *mine);
        st_free(best.tier);
        *out = best;
        out->tier = mine;
        out->device_min = min_need;
        /* what a plan at device_min needs: two staging chunks and the rows */
        out->host_min = 2 * k.chunk + ST_WG_ALIGN + embed_rows_host(g, &k);
    }
done:
    st_free(cand);
    st_free(work);
    if (st != STRATA_OK) st_wplan_free(out);
    return st;
}

void st_wplan_free(st_wplan *p) {
    if (!p) return;
    st_free(p->tier);
    p->tier = NULL;
}

void st_wplan_summary(const st_wplan *p, char *buf, size_t n) {
    char b[7][32], cpu[160] = "", pass[64] = "";
    if (p->pass_tokens > 1)
        snprintf(pass, sizeof pass, ", balanced for passes of %lld tokens", (long long)p->pass_tokens);
    if (p->groups[ST_TIER_CPU])
        snprintf(cpu, sizeof cpu, ", cpu %d groups %s (%lld rows of each on the device%s)", p->groups[ST_TIER_CPU],
                 st_fmt_bytes((double)p->bytes[ST_TIER_CPU], b[6], 32), (long long)p->split_rows, pass);
    snprintf(buf, n,
             "device %d groups %s, host %d groups %s, ssd %d groups %s%s; ring %d x %s; decode %.2f ms/token "
             "predicted (%s bound), %s from SSD per token",
             p->groups[ST_TIER_DEVICE], st_fmt_bytes((double)p->bytes[ST_TIER_DEVICE], b[0], 32),
             p->groups[ST_TIER_HOST], st_fmt_bytes((double)p->bytes[ST_TIER_HOST], b[1], 32), p->groups[ST_TIER_SSD],
             st_fmt_bytes((double)p->bytes[ST_TIER_SSD], b[2], 32), cpu, p->ring_slots,
             st_fmt_bytes((double)p->slot_bytes, b[3], 32), p->t_decode * 1e3, st_wbound_name(p->decode_bound),
             st_fmt_bytes((double)p->step_ssd_img_bytes, b[4], 32));
}

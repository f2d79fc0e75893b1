/* sample: out[i] = a token drawn from row i of logits [n, vocab] with args[i]
 * (backend.h says what; engine/sampler.h steps 2-6). One block of 1024
 * threads per row, no sort, nothing but the row read from global memory:
 *
 *   1. max, first argmax, NaN check (one pass). NaN or all -inf -> -1;
 *      greedy -> the argmax; +inf (not greedy) -> -1.
 *   2. top-k: the k-th largest logit by a radix select over the floats'
 *      ordered bits (4 passes of 8 bits, counting; -0 counts as +0).
 *   3. p_i = expf((x_i - max) / T) in fp32 for the candidates (logit >= the
 *      top-k threshold, not -inf), converted to fixed point
 *      q_i = rint(p_i * 2^s) (s = 63 - bit length of vocab, so that any sum
 *      fits in 64 bits). Every sum below is an integer sum: exact, so the
 *      result does not depend on the order threads add in.
 *   4. top-p: target = ceil(top_p * sum q); a mass-weighted radix select
 *      (4 passes) finds the boundary logit Kp with mass(x > Kp) < target <=
 *      mass(x >= Kp); among the tokens at Kp (equal logits, equal q) the
 *      first c = ceil((target - mass above) / q) in increasing id are kept,
 *      as the host's decreasing-probability walk with ties by id does.
 *   5. min-p: p_i >= min_p (the top token has p = 1).
 *   6. draw: threshold = floor(u * total kept mass); the first kept token in
 *      id order whose cumulative mass exceeds it. Each warp owns a contiguous
 *      range of ids cut into at most 64 groups of tiles; one pass sums each
 *      group (kept mass beside the tokens at Kp, counted apart), a block scan
 *      over the groups (in id order) finds the group, and one warp walks it.
 *
 * Histograms: one of 256 64-bit bins per 4 warps (8 in shared memory). Lanes
 * with the same bin are found with __match_any_sync and their weights summed
 * with __reduce_add_sync (in 21-bit pieces), so one atomic per distinct bin
 * per warp goes to shared memory even when the logits crowd into a few bins.
 * Tiles are 128 ids: lane l reads ids 4l..4l+3 (a float4 when the row is
 * 16-byte aligned). Shared memory: ~35 KB static.
 *
 * Truncated draws first try the candidate fast path (sp_fast, below): steps
 * 2-6 over a list of the largest logits kept in dynamic shared memory, with
 * the same integer arithmetic, so the same token; rows it cannot prove take
 * the full path above (as do all rows when the device lacks the shared memory). */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define SP_THREADS 1024
#define SP_WARPS (SP_THREADS / 32)
#define SP_TILE 128
#define SP_GROUPS_PER_WARP 64
#define SP_GROUPS (SP_WARPS * SP_GROUPS_PER_WARP)
#define SP_HSUB 8
#define SP_NOBIN 256u

typedef unsigned long long sp_u64;

/* What a row's pass reads: the row, and this warp's tiles [tile0, tile1). */
struct sp_row {
    const float *x;
    int64_t V;
    bool vec;
    int64_t tile0, tile1;
};

/* The row's sampling state once known (the same in every thread). */
struct sp_prob {
    float m;     /* the largest logit */
    float T;     /* temperature > 0 */
    float scale; /* 2^s */
    float tau;   /* top-k threshold (-inf: off) */
    float min_p;
};

struct sp_shared {
    sp_u64 buf[SP_HSUB * 256]; /* histograms (select) / tie counts per group (draw) */
    sp_u64 gmass[SP_GROUPS];   /* kept mass per group (draw) */
    sp_u64 tot[256];           /* a level's histogram summed over the sub-histograms */
    sp_u64 red[SP_WARPS];      /* block reductions / scans */
    float rv[SP_WARPS];
    int32_t ri[SP_WARPS];
    int rnan[SP_WARPS];
    uint32_t bin;
    sp_u64 above;
    int64_t gsel;              /* the draw's group */
    sp_u64 resid;              /* threshold left inside that group */
    sp_u64 tie_off;            /* tokens at Kp before that group */
    int32_t out;
    int fB;                    /* fast path: buckets kept */
    uint32_t kmin;             /* fast path: the smallest key among the candidates */
};

/* float -> uint32 with the same order; -0 maps as +0 (equal floats, equal keys) */
ST_DEV uint32_t sp_key(float f) {
    const uint32_t b = f == 0.0f ? 0u : __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
ST_DEV float sp_value(uint32_t k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

ST_DEV bool sp_cand(const sp_prob &p, float x) { return x != -INFINITY && x >= p.tau; }
ST_DEV float sp_p(const sp_prob &p, float x) { return expf(__fdiv_rn(__fsub_rn(x, p.m), p.T)); }
ST_DEV sp_u64 sp_q(const sp_prob &p, float pf) { return __float2ull_rn(__fmul_rn(pf, p.scale)); }

/* Tile t's elements 4 lane .. 4 lane + 3 into v; returns how many exist. */
ST_DEV int sp_load(const sp_row &r, int64_t t, int lane, float v[4]) {
    const int64_t i0 = t * SP_TILE + 4 * lane;
    const int64_t left = r.V - i0;
    const int nv = left <= 0 ? 0 : left >= 4 ? 4 : (int)left;
    if (r.vec && nv == 4) {
        const float4 q = __ldg((const float4 *)(r.x + i0));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = e < nv ? __ldg(r.x + i0 + e) : 0.0f;
    }
    return nv;
}

ST_DEV sp_u64 sp_warp_sum(sp_u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block; every thread gets it. Synchronizes. */
ST_DEV sp_u64 sp_block_sum(sp_u64 v, sp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = sp_warp_sum(v);
    __syncthreads(); /* sh.red may still be read by a previous call */
    if (lane == 0) sh.red[warp] = v;
    __syncthreads();
    v = lane < SP_WARPS ? sh.red[lane] : 0;
    return sp_warp_sum(v);
}

/* In-place exclusive scan of a[0..n) (n <= SP_THREADS * k for any k: each
 * thread takes a contiguous run); returns the total. Synchronizes. */
ST_DEV sp_u64 sp_block_scan(sp_u64 *a, int n, sp_shared &sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = (n + SP_THREADS - 1) / SP_THREADS;
    const int i0 = min(n, (int)threadIdx.x * per), i1 = min(n, i0 + per);
    __syncthreads(); /* a complete */
    sp_u64 loc = 0;
    for (int i = i0; i < i1; i++) loc += a[i];
    sp_u64 incl = loc;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const sp_u64 y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads(); /* sh.red free */
    if (lane == 31) sh.red[warp] = incl;
    __syncthreads();
    sp_u64 wbase = 0, total = 0;
    for (int w = 0; w < SP_WARPS; w++) {
        const sp_u64 s = sh.red[w];
        if (w < warp) wbase += s;
        total += s;
    }
    sp_u64 run = wbase + incl - loc;
    for (int i = i0; i < i1; i++) {
        const sp_u64 x = a[i];
        a[i] = run;
        run += x;
    }
    __syncthreads(); /* a scanned */
    return total;
}

/* Radix select, descending: the key K with W(key > K) < target <= W(key >= K)
 * where W sums, over the row's tokens, 1 each (MASS false: every token) or
 * q_i (MASS true: the candidates). Needs 1 <= target <= the total weight.
 * *above = W(key > K). Synchronizes. */
template <bool MASS>
ST_DEV void sp_select(const sp_row &r, const sp_prob &p, sp_u64 target, sp_shared &sh, uint32_t *K,
                      sp_u64 *above_out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    sp_u64 *h = sh.buf + (warp & (SP_HSUB - 1)) * 256;
    uint32_t prefix = 0;
    sp_u64 above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        __syncthreads(); /* the previous level's sh.bin / sh.tot reads are done */
        for (int i = threadIdx.x; i < SP_HSUB * 256; i += SP_THREADS) sh.buf[i] = 0;
        __syncthreads();
        for (int64_t t = r.tile0; t < r.tile1; t++) {
            float v[4];
            const int nv = sp_load(r, t, lane, v);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const uint32_t key = sp_key(v[e]);
                uint32_t bin = SP_NOBIN;
                sp_u64 w = 0;
                if (e < nv && (key & hi_mask) == (prefix & hi_mask)) {
                    if (!MASS) {
                        bin = (key >> shift) & 255u;
                    } else if (sp_cand(p, v[e])) {
                        w = sp_q(p, sp_p(p, v[e]));
                        if (w) bin = (key >> shift) & 255u;
                    }
                }
                const unsigned peers = __match_any_sync(0xffffffffu, bin);
                sp_u64 sum;
                if (!MASS) {
                    sum = (sp_u64)__popc(peers);
                } else { /* each piece summed over <= 32 lanes stays below 2^26 */
                    const unsigned m21 = (1u << 21) - 1;
                    const unsigned s0 = __reduce_add_sync(peers, (unsigned)(w & m21));
                    const unsigned s1 = __reduce_add_sync(peers, (unsigned)((w >> 21) & m21));
                    const unsigned s2 = __reduce_add_sync(peers, (unsigned)(w >> 42));
                    sum = (sp_u64)s0 + ((sp_u64)s1 << 21) + ((sp_u64)s2 << 42);
                }
                if (bin != SP_NOBIN && lane == __ffs(peers) - 1) atomicAdd(&h[bin], sum);
            }
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            sp_u64 s = 0;
            for (int j = 0; j < SP_HSUB; j++) s += sh.buf[j * 256 + threadIdx.x];
            sh.tot[threadIdx.x] = s;
        }
        __syncthreads();
        if (warp == 0) { /* lane l: bins 255 - 8l down to 248 - 8l */
            if (lane == 0) sh.bin = 0, sh.above = above;
            __syncwarp();
            sp_u64 loc[8], lsum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) loc[j] = sh.tot[255 - 8 * lane - j], lsum += loc[j];
            sp_u64 incl = lsum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const sp_u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const sp_u64 excl = incl - lsum, need = target - above;
            if (excl < need && need <= incl) {
                sp_u64 acc = excl;
                for (int j = 0; j < 8; j++) {
                    if (acc + loc[j] >= need) {
                        sh.bin = (uint32_t)(255 - 8 * lane - j);
                        sh.above = above + acc;
                        break;
                    }
                    acc += loc[j];
                }
            }
        }
        __syncthreads();
        prefix |= sh.bin << shift;
        above = sh.above;
    }
    *K = prefix;
    *above_out = above;
}

/* Which tokens the draw keeps: top-k / top-p / min-p as known. Tokens at the
 * top-p boundary (key == Kp) are counted apart: the first c_keep of them in id
 * order are kept, each of mass q_tie. */
struct sp_keep {
    bool topp;
    uint32_t Kp;
    sp_u64 c_keep, q_tie;
};

/* Token x's mass when kept and not at the boundary, and whether it is at the
 * boundary. */
ST_DEV sp_u64 sp_mass(const sp_prob &p, const sp_keep &k, float x, bool *tie) {
    *tie = false;
    if (!sp_cand(p, x)) return 0;
    if (k.topp) {
        const uint32_t key = sp_key(x);
        if (key < k.Kp) return 0;
        if (key == k.Kp) {
            *tie = true;
            return 0;
        }
    }
    const float pf = sp_p(p, x);
    return pf >= p.min_p ? sp_q(p, pf) : 0;
}


/* ---- the candidate fast path ----
 * Every kept token of a truncated draw (top-k, top-p or min-p) lies among the
 * largest logits. With d = -(x - m) / T in sp_p's arithmetic (so p = expf(-d)),
 *   pass 2 (whole row): a histogram per warp of floor(16 d) for d < 16, and
 *           (top-p without top-k) the exact fixed-point total over the row;
 *   from it a bucket count B is chosen so that the tokens with
 *           floor(16 d) < B (an upper set of keys: d is monotone in x) hold
 *           the top k, or enough mass for top-p, or every token with
 *           p >= min_p (B/16 >= -ln min_p + 1/8: expf's error cannot cross);
 *   pass 3 (whole row): their ids, in id order (each warp writes its own
 *           range, whose size the histogram gave), into shared memory.
 * Then the same selects as the full path but over the list (radix digits of
 * up to 11 bits, starting below the candidates' common key prefix), checked
 * exactly: at least k candidates, candidate mass >= the top-p target. A row
 * that fails (flat logits, too many candidates) runs the full path. Since the
 * candidates are every token with key >= their smallest key, each count or
 * mass above any key >= that key is the same as over the row, so K, Kp, the
 * ties and the draw come out identical to the full path. */
#define SP_NB 256 /* buckets of 16 d over [0, 256) */
#define SP_E16 0.93941306281347581 /* exp(-1/16): a bucket's smallest p over its largest */

/* floor(16 d) for d = -sfx < 16, else SP_NB (sfx = (x - m) / T <= 0 as sp_p computes it) */
ST_DEV int sp_bucket(float sfx) {
    const float d = -sfx;
    return d < 16.0f ? __float2int_rz(__fmul_rn(d, 16.0f)) : SP_NB;
}
ST_DEV float sp_sfx(const sp_prob &p, float x) { return __fdiv_rn(__fsub_rn(x, p.m), p.T); }

/* Exclusive prefix of one value per thread over the block in thread order;
 * *total = the sum. Synchronizes. */
ST_DEV sp_u64 sp_block_excl(sp_u64 v, sp_shared &sh, sp_u64 *total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    sp_u64 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const sp_u64 y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads(); /* sh.red may still be read by a previous call */
    if (lane == 31) sh.red[warp] = incl;
    __syncthreads();
    sp_u64 wbase = 0, tot = 0;
    for (int w = 0; w < SP_WARPS; w++) {
        const sp_u64 s = sh.red[w];
        if (w < warp) wbase += s;
        tot += s;
    }
    *total = tot;
    return wbase + incl - v;
}

/* sp_select over the candidate list ids[0..n_c) (keys in [kmin, kmax]):
 * the same K and *above when the list holds every token with key >= kmin
 * and its weight reaches target. One histogram of up to 2048 bins (sh.buf). */
template <bool MASS>
static __device__ __noinline__ void sp_select_list(const float *__restrict__ x, const int32_t *ids, int n_c, const sp_prob &p,
                           sp_u64 target, uint32_t kmax, uint32_t kmin, sp_shared &sh, uint32_t *K,
                           sp_u64 *above_out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int top = 32 - __clz((int)(kmax ^ kmin)); /* bits below the common prefix */
    uint32_t prefix = kmax & (top >= 32 ? 0u : ~((1u << top) - 1u));
    sp_u64 above = 0;
    while (top > 0) {
        const int width = min(11, top), shift = top - width;
        const int nb = 1 << width, per = (nb + 31) / 32;
        const uint32_t hi_mask = top >= 32 ? 0u : ~0u << top;
        __syncthreads(); /* the previous level's sh.bin / sh.buf reads are done */
        for (int i = threadIdx.x; i < nb; i += SP_THREADS) sh.buf[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n_c; i += SP_THREADS) {
            const float v = __ldg(x + ids[i]);
            const uint32_t key = sp_key(v);
            if ((key & hi_mask) != (prefix & hi_mask)) continue;
            sp_u64 w = 1;
            if (MASS) {
                if (!sp_cand(p, v)) continue;
                w = sp_q(p, sp_p(p, v));
                if (!w) continue;
            }
            atomicAdd(&sh.buf[(key >> shift) & (uint32_t)(nb - 1)], w);
        }
        __syncthreads();
        if (warp == 0) { /* lane l: bins nb - 1 - per l down to nb - per (l + 1) */
            if (lane == 0) sh.bin = 0, sh.above = above;
            __syncwarp();
            sp_u64 lsum = 0;
            for (int j = 0; j < per; j++) {
                const int idx = lane * per + j;
                if (idx < nb) lsum += sh.buf[nb - 1 - idx];
            }
            sp_u64 incl = lsum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const sp_u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const sp_u64 excl = incl - lsum, need = target - above;
            if (excl < need && need <= incl) {
                sp_u64 acc = excl;
                for (int j = 0; j < per; j++) {
                    const int idx = lane * per + j;
                    if (idx >= nb) break;
                    const sp_u64 c = sh.buf[nb - 1 - idx];
                    if (acc + c >= need) {
                        sh.bin = (uint32_t)(nb - 1 - idx);
                        sh.above = above + acc;
                        break;
                    }
                    acc += c;
                }
            }
        }
        __syncthreads();
        prefix |= sh.bin << shift;
        above = sh.above;
        top = shift;
    }
    *K = prefix;
    *above_out = above;
}

/* The fast path for one row (block-uniform). Returns false, having written
 * nothing, when the row must take the full path (p.tau may have changed:
 * the caller resets it); true once out_row is written. */
static __device__ __noinline__ bool sp_fast(const sp_row &r, sp_prob &p, int64_t top_k, bool topp, float top_p, double u, int32_t bi,
                    uint32_t *dyn, int cap, sp_shared &sh, int32_t *out_row) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (!isfinite(p.T)) return false; /* T = inf: (x - m) / T may be NaN, whose bucket means nothing */
    int Bminp = 0;
    if (top_k == 0 && !topp) { /* min-p alone: every token with p >= min_p */
        const double L = -log((double)p.min_p);
        if (!(L < 15.8)) return false;
        Bminp = (int)ceil(16.0 * L) + 2; /* <= 256 */
    }
    /* pass 2: histograms of 16 d per warp; the row's total (top-p, no top-k) */
    uint32_t *wh = dyn + warp * SP_NB;
    for (int i = lane; i < SP_NB; i += 32) wh[i] = 0;
    __syncwarp();
    const bool need_total = topp && top_k == 0;
    sp_u64 s = 0;
    for (int64_t t = r.tile0; t < r.tile1; t++) {
        float v[4];
        const int nv = sp_load(r, t, lane, v);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (e >= nv || v[e] == -INFINITY) continue;
            const float sfx = sp_sfx(p, v[e]);
            if (need_total) s += sp_q(p, expf(sfx)); /* = sp_q(p, sp_p(p, v[e])) */
            const int b = sp_bucket(sfx);
            if (b < SP_NB) atomicAdd(&wh[b], 1u);
        }
    }
    const sp_u64 total_all = sp_block_sum(s, sh); /* synchronizes: the histograms are complete */
    if (threadIdx.x < SP_NB) {
        sp_u64 c = 0;
        for (int w = 0; w < SP_WARPS; w++) c += dyn[w * SP_NB + threadIdx.x];
        sh.tot[threadIdx.x] = c;
    }
    __syncthreads();
    /* B: the fewest buckets that hold what the draw may keep (estimates; checked exactly below) */
    if (warp == 0) {
        sp_u64 lc = 0, call = 0;
        double lo = 0.0, hi = 0.0;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * lane + j;
            const double cj = (double)sh.tot[b], eb = exp(-(double)b / 16.0);
            lc += sh.tot[b];
            lo += cj * eb * SP_E16;
            hi += cj * eb;
        }
        sp_u64 cin = lc;
        double lin = lo;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const sp_u64 y = __shfl_up_sync(0xffffffffu, cin, o);
            const double z = __shfl_up_sync(0xffffffffu, lin, o);
            if (lane >= o) cin += y, lin += z;
        }
        call = __shfl_sync(0xffffffffu, cin, 31);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) hi += __shfl_xor_sync(0xffffffffu, hi, o);
        const double rest = r.V > (int64_t)call ? (double)(r.V - (int64_t)call) : 0.0;
        const double need = (double)top_p * (hi + rest * exp(-16.0)) * (1.0 + 1e-3);
        sp_u64 c = cin - lc;
        double m = lin - lo;
        int found = SP_NB + 1;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * lane + j;
            c += sh.tot[b];
            m += (double)sh.tot[b] * exp(-(double)b / 16.0) * SP_E16;
            const bool ok = top_k > 0 ? c >= (sp_u64)top_k : topp ? m >= need : b + 1 >= Bminp;
            if (ok) {
                found = b + 1;
                break;
            }
        }
        const unsigned any = __ballot_sync(0xffffffffu, found <= SP_NB);
        int B = __shfl_sync(0xffffffffu, found, any ? __ffs(any) - 1 : 0);
        if (!any) B = top_k == 0 && topp ? SP_NB : 0; /* top-p: try every bucket */
        if (lane == 0) sh.fB = B, sh.kmin = 0xffffffffu;
    }
    __syncthreads();
    const int B = sh.fB;
    sp_u64 cw = 0;
    for (int b = lane; b < B; b += 32) cw += wh[b];
    cw = sp_warp_sum(cw);
    sp_u64 n_c64;
    const sp_u64 seg = __shfl_sync(0xffffffffu, sp_block_excl(lane == 0 ? cw : 0, sh, &n_c64), 0);
    if (B == 0 || n_c64 == 0 || n_c64 > (sp_u64)cap || (top_k > 0 && n_c64 < (sp_u64)top_k)) return false;
    __syncthreads(); /* every histogram read is done: ids overwrite them */

    /* pass 3: the candidates' ids, in id order */
    int32_t *ids = (int32_t *)dyn;
    const int n_c = (int)n_c64;
    sp_u64 pos = seg;
    const sp_u64 end = seg + cw;
    uint32_t kmin = 0xffffffffu;
    for (int64_t t = r.tile0; t < r.tile1; t++) {
        float v[4];
        const int nv = sp_load(r, t, lane, v);
        unsigned f = 0, nf = 0;
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (e < nv && v[e] != -INFINITY && sp_bucket(sp_sfx(p, v[e])) < B) {
                f |= 1u << e, nf++;
                kmin = min(kmin, sp_key(v[e]));
            }
        unsigned incl = nf;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        sp_u64 idx = pos + (incl - nf);
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (f & (1u << e)) {
                if (idx < end) ids[idx] = (int32_t)(t * SP_TILE + 4 * lane + e);
                idx++;
            }
        pos += __shfl_sync(0xffffffffu, incl, 31);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, o));
    if (lane == 0) atomicMin(&sh.kmin, kmin);
    __syncthreads();
    const uint32_t kmax = sp_key(p.m), kmn = sh.kmin;

    /* top-k threshold */
    if (top_k > 0) {
        uint32_t K;
        sp_u64 above;
        sp_select_list<false>(r.x, ids, n_c, p, (sp_u64)top_k, kmax, kmn, sh, &K, &above);
        p.tau = sp_value(K);
    }
    /* top-p boundary */
    sp_keep k;
    k.topp = false;
    k.Kp = 0;
    k.c_keep = 0;
    k.q_tie = 0;
    if (topp) {
        sp_u64 wc = 0;
        for (int i = threadIdx.x; i < n_c; i += SP_THREADS) {
            const float v = __ldg(r.x + ids[i]);
            if (sp_cand(p, v)) wc += sp_q(p, sp_p(p, v));
        }
        wc = sp_block_sum(wc, sh);
        const sp_u64 total = top_k > 0 ? wc : total_all; /* top-k: every candidate is listed */
        double tq = ceil((double)top_p * (double)total);
        sp_u64 target = tq < 1.0 ? 1 : tq >= (double)total ? total : (sp_u64)tq;
        if (wc < target) return false; /* the list does not reach the boundary */
        uint32_t K;
        sp_u64 above;
        sp_select_list<true>(r.x, ids, n_c, p, target, kmax, kmn, sh, &K, &above);
        k.topp = true;
        k.Kp = K;
        const float pt = sp_p(p, sp_value(K));
        k.q_tie = sp_q(p, pt);
        k.c_keep = k.q_tie > 0 && target > above ? (target - above + k.q_tie - 1) / k.q_tie : 1;
        if (!(pt >= p.min_p)) k.c_keep = 0;
    }

    /* the draw over the list: contiguous runs per thread, in id order */
    const int per = (n_c + SP_THREADS - 1) / SP_THREADS;
    const int i0 = min(n_c, (int)threadIdx.x * per), i1 = min(n_c, i0 + per);
    sp_u64 nt = 0;
    for (int i = i0; i < i1; i++) {
        bool tie;
        (void)sp_mass(p, k, __ldg(r.x + ids[i]), &tie);
        nt += tie;
    }
    sp_u64 n_ties;
    const sp_u64 rank0 = sp_block_excl(nt, sh, &n_ties);
    sp_u64 ms = 0, rank = rank0;
    for (int i = i0; i < i1; i++) {
        bool tie;
        sp_u64 m = sp_mass(p, k, __ldg(r.x + ids[i]), &tie);
        if (tie) m = rank++ < k.c_keep ? k.q_tie : 0;
        ms += m;
    }
    sp_u64 total;
    const sp_u64 base = sp_block_excl(ms, sh, &total);
    if (threadIdx.x == 0) sh.out = bi;
    __syncthreads();
    if (total > 0) {
        sp_u64 thr = (sp_u64)floor(u * (double)total);
        if (thr >= total) thr = total - 1;
        if (base <= thr && thr < base + ms) {
            sp_u64 run = base;
            rank = rank0;
            for (int i = i0; i < i1; i++) {
                bool tie;
                const int32_t id = ids[i];
                sp_u64 m = sp_mass(p, k, __ldg(r.x + id), &tie);
                if (tie) m = rank++ < k.c_keep ? k.q_tie : 0;
                if (run + m > thr) {
                    sh.out = id;
                    break;
                }
                run += m;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *out_row = sh.out;
    return true;
}

static __global__ void __launch_bounds__(SP_THREADS) sample_kernel(const float *__restrict__ logits, int64_t V,
                                                                   bool vec, float scale, int cap,
                                                                   const st_sample_args *__restrict__ args,
                                                                   int32_t *__restrict__ out) {
    __shared__ sp_shared sh;
    extern __shared__ __align__(16) uint32_t sp_dyn[]; /* cap ids (fast path); 0: the full path only */
    st_pdl_wait();
    st_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row = blockIdx.x;
    const int64_t n_tiles = (V + SP_TILE - 1) / SP_TILE;
    const int64_t tpw = (n_tiles + SP_WARPS - 1) / SP_WARPS;        /* tiles per warp */
    const int64_t tpg = (tpw + SP_GROUPS_PER_WARP - 1) / SP_GROUPS_PER_WARP; /* tiles per group */
    const int ng = (int)((tpw + tpg - 1) / tpg);                     /* groups per warp, <= 64 */
    sp_row r;
    r.x = logits + row * V;
    r.V = V;
    r.vec = vec;
    r.tile0 = min(n_tiles, warp * tpw);
    r.tile1 = min(n_tiles, r.tile0 + tpw);

    /* args, clamped to their ranges */
    const st_sample_args a = args[row];
    const bool greedy = !(a.temperature > 0.0f);
    const int64_t top_k = a.top_k > 0 && a.top_k < V ? a.top_k : 0;
    const bool topp = a.top_p < 1.0f; /* NaN: off */
    const float top_p = a.top_p > 0.0f ? a.top_p : 0.0f;
    const float min_p = a.min_p > 0.0f ? fminf(a.min_p, 1.0f) : 0.0f;
    const double u = a.u > 0.0 ? fmin(a.u, 1.0) : 0.0;

    /* 1: max, first argmax, NaN */
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    int nan = 0;
    for (int64_t t = r.tile0; t < r.tile1; t++) {
        float v[4];
        const int nv = sp_load(r, t, lane, v);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int32_t id = (int32_t)(t * SP_TILE + 4 * lane + e);
            if (e >= nv) break;
            if (isnan(v[e])) nan = 1;
            else if (v[e] > bv || (v[e] == bv && id < bi)) bv = v[e], bi = id;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if (lane == 0) sh.rv[warp] = bv, sh.ri[warp] = bi, sh.rnan[warp] = nan;
    __syncthreads();
    bv = sh.rv[0], bi = sh.ri[0], nan = sh.rnan[0];
    for (int w = 1; w < SP_WARPS; w++) {
        nan |= sh.rnan[w];
        if (sh.rv[w] > bv || (sh.rv[w] == bv && sh.ri[w] < bi)) bv = sh.rv[w], bi = sh.ri[w];
    }
    /* (uniform from here: every thread reduced the same values) */
    if (nan || bv == -INFINITY || (!greedy && bv == INFINITY)) {
        if (threadIdx.x == 0) out[row] = -1;
        return;
    }
    if (greedy) {
        if (threadIdx.x == 0) out[row] = bi;
        return;
    }
    sp_prob p;
    p.m = bv;
    p.T = a.temperature;
    p.scale = scale;
    p.tau = -INFINITY;
    p.min_p = min_p;

    if (cap >= SP_WARPS * SP_NB && (top_k > 0 || topp || min_p > 0.0f)) {
        if (sp_fast(r, p, top_k, topp, top_p, u, bi, sp_dyn, cap, sh, out + row)) return;
        p.tau = -INFINITY; /* the full path from the start */
    }

    /* 2: top-k threshold */
    if (top_k > 0) {
        uint32_t K;
        sp_u64 above;
        sp_select<false>(r, p, (sp_u64)top_k, sh, &K, &above);
        p.tau = sp_value(K);
    }

    /* 3-4: top-p boundary */
    sp_keep k;
    k.topp = false;
    k.Kp = 0;
    k.c_keep = 0;
    k.q_tie = 0;
    if (topp) {
        sp_u64 s = 0;
        for (int64_t t = r.tile0; t < r.tile1; t++) {
            float v[4];
            const int nv = sp_load(r, t, lane, v);
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (e < nv && sp_cand(p, v[e])) s += sp_q(p, sp_p(p, v[e]));
        }
        const sp_u64 total = sp_block_sum(s, sh);
        double tq = ceil((double)top_p * (double)total);
        sp_u64 target = tq < 1.0 ? 1 : tq >= (double)total ? total : (sp_u64)tq;
        uint32_t K;
        sp_u64 above;
        sp_select<true>(r, p, target, sh, &K, &above);
        k.topp = true;
        k.Kp = K;
        const float pt = sp_p(p, sp_value(K));
        k.q_tie = sp_q(p, pt);
        /* target > above and q_tie > 0 by the select; min-p removes all of the
         * boundary's tokens or none (equal logits) */
        k.c_keep = k.q_tie > 0 && target > above ? (target - above + k.q_tie - 1) / k.q_tie : 1;
        if (!(pt >= p.min_p)) k.c_keep = 0;
    }

    /* 6: the draw. Pass over the groups: kept mass apart from the boundary's
     * tokens, and the number of those. */
    sp_u64 *gties = sh.buf; /* the histograms are done */
    __syncthreads();
    for (int g = 0; g < ng; g++) {
        const int64_t g0 = min(r.tile1, r.tile0 + g * tpg), g1 = min(r.tile1, g0 + tpg);
        sp_u64 ms = 0, ts = 0;
        for (int64_t t = g0; t < g1; t++) {
            float v[4];
            const int nv = sp_load(r, t, lane, v);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (e >= nv) break;
                bool tie;
                ms += sp_mass(p, k, v[e], &tie);
                ts += tie;
            }
        }
        ms = sp_warp_sum(ms);
        ts = sp_warp_sum(ts);
        if (lane == 0) sh.gmass[warp * ng + g] = ms, gties[warp * ng + g] = ts;
    }
    const int G = SP_WARPS * ng; /* groups in id order: warp-major */
    const sp_u64 n_ties = sp_block_scan(gties, G, sh);
    for (int g = threadIdx.x; g < G; g += SP_THREADS) {
        const sp_u64 off = gties[g], cnt = (g + 1 < G ? gties[g + 1] : n_ties) - off;
        const sp_u64 kept = k.c_keep > off ? min(k.c_keep - off, cnt) : 0;
        sh.gmass[g] += kept * k.q_tie;
    }
    const sp_u64 total = sp_block_scan(sh.gmass, G, sh);
    sp_u64 thr = (sp_u64)floor(u * (double)total);
    if (thr >= total) thr = total - 1; /* total >= q(top token) > 0 */
    if (threadIdx.x == 0) sh.gsel = -1, sh.out = bi;
    __syncthreads();
    for (int g = threadIdx.x; g < G; g += SP_THREADS) {
        const sp_u64 off = sh.gmass[g], end = g + 1 < G ? sh.gmass[g + 1] : total;
        if (off <= thr && thr < end) sh.gsel = g, sh.resid = thr - off, sh.tie_off = gties[g];
    }
    __syncthreads();
    /* walk the group (warp 0): per tile, a warp scan of masses in id order */
    if (warp == 0 && sh.gsel >= 0) {
        const int gw = (int)(sh.gsel / ng), gg = (int)(sh.gsel % ng);
        const int64_t w0 = min(n_tiles, gw * tpw), w1 = min(n_tiles, w0 + tpw);
        const int64_t g0 = min(w1, w0 + gg * tpg), g1 = min(w1, g0 + tpg);
        const sp_u64 resid = sh.resid;
        sp_u64 run = 0, tie_run = sh.tie_off;
        for (int64_t t = g0; t < g1; t++) {
            float v[4];
            const int nv = sp_load(r, t, lane, v);
            sp_u64 m[4] = {0, 0, 0, 0};
            bool tie[4] = {false, false, false, false};
            unsigned lt = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (e < nv) m[e] = sp_mass(p, k, v[e], &tie[e]);
                lt += tie[e];
            }
            unsigned ltin = lt; /* ties of this tile up to this lane, inclusive */
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned y = __shfl_up_sync(0xffffffffu, ltin, o);
                if (lane >= o) ltin += y;
            }
            sp_u64 rank = tie_run + (ltin - lt), lm = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (tie[e]) m[e] = rank++ < k.c_keep ? k.q_tie : 0;
                lm += m[e];
            }
            sp_u64 incl = lm;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const sp_u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            const sp_u64 tile_mass = __shfl_sync(0xffffffffu, incl, 31);
            const unsigned tile_ties = __shfl_sync(0xffffffffu, ltin, 31);
            if (run + tile_mass > resid) {
                sp_u64 cum = run + incl - lm;
                if (cum <= resid && resid < run + incl) {
                    int hit = 3;
#pragma unroll
                    for (int e = 3; e >= 0; e--) /* the first e whose cumulative mass passes resid */
                        if (cum + m[0] + (e > 0 ? m[1] : 0) + (e > 1 ? m[2] : 0) + (e > 2 ? m[3] : 0) > resid) hit = e;
                    sh.out = (int32_t)(t * SP_TILE + 4 * lane + hit);
                }
                break; /* uniform: tile_mass is the same in every lane */
            }
            run += tile_mass;
            tie_run += tile_ties;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) out[row] = sh.out;
}

strata_status st_cuda_op_sample(st_backend *be, st_cuda_stream *s, const float *logits, int64_t n, int64_t vocab,
                                const st_sample_args *args, int32_t *out) {
    if (n > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda sample: n = %lld rows is too many", (long long)n);
    int bits = 0;
    while (bits < 63 && ((int64_t)1 << bits) <= vocab) bits++; /* vocab < 2^bits */
    const float scale = ldexpf(1.0f, 63 - bits);
    const bool vec = vocab % 4 == 0 && st_cuda_aligned(logits, 16);
    const st_cuda *c = st_cuda_of(be);
    size_t dyn = c->sample_smem;
    if (n > c->sm_count && dyn > 64 * 1024) dyn = 64 * 1024; /* more rows than SMs: two blocks per SM */
    if (dyn < SP_WARPS * SP_NB * sizeof(uint32_t)) dyn = 0;
    const int cap = (int)(dyn / sizeof(int32_t));
    ST_CUDA_TRY(st_launch(c->pdl, sample_kernel, dim3((unsigned)n), dim3(SP_THREADS), dyn, s->s, logits, vocab, vec,
                          scale, cap, args, out));
    return STRATA_OK;
}

strata_status st_cuda_sample_setup(st_cuda *c) {
    c->sample_smem = 0;
    cudaFuncAttributes fa;
    ST_CUDA_TRY(cudaFuncGetAttributes(&fa, sample_kernel));
    size_t dyn = c->smem_optin > fa.sharedSizeBytes ? (c->smem_optin - fa.sharedSizeBytes) & ~(size_t)15 : 0;
    if (dyn < SP_WARPS * SP_NB * sizeof(uint32_t)) return STRATA_OK; /* the full path only */
    ST_CUDA_TRY(cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
    c->sample_smem = dyn;
    return STRATA_OK;
}

/* attention: causal grouped-query attention of one sequence (backend.h):
 * q [n, H, hd], k/v [n_kv, Hkv, hd] fp32; query i sees keys 0..pos[i];
 * head h reads kv head h / (H / Hkv); out [n, H, hd] = softmax(q k^T scale) v.
 * attention_part: the same over one piece of the sequence's keys (k/v hold
 * keys key0 .. key0 + n_kv - 1; query i sees key0 .. min(pos[i], key0 +
 * n_kv - 1)), giving also each row's natural-log log-sum-exp, or merging
 * the piece's result into a running (out, lse) (backend.h's rule).
 *
 * A block works on rows of one kv head: row r of kv head g is the pair
 * (token r / G, head g G + r % G) with G = H / Hkv, so the K/V tiles it loads
 * serve the G query heads that share them. Every kernel keeps an online
 * softmax per row (running max m, sum l, unnormalized accumulator; scores are
 * pre-scaled by scale * log2(e) and exponentiated with exp2): no n x n_kv
 * matrix exists anywhere. The KV range can be split over blocks (grid.z or
 * grid.x); each split then writes (acc, m, l) per row to scratch and a second
 * kernel merges the splits: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
 *
 * Kernels, chosen per call:
 *   decode (n * G <= 16 rows, hd 64 or 128): fp32 SIMT, exact to fp32
 *     rounding. 128 threads; tiles of 32 keys double-buffered in shared
 *     memory by cp.async; lane j scores key j against the rows of its warp,
 *     the warp does the softmax update of its rows, then thread d accumulates
 *     column d of every row.
 *     The KV length is split so that the grid is exactly one wave: the
 *     blocks resident at once (occupancy, measured at init) spread evenly
 *     over the kv heads (memory bound: the whole K/V of the kv head is read
 *     once per split). (The previous sizing, ~3 blocks per SM, made for 8 kv
 *     heads on 132 SMs 400 blocks for 396 places: a second, nearly empty
 *     wave at the end.) The splits are merged by attn_merge_fast_kernel
 *     (loads spread over the block).
 *   prefill (more rows, hd 64 or 128): tensor cores, mma.sync m16n8k16 bf16
 *     with fp32 accumulation (flash-attention style). 64 rows per block (4
 *     warps x 16); softmax statistics and the accumulator stay fp32 in
 *     registers. Default (precise): Q, K, V and the probabilities are each
 *     split into bf16 hi + lo and every product takes three MMAs (error
 *     ~5e-6 against fp32, measured), tiles of 32 keys. Fast mode
 *     (set_fast_prefill): rounded to bf16 once (~1e-3 on the output), tiles
 *     of 64 keys. Split over the KV length when the grid would not fill the
 *     GPU. Measured on an H200 (bench_cuda_ops, 32/8 heads, hd 128, causal):
 *     n = 4096: 53 TFLOP/s precise, 112 fast; n = 16384: 64 and 140.
 *   prefill, fast mode, at least ST_ATTN_FA2_MIN_ROWS rows per kv head:
 *     the FlashAttention-2 style kernel of cuda_attn_prefill_fa2.cu (K/V
 *     rounded to bf16 by a pre-pass, 128 or 256 rows per block, K/V tiles of
 *     64 keys double-buffered by cp.async, ldmatrix fragments, P kept in
 *     registers; configuration: st_backend_params.attn_fa2, auto by default).
 *   prefill, fast mode, the same rows, head dim 128, on compute capability
 *     9.0 (auto, or attn_fa2 "wgmma" / "wgmma-pp"), at least one tile of 128
 *     keys: the Hopper kernel of cuda_attn_prefill_wgmma.cu (K and V^T rounded
 *     to bf16 by a pre-pass, TMA tiles in a 2-stage mbarrier pipeline fed by a
 *     producer warp, two consumer warpgroups of 64 rows running wgmma;
 *     measured 1.4-1.7x the best FA2 configuration on an H100).
 * Split lengths are derived on the device from the rows' positions
 * (split_range), the host choosing only the number of splits from n_kv, an
 * upper bound: a recorded decode step passes the cache's capacity as n_kv
 * and stays valid as the sequence grows.
 *   generic (any other head_dim or unaligned pointers): fp32, one block per
 *     (token, head) row, keys 128 at a time. Slow; for odd shapes only.
 * Keys a row must not see (beyond its position, or beyond n_kv) get -inf;
 * K/V rows beyond the block's range are zero-filled in shared memory, so
 * garbage never reaches the accumulators (0 * NaN).
 *
 * attention_part runs the same kernels with the same launches, sizing and
 * splits (hd 64 / 128, aligned; anything else: STRATA_ERR_UNSUPPORTED, no
 * generic kernel), in instantiations of their own (template flag PART, so
 * that `attention`'s code, registers and speed stay as they were), told
 * through attn_out (cuda_attn_common.cuh):
 *   - positions: every kernel reads a query's position as pos - key0,
 *     clamped to >= 0 (st_attn_qpos), so the piece's keys count from 0 and
 *     a row sees min(pos - key0, n_kv - 1) + 1 of them; no extra launch;
 *   - unsplit grids: the epilogue that normalizes a row also writes its
 *     lse = (m + log2 l) ln 2, or, with merge, reads the row's (out, lse)
 *     and writes out_old a' + acc b' and the merged lse (st_attn_finish:
 *     M = max(lse, lse_p), a = e^(lse - M), b = e^(lse_p - M)): one pass;
 *   - split grids: the splits' partials (acc, m, l in log2 units) are
 *     merged by attn_merge_fast_kernel, which then does the same with the
 *     splits' combined (acc, M, L) (st_attn_merge_row).
 * So a call costs what `attention` over n_kv keys costs; the partials use
 * the same ST_CUDA_SCRATCH_ATTN buffer (no other buffer is live meanwhile,
 * the FA2 kernel's bf16 K/V being ST_CUDA_SCRATCH_ATTN_BF16). In precise
 * mode the results are within fp32 rounding of the CPU's (not bit-equal:
 * the GPU's ranges are its splits and tiles, not ST_ATTN_RANGE). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_attn_common.cuh"
#include "backend/cuda/cuda_attn_prefill_fa2.cuh"
#include "backend/cuda/cuda_attn_prefill_wgmma.cuh"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define LOG2E 1.4426950408889634f

/* ---- split merge --------------------------------------------------------------------- */

/* part_acc [nsplit][rows][HD], part_m/part_l [nsplit][rows]; one block per
 * row, the partials' loads spread over the block (st_attn_merge_row). PART
 * (attention_part): lse (or NULL) [rows] gets each row's log-sum-exp,
 * written or (merge) merged into with out. */
template <int HD, bool PART>
static __global__ void __launch_bounds__(128) attn_merge_fast_kernel(const float *__restrict__ part_acc,
                                                                    const float *__restrict__ part_m,
                                                                    const float *__restrict__ part_l, int nsplit,
                                                                    int64_t rows, float *__restrict__ out,
                                                                    float *__restrict__ lse, bool merge) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t row = blockIdx.x;
    st_attn_merge_row<HD>(part_acc, part_m, part_l, rows, row, nsplit, out + row * HD,
                          PART && lse ? lse + row : nullptr, PART && merge);
}

/* ---- decode: fp32 SIMT --------------------------------------------------------------- */

#define AD_THREADS 128
#define AD_TK 32

template <int HD, int RMAX>
static size_t decode_smem_bytes() {
    return sizeof(float) * ((size_t)RMAX * HD + 2 * ((size_t)AD_TK * (HD + 4) + (size_t)AD_TK * HD) +
                            (size_t)RMAX * AD_TK + 3 * (size_t)RMAX) +
           sizeof(int) * RMAX;
}

/* grid (nsplit, Hkv); rows R = n G <= RMAX. K/V tiles are double-buffered:
 * cp.async brings tile t+1 while tile t is computed. PART: attention_part's
 * instantiation (attn_out: positions from key0, the rows' lse). */
template <int HD, int RMAX, bool PART>
static __global__ void __launch_bounds__(AD_THREADS)
    attn_decode_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                       const int32_t *__restrict__ pos, int n, int64_t n_kv, int H, int Hkv, float qscale,
                       attn_out o) {
    constexpr int KP = HD + 4; /* padded K row: conflict-free float4 reads by key */
    constexpr int RPW = RMAX / 4;          /* rows per warp in the score phase */
    constexpr int CG = 128 / HD;           /* thread groups per column (1 or 2) */
    constexpr int RPT = RMAX / CG;         /* rows per thread in the PV phase */
    constexpr int TILE = AD_TK * KP + AD_TK * HD; /* floats of one K+V buffer */
    extern __shared__ float4 smem4[];
    float *q_s = (float *)smem4;           /* [RMAX][HD] */
    float *kv_s = q_s + RMAX * HD;         /* 2 x ([TK][KP] K, [TK][HD] V) */
    float *p_s = kv_s + 2 * TILE;          /* [RMAX][TK] */
    float *alpha_s = p_s + RMAX * AD_TK;   /* [RMAX] */
    float *m_s = alpha_s + RMAX;
    float *l_s = m_s + RMAX;
    int *pos_s = (int *)(l_s + RMAX);
    st_pdl_wait();
    st_pdl_trigger();

    const int G = H / Hkv, R = n * G;
    const int kvh = blockIdx.y, split = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    for (int i = tid; i < RMAX * HD / 4; i += AD_THREADS) {
        const int r = i / (HD / 4), d4 = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < R) {
            x = __ldg((const float4 *)(q + ((size_t)(r / G) * H + kvh * G + r % G) * HD) + d4);
            x.x *= qscale, x.y *= qscale, x.z *= qscale, x.w *= qscale;
        }
        ((float4 *)q_s)[i] = x;
    }
    if (tid < RMAX) pos_s[tid] = tid < R ? st_attn_qpos<PART>(o, pos, tid / G) : -1;
    __syncthreads();
    int maxpos = -1;
    for (int r = 0; r < R; r++) maxpos = max(maxpos, pos_s[r]);
    int64_t kv_begin, kv_end;
    split_range(n_kv, maxpos, o.nsplit, split, AD_TK, &kv_begin, &kv_end);
    const int ntiles = kv_end > kv_begin ? (int)((kv_end - kv_begin + AD_TK - 1) / AD_TK) : 0;

    /* tile t -> buffer t & 1; keys past kv_end are zero-filled */
    auto stage = [&](int t) {
        float *ks = kv_s + (t & 1) * TILE, *vs = ks + AD_TK * KP;
        const int64_t kb = kv_begin + (int64_t)t * AD_TK;
        for (int i = tid; i < AD_TK * HD / 4; i += AD_THREADS) {
            const int j = i / (HD / 4), d4 = i % (HD / 4);
            const int64_t key = kb + j;
            const bool ok = key < kv_end;
            const size_t off = ok ? ((size_t)key * Hkv + kvh) * HD + 4 * d4 : 0;
            st_cp_async16(ks + j * KP + 4 * d4, k + off, ok);
            st_cp_async16(vs + j * HD + 4 * d4, v + off, ok);
        }
        st_cp_async_commit();
    };

    float m_r[RPW], l_r[RPW];
#pragma unroll
    for (int i = 0; i < RPW; i++) m_r[i] = -INFINITY, l_r[i] = 0.0f;
    const int dcol = tid % HD, rg = tid / HD;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) acc[i] = 0.0f;

    if (ntiles > 0) stage(0);
    for (int t = 0; t < ntiles; t++) {
        if (t + 1 < ntiles) {
            stage(t + 1);
            st_cp_async_wait<1>();
        } else {
            st_cp_async_wait<0>();
        }
        __syncthreads();
        const float *k_s = kv_s + (t & 1) * TILE, *v_s = k_s + AD_TK * KP;
        const int64_t kb = kv_begin + (int64_t)t * AD_TK;
        st_attn_simt_tile<HD, RMAX>(q_s, k_s, v_s, p_s, alpha_s, R, kb,
                                    [=](int r, int64_t key) { return key < kv_end && key <= pos_s[r]; }, m_r, l_r, acc);
        __syncthreads(); /* buffer t & 1 and p_s are free again */
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + 4 * i;
            if (r < R) m_s[r] = m_r[i], l_s[r] = l_r[i];
        }
    }
    __syncthreads();
    const bool fin = PART && o.nsplit == 1 && o.lse; /* attention_part, unsplit: lse (and merge) here */
    if (fin) { /* block-uniform; alpha_s and p_s are free: the rows' weights (st_attn_finish) */
        if (tid < R) {
            const int64_t orow = (int64_t)(tid / G) * H + kvh * G + tid % G;
            const attn_fin f = st_attn_finish(m_s[tid], l_s[tid], o.merge, o.merge ? o.lse[orow] : 0.0f);
            alpha_s[tid] = f.wa, p_s[tid] = f.wb;
            o.lse[orow] = f.lse;
        }
        __syncthreads();
    }
    const int64_t rows = (int64_t)n * H;
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int r = rg + CG * i;
        if (r < R) {
            const int64_t orow = (int64_t)(r / G) * H + kvh * G + r % G;
            if (fin) {
                float *d = o.out + orow * HD + dcol;
                *d = o.merge ? fmaf(*d, alpha_s[r], acc[i] * p_s[r]) : acc[i] * p_s[r];
            } else if (o.nsplit == 1) {
                o.out[orow * HD + dcol] = acc[i] / l_s[r];
            } else {
                o.part_acc[((size_t)split * rows + orow) * HD + dcol] = acc[i];
                if (dcol == 0) {
                    o.part_m[split * rows + orow] = m_s[r];
                    o.part_l[split * rows + orow] = l_s[r];
                }
            }
        }
    }
}

/* ---- prefill: bf16 tensor cores ---------------------------------------------------------- */

#define AP_BQ 64 /* rows per block: 4 warps x 16 (128 rows: 1 block per SM, measured 25% slower) */
#define AP_THREADS (AP_BQ * 2)
#define AP_TK 64

/* fp32 [4] -> bf16 [4] at dst (8-byte aligned). */
ST_DEV void st_bf16x4(__nv_bfloat16 *dst, float4 x) {
    *(uint2 *)dst = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
}

ST_DEV float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/* x = hi + lo as two bf16 [4] (hi = bf16(x), lo = bf16(x - hi)). */
ST_DEV void st_bf16x4_split(__nv_bfloat16 *hi, __nv_bfloat16 *lo, float4 x) {
    const float4 h = make_float4(bf16_round(x.x), bf16_round(x.y), bf16_round(x.z), bf16_round(x.w));
    st_bf16x4(hi, h);
    st_bf16x4(lo, make_float4(__fsub_rn(x.x, h.x), __fsub_rn(x.y, h.y), __fsub_rn(x.z, h.z), __fsub_rn(x.w, h.w)));
}

/* The low bf16 parts of a pair: bf16(a - bf16(a)), bf16(b - bf16(b)). */
ST_DEV uint32_t pack_bf16x2_lo(float a, float b) {
    return pack_bf16x2(__fsub_rn(a, bf16_round(a)), __fsub_rn(b, bf16_round(b)));
}

/* grid (ceil(n G / AP_BQ), Hkv, nsplit); warp w owns rows 16w .. 16w+15.
 * PRECISE: Q, K, V and P are each split into bf16 hi + lo parts and every
 * product is formed as hi*hi + lo*hi + hi*lo (three MMAs for one: the
 * dropped lo*lo term is ~2^-16 of the product), so scores and outputs are
 * within ~1e-5 of fp32 math; tiles of 32 keys so that the four bf16 tiles
 * (K, K lo, V, V lo) fit the same shared memory. Otherwise everything is
 * rounded to bf16 once (~1e-3 relative error), tiles of 64 keys. PART:
 * attention_part's instantiation (attn_out: positions from key0, lse). */
template <int HD, bool PRECISE, bool PART>
static __global__ void __launch_bounds__(AP_THREADS)
    attn_prefill_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                        const int32_t *__restrict__ pos, int n, int64_t n_kv, int H, int Hkv, float qscale,
                        attn_out o) {
    constexpr int LD = HD + 8; /* bf16 per shared row: 16-byte rows, conflict-free fragments */
    constexpr int TK = PRECISE ? AP_TK / 2 : AP_TK;
    constexpr int NT = PRECISE ? 4 : 2; /* tiles: K, V (+ K lo, V lo) */
    __shared__ __align__(16) __nv_bfloat16 kvs[NT * TK * LD]; /* stages Q (hi, lo) first */
    __nv_bfloat16 *ks = kvs, *vs = kvs + TK * LD;
    __nv_bfloat16 *kls = kvs + (PRECISE ? 2 : 0) * TK * LD; /* PRECISE only: K lo, V lo */
    __nv_bfloat16 *vls = kvs + (PRECISE ? 3 : 1) * TK * LD;
    static_assert(AP_BQ * (PRECISE ? 2 : 1) <= NT * TK, "Q staging must fit in the K/V tiles");
    __shared__ int pos_s[AP_BQ];

    const int G = H / Hkv;
    const int64_t RT = (int64_t)n * G;
    const int kvh = blockIdx.y, split = blockIdx.z;
    /* (issuing the last, longest rows first was measured 15% slower at 4K-16K) */
    const int64_t rbase = (int64_t)blockIdx.x * AP_BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;

    __nv_bfloat16 *qls = kvs + AP_BQ * LD; /* Q lo staging (PRECISE) */
    for (int i = tid; i < AP_BQ * HD / 4; i += AP_THREADS) {
        const int r = i / (HD / 4), d4 = i % (HD / 4);
        const int64_t P = rbase + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (P < RT) {
            x = __ldg((const float4 *)(q + ((size_t)(P / G) * H + kvh * G + P % G) * HD) + d4);
            x.x *= qscale, x.y *= qscale, x.z *= qscale, x.w *= qscale;
        }
        if (PRECISE) st_bf16x4_split(ks + r * LD + 4 * d4, qls + r * LD + 4 * d4, x);
        else st_bf16x4(ks + r * LD + 4 * d4, x);
    }
    if (tid < AP_BQ) {
        const int64_t P = rbase + tid;
        pos_s[tid] = P < RT ? st_attn_qpos<PART>(o, pos, P / G) : -1;
    }
    __syncthreads();
    const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    uint32_t qf[HD / 16][4], qfl[PRECISE ? HD / 16 : 1][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        qf[kk][0] = *(const uint32_t *)(ks + r_lo * LD + kk * 16 + 2 * t4);
        qf[kk][1] = *(const uint32_t *)(ks + r_hi * LD + kk * 16 + 2 * t4);
        qf[kk][2] = *(const uint32_t *)(ks + r_lo * LD + kk * 16 + 8 + 2 * t4);
        qf[kk][3] = *(const uint32_t *)(ks + r_hi * LD + kk * 16 + 8 + 2 * t4);
        if (PRECISE) {
            qfl[kk][0] = *(const uint32_t *)(qls + r_lo * LD + kk * 16 + 2 * t4);
            qfl[kk][1] = *(const uint32_t *)(qls + r_hi * LD + kk * 16 + 2 * t4);
            qfl[kk][2] = *(const uint32_t *)(qls + r_lo * LD + kk * 16 + 8 + 2 * t4);
            qfl[kk][3] = *(const uint32_t *)(qls + r_hi * LD + kk * 16 + 8 + 2 * t4);
        }
    }
    const int pos_lo = pos_s[r_lo], pos_hi = pos_s[r_hi];
    int maxpos = -1;
    for (int r = 0; r < AP_BQ; r++) maxpos = max(maxpos, pos_s[r]);
    int64_t kv_begin, kv_end;
    split_range(n_kv, maxpos, o.nsplit, split, TK, &kv_begin, &kv_end);
    /* the last key each row may see, within this block's range */
    const int64_t lim_lo = min((int64_t)pos_lo, kv_end - 1), lim_hi = min((int64_t)pos_hi, kv_end - 1);

    float acc[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

    for (int64_t kb = kv_begin; kb < kv_end; kb += TK) {
        __syncthreads(); /* the previous tile (or Q) is no longer read */
        for (int i = tid; i < TK * HD / 4; i += AP_THREADS) {
            const int j = i / (HD / 4), d4 = i % (HD / 4);
            const int64_t key = kb + j;
            float4 kx = make_float4(0.f, 0.f, 0.f, 0.f), vx = kx;
            if (key < kv_end) {
                const size_t off = ((size_t)key * Hkv + kvh) * HD;
                kx = __ldg((const float4 *)(k + off) + d4);
                vx = __ldg((const float4 *)(v + off) + d4);
            }
            if (PRECISE) {
                st_bf16x4_split(ks + j * LD + 4 * d4, kls + j * LD + 4 * d4, kx);
                st_bf16x4_split(vs + j * LD + 4 * d4, vls + j * LD + 4 * d4, vx);
            } else {
                st_bf16x4(ks + j * LD + 4 * d4, kx);
                st_bf16x4(vs + j * LD + 4 * d4, vx);
            }
        }
        __syncthreads();

        float s[TK / 8][4];
#pragma unroll
        for (int j = 0; j < TK / 8; j++) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const __nv_bfloat16 *kr = ks + (j * 8 + g) * LD + 2 * t4;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
                const uint32_t b0 = *(const uint32_t *)(kr + kk * 16), b1 = *(const uint32_t *)(kr + kk * 16 + 8);
                if (PRECISE) {
                    const __nv_bfloat16 *krl = kls + (j * 8 + g) * LD + 2 * t4;
                    mma_bf16(s[j], qfl[kk], b0, b1);
                    mma_bf16(s[j], qf[kk], *(const uint32_t *)(krl + kk * 16), *(const uint32_t *)(krl + kk * 16 + 8));
                }
                mma_bf16(s[j], qf[kk], b0, b1);
            }
        }
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
        for (int j = 0; j < TK / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int64_t key = kb + j * 8 + 2 * t4 + e;
                if (key > lim_lo) s[j][e] = -INFINITY;
                if (key > lim_hi) s[j][2 + e] = -INFINITY;
                mx_lo = fmaxf(mx_lo, s[j][e]);
                mx_hi = fmaxf(mx_hi, s[j][2 + e]);
            }
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        const float b_lo = mn_lo == -INFINITY ? 0.0f : mn_lo, b_hi = mn_hi == -INFINITY ? 0.0f : mn_hi;
        const float a_lo = exp2f(m_lo - b_lo), a_hi = exp2f(m_hi - b_hi);
        m_lo = mn_lo, m_hi = mn_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < TK / 8; j++) {
            s[j][0] = exp2f(s[j][0] - b_lo);
            s[j][1] = exp2f(s[j][1] - b_lo);
            s[j][2] = exp2f(s[j][2] - b_hi);
            s[j][3] = exp2f(s[j][3] - b_hi);
            sum_lo += s[j][0] + s[j][1];
            sum_hi += s[j][2] + s[j][3];
        }
        l_lo = l_lo * a_lo + sum_lo; /* per-thread partial sums; the quad adds them at the end */
        l_hi = l_hi * a_hi + sum_hi;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            acc[dt][0] *= a_lo, acc[dt][1] *= a_lo;
            acc[dt][2] *= a_hi, acc[dt][3] *= a_hi;
        }
#pragma unroll
        for (int kc = 0; kc < TK / 16; kc++) {
            uint32_t a[4], al[4];
            a[0] = pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            if (PRECISE) {
                al[0] = pack_bf16x2_lo(s[2 * kc][0], s[2 * kc][1]);
                al[1] = pack_bf16x2_lo(s[2 * kc][2], s[2 * kc][3]);
                al[2] = pack_bf16x2_lo(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                al[3] = pack_bf16x2_lo(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            }
            const int mat = lane >> 3, rr = lane & 7;
            const int voff = (kc * 16 + (mat & 1) * 8 + rr) * LD + (mat >> 1) * 8;
#pragma unroll
            for (int d2 = 0; d2 < HD / 16; d2++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, vs + voff + d2 * 16);
                if (PRECISE) {
                    uint32_t bl[4];
                    ldmatrix_x4_trans(bl, vls + voff + d2 * 16);
                    mma_bf16(acc[2 * d2], al, b[0], b[1]);
                    mma_bf16(acc[2 * d2 + 1], al, b[2], b[3]);
                    mma_bf16(acc[2 * d2], a, bl[0], bl[1]);
                    mma_bf16(acc[2 * d2 + 1], a, bl[2], bl[3]);
                }
                mma_bf16(acc[2 * d2], a, b[0], b[1]);
                mma_bf16(acc[2 * d2 + 1], a, b[2], b[3]);
            }
        }
    }
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);

    const int64_t rows = (int64_t)n * H;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int64_t P = rbase + (half ? r_hi : r_lo);
        if (P >= RT) continue;
        const int64_t orow = (P / G) * H + kvh * G + P % G;
        st_attn_store_row<HD, PART>(o, split, rows, orow, t4, acc, 2 * half, half ? m_hi : m_lo, half ? l_hi : l_lo);
    }
}

/* ---- generic: any head_dim, fp32 ------------------------------------------------------ */

#define AG_THREADS 128

/* grid (n H): one block per (token, head) row; smem: q [hd], acc [hd], p [128].
 * attention_part (key0 >= 0): the query sees keys 0..pos - key0 of the piece;
 * the epilogue writes its natural-log lse (when lse) or merges into (out, lse)
 * (backend.h); key0 < 0: plain attention. */
static __global__ void __launch_bounds__(AG_THREADS)
    attn_generic_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                        const int32_t *__restrict__ pos, int64_t n_kv, int H, int Hkv, int hd, float qscale,
                        float *__restrict__ out, int64_t key0, float *__restrict__ lse, bool merge) {
    extern __shared__ float sm[];
    float *q_s = sm, *acc_s = sm + hd, *p_s = acc_s + hd;
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const int64_t t = row / H;
    const int h = (int)(row % H), kvh = h / (H / Hkv);
    for (int d = threadIdx.x; d < hd; d += AG_THREADS) {
        q_s[d] = q[row * hd + d] * qscale;
        acc_s[d] = 0.0f;
    }
    const int64_t qp = (int64_t)__ldg(pos + t) - (key0 > 0 ? key0 : 0);
    const int64_t end = min(n_kv, (qp > 0 ? qp : 0) + 1);
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int64_t kb = 0; kb < end; kb += AG_THREADS) {
        const int64_t key = kb + threadIdx.x;
        float sv = -INFINITY;
        if (key < end) {
            const float *kr = k + ((size_t)key * Hkv + kvh) * hd;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s = fmaf(q_s[d], __ldg(kr + d), s);
            sv = s;
        }
        const float bm = st_block_max(sv, red);
        const float mn = fmaxf(m, bm);
        const float base = mn == -INFINITY ? 0.0f : mn;
        const float p = exp2f(sv - base);
        const float alpha = exp2f(m - base);
        const float ps = st_block_sum(p, red);
        l = l * alpha + ps;
        m = mn;
        p_s[threadIdx.x] = p;
        __syncthreads();
        const int nk = (int)min((int64_t)AG_THREADS, end - kb);
        for (int d = threadIdx.x; d < hd; d += AG_THREADS) {
            float a = acc_s[d] * alpha;
            for (int j = 0; j < nk; j++) a = fmaf(p_s[j], __ldg(v + ((size_t)(kb + j) * Hkv + kvh) * hd + d), a);
            acc_s[d] = a;
        }
        __syncthreads();
    }
    if (key0 < 0 || (!merge && !lse)) {
        for (int d = threadIdx.x; d < hd; d += AG_THREADS) out[row * hd + d] = acc_s[d] / l;
        return;
    }
    const float lp = (m + log2f(l)) * 0.6931471805599453f; /* m, scores in log2 units: natural log */
    if (!merge) {
        for (int d = threadIdx.x; d < hd; d += AG_THREADS) out[row * hd + d] = acc_s[d] / l;
        if (threadIdx.x == 0) lse[row] = lp;
        return;
    }
    const float lo = lse[row], M = fmaxf(lo, lp), a = expf(lo - M), b = expf(lp - M), inv = 1.0f / (a + b);
    __syncthreads(); /* every thread read lse[row] before thread 0 rewrites it */
    for (int d = threadIdx.x; d < hd; d += AG_THREADS)
        out[row * hd + d] = (out[row * hd + d] * a + acc_s[d] / l * b) * inv;
    if (threadIdx.x == 0) lse[row] = M + logf(a + b);
}

/* ---- dispatch ----------------------------------------------------------------------- */

template <int HD, int RMAX>
static strata_status set_decode_attr() {
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_decode_kernel<HD, RMAX, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)decode_smem_bytes<HD, RMAX>()));
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_decode_kernel<HD, RMAX, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)decode_smem_bytes<HD, RMAX>()));
    return STRATA_OK;
}

template <int HD, int RMAX, bool PART>
static strata_status decode_bpsm(int *out) {
    ST_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, attn_decode_kernel<HD, RMAX, PART>, AD_THREADS,
                                                              decode_smem_bytes<HD, RMAX>()));
    if (*out < 1) *out = 1;
    return STRATA_OK;
}

/* Once per backend: kernel attributes, the FA2 kernel's configuration
 * (params->attn_fa2: cuda_attn_prefill_fa2.cuh), and the decode kernel's
 * blocks per SM (attention's and attention_part's instantiations). */
strata_status st_cuda_attention_setup(st_cuda *c, const st_backend_params *params) {
    strata_status st;
    if ((st = st_attn_fa2_variant(params->attn_fa2, &c->attn_fa2)) != STRATA_OK) return st;
    if ((st = st_attn_fa2_setup()) != STRATA_OK) return st;
    if ((st = st_attn_wgmma_setup(c, &c->attn_wgmma)) != STRATA_OK) return st;
#define SET(HD, RM)                                                                          \
    if ((st = set_decode_attr<HD, RM>()) != STRATA_OK) return st;
    SET(64, 4) SET(64, 8) SET(64, 16) SET(128, 4) SET(128, 8) SET(128, 16)
#undef SET
#define OCC(I, HD, J, RM)                                                                    \
    if ((st = decode_bpsm<HD, RM, false>(&c->attn_dec_bpsm[0][I][J])) != STRATA_OK) return st; \
    if ((st = decode_bpsm<HD, RM, true>(&c->attn_dec_bpsm[1][I][J])) != STRATA_OK) return st;
    OCC(0, 64, 0, 4) OCC(0, 64, 1, 8) OCC(0, 64, 2, 16) OCC(1, 128, 0, 4) OCC(1, 128, 1, 8) OCC(1, 128, 2, 16)
#undef OCC
    return STRATA_OK;
}

/* Number of splits of the KV length: about `want`, each at least `min_len`
 * keys of n_kv (an upper bound of the keys the rows see; the kernels cut the
 * range they really see into this many pieces, split_range). */
static int pick_splits(int64_t n_kv, int64_t want, int64_t min_len) {
    int64_t by_len = (n_kv + min_len - 1) / min_len;
    int64_t ns = want < by_len ? want : by_len;
    if (ns < 1) ns = 1;
    if (ns > 1024) ns = 1024;
    return (int)ns;
}

static strata_status alloc_parts(st_backend *be, st_cuda_stream *s, int nsplit, int64_t rows, int64_t hd,
                                 attn_out *o) {
    if (nsplit == 1) return STRATA_OK;
    const size_t acc_b = (size_t)nsplit * rows * hd * sizeof(float);
    const size_t ml_b = (size_t)nsplit * rows * sizeof(float);
    const size_t ml_off = (acc_b + 255) / 256 * 256;
    const size_t l_off = ml_off + (ml_b + 255) / 256 * 256;
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_ATTN, l_off + ml_b, &p);
    if (st != STRATA_OK) return st;
    o->part_acc = (float *)p;
    o->part_m = (float *)((char *)p + ml_off);
    o->part_l = (float *)((char *)p + l_off);
    return STRATA_OK;
}

/* Merges the splits of o into o->out (and o->lse: attention_part); HD 64 or
 * 128 (the only head dims of the split kernels). */
template <int HD, bool PART>
static strata_status merge_splits(cudaStream_t s, bool pdl, const attn_out *o, int64_t rows) {
    ST_CUDA_TRY(st_launch(pdl, attn_merge_fast_kernel<HD, PART>, dim3((unsigned)rows), dim3(128), 0, s,
                          (const float *)o->part_acc, (const float *)o->part_m, (const float *)o->part_l, o->nsplit,
                          rows, o->out, o->lse, o->merge));
    return STRATA_OK;
}

template <int HD, int RMAX, bool PART>
static strata_status run_decode(st_backend *be, st_cuda_stream *s, const float *q, const float *k, const float *v,
                                const int32_t *pos, int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, float qscale,
                                attn_out o) {
    st_cuda *c = st_cuda_of(be);
    /* exactly one wave: the most blocks that are resident at once, split
     * evenly over the kv heads (a few more blocks than the GPU holds would
     * run as a second, nearly empty wave at the end) */
    const int bpsm = c->attn_dec_bpsm[PART][HD == 64 ? 0 : 1][RMAX == 4 ? 0 : RMAX == 8 ? 1 : 2];
    int64_t want = (int64_t)bpsm * c->sm_count / Hkv;
    if (want < 1) want = 1;
    o.nsplit = pick_splits(n_kv, want, 128);
    strata_status st = alloc_parts(be, s, o.nsplit, n * H, HD, &o);
    if (st != STRATA_OK) return st;
    ST_CUDA_TRY(st_launch(c->pdl, attn_decode_kernel<HD, RMAX, PART>, dim3((unsigned)o.nsplit, (unsigned)Hkv), dim3(AD_THREADS),
                          decode_smem_bytes<HD, RMAX>(), s->s, q, k, v, pos, (int)n, n_kv, (int)H, (int)Hkv, qscale, o));
    return o.nsplit > 1 ? merge_splits<HD, PART>(s->s, c->pdl, &o, n * H) : STRATA_OK;
}

template <int HD, bool PART>
static strata_status run_prefill(st_backend *be, st_cuda_stream *s, const float *q, const float *k, const float *v,
                                 const int32_t *pos, int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, float qscale,
                                 attn_out o) {
    st_cuda *c = st_cuda_of(be);
    const int64_t G = H / Hkv;
    if (c->fast_prefill && n * G >= ST_ATTN_FA2_MIN_ROWS && HD == 128 && c->attn_wgmma && n_kv >= ST_ATTN_WG_KEYS &&
        (c->attn_fa2 < 0 || c->attn_fa2 >= ST_ATTN_FA2_WGMMA)) {
        /* the Hopper kernel (cuda_attn_prefill_wgmma.cu): one block per SM;
         * split the KV length while the grid is under two waves */
        const int64_t blocks = (n * G + ST_ATTN_WG_ROWS - 1) / ST_ATTN_WG_ROWS * Hkv;
        const int64_t slots = 2 * (int64_t)c->sm_count;
        const int64_t want = blocks >= slots ? 1 : (slots + blocks - 1) / blocks;
        o.nsplit = pick_splits(n_kv, want, 256);
        strata_status st = alloc_parts(be, s, o.nsplit, n * H, HD, &o);
        if (st != STRATA_OK) return st;
        st = st_attn_prefill_wgmma(be, s, q, k, v, pos, n, n_kv, H, Hkv, qscale, &o, PART,
                                   c->attn_fa2 == ST_ATTN_FA2_WGMMA_PP);
        if (st != STRATA_OK) return st;
        return o.nsplit > 1 ? merge_splits<HD, PART>(s->s, false, &o, n * H) : STRATA_OK;
    }
    if (c->fast_prefill && n * G >= ST_ATTN_FA2_MIN_ROWS) {
        /* the FA2 kernel (cuda_attn_prefill_fa2.cu); split the KV length
         * while the grid is under two waves of resident blocks */
        const int var = st_attn_fa2_pick(c->attn_fa2, HD, n * G);
        const int64_t rows = st_attn_fa2_rows(var);
        const int64_t blocks = (n * G + rows - 1) / rows * Hkv;
        const int64_t slots = 2 * (int64_t)st_attn_fa2_bpsm(var, HD) * c->sm_count;
        const int64_t want = blocks >= slots ? 1 : (slots + blocks - 1) / blocks;
        o.nsplit = pick_splits(n_kv, want, 256);
        strata_status st = alloc_parts(be, s, o.nsplit, n * H, HD, &o);
        if (st != STRATA_OK) return st;
        st = st_attn_prefill_fa2(be, s, var, HD, q, k, v, pos, n, n_kv, H, Hkv, qscale, &o, PART);
        if (st != STRATA_OK) return st;
        return o.nsplit > 1 ? merge_splits<HD, PART>(s->s, false, &o, n * H) : STRATA_OK;
    }
    const int64_t bx = (n * G + AP_BQ - 1) / AP_BQ;
    if (bx > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda attention: n = %lld is too large", (long long)n);
    const int64_t blocks = bx * Hkv;
    const int64_t want = blocks >= 2 * c->sm_count ? 1 : (2 * c->sm_count + blocks - 1) / blocks;
    o.nsplit = pick_splits(n_kv, want, 256);
    strata_status st = alloc_parts(be, s, o.nsplit, n * H, HD, &o);
    if (st != STRATA_OK) return st;
    const dim3 grid((unsigned)bx, (unsigned)Hkv, (unsigned)o.nsplit);
    if (c->fast_prefill)
        attn_prefill_kernel<HD, false, PART><<<grid, AP_THREADS, 0, s->s>>>(q, k, v, pos, (int)n, n_kv, (int)H, (int)Hkv,
                                                                      qscale, o);
    else
        attn_prefill_kernel<HD, true, PART><<<grid, AP_THREADS, 0, s->s>>>(q, k, v, pos, (int)n, n_kv, (int)H, (int)Hkv,
                                                                     qscale, o);
    ST_CUDA_LAUNCHED("attn_prefill_kernel");
    return o.nsplit > 1 ? merge_splits<HD, PART>(s->s, false, &o, n * H) : STRATA_OK;
}

/* The kernels of hd 64 / 128 with 16-byte aligned pointers (decode, prefill,
 * FA2), o: where the rows go (o.nsplit 1: the run sizes the split); PART:
 * attention_part's instantiations. */
template <bool PART>
static strata_status run_aligned(st_backend *be, st_cuda_stream *s, const float *q, const float *k, const float *v,
                                 const int32_t *pos, int64_t n, int64_t n_kv, int64_t n_heads, int64_t n_kv_heads,
                                 int64_t head_dim, float qscale, const attn_out &o) {
    const int64_t R = n * (n_heads / n_kv_heads);
    if (R <= 16) {
#define DEC(HD)                                                                                        \
    if (R <= 4) return run_decode<HD, 4, PART>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, qscale, o); \
    if (R <= 8) return run_decode<HD, 8, PART>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, qscale, o); \
    return run_decode<HD, 16, PART>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, qscale, o);
        if (head_dim == 64) { DEC(64) }
        DEC(128)
#undef DEC
    }
    if (head_dim == 64) return run_prefill<64, PART>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, qscale, o);
    return run_prefill<128, PART>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, qscale, o);
}

static bool too_large(int64_t n, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim) {
    return n > INT32_MAX / n_heads || n_heads > 65535 || n_kv_heads > 65535 || head_dim > 4096;
}

strata_status st_cuda_op_attention(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                   const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                   int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                   float *out) {
    if (too_large(n, n_heads, n_kv_heads, head_dim))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention: n = %lld, n_heads = %lld, head_dim = %lld: too large",
                      (long long)n, (long long)n_heads, (long long)head_dim);
    const float qscale = scale * LOG2E;
    const bool aligned = st_cuda_aligned(q, 16) && st_cuda_aligned(k, 16) && st_cuda_aligned(v, 16) &&
                         st_cuda_aligned(out, 16);
    if (aligned && (head_dim == 64 || head_dim == 128)) {
        attn_out o = {};
        o.out = out, o.nsplit = 1;
        return run_aligned<false>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, head_dim, qscale, o);
    }
    const size_t smem = (size_t)(2 * head_dim + AG_THREADS) * sizeof(float);
    if (smem > 48 * 1024)
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda attention: head_dim %lld is too large", (long long)head_dim);
    attn_generic_kernel<<<(unsigned)(n * n_heads), AG_THREADS, smem, s->s>>>(
        q, k, v, pos, n_kv, (int)n_heads, (int)n_kv_heads, (int)head_dim, qscale, out, -1, nullptr, false);
    ST_CUDA_LAUNCHED("attn_generic_kernel");
    return STRATA_OK;
}

/* attention_part: the kernels of `attention` over the piece (positions
 * shifted by key0 on the device, st_attn_qpos); unsplit, each kernel's
 * epilogue writes the rows' lse or merges them into (out, lse); split, the
 * merge of the splits does (st_attn_merge_row). The same launches as
 * `attention` over n_kv keys. */
strata_status st_cuda_op_attention_part(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                        const float *v, const int32_t *pos, int64_t n, int64_t key0, int64_t n_kv,
                                        int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, float scale,
                                        bool merge, float *out, float *lse) {
    if (too_large(n, n_heads, n_kv_heads, head_dim) || n_kv > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "cuda attention_part: n = %lld, n_kv = %lld, n_heads = %lld, head_dim = %lld: too large",
                      (long long)n, (long long)n_kv, (long long)n_heads, (long long)head_dim);
    const bool aligned = st_cuda_aligned(q, 16) && st_cuda_aligned(k, 16) && st_cuda_aligned(v, 16) &&
                         st_cuda_aligned(out, 16);
    if (!aligned || (head_dim != 64 && head_dim != 128)) { /* the generic kernel, fp32 (odd shapes only) */
        const size_t smem = (size_t)(2 * head_dim + AG_THREADS) * sizeof(float);
        if (smem > 48 * 1024)
            return st_err(STRATA_ERR_UNSUPPORTED, "cuda attention_part: head_dim %lld is too large",
                          (long long)head_dim);
        attn_generic_kernel<<<(unsigned)(n * n_heads), AG_THREADS, smem, s->s>>>(
            q, k, v, pos, n_kv, (int)n_heads, (int)n_kv_heads, (int)head_dim, scale * LOG2E, out, key0, lse, merge);
        ST_CUDA_LAUNCHED("attn_generic_kernel");
        return STRATA_OK;
    }
    attn_out o = {};
    o.out = out, o.nsplit = 1;
    o.key0 = key0 < INT32_MAX ? (int)key0 : INT32_MAX, o.lse = lse, o.merge = merge;
    return run_aligned<true>(be, s, q, k, v, pos, n, n_kv, n_heads, n_kv_heads, head_dim, scale * LOG2E, o);
}

/* attn_merge: one block per row, threads over its hd outputs (backend.h's rule, natural logs). */
static __global__ void __launch_bounds__(128) attn_merge2_kernel(float *out, float *lse, const float *out2,
                                                                 const float *lse2, int hd) {
    const int64_t r = blockIdx.x;
    const float l1 = lse[r], l2 = lse2[r], m = fmaxf(l1, l2), a = expf(l1 - m), b = expf(l2 - m);
    const float inv = 1.0f / (a + b);
    for (int d = threadIdx.x; d < hd; d += blockDim.x)
        out[r * hd + d] = (out[r * hd + d] * a + out2[r * hd + d] * b) * inv;
    __syncthreads(); /* every thread read lse[r] before it changes */
    if (threadIdx.x == 0) lse[r] = m + logf(a + b);
}

strata_status st_cuda_op_attn_merge(st_backend *be, st_cuda_stream *s, float *out, float *lse, const float *out2,
                                    const float *lse2, int64_t rows, int64_t hd) {
    (void)be;
    if (rows <= 0) return STRATA_OK;
    if (rows > INT32_MAX || hd < 1 || hd > 4096)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attn_merge: %lld rows of %lld", (long long)rows, (long long)hd);
    attn_merge2_kernel<<<(unsigned)rows, 128, 0, s->s>>>(out, lse, out2, lse2, (int)hd);
    ST_CUDA_LAUNCHED("attn_merge2_kernel");
    return STRATA_OK;
}

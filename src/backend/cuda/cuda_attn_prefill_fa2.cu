/* attention, prefill in fast mode: a FlashAttention-2 style tensor-core
 * kernel (the op's contract: backend.h; the row layout, online softmax and
 * KV splits: cuda_attention.cu). Used by the contiguous attention op when
 * set_fast_prefill is on, the head dim is 64 or 128 and a kv head has at
 * least ST_ATTN_FA2_MIN_ROWS rows (below, the previous kernel,
 * attn_prefill_kernel<HD, false>).
 *
 * Two launches:
 *   1. attn_kv_bf16_kernel: K and V [n_kv, Hkv, hd] fp32 -> bf16 (round to
 *      nearest) into the stream's ST_CUDA_SCRATCH_ATTN_BF16 buffer, same
 *      layout, so that every tile row of the main kernel is hd * 2 bytes of
 *      16-byte cp.async copies.
 *   2. attn_prefill_fa2_kernel<HD, WARPS, MT, TK, QS, REV, MINB, PART>: grid
 *      (ceil(n G / BQ), Hkv, nsplit), WARPS x 32 threads. A block owns
 *      BQ = WARPS x 16 MT rows (token, head) of one kv head (row r: token
 *      r / G, head kvh G + r % G); warp w owns rows 16 MT w .. + 16 MT - 1,
 *      MT m-tiles of 16 rows.
 *      - Q: loaded once (fp32, times qscale = scale log2(e), rounded to bf16)
 *        into shared memory; then either into registers as mma A fragments
 *        (ldmatrix.x4), where it stays for the whole KV loop (QS false:
 *        32 registers at hd 128), or read again from its own shared region
 *        for every tile (QS true).
 *      - K/V: tiles of TK keys, double-buffered: cp.async brings tile t+1
 *        while tile t is computed (one barrier per tile). Shared rows are
 *        padded to hd + 8 bf16 (a 16-byte skew per row), so the 8 row
 *        addresses of each ldmatrix phase fall in 8 distinct 16-byte bank
 *        groups: conflict-free. Keys past the block's range are zero-filled.
 *      - S = Q K^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate; K
 *        fragments by ldmatrix.x4), kept in registers; online softmax in
 *        fp32 with exp2 (scores are already in log2 units); P is packed to
 *        bf16 in registers and used directly as the A operand of P V (V
 *        fragments by ldmatrix.x4.trans), no trip through shared memory.
 *        Every K and V fragment serves the warp's MT m-tiles (MT 2 halves
 *        the shared-memory reads per MMA, at 128 accumulator registers per
 *        thread at hd 128). Row sums stay per-thread partials until the end
 *        (one quad reduction).
 *      - Causal: the block's key range ends at its largest position
 *        (split_range), so tiles past its last row are never loaded; a warp
 *        skips a tile that none of its rows sees, and applies the
 *        per-element mask only to tiles that reach past the smallest
 *        position of its rows or past the range's end (the diagonal ones).
 *        REV: block x takes the rows of block gridDim.x - 1 - x, so the
 *        heaviest blocks start first and the grid's tail holds the lightest.
 *      Shared memory: 2 stages x (K + V) x TK keys x (hd + 8) bf16, plus
 *      BQ x (hd + 8) bf16 of Q when QS (else the Q staging reuses stage 1
 *      before the loop starts).
 *   The configurations (FA2_VARIANTS below; st_backend_params.attn_fa2):
 *      b128w8   8 warps x 16 rows, TK 64, Q in registers (the first version;
 *               hd 128: 68 KiB, 1 block per SM)
 *      b128w8r  b128w8, heaviest blocks first
 *      b128w4   4 warps x 32 rows, TK 32, Q from shared memory, heaviest
 *               first (hd 128: 68 KiB, 2 blocks per SM)
 *      b256w8   8 warps x 32 rows, TK 32, Q from shared memory, heaviest
 *               first (hd 128: 102 KiB, 1 block per SM; half the K/V
 *               traffic from L2 per row)
 * PART: attention_part's instantiation of each (the op's contract:
 * backend.h; cuda_attention.cu): positions count from the piece's first
 * key, and an unsplit grid's epilogue also writes each row's log-sum-exp or
 * merges the row into a running (out, lse) (st_attn_store_row); the
 * instantiations for `attention` (PART false) are compiled as before.
 * Precision: Q (scaled), K, V and P rounded to bf16 once, fp32 accumulation:
 * the fast mode's contract (~1e-3 of the output's scale). */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_attn_prefill_fa2.cuh"
#include "backend/cuda/cuda_common.cuh"

/* The configurations (st_backend_params.attn_fa2, read at backend init; see
 * the top of the file): index, name, warps, m-tiles of 16 rows per warp,
 * keys per tile, Q from shared memory (else registers), heaviest blocks
 * first, blocks per SM at hd 64 and hd 128 (__launch_bounds__). Rows per
 * block = warps x 16 x m-tiles. */
#define FA2_VARIANTS(X)                                  \
    X(0, "b128w8", 8, 1, 64, false, false, 2, 1)         \
    X(1, "b128w8r", 8, 1, 64, false, true, 2, 1)         \
    X(2, "b128w4", 4, 2, 32, true, true, 3, 2)           \
    X(3, "b256w8", 8, 2, 32, true, true, 1, 1)

/* 2^x (ex2.approx, flush to zero): 2^-inf = 0; ~2 ulp, far below bf16's rounding. */
ST_DEV float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ---- 1. K, V fp32 -> bf16 ---------------------------------------------------------------- */

/* n8 groups of 8 elements of k and of v (16-byte aligned) -> kb, vb. */
static __global__ void __launch_bounds__(256) attn_kv_bf16_kernel(const float4 *__restrict__ k,
                                                                  const float4 *__restrict__ v, int64_t n8,
                                                                  uint4 *__restrict__ kb, uint4 *__restrict__ vb) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += stride) {
        const float4 k0 = __ldg(k + 2 * i), k1 = __ldg(k + 2 * i + 1);
        const float4 v0 = __ldg(v + 2 * i), v1 = __ldg(v + 2 * i + 1);
        kb[i] = make_uint4(pack_bf16x2(k0.x, k0.y), pack_bf16x2(k0.z, k0.w), pack_bf16x2(k1.x, k1.y),
                           pack_bf16x2(k1.z, k1.w));
        vb[i] = make_uint4(pack_bf16x2(v0.x, v0.y), pack_bf16x2(v0.z, v0.w), pack_bf16x2(v1.x, v1.y),
                           pack_bf16x2(v1.z, v1.w));
    }
}

/* ---- 2. the attention kernel --------------------------------------------------------------- */

/* K/V stages (2 x (K + V) x TK keys) and, with QS, the block's Q rows, of
 * (HD + 8) bf16 each. */
template <int HD, int BQ, int TK, bool QS>
static constexpr size_t fa2_smem_bytes() {
    return (size_t)(2 * 2 * TK + (QS ? BQ : 0)) * (HD + 8) * sizeof(__nv_bfloat16);
}

/* q [n, H, HD] fp32; kb, vb [n_kv, Hkv, HD] bf16; pos [n]. WARPS warps, each
 * owning MT m-tiles of 16 rows (rows 16 MT w .. 16 MT w + 16 MT - 1); QS: the
 * Q fragments are read from shared memory for every tile (else held in
 * registers); REV: block x takes the rows of block gridDim.x - 1 - x (the
 * causal heaviest first, so that the grid's last wave holds the lightest);
 * PART: attention_part's instantiation (attn_out: positions from key0, the
 * rows' lse). See the top of the file. */
template <int HD, int WARPS, int MT, int TK, bool QS, bool REV, int MINB, bool PART>
static __global__ void __launch_bounds__(WARPS * 32, MINB)
    attn_prefill_fa2_kernel(const float *__restrict__ q, const __nv_bfloat16 *__restrict__ kb,
                            const __nv_bfloat16 *__restrict__ vb, const int32_t *__restrict__ pos, int n,
                            int64_t n_kv, int H, int Hkv, float qscale, attn_out o) {
    constexpr int THREADS = WARPS * 32;
    constexpr int BQ = WARPS * 16 * MT; /* rows per block */
    constexpr int WR = 16 * MT;         /* rows per warp */
    constexpr int NR = 2 * MT;          /* rows per thread: m-tile i / 2, half i % 2 */
    constexpr int LD = HD + 8;          /* bf16 per shared row (16-byte skew) */
    constexpr int TILE = TK * LD;       /* bf16 of one K or V tile */
    constexpr int CH = HD / 8;          /* 16-byte chunks per row */
    static_assert(QS || BQ * LD <= 2 * TILE, "the Q staging must fit in one stage");
    static_assert(QS || MT == 1, "Q in registers: one m-tile per warp");
    static_assert(TK * CH % THREADS == 0 && BQ * HD / 4 % THREADS == 0 && BQ % 32 == 0, "whole loops");
    extern __shared__ uint4 fa_smem[]; /* [stage 0: K, V][stage 1: K, V][Q (QS)] */
    __nv_bfloat16 *const sm = (__nv_bfloat16 *)fa_smem;

    /* row indices in 32 bits: RT = n G <= n H < 2^31 (the op's check), and a
     * block's rows start below RT, so they end below 2^31 + BQ */
    const unsigned G = (unsigned)(H / Hkv);
    const unsigned RT = (unsigned)n * G;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const unsigned rbase = (REV ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;

    /* positions: this thread's NR rows, its warp's smallest and largest
     * (rows past RT are padding: position -1, left out of min and max), the
     * block's largest (every warp computes it alike) */
    int prow[NR];
    int wmax = -1, wmin = INT_MAX;
#pragma unroll
    for (int i = 0; i < NR; i++) {
        const unsigned P = rbase + warp * WR + (i >> 1) * 16 + (i & 1) * 8 + g;
        prow[i] = P < RT ? st_attn_qpos<PART>(o, pos, P / G) : -1;
        wmax = max(wmax, prow[i]);
        if (prow[i] >= 0) wmin = min(wmin, prow[i]);
    }
    int maxpos = -1;
#pragma unroll
    for (int i = 0; i < BQ / 32; i++) {
        const unsigned P = rbase + lane + 32 * i;
        if (P < RT) maxpos = max(maxpos, st_attn_qpos<PART>(o, pos, P / G));
    }
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, sh));
        wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, sh));
        maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, sh));
    }
    int64_t kv_begin, kv_end;
    split_range(n_kv, maxpos, o.nsplit, split, TK, &kv_begin, &kv_end);
    /* from here on keys count from kv_begin (int: a cache holds fewer than 2^31 keys) */
    const int nk = kv_end > kv_begin ? (int)(kv_end - kv_begin) : 0;
    const int ntiles = (nk + TK - 1) / TK;
    /* the last key each row sees within the range (< 0: none); the warp's
     * smallest and largest of them (clamped to -1 when below the range) */
    int lim[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) lim[i] = (int)(min((int64_t)prow[i], kv_end - 1) - kv_begin);
    const int wlo = wmin == INT_MAX ? INT_MAX : (int)max((int64_t)wmin - kv_begin, (int64_t)-1);
    const int whi = (int)max((int64_t)wmax - kv_begin, (int64_t)-1);

    /* tile t -> stage t & 1; keys at or past kv_end are zero-filled */
    auto stage = [&](int t) {
        __nv_bfloat16 *ks = sm + (t & 1) * 2 * TILE, *vs = ks + TILE;
        const int64_t k0 = kv_begin + (int64_t)t * TK;
#pragma unroll
        for (int it = 0; it < TK * CH / THREADS; it++) {
            const int i = tid + it * THREADS, j = i / CH, c = i % CH;
            const bool ok = k0 + j < kv_end;
            const size_t off = ok ? ((size_t)(k0 + j) * Hkv + kvh) * HD + c * 8 : 0;
            st_cp_async16(ks + j * LD + c * 8, kb + off, ok);
            st_cp_async16(vs + j * LD + c * 8, vb + off, ok);
        }
        st_cp_async_commit();
    };
    if (ntiles > 0) stage(0);

    /* Q -> bf16 in shared memory: its own region (QS) or stage 1 (free until
     * the loop's first barrier), then (not QS) into registers */
    __nv_bfloat16 *const qs = sm + (QS ? 4 : 2) * TILE;
#pragma unroll 4
    for (int it = 0; it < BQ * HD / 4 / THREADS; it++) {
        const int i = tid + it * THREADS, r = i / (HD / 4), d4 = i % (HD / 4);
        const unsigned P = rbase + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (P < RT) {
            x = __ldg((const float4 *)(q + ((size_t)(P / G) * H + kvh * G + P % G) * HD) + d4);
            x.x *= qscale, x.y *= qscale, x.z *= qscale, x.w *= qscale;
        }
        *(uint2 *)(qs + r * LD + 4 * d4) = make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
    }
    __syncthreads();
    /* A fragments: matrix i of ldmatrix.x4 = rows (i & 1) * 8 .., cols (i >> 1) * 8 .. of the 16x16 chunk */
    const int mi = lane >> 3, mr = lane & 7;
    const __nv_bfloat16 *const qw = qs + (warp * WR + (mi & 1) * 8 + mr) * LD + (mi >> 1) * 8;
    uint32_t qf[QS ? 1 : HD / 16][4];
    if (!QS) {
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) ldmatrix_x4(qf[QS ? 0 : kk], qw + kk * 16);
    }

    float acc[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.0f;
    float m[NR], l[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) m[i] = -INFINITY, l[i] = 0.0f;

    /* per-lane shared offsets (bf16) of the ldmatrix row addresses:
     * K (B of S = Q K^T, 16 keys x 16 dims per x4): matrix i = keys (i >> 1) * 8 ..,
     *   dims (i & 1) * 8 .. -> b0, b1 of key group 2jp, then of 2jp + 1;
     * V (B of O = P V, .trans, 16 keys x 16 dims per x4): matrix i = keys (i & 1) * 8 ..,
     *   dims (i >> 1) * 8 .. -> b0, b1 of dim group 2 d2, then of 2 d2 + 1 */
    const int koff = ((mi >> 1) * 8 + mr) * LD + (mi & 1) * 8;
    const int voff = ((mi & 1) * 8 + mr) * LD + (mi >> 1) * 8;

    for (int t = 0; t < ntiles; t++) {
        st_cp_async_wait<0>(); /* this thread's copies of tile t have landed */
        __syncthreads();       /* everyone's have; every warp is done with tile t - 1 (and the Q staging) */
        if (t + 1 < ntiles) stage(t + 1);
        const int kt = t * TK;
        if (kt > whi) continue; /* no row of this warp sees any key of the tile (warp-uniform) */
        const __nv_bfloat16 *ks = sm + (t & 1) * 2 * TILE, *vs = ks + TILE;

        /* S = Q K^T: each K fragment serves the warp's MT m-tiles */
        float s[MT][TK / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < TK / 8; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
        /* (QS: the dims loop indexes no register array, so it need not be
         * unrolled whole; 2 at a time keeps the fragments in flight few) */
        constexpr int KU = QS ? 2 : HD / 16;
#pragma unroll(KU)
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (QS) {
                    ldmatrix_x4(qa[mt], qw + mt * 16 * LD + kk * 16);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; e++) qa[mt][e] = qf[QS ? 0 : kk][e];
                }
            }
#pragma unroll
            for (int jp = 0; jp < TK / 16; jp++) {
                uint32_t b[4];
                ldmatrix_x4(b, ks + koff + jp * 16 * LD + kk * 16);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16(s[mt][2 * jp], qa[mt], b[0], b[1]);
                    mma_bf16(s[mt][2 * jp + 1], qa[mt], b[2], b[3]);
                }
            }
        }
        /* the diagonal (or the range's last) tile: keys past a row's limit -> -inf */
        if (kt + TK - 1 > wlo || kt + TK > nk) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < TK / 8; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int key = kt + j * 8 + 2 * t4 + e;
                        if (key > lim[2 * mt]) s[mt][j][e] = -INFINITY;
                        if (key > lim[2 * mt + 1]) s[mt][j][2 + e] = -INFINITY;
                    }
        }
        /* online softmax: row i of the thread = m-tile i / 2, elements 2 (i % 2) .. +1, spread over the quad */
#pragma unroll
        for (int i = 0; i < NR; i++) {
            const int mt = i >> 1, h = (i & 1) * 2;
            float mx = m[i];
#pragma unroll
            for (int j = 0; j < TK / 8; j++) mx = fmaxf(mx, fmaxf(s[mt][j][h], s[mt][j][h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float b = mx == -INFINITY ? 0.0f : mx;
            const float a = fa_exp2(m[i] - b);
            m[i] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < TK / 8; j++) {
                s[mt][j][h] = fa_exp2(s[mt][j][h] - b);
                s[mt][j][h + 1] = fa_exp2(s[mt][j][h + 1] - b);
                sum += s[mt][j][h] + s[mt][j][h + 1];
            }
            l[i] = l[i] * a + sum; /* per-thread partial sums; the quad adds them at the end */
#pragma unroll
            for (int dt = 0; dt < HD / 8; dt++) acc[mt][dt][h] *= a, acc[mt][dt][h + 1] *= a;
        }
        /* O += P V: the C fragments of key groups 2kc, 2kc + 1 are the A fragment
         * of keys 16kc .. 16kc+15; each V fragment serves the warp's MT m-tiles */
#pragma unroll
        for (int kc = 0; kc < TK / 16; kc++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                a[mt][0] = pack_bf16x2(s[mt][2 * kc][0], s[mt][2 * kc][1]);
                a[mt][1] = pack_bf16x2(s[mt][2 * kc][2], s[mt][2 * kc][3]);
                a[mt][2] = pack_bf16x2(s[mt][2 * kc + 1][0], s[mt][2 * kc + 1][1]);
                a[mt][3] = pack_bf16x2(s[mt][2 * kc + 1][2], s[mt][2 * kc + 1][3]);
            }
#pragma unroll
            for (int d2 = 0; d2 < HD / 16; d2++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, vs + voff + kc * 16 * LD + d2 * 16);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma_bf16(acc[mt][2 * d2], a[mt], b[0], b[1]);
                    mma_bf16(acc[mt][2 * d2 + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NR; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }

    const int64_t rows = (int64_t)n * H;
#pragma unroll
    for (int i = 0; i < NR; i++) {
        const int mt = i >> 1, h = (i & 1) * 2;
        const unsigned P = rbase + warp * WR + mt * 16 + (i & 1) * 8 + g;
        if (P >= RT) continue;
        const int64_t orow = (int64_t)(P / G) * H + kvh * G + P % G;
        st_attn_store_row<HD, PART>(o, split, rows, orow, t4, acc[mt], h, m[i], l[i]);
    }
}

/* ---- host ---------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    int rows, bpsm64, bpsm128;
} fa2_variants[] = {
#define ROW(I, NAME, W, MT, TK, QS, REV, B64, B128) {NAME, (W) * 16 * (MT), B64, B128},
    FA2_VARIANTS(ROW)
#undef ROW
};
enum { FA2_NVAR = sizeof fa2_variants / sizeof fa2_variants[0] };
static_assert(FA2_NVAR == ST_ATTN_FA2_NVARIANTS, "ST_ATTN_FA2_NVARIANTS");

strata_status st_attn_fa2_variant(const char *name, int *variant) {
    if (!name || !*name || strcmp(name, "auto") == 0) {
        *variant = -1;
        return STRATA_OK;
    }
    for (int i = 0; i < FA2_NVAR; i++)
        if (strcmp(name, fa2_variants[i].name) == 0) {
            *variant = i;
            return STRATA_OK;
        }
    if (strcmp(name, "wgmma") == 0 || strcmp(name, "wgmma-pp") == 0) {
        *variant = name[5] ? ST_ATTN_FA2_WGMMA_PP : ST_ATTN_FA2_WGMMA;
        return STRATA_OK;
    }
    return st_err(STRATA_ERR_INVALID_ARG,
                  "cuda backend init: attn_fa2 \"%s\" is not one of auto, wgmma, wgmma-pp, b128w8, b128w8r, b128w4, "
                  "b256w8",
                  name);
}

/* The variant by name (the table's names are constants: never missing). */
static int fa2_index(const char *name) {
    for (int i = 0; i < FA2_NVAR; i++)
        if (strcmp(name, fa2_variants[i].name) == 0) return i;
    return 0;
}

/* auto: measured on the H200 (bench_cuda_ops, causal, 32/8 heads, TFLOP/s):
 * hd 128 at n = 16384 (65536 rows per kv head): b128w4 310, b256w8 301,
 * b128w8r 288, b128w8 280; at n = 4096 / 2048: b128w8r 238 / 168 ahead of
 * b128w4 221 / 108; hd 64 at 16384: b128w8r 266, b128w4 266, b128w8 255. */
int st_attn_fa2_pick(int variant, int hd, int64_t rows_per_kv_head) {
    if (variant >= 0 && variant < FA2_NVAR) return variant;
    return fa2_index(hd == 128 && rows_per_kv_head >= 32768 ? "b128w4" : "b128w8r");
}

const char *st_attn_fa2_name(int variant) {
    return variant >= 0 && variant < FA2_NVAR ? fa2_variants[variant].name : "?";
}

int st_attn_fa2_rows(int variant) { return fa2_variants[variant].rows; }

int st_attn_fa2_bpsm(int variant, int hd) {
    return hd == 64 ? fa2_variants[variant].bpsm64 : fa2_variants[variant].bpsm128;
}

template <int HD, int W, int MT, int TK, bool QS, bool REV, int MINB>
static strata_status fa2_set_attr() {
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_fa2_kernel<HD, W, MT, TK, QS, REV, MINB, false>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)fa2_smem_bytes<HD, W * 16 * MT, TK, QS>()));
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_fa2_kernel<HD, W, MT, TK, QS, REV, MINB, true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)fa2_smem_bytes<HD, W * 16 * MT, TK, QS>()));
    return STRATA_OK;
}

strata_status st_attn_fa2_setup(void) {
    strata_status st;
#define SET(I, NAME, W, MT, TK, QS, REV, B64, B128)                                              \
    if ((st = fa2_set_attr<64, W, MT, TK, QS, REV, B64>()) != STRATA_OK) return st;           \
    if ((st = fa2_set_attr<128, W, MT, TK, QS, REV, B128>()) != STRATA_OK) return st;
    FA2_VARIANTS(SET)
#undef SET
    return STRATA_OK;
}

template <int HD, int W, int MT, int TK, bool QS, bool REV, int MINB>
static strata_status launch_fa2(cudaStream_t s, bool part, const float *q, const __nv_bfloat16 *kb,
                                const __nv_bfloat16 *vb, const int32_t *pos, int64_t n, int64_t n_kv, int64_t H,
                                int64_t Hkv, float qscale, const attn_out *o) {
    constexpr int BQ = W * 16 * MT;
    const int64_t bx = (n * (H / Hkv) + BQ - 1) / BQ;
    const dim3 grid((unsigned)bx, (unsigned)Hkv, (unsigned)o->nsplit);
    if (part)
        attn_prefill_fa2_kernel<HD, W, MT, TK, QS, REV, MINB, true><<<grid, W * 32, fa2_smem_bytes<HD, BQ, TK, QS>(), s>>>(
            q, kb, vb, pos, (int)n, n_kv, (int)H, (int)Hkv, qscale, *o);
    else
        attn_prefill_fa2_kernel<HD, W, MT, TK, QS, REV, MINB, false><<<grid, W * 32, fa2_smem_bytes<HD, BQ, TK, QS>(), s>>>(
            q, kb, vb, pos, (int)n, n_kv, (int)H, (int)Hkv, qscale, *o);
    ST_CUDA_LAUNCHED("attn_prefill_fa2_kernel");
    return STRATA_OK;
}

strata_status st_attn_prefill_fa2(st_backend *be, st_cuda_stream *s, int variant, int hd, const float *q,
                                  const float *k, const float *v, const int32_t *pos, int64_t n, int64_t n_kv,
                                  int64_t H, int64_t Hkv, float qscale, const attn_out *o, bool part) {
    if (hd != 64 && hd != 128)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (fa2 prefill): head_dim %d is not 64 or 128", hd);
    if (variant < 0 || variant >= FA2_NVAR)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (fa2 prefill): variant %d", variant);
    if ((n * (H / Hkv) + st_attn_fa2_rows(variant) - 1) / st_attn_fa2_rows(variant) > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (fa2 prefill): n = %lld is too large", (long long)n);
    const size_t elems = (size_t)n_kv * (size_t)Hkv * (size_t)hd; /* a multiple of 8 */
    const size_t kv_bytes = (elems * sizeof(__nv_bfloat16) + 255) / 256 * 256;
    void *p = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_ATTN_BF16, 2 * kv_bytes, &p);
    if (st != STRATA_OK) return st;
    __nv_bfloat16 *kb = (__nv_bfloat16 *)p, *vb = (__nv_bfloat16 *)((char *)p + kv_bytes);
    const int64_t n8 = (int64_t)(elems / 8);
    int64_t cb = (n8 + 255) / 256;
    const int64_t cmax = (int64_t)st_cuda_of(be)->sm_count * 8;
    if (cb > cmax) cb = cmax;
    attn_kv_bf16_kernel<<<(unsigned)cb, 256, 0, s->s>>>((const float4 *)k, (const float4 *)v, n8, (uint4 *)kb,
                                                        (uint4 *)vb);
    ST_CUDA_LAUNCHED("attn_kv_bf16_kernel");
    switch (variant) {
#define CASE(I, NAME, W, MT, TK, QS, REV, B64, B128)                                                          \
    case I:                                                                                                \
        if (hd == 64)                                                                                      \
            return launch_fa2<64, W, MT, TK, QS, REV, B64>(s->s, part, q, kb, vb, pos, n, n_kv, H, Hkv, qscale, o); \
        return launch_fa2<128, W, MT, TK, QS, REV, B128>(s->s, part, q, kb, vb, pos, n, n_kv, H, Hkv, qscale, o);
        FA2_VARIANTS(CASE)
#undef CASE
    }
    return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (fa2 prefill): variant %d", variant);
}

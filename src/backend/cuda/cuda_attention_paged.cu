/* attention_paged: causal grouped-query attention of a batch of sequences over
 * a paged KV cache (backend.h, st_paged_kv). Token t of sequence seq[t] at
 * position pos[t] sees keys 0..pos[t]; key j lives in slot
 * table[j / bs] * bs + j % bs of the layer's pool.
 *
 * Batch invariance is the design goal: every token, whether it is a decode or
 * part of a prefill chunk, goes through the same arithmetic (the tile kernel,
 * or for decode batches the decode kernels below, which repeat it operation
 * for operation), and the order of its reduction depends only on its own
 * position:
 *   - its keys [0, pos] are cut into fixed ranges of PA_SPLIT keys (split s =
 *     keys [s PA_SPLIT, (s+1) PA_SPLIT)), one block (or warp) each; a range is
 *     walked in tiles of 32 keys from its start, with an online softmax per
 *     row (fp32 SIMT, exact to fp32 rounding: scores pre-scaled by scale *
 *     log2(e), exp2);
 *   - a token with one range writes its output directly; one with more
 *     writes (acc, m, l) per range and the merge kernel combines the ranges:
 *     out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, in an order
 *     fixed by the number of ranges.
 * The kernel (pa_tile_kernel) works on a TILE of consecutive tokens of one
 * sequence (up to 64 rows of token x head) and stages each K/V tile once for
 * all of them; every row's operations and their order are those it has alone
 * (see the comment above the kernel: rows skip keys past their end instead of
 * multiplying them by 0, and every sum has a fixed tree), so its bits do not
 * depend on the tile.
 * So a token's bits are the same alone or among any others, and for any
 * number of tokens per call (tokens are processed in sub-batches that bound
 * the partials' scratch, which changes nothing per token). What is NOT
 * claimed: equality with the contiguous `attention` op (a different kernel,
 * ~1e-6 apart), nor across head_dim/alignment classes (hd 64/128 with
 * 16-byte aligned pointers take the tile kernel; anything else a generic
 * one, also batch-invariant). The tile kernel's figures: bench_cuda_ops.
 *
 * Cache element types (st_kv_layer): every K/V element is dequantized to
 * fp32 exactly as the CPU does (bf16: bits << 16; fp8: its fp32 value, then
 * __fmul_rn by the row's scale) and the arithmetic after that is the f32
 * path's, so a bf16 / fp8 pool gives the bits of an f32 pool holding the
 * dequantized values (same kernel variant). In the tile kernel the raw tile
 * (bf16: 8 KB of K+V per 32 keys at hd 128, half the f32 bytes; fp8: a
 * quarter, plus 32 scales each) is staged with 16-byte cp.async into its own
 * shared buffer, converted once into the fp32 tile (16-byte shared reads of
 * 8 bf16 / 8 fp8), and the next raw tile is loaded while this one is
 * computed (one raw and one fp32 buffer; ~95 KB of shared memory instead of
 * ~111 KB at hd 128). The decode kernels read K and V rows of any type
 * straight into registers and convert them there (pd_ld8, pd_ldv).
 *
 * Invalid indices (the host cannot read them): a seq outside [0, n_seqs) or a
 * sequence with no keys gives a row of NaN; ctx_lens is clamped to
 * max_blocks * bs and pos to ctx_len - 1; a block id outside the pool reads
 * as zeros. No out-of-bounds access in any case. */
#include <math.h>

#include <cuda_fp8.h>

#include "backend/cuda/cuda_attn_common.cuh"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define LOG2E 1.4426950408889634f
/* Keys per range: fixed, so a token's reduction order is its own. 64 keys
 * (two tiles) give a decode step of one sequence enough blocks: 8B shape on
 * an H100, one sequence at context 576, bf16 KV: 256 -> 139.9 tok/s, 128 ->
 * 155.3, 64 -> 162.3 (q4_0: 206, 240, 259); batched decode unchanged or
 * better (bench/RESULTS.md). Overridable at build time for such measurements. */
#ifndef PA_SPLIT
#define PA_SPLIT 64
#endif
#define PA_THREADS 128
#define PA_TK 32       /* keys per tile */
#define PA_SCRATCH_CAP ((size_t)64 << 20) /* partials of one sub-batch */

/* What a token's block needs to know about it: its keys [0, nk) (nk = 0:
 * invalid token) and its block-table row. */
struct pa_tok {
    const int32_t *table;
    int64_t nk;
};

ST_DEV pa_tok pa_token(const st_paged_kv &kv, const int32_t *seq, const int32_t *pos, int64_t t, int64_t max_nk) {
    pa_tok r = {nullptr, 0};
    const int32_t sq = __ldg(seq + t);
    if (sq < 0 || (int64_t)sq >= kv.n_seqs) return r;
    int64_t len = __ldg(kv.ctx_lens + sq);
    int64_t cap = kv.max_blocks * kv.block_size;
    if (cap > max_nk) cap = max_nk; /* the ranges the grid holds (ctx_lens beyond max_ctx) */
    if (len > cap) len = cap;
    if (len <= 0) return r;
    int64_t p = __ldg(pos + t);
    if (p < 0) p = 0;
    if (p > len - 1) p = len - 1;
    r.table = kv.block_tables + (int64_t)sq * kv.max_blocks;
    r.nk = p + 1;
    return r;
}

/* The slot of key j, or -1 when its block id is outside the pool. */
ST_DEV int64_t pa_slot(const pa_tok &tk, int64_t j, int64_t bs, int64_t n_blocks) {
    const int32_t b = __ldg(tk.table + j / bs);
    return b >= 0 && b < n_blocks ? (int64_t)b * bs + j % bs : -1;
}

/* ---- cache element types -------------------------------------------------------------- */

/* Element idx of K or V (base) of the cache as fp32, exact (backend.h,
 * st_kv_layer); sc: the row's fp8 scale (unused otherwise). */
template <int KT>
ST_DEV float pa_ld(const void *base, size_t idx, float sc) {
    if constexpr (KT == ST_KV_F32) {
        return __ldg((const float *)base + idx);
    } else if constexpr (KT == ST_KV_BF16) {
        return __uint_as_float((uint32_t)__ldg((const unsigned short *)base + idx) << 16);
    } else {
        const __nv_fp8_storage_t b = (__nv_fp8_storage_t)__ldg((const unsigned char *)base + idx);
        return __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3))), sc);
    }
}

/* The fp8 scale of (slot, kv head) of K (v = false) or V; 1 for other types. */
template <int KT>
ST_DEV float pa_scale(const st_kv_layer &c, bool v, int64_t row) {
    if constexpr (KT == ST_KV_FP8) return __ldg((v ? c.v_scale : c.k_scale) + row);
    return 1.0f;
}

/* Raw cache words to fp32, exactly: bf16 (2 per word: the low half first),
 * fp8 (2 per 16 bits, the low byte first, times the row's scale sc). */
ST_DEV float2 pa_bf16x2(uint32_t w) { return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)); }
ST_DEV float2 pa_fp8x2(uint32_t w16, float sc) {
    const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(w16 & 0xffffu);
    const float2 x = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    return make_float2(__fmul_rn(x.x, sc), __fmul_rn(x.y, sc));
}

/* 8 raw elements (16 bytes of bf16 / 8 bytes of fp8: words w) to fp32. */
template <int KT>
ST_DEV void pa_cvt8w(uint4 w, float sc, float4 &lo, float4 &hi) {
    float2 f[4];
    if constexpr (KT == ST_KV_BF16) {
        f[0] = pa_bf16x2(w.x), f[1] = pa_bf16x2(w.y), f[2] = pa_bf16x2(w.z), f[3] = pa_bf16x2(w.w);
    } else {
        f[0] = pa_fp8x2(w.x, sc), f[1] = pa_fp8x2(w.x >> 16, sc), f[2] = pa_fp8x2(w.y, sc), f[3] = pa_fp8x2(w.y >> 16, sc);
    }
    lo = make_float4(f[0].x, f[0].y, f[1].x, f[1].y);
    hi = make_float4(f[2].x, f[2].y, f[3].x, f[3].y);
}

/* The same from shared memory. */
template <int KT>
ST_DEV void pa_cvt8(const unsigned char *raw, float sc, float4 &lo, float4 &hi) {
    if constexpr (KT == ST_KV_BF16) {
        pa_cvt8w<KT>(*(const uint4 *)raw, sc, lo, hi);
    } else {
        const uint2 u = *(const uint2 *)raw;
        pa_cvt8w<KT>(make_uint4(u.x, u.y, 0u, 0u), sc, lo, hi);
    }
}

/* cp.async of 4 bytes (the fp8 scales), zero-filled when !valid. */
ST_DEV void pa_cp_async4(void *smem, const void *gmem, bool valid) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}

/* ---- partial results and their merge ---------------------------------------------- */

struct pa_out {
    float *out;      /* [n, H, hd] (rows of the whole call) */
    float *part_acc; /* [nsplit][rows of the sub-batch][hd] */
    float *part_m;   /* [nsplit][rows] */
    float *part_l;
    int64_t tok0;    /* first token of the sub-batch */
    int64_t rows;    /* sub-batch tokens * H */
};

/* grid (sub-batch tokens * H): one block per (token, head) row with more than
 * one range; the ranges are merged in increasing order. */
static __global__ void __launch_bounds__(128)
    pa_merge_kernel(st_paged_kv kv, const int32_t *__restrict__ seq, const int32_t *__restrict__ pos, int H, int hd,
                    int64_t max_nk, pa_out o) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t row = blockIdx.x;
    const pa_tok tk = pa_token(kv, seq, pos, o.tok0 + row / H, max_nk);
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
    if (ns <= 1) return; /* written directly (or NaN) by the main kernel */
    float M = -INFINITY;
    for (int sp = 0; sp < ns; sp++) M = fmaxf(M, o.part_m[sp * o.rows + row]);
    float L = 0.0f;
    for (int sp = 0; sp < ns; sp++) {
        const float m = o.part_m[sp * o.rows + row];
        if (m != -INFINITY) L += exp2f(m - M) * o.part_l[sp * o.rows + row];
    }
    const float inv = 1.0f / L;
    float *dst = o.out + (o.tok0 * H + row) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int sp = 0; sp < ns; sp++) {
            const float m = o.part_m[sp * o.rows + row];
            if (m != -INFINITY) acc += exp2f(m - M) * o.part_acc[((size_t)sp * o.rows + row) * hd + d];
        }
        dst[d] = acc * inv;
    }
}

/* ---- the tile kernel (hd 64 / 128): tiles of consecutive tokens of one sequence ---------------
 * A block takes a TILE of up to TQ consecutive tokens of the batch that
 * belong to the same sequence, the query heads of one kv head (GC of them:
 * the whole GQA group, or a chunk of PT_ROWS heads of a larger one), and one
 * PA_SPLIT-key range; rows r = token (r / Gc) x head (r % Gc), at most PT_ROWS.
 * Each 32-key tile of K/V is staged once in shared memory (cp.async, double-
 * buffered) and used by every row. Tiles are found on the device: token t
 * starts one when t is the sub-batch's first token, a multiple of TQ, or its
 * sequence differs from token t-1's; every other token's blocks exit at once.
 *
 * Batch invariance: every row's arithmetic is a fixed function of its own
 * q, its own keys [0, nk) and nk, whatever else shares the block:
 *   - per 32-key tile kb of its range, the row takes c = clamp(nk - kb, 0, 32)
 *     keys; c = 0 leaves its state untouched (no update at all);
 *   - score(key) = fmaf chain over the dims in increasing order (x, y, z, w
 *     of each float4), on q pre-scaled by __fmul_rn;
 *   - keys j >= c score -inf; the tile max is exact; the p sum is
 *     ((p_kg + p_kg+8) + p_kg+16) + p_kg+24 per lane kg, then a butterfly over
 *     kg (xor 1, 2, 4): the same tree on every lane, for every row;
 *   - l = l alpha + sum and acc = acc alpha with __fmul_rn / __fadd_rn (no
 *     contraction the compiler could choose differently), then
 *     acc = fmaf(p_j, v_j, acc) for j = 0 .. c-1 in order: keys past the
 *     row's end are skipped, not multiplied by 0 (their V may be garbage);
 *   - the output is acc / l (one range), or (acc, m, l) per range merged by
 *     st_attn_merge_row, whose order depends on the range count alone.
 * The thread that computes a value changes with the tile's shape; the
 * operations and their order do not. So a token gives the same bits alone,
 * in a tile of 64, at any offset in the batch, with any sub-batching. */
#define PT_ROWS 64 /* rows (token x head) per block */
#define PT_TK 32   /* keys per staged tile */

/* KT: the cache's st_kv_dtype. bf16 / fp8 run with NBUF = 1 fp32 tile plus a
 * raw tile (RAWB bytes: K then V rows of the type, then fp8's 2 x 32 scales). */
template <int HD, int NBUF, int KT>
struct pt_cfg {
    static constexpr int ROWS = PT_ROWS;
    static constexpr int QP = HD + 4;       /* padded rows: conflict-free float4 reads */
    static constexpr int KP = HD + 4;
    static constexpr int PP = 40;           /* p_s row stride: conflict-free writes and float4 reads */
    static constexpr int SR = ROWS / 16; /* score phase: rows rg + 16 i of thread (rg, kg) */
    static constexpr int PR = ROWS / 8;  /* PV phase: rows prg + 8 i of thread (prg, pdg) */
    static constexpr int PD = HD / 16;      /* PV phase: dims PD pdg .. PD pdg + PD - 1 */
    static constexpr int TILE = PT_TK * KP + PT_TK * HD; /* floats of one K+V buffer */
    static constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1; /* bytes per element */
    static constexpr int RROW = HD * ES;                 /* bytes of one raw row */
    static constexpr size_t RAWB = KT == ST_KV_F32 ? 0
                                                   : (size_t)2 * PT_TK * RROW +
                                                         (KT == ST_KV_FP8 ? 2 * PT_TK * sizeof(float) : 0);
    static_assert(KT == ST_KV_F32 || NBUF == 1, "bf16 / fp8: one fp32 tile (plus the raw one)");
    static constexpr size_t smem = sizeof(float) * ((size_t)ROWS * QP + NBUF * (size_t)TILE +
                                                    (size_t)ROWS * PP + 3 * (size_t)ROWS) +
                                   sizeof(int) * 2 * ROWS + RAWB;
};

/* grid (sub-batch tokens, Hkv * hchunks, ranges); 128 threads. */
template <int HD, int NBUF, int KT>
static __global__ void __launch_bounds__(PA_THREADS)
    pa_tile_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                   const int32_t *__restrict__ pos, int H, int Hkv, int hchunks, int GC, int TQ, int64_t max_nk,
                   float qscale, pa_out o) {
    using C = pt_cfg<HD, NBUF, KT>;
    constexpr int ROWS = C::ROWS;
    extern __shared__ float4 pt_smem4[];
    float *q_s = (float *)pt_smem4;         /* [ROWS][QP] */
    float *kv_s = q_s + ROWS * C::QP;       /* NBUF x ([TK][KP] K, [TK][HD] V) */
    float *p_s = kv_s + NBUF * C::TILE;     /* [ROWS][PP] */
    float *alpha_s = p_s + ROWS * C::PP;    /* [ROWS] */
    float *m_s = alpha_s + ROWS;
    float *l_s = m_s + ROWS;
    int *cnt_s = (int *)(l_s + ROWS);       /* [ROWS] keys of the current tile the row takes */
    int *nk_s = cnt_s + ROWS;               /* [ROWS] the row sees keys [0, nk) */
    unsigned char *raw_s = (unsigned char *)(nk_s + ROWS); /* bf16 / fp8: [TK][RROW] K, [TK][RROW] V */
    float *rsc_s = (float *)(raw_s + 2 * PT_TK * C::RROW); /* fp8: [TK] K scales, [TK] V scales */
    __shared__ int ntok_s, maxnk_s;
    st_pdl_wait();
    st_pdl_trigger();

    const int64_t t0 = o.tok0 + blockIdx.x, tend = o.tok0 + gridDim.x;
    const int32_t sq = __ldg(seq + t0);
    if (t0 != o.tok0 && t0 % TQ != 0 && __ldg(seq + t0 - 1) == sq) return; /* inside an earlier token's tile */
    const int tid = threadIdx.x;
    const int kvh = blockIdx.y / hchunks, chunk = blockIdx.y % hchunks, sp = blockIdx.z;
    const int G = H / Hkv, h0 = kvh * G + chunk * GC, Gc = min(GC, G - chunk * GC);
    if (tid == 0) ntok_s = TQ, maxnk_s = 0;
    __syncthreads();
    if (tid >= 1 && tid < TQ) { /* the tile ends at the first token that starts another */
        const int64_t t = t0 + tid;
        if (t >= tend || t % TQ == 0 || __ldg(seq + t) != sq) atomicMin(&ntok_s, tid);
    }
    __syncthreads();
    const int R = ntok_s * Gc; /* <= TQ GC <= ROWS */
    /* the tokens share seq, so they are all valid or all invalid */
    if (pa_token(kv, seq, pos, t0, max_nk).nk == 0) { /* a NaN row each, written by the first range's block */
        if (sp == 0)
            for (int i = tid; i < R * HD; i += PA_THREADS) {
                const int r = i / HD;
                o.out[((t0 + r / Gc) * H + h0 + r % Gc) * HD + i % HD] = __int_as_float(0x7fc00000);
            }
        return;
    }
    const pa_tok tk = pa_token(kv, seq, pos, t0, max_nk); /* the tile's block table */
    if (tid < ROWS) {
        int nk = 0;
        if (tid < R) nk = (int)pa_token(kv, seq, pos, t0 + tid / Gc, max_nk).nk;
        nk_s[tid] = nk;
        atomicMax(&maxnk_s, nk);
    }
    const int64_t kv_begin = (int64_t)sp * PA_SPLIT;
    __syncthreads();
    const int64_t maxnk = maxnk_s;
    if (maxnk <= kv_begin) return; /* no row has keys in this range */
    const int64_t kv_end = min(maxnk, kv_begin + PA_SPLIT);
    const int64_t bs = kv.block_size, n_blocks = kv.cache.n_slots / bs, kv_stride = (int64_t)Hkv * HD;

    for (int i = tid; i < ROWS * HD / 4; i += PA_THREADS) {
        const int r = i / (HD / 4), d4 = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < R) {
            x = __ldg((const float4 *)(q + ((t0 + r / Gc) * H + h0 + r % Gc) * HD) + d4);
            x = make_float4(__fmul_rn(x.x, qscale), __fmul_rn(x.y, qscale), __fmul_rn(x.z, qscale),
                            __fmul_rn(x.w, qscale));
        }
        *(float4 *)(q_s + r * C::QP + 4 * d4) = x;
    }
    const int ntiles = (int)((kv_end - kv_begin + PT_TK - 1) / PT_TK);

    /* tile tt -> buffer tt % NBUF; keys past kv_end and keys of invalid blocks are zero-filled */
    auto stage = [&](int tt) {
        float *ks = kv_s + (tt % NBUF) * C::TILE, *vs = ks + PT_TK * C::KP;
        const int64_t kb = kv_begin + (int64_t)tt * PT_TK;
        for (int i = tid; i < PT_TK * HD / 4; i += PA_THREADS) {
            const int j = i / (HD / 4), d4 = i % (HD / 4);
            const int64_t key = kb + j;
            const int64_t slot = key < kv_end ? pa_slot(tk, key, bs, n_blocks) : -1;
            const bool ok = slot >= 0;
            const size_t off = ok ? (size_t)slot * kv_stride + (size_t)kvh * HD + 4 * d4 : 0;
            st_cp_async16(ks + j * C::KP + 4 * d4, (const float *)kv.cache.k + off, ok);
            st_cp_async16(vs + j * HD + 4 * d4, (const float *)kv.cache.v + off, ok);
        }
        st_cp_async_commit();
    };
    /* bf16 / fp8: raw tile tt -> raw_s (16-byte chunks; fp8 scales 4 bytes each),
     * zero-filled like the fp32 tile (a zero scale: an fp8 zero times 0) */
    auto stage_raw = [&](int tt) {
        constexpr int CH = C::RROW / 16; /* chunks per row */
        const int64_t kb = kv_begin + (int64_t)tt * PT_TK;
        for (int i = tid; i < PT_TK * CH; i += PA_THREADS) {
            const int j = i / CH, ch = i % CH;
            const int64_t key = kb + j;
            const int64_t slot = key < kv_end ? pa_slot(tk, key, bs, n_blocks) : -1;
            const bool ok = slot >= 0;
            const size_t off = ok ? ((size_t)slot * kv_stride + (size_t)kvh * HD) * C::ES + 16 * ch : 0;
            st_cp_async16(raw_s + j * C::RROW + 16 * ch, (const unsigned char *)kv.cache.k + off, ok);
            st_cp_async16(raw_s + (PT_TK + j) * C::RROW + 16 * ch, (const unsigned char *)kv.cache.v + off, ok);
            if constexpr (KT == ST_KV_FP8) {
                if (ch == 0) {
                    const size_t r = ok ? (size_t)slot * Hkv + kvh : 0;
                    pa_cp_async4(rsc_s + j, kv.cache.k_scale + r, ok);
                    pa_cp_async4(rsc_s + PT_TK + j, kv.cache.v_scale + r, ok);
                }
            }
        }
        st_cp_async_commit();
    };
    /* bf16 / fp8: raw_s -> the fp32 tile (buffer 0), 8 elements per step */
    auto convert = [&]() {
        float *ks = kv_s, *vs = ks + PT_TK * C::KP;
        for (int i = tid; i < 2 * PT_TK * HD / 8; i += PA_THREADS) {
            const int jj = i / (HD / 8), g = i % (HD / 8); /* jj < TK: K row jj, else V row jj - TK */
            float sc = 1.0f;
            if constexpr (KT == ST_KV_FP8) sc = rsc_s[jj];
            float4 lo, hi;
            pa_cvt8<KT>(raw_s + jj * C::RROW + 8 * g * C::ES, sc, lo, hi);
            float *dst = jj < PT_TK ? ks + jj * C::KP + 8 * g : vs + (jj - PT_TK) * HD + 8 * g;
            *(float4 *)dst = lo;
            *(float4 *)(dst + 4) = hi;
        }
    };

    const int rg = tid >> 3, kg = tid & 7;    /* score phase */
    const int prg = tid >> 4, pdg = tid & 15; /* PV phase */
    float m_r[C::SR], l_r[C::SR];
#pragma unroll
    for (int i = 0; i < C::SR; i++) m_r[i] = -INFINITY, l_r[i] = 0.0f;
    float acc[C::PR][C::PD];
#pragma unroll
    for (int i = 0; i < C::PR; i++)
#pragma unroll
        for (int d = 0; d < C::PD; d++) acc[i][d] = 0.0f;

    if constexpr (KT == ST_KV_F32) stage(0); /* ntiles >= 1 */
    else stage_raw(0);
    for (int tt = 0; tt < ntiles; tt++) {
        if constexpr (KT != ST_KV_F32) {
            /* raw tile tt has landed; the fp32 tile is free (the __syncthreads ending
             * the previous iteration): convert, then load raw tile tt + 1 while
             * tile tt is computed */
            st_cp_async_wait<0>();
            __syncthreads();
            convert();
            __syncthreads();
            if (tt + 1 < ntiles) stage_raw(tt + 1);
        } else if (NBUF == 1) { /* one buffer: tile tt is loaded once tile tt - 1 is done (the
                                 * __syncthreads ending the previous iteration) */
            if (tt > 0) stage(tt);
            st_cp_async_wait<0>();
            __syncthreads();
        } else if (tt + 1 < ntiles) {
            stage(tt + 1);
            st_cp_async_wait<1>();
            __syncthreads();
        } else {
            st_cp_async_wait<0>();
            __syncthreads();
        }
        const float *k_s = kv_s + (tt % NBUF) * C::TILE, *v_s = k_s + PT_TK * C::KP;
        const int64_t kb = kv_begin + (int64_t)tt * PT_TK;

        /* scores: thread (rg, kg) scores keys kg + 8 j (j < 4) against rows rg + 16 i */
        float sc[C::SR][4];
#pragma unroll
        for (int i = 0; i < C::SR; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll 2
        for (int d4 = 0; d4 < HD / 4; d4++) {
            float4 kx[4];
#pragma unroll
            for (int j = 0; j < 4; j++) kx[j] = *(const float4 *)(k_s + (kg + 8 * j) * C::KP + 4 * d4);
#pragma unroll
            for (int i = 0; i < C::SR; i++) {
                const int row = rg + 16 * i;
                if (row < R) {
                    const float4 qx = *(const float4 *)(q_s + row * C::QP + 4 * d4);
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        float a = sc[i][j];
                        a = fmaf(qx.x, kx[j].x, a);
                        a = fmaf(qx.y, kx[j].y, a);
                        a = fmaf(qx.z, kx[j].z, a);
                        a = fmaf(qx.w, kx[j].w, a);
                        sc[i][j] = a;
                    }
                }
            }
        }
        /* online softmax per row; the 8 lanes kg of a row run it together (every
         * lane of the warp executes the shuffles; rows without keys commit nothing) */
#pragma unroll
        for (int i = 0; i < C::SR; i++) {
            const int row = rg + 16 * i;
            const int64_t left = row < R ? (int64_t)nk_s[row] - kb : 0;
            const int c = (int)max((int64_t)0, min((int64_t)PT_TK, left));
            float sv[4], mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                sv[j] = kg + 8 * j < c ? sc[i][j] : -INFINITY;
                mx = fmaxf(mx, sv[j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            const float mnew = fmaxf(m_r[i], mx);
            const float base = mnew == -INFINITY ? 0.0f : mnew;
            float p[4];
#pragma unroll
            for (int j = 0; j < 4; j++) p[j] = exp2f(__fsub_rn(sv[j], base));
            float sum = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), p[2]), p[3]);
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 4));
            const float alpha = exp2f(__fsub_rn(m_r[i], base));
            if (c > 0) {
                l_r[i] = __fadd_rn(__fmul_rn(l_r[i], alpha), sum);
                m_r[i] = mnew;
#pragma unroll
                for (int j = 0; j < 4; j++) p_s[row * C::PP + kg + 8 * j] = p[j];
                if (kg == 0) alpha_s[row] = alpha;
            }
            if (kg == 0) cnt_s[row] = c; /* row < 16 SR = ROWS */
        }
        __syncthreads();
        /* PV: thread (prg, pdg) owns dims PD pdg .. of rows prg + 8 i */
        int cnt[C::PR];
#pragma unroll
        for (int i = 0; i < C::PR; i++) {
            const int row = prg + 8 * i;
            cnt[i] = row < R ? cnt_s[row] : 0;
            if (cnt[i] > 0) {
                const float a = alpha_s[row];
#pragma unroll
                for (int d = 0; d < C::PD; d++) acc[i][d] = __fmul_rn(acc[i][d], a);
            }
        }
#pragma unroll 2
        for (int j4 = 0; j4 < PT_TK / 4; j4++) {
            float4 pv[C::PR];
#pragma unroll
            for (int i = 0; i < C::PR; i++)
                pv[i] = cnt[i] > 4 * j4 ? *(const float4 *)(p_s + (prg + 8 * i) * C::PP + 4 * j4)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * j4 + jj;
                float vv[C::PD];
#pragma unroll
                for (int d4 = 0; d4 < C::PD / 4; d4++) {
                    const float4 x = *(const float4 *)(v_s + j * HD + C::PD * pdg + 4 * d4);
                    vv[4 * d4] = x.x, vv[4 * d4 + 1] = x.y, vv[4 * d4 + 2] = x.z, vv[4 * d4 + 3] = x.w;
                }
#pragma unroll
                for (int i = 0; i < C::PR; i++) {
                    if (j < cnt[i]) {
                        const float pj = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
#pragma unroll
                        for (int d = 0; d < C::PD; d++) acc[i][d] = fmaf(pj, vv[d], acc[i][d]);
                    }
                }
            }
        }
        __syncthreads(); /* buffer tt % NBUF, p_s and cnt_s are free again */
    }
    if (kg == 0) {
#pragma unroll
        for (int i = 0; i < C::SR; i++) {
            const int row = rg + 16 * i;
            if (row < R) m_s[row] = m_r[i], l_s[row] = l_r[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < C::PR; i++) {
        const int row = prg + 8 * i;
        if (row >= R) continue;
        const int nk = nk_s[row];
        if (nk <= kv_begin) continue; /* this token has no keys in the range */
        const int ns = (nk + PA_SPLIT - 1) / PA_SPLIT;
        const int64_t t = t0 + row / Gc;
        const int h = h0 + row % Gc;
        const int64_t grow = t * H + h, lrow = (t - o.tok0) * H + h;
        if (ns == 1) {
            float *dst = o.out + grow * HD + C::PD * pdg;
            const float l = l_s[row];
#pragma unroll
            for (int d = 0; d < C::PD; d++) dst[d] = __fdiv_rn(acc[i][d], l);
        } else {
            float *dst = o.part_acc + ((size_t)sp * o.rows + lrow) * HD + C::PD * pdg;
#pragma unroll
            for (int d = 0; d < C::PD; d++) dst[d] = acc[i][d];
            if (pdg == 0) {
                o.part_m[sp * o.rows + lrow] = m_s[row];
                o.part_l[sp * o.rows + lrow] = l_s[row];
            }
        }
    }
}

/* The merge of the tile kernel's ranges: st_attn_merge_row (loads spread over
 * the block); grid (sub-batch tokens * H), rows with one range skip. */
template <int HD>
static __global__ void __launch_bounds__(128)
    pa_merge_fast_kernel(st_paged_kv kv, const int32_t *__restrict__ seq, const int32_t *__restrict__ pos, int H,
                         int64_t max_nk, pa_out o) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t row = blockIdx.x;
    const pa_tok tk = pa_token(kv, seq, pos, o.tok0 + row / H, max_nk);
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
    if (ns <= 1) return; /* written directly (or NaN) by the main kernel; uniform over the block */
    st_attn_merge_row<HD>(o.part_acc, o.part_m, o.part_l, o.rows, row, ns, o.out + (o.tok0 * H + row) * HD);
}

/* ---- the decode kernel: one warp per (token, kv head, range) ---------------------------
 * Decode steps (about one token per sequence, GQA group G <= PD_MAX_G): the
 * tile kernel would stage each 32-key tile for G of its 64 rows and leave
 * most of its threads idle. Here a warp takes one token's G query heads of
 * one kv head and one PA_SPLIT-key range, with no block barrier (the
 * PD_WARPS warps of a block are independent), and per 32-key tile of the
 * range:
 *   - lane j scores key j against the G rows, q from shared memory (a
 *     broadcast). bf16 / fp8 caches: the tile's K rows are first copied
 *     into the warp's shared memory by cp.async, 16-byte chunks of 2..8
 *     whole rows per instruction (coalesced; a lane reading its own row
 *     from the cache touched a sector per key and instruction), the copy of
 *     the next tile issued as soon as this tile's scores are read, so it
 *     overlaps the softmax and PV; f32 rows (512 bytes at hd 128) would not
 *     fit 4 blocks per SM and are read straight into registers;
 *   - the online softmax runs across the warp (max by xor shuffles; the p
 *     sum by the tile kernel's tree, below);
 *   - lane l accumulates dims DPL l .. DPL l + DPL - 1 of every row over the
 *     tile's keys in order, its V rows read coalesced, all of the tile's
 *     loads issued before the first FMA.
 * Every row's arithmetic is the tile kernel's, operation for operation: the
 * score chain (fmaf over the dims in increasing order from 0, on q pre-scaled
 * by __fmul_rn), keys past the token's end at -inf, the exact tile max, p =
 * exp2f(s - base), the sum ((p_kg + p_kg+8) + p_kg+16) + p_kg+24 for kg < 8
 * then xor 1, 2, 4 over kg, l = l alpha + sum and acc = acc alpha with
 * __fmul_rn / __fadd_rn, acc = fmaf(p_j, v_j, acc) over the tile's keys in
 * order, the same ranges, output (acc / l, or the partials) and merge. So a
 * token's bits are the same here and in the tile kernel, and the batch
 * invariance holds across the two (gpu_check_ops: each token alone runs this
 * kernel, a batch with prefill tiles the tile kernel, compared bit for bit).
 * Invalid keys (block ids outside the pool) read as zeros, as the tile
 * kernel's zero-filled staging. */
#define PD_WARPS 4
#define PD_MAX_G 8
/* Fewer (token, kv head, range) items than this per SM: a block of 4 warps
 * each (pa_decb_kernel) rather than a warp each. bench_cuda_ops --only
 * paged-decode, H100, bf16 KV, 32/8 heads: one sequence at context 576 (72
 * items) 14.5 us with blocks, 20.4 with warps; at 4096 (512 items) 31.4 vs
 * 24.8; 8 sequences at 576 (576 items) 31.0 vs 24.0. */
#define PD_BLOCK_ITEMS_PER_SM 2

/* 8 elements of a cache row as loaded: f32 two float4, bf16 one uint4, fp8 one uint2 (in .x, .y) */
template <int KT>
struct pd_raw8 {
    uint4 a, b;
};
template <int KT>
ST_DEV pd_raw8<KT> pd_ld8(const unsigned char *row, int e, bool ok) {
    pd_raw8<KT> r;
    r.a = r.b = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return r;
    if constexpr (KT == ST_KV_F32) {
        r.a = __ldg((const uint4 *)(row + 4 * e));
        r.b = __ldg((const uint4 *)(row + 4 * e + 16));
    } else if constexpr (KT == ST_KV_BF16) {
        r.a = __ldg((const uint4 *)(row + 2 * e));
    } else {
        const uint2 u = __ldg((const uint2 *)(row + e));
        r.a = make_uint4(u.x, u.y, 0u, 0u);
    }
    return r;
}
template <int KT>
ST_DEV void pd_cvt8(const pd_raw8<KT> &r, float sc, float4 &lo, float4 &hi) {
    if constexpr (KT == ST_KV_F32) {
        lo = make_float4(__uint_as_float(r.a.x), __uint_as_float(r.a.y), __uint_as_float(r.a.z), __uint_as_float(r.a.w));
        hi = make_float4(__uint_as_float(r.b.x), __uint_as_float(r.b.y), __uint_as_float(r.b.z), __uint_as_float(r.b.w));
    } else {
        pa_cvt8w<KT>(r.a, sc, lo, hi);
    }
}

/* DPL elements of a V row (DPL = 2 or 4) as loaded: up to 16 bytes */
template <int KT, int DPL>
ST_DEV uint4 pd_ldv(const unsigned char *p, bool ok) {
    constexpr int B = DPL * (KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1);
    uint4 r = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return r;
    if constexpr (B == 16) r = __ldg((const uint4 *)p);
    else if constexpr (B == 8) {
        const uint2 u = __ldg((const uint2 *)p);
        r.x = u.x, r.y = u.y;
    } else if constexpr (B == 4) r.x = __ldg((const unsigned int *)p);
    else r.x = __ldg((const unsigned short *)p);
    return r;
}
template <int KT, int DPL>
ST_DEV void pd_cvtv(uint4 r, float sc, float v[DPL]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
    if constexpr (KT == ST_KV_F32) {
#pragma unroll
        for (int i = 0; i < DPL; i++) v[i] = __uint_as_float(w[i]);
    } else if constexpr (KT == ST_KV_BF16) {
#pragma unroll
        for (int i = 0; i < DPL / 2; i++) {
            const float2 f = pa_bf16x2(w[i]);
            v[2 * i] = f.x, v[2 * i + 1] = f.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < DPL / 2; i++) {
            const float2 f = pa_fp8x2(w[i / 2] >> (16 * (i & 1)), sc);
            v[2 * i] = f.x, v[2 * i + 1] = f.y;
        }
    }
}

/* A staged K tile (pa_dec_kernel, bf16 / fp8): key j's row of RB = HD x ES
 * bytes at j RB, its 16-byte chunk c (CPR = RB / 16 of them) at chunk
 * pd_swz(c, j) of the row, so the lanes of one 128-bit shared load (8 keys,
 * one chunk each) read 8 different bank groups. */
template <int CPR>
ST_DEV int pd_swz(int c, int j) {
    static_assert(CPR == 4 || CPR % 8 == 0, "rows of 64 bytes or a multiple of 128");
    return CPR >= 8 ? c ^ (j & 7) : c ^ ((j >> 1) & 3);
}
/* The 8 elements at e of key j's row in a staged tile, as pd_ld8 loads them. */
template <int HD, int KT>
ST_DEV pd_raw8<KT> pd_lds8(const unsigned char *k_s, int j, int e, bool ok) {
    constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1, RB = HD * ES;
    pd_raw8<KT> r;
    r.a = r.b = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return r;
    const int b = e * ES; /* byte in the row */
    const unsigned char *row = k_s + j * RB, *p = row + 16 * pd_swz<RB / 16>(b / 16, j) + b % 16;
    if constexpr (KT == ST_KV_F32) {
        r.a = *(const uint4 *)p;
        r.b = *(const uint4 *)(row + 16 * pd_swz<RB / 16>(b / 16 + 1, j));
    } else if constexpr (KT == ST_KV_BF16) {
        r.a = *(const uint4 *)p;
    } else {
        const uint2 u = *(const uint2 *)p;
        r.a = make_uint4(u.x, u.y, 0u, 0u);
    }
    return r;
}

/* The K rows at offs[0..TK) (-1: none, not copied) of the cache kc into the
 * staged tile k_s by the threads i0, i0 + step, ... (a warp or a block):
 * 16-byte cp.async chunks, 32 / CPR whole rows per warp instruction; one
 * commit group per thread. */
template <int HD, int KT>
ST_DEV void pd_stage_k(unsigned char *k_s, const unsigned char *kc, const int64_t *offs, int i0, int step) {
    constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1, RB = HD * ES, CPR = RB / 16;
#pragma unroll 4
    for (int i = i0; i < PT_TK * CPR; i += step) {
        const int j = i / CPR, ch = i % CPR;
        const int64_t oj = offs[j];
        if (oj >= 0) st_cp_async16(k_s + j * RB + 16 * pd_swz<CPR>(ch, j), kc + oj + 16 * ch, true);
    }
    st_cp_async_commit();
}

/* The scores of NR rows of q_s (row(i): the q_s row of score i, -1: none)
 * against this lane's key (its K row at krow, zeros when !ok): per row the
 * tile kernel's chain, fmaf over the dims in increasing order from 0. The
 * raw K elements are loaded KREG registers at a time, ld(e) giving the 8
 * at element e (pd_ld8: from the cache; pd_lds8: from a staged tile). */
template <int HD, int KT, int NR, int KREG = 64, class Ld, class RowOf>
ST_DEV void pd_scores(Ld ld, float ksc, const float *q_s, RowOf row, float s[NR]) {
    constexpr int CW = KT == ST_KV_F32 ? 8 : KT == ST_KV_BF16 ? 4 : 2; /* registers per 8 raw K elements */
    constexpr int CG = HD / 8 < KREG / CW ? HD / 8 : KREG / CW;        /* 8-element K chunks loaded at once */
#pragma unroll
    for (int i = 0; i < NR; i++) s[i] = 0.0f;
#pragma unroll
    for (int g0 = 0; g0 < HD / 8; g0 += CG) {
        pd_raw8<KT> kr[CG];
#pragma unroll
        for (int c = 0; c < CG; c++) kr[c] = ld(8 * (g0 + c));
#pragma unroll
        for (int c = 0; c < CG; c++) {
            float4 lo, hi;
            pd_cvt8<KT>(kr[c], ksc, lo, hi);
            const int d = 8 * (g0 + c);
#pragma unroll
            for (int i = 0; i < NR; i++) {
                const int r = row(i);
                if (r >= 0) {
                    const float4 qa = *(const float4 *)(q_s + r * HD + d), qb = *(const float4 *)(q_s + r * HD + d + 4);
                    float a = s[i];
                    a = fmaf(qa.x, lo.x, a);
                    a = fmaf(qa.y, lo.y, a);
                    a = fmaf(qa.z, lo.z, a);
                    a = fmaf(qa.w, lo.w, a);
                    a = fmaf(qb.x, hi.x, a);
                    a = fmaf(qb.y, hi.y, a);
                    a = fmaf(qb.z, hi.z, a);
                    a = fmaf(qb.w, hi.w, a);
                    s[i] = a;
                }
            }
        }
    }
}

/* One row's online-softmax step over a 32-key tile, across the warp (lane j:
 * key j; c >= 1 keys taken, the rest at -inf): the tile kernel's operations,
 * its p-sum tree ((p_kg + p_kg+8) + p_kg+16) + p_kg+24 for kg < 8, then
 * xor 1, 2, 4. Updates (m, l), returns this lane's p; alpha: acc's factor. */
ST_DEV float pd_softmax(float s, int c, int lane, float &m, float &l, float &alpha) {
    const float sv = lane < c ? s : -INFINITY;
    const float mx = st_warp_max(sv);
    const float mnew = fmaxf(m, mx);
    const float base = mnew == -INFINITY ? 0.0f : mnew;
    const float p = exp2f(__fsub_rn(sv, base));
    const float p8 = __shfl_down_sync(0xffffffffu, p, 8), p16 = __shfl_down_sync(0xffffffffu, p, 16),
                p24 = __shfl_down_sync(0xffffffffu, p, 24);
    float sum = __fadd_rn(__fadd_rn(__fadd_rn(p, p8), p16), p24); /* lanes kg < 8 */
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 4));
    sum = __shfl_sync(0xffffffffu, sum, 0);
    alpha = exp2f(__fsub_rn(m, base));
    l = __fadd_rn(__fmul_rn(l, alpha), sum);
    m = mnew;
    return p;
}

/* Key j's slot in the tile at kb (the lane's key), its K / V row's byte offset (-1: none) and fp8 scales. */
template <int HD, int KT>
ST_DEV int64_t pd_key(const st_paged_kv &kv, const pa_tok &tk, int64_t kb, int lane, int c, int kvh, int Hkv,
                      float &ksc, float &vsc) {
    constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1;
    const int64_t bs = kv.block_size, slot = lane < c ? pa_slot(tk, kb + lane, bs, kv.cache.n_slots / bs) : -1;
    ksc = vsc = 1.0f;
    if constexpr (KT == ST_KV_FP8) {
        ksc = slot >= 0 ? __ldg(kv.cache.k_scale + slot * Hkv + kvh) : 0.0f;
        vsc = slot >= 0 ? __ldg(kv.cache.v_scale + slot * Hkv + kvh) : 0.0f;
    }
    return slot >= 0 ? (slot * (int64_t)Hkv * HD + (int64_t)kvh * HD) * ES : -1;
}

/* A decode kernel's item (token t, kv head kvh, range sp) from its index;
 * false past the sub-batch's tokens. */
struct pd_item {
    int sp, kvh, h0;
    int64_t t;
};
ST_DEV bool pd_item_of(int64_t item, int nsplit, const pa_out &o, int H, int Hkv, pd_item &it) {
    const int64_t th = item / nsplit;
    if (th >= o.rows / H * Hkv) return false;
    it.sp = (int)(item % nsplit);
    it.kvh = (int)(th % Hkv);
    it.h0 = it.kvh * (H / Hkv);
    it.t = o.tok0 + th / Hkv;
    return true;
}

/* Threads i0, i0 + step, ... of an item: its G output rows as NaN (an
 * invalid token), or its q rows times qscale into q_s [GM][HD] (zeros past G). */
template <int HD>
ST_DEV void pd_nan_rows(const pa_out &o, const pd_item &it, int H, int G, int i0, int step) {
    for (int i = i0; i < G * HD; i += step) o.out[(it.t * H + it.h0 + i / HD) * HD + i % HD] = __int_as_float(0x7fc00000);
}
template <int HD, int GM>
ST_DEV void pd_load_q(const float *__restrict__ q, const pd_item &it, int H, int G, float qscale, float *q_s, int i0,
                      int step) {
    for (int i = i0; i < GM * HD / 4; i += step) {
        const int r = i / (HD / 4), d4 = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < G) {
            x = __ldg((const float4 *)(q + ((it.t * H + it.h0 + r) * HD)) + d4);
            x = make_float4(__fmul_rn(x.x, qscale), __fmul_rn(x.y, qscale), __fmul_rn(x.z, qscale),
                            __fmul_rn(x.w, qscale));
        }
        *(float4 *)(q_s + r * HD + 4 * d4) = x;
    }
}

/* Blocks per SM the registers are bound to: at 212 registers (2 blocks),
 * bf16 hd 128 GQA 4, a batch of 64 sequences at context 576 kept 1.8 warps
 * per scheduler and the DRAM 38% busy (Nsight Compute, H100): latency-bound.
 * So a lane's raw K is loaded 16 registers at a time, its raw V 32 (VPF);
 * 4 blocks for hd 128 up to 4 rows, 3 for hd 64, 2 for 8 rows (sm_90a,
 * CUDA 13.0: 16 bytes of spill for bf16 hd 128, none elsewhere). */
__host__ __device__ constexpr int pd_min_blocks(int hd, int gm) { return gm > 4 ? 2 : hd == 128 ? 4 : 3; }

template <int HD, int GM, int KT>
struct pd_cfg {
    static constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1; /* bytes per element */
    static constexpr bool STAGE = KT != ST_KV_F32;                          /* K tiles through shared memory */
    static constexpr int KTILE = STAGE ? PT_TK * HD * ES : 0;               /* bytes of a warp's K tile */
    /* q [GM][HD], p [GM][TK], fp8 V scales [2][TK] by tile parity */
    static constexpr int WARP_FLOATS = GM * HD + GM * PT_TK + 2 * PT_TK;
    /* K tiles [PD_WARPS], the warps' floats, the key offsets [PD_WARPS][2][TK] by tile parity */
    static constexpr size_t smem = PD_WARPS * ((size_t)KTILE + WARP_FLOATS * sizeof(float) + 2 * PT_TK * sizeof(int64_t));
    static_assert(smem <= 228 * 1024 / pd_min_blocks(HD, GM) - 1024, "as many blocks per SM as the registers allow");
};

/* grid (ceil(sub-batch tokens x Hkv x ranges / PD_WARPS)); PD_WARPS warps; G <= GM. */
template <int HD, int GM, int KT>
static __global__ void __launch_bounds__(32 * PD_WARPS, pd_min_blocks(HD, GM))
    pa_dec_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                  const int32_t *__restrict__ pos, int H, int Hkv, int nsplit, int64_t max_nk, float qscale,
                  pa_out o) {
    using C = pd_cfg<HD, GM, KT>;
    constexpr int DPL = HD / 32;                                       /* PV: dims per lane */
    constexpr int ES = C::ES;                                          /* bytes per element */
    constexpr int VPF = KT == ST_KV_F32 ? 8 : KT == ST_KV_BF16 ? 16 : PT_TK; /* V rows loaded at once: 32 registers */
    extern __shared__ float4 pd_smem4[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char *k_s = (unsigned char *)pd_smem4 + warp * C::KTILE; /* [TK][HD * ES], chunks by pd_swz */
    float *const f_s = (float *)((unsigned char *)pd_smem4 + PD_WARPS * C::KTILE);
    float *q_s = f_s + warp * C::WARP_FLOATS; /* [GM][HD] */
    float *p_s = q_s + GM * HD;              /* [GM][TK] */
    float *vsc_s = p_s + GM * PT_TK;          /* [2][TK] fp8: V scales of the tile's keys */
    int64_t *off_s = (int64_t *)(f_s + PD_WARPS * C::WARP_FLOATS) + warp * 2 * PT_TK; /* [2][TK] */
    st_pdl_wait();
    st_pdl_trigger();

    pd_item it;
    if (!pd_item_of((int64_t)blockIdx.x * PD_WARPS + warp, nsplit, o, H, Hkv, it)) return;
    const int sp = it.sp, kvh = it.kvh, G = H / Hkv, h0 = it.h0;
    const int64_t t = it.t;
    const pa_tok tk = pa_token(kv, seq, pos, t, max_nk);
    if (tk.nk == 0) { /* a NaN row each, written by the first range's warp */
        if (sp == 0) pd_nan_rows<HD>(o, it, H, G, lane, 32);
        return;
    }
    const int64_t kv_begin = (int64_t)sp * PA_SPLIT;
    if (tk.nk <= kv_begin) return; /* no keys in this range */
    const int64_t kv_end = min(tk.nk, kv_begin + PA_SPLIT);
    const unsigned char *kc = (const unsigned char *)kv.cache.k, *vc = (const unsigned char *)kv.cache.v;
    const int ntiles = (int)((kv_end - kv_begin + PT_TK - 1) / PT_TK);
    /* tile tt's keys the token takes (>= 1), and lane j's key kb + j: its row offset (-1: none) and fp8 scales */
    auto keys_of = [&](int tt) { return (int)min((int64_t)PT_TK, tk.nk - (kv_begin + (int64_t)tt * PT_TK)); };
    auto key_of = [&](int tt, float &ksc, float &vsc) {
        return pd_key<HD, KT>(kv, tk, kv_begin + (int64_t)tt * PT_TK, lane, keys_of(tt), kvh, Hkv, ksc, vsc);
    };
    auto stage_k = [&](const int64_t *offs) {
        if constexpr (C::STAGE) pd_stage_k<HD, KT>(k_s, kc, offs, lane, 32);
    };
    float ksc, vsc;
    int64_t roff = key_of(0, ksc, vsc);
    off_s[lane] = roff;
    if constexpr (KT == ST_KV_FP8) vsc_s[lane] = vsc;
    __syncwarp();
    stage_k(off_s);
    pd_load_q<HD, GM>(q, it, H, G, qscale, q_s, lane, 32);
    __syncwarp();

    float m_r[GM], l_r[GM], acc[GM][DPL];
#pragma unroll
    for (int r = 0; r < GM; r++) {
        m_r[r] = -INFINITY, l_r[r] = 0.0f;
#pragma unroll
        for (int d = 0; d < DPL; d++) acc[r][d] = 0.0f;
    }
    for (int tt = 0; tt < ntiles; tt++) {
        const int c = keys_of(tt), nb = (tt + 1) & 1;
        const int64_t *offs = off_s + (tt & 1) * PT_TK;
        const float *vscs = vsc_s + (tt & 1) * PT_TK;
        float ksc_n = 0.0f, vsc_n = 0.0f;
        const int64_t roff_n = tt + 1 < ntiles ? key_of(tt + 1, ksc_n, vsc_n) : -1; /* its loads issued early */
        /* the tile's V: this lane's dims of the keys the token takes, VPF keys at
         * a time, the first VPF loaded before the scores */
        uint4 vr[VPF];
        auto load_v = [&](int j0) {
#pragma unroll
            for (int i = 0; i < VPF; i++) {
                const int64_t oj = offs[j0 + i];
                vr[i] = pd_ldv<KT, DPL>(vc + oj + (int64_t)(DPL * lane) * ES, j0 + i < c && oj >= 0);
            }
        };
        load_v(0);
        const bool ok = roff >= 0;
        auto rows = [&](int i) { return i < G ? i : -1; };
        float s[GM];
        if constexpr (C::STAGE) {
            st_cp_async_wait<0>();
            __syncwarp(); /* every lane's chunks in k_s */
            pd_scores<HD, KT, GM, 16>([&](int e) { return pd_lds8<HD, KT>(k_s, lane, e, ok); }, ksc, q_s, rows, s);
            __syncwarp(); /* k_s read: the next tile's copy may land */
        } else {
            const unsigned char *krow = kc + (ok ? roff : 0);
            pd_scores<HD, KT, GM, 16>([&](int e) { return pd_ld8<KT>(krow, e, ok); }, ksc, q_s, rows, s);
        }
        if (tt + 1 < ntiles) { /* the next tile's keys, and its K copy in flight during this tile's softmax and PV */
            off_s[nb * PT_TK + lane] = roff_n;
            if constexpr (KT == ST_KV_FP8) vsc_s[nb * PT_TK + lane] = vsc_n;
            __syncwarp();
            stage_k(off_s + nb * PT_TK);
        }
        /* online softmax per row (c >= 1: every row commits) */
#pragma unroll
        for (int r = 0; r < GM; r++) {
            if (r >= G) continue;
            float alpha;
            p_s[r * PT_TK + lane] = pd_softmax(s[r], c, lane, m_r[r], l_r[r], alpha);
#pragma unroll
            for (int d = 0; d < DPL; d++) acc[r][d] = __fmul_rn(acc[r][d], alpha);
        }
        __syncwarp();
        /* PV over the tile's keys in order */
#pragma unroll
        for (int j4 = 0; j4 < PT_TK / 4; j4++) {
            if (4 * j4 >= c) break; /* warp-uniform */
            if (j4 > 0 && (4 * j4) % VPF == 0) load_v(4 * j4);
            float4 pv[GM];
#pragma unroll
            for (int r = 0; r < GM; r++)
                if (r < G) pv[r] = *(const float4 *)(p_s + r * PT_TK + 4 * j4);
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * j4 + jj;
                if (j < c) {
                    float v[DPL];
                    pd_cvtv<KT, DPL>(vr[j % VPF], KT == ST_KV_FP8 ? vscs[j] : 1.0f, v);
#pragma unroll
                    for (int r = 0; r < GM; r++) {
                        if (r < G) {
                            const float pj = jj == 0 ? pv[r].x : jj == 1 ? pv[r].y : jj == 2 ? pv[r].z : pv[r].w;
#pragma unroll
                            for (int d = 0; d < DPL; d++) acc[r][d] = fmaf(pj, v[d], acc[r][d]);
                        }
                    }
                }
            }
        }
        __syncwarp(); /* p_s, and this parity's offsets and V scales, are rewritten by later tiles */
        roff = roff_n, ksc = ksc_n;
    }
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
#pragma unroll
    for (int r = 0; r < GM; r++) {
        if (r >= G) continue;
        const int64_t grow = t * H + h0 + r, lrow = (t - o.tok0) * H + h0 + r;
        if (ns == 1) {
            float *dst = o.out + grow * HD + DPL * lane;
#pragma unroll
            for (int d = 0; d < DPL; d++) dst[d] = __fdiv_rn(acc[r][d], l_r[r]);
        } else {
            float *dst = o.part_acc + ((size_t)sp * o.rows + lrow) * HD + DPL * lane;
#pragma unroll
            for (int d = 0; d < DPL; d++) dst[d] = acc[r][d];
            if (lane == 0) {
                o.part_m[sp * o.rows + lrow] = m_r[r];
                o.part_l[sp * o.rows + lrow] = l_r[r];
            }
        }
    }
}

/* The decode kernel for few items (a batch of a few sequences: one warp per
 * item would leave most SMs with one warp): one block of 4 warps per
 * (token, kv head, range). Per 32-key tile, warp w scores rows w, w + 4 of
 * the GQA group (lane j: key j, its K row from the cache) and runs their
 * online softmax; then thread (d, i) accumulates dim d of rows
 * i, i + 128 / HD, ... over the tile's keys in order, its V elements loaded
 * before the scores. The same per-row arithmetic as pa_dec_kernel (the
 * same helpers), so the same bits. */
template <int HD, int GM, int KT>
static __global__ void __launch_bounds__(128)
    pa_decb_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                   const int32_t *__restrict__ pos, int H, int Hkv, int nsplit, int64_t max_nk, float qscale,
                   pa_out o) {
    constexpr int RW = GM / 4;                                         /* score rows per warp */
    constexpr int TPD = 128 / HD;                                      /* PV: threads per dim */
    constexpr int PR = GM / TPD;                                       /* PV: rows per thread */
    constexpr int ES = KT == ST_KV_F32 ? 4 : KT == ST_KV_BF16 ? 2 : 1; /* bytes per element */
    __shared__ __align__(16) unsigned char k_s[PT_TK * HD * ES]; /* the tile's K rows, chunks by pd_swz */
    __shared__ __align__(16) float q_s[GM * HD];
    __shared__ __align__(16) float p_s[GM * PT_TK];
    __shared__ float alpha_s[GM], m_s[GM], l_s[GM], vsc_s[2][PT_TK]; /* fp8 V scales by tile parity */
    __shared__ int64_t off_s[2][PT_TK];                                /* key offsets by tile parity */
    st_pdl_wait();
    st_pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    pd_item it;
    if (!pd_item_of(blockIdx.x, nsplit, o, H, Hkv, it)) return;
    const int sp = it.sp, kvh = it.kvh, G = H / Hkv, h0 = it.h0;
    const int64_t t = it.t;
    const pa_tok tk = pa_token(kv, seq, pos, t, max_nk);
    if (tk.nk == 0) { /* a NaN row each, written by the first range's block */
        if (sp == 0) pd_nan_rows<HD>(o, it, H, G, tid, 128);
        return;
    }
    const int64_t kv_begin = (int64_t)sp * PA_SPLIT;
    if (tk.nk <= kv_begin) return; /* no keys in this range */
    const int64_t kv_end = min(tk.nk, kv_begin + PA_SPLIT);
    const unsigned char *kc = (const unsigned char *)kv.cache.k, *vc = (const unsigned char *)kv.cache.v;
    const int ntiles = (int)((kv_end - kv_begin + PT_TK - 1) / PT_TK);
    /* tile tt's keys the token takes (>= 1), and lane j's key kb + j: its row offset (-1: none) and fp8 scales */
    auto keys_of = [&](int tt) { return (int)min((int64_t)PT_TK, tk.nk - (kv_begin + (int64_t)tt * PT_TK)); };
    auto key_of = [&](int tt, float &ksc, float &vsc) {
        return pd_key<HD, KT>(kv, tk, kv_begin + (int64_t)tt * PT_TK, lane, keys_of(tt), kvh, Hkv, ksc, vsc);
    };
    float ksc, vsc;
    int64_t roff = key_of(0, ksc, vsc); /* every warp: its lanes' keys (warp 0 publishes them) */
    if (warp == 0) off_s[0][lane] = roff, vsc_s[0][lane] = vsc;
    __syncthreads();
    pd_stage_k<HD, KT>(k_s, kc, off_s[0], tid, 128);
    pd_load_q<HD, GM>(q, it, H, G, qscale, q_s, tid, 128);
    float m_r[RW], l_r[RW];
#pragma unroll
    for (int i = 0; i < RW; i++) m_r[i] = -INFINITY, l_r[i] = 0.0f;
    const int pd = tid % HD, pr0 = tid / HD; /* PV: dim pd of rows pr0 + TPD i */
    float acc[PR];
#pragma unroll
    for (int i = 0; i < PR; i++) acc[i] = 0.0f;
    for (int tt = 0; tt < ntiles; tt++) {
        const int c = keys_of(tt), b = tt & 1;
        float ksc_n = 0.0f, vsc_n = 0.0f;
        const int64_t roff_n = tt + 1 < ntiles ? key_of(tt + 1, ksc_n, vsc_n) : -1; /* its loads issued early */
        uint32_t vr[PT_TK]; /* dim pd of each key's V row, raw */
#pragma unroll
        for (int j = 0; j < PT_TK; j++) {
            const int64_t oj = off_s[b][j];
            const unsigned char *pv = vc + oj + (int64_t)pd * ES;
            uint32_t w = 0;
            if (j < c && oj >= 0) {
                if constexpr (ES == 4) w = __ldg((const unsigned int *)pv);
                else if constexpr (ES == 2) w = __ldg((const unsigned short *)pv);
                else w = __ldg(pv);
            }
            vr[j] = w;
        }
        /* this thread's K chunks landed; the barrier: everyone's (and q_s on the
         * first tile), and the previous tile's p_s and alpha_s read */
        st_cp_async_wait<0>();
        __syncthreads();
        const bool ok = roff >= 0;
        float s[RW];
        pd_scores<HD, KT, RW>([&](int e) { return pd_lds8<HD, KT>(k_s, lane, e, ok); }, ksc, q_s,
                              [&](int i) { return warp + 4 * i < G ? warp + 4 * i : -1; }, s);
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const int r = warp + 4 * i;
            if (r >= G) continue;
            float alpha;
            p_s[r * PT_TK + lane] = pd_softmax(s[i], c, lane, m_r[i], l_r[i], alpha);
            if (lane == 0) alpha_s[r] = alpha;
        }
        if (warp == 0 && tt + 1 < ntiles) off_s[b ^ 1][lane] = roff_n, vsc_s[b ^ 1][lane] = vsc_n;
        __syncthreads(); /* p_s, alpha_s and the next tile's offsets written; k_s read */
        if (tt + 1 < ntiles) pd_stage_k<HD, KT>(k_s, kc, off_s[b ^ 1], tid, 128); /* in flight during PV */
#pragma unroll
        for (int i = 0; i < PR; i++) {
            const int r = pr0 + TPD * i;
            if (r < G) acc[i] = __fmul_rn(acc[i], alpha_s[r]);
        }
#pragma unroll
        for (int j = 0; j < PT_TK; j++) {
            if (j >= c) break; /* block-uniform */
            float v;
            if constexpr (KT == ST_KV_F32) v = __uint_as_float(vr[j]);
            else if constexpr (KT == ST_KV_BF16) v = __uint_as_float(vr[j] << 16);
            else v = pa_fp8x2(vr[j], vsc_s[b][j]).x;
#pragma unroll
            for (int i = 0; i < PR; i++) {
                const int r = pr0 + TPD * i;
                if (r < G) acc[i] = fmaf(p_s[r * PT_TK + j], v, acc[i]);
            }
        }
        roff = roff_n, ksc = ksc_n;
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < RW; i++)
            if (warp + 4 * i < G) m_s[warp + 4 * i] = m_r[i], l_s[warp + 4 * i] = l_r[i];
    __syncthreads();
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
#pragma unroll
    for (int i = 0; i < PR; i++) {
        const int r = pr0 + TPD * i;
        if (r >= G) continue;
        const int64_t grow = t * H + h0 + r, lrow = (t - o.tok0) * H + h0 + r;
        if (ns == 1) {
            o.out[grow * HD + pd] = __fdiv_rn(acc[i], l_s[r]);
        } else {
            o.part_acc[((size_t)sp * o.rows + lrow) * HD + pd] = acc[i];
            if (pd == 0) {
                o.part_m[sp * o.rows + lrow] = m_s[r];
                o.part_l[sp * o.rows + lrow] = l_s[r];
            }
        }
    }
}

/* ---- generic: any head_dim or alignment, one block per (token, head) ----------------- */

#define PG_THREADS 128

/* grid (sub-batch tokens * H, ranges); smem: q [hd], acc [hd], p [128]. Same
 * ranges and merge as the tile kernel; keys 128 at a time within a range;
 * elements of the cache's type KT read one at a time (pa_ld). */
template <int KT>
static __global__ void __launch_bounds__(PG_THREADS)
    pa_generic_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                      const int32_t *__restrict__ pos, int H, int Hkv, int hd, int64_t max_nk, float qscale,
                      pa_out o) {
    extern __shared__ float pg_sm[];
    float *q_s = pg_sm, *acc_s = pg_sm + hd, *p_s = acc_s + hd;
    __shared__ float red[32];
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t lrow = blockIdx.x, t = o.tok0 + lrow / H, grow = o.tok0 * H + lrow;
    const int h = (int)(lrow % H), kvh = h / (H / Hkv), sp = blockIdx.y;
    const pa_tok tk = pa_token(kv, seq, pos, t, max_nk);
    if (tk.nk == 0) {
        if (sp == 0)
            for (int d = threadIdx.x; d < hd; d += PG_THREADS) o.out[grow * hd + d] = __int_as_float(0x7fc00000);
        return;
    }
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
    if (sp >= ns) return;
    const int64_t begin = (int64_t)sp * PA_SPLIT, end = min(tk.nk, begin + PA_SPLIT);
    const int64_t bs = kv.block_size, n_blocks = kv.cache.n_slots / bs, kv_stride = (int64_t)Hkv * hd;
    for (int d = threadIdx.x; d < hd; d += PG_THREADS) {
        q_s[d] = q[grow * hd + d] * qscale;
        acc_s[d] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int64_t kb = begin; kb < end; kb += PG_THREADS) {
        const int64_t key = kb + threadIdx.x;
        float sv = -INFINITY;
        if (key < end) {
            const int64_t slot = pa_slot(tk, key, bs, n_blocks);
            float s = 0.0f;
            if (slot >= 0) {
                const size_t kr = (size_t)slot * kv_stride + (size_t)kvh * hd;
                const float sc = pa_scale<KT>(kv.cache, false, slot * Hkv + kvh);
                for (int d = 0; d < hd; d++) s = fmaf(q_s[d], pa_ld<KT>(kv.cache.k, kr + d, sc), s);
            }
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
        const int nk = (int)min((int64_t)PG_THREADS, end - kb);
        for (int d = threadIdx.x; d < hd; d += PG_THREADS) {
            float a = acc_s[d] * alpha;
            for (int j = 0; j < nk; j++) {
                const int64_t slot = pa_slot(tk, kb + j, bs, n_blocks);
                const float vv = slot >= 0 ? pa_ld<KT>(kv.cache.v, (size_t)slot * kv_stride + (size_t)kvh * hd + d,
                                                       pa_scale<KT>(kv.cache, true, slot * Hkv + kvh))
                                           : 0.0f;
                a = fmaf(p_s[j], vv, a);
            }
            acc_s[d] = a;
        }
        __syncthreads();
    }
    for (int d = threadIdx.x; d < hd; d += PG_THREADS) {
        if (ns == 1) {
            o.out[grow * hd + d] = acc_s[d] / l;
        } else {
            o.part_acc[((size_t)sp * o.rows + lrow) * hd + d] = acc_s[d];
            if (d == 0) {
                o.part_m[sp * o.rows + lrow] = m;
                o.part_l[sp * o.rows + lrow] = l;
            }
        }
    }
}

/* ---- dispatch ------------------------------------------------------------------------ */

template <int HD, int NBUF, int KT>
static strata_status pt_set_attr() {
    ST_CUDA_TRY(cudaFuncSetAttribute(pa_tile_kernel<HD, NBUF, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)pt_cfg<HD, NBUF, KT>::smem));
    return STRATA_OK;
}

/* The tile kernel's variants for one cache type (f32 double-buffers its fp32
 * tiles, bf16 / fp8 have one plus the raw tile). */
template <int KT>
static strata_status pt_set_attrs() {
    constexpr int NB = KT == ST_KV_F32 ? 2 : 1;
    strata_status st;
    if ((st = pt_set_attr<64, NB, KT>()) != STRATA_OK) return st;
    return pt_set_attr<128, NB, KT>();
}

/* The decode kernel's variants for one cache type (bf16 hd 128 with 8 rows: 55 KB). */
template <int KT>
static strata_status pd_set_attrs() {
#define PD_ATTR(HD, GM)                                                                                              \
    ST_CUDA_TRY(cudaFuncSetAttribute(pa_dec_kernel<HD, GM, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize,          \
                                     (int)pd_cfg<HD, GM, KT>::smem))
    PD_ATTR(64, 4);
    PD_ATTR(64, 8);
    PD_ATTR(128, 4);
    PD_ATTR(128, 8);
#undef PD_ATTR
    return STRATA_OK;
}

strata_status st_cuda_attention_paged_setup(st_cuda *c) {
    strata_status st;
    if ((st = pt_set_attrs<ST_KV_F32>()) != STRATA_OK) return st;
    if ((st = pt_set_attrs<ST_KV_BF16>()) != STRATA_OK) return st;
    if ((st = pt_set_attrs<ST_KV_FP8>()) != STRATA_OK) return st;
    if ((st = pd_set_attrs<ST_KV_F32>()) != STRATA_OK) return st;
    if ((st = pd_set_attrs<ST_KV_BF16>()) != STRATA_OK) return st;
    return pd_set_attrs<ST_KV_FP8>();
}

template <int HD, int NBUF, int KT>
static strata_status pa_launch_tile(st_cuda *c, cudaStream_t s, const float *q, const st_paged_kv &kv,
                                    const int32_t *seq, const int32_t *pos, int64_t nt, int H, int Hkv, int nsplit,
                                    int64_t max_nk, float qscale, const pa_out &o) {
    const int G = H / Hkv, GC = G < PT_ROWS ? G : PT_ROWS, hchunks = (G + GC - 1) / GC, TQ = PT_ROWS / GC;
    ST_CUDA_TRY(st_launch(c->pdl, pa_tile_kernel<HD, NBUF, KT>,
                          dim3((unsigned)nt, (unsigned)(Hkv * hchunks), (unsigned)nsplit), dim3(PA_THREADS),
                          pt_cfg<HD, NBUF, KT>::smem, s, q, kv, seq, pos, H, Hkv, hchunks, GC, TQ, max_nk,
                          qscale, o));
    if (nsplit > 1)
        ST_CUDA_TRY(st_launch(c->pdl, pa_merge_fast_kernel<HD>, dim3((unsigned)(nt * H)), dim3(128), 0, s, kv, seq,
                              pos, H, max_nk, o));
    return STRATA_OK;
}

/* The decode kernel: G query heads per warp in GM rows. */
template <int HD, int GM, int KT>
static strata_status pa_launch_dec(st_cuda *c, cudaStream_t s, const float *q, const st_paged_kv &kv,
                                   const int32_t *seq, const int32_t *pos, int64_t nt, int H, int Hkv, int nsplit,
                                   int64_t max_nk, float qscale, const pa_out &o) {
    const int64_t items = nt * Hkv * nsplit;
    if (items > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: %lld tokens x %d kv heads x %d ranges is too many",
                      (long long)nt, Hkv, nsplit);
    if (c->paged_dec == 1 || (c->paged_dec == 0 && items < PD_BLOCK_ITEMS_PER_SM * (int64_t)c->sm_count))
        ST_CUDA_TRY(st_launch(c->pdl, pa_decb_kernel<HD, GM, KT>, dim3((unsigned)items), dim3(128), 0, s, q, kv, seq,
                              pos, H, Hkv, nsplit, max_nk, qscale, o));
    else
        ST_CUDA_TRY(st_launch(c->pdl, pa_dec_kernel<HD, GM, KT>, dim3((unsigned)((items + PD_WARPS - 1) / PD_WARPS)),
                              dim3(32 * PD_WARPS), pd_cfg<HD, GM, KT>::smem, s, q, kv, seq, pos, H, Hkv, nsplit, max_nk,
                              qscale, o));
    if (nsplit > 1)
        ST_CUDA_TRY(st_launch(c->pdl, pa_merge_fast_kernel<HD>, dim3((unsigned)(nt * H)), dim3(128), 0, s, kv, seq,
                              pos, H, max_nk, o));
    return STRATA_OK;
}

/* Cache type KT, hd 64 or 128: the decode kernel (dec: G <= PD_MAX_G) or the tile kernel. */
template <int KT>
static strata_status pa_tile_kt(st_cuda *c, cudaStream_t s, const float *q, const st_paged_kv &kv,
                                const int32_t *seq, const int32_t *pos, int64_t nt, int H, int Hkv, int hd,
                                bool dec, int nsplit, int64_t max_nk, float qscale, const pa_out &o) {
    constexpr int NB = KT == ST_KV_F32 ? 2 : 1;
    if (dec) {
        const bool g4 = H / Hkv <= 4;
        if (hd == 64)
            return g4 ? pa_launch_dec<64, 4, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o)
                      : pa_launch_dec<64, 8, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o);
        return g4 ? pa_launch_dec<128, 4, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o)
                  : pa_launch_dec<128, 8, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o);
    }
    return hd == 64 ? pa_launch_tile<64, NB, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o)
                    : pa_launch_tile<128, NB, KT>(c, s, q, kv, seq, pos, nt, H, Hkv, nsplit, max_nk, qscale, o);
}

strata_status st_cuda_op_attention_paged(st_backend *be, st_cuda_stream *s, const float *q, const st_paged_kv *kv,
                                         const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    st_cuda *c = st_cuda_of(be);
    if (n > INT32_MAX / n_heads || n_heads > 4096 || head_dim > 4096)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: n = %lld, n_heads = %lld, head_dim = %lld: too large",
                      (long long)n, (long long)n_heads, (long long)head_dim);
    const int H = (int)n_heads, Hkv = (int)n_kv_heads, hd = (int)head_dim, G = H / Hkv;
    const float qscale = scale * LOG2E;
    const int64_t max_ctx = kv->max_ctx > 0 ? kv->max_ctx : 1;
    const int64_t nsplit64 = (max_ctx + PA_SPLIT - 1) / PA_SPLIT;
    if (nsplit64 > 65535)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: max_ctx = %lld is too large (%d keys per range, "
                      "65535 ranges)", (long long)kv->max_ctx, PA_SPLIT);
    const int nsplit = (int)nsplit64;
    const st_kv_layer &L = kv->cache;
    const size_t es = st_kv_dtype_size(L.dtype);
    if (!st_cuda_aligned(L.k, es) || !st_cuda_aligned(L.v, es))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "cuda attention_paged: cache.k = %p / cache.v = %p are not %zu-byte aligned (%s)", L.k, L.v, es,
                      st_kv_dtype_name(L.dtype));
    if (L.dtype == ST_KV_FP8 && (!st_cuda_aligned(L.k_scale, 4) || !st_cuda_aligned(L.v_scale, 4)))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: cache.k_scale / cache.v_scale are not 4-byte aligned");
    /* the tile kernel: hd 64 / 128 with 16-byte aligned q and cache */
    const bool tile = (hd == 64 || hd == 128) && st_cuda_aligned(q, 16) && st_cuda_aligned(L.k, 16) &&
                      st_cuda_aligned(L.v, 16);
    /* the decode kernel when the batch holds about one token per sequence
     * (decode steps); same bits either way (see pa_dec_kernel) */
    const int64_t in_call = kv->batch_seqs > 0 ? kv->batch_seqs : kv->n_seqs;
    const bool dec = tile && G <= PD_MAX_G && n <= 2 * in_call;
    if (tile && (int64_t)Hkv * ((G + PT_ROWS - 1) / PT_ROWS) > 65535)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: %d kv heads is too many", Hkv);
    const size_t gsmem = (size_t)(2 * hd + PG_THREADS) * sizeof(float);
    if (!tile && gsmem > 48 * 1024)
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda attention_paged: head_dim %d is too large", hd);

    /* sub-batches of tokens whose partials fit PA_SCRATCH_CAP (at least one token) */
    const size_t per_tok = nsplit > 1 ? (size_t)nsplit * n_heads * (head_dim + 2) * sizeof(float) : 0;
    int64_t nt_max = per_tok ? (int64_t)(PA_SCRATCH_CAP / per_tok) : n;
    if (nt_max < 1) nt_max = 1;
    if (nt_max > PT_ROWS) nt_max -= nt_max % PT_ROWS; /* sub-batches keep whole tiles (speed only) */
    if (nt_max > n) nt_max = n;
    const int64_t max_nk = (int64_t)nsplit * PA_SPLIT;
    pa_out o = {out, nullptr, nullptr, nullptr, 0, 0};
    if (per_tok) {
        const int64_t rows = nt_max * n_heads;
        const size_t acc_b = (size_t)nsplit * rows * head_dim * sizeof(float);
        const size_t ml_b = (size_t)nsplit * rows * sizeof(float);
        const size_t ml_off = (acc_b + 255) / 256 * 256, l_off = ml_off + (ml_b + 255) / 256 * 256;
        void *p = nullptr;
        strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_ATTN, l_off + ml_b, &p);
        if (st != STRATA_OK) return st;
        o.part_acc = (float *)p;
        o.part_m = (float *)((char *)p + ml_off);
        o.part_l = (float *)((char *)p + l_off);
    }
    for (int64_t t0 = 0; t0 < n; t0 += nt_max) {
        const int64_t nt = n - t0 < nt_max ? n - t0 : nt_max;
        o.tok0 = t0;
        o.rows = nt * n_heads;
        strata_status st = STRATA_OK;
        if (tile) {
            switch (L.dtype) {
            case ST_KV_F32:
                st = pa_tile_kt<ST_KV_F32>(c, s->s, q, *kv, seq, pos, nt, H, Hkv, hd, dec, nsplit, max_nk, qscale, o);
                break;
            case ST_KV_BF16:
                st = pa_tile_kt<ST_KV_BF16>(c, s->s, q, *kv, seq, pos, nt, H, Hkv, hd, dec, nsplit, max_nk, qscale, o);
                break;
            case ST_KV_FP8:
                st = pa_tile_kt<ST_KV_FP8>(c, s->s, q, *kv, seq, pos, nt, H, Hkv, hd, dec, nsplit, max_nk, qscale, o);
                break;
            }
            if (st != STRATA_OK) return st;
            continue;
        }
        const dim3 ggrid((unsigned)(nt * n_heads), (unsigned)nsplit);
        switch (L.dtype) {
        case ST_KV_F32:
            ST_CUDA_TRY(st_launch(c->pdl, pa_generic_kernel<ST_KV_F32>, ggrid, dim3(PG_THREADS), gsmem, s->s, q, *kv,
                                  seq, pos, H, Hkv, hd, max_nk, qscale, o));
            break;
        case ST_KV_BF16:
            ST_CUDA_TRY(st_launch(c->pdl, pa_generic_kernel<ST_KV_BF16>, ggrid, dim3(PG_THREADS), gsmem, s->s, q, *kv,
                                  seq, pos, H, Hkv, hd, max_nk, qscale, o));
            break;
        case ST_KV_FP8:
            ST_CUDA_TRY(st_launch(c->pdl, pa_generic_kernel<ST_KV_FP8>, ggrid, dim3(PG_THREADS), gsmem, s->s, q, *kv,
                                  seq, pos, H, Hkv, hd, max_nk, qscale, o));
            break;
        }
        if (st != STRATA_OK) return st;
        if (nsplit > 1)
            ST_CUDA_TRY(st_launch(c->pdl, pa_merge_kernel, dim3((unsigned)(nt * n_heads)), dim3(128), 0, s->s, *kv,
                                  seq, pos, H, hd, max_nk, o));
    }
    return STRATA_OK;
}

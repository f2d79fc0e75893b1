/* attention, prefill in fast mode: a FlashAttention-2 style tensor-core
 * kernel (the op's contract: backend.h; the row layout, online softmax and
 * KV splits: cuda_attention.cu). Used by the contiguous attention op when
 * set_fast_prefill is on, the head dim is 64 or 128 and a kv head has at
 * least ST_ATTN_FA2_MIN_ROWS rows; STRATA_ATTN_PREFILL=old keeps the
 * previous kernel (attn_prefill_kernel<HD, false>).
 *
 * Two launches:
 *   1. attn_kv_bf16_kernel: K and V [n_kv, Hkv, hd] fp32 -> bf16 (round to
 *      nearest) into the stream's ST_CUDA_SCRATCH_ATTN_BF16 buffer, same
 *      layout, so that every tile row of the main kernel is hd * 2 bytes of
 *      16-byte cp.async copies.
 *   2. attn_prefill_fa2_kernel<HD>: grid (ceil(n G / 128), Hkv, nsplit), 256
 *      threads. A block owns 128 rows (token, head) of one kv head (row r:
 *      token r / G, head kvh G + r % G); warp w owns rows 16w .. 16w+15.
 *      - Q: loaded once (fp32, times qscale = scale log2(e), rounded to bf16)
 *        into shared memory, then into registers as mma A fragments
 *        (ldmatrix.x4), where it stays for the whole KV loop.
 *      - K/V: tiles of 64 keys, double-buffered: cp.async brings tile t+1
 *        while tile t is computed (one barrier per tile). Shared rows are
 *        padded to hd + 8 bf16 (a 16-byte skew per row), so the 8 row
 *        addresses of each ldmatrix phase fall in 8 distinct 16-byte bank
 *        groups: conflict-free. Keys past the block's range are zero-filled.
 *      - S = Q K^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate; K
 *        fragments by ldmatrix.x4), kept in registers; online softmax in
 *        fp32 with exp2 (scores are already in log2 units); P is packed to
 *        bf16 in registers and used directly as the A operand of P V (V
 *        fragments by ldmatrix.x4.trans), no trip through shared memory.
 *        Row sums stay per-thread partials until the end (one quad
 *        reduction).
 *      - Causal: the block's key range ends at its largest position
 *        (split_range), so tiles past its last row are never loaded; a warp
 *        skips a tile that none of its rows sees, and applies the
 *        per-element mask only to tiles that reach past the smallest
 *        position of its rows or past the range's end (the diagonal ones).
 *      Shared memory: 2 stages x (K + V) x 64 keys x (hd + 8) bf16 = 68 KiB
 *      (hd 128), 36 KiB (hd 64); the Q staging (128 rows x (hd + 8)) reuses
 *      stage 1 before the loop starts.
 * Precision: Q (scaled), K, V and P rounded to bf16 once, fp32 accumulation:
 * the fast mode's contract (~1e-3 of the output's scale). */
#include <limits.h>
#include <math.h>

#include "backend/cuda/cuda_attn_prefill_fa2.cuh"
#include "backend/cuda/cuda_common.cuh"

#define FA_BQ ST_ATTN_FA2_BQ
#define FA_WARPS (FA_BQ / 16)
#define FA_THREADS (FA_WARPS * 32)
#define FA_TK 64 /* keys per tile */

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

template <int HD>
static constexpr size_t fa2_smem_bytes() {
    return (size_t)2 * 2 * FA_TK * (HD + 8) * sizeof(__nv_bfloat16);
}

/* q [n, H, HD] fp32; kb, vb [n_kv, Hkv, HD] bf16; pos [n]. See the top of the file. */
template <int HD>
static __global__ void __launch_bounds__(FA_THREADS, HD == 64 ? 2 : 1)
    attn_prefill_fa2_kernel(const float *__restrict__ q, const __nv_bfloat16 *__restrict__ kb,
                            const __nv_bfloat16 *__restrict__ vb, const int32_t *__restrict__ pos, int n,
                            int64_t n_kv, int H, int Hkv, float qscale, attn_out o) {
    constexpr int LD = HD + 8;       /* bf16 per shared row (16-byte skew) */
    constexpr int TILE = FA_TK * LD; /* bf16 of one K or V tile */
    constexpr int CH = HD / 8;       /* 16-byte chunks per row */
    static_assert(FA_BQ * LD <= 2 * TILE, "the Q staging must fit in one stage");
    static_assert(FA_TK * CH % FA_THREADS == 0 && FA_BQ * HD / 4 % FA_THREADS == 0, "whole loops");
    extern __shared__ uint4 fa_smem[]; /* [stage 0: K, V][stage 1: K, V] */
    __nv_bfloat16 *const sm = (__nv_bfloat16 *)fa_smem;

    const int G = H / Hkv;
    const int64_t RT = (int64_t)n * G;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int64_t rbase = (int64_t)blockIdx.x * FA_BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;

    /* positions: this thread's two rows, its warp's smallest and largest
     * (rows past RT are padding: position -1, left out of min and max), the
     * block's largest (every warp computes it alike) */
    const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    const int pos_lo = rbase + r_lo < RT ? __ldg(pos + (rbase + r_lo) / G) : -1;
    const int pos_hi = rbase + r_hi < RT ? __ldg(pos + (rbase + r_hi) / G) : -1;
    int wmax = max(pos_lo, pos_hi);
    int wmin = min(pos_lo < 0 ? INT_MAX : pos_lo, pos_hi < 0 ? INT_MAX : pos_hi);
    int maxpos = -1;
#pragma unroll
    for (int i = 0; i < FA_BQ / 32; i++) {
        const int64_t P = rbase + lane + 32 * i;
        if (P < RT) maxpos = max(maxpos, __ldg(pos + P / G));
    }
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
        wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, sh));
        wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, sh));
        maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, sh));
    }
    int64_t kv_begin, kv_end;
    split_range(n_kv, maxpos, o.nsplit, split, FA_TK, &kv_begin, &kv_end);
    /* from here on keys count from kv_begin (int: a cache holds fewer than 2^31 keys) */
    const int nk = kv_end > kv_begin ? (int)(kv_end - kv_begin) : 0;
    const int ntiles = (nk + FA_TK - 1) / FA_TK;
    /* the last key each row sees within the range (< 0: none); the warp's
     * smallest and largest of them (clamped to -1 when below the range) */
    const int lim_lo = (int)(min((int64_t)pos_lo, kv_end - 1) - kv_begin);
    const int lim_hi = (int)(min((int64_t)pos_hi, kv_end - 1) - kv_begin);
    const int wlo = wmin == INT_MAX ? INT_MAX : (int)max((int64_t)wmin - kv_begin, (int64_t)-1);
    const int whi = (int)max((int64_t)wmax - kv_begin, (int64_t)-1);

    /* tile t -> stage t & 1; keys at or past kv_end are zero-filled */
    auto stage = [&](int t) {
        __nv_bfloat16 *ks = sm + (t & 1) * 2 * TILE, *vs = ks + TILE;
        const int64_t k0 = kv_begin + (int64_t)t * FA_TK;
#pragma unroll
        for (int it = 0; it < FA_TK * CH / FA_THREADS; it++) {
            const int i = tid + it * FA_THREADS, j = i / CH, c = i % CH;
            const bool ok = k0 + j < kv_end;
            const size_t off = ok ? ((size_t)(k0 + j) * Hkv + kvh) * HD + c * 8 : 0;
            st_cp_async16(ks + j * LD + c * 8, kb + off, ok);
            st_cp_async16(vs + j * LD + c * 8, vb + off, ok);
        }
        st_cp_async_commit();
    };
    if (ntiles > 0) stage(0);

    /* Q -> bf16 in stage 1 (free until the loop's first barrier) -> registers */
    __nv_bfloat16 *const qs = sm + 2 * TILE;
#pragma unroll 4
    for (int it = 0; it < FA_BQ * HD / 4 / FA_THREADS; it++) {
        const int i = tid + it * FA_THREADS, r = i / (HD / 4), d4 = i % (HD / 4);
        const int64_t P = rbase + r;
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
    uint32_t qf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        ldmatrix_x4(qf[kk], qs + (warp * 16 + (mi & 1) * 8 + mr) * LD + kk * 16 + (mi >> 1) * 8);

    float acc[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

    /* per-lane shared offsets (bf16) of the ldmatrix row addresses:
     * K (B of S = Q K^T, 16 keys x 16 dims per x4): matrix i = keys (i >> 1) * 8 ..,
     *   dims (i & 1) * 8 .. -> b0, b1 of key group 2jp, then of 2jp + 1;
     * V (B of O = P V, .trans, 16 keys x 16 dims per x4): matrix i = keys (i & 1) * 8 ..,
     *   dims (i >> 1) * 8 .. -> b0, b1 of dim group 2 d2, then of 2 d2 + 1 */
    const int koff = ((mi >> 1) * 8 + mr) * LD + (mi & 1) * 8;
    const int voff = ((mi & 1) * 8 + mr) * LD + (mi >> 1) * 8;

    for (int t = 0; t < ntiles; t++) {
        st_cp_async_wait<0>(); /* this thread's copies of tile t have landed */
        __syncthreads();       /* everyone's have; every warp is done with tile t - 1 (and Q) */
        if (t + 1 < ntiles) stage(t + 1);
        const int kt = t * FA_TK;
        if (kt > whi) continue; /* no row of this warp sees any key of the tile (warp-uniform) */
        const __nv_bfloat16 *ks = sm + (t & 1) * 2 * TILE, *vs = ks + TILE;

        float s[FA_TK / 8][4];
#pragma unroll
        for (int j = 0; j < FA_TK / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
            for (int jp = 0; jp < FA_TK / 16; jp++) {
                uint32_t b[4];
                ldmatrix_x4(b, ks + koff + jp * 16 * LD + kk * 16);
                mma_bf16(s[2 * jp], qf[kk], b[0], b[1]);
                mma_bf16(s[2 * jp + 1], qf[kk], b[2], b[3]);
            }
        }
        /* the diagonal (or the range's last) tile: keys past a row's limit -> -inf */
        if (kt + FA_TK - 1 > wlo || kt + FA_TK > nk) {
#pragma unroll
            for (int j = 0; j < FA_TK / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = kt + j * 8 + 2 * t4 + e;
                    if (key > lim_lo) s[j][e] = -INFINITY;
                    if (key > lim_hi) s[j][2 + e] = -INFINITY;
                }
        }
        /* online softmax: rows g (lo) and g + 8 (hi) of the warp, spread over the quad */
        float mx_lo = m_lo, mx_hi = m_hi;
#pragma unroll
        for (int j = 0; j < FA_TK / 8; j++) {
            mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
        const float b_lo = mx_lo == -INFINITY ? 0.0f : mx_lo, b_hi = mx_hi == -INFINITY ? 0.0f : mx_hi;
        const float a_lo = fa_exp2(m_lo - b_lo), a_hi = fa_exp2(m_hi - b_hi);
        m_lo = mx_lo, m_hi = mx_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < FA_TK / 8; j++) {
            s[j][0] = fa_exp2(s[j][0] - b_lo);
            s[j][1] = fa_exp2(s[j][1] - b_lo);
            s[j][2] = fa_exp2(s[j][2] - b_hi);
            s[j][3] = fa_exp2(s[j][3] - b_hi);
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
        /* O += P V: the C fragments of key groups 2kc, 2kc + 1 are the A fragment of keys 16kc .. 16kc+15 */
#pragma unroll
        for (int kc = 0; kc < FA_TK / 16; kc++) {
            uint32_t a[4];
            a[0] = pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int d2 = 0; d2 < HD / 16; d2++) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, vs + voff + kc * 16 * LD + d2 * 16);
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
        const float m = half ? m_hi : m_lo, l = half ? l_hi : l_lo;
        if (o.nsplit == 1) {
            const float inv = 1.0f / l;
            float *dst = o.out + orow * HD + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < HD / 8; dt++)
                *(float2 *)(dst + dt * 8) = make_float2(acc[dt][2 * half] * inv, acc[dt][2 * half + 1] * inv);
        } else {
            float *dst = o.part_acc + ((size_t)split * rows + orow) * HD + 2 * t4;
#pragma unroll
            for (int dt = 0; dt < HD / 8; dt++)
                *(float2 *)(dst + dt * 8) = make_float2(acc[dt][2 * half], acc[dt][2 * half + 1]);
            if (t4 == 0) {
                o.part_m[split * rows + orow] = m;
                o.part_l[split * rows + orow] = l;
            }
        }
    }
}

/* ---- host ---------------------------------------------------------------------------------- */

strata_status st_attn_fa2_setup(void) {
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_fa2_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)fa2_smem_bytes<64>()));
    ST_CUDA_TRY(cudaFuncSetAttribute(attn_prefill_fa2_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)fa2_smem_bytes<128>()));
    return STRATA_OK;
}

template <int HD>
static strata_status launch_fa2(cudaStream_t s, const float *q, const __nv_bfloat16 *kb, const __nv_bfloat16 *vb,
                                const int32_t *pos, int64_t n, int64_t n_kv, int64_t H, int64_t Hkv, float qscale,
                                const attn_out *o) {
    const int64_t bx = (n * (H / Hkv) + FA_BQ - 1) / FA_BQ;
    const dim3 grid((unsigned)bx, (unsigned)Hkv, (unsigned)o->nsplit);
    attn_prefill_fa2_kernel<HD><<<grid, FA_THREADS, fa2_smem_bytes<HD>(), s>>>(q, kb, vb, pos, (int)n, n_kv, (int)H,
                                                                              (int)Hkv, qscale, *o);
    ST_CUDA_LAUNCHED("attn_prefill_fa2_kernel");
    return STRATA_OK;
}

strata_status st_attn_prefill_fa2(st_backend *be, st_cuda_stream *s, int hd, const float *q, const float *k,
                                  const float *v, const int32_t *pos, int64_t n, int64_t n_kv, int64_t H, int64_t Hkv,
                                  float qscale, const attn_out *o) {
    if (hd != 64 && hd != 128)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (fa2 prefill): head_dim %d is not 64 or 128", hd);
    if ((n * (H / Hkv) + FA_BQ - 1) / FA_BQ > INT32_MAX)
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
    if (hd == 64) return launch_fa2<64>(s->s, q, kb, vb, pos, n, n_kv, H, Hkv, qscale, o);
    return launch_fa2<128>(s->s, q, kb, vb, pos, n, n_kv, H, Hkv, qscale, o);
}

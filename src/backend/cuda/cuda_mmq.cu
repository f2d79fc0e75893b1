/* MMQ: y[n, N] = x[n, K] @ w[N, K]^T on int8 tensor cores, for quantized
 * weights (q8_0, q4_0, q4_1, q4_k, q6_k) in fast mode and batches of tokens (by
 * default 5..64: cuda_matmul.cu's switch points, measured with
 * bench_cuda_ops --only mmq; any n works). x comes quantized per token and
 * 32-element block (st_cuda_gemv2_quant_x: int8 xq, scale d_x = max|x| /
 * 127, and for q4_1 / q4_k xs = d_x * sum x_q, llama.cpp's q8_1 idea); the
 * weights are read in their GGUF layout, never dequantized to memory.
 *
 * One instruction, mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32, covers
 * 16 weight rows x 8 tokens x one 32-element block: its int32 results are
 * exact sums of weight integers times x integers, and each is added to the
 * fp32 accumulator times d_w d_x (+ m_w xs for the types with a min). Weight
 * integers go into the A fragment as stored (q8_0), as nibbles made signed
 * in registers (q4_0: q - 8 by one add and one xor per 4 bytes; q6_k: q -
 * 32 of the 6-bit values the same way), or as unsigned nibbles (q4_1, q4_k,
 * whose offsets enter through xs). q6_k has a scale per 16 elements, so its
 * 32-block is two m16n8k16 products, each scaled by its half's d sc d_x.
 *
 * K is walked in stages of 256 elements (8 blocks; one q4_k or q6_k
 * super-block; q6_k's 210 bytes are staged as the 14 aligned 16-byte chunks
 * that hold them, read at their offset in the first: mq_chunk0, mq_off);
 * weight bytes go to shared memory with 16-byte cp.async, several stages
 * ahead (the first ones before the PDL wait: weights are never written by
 * kernels), and each loaded weight block serves every token of the tile.
 * Two kernels:
 *   mmqw_kernel, 8 or 16 tokens: a block of 4 warps over 32 rows (SwiGLU:
 *     16 gate rows and the same up rows), each warp streaming its own stages
 *     (w, w + 4, ...) through its own ring with no block barrier, x's B
 *     fragments and scales loaded a stage at a time through L1; the warps'
 *     partial sums added at the end in a fixed order.
 *   mmq_kernel, more tokens: a block pipeline of 4 or 8 warps over a tile of
 *     BM rows x BN tokens (64 x 32 or 64 x 64; 32 rows where 64 would leave
 *     SMs idle), x staged in shared memory beside the weights, warps laid
 *     out WM x WN over the m16 / n8 tiles and WK along a stage's blocks;
 *     token tiles are blockIdx.x (fastest), so the blocks sharing a weight
 *     tile run together and read it from HBM once.
 * Shared-memory rows are padded so that fragment loads are free of bank
 * conflicts. Launches of fewer than two blocks per SM (4096-row weights:
 * 128 tiles of 32 rows) split K into up to 8 slices (grid.z, mq_slices):
 * each slice's block writes its tile's partial sums to a.part and
 * mmq_slices_kernel adds the slices in order (then SwiGLU) into y.
 *
 * Rounding: the integer sums are exact; per block one fp32 product and FMA
 * (the same terms as the dp4a GEMV of cuda_gemv.cu, in another order). The
 * result of a token depends on the tile configuration and K slices (n, the
 * launch's rows and K, the device's SM count), not on the other tokens'
 * values. Error against the fp32 reference: 8.2e-3 of max|y| at most
 * over gpu_check_ops --only-mmq in the seventh session, q6_k since within
 * the same threshold (1.5e-2, the int8 GEMV's). Timings: bench/RESULTS.md,
 * seventh session (H200: q4_0 14336 x 4096, 8 tokens 32.6 us against 43.0
 * for the int8 GEMV and 90.6 for dequantize + GEMM; 64 tokens 56.9 / 297 /
 * 95.1); q6_k sixteenth session (H100, 14336 x 4096: 8 tokens 45.5 us
 * against 75.3 for the fp32 GEMV, 64 tokens 112.4 against 128.9 for
 * dequantize + GEMM). */
#include "backend/cuda/cuda_mmq.cuh"

#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define MQ_XS 272                /* shared bytes per token row of a stage's int8 x (256 + 16) */
#define MQ_XD 12                 /* floats per token row of a stage's scales (8 + 4) */
#define MQ_SMEM_TARGET (96 * 1024) /* ring bytes a block aims at (2 to 8 stages) */

ST_DEV void mq_cp16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
ST_DEV void mq_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> ST_DEV void mq_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

ST_DEV float mq_h2f(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu))); }

/* 4 little-endian bytes at an even byte offset of 4-byte aligned shared memory */
ST_DEV uint32_t mq_word2(const uint8_t *s, int off) {
    const uint32_t *w = (const uint32_t *)(s + (off & ~3));
    return __funnelshift_r(w[0], w[1], (unsigned)(off & 2) * 8u);
}

/* c = a (16 x 32 s8, row) . b (32 x 8 s8, col), int32 */
ST_DEV void mq_mma(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

/* c = a (16 x 16 s8, row) . b (16 x 8 s8, col), int32: the halves of mq_mma's k */
ST_DEV void mq_mma16(int c[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

/* ---- weight types ---------------------------------------------------------------
 * mq<T>: GB bytes per row and stage of 256 elements in the weight, SB
 * staged (16-byte chunks from the one holding the stage's first byte,
 * which sits o = GB s % 16 bytes into it: mq_off); SUM: the offset term
 * m_w * xs is needed; row(r, o, b, tig, lo, hi, d, m): block b (0..7) of
 * the stage's row r in shared memory, for the lane of thread-in-group tig:
 * lo = the 4 weight integers of elements 4 tig .. 4 tig + 3 (int8 each), hi
 * = those of 16 + 4 tig .., d the block's scale, m its offset (element = d
 * q + m; 0 without SUM); K16 (q6_k): d and m are the scales of the two
 * 16-element halves instead. */
template <int T> struct mq;

template <> struct mq<ST_DTYPE_Q8_0> {
    static constexpr int SB = 8 * 34;
    static constexpr int GB = SB;
    static constexpr bool K16 = false;
    static constexpr bool SUM = false;
    ST_DEV static void row(const uint8_t *r, int, int b, int tig, uint32_t &lo, uint32_t &hi, float &d, float &m) {
        const int o = 34 * b;
        d = mq_h2f(*(const uint16_t *)(r + o));
        m = 0.0f;
        lo = mq_word2(r, o + 2 + 4 * tig);
        hi = mq_word2(r, o + 18 + 4 * tig);
    }
};

/* q - 8 of 4 nibbles in bytes: q + 0x78 stays below 256, ^ 0x80 gives q - 8 mod 256 */
ST_DEV uint32_t mq_nib_s8(uint32_t q) { return ((q & 0x0f0f0f0fu) + 0x78787878u) ^ 0x80808080u; }

template <> struct mq<ST_DTYPE_Q4_0> {
    static constexpr int SB = 8 * 18;
    static constexpr int GB = SB;
    static constexpr bool K16 = false;
    static constexpr bool SUM = false;
    ST_DEV static void row(const uint8_t *r, int, int b, int tig, uint32_t &lo, uint32_t &hi, float &d, float &m) {
        const int o = 18 * b;
        d = mq_h2f(*(const uint16_t *)(r + o));
        m = 0.0f;
        const uint32_t q = mq_word2(r, o + 2 + 4 * tig); /* bytes 4 tig ..: low nibbles = elements 4 tig .., high = 16 + 4 tig .. */
        lo = mq_nib_s8(q);
        hi = mq_nib_s8(q >> 4);
    }
};

template <> struct mq<ST_DTYPE_Q4_1> {
    static constexpr int SB = 8 * 20;
    static constexpr int GB = SB;
    static constexpr bool K16 = false;
    static constexpr bool SUM = true;
    ST_DEV static void row(const uint8_t *r, int, int b, int tig, uint32_t &lo, uint32_t &hi, float &d, float &m) {
        const uint32_t *p = (const uint32_t *)(r + 20 * b); /* 4-byte aligned blocks */
        const uint32_t dm = p[0];
        d = mq_h2f(dm);
        m = mq_h2f(dm >> 16);
        const uint32_t q = p[1 + tig];
        lo = q & 0x0f0f0f0fu;
        hi = (q >> 4) & 0x0f0f0f0fu;
    }
};

/* q4_k: the stage is one super-block (d, dmin, 12 bytes of 6-bit scales and
 * mins, 128 bytes of nibbles); block b = sub-block b: chunk b / 2 of 32
 * bytes, low nibbles for even b, high for odd; element = d sc_b q - dmin m_b. */
template <> struct mq<ST_DTYPE_Q4_K> {
    static constexpr int SB = 144;
    static constexpr int GB = SB;
    static constexpr bool K16 = false;
    static constexpr bool SUM = true;
    ST_DEV static void row(const uint8_t *r, int, int b, int tig, uint32_t &lo, uint32_t &hi, float &d, float &m) {
        const uint32_t dd = *(const uint32_t *)r;
        const uint8_t *s = r + 4;
        int sc, mn;
        if (b < 4) {
            sc = s[b] & 63;
            mn = s[b + 4] & 63;
        } else {
            sc = (s[b + 4] & 15) | ((s[b - 4] >> 6) << 4);
            mn = (s[b + 4] >> 4) | ((s[b] >> 6) << 4);
        }
        d = __fmul_rn(mq_h2f(dd), (float)sc);
        m = -__fmul_rn(mq_h2f(dd >> 16), (float)mn);
        const uint32_t *q = (const uint32_t *)(r + 16 + 32 * (b >> 1)) + tig;
        const unsigned sh = (unsigned)(b & 1) * 4u;
        lo = (q[0] >> sh) & 0x0f0f0f0fu;
        hi = (q[4] >> sh) & 0x0f0f0f0fu;
    }
};

/* q6_k: the stage is one super-block (ql[128], qh[64], int8 scales[16], f16
 * d: 210 bytes, so stage s starts 2 (s % 8) bytes into a 16-byte chunk: GB
 * bytes per stage in the row, SB = 14 chunks staged, the stage at byte o of
 * them; rows of 16-byte multiples end on a chunk, nothing is read past
 * them). Block b = elements 32 b .. of the super-block, half h = b / 4 and
 * B = b % 4 within it: 6-bit q = nibble (B < 2: low) of ql[64 h + 32 (B &
 * 1) + i] with bits 2B of qh[32 h + i] as bits 4, 5; element = d sc q - 32 d
 * sc, sc the int8 scale of its 16 elements. Each 16-element half has its
 * own scale, so the block is two k16 products (K16): lo / hi are the signed
 * q - 32 of elements 4 tig .. and 16 + 4 tig .., d and m the scales d sc of
 * the low and the high half. */
template <> struct mq<ST_DTYPE_Q6_K> {
    static constexpr int SB = 224;
    static constexpr int GB = 210;
    static constexpr bool SUM = false;
    static constexpr bool K16 = true;
    ST_DEV static uint32_t q6(uint32_t ql, uint32_t qh, int B) {
        const uint32_t q = ((ql >> (B < 2 ? 0 : 4)) & 0x0f0f0f0fu) | (((qh >> (2 * B)) & 0x03030303u) << 4);
        return (q + 0x60606060u) ^ 0x80808080u; /* q - 32 in each byte: q + 96 < 256, then bit 7 flipped */
    }
    ST_DEV static void row(const uint8_t *r, int o, int b, int tig, uint32_t &lo, uint32_t &hi, float &d, float &m) {
        const int h = b >> 2, B = b & 3;
        const int ql = o + 64 * h + 32 * (B & 1) + 4 * tig, qh = o + 128 + 32 * h + 4 * tig;
        lo = q6(mq_word2(r, ql), mq_word2(r, qh), B);
        hi = q6(mq_word2(r, ql + 16), mq_word2(r, qh + 16), B);
        const float dd = mq_h2f(mq_word2(r, o + 208));
        d = __fmul_rn(dd, (float)(int8_t)r[o + 192 + 2 * b]);
        m = __fmul_rn(dd, (float)(int8_t)r[o + 193 + 2 * b]);
    }
};

/* the byte offset of stage s's first byte in its first staged chunk, and that chunk's offset in the row */
template <int T> ST_DEV int mq_off(int64_t s) { return mq<T>::GB % 16 ? (int)((s * mq<T>::GB) & 15) : 0; }
template <int T> ST_DEV size_t mq_chunk0(int64_t s) { return (size_t)(s * mq<T>::GB) & ~(size_t)15; }

/* One block of 16 rows x 8 tokens into acc (rows g, g + 8 x tokens 2 tig,
 * 2 tig + 1): the rows' integers af (mq<T>::row of rows g, g + 8), x's b0,
 * b1, scales d0, d1 and offsets m0, m1 of the rows, dx / sx of the tokens.
 * One k32 product scaled by d_w d_x (+ m_w s_x); K16: two k16 products,
 * each scaled by its half's d_w d_x. */
template <typename Q>
ST_DEV void mq_acc(float (&acc)[4], const uint32_t (&af)[4], uint32_t b0, uint32_t b1, float d0, float d1, float m0,
                   float m1, float dx0, float dx1, float sx0, float sx1) {
    int c[4];
    if constexpr (Q::K16) {
        int e[4];
        mq_mma16(c, af[0], af[1], b0);
        mq_mma16(e, af[2], af[3], b1);
        acc[0] = fmaf(__fmul_rn(m0, dx0), (float)e[0], fmaf(__fmul_rn(d0, dx0), (float)c[0], acc[0]));
        acc[1] = fmaf(__fmul_rn(m0, dx1), (float)e[1], fmaf(__fmul_rn(d0, dx1), (float)c[1], acc[1]));
        acc[2] = fmaf(__fmul_rn(m1, dx0), (float)e[2], fmaf(__fmul_rn(d1, dx0), (float)c[2], acc[2]));
        acc[3] = fmaf(__fmul_rn(m1, dx1), (float)e[3], fmaf(__fmul_rn(d1, dx1), (float)c[3], acc[3]));
        return;
    }
    mq_mma(c, af, b0, b1);
    acc[0] = fmaf(__fmul_rn(d0, dx0), (float)c[0], acc[0]);
    acc[1] = fmaf(__fmul_rn(d0, dx1), (float)c[1], acc[1]);
    acc[2] = fmaf(__fmul_rn(d1, dx0), (float)c[2], acc[2]);
    acc[3] = fmaf(__fmul_rn(d1, dx1), (float)c[3], acc[3]);
    if (Q::SUM) {
        acc[0] = fmaf(m0, sx0, acc[0]);
        acc[1] = fmaf(m0, sx1, acc[1]);
        acc[2] = fmaf(m1, sx0, acc[2]);
        acc[3] = fmaf(m1, sx1, acc[3]);
    }
}

/* ---- configuration ------------------------------------------------------------------ */

__host__ __device__ constexpr int mq_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
__host__ __device__ constexpr int mq_max(int a, int b) { return a > b ? a : b; }

/* MT x NT mma tiles per warp, warps WM x WN over the tile, WK along K. */
template <int T, int MT, int NT, int WM, int WN, int WK>
struct mq_cfg {
    static_assert(WM * WN * WK == 4 || WM * WN * WK == 8, "4 or 8 warps");
    static constexpr int THREADS = 32 * WM * WN * WK;
    static_assert(8 % WK == 0, "WK divides a stage's 8 blocks");
    static constexpr int BM = 16 * MT * WM, BN = 8 * NT * WN;
    static constexpr int SB = mq<T>::SB;
    static constexpr int SBP = (SB / 4) % 8 == 4 ? SB : SB + 16; /* row stride: 4 g + tig distinct banks */
    static constexpr bool SUM = mq<T>::SUM;
    static constexpr int XOFF = BM * SBP;                          /* x of the stage */
    static constexpr int DOFF = XOFF + BN * MQ_XS;                 /* its scales (then sums) */
    static constexpr int STAGE = DOFF + BN * MQ_XD * 4 * (SUM ? 2 : 1);
    static constexpr int NST = mq_clamp(MQ_SMEM_TARGET / STAGE, 2, 8);
    static constexpr int BMP = BM + 4; /* reduction row stride: conflict-free stores */
    static constexpr int SMEM = mq_max(NST * STAGE + 16, WK * BN * BMP * 4);
};

/* ---- the kernel ---------------------------------------------------------------------- */

template <int T, int MT, int NT, int WM, int WN, int WK, bool SW>
static __global__ void __launch_bounds__(32 * WM * WN * WK) mmq_kernel(const st_gemv_args a) {
    using C = mq_cfg<T, MT, NT, WM, WN, WK>;
    using Q = mq<T>;
    constexpr int BM = C::BM, BN = C::BN, SB = C::SB, SBP = C::SBP, NST = C::NST, STAGE = C::STAGE;
    constexpr int RT = SW ? BM / 2 : BM; /* output rows of the tile */
    constexpr int C16 = SB / 16;
    extern __shared__ __align__(16) uint8_t sm[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wk = warp % WK, wn = (warp / WK) % WN, wm = warp / (WK * WN);
    const int64_t K = a.K, n = a.n;
    const int nblk = (int)(K >> 5), nst = (nblk + 7) >> 3;
    const int64_t kq = K >> 5; /* scales per token row */
    const st_gemv_group tl = st_gemv_group_of<RT, SW>(a, blockIdx.y);
    const int64_t t0 = (int64_t)blockIdx.x * BN;
    /* this block's slice of K (gridDim.z slices): stages s0 .. s0 + ns - 1 */
    const int s0 = (int)((int64_t)nst * blockIdx.z / gridDim.z);
    const int ns = (int)((int64_t)nst * (blockIdx.z + 1) / gridDim.z) - s0;

    /* local stage s (ring slot s % NST) is stage s0 + s of K */
    auto issue_w = [&](int s) {
        uint8_t *ws = sm + (s % NST) * STAGE;
        const size_t so = mq_chunk0<T>(s0 + s);
        for (int i = tid; i < BM * C16; i += C::THREADS) {
            const int r = i / C16, c = i - r * C16;
            const size_t o = so + 16 * (size_t)c;
            if (o < a.rb) {
                const int64_t row = min(tl.row0 + (SW ? r % RT : r), tl.N - 1); /* past N: the last row, not written */
                const uint8_t *w = SW && r >= RT ? a.w[1] : tl.w;
                mq_cp16(ws + r * SBP + 16 * c, w + (size_t)row * a.rb + o);
            }
        }
    };
    auto issue_x = [&](int s) {
        uint8_t *ws = sm + (s % NST) * STAGE;
        for (int i = tid; i < BN * 16; i += C::THREADS) {
            const int j = i >> 4, c = i & 15;
            const int64_t tok = min(t0 + j, n - 1), o = (int64_t)(s0 + s) * 256 + 16 * c;
            if (o < K) mq_cp16(ws + C::XOFF + j * MQ_XS + 16 * c, a.xq + tok * K + o);
        }
        constexpr int ND = C::SUM ? 4 : 2; /* 16-byte pieces per token: scales, then sums */
        for (int i = tid; i < BN * ND; i += C::THREADS) {
            const int j = i / ND, c = i % ND;
            const int64_t tok = min(t0 + j, n - 1), o = (int64_t)(s0 + s) * 8 + 4 * (c & 1);
            if (o < kq) {
                const float *src = (c < 2 ? a.xd : a.xs) + tok * kq + o;
                mq_cp16(ws + C::DOFF + (c >> 1) * (BN * MQ_XD * 4) + j * (MQ_XD * 4) + 16 * (c & 1), src);
            }
        }
    };

    /* prologue: weights before the PDL wait, x after */
#pragma unroll
    for (int s = 0; s < NST - 1; s++)
        if (s < ns) issue_w(s);
    st_pdl_wait(); /* x and y may belong to the previous kernel */
    st_pdl_trigger();
#pragma unroll
    for (int s = 0; s < NST - 1; s++) {
        if (s < ns) issue_x(s);
        mq_commit();
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][j][e] = 0.0f;

    for (int s = 0; s < ns; s++) {
        mq_wait<NST - 2>(); /* stage s has landed (this thread's copies) */
        __syncthreads();    /* everyone's; and slot (s - 1) % NST is free */
        if (s + NST - 1 < ns) {
            issue_w(s + NST - 1);
            issue_x(s + NST - 1);
        }
        mq_commit();
        const uint8_t *ws = sm + (s % NST) * STAGE;
        const uint8_t *xs = ws + C::XOFF;
        const float *xd = (const float *)(ws + C::DOFF), *xsum = xd + BN * MQ_XD;
        const int nb = min(8, nblk - 8 * (s0 + s)), so = mq_off<T>(s0 + s);
#pragma unroll
        for (int i = 0; i < 8 / WK; i++) {
            const int b = wk + WK * i;
            if (b >= nb) break; /* warp-uniform */
            uint32_t bf[NT][2];
            float dx[NT][2], sx[NT][2];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint8_t *p = xs + ((wn * NT + j) * 8 + g) * MQ_XS + 32 * b + 4 * tig;
                bf[j][0] = *(const uint32_t *)p;
                bf[j][1] = *(const uint32_t *)(p + 16);
                const int c = (wn * NT + j) * 8 + 2 * tig;
                dx[j][0] = xd[c * MQ_XD + b], dx[j][1] = xd[(c + 1) * MQ_XD + b];
                if (C::SUM) sx[j][0] = xsum[c * MQ_XD + b], sx[j][1] = xsum[(c + 1) * MQ_XD + b];
            }
#pragma unroll
            for (int m = 0; m < MT; m++) {
                const int r0 = (wm * MT + m) * 16 + g;
                uint32_t af[4];
                float d0, d1, m0, m1;
                Q::row(ws + r0 * SBP, so, b, tig, af[0], af[2], d0, m0);
                Q::row(ws + (r0 + 8) * SBP, so, b, tig, af[1], af[3], d1, m1);
#pragma unroll
                for (int j = 0; j < NT; j++)
                    mq_acc<Q>(acc[m][j], af, bf[j][0], bf[j][1], d0, d1, m0, m1, dx[j][0], dx[j][1], sx[j][0],
                              sx[j][1]);
            }
        }
    }

    /* the tile's sums: each warp's partials into shared memory (the ring is
     * free once every copy has landed and every warp is past its last
     * stage), then the WK partials added in order, SwiGLU, y */
    mq_wait<0>();
    __syncthreads();
    float *red = (float *)sm; /* [WK][BN][BMP] */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = (wm * MT + m) * 16 + g, c = (wn * NT + j) * 8 + 2 * tig;
            float *p = red + (wk * BN + c) * C::BMP + r;
            p[0] = acc[m][j][0];
            p[C::BMP] = acc[m][j][1];
            p[8] = acc[m][j][2];
            p[C::BMP + 8] = acc[m][j][3];
        }
    __syncthreads();
    if (gridDim.z > 1) { /* one slice of K: the tile's partial sums (gate and up rows alike) */
        float *pp = a.part + ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (BN * BM);
        for (int i = tid; i < BN * BM; i += C::THREADS) {
            const int c = i / BM, r = i - c * BM;
            float v = red[c * C::BMP + r];
#pragma unroll
            for (int k = 1; k < WK; k++) v += red[(k * BN + c) * C::BMP + r];
            pp[i] = v;
        }
        return;
    }
    for (int i = tid; i < BN * RT; i += C::THREADS) {
        const int c = i / RT, r = i - c * RT;
        const int64_t tok = t0 + c, row = tl.row0 + r;
        if (tok >= n || row >= tl.N) continue;
        float v = red[c * C::BMP + r];
#pragma unroll
        for (int k = 1; k < WK; k++) v += red[(k * BN + c) * C::BMP + r];
        if (SW) {
            float u = red[c * C::BMP + RT + r];
#pragma unroll
            for (int k = 1; k < WK; k++) u += red[(k * BN + c) * C::BMP + RT + r];
            v = st_silu_mul(v, u);
        }
        tl.y[tok * tl.N + row] = v;
    }
}

#define MQ_MAX_SLICES 8

/* The K slices' partial sums of each tile added in slice order (then
 * SwiGLU), into y: grid (token tiles, row tiles) as the MMQ's, gridDim.z
 * blocks share a tile's outputs (mq_sum_parts: one block per tile with a
 * loop of 16 outputs per thread took 12 us for 64 x 4096 outputs of 3
 * slices, Nsight Compute, H100). */
template <int BM, int BN, bool SW>
static __global__ void __launch_bounds__(256) mmq_slices_kernel(const st_gemv_args a, int ks) {
    constexpr int RT = SW ? BM / 2 : BM;
    st_pdl_wait(); /* the partials are the previous kernel's */
    st_pdl_trigger();
    const st_gemv_group tl = st_gemv_group_of<RT, SW>(a, blockIdx.y);
    const int64_t t0 = (int64_t)blockIdx.x * BN;
    const size_t zs = (size_t)gridDim.y * gridDim.x * (BN * BM); /* one slice's partials */
    const float *pp = a.part + ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * (BN * BM);
    for (int i = threadIdx.x + blockIdx.z * blockDim.x; i < BN * RT; i += blockDim.x * gridDim.z) {
        const int c = i / RT, r = i - c * RT;
        const int64_t tok = t0 + c, row = tl.row0 + r;
        if (tok >= a.n || row >= tl.N) continue;
        float p[MQ_MAX_SLICES], u[MQ_MAX_SLICES]; /* the loads first, then the sums in slice order */
#pragma unroll
        for (int z = 0; z < MQ_MAX_SLICES; z++) {
            p[z] = z < ks ? pp[z * zs + c * BM + r] : 0.0f;
            u[z] = SW && z < ks ? pp[z * zs + c * BM + RT + r] : 0.0f;
        }
        float v = p[0], w = u[0];
#pragma unroll
        for (int z = 1; z < MQ_MAX_SLICES; z++)
            if (z < ks) v += p[z], w += u[z];
        tl.y[tok * tl.N + row] = SW ? st_silu_mul(v, w) : v;
    }
}

/* The slices kernel's launch: blocks of 256 threads, up to 4 per tile. */
template <int BM, int BN, bool SW>
static cudaError_t mq_sum_parts(cudaStream_t s, bool pdl, const st_gemv_args &a, int64_t gx, int64_t tiles, int ks) {
    constexpr int RT = SW ? BM / 2 : BM, GZ = BN * RT / 256 < 1 ? 1 : BN * RT / 256 > 4 ? 4 : BN * RT / 256;
    return st_launch(pdl, mmq_slices_kernel<BM, BN, SW>, dim3((unsigned)gx, (unsigned)tiles, GZ), dim3(256), 0, s, a,
                     ks);
}

/* ---- small token counts: one pipeline per warp ---------------------------------------
 * 8 or 16 tokens (NT = 1, 2), BM = 16 MT rows per block of 4 warps. Each
 * warp streams its own stages of the tile (w, w + 4, ...: the block's
 * warps split K) through its own ring of NST stages of weight bytes, with
 * no block barrier until the end: with so little work per stage a block-wide
 * pipeline waited on its barriers (H200: ~1 us per stage whatever the
 * size). x is not staged: each lane loads its B fragments (4 + 4 bytes of a
 * token's block) and the scales of a whole stage at once, through L1 (one
 * L2 round trip per stage: loaded block by block they cost ~3 us per
 * stage). The 4 warps' partial sums are added at the end in a fixed order. */
__host__ __device__ constexpr int mqw_sbp(int sb) { return (sb / 4) % 8 == 4 ? sb : sb + 16; }
__host__ __device__ constexpr int mqw_nst(int wst) { return mq_clamp(73728 / (4 * wst), 2, 6); }

template <int T, int MT, int NT, bool SW>
static __global__ void __launch_bounds__(128) mmqw_kernel(const st_gemv_args a) {
    using Q = mq<T>;
    constexpr int BM = 16 * MT, BN = 8 * NT, SB = Q::SB, SBP = mqw_sbp(SB);
    constexpr int RT = SW ? BM / 2 : BM;
    constexpr int C16 = SB / 16, NCH = BM * C16, CPL = (NCH + 31) / 32; /* 16-byte pieces per stage, per lane */
    constexpr int WST = BM * SBP, NST = mqw_nst(WST), BMP = BM + 4;
    extern __shared__ __align__(16) uint8_t sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int64_t K = a.K, n = a.n, kq = K >> 5;
    const int nblk = (int)kq, nst = (nblk + 7) >> 3;
    /* this block's slice of K (gridDim.z slices): stages s0 .. s0 + ns - 1; warp w takes s0 + w + 4 k */
    const int s0 = (int)((int64_t)nst * blockIdx.z / gridDim.z);
    const int ns = (int)((int64_t)nst * (blockIdx.z + 1) / gridDim.z) - s0;
    const int cnt = warp < ns ? (ns - 1 - warp) / 4 + 1 : 0; /* this warp's stages */
    const st_gemv_group tl = st_gemv_group_of<RT, SW>(a, blockIdx.y);
    const int64_t t0 = (int64_t)blockIdx.x * BN;
    uint8_t *ring = sm + warp * (NST * WST);

    /* this lane's pieces of a stage: offsets from the tile's first row (rows past N: the last row) */
    const uint8_t *wb0 = tl.w + (size_t)tl.row0 * a.rb, *wb1 = a.w[SW ? 1 : 0] + (size_t)tl.row0 * a.rb;
    uint32_t gofs[CPL];
#pragma unroll
    for (int j = 0; j < CPL; j++) {
        const int i = lane + 32 * j, r = i / C16, c = i - r * C16;
        const int64_t row = min(tl.row0 + (SW ? r % RT : r), tl.N - 1) - tl.row0;
        gofs[j] = (uint32_t)((size_t)row * a.rb) + 16u * (uint32_t)c;
    }
    auto issue = [&](int k) {
        if (k < cnt) {
            const size_t so = mq_chunk0<T>(s0 + warp + 4 * k);
            uint8_t *buf = ring + (k % NST) * WST;
#pragma unroll
            for (int j = 0; j < CPL; j++) {
                const int i = lane + 32 * j, r = i / C16, c = i - r * C16;
                if (i < NCH && so + 16 * (size_t)c < a.rb)
                    mq_cp16(buf + r * SBP + 16 * c, (SW && r >= RT ? wb1 : wb0) + so + gofs[j]);
            }
        }
        mq_commit();
    };
#pragma unroll
    for (int k = 0; k < NST - 1; k++) issue(k);
    st_pdl_wait(); /* x and y may belong to the previous kernel */
    st_pdl_trigger();

    /* this lane's x rows: B fragments of token g of each n tile, scales of tokens 2 tig, 2 tig + 1 */
    const int8_t *xr[NT];
    const float *dr[NT][2], *sr[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xr[j] = a.xq + min(t0 + 8 * j + g, n - 1) * K + 4 * tig;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int64_t tok = min(t0 + 8 * j + 2 * tig + e, n - 1);
            dr[j][e] = a.xd + tok * kq;
            sr[j][e] = Q::SUM ? a.xs + tok * kq : a.xd;
        }
    }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][j][e] = 0.0f;

    for (int k = 0; k < cnt; k++) {
        __syncwarp(); /* every lane is done with slot (k - 1) % NST, refilled now */
        issue(k + NST - 1);
        /* the stage's x, all 8 blocks at once (one L2 round trip per stage,
         * not one per block; past the last block: the last block again) */
        const int s = s0 + warp + 4 * k, nb = min(8, nblk - 8 * s);
        uint32_t bf[8][NT][2];
        float dx[8][NT][2], sx[8][NT][2];
#pragma unroll
        for (int b = 0; b < 8; b++) {
            const int64_t kb = (int64_t)s * 8 + min(b, nb - 1);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int8_t *p = xr[j] + kb * 32;
                bf[b][j][0] = __ldg((const unsigned int *)p);
                bf[b][j][1] = __ldg((const unsigned int *)(p + 16));
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    dx[b][j][e] = __ldg(dr[j][e] + kb);
                    sx[b][j][e] = Q::SUM ? __ldg(sr[j][e] + kb) : 0.0f;
                }
            }
        }
        mq_wait<NST - 1>(); /* this lane's copies of stage k have landed */
        __syncwarp();       /* and every other lane's */
        const uint8_t *ws = ring + (k % NST) * WST;
        const int so = mq_off<T>(s);
#pragma unroll
        for (int b = 0; b < 8; b++) {
            if (b < nb) {
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    const int r0 = m * 16 + g;
                    uint32_t af[4];
                    float d0, d1, m0, m1;
                    Q::row(ws + r0 * SBP, so, b, tig, af[0], af[2], d0, m0);
                    Q::row(ws + (r0 + 8) * SBP, so, b, tig, af[1], af[3], d1, m1);
#pragma unroll
                    for (int j = 0; j < NT; j++)
                        mq_acc<Q>(acc[m][j], af, bf[b][j][0], bf[b][j][1], d0, d1, m0, m1, dx[b][j][0], dx[b][j][1],
                                  sx[b][j][0], sx[b][j][1]);
                }
            }
        }
    }

    mq_wait<0>();
    __syncthreads(); /* every warp past its stages: the rings become the reduction buffer */
    float *red = (float *)sm; /* [4][BN][BMP] */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float *p = red + (warp * BN + 8 * j + 2 * tig) * BMP + m * 16 + g;
            p[0] = acc[m][j][0];
            p[BMP] = acc[m][j][1];
            p[8] = acc[m][j][2];
            p[BMP + 8] = acc[m][j][3];
        }
    __syncthreads();
    if (gridDim.z > 1) { /* one slice of K: the tile's partial sums (gate and up rows alike) */
        float *pp = a.part + ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (BN * BM);
        for (int i = threadIdx.x; i < BN * BM; i += 128) {
            const int c = i / BM, r = i - c * BM;
            float v = red[c * BMP + r];
#pragma unroll
            for (int w = 1; w < 4; w++) v += red[(w * BN + c) * BMP + r];
            pp[i] = v;
        }
        return;
    }
    for (int i = threadIdx.x; i < BN * RT; i += 128) {
        const int c = i / RT, r = i - c * RT;
        const int64_t tok = t0 + c, row = tl.row0 + r;
        if (tok >= n || row >= tl.N) continue;
        float v = red[c * BMP + r];
#pragma unroll
        for (int w = 1; w < 4; w++) v += red[(w * BN + c) * BMP + r];
        if (SW) {
            float u = red[c * BMP + RT + r];
#pragma unroll
            for (int w = 1; w < 4; w++) u += red[(w * BN + c) * BMP + RT + r];
            v = st_silu_mul(v, u);
        }
        tl.y[tok * tl.N + row] = v;
    }
}

/* ---- launch -------------------------------------------------------------------------- */

/* K slices of a launch of `blocks` blocks: enough blocks for two per SM
 * (the small weights: 4096 rows at 64 tokens are 128 blocks), at least 4
 * of its nst stages a slice, at most MQ_MAX_SLICES. The slices' partial
 * sums go to a.part, and mmq_slices_kernel adds them in slice order. */
static int mq_slices(int64_t blocks, int64_t nst, int sm_count) {
    if (blocks >= 2 * (int64_t)sm_count) return 1;
    int64_t ks = (2 * (int64_t)sm_count + blocks - 1) / blocks;
    if (ks > nst / 4) ks = nst / 4;
    if (ks > MQ_MAX_SLICES) ks = MQ_MAX_SLICES;
    return ks < 2 ? 1 : (int)ks;
}

template <int T, int MT, int NT, bool SW>
static strata_status mqw_launch(cudaStream_t s, bool pdl, st_gemv_args a, bool setup, int sm_count,
                                size_t *part_bytes) {
    constexpr int BM = 16 * MT, BN = 8 * NT, WST = BM * mqw_sbp(mq<T>::SB);
    constexpr int SMEM = mq_max(4 * mqw_nst(WST) * WST, 4 * BN * (BM + 4) * 4);
    if (setup) {
        ST_CUDA_TRY(cudaFuncSetAttribute(mmqw_kernel<T, MT, NT, SW>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
        return STRATA_OK;
    }
    constexpr int RT = SW ? BM / 2 : BM;
    int64_t tiles = 0;
    for (int i = 0; i < (SW ? 1 : a.count); i++) {
        a.b0[i] = (unsigned)tiles;
        tiles += (a.N[i] + RT - 1) / RT;
    }
    const int64_t gx = (a.n + BN - 1) / BN;
    if (tiles > 65535 || gx > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda mmq: %lld row tiles x %lld token tiles is too large", (long long)tiles,
                      (long long)gx);
    /* K slices as the block pipeline's, at least 2 stages per warp */
    const int ks = mq_slices(gx * tiles, (a.K / 32 + 7) / 8 / 2, sm_count);
    const size_t pb = ks > 1 ? (size_t)ks * (size_t)(gx * tiles) * (BN * BM) * sizeof(float) : 0;
    if (part_bytes) {
        *part_bytes = pb;
        return STRATA_OK;
    }
    if (pb && !a.part) return st_err(STRATA_ERR_INVALID_ARG, "cuda mmq: %d K slices and no partials buffer", ks);
    a.groups = (unsigned)tiles;
    ST_CUDA_TRY(st_launch(pdl, mmqw_kernel<T, MT, NT, SW>, dim3((unsigned)gx, (unsigned)tiles, (unsigned)ks), dim3(128),
                          (size_t)SMEM, s, a));
    if (ks > 1) ST_CUDA_TRY((mq_sum_parts<BM, BN, SW>(s, pdl, a, gx, tiles, ks)));
    return STRATA_OK;
}


/* part_bytes not NULL: the bytes of a.part the launch needs (0: no K
 * slices), nothing launched. */
template <int T, int MT, int NT, int WM, int WN, int WK, bool SW>
static strata_status mq_launch(cudaStream_t s, bool pdl, st_gemv_args a, bool setup, int sm_count,
                               size_t *part_bytes) {
    using C = mq_cfg<T, MT, NT, WM, WN, WK>;
    if (setup) {
        ST_CUDA_TRY(cudaFuncSetAttribute(mmq_kernel<T, MT, NT, WM, WN, WK, SW>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM));
        return STRATA_OK;
    }
    constexpr int RT = SW ? C::BM / 2 : C::BM;
    int64_t tiles = 0;
    for (int i = 0; i < (SW ? 1 : a.count); i++) {
        a.b0[i] = (unsigned)tiles;
        tiles += (a.N[i] + RT - 1) / RT;
    }
    const int64_t gx = (a.n + C::BN - 1) / C::BN;
    if (tiles > 65535 || gx > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda mmq: %lld row tiles x %lld token tiles is too large", (long long)tiles,
                      (long long)gx);
    const int ks = mq_slices(gx * tiles, (a.K / 32 + 7) / 8, sm_count);
    const size_t pb = ks > 1 ? (size_t)ks * (size_t)(gx * tiles) * (C::BN * C::BM) * sizeof(float) : 0;
    if (part_bytes) {
        *part_bytes = pb;
        return STRATA_OK;
    }
    if (pb && !a.part) return st_err(STRATA_ERR_INVALID_ARG, "cuda mmq: %d K slices and no partials buffer", ks);
    a.groups = (unsigned)tiles;
    ST_CUDA_TRY(st_launch(pdl, mmq_kernel<T, MT, NT, WM, WN, WK, SW>, dim3((unsigned)gx, (unsigned)tiles, (unsigned)ks),
                          dim3(C::THREADS), (size_t)C::SMEM, s, a));
    if (ks > 1) ST_CUDA_TRY((mq_sum_parts<C::BM, C::BN, SW>(s, pdl, a, gx, tiles, ks)));
    return STRATA_OK;
}

/* Tile shapes by token count. Up to 16 tokens: the per-warp pipelines,
 * 32 rows, one token tile. More: a block pipeline of 8 warps over 64 rows
 * (each x byte read from L2 serves 64 rows) and 32- or 64-token tiles
 * (tiles of the token dimension run side by side on the same rows), unless
 * that leaves fewer blocks than SMs: then 4 warps over 32 rows. */
template <int T, bool SW>
static strata_status mq_dispatch(cudaStream_t s, bool pdl, const st_gemv_args &a, bool setup, int sm_count,
                                 size_t *pb) {
    strata_status st;
    if (pb) *pb = 0;
    if (setup || a.n <= 8)
        if ((st = mqw_launch<T, 2, 1, SW>(s, pdl, a, setup, sm_count, pb)) != STRATA_OK || !setup) return st;
    if (setup || a.n <= 16)
        if ((st = mqw_launch<T, 2, 2, SW>(s, pdl, a, setup, sm_count, pb)) != STRATA_OK || !setup) return st;
    int64_t rows = 0;
    for (int i = 0; i < (SW ? 1 : a.count); i++) rows += a.N[i];
    const int64_t rt = SW ? 32 : 64; /* output rows of a 64-row tile */
    const bool wide = (rows + rt - 1) / rt * ((a.n + (a.n <= 32 ? 31 : 63)) / (a.n <= 32 ? 32 : 64)) >= sm_count;
    if (setup || a.n <= 32) {
        if (setup || wide)
            if ((st = mq_launch<T, 2, 4, 2, 1, 4, SW>(s, pdl, a, setup, sm_count, pb)) != STRATA_OK || !setup) return st;
        if ((st = mq_launch<T, 2, 4, 1, 1, 4, SW>(s, pdl, a, setup, sm_count, pb)) != STRATA_OK || !setup) return st;
    }
    if (setup || wide)
        if ((st = mq_launch<T, 2, 4, 2, 2, 2, SW>(s, pdl, a, setup, sm_count, pb)) != STRATA_OK || !setup) return st;
    return mq_launch<T, 1, 8, 2, 1, 2, SW>(s, pdl, a, setup, sm_count, pb);
}

template <int T>
static strata_status mq_dtype(cudaStream_t s, bool pdl, bool swiglu, const st_gemv_args &a, bool setup, int smc,
                              size_t *pb) {
    if (setup) {
        strata_status st = mq_dispatch<T, false>(s, pdl, a, true, smc, NULL);
        return st != STRATA_OK ? st : mq_dispatch<T, true>(s, pdl, a, true, smc, NULL);
    }
    return swiglu ? mq_dispatch<T, true>(s, pdl, a, false, smc, pb) : mq_dispatch<T, false>(s, pdl, a, false, smc, pb);
}

static strata_status mq_any(int dtype, cudaStream_t s, bool pdl, bool swiglu, const st_gemv_args &a, bool setup,
                            int smc, size_t *pb) {
    switch (dtype) {
    case ST_DTYPE_Q8_0: return mq_dtype<ST_DTYPE_Q8_0>(s, pdl, swiglu, a, setup, smc, pb);
    case ST_DTYPE_Q4_0: return mq_dtype<ST_DTYPE_Q4_0>(s, pdl, swiglu, a, setup, smc, pb);
    case ST_DTYPE_Q4_1: return mq_dtype<ST_DTYPE_Q4_1>(s, pdl, swiglu, a, setup, smc, pb);
    case ST_DTYPE_Q4_K: return mq_dtype<ST_DTYPE_Q4_K>(s, pdl, swiglu, a, setup, smc, pb);
    case ST_DTYPE_Q6_K: return mq_dtype<ST_DTYPE_Q6_K>(s, pdl, swiglu, a, setup, smc, pb);
    default: break;
    }
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda mmq: dtype %s", st_dtype_name((st_dtype)dtype));
}

size_t st_cuda_mmq_part_bytes(int dtype, bool swiglu, const st_gemv_args &a, int sm_count) {
    size_t pb = 0;
    return mq_any(dtype, 0, false, swiglu, a, false, sm_count, &pb) == STRATA_OK ? pb : 0;
}

bool st_cuda_mmq_supports(int dtype, size_t row_bytes, int64_t K) {
    switch (dtype) {
    case ST_DTYPE_Q8_0:
    case ST_DTYPE_Q4_0:
    case ST_DTYPE_Q4_1:
    case ST_DTYPE_Q4_K:
    case ST_DTYPE_Q6_K: return row_bytes > 0 && row_bytes % 16 == 0 && K > 0 && K % 128 == 0;
    default: return false;
    }
}

bool st_cuda_mmq_needs_sums(int dtype) { return dtype == ST_DTYPE_Q4_1 || dtype == ST_DTYPE_Q4_K; }

strata_status st_cuda_mmq(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a, int sm_count) {
    if (!a.xq || !a.xd || (st_cuda_mmq_needs_sums(dtype) && !a.xs))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda mmq: x not quantized (xq, xd%s missing)",
                      st_cuda_mmq_needs_sums(dtype) ? ", xs" : "");
    return mq_any(dtype, s, pdl, swiglu, a, false, sm_count, NULL);
}

strata_status st_cuda_mmq_setup(void) {
    st_gemv_args a;
    memset(&a, 0, sizeof a);
    const int types[] = {ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K, ST_DTYPE_Q6_K};
    for (int i = 0; i < 5; i++) {
        strata_status st = mq_any(types[i], 0, false, false, a, true, 1, NULL);
        if (st != STRATA_OK) return st;
    }
    return STRATA_OK;
}

/* Decode GEMV, staged version ("gemv2"): y[n, N] = x[n, K] @ w[N, K]^T for
 * n <= 8 tokens per pass (grid.y covers more), fp32 x and y, fp32
 * accumulation, weights bf16, f16, q8_0, q4_0, q4_1 or q4_k (cuda_gemv.cuh;
 * cuda_matmul.cu picks it over its older mmv_kernel where it applies).
 *
 * Layout of the work. A row group is R rows of one weight (2R row slots in
 * SwiGLU mode: gate rows, then up rows) for NT tokens. A row is cut into
 * stages of 32 units (a unit: the 8 to 32 elements one lane decodes); in a
 * block (4 warps), warp w takes stages w, w + 4, w + 8, ... of the group and
 * the block adds the warps' partial sums at the end of the group (a fixed
 * order: deterministic). For bf16 / f16 the grid is at most one wave: each
 * block walks row groups blockIdx.x, + gridDim.x, ..., and its
 * warps' copies run on across group boundaries, so the memory latency is
 * paid once per launch, not once per group; for one token, groups of half
 * the rows where that leaves the last round of blocks less empty (see
 * g2_plain for the measurements). The quantized types keep one block per
 * group: they are bound by their decode instructions, not by latency
 * (Nsight Compute, q4_0 SwiGLU 14336 x 4096 on the H200: ~6.4 instructions
 * issued per weight, issue slots 60% busy, DRAM 34%, 4 warps per scheduler
 * with the occupancy limited by the staging ring's shared memory).
 *
 * Weight bytes move with cp.async: each warp copies the R rows' bytes of a
 * stage (16-byte pieces, consecutive lanes on consecutive pieces: fully
 * coalesced, whatever the block size) into its own ring of NST stages in
 * shared memory, NST - 1 stages ahead of the one it decodes. Rows must be a
 * multiple of 16 bytes (st_cuda_gemv2_supports). The first NST - 1 stages are
 * requested before the PDL wait: weights are never written by kernels (only
 * by copies and uploads, which are ordinary stream dependencies, not
 * relaxed by PDL), so their loads overlap the previous kernel's tail; x is
 * read and y written only after the wait.
 *
 * Decoding reads a unit from shared memory (aligned 32-bit words and funnel
 * shifts where a block's bytes are only 2-byte aligned), turns the packed
 * integers into exact floats without int-to-float conversions (byte placed
 * in the mantissa of 2^23, then 2^23 + offset subtracted), and factors the
 * block scale out of the dot product: a unit contributes
 * d * sum_j q_j x_j (+ m * sum_j x_j for q4_1; d_i, m_i per sub-block for
 * q4_k), where the reference dequantizes d * q_j first. d * q_j is exact in
 * fp32 for q8_0, q4_0 (at most 19 significant bits), so only the rounding of
 * the sums differs from dequantize-then-dot; both are fp32 accumulations,
 * within ~1e-6 relative of each other. x is read through L1 (float4 loads),
 * once per unit and token, and shared by the block's R rows.
 *
 * Tokens: for NT <= 2 a lane keeps its unit's x of every token in registers
 * and decodes row after row; for NT = 4, 8 it decodes all R rows' units into
 * registers and then walks the tokens. Each weight byte is read once per
 * pass whatever NT.
 *
 * int8 kernels (fast mode, set_fast_prefill; q8_0 from 2 tokens, q4_0,
 * q4_1, q4_k; cuda_matmul.cu chooses; one token goes to the direct kernel
 * of cuda_gemv1.cu where K % 128 == 0, so the one-token variants here serve
 * other K and st_backend_params.gemv1_rows -1, the comparison). The fp32 path above costs ~6.4
 * instructions issued per weight and NT times the FMAs for NT tokens. Here
 * each matmul first quantizes x[n, K] once (g2_quant_x_kernel: per token and
 * 32-element block, d = max|x| / 127, q = round(x / d), llama.cpp's q8_1
 * without sums) into int8 xq and fp32 scales xd, shared by every row. A lane
 * keeps its unit's weights as packed bytes (q8_0 as stored, 4-bit types as
 * nibbles masked into bytes: no conversion) and per token and row adds
 * d_w d_x sum q x_q with 4 dp4a (8 for q4_k) + one scale product + one FMA;
 * q4_0's -8 enters as -8 sum x_q (4 dp4a per token, shared by the R rows),
 * q4_1's and q4_k's mins as m d_x sum x_q. x comes from L1 as 16 bytes per
 * unit and token instead of 64, so several tokens cost far less: more rows
 * per block for NT = 4, 8 (the packed words leave registers free), and for
 * NT > 1 the one-wave grid of walking blocks (g2_walk). Error against the
 * fp32 reference (max|y - ref| / max|ref|, gpu_check_ops, random weights
 * and x): ~3.5e-3 to 4e-3 on 4096- and 14336-deep rows, 7.7e-3 at most over
 * the checks then (13-row, 512-deep cases; threshold now 1.5e-2), SwiGLU
 * 7.8e-3; the
 * precise path stays within 1e-5 (checked at that threshold). Measured on
 * an H100 (bench_cuda_ops, us, fp32 path -> int8): q4_0 14336 x 4096 n = 1
 * 22.5 -> 20.1, n = 5 112 -> 37, n = 8 156 -> 44; q8_0 n = 5 64.6 -> 40.3,
 * n = 8 88.2 -> 45.6; one token of 1024 x 4096 is slower (4.4 -> 5.7: the
 * quantization is one more launch). Whole 8B-shaped q4_0 model, H200: 272 ->
 * 312 tok/s for one sequence, 388 -> 1188 for 8, a pass of 5 tokens 4.4x ->
 * 2.2x a one-token step (bench/RESULTS.md, 2026-11-26). */
#include "backend/cuda/cuda_gemv.cuh"

#include <string.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define G2_WARPS 4
#define G2_THREADS (G2_WARPS * 32)
#define G2_WARP_SMEM 9216 /* staging bytes per warp the ring aims at */
#ifndef G2_WARP_SMEM_Q
#define G2_WARP_SMEM_Q 9216 /* the same for the quantized types (a build-time knob for measurements) */
#endif

/* ---- cp.async (sm_80+) ----------------------------------------------------------- */

ST_DEV void g2_cp16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
ST_DEV void g2_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> ST_DEV void g2_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }


/* NW little-endian words of the bytes at byte offset off (even) of a 16-byte
 * aligned shared buffer s. Reads one word past them when off % 4 == 2. */
template <int NW>
ST_DEV void g2_words(const uint8_t *s, int off, uint32_t out[NW]) {
    const uint32_t *w = (const uint32_t *)s + (off >> 2);
    const unsigned sh = (unsigned)(off & 2) * 8u; /* 0 or 16 */
    uint32_t t[NW + 1];
#pragma unroll
    for (int i = 0; i < NW; i++) t[i] = w[i];
    t[NW] = sh ? w[NW] : 0u;
#pragma unroll
    for (int i = 0; i < NW; i++) out[i] = __funnelshift_r(t[i], t[i + 1], sh);
}

ST_DEV float g2_h2f(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu))); }

/* ---- units --------------------------------------------------------------------------
 * g2<T>: U elements per lane unit in U / 8 runs of 8 contiguous elements (run
 * j starts at element off(l, j) of the stage, lane l); SB bytes per row and
 * stage (32 units); decode() gives v[U] (the weights, or for scaled types the
 * exact small integers q) and NSC scales; accum() adds the unit's dot product
 * with x (x[U] in the same run order, xs[NXS] its sums from xsum()). */
template <int T> struct g2;

template <> struct g2<ST_DTYPE_BF16> {
    static constexpr int U = 8, SB = 512, NSC = 1, NXS = 1;
    ST_DEV static int off(int l, int) { return 8 * l; }
    ST_DEV static bool valid(int l, int rem) { return 8 * l < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *) {
        const uint4 q = ((const uint4 *)s)[l];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    ST_DEV static void xsum(const float *, float *) {}
    ST_DEV static float accum(const float v[U], const float *, const float x[U], const float *, float acc) {
#pragma unroll
        for (int k = 0; k < U; k++) acc = fmaf(v[k], x[k], acc);
        return acc;
    }
};

template <> struct g2<ST_DTYPE_F16> {
    static constexpr int U = 8, SB = 512, NSC = 1, NXS = 1;
    ST_DEV static int off(int l, int) { return 8 * l; }
    ST_DEV static bool valid(int l, int rem) { return 8 * l < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *) {
        const uint4 q = ((const uint4 *)s)[l];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = g2_h2f(w[i]);
            v[2 * i + 1] = g2_h2f(w[i] >> 16);
        }
    }
    ST_DEV static void xsum(const float *, float *) {}
    ST_DEV static float accum(const float v[U], const float *, const float x[U], const float *, float acc) {
#pragma unroll
        for (int k = 0; k < U; k++) acc = fmaf(v[k], x[k], acc);
        return acc;
    }
};

/* sum_k v[k] x[k] over k in [a, b), starting from 0 */
template <int A, int B>
ST_DEV float g2_dot(const float *v, const float *x) {
    float p = __fmul_rn(v[A], x[A]);
#pragma unroll
    for (int k = A + 1; k < B; k++) p = fmaf(v[k], x[k], p);
    return p;
}

/* Q8_0: unit = half a block (16 int8, contiguous elements 16 l ..), its d. */
template <> struct g2<ST_DTYPE_Q8_0> {
    static constexpr int U = 16, SB = 16 * 34, NSC = 1, NXS = 1;
    ST_DEV static int off(int l, int j) { return 16 * l + 8 * j; }
    ST_DEV static bool valid(int l, int rem) { return 32 * (l >> 1) < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *sc) {
        const int b = 34 * (l >> 1);
        sc[0] = g2_h2f(((const uint16_t *)s)[b >> 1]);
        uint32_t w[4];
        g2_words<4>(s, b + 2 + 16 * (l & 1), w);
#pragma unroll
        for (int i = 0; i < 4; i++) st_bytes_f4(w[i] ^ 0x80808080u, 128.0f, v + 4 * i); /* int8 -> uint8 + 128 */
    }
    ST_DEV static void xsum(const float *, float *) {}
    ST_DEV static float accum(const float v[U], const float *sc, const float x[U], const float *, float acc) {
        return fmaf(sc[0], g2_dot<0, U>(v, x), acc);
    }
};

/* Q4_0: unit = 8 bytes of a block's nibbles (bytes 8h.., h = l & 1): run 0 =
 * low nibbles (elements 8h ..), run 1 = high nibbles (16 + 8h ..). */
template <> struct g2<ST_DTYPE_Q4_0> {
    static constexpr int U = 16, SB = 16 * 18, NSC = 1, NXS = 1;
    ST_DEV static int off(int l, int j) { return 32 * (l >> 1) + 8 * (l & 1) + 16 * j; }
    ST_DEV static bool valid(int l, int rem) { return 32 * (l >> 1) < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *sc) {
        const int b = 18 * (l >> 1);
        sc[0] = g2_h2f(((const uint16_t *)s)[b >> 1]);
        uint32_t w[2];
        g2_words<2>(s, b + 2 + 8 * (l & 1), w);
        st_bytes_f4(w[0] & 0x0f0f0f0fu, 8.0f, v);
        st_bytes_f4(w[1] & 0x0f0f0f0fu, 8.0f, v + 4);
        st_bytes_f4((w[0] >> 4) & 0x0f0f0f0fu, 8.0f, v + 8);
        st_bytes_f4((w[1] >> 4) & 0x0f0f0f0fu, 8.0f, v + 12);
    }
    ST_DEV static void xsum(const float *, float *) {}
    ST_DEV static float accum(const float v[U], const float *sc, const float x[U], const float *, float acc) {
        return fmaf(sc[0], g2_dot<0, U>(v, x), acc);
    }
};

/* Q4_1: as Q4_0 with q = nibble and the block's m: d sum q x + m sum x. */
template <> struct g2<ST_DTYPE_Q4_1> {
    static constexpr int U = 16, SB = 16 * 20, NSC = 2, NXS = 1;
    ST_DEV static int off(int l, int j) { return 32 * (l >> 1) + 8 * (l & 1) + 16 * j; }
    ST_DEV static bool valid(int l, int rem) { return 32 * (l >> 1) < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *sc) {
        const uint32_t *b = (const uint32_t *)s + 5 * (l >> 1); /* blocks are 4-byte aligned */
        const uint32_t dm = b[0];
        sc[0] = g2_h2f(dm);
        sc[1] = g2_h2f(dm >> 16);
        const uint32_t w0 = b[1 + 2 * (l & 1)], w1 = b[2 + 2 * (l & 1)];
        st_bytes_f4(w0 & 0x0f0f0f0fu, 0.0f, v);
        st_bytes_f4(w1 & 0x0f0f0f0fu, 0.0f, v + 4);
        st_bytes_f4((w0 >> 4) & 0x0f0f0f0fu, 0.0f, v + 8);
        st_bytes_f4((w1 >> 4) & 0x0f0f0f0fu, 0.0f, v + 12);
    }
    ST_DEV static void xsum(const float *x, float *xs) {
        float t = x[0];
#pragma unroll
        for (int k = 1; k < U; k++) t = __fadd_rn(t, x[k]);
        xs[0] = t;
    }
    ST_DEV static float accum(const float v[U], const float *sc, const float x[U], const float *xs, float acc) {
        return fmaf(sc[1], xs[0], fmaf(sc[0], g2_dot<0, U>(v, x), acc));
    }
};

/* Q4_K: unit = 16 bytes i (0..1) of the nibbles of 64-element chunk c of a
 * block (l = 8 block + 2c + i, as st_unit<Q4_K>): runs 0, 1 = low nibbles
 * (sub-block 2c, elements 16i ..), runs 2, 3 = high nibbles (sub-block
 * 2c + 1). Element = (d s) q - dmin m per sub-block: d s sum q x - dmin m sum x. */
template <> struct g2<ST_DTYPE_Q4_K> {
    static constexpr int U = 32, SB = 4 * 144, NSC = 4, NXS = 2;
    ST_DEV static int off(int l, int j) {
        return 256 * (l >> 3) + 64 * ((l >> 1) & 3) + 16 * (l & 1) + 8 * (j & 1) + 32 * (j >> 1);
    }
    ST_DEV static bool valid(int l, int rem) { return 256 * (l >> 3) < rem; }
    ST_DEV static void decode(const uint8_t *s, int l, float v[U], float *sc) {
        const uint8_t *b = s + 144 * (l >> 3); /* 16-byte aligned */
        const int c = (l >> 1) & 3, i = l & 1;
        const uint4 hd = *(const uint4 *)b; /* d, dmin | scales[12] */
        const uint4 q = *(const uint4 *)(b + 16 + 32 * c + 16 * i);
        const uint32_t s0 = hd.y, s1 = hd.z, s2 = hd.w;
        const uint32_t scw = c < 2 ? (s0 & 0x3f3f3f3fu) : ((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u));
        const uint32_t mnw = c < 2 ? (s1 & 0x3f3f3f3fu) : (((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u));
        const uint32_t k = (uint32_t)(2 * c) & 3u;
        const float d = g2_h2f(hd.x), dmin = g2_h2f(hd.x >> 16);
        const float two23 = 8388608.0f;
        const float fs0 = __fsub_rn(__uint_as_float(__byte_perm(scw, 0x4B000000u, 0x7540u | k)), two23);
        const float fs1 = __fsub_rn(__uint_as_float(__byte_perm(scw, 0x4B000000u, 0x7540u | (k + 1))), two23);
        const float fm0 = __fsub_rn(__uint_as_float(__byte_perm(mnw, 0x4B000000u, 0x7540u | k)), two23);
        const float fm1 = __fsub_rn(__uint_as_float(__byte_perm(mnw, 0x4B000000u, 0x7540u | (k + 1))), two23);
        sc[0] = __fmul_rn(d, fs0), sc[1] = __fmul_rn(dmin, fm0);
        sc[2] = __fmul_rn(d, fs1), sc[3] = __fmul_rn(dmin, fm1);
        st_bytes_f4(q.x & 0x0f0f0f0fu, 0.0f, v);
        st_bytes_f4(q.y & 0x0f0f0f0fu, 0.0f, v + 4);
        st_bytes_f4(q.z & 0x0f0f0f0fu, 0.0f, v + 8);
        st_bytes_f4(q.w & 0x0f0f0f0fu, 0.0f, v + 12);
        st_bytes_f4((q.x >> 4) & 0x0f0f0f0fu, 0.0f, v + 16);
        st_bytes_f4((q.y >> 4) & 0x0f0f0f0fu, 0.0f, v + 20);
        st_bytes_f4((q.z >> 4) & 0x0f0f0f0fu, 0.0f, v + 24);
        st_bytes_f4((q.w >> 4) & 0x0f0f0f0fu, 0.0f, v + 28);
    }
    ST_DEV static void xsum(const float *x, float *xs) {
        float a = x[0], b = x[16];
#pragma unroll
        for (int k = 1; k < 16; k++) a = __fadd_rn(a, x[k]), b = __fadd_rn(b, x[16 + k]);
        xs[0] = a, xs[1] = b;
    }
    ST_DEV static float accum(const float v[U], const float *sc, const float x[U], const float *xs, float acc) {
        acc = fmaf(sc[0], g2_dot<0, 16>(v, x), acc);
        acc = fmaf(-sc[1], xs[0], acc);
        acc = fmaf(sc[2], g2_dot<16, 32>(v, x), acc);
        return fmaf(-sc[3], xs[1], acc);
    }
};

/* ---- int8 units (fast mode) ----------------------------------------------------------
 * x quantized per 32-element block: xq int8, xd the block's scale. A lane's
 * x of one token and unit: w[U / 4] words (run j: words 2j, 2j + 1 = the 8
 * int8 at element off(l, j)), d[] the scales of its 32-blocks (q4_k: two),
 * s[] / z the sums the weights' offsets need (computed once per token and
 * unit, shared by the R rows). g2i<T>::decode gives the unit's weights as
 * packed small integers q[NQ] (bytes in run order, as dp4a wants them) and
 * the block scales; accum() adds d_w d_x sum q x_q (+ the offset terms). */
template <int U> struct g2x {
    uint32_t w[U / 4];
    float d[2], s[2]; /* s: d_x * sum x_q over the 16 elements of a sub-block run pair */
    int z;            /* q4_0: -8 * sum x_q */
};

ST_DEV int g2_dp4(uint32_t a, uint32_t b, int c) { return __dp4a((int)a, (int)b, c); }

template <int T> struct g2i;

/* Q8_0: q = the 16 int8 of the unit. */
template <> struct g2i<ST_DTYPE_Q8_0> {
    static constexpr int NQ = 4, NSC = 1;
    ST_DEV static void decode(const uint8_t *s, int l, uint32_t q[NQ], float *sc) {
        const int b = 34 * (l >> 1);
        sc[0] = g2_h2f(((const uint16_t *)s)[b >> 1]);
        g2_words<4>(s, b + 2 + 16 * (l & 1), q);
    }
    ST_DEV static void xprep(g2x<16> &) {}
    ST_DEV static float accum(const uint32_t q[NQ], const float *sc, const g2x<16> &x, float acc) {
        int p = g2_dp4(q[0], x.w[0], 0);
        p = g2_dp4(q[1], x.w[1], p);
        p = g2_dp4(q[2], x.w[2], p);
        p = g2_dp4(q[3], x.w[3], p);
        return fmaf(__fmul_rn(sc[0], x.d[0]), (float)p, acc);
    }
};

/* Q4_0: q = nibbles (run 0 low, run 1 high), element = d (q - 8): the -8 sum
 * x_q starts the integer sum. */
template <> struct g2i<ST_DTYPE_Q4_0> {
    static constexpr int NQ = 4, NSC = 1;
    ST_DEV static void decode(const uint8_t *s, int l, uint32_t q[NQ], float *sc) {
        const int b = 18 * (l >> 1);
        sc[0] = g2_h2f(((const uint16_t *)s)[b >> 1]);
        uint32_t w[2];
        g2_words<2>(s, b + 2 + 8 * (l & 1), w);
        q[0] = w[0] & 0x0f0f0f0fu, q[1] = w[1] & 0x0f0f0f0fu;
        q[2] = (w[0] >> 4) & 0x0f0f0f0fu, q[3] = (w[1] >> 4) & 0x0f0f0f0fu;
    }
    ST_DEV static void xprep(g2x<16> &x) {
        int z = g2_dp4(0xf8f8f8f8u, x.w[0], 0); /* bytes of -8 */
        z = g2_dp4(0xf8f8f8f8u, x.w[1], z);
        z = g2_dp4(0xf8f8f8f8u, x.w[2], z);
        x.z = g2_dp4(0xf8f8f8f8u, x.w[3], z);
    }
    ST_DEV static float accum(const uint32_t q[NQ], const float *sc, const g2x<16> &x, float acc) {
        int p = g2_dp4(q[0], x.w[0], x.z);
        p = g2_dp4(q[1], x.w[1], p);
        p = g2_dp4(q[2], x.w[2], p);
        p = g2_dp4(q[3], x.w[3], p);
        return fmaf(__fmul_rn(sc[0], x.d[0]), (float)p, acc);
    }
};

/* Q4_1: q = nibbles, element = d q + m: d d_x sum q x_q + m d_x sum x_q. */
template <> struct g2i<ST_DTYPE_Q4_1> {
    static constexpr int NQ = 4, NSC = 2;
    ST_DEV static void decode(const uint8_t *s, int l, uint32_t q[NQ], float *sc) {
        const uint32_t *b = (const uint32_t *)s + 5 * (l >> 1);
        const uint32_t dm = b[0];
        sc[0] = g2_h2f(dm);
        sc[1] = g2_h2f(dm >> 16);
        const uint32_t w0 = b[1 + 2 * (l & 1)], w1 = b[2 + 2 * (l & 1)];
        q[0] = w0 & 0x0f0f0f0fu, q[1] = w1 & 0x0f0f0f0fu;
        q[2] = (w0 >> 4) & 0x0f0f0f0fu, q[3] = (w1 >> 4) & 0x0f0f0f0fu;
    }
    ST_DEV static void xprep(g2x<16> &x) {
        int z = g2_dp4(0x01010101u, x.w[0], 0);
        z = g2_dp4(0x01010101u, x.w[1], z);
        z = g2_dp4(0x01010101u, x.w[2], z);
        z = g2_dp4(0x01010101u, x.w[3], z);
        x.s[0] = __fmul_rn(x.d[0], (float)z);
    }
    ST_DEV static float accum(const uint32_t q[NQ], const float *sc, const g2x<16> &x, float acc) {
        int p = g2_dp4(q[0], x.w[0], 0);
        p = g2_dp4(q[1], x.w[1], p);
        p = g2_dp4(q[2], x.w[2], p);
        p = g2_dp4(q[3], x.w[3], p);
        return fmaf(sc[1], x.s[0], fmaf(__fmul_rn(sc[0], x.d[0]), (float)p, acc));
    }
};

/* Q4_K: q[0..3] low nibbles (sub-block 2c: runs 0, 1, x block d[0]),
 * q[4..7] high nibbles (2c + 1: runs 2, 3, d[1]); scales as g2<Q4_K>. */
template <> struct g2i<ST_DTYPE_Q4_K> {
    static constexpr int NQ = 8, NSC = 4;
    ST_DEV static void decode(const uint8_t *s, int l, uint32_t q[NQ], float *sc) {
        const uint8_t *b = s + 144 * (l >> 3);
        const int c = (l >> 1) & 3, i = l & 1;
        const uint4 hd = *(const uint4 *)b;
        const uint4 w = *(const uint4 *)(b + 16 + 32 * c + 16 * i);
        const uint32_t s0 = hd.y, s1 = hd.z, s2 = hd.w;
        const uint32_t scw = c < 2 ? (s0 & 0x3f3f3f3fu) : ((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u));
        const uint32_t mnw = c < 2 ? (s1 & 0x3f3f3f3fu) : (((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u));
        const unsigned k = (unsigned)(2 * c) & 3u;
        const float d = g2_h2f(hd.x), dmin = g2_h2f(hd.x >> 16);
        sc[0] = __fmul_rn(d, (float)((scw >> (8 * k)) & 0xffu));
        sc[1] = __fmul_rn(dmin, (float)((mnw >> (8 * k)) & 0xffu));
        sc[2] = __fmul_rn(d, (float)((scw >> (8 * k + 8)) & 0xffu));
        sc[3] = __fmul_rn(dmin, (float)((mnw >> (8 * k + 8)) & 0xffu));
        q[0] = w.x & 0x0f0f0f0fu, q[1] = w.y & 0x0f0f0f0fu, q[2] = w.z & 0x0f0f0f0fu, q[3] = w.w & 0x0f0f0f0fu;
        q[4] = (w.x >> 4) & 0x0f0f0f0fu, q[5] = (w.y >> 4) & 0x0f0f0f0fu, q[6] = (w.z >> 4) & 0x0f0f0f0fu,
        q[7] = (w.w >> 4) & 0x0f0f0f0fu;
    }
    ST_DEV static void xprep(g2x<32> &x) {
        int a = 0, b = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) a = g2_dp4(0x01010101u, x.w[i], a), b = g2_dp4(0x01010101u, x.w[4 + i], b);
        x.s[0] = __fmul_rn(x.d[0], (float)a), x.s[1] = __fmul_rn(x.d[1], (float)b);
    }
    ST_DEV static float accum(const uint32_t q[NQ], const float *sc, const g2x<32> &x, float acc) {
        int a = 0, b = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) a = g2_dp4(q[i], x.w[i], a), b = g2_dp4(q[4 + i], x.w[4 + i], b);
        acc = fmaf(__fmul_rn(sc[0], x.d[0]), (float)a, acc);
        acc = fmaf(-sc[1], x.s[0], acc);
        acc = fmaf(__fmul_rn(sc[2], x.d[1]), (float)b, acc);
        return fmaf(-sc[3], x.s[1], acc);
    }
};

/* A lane's x of one token and unit (int8 path): xq, xd the token's rows, e0
 * the stage's first element. */
template <int T>
ST_DEV void g2_xload(const int8_t *xq, const float *xd, int64_t e0, int l, g2x<g2<T>::U> &x) {
    using Q = g2<T>;
#pragma unroll
    for (int j = 0; j < Q::U / 8; j++) {
        const uint2 v = __ldg((const uint2 *)(xq + e0 + Q::off(l, j)));
        x.w[2 * j] = v.x, x.w[2 * j + 1] = v.y;
    }
    x.d[0] = __ldg(xd + ((e0 + Q::off(l, 0)) >> 5));
    if constexpr (Q::U == 32) x.d[1] = __ldg(xd + ((e0 + Q::off(l, 2)) >> 5)); /* q4_k: the high nibbles' block */
    else x.d[1] = x.d[0];
    g2i<T>::xprep(x);
}

/* x [n, K] -> int8 + per-32 scales (+ d * sum q per block when xs is set,
 * for the MMQ kernels of q4_1 / q4_k): 4 threads per block, 8 elements each. */
static __global__ void __launch_bounds__(256) g2_quant_x_kernel(const float *__restrict__ x, int64_t total8,
                                                               int8_t *__restrict__ xq, float *__restrict__ xd,
                                                               float *__restrict__ xs) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; /* total8 is a multiple of 4: whole warps agree */
    const bool in = i < total8;
    float4 a = make_float4(0, 0, 0, 0), b = a;
    if (in) a = __ldg((const float4 *)x + 2 * i), b = __ldg((const float4 *)x + 2 * i + 1);
    float m = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                    fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float d = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint32_t w[2] = {0, 0};
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = min(127, max(-127, __float2int_rn(v[k] * id)));
        sum += q;
        w[k >> 2] |= ((uint32_t)q & 0xffu) << (8 * (k & 3));
    }
    if (xs) { /* uniform */
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    }
    if (!in) return;
    ((uint2 *)xq)[i] = make_uint2(w[0], w[1]);
    if ((i & 3) == 0) {
        xd[i >> 2] = d;
        if (xs) xs[i >> 2] = __fmul_rn(d, (float)sum);
    }
}

/* ---- the kernel ---------------------------------------------------------------------- */

/* bf16, f16: the types whose GEMV the one-wave grid and the half-height
 * groups help (H200, bench_cuda_ops: bf16 4096 x 4096 81% of HBM vs 69%,
 * decode of the 8B shape 80% vs 77%); for the quantized types they did not
 * (q4_0 decode 29% vs 32%, q4_k 14336 x 4096 23% vs 29%), which keep one
 * block per group of the full height. */
__host__ __device__ constexpr bool g2_plain(int T) { return T == ST_DTYPE_BF16 || T == ST_DTYPE_F16; }

/* The one-wave grid of walking blocks: the plain types, and the int8 kernels
 * for several tokens (H100, bench_cuda_ops: q8_0 14336 x 4096 n = 5 40.3 us
 * walking vs 48.7 us, n = 8 45.6 vs 62.2; q4_0 level). Not for one token:
 * q4_0 14336 x 4096 21.2 vs 20.1 us, 1024 x 4096 7.5 vs 5.7 us, and the 8B
 * decode 273 vs 288 tok/s. */
__host__ __device__ constexpr bool g2_walk(int T, bool I8, int NT) { return g2_plain(T) || (I8 && NT > 1); }

/* Stages in a warp's ring for RR rows of SB bytes: about G2_WARP_SMEM bytes,
 * 2 to 4 (3 at most for the plain types, whose blocks are more numerous). */
template <int T>
__host__ __device__ constexpr int g2_nst(int row_stage_bytes) {
    constexpr bool plain = g2_plain(T);
    const int cap = plain ? 3 : 4;
    const int n = (plain ? G2_WARP_SMEM : G2_WARP_SMEM_Q) / row_stage_bytes;
    return n < 2 ? 2 : n > cap ? cap : n;
}

/* The warp's copy side: the stages of every row group the block walks, in
 * order (group by group, stage warp, warp + 4, ... of each), each into ring
 * slot j % NST. issue() always commits a group (empty past the end) so that
 * group counting stays uniform. */
template <int R, bool SW, int SB, int NST>
struct g2_copier {
    static constexpr int RR = SW ? 2 * R : R;
    const uint8_t *wr[RR]; /* rows of the group being requested */
    unsigned g;            /* that group */
    int st;                /* next stage of it, in the warp's list */

    ST_DEV void rows(const st_gemv_args &a) {
        const st_gemv_group q = st_gemv_group_of<R, SW>(a, g);
#pragma unroll
        for (int r = 0; r < R; r++) {
            wr[r] = q.w + (size_t)min(q.row0 + r, q.N - 1) * a.rb; /* rows past N: a copy of the last, not written */
            if (SW) wr[R + r] = a.w[1] + (size_t)min(q.row0 + r, q.N - 1) * a.rb;
        }
    }
    ST_DEV void start(const st_gemv_args &a, unsigned g0) {
        g = g0, st = 0;
        if (g < a.groups) rows(a);
    }
    ST_DEV void issue(uint8_t *ring, const st_gemv_args &a, int warp, int lane, int j, int jcnt, int cnt,
                      unsigned stride) {
        if (j < jcnt) {
            constexpr int C16 = SB / 16;
            const size_t base = (size_t)(warp + G2_WARPS * st) * SB;
            uint8_t *buf = ring + (j % NST) * (RR * SB);
#pragma unroll 4
            for (int c = lane; c < RR * C16; c += 32) {
                const int r = c / C16, k = c - r * C16;
                const size_t o = base + 16 * (size_t)k;
                if (o < a.rb) g2_cp16(buf + r * SB + 16 * k, wr[r] + o);
            }
            if (++st == cnt) {
                st = 0, g += stride;
                if (g < a.groups) rows(a);
            }
        }
        g2_commit();
    }
};

/* grid.x blocks walk the row groups g = blockIdx.x, + gridDim.x, ...; the
 * copies run ahead across group boundaries, so a warp waits for memory once
 * per launch rather than once per group. Partial sums of a group go through
 * red[group parity] and one block barrier per group. */
template <int T, int NT, int R, bool SW, bool I8>
static __global__ void __launch_bounds__(G2_THREADS) gemv2_kernel(const st_gemv_args a) {
    using Q = g2<T>;
    constexpr int RR = SW ? 2 * R : R;
    constexpr int U = Q::U, SE = 32 * U, SB = Q::SB;
    constexpr int NST = g2_nst<T>(RR * SB);
    __shared__ __align__(16) uint8_t ring_all[G2_WARPS * NST * RR * SB + 16]; /* + slack for g2_words */
    __shared__ float red[2][G2_WARPS][RR * NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    const int64_t K = a.K;
    const unsigned stride = gridDim.x;
    const int nmine = blockIdx.x < a.groups ? (int)((a.groups - 1 - blockIdx.x) / stride + 1) : 0;
    const int ns = (int)((K + SE - 1) / SE);                      /* stages per row */
    const int cnt = warp < ns ? (ns - 1 - warp) / G2_WARPS + 1 : 0; /* this warp's, per group */
    const int jcnt = nmine * cnt;
    uint8_t *ring = ring_all + warp * (NST * RR * SB);

    g2_copier<R, SW, SB, NST> cp;
    cp.start(a, blockIdx.x);
#pragma unroll
    for (int i = 0; i < NST - 1; i++) cp.issue(ring, a, warp, lane, i, jcnt, cnt, stride);
    st_pdl_wait(); /* x and y may belong to the previous kernel */
    st_pdl_trigger();

    const int64_t t0 = (int64_t)blockIdx.y * NT;
    const int nt = (int)min((int64_t)NT, a.n - t0);
    const float *xt = a.x + t0 * K;
    int j = 0; /* this warp's stage counter over all its groups */
    for (int gi = 0; gi < nmine; gi++) {
        float acc[RR][NT];
#pragma unroll
        for (int r = 0; r < RR; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;

        for (int i = 0; i < cnt; i++, j++) {
            __syncwarp(); /* every lane is done with slot (j - 1) % NST, refilled now */
            cp.issue(ring, a, warp, lane, j + NST - 1, jcnt, cnt, stride);
            g2_wait<NST - 1>(); /* this lane's copies of stage j have landed */
            __syncwarp();       /* and every other lane's */
            const int64_t e0 = (int64_t)(warp + G2_WARPS * i) * SE;
            if (!Q::valid(lane, (int)min((int64_t)SE, K - e0))) continue;
            const uint8_t *buf = ring + (j % NST) * (RR * SB);
            const float *xs0 = xt + e0;
            if constexpr (I8) {
                using QI = g2i<T>;
                const int8_t *xq0 = a.xq + t0 * K;
                const float *xd0 = a.xd + t0 * (K >> 5);
                if constexpr (NT <= 2) {
                    g2x<U> xv[NT];
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        if (t < nt) g2_xload<T>(xq0 + (int64_t)t * K, xd0 + (int64_t)t * (K >> 5), e0, lane, xv[t]);
#pragma unroll
                    for (int r = 0; r < RR; r++) {
                        uint32_t q[QI::NQ];
                        float sc[QI::NSC];
                        QI::decode(buf + r * SB, lane, q, sc);
#pragma unroll
                        for (int t = 0; t < NT; t++)
                            if (t < nt) acc[r][t] = QI::accum(q, sc, xv[t], acc[r][t]);
                    }
                } else {
                    uint32_t q[RR][QI::NQ];
                    float sc[RR][QI::NSC];
#pragma unroll
                    for (int r = 0; r < RR; r++) QI::decode(buf + r * SB, lane, q[r], sc[r]);
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (t < nt) {
                            g2x<U> xv;
                            g2_xload<T>(xq0 + (int64_t)t * K, xd0 + (int64_t)t * (K >> 5), e0, lane, xv);
#pragma unroll
                            for (int r = 0; r < RR; r++) acc[r][t] = QI::accum(q[r], sc[r], xv, acc[r][t]);
                        }
                    }
                }
            } else if constexpr (NT <= 2) {
                float xv[NT][U], xsm[NT][Q::NXS];
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < nt) {
#pragma unroll
                        for (int jj = 0; jj < U / 8; jj++) {
                            const float4 *p = (const float4 *)(xs0 + (int64_t)t * K + Q::off(lane, jj));
                            const float4 u = __ldg(p), v = __ldg(p + 1);
                            xv[t][8 * jj] = u.x, xv[t][8 * jj + 1] = u.y, xv[t][8 * jj + 2] = u.z,
                                      xv[t][8 * jj + 3] = u.w;
                            xv[t][8 * jj + 4] = v.x, xv[t][8 * jj + 5] = v.y, xv[t][8 * jj + 6] = v.z,
                                          xv[t][8 * jj + 7] = v.w;
                        }
                        Q::xsum(xv[t], xsm[t]);
                    }
                }
#pragma unroll
                for (int r = 0; r < RR; r++) {
                    float v[U], sc[Q::NSC];
                    Q::decode(buf + r * SB, lane, v, sc);
#pragma unroll
                    for (int t = 0; t < NT; t++)
                        if (t < nt) acc[r][t] = Q::accum(v, sc, xv[t], xsm[t], acc[r][t]);
                }
            } else {
                float v[RR][U], sc[RR][Q::NSC];
#pragma unroll
                for (int r = 0; r < RR; r++) Q::decode(buf + r * SB, lane, v[r], sc[r]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < nt) {
                        float xv[U], xsm[Q::NXS];
#pragma unroll
                        for (int jj = 0; jj < U / 8; jj++) {
                            const float4 *p = (const float4 *)(xs0 + (int64_t)t * K + Q::off(lane, jj));
                            const float4 u = __ldg(p), q = __ldg(p + 1);
                            xv[8 * jj] = u.x, xv[8 * jj + 1] = u.y, xv[8 * jj + 2] = u.z, xv[8 * jj + 3] = u.w;
                            xv[8 * jj + 4] = q.x, xv[8 * jj + 5] = q.y, xv[8 * jj + 6] = q.z, xv[8 * jj + 7] = q.w;
                        }
                        Q::xsum(xv, xsm);
#pragma unroll
                        for (int r = 0; r < RR; r++) acc[r][t] = Q::accum(v[r], sc[r], xv, xsm, acc[r][t]);
                    }
                }
            }
        }

        /* the group's sums: warps' partials through red[gi & 1] (a group's
         * readers finish before anyone passes the next group's barrier, so
         * two buffers need one barrier per group) */
        float(*rd)[RR * NT] = red[gi & 1];
#pragma unroll
        for (int r = 0; r < RR; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const float v = st_warp_sum(acc[r][t]);
                if (lane == 0) rd[warp][r * NT + t] = v;
            }
        __syncthreads();
        if (threadIdx.x < R * NT) {
            const st_gemv_group q = st_gemv_group_of<R, SW>(a, blockIdx.x + (unsigned)gi * stride);
            const int r = threadIdx.x / NT, t = threadIdx.x % NT;
            float v = rd[0][threadIdx.x];
#pragma unroll
            for (int i = 1; i < G2_WARPS; i++) v += rd[i][threadIdx.x];
            if (SW) {
                float u = rd[0][(R + r) * NT + t];
#pragma unroll
                for (int i = 1; i < G2_WARPS; i++) u += rd[i][(R + r) * NT + t];
                v = st_silu_mul(v, u);
            }
            if (t < nt && q.row0 + r < q.N) q.y[(t0 + t) * q.N + q.row0 + r] = v;
        }
    }
}

/* ---- launch ------------------------------------------------------------------------ */

constexpr int g2_tidx(int T, bool I8) {
    return (T == ST_DTYPE_BF16 ? 0 : T == ST_DTYPE_F16 ? 1 : T == ST_DTYPE_Q8_0 ? 2 : T == ST_DTYPE_Q4_0 ? 3
         : T == ST_DTYPE_Q4_1 ? 4 : 5) + (I8 ? 4 : 0);
}

/* setup: the variant's attributes and blocks per SM (into t); else a launch
 * of at most one wave for bf16 / f16 (one block per row group for the
 * quantized types). Every slot of the wave gets a block (blocks then walk
 * ceil or floor of groups / blocks groups): measured on the H200, a smaller grid of evenly loaded blocks
 * (bf16 4096 x 14336: 512 blocks of 2 groups for 660 places) lost more to
 * the idle places (75% of HBM vs 82%) than the balance gained. */
template <int T, int NT, int R, bool SW, bool I8, int V>
static strata_status g2_launch(cudaStream_t s, bool pdl, st_gemv_args a, bool setup, st_gemv2_tune *t) {
    int &bpsm = t->bpsm[g2_tidx(T, I8)][V][SW ? 1 : 0];
    if (setup) {
        /* leave L1 room for x (read through it by every block): a hint */
        ST_CUDA_TRY(cudaFuncSetAttribute(gemv2_kernel<T, NT, R, SW, I8>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         70));
        ST_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bpsm, gemv2_kernel<T, NT, R, SW, I8>, G2_THREADS, 0));
        if (bpsm < 1) bpsm = 1;
        return STRATA_OK;
    }
    int64_t groups = 0;
    const int nw = SW ? 1 : a.count;
    for (int i = 0; i < nw; i++) {
        a.b0[i] = (unsigned)groups;
        groups += (a.N[i] + R - 1) / R;
    }
    const int64_t gy = (a.n + NT - 1) / NT;
    if (groups > INT32_MAX || gy > 65535) return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape too large");
    a.groups = (unsigned)groups;
    int64_t blocks = groups;
    const int64_t wave = (int64_t)bpsm * t->sm_count;
    if (g2_walk(T, I8, NT) && wave > 0 && groups > wave) blocks = wave;
    ST_CUDA_TRY(st_launch(pdl, gemv2_kernel<T, NT, R, SW, I8>, dim3((unsigned)blocks, (unsigned)gy), dim3(G2_THREADS),
                          0, s, a));
    return STRATA_OK;
}

/* Rows per block: x is read once per unit and token for R rows, so larger R
 * saves L1 traffic (which limits the 4-bit types, with the most elements per
 * byte); smaller R means more blocks for small matrices and fewer registers
 * for several tokens. SwiGLU blocks hold 2R row slots. */
/* Row groups of R rows over the launch's weights. */
template <int R, bool SW>
static int64_t g2_groups(const st_gemv_args &a) {
    int64_t g = 0;
    for (int i = 0; i < (SW ? 1 : a.count); i++) g += (a.N[i] + R - 1) / R;
    return g;
}

/* Time of a one-token launch of groups of R rows, in units of one row's
 * time: the rounds of the fullest place (ceil(groups / wave)) times R. */
static int64_t g2_cost(int64_t groups, int bpsm, int sm_count, int R) {
    const int64_t wave = (int64_t)(bpsm > 0 ? bpsm : 1) * sm_count;
    return (groups + wave - 1) / wave * R;
}

/* One token, bf16 / f16: groups of R1 rows, or of R1 / 2 where the last round of
 * blocks is then less empty (4096-row weights: 1024 groups of 4 rows make
 * 1.3 waves of bf16 blocks, 2048 groups of 2 rows 2.2). Variant slots of
 * t->bpsm: 0 one token, 1 two, 2 up to four, 3 up to eight, 4 one token
 * with half the rows per group. */
template <int T, bool SW, bool I8>
static strata_status g2_dispatch(cudaStream_t s, bool pdl, const st_gemv_args &a, bool setup, st_gemv2_tune *t) {
    constexpr bool q4 = T == ST_DTYPE_Q4_0 || T == ST_DTYPE_Q4_1;
    constexpr int D = SW ? 2 : 1;
    constexpr int R1 = (q4 ? 8 : 4) / D;
    constexpr int RH = R1 / 2;
    /* the int8 kernels hold packed words, not floats: room for more rows
     * per x load with several tokens */
    constexpr int R4 = I8 ? (q4 ? 8 : 4) / D : (T == ST_DTYPE_Q4_K ? 2 : 4) / D;
    constexpr int R8 = I8 ? (T == ST_DTYPE_Q4_K ? 2 : 4) / D : 2 / D;
    strata_status st;
    if (setup) {
        if ((st = g2_launch<T, 1, RH, SW, I8, 4>(s, pdl, a, true, t)) != STRATA_OK) return st;
    } else if (g2_plain(T) && a.n == 1) {
        const int ti = g2_tidx(T, I8), sw = SW ? 1 : 0;
        if (g2_cost(g2_groups<RH, SW>(a), t->bpsm[ti][4][sw], t->sm_count, RH) <
            g2_cost(g2_groups<R1, SW>(a), t->bpsm[ti][0][sw], t->sm_count, R1))
            return g2_launch<T, 1, RH, SW, I8, 4>(s, pdl, a, false, t);
    }
    if (setup || a.n == 1)
        if ((st = g2_launch<T, 1, R1, SW, I8, 0>(s, pdl, a, setup, t)) != STRATA_OK || !setup) return st;
    if (setup || a.n == 2)
        if ((st = g2_launch<T, 2, R1, SW, I8, 1>(s, pdl, a, setup, t)) != STRATA_OK || !setup) return st;
    if (setup || a.n <= 4)
        if ((st = g2_launch<T, 4, R4, SW, I8, 2>(s, pdl, a, setup, t)) != STRATA_OK || !setup) return st;
    return g2_launch<T, 8, R8, SW, I8, 3>(s, pdl, a, setup, t);
}

template <int T, bool I8>
static strata_status g2_dtype(cudaStream_t s, bool pdl, bool swiglu, const st_gemv_args &a, bool setup,
                              st_gemv2_tune *t) {
    strata_status st;
    if (setup) {
        if ((st = g2_dispatch<T, false, I8>(s, pdl, a, true, t)) != STRATA_OK) return st;
        return g2_dispatch<T, true, I8>(s, pdl, a, true, t);
    }
    return swiglu ? g2_dispatch<T, true, I8>(s, pdl, a, false, t) : g2_dispatch<T, false, I8>(s, pdl, a, false, t);
}

static strata_status g2_any(int dtype, bool i8, cudaStream_t s, bool pdl, bool swiglu, const st_gemv_args &a,
                            bool setup, st_gemv2_tune *t) {
    if (i8) {
        switch (dtype) {
        case ST_DTYPE_Q8_0: return g2_dtype<ST_DTYPE_Q8_0, true>(s, pdl, swiglu, a, setup, t);
        case ST_DTYPE_Q4_0: return g2_dtype<ST_DTYPE_Q4_0, true>(s, pdl, swiglu, a, setup, t);
        case ST_DTYPE_Q4_1: return g2_dtype<ST_DTYPE_Q4_1, true>(s, pdl, swiglu, a, setup, t);
        case ST_DTYPE_Q4_K: return g2_dtype<ST_DTYPE_Q4_K, true>(s, pdl, swiglu, a, setup, t);
        default: break;
        }
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda gemv2 int8: dtype %s", st_dtype_name((st_dtype)dtype));
    }
    switch (dtype) {
    case ST_DTYPE_BF16: return g2_dtype<ST_DTYPE_BF16, false>(s, pdl, swiglu, a, setup, t);
    case ST_DTYPE_F16: return g2_dtype<ST_DTYPE_F16, false>(s, pdl, swiglu, a, setup, t);
    case ST_DTYPE_Q8_0: return g2_dtype<ST_DTYPE_Q8_0, false>(s, pdl, swiglu, a, setup, t);
    case ST_DTYPE_Q4_0: return g2_dtype<ST_DTYPE_Q4_0, false>(s, pdl, swiglu, a, setup, t);
    case ST_DTYPE_Q4_1: return g2_dtype<ST_DTYPE_Q4_1, false>(s, pdl, swiglu, a, setup, t);
    case ST_DTYPE_Q4_K: return g2_dtype<ST_DTYPE_Q4_K, false>(s, pdl, swiglu, a, setup, t);
    default: break;
    }
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda gemv2: dtype %s", st_dtype_name((st_dtype)dtype));
}

bool st_cuda_gemv2_supports(int dtype, size_t row_bytes) {
    switch (dtype) {
    case ST_DTYPE_BF16:
    case ST_DTYPE_F16:
    /* not Q8_0: measured on the H200 (bench_cuda_ops, 14336 x 4096, n = 1) the
     * older kernel is faster for it (21.8 vs 27.9 us, also with the one-wave
     * grid), so it stays there */
    case ST_DTYPE_Q4_0:
    case ST_DTYPE_Q4_1:
    case ST_DTYPE_Q4_K: return row_bytes > 0 && row_bytes % 16 == 0;
    default: return false;
    }
}

bool st_cuda_gemv2_i8_supports(int dtype, size_t row_bytes) {
    switch (dtype) {
    case ST_DTYPE_Q8_0:
    case ST_DTYPE_Q4_0:
    case ST_DTYPE_Q4_1:
    case ST_DTYPE_Q4_K: return row_bytes > 0 && row_bytes % 16 == 0;
    default: return false;
    }
}

strata_status st_cuda_gemv2_quant_x(cudaStream_t s, bool pdl, const float *x, int64_t n, int64_t K, int8_t *xq,
                                    float *xd, float *xs) {
    if (K % 32) return st_err(STRATA_ERR_INVALID_ARG, "cuda gemv2: int8 x needs K %% 32 == 0 (K = %lld)", (long long)K);
    const int64_t total8 = n * K / 8, blocks = (total8 + 255) / 256;
    if (blocks > INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "cuda gemv2: x too large");
    ST_CUDA_TRY(st_launch(pdl, g2_quant_x_kernel, dim3((unsigned)blocks), dim3(256), 0, s, x, total8, xq, xd, xs));
    return STRATA_OK;
}

strata_status st_cuda_gemv2(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a,
                            const st_gemv2_tune *t) {
    return g2_any(dtype, a.xq != NULL, s, pdl, swiglu, a, false, (st_gemv2_tune *)t); /* read only when not setting up */
}

strata_status st_cuda_gemv2_setup(st_gemv2_tune *t, int sm_count) {
    memset(t, 0, sizeof *t);
    t->sm_count = sm_count;
    st_gemv_args a = {};
    const int types[] = {ST_DTYPE_BF16, ST_DTYPE_F16, ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1, ST_DTYPE_Q4_K};
    for (int i = 0; i < 6; i++) {
        strata_status st = g2_any(types[i], false, 0, false, false, a, true, t);
        if (st == STRATA_OK && st_cuda_gemv2_i8_supports(types[i], 16))
            st = g2_any(types[i], true, 0, false, false, a, true, t);
        if (st != STRATA_OK) return st;
    }
    return STRATA_OK;
}

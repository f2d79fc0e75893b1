/* One-token int8 GEMV ("gemv1", fast mode): y[1, N] = x[1, K] @ w[N, K]^T
 * for q8_0, q4_0, q4_1, q4_k and q6_k weights, x quantized per 32-block by
 * st_cuda_gemv2_quant_x (int8 xq, scales xd and d * sum q in xs), the decode
 * step's matmuls (cuda_gemv.cuh; cuda_matmul.cu chooses).
 *
 * Why not the staged kernel (cuda_gemv.cu) for one token: its blocks copy a
 * row group's bytes into a shared-memory ring first, and for one token a
 * block's whole life is one such copy, its decode and a block reduction.
 * Under Nsight Compute (bench/RESULTS.md, thirteenth session) its q4_0
 * launch on the 8B q|k|v shape held DRAM 32% busy at 25% occupancy, limited
 * by the ring's shared memory. Here nothing goes through shared memory:
 *
 * - A warp owns a group of R rows (SwiGLU: R gate rows and the same R up
 *   rows) and walks its rows in units of 128 elements (four 32-blocks),
 *   lane l taking units l, l + 32, ...: no block barrier, a warp reduction
 *   per row at the end, a fixed order (deterministic).
 * - A unit's weight bytes go straight into registers with vector loads:
 *   four q4_0 blocks are 72 bytes (9 x 8), four q8_0 blocks 136 (17 x 8),
 *   four q4_1 blocks 80 (5 x 16), half a q4_k super-block its 16-byte header
 *   and 64 bytes of nibbles (5 x 16), half a q6_k super-block 27 words
 *   (4-byte loads: its blocks are 2-byte aligned); rows of K % 128 == 0 keep every unit
 *   aligned (st_cuda_gemv1_supports). The first unit's loads are issued
 *   before the PDL wait (weights are never written by kernels), so they
 *   overlap the previous kernel's tail.
 * - A block's dot product is 8 dp4a against the packed nibbles or bytes
 *   (the nibbles masked in place, the 2-byte-aligned blocks' words joined
 *   with one funnel shift), then d_w d_x dot + m_w s_x, s_x = d_x sum x_q from
 *   the quantization: q4_0's -8 is m_w = -8 d_w, q4_1's min m, q4_k's
 *   -dmin m_j. No integer conversions beyond one per block.
 *
 * Occupancy is limited only by registers. Error against the fp32 reference:
 * the int8 path's (the same quantized x; gpu_check_ops, 1e-2). */
#include <string.h>

#include "backend/cuda/cuda_gemv.cuh"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define G1_WARPS 4
#define G1_UNIT 128 /* elements per lane unit */

/* The 4 words at byte offset S (even, compile time) of a unit's words w. */
template <int S>
ST_DEV void g1_words4(const uint32_t *w, uint32_t q[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) q[i] = S % 4 ? __funnelshift_r(w[S / 4 + i], w[S / 4 + i + 1], 16) : w[S / 4 + i];
}
/* The f16 at byte offset B (even, compile time) as a float. */
template <int B>
ST_DEV float g1_h(const uint32_t *w) {
    return __half2float(__ushort_as_half((unsigned short)((w[B / 4] >> (8 * (B % 4))) & 0xffffu)));
}

/* The NV vectors of V (uint2, uint4) at p, read through the non-coherent
 * path, as consecutive words of w. */
template <typename V, int NV>
ST_DEV void g1_ldv(const void *p, uint32_t *w) {
    constexpr int WPV = (int)(sizeof(V) / 4);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const V v = __ldg((const V *)p + i);
        const uint32_t *vw = (const uint32_t *)&v;
#pragma unroll
        for (int j = 0; j < WPV; j++) w[WPV * i + j] = vw[j];
    }
}

/* g1<T>: NW words per unit; load(row, u, w) its bytes, then block<B>(w, h,
 * q, dw, mw) for B = 0..3: the 32-block's 8 packed words in x's element
 * order (q[0..3] elements 0..15, q[4..7] 16..31), its scale d_w and the
 * coefficient m_w of s_x (SUMS: whether there is one). h: the unit's
 * parity (q4_k: which half of the super-block). */
template <int T> struct g1;

template <> struct g1<ST_DTYPE_Q4_0> {
    static constexpr int NW = 18;
    static constexpr bool SUMS = true;
    ST_DEV static void load(const uint8_t *row, int64_t u, uint32_t w[NW]) {
        g1_ldv<uint2, 9>(row + 72 * u, w);
    }
    template <int B>
    ST_DEV static void block(const uint32_t w[NW], int, uint32_t q[8], float &dw, float &mw) {
        uint32_t n[4];
        g1_words4<18 * B + 2>(w, n);
#pragma unroll
        for (int i = 0; i < 4; i++) q[i] = n[i] & 0x0f0f0f0fu, q[4 + i] = (n[i] >> 4) & 0x0f0f0f0fu;
        dw = g1_h<18 * B>(w);
        mw = -8.0f * dw;
    }
};

template <> struct g1<ST_DTYPE_Q8_0> {
    static constexpr int NW = 34;
    static constexpr bool SUMS = false;
    ST_DEV static void load(const uint8_t *row, int64_t u, uint32_t w[NW]) {
        g1_ldv<uint2, 17>(row + 136 * u, w);
    }
    template <int B>
    ST_DEV static void block(const uint32_t w[NW], int, uint32_t q[8], float &dw, float &mw) {
        g1_words4<34 * B + 2>(w, q);
        g1_words4<34 * B + 18>(w, q + 4);
        dw = g1_h<34 * B>(w);
        mw = 0.0f;
    }
};

template <> struct g1<ST_DTYPE_Q4_1> {
    static constexpr int NW = 20;
    static constexpr bool SUMS = true;
    ST_DEV static void load(const uint8_t *row, int64_t u, uint32_t w[NW]) {
        g1_ldv<uint4, 5>(row + 80 * u, w);
    }
    template <int B>
    ST_DEV static void block(const uint32_t w[NW], int, uint32_t q[8], float &dw, float &mw) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t n = w[5 * B + 1 + i];
            q[i] = n & 0x0f0f0f0fu, q[4 + i] = (n >> 4) & 0x0f0f0f0fu;
        }
        dw = g1_h<20 * B>(w);
        mw = g1_h<20 * B + 2>(w);
    }
};

/* Q4_K: unit u = half h = u & 1 of super-block u >> 1: words 0..3 the header
 * (d, dmin, 12 bytes of 6-bit scales and mins), 4..19 the 64 nibble bytes
 * of chunks 2h, 2h + 1; 32-block B is sub-block 4h + B (low nibbles of
 * chunk B >> 1 for even B, high for odd). */
template <> struct g1<ST_DTYPE_Q4_K> {
    static constexpr int NW = 20;
    static constexpr bool SUMS = true;
    ST_DEV static void load(const uint8_t *row, int64_t u, uint32_t w[NW]) {
        const uint8_t *sb = row + 144 * (u >> 1);
        g1_ldv<uint4, 1>(sb, w);
        g1_ldv<uint4, 4>(sb + 16 + 64 * (u & 1), w + 4);
    }
    template <int B>
    ST_DEV static void block(const uint32_t w[NW], int h, uint32_t q[8], float &dw, float &mw) {
        constexpr int C = B >> 1, SH = 4 * (B & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = (w[4 + 8 * C + i] >> SH) & 0x0f0f0f0fu;
        const uint32_t s0 = w[1], s1 = w[2], s2 = w[3];
        const uint32_t scw = h ? ((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u)) : (s0 & 0x3f3f3f3fu);
        const uint32_t mnw = h ? (((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u)) : (s1 & 0x3f3f3f3fu);
        dw = __fmul_rn(g1_h<0>(w), (float)((scw >> (8 * B)) & 0xffu));
        mw = -__fmul_rn(g1_h<2>(w), (float)((mnw >> (8 * B)) & 0xffu));
    }
};

/* Q6_K: unit u = half h = u & 1 of super-block u >> 1 (210 bytes: ql[128],
 * qh[64], int8 scales[16], f16 d; 2-byte aligned only, so its words are read
 * from the 4-byte boundary below and joined with one funnel shift): words
 * 0..15 ql[64h ..], 16..23 qh[32h ..], 24..25 scales[8h ..], 26 d. 32-block
 * B: 6-bit q = the nibbles of ql bytes 32 (B & 1) .. (low for B < 2) with
 * bits 2B of qh as bits 4, 5, element d * scale[2B + l / 16] * (q - 32):
 * per 16 elements the integer sum scale (sum q x_q - 32 sum x_q), the sums
 * of x_q per 16 (z16) computed once per unit and token. Reads up to 2 bytes
 * past a row's last super-block (cuda_common.cuh: the pool keeps them
 * mapped). */
template <> struct g1<ST_DTYPE_Q6_K> {
    static constexpr int NW = 27;
    static constexpr bool SUMS = false;
    ST_DEV static void load(const uint8_t *row, int64_t u, uint32_t w[NW]) {
        const uintptr_t b = (uintptr_t)(row + 210 * (u >> 1));
        const uint32_t *p = (const uint32_t *)(b & ~(uintptr_t)3);
        const unsigned sh = (unsigned)(b & 2) * 8u, h = (unsigned)(u & 1);
        uint32_t r[18];
#pragma unroll
        for (int i = 0; i < 17; i++) r[i] = __ldg(p + 16 * h + i);
#pragma unroll
        for (int i = 0; i < 16; i++) w[i] = __funnelshift_r(r[i], r[i + 1], sh);
#pragma unroll
        for (int i = 0; i < 9; i++) r[i] = __ldg(p + 32 + 8 * h + i);
#pragma unroll
        for (int i = 0; i < 8; i++) w[16 + i] = __funnelshift_r(r[i], r[i + 1], sh);
#pragma unroll
        for (int i = 0; i < 3; i++) r[i] = __ldg(p + 48 + 2 * h + i);
        w[24] = __funnelshift_r(r[0], r[1], sh), w[25] = __funnelshift_r(r[1], r[2], sh);
        w[26] = __ldg(p + 52) >> sh;
    }
    /* the 32-block's contribution: d d_x (s0 (dot0 - 32 z0) + s1 (dot1 - 32 z1)) */
    template <int B>
    ST_DEV static float dot(const uint32_t w[NW], const uint32_t *xw, const int *z16, float xd, float acc) {
        int p[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const uint32_t lo = (w[k + 8 * (B & 1)] >> (B < 2 ? 0 : 4)) & 0x0f0f0f0fu;
            const uint32_t hi = (w[16 + k] >> (2 * B)) & 0x03030303u;
            p[k >> 2] = __dp4a((int)(lo | (hi << 4)), (int)xw[8 * B + k], p[k >> 2]);
        }
        const int s0 = (int)(int8_t)(w[24 + (2 * B) / 4] >> (8 * ((2 * B) % 4)));
        const int s1 = (int)(int8_t)(w[24 + (2 * B + 1) / 4] >> (8 * ((2 * B + 1) % 4)));
        const int t = s0 * (p[0] - 32 * z16[2 * B]) + s1 * (p[1] - 32 * z16[2 * B + 1]);
        const float d = __half2float(__ushort_as_half((unsigned short)(w[26] & 0xffffu)));
        return fmaf(__fmul_rn(d, xd), (float)t, acc);
    }
};

/* acc[r] += 32-block B's dot products of rows r against x's unit (xw: its
 * 32 words of int8, xd / xs: the block's scale and sum, z16: q6_k's sums of
 * x_q per 16 elements). */
template <int T, int B, int RR>
ST_DEV void g1_block(const uint32_t (&w)[RR][g1<T>::NW], int h, const uint32_t *xw, const int *z16, float xd,
                     float xs, float (&acc)[RR]) {
#pragma unroll
    for (int r = 0; r < RR; r++) {
        if constexpr (T == ST_DTYPE_Q6_K) { /* two scales per 32-block: the type's own dot */
            acc[r] = g1<T>::template dot<B>(w[r], xw, z16, xd, acc[r]);
        } else {
            uint32_t q[8];
            float dw, mw;
            g1<T>::template block<B>(w[r], h, q, dw, mw);
            int p = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) p = __dp4a((int)q[i], (int)xw[8 * B + i], p);
            acc[r] = fmaf(__fmul_rn(dw, xd), (float)p, acc[r]);
            if (g1<T>::SUMS) acc[r] = fmaf(mw, xs, acc[r]);
        }
    }
}

template <int T, int R, bool SW>
static __global__ void __launch_bounds__(32 * G1_WARPS) gemv1_kernel(const st_gemv_args a) {
    using Q = g1<T>;
    constexpr int RR = SW ? 2 * R : R;
    const int lane = threadIdx.x & 31;
    const unsigned g = blockIdx.x * G1_WARPS + (threadIdx.x >> 5);
    const bool live = g < a.groups; /* uniform per warp */
    const st_gemv_group grp = st_gemv_group_of<R, SW>(a, live ? g : 0);
    const uint8_t *wr[RR];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int64_t row = min(grp.row0 + r, grp.N - 1); /* rows past N: a copy of the last, not written */
        wr[r] = grp.w + (size_t)row * a.rb;
        if (SW) wr[R + r] = a.w[1] + (size_t)row * a.rb;
    }
    const int64_t nu = a.K / G1_UNIT;
    int64_t u = lane;
    uint32_t w[RR][Q::NW];
    if (live && u < nu)
#pragma unroll
        for (int r = 0; r < RR; r++) Q::load(wr[r], u, w[r]);
    st_pdl_wait(); /* x and y may belong to the previous kernel */
    st_pdl_trigger();
    if (!live) return;

    float acc[RR];
#pragma unroll
    for (int r = 0; r < RR; r++) acc[r] = 0.0f;
    while (u < nu) {
        uint32_t xw[32];
        g1_ldv<uint4, 8>(a.xq + G1_UNIT * u, xw);
        const float4 xd = __ldg((const float4 *)a.xd + u);
        float4 xs = make_float4(0, 0, 0, 0);
        if (Q::SUMS) xs = __ldg((const float4 *)a.xs + u);
        const int h = (int)(u & 1);
        int z16[8]; /* q6_k: sum x_q per 16 elements */
        if constexpr (T == ST_DTYPE_Q6_K)
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int z = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) z = __dp4a((int)xw[4 * i + k], 0x01010101, z);
                z16[i] = z;
            }
        g1_block<T, 0, RR>(w, h, xw, z16, xd.x, xs.x, acc);
        g1_block<T, 1, RR>(w, h, xw, z16, xd.y, xs.y, acc);
        g1_block<T, 2, RR>(w, h, xw, z16, xd.z, xs.z, acc);
        g1_block<T, 3, RR>(w, h, xw, z16, xd.w, xs.w, acc);
        u += 32;
        if (u < nu)
#pragma unroll
            for (int r = 0; r < RR; r++) Q::load(wr[r], u, w[r]);
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = st_warp_sum(acc[r]);
        if (SW) v = st_silu_mul(v, st_warp_sum(acc[R + r]));
        if (lane == r && grp.row0 + r < grp.N) grp.y[grp.row0 + r] = v;
    }
}

template <int T, int R, bool SW>
static strata_status g1_launch(cudaStream_t s, bool pdl, st_gemv_args a) {
    int64_t groups = 0;
    for (int i = 0; i < (SW ? 1 : a.count); i++) {
        a.b0[i] = (unsigned)groups;
        groups += (a.N[i] + R - 1) / R;
    }
    if (groups > INT32_MAX - G1_WARPS) return st_err(STRATA_ERR_INVALID_ARG, "cuda matmul: shape too large");
    a.groups = (unsigned)groups;
    const unsigned blocks = (unsigned)((groups + G1_WARPS - 1) / G1_WARPS);
    ST_CUDA_TRY(st_launch(pdl, gemv1_kernel<T, R, SW>, dim3(blocks), dim3(32 * G1_WARPS), 0, s, a));
    return STRATA_OK;
}

template <int T, bool SW>
static strata_status g1_rows(cudaStream_t s, bool pdl, const st_gemv_args &a, int rows) {
    switch (rows) {
    case 1: return g1_launch<T, 1, SW>(s, pdl, a);
    case 2: return g1_launch<T, 2, SW>(s, pdl, a);
    case 4: return SW ? g1_launch<T, 2, SW>(s, pdl, a) : g1_launch<T, 4, false>(s, pdl, a); /* SwiGLU: 8 row slots spill */
    default: break;
    }
    return st_err(STRATA_ERR_INVALID_ARG, "cuda gemv1: %d rows per warp (1, 2 or 4)", rows);
}

template <int T>
static strata_status g1_dtype(cudaStream_t s, bool pdl, bool swiglu, const st_gemv_args &a, int rows) {
    return swiglu ? g1_rows<T, true>(s, pdl, a, rows) : g1_rows<T, false>(s, pdl, a, rows);
}

bool st_cuda_gemv1_supports(int dtype, int64_t K) {
    switch (dtype) {
    case ST_DTYPE_Q8_0:
    case ST_DTYPE_Q4_0:
    case ST_DTYPE_Q4_1:
    case ST_DTYPE_Q4_K:
    case ST_DTYPE_Q6_K: return K > 0 && K % G1_UNIT == 0;
    default: return false;
    }
}

bool st_cuda_gemv1_needs_sums(int dtype) { return dtype != ST_DTYPE_Q8_0 && dtype != ST_DTYPE_Q6_K; }

strata_status st_cuda_gemv1(cudaStream_t s, bool pdl, int dtype, bool swiglu, const st_gemv_args &a, int rows) {
    if (a.n != 1 || !a.xq || !a.xd || (st_cuda_gemv1_needs_sums(dtype) && !a.xs) || !st_cuda_gemv1_supports(dtype, a.K))
        return st_err(STRATA_ERR_INVALID_ARG, "cuda gemv1: needs one token, x quantized (with sums for %s) and K %% %d "
                      "== 0 (K = %lld)", st_dtype_name((st_dtype)dtype), G1_UNIT, (long long)a.K);
    switch (dtype) {
    case ST_DTYPE_Q8_0: return g1_dtype<ST_DTYPE_Q8_0>(s, pdl, swiglu, a, rows);
    case ST_DTYPE_Q4_0: return g1_dtype<ST_DTYPE_Q4_0>(s, pdl, swiglu, a, rows);
    case ST_DTYPE_Q4_1: return g1_dtype<ST_DTYPE_Q4_1>(s, pdl, swiglu, a, rows);
    case ST_DTYPE_Q4_K: return g1_dtype<ST_DTYPE_Q4_K>(s, pdl, swiglu, a, rows);
    case ST_DTYPE_Q6_K: return g1_dtype<ST_DTYPE_Q6_K>(s, pdl, swiglu, a, rows);
    default: break;
    }
    return st_err(STRATA_ERR_UNSUPPORTED, "cuda gemv1: dtype %s", st_dtype_name((st_dtype)dtype));
}

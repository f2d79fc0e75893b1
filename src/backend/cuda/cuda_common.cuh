/* Device helpers shared by the CUDA backend's kernels (CUDA C only): warp
 * reductions, half-precision loads, and the weight decoders.
 *
 * Weight decoders follow the block layouts of core/dtype.h and round exactly
 * like core/quant.c's reference (no fused multiply-add: __fmul_rn/__fadd_rn),
 * so a dequantized element equals st_dequantize_row's bit for bit.
 *   st_dq8<T>(row, c, v): elements 8c .. 8c+7 of a row (row 16-byte aligned,
 *       for plain types cols % 8 == 0; quantized rows always qualify);
 *   st_dq1<T>(row, k):   element k alone (any row, any cols);
 *   st_unit<T>:          the GEMV's unit of work (below), decoded from packed
 *       bytes held in registers, with no int-to-float conversions.
 * Quantized decoders rely only on the weight's base being 16-byte aligned
 * (blocks are then 2-, 4- or 16-byte aligned by their size); some read up to
 * 4 bytes past the last block, which the pool's chunk tail keeps mapped. */
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/dtype.h"

#define ST_DEV __device__ __forceinline__

/* ---- programmatic dependent launch (PDL, sm_90) -------------------------------
 * A kernel launched by st_launch with pdl = true may be scheduled while the
 * kernel before it on the stream is still running (its launch latency then
 * overlaps that kernel's tail; in a recorded graph too). Such a kernel must
 * call st_pdl_wait() before it reads or writes any memory the previous kernel
 * may touch: the wait returns once the previous grid has completed and its
 * writes are visible. The kernels below that are launched this way start with
 * st_pdl_wait(); st_pdl_trigger(); (the trigger lets the next kernel be
 * scheduled once every block of this one has started). Both are no-ops for a
 * plain launch and below sm_90. */
ST_DEV void st_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
ST_DEV void st_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* kernel<<<grid, block, smem, s>>>(args...), with PDL allowed when pdl. */
template <typename... KArgs, typename... Args>
static inline cudaError_t st_launch(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t s, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, ((KArgs)args)...);
}

ST_DEV float st_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* SwiGLU's element from the gate's and the up projection's values, rounded
 * as the CPU backend's: silu(g) * u. */
ST_DEV float st_silu_mul(float g, float u) { return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u); }

ST_DEV float st_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, <= 1024). Every thread gets
 * the result. `red` is 32 floats of shared memory; the call synchronizes. */
ST_DEV float st_block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = st_warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.0f;
    return st_warp_sum(t);
}

/* Max over the block, as st_block_sum. */
ST_DEV float st_block_max(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = st_warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : -INFINITY;
    return st_warp_max(t);
}

ST_DEV float st_f16f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
ST_DEV float st_bf16f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
ST_DEV uint16_t st_ld16(const uint8_t *p) { return __ldg((const unsigned short *)p); }
ST_DEV uint32_t st_ld32(const uint8_t *p) { return __ldg((const unsigned int *)p); }
/* 8 bytes from a 2-byte aligned address, as two little-endian words. */
ST_DEV uint2 st_ld8_a2(const uint8_t *p) {
    const unsigned short *h = (const unsigned short *)p;
    uint2 r;
    r.x = (uint32_t)__ldg(h) | ((uint32_t)__ldg(h + 1) << 16);
    r.y = (uint32_t)__ldg(h + 2) | ((uint32_t)__ldg(h + 3) << 16);
    return r;
}
ST_DEV int st_byte(uint2 w, int i) { return (int)(((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xffu); }

/* Q4_K: 6-bit scale and min of sub-block i (0..7), as core/quant.c. */
ST_DEV void st_q4k_sm(const uint8_t *sc, int i, int *s, int *m) {
    if (i < 4) {
        *s = __ldg(sc + i) & 63;
        *m = __ldg(sc + i + 4) & 63;
    } else {
        const int a = __ldg(sc + i + 4);
        *s = (a & 15) | ((__ldg(sc + i - 4) >> 6) << 4);
        *m = (a >> 4) | ((__ldg(sc + i) >> 6) << 4);
    }
}

template <int T>
ST_DEV void st_dq8(const uint8_t *__restrict__ row, int64_t c, float v[8]) {
    if constexpr (T == ST_DTYPE_F32) {
        const float4 *p = (const float4 *)row + 2 * c;
        const float4 a = __ldg(p), b = __ldg(p + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else if constexpr (T == ST_DTYPE_BF16) {
        const uint4 u = __ldg((const uint4 *)row + c);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else if constexpr (T == ST_DTYPE_F16) {
        const uint4 u = __ldg((const uint4 *)row + c);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = st_f16f((uint16_t)(w[i] & 0xffffu));
            v[2 * i + 1] = st_f16f((uint16_t)(w[i] >> 16));
        }
    } else if constexpr (T == ST_DTYPE_Q8_0) {
        const uint8_t *b = row + 34 * (c >> 2);
        const float d = st_f16f(st_ld16(b));
        const uint2 q = st_ld8_a2(b + 2 + 8 * (c & 3));
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn((float)(int8_t)st_byte(q, i), d);
    } else if constexpr (T == ST_DTYPE_Q4_0) {
        const uint8_t *b = row + 18 * (c >> 2);
        const int s = (int)(c & 3);
        const float d = st_f16f(st_ld16(b));
        const uint2 q = st_ld8_a2(b + 2 + 8 * (s & 1));
        const int sh = s < 2 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(d, (float)(((st_byte(q, i) >> sh) & 15) - 8));
    } else if constexpr (T == ST_DTYPE_Q4_1) {
        const uint8_t *b = row + 20 * (c >> 2);
        const int s = (int)(c & 3);
        const float d = st_f16f(st_ld16(b)), m = st_f16f(st_ld16(b + 2));
        uint2 q;
        q.x = st_ld32(b + 4 + 8 * (s & 1));
        q.y = st_ld32(b + 8 + 8 * (s & 1));
        const int sh = s < 2 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(__fmul_rn(d, (float)((st_byte(q, i) >> sh) & 15)), m);
    } else if constexpr (T == ST_DTYPE_Q4_K) {
        const uint8_t *b = row + 144 * (c >> 5);
        const int cc = (int)(c & 31), i = cc >> 2, l0 = (cc & 3) * 8;
        const float d = st_f16f(st_ld16(b)), dmin = st_f16f(st_ld16(b + 2));
        int s, m;
        st_q4k_sm(b + 4, i, &s, &m);
        const float ds = __fmul_rn(d, (float)s), dm = __fmul_rn(dmin, (float)m);
        const uint2 q = __ldg((const uint2 *)(b + 16 + 32 * (i >> 1) + l0));
        const int sh = (i & 1) ? 4 : 0;
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = __fsub_rn(__fmul_rn(ds, (float)((st_byte(q, k) >> sh) & 15)), dm);
    } else if constexpr (T == ST_DTYPE_Q6_K) {
        const uint8_t *b = row + 210 * (c >> 5);
        const int cc = (int)(c & 31), h = cc >> 4, e0 = (cc & 15) * 8, g = e0 >> 5, l0 = e0 & 31;
        const uint2 ql = st_ld8_a2(b + 64 * h + l0 + 32 * (g & 1));
        const uint2 qh = st_ld8_a2(b + 128 + 32 * h + l0);
        const int sc = (int)(int8_t)__ldg(b + 192 + 8 * h + 2 * g + (l0 >> 4));
        const float ds = __fmul_rn(st_f16f(st_ld16(b + 208)), (float)sc);
        const int sh = g < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int lo = (st_byte(ql, k) >> sh) & 15;
            const int hi = (st_byte(qh, k) >> (2 * g)) & 3;
            v[k] = __fmul_rn(ds, (float)((lo | (hi << 4)) - 32));
        }
    }
}

template <int T>
ST_DEV float st_dq1(const uint8_t *__restrict__ row, int64_t k) {
    if constexpr (T == ST_DTYPE_F32) {
        return __ldg((const float *)row + k);
    } else if constexpr (T == ST_DTYPE_BF16) {
        return st_bf16f(st_ld16(row + 2 * k));
    } else if constexpr (T == ST_DTYPE_F16) {
        return st_f16f(st_ld16(row + 2 * k));
    } else {
        float v[8];
        st_dq8<T>(row, k >> 3, v);
        float r = v[0];
#pragma unroll
        for (int i = 1; i < 8; i++)
            if ((k & 7) == i) r = v[i];
        return r;
    }
}

/* ---- GEMV units ------------------------------------------------------------------
 * A unit is U elements of a row that one thread of a GEMV decodes at once,
 * with as few and as wide loads as the block layout allows (raw bytes stay
 * packed in registers until used). It is RUNS runs of 8 contiguous elements:
 * run j starts at element run_start(u, j) and expand(raw, j, v) decodes it,
 * with the rounding of core/quant.c. Rows must start 16-byte aligned for the
 * plain types; quantized rows only need the base 16-byte aligned. */

/* NW little-endian 32-bit words of the bytes at p (2-byte aligned). */
template <int NW>
ST_DEV void st_ld_words_a2(const uint8_t *p, uint32_t out[NW]) {
    const uintptr_t a = (uintptr_t)p;
    const unsigned int *b = (const unsigned int *)(a & ~(uintptr_t)3);
    const uint32_t sh = (uint32_t)(a & 3) * 8; /* 0 or 16 */
    uint32_t w[NW + 1];
#pragma unroll
    for (int i = 0; i < NW; i++) w[i] = __ldg(b + i);
    w[NW] = sh ? __ldg(b + NW) : 0u; /* never read past the block when aligned */
#pragma unroll
    for (int i = 0; i < NW; i++) out[i] = __funnelshift_r(w[i], w[i + 1], sh);
}
/* float(byte i of b) - off for i < 4, exactly and without int-to-float
 * conversions: byte i is placed in the mantissa of 2^23 (0x4B000000) and
 * 2^23 + off is subtracted (exact for the small integers of quantized blocks). */
ST_DEV void st_bytes_f4(uint32_t b, float off, float v[4]) {
    const float k = 8388608.0f + off;
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __fsub_rn(__uint_as_float(__byte_perm(b, 0x4B000000u, 0x7540u | i)), k);
}

/* byte k (compile-time after unrolling) of a word array */
#define ST_WB(w, k) ((int)(((w)[(k) >> 2] >> (8 * ((k) & 3))) & 0xffu))

template <int T> struct st_unit;

template <> struct st_unit<ST_DTYPE_F32> {
    static constexpr int U = 8, RUNS = 1;
    struct raw { float4 a, b; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const float4 *p = (const float4 *)row + 2 * u;
        return {__ldg(p), __ldg(p + 1)};
    }
    ST_DEV static int64_t run_start(int u, int j) { return 8 * (int64_t)u; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        v[0] = r.a.x, v[1] = r.a.y, v[2] = r.a.z, v[3] = r.a.w, v[4] = r.b.x, v[5] = r.b.y, v[6] = r.b.z, v[7] = r.b.w;
    }
};

template <> struct st_unit<ST_DTYPE_BF16> {
    static constexpr int U = 8, RUNS = 1;
    struct raw { uint4 q; };
    ST_DEV static raw load(const uint8_t *row, int u) { return {__ldg((const uint4 *)row + u)}; }
    ST_DEV static int64_t run_start(int u, int j) { return 8 * (int64_t)u; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        const uint32_t w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
};

template <> struct st_unit<ST_DTYPE_F16> {
    static constexpr int U = 8, RUNS = 1;
    struct raw { uint4 q; };
    ST_DEV static raw load(const uint8_t *row, int u) { return {__ldg((const uint4 *)row + u)}; }
    ST_DEV static int64_t run_start(int u, int j) { return 8 * (int64_t)u; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        const uint32_t w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = st_f16f((uint16_t)(w[i] & 0xffffu));
            v[2 * i + 1] = st_f16f((uint16_t)(w[i] >> 16));
        }
    }
};

/* Quantized units are sized so that the units of consecutive threads cover
 * adjacent elements (x loads stay coalesced) while each thread still loads
 * its packed bytes with a few wide loads. */

/* Q8_0: a unit is half a block (16 int8) and the block's d. */
template <> struct st_unit<ST_DTYPE_Q8_0> {
    static constexpr int U = 16, RUNS = 2;
    struct raw { uint32_t w[4]; float d; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const uint8_t *b = row + 34 * (size_t)(u >> 1);
        raw r;
        r.d = st_f16f(__ldg((const unsigned short *)b));
        st_ld_words_a2<4>(b + 2 + 16 * (u & 1), r.w);
        return r;
    }
    ST_DEV static int64_t run_start(int u, int j) { return 16 * (int64_t)u + 8 * j; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        st_bytes_f4(r.w[2 * j] ^ 0x80808080u, 128.0f, v); /* int8 -> uint8 + 128 */
        st_bytes_f4(r.w[2 * j + 1] ^ 0x80808080u, 128.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(v[i], r.d);
    }
};

/* Q4_0: a unit is 8 bytes of a block's nibbles: elements 8i.. (low) and
 * 16 + 8i.. (high), i = u & 1. */
template <> struct st_unit<ST_DTYPE_Q4_0> {
    static constexpr int U = 16, RUNS = 2;
    struct raw { uint32_t w[2]; float d; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const uint8_t *b = row + 18 * (size_t)(u >> 1);
        raw r;
        r.d = st_f16f(__ldg((const unsigned short *)b));
        st_ld_words_a2<2>(b + 2 + 8 * (u & 1), r.w);
        return r;
    }
    ST_DEV static int64_t run_start(int u, int j) { return 32 * (int64_t)(u >> 1) + 8 * (u & 1) + 16 * j; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        st_bytes_f4((r.w[0] >> (4 * j)) & 0x0f0f0f0fu, 8.0f, v);
        st_bytes_f4((r.w[1] >> (4 * j)) & 0x0f0f0f0fu, 8.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(r.d, v[i]);
    }
};

/* Q4_1: as Q4_0, with the block's m; blocks are 4-byte aligned. */
template <> struct st_unit<ST_DTYPE_Q4_1> {
    static constexpr int U = 16, RUNS = 2;
    struct raw { uint32_t w[2]; float d, m; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const unsigned int *b = (const unsigned int *)(row + 20 * (size_t)(u >> 1));
        const uint32_t dm = __ldg(b);
        raw r;
        r.d = st_f16f((uint16_t)(dm & 0xffffu));
        r.m = st_f16f((uint16_t)(dm >> 16));
        r.w[0] = __ldg(b + 1 + 2 * (u & 1));
        r.w[1] = __ldg(b + 2 + 2 * (u & 1));
        return r;
    }
    ST_DEV static int64_t run_start(int u, int j) { return 32 * (int64_t)(u >> 1) + 8 * (u & 1) + 16 * j; }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        st_bytes_f4((r.w[0] >> (4 * j)) & 0x0f0f0f0fu, 0.0f, v);
        st_bytes_f4((r.w[1] >> (4 * j)) & 0x0f0f0f0fu, 0.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fadd_rn(__fmul_rn(r.d, v[i]), r.m);
    }
};

/* Q4_K: a unit is 16 bytes i (0..1) of the nibbles of 64-element chunk c:
 * elements 64c + 16i .. +15 of sub-block 2c (low nibbles) and 64c + 32 + 16i
 * .. +15 of sub-block 2c + 1 (high); u = 8 block + 2c + i. The eight 6-bit
 * scales and mins are unpacked four at a time inside 32-bit words. */
template <> struct st_unit<ST_DTYPE_Q4_K> {
    static constexpr int U = 32, RUNS = 4;
    struct raw { uint4 q; float d0, m0, d1, m1; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const uint8_t *b = row + 144 * (size_t)(u >> 3);
        const int c = (u >> 1) & 3, i = u & 1;
        const unsigned int *w = (const unsigned int *)b;
        const uint32_t dd = __ldg(w), s0 = __ldg(w + 1), s1 = __ldg(w + 2), s2 = __ldg(w + 3);
        raw r;
        r.q = __ldg((const uint4 *)(b + 16 + 32 * c + 16 * i));
        /* scales / mins of sub-blocks 0..3 and 4..7, one per byte (core/quant.c's packing) */
        const uint32_t sc = c < 2 ? (s0 & 0x3f3f3f3fu) : ((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u));
        const uint32_t mn = c < 2 ? (s1 & 0x3f3f3f3fu) : (((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u));
        const uint32_t k = (uint32_t)(2 * c) & 3u; /* byte of sub-block 2c in its word */
        const float d = st_f16f((uint16_t)(dd & 0xffffu)), dmin = st_f16f((uint16_t)(dd >> 16));
        const float two23 = 8388608.0f;
        const float fs0 = __fsub_rn(__uint_as_float(__byte_perm(sc, 0x4B000000u, 0x7540u | k)), two23);
        const float fs1 = __fsub_rn(__uint_as_float(__byte_perm(sc, 0x4B000000u, 0x7540u | (k + 1))), two23);
        const float fm0 = __fsub_rn(__uint_as_float(__byte_perm(mn, 0x4B000000u, 0x7540u | k)), two23);
        const float fm1 = __fsub_rn(__uint_as_float(__byte_perm(mn, 0x4B000000u, 0x7540u | (k + 1))), two23);
        r.d0 = __fmul_rn(d, fs0), r.m0 = __fmul_rn(dmin, fm0);
        r.d1 = __fmul_rn(d, fs1), r.m1 = __fmul_rn(dmin, fm1);
        return r;
    }
    ST_DEV static int64_t run_start(int u, int j) {
        return 256 * (int64_t)(u >> 3) + 64 * ((u >> 1) & 3) + 16 * (u & 1) + 8 * (j & 1) + 32 * (j >> 1);
    }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        const int sh = 4 * (j >> 1);
        const uint32_t w0 = (j & 1) ? r.q.z : r.q.x, w1 = (j & 1) ? r.q.w : r.q.y;
        const float ds = (j >> 1) ? r.d1 : r.d0, dm = (j >> 1) ? r.m1 : r.m0;
        st_bytes_f4((w0 >> sh) & 0x0f0f0f0fu, 0.0f, v);
        st_bytes_f4((w1 >> sh) & 0x0f0f0f0fu, 0.0f, v + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fsub_rn(__fmul_rn(ds, v[i]), dm);
    }
};

/* Q6_K: a unit is elements 32g + l0 .. +7 (g = 0..3) of half h of a block:
 * 8 bytes of ql for g even, 8 for g odd, 8 of qh, the 4 scales. */
template <> struct st_unit<ST_DTYPE_Q6_K> {
    static constexpr int U = 32, RUNS = 4;
    struct raw { uint32_t lo[2], hi[2], qh[2]; float ds[4]; };
    ST_DEV static raw load(const uint8_t *row, int u) {
        const uint8_t *b = row + 210 * (size_t)(u >> 3);
        const int h = (u >> 2) & 1, l0 = (u & 3) * 8;
        raw r;
        st_ld_words_a2<2>(b + 64 * h + l0, r.lo);
        st_ld_words_a2<2>(b + 64 * h + 32 + l0, r.hi);
        st_ld_words_a2<2>(b + 128 + 32 * h + l0, r.qh);
        uint32_t sc[2];
        st_ld_words_a2<2>(b + 192 + 8 * h, sc);
        const float d = st_f16f(__ldg((const unsigned short *)(b + 208)));
        const int o = l0 >> 4;
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const int k = 2 * g + o; /* 0..7, runtime only through o */
            const uint32_t w = k < 4 ? sc[0] : sc[1];
            r.ds[g] = __fmul_rn(d, (float)(int8_t)((w >> (8 * (k & 3))) & 0xffu));
        }
        return r;
    }
    ST_DEV static int64_t run_start(int u, int j) {
        return 256 * (int64_t)(u >> 3) + 128 * ((u >> 2) & 1) + 32 * j + (u & 3) * 8;
    }
    ST_DEV static void expand(const raw &r, int j, float v[8]) {
        const uint32_t *q = (j & 1) ? r.hi : r.lo;
        const int sh = j < 2 ? 0 : 4;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const uint32_t b = ((q[h] >> sh) & 0x0f0f0f0fu) | (((r.qh[h] >> (2 * j)) & 0x03030303u) << 4);
            st_bytes_f4(b, 32.0f, v + 4 * h);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(r.ds[j], v[i]);
    }
};

/* Calls f.template operator()<T>() with T the weight's dtype as a constant. */
#define ST_DTYPE_SWITCH(dtype, T, ...)                                                       \
    switch (dtype) {                                                                         \
    case ST_DTYPE_F32: { constexpr int T = ST_DTYPE_F32; __VA_ARGS__; } break;               \
    case ST_DTYPE_F16: { constexpr int T = ST_DTYPE_F16; __VA_ARGS__; } break;               \
    case ST_DTYPE_BF16: { constexpr int T = ST_DTYPE_BF16; __VA_ARGS__; } break;             \
    case ST_DTYPE_Q8_0: { constexpr int T = ST_DTYPE_Q8_0; __VA_ARGS__; } break;             \
    case ST_DTYPE_Q4_0: { constexpr int T = ST_DTYPE_Q4_0; __VA_ARGS__; } break;             \
    case ST_DTYPE_Q4_1: { constexpr int T = ST_DTYPE_Q4_1; __VA_ARGS__; } break;             \
    case ST_DTYPE_Q4_K: { constexpr int T = ST_DTYPE_Q4_K; __VA_ARGS__; } break;             \
    case ST_DTYPE_Q6_K: { constexpr int T = ST_DTYPE_Q6_K; __VA_ARGS__; } break;             \
    default: break;                                                                          \
    }

/* Grid-stride helpers: blocks for `work` items of `per_block`, capped. */
static inline unsigned st_grid_for(int64_t work, int per_block, int64_t cap) {
    int64_t b = (work + per_block - 1) / per_block;
    if (b < 1) b = 1;
    if (b > cap) b = cap;
    return (unsigned)b;
}

/* attention, prefill in fast mode on Hopper (sm_90a): a FlashAttention-3
 * style kernel (the ideas of the FlashAttention-3 paper: warp-specialized
 * producer/consumers around an asynchronous copy pipeline, warpgroup matrix
 * products with operands in shared memory, the softmax of one tile
 * overlapping the products of another, two consumer warpgroups taking turns
 * (optional here); no code taken from it). Used by the contiguous attention
 * op (and attention_part) in fast mode for head dim 128 with at least
 * ST_ATTN_FA2_MIN_ROWS rows per kv head on a device of compute capability
 * 9.0 (st_backend_params.attn_fa2 "auto" or "wgmma"; "wgmma-pp" with the
 * turns; the FA2 configurations stay selectable by name). Other head dims
 * and other devices: the FA2 kernel
 * (cuda_attn_prefill_fa2.cu). The compute_80 build holds a stub (wgmma and
 * setmaxnreg exist on sm_90a only); the host never launches it there.
 *
 * Two launches:
 *   1. hw_kv_prep_kernel: K [n_kv, Hkv, 128] fp32 -> bf16, same layout; V ->
 *      bf16 transposed, Vt [Hkv][128][ldv] (ldv = n_kv rounded up to 8, so
 *      that every row is 16-byte aligned as the tensor copy needs), so that
 *      both products read their B operand K-major (keys contiguous in Vt).
 *      Grid (ceil(n_kv / 64), Hkv): 64 keys of one kv head per block, V
 *      transposed through shared memory.
 *   2. hw_attn_kernel<PART>: grid (ceil(n G / 128), Hkv, nsplit), 384
 *      threads = 3 warpgroups, one block per SM (160 KiB of shared memory).
 *      A block owns 128 rows (token, head) of one kv head (row r: token r / G,
 *      head kvh G + r % G), taken heaviest (causal) first.
 *      - warpgroup 0, the producer: gives its registers away (setmaxnreg 24);
 *        one thread loads every K and Vt tile of the block's key range with
 *        the tensor copy engine (cp.async.bulk.tensor, 3-d tensor maps made
 *        on the host per call by cuTensorMapEncodeTiled, 128-byte swizzle,
 *        keys past n_kv zero-filled) into 2 stages, each stage's K and Vt
 *        completing on an mbarrier of their own (transaction bytes), and
 *        waits on the stage's "empty" mbarrier before reusing it.
 *      - warpgroups 1, 2, the consumers (setmaxnreg 240): 64 rows each. Q is
 *        loaded once (fp32, times qscale, rounded to bf16) into shared memory
 *        in the same swizzled layout. Per tile of 128 keys: S = Q K^T (8
 *        wgmma m64n128k16, A and B from shared memory), masking, online
 *        softmax in fp32 registers (exp2: scores are in log2 units), P packed
 *        to bf16 in registers as the A operand of O += P V (8 wgmma
 *        m64n128k16, A from registers, B = Vt from shared memory). The
 *        products of tile t + 1's S and tile t's P V are issued together, so
 *        that the softmax of tile t + 1 runs while P V of tile t is on the
 *        tensor cores (intra-warpgroup overlap); then the stage of tile t is
 *        released (every consumer thread arrives on its empty mbarrier).
 *        pingpong (attn_fa2 "wgmma-pp" only): the two warpgroups take turns
 *        issuing their products (named barriers), so that one's softmax runs
 *        while the other's products do. Measured on an H100 (bench/RESULTS.md,
 *        eighth session) it gained nothing at 2K and 4K tokens and lost 5% at
 *        16K: the two warpgroups already interleave on their own, and the
 *        turns add waits; so the default runs without them.
 *      - Causal: the block's key range ends at its largest position
 *        (split_range, tiles of 128 keys); the mask (key > the row's last
 *        key -> -inf) is applied only to the tiles that reach past a row's
 *        last key. Keys of the last tile past the range's end hold real
 *        (or, past the largest position, arbitrary: NaN) data: their Vt
 *        columns are zeroed in shared memory before P V, as 0 * NaN would
 *        poison the row (the FA2 kernel zero-fills them instead).
 *      - Epilogue: the accumulator fragments of wgmma are laid out as
 *        mma.sync's C fragments per warp, so the rows go out through
 *        st_attn_store_row as the FA2 kernel's (out, or the split partials,
 *        or attention_part's lse / merge).
 *   Shared memory (1024-byte aligned, 128-byte swizzle: the 16-byte chunk c
 *   of row r of a 128-byte-wide region sits at chunk c ^ (r % 8)): Q 2 x 2
 *   regions of 64 rows x 64 dims, per stage K 2 regions of 128 keys x 64
 *   dims and Vt 2 regions of 128 dims x 64 keys; wgmma descriptors walk
 *   k-steps of 16 inside a region by 32-byte steps of the start address.
 * Precision: Q (scaled), K, V and P rounded to bf16 once, fp32 accumulation:
 * the fast mode's contract, as the FA2 kernel. */
#include <cuda.h>
#include <limits.h>
#include <math.h>

#include "backend/cuda/cuda_attn_prefill_wgmma.cuh"
#include "backend/cuda/cuda_common.cuh"

#define HW_HD 128
#define HW_BQ ST_ATTN_WG_ROWS
#define HW_BK ST_ATTN_WG_KEYS
#define HW_ST 2
#define HW_THREADS 384
/* shared memory (bytes from the 1024-aligned base) */
#define HW_REG 16384                       /* one 128-row x 128-byte region */
#define HW_Q 0                             /* Q: (wg 2 + half) x 8192 */
#define HW_K(s) (32768 + (s) * 65536)      /* K of stage s: 2 regions (dims 0-63, 64-127) */
#define HW_V(s) (32768 + (s) * 65536 + 32768) /* Vt of stage s: 2 regions (keys 0-63, 64-127) */
#define HW_SMEM (32768 + HW_ST * 65536 + 1024) /* + the alignment slack */
#define HW_TILE_BYTES 32768                /* one K or Vt tile */

/* 2^x (ex2.approx, flush to zero): 2^-inf = 0. */
ST_DEV float hw_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ---- 1. K -> bf16, V -> bf16 transposed ------------------------------------------------------ */

/* grid (ceil(n_kv / 64), Hkv), 256 threads: keys key0 .. key0 + 63 of kv head
 * blockIdx.y. Warp w takes key pairs w, w + 8, ...; lane l dims 4l .. 4l + 3
 * of both keys (512 coalesced bytes per key); the pair's V values go to
 * tr[dim][pair] as bf16x2, then each Vt row segment (64 keys, 128 bytes) is
 * written as 8 16-byte stores. */
static __global__ void __launch_bounds__(256) hw_kv_prep_kernel(const float *__restrict__ k,
                                                                const float *__restrict__ v, int64_t n_kv, int Hkv,
                                                                int64_t ldv, __nv_bfloat16 *__restrict__ kb,
                                                                __nv_bfloat16 *__restrict__ vt) {
    __shared__ uint32_t tr[HW_HD][33]; /* odd row stride: the stores of a warp spread over 8 banks */
    const int64_t key0 = (int64_t)blockIdx.x * 64;
    const int kvh = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
    for (int it = 0; it < 4; it++) {
        const int p = warp + 8 * it; /* key pair */
        float4 va[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int64_t key = key0 + 2 * p + e;
            va[e] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (key < n_kv) {
                const size_t off = ((size_t)key * Hkv + kvh) * HW_HD + 4 * lane;
                const float4 kx = __ldg((const float4 *)(k + off));
                va[e] = __ldg((const float4 *)(v + off));
                *(uint2 *)(kb + off) = make_uint2(pack_bf16x2(kx.x, kx.y), pack_bf16x2(kx.z, kx.w));
            }
        }
        tr[4 * lane + 0][p] = pack_bf16x2(va[0].x, va[1].x);
        tr[4 * lane + 1][p] = pack_bf16x2(va[0].y, va[1].y);
        tr[4 * lane + 2][p] = pack_bf16x2(va[0].z, va[1].z);
        tr[4 * lane + 3][p] = pack_bf16x2(va[0].w, va[1].w);
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < 4; it++) {
        const int i = tid + 256 * it, d = i >> 3, c = i & 7; /* row d, keys 8c .. 8c + 7 */
        const int64_t key = key0 + 8 * c;
        if (key < ldv) /* (ldv is a multiple of 8: the whole 16 bytes lie in the row) */
            *(uint4 *)(vt + ((size_t)kvh * HW_HD + d) * ldv + key) =
                make_uint4(tr[d][4 * c], tr[d][4 * c + 1], tr[d][4 * c + 2], tr[d][4 * c + 3]);
    }
}

/* ---- 2. the attention kernel --------------------------------------------------------------- */

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HW_SM90A 1
#endif

#ifdef HW_SM90A
ST_DEV uint32_t hw_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

ST_DEV void hw_mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
ST_DEV void hw_mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
ST_DEV void hw_mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Returns once the barrier's phase of parity `parity` has completed. */
ST_DEV void hw_mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
/* A box of the 3-d tensor map at coordinates (c0, c1, c2) -> shared dst,
 * completing on bar. */
ST_DEV void hw_tma3(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
ST_DEV void hw_bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
ST_DEV void hw_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/* wgmma shared-memory descriptor of a K-major operand in 128-byte swizzled
 * regions of 8-row groups 1024 bytes apart (stride offset 1024; the leading
 * offset is unused with this swizzle; bits 62-63 = 1: 128-byte swizzle). */
ST_DEV uint64_t hw_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}
ST_DEV void hw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
ST_DEV void hw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
ST_DEV void hw_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accesses of these registers across the
 * asynchronous products' issue and wait. */
ST_DEV void hw_fence_regs(float (&d)[16][4]) {
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[j][e])::"memory");
}
ST_DEV void hw_fence_regs(uint32_t (&a)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[j][e])::"memory");
}

/* D (64 x 128 fp32: d[j][e] as an mma.sync C fragment per warp) (+)= A B over
 * k16: A from shared memory (descriptor da), B from shared memory (db), both
 * K-major; scale_d 0: D = A B (the old D ignored). */
ST_DEV void hw_wgmma_ss(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
}

/* D += A B over k16: A from registers (a: the m16n8k16 A fragment of the
 * warp's 16 rows), B from shared memory (db, K-major). */
ST_DEV void hw_wgmma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1)
        : "memory");
}

/* S = Q K^T over the 8 k-steps of the head dim (q: the warpgroup's Q, k: the
 * stage's K, shared addresses). */
ST_DEV void hw_qk(float (&s)[16][4], uint32_t q, uint32_t k) {
#pragma unroll
    for (int kk = 0; kk < HW_HD / 16; kk++)
        hw_wgmma_ss(s, hw_desc(q + (kk >> 2) * 8192 + (kk & 3) * 32), hw_desc(k + (kk >> 2) * HW_REG + (kk & 3) * 32),
                    kk > 0);
}
/* O += P V over the 8 k-steps of the tile's keys (vt: the stage's Vt). */
ST_DEV void hw_pv(float (&o)[16][4], const uint32_t (&p)[8][4], uint32_t vt) {
#pragma unroll
    for (int kc = 0; kc < HW_BK / 16; kc++) hw_wgmma_rs(o, p[kc], hw_desc(vt + (kc >> 2) * HW_REG + (kc & 3) * 32));
}

/* Online softmax of one tile's scores s (the thread's rows i = 0, 1: elements
 * 2i, 2i + 1 of every s[j], spread over the quad): keys past a row's last
 * key (kt + key > lim[i]) -> -inf when the tile reaches past it, new maxima
 * m, s -> 2^(s - m) in place, the tile's row sums (this thread's part) and
 * the rescale factors of the old sums and accumulator. */
ST_DEV void hw_softmax(float (&s)[16][4], int kt, const int (&lim)[2], int t4, float (&m)[2], float (&alpha)[2],
                       float (&rs)[2]) {
    if (kt + HW_BK - 1 > min(lim[0], lim[1])) {
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (kt + 8 * j + 2 * t4 + (e & 1) > lim[e >> 1]) s[j][e] = -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int h = 2 * i;
        float mx = m[i];
#pragma unroll
        for (int j = 0; j < 16; j++) mx = fmaxf(mx, fmaxf(s[j][h], s[j][h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float b = mx == -INFINITY ? 0.0f : mx;
        alpha[i] = hw_exp2(m[i] - b);
        m[i] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            s[j][h] = hw_exp2(s[j][h] - b);
            s[j][h + 1] = hw_exp2(s[j][h + 1] - b);
            sum += s[j][h] + s[j][h + 1];
        }
        rs[i] = sum;
    }
}

/* acc, l rescaled by alpha, l += the tile's sums; P (bf16, the A fragments of
 * keys 16 kc .. 16 kc + 15) from the exponentiated scores. */
ST_DEV void hw_rescale_pack(float (&acc)[16][4], float (&l)[2], const float (&alpha)[2], const float (&rs)[2],
                            const float (&s)[16][4], uint32_t (&p)[8][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++) l[i] = l[i] * alpha[i] + rs[i];
#pragma unroll
    for (int j = 0; j < 16; j++) {
        acc[j][0] *= alpha[0], acc[j][1] *= alpha[0];
        acc[j][2] *= alpha[1], acc[j][3] *= alpha[1];
    }
#pragma unroll
    for (int kc = 0; kc < 8; kc++) {
        p[kc][0] = pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
        p[kc][1] = pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
        p[kc][2] = pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
        p[kc][3] = pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    }
}
#endif /* HW_SM90A */

/* q [n, H, 128] fp32; tm_k: K bf16 [n_kv][Hkv][128] (box 64 dims x 1 x 128
 * keys), tm_v: Vt bf16 [Hkv][128][ldv] (box 64 keys x 128 dims x 1); pos [n].
 * pingpong: the consumer warpgroups take turns issuing products. PART:
 * attention_part's instantiation (attn_out: positions from key0, the rows'
 * lse). See the top of the file. */
template <bool PART>
static __global__ void __launch_bounds__(HW_THREADS, 1)
    hw_attn_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                   const float *__restrict__ q, const int32_t *__restrict__ pos, int n, int64_t n_kv, int H, int Hkv,
                   float qscale, attn_out o, int pingpong) {
#ifdef HW_SM90A
    extern __shared__ uint8_t hw_smem_raw[];
    __shared__ __align__(8) uint64_t bars[3 * HW_ST]; /* full K [ST], full V [ST], empty [ST] */
    uint8_t *const sm = (uint8_t *)(((uintptr_t)hw_smem_raw + 1023) & ~(uintptr_t)1023);
    const uint32_t sbase = hw_smem_addr(sm), bar0 = hw_smem_addr(bars);
#define FULLK(s) (bar0 + 8 * (s))
#define FULLV(s) (bar0 + 8 * (HW_ST + (s)))
#define EMPTY(s) (bar0 + 8 * (2 * HW_ST + (s)))

    /* row indices in 32 bits as the FA2 kernel's (RT = n G < 2^31) */
    const unsigned G = (unsigned)(H / Hkv);
    const unsigned RT = (unsigned)n * G;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const unsigned rbase = (gridDim.x - 1 - blockIdx.x) * HW_BQ; /* heaviest (causal) first */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    /* the block's largest position (every warp alike) -> its key range */
    int maxpos = -1;
#pragma unroll
    for (int i = 0; i < HW_BQ / 32; i++) {
        const unsigned P = rbase + lane + 32 * i;
        if (P < RT) maxpos = max(maxpos, st_attn_qpos<PART>(o, pos, P / G));
    }
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, sh));
    int64_t kv_begin, kv_end;
    split_range(n_kv, maxpos, o.nsplit, split, HW_BK, &kv_begin, &kv_end);
    const int nk = kv_end > kv_begin ? (int)(kv_end - kv_begin) : 0;
    const int ntiles = (nk + HW_BK - 1) / HW_BK;

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < HW_ST; s++) {
            hw_mbar_init(FULLK(s), 1);
            hw_mbar_init(FULLV(s), 1);
            hw_mbar_init(EMPTY(s), 2 * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp < 4) { /* ---- the producer warpgroup ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 0) {
            for (int t = 0; t < ntiles; t++) {
                const int s = t % HW_ST;
                if (t >= HW_ST) hw_mbar_wait(EMPTY(s), (t / HW_ST - 1) & 1); /* tile t - ST released */
                const int key = (int)(kv_begin + (int64_t)t * HW_BK);
                hw_mbar_expect_tx(FULLK(s), HW_TILE_BYTES);
                hw_tma3(sbase + HW_K(s), &tm_k, 0, kvh, key, FULLK(s));
                hw_tma3(sbase + HW_K(s) + HW_REG, &tm_k, 64, kvh, key, FULLK(s));
                hw_mbar_expect_tx(FULLV(s), HW_TILE_BYTES);
                hw_tma3(sbase + HW_V(s), &tm_v, key, 0, kvh, FULLV(s));
                hw_tma3(sbase + HW_V(s) + HW_REG, &tm_v, key + 64, 0, kvh, FULLV(s));
            }
        }
        return;
    }

    /* ---- the consumer warpgroups: wg 0, 1, rows rbase + 64 wg .. + 63 ---- */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int wg = (warp >> 2) - 1, wq = warp & 3, ct = tid - 128 * (wg + 1), g = lane >> 2, t4 = lane & 3;
    const unsigned row0 = rbase + 64 * wg;

    /* Q -> bf16 (times qscale) into the warpgroup's two swizzled regions */
    uint8_t *const qp = sm + HW_Q + wg * 16384;
#pragma unroll 4
    for (int it = 0; it < 16; it++) {
        const int i = ct + 128 * it, r = i >> 5, d4 = i & 31;
        const unsigned P = row0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (P < RT) {
            x = __ldg((const float4 *)(q + ((size_t)(P / G) * H + kvh * G + P % G) * HW_HD) + d4);
            x.x *= qscale, x.y *= qscale, x.z *= qscale, x.w *= qscale;
        }
        const int c = (d4 & 15) >> 1; /* 16-byte chunk within the 128-byte row */
        *(uint2 *)(qp + (d4 >> 4) * 8192 + r * 128 + ((c ^ (r & 7)) << 4) + (d4 & 1) * 8) =
            make_uint2(pack_bf16x2(x.x, x.y), pack_bf16x2(x.z, x.w));
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* visible to wgmma */
    hw_bar_sync(1 + wg, 128);
    const uint32_t qs = sbase + HW_Q + wg * 16384;

    /* this thread's rows (i = 0, 1: rows g and g + 8 of its warp's 16) and the
     * last key each sees within the range (< 0: none) */
    int lim[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const unsigned P = row0 + 16 * wq + 8 * i + g;
        const int prow = P < RT ? st_attn_qpos<PART>(o, pos, P / G) : -1;
        lim[i] = (int)(min((int64_t)prow, kv_end - 1) - kv_begin);
    }

    float acc[16][4], s[16][4];
    uint32_t p[8][4];
#pragma unroll
    for (int j = 0; j < 16; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2], rs[2];
    const int me = 4 + wg, other = 5 - wg; /* named barriers of the turns (pingpong) */
    if (ntiles > 0) {
        /* turn 0: S of tile 0 */
        if (pingpong && wg == 1) hw_bar_arrive(4, 256); /* warpgroup 0 goes first */
        hw_mbar_wait(FULLK(0), 0);
        if (pingpong) hw_bar_sync(me, 256);
        hw_wg_fence();
        hw_qk(s, qs, sbase + HW_K(0));
        hw_wg_commit();
        if (pingpong) hw_bar_arrive(other, 256);
        hw_wg_wait<0>();
        hw_fence_regs(s);
        hw_softmax(s, 0, lim, t4, m, alpha, rs);
        hw_rescale_pack(acc, l, alpha, rs, s, p);
        /* turn t: S of tile t with P V of tile t - 1 */
        for (int t = 1; t < ntiles; t++) {
            const int sc = t % HW_ST, sp = (t - 1) % HW_ST;
            hw_mbar_wait(FULLK(sc), (t / HW_ST) & 1);
            hw_mbar_wait(FULLV(sp), ((t - 1) / HW_ST) & 1);
            if (pingpong) hw_bar_sync(me, 256);
            hw_fence_regs(acc);
            hw_fence_regs(p);
            hw_wg_fence();
            hw_qk(s, qs, sbase + HW_K(sc));
            hw_wg_commit();
            hw_pv(acc, p, sbase + HW_V(sp));
            hw_wg_commit();
            if (pingpong) hw_bar_arrive(other, 256);
            hw_wg_wait<1>(); /* S of tile t */
            hw_fence_regs(s);
            hw_softmax(s, t * HW_BK, lim, t4, m, alpha, rs);
            hw_wg_wait<0>(); /* P V of tile t - 1 */
            hw_fence_regs(acc);
            hw_fence_regs(p);
            hw_mbar_arrive(EMPTY(sp));
            hw_rescale_pack(acc, l, alpha, rs, s, p);
        }
        /* the last turn: P V of the last tile, its keys past the range's end
         * zeroed in Vt first (both warpgroups: 64 dims each) */
        const int tl = ntiles - 1, sl = tl % HW_ST;
        hw_mbar_wait(FULLV(sl), (tl / HW_ST) & 1);
        const int j0 = nk - tl * HW_BK;
        if (j0 < HW_BK) {
            uint8_t *const vb = sm + HW_V(sl);
            for (int idx = ct; idx < 64 * HW_BK; idx += 128) {
                const int r = 64 * wg + (idx >> 7), j = idx & (HW_BK - 1);
                if (j >= j0) {
                    const int jj = j & 63;
                    *(uint16_t *)(vb + (j >> 6) * HW_REG + r * 128 + (((jj >> 3) ^ (r & 7)) << 4) + (jj & 7) * 2) = 0;
                }
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            hw_bar_sync(3, 256);
        }
        if (pingpong) hw_bar_sync(me, 256);
        hw_fence_regs(acc);
        hw_fence_regs(p);
        hw_wg_fence();
        hw_pv(acc, p, sbase + HW_V(sl));
        hw_wg_commit();
        if (pingpong && wg == 0) hw_bar_arrive(other, 256); /* (warpgroup 1's last turn passes nothing on) */
        hw_wg_wait<0>();
        hw_fence_regs(acc);
        hw_fence_regs(p);
    }
#undef FULLK
#undef FULLV
#undef EMPTY
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const int64_t rows = (int64_t)n * H;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const unsigned P = row0 + 16 * wq + 8 * i + g;
        if (P >= RT) continue;
        const int64_t orow = (int64_t)(P / G) * H + kvh * G + P % G;
        st_attn_store_row<HW_HD, PART>(o, split, rows, orow, t4, acc, 2 * i, m[i], l[i]);
    }
#elif defined(__CUDA_ARCH__)
    __trap(); /* not sm_90a: never launched (st_attn_wgmma_setup) */
#endif
}

/* ---- host ---------------------------------------------------------------------------------- */

typedef CUresult (*hw_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                 const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

strata_status st_attn_wgmma_setup(st_cuda *c, bool *ok) {
    *ok = false;
    c->tmap_encode = NULL;
    int major = 0, minor = 0;
    ST_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->device));
    ST_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, c->device));
    /* sm_90a code runs on compute capability 9.0 alone; the kernel needs
     * HW_SMEM bytes of dynamic shared memory besides its barriers */
    if (major != 9 || minor != 0 || c->smem_optin < (size_t)HW_SMEM + 64) return STRATA_OK;
    void *fn = NULL;
    cudaDriverEntryPointQueryResult qr = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr) !=
            cudaSuccess ||
        qr != cudaDriverEntryPointSuccess || !fn) {
        (void)cudaGetLastError(); /* no tensor maps: the FA2 kernel serves */
        return STRATA_OK;
    }
    c->tmap_encode = fn;
    ST_CUDA_TRY(cudaFuncSetAttribute(hw_attn_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, HW_SMEM));
    ST_CUDA_TRY(cudaFuncSetAttribute(hw_attn_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, HW_SMEM));
    *ok = true;
    return STRATA_OK;
}

/* A 3-d bf16 tensor map, 128-byte swizzle, out-of-bounds elements zero. */
static strata_status hw_map(const st_cuda *c, CUtensorMap *map, void *base, const cuuint64_t dims[3],
                            const cuuint64_t strides[2], const cuuint32_t box[3], const char *what) {
    const cuuint32_t es[3] = {1, 1, 1};
    const CUresult r = ((hw_encode_fn)c->tmap_encode)(
        map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return st_err(STRATA_ERR_BACKEND, "cuda attention (wgmma prefill): cuTensorMapEncodeTiled of %s failed (%d)",
                      what, (int)r);
    return STRATA_OK;
}

strata_status st_attn_prefill_wgmma(st_backend *be, st_cuda_stream *s, const float *q, const float *k,
                                    const float *v, const int32_t *pos, int64_t n, int64_t n_kv, int64_t H,
                                    int64_t Hkv, float qscale, const attn_out *o, bool part, bool pingpong) {
    st_cuda *c = st_cuda_of(be);
    if (!c->tmap_encode)
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda attention (wgmma prefill): not available on this device");
    if ((n * (H / Hkv) + HW_BQ - 1) / HW_BQ > INT32_MAX || n_kv > INT32_MAX - 2 * HW_BK)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention (wgmma prefill): n = %lld, n_kv = %lld: too large",
                      (long long)n, (long long)n_kv);
    const int64_t ldv = (n_kv + 7) / 8 * 8;
    const size_t kb_bytes = ((size_t)n_kv * (size_t)Hkv * HW_HD * sizeof(__nv_bfloat16) + 255) / 256 * 256;
    const size_t vt_bytes = (size_t)Hkv * HW_HD * (size_t)ldv * sizeof(__nv_bfloat16);
    void *buf = NULL;
    strata_status st = st_cuda_scratch(be, s, ST_CUDA_SCRATCH_ATTN_BF16, kb_bytes + vt_bytes, &buf);
    if (st != STRATA_OK) return st;
    __nv_bfloat16 *kb = (__nv_bfloat16 *)buf, *vt = (__nv_bfloat16 *)((char *)buf + kb_bytes);
    hw_kv_prep_kernel<<<dim3((unsigned)((n_kv + 63) / 64), (unsigned)Hkv), 256, 0, s->s>>>(k, v, n_kv, (int)Hkv,
                                                                                         ldv, kb, vt);
    ST_CUDA_LAUNCHED("hw_kv_prep_kernel");
    CUtensorMap tk, tv;
    const cuuint64_t kd[3] = {HW_HD, (cuuint64_t)Hkv, (cuuint64_t)n_kv};
    const cuuint64_t ks[2] = {HW_HD * 2, (cuuint64_t)Hkv * HW_HD * 2};
    const cuuint32_t kbox[3] = {64, 1, HW_BK};
    if ((st = hw_map(c, &tk, kb, kd, ks, kbox, "K")) != STRATA_OK) return st;
    const cuuint64_t vd[3] = {(cuuint64_t)n_kv, HW_HD, (cuuint64_t)Hkv};
    const cuuint64_t vs[2] = {(cuuint64_t)ldv * 2, (cuuint64_t)HW_HD * ldv * 2};
    const cuuint32_t vbox[3] = {64, HW_HD, 1};
    if ((st = hw_map(c, &tv, vt, vd, vs, vbox, "Vt")) != STRATA_OK) return st;
    const dim3 grid((unsigned)((n * (H / Hkv) + HW_BQ - 1) / HW_BQ), (unsigned)Hkv, (unsigned)o->nsplit);
    if (part)
        hw_attn_kernel<true><<<grid, HW_THREADS, HW_SMEM, s->s>>>(tk, tv, q, pos, (int)n, n_kv, (int)H, (int)Hkv,
                                                                 qscale, *o, pingpong ? 1 : 0);
    else
        hw_attn_kernel<false><<<grid, HW_THREADS, HW_SMEM, s->s>>>(tk, tv, q, pos, (int)n, n_kv, (int)H, (int)Hkv,
                                                                  qscale, *o, pingpong ? 1 : 0);
    ST_CUDA_LAUNCHED("hw_attn_kernel");
    return STRATA_OK;
}

/* attention_paged: causal grouped-query attention of a batch of sequences over
 * a paged KV cache (backend.h, st_paged_kv). Token t of sequence seq[t] at
 * position pos[t] sees keys 0..pos[t]; key j lives in slot
 * table[j / bs] * bs + j % bs of the layer's pool.
 *
 * Batch invariance is the design goal: every token, whether it is a decode or
 * part of a prefill chunk, goes through the same kernel, and the order of its
 * reduction depends only on its own position:
 *   - a block works on ONE token and the query heads of one kv head (up to
 *     RMAX of them: rows r = heads kvh G + c RMAX + r), so nothing of another
 *     token ever shares its arithmetic;
 *   - its keys [0, pos] are cut into fixed ranges of PA_SPLIT keys (split s =
 *     keys [s PA_SPLIT, (s+1) PA_SPLIT)), one block each (grid.z); a range is
 *     walked in tiles of 32 keys from its start, with an online softmax per
 *     row (fp32 SIMT, exact to fp32 rounding: scores pre-scaled by scale *
 *     log2(e), exp2);
 *   - a token with one range writes its output directly; one with more
 *     writes (acc, m, l) per range and the merge kernel combines the ranges in
 *     increasing order: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
 * So a token's bits are the same alone or among any others, and for any
 * number of tokens per call (tokens are processed in sub-batches that bound
 * the partials' scratch, which changes nothing per token). What is NOT
 * claimed: equality with the contiguous `attention` op (a different kernel,
 * ~1e-6 apart), nor across head_dim/alignment classes (hd 64/128 with
 * 16-byte aligned pointers take the tiled kernel; anything else a generic
 * one, also batch-invariant).
 *
 * Speed (H200, 32/8 heads, hd 128, bs 16, measured with a throwaway timing
 * harness, 2026-11-21): 32 decodes over 2048 keys each 0.23 ms (2.3 TB/s of K+V; the
 * contiguous op called per sequence: 0.57 ms), over 8192 keys 0.82 ms
 * (2.6 TB/s); one decode over 32768 keys 0.19 ms (the contiguous kernel,
 * whose splits adapt to the length: 0.09 ms). Prefill is the weak spot: one
 * block per token re-reads the keys for every query and runs on fp32 SIMT,
 * so 512 queries over 2048 keys take 2.8 ms against 0.42 ms for the
 * tensor-core kernel of `attention`. Sharing K/V tiles between the tokens of
 * one sequence inside a block keeps every row's arithmetic (a tile past a
 * row's position is an exact no-op for it) and is the next step.
 *
 * Invalid indices (the host cannot read them): a seq outside [0, n_seqs) or a
 * sequence with no keys gives a row of NaN; ctx_lens is clamped to
 * max_blocks * bs and pos to ctx_len - 1; a block id outside the pool reads
 * as zeros. No out-of-bounds access in any case. */
#include <math.h>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_internal.h"

#define LOG2E 1.4426950408889634f
#define PA_SPLIT 256   /* keys per range: fixed, so a token's reduction order is its own */
#define PA_THREADS 128
#define PA_TK 32       /* keys per tile */
#define PA_SCRATCH_CAP ((size_t)64 << 20) /* partials of one sub-batch */

/* What a token's block needs to know about it: its keys [0, nk) (nk = 0:
 * invalid token) and its block-table row. */
struct pa_tok {
    const int32_t *table;
    int64_t nk;
};

ST_DEV pa_tok pa_token(const st_paged_kv &kv, const int32_t *seq, const int32_t *pos, int64_t t) {
    pa_tok r = {nullptr, 0};
    const int32_t sq = __ldg(seq + t);
    if (sq < 0 || (int64_t)sq >= kv.n_seqs) return r;
    int64_t len = __ldg(kv.ctx_lens + sq);
    const int64_t cap = kv.max_blocks * kv.block_size;
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
                    pa_out o) {
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t row = blockIdx.x;
    const pa_tok tk = pa_token(kv, seq, pos, o.tok0 + row / H);
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

/* ---- the tiled kernel: hd 64 / 128, fp32 SIMT ----------------------------------------- */

ST_DEV void pa_cp_async16(void *smem, const void *gmem, bool valid) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0; /* 0: nothing read, 16 bytes of zeros written */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
ST_DEV void pa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
ST_DEV void pa_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int HD, int RMAX>
static size_t pa_smem_bytes() {
    return sizeof(float) * ((size_t)RMAX * HD + 2 * ((size_t)PA_TK * (HD + 4) + (size_t)PA_TK * HD) +
                            (size_t)RMAX * PA_TK + 3 * (size_t)RMAX);
}

/* grid (sub-batch tokens, Hkv * hchunks, ranges). Block (t, y, sp): token
 * tok0 + t, kv head y / hchunks, query heads (y % hchunks) * RMAX .. of its
 * group, keys of range sp. K/V tiles double-buffered with cp.async. */
template <int HD, int RMAX>
static __global__ void __launch_bounds__(PA_THREADS)
    pa_tiled_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                    const int32_t *__restrict__ pos, int H, int Hkv, int hchunks, float qscale, pa_out o) {
    constexpr int KP = HD + 4;                     /* padded K row: conflict-free float4 reads by key */
    constexpr int RPW = RMAX / 4;                  /* rows per warp in the score phase */
    constexpr int CG = 128 / HD;                   /* thread groups per column (1 or 2) */
    constexpr int RPT = RMAX / CG;                 /* rows per thread in the PV phase */
    constexpr int TILE = PA_TK * KP + PA_TK * HD;  /* floats of one K+V buffer */
    extern __shared__ float4 pa_smem4[];
    float *q_s = (float *)pa_smem4;                /* [RMAX][HD] */
    float *kv_s = q_s + RMAX * HD;                 /* 2 x ([TK][KP] K, [TK][HD] V) */
    float *p_s = kv_s + 2 * TILE;                  /* [RMAX][TK] */
    float *alpha_s = p_s + RMAX * PA_TK;           /* [RMAX] */
    float *m_s = alpha_s + RMAX;
    float *l_s = m_s + RMAX;
    st_pdl_wait();
    st_pdl_trigger();

    const int64_t t = o.tok0 + blockIdx.x;
    const int kvh = blockIdx.y / hchunks, chunk = blockIdx.y % hchunks, sp = blockIdx.z;
    const int G = H / Hkv, h0 = kvh * G + chunk * RMAX;
    const int R = min(RMAX, G - chunk * RMAX);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const pa_tok tk = pa_token(kv, seq, pos, t);
    if (tk.nk == 0) { /* invalid token: a NaN row, written by the first range's block */
        if (sp == 0)
            for (int i = tid; i < R * HD; i += PA_THREADS)
                o.out[(t * H + h0 + i / HD) * HD + i % HD] = __int_as_float(0x7fc00000);
        return;
    }
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
    if (sp >= ns) return;
    const int64_t kv_begin = (int64_t)sp * PA_SPLIT;
    const int64_t kv_end = min(tk.nk, kv_begin + PA_SPLIT);
    const int64_t bs = kv.block_size, n_blocks = kv.n_slots / bs, kv_stride = (int64_t)Hkv * HD;

    for (int i = tid; i < RMAX * HD / 4; i += PA_THREADS) {
        const int r = i / (HD / 4), d4 = i % (HD / 4);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < R) {
            x = __ldg((const float4 *)(q + (t * H + h0 + r) * HD) + d4);
            x.x *= qscale, x.y *= qscale, x.z *= qscale, x.w *= qscale;
        }
        ((float4 *)q_s)[i] = x;
    }
    const int ntiles = (int)((kv_end - kv_begin + PA_TK - 1) / PA_TK);

    /* tile tt -> buffer tt & 1; keys past kv_end and keys of invalid blocks are zero-filled */
    auto stage = [&](int tt) {
        float *ks = kv_s + (tt & 1) * TILE, *vs = ks + PA_TK * KP;
        const int64_t kb = kv_begin + (int64_t)tt * PA_TK;
        for (int i = tid; i < PA_TK * HD / 4; i += PA_THREADS) {
            const int j = i / (HD / 4), d4 = i % (HD / 4);
            const int64_t key = kb + j;
            const int64_t slot = key < kv_end ? pa_slot(tk, key, bs, n_blocks) : -1;
            const bool ok = slot >= 0;
            const size_t off = ok ? (size_t)slot * kv_stride + (size_t)kvh * HD + 4 * d4 : 0;
            pa_cp_async16(ks + j * KP + 4 * d4, kv.k_cache + off, ok);
            pa_cp_async16(vs + j * HD + 4 * d4, kv.v_cache + off, ok);
        }
        pa_cp_commit();
    };

    float m_r[RPW], l_r[RPW];
#pragma unroll
    for (int i = 0; i < RPW; i++) m_r[i] = -INFINITY, l_r[i] = 0.0f;
    const int dcol = tid % HD, rg = tid / HD;
    float acc[RPT];
#pragma unroll
    for (int i = 0; i < RPT; i++) acc[i] = 0.0f;

    stage(0); /* ntiles >= 1: the range holds at least its first key */
    for (int tt = 0; tt < ntiles; tt++) {
        if (tt + 1 < ntiles) {
            stage(tt + 1);
            pa_cp_wait<1>();
        } else {
            pa_cp_wait<0>();
        }
        __syncthreads();
        const float *k_s = kv_s + (tt & 1) * TILE, *v_s = k_s + PA_TK * KP;
        const int64_t key = kv_begin + (int64_t)tt * PA_TK + lane;
        /* scores: lane = key, rows warp, warp + 4, ... */
        float s[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) s[i] = 0.0f;
#pragma unroll 4
        for (int d4 = 0; d4 < HD / 4; d4++) {
            const float4 kx = *(const float4 *)(k_s + lane * KP + 4 * d4);
#pragma unroll
            for (int i = 0; i < RPW; i++) {
                const int r = warp + 4 * i;
                if (r < R) {
                    const float4 qx = *(const float4 *)(q_s + r * HD + 4 * d4);
                    s[i] = fmaf(qx.x, kx.x, fmaf(qx.y, kx.y, fmaf(qx.z, kx.z, fmaf(qx.w, kx.w, s[i]))));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + 4 * i;
            if (r < R) { /* warp-uniform */
                const float sv = key < kv_end ? s[i] : -INFINITY;
                const float mnew = fmaxf(m_r[i], st_warp_max(sv));
                const float base = mnew == -INFINITY ? 0.0f : mnew;
                const float p = exp2f(sv - base);
                const float alpha = exp2f(m_r[i] - base);
                l_r[i] = l_r[i] * alpha + st_warp_sum(p);
                m_r[i] = mnew;
                p_s[r * PA_TK + lane] = p;
                if (lane == 0) alpha_s[r] = alpha;
            }
        }
        __syncthreads();
        /* PV: thread owns column dcol of rows rg, rg + CG, ... */
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int r = rg + CG * i;
            if (r < R) acc[i] *= alpha_s[r];
        }
#pragma unroll 2
        for (int j4 = 0; j4 < PA_TK / 4; j4++) {
            const float v0 = v_s[(4 * j4 + 0) * HD + dcol], v1 = v_s[(4 * j4 + 1) * HD + dcol];
            const float v2 = v_s[(4 * j4 + 2) * HD + dcol], v3 = v_s[(4 * j4 + 3) * HD + dcol];
#pragma unroll
            for (int i = 0; i < RPT; i++) {
                const int r = rg + CG * i;
                if (r < R) {
                    const float4 p = *(const float4 *)(p_s + r * PA_TK + 4 * j4);
                    acc[i] = fmaf(p.x, v0, fmaf(p.y, v1, fmaf(p.z, v2, fmaf(p.w, v3, acc[i]))));
                }
            }
        }
        __syncthreads(); /* buffer tt & 1 and p_s are free again */
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + 4 * i;
            if (r < R) m_s[r] = m_r[i], l_s[r] = l_r[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int r = rg + CG * i;
        if (r < R) {
            const int64_t grow = t * H + h0 + r;             /* row of the call */
            const int64_t lrow = (t - o.tok0) * H + h0 + r;  /* row of the sub-batch */
            if (ns == 1) {
                o.out[grow * HD + dcol] = acc[i] / l_s[r];
            } else {
                o.part_acc[((size_t)sp * o.rows + lrow) * HD + dcol] = acc[i];
                if (dcol == 0) {
                    o.part_m[sp * o.rows + lrow] = m_s[r];
                    o.part_l[sp * o.rows + lrow] = l_s[r];
                }
            }
        }
    }
}

/* ---- generic: any head_dim or alignment, fp32, one block per (token, head) ---------- */

#define PG_THREADS 128

/* grid (sub-batch tokens * H, ranges); smem: q [hd], acc [hd], p [128]. Same
 * ranges and merge as the tiled kernel; keys 128 at a time within a range. */
static __global__ void __launch_bounds__(PG_THREADS)
    pa_generic_kernel(const float *__restrict__ q, st_paged_kv kv, const int32_t *__restrict__ seq,
                      const int32_t *__restrict__ pos, int H, int Hkv, int hd, float qscale, pa_out o) {
    extern __shared__ float pg_sm[];
    float *q_s = pg_sm, *acc_s = pg_sm + hd, *p_s = acc_s + hd;
    __shared__ float red[32];
    st_pdl_wait();
    st_pdl_trigger();
    const int64_t lrow = blockIdx.x, t = o.tok0 + lrow / H, grow = o.tok0 * H + lrow;
    const int h = (int)(lrow % H), kvh = h / (H / Hkv), sp = blockIdx.y;
    const pa_tok tk = pa_token(kv, seq, pos, t);
    if (tk.nk == 0) {
        if (sp == 0)
            for (int d = threadIdx.x; d < hd; d += PG_THREADS) o.out[grow * hd + d] = __int_as_float(0x7fc00000);
        return;
    }
    const int ns = (int)((tk.nk + PA_SPLIT - 1) / PA_SPLIT);
    if (sp >= ns) return;
    const int64_t begin = (int64_t)sp * PA_SPLIT, end = min(tk.nk, begin + PA_SPLIT);
    const int64_t bs = kv.block_size, n_blocks = kv.n_slots / bs, kv_stride = (int64_t)Hkv * hd;
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
                const float *kr = kv.k_cache + (size_t)slot * kv_stride + (size_t)kvh * hd;
                for (int d = 0; d < hd; d++) s = fmaf(q_s[d], __ldg(kr + d), s);
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
                const float vv = slot >= 0 ? __ldg(kv.v_cache + (size_t)slot * kv_stride + (size_t)kvh * hd + d) : 0.0f;
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

template <int HD, int RMAX>
static strata_status pa_set_attr() {
    ST_CUDA_TRY(cudaFuncSetAttribute(pa_tiled_kernel<HD, RMAX>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)pa_smem_bytes<HD, RMAX>()));
    return STRATA_OK;
}

strata_status st_cuda_attention_paged_setup(st_cuda *c) {
    strata_status st;
#define SET(HD, RM)                                                                          \
    if ((st = pa_set_attr<HD, RM>()) != STRATA_OK) return st;
    SET(64, 4) SET(64, 8) SET(64, 16) SET(128, 4) SET(128, 8) SET(128, 16)
#undef SET
    return STRATA_OK;
}

template <int HD, int RMAX>
static strata_status pa_launch_tiled(st_cuda *c, cudaStream_t s, const float *q, const st_paged_kv &kv,
                                     const int32_t *seq, const int32_t *pos, int64_t nt, int H, int Hkv, int nsplit,
                                     float qscale, const pa_out &o) {
    const int G = H / Hkv, hchunks = (G + RMAX - 1) / RMAX;
    ST_CUDA_TRY(st_launch(c->pdl, pa_tiled_kernel<HD, RMAX>, dim3((unsigned)nt, (unsigned)(Hkv * hchunks), (unsigned)nsplit),
                          dim3(PA_THREADS), pa_smem_bytes<HD, RMAX>(), s, q, kv, seq, pos, H, Hkv, hchunks, qscale, o));
    return STRATA_OK;
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
    const bool tiled = (hd == 64 || hd == 128) && st_cuda_aligned(q, 16) && st_cuda_aligned(kv->k_cache, 16) &&
                       st_cuda_aligned(kv->v_cache, 16);
    const int RMAX = G <= 4 ? 4 : G <= 8 ? 8 : 16;
    if (tiled && (int64_t)Hkv * ((G + RMAX - 1) / RMAX) > 65535)
        return st_err(STRATA_ERR_INVALID_ARG, "cuda attention_paged: %d kv heads is too many", Hkv);
    const size_t gsmem = (size_t)(2 * hd + PG_THREADS) * sizeof(float);
    if (!tiled && gsmem > 48 * 1024)
        return st_err(STRATA_ERR_UNSUPPORTED, "cuda attention_paged: head_dim %d is too large", hd);

    /* sub-batches of tokens whose partials fit PA_SCRATCH_CAP (at least one token) */
    const size_t per_tok = nsplit > 1 ? (size_t)nsplit * n_heads * (head_dim + 2) * sizeof(float) : 0;
    int64_t nt_max = per_tok ? (int64_t)(PA_SCRATCH_CAP / per_tok) : n;
    if (nt_max < 1) nt_max = 1;
    if (nt_max > n) nt_max = n;
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
        if (tiled) {
#define TL(HDV, RM) st = pa_launch_tiled<HDV, RM>(c, s->s, q, *kv, seq, pos, nt, H, Hkv, nsplit, qscale, o)
            if (hd == 64) {
                if (RMAX == 4) TL(64, 4);
                else if (RMAX == 8) TL(64, 8);
                else TL(64, 16);
            } else {
                if (RMAX == 4) TL(128, 4);
                else if (RMAX == 8) TL(128, 8);
                else TL(128, 16);
            }
#undef TL
        } else {
            ST_CUDA_TRY(st_launch(c->pdl, pa_generic_kernel, dim3((unsigned)(nt * n_heads), (unsigned)nsplit),
                                  dim3(PG_THREADS), gsmem, s->s, q, *kv, seq, pos, H, Hkv, hd, qscale, o));
        }
        if (st != STRATA_OK) return st;
        if (nsplit > 1)
            ST_CUDA_TRY(st_launch(c->pdl, pa_merge_kernel, dim3((unsigned)(nt * n_heads)), dim3(128), 0, s->s, *kv,
                                  seq, pos, H, hd, o));
    }
    return STRATA_OK;
}

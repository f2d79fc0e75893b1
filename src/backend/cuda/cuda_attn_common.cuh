/* Device code shared by the attention ops (cuda_attention.cu, the contiguous
 * op, its FA2 prefill kernel cuda_attn_prefill_fa2.cu, and
 * cuda_attention_paged.cu): cp.async staging, split-KV ranges and outputs,
 * bf16 tensor-core helpers (mma, ldmatrix), the fp32 SIMT tile of the decode
 * kernels (online softmax + PV over one staged tile of keys), and the merge
 * of split-KV partial results, and the row epilogue of attention_part
 * (positions counted from the piece's first key, the row's log-sum-exp,
 * the merge into a running (out, lse)). CUDA C only.
 *
 * Online softmax per row (both files): running max m, sum l and an
 * unnormalized accumulator acc; scores are pre-scaled by scale * log2(e) and
 * exponentiated with exp2. A tile of keys turns (m, l, acc) into
 *   m' = max(m, max_j s_j), p_j = 2^(s_j - m'), alpha = 2^(m - m'),
 *   l' = l alpha + sum_j p_j, acc' = acc alpha + sum_j p_j v_j
 * (m' = -inf: base 0 instead, so that no inf - inf appears). */
#pragma once
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

/* ---- cp.async: 16 bytes global -> shared, zero-filled when !valid ------------------- */
ST_DEV void st_cp_async16(void *smem, const void *gmem, bool valid) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0; /* 0: nothing read, 16 bytes of zeros written */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(gmem), "r"(n));
}
ST_DEV void st_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
ST_DEV void st_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* ---- split-KV bookkeeping (cuda_attention.cu, cuda_attn_prefill_fa2.cu) ---------------- */
/* Where a block puts its rows' results: final output (nsplit == 1) or partials.
 * The fields after nsplit serve attention_part (backend.h), read only by
 * the kernels' PART instantiations (template flag PART: `attention` runs
 * the others, compiled as before, and leaves these zero):
 *   key0: the kernel's keys are one piece of the sequence's, starting at key
 *     key0: a query at position p sees the piece's keys 0 .. p - key0 (p is
 *     clamped to >= key0: CUDA clamps instead of checking, backend.h);
 *   lse: when not NULL, each row's natural-log log-sum-exp goes to lse[orow]
 *     (orow = token * H + head, as out's rows);
 *   merge: (out, lse) hold the result over earlier keys; the row's result is
 *     merged into them (st_attn_finish) instead of written (lse not NULL). */
struct attn_out {
    float *out;      /* [n, H, hd] */
    float *part_acc; /* [nsplit][n H][hd] */
    float *part_m;   /* [nsplit][n H] */
    float *part_l;
    int nsplit;
    bool merge;      /* attention_part: merge into (out, lse) */
    int key0;        /* attention_part: the piece's first key (min(key0, INT32_MAX): positions are int32) */
    float *lse;      /* attention_part: [n H] natural log, or NULL */
};

/* The position of query token t as the kernels use it: pos[t], or for a
 * piece (PART) pos[t] - key0 clamped to >= 0, so that every row sees at
 * least the piece's first key (max(pos, 0) - key0 cannot overflow: both
 * are in [0, 2^31)). */
template <bool PART>
ST_DEV int st_attn_qpos(const attn_out &o, const int32_t *__restrict__ pos, int64_t t) {
    const int p = __ldg(pos + t);
    return PART ? max(max(p, 0) - o.key0, 0) : p;
}

#define ST_ATTN_LOG2E 1.4426950408889634f
#define ST_ATTN_LN2 0.6931471805599453f

/* How a row's unnormalized result over its keys (acc, m, l: log2 units, as
 * the kernels keep them: sum_j 2^(s_j log2(e) - m) = l, acc the same
 * weighted sum of V) becomes its output: out = out_old wa + acc wb, and its
 * log-sum-exp (natural log). Without merge: wa = 0, wb = 1 / l, lse =
 * (m + log2 l) ln 2. With merge, (out_old, lse_old) the result over earlier
 * keys, by backend.h's rule: lse_p = (m + log2 l) ln 2, M = max(lse_old,
 * lse_p), a = e^(lse_old - M), b = e^(lse_p - M): wa = a / (a + b),
 * wb = b / ((a + b) l), lse = M + ln(a + b). */
struct attn_fin {
    float wa, wb, lse;
};
ST_DEV attn_fin st_attn_finish(float m, float l, bool merge, float lse_old) {
    /* (__fdividef: ~2 ulp, no call to the IEEE division's slow path, which
     * costs the kernels registers; l >= 1 (the row's largest term is 1) and
     * a + b is in [1, 2], far from its range limits) */
    const float lp = (m + log2f(l)) * ST_ATTN_LN2;
    attn_fin f;
    if (!merge) {
        f.wa = 0.0f, f.wb = __fdividef(1.0f, l), f.lse = lp;
        return f;
    }
    const float M = fmaxf(lse_old, lp);
    const float a = expf(lse_old - M), b = expf(lp - M), inv = __fdividef(1.0f, a + b);
    f.wa = a * inv, f.wb = __fdividef(b * inv, l), f.lse = M + logf(a + b);
    return f;
}

/* One row's result from a tensor-core kernel's accumulator fragments: lane
 * t4 (of 4 sharing the row) holds columns 8 dt + 2 t4 + {0, 1} of the row in
 * acc[dt][h], acc[dt][h + 1]. Row orow of rows (n H): o.out scaled by 1 / l
 * when unsplit, else the unnormalized partials of split `split` and, from
 * lane t4 = 0, the row's (m, l). PART (attention_part), unsplit, o.lse not
 * NULL: also the row's lse (lane t4 = 0), and with o.merge the merge into
 * (out, lse) (st_attn_finish; the 4 lanes read the old lse before lane 0
 * writes the new one: the quad must call this together, as its lanes share
 * the row). */
template <int HD, bool PART = false>
ST_DEV void st_attn_store_row(const attn_out &o, int split, int64_t rows, int64_t orow, int t4,
                              const float (*acc)[4], int h, float m, float l) {
    if (o.nsplit == 1) {
        float *dst = o.out + orow * HD + 2 * t4;
        if (PART && o.lse) {
            const attn_fin f = st_attn_finish(m, l, o.merge, o.merge ? o.lse[orow] : 0.0f);
            __syncwarp(0xfu << (threadIdx.x & 28)); /* the quad's reads of lse[orow] are done */
            if (t4 == 0) o.lse[orow] = f.lse;
            if (o.merge) {
#pragma unroll
                for (int dt = 0; dt < HD / 8; dt++) {
                    const float2 x = *(const float2 *)(dst + dt * 8);
                    *(float2 *)(dst + dt * 8) =
                        make_float2(fmaf(x.x, f.wa, acc[dt][h] * f.wb), fmaf(x.y, f.wa, acc[dt][h + 1] * f.wb));
                }
                return;
            }
        }
        const float inv = 1.0f / l;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++)
            *(float2 *)(dst + dt * 8) = make_float2(acc[dt][h] * inv, acc[dt][h + 1] * inv);
    } else {
        float *dst = o.part_acc + ((size_t)split * rows + orow) * HD + 2 * t4;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) *(float2 *)(dst + dt * 8) = make_float2(acc[dt][h], acc[dt][h + 1]);
        if (t4 == 0) {
            o.part_m[split * rows + orow] = m;
            o.part_l[split * rows + orow] = l;
        }
    }
}

/* The keys [*b, *e) split `split` of `nsplit` covers for rows whose largest
 * position is maxpos: the range [0, min(n_kv, maxpos + 1)) cut into nsplit
 * pieces of a multiple of `tile` keys (the last ones may be empty). Derived
 * on the device from the positions, so the host's n_kv is only an upper
 * bound: a recorded decode step (n_kv = the cache's capacity) spreads the
 * keys it actually has over all its splits, whatever the sequence length. */
ST_DEV void split_range(int64_t n_kv, int maxpos, int nsplit, int split, int tile, int64_t *b, int64_t *e) {
    const int64_t total = min(n_kv, (int64_t)maxpos + 1);
    int64_t len = (total + nsplit - 1) / nsplit;
    len = (len + tile - 1) / tile * tile;
    *b = (int64_t)split * len;
    *e = min(total, *b + len);
}

/* ---- bf16 tensor-core helpers (the prefill kernels) -------------------------------------
 * mma_bf16: c += a b, m16n8k16, A row-major 16x16 (a[0]: row g, cols 2t..2t+1;
 * a[1]: row g+8, same cols; a[2], a[3]: the same rows, cols 8+2t..), B
 * column-major 16x8 (b0: rows 2t..2t+1 of column g; b1: rows 8+2t..), C
 * 16x8 fp32 (c[0..1]: row g, cols 2t..2t+1; c[2..3]: row g+8), with
 * g = lane / 4, t = lane % 4 (PTX ISA, mma.m16n8k16). ldmatrix_x4: lanes
 * 8i..8i+7 give the row addresses of 8x8 matrix i (16 bytes each); register
 * i of every lane receives matrix i's row lane/4, cols 2 (lane%4)..+1 (the
 * fragment layout above); .trans gives its column lane/4, rows 2 (lane%4)..+1. */
ST_DEV uint32_t pack_bf16x2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b); /* a in the low half */
    return *(const uint32_t *)&h;
}

ST_DEV void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

ST_DEV void ldmatrix_x4_trans(uint32_t r[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

ST_DEV void ldmatrix_x4(uint32_t r[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* ---- the fp32 SIMT tile of the decode kernels ------------------------------------------
 * 128 threads (4 warps), up to RMAX rows, one tile of TK = 32 keys staged in
 * shared memory: k_s [TK][HD + 4] (padded), v_s [TK][HD]; q_s [RMAX][HD]
 * (pre-scaled). Scores: lane j scores key kb + j against rows warp, warp + 4,
 * ...; visible(r, key) says whether row r sees the key (else -inf). The warp
 * does the softmax update of its rows (m_r, l_r: rows warp + 4 i), writes p
 * to p_s [RMAX][TK] and alpha to alpha_s [RMAX]; after a barrier, thread tid
 * owns column tid % HD of rows tid / HD, tid / HD + 128 / HD, ... (acc).
 * Ends after the PV product without a barrier: the caller synchronizes before
 * the tile's buffers or p_s are written again. Rows >= R are left alone. */
template <int HD, int RMAX, typename Visible>
ST_DEV void st_attn_simt_tile(const float *q_s, const float *k_s, const float *v_s, float *p_s, float *alpha_s,
                              int R, int64_t kb, Visible visible, float *m_r, float *l_r, float *acc) {
    constexpr int TK = 32;
    constexpr int KP = HD + 4;
    constexpr int RPW = RMAX / 4;  /* rows per warp in the score phase */
    constexpr int CG = 128 / HD;   /* thread groups per column (1 or 2) */
    constexpr int RPT = RMAX / CG; /* rows per thread in the PV phase */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
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
    const int64_t key = kb + lane;
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp + 4 * i;
        if (r < R) { /* warp-uniform */
            const float sv = visible(r, key) ? s[i] : -INFINITY;
            const float mnew = fmaxf(m_r[i], st_warp_max(sv));
            const float base = mnew == -INFINITY ? 0.0f : mnew;
            const float p = exp2f(sv - base);
            const float alpha = exp2f(m_r[i] - base);
            l_r[i] = l_r[i] * alpha + st_warp_sum(p);
            m_r[i] = mnew;
            p_s[r * TK + lane] = p;
            if (lane == 0) alpha_s[r] = alpha;
        }
    }
    __syncthreads();
    const int dcol = tid % HD, rg = tid / HD;
#pragma unroll
    for (int i = 0; i < RPT; i++) {
        const int r = rg + CG * i;
        if (r < R) acc[i] *= alpha_s[r];
    }
#pragma unroll 2
    for (int j4 = 0; j4 < TK / 4; j4++) {
        const float v0 = v_s[(4 * j4 + 0) * HD + dcol], v1 = v_s[(4 * j4 + 1) * HD + dcol];
        const float v2 = v_s[(4 * j4 + 2) * HD + dcol], v3 = v_s[(4 * j4 + 3) * HD + dcol];
#pragma unroll
        for (int i = 0; i < RPT; i++) {
            const int r = rg + CG * i;
            if (r < R) {
                const float4 p = *(const float4 *)(p_s + r * TK + 4 * j4);
                acc[i] = fmaf(p.x, v0, fmaf(p.y, v1, fmaf(p.z, v2, fmaf(p.w, v3, acc[i]))));
            }
        }
    }
}

/* ---- merge of split-KV partials (the new kernels' merge) --------------------------------
 * One block of 128 threads merges the ns partial results of one row:
 * part_m/part_l [sp * stride + row], part_acc [(sp * stride + row) * HD + d];
 * dst[d] = sum_sp 2^(m_sp - M) acc_sp[d] / sum_sp 2^(m_sp - M) l_sp with
 * M = max m_sp (a part with m = -inf counts 0). All threads of the block
 * must call it (it synchronizes). Every sum runs in an order fixed by ns
 * alone (thread strides, then a fixed tree), so the bits depend only on the
 * row's own partials: deterministic and batch-invariant. Loads of the
 * partials are spread over the threads (the previous merge walked every
 * split serially in each thread). attention_part: lse (not NULL) gets the
 * row's natural-log log-sum-exp, (base + log2 L) ln 2; with merge, (dst,
 * lse) hold the result over earlier keys and the row's is merged into them
 * (st_attn_finish). */
template <int HD>
ST_DEV void st_attn_merge_row(const float *__restrict__ part_acc, const float *__restrict__ part_m,
                              const float *__restrict__ part_l, int64_t stride, int64_t row, int ns,
                              float *__restrict__ dst, float *__restrict__ lse = nullptr, bool merge = false) {
    constexpr int D4 = HD / 4;      /* float4 columns */
    constexpr int SG = 128 / D4;    /* split groups (4 for hd 128, 8 for hd 64) */
    __shared__ float red[32];
    __shared__ __align__(16) float4 part_s[SG][D4];
    const int tid = threadIdx.x;
    /* (read before the barriers below: thread 0 writes the new lse at the end) */
    const float lse_old = lse && merge ? *lse : 0.0f;
    float mx = -INFINITY;
    for (int sp = tid; sp < ns; sp += 128) mx = fmaxf(mx, part_m[sp * stride + row]);
    const float M = st_block_max(mx, red);
    const float base = M == -INFINITY ? 0.0f : M;
    float ls = 0.0f;
    for (int sp = tid; sp < ns; sp += 128) {
        const float m = part_m[sp * stride + row];
        if (m != -INFINITY) ls = __fadd_rn(ls, __fmul_rn(exp2f(__fsub_rn(m, base)), part_l[sp * stride + row]));
    }
    const float L = st_block_sum(ls, red);
    const int d4 = tid % D4, sg = tid / D4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int sp = sg; sp < ns; sp += SG) {
        const float m = part_m[sp * stride + row];
        const float4 x = *((const float4 *)(part_acc + ((size_t)sp * stride + row) * HD) + d4);
        const float w = m != -INFINITY ? exp2f(__fsub_rn(m, base)) : 0.0f;
        a.x = fmaf(w, x.x, a.x), a.y = fmaf(w, x.y, a.y), a.z = fmaf(w, x.z, a.z), a.w = fmaf(w, x.w, a.w);
    }
    part_s[sg][d4] = a;
    __syncthreads();
    if (tid < D4) {
        float4 o = part_s[0][tid];
#pragma unroll
        for (int g = 1; g < SG; g++) {
            const float4 y = part_s[g][tid];
            o.x = __fadd_rn(o.x, y.x), o.y = __fadd_rn(o.y, y.y), o.z = __fadd_rn(o.z, y.z), o.w = __fadd_rn(o.w, y.w);
        }
        float *d = dst + 4 * tid; /* scalar stores: dst needs no alignment */
        if (lse && merge) { /* (acc, m, l) = (o, base, L): merged into (dst, lse) */
            const attn_fin f = st_attn_finish(base, L, true, lse_old);
            d[0] = fmaf(d[0], f.wa, o.x * f.wb), d[1] = fmaf(d[1], f.wa, o.y * f.wb);
            d[2] = fmaf(d[2], f.wa, o.z * f.wb), d[3] = fmaf(d[3], f.wa, o.w * f.wb);
            if (tid == 0) *lse = f.lse;
        } else {
            d[0] = __fdiv_rn(o.x, L), d[1] = __fdiv_rn(o.y, L), d[2] = __fdiv_rn(o.z, L), d[3] = __fdiv_rn(o.w, L);
            if (lse && tid == 0) *lse = (base + log2f(L)) * ST_ATTN_LN2;
        }
    }
}

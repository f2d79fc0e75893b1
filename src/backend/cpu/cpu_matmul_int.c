/* CPU matmul of the quantized dtypes with integer dot products: the activations
 * laid out and the level picked at run time; the arithmetic and the kernels are
 * in cpu_qi.h, each level's instantiations in cpu_qi_<level>.c. */
#include "backend/cpu/cpu_qi.h"

/* The int8 path of st_cpu_matmul_int (m set up but for the activations). */
static strata_status matmul_a8(st_cpu *c, const float *x, qi_ctx *m) {
    const int64_t n = m->n, K = m->L.K, nb = m->L.nb;
    m->L.stride = a8_stride(K);
#if ST_CPU_HAVE_AVX2_PATH
    /* a few tokens on AVX-512: 16 rows x all tokens straight from the weights (W16) */
    if (c->isa == ST_CPU_ISA_AVX512 && c->w16_min > 0 && n >= c->w16_min && n <= QI_STREAM && w16_dtype(m->dtype)) {
        const size_t tok_bytes = m->L.stride * (size_t)n;
        strata_status st = st_cpu_qact_reserve(c, tok_bytes + (size_t)(n * nb) * sizeof(int32_t));
        if (st != STRATA_OK) return st;
        m->q = c->qact;
        qa8_ctx qa = {.x = x, .q = c->qact, .grp = NULL, .K = K, .nb = nb, .stride = m->L.stride};
        const int64_t qgrain = K < 16384 ? 16384 / K : 1; /* ~16K elements per chunk, as below */
        if (n <= qgrain)
            st_qa8_fn_avx2(&qa, 0, n, 0);
        else
            st_pool_parallel_for(c->pool, n, qgrain, st_qa8_fn_avx2, &qa);
        const int off = m->dtype == ST_DTYPE_Q8_0 ? 128 : off8(m->dtype);
        int32_t *corr = (int32_t *)((uint8_t *)c->qact + tok_bytes);
        for (int64_t tk = 0; tk < n; tk++) {
            const int32_t *hs = (const int32_t *)((const uint8_t *)c->qact + (size_t)tk * m->L.stride + K +
                                                  2 * (size_t)nb * sizeof(float));
            for (int64_t b = 0; b < nb; b++) corr[tk * nb + b] = -off * (hs[2 * b] + hs[2 * b + 1]);
        }
        m->corr = corr;
        for (int i = 0; i < m->nw; i++) m->rb0[i + 1] = m->rb0[i] + (m->Ns[i] + W16_ROWS - 1) / W16_ROWS;
        for (int i = m->nw; i < QI_MULTI; i++) m->rb0[i + 1] = m->rb0[m->nw];
        m->n_rb = m->rb0[m->nw];
        int64_t grain = 65536 / (W16_ROWS * K * n);
        if (grain < 1) grain = 1;
        st_pool_parallel_for(c->pool, m->n_rb, grain, st_qi8_fn_w16, m);
        return STRATA_OK;
    }
#endif
    /* the token-group layout, for the AVX-512 or AMX group kernels past QI_STREAM_GROUPED tokens */
    const bool grouped = (c->isa == ST_CPU_ISA_AVX512 || c->amx != ST_CPU_AMX_OFF) && n > QI_STREAM_GROUPED;
    const int64_t n_groups = (n + QI_GROUP - 1) / QI_GROUP;
    const size_t tok_bytes = m->L.stride * (size_t)n;
    strata_status st = st_cpu_qact_reserve(c, tok_bytes + (grouped ? a8_group_stride(nb) * (size_t)n_groups : 0));
    if (st == STRATA_OK) st = st_cpu_scratch_reserve(c, (size_t)(18 * QI_ROWS * m->nu));
    if (st != STRATA_OK) return st;
    m->q = c->qact;
    m->grp = grouped ? (const uint8_t *)c->qact + tok_bytes : NULL;
    m->scratch = c->scratch;

    st_pool_fn qa_fn = st_qa8_fn_portable, qi_fn = st_qi8_fn_portable;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->isa >= ST_CPU_ISA_AVX2) qa_fn = st_qa8_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVX2) qi_fn = st_qi8_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVXVNNI) qi_fn = st_qi8_fn_avxvnni;
    if (c->isa == ST_CPU_ISA_AVX512) qi_fn = st_qi8_fn_avx512;
    if (grouped && c->amx == ST_CPU_AMX_ON) qi_fn = st_qi8_fn_amx;
#endif
    if (grouped && c->amx == ST_CPU_AMX_EMULATED) qi_fn = st_qi8_fn_amxemu;
    qa8_ctx qa = {.x = x, .q = c->qact, .grp = (uint8_t *)m->grp, .K = K, .nb = nb, .stride = m->L.stride};
    if (grouped) memset(qa.grp + a8_group_stride(nb) * (size_t)(n_groups - 1), 0, a8_group_stride(nb));
    int64_t qgrain = 16384 / K;
    if (qgrain < 1) qgrain = 1;
    if (n <= qgrain)
        qa_fn(&qa, 0, n, 0);
    else
        st_pool_parallel_for(c->pool, n, qgrain, qa_fn, &qa);

    const bool amx = grouped && c->amx != ST_CPU_AMX_OFF;
    int64_t tile_max = (amx ? A8_AMX_TILE_BYTES : QI_TILE_BYTES) / (int64_t)m->L.stride;
    if (tile_max < 1) tile_max = 1;
    if (tile_max > (amx ? A8_AMX_TILE_MAX : QI_TILE_MAX)) tile_max = amx ? A8_AMX_TILE_MAX : QI_TILE_MAX;
    if (!grouped && n <= QI_STREAM) tile_max = n; /* dot_tokens8: the weights read once for all of them */
    int64_t n_tiles = (n + tile_max - 1) / tile_max;
    m->tile = (n + n_tiles - 1) / n_tiles;
    if (grouped) {
        m->tile = (m->tile + QI_GROUP - 1) / QI_GROUP * QI_GROUP;
        n_tiles = (n + m->tile - 1) / m->tile;
    }
    const int64_t macs = QI_ROWS * K * m->tile;
    int64_t grain = 65536 / macs;
    if (grain < 1) grain = 1;
    st_pool_parallel_for(c->pool, n_tiles * m->n_rb, grain, qi_fn, m);
    return STRATA_OK;
}

strata_status st_cpu_matmul_int(st_cpu *c, const float *x, const st_weight *w, int count, int64_t n,
                                float *const *y) {
    ST_ASSERT(count >= 1 && count <= QI_MULTI);
    const int64_t K = w->cols;
    qi_ctx m = {
        .nw = count, .dtype = w->dtype, .row_bytes = st_weight_stride(w),
        .L = {.K = K, .nb = K / 32},
        .n = n,
        .nu = w->dtype == ST_DTYPE_Q6_K ? K / 16 : K / 32,
    };
    for (int i = 0; i < count; i++) {
        ST_ASSERT(w[i].dtype == w->dtype && w[i].cols == K && st_weight_stride(&w[i]) == m.row_bytes);
        m.w[i] = w[i].data, m.ys[i] = y[i], m.Ns[i] = w[i].rows;
        m.rb0[i + 1] = m.rb0[i] + (w[i].rows + QI_ROWS - 1) / QI_ROWS;
    }
    for (int i = count; i < QI_MULTI; i++) m.rb0[i + 1] = m.rb0[count];
    m.n_rb = m.rb0[count];
    if (n == 0 || m.n_rb == 0) return STRATA_OK;
    if (c->act8) return matmul_a8(c, x, &m);
    m.L.stride = (2 * (size_t)K * sizeof(int16_t) + 2 * (size_t)m.L.nb * sizeof(float) + 63) & ~(size_t)63;

    const bool grouped = c->isa == ST_CPU_ISA_AVX512 && n > QI_STREAM; /* fewer: dot_tokens */
    const int64_t n_groups = (n + QI_GROUP - 1) / QI_GROUP;
    const size_t tok_bytes = m.L.stride * (size_t)n;
    strata_status st = st_cpu_qact_reserve(c, tok_bytes + (grouped ? group_stride(m.L.nb) * (size_t)n_groups : 0));
    if (st == STRATA_OK) st = st_cpu_scratch_reserve(c, (size_t)(18 * QI_ROWS * m.nu));
    if (st != STRATA_OK) return st;
    m.q = c->qact;
    m.grp = grouped ? (const uint8_t *)c->qact + tok_bytes : NULL;
    m.scratch = c->scratch;

    st_pool_fn qa_fn = st_qa_fn_portable, qi_fn = st_qi_fn_portable;
#if ST_CPU_HAVE_AVX2_PATH
    if (c->isa >= ST_CPU_ISA_AVX2) qa_fn = st_qa_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVX2 || c->isa == ST_CPU_ISA_AVXVNNI) qi_fn = st_qi_fn_avx2;
    if (c->isa == ST_CPU_ISA_AVX512) qi_fn = st_qi_fn_avx512;
#endif
    /* quantize the activations: ~16K elements per chunk */
    qa_ctx qa = {.x = x, .q = c->qact, .grp = (uint8_t *)m.grp, .L = m.L,
                 .qmax = w->dtype == ST_DTYPE_Q8_0 ? QI_QMAX_Q8 : QI_QMAX};
    if (grouped) /* the last group's lanes past n stay zero */
        memset(qa.grp + group_stride(m.L.nb) * (size_t)(n_groups - 1), 0, group_stride(m.L.nb));
    int64_t qgrain = 16384 / K;
    if (qgrain < 1) qgrain = 1;
    if (n <= qgrain)
        qa_fn(&qa, 0, n, 0);
    else
        st_pool_parallel_for(c->pool, n, qgrain, qa_fn, &qa);

    int64_t tile_max = QI_TILE_BYTES / (int64_t)m.L.stride;
    if (tile_max < 1) tile_max = 1;
    if (tile_max > QI_TILE_MAX) tile_max = QI_TILE_MAX;
    if (!grouped && n <= QI_STREAM) tile_max = n; /* dot_tokens: the weights read once for all of them */
    int64_t n_tiles = (n + tile_max - 1) / tile_max;
    m.tile = (n + n_tiles - 1) / n_tiles; /* balanced tiles */
    if (grouped) { /* whole groups */
        m.tile = (m.tile + QI_GROUP - 1) / QI_GROUP * QI_GROUP;
        n_tiles = (n + m.tile - 1) / m.tile;
    }
    /* At least ~64K multiply-adds per chunk, so tiny products stay on one thread. */
    const int64_t macs = QI_ROWS * K * m.tile;
    int64_t grain = 65536 / macs;
    if (grain < 1) grain = 1;
    st_pool_parallel_for(c->pool, n_tiles * m.n_rb, grain, qi_fn, &m);
    return STRATA_OK;
}

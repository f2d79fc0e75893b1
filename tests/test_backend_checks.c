/* The validating layer every backend's ops go through (backend.h: "Argument
 * checks", backend.c): each checked entry rejects bad arguments with
 * STRATA_ERR_INVALID_ARG and a message naming the backend, the op and the bad
 * parameter, without reaching the device; n = 0 returns STRATA_OK without
 * reaching the device; valid calls do reach it; the other entries are the
 * device's own. Runs on the CPU backend, and on the CUDA backend too where a
 * GPU is present (no kernel is launched on bad arguments; the valid calls
 * checked here use device memory). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "testutil.h"

/* ---- a spy between the wrapper and the device: counts the calls that reach it ---- */

static const st_backend_ops *g_real;
static st_backend_ops g_spy;
static int g_reached;

static strata_status spy_matmul(st_backend *be, st_stream *s, const float *x, const st_weight *w, int64_t n,
                                float *y) {
    g_reached++;
    return g_real->matmul(be, s, x, w, n, y);
}
static strata_status spy_add(st_backend *be, st_stream *s, float *x, const float *y, int64_t n) {
    g_reached++;
    return g_real->add(be, s, x, y, n);
}
static strata_status spy_sample(st_backend *be, st_stream *s, const float *logits, int64_t n, int64_t vocab,
                                const st_sample_args *args, int32_t *out) {
    g_reached++;
    return g_real->sample(be, s, logits, n, vocab, args, out);
}
static strata_status spy_copy_h2d(st_backend *be, st_stream *s, void *dst, const void *src, size_t n) {
    g_reached++;
    return g_real->copy_h2d(be, s, dst, src, n);
}
static strata_status spy_kv_store_paged(st_backend *be, st_stream *s, const st_kv_layer *cache, const float *k,
                                        const float *v, const int64_t *slots, int64_t n) {
    g_reached++;
    return g_real->kv_store_paged(be, s, cache, k, v, slots, n);
}
static strata_status spy_attention_paged(st_backend *be, st_stream *s, const float *q, const st_paged_kv *kv,
                                         const int32_t *seq, const int32_t *pos, int64_t n, int64_t n_heads,
                                         int64_t n_kv_heads, int64_t head_dim, float scale, float *out) {
    g_reached++;
    return g_real->attention_paged(be, s, q, kv, seq, pos, n, n_heads, n_kv_heads, head_dim, scale, out);
}

/* `call` fails with INVALID_ARG, its message holds `p` (the backend's name),
 * `op` and `what`, and the device was not reached */
#define BAD(be, call, op, what)                                                              \
    do {                                                                                     \
        char full_[64];                                                                      \
        snprintf(full_, sizeof full_, "%s %s:", (be)->ops->name, op);                        \
        g_reached = 0;                                                                       \
        CHECK_ERR((call), STRATA_ERR_INVALID_ARG, full_, what);                              \
        CHECK_MSG(g_reached == 0, "%s: the device was reached", full_);                      \
    } while (0)

static void check_backend(st_backend *be) {
    const char *name = be->ops->name;
    const bool cuda = be->kind == ST_BACKEND_CUDA;
    fprintf(stderr, "backend %s\n", name);

    /* the wrapper: its own table, the device's name and pass-through entries */
    CHECK(be->ops == &be->checked && be->dev_ops && be->dev_ops != be->ops);
    CHECK(strcmp(be->ops->name, be->dev_ops->name) == 0);
    CHECK(be->ops->destroy == be->dev_ops->destroy && be->ops->dealloc == be->dev_ops->dealloc &&
          be->ops->graph_begin == be->dev_ops->graph_begin && be->ops->stream_sync == be->dev_ops->stream_sync);
    CHECK(be->ops->matmul != be->dev_ops->matmul && be->ops->alloc != be->dev_ops->alloc);

    g_real = be->dev_ops;
    g_spy = *g_real;
    g_spy.matmul = spy_matmul;
    g_spy.add = spy_add;
    g_spy.sample = spy_sample;
    g_spy.copy_h2d = spy_copy_h2d;
    g_spy.attention_paged = spy_attention_paged;
    g_spy.kv_store_paged = spy_kv_store_paged;
    be->dev_ops = &g_spy;

    /* device buffers: x [2, 8], y [2, 8], a weight [8, 8] f32, ints */
    float *buf = NULL;
    CHECK(be->ops->alloc(be, 4096, (void **)&buf) == STRATA_OK && buf);
    if (!buf) {
        be->dev_ops = g_real;
        return;
    }
    float *x = buf, *y = buf + 64, *o = buf + 128, *wd = buf + 256; /* wd: 64 floats, 16-byte aligned */
    int32_t *ids = (int32_t *)(buf + 512);
    int64_t *slots = (int64_t *)(buf + 576);
    st_sample_args *args = (st_sample_args *)(buf + 640);
    const st_weight w = {wd, ST_DTYPE_F32, 8, 8, 0};
    const st_weight w16 = {wd, ST_DTYPE_BF16, 8, 8, 0};
    const st_weight wn = {wd, ST_DTYPE_F32, 1, 8, 0};

    /* memory, streams, events */
    BAD(be, be->ops->alloc(be, 16, NULL), "alloc", "out is NULL");
    BAD(be, be->ops->host_alloc(be, 16, NULL), "host_alloc", "out is NULL");
    void *dv = NULL;
    bool owned = false;
    BAD(be, be->ops->upload(be, x, 16, NULL, &owned), "upload", "NULL out parameter");
    BAD(be, be->ops->upload(be, NULL, 16, &dv, &owned), "upload", "host is NULL");
    BAD(be, be->ops->copy_h2d(be, NULL, NULL, x, 16), "copy_h2d", "dst is NULL");
    BAD(be, be->ops->copy_d2h(be, NULL, x, NULL, 16), "copy_d2h", "src is NULL");
    BAD(be, be->ops->copy_d2d(be, NULL, NULL, x, 16), "copy_d2d", "dst is NULL");
    g_reached = 0;
    CHECK(be->ops->copy_h2d(be, NULL, NULL, NULL, 0) == STRATA_OK && g_reached == 0);
    BAD(be, be->ops->stream_create(be, false, NULL), "stream_create", "out is NULL");
    BAD(be, be->ops->event_create(be, NULL), "event_create", "out is NULL");
    BAD(be, be->ops->event_record(be, NULL, NULL), "event_record", "event is NULL");
    BAD(be, be->ops->stream_wait_event(be, NULL, NULL), "stream_wait_event", "event is NULL");
    BAD(be, be->ops->event_sync(be, NULL), "event_sync", "event is NULL");

    /* ops: shapes, weights, pointers */
    BAD(be, be->ops->get_rows(be, NULL, &w, ids, -1, o), "get_rows", "n = -1");
    BAD(be, be->ops->get_rows(be, NULL, NULL, ids, 1, o), "get_rows", "weight is NULL");
    BAD(be, be->ops->get_rows(be, NULL, &w, NULL, 1, o), "get_rows", "ids is NULL");
    BAD(be, be->ops->rmsnorm(be, NULL, x, NULL, &w, 1e-5f, 1, 8, o), "rmsnorm", "expected [1, 8]");
    BAD(be, be->ops->rmsnorm(be, NULL, x, NULL, &wn, 1e-5f, 1, 0, o), "rmsnorm", "d = 0");
    BAD(be, be->ops->rmsnorm(be, NULL, NULL, NULL, &wn, 1e-5f, 1, 8, o), "rmsnorm", "x is NULL");
    BAD(be, be->ops->matmul(be, NULL, NULL, &w, 1, y), "matmul", "x is NULL");
    BAD(be, be->ops->matmul(be, NULL, x, &w, 1, NULL), "matmul", "y is NULL");
    BAD(be, be->ops->matmul(be, NULL, x, &w, -2, y), "matmul", "n = -2");
    BAD(be, be->ops->matmul(be, NULL, x, &w, 2, x + 4), "matmul", "overlaps");
    const st_weight wbad = {wd, ST_DTYPE_F32, 0, 8, 0};
    BAD(be, be->ops->matmul(be, NULL, x, &wbad, 1, y), "matmul", "empty");
    const st_weight wnull = {NULL, ST_DTYPE_F32, 8, 8, 0};
    BAD(be, be->ops->matmul(be, NULL, x, &wnull, 1, y), "matmul", "weight data is NULL");
    BAD(be, be->ops->rope(be, NULL, x, ids, 1, 2, 3, y, false), "rope", "even");
    BAD(be, be->ops->rope(be, NULL, x, NULL, 1, 2, 4, y, false), "rope", "pos is NULL");
    BAD(be, be->ops->attention(be, NULL, x, x, x, ids, 1, 4, 6, 4, 2, 0.5f, o), "attention", "multiple of n_kv_heads");
    BAD(be, be->ops->attention(be, NULL, x, x, x, ids, 1, 0, 2, 1, 2, 0.5f, o), "attention", "no cached keys");
    BAD(be, be->ops->attention(be, NULL, x, x, NULL, ids, 1, 4, 2, 1, 2, 0.5f, o), "attention", "v is NULL");
    BAD(be, be->ops->swiglu(be, NULL, NULL, y, 4, o), "swiglu", "gate is NULL");
    BAD(be, be->ops->swiglu(be, NULL, x, y, -1, o), "swiglu", "n = -1");
    BAD(be, be->ops->add(be, NULL, x, NULL, 4), "add", "y is NULL");
    BAD(be, be->ops->add(be, NULL, x, y, -3), "add", "n = -3");
    BAD(be, be->ops->argmax(be, NULL, x, 1, (int64_t)INT32_MAX + 1, ids), "argmax", "cols = 2147483648");
    BAD(be, be->ops->argmax(be, NULL, x, 1, 8, NULL), "argmax", "out is NULL");
    float *ys[4] = {y, NULL, o, o};
    const st_weight wm[2] = {w, w};
    BAD(be, be->ops->matmul_multi(be, NULL, x, wm, 5, 1, ys), "matmul_multi", "count = 5");
    BAD(be, be->ops->matmul_multi(be, NULL, x, wm, 2, 1, ys), "matmul_multi", "y[1] is NULL");
    const st_weight wm2[2] = {w, {wd, ST_DTYPE_F32, 8, 4, 0}};
    BAD(be, be->ops->matmul_multi(be, NULL, x, wm2, 2, 1, ys), "matmul_multi", "weight 1 has");
    float *ys_ov[2] = {y, x + 2};
    BAD(be, be->ops->matmul_multi(be, NULL, x, wm, 2, 1, ys_ov), "matmul_multi", "y[1] overlaps");
    BAD(be, be->ops->matmul_swiglu(be, NULL, x, &w, &w16, 1, o, NULL), "matmul_swiglu", "gate is");
    BAD(be, be->ops->matmul_swiglu(be, NULL, x, &w, &wn, 1, o, NULL), "matmul_swiglu", "gate is");
    BAD(be, be->ops->matmul_swiglu(be, NULL, x, &w, &w, 1, x, NULL), "matmul_swiglu", "out overlaps");
    BAD(be, be->ops->matmul_swiglu(be, NULL, x, &w, &w, 1, o, x + 1), "matmul_swiglu", "work overlaps x or out");
    /* rmsnorm_matmul: the norm's checks, then the matmul's (reading out), its cols against d */
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &w, 1e-5f, 1, 8, o, wm, 2, NULL, ys), "rmsnorm_matmul",
        "expected [1, 8]");
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, wm, 2, &w, ys), "rmsnorm_matmul",
        "count = 2 with up");
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, wm, 2, NULL, ys), "rmsnorm_matmul",
        "y[1] is NULL");
    float *ys_out[2] = {y, o + 2};
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, wm, 2, NULL, ys_out), "rmsnorm_matmul",
        "y[1] overlaps");
    const st_weight w4 = {wd, ST_DTYPE_F32, 8, 4, 0};
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, &w4, 1, NULL, ys), "rmsnorm_matmul",
        "has 4 cols");
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, &w, 1, &w16, ys), "rmsnorm_matmul",
        "gate is");
    BAD(be, be->ops->rmsnorm_matmul(be, NULL, x, NULL, &wn, 1e-5f, 1, 8, o, &w, 1, &w, NULL), "rmsnorm_matmul",
        "y is NULL");
    /* paged KV: one layer of 8 slots x 1 kv head x 2 dims (f32: o, 16 floats; the
     * fp8 scales in y) */
    const st_kv_layer L = {.k = o, .v = o + 16, .dtype = ST_KV_F32, .n_slots = 8, .n_kv_heads = 1, .head_dim = 2};
    st_kv_layer Lb = L;
    BAD(be, be->ops->kv_store_paged(be, NULL, &L, x, y, NULL, 1), "kv_store_paged", "slots is NULL");
    BAD(be, be->ops->kv_store_paged(be, NULL, &L, NULL, y, slots, 1), "kv_store_paged", "k is NULL");
    BAD(be, be->ops->kv_store_paged(be, NULL, &L, x, NULL, slots, 1), "kv_store_paged", "v is NULL");
    BAD(be, be->ops->kv_store_paged(be, NULL, &L, x, y, slots, -1), "kv_store_paged", "n = -1");
    BAD(be, be->ops->kv_store_paged(be, NULL, NULL, x, y, slots, 1), "kv_store_paged", "cache) is NULL");
    /* rope_kv_store: kv_store_paged's checks, head_dim against the cache's, rope's for q and for k */
    BAD(be, be->ops->rope_kv_store(be, NULL, x, y, o, ids, 1, 2, 2, wd, false, &L, NULL), "rope_kv_store",
        "slots is NULL");
    BAD(be, be->ops->rope_kv_store(be, NULL, x, NULL, o, ids, 1, 2, 2, wd, false, &L, slots), "rope_kv_store",
        "k is NULL");
    BAD(be, be->ops->rope_kv_store(be, NULL, x, y, o, ids, 1, 2, 4, wd, false, &L, slots), "rope_kv_store",
        "head_dim = 4, the cache's 2");
    BAD(be, be->ops->rope_kv_store(be, NULL, NULL, y, o, ids, 1, 2, 2, wd, false, &L, slots), "rope_kv_store",
        "q is NULL");
    BAD(be, be->ops->rope_kv_store(be, NULL, x, y, o, NULL, 1, 2, 2, wd, false, &L, slots), "rope_kv_store",
        "pos is NULL");
    BAD(be, be->ops->rope_kv_store(be, NULL, x, y, o, ids, 1, 0, 2, wd, false, &L, slots), "rope_kv_store",
        "n_heads = 0");
    BAD(be, be->ops->rope_kv_store(be, NULL, x, y, o, ids, 1, 2, 2, NULL, false, &L, slots), "rope_kv_store",
        "inv_freq is NULL");
    Lb.dtype = (st_kv_dtype)7;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.dtype = 7");
    Lb = L, Lb.k = NULL;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.k is NULL");
    Lb = L, Lb.v = NULL;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.v is NULL");
    Lb = L, Lb.dtype = ST_KV_FP8; /* no scales */
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.k_scale is NULL");
    Lb.k_scale = y;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.v_scale is NULL");
    Lb = L, Lb.n_slots = 0;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.n_slots = 0");
    Lb = L, Lb.head_dim = 0;
    BAD(be, be->ops->kv_store_paged(be, NULL, &Lb, x, y, slots, 1), "kv_store_paged", "cache.head_dim = 0");
    BAD(be, be->ops->attention_paged(be, NULL, x, NULL, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "description is NULL");
    st_paged_kv kv = {.cache = L, .block_size = 4, .block_tables = ids, .max_blocks = 2, .ctx_lens = ids,
                      .n_seqs = 1, .max_ctx = 8};
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 3, 2, 2, 0.5f, o), "attention_paged",
        "multiple of n_kv_heads");
    /* the cache's shape against the op's */
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 2, 2, 0.5f, o), "attention_paged",
        "cache.n_kv_heads = 1, cache.head_dim = 2 differ from the op's n_kv_heads = 2, head_dim = 2");
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 4, 0.5f, o), "attention_paged",
        "differ from the op's n_kv_heads = 1, head_dim = 4");
    kv.cache.dtype = (st_kv_dtype)-1;
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "cache.dtype = -1");
    kv.cache = L, kv.cache.v = NULL;
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "cache.v is NULL");
    kv.cache = L, kv.cache.dtype = ST_KV_FP8, kv.cache.k_scale = y;
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "cache.v_scale is NULL");
    kv.cache = L, kv.block_tables = NULL;
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "block_tables is NULL");
    kv.block_tables = ids;
    kv.cache.n_slots = 7;
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "cache.n_slots = 7 must be a positive multiple of block_size");
    kv.cache.n_slots = 8;
    kv.batch_seqs = 2; /* more sequences in the call than the table holds */
    BAD(be, be->ops->attention_paged(be, NULL, x, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "batch_seqs = 2");
    kv.batch_seqs = 0;
    BAD(be, be->ops->attention_paged(be, NULL, NULL, &kv, ids, ids, 1, 2, 1, 2, 0.5f, o), "attention_paged",
        "q is NULL");
    /* a valid fp8 store reaches the device: the scales are ignored for the other types */
    {
        const int64_t hslot = 3;
        CHECK(be->ops->copy_h2d(be, NULL, slots, &hslot, sizeof hslot) == STRATA_OK);
        st_kv_layer L8 = L;
        L8.dtype = ST_KV_FP8, L8.k_scale = y, L8.v_scale = y + 8;
        g_reached = 0;
        CHECK(be->ops->kv_store_paged(be, NULL, &L8, x, x + 2, slots, 1) == STRATA_OK);
        Lb = L, Lb.k_scale = NULL, Lb.v_scale = NULL;
        CHECK(be->ops->kv_store_paged(be, NULL, &Lb, x, x + 2, slots, 1) == STRATA_OK);
        CHECK(be->ops->stream_sync(be, NULL) == STRATA_OK);
        CHECK_MSG(g_reached == 2, "valid kv_store_paged calls reached the device %d times", g_reached);
    }
    BAD(be, be->ops->sample(be, NULL, x, 1, 0, args, ids), "sample", "vocab = 0");
    BAD(be, be->ops->sample(be, NULL, x, 1, 8, NULL, ids), "sample", "args is NULL");

    /* n = 0: STRATA_OK without reaching the device, pointers unused */
    g_reached = 0;
    CHECK(be->ops->matmul(be, NULL, NULL, &w, 0, NULL) == STRATA_OK);
    CHECK(be->ops->add(be, NULL, NULL, NULL, 0) == STRATA_OK);
    CHECK(be->ops->sample(be, NULL, NULL, 0, 8, NULL, NULL) == STRATA_OK);
    CHECK(be->ops->attention_paged(be, NULL, NULL, NULL, NULL, NULL, 0, 2, 1, 2, 0.5f, NULL) == STRATA_OK);
    CHECK(be->ops->kv_store_paged(be, NULL, &L, NULL, NULL, NULL, 0) == STRATA_OK);
    CHECK(be->ops->get_rows(be, NULL, &w, NULL, 0, NULL) == STRATA_OK);
    CHECK(be->ops->matmul_multi(be, NULL, NULL, wm, 2, 0, NULL) == STRATA_OK);
    CHECK_MSG(g_reached == 0, "n = 0 reached the device %d times", g_reached);

    /* valid calls reach the device (and succeed) */
    float hx[64];
    for (int i = 0; i < 64; i++) hx[i] = (float)(i % 7) - 3.0f;
    g_reached = 0;
    CHECK(be->ops->copy_h2d(be, NULL, wd, hx, sizeof hx) == STRATA_OK);
    CHECK(be->ops->copy_h2d(be, NULL, x, hx, 16 * sizeof(float)) == STRATA_OK);
    CHECK(be->ops->matmul(be, NULL, x, &w, 2, y) == STRATA_OK);
    CHECK(be->ops->add(be, NULL, y, x, 16) == STRATA_OK);
    CHECK(be->ops->stream_sync(be, NULL) == STRATA_OK);
    CHECK_MSG(g_reached == 4, "valid calls reached the device %d times (4 expected)", g_reached);
    float hy[16];
    CHECK(be->ops->copy_d2h(be, NULL, hy, y, sizeof hy) == STRATA_OK);
    CHECK(be->ops->stream_sync(be, NULL) == STRATA_OK);
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 8; j++) {
            float want = hx[r * 8 + j];
            for (int k = 0; k < 8; k++) want += hx[r * 8 + k] * hx[j * 8 + k];
            CHECK_MSG(hy[r * 8 + j] == want, "y[%d][%d] = %g, want %g", r, j, (double)hy[r * 8 + j], (double)want);
        }

    /* device-specific checks stay in the device */
    if (cuda) {
        /* these checks are the device's own: it is reached, and refuses */
        const st_weight wmis = {(const char *)wd + 4, ST_DTYPE_F32, 4, 8, 0};
        CHECK_ERR(be->ops->matmul(be, NULL, x, &wmis, 1, y), STRATA_ERR_INVALID_ARG, "cuda matmul:",
                  "16-byte aligned");
        CHECK_ERR(be->ops->add(be, NULL, (float *)((char *)x + 2), y, 4), STRATA_ERR_INVALID_ARG, "cuda add:",
                  "4-byte aligned");
    } else {
        const int32_t bad_idx = 9;
        CHECK(be->ops->copy_h2d(be, NULL, ids, &bad_idx, sizeof bad_idx) == STRATA_OK);
        CHECK_ERR(be->ops->get_rows(be, NULL, &w, ids, 1, o), STRATA_ERR_INVALID_ARG, "cpu get_rows:", "ids[0] = 9");
    }

    be->dev_ops = g_real;
    be->ops->dealloc(be, buf);
}

int main(void) {
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2};
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    if (be) check_backend(be);
    st_backend_free(be);
    if (st_backend_available(ST_BACKEND_CUDA)) {
        st_backend *gb = NULL;
        st_backend_params gp = {.kind = ST_BACKEND_CUDA};
        CHECK_MSG(st_backend_init(&gp, &gb) == STRATA_OK, "cuda init: %s", st_last_error());
        if (gb) check_backend(gb);
        st_backend_free(gb);
    } else {
        fprintf(stderr, "no CUDA device: the CUDA backend is not checked\n");
    }
    return test_finish("test_backend_checks");
}

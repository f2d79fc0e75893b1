/* Prefill/decode disaggregation in the engine (engine/engine.h, no transport),
 * on the tiny GGUF llama (tests/data/tokenizer/tiny_bpe_smollm.gguf, context
 * 64), blocks of 4 tokens, CPU backend:
 *  - a prefill-only request with export_kv hands every layer of its full
 *    prompt blocks to on_kv, block ranges in order per layer, as the chunks
 *    complete, from the runner's export thread (layer by layer during the
 *    pass); it ends STOP with no completion token; a second one over the
 *    same prompt (a prefix hit on that node) exports the same bytes;
 *  - a decode engine reserves host blocks for the prompt, the pieces are
 *    copied into them (what the UCX transfer does), the reservation is
 *    adopted (the blocks go on to the device before the waiting request is
 *    admitted: a device hit, nothing loaded in its pass), and the request
 *    waiting for the ticket gives the logits of a single engine that computed
 *    the whole prompt, bit for bit, having computed only the last block's
 *    tokens;
 *  - the request may come before the adoption (it waits, holding nothing) or
 *    after it; a later reservation of the same prompt needs nothing, and of a
 *    longer one only its new blocks;
 *  - a cancelled reservation: the waiting request computes its prompt, same
 *    logits; reserved blocks go back (host_reserved 0);
 *  - a host tier too small: NOMEM naming --kv-host-mem; an aborted waiting
 *    request; export_kv without prefill_only refused. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "testutil.h"

#define BS 4
#define MAXP 48
#define NGEN 8

typedef struct {
    st_model_files *files;
    st_backend *be;
    st_tokenizer *tok;
    int64_t n_ctx;
} tiny;

static bool tiny_open(tiny *t) {
    memset(t, 0, sizeof *t);
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 1};
    if (st_model_open(test_src_path("tests/data/tokenizer/tiny_bpe_smollm.gguf"), &t->files) ||
        st_backend_init(&bp, &t->be) || st_tokenizer_load(t->files, &t->tok)) {
        fprintf(stderr, "tiny model: %s\n", st_last_error());
        return false;
    }
    t->n_ctx = t->files->config.max_position_embeddings;
    return true;
}

/* ---- a request's outcome, and the logits of its positions ---------------------------------*/
typedef struct {
    int finished;
    st_engine_finish fin;
    char text[1024];
    size_t len;
    /* exported pieces: per layer, the bytes in block order */
    uint8_t *layer_data[8];
    int64_t layer_blocks[8]; /* blocks received per layer, contiguous from first */
    int64_t first_block;
    int pieces;
    bool order_ok;
    bool on_stepping_thread; /* a piece came on the thread that steps (not the export thread) */
} result;

static pthread_t g_main;

static void on_text(void *user, const char *t, size_t n) {
    result *r = user;
    if (r->len + n < sizeof r->text) {
        memcpy(r->text + r->len, t, n);
        r->len += n;
    }
}
static void on_finish(void *user, const st_engine_finish *f) {
    result *r = user;
    r->fin = *f;
    r->fin.error = NULL;
    r->finished++;
}
static size_t g_layer_bytes;
static void *kv_buffer(void *user, size_t bytes) {
    (void)user;
    return malloc(bytes);
}
static void on_kv(void *user, const st_kv_piece *p) {
    result *r = user;
    r->pieces++;
    if (pthread_equal(pthread_self(), g_main)) r->on_stepping_thread = true;
    if (p->layer < 0 || p->layer >= 8 || p->n_blocks <= 0 || p->bytes != (size_t)p->n_blocks * g_layer_bytes) {
        r->order_ok = false;
        free(p->data);
        return;
    }
    const int64_t l = p->layer;
    if (p->first_block != r->first_block + r->layer_blocks[l]) r->order_ok = false;
    r->layer_data[l] = realloc(r->layer_data[l], (size_t)(r->layer_blocks[l] + p->n_blocks) * g_layer_bytes);
    memcpy(r->layer_data[l] + (size_t)r->layer_blocks[l] * g_layer_bytes, p->data, p->bytes);
    r->layer_blocks[l] += p->n_blocks;
    free(p->data);
}
static void result_free(result *r) {
    for (int l = 0; l < 8; l++) free(r->layer_data[l]);
}

/* logits by position of the one request the hook sees */
static float *g_logits;
static int64_t g_vocab, g_first_pos, g_last_pos;
static void on_logits(void *user, uint64_t id, int64_t pos, const float *row, int64_t n_vocab) {
    (void)user;
    (void)id;
    g_vocab = n_vocab;
    if (pos < 0 || pos >= 64) return;
    if (!g_logits) g_logits = calloc((size_t)64 * (size_t)n_vocab, sizeof(float));
    memcpy(g_logits + pos * n_vocab, row, (size_t)n_vocab * sizeof(float));
    if (g_first_pos < 0 || pos < g_first_pos) g_first_pos = pos;
    if (pos > g_last_pos) g_last_pos = pos;
}

static st_engine *engine(tiny *t, int64_t host_mem, bool hook) {
    st_engine_params p = {.max_batch = 4, .max_model_len = t->n_ctx, .prefill_chunk = 8, .kv_block_size = BS,
                          .kv_host_mem = host_mem, .on_logits = hook ? on_logits : NULL};
    st_engine *e = NULL;
    CHECK(st_engine_init(t->files, t->be, t->tok, &p, &e) == STRATA_OK);
    return e;
}

static void drain(st_engine *e) {
    for (int i = 0; i < 1000 && st_engine_has_work(e); i++) CHECK(st_engine_step(e, NULL) == STRATA_OK);
}

static st_engine_request req_of(const int32_t *prompt, int64_t n) {
    st_engine_request r = {.prompt = prompt, .n_prompt = n, .sampler = st_sampler_params_default(),
                           .max_tokens = NGEN, .ignore_eos = true};
    r.sampler.temperature = 0;
    return r;
}

/* the reservation callback */
typedef struct {
    int calls;
    strata_status st;
    st_engine_kv_reservation res;
    void *blocks[64];
    char error[256];
} reserved;
static void on_reserved(void *user, strata_status st, const st_engine_kv_reservation *res) {
    reserved *r = user;
    r->calls++;
    r->st = st;
    snprintf(r->error, sizeof r->error, "%s", st ? st_last_error() : "");
    if (res) {
        r->res = *res;
        for (int64_t k = 0; k < res->n_blocks && k < 64; k++) r->blocks[k] = res->blocks[k];
    }
}

static float *run_reference(tiny *t, const int32_t *prompt, int64_t n, result *out) {
    free(g_logits);
    g_logits = NULL;
    g_first_pos = -1;
    g_last_pos = -1;
    st_engine *e = engine(t, ST_KV_HOST_OFF, true);
    if (!e) return NULL;
    const st_engine_request rq = req_of(prompt, n);
    const st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = out};
    uint64_t id;
    CHECK(st_engine_add(e, &rq, &cb, &id) == STRATA_OK);
    drain(e);
    st_engine_free(e);
    float *l = g_logits;
    g_logits = NULL;
    return l;
}

/* prefill-only on P: the pieces of blocks [from, (n-1)/BS) of prompt[0..n) */
static void run_prefill(st_engine *p, const int32_t *prompt, int64_t n, int64_t from, result *out) {
    const int64_t full = (n - 1) / BS;
    st_engine_request rq = req_of(prompt, full * BS);
    rq.prefill_only = true;
    rq.export_kv = true;
    rq.export_from_block = from;
    out->first_block = from;
    out->order_ok = true;
    const st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = out,
                                    .kv_buffer = kv_buffer, .on_kv = on_kv};
    uint64_t id;
    CHECK(st_engine_add(p, &rq, &cb, &id) == STRATA_OK);
    drain(p);
    CHECK(out->finished == 1 && out->fin.reason == ST_FINISH_STOP && out->fin.completion_tokens == 0);
    CHECK(out->order_ok);
}

/* what the transfer does: piece bytes into the reserved blocks */
static void land(const reserved *rv, const result *pieces, int64_t n_layers) {
    for (int64_t k = 0; k < rv->res.n_blocks; k++)
        for (int64_t l = 0; l < n_layers; l++)
            memcpy((uint8_t *)rv->blocks[k] + l * rv->res.layer_bytes,
                   pieces->layer_data[l] + (size_t)(rv->res.cached_blocks + k - pieces->first_block) * g_layer_bytes,
                   rv->res.layer_bytes);
}

static bool logits_equal(const float *a, const float *b, int64_t from, int64_t to) {
    if (!a || !b) return false;
    return memcmp(a + from * g_vocab, b + from * g_vocab, (size_t)(to - from + 1) * (size_t)g_vocab * sizeof(float)) == 0;
}

int main(void) {
    tiny t;
    g_main = pthread_self();
    if (!tiny_open(&t)) return 1;
    int32_t prompt[MAXP];
    uint64_t rs = 0x1234567;
    const int64_t vocab = st_tokenizer_vocab_size(t.tok);
    for (int i = 0; i < MAXP; i++) prompt[i] = (int32_t)(test_rand_u32(&rs) % (uint32_t)(vocab - 10)) + 5;
    const int64_t N = 42, FULL = (N - 1) / BS; /* 10 full blocks to move, 2 tokens computed on D */

    result ref = {0};
    float *ref_logits = run_reference(&t, prompt, N, &ref);
    CHECK(ref.finished == 1 && ref.fin.completion_tokens == NGEN);

    /* ---- P: prefill-only with export ---- */
    st_engine *P = engine(&t, ST_KV_HOST_OFF, false);
    int64_t n_layers = 0;
    uint64_t ident = 0, ident_d = 0;
    st_engine_kv_layout(P, &n_layers, &g_layer_bytes, &ident);
    CHECK(n_layers >= 1 && n_layers <= 8 && g_layer_bytes > 0);
    result pr = {0};
    run_prefill(P, prompt, N, 0, &pr);
    for (int64_t l = 0; l < n_layers; l++) CHECK_MSG(pr.layer_blocks[l] == FULL, "layer %lld: %lld blocks", (long long)l, (long long)pr.layer_blocks[l]);
    CHECK_MSG(pr.pieces > n_layers, "%d pieces: the chunks' blocks went out as they completed", pr.pieces);
    CHECK_MSG(!pr.on_stepping_thread, "each layer's piece is handed over by the export thread, during the pass");
    /* again: a prefix hit on P, the same bytes from block 3 on */
    result pr2 = {0};
    run_prefill(P, prompt, N, 3, &pr2);
    for (int64_t l = 0; l < n_layers; l++) {
        CHECK(pr2.layer_blocks[l] == FULL - 3);
        CHECK(pr2.layer_data[l] && !memcmp(pr2.layer_data[l], pr.layer_data[l] + 3 * g_layer_bytes, (size_t)(FULL - 3) * g_layer_bytes));
    }

    /* ---- D: reserve, request first (waits), land, adopt ---- */
    {
        st_engine *D = engine(&t, TEST_KV_HOST_MEM, true);
        st_engine_kv_layout(D, &n_layers, &g_layer_bytes, &ident_d);
        CHECK(ident_d == ident);
        reserved rv = {0};
        CHECK(st_engine_kv_reserve(D, prompt, N, on_reserved, &rv) == STRATA_OK);
        CHECK(rv.calls == 0); /* made at the next step */
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK(rv.calls == 1 && rv.st == STRATA_OK && rv.res.ticket != 0);
        CHECK(rv.res.cached_blocks == 0 && rv.res.n_blocks == FULL && rv.res.layer_bytes == g_layer_bytes &&
              rv.res.n_layers == n_layers && rv.res.block_tokens == BS);
        free(g_logits);
        g_logits = NULL;
        g_first_pos = g_last_pos = -1;
        result dr = {0};
        st_engine_request rq = req_of(prompt, N);
        rq.kv_ticket = rv.res.ticket;
        const st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &dr};
        uint64_t id;
        CHECK(st_engine_add(D, &rq, &cb, &id) == STRATA_OK);
        for (int i = 0; i < 3; i++) CHECK(st_engine_step(D, NULL) == STRATA_OK);
        st_engine_metrics m;
        st_engine_metrics_get(D, &m);
        CHECK_MSG(dr.finished == 0 && m.running == 0 && m.waiting == 1 && m.kv_blocks_used == 0,
                  "it waits for its ticket holding nothing: running %lld waiting %lld blocks %lld",
                  (long long)m.running, (long long)m.waiting, (long long)m.kv_blocks_used);
        CHECK(!st_engine_has_work(D)); /* nothing to do until the ticket is resolved: no busy loop */
        CHECK(m.kv_tier.host_reserved == FULL);
        land(&rv, &pr, n_layers);
        CHECK(st_engine_kv_resolve(D, rv.res.ticket, true) == STRATA_OK);
        drain(D);
        st_engine_metrics_get(D, &m);
        CHECK(dr.finished == 1 && dr.fin.reason == ST_FINISH_LENGTH && dr.fin.completion_tokens == NGEN);
        CHECK_MSG(dr.fin.cached_tokens == FULL * BS, "cached %lld", (long long)dr.fin.cached_tokens);
        CHECK_MSG(m.prompt_tokens == N - FULL * BS, "computed %lld prompt tokens", (long long)m.prompt_tokens);
        CHECK(m.pd_adopted == 1 && m.kv_tier.host_reserved == 0 && m.kv_tier.blocks_adopted == FULL);
        CHECK_MSG(m.prefix_hits_device == FULL * BS && m.prefix_hits_host == 0 &&
                      m.kv_tier.bytes_h2d == (uint64_t)FULL * (uint64_t)n_layers * g_layer_bytes,
                  "the adopted blocks reached the device before the admission (device hits %lld, host hits %lld, "
                  "%llu bytes host -> device)", (long long)m.prefix_hits_device, (long long)m.prefix_hits_host,
                  (unsigned long long)m.kv_tier.bytes_h2d);
        CHECK(dr.len == ref.len && !memcmp(dr.text, ref.text, ref.len));
        CHECK_MSG(g_first_pos == N - 1 && logits_equal(g_logits, ref_logits, N - 1, N - 1 + NGEN - 1),
                  "the decode node's logits equal the single engine's, bit for bit (first pos %lld)",
                  (long long)g_first_pos);
        free(g_logits);
        g_logits = NULL;

        /* the same prompt again: nothing to move; a longer one: only its new blocks */
        reserved r2 = {0}, r3 = {0};
        CHECK(st_engine_kv_reserve(D, prompt, N, on_reserved, &r2) == STRATA_OK);
        CHECK(st_engine_kv_reserve(D, prompt, MAXP, on_reserved, &r3) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK(r2.calls == 1 && r2.st == STRATA_OK && r2.res.n_blocks == 0 && r2.res.ticket == 0 &&
              r2.res.cached_blocks == FULL);
        CHECK(r3.calls == 1 && r3.st == STRATA_OK && r3.res.cached_blocks == FULL &&
              r3.res.n_blocks == (MAXP - 1) / BS - FULL && r3.res.ticket != 0);
        /* cancelled: the waiting request computes its prompt itself */
        result cr = {0};
        st_engine_request rq3 = req_of(prompt, MAXP);
        rq3.kv_ticket = r3.res.ticket;
        const st_engine_callbacks cb3 = {.on_text = on_text, .on_finish = on_finish, .user = &cr};
        CHECK(st_engine_add(D, &rq3, &cb3, &id) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK(cr.finished == 0);
        CHECK(st_engine_kv_resolve(D, r3.res.ticket, false) == STRATA_OK);
        drain(D);
        st_engine_metrics_get(D, &m);
        CHECK(cr.finished == 1 && cr.fin.completion_tokens == NGEN && m.pd_cancelled == 1 &&
              m.kv_tier.host_reserved == 0);
        /* an aborted waiting request */
        reserved r4 = {0};
        int32_t other[20];
        for (int i = 0; i < 20; i++) other[i] = prompt[i] + 1;
        CHECK(st_engine_kv_reserve(D, other, 20, on_reserved, &r4) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK(r4.st == STRATA_OK && r4.res.ticket != 0);
        result ar = {0};
        st_engine_request rq4 = req_of(other, 20);
        rq4.kv_ticket = r4.res.ticket;
        const st_engine_callbacks cb4 = {.on_text = on_text, .on_finish = on_finish, .user = &ar};
        CHECK(st_engine_add(D, &rq4, &cb4, &id) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK(st_engine_abort(D, id) == STRATA_OK);
        CHECK(st_engine_has_work(D));
        drain(D);
        CHECK(ar.finished == 1 && ar.fin.reason == ST_FINISH_ABORT);
        st_engine_free(D); /* with r4's reservation still open: freed with it */
        result_free(&cr);
        result_free(&dr);
    }

    /* ---- D with the request after the adoption, and cancel before any request ---- */
    {
        st_engine *D = engine(&t, TEST_KV_HOST_MEM, true);
        reserved rv = {0};
        CHECK(st_engine_kv_reserve(D, prompt, N, on_reserved, &rv) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        land(&rv, &pr, n_layers);
        CHECK(st_engine_kv_resolve(D, rv.res.ticket, true) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        free(g_logits);
        g_logits = NULL;
        g_first_pos = g_last_pos = -1;
        result dr = {0};
        st_engine_request rq = req_of(prompt, N);
        rq.kv_ticket = rv.res.ticket; /* resolved already: runs at once */
        const st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &dr};
        uint64_t id;
        CHECK(st_engine_add(D, &rq, &cb, &id) == STRATA_OK);
        drain(D);
        CHECK(dr.finished == 1 && dr.fin.cached_tokens == FULL * BS);
        CHECK(logits_equal(g_logits, ref_logits, N - 1, N - 1 + NGEN - 1));
        free(g_logits);
        g_logits = NULL;
        st_engine_free(D);
    }

    /* ---- a host tier too small; bad requests ---- */
    {
        st_engine *D = engine(&t, (int64_t)4 * 4096, false); /* a few blocks */
        reserved rv = {0};
        CHECK(st_engine_kv_reserve(D, prompt, MAXP, on_reserved, &rv) == STRATA_OK);
        CHECK(st_engine_step(D, NULL) == STRATA_OK);
        CHECK_MSG(rv.calls == 1 && rv.st == STRATA_ERR_NOMEM && strstr(rv.error, "--kv-host-mem"), "got %d: %s",
                  rv.st, rv.error);
        st_engine_metrics m;
        st_engine_metrics_get(D, &m);
        CHECK(m.kv_tier.host_reserved == 0);
        st_engine_request bad = req_of(prompt, N);
        bad.export_kv = true;
        const st_engine_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = &rv,
                                        .kv_buffer = kv_buffer, .on_kv = on_kv};
        uint64_t id;
        CHECK_ERR(st_engine_add(D, &bad, &cb, &id), STRATA_ERR_INVALID_ARG, "prefill-only");
        st_engine_free(D);
        st_engine *noh = engine(&t, ST_KV_HOST_OFF, false);
        CHECK_ERR(st_engine_kv_reserve(noh, prompt, N, on_reserved, &rv), STRATA_ERR_UNSUPPORTED, "host tier");
        st_engine_free(noh);
    }

    free(g_logits);
    st_engine_free(P);
    result_free(&pr);
    result_free(&pr2);
    free(ref_logits);
    st_tokenizer_free(t.tok);
    st_backend_free(t.be);
    st_model_close(t.files);
    return test_finish("test_pd_engine");
}

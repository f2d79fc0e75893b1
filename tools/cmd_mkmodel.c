/* strata mkmodel: writes a random Llama model of a known shape, quickly, for
 * benchmarks and tests of models too big to carry (a Llama-3-8B-shaped bf16
 * model is 16 GB).
 *
 * Output: an HF directory (config.json + model.safetensors, or shards of at
 * most 5 GB model-0000i-of-0000n.safetensors + model.safetensors.index.json)
 * (--shard-mb) for f32/f16/bf16, or one GGUF v3 file (llama.* metadata, llama.cpp tensor
 * names; any of f32/f16/bf16/q8_0/q4_0/q4_1 for the matrices, norms f32, and
 * rope_freqs.weight for llama3 scaling) — layouts as src/loader reads them.
 * No tokenizer: the models are driven with token ids.
 *
 * Values (so activations stay in a realistic range through many layers):
 * every matrix [rows, cols] ~ N(0, gain^2 / cols), gain 1 (q, k, v, gate,
 * up), 1/sqrt(2 n_layers) (o, down: the residual stream grows slowly),
 * 2 (lm_head: logits of std ~2, peaked enough for greedy decoding to mean
 * something); the embedding table ~ N(0, 1); norm weights 1 + U(-0.1, 0.1).
 * The normal is approximated by the sum of four uniforms (Irwin-Hall),
 * counter-based per (tensor name, row): the values depend only on the seed,
 * not on the thread count, and a GGUF q8_0 file holds the quantized values of
 * the bf16 HF model of the same seed.
 *
 * Speed: the file is written in batches of whole rows (~128 MB); worker
 * threads generate (and quantize) batch i + 1 while a writer thread writes
 * batch i with large sequential writes (the output stays in the page cache,
 * so a model written just before a benchmark loads at memory speed). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "commands.h"
#include "common.h"
#include "core/pool.h"
#include "core/quant.h"
#include "loader/gguf.h"

#define BATCH_BYTES ((size_t)128 << 20)
#define SHARD_MB_DEFAULT 5000 /* HF shards: at most this many MB (1e6 bytes) of tensors each, as HF's "5GB" */
#define GGUF_ALIGN 32

/* ---- shapes ---- */

typedef struct {
    const char *name;
    int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim, max_pos;
    double rope_theta;
    bool llama3_rope, tied;
    int64_t bos, eos;
} mk_config;

static const mk_config k_configs[] = {
    {"llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, 131072, 500000.0, true, false, 128000, 128001},
    {"llama3-70b", 128256, 8192, 28672, 80, 64, 8, 128, 131072, 500000.0, true, false, 128000, 128001},
    {"smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, 8192, 100000.0, false, true, 1, 2},
    {"tiny", 512, 128, 256, 2, 4, 2, 32, 2048, 10000.0, false, false, 1, 2},
};

typedef enum { INIT_NORMAL = 0, INIT_NORM } mk_init;

typedef struct {
    char hf[96], gg[64];  /* HF and GGUF names */
    st_dtype dtype;       /* as written */
    int64_t rows, cols;   /* rows = 1 for vectors */
    bool vector;
    mk_init init;
    float std;
    const float *values;  /* fixed contents (rope_freqs), or NULL */
    int file;             /* output file */
    uint64_t off;         /* byte offset in that file */
    uint64_t nbytes;
} mk_tensor;

typedef struct {
    mk_tensor *t;
    int n, cap;
} mk_list;

static bool add_tensor(mk_list *l, const char *hf, const char *gg, st_dtype dt, int64_t rows, int64_t cols,
                       bool vector, mk_init init, float std) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        mk_tensor *p = realloc(l->t, (size_t)cap * sizeof *p);
        if (!p) return false;
        l->t = p;
        l->cap = cap;
    }
    mk_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->hf, sizeof t->hf, "%s", hf);
    snprintf(t->gg, sizeof t->gg, "%s", gg);
    t->dtype = dt;
    t->rows = rows;
    t->cols = cols;
    t->vector = vector;
    t->init = init;
    t->std = std;
    t->nbytes = st_dtype_row_bytes(dt, cols) * (uint64_t)rows;
    return true;
}

/* The tensors in file order: embed, per layer attn + ffn, final norm, lm_head. */
static bool build_tensors(const mk_config *c, st_dtype wt, bool gguf, mk_list *l) {
    const int64_t H = c->hidden, qd = c->heads * c->head_dim, kvd = c->kv_heads * c->head_dim, I = c->inter;
    const st_dtype vt = gguf ? ST_DTYPE_F32 : wt; /* GGUF vectors are f32, as llama.cpp writes them */
    const float resid = 1.0f / sqrtf(2.0f * (float)c->layers);
    char hf[96], gg[64];
    bool ok = add_tensor(l, "model.embed_tokens.weight", "token_embd.weight", wt, c->vocab, H, false, INIT_NORMAL,
                         1.0f);
    for (int64_t i = 0; i < c->layers && ok; i++) {
        struct { const char *hf, *gg; int64_t r, cc; bool vec; float gain; } L[] = {
            {"input_layernorm", "attn_norm", 1, H, true, 0},
            {"self_attn.q_proj", "attn_q", qd, H, false, 1.0f},
            {"self_attn.k_proj", "attn_k", kvd, H, false, 1.0f},
            {"self_attn.v_proj", "attn_v", kvd, H, false, 1.0f},
            {"self_attn.o_proj", "attn_output", H, qd, false, resid},
            {"post_attention_layernorm", "ffn_norm", 1, H, true, 0},
            {"mlp.gate_proj", "ffn_gate", I, H, false, 1.0f},
            {"mlp.up_proj", "ffn_up", I, H, false, 1.0f},
            {"mlp.down_proj", "ffn_down", H, I, false, resid},
        };
        for (size_t k = 0; k < sizeof L / sizeof L[0] && ok; k++) {
            snprintf(hf, sizeof hf, "model.layers.%" PRId64 ".%s.weight", i, L[k].hf);
            snprintf(gg, sizeof gg, "blk.%" PRId64 ".%s.weight", i, L[k].gg);
            ok = add_tensor(l, hf, gg, L[k].vec ? vt : wt, L[k].r, L[k].cc, L[k].vec, L[k].vec ? INIT_NORM : INIT_NORMAL,
                            L[k].gain / sqrtf((float)L[k].cc));
        }
    }
    ok = ok && add_tensor(l, "model.norm.weight", "output_norm.weight", vt, 1, H, true, INIT_NORM, 0);
    if (!c->tied) ok = ok && add_tensor(l, "lm_head.weight", "output.weight", wt, c->vocab, H, false, INIT_NORMAL,
                                        2.0f / sqrtf((float)H));
    return ok;
}

/* ---- values ---- */

static inline uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Row r of tensor ti, fp32, into out[cols]. */
static void gen_row(const mk_tensor *t, int64_t r, uint64_t seed, float *out) {
    if (t->values) {
        memcpy(out, t->values, (size_t)t->cols * sizeof(float));
        return;
    }
    /* keyed by the tensor's name, so HF and GGUF files of one seed hold the same values */
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = t->hf; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    uint64_t s = seed ^ h ^ ((uint64_t)r * 0x8cb92ba72f3d8dd7ull);
    if (t->init == INIT_NORM) {
        for (int64_t j = 0; j < t->cols; j++) {
            const uint64_t z = splitmix64(&s);
            out[j] = 1.0f + 0.2f * ((float)(z >> 40) / 16777216.0f - 0.5f);
        }
        return;
    }
    /* Irwin-Hall(4): sum of four 16-bit uniforms, mean 2, variance 1/3 */
    const float k = t->std * 1.7320508f / 65536.0f, m = 2.0f * 65536.0f;
    for (int64_t j = 0; j < t->cols; j++) {
        const uint64_t z = splitmix64(&s);
        const float u = (float)(z & 0xffff) + (float)((z >> 16) & 0xffff) + (float)((z >> 32) & 0xffff) +
                        (float)(z >> 48);
        out[j] = (u - m) * k;
    }
}

/* ---- batches: whole rows of consecutive tensors, written by a writer thread ---- */

typedef struct {
    int ti;            /* tensor */
    int64_t r0, r1;    /* rows */
} mk_item;

typedef struct {
    const mk_list *l;
    uint64_t seed;
    const mk_item *items;
    uint8_t *buf;      /* the batch's bytes, from file offset base */
    uint64_t base;
    int64_t max_cols;
    float **rowbuf;    /* [threads] */
} gen_ctx;

static void gen_items(void *ctx, int64_t b, int64_t e, int thread) {
    gen_ctx *g = ctx;
    float *row = g->rowbuf[thread];
    for (int64_t i = b; i < e; i++) {
        const mk_item *it = &g->items[i];
        const mk_tensor *t = &g->l->t[it->ti];
        const size_t rb = st_dtype_row_bytes(t->dtype, t->cols);
        uint8_t *dst = g->buf + (t->off - g->base) + (size_t)it->r0 * rb;
        for (int64_t r = it->r0; r < it->r1; r++, dst += rb) {
            gen_row(t, r, g->seed, row);
            if (!st_quantize_row(t->dtype, row, dst, t->cols)) memset(dst, 0, rb); /* types checked up front */
        }
    }
}

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fd;
    const char *path;
    uint8_t *buf;      /* pending batch (NULL: none) */
    size_t len;
    uint64_t off;
    bool quit, failed;
    int err;
} mk_writer;

static void *writer_main(void *arg) {
    mk_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->buf && !w->quit) pthread_cond_wait(&w->cv, &w->mu);
        if (!w->buf && w->quit) break;
        uint8_t *p = w->buf;
        size_t len = w->len;
        uint64_t off = w->off;
        pthread_mutex_unlock(&w->mu);
        bool ok = true;
        int err = 0;
        while (len > 0 && ok) {
            const ssize_t k = pwrite(w->fd, p, len > ((size_t)1 << 30) ? (size_t)1 << 30 : len, (off_t)off);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) ok = false, err = k < 0 ? errno : ENOSPC;
            else p += k, len -= (size_t)k, off += (uint64_t)k;
        }
        pthread_mutex_lock(&w->mu);
        if (!ok && !w->failed) w->failed = true, w->err = err;
        w->buf = NULL;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Hands `buf` to the writer once it is idle; false when a write failed. */
static bool writer_submit(mk_writer *w, uint8_t *buf, size_t len, uint64_t off) {
    pthread_mutex_lock(&w->mu);
    while (w->buf) pthread_cond_wait(&w->cv, &w->mu);
    const bool ok = !w->failed;
    if (ok) {
        w->buf = buf;
        w->len = len;
        w->off = off;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return ok;
}

static bool writer_wait_idle(mk_writer *w) {
    pthread_mutex_lock(&w->mu);
    while (w->buf) pthread_cond_wait(&w->cv, &w->mu);
    const bool ok = !w->failed;
    pthread_mutex_unlock(&w->mu);
    return ok;
}

/* Writes the data of every tensor of file `file` (offsets already set, the
 * header already written at the start of fd). */
static bool write_data(const mk_list *l, int file, int fd, const char *path, uint64_t seed, st_pool *pool,
                       uint8_t *bufs[2], uint64_t *written) {
    const int nth = st_pool_threads(pool);
    int64_t max_cols = 1;
    for (int i = 0; i < l->n; i++)
        if (l->t[i].cols > max_cols) max_cols = l->t[i].cols;
    float **rowbuf = calloc((size_t)nth, sizeof *rowbuf);
    mk_item *items = malloc(sizeof(mk_item) * 4096);
    bool ok = rowbuf && items;
    for (int i = 0; ok && i < nth; i++) ok = (rowbuf[i] = malloc((size_t)max_cols * sizeof(float))) != NULL;
    mk_writer w = {.fd = fd, .path = path};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    pthread_t th;
    bool started = ok && pthread_create(&th, NULL, writer_main, &w) == 0;
    ok = ok && started;
    int cur = 0;
    int ti = 0;
    int64_t row = 0;
    while (ok) {
        /* next batch: rows from (ti, row) on, items of ~BATCH_BYTES / (8 nth) */
        while (ti < l->n && (l->t[ti].file != file || row >= l->t[ti].rows)) ti++, row = 0;
        if (ti >= l->n) break;
        const uint64_t base = l->t[ti].off + (uint64_t)row * st_dtype_row_bytes(l->t[ti].dtype, l->t[ti].cols);
        uint64_t end = base;
        int n_items = 0;
        const uint64_t item_bytes = BATCH_BYTES / (8 * (uint64_t)nth) + 1;
        while (ti < l->n && n_items < 4096) {
            const mk_tensor *t = &l->t[ti];
            if (t->file != file) { ti++, row = 0; continue; }
            const uint64_t rb = st_dtype_row_bytes(t->dtype, t->cols);
            if (row >= t->rows) { ti++, row = 0; continue; }
            if (t->off + (uint64_t)row * rb + rb - base > BATCH_BYTES && n_items > 0) break;
            int64_t take = (int64_t)(item_bytes / rb);
            if (take < 1) take = 1;
            int64_t fit = (int64_t)((BATCH_BYTES - (t->off + (uint64_t)row * rb - base)) / rb);
            if (fit < 1) fit = 1;
            if (take > fit) take = fit;
            if (take > t->rows - row) take = t->rows - row;
            items[n_items++] = (mk_item){ti, row, row + take};
            row += take;
            end = t->off + (uint64_t)row * rb;
        }
        uint8_t *buf = bufs[cur];
        memset(buf, 0, (size_t)(end - base)); /* alignment gaps between tensors */
        gen_ctx g = {l, seed, items, buf, base, max_cols, rowbuf};
        st_pool_parallel_for(pool, n_items, 1, gen_items, &g);
        ok = writer_submit(&w, buf, (size_t)(end - base), base);
        *written += end - base;
        cur ^= 1;
    }
    if (started) {
        ok = writer_wait_idle(&w) && ok;
        pthread_mutex_lock(&w.mu);
        w.quit = true;
        pthread_cond_broadcast(&w.cv);
        pthread_mutex_unlock(&w.mu);
        pthread_join(th, NULL);
        if (w.failed) fprintf(stderr, "strata mkmodel: writing %s: %s\n", path, strerror(w.err));
    }
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    for (int i = 0; rowbuf && i < nth; i++) free(rowbuf[i]);
    free(rowbuf);
    free(items);
    return ok && !w.failed;
}

/* ---- small text / byte builders ---- */

typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const void *d, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) { b->oom = true; return; }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k > 0) sb_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}
static void sb_u32(sbuf *b, uint32_t v) { sb_put(b, &v, 4); }
static void sb_u64(sbuf *b, uint64_t v) { sb_put(b, &v, 8); }
static void sb_gstr(sbuf *b, const char *s) {
    sb_u64(b, strlen(s));
    sb_put(b, s, strlen(s));
}

static bool write_all(int fd, const void *p, size_t n, uint64_t off) {
    const uint8_t *c = p;
    while (n > 0) {
        ssize_t k = pwrite(fd, c, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return false;
        c += k, n -= (size_t)k, off += (uint64_t)k;
    }
    return true;
}

static bool write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return false;
    bool ok = fputs(text, f) >= 0;
    return (fclose(f) == 0) && ok;
}

static const char *st_name(st_dtype t) {
    return t == ST_DTYPE_BF16 ? "BF16" : t == ST_DTYPE_F16 ? "F16" : "F32";
}

/* ---- HF directory ---- */

static void hf_config(const mk_config *c, st_dtype wt, sbuf *b) {
    sb_printf(b, "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n");
    sb_printf(b, "  \"vocab_size\": %" PRId64 ",\n  \"hidden_size\": %" PRId64 ",\n  \"intermediate_size\": %" PRId64
              ",\n", c->vocab, c->hidden, c->inter);
    sb_printf(b, "  \"num_hidden_layers\": %" PRId64 ",\n  \"num_attention_heads\": %" PRId64
              ",\n  \"num_key_value_heads\": %" PRId64 ",\n  \"head_dim\": %" PRId64 ",\n",
              c->layers, c->heads, c->kv_heads, c->head_dim);
    sb_printf(b, "  \"max_position_embeddings\": %" PRId64 ",\n  \"rms_norm_eps\": 1e-05,\n  \"rope_theta\": %.1f,\n",
              c->max_pos, c->rope_theta);
    if (c->llama3_rope)
        sb_printf(b, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0,"
                  " \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192},\n");
    sb_printf(b, "  \"tie_word_embeddings\": %s,\n  \"hidden_act\": \"silu\",\n  \"attention_bias\": false,\n"
              "  \"mlp_bias\": false,\n", c->tied ? "true" : "false");
    sb_printf(b, "  \"bos_token_id\": %" PRId64 ",\n  \"eos_token_id\": %" PRId64 ",\n  \"torch_dtype\": \"%s\"\n}\n",
              c->bos, c->eos, wt == ST_DTYPE_BF16 ? "bfloat16" : wt == ST_DTYPE_F16 ? "float16" : "float32");
}

/* Safetensors header of the tensors of file `file`: 8-byte length + JSON,
 * padded with spaces so that the data starts at a multiple of 4096. Sets the
 * tensors' offsets (contiguous, in order). *hdr_bytes = the header's size. */
static bool st_header(mk_list *l, int file, sbuf *b, uint64_t *hdr_bytes) {
    sbuf j = {0};
    uint64_t data = 0;
    sb_printf(&j, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < l->n; i++) {
        mk_tensor *t = &l->t[i];
        if (t->file != file) continue;
        if (t->vector)
            sb_printf(&j, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%" PRId64 "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}",
                      t->hf, st_name(t->dtype), t->cols, data, data + t->nbytes);
        else
            sb_printf(&j, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%" PRId64 ",%" PRId64 "],\"data_offsets\":[%" PRIu64
                      ",%" PRIu64 "]}", t->hf, st_name(t->dtype), t->rows, t->cols, data, data + t->nbytes);
        t->off = data; /* relative for now */
        data += t->nbytes;
    }
    sb_put(&j, "}", 1);
    if (j.oom) { free(j.p); return false; }
    uint64_t len = j.n;
    const uint64_t total = (8 + len + 4095) / 4096 * 4096;
    len = total - 8;
    sb_u64(b, len);
    sb_put(b, j.p, j.n);
    for (uint64_t k = j.n; k < len; k++) sb_put(b, " ", 1);
    free(j.p);
    for (int i = 0; i < l->n; i++)
        if (l->t[i].file == file) l->t[i].off += total;
    *hdr_bytes = total;
    return !b->oom;
}

/* ---- GGUF ---- */

static uint32_t file_type_of(st_dtype t) {
    switch (t) {
    case ST_DTYPE_F16: return 1;
    case ST_DTYPE_Q4_0: return 2;
    case ST_DTYPE_Q4_1: return 3;
    case ST_DTYPE_Q8_0: return 7;
    case ST_DTYPE_BF16: return 32;
    default: return 0;
    }
}

static void kv_u32(sbuf *b, const char *k, uint32_t v) { sb_gstr(b, k), sb_u32(b, ST_GGUF_TYPE_UINT32), sb_u32(b, v); }
static void kv_f32(sbuf *b, const char *k, float v) { sb_gstr(b, k), sb_u32(b, ST_GGUF_TYPE_FLOAT32), sb_put(b, &v, 4); }
static void kv_str(sbuf *b, const char *k, const char *v) { sb_gstr(b, k), sb_u32(b, ST_GGUF_TYPE_STRING), sb_gstr(b, v); }

/* Header, key/values and tensor infos; sets the offsets (aligned). */
static bool gguf_header(const mk_config *c, st_dtype wt, mk_list *l, sbuf *b, uint64_t *hdr_bytes) {
    sbuf kv = {0};
    int n_kv = 0;
    kv_str(&kv, "general.architecture", "llama"), n_kv++;
    kv_str(&kv, "general.name", c->name), n_kv++;
    kv_u32(&kv, "general.alignment", GGUF_ALIGN), n_kv++;
    kv_u32(&kv, "general.file_type", file_type_of(wt)), n_kv++;
    if (st_dtype_get(wt)->quantized) kv_u32(&kv, "general.quantization_version", 2), n_kv++;
    const struct { const char *k; int64_t v; } ints[] = {
        {"llama.vocab_size", c->vocab}, {"llama.context_length", c->max_pos}, {"llama.embedding_length", c->hidden},
        {"llama.block_count", c->layers}, {"llama.feed_forward_length", c->inter},
        {"llama.attention.head_count", c->heads}, {"llama.attention.head_count_kv", c->kv_heads},
        {"llama.attention.key_length", c->head_dim}, {"llama.attention.value_length", c->head_dim},
        {"llama.rope.dimension_count", c->head_dim}, {"tokenizer.ggml.bos_token_id", c->bos},
        {"tokenizer.ggml.eos_token_id", c->eos},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) kv_u32(&kv, ints[i].k, (uint32_t)ints[i].v), n_kv++;
    kv_f32(&kv, "llama.attention.layer_norm_rms_epsilon", 1e-5f), n_kv++;
    kv_f32(&kv, "llama.rope.freq_base", (float)c->rope_theta), n_kv++;

    sbuf ti = {0};
    uint64_t data = 0;
    for (int i = 0; i < l->n; i++) {
        mk_tensor *t = &l->t[i];
        sb_gstr(&ti, t->gg);
        sb_u32(&ti, t->vector ? 1 : 2);
        sb_u64(&ti, (uint64_t)t->cols);
        if (!t->vector) sb_u64(&ti, (uint64_t)t->rows);
        sb_u32(&ti, st_gguf_dtype_to_ggml(t->dtype));
        sb_u64(&ti, data);
        t->off = data;
        data = (data + t->nbytes + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
    }
    sb_put(b, "GGUF", 4);
    sb_u32(b, 3);
    sb_u64(b, (uint64_t)l->n);
    sb_u64(b, (uint64_t)n_kv);
    sb_put(b, kv.p, kv.n);
    sb_put(b, ti.p, ti.n);
    const bool oom = kv.oom || ti.oom;
    free(kv.p);
    free(ti.p);
    const uint64_t total = (b->n + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
    while (b->n < total && !b->oom) sb_put(b, "\0", 1);
    for (int i = 0; i < l->n; i++) l->t[i].off += total;
    *hdr_bytes = total;
    return !oom && !b->oom;
}

/* ---- command ---- */

static void mk_usage(FILE *f) {
    fprintf(f,
            "usage: strata mkmodel --config NAME [options] OUT\n"
            "Writes a Llama model of a known shape with random weights (no tokenizer).\n\n"
            "  --config NAME      llama3-8b, llama3-70b, smollm2-135m or tiny\n"
            "  --layers N         number of layers (default: the config's)\n"
            "  --dtype T          matrices as bf16 (default), f16, f32, q8_0, q4_0 or q4_1\n"
            "  --format hf|gguf   HF directory (config.json + safetensors, sharded above 5 GB) or one\n"
            "                     GGUF file (default: gguf for quantized types or an OUT ending in\n"
            "                     .gguf, hf otherwise)\n"
            "  --shard-mb N       HF: tensor MB per safetensors file at most (default 5000)\n"
            "  --seed N           random seed (default 1)\n"
            "  --threads N        generator threads (default: all cores)\n");
}

int cmd_mkmodel(int argc, char **argv) {
    const char *cfg_name = NULL, *out = NULL, *fmt = NULL;
    int64_t layers = -1, seed = 1, threads = 0, shard_mb = SHARD_MB_DEFAULT;
    st_dtype wt = ST_DTYPE_BF16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mk_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--config")) {
            if (!val) { fprintf(stderr, "strata mkmodel: --config needs a value\n"); return 2; }
            cfg_name = val, i++;
        } else if (!strcmp(a, "--layers")) {
            if (!tool_parse_i64(val, 1, 100000, "--layers", &layers)) return 2;
            i++;
        } else if (!strcmp(a, "--seed")) {
            if (!tool_parse_i64(val, 0, INT64_MAX, "--seed", &seed)) return 2;
            i++;
        } else if (!strcmp(a, "--shard-mb")) {
            if (!tool_parse_i64(val, 1, INT64_MAX / 1000000, "--shard-mb", &shard_mb)) return 2;
            i++;
        } else if (!strcmp(a, "--threads")) {
            if (!tool_parse_i64(val, 1, 1024, "--threads", &threads)) return 2;
            i++;
        } else if (!strcmp(a, "--dtype")) {
            if (!val || !st_dtype_parse(val, &wt) ||
                !(wt == ST_DTYPE_BF16 || wt == ST_DTYPE_F16 || wt == ST_DTYPE_F32 || wt == ST_DTYPE_Q8_0 ||
                  wt == ST_DTYPE_Q4_0 || wt == ST_DTYPE_Q4_1)) {
                fprintf(stderr, "strata mkmodel: --dtype takes bf16, f16, f32, q8_0, q4_0 or q4_1\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--format")) {
            if (!val || (strcmp(val, "hf") && strcmp(val, "gguf"))) {
                fprintf(stderr, "strata mkmodel: --format takes hf or gguf\n");
                return 2;
            }
            fmt = val, i++;
        } else if (a[0] == '-') {
            fprintf(stderr, "strata mkmodel: unknown option '%s'\n", a);
            mk_usage(stderr);
            return 2;
        } else if (!out) {
            out = a;
        } else {
            fprintf(stderr, "strata mkmodel: unexpected argument '%s'\n", a);
            return 2;
        }
    }
    if (!cfg_name || !out) {
        mk_usage(stderr);
        return 2;
    }
    mk_config c;
    bool found = false;
    for (size_t i = 0; i < sizeof k_configs / sizeof k_configs[0]; i++)
        if (!strcmp(cfg_name, k_configs[i].name)) c = k_configs[i], found = true;
    if (!found) {
        fprintf(stderr, "strata mkmodel: unknown config '%s' (llama3-8b, llama3-70b, smollm2-135m, tiny)\n", cfg_name);
        return 2;
    }
    if (layers > 0) c.layers = layers;
    const bool quant = st_dtype_get(wt)->quantized;
    const size_t out_len = strlen(out);
    const bool gguf_name = out_len >= 5 && !strcasecmp(out + out_len - 5, ".gguf");
    const bool gguf = fmt ? !strcmp(fmt, "gguf") : quant || gguf_name;
    if (!gguf && quant) {
        fprintf(stderr, "strata mkmodel: %s weights need --format gguf (safetensors holds f32/f16/bf16)\n",
                st_dtype_name(wt));
        return 2;
    }
    if (c.hidden % 32 || c.inter % 32 || (c.heads * c.head_dim) % 32) {
        fprintf(stderr, "strata mkmodel: internal: shapes must be multiples of 32\n");
        return 2;
    }

    mk_list l = {0};
    float *divisors = NULL;
    if (!build_tensors(&c, wt, gguf, &l)) {
        fprintf(stderr, "strata mkmodel: out of memory\n");
        return 1;
    }
    if (gguf && c.llama3_rope) { /* llama3 scaling travels as frequency divisors */
        st_config sc;
        memset(&sc, 0, sizeof sc);
        sc.head_dim = c.head_dim;
        sc.rope_theta = c.rope_theta;
        sc.rope_scaling = ST_ROPE_SCALING_LLAMA3;
        sc.rope_factor = 8.0;
        sc.rope_low_freq_factor = 1.0;
        sc.rope_high_freq_factor = 4.0;
        sc.rope_original_max_pos = 8192;
        divisors = malloc((size_t)(c.head_dim / 2) * sizeof(float));
        if (!divisors) return 1;
        st_gguf_llama3_rope_divisors(&sc, divisors);
        add_tensor(&l, "rope_freqs.weight", "rope_freqs.weight", ST_DTYPE_F32, 1, c.head_dim / 2, true,
                   INIT_NORM, 0);
        /* after the embedding, as llama.cpp orders it */
        mk_tensor rf = l.t[l.n - 1];
        rf.values = divisors;
        memmove(&l.t[2], &l.t[1], (size_t)(l.n - 2) * sizeof rf);
        l.t[1] = rf;
    }

    /* files: HF shards of at most shard_mb MB of tensors (a tensor never splits) */
    uint64_t total = 0;
    int n_files = 1;
    {
        uint64_t in_file = 0;
        for (int i = 0; i < l.n; i++) {
            if (!gguf && in_file > 0 && in_file + l.t[i].nbytes > (uint64_t)shard_mb * 1000000u) n_files++, in_file = 0;
            l.t[i].file = n_files - 1;
            in_file += l.t[i].nbytes;
            total += l.t[i].nbytes;
        }
    }
    st_pool *pool = NULL;
    if (st_pool_init((int)threads, &pool) != STRATA_OK) {
        tool_print_error("mkmodel");
        return 1;
    }
    uint8_t *bufs[2] = {malloc(BATCH_BYTES), malloc(BATCH_BYTES)};
    int rc = 1;
    uint64_t written = 0, hdr_total = 0;
    const double t0 = st_time_now();
    char path[4096];
    if (!bufs[0] || !bufs[1]) {
        fprintf(stderr, "strata mkmodel: out of memory\n");
        goto done;
    }
    if (!gguf && mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "strata mkmodel: cannot create directory %s: %s\n", out, strerror(errno));
        goto done;
    }
    for (int f = 0; f < n_files; f++) {
        sbuf hdr = {0};
        uint64_t hb = 0;
        bool ok;
        if (gguf) {
            snprintf(path, sizeof path, "%s", out);
            ok = gguf_header(&c, wt, &l, &hdr, &hb);
        } else {
            if (n_files == 1) snprintf(path, sizeof path, "%s/model.safetensors", out);
            else snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", out, f + 1, n_files);
            ok = st_header(&l, f, &hdr, &hb);
        }
        if (!ok) {
            free(hdr.p);
            fprintf(stderr, "strata mkmodel: out of memory\n");
            goto done;
        }
        const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) {
            free(hdr.p);
            fprintf(stderr, "strata mkmodel: cannot create %s: %s\n", path, strerror(errno));
            goto done;
        }
        ok = write_all(fd, hdr.p, hdr.n, 0);
        free(hdr.p);
        hdr_total += hb;
        ok = ok && write_data(&l, f, fd, path, (uint64_t)seed, pool, bufs, &written);
        /* the file ends with the last tensor's bytes (GGUF: padded to the alignment) */
        uint64_t end = 0;
        for (int i = 0; i < l.n; i++)
            if (l.t[i].file == f && l.t[i].off + l.t[i].nbytes > end) end = l.t[i].off + l.t[i].nbytes;
        if (gguf) end = (end + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
        ok = ok && ftruncate(fd, (off_t)end) == 0;
        /* on disk before the command returns (and in its time): a 40 GB file's writeback went on for
         * a minute after, slowing the CPU's reads of whatever ran next (a hybrid bench measured 46
         * GB/s instead of 60-70, tenth session) */
        ok = ok && fdatasync(fd) == 0;
        if (close(fd) != 0) ok = false;
        if (!ok) {
            fprintf(stderr, "strata mkmodel: writing %s failed: %s\n", path, strerror(errno ? errno : EIO));
            unlink(path);
            goto done;
        }
    }
    if (!gguf) {
        sbuf t = {0};
        hf_config(&c, wt, &t);
        snprintf(path, sizeof path, "%s/config.json", out);
        bool ok = !t.oom && write_text(path, t.p);
        free(t.p);
        if (ok && n_files > 1) {
            sbuf ix = {0};
            sb_printf(&ix, "{\n  \"metadata\": {\"total_size\": %" PRIu64 "},\n  \"weight_map\": {\n", total);
            for (int i = 0; i < l.n; i++)
                sb_printf(&ix, "    \"%s\": \"model-%05d-of-%05d.safetensors\"%s\n", l.t[i].hf, l.t[i].file + 1,
                          n_files, i + 1 < l.n ? "," : "");
            sb_printf(&ix, "  }\n}\n");
            snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
            ok = !ix.oom && write_text(path, ix.p);
            free(ix.p);
        }
        if (!ok) {
            fprintf(stderr, "strata mkmodel: cannot write %s\n", path);
            goto done;
        }
    }
    {
        const double dt = st_time_now() - t0;
        printf("wrote %s: %s, %" PRId64 " layers, %s%s, %d tensor%s in %d file%s, %" PRIu64
               " bytes of tensors (%.2f GB) in %.1f s (%.2f GB/s, %d threads)\n",
               out, c.name, c.layers, st_dtype_name(wt), gguf ? " gguf" : " safetensors", l.n, l.n == 1 ? "" : "s",
               n_files, n_files == 1 ? "" : "s", total, total / 1e9, dt, (written + hdr_total) / 1e9 / (dt > 0 ? dt : 1),
               st_pool_threads(pool));
    }
    rc = 0;
done:
    free(bufs[0]);
    free(bufs[1]);
    free(divisors);
    free(l.t);
    st_pool_free(pool);
    return rc;
}

/* GGUF reader and writer tests.
 *
 * The reader is checked against GGUF bytes built here by hand (independent of
 * gguf_write.c): a valid tiny llama with every supported tensor type, its
 * metadata API, then one malformed variant per failure mode (status and
 * message), a truncation sweep over every header prefix and a corruption
 * fuzz (no crash, no out-of-bounds read under ASan). The writer is checked by
 * a round trip: a HF directory written here -> st_gguf_write_model (f32, q8_0,
 * f16) -> st_model_open, config and (un-permuted, dequantized) weights equal. */
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/quant.h"
#include "loader/gguf.h"
#include "loader/loader.h"
#include "testutil.h"

/* ---- a byte builder ---- */
typedef struct {
    uint8_t *p;
    size_t n, cap;
} gb;

static void gb_put(gb *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 1024;
        while (nc < b->n + n) nc *= 2;
        b->p = realloc(b->p, nc);
        ST_ASSERT(b->p);
        b->cap = nc;
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void gb_u8(gb *b, uint8_t v) { gb_put(b, &v, 1); }
static void gb_u32(gb *b, uint32_t v) { gb_put(b, &v, 4); }
static void gb_u64(gb *b, uint64_t v) { gb_put(b, &v, 8); }
static void gb_f32(gb *b, float v) { gb_put(b, &v, 4); }
static void gb_str(gb *b, const char *s) { gb_u64(b, strlen(s)); gb_put(b, s, strlen(s)); }

/* GGUF value type numbers (written literally: independent of gguf.h). */
enum { T_U8 = 0, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 };

static void kv_hdr(gb *b, int *n, const char *key, uint32_t type) {
    gb_str(b, key);
    gb_u32(b, type);
    (*n)++;
}
static void kv_u32(gb *b, int *n, const char *key, uint32_t v) { kv_hdr(b, n, key, T_U32); gb_u32(b, v); }
static void kv_f32(gb *b, int *n, const char *key, float v) { kv_hdr(b, n, key, T_F32); gb_f32(b, v); }
static void kv_str(gb *b, int *n, const char *key, const char *v) { kv_hdr(b, n, key, T_STR); gb_str(b, v); }

/* ggml type -> (block elems, block bytes) as documented for GGUF. */
static void ggml_block(uint32_t t, uint64_t *be, uint64_t *bb) {
    switch (t) {
    case 0: *be = 1; *bb = 4; break;     /* f32 */
    case 1: *be = 1; *bb = 2; break;     /* f16 */
    case 30: *be = 1; *bb = 2; break;    /* bf16 */
    case 2: *be = 32; *bb = 18; break;   /* q4_0 */
    case 3: *be = 32; *bb = 20; break;   /* q4_1 */
    case 8: *be = 32; *bb = 34; break;   /* q8_0 */
    case 12: *be = 256; *bb = 144; break;/* q4_K */
    case 14: *be = 256; *bb = 210; break;/* q6_K */
    case 13: *be = 256; *bb = 176; break;/* q5_K (unsupported by strata) */
    default: *be = 1; *bb = 1; break;
    }
}

typedef struct {
    char name[64];
    uint32_t type;
    uint32_t n_dims;
    uint64_t ne[5];     /* ggml order: ne[0] innermost */
    int64_t off_delta;  /* added to the computed offset (bad-input cases) */
    uint64_t nbytes;    /* filled by build */
    uint64_t abs;       /* filled by build: absolute file offset */
} tspec;

#define HID 256
#define FFN 512
#define VOC 32
#define NH 4
#define NKV 2
#define HD 64

typedef struct {
    const char *arch;
    uint32_t version;
    uint32_t alignment;       /* 0: no general.alignment key (default 32) */
    const char *omit_key;     /* a standard key to leave out */
    void (*extra)(gb *b, int *n_kv); /* extra KVs after the standard ones */
    tspec t[32];
    int nt;
    uint64_t data_start;      /* filled by build */
} mspec;

static void add_t(mspec *m, const char *name, uint32_t type, uint32_t nd, uint64_t ne0, uint64_t ne1) {
    tspec *t = &m->t[m->nt++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type;
    t->n_dims = nd;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
}

/* The standard tiny llama: layer 0 exercises the quantized types, layer 1
 * the plain ones. */
static void std_model(mspec *m, bool tied) {
    memset(m, 0, sizeof *m);
    m->arch = "llama";
    m->version = 3;
    add_t(m, "token_embd.weight", 14, 2, HID, VOC);
    add_t(m, "rope_freqs.weight", 0, 1, HD / 2, 0);
    const uint32_t types[2][9] = {
        /* attn_norm q k v o ffn_norm gate up down */
        {0, 8, 2, 3, 12, 0, 1, 30, 14},
        {0, 30, 1, 0, 8, 0, 12, 2, 3},
    };
    for (int l = 0; l < 2; l++) {
        char nm[64];
#define T(i, suffix, nd, a, b) snprintf(nm, sizeof nm, "blk.%d." suffix, l); add_t(m, nm, types[l][i], nd, a, b)
        T(0, "attn_norm.weight", 1, HID, 0);
        T(1, "attn_q.weight", 2, HID, NH * HD);
        T(2, "attn_k.weight", 2, HID, NKV * HD);
        T(3, "attn_v.weight", 2, HID, NKV * HD);
        T(4, "attn_output.weight", 2, NH * HD, HID);
        T(5, "ffn_norm.weight", 1, HID, 0);
        T(6, "ffn_gate.weight", 2, HID, FFN);
        T(7, "ffn_up.weight", 2, HID, FFN);
        T(8, "ffn_down.weight", 2, FFN, HID);
#undef T
    }
    add_t(m, "output_norm.weight", 0, 1, HID, 0);
    if (!tied) add_t(m, "output.weight", 8, 2, HID, VOC);
}

static int find_t(mspec *m, const char *name) {
    for (int i = 0; i < m->nt; i++)
        if (!strcmp(m->t[i].name, name)) return i;
    ST_ASSERT(!"no such tensor in spec");
    return -1;
}

static uint8_t pat_byte(int t, uint64_t i) { return (uint8_t)(t * 31 + i * 7 + (i >> 8) * 13); }

static void std_kvs(const mspec *m, gb *b, int *n) {
#define K(name) (!m->omit_key || strcmp(m->omit_key, name))
    if (K("general.architecture")) kv_str(b, n, "general.architecture", m->arch);
    if (m->alignment) kv_u32(b, n, "general.alignment", m->alignment);
    if (K("llama.context_length")) kv_u32(b, n, "llama.context_length", 2048);
    if (K("llama.embedding_length")) kv_u32(b, n, "llama.embedding_length", HID);
    if (K("llama.block_count")) kv_u32(b, n, "llama.block_count", 2);
    if (K("llama.feed_forward_length")) kv_u32(b, n, "llama.feed_forward_length", FFN);
    if (K("llama.attention.head_count")) kv_u32(b, n, "llama.attention.head_count", NH);
    if (K("llama.attention.head_count_kv")) kv_u32(b, n, "llama.attention.head_count_kv", NKV);
    if (K("llama.attention.layer_norm_rms_epsilon"))
        kv_f32(b, n, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    if (K("llama.rope.freq_base")) kv_f32(b, n, "llama.rope.freq_base", 500000.0f);
    if (K("tokenizer.ggml.model")) kv_str(b, n, "tokenizer.ggml.model", "gpt2");
    if (K("tokenizer.ggml.tokens")) {
        kv_hdr(b, n, "tokenizer.ggml.tokens", T_ARR);
        gb_u32(b, T_STR);
        gb_u64(b, VOC);
        for (int i = 0; i < VOC; i++) {
            char tok[16];
            snprintf(tok, sizeof tok, "tok%d", i);
            gb_str(b, tok);
        }
    }
    if (K("tokenizer.ggml.scores")) {
        kv_hdr(b, n, "tokenizer.ggml.scores", T_ARR);
        gb_u32(b, T_F32);
        gb_u64(b, VOC);
        for (int i = 0; i < VOC; i++) gb_f32(b, -0.5f * (float)i);
    }
    if (K("tokenizer.ggml.token_type")) {
        kv_hdr(b, n, "tokenizer.ggml.token_type", T_ARR);
        gb_u32(b, T_I32);
        gb_u64(b, VOC);
        for (int i = 0; i < VOC; i++) gb_u32(b, (uint32_t)(i < 4 ? 3 : 1));
    }
    if (K("tokenizer.ggml.bos_token_id")) kv_u32(b, n, "tokenizer.ggml.bos_token_id", 1);
    if (K("tokenizer.ggml.eos_token_id")) kv_u32(b, n, "tokenizer.ggml.eos_token_id", 2);
    if (K("tokenizer.ggml.eot_token_id")) kv_u32(b, n, "tokenizer.ggml.eot_token_id", 3);
    /* one of every scalar type for the getters */
    if (K("test.u8")) { kv_hdr(b, n, "test.u8", T_U8); gb_u8(b, 200); }
    if (K("test.i8")) { kv_hdr(b, n, "test.i8", T_I8); gb_u8(b, (uint8_t)-5); }
    if (K("test.u16")) { kv_hdr(b, n, "test.u16", T_U16); uint16_t v = 60000; gb_put(b, &v, 2); }
    if (K("test.i16")) { kv_hdr(b, n, "test.i16", T_I16); int16_t v = -30000; gb_put(b, &v, 2); }
    if (K("test.i32")) { kv_hdr(b, n, "test.i32", T_I32); gb_u32(b, (uint32_t)-7); }
    if (K("test.u64")) { kv_hdr(b, n, "test.u64", T_U64); gb_u64(b, 1ull << 40); }
    if (K("test.i64")) { kv_hdr(b, n, "test.i64", T_I64); gb_u64(b, (uint64_t)-(1ll << 40)); }
    if (K("test.f64")) { kv_hdr(b, n, "test.f64", T_F64); double v = 0.125; gb_put(b, &v, 8); }
    if (K("test.bool")) { kv_hdr(b, n, "test.bool", T_BOOL); gb_u8(b, 1); }
    if (K("test.empty")) {
        kv_hdr(b, n, "test.empty", T_ARR);
        gb_u32(b, T_U16);
        gb_u64(b, 0);
    }
#undef K
}

/* Serializes m into b. Tensor data bytes follow pat_byte, except f32 tensors
 * which hold 1 + i/1000. */
static void build(mspec *m, gb *b) {
    memset(b, 0, sizeof *b);
    gb_put(b, "GGUF", 4);
    gb_u32(b, m->version);
    gb_u64(b, (uint64_t)m->nt);
    size_t nkv_pos = b->n;
    gb_u64(b, 0);
    int n_kv = 0;
    std_kvs(m, b, &n_kv);
    if (m->extra) m->extra(b, &n_kv);
    uint64_t nkv64 = (uint64_t)n_kv;
    memcpy(b->p + nkv_pos, &nkv64, 8);
    uint64_t align = m->alignment ? m->alignment : 32, off = 0;
    for (int i = 0; i < m->nt; i++) {
        tspec *t = &m->t[i];
        uint64_t be, bb, rows = 1;
        ggml_block(t->type, &be, &bb);
        for (uint32_t d = 1; d < t->n_dims && d < 5; d++) rows *= t->ne[d];
        t->nbytes = t->ne[0] / be * bb * rows;
        gb_str(b, t->name);
        gb_u32(b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) gb_u64(b, t->ne[d]);
        gb_u32(b, t->type);
        gb_u64(b, off + (uint64_t)t->off_delta);
        t->abs = off + (uint64_t)t->off_delta; /* relative for now */
        off += (t->nbytes + align - 1) / align * align;
    }
    while (b->n % align) gb_u8(b, 0);
    m->data_start = b->n;
    for (int i = 0; i < m->nt; i++) {
        tspec *t = &m->t[i];
        t->abs += m->data_start;
        /* bad-input specs: a shifted tensor has no data of its own; after a
         * huge one the file simply ends */
        if (t->nbytes > (1u << 26)) break;
        if (t->off_delta) continue;
        while (b->n < t->abs) gb_u8(b, 0);
        for (uint64_t k = 0; k < t->nbytes; k++) {
            if (t->type == 0) {
                if (k % 4 == 0) gb_f32(b, 1.0f + (float)(k / 4) / 1000.0f);
            } else {
                gb_u8(b, pat_byte(i, k));
            }
        }
    }
}

static const char *tmp_path(const char *name) {
    static char buf[4][1200];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 1200, "%s/%s", test_tmpdir("gguf"), name);
    return p;
}

static strata_status open_bytes(const char *path, const void *p, size_t n, st_model_files **m) {
    ST_ASSERT(test_write_file(path, p, n));
    st_clear_error();
    return st_gguf_open(path, m);
}

/* Builds spec m to a file and opens it; returns the status (closes on OK). */
static strata_status open_spec(mspec *m, const char *fname) {
    gb b;
    build(m, &b);
    st_model_files *mf = NULL;
    strata_status st = open_bytes(tmp_path(fname), b.p, b.n, &mf);
    if (st == STRATA_OK) CHECK(mf != NULL); else CHECK(mf == NULL);
    st_model_close(mf);
    free(b.p);
    return st;
}

/* ---- the valid file ---- */
static void test_valid(void) {
    mspec m;
    std_model(&m, false);
    gb b;
    build(&m, &b);
    const char *path = tmp_path("valid.gguf");
    st_model_files *mf = NULL;
    strata_status st = open_bytes(path, b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (st != STRATA_OK) { free(b.p); return; }
    CHECK(mf->format == ST_FORMAT_GGUF);
    CHECK(mf->n_files == 1 && mf->files[0].size == b.n);
    CHECK(mf->n_tensors == m.nt);
    const st_config *c = &mf->config;
    CHECK(c->vocab_size == VOC);
    CHECK(c->hidden_size == HID);
    CHECK(c->intermediate_size == FFN);
    CHECK(c->n_layers == 2);
    CHECK(c->n_heads == NH && c->n_kv_heads == NKV && c->head_dim == HD);
    CHECK(c->max_position_embeddings == 2048);
    CHECK(c->rms_norm_eps == 1e-5f);
    CHECK(c->rope_theta == 500000.0);
    CHECK(c->rope_scaling == ST_ROPE_SCALING_NONE);
    CHECK(!c->tie_word_embeddings);
    CHECK(c->rope_interleaved);
    CHECK(c->bos_token_id == 1);
    CHECK(c->n_eos == 2 && c->eos_token_ids[0] == 2 && c->eos_token_ids[1] == 3);

    static const struct { const char *g, *hf; st_dtype dt; } names[] = {
        {"token_embd.weight", "model.embed_tokens.weight", ST_DTYPE_Q6_K},
        {"rope_freqs.weight", "rope_freqs.weight", ST_DTYPE_F32},
        {"blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", ST_DTYPE_F32},
        {"blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", ST_DTYPE_Q8_0},
        {"blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", ST_DTYPE_Q4_0},
        {"blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", ST_DTYPE_Q4_1},
        {"blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", ST_DTYPE_Q4_K},
        {"blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", ST_DTYPE_F32},
        {"blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", ST_DTYPE_F16},
        {"blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", ST_DTYPE_BF16},
        {"blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", ST_DTYPE_Q6_K},
        {"blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", ST_DTYPE_BF16},
        {"blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight", ST_DTYPE_Q4_K},
        {"output_norm.weight", "model.norm.weight", ST_DTYPE_F32},
        {"output.weight", "lm_head.weight", ST_DTYPE_Q8_0},
    };
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const st_tensor_desc *t = st_model_find(mf, names[k].hf);
        CHECK_MSG(t != NULL, "%s", names[k].hf);
        if (!t) continue;
        int i = find_t(&m, names[k].g);
        const tspec *s = &m.t[i];
        CHECK_MSG(t->dtype == names[k].dt, "%s dtype %d", names[k].hf, t->dtype);
        CHECK(t->n_dims == (int)s->n_dims);
        for (uint32_t d = 0; d < s->n_dims; d++) CHECK(t->shape[d] == (int64_t)s->ne[s->n_dims - 1 - d]);
        CHECK(t->file == 0);
        CHECK_MSG(t->offset == s->abs, "%s offset %llu want %llu", names[k].hf,
                  (unsigned long long)t->offset, (unsigned long long)s->abs);
        CHECK(t->nbytes == s->nbytes);
        CHECK(t->offset % 32 == 0);
        const uint8_t *d = st_tensor_data(mf, t);
        CHECK(d == mf->files[0].data + s->abs); /* no copy: points into the mapping */
        CHECK(d && memcmp(d, b.p + s->abs, s->nbytes) == 0);
        char *back = st_gguf_name_from_hf(names[k].hf);
        CHECK(back && strcmp(back, names[k].g) == 0);
        free(back);
    }
    /* every tensor of the spec is there with its size */
    uint64_t total = 0;
    for (int64_t i = 0; i < mf->n_tensors; i++) total += mf->tensors[i].nbytes;
    uint64_t want = 0;
    for (int i = 0; i < m.nt; i++) want += m.t[i].nbytes;
    CHECK(total == want);
    const st_tensor_desc *q = st_model_find(mf, "model.layers.0.self_attn.q_proj.weight");
    CHECK(q && q->shape[0] == NH * HD && q->shape[1] == HID && q->nbytes == NH * HD * (HID / 32) * 34);
    const st_tensor_desc *rf = st_model_find(mf, "rope_freqs.weight");
    CHECK(rf && rf->n_dims == 1 && rf->shape[0] == HD / 2);

    /* metadata API */
    const st_gguf_meta *g = mf->gguf;
    CHECK(g != NULL);
    CHECK(st_gguf_version(g) == 3);
    CHECK(st_gguf_alignment(g) == 32);
    CHECK(st_gguf_data_offset(g) == m.data_start);
    CHECK(st_gguf_find_key(g, "general.architecture") == 0);
    CHECK(st_gguf_find_key(g, "nope") == -1);
    CHECK(st_gguf_key_type(g, 0) == ST_GGUF_TYPE_STRING);
    CHECK(!strcmp(st_gguf_key_name(g, 0), "general.architecture"));
    const char *s;
    uint64_t len;
    CHECK(st_gguf_get_str(g, "tokenizer.ggml.model", &s, &len) == STRATA_OK && !strcmp(s, "gpt2") && len == 4);
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    int64_t i64;
    float f32;
    double f64;
    bool bl;
    CHECK(st_gguf_get_u32(g, "llama.block_count", &u32) == STRATA_OK && u32 == 2);
    CHECK(st_gguf_get_u32(g, "test.u8", &u32) == STRATA_OK && u32 == 200);
    CHECK(st_gguf_get_i32(g, "test.i8", &i32) == STRATA_OK && i32 == -5);
    CHECK(st_gguf_get_u32(g, "test.u16", &u32) == STRATA_OK && u32 == 60000);
    CHECK(st_gguf_get_i32(g, "test.i16", &i32) == STRATA_OK && i32 == -30000);
    CHECK(st_gguf_get_i32(g, "test.i32", &i32) == STRATA_OK && i32 == -7);
    CHECK_ERR(st_gguf_get_u32(g, "test.i32", &u32), STRATA_ERR_FORMAT, "test.i32", "out of range");
    CHECK_ERR(st_gguf_get_u32(g, "test.u64", &u32), STRATA_ERR_FORMAT, "test.u64", "out of range");
    CHECK(st_gguf_get_u64(g, "test.u64", &u64) == STRATA_OK && u64 == (1ull << 40));
    CHECK(st_gguf_get_i64(g, "test.i64", &i64) == STRATA_OK && i64 == -(1ll << 40));
    CHECK(st_gguf_get_f64(g, "test.f64", &f64) == STRATA_OK && f64 == 0.125);
    CHECK(st_gguf_get_f32(g, "llama.rope.freq_base", &f32) == STRATA_OK && f32 == 500000.0f);
    CHECK(st_gguf_get_bool(g, "test.bool", &bl) == STRATA_OK && bl);
    CHECK_ERR(st_gguf_get_u32(g, "missing.key", &u32), STRATA_ERR_NOT_FOUND, "missing.key", path);
    CHECK_ERR(st_gguf_get_u32(g, "general.architecture", &u32), STRATA_ERR_FORMAT,
              "general.architecture", "string");
    CHECK_ERR(st_gguf_get_str(g, "llama.block_count", &s, NULL), STRATA_ERR_FORMAT, "llama.block_count");
    CHECK_ERR(st_gguf_get_f32(g, "test.bool", &f32), STRATA_ERR_FORMAT, "test.bool");
    int64_t ki;
    st_gguf_type et;
    uint64_t cnt;
    CHECK(st_gguf_get_arr(g, "tokenizer.ggml.tokens", &ki, &et, &cnt) == STRATA_OK &&
          et == ST_GGUF_TYPE_STRING && cnt == VOC);
    CHECK(st_gguf_arr_str(g, ki, 17, &s, &len) && len == 5 && !memcmp(s, "tok17", 5));
    CHECK(st_gguf_arr_str(g, ki, 0, &s, &len) && len == 4 && !memcmp(s, "tok0", 4));
    CHECK(!st_gguf_arr_str(g, ki, VOC, &s, &len));
    CHECK(!st_gguf_arr_f64(g, ki, 0, &f64));
    CHECK(st_gguf_get_arr(g, "tokenizer.ggml.scores", &ki, &et, &cnt) == STRATA_OK &&
          et == ST_GGUF_TYPE_FLOAT32 && cnt == VOC);
    CHECK(st_gguf_arr_f64(g, ki, 3, &f64) && f64 == -1.5);
    CHECK(!st_gguf_arr_i64(g, ki, 3, &i64));
    CHECK(!st_gguf_arr_str(g, ki, 3, &s, &len));
    CHECK(st_gguf_get_arr(g, "tokenizer.ggml.token_type", &ki, &et, &cnt) == STRATA_OK &&
          et == ST_GGUF_TYPE_INT32);
    CHECK(st_gguf_arr_i64(g, ki, 2, &i64) && i64 == 3);
    CHECK(st_gguf_arr_i64(g, ki, 9, &i64) && i64 == 1);
    CHECK(st_gguf_arr_f64(g, ki, 9, &f64) && f64 == 1.0);
    CHECK(!st_gguf_arr_i64(g, ki, VOC, &i64));
    CHECK(st_gguf_get_arr(g, "test.empty", &ki, &et, &cnt) == STRATA_OK && cnt == 0 &&
          et == ST_GGUF_TYPE_UINT16);
    CHECK_ERR(st_gguf_get_arr(g, "llama.block_count", &ki, &et, &cnt), STRATA_ERR_FORMAT,
              "llama.block_count", "array");
    const uint8_t *raw;
    st_gguf_key_raw(g, st_gguf_find_key(g, "llama.block_count"), &raw, &len);
    CHECK(len == 4 && raw[0] == 2 && raw[1] == 0);

    /* GGUF -> GGUF (f32): tokenizer keys copied verbatim, no second Q/K
     * permutation (the source is already interleaved), every tensor's values
     * (dequantized from q4_K, q6_K, ...) preserved bit for bit. */
    const char *re = tmp_path("rewritten.gguf");
    st = st_gguf_write_model(mf, ST_DTYPE_F32, re);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    st_model_files *m2 = NULL;
    if (st == STRATA_OK) {
        st = st_gguf_open(re, &m2);
        CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    }
    if (m2) {
        const st_gguf_meta *g2 = m2->gguf;
        CHECK(st_gguf_get_arr(g2, "tokenizer.ggml.tokens", &ki, &et, &cnt) == STRATA_OK && cnt == VOC);
        CHECK(st_gguf_arr_str(g2, ki, 31, &s, &len) && len == 5 && !memcmp(s, "tok31", 5));
        CHECK(st_gguf_get_arr(g2, "tokenizer.ggml.scores", &ki, &et, &cnt) == STRATA_OK &&
              et == ST_GGUF_TYPE_FLOAT32 && st_gguf_arr_f64(g2, ki, 5, &f64) && f64 == -2.5);
        CHECK(st_gguf_get_str(g2, "tokenizer.ggml.model", &s, NULL) == STRATA_OK && !strcmp(s, "gpt2"));
        CHECK(st_gguf_find_key(g2, "test.u8") < 0); /* only tokenizer.* travels */
        CHECK(m2->config.bos_token_id == 1 && m2->config.n_eos == 2 && m2->config.eos_token_ids[1] == 3);
        CHECK(m2->n_tensors == mf->n_tensors);
        float *ra = malloc(sizeof(float) * FFN), *rb = malloc(sizeof(float) * FFN);
        for (int64_t i = 0; i < mf->n_tensors; i++) {
            const st_tensor_desc *a = &mf->tensors[i], *d2 = st_model_find(m2, a->name);
            CHECK_MSG(d2 != NULL, "%s", a->name);
            if (!d2) continue;
            CHECK(d2->dtype == ST_DTYPE_F32 && d2->n_dims == a->n_dims);
            CHECK(memcmp(d2->shape, a->shape, sizeof a->shape) == 0);
            int64_t cols = a->shape[a->n_dims - 1], rows = a->n_dims == 2 ? a->shape[0] : 1;
            size_t rba = st_dtype_row_bytes(a->dtype, cols);
            const uint8_t *da = st_tensor_data(mf, a), *db = st_tensor_data(m2, d2);
            bool same = true;
            for (int64_t r = 0; r < rows && same; r++) {
                st_dequantize_row(a->dtype, da + r * rba, ra, cols);
                st_dequantize_row(ST_DTYPE_F32, db + r * cols * 4, rb, cols);
                same = memcmp(ra, rb, (size_t)cols * 4) == 0;
            }
            CHECK_MSG(same, "%s changed in GGUF -> GGUF", a->name);
        }
        free(ra);
        free(rb);
    }
    st_model_close(m2);
    st_model_close(mf);

    /* st_model_open dispatches .gguf files here */
    st = st_model_open(path, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    st_model_close(mf);

    /* version 2 has the same layout and is accepted */
    b.p[4] = 2;
    st = open_bytes(tmp_path("v2.gguf"), b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) CHECK(st_gguf_version(mf->gguf) == 2);
    st_model_close(mf);
    free(b.p);

    /* tied: no output.weight */
    std_model(&m, true);
    CHECK(open_spec(&m, "tied.gguf") == STRATA_OK);
    build(&m, &b);
    st = open_bytes(tmp_path("tied.gguf"), b.p, b.n, &mf);
    CHECK(st == STRATA_OK && mf->config.tie_word_embeddings && !st_model_find(mf, "lm_head.weight"));
    st_model_close(mf);
    free(b.p);
}

/* ---- variants of the metadata ---- */
static void extra_linear(gb *b, int *n) {
    kv_str(b, n, "llama.rope.scaling.type", "linear");
    kv_f32(b, n, "llama.rope.scaling.factor", 4.0f);
    kv_u32(b, n, "llama.vocab_size", VOC);
    kv_u32(b, n, "llama.attention.key_length", HD);
    kv_u32(b, n, "tokenizer.ggml.eom_token_id", 5);
}
static void extra_yarn(gb *b, int *n) { kv_str(b, n, "llama.rope.scaling.type", "yarn"); }
static void extra_unknown_type(gb *b, int *n) { kv_hdr(b, n, "test.bad", 13); gb_u32(b, 0); }
static void extra_nested(gb *b, int *n) {
    kv_hdr(b, n, "test.nested", T_ARR);
    gb_u32(b, T_ARR);
    gb_u64(b, 1);
    gb_u32(b, T_U8);
    gb_u64(b, 1);
    gb_u8(b, 7);
}
static void extra_dup_key(gb *b, int *n) { kv_u32(b, n, "llama.block_count", 2); }
static void extra_block_count_str(gb *b, int *n) { kv_str(b, n, "llama.block_count", "2"); }
static void extra_bad_bool(gb *b, int *n) { kv_hdr(b, n, "test.bool2", T_BOOL); gb_u8(b, 2); }
static void extra_nul_key(gb *b, int *n) {
    gb_u64(b, 5);
    gb_put(b, "ab\0cd", 5);
    gb_u32(b, T_U8);
    gb_u8(b, 1);
    (*n)++;
}
static void extra_huge_str(gb *b, int *n) {
    kv_hdr(b, n, "test.huge", T_STR);
    gb_u64(b, 1ull << 63);
}
static void extra_huge_arr(gb *b, int *n) {
    kv_hdr(b, n, "test.hugearr", T_ARR);
    gb_u32(b, T_U32);
    gb_u64(b, 1ull << 62); /* * 4 bytes overflows u64 */
}
static void extra_huge_strarr(gb *b, int *n) {
    kv_hdr(b, n, "test.hugestrarr", T_ARR);
    gb_u32(b, T_STR);
    gb_u64(b, 1ull << 61);
}
static void extra_bad_strarr(gb *b, int *n) { /* 3 strings, the second claims 2^40 bytes */
    kv_hdr(b, n, "test.badstrarr", T_ARR);
    gb_u32(b, T_STR);
    gb_u64(b, 3);
    gb_str(b, "a");
    gb_u64(b, 1ull << 40);
    gb_str(b, "c");
}
static void extra_unknown_elem(gb *b, int *n) {
    kv_hdr(b, n, "test.arr99", T_ARR);
    gb_u32(b, 99);
    gb_u64(b, 0);
}

static void test_variants(void) {
    mspec m;
    st_model_files *mf = NULL;
    gb b;
    std_model(&m, false);
    m.extra = extra_linear;
    build(&m, &b);
    strata_status st = open_bytes(tmp_path("linear.gguf"), b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        CHECK(mf->config.rope_scaling == ST_ROPE_SCALING_LINEAR && mf->config.rope_factor == 4.0);
        CHECK(mf->config.n_eos == 3 && mf->config.eos_token_ids[2] == 5);
    }
    st_model_close(mf);
    free(b.p);

    /* head_count_kv defaults to head_count (then K/V shapes must follow) */
    std_model(&m, false);
    m.omit_key = "llama.attention.head_count_kv";
    for (int l = 0; l < 2; l++) {
        char nm[64];
        snprintf(nm, sizeof nm, "blk.%d.attn_k.weight", l);
        m.t[find_t(&m, nm)].ne[1] = NH * HD;
        snprintf(nm, sizeof nm, "blk.%d.attn_v.weight", l);
        m.t[find_t(&m, nm)].ne[1] = NH * HD;
    }
    build(&m, &b);
    st = open_bytes(tmp_path("nokv.gguf"), b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) CHECK(mf->config.n_kv_heads == NH);
    st_model_close(mf);
    free(b.p);

    /* vocab from token_embd rows when there is neither key nor tokens */
    std_model(&m, false);
    m.omit_key = "tokenizer.ggml.tokens";
    build(&m, &b);
    st = open_bytes(tmp_path("novocab.gguf"), b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) CHECK(mf->config.vocab_size == VOC);
    st_model_close(mf);
    free(b.p);

    /* alignment 64 */
    std_model(&m, false);
    m.alignment = 64;
    build(&m, &b);
    st = open_bytes(tmp_path("align64.gguf"), b.p, b.n, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        CHECK(st_gguf_alignment(mf->gguf) == 64);
        for (int64_t i = 0; i < mf->n_tensors; i++) CHECK(mf->tensors[i].offset % 64 == 0);
    }
    st_model_close(mf);
    free(b.p);
}

/* ---- malformed files: one per failure mode ---- */
static void test_bad(void) {
    mspec m;
    gb b;
    st_model_files *mf = NULL;
    const char *p;

    std_model(&m, false);
    build(&m, &b);
    uint8_t *c = malloc(b.n);
    size_t n = b.n;

#define FRESH() memcpy(c, b.p, n)
    /* bad magic */
    FRESH();
    memcpy(c, "GGUX", 4);
    p = tmp_path("magic.gguf");
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_FORMAT, p, "magic");
    CHECK(mf == NULL);
    /* empty file */
    p = tmp_path("empty.gguf");
    CHECK_ERR(open_bytes(p, c, 0, &mf), STRATA_ERR_FORMAT, p, "magic");
    /* versions */
    FRESH();
    c[4] = 1;
    p = tmp_path("v1.gguf");
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_UNSUPPORTED, p, "version 1");
    FRESH();
    c[4] = 4;
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_UNSUPPORTED, p, "version 4");
    FRESH();
    c[4] = 0;
    c[7] = 3;
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_UNSUPPORTED, p, "big-endian");
    /* absurd counts: fail fast, no allocation */
    FRESH();
    uint64_t huge = 1ull << 60;
    memcpy(c + 8, &huge, 8);
    p = tmp_path("ntensors.gguf");
    double t0 = st_time_now();
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_IO, p, "truncated", "1152921504606846976 tensors");
    CHECK(st_time_now() - t0 < 0.5);
    FRESH();
    memcpy(c + 16, &huge, 8);
    p = tmp_path("nkv.gguf");
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_IO, p, "truncated", "keys");
    FRESH();
    huge = UINT64_MAX;
    memcpy(c + 8, &huge, 8);
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_IO, p, "truncated");
    /* first key's length 2^63 */
    FRESH();
    huge = 1ull << 63;
    memcpy(c + 24, &huge, 8);
    p = tmp_path("keylen.gguf");
    CHECK_ERR(open_bytes(p, c, n, &mf), STRATA_ERR_IO, p, "truncated", "key #0", "9223372036854775808");
    free(c);
    free(b.p);

    /* KV-level failures */
    struct { void (*extra)(gb *, int *); strata_status want; const char *s1, *s2; } kvcases[] = {
        {extra_unknown_type, STRATA_ERR_FORMAT, "'test.bad'", "unknown value type 13"},
        {extra_nested, STRATA_ERR_UNSUPPORTED, "'test.nested'", "nested"},
        {extra_dup_key, STRATA_ERR_FORMAT, "duplicate", "'llama.block_count'"},
        {extra_bad_bool, STRATA_ERR_FORMAT, "'test.bool2'", "not 0 or 1"},
        {extra_nul_key, STRATA_ERR_FORMAT, "NUL", "key #"},
        {extra_huge_str, STRATA_ERR_IO, "'test.huge'", "truncated"},
        {extra_huge_arr, STRATA_ERR_IO, "'test.hugearr'", "truncated"},
        {extra_huge_strarr, STRATA_ERR_IO, "'test.hugestrarr'", "truncated"},
        {extra_bad_strarr, STRATA_ERR_IO, "'test.badstrarr'", "1099511627776"},
        {extra_unknown_elem, STRATA_ERR_FORMAT, "'test.arr99'", "unknown element type 99"},
        {extra_yarn, STRATA_ERR_UNSUPPORTED, "'yarn'", "llama.rope.scaling.type"},
    };
    for (size_t k = 0; k < sizeof kvcases / sizeof kvcases[0]; k++) {
        std_model(&m, false);
        m.extra = kvcases[k].extra;
        char fname[32];
        snprintf(fname, sizeof fname, "kv%zu.gguf", k);
        st_clear_error();
        strata_status st = open_spec(&m, fname);
        CHECK_ERR(st, kvcases[k].want, tmp_path(fname), kvcases[k].s1, kvcases[k].s2);
    }
    std_model(&m, false);
    m.omit_key = "llama.block_count";
    m.extra = extra_block_count_str;
    p = tmp_path("bcstr.gguf");
    CHECK_ERR(open_spec(&m, "bcstr.gguf"), STRATA_ERR_FORMAT, p, "'llama.block_count'", "string");

    /* config-level failures */
    std_model(&m, false);
    m.arch = "gpt2";
    p = tmp_path("arch.gguf");
    CHECK_ERR(open_spec(&m, "arch.gguf"), STRATA_ERR_UNSUPPORTED, p, "'gpt2'");
    std_model(&m, false);
    m.omit_key = "general.architecture";
    p = tmp_path("noarch.gguf");
    CHECK_ERR(open_spec(&m, "noarch.gguf"), STRATA_ERR_NOT_FOUND, p, "general.architecture");
    std_model(&m, false);
    m.omit_key = "llama.block_count";
    p = tmp_path("nobc.gguf");
    CHECK_ERR(open_spec(&m, "nobc.gguf"), STRATA_ERR_NOT_FOUND, p, "llama.block_count", "missing");
    std_model(&m, false);
    m.omit_key = "llama.attention.layer_norm_rms_epsilon";
    p = tmp_path("noeps.gguf");
    CHECK_ERR(open_spec(&m, "noeps.gguf"), STRATA_ERR_NOT_FOUND, p, "layer_norm_rms_epsilon");
    std_model(&m, false);
    m.alignment = 48;
    p = tmp_path("align48.gguf");
    CHECK_ERR(open_spec(&m, "align48.gguf"), STRATA_ERR_FORMAT, p, "general.alignment", "power of two");

    /* tensor-level failures */
    std_model(&m, false);
    snprintf(m.t[find_t(&m, "blk.1.attn_q.weight")].name, 64, "blk.0.attn_q.weight");
    p = tmp_path("dupname.gguf");
    CHECK_ERR(open_spec(&m, "dupname.gguf"), STRATA_ERR_FORMAT, p, "duplicate tensor name",
              "model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight");
    std_model(&m, false);
    add_t(&m, "lm_head.weight", 8, 2, HID, VOC); /* a second name for output.weight */
    p = tmp_path("dupname2.gguf");
    CHECK_ERR(open_spec(&m, "dupname2.gguf"), STRATA_ERR_FORMAT, p, "duplicate tensor name",
              "'lm_head.weight'");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_v.weight")].off_delta = 16;
    p = tmp_path("unaligned.gguf");
    CHECK_ERR(open_spec(&m, "unaligned.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_v.weight'",
              "not a multiple of the alignment 32");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_v.weight")].off_delta = -64;
    p = tmp_path("overlap.gguf");
    CHECK_ERR(open_spec(&m, "overlap.gguf"), STRATA_ERR_FORMAT, p, "overlap", "'blk.0.attn_k.weight'",
              "'blk.0.attn_v.weight'");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.ffn_up.weight")].off_delta = 1 << 30;
    p = tmp_path("pastend.gguf");
    CHECK_ERR(open_spec(&m, "pastend.gguf"), STRATA_ERR_IO, p, "'blk.0.ffn_up.weight'", "past the end");

    std_model(&m, false);
    build(&m, &b);
    p = tmp_path("cut.gguf");
    CHECK_ERR(open_bytes(p, b.p, b.n - 1, &mf), STRATA_ERR_IO, p, "'output.weight'", "past the end");
    free(b.p);

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_norm.weight")].n_dims = 5;
    for (int d = 1; d < 5; d++) m.t[find_t(&m, "blk.0.attn_norm.weight")].ne[d] = 1;
    p = tmp_path("ndims.gguf");
    CHECK_ERR(open_spec(&m, "ndims.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_norm.weight'",
              "5 dimensions");
    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_norm.weight")].n_dims = 0;
    CHECK_ERR(open_spec(&m, "ndims.gguf"), STRATA_ERR_FORMAT, p, "0 dimensions");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_q.weight")].ne[0] = 48;
    p = tmp_path("block.gguf");
    CHECK_ERR(open_spec(&m, "block.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_q.weight'",
              "row length 48", "q8_0 block size 32");
    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_output.weight")].ne[0] = 128;
    CHECK_ERR(open_spec(&m, "block.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_output.weight'",
              "q4_k block size 256");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_output.weight")].type = 13;
    p = tmp_path("type13.gguf");
    CHECK_ERR(open_spec(&m, "type13.gguf"), STRATA_ERR_UNSUPPORTED, p, "'blk.0.attn_output.weight'",
              "type 13");
    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_output.weight")].type = 1234;
    CHECK_ERR(open_spec(&m, "type13.gguf"), STRATA_ERR_UNSUPPORTED, p, "type 1234");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_q.weight")].ne[1] = 2;
    m.t[find_t(&m, "blk.0.attn_q.weight")].ne[2] = 1ull << 62;
    m.t[find_t(&m, "blk.0.attn_q.weight")].n_dims = 3;
    p = tmp_path("ovf.gguf");
    CHECK_ERR(open_spec(&m, "ovf.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_q.weight'", "overflows");

    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_norm.weight")].ne[0] = 1ull << 62; /* 2^62 f32 = 2^64 bytes */
    CHECK_ERR(open_spec(&m, "ovf.gguf"), STRATA_ERR_FORMAT, p, "'blk.0.attn_norm.weight'",
              "byte size overflows");
    std_model(&m, false);
    m.t[find_t(&m, "blk.0.attn_norm.weight")].ne[0] = 1ull << 40; /* fits, but not in the file */
    CHECK_ERR(open_spec(&m, "ovf.gguf"), STRATA_ERR_IO, p, "'blk.0.attn_norm.weight'", "past the end");

    /* shapes that disagree with the metadata: st_model_validate */
    std_model(&m, false);
    m.t[find_t(&m, "blk.1.attn_q.weight")].ne[1] = NH * HD / 2;
    p = tmp_path("shape.gguf");
    CHECK_ERR(open_spec(&m, "shape.gguf"), STRATA_ERR_MISMATCH, p, "model.layers.1.self_attn.q_proj.weight");
    std_model(&m, false);
    m.nt--; /* drop output.weight ... */
    m.t[find_t(&m, "output_norm.weight")].type = 8; /* ... and the norm becomes q8_0 */
    m.t[find_t(&m, "output_norm.weight")].ne[0] = HID;
    p = tmp_path("qnorm.gguf");
    CHECK(open_spec(&m, "qnorm.gguf") != STRATA_OK);
#undef FRESH
}

/* ---- hyperparameters: the rules config.json obeys (st_config_check) ----
 * Each case replaces (or adds) one key; the file must be refused with
 * STRATA_ERR_FORMAT and a message naming the file and the key. */
static struct {
    const char *key;
    uint32_t type;  /* T_U32, T_I32 or T_F32 */
    uint32_t u;
    float f;
} g_kv;

static void extra_one(gb *b, int *n) {
    kv_hdr(b, n, g_kv.key, g_kv.type);
    if (g_kv.type == T_F32) gb_f32(b, g_kv.f);
    else gb_u32(b, g_kv.u);
}

static strata_status open_with(const char *key, uint32_t type, uint32_t u, float f, const char *fname) {
    mspec m;
    std_model(&m, false);
    m.omit_key = key; /* a standard key is replaced; others are added */
    g_kv.key = key;
    g_kv.type = type;
    g_kv.u = u;
    g_kv.f = f;
    m.extra = extra_one;
    return open_spec(&m, fname);
}

static void test_hparams(void) {
    const char *eps = "llama.attention.layer_norm_rms_epsilon";
    struct {
        const char *key;
        uint32_t type, u;
        float f;
        const char *what; /* in the message besides the key */
    } bad[] = {
        {eps, T_F32, 0, NAN, "out of range (0, 1)"},
        {eps, T_F32, 0, -1.0f, "out of range (0, 1)"},
        {eps, T_F32, 0, 0.0f, "out of range (0, 1)"},
        {eps, T_F32, 0, 2.0f, "out of range (0, 1)"},
        {eps, T_F32, 0, INFINITY, "out of range (0, 1)"},
        {"llama.rope.dimension_count", T_U32, 63, 0, "whole head of 64"},
        {"llama.rope.dimension_count", T_U32, 32, 0, "partial rotary"},
        {"llama.rope.dimension_count", T_U32, 1000, 0, "1000"},
        {"llama.rope.dimension_count", T_I32, (uint32_t)-2, 0, "rotary"},
        {"tokenizer.ggml.eos_token_id", T_U32, 1000000000u, 0, "outside the vocabulary of 32"},
        {"tokenizer.ggml.eos_token_id", T_U32, VOC, 0, "outside the vocabulary"},
        {"tokenizer.ggml.eos_token_id", T_I32, (uint32_t)-7, 0, "not a valid token id"},
        {"tokenizer.ggml.eot_token_id", T_U32, 4000, 0, "outside the vocabulary"},
        {"tokenizer.ggml.eom_token_id", T_U32, 99, 0, "outside the vocabulary"},
        {"tokenizer.ggml.bos_token_id", T_U32, VOC, 0, "outside the vocabulary"},
        {"tokenizer.ggml.bos_token_id", T_I32, (uint32_t)-3, 0, "not a valid token id"},
        {"llama.vocab_size", T_U32, 3, 0, "= 3 is not a valid token id: outside the vocabulary of 3"}, /* eos 2 ok, eot 3 not */
        {"llama.context_length", T_U32, 1, 0, "out of range [2, "},
        {"llama.context_length", T_U32, 0x7fffffffu, 0, "out of range [2, "},
        {"llama.attention.head_count_kv", T_U32, 3, 0, "llama.attention.head_count=4"},
        {"llama.attention.head_count_kv", T_U32, 8, 0, "not a multiple"},
        {"llama.attention.key_length", T_U32, 63, 0, "even"},
        {"llama.rope.freq_base", T_F32, 0, INFINITY, "positive and finite"},
        {"llama.rope.freq_base", T_F32, 0, NAN, "positive and finite"},
        {"llama.rope.freq_base", T_F32, 0, -5.0f, "positive and finite"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char fname[32];
        snprintf(fname, sizeof fname, "hp%zu.gguf", k);
        st_clear_error();
        strata_status st = open_with(bad[k].key, bad[k].type, bad[k].u, bad[k].f, fname);
        char quoted[96];
        /* a vocabulary too small is reported at the first id outside it */
        snprintf(quoted, sizeof quoted, "%s",
                 strcmp(bad[k].key, "llama.vocab_size") ? bad[k].key : "tokenizer.ggml.eot_token_id");
        CHECK_MSG(st == STRATA_ERR_FORMAT, "case %zu (%s): status %d: %s", k, bad[k].key, st,
                  st_last_error());
        CHECK_ERR(st, STRATA_ERR_FORMAT, tmp_path(fname), quoted, bad[k].what);
    }
    /* the values that pass: a full rotary dimension count, -1 as "no token" */
    struct {
        const char *key;
        uint32_t type, u;
        float f;
    } good[] = {
        {"llama.rope.dimension_count", T_U32, HD, 0},
        {"tokenizer.ggml.bos_token_id", T_I32, (uint32_t)-1, 0},
        {"tokenizer.ggml.eos_token_id", T_U32, VOC - 1, 0},
        {"llama.context_length", T_U32, 2, 0},
        {eps, T_F32, 0, 0.5f},
    };
    for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
        char fname[32];
        snprintf(fname, sizeof fname, "hpok%zu.gguf", k);
        st_clear_error();
        strata_status st = open_with(good[k].key, good[k].type, good[k].u, good[k].f, fname);
        CHECK_MSG(st == STRATA_OK, "good case %zu (%s): %s", k, good[k].key, st_last_error());
    }
}

/* Every prefix of the header region and a sample of longer prefixes must fail
 * cleanly; random byte corruption must never crash. */
static void test_truncation_and_fuzz(void) {
    mspec m;
    gb b;
    std_model(&m, false);
    build(&m, &b);
    const char *p = tmp_path("trunc.gguf");
    int bad = 0;
    for (size_t len = 0; len < b.n; len += (len < m.data_start + 64 ? 1 : 9973)) {
        st_model_files *mf = NULL;
        strata_status st = open_bytes(p, b.p, len, &mf);
        if (st == STRATA_OK || mf || !strstr(st_last_error(), p) ||
            !(st == STRATA_ERR_IO || st == STRATA_ERR_FORMAT)) {
            if (bad++ < 5)
                fprintf(stderr, "truncated at %zu: status %d, message: %s\n", len, st, st_last_error());
        }
        st_model_close(mf);
    }
    CHECK_MSG(bad == 0, "%d truncated prefixes misbehaved", bad);

    /* fuzz: corrupt 1-4 random bytes of the header region (patched in place
     * in one file, restored after each open) */
    ST_ASSERT(test_write_file(p, b.p, b.n));
    FILE *fp = fopen(p, "r+b");
    ST_ASSERT(fp);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int opened = 0;
    for (int it = 0; it < 3000; it++) {
        size_t pos[4];
        int k = 1 + (int)((rng >> 60) & 3);
        for (int j = 0; j < k; j++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            pos[j] = (size_t)((rng >> 33) % m.data_start);
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            uint8_t v = (it & 1) ? (uint8_t)(rng >> 56) : (uint8_t)(b.p[pos[j]] ^ (1u << ((rng >> 40) & 7)));
            fseek(fp, (long)pos[j], SEEK_SET);
            fputc(v, fp);
        }
        fflush(fp);
        st_model_files *mf = NULL;
        st_clear_error();
        strata_status st = st_gguf_open(p, &mf);
        if (st == STRATA_OK) {
            opened++;
            /* whatever opened must be self-consistent */
            for (int64_t i = 0; i < mf->n_tensors; i++) {
                const st_tensor_desc *t = &mf->tensors[i];
                CHECK(t->offset + t->nbytes <= mf->files[0].size);
                CHECK(st_tensor_data(mf, t) != NULL);
            }
        } else {
            CHECK(mf == NULL && strstr(st_last_error(), p));
        }
        st_model_close(mf);
        for (int j = 0; j < k; j++) {
            fseek(fp, (long)pos[j], SEEK_SET);
            fputc(b.p[pos[j]], fp);
        }
        fflush(fp);
    }
    fclose(fp);
    printf("fuzz: %d of 3000 corrupted files still opened (corruption in ignored bytes)\n", opened);
    free(b.p);
}

/* st_gguf_open_mem: the same model as from the file, the buffer borrowed
 * (never freed or unmapped), every prefix refused naming the given name. */
static void test_open_mem(void) {
    mspec m;
    gb b;
    std_model(&m, false);
    build(&m, &b);
    st_model_files *ff = NULL, *mf = NULL;
    CHECK(open_bytes(tmp_path("mem.gguf"), b.p, b.n, &ff) == STRATA_OK);
    st_clear_error();
    strata_status st = st_gguf_open_mem(b.p, b.n, "image.gguf", &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (ff && mf) {
        CHECK(!strcmp(mf->path, "image.gguf") && mf->n_files == 1 && mf->files[0].data == b.p &&
              mf->files[0].size == b.n && mf->files[0].fd == -1 && mf->files[0].borrowed);
        CHECK(!memcmp(&mf->config, &ff->config, sizeof mf->config));
        CHECK(mf->n_tensors == ff->n_tensors);
        for (int64_t i = 0; i < mf->n_tensors && i < ff->n_tensors; i++) {
            const st_tensor_desc *a = &mf->tensors[i], *c = &ff->tensors[i];
            CHECK(!strcmp(a->name, c->name) && a->offset == c->offset && a->nbytes == c->nbytes &&
                  !memcmp(st_tensor_data(mf, a), st_tensor_data(ff, c), (size_t)a->nbytes));
        }
        CHECK(st_gguf_n_keys(mf->gguf) == st_gguf_n_keys(ff->gguf));
    }
    st_model_close(mf);
    st_model_close(ff);
    CHECK(b.p[0] == 'G'); /* still the caller's */
    int bad = 0;
    for (size_t len = 0; len < m.data_start + 64; len++) {
        mf = NULL;
        st_clear_error();
        st = st_gguf_open_mem(b.p, len, "image.gguf", &mf);
        if (st == STRATA_OK || mf || !strstr(st_last_error(), "image.gguf")) bad++;
        st_model_close(mf);
    }
    CHECK_MSG(bad == 0, "%d prefixes opened or named no file", bad);
    mf = NULL;
    CHECK_ERR(st_gguf_open_mem(NULL, 0, "empty.gguf", &mf), STRATA_ERR_FORMAT, "empty.gguf", "not a GGUF file");
    CHECK(mf == NULL);
    CHECK_ERR(st_gguf_open_mem(NULL, 8, "null.gguf", &mf), STRATA_ERR_INVALID_ARG, "null.gguf");
    free(b.p);
}

/* ---- writer round trip through a HF directory ---- */

#define R_HID 64
#define R_NH 4
#define R_NKV 2
#define R_HD 16
#define R_FFN 128
#define R_VOC 48
#define R_L 2

typedef struct {
    char name[96];
    int rows, cols; /* cols 0: 1-D */
    bool bf16;
    float *data;    /* rows*max(cols,1) */
} hf_tensor;

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static int make_hf_tensors(hf_tensor *t, bool tied) {
    int n = 0;
    uint64_t seed = 12345;
#define ADD(nm, r, c_, b16) do { snprintf(t[n].name, 96, "%s", nm); t[n].rows = r; t[n].cols = c_; \
        t[n].bf16 = b16; size_t cnt = (size_t)(r) * (size_t)((c_) ? (c_) : 1); \
        t[n].data = malloc(cnt * sizeof(float)); \
        for (size_t i = 0; i < cnt; i++) { float v = frand(&seed) * ((c_) ? 0.5f : 0.1f) + ((c_) ? 0.f : 1.f); \
            t[n].data[i] = b16 ? st_bf16_to_f32(st_f32_to_bf16(v)) : v; } n++; } while (0)
    ADD("model.embed_tokens.weight", R_VOC, R_HID, false);
    for (int l = 0; l < R_L; l++) {
        char nm[96];
#define L(suffix, r, c_, b16) snprintf(nm, sizeof nm, "model.layers.%d." suffix, l); ADD(nm, r, c_, b16)
        L("input_layernorm.weight", R_HID, 0, false);
        L("self_attn.q_proj.weight", R_NH * R_HD, R_HID, false);
        L("self_attn.k_proj.weight", R_NKV * R_HD, R_HID, l == 1);
        L("self_attn.v_proj.weight", R_NKV * R_HD, R_HID, false);
        L("self_attn.o_proj.weight", R_HID, R_NH * R_HD, false);
        L("post_attention_layernorm.weight", R_HID, 0, false);
        L("mlp.gate_proj.weight", R_FFN, R_HID, false);
        L("mlp.up_proj.weight", R_FFN, R_HID, true);
        L("mlp.down_proj.weight", R_HID, R_FFN, false);
#undef L
    }
    ADD("model.norm.weight", R_HID, 0, false);
    if (!tied) ADD("lm_head.weight", R_VOC, R_HID, false);
#undef ADD
    return n;
}

/* Writes config.json + model.safetensors for the tensors. */
static void write_hf_dir(const char *dir, hf_tensor *t, int n, bool tied) {
    char path[1200];
    char cfg[2048];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\",\n"
             " \"vocab_size\": %d, \"hidden_size\": %d, \"intermediate_size\": %d,\n"
             " \"num_hidden_layers\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d,\n"
             " \"head_dim\": %d, \"max_position_embeddings\": 131072, \"rms_norm_eps\": 1e-05,\n"
             " \"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0,\n"
             "   \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,\n"
             "   \"original_max_position_embeddings\": 8192},\n"
             " \"tie_word_embeddings\": %s, \"bos_token_id\": 1, \"eos_token_id\": [2, 7],\n"
             " \"hidden_act\": \"silu\", \"torch_dtype\": \"float32\"}\n",
             R_VOC, R_HID, R_FFN, R_L, R_NH, R_NKV, R_HD, tied ? "true" : "false");
    snprintf(path, sizeof path, "%s/config.json", dir);
    ST_ASSERT(test_write_file(path, cfg, strlen(cfg)));

    gb hdr = {0}, data = {0};
    gb_put(&hdr, "{", 1);
    for (int i = 0; i < n; i++) {
        size_t cnt = (size_t)t[i].rows * (size_t)(t[i].cols ? t[i].cols : 1);
        size_t begin = data.n;
        for (size_t k = 0; k < cnt; k++) {
            if (t[i].bf16) { uint16_t h = st_f32_to_bf16(t[i].data[k]); gb_put(&data, &h, 2); }
            else gb_f32(&data, t[i].data[k]);
        }
        char e[4096];
        if (t[i].cols)
            snprintf(e, sizeof e, "%s\"%s\": {\"dtype\": \"%s\", \"shape\": [%d, %d], \"data_offsets\": [%zu, %zu]}",
                     i ? ", " : "", t[i].name, t[i].bf16 ? "BF16" : "F32", t[i].rows, t[i].cols, begin, data.n);
        else
            snprintf(e, sizeof e, "%s\"%s\": {\"dtype\": \"%s\", \"shape\": [%d], \"data_offsets\": [%zu, %zu]}",
                     i ? ", " : "", t[i].name, t[i].bf16 ? "BF16" : "F32", t[i].rows, begin, data.n);
        gb_put(&hdr, e, strlen(e));
    }
    const char *meta = ", \"__metadata__\": {\"format\": \"pt\"}}";
    gb_put(&hdr, meta, strlen(meta));
    while (hdr.n % 8) gb_put(&hdr, " ", 1);
    gb file = {0};
    gb_u64(&file, hdr.n);
    gb_put(&file, hdr.p, hdr.n);
    gb_put(&file, data.p, data.n);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ST_ASSERT(test_write_file(path, file.p, file.n));
    free(hdr.p);
    free(data.p);
    free(file.p);
}

/* Independent llama3 divisors (the formula of the brief, in double). */
static double ref_divisor(int i) {
    double inv = 1.0 / pow(500000.0, 2.0 * i / R_HD);
    double wavelen = 2 * M_PI / inv, orig = 8192, low = 1, high = 4, factor = 8;
    if (wavelen < orig / high) return 1;
    if (wavelen > orig / low) return factor;
    double smooth = (orig / wavelen - low) / (high - low);
    return inv / ((1 - smooth) * inv / factor + smooth * inv);
}

static void check_roundtrip(hf_tensor *t, int n, const st_model_files *src, const char *out,
                            st_dtype type, bool tied) {
    st_model_files *g = NULL;
    strata_status st = st_model_open(out, &g);
    CHECK_MSG(st == STRATA_OK, "%s: %s", out, st_last_error());
    if (st) return;
    const st_config *a = &src->config, *b = &g->config;
    CHECK(a->rope_scaling == ST_ROPE_SCALING_LLAMA3 && !a->rope_interleaved);
    CHECK(b->vocab_size == a->vocab_size && b->hidden_size == a->hidden_size);
    CHECK(b->intermediate_size == a->intermediate_size && b->n_layers == a->n_layers);
    CHECK(b->n_heads == a->n_heads && b->n_kv_heads == a->n_kv_heads && b->head_dim == a->head_dim);
    CHECK(b->max_position_embeddings == a->max_position_embeddings);
    CHECK(b->rms_norm_eps == a->rms_norm_eps);
    CHECK(b->rope_theta == a->rope_theta);
    CHECK(b->rope_scaling == ST_ROPE_SCALING_NONE && b->rope_interleaved);
    CHECK(b->tie_word_embeddings == a->tie_word_embeddings && b->tie_word_embeddings == tied);
    CHECK(b->bos_token_id == a->bos_token_id && b->n_eos == a->n_eos);
    for (int i = 0; i < a->n_eos && i < b->n_eos; i++) CHECK(b->eos_token_ids[i] == a->eos_token_ids[i]);
    CHECK(g->n_tensors == n + 1); /* + rope_freqs */

    const st_tensor_desc *rf = st_model_find(g, "rope_freqs.weight");
    CHECK(rf && rf->dtype == ST_DTYPE_F32 && rf->n_dims == 1 && rf->shape[0] == R_HD / 2);
    if (rf) {
        const float *d = st_tensor_data(g, rf);
        int n_one = 0, n_factor = 0, n_mid = 0;
        for (int i = 0; i < R_HD / 2; i++) {
            double want = ref_divisor(i);
            CHECK_MSG(fabs(d[i] - want) <= 1e-5 * want, "rope_freqs[%d] = %g, want %g", i, d[i], want);
            n_one += d[i] == 1.0f;
            n_factor += d[i] == 8.0f;
            n_mid += d[i] > 1.0f && d[i] < 8.0f;
        }
        CHECK(n_one > 0 && n_factor > 0 && n_mid > 0); /* all three branches covered */
    }
    if (tied) CHECK(!st_model_find(g, "lm_head.weight"));

    float *row = malloc(sizeof(float) * 1024);
    for (int i = 0; i < n; i++) {
        const st_tensor_desc *d = st_model_find(g, t[i].name);
        CHECK_MSG(d != NULL, "%s missing", t[i].name);
        if (!d) continue;
        int cols = t[i].cols ? t[i].cols : t[i].rows;
        int rows = t[i].cols ? t[i].rows : 1;
        CHECK(d->dtype == (t[i].cols ? type : ST_DTYPE_F32));
        CHECK(d->n_dims == (t[i].cols ? 2 : 1));
        CHECK(d->shape[0] == t[i].rows && (!t[i].cols || d->shape[1] == t[i].cols));
        bool is_q = strstr(t[i].name, "q_proj") != NULL, is_k = strstr(t[i].name, "k_proj") != NULL;
        int heads = is_q ? R_NH : R_NKV;
        size_t rb = st_dtype_row_bytes(d->dtype, cols);
        const uint8_t *base = st_tensor_data(g, d);
        double max_err = 0;
        bool bad = false;
        for (int r = 0; r < rows && !bad; r++) {
            /* GGUF row r holds source row h*hd + (j%2)*hd/2 + j/2 */
            int sr = r;
            if (is_q || is_k) {
                int hd = rows / heads, h = r / hd, j = r % hd;
                sr = h * hd + (j % 2) * (hd / 2) + j / 2;
            }
            st_dequantize_row(d->dtype, base + (size_t)r * rb, row, cols);
            const float *want = t[i].data + (size_t)sr * cols;
            for (int b0 = 0; b0 < cols; b0 += 32) {
                float amax = 0;
                for (int k = b0; k < b0 + 32 && k < cols; k++) amax = fmaxf(amax, fabsf(want[k]));
                for (int k = b0; k < b0 + 32 && k < cols; k++) {
                    double e = fabs((double)row[k] - want[k]);
                    if (e > max_err) max_err = e;
                    double tol = 0;
                    if (d->dtype == ST_DTYPE_Q8_0) tol = amax / 127.0 * 0.5 * 1.002 + amax / 127.0 * 127 / 2048.0;
                    else if (d->dtype == ST_DTYPE_F16) tol = fabs(want[k]) / 2048.0 + 1e-7;
                    if (e > tol) {
                        CHECK_MSG(false, "%s (%s) row %d col %d: %g vs %g (tol %g)", t[i].name,
                                  st_dtype_name(d->dtype), r, k, row[k], want[k], tol);
                        bad = true;
                        break;
                    }
                }
                if (bad) break;
            }
        }
        if (d->dtype == ST_DTYPE_Q8_0) CHECK(max_err > 0); /* it was really quantized */
    }
    free(row);

    /* the GGUF we wrote, converted again, is the same file: no double permutation */
    char again[1300];
    snprintf(again, sizeof again, "%s.again.gguf", out);
    st = st_gguf_write_model(g, type, again);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    if (st == STRATA_OK && st_file_read_all(out, &x, &nx) == STRATA_OK &&
        st_file_read_all(again, &y, &ny) == STRATA_OK) {
        /* the only difference allowed: none (general.file_type etc. identical) */
        CHECK_MSG(nx == ny && memcmp(x, y, nx) == 0, "re-conversion of %s differs", out);
    }
    free(x);
    free(y);
    st_model_close(g);
}

static void test_writer(void) {
    for (int tied = 0; tied < 2; tied++) {
        hf_tensor t[32];
        int n = make_hf_tensors(t, tied);
        char dir[1100];
        snprintf(dir, sizeof dir, "%s", tmp_path(tied ? "hf_tied" : "hf"));
        ST_ASSERT(mkdir(dir, 0755) == 0 || access(dir, F_OK) == 0);
        write_hf_dir(dir, t, n, tied);
        st_model_files *src = NULL;
        strata_status st = st_model_open(dir, &src);
        CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
        if (st) return;
        const st_dtype types[] = {ST_DTYPE_F32, ST_DTYPE_Q8_0, ST_DTYPE_F16};
        for (size_t k = 0; k < 3; k++) {
            if (tied && types[k] != ST_DTYPE_F16) continue;
            char out[1200];
            snprintf(out, sizeof out, "%s/out_%s.gguf", dir, st_dtype_name(types[k]));
            st = st_gguf_write_model(src, types[k], out);
            CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
            if (st == STRATA_OK) check_roundtrip(t, n, src, out, types[k], tied);
        }
        /* writer errors */
        char out[1200];
        snprintf(out, sizeof out, "%s/no/such/dir/x.gguf", dir);
        CHECK_ERR(st_gguf_write_model(src, ST_DTYPE_F16, out), STRATA_ERR_IO, out, "cannot create");
        snprintf(out, sizeof out, "%s/model.safetensors", dir);
        CHECK_ERR(st_gguf_write_model(src, ST_DTYPE_F16, out), STRATA_ERR_INVALID_ARG, out,
                  "file of the source");
        snprintf(out, sizeof out, "%s/x.gguf", dir);
        CHECK_ERR(st_gguf_write_model(src, ST_DTYPE_Q4_K, out), STRATA_ERR_UNSUPPORTED, out, "q4_k");
        CHECK(access(out, F_OK) != 0);
        /* a write that fails midway (file size limit): error, partial file removed */
        struct rlimit old;
        if (!tied && getrlimit(RLIMIT_FSIZE, &old) == 0) {
            void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
            struct rlimit lim = old;
            lim.rlim_cur = 3000;
            ST_ASSERT(setrlimit(RLIMIT_FSIZE, &lim) == 0);
            st = st_gguf_write_model(src, ST_DTYPE_F32, out);
            ST_ASSERT(setrlimit(RLIMIT_FSIZE, &old) == 0);
            signal(SIGXFSZ, prev);
            CHECK_ERR(st, STRATA_ERR_IO, out, "fail");
            CHECK(access(out, F_OK) != 0);
        }
        st_model_close(src);
        for (int i = 0; i < n; i++) free(t[i].data);
    }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

int main(void) {
    test_valid();
    test_variants();
    test_bad();
    test_hparams();
    test_truncation_and_fuzz();
    test_open_mem();
    test_writer();
    /* keep the files of a failing run for inspection */
    if (!g_test_failures) nftw(test_tmpdir("gguf"), rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return test_finish("test_gguf");
}

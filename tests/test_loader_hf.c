/* Hugging Face loader: config.json parsing, safetensors (single and sharded),
 * validation against the config, and one test per malformed input.
 * Every fixture is generated here at run time under test_tmpdir(). */
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/dtype.h"
#include "loader/loader.h"
#include "testutil.h"

/* The tiny model: vocab 32, hidden 16, inter 32, 2 layers, 4 heads, 2 kv heads. */
enum { VOCAB = 32, HID = 16, INTER = 32, LAYERS = 2, HEADS = 4, KV = 2, HDIM = 4 };

/* ---- fixture writer ---------------------------------------------------------*/

typedef struct {
    char name[96];
    char dtype[16];   /* as written in the header */
    st_dtype dt;      /* how the data was encoded */
    int nd;
    int64_t shape[6];
    int shard;
    uint64_t lbeg;    /* where the bytes really are in the data section */
    uint64_t begin, end; /* what the header says (== lbeg, lbeg+nbytes unless mutated) */
    uint8_t *data;
    size_t nbytes;
    bool omit;        /* leave out of the header (but keep in the index) */
} ft_tensor;

typedef struct {
    ft_tensor t[48];
    int n;
    int n_shards;
    bool tied;
    st_dtype dt;
    uint64_t hdr_len[2]; /* N of each written file */
    /* single-file mutations */
    long truncate_by;          /* bytes cut from the end of the file */
    bool hdr_len_set;          /* write hdr_len_value instead of the true N */
    uint64_t hdr_len_value;
    const char *hdr_text;      /* raw header text instead of the generated one */
} ft_model;

static float ft_value(int k, int64_t i) { return (float)(((k * 7 + i) % 61) - 30) * 0.25f; }

static void ft_add(ft_model *m, const char *name, int nd, int64_t d0, int64_t d1, int shard) {
    ft_tensor *t = &m->t[m->n];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = m->dt;
    snprintf(t->dtype, sizeof t->dtype, "%s",
             m->dt == ST_DTYPE_F32 ? "F32" : m->dt == ST_DTYPE_F16 ? "F16" : "BF16");
    t->nd = nd;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shard = shard;
    int64_t numel = nd == 1 ? d0 : d0 * d1;
    size_t es = st_dtype_get(m->dt)->block_bytes;
    t->nbytes = (size_t)numel * es;
    t->data = malloc(t->nbytes);
    for (int64_t i = 0; i < numel; i++) {
        float v = ft_value(m->n, i);
        if (m->dt == ST_DTYPE_F32) {
            memcpy(t->data + 4 * i, &v, 4);
        } else {
            uint16_t h = m->dt == ST_DTYPE_F16 ? st_f32_to_f16(v) : st_f32_to_bf16(v);
            memcpy(t->data + 2 * i, &h, 2);
        }
    }
    m->n++;
}

static void ft_layout(ft_model *m) {
    uint64_t off[2] = {0, 0};
    for (int i = 0; i < m->n; i++) {
        ft_tensor *t = &m->t[i];
        t->lbeg = off[t->shard];
        t->begin = t->lbeg;
        t->end = t->lbeg + t->nbytes;
        off[t->shard] += t->nbytes;
    }
}

static void ft_build(ft_model *m, st_dtype dt, bool tied, int n_shards) {
    memset(m, 0, sizeof *m);
    m->dt = dt;
    m->tied = tied;
    m->n_shards = n_shards;
    ft_add(m, "model.embed_tokens.weight", 2, VOCAB, HID, 0);
    for (int l = 0; l < LAYERS; l++) {
        int s = n_shards > 1 ? l : 0;
        char n[96];
#define L_ADD(suffix, nd, d0, d1) \
    (snprintf(n, sizeof n, "model.layers.%d." suffix, l), ft_add(m, n, nd, d0, d1, s))
        L_ADD("input_layernorm.weight", 1, HID, 0);
        L_ADD("self_attn.q_proj.weight", 2, HEADS * HDIM, HID);
        L_ADD("self_attn.k_proj.weight", 2, KV * HDIM, HID);
        L_ADD("self_attn.v_proj.weight", 2, KV * HDIM, HID);
        L_ADD("self_attn.o_proj.weight", 2, HID, HEADS * HDIM);
        L_ADD("post_attention_layernorm.weight", 1, HID, 0);
        L_ADD("mlp.gate_proj.weight", 2, INTER, HID);
        L_ADD("mlp.up_proj.weight", 2, INTER, HID);
        L_ADD("mlp.down_proj.weight", 2, HID, INTER);
#undef L_ADD
    }
    ft_add(m, "model.norm.weight", 1, HID, 0, n_shards - 1);
    if (!tied) ft_add(m, "lm_head.weight", 2, VOCAB, HID, n_shards - 1);
    ft_layout(m);
}

static void ft_free(ft_model *m) {
    for (int i = 0; i < m->n; i++) free(m->t[i].data);
    m->n = 0;
}

static ft_tensor *ft_get(ft_model *m, const char *name) {
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->t[i].name, name) == 0) return &m->t[i];
    return NULL;
}

static void ft_remove(ft_model *m, const char *name) {
    ft_tensor *t = ft_get(m, name);
    if (!t) return;
    free(t->data);
    int i = (int)(t - m->t);
    memmove(&m->t[i], &m->t[i + 1], (size_t)(m->n - i - 1) * sizeof *t);
    m->n--;
    ft_layout(m);
}

static const char *shard_name(const ft_model *m, int s) {
    static char buf[2][64];
    if (m->n_shards == 1) return "model.safetensors";
    snprintf(buf[s], sizeof buf[s], "model-%05d-of-%05d.safetensors", s + 1, m->n_shards);
    return buf[s];
}

static char *path_in(const char *dir, const char *name) {
    static char buf[4][1024];
    static int k;
    char *b = buf[k++ & 3];
    snprintf(b, 1024, "%s/%s", dir, name);
    return b;
}

static void ft_write_shard(ft_model *m, const char *dir, int s) {
    static char hdr[32768];
    int p = 0;
    if (m->hdr_text) {
        p = snprintf(hdr, sizeof hdr, "%s", m->hdr_text);
    } else {
        p += snprintf(hdr + p, sizeof hdr - p, "{\"__metadata__\":{\"format\":\"pt\"}");
        for (int i = 0; i < m->n; i++) {
            const ft_tensor *t = &m->t[i];
            if (t->shard != s || t->omit) continue;
            p += snprintf(hdr + p, sizeof hdr - p, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name,
                          t->dtype);
            for (int d = 0; d < t->nd; d++)
                p += snprintf(hdr + p, sizeof hdr - p, "%s%lld", d ? "," : "", (long long)t->shape[d]);
            p += snprintf(hdr + p, sizeof hdr - p, "],\"data_offsets\":[%llu,%llu]}",
                          (unsigned long long)t->begin, (unsigned long long)t->end);
        }
        p += snprintf(hdr + p, sizeof hdr - p, "}");
        while (p % 8) hdr[p++] = ' '; /* padded like the reference writer */
        hdr[p] = 0;
    }
    uint64_t n = (uint64_t)p;
    m->hdr_len[s] = n;
    uint64_t data_len = 0;
    for (int i = 0; i < m->n; i++)
        if (m->t[i].shard == s && m->t[i].lbeg + m->t[i].nbytes > data_len)
            data_len = m->t[i].lbeg + m->t[i].nbytes;
    size_t total = 8 + (size_t)n + (size_t)data_len;
    uint8_t *buf = calloc(1, total);
    uint64_t nl = m->hdr_len_set ? m->hdr_len_value : n;
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(nl >> (8 * i));
    memcpy(buf + 8, hdr, (size_t)n);
    for (int i = 0; i < m->n; i++)
        if (m->t[i].shard == s) memcpy(buf + 8 + n + m->t[i].lbeg, m->t[i].data, m->t[i].nbytes);
    size_t wl = total;
    if (m->truncate_by > 0) wl = total > (size_t)m->truncate_by ? total - (size_t)m->truncate_by : 0;
    CHECK(test_write_file(path_in(dir, shard_name(m, s)), buf, wl));
    free(buf);
}

static void ft_write(ft_model *m, const char *dir) {
    for (int s = 0; s < m->n_shards; s++) ft_write_shard(m, dir, s);
    if (m->n_shards > 1) {
        static char idx[16384];
        int p = snprintf(idx, sizeof idx, "{\"metadata\":{\"total_size\":0},\"weight_map\":{");
        for (int i = 0; i < m->n; i++)
            p += snprintf(idx + p, sizeof idx - p, "%s\"%s\":\"%s\"", i ? "," : "", m->t[i].name,
                          shard_name(m, m->t[i].shard));
        p += snprintf(idx + p, sizeof idx - p, "}}\n");
        CHECK(test_write_file(path_in(dir, "model.safetensors.index.json"), idx, (size_t)p));
    }
}

/* config.json text. `extra` goes in the middle and must end with a comma. */
static const char *cfg_text(const char *model_type, int hidden, int layers, bool tied,
                            const char *extra) {
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{\n"
             "  \"architectures\": [\"LlamaForCausalLM\"],\n"
             "  \"model_type\": \"%s\",\n"
             "  \"vocab_size\": %d,\n"
             "  \"hidden_size\": %d,\n"
             "  \"intermediate_size\": %d,\n"
             "  \"num_hidden_layers\": %d,\n"
             "  \"num_attention_heads\": %d,\n"
             "  \"num_key_value_heads\": %d,\n"
             "  \"max_position_embeddings\": 256,\n"
             "  \"rms_norm_eps\": 1e-05,\n"
             "  \"hidden_act\": \"silu\",\n"
             "  \"attention_bias\": false,\n"
             "  \"tie_word_embeddings\": %s,\n"
             "  %s\n"
             "  \"bos_token_id\": 1\n"
             "}\n",
             model_type, VOCAB, hidden, INTER, layers, HEADS, KV, tied ? "true" : "false", extra);
    return buf;
}

#define V4_ROPE                                                                        \
    "\"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", "         \
    "\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "           \
    "\"original_max_position_embeddings\": 8192}, \"eos_token_id\": 2,"
#define V5_ROPE                                                                        \
    "\"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 250000.0, "      \
    "\"factor\": 32.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "          \
    "\"original_max_position_embeddings\": 8192}, \"eos_token_id\": [2, 7, 9],"

static void write_cfg(const char *dir, const char *text) {
    CHECK(test_write_file(path_in(dir, "config.json"), text, strlen(text)));
}

static int g_case;
static char g_case_dirs[64][1024];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

/* A fresh directory per case. */
static const char *case_dir(const char *tag) {
    static char buf[1024];
    char t[128];
    g_case++;
    snprintf(t, sizeof t, "hf-%02d-%s", g_case, tag);
    snprintf(buf, sizeof buf, "%s", test_tmpdir(t));
    if (g_case < 64) snprintf(g_case_dirs[g_case], sizeof g_case_dirs[g_case], "%s", buf);
    return buf;
}

/* Writes a good F32 single-file untied model (v4 config) to a new dir. */
static const char *good_single(ft_model *m, const char *tag) {
    const char *dir = case_dir(tag);
    ft_build(m, ST_DTYPE_F32, false, 1);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    return dir;
}

/* ---- checks of a successfully opened model ------------------------------------*/

static void check_tensors(const st_model_files *mf, ft_model *m) {
    CHECK(mf->format == ST_FORMAT_SAFETENSORS);
    CHECK(mf->gguf == NULL);
    CHECK(mf->n_files == m->n_shards);
    CHECK(mf->n_tensors == m->n);
    for (int i = 0; i < m->n; i++) {
        const ft_tensor *f = &m->t[i];
        const st_tensor_desc *t = st_model_find(mf, f->name);
        CHECK_MSG(t != NULL, "%s", f->name);
        if (!t) continue;
        CHECK(strcmp(t->name, f->name) == 0);
        CHECK(t->dtype == f->dt);
        CHECK(t->n_dims == f->nd);
        for (int d = 0; d < f->nd; d++) CHECK(t->shape[d] == f->shape[d]);
        CHECK(t->nbytes == f->nbytes);
        CHECK(t->file >= 0 && t->file < mf->n_files);
        if (t->file < 0 || t->file >= mf->n_files) continue;
        const char *fp = mf->files[t->file].path;
        const char *want = shard_name(m, f->shard);
        CHECK_MSG(strlen(fp) >= strlen(want) && strcmp(fp + strlen(fp) - strlen(want), want) == 0,
                  "%s in %s, wanted %s", f->name, fp, want);
        CHECK_MSG(t->offset == 8 + m->hdr_len[f->shard] + f->lbeg, "%s offset %llu", f->name,
                  (unsigned long long)t->offset);
        const uint8_t *p = st_tensor_data(mf, t);
        CHECK(p == mf->files[t->file].data + t->offset);
        CHECK_MSG(p && memcmp(p, f->data, f->nbytes) == 0, "%s bytes", f->name);
        /* decode the last element and compare with the value written */
        if (p) {
            int64_t last = (int64_t)(f->nbytes / st_dtype_get(f->dt)->block_bytes) - 1;
            float v;
            if (f->dt == ST_DTYPE_F32) {
                memcpy(&v, p + 4 * last, 4);
            } else {
                uint16_t h;
                memcpy(&h, p + 2 * last, 2);
                v = f->dt == ST_DTYPE_F16 ? st_f16_to_f32(h) : st_bf16_to_f32(h);
            }
            CHECK_MSG(v == ft_value(i, last), "%s: %g vs %g", f->name, v, ft_value(i, last));
        }
    }
    CHECK(st_model_find(mf, "model.layers.2.mlp.up_proj.weight") == NULL);
    CHECK(st_model_find(mf, "nope") == NULL);
}

static void check_tiny_sizes(const st_config *c) {
    CHECK(c->vocab_size == VOCAB);
    CHECK(c->hidden_size == HID);
    CHECK(c->intermediate_size == INTER);
    CHECK(c->n_layers == LAYERS);
    CHECK(c->n_heads == HEADS);
    CHECK(c->n_kv_heads == KV);
    CHECK(c->head_dim == HDIM);
    CHECK(c->max_position_embeddings == 256);
    CHECK(fabsf(c->rms_norm_eps - 1e-5f) < 1e-12f);
    CHECK(c->rope_interleaved == false);
    CHECK(c->bos_token_id == 1);
}

/* ---- good models ------------------------------------------------------------*/

static void test_good_f32_single_untied_v4(void) {
    ft_model m;
    const char *dir = good_single(&m, "f32");
    ft_write(&m, dir);
    st_model_files *mf = NULL;
    strata_status st = st_model_open(dir, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        check_tiny_sizes(&mf->config);
        const st_config *c = &mf->config;
        CHECK(c->tie_word_embeddings == false);
        CHECK(c->rope_theta == 500000.0);
        CHECK(c->rope_scaling == ST_ROPE_SCALING_LLAMA3);
        CHECK(c->rope_factor == 8.0);
        CHECK(c->rope_low_freq_factor == 1.0);
        CHECK(c->rope_high_freq_factor == 4.0);
        CHECK(c->rope_original_max_pos == 8192);
        CHECK(c->n_eos == 1 && c->eos_token_ids[0] == 2);
        CHECK(strcmp(mf->path, dir) == 0);
        check_tensors(mf, &m);
        CHECK(st_model_validate(mf) == STRATA_OK);
        /* validation of dtypes, by tweaking the opened table */
        st_tensor_desc *norm = (st_tensor_desc *)st_model_find(mf, "model.layers.1.input_layernorm.weight");
        st_tensor_desc *q = (st_tensor_desc *)st_model_find(mf, "model.layers.0.self_attn.q_proj.weight");
        if (norm && q) {
            norm->dtype = ST_DTYPE_Q8_0;
            CHECK_ERR(st_model_validate(mf), STRATA_ERR_UNSUPPORTED,
                      "model.layers.1.input_layernorm.weight", "q8_0", dir);
            norm->dtype = ST_DTYPE_F32;
            q->dtype = ST_DTYPE_Q4_K;
            CHECK_ERR(st_model_validate(mf), STRATA_ERR_FORMAT,
                      "model.layers.0.self_attn.q_proj.weight", "block of 256");
            q->dtype = ST_DTYPE_F32;
            uint64_t o = q->offset;
            q->offset = mf->files[0].size;
            CHECK(st_tensor_data(mf, q) == NULL);
            q->offset = o;
            CHECK(st_model_validate(mf) == STRATA_OK);
        }
    }
    st_model_close(mf);
    st_model_close(NULL);
    /* same directory with a trailing slash, through the format opener */
    char slash[1100];
    snprintf(slash, sizeof slash, "%s/", dir);
    st = st_safetensors_open_dir(slash, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) check_tensors(mf, &m);
    st_model_close(mf);
    ft_free(&m);
}

static void test_good_bf16_sharded_tied_v5(void) {
    ft_model m;
    const char *dir = case_dir("bf16-sharded");
    ft_build(&m, ST_DTYPE_BF16, true, 2);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, true, V5_ROPE));
    st_model_files *mf = NULL;
    strata_status st = st_model_open(dir, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        check_tiny_sizes(&mf->config);
        const st_config *c = &mf->config;
        CHECK(c->tie_word_embeddings == true);
        CHECK(c->rope_theta == 250000.0);
        CHECK(c->rope_scaling == ST_ROPE_SCALING_LLAMA3);
        CHECK(c->rope_factor == 32.0);
        CHECK(c->rope_original_max_pos == 8192);
        CHECK(c->n_eos == 3 && c->eos_token_ids[0] == 2 && c->eos_token_ids[1] == 7 &&
              c->eos_token_ids[2] == 9);
        CHECK(st_model_find(mf, "lm_head.weight") == NULL);
        check_tensors(mf, &m);
        /* layer 0 in shard 1, layer 1 in shard 2 */
        const st_tensor_desc *a = st_model_find(mf, "model.layers.0.mlp.up_proj.weight");
        const st_tensor_desc *b = st_model_find(mf, "model.layers.1.mlp.up_proj.weight");
        CHECK(a && b && a->file != b->file);
    }
    st_model_close(mf);
    ft_free(&m);
}

static void test_good_f16_single_tied_linear(void) {
    ft_model m;
    const char *dir = case_dir("f16");
    ft_build(&m, ST_DTYPE_F16, true, 1);
    /* a tied model may still ship lm_head; it is then checked too */
    ft_add(&m, "lm_head.weight", 2, VOCAB, HID, 0);
    ft_layout(&m);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, true,
                            "\"head_dim\": null, \"rope_scaling\": {\"type\": \"linear\", "
                            "\"factor\": 2.0}, \"eos_token_id\": null,"));
    st_model_files *mf = NULL;
    strata_status st = st_model_open(dir, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        check_tiny_sizes(&mf->config);
        CHECK(mf->config.rope_scaling == ST_ROPE_SCALING_LINEAR);
        CHECK(mf->config.rope_factor == 2.0);
        CHECK(mf->config.rope_theta == 10000.0);
        CHECK(mf->config.n_eos == 0);
        check_tensors(mf, &m);
    }
    st_model_close(mf);
    ft_free(&m);
}

static void test_good_bf16_sharded_untied(void) {
    ft_model m;
    const char *dir = case_dir("bf16-untied");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, "\"rope_scaling\": null,"));
    st_model_files *mf = NULL;
    strata_status st = st_model_open(dir, &mf);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (mf) {
        CHECK(mf->config.rope_scaling == ST_ROPE_SCALING_NONE);
        CHECK(st_model_find(mf, "lm_head.weight") != NULL);
        check_tensors(mf, &m);
    }
    st_model_close(mf);
    ft_free(&m);
}

/* ---- config.json alone --------------------------------------------------------*/

static const char *MIN_CFG =
    "{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, "
    "\"intermediate_size\": 128, \"num_hidden_layers\": 3, \"num_attention_heads\": 8%s}";

static strata_status parse_min(const char *extra, st_config *c) {
    char buf[2048];
    snprintf(buf, sizeof buf, MIN_CFG, extra);
    return st_config_parse_json(buf, "x/config.json", c);
}

/* generation_config.json: st_sampling_defaults_read */
static void test_generation_config(void) {
    const char *dir = test_tmpdir("genconf");
    char path[1200];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    st_model_files m = {.format = ST_FORMAT_SAFETENSORS, .path = (char *)dir};
    st_sampling_defaults d;
    /* absent: nothing, no error */
    CHECK(st_sampling_defaults_read(&m, &d) == STRATA_OK && !d.has_temperature && !d.has_top_p &&
          !d.source[0]);
    const char *t1 = "{\"do_sample\": true, \"temperature\": 0.6, \"top_p\": 0.9, \"top_k\": 20, "
                     "\"min_p\": null, \"repetition_penalty\": 1.1, \"eos_token_id\": [1, 2]}";
    ST_ASSERT(test_write_file(path, t1, strlen(t1)));
    CHECK(st_sampling_defaults_read(&m, &d) == STRATA_OK);
    CHECK(d.has_temperature && d.temperature == 0.6 && d.has_top_p && d.top_p == 0.9 && d.has_top_k &&
          d.top_k == 20 && !d.has_min_p && d.has_repetition_penalty && d.repetition_penalty == 1.1);
    CHECK(strstr(d.source, "generation_config.json") != NULL);
    const char *t2 = "{\"do_sample\": false, \"temperature\": 0.6}";
    ST_ASSERT(test_write_file(path, t2, strlen(t2)));
    CHECK(st_sampling_defaults_read(&m, &d) == STRATA_OK && d.has_temperature && d.temperature == 0);
    const char *bad[][2] = {{"{\"temperature\": -1}", "'temperature'"},
                            {"{\"top_p\": 0}", "'top_p'"},
                            {"{\"top_k\": 2.5}", "top_k"},
                            {"{\"temperature\": \"hot\"}", "temperature"},
                            {"{\"top_p\": 0.9", "invalid JSON"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ST_ASSERT(test_write_file(path, bad[i][0], strlen(bad[i][0])));
        CHECK_ERR(st_sampling_defaults_read(&m, &d), STRATA_ERR_FORMAT, path, bad[i][1]);
    }
}

static void test_config(void) {
    st_config c;
    /* defaults */
    CHECK(parse_min("", &c) == STRATA_OK);
    CHECK(c.n_kv_heads == 8 && c.head_dim == 8);
    CHECK(c.rope_theta == 10000.0 && c.rope_scaling == ST_ROPE_SCALING_NONE);
    CHECK(c.tie_word_embeddings == false && c.bos_token_id == -1 && c.n_eos == 0);
    CHECK(c.max_position_embeddings == 2048);
    CHECK(fabsf(c.rms_norm_eps - 1e-6f) < 1e-12f);
    /* explicit head_dim differing from hidden/heads */
    CHECK(parse_min(", \"head_dim\": 16, \"num_key_value_heads\": 2", &c) == STRATA_OK);
    CHECK(c.head_dim == 16 && c.n_kv_heads == 2);
    /* v5 rope_parameters default with theta inside; top-level theta overridden */
    CHECK(parse_min(", \"rope_theta\": 1.0, \"rope_parameters\": {\"rope_type\": \"default\", "
                    "\"rope_theta\": 500000.0}", &c) == STRATA_OK);
    CHECK(c.rope_theta == 500000.0 && c.rope_scaling == ST_ROPE_SCALING_NONE);
    /* v5 linear */
    CHECK(parse_min(", \"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 4}", &c) ==
          STRATA_OK);
    CHECK(c.rope_scaling == ST_ROPE_SCALING_LINEAR && c.rope_factor == 4.0);
    /* v4 "type": "default" */
    CHECK(parse_min(", \"rope_scaling\": {\"type\": \"default\"}", &c) == STRATA_OK);
    CHECK(c.rope_scaling == ST_ROPE_SCALING_NONE);
    /* architectures only */
    CHECK(st_config_parse_json("{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": 8, "
                               "\"hidden_size\": 8, \"intermediate_size\": 8, "
                               "\"num_hidden_layers\": 1, \"num_attention_heads\": 2}",
                               "a/config.json", &c) == STRATA_OK);

    /* errors */
    CHECK_ERR(st_config_parse_json("{\n  \"vocab_size\": 32,\n  \"hidden_size\": 16 oops\n}",
                                   "bad/config.json", &c),
              STRATA_ERR_FORMAT, "bad/config.json", "invalid JSON", "line 3");
    CHECK_ERR(st_config_parse_json("", "e/config.json", &c), STRATA_ERR_FORMAT, "e/config.json",
              "invalid JSON");
    CHECK_ERR(st_config_parse_json("[1, 2]", "arr/config.json", &c), STRATA_ERR_FORMAT,
              "arr/config.json", "object");
    CHECK_ERR(st_config_parse_json("{\"model_type\": \"llama\", \"vocab_size\": 8}", "m/config.json", &c),
              STRATA_ERR_NOT_FOUND, "m/config.json", "hidden_size");
    CHECK_ERR(st_config_parse_json("{\"vocab_size\": 8}", "m/config.json", &c),
              STRATA_ERR_NOT_FOUND, "m/config.json", "model_type");
    CHECK_ERR(parse_min(", \"num_key_value_heads\": \"2\"", &c), STRATA_ERR_FORMAT,
              "x/config.json", "num_key_value_heads", "integer", "string");
    CHECK_ERR(parse_min(", \"num_key_value_heads\": 2.5", &c), STRATA_ERR_FORMAT,
              "num_key_value_heads", "integer");
    CHECK_ERR(parse_min(", \"num_key_value_heads\": 3", &c), STRATA_ERR_FORMAT, "x/config.json",
              "num_attention_heads=8", "num_key_value_heads=3");
    CHECK_ERR(parse_min(", \"num_key_value_heads\": 0", &c), STRATA_ERR_FORMAT,
              "num_key_value_heads", "positive");
    CHECK_ERR(parse_min(", \"head_dim\": -4", &c), STRATA_ERR_FORMAT, "head_dim", "positive");
    CHECK_ERR(parse_min(", \"head_dim\": 7", &c), STRATA_ERR_FORMAT, "head_dim=7", "even");
    CHECK_ERR(parse_min(", \"tie_word_embeddings\": 1", &c), STRATA_ERR_FORMAT,
              "tie_word_embeddings", "true or false");
    CHECK_ERR(parse_min(", \"rms_norm_eps\": \"small\"", &c), STRATA_ERR_FORMAT, "rms_norm_eps",
              "number");
    CHECK_ERR(parse_min(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}", &c),
              STRATA_ERR_UNSUPPORTED, "x/config.json", "rope_scaling.rope_type", "yarn");
    CHECK_ERR(parse_min(", \"rope_parameters\": {\"rope_type\": \"dynamic\"}", &c),
              STRATA_ERR_UNSUPPORTED, "rope_parameters.rope_type", "dynamic");
    CHECK_ERR(parse_min(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8}", &c),
              STRATA_ERR_NOT_FOUND, "x/config.json", "rope_scaling.low_freq_factor");
    CHECK_ERR(parse_min(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, "
                        "\"low_freq_factor\": 4, \"high_freq_factor\": 1, "
                        "\"original_max_position_embeddings\": 8192}", &c),
              STRATA_ERR_FORMAT, "high_freq_factor > low_freq_factor");
    CHECK_ERR(parse_min(", \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": \"2\"}", &c),
              STRATA_ERR_FORMAT, "rope_scaling.factor", "number");
    CHECK_ERR(parse_min(", \"rope_scaling\": 3", &c), STRATA_ERR_FORMAT, "rope_scaling", "object");
    CHECK_ERR(parse_min(", \"attention_bias\": true", &c), STRATA_ERR_UNSUPPORTED, "attention_bias");
    CHECK_ERR(parse_min(", \"mlp_bias\": true", &c), STRATA_ERR_UNSUPPORTED, "mlp_bias");
    CHECK_ERR(parse_min(", \"hidden_act\": \"gelu\"", &c), STRATA_ERR_UNSUPPORTED, "gelu");
    CHECK_ERR(parse_min(", \"eos_token_id\": [1, \"x\"]", &c), STRATA_ERR_FORMAT,
              "eos_token_id[1]");
    CHECK_ERR(parse_min(", \"eos_token_id\": -5", &c), STRATA_ERR_FORMAT, "eos_token_id",
              "token id");
    CHECK_ERR(parse_min(", \"eos_token_id\": [1,2,3,4,5,6,7,8,9]", &c), STRATA_ERR_UNSUPPORTED,
              "eos_token_id", "9 ids");
    CHECK_ERR(parse_min(", \"max_position_embeddings\": 1e300", &c), STRATA_ERR_FORMAT,
              "max_position_embeddings", "out of range");
    /* the rules shared with GGUF (st_config_check) */
    CHECK_ERR(parse_min(", \"eos_token_id\": 100", &c), STRATA_ERR_FORMAT, "x/config.json",
              "'eos_token_id'", "outside the vocabulary of 100");
    CHECK_ERR(parse_min(", \"eos_token_id\": [2, 1000000000]", &c), STRATA_ERR_FORMAT,
              "'eos_token_id'", "1000000000");
    CHECK_ERR(parse_min(", \"bos_token_id\": 100", &c), STRATA_ERR_FORMAT, "'bos_token_id'",
              "outside the vocabulary");
    CHECK_ERR(parse_min(", \"max_position_embeddings\": 1", &c), STRATA_ERR_FORMAT,
              "'max_position_embeddings'", "out of range [2, ");
    CHECK_ERR(parse_min(", \"max_position_embeddings\": 1000000000000", &c), STRATA_ERR_FORMAT,
              "'max_position_embeddings'", "out of range [2, ");
    CHECK_ERR(parse_min(", \"rms_norm_eps\": -1", &c), STRATA_ERR_FORMAT, "'rms_norm_eps'",
              "out of range (0, 1)");
    CHECK_ERR(parse_min(", \"rms_norm_eps\": 1e-50", &c), STRATA_ERR_FORMAT, "'rms_norm_eps'");
    CHECK_ERR(parse_min(", \"rope_theta\": 1e999", &c), STRATA_ERR_FORMAT, "'rope_theta'",
              "finite");
    CHECK_ERR(parse_min(", \"partial_rotary_factor\": 0.5", &c), STRATA_ERR_FORMAT,
              "'partial_rotary_factor'", "whole head");
    CHECK(parse_min(", \"partial_rotary_factor\": 1.0, \"eos_token_id\": 99", &c) == STRATA_OK);
    CHECK_ERR(parse_min(", \"num_key_value_heads\": 16", &c), STRATA_ERR_FORMAT,
              "num_attention_heads=8", "not a multiple");
    CHECK_ERR(st_config_parse_json("{\"model_type\": \"llama\", \"vocab_size\": 8, \"hidden_size\": 8, "
                                   "\"intermediate_size\": 0, \"num_hidden_layers\": 1, "
                                   "\"num_attention_heads\": 2}", "i/config.json", &c),
              STRATA_ERR_FORMAT, "i/config.json", "'intermediate_size'", "positive");
    CHECK_ERR(st_config_parse_json("{\"model_type\": \"mistral\"}", "q/config.json", &c),
              STRATA_ERR_UNSUPPORTED, "q/config.json", "mistral");
    CHECK_ERR(st_config_parse_json("{\"model_type\": \"llama\", \"architectures\": "
                                   "[\"Qwen2ForCausalLM\"]}", "q/config.json", &c),
              STRATA_ERR_UNSUPPORTED, "q/config.json", "Qwen2ForCausalLM");
}

/* ---- bad safetensors files ----------------------------------------------------*/

static strata_status open_dir(const char *dir) {
    st_model_files *mf = (st_model_files *)(uintptr_t)1;
    strata_status st = st_model_open(dir, &mf);
    CHECK(mf == NULL || st == STRATA_OK);
    st_model_close(mf);
    return st;
}

static void test_bad_files(void) {
    ft_model m;
    const char *dir;

    /* shorter than 8 bytes */
    dir = good_single(&m, "short");
    CHECK(test_write_file(path_in(dir, "model.safetensors"), "\x10\0\0\0\0", 5));
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model.safetensors", "5 bytes", "too short");
    ft_free(&m);

    /* empty file */
    dir = good_single(&m, "empty");
    CHECK(test_write_file(path_in(dir, "model.safetensors"), "", 0));
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model.safetensors", "too short");
    ft_free(&m);

    /* data section cut short */
    dir = good_single(&m, "cut");
    m.truncate_by = 10;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model.safetensors", "lm_head.weight", "past the end");
    ft_free(&m);

    /* header length past the end of the file */
    dir = good_single(&m, "hdrlen");
    m.hdr_len_set = true;
    m.hdr_len_value = 1000000;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model.safetensors", "header length 1000000",
              "past the end");
    ft_free(&m);

    /* absurd header length (would overflow 8 + N) */
    dir = good_single(&m, "hdrabsurd");
    m.hdr_len_set = true;
    m.hdr_len_value = UINT64_MAX - 3;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "absurd");
    ft_free(&m);

    /* invalid JSON in the header */
    dir = good_single(&m, "hdrjson");
    m.hdr_text = "{\"model.norm.weight\": {\"dtype\": \"F32\", \"shape\": [16]    ";
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "invalid JSON");
    ft_free(&m);

    /* header JSON that is not an object */
    dir = good_single(&m, "hdrarray");
    m.hdr_text = "[1, 2, 3]       ";
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "JSON object");
    ft_free(&m);

    /* garbage after the header JSON */
    dir = good_single(&m, "hdrtrail");
    m.hdr_text = "{}  xx  ";
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "invalid JSON");
    ft_free(&m);

    /* invalid JSON in config.json */
    dir = case_dir("cfgjson");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, "{\n  \"model_type\": \"llama\",\n  \"vocab_size\": 32,,\n}\n");
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "config.json", "invalid JSON", "line 3");
    ft_free(&m);

    /* offsets outside the file */
    dir = good_single(&m, "offsets");
    ft_get(&m, "model.layers.0.mlp.up_proj.weight")->begin += 1u << 20;
    ft_get(&m, "model.layers.0.mlp.up_proj.weight")->end += 1u << 20;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model.safetensors",
              "model.layers.0.mlp.up_proj.weight", "past the end");
    ft_free(&m);

    /* offsets beyond 2^53 (not exactly representable) */
    dir = good_single(&m, "offhuge");
    ft_get(&m, "model.norm.weight")->end = 18446744073709551615ull;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "model.norm.weight",
              "data_offsets[1]");
    ft_free(&m);

    /* begin > end */
    dir = good_single(&m, "beginend");
    {
        ft_tensor *t = ft_get(&m, "model.layers.1.input_layernorm.weight");
        uint64_t b = t->begin;
        t->begin = t->end;
        t->end = b;
    }
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors",
              "model.layers.1.input_layernorm.weight", "begin");
    ft_free(&m);

    /* overlapping tensors (same size, o_proj shifted into q_proj) */
    dir = good_single(&m, "overlap");
    {
        ft_tensor *q = ft_get(&m, "model.layers.0.self_attn.q_proj.weight");
        ft_tensor *o = ft_get(&m, "model.layers.0.self_attn.o_proj.weight");
        o->begin = q->begin + 4;
        o->end = o->begin + o->nbytes;
    }
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "overlap",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight");
    ft_free(&m);

    /* shape vs byte count */
    dir = good_single(&m, "bytecount");
    ft_get(&m, "model.norm.weight")->shape[0] = 15;
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors", "model.norm.weight",
              "64 bytes", "[15]", "60");
    ft_free(&m);

    /* dtype vs byte count */
    dir = good_single(&m, "dtypecount");
    snprintf(ft_get(&m, "model.norm.weight")->dtype, 16, "BF16");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.norm.weight", "BF16 needs 32");
    ft_free(&m);

    /* unknown / unsupported dtypes */
    dir = good_single(&m, "i64");
    snprintf(ft_get(&m, "model.layers.0.mlp.down_proj.weight")->dtype, 16, "I64");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_UNSUPPORTED, "model.safetensors",
              "model.layers.0.mlp.down_proj.weight", "I64");
    ft_free(&m);
    dir = good_single(&m, "f8");
    snprintf(ft_get(&m, "model.embed_tokens.weight")->dtype, 16, "F8_E4M3");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_UNSUPPORTED, "model.embed_tokens.weight", "F8_E4M3");
    ft_free(&m);

    /* too many dims; negative dim */
    dir = good_single(&m, "dims");
    {
        ft_tensor *t = ft_get(&m, "model.norm.weight");
        t->nd = 5;
        t->shape[0] = t->shape[1] = t->shape[2] = t->shape[3] = 1;
        t->shape[4] = HID;
    }
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_UNSUPPORTED, "model.norm.weight", "5 dimensions");
    ft_free(&m);
    dir = good_single(&m, "negdim");
    {
        ft_tensor *t = ft_get(&m, "model.layers.0.self_attn.k_proj.weight");
        t->shape[0] = -8;
        t->shape[1] = -16;
    }
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.layers.0.self_attn.k_proj.weight",
              "negative");
    ft_free(&m);

    /* a tensor name twice in one header */
    dir = good_single(&m, "dup");
    snprintf(ft_get(&m, "model.layers.0.self_attn.o_proj.weight")->name, 96,
             "model.layers.0.self_attn.q_proj.weight");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors",
              "model.layers.0.self_attn.q_proj.weight", "twice");
    ft_free(&m);

    /* missing tensor */
    dir = good_single(&m, "missing");
    ft_remove(&m, "model.layers.1.self_attn.k_proj.weight");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, dir, "missing tensor",
              "model.layers.1.self_attn.k_proj.weight");
    ft_free(&m);

    /* untied but no lm_head */
    dir = good_single(&m, "nohead");
    ft_remove(&m, "lm_head.weight");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "lm_head.weight", "tie_word_embeddings=false");
    ft_free(&m);

    /* no weights at all; no config */
    dir = good_single(&m, "noweights");
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, dir, "model.safetensors.index.json");
    ft_free(&m);
    dir = case_dir("nocfg");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "config.json", "missing");
    ft_free(&m);

    /* paths that are not models */
    CHECK_ERR(open_dir("/nonexistent/strata/model"), STRATA_ERR_NOT_FOUND, "/nonexistent/strata/model");
    dir = good_single(&m, "notdir");
    ft_write(&m, dir);
    CHECK_ERR(open_dir(path_in(dir, "model.safetensors")), STRATA_ERR_UNSUPPORTED,
              "model.safetensors", "directory");
    ft_free(&m);
}

static void test_bad_sharded(void) {
    ft_model m;
    const char *dir;

    /* listed in the index, absent from its shard */
    dir = case_dir("shard-missing-tensor");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    ft_get(&m, "model.layers.1.mlp.gate_proj.weight")->omit = true;
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "model.safetensors.index.json",
              "model.layers.1.mlp.gate_proj.weight", "model-00002-of-00002.safetensors");
    ft_free(&m);

    /* shard file missing */
    dir = case_dir("shard-missing-file");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    CHECK(unlink(path_in(dir, "model-00002-of-00002.safetensors")) == 0);
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "model-00002-of-00002.safetensors", "missing");
    ft_free(&m);

    /* a bad shard is named in the message */
    dir = case_dir("shard-bad");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    CHECK(test_write_file(path_in(dir, "model-00001-of-00002.safetensors"), "abc", 3));
    CHECK_ERR(open_dir(dir), STRATA_ERR_IO, "model-00001-of-00002.safetensors", "too short");
    ft_free(&m);

    /* index that is not JSON; index escaping the directory; no weight_map */
    dir = case_dir("index-bad");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    const char *bad = "{\"weight_map\": {\"a\": \"x.safetensors\"";
    CHECK(test_write_file(path_in(dir, "model.safetensors.index.json"), bad, strlen(bad)));
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors.index.json", "invalid JSON");
    bad = "{\"weight_map\": {\"model.norm.weight\": \"../../etc/passwd\"}}";
    CHECK(test_write_file(path_in(dir, "model.safetensors.index.json"), bad, strlen(bad)));
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.safetensors.index.json", "../../etc/passwd");
    bad = "{\"metadata\": {}}";
    CHECK(test_write_file(path_in(dir, "model.safetensors.index.json"), bad, strlen(bad)));
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "model.safetensors.index.json", "weight_map");
    ft_free(&m);

    /* the same tensor in two shards */
    dir = case_dir("shard-dup");
    ft_build(&m, ST_DTYPE_BF16, false, 2);
    snprintf(ft_get(&m, "model.layers.1.input_layernorm.weight")->name, 96,
             "model.layers.0.input_layernorm.weight");
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_FORMAT, "model.layers.0.input_layernorm.weight",
              "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    ft_free(&m);
}

static void test_config_vs_tensors(void) {
    ft_model m;
    const char *dir;

    /* hidden_size 32 while the tensors are 16 wide */
    dir = case_dir("cfg-hidden");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", 32, LAYERS, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_MISMATCH, dir,
              "model.embed_tokens.weight has shape [32, 16] but config.json "
              "(vocab_size=32, hidden_size=32) implies [32, 32]");
    ft_free(&m);

    /* head_dim wrong */
    dir = case_dir("cfg-headdim");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, LAYERS, false, "\"head_dim\": 8,"));
    CHECK_ERR(open_dir(dir), STRATA_ERR_MISMATCH,
              "model.layers.0.self_attn.q_proj.weight has shape [16, 16] but config.json "
              "(hidden_size=16, num_attention_heads=4, head_dim=8) implies [32, 16]");
    ft_free(&m);

    /* k_proj with the wrong number of kv heads */
    dir = case_dir("cfg-kv");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    {
        char cfg[2048];
        snprintf(cfg, sizeof cfg,
                 "{\"model_type\": \"llama\", \"vocab_size\": %d, \"hidden_size\": %d, "
                 "\"intermediate_size\": %d, \"num_hidden_layers\": %d, "
                 "\"num_attention_heads\": %d, \"num_key_value_heads\": 4}",
                 VOCAB, HID, INTER, LAYERS, HEADS);
        write_cfg(dir, cfg);
    }
    CHECK_ERR(open_dir(dir), STRATA_ERR_MISMATCH, "model.layers.0.self_attn.k_proj.weight",
              "[8, 16]", "num_key_value_heads=4", "[16, 16]");
    ft_free(&m);

    /* fewer layers in the config than in the files */
    dir = case_dir("cfg-layers");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, 1, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_MISMATCH, "model.layers.1.", "num_hidden_layers=1");
    ft_free(&m);

    /* more layers in the config than in the files */
    dir = case_dir("cfg-layers3");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("llama", HID, 3, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_NOT_FOUND, "missing tensor",
              "model.layers.2.input_layernorm.weight");
    ft_free(&m);

    /* model_type not llama */
    dir = case_dir("cfg-mistral");
    ft_build(&m, ST_DTYPE_F32, false, 1);
    ft_write(&m, dir);
    write_cfg(dir, cfg_text("mistral", HID, LAYERS, false, V4_ROPE));
    CHECK_ERR(open_dir(dir), STRATA_ERR_UNSUPPORTED, "config.json", "mistral");
    ft_free(&m);
}

int main(void) {
    test_config();
    test_generation_config();
    test_good_f32_single_untied_v4();
    test_good_bf16_sharded_tied_v5();
    test_good_f16_single_tied_linear();
    test_good_bf16_sharded_untied();
    test_bad_files();
    test_bad_sharded();
    test_config_vs_tensors();
    /* keep the fixtures for inspection when something failed */
    if (g_test_failures == 0 && !getenv("KEEP"))
        for (int i = 1; i <= g_case && i < 64; i++)
            nftw(g_case_dirs[i], rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return test_finish("test_loader_hf");
}

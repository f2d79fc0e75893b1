/* Format-neutral part of the loader: open by path, lookup, data pointers,
 * teardown, and validation of the tensor table against the config. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/gguf.h"
#include "loader/loader.h"

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static bool file_has_gguf_magic(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    char magic[4];
    ssize_t r = read(fd, magic, sizeof magic);
    close(fd);
    return r == 4 && memcmp(magic, "GGUF", 4) == 0;
}

/* Opens a HF directory (st_safetensors_open_dir) or a GGUF file (by suffix
 * ".gguf" or the magic "GGUF"). The caller owns *out (st_model_close); on
 * error *out is NULL and st_last_error() says what is wrong. */
strata_status st_model_open(const char *path, st_model_files **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "st_model_open: out is NULL");
    *out = NULL;
    if (!path || !path[0]) return st_err(STRATA_ERR_INVALID_ARG, "st_model_open: empty path");
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        return st_err(e == ENOENT ? STRATA_ERR_NOT_FOUND : STRATA_ERR_IO, "%s: %s", path,
                      strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) return st_safetensors_open_dir(path, out);
    if (S_ISREG(sb.st_mode) && (ends_with(path, ".gguf") || file_has_gguf_magic(path)))
        return st_gguf_open(path, out);
    if (S_ISREG(sb.st_mode) && (ends_with(path, ".safetensors") || ends_with(path, ".json")))
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: open the Hugging Face model directory that holds this file instead",
                      path);
    return st_err(STRATA_ERR_UNSUPPORTED,
                  "%s: neither a model directory (config.json + safetensors) nor a GGUF file", path);
}

/* Frees the tensor table (names included) and unmaps the files; leaves the
 * rest of *m (path, config, gguf) alone. Safe on a partly built table. */
void st_model_files_free_parts(st_model_files *m) {
    if (!m) return;
    for (int64_t i = 0; i < m->n_tensors; i++) st_free(m->tensors[i].name);
    st_free(m->tensors);
    m->tensors = NULL;
    m->n_tensors = 0;
    for (int i = 0; i < m->n_files; i++) st_file_unmap(&m->files[i]);
    st_free(m->files);
    m->files = NULL;
    m->n_files = 0;
}

/* Releases everything st_model_open returned. NULL is a no-op. */
void st_model_close(st_model_files *m) {
    if (!m) return;
    st_gguf_meta_free(m->gguf);
    m->gguf = NULL;
    st_model_files_free_parts(m);
    st_free(m->path);
    st_free(m);
}

/* Linear search by name; the result is borrowed from m. */
const st_tensor_desc *st_model_find(const st_model_files *m, const char *name) {
    if (!m || !name) return NULL;
    for (int64_t i = 0; i < m->n_tensors; i++)
        if (strcmp(m->tensors[i].name, name) == 0) return &m->tensors[i];
    return NULL;
}

/* Pointer to the tensor's first byte inside its file mapping (borrowed, valid
 * until st_model_close); NULL when the descriptor does not fit its file. */
const void *st_tensor_data(const st_model_files *m, const st_tensor_desc *t) {
    if (!m || !t || t->file < 0 || t->file >= m->n_files) return NULL;
    const st_mapped_file *f = &m->files[t->file];
    uint64_t end;
    if (st_add_ovf_u64(t->offset, t->nbytes, &end) || end > f->size) return NULL;
    if (!f->data) return NULL;
    return f->data + t->offset;
}

/* ---- validation ---- */

static const char *cfg_source(const st_model_files *m) {
    return m->format == ST_FORMAT_GGUF ? "the GGUF metadata" : "config.json";
}

static void fmt_shape(char *buf, size_t n, int nd, const int64_t *shape) {
    size_t p = 0;
    int w = snprintf(buf, n, "[");
    if (w < 0) return;
    p = (size_t)w;
    for (int i = 0; i < nd && p < n; i++) {
        w = snprintf(buf + p, n - p, "%s%lld", i ? ", " : "", (long long)shape[i]);
        if (w < 0) return;
        p += (size_t)w;
    }
    if (p < n) snprintf(buf + p, n - p, "]");
}

typedef enum { V_NORM, V_MATRIX } v_kind;

/* Checks one tensor. `why` lists the config values that imply its shape. */
static strata_status check_tensor(const st_model_files *m, const char *name, v_kind kind,
                                  int nd, int64_t d0, int64_t d1, const char *why, bool optional) {
    const st_tensor_desc *t = st_model_find(m, name);
    if (!t) {
        if (optional) return STRATA_OK;
        return st_err(STRATA_ERR_NOT_FOUND, "%s: missing tensor %s (needed by %s: %s)", m->path,
                      name, cfg_source(m), why);
    }
    int64_t want[2] = {d0, d1};
    bool same = t->n_dims == nd;
    for (int i = 0; same && i < nd; i++) same = t->shape[i] == want[i];
    if (!same) {
        char have_s[96], want_s[96];
        fmt_shape(have_s, sizeof have_s, t->n_dims, t->shape);
        fmt_shape(want_s, sizeof want_s, nd, want);
        return st_err(STRATA_ERR_MISMATCH, "%s: %s has shape %s but %s (%s) implies %s", m->path,
                      name, have_s, cfg_source(m), why, want_s);
    }
    const st_dtype_info *di = st_dtype_get(t->dtype);
    if (!di)
        return st_err(STRATA_ERR_FORMAT, "%s: %s has an invalid dtype (%d)", m->path, name,
                      (int)t->dtype);
    if (kind == V_NORM && di->quantized)
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: %s has dtype %s; norm weights must be f32, f16 or bf16", m->path, name,
                      di->name);
    int64_t row = nd == 2 ? d1 : d0;
    int64_t rows = nd == 2 ? d0 : 1;
    size_t rb = st_dtype_row_bytes(t->dtype, row);
    if (rb == 0)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: %s has rows of %lld elements, not a multiple of the %s block of %lld",
                      m->path, name, (long long)row, di->name, (long long)di->block_elems);
    uint64_t bytes;
    if (st_mul_ovf_u64((uint64_t)rows, (uint64_t)rb, &bytes) || bytes != t->nbytes)
        return st_err(STRATA_ERR_FORMAT, "%s: %s holds %llu bytes but %lld rows of %s need %llu",
                      m->path, name, (unsigned long long)t->nbytes, (long long)rows, di->name,
                      (unsigned long long)bytes);
    if (!st_tensor_data(m, t) && t->nbytes > 0)
        return st_err(STRATA_ERR_FORMAT, "%s: %s lies outside its file", m->path, name);
    return STRATA_OK;
}

static bool mul_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_mul_overflow(a, b, r); }

/* Checks the config's own consistency and that every Llama tensor is present
 * with the shape the config implies, a usable dtype, and whole blocks per row.
 * Tensors named model.layers.N.* with N >= num_hidden_layers are a mismatch.
 * Messages name m->path and the config values involved. */
strata_status st_model_validate(const st_model_files *m) {
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "st_model_validate: NULL model");
    const st_config *c = &m->config;
    const char *src = cfg_source(m);
    if (c->vocab_size <= 0 || c->hidden_size <= 0 || c->intermediate_size <= 0 ||
        c->n_layers <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->head_dim <= 0)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: %s has a non-positive size (vocab_size=%lld, hidden_size=%lld, "
                      "intermediate_size=%lld, num_hidden_layers=%lld, num_attention_heads=%lld, "
                      "num_key_value_heads=%lld, head_dim=%lld)",
                      m->path, src, (long long)c->vocab_size, (long long)c->hidden_size,
                      (long long)c->intermediate_size, (long long)c->n_layers,
                      (long long)c->n_heads, (long long)c->n_kv_heads, (long long)c->head_dim);
    if (c->n_heads % c->n_kv_heads != 0)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: %s: num_attention_heads=%lld is not a multiple of num_key_value_heads=%lld",
                      m->path, src, (long long)c->n_heads, (long long)c->n_kv_heads);
    int64_t q_dim, kv_dim;
    if (!mul_ok(c->n_heads, c->head_dim, &q_dim) || !mul_ok(c->n_kv_heads, c->head_dim, &kv_dim))
        return st_err(STRATA_ERR_FORMAT, "%s: %s: heads * head_dim overflows", m->path, src);

    const int64_t H = c->hidden_size, V = c->vocab_size, I = c->intermediate_size;
    char why_vh[128], why_h[64], why_q[160], why_kv[160], why_ffn[128];
    snprintf(why_vh, sizeof why_vh, "vocab_size=%lld, hidden_size=%lld", (long long)V, (long long)H);
    snprintf(why_h, sizeof why_h, "hidden_size=%lld", (long long)H);
    snprintf(why_q, sizeof why_q, "hidden_size=%lld, num_attention_heads=%lld, head_dim=%lld",
             (long long)H, (long long)c->n_heads, (long long)c->head_dim);
    snprintf(why_kv, sizeof why_kv, "hidden_size=%lld, num_key_value_heads=%lld, head_dim=%lld",
             (long long)H, (long long)c->n_kv_heads, (long long)c->head_dim);
    snprintf(why_ffn, sizeof why_ffn, "hidden_size=%lld, intermediate_size=%lld", (long long)H,
             (long long)I);

    strata_status st;
    if ((st = check_tensor(m, "model.embed_tokens.weight", V_MATRIX, 2, V, H, why_vh, false)))
        return st;
    char name[128];
    for (int64_t l = 0; l < c->n_layers; l++) {
        struct { const char *suffix; v_kind kind; int nd; int64_t d0, d1; const char *why; } req[] = {
            {"input_layernorm.weight", V_NORM, 1, H, 0, why_h},
            {"self_attn.q_proj.weight", V_MATRIX, 2, q_dim, H, why_q},
            {"self_attn.k_proj.weight", V_MATRIX, 2, kv_dim, H, why_kv},
            {"self_attn.v_proj.weight", V_MATRIX, 2, kv_dim, H, why_kv},
            {"self_attn.o_proj.weight", V_MATRIX, 2, H, q_dim, why_q},
            {"post_attention_layernorm.weight", V_NORM, 1, H, 0, why_h},
            {"mlp.gate_proj.weight", V_MATRIX, 2, I, H, why_ffn},
            {"mlp.up_proj.weight", V_MATRIX, 2, I, H, why_ffn},
            {"mlp.down_proj.weight", V_MATRIX, 2, H, I, why_ffn},
        };
        for (size_t k = 0; k < sizeof req / sizeof req[0]; k++) {
            snprintf(name, sizeof name, "model.layers.%lld.%s", (long long)l, req[k].suffix);
            if ((st = check_tensor(m, name, req[k].kind, req[k].nd, req[k].d0, req[k].d1,
                                   req[k].why, false)))
                return st;
        }
    }
    if ((st = check_tensor(m, "model.norm.weight", V_NORM, 1, H, 0, why_h, false))) return st;
    if (c->tie_word_embeddings) {
        char why_tied[160];
        snprintf(why_tied, sizeof why_tied, "%s, tie_word_embeddings=true", why_vh);
        if ((st = check_tensor(m, "lm_head.weight", V_MATRIX, 2, V, H, why_tied, true))) return st;
    } else {
        char why_untied[160];
        snprintf(why_untied, sizeof why_untied, "%s, tie_word_embeddings=false", why_vh);
        if ((st = check_tensor(m, "lm_head.weight", V_MATRIX, 2, V, H, why_untied, false)))
            return st;
    }

    /* Layers beyond the config's count mean the two disagree. */
    for (int64_t i = 0; i < m->n_tensors; i++) {
        const char *n = m->tensors[i].name;
        if (strncmp(n, "model.layers.", 13) != 0) continue;
        const char *p = n + 13;
        int64_t l = 0;
        bool big = false;
        while (*p >= '0' && *p <= '9') {
            if (l > (INT64_MAX - 9) / 10) big = true; else l = l * 10 + (*p - '0');
            p++;
        }
        if (p == n + 13 || *p != '.') continue;
        if (big || l >= c->n_layers)
            return st_err(STRATA_ERR_MISMATCH,
                          "%s: tensor %s is beyond the last layer (%s has num_hidden_layers=%lld)",
                          m->path, n, src, (long long)c->n_layers);
    }
    return STRATA_OK;
}

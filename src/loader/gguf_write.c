/* GGUF writer: any opened model -> one llama GGUF v3 file (layout: gguf.c).
 *
 * Plan first (names, types, shapes, offsets), then write with stdio:
 * header, key/values (built in memory so their count is known), tensor infos,
 * padding, tensor data (each padded to the alignment). Weight rows are
 * dequantized from the source to fp32 (st_dequantize_row), permuted for Q/K,
 * and quantized to the output type (st_quantize_row), one row at a time.
 *
 * Q/K permutation (llama.cpp's converter): a projection with n_head heads of
 * hd rows, seen as [n_head, 2, hd/2, cols], is written as [n_head, hd/2, 2,
 * cols]: output row h*hd + 2*j + k is source row h*hd + k*hd/2 + j. RoPE on
 * adjacent pairs (2j, 2j+1) of the permuted rows equals HF's rotate-half RoPE
 * on pairs (j, j + hd/2) of the original rows.
 *
 * eos ids: eos_token_ids[0] is written as tokenizer.ggml.eos_token_id, [1] as
 * eot_token_id, [2] as eom_token_id (the reader collects all three back as
 * eos ids, in that order); further ids are dropped.
 */
#include "loader/gguf.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/quant.h"

#define ALIGN ST_GGUF_DEFAULT_ALIGNMENT

/* ---- growable byte buffer for the metadata ---- */
typedef struct {
    uint8_t *p;
    size_t n, cap;
    bool oom;
    uint64_t n_kv;
} buf;

static void b_put(buf *b, const void *d, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n) nc *= 2;
        uint8_t *p = st_realloc(b->p, nc);
        if (!p) { b->oom = true; return; }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void b_u32(buf *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(buf *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(buf *b, const char *s) {
    uint64_t n = strlen(s);
    b_u64(b, n);
    b_put(b, s, n);
}
static void kv_u32(buf *b, const char *key, uint32_t v) {
    b_str(b, key); b_u32(b, ST_GGUF_TYPE_UINT32); b_u32(b, v); b->n_kv++;
}
static void kv_f32(buf *b, const char *key, float v) {
    b_str(b, key); b_u32(b, ST_GGUF_TYPE_FLOAT32); b_put(b, &v, 4); b->n_kv++;
}
static void kv_str(buf *b, const char *key, const char *v) {
    b_str(b, key); b_u32(b, ST_GGUF_TYPE_STRING); b_str(b, v); b->n_kv++;
}

/* ---- the plan ---- */
typedef struct {
    char *gname;                 /* GGUF name, owned */
    const st_tensor_desc *src;   /* NULL: generated (rope_freqs) */
    st_dtype dtype;              /* output type */
    int n_dims;
    int64_t shape[ST_MAX_DIMS];  /* outermost first */
    int64_t row_len;             /* innermost dim */
    int64_t n_rows;
    uint64_t nbytes;
    uint64_t offset;             /* relative to the data section */
    int64_t perm_heads;          /* > 0: permute rows for this many heads */
    int rank_major, rank_minor;  /* output order */
} plan_t;

static int cmp_plan(const void *a, const void *b) {
    const plan_t *x = a, *y = b;
    if (x->rank_major != y->rank_major) return x->rank_major < y->rank_major ? -1 : 1;
    if (x->rank_minor != y->rank_minor) return x->rank_minor < y->rank_minor ? -1 : 1;
    return strcmp(x->gname, y->gname);
}

/* Order like llama.cpp's files: token_embd, rope_freqs, blk.0.*, blk.1.*, ...,
 * output_norm, output. */
static void rank_of(const char *g, int *major, int *minor) {
    static const char *const blk_order[] = {"attn_norm", "attn_q", "attn_k", "attn_v",
                                            "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                                            "ffn_down"};
    *minor = 0;
    if (strncmp(g, "token_embd.", 11) == 0) { *major = 0; return; }
    if (strncmp(g, "rope_freqs.", 11) == 0) { *major = 1; return; }
    if (strncmp(g, "output_norm.", 12) == 0) { *major = INT32_MAX - 1; return; }
    if (strncmp(g, "output.", 7) == 0) { *major = INT32_MAX; return; }
    if (strncmp(g, "blk.", 4) == 0) {
        char *end;
        long layer = strtol(g + 4, &end, 10);
        *major = 2 + (int)(layer < 0 || layer > 1000000000 ? 1000000000 : layer);
        const char *stem = *end == '.' ? end + 1 : end;
        for (int k = 0; k < (int)(sizeof blk_order / sizeof blk_order[0]); k++) {
            size_t l = strlen(blk_order[k]);
            if (strncmp(stem, blk_order[k], l) == 0 && stem[l] == '.') { *minor = k; return; }
        }
        *minor = 100;
        return;
    }
    *major = INT32_MAX - 2;
}

static bool writable_type(st_dtype t) {
    return t == ST_DTYPE_F32 || t == ST_DTYPE_F16 || t == ST_DTYPE_BF16 || t == ST_DTYPE_Q8_0 ||
           t == ST_DTYPE_Q4_0 || t == ST_DTYPE_Q4_1;
}

/* llama.cpp's general.file_type for a whole-file type. */
static uint32_t file_type_of(st_dtype t) {
    switch (t) {
    case ST_DTYPE_F32: return 0;
    case ST_DTYPE_F16: return 1;
    case ST_DTYPE_Q4_0: return 2;
    case ST_DTYPE_Q4_1: return 3;
    case ST_DTYPE_Q8_0: return 7;
    case ST_DTYPE_BF16: return 32;
    default: return 0;
    }
}

void st_gguf_llama3_rope_divisors(const st_config *cfg, float *out) {
    int64_t hd = cfg->head_dim;
    double factor = cfg->rope_factor, low = cfg->rope_low_freq_factor;
    double high = cfg->rope_high_freq_factor, orig = (double)cfg->rope_original_max_pos;
    double low_wavelen = orig / low, high_wavelen = orig / high;
    for (int64_t i = 0; i < hd / 2; i++) {
        /* inv_freq in fp32 as HF computes it, the rest in double. */
        float inv_f = (float)(1.0 / pow(cfg->rope_theta, (double)(float)(2 * i) / (double)hd));
        double inv = inv_f;
        double wavelen = 2.0 * M_PI / inv;
        double div;
        if (wavelen < high_wavelen) {
            div = 1.0;
        } else if (wavelen > low_wavelen || !(high > low)) {
            div = factor;
        } else {
            double smooth = (orig / wavelen - low) / (high - low);
            double scaled = (1.0 - smooth) * inv / factor + smooth * inv;
            div = inv / scaled;
        }
        out[i] = (float)div;
    }
}

typedef struct {
    FILE *f;
    const char *path;
    uint64_t written;
} writer;

static strata_status w_put(writer *w, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, w->f) != n)
        return st_err(STRATA_ERR_IO, "%s: write failed after %" PRIu64 " bytes", w->path,
                      w->written);
    w->written += n;
    return STRATA_OK;
}

static strata_status w_pad(writer *w) {
    static const uint8_t zeros[ALIGN];
    size_t pad = (size_t)((ALIGN - w->written % ALIGN) % ALIGN);
    return w_put(w, zeros, pad);
}

static void plan_free(plan_t *pl, int64_t n) {
    if (!pl) return;
    for (int64_t i = 0; i < n; i++) st_free(pl[i].gname);
    st_free(pl);
}

static strata_status fits_u32(const char *out_path, const char *what, int64_t v) {
    if (v < 0 || v > (int64_t)UINT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %s = %" PRId64 " does not fit a GGUF uint32",
                      out_path, what, v);
    return STRATA_OK;
}

/* Builds the key/values into *b. */
static strata_status build_meta(const st_model_files *src, st_dtype type, const char *out_path,
                                buf *b) {
    const st_config *c = &src->config;
    strata_status st;
    struct { const char *key; int64_t v; } ints[] = {
        {"llama.vocab_size", c->vocab_size},
        {"llama.context_length", c->max_position_embeddings},
        {"llama.embedding_length", c->hidden_size},
        {"llama.block_count", c->n_layers},
        {"llama.feed_forward_length", c->intermediate_size},
        {"llama.attention.head_count", c->n_heads},
        {"llama.attention.head_count_kv", c->n_kv_heads},
        {"llama.attention.key_length", c->head_dim},
        {"llama.attention.value_length", c->head_dim},
        {"llama.rope.dimension_count", c->head_dim},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if ((st = fits_u32(out_path, ints[i].key, ints[i].v))) return st;

    kv_str(b, "general.architecture", "llama");
    kv_u32(b, "general.alignment", ALIGN);
    kv_u32(b, "general.file_type", file_type_of(type));
    if (st_dtype_get(type)->quantized) kv_u32(b, "general.quantization_version", 2);
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        kv_u32(b, ints[i].key, (uint32_t)ints[i].v);
    kv_f32(b, "llama.attention.layer_norm_rms_epsilon", c->rms_norm_eps);
    kv_f32(b, "llama.rope.freq_base", (float)c->rope_theta);
    if (c->rope_scaling == ST_ROPE_SCALING_LINEAR) {
        kv_str(b, "llama.rope.scaling.type", "linear");
        kv_f32(b, "llama.rope.scaling.factor", (float)c->rope_factor);
    }
    static const char *const id_keys[] = {"tokenizer.ggml.bos_token_id",
                                          "tokenizer.ggml.eos_token_id",
                                          "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id"};
    if (c->bos_token_id >= 0) kv_u32(b, id_keys[0], (uint32_t)c->bos_token_id);
    for (int i = 0; i < c->n_eos && i < 3; i++)
        if (c->eos_token_ids[i] >= 0) kv_u32(b, id_keys[1 + i], (uint32_t)c->eos_token_ids[i]);

    /* A GGUF source's tokenizer travels verbatim. */
    const st_gguf_meta *g = src->gguf;
    for (int64_t i = 0; g && i < st_gguf_n_keys(g); i++) {
        const char *key = st_gguf_key_name(g, i);
        if (strncmp(key, "tokenizer.", 10) != 0) continue;
        bool skip = false;
        for (size_t k = 0; k < 4; k++) skip |= strcmp(key, id_keys[k]) == 0;
        if (skip) continue;
        const uint8_t *raw;
        uint64_t len;
        st_gguf_key_raw(g, i, &raw, &len);
        b_str(b, key);
        b_u32(b, (uint32_t)st_gguf_key_type(g, i));
        b_put(b, raw, (size_t)len);
        b->n_kv++;
    }
    if (b->oom) return st_err(STRATA_ERR_NOMEM, "%s: out of memory building metadata", out_path);
    return STRATA_OK;
}

/* Fills the plan; *n_out entries. */
static strata_status build_plan(const st_model_files *src, st_dtype type, const char *out_path,
                                plan_t **out, int64_t *n_out) {
    const st_config *c = &src->config;
    plan_t *pl = st_calloc((size_t)src->n_tensors + 1, sizeof(plan_t));
    if (!pl) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", out_path);
    int64_t n = 0;
    bool have_rope_freqs = false;
    strata_status st = STRATA_OK;
    for (int64_t i = 0; i < src->n_tensors; i++) {
        const st_tensor_desc *t = &src->tensors[i];
        if (c->tie_word_embeddings && strcmp(t->name, "lm_head.weight") == 0) continue;
        char *gname = st_gguf_name_from_hf(t->name);
        if (!gname) {
            st_log(STRATA_LOG_INFO, "gguf write: skipping tensor '%s' (no GGUF name)", t->name);
            continue;
        }
        plan_t *p = &pl[n++];
        p->gname = gname;
        p->src = t;
        p->n_dims = t->n_dims;
        memcpy(p->shape, t->shape, sizeof p->shape);
        p->row_len = t->shape[t->n_dims - 1];
        p->n_rows = 1;
        for (int d = 0; d + 1 < t->n_dims; d++) p->n_rows *= t->shape[d];
        if (strcmp(gname, "rope_freqs.weight") == 0) have_rope_freqs = true;
        if (t->n_dims == 2 && strncmp(gname, "rope_freqs.", 11) != 0) {
            p->dtype = type;
            if (p->row_len % st_dtype_get(type)->block_elems) {
                st_log(STRATA_LOG_WARN, "gguf write: '%s' rows of %" PRId64
                       " are not a multiple of the %s block; writing it as f16",
                       gname, p->row_len, st_dtype_name(type));
                p->dtype = ST_DTYPE_F16;
            }
        } else {
            p->dtype = ST_DTYPE_F32;
        }
        if (!c->rope_interleaved) {
            size_t l = strlen(gname);
            bool is_q = l > 14 && strcmp(gname + l - 14, ".attn_q.weight") == 0;
            bool is_k = l > 14 && strcmp(gname + l - 14, ".attn_k.weight") == 0;
            if (is_q || is_k) {
                int64_t heads = is_q ? c->n_heads : c->n_kv_heads;
                if (t->n_dims != 2 || heads <= 0 || p->n_rows % heads ||
                    (p->n_rows / heads) % 2) {
                    st = st_err(STRATA_ERR_MISMATCH, "%s: tensor '%s' has %" PRId64
                                " rows, which cannot be split into %" PRId64
                                " heads of an even size", out_path, t->name, p->n_rows, heads);
                    goto fail;
                }
                p->perm_heads = heads;
            }
        }
    }
    if (c->rope_scaling == ST_ROPE_SCALING_LLAMA3 && !have_rope_freqs) {
        if (c->head_dim < 2 || !(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) ||
            !(c->rope_high_freq_factor > 0) || c->rope_original_max_pos <= 0) {
            st = st_err(STRATA_ERR_INVALID_ARG, "%s: the source's llama3 rope scaling "
                        "parameters are incomplete", out_path);
            goto fail;
        }
        plan_t *p = &pl[n++];
        if (!(p->gname = st_strdup("rope_freqs.weight"))) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", out_path);
            goto fail;
        }
        p->dtype = ST_DTYPE_F32;
        p->n_dims = 1;
        p->shape[0] = c->head_dim / 2;
        p->row_len = p->shape[0];
        p->n_rows = 1;
    }
    for (int64_t i = 0; i < n; i++) rank_of(pl[i].gname, &pl[i].rank_major, &pl[i].rank_minor);
    qsort(pl, (size_t)n, sizeof(plan_t), cmp_plan);
    uint64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        plan_t *p = &pl[i];
        p->nbytes = (uint64_t)st_dtype_row_bytes(p->dtype, p->row_len) * (uint64_t)p->n_rows;
        p->offset = off;
        off += (p->nbytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    *out = pl;
    *n_out = n;
    return STRATA_OK;
fail:
    plan_free(pl, n);
    return st;
}

/* Writes one tensor's data. rowf: row_len floats; rowq: output row bytes;
 * (both sized by the caller for the largest row). */
static strata_status write_tensor(writer *w, const st_model_files *src, const plan_t *p,
                                  float *rowf, void *rowq) {
    strata_status st;
    if (!p->src) { /* generated rope_freqs */
        st_gguf_llama3_rope_divisors(&src->config, rowf);
        return w_put(w, rowf, (size_t)p->row_len * sizeof(float));
    }
    const uint8_t *data = st_tensor_data(src, p->src);
    size_t src_row = st_dtype_row_bytes(p->src->dtype, p->row_len);
    size_t out_row = st_dtype_row_bytes(p->dtype, p->row_len);
    if (!data || !src_row || (uint64_t)src_row * (uint64_t)p->n_rows != p->src->nbytes)
        return st_err(STRATA_ERR_INTERNAL, "%s: tensor '%s' of the source has inconsistent "
                      "sizes", w->path, p->src->name);
    int64_t hd = p->perm_heads ? p->n_rows / p->perm_heads : 0;
    for (int64_t r = 0; r < p->n_rows; r++) {
        int64_t sr = r;
        if (p->perm_heads) {
            int64_t h = r / hd, rem = r % hd;
            sr = h * hd + (rem % 2) * (hd / 2) + rem / 2;
        }
        const uint8_t *srow = data + (size_t)sr * src_row;
        if (p->src->dtype == p->dtype) {
            if ((st = w_put(w, srow, out_row))) return st;
            continue;
        }
        st_dequantize_row(p->src->dtype, srow, rowf, p->row_len);
        if (!st_quantize_row(p->dtype, rowf, rowq, p->row_len))
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: tensor '%s': cannot convert to %s",
                          w->path, p->gname, st_dtype_name(p->dtype));
        if ((st = w_put(w, rowq, out_row))) return st;
    }
    return STRATA_OK;
}

strata_status st_gguf_write_model(const st_model_files *src, st_dtype type, const char *out_path) {
    if (!src || !out_path)
        return st_err(STRATA_ERR_INVALID_ARG, "st_gguf_write_model: src or out_path is NULL");
    if (!writable_type(type))
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: cannot write tensors as %s (f32, f16, bf16, "
                      "q8_0, q4_0, q4_1 are supported)", out_path, st_dtype_name(type));
    /* Writing over a file of the source would pull its mapping from under us. */
    struct stat osb;
    if (stat(out_path, &osb) == 0) {
        for (int i = 0; i < src->n_files; i++) {
            struct stat fsb;
            if (src->files[i].fd >= 0 && fstat(src->files[i].fd, &fsb) == 0 &&
                fsb.st_dev == osb.st_dev && fsb.st_ino == osb.st_ino)
                return st_err(STRATA_ERR_INVALID_ARG, "%s: is a file of the source model %s; "
                              "write the GGUF elsewhere", out_path, src->path);
        }
    }
    strata_status st;
    buf meta = {0};
    plan_t *pl = NULL;
    int64_t n = 0;
    float *rowf = NULL;
    uint8_t *rowq = NULL;
    writer w = {.f = NULL, .path = out_path, .written = 0};
    char *iobuf = NULL;

    if ((st = build_meta(src, type, out_path, &meta))) goto done;
    if ((st = build_plan(src, type, out_path, &pl, &n))) goto done;

    int64_t max_row = 1;
    for (int64_t i = 0; i < n; i++) if (pl[i].row_len > max_row) max_row = pl[i].row_len;
    rowf = st_malloc((size_t)max_row * sizeof(float));
    rowq = st_malloc((size_t)max_row * sizeof(float)); /* >= any output row */
    iobuf = st_malloc(1 << 20);
    if (!rowf || !rowq || !iobuf) {
        st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", out_path);
        goto done;
    }

    w.f = fopen(out_path, "wb");
    if (!w.f) {
        st = st_err(STRATA_ERR_IO, "%s: cannot create: %s", out_path, strerror(errno));
        goto done;
    }
    setvbuf(w.f, iobuf, _IOFBF, 1 << 20);

    /* header + key/values */
    buf hdr = {0};
    b_put(&hdr, "GGUF", 4);
    b_u32(&hdr, 3);
    b_u64(&hdr, (uint64_t)n);
    b_u64(&hdr, meta.n_kv);
    /* tensor infos */
    for (int64_t i = 0; i < n; i++) {
        const plan_t *p = &pl[i];
        b_str(&hdr, p->gname);
        b_u32(&hdr, (uint32_t)p->n_dims);
        for (int d = p->n_dims - 1; d >= 0; d--) b_u64(&hdr, (uint64_t)p->shape[d]);
        b_u32(&hdr, st_gguf_dtype_to_ggml(p->dtype));
        b_u64(&hdr, p->offset);
    }
    if (hdr.oom) {
        st_free(hdr.p);
        st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", out_path);
        goto done;
    }
    /* magic..counts, then the KVs, then the infos */
    st = w_put(&w, hdr.p, 24);
    if (!st) st = w_put(&w, meta.p, meta.n);
    if (!st) st = w_put(&w, hdr.p + 24, hdr.n - 24);
    st_free(hdr.p);
    if (st) goto done;

    if ((st = w_pad(&w))) goto done;
    uint64_t data_start = w.written;
    for (int64_t i = 0; i < n; i++) {
        ST_ASSERT(w.written == data_start + pl[i].offset);
        if ((st = write_tensor(&w, src, &pl[i], rowf, rowq))) goto done;
        if ((st = w_pad(&w))) goto done;
    }
    if (fflush(w.f) != 0) st = st_err(STRATA_ERR_IO, "%s: write failed: %s", out_path, strerror(errno));

done:
    if (w.f) {
        if (fclose(w.f) != 0 && !st)
            st = st_err(STRATA_ERR_IO, "%s: close failed: %s", out_path, strerror(errno));
        /* remove what we created, never a device or other special file */
        struct stat sb;
        if (st && stat(out_path, &sb) == 0 && S_ISREG(sb.st_mode)) remove(out_path);
    }
    st_free(iobuf);
    st_free(rowf);
    st_free(rowq);
    plan_free(pl, n);
    st_free(meta.p);
    return st;
}

/* GGUF reader: one .gguf file -> st_model_files (config + tensor descriptors)
 * plus its key/value metadata (st_gguf_meta, see gguf.h).
 *
 * Byte layout (GGUF v3; all integers little-endian, no padding between fields):
 *
 *   header   char[4]  magic = "GGUF"
 *            u32      version (3; version 2 has the identical layout and is
 *                     accepted too; version 1 used u32 counts and is refused)
 *            u64      n_tensors
 *            u64      n_kv
 *   n_kv x   string   key            string = u64 len + len bytes (no NUL)
 *   KV       u32      value type
 *            value    by type: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32,
 *                     7 bool (1 byte, 0 or 1), 8 string, 10 u64, 11 i64, 12 f64,
 *                     9 array = u32 element type + u64 count + count values
 *                     (arrays of arrays are refused here)
 *   n_tensors x  string  name
 *   tensor   u32      n_dims (1..4)
 *   info     u64      ne[n_dims]   element counts, ne[0] innermost (contiguous)
 *            u32      ggml type: 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K,
 *                     14 Q6_K, 30 BF16 (others exist; strata refuses them)
 *            u64      offset of the tensor's data, relative to the data section
 *   padding  zeros up to the next multiple of the alignment
 *   data     the data section; the alignment is the u32 key general.alignment
 *            (default 32, a power of two); every tensor offset is a multiple of
 *            it; a tensor's bytes are ne[0]/block * block_bytes * ne[1]*...
 *            (ne[0] must be a multiple of the type's block size).
 *
 * The file is mapped; descriptors point into the mapping (offset = data
 * section + tensor offset) and tensor data is never copied. Every length and
 * count is checked against the bytes left before anything is allocated, with
 * overflow-checked arithmetic; a structure that would run past the end of the
 * file is STRATA_ERR_IO ("truncated"), malformed content STRATA_ERR_FORMAT,
 * well-formed but unhandled content (types, architecture) STRATA_ERR_UNSUPPORTED.
 */
#include "loader/gguf.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

typedef struct {
    char *key;          /* owned, NUL-terminated */
    uint32_t type;      /* st_gguf_type */
    uint64_t raw_off;   /* the encoded value in the file */
    uint64_t raw_len;
    /* scalars */
    uint64_t u;         /* unsigned ints, bool */
    int64_t i;          /* signed ints */
    double f;           /* floats */
    char *str;          /* STRING: owned NUL-terminated copy */
    uint64_t str_len;
    /* ARRAY */
    uint32_t arr_type;
    uint64_t arr_count;
    uint64_t arr_off;   /* first element in the file */
    uint64_t *arr_str;  /* STRING arrays: file offset of each string's u64 length */
} gguf_kv;

struct st_gguf_meta {
    char *path;
    const uint8_t *base; /* the mapping (not owned) */
    uint64_t size;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    gguf_kv *kvs;
    int64_t n_kv;
};

/* ---- type tables ------------------------------------------------------------ */

static const char *const g_type_names[ST_GGUF_TYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64",
};
/* Encoded size of a scalar value; 0 for string/array. */
static const uint8_t g_type_size[ST_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *st_gguf_type_name(uint32_t t) {
    return t < ST_GGUF_TYPE_COUNT ? g_type_names[t] : "?";
}

bool st_gguf_dtype_from_ggml(uint32_t ggml_type, st_dtype *out) {
    switch (ggml_type) {
    case ST_GGML_TYPE_F32: *out = ST_DTYPE_F32; return true;
    case ST_GGML_TYPE_F16: *out = ST_DTYPE_F16; return true;
    case ST_GGML_TYPE_BF16: *out = ST_DTYPE_BF16; return true;
    case ST_GGML_TYPE_Q8_0: *out = ST_DTYPE_Q8_0; return true;
    case ST_GGML_TYPE_Q4_0: *out = ST_DTYPE_Q4_0; return true;
    case ST_GGML_TYPE_Q4_1: *out = ST_DTYPE_Q4_1; return true;
    case ST_GGML_TYPE_Q4_K: *out = ST_DTYPE_Q4_K; return true;
    case ST_GGML_TYPE_Q6_K: *out = ST_DTYPE_Q6_K; return true;
    default: return false;
    }
}

uint32_t st_gguf_dtype_to_ggml(st_dtype t) {
    switch (t) {
    case ST_DTYPE_F32: return ST_GGML_TYPE_F32;
    case ST_DTYPE_F16: return ST_GGML_TYPE_F16;
    case ST_DTYPE_BF16: return ST_GGML_TYPE_BF16;
    case ST_DTYPE_Q8_0: return ST_GGML_TYPE_Q8_0;
    case ST_DTYPE_Q4_0: return ST_GGML_TYPE_Q4_0;
    case ST_DTYPE_Q4_1: return ST_GGML_TYPE_Q4_1;
    case ST_DTYPE_Q4_K: return ST_GGML_TYPE_Q4_K;
    case ST_DTYPE_Q6_K: return ST_GGML_TYPE_Q6_K;
    default: break;
    }
    ST_ASSERT(!"st_gguf_dtype_to_ggml: invalid dtype");
    return 0;
}

/* Names of other ggml types, for messages only. */
static const char *ggml_type_name(uint32_t t) {
    switch (t) {
    case 0: return "f32";
    case 1: return "f16";
    case 2: return "q4_0";
    case 3: return "q4_1";
    case 6: return "q5_0";
    case 7: return "q5_1";
    case 8: return "q8_0";
    case 9: return "q8_1";
    case 10: return "q2_K";
    case 11: return "q3_K";
    case 12: return "q4_K";
    case 13: return "q5_K";
    case 14: return "q6_K";
    case 15: return "q8_K";
    case 24: return "i8";
    case 25: return "i16";
    case 26: return "i32";
    case 27: return "i64";
    case 28: return "f64";
    case 30: return "bf16";
    default: return "unknown";
    }
}

/* ---- tensor names -------------------------------------------------------------- */

static const struct {
    const char *gguf; /* stem, the ".weight" / ".bias" tail is kept */
    const char *hf;
} g_blk_names[] = {
    {"attn_norm", "input_layernorm"},
    {"attn_q", "self_attn.q_proj"},
    {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},
    {"attn_output", "self_attn.o_proj"},
    {"ffn_norm", "post_attention_layernorm"},
    {"ffn_gate", "mlp.gate_proj"},
    {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},
}, g_top_names[] = {
    {"token_embd", "model.embed_tokens"},
    {"output_norm", "model.norm"},
    {"output", "lm_head"},
};
#define N_BLK_NAMES (sizeof g_blk_names / sizeof g_blk_names[0])
#define N_TOP_NAMES (sizeof g_top_names / sizeof g_top_names[0])

static bool is_tail(const char *s) { return strcmp(s, ".weight") == 0 || strcmp(s, ".bias") == 0; }

/* Length of a run of decimal digits at s (0 if none, or more than 9 digits). */
static size_t digits_len(const char *s) {
    size_t n = 0;
    while (s[n] >= '0' && s[n] <= '9') n++;
    return n <= 9 ? n : 0;
}

static char *join3(const char *a, const char *b, const char *c) {
    size_t la = strlen(a), lb = strlen(b), lc = strlen(c);
    char *r = st_malloc(la + lb + lc + 1);
    if (!r) return NULL;
    memcpy(r, a, la);
    memcpy(r + la, b, lb);
    memcpy(r + la + lb, c, lc + 1);
    return r;
}

char *st_gguf_name_to_hf(const char *name) {
    if (strncmp(name, "blk.", 4) == 0) {
        size_t nd = digits_len(name + 4);
        if (nd && name[4 + nd] == '.') {
            const char *stem = name + 5 + nd;
            for (size_t k = 0; k < N_BLK_NAMES; k++) {
                size_t ls = strlen(g_blk_names[k].gguf);
                if (strncmp(stem, g_blk_names[k].gguf, ls) == 0 && is_tail(stem + ls)) {
                    char layer[16];
                    snprintf(layer, sizeof layer, "%.*s.", (int)nd, name + 4);
                    char *pre = join3("model.layers.", layer, g_blk_names[k].hf);
                    if (!pre) return NULL;
                    char *r = join3(pre, stem + ls, "");
                    st_free(pre);
                    return r;
                }
            }
        }
        return st_strdup(name);
    }
    for (size_t k = 0; k < N_TOP_NAMES; k++) {
        size_t ls = strlen(g_top_names[k].gguf);
        if (strncmp(name, g_top_names[k].gguf, ls) == 0 && is_tail(name + ls))
            return join3(g_top_names[k].hf, name + ls, "");
    }
    return st_strdup(name);
}

char *st_gguf_name_from_hf(const char *name) {
    if (strncmp(name, "model.layers.", 13) == 0) {
        const char *p = name + 13;
        size_t nd = digits_len(p);
        if (!nd || p[nd] != '.') return NULL;
        const char *stem = p + nd + 1;
        for (size_t k = 0; k < N_BLK_NAMES; k++) {
            size_t ls = strlen(g_blk_names[k].hf);
            if (strncmp(stem, g_blk_names[k].hf, ls) == 0 && is_tail(stem + ls)) {
                char layer[16];
                snprintf(layer, sizeof layer, "%.*s.", (int)nd, p);
                char *pre = join3("blk.", layer, g_blk_names[k].gguf);
                if (!pre) return NULL;
                char *r = join3(pre, stem + ls, "");
                st_free(pre);
                return r;
            }
        }
        return NULL;
    }
    for (size_t k = 0; k < N_TOP_NAMES; k++) {
        size_t ls = strlen(g_top_names[k].hf);
        if (strncmp(name, g_top_names[k].hf, ls) == 0 && is_tail(name + ls))
            return join3(g_top_names[k].gguf, name + ls, "");
    }
    if (strcmp(name, "rope_freqs.weight") == 0) return st_strdup(name);
    return NULL;
}

/* ---- metadata access ------------------------------------------------------------- */

void st_gguf_meta_free(st_gguf_meta *g) {
    if (!g) return;
    for (int64_t i = 0; i < g->n_kv; i++) {
        st_free(g->kvs[i].key);
        st_free(g->kvs[i].str);
        st_free(g->kvs[i].arr_str);
    }
    st_free(g->kvs);
    st_free(g->path);
    st_free(g);
}

uint32_t st_gguf_version(const st_gguf_meta *g) { return g->version; }
uint32_t st_gguf_alignment(const st_gguf_meta *g) { return g->alignment; }
uint64_t st_gguf_data_offset(const st_gguf_meta *g) { return g->data_offset; }
int64_t st_gguf_n_keys(const st_gguf_meta *g) { return g ? g->n_kv : 0; }

int64_t st_gguf_find_key(const st_gguf_meta *g, const char *key) {
    if (!g || !key) return -1;
    for (int64_t i = 0; i < g->n_kv; i++)
        if (strcmp(g->kvs[i].key, key) == 0) return i;
    return -1;
}

const char *st_gguf_key_name(const st_gguf_meta *g, int64_t i) {
    ST_ASSERT(g && i >= 0 && i < g->n_kv);
    return g->kvs[i].key;
}

st_gguf_type st_gguf_key_type(const st_gguf_meta *g, int64_t i) {
    ST_ASSERT(g && i >= 0 && i < g->n_kv);
    return (st_gguf_type)g->kvs[i].type;
}

void st_gguf_key_raw(const st_gguf_meta *g, int64_t i, const uint8_t **data, uint64_t *len) {
    ST_ASSERT(g && i >= 0 && i < g->n_kv);
    *data = g->base + g->kvs[i].raw_off;
    *len = g->kvs[i].raw_len;
}

static bool type_is_int(uint32_t t) {
    return t == ST_GGUF_TYPE_UINT8 || t == ST_GGUF_TYPE_INT8 || t == ST_GGUF_TYPE_UINT16 ||
           t == ST_GGUF_TYPE_INT16 || t == ST_GGUF_TYPE_UINT32 || t == ST_GGUF_TYPE_INT32 ||
           t == ST_GGUF_TYPE_UINT64 || t == ST_GGUF_TYPE_INT64;
}
static bool type_is_signed(uint32_t t) {
    return t == ST_GGUF_TYPE_INT8 || t == ST_GGUF_TYPE_INT16 || t == ST_GGUF_TYPE_INT32 ||
           t == ST_GGUF_TYPE_INT64;
}
static bool type_is_float(uint32_t t) {
    return t == ST_GGUF_TYPE_FLOAT32 || t == ST_GGUF_TYPE_FLOAT64;
}

static const gguf_kv *lookup(const st_gguf_meta *g, const char *key, strata_status *st) {
    int64_t i = st_gguf_find_key(g, key);
    if (i < 0) {
        *st = st_err(STRATA_ERR_NOT_FOUND, "%s: GGUF key '%s' is missing",
                     g && g->path ? g->path : "gguf", key);
        return NULL;
    }
    *st = STRATA_OK;
    return &g->kvs[i];
}

static strata_status bad_type(const st_gguf_meta *g, const gguf_kv *kv, const char *want) {
    return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s' has type %s, expected %s", g->path,
                  kv->key, st_gguf_type_name(kv->type), want);
}

/* An integer key as a signed/unsigned pair checked against [lo, hi]. */
static strata_status get_int(const st_gguf_meta *g, const char *key, int64_t lo, uint64_t hi, int64_t *outs, uint64_t *outu) {
    strata_status st;
    const gguf_kv *kv = lookup(g, key, &st);
    if (!kv) return st;
    if (!type_is_int(kv->type)) return bad_type(g, kv, "an integer");
    bool ok;
    if (type_is_signed(kv->type)) {
        ok = kv->i >= lo && (kv->i < 0 || (uint64_t)kv->i <= hi);
        if (ok) { *outs = kv->i; *outu = (uint64_t)kv->i; }
    } else {
        ok = kv->u <= hi;
        if (ok) { *outu = kv->u; *outs = (int64_t)kv->u; }
    }
    if (!ok) {
        if (type_is_signed(kv->type))
            return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s' = %" PRId64 " is out of range",
                          g->path, key, kv->i);
        return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s' = %" PRIu64 " is out of range",
                      g->path, key, kv->u);
    }
    return STRATA_OK;
}

strata_status st_gguf_get_u32(const st_gguf_meta *g, const char *key, uint32_t *out) {
    int64_t s; uint64_t u;
    strata_status st = get_int(g, key, 0, UINT32_MAX, &s, &u);
    if (st == STRATA_OK) *out = (uint32_t)u;
    return st;
}
strata_status st_gguf_get_i32(const st_gguf_meta *g, const char *key, int32_t *out) {
    int64_t s; uint64_t u;
    strata_status st = get_int(g, key, INT32_MIN, INT32_MAX, &s, &u);
    if (st == STRATA_OK) *out = (int32_t)s;
    return st;
}
strata_status st_gguf_get_u64(const st_gguf_meta *g, const char *key, uint64_t *out) {
    int64_t s; uint64_t u;
    strata_status st = get_int(g, key, 0, UINT64_MAX, &s, &u);
    if (st == STRATA_OK) *out = u;
    return st;
}
strata_status st_gguf_get_i64(const st_gguf_meta *g, const char *key, int64_t *out) {
    int64_t s; uint64_t u;
    strata_status st = get_int(g, key, INT64_MIN, INT64_MAX, &s, &u);
    if (st == STRATA_OK) *out = s;
    return st;
}

strata_status st_gguf_get_f64(const st_gguf_meta *g, const char *key, double *out) {
    strata_status st;
    const gguf_kv *kv = lookup(g, key, &st);
    if (!kv) return st;
    if (!type_is_float(kv->type)) return bad_type(g, kv, "float32 or float64");
    *out = kv->f;
    return STRATA_OK;
}
strata_status st_gguf_get_f32(const st_gguf_meta *g, const char *key, float *out) {
    double d;
    strata_status st = st_gguf_get_f64(g, key, &d);
    if (st == STRATA_OK) *out = (float)d;
    return st;
}
strata_status st_gguf_get_bool(const st_gguf_meta *g, const char *key, bool *out) {
    strata_status st;
    const gguf_kv *kv = lookup(g, key, &st);
    if (!kv) return st;
    if (kv->type != ST_GGUF_TYPE_BOOL) return bad_type(g, kv, "bool");
    *out = kv->u != 0;
    return STRATA_OK;
}
strata_status st_gguf_get_str(const st_gguf_meta *g, const char *key, const char **out,
                              uint64_t *len) {
    strata_status st;
    const gguf_kv *kv = lookup(g, key, &st);
    if (!kv) return st;
    if (kv->type != ST_GGUF_TYPE_STRING) return bad_type(g, kv, "string");
    *out = kv->str;
    if (len) *len = kv->str_len;
    return STRATA_OK;
}

strata_status st_gguf_get_arr(const st_gguf_meta *g, const char *key, int64_t *key_index,
                              st_gguf_type *elem_type, uint64_t *count) {
    strata_status st;
    const gguf_kv *kv = lookup(g, key, &st);
    if (!kv) return st;
    if (kv->type != ST_GGUF_TYPE_ARRAY) return bad_type(g, kv, "array");
    if (key_index) *key_index = kv - g->kvs;
    if (elem_type) *elem_type = (st_gguf_type)kv->arr_type;
    if (count) *count = kv->arr_count;
    return STRATA_OK;
}

static const gguf_kv *arr_kv(const st_gguf_meta *g, int64_t ki, uint64_t i) {
    if (!g || ki < 0 || ki >= g->n_kv) return NULL;
    const gguf_kv *kv = &g->kvs[ki];
    if (kv->type != ST_GGUF_TYPE_ARRAY || i >= kv->arr_count) return NULL;
    return kv;
}

bool st_gguf_arr_str(const st_gguf_meta *g, int64_t ki, uint64_t i, const char **s,
                     uint64_t *len) {
    const gguf_kv *kv = arr_kv(g, ki, i);
    if (!kv || kv->arr_type != ST_GGUF_TYPE_STRING) return false;
    uint64_t n;
    memcpy(&n, g->base + kv->arr_str[i], 8);
    *s = (const char *)(g->base + kv->arr_str[i] + 8);
    if (len) *len = n;
    return true;
}

/* Reads one scalar of numeric type t at p into (u, i, f). */
static void decode_scalar(uint32_t t, const uint8_t *p, uint64_t *u, int64_t *i, double *f) {
    *u = 0; *i = 0; *f = 0;
    switch (t) {
    case ST_GGUF_TYPE_UINT8: case ST_GGUF_TYPE_BOOL: *u = p[0]; break;
    case ST_GGUF_TYPE_INT8: *i = (int8_t)p[0]; break;
    case ST_GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); *u = v; break; }
    case ST_GGUF_TYPE_INT16: { int16_t v; memcpy(&v, p, 2); *i = v; break; }
    case ST_GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); *u = v; break; }
    case ST_GGUF_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); *i = v; break; }
    case ST_GGUF_TYPE_UINT64: memcpy(u, p, 8); break;
    case ST_GGUF_TYPE_INT64: memcpy(i, p, 8); break;
    case ST_GGUF_TYPE_FLOAT32: { float v; memcpy(&v, p, 4); *f = v; break; }
    case ST_GGUF_TYPE_FLOAT64: memcpy(f, p, 8); break;
    default: break;
    }
}

bool st_gguf_arr_i64(const st_gguf_meta *g, int64_t ki, uint64_t i, int64_t *out) {
    const gguf_kv *kv = arr_kv(g, ki, i);
    if (!kv || !(type_is_int(kv->arr_type) || kv->arr_type == ST_GGUF_TYPE_BOOL)) return false;
    uint64_t u; int64_t s; double f;
    decode_scalar(kv->arr_type, g->base + kv->arr_off + i * g_type_size[kv->arr_type], &u, &s, &f);
    if (type_is_signed(kv->arr_type)) { *out = s; return true; }
    if (u > INT64_MAX) return false;
    *out = (int64_t)u;
    return true;
}

bool st_gguf_arr_f64(const st_gguf_meta *g, int64_t ki, uint64_t i, double *out) {
    const gguf_kv *kv = arr_kv(g, ki, i);
    if (!kv || kv->arr_type == ST_GGUF_TYPE_STRING) return false;
    uint64_t u; int64_t s; double f;
    decode_scalar(kv->arr_type, g->base + kv->arr_off + i * g_type_size[kv->arr_type], &u, &s, &f);
    if (type_is_float(kv->arr_type)) *out = f;
    else if (type_is_signed(kv->arr_type)) *out = (double)s;
    else *out = (double)u;
    return true;
}

/* ---- the parser --------------------------------------------------------------- */

typedef struct {
    const char *path;
    const uint8_t *p;
    uint64_t size;
    uint64_t pos;
} reader;

/* Fails unless n more bytes exist at the cursor. `what` (printf-style) says
 * what was being read. */
static strata_status rd_need(reader *r, uint64_t n, const char *what, const char *name) {
    if (n <= r->size - r->pos) return STRATA_OK;
    return st_err(STRATA_ERR_IO,
                  "%s: truncated or corrupt GGUF file: %s%s%s%s needs %" PRIu64
                  " bytes at offset %" PRIu64 " but only %" PRIu64 " remain",
                  r->path, what, name ? " '" : "", name ? name : "", name ? "'" : "", n, r->pos,
                  r->size - r->pos);
}

static strata_status rd_u32(reader *r, uint32_t *v, const char *what, const char *name) {
    strata_status st = rd_need(r, 4, what, name);
    if (st) return st;
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return STRATA_OK;
}

static strata_status rd_u64(reader *r, uint64_t *v, const char *what, const char *name) {
    strata_status st = rd_need(r, 8, what, name);
    if (st) return st;
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return STRATA_OK;
}

/* A GGUF string: on success *off is the file offset of its bytes. */
static strata_status rd_str(reader *r, uint64_t *off, uint64_t *len, const char *what,
                            const char *name) {
    strata_status st = rd_u64(r, len, what, name);
    if (st) return st;
    if ((st = rd_need(r, *len, what, name))) return st;
    *off = r->pos;
    r->pos += *len;
    return STRATA_OK;
}

/* A GGUF string copied to a NUL-terminated heap string (its length was checked
 * against the file, so the allocation is bounded by the file size). */
static strata_status rd_str_dup(reader *r, char **out, uint64_t *out_len, const char *what,
                                const char *name) {
    uint64_t off, len;
    strata_status st = rd_str(r, &off, &len, what, name);
    if (st) return st;
    char *s = st_malloc((size_t)len + 1);
    if (!s) return st_err(STRATA_ERR_NOMEM, "%s: out of memory reading %s", r->path, what);
    memcpy(s, r->p + off, (size_t)len);
    s[len] = '\0';
    *out = s;
    if (out_len) *out_len = len;
    return STRATA_OK;
}

/* Reads one KV value of `type` (the type field already consumed) into kv. */
static strata_status rd_value(reader *r, gguf_kv *kv) {
    strata_status st;
    const char *key = kv->key;
    uint32_t t = kv->type;
    kv->raw_off = r->pos;
    if (t >= ST_GGUF_TYPE_COUNT)
        return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s' has unknown value type %" PRIu32,
                      r->path, key, t);
    if (t == ST_GGUF_TYPE_STRING) {
        st = rd_str_dup(r, &kv->str, &kv->str_len, "the string value of key", key);
    } else if (t == ST_GGUF_TYPE_ARRAY) {
        uint32_t et;
        uint64_t n;
        if ((st = rd_u32(r, &et, "the array element type of key", key))) return st;
        if ((st = rd_u64(r, &n, "the array length of key", key))) return st;
        if (et == ST_GGUF_TYPE_ARRAY)
            return st_err(STRATA_ERR_UNSUPPORTED,
                          "%s: GGUF key '%s' is an array of arrays (nested arrays are not supported)",
                          r->path, key);
        if (et >= ST_GGUF_TYPE_COUNT)
            return st_err(STRATA_ERR_FORMAT,
                          "%s: GGUF key '%s' is an array of unknown element type %" PRIu32,
                          r->path, key, et);
        kv->arr_type = et;
        kv->arr_count = n;
        kv->arr_off = r->pos;
        if (et != ST_GGUF_TYPE_STRING) {
            uint64_t bytes;
            if (st_mul_ovf_u64(n, g_type_size[et], &bytes)) bytes = UINT64_MAX;
            if ((st = rd_need(r, bytes, "the array elements of key", key))) return st;
            if (et == ST_GGUF_TYPE_BOOL)
                for (uint64_t i = 0; i < n; i++)
                    if (r->p[r->pos + i] > 1)
                        return st_err(STRATA_ERR_FORMAT,
                                      "%s: GGUF key '%s': bool array element %" PRIu64
                                      " has value %u (not 0 or 1)",
                                      r->path, key, i, r->p[r->pos + i]);
            r->pos += bytes;
        } else {
            /* Every string takes at least its 8-byte length: bound the count
             * first, then validate every length (no allocation), then index. */
            uint64_t min_bytes;
            if (st_mul_ovf_u64(n, 8, &min_bytes)) min_bytes = UINT64_MAX;
            if ((st = rd_need(r, min_bytes, "the string array of key", key))) return st;
            uint64_t start = r->pos;
            for (uint64_t i = 0; i < n; i++) {
                uint64_t off, len;
                if ((st = rd_str(r, &off, &len, "a string in the array of key", key))) return st;
            }
            uint64_t end = r->pos;
            kv->arr_str = st_malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
            if (!kv->arr_str)
                return st_err(STRATA_ERR_NOMEM, "%s: out of memory indexing the %" PRIu64
                              " strings of key '%s'", r->path, n, key);
            r->pos = start;
            for (uint64_t i = 0; i < n; i++) {
                uint64_t len;
                kv->arr_str[i] = r->pos;
                memcpy(&len, r->p + r->pos, 8);
                r->pos += 8 + len;
            }
            ST_ASSERT(r->pos == end);
        }
    } else {
        uint64_t n = g_type_size[t];
        if ((st = rd_need(r, n, "the value of key", key))) return st;
        decode_scalar(t, r->p + r->pos, &kv->u, &kv->i, &kv->f);
        if (t == ST_GGUF_TYPE_BOOL && kv->u > 1)
            return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s': bool value %" PRIu64
                          " is not 0 or 1", r->path, key, kv->u);
        r->pos += n;
        st = STRATA_OK;
    }
    if (st) return st;
    kv->raw_len = r->pos - kv->raw_off;
    return STRATA_OK;
}

/* Grows *arr (of *cap elements of `elem` bytes) to hold at least need. */
static bool grow(void **arr, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return true;
    int64_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *p = st_realloc(*arr, (size_t)nc * elem);
    if (!p) return false;
    memset((char *)p + (size_t)*cap * elem, 0, (size_t)(nc - *cap) * elem);
    *arr = p;
    *cap = nc;
    return true;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

typedef struct {
    uint64_t off;
    uint64_t end;
    int64_t idx;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Per-tensor data read from the info table before renaming. */
typedef struct {
    char *gname;       /* GGUF name (owned) */
    uint64_t rel_off;
} tinfo;

static strata_status parse_kvs(reader *r, st_gguf_meta *g, uint64_t n_kv) {
    strata_status st;
    int64_t cap = 0;
    for (uint64_t k = 0; k < n_kv; k++) {
        if (!grow((void **)&g->kvs, &cap, g->n_kv + 1, sizeof(gguf_kv)))
            return st_err(STRATA_ERR_NOMEM, "%s: out of memory reading GGUF metadata", r->path);
        gguf_kv *kv = &g->kvs[g->n_kv];
        char what[64];
        snprintf(what, sizeof what, "key #%" PRIu64, k);
        uint64_t klen;
        if ((st = rd_str_dup(r, &kv->key, &klen, what, NULL))) return st;
        g->n_kv++; /* owns kv->key from here on */
        if (strlen(kv->key) != klen)
            return st_err(STRATA_ERR_FORMAT, "%s: GGUF key #%" PRIu64 " ('%s') contains a NUL byte",
                          r->path, k, kv->key);
        if ((st = rd_u32(r, &kv->type, "the value type of key", kv->key))) return st;
        if ((st = rd_value(r, kv))) return st;
    }
    if (g->n_kv < 2) return STRATA_OK;
    /* Duplicate keys, by sorting (a file may hold many keys). */
    const char **keys = st_malloc((size_t)g->n_kv * sizeof(char *));
    if (!keys) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", r->path);
    for (int64_t k = 0; k < g->n_kv; k++) keys[k] = g->kvs[k].key;
    qsort(keys, (size_t)g->n_kv, sizeof(char *), cmp_cstr);
    st = STRATA_OK;
    for (int64_t k = 1; k < g->n_kv && !st; k++)
        if (strcmp(keys[k], keys[k - 1]) == 0)
            st = st_err(STRATA_ERR_FORMAT, "%s: duplicate GGUF key '%s'", r->path, keys[k]);
    st_free(keys);
    return st;
}

static strata_status parse_tensor_infos(reader *r, st_model_files *m, uint64_t n_tensors,
                                        tinfo **out_infos) {
    strata_status st;
    int64_t cap = 0, icap = 0;
    tinfo *infos = NULL;
    *out_infos = NULL;
    for (uint64_t k = 0; k < n_tensors; k++) {
        if (!grow((void **)&m->tensors, &cap, m->n_tensors + 1, sizeof(st_tensor_desc)) ||
            !grow((void **)&infos, &icap, m->n_tensors + 1, sizeof(tinfo))) {
            *out_infos = infos;
            return st_err(STRATA_ERR_NOMEM, "%s: out of memory reading tensor infos", r->path);
        }
        *out_infos = infos;
        tinfo *ti = &infos[m->n_tensors];
        st_tensor_desc *t = &m->tensors[m->n_tensors];
        char what[64];
        snprintf(what, sizeof what, "the name of tensor #%" PRIu64, k);
        uint64_t nlen;
        if ((st = rd_str_dup(r, &ti->gname, &nlen, what, NULL))) return st;
        m->n_tensors++; /* owns ti->gname (t->name still NULL) */
        const char *nm = ti->gname;
        if (strlen(nm) != nlen)
            return st_err(STRATA_ERR_FORMAT, "%s: tensor #%" PRIu64 " name ('%s') contains a NUL byte",
                          r->path, k, nm);
        uint32_t nd;
        if ((st = rd_u32(r, &nd, "n_dims of tensor", nm))) return st;
        if (nd < 1 || nd > ST_MAX_DIMS)
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s' has %" PRIu32
                          " dimensions (1 to %d allowed)", r->path, nm, nd, ST_MAX_DIMS);
        uint64_t ne[ST_MAX_DIMS];
        uint64_t n_elems = 1;
        for (uint32_t d = 0; d < nd; d++) {
            if ((st = rd_u64(r, &ne[d], "the shape of tensor", nm))) return st;
            if (ne[d] > (uint64_t)INT64_MAX || st_mul_ovf_u64(n_elems, ne[d], &n_elems) ||
                n_elems > (uint64_t)INT64_MAX)
                return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': element count overflows "
                              "(ne[%" PRIu32 "] = %" PRIu64 ")", r->path, nm, d, ne[d]);
        }
        uint32_t gt;
        if ((st = rd_u32(r, &gt, "the type of tensor", nm))) return st;
        if ((st = rd_u64(r, &ti->rel_off, "the data offset of tensor", nm))) return st;
        if (!st_gguf_dtype_from_ggml(gt, &t->dtype))
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: tensor '%s' has ggml type %" PRIu32
                          " (%s), which strata does not support", r->path, nm, gt,
                          ggml_type_name(gt));
        const st_dtype_info *di = st_dtype_get(t->dtype);
        if (ne[0] % (uint64_t)di->block_elems)
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': row length %" PRIu64
                          " is not a multiple of the %s block size %" PRId64,
                          r->path, nm, ne[0], di->name, di->block_elems);
        uint64_t nbytes;
        bool ovf = st_mul_ovf_u64(ne[0] / (uint64_t)di->block_elems, di->block_bytes, &nbytes);
        for (uint32_t d = 1; d < nd && !ovf; d++) ovf = st_mul_ovf_u64(nbytes, ne[d], &nbytes);
        if (ovf)
                return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': byte size overflows",
                              r->path, nm);
        t->n_dims = (int)nd;
        for (uint32_t d = 0; d < nd; d++) t->shape[d] = (int64_t)ne[nd - 1 - d];
        t->nbytes = nbytes;
        t->file = 0;
    }
    return STRATA_OK;
}

/* Places tensors in the data section and checks alignment, bounds, overlap,
 * duplicate names (after renaming). */
static strata_status place_tensors(const st_gguf_meta *g, st_model_files *m, tinfo *infos) {
    const char *path = g->path;
    for (int64_t k = 0; k < m->n_tensors; k++) {
        st_tensor_desc *t = &m->tensors[k];
        const char *nm = infos[k].gname;
        uint64_t rel = infos[k].rel_off, abs, end;
        if (rel % g->alignment)
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': data offset %" PRIu64
                          " is not a multiple of the alignment %" PRIu32, path, nm, rel,
                          g->alignment);
        if (st_add_ovf_u64(g->data_offset, rel, &abs) || st_add_ovf_u64(abs, t->nbytes, &end) ||
            end > g->size)
            return st_err(STRATA_ERR_IO, "%s: truncated GGUF file: tensor '%s' data (%" PRIu64
                          " bytes at data offset %" PRIu64 ") extends past the end of the file "
                          "(%" PRIu64 " bytes, data section at %" PRIu64 ")",
                          path, nm, t->nbytes, rel, g->size, g->data_offset);
        t->offset = abs;
    }
    if (m->n_tensors == 0) return STRATA_OK;
    span *sp = st_malloc((size_t)m->n_tensors * sizeof(span));
    if (!sp) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    for (int64_t k = 0; k < m->n_tensors; k++)
        sp[k] = (span){m->tensors[k].offset, m->tensors[k].offset + m->tensors[k].nbytes, k};
    qsort(sp, (size_t)m->n_tensors, sizeof(span), cmp_span);
    for (int64_t k = 1; k < m->n_tensors; k++) {
        if (sp[k].off < sp[k - 1].end && sp[k].off != sp[k].end) {
            strata_status st = st_err(
                STRATA_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap (bytes [%" PRIu64
                ", %" PRIu64 ") and [%" PRIu64 ", %" PRIu64 ") of the file)",
                path, infos[sp[k - 1].idx].gname, infos[sp[k].idx].gname, sp[k - 1].off,
                sp[k - 1].end, sp[k].off, sp[k].end);
            st_free(sp);
            return st;
        }
        if (sp[k].end < sp[k - 1].end) sp[k] = (span){sp[k - 1].off, sp[k - 1].end, sp[k - 1].idx};
    }
    st_free(sp);

    for (int64_t k = 0; k < m->n_tensors; k++) {
        m->tensors[k].name = st_gguf_name_to_hf(infos[k].gname);
        if (!m->tensors[k].name) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    }
    const char **names = st_malloc((size_t)m->n_tensors * sizeof(char *));
    if (!names) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    for (int64_t k = 0; k < m->n_tensors; k++) names[k] = m->tensors[k].name;
    qsort(names, (size_t)m->n_tensors, sizeof(char *), cmp_cstr);
    for (int64_t k = 1; k < m->n_tensors; k++) {
        if (strcmp(names[k], names[k - 1]) == 0) {
            const char *dup = names[k];
            /* Name it by its GGUF name(s) as they appear in the file. */
            const char *g1 = NULL, *g2 = NULL;
            for (int64_t j = 0; j < m->n_tensors; j++) {
                if (strcmp(m->tensors[j].name, dup) != 0) continue;
                if (!g1) g1 = infos[j].gname;
                else if (!g2) g2 = infos[j].gname;
            }
            strata_status st = st_err(STRATA_ERR_FORMAT,
                                      "%s: duplicate tensor name '%s' (GGUF names '%s' and '%s')",
                                      path, dup, g1, g2);
            st_free(names);
            return st;
        }
    }
    st_free(names);
    return STRATA_OK;
}

/* Optional integer key: *present false when absent; error on a bad type. */
static strata_status opt_u64(const st_gguf_meta *g, const char *key, uint64_t *v, bool *present) {
    *present = st_gguf_find_key(g, key) >= 0;
    return *present ? st_gguf_get_u64(g, key, v) : STRATA_OK;
}

/* A required positive count that fits int64 (and int32: config sizes). */
static strata_status req_count(const st_gguf_meta *g, const char *key, int64_t *out) {
    uint64_t v;
    strata_status st = st_gguf_get_u64(g, key, &v);
    if (st) return st;
    if (v == 0 || v > INT32_MAX)
        return st_err(STRATA_ERR_FORMAT, "%s: GGUF key '%s' = %" PRIu64 " is out of range",
                      g->path, key, v);
    *out = (int64_t)v;
    return STRATA_OK;
}

static strata_status opt_token(const st_gguf_meta *g, const char *key, int32_t *out, bool *present) {
    *present = st_gguf_find_key(g, key) >= 0;
    if (!*present) return STRATA_OK;
    return st_gguf_get_i32(g, key, out);
}

static void add_eos(st_config *c, int32_t id, const char *key, st_config_keys *keys) {
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == id) return;
    if (c->n_eos < ST_MAX_EOS) {
        keys->eos_keys[c->n_eos] = key;
        c->eos_token_ids[c->n_eos++] = id;
    }
}

static strata_status build_config(const st_gguf_meta *g, st_model_files *m) {
    strata_status st;
    const char *path = g->path;
    st_config *c = &m->config;
    memset(c, 0, sizeof *c);

    const char *arch;
    if ((st = st_gguf_get_str(g, "general.architecture", &arch, NULL))) return st;
    if (strcmp(arch, "llama") != 0)
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: GGUF architecture '%s' is not supported (only 'llama')", path, arch);

    if ((st = req_count(g, "llama.context_length", &c->max_position_embeddings))) return st;
    if ((st = req_count(g, "llama.embedding_length", &c->hidden_size))) return st;
    if ((st = req_count(g, "llama.block_count", &c->n_layers))) return st;
    if ((st = req_count(g, "llama.feed_forward_length", &c->intermediate_size))) return st;
    if ((st = req_count(g, "llama.attention.head_count", &c->n_heads))) return st;
    c->n_kv_heads = c->n_heads;
    if (st_gguf_find_key(g, "llama.attention.head_count_kv") >= 0 &&
        (st = req_count(g, "llama.attention.head_count_kv", &c->n_kv_heads)))
        return st;
    if (st_gguf_find_key(g, "llama.attention.key_length") >= 0) {
        if ((st = req_count(g, "llama.attention.key_length", &c->head_dim))) return st;
    } else {
        if (c->hidden_size % c->n_heads)
            return st_err(STRATA_ERR_FORMAT, "%s: llama.embedding_length %" PRId64
                          " is not a multiple of llama.attention.head_count %" PRId64
                          " (and llama.attention.key_length is absent)",
                          path, c->hidden_size, c->n_heads);
        c->head_dim = c->hidden_size / c->n_heads;
    }
    if (st_gguf_find_key(g, "llama.attention.value_length") >= 0) {
        int64_t vl;
        if ((st = req_count(g, "llama.attention.value_length", &vl))) return st;
        if (vl != c->head_dim)
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: llama.attention.value_length %" PRId64
                          " differs from the key length %" PRId64, path, vl, c->head_dim);
    }
    if ((st = st_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &c->rms_norm_eps)))
        return st;
    int64_t rope_dim = -1;
    if (st_gguf_find_key(g, "llama.rope.dimension_count") >= 0 &&
        (st = st_gguf_get_i64(g, "llama.rope.dimension_count", &rope_dim)))
        return st;
    if (rope_dim < -1) rope_dim = INT64_MAX; /* negative: refused by st_config_check */
    c->rope_theta = 10000.0;
    if (st_gguf_find_key(g, "llama.rope.freq_base") >= 0 &&
        (st = st_gguf_get_f64(g, "llama.rope.freq_base", &c->rope_theta)))
        return st;

    c->rope_scaling = ST_ROPE_SCALING_NONE;
    if (st_gguf_find_key(g, "llama.rope.scaling.type") >= 0) {
        const char *type;
        if ((st = st_gguf_get_str(g, "llama.rope.scaling.type", &type, NULL))) return st;
        if (strcmp(type, "linear") == 0) {
            double f;
            if ((st = st_gguf_get_f64(g, "llama.rope.scaling.factor", &f))) return st;
            if (!(f > 0) || !isfinite(f))
                return st_err(STRATA_ERR_FORMAT, "%s: llama.rope.scaling.factor = %g is not positive",
                              path, f);
            if (f != 1.0) {
                c->rope_scaling = ST_ROPE_SCALING_LINEAR;
                c->rope_factor = f;
            }
        } else if (strcmp(type, "none") != 0) {
            return st_err(STRATA_ERR_UNSUPPORTED,
                          "%s: llama.rope.scaling.type '%s' is not supported (none, linear)",
                          path, type);
        }
    } else if (st_gguf_find_key(g, "llama.rope.scale_linear") >= 0) { /* older files */
        double f;
        if ((st = st_gguf_get_f64(g, "llama.rope.scale_linear", &f))) return st;
        if (!(f > 0) || !isfinite(f))
            return st_err(STRATA_ERR_FORMAT, "%s: llama.rope.scale_linear = %g is not positive",
                          path, f);
        if (f != 1.0) {
            c->rope_scaling = ST_ROPE_SCALING_LINEAR;
            c->rope_factor = f;
        }
    }
    /* Llama-3 scaling arrives as the rope_freqs.weight tensor (kept as is). */

    uint64_t v;
    bool present;
    if ((st = opt_u64(g, "llama.vocab_size", &v, &present))) return st;
    if (present) {
        if (v == 0 || v > INT32_MAX)
            return st_err(STRATA_ERR_FORMAT, "%s: llama.vocab_size = %" PRIu64 " is out of range",
                          path, v);
        c->vocab_size = (int64_t)v;
    } else if (st_gguf_find_key(g, "tokenizer.ggml.tokens") >= 0) {
        uint64_t n;
        if ((st = st_gguf_get_arr(g, "tokenizer.ggml.tokens", NULL, NULL, &n))) return st;
        if (n == 0 || n > INT32_MAX)
            return st_err(STRATA_ERR_FORMAT, "%s: tokenizer.ggml.tokens has %" PRIu64 " entries",
                          path, n);
        c->vocab_size = (int64_t)n;
    } else {
        const st_tensor_desc *e = st_model_find(m, "model.embed_tokens.weight");
        if (!e)
            return st_err(STRATA_ERR_NOT_FOUND, "%s: cannot tell the vocabulary size: no "
                          "llama.vocab_size, no tokenizer.ggml.tokens, no token_embd.weight", path);
        c->vocab_size = e->shape[0];
    }

    /* the vocabulary size's key: what it was taken from */
    st_config_keys keys = st_config_keys_gguf;
    if (!present)
        keys.vocab_size = st_gguf_find_key(g, "tokenizer.ggml.tokens") >= 0
                              ? "tokenizer.ggml.tokens (its length)"
                              : "token_embd.weight (its rows)";
    if (st_gguf_find_key(g, "llama.attention.key_length") < 0)
        keys.head_dim = "llama.embedding_length / llama.attention.head_count";

    int32_t id;
    c->bos_token_id = -1;
    if ((st = opt_token(g, "tokenizer.ggml.bos_token_id", &id, &present))) return st;
    if (present) c->bos_token_id = id; /* -1: none (llama.cpp's null token); other negatives refused */
    static const char *const eos_keys[] = {"tokenizer.ggml.eos_token_id",
                                           "tokenizer.ggml.eot_token_id",
                                           "tokenizer.ggml.eom_token_id"};
    for (size_t k = 0; k < sizeof eos_keys / sizeof eos_keys[0]; k++) {
        if ((st = opt_token(g, eos_keys[k], &id, &present))) return st;
        if (present && id != -1) add_eos(c, id, eos_keys[k], &keys); /* -1: none */
    }

    c->tie_word_embeddings = st_model_find(m, "lm_head.weight") == NULL;
    c->rope_interleaved = true;
    /* the same rules as config.json's */
    return st_config_check(c, path, &keys, rope_dim);
}

static strata_status parse_file(st_model_files *m, st_gguf_meta *g) {
    strata_status st;
    const st_mapped_file *f = &m->files[0];
    reader r = {.path = g->path, .p = f->data, .size = f->size, .pos = 0};
    g->base = f->data;
    g->size = f->size;

    if (r.size < 4 || memcmp(r.p, "GGUF", 4) != 0)
        return st_err(STRATA_ERR_FORMAT, "%s: not a GGUF file (bad magic, expected \"GGUF\")",
                      g->path);
    r.pos = 4;
    if ((st = rd_u32(&r, &g->version, "the version", NULL))) return st;
    if (g->version != 3 && g->version != 2) {
        if (g->version == 0x03000000u || g->version == 0x02000000u)
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: big-endian GGUF files are not supported",
                          g->path);
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: GGUF version %" PRIu32 " is not supported (2 and 3 are)", g->path,
                      g->version);
    }
    uint64_t n_tensors, n_kv;
    if ((st = rd_u64(&r, &n_tensors, "the tensor count", NULL))) return st;
    if ((st = rd_u64(&r, &n_kv, "the key/value count", NULL))) return st;
    /* Each KV takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor
     * info at least 8 (name length) + 4 + 8 + 4 + 8 bytes. */
    uint64_t min_kv, min_ti, min_total;
    if (st_mul_ovf_u64(n_kv, 13, &min_kv) || st_mul_ovf_u64(n_tensors, 32, &min_ti) ||
        st_add_ovf_u64(min_kv, min_ti, &min_total) || min_total > r.size - r.pos)
        return st_err(STRATA_ERR_IO,
                      "%s: truncated or corrupt GGUF file: %" PRIu64 " tensors and %" PRIu64
                      " keys cannot fit in the %" PRIu64 " bytes that follow the header",
                      g->path, n_tensors, n_kv, r.size - r.pos);

    if ((st = parse_kvs(&r, g, n_kv))) return st;

    g->alignment = ST_GGUF_DEFAULT_ALIGNMENT;
    if (st_gguf_find_key(g, "general.alignment") >= 0) {
        int64_t ki = st_gguf_find_key(g, "general.alignment");
        if (g->kvs[ki].type != ST_GGUF_TYPE_UINT32)
            return bad_type(g, &g->kvs[ki], "uint32");
        uint32_t a = (uint32_t)g->kvs[ki].u;
        if (a == 0 || (a & (a - 1)))
            return st_err(STRATA_ERR_FORMAT, "%s: general.alignment = %" PRIu32
                          " is not a power of two", g->path, a);
        g->alignment = a;
    }

    tinfo *infos = NULL;
    st = parse_tensor_infos(&r, m, n_tensors, &infos);
    if (st == STRATA_OK) {
        uint64_t a = g->alignment;
        g->data_offset = r.pos + (a - r.pos % a) % a; /* r.pos <= size < 2^63 */
        st = place_tensors(g, m, infos);
    }
    for (int64_t k = 0; k < m->n_tensors; k++) st_free(infos[k].gname);
    st_free(infos);
    if (st) return st;
    return build_config(g, m);
}

/* The two openers: a file to map (path), or a borrowed image (mem, size). */
static strata_status gguf_open(const char *path, const void *mem, size_t size, st_model_files **out) {
    st_model_files *m = st_calloc(1, sizeof *m);
    st_gguf_meta *g = st_calloc(1, sizeof *g);
    strata_status st = STRATA_OK;
    if (!m || !g || !(g->path = st_strdup(path)) || !(m->path = st_strdup(path)) ||
        !(m->files = st_calloc(1, sizeof(st_mapped_file)))) {
        st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
        goto fail;
    }
    m->format = ST_FORMAT_GGUF;
    m->gguf = g;
    g = NULL;
    m->files[0].fd = -1;
    if (mem) {
        m->files[0] = (st_mapped_file){.path = st_strdup(path), .fd = -1, .size = size, .data = mem,
                                       .borrowed = true};
        if (!m->files[0].path) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
            goto fail;
        }
    } else if ((st = st_file_map(path, &m->files[0]))) {
        goto fail;
    }
    m->n_files = 1;
    if ((st = parse_file(m, m->gguf))) goto fail;
    if ((st = st_model_validate(m))) goto fail;
    *out = m;
    return STRATA_OK;

fail:
    st_gguf_meta_free(g);
    if (m) st_model_close(m);
    return st;
}

strata_status st_gguf_open(const char *path, st_model_files **out) {
    *out = NULL;
    if (!path) return st_err(STRATA_ERR_INVALID_ARG, "st_gguf_open: path is NULL");
    return gguf_open(path, NULL, 0, out);
}

strata_status st_gguf_open_mem(const void *data, size_t size, const char *name, st_model_files **out) {
    *out = NULL;
    if (!name) return st_err(STRATA_ERR_INVALID_ARG, "st_gguf_open_mem: name is NULL");
    if (!data && size) return st_err(STRATA_ERR_INVALID_ARG, "%s: st_gguf_open_mem: data is NULL", name);
    static const uint8_t empty[1];
    return gguf_open(name, data ? data : empty, size, out); /* an empty image is refused by its size */
}

/* Hugging Face model directories: config.json + safetensors weights.
 *
 * Safetensors byte layout (all integers little-endian):
 *
 *   offset 0      u64 N            length of the JSON header in bytes
 *   offset 8      N bytes          JSON header, UTF-8, may end with spaces:
 *                   { "<tensor name>": { "dtype": "BF16",
 *                                        "shape": [d0, d1, ...],        outermost first
 *                                        "data_offsets": [begin, end] },
 *                     ...,
 *                     "__metadata__": { "<key>": "<string>", ... } }     optional
 *   offset 8+N    data section     tensor bytes, row-major, no padding inside a tensor
 *
 * data_offsets are relative to the start of the data section (8+N), half-open
 * [begin, end), and end - begin == product(shape) * sizeof(dtype). Tensors do
 * not overlap. dtypes in the format: BOOL U8 I8 I16 U16 I32 U32 I64 U64 F8_E5M2
 * F8_E4M3 F16 BF16 F32 F64; strata takes F32, F16 and BF16.
 *
 * A sharded checkpoint has model.safetensors.index.json:
 *   { "metadata": { "total_size": ... }, "weight_map": { "<tensor>": "<shard file>" } }
 * with shard file names relative to the directory. Each distinct shard is mapped
 * once; every tensor the index lists must be found in the shard it names.
 *
 * Files are mapped read-only (st_file_map); descriptors point into the mappings.
 * Every size computed from file content is overflow-checked and bounds-checked
 * against the file before use.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/json.h"
#include "loader/loader.h"

/* The format's reference implementation refuses headers above 100 MB. */
#define SAFETENSORS_MAX_HEADER ((uint64_t)100 * 1000 * 1000)

typedef struct {
    st_model_files *m;
    int64_t cap; /* capacity of m->tensors */
} st_builder;

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    bool slash = a > 0 && dir[a - 1] == '/';
    char *p = st_malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (!slash) p[k++] = '/';
    memcpy(p + k, name, b);
    p[k + b] = '\0';
    return p;
}

static bool path_is_regular(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static uint64_t read_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static bool st_dtype_from_safetensors(const char *s, st_dtype *out) {
    if (strcmp(s, "F32") == 0) { *out = ST_DTYPE_F32; return true; }
    if (strcmp(s, "F16") == 0) { *out = ST_DTYPE_F16; return true; }
    if (strcmp(s, "BF16") == 0) { *out = ST_DTYPE_BF16; return true; }
    return false;
}

static strata_status builder_push(st_builder *b, const st_tensor_desc *t) {
    st_model_files *m = b->m;
    if (m->n_tensors == b->cap) {
        int64_t nc = b->cap ? b->cap * 2 : 64;
        st_tensor_desc *nt = st_realloc(m->tensors, (size_t)nc * sizeof *nt);
        if (!nt) return st_err(STRATA_ERR_NOMEM, "%s: out of memory for the tensor table", m->path);
        m->tensors = nt;
        b->cap = nc;
    }
    m->tensors[m->n_tensors++] = *t;
    return STRATA_OK;
}

/* Adds a mapped file to m->files; on success *idx is its index. */
static strata_status model_add_file(st_model_files *m, const char *path, int *idx) {
    st_mapped_file *nf = st_realloc(m->files, (size_t)(m->n_files + 1) * sizeof *nf);
    if (!nf) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    m->files = nf;
    strata_status st = st_file_map(path, &m->files[m->n_files]);
    if (st) return st;
    *idx = m->n_files++;
    return STRATA_OK;
}

/* ---- one tensor entry of a header ---- */

static strata_status parse_entry(const char *fpath, const cJSON *e, uint64_t data_size,
                                 st_tensor_desc *t, uint64_t *begin_out, uint64_t *end_out) {
    const char *name = e->string;
    if (!name || !name[0])
        return st_err(STRATA_ERR_FORMAT, "%s: header has a tensor with an empty name", fpath);
    if (!cJSON_IsObject(e))
        return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': entry must be an object, got %s", fpath,
                      name, st_json_type_name(e));
    st_json_where w = {fpath, name};
    const char *dtype_s = NULL;
    strata_status st = st_json_get_string(&w, e, "dtype", &dtype_s);
    if (st) return st;
    if (!st_dtype_from_safetensors(dtype_s, &t->dtype))
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: tensor '%s' has dtype %s, which strata does not load (F32, F16, BF16)",
                      fpath, name, dtype_s);
    size_t esize = st_dtype_get(t->dtype)->block_bytes;

    const cJSON *shape = st_json_field(e, "shape");
    if (!shape)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: tensor '%s' has no 'shape'", fpath, name);
    if (!cJSON_IsArray(shape))
        return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': 'shape' must be an array, got %s", fpath,
                      name, st_json_type_name(shape));
    int nd = cJSON_GetArraySize(shape);
    if (nd > ST_MAX_DIMS)
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: tensor '%s' has %d dimensions (at most %d)",
                      fpath, name, nd, ST_MAX_DIMS);
    t->n_dims = nd;
    uint64_t numel = 1;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape) {
        char dn[64];
        snprintf(dn, sizeof dn, "shape[%d]", i);
        int64_t v;
        if (!cJSON_IsNumber(d))
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': shape[%d] must be an integer, got %s",
                          fpath, name, i, st_json_type_name(d));
        if ((st = st_json_as_int64(fpath, dn, d, &v)))
            return st_err(st, "%s: tensor '%s': shape[%d] is not an integer", fpath, name, i);
        if (v < 0)
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': shape[%d] = %lld is negative", fpath,
                          name, i, (long long)v);
        t->shape[i] = v;
        if (st_mul_ovf_u64(numel, (uint64_t)v, &numel))
            return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': element count overflows", fpath, name);
        i++;
    }
    uint64_t need;
    if (st_mul_ovf_u64(numel, esize, &need))
        return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': byte count overflows", fpath, name);

    const cJSON *off = st_json_field(e, "data_offsets");
    if (!off)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: tensor '%s' has no 'data_offsets'", fpath, name);
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: tensor '%s': 'data_offsets' must be an array [begin, end]", fpath, name);
    int64_t be[2];
    for (int k = 0; k < 2; k++) {
        const cJSON *x = cJSON_GetArrayItem(off, k);
        if (!cJSON_IsNumber(x) || st_json_as_int64(fpath, "data_offsets", x, &be[k]) || be[k] < 0)
            return st_err(STRATA_ERR_FORMAT,
                          "%s: tensor '%s': data_offsets[%d] must be a non-negative integer", fpath,
                          name, k);
    }
    uint64_t begin = (uint64_t)be[0], end = (uint64_t)be[1];
    if (begin > end)
        return st_err(STRATA_ERR_FORMAT, "%s: tensor '%s': data_offsets begin %llu > end %llu",
                      fpath, name, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_size)
        return st_err(STRATA_ERR_IO,
                      "%s: tensor '%s': data_offsets [%llu, %llu] run past the end of the file "
                      "(data section is %llu bytes; truncated?)",
                      fpath, name, (unsigned long long)begin, (unsigned long long)end,
                      (unsigned long long)data_size);
    if (end - begin != need) {
        char sh[128];
        int p = snprintf(sh, sizeof sh, "[");
        for (int k = 0; k < nd && p > 0 && (size_t)p < sizeof sh; k++)
            p += snprintf(sh + p, sizeof sh - (size_t)p, "%s%lld", k ? ", " : "", (long long)t->shape[k]);
        if (p > 0 && (size_t)p < sizeof sh) snprintf(sh + p, sizeof sh - (size_t)p, "]");
        return st_err(STRATA_ERR_FORMAT,
                      "%s: tensor '%s': data_offsets hold %llu bytes but shape %s of %s needs %llu",
                      fpath, name, (unsigned long long)(end - begin), sh, dtype_s,
                      (unsigned long long)need);
    }
    t->nbytes = need;
    *begin_out = begin;
    *end_out = end;
    return STRATA_OK;
}

typedef struct {
    uint64_t begin, end;
    int64_t tensor; /* index into m->tensors */
} st_span;

static int span_cmp(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Parses the header of mapped file `fi` and appends its tensors to the table. */
static strata_status parse_file(st_builder *b, int fi) {
    st_model_files *m = b->m;
    const st_mapped_file *f = &m->files[fi];
    const char *fpath = f->path;
    if (f->size < 8)
        return st_err(STRATA_ERR_IO,
                      "%s: file is %llu bytes, too short for the 8-byte safetensors header length",
                      fpath, (unsigned long long)f->size);
    uint64_t n = read_le64(f->data);
    if (n > SAFETENSORS_MAX_HEADER)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: header length %llu is absurd (limit %llu); not a safetensors file?",
                      fpath, (unsigned long long)n, (unsigned long long)SAFETENSORS_MAX_HEADER);
    if (n > f->size - 8)
        return st_err(STRATA_ERR_IO,
                      "%s: header length %llu runs past the end of the file (%llu bytes; truncated?)",
                      fpath, (unsigned long long)n, (unsigned long long)f->size);
    uint64_t data_start = 8 + n;
    uint64_t data_size = f->size - data_start;

    char hpath[1100];
    snprintf(hpath, sizeof hpath, "%s (header)", fpath);
    cJSON *root = NULL;
    strata_status st = st_json_parse((const char *)f->data + 8, (size_t)n, hpath, &root);
    if (st) return st;
    if (!cJSON_IsObject(root)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: header must be a JSON object, got %s", fpath,
                    st_json_type_name(root));
        cJSON_Delete(root);
        return st;
    }

    int64_t first = m->n_tensors;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        if (e->string && strcmp(e->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(e)) {
                st = st_err(STRATA_ERR_FORMAT, "%s: '__metadata__' must be an object, got %s",
                            fpath, st_json_type_name(e));
                goto done;
            }
            continue;
        }
        st_tensor_desc t;
        memset(&t, 0, sizeof t);
        uint64_t begin = 0, end = 0;
        if ((st = parse_entry(fpath, e, data_size, &t, &begin, &end))) goto done;
        t.file = fi;
        t.offset = data_start + begin;
        t.name = st_strdup(e->string);
        if (!t.name) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", fpath);
            goto done;
        }
        if ((st = builder_push(b, &t))) {
            st_free(t.name);
            goto done;
        }
    }

    /* Overlap check within this file: sort the spans, compare neighbours. */
    int64_t cnt = m->n_tensors - first;
    if (cnt > 1) {
        st_span *sp = st_malloc((size_t)cnt * sizeof *sp);
        if (!sp) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", fpath);
            goto done;
        }
        for (int64_t i = 0; i < cnt; i++) {
            const st_tensor_desc *t = &m->tensors[first + i];
            sp[i].begin = t->offset - data_start;
            sp[i].end = sp[i].begin + t->nbytes;
            sp[i].tensor = first + i;
        }
        qsort(sp, (size_t)cnt, sizeof *sp, span_cmp);
        int64_t prev = -1; /* last non-empty span */
        for (int64_t i = 0; i < cnt; i++) {
            if (sp[i].begin == sp[i].end) continue;
            if (prev >= 0 && sp[i].begin < sp[prev].end) {
                st = st_err(STRATA_ERR_FORMAT,
                            "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", fpath,
                            m->tensors[sp[prev].tensor].name, (unsigned long long)sp[prev].begin,
                            (unsigned long long)sp[prev].end, m->tensors[sp[i].tensor].name,
                            (unsigned long long)sp[i].begin, (unsigned long long)sp[i].end);
                break;
            }
            prev = i;
        }
        st_free(sp);
    }
done:
    cJSON_Delete(root);
    return st;
}

static int name_cmp(const void *a, const void *b) {
    const st_tensor_desc *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Sorted array of pointers into m->tensors (caller frees); FORMAT on a
 * duplicate name. */
static strata_status sorted_names(const st_model_files *m, const st_tensor_desc ***out) {
    *out = NULL;
    const st_tensor_desc **v = st_malloc((size_t)(m->n_tensors ? m->n_tensors : 1) * sizeof *v);
    if (!v) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", m->path);
    for (int64_t i = 0; i < m->n_tensors; i++) v[i] = &m->tensors[i];
    qsort(v, (size_t)m->n_tensors, sizeof *v, name_cmp);
    for (int64_t i = 1; i < m->n_tensors; i++) {
        if (strcmp(v[i - 1]->name, v[i]->name) == 0) {
            const char *f1 = m->files[v[i - 1]->file].path, *f2 = m->files[v[i]->file].path;
            strata_status st = (f1 == f2 || strcmp(f1, f2) == 0)
                ? st_err(STRATA_ERR_FORMAT, "%s: tensor '%s' appears twice", f1, v[i]->name)
                : st_err(STRATA_ERR_FORMAT, "%s: tensor '%s' appears in both %s and %s", m->path,
                         v[i]->name, f1, f2);
            st_free(v);
            return st;
        }
    }
    *out = v;
    return STRATA_OK;
}

static const st_tensor_desc *sorted_find(const st_tensor_desc **v, int64_t n, const char *name) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = strcmp(v[mid]->name, name);
        if (c == 0) return v[mid];
        if (c < 0) lo = mid + 1; else hi = mid;
    }
    return NULL;
}

static bool shard_name_ok(const char *s) {
    if (!s[0] || s[0] == '/') return false;
    /* no ".." path component: shards live inside the directory */
    for (const char *p = s; (p = strstr(p, "..")) != NULL; p += 2) {
        bool start = (p == s) || p[-1] == '/';
        bool stop = p[2] == '\0' || p[2] == '/';
        if (start && stop) return false;
    }
    return true;
}

static strata_status open_sharded(st_builder *b, const char *dir, const char *ipath) {
    st_model_files *m = b->m;
    char *text = NULL;
    size_t len = 0;
    strata_status st = st_file_read_all(ipath, &text, &len);
    if (st) return st;
    cJSON *root = NULL;
    st = st_json_parse(text, len, ipath, &root);
    st_free(text);
    if (st) return st;

    const cJSON *wm = st_json_field(root, "weight_map");
    const char **shards = NULL; /* distinct shard names, borrowed from root */
    int *shard_file = NULL;     /* shard -> index in m->files */
    int n_shards = 0;
    const st_tensor_desc **sorted = NULL;
    if (!cJSON_IsObject(root)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: top level must be a JSON object", ipath);
        goto done;
    }
    if (!wm) {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: missing required key 'weight_map'", ipath);
        goto done;
    }
    if (!cJSON_IsObject(wm)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'weight_map' must be an object, got %s", ipath,
                    st_json_type_name(wm));
        goto done;
    }
    int n_entries = cJSON_GetArraySize(wm);
    if (n_entries == 0) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'weight_map' is empty", ipath);
        goto done;
    }
    shards = st_calloc((size_t)n_entries, sizeof *shards);
    shard_file = st_calloc((size_t)n_entries, sizeof *shard_file);
    if (!shards || !shard_file) {
        st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", ipath);
        goto done;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, wm) {
        if (!cJSON_IsString(e) || !e->valuestring) {
            st = st_err(STRATA_ERR_FORMAT, "%s: weight_map['%s'] must be a file name, got %s",
                        ipath, e->string ? e->string : "", st_json_type_name(e));
            goto done;
        }
        if (!shard_name_ok(e->valuestring)) {
            st = st_err(STRATA_ERR_FORMAT,
                        "%s: weight_map['%s'] = '%s' is not a file inside the directory", ipath,
                        e->string ? e->string : "", e->valuestring);
            goto done;
        }
        int k = 0;
        while (k < n_shards && strcmp(shards[k], e->valuestring) != 0) k++;
        if (k == n_shards) shards[n_shards++] = e->valuestring;
    }

    for (int k = 0; k < n_shards; k++) {
        char *sp = path_join(dir, shards[k]);
        if (!sp) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", ipath);
            goto done;
        }
        struct stat sb;
        if (stat(sp, &sb) != 0 && errno == ENOENT) {
            st = st_err(STRATA_ERR_NOT_FOUND, "%s: shard file %s listed in weight_map is missing",
                        ipath, sp);
            st_free(sp);
            goto done;
        }
        st = model_add_file(m, sp, &shard_file[k]);
        st_free(sp);
        if (st) goto done;
        if ((st = parse_file(b, shard_file[k]))) goto done;
    }

    if ((st = sorted_names(m, &sorted))) goto done;
    cJSON_ArrayForEach(e, wm) {
        int k = 0;
        while (strcmp(shards[k], e->valuestring) != 0) k++;
        const st_tensor_desc *t = sorted_find(sorted, m->n_tensors, e->string);
        if (!t || t->file != shard_file[k]) {
            st = st_err(STRATA_ERR_NOT_FOUND,
                        "%s: tensor '%s' is listed in %s but missing from that shard", ipath,
                        e->string, shards[k]);
            goto done;
        }
    }
done:
    st_free(sorted);
    st_free(shards);
    st_free(shard_file);
    cJSON_Delete(root);
    return st;
}

/* Opens a Hugging Face model directory: dir/config.json plus dir/model.safetensors
 * or dir/model.safetensors.index.json and its shards. The caller owns *out
 * (st_model_close). On error *out is NULL, everything opened so far is released,
 * and st_last_error() names the file and the problem. Runs st_model_validate. */
strata_status st_safetensors_open_dir(const char *dir, st_model_files **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "st_safetensors_open_dir: out is NULL");
    *out = NULL;
    if (!dir) return st_err(STRATA_ERR_INVALID_ARG, "st_safetensors_open_dir: dir is NULL");
    st_model_files *m = st_calloc(1, sizeof *m);
    if (!m) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", dir);
    m->format = ST_FORMAT_SAFETENSORS;
    st_builder b = {m, 0};
    strata_status st = STRATA_OK;
    char *cpath = NULL, *spath = NULL, *ipath = NULL, *text = NULL;
    m->path = st_strdup(dir);
    cpath = path_join(dir, "config.json");
    spath = path_join(dir, "model.safetensors");
    ipath = path_join(dir, "model.safetensors.index.json");
    if (!m->path || !cpath || !spath || !ipath) {
        st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }

    if (!path_is_regular(cpath)) {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: missing (a Hugging Face model directory needs it)",
                    cpath);
        goto done;
    }
    if ((st = st_file_read_all(cpath, &text, NULL))) goto done;
    if ((st = st_config_parse_json(text, cpath, &m->config))) goto done;

    if (path_is_regular(spath)) {
        int fi;
        if ((st = model_add_file(m, spath, &fi))) goto done;
        if ((st = parse_file(&b, fi))) goto done;
        const st_tensor_desc **sorted = NULL;
        if ((st = sorted_names(m, &sorted))) goto done;
        st_free(sorted);
    } else if (path_is_regular(ipath)) {
        if ((st = open_sharded(&b, dir, ipath))) goto done;
    } else {
        st = st_err(STRATA_ERR_NOT_FOUND,
                    "%s: neither model.safetensors nor model.safetensors.index.json found", dir);
        goto done;
    }
    st = st_model_validate(m);
done:
    st_free(text);
    st_free(cpath);
    st_free(spath);
    st_free(ipath);
    if (st) {
        st_model_close(m);
        return st;
    }
    *out = m;
    return STRATA_OK;
}

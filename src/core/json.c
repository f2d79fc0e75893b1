/* Type-checked helpers over cJSON (see json.h). */
#include "core/json.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define JSON_MAX_EXACT_INT 9007199254740992.0 /* 2^53 */

static void json_full_key(const st_json_where *w, const char *key, char *buf, size_t n) {
    if (w && w->prefix && w->prefix[0])
        snprintf(buf, n, "%s.%s", w->prefix, key);
    else
        snprintf(buf, n, "%s", key);
}

static const char *json_where_path(const st_json_where *w) {
    return (w && w->path) ? w->path : "json";
}

static bool json_is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

strata_status st_json_parse(const char *text, size_t len, const char *path, cJSON **out) {
    *out = NULL;
    if (!path) path = "json";
    if (!text) return st_err(STRATA_ERR_INVALID_ARG, "%s: no JSON text", path);
    const char *nul = memchr(text, '\0', len);
    if (nul)
        return st_err(STRATA_ERR_FORMAT, "%s: invalid JSON: NUL byte at offset %zu", path,
                      (size_t)(nul - text));
    /* cJSON wants a NUL-terminated buffer; the source may be a mapping. */
    char *buf = st_malloc(len + 1);
    if (!buf) return st_err(STRATA_ERR_NOMEM, "%s: out of memory for %zu bytes of JSON", path, len);
    memcpy(buf, text, len);
    buf[len] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(buf, &end, 0);
    size_t stop = (end && end >= buf && end <= buf + len) ? (size_t)(end - buf) : len;
    if (root) {
        while (stop < len && json_is_space(buf[stop])) stop++;
        if (stop != len) {
            cJSON_Delete(root);
            root = NULL;
        }
    }
    if (!root) {
        size_t line = 1, col = 1;
        for (size_t i = 0; i < stop; i++) {
            if (buf[i] == '\n') { line++; col = 1; } else { col++; }
        }
        strata_status st = (len == 0)
            ? st_err(STRATA_ERR_FORMAT, "%s: invalid JSON: empty", path)
            : st_err(STRATA_ERR_FORMAT,
                     "%s: invalid JSON near line %zu, column %zu (byte %zu of %zu)", path, line,
                     col, stop, len);
        st_free(buf);
        return st;
    }
    st_free(buf);
    *out = root;
    return STRATA_OK;
}

const cJSON *st_json_field(const cJSON *obj, const char *key) {
    if (!obj || !cJSON_IsObject(obj) || !key) return NULL;
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!it || cJSON_IsNull(it)) return NULL;
    return it;
}

const char *st_json_type_name(const cJSON *item) {
    if (!item) return "nothing";
    if (cJSON_IsNull(item)) return "null";
    if (cJSON_IsBool(item)) return "boolean";
    if (cJSON_IsNumber(item)) return "number";
    if (cJSON_IsString(item)) return "string";
    if (cJSON_IsArray(item)) return "array";
    if (cJSON_IsObject(item)) return "object";
    return "invalid";
}

strata_status st_json_as_int64(const char *path, const char *name, const cJSON *item, int64_t *out) {
    if (!cJSON_IsNumber(item))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be an integer, got %s", path, name,
                      st_json_type_name(item));
    double d = item->valuedouble;
    if (!isfinite(d) || d != trunc(d))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be an integer, got %g", path, name, d);
    if (fabs(d) > JSON_MAX_EXACT_INT)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %g is out of range", path, name, d);
    *out = (int64_t)d;
    return STRATA_OK;
}

strata_status st_json_as_double(const char *path, const char *name, const cJSON *item, double *out) {
    if (!cJSON_IsNumber(item))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be a number, got %s", path, name,
                      st_json_type_name(item));
    if (!isfinite(item->valuedouble))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be a finite number", path, name);
    *out = item->valuedouble;
    return STRATA_OK;
}

static strata_status json_missing(const st_json_where *w, const char *key) {
    char k[256];
    json_full_key(w, key, k, sizeof k);
    return st_err(STRATA_ERR_NOT_FOUND, "%s: missing required key '%s'", json_where_path(w), k);
}

strata_status st_json_get_int64(const st_json_where *w, const cJSON *obj, const char *key, int64_t *out) {
    const cJSON *it = st_json_field(obj, key);
    if (!it) return json_missing(w, key);
    char k[256];
    json_full_key(w, key, k, sizeof k);
    return st_json_as_int64(json_where_path(w), k, it, out);
}

strata_status st_json_get_double(const st_json_where *w, const cJSON *obj, const char *key, double *out) {
    const cJSON *it = st_json_field(obj, key);
    if (!it) return json_missing(w, key);
    char k[256];
    json_full_key(w, key, k, sizeof k);
    return st_json_as_double(json_where_path(w), k, it, out);
}

strata_status st_json_get_string(const st_json_where *w, const cJSON *obj, const char *key, const char **out) {
    const cJSON *it = st_json_field(obj, key);
    if (!it) return json_missing(w, key);
    if (!cJSON_IsString(it) || !it->valuestring) {
        char k[256];
        json_full_key(w, key, k, sizeof k);
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be a string, got %s", json_where_path(w),
                      k, st_json_type_name(it));
    }
    *out = it->valuestring;
    return STRATA_OK;
}

strata_status st_json_opt_int64(const st_json_where *w, const cJSON *obj, const char *key, int64_t def, int64_t *out) {
    if (!st_json_field(obj, key)) {
        *out = def;
        return STRATA_OK;
    }
    return st_json_get_int64(w, obj, key, out);
}

strata_status st_json_opt_double(const st_json_where *w, const cJSON *obj, const char *key, double def, double *out) {
    if (!st_json_field(obj, key)) {
        *out = def;
        return STRATA_OK;
    }
    return st_json_get_double(w, obj, key, out);
}

strata_status st_json_opt_bool(const st_json_where *w, const cJSON *obj, const char *key, bool def, bool *out) {
    const cJSON *it = st_json_field(obj, key);
    if (!it) {
        *out = def;
        return STRATA_OK;
    }
    if (!cJSON_IsBool(it)) {
        char k[256];
        json_full_key(w, key, k, sizeof k);
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be true or false, got %s",
                      json_where_path(w), k, st_json_type_name(it));
    }
    *out = cJSON_IsTrue(it);
    return STRATA_OK;
}

strata_status st_json_opt_string(const st_json_where *w, const cJSON *obj, const char *key, const char *def, const char **out) {
    if (!st_json_field(obj, key)) {
        *out = def;
        return STRATA_OK;
    }
    return st_json_get_string(w, obj, key, out);
}

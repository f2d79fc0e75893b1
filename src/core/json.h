/* Small type-checked helpers over cJSON for the parsers (config.json,
 * safetensors headers, index files, tokenizer.json ...).
 *
 * Every getter names the file and the key in its st_err() message, e.g.
 *   "m/config.json: 'rope_scaling.factor' must be a number, got string".
 * A key whose value is JSON null counts as absent. Numbers are doubles in
 * cJSON, so integers are accepted only when integral and |x| <= 2^53.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cjson/cJSON.h>
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Where an object sits, for messages: "<path>: '<prefix>.<key>' ...". */
typedef struct {
    const char *path;   /* the file (or any label) named in messages */
    const char *prefix; /* dotted name of the object; NULL or "" at top level */
} st_json_where;

/* Parses `len` bytes of `text` (need not be NUL-terminated) as one JSON value;
 * only whitespace may follow it. The caller owns *out (cJSON_Delete). On error
 * *out is NULL and the message names `path` and the line:column / byte offset
 * where parsing stopped. */
strata_status st_json_parse(const char *text, size_t len, const char *path, cJSON **out);

/* The member `key` of obj, or NULL when obj is not an object, the key is
 * absent, or its value is null. Borrowed from obj. */
const cJSON *st_json_field(const cJSON *obj, const char *key);

/* cJSON's type as a word ("string", "number", "object", ...). */
const char *st_json_type_name(const cJSON *item);

/* Converts one item; `name` is its full name in messages (e.g. "shape[1]").
 * STRATA_ERR_FORMAT when the item has the wrong type or range. */
strata_status st_json_as_int64(const char *path, const char *name, const cJSON *item, int64_t *out);
strata_status st_json_as_double(const char *path, const char *name, const cJSON *item, double *out);

/* Required members: STRATA_ERR_NOT_FOUND when absent (or null),
 * STRATA_ERR_FORMAT when of the wrong type. Strings are borrowed from obj. */
strata_status st_json_get_int64(const st_json_where *w, const cJSON *obj, const char *key, int64_t *out);
strata_status st_json_get_double(const st_json_where *w, const cJSON *obj, const char *key, double *out);
strata_status st_json_get_string(const st_json_where *w, const cJSON *obj, const char *key, const char **out);

/* Optional members: *out = def when absent (or null), FORMAT when of the
 * wrong type. */
strata_status st_json_opt_int64(const st_json_where *w, const cJSON *obj, const char *key, int64_t def, int64_t *out);
strata_status st_json_opt_double(const st_json_where *w, const cJSON *obj, const char *key, double def, double *out);
strata_status st_json_opt_bool(const st_json_where *w, const cJSON *obj, const char *key, bool def, bool *out);
strata_status st_json_opt_string(const st_json_where *w, const cJSON *obj, const char *key, const char *def, const char **out);

#ifdef __cplusplus
}
#endif

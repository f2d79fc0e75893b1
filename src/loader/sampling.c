/* A model's recommended sampling settings: generation_config.json next to a
 * HF config.json, or a GGUF file's general.sampling.* keys (gguf-py's
 * Keys.General.SAMPLING_*). See st_sampling_defaults_read in loader.h. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "core/json.h"
#include "loader/gguf.h"
#include "loader/loader.h"

static strata_status range_err(const char *src, const char *key, double v, const char *range) {
    return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %g is out of range %s", src, key, v, range);
}

/* Range rules shared by both sources (key names per source). */
static strata_status check_values(const st_sampling_defaults *d, const char *src, const char *k_temp,
                                  const char *k_top_p, const char *k_top_k, const char *k_min_p,
                                  const char *k_rep) {
    if (d->has_temperature && !(d->temperature >= 0 && d->temperature <= 100))
        return range_err(src, k_temp, d->temperature, "[0, 100]");
    if (d->has_top_p && !(d->top_p > 0 && d->top_p <= 1)) return range_err(src, k_top_p, d->top_p, "(0, 1]");
    if (d->has_top_k && (d->top_k < 0 || d->top_k > INT32_MAX))
        return range_err(src, k_top_k, (double)d->top_k, "[0, 2^31)");
    if (d->has_min_p && !(d->min_p >= 0 && d->min_p <= 1)) return range_err(src, k_min_p, d->min_p, "[0, 1]");
    if (d->has_repetition_penalty && !(d->repetition_penalty > 0 && d->repetition_penalty <= 100))
        return range_err(src, k_rep, d->repetition_penalty, "(0, 100]");
    return STRATA_OK;
}

static strata_status read_hf(const char *dir, st_sampling_defaults *d) {
    char path[1100];
    int n = snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (n < 0 || (size_t)n >= sizeof path) return st_err(STRATA_ERR_INVALID_ARG, "%s: path too long", dir);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        if (errno == ENOENT) return STRATA_OK; /* optional */
        return st_err(STRATA_ERR_IO, "%s: %s", path, strerror(errno));
    }
    char *text = NULL;
    size_t len = 0;
    strata_status st = st_file_read_all(path, &text, &len);
    if (st) return st;
    cJSON *root = NULL;
    st = st_json_parse(text, len, path, &root);
    st_free(text);
    if (st) return st;
    st_json_where w = {path, NULL};
    if (!cJSON_IsObject(root)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: top level must be a JSON object, got %s", path,
                    st_json_type_name(root));
        goto done;
    }
#define OPT_NUM(key, field, flag)                                                              \
    do {                                                                                        \
        const cJSON *it_ = st_json_field(root, key);                                            \
        if (it_ && !cJSON_IsNull(it_)) {                                                        \
            if ((st = st_json_get_double(&w, root, key, &d->field))) goto done;                 \
            d->flag = true;                                                                     \
        }                                                                                       \
    } while (0)
    OPT_NUM("temperature", temperature, has_temperature);
    OPT_NUM("top_p", top_p, has_top_p);
    OPT_NUM("min_p", min_p, has_min_p);
    OPT_NUM("repetition_penalty", repetition_penalty, has_repetition_penalty);
#undef OPT_NUM
    const cJSON *tk = st_json_field(root, "top_k");
    if (tk && !cJSON_IsNull(tk)) {
        if ((st = st_json_get_int64(&w, root, "top_k", &d->top_k))) goto done;
        d->has_top_k = true;
    }
    const cJSON *ds = st_json_field(root, "do_sample");
    if (ds && !cJSON_IsNull(ds)) {
        bool sample;
        if ((st = st_json_opt_bool(&w, root, "do_sample", true, &sample))) goto done;
        if (!sample) { /* transformers: greedy search, whatever the temperature says */
            d->temperature = 0;
            d->has_temperature = true;
        }
    }
    if ((st = check_values(d, path, "temperature", "top_p", "top_k", "min_p", "repetition_penalty")))
        goto done;
    if (d->has_temperature || d->has_top_p || d->has_top_k || d->has_min_p || d->has_repetition_penalty)
        snprintf(d->source, sizeof d->source, "%s", path);
done:
    cJSON_Delete(root);
    return st;
}

static strata_status gguf_opt_f64(const st_gguf_meta *g, const char *key, double *v, bool *has) {
    if (st_gguf_find_key(g, key) < 0) return STRATA_OK;
    strata_status st = st_gguf_get_f64(g, key, v);
    if (st) return st;
    *has = true;
    return STRATA_OK;
}

static strata_status read_gguf(const st_model_files *m, st_sampling_defaults *d) {
    const st_gguf_meta *g = m->gguf;
    strata_status st;
    if ((st = gguf_opt_f64(g, "general.sampling.temp", &d->temperature, &d->has_temperature)) ||
        (st = gguf_opt_f64(g, "general.sampling.top_p", &d->top_p, &d->has_top_p)) ||
        (st = gguf_opt_f64(g, "general.sampling.min_p", &d->min_p, &d->has_min_p)) ||
        (st = gguf_opt_f64(g, "general.sampling.penalty_repeat", &d->repetition_penalty,
                           &d->has_repetition_penalty)))
        return st;
    if (st_gguf_find_key(g, "general.sampling.top_k") >= 0) {
        if ((st = st_gguf_get_i64(g, "general.sampling.top_k", &d->top_k))) return st;
        d->has_top_k = true;
    }
    if ((st = check_values(d, m->path, "general.sampling.temp", "general.sampling.top_p",
                           "general.sampling.top_k", "general.sampling.min_p",
                           "general.sampling.penalty_repeat")))
        return st;
    if (d->has_temperature || d->has_top_p || d->has_top_k || d->has_min_p || d->has_repetition_penalty)
        snprintf(d->source, sizeof d->source, "%s general.sampling.*", m->path);
    return STRATA_OK;
}

strata_status st_sampling_defaults_read(const st_model_files *m, st_sampling_defaults *out) {
    if (!m || !out) return st_err(STRATA_ERR_INVALID_ARG, "st_sampling_defaults_read: NULL argument");
    memset(out, 0, sizeof *out);
    st_sampling_defaults d;
    memset(&d, 0, sizeof d);
    strata_status st = m->format == ST_FORMAT_GGUF ? (m->gguf ? read_gguf(m, &d) : STRATA_OK)
                                                   : read_hf(m->path, &d);
    if (st) return st;
    *out = d;
    return STRATA_OK;
}

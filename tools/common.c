#include "common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tool_print_error(const char *cmd) {
    const char *msg = st_last_error();
    fprintf(stderr, "strata %s: %s\n", cmd, msg && *msg ? msg : "failed");
}

bool tool_parse_i64(const char *s, int64_t lo, int64_t hi, const char *what, int64_t *out) {
    if (!s) {
        fprintf(stderr, "strata: %s needs a value\n", what);
        return false;
    }
    errno = 0;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "strata: %s: '%s' is not an integer in [%lld, %lld]\n", what, s,
                (long long)lo, (long long)hi);
        return false;
    }
    *out = v;
    return true;
}

bool tool_parse_f64(const char *s, double lo, double hi, const char *what, double *out) {
    if (!s) {
        fprintf(stderr, "strata: %s needs a value\n", what);
        return false;
    }
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !(v >= lo && v <= hi)) {
        fprintf(stderr, "strata: %s: '%s' is not a number in [%g, %g]\n", what, s, lo, hi);
        return false;
    }
    *out = v;
    return true;
}

int tool_parse_model_opt(int argc, char **argv, int *i, tool_model_opts *o) {
    const char *a = argv[*i];
    const char *val = *i + 1 < argc ? argv[*i + 1] : NULL;
    int64_t v;
    if (strcmp(a, "--device") == 0) {
        if (!val || (strcmp(val, "cpu") && strcmp(val, "cuda") && strcmp(val, "auto"))) {
            fprintf(stderr, "strata: --device takes cpu, cuda or auto\n");
            return -1;
        }
        o->device = val;
    } else if (strcmp(a, "--threads") == 0) {
        if (!tool_parse_i64(val, 1, 1024, "--threads", &v)) return -1;
        o->threads = (int)v;
    } else if (strcmp(a, "--ctx") == 0) {
        if (!tool_parse_i64(val, 1, INT32_MAX, "--ctx", &v)) return -1;
        o->ctx = v;
    } else if (strcmp(a, "--batch") == 0) {
        if (!tool_parse_i64(val, 1, 1 << 20, "--batch", &v)) return -1;
        o->batch = v;
    } else {
        return 0;
    }
    (*i)++;
    return 1;
}

bool tool_model_open(const char *path, const tool_model_opts *o, tool_model *tm) {
    memset(tm, 0, sizeof *tm);
    double t0 = st_time_now();
    if (st_model_open(path, &tm->files) != STRATA_OK) {
        tool_print_error("load");
        return false;
    }
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = o->threads};
    const char *dev = o->device ? o->device : "auto";
    if (strcmp(dev, "cuda") == 0 || (strcmp(dev, "auto") == 0 && st_backend_available(ST_BACKEND_CUDA)))
        bp.kind = ST_BACKEND_CUDA;
    if (st_backend_init(&bp, &tm->be) != STRATA_OK) {
        tool_print_error("backend");
        tool_model_close(tm);
        return false;
    }
    st_llama_params lp = {.max_ctx = o->ctx, .max_batch = o->batch};
    if (st_llama_init(tm->files, tm->be, &lp, &tm->model) != STRATA_OK) {
        tool_print_error("model");
        tool_model_close(tm);
        return false;
    }
    tm->load_s = st_time_now() - t0;
    return true;
}

void tool_model_close(tool_model *tm) {
    st_llama_free(tm->model);
    st_backend_free(tm->be);
    st_model_close(tm->files);
    memset(tm, 0, sizeof *tm);
}

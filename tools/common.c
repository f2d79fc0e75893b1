#include "common.h"
#include "api/faults.h"

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tool_print_error(const char *cmd) {
    const char *msg = st_last_error();
    fprintf(stderr, "strata %s: %s\n", cmd, msg && *msg ? msg : "failed");
}

bool tool_take_positional(const char *cmd, const char *arg, const char **path, void (*usage)(FILE *)) {
    if (arg[0] == '-') {
        fprintf(stderr, "strata %s: unknown option '%s' (or missing value)\n", cmd, arg);
        usage(stderr);
        return false;
    }
    if (*path) {
        fprintf(stderr, "strata %s: unexpected argument '%s'\n", cmd, arg);
        return false;
    }
    *path = arg;
    return true;
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

bool tool_parse_size(const char *s, const char *what, size_t *out) {
    if (!s) {
        fprintf(stderr, "strata: %s needs a value\n", what);
        return false;
    }
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    double mul = 1;
    if (end != s && *end) {
        switch (*end) {
        case 'k': case 'K': mul = 1024.0; break;
        case 'm': case 'M': mul = 1024.0 * 1024; break;
        case 'g': case 'G': mul = 1024.0 * 1024 * 1024; break;
        case 't': case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
        case 'b': case 'B': break;
        default: mul = 0;
        }
        if (mul > 0) {
            end++;
            if (*end == 'i') end++;
            if (*end == 'B' || *end == 'b') end++;
        }
    }
    if (errno || end == s || *end != '\0' || mul == 0 || !(v >= 0) || v * mul > 1.8e19) {
        fprintf(stderr, "strata: %s: '%s' is not a size (a number with an optional K, M, G or T suffix)\n", what,
                s);
        return false;
    }
    *out = (size_t)(v * mul);
    return true;
}

/* Block size of the tools' KV pools (the engines' default). */
#define TOOL_KV_BLOCK 16

static int64_t tool_seq_len(const tool_model_opts *o, const st_config *c) {
    return o->ctx > 0 ? o->ctx
           : c->max_position_embeddings > 0 && c->max_position_embeddings < 4096 ? c->max_position_embeddings
                                                                               : 4096;
}

static st_kv_pool_params kv_params_for(const tool_model_opts *o, const st_config *c, int64_t max_tokens,
                                       int64_t seq_len) {
    const int64_t seqs = o->kv_seqs > 0 ? o->kv_seqs : 1;
    const int64_t blocks = seqs * ((seq_len + TOOL_KV_BLOCK - 1) / TOOL_KV_BLOCK);
    return st_llama_kv_params_for(c, max_tokens, seq_len, blocks, TOOL_KV_BLOCK, o->kv_dtype);
}

st_kv_pool_params tool_kv_params(const tool_model_opts *o, const st_llama *m) {
    return kv_params_for(o, st_llama_config(m), st_llama_max_tokens(m), st_llama_max_seq_len(m));
}

bool tool_kv_streamed(const tool_model_opts *o, const st_config *c) {
    if (o->kv_stream) return true;
    if (!o->device_mem || o->kv_seqs > 1) return false;
    const int64_t T = o->batch > 0 ? o->batch : 512;
    const st_kv_pool_params kp = kv_params_for(o, c, T, tool_seq_len(o, c));
    return st_kv_pool_device_bytes(&kp) > o->device_mem / 2;
}

/* The attention piece: the default, or a --kv-segment below it. */
static int64_t attn_piece(const tool_model_opts *o) {
    return o->kv_segment > 0 && o->kv_segment < ST_PLAN_ATTN_PIECE ? o->kv_segment : 0;
}

st_kv_stream_params tool_stream_params(const tool_model_opts *o, const st_config *c) {
    return (st_kv_stream_params){.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                                 .dtype = o->kv_dtype, .piece = st_plan_attn_piece(attn_piece(o)),
                                 .max_tokens = o->batch > 0 ? o->batch : 512, .max_len = tool_seq_len(o, c),
                                 .host_mem = o->kv_stream_mem ? o->kv_stream_mem : st_kv_stream_default_host_mem(),
                                 .seg = o->kv_segment, .ssd_dir = o->kv_ssd_dir, .ssd_mem = o->kv_ssd_size};
}

st_llama_params tool_llama_params(const tool_model_opts *o, const st_model_files *files) {
    const st_config *c = &files->config;
    st_llama_params lp;
    memset(&lp, 0, sizeof lp);
    lp.max_seq_len = tool_seq_len(o, c);
    lp.max_tokens = o->batch > 0 ? o->batch : 512;
    lp.attn_piece = attn_piece(o);
    lp.cpu_attn = o->kv_cpu_attn;
    lp.device_mem = o->device_mem;
    const st_kv_pool_params kp = kv_params_for(o, c, lp.max_tokens, lp.max_seq_len);
    if (tool_kv_streamed(o, c)) {
        const st_kv_stream_params sp = tool_stream_params(o, c);
        lp.kv_bytes = st_kv_stream_device_bytes(&sp);
    } else {
        lp.kv_bytes = st_kv_pool_device_bytes(&kp);
    }
    lp.weights.host_mem = o->host_mem;
    lp.weights.ring_slots = o->ring_slots;
    lp.weights.cpu_ffn = o->cpu_layers;
    lp.weights.cpu_split = o->cpu_split;
    lp.weights.cpu_threads = o->threads;
    /* the CPU tier: int8 activations in fast mode on CUDA (its decode GEMV is int8 there too); on
     * the CPU backend those of the backend (--cpu-act), so the tier computes what it would */
    const bool cpu_dev = tool_backend_params(o).kind == ST_BACKEND_CPU;
    lp.weights.cpu_act = o->cpu_act8 || (!cpu_dev && tool_fast_prefill(o, files)) ? ST_CPU_ACT_INT8 : ST_CPU_ACT_PRECISE;
    lp.weights.cpu_max_tokens = o->cpu_max_tokens;
    lp.weights.cpu_pass_tokens = o->cpu_pass_tokens;
    lp.weights.bw.h2d = o->h2d_bw * 1e9;
    lp.weights.bw.ssd = o->ssd_bw * 1e9;
    strata_model_params mp = {0}; /* --test-fault (test builds only) */
    tool_test_faults(o, &mp);
    lp.weights.stream.faults = (st_ssd_faults){.fail_nth = mp.weight_read_fail_nth,
                                               .short_nth = mp.weight_read_short_nth,
                                               .delay_ms = mp.weight_read_delay_ms};
    return lp;
}

/* --test-fault KIND:N, checked when parsed: the kinds and the field each sets */
static const struct {
    const char *kind;
    size_t field; /* offsetof in strata_model_params (an int64_t, or delay_ms's int) */
} FAULTS[] = {
    {"read-error", offsetof(strata_model_params, weight_read_fail_nth)},
    {"short-read", offsetof(strata_model_params, weight_read_short_nth)},
    {"slow-read", offsetof(strata_model_params, weight_read_delay_ms)},
    {"device-alloc", offsetof(strata_model_params, device_alloc_fail_nth)},
    {"host-alloc", offsetof(strata_model_params, host_alloc_fail_nth)},
    {"kv-ssd-write", offsetof(strata_model_params, kv_ssd_fail_write_nth)},
};

/* The fault of a --test-fault value ("KIND:N", N >= 1): its index in FAULTS and N; -1 if malformed. */
static int fault_parse(const char *val, long long *n) {
    if (!val) return -1;
    for (size_t i = 0; i < sizeof FAULTS / sizeof FAULTS[0]; i++) {
        const size_t k = strlen(FAULTS[i].kind);
        if (strncmp(val, FAULTS[i].kind, k) != 0 || val[k] != ':') continue;
        char *end = NULL;
        errno = 0;
        *n = strtoll(val + k + 1, &end, 10);
        const long long cap = FAULTS[i].field == offsetof(strata_model_params, weight_read_delay_ms) ? 60000 : LLONG_MAX;
        return !errno && end != val + k + 1 && !*end && *n >= 1 && *n <= cap ? (int)i : -1;
    }
    return -1;
}

bool tool_spec_settle(tool_model_opts *o) {
    if (o->draft && o->spec == STRATA_SPEC_OFF) o->spec = STRATA_SPEC_DRAFT;
    if (o->draft && o->spec != STRATA_SPEC_DRAFT) {
        fprintf(stderr, "strata: --draft %s is a draft model, but --spec says lookup\n", o->draft);
        return false;
    }
    if (o->spec == STRATA_SPEC_DRAFT && !o->draft) {
        fprintf(stderr, "strata: --spec draft needs the draft model: --draft MODEL\n");
        return false;
    }
    if ((o->spec_k || o->spec_cost > 0) && o->spec == STRATA_SPEC_OFF) {
        fprintf(stderr, "strata: --spec-k and --spec-cost set the drafts of speculative decoding: give --spec "
                        "lookup or --draft\n");
        return false;
    }
    return true;
}

void tool_test_faults(const tool_model_opts *o, strata_model_params *mp) {
    long long n = 0;
    const int i = fault_parse(o->test_fault, &n);
    if (i < 0) return;
    char *f = (char *)mp + FAULTS[i].field;
    if (FAULTS[i].field == offsetof(strata_model_params, weight_read_delay_ms)) *(int *)f = (int)n;
    else *(int64_t *)f = n;
}

bool tool_test_fault_is(const tool_model_opts *o, const char *kind) {
    long long n;
    const int i = fault_parse(o->test_fault, &n);
    return i >= 0 && !strcmp(FAULTS[i].kind, kind);
}

st_backend_params tool_backend_params(const tool_model_opts *o) {
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = o->threads, .device_mem = o->device_mem,
                            .cpu_act = o->cpu_act8 ? ST_CPU_ACT_INT8 : ST_CPU_ACT_PRECISE};
    const char *dev = o->device ? o->device : "auto";
    if (strcmp(dev, "cuda") == 0 || (strcmp(dev, "auto") == 0 && st_backend_available(ST_BACKEND_CUDA)))
        bp.kind = ST_BACKEND_CUDA;
    return bp;
}

bool tool_fast_prefill(const tool_model_opts *o, const st_model_files *files) {
    if (o->prefill != 0) return o->prefill > 0;
    for (int64_t i = 0; i < files->n_tensors; i++) {
        const st_tensor_desc *t = &files->tensors[i];
        if (t->n_dims == 2 && strcmp(t->name, "model.embed_tokens.weight") != 0 && t->dtype != ST_DTYPE_F32)
            return true;
    }
    return false;
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
    } else if (strcmp(a, "--cpu-act") == 0) {
        if (!val || (strcmp(val, "precise") && strcmp(val, "int8"))) {
            fprintf(stderr, "strata: --cpu-act takes precise or int8\n");
            return -1;
        }
        o->cpu_act8 = strcmp(val, "int8") == 0;
    } else if (strcmp(a, "--ctx") == 0) {
        if (!tool_parse_i64(val, 1, INT32_MAX, "--ctx", &v)) return -1;
        o->ctx = v;
    } else if (strcmp(a, "--batch") == 0) {
        if (!tool_parse_i64(val, 1, 1 << 20, "--batch", &v)) return -1;
        o->batch = v;
    } else if (strcmp(a, "--device-mem") == 0 || strcmp(a, "--gpu-mem") == 0) {
        if (!tool_parse_size(val, a, &o->device_mem)) return -1;
    } else if (strcmp(a, "--host-mem") == 0) {
        if (!tool_parse_size(val, a, &o->host_mem)) return -1;
    } else if (strcmp(a, "--h2d-bw") == 0) {
        if (!tool_parse_f64(val, 1e-6, 1e6, a, &o->h2d_bw)) return -1;
    } else if (strcmp(a, "--ssd-bw") == 0) {
        if (!tool_parse_f64(val, 1e-6, 1e6, a, &o->ssd_bw)) return -1;
    } else if (strcmp(a, "--ring-slots") == 0) {
        if (!tool_parse_i64(val, 2, 64, a, &v)) return -1;
        o->ring_slots = (int)v;
    } else if (strcmp(a, "--cpu-layers") == 0) {
        if (val && !strcmp(val, "auto")) {
            o->cpu_layers = 0;
        } else {
            if (!tool_parse_i64(val, 0, 1 << 20, "--cpu-layers (auto, 0: off, or a count)", &v)) return -1;
            o->cpu_layers = v == 0 ? -1 : (int)v;
        }
    } else if (strcmp(a, "--cpu-split") == 0) {
        if (val && !strcmp(val, "auto")) {
            o->cpu_split = 0;
        } else {
            double f;
            if (!tool_parse_f64(val, 0, 0.999, "--cpu-split (auto, 0: none, or a share below 1)", &f)) return -1;
            o->cpu_split = f == 0 ? -1 : f;
        }
    } else if (strcmp(a, "--cpu-max-tokens") == 0) {
        if (!tool_parse_i64(val, 1, 1 << 20, a, &v)) return -1;
        o->cpu_max_tokens = v;
    } else if (strcmp(a, "--cpu-pass-tokens") == 0) {
        if (!tool_parse_i64(val, 1, 1 << 20, a, &v)) return -1;
        o->cpu_pass_tokens = v;
    } else if (strcmp(a, "--kv-dtype") == 0) {
        if (!val || !st_kv_dtype_parse(val, &o->kv_dtype)) {
            fprintf(stderr, "strata: --kv-dtype takes bf16, fp8 or f32\n");
            return -1;
        }
    } else if (strcmp(a, "--precise") == 0 || strcmp(a, "--fast-prefill") == 0) {
        const int want = a[2] == 'p' ? -1 : 1;
        if (o->prefill != 0 && o->prefill != want) {
            fprintf(stderr, "strata: --precise and --fast-prefill exclude each other\n");
            return -1;
        }
        o->prefill = want;
        return 1; /* no value */
    } else if (!o->kv_tier_opts && (!strcmp(a, "--kv-host-mem") || !strcmp(a, "--kv-offload") ||
                                    !strcmp(a, "--kv-ssd-dir") || !strcmp(a, "--kv-ssd-size") ||
                                    !strcmp(a, "--kv-stream") || !strcmp(a, "--kv-segment") ||
                                    !strcmp(a, "--kv-stream-mem") || !strcmp(a, "--kv-cpu-attn"))) {
        fprintf(stderr, "strata: %s is an option of run, serve, plan, bench and bench-kv (the KV cache's tiers)\n",
                a);
        return -1;
    } else if (!o->spec_opts && (!strcmp(a, "--spec") || !strcmp(a, "--draft") || !strcmp(a, "--spec-k") ||
                                 !strcmp(a, "--spec-cost"))) {
        fprintf(stderr, "strata: %s is an option of run and serve (speculative decoding; bench measures its "
                        "verification passes with --verify)\n", a);
        return -1;
    } else if (strcmp(a, "--spec") == 0) {
        if (!val || (strcmp(val, "off") && strcmp(val, "lookup") && strcmp(val, "draft"))) {
            fprintf(stderr, "strata: --spec takes lookup, draft or off\n");
            return -1;
        }
        o->spec = !strcmp(val, "lookup") ? STRATA_SPEC_LOOKUP : !strcmp(val, "draft") ? STRATA_SPEC_DRAFT
                                                                                        : STRATA_SPEC_OFF;
    } else if (strcmp(a, "--draft") == 0) {
        if (!val || !val[0]) {
            fprintf(stderr, "strata: --draft needs the draft model's path\n");
            return -1;
        }
        o->draft = val;
    } else if (strcmp(a, "--spec-k") == 0) {
        if (!tool_parse_i64(val, 1, 32, a, &v)) return -1;
        o->spec_k = (int)v;
    } else if (strcmp(a, "--spec-cost") == 0) {
        if (!tool_parse_f64(val, 1e-6, 10, a, &o->spec_cost)) return -1;
    } else if (strcmp(a, "--kv-stream") == 0) {
        o->kv_stream = true;
        return 1; /* no value */
    } else if (strcmp(a, "--kv-segment") == 0) {
        if (!tool_parse_i64(val, 4096, (int64_t)1 << 24, a, &v)) return -1;
        if (v & (v - 1)) {
            fprintf(stderr, "strata: --kv-segment %s is not a power of two (4096, 8192, ... 65536, ...)\n", val);
            return -1;
        }
        o->kv_segment = v;
    } else if (strcmp(a, "--kv-stream-mem") == 0) {
        if (!tool_parse_size(val, a, &o->kv_stream_mem)) return -1;
        if (o->kv_stream_mem == 0) {
            fprintf(stderr, "strata: --kv-stream-mem must be > 0 (leave it out for 3/4 of the memory available)\n");
            return -1;
        }
    } else if (strcmp(a, "--kv-cpu-attn") == 0) {
        if (val && !strcmp(val, "auto")) o->kv_cpu_attn = -1;
        else if (!tool_parse_f64(val, 0, 1, a, &o->kv_cpu_attn)) return -1;
    } else if (strcmp(a, "--kv-host-mem") == 0) {
        size_t n = 0;
        if (!tool_parse_size(val, a, &n)) return -1;
        if (n > (size_t)INT64_MAX) {
            fprintf(stderr, "strata: --kv-host-mem %s is too large\n", val);
            return -1;
        }
        o->kv_host_mem = n == 0 ? -1 : (int64_t)n;
    } else if (strcmp(a, "--kv-offload") == 0) {
        if (!val || (strcmp(val, "eager") && strcmp(val, "lazy"))) {
            fprintf(stderr, "strata: --kv-offload takes eager or lazy\n");
            return -1;
        }
        o->kv_offload_lazy = strcmp(val, "lazy") == 0;
    } else if (strcmp(a, "--kv-ssd-dir") == 0) {
        if (!val || !val[0]) {
            fprintf(stderr, "strata: --kv-ssd-dir needs a directory\n");
            return -1;
        }
        o->kv_ssd_dir = val;
    } else if (strcmp(a, "--kv-ssd-size") == 0) {
        if (!tool_parse_size(val, a, &o->kv_ssd_size)) return -1;
        if (o->kv_ssd_size == 0) {
            fprintf(stderr, "strata: --kv-ssd-size must be > 0 (leave out --kv-ssd-dir for no SSD tier)\n");
            return -1;
        }
#ifdef STRATA_TESTING
    } else if (strcmp(a, "--test-fault") == 0) { /* test builds only: fault injection */
        long long n = 0;
        if (fault_parse(val, &n) < 0) {
            fprintf(stderr, "strata: --test-fault takes read-error:N, short-read:N, slow-read:MS (at most 60000), "
                            "device-alloc:N, host-alloc:N or kv-ssd-write:N (N >= 1)\n");
            return -1;
        }
        o->test_fault = val;
#endif
    } else {
        return 0;
    }
    (*i)++;
    return 1;
}

bool tool_model_open(const char *path, const tool_model_opts *o, tool_model *tm) {
    memset(tm, 0, sizeof *tm);
    double t0 = st_time_now();
    /* budgets above what the machine has (the check strata_model_open makes for run and serve) */
    const strata_model_params mp = {.device = o->device, .host_mem = o->host_mem, .kv_stream_mem = o->kv_stream_mem};
    if (strata_check_memory(&mp) != STRATA_OK) {
        tool_print_error("load");
        return false;
    }
    if (st_model_open(path, &tm->files) != STRATA_OK) {
        tool_print_error("load");
        return false;
    }
    st_backend_params bp = tool_backend_params(o);
    if (st_backend_init(&bp, &tm->be) != STRATA_OK) {
        tool_print_error("backend");
        tool_model_close(tm);
        return false;
    }
    strata_model_params fp = {0}; /* --test-fault device-alloc:N / host-alloc:N (test builds) */
    tool_test_faults(o, &fp);
    st_backend_inject_alloc_faults(tm->be, fp.device_alloc_fail_nth, fp.host_alloc_fail_nth);
    tm->be->ops->set_fast_prefill(tm->be, tool_fast_prefill(o, tm->files));
    st_llama_params lp = tool_llama_params(o, tm->files);
    if (st_llama_measure(tm->files, tm->be, &lp) != STRATA_OK || /* bandwidths, scratch (budgeted) */
        st_llama_init(tm->files, tm->be, &lp, &tm->model) != STRATA_OK) {
        tool_print_error("model");
        tool_model_close(tm);
        return false;
    }
    const st_kv_pool_params kp = tool_kv_params(o, tm->model);
    if (!tool_kv_streamed(o, &tm->files->config) && st_kv_pool_init(tm->be, &kp, &tm->kv) != STRATA_OK) {
        tool_print_error("kv cache");
        tool_model_close(tm);
        return false;
    }
    tm->load_s = st_time_now() - t0;
    st_wm_stats ws;
    st_wm_stats_get(st_llama_weights(tm->model), &ws);
    if (!ws.pin_done) {
        char b[32];
        fprintf(stderr, "strata: pinning %s of weights in host memory in the background (served from the file "
                        "meanwhile; STRATA_LOG=info shows progress)\n",
                st_fmt_bytes((double)ws.pin_total_bytes, b, sizeof b));
    }
    return true;
}

void tool_model_close(tool_model *tm) {
    if (tm->model && tm->kv) st_llama_forget_pool(tm->model, tm->kv);
    st_kv_pool_free(tm->kv);
    st_llama_free(tm->model);
    st_backend_free(tm->be);
    st_model_close(tm->files);
    memset(tm, 0, sizeof *tm);
}

void tool_weights_settle(tool_model *tm, st_wm_stats *out) {
    st_wm *wm = st_llama_weights(tm->model);
    st_wm_stats_get(wm, out);
    if (!out->pin_done) {
        const double t0 = st_time_now();
        if (st_wm_wait_pinned(wm) != STRATA_OK) return;
        fprintf(stderr, "strata: waited %.2f s for the host tier to be pinned\n", st_time_now() - t0);
    }
    st_wm_stats_get(wm, out);
}

void tool_print_weights(tool_model *tm, const st_wm_stats *before, const st_wm_stats *after, int64_t steps,
                        double step_s, int64_t n_prompt, double t_prefill) {
    st_wm *wm = st_llama_weights(tm->model);
    const st_wplan *p = st_wm_plan(wm);
    char line[512], b[4][32];
    st_wplan_summary(p, line, sizeof line);
    printf("weights      %s\n", line);
    if (st_wm_streamed(wm) == 0 || steps <= 0) return;
    const st_wm_stats s = *after;
    const double n = (double)steps;
    const uint64_t ssd_total = s.ssd_group_bytes - before->ssd_group_bytes, h2d_total = s.h2d_bytes - before->h2d_bytes;
    const double ssd = (double)ssd_total / n;
    const double h2d = (double)h2d_total / n;
    const double wait = (s.acquire_wait_s - before->acquire_wait_s) / n;
    printf("streaming    per token: %s from the file (plan %s), %s copied to the device (plan %s); "
           "%s, %s; compute waited %.3f ms/token for weights\n",
           st_fmt_bytes(ssd, b[0], 32), st_fmt_bytes((double)p->step_ssd_img_bytes, b[1], 32),
           st_fmt_bytes(h2d, b[2], 32), st_fmt_bytes((double)(p->step_ssd_bytes + p->step_host_bytes), b[3], 32),
           s.uring ? "io_uring" : "pread", s.direct ? "O_DIRECT" : "page cache", wait * 1e3);
    /* exact: groups are counted when used, so a step's bytes are the plan's to the byte */
    printf("bytes        per decode step: file %.1f (plan %llu), to the device %.1f (plan %llu) (%llu and %llu bytes in "
           "%lld steps)\n",
           ssd, (unsigned long long)p->step_ssd_img_bytes, h2d,
           (unsigned long long)(p->step_ssd_bytes + p->step_host_bytes), (unsigned long long)ssd_total,
           (unsigned long long)h2d_total, (long long)steps);
    printf("bandwidth    H2D %.2f GB/s, SSD %.2f GB/s (%s), matmul weight read %.2f GB/s; achieved: file reads "
           "%.2f GB/s, copies to the device %.2f GB/s (per decode step)\n",
           p->bw.h2d / 1e9, p->bw.ssd / 1e9, p->bw.measured[1] ? "measured now" : "given", p->bw.dev_read / 1e9,
           step_s > 0 ? ssd / step_s / 1e9 : 0.0, step_s > 0 ? h2d / step_s / 1e9 : 0.0);
    printf("bound        decode %.3f ms/token predicted (%s: SSD %.3f ms, PCIe %.3f ms, device compute %.3f ms, "
           "CPU compute %.3f ms), measured %.3f ms/token: %.0f%% of the bound\n",
           p->t_decode * 1e3, st_wbound_name(p->decode_bound), p->t_ssd * 1e3, p->t_pcie * 1e3,
           p->t_compute * 1e3, p->t_cpu * 1e3, step_s * 1e3, step_s > 0 ? 100.0 * p->t_decode / step_s : 0.0);
    if (p->groups[ST_TIER_CPU] > 0) { /* hybrid: the two streams of weight bytes, each at its own rate */
        const double cpu = (double)(s.cpu_bytes - before->cpu_bytes) / n;
        const double t_pcie = p->bw.h2d > 0 ? (double)(p->step_ssd_bytes + p->step_host_bytes) / p->bw.h2d : 0;
        const double t_cpu = p->bw.cpu > 0 ? (double)p->step_cpu_bytes / p->bw.cpu : 0;
        const double bound = t_pcie > t_cpu ? t_pcie : t_cpu;
        const double floor = p->t_host > bound ? p->t_host : bound;
        printf("hybrid       per decode step: %s computed on the CPU from host memory (plan %s, %d groups, %lld "
               "rows of each on the device) at %.2f GB/s (%s), %s over PCIe at %.2f GB/s; achieved CPU read %.2f GB/s\n",
               st_fmt_bytes(cpu, b[0], 32), st_fmt_bytes((double)p->step_cpu_bytes, b[1], 32),
               p->groups[ST_TIER_CPU], (long long)p->split_rows, p->bw.cpu / 1e9,
               p->bw.cpu <= 0 ? "not measured: the CPU backend" : p->bw.measured[4] ? "measured now" : "given",
               st_fmt_bytes((double)(p->step_ssd_bytes + p->step_host_bytes), b[2], 32), p->bw.h2d / 1e9,
               step_s > 0 ? cpu / step_s / 1e9 : 0.0);
        const double wait = (s.cpu_wait_s - before->cpu_wait_s) / n, comp = (s.cpu_compute_s - before->cpu_compute_s) / n;
        printf("hybrid       per decode step: the CPU computed its groups in %.3f ms (%.2f GB/s while computing) and "
               "waited %.3f ms for the device's work before them; the rest of the step %.3f ms\n",
               comp * 1e3, comp > 0 ? cpu / comp / 1e9 : 0.0, wait * 1e3, (step_s - comp - wait) * 1e3);
        printf("bound        hybrid max(PCIe bytes / H2D, CPU bytes / CPU rate) = max(%.3f, %.3f) = %.3f ms/token, "
               "measured %.3f ms/token: %.0f%% of it\n",
               t_pcie * 1e3, t_cpu * 1e3, bound * 1e3, step_s * 1e3, step_s > 0 ? 100.0 * bound / step_s : 0.0);
        if (p->t_step > 0)
            printf("bound        hybrid step simulated group by group (ring %d slots ahead, the device waiting while the "
                   "CPU computes) %.3f ms/token, measured %.3f ms/token: %.0f%% of it\n",
                   p->ring_slots, p->t_step * 1e3, step_s * 1e3, step_s > 0 ? 100.0 * p->t_step / step_s : 0.0);
        if (p->t_host > 0) /* both read the same DRAM: what it gives them together */
            printf("bound        host memory: (PCIe + CPU bytes) / (H2D %.2f + CPU %.2f GB/s measured together) = "
                   "%.3f ms/token; max with the above %.3f ms/token, measured %.3f ms/token: %.0f%% of it\n",
                   p->bw.h2d_shared / 1e9, p->bw.cpu_shared / 1e9, p->t_host * 1e3, floor * 1e3, step_s * 1e3,
                   step_s > 0 ? 100.0 * floor / step_s : 0.0);
    }
    if (n_prompt > 0 && t_prefill > 0) {
        double ts, tc;
        st_wbound pb;
        const double tp = st_wplan_prefill(p, n_prompt, &ts, &tc, &pb);
        printf("bound        prefill of %lld tokens %.3f s predicted (%s: streaming %.3f s, compute %.3f s), "
               "measured %.3f s: %.0f%% of the bound\n",
               (long long)n_prompt, tp, st_wbound_name(pb), ts, tc, t_prefill, 100.0 * tp / t_prefill);
    }
}

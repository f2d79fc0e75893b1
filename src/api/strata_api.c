/* The public C API (include/strata.h) over the internal modules: a model
 * handle holds the mapped files, the backend, the tokenizer, the chat
 * template in use and (once created) the engine. Requests map onto
 * st_engine_add / abort / step / start / stop; each accepted request carries a
 * small record with the caller's callbacks, freed after its on_finish. */
#include <float.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"
#include "api/faults.h"

#include "backend/backend.h"
#include "core/core.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "loader/loader.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

#define DEF_MAX_SEQ_CAP 4096

struct strata_model {
    st_model_files *files;
    st_backend *be;
    st_tokenizer *tok;
    st_engine *eng;             /* NULL until strata_model_create_engine */
    st_engine_params ep;        /* what the engine is built with (from the load params) */
    /* chat: the model's own template as recognised at open, and the one in use */
    st_chat_template own;       /* kind NONE when absent or not recognised */
    strata_status own_status;   /* UNSUPPORTED: the model's template is not recognised */
    char own_error[512];        /* its message */
    st_chat_template tpl;       /* in use */
    bool tpl_set;               /* chosen by strata_chat_set_template (not the model's own) */
    atomic_bool thread_on;      /* strata_start .. strata_stop */
    char *kv_ssd_dir;           /* the params' copy (ep.kv_ssd_dir points here) */
    st_model_files *draft;      /* speculative decoding's draft model (ep.spec.draft), or NULL */
};

/* ---- errors and logging ---------------------------------------------------------------*/
const char *strata_last_error(void) { return st_last_error(); }

float strata_sampling_float(double v) {
    const float f = (float)v;
    return v > 0 && !(f > 0) ? FLT_TRUE_MIN : f;
}

void strata_set_log(strata_log_level level, strata_log_fn fn, void *user) { st_log_set(fn, user, level); }

static strata_status need_engine(const strata_model *m, const char *fn);

/* The public enums and limits mirror the internal ones. */
_Static_assert(STRATA_FINISH_COUNT == ST_FINISH_COUNT_, "finish reasons");
_Static_assert((int)STRATA_FINISH_STOP == (int)ST_FINISH_STOP && (int)STRATA_FINISH_LENGTH == (int)ST_FINISH_LENGTH &&
                   (int)STRATA_FINISH_ABORT == (int)ST_FINISH_ABORT && (int)STRATA_FINISH_ERROR == (int)ST_FINISH_ERROR,
               "finish reasons");
_Static_assert(STRATA_HIST_MAX == ST_ENGINE_HIST_MAX, "histogram bounds");

/* ---- model -------------------------------------------------------------------------------*/
static strata_status kv_dtype_of(const strata_model_params *p, st_kv_dtype *out) {
    if (p->kv_dtype_name) {
        if (!st_kv_dtype_parse(p->kv_dtype_name, out))
            return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_dtype_name '%s' (bf16, fp8 or f32)",
                          p->kv_dtype_name);
        return STRATA_OK;
    }
    switch (p->kv_dtype) {
    case STRATA_KV_BF16: *out = ST_KV_BF16; return STRATA_OK;
    case STRATA_KV_FP8: *out = ST_KV_FP8; return STRATA_OK;
    case STRATA_KV_F32: *out = ST_KV_F32; return STRATA_OK;
    }
    return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_dtype %d (STRATA_KV_BF16, _FP8 or _F32)", (int)p->kv_dtype);
}

/* Checks the load params and turns them into backend params (the engine's
 * come later, from the model's config). */
static strata_status check_params(const strata_model_params *p, st_backend_params *bp, st_kv_dtype *kvd) {
    memset(bp, 0, sizeof *bp);
    const char *dev = p->device ? p->device : "auto";
    if (strcmp(dev, "cpu") && strcmp(dev, "cuda") && strcmp(dev, "auto"))
        return st_err(STRATA_ERR_INVALID_ARG, "model params: device '%s' (cpu, cuda or auto)", dev);
    bp->kind = ST_BACKEND_CPU;
    if (!strcmp(dev, "cuda") || (!strcmp(dev, "auto") && st_backend_available(ST_BACKEND_CUDA)))
        bp->kind = ST_BACKEND_CUDA;
    if (p->threads < 0) return st_err(STRATA_ERR_INVALID_ARG, "model params: threads %d < 0", p->threads);
    bp->n_threads = p->threads;
    if (p->cpu_act != STRATA_CPU_ACT_PRECISE && p->cpu_act != STRATA_CPU_ACT_INT8)
        return st_err(STRATA_ERR_INVALID_ARG, "model params: cpu_act %d", (int)p->cpu_act);
    bp->cpu_act = p->cpu_act == STRATA_CPU_ACT_INT8 ? ST_CPU_ACT_INT8 : ST_CPU_ACT_PRECISE;
    bp->device_mem = p->device_mem;
    if (p->max_batch < 0 || p->max_seq_len < 0 || p->prefill_chunk < 0 || p->max_waiting < 0)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "model params: negative max_batch %lld, max_seq_len %lld, prefill_chunk %lld or max_waiting %lld",
                      (long long)p->max_batch, (long long)p->max_seq_len, (long long)p->prefill_chunk,
                      (long long)p->max_waiting);
    if (p->prefill != STRATA_PREFILL_AUTO && p->prefill != STRATA_PREFILL_PRECISE && p->prefill != STRATA_PREFILL_FAST)
        return st_err(STRATA_ERR_INVALID_ARG, "model params: prefill %d", (int)p->prefill);
    if (p->ring_slots < 0) return st_err(STRATA_ERR_INVALID_ARG, "model params: ring_slots %d < 0", p->ring_slots);
    if (!(p->cpu_split < 1) || p->cpu_split != p->cpu_split)
        return st_err(STRATA_ERR_INVALID_ARG, "model params: cpu_split %g (0 auto, < 0 none, or a share below 1)",
                      p->cpu_split);
    if (p->cpu_layers < -1 || p->cpu_max_tokens < 0 || p->cpu_pass_tokens < 0)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "model params: cpu_layers %d (-1, 0 or a count), cpu_max_tokens %lld or cpu_pass_tokens %lld "
                      "(>= 0)",
                      p->cpu_layers, (long long)p->cpu_max_tokens, (long long)p->cpu_pass_tokens);
    if (p->max_seq_len_cap < 0 || p->step_tokens < 0 || p->kv_blocks < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "model params: negative max_seq_len_cap %lld, step_tokens %lld or kv_blocks %lld",
                      (long long)p->max_seq_len_cap, (long long)p->step_tokens, (long long)p->kv_blocks);
    if (!(p->h2d_gbps >= 0) || !(p->ssd_gbps >= 0))
        return st_err(STRATA_ERR_INVALID_ARG, "model params: bandwidths h2d %g, ssd %g GB/s (>= 0)", p->h2d_gbps,
                      p->ssd_gbps);
    if (p->kv_segment && (p->kv_segment < 4096 || p->kv_segment > ((int64_t)1 << 24) ||
                          (p->kv_segment & (p->kv_segment - 1))))
        return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_segment %lld (--kv-segment: 0, or a power of two "
                      "from 4096 to 2^24)", (long long)p->kv_segment);
    if (!(p->kv_cpu_attn == -1 || (p->kv_cpu_attn >= 0 && p->kv_cpu_attn <= 1)))
        return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_cpu_attn %g (--kv-cpu-attn: auto, or 0 to 1)",
                      p->kv_cpu_attn);
    if (p->kv_host_mem < -1)
        return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_host_mem %lld (-1: off, 0: default, or bytes)",
                      (long long)p->kv_host_mem);
    if (p->kv_stream_mem && !p->kv_stream) /* no streamed request: it would be ignored without a word */
        return st_err(STRATA_ERR_INVALID_ARG, "model params: kv_stream_mem (--kv-stream-mem) is the host share of a "
                      "streamed request's KV: it needs kv_stream (--kv-stream)");
    return kv_dtype_of(p, kvd);
}

/* The prefill precision: AUTO is fast when a matrix of the model (a 2-D
 * tensor other than the token embedding) is stored in bf16, f16 or a
 * quantized type, precise for f32 models (as the tools choose). */
static bool fast_prefill(strata_prefill pf, const st_model_files *files) {
    if (pf != STRATA_PREFILL_AUTO) return pf == STRATA_PREFILL_FAST;
    for (int64_t i = 0; i < files->n_tensors; i++) {
        const st_tensor_desc *t = &files->tensors[i];
        if (t->n_dims == 2 && strcmp(t->name, "model.embed_tokens.weight") != 0 && t->dtype != ST_DTYPE_F32)
            return true;
    }
    return false;
}

static strata_status tpl_copy(const st_chat_template *src, st_chat_template *dst) {
    memset(dst, 0, sizeof *dst);
    dst->kind = src->kind;
    dst->date_from_clock = src->date_from_clock;
    if ((src->default_system && !(dst->default_system = st_strdup(src->default_system))) ||
        (src->date && !(dst->date = st_strdup(src->date)))) {
        st_chat_template_clear(dst);
        return st_err(STRATA_ERR_NOMEM, "chat template: out of memory for a copy of its system prompt and date");
    }
    return STRATA_OK;
}

void strata_model_free(strata_model *m) {
    if (!m) return;
    st_engine_free(m->eng); /* stops the thread, aborts what is pending (their records freed) */
    st_chat_template_clear(&m->tpl);
    st_chat_template_clear(&m->own);
    st_tokenizer_free(m->tok);
    st_backend_free(m->be);
    st_model_close(m->files);
    st_model_close(m->draft);
    st_free(m->kv_ssd_dir);
    st_free(m);
}

/* "1.5 GiB" (powers of 1024, as the size options read them). */
static const char *mem_str(char *buf, size_t n, size_t bytes) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, n, "%zu B", bytes);
    else snprintf(buf, n, "%.1f %s", v, units[u]);
    return buf;
}

strata_status strata_check_memory(const strata_model_params *params) {
    const strata_model_params p = params ? *params : (strata_model_params){0};
    const size_t avail = st_mem_available();
    if (!avail) return STRATA_OK; /* unknown: not checked */
    char want[32], have[32];
    if (p.host_mem > avail)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "--host-mem %s (pinned host memory for streamed weights) is more than this machine has "
                      "available: MemAvailable %s (/proc/meminfo)",
                      mem_str(want, sizeof want, p.host_mem), mem_str(have, sizeof have, avail));
    if (p.kv_stream_mem > avail)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "--kv-stream-mem %s (host memory for a streamed request's KV) is more than this machine has "
                      "available: MemAvailable %s (/proc/meminfo)",
                      mem_str(want, sizeof want, p.kv_stream_mem), mem_str(have, sizeof have, avail));
    const char *dev = p.device ? p.device : "auto";
    const bool cpu = !strcmp(dev, "cpu") || (!strcmp(dev, "auto") && !st_backend_available(ST_BACKEND_CUDA));
    if (cpu && p.kv_blocks == 0 && p.kv_mem > avail)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "--kv-mem %s (the KV cache: in host memory on the CPU backend) is more than this machine "
                      "has available: MemAvailable %s (/proc/meminfo)",
                      mem_str(want, sizeof want, p.kv_mem), mem_str(have, sizeof have, avail));
    return STRATA_OK;
}

strata_status strata_model_open(const char *path, const strata_model_params *params, strata_model **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "strata_model_open: out is NULL");
    *out = NULL;
    if (!path) return st_err(STRATA_ERR_INVALID_ARG, "strata_model_open: path is NULL");
    const strata_model_params p = params ? *params : (strata_model_params){0};
    st_backend_params bp;
    st_kv_dtype kvd;
    strata_status st = check_params(&p, &bp, &kvd);
    if (st) return st;
    if ((st = strata_check_memory(&p))) return st; /* budgets above what the machine has */
    strata_model *m = st_calloc(1, sizeof *m);
    if (!m) return st_err(STRATA_ERR_NOMEM, "strata_model_open: out of memory for its state (%zu bytes)", sizeof *m);
    atomic_init(&m->thread_on, false);
    if ((st = st_model_open(path, &m->files)) || (st = st_backend_init(&bp, &m->be)) ||
        (st = st_tokenizer_load(m->files, &m->tok))) {
        strata_model_free(m);
        return st;
    }
    st_backend_inject_alloc_faults(m->be, p.device_alloc_fail_nth, p.host_alloc_fail_nth); /* tests */
    m->be->ops->set_fast_prefill(m->be, fast_prefill(p.prefill, m->files));
    /* the chat template: recognised now; an unknown one is not an error until used */
    m->own_status = st_chat_detect(st_tokenizer_chat_template(m->tok), &m->own);
    if (m->own_status != STRATA_OK) {
        snprintf(m->own_error, sizeof m->own_error, "%s", st_last_error());
        st_clear_error();
    }
    if ((st = tpl_copy(&m->own, &m->tpl))) {
        strata_model_free(m);
        return st;
    }
    /* the engine's parameters, built later */
    const st_config *cfg = &m->files->config;
    int64_t seq = p.max_seq_len;
    const int64_t cap = p.max_seq_len_cap > 0 ? p.max_seq_len_cap : DEF_MAX_SEQ_CAP;
    if (seq == 0)
        seq = cfg->max_position_embeddings > 0 && cfg->max_position_embeddings < cap ? cfg->max_position_embeddings
                                                                                     : cap;
    m->ep = (st_engine_params){.max_batch = p.max_batch,
                               .max_model_len = seq,
                               .prefill_chunk = p.prefill_chunk,
                               .step_tokens = p.step_tokens,
                               .max_waiting = p.max_waiting,
                               .kv_blocks = p.kv_blocks,
                               .kv_mem = p.kv_mem,
                               .disable_prefix_cache = p.disable_prefix_cache,
                               .host_sample = p.host_sample,
                               .kv_stream = p.kv_stream,
                               .kv_segment = p.kv_segment,
                               .kv_stream_mem = p.kv_stream_mem,
                               .kv_cpu_attn = p.kv_cpu_attn,
                               .kv_host_mem = p.kv_host_mem < 0 ? ST_KV_HOST_OFF : p.kv_host_mem,
                               .kv_landing_mem = p.kv_landing_mem,
                               .kv_offload = p.kv_offload_lazy ? ST_KV_OFFLOAD_LAZY : ST_KV_OFFLOAD_EAGER,
                               .kv_ssd_dir = NULL, /* below: the model's copy */
                               .kv_ssd_size = p.kv_ssd_size,
                               .kv_ssd_fail_write_nth = p.kv_ssd_fail_write_nth,
                               .kv_dtype = kvd,
                               .device_mem = p.device_mem};
    if (p.kv_ssd_dir && p.kv_ssd_dir[0]) {
        m->kv_ssd_dir = st_malloc(strlen(p.kv_ssd_dir) + 1);
        if (!m->kv_ssd_dir) {
            strata_model_free(m);
            return st_err(STRATA_ERR_NOMEM, "strata_model_open: out of memory for the path of --kv-ssd-dir (%zu bytes)",
                          strlen(p.kv_ssd_dir) + 1);
        }
        memcpy(m->kv_ssd_dir, p.kv_ssd_dir, strlen(p.kv_ssd_dir) + 1);
        m->ep.kv_ssd_dir = m->kv_ssd_dir;
    }
    if (p.spec != STRATA_SPEC_OFF && p.spec != STRATA_SPEC_LOOKUP && p.spec != STRATA_SPEC_DRAFT) {
        strata_model_free(m);
        return st_err(STRATA_ERR_INVALID_ARG, "spec %d: off, lookup or draft", (int)p.spec);
    }
    if ((p.spec == STRATA_SPEC_DRAFT) != (p.draft_model != NULL && p.draft_model[0])) {
        strata_model_free(m);
        return st_err(STRATA_ERR_INVALID_ARG, p.spec == STRATA_SPEC_DRAFT
                                                  ? "speculative decoding with a draft model needs its path (--draft)"
                                                  : "a draft model is given but speculative decoding is not set to "
                                                    "draft");
    }
    m->ep.spec = (st_spec_params){.mode = p.spec == STRATA_SPEC_LOOKUP  ? ST_SPEC_LOOKUP
                                          : p.spec == STRATA_SPEC_DRAFT ? ST_SPEC_DRAFT
                                                                        : ST_SPEC_OFF,
                                  .k_max = p.spec_k,
                                  .step_cost = p.spec_cost};
    if (p.spec == STRATA_SPEC_DRAFT) {
        if ((st = st_model_open(p.draft_model, &m->draft))) {
            char msg[768];
            snprintf(msg, sizeof msg, "%s", st_last_error());
            strata_model_free(m);
            return st_err(st, "draft model: %s", msg);
        }
        m->ep.spec.draft = m->draft;
    }
    if ((st = st_spec_params_resolve(&m->ep.spec))) {
        strata_model_free(m);
        return st;
    }
    m->ep.weights.host_mem = p.host_mem;
    m->ep.weights.ring_slots = p.ring_slots;
    m->ep.weights.cpu_ffn = p.cpu_layers;
    m->ep.weights.cpu_split = p.cpu_split;
    m->ep.weights.cpu_threads = p.threads;
    /* the CPU tier: int8 activations in fast mode on CUDA (its decode GEMV is int8 there too); on the CPU
     * backend those of the backend */
    m->ep.weights.cpu_act = p.cpu_act == STRATA_CPU_ACT_INT8 ||
                                    (m->be->kind != ST_BACKEND_CPU && fast_prefill(p.prefill, m->files))
                                ? ST_CPU_ACT_INT8
                                : ST_CPU_ACT_PRECISE;
    m->ep.weights.cpu_max_tokens = p.cpu_max_tokens;
    m->ep.weights.cpu_pass_tokens = p.cpu_pass_tokens;
    m->ep.weights.bw.h2d = p.h2d_gbps * 1e9;
    m->ep.weights.bw.ssd = p.ssd_gbps * 1e9;
    m->ep.weights.stream.faults = (st_ssd_faults){.fail_nth = p.weight_read_fail_nth,
                                                  .short_nth = p.weight_read_short_nth,
                                                  .delay_ms = p.weight_read_delay_ms};
    *out = m;
    return STRATA_OK;
}

strata_status strata_model_create_engine(strata_model *m) {
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "strata_model_create_engine: model is NULL");
    if (m->eng) return STRATA_OK;
    const int64_t tv = st_tokenizer_vocab_size(m->tok);
    if (tv > m->files->config.vocab_size)
        return st_err(STRATA_ERR_MISMATCH, "%s: the tokenizer has %lld tokens, more than the model's vocabulary of %lld",
                      m->files->path, (long long)tv, (long long)m->files->config.vocab_size);
    return st_engine_init(m->files, m->be, m->tok, &m->ep, &m->eng);
}

strata_status strata_model_load(const char *path, const strata_model_params *params, strata_model **out) {
    strata_status st = strata_model_open(path, params, out);
    if (st) return st;
    if ((st = strata_model_create_engine(*out))) {
        strata_model_free(*out);
        *out = NULL;
    }
    return st;
}

strata_status strata_model_page_in(const strata_model *m, void (*progress)(void *user, uint64_t done, uint64_t total),
                                   void *user) {
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "strata_model_page_in: model is NULL");
    const st_model_files *files = m->files;
    uint64_t total = 0, done = 0;
    for (int f = 0; f < files->n_files; f++) total += files->files[f].size;
    uint8_t acc = 0;
    for (int f = 0; f < files->n_files; f++) {
        const st_mapped_file *mf = &files->files[f];
        if (!mf->data) continue;
        for (uint64_t off = 0; off < mf->size; off += 4096) {
            acc ^= ((const volatile uint8_t *)mf->data)[off];
            if (progress && ((off >> 12) & 1023) == 0) progress(user, done + off, total);
        }
        done += mf->size;
    }
    volatile uint8_t sink = acc; /* the reads stay */
    (void)sink;
    return STRATA_OK;
}

strata_status strata_model_info_get(const strata_model *m, strata_model_info *out) {
    if (!m || !out) return st_err(STRATA_ERR_INVALID_ARG, "strata_model_info_get: %s is NULL", m ? "out" : "model");
    const st_config *c = &m->files->config;
    memset(out, 0, sizeof *out);
    out->vocab_size = c->vocab_size;
    out->tokenizer_vocab_size = st_tokenizer_vocab_size(m->tok);
    out->n_layers = c->n_layers;
    out->hidden_size = c->hidden_size;
    out->intermediate_size = c->intermediate_size;
    out->n_heads = c->n_heads;
    out->n_kv_heads = c->n_kv_heads;
    out->head_dim = c->head_dim;
    out->context_length = c->max_position_embeddings;
    out->rope_linear_factor = c->rope_scaling == ST_ROPE_SCALING_LINEAR && c->rope_factor > 1 ? c->rope_factor : 1.0;
    out->context_limit = (int64_t)((double)c->max_position_embeddings * out->rope_linear_factor);
    out->bos_id = st_tokenizer_bos(m->tok);
    out->eos_id = st_tokenizer_eos(m->tok);
    out->backend = m->be->kind == ST_BACKEND_CUDA ? "cuda" : "cpu";
    out->kv_dtype = st_kv_dtype_name(m->ep.kv_dtype);
    if (m->eng) {
        const st_engine_params *ep = st_engine_get_params(m->eng);
        out->max_batch = ep->max_batch;
        out->max_seq_len = ep->max_model_len;
    }
    out->chat_template = st_chat_kind_name(m->tpl.kind);
    out->chat_wants_date = m->tpl.date != NULL && m->tpl.date_from_clock;
    return STRATA_OK;
}

strata_status strata_model_sampling_defaults(const strata_model *m, strata_sampling_defaults *out) {
    if (!m || !out)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_model_sampling_defaults: %s is NULL", m ? "out" : "model");
    memset(out, 0, sizeof *out);
    st_sampling_defaults sd;
    const strata_status st = st_sampling_defaults_read(m->files, &sd);
    if (st != STRATA_OK) return st;
    out->has_temperature = sd.has_temperature;
    out->has_top_p = sd.has_top_p;
    out->has_top_k = sd.has_top_k;
    out->has_min_p = sd.has_min_p;
    out->has_repetition_penalty = sd.has_repetition_penalty;
    out->temperature = sd.temperature;
    out->top_p = sd.top_p;
    out->top_k = sd.top_k;
    out->min_p = sd.min_p;
    out->repetition_penalty = sd.repetition_penalty;
    snprintf(out->source, sizeof out->source, "%s", sd.source);
    return STRATA_OK;
}

strata_status strata_engine_info_get(const strata_model *m, strata_engine_info *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "strata_engine_info_get: out is NULL");
    strata_status st = need_engine(m, "strata_engine_info_get");
    if (st) return st;
    const st_engine_params *ep = st_engine_get_params(m->eng);
    const st_engine_costs *c = st_engine_get_costs(m->eng);
    out->max_batch = ep->max_batch;
    out->max_seq_len = ep->max_model_len;
    out->prefill_chunk = ep->prefill_chunk;
    out->step_tokens = ep->step_tokens;
    out->max_waiting = ep->max_waiting;
    out->kv_block_size = ep->kv_block_size;
    out->kv_blocks = ep->kv_blocks;
    out->kv_dtype = st_kv_dtype_name(ep->kv_dtype);
    out->prefix_cache = !ep->disable_prefix_cache;
    out->host_sample = ep->host_sample;
    out->kv_offload = st_kv_offload_name(ep->kv_offload);
    st_engine_metrics *em = st_malloc(sizeof *em);
    if (!em)
        return st_err(STRATA_ERR_NOMEM, "strata_engine_info_get: out of memory for the metrics (%zu bytes)",
                      sizeof *em);
    st_engine_metrics_get(m->eng, em);
    if (em->kv_tiers) {
        out->kv_host_blocks = em->kv_tier.host_blocks;
        out->kv_ssd_blocks = em->kv_tier.ssd_slots;
        out->kv_ssd_found = em->kv_tier.ssd_found_at_start;
        out->kv_block_bytes = (double)em->kv_tier.block_bytes;
    }
    st_free(em);
    out->weight_bytes = c->weight_bytes;
    out->kv_bytes_per_token = c->kv_bytes_per_token;
    out->flops_per_token = c->flops_per_token;
    out->attn_flops_per_pair = c->attn_flops_per_pair;
    st_engine_kv_layout(m->eng, &out->kv_layers, &out->kv_layer_bytes, &out->kv_identity);
    out->kv_landing_blocks = st_engine_kv_landing_blocks(m->eng);
    out->spec = ep->spec.mode == ST_SPEC_LOOKUP  ? STRATA_SPEC_LOOKUP
                : ep->spec.mode == ST_SPEC_DRAFT ? STRATA_SPEC_DRAFT
                                                 : STRATA_SPEC_OFF;
    out->spec_k = ep->spec.mode == ST_SPEC_OFF ? 0 : ep->spec.k_max;
    return STRATA_OK;
}

/* ---- prefill / decode disaggregation ------------------------------------------------------------*/
strata_status strata_host_alloc(strata_model *m, size_t bytes, void **out) {
    if (out) *out = NULL;
    if (!m || !out || bytes == 0) return st_err(STRATA_ERR_INVALID_ARG, "strata_host_alloc: bad arguments");
    return m->be->ops->host_alloc(m->be, bytes, out);
}

void strata_host_free(strata_model *m, void *p) {
    if (m && p) m->be->ops->host_dealloc(m->be, p);
}

strata_status strata_device_alloc(strata_model *m, size_t bytes, void **out) {
    if (out) *out = NULL;
    if (!m || !out || bytes == 0) return st_err(STRATA_ERR_INVALID_ARG, "strata_device_alloc: bad arguments");
    return m->be->ops->alloc(m->be, bytes, out);
}

void strata_device_free(strata_model *m, void *p) {
    if (m && p) m->be->ops->dealloc(m->be, p);
}

typedef struct {
    void (*fn)(void *user, strata_status st, const strata_kv_reservation *res);
    void *user;
} reserve_rec;

static void on_reserved(void *user, strata_status st, const st_engine_kv_reservation *r) {
    reserve_rec *rr = user;
    if (st || !r) {
        rr->fn(rr->user, st ? st : STRATA_ERR_INTERNAL, NULL);
    } else {
        const strata_kv_reservation out = {.ticket = r->ticket, .n_tokens = r->n_tokens,
                                           .block_tokens = r->block_tokens, .cached_blocks = r->cached_blocks,
                                           .n_blocks = r->n_blocks, .n_layers = r->n_layers,
                                           .layer_bytes = r->layer_bytes, .blocks = r->blocks,
                                           .landing = r->landing, .landing_stride = r->landing_stride};
        rr->fn(rr->user, STRATA_OK, &out);
    }
    st_free(rr);
}

strata_status strata_kv_reserve(strata_model *m, const int32_t *ids, size_t n,
                                void (*fn)(void *user, strata_status st, const strata_kv_reservation *res),
                                void *user) {
    strata_status st = need_engine(m, "strata_kv_reserve");
    if (st) return st;
    if (!ids || n == 0 || n > (size_t)INT64_MAX || !fn)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_kv_reserve: no ids or callback");
    reserve_rec *rr = st_malloc(sizeof *rr);
    if (!rr) return st_err(STRATA_ERR_NOMEM, "strata_kv_reserve: out of memory for its state (%zu bytes)", sizeof *rr);
    *rr = (reserve_rec){fn, user};
    st = st_engine_kv_reserve(m->eng, ids, (int64_t)n, on_reserved, rr);
    if (st) st_free(rr);
    return st;
}

strata_status strata_kv_resolve(strata_model *m, uint64_t ticket, bool adopt) {
    strata_status st = need_engine(m, "strata_kv_resolve");
    return st ? st : st_engine_kv_resolve(m->eng, ticket, adopt);
}

/* ---- tokenizer ---------------------------------------------------------------------------*/
/* Copies n bytes of src (+ a NUL) into buf[cap]; NOMEM (naming `fn`) when they do not fit. */
static strata_status put_text(const char *fn, const char *src, size_t n, char *buf, size_t cap, size_t *len) {
    *len = n;
    if (cap < n + 1)
        return st_err(STRATA_ERR_NOMEM, "%s: %zu bytes of text (+ 1 for the NUL) do not fit in %zu", fn, n, cap);
    memcpy(buf, src, n);
    buf[n] = '\0';
    return STRATA_OK;
}

strata_status strata_tokenize(const strata_model *m, const char *text, bool add_special, bool parse_special,
                              int32_t *ids, size_t cap, size_t *n) {
    if (n) *n = 0;
    if (!m || !text || !n || (!ids && cap > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "strata_tokenize: %s is NULL",
                      !m ? "model" : !text ? "text" : !n ? "n" : "ids (with cap > 0)");
    int32_t *got = NULL;
    int64_t k = 0;
    strata_status st = st_tokenizer_encode(m->tok, text, strlen(text), add_special, parse_special, &got, &k);
    if (st) return st;
    *n = (size_t)k;
    if ((size_t)k > cap) st = st_err(STRATA_ERR_NOMEM, "strata_tokenize: %lld ids do not fit in %zu", (long long)k, cap);
    else if (k > 0) memcpy(ids, got, (size_t)k * sizeof *ids);
    st_free(got);
    return st;
}

strata_status strata_tokenize_alloc(const strata_model *m, const char *text, bool add_special, bool parse_special,
                                    int32_t **ids, size_t *n) {
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!m || !text || !ids || !n)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_tokenize_alloc: %s is NULL",
                      !m ? "model" : !text ? "text" : !ids ? "ids" : "n");
    int32_t *got = NULL; /* st_malloc'd: plain malloc (core.h), so the caller's free() releases it */
    int64_t k = 0;
    strata_status st = st_tokenizer_encode(m->tok, text, strlen(text), add_special, parse_special, &got, &k);
    if (st) return st;
    if (k == 0) {
        st_free(got);
        got = NULL;
    }
    *ids = got;
    *n = (size_t)k;
    return STRATA_OK;
}

strata_status strata_detokenize(const strata_model *m, const int32_t *ids, size_t n, char *buf, size_t cap,
                                size_t *len) {
    if (len) *len = 0;
    if (!m || !len || (!ids && n > 0) || (!buf && cap > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "strata_detokenize: %s is NULL",
                      !m ? "model" : !len ? "len" : !buf && cap > 0 ? "buf (with cap > 0)" : "ids (with n > 0)");
    if (n > (size_t)INT64_MAX) return st_err(STRATA_ERR_INVALID_ARG, "strata_detokenize: n %zu", n);
    if (n == 0) return put_text("strata_detokenize", "", 0, buf, cap, len);
    char *text = NULL;
    size_t tl = 0;
    strata_status st = st_tokenizer_decode_len(m->tok, ids, (int64_t)n, false, &text, &tl);
    if (st) return st;
    st = put_text("strata_detokenize", text, tl, buf, cap, len);
    st_free(text);
    return st;
}

/* ---- chat template ---------------------------------------------------------------------------*/
strata_status strata_chat_template(const strata_model *m, const char **name) {
    if (name) *name = "none";
    if (!m || !name) return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_template: %s is NULL", m ? "name" : "model");
    *name = st_chat_kind_name(m->tpl.kind);
    if (!m->tpl_set && m->own_status != STRATA_OK) return st_err(m->own_status, "%s", m->own_error);
    return STRATA_OK;
}

strata_status strata_chat_set_template(strata_model *m, const char *name) {
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_set_template: model is NULL");
    st_chat_template next = {0};
    strata_status st;
    if (!name) {
        if ((st = tpl_copy(&m->own, &next))) return st;
    } else {
        st_chat_kind k;
        if (!st_chat_kind_from_name(name, &k))
            return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_set_template: '%s' is not one of chatml, llama3, llama2, none",
                          name);
        if (k != ST_CHAT_NONE && m->own.kind == k) {
            if ((st = tpl_copy(&m->own, &next))) return st; /* same family: the template's details kept */
        } else {
            next.kind = k;
        }
    }
    st_chat_template_clear(&m->tpl);
    m->tpl = next;
    m->tpl_set = name != NULL;
    return STRATA_OK;
}

strata_status strata_chat_set_date(strata_model *m, const char *date) {
    if (!m || !date) return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_set_date: %s is NULL", m ? "date" : "model");
    if (!m->tpl.date) return STRATA_OK;
    char *d = st_strdup(date);
    if (!d)
        return st_err(STRATA_ERR_NOMEM, "strata_chat_set_date: out of memory for the date (%zu bytes)",
                      strlen(date) + 1);
    st_free(m->tpl.date);
    m->tpl.date = d;
    return STRATA_OK;
}

/* The checks shared by strata_chat_apply and strata_chat_tokenize, then the
 * formatting (*spans NULL: not wanted). */
static strata_status chat_format(const char *fn, const strata_model *m, const char *const *roles,
                                 const char *const *contents, size_t n, bool add_generation_prompt, char **text,
                                 size_t **spans, int64_t *n_spans) {
    if (n == 0 || n > (size_t)INT32_MAX) return st_err(STRATA_ERR_INVALID_ARG, "%s: %zu messages (1 or more)", fn, n);
    if (m->tpl.kind == ST_CHAT_NONE) {
        if (!m->tpl_set && m->own_status != STRATA_OK) return st_err(m->own_status, "%s", m->own_error);
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: %s", fn,
                      m->tpl_set ? "the chat format is set to none" : "the model has no chat template");
    }
    for (size_t i = 0; i < n; i++)
        if (!roles[i] || !contents[i])
            return st_err(STRATA_ERR_INVALID_ARG, "%s: message %zu: %s is NULL", fn, i, !roles[i] ? "role" : "content");
    st_chat_msg *msgs = st_calloc(n, sizeof *msgs);
    if (!msgs) return st_err(STRATA_ERR_NOMEM, "%s: out of memory", fn);
    for (size_t i = 0; i < n; i++) msgs[i] = (st_chat_msg){roles[i], contents[i]};
    strata_status st = st_chat_format_spans(&m->tpl, msgs, (int64_t)n, add_generation_prompt, text, spans, n_spans);
    st_free(msgs);
    return st;
}

strata_status strata_chat_apply(const strata_model *m, const char *const *roles, const char *const *contents,
                                size_t n, bool add_generation_prompt, char *buf, size_t cap, size_t *len) {
    if (len) *len = 0;
    if (!m || !roles || !contents || !len || (!buf && cap > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_apply: %s is NULL",
                      !m ? "model" : !roles ? "roles" : !contents ? "contents" : !len ? "len" : "buf (with cap > 0)");
    char *text = NULL;
    strata_status st = chat_format("strata_chat_apply", m, roles, contents, n, add_generation_prompt, &text, NULL, NULL);
    if (st) return st;
    st = put_text("strata_chat_apply", text, strlen(text), buf, cap, len);
    st_free(text);
    return st;
}

strata_status strata_chat_tokenize(const strata_model *m, const char *const *roles, const char *const *contents,
                                   size_t n, bool add_generation_prompt, int32_t *ids, size_t cap, size_t *n_ids) {
    if (n_ids) *n_ids = 0;
    if (!m || !roles || !contents || !n_ids || (!ids && cap > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "strata_chat_tokenize: %s is NULL",
                      !m ? "model" : !roles ? "roles" : !contents ? "contents" : !n_ids ? "n_ids" : "ids (with cap > 0)");
    char *text = NULL;
    size_t *spans = NULL;
    int64_t n_spans = 0;
    strata_status st = chat_format("strata_chat_tokenize", m, roles, contents, n, add_generation_prompt, &text,
                                   &spans, &n_spans);
    if (st) return st;
    int32_t *got = NULL;
    int64_t k = 0;
    st = st_tokenizer_encode_spans(m->tok, text, strlen(text), false, spans, n_spans, &got, &k);
    st_free(text);
    st_free(spans);
    if (st) return st;
    *n_ids = (size_t)k;
    if ((size_t)k > cap) st = st_err(STRATA_ERR_NOMEM, "strata_chat_tokenize: %lld ids do not fit in %zu", (long long)k, cap);
    else if (k > 0) memcpy(ids, got, (size_t)k * sizeof *ids);
    st_free(got);
    return st;
}

/* ---- generation ----------------------------------------------------------------------------------*/
/* The record an accepted request carries: the caller's callbacks. Freed
 * after its on_finish (which the engine calls exactly once, last). */
typedef struct {
    strata_callbacks cb;
} req_rec;

static void rec_on_text(void *user, const char *text, size_t len) {
    req_rec *r = user;
    if (r->cb.on_text) r->cb.on_text(r->cb.user, text, len);
}

static void rec_on_finish(void *user, const st_finish_info *f) {
    req_rec *r = user;
    if (r->cb.on_finish) {
        const strata_finish fin = {
            .reason = (strata_finish_reason)f->reason,
            .detail = st_finish_detail(f),
            .stop_string = f->stop_string,
            .prompt_tokens = f->prompt_tokens,
            .completion_tokens = f->completion_tokens,
            .cached_tokens = f->cached_tokens,
            .queue_s = f->queue_s,
            .ttft_s = f->ttft_s,
            .total_s = f->total_s,
            .error = f->error,
        };
        r->cb.on_finish(r->cb.user, &fin);
    }
    st_free(r);
}

static void *rec_kv_buffer(void *user, size_t bytes) {
    req_rec *r = user;
    return r->cb.kv_buffer ? r->cb.kv_buffer(r->cb.user, bytes) : NULL;
}

static void rec_on_kv(void *user, const st_kv_piece *p) {
    req_rec *r = user;
    const strata_kv_piece pc = {.layer = p->layer, .first_block = p->first_block, .n_blocks = p->n_blocks,
                                .data = p->data, .bytes = p->bytes};
    r->cb.on_kv(r->cb.user, &pc);
}

static strata_status need_engine(const strata_model *m, const char *fn) {
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "%s: model is NULL", fn);
    if (!m->eng)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: the model has no engine (strata_model_create_engine)", fn);
    return STRATA_OK;
}

strata_status strata_submit(strata_model *m, const strata_request_params *params, const strata_callbacks *cb,
                            uint64_t *id) {
    if (id) *id = 0;
    strata_status st = need_engine(m, "strata_submit");
    if (st) return st;
    if (!params || !cb || !id)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_submit: %s is NULL", !params ? "params" : !cb ? "callbacks" : "id");
    const strata_request_params *p = params;
    const bool has_ids = p->prompt_ids != NULL || p->n_prompt_ids > 0, has_text = p->prompt_text != NULL;
    if (has_ids == has_text)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_submit: give the prompt as %s",
                      has_ids ? "ids or text, not both" : "ids (prompt_ids) or text (prompt_text)");
    if (has_ids && (!p->prompt_ids || p->n_prompt_ids == 0))
        return st_err(STRATA_ERR_INVALID_ARG, "the prompt is empty (%s)", p->prompt_ids ? "n_prompt_ids 0" : "prompt_ids NULL");
    if (p->n_prompt_ids > (size_t)INT64_MAX || p->n_stop > (size_t)INT_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "strata_submit: n_prompt_ids %zu / n_stop %zu", p->n_prompt_ids, p->n_stop);
    if (p->n_stop > 0 && !p->stop) return st_err(STRATA_ERR_INVALID_ARG, "stop: NULL list of %zu strings", p->n_stop);
    if (p->max_tokens < 0) return st_err(STRATA_ERR_INVALID_ARG, "max_tokens %lld < 0", (long long)p->max_tokens);

    int32_t *ids = NULL;
    int64_t n_ids = (int64_t)p->n_prompt_ids;
    if (has_text) {
        st = st_tokenizer_encode(m->tok, p->prompt_text, strlen(p->prompt_text), !p->text_no_add_special, true, &ids,
                                 &n_ids);
        if (st) return st;
    }
    st_sampler_params sp = st_sampler_params_default();
    sp.temperature = p->temperature;
    sp.top_k = p->top_k;
    sp.top_p = p->top_p == 0.0f ? 1.0f : p->top_p;
    sp.min_p = p->min_p;
    sp.repeat_penalty = p->repetition_penalty == 0.0f ? 1.0f : p->repetition_penalty;
    sp.repeat_last_n = p->repeat_last_n;
    sp.seed = p->seed;
    const st_engine_request rq = {.prompt = has_text ? ids : p->prompt_ids,
                                  .n_prompt = n_ids,
                                  .sampler = sp,
                                  .max_tokens = p->max_tokens,
                                  .stop = p->stop,
                                  .n_stop = (int)p->n_stop,
                                  .ignore_eos = p->ignore_eos,
                                  .prefill_only = p->prefill_only,
                                  .export_kv = p->export_kv,
                                  .export_from_block = p->export_from_block,
                                  .kv_ticket = p->kv_ticket};
    if (p->export_kv && (!cb->kv_buffer || !cb->on_kv)) {
        st_free(ids);
        return st_err(STRATA_ERR_INVALID_ARG, "export_kv: the callbacks need kv_buffer and on_kv");
    }
    req_rec *rec = st_calloc(1, sizeof *rec);
    if (!rec) {
        st_free(ids);
        return st_err(STRATA_ERR_NOMEM, "strata_submit: out of memory for the request (%zu bytes)", sizeof *rec);
    }
    rec->cb = *cb;
    const st_engine_callbacks ecb = {.on_text = rec_on_text, .on_finish = rec_on_finish, .user = rec,
                                     .kv_buffer = p->export_kv ? rec_kv_buffer : NULL,
                                     .on_kv = p->export_kv ? rec_on_kv : NULL};
    st = st_engine_add(m->eng, &rq, &ecb, id);
    st_free(ids);
    if (st) st_free(rec); /* refused: no callback will ever run */
    return st;
}

strata_status strata_abort(strata_model *m, uint64_t id) {
    strata_status st = need_engine(m, "strata_abort");
    return st ? st : st_engine_abort(m->eng, id);
}

strata_status strata_step(strata_model *m, bool *worked) {
    if (worked) *worked = false;
    strata_status st = need_engine(m, "strata_step");
    if (st) return st;
    if (atomic_load(&m->thread_on))
        return st_err(STRATA_ERR_INVALID_ARG, "strata_step: the engine thread runs (strata_start); it steps the engine");
    return st_engine_step(m->eng, worked);
}

strata_status strata_start(strata_model *m) {
    strata_status st = need_engine(m, "strata_start");
    if (st) return st;
    if ((st = st_engine_start(m->eng))) return st;
    atomic_store(&m->thread_on, true);
    return STRATA_OK;
}

strata_status strata_stop(strata_model *m) {
    strata_status st = need_engine(m, "strata_stop");
    if (st) return st;
    st_engine_stop(m->eng);
    atomic_store(&m->thread_on, false);
    return STRATA_OK;
}

const char *strata_finish_reason_str(strata_finish_reason r) {
    return (int)r >= 0 && (int)r < STRATA_FINISH_COUNT ? st_finish_reason_name((st_finish_reason)r) : "?";
}

/* ---- metrics -----------------------------------------------------------------------------------*/
static void hist_copy(const st_engine_hist *h, strata_histogram *out) {
    out->n_bounds = h->n_bounds;
    memcpy(out->bounds, h->bounds, sizeof out->bounds);
    memcpy(out->counts, h->counts, sizeof out->counts);
    out->count = h->count;
    out->sum = h->sum;
}

strata_status strata_metrics_get(strata_model *m, strata_metrics *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "strata_metrics_get: out is NULL");
    strata_status st = need_engine(m, "strata_metrics_get");
    if (st) return st;
    st_engine_metrics *e = st_malloc(sizeof *e); /* ~1.3 KB: not on a caller's (callback's) stack */
    if (!e) return st_err(STRATA_ERR_NOMEM, "strata_metrics_get: out of memory for the metrics (%zu bytes)", sizeof *e);
    st_engine_metrics_get(m->eng, e);
    out->running = e->running;
    out->waiting = e->waiting;
    out->max_batch = e->max_batch;
    out->max_seq_len = e->max_model_len;
    out->requests_added = e->requests_added;
    for (int i = 0; i < STRATA_FINISH_COUNT; i++) out->requests_finished[i] = e->requests_finished[i];
    out->prompt_tokens = e->prompt_tokens;
    out->generation_tokens = e->generation_tokens;
    out->steps = e->steps;
    out->step_tokens = e->step_tokens;
    out->step_seconds = e->step_seconds;
    out->forward_seconds = e->forward_seconds;
    out->decode_steps = e->decode_steps;
    out->decode_tokens = e->decode_tokens;
    out->decode_kv_tokens = e->decode_kv_tokens;
    out->decode_seconds = e->decode_seconds;
    out->preemptions = e->preemptions;
    out->kv_block_size = e->kv_block_size;
    out->kv_blocks_used = e->kv_blocks_used;
    out->kv_blocks_total = e->kv_blocks_total;
    out->prefix_cache_queries = e->prefix_cache_queries;
    out->prefix_cache_hits = e->prefix_cache_hits;
    out->prefix_cache_hits_device = e->prefix_hits_device;
    out->prefix_cache_hits_host = e->prefix_hits_host;
    out->prefix_cache_hits_ssd = e->prefix_hits_ssd;
    out->kv_device_used = e->kv_blocks_used;
    out->kv_device_cached = e->kv_blocks_cached;
    out->kv_device_free = e->kv_blocks_free;
    if (e->kv_tiers) {
        const st_kv_tiers_stats *t = &e->kv_tier;
        out->kv_host_used = t->host_busy;
        out->kv_host_cached = t->host_cached - t->host_busy > 0 ? t->host_cached - t->host_busy : 0;
        out->kv_host_free = t->host_blocks - t->host_cached;
        out->kv_ssd_used = t->ssd_busy;
        out->kv_ssd_cached = t->ssd_cached;
        out->kv_ssd_free = t->ssd_slots - t->ssd_cached - t->ssd_busy - t->ssd_bad;
        out->kv_bytes_device_to_host = (int64_t)t->bytes_d2h;
        out->kv_bytes_host_to_device = (int64_t)t->bytes_h2d;
        out->kv_bytes_host_to_ssd = (int64_t)t->bytes_h2ssd;
        out->kv_bytes_ssd_to_host = (int64_t)t->bytes_ssd2h;
    }
    out->kv_swaps = e->kv_swaps;
    out->spec_drafted = e->spec_drafted;
    out->spec_accepted = e->spec_accepted;
    out->pd_adopted = e->pd_adopted;
    out->pd_cancelled = e->pd_cancelled;
    hist_copy(&e->ttft, &out->ttft);
    hist_copy(&e->tbt, &out->tbt);
    hist_copy(&e->e2e, &out->e2e);
    st_free(e);
    return STRATA_OK;
}

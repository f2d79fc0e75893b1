/* Hugging Face config.json -> st_config for Llama models.
 *
 * Keys read (transformers LlamaConfig; defaults as in transformers):
 *   model_type "llama" and/or architectures ["LlamaForCausalLM"] (one required)
 *   vocab_size, hidden_size, intermediate_size, num_hidden_layers,
 *   num_attention_heads                        required, > 0
 *   num_key_value_heads                        default num_attention_heads
 *   head_dim                                   default hidden_size / heads (null ok)
 *   max_position_embeddings                    default 2048
 *   rms_norm_eps                               default 1e-6
 *   rope_theta                                 default 10000
 *   tie_word_embeddings                        default false
 *   bos_token_id (int|null), eos_token_id (int|[int...]|null)
 *   attention_bias, mlp_bias                   must be false (no bias support)
 *   hidden_act                                 "silu" when present
 * RoPE scaling, two spellings:
 *   transformers v4: "rope_scaling": null | {"rope_type" (or "type"):
 *       "default" | "linear" (factor) | "llama3" (factor, low_freq_factor,
 *       high_freq_factor, original_max_position_embeddings)}
 *   transformers v5: "rope_parameters": {"rope_type": ..., "rope_theta": ...,
 *       the same scaling keys}; its rope_theta overrides the top-level one.
 * When both are present, rope_parameters wins.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/json.h"
#include "loader/loader.h"

#define CFG_MAX_TOKEN_ID 2147483647

static strata_status cfg_positive(const char *path, const char *key, int64_t v) {
    if (v <= 0)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be positive, got %lld", path, key,
                      (long long)v);
    return STRATA_OK;
}

const st_config_keys st_config_keys_json = {
    .vocab_size = "vocab_size",
    .hidden_size = "hidden_size",
    .intermediate_size = "intermediate_size",
    .n_layers = "num_hidden_layers",
    .n_heads = "num_attention_heads",
    .n_kv_heads = "num_key_value_heads",
    .head_dim = "head_dim",
    .max_position_embeddings = "max_position_embeddings",
    .rms_norm_eps = "rms_norm_eps",
    .rope_theta = "rope_theta",
    .rope_factor = "rope_scaling.factor",
    .rope_dim = "partial_rotary_factor",
    .bos_token_id = "bos_token_id",
    .eos_token_id = "eos_token_id",
};

const st_config_keys st_config_keys_gguf = {
    .vocab_size = "llama.vocab_size",
    .hidden_size = "llama.embedding_length",
    .intermediate_size = "llama.feed_forward_length",
    .n_layers = "llama.block_count",
    .n_heads = "llama.attention.head_count",
    .n_kv_heads = "llama.attention.head_count_kv",
    .head_dim = "llama.attention.key_length",
    .max_position_embeddings = "llama.context_length",
    .rms_norm_eps = "llama.attention.layer_norm_rms_epsilon",
    .rope_theta = "llama.rope.freq_base",
    .rope_factor = "llama.rope.scaling.factor",
    .rope_dim = "llama.rope.dimension_count",
    .bos_token_id = "tokenizer.ggml.bos_token_id",
    .eos_token_id = "tokenizer.ggml.eos_token_id",
};

static strata_status chk_dim(const char *path, const char *key, int64_t v) {
    if (v <= 0)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be positive, got %lld", path, key,
                      (long long)v);
    if (v > ST_CONFIG_MAX_DIM)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %lld is out of range (at most %lld)", path,
                      key, (long long)v, (long long)ST_CONFIG_MAX_DIM);
    return STRATA_OK;
}

static strata_status chk_token(const char *path, const char *key, int64_t id, int64_t vocab) {
    if (id < 0 || id >= vocab)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: '%s' = %lld is not a valid token id: outside the vocabulary of %lld "
                      "tokens", path, key, (long long)id, (long long)vocab);
    return STRATA_OK;
}

strata_status st_config_check(const st_config *c, const char *path, const st_config_keys *k,
                              int64_t rope_dim) {
    strata_status st;
    if (!c || !k) return st_err(STRATA_ERR_INVALID_ARG, "st_config_check: NULL argument");
    if (!path) path = "config";
    if ((st = chk_dim(path, k->vocab_size, c->vocab_size)) ||
        (st = chk_dim(path, k->hidden_size, c->hidden_size)) ||
        (st = chk_dim(path, k->intermediate_size, c->intermediate_size)) ||
        (st = chk_dim(path, k->n_layers, c->n_layers)) ||
        (st = chk_dim(path, k->n_heads, c->n_heads)) ||
        (st = chk_dim(path, k->n_kv_heads, c->n_kv_heads)) ||
        (st = chk_dim(path, k->head_dim, c->head_dim)))
        return st;
    if (c->n_heads % c->n_kv_heads != 0)
        return st_err(STRATA_ERR_FORMAT, "%s: %s=%lld is not a multiple of %s=%lld", path,
                      k->n_heads, (long long)c->n_heads, k->n_kv_heads, (long long)c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return st_err(STRATA_ERR_FORMAT, "%s: %s=%lld must be even for RoPE", path, k->head_dim,
                      (long long)c->head_dim);
    if (rope_dim >= 0 && rope_dim != c->head_dim)
        return st_err(STRATA_ERR_FORMAT,
                      "%s: '%s' gives %lld rotary dimensions per head, but RoPE here rotates the "
                      "whole head of %lld (%s): partial rotary embeddings are not supported",
                      path, k->rope_dim, (long long)rope_dim, (long long)c->head_dim, k->head_dim);
    if (c->max_position_embeddings < 2 || c->max_position_embeddings > ST_CONFIG_MAX_CONTEXT)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %lld is out of range [2, %lld]", path,
                      k->max_position_embeddings, (long long)c->max_position_embeddings,
                      (long long)ST_CONFIG_MAX_CONTEXT);
    if (!(c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %g is out of range (0, 1)", path,
                      k->rms_norm_eps, (double)c->rms_norm_eps);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be positive and finite, got %g", path,
                      k->rope_theta, c->rope_theta);
    if (c->rope_scaling != ST_ROPE_SCALING_NONE && (!(c->rope_factor > 0) || !isfinite(c->rope_factor)))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be positive and finite, got %g", path,
                      k->rope_factor, c->rope_factor);
    if (c->bos_token_id != -1 &&
        (st = chk_token(path, k->bos_token_id, c->bos_token_id, c->vocab_size)))
        return st;
    if (c->n_eos < 0 || c->n_eos > ST_MAX_EOS)
        return st_err(STRATA_ERR_FORMAT, "%s: %d end tokens (at most %d)", path, c->n_eos,
                      ST_MAX_EOS);
    for (int i = 0; i < c->n_eos; i++)
        if ((st = chk_token(path, k->eos_keys[i] ? k->eos_keys[i] : k->eos_token_id,
                            c->eos_token_ids[i], c->vocab_size)))
            return st;
    return STRATA_OK;
}

static strata_status cfg_token_id(const char *path, const char *name, const cJSON *it, int32_t *out) {
    int64_t v;
    strata_status st = st_json_as_int64(path, name, it, &v);
    if (st) return st;
    if (v < 0 || v > CFG_MAX_TOKEN_ID)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' = %lld is not a valid token id", path, name,
                      (long long)v);
    *out = (int32_t)v;
    return STRATA_OK;
}

static strata_status cfg_arch(const char *path, const cJSON *root) {
    st_json_where w = {path, NULL};
    const char *mt = NULL;
    strata_status st = st_json_opt_string(&w, root, "model_type", NULL, &mt);
    if (st) return st;
    if (mt && strcmp(mt, "llama") != 0)
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: model_type '%s' is not supported (only 'llama')", path, mt);
    const cJSON *arch = st_json_field(root, "architectures");
    if (arch) {
        if (!cJSON_IsArray(arch))
            return st_err(STRATA_ERR_FORMAT, "%s: 'architectures' must be an array, got %s",
                          path, st_json_type_name(arch));
        int i = 0;
        const cJSON *a;
        cJSON_ArrayForEach(a, arch) {
            if (!cJSON_IsString(a) || !a->valuestring)
                return st_err(STRATA_ERR_FORMAT, "%s: 'architectures[%d]' must be a string, got %s",
                              path, i, st_json_type_name(a));
            if (strcmp(a->valuestring, "LlamaForCausalLM") != 0)
                return st_err(STRATA_ERR_UNSUPPORTED,
                              "%s: architecture '%s' is not supported (only 'LlamaForCausalLM')",
                              path, a->valuestring);
            i++;
        }
    }
    if (!mt && !arch)
        return st_err(STRATA_ERR_NOT_FOUND,
                      "%s: missing required key 'model_type' (or 'architectures')", path);
    return STRATA_OK;
}

/* Reads one rope scaling object (v4 rope_scaling or v5 rope_parameters). */
static strata_status cfg_rope(const char *path, const char *objname, const cJSON *obj, st_config *c) {
    st_json_where w = {path, objname};
    if (!cJSON_IsObject(obj))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be an object or null, got %s", path,
                      objname, st_json_type_name(obj));
    const char *type = NULL;
    strata_status st = st_json_opt_string(&w, obj, "rope_type", NULL, &type);
    if (!st && !type) st = st_json_opt_string(&w, obj, "type", NULL, &type);
    if (st) return st;
    if (st_json_field(obj, "rope_theta")) {
        st = st_json_get_double(&w, obj, "rope_theta", &c->rope_theta);
        if (st) return st;
    }
    if (!type || strcmp(type, "default") == 0) {
        c->rope_scaling = ST_ROPE_SCALING_NONE;
        return STRATA_OK;
    }
    if (strcmp(type, "linear") == 0) {
        c->rope_scaling = ST_ROPE_SCALING_LINEAR;
        st = st_json_get_double(&w, obj, "factor", &c->rope_factor);
        if (st) return st;
        if (!(c->rope_factor > 0))
            return st_err(STRATA_ERR_FORMAT, "%s: '%s.factor' must be positive, got %g", path,
                          objname, c->rope_factor);
        return STRATA_OK;
    }
    if (strcmp(type, "llama3") == 0) {
        c->rope_scaling = ST_ROPE_SCALING_LLAMA3;
        if ((st = st_json_get_double(&w, obj, "factor", &c->rope_factor)) ||
            (st = st_json_get_double(&w, obj, "low_freq_factor", &c->rope_low_freq_factor)) ||
            (st = st_json_get_double(&w, obj, "high_freq_factor", &c->rope_high_freq_factor)) ||
            (st = st_json_get_int64(&w, obj, "original_max_position_embeddings",
                                    &c->rope_original_max_pos)))
            return st;
        if (!(c->rope_factor > 0) || !(c->rope_low_freq_factor > 0) ||
            !(c->rope_high_freq_factor > c->rope_low_freq_factor) || c->rope_original_max_pos <= 0)
            return st_err(STRATA_ERR_FORMAT,
                          "%s: '%s' llama3 parameters out of range (factor=%g, "
                          "low_freq_factor=%g, high_freq_factor=%g, "
                          "original_max_position_embeddings=%lld; need all > 0 and "
                          "high_freq_factor > low_freq_factor)",
                          path, objname, c->rope_factor, c->rope_low_freq_factor,
                          c->rope_high_freq_factor, (long long)c->rope_original_max_pos);
        return STRATA_OK;
    }
    return st_err(STRATA_ERR_UNSUPPORTED,
                  "%s: '%s.rope_type' '%s' is not supported (default, linear, llama3)", path,
                  objname, type);
}

static strata_status cfg_parse(const cJSON *root, const char *path, st_config *c, int64_t *rope_dim) {
    st_json_where w = {path, NULL};
    strata_status st;
    if (!cJSON_IsObject(root))
        return st_err(STRATA_ERR_FORMAT, "%s: top level must be a JSON object, got %s", path,
                      st_json_type_name(root));
    if ((st = cfg_arch(path, root))) return st;

    if ((st = st_json_get_int64(&w, root, "vocab_size", &c->vocab_size)) ||
        (st = st_json_get_int64(&w, root, "hidden_size", &c->hidden_size)) ||
        (st = st_json_get_int64(&w, root, "intermediate_size", &c->intermediate_size)) ||
        (st = st_json_get_int64(&w, root, "num_hidden_layers", &c->n_layers)) ||
        (st = st_json_get_int64(&w, root, "num_attention_heads", &c->n_heads)))
        return st;
    /* sizes are checked for range by st_config_check; here only what a
       derivation needs */
    if ((st = cfg_positive(path, "num_attention_heads", c->n_heads))) return st;
    if ((st = st_json_opt_int64(&w, root, "num_key_value_heads", c->n_heads, &c->n_kv_heads)))
        return st;
    if (st_json_field(root, "head_dim")) {
        if ((st = st_json_get_int64(&w, root, "head_dim", &c->head_dim))) return st;
    } else {
        if (c->hidden_size % c->n_heads != 0)
            return st_err(STRATA_ERR_FORMAT,
                          "%s: hidden_size=%lld is not a multiple of num_attention_heads=%lld "
                          "and no head_dim is given",
                          path, (long long)c->hidden_size, (long long)c->n_heads);
        c->head_dim = c->hidden_size / c->n_heads;
    }
    if ((st = st_json_opt_int64(&w, root, "max_position_embeddings", 2048,
                                &c->max_position_embeddings)))
        return st;

    double eps;
    if ((st = st_json_opt_double(&w, root, "rms_norm_eps", 1e-6, &eps))) return st;
    if (!(eps > 0 && eps < 1)) /* before the float conversion (1e-50 would become 0) */
        return st_err(STRATA_ERR_FORMAT, "%s: 'rms_norm_eps' = %g is out of range (0, 1)", path, eps);
    c->rms_norm_eps = (float)eps;
    if (!(c->rms_norm_eps > 0))
        return st_err(STRATA_ERR_FORMAT, "%s: 'rms_norm_eps' = %g is below float precision", path,
                      eps);

    /* partial rotary embeddings (other architectures' key): only 1.0 (the whole head) */
    *rope_dim = -1;
    if (st_json_field(root, "partial_rotary_factor")) {
        double prf;
        if ((st = st_json_get_double(&w, root, "partial_rotary_factor", &prf))) return st;
        if (prf != 1.0)
            return st_err(STRATA_ERR_FORMAT,
                          "%s: 'partial_rotary_factor' = %g: partial rotary embeddings are not "
                          "supported (RoPE here rotates the whole head)", path, prf);
    }

    if ((st = st_json_opt_bool(&w, root, "tie_word_embeddings", false, &c->tie_word_embeddings)))
        return st;

    bool bias;
    if ((st = st_json_opt_bool(&w, root, "attention_bias", false, &bias))) return st;
    if (bias)
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: 'attention_bias' true is not supported", path);
    if ((st = st_json_opt_bool(&w, root, "mlp_bias", false, &bias))) return st;
    if (bias) return st_err(STRATA_ERR_UNSUPPORTED, "%s: 'mlp_bias' true is not supported", path);

    const char *act;
    if ((st = st_json_opt_string(&w, root, "hidden_act", "silu", &act))) return st;
    if (strcmp(act, "silu") != 0)
        return st_err(STRATA_ERR_UNSUPPORTED,
                      "%s: 'hidden_act' '%s' is not supported (only 'silu')", path, act);

    /* RoPE */
    if ((st = st_json_opt_double(&w, root, "rope_theta", 10000.0, &c->rope_theta))) return st;
    const cJSON *rp = st_json_field(root, "rope_parameters");
    const cJSON *rs = st_json_field(root, "rope_scaling");
    if (rp)
        st = cfg_rope(path, "rope_parameters", rp, c);
    else if (rs)
        st = cfg_rope(path, "rope_scaling", rs, c);
    if (st) return st;
    c->rope_interleaved = false;

    /* special tokens */
    const cJSON *bos = st_json_field(root, "bos_token_id");
    if (bos && (st = cfg_token_id(path, "bos_token_id", bos, &c->bos_token_id))) return st;
    const cJSON *eos = st_json_field(root, "eos_token_id");
    if (eos && cJSON_IsArray(eos)) {
        int n = cJSON_GetArraySize(eos);
        if (n > ST_MAX_EOS)
            return st_err(STRATA_ERR_UNSUPPORTED,
                          "%s: 'eos_token_id' lists %d ids, more than the %d supported", path, n,
                          ST_MAX_EOS);
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, eos) {
            char name[64];
            snprintf(name, sizeof name, "eos_token_id[%d]", i);
            if ((st = cfg_token_id(path, name, e, &c->eos_token_ids[i]))) return st;
            i++;
        }
        c->n_eos = i;
    } else if (eos) {
        if ((st = cfg_token_id(path, "eos_token_id", eos, &c->eos_token_ids[0]))) return st;
        c->n_eos = 1;
    }
    return STRATA_OK;
}

/* Parses `text` (NUL-terminated) into *cfg; `path` names the file in
 * messages. On success *cfg is fully written; on error it is left zeroed
 * apart from defaults, and st_last_error() names the path and the key. */
strata_status st_config_parse_json(const char *text, const char *path, st_config *cfg) {
    if (!cfg) return st_err(STRATA_ERR_INVALID_ARG, "st_config_parse_json: cfg is NULL");
    if (!path) path = "config.json";
    memset(cfg, 0, sizeof *cfg);
    cfg->bos_token_id = -1;
    if (!text) return st_err(STRATA_ERR_INVALID_ARG, "%s: no text", path);
    cJSON *root = NULL;
    strata_status st = st_json_parse(text, strlen(text), path, &root);
    if (st) return st;
    st_config c;
    memset(&c, 0, sizeof c);
    c.bos_token_id = -1;
    int64_t rope_dim = -1;
    st = cfg_parse(root, path, &c, &rope_dim);
    st_config_keys keys = st_config_keys_json;
    if (cJSON_IsObject(root) && st_json_field(root, "rope_parameters"))
        keys.rope_factor = "rope_parameters.factor";
    cJSON_Delete(root);
    if (st) return st;
    if ((st = st_config_check(&c, path, &keys, rope_dim))) return st;
    *cfg = c;
    return STRATA_OK;
}

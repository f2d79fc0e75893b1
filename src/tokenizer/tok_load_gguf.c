/* GGUF tokenizer.* metadata -> st_tokenizer.
 *
 * Keys (llama.cpp's conventions):
 *   tokenizer.ggml.model        "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE)
 *   tokenizer.ggml.pre          gpt2: "gpt2" | "llama-bpe" (also "llama3", "llama-v3") |
 *                               "smollm" | "qwen2"; absent -> "gpt2"
 *   tokenizer.ggml.tokens       [string] (required)
 *   tokenizer.ggml.token_type   [int32] 1 normal, 2 unknown, 3 control, 4 user-defined,
 *                               5 unused, 6 byte (absent: all normal)
 *   tokenizer.ggml.scores       [float32] (llama: required)
 *   tokenizer.ggml.merges       [string "A B"] (gpt2: required)
 *   tokenizer.ggml.{bos,eos,unknown,eot,eom}_token_id
 *   tokenizer.ggml.add_bos_token / add_eos_token / add_space_prefix
 *       defaults: llama add_bos, add_space_prefix; gpt2 add_bos only for llama-bpe
 *   tokenizer.chat_template
 */
#include <string.h>

#include "loader/gguf.h"
#include "tokenizer/tok_internal.h"

/* An optional token id key; absent or out of range (some files write -1 for
 * "none") leaves *out / sets it to -1. */
static strata_status opt_id(const st_gguf_meta *g, const char *key, int64_t n_vocab, int32_t *out) {
    if (st_gguf_find_key(g, key) < 0) return STRATA_OK;
    int64_t v;
    strata_status st = st_gguf_get_i64(g, key, &v);
    if (st) return st;
    *out = v < 0 || v >= n_vocab ? -1 : (int32_t)v;
    return STRATA_OK;
}

static strata_status opt_bool(const st_gguf_meta *g, const char *key, bool *out) {
    if (st_gguf_find_key(g, key) < 0) return STRATA_OK;
    return st_gguf_get_bool(g, key, out);
}

static strata_status arr_of(const st_gguf_meta *g, const char *path, const char *key,
                            uint64_t want, bool strings, int64_t *ki) {
    st_gguf_type et;
    uint64_t cnt;
    strata_status st = st_gguf_get_arr(g, key, ki, &et, &cnt);
    if (st) return st;
    if (strings ? et != ST_GGUF_TYPE_STRING : (et == ST_GGUF_TYPE_STRING || et == ST_GGUF_TYPE_ARRAY))
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' must be an array of %s, got %s elements", path, key,
                      strings ? "strings" : "numbers", st_gguf_type_name(et));
    if (want != UINT64_MAX && cnt != want)
        return st_err(STRATA_ERR_FORMAT, "%s: '%s' has %llu entries but tokenizer.ggml.tokens has %llu",
                      path, key, (unsigned long long)cnt, (unsigned long long)want);
    return STRATA_OK;
}

static strata_status load_merges(st_tokenizer *t, const st_gguf_meta *g, const char *path) {
    int64_t ki;
    uint64_t cnt;
    strata_status st;
    if (st_gguf_find_key(g, "tokenizer.ggml.merges") < 0)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: 'tokenizer.ggml.merges' is missing (needed by a "
                      "gpt2 (byte-level BPE) tokenizer)", path);
    if ((st = arr_of(g, path, "tokenizer.ggml.merges", UINT64_MAX, true, &ki))) return st;
    if ((st = st_gguf_get_arr(g, "tokenizer.ggml.merges", NULL, NULL, &cnt))) return st;
    if (cnt > INT32_MAX) return st_err(STRATA_ERR_FORMAT, "%s: too many merges", path);
    if ((st = st_pairmap_init(&t->merges, (size_t)cnt))) return st;
    for (uint64_t i = 0; i < cnt; i++) {
        const char *s;
        uint64_t len;
        if (!st_gguf_arr_str(g, ki, i, &s, &len)) {
            st = st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.merges'[%llu] is unreadable", path,
                        (unsigned long long)i);
            break;
        }
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            st = st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.merges'[%llu] = \"%.*s\" is not \"A B\"",
                        path, (unsigned long long)i, (int)(len > 100 ? 100 : len), s);
            break;
        }
        const size_t al = (size_t)(sp - s), bl = (size_t)len - al - 1;
        const char *missing;
        if ((st = st_tok_add_merge(t, s, al, sp + 1, bl, (int32_t)i, &missing))) {
            if (missing)
                st = st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.merges'[%llu] = \"%.*s\": %s is not in "
                            "tokenizer.ggml.tokens", path, (unsigned long long)i,
                            (int)(len > 100 ? 100 : len), s, missing);
            break;
        }
    }
    return st;
}

strata_status st_tok_load_gguf(const st_model_files *m, st_tokenizer **out) {
    *out = NULL;
    const st_gguf_meta *g = m->gguf;
    const char *path = m->path;
    strata_status st;
    if (!g) return st_err(STRATA_ERR_INVALID_ARG, "%s: not a GGUF model", path);
    if (st_gguf_find_key(g, "tokenizer.ggml.tokens") < 0)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: no tokenizer in this GGUF: 'tokenizer.ggml.tokens' "
                      "is missing", path);
    const char *model;
    if (st_gguf_find_key(g, "tokenizer.ggml.model") < 0)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: 'tokenizer.ggml.model' is missing", path);
    if ((st = st_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL))) return st;
    st_tok_type type;
    if (!strcmp(model, "gpt2")) type = ST_TOK_BPE;
    else if (!strcmp(model, "llama")) type = ST_TOK_SPM;
    else
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: 'tokenizer.ggml.model' = \"%s\" is not supported "
                      "(gpt2, llama)", path, model);

    st_pretok pre = ST_PRETOK_GPT2;
    if (type == ST_TOK_BPE && st_gguf_find_key(g, "tokenizer.ggml.pre") >= 0) {
        const char *p;
        if ((st = st_gguf_get_str(g, "tokenizer.ggml.pre", &p, NULL))) return st;
        if (!strcmp(p, "gpt2") || !strcmp(p, "gpt-2")) pre = ST_PRETOK_GPT2;
        else if (!strcmp(p, "llama-bpe") || !strcmp(p, "llama3") || !strcmp(p, "llama-v3"))
            pre = ST_PRETOK_LLAMA3;
        else if (!strcmp(p, "smollm")) pre = ST_PRETOK_SMOLLM;
        else if (!strcmp(p, "qwen2")) pre = ST_PRETOK_QWEN2;
        else
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: unknown pre-tokenizer 'tokenizer.ggml.pre' = "
                          "\"%s\" (supported: gpt2, llama-bpe, smollm, qwen2)", path, p);
    }

    int64_t ki_tok, ki_type = -1, ki_score = -1;
    uint64_t n;
    if ((st = arr_of(g, path, "tokenizer.ggml.tokens", UINT64_MAX, true, &ki_tok))) return st;
    if ((st = st_gguf_get_arr(g, "tokenizer.ggml.tokens", NULL, NULL, &n))) return st;
    if (n == 0 || n > INT32_MAX / 2)
        return st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.tokens' has %llu entries", path,
                      (unsigned long long)n);
    if (st_gguf_find_key(g, "tokenizer.ggml.token_type") >= 0 &&
        (st = arr_of(g, path, "tokenizer.ggml.token_type", n, false, &ki_type)))
        return st;
    if (type == ST_TOK_SPM) {
        if (st_gguf_find_key(g, "tokenizer.ggml.scores") < 0)
            return st_err(STRATA_ERR_NOT_FOUND, "%s: 'tokenizer.ggml.scores' is missing (needed by a "
                          "llama (SentencePiece) tokenizer)", path);
        if ((st = arr_of(g, path, "tokenizer.ggml.scores", n, false, &ki_score))) return st;
    }

    size_t pool = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        uint64_t len;
        if (!st_gguf_arr_str(g, ki_tok, i, &s, &len) || len > UINT32_MAX)
            return st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.tokens'[%llu] is unreadable", path,
                          (unsigned long long)i);
        pool += (size_t)len;
    }
    st_tokenizer *t;
    if ((st = st_tok_alloc(&t, type, (int64_t)n, pool, path))) return st;
    t->pre = pre;
    size_t pos = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        uint64_t len;
        st_gguf_arr_str(g, ki_tok, i, &s, &len);
        st_tok_set_text(t, (int32_t)i, s, (size_t)len, &pos);
        int64_t ty = 1;
        if (ki_type >= 0 && !st_gguf_arr_i64(g, ki_type, i, &ty)) ty = -1;
        switch (ty) {
        case 1: t->attr[i] = 0; break;
        case 2: t->attr[i] = ST_TA_UNKNOWN; break;
        case 3: t->attr[i] = ST_TA_CONTROL; break;
        case 4: t->attr[i] = ST_TA_USER; break;
        case 5: t->attr[i] = ST_TA_UNUSED; break;
        case 6: t->attr[i] = type == ST_TOK_SPM ? ST_TA_BYTE : 0; break;
        default:
            st = st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.token_type'[%llu] = %lld is not a token "
                        "type (1..6)", path, (unsigned long long)i, (long long)ty);
            goto fail;
        }
        if (ki_score >= 0) {
            double sc;
            if (!st_gguf_arr_f64(g, ki_score, i, &sc)) {
                st = st_err(STRATA_ERR_FORMAT, "%s: 'tokenizer.ggml.scores'[%llu] is unreadable", path,
                            (unsigned long long)i);
                goto fail;
            }
            t->scores[i] = (float)sc;
        }
    }
    int64_t nv = (int64_t)n;
    if ((st = opt_id(g, "tokenizer.ggml.bos_token_id", nv, &t->bos))) goto fail;
    if ((st = opt_id(g, "tokenizer.ggml.eos_token_id", nv, &t->eos))) goto fail;
    if ((st = opt_id(g, "tokenizer.ggml.unknown_token_id", nv, &t->unk))) goto fail;
    t->add_bos = type == ST_TOK_SPM || pre == ST_PRETOK_LLAMA3;
    t->add_eos = false;
    if ((st = opt_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos))) goto fail;
    if ((st = opt_bool(g, "tokenizer.ggml.add_eos_token", &t->add_eos))) goto fail;
    if (type == ST_TOK_SPM && (st = opt_bool(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix)))
        goto fail;
    if (t->unk < 0 && type == ST_TOK_SPM)
        for (int64_t i = 0; i < nv; i++)
            if (t->attr[i] & ST_TA_UNKNOWN) {
                t->unk = (int32_t)i;
                break;
            }
    if (st_gguf_find_key(g, "tokenizer.chat_template") >= 0) {
        const char *ct;
        if ((st = st_gguf_get_str(g, "tokenizer.chat_template", &ct, NULL))) goto fail;
        if (!(t->chat_template = st_strdup(ct))) {
            st = st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
            goto fail;
        }
    }
    if ((st = st_tok_finish(t, path))) goto fail;
    if (type == ST_TOK_BPE && (st = load_merges(t, g, path))) goto fail;
    if ((st = st_tok_build_stops(t))) goto fail;
    static const char *const more[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
    for (size_t k = 0; k < 2; k++) {
        int32_t id = -1;
        if ((st = opt_id(g, more[k], nv, &id))) goto fail;
        if ((st = st_tok_add_stop(t, id))) goto fail;
    }
    *out = t;
    return STRATA_OK;
fail:
    st_tokenizer_free(t);
    return st;
}

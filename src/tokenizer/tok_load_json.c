/* HF tokenizer.json (+ tokenizer_config.json) -> st_tokenizer.
 *
 * Supported: model.type "BPE" over a byte-level alphabet with
 *   normalizer: null or NFC
 *   pre_tokenizer, one of (as the real files write them):
 *     ByteLevel{use_regex: true}                                  -> gpt2
 *     Sequence[ByteLevel{use_regex: true}]                        -> gpt2
 *     Sequence[Split{pattern: {Regex: P}, behavior: Isolated}, ByteLevel{use_regex: false}]
 *         with P the GPT-2, Llama-3 or Qwen2 pattern (exact string) -> gpt2/llama3/qwen2
 *     Sequence[Digits{individual_digits: true}, ByteLevel{use_regex: true}] -> smollm
 *   decoder: ByteLevel (or absent)
 *   added_tokens: [{id, content, special}], special ones are control tokens
 *   post_processor: a TemplateProcessing (alone or in a Sequence) gives BOS
 *     (special token before $A) and EOS (after) and whether they are added.
 * tokenizer_config.json: bos_token / eos_token / unk_token (string or
 * {"content": ...}), add_bos_token, add_eos_token, chat_template (string or
 * [{name, template}], "default" preferred). Its values win over the template.
 */
#include <stdio.h>
#include <string.h>

#include "core/json.h"
#include "tokenizer/tok_internal.h"

static const char PAT_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char PAT_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char PAT_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const char *type_of(const cJSON *o) {
    const cJSON *t = st_json_field(o, "type");
    return cJSON_IsString(t) ? t->valuestring : "?";
}

/* ByteLevel{...}: checks add_prefix_space is false; *use_regex gets its flag. */
static strata_status bytelevel_opts(const char *path, const char *name, const cJSON *o,
                                    bool *use_regex) {
    st_json_where w = {path, name};
    bool aps;
    strata_status st;
    if ((st = st_json_opt_bool(&w, o, "use_regex", true, use_regex))) return st;
    if ((st = st_json_opt_bool(&w, o, "add_prefix_space", false, &aps))) return st;
    if (aps)
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: '%s.add_prefix_space' = true is not supported",
                      path, name);
    return STRATA_OK;
}

static strata_status parse_pretok(const char *path, const cJSON *root, st_pretok *out) {
    const cJSON *pt = st_json_field(root, "pre_tokenizer");
    if (!pt)
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: 'pre_tokenizer' is null; a byte-level BPE "
                      "needs a ByteLevel pre-tokenizer", path);
    const char *ty = type_of(pt);
    strata_status st;
    bool re;
    if (!strcmp(ty, "ByteLevel")) {
        if ((st = bytelevel_opts(path, "pre_tokenizer", pt, &re))) return st;
        if (!re)
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: pre_tokenizer ByteLevel with use_regex=false "
                          "alone (no split) is not supported", path);
        *out = ST_PRETOK_GPT2;
        return STRATA_OK;
    }
    if (strcmp(ty, "Sequence"))
        return st_err(STRATA_ERR_UNSUPPORTED, "%s: unknown pre_tokenizer type '%s' (supported: "
                      "ByteLevel, Sequence of Split/Digits + ByteLevel)", path, ty);
    const cJSON *items = st_json_field(pt, "pretokenizers");
    if (!cJSON_IsArray(items))
        return st_err(STRATA_ERR_FORMAT, "%s: 'pre_tokenizer.pretokenizers' must be an array", path);
    int n = cJSON_GetArraySize(items);
    char desc[160] = "";
    size_t dl = 0;
    for (int i = 0; i < n && dl < sizeof desc - 1; i++)
        dl += (size_t)snprintf(desc + dl, sizeof desc - dl, "%s%s", i ? ", " : "",
                               type_of(cJSON_GetArrayItem(items, i)));
    const cJSON *a = n > 0 ? cJSON_GetArrayItem(items, 0) : NULL;
    const cJSON *b = n > 1 ? cJSON_GetArrayItem(items, 1) : NULL;
    if (n == 1 && !strcmp(type_of(a), "ByteLevel")) {
        if ((st = bytelevel_opts(path, "pre_tokenizer.pretokenizers[0]", a, &re))) return st;
        if (re) {
            *out = ST_PRETOK_GPT2;
            return STRATA_OK;
        }
    } else if (n == 2 && !strcmp(type_of(a), "Digits") && !strcmp(type_of(b), "ByteLevel")) {
        st_json_where w = {path, "pre_tokenizer.pretokenizers[0]"};
        bool indiv;
        if ((st = st_json_opt_bool(&w, a, "individual_digits", false, &indiv))) return st;
        if ((st = bytelevel_opts(path, "pre_tokenizer.pretokenizers[1]", b, &re))) return st;
        if (!indiv)
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: pre_tokenizer Digits with "
                          "individual_digits=false is not supported", path);
        if (re) {
            *out = ST_PRETOK_SMOLLM;
            return STRATA_OK;
        }
    } else if (n == 2 && !strcmp(type_of(a), "Split") && !strcmp(type_of(b), "ByteLevel")) {
        st_json_where w = {path, "pre_tokenizer.pretokenizers[0]"};
        const cJSON *pat = st_json_field(a, "pattern");
        const cJSON *rx = st_json_field(pat, "Regex");
        const char *beh;
        bool inv;
        if ((st = st_json_opt_string(&w, a, "behavior", "Isolated", &beh))) return st;
        if ((st = st_json_opt_bool(&w, a, "invert", false, &inv))) return st;
        if ((st = bytelevel_opts(path, "pre_tokenizer.pretokenizers[1]", b, &re))) return st;
        if (!cJSON_IsString(rx))
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: 'pre_tokenizer.pretokenizers[0].pattern' "
                          "must be {\"Regex\": ...}", path);
        if (strcmp(beh, "Isolated") || inv)
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: pre_tokenizer Split with behavior '%s'%s is "
                          "not supported (Isolated only)", path, beh, inv ? " and invert" : "");
        const char *p = rx->valuestring;
        st_pretok which;
        if (!strcmp(p, PAT_GPT2)) which = ST_PRETOK_GPT2;
        else if (!strcmp(p, PAT_LLAMA3)) which = ST_PRETOK_LLAMA3;
        else if (!strcmp(p, PAT_QWEN2)) which = ST_PRETOK_QWEN2;
        else
            return st_err(STRATA_ERR_UNSUPPORTED, "%s: unknown pre-tokenizer regex "
                          "'pre_tokenizer.pretokenizers[0].pattern.Regex' = \"%.200s\" (known: the "
                          "GPT-2, Llama-3 and Qwen2 patterns)", path, p);
        if (!re) {
            *out = which;
            return STRATA_OK;
        }
    }
    return st_err(STRATA_ERR_UNSUPPORTED, "%s: unknown pre_tokenizer Sequence[%s] (supported: "
                  "[ByteLevel], [Digits, ByteLevel], [Split(Regex), ByteLevel(use_regex=false)])",
                  path, desc);
}

/* A token named in tokenizer_config.json: "text" or {"content": "text"}. */
static const char *config_token(const cJSON *cfg, const char *key) {
    const cJSON *v = st_json_field(cfg, key);
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = st_json_field(v, "content");
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static strata_status config_id(const st_tokenizer *t, const char *path, const cJSON *cfg,
                               const char *key, int32_t *id) {
    const char *s = config_token(cfg, key);
    if (!s) return STRATA_OK;
    int32_t v = st_tok_lookup(t, s, strlen(s));
    if (v < 0)
        return st_err(STRATA_ERR_NOT_FOUND, "%s: '%s' = \"%s\" is not in the vocabulary", path, key, s);
    *id = v;
    return STRATA_OK;
}

/* TemplateProcessing -> bos/eos and whether the template adds them. */
static void parse_template(const st_tokenizer *t, const cJSON *root, int32_t *bos, int32_t *eos,
                           bool *add_bos, bool *add_eos) {
    const cJSON *pp = st_json_field(root, "post_processor");
    const cJSON *tp = NULL;
    if (!strcmp(type_of(pp), "TemplateProcessing")) {
        tp = pp;
    } else if (!strcmp(type_of(pp), "Sequence")) {
        const cJSON *it;
        cJSON_ArrayForEach(it, st_json_field(pp, "processors"))
            if (!strcmp(type_of(it), "TemplateProcessing")) tp = it;
    }
    if (!tp) return;
    const cJSON *single = st_json_field(tp, "single"), *specials = st_json_field(tp, "special_tokens");
    bool seen_a = false;
    const cJSON *it;
    cJSON_ArrayForEach(it, single) {
        if (st_json_field(it, "Sequence")) {
            seen_a = true;
            continue;
        }
        const cJSON *name = st_json_field(st_json_field(it, "SpecialToken"), "id");
        if (!cJSON_IsString(name)) continue;
        int32_t id = -1;
        const cJSON *ids = st_json_field(st_json_field(specials, name->valuestring), "ids");
        const cJSON *first = cJSON_IsArray(ids) ? cJSON_GetArrayItem(ids, 0) : NULL;
        if (cJSON_IsNumber(first)) id = (int32_t)first->valuedouble;
        else id = st_tok_lookup(t, name->valuestring, strlen(name->valuestring));
        if (id < 0 || id >= t->n_vocab) continue;
        if (!seen_a) {
            *bos = id;
            *add_bos = true;
        } else {
            *eos = id;
            *add_eos = true;
        }
    }
}

static strata_status load_config(st_tokenizer *t, const char *path, const cJSON *cfg) {
    strata_status st;
    st_json_where w = {path, NULL};
    if ((st = config_id(t, path, cfg, "bos_token", &t->bos))) return st;
    if ((st = config_id(t, path, cfg, "eos_token", &t->eos))) return st;
    if ((st = config_id(t, path, cfg, "unk_token", &t->unk))) return st;
    if ((st = st_json_opt_bool(&w, cfg, "add_bos_token", t->add_bos, &t->add_bos))) return st;
    if ((st = st_json_opt_bool(&w, cfg, "add_eos_token", t->add_eos, &t->add_eos))) return st;
    const cJSON *ct = st_json_field(cfg, "chat_template");
    const char *tmpl = NULL;
    if (cJSON_IsString(ct)) {
        tmpl = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, ct) {
            const cJSON *name = st_json_field(it, "name"), *tx = st_json_field(it, "template");
            if (!cJSON_IsString(tx)) continue;
            if (!tmpl || (cJSON_IsString(name) && !strcmp(name->valuestring, "default")))
                tmpl = tx->valuestring;
        }
    } else if (ct) {
        return st_err(STRATA_ERR_FORMAT, "%s: 'chat_template' must be a string or a list, got %s",
                      path, st_json_type_name(ct));
    }
    if (tmpl && !(t->chat_template = st_strdup(tmpl)))
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory", path);
    return STRATA_OK;
}

static strata_status merge_pair(const cJSON *m, const char **a, size_t *al, const char **b,
                                size_t *bl) {
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        const char *sp = s[0] ? strchr(s + 1, ' ') : NULL;
        if (!sp) return STRATA_ERR_FORMAT;
        *a = s;
        *al = (size_t)(sp - s);
        *b = sp + 1;
        *bl = strlen(sp + 1);
        return STRATA_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2) {
        const cJSON *x = cJSON_GetArrayItem(m, 0), *y = cJSON_GetArrayItem(m, 1);
        if (!cJSON_IsString(x) || !cJSON_IsString(y)) return STRATA_ERR_FORMAT;
        *a = x->valuestring;
        *al = strlen(*a);
        *b = y->valuestring;
        *bl = strlen(*b);
        return STRATA_OK;
    }
    return STRATA_ERR_FORMAT;
}

static strata_status load_merges(st_tokenizer *t, const char *path, const cJSON *merges) {
    int n = cJSON_GetArraySize(merges);
    strata_status st;
    if ((st = st_pairmap_init(&t->merges, (size_t)n))) return st;
    int i = 0;
    const cJSON *m;
    st = STRATA_OK;
    cJSON_ArrayForEach(m, merges) {
        const char *a, *b;
        size_t al, bl;
        if (merge_pair(m, &a, &al, &b, &bl)) {
            st = st_err(STRATA_ERR_FORMAT, "%s: 'model.merges[%d]' must be \"A B\" or [\"A\", \"B\"]",
                        path, i);
            break;
        }
        const char *miss;
        if ((st = st_tok_add_merge(t, a, al, b, bl, i, &miss))) {
            if (miss)
                st = st_err(STRATA_ERR_FORMAT, "%s: 'model.merges[%d]' (\"%.*s\" + \"%.*s\"): %s is not in "
                            "model.vocab", path, i, (int)al, a, (int)bl, b, miss);
            break;
        }
        i++;
    }
    return st;
}

strata_status st_tok_load_json_file(const char *json_path, const char *config_path,
                                    st_tokenizer **out) {
    *out = NULL;
    char *text = NULL, *ctext = NULL;
    size_t len, clen;
    cJSON *root = NULL, *cfg = NULL;
    st_tokenizer *t = NULL;
    strata_status st;
    const char *path = json_path;
    if ((st = st_file_read_all(json_path, &text, &len))) goto done;
    if ((st = st_json_parse(text, len, json_path, &root))) goto done;
    if (config_path) {
        if ((st = st_file_read_all(config_path, &ctext, &clen))) goto done;
        if ((st = st_json_parse(ctext, clen, config_path, &cfg))) goto done;
        if (!cJSON_IsObject(cfg)) {
            st = st_err(STRATA_ERR_FORMAT, "%s: must hold a JSON object", config_path);
            goto done;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: must hold a JSON object", path);
        goto done;
    }

    const cJSON *model = st_json_field(root, "model");
    if (!cJSON_IsObject(model)) {
        st = st_err(model ? STRATA_ERR_FORMAT : STRATA_ERR_NOT_FOUND, "%s: 'model' %s", path,
                    model ? "must be an object" : "is missing");
        goto done;
    }
    st_json_where wm = {path, "model"};
    const char *mtype;
    if ((st = st_json_opt_string(&wm, model, "type", "BPE", &mtype))) goto done;
    if (strcmp(mtype, "BPE")) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: 'model.type' = \"%s\" is not supported (BPE only)",
                    path, mtype);
        goto done;
    }
    const cJSON *vocab = st_json_field(model, "vocab"), *merges = st_json_field(model, "merges");
    if (!vocab) {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: 'model.vocab' is missing", path);
        goto done;
    }
    if (!cJSON_IsObject(vocab)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'model.vocab' must be an object, got %s", path,
                    st_json_type_name(vocab));
        goto done;
    }
    if (!merges) {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: 'model.merges' is missing", path);
        goto done;
    }
    if (!cJSON_IsArray(merges)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'model.merges' must be an array, got %s", path,
                    st_json_type_name(merges));
        goto done;
    }
    bool byte_fallback, ignore_merges;
    const char *csp, *eow, *unk_tok;
    if ((st = st_json_opt_bool(&wm, model, "byte_fallback", false, &byte_fallback))) goto done;
    if ((st = st_json_opt_bool(&wm, model, "ignore_merges", false, &ignore_merges))) goto done;
    if ((st = st_json_opt_string(&wm, model, "continuing_subword_prefix", "", &csp))) goto done;
    if ((st = st_json_opt_string(&wm, model, "end_of_word_suffix", "", &eow))) goto done;
    if ((st = st_json_opt_string(&wm, model, "unk_token", NULL, &unk_tok))) goto done;
    if (byte_fallback || csp[0] || eow[0]) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: 'model.%s' is set: only byte-level BPE "
                    "tokenizer.json files are supported (load SentencePiece models from GGUF)", path,
                    byte_fallback ? "byte_fallback" : csp[0] ? "continuing_subword_prefix"
                                                             : "end_of_word_suffix");
        goto done;
    }
    const cJSON *norm = st_json_field(root, "normalizer");
    bool nfc = false;
    if (norm) {
        const char *nt = type_of(norm);
        const cJSON *seq = st_json_field(norm, "normalizers");
        if (!strcmp(nt, "Sequence") && cJSON_GetArraySize(seq) == 1)
            nt = type_of(cJSON_GetArrayItem(seq, 0));
        if (strcmp(nt, "NFC")) {
            st = st_err(STRATA_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported (null or NFC)",
                        path, nt);
            goto done;
        }
        nfc = true;
    }
    const cJSON *dec = st_json_field(root, "decoder");
    if (dec && strcmp(type_of(dec), "ByteLevel")) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "%s: decoder '%s' is not supported (ByteLevel only)",
                    path, type_of(dec));
        goto done;
    }
    st_pretok pre;
    if ((st = parse_pretok(path, root, &pre))) goto done;

    /* ids and the text pool size */
    const cJSON *added = st_json_field(root, "added_tokens");
    if (added && !cJSON_IsArray(added)) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'added_tokens' must be an array", path);
        goto done;
    }
    int64_t n_vocab = 0, n_tokens = 0;
    size_t pool = 0;
    const cJSON *it;
    char top_name[64] = ""; /* the entry with the largest id, for the message below */
    cJSON_ArrayForEach(it, vocab) {
        int64_t id;
        char name[64];
        snprintf(name, sizeof name, "model.vocab[\"%.40s\"]", it->string);
        if ((st = st_json_as_int64(path, name, it, &id))) goto done;
        if (id < 0 || id >= INT32_MAX / 2) {
            st = st_err(STRATA_ERR_FORMAT, "%s: '%s' = %lld is out of range", path, name, (long long)id);
            goto done;
        }
        if (id + 1 > n_vocab) {
            n_vocab = id + 1;
            snprintf(top_name, sizeof top_name, "%s", name);
        }
        pool += strlen(it->string);
        n_tokens++;
    }
    int ai = 0;
    cJSON_ArrayForEach(it, added) {
        st_json_where wa = {path, NULL};
        char pre_s[32];
        snprintf(pre_s, sizeof pre_s, "added_tokens[%d]", ai++);
        wa.prefix = pre_s;
        int64_t id;
        const char *content;
        if ((st = st_json_get_int64(&wa, it, "id", &id))) goto done;
        if ((st = st_json_get_string(&wa, it, "content", &content))) goto done;
        if (id < 0 || id >= INT32_MAX / 2) {
            st = st_err(STRATA_ERR_FORMAT, "%s: '%s.id' = %lld is out of range", path, pre_s, (long long)id);
            goto done;
        }
        if (id + 1 > n_vocab) {
            n_vocab = id + 1;
            snprintf(top_name, sizeof top_name, "%s.id", pre_s);
        }
        pool += strlen(content);
        n_tokens++;
    }
    if (n_vocab == 0) {
        st = st_err(STRATA_ERR_FORMAT, "%s: 'model.vocab' is empty", path);
        goto done;
    }
    /* Ids index dense tables (tens of bytes per id): a few tokens with huge ids
     * would take gigabytes. Gaps are allowed, up to the token count + 65536. */
    if (n_vocab > 2 * n_tokens + 65536) {
        st = st_err(STRATA_ERR_FORMAT, "%s: '%s' = %lld is too large for %lld tokens: the ids below it "
                    "would hold more gaps than tokens + 65536", path, top_name, (long long)(n_vocab - 1),
                    (long long)n_tokens);
        goto done;
    }
    if ((st = st_tok_alloc(&t, ST_TOK_BPE, n_vocab, pool, path))) goto done;
    t->pre = pre;
    t->ignore_merges = ignore_merges;
    t->nfc = nfc;
    size_t pos = 0;
    cJSON_ArrayForEach(it, vocab) {
        int32_t id = (int32_t)it->valuedouble;
        if (!(t->attr[id] & ST_TA_UNUSED)) {
            st = st_err(STRATA_ERR_FORMAT, "%s: 'model.vocab' gives id %d to both \"%.*s\" and \"%s\"",
                        path, id, (int)t->text_len[id], t->pool + t->text_off[id], it->string);
            goto done;
        }
        st_tok_set_text(t, id, it->string, strlen(it->string), &pos);
        t->attr[id] = 0;
    }
    ai = 0;
    cJSON_ArrayForEach(it, added) {
        int32_t id = (int32_t)st_json_field(it, "id")->valuedouble;
        const char *content = st_json_field(it, "content")->valuestring;
        bool special;
        st_json_where wa = {path, "added_tokens[]"};
        if ((st = st_json_opt_bool(&wa, it, "special", false, &special))) goto done;
        size_t cl = strlen(content);
        if (!(t->attr[id] & ST_TA_UNUSED) &&
            (t->text_len[id] != cl || memcmp(t->pool + t->text_off[id], content, cl) != 0)) {
            st = st_err(STRATA_ERR_FORMAT, "%s: 'added_tokens[%d]' \"%s\" has id %d, which model.vocab "
                        "gives to \"%.*s\"", path, ai, content, id, (int)t->text_len[id],
                        t->pool + t->text_off[id]);
            goto done;
        }
        if (t->attr[id] & ST_TA_UNUSED) st_tok_set_text(t, id, content, cl, &pos);
        t->attr[id] = special ? ST_TA_CONTROL : ST_TA_USER;
        ai++;
    }
    if ((st = st_tok_finish(t, path))) goto done;
    if (unk_tok) t->unk = st_tok_lookup(t, unk_tok, strlen(unk_tok));
    parse_template(t, root, &t->bos, &t->eos, &t->add_bos, &t->add_eos);
    if (cfg && (st = load_config(t, config_path, cfg))) goto done;
    if (t->unk >= 0) t->attr[t->unk] |= ST_TA_UNKNOWN;
    if ((st = load_merges(t, path, merges))) goto done;
    if ((st = st_tok_build_stops(t))) goto done;

done:
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    st_free(text);
    st_free(ctext);
    if (st) {
        st_tokenizer_free(t);
        return st;
    }
    *out = t;
    return STRATA_OK;
}

/* engine/seq: see seq.h. */
#include "engine/seq.h"

#include <stdio.h>
#include <string.h>

const char *st_finish_reason_name(st_finish_reason r) {
    switch (r) {
    case ST_FINISH_STOP: return "stop";
    case ST_FINISH_LENGTH: return "length";
    case ST_FINISH_ABORT: return "abort";
    case ST_FINISH_ERROR: return "error";
    case ST_FINISH_COUNT_: break;
    }
    return "?";
}

const char *st_finish_detail(const st_finish_info *f) {
    switch (f->reason) {
    case ST_FINISH_STOP: return f->stop_string >= 0 ? "stop_string" : "eos";
    case ST_FINISH_LENGTH: return f->context_full ? "context_full" : "max_tokens";
    case ST_FINISH_ABORT: return "abort";
    case ST_FINISH_ERROR: return "error";
    case ST_FINISH_COUNT_: break;
    }
    return "?";
}

strata_status st_seq_create(const st_request *req, const st_seq_limits *lim, const st_seq_callbacks *cb,
                            uint64_t id, st_seq **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "request: out is NULL");
    *out = NULL;
    if (!req || !lim) return st_err(STRATA_ERR_INVALID_ARG, "request: no request or limits");
    if (lim->vocab < 1 || lim->max_model_len < 2)
        return st_err(STRATA_ERR_INVALID_ARG, "request: limits: vocab %lld, max_model_len %lld",
                      (long long)lim->vocab, (long long)lim->max_model_len);
    if (req->n_prompt < 1 || !req->prompt) return st_err(STRATA_ERR_INVALID_ARG, "the prompt is empty");
    if (req->n_prompt >= lim->max_model_len)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "the prompt has %lld tokens; the context holds %lld (prompt and output together)",
                      (long long)req->n_prompt, (long long)lim->max_model_len);
    for (int64_t i = 0; i < req->n_prompt; i++)
        if (req->prompt[i] < 0 || req->prompt[i] >= lim->vocab)
            return st_err(STRATA_ERR_INVALID_ARG, "prompt token %lld: id %d is outside the vocabulary [0, %lld)",
                          (long long)i, req->prompt[i], (long long)lim->vocab);
    if (req->max_tokens < 0) return st_err(STRATA_ERR_INVALID_ARG, "max_tokens %lld < 0", (long long)req->max_tokens);
    if (req->n_stop_ids < 0 || (req->n_stop_ids > 0 && !req->stop_ids))
        return st_err(STRATA_ERR_INVALID_ARG, "stop_ids: bad list (%d ids)", req->n_stop_ids);
    if (req->n_stop < 0 || (req->n_stop > 0 && !req->stop))
        return st_err(STRATA_ERR_INVALID_ARG, "stop: bad list (%d strings)", req->n_stop);
    if (req->n_stop > 0 && !lim->tok)
        return st_err(STRATA_ERR_INVALID_ARG, "stop: stop strings need a tokenizer");
    if (req->export_kv && !req->prefill_only)
        return st_err(STRATA_ERR_INVALID_ARG, "export_kv: only a prefill-only request exports its KV");
    if (req->export_kv && (!cb || !cb->kv_buffer || !cb->on_kv))
        return st_err(STRATA_ERR_INVALID_ARG, "export_kv: the KV export needs kv_buffer and on_kv callbacks");
    if (req->export_kv && (req->export_from_block < 0 || req->export_from_block > req->n_prompt))
        return st_err(STRATA_ERR_INVALID_ARG, "export_from_block %lld: outside the prompt",
                      (long long)req->export_from_block);

    st_seq *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "request: out of memory for its state (%zu bytes)", sizeof *s);
    s->id = id;
    s->status = ST_SEQ_WAITING;
    s->n_prompt = req->n_prompt;
    s->sampling = req->sampler;
    s->max_tokens = req->max_tokens;
    s->n_cached = -1;
    s->plan = -1;
    s->prefill_only = req->prefill_only;
    s->export_from = req->export_kv ? req->export_from_block : -1;
    s->exported = s->export_from;
    s->kv_ticket = req->kv_ticket;
    s->spec.slot = -1;
    s->fin = (st_finish_info){.stop_id = -1, .stop_string = -1, .ttft_s = -1.0};
    if (cb) s->cb = *cb;
    st_block_table_init(&s->kv);
    strata_status st;
    if ((st = st_sampler_init(&req->sampler, lim->vocab, &s->sampler))) goto fail;
    if ((st = st_stop_filter_init(req->stop, req->n_stop, &s->stop))) goto fail;
    if (lim->tok && (st = st_detok_init(lim->tok, true, &s->detok))) goto fail;
    const int32_t *tok_ids = NULL;
    const int n_tok_ids = lim->tok && !req->ignore_eos ? st_tokenizer_stop_ids(lim->tok, &tok_ids) : 0;
    if (n_tok_ids + req->n_stop_ids > 0) {
        if (!(s->stop_ids = st_malloc((size_t)(n_tok_ids + req->n_stop_ids) * sizeof *s->stop_ids))) goto oom;
        for (int i = 0; i < n_tok_ids; i++) s->stop_ids[s->n_stop_ids++] = tok_ids[i];
        for (int i = 0; i < req->n_stop_ids; i++) s->stop_ids[s->n_stop_ids++] = req->stop_ids[i];
    }
    if ((st = st_seq_reserve(s, req->n_prompt + 16))) goto fail;
    memcpy(s->tokens, req->prompt, (size_t)req->n_prompt * sizeof *s->tokens);
    s->n_tokens = req->n_prompt;
    *out = s;
    return STRATA_OK;
oom:
    st = st_err(STRATA_ERR_NOMEM, "request: out of memory for a copy of its %lld prompt tokens and its options",
                (long long)req->n_prompt);
fail:
    st_seq_free(s);
    return st;
}

void st_seq_free(st_seq *s) {
    if (!s) return;
    st_block_table_free(&s->kv);
    st_free(s->tokens);
    st_sampler_free(s->sampler);
    st_free(s->stop_ids);
    st_stop_filter_free(s->stop);
    st_detok_free(s->detok);
    st_free(s->text);
    st_free(s);
}

strata_status st_seq_reserve(st_seq *s, int64_t n_tokens) {
    if (n_tokens <= s->cap) return STRATA_OK;
    int64_t cap = s->cap ? s->cap : 16;
    while (cap < n_tokens) cap *= 2;
    int32_t *t = st_realloc(s->tokens, (size_t)cap * sizeof *t);
    if (!t) return st_err(STRATA_ERR_NOMEM, "seq %llu: cannot hold %lld tokens", (unsigned long long)s->id, (long long)cap);
    s->tokens = t;
    s->cap = cap;
    return STRATA_OK;
}

void st_seq_append(st_seq *s, int32_t token) {
    ST_ASSERT(s->n_tokens < s->cap);
    s->tokens[s->n_tokens++] = token;
}

void st_seq_set_finished(st_seq *s, st_finish_reason reason, const char *error) {
    s->status = ST_SEQ_FINISHED;
    s->fin.reason = reason;
    if (reason == ST_FINISH_ERROR) {
        snprintf(s->error, sizeof s->error, "%s", error ? error : "unknown error");
        s->fin.error = s->error;
    }
}

/* ---- postprocess: stop ids, stop strings, text ------------------------------------------*/

static strata_status text_add(st_seq *s, const char *t, size_t n) {
    if (n == 0) return STRATA_OK;
    if (s->n_text + n > s->text_cap) {
        size_t cap = s->text_cap ? s->text_cap : 64;
        while (cap < s->n_text + n) cap *= 2;
        char *p = st_realloc(s->text, cap);
        if (!p) return st_err(STRATA_ERR_NOMEM, "seq %llu: out of memory for its text", (unsigned long long)s->id);
        s->text = p;
        s->text_cap = cap;
    }
    memcpy(s->text + s->n_text, t, n);
    s->n_text += n;
    return STRATA_OK;
}

/* Detokenized text through the stop filter into s->text. *stopped: a stop string appeared. */
static strata_status emit(st_seq *s, const char *t, size_t n, bool *stopped) {
    *stopped = false;
    if (n == 0) return STRATA_OK;
    const char *out;
    size_t on;
    strata_status st = st_stop_filter_push(s->stop, t, n, &out, &on, stopped);
    if (st) return st;
    return text_add(s, out, on);
}

/* The end of the output: what the detokenizer and the stop filter still
 * hold. *stopped: the held text completed a stop string. */
static strata_status emit_end(st_seq *s, bool *stopped) {
    *stopped = false;
    if (!s->detok) return STRATA_OK;
    const char *t;
    size_t n;
    strata_status st = st_detok_flush(s->detok, &t, &n);
    if (st) return st;
    if ((st = emit(s, t, n, stopped))) return st;
    if (*stopped) return STRATA_OK;
    st_stop_filter_flush(s->stop, &t, &n);
    return text_add(s, t, n);
}

strata_status st_seq_postprocess(st_seq *s, int32_t token, bool last, bool *stop) {
    *stop = false;
    bool stopped = false;
    strata_status st;
    for (int i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] == token) {
            if ((st = emit_end(s, &stopped))) return st;
            s->fin.stop_id = stopped ? -1 : token;
            s->fin.stop_string = stopped ? st_stop_filter_hit(s->stop) : -1;
            s->fin.context_full = false;
            s->fin.reason = ST_FINISH_STOP;
            *stop = true;
            return STRATA_OK;
        }
    if (s->detok) {
        const char *t;
        size_t n;
        if ((st = st_detok_push(s->detok, token, &t, &n))) return st;
        if ((st = emit(s, t, n, &stopped))) return st;
    }
    if (!stopped && last && s->status == ST_SEQ_FINISHED && (st = emit_end(s, &stopped))) return st;
    if (stopped) {
        s->fin.stop_string = st_stop_filter_hit(s->stop);
        s->fin.context_full = false;
        s->fin.reason = ST_FINISH_STOP;
        *stop = true;
    }
    return STRATA_OK;
}

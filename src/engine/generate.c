/* Generation loop for one sequence: prefill, then sample / detokenize /
 * stop-check / decode step until a stop condition. See generate.h. */
#include "engine/generate.h"

#include <string.h>

const char *st_stop_reason_name(st_stop_reason r) {
    switch (r) {
    case ST_STOP_NONE: return "none";
    case ST_STOP_MAX_TOKENS: return "max_tokens";
    case ST_STOP_EOS: return "eos";
    case ST_STOP_STRING: return "stop_string";
    case ST_STOP_CONTEXT: return "context_full";
    case ST_STOP_CALLBACK: return "callback";
    }
    return "?";
}

/* ---- stop strings -------------------------------------------------------------*/
struct st_stop_filter {
    char **stop;
    size_t *stop_len;
    int n_stop;
    char *buf; /* held text */
    size_t len, cap;
    char *out; /* what the last call releases */
    size_t out_cap;
    bool stopped;
};

void st_stop_filter_free(st_stop_filter *f) {
    if (!f) return;
    for (int i = 0; i < f->n_stop; i++) st_free(f->stop[i]);
    st_free(f->stop);
    st_free(f->stop_len);
    st_free(f->buf);
    st_free(f->out);
    st_free(f);
}

strata_status st_stop_filter_init(const char *const *stop, int n_stop, st_stop_filter **out) {
    *out = NULL;
    if (n_stop < 0 || (n_stop > 0 && !stop))
        return st_err(STRATA_ERR_INVALID_ARG, "stop strings: bad list (%d)", n_stop);
    for (int i = 0; i < n_stop; i++) {
        if (!stop[i] || !stop[i][0])
            return st_err(STRATA_ERR_INVALID_ARG, "stop string %d is empty", i + 1);
        if (!st_utf8_valid(stop[i], strlen(stop[i])))
            return st_err(STRATA_ERR_INVALID_ARG, "stop string %d is not valid UTF-8", i + 1);
    }
    st_stop_filter *f = st_calloc(1, sizeof *f);
    if (!f) return st_err(STRATA_ERR_NOMEM, "out of memory");
    f->n_stop = 0;
    if (n_stop > 0) {
        f->stop = st_calloc((size_t)n_stop, sizeof *f->stop);
        f->stop_len = st_calloc((size_t)n_stop, sizeof *f->stop_len);
        if (!f->stop || !f->stop_len) goto oom;
        for (int i = 0; i < n_stop; i++) {
            if (!(f->stop[i] = st_strdup(stop[i]))) goto oom;
            f->stop_len[i] = strlen(stop[i]);
            f->n_stop = i + 1;
        }
    }
    *out = f;
    return STRATA_OK;
oom:
    st_stop_filter_free(f);
    return st_err(STRATA_ERR_NOMEM, "out of memory");
}

static bool grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *np = st_realloc(*p, c);
    if (!np) return false;
    *p = np;
    *cap = c;
    return true;
}

/* Moves buf[0..n) to out and shifts the rest of buf down. */
static strata_status release(st_stop_filter *f, size_t n, const char **out, size_t *out_len) {
    if (!grow(&f->out, &f->out_cap, n + 1)) return st_err(STRATA_ERR_NOMEM, "out of memory");
    memcpy(f->out, f->buf, n);
    f->out[n] = '\0';
    memmove(f->buf, f->buf + n, f->len - n);
    f->len -= n;
    *out = f->out;
    *out_len = n;
    return STRATA_OK;
}

strata_status st_stop_filter_push(st_stop_filter *f, const char *text, size_t len, const char **out,
                                  size_t *out_len, bool *stopped) {
    *out = "";
    *out_len = 0;
    *stopped = f->stopped;
    if (f->stopped) return STRATA_OK;
    if (!grow(&f->buf, &f->cap, f->len + len + 1)) return st_err(STRATA_ERR_NOMEM, "out of memory");
    memcpy(f->buf + f->len, text, len);
    f->len += len;
    /* the earliest complete stop string */
    size_t first = SIZE_MAX;
    for (int i = 0; i < f->n_stop; i++) {
        const char *hit = memmem(f->buf, f->len, f->stop[i], f->stop_len[i]);
        if (hit && (size_t)(hit - f->buf) < first) first = (size_t)(hit - f->buf);
    }
    if (first != SIZE_MAX) {
        f->stopped = true;
        *stopped = true;
        f->len = first;
        return release(f, first, out, out_len);
    }
    /* hold back the longest tail that is a proper prefix of a stop string */
    size_t hold = 0;
    for (int i = 0; i < f->n_stop; i++) {
        size_t max = f->stop_len[i] - 1 < f->len ? f->stop_len[i] - 1 : f->len;
        for (size_t l = max; l > hold; l--)
            if (!memcmp(f->buf + f->len - l, f->stop[i], l)) {
                hold = l;
                break;
            }
    }
    return release(f, f->len - hold, out, out_len);
}

void st_stop_filter_flush(st_stop_filter *f, const char **out, size_t *out_len) {
    *out = "";
    *out_len = 0;
    if (f->stopped || f->len == 0) return;
    if (release(f, f->len, out, out_len) != STRATA_OK) { /* OOM: drop the tail */
        *out = "";
        *out_len = 0;
        f->len = 0;
    }
}

/* ---- the loop --------------------------------------------------------------------*/
typedef struct {
    st_generate_text_fn fn;
    void *user;
    st_stop_filter *filter;
    bool stop_string;
    bool cb_stop;
} emitter;

/* Text from the detokenizer -> stop filter -> callback. */
static strata_status emit(emitter *e, const char *text, size_t len) {
    if (len == 0 || e->stop_string || e->cb_stop) return STRATA_OK;
    const char *out;
    size_t n;
    bool stopped;
    strata_status st = st_stop_filter_push(e->filter, text, len, &out, &n, &stopped);
    if (st) return st;
    if (n > 0 && e->fn && !e->fn(out, n, e->user)) e->cb_stop = true;
    if (stopped) e->stop_string = true;
    return STRATA_OK;
}

static strata_status emit_end(emitter *e, st_detok *d) {
    const char *text;
    size_t len;
    strata_status st = st_detok_flush(d, &text, &len);
    if (st) return st;
    if ((st = emit(e, text, len))) return st;
    if (e->stop_string || e->cb_stop) return STRATA_OK;
    st_stop_filter_flush(e->filter, &text, &len);
    if (len > 0 && e->fn) e->fn(text, len, e->user);
    return STRATA_OK;
}

strata_status st_generate(st_llama *model, const st_tokenizer *tok, st_sampler *sampler,
                          const int32_t *prompt, int64_t n_prompt, const st_generate_params *params,
                          st_generate_text_fn on_text, void *user, st_generate_stats *stats) {
    memset(stats, 0, sizeof *stats);
    stats->last_token = -1;
    st_generate_params def = {0};
    const st_generate_params *p = params ? params : &def;
    const st_config *cfg = st_llama_config(model);
    const int64_t V = cfg->vocab_size;
    const int64_t n_past = st_llama_n_past(model);
    if (n_prompt < 1 || !prompt) return st_err(STRATA_ERR_INVALID_ARG, "generate: empty prompt");
    if (p->max_tokens < 0) return st_err(STRATA_ERR_INVALID_ARG, "generate: max_tokens %lld < 0", (long long)p->max_tokens);
    if (st_sampler_vocab(sampler) > V || st_sampler_vocab(sampler) > st_tokenizer_vocab_size(tok))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "generate: the sampler draws from %lld tokens but the model has %lld and the tokenizer %lld",
                      (long long)st_sampler_vocab(sampler), (long long)V,
                      (long long)st_tokenizer_vocab_size(tok));
    if (p->n_ctx > 0 && n_past + n_prompt > p->n_ctx)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "generate: a prompt of %lld tokens after %lld does not fit the context of %lld tokens",
                      (long long)n_prompt, (long long)n_past, (long long)p->n_ctx);

    const int32_t *stop_ids;
    const int n_stop_ids = st_tokenizer_stop_ids(tok, &stop_ids);
    int64_t budget = p->max_tokens > 0 ? p->max_tokens : INT64_MAX;
    if (p->n_ctx > 0 && budget > p->n_ctx - n_past - n_prompt + 1) budget = p->n_ctx - n_past - n_prompt + 1;

    strata_status st = STRATA_OK;
    float *logits = st_malloc((size_t)V * sizeof *logits);
    int64_t hist_cap = n_prompt + 256;
    int32_t *hist = st_malloc((size_t)hist_cap * sizeof *hist);
    st_detok *detok = NULL;
    emitter em = {.fn = on_text, .user = user};
    if (!logits || !hist) {
        st = st_err(STRATA_ERR_NOMEM, "generate: out of memory");
        goto done;
    }
    memcpy(hist, prompt, (size_t)n_prompt * sizeof *hist);
    int64_t n_hist = n_prompt;
    if ((st = st_detok_init(tok, !p->emit_special, &detok))) goto done;
    if ((st = st_stop_filter_init(p->stop, p->n_stop, &em.filter))) goto done;

    double t0 = st_time_now();
    if ((st = st_llama_forward(model, prompt, n_prompt, n_past, false, logits))) goto done;
    double t1 = st_time_now();
    stats->prompt_tokens = n_prompt;
    stats->prompt_s = t1 - t0;

    for (;;) {
        if (stats->gen_tokens >= budget) {
            stats->stop = p->max_tokens > 0 && stats->gen_tokens >= p->max_tokens ? ST_STOP_MAX_TOKENS
                                                                                  : ST_STOP_CONTEXT;
            break;
        }
        int32_t t;
        if ((st = st_sampler_sample(sampler, logits, hist, n_hist, &t))) break;
        stats->gen_tokens++;
        stats->last_token = t;
        bool is_stop = false;
        for (int i = 0; i < n_stop_ids; i++)
            if (stop_ids[i] == t) is_stop = true;
        if (is_stop) {
            stats->stop = ST_STOP_EOS;
            break;
        }
        if (n_hist == hist_cap) {
            int32_t *nh = st_realloc(hist, (size_t)(hist_cap * 2) * sizeof *hist);
            if (!nh) {
                st = st_err(STRATA_ERR_NOMEM, "generate: out of memory");
                break;
            }
            hist = nh;
            hist_cap *= 2;
        }
        hist[n_hist++] = t;
        const char *text;
        size_t len;
        if ((st = st_detok_push(detok, t, &text, &len))) break;
        if ((st = emit(&em, text, len))) break;
        if (em.stop_string) {
            stats->stop = ST_STOP_STRING;
            break;
        }
        if (em.cb_stop) {
            stats->stop = ST_STOP_CALLBACK;
            break;
        }
        if (stats->gen_tokens >= budget) continue; /* decided at the top, without a wasted step */
        if ((st = st_llama_forward(model, &t, 1, st_llama_n_past(model), false, logits))) break;
        stats->n_fed++;
    }
    if (!st && stats->stop != ST_STOP_STRING && stats->stop != ST_STOP_CALLBACK) st = emit_end(&em, detok);
    stats->gen_s = st_time_now() - t1;
done:
    st_stop_filter_free(em.filter);
    st_detok_free(detok);
    st_free(hist);
    st_free(logits);
    return st;
}

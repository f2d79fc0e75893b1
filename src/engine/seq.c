/* engine/seq: see seq.h. */
#include "engine/seq.h"

#include <string.h>

const char *st_seq_finish_name(st_seq_finish r) {
    switch (r) {
    case ST_SEQ_FINISH_NONE: return "none";
    case ST_SEQ_FINISH_MAX_TOKENS: return "max_tokens";
    case ST_SEQ_FINISH_CONTEXT: return "context";
    case ST_SEQ_FINISH_STOP: return "stop";
    case ST_SEQ_FINISH_ABORT: return "abort";
    }
    return "unknown";
}

strata_status st_seq_init(const st_seq_params *p, uint64_t id, uint64_t arrival, st_seq **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "seq: out is NULL");
    *out = NULL;
    if (!p) return st_err(STRATA_ERR_INVALID_ARG, "seq: params is NULL");
    if (p->n_prompt < 1 || !p->prompt)
        return st_err(STRATA_ERR_INVALID_ARG, "seq %llu: empty prompt", (unsigned long long)id);
    if (p->max_tokens < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "seq %llu: max_tokens %lld < 0", (unsigned long long)id,
                      (long long)p->max_tokens);
    for (int64_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0)
            return st_err(STRATA_ERR_INVALID_ARG, "seq %llu: prompt token %lld is %d (negative)",
                          (unsigned long long)id, (long long)i, p->prompt[i]);
    st_seq *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "seq: out of memory");
    s->id = id;
    s->arrival = arrival;
    s->state = ST_SEQ_WAITING;
    s->n_prompt = p->n_prompt;
    s->max_tokens = p->max_tokens;
    s->user = p->user;
    s->n_cached = -1;
    s->plan = -1;
    st_block_table_init(&s->kv);
    strata_status st = st_seq_reserve(s, p->n_prompt + 16);
    if (st) {
        st_seq_free(s);
        return st;
    }
    memcpy(s->tokens, p->prompt, (size_t)p->n_prompt * sizeof *s->tokens);
    s->n_tokens = p->n_prompt;
    *out = s;
    return STRATA_OK;
}

void st_seq_free(st_seq *s) {
    if (!s) return;
    st_block_table_free(&s->kv);
    st_free(s->tokens);
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

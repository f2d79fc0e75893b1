/* OpenAI-compatible request parsing and answer building. See openai.h. */
#include "server/openai.h"
#include "core/core.h"
#include "core/strbuf.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/json.h"
#include "http/http_answer.h"

#define INVALID "invalid_request_error"
#define MAX_EXACT_INT 9007199254740992.0 /* 2^53 */

void srv_error_set(srv_error *e, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) {
    e->status = status;
    e->type = type ? type : INVALID;
    e->code = code;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

void srv_gen_clear(srv_gen *g) {
    if (!g) return;
    st_free(g->model);
    st_free(g->prompt_text);
    st_free(g->prompt_ids);
    for (int i = 0; i < g->n_stop; i++) st_free(g->stop[i]);
    memset(g, 0, sizeof *g);
}

/* ---- field access: null counts as absent -------------------------------------------*/
static const cJSON *field(const cJSON *obj, const char *key) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

static bool wrong_type(srv_error *e, const char *name, const char *want, const cJSON *it) {
    srv_error_set(e, 400, INVALID, "invalid_type", name, "'%s' must be %s, got %s", name, want,
                  st_json_type_name(it));
    return false;
}

/* A number that is not finite (1e999 parses as infinity) or not whole where an integer is wanted. */
static bool bad_number(srv_error *e, const char *name, bool integer, double d) {
    if (!isfinite(d))
        srv_error_set(e, 400, INVALID, "invalid_value", name, "'%s' must be a finite number (got one too large to represent)",
                      name);
    else if (integer && fabs(d) > MAX_EXACT_INT)
        srv_error_set(e, 400, INVALID, "invalid_value", name, "'%s' must be an integer in [-2^53, 2^53], got %g", name, d);
    else
        srv_error_set(e, 400, INVALID, "invalid_type", name, "'%s' must be an integer, got %.17g", name, d);
    return false;
}

/* Optional number: *present false when absent. */
static bool get_number(const cJSON *obj, const char *key, double *out, bool *present, srv_error *e) {
    const cJSON *it = field(obj, key);
    *present = it != NULL;
    if (!it) return true;
    if (!cJSON_IsNumber(it)) return wrong_type(e, key, "a number", it);
    if (!isfinite(it->valuedouble)) return bad_number(e, key, false, it->valuedouble);
    *out = it->valuedouble;
    return true;
}

static bool get_int(const cJSON *obj, const char *key, int64_t *out, bool *present, srv_error *e) {
    const cJSON *it = field(obj, key);
    *present = it != NULL;
    if (!it) return true;
    if (!cJSON_IsNumber(it)) return wrong_type(e, key, "an integer", it);
    const double d = it->valuedouble;
    if (!isfinite(d) || d != floor(d) || fabs(d) > MAX_EXACT_INT) return bad_number(e, key, true, d);
    *out = (int64_t)d;
    return true;
}

static bool get_bool(const cJSON *obj, const char *key, bool *out, bool *present, srv_error *e) {
    const cJSON *it = field(obj, key);
    *present = it != NULL;
    if (!it) return true;
    if (!cJSON_IsBool(it)) return wrong_type(e, key, "a boolean", it);
    *out = cJSON_IsTrue(it);
    return true;
}

static bool out_of_range(srv_error *e, const char *name, const char *range, double v) {
    srv_error_set(e, 400, INVALID, "invalid_value", name, "'%s' must be %s, got %g", name, range, v);
    return false;
}

static bool unsupported(srv_error *e, const char *name, const char *what) {
    srv_error_set(e, 400, INVALID, "unsupported_parameter", name, "'%s': %s is not supported by this server", name,
                  what);
    return false;
}

/* ---- a growable string -------------------------------------------------------------------*/

/* ---- the fields shared by both endpoints ------------------------------------------------------*/
static bool parse_common(const cJSON *root, srv_gen *g, srv_error *e) {
    bool present;
    const cJSON *it;
    if ((it = field(root, "model")) && !cJSON_IsString(it)) return wrong_type(e, "model", "a string", it);
    if (it && !(g->model = st_strdup(it->valuestring))) goto oom;

    /* max_tokens / max_completion_tokens */
    const char *names[2] = {"max_completion_tokens", "max_tokens"};
    for (int i = 0; i < 2; i++) {
        int64_t v = 0;
        if (!get_int(root, names[i], &v, &present, e)) return false;
        if (!present) continue;
        if (v < 1) return out_of_range(e, names[i], "at least 1", (double)v);
        g->max_tokens = v;
        break;
    }

    g->sp = (strata_request_params){.temperature = 1.0f, .top_p = 1.0f, .repetition_penalty = 1.0f};
    double d = 1.0;
    if (!get_number(root, "temperature", &d, &present, e)) return false;
    if (present && !(d >= 0 && d <= STRATA_TEMPERATURE_MAX))
        return out_of_range(e, "temperature", "in [0, 2] (as strata run --temp)", d);
    g->sp.temperature = present ? (float)d : 1.0f;
    d = 1.0;
    if (!get_number(root, "top_p", &d, &present, e)) return false;
    if (present && !(d > 0 && d <= 1)) return out_of_range(e, "top_p", "in (0, 1]", d);
    g->sp.top_p = strata_sampling_float(d); /* 1e-300: not 0 (off) */
    int64_t k = 0;
    if (!get_int(root, "top_k", &k, &present, e)) return false;
    if (present && (k < -1 || k > INT32_MAX)) return out_of_range(e, "top_k", "-1, 0 (off) or a positive integer", (double)k);
    g->sp.top_k = k < 0 ? 0 : (int32_t)k;
    d = 0;
    if (!get_number(root, "min_p", &d, &present, e)) return false;
    if (present && !(d >= 0 && d <= 1)) return out_of_range(e, "min_p", "in [0, 1]", d);
    g->sp.min_p = strata_sampling_float(d);
    d = 1;
    if (!get_number(root, "repetition_penalty", &d, &present, e)) return false;
    if (present && !(d > 0 && d <= STRATA_REPETITION_PENALTY_MAX))
        return out_of_range(e, "repetition_penalty", "in (0, 2] (as strata run --repeat-penalty)", d);
    g->sp.repetition_penalty = strata_sampling_float(d);
    int64_t seed = 0;
    if (!get_int(root, "seed", &seed, &g->seed_given, e)) return false;
    if (g->seed_given && (seed < -1 || seed > STRATA_SEED_MAX))
        return out_of_range(e, "seed", "an integer in [0, 2^53], or -1 for a fresh one (as strata run --seed)",
                            (double)seed);
    if (seed == -1) g->seed_given = false; /* a fresh seed, as when absent */
    g->sp.seed = g->seed_given ? (uint64_t)seed : 0;

    const char *pen[2] = {"presence_penalty", "frequency_penalty"};
    for (int i = 0; i < 2; i++) {
        d = 0;
        if (!get_number(root, pen[i], &d, &present, e)) return false;
        if (present && !(d >= -2 && d <= 2)) return out_of_range(e, pen[i], "in [-2, 2]", d);
        if (d != 0) return unsupported(e, pen[i], "a non-zero value");
    }

    int64_t n = 1;
    if (!get_int(root, "n", &n, &present, e)) return false;
    if (n != 1) {
        srv_error_set(e, 400, INVALID, "invalid_value", "n", "'n' must be 1 (one choice per request), got %lld",
                      (long long)n);
        return false;
    }
    int64_t best_of = 1;
    if (!get_int(root, "best_of", &best_of, &present, e)) return false;
    if (best_of != 1) return unsupported(e, "best_of", "a value other than 1");

    /* stop */
    if ((it = field(root, "stop"))) {
        if (cJSON_IsString(it)) {
            if (!it->valuestring[0]) {
                srv_error_set(e, 400, INVALID, "invalid_value", "stop", "'stop' must not be an empty string");
                return false;
            }
            if (!(g->stop[0] = st_strdup(it->valuestring))) goto oom;
            g->n_stop = 1;
        } else if (cJSON_IsArray(it)) {
            int n_stop = cJSON_GetArraySize(it);
            if (n_stop > SRV_MAX_STOP) {
                srv_error_set(e, 400, INVALID, "invalid_value", "stop", "'stop' has %d strings; at most %d", n_stop,
                              SRV_MAX_STOP);
                return false;
            }
            const cJSON *s;
            int i = 0;
            cJSON_ArrayForEach(s, it) {
                char name[32];
                snprintf(name, sizeof name, "stop[%d]", i);
                if (!cJSON_IsString(s)) return wrong_type(e, name, "a string", s);
                if (!s->valuestring[0]) {
                    srv_error_set(e, 400, INVALID, "invalid_value", "stop", "'%s' must not be empty", name);
                    return false;
                }
                if (!(g->stop[g->n_stop] = st_strdup(s->valuestring))) goto oom;
                g->n_stop++;
                i++;
            }
        } else {
            return wrong_type(e, "stop", "a string or an array of strings", it);
        }
    }

    if (!get_bool(root, "stream", &g->stream, &present, e)) return false;
    if ((it = field(root, "stream_options"))) {
        if (!cJSON_IsObject(it)) return wrong_type(e, "stream_options", "an object", it);
        if (!g->stream) {
            srv_error_set(e, 400, INVALID, "invalid_value", "stream_options",
                          "'stream_options' is only allowed when 'stream' is true");
            return false;
        }
        const cJSON *iu = field(it, "include_usage");
        if (iu && !cJSON_IsBool(iu)) return wrong_type(e, "stream_options.include_usage", "a boolean", iu);
        g->include_usage = iu && cJSON_IsTrue(iu);
    }
    if (!get_bool(root, "ignore_eos", &g->ignore_eos, &present, e)) return false;

    /* asks for things this server does not do */
    bool b = false;
    if (!get_bool(root, "echo", &b, &present, e)) return false;
    if (b) return unsupported(e, "echo", "echoing the prompt");
    if ((it = field(root, "logprobs"))) {
        if (cJSON_IsTrue(it) || (cJSON_IsNumber(it) && it->valuedouble > 0)) return unsupported(e, "logprobs", "logprobs");
        if (!cJSON_IsBool(it) && !cJSON_IsNumber(it)) return wrong_type(e, "logprobs", "a boolean", it);
    }
    if ((it = field(root, "top_logprobs")) && !(cJSON_IsNumber(it) && it->valuedouble == 0))
        return unsupported(e, "top_logprobs", "top_logprobs");
    if ((it = field(root, "suffix"))) return unsupported(e, "suffix", "a suffix");
    const char *arrays[2] = {"tools", "functions"};
    for (int i = 0; i < 2; i++)
        if ((it = field(root, arrays[i])) && !(cJSON_IsArray(it) && cJSON_GetArraySize(it) == 0))
            return unsupported(e, arrays[i], "tool calling");
    if ((it = field(root, "logit_bias")) && !(cJSON_IsObject(it) && !it->child))
        return unsupported(e, "logit_bias", "logit_bias");
    if ((it = field(root, "response_format"))) {
        const cJSON *t = cJSON_IsObject(it) ? field(it, "type") : NULL;
        if (!t || !cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0)
            return unsupported(e, "response_format", "a response format other than text");
    }
    return true;
oom:
    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return false;
}

/* ---- chat ------------------------------------------------------------------------------------*/
static bool parse_messages(const cJSON *root, const strata_model *model, srv_gen *g, srv_error *e) {
    const cJSON *msgs = field(root, "messages");
    if (!msgs) {
        srv_error_set(e, 400, INVALID, "missing_required_parameter", "messages", "'messages' is required");
        return false;
    }
    if (!cJSON_IsArray(msgs)) return wrong_type(e, "messages", "an array", msgs);
    const int n = cJSON_GetArraySize(msgs);
    if (n == 0) {
        srv_error_set(e, 400, INVALID, "invalid_value", "messages", "'messages' must not be empty");
        return false;
    }
    const char *tpl = "none";
    if (!model || strata_chat_template(model, &tpl) != STRATA_OK || !strcmp(tpl, "none")) {
        srv_error_set(e, 400, INVALID, "model_not_supported", "messages",
                      "the model has no chat template: use /v1/completions, or start the server with "
                      "--chat-template");
        return false;
    }
    const char **roles = st_calloc((size_t)n, sizeof *roles);
    const char **contents = st_calloc((size_t)n, sizeof *contents);
    char **owned = st_calloc((size_t)n, sizeof *owned);
    bool ok = false;
    if (!roles || !contents || !owned) {
        srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        goto done;
    }
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, msgs) {
        char name[48];
        snprintf(name, sizeof name, "messages[%d]", i);
        if (!cJSON_IsObject(msg)) {
            wrong_type(e, name, "an object", msg);
            goto done;
        }
        const cJSON *role = field(msg, "role");
        snprintf(name, sizeof name, "messages[%d].role", i);
        if (!role) {
            srv_error_set(e, 400, INVALID, "missing_required_parameter", name, "'%s' is required", name);
            goto done;
        }
        if (!cJSON_IsString(role)) {
            wrong_type(e, name, "a string", role);
            goto done;
        }
        const char *r = role->valuestring;
        if (!strcmp(r, "developer")) r = "system";
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool")) {
            srv_error_set(e, 400, INVALID, "invalid_value", name,
                          "'%s' must be system, developer, user, assistant or tool, got '%s'", name, r);
            goto done;
        }
        const cJSON *content = field(msg, "content");
        snprintf(name, sizeof name, "messages[%d].content", i);
        const char *text = NULL;
        if (!content) {
            if (strcmp(r, "assistant") != 0) {
                srv_error_set(e, 400, INVALID, "missing_required_parameter", name, "'%s' is required", name);
                goto done;
            }
            text = "";
        } else if (cJSON_IsString(content)) {
            text = content->valuestring;
        } else if (cJSON_IsArray(content)) {
            st_strbuf b = {0};
            int k = 0;
            const cJSON *part;
            cJSON_ArrayForEach(part, content) {
                char pname[64];
                snprintf(pname, sizeof pname, "messages[%d].content[%d]", i, k);
                const cJSON *type = cJSON_IsObject(part) ? field(part, "type") : NULL;
                const cJSON *pt = cJSON_IsObject(part) ? field(part, "text") : NULL;
                if (!cJSON_IsObject(part) || !type || !cJSON_IsString(type)) {
                    st_free(b.p);
                    srv_error_set(e, 400, INVALID, "invalid_value", pname,
                                  "'%s' must be an object with a 'type'", pname);
                    goto done;
                }
                if (strcmp(type->valuestring, "text") != 0) {
                    st_free(b.p);
                    unsupported(e, pname, "content of a type other than text");
                    goto done;
                }
                if (!pt || !cJSON_IsString(pt)) {
                    st_free(b.p);
                    snprintf(pname + strlen(pname), sizeof pname - strlen(pname), ".text");
                    wrong_type(e, pname, "a string", pt ? pt : part);
                    goto done;
                }
                if ((k > 0 && !st_strbuf_add(&b, "\n", 1)) || !st_strbuf_add(&b, pt->valuestring, strlen(pt->valuestring))) {
                    st_free(b.p);
                    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
                    goto done;
                }
                k++;
            }
            owned[i] = b.p ? b.p : st_strdup("");
            if (!owned[i]) {
                srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
                goto done;
            }
            text = owned[i];
        } else {
            wrong_type(e, name, "a string or an array of content parts", content);
            goto done;
        }
        roles[i] = r;
        contents[i] = text;
        i++;
    }
    /* the template's control tokens as such, the contents as plain text (turns cannot be forged) */
    size_t cap = 64, got = 0;
    for (int j = 0; j < n; j++) cap += strlen(contents[j]) + strlen(roles[j]) + 64;
    strata_status st = STRATA_ERR_NOMEM;
    for (int tries = 0; tries < 2 && st == STRATA_ERR_NOMEM; tries++) {
        st_free(g->prompt_ids);
        if (!(g->prompt_ids = st_malloc(cap * sizeof *g->prompt_ids))) {
            srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            goto done;
        }
        st = strata_chat_tokenize(model, roles, contents, (size_t)n, true, g->prompt_ids, cap, &got);
        if (st == STRATA_ERR_NOMEM && got > cap) cap = got;
        else if (st == STRATA_ERR_NOMEM) break;
    }
    if (st != STRATA_OK) {
        srv_error_set(e, st == STRATA_ERR_NOMEM ? 500 : 400, st == STRATA_ERR_NOMEM ? "server_error" : INVALID,
                      st == STRATA_ERR_NOMEM ? NULL : "invalid_value", st == STRATA_ERR_NOMEM ? NULL : "messages",
                      "the conversation cannot be formatted: %s", strata_last_error());
        goto done;
    }
    g->n_prompt_ids = (int64_t)got;
    ok = true;
done:
    if (owned)
        for (int j = 0; j < n; j++) st_free(owned[j]);
    st_free(owned);
    st_free(roles);
    st_free(contents);
    return ok;
}

/* ---- completions ------------------------------------------------------------------------------*/
static bool parse_prompt(const cJSON *root, srv_gen *g, srv_error *e) {
    const cJSON *p = field(root, "prompt");
    if (!p) {
        srv_error_set(e, 400, INVALID, "missing_required_parameter", "prompt", "'prompt' is required");
        return false;
    }
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(p->child)) p = p->child;
    if (cJSON_IsString(p)) {
        if (!(g->prompt_text = st_strdup(p->valuestring))) goto oom;
        return true;
    }
    if (!cJSON_IsArray(p)) return wrong_type(e, "prompt", "a string or an array of token ids", p);
    const int n = cJSON_GetArraySize(p);
    if (n == 0) {
        srv_error_set(e, 400, INVALID, "invalid_value", "prompt", "'prompt' must not be empty");
        return false;
    }
    if (cJSON_IsString(p->child)) {
        srv_error_set(e, 400, INVALID, "invalid_value", "prompt",
                      "'prompt' holds %d strings; one prompt per request is supported", n);
        return false;
    }
    if (!(g->prompt_ids = st_malloc((size_t)n * sizeof *g->prompt_ids))) goto oom;
    const cJSON *t;
    int i = 0;
    cJSON_ArrayForEach(t, p) {
        const double d = cJSON_IsNumber(t) ? t->valuedouble : -1;
        if (!cJSON_IsNumber(t) || d != floor(d) || d < 0 || d > INT32_MAX) {
            char name[32];
            snprintf(name, sizeof name, "prompt[%d]", i);
            return cJSON_IsNumber(t) ? out_of_range(e, "prompt", "token ids (integers >= 0)", d)
                                     : wrong_type(e, name, "a token id", t);
        }
        g->prompt_ids[i++] = (int32_t)d;
    }
    g->n_prompt_ids = n;
    return true;
oom:
    srv_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return false;
}

bool srv_parse_gen(srv_kind kind, const char *body, size_t len, const strata_model *model, srv_gen *g,
                   srv_error *e) {
    memset(g, 0, sizeof *g);
    g->kind = kind;
    cJSON *root = NULL;
    if (st_json_parse(body, len, "request body", &root) != STRATA_OK) {
        srv_error_set(e, 400, INVALID, "invalid_json", NULL, "We could not parse the JSON body of your request: %s",
                      st_last_error());
        return false;
    }
    bool ok = false;
    if (!cJSON_IsObject(root)) {
        srv_error_set(e, 400, INVALID, "invalid_json", NULL, "the request body must be a JSON object, got %s",
                      st_json_type_name(root));
    } else if (parse_common(root, g, e)) {
        ok = kind == SRV_CHAT ? parse_messages(root, model, g, e) : parse_prompt(root, g, e);
    }
    cJSON_Delete(root);
    if (!ok) srv_gen_clear(g);
    return ok;
}

/* ---- answers ----------------------------------------------------------------------------------*/
static char *print_delete(cJSON *root) {
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

/* A string item from len bytes (the text is copied). */
static cJSON *string_n(const char *text, size_t len) {
    char *tmp = st_malloc(len + 1);
    if (!tmp) return NULL;
    memcpy(tmp, text, len);
    tmp[len] = 0;
    cJSON *s = cJSON_CreateString(tmp);
    st_free(tmp);
    return s;
}

static cJSON *usage_json(const strata_finish *u) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)u->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)u->completion_tokens);
    cJSON_AddNumberToObject(o, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
    cJSON *d = cJSON_AddObjectToObject(o, "prompt_tokens_details");
    if (d) cJSON_AddNumberToObject(d, "cached_tokens", (double)u->cached_tokens);
    return o;
}

static cJSON *meta_json(const srv_answer_meta *m, bool chunk) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "id", m->id);
    cJSON_AddStringToObject(o, "object", m->kind == SRV_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                             : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)m->created);
    cJSON_AddStringToObject(o, "model", m->model);
    return o;
}

static void add_finish(cJSON *choice, const char *finish) {
    if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
    else cJSON_AddNullToObject(choice, "finish_reason");
}

char *srv_json_answer(const srv_answer_meta *m, const char *text, size_t len, const char *finish,
                      const strata_finish *usage) {
    cJSON *o = meta_json(m, false);
    if (!o) return NULL;
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON *t = string_n(text ? text : "", text ? len : 0);
    if (!choices || !c || !t) {
        cJSON_Delete(c);
        cJSON_Delete(t);
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (m->kind == SRV_CHAT) {
        cJSON *msg = cJSON_AddObjectToObject(c, "message");
        if (msg) {
            cJSON_AddStringToObject(msg, "role", "assistant");
            cJSON_AddItemToObject(msg, "content", t);
        } else {
            cJSON_Delete(t);
        }
    } else {
        cJSON_AddItemToObject(c, "text", t);
    }
    cJSON_AddNullToObject(c, "logprobs");
    add_finish(c, finish);
    if (usage) cJSON_AddItemToObject(o, "usage", usage_json(usage));
    return print_delete(o);
}

char *srv_json_chunk(const srv_answer_meta *m, bool role, const char *text, size_t len, const char *finish,
                     bool with_usage_null) {
    cJSON *o = meta_json(m, true);
    if (!o) return NULL;
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    if (!choices || !c) {
        cJSON_Delete(c);
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    if (m->kind == SRV_CHAT) {
        cJSON *delta = cJSON_AddObjectToObject(c, "delta");
        if (delta && role) cJSON_AddStringToObject(delta, "role", "assistant");
        if (delta && text) cJSON_AddItemToObject(delta, "content", string_n(text, len));
    } else {
        cJSON_AddItemToObject(c, "text", string_n(text ? text : "", text ? len : 0));
    }
    cJSON_AddNullToObject(c, "logprobs");
    add_finish(c, finish);
    if (with_usage_null) cJSON_AddNullToObject(o, "usage");
    return print_delete(o);
}

char *srv_json_usage_chunk(const srv_answer_meta *m, const strata_finish *usage) {
    cJSON *o = meta_json(m, true);
    if (!o) return NULL;
    cJSON_AddArrayToObject(o, "choices");
    cJSON_AddItemToObject(o, "usage", usage_json(usage));
    return print_delete(o);
}

char *srv_json_error(const srv_error *e) {
    return st_http_error_json(e->type ? e->type : INVALID, e->code, e->param[0] ? e->param : NULL, e->message);
}

char *srv_json_models(const char *model, long long created, int64_t max_model_len) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON *m = cJSON_CreateObject();
    if (!data || !m) {
        cJSON_Delete(m);
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddItemToArray(data, m);
    cJSON_AddStringToObject(m, "id", model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)created);
    cJSON_AddStringToObject(m, "owned_by", "strata");
    cJSON_AddNumberToObject(m, "max_model_len", (double)max_model_len);
    return print_delete(o);
}

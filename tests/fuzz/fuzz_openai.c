/* Fuzzes the OpenAI request parser (src/server/openai.c: srv_parse_gen, the
 * body of POST /v1/chat/completions and /v1/completions) with the default
 * model's tokenizer and chat template behind it (models/
 * SmolLM2-135M-Instruct.Q4_1.gguf, fetched by scripts/fetch-default-model.sh;
 * opened once, CPU backend, no engine), then what the server does next with a
 * request: the prompt tokenized, or the error body built.
 *
 * Input: byte 0 picks the endpoint (bit 0: 1 chat, 0 completions); the rest
 * is the request body. Checked beyond memory safety: a refused request has an
 * HTTP status (400, or 500 for memory) and a message, and its error body is
 * JSON; an accepted one has a prompt (ids in range, or text), at most
 * SRV_MAX_STOP non-empty stop strings, sampling values in their documented
 * ranges. Seeds: tests/fuzz/corpus/openai/. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fuzzutil.h"
#include "server/openai.h"

#define MODEL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
static strata_model *g_model;
static int64_t g_vocab;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *path = fuzz_src_path(MODEL);
    strata_model_params p = {.device = "cpu", .threads = 1};
    FUZZ_CHECK(strata_model_open(path, &p, &g_model) == STRATA_OK,
               "%s: %s (scripts/fetch-default-model.sh fetches it)", path, strata_last_error());
    strata_model_info info;
    FUZZ_CHECK(strata_model_info_get(g_model, &info) == STRATA_OK, "%s", strata_last_error());
    FUZZ_CHECK(strcmp(info.chat_template, "none") != 0, "%s: no chat template", path);
    g_vocab = info.tokenizer_vocab_size;
    return 0;
}

static void check_json(const char *s, const char *what) {
    FUZZ_CHECK(s != NULL, "%s: no body", what);
    cJSON *j = cJSON_Parse(s);
    FUZZ_CHECK(j != NULL, "%s is not JSON: %s", what, s);
    cJSON_Delete(j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const srv_kind kind = (data[0] & 1) ? SRV_CHAT : SRV_COMPLETIONS;
    /* the server's body buffer: not NUL-terminated past len (an exact copy) */
    char *body = malloc(size - 1 ? size - 1 : 1);
    FUZZ_CHECK(body != NULL, "out of memory");
    memcpy(body, data + 1, size - 1);
    srv_gen g;
    srv_error e;
    memset(&e, 0, sizeof e);
    const bool ok = srv_parse_gen(kind, body, size - 1, g_model, &g, &e);
    free(body);
    if (!ok) {
        FUZZ_CHECK(e.status == 400 || e.status == 500, "status %d", e.status);
        FUZZ_CHECK(e.message[0] && e.type, "an error without a message or type");
        char *j = srv_json_error(&e);
        check_json(j, "the error body");
        free(j);
        return 0;
    }
    FUZZ_CHECK(g.kind == kind, "kind %d", (int)g.kind);
    FUZZ_CHECK((g.prompt_text != NULL) != (g.prompt_ids != NULL), "text %p, ids %p", (void *)g.prompt_text,
               (void *)g.prompt_ids);
    if (kind == SRV_CHAT) FUZZ_CHECK(g.prompt_ids && g.n_prompt_ids > 0, "a chat without prompt ids");
    for (int64_t i = 0; kind == SRV_CHAT && i < g.n_prompt_ids; i++)
        FUZZ_CHECK(g.prompt_ids[i] >= 0 && g.prompt_ids[i] < g_vocab, "prompt id %d", g.prompt_ids[i]);
    FUZZ_CHECK(g.n_stop >= 0 && g.n_stop <= SRV_MAX_STOP, "%d stops", g.n_stop);
    for (int i = 0; i < g.n_stop; i++) FUZZ_CHECK(g.stop[i] && g.stop[i][0], "stop %d empty", i);
    FUZZ_CHECK(g.max_tokens >= 0, "max_tokens %lld", (long long)g.max_tokens);
    const strata_request_params *sp = &g.sp;
    FUZZ_CHECK(sp->temperature >= 0 && sp->temperature <= STRATA_TEMPERATURE_MAX, "temperature %g",
               (double)sp->temperature);
    FUZZ_CHECK(sp->top_p > 0 && sp->top_p <= 1, "top_p %g", (double)sp->top_p);
    FUZZ_CHECK(sp->min_p >= 0 && sp->min_p <= 1, "min_p %g", (double)sp->min_p);
    FUZZ_CHECK(sp->repetition_penalty > 0 && sp->repetition_penalty <= 2, "repetition_penalty %g",
               (double)sp->repetition_penalty);
    FUZZ_CHECK(sp->top_k >= 0, "top_k %d", (int)sp->top_k);
    FUZZ_CHECK(!g.seed_given || sp->seed <= STRATA_SEED_MAX, "seed %llu", (unsigned long long)sp->seed);
    if (g.prompt_text) {
        /* as the server: tokenized with its control tokens, BOS added */
        int32_t *ids = NULL;
        size_t n = 0;
        FUZZ_CHECK(strata_tokenize_alloc(g_model, g.prompt_text, true, true, &ids, &n) == STRATA_OK, "tokenize: %s",
                   strata_last_error());
        for (size_t i = 0; i < n; i++) FUZZ_CHECK(ids[i] >= 0 && ids[i] < g_vocab, "id %d", ids[i]);
        free(ids);
        /* an answer carrying the prompt as its text is JSON */
        srv_answer_meta m = {"cmpl-fuzz", g.model ? g.model : "fuzz", 0, kind};
        strata_finish usage = {0};
        char *a = srv_json_answer(&m, g.prompt_text, strlen(g.prompt_text), "stop", &usage);
        check_json(a, "the answer");
        free(a);
    }
    srv_gen_clear(&g);
    return 0;
}

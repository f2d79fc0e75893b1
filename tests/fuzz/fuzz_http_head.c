/* Fuzzes the HTTP request head check of the server's front door
 * (src/server/http_head.c: srv_head_check, what every new connection's first
 * bytes go through before libmicrohttpd sees them), then the JSON error the
 * front door would send for a refused head.
 *
 * Input: the bytes a client sent. Checked beyond memory safety (the input is
 * an exact heap copy, not NUL-terminated: a read past it is an ASan report):
 *   - a verdict on every prefix agrees with the whole: MORE on a prefix, then
 *     OK or BAD for the whole, never OK then BAD (nothing after a complete
 *     head is looked at), and a BAD prefix stays BAD with the same status;
 *   - OK: head_len within the input and at most the limit (+ 4 empty lines),
 *     the bytes before it end with an empty line;
 *   - BAD: one of the documented statuses, a code and a message; the error
 *     body is JSON with the OpenAI error shape.
 * Seeds: tests/fuzz/corpus/http_head/. */
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fuzzutil.h"
#include "server/http_head.h"
#include "http/http_answer.h"
#include "server/openai.h"

#define MAX_HEAD 2048 /* small, so that the fuzzer reaches the limits */

static srv_head_verdict check_one(const char *p, size_t n, srv_head *h) {
    const srv_head_limits lim = {.max_head = MAX_HEAD, .max_fields = 16};
    const srv_head_verdict v = srv_head_check(p, n, &lim, h);
    FUZZ_CHECK(v == SRV_HEAD_MORE || v == SRV_HEAD_OK || v == SRV_HEAD_BAD, "verdict %d", (int)v);
    if (v == SRV_HEAD_OK) {
        FUZZ_CHECK(h->head_len >= 2 && h->head_len <= n && h->head_len <= MAX_HEAD + 8, "head_len %zu of %zu",
                   h->head_len, n);
        FUZZ_CHECK(p[h->head_len - 1] == '\n', "the head does not end with a line end");
        const bool crlf = h->head_len >= 4 && !memcmp(p + h->head_len - 4, "\r\n\r\n", 4);
        const bool lf = !memcmp(p + h->head_len - 2, "\n\n", 2) ||
                        (h->head_len >= 3 && !memcmp(p + h->head_len - 3, "\n\r\n", 3));
        FUZZ_CHECK(crlf || lf, "the head does not end with an empty line");
    }
    if (v == SRV_HEAD_BAD) {
        static const int ok_status[] = {400, 413, 414, 431, 501, 505};
        bool known = false;
        for (size_t i = 0; i < sizeof ok_status / sizeof ok_status[0]; i++) known |= h->status == ok_status[i];
        FUZZ_CHECK(known, "status %d", h->status);
        FUZZ_CHECK(h->code && h->code[0] && h->message[0], "a refusal without a code or message");
        FUZZ_CHECK(strcmp(st_http_reason(h->status), "Error") != 0, "no reason phrase for %d", h->status);
    }
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *p = malloc(size ? size : 1);
    FUZZ_CHECK(p != NULL, "out of memory");
    memcpy(p, data, size);
    srv_head whole;
    const srv_head_verdict vw = check_one(p, size, &whole);
    /* prefixes: a handful of cut points (every one would be quadratic) */
    const size_t cuts[] = {0, 1, size / 3, size / 2, size > 0 ? size - 1 : 0};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        if (cuts[i] > size) continue;
        srv_head h;
        const srv_head_verdict v = check_one(p, cuts[i], &h);
        if (v == SRV_HEAD_OK)
            FUZZ_CHECK(vw == SRV_HEAD_OK && h.head_len == whole.head_len, "a prefix of %zu is OK (head %zu), the "
                       "whole %d (head %zu)", cuts[i], h.head_len, (int)vw, whole.head_len);
        if (v == SRV_HEAD_BAD)
            FUZZ_CHECK(vw == SRV_HEAD_BAD && h.status == whole.status, "a prefix of %zu is BAD %d, the whole %d (%d)",
                       cuts[i], h.status, (int)vw, whole.status);
    }
    if (vw == SRV_HEAD_BAD) { /* the answer's body, as the front door builds it */
        srv_error e;
        srv_error_set(&e, whole.status, "invalid_request_error", whole.code, NULL, "%s", whole.message);
        char *j = srv_json_error(&e);
        FUZZ_CHECK(j != NULL, "no error body");
        cJSON *o = cJSON_Parse(j);
        FUZZ_CHECK(o != NULL, "the error body is not JSON: %s", j);
        const cJSON *err = cJSON_GetObjectItemCaseSensitive(o, "error");
        FUZZ_CHECK(cJSON_IsObject(err) && cJSON_IsString(cJSON_GetObjectItemCaseSensitive(err, "message")) &&
                       cJSON_IsString(cJSON_GetObjectItemCaseSensitive(err, "code")),
                   "not the OpenAI error shape: %s", j);
        cJSON_Delete(o);
        free(j);
    }
    free(p);
    return 0;
}

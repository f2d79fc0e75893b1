/* server/http_head: the request head check the server makes before
 * libmicrohttpd parses a connection's first request (http_head.h): heads that
 * pass, each kind of refusal with its status and code, verdicts on partial
 * input (nothing wrong yet: MORE; a bad complete line or first byte: BAD at
 * once), the size and field limits, and every prefix of a good head. */
#include <stdlib.h>
#include <string.h>

#include "server/http_head.h"
#include "http/http_answer.h"
#include "testutil.h"

static srv_head_verdict chk(const char *s, srv_head *h) {
    const srv_head_limits lim = {.max_head = 512, .max_fields = 8};
    return srv_head_check(s, strlen(s), &lim, h);
}

static void expect_ok(const char *s) {
    srv_head h;
    const srv_head_verdict v = chk(s, &h);
    CHECK_MSG(v == SRV_HEAD_OK && h.head_len == strlen(s), "%s: verdict %d (%d %s), head_len %zu", s, (int)v,
              h.status, h.message, h.head_len);
}

static void expect_bad(const char *s, int status, const char *code, const char *needle) {
    srv_head h;
    const srv_head_verdict v = chk(s, &h);
    CHECK_MSG(v == SRV_HEAD_BAD && h.status == status && h.code && !strcmp(h.code, code) &&
                  (!needle || strstr(h.message, needle)),
              "%.60s: verdict %d, %d %s '%s' (want %d %s '%s')", s, (int)v, h.status, h.code ? h.code : "-",
              h.message, status, code, needle ? needle : "");
}

static void expect_more(const char *s) {
    srv_head h;
    const srv_head_verdict v = chk(s, &h);
    CHECK_MSG(v == SRV_HEAD_MORE, "%.60s: verdict %d (%d %s)", s, (int)v, h.status, h.message);
}

int main(void) {
    /* good heads */
    expect_ok("GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n");
    expect_ok("GET / HTTP/1.0\r\n\r\n");
    expect_ok("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Content-Length: 12\r\n\r\n");
    expect_ok("GET /x HTTP/1.1\nHost: a\n\n");                        /* bare LF line ends */
    expect_ok("\r\n\r\nGET /x HTTP/1.1\r\n\r\n");                      /* empty lines before */
    expect_ok("GET /x?a=%20b HTTP/1.1\r\nX-A:\r\nX-B:  v v \t\r\n\r\n"); /* empty and spaced values */
    expect_ok("POST / HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 005\r\n\r\n"); /* equal copies */
    expect_ok("POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n");
    expect_ok("GET / HTTP/1.1\r\nX-U: caf\xc3\xa9\r\n\r\n");          /* UTF-8 in a value */
    {   /* the head ends at its blank line: a body or the next request may follow */
        srv_head h;
        const char *s = "POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET / HTTP/1.1\r\n";
        CHECK(chk(s, &h) == SRV_HEAD_OK && h.head_len == strlen(s) - strlen("{}GET / HTTP/1.1\r\n"));
    }

    /* the request line */
    expect_bad("GARBAGE\r\n\r\n", 400, "bad_request", "malformed request line 'GARBAGE'");
    expect_bad("GARBAGE\r\n", 400, "bad_request", NULL); /* at once, not at the end of the head */
    expect_bad("GET\r\n", 400, "bad_request", NULL);
    expect_bad("GET /\r\n", 400, "bad_request", NULL);
    expect_bad("GET  / HTTP/1.1\r\n", 400, "bad_request", NULL);
    expect_bad("GET / HTTP/1.1 \r\n", 400, "bad_request", NULL);
    expect_bad("GET / http/1.1\r\n", 400, "bad_request", NULL);
    expect_bad("GET / HTTP/11\r\n", 400, "bad_request", NULL);
    expect_bad("G(T / HTTP/1.1\r\n", 400, "bad_request", NULL);
    expect_bad("GET /caf\xc3\xa9 HTTP/1.1\r\n", 400, "bad_request", NULL);
    expect_bad("GET / HTTP/2.0\r\n\r\n", 505, "http_version_not_supported", "HTTP/2.0");
    expect_bad("GET / HTTP/0.9\r\n", 505, "http_version_not_supported", NULL);
    expect_bad("GET / HTTP/1.2\r\n", 505, "http_version_not_supported", NULL);
    expect_bad("\x16\x03\x01\x02\x00", 400, "bad_request", "not an HTTP request"); /* a TLS hello */
    expect_bad("\r\n\r\n\r\n\r\n\r\nGET / HTTP/1.1\r\n", 400, "bad_request", "empty lines");
    expect_bad("GET / HT\rTP/1.1\r\n", 400, "bad_request", "carriage return");
    expect_bad("GET /\x01", 400, "bad_request", "control character");

    /* header fields */
    expect_bad("GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400, "bad_request", "header line 2");
    expect_bad("GET / HTTP/1.1\r\nName : v\r\n\r\n", 400, "bad_request", NULL);
    expect_bad("GET / HTTP/1.1\r\n: v\r\n\r\n", 400, "bad_request", NULL);
    expect_bad("GET / HTTP/1.1\r\nA: b\r\n  folded\r\n\r\n", 400, "bad_request", "folded");
    expect_bad("GET / HTTP/1.1\r\nA: b\x01\r\n\r\n", 400, "bad_request", "control character");
    expect_bad("GET / HTTP/1.1\r\nA: b\x7f\r\n", 400, "bad_request", "control character");
    expect_bad("POST / HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400, "bad_request", "Content-Length 'abc'");
    expect_bad("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "bad_request", NULL);
    expect_bad("POST / HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n", 400, "bad_request", NULL);
    expect_bad("POST / HTTP/1.1\r\nContent-Length:\r\n\r\n", 400, "bad_request", NULL);
    expect_bad("POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400, "bad_request", "two");
    expect_bad("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n", 413, "request_too_large",
               NULL);
    expect_ok("POST / HTTP/1.1\r\nContent-Length: 000000000000000000000001\r\n\r\n");
    expect_bad("POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not_implemented", "gzip");
    expect_bad("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400, "bad_request",
               "together");
    expect_bad("POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "bad_request",
               "together");
    expect_bad("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
               "bad_request", NULL);

    /* limits (max_head 512, max_fields 8 here) */
    {
        char s[1200];
        strcpy(s, "GET /");
        memset(s + 5, 'a', 600);
        s[605] = 0;
        expect_bad(s, 414, "uri_too_long", NULL); /* the request line alone past the limit */
        strcpy(s, "GET / HTTP/1.1\r\nX: ");
        size_t k = strlen(s);
        memset(s + k, 'v', 600);
        s[k + 600] = 0;
        expect_bad(s, 431, "header_too_large", NULL);
        /* a control character within the limit, the line's end past it: the same verdict
         * (400) for the whole and for every prefix that holds the character */
        s[k + 50] = '\x01';
        for (size_t cut = k + 51; cut <= k + 600; cut += 7) {
            srv_head h;
            const srv_head_limits lim = {.max_head = 512, .max_fields = 8};
            const srv_head_verdict v = srv_head_check(s, cut, &lim, &h);
            CHECK_MSG(v == SRV_HEAD_BAD && h.status == 400, "prefix %zu: verdict %d status %d", cut, (int)v,
                      h.status);
        }
        /* a carriage return as the last byte within the limit: 431 for the whole and the prefix */
        s[k + 50] = 'v';
        s[512 - 1] = '\r';
        expect_bad(s, 431, "header_too_large", NULL);
        {
            srv_head h;
            const srv_head_limits lim = {.max_head = 512, .max_fields = 8};
            CHECK(srv_head_check(s, 512, &lim, &h) == SRV_HEAD_BAD && h.status == 431);
        }
        s[0] = 0;
        strcat(s, "GET / HTTP/1.1\r\n");
        for (int i = 0; i < 9; i++) strcat(s, "A: b\r\n");
        strcat(s, "\r\n");
        expect_bad(s, 431, "header_too_large", "8 header fields");
        /* exactly at the limit: passes */
        strcpy(s, "GET / HTTP/1.1\r\nX: ");
        k = strlen(s);
        memset(s + k, 'v', 512 - k - 4);
        strcpy(s + 512 - 4, "\r\n\r\n");
        CHECK(strlen(s) == 512);
        expect_ok(s);
        /* ... after the empty lines allowed before it too (the limit counts from the request line) */
        char t[1200] = "\r\n\r\n\r\n\r\n";
        strcat(t, s);
        expect_ok(t);
    }

    /* partial input: MORE while nothing is wrong, for every prefix of good heads */
    expect_more("");
    expect_more("G");
    expect_more("GET / HTTP/1.1\r");
    expect_more("GET / HTTP/1.1\r\nHost: x\r\n");
    expect_more("\r\n");
    const char *goods[] = {"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:8080\r\nContent-Type: "
                           "application/json\r\nContent-Length: 120\r\nAuthorization: Bearer k\r\n\r\n",
                           "\r\nGET /metrics HTTP/1.0\nA:b\n\n"};
    for (size_t g = 0; g < sizeof goods / sizeof goods[0]; g++) {
        const size_t n = strlen(goods[g]);
        for (size_t i = 0; i < n; i++) {
            srv_head h;
            const srv_head_verdict v = srv_head_check(goods[g], i, NULL, &h);
            CHECK_MSG(v == SRV_HEAD_MORE, "prefix %zu of good head %zu: verdict %d (%s)", i, g, (int)v, h.message);
        }
        srv_head h;
        CHECK(srv_head_check(goods[g], n, NULL, &h) == SRV_HEAD_OK && h.head_len == n);
    }
    /* default limits: 16 KiB, 100 fields */
    {
        char *s = malloc(20000);
        strcpy(s, "GET / HTTP/1.1\r\n");
        for (int i = 0; i < 100; i++) strcat(s, "A: b\r\n");
        strcat(s, "\r\n");
        srv_head h;
        CHECK(srv_head_check(s, strlen(s), NULL, &h) == SRV_HEAD_OK);
        s[strlen(s) - 2] = 0;
        strcat(s, "A: b\r\n\r\n");
        CHECK(srv_head_check(s, strlen(s), NULL, &h) == SRV_HEAD_BAD && h.status == 431);
        strcpy(s, "GET / HTTP/1.1\r\nX: ");
        memset(s + strlen(s), 'v', 16400);
        s[19 + 16400] = 0;
        CHECK(srv_head_check(s, strlen(s), NULL, &h) == SRV_HEAD_BAD && h.status == 431);
        free(s);
    }
    CHECK(!strcmp(st_http_reason(431), "Request Header Fields Too Large") && !strcmp(st_http_reason(505),
                                                                                      "HTTP Version Not Supported"));
    return test_finish("test_http_head");
}

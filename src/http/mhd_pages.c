/* libmicrohttpd's own pages made JSON errors. See mhd_pages.h. */
#include "http/mhd_pages.h"
#include "http/http_answer.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <microhttpd.h>

/* how long a page written here may wait for room in the socket (ms): a client that reads
 * nothing loses it, the connection is closed either way */
#define SEND_WAIT_MS 200

/* what the last log line on this thread announced (cleared by the next MHD_queue_response) */
static _Thread_local char last_text[200];  /* the page's text, without its tags */
static _Thread_local unsigned last_status; /* its status (0: none pending) */
static _Thread_local bool in_headers;      /* the request's headers were being parsed (the page is written twice) */

/* libmicrohttpd's line after a page written here made its MHD_queue_response fail */
static const char CLOSING[] = "failed to queue error response";

int st_mhd_note_log(const char *line) {
    /* announced while parsing the headers (parse_connection_headers), just before the page's line */
    if (strstr(line, "Content-Length' header") || strstr(line, "without `Host' header")) {
        in_headers = true;
        return 0;
    }
    const char *rc = strstr(line, "HTTP response code is ");
    if (!rc) {
        in_headers = false;
        return 0;
    }
    const int status = atoi(rc + strlen("HTTP response code is "));
    last_status = status >= 400 && status < 600 ? (unsigned)status : 0;
    last_text[0] = 0;
    /* the text of the page's <body>, quoted in the line */
    const char *b0 = strstr(line, "<body>");
    const char *b1 = b0 ? strstr(b0, "</body>") : NULL;
    if (b1) {
        size_t k = 0;
        bool tag = false;
        for (const char *p = b0 + 6; p < b1 && k + 1 < sizeof last_text; p++) {
            if (*p == '<') tag = true;
            else if (*p == '>') tag = false;
            else if (!tag) last_text[k++] = *p;
        }
        while (k > 0 && last_text[k - 1] == '.') k--;
        last_text[k] = 0;
    }
    return (int)last_status;
}

bool st_mhd_log_is_ours(const char *line) {
    return strstr(line, CLOSING) || strstr(line, "Content-Length' header") || strstr(line, "without `Host' header");
}

typedef enum MHD_Result (*queue_fn)(struct MHD_Connection *, unsigned int, struct MHD_Response *);

static queue_fn real_queue_response(void) {
    static _Atomic(queue_fn) fn;
    queue_fn f = atomic_load(&fn);
    if (!f) {
        void *sym = dlsym(RTLD_NEXT, "MHD_queue_response");
        memcpy(&f, &sym, sizeof f);
        atomic_store(&fn, f);
    }
    return f;
}

/* The JSON error's type, code and message replacing a page of `status` (message: into msg). */
static void page_error(unsigned int status, const char **type, const char **code, char *msg, size_t cap) {
    const char *what = "malformed request";
    *code = "bad_request", *type = "invalid_request_error";
    switch (status) {
    case 413: *code = "request_too_large", what = "request too large"; break;
    case 414: *code = "uri_too_long", what = "request line too long"; break;
    case 431: *code = "header_too_large", what = "request head too large"; break;
    case 501: *code = "not_implemented", what = "not implemented"; break;
    case 505: *code = "http_version_not_supported", what = "HTTP version not supported"; break;
    default:
        if (status >= 500) *code = "server_error", *type = "server_error", what = "server error";
        break;
    }
    if (last_text[0] && status != 500) /* its 500 page speaks to the developer, not the client */
        snprintf(msg, cap, "%s: %s", what, last_text);
    else
        snprintf(msg, cap, "%s", what);
}

enum MHD_Result MHD_queue_response(struct MHD_Connection *c, unsigned int status, struct MHD_Response *resp);
enum MHD_Result MHD_queue_response(struct MHD_Connection *c, unsigned int status, struct MHD_Response *resp) {
    const queue_fn queue = real_queue_response();
    if (!queue) return MHD_NO;
    /* libmicrohttpd's own page: announced on this thread by its log line, with the same status
     * (so that no other answer, e.g. the router's, is ever taken for one) */
    const bool pending = last_status != 0 && last_status == status;
    const bool headers = in_headers;
    last_status = 0;
    in_headers = false;
    const char *ct = pending && resp ? MHD_get_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE) : "";
    if (!pending || !resp || (ct && strncasecmp(ct, "text/html", 9) != 0)) return queue(c, status, resp);
    const char *type, *code;
    char msg[256];
    page_error(status, &type, &code, msg, sizeof msg);
    last_text[0] = 0;
    if (headers) {
        /* libmicrohttpd would write this page's status line and headers twice: written here,
         * then its queueing fails and it closes the connection (nothing of its own is written) */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) {
            st_http_send_error(ci->connect_fd, (int)status, type, code, msg, SEND_WAIT_MS);
            return MHD_NO;
        }
    }
    char *json = st_http_error_json(type, code, NULL, msg);
    struct MHD_Response *mine =
        json ? MHD_create_response_from_buffer(strlen(json), json, MHD_RESPMEM_MUST_COPY) : NULL;
    free(json); /* cJSON's allocator */
    if (!mine) return queue(c, status, resp); /* out of memory: libmicrohttpd's page */
    MHD_add_response_header(mine, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(mine, MHD_HTTP_HEADER_CONNECTION, "close");
    const enum MHD_Result ok = queue(c, status, mine);
    MHD_destroy_response(mine);
    return ok;
}

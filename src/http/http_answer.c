/* The error answers the server and the router write alike. See http_answer.h. */
#include "http/http_answer.h"
#include "core/core.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cjson/cJSON.h>

const char *st_http_reason(int status) {
    switch (status) {
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 421: return "Misdirected Request";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

char *st_http_error_json(const char *type, const char *code, const char *param, const char *message) {
    cJSON *o = cJSON_CreateObject();
    cJSON *e = o ? cJSON_AddObjectToObject(o, "error") : NULL;
    if (!e) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddStringToObject(e, "message", message ? message : "");
    cJSON_AddStringToObject(e, "type", type ? type : "invalid_request_error");
    if (param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

bool st_http_send_error(int fd, int status, const char *type, const char *code, const char *message, int wait_ms) {
    char *json = st_http_error_json(type, code, NULL, message);
    static const char oom[] =
        "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
    const char *body = json ? json : oom;
    const size_t blen = strlen(body);
    char head[256];
    const int hn = snprintf(head, sizeof head,
                            "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                            "Connection: close\r\n\r\n", status, st_http_reason(status), blen);
    size_t off = 0; /* of head then body */
    const size_t total = (size_t)hn + blen;
    const double until = st_time_now() + wait_ms / 1000.0;
    bool ok = true;
    while (off < total) {
        struct iovec iov[2];
        int n_iov = 0;
        if (off < (size_t)hn) iov[n_iov++] = (struct iovec){head + off, (size_t)hn - off};
        const size_t boff = off > (size_t)hn ? off - (size_t)hn : 0;
        iov[n_iov++] = (struct iovec){(char *)body + boff, blen - boff};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n_iov};
        const ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        const double left_ms = (until - st_time_now()) * 1000.0;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && left_ms > 0) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            if (poll(&p, 1, (int)left_ms + 1) >= 0) continue;
        }
        ok = false;
        break;
    }
    free(json); /* cJSON's allocator */
    return ok;
}

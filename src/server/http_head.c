/* server/http_head: the request head check (http_head.h). */
#include "server/http_head.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define DEF_MAX_HEAD 16384
#define DEF_MAX_FIELDS 100
#define MAX_METHOD 32
#define MAX_LEADING_EMPTY 4
#define MAX_CL_DIGITS 18

/* RFC 9110 5.6.2 tchar */
static bool tchar(unsigned char c) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static srv_head_verdict bad(srv_head *out, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static srv_head_verdict bad(srv_head *out, int status, const char *code, const char *fmt, ...) {
    out->status = status;
    out->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->message, sizeof out->message, fmt, ap);
    va_end(ap);
    return SRV_HEAD_BAD;
}

/* A printable excerpt of s[0..n) for a message: at most 40 bytes, others as '?'. */
static const char *excerpt(const char *s, size_t n, char *buf, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 4 < cap && i < 40; i++) {
        const unsigned char c = (unsigned char)s[i];
        buf[k++] = c >= 0x20 && c < 0x7f && c != '\'' ? (char)c : '?';
    }
    if (n > 40 && k + 4 < cap) buf[k++] = '.', buf[k++] = '.', buf[k++] = '.';
    buf[k] = 0;
    return buf;
}

static srv_head_verdict check_request_line(const char *l, size_t n, srv_head *out) {
    char ex[64];
    size_t i = 0;
    while (i < n && tchar((unsigned char)l[i])) i++;
    if (i == 0 || i > MAX_METHOD || i >= n || l[i] != ' ')
        return bad(out, 400, "bad_request", "malformed request line '%s' (want: METHOD /path HTTP/1.1)",
                   excerpt(l, n, ex, sizeof ex));
    const size_t t0 = ++i;
    while (i < n && (unsigned char)l[i] > 0x20 && (unsigned char)l[i] < 0x7f) i++;
    if (i == t0 || i >= n || l[i] != ' ')
        return bad(out, 400, "bad_request", "malformed request line '%s' (want: METHOD /path HTTP/1.1)",
                   excerpt(l, n, ex, sizeof ex));
    const char *v = l + i + 1;
    const size_t vn = n - i - 1;
    if (vn != 8 || memcmp(v, "HTTP/", 5) != 0 || v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' ||
        v[7] > '9')
        return bad(out, 400, "bad_request", "malformed request line '%s' (want: METHOD /path HTTP/1.1)",
                   excerpt(l, n, ex, sizeof ex));
    if (v[5] != '1' || (v[7] != '0' && v[7] != '1'))
        return bad(out, 505, "http_version_not_supported", "HTTP version '%.8s' is not supported (HTTP/1.1 or 1.0)",
                   v);
    return SRV_HEAD_MORE;
}

/* v[0..n) without the spaces and tabs around it. */
static void trim(const char **v, size_t *n) {
    while (*n && (**v == ' ' || **v == '\t')) (*v)++, (*n)--;
    while (*n && ((*v)[*n - 1] == ' ' || (*v)[*n - 1] == '\t')) (*n)--;
}

typedef struct {
    int fields;
    bool has_cl, has_te;
    char cl[MAX_CL_DIGITS + 1]; /* the first Content-Length's digits */
} head_state;

static srv_head_verdict check_field(const char *l, size_t n, int line_no, head_state *hs, const srv_head_limits *lim,
                                    srv_head *out) {
    char ex[64];
    if (l[0] == ' ' || l[0] == '\t')
        return bad(out, 400, "bad_request", "header line %d is folded (starts with white space)", line_no);
    size_t i = 0;
    while (i < n && tchar((unsigned char)l[i])) i++;
    if (i == 0 || i >= n || l[i] != ':')
        return bad(out, 400, "bad_request", "malformed header line %d '%s' (want: Name: value)", line_no,
                   excerpt(l, n, ex, sizeof ex));
    const char *name = l;
    const size_t name_n = i;
    const char *v = l + i + 1;
    size_t vn = n - i - 1;
    for (size_t k = 0; k < vn; k++) {
        const unsigned char c = (unsigned char)v[k];
        if ((c < 0x20 && c != '\t') || c == 0x7f)
            return bad(out, 400, "bad_request", "header line %d has a control character (0x%02x) in its value",
                       line_no, c);
    }
    if (++hs->fields > lim->max_fields)
        return bad(out, 431, "header_too_large", "more than %d header fields", lim->max_fields);
    trim(&v, &vn);
    if (name_n == 14 && !strncasecmp(name, "Content-Length", 14)) {
        size_t d = 0;
        while (d < vn && v[d] >= '0' && v[d] <= '9') d++;
        if (vn == 0 || d != vn)
            return bad(out, 400, "bad_request", "bad Content-Length '%s' (want: a number of bytes)",
                       excerpt(v, vn, ex, sizeof ex));
        while (vn > 1 && v[0] == '0') v++, vn--; /* leading zeros: the same length */
        if (vn > MAX_CL_DIGITS)
            return bad(out, 413, "request_too_large", "Content-Length of %zu digits is too large", vn);
        if (hs->has_cl && (strlen(hs->cl) != vn || memcmp(hs->cl, v, vn) != 0))
            return bad(out, 400, "bad_request", "two different Content-Length values");
        memcpy(hs->cl, v, vn);
        hs->cl[vn] = 0;
        hs->has_cl = true;
    } else if (name_n == 17 && !strncasecmp(name, "Transfer-Encoding", 17)) {
        if (hs->has_te) return bad(out, 400, "bad_request", "two Transfer-Encoding fields");
        if (vn != 7 || strncasecmp(v, "chunked", 7) != 0)
            return bad(out, 501, "not_implemented", "Transfer-Encoding '%s' is not supported (chunked only)",
                       excerpt(v, vn, ex, sizeof ex));
        hs->has_te = true;
    }
    if (hs->has_cl && hs->has_te)
        return bad(out, 400, "bad_request", "Content-Length and Transfer-Encoding together");
    return SRV_HEAD_MORE;
}

srv_head_verdict srv_head_check(const char *buf, size_t n, const srv_head_limits *limits, srv_head *out) {
    memset(out, 0, sizeof *out);
    srv_head_limits lim = limits ? *limits : (srv_head_limits){0};
    if (lim.max_head == 0) lim.max_head = DEF_MAX_HEAD;
    if (lim.max_fields <= 0) lim.max_fields = DEF_MAX_FIELDS;
    head_state hs = {0};
    size_t pos = 0, head0 = 0;
    int empty = 0, line_no = 0;
    bool have_request_line = false;
    /* a first byte that cannot start a method (or an empty line): refused at once */
    if (n > 0 && !tchar((unsigned char)buf[0]) && buf[0] != '\r' && buf[0] != '\n')
        return bad(out, 400, "bad_request", "this is not an HTTP request (first byte 0x%02x)", (unsigned char)buf[0]);
    for (;;) {
        const size_t limit = n < head0 + lim.max_head ? n : head0 + lim.max_head;
        const char *nl = pos < limit ? memchr(buf + pos, '\n', limit - pos) : NULL;
        if (!nl) {
            /* the partial line within the limit: a control character already makes it bad (before the
             * size, so that a longer input never turns a prefix's 400 into a 431) */
            for (size_t k = pos; k < limit; k++) {
                const unsigned char c = (unsigned char)buf[k];
                if (((c < 0x20 && c != '\t' && c != '\r') || c == 0x7f) || (c == '\r' && k + 1 < limit))
                    return bad(out, 400, "bad_request", "line %d has a control character (0x%02x)", line_no + 1, c);
            }
            if (n - head0 >= lim.max_head) /* no end within the limit */
                return have_request_line
                           ? bad(out, 431, "header_too_large", "the request head is larger than %zu bytes",
                                 lim.max_head)
                           : bad(out, 414, "uri_too_long", "the request line is longer than %zu bytes",
                                 lim.max_head);
            return SRV_HEAD_MORE;
        }
        const char *l = buf + pos;
        size_t ln = (size_t)(nl - l);
        if (ln > 0 && l[ln - 1] == '\r') ln--;
        for (size_t k = 0; k < ln; k++)
            if (l[k] == '\r')
                return bad(out, 400, "bad_request", "line %d has a bare carriage return", line_no + 1);
        pos = (size_t)(nl - buf) + 1;
        if (!have_request_line) {
            if (ln == 0) { /* empty lines before the request line */
                if (++empty > MAX_LEADING_EMPTY)
                    return bad(out, 400, "bad_request", "more than %d empty lines before the request line",
                               MAX_LEADING_EMPTY);
                head0 = pos;
                continue;
            }
            line_no = 1;
            const srv_head_verdict v = check_request_line(l, ln, out);
            if (v != SRV_HEAD_MORE) return v;
            have_request_line = true;
            continue;
        }
        line_no++;
        if (ln == 0) { /* the blank line: the head is complete */
            out->head_len = pos;
            return SRV_HEAD_OK;
        }
        const srv_head_verdict v = check_field(l, ln, line_no, &hs, &lim, out);
        if (v != SRV_HEAD_MORE) return v;
    }
}

/* server/http_head: the check of an HTTP/1.x request head that the server
 * makes before libmicrohttpd parses it (server.c's front door).
 *
 * libmicrohttpd answers the requests it cannot parse itself, with fixed HTML
 * bodies (and, in 0.9.75, a bad Content-Length with its status line and
 * headers twice, a garbage request line with no answer at all). The server
 * therefore reads each new connection's first request head without taking it
 * off the socket (MSG_PEEK) and checks it here; a head that passes is one
 * libmicrohttpd accepts, so only the server's own JSON errors reach clients
 * (requests after the first on a keep-alive connection go to libmicrohttpd
 * unchecked).
 *
 * The rules (RFC 9112, stricter than libmicrohttpd where the RFC allows it):
 *   - up to 4 empty lines before the request line are skipped; lines end
 *     with CRLF or a bare LF;
 *   - request line: method (1..32 token characters) SP target (visible ASCII)
 *     SP HTTP/d.d; HTTP/1.0 and HTTP/1.1 only (another version: 505);
 *   - header fields: a token name, ':' right after it, a value of visible
 *     characters, spaces and tabs (no other control character; bytes >= 0x80
 *     allowed); no line folding (a line starting with a space or tab);
 *     at most max_fields fields;
 *   - Content-Length: digits only (after spaces), all copies equal; more than
 *     18 digits: 413; Transfer-Encoding: "chunked" only (else 501), never
 *     beside a Content-Length (request smuggling);
 *   - the head (request line to its blank line) at most max_head bytes: 431,
 *     or 414 while the request line itself is longer.
 * A problem in a complete line is reported as soon as the line is there (a
 * garbage first line gets its 400 without waiting for the rest), and so is a
 * first byte that cannot start a method (a TLS handshake, binary noise). */
#pragma once
#include <stdbool.h>
#include <stddef.h>

typedef enum {
    SRV_HEAD_MORE = 0, /* no verdict yet: the head is not complete and nothing is wrong so far */
    SRV_HEAD_OK,       /* a complete head that passes (head_len bytes) */
    SRV_HEAD_BAD,      /* refused: status, code and message say why */
} srv_head_verdict;

typedef struct {
    size_t max_head;   /* bytes of the head, its blank line included (0: 16384) */
    int max_fields;    /* header fields (0: 100) */
} srv_head_limits;

typedef struct {
    int status;        /* BAD: 400, 413, 414, 431, 501 or 505 */
    const char *code;  /* BAD: an OpenAI-style error code ("bad_request", "header_too_large", ...) */
    char message[192]; /* BAD: what is wrong (for the JSON error's message) */
    size_t head_len;   /* OK: bytes of the head, leading empty lines and the blank line included */
} srv_head;

/* Checks the first `n` bytes received on a connection (not NUL-terminated). */
srv_head_verdict srv_head_check(const char *buf, size_t n, const srv_head_limits *lim, srv_head *out);

/* http/http_answer: the OpenAI-style error answers that the server
 * (src/server) and the router (src/disagg/router.c) write alike, without an
 * HTTP library: the reason phrases, the JSON error body, and a whole error
 * answer written straight to a socket (for the bytes libmicrohttpd does not
 * answer as we want: the server's front door, http/mhd_pages.c). */
#pragma once
#include <stdbool.h>
#ifdef __cplusplus
extern "C" {
#endif

/* The reason phrase of a status the server or the router answers with
 * ("Error" for one it does not know). */
const char *st_http_reason(int status);

/* {"error":{"message":...,"type":...,"param":...,"code":...}}, OpenAI's shape:
 * type NULL is "invalid_request_error"; param and code NULL are null.
 * malloc'd (cJSON's allocator: free()); NULL when out of memory. */
char *st_http_error_json(const char *type, const char *code, const char *param, const char *message);

/* Writes a whole error answer to a connected socket: "HTTP/1.1 <status>
 * <reason>", Content-Type: application/json, its Content-Length,
 * Connection: close, then the JSON error (type NULL: invalid_request_error).
 * Waits at most wait_ms for room in the socket's send buffer (0: what fits
 * now); true when all of it was written. The caller closes the connection. */
bool st_http_send_error(int fd, int status, const char *type, const char *code, const char *message, int wait_ms);

#ifdef __cplusplus
}
#endif

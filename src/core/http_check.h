/* core/http_check: the checks of an HTTP request's headers that the server
 * (src/server) and the router (src/disagg/router.c) make alike, as pure string
 * functions (no HTTP library here). */
#pragma once
#include <stdbool.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Whether an Authorization header value presents `key` as a Bearer token (the
 * scheme in any case, RFC 9110 11.1, then spaces or tabs). Compares in time
 * independent of where the key differs. NULL header: false. */
bool st_http_bearer_ok(const char *authorization, const char *key);

/* Whether a Host header value names this machine: localhost, 127.0.0.1, [::1]
 * or `bound` (the address listened on; an IPv6 literal bracketed), with or
 * without a port (':' and 1 to 5 digits); "localhost." too. */
bool st_http_host_ok(const char *host, const char *bound);

/* Whether an address to listen on is a loopback one (localhost, 127.x, ::1). */
bool st_http_loopback(const char *host);

/* Whether a Content-Type value is application/json (any case, parameters allowed). */
bool st_http_json_ctype(const char *ct);

#ifdef __cplusplus
}
#endif

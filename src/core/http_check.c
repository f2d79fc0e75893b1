/* core/http_check: see http_check.h. */
#include "core/http_check.h"

#include <string.h>
#include <strings.h>

bool st_http_bearer_ok(const char *h, const char *key) {
    if (!h || !key || strncasecmp(h, "Bearer", 6) != 0 || (h[6] != ' ' && h[6] != '\t')) return false;
    const char *k = h + 6;
    while (*k == ' ' || *k == '\t') k++;
    const size_t n = strlen(key), m = strlen(k);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)key[i] ^ (unsigned char)(i < m ? k[i] : 0);
    return diff == 0;
}

bool st_http_host_ok(const char *h, const char *bound) {
    const size_t n = strlen(h);
    size_t name_len = n;
    if (h[0] == '[') { /* [v6]:port */
        const char *e = strchr(h, ']');
        if (!e) return false;
        name_len = (size_t)(e - h) + 1;
    } else {
        const char *colon = strchr(h, ':');
        if (colon) name_len = (size_t)(colon - h);
    }
    if (name_len < n) { /* a port: ':' and 1 to 5 digits */
        if (h[name_len] != ':' || n - name_len < 2 || n - name_len > 6) return false;
        for (size_t i = name_len + 1; i < n; i++)
            if (h[i] < '0' || h[i] > '9') return false;
    }
    if (name_len && h[name_len - 1] == '.' && h[0] != '[') name_len--; /* "localhost." */
    static const char *const names[] = {"localhost", "127.0.0.1", "[::1]"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == name_len && !strncasecmp(h, names[i], name_len)) return true;
    const size_t hl = strlen(bound);
    if (strchr(bound, ':')) /* an IPv6 literal: bracketed in Host */
        return name_len == hl + 2 && h[0] == '[' && !strncasecmp(h + 1, bound, hl);
    return name_len == hl && !strncasecmp(h, bound, hl);
}

bool st_http_loopback(const char *host) {
    return !strcasecmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1") ||
           !strcasecmp(host, "::ffff:127.0.0.1");
}

bool st_http_json_ctype(const char *ct) {
    if (!ct) return false;
    while (*ct == ' ' || *ct == '\t') ct++;
    static const char want[] = "application/json";
    if (strncasecmp(ct, want, sizeof want - 1) != 0) return false;
    const char *rest = ct + sizeof want - 1;
    while (*rest == ' ' || *rest == '\t') rest++;
    return *rest == '\0' || *rest == ';';
}

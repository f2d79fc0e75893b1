/* A growable NUL-terminated byte string (answers, metrics text, SSE frames). */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Zero-initialise ({0}) to start empty; st_strbuf_free releases p. */
typedef struct {
    char *p;      /* NUL-terminated once anything was added; NULL while empty */
    size_t len, cap;
} st_strbuf;

/* Appends n bytes of s; false when out of memory (b unchanged). */
bool st_strbuf_add(st_strbuf *b, const char *s, size_t n);
/* Appends printf-formatted text; false on a format or memory error. */
bool st_strbuf_printf(st_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void st_strbuf_free(st_strbuf *b); /* safe on an empty buffer */

#ifdef __cplusplus
}
#endif

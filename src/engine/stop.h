/* engine/stop: the stop-string filter of one sequence's output text.
 *
 * Text goes in piece by piece (as the detokenizer releases it); what comes
 * out can no longer be part of a stop string. Text that could be the start of
 * a stop string is held back until it is decided; when a stop string appears
 * the output ends just before its first occurrence (the earliest of all the
 * strings) and everything after it is dropped. Used by st_seq_postprocess
 * (engine/seq.h), the one place where stop ids and stop strings are checked.
 * No printing; errors through strata_status + st_err. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_stop_filter st_stop_filter;
/* Copies the strings (n_stop >= 0; 0: a filter that passes everything).
 * INVALID_ARG naming the string for an empty or invalid UTF-8 one; NOMEM.
 * *out owned by the caller (st_stop_filter_free); NULL on error. */
strata_status st_stop_filter_init(const char *const *stop, int n_stop, st_stop_filter **out);
void st_stop_filter_free(st_stop_filter *f); /* NULL: no-op */
/* Appends text; *out, *out_len: what may be emitted now (buffer owned by f,
 * valid until the next call); *stopped: a stop string was found (the output
 * ends just before it; everything after it is dropped and later pushes emit
 * nothing). NOMEM. */
strata_status st_stop_filter_push(st_stop_filter *f, const char *text, size_t len, const char **out,
                                  size_t *out_len, bool *stopped);
/* End of text: releases what was held back (nothing after a stop). */
void st_stop_filter_flush(st_stop_filter *f, const char **out, size_t *out_len);
/* The index of the stop string that was found, -1 while none. */
int st_stop_filter_hit(const st_stop_filter *f);
int st_stop_filter_count(const st_stop_filter *f);

#ifdef __cplusplus
}
#endif

/* http/mhd_pages: the answers libmicrohttpd writes by itself, made the
 * OpenAI-style JSON error the server and the router answer with.
 *
 * libmicrohttpd (0.9.75) refuses what it cannot parse with fixed HTML pages
 * (a malformed request line or header field, headers too large, an
 * unsupported HTTP version, a bad Content-Length, a malformed chunked body),
 * and writes a bad Content-Length's page with its status line and headers
 * twice (it queues the page while parsing the headers, then builds the
 * answer's headers again). It queues each page with MHD_queue_response
 * through its PLT, just after it logs "... HTTP response code is N
 * ('<html>...')" on the same thread. This module defines MHD_queue_response,
 * which comes first in the process's symbol lookup, so that libmicrohttpd's
 * own calls land here too:
 *   - a page so announced (st_mhd_note_log, from the daemon's external
 *     logger) is replaced by the JSON error with the same status and the
 *     page's text ("malformed request: <text>", Connection: close);
 *   - one announced while the request's headers are being parsed (a bad or
 *     too large Content-Length, HTTP/1.1 without Host), which libmicrohttpd
 *     would write twice, is written here straight to the socket
 *     (http_answer.h) and libmicrohttpd is told the queueing failed, so
 *     that it closes the connection without writing anything of its own;
 *   - every other call (the server's and router's own answers) goes to
 *     libmicrohttpd's MHD_queue_response unchanged.
 * Linking this module into a program is what replaces the pages; a daemon
 * whose logger does not call st_mhd_note_log keeps libmicrohttpd's pages. */
#pragma once
#include <stdbool.h>
#ifdef __cplusplus
extern "C" {
#endif

/* For a daemon's external logger (MHD_OPTION_EXTERNAL_LOGGER), with each of
 * its lines formatted: notes, for this thread, a page libmicrohttpd announces
 * it is about to write itself, and whether the request's headers were being
 * parsed. Returns the page's status (400..599: to be counted in /metrics), or
 * 0 for another line. */
int st_mhd_note_log(const char *line);

/* Whether a libmicrohttpd log line is routine here: a request whose headers it
 * refused (the page written here) and its closing of that connection. */
bool st_mhd_log_is_ours(const char *line);

#ifdef __cplusplus
}
#endif

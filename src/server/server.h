/* server: the OpenAI-compatible HTTP front of a model's engine (libmicrohttpd +
 * cJSON), over the public C API (include/strata.h) only.
 *
 * Routes:
 *   POST /v1/chat/completions   messages -> the model's chat template -> tokens
 *   POST /v1/completions        prompt (text or token ids)
 *       both answer whole (application/json, with usage) or, with
 *       "stream": true, as server-sent events: `data: {chunk}\n\n` ... then
 *       `data: [DONE]\n\n` (chunked transfer encoding)
 *   GET  /v1/models             the one model served
 *   GET  /health                200 {"status":"ok","role","running","waiting","kv_blocks_free",
 *                               "kv_blocks_total","queued_prompt_tokens"} (503 while shutting down)
 *   POST /pd/reserve, /pd/cancel (--role decode), /pd/prefill (--role prefill): prefill/decode
 *                               disaggregation (docs/ARCHITECTURE.md; server/pd_node.h)
 *   GET  /metrics               Prometheus text format (names in server.c; stable)
 * An API key, when set, is required on every /v1/ route, /health and /metrics as
 * `Authorization: Bearer KEY` (the scheme in any case; 401 otherwise), unless
 * metrics_public opens /health and /metrics for probes and scrapers.
 * Generation requests need `Content-Type: application/json` (415 otherwise: a
 * web page cannot post a form or text/plain body across sites without it).
 * Served on a loopback address, a Host header must name this machine
 * (localhost, 127.0.0.1, [::1] or the bound host, any port; 421 otherwise), so
 * that a page whose name was rebound to 127.0.0.1 cannot use the server.
 * A request naming a model other than the one served gets 404
 * (model_not_found); one without "model" is served.
 * Errors are OpenAI-style JSON {"error": {"message", "type", "param", "code"}}
 * with 400 (bad request), 401, 404 (no such route or model), 405 (wrong method, with
 * Allow), 413 (body over max_body), 415, 421, 500, 503 (queue full, shutting down);
 * a connection's first request head that is not well-formed HTTP/1.x (the
 * front door below) gets 400, 413, 414, 431, 501 or 505 in the same shape,
 * then the connection is closed. libmicrohttpd's own answers (HTML) remain
 * only for a malformed chunked body and for the heads of later requests on a
 * keep-alive connection; all are counted in /metrics.
 *
 * Shutdown (st_server_shutdown): new requests get 503, running ones may
 * finish for a while, then are aborted (streams end with an error event and
 * [DONE]).
 *
 * Front door: the server's watcher thread (below) owns the listening socket.
 * It accepts, applies the connection limits, and holds each new connection
 * until its first request head has arrived, looking at it with MSG_PEEK (the
 * bytes stay on the socket) and checking it (http_head.h: request line,
 * fields, Content-Length / Transfer-Encoding, at most 16 KiB and 100 fields);
 * a head that passes goes to libmicrohttpd with the socket
 * (MHD_USE_NO_LISTEN_SOCKET, MHD_add_connection), a refused one gets its JSON
 * error from the watcher. A connection in the front door costs no thread.
 *
 * Threads: libmicrohttpd polls the sockets with epoll in a pool of `threads`
 * threads (MHD_USE_EPOLL_INTERNAL_THREAD + MHD_OPTION_THREAD_POOL_SIZE), each
 * owning the connections handed to it; no thread waits for a connection. A
 * pool thread parses and tokenizes a request and adds it to the engine; then
 * the connection is suspended (MHD_suspend_connection), and the engine
 * thread's callbacks, which append text and mark the end, resume it
 * (MHD_resume_connection): a whole answer is queued once the engine has
 * finished it; a stream's content reader hands out what the engine has
 * produced and suspends the connection again when nothing is left (it never
 * returns 0 without suspending: no busy loop). One watcher thread of the
 * server's own does what a suspended connection cannot: it waits (epoll,
 * EPOLLRDHUP, one-shot) for the peers of requests in flight to go away,
 * resuming their connections so that their engine requests are aborted
 * (their sequence slots are freed at the next engine step), and it ends the
 * connections that miss a deadline (below) by shutting their sockets down.
 * Each request object is reference-counted between the connection, the
 * streaming response and the engine (on_finish drops the engine's
 * reference), so whichever finishes last frees it.
 *
 * Deadlines (each connection's, kept by the watcher thread):
 *   header_timeout_s  the request line and headers of a connection's first
 *                     request must have arrived within this many seconds of
 *                     its accept, and those of a later request on a keep-alive
 *                     connection within this many seconds of its first byte
 *                     (a request line without its end included); trickling
 *                     bytes does not extend it (slow loris);
 *   idle_timeout_s    a keep-alive connection must send the first byte of its
 *                     next request within this many seconds of the previous
 *                     answer's end;
 *                     plus one second: libmicrohttpd's inactivity timeout while
 *                     a body is read or an answer written (a connection waiting
 *                     for the engine is suspended and has none).
 * Limits, applied by the front door at accept (a connection over one is closed
 * at once and counted as refused): max_connections in all, those in the front
 * door included; max_connections_per_client from one remote address.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "server/pd_node.h"
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_server st_server;

typedef struct {
    const char *host;        /* address to bind (NULL: "127.0.0.1"); a name or an IPv4/IPv6 literal */
    int port;                /* 0: any free port (st_server_port tells which) */
    const char *api_key;     /* NULL or "": no key required */
    bool metrics_public;     /* with an API key: /health and /metrics still answer without it */
    const char *model_name;  /* the id in /v1/models and in answers (NULL: "strata") */
    size_t max_body;         /* request body limit in bytes (0: 1 MiB) */
    unsigned max_connections;/* simultaneous connections, the front door's included (0: 1024) */
    int max_connections_per_client; /* simultaneous connections from one remote address (0: 32, or no cap
                                     * when host is a loopback address; negative: no cap) */
    unsigned threads;        /* libmicrohttpd's pool of polling threads (0: 4; at most max_connections) */
    unsigned header_timeout_s; /* request line + headers deadline (0: 10), see above */
    unsigned idle_timeout_s; /* keep-alive wait for the next request, and inactivity (0: 60), see above */
    /* Device rates the caller measured at start-up, published in /metrics
     * beside the engine's step costs so that a benchmark client can compute
     * the roofline of the batches it drove (0: unknown, not published). */
    double device_read_bw;   /* bytes per second the device's memory streams (HBM; a large copy) */
    double gemm_rate;        /* FLOP/s of a large bf16 GEMM on the tensor cores */
    double gemm_rate_precise;/* FLOP/s of useful work on the backend's default (precise) matmul path */
    /* Prefill/decode disaggregation (server/pd_node.h): PD_ROLE_PREFILL serves /pd/prefill, PD_ROLE_DECODE
     * /pd/reserve, /pd/cancel and generation requests with X-Strata-PD-Ticket; both still serve the
     * OpenAI routes. pd_timeout_s: a decode node's wait for a reservation's blocks (0: 60). */
    pd_role role;
    double pd_timeout_s;
} st_server_params;

/* Starts serving model `m` (strata_model_load'ed, its engine thread started
 * and stopped by the caller: strata_start / strata_stop): its tokenizer for
 * prompts, its chat template in use for conversations (strata_chat_template
 * "none": chat completions are refused; the caller settles the template,
 * and its date, before). Borrows m: it must outlive the server, and the
 * chat template must not change while it serves. Strings in params are
 * copied. On success the server is listening and the
 * caller owns *out (st_server_stop). On error (an address that does not
 * resolve, a port in use) *out is NULL and the message says why. */
strata_status st_server_start(strata_model *m, const st_server_params *params, st_server **out);

/* The port it listens on, and the host as given. */
int st_server_port(const st_server *s);
const char *st_server_host(const st_server *s);

/* Graceful shutdown (SIGTERM): from now on generation requests and /health
 * are answered 503 (JSON error, code "server_shutting_down"; "Connection:
 * close"); the requests in flight get up to timeout_s seconds to finish
 * normally; what is left then is aborted: an open stream gets an error event
 * (`data: {"error": {...}}`) and `data: [DONE]`, a whole answer a 503 JSON
 * error. Returns when every generation request has been answered (at most
 * a few seconds after the abort; the engine must still be stepping), with
 * the number aborted. Call st_server_stop afterwards. NULL: 0. */
int64_t st_server_shutdown(st_server *s, double timeout_s);

/* Ends a shutdown's drain now (thread-safe; e.g. on a second signal): the
 * requests in flight are aborted as at the end of the timeout. */
void st_server_abort(st_server *s);

/* Stops accepting, ends every connection (their engine requests are aborted
 * and waited for: the engine must still be stepping, or stopped), and frees
 * the server. NULL is a no-op. */
void st_server_stop(st_server *s);

#ifdef __cplusplus
}
#endif

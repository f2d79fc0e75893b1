/* The HTTP server over libmicrohttpd (epoll, a pool of threads, suspended
 * connections). See server.h.
 *
 * Prometheus metrics (names are stable):
 *   strata_http_requests_total{route,code}          counter
 *   strata_http_stream_disconnects_total            counter  clients gone before the end
 *   strata_http_connections_open                    gauge    connections accepted and not yet closed
 *   strata_http_connections_refused_total           counter  closed at accept: over max_connections or
 *                                                            max_connections_per_client
 *   strata_http_connections_timed_out_total{phase}  counter  closed by a deadline: headers (header_timeout_s),
 *                                                            idle (idle_timeout_s, keep-alive)
 *   strata_requests_running / _waiting              gauges   sequences in slots / queued
 *   strata_requests_finished_total{reason}          counter  stop, length, abort, error
 *   strata_prompt_tokens_total                      counter  prompt tokens computed
 *   strata_generation_tokens_total                  counter  tokens sampled
 *   strata_engine_steps_total, strata_preemptions_total          counters
 *   strata_kv_blocks_used / _total, strata_kv_block_size_tokens   gauges
 *   strata_prefix_cache_queries_total / _hits_total counters (prompt tokens)
 *   strata_prefix_cache_hit_rate                    gauge    hits / queries (0 before any)
 *   strata_prefix_cache_hit_tokens_total{tier}      counter  hits by KV tier: device, host, ssd
 *   strata_kv_blocks{tier,state}                    gauge    blocks per tier (device, host, ssd) and
 *                                                            state (used, cached, free)
 *   strata_kv_transfer_bytes_total{direction}       counter  device_to_host, host_to_device,
 *                                                            host_to_ssd, ssd_to_host
 *   strata_kv_swaps_total                           counter  preempted sequences whose KV came back
 *                                                            from a lower tier
 *   strata_spec_draft_tokens_total{result}          counter  speculative drafts verified: accepted,
 *                                                            rejected
 *   strata_time_to_first_token_seconds              histogram
 *   strata_time_between_tokens_seconds              histogram
 *   strata_request_duration_seconds                 histogram (engine add -> finish)
 *   strata_max_batch, strata_max_model_len          gauges   configuration
 * For rooflines (bench/bench_serve.py reads them):
 *   strata_engine_step_tokens_total                 counter  tokens the forward passes ran
 *   strata_engine_step_seconds_total                counter  wall time of the steps that ran the model
 *   strata_engine_forward_seconds_total             counter  of which in forward passes
 *   strata_decode_steps_total, strata_decode_tokens_total, strata_decode_kv_tokens_total,
 *   strata_decode_seconds_total                     counters decode-only steps: how many, tokens
 *                                                            (= sequences), keys attended, wall time
 *   strata_model_weight_bytes_per_step, strata_model_kv_bytes_per_token,
 *   strata_model_flops_per_token, strata_model_attention_flops_per_pair   gauges (strata_engine_info)
 *   strata_device_read_bytes_per_second, strata_gemm_flops_per_second,
 *   strata_gemm_precise_flops_per_second            gauges   measured at start-up (absent: unknown)
 *
 * Locks, in the order they may be taken: s->mu (connections, requests, counts
 * of requests in flight), a request's r->mu (its text and state),
 * libmicrohttpd's own (MHD_resume_connection, MHD_suspend_connection), the
 * engine's (strata_abort). s->stat_mu and s->log_mu are leaves: nothing is
 * taken under them, so that libmicrohttpd may log while it holds its locks.
 * The engine calls on_text / on_finish holding none of its locks.
 */
#include "server/server.h"
#include "core/core.h"
#include "core/http_check.h"
#include "core/json.h"
#include "core/strbuf.h"
#include "http/http_answer.h"
#include "http/mhd_pages.h"

#include <ctype.h>
#include <errno.h>
#include <microhttpd.h>
#include <linux/tcp.h> /* struct tcp_info with tcpi_bytes_received (glibc's is older) */
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/http_head.h"
#include "server/pd_node.h"
#include "server/openai.h"

#define DEF_MAX_BODY (1u << 20)
#define DEF_MAX_CONN 1024
#define DEF_PER_CLIENT 32
#define DEF_THREADS 4
#define DEF_HEADER_TIMEOUT 10
#define DEF_IDLE_TIMEOUT 60
/* After a shutdown aborts the requests in flight, how long it waits for the
 * engine's on_finish (the abort takes effect at the next engine step) before
 * ending the answers without it. */
#define ABORT_GRACE_S 5.0
/* An oversized body without a Content-Length is read and dropped up to this
 * many times the limit before the connection is simply closed. */
#define DISCARD_FACTOR 16
/* "no deadline" for the watcher */
#define NO_DEADLINE 1e300
/* refused connections are logged as a warning at most this often (seconds) */
#define REFUSED_LOG_EVERY 10.0
/* the front door (a connection's first request head, checked before libmicrohttpd parses it):
 * the largest head and the most header fields it lets through, how long a connection refused
 * there may still send before it is closed, and how long accepting pauses when the process is
 * out of file descriptors */
#define HEAD_MAX 16384
#define HEAD_FIELDS 100
/* what the front door peeks at: a head of HEAD_MAX after the empty lines http_head.h allows
 * before it, and one byte more */
#define HEAD_PEEK (HEAD_MAX + 16)
#define LINGER_S 2.0
#define ACCEPT_PAUSE_S 0.1
/* libmicrohttpd's memory per connection: room for a HEAD_MAX head, its fields and the answer's
 * headers (its default, 32 KiB, is not: a head it cannot hold gets its own HTML 431) */
#define MHD_CONN_MEMORY (64 * 1024)
/* the watcher's epoll data: 0 its wake-up; request serials (peers of requests in flight);
 * the listening socket; connections in the front door (EV_FRONT | their id) */
#define EV_LISTEN (1ull << 63)
#define EV_FRONT (1ull << 62)

typedef enum {
    R_CHAT = 0, R_COMPLETIONS, R_MODELS, R_HEALTH, R_METRICS, R_PD_RESERVE, R_PD_PREFILL, R_PD_CANCEL, R_OTHER, R_COUNT_
} route;
static const char *const ROUTE_NAMES[R_COUNT_] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                  "/health", "/metrics", "/pd/reserve", "/pd/prefill",
                                                  "/pd/cancel", "other"};
static const int CODES[] = {200, 400, 401, 404, 405, 413, 414, 415, 421, 429, 431, 499, 500, 501, 503, 505};
#define N_CODES ((int)(sizeof CODES / sizeof CODES[0]))

typedef struct req req;
typedef struct conn conn;

struct st_server {
    strata_model *model;
    pd_node *pd;                  /* P-D role prefill or decode (NULL: both, a single server) */
    int64_t max_seq_len;          /* the engine's (strata_engine_info) */
    strata_engine_info info;      /* the engine's parameters and step costs (fixed) */
    char *host, *api_key, *model_name;
    size_t max_body;
    bool metrics_public;          /* /health and /metrics open even with an API key */
    unsigned max_conn, per_client; /* connections in all, from one address (0: no cap) */
    int listen_fd;                /* the listening socket (the front door accepts) */
    char *peek;                   /* [HEAD_PEEK]: the front door's view of a head (the watcher's) */
    bool loopback;                /* bound to a loopback address: Host must name this machine */
    int port;
    unsigned header_timeout, idle_timeout; /* seconds */
    long long created;
    double device_read_bw, gemm_rate, gemm_rate_precise;
    uint64_t seed_base;
    struct MHD_Daemon *d;
    atomic_bool draining;         /* shutting down: new generation requests (and /health) get 503 */
    atomic_bool stopping;         /* requests in flight are being aborted (streams end with an error event) */
    atomic_bool ending;           /* answers end now, without waiting for the engine (no more suspending) */
    atomic_uint_fast64_t counter; /* request numbers: ids and default seeds */

    pthread_mutex_t mu;           /* guards what follows */
    pthread_cond_t cv;            /* n_engine or n_active dropped (CLOCK_MONOTONIC) */
    int64_t n_engine;             /* requests whose on_finish has not come yet */
    int64_t n_active;             /* generation requests submitted and not yet answered (until on_completed) */
    req *reqs;                    /* requests on their connections: from their headers to on_completed */
    conn *conns;                  /* connections: from accept to close */
    int64_t n_conns;
    uint64_t next_serial;         /* request serials (the watcher's epoll data; 0: its wake-up) */
    uint64_t next_conn_id;        /* front-door connection ids (the watcher's epoll data with EV_FRONT) */
    double accept_resume;         /* out of file descriptors: accepting resumes then (0: accepting) */
    double watch_until;           /* when the watcher wakes next (NO_DEADLINE: only when woken) */
    bool watch_quit;

    /* the watcher thread: peers of requests in flight (EPOLLRDHUP, one-shot) and deadlines */
    int ep, wake_fd;              /* epoll; eventfd (in ep, data 0) that wakes it */
    pthread_t watcher;
    bool watcher_started;

    pthread_mutex_t stat_mu;      /* a leaf: guards the counters below */
    int64_t http[R_COUNT_][N_CODES + 1]; /* the last column: other codes */
    int64_t disconnects;
    int64_t timed_out_headers, timed_out_idle;
    int64_t refused;
    double refused_logged;        /* when a refusal was last logged as a warning */
    pthread_mutex_t log_mu;       /* a leaf: guards mhd_msg */
    char mhd_msg[256];            /* libmicrohttpd's last log line (for start errors) */
};

/* ---- connections ------------------------------------------------------------------------------
 * One per accepted socket, in s->conns from its accept to its close. The
 * watcher thread accepts it and holds it in the front door (`front`: the
 * server owns the socket) until its first request head has arrived and
 * passed the check of http_head.h; then it hands the socket to libmicrohttpd
 * (MHD_add_connection: `handed`) and the connection becomes libmicrohttpd's
 * socket context at its notify_connection (started) until its close
 * (closed). A head refused in the front door gets the server's own JSON
 * error and the socket lingers (`lingering`: input read and dropped) for
 * LINGER_S before it is closed, so that the client reads the answer. Its
 * deadline, when set, is kept by the watcher thread: in the front door it
 * closes the socket; for libmicrohttpd's it shuts the socket down
 * (libmicrohttpd then sees the end of the stream and closes the connection;
 * the socket stays open until notify_connection says closed, which takes
 * s->mu). */
typedef enum { CONN_HEAD = 0, CONN_BUSY, CONN_IDLE } conn_phase;

struct conn {
    conn *prev, *next;            /* s->conns, under s->mu */
    int fd;
    conn_phase phase;             /* under s->mu: waiting for a request's head, serving one, idle (keep-alive) */
    double deadline;              /* under s->mu: st_time_now() seconds; 0: none */
    char addr[64];                /* the peer's address, for logs and the per-client cap */
    /* the front door (under s->mu; the socket's I/O there is the watcher thread's) */
    bool front;                   /* the server owns the socket: its first head is awaited */
    bool lingering;               /* front: refused, its answer sent; input dropped until the close */
    bool handed;                  /* given to libmicrohttpd, whose notify_connection has not come yet */
    uint64_t id;                  /* front: the watcher's epoll data (with EV_FRONT) */
    /* libmicrohttpd's, idle (keep-alive): when the idle deadline is (0: not checked for bytes, the
     * deadline is it), the bytes received on the socket when it became idle (TCP_INFO) */
    double idle_end;
    uint64_t idle_rx;
    /* the bytes received on the socket at the access handler's last call for the request being
     * served (the connection's thread only): its idle_rx once it is answered (a client sends its
     * next request after the answer, maybe before libmicrohttpd says the request completed) */
    uint64_t req_rx;
    bool req_rx_known;
    struct sockaddr_storage sa;   /* the peer's address, for MHD_add_connection */
    socklen_t salen;
};

/* ---- one HTTP request ------------------------------------------------------------------------
 * References: the connection (until libmicrohttpd's request-completed
 * notice), the streaming response (until its free callback), the engine
 * (until on_finish). */
struct req {
    st_server *srv;
    req *prev, *next;           /* s->reqs, under s->mu (listed from the first call to on_completed) */
    bool listed;
    uint64_t serial;            /* set when listed: the watcher's name for it */
    pthread_mutex_t mu;
    int refs;                   /* under mu */
    route rt;
    struct MHD_Connection *c;   /* the connection (until on_completed) */
    conn *k;                    /* its socket context (NULL: not tracked) */
    int fd;                     /* the connection's socket */
    bool watched;               /* fd is in s->ep (the connection's thread only) */
    /* body */
    st_strbuf body;
    bool too_large;
    size_t discarded;
    /* generation */
    srv_answer_meta meta;
    char id[48];
    bool stream, include_usage;
    bool waiting;               /* a whole answer: submitted, waiting for the end (the connection's thread) */
    int64_t n_prompt;
    bool active;                /* counted in srv->n_active (under srv->mu) */
    /* under mu */
    uint64_t eid;               /* engine id (0: not added) */
    bool suspended;             /* its connection is suspended: whoever clears this resumes it */
    bool peer_closed;           /* the watcher saw the peer go (EPOLLRDHUP / HUP / ERR) */
    bool aborted;               /* this side aborted it (client gone, shutdown) */
    st_strbuf text;             /* filled by the engine thread: non-streamed: everything; streamed: not yet sent */
    bool finished;
    strata_finish fin;          /* detail: a static string; error: NULL (fin_error) */
    char *fin_error;
    /* streaming: owned by the connection's thread (the content reader) */
    st_strbuf out;
    size_t out_pos;
    bool role_sent, done;
    /* P-D: a /pd/ request waiting for the engine (reserve) or a prefill (the connection's thread
     * suspends it; pd_ready under mu) */
    int pd_wait;                /* 0: none, 1: reserve, 2: prefill */
    bool pd_ready;
    strata_status pd_st;
    char pd_err[256];
    strata_kv_reservation pd_res;
    int32_t *pd_ids;
    int64_t pd_n;
    pd_prefill_result pd_pre;
};

static req *req_new(st_server *s) {
    req *r = st_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->srv = s;
    r->refs = 1;
    r->fd = -1;
    pthread_mutex_init(&r->mu, NULL);
    return r;
}

static void req_ref(req *r) {
    pthread_mutex_lock(&r->mu);
    r->refs++;
    pthread_mutex_unlock(&r->mu);
}

static void req_unref(req *r) {
    pthread_mutex_lock(&r->mu);
    const bool last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (!last) return;
    pthread_mutex_destroy(&r->mu);
    st_free(r->body.p);
    st_free(r->text.p);
    st_free(r->out.p);
    st_free(r->fin_error);
    st_free(r->pd_ids);
    st_free(r);
}

/* Resumes r's connection if it is suspended (r->mu held). Any thread. */
static void req_wake_locked(req *r) {
    if (!r->suspended) return;
    r->suspended = false;
    MHD_resume_connection(r->c);
}

/* Suspends r's connection (r->mu held; the connection's thread, from the
 * access handler or the content reader, which then return without an answer
 * or with 0 bytes). Whoever changes what the reader or handler waits for
 * does so under r->mu and then calls req_wake_locked. */
static void req_suspend_locked(req *r) {
    r->suspended = true;
    MHD_suspend_connection(r->c);
}

/* ---- the watcher thread -------------------------------------------------------------------------*/
static void watcher_wake(st_server *s) {
    const uint64_t one = 1;
    if (write(s->wake_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        st_log(STRATA_LOG_WARN, "server: cannot wake the watcher thread: %s", strerror(errno));
}

/* The bytes received so far on TCP socket fd (read by the application or not); false: not known. */
static bool tcp_bytes_received(int fd, uint64_t *out) {
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    memset(&ti, 0, sizeof ti);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0 ||
        len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof ti.tcpi_bytes_received)
        return false;
    *out = ti.tcpi_bytes_received;
    return true;
}

/* When an idle keep-alive connection's socket is checked next for the bytes of a next request:
 * every header_timeout / 2 (at least 1 s), on a grid of quarter seconds (so that the checks of
 * many connections share the watcher's wake-ups), and not after idle_end. */
static double idle_check_at(const st_server *s, double now, double idle_end) {
    const double t = ceil((now + (s->header_timeout > 2 ? s->header_timeout / 2.0 : 1.0)) * 4.0) / 4.0;
    return t < idle_end ? t : idle_end;
}

/* Sets connection k's phase and its deadline `secs` from now (0: none) (s->mu held). An idle
 * keep-alive connection of libmicrohttpd's is checked (idle_check_at) for bytes received
 * since it became idle (libmicrohttpd reads them at once: TCP_INFO counts them): the next
 * request has then begun, and has header_timeout from that check for its head, however its
 * bytes trickle in, its request line complete or not (libmicrohttpd would wait for a line end
 * until its inactivity timeout, and close a garbage line at once without an answer). */
static void conn_phase_locked(st_server *s, conn *k, conn_phase ph, unsigned secs) {
    const double now = st_time_now();
    k->idle_end = 0;
    k->phase = ph;
    k->deadline = secs ? now + (double)secs : 0;
    bool rx_known = false;
    if (ph == CONN_IDLE) { /* the connection's thread (on_completed): req_rx is its own */
        rx_known = k->req_rx_known;
        k->req_rx_known = false;
    }
    if (ph == CONN_IDLE && secs && !k->front && !k->handed && k->fd >= 0 &&
        (rx_known ? (k->idle_rx = k->req_rx, true) : tcp_bytes_received(k->fd, &k->idle_rx))) {
        k->idle_end = k->deadline;
        k->deadline = idle_check_at(s, now, k->idle_end);
    }
    if (k->deadline > 0 && k->deadline < s->watch_until) {
        s->watch_until = k->deadline;
        watcher_wake(s);
    }
}

/* Counts a reply in /metrics. */
static void count_reply(st_server *s, route rt, int status) {
    int col = N_CODES;
    for (int i = 0; i < N_CODES; i++)
        if (CODES[i] == status) col = i;
    pthread_mutex_lock(&s->stat_mu);
    s->http[rt][col]++;
    pthread_mutex_unlock(&s->stat_mu);
}

/* Unlinks connection k and frees it (s->mu held); closes its socket when the server owns it. */
static void conn_drop_locked(st_server *s, conn *k) {
    if (k->front && k->fd >= 0) close(k->fd); /* also out of the watcher's epoll */
    if (k->prev) k->prev->next = k->next;
    else s->conns = k->next;
    if (k->next) k->next->prev = k->prev;
    s->n_conns--;
    st_free(k);
}

/* Ends connection k, whose deadline passed (s->mu held); an idle one's check for the bytes of
 * a next request gives it its next deadline instead. Returns k's deadline now (0: none, or k
 * is freed). */
static double conn_expire_locked(st_server *s, conn *k) {
    if (!k->front && !k->handed && k->phase == CONN_IDLE && k->idle_end > 0) {
        const double now = st_time_now();
        uint64_t rx;
        if (tcp_bytes_received(k->fd, &rx) && rx > k->idle_rx) {
            /* a next request has begun and libmicrohttpd has not seen its request line */
            st_log(STRATA_LOG_DEBUG, "server: connection from %s: a request began; its head is due within %u s",
                   k->addr, s->header_timeout);
            conn_phase_locked(s, k, CONN_HEAD, s->header_timeout);
            return k->deadline;
        }
        if (now < k->idle_end) {
            k->deadline = idle_check_at(s, now, k->idle_end);
            return k->deadline;
        }
    }
    if (k->handed) { /* libmicrohttpd took the socket and never started it (it closed it): forget it */
        conn_drop_locked(s, k);
        return 0;
    }
    if (k->front) {
        if (!k->lingering) {
            pthread_mutex_lock(&s->stat_mu);
            s->timed_out_headers++;
            pthread_mutex_unlock(&s->stat_mu);
            st_log(STRATA_LOG_INFO, "server: connection from %s: request headers not complete within %u s; closed",
                   k->addr, s->header_timeout);
        }
        conn_drop_locked(s, k);
        return 0;
    }
    const conn_phase ph = k->phase;
    k->deadline = 0;
    shutdown(k->fd, SHUT_RDWR);
    pthread_mutex_lock(&s->stat_mu);
    if (ph == CONN_IDLE) s->timed_out_idle++;
    else s->timed_out_headers++;
    pthread_mutex_unlock(&s->stat_mu);
    if (ph == CONN_IDLE)
        st_log(STRATA_LOG_DEBUG, "server: connection from %s: no request within %u s; closed", k->addr,
               s->idle_timeout);
    else
        st_log(STRATA_LOG_INFO, "server: connection from %s: request headers not complete within %u s; closed",
               k->addr, s->header_timeout);
    return 0;
}

/* The peer of request `serial` went away: resume its connection, whose
 * handler or reader then aborts it. */
static void peer_closed(st_server *s, uint64_t serial) {
    pthread_mutex_lock(&s->mu);
    for (req *r = s->reqs; r; r = r->next)
        if (r->serial == serial) {
            pthread_mutex_lock(&r->mu);
            r->peer_closed = true;
            req_wake_locked(r);
            pthread_mutex_unlock(&r->mu);
            break;
        }
    pthread_mutex_unlock(&s->mu);
}


/* ---- the front door (the watcher thread) ------------------------------------------------------
 * Accepts connections and holds each until its first request head has
 * arrived (read with MSG_PEEK: the bytes stay for libmicrohttpd) and passed
 * srv_head_check; then hands the socket to libmicrohttpd. A refused head
 * gets a JSON error here (libmicrohttpd's own would be HTML), counted in
 * /metrics under the route "other". */

static void count_refused(st_server *s) {
    const double now = st_time_now();
    pthread_mutex_lock(&s->stat_mu);
    const int64_t refused = ++s->refused;
    const bool say = now - s->refused_logged >= REFUSED_LOG_EVERY;
    if (say) s->refused_logged = now;
    pthread_mutex_unlock(&s->stat_mu);
    st_log(say ? STRATA_LOG_WARN : STRATA_LOG_DEBUG,
           "server: a connection was refused: over --max-connections or --max-connections-per-client "
           "(%lld refused so far)", (long long)refused);
}

/* The front-door connection with this id (s->mu held), or NULL when it is gone. */
static conn *front_find_locked(st_server *s, uint64_t id) {
    for (conn *k = s->conns; k; k = k->next)
        if (k->front && k->id == id) return k;
    return NULL;
}

/* Closes front-door connection k (the watcher thread). */
static void front_close(st_server *s, conn *k) {
    pthread_mutex_lock(&s->mu);
    conn_drop_locked(s, k);
    pthread_mutex_unlock(&s->mu);
}

/* Reads and drops what k's peer sends (a refused connection lingering); false at its end. */
static bool front_drain(conn *k) {
    char buf[4096];
    for (;;) {
        const ssize_t n = recv(k->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n > 0) continue;
        return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    }
}

/* Answers k's refused head with the OpenAI-style error, then lets the socket linger. */
static void front_refuse(st_server *s, conn *k, const srv_head *h) {
    if (!st_http_send_error(k->fd, h->status, "invalid_request_error", h->code, h->message, 0))
        st_log(STRATA_LOG_DEBUG, "server: connection from %s: cannot send the %d answer: %s", k->addr, h->status,
               strerror(errno));
    count_reply(s, R_OTHER, h->status);
    st_log(STRATA_LOG_DEBUG, "server: connection from %s: %d %s", k->addr, h->status, h->message);
    shutdown(k->fd, SHUT_WR);
    const bool open = front_drain(k);
    pthread_mutex_lock(&s->mu);
    if (!open) {
        conn_drop_locked(s, k);
    } else {
        k->lingering = true;
        k->deadline = st_time_now() + LINGER_S;
        if (k->deadline < s->watch_until) s->watch_until = k->deadline;
    }
    pthread_mutex_unlock(&s->mu);
}

/* Gives k's socket to libmicrohttpd (its head passed). */
static void front_hand_over(st_server *s, conn *k) {
    pthread_mutex_lock(&s->mu);
    epoll_ctl(s->ep, EPOLL_CTL_DEL, k->fd, NULL);
    k->front = false;
    k->handed = true; /* notify_connection (started) attaches it, on a pool thread */
    const int fd = k->fd;
    const struct sockaddr_storage sa = k->sa;
    const socklen_t salen = k->salen;
    pthread_mutex_unlock(&s->mu);
    if (MHD_add_connection(s->d, fd, (const struct sockaddr *)&sa, salen) != MHD_YES) {
        /* libmicrohttpd closed the socket (over its limit, out of memory) */
        st_log(STRATA_LOG_WARN, "server: libmicrohttpd did not take a connection: %s", strerror(errno));
        pthread_mutex_lock(&s->mu);
        for (conn *c = s->conns; c; c = c->next)
            if (c == k && c->handed) {
                conn_drop_locked(s, c);
                break;
            }
        pthread_mutex_unlock(&s->mu);
    }
}

/* Looks at what front-door connection `id` has received (the watcher thread). */
static void front_event(st_server *s, uint64_t id, uint32_t events) {
    pthread_mutex_lock(&s->mu);
    conn *k = front_find_locked(s, id);
    const bool lingering = k && k->lingering;
    pthread_mutex_unlock(&s->mu);
    if (!k) return;
    const bool hup = (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0;
    if (lingering) {
        if (!front_drain(k) || hup) front_close(s, k);
        return;
    }
    const ssize_t n = recv(k->fd, s->peek, HEAD_PEEK, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0) {
        if ((errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) && !hup) return;
        front_close(s, k);
        return;
    }
    if (n == 0) { /* gone before sending a request */
        front_close(s, k);
        return;
    }
    srv_head h;
    const srv_head_limits lim = {.max_head = HEAD_MAX, .max_fields = HEAD_FIELDS};
    switch (srv_head_check(s->peek, (size_t)n, &lim, &h)) {
    case SRV_HEAD_OK:
        front_hand_over(s, k);
        break;
    case SRV_HEAD_BAD:
        front_refuse(s, k, &h);
        break;
    case SRV_HEAD_MORE:
        if (hup) front_close(s, k); /* the peer stopped sending with the head incomplete */
        break;
    }
}

/* Accepts the connections waiting on the listening socket (the watcher thread). */
static void front_accept(st_server *s) {
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t salen = sizeof sa;
        const int fd = accept4(s->listen_fd, (struct sockaddr *)&sa, &salen, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            /* out of descriptors or memory: pause accepting (the listening socket stays readable) */
            st_log(STRATA_LOG_WARN, "server: accept: %s; accepting again in %.1f s", strerror(errno), ACCEPT_PAUSE_S);
            pthread_mutex_lock(&s->mu);
            epoll_ctl(s->ep, EPOLL_CTL_DEL, s->listen_fd, NULL);
            s->accept_resume = st_time_now() + ACCEPT_PAUSE_S;
            pthread_mutex_unlock(&s->mu);
            return;
        }
        char addr[64] = "?";
        getnameinfo((struct sockaddr *)&sa, salen, addr, sizeof addr, NULL, 0, NI_NUMERICHOST);
        conn *k = st_calloc(1, sizeof *k);
        pthread_mutex_lock(&s->mu);
        int64_t same = 0;
        for (conn *c = s->conns, *nc; c; c = nc) {
            nc = c->next;
            if (c->handed && c->fd == fd) { /* libmicrohttpd dropped it before starting it: the number is free */
                conn_drop_locked(s, c);
                continue;
            }
            if (s->per_client && !strcmp(c->addr, addr)) same++;
        }
        const bool refuse = !k || s->n_conns >= (int64_t)s->max_conn || (s->per_client && same >= s->per_client);
        if (!refuse) {
            k->fd = fd;
            k->front = true;
            k->id = ++s->next_conn_id;
            k->sa = sa;
            k->salen = salen;
            snprintf(k->addr, sizeof k->addr, "%s", addr);
            k->next = s->conns;
            if (s->conns) s->conns->prev = k;
            s->conns = k;
            s->n_conns++;
            conn_phase_locked(s, k, CONN_HEAD, s->header_timeout);
            /* edge-triggered: each arrival of bytes is an event, though the peeked ones stay unread */
            struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data.u64 = EV_FRONT | k->id};
            if (epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &e) != 0) {
                st_log(STRATA_LOG_WARN, "server: cannot watch a new connection: %s", strerror(errno));
                conn_drop_locked(s, k);
                k = NULL;
            }
        }
        const uint64_t id = k && !refuse ? k->id : 0;
        pthread_mutex_unlock(&s->mu);
        if (refuse) {
            close(fd);
            st_free(k);
            count_refused(s);
            continue;
        }
        if (id) front_event(s, id, 0); /* the head may be there already */
    }
}

static void *watcher_main(void *arg) {
    st_server *s = arg;
    struct epoll_event ev[64];
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->watch_quit) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        const double now = st_time_now();
        double next = NO_DEADLINE;
        for (conn *k = s->conns, *nk; k; k = nk) {
            nk = k->next; /* k may be freed */
            if (k->deadline <= 0) continue;
            const double d = k->deadline <= now ? conn_expire_locked(s, k) : k->deadline;
            if (d > 0 && d < next) next = d;
        }
        if (s->accept_resume > 0 && s->accept_resume <= now) { /* out of descriptors a while ago: try again */
            s->accept_resume = 0;
            struct epoll_event le = {.events = EPOLLIN, .data.u64 = EV_LISTEN};
            epoll_ctl(s->ep, EPOLL_CTL_ADD, s->listen_fd, &le);
        } else if (s->accept_resume > 0 && s->accept_resume < next) {
            next = s->accept_resume;
        }
        s->watch_until = next;
        pthread_mutex_unlock(&s->mu);
        int ms = -1;
        if (next < NO_DEADLINE) {
            const double wait_ms = (next - now) * 1000.0 + 1.0;
            ms = wait_ms > 3600e3 ? 3600000 : (int)wait_ms + 1;
        }
        const int n = epoll_wait(s->ep, ev, (int)(sizeof ev / sizeof ev[0]), ms);
        if (n < 0 && errno != EINTR) {
            st_log(STRATA_LOG_ERROR, "server: watcher: epoll_wait: %s", strerror(errno));
            break;
        }
        for (int i = 0; i < n; i++) {
            const uint64_t d = ev[i].data.u64;
            if (d == 0) {
                uint64_t v;
                while (read(s->wake_fd, &v, sizeof v) > 0) {
                }
                continue;
            }
            if (d == EV_LISTEN) front_accept(s);
            else if (d & EV_FRONT) front_event(s, d & ~EV_FRONT, ev[i].events);
            else peer_closed(s, d);
        }
    }
    return NULL;
}

/* Watches r's peer for going away (the connection's thread). */
static void watch_peer(st_server *s, req *r) {
    if (r->fd < 0 || r->watched) return;
    struct epoll_event e = {.events = EPOLLRDHUP | EPOLLONESHOT, .data.u64 = r->serial};
    if (epoll_ctl(s->ep, EPOLL_CTL_ADD, r->fd, &e) == 0) r->watched = true;
    else st_log(STRATA_LOG_WARN, "server: %s: cannot watch the connection: %s", r->id, strerror(errno));
}

static void unwatch_peer(st_server *s, req *r) {
    if (!r->watched) return;
    epoll_ctl(s->ep, EPOLL_CTL_DEL, r->fd, NULL);
    r->watched = false;
}

/* ---- engine callbacks (engine thread) ------------------------------------------------------*/
static void on_text(void *user, const char *text, size_t len) {
    req *r = user;
    pthread_mutex_lock(&r->mu);
    if (!st_strbuf_add(&r->text, text, len)) st_log(STRATA_LOG_ERROR, "server: %s: out of memory for the answer", r->id);
    if (r->stream) req_wake_locked(r); /* a whole answer waits for the end */
    pthread_mutex_unlock(&r->mu);
}

static void on_finish(void *user, const strata_finish *f) {
    req *r = user;
    st_server *s = r->srv;
    st_log(STRATA_LOG_INFO, "server: %s: %s (%s), %lld prompt + %lld completion tokens, queue %.3f s, ttft %.3f s, total %.3f s",
           r->id, strata_finish_reason_str(f->reason), f->detail, (long long)f->prompt_tokens,
           (long long)f->completion_tokens, f->queue_s, f->ttft_s, f->total_s);
    pthread_mutex_lock(&r->mu);
    r->finished = true;
    r->fin = *f;
    r->fin.error = NULL;
    if (f->error) r->fin_error = st_strdup(f->error);
    req_wake_locked(r);
    pthread_mutex_unlock(&r->mu);
    req_unref(r);
    pthread_mutex_lock(&s->mu);
    s->n_engine--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- replies ------------------------------------------------------------------------------------*/
/* Queues a whole answer (the body is copied). */
static enum MHD_Result reply(struct MHD_Connection *c, req *r, int status, const char *ctype, const char *body,
                             size_t len, const char *allow) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    /* shutting down: keep-alive clients are sent elsewhere */
    if (atomic_load(&r->srv->draining)) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    count_reply(r->srv, r->rt, status);
    return ok;
}

static enum MHD_Result reply_json(struct MHD_Connection *c, req *r, int status, char *json /* freed */,
                                  const char *allow) {
    if (!json) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        return reply(c, r, 500, "application/json", oom, sizeof oom - 1, NULL);
    }
    enum MHD_Result ok = reply(c, r, status, "application/json", json, strlen(json), allow);
    free(json); /* cJSON's allocator */
    return ok;
}

static enum MHD_Result reply_error(struct MHD_Connection *c, req *r, const srv_error *e, const char *allow) {
    if (e->status >= 500) st_log(STRATA_LOG_WARN, "server: %s %d: %s", ROUTE_NAMES[r->rt], e->status, e->message);
    else st_log(STRATA_LOG_DEBUG, "server: %s %d: %s", ROUTE_NAMES[r->rt], e->status, e->message);
    return reply_json(c, r, e->status, srv_json_error(e), allow);
}

static enum MHD_Result error_reply(struct MHD_Connection *c, req *r, int status, const char *type, const char *code,
                                   const char *allow, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static enum MHD_Result error_reply(struct MHD_Connection *c, req *r, int status, const char *type, const char *code,
                                   const char *allow, const char *fmt, ...) {
    srv_error e;
    srv_error_set(&e, status, type, code, NULL, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    return reply_error(c, r, &e, allow);
}

/* ---- /metrics ---------------------------------------------------------------------------------*/
static bool hist_text(st_strbuf *b, const char *name, const char *help, const strata_histogram *h) {
    bool ok = st_strbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    int64_t cum = 0;
    for (int i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        ok = ok && st_strbuf_printf(b, "%s_bucket{le=\"%g\"} %lld\n", name, h->bounds[i], (long long)cum);
    }
    cum += h->counts[h->n_bounds];
    ok = ok && st_strbuf_printf(b, "%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.6f\n%s_count %lld\n", name, (long long)cum, name,
                         h->sum, name, (long long)h->count);
    return ok;
}

static bool metric(st_strbuf *b, const char *name, const char *type, const char *help, double v) {
    return st_strbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

static char *metrics_text(st_server *s) {
    strata_metrics *m = st_malloc(sizeof *m);
    if (!m) return NULL;
    if (strata_metrics_get(s->model, m) != STRATA_OK) {
        st_free(m);
        return NULL;
    }
    int64_t http[R_COUNT_][N_CODES + 1];
    pthread_mutex_lock(&s->stat_mu);
    memcpy(http, s->http, sizeof http);
    const int64_t disconnects = s->disconnects, refused = s->refused;
    const int64_t to_headers = s->timed_out_headers, to_idle = s->timed_out_idle;
    pthread_mutex_unlock(&s->stat_mu);
    pthread_mutex_lock(&s->mu);
    const int64_t n_conns = s->n_conns;
    pthread_mutex_unlock(&s->mu);

    st_strbuf b = {0};
    bool ok = st_strbuf_printf(&b, "# HELP strata_http_requests_total HTTP requests answered, by route and status code.\n"
                            "# TYPE strata_http_requests_total counter\n");
    for (int rt = 0; rt < R_COUNT_; rt++)
        for (int k = 0; k <= N_CODES; k++) {
            /* the generation routes always show 200, so the series exist from the start */
            if (!http[rt][k] && !(k == 0 && rt <= R_COMPLETIONS)) continue;
            char code[16];
            if (k < N_CODES) snprintf(code, sizeof code, "%d", CODES[k]);
            else snprintf(code, sizeof code, "other");
            ok = ok && st_strbuf_printf(&b, "strata_http_requests_total{route=\"%s\",code=\"%s\"} %lld\n", ROUTE_NAMES[rt], code,
                                 (long long)http[rt][k]);
        }
    ok = ok && metric(&b, "strata_http_stream_disconnects_total", "counter",
                      "Requests whose client went away before the answer ended (their sequences are aborted).",
                      (double)disconnects);
    ok = ok && metric(&b, "strata_http_connections_open", "gauge", "HTTP connections accepted and not yet closed.",
                      (double)n_conns);
    ok = ok && metric(&b, "strata_http_connections_refused_total", "counter",
                      "HTTP connections closed at accept: over the connection limit, in all or from one client.",
                      (double)refused);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_http_connections_timed_out_total HTTP connections closed by a "
                                    "deadline: request headers not complete in time, or idle (keep-alive) too long.\n"
                                    "# TYPE strata_http_connections_timed_out_total counter\n"
                                    "strata_http_connections_timed_out_total{phase=\"headers\"} %lld\n"
                                    "strata_http_connections_timed_out_total{phase=\"idle\"} %lld\n",
                                (long long)to_headers, (long long)to_idle);
    ok = ok && metric(&b, "strata_requests_running", "gauge", "Sequences holding a slot (running).", (double)m->running);
    ok = ok && metric(&b, "strata_requests_waiting", "gauge", "Requests waiting for a slot.", (double)m->waiting);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_requests_finished_total Requests finished, by reason.\n"
                             "# TYPE strata_requests_finished_total counter\n");
    for (int f = 0; f < STRATA_FINISH_COUNT; f++)
        ok = ok && st_strbuf_printf(&b, "strata_requests_finished_total{reason=\"%s\"} %lld\n",
                             strata_finish_reason_str((strata_finish_reason)f), (long long)m->requests_finished[f]);
    ok = ok && metric(&b, "strata_prompt_tokens_total", "counter", "Prompt tokens computed (prefilled).",
                      (double)m->prompt_tokens);
    ok = ok && metric(&b, "strata_generation_tokens_total", "counter", "Tokens generated (sampled).",
                      (double)m->generation_tokens);
    ok = ok && metric(&b, "strata_engine_steps_total", "counter", "Engine steps that ran the model.", (double)m->steps);
    ok = ok && metric(&b, "strata_preemptions_total", "counter", "Sequences preempted (sent back to waiting).",
                      (double)m->preemptions);
    ok = ok && metric(&b, "strata_kv_blocks_used", "gauge", "KV cache blocks holding tokens.", (double)m->kv_blocks_used);
    ok = ok && metric(&b, "strata_kv_blocks_total", "gauge", "KV cache blocks in all.", (double)m->kv_blocks_total);
    ok = ok && metric(&b, "strata_kv_block_size_tokens", "gauge", "Tokens per KV cache block.", (double)m->kv_block_size);
    ok = ok && metric(&b, "strata_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                      (double)m->prefix_cache_queries);
    ok = ok && metric(&b, "strata_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                      (double)m->prefix_cache_hits);
    ok = ok && metric(&b, "strata_prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries (tokens).",
                      m->prefix_cache_queries ? (double)m->prefix_cache_hits / (double)m->prefix_cache_queries : 0.0);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_prefix_cache_hit_tokens_total Prompt tokens found in the prefix "
                                    "cache, by the KV tier they came from.\n"
                                    "# TYPE strata_prefix_cache_hit_tokens_total counter\n"
                                    "strata_prefix_cache_hit_tokens_total{tier=\"device\"} %lld\n"
                                    "strata_prefix_cache_hit_tokens_total{tier=\"host\"} %lld\n"
                                    "strata_prefix_cache_hit_tokens_total{tier=\"ssd\"} %lld\n",
                                (long long)m->prefix_cache_hits_device, (long long)m->prefix_cache_hits_host,
                                (long long)m->prefix_cache_hits_ssd);
    {
        const char *tier[3] = {"device", "host", "ssd"};
        const int64_t v[3][3] = {{m->kv_device_used, m->kv_device_cached, m->kv_device_free},
                                 {m->kv_host_used, m->kv_host_cached, m->kv_host_free},
                                 {m->kv_ssd_used, m->kv_ssd_cached, m->kv_ssd_free}};
        ok = ok && st_strbuf_printf(&b, "# HELP strata_kv_blocks KV cache blocks by tier and state (used: held by "
                                        "sequences or being moved; cached: kept for prefix hits).\n"
                                        "# TYPE strata_kv_blocks gauge\n");
        for (int t = 0; t < 3; t++)
            ok = ok && st_strbuf_printf(&b, "strata_kv_blocks{tier=\"%s\",state=\"used\"} %lld\n"
                                            "strata_kv_blocks{tier=\"%s\",state=\"cached\"} %lld\n"
                                            "strata_kv_blocks{tier=\"%s\",state=\"free\"} %lld\n",
                                        tier[t], (long long)v[t][0], tier[t], (long long)v[t][1], tier[t],
                                        (long long)v[t][2]);
    }
    ok = ok && st_strbuf_printf(&b, "# HELP strata_kv_transfer_bytes_total KV cache bytes moved between tiers.\n"
                                    "# TYPE strata_kv_transfer_bytes_total counter\n"
                                    "strata_kv_transfer_bytes_total{direction=\"device_to_host\"} %lld\n"
                                    "strata_kv_transfer_bytes_total{direction=\"host_to_device\"} %lld\n"
                                    "strata_kv_transfer_bytes_total{direction=\"host_to_ssd\"} %lld\n"
                                    "strata_kv_transfer_bytes_total{direction=\"ssd_to_host\"} %lld\n",
                                (long long)m->kv_bytes_device_to_host, (long long)m->kv_bytes_host_to_device,
                                (long long)m->kv_bytes_host_to_ssd, (long long)m->kv_bytes_ssd_to_host);
    ok = ok && metric(&b, "strata_kv_swaps_total", "counter",
                      "Preempted sequences whose KV came back from a lower tier instead of being recomputed.",
                      (double)m->kv_swaps);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_spec_draft_tokens_total Speculative drafts verified, by result.\n"
                                "# TYPE strata_spec_draft_tokens_total counter\n"
                                "strata_spec_draft_tokens_total{result=\"accepted\"} %lld\n"
                                "strata_spec_draft_tokens_total{result=\"rejected\"} %lld\n",
                      (long long)m->spec_accepted, (long long)(m->spec_drafted - m->spec_accepted));
    ok = ok && hist_text(&b, "strata_time_to_first_token_seconds", "Time from a request's arrival at the engine to its first token.", &m->ttft);
    ok = ok && hist_text(&b, "strata_time_between_tokens_seconds", "Time between consecutive tokens of a request.", &m->tbt);
    ok = ok && hist_text(&b, "strata_request_duration_seconds", "Time from a request's arrival at the engine to its end.", &m->e2e);
    ok = ok && metric(&b, "strata_max_batch", "gauge", "Sequences that can run at once.", (double)m->max_batch);
    ok = ok && metric(&b, "strata_max_model_len", "gauge", "Tokens per sequence (prompt and output).",
                      (double)m->max_seq_len);
    ok = ok && metric(&b, "strata_engine_step_tokens_total", "counter",
                      "Tokens the engine steps' forward passes ran (prompt chunks and decodes).", (double)m->step_tokens);
    ok = ok && metric(&b, "strata_engine_step_seconds_total", "counter",
                      "Wall time of the engine steps that ran the model (sampling and streaming included).",
                      m->step_seconds);
    ok = ok && metric(&b, "strata_engine_forward_seconds_total", "counter",
                      "Of the step time, the time in the model's forward passes (device sampling included).",
                      m->forward_seconds);
    ok = ok && metric(&b, "strata_decode_steps_total", "counter",
                      "Decode-only engine steps (one token for every sequence of the batch, no prompt chunk).",
                      (double)m->decode_steps);
    ok = ok && metric(&b, "strata_decode_tokens_total", "counter", "Tokens (= sequences) of the decode-only steps.",
                      (double)m->decode_tokens);
    ok = ok && metric(&b, "strata_decode_kv_tokens_total", "counter",
                      "Keys the decode-only steps attended over (context lengths summed over sequences and steps).",
                      (double)m->decode_kv_tokens);
    ok = ok && metric(&b, "strata_decode_seconds_total", "counter", "Wall time of the decode-only steps.",
                      m->decode_seconds);
    const strata_engine_info *c = &s->info;
    ok = ok && metric(&b, "strata_model_weight_bytes_per_step", "gauge",
                      "Weight bytes one forward pass reads (every matrix once; embedding rows not counted).",
                      c->weight_bytes);
    ok = ok && metric(&b, "strata_model_kv_bytes_per_token", "gauge", "KV cache bytes per token (K and V, all layers).",
                      c->kv_bytes_per_token);
    ok = ok && metric(&b, "strata_model_flops_per_token", "gauge",
                      "Matrix FLOPs per token with logits (2 per weight element, lm_head included).", c->flops_per_token);
    ok = ok && metric(&b, "strata_model_attention_flops_per_pair", "gauge",
                      "Attention FLOPs per (query, key) pair, all layers.", c->attn_flops_per_pair);
    if (s->device_read_bw > 0)
        ok = ok && metric(&b, "strata_device_read_bytes_per_second", "gauge",
                          "Device memory bandwidth measured at start-up (large copy, bytes read + written per second).",
                          s->device_read_bw);
    if (s->gemm_rate > 0)
        ok = ok && metric(&b, "strata_gemm_flops_per_second", "gauge",
                          "Tensor-core bf16 GEMM rate measured at start-up (8192x8192 x 4096 tokens).", s->gemm_rate);
    if (s->gemm_rate_precise > 0)
        ok = ok && metric(&b, "strata_gemm_precise_flops_per_second", "gauge",
                          "Useful FLOP/s of the default (precise, hi + lo) matmul path, same GEMM.", s->gemm_rate_precise);
    if (s->pd) ok = ok && pd_node_metrics(s->pd, &b);
    st_free(m);
    if (!ok) {
        st_free(b.p);
        return NULL;
    }
    return b.p;
}

/* ---- streaming ----------------------------------------------------------------------------------*/
static bool sse_add(req *r, char *json /* freed */) {
    if (!json) return false;
    bool ok = st_strbuf_add(&r->out, "data: ", 6) && st_strbuf_add(&r->out, json, strlen(json)) && st_strbuf_add(&r->out, "\n\n", 2);
    free(json);
    return ok;
}

static const char *finish_name(strata_finish_reason f) { return f == STRATA_FINISH_LENGTH ? "length" : "stop"; }

/* Aborts r's engine request unless it ended or was aborted already; whether
 * this call aborted it. Any thread; r->mu not held. */
static bool req_abort(req *r) {
    pthread_mutex_lock(&r->mu);
    const uint64_t eid = r->aborted || r->finished ? 0 : r->eid;
    if (eid) r->aborted = true;
    pthread_mutex_unlock(&r->mu);
    return eid && strata_abort(r->srv->model, eid) == STRATA_OK;
}

/* The client went away (or the server is stopping): abort the engine request. */
static void client_gone(req *r, const char *how) {
    st_server *s = r->srv;
    if (!req_abort(r)) return;
    const bool stopping = atomic_load(&s->stopping);
    if (!stopping) {
        pthread_mutex_lock(&s->stat_mu);
        s->disconnects++;
        pthread_mutex_unlock(&s->stat_mu);
    }
    st_log(STRATA_LOG_INFO, "server: %s: %s; request aborted", r->id, stopping ? "the server is stopping" : how);
}

/* The server is shutting down and its drain time is over: abort the engine
 * request, whose on_finish (reason abort) then ends the answer with an error
 * (an error event and [DONE] on a stream, a 503 otherwise). */
static void cancel(req *r) {
    if (req_abort(r)) st_log(STRATA_LOG_INFO, "server: %s: the server is shutting down; request aborted", r->id);
}

/* libmicrohttpd's content reader for a streamed answer (the connection's
 * thread): hands out SSE bytes, or, when the engine has nothing new,
 * suspends the connection and returns 0; the engine's callbacks resume it. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    req *r = cls;
    st_server *s = r->srv;
    for (;;) {
        if (r->out_pos < r->out.len) {
            size_t n = r->out.len - r->out_pos;
            if (n > max) n = max;
            memcpy(buf, r->out.p + r->out_pos, n);
            r->out_pos += n;
            if (r->out_pos == r->out.len) r->out_pos = r->out.len = 0;
            return (ssize_t)n;
        }
        if (r->done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (atomic_load(&s->stopping)) cancel(r);

        pthread_mutex_lock(&r->mu);
        if (r->peer_closed && !r->finished) {
            pthread_mutex_unlock(&r->mu);
            client_gone(r, "the client went away");
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (r->role_sent && r->text.len == 0 && !r->finished) {
            if (atomic_load(&s->ending)) { /* the engine did not end it in time, or the server stops */
                pthread_mutex_unlock(&r->mu);
                cancel(r);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            req_suspend_locked(r);
            pthread_mutex_unlock(&r->mu);
            return 0;
        }
        st_strbuf piece = r->text; /* take the pending text */
        r->text = (st_strbuf){0};
        const bool fin = r->finished;
        const strata_finish f = r->fin;
        char *ferr = fin && r->fin_error ? st_strdup(r->fin_error) : NULL;
        pthread_mutex_unlock(&r->mu);

        bool ok = true;
        const bool chat = r->meta.kind == SRV_CHAT;
        if (!r->role_sent) {
            if (chat) ok = sse_add(r, srv_json_chunk(&r->meta, true, "", 0, NULL, r->include_usage));
            r->role_sent = true;
        }
        if (ok && piece.len) ok = sse_add(r, srv_json_chunk(&r->meta, false, piece.p, piece.len, NULL, r->include_usage));
        st_free(piece.p);
        if (ok && fin) {
            if (f.reason == STRATA_FINISH_ERROR || f.reason == STRATA_FINISH_ABORT) {
                srv_error e;
                const bool ab = f.reason == STRATA_FINISH_ABORT;
                srv_error_set(&e, ab ? 503 : 500, "server_error", ab ? "server_shutting_down" : NULL, NULL, "%s",
                              ab ? "the request was cancelled (the server is shutting down)"
                                 : ferr ? ferr : "generation failed");
                ok = sse_add(r, srv_json_error(&e));
            } else {
                ok = sse_add(r, srv_json_chunk(&r->meta, false, chat ? NULL : "", 0, finish_name(f.reason),
                                               r->include_usage));
                if (ok && r->include_usage) ok = sse_add(r, srv_json_usage_chunk(&r->meta, &f));
            }
            ok = ok && st_strbuf_add(&r->out, "data: [DONE]\n\n", 14);
            r->done = true;
        }
        st_free(ferr);
        if (!ok) {
            st_log(STRATA_LOG_ERROR, "server: %s: out of memory while streaming", r->id);
            req_abort(r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

static void stream_free(void *cls) { req_unref(cls); }

/* ---- generation requests --------------------------------------------------------------------*/
static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* text -> *ids (malloc'd: the caller frees; NULL when *n is 0), BOS / EOS as the tokenizer
 * says when add_special, control token strings parsed. False (message set)
 * when it cannot be tokenized. */
static bool encode(const strata_model *m, const char *text, bool add_special, int32_t **ids, int64_t *n) {
    size_t got = 0;
    const bool ok = strata_tokenize_alloc(m, text, add_special, true, ids, &got) == STRATA_OK;
    *n = (int64_t)got;
    return ok;
}

static enum MHD_Result whole_continue(struct MHD_Connection *c, req *r);

/* A generation request's body -> its parsed fields and prompt ids (*g
 * filled, *ids the caller's), or false with *e set (nothing to free): the
 * one place both the generation routes and a decode node's /pd/reserve check
 * a request, so that they refuse it alike. */
static bool gen_prepare(st_server *s, srv_kind kind, const char *body, size_t len, srv_gen *g, int32_t **ids,
                        int64_t *n, srv_error *e) {
    *ids = NULL;
    *n = 0;
    if (!srv_parse_gen(kind, body, len, s->model, g, e)) return false;
    if (g->model && strcmp(g->model, s->model_name) != 0) {
        srv_error_set(e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist: this server serves '%.200s' (GET /v1/models)", g->model,
                      s->model_name);
        srv_gen_clear(g);
        return false;
    }
    if (g->prompt_ids) {
        *ids = g->prompt_ids;
        *n = g->n_prompt_ids;
        g->prompt_ids = NULL;
    } else if (!encode(s->model, g->prompt_text, true, ids, n)) {
        srv_error_set(e, 400, "invalid_request_error", "invalid_value", kind == SRV_CHAT ? "messages" : "prompt",
                      "the prompt cannot be tokenized: %s", st_last_error());
        srv_gen_clear(g);
        return false;
    }
    const char *pname = kind == SRV_CHAT ? "messages" : "prompt";
    const int64_t ctx = s->max_seq_len;
    if (*n == 0) {
        srv_error_set(e, 400, "invalid_request_error", "invalid_value", pname, "the prompt is empty (no tokens)");
    } else if (*n >= ctx) {
        srv_error_set(e, 400, "invalid_request_error", "context_length_exceeded", pname,
                      "This model's maximum context length is %lld tokens, but the prompt has %lld tokens "
                      "(prompt and completion must fit together, with at least 1 completion token).",
                      (long long)ctx, (long long)*n);
    } else {
        return true;
    }
    st_free(*ids);
    *ids = NULL;
    srv_gen_clear(g);
    return false;
}

static enum MHD_Result handle_generate(struct MHD_Connection *c, req *r, srv_kind kind) {
    st_server *s = r->srv;
    srv_gen g;
    srv_error e;
    if (atomic_load(&s->draining))
        return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                           "the server is shutting down and takes no new requests");
    int32_t *ids = NULL;
    int64_t n = 0;
    const bool ok = gen_prepare(s, kind, r->body.p ? r->body.p : "", r->body.len, &g, &ids, &n, &e);
    st_free(r->body.p);
    r->body = (st_strbuf){0};
    if (!ok) return reply_error(c, r, &e, NULL);
    /* P-D: a decode node's request whose prompt blocks a prefill node pushes (decimal ticket) */
    uint64_t ticket = 0;
    const char *tk = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Strata-PD-Ticket");
    if (tk && pd_node_role(s->pd) == PD_ROLE_DECODE) {
        char *end = NULL;
        errno = 0;
        ticket = strtoull(tk, &end, 10);
        if (errno || end == tk || *end) {
            st_free(ids);
            srv_gen_clear(&g);
            return error_reply(c, r, 400, "invalid_request_error", "invalid_value", NULL,
                               "X-Strata-PD-Ticket '%.40s' is not a ticket number", tk);
        }
    }

    const uint64_t num = atomic_fetch_add(&s->counter, 1) + 1;
    snprintf(r->id, sizeof r->id, "%s-%016llx", kind == SRV_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)splitmix64(s->seed_base ^ num));
    r->meta = (srv_answer_meta){.id = r->id, .model = s->model_name, .created = (long long)time(NULL), .kind = kind};
    r->stream = g.stream;
    r->include_usage = g.include_usage;
    r->n_prompt = n;
    if (!g.seed_given) g.sp.seed = splitmix64(s->seed_base + num * 0x2545f4914f6cdd1dull);

    strata_request_params er = g.sp; /* the sampling fields */
    er.prompt_ids = ids;
    er.n_prompt_ids = (size_t)n;
    er.max_tokens = g.max_tokens;
    er.stop = (const char *const *)g.stop;
    er.n_stop = (size_t)g.n_stop;
    er.ignore_eos = g.ignore_eos;
    er.kv_ticket = ticket;
    const strata_callbacks cb = {.on_text = on_text, .on_finish = on_finish, .user = r};
    req_ref(r); /* the engine's */
    /* counted under s->mu with the draining check, so that a shutdown waits for every request it let in */
    pthread_mutex_lock(&s->mu);
    const bool refuse = atomic_load(&s->draining);
    if (!refuse) {
        s->n_engine++;
        s->n_active++;
        r->active = true;
    }
    pthread_mutex_unlock(&s->mu);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;
    r->c = c;
    uint64_t eid = 0;
    strata_status st = refuse ? st_err(STRATA_ERR_UNSUPPORTED, "the server is shutting down")
                              : strata_submit(s->model, &er, &cb, &eid);
    st_free(ids);
    srv_gen_clear(&g);
    if (st != STRATA_OK) {
        pthread_mutex_lock(&s->mu);
        if (!refuse) {
            s->n_engine--;
            s->n_active--;
            r->active = false;
        }
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        req_unref(r);
        if (st == STRATA_ERR_INVALID_ARG) srv_error_set(&e, 400, "invalid_request_error", "invalid_value", NULL, "%s", st_last_error());
        else srv_error_set(&e, 503, "server_error", st == STRATA_ERR_NOMEM ? "overloaded" : "unavailable", NULL, "%s",
                           st_last_error());
        return reply_error(c, r, &e, NULL);
    }
    pthread_mutex_lock(&r->mu);
    r->eid = eid;
    pthread_mutex_unlock(&r->mu);
    watch_peer(s, r);
    /* a shutdown that began aborting before r->eid was set did not see it */
    if (atomic_load(&s->stopping)) cancel(r);

    if (r->stream) {
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_reader, r,
                                                                      stream_free);
        if (!resp) {
            req_abort(r);
            return MHD_NO;
        }
        req_ref(r); /* the response's */
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        enum MHD_Result ok = MHD_queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        count_reply(s, r->rt, 200);
        return ok;
    }
    r->waiting = true;
    return whole_continue(c, r);
}

/* A whole answer (the connection's thread, at the request's final call and at
 * each one after a resume): queues it once the engine has finished it, or
 * ends the connection when the client went away; otherwise suspends the
 * connection until on_finish (or the watcher, or a shutdown) resumes it. */
static enum MHD_Result whole_continue(struct MHD_Connection *c, req *r) {
    st_server *s = r->srv;
    srv_error e;
    if (atomic_load(&s->stopping)) cancel(r);
    pthread_mutex_lock(&r->mu);
    if (!r->finished) {
        if (r->peer_closed) {
            pthread_mutex_unlock(&r->mu);
            client_gone(r, "the client went away");
            count_reply(s, r->rt, 499);
            return MHD_NO;
        }
        if (atomic_load(&s->ending)) { /* the engine did not end it in time, or the server stops */
            pthread_mutex_unlock(&r->mu);
            cancel(r);
            return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                               "the request was cancelled (the server is shutting down)");
        }
        req_suspend_locked(r);
        pthread_mutex_unlock(&r->mu);
        return MHD_YES;
    }
    r->waiting = false;
    const strata_finish f = r->fin;
    pthread_mutex_unlock(&r->mu);
    if (f.reason == STRATA_FINISH_ERROR || f.reason == STRATA_FINISH_ABORT) {
        srv_error_set(&e, f.reason == STRATA_FINISH_ABORT ? 503 : 500, "server_error",
                      f.reason == STRATA_FINISH_ABORT ? "server_shutting_down" : NULL, NULL, "%s",
                      f.reason == STRATA_FINISH_ABORT ? "the request was cancelled (the server is shutting down)"
                                                  : r->fin_error ? r->fin_error : "generation failed");
        return reply_error(c, r, &e, NULL);
    }
    return reply_json(c, r, 200, srv_json_answer(&r->meta, r->text.p, r->text.len, finish_name(f.reason), &f), NULL);
}

/* ---- P-D: the /pd/ routes of a prefill or decode node (docs/ARCHITECTURE.md) -------------------
 * A handler that waits (a reservation made by the engine at its next step, a
 * prefill) suspends its connection; the callback fills r->pd_* under r->mu
 * and resumes it; on_access then calls pd_continue. */

static void pd_wake(req *r) {
    pthread_mutex_lock(&r->mu);
    r->pd_ready = true;
    req_wake_locked(r);
    pthread_mutex_unlock(&r->mu);
}

static void pd_on_reserved(void *user, strata_status st, const strata_kv_reservation *res) {
    req *r = user;
    pthread_mutex_lock(&r->mu);
    r->pd_st = st;
    if (st) snprintf(r->pd_err, sizeof r->pd_err, "%s", st_last_error());
    else r->pd_res = *res;
    pthread_mutex_unlock(&r->mu);
    pd_wake(r);
    req_unref(r); /* the engine's */
}

static void pd_on_prefilled(void *user, const pd_prefill_result *res) {
    req *r = user;
    pthread_mutex_lock(&r->mu);
    r->pd_pre = *res;
    pthread_mutex_unlock(&r->mu);
    pd_wake(r);
    req_unref(r); /* the prefill's */
}

/* Suspends until pd_ready (the connection's thread). */
static enum MHD_Result pd_continue(struct MHD_Connection *c, req *r);
static enum MHD_Result pd_wait(struct MHD_Connection *c, req *r, int what) {
    r->pd_wait = what;
    return pd_continue(c, r); /* answers now when the callback came already, else suspends */
}

static bool hex_decode(const char *h, uint8_t **out, size_t *n) {
    const size_t len = strlen(h);
    if (len == 0 || len % 2) return false;
    uint8_t *b = st_malloc(len / 2);
    if (!b) return false;
    for (size_t i = 0; i < len / 2; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1 || !isxdigit((unsigned char)h[2 * i]) ||
            !isxdigit((unsigned char)h[2 * i + 1])) {
            st_free(b);
            return false;
        }
        b[i] = (uint8_t)v;
    }
    *out = b;
    *n = len / 2;
    return true;
}

static bool parse_ticket(const cJSON *it, uint64_t *out) {
    if (!cJSON_IsString(it) || !it->valuestring[0]) return false;
    char *end = NULL;
    errno = 0;
    *out = strtoull(it->valuestring, &end, 10);
    return !errno && !*end && *out != 0;
}

/* A /pd/ request's JSON body into *root, or false with the answer in *early
 * (503 while shutting down when `new_work`, 400 for malformed JSON). */
static bool pd_body(struct MHD_Connection *c, req *r, bool new_work, cJSON **root, enum MHD_Result *early) {
    if (new_work && atomic_load(&r->srv->draining)) {
        *early = error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                             "the server is shutting down and takes no new requests");
        return false;
    }
    if (st_json_parse(r->body.p ? r->body.p : "", r->body.len, "request body", root) != STRATA_OK) {
        *early = error_reply(c, r, 400, "invalid_request_error", "invalid_json", NULL, "%s", st_last_error());
        return false;
    }
    return true;
}

/* POST /pd/reserve {"route", "request"} (decode) */
static enum MHD_Result handle_pd_reserve(struct MHD_Connection *c, req *r) {
    st_server *s = r->srv;
    cJSON *root = NULL;
    enum MHD_Result early;
    if (!pd_body(c, r, true, &root, &early)) return early;
    const cJSON *route_it = st_json_field(root, "route"), *rq = st_json_field(root, "request");
    srv_kind kind;
    if (cJSON_IsString(route_it) && !strcmp(route_it->valuestring, "/v1/chat/completions")) kind = SRV_CHAT;
    else if (cJSON_IsString(route_it) && !strcmp(route_it->valuestring, "/v1/completions")) kind = SRV_COMPLETIONS;
    else {
        cJSON_Delete(root);
        return error_reply(c, r, 400, "invalid_request_error", "invalid_value", "route",
                           "'route' must be \"/v1/completions\" or \"/v1/chat/completions\"");
    }
    char *body = rq ? cJSON_PrintUnformatted(rq) : NULL;
    cJSON_Delete(root);
    if (!body) return error_reply(c, r, 400, "invalid_request_error", "invalid_value", "request", "'request' is missing");
    srv_gen g;
    srv_error e;
    int32_t *ids = NULL;
    int64_t n = 0;
    const bool ok = gen_prepare(s, kind, body, strlen(body), &g, &ids, &n, &e);
    cJSON_free(body);
    if (!ok) return reply_error(c, r, &e, NULL);
    srv_gen_clear(&g);
    r->pd_ids = ids;
    r->pd_n = n;
    r->c = c;
    req_ref(r); /* the engine's, until pd_on_reserved */
    strata_status st = strata_kv_reserve(s->model, ids, (size_t)n, pd_on_reserved, r);
    if (st) {
        req_unref(r);
        return error_reply(c, r, 503, "server_error", "unavailable", NULL, "%s", st_last_error());
    }
    return pd_wait(c, r, 1);
}

static enum MHD_Result reserve_continue(struct MHD_Connection *c, req *r) {
    st_server *s = r->srv;
    if (r->pd_st == STRATA_ERR_NOMEM)
        return error_reply(c, r, 503, "server_error", "kv_blocks_exhausted", NULL, "%s", r->pd_err);
    if (r->pd_st) return error_reply(c, r, 503, "server_error", "unavailable", NULL, "%s", r->pd_err);
    const strata_kv_reservation *res = &r->pd_res;
    if (res->ticket && pd_node_expect(s->pd, res) != STRATA_OK)
        return error_reply(c, r, 500, "server_error", NULL, NULL, "%s", st_last_error());
    st_strbuf b = {0};
    bool ok = st_strbuf_printf(&b, "{\"ticket\":\"%llu\",\"tokens\":[", (unsigned long long)res->ticket);
    for (int64_t i = 0; i < r->pd_n && ok; i++) ok = st_strbuf_printf(&b, i ? ",%d" : "%d", r->pd_ids[i]);
    ok = ok && st_strbuf_printf(&b,
                                "],\"block_tokens\":%lld,\"cached_blocks\":%lld,\"blocks\":%lld,\"layers\":%lld,"
                                "\"layer_bytes\":%zu,\"identity\":\"%s\",\"address\":\"%s\"}",
                                (long long)res->block_tokens, (long long)res->cached_blocks, (long long)res->n_blocks,
                                (long long)res->n_layers, res->layer_bytes, pd_node_identity_hex(s->pd),
                                pd_node_address_hex(s->pd));
    if (!ok) {
        st_strbuf_free(&b);
        if (res->ticket) pd_node_cancel(s->pd, res->ticket);
        return error_reply(c, r, 500, "server_error", NULL, NULL, "out of memory");
    }
    return reply_json(c, r, 200, b.p, NULL);
}

/* POST /pd/prefill (prefill) */
static enum MHD_Result handle_pd_prefill(struct MHD_Connection *c, req *r) {
    st_server *s = r->srv;
    cJSON *root = NULL;
    enum MHD_Result early;
    if (!pd_body(c, r, true, &root, &early)) return early;
    const st_json_where w = {.path = "request body"};
    int64_t attempt = 0, bt = 0, from = 0, nb = 0;
    const char *identity = NULL, *address = NULL;
    uint64_t ticket = 0;
    const cJSON *toks = st_json_field(root, "tokens");
    strata_status st = STRATA_OK;
    const char *bad = NULL;
    if (!parse_ticket(st_json_field(root, "ticket"), &ticket)) bad = "ticket";
    else if (st_json_get_int64(&w, root, "attempt", &attempt) || attempt < 1 || attempt > UINT32_MAX) bad = "attempt";
    else if (st_json_get_int64(&w, root, "block_tokens", &bt)) bad = "block_tokens";
    else if (st_json_get_int64(&w, root, "from_block", &from) || from < 0) bad = "from_block";
    else if (st_json_get_int64(&w, root, "blocks", &nb) || nb < 1) bad = "blocks";
    else if (st_json_get_string(&w, root, "identity", &identity)) bad = "identity";
    else if (st_json_get_string(&w, root, "address", &address)) bad = "address";
    else if (!cJSON_IsArray(toks)) bad = "tokens";
    if (bad) {
        cJSON_Delete(root);
        return error_reply(c, r, 400, "invalid_request_error", "invalid_value", bad,
                           "'%s' is missing or invalid", bad);
    }
    if (strcmp(identity, pd_node_identity_hex(s->pd)) != 0 || bt != s->info.kv_block_size) {
        const enum MHD_Result rr = error_reply(
            c, r, 409, "invalid_request_error", "kv_layout_mismatch", "identity",
            "the decode node's model or KV layout (identity %.40s, blocks of %lld tokens) is not this node's (%s, %lld)",
            identity, (long long)bt, pd_node_identity_hex(s->pd), (long long)s->info.kv_block_size);
        cJSON_Delete(root);
        return rr;
    }
    const int64_t need = (from + nb) * bt, have = cJSON_GetArraySize(toks);
    if (have < need || need >= s->max_seq_len) {
        cJSON_Delete(root);
        return error_reply(c, r, 400, "invalid_request_error", "invalid_value", "tokens",
                           "'tokens' has %lld ids; blocks %lld..%lld need %lld (and fewer than %lld)", (long long)have,
                           (long long)from, (long long)(from + nb), (long long)need, (long long)s->max_seq_len);
    }
    int32_t *ids = st_malloc((size_t)need * sizeof *ids);
    uint8_t *addr = NULL;
    size_t addr_len = 0;
    if (!ids)
        st = st_err(STRATA_ERR_NOMEM, "pd prefill: out of memory for %lld prompt token ids (%zu bytes)",
                    (long long)need, (size_t)need * sizeof *ids);
    int64_t i = 0;
    for (const cJSON *it = toks ? toks->child : NULL; it && i < need && !st; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble >= 2147483647.0 ||
            it->valuedouble != (double)(int32_t)it->valuedouble)
            st = st_err(STRATA_ERR_INVALID_ARG, "tokens[%lld] is not a token id", (long long)i);
        else ids[i] = (int32_t)it->valuedouble;
    }
    if (!st && !hex_decode(address, &addr, &addr_len))
        st = st_err(STRATA_ERR_INVALID_ARG, "'address' is not an even number of hex digits");
    cJSON_Delete(root);
    if (st) {
        st_free(ids);
        st_free(addr);
        return error_reply(c, r, 400, "invalid_request_error", "invalid_value", NULL, "%s", st_last_error());
    }
    const pd_prefill_args a = {.ticket = ticket, .attempt = (uint32_t)attempt, .tokens = ids, .from_block = from,
                               .n_blocks = nb, .address = addr, .address_len = addr_len};
    r->c = c;
    req_ref(r); /* the prefill's, until pd_on_prefilled */
    st = pd_node_prefill(s->pd, &a, pd_on_prefilled, r);
    st_free(ids);
    st_free(addr);
    if (st) {
        req_unref(r);
        const int code = st == STRATA_ERR_INVALID_ARG ? 400 : 502;
        return error_reply(c, r, code, code == 400 ? "invalid_request_error" : "server_error",
                           code == 400 ? "invalid_value" : "kv_transfer_failed", NULL, "%s", st_last_error());
    }
    return pd_wait(c, r, 2);
}

static enum MHD_Result prefill_continue(struct MHD_Connection *c, req *r) {
    const pd_prefill_result *p = &r->pd_pre;
    if (p->st)
        return error_reply(c, r, 502, "server_error", "kv_transfer_failed", NULL, "%s", p->error);
    st_strbuf sb = {0};
    if (!st_strbuf_printf(&sb, "{\"bytes\":%llu,\"messages\":%lld,\"seconds\":%.6f}", (unsigned long long)p->bytes,
                          (long long)p->messages, p->seconds)) {
        st_strbuf_free(&sb);
        return error_reply(c, r, 500, "server_error", NULL, NULL, "out of memory");
    }
    return reply_json(c, r, 200, sb.p, NULL);
}

/* POST /pd/cancel {"ticket"} (decode) */
static enum MHD_Result handle_pd_cancel(struct MHD_Connection *c, req *r) {
    st_server *s = r->srv;
    cJSON *root = NULL;
    enum MHD_Result early;
    if (!pd_body(c, r, false, &root, &early)) return early;
    uint64_t ticket = 0;
    const bool ok = parse_ticket(st_json_field(root, "ticket"), &ticket);
    cJSON_Delete(root);
    if (!ok) return error_reply(c, r, 400, "invalid_request_error", "invalid_value", "ticket", "'ticket' is missing or invalid");
    pd_node_cancel(s->pd, ticket);
    static const char empty[] = "{}";
    return reply(c, r, 200, "application/json", empty, sizeof empty - 1, NULL);
}

static enum MHD_Result pd_continue(struct MHD_Connection *c, req *r) {
    pthread_mutex_lock(&r->mu);
    const bool ready = r->pd_ready, ending = atomic_load(&r->srv->ending);
    if (!ready && !ending) req_suspend_locked(r); /* resumed by something else: wait on */
    pthread_mutex_unlock(&r->mu);
    if (!ready && ending) {
        r->pd_wait = 0;
        return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL, "the server is shutting down");
    }
    if (!ready) return MHD_YES;
    const int what = r->pd_wait;
    r->pd_wait = 0;
    return what == 1 ? reserve_continue(c, r) : prefill_continue(c, r);
}

/* ---- routing ------------------------------------------------------------------------------------*/
static route route_of(const char *url) {
    for (int i = 0; i < R_OTHER; i++)
        if (!strcmp(url, ROUTE_NAMES[i])) return (route)i;
    return R_OTHER;
}

static enum MHD_Result dispatch(struct MHD_Connection *c, req *r, const char *url, const char *method) {
    st_server *s = r->srv;
    const bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    const bool post = !strcmp(method, "POST");
    if (s->loopback) {
        const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
        if (h && !st_http_host_ok(h, s->host))
            return error_reply(c, r, 421, "invalid_request_error", "invalid_host", NULL,
                               "the Host header '%.100s' does not name this server (it listens on %s: use "
                               "localhost or 127.0.0.1)", h, s->host);
    }
    const bool open_probe = (r->rt == R_HEALTH || r->rt == R_METRICS) && s->metrics_public;
    if (s->api_key && (!strncmp(url, "/v1/", 4) || !strncmp(url, "/pd/", 4) || r->rt == R_HEALTH || r->rt == R_METRICS) &&
        !open_probe &&
        !st_http_bearer_ok(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION), s->api_key)) {
        const bool missing = !MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        return error_reply(c, r, 401, "invalid_request_error", "invalid_api_key", NULL, "%s",
                           missing ? "You didn't provide an API key: pass it as 'Authorization: Bearer KEY'."
                                   : "Incorrect API key provided.");
    }
    switch (r->rt) {
    case R_CHAT:
    case R_COMPLETIONS:
        if (!post)
            return error_reply(c, r, 405, "invalid_request_error", "method_not_allowed", "POST",
                               "%s is not allowed on %s (use POST)", method, url);
        if (!st_http_json_ctype(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE))) {
            const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
            return error_reply(c, r, 415, "invalid_request_error", "unsupported_media_type", NULL,
                               "the request body must be JSON with 'Content-Type: application/json' (got %s%.100s%s)",
                               ct ? "'" : "", ct ? ct : "none", ct ? "'" : "");
        }
        return handle_generate(c, r, r->rt == R_CHAT ? SRV_CHAT : SRV_COMPLETIONS);
    case R_MODELS:
    case R_HEALTH:
    case R_METRICS:
        if (!get)
            return error_reply(c, r, 405, "invalid_request_error", "method_not_allowed", "GET, HEAD",
                               "%s is not allowed on %s (use GET)", method, url);
        if (r->rt == R_MODELS)
            return reply_json(c, r, 200,
                              srv_json_models(s->model_name, s->created, s->max_seq_len),
                              NULL);
        if (r->rt == R_HEALTH) {
            if (atomic_load(&s->draining))
                return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                                   "the server is shutting down");
            strata_metrics *mm = st_malloc(sizeof *mm);
            if (!mm || strata_metrics_get(s->model, mm) != STRATA_OK) {
                st_free(mm);
                return error_reply(c, r, 500, "server_error", NULL, NULL, "the engine's metrics are unavailable");
            }
            st_strbuf hb = {0};
            const bool hok = st_strbuf_printf(
                &hb,
                "{\"status\":\"ok\",\"role\":\"%s\",\"running\":%lld,\"waiting\":%lld,\"kv_blocks_free\":%lld,"
                "\"kv_blocks_total\":%lld,\"queued_prompt_tokens\":%lld}",
                pd_role_name(pd_node_role(s->pd)), (long long)mm->running, (long long)mm->waiting,
                (long long)(mm->kv_device_free + mm->kv_device_cached), (long long)mm->kv_blocks_total,
                (long long)pd_node_queued_tokens(s->pd));
            st_free(mm);
            if (!hok) return error_reply(c, r, 500, "server_error", NULL, NULL, "out of memory");
            return reply_json(c, r, 200, hb.p, NULL);
        }
        {
            char *text = metrics_text(s);
            if (!text) return error_reply(c, r, 500, "server_error", NULL, NULL, "out of memory");
            enum MHD_Result ok = reply(c, r, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
            st_free(text);
            return ok;
        }
    case R_PD_RESERVE:
    case R_PD_PREFILL:
    case R_PD_CANCEL: {
        const pd_role need = r->rt == R_PD_PREFILL ? PD_ROLE_PREFILL : PD_ROLE_DECODE;
        if (pd_node_role(s->pd) != need)
            return error_reply(c, r, 404, "invalid_request_error", "not_found", NULL,
                               "no route %s %s: this node's role is %s (%s needs --role %s)", method, url,
                               pd_role_name(pd_node_role(s->pd)), url, pd_role_name(need));
        if (!post)
            return error_reply(c, r, 405, "invalid_request_error", "method_not_allowed", "POST",
                               "%s is not allowed on %s (use POST)", method, url);
        return r->rt == R_PD_RESERVE ? handle_pd_reserve(c, r)
               : r->rt == R_PD_PREFILL ? handle_pd_prefill(c, r)
                                       : handle_pd_cancel(c, r);
    }
    default:
        return error_reply(c, r, 404, "invalid_request_error", "not_found", NULL, "no route %s %s", method, url);
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    st_server *s = cls;
    req *r = *con_cls;
    if (!r) { /* the headers: nothing of the body yet */
        if (!(r = req_new(s))) return MHD_NO;
        *con_cls = r;
        r->rt = route_of(url);
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        r->k = ci ? ci->socket_context : NULL;
        if (r->k) r->k->req_rx_known = tcp_bytes_received(r->k->fd, &r->k->req_rx);
        pthread_mutex_lock(&s->mu);
        r->serial = ++s->next_serial;
        r->next = s->reqs;
        if (s->reqs) s->reqs->prev = r;
        s->reqs = r;
        r->listed = true;
        if (r->k) conn_phase_locked(s, r->k, CONN_BUSY, 0); /* the head is in: no deadline while it is served */
        pthread_mutex_unlock(&s->mu);
        /* a later request on a keep-alive connection (libmicrohttpd parsed its head, not the
         * front door): a transfer coding other than chunked would have its body awaited until
         * the idle deadline; refused as the front door refuses it (counted under "other") */
        const char *te = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
        if (te && strcasecmp(te, "chunked") != 0) {
            r->rt = R_OTHER;
            return error_reply(c, r, 501, "invalid_request_error", "not_implemented", NULL,
                               "Transfer-Encoding '%.40s' is not supported (chunked only)", te);
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end = NULL;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            if (!errno && end != cl && v > s->max_body) {
                /* A client that waits for "100 Continue", or one with a huge body, gets the
                 * answer now (and the connection is closed); otherwise the body is read and
                 * dropped first, so that a client still sending does not see a reset before
                 * it reads the answer. */
                const char *expect = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
                if (expect || v > (unsigned long long)DISCARD_FACTOR * s->max_body)
                    return error_reply(c, r, 413, "invalid_request_error", "request_too_large", NULL,
                                       "the request body has %llu bytes; the limit is %zu", v, s->max_body);
                r->too_large = true;
            }
        }
        return MHD_YES;
    }
    if (r->k) r->k->req_rx_known = tcp_bytes_received(r->k->fd, &r->k->req_rx); /* the request as received so far */
    if (*upload_size) { /* a piece of the body */
        const size_t n = *upload_size;
        *upload_size = 0;
        if (!r->too_large && r->body.len + n > s->max_body) {
            r->too_large = true;
            st_free(r->body.p);
            r->body = (st_strbuf){0};
        }
        if (r->too_large) {
            r->discarded += n;
            return r->discarded > DISCARD_FACTOR * s->max_body ? MHD_NO : MHD_YES;
        }
        return st_strbuf_add(&r->body, upload, n) ? MHD_YES : MHD_NO;
    }
    if (r->waiting) return whole_continue(c, r); /* resumed */
    if (r->pd_wait) return pd_continue(c, r);
    if (r->too_large)
        return error_reply(c, r, 413, "invalid_request_error", "request_too_large", NULL,
                           "the request body is over the limit of %zu bytes", s->max_body);
    return dispatch(c, r, url, method);
}

/* libmicrohttpd is done with a request: answered, or its connection ended. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    st_server *s = cls;
    req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    unwatch_peer(s, r);
    pthread_mutex_lock(&r->mu);
    const bool fin = r->finished, running = r->eid && !r->aborted && !fin;
    if (r->suspended) /* cannot be: libmicrohttpd completes no suspended connection */
        st_log(STRATA_LOG_ERROR, "server: %s: completed while suspended", r->id);
    r->suspended = false;
    r->c = NULL;
    pthread_mutex_unlock(&r->mu);
    if (running) /* e.g. a write to a closed socket failed mid-stream, or the server stops */
        client_gone(r, toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED ? "the connection timed out"
                                                                     : "the connection ended before the answer");
    pthread_mutex_lock(&s->mu);
    if (r->active) { /* answered (or the connection ended): a shutdown's drain waits for this */
        s->n_active--;
        r->active = false;
        pthread_cond_broadcast(&s->cv);
    }
    if (r->listed) {
        if (r->prev) r->prev->next = r->next;
        else s->reqs = r->next;
        if (r->next) r->next->prev = r->prev;
        r->prev = r->next = NULL;
        r->listed = false;
    }
    /* keep-alive: the next request line is due within idle_timeout */
    if (r->k && toe == MHD_REQUEST_TERMINATED_COMPLETED_OK) conn_phase_locked(s, r->k, CONN_IDLE, s->idle_timeout);
    pthread_mutex_unlock(&s->mu);
    req_unref(r);
}

/* libmicrohttpd starts a connection the front door handed over, or closes one
 * (its socket is closed after this). */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    st_server *s = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        const int fd = fi ? fi->connect_fd : -1;
        pthread_mutex_lock(&s->mu);
        conn *k = NULL;
        for (conn *x = s->conns; x && fd >= 0; x = x->next)
            if (x->handed && x->fd == fd) {
                k = x;
                break;
            }
        if (k) { /* its header deadline, from the accept, goes on: the head is in already */
            k->handed = false;
            *socket_context = k;
            pthread_mutex_unlock(&s->mu);
            return;
        }
        pthread_mutex_unlock(&s->mu);
        /* not from the front door (cannot be): tracked from now on */
        k = st_calloc(1, sizeof *k);
        *socket_context = k;
        if (!k) return; /* not tracked: libmicrohttpd's inactivity timeout still applies */
        k->fd = fd;
        snprintf(k->addr, sizeof k->addr, "?");
        pthread_mutex_lock(&s->mu);
        k->next = s->conns;
        if (s->conns) s->conns->prev = k;
        s->conns = k;
        s->n_conns++;
        if (k->fd >= 0) conn_phase_locked(s, k, CONN_HEAD, s->header_timeout);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    conn *k = *socket_context;
    if (!k) return;
    *socket_context = NULL;
    pthread_mutex_lock(&s->mu);
    conn_drop_locked(s, k);
    pthread_mutex_unlock(&s->mu);
}

/* A request line has arrived (before its headers): a request on a keep-alive
 * connection now has header_timeout for its head. */
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *c) {
    (void)uri;
    st_server *s = cls;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    conn *k = ci ? ci->socket_context : NULL;
    if (k) {
        pthread_mutex_lock(&s->mu);
        if (k->phase == CONN_IDLE) conn_phase_locked(s, k, CONN_HEAD, s->header_timeout);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL; /* *con_cls stays NULL until the access handler's first call */
}

/* libmicrohttpd's messages; it may hold its locks here: only leaf locks are taken. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    st_server *s = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    pthread_mutex_lock(&s->log_mu);
    snprintf(s->mhd_msg, sizeof s->mhd_msg, "%.*s", (int)sizeof s->mhd_msg - 1, msg);
    pthread_mutex_unlock(&s->log_mu);
    /* over max_connections (a pool thread's share) or max_connections_per_client: closed at accept */
    if (strstr(msg, "reached connection limit")) { /* a pool thread at its share (the front door counts all) */
        count_refused(s);
        return;
    }
    /* an answer libmicrohttpd writes itself (a malformed later head or chunked body: 400, 413, 414,
     * 431, 505), which http/mhd_pages.c turns into the JSON error: counted too, under "other" */
    const int status = st_mhd_note_log(msg);
    if (status) count_reply(s, R_OTHER, status);
    /* what a content reader ending a stream early (client gone) makes it say, a client's closing
     * mid-request (or a deadline's shutdown, logged by the watcher), a client's malformed request:
     * routine, and a flood of warnings under a slow-loris attack */
    const bool expected = strstr(msg, "Application reported internal error") != NULL ||
                          strstr(msg, "application error generating response") != NULL ||
                          strstr(msg, "Connection socket is closed when reading request") != NULL ||
                          strstr(msg, "closed by remote side with incomplete request") != NULL ||
                          st_mhd_log_is_ours(msg) || (status >= 400 && status < 500);
    st_log(expected ? STRATA_LOG_DEBUG : STRATA_LOG_WARN, "server: libmicrohttpd: %s", msg);
}

/* ---- start / stop ---------------------------------------------------------------------------------*/
strata_status st_server_start(strata_model *m, const st_server_params *params, st_server **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "server: out is NULL");
    *out = NULL;
    if (!m || !params) return st_err(STRATA_ERR_INVALID_ARG, "server: no model or params");
    strata_engine_info info;
    if (strata_engine_info_get(m, &info) != STRATA_OK) return STRATA_ERR_INVALID_ARG; /* no engine: message set */
    if (params->port < 0 || params->port > 65535)
        return st_err(STRATA_ERR_INVALID_ARG, "server: port %d is not in [0, 65535]", params->port);
    st_server *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "server: out of memory for its state (%zu bytes)", sizeof *s);
    s->model = m;
    s->info = info;
    s->max_seq_len = info.max_seq_len;
    if (params->role != PD_ROLE_BOTH) {
        strata_status pst = pd_node_create(m, params->role, params->pd_timeout_s > 0 ? params->pd_timeout_s : 60.0,
                                           &s->pd);
        if (pst) {
            st_free(s);
            return pst;
        }
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->stat_mu, NULL);
    pthread_mutex_init(&s->log_mu, NULL);
    {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&s->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
    s->ep = s->wake_fd = s->listen_fd = -1;
    s->watch_until = NO_DEADLINE;
    s->host = st_strdup(params->host ? params->host : "127.0.0.1");
    s->model_name = st_strdup(params->model_name ? params->model_name : "strata");
    s->api_key = params->api_key && params->api_key[0] ? st_strdup(params->api_key) : NULL;
    s->max_body = params->max_body ? params->max_body : DEF_MAX_BODY;
    s->metrics_public = params->metrics_public;
    s->created = (long long)time(NULL);
    s->device_read_bw = params->device_read_bw;
    s->gemm_rate = params->gemm_rate;
    s->gemm_rate_precise = params->gemm_rate_precise;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    s->seed_base = splitmix64((uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^ (uint64_t)(uintptr_t)s);
    atomic_init(&s->draining, false);
    atomic_init(&s->stopping, false);
    atomic_init(&s->ending, false);
    atomic_init(&s->counter, 0);
    s->header_timeout = params->header_timeout_s ? params->header_timeout_s : DEF_HEADER_TIMEOUT;
    s->idle_timeout = params->idle_timeout_s ? params->idle_timeout_s : DEF_IDLE_TIMEOUT;
    const unsigned max_conn = params->max_connections ? params->max_connections : DEF_MAX_CONN;
    unsigned threads = params->threads ? params->threads : DEF_THREADS;
    if (threads > max_conn) threads = max_conn; /* each pool thread takes a share of the connections */
    if (s->host) s->loopback = st_http_loopback(s->host);
    /* on a loopback address every client is this machine (a benchmark, a proxy): no cap unless asked */
    const unsigned per_client = params->max_connections_per_client < 0 ? 0
                                : params->max_connections_per_client > 0 ? (unsigned)params->max_connections_per_client
                                : s->loopback ? 0 : DEF_PER_CLIENT;
    s->max_conn = max_conn;
    s->per_client = per_client;
    s->peek = st_malloc(HEAD_PEEK);
    if (!s->host || !s->model_name || !s->peek || (params->api_key && params->api_key[0] && !s->api_key)) {
        st_server_stop(s);
        return st_err(STRATA_ERR_NOMEM, "server: out of memory for its names and the head buffer (%d bytes)",
                      (int)HEAD_PEEK);
    }
    s->ep = epoll_create1(EPOLL_CLOEXEC);
    s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event wev = {.events = EPOLLIN, .data.u64 = 0};
    if (s->ep < 0 || s->wake_fd < 0 || epoll_ctl(s->ep, EPOLL_CTL_ADD, s->wake_fd, &wev) != 0) {
        strata_status st = st_err(STRATA_ERR_IO, "server: epoll / eventfd: %s", strerror(errno));
        st_server_stop(s);
        return st;
    }
    if (pthread_create(&s->watcher, NULL, watcher_main, s) != 0) {
        st_server_stop(s);
        return st_err(STRATA_ERR_IO, "server: cannot start the watcher thread");
    }
    s->watcher_started = true;

    char port[16];
    snprintf(port, sizeof port, "%d", params->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int gai = getaddrinfo(s->host, port, &hints, &ai);
    if (gai != 0 || !ai) {
        strata_status st = st_err(STRATA_ERR_INVALID_ARG, "server: cannot resolve host '%s': %s", s->host,
                                  gai_strerror(gai));
        st_server_stop(s);
        return st;
    }
    /* the listening socket: the front door (the watcher thread) accepts, libmicrohttpd gets the
     * connections whose first head passed */
    s->listen_fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    const int one = 1;
    if (s->listen_fd < 0 || setsockopt(s->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        (ai->ai_family == AF_INET6 && setsockopt(s->listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one) != 0) ||
        bind(s->listen_fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(s->listen_fd, SOMAXCONN) != 0) {
        strata_status st = st_err(STRATA_ERR_IO, "server: cannot listen on %s port %d: %s", s->host, params->port,
                                  strerror(errno));
        freeaddrinfo(ai);
        st_server_stop(s);
        return st;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage bound;
    socklen_t blen = sizeof bound;
    s->port = params->port;
    if (getsockname(s->listen_fd, (struct sockaddr *)&bound, &blen) == 0)
        s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
    /* epoll in a pool of threads; connections are suspended while the engine works on their requests */
    unsigned flags = (MHD_is_feature_supported(MHD_FEATURE_EPOLL) == MHD_YES ? MHD_USE_EPOLL_INTERNAL_THREAD
                                                                              : MHD_USE_POLL_INTERNAL_THREAD) |
                     MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    struct MHD_OptionItem more[2];
    int n_more = 0;
    if (threads > 1) more[n_more++] = (struct MHD_OptionItem){MHD_OPTION_THREAD_POOL_SIZE, (intptr_t)threads, NULL};
    more[n_more] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_access, s,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s, /* first, to catch every message */
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                            MHD_OPTION_URI_LOG_CALLBACK, on_uri, s,
                            /* stalls while a body is read or an answer written; a second more than the
                             * watcher's idle deadline, which it leaves to the watcher (counted there) */
                            MHD_OPTION_CONNECTION_TIMEOUT, s->idle_timeout + 1,
                            MHD_OPTION_CONNECTION_LIMIT, max_conn,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)MHD_CONN_MEMORY,
                            MHD_OPTION_ARRAY, more,
                            MHD_OPTION_END);
    if (!s->d) {
        strata_status st = st_err(STRATA_ERR_IO, "server: cannot start libmicrohttpd on %s port %d%s%s", s->host,
                                  s->port, s->mhd_msg[0] ? ": " : "", s->mhd_msg);
        st_server_stop(s);
        return st;
    }
    struct epoll_event le = {.events = EPOLLIN, .data.u64 = EV_LISTEN};
    if (epoll_ctl(s->ep, EPOLL_CTL_ADD, s->listen_fd, &le) != 0) {
        strata_status st = st_err(STRATA_ERR_IO, "server: epoll: %s", strerror(errno));
        st_server_stop(s);
        return st;
    }
    st_log(STRATA_LOG_INFO, "server: listening on %s port %d (model '%s'%s), %u thread(s), %u connections (%u per "
           "client%s), header timeout %u s, idle timeout %u s", s->host, s->port, s->model_name,
           s->api_key ? ", API key required" : "", threads, max_conn, per_client, per_client ? "" : ": no cap",
           s->header_timeout, s->idle_timeout);
    *out = s;
    return STRATA_OK;
}

int st_server_port(const st_server *s) { return s->port; }
const char *st_server_host(const st_server *s) { return s->host; }

/* Waits on s->cv (s->mu held) until n_active is 0 or the monotonic time `until`; whether it is 0. */
static bool wait_active(st_server *s, const struct timespec *until) {
    while (s->n_active > 0)
        if (pthread_cond_timedwait(&s->cv, &s->mu, until) == ETIMEDOUT) break;
    return s->n_active == 0;
}

/* wait_active, ending early when st_server_abort was called. */
static bool wait_active_or_abort(st_server *s, const struct timespec *until) {
    while (s->n_active > 0 && !atomic_load(&s->stopping))
        if (pthread_cond_timedwait(&s->cv, &s->mu, until) == ETIMEDOUT) break;
    return s->n_active == 0;
}

static struct timespec mono_after(double secs) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (!(secs >= 0)) secs = 0;
    if (secs > 1e9) secs = 1e9;
    const time_t whole = (time_t)secs;
    ts.tv_sec += whole;
    ts.tv_nsec += (long)((secs - (double)whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* Aborts every request in flight (a shutdown's drain is over). */
static void cancel_all(st_server *s) {
    pthread_mutex_lock(&s->mu);
    for (req *r = s->reqs; r; r = r->next) cancel(r);
    pthread_mutex_unlock(&s->mu);
}

/* Resumes every suspended connection (s->ending is set: none suspends again). */
static void resume_all(st_server *s) {
    pthread_mutex_lock(&s->mu);
    for (req *r = s->reqs; r; r = r->next) {
        pthread_mutex_lock(&r->mu);
        req_wake_locked(r);
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&s->mu);
}

int64_t st_server_shutdown(st_server *s, double timeout_s) {
    if (!s) return 0;
    pthread_mutex_lock(&s->mu); /* with handle_generate's count: no request slips in after the drain began */
    atomic_store(&s->draining, true);
    const int64_t running = s->n_active;
    pthread_mutex_unlock(&s->mu);
    st_log(STRATA_LOG_INFO, "server: shutting down: %lld request(s) in flight, up to %g s to finish",
           (long long)running, timeout_s);
    struct timespec until = mono_after(timeout_s);
    pthread_mutex_lock(&s->mu);
    const bool drained = wait_active_or_abort(s, &until);
    const int64_t left = s->n_active;
    pthread_mutex_unlock(&s->mu);
    if (drained) return 0;
    st_log(STRATA_LOG_INFO, "server: shutting down: aborting %lld request(s) still in flight", (long long)left);
    /* their on_finish (reason abort) comes at the next engine step and resumes their
     * connections: a stream ends with an error event and [DONE], a whole answer is a 503 */
    atomic_store(&s->stopping, true);
    cancel_all(s);
    until = mono_after(ABORT_GRACE_S);
    pthread_mutex_lock(&s->mu);
    const bool ended = wait_active(s, &until);
    pthread_mutex_unlock(&s->mu);
    if (!ended) { /* the engine is not stepping: answer without it */
        atomic_store(&s->ending, true);
        resume_all(s);
        until = mono_after(1.0);
        pthread_mutex_lock(&s->mu);
        if (!wait_active(s, &until))
            st_log(STRATA_LOG_WARN, "server: shutting down: %lld request(s) did not end after the abort",
                   (long long)s->n_active);
        pthread_mutex_unlock(&s->mu);
    }
    return left;
}

void st_server_abort(st_server *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    atomic_store(&s->draining, true);
    atomic_store(&s->stopping, true);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void st_server_stop(st_server *s) {
    if (!s) return;
    atomic_store(&s->draining, true);
    atomic_store(&s->stopping, true);
    atomic_store(&s->ending, true);
    /* the watcher first: it hands connections to libmicrohttpd, which is stopped next */
    if (s->watcher_started) {
        pthread_mutex_lock(&s->mu);
        s->watch_quit = true;
        pthread_mutex_unlock(&s->mu);
        watcher_wake(s);
        pthread_join(s->watcher, NULL);
        s->watcher_started = false;
    }
    if (s->listen_fd >= 0) close(s->listen_fd);
    s->listen_fd = -1;
    pthread_mutex_lock(&s->mu); /* the front door's connections, and those handed over and never started */
    for (conn *k = s->conns, *nk; k; k = nk) {
        nk = k->next;
        if (k->front || k->handed) conn_drop_locked(s, k);
    }
    pthread_mutex_unlock(&s->mu);
    if (s->d) {
        /* libmicrohttpd must not be stopped with suspended connections: resume them all; with
         * `ending` set none suspends again (handlers and readers check it under r->mu) */
        resume_all(s);
        MHD_stop_daemon(s->d); /* ends the connections: on_completed aborts their requests */
    }
    s->d = NULL;
    /* the engine calls on_finish for every aborted request at its next step */
    pthread_mutex_lock(&s->mu);
    while (s->n_engine > 0) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    pd_node_destroy(s->pd); /* its prefills aborted and waited for, its tickets cancelled */
    s->pd = NULL;
    if (s->ep >= 0) close(s->ep);
    if (s->wake_fd >= 0) close(s->wake_fd);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->stat_mu);
    pthread_mutex_destroy(&s->log_mu);
    st_free(s->host);
    st_free(s->model_name);
    st_free(s->api_key);
    st_free(s->peek);
    st_free(s);
}

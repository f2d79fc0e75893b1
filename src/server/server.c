/* The HTTP server over libmicrohttpd (thread per connection). See server.h.
 *
 * Prometheus metrics (names are stable):
 *   strata_http_requests_total{route,code}          counter
 *   strata_http_stream_disconnects_total            counter  clients gone before the end
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
 */
#include "server/server.h"
#include "core/core.h"
#include "core/strbuf.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "server/openai.h"

#define DEF_MAX_BODY (1u << 20)
#define DEF_MAX_CONN 1024
#define DEF_IDLE_TIMEOUT 300
#define WAIT_SLICE_MS 100
/* After a shutdown aborts a request, how long its connection waits for the
 * engine's on_finish (the abort takes effect at the next engine step) before
 * ending the answer without it. */
#define ABORT_GRACE_S 5.0
/* An oversized body without a Content-Length is read and dropped up to this
 * many times the limit before the connection is simply closed. */
#define DISCARD_FACTOR 16

typedef enum { R_CHAT = 0, R_COMPLETIONS, R_MODELS, R_HEALTH, R_METRICS, R_OTHER, R_COUNT_ } route;
static const char *const ROUTE_NAMES[R_COUNT_] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                  "/health", "/metrics", "other"};
static const int CODES[] = {200, 400, 401, 404, 405, 413, 415, 421, 429, 431, 499, 500, 503};
#define N_CODES ((int)(sizeof CODES / sizeof CODES[0]))

struct st_server {
    strata_model *model;
    int64_t max_seq_len;          /* the engine's (strata_engine_info) */
    strata_engine_info info;      /* the engine's parameters and step costs (fixed) */
    char *host, *api_key, *model_name;
    size_t max_body;
    bool metrics_public;          /* /health and /metrics open even with an API key */
    bool loopback;                /* bound to a loopback address: Host must name this machine */
    int port;
    long long created;
    double device_read_bw, gemm_rate, gemm_rate_precise;
    uint64_t seed_base;
    struct MHD_Daemon *d;
    atomic_bool draining;         /* shutting down: new generation requests (and /health) get 503 */
    atomic_bool stopping;         /* requests in flight are aborted (streams end with an error event) */
    atomic_uint_fast64_t counter; /* request numbers: ids and default seeds */

    pthread_mutex_t mu;           /* guards what follows */
    pthread_cond_t cv;            /* n_engine or n_active dropped (CLOCK_MONOTONIC) */
    int64_t n_engine;             /* requests whose on_finish has not come yet */
    int64_t n_active;             /* generation requests submitted and not yet answered (until on_completed) */
    int64_t http[R_COUNT_][N_CODES + 1]; /* the last column: other codes */
    int64_t disconnects;
    char mhd_msg[256];            /* libmicrohttpd's last log line (for start errors) */
};

/* ---- one HTTP request ------------------------------------------------------------------------
 * References: the connection (until libmicrohttpd's request-completed
 * notice), the streaming response (until its free callback), the engine
 * (until on_finish). */
typedef struct {
    st_server *srv;
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* text arrived, or the end */
    int refs;                   /* under mu */
    route rt;
    /* body */
    st_strbuf body;
    bool too_large;
    size_t discarded;
    /* generation */
    srv_answer_meta meta;
    char id[48];
    bool stream, include_usage;
    uint64_t eid;               /* engine id (0: not added) */
    int64_t n_prompt;
    int fd;                     /* the connection's socket, for disconnect checks */
    /* filled by the engine thread, under mu */
    st_strbuf text;                  /* non-streamed: everything; streamed: not yet sent */
    bool finished;
    strata_finish fin;            /* detail: a static string; error: NULL (fin_error) */
    char *fin_error;
    /* streaming: owned by the connection thread */
    st_strbuf out;
    size_t out_pos;
    bool role_sent, done;
    bool aborted;               /* this side aborted it (client gone, shutdown) */
    bool active;                /* counted in srv->n_active */
    double abort_t;             /* when a shutdown aborted it (st_time_now) */
} req;

static req *req_new(st_server *s) {
    req *r = st_calloc(1, sizeof *r);
    if (!r) return NULL;
    r->srv = s;
    r->refs = 1;
    r->fd = -1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
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
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    st_free(r->body.p);
    st_free(r->text.p);
    st_free(r->out.p);
    st_free(r->fin_error);
    st_free(r);
}

/* Waits up to WAIT_SLICE_MS on r->cv (r->mu held). */
static void req_wait_slice(req *r) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += WAIT_SLICE_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
}

/* Whether the peer of `fd` has closed or reset the connection. */
static bool peer_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) return true;
    if (p.revents & POLLIN) {
        char c;
        ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    return false;
}

/* ---- engine callbacks (engine thread) ------------------------------------------------------*/
static void on_text(void *user, const char *text, size_t len) {
    req *r = user;
    pthread_mutex_lock(&r->mu);
    if (!st_strbuf_add(&r->text, text, len)) st_log(STRATA_LOG_ERROR, "server: %s: out of memory for the answer", r->id);
    pthread_cond_signal(&r->cv);
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
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    req_unref(r);
    pthread_mutex_lock(&s->mu);
    s->n_engine--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---- replies ------------------------------------------------------------------------------------*/
static void count_reply(st_server *s, route rt, int status) {
    int col = N_CODES;
    for (int i = 0; i < N_CODES; i++)
        if (CODES[i] == status) col = i;
    pthread_mutex_lock(&s->mu);
    s->http[rt][col]++;
    pthread_mutex_unlock(&s->mu);
}

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
    pthread_mutex_lock(&s->mu);
    memcpy(http, s->http, sizeof http);
    const int64_t disconnects = s->disconnects;
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

/* The client went away (or the server is stopping): abort the engine request. */
static void client_gone(req *r) {
    st_server *s = r->srv;
    r->aborted = true;
    strata_abort(s->model, r->eid);
    const bool stopping = atomic_load(&s->stopping);
    if (!stopping) {
        pthread_mutex_lock(&s->mu);
        s->disconnects++;
        pthread_mutex_unlock(&s->mu);
    }
    st_log(STRATA_LOG_INFO, "server: %s: %s; request aborted", r->id,
           stopping ? "the server is stopping" : "the client went away");
}

/* The server is shutting down and its drain time is over: abort the engine
 * request, whose on_finish (reason abort) then ends the answer with an error
 * (an error event and [DONE] on a stream, a 503 otherwise). */
static void cancel(req *r) {
    r->aborted = true;
    r->abort_t = st_time_now();
    pthread_mutex_lock(&r->mu);
    const bool fin = r->finished;
    pthread_mutex_unlock(&r->mu);
    if (fin || strata_abort(r->srv->model, r->eid) != STRATA_OK) return; /* it ended on its own */
    st_log(STRATA_LOG_INFO, "server: %s: the server is shutting down; request aborted", r->id);
}

/* Whether a request cancelled by a shutdown has waited for its on_finish
 * longer than ABORT_GRACE_S (the engine is not stepping). */
static bool cancel_overdue(const req *r) { return r->aborted && st_time_now() - r->abort_t > ABORT_GRACE_S; }

/* libmicrohttpd's content reader for a streamed answer: blocks until the
 * engine has something, then hands out SSE bytes. */
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
        if (!r->aborted && atomic_load(&s->stopping)) cancel(r);

        st_strbuf piece = {0};
        pthread_mutex_lock(&r->mu);
        while (r->role_sent && r->text.len == 0 && !r->finished) {
            req_wait_slice(r);
            if (r->text.len || r->finished) break;
            if (peer_gone(r->fd) || cancel_overdue(r)) {
                pthread_mutex_unlock(&r->mu);
                if (!r->aborted) client_gone(r);
                return MHD_CONTENT_READER_END_WITH_ERROR;
            }
            if (!r->aborted && atomic_load(&s->stopping)) {
                pthread_mutex_unlock(&r->mu);
                cancel(r);
                pthread_mutex_lock(&r->mu);
            }
        }
        piece = r->text; /* take the pending text */
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
            strata_abort(s->model, r->eid);
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

static enum MHD_Result handle_generate(struct MHD_Connection *c, req *r, srv_kind kind) {
    st_server *s = r->srv;
    srv_gen g;
    srv_error e;
    if (atomic_load(&s->draining))
        return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                           "the server is shutting down and takes no new requests");
    if (!srv_parse_gen(kind, r->body.p ? r->body.p : "", r->body.len, s->model, &g, &e)) return reply_error(c, r, &e, NULL);
    st_free(r->body.p);
    r->body = (st_strbuf){0};
    if (g.model && strcmp(g.model, s->model_name) != 0) {
        srv_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                      "The model '%.200s' does not exist: this server serves '%.200s' (GET /v1/models)", g.model,
                      s->model_name);
        srv_gen_clear(&g);
        return reply_error(c, r, &e, NULL);
    }

    int32_t *ids = NULL;
    int64_t n = 0;
    if (g.prompt_ids) {
        ids = g.prompt_ids;
        n = g.n_prompt_ids;
        g.prompt_ids = NULL;
    } else if (!encode(s->model, g.prompt_text, true, &ids, &n)) {
        srv_error_set(&e, 400, "invalid_request_error", "invalid_value", kind == SRV_CHAT ? "messages" : "prompt",
                      "the prompt cannot be tokenized: %s", st_last_error());
        srv_gen_clear(&g);
        return reply_error(c, r, &e, NULL);
    }
    const char *pname = kind == SRV_CHAT ? "messages" : "prompt";
    const int64_t ctx = s->max_seq_len;
    if (n == 0) {
        srv_error_set(&e, 400, "invalid_request_error", "invalid_value", pname, "the prompt is empty (no tokens)");
    } else if (n >= ctx) {
        srv_error_set(&e, 400, "invalid_request_error", "context_length_exceeded", pname,
                      "This model's maximum context length is %lld tokens, but the prompt has %lld tokens "
                      "(prompt and completion must fit together, with at least 1 completion token).",
                      (long long)ctx, (long long)n);
    } else {
        e.status = 0;
    }
    if (e.status) {
        st_free(ids);
        srv_gen_clear(&g);
        return reply_error(c, r, &e, NULL);
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
    const strata_callbacks cb = {on_text, on_finish, r};
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
    strata_status st = refuse ? st_err(STRATA_ERR_UNSUPPORTED, "the server is shutting down")
                              : strata_submit(s->model, &er, &cb, &r->eid);
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
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    r->fd = ci ? ci->connect_fd : -1;

    if (r->stream) {
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_reader, r,
                                                                      stream_free);
        if (!resp) {
            strata_abort(s->model, r->eid);
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

    /* whole answer: wait here (this connection's own thread) */
    pthread_mutex_lock(&r->mu);
    while (!r->finished) {
        req_wait_slice(r);
        if (r->finished) break;
        if (peer_gone(r->fd) || cancel_overdue(r)) {
            pthread_mutex_unlock(&r->mu);
            if (!r->aborted) {
                client_gone(r);
                count_reply(s, r->rt, 499);
                return MHD_NO;
            }
            return error_reply(c, r, 503, "server_error", "server_shutting_down", NULL,
                               "the request was cancelled (the server is shutting down)");
        }
        if (!r->aborted && atomic_load(&s->stopping)) {
            pthread_mutex_unlock(&r->mu);
            cancel(r);
            pthread_mutex_lock(&r->mu);
        }
    }
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

/* ---- routing ------------------------------------------------------------------------------------*/
static route route_of(const char *url) {
    for (int i = 0; i < R_OTHER; i++)
        if (!strcmp(url, ROUTE_NAMES[i])) return (route)i;
    return R_OTHER;
}

/* Constant-time comparison of the presented key with the server's. */
static bool key_ok(const st_server *s, struct MHD_Connection *c) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    /* the scheme is case-insensitive (RFC 9110 11.1), then one or more spaces */
    if (!h || strncasecmp(h, "Bearer", 6) != 0 || (h[6] != ' ' && h[6] != '\t')) return false;
    const char *k = h + 6;
    while (*k == ' ' || *k == '\t') k++;
    const size_t n = strlen(s->api_key), m = strlen(k);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)s->api_key[i] ^ (unsigned char)(i < m ? k[i] : 0);
    return diff == 0;
}

/* Whether the value of a Host header names this machine: localhost, 127.0.0.1,
 * [::1] or the bound host, with or without a port. */
static bool host_ok(const st_server *s, const char *h) {
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
    const size_t hl = strlen(s->host);
    if (strchr(s->host, ':')) /* an IPv6 literal: bracketed in Host */
        return name_len == hl + 2 && h[0] == '[' && !strncasecmp(h + 1, s->host, hl);
    return name_len == hl && !strncasecmp(h, s->host, hl);
}

/* Whether the address the server binds is a loopback one (then only local
 * clients reach it, and a Host naming another site is a DNS-rebinding page). */
static bool loopback_host(const char *host) {
    return !strcasecmp(host, "localhost") || !strncmp(host, "127.", 4) || !strcmp(host, "::1") ||
           !strcasecmp(host, "::ffff:127.0.0.1");
}

/* Whether a Content-Type names application/json (parameters such as charset allowed). */
static bool json_ctype(const char *ct) {
    if (!ct) return false;
    while (*ct == ' ' || *ct == '\t') ct++;
    static const char want[] = "application/json";
    if (strncasecmp(ct, want, sizeof want - 1) != 0) return false;
    const char *rest = ct + sizeof want - 1;
    while (*rest == ' ' || *rest == '\t') rest++;
    return *rest == '\0' || *rest == ';';
}

static enum MHD_Result dispatch(struct MHD_Connection *c, req *r, const char *url, const char *method) {
    st_server *s = r->srv;
    const bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    const bool post = !strcmp(method, "POST");
    if (s->loopback) {
        const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
        if (h && !host_ok(s, h))
            return error_reply(c, r, 421, "invalid_request_error", "invalid_host", NULL,
                               "the Host header '%.100s' does not name this server (it listens on %s: use "
                               "localhost or 127.0.0.1)", h, s->host);
    }
    const bool open_probe = (r->rt == R_HEALTH || r->rt == R_METRICS) && s->metrics_public;
    if (s->api_key && (!strncmp(url, "/v1/", 4) || r->rt == R_HEALTH || r->rt == R_METRICS) && !open_probe &&
        !key_ok(s, c)) {
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
        if (!json_ctype(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE))) {
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
            static const char ok[] = "{\"status\":\"ok\"}";
            return reply(c, r, 200, "application/json", ok, sizeof ok - 1, NULL);
        }
        {
            char *text = metrics_text(s);
            if (!text) return error_reply(c, r, 500, "server_error", NULL, NULL, "out of memory");
            enum MHD_Result ok = reply(c, r, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
            st_free(text);
            return ok;
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
    if (r->too_large)
        return error_reply(c, r, 413, "invalid_request_error", "request_too_large", NULL,
                           "the request body is over the limit of %zu bytes", s->max_body);
    return dispatch(c, r, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)c;
    st_server *s = cls;
    req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    if (r->eid && !r->aborted) {
        pthread_mutex_lock(&r->mu);
        const bool fin = r->finished;
        pthread_mutex_unlock(&r->mu);
        /* e.g. a write to a closed socket failed mid-stream */
        if (!fin && strata_abort(s->model, r->eid) == STRATA_OK) {
            st_log(STRATA_LOG_INFO, "server: %s: connection ended (code %d) before the answer; request aborted",
                   r->id, (int)toe);
            pthread_mutex_lock(&s->mu);
            s->disconnects++;
            pthread_mutex_unlock(&s->mu);
        }
    }
    if (r->active) { /* answered (or the connection ended): a shutdown's drain waits for this */
        pthread_mutex_lock(&s->mu);
        s->n_active--;
        r->active = false;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    req_unref(r);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    st_server *s = cls;
    char msg[256];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    pthread_mutex_lock(&s->mu);
    snprintf(s->mhd_msg, sizeof s->mhd_msg, "%s", msg);
    pthread_mutex_unlock(&s->mu);
    /* the answers libmicrohttpd writes itself (a malformed request line or header, a bad
     * Content-Length, headers too large: 400, 413, 431, 505) are counted too, under "other" */
    const char *code = strstr(msg, "HTTP response code is ");
    if (code) {
        const int status = atoi(code + strlen("HTTP response code is "));
        if (status >= 400 && status < 600) count_reply(s, R_OTHER, status);
    }
    /* what a content reader ending a stream early (client gone) makes it say */
    const bool expected = strstr(msg, "Application reported internal error") != NULL;
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
    if (!s) return st_err(STRATA_ERR_NOMEM, "server: out of memory");
    s->model = m;
    s->info = info;
    s->max_seq_len = info.max_seq_len;
    pthread_mutex_init(&s->mu, NULL);
    {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&s->cv, &ca);
        pthread_condattr_destroy(&ca);
    }
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
    atomic_init(&s->counter, 0);
    if (s->host) s->loopback = loopback_host(s->host);
    if (!s->host || !s->model_name || (params->api_key && params->api_key[0] && !s->api_key)) {
        st_server_stop(s);
        return st_err(STRATA_ERR_NOMEM, "server: out of memory");
    }

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
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                     MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    s->d = MHD_start_daemon(flags, (uint16_t)params->port, NULL, NULL, on_access, s,
                            MHD_OPTION_EXTERNAL_LOGGER, mhd_log, s, /* first, to catch every message */
                            MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)(params->idle_timeout_s ? params->idle_timeout_s : DEF_IDLE_TIMEOUT),
                            MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)(params->max_connections ? params->max_connections : DEF_MAX_CONN),
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) {
        strata_status st = st_err(STRATA_ERR_IO, "server: cannot listen on %s port %d%s%s", s->host, params->port,
                                  s->mhd_msg[0] ? ": " : "", s->mhd_msg);
        st_server_stop(s);
        return st;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    s->port = di && di->port ? di->port : params->port;
    st_log(STRATA_LOG_INFO, "server: listening on %s port %d (model '%s'%s)", s->host, s->port, s->model_name,
           s->api_key ? ", API key required" : "");
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
    atomic_store(&s->stopping, true); /* the connections' waits abort their requests within WAIT_SLICE_MS */
    until = mono_after(ABORT_GRACE_S + 1.0);
    pthread_mutex_lock(&s->mu);
    if (!wait_active(s, &until))
        st_log(STRATA_LOG_WARN, "server: shutting down: %lld request(s) did not end after the abort",
               (long long)s->n_active);
    pthread_mutex_unlock(&s->mu);
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
    if (s->d) MHD_stop_daemon(s->d); /* ends the connections: their waits see `stopping` and abort */
    s->d = NULL;
    /* the engine calls on_finish for every aborted request at its next step */
    pthread_mutex_lock(&s->mu);
    while (s->n_engine > 0) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    st_free(s->host);
    st_free(s->model_name);
    st_free(s->api_key);
    st_free(s);
}

/* disagg/router: see router.h. */
#include "disagg/router.h"

#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <microhttpd.h>
#include <xxhash.h>

#include "core/core.h"
#include "core/http_check.h"
#include "core/json.h"
#include "core/strbuf.h"
#include "http/http_answer.h"
#include "http/mhd_pages.h"

#define CONNECT_TIMEOUT_S 2L
#define RESERVE_TIMEOUT_S 30L
#define CANCEL_TIMEOUT_S 5L
#define HEALTH_TIMEOUT_MS 1000L
#define FIRST_BYTE_EXTRA_S 30.0 /* the generation's first byte: pd_timeout + this */
#define BETWEEN_BYTES_S 300.0   /* then between bytes */
#define DEF_MAX_BODY ((size_t)1 << 20)
#define MAX_NODES 64
#define MAX_BLOCK_TOKENS 65536        /* bounds of a /pd/reserve answer's counts */
#define MAX_PROMPT_BLOCKS ((int64_t)1 << 24)
#define DISCARD_FACTOR 16 /* a body over the limit is read and dropped up to this many times the limit */

/* ---- routes and metrics ------------------------------------------------------------------------*/
typedef enum { R_CHAT, R_COMPLETIONS, R_MODELS, R_HEALTH, R_METRICS, R_OTHER, R_COUNT_ } route;
static const char *const ROUTE_NAMES[R_COUNT_] = {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                  "/health", "/metrics", "other"};
enum { STAGE_RESERVE, STAGE_PREFILL, STAGE_DECODE, STAGE_COUNT_ };
static const char *const STAGE_NAMES[STAGE_COUNT_] = {"reserve", "prefill", "decode"};

/* ---- prefix affinity: an LRU set of block hashes ---------------------------------------------*/
typedef struct {
    uint64_t *key;
    int32_t *prev, *next, *hnext, *bucket; /* LRU list, hash chains (bucket heads: cap of them) */
    int32_t head, tail, n, cap;
} lru_set;

static bool lru_init(lru_set *s, int32_t cap) {
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->key = st_malloc(sizeof(uint64_t) * (size_t)cap);
    s->prev = st_malloc(sizeof(int32_t) * (size_t)cap);
    s->next = st_malloc(sizeof(int32_t) * (size_t)cap);
    s->hnext = st_malloc(sizeof(int32_t) * (size_t)cap);
    s->bucket = st_malloc(sizeof(int32_t) * (size_t)cap);
    if (!s->key || !s->prev || !s->next || !s->hnext || !s->bucket) return false;
    for (int32_t i = 0; i < cap; i++) s->bucket[i] = -1;
    s->head = s->tail = -1;
    return true;
}

static void lru_free(lru_set *s) {
    st_free(s->key);
    st_free(s->prev);
    st_free(s->next);
    st_free(s->hnext);
    st_free(s->bucket);
    memset(s, 0, sizeof *s);
}

static int32_t lru_find(const lru_set *s, uint64_t k) {
    if (!s->cap) return -1;
    for (int32_t i = s->bucket[k % (uint64_t)s->cap]; i >= 0; i = s->hnext[i])
        if (s->key[i] == k) return i;
    return -1;
}

static void lru_unlink(lru_set *s, int32_t i) {
    if (s->prev[i] >= 0) s->next[s->prev[i]] = s->next[i];
    else s->head = s->next[i];
    if (s->next[i] >= 0) s->prev[s->next[i]] = s->prev[i];
    else s->tail = s->prev[i];
}

static void lru_push_front(lru_set *s, int32_t i) {
    s->prev[i] = -1;
    s->next[i] = s->head;
    if (s->head >= 0) s->prev[s->head] = i;
    s->head = i;
    if (s->tail < 0) s->tail = i;
}

/* Inserts k (or refreshes it), evicting the least recently used when full. */
static void lru_add(lru_set *s, uint64_t k) {
    if (!s->cap) return;
    int32_t i = lru_find(s, k);
    if (i >= 0) {
        lru_unlink(s, i);
        lru_push_front(s, i);
        return;
    }
    if (s->n < s->cap) {
        i = s->n++;
    } else { /* evict the tail: out of its hash chain too */
        i = s->tail;
        lru_unlink(s, i);
        int32_t *pp = &s->bucket[s->key[i] % (uint64_t)s->cap];
        while (*pp != i) pp = &s->hnext[*pp];
        *pp = s->hnext[i];
    }
    s->key[i] = k;
    const uint64_t b = k % (uint64_t)s->cap;
    s->hnext[i] = s->bucket[b];
    s->bucket[b] = i;
    lru_push_front(s, i);
}

/* ---- nodes --------------------------------------------------------------------------------------*/
typedef enum { ROLE_PREFILL, ROLE_DECODE } node_role;

typedef struct {
    char *url; /* base, no trailing '/' */
    node_role role;
    /* under the router's mu: */
    bool up;
    int64_t running, waiting, kv_free, queued_tokens; /* its last /health */
    int64_t inflight;        /* the router's requests there now */
    int64_t inflight_tokens; /* prefill: prompt tokens sent there and not yet answered */
    lru_set sent;            /* prefill: hashes of the blocks sent there */
} node;

struct st_router {
    st_router_params p;
    char *api_key, *node_auth, *host; /* node_auth: "Authorization: Bearer ..." or NULL */
    bool loopback;
    node nodes[2 * MAX_NODES];
    int n_nodes;
    struct MHD_Daemon *d;
    int port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t health;
    bool health_started;
    atomic_bool stopping;
    int64_t jobs;   /* prefill threads running (under mu) */
    int64_t active; /* generation requests being handled or streamed (under mu) */
    /* metrics (under mu) */
    int64_t requests[R_COUNT_][600];
    int64_t retries[STAGE_COUNT_];
    int64_t prefill_cancelled;
};

static double now_s(void) { return st_time_now(); }

static void node_down(st_router *r, int i, const char *why) {
    pthread_mutex_lock(&r->mu);
    const bool was = r->nodes[i].up;
    r->nodes[i].up = false;
    pthread_mutex_unlock(&r->mu);
    if (was) st_log(STRATA_LOG_WARN, "router: %s node %s is down: %s",
                    r->nodes[i].role == ROLE_DECODE ? "decode" : "prefill", r->nodes[i].url, why);
}

/* ---- HTTP client (libcurl) -------------------------------------------------------------------*/
/* What came back from a node. */
typedef struct {
    long status;
    char ctype[256], cache_control[256];
    st_strbuf body;
    bool headers_done;
    double last_byte; /* time of the last body byte */
} reply_buf;

static void trim_value(char *dst, size_t cap, const char *v, size_t n) {
    while (n && (*v == ' ' || *v == '\t')) v++, n--;
    while (n && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
    if (n >= cap) n = cap - 1;
    memcpy(dst, v, n);
    dst[n] = 0;
}

static size_t on_header(char *b, size_t size, size_t nitems, void *user) {
    reply_buf *rb = user;
    const size_t n = size * nitems;
    if (n >= 5 && !strncmp(b, "HTTP/", 5)) { /* a status line: a new head (after 100 Continue) */
        rb->ctype[0] = rb->cache_control[0] = 0;
        rb->headers_done = false;
        const char *sp = memchr(b, ' ', n);
        rb->status = sp ? strtol(sp + 1, NULL, 10) : 0;
    } else if (n <= 2 && (b[0] == '\r' || b[0] == '\n')) {
        if (rb->status >= 200) rb->headers_done = true;
    } else if (n > 13 && !strncasecmp(b, "Content-Type:", 13)) {
        trim_value(rb->ctype, sizeof rb->ctype, b + 13, n - 13);
    } else if (n > 14 && !strncasecmp(b, "Cache-Control:", 14)) {
        trim_value(rb->cache_control, sizeof rb->cache_control, b + 14, n - 14);
    }
    return n;
}

static size_t on_body(char *b, size_t size, size_t nmemb, void *user) {
    reply_buf *rb = user;
    const size_t n = size * nmemb;
    if (!st_strbuf_add(&rb->body, b, n)) return 0; /* out of memory: the transfer fails */
    rb->last_byte = now_s();
    return n;
}

/* Whether the client of a connection has gone away (its socket read EOF or an error). */
static bool client_gone_fd(int fd) {
    if (fd < 0) return false;
    char c;
    const ssize_t k = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* Why a synchronous hop should stop early. */
typedef struct {
    st_router *r;
    atomic_bool *cancel; /* NULL: none */
    int client_fd;       /* -1: none */
} hop_guard;

static int on_progress(void *user, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un) {
    (void)dt, (void)dn, (void)ut, (void)un;
    const hop_guard *g = user;
    if (!g) return 0;
    if (atomic_load(&g->r->stopping)) return 1;
    if (g->cancel && atomic_load(g->cancel)) return 1;
    if (client_gone_fd(g->client_fd)) return 1;
    return 0;
}

/* An easy handle for METHOD url[path] (body: POST with it). */
static CURL *hop_handle(st_router *r, const char *base, const char *path, const char *body, size_t len,
                        const char *ctype, const char *extra_header, reply_buf *rb, struct curl_slist **hdrs,
                        hop_guard *g) {
    CURL *h = curl_easy_init();
    if (!h) return NULL;
    char url[1024];
    snprintf(url, sizeof url, "%s%s", base, path);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT, CONNECT_TIMEOUT_S);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, rb);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, rb);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    if (g) {
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, g);
    }
    struct curl_slist *l = NULL;
    l = curl_slist_append(l, "Expect:"); /* no 100-continue round trip */
    if (r->node_auth) l = curl_slist_append(l, r->node_auth);
    if (extra_header) l = curl_slist_append(l, extra_header);
    if (body) {
        char ct[300];
        snprintf(ct, sizeof ct, "Content-Type: %s", ctype ? ctype : "application/json");
        l = curl_slist_append(l, ct);
        curl_easy_setopt(h, CURLOPT_POST, 1L);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    }
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, l);
    *hdrs = l;
    return h;
}

/* One synchronous request; CURLE_OK when an answer (any status) came back whole. */
static CURLcode hop(st_router *r, const char *base, const char *path, const char *body, size_t len,
                    double timeout_s, hop_guard *g, reply_buf *rb) {
    memset(rb, 0, sizeof *rb);
    struct curl_slist *hdrs = NULL;
    CURL *h = hop_handle(r, base, path, body, len, NULL, NULL, rb, &hdrs, g);
    if (!h) return CURLE_OUT_OF_MEMORY;
    long ms = (long)(timeout_s * 1000.0);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, ms < 1 ? 1L : ms);
    if (ms < CONNECT_TIMEOUT_S * 1000) curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, ms < 1 ? 1L : ms);
    const CURLcode res = curl_easy_perform(h);
    curl_easy_cleanup(h);
    curl_slist_free_all(hdrs);
    return res;
}

/* POST /pd/cancel {"ticket"} on decode node d, best effort. */
static void cancel_ticket(st_router *r, int d, const char *ticket) {
    char body[128];
    const int n = snprintf(body, sizeof body, "{\"ticket\":\"%s\"}", ticket);
    reply_buf rb;
    hop_guard g = {.r = r, .cancel = NULL, .client_fd = -1}; /* stops only at shutdown */
    const CURLcode res = hop(r, r->nodes[d].url, "/pd/cancel", body, (size_t)n, CANCEL_TIMEOUT_S, &g, &rb);
    if (res != CURLE_OK || rb.status != 200)
        st_log(STRATA_LOG_WARN, "router: /pd/cancel of ticket %s on %s failed: %s", ticket, r->nodes[d].url,
               res != CURLE_OK ? curl_easy_strerror(res) : "non-200 answer");
    else
        st_log(STRATA_LOG_INFO, "router: ticket %s cancelled on %s", ticket, r->nodes[d].url);
    st_strbuf_free(&rb.body);
}

/* ---- health -------------------------------------------------------------------------------------*/
static void apply_health(st_router *r, int i, CURLcode res, reply_buf *rb) {
    cJSON *j = NULL;
    bool ok = res == CURLE_OK && rb->status == 200 && rb->body.len &&
              st_json_parse(rb->body.p, rb->body.len, "/health", &j) == STRATA_OK && cJSON_IsObject(j);
    int64_t running = 0, waiting = 0, kv_free = 0, queued = 0;
    if (ok) {
        const st_json_where w = {"/health", NULL};
        ok = st_json_opt_int64(&w, j, "running", 0, &running) == STRATA_OK &&
             st_json_opt_int64(&w, j, "waiting", 0, &waiting) == STRATA_OK &&
             st_json_opt_int64(&w, j, "kv_blocks_free", 0, &kv_free) == STRATA_OK &&
             st_json_opt_int64(&w, j, "queued_prompt_tokens", 0, &queued) == STRATA_OK;
    }
    cJSON_Delete(j);
    node *n = &r->nodes[i];
    pthread_mutex_lock(&r->mu);
    const bool was = n->up;
    n->up = ok;
    if (ok) {
        n->running = running;
        n->waiting = waiting;
        n->kv_free = kv_free;
        n->queued_tokens = queued;
    }
    pthread_mutex_unlock(&r->mu);
    if (was != ok)
        st_log(ok ? STRATA_LOG_INFO : STRATA_LOG_WARN, "router: %s node %s is %s%s%s",
               n->role == ROLE_DECODE ? "decode" : "prefill", n->url, ok ? "up" : "down",
               ok ? "" : ": ", ok ? "" : res != CURLE_OK ? curl_easy_strerror(res) : "bad /health answer");
}

/* Polls every node once, all at once (timeout 1 s each). */
static void poll_all(st_router *r) {
    CURLM *m = curl_multi_init();
    if (!m) return;
    CURL *h[2 * MAX_NODES] = {0};
    struct curl_slist *hd[2 * MAX_NODES] = {0};
    reply_buf rb[2 * MAX_NODES];
    memset(rb, 0, sizeof rb);
    CURLcode res[2 * MAX_NODES];
    for (int i = 0; i < r->n_nodes; i++) {
        res[i] = CURLE_FAILED_INIT;
        h[i] = hop_handle(r, r->nodes[i].url, "/health", NULL, 0, NULL, NULL, &rb[i], &hd[i], NULL);
        if (!h[i]) continue;
        curl_easy_setopt(h[i], CURLOPT_TIMEOUT_MS, HEALTH_TIMEOUT_MS);
        curl_easy_setopt(h[i], CURLOPT_CONNECTTIMEOUT_MS, HEALTH_TIMEOUT_MS);
        curl_easy_setopt(h[i], CURLOPT_PRIVATE, (void *)(intptr_t)i);
        curl_multi_add_handle(m, h[i]);
    }
    int running = 1;
    const double end = now_s() + 2.0; /* every handle has its own 1 s timeout; a bound anyway */
    while (running && now_s() < end && !atomic_load(&r->stopping)) {
        curl_multi_perform(m, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(m, &left)))
            if (msg->msg == CURLMSG_DONE) {
                void *p = NULL;
                curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &p);
                res[(intptr_t)p] = msg->data.result;
            }
        if (running) curl_multi_poll(m, NULL, 0, 100, NULL);
    }
    for (int i = 0; i < r->n_nodes; i++) {
        if (h[i]) {
            curl_multi_remove_handle(m, h[i]);
            curl_easy_cleanup(h[i]);
        }
        curl_slist_free_all(hd[i]);
        if (!atomic_load(&r->stopping)) apply_health(r, i, res[i], &rb[i]);
        st_strbuf_free(&rb[i].body);
    }
    curl_multi_cleanup(m);
}

/* Polls every health_interval seconds (the first poll was st_router_start's). */
static void *health_main(void *arg) {
    st_router *r = arg;
    double t0 = now_s();
    while (!atomic_load(&r->stopping)) {
        double wait = r->p.health_interval - (now_s() - t0);
        if (wait < 0.05) wait = 0.05;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const double t = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + wait;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        pthread_mutex_lock(&r->mu);
        if (!atomic_load(&r->stopping)) pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        pthread_mutex_unlock(&r->mu);
        if (atomic_load(&r->stopping)) break;
        t0 = now_s();
        poll_all(r);
    }
    return NULL;
}

/* ---- node choice --------------------------------------------------------------------------------*/
/* The decode node to try next (not in tried), or -1. */
static int pick_decode(st_router *r, const bool *tried) {
    int best = -1;
    int64_t best_load = 0, best_free = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++) {
        const node *n = &r->nodes[i];
        if (n->role != ROLE_DECODE || !n->up || tried[i]) continue;
        const int64_t load = n->running + n->waiting + n->inflight;
        if (best < 0 || load < best_load || (load == best_load && n->kv_free > best_free)) {
            best = i;
            best_load = load;
            best_free = n->kv_free;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return best;
}

/* The prefill node for a prompt whose block hashes are hs[0..nb) (not in tried), or -1;
 * on a choice its in-flight counts grow by one request and `tokens`, and the
 * hashes are remembered as sent there. */
static int pick_prefill(st_router *r, const uint64_t *hs, int64_t nb, int64_t block_tokens, int64_t tokens,
                        const bool *tried, int64_t *affinity_out) {
    int best = -1;
    int64_t best_score = 0, best_inflight = 0, best_aff = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_nodes; i++) {
        const node *n = &r->nodes[i];
        if (n->role != ROLE_PREFILL || !n->up || tried[i]) continue;
        int64_t aff = 0;
        while (aff < nb && lru_find(&n->sent, hs[aff]) >= 0) aff++;
        const int64_t score = aff * block_tokens - (n->queued_tokens + n->inflight_tokens);
        if (best < 0 || score > best_score || (score == best_score && n->inflight < best_inflight)) {
            best = i;
            best_score = score;
            best_inflight = n->inflight;
            best_aff = aff;
        }
    }
    if (best >= 0) {
        node *n = &r->nodes[best];
        n->inflight++;
        n->inflight_tokens += tokens;
        for (int64_t b = 0; b < nb; b++) lru_add(&n->sent, hs[b]);
    }
    pthread_mutex_unlock(&r->mu);
    if (affinity_out) *affinity_out = best_aff;
    return best;
}

/* ---- the prefill job (a thread per ticket) ---------------------------------------------------*/
typedef struct {
    st_router *r;
    int d; /* the decode node holding the ticket */
    char ticket[32];
    cJSON *tokens; /* blocks 0 .. cached + blocks */
    int64_t block_tokens, from_block, blocks, n_tokens;
    char *identity, *address;
    uint64_t *hashes;
    atomic_bool cancel; /* the generation ended early: stop */
    atomic_int refs;
} pjob;

static void pjob_unref(pjob *j) {
    if (atomic_fetch_sub(&j->refs, 1) != 1) return;
    cJSON_Delete(j->tokens);
    st_free(j->identity);
    st_free(j->address);
    st_free(j->hashes);
    st_free(j);
}

static void *pjob_main(void *arg) {
    pjob *j = arg;
    st_router *r = j->r;
    bool tried[2 * MAX_NODES] = {false};
    const double budget = 2.0 * r->p.pd_timeout, t0 = now_s();
    bool done = false;
    const char *why = "no prefill node is up";
    for (int attempt = 1; !done; attempt++) {
        if (atomic_load(&j->cancel) || atomic_load(&r->stopping)) {
            why = NULL; /* the generation's side cancels */
            break;
        }
        double left = budget - (now_s() - t0);
        if (left <= 0) {
            why = "the prefill time budget (2 x --pd-timeout) is spent";
            break;
        }
        /* one attempt may take pd_timeout (the decode node computes the prompt itself after
         * that), all of them together 2 x pd_timeout */
        if (left > r->p.pd_timeout) left = r->p.pd_timeout;
        int64_t aff = 0;
        const int p = pick_prefill(r, j->hashes, j->from_block + j->blocks, j->block_tokens, j->n_tokens, tried, &aff);
        if (p < 0) {
            if (attempt > 1) why = "every prefill node failed";
            break;
        }
        tried[p] = true;
        if (attempt > 1) { /* a retry: counted once it has a node */
            pthread_mutex_lock(&r->mu);
            r->retries[STAGE_PREFILL]++;
            pthread_mutex_unlock(&r->mu);
        }
        cJSON *b = cJSON_CreateObject();
        cJSON_AddStringToObject(b, "ticket", j->ticket);
        cJSON_AddNumberToObject(b, "attempt", attempt);
        cJSON_AddItemReferenceToObject(b, "tokens", j->tokens);
        cJSON_AddNumberToObject(b, "block_tokens", (double)j->block_tokens);
        cJSON_AddNumberToObject(b, "from_block", (double)j->from_block);
        cJSON_AddNumberToObject(b, "blocks", (double)j->blocks);
        cJSON_AddStringToObject(b, "identity", j->identity);
        cJSON_AddStringToObject(b, "address", j->address);
        char *text = cJSON_PrintUnformatted(b);
        cJSON_Delete(b);
        st_log(STRATA_LOG_INFO, "router: ticket %s: prefill of %lld blocks from block %lld on %s (attempt %d, "
               "affinity %lld blocks)", j->ticket, (long long)j->blocks, (long long)j->from_block,
               r->nodes[p].url, attempt, (long long)aff);
        reply_buf rb;
        hop_guard g = {.r = r, .cancel = &j->cancel, .client_fd = -1};
        const CURLcode res = text ? hop(r, r->nodes[p].url, "/pd/prefill", text, strlen(text), left, &g, &rb)
                                  : CURLE_OUT_OF_MEMORY;
        free(text);
        pthread_mutex_lock(&r->mu);
        r->nodes[p].inflight--;
        r->nodes[p].inflight_tokens -= j->n_tokens;
        pthread_mutex_unlock(&r->mu);
        if (res == CURLE_OK && rb.status == 200) {
            st_log(STRATA_LOG_INFO, "router: ticket %s: prefill done on %s (%.3f s)", j->ticket, r->nodes[p].url,
                   now_s() - t0);
            done = true;
        } else if (res == CURLE_ABORTED_BY_CALLBACK) {
            why = NULL;
            st_strbuf_free(&rb.body);
            break;
        } else if (res == CURLE_OK && rb.status >= 400 && rb.status < 500) {
            st_log(STRATA_LOG_WARN, "router: ticket %s: prefill node %s refused it (%ld): %.300s", j->ticket,
                   r->nodes[p].url, rb.status, rb.body.p ? rb.body.p : "");
            why = "a prefill node refused it";
            st_strbuf_free(&rb.body);
            break;
        } else {
            if (res != CURLE_OK) node_down(r, p, curl_easy_strerror(res));
            st_log(STRATA_LOG_WARN, "router: ticket %s: prefill on %s failed (%s): trying another prefill node",
                   j->ticket, r->nodes[p].url, res != CURLE_OK ? curl_easy_strerror(res) : "a 5xx answer");
        }
        st_strbuf_free(&rb.body);
    }
    if (!done && why) {
        st_log(STRATA_LOG_WARN, "router: ticket %s: %s: cancelled (the decode node computes the prompt)", j->ticket,
               why);
        pthread_mutex_lock(&r->mu);
        r->prefill_cancelled++;
        pthread_mutex_unlock(&r->mu);
        cancel_ticket(r, j->d, j->ticket);
    }
    pthread_mutex_lock(&r->mu);
    r->jobs--;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pjob_unref(j);
    return NULL;
}

/* ---- replies ------------------------------------------------------------------------------------*/
typedef struct {
    st_router *r;
    route rt;
    st_strbuf body;
    bool too_large;
    size_t discarded; /* body bytes dropped past the limit */
} req;

static void count(st_router *r, route rt, int status) {
    if (status < 0 || status >= 600) status = 599;
    pthread_mutex_lock(&r->mu);
    r->requests[rt][status]++;
    pthread_mutex_unlock(&r->mu);
}

static enum MHD_Result reply(struct MHD_Connection *c, req *q, int status, const char *ctype, const char *body,
                             size_t len, const char *allow) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    if (ctype && *ctype) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    if (status == 401) MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (atomic_load(&q->r->stopping)) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    const enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    count(q->r, q->rt, status);
    return ok;
}

static enum MHD_Result error_reply(struct MHD_Connection *c, req *q, int status, const char *type, const char *code,
                                   const char *allow, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static enum MHD_Result error_reply(struct MHD_Connection *c, req *q, int status, const char *type, const char *code,
                                   const char *allow, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (status >= 500) st_log(STRATA_LOG_WARN, "router: %s %d: %s", ROUTE_NAMES[q->rt], status, msg);
    char *j = st_http_error_json(type, code, NULL, msg);
    static const char oom[] =
        "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";
    const enum MHD_Result ok = j ? reply(c, q, status, "application/json", j, strlen(j), allow)
                                 : reply(c, q, 500, "application/json", oom, sizeof oom - 1, NULL);
    free(j);
    return ok;
}

/* libmicrohttpd's inactivity timeout of a connection: none while a request
 * waits for a node (its thread is ours then), IDLE_TIMEOUT_S again once the
 * answer is out (setting it from 0 restarts its clock). */
#define IDLE_TIMEOUT_S 60u
static void conn_timeout(struct MHD_Connection *c, unsigned secs) {
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, secs);
}

/* ---- generation -------------------------------------------------------------------------------*/
typedef struct {
    st_router *r;
    req *q;
    struct MHD_Connection *c;
    int client_fd;
    const char *path; /* the route */
    const char *body; /* the client's (owned by q) */
    size_t len;
    char ctype[256];
    /* the current decode node's transfer */
    int d;
    bool inflight; /* counted in nodes[d].inflight */
    CURL *h;
    CURLM *m;
    struct curl_slist *hdrs;
    reply_buf rb;
    size_t off;       /* bytes of rb.body handed to libmicrohttpd */
    bool xfer_done;
    CURLcode res;
    double started;
    bool timed_out;
    bool finished;    /* the stream's end is in rb.body */
    char last[2];     /* the last two bytes handed out */
    char ticket[32];
    pjob *job;
} gen;

static void gen_end_transfer(gen *g) {
    if (g->h) {
        curl_multi_remove_handle(g->m, g->h);
        curl_easy_cleanup(g->h);
        g->h = NULL;
    }
    if (g->m) {
        curl_multi_cleanup(g->m);
        g->m = NULL;
    }
    curl_slist_free_all(g->hdrs);
    g->hdrs = NULL;
}

/* The current decode node is done with (answered, failed or abandoned). */
static void gen_release(gen *g, bool cancel) {
    gen_end_transfer(g);
    if (g->job) {
        atomic_store(&g->job->cancel, cancel);
        pjob_unref(g->job);
        g->job = NULL;
    }
    if (cancel && g->ticket[0]) cancel_ticket(g->r, g->d, g->ticket);
    g->ticket[0] = 0;
    if (g->inflight) {
        pthread_mutex_lock(&g->r->mu);
        g->r->nodes[g->d].inflight--;
        pthread_mutex_unlock(&g->r->mu);
        g->inflight = false;
    }
}

static void gen_free(gen *g) {
    st_router *r = g->r;
    gen_release(g, !g->xfer_done || g->res != CURLE_OK);
    st_strbuf_free(&g->rb.body);
    st_free(g);
    pthread_mutex_lock(&r->mu);
    r->active--;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static bool gen_start_transfer(gen *g) {
    char th[80]; /* no ticket (a plain server behind the router, or no prefill nodes): no header */
    snprintf(th, sizeof th, "X-Strata-PD-Ticket: %s", g->ticket);
    memset(&g->rb, 0, sizeof g->rb);
    g->off = 0;
    g->xfer_done = g->timed_out = false;
    g->m = curl_multi_init();
    g->h = g->m ? hop_handle(g->r, g->r->nodes[g->d].url, g->path, g->body, g->len, g->ctype, g->ticket[0] ? th : NULL,
                             &g->rb, &g->hdrs, NULL)
                : NULL;
    if (!g->h || curl_multi_add_handle(g->m, g->h) != CURLM_OK) return false;
    g->started = now_s();
    return true;
}

/* Moves the transfer on for up to wait_ms; sets xfer_done (res) at its end,
 * on a no-progress timeout, on shutdown or when the client left (res
 * CURLE_ABORTED_BY_CALLBACK then). */
static void gen_drive(gen *g, int wait_ms) {
    if (g->xfer_done) return;
    int running = 0;
    const size_t had = g->rb.body.len;
    const bool had_head = g->rb.headers_done;
    curl_multi_perform(g->m, &running);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(g->m, &left)))
        if (msg->msg == CURLMSG_DONE) {
            g->xfer_done = true;
            g->res = msg->data.result;
            return;
        }
    const double t = now_s();
    const double limit = g->rb.body.len || g->rb.last_byte > 0
                             ? g->rb.last_byte + BETWEEN_BYTES_S
                             : g->started + g->r->p.pd_timeout + FIRST_BYTE_EXTRA_S;
    if (t > limit) {
        g->xfer_done = g->timed_out = true;
        g->res = CURLE_OPERATION_TIMEDOUT;
        return;
    }
    if (atomic_load(&g->r->stopping) || client_gone_fd(g->client_fd)) {
        g->xfer_done = true;
        g->res = CURLE_ABORTED_BY_CALLBACK;
        return;
    }
    if (g->rb.body.len != had || g->rb.headers_done != had_head) return; /* news: hand it out first */
    curl_multi_poll(g->m, NULL, 0, wait_ms, NULL);
}

static void gen_hand_out(gen *g, const char *p, size_t n) {
    if (n >= 2) {
        g->last[0] = p[n - 2];
        g->last[1] = p[n - 1];
    } else if (n == 1) {
        g->last[0] = g->last[1];
        g->last[1] = p[0];
    }
}

/* A stream's content reader: D's bytes as they come, then the end (an error
 * event and [DONE] when D failed mid-stream). Never returns 0. */
static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    gen *g = cls;
    for (;;) {
        if (g->off < g->rb.body.len) {
            size_t n = g->rb.body.len - g->off;
            if (n > max) n = max;
            memcpy(buf, g->rb.body.p + g->off, n);
            gen_hand_out(g, buf, n);
            g->off += n;
            if (g->off == g->rb.body.len) {
                g->off = g->rb.body.len = 0;
                if (g->rb.body.p) g->rb.body.p[0] = 0;
            }
            return (ssize_t)n;
        }
        if (g->finished) {
            conn_timeout(g->c, IDLE_TIMEOUT_S);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        if (g->xfer_done) {
            g->finished = true;
            if (g->res == CURLE_OK) continue;
            if (g->res == CURLE_ABORTED_BY_CALLBACK && !atomic_load(&g->r->stopping))
                return MHD_CONTENT_READER_END_WITH_ERROR; /* the client left */
            const bool stop = atomic_load(&g->r->stopping);
            char msg[512];
            if (stop) snprintf(msg, sizeof msg, "the request was cancelled (the router is shutting down)");
            else snprintf(msg, sizeof msg, "the decode node %s failed mid-answer: %s", g->r->nodes[g->d].url,
                          g->timed_out ? "no data for too long" : curl_easy_strerror(g->res));
            st_log(STRATA_LOG_WARN, "router: %s: %s", g->path, msg);
            if (!stop) node_down(g->r, g->d, msg);
            char *j = st_http_error_json("server_error", stop ? "server_shutting_down" : "upstream_failed", NULL, msg);
            st_strbuf *b = &g->rb.body;
            if (g->last[0] != '\n' || g->last[1] != '\n') st_strbuf_add(b, "\n\n", 2); /* end a torn event */
            st_strbuf_printf(b, "data: %s\n\ndata: [DONE]\n\n", j ? j : "{}");
            free(j);
            continue;
        }
        gen_drive(g, 100);
    }
}

static void stream_free(void *cls) { gen_free(cls); }

/* Reserves on decode nodes until one takes the request; then prefill and generation. */
static enum MHD_Result handle_generate(struct MHD_Connection *c, req *q) {
    st_router *r = q->r;
    if (atomic_load(&r->stopping))
        return error_reply(c, q, 503, "server_error", "server_shutting_down", NULL,
                           "the server is shutting down and takes no new requests");
    cJSON *root = NULL;
    if (st_json_parse(q->body.p ? q->body.p : "", q->body.len, "request body", &root) != STRATA_OK) {
        return error_reply(c, q, 400, "invalid_request_error", "invalid_json", NULL,
                           "We could not parse the JSON body of your request: %s", st_last_error());
    }
    if (!cJSON_IsObject(root)) {
        const char *tn = st_json_type_name(root);
        cJSON_Delete(root);
        return error_reply(c, q, 400, "invalid_request_error", "invalid_json", NULL,
                           "the request body must be a JSON object, got %s", tn);
    }
    /* the reserve body: {"route", "request"} */
    cJSON *rb_obj = cJSON_CreateObject();
    char *reserve = NULL;
    if (rb_obj) {
        cJSON_AddStringToObject(rb_obj, "route", ROUTE_NAMES[q->rt]);
        cJSON_AddItemToObject(rb_obj, "request", root);
        reserve = cJSON_PrintUnformatted(rb_obj);
        cJSON_Delete(rb_obj);
    } else {
        cJSON_Delete(root);
    }
    if (!reserve) return error_reply(c, q, 500, "server_error", NULL, NULL, "out of memory");

    gen *g = st_calloc(1, sizeof *g);
    if (!g) {
        free(reserve);
        return error_reply(c, q, 500, "server_error", NULL, NULL, "out of memory");
    }
    g->r = r;
    g->q = q;
    g->c = c;
    pthread_mutex_lock(&r->mu);
    r->active++;
    pthread_mutex_unlock(&r->mu);
    conn_timeout(c, 0);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    g->client_fd = ci ? ci->connect_fd : -1;
    g->path = ROUTE_NAMES[q->rt];
    g->body = q->body.p ? q->body.p : "";
    g->len = q->body.len;
    const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    snprintf(g->ctype, sizeof g->ctype, "%s", ct ? ct : "application/json");

    bool tried[2 * MAX_NODES] = {false};
    char last_err[512] = "no decode node is up";
    int retry_stage = -1; /* the stage whose failure the next attempt retries */
    enum MHD_Result ret = MHD_NO;
    hop_guard guard = {.r = r, .cancel = NULL, .client_fd = g->client_fd};
    for (;;) {
        if (atomic_load(&r->stopping)) {
            ret = error_reply(c, q, 503, "server_error", "server_shutting_down", NULL,
                              "the server is shutting down and takes no new requests");
            goto out;
        }
        const int d = pick_decode(r, tried);
        if (d < 0) break;
        tried[d] = true;
        if (retry_stage >= 0) { /* a retry: counted once it has a node */
            pthread_mutex_lock(&r->mu);
            r->retries[retry_stage]++;
            pthread_mutex_unlock(&r->mu);
            retry_stage = -1;
        }
        g->d = d;
        pthread_mutex_lock(&r->mu);
        r->nodes[d].inflight++;
        pthread_mutex_unlock(&r->mu);
        g->inflight = true;
        if (r->p.n_prefill == 0) goto generate; /* balancing whole requests: no reserve, no prefill */
        /* 1. reserve */
        reply_buf rv;
        const CURLcode res = hop(r, r->nodes[d].url, "/pd/reserve", reserve, strlen(reserve), RESERVE_TIMEOUT_S,
                                 &guard, &rv);
        if (res == CURLE_ABORTED_BY_CALLBACK) {
            st_strbuf_free(&rv.body);
            gen_release(g, false);
            ret = atomic_load(&r->stopping) ? error_reply(c, q, 503, "server_error", "server_shutting_down", NULL,
                                                          "the server is shutting down")
                                            : MHD_NO; /* the client left */
            goto out;
        }
        cJSON *rj = NULL;
        st_clear_error();
        if (res == CURLE_OK && rv.body.len) st_json_parse(rv.body.p, rv.body.len, "/pd/reserve answer", &rj);
        if (res != CURLE_OK) {
            snprintf(last_err, sizeof last_err, "%s: /pd/reserve: %s", r->nodes[d].url, curl_easy_strerror(res));
            node_down(r, d, curl_easy_strerror(res));
        } else if (rv.status == 503) {
            const cJSON *e = st_json_field(rj, "error");
            const cJSON *code = st_json_field(e, "code");
            if (!cJSON_IsString(code) || strcmp(code->valuestring, "kv_blocks_exhausted") != 0) goto pass_through;
            snprintf(last_err, sizeof last_err, "%s: no KV blocks free", r->nodes[d].url);
        } else if (rv.status != 200) {
        pass_through: /* the node's answer verbatim: a validation error looks as a single server's */
            cJSON_Delete(rj);
            gen_release(g, false);
            ret = reply(c, q, (int)rv.status, rv.ctype, rv.body.p ? rv.body.p : "", rv.body.len, NULL);
            st_strbuf_free(&rv.body);
            goto out;
        }
        /* 200: the ticket */
        const st_json_where w = {"/pd/reserve answer", NULL};
        const char *ticket = NULL, *identity = NULL, *address = NULL;
        int64_t block_tokens = 0, cached = 0, blocks = 0;
        const cJSON *tokens = st_json_field(rj, "tokens");
        bool ok = res == CURLE_OK && rv.status == 200;
        if (ok) {
            ok = cJSON_IsObject(rj) && st_json_get_string(&w, rj, "ticket", &ticket) == STRATA_OK &&
                 st_json_get_int64(&w, rj, "block_tokens", &block_tokens) == STRATA_OK &&
                 st_json_get_int64(&w, rj, "cached_blocks", &cached) == STRATA_OK &&
                 st_json_get_int64(&w, rj, "blocks", &blocks) == STRATA_OK && strlen(ticket) < sizeof g->ticket &&
                 block_tokens > 0 && block_tokens <= MAX_BLOCK_TOKENS && cached >= 0 && blocks >= 0 &&
                 cached + blocks <= MAX_PROMPT_BLOCKS;
            if (!ok && !st_last_error()[0]) st_err(STRATA_ERR_FORMAT, "a count out of range, or a ticket too long");
            if (ok && blocks > 0)
                ok = st_json_get_string(&w, rj, "identity", &identity) == STRATA_OK &&
                     st_json_get_string(&w, rj, "address", &address) == STRATA_OK && cJSON_IsArray(tokens) &&
                     (int64_t)cJSON_GetArraySize(tokens) >= (cached + blocks) * block_tokens;
            if (!ok) {
                snprintf(last_err, sizeof last_err, "%s: a malformed /pd/reserve answer: %s", r->nodes[d].url,
                         st_last_error());
                st_log(STRATA_LOG_WARN, "router: %s", last_err);
            }
        }
        if (!ok) {
            cJSON_Delete(rj);
            st_strbuf_free(&rv.body);
            gen_release(g, false);
            retry_stage = STAGE_RESERVE;
            continue;
        }
        snprintf(g->ticket, sizeof g->ticket, "%s", ticket);
        /* 2. the prefill, in a thread of its own */
        if (blocks > 0) {
            pjob *j = st_calloc(1, sizeof *j);
            const int64_t nb = cached + blocks, nt = nb * block_tokens;
            if (j) {
                j->r = r;
                j->d = d;
                snprintf(j->ticket, sizeof j->ticket, "%s", ticket);
                j->block_tokens = block_tokens;
                j->from_block = cached;
                j->blocks = blocks;
                j->n_tokens = nt;
                j->identity = st_strdup(identity);
                j->address = st_strdup(address);
                j->tokens = cJSON_CreateArray();
                j->hashes = st_malloc(sizeof(uint64_t) * (size_t)nb);
                atomic_init(&j->refs, 2);
                bool jok = j->identity && j->address && j->tokens && j->hashes;
                int32_t *ids = st_malloc(sizeof(int32_t) * (size_t)(nt > 0 ? nt : 1));
                jok = jok && ids;
                const cJSON *t = tokens->child;
                for (int64_t i = 0; jok && i < nt; i++, t = t->next) {
                    jok = cJSON_IsNumber(t) && t->valuedouble >= 0 && t->valuedouble <= INT32_MAX;
                    if (!jok) break;
                    ids[i] = (int32_t)t->valuedouble;
                    cJSON *num = cJSON_CreateNumber(t->valuedouble);
                    jok = num && cJSON_AddItemToArray(j->tokens, num);
                }
                uint64_t h = 0;
                for (int64_t b = 0; jok && b < nb; b++) {
                    h = XXH3_64bits_withSeed(ids + b * block_tokens, (size_t)block_tokens * sizeof(int32_t), h);
                    j->hashes[b] = h;
                }
                st_free(ids);
                pthread_t th;
                if (jok) {
                    pthread_mutex_lock(&r->mu);
                    r->jobs++;
                    pthread_mutex_unlock(&r->mu);
                    if (pthread_create(&th, NULL, pjob_main, j) == 0) {
                        pthread_detach(th);
                        g->job = j;
                    } else {
                        pthread_mutex_lock(&r->mu);
                        r->jobs--;
                        pthread_mutex_unlock(&r->mu);
                        jok = false;
                    }
                }
                if (!jok) {
                    atomic_store(&j->refs, 1);
                    pjob_unref(j);
                    st_log(STRATA_LOG_WARN, "router: ticket %s: could not start its prefill: cancelled", ticket);
                    cancel_ticket(r, d, ticket);
                }
            }
        }
        cJSON_Delete(rj);
        st_strbuf_free(&rv.body);
    generate: /* 3. the generation on d */
        if (!gen_start_transfer(g)) {
            gen_release(g, true);
            ret = error_reply(c, q, 500, "server_error", NULL, NULL, "out of memory");
            goto out;
        }
        /* until the head and a first byte of the body (or the end) */
        while (!g->xfer_done && !(g->rb.headers_done && g->rb.body.len > 0)) gen_drive(g, 100);
        const bool sse = g->rb.headers_done && !strncasecmp(g->rb.ctype, "text/event-stream", 17);
        if (sse && !(g->xfer_done && g->res != CURLE_OK && g->rb.body.len == 0)) {
            struct MHD_Response *resp =
                MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, g, stream_free);
            if (!resp) {
                gen_free(g);
                g = NULL;
                ret = MHD_NO;
                goto out;
            }
            MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, g->rb.ctype);
            if (g->rb.cache_control[0])
                MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, g->rb.cache_control);
            const int status = (int)g->rb.status;
            ret = MHD_queue_response(c, (unsigned)status, resp);
            MHD_destroy_response(resp);
            count(r, q->rt, status);
            g = NULL; /* the response's now (its end restores the timeout) */
            goto out;
        }
        while (!g->xfer_done) gen_drive(g, 100); /* a whole answer */
        if (g->res == CURLE_OK) {
            gen_release(g, false);
            ret = reply(c, q, (int)g->rb.status, g->rb.ctype, g->rb.body.p ? g->rb.body.p : "", g->rb.body.len, NULL);
            goto out;
        }
        if (g->res == CURLE_ABORTED_BY_CALLBACK) {
            gen_release(g, true);
            ret = atomic_load(&r->stopping) ? error_reply(c, q, 503, "server_error", "server_shutting_down", NULL,
                                                          "the request was cancelled (the router is shutting down)")
                                            : MHD_NO;
            goto out;
        }
        /* d failed before a byte reached the client: another decode node takes the whole request */
        snprintf(last_err, sizeof last_err, "%s: %s", r->nodes[d].url,
                 g->timed_out ? "no answer in time" : curl_easy_strerror(g->res));
        st_log(STRATA_LOG_WARN, "router: %s: decode node failed (%s): retrying on another", g->path, last_err);
        node_down(r, d, g->timed_out ? "no answer in time" : curl_easy_strerror(g->res));
        gen_release(g, true);
        st_strbuf_free(&g->rb.body);
        retry_stage = STAGE_DECODE;
    }
    ret = error_reply(c, q, 503, "server_error", "no_decode_node", NULL, "no decode node could take the request (%s)",
                      last_err);
out:
    if (g) {
        gen_free(g);
        conn_timeout(c, IDLE_TIMEOUT_S);
    }
    free(reserve);
    return ret;
}

/* GET /v1/models: from an up decode node, passed on. */
static enum MHD_Result handle_models(struct MHD_Connection *c, req *q) {
    st_router *r = q->r;
    bool tried[2 * MAX_NODES] = {false};
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    hop_guard guard = {.r = r, .cancel = NULL, .client_fd = ci ? ci->connect_fd : -1};
    conn_timeout(c, 0);
    for (int d; (d = pick_decode(r, tried)) >= 0;) {
        tried[d] = true;
        reply_buf rb;
        const CURLcode res = hop(r, r->nodes[d].url, "/v1/models", NULL, 0, RESERVE_TIMEOUT_S, &guard, &rb);
        conn_timeout(c, IDLE_TIMEOUT_S);
        if (res == CURLE_OK) {
            const enum MHD_Result ok = reply(c, q, (int)rb.status, rb.ctype, rb.body.p ? rb.body.p : "", rb.body.len,
                                             NULL);
            st_strbuf_free(&rb.body);
            return ok;
        }
        st_strbuf_free(&rb.body);
        if (res == CURLE_ABORTED_BY_CALLBACK) return MHD_NO;
        node_down(r, d, curl_easy_strerror(res));
    }
    return error_reply(c, q, 503, "server_error", "no_decode_node", NULL, "no decode node is up");
}

/* ---- /metrics -----------------------------------------------------------------------------------*/
static char *metrics_text(st_router *r) {
    st_strbuf b = {0};
    bool ok = true;
    pthread_mutex_lock(&r->mu);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_requests_total Requests answered, by route and status.\n"
                                    "# TYPE strata_router_requests_total counter\n");
    for (int rt = 0; rt < R_COUNT_; rt++)
        for (int s = 0; s < 600; s++)
            if (r->requests[rt][s])
                ok = ok && st_strbuf_printf(&b, "strata_router_requests_total{route=\"%s\",code=\"%d\"} %lld\n",
                                            ROUTE_NAMES[rt], s, (long long)r->requests[rt][s]);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_retries_total Attempts that failed and were retried on "
                                    "another node, by stage.\n# TYPE strata_router_retries_total counter\n");
    for (int s = 0; s < STAGE_COUNT_; s++)
        ok = ok && st_strbuf_printf(&b, "strata_router_retries_total{stage=\"%s\"} %lld\n", STAGE_NAMES[s],
                                    (long long)r->retries[s]);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_prefill_cancelled_total Tickets cancelled because no "
                                    "prefill node could compute them (the decode node did).\n"
                                    "# TYPE strata_router_prefill_cancelled_total counter\n"
                                    "strata_router_prefill_cancelled_total %lld\n",
                                (long long)r->prefill_cancelled);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_node_up Whether the node answered its last poll and "
                                    "request.\n# TYPE strata_router_node_up gauge\n");
    for (int i = 0; i < r->n_nodes; i++)
        ok = ok && st_strbuf_printf(&b, "strata_router_node_up{role=\"%s\",node=\"%s\"} %d\n",
                                    r->nodes[i].role == ROLE_DECODE ? "decode" : "prefill", r->nodes[i].url,
                                    r->nodes[i].up ? 1 : 0);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_node_inflight The router's requests in flight on the "
                                    "node.\n# TYPE strata_router_node_inflight gauge\n");
    for (int i = 0; i < r->n_nodes; i++)
        ok = ok && st_strbuf_printf(&b, "strata_router_node_inflight{role=\"%s\",node=\"%s\"} %lld\n",
                                    r->nodes[i].role == ROLE_DECODE ? "decode" : "prefill", r->nodes[i].url,
                                    (long long)r->nodes[i].inflight);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_node_queued_prompt_tokens A prefill node's queued prompt "
                                    "tokens (its last /health).\n"
                                    "# TYPE strata_router_node_queued_prompt_tokens gauge\n");
    for (int i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].role == ROLE_PREFILL)
            ok = ok && st_strbuf_printf(&b, "strata_router_node_queued_prompt_tokens{node=\"%s\"} %lld\n",
                                        r->nodes[i].url, (long long)r->nodes[i].queued_tokens);
    ok = ok && st_strbuf_printf(&b, "# HELP strata_router_node_kv_blocks_free A decode node's free KV blocks (its "
                                    "last /health).\n# TYPE strata_router_node_kv_blocks_free gauge\n");
    for (int i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].role == ROLE_DECODE)
            ok = ok && st_strbuf_printf(&b, "strata_router_node_kv_blocks_free{node=\"%s\"} %lld\n", r->nodes[i].url,
                                        (long long)r->nodes[i].kv_free);
    pthread_mutex_unlock(&r->mu);
    if (!ok) {
        st_strbuf_free(&b);
        return NULL;
    }
    return b.p;
}

/* ---- routing ------------------------------------------------------------------------------------*/
static route route_of(const char *url) {
    for (int i = 0; i < R_OTHER; i++)
        if (!strcmp(url, ROUTE_NAMES[i])) return (route)i;
    return R_OTHER;
}

static enum MHD_Result dispatch(struct MHD_Connection *c, req *q, const char *url, const char *method) {
    st_router *r = q->r;
    const bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    const bool post = !strcmp(method, "POST");
    if (r->loopback) {
        const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
        if (h && !st_http_host_ok(h, r->host))
            return error_reply(c, q, 421, "invalid_request_error", "invalid_host", NULL,
                               "the Host header '%.100s' does not name this server (it listens on %s: use "
                               "localhost or 127.0.0.1)", h, r->host);
    }
    const bool open_probe = (q->rt == R_HEALTH || q->rt == R_METRICS) && r->p.metrics_public;
    if (r->api_key && (!strncmp(url, "/v1/", 4) || q->rt == R_HEALTH || q->rt == R_METRICS) && !open_probe &&
        !st_http_bearer_ok(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION), r->api_key)) {
        const bool missing = !MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        return error_reply(c, q, 401, "invalid_request_error", "invalid_api_key", NULL, "%s",
                           missing ? "You didn't provide an API key: pass it as 'Authorization: Bearer KEY'."
                                   : "Incorrect API key provided.");
    }
    switch (q->rt) {
    case R_CHAT:
    case R_COMPLETIONS:
        if (!post)
            return error_reply(c, q, 405, "invalid_request_error", "method_not_allowed", "POST",
                               "%s is not allowed on %s (use POST)", method, url);
        if (!st_http_json_ctype(MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE))) {
            const char *ct = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
            return error_reply(c, q, 415, "invalid_request_error", "unsupported_media_type", NULL,
                               "the request body must be JSON with 'Content-Type: application/json' (got %s%.100s%s)",
                               ct ? "'" : "", ct ? ct : "none", ct ? "'" : "");
        }
        return handle_generate(c, q);
    case R_MODELS:
    case R_HEALTH:
    case R_METRICS:
        if (!get)
            return error_reply(c, q, 405, "invalid_request_error", "method_not_allowed", "GET, HEAD",
                               "%s is not allowed on %s (use GET)", method, url);
        if (q->rt == R_MODELS) return handle_models(c, q);
        if (q->rt == R_HEALTH) {
            if (atomic_load(&r->stopping))
                return error_reply(c, q, 503, "server_error", "server_shutting_down", NULL,
                                   "the server is shutting down");
            int up_d = 0, up_p = 0;
            pthread_mutex_lock(&r->mu);
            for (int i = 0; i < r->n_nodes; i++)
                if (r->nodes[i].up) r->nodes[i].role == ROLE_DECODE ? up_d++ : up_p++;
            pthread_mutex_unlock(&r->mu);
            if (!up_d)
                return error_reply(c, q, 503, "server_error", "no_decode_node", NULL,
                                   "no decode node is up (%d prefill node%s up)", up_p, up_p == 1 ? " is" : "s are");
            char ok[128];
            const int n = snprintf(ok, sizeof ok, "{\"status\":\"ok\",\"decode_up\":%d,\"prefill_up\":%d}", up_d, up_p);
            return reply(c, q, 200, "application/json", ok, (size_t)n, NULL);
        }
        {
            char *text = metrics_text(r);
            if (!text) return error_reply(c, q, 500, "server_error", NULL, NULL, "out of memory");
            const enum MHD_Result ok =
                reply(c, q, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
            st_free(text);
            return ok;
        }
    default:
        return error_reply(c, q, 404, "invalid_request_error", "not_found", NULL, "no route %s %s", method, url);
    }
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    st_router *r = cls;
    req *q = *con_cls;
    if (!q) {
        if (!(q = st_calloc(1, sizeof *q))) return MHD_NO;
        q->r = r;
        q->rt = route_of(url);
        *con_cls = q;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end = NULL;
            errno = 0;
            const unsigned long long v = strtoull(cl, &end, 10);
            if (!errno && end != cl && v > r->p.max_body) {
                /* as the server: a client waiting for "100 Continue", or one with a huge body, gets
                 * the answer now; otherwise the body is read and dropped first, so that a client
                 * still sending does not see a reset before it reads the answer */
                if (MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT) ||
                    v > (unsigned long long)DISCARD_FACTOR * r->p.max_body)
                    return error_reply(c, q, 413, "invalid_request_error", "request_too_large", NULL,
                                       "the request body has %llu bytes; the limit is %zu", v, r->p.max_body);
                q->too_large = true;
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        const size_t n = *upload_size;
        *upload_size = 0;
        if (!q->too_large && q->body.len + n > r->p.max_body) {
            q->too_large = true;
            st_strbuf_free(&q->body);
        }
        if (q->too_large) {
            q->discarded += n;
            return q->discarded > DISCARD_FACTOR * r->p.max_body ? MHD_NO : MHD_YES;
        }
        return st_strbuf_add(&q->body, upload, n) ? MHD_YES : MHD_NO;
    }
    if (q->too_large)
        return error_reply(c, q, 413, "invalid_request_error", "request_too_large", NULL,
                           "the request body is over the limit of %zu bytes", r->p.max_body);
    return dispatch(c, q, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls, (void)c, (void)toe;
    req *q = *con_cls;
    if (!q) return;
    *con_cls = NULL;
    st_strbuf_free(&q->body);
    st_free(q);
}

/* libmicrohttpd's messages: its own answers to malformed requests (made the JSON error by
 * http/mhd_pages.c) are counted under "other" */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    st_router *r = cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    const int status = st_mhd_note_log(msg);
    if (status) count(r, R_OTHER, status);
    st_log(STRATA_LOG_DEBUG, "router: libmicrohttpd: %s", msg);
}

/* ---- start / stop -------------------------------------------------------------------------------*/
static bool add_nodes(st_router *r, const char *const *urls, int n, node_role role) {
    if (n < 1) return st_err(STRATA_ERR_INVALID_ARG, "no %s node given", role == ROLE_DECODE ? "decode" : "prefill"),
                      false;
    for (int i = 0; i < n; i++) {
        const char *u = urls[i];
        if (r->n_nodes >= 2 * MAX_NODES) return st_err(STRATA_ERR_INVALID_ARG, "more than %d nodes", MAX_NODES), false;
        if (!u || (strncmp(u, "http://", 7) && strncmp(u, "https://", 8)) || !u[strncmp(u, "http://", 7) ? 8 : 7])
            return st_err(STRATA_ERR_INVALID_ARG, "'%s' is not an http:// URL", u ? u : "(null)"), false;
        node *nd = &r->nodes[r->n_nodes];
        nd->url = st_strdup(u);
        if (!nd->url)
            return st_err(STRATA_ERR_NOMEM, "router: out of memory for the URL '%s' (%zu bytes)", u, strlen(u) + 1),
                   false;
        size_t len = strlen(nd->url);
        while (len > 8 && nd->url[len - 1] == '/') nd->url[--len] = 0;
        nd->role = role;
        if (role == ROLE_PREFILL && !lru_init(&nd->sent, ST_ROUTER_AFFINITY_HASHES)) {
            r->n_nodes++;
            return st_err(STRATA_ERR_NOMEM, "router: out of memory for the affinity table of %d prompt hashes "
                          "of the prefill node %s", ST_ROUTER_AFFINITY_HASHES, nd->url), false;
        }
        r->n_nodes++;
    }
    return true;
}

static void router_free(st_router *r) {
    for (int i = 0; i < r->n_nodes; i++) {
        st_free(r->nodes[i].url);
        lru_free(&r->nodes[i].sent);
    }
    st_free(r->api_key);
    st_free(r->node_auth);
    st_free(r->host);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    st_free(r);
    curl_global_cleanup();
}

strata_status st_router_start(const st_router_params *p, st_router **out) {
    *out = NULL;
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) return st_err(STRATA_ERR_IO, "libcurl did not initialise");
    st_router *r = st_calloc(1, sizeof *r);
    if (!r) return st_err(STRATA_ERR_NOMEM, "router: out of memory for its state (%zu bytes)", sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->p = *p;
    if (r->p.pd_timeout <= 0) r->p.pd_timeout = 60;
    if (r->p.health_interval <= 0) r->p.health_interval = 1;
    if (!r->p.max_body) r->p.max_body = DEF_MAX_BODY;
    r->host = st_strdup(p->host ? p->host : "127.0.0.1");
    r->loopback = st_http_loopback(r->host);
    if (p->api_key && p->api_key[0]) r->api_key = st_strdup(p->api_key);
    const char *nk = p->node_api_key ? p->node_api_key : p->api_key;
    if (nk && nk[0]) {
        const size_t n = strlen(nk) + 32;
        r->node_auth = st_malloc(n);
        if (r->node_auth) snprintf(r->node_auth, n, "Authorization: Bearer %s", nk);
    }
    r->p.prefill = r->p.decode = NULL;
    r->p.host = r->p.api_key = r->p.node_api_key = NULL;
    strata_status st = STRATA_OK;
    if (!add_nodes(r, p->decode, p->n_decode, ROLE_DECODE) ||
        (p->n_prefill > 0 && !add_nodes(r, p->prefill, p->n_prefill, ROLE_PREFILL))) {
        st = STRATA_ERR_INVALID_ARG;
        goto fail;
    }
    /* the address */
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%d", p->port);
    const int gr = getaddrinfo(r->host, port, &hints, &ai);
    if (gr != 0 || !ai) {
        st = st_err(STRATA_ERR_INVALID_ARG, "--host %s: %s", r->host, gai_strerror(gr));
        goto fail;
    }
    poll_all(r); /* the nodes' state before the first request */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    r->d = MHD_start_daemon(flags, (uint16_t)p->port, NULL, NULL, on_access, r, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, r, MHD_OPTION_CONNECTION_TIMEOUT,
                            IDLE_TIMEOUT_S, MHD_OPTION_CONNECTION_LIMIT, (unsigned)1024, MHD_OPTION_EXTERNAL_LOGGER,
                            mhd_log, r, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!r->d) {
        st = st_err(STRATA_ERR_IO, "cannot listen on %s port %d (in use?)", r->host, p->port);
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(r->d, MHD_DAEMON_INFO_BIND_PORT);
    r->port = di ? di->port : p->port;
    if (pthread_create(&r->health, NULL, health_main, r) != 0) {
        st = st_err(STRATA_ERR_IO, "cannot start the health thread");
        goto fail;
    }
    r->health_started = true;
    *out = r;
    return STRATA_OK;
fail:
    if (r->d) MHD_stop_daemon(r->d);
    router_free(r);
    return st;
}

int st_router_port(const st_router *r) { return r ? r->port : 0; }

void st_router_stop(st_router *r) {
    if (!r) return;
    atomic_store(&r->stopping, true);
    pthread_mutex_lock(&r->mu);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    /* requests see `stopping` within 100 ms: streams end with an error event, waits with a
     * 503; they get 2 s to be written before the connections are closed */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 2;
    pthread_mutex_lock(&r->mu);
    while (r->active > 0)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) != 0) break;
    pthread_mutex_unlock(&r->mu);
    MHD_stop_daemon(r->d);
    if (r->health_started) pthread_join(r->health, NULL);
    pthread_mutex_lock(&r->mu);
    while (r->jobs > 0) pthread_cond_wait(&r->cv, &r->mu); /* prefill threads see `stopping` too */
    pthread_mutex_unlock(&r->mu);
    router_free(r);
}

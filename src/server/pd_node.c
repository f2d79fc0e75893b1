/* server/pd_node: see pd_node.h. */
#include "server/pd_node.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "disagg/pd_xfer.h"

const char *pd_role_name(pd_role r) {
    return r == PD_ROLE_PREFILL ? "prefill" : r == PD_ROLE_DECODE ? "decode" : "both";
}

bool pd_role_parse(const char *s, pd_role *out) {
    if (!s) return false;
    if (!strcmp(s, "both")) *out = PD_ROLE_BOTH;
    else if (!strcmp(s, "prefill")) *out = PD_ROLE_PREFILL;
    else if (!strcmp(s, "decode")) *out = PD_ROLE_DECODE;
    else return false;
    return true;
}

/* a decode node's open ticket */
typedef enum { TK_EXPECTED = 0, TK_LANDED, TK_BROKEN } tk_state;
typedef struct tk {
    uint64_t id;
    double deadline;
    tk_state state;
    struct tk *next;
} tk;

struct pd_node {
    strata_model *m;
    pd_role role;
    double timeout_s;
    pd_xfer *x;
    char *addr_hex;
    char identity_hex[24];

    pthread_mutex_t mu;
    pthread_cond_t cv;
    tk *tickets;                  /* decode: open tickets */
    bool stop;
    pthread_t thr;
    bool thr_on;
    int64_t queued_tokens;        /* prefill: tokens of the prefills in flight */
    int64_t adopted, cancelled, expired, broken; /* decode: tickets by outcome; broken: an attempt failed */
    int64_t prefills_ok, prefills_failed;
    struct job *jobs;             /* prefill: in flight (until done) */
    struct pbuf *free_bufs;       /* prefill: piece buffers to reuse */
    struct pbuf *lent;            /* prefill: piece buffers handed out */
    size_t free_bytes;
    bool cuda;                    /* CUDA engine and a UCX that moves CUDA memory: pieces leave from device
                                     memory, a decode node's landing memory is device memory */
    bool closing;                 /* destroy: no new prefill */
};

/* ---- decode: tickets --------------------------------------------------------------------------*/

static tk *tk_take_locked(pd_node *n, uint64_t id) {
    for (tk **pp = &n->tickets; *pp; pp = &(*pp)->next)
        if ((*pp)->id == id) {
            tk *t = *pp;
            *pp = t->next;
            return t;
        }
    return NULL;
}

static void on_landed(void *user, uint64_t ticket, strata_status st) {
    pd_node *n = user;
    pthread_mutex_lock(&n->mu);
    for (tk *t = n->tickets; t; t = t->next)
        if (t->id == ticket) {
            if (st == STRATA_OK) t->state = TK_LANDED;
            else if (t->state == TK_EXPECTED) {
                t->state = TK_BROKEN; /* this attempt broke: a retry (higher attempt) may still land it */
                n->broken++;
            }
        }
    pthread_cond_signal(&n->cv);
    pthread_mutex_unlock(&n->mu);
}

/* The node's thread: adopts landed tickets, cancels expired ones (the
 * transport forgets each first, so nothing writes its blocks afterwards). */
static void *node_main(void *arg) {
    pd_node *n = arg;
    pthread_mutex_lock(&n->mu);
    while (!n->stop) {
        const double now = st_time_now();
        tk *t = n->tickets, *due = NULL;
        double next = now + 1.0;
        for (; t; t = t->next) {
            if (t->state == TK_LANDED || t->deadline <= now) {
                due = t;
                break;
            }
            if (t->deadline < next) next = t->deadline;
        }
        if (!due) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            const double wait = next - now > 0 ? next - now : 0.001;
            ts.tv_sec += (time_t)wait;
            ts.tv_nsec += (long)((wait - (double)(time_t)wait) * 1e9);
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&n->cv, &n->mu, &ts);
            continue;
        }
        tk_take_locked(n, due->id);
        const bool landed = due->state == TK_LANDED;
        if (landed) n->adopted++;
        else n->expired++;
        pthread_mutex_unlock(&n->mu);
        pd_xfer_forget(n->x, due->id);
        if (!landed)
            st_log(STRATA_LOG_WARN, "pd: ticket %llu: its blocks did not land within %.0f s: the request computes "
                   "its prompt here", (unsigned long long)due->id, n->timeout_s);
        strata_kv_resolve(n->m, due->id, landed);
        st_free(due);
        pthread_mutex_lock(&n->mu);
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

strata_status pd_node_expect(pd_node *n, const strata_kv_reservation *res) {
    if (!n || n->role != PD_ROLE_DECODE || !res || !res->ticket)
        return st_err(STRATA_ERR_INVALID_ARG, "pd: expect: not a decode node, or no ticket");
    tk *t = st_calloc(1, sizeof *t);
    if (!t) {
        strata_kv_resolve(n->m, res->ticket, false);
        return st_err(STRATA_ERR_NOMEM, "pd: out of memory for the ticket (%zu bytes)", sizeof *t);
    }
    t->id = res->ticket;
    t->deadline = st_time_now() + n->timeout_s;
    pthread_mutex_lock(&n->mu);
    t->next = n->tickets;
    n->tickets = t;
    pthread_mutex_unlock(&n->mu);
    strata_status st =
        res->landing ? pd_xfer_expect_at(n->x, res->ticket, res->n_layers, res->layer_bytes, res->cached_blocks,
                                         res->n_blocks, res->landing, res->landing_stride, n->cuda, on_landed, n)
                     : pd_xfer_expect(n->x, res->ticket, res->n_layers, res->layer_bytes, res->cached_blocks,
                                      res->n_blocks, res->blocks, on_landed, n);
    if (st) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        pthread_mutex_lock(&n->mu);
        tk *mine = tk_take_locked(n, res->ticket);
        pthread_mutex_unlock(&n->mu);
        if (mine) {
            st_free(mine);
            strata_kv_resolve(n->m, res->ticket, false);
        }
        return st_err(st, "pd: the transfer cannot be expected: %s", msg);
    }
    return STRATA_OK;
}

strata_status pd_node_cancel(pd_node *n, uint64_t ticket) {
    if (!n || n->role != PD_ROLE_DECODE) return st_err(STRATA_ERR_INVALID_ARG, "pd: cancel: not a decode node");
    pthread_mutex_lock(&n->mu);
    tk *t = tk_take_locked(n, ticket);
    if (t) n->cancelled++;
    pthread_mutex_unlock(&n->mu);
    if (!t) return STRATA_OK; /* unknown, or resolved already */
    pd_xfer_forget(n->x, ticket);
    st_free(t);
    return strata_kv_resolve(n->m, ticket, false);
}

/* ---- prefill ---------------------------------------------------------------------------------*/

/* Piece buffers: device memory when n->cuda (the device copies each layer into it, UCX moves it
 * to the decode node's GPU), else pinned host memory (strata_host_alloc: the device copies at full
 * speed, the transport sends from it); kept for reuse up to BUF_KEEP bytes. Their descriptors
 * live on the host (a device buffer has no room the host may write). */
#define BUF_KEEP ((size_t)1 << 30)
typedef struct pbuf {
    size_t cap;
    void *mem;
    struct pbuf *next;
} pbuf;

static void buf_release(pd_node *n, pbuf *b) {
    if (n->cuda) strata_device_free(n->m, b->mem);
    else strata_host_free(n->m, b->mem);
    st_free(b);
}

static void *buf_get(pd_node *n, size_t bytes) {
    pthread_mutex_lock(&n->mu);
    for (pbuf **pp = &n->free_bufs; *pp; pp = &(*pp)->next)
        if ((*pp)->cap >= bytes && (*pp)->cap / 4 <= bytes) {
            pbuf *b = *pp;
            *pp = b->next;
            n->free_bytes -= b->cap;
            b->next = n->lent;
            n->lent = b;
            pthread_mutex_unlock(&n->mu);
            return b->mem;
        }
    pthread_mutex_unlock(&n->mu);
    pbuf *b = st_calloc(1, sizeof *b);
    if (!b) return NULL;
    b->cap = (bytes + ((size_t)1 << 20) - 1) >> 20 << 20; /* whole MiB: sizes repeat */
    if ((n->cuda ? strata_device_alloc(n->m, b->cap, &b->mem) : strata_host_alloc(n->m, b->cap, &b->mem)) !=
        STRATA_OK) {
        st_free(b);
        return NULL;
    }
    pthread_mutex_lock(&n->mu);
    b->next = n->lent;
    n->lent = b;
    pthread_mutex_unlock(&n->mu);
    return b->mem;
}

static void buf_put(pd_node *n, void *data) {
    if (!data) return;
    pthread_mutex_lock(&n->mu);
    pbuf *b = NULL;
    for (pbuf **pp = &n->lent; *pp; pp = &(*pp)->next)
        if ((*pp)->mem == data) {
            b = *pp;
            *pp = b->next;
            break;
        }
    ST_ASSERT(b);
    if (n->free_bytes + b->cap <= BUF_KEEP) {
        b->next = n->free_bufs;
        n->free_bufs = b;
        n->free_bytes += b->cap;
        b = NULL;
    }
    pthread_mutex_unlock(&n->mu);
    if (b) buf_release(n, b);
}

typedef struct job {
    struct job *next;
    pd_node *n;
    pd_peer *peer;
    uint64_t ticket;
    uint32_t attempt;
    int64_t tokens;               /* counted in n->queued_tokens */
    uint64_t eid;
    pd_prefill_done done;
    void *user;
    double t0;
    /* under n->mu */
    int64_t sends;                /* in flight */
    bool finished, told;
    bool submitting;              /* strata_submit has not returned yet: not done before it */
    pd_prefill_result res;
} job;

static void job_fail_locked(job *j, strata_status st, const char *fmt, const char *detail) {
    if (j->res.st) return; /* the first failure says why */
    j->res.st = st;
    snprintf(j->res.error, sizeof j->res.error, fmt, detail ? detail : "");
}

/* Called with n->mu held: when the request finished and no send is in
 * flight, tells the caller (after unlocking) and frees. Returns true when it
 * unlocked and freed. */
static bool job_maybe_done_locked(job *j) {
    if (!j->finished || j->sends > 0 || j->told || j->submitting) return false;
    j->told = true;
    pd_node *n = j->n;
    for (struct job **pp = &n->jobs; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    pthread_cond_broadcast(&n->cv);
    n->queued_tokens -= j->tokens;
    if (j->res.st) n->prefills_failed++;
    else n->prefills_ok++;
    pthread_mutex_unlock(&n->mu);
    j->res.seconds = st_time_now() - j->t0;
    j->done(j->user, &j->res);
    st_free(j);
    return true;
}

typedef struct {
    job *j;
    void *data;
    size_t bytes;
} sendctx;

static void on_sent(void *user, strata_status st) {
    sendctx *sc = user;
    job *j = sc->j;
    pd_node *n = j->n;
    buf_put(n, sc->data);
    pthread_mutex_lock(&n->mu);
    j->sends--;
    bool abort_it = false;
    if (st) {
        abort_it = !j->res.st && !j->finished;
        job_fail_locked(j, STRATA_ERR_IO, "the KV transfer to the decode node failed%s", "");
    } else {
        j->res.bytes += sc->bytes;
        j->res.messages++;
    }
    const uint64_t eid = j->eid;
    st_free(sc);
    if (!job_maybe_done_locked(j)) pthread_mutex_unlock(&n->mu);
    if (abort_it && eid) strata_abort(n->m, eid);
}

static void *job_kv_buffer(void *user, size_t bytes) {
    job *j = user;
    return buf_get(j->n, bytes);
}

static void job_on_kv(void *user, const strata_kv_piece *p) {
    job *j = user;
    pd_node *n = j->n;
    if (p->n_blocks <= 0) { /* the export failed: the request ends with the error */
        buf_put(n, p->data);
        return;
    }
    sendctx *sc = st_malloc(sizeof *sc);
    pthread_mutex_lock(&n->mu);
    const bool broken = j->res.st != STRATA_OK;
    if (!broken && sc) j->sends++;
    pthread_mutex_unlock(&n->mu);
    if (broken || !sc) {
        st_free(sc);
        buf_put(n, p->data);
        return;
    }
    *sc = (sendctx){.j = j, .data = p->data, .bytes = p->bytes};
    const pd_msg h = {.ticket = j->ticket, .attempt = j->attempt, .layer = (uint32_t)p->layer,
                      .first_block = p->first_block, .n_blocks = p->n_blocks, .flags = n->cuda ? PD_MSG_F_CUDA : 0};
    if (pd_xfer_send(n->x, j->peer, &h, p->data, p->bytes, on_sent, sc) != STRATA_OK) on_sent(sc, STRATA_ERR_IO);
}

static void job_on_finish(void *user, const strata_finish *f) {
    job *j = user;
    pd_node *n = j->n;
    pthread_mutex_lock(&n->mu);
    j->finished = true;
    if (f->reason != STRATA_FINISH_STOP)
        job_fail_locked(j, f->reason == STRATA_FINISH_ABORT ? STRATA_ERR_IO : STRATA_ERR_INTERNAL,
                        "the prefill ended early: %s", f->error ? f->error : f->detail);
    if (!job_maybe_done_locked(j)) pthread_mutex_unlock(&n->mu);
}

strata_status pd_node_prefill(pd_node *n, const pd_prefill_args *a, pd_prefill_done done, void *user) {
    if (!n || n->role != PD_ROLE_PREFILL || !a || !a->tokens || !done || a->n_blocks < 1 || a->from_block < 0)
        return st_err(STRATA_ERR_INVALID_ARG, "pd: prefill: not a prefill node, or bad arguments");
    strata_engine_info info;
    strata_status st = strata_engine_info_get(n->m, &info);
    if (st) return st;
    pd_peer *peer = NULL;
    if ((st = pd_xfer_connect(n->x, a->address, a->address_len, &peer)))
        return st_err(st, "the decode node's transport cannot be reached: %s", st_last_error());
    job *j = st_calloc(1, sizeof *j);
    if (!j) return st_err(STRATA_ERR_NOMEM, "pd: out of memory for its state (%zu bytes)", sizeof *j);
    *j = (job){.n = n, .peer = peer, .ticket = a->ticket, .attempt = a->attempt, .done = done, .user = user,
               .t0 = st_time_now(), .tokens = (a->from_block + a->n_blocks) * info.kv_block_size,
               .submitting = true};
    strata_request_params rp = {.prompt_ids = a->tokens, .n_prompt_ids = (size_t)j->tokens, .max_tokens = 1,
                                .prefill_only = true, .export_kv = true, .export_from_block = a->from_block};
    const strata_callbacks cb = {.on_finish = job_on_finish, .user = j, .kv_buffer = job_kv_buffer,
                                 .on_kv = job_on_kv};
    pthread_mutex_lock(&n->mu);
    if (n->closing) {
        pthread_mutex_unlock(&n->mu);
        st_free(j);
        return st_err(STRATA_ERR_UNSUPPORTED, "the node is shutting down");
    }
    n->queued_tokens += j->tokens;
    j->next = n->jobs;
    n->jobs = j;
    pthread_mutex_unlock(&n->mu);
    uint64_t eid = 0;
    if ((st = strata_submit(n->m, &rp, &cb, &eid))) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", st_last_error());
        pthread_mutex_lock(&n->mu);
        n->queued_tokens -= j->tokens;
        for (struct job **pp = &n->jobs; *pp; pp = &(*pp)->next)
            if (*pp == j) {
                *pp = j->next;
                break;
            }
        pthread_mutex_unlock(&n->mu);
        st_free(j);
        return st_err(st, "%s", msg);
    }
    pthread_mutex_lock(&n->mu);
    j->eid = eid;
    j->submitting = false;
    const bool abort_it = j->res.st != STRATA_OK && !j->finished; /* a send failed before the id was known */
    if (!job_maybe_done_locked(j)) pthread_mutex_unlock(&n->mu);
    if (abort_it) strata_abort(n->m, eid);
    return STRATA_OK;
}

int64_t pd_node_queued_tokens(pd_node *n) {
    if (!n) return 0;
    pthread_mutex_lock(&n->mu);
    const int64_t q = n->queued_tokens;
    pthread_mutex_unlock(&n->mu);
    return q;
}

/* ---- life ---------------------------------------------------------------------------------------*/

strata_status pd_node_create(strata_model *m, pd_role role, double timeout_s, pd_node **out) {
    *out = NULL;
    if (!m || (role != PD_ROLE_PREFILL && role != PD_ROLE_DECODE) || !(timeout_s > 0))
        return st_err(STRATA_ERR_INVALID_ARG, "pd: a node needs a model, the role prefill or decode and a timeout");
    strata_engine_info info;
    strata_status st = strata_engine_info_get(m, &info);
    if (st) return st;
    if (role == PD_ROLE_DECODE && info.kv_host_blocks <= 0 && info.kv_landing_blocks <= 0)
        return st_err(STRATA_ERR_INVALID_ARG, "--role decode: the blocks from prefill nodes land in the KV host tier "
                                              "or the landing memory; give it room (--kv-host-mem, --pd-landing-mem)");
    if (role != PD_ROLE_BOTH && !info.prefix_cache)
        return st_err(STRATA_ERR_INVALID_ARG, "--role %s: P-D needs the prefix cache (blocks are named by it)",
                      pd_role_name(role));
    pd_node *n = st_calloc(1, sizeof *n);
    if (!n) return st_err(STRATA_ERR_NOMEM, "pd: out of memory for its state (%zu bytes)", sizeof *n);
    n->m = m;
    n->role = role;
    n->timeout_s = timeout_s;
    snprintf(n->identity_hex, sizeof n->identity_hex, "%016llx", (unsigned long long)info.kv_identity);
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    if ((st = pd_xfer_create(&n->x))) goto fail;
    strata_model_info mi;
    if ((st = strata_model_info_get(m, &mi))) goto fail;
    const bool cuda_engine = !strcmp(mi.backend, "cuda");
    n->cuda = cuda_engine && pd_xfer_cuda(n->x);
    if (role == PD_ROLE_DECODE && info.kv_landing_blocks > 0 && cuda_engine && !n->cuda) {
        st = st_err(STRATA_ERR_UNSUPPORTED, "--pd-landing-mem: blocks land in GPU memory, and this process's UCX "
                                            "moves host memory only (use a UCX built with CUDA, e.g. PyPI's "
                                            "libucx-cu12, on LD_LIBRARY_PATH; or land in the host tier)");
        goto fail;
    }
    st_log(STRATA_LOG_INFO, "pd: %s node: KV %s", pd_role_name(role),
           role == PD_ROLE_PREFILL ? (n->cuda ? "pieces leave from GPU memory (UCX with CUDA)"
                                              : "pieces leave from pinned host memory")
           : info.kv_landing_blocks > 0 ? "lands in the landing memory"
                                        : "lands in the host tier");
    size_t len = 0;
    const uint8_t *a = pd_xfer_address(n->x, &len);
    if (!(n->addr_hex = st_malloc(2 * len + 1))) {
        st = st_err(STRATA_ERR_NOMEM, "pd: out of memory for the transport address in hex (%zu bytes)", 2 * len + 1);
        goto fail;
    }
    for (size_t i = 0; i < len; i++) snprintf(n->addr_hex + 2 * i, 3, "%02x", a[i]);
    n->addr_hex[2 * len] = 0;
    if (role == PD_ROLE_DECODE) {
        if (pthread_create(&n->thr, NULL, node_main, n) != 0) {
            st = st_err(STRATA_ERR_INTERNAL, "pd: cannot start the node's thread");
            goto fail;
        }
        n->thr_on = true;
    }
    *out = n;
    return STRATA_OK;
fail:
    pd_node_destroy(n);
    return st;
}

void pd_node_destroy(pd_node *n) {
    if (!n) return;
    /* prefills in flight: aborted (the engine still steps), then waited for */
    pthread_mutex_lock(&n->mu);
    n->closing = true;
    while (n->jobs) {
        uint64_t eids[64];
        int k = 0;
        for (struct job *j = n->jobs; j && k < 64; j = j->next)
            if (j->eid) eids[k++] = j->eid;
        pthread_mutex_unlock(&n->mu);
        for (int i = 0; i < k; i++) strata_abort(n->m, eids[i]);
        pthread_mutex_lock(&n->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        if (n->jobs) pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    pthread_mutex_unlock(&n->mu);
    if (n->thr_on) {
        pthread_mutex_lock(&n->mu);
        n->stop = true;
        pthread_cond_signal(&n->cv);
        pthread_mutex_unlock(&n->mu);
        pthread_join(n->thr, NULL);
    }
    /* open tickets: forgotten (nothing lands any more), then cancelled */
    while (n->tickets) {
        tk *t = n->tickets;
        n->tickets = t->next;
        if (n->x) pd_xfer_forget(n->x, t->id);
        strata_kv_resolve(n->m, t->id, false);
        st_free(t);
    }
    pd_xfer_destroy(n->x);
    while (n->free_bufs) {
        pbuf *b = n->free_bufs;
        n->free_bufs = b->next;
        buf_release(n, b);
    }
    int lent = 0; /* every piece comes back before its job ends; one that did not stays allocated */
    for (pbuf *b = n->lent; b; b = b->next) lent++;
    if (lent) st_log(STRATA_LOG_WARN, "pd: %d KV piece buffer(s) still lent at shutdown: left allocated", lent);
    st_free(n->addr_hex);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->mu);
    st_free(n);
}

pd_role pd_node_role(const pd_node *n) { return n ? n->role : PD_ROLE_BOTH; }
const char *pd_node_address_hex(const pd_node *n) { return n ? n->addr_hex : ""; }
const char *pd_node_identity_hex(const pd_node *n) { return n ? n->identity_hex : ""; }

/* ---- metrics -------------------------------------------------------------------------------------*/

static bool hist(st_strbuf *b, const char *name, const char *dir, const int64_t *counts, double sum) {
    int64_t cum = 0;
    for (int i = 0; i < 11; i++) {
        cum += counts[i];
        if (!st_strbuf_printf(b, "%s_bucket{direction=\"%s\",le=\"%g\"} %lld\n", name, dir, PD_XFER_HIST_BOUNDS[i],
                              (long long)cum))
            return false;
    }
    cum += counts[11];
    return st_strbuf_printf(b, "%s_bucket{direction=\"%s\",le=\"+Inf\"} %lld\n%s_sum{direction=\"%s\"} %.6f\n"
                               "%s_count{direction=\"%s\"} %lld\n",
                            name, dir, (long long)cum, name, dir, sum, name, dir, (long long)cum);
}

bool pd_node_metrics(pd_node *n, st_strbuf *b) {
    if (!n) return true;
    pd_xfer_stats xs;
    pd_xfer_get_stats(n->x, &xs);
    pthread_mutex_lock(&n->mu);
    const int64_t adopted = n->adopted, cancelled = n->cancelled, expired = n->expired, broken = n->broken,
                  pok = n->prefills_ok, pfail = n->prefills_failed, queued = n->queued_tokens;
    pthread_mutex_unlock(&n->mu);
    bool ok = st_strbuf_printf(
        b,
        "# HELP strata_pd_kv_bytes_total KV bytes moved between prefill and decode nodes\n"
        "# TYPE strata_pd_kv_bytes_total counter\n"
        "strata_pd_kv_bytes_total{direction=\"sent\"} %llu\nstrata_pd_kv_bytes_total{direction=\"received\"} %llu\n"
        "# HELP strata_pd_kv_blocks_total KV blocks moved (all layers of a block: one)\n"
        "# TYPE strata_pd_kv_blocks_total counter\n"
        "strata_pd_kv_blocks_total{direction=\"sent\"} %lld\nstrata_pd_kv_blocks_total{direction=\"received\"} %lld\n"
        "# HELP strata_pd_messages_rejected_total KV messages rejected (malformed, truncated, unknown ticket, "
        "bad checksum)\n# TYPE strata_pd_messages_rejected_total counter\nstrata_pd_messages_rejected_total %lld\n"
        "# HELP strata_pd_tickets_total decode node: reservations by outcome\n"
        "# TYPE strata_pd_tickets_total counter\n"
        "strata_pd_tickets_total{result=\"adopted\"} %lld\nstrata_pd_tickets_total{result=\"cancelled\"} %lld\n"
        "strata_pd_tickets_total{result=\"expired\"} %lld\nstrata_pd_tickets_total{result=\"attempt_failed\"} %lld\n"
        "# HELP strata_pd_prefills_total prefill node: prefills by outcome\n"
        "# TYPE strata_pd_prefills_total counter\n"
        "strata_pd_prefills_total{result=\"ok\"} %lld\nstrata_pd_prefills_total{result=\"failed\"} %lld\n"
        "# HELP strata_pd_queued_prompt_tokens prefill node: prompt tokens of the prefills in flight\n"
        "# TYPE strata_pd_queued_prompt_tokens gauge\nstrata_pd_queued_prompt_tokens %lld\n"
        "# HELP strata_pd_send_busy_seconds_total prefill node: seconds with a KV message in flight (bytes sent / "
        "this: the transfer's rate while it ran)\n# TYPE strata_pd_send_busy_seconds_total counter\n"
        "strata_pd_send_busy_seconds_total %.6f\n"
        "# HELP strata_pd_layer_seconds time of one layer's KV message (sent: queued to completed; "
        "received: arrival to landed)\n# TYPE strata_pd_layer_seconds histogram\n",
        (unsigned long long)xs.bytes_sent, (unsigned long long)xs.bytes_received, (long long)xs.blocks_sent,
        (long long)xs.blocks_received, (long long)xs.messages_rejected, (long long)adopted, (long long)cancelled,
        (long long)expired, (long long)broken, (long long)pok, (long long)pfail, (long long)queued,
        xs.send_busy_seconds);
    return ok && hist(b, "strata_pd_layer_seconds", "sent", xs.send_hist, xs.send_seconds) &&
           hist(b, "strata_pd_layer_seconds", "received", xs.recv_hist, xs.recv_seconds);
}

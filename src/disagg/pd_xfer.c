/* disagg/pd_xfer: UCX (UCP) active messages carrying KV blocks between a
 * prefill node and a decode node. See pd_xfer.h for the contract.
 *
 * Layout of this file:
 *   - the objects (tickets, peers, sends, receives, commands)
 *   - UCX's log routed to st_log
 *   - receiver: the AM handler, validation, eager copy, rendezvous IOV receive
 *   - sender: endpoints, sends, peer failure
 *   - the transport thread (commands, progress, sleep) and the public calls
 *
 * Threads: the transport thread alone calls UCX after create. `mu` guards the
 * command queue, the ticket list's membership and the stats; a ticket's fields
 * are written only by the transport thread (pd_xfer_expect builds the ticket
 * before linking it in; pd_xfer_forget's work is done by the thread). User
 * callbacks (on_done, sent) run on the transport thread with `mu` released. */
#include "disagg/pd_xfer.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>
#include <xxhash.h>

#include "core/core.h"

const double PD_XFER_HIST_BOUNDS[11] = {1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10};

#define PD_AM_ID 23u
/* The address pd_xfer_address hands out: this frame around the UCX worker
 * address, so pd_xfer_connect can refuse bytes that are not one (UCX parses
 * an address without knowing its length). */
#define PD_ADDR_MAGIC 0x41505453u /* "STPA" */
typedef struct {
    uint32_t magic, len;  /* len: the UCX address bytes that follow */
    uint64_t checksum;    /* XXH3-64 of those bytes */
} pd_addr_frame;
/* How often UCX checks that the peers of its endpoints are alive (the
 * default is 20 s): a peer whose connection gives no error by itself (a host
 * gone without closing its sockets) fails the pending sends within about
 * this time. A process that dies closes its sockets: seen at once. */
#define PD_KEEPALIVE_INTERVAL "1s"
/* The thread's sleep: with operations in flight it wakes at least this often
 * (ms) to progress transports that raise no event; idle, UCX's or a command's
 * event wakes it (the timeout is a safety net). */
#define PD_BUSY_WAIT_MS 1
#define PD_IDLE_WAIT_MS 200
/* destroy: how long the endpoints' forced close may take */
#define PD_CLOSE_TIMEOUT_S 2.0
/* pd_xfer_connect: how long the peer may take to answer UCX's connection setup */
#define PD_CONNECT_TIMEOUT_S 10.0

enum { T_RECEIVING, T_FAILED, T_DONE };

typedef struct pd_fwait pd_fwait;

typedef struct pd_ticket {
    struct pd_ticket *next;
    uint64_t id;
    int64_t n_layers, from_block, n_blocks;
    size_t layer_bytes;
    uint8_t **dst;        /* host layout: block k's layer l at dst[k] + l * layer_bytes; or NULL: */
    uint8_t *base;        /* layer-major: block k's layer l at base + l * stride + k * layer_bytes */
    size_t stride;
    bool cuda;            /* base is CUDA device memory */
    pd_xfer_done_fn on_done;
    void *user;
    /* transport thread only: */
    uint32_t attempt;     /* current attempt; 0 before the first message */
    int state;
    bool cancelled;       /* forgotten: no message is taken any more */
    uint8_t *claimed;     /* [layer * n_blocks + k]: block k of layer taken by an accepted message of the
                             current attempt: 1 its data is landing, 2 landed and checked */
    int64_t landed;       /* block-layers of the current attempt whose data landed and checked */
    int64_t landed_ever;  /* block-layers landed over all attempts (stats' whole blocks) */
    int inflight;         /* rendezvous receives into dst not yet completed (any attempt) */
    pd_fwait *waiters;    /* pd_xfer_forget callers waiting for inflight == 0 */
} pd_ticket;

struct pd_fwait {
    pd_fwait *next;
    bool done;
};

struct pd_peer {
    struct pd_peer *next;
    pd_xfer *x;
    uint8_t *addr; /* the UCX address (unframed) */
    size_t len;
    ucp_ep_h ep;   /* NULL: dead (closed), the next connect to addr makes a new one */
    bool failed;   /* the error handler ran or a send failed: close ep after progress */
    ucs_status_t fail_status;
    /* pd_xfer_connect's wait for the connection setup (a flush of the new endpoint) */
    bool connecting;
    ucs_status_t flush_st;
    double connect_deadline;
    struct pd_cmd *waiters;
};

typedef struct pd_send {
    struct pd_send *next, *prev; /* x->sends: every send UCX may still hold */
    pd_peer *peer;
    pd_msg hdr; /* the AM header must live until the send completes (UCX 1.13) */
    const void *data;
    size_t len;
    pd_xfer_sent_fn sent;
    void *user;
    double t0;
    bool reported; /* sent() ran */
    bool posted;   /* handed to UCX and not completed: UCX holds a pointer to this */
} pd_send;

typedef struct pd_recv {
    struct pd_recv *next, *prev; /* x->recvs */
    pd_xfer *x;
    pd_ticket *t;
    pd_msg h;
    uint32_t attempt;
    int64_t n;
    uint64_t checksum, bytes;
    bool check;        /* the checksum is compared once the data landed */
    double t0;
    ucp_dt_iov_t *iov; /* n entries (host layout); UCX reads it until the receive completes;
                          layer-major: 1 entry, the contiguous region (not handed to UCX) */
} pd_recv;

enum { CMD_SEND, CMD_CONNECT, CMD_FORGET };
typedef struct pd_cmd {
    struct pd_cmd *next;
    int type;
    pd_send *send;
    /* connect */
    const void *addr;
    size_t len;
    pd_peer *peer;
    strata_status st;
    char err[256];
    /* forget */
    uint64_t ticket;
    pd_fwait fw;
    bool done; /* connect: answered */
} pd_cmd;

struct pd_xfer {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int ucp_efd, evfd, epfd;
    uint8_t *address; /* framed */
    size_t address_len;
    pthread_t thread;
    bool thread_started;
    bool cuda; /* UCX moves CUDA memory (its context lists the type) */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pd_cmd *cmd_head, *cmd_tail;
    bool stopping;     /* destroy began: no new command */
    pd_ticket *tickets;
    pd_xfer_stats stats;
    int64_t sends_open;         /* sends queued and not yet reported (mu) */
    double busy_t0;             /* when sends_open last became 1 (mu) */

    /* transport thread only */
    bool closing;      /* shutdown: callbacks report nothing more to the user */
    pd_peer *peers;
    pd_send *sends;
    pd_recv *recvs;
    int64_t n_posted;  /* sends UCX holds */
    int64_t n_recving; /* rendezvous receives in flight */
    int n_closing;     /* endpoint closes in flight */
    int n_connecting;  /* peers whose connection setup a pd_xfer_connect waits for */
    bool peer_failed;  /* some peer has failed set */
};

static strata_status st_of(ucs_status_t s) { return s == UCS_OK ? STRATA_OK : STRATA_ERR_IO; }

static void hist_add(int64_t *hist, double s) {
    int i = 0;
    while (i < 11 && s > PD_XFER_HIST_BOUNDS[i]) i++;
    hist[i]++;
}

/* ---- UCX's log → st_log ------------------------------------------------------
 * UCX prints its warnings and errors (a peer's reset connection, ...) on
 * stderr; the library never prints: the first pd_xfer_create routes them to
 * st_log for the whole process. */
static ucs_log_func_rc_t ucx_log(const char *file, unsigned line, const char *function, ucs_log_level_t level,
                                 const ucs_log_component_config_t *comp_conf, const char *message, va_list ap) {
    (void)comp_conf;
    (void)function;
    if (level > UCS_LOG_LEVEL_INFO) return UCS_LOG_FUNC_RC_STOP;
    char buf[512];
    va_list aq;
    va_copy(aq, ap);
    vsnprintf(buf, sizeof buf, message, aq);
    va_end(aq);
    const char *base = strrchr(file, '/');
    strata_log_level l = level <= UCS_LOG_LEVEL_ERROR ? STRATA_LOG_ERROR
                         : level == UCS_LOG_LEVEL_WARN ? STRATA_LOG_WARN
                                                       : STRATA_LOG_DEBUG;
    /* UCX's errors about one peer are the pd_xfer caller's IO errors: warn */
    if (l == STRATA_LOG_ERROR) l = STRATA_LOG_WARN;
    st_log(l, "pd_xfer: ucx %s:%u: %s", base ? base + 1 : file, line, buf);
    return UCS_LOG_FUNC_RC_STOP;
}
static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static void log_init(void) { ucs_log_push_handler(ucx_log); }

/* ---- receiver ---------------------------------------------------------------- */

static pd_ticket *ticket_find(pd_xfer *x, uint64_t id) { /* mu held */
    for (pd_ticket *t = x->tickets; t; t = t->next)
        if (t->id == id && !t->cancelled) return t;
    return NULL;
}

static void ticket_free(pd_ticket *t) {
    if (!t) return;
    st_free(t->dst);
    st_free(t->claimed);
    st_free(t);
}

/* A cancelled ticket with nothing in flight: unlinked, freed, its forget
 * callers answered. Transport thread. */
static void ticket_reap(pd_xfer *x, pd_ticket *t) {
    pthread_mutex_lock(&x->mu);
    for (pd_ticket **pp = &x->tickets; *pp; pp = &(*pp)->next)
        if (*pp == t) {
            *pp = t->next;
            break;
        }
    for (pd_fwait *w = t->waiters; w; w = w->next) w->done = true;
    if (t->waiters) pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->mu);
    ticket_free(t);
}

/* What a message's handling ends in, acted on after mu is released. */
typedef struct {
    pd_xfer_done_fn fn;
    void *user;
    uint64_t ticket;
    strata_status st;
} pd_notice;

static void notice_run(pd_xfer *x, const pd_notice *n) {
    if (n->fn && !x->closing) n->fn(n->user, n->ticket, n->st);
}

/* The current attempt of t broke (mu held): FAILED, its on_done(ERR_IO) once. */
static void ticket_fail(pd_xfer *x, pd_ticket *t, pd_notice *n, const char *why) {
    if (t->state != T_RECEIVING) return;
    t->state = T_FAILED;
    x->stats.tickets_failed++;
    st_log(STRATA_LOG_WARN, "pd_xfer: ticket %llu attempt %u failed: %s", (unsigned long long)t->id, t->attempt, why);
    *n = (pd_notice){t->on_done, t->user, t->id, STRATA_ERR_IO};
}

/* n block-layers of t's current attempt landed (mu held). */
static void ticket_landed(pd_xfer *x, pd_ticket *t, int64_t n, uint64_t bytes, double secs, bool rndv) {
    x->stats.messages_received++;
    if (rndv) x->stats.messages_rndv++;
    else x->stats.messages_eager++;
    x->stats.bytes_received += bytes;
    x->stats.blocks_received += (t->landed_ever + n) / t->n_layers - t->landed_ever / t->n_layers;
    x->stats.recv_seconds += secs;
    hist_add(x->stats.recv_hist, secs);
    t->landed_ever += n;
    t->landed += n;
}

/* Complete: every block-layer of the current attempt landed, and no receive
 * of a replaced attempt still writes into the blocks (after OK the memory is
 * the caller's). mu held. */
static void ticket_check_done(pd_xfer *x, pd_ticket *t, pd_notice *out) {
    if (t->state == T_RECEIVING && !t->cancelled && t->inflight == 0 && t->landed == t->n_layers * t->n_blocks) {
        t->state = T_DONE;
        x->stats.tickets_done++;
        *out = (pd_notice){t->on_done, t->user, t->id, STRATA_OK};
    }
}

static void reject(pd_xfer *x, const pd_msg *h, const char *why) { /* mu held */
    x->stats.messages_rejected++;
    if (h)
        st_log(STRATA_LOG_WARN, "pd_xfer: rejected a message (ticket %llu attempt %u layer %u blocks %lld+%lld): %s",
               (unsigned long long)h->ticket, h->attempt, h->layer, (long long)h->first_block, (long long)h->n_blocks,
               why);
    else
        st_log(STRATA_LOG_WARN, "pd_xfer: rejected a message: %s", why);
}

static uint64_t hash_iov(const ucp_dt_iov_t *iov, int64_t n) {
    XXH3_state_t *s = XXH3_createState();
    if (!s) return 0; /* cannot hash: the caller's compare fails (a failed attempt, not a crash) */
    XXH3_64bits_reset(s);
    for (int64_t i = 0; i < n; i++) XXH3_64bits_update(s, iov[i].buffer, iov[i].length);
    uint64_t h = XXH3_64bits_digest(s);
    XXH3_freeState(s);
    return h;
}

static void recv_unlink(pd_xfer *x, pd_recv *r) {
    if (r->prev) r->prev->next = r->next;
    else x->recvs = r->next;
    if (r->next) r->next->prev = r->prev;
}

/* A rendezvous receive ended (from its callback, or inline when UCX finished
 * it at once or refused it). */
static void recv_finish(pd_recv *r, ucs_status_t status) {
    pd_xfer *x = r->x;
    pd_ticket *t = r->t;
    const double secs = st_time_now() - r->t0;
    /* the hash reads memory the ticket still owns (inflight > 0 keeps it) */
    const bool sum_ok = status == UCS_OK && (!r->check || hash_iov(r->iov, r->t->dst ? r->n : 1) == r->checksum);
    pd_notice n = {0};
    pthread_mutex_lock(&x->mu);
    t->inflight--;
    x->n_recving--;
    if (!t->cancelled && r->attempt == t->attempt && t->state == T_RECEIVING) {
        if (status != UCS_OK) {
            reject(x, &r->h, ucs_status_string(status));
            ticket_fail(x, t, &n, ucs_status_string(status));
        } else if (!sum_ok) {
            reject(x, &r->h, "checksum mismatch (rendezvous data, landed)");
            ticket_fail(x, t, &n, "checksum mismatch (rendezvous data, landed)");
        } else {
            memset(t->claimed + (int64_t)r->h.layer * t->n_blocks + (r->h.first_block - t->from_block), 2,
                   (size_t)r->n);
            ticket_landed(x, t, r->n, r->bytes, secs, true);
        }
    } else {
        /* forgotten, replaced by a higher attempt, or the attempt failed
         * meanwhile: the data landed but counts for nothing */
        reject(x, &r->h, t->cancelled ? "the ticket was forgotten while its data landed"
                                      : "the attempt ended while its data landed");
        /* a replaced attempt's data may have landed over blocks whose current
         * data had landed and been checked: those bytes are not the current
         * attempt's any more. (Over blocks still landing, the current
         * attempt's checksum, taken once its data is in, judges.) */
        if (!t->cancelled && t->state == T_RECEIVING && r->attempt != t->attempt) {
            const uint8_t *cl = t->claimed + (int64_t)r->h.layer * t->n_blocks + (r->h.first_block - t->from_block);
            for (int64_t k = 0; k < r->n; k++)
                if (cl[k] == 2) {
                    ticket_fail(x, t, &n, "a replaced attempt's data landed over this attempt's blocks");
                    break;
                }
        }
    }
    ticket_check_done(x, t, &n);
    const bool reap = t->cancelled && t->inflight == 0;
    pthread_mutex_unlock(&x->mu);
    recv_unlink(x, r);
    st_free(r->iov);
    st_free(r);
    if (reap) ticket_reap(x, t);
    notice_run(x, &n);
}

static void recv_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
    (void)length;
    recv_finish(user_data, status);
    ucp_request_free(request);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param) {
    pd_xfer *x = arg;
    const double t0 = st_time_now();
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    /* A rejected message's data is dropped by UCX when the callback returns
     * without receiving it: eager data is UCX's buffer (UCS_OK frees it); a
     * rendezvous message's data never moves, and the status returned here
     * completes the sender's send (UCS_ERR_REJECTED: the sender hears IO).
     * (ucp_am_data_release is for descriptors kept past the callback by
     * returning UCS_INPROGRESS; called inside the callback, UCX 1.13 would
     * release the descriptor a second time after it returns.) */
    const ucs_status_t refuse = rndv ? UCS_ERR_REJECTED : UCS_OK;
    if (x->closing) return refuse;
    pd_msg h;
    pd_notice n = {0};
    pthread_mutex_lock(&x->mu);
    if (header_length != sizeof h || !header) {
        reject(x, NULL, "header size is not a pd_msg's");
        pthread_mutex_unlock(&x->mu);
        return refuse;
    }
    memcpy(&h, header, sizeof h);
    if (x->stopping) { /* pd_xfer_destroy began: nothing more lands */
        reject(x, &h, "the receiver is shutting down");
        pthread_mutex_unlock(&x->mu);
        return refuse;
    }
    pd_ticket *t = ticket_find(x, h.ticket);
    const char *why = NULL;
    char buf[160];
    if (!t) {
        reject(x, &h, "unknown ticket (not expected, or forgotten)");
        goto out;
    }
    if (t->state == T_DONE) {
        reject(x, &h, "the ticket is complete");
        t = NULL; /* final: nothing changes */
        goto out;
    }
    if (h.magic != PD_MSG_MAGIC || h.version != PD_MSG_VERSION) {
        snprintf(buf, sizeof buf, "bad magic/version %#x/%u", h.magic, h.version);
        why = buf;
        goto fail;
    }
    if (h.attempt < t->attempt) {
        reject(x, &h, "an older attempt's message (dropped)");
        t = NULL;
        goto out;
    }
    if (h.attempt == 0) {
        why = "attempt 0";
        goto fail;
    }
    if (h.attempt > t->attempt) { /* a retry (another prefill node): count again */
        if (t->attempt)
            st_log(STRATA_LOG_INFO, "pd_xfer: ticket %llu: attempt %u replaces attempt %u",
                   (unsigned long long)t->id, h.attempt, t->attempt);
        t->attempt = h.attempt;
        t->state = T_RECEIVING;
        t->landed = 0;
        memset(t->claimed, 0, (size_t)(t->n_layers * t->n_blocks));
    }
    if (t->state == T_FAILED) {
        reject(x, &h, "the ticket's attempt already failed");
        t = NULL;
        goto out;
    }
    if ((int64_t)h.layer >= t->n_layers) {
        snprintf(buf, sizeof buf, "layer %u >= %lld layers", h.layer, (long long)t->n_layers);
        why = buf;
        goto fail;
    }
    if (h.n_blocks < 1 || h.first_block < t->from_block || h.first_block - t->from_block > t->n_blocks ||
        h.n_blocks > t->n_blocks - (h.first_block - t->from_block)) {
        snprintf(buf, sizeof buf, "blocks [%lld, +%lld) outside the ticket's [%lld, %lld)", (long long)h.first_block,
                 (long long)h.n_blocks, (long long)t->from_block, (long long)(t->from_block + t->n_blocks));
        why = buf;
        goto fail;
    }
    const uint64_t want = (uint64_t)h.n_blocks * t->layer_bytes; /* <= the ticket's size: no overflow */
    if (h.bytes != want || length != want) {
        snprintf(buf, sizeof buf, "%llu header bytes, %zu data bytes, %llu expected", (unsigned long long)h.bytes,
                 length, (unsigned long long)want);
        why = buf;
        goto fail;
    }
    const int64_t k0 = h.first_block - t->from_block;
    uint8_t *cl = t->claimed + (int64_t)h.layer * t->n_blocks + k0;
    for (int64_t k = 0; k < h.n_blocks; k++)
        if (cl[k]) {
            snprintf(buf, sizeof buf, "block %lld of layer %u received twice", (long long)(h.first_block + k),
                     h.layer);
            why = buf;
            goto fail;
        }
    const bool check = !(h.flags & PD_MSG_F_CUDA) && !t->cuda;
    if (!rndv) {
        /* eager: checked before anything is written */
        if (t->cuda) {
            why = "eager data for CUDA memory (a sender must send from CUDA memory: rendezvous)";
            goto fail;
        }
        if (check && XXH3_64bits(data, length) != h.checksum) {
            why = "checksum mismatch";
            goto fail;
        }
        memset(cl, 2, (size_t)h.n_blocks);
        if (t->dst)
            for (int64_t k = 0; k < h.n_blocks; k++)
                memcpy(t->dst[k0 + k] + (size_t)h.layer * t->layer_bytes,
                       (const uint8_t *)data + (size_t)k * t->layer_bytes, t->layer_bytes);
        else
            memcpy(t->base + (size_t)h.layer * t->stride + (size_t)k0 * t->layer_bytes, data, length);
        ticket_landed(x, t, h.n_blocks, want, st_time_now() - t0, false);
        ticket_check_done(x, t, &n);
        pthread_mutex_unlock(&x->mu);
        notice_run(x, &n);
        return UCS_OK;
    }
    /* rendezvous: straight into the blocks, checked once landed */
    pd_recv *r = st_malloc(sizeof *r);
    ucp_dt_iov_t *iov = st_malloc(sizeof *iov * (size_t)(t->dst ? h.n_blocks : 1));
    if (!r || !iov) {
        st_free(r);
        st_free(iov);
        why = "out of memory";
        goto fail;
    }
    *r = (pd_recv){.x = x, .t = t, .h = h, .attempt = h.attempt, .n = h.n_blocks, .checksum = h.checksum,
                   .bytes = want, .check = check, .t0 = t0, .iov = iov};
    if (t->dst)
        for (int64_t k = 0; k < h.n_blocks; k++)
            iov[k] = (ucp_dt_iov_t){t->dst[k0 + k] + (size_t)h.layer * t->layer_bytes, t->layer_bytes};
    else
        iov[0] = (ucp_dt_iov_t){t->base + (size_t)h.layer * t->stride + (size_t)k0 * t->layer_bytes, want};
    memset(cl, 1, (size_t)h.n_blocks);
    t->inflight++;
    x->n_recving++;
    pthread_mutex_unlock(&x->mu);
    r->next = x->recvs;
    r->prev = NULL;
    if (x->recvs) x->recvs->prev = r;
    x->recvs = r;
    /* layer-major: one contiguous region (UCX's CUDA protocols take no IOV), its memory type stated */
    const bool contig = !t->dst;
    const ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        .cb.recv_am = recv_cb,
        .user_data = r,
        .datatype = contig ? ucp_dt_make_contig(1) : ucp_dt_make_iov(),
        .memory_type = t->cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST,
    };
    ucs_status_ptr_t req = contig ? ucp_am_recv_data_nbx(x->worker, data, iov[0].buffer, want, &rp)
                                  : ucp_am_recv_data_nbx(x->worker, data, iov, (size_t)h.n_blocks, &rp);
    if (req == NULL) recv_finish(r, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) recv_finish(r, UCS_PTR_STATUS(req));
    return UCS_OK;

fail:
    reject(x, &h, why);
    ticket_fail(x, t, &n, why);
out:
    pthread_mutex_unlock(&x->mu);
    notice_run(x, &n);
    return refuse;
}

/* ---- sender -------------------------------------------------------------------- */

static void send_unlink(pd_xfer *x, pd_send *s) {
    if (s->prev) s->prev->next = s->next;
    else x->sends = s->next;
    if (s->next) s->next->prev = s->prev;
}

/* The user hears of s once: st, stats. */
static void send_report(pd_xfer *x, pd_send *s, strata_status st) {
    if (s->reported) return;
    s->reported = true;
    pthread_mutex_lock(&x->mu);
    if (--x->sends_open == 0) x->stats.send_busy_seconds += st_time_now() - x->busy_t0;
    if (st == STRATA_OK) {
        const double secs = st_time_now() - s->t0;
        x->stats.messages_sent++;
        x->stats.bytes_sent += s->len;
        if (s->hdr.layer == 0 && s->hdr.n_blocks > 0) x->stats.blocks_sent += s->hdr.n_blocks;
        x->stats.send_seconds += secs;
        hist_add(x->stats.send_hist, secs);
    }
    pthread_mutex_unlock(&x->mu);
    if (s->sent) s->sent(s->user, st);
}

static void peer_mark_failed(pd_peer *p, ucs_status_t status) {
    if (!p->ep || p->failed) return;
    p->failed = true;
    p->fail_status = status;
    p->x->peer_failed = true;
}

/* UCX is done with s (callback, immediate completion or refusal). */
static void send_complete(pd_xfer *x, pd_send *s, ucs_status_t status) {
    if (s->posted) {
        s->posted = false;
        x->n_posted--;
    }
    if (status == UCS_ERR_REJECTED) { /* the receiver refused a rendezvous message: the peer is fine */
        if (!s->reported)
            st_log(STRATA_LOG_WARN, "pd_xfer: the receiver refused a message (ticket %llu layer %u)",
                   (unsigned long long)s->hdr.ticket, s->hdr.layer);
    } else if (status != UCS_OK) {
        if (!s->reported)
            st_log(STRATA_LOG_WARN, "pd_xfer: a send (ticket %llu layer %u) failed: %s",
                   (unsigned long long)s->hdr.ticket, s->hdr.layer, ucs_status_string(status));
        peer_mark_failed(s->peer, status);
    }
    send_report(x, s, st_of(status));
    send_unlink(x, s);
    st_free(s);
}

static void send_cb(void *request, ucs_status_t status, void *user_data) {
    pd_send *s = user_data;
    send_complete(s->peer->x, s, status);
    ucp_request_free(request);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    pd_peer *p = arg;
    (void)ep;
    st_log(STRATA_LOG_WARN, "pd_xfer: peer endpoint failed: %s", ucs_status_string(status));
    peer_mark_failed(p, status);
}

static void close_cb(void *request, ucs_status_t status, void *user_data) {
    pd_xfer *x = user_data;
    (void)status;
    x->n_closing--;
    ucp_request_free(request);
}

/* Force-closes p's endpoint (UCX completes its outstanding sends with an
 * error first); every send to p still unreported fails with IO. */
static void peer_close(pd_xfer *x, pd_peer *p) {
    if (!p->ep) return;
    ucp_ep_h ep = p->ep;
    p->ep = NULL;
    p->failed = false;
    const ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                                    UCP_OP_ATTR_FIELD_USER_DATA,
                                    .flags = UCP_EP_CLOSE_FLAG_FORCE,
                                    .cb.send = close_cb,
                                    .user_data = x};
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &rp);
    if (req && !UCS_PTR_IS_ERR(req)) x->n_closing++;
    /* UCX purges the endpoint's requests (their callbacks ran above or run
     * during the close); a send it still holds is failed here, once */
    for (pd_send *s = x->sends; s; s = s->next)
        if (s->peer == p && !s->reported) send_report(x, s, STRATA_ERR_IO);
}

static void handle_failed_peers(pd_xfer *x) {
    if (!x->peer_failed) return;
    x->peer_failed = false;
    for (pd_peer *p = x->peers; p; p = p->next)
        if (p->failed && p->ep) {
            st_log(STRATA_LOG_WARN, "pd_xfer: dropping the endpoint to a failed peer (%s)",
                   ucs_status_string(p->fail_status));
            peer_close(x, p);
        }
}

static void post_send(pd_xfer *x, pd_send *s) {
    s->next = x->sends;
    s->prev = NULL;
    if (x->sends) x->sends->prev = s;
    x->sends = s;
    pd_peer *p = s->peer;
    if (!p->ep || p->failed) {
        send_complete(x, s, UCS_ERR_NOT_CONNECTED);
        return;
    }
    const bool cuda = (s->hdr.flags & PD_MSG_F_CUDA) != 0;
    const ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS |
                        UCP_OP_ATTR_FIELD_MEMORY_TYPE,
        .cb.send = send_cb,
        .user_data = s,
        .flags = cuda ? UCP_AM_SEND_FLAG_RNDV : 0,
        .memory_type = cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST,
    };
    s->posted = true;
    x->n_posted++;
    ucs_status_ptr_t req = ucp_am_send_nbx(p->ep, PD_AM_ID, &s->hdr, sizeof s->hdr, s->data, s->len, &rp);
    if (req == NULL) send_complete(x, s, UCS_OK);
    else if (UCS_PTR_IS_ERR(req)) send_complete(x, s, UCS_PTR_STATUS(req));
}

static void flush_cb(void *request, ucs_status_t status, void *user_data) {
    pd_peer *p = user_data; /* kept until destroy: a late callback writes nothing freed */
    p->flush_st = status;
    ucp_request_free(request);
}

#define PD_CONNECT_PENDING ((strata_status)-1)
static void answer(pd_xfer *x, pd_cmd *c);

static void connect_answer(pd_xfer *x, pd_peer *p, strata_status st, const char *fmt, const char *what) {
    pd_cmd *c = p->waiters;
    p->waiters = NULL;
    p->connecting = false;
    x->n_connecting--;
    while (c) {
        pd_cmd *next = c->next;
        c->st = st;
        c->peer = st == STRATA_OK ? p : NULL;
        if (st != STRATA_OK) snprintf(c->err, sizeof c->err, fmt, what);
        answer(x, c);
        c = next;
    }
}

/* Connects waiting for their connection setup: answered once UCX's flush of
 * the new endpoint completed (the peer reached), failed, or timed out. */
static void handle_connects(pd_xfer *x, bool shutdown) {
    if (x->n_connecting == 0) return;
    const double now = st_time_now();
    for (pd_peer *p = x->peers; p; p = p->next) {
        if (!p->connecting) continue;
        if (shutdown) {
            connect_answer(x, p, STRATA_ERR_IO, "pd_xfer_connect: %s", "the transport is shutting down");
        } else if (p->flush_st == UCS_OK && p->ep && !p->failed) {
            connect_answer(x, p, STRATA_OK, NULL, NULL);
        } else if (p->flush_st != UCS_INPROGRESS || !p->ep || p->failed) {
            ucs_status_t st = p->flush_st; /* the cause: the flush's error, else the endpoint's */
            if (st == UCS_INPROGRESS || st == UCS_OK || st == UCS_ERR_CANCELED)
                st = p->fail_status != UCS_OK ? p->fail_status : UCS_ERR_CANCELED;
            peer_close(x, p);
            connect_answer(x, p, STRATA_ERR_IO, "pd_xfer_connect: cannot reach the peer: %s", ucs_status_string(st));
        } else if (now > p->connect_deadline) {
            peer_close(x, p);
            char what[32];
            snprintf(what, sizeof what, "%.0f s", PD_CONNECT_TIMEOUT_S);
            connect_answer(x, p, STRATA_ERR_IO, "pd_xfer_connect: the peer did not answer within %s", what);
        }
    }
}

/* The endpoint to a framed address; err gets a message on failure. From a
 * command (c): a new endpoint's caller waits for its connection setup
 * (PD_CONNECT_PENDING: c is answered later); inline (c NULL: from a
 * callback) it does not. Transport thread. */
static strata_status do_connect(pd_xfer *x, const void *addr, size_t len, pd_peer **out, char *err, size_t cap,
                                pd_cmd *c) {
    *out = NULL;
    pd_addr_frame f;
    if (!addr || len < sizeof f) {
        snprintf(err, cap, "pd_xfer_connect: the address is %zu bytes, not a pd_xfer address", len);
        return STRATA_ERR_IO;
    }
    memcpy(&f, addr, sizeof f);
    const uint8_t *ua = (const uint8_t *)addr + sizeof f;
    if (f.magic != PD_ADDR_MAGIC || f.len != len - sizeof f || XXH3_64bits(ua, f.len) != f.checksum) {
        snprintf(err, cap, "pd_xfer_connect: malformed address (%zu bytes: not a pd_xfer worker address)", len);
        return STRATA_ERR_IO;
    }
    pd_peer *p = NULL;
    for (pd_peer *q = x->peers; q; q = q->next)
        if (q->len == f.len && memcmp(q->addr, ua, f.len) == 0) {
            p = q;
            break;
        }
    if (p && p->failed && !p->connecting) peer_close(x, p); /* failed but not yet closed: replace it now */
    if (p && p->ep) {
        if (p->connecting && c) { /* its setup is under way: wait with the first caller */
            c->next = p->waiters;
            p->waiters = c;
            return PD_CONNECT_PENDING;
        }
        *out = p;
        return STRATA_OK;
    }
    if (!p) {
        p = st_calloc(1, sizeof *p);
        uint8_t *a = st_malloc(f.len);
        if (!p || !a) {
            st_free(p);
            st_free(a);
            snprintf(err, cap, "pd_xfer_connect: out of memory");
            return STRATA_ERR_NOMEM;
        }
        memcpy(a, ua, f.len);
        *p = (pd_peer){.x = x, .addr = a, .len = f.len};
        p->next = x->peers;
        x->peers = p;
    }
    /* the dead endpoint's pd_peer is reused: a caller's old handle reaches the new endpoint */
    const ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)p->addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_err_cb, .arg = p},
    };
    p->fail_status = UCS_OK;
    ucs_status_t s = ucp_ep_create(x->worker, &ep, &p->ep);
    if (s != UCS_OK) {
        p->ep = NULL;
        snprintf(err, cap, "pd_xfer_connect: cannot reach the peer: %s", ucs_status_string(s));
        return STRATA_ERR_IO;
    }
    if (!c) {
        *out = p;
        return STRATA_OK;
    }
    /* wait for the connection setup without holding the thread: a flush of
     * the new endpoint completes once the peer was reached (an unreachable or
     * dead one fails here rather than at the first send) */
    p->flush_st = UCS_INPROGRESS;
    const ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                    .cb.send = flush_cb,
                                    .user_data = p};
    ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &rp);
    if (req == NULL) p->flush_st = UCS_OK;
    else if (UCS_PTR_IS_ERR(req)) p->flush_st = UCS_PTR_STATUS(req);
    p->connecting = true;
    p->connect_deadline = st_time_now() + PD_CONNECT_TIMEOUT_S;
    x->n_connecting++;
    c->next = NULL;
    p->waiters = c;
    return PD_CONNECT_PENDING;
}

/* Marks a ticket cancelled; frees it when nothing lands in it, else when the
 * last receive ends. w (may be NULL) is answered then. Transport thread. */
static void do_forget(pd_xfer *x, uint64_t id, pd_fwait *w) {
    pthread_mutex_lock(&x->mu);
    pd_ticket *t = ticket_find(x, id);
    if (!t) {
        if (w) {
            w->done = true;
            pthread_cond_broadcast(&x->cv);
        }
        pthread_mutex_unlock(&x->mu);
        return;
    }
    t->cancelled = true;
    if (w) {
        w->next = t->waiters;
        t->waiters = w;
    }
    const bool reap = t->inflight == 0;
    pthread_mutex_unlock(&x->mu);
    if (reap) ticket_reap(x, t);
}

/* ---- the transport thread ---------------------------------------------------- */

static void wake(pd_xfer *x) {
    uint64_t one = 1;
    ssize_t r;
    do r = write(x->evfd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
}

static void answer(pd_xfer *x, pd_cmd *c) {
    pthread_mutex_lock(&x->mu);
    c->done = true;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

/* Runs the queued commands; returns false once destroy began. */
static bool run_commands(pd_xfer *x) {
    pthread_mutex_lock(&x->mu);
    pd_cmd *c = x->cmd_head;
    x->cmd_head = x->cmd_tail = NULL;
    const bool stopping = x->stopping;
    pthread_mutex_unlock(&x->mu);
    while (c) {
        pd_cmd *next = c->next;
        switch (c->type) {
        case CMD_SEND:
            post_send(x, c->send);
            st_free(c);
            break;
        case CMD_CONNECT:
            if (stopping) {
                c->st = STRATA_ERR_IO;
                snprintf(c->err, sizeof c->err, "pd_xfer_connect: the transport is shutting down");
            } else {
                c->st = do_connect(x, c->addr, c->len, &c->peer, c->err, sizeof c->err, c);
            }
            if (c->st != PD_CONNECT_PENDING) answer(x, c); /* else handle_connects answers */
            break;
        case CMD_FORGET:
            do_forget(x, c->ticket, &c->fw);
            break;
        }
        c = next;
    }
    return !stopping;
}

static void progress_all(pd_xfer *x) {
    while (ucp_worker_progress(x->worker)) {
    }
    handle_failed_peers(x);
    handle_connects(x, false);
}

static void *thread_main(void *arg) {
    pd_xfer *x = arg;
    for (;;) {
        if (!run_commands(x)) break;
        progress_all(x);
        pthread_mutex_lock(&x->mu);
        const bool more = x->cmd_head != NULL || x->stopping;
        pthread_mutex_unlock(&x->mu);
        if (more) continue;
        /* transfers in flight: poll (shared-memory transports raise no event, and a rendezvous
         * moves its data only as fast as the worker is progressed: sleeping 1 ms between rounds
         * held a 6 MB message to ~2 GB/s) */
        if (x->n_posted > 0 || x->n_recving > 0) {
            sched_yield();
            continue;
        }
        ucs_status_t s = ucp_worker_arm(x->worker);
        if (s == UCS_ERR_BUSY) continue; /* events came meanwhile */
        const bool busy = x->n_closing > 0 || x->n_connecting > 0 || s != UCS_OK;
        struct epoll_event ev[4];
        int n = epoll_wait(x->epfd, ev, 4, busy ? PD_BUSY_WAIT_MS : PD_IDLE_WAIT_MS);
        for (int i = 0; i < n; i++)
            if (ev[i].data.fd == x->evfd) {
                uint64_t v;
                ssize_t r = read(x->evfd, &v, sizeof v);
                (void)r;
            }
    }

    /* shutdown: commands queued before destroy still run (sends fail: their
     * endpoints close below), every endpoint is force-closed, every send not
     * yet reported fails with IO. */
    run_commands(x);
    handle_connects(x, true);
    for (pd_peer *p = x->peers; p; p = p->next) peer_close(x, p);
    const double t_end = st_time_now() + PD_CLOSE_TIMEOUT_S;
    while (x->n_closing > 0 && st_time_now() < t_end) {
        progress_all(x);
        if (x->n_closing > 0) usleep(200);
    }
    if (x->n_closing > 0) st_log(STRATA_LOG_WARN, "pd_xfer: %d endpoint closes did not finish", x->n_closing);
    for (pd_send *s = x->sends; s; s = s->next)
        if (!s->reported) send_report(x, s, STRATA_ERR_IO);
    x->closing = true;
    return NULL;
}

/* ---- public -------------------------------------------------------------------- */

strata_status pd_xfer_create(pd_xfer **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_create: out is NULL");
    *out = NULL;
    pthread_once(&g_log_once, log_init);
    pd_xfer *x = st_calloc(1, sizeof *x);
    if (!x) return st_err(STRATA_ERR_NOMEM, "pd_xfer_create: out of memory for its state (%zu bytes)", sizeof *x);
    x->ucp_efd = x->evfd = x->epfd = -1;
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, NULL);
    strata_status st = STRATA_ERR_IO;
    ucs_status_t s;
    ucp_config_t *cfg = NULL;
    s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK) {
        st_err(st, "pd_xfer_create: UCX configuration: %s", ucs_status_string(s));
        goto fail;
    }
    s = ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", PD_KEEPALIVE_INTERVAL);
    if (s != UCS_OK) st_log(STRATA_LOG_WARN, "pd_xfer: UCX keepalive interval not set: %s", ucs_status_string(s));
    const ucp_params_t pp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
    };
    s = ucp_init(&pp, cfg, &x->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK) {
        x->ctx = NULL;
        st_err(st, "pd_xfer_create: ucp_init: %s", ucs_status_string(s));
        goto fail;
    }
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    x->cuda = ucp_context_query(x->ctx, &ca) == UCS_OK && (ca.memory_types & (1ull << UCS_MEMORY_TYPE_CUDA));
    const ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                                    .thread_mode = UCS_THREAD_MODE_SINGLE};
    s = ucp_worker_create(x->ctx, &wp, &x->worker);
    if (s != UCS_OK) {
        x->worker = NULL;
        st_err(st, "pd_xfer_create: ucp_worker_create: %s", ucs_status_string(s));
        goto fail;
    }
    ucp_address_t *ua = NULL;
    size_t ulen = 0;
    s = ucp_worker_get_address(x->worker, &ua, &ulen);
    if (s != UCS_OK) {
        st_err(st, "pd_xfer_create: ucp_worker_get_address: %s", ucs_status_string(s));
        goto fail;
    }
    x->address_len = sizeof(pd_addr_frame) + ulen;
    x->address = st_malloc(x->address_len);
    if (!x->address) {
        ucp_worker_release_address(x->worker, ua);
        st = st_err(STRATA_ERR_NOMEM, "pd_xfer_create: out of memory for the worker address (%zu bytes)",
                    x->address_len);
        goto fail;
    }
    const pd_addr_frame f = {PD_ADDR_MAGIC, (uint32_t)ulen, XXH3_64bits(ua, ulen)};
    memcpy(x->address, &f, sizeof f);
    memcpy(x->address + sizeof f, ua, ulen);
    ucp_worker_release_address(x->worker, ua);

    const ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = PD_AM_ID,
        .cb = am_cb,
        .arg = x,
    };
    s = ucp_worker_set_am_recv_handler(x->worker, &hp);
    if (s != UCS_OK) {
        st_err(st, "pd_xfer_create: ucp_worker_set_am_recv_handler: %s", ucs_status_string(s));
        goto fail;
    }
    s = ucp_worker_get_efd(x->worker, &x->ucp_efd);
    if (s != UCS_OK) {
        x->ucp_efd = -1;
        st_err(st, "pd_xfer_create: ucp_worker_get_efd: %s", ucs_status_string(s));
        goto fail;
    }
    x->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    x->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (x->evfd < 0 || x->epfd < 0) {
        st_err(st, "pd_xfer_create: eventfd/epoll: %s", strerror(errno));
        goto fail;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = x->ucp_efd};
    struct epoll_event ev2 = {.events = EPOLLIN, .data.fd = x->evfd};
    if (epoll_ctl(x->epfd, EPOLL_CTL_ADD, x->ucp_efd, &ev) != 0 ||
        epoll_ctl(x->epfd, EPOLL_CTL_ADD, x->evfd, &ev2) != 0) {
        st_err(st, "pd_xfer_create: epoll_ctl: %s", strerror(errno));
        goto fail;
    }
    int e = pthread_create(&x->thread, NULL, thread_main, x);
    if (e != 0) {
        st_err(st, "pd_xfer_create: pthread_create: %s", strerror(e));
        goto fail;
    }
    x->thread_started = true;
    *out = x;
    return STRATA_OK;
fail:
    pd_xfer_destroy(x);
    return st;
}

void pd_xfer_destroy(pd_xfer *x) {
    if (!x) return;
    if (x->thread_started) {
        pthread_mutex_lock(&x->mu);
        x->stopping = true;
        pthread_mutex_unlock(&x->mu);
        wake(x);
        pthread_join(x->thread, NULL);
    }
    x->closing = true; /* UCX's callbacks during the worker's destruction tell the user nothing */
    if (x->worker) ucp_worker_destroy(x->worker);
    if (x->ctx) ucp_cleanup(x->ctx);
    if (x->evfd >= 0) close(x->evfd);
    if (x->epfd >= 0) close(x->epfd);
    while (x->sends) {
        pd_send *s = x->sends;
        x->sends = s->next;
        st_free(s);
    }
    while (x->recvs) {
        pd_recv *r = x->recvs;
        x->recvs = r->next;
        st_free(r->iov);
        st_free(r);
    }
    while (x->peers) {
        pd_peer *p = x->peers;
        x->peers = p->next;
        st_free(p->addr);
        st_free(p);
    }
    while (x->tickets) {
        pd_ticket *t = x->tickets;
        x->tickets = t->next;
        for (pd_fwait *w = t->waiters; w; w = w->next) w->done = true;
        ticket_free(t);
    }
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    st_free(x->address);
    st_free(x);
}

const void *pd_xfer_address(const pd_xfer *x, size_t *len) {
    if (len) *len = x ? x->address_len : 0;
    return x ? x->address : NULL;
}

/* Queues c and wakes the thread; false when destroy began (c not queued). */
static bool enqueue(pd_xfer *x, pd_cmd *c) {
    pthread_mutex_lock(&x->mu);
    if (x->stopping) {
        pthread_mutex_unlock(&x->mu);
        return false;
    }
    c->next = NULL;
    if (x->cmd_tail) x->cmd_tail->next = c;
    else x->cmd_head = c;
    x->cmd_tail = c;
    pthread_mutex_unlock(&x->mu);
    wake(x);
    return true;
}

static bool on_thread(const pd_xfer *x) { return pthread_equal(pthread_self(), x->thread) != 0; }

bool pd_xfer_cuda(const pd_xfer *x) { return x && x->cuda; }

static strata_status expect(pd_xfer *x, uint64_t ticket, int64_t n_layers, size_t layer_bytes, int64_t from_block,
                            int64_t n_blocks, void *const *dst, void *base, size_t stride, bool cuda,
                            pd_xfer_done_fn on_done, void *user) {
    if (!x) return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: x is NULL");
    uint64_t cells = 0, total = 0;
    if (n_layers < 1 || n_blocks < 1 || layer_bytes == 0 || from_block < 0 ||
        st_mul_ovf_u64((uint64_t)n_layers, (uint64_t)n_blocks, &cells) || cells > (uint64_t)INT64_MAX / 2 ||
        st_mul_ovf_u64((uint64_t)n_layers, layer_bytes, &total) || total > SIZE_MAX / 2 ||
        from_block > INT64_MAX - n_blocks)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "pd_xfer_expect: ticket %llu: bad sizes (%lld layers of %zu bytes, blocks [%lld, +%lld))",
                      (unsigned long long)ticket, (long long)n_layers, layer_bytes, (long long)from_block,
                      (long long)n_blocks);
    if ((!dst && !base) || !on_done)
        return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: %s is NULL", (unsigned long long)ticket,
                      !on_done ? "on_done" : dst ? "dst" : "base");
    for (int64_t k = 0; dst && k < n_blocks; k++)
        if (!dst[k])
            return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: dst[%lld] is NULL",
                          (unsigned long long)ticket, (long long)k);
    uint64_t run = 0;
    if (!dst && (st_mul_ovf_u64((uint64_t)n_blocks, layer_bytes, &run) || stride < run ||
                 st_mul_ovf_u64((uint64_t)n_layers, stride, &total)))
        return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: layer stride %zu < %lld blocks x %zu bytes",
                      (unsigned long long)ticket, stride, (long long)n_blocks, layer_bytes);
    if (cuda && !x->cuda)
        return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: CUDA memory, and this process's UCX has "
                      "no CUDA support", (unsigned long long)ticket);
    pd_ticket *t = st_calloc(1, sizeof *t);
    if (t) {
        t->dst = dst ? st_malloc(sizeof *t->dst * (size_t)n_blocks) : NULL;
        t->claimed = st_calloc((size_t)cells, 1);
    }
    if (!t || (dst && !t->dst) || !t->claimed) {
        ticket_free(t);
        return st_err(STRATA_ERR_NOMEM, "pd_xfer_expect: ticket %llu: out of memory", (unsigned long long)ticket);
    }
    for (int64_t k = 0; dst && k < n_blocks; k++) t->dst[k] = dst[k];
    t->base = base;
    t->stride = stride;
    t->cuda = cuda;
    t->id = ticket;
    t->n_layers = n_layers;
    t->layer_bytes = layer_bytes;
    t->from_block = from_block;
    t->n_blocks = n_blocks;
    t->on_done = on_done;
    t->user = user;
    t->state = T_RECEIVING;
    pthread_mutex_lock(&x->mu);
    if (ticket_find(x, ticket)) {
        pthread_mutex_unlock(&x->mu);
        ticket_free(t);
        return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu is already expected",
                      (unsigned long long)ticket);
    }
    t->next = x->tickets;
    x->tickets = t;
    pthread_mutex_unlock(&x->mu);
    return STRATA_OK;
}

strata_status pd_xfer_expect(pd_xfer *x, uint64_t ticket, int64_t n_layers, size_t layer_bytes, int64_t from_block,
                             int64_t n_blocks, void *const *dst, pd_xfer_done_fn on_done, void *user) {
    if (!dst) return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: dst is NULL", (unsigned long long)ticket);
    return expect(x, ticket, n_layers, layer_bytes, from_block, n_blocks, dst, NULL, 0, false, on_done, user);
}

strata_status pd_xfer_expect_at(pd_xfer *x, uint64_t ticket, int64_t n_layers, size_t layer_bytes, int64_t from_block,
                                int64_t n_blocks, void *base, size_t layer_stride, bool cuda, pd_xfer_done_fn on_done,
                                void *user) {
    if (!base) return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_expect: ticket %llu: base is NULL", (unsigned long long)ticket);
    return expect(x, ticket, n_layers, layer_bytes, from_block, n_blocks, NULL, base, layer_stride, cuda, on_done,
                  user);
}

void pd_xfer_forget(pd_xfer *x, uint64_t ticket) {
    if (!x) return;
    if (on_thread(x)) { /* from on_done / sent: cannot wait for the thread's own progress */
        do_forget(x, ticket, NULL);
        return;
    }
    pd_cmd c = {.type = CMD_FORGET, .ticket = ticket};
    if (!enqueue(x, &c)) return;
    pthread_mutex_lock(&x->mu);
    while (!c.fw.done) pthread_cond_wait(&x->cv, &x->mu);
    pthread_mutex_unlock(&x->mu);
}

strata_status pd_xfer_connect(pd_xfer *x, const void *addr, size_t len, pd_peer **out) {
    if (out) *out = NULL;
    if (!x || !out) return st_err(STRATA_ERR_INVALID_ARG, "pd_xfer_connect: %s is NULL", !x ? "x" : "out");
    if (on_thread(x)) {
        char err[256];
        strata_status st = do_connect(x, addr, len, out, err, sizeof err, NULL);
        return st == STRATA_OK ? st : st_err(st, "%s", err);
    }
    pd_cmd c = {.type = CMD_CONNECT, .addr = addr, .len = len};
    if (!enqueue(x, &c)) return st_err(STRATA_ERR_IO, "pd_xfer_connect: the transport is shutting down");
    pthread_mutex_lock(&x->mu);
    while (!c.done) pthread_cond_wait(&x->cv, &x->mu);
    pthread_mutex_unlock(&x->mu);
    if (c.st != STRATA_OK) return st_err(c.st, "%s", c.err);
    *out = c.peer;
    return STRATA_OK;
}

static strata_status send_common(pd_xfer *x, pd_peer *peer, const pd_msg *hdr, const void *data, size_t len,
                                 pd_xfer_sent_fn sent, void *user, bool raw, const char *fn) {
    if (!x || !peer || !hdr || (!data && len))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %s is NULL", fn, !x ? "x" : !peer ? "peer" : !hdr ? "hdr" : "data");
    if (peer->x != x) return st_err(STRATA_ERR_INVALID_ARG, "%s: the peer belongs to another pd_xfer", fn);
    if ((hdr->flags & PD_MSG_F_CUDA) && !x->cuda)
        return st_err(STRATA_ERR_INVALID_ARG, "%s: CUDA memory, and this process's UCX has no CUDA support", fn);
    pd_send *s = st_calloc(1, sizeof *s);
    pd_cmd *c = st_calloc(1, sizeof *c);
    if (!s || !c) {
        st_free(s);
        st_free(c);
        return st_err(STRATA_ERR_NOMEM, "%s: out of memory", fn);
    }
    s->peer = peer;
    s->hdr = *hdr;
    if (!raw) {
        s->hdr.magic = PD_MSG_MAGIC;
        s->hdr.version = PD_MSG_VERSION;
        s->hdr.bytes = len;
        s->hdr.checksum = s->hdr.flags & PD_MSG_F_CUDA ? 0 : XXH3_64bits(data, len);
    }
    s->data = data;
    s->len = len;
    s->sent = sent;
    s->user = user;
    s->t0 = st_time_now();
    c->type = CMD_SEND;
    c->send = s;
    pthread_mutex_lock(&x->mu);
    if (x->sends_open++ == 0) x->busy_t0 = s->t0; /* the sender's busy time: the union of messages in flight */
    pthread_mutex_unlock(&x->mu);
    if (!enqueue(x, c)) {
        pthread_mutex_lock(&x->mu);
        if (--x->sends_open == 0) x->stats.send_busy_seconds += st_time_now() - x->busy_t0;
        pthread_mutex_unlock(&x->mu);
        st_free(s);
        st_free(c);
        return st_err(STRATA_ERR_IO, "%s: the transport is shutting down", fn);
    }
    return STRATA_OK;
}

strata_status pd_xfer_send(pd_xfer *x, pd_peer *peer, const pd_msg *hdr, const void *data, size_t len,
                           pd_xfer_sent_fn sent, void *user) {
    return send_common(x, peer, hdr, data, len, sent, user, false, "pd_xfer_send");
}

strata_status pd_xfer_send_raw(pd_xfer *x, pd_peer *peer, const pd_msg *hdr, const void *data, size_t len,
                               pd_xfer_sent_fn sent, void *user) {
    return send_common(x, peer, hdr, data, len, sent, user, true, "pd_xfer_send_raw");
}

void pd_xfer_get_stats(pd_xfer *x, pd_xfer_stats *out) {
    if (!out) return;
    if (!x) {
        memset(out, 0, sizeof *out);
        return;
    }
    pthread_mutex_lock(&x->mu);
    *out = x->stats;
    pthread_mutex_unlock(&x->mu);
}

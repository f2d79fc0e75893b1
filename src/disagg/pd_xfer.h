/* disagg/pd_xfer: the KV data path between a prefill node and a decode node,
 * over UCX active messages (UCP; whatever UCX finds between hosts). Between
 * processes of one host UCX 1.13 takes TCP on loopback for the messages and
 * CMA (process_vm_readv) for rendezvous data: its shared-memory transports
 * cannot report a dead peer, which the endpoints here ask for
 * (UCP_ERR_HANDLING_MODE_PEER). No home-made sockets: UCX moves the bytes,
 * this module names them and checks them.
 *
 * Unit of transfer: one MESSAGE = one layer of a run of consecutive blocks of
 * one transfer ("ticket"). Its payload is n_blocks regions of layer_bytes
 * each, block after block (block b's region of layer l, as a host-tier block
 * lays it out at offset l * layer_bytes: K rows, V rows, fp8 scales). The
 * header (pd_msg) travels as the AM header; the payload as the AM data
 * (eager or rendezvous: UCX decides by size).
 *
 * Receiver (decode node): pd_xfer_expect registers a ticket with the memory
 * each block's layers land in (block k of the ticket at dst[k], its layer l at
 * dst[k] + l * layer_bytes; dst are the engine's reserved host-tier blocks).
 * A message is accepted only when ALL hold, else it is rejected (counted, its
 * data dropped, never written anywhere; the ticket's state is set to FAILED
 * if the ticket is known):
 *   magic and version; the ticket is expected and not cancelled; attempt >=
 *   the ticket's current attempt (a higher attempt restarts the count: a
 *   retry from another prefill node; lower ones are dropped silently, not a
 *   failure); layer < n_layers; first_block, n_blocks inside
 *   [from_block, from_block + ticket's n_blocks); bytes == n_blocks *
 *   layer_bytes and equal to the AM data length; after the data landed,
 *   XXH3-64 of the payload == checksum (a mismatch: FAILED).
 * Data lands straight in the destination blocks (ucp_am_recv_data_nbx with an
 * IOV datatype for rendezvous; a copy for eager data). The ticket completes
 * when every (layer, block) was received once: its on_done(user, ticket,
 * STRATA_OK) runs on the transport thread (must be quick: it posts to the
 * engine). FAILED tickets call on_done(user, ticket, STRATA_ERR_IO) once.
 * pd_xfer_forget drops a ticket: it returns only when no receive into its
 * memory is in flight, so the caller may reuse that memory afterwards.
 *
 * on_done, precisely (per ticket, attempt by attempt):
 *   - ERR_IO at the first failure of the current attempt (a rejected message
 *     of a known ticket, a rendezvous receive that failed, a checksum
 *     mismatch); later messages of that attempt are rejected without another
 *     on_done. It means "this attempt broke": receives of it may still be in
 *     flight (pd_xfer_forget waits for them).
 *   - A higher attempt after a failure starts over (counts cleared, the state
 *     receiving again) and may end in OK, or in one more ERR_IO of its own.
 *   - OK once, when every (layer, block) landed and checked in one attempt
 *     and no receive of a replaced attempt still lands in the blocks. OK is
 *     final: every later message of the ticket is rejected (the memory is
 *     the caller's now) and on_done never runs again.
 *   - A message of a lower attempt is dropped (counted as rejected), no
 *     failure. A rendezvous receive of an attempt replaced meanwhile lands
 *     but counts for nothing; landing over blocks whose current data had
 *     already landed and been checked, it fails the current attempt (over
 *     blocks still landing, the current attempt's checksum, taken after its
 *     data is in, judges the bytes).
 *   - Messages are also refused once pd_xfer_destroy began.
 * A refused rendezvous message's data never moves: UCX drops the descriptor
 * and the sender's send completes with STRATA_ERR_IO (UCS_ERR_REJECTED; the
 * endpoint stays up). A rejected eager message's send had completed (OK) on
 * the sender's side already. So a sender's OK means "delivered", not
 * "accepted": only the receiver's on_done says the ticket is whole.
 * From the transport thread itself (inside on_done or a sent callback)
 * pd_xfer_forget cannot wait: it marks the ticket forgotten and returns; the
 * ticket is dropped when its last receive ends.
 *
 * Sender (prefill node): pd_xfer_connect opens (or reuses: one endpoint per
 * distinct address) an endpoint to a receiver's worker address;
 * pd_xfer_send queues one message; the data buffer is the caller's until its
 * done callback (transport thread) says the send completed or failed. A peer
 * that dies fails the pending sends (done with STRATA_ERR_IO) and the
 * endpoint is dropped (the next connect makes a new one; a pd_peer handle
 * stays valid until destroy and reaches the new endpoint once one is made).
 * A dead process is seen at once (its sockets close); a silent one within
 * about a second (UCX keepalive, set to 1 s here: the default is 20 s).
 * The address pd_xfer_address gives is opaque: UCX's worker address framed
 * with a magic, its length and its XXH3; pd_xfer_connect refuses (IO, with a
 * message) bytes that are not such a frame before UCX parses anything.
 *
 * Threads: one transport thread per pd_xfer owns the UCP worker (progress,
 * AM handlers, sends); every function below may be called from any thread
 * (commands go to it through a locked queue and a wakeup of the worker),
 * also from on_done / sent callbacks, but pd_xfer_destroy (not from a
 * callback, and with no other call of that pd_xfer in progress). The thread
 * sleeps in epoll on the worker's event fd when idle; with operations in
 * flight it wakes at least every millisecond.
 * UCX's own warnings and errors go to st_log (warnings), not stderr: the
 * first pd_xfer_create installs a UCX log handler for the process.
 * Keep on_done and sent quick, also for this reason: UCX 1.13.1 as Debian
 * builds it (assertions on) aborts the process when it purges a connection
 * setup reply it still owes to a peer that died (ucp_request_send_state_ff:
 * "Assertion ... got REP message"; the assertion is gone upstream,
 * openucx/ucx#8175). A receiver whose thread is held while a new sender
 * connects and dies meets it; a responsive one answers the setup at once.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

#define PD_MSG_MAGIC 0x44505453u /* "STPD" as little-endian bytes (the field is 32 bits) */
#define PD_MSG_VERSION 1u

/* The AM header of one message (little-endian, as laid out here; 64 bytes). */
typedef struct {
    uint32_t magic, version;
    uint64_t ticket;
    uint32_t attempt;     /* the router's attempt number for this ticket (>= 1) */
    uint32_t layer;
    int64_t first_block;  /* block index in the prompt (not a pool block id) */
    int64_t n_blocks;
    uint64_t bytes;       /* payload bytes = n_blocks * layer_bytes */
    uint64_t checksum;    /* XXH3-64 of the payload, seed 0 (0 and unchecked with PD_MSG_F_CUDA) */
    uint64_t flags;       /* PD_MSG_F_* */
} pd_msg;
/* The payload is in the sender's CUDA device memory: sent by rendezvous (the
 * receiver's transport moves it: CUDA IPC between GPUs of one host), no
 * checksum (the host cannot read it where it lies). */
#define PD_MSG_F_CUDA 1u

typedef struct pd_xfer pd_xfer;

typedef struct {
    int64_t messages_sent, messages_received, messages_rejected;
    int64_t blocks_sent, blocks_received;      /* block-layers / n_layers: whole blocks */
    uint64_t bytes_sent, bytes_received;
    int64_t tickets_done, tickets_failed;
    /* blocks_sent: the blocks of layer-0 messages sent (the sender does not
     * know n_layers; for a whole ticket both sides count its n_blocks);
     * blocks_received: whole blocks (block-layers landed / the ticket's n_layers).
     * messages_/bytes_sent: sends completed OK; messages_/bytes_received:
     * messages accepted and landed; messages_rejected: every other message
     * that arrived (also those of lower attempts and those that landed for
     * a ticket forgotten or an attempt replaced meanwhile).
     * tickets_done / tickets_failed: on_done OK / ERR_IO calls (one per failed attempt).
     * per message: seconds from pd_xfer_send to its completion (sender, sends
     * completed OK) / from the AM's arrival to its data landing (receiver) */
    double send_seconds, recv_seconds;
    int64_t send_hist[12], recv_hist[12];
    /* sender: seconds with at least one message in flight (bytes_sent / this: the rate the
     * transfer ran at while it ran) */
    double send_busy_seconds;  /* counts of message times <= PD_XFER_HIST_BOUNDS[i]; last: above */
    int64_t messages_eager, messages_rndv; /* receiver: messages_received by UCX's protocol (data copied
                                              from UCX's buffer / received straight into the blocks) */
} pd_xfer_stats;
extern const double PD_XFER_HIST_BOUNDS[11]; /* seconds: 1e-4 .. 10 */

/* Makes the UCP context + worker and starts the transport thread. IO with a
 * message when UCX cannot start. */
strata_status pd_xfer_create(pd_xfer **out);
/* Stops the thread (pending sends fail with STRATA_ERR_IO, their done
 * callbacks run), closes endpoints, frees. NULL: no-op. */
void pd_xfer_destroy(pd_xfer *x);

/* This worker's address (for a sender's pd_xfer_connect), valid until destroy. */
const void *pd_xfer_address(const pd_xfer *x, size_t *len);

/* ---- receiver ---- */
typedef void (*pd_xfer_done_fn)(void *user, uint64_t ticket, strata_status st);
/* Expects blocks [from_block, from_block + n_blocks) of `ticket`, n_layers
 * layers of layer_bytes each, block k landing at dst[k] (copied array; the
 * memory is the caller's and must stay valid until on_done or
 * pd_xfer_forget). INVALID_ARG for a ticket already expected or bad sizes
 * (n_layers, n_blocks, layer_bytes >= 1, from_block >= 0: a reservation of
 * no block has nothing to expect), a NULL dst[k] or on_done. */
strata_status pd_xfer_expect(pd_xfer *x, uint64_t ticket, int64_t n_layers, size_t layer_bytes, int64_t from_block,
                             int64_t n_blocks, void *const *dst, pd_xfer_done_fn on_done, void *user);
/* The same, but block k's layer l lands at base + l * layer_stride + k *
 * layer_bytes (layer-major: every message is one contiguous region), and
 * `cuda` says base is CUDA device memory (a UCX with CUDA support moves the
 * data there: pd_xfer_cuda). A CUDA ticket takes rendezvous messages only
 * (an eager one fails the attempt: its bytes would need a host copy) and
 * checks no checksum (the host cannot read the landed bytes). INVALID_ARG
 * also for layer_stride < n_blocks * layer_bytes, and for cuda without
 * pd_xfer_cuda. */
strata_status pd_xfer_expect_at(pd_xfer *x, uint64_t ticket, int64_t n_layers, size_t layer_bytes, int64_t from_block,
                                int64_t n_blocks, void *base, size_t layer_stride, bool cuda, pd_xfer_done_fn on_done,
                                void *user);
/* Whether this process's UCX moves CUDA device memory (its context lists the
 * CUDA memory type: a UCX built with CUDA, e.g. PyPI's libucx-cu12). */
bool pd_xfer_cuda(const pd_xfer *x);
/* Drops a ticket (cancelled, expired, or taken after on_done); returns once no
 * receive into its memory is in flight. Unknown tickets: no-op. */
void pd_xfer_forget(pd_xfer *x, uint64_t ticket);

/* ---- sender ---- */
typedef struct pd_peer pd_peer;
/* An endpoint to the worker at addr[0..len) (one per address, reused; a dead
 * one is replaced). IO when the address is malformed or unreachable: a new
 * endpoint is returned once UCX's connection setup with the peer completed
 * (a flush of the endpoint; at most 10 s; the transport thread goes on
 * meanwhile). Called from on_done / sent (the transport thread) it returns
 * the endpoint without waiting: an unreachable peer then fails the sends. */
strata_status pd_xfer_connect(pd_xfer *x, const void *addr, size_t len, pd_peer **out);
typedef void (*pd_xfer_sent_fn)(void *user, strata_status st);
/* Queues one message: hdr (copied; magic, version, bytes and checksum are
 * filled in here from data/len), data[0..len) sent as the AM data, the
 * caller's until sent(user, st) runs on the transport thread. With
 * PD_MSG_F_CUDA in hdr->flags, data is CUDA device memory (INVALID_ARG
 * without pd_xfer_cuda): rendezvous, checksum 0. */
strata_status pd_xfer_send(pd_xfer *x, pd_peer *peer, const pd_msg *hdr, const void *data, size_t len,
                           pd_xfer_sent_fn sent, void *user);
/* Sends a message exactly as given: no field filled in (tests: malformed
 * and truncated messages). data may be shorter than hdr->bytes. */
strata_status pd_xfer_send_raw(pd_xfer *x, pd_peer *peer, const pd_msg *hdr, const void *data, size_t len,
                               pd_xfer_sent_fn sent, void *user);

void pd_xfer_get_stats(pd_xfer *x, pd_xfer_stats *out);

#ifdef __cplusplus
}
#endif

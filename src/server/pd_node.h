/* server/pd_node: the P-D side of a node (`strata serve --role prefill|decode`),
 * between the HTTP handlers (server.c) and the KV transport (disagg/pd_xfer.h).
 * docs/ARCHITECTURE.md "Prefill/decode disaggregation" has the protocol.
 *
 * Decode role: a reservation made by the engine (strata_kv_reserve) is
 * registered with the transport (pd_node_expect): the blocks land straight in
 * the reserved host-tier blocks. The node's own thread resolves tickets: when
 * the transport reports every block landed it forgets the ticket there (no
 * later message can write the blocks) and has the engine adopt them; a
 * ticket not complete within timeout_s is forgotten and cancelled (the
 * waiting request computes its prompt itself); /pd/cancel does the same at
 * once (pd_node_cancel).
 *
 * Prefill role: pd_node_prefill submits a prefill-only request that exports
 * its KV; each piece (one layer of the blocks a pass completed) is sent as
 * one message as soon as the engine hands it over, while the next chunks
 * compute; done() runs once the request finished and every send completed
 * (or the first failure: the request is aborted then).
 *
 * Thread-safe; callbacks (done) run on the engine's or the transport's
 * thread and must be quick. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/strbuf.h"
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum { PD_ROLE_BOTH = 0, PD_ROLE_PREFILL, PD_ROLE_DECODE } pd_role;
const char *pd_role_name(pd_role r); /* "both", "prefill", "decode" */
bool pd_role_parse(const char *s, pd_role *out);

typedef struct pd_node pd_node;

/* Starts the transport and the node's thread for role PREFILL or DECODE
 * (m: an engine; DECODE needs its KV host tier). timeout_s: a decode node's
 * wait for a ticket's blocks (> 0). */
strata_status pd_node_create(strata_model *m, pd_role role, double timeout_s, pd_node **out);
/* Cancels the open tickets, stops the thread and the transport. NULL: no-op. */
void pd_node_destroy(pd_node *n);

pd_role pd_node_role(const pd_node *n);
/* The transport address as lowercase hex (the protocol's "address"). */
const char *pd_node_address_hex(const pd_node *n);
/* The identity in the protocol ("%016llx" of strata_engine_info.kv_identity). */
const char *pd_node_identity_hex(const pd_node *n);

/* ---- decode ---- */
/* Registers reservation res (ticket != 0) with the transport; its deadline
 * starts now. On failure the reservation is cancelled. */
strata_status pd_node_expect(pd_node *n, const strata_kv_reservation *res);
/* Forgets and cancels ticket (unknown, or resolved already: OK). */
strata_status pd_node_cancel(pd_node *n, uint64_t ticket);

/* ---- prefill ---- */
typedef struct {
    uint64_t ticket;
    uint32_t attempt;
    const int32_t *tokens;       /* (from_block + n_blocks) * block_tokens ids */
    int64_t from_block, n_blocks;
    const void *address;         /* the decode node's transport address */
    size_t address_len;
} pd_prefill_args;
typedef struct {
    strata_status st;            /* OK, or why it failed (message in error) */
    char error[256];
    uint64_t bytes;              /* sent */
    int64_t messages;
    double seconds;              /* from pd_node_prefill to done */
} pd_prefill_result;
typedef void (*pd_prefill_done)(void *user, const pd_prefill_result *res);
/* Starts one prefill (args copied). Errors now (done never called): IO
 * when the decode node cannot be reached, the request's own errors. */
strata_status pd_node_prefill(pd_node *n, const pd_prefill_args *a, pd_prefill_done done, void *user);
/* Prompt tokens of the prefills in flight (the router's load figure). */
int64_t pd_node_queued_tokens(pd_node *n);

/* Appends the node's metrics (Prometheus text: strata_pd_*) to b. */
bool pd_node_metrics(pd_node *n, st_strbuf *b);

#ifdef __cplusplus
}
#endif

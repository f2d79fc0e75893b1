/* disagg/router: the front of prefill/decode disaggregation (`strata router`).
 *
 * Holds no model. It serves the OpenAI API of `strata serve` (the same routes,
 * API key rules, error JSON, body limit, 404 / 405 / 415 / 421 / 413 answers)
 * and hands each generation to a decode node D and its prompt to a prefill
 * node P, over the protocol of docs/ARCHITECTURE.md "Prefill/decode
 * disaggregation":
 *   1. D: POST /pd/reserve {"route", "request"}: D validates and tokenizes as
 *      its route would; a non-200 answer but 503 kv_blocks_exhausted goes to
 *      the client verbatim; 503 kv_blocks_exhausted, a refused or broken
 *      connection or a timeout: the next decode node.
 *   2. When "blocks" > 0, in a thread of its own: P: POST /pd/prefill
 *      {"ticket", "attempt", "tokens" (blocks 0 .. cached + blocks),
 *      "block_tokens", "from_block", "blocks", "identity", "address"}; a
 *      transport failure or a 5xx: the next prefill node with attempt + 1; a
 *      4xx, or no prefill node left, or the prefill budget (2 x pd_timeout)
 *      spent: D: POST /pd/cancel {"ticket"} (D computes the prompt itself).
 *   3. At the same time D: POST <route> with the client's body and
 *      `X-Strata-PD-Ticket`; D's answer goes to the client as it comes: its
 *      status, Content-Type (and Cache-Control), body bytes unchanged, server-
 *      sent events flushed chunk by chunk. D failing before a byte reached the
 *      client: the ticket is cancelled and the whole request goes to another
 *      decode node; after: a stream ends with an error event and [DONE].
 * Choices:
 *   decode node: up, fewest running + waiting (its /health) + the router's own
 *     requests in flight there; more kv_blocks_free breaks ties.
 *   prefill node: up, the largest affinity_blocks * block_tokens -
 *     queued_tokens, where queued_tokens = its queued_prompt_tokens (/health) +
 *     the prompt tokens the router has sent there and not yet seen answered,
 *     and affinity_blocks = how many leading blocks of this prompt the router
 *     sent there before (chained XXH3 hashes of each block's token ids, block
 *     i seeded with block i-1's hash, block 0 with 0: the block managers' scheme;
 *     an LRU of ST_ROUTER_AFFINITY_HASHES per node); ties: fewest prefill
 *     requests in flight, then the order given.
 * Health: a thread polls every node's GET /health every health_interval
 * seconds (timeout 1 s, all nodes at once); a node that fails a poll or a
 * request (connection refused or reset, timeout) is down until a poll
 * succeeds.
 * Timeouts: connect 2 s; reserve 30 s; prefill: one attempt pd_timeout (the
 * decode node's ticket expires then), all attempts of a ticket together 2 x
 * pd_timeout; the generation: its first byte within pd_timeout
 * + 30 s, then at most 300 s between bytes. A client that goes away aborts
 * the upstream requests (and cancels the ticket).
 * Without prefill nodes (n_prefill 0) the router balances whole requests over
 * the decode nodes, which may be plain servers (any --role): step 3 alone, no
 * ticket, the same choice of node, retries and pass-through.
 * Threads: libmicrohttpd, one thread per connection (a request blocks its own
 * thread while it waits for a node); the health thread; one thread per
 * prefill job.
 * Layering: core and the public header only, no engine or server internals.
 */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ST_ROUTER_AFFINITY_HASHES 65536 /* block hashes remembered per prefill node */

typedef struct st_router st_router;

typedef struct {
    const char *const *prefill; /* base URLs ("http://127.0.0.1:8081"); none: whole requests balanced
                                   over the decode nodes (see above) */
    int n_prefill;
    const char *const *decode;  /* at least one */
    int n_decode;
    const char *host;           /* address to bind (NULL: "127.0.0.1") */
    int port;                   /* 0: any free port (st_router_port) */
    const char *api_key;        /* NULL or "": none required */
    const char *node_api_key;   /* sent to the nodes as a Bearer key (NULL: api_key; "": none) */
    bool metrics_public;        /* /health and /metrics answer without the key */
    double pd_timeout;          /* seconds (0: 60), see above */
    double health_interval;     /* seconds between polls (0: 1) */
    size_t max_body;            /* request body limit (0: 1 MiB) */
} st_router_params;

/* Polls every node once, then listens. On error *out is NULL and the message
 * says why (a bad URL, an address that does not resolve, a port in use). */
strata_status st_router_start(const st_router_params *p, st_router **out);
int st_router_port(const st_router *r);
/* Refuses new requests (503), ends those in flight (a stream with an error
 * event and [DONE]), stops every thread and frees the router. NULL: no-op. */
void st_router_stop(st_router *r);

#ifdef __cplusplus
}
#endif

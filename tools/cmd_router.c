/* strata router --prefill URL[,URL...] --decode URL[,URL...] [options]: the
 * front of prefill/decode disaggregation (src/disagg/router.h). Holds no
 * model: serves the OpenAI API of `strata serve` and hands each request to a
 * decode node, its prompt to a prefill node. Prints "listening on
 * http://HOST:PORT" on stdout when ready; SIGINT or SIGTERM stops it (exit 0). */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

#include "commands.h"
#include "common.h" /* tool_parse_i64, tool_parse_f64 */
#include "disagg/router.h"

#define ROUTER_MAX_NODES 64

static void router_usage(FILE *f) {
    fprintf(f,
            "usage: strata router [--prefill URL[,URL...]] --decode URL[,URL...] [options]\n"
            "The front of prefill/decode disaggregation: serves the OpenAI-compatible API of strata serve\n"
            "(POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics)\n"
            "and holds no model. Each generation request is reserved on a decode node (strata serve --role\n"
            "decode: the one with the fewest requests running and waiting; more free KV blocks break ties),\n"
            "its prompt computed by a prefill node (strata serve --role prefill: the one maximizing\n"
            "affinity_blocks x block_tokens - queued_prompt_tokens, where affinity_blocks counts the\n"
            "leading blocks of the prompt the router sent there before), and the decode node's answer\n"
            "passed to the client byte for byte, streams as they come. Failed nodes are retried elsewhere;\n"
            "when no prefill node can do a prompt, the decode node computes it. Prints \"listening on\n"
            "http://HOST:PORT\" when ready; SIGINT or SIGTERM stops it (requests in flight are ended: a\n"
            "stream with an error event and [DONE]) and it exits 0. Without --prefill it balances whole\n"
            "requests over the --decode URLs, which may be plain servers (strata serve, any role): the same\n"
            "choice of node, retries and pass-through, no prefill/decode split.\n\n"
            "  --prefill URL[,URL...]   prefill nodes' base URLs (http://HOST:PORT)\n"
            "  --decode URL[,URL...]    decode nodes' (or plain servers') base URLs; required (at most %d\n"
            "                           nodes of each role)\n"
            "  --host HOST              address to bind (default 127.0.0.1: this machine only)\n"
            "  --port N                 port (default 8080; 0: any free port, printed)\n"
            "  --api-key KEY            require 'Authorization: Bearer KEY' on /v1/*, /health and /metrics\n"
            "                           (default: none; also read from $STRATA_API_KEY); also sent to the\n"
            "                           nodes unless --node-api-key is given\n"
            "  --node-api-key KEY       the key sent to the nodes (Authorization: Bearer KEY)\n"
            "  --metrics-public         with --api-key: /health and /metrics answer without the key\n"
            "  --pd-timeout SECS        the nodes' --pd-timeout (default 60): a prefill attempt may take\n"
            "                           SECS, a prompt's attempts 2 x SECS in all; a decode node's answer\n"
            "                           must start within SECS + 30 s (then at most 300 s between bytes),\n"
            "                           else the request goes to another decode node (or, once bytes were\n"
            "                           sent, ends with an error)\n"
            "  --health-interval SECS   seconds between polls of every node's /health (default 1); a node\n"
            "                           failing a poll or a request is not used until a poll succeeds\n"
            "  --max-body BYTES         request body limit (default 1048576); larger bodies get a 413\n"
            "\nTimeouts toward the nodes: connect 2 s, /pd/reserve 30 s, /health 1 s.\n"
            "Metrics: strata_router_requests_total{route,code}, strata_router_retries_total{stage},\n"
            "strata_router_prefill_cancelled_total, strata_router_node_up / _inflight{role,node},\n"
            "strata_router_node_queued_prompt_tokens{node}, strata_router_node_kv_blocks_free{node}.\n"
            "Request logs go to standard error at STRATA_LOG=info.\n",
            ROUTER_MAX_NODES);
}

typedef struct {
    const char *host, *api_key, *node_api_key;
    int64_t port, max_body;
    double pd_timeout, health_interval;
    bool metrics_public;
    char *urls[2][ROUTER_MAX_NODES]; /* [0] prefill, [1] decode: strdup'ed */
    int n[2];
} router_opts;

static void free_opts(router_opts *o) {
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < o->n[r]; i++) free(o->urls[r][i]);
}

/* A comma-separated list of http:// URLs. */
static bool parse_urls(const char *opt, const char *val, router_opts *o, int role) {
    if (!val || !*val) {
        fprintf(stderr, "strata router: %s needs a value (URL[,URL...])\n", opt);
        return false;
    }
    const char *p = val;
    while (*p) {
        const char *e = strchr(p, ',');
        const size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 0) {
            fprintf(stderr, "strata router: %s: an empty URL in '%s'\n", opt, val);
            return false;
        }
        char *u = strndup(p, n);
        if (!u) return false;
        const size_t pre = !strncmp(u, "http://", 7) ? 7 : 0;
        if (!pre || !u[pre] || u[pre] == '/') {
            fprintf(stderr, "strata router: %s: '%s' is not an http://HOST:PORT URL\n", opt, u);
            free(u);
            return false;
        }
        if (o->n[role] >= ROUTER_MAX_NODES) {
            fprintf(stderr, "strata router: %s: more than %d nodes\n", opt, ROUTER_MAX_NODES);
            free(u);
            return false;
        }
        o->urls[role][o->n[role]++] = u;
        p += n;
        if (*p == ',') p++;
    }
    return true;
}

/* 1: run, 0: exit 0 (help), -1: usage error (printed). */
static int parse_args(int argc, char **argv, router_opts *o) {
    o->host = "127.0.0.1";
    o->port = 8080;
    o->pd_timeout = 60;
    o->health_interval = 1;
    o->api_key = getenv("STRATA_API_KEY");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            router_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--prefill") || !strcmp(a, "--decode")) {
            if (!parse_urls(a, val, o, !strcmp(a, "--decode"))) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--metrics-public")) {
            o->metrics_public = true;
            continue;
        }
        if (!strcmp(a, "--host") || !strcmp(a, "--api-key") || !strcmp(a, "--node-api-key")) {
            if (!val) {
                fprintf(stderr, "strata router: %s needs a value\n", a);
                return -1;
            }
            if (!strcmp(a, "--host")) o->host = val;
            else if (!strcmp(a, "--api-key")) o->api_key = val;
            else o->node_api_key = val;
            i++;
            continue;
        }
        if (!strcmp(a, "--port")) {
            if (!tool_parse_i64(val, 0, 65535, a, &o->port)) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--max-body")) {
            if (!tool_parse_i64(val, 64, (int64_t)1 << 32, a, &o->max_body)) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--pd-timeout")) {
            if (!tool_parse_f64(val, 0.1, 86400, a, &o->pd_timeout)) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--health-interval")) {
            if (!tool_parse_f64(val, 0.05, 3600, a, &o->health_interval)) return -1;
            i++;
            continue;
        }
        if (a[0] == '-' && a[1]) {
            fprintf(stderr, "strata router: unknown option '%s' (strata router --help lists them)\n", a);
            return -1;
        }
        fprintf(stderr, "strata router: unexpected argument '%s'\n", a);
        return -1;
    }
    if (!o->n[1]) {
        fprintf(stderr, "strata router: --decode is required\n");
        return -1;
    }
    return 1;
}

int cmd_router(int argc, char **argv) {
    router_opts o;
    memset(&o, 0, sizeof o);
    const int pr = parse_args(argc, argv, &o);
    if (pr <= 0) {
        free_opts(&o);
        if (pr < 0) fprintf(stderr, "usage: strata router [--prefill URL[,URL...]] --decode URL[,URL...] "
                                    "[options]  (--help for more)\n");
        return pr < 0 ? 2 : 0;
    }
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    st_router_params p = {
        .prefill = (const char *const *)o.urls[0], .n_prefill = o.n[0],
        .decode = (const char *const *)o.urls[1], .n_decode = o.n[1],
        .host = o.host, .port = (int)o.port, .api_key = o.api_key, .node_api_key = o.node_api_key,
        .metrics_public = o.metrics_public, .pd_timeout = o.pd_timeout, .health_interval = o.health_interval,
        .max_body = (size_t)o.max_body,
    };
    st_router *r = NULL;
    if (st_router_start(&p, &r) != STRATA_OK) {
        fprintf(stderr, "strata router: %s\n", strata_last_error());
        free_opts(&o);
        return 1;
    }
    if (o.n[0])
        fprintf(stderr, "strata: router ready: %d prefill node(s), %d decode node(s), --pd-timeout %g s%s\n", o.n[0],
                o.n[1], o.pd_timeout, o.api_key && o.api_key[0] ? ", API key required" : "");
    else
        fprintf(stderr, "strata: router ready: balancing whole requests over %d server(s)%s\n", o.n[1],
                o.api_key && o.api_key[0] ? ", API key required" : "");
    const bool v6 = strchr(o.host, ':') != NULL;
    printf("listening on http://%s%s%s:%d\n", v6 ? "[" : "", o.host, v6 ? "]" : "", st_router_port(r));
    fflush(stdout);
    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    fprintf(stderr, "strata: %s: stopping the router\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    st_router_stop(r);
    free_opts(&o);
    return 0;
}

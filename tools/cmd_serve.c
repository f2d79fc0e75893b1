/* strata serve MODEL [options]: the OpenAI-compatible HTTP server.
 *
 * Through the public C API (strata.h): opens the model (files, backend,
 * tokenizer, chat template), settles the chat format, builds the engine
 * (max_batch sequence slots), starts its thread and the HTTP server
 * (src/server, itself on strata.h), prints "listening on http://HOST:PORT"
 * on stdout when ready, and serves until SIGINT or SIGTERM; then refuses new
 * requests (503), lets those in flight finish for up to --shutdown-timeout
 * seconds (SIGTERM; SIGINT or a second signal: none), aborts the rest (streams
 * end with an error event and [DONE]), frees everything and exits 0.
 *
 * On CUDA it first measures the device's rooflines (HBM bandwidth, GEMM
 * rate: tools/roofline.h) on a probe backend, before the model loads, and
 * publishes them in /metrics beside the engine's step costs, so that a
 * benchmark client (bench/bench_serve.py) can put the decode throughput it
 * measured beside the roofline of the batches it drove.
 *
 * tools/common.h (shared with the other commands, over internal headers) is
 * used for option parsing only (tool_model_opts, tool_parse_*), and with
 * tools/roofline.h for the start-up probes (tool_backend_params ->
 * tool_measure_device_rooflines); everything about the model goes through
 * strata.h. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "strata.h"

#include "commands.h"
#include "core/core.h" /* st_time_now */
#include "common.h"   /* option parsing (tool_model_opts) and tool_backend_params for the probes */
#include "roofline.h" /* start-up device probes */
#include "server/server.h"

/* The model's context is capped at this many tokens when --max-model-len is not given. */
#define SERVE_DEF_SEQ_CAP 2048
/* --shutdown-timeout's default: seconds running requests have to finish on SIGTERM / SIGINT. */
#define SERVE_DEF_SHUTDOWN_TIMEOUT 10.0

static void serve_usage(FILE *f) {
    fprintf(f,
            "usage: strata serve MODEL [options]\n"
            "Serves a model (a Hugging Face directory with tokenizer.json, or a .gguf file) over an\n"
            "OpenAI-compatible HTTP API: POST /v1/chat/completions, POST /v1/completions (streamed\n"
            "with server-sent events or not), GET /v1/models, GET /health, GET /metrics (Prometheus).\n"
            "Prints \"listening on http://HOST:PORT\" when ready; SIGINT or SIGTERM stops it (see\n"
            "--shutdown-timeout).\n\n"
            "  --host HOST              address to bind (default 127.0.0.1: this machine only)\n"
            "  --port N                 port (default 8080; 0: any free port, printed)\n"
            "  --api-key KEY            require 'Authorization: Bearer KEY' on /v1/*, /health and /metrics\n"
            "                           (default: none; also read from $STRATA_API_KEY)\n"
            "  --metrics-public         with --api-key: /health and /metrics answer without the key\n"
            "                           (for probes and scrapers)\n"
            "  --max-batch N            sequences running at once (default 32); more requests wait\n"
            "  --max-model-len N        tokens per sequence, prompt and output (default: the model's,\n"
            "                           at most 2048); a longer prompt is refused with a 400\n"
            "  --prefill-chunk N        most prompt tokens of one request per engine step (default 256)\n"
            "  --step-tokens N          token budget of an engine step: decodes + prompt chunks (default\n"
            "                           prefill-chunk + max-batch; at least prefill-chunk)\n"
            "  --kv-mem SIZE            paged KV cache size (K/M/G suffixes; default: room for max-batch\n"
            "                           sequences of max-model-len tokens, at most 1 GiB; less than one\n"
            "                           such sequence is raised to one, with a warning)\n"
            "  --kv-blocks N            paged KV cache size in blocks of 16 tokens (instead of --kv-mem)\n"
            "  --fast-prefill           bf16 operands, fp32 accumulation in the tensor-core matmuls and\n"
            "                           attention of batches of 4 tokens or more (CUDA; ~1e-2 relative\n"
            "                           error, about twice as fast): the default for bf16, f16 and\n"
            "                           quantized models\n"
            "  --precise                hi+lo split bf16 operands instead (~1e-5 of fp32 math): the\n"
            "                           default for models stored in f32\n"
            "  --kv-dtype bf16|fp8|f32  KV cache element type (default bf16)\n"
            TOOL_KV_TIER_OPTS_HELP TOOL_KV_STREAM_OPT_HELP TOOL_SPEC_OPTS_HELP
            "  --role both|prefill|decode\n"
            "                           prefill/decode disaggregation behind `strata router` (default both:\n"
            "                           a single server). prefill: serves /pd/prefill, pushing each layer's\n"
            "                           KV to a decode node over UCX as it is computed; decode: serves\n"
            "                           /pd/reserve and /pd/cancel, receives that KV into its host tier (or\n"
            "                           --pd-landing-mem) and\n"
            "                           generates. Every role still serves the OpenAI routes\n"
            "  --pd-timeout SECS        decode role: how long a request waits for its prompt's KV before\n"
            "                           computing the prompt itself (default 60)\n"
            "  --pd-landing-mem SIZE    decode role: the KV lands in this much device memory instead of the\n"
            "                           host tier and goes on into the KV cache from there (default: 0, the\n"
            "                           host tier). On CUDA it needs a UCX built with CUDA (e.g. PyPI's\n"
            "                           libucx-cu12 on LD_LIBRARY_PATH): the KV then moves GPU to GPU, and a\n"
            "                           prefill node with such a UCX sends from GPU memory too\n"
            "  --host-sample            sample on the host even on CUDA (checks; default: on the device)\n"
            "  --no-rooflines           skip the start-up probes of HBM bandwidth and GEMM rate (CUDA)\n"
            "  --max-body BYTES         request body limit (default 1048576); larger bodies get a 413\n"
            "  --model-name NAME        the model id in /v1/models and answers (default: the file name)\n"
            "  --chat-template NAME     chatml, llama3 or llama2 instead of the model's own template\n"
            "  --max-connections N      simultaneous connections (default 1024), those still sending their\n"
            "                           first request head included; more are closed at once\n"
            "  --max-connections-per-client N\n"
            "                           simultaneous connections from one remote address; more are closed\n"
            "                           at once (default 32; on a loopback --host, where every client is\n"
            "                           this machine, no cap unless given; 0: no cap). Behind a reverse\n"
            "                           proxy every connection comes from the proxy's address\n"
            "  --http-threads N         threads polling the connections (epoll; default 4, at most\n"
            "                           --max-connections); a request waiting for the engine, streamed or\n"
            "                           not, holds no thread\n"
            "  --header-timeout SECS    a connection's request line and headers must have arrived within\n"
            "                           SECS of its accept (a later request on a keep-alive connection: of\n"
            "                           its first byte), however slowly they trickle in; otherwise the\n"
            "                           connection is closed (default 10)\n"
            "  --idle-timeout SECS      a keep-alive connection must start its next request within SECS of\n"
            "                           the previous answer, and one reading a body or writing an answer\n"
            "                           may stall for SECS + 1 at most (not while the engine works on its\n"
            "                           request); otherwise it is closed (default 60)\n"
            "  --shutdown-timeout SECS  on SIGTERM: new requests get 503 while running ones have up\n"
            "                           to SECS seconds to finish (default 10); then the rest are\n"
            "                           aborted (a stream ends with an error event and [DONE], a whole\n"
            "                           answer is a 503) and the server exits 0. SIGINT (Ctrl-C), or a\n"
            "                           second signal, aborts at once\n"
            "  --device cpu|cuda|auto   backend (default auto: CUDA when built and a GPU is present)\n"
            "  --threads N              CPU worker threads (default: all cores; on CUDA, the CPU part of\n"
            "                           hybrid execution)\n"
            "  --device-mem SIZE        device memory budget (weights, KV cache, activations, scratch;\n"
            "                           default: no cap); weights that do not fit are streamed\n"
            "  --host-mem SIZE          pinned host memory for streamed weights (default 80%% of available)\n"
            "  --h2d-bw GB/s, --ssd-bw GB/s, --ring-slots N   weight streaming (as strata bench)\n"
            "  --cpu-layers auto|N, --cpu-max-tokens N   hybrid execution (CUDA, weights streamed): FFN\n"
            "                           groups of N layers computed by the CPU from host memory in decode\n"
            "                           steps (default auto; 0: off; as strata bench); --cpu-split auto|F\n"
            "                           the GPU's share of each, --cpu-pass-tokens N the pass it balances\n"
            "                           (as strata bench)\n"
            "\nRequests: POST bodies must be 'Content-Type: application/json' (415 otherwise); \"model\",\n"
            "when given, must be the served model's name (404 otherwise); on a loopback --host the Host\n"
            "header must be localhost, 127.0.0.1, [::1] or the host itself (421 otherwise: DNS rebinding).\n"
            "Sampling: temperature in [0, 2] (0: greedy), seed an integer in [0, 2^53] (-1 or absent: a\n"
            "fresh one per request), as strata run's --temp and --seed.\n"
            "\nRequest logs go to standard error at STRATA_LOG=info.\n");
}

typedef struct {
    const char *model_path, *host, *api_key, *model_name, *chat_template;
    int64_t port, max_batch, max_model_len, prefill_chunk, step_tokens, max_body, max_conn, kv_blocks;
    int64_t max_per_client, http_threads, header_timeout, idle_timeout;
    size_t kv_mem, landing_mem;
    double shutdown_timeout, pd_timeout;
    pd_role role;
    bool no_rooflines, host_sample, metrics_public;
    tool_model_opts mo;
} serve_opts;

/* 1: run, 0: exit 0 (help), -1: usage error (printed). */
static int parse_args(int argc, char **argv, serve_opts *o) {
    memset(o, 0, sizeof *o);
    o->mo = (tool_model_opts)TOOL_ENGINE_OPTS_INIT;
    o->mo.spec_opts = true;
    o->host = "127.0.0.1";
    o->port = 8080;
    o->shutdown_timeout = SERVE_DEF_SHUTDOWN_TIMEOUT;
    o->max_per_client = -1; /* the server's default */
    o->api_key = getenv("STRATA_API_KEY");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int r = tool_parse_model_opt(argc, argv, &i, &o->mo);
        if (r < 0) return -1;
        if (r > 0) {
            if (!strcmp(a, "--ctx") || !strcmp(a, "--batch")) {
                fprintf(stderr, "strata serve: %s: use %s\n", a,
                        !strcmp(a, "--ctx") ? "--max-model-len" : "--prefill-chunk");
                return -1;
            }
            continue;
        }
#define STR_OPT(name, field)                                                   \
    if (!strcmp(a, name)) {                                                    \
        if (!val) {                                                            \
            fprintf(stderr, "strata serve: %s needs a value\n", name);         \
            return -1;                                                         \
        }                                                                      \
        o->field = val;                                                        \
        i++;                                                                   \
        continue;                                                              \
    }
#define INT_OPT(name, field, lo, hi)                                           \
    if (!strcmp(a, name)) {                                                    \
        if (!tool_parse_i64(val, lo, hi, name, &o->field)) return -1;          \
        i++;                                                                   \
        continue;                                                              \
    }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            serve_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--kv-mem")) {
            if (!val || !tool_parse_size(val, "--kv-mem", &o->kv_mem)) {
                if (!val) fprintf(stderr, "strata serve: --kv-mem needs a value\n");
                return -1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--pd-landing-mem")) {
            if (!val || !tool_parse_size(val, "--pd-landing-mem", &o->landing_mem)) {
                if (!val) fprintf(stderr, "strata serve: --pd-landing-mem needs a value\n");
                return -1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--shutdown-timeout")) {
            if (!tool_parse_f64(val, 0, 86400, a, &o->shutdown_timeout)) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--role")) {
            if (!val || !pd_role_parse(val, &o->role)) {
                fprintf(stderr, "strata serve: --role: '%s' is not one of both, prefill, decode\n", val ? val : "");
                return -1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--pd-timeout")) {
            if (!tool_parse_f64(val, 0.001, 86400, a, &o->pd_timeout)) return -1;
            i++;
            continue;
        }
        if (!strcmp(a, "--host-sample")) {
            o->host_sample = true;
            continue;
        }
        if (!strcmp(a, "--metrics-public")) {
            o->metrics_public = true;
            continue;
        }
        if (!strcmp(a, "--no-rooflines")) {
            o->no_rooflines = true;
            continue;
        }
        STR_OPT("--host", host)
        STR_OPT("--api-key", api_key)
        STR_OPT("--model-name", model_name)
        STR_OPT("--chat-template", chat_template)
        INT_OPT("--port", port, 0, 65535)
        INT_OPT("--max-batch", max_batch, 1, 4096)
        INT_OPT("--max-model-len", max_model_len, 2, INT32_MAX)
        INT_OPT("--prefill-chunk", prefill_chunk, 1, 1 << 20)
        INT_OPT("--max-body", max_body, 64, (int64_t)1 << 32)
        INT_OPT("--max-connections", max_conn, 1, 1 << 16)
        INT_OPT("--max-connections-per-client", max_per_client, 0, 1 << 16)
        INT_OPT("--http-threads", http_threads, 1, 256)
        INT_OPT("--header-timeout", header_timeout, 1, 86400)
        INT_OPT("--idle-timeout", idle_timeout, 1, 86400)
        INT_OPT("--kv-blocks", kv_blocks, 1, INT32_MAX)
        INT_OPT("--step-tokens", step_tokens, 1, 1 << 20)
#undef STR_OPT
#undef INT_OPT
        if (a[0] == '-' && a[1]) {
            fprintf(stderr, "strata serve: unknown option '%s' (strata serve --help lists them)\n", a);
            return -1;
        }
        if (o->model_path) {
            fprintf(stderr, "strata serve: unexpected argument '%s'\n", a);
            return -1;
        }
        o->model_path = a;
    }
    if (!o->model_path) {
        fprintf(stderr, "strata serve: no MODEL given\n");
        return -1;
    }
    if (!tool_spec_settle(&o->mo)) return -1;
    if (o->chat_template) {
        if (strcmp(o->chat_template, "chatml") && strcmp(o->chat_template, "llama3") &&
            strcmp(o->chat_template, "llama2")) {
            fprintf(stderr, "strata serve: --chat-template: '%s' is not one of chatml, llama3, llama2\n",
                    o->chat_template);
            return -1;
        }
    }
    if (o->landing_mem && o->role != PD_ROLE_DECODE) {
        fprintf(stderr, "strata serve: --pd-landing-mem is for --role decode\n");
        return -1;
    }
    return 1;
}

static void print_error(const char *what) {
    const char *msg = strata_last_error();
    fprintf(stderr, "strata %s: %s\n", what, msg && *msg ? msg : "failed");
}

/* The model's chat template, or --chat-template's (a template of the same
 * family keeps its details); "none" when there is none (chat completions are
 * then refused). False (printed) on an unrecognised template with no
 * override. A template that names a date gets today's, as transformers does. */
static bool settle_chat(const serve_opts *o, strata_model *m) {
    const char *name = "none";
    const strata_status st = strata_chat_template(m, &name);
    if (o->chat_template) {
        /* a format other than the model's own (as strata run warns): the model was not trained on it */
        if (st == STRATA_OK && strcmp(name, "none") != 0 && strcmp(name, o->chat_template) != 0)
            fprintf(stderr,
                    "strata serve: warning: --chat-template %s differs from the model's own template (%s); "
                    "expect poor answers\n",
                    o->chat_template, name);
        if (strata_chat_set_template(m, o->chat_template) != STRATA_OK) {
            print_error("serve");
            return false;
        }
    } else if (st != STRATA_OK) {
        fprintf(stderr, "strata serve: %s: %s.\nPass --chat-template chatml|llama3|llama2 to choose a format.\n",
                o->model_path, strata_last_error());
        return false;
    }
    strata_model_info info;
    if (strata_model_info_get(m, &info) != STRATA_OK) {
        print_error("serve");
        return false;
    }
    if (info.chat_wants_date) {
        char buf[32];
        time_t now = time(NULL);
        struct tm tmv;
        if (localtime_r(&now, &tmv) && strftime(buf, sizeof buf, "%d %b %Y", &tmv) &&
            strata_chat_set_date(m, buf) != STRATA_OK) {
            print_error("serve");
            return false;
        }
    }
    return true;
}

/* Watches for a second SIGTERM / SIGINT during a drain: aborts what runs. */
typedef struct {
    st_server *srv;
    const sigset_t *sigs;
    pthread_t thread;
    atomic_bool done; /* the drain is over: the signal that ends sigwait is ours */
} serve_watch;

static void *serve_watch_main(void *arg) {
    serve_watch *w = arg;
    int sig = 0;
    while (sigwait(w->sigs, &sig) != 0) {
    }
    if (!atomic_load(&w->done)) {
        fprintf(stderr, "strata: %s again: aborting the requests in flight now\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
        st_server_abort(w->srv);
    }
    return NULL;
}

static const char *base_name(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    const char *b = path;
    for (size_t i = 0; i + 1 < n; i++)
        if (path[i] == '/') b = path + i + 1;
    return b;
}

int cmd_serve(int argc, char **argv) {
    serve_opts o;
    int pr = parse_args(argc, argv, &o);
    if (pr <= 0) {
        if (pr < 0) fprintf(stderr, "usage: strata serve MODEL [options]  (--help for more)\n");
        return pr < 0 ? 2 : 0;
    }
    /* SIGINT / SIGTERM are taken by sigwait below: block them in every thread
     * (the threads started from here inherit the mask). */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int rc = 1;
    strata_model *m = NULL;
    st_server *srv = NULL;
    char *model_name = NULL;
    const tool_model_opts *mo = &o.mo;
    double t0 = st_time_now();
    fprintf(stderr, "strata: loading %s ...\n", o.model_path);
    /* device rooflines first, on a probe backend of their own (tools/roofline.h), before the
     * model's backend exists */
    const st_backend_params bp = tool_backend_params(mo);
    tool_rooflines roof = {0};
    if (!o.no_rooflines && !tool_measure_device_rooflines(&bp, &roof)) goto done;
    if (roof.copy_bw > 0)
        fprintf(stderr, "strata: device rooflines: HBM %.0f GB/s (copy, read + write), bf16 GEMM %.0f TFLOP/s "
                        "(precise path %.0f)\n", roof.copy_bw / 1e9, roof.gemm_fast / 1e12, roof.gemm_precise / 1e12);
    strata_model_params mp = {
        .device = mo->device,
        .threads = mo->threads,
        .cpu_act = mo->cpu_act8 ? STRATA_CPU_ACT_INT8 : STRATA_CPU_ACT_PRECISE,
        .device_mem = mo->device_mem,
        .host_mem = mo->host_mem,
        .kv_dtype = mo->kv_dtype == ST_KV_FP8 ? STRATA_KV_FP8 : mo->kv_dtype == ST_KV_F32 ? STRATA_KV_F32 : STRATA_KV_BF16,
        .max_batch = o.max_batch,
        .max_seq_len = o.max_model_len,
        .max_seq_len_cap = SERVE_DEF_SEQ_CAP,
        .prefill_chunk = o.prefill_chunk,
        .step_tokens = o.step_tokens,
        .kv_blocks = o.kv_blocks,
        .kv_mem = o.kv_mem,
        .host_sample = o.host_sample, /* tests/gpu/check_device_sample.py compares the two */
        .kv_host_mem = mo->kv_host_mem,
        .kv_landing_mem = o.landing_mem,
        .kv_offload_lazy = mo->kv_offload_lazy,
        .kv_ssd_dir = mo->kv_ssd_dir,
        .kv_ssd_size = mo->kv_ssd_size,
        .kv_stream = mo->kv_stream,
        .kv_segment = mo->kv_segment,
        .kv_stream_mem = mo->kv_stream_mem,
        .kv_cpu_attn = mo->kv_cpu_attn,
        .spec = mo->spec,
        .spec_k = mo->spec_k,
        .spec_cost = mo->spec_cost,
        .draft_model = mo->draft,
        .prefill = mo->prefill < 0 ? STRATA_PREFILL_PRECISE : mo->prefill > 0 ? STRATA_PREFILL_FAST : STRATA_PREFILL_AUTO,
        .ring_slots = mo->ring_slots,
        .cpu_layers = mo->cpu_layers,
        .cpu_split = mo->cpu_split,
        .cpu_max_tokens = mo->cpu_max_tokens,
        .cpu_pass_tokens = mo->cpu_pass_tokens,
        .h2d_gbps = mo->h2d_bw,
        .ssd_gbps = mo->ssd_bw,
    };
    tool_test_faults(mo, &mp); /* --test-fault (test builds) */
    if (strata_model_open(o.model_path, &mp, &m) != STRATA_OK) {
        print_error("serve");
        goto done;
    }
    if (!settle_chat(&o, m)) goto done;
    if (strata_model_create_engine(m) != STRATA_OK || strata_start(m) != STRATA_OK) {
        print_error("serve");
        goto done;
    }
    if (o.model_name) {
        model_name = strdup(o.model_name);
    } else {
        model_name = strdup(base_name(o.model_path));
        size_t n = model_name ? strlen(model_name) : 0;
        if (n > 5 && !strcmp(model_name + n - 5, ".gguf")) model_name[n - 5] = 0;
    }
    strata_model_info info;
    strata_engine_info ei;
    if (strata_model_info_get(m, &info) != STRATA_OK || strata_engine_info_get(m, &ei) != STRATA_OK) {
        print_error("serve");
        goto done;
    }
    st_server_params sp = {.host = o.host, .port = (int)o.port, .api_key = o.api_key,
                           .metrics_public = o.metrics_public, .model_name = model_name,
                           .max_body = (size_t)o.max_body, .max_connections = (unsigned)o.max_conn,
                           /* server: 0 = its default, negative = no cap; here -1 = not given, 0 = no cap */
                           .max_connections_per_client = o.max_per_client < 0 ? 0
                                                         : o.max_per_client == 0 ? -1 : (int)o.max_per_client,
                           .threads = (unsigned)o.http_threads, .header_timeout_s = (unsigned)o.header_timeout,
                           .idle_timeout_s = (unsigned)o.idle_timeout,
                           .device_read_bw = roof.copy_bw, .gemm_rate = roof.gemm_fast,
                           .gemm_rate_precise = roof.gemm_precise, .role = o.role,
                           .pd_timeout_s = o.pd_timeout};
    if (st_server_start(m, &sp, &srv) != STRATA_OK) {
        print_error("serve");
        goto done;
    }
    fprintf(stderr,
            "strata: ready in %.2f s: model '%s' (%s, chat template %s), %lld sequences x %lld tokens, "
            "prefill chunk %lld, KV cache %lld blocks x %lld tokens (%.2f GiB)%s\n",
            st_time_now() - t0, model_name ? model_name : "?", info.backend, info.chat_template,
            (long long)ei.max_batch, (long long)ei.max_seq_len, (long long)ei.prefill_chunk, (long long)ei.kv_blocks,
            (long long)ei.kv_block_size, (double)(ei.kv_blocks * ei.kv_block_size) * ei.kv_bytes_per_token / 1073741824.0,
            o.api_key && o.api_key[0] ? ", API key required" : "");
    if (o.role != PD_ROLE_BOTH)
        fprintf(stderr, "strata: P-D role %s (KV over UCX)%s\n", pd_role_name(o.role),
                ei.kv_landing_blocks > 0 ? ", landing in device memory" : "");
    if (ei.kv_host_blocks > 0)
        fprintf(stderr, "strata: KV tiers: device %.2f GiB, host %.2f GiB (%lld blocks, %s offload)%s",
                (double)(ei.kv_blocks * ei.kv_block_size) * ei.kv_bytes_per_token / 1073741824.0,
                (double)ei.kv_host_blocks * ei.kv_block_bytes / 1073741824.0, (long long)ei.kv_host_blocks,
                ei.kv_offload, ei.kv_ssd_blocks > 0 ? "" : ", no SSD tier\n");
    if (ei.kv_host_blocks > 0 && ei.kv_ssd_blocks > 0)
        fprintf(stderr, ", SSD %.2f GiB in %s (%lld blocks, %lld found from earlier runs)\n",
                (double)ei.kv_ssd_blocks * (ei.kv_block_bytes + 4096.0) / 1073741824.0, mo->kv_ssd_dir,
                (long long)ei.kv_ssd_blocks, (long long)ei.kv_ssd_found);
    const bool v6 = strchr(o.host, ':') != NULL;
    printf("listening on http://%s%s%s:%d\n", v6 ? "[" : "", o.host, v6 ? "]" : "", st_server_port(srv));
    fflush(stdout);

    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    /* SIGTERM drains for --shutdown-timeout; SIGINT (Ctrl-C) aborts at once, and so does a second
     * signal during the drain (taken by a watcher thread) */
    const double grace = sig == SIGINT ? 0.0 : o.shutdown_timeout;
    fprintf(stderr, "strata: %s: shutting down (new requests refused; running ones have %g s to finish)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", grace);
    serve_watch w = {.srv = srv, .sigs = &sigs};
    const bool watching = grace > 0 && pthread_create(&w.thread, NULL, serve_watch_main, &w) == 0;
    const int64_t aborted = st_server_shutdown(srv, grace);
    if (watching) {
        atomic_store(&w.done, true);
        pthread_kill(w.thread, SIGTERM); /* ends its sigwait (directed at it; blocked everywhere) */
        pthread_join(w.thread, NULL);
    }
    if (aborted) fprintf(stderr, "strata: %lld request(s) aborted at shutdown\n", (long long)aborted);
    rc = 0;
done:
    st_server_stop(srv);   /* ends the connections, aborts their requests */
    strata_model_free(m);  /* stops the engine thread */
    free(model_name);
    return rc;
}

/* strata: the command-line tool. Dispatches to one subcommand per file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "core/core.h"

static void log_to_stderr(strata_log_level level, const char *msg, void *user) {
    (void)user;
    static const char *names[] = {"debug", "info", "warn", "error"};
    fprintf(stderr, "strata [%s] %s\n", names[level], msg);
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} g_cmds[] = {
    {"logits", cmd_logits, "write float32 logits of every position for given token ids"},
    {"inspect", cmd_inspect, "print a model's configuration and tensor table"},
    {"convert", cmd_convert, "convert a model (HF dir or GGUF) to a GGUF file"},
    {"tokenize", cmd_tokenize, "print the token ids of a text"},
    {"run", cmd_run, "generate text from a prompt, or chat (streams to stdout)"},
    {"bench", cmd_bench, "time prefill and decode beside their measured rooflines"},
    {"bench-kv", cmd_bench_kv, "time the first token of a long prompt from each KV tier beside its floor"},
    {"plan", cmd_plan, "show where the weights would live for given memory budgets, and the predicted speed"},
    {"mkmodel", cmd_mkmodel, "write a random Llama model of a known shape (benchmarks, tests)"},
    {"serve", cmd_serve, "serve a model over an OpenAI-compatible HTTP API"},
    {"router", cmd_router, "route OpenAI API requests to prefill and decode nodes (disaggregation)"},
};

#ifndef STRATA_VERSION
#error "STRATA_VERSION is defined by CMakeLists.txt (project VERSION)"
#endif

static void usage(FILE *f) {
    fprintf(f, "usage: strata COMMAND [ARGS...]   (strata COMMAND --help for its options)\n"
               "       strata --version\n\ncommands:\n");
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++)
        fprintf(f, "  %-10s %s\n", g_cmds[i].name, g_cmds[i].help);
    fprintf(f, "\nSTRATA_LOG=debug|info|warn|error sets the log level (default warn).\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V") || !strcmp(argv[1], "version")) {
        printf("strata %s\n", STRATA_VERSION);
        return 0;
    }
    strata_log_level lvl = STRATA_LOG_WARN;
    const char *env = getenv("STRATA_LOG");
    if (env) {
        if (!strcmp(env, "debug")) lvl = STRATA_LOG_DEBUG;
        else if (!strcmp(env, "info")) lvl = STRATA_LOG_INFO;
        else if (!strcmp(env, "error")) lvl = STRATA_LOG_ERROR;
    }
    st_log_set(log_to_stderr, NULL, lvl);
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++)
        if (!strcmp(argv[1], g_cmds[i].name)) return g_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "strata: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

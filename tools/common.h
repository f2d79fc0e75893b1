/* Shared pieces of the `strata` subcommands: option parsing helpers and the
 * "open a model on a backend" sequence every model-loading command uses. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "backend/backend.h"
#include "loader/loader.h"
#include "model/llama.h"

/* Options every command that loads a model accepts. */
typedef struct {
    const char *device;  /* "cpu" | "cuda" | "auto" */
    int threads;         /* 0: all cores */
    int64_t ctx;         /* 0: model default */
    int64_t batch;       /* tokens per forward chunk, 0: default */
} tool_model_opts;

#define TOOL_MODEL_OPTS_HELP \
    "  --device cpu|cuda|auto   backend (default auto: CUDA when built and a GPU is present)\n" \
    "  --threads N              CPU worker threads (default: all cores)\n"                      \
    "  --ctx N                  context length to reserve KV for (default: model's, at most 4096)\n" \
    "  --batch N                tokens per forward chunk (default 512)\n"

/* If argv[*i] is one of the model options, consumes it (and its value) and
 * returns 1; returns 0 when it is not; -1 (message printed) on a bad value. */
int tool_parse_model_opt(int argc, char **argv, int *i, tool_model_opts *o);

/* Parses a whole decimal integer in [lo, hi]; false (message printed, naming
 * `what`) otherwise. */
bool tool_parse_i64(const char *s, int64_t lo, int64_t hi, const char *what, int64_t *out);

/* Parses a whole finite decimal number in [lo, hi]; false (message printed,
 * naming `what`) otherwise. */
bool tool_parse_f64(const char *s, double lo, double hi, const char *what, double *out);

typedef struct {
    st_model_files *files;
    st_backend *be;
    st_llama *model;
    double load_s;
} tool_model;

/* Opens `path`, creates the backend and the model. Prints errors to stderr
 * and returns false on failure (everything released). */
bool tool_model_open(const char *path, const tool_model_opts *o, tool_model *tm);
void tool_model_close(tool_model *tm);

/* Prints "strata CMD: <st_last_error()>" to stderr. */
void tool_print_error(const char *cmd);

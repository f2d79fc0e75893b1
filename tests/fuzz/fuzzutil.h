/* Helpers shared by the libFuzzer harnesses of tests/fuzz (one executable per
 * fuzz_<name>.c, seed corpus in tests/fuzz/corpus/<name>/; built with
 * -DSTRATA_FUZZ=ON, run by scripts/test.sh).
 *
 * libFuzzer's interface is two free functions, so what a harness loads once
 * (a tokenizer, a model) is file-scope state of that harness: test code only.
 * A broken invariant calls FUZZ_CHECK, which prints it and aborts (libFuzzer
 * records the input as a crash). */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"

#define FUZZ_CHECK(cond, ...) do { if (!(cond)) fuzz_fail(__FILE__, __LINE__, #cond, __VA_ARGS__); } while (0)
void fuzz_fail(const char *file, int line, const char *cond, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 4, 5)));

/* A failed call must leave a message, naming `what` (the file) when not NULL. */
void fuzz_check_error(strata_status st, const char *what);

/* The input cut at every occurrence of FUZZ_SEP (a line "--8<--"): parts
 * point into the input, at most max of them (the last keeps the rest). */
#define FUZZ_SEP "\n--8<--\n"
typedef struct {
    const uint8_t *p;
    size_t n;
} fuzz_part;
size_t fuzz_split(const uint8_t *data, size_t size, fuzz_part *parts, size_t max);

/* A NUL-terminated heap copy of p[0..n) (aborts when out of memory). */
char *fuzz_strndup(const void *p, size_t n);

/* A private directory made at the first call (removed with its files at
 * exit), and files in it: fuzz_write writes data there as `name` and returns
 * the path (static rotating buffers); fuzz_remove deletes `name` if present. */
const char *fuzz_dir(void);
const char *fuzz_write(const char *name, const void *data, size_t n);
void fuzz_remove(const char *name);

/* A file of the source tree (STRATA_SOURCE_DIR, set by CMake). */
const char *fuzz_src_path(const char *rel);

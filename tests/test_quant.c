/* Reference quantization (core/quant.c).
 *
 * With no arguments: self-checks (hand-built blocks with hand-computed
 * values, round-trip error bounds, edge cases).
 * As a tool for tests/test_quant_pyref.py, which compares against gguf-py:
 *   test_quant dequant TYPE IN OUT   IN: whole blocks of TYPE -> OUT: float32
 *   test_quant quant   TYPE IN OUT   IN: float32 (whole blocks) -> OUT: TYPE bytes
 * TYPE is an st_dtype name (f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q6_k). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/quant.h"
#include "testutil.h"

static int tool(const char *mode, const char *type, const char *in, const char *out) {
    st_dtype t;
    if (!st_dtype_parse(type, &t)) {
        fprintf(stderr, "test_quant: unknown type %s\n", type);
        return 2;
    }
    const st_dtype_info *info = st_dtype_get(t);
    char *data = NULL;
    size_t len = 0;
    if (st_file_read_all(in, &data, &len) != STRATA_OK) {
        fprintf(stderr, "test_quant: %s\n", st_last_error());
        return 2;
    }
    int rc = 0;
    void *res = NULL;
    size_t res_len = 0;
    if (strcmp(mode, "dequant") == 0) {
        if (len % info->block_bytes) {
            fprintf(stderr, "test_quant: %zu bytes is not whole %s blocks\n", len, info->name);
            rc = 2;
        } else {
            int64_t n = (int64_t)(len / info->block_bytes) * info->block_elems;
            res_len = (size_t)n * sizeof(float);
            res = malloc(res_len ? res_len : 1);
            st_dequantize_row(t, data, res, n);
        }
    } else if (strcmp(mode, "quant") == 0) {
        int64_t n = (int64_t)(len / sizeof(float));
        if (len % sizeof(float) || n % info->block_elems) {
            fprintf(stderr, "test_quant: %zu bytes is not whole %s blocks of floats\n", len, info->name);
            rc = 2;
        } else {
            res_len = st_dtype_row_bytes(t, n);
            res = malloc(res_len ? res_len : 1);
            float *x = malloc(len ? len : 1);
            memcpy(x, data, len);
            if (!st_quantize_row(t, x, res, n)) {
                fprintf(stderr, "test_quant: no quantizer for %s\n", info->name);
                rc = 2;
            }
            free(x);
        }
    } else {
        fprintf(stderr, "test_quant: unknown mode %s\n", mode);
        rc = 2;
    }
    if (rc == 0 && !test_write_file(out, res, res_len)) {
        fprintf(stderr, "test_quant: cannot write %s\n", out);
        rc = 2;
    }
    free(res);
    free(data);
    return rc;
}

static void put16(uint8_t *p, uint16_t h) {
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void test_q4_k_block(void) {
    uint8_t b[144] = {0};
    put16(b, 0x3c00);     /* d = 1 */
    put16(b + 2, 0x3800); /* dmin = 0.5 */
    uint8_t *sc = b + 4, *qs = b + 16;
    sc[0] = 0x04;         /* s0 = 4 */
    sc[4] = 0x02;         /* m0 = 2 */
    sc[1] = 0xC5;         /* s1 = 5, top bits 3 -> high bits of s5 */
    sc[5] = 0x87;         /* m1 = 7, top bits 2 -> high bits of m5 */
    sc[9] = 0xA3;         /* s5 low = 3, m5 low = 10 */
    sc[8] = 0x21;         /* s4 = 1, m4 = 2 (no high bits: sc[0], sc[4] < 64) */
    qs[3] = 0x9C;         /* elem 3 (sub 0, low nibble 12), elem 35 (sub 1, high nibble 9) */
    qs[64 + 3] = 0xB0;    /* elem 131 (sub 4, low 0), elem 163 (sub 5, high 11) */
    float y[256];
    st_dequantize_row(ST_DTYPE_Q4_K, b, y, 256);
    CHECK(y[3] == 4.0f * 12 - 0.5f * 2);            /* 47 */
    CHECK(y[35] == 5.0f * 9 - 0.5f * 7);            /* 41.5 */
    CHECK(y[163] == 51.0f * 11 - 0.5f * 42);        /* s5 = 3 | 3<<4, m5 = 10 | 2<<4: 540 */
    CHECK(y[131] == -1.0f);                         /* sub 4, q = 0: -0.5 * 2 */
    CHECK(y[128] == -1.0f);
    CHECK(y[0] == -1.0f);                           /* sub 0, q = 0: -dmin*m0 */
}

static void test_q6_k_block(void) {
    uint8_t b[210] = {0};
    put16(b + 208, 0x3800);           /* d = 0.5 */
    int8_t *sc = (int8_t *)(b + 192);
    sc[15] = -3;                      /* half 1, group 3, second 16 */
    sc[0] = 2;
    b[116] = 0x70;                    /* ql[64 + 32 + 20]: high nibble 7 (group 3) */
    b[128 + 52] = 0x80;               /* qh[32 + 20]: bits 6..7 = 2 (group 3) */
    b[5] = 0x0F;                      /* ql[5] low nibble 15: elem 5 (half 0, group 0) */
    b[128 + 5] = 0x01;                /* qh[5] bits 0..1 = 1 */
    float y[256];
    st_dequantize_row(ST_DTYPE_Q6_K, b, y, 256);
    CHECK(y[244] == 0.5f * -3 * (7 + 32 - 32)); /* q = (7 | 2 << 4) - 32 = 7: -10.5 */
    CHECK(y[5] == 0.5f * 2 * ((15 | 1 << 4) - 32)); /* q = -1 */
    CHECK(y[6] == 0.5f * 2 * -32);
}

static void test_small_blocks(void) {
    /* Q8_0: x = j - 10 for j < 32: amax 21, d = 21/127 */
    float x[64], y[64];
    uint8_t q[2 * 34];
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 10);
    CHECK(st_quantize_row(ST_DTYPE_Q8_0, x, q, 32));
    CHECK((int8_t)q[2 + 31] == 127 && (int8_t)q[2 + 10] == 0 && (int8_t)q[2 + 0] == -60);
    st_dequantize_row(ST_DTYPE_Q8_0, q, y, 32);
    for (int j = 0; j < 32; j++) CHECK(fabsf(y[j] - x[j]) <= 21.0f / 127 * 0.51f);
    /* Q8_0 ties round away from zero: amax 127 -> d = 1 exactly */
    for (int j = 0; j < 32; j++) x[j] = 0.5f * (float)(j - 16);
    x[0] = 127.0f;
    x[1] = -2.5f;
    CHECK(st_quantize_row(ST_DTYPE_Q8_0, x, q, 32));
    CHECK((int8_t)q[2 + 1] == -3 && (int8_t)q[2 + 21] == 3 && (int8_t)q[2 + 17] == 1);

    /* Q4_0: largest magnitude -8 -> d = 1, x + 8.5 truncated */
    for (int j = 0; j < 32; j++) x[j] = 0.5f * (float)(j % 31) - 8.0f; /* -8 .. 7 */
    CHECK(st_quantize_row(ST_DTYPE_Q4_0, x, q, 32));
    CHECK(q[0] == 0x00 && q[1] == 0x3c); /* d = max / -8 = -8 / -8 = 1 as f16 */
    st_dequantize_row(ST_DTYPE_Q4_0, q, y, 32);
    for (int j = 0; j < 32; j++) CHECK(y[j] == floorf(x[j] + 8.5f) - 8.0f || y[j] == 7.0f);
    /* Q4_1: min 0, max 15 -> d = 1, m = 0 */
    for (int j = 0; j < 32; j++) x[j] = (float)(j % 16) - (j >= 16 ? 0.5f : 0.0f);
    x[16] = 0.0f;
    CHECK(st_quantize_row(ST_DTYPE_Q4_1, x, q, 32));
    st_dequantize_row(ST_DTYPE_Q4_1, q, y, 32);
    for (int j = 0; j < 32; j++) CHECK(y[j] == floorf(x[j] + 0.5f));

    /* all-zero blocks */
    memset(x, 0, sizeof x);
    const st_dtype zt[] = {ST_DTYPE_Q8_0, ST_DTYPE_Q4_0, ST_DTYPE_Q4_1};
    for (int i = 0; i < 3; i++) {
        CHECK(st_quantize_row(zt[i], x, q, 64));
        for (int j = 0; j < 64; j++) y[j] = 1.0f;
        st_dequantize_row(zt[i], q, y, 64);
        for (int j = 0; j < 64; j++) CHECK(y[j] == 0.0f);
    }
    CHECK(!st_quantize_row(ST_DTYPE_Q4_K, x, q, 0));
    CHECK(!st_quantize_row(ST_DTYPE_Q6_K, x, q, 0));
}

static uint64_t g_rng = 12345;
static float rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void test_round_trips(void) {
    enum { N = 32 * 64 };
    float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
    uint8_t *q = malloc(N * 4);
    for (int i = 0; i < N; i++) x[i] = rnd() * (float)(1 + i / 256); /* varying block scales */
    struct { st_dtype t; double bound; } cases[] = {
        /* max |y - x| / (block range) */
        {ST_DTYPE_F32, 0}, {ST_DTYPE_F16, 1e-3}, {ST_DTYPE_BF16, 8e-3},
        {ST_DTYPE_Q8_0, 0.51 / 127 + 1e-3}, {ST_DTYPE_Q4_0, 1.0 / 8 + 1e-3}, {ST_DTYPE_Q4_1, 2 * 0.51 / 15 + 2e-3} /* d = range / 15, range <= 2 amax */,
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        CHECK(st_quantize_row(cases[c].t, x, q, N));
        st_dequantize_row(cases[c].t, q, y, N);
        double worst = 0;
        for (int b = 0; b < N / 32; b++) {
            double amax = 0, e = 0;
            for (int j = 0; j < 32; j++) {
                amax = fmax(amax, fabs(x[32 * b + j]));
                e = fmax(e, fabs((double)y[32 * b + j] - x[32 * b + j]));
            }
            worst = fmax(worst, e / amax);
        }
        CHECK_MSG(worst <= cases[c].bound, "%s round trip: worst relative error %.4g > %.4g",
                  st_dtype_name(cases[c].t), worst, cases[c].bound);
    }
    free(x);
    free(y);
    free(q);
}

int main(int argc, char **argv) {
    if (argc == 5) return tool(argv[1], argv[2], argv[3], argv[4]);
    if (argc != 1) {
        fprintf(stderr, "usage: test_quant [dequant|quant TYPE IN OUT]\n");
        return 2;
    }
    test_q4_k_block();
    test_q6_k_block();
    test_small_blocks();
    test_round_trips();
    return test_finish("test_quant");
}

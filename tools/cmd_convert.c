/* strata convert SRC OUT.gguf [--type T]: writes any model as a llama GGUF file. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "common.h"
#include "loader/gguf.h"

static void convert_usage(FILE *f) {
    fprintf(f, "usage: strata convert SRC OUT.gguf [--type f32|f16|bf16|q8_0|q4_0|q4_1]\n"
               "Writes SRC (a Hugging Face model directory or a .gguf file) as a llama GGUF v3\n"
               "file. 2-D weights become --type (default f16), norms stay f32, the Q/K rows are\n"
               "permuted into llama.cpp's interleaved-RoPE order.\n");
}

int cmd_convert(int argc, char **argv) {
    const char *src = NULL, *out = NULL;
    st_dtype type = ST_DTYPE_F16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            convert_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--type")) {
            const char *v = i + 1 < argc ? argv[++i] : NULL;
            if (!v || !st_dtype_parse(v, &type) ||
                !(type == ST_DTYPE_F32 || type == ST_DTYPE_F16 || type == ST_DTYPE_BF16 ||
                  type == ST_DTYPE_Q8_0 || type == ST_DTYPE_Q4_0 || type == ST_DTYPE_Q4_1)) {
                fprintf(stderr, "strata convert: --type takes f32, f16, bf16, q8_0, q4_0 or q4_1\n");
                return 2;
            }
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "strata convert: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (!src) {
            src = argv[i];
        } else if (!out) {
            out = argv[i];
        } else {
            fprintf(stderr, "strata convert: unexpected argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!src || !out) {
        convert_usage(stderr);
        return 2;
    }
    double t0 = st_time_now();
    st_model_files *m = NULL;
    if (st_model_open(src, &m) != STRATA_OK) {
        tool_print_error("convert");
        return 1;
    }
    strata_status st = st_gguf_write_model(m, type, out);
    st_model_close(m);
    if (st != STRATA_OK) {
        tool_print_error("convert");
        return 1;
    }
    /* Reopen what was written: checks it and gives the summary's numbers. */
    st_model_files *o = NULL;
    if (st_gguf_open(out, &o) != STRATA_OK) {
        tool_print_error("convert");
        return 1;
    }
    uint64_t bytes = o->files[0].size;
    long long n = (long long)o->n_tensors;
    st_model_close(o);
    printf("converted %s -> %s: %lld tensors, %llu bytes (%s), %.2f s\n", src, out, n,
           (unsigned long long)bytes, st_dtype_name(type), st_time_now() - t0);
    return 0;
}

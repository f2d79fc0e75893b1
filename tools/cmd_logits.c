/* strata logits MODEL --tokens "1 2 3" --out FILE: float32 logits [n, vocab]
 * of every position, little-endian, no header. --pos-offset N shifts the
 * RoPE positions (st_llama_forward_seq_at). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "common.h"

static void logits_usage(FILE *f) {
    fprintf(f,
            "usage: strata logits MODEL (--tokens \"ID ID ...\" | --tokens-file FILE) --out FILE [options]\n"
            "Writes float32 logits [n_tokens, vocab] for every position (little-endian, no header).\n"
            "MODEL is a Hugging Face directory or a .gguf file.\n\n"
            "  --tokens \"1 2 3\"        token ids, separated by spaces or commas\n"
            "  --tokens-file FILE      the same, read from a file\n"
            "  --out FILE              where to write the logits\n"
            "  --chunk N               feed the tokens N at a time (1: token-by-token decode)\n"
            "  --pos-offset N          RoPE positions start at N instead of 0 (N + n_tokens - 1 <= 2^31 - 1);\n"
            "                          the KV cache and --ctx still count the tokens from 0. Positions past\n"
            "                          the model's max_position_embeddings are allowed (with a note): RoPE\n"
            "                          sees only the distances between tokens, so the logits should equal\n"
            "                          those at --pos-offset 0 up to rounding; a check that the angles stay\n"
            "                          exact far out (float32 angles would be off by radians past 2^24)\n"
            TOOL_MODEL_OPTS_HELP);
}

/* Parses ids separated by spaces/commas/newlines; prints the bad item on error. */
static bool parse_tokens(const char *s, int32_t **out, int64_t *n_out) {
    int64_t cap = 64, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof *ids);
    if (!ids) return false;
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) break;
        errno = 0;
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX ||
            (*end && *end != ' ' && *end != ',' && *end != '\n' && *end != '\t' && *end != '\r')) {
            int len = 0;
            while (p[len] && p[len] != ' ' && p[len] != ',' && p[len] != '\n' && len < 32) len++;
            fprintf(stderr, "strata logits: --tokens: '%.*s' (item %lld) is not a token id\n", len, p,
                    (long long)n + 1);
            free(ids);
            return false;
        }
        if (n == cap) {
            cap *= 2;
            int32_t *ni = realloc(ids, (size_t)cap * sizeof *ids);
            if (!ni) { free(ids); return false; }
            ids = ni;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    if (n == 0) {
        fprintf(stderr, "strata logits: no token ids given\n");
        free(ids);
        return false;
    }
    *out = ids;
    *n_out = n;
    return true;
}

int cmd_logits(int argc, char **argv) {
    tool_model_opts mo = TOOL_MODEL_OPTS_INIT;
    const char *model_path = NULL, *tokens_arg = NULL, *tokens_file = NULL, *out_path = NULL;
    int64_t chunk = 0, pos_offset = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int r = tool_parse_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            logits_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--tokens") && val) {
            tokens_arg = val; i++;
        } else if (!strcmp(a, "--tokens-file") && val) {
            tokens_file = val; i++;
        } else if (!strcmp(a, "--out") && val) {
            out_path = val; i++;
        } else if (!strcmp(a, "--chunk")) {
            if (!tool_parse_i64(val, 1, 1 << 20, "--chunk", &chunk)) return 2;
            i++;
        } else if (!strcmp(a, "--pos-offset")) {
            if (!tool_parse_i64(val, 0, INT32_MAX, "--pos-offset", &pos_offset)) return 2;
            i++;
        } else if (!tool_take_positional("logits", a, &model_path, logits_usage)) {
            return 2;
        }
    }
    if (!model_path || !out_path || (!tokens_arg == !tokens_file)) {
        fprintf(stderr, "strata logits: needs MODEL, --out and one of --tokens / --tokens-file\n");
        logits_usage(stderr);
        return 2;
    }
    char *file_text = NULL;
    if (tokens_file) {
        if (st_file_read_all(tokens_file, &file_text, NULL) != STRATA_OK) {
            tool_print_error("logits");
            return 1;
        }
        tokens_arg = file_text;
    }
    int32_t *ids = NULL;
    int64_t n = 0;
    bool ok = parse_tokens(tokens_arg, &ids, &n);
    st_free(file_text);
    if (!ok) return 2;
    if (pos_offset > (int64_t)INT32_MAX - (n - 1)) {
        fprintf(stderr, "strata logits: --pos-offset %lld with %lld tokens puts the last at position %lld, past "
                "2^31 - 1 (RoPE positions are int32)\n", (long long)pos_offset, (long long)n,
                (long long)(pos_offset + n - 1));
        free(ids);
        return 2;
    }

    if (mo.ctx == 0) mo.ctx = n;
    if (chunk > 0 && mo.batch == 0) mo.batch = chunk;
    tool_model tm;
    if (!tool_model_open(model_path, &mo, &tm)) {
        free(ids);
        return 1;
    }
    const int64_t vocab = tm.files->config.vocab_size, trained = tm.files->config.max_position_embeddings;
    if (pos_offset > 0 && pos_offset + n > trained)
        fprintf(stderr, "strata logits: note: RoPE positions %lld .. %lld go past the %lld positions of %s "
                "(max_position_embeddings); RoPE sees only distances, so the logits should equal those at "
                "--pos-offset 0 up to rounding\n", (long long)pos_offset, (long long)(pos_offset + n - 1),
                (long long)trained, model_path);
    float *logits = malloc((size_t)(n * vocab) * sizeof(float));
    int rc = 1;
    if (!logits) {
        fprintf(stderr, "strata logits: out of memory for %lld x %lld logits\n", (long long)n, (long long)vocab);
        goto done;
    }
    int64_t step = chunk > 0 ? chunk : n;
    for (int64_t done = 0; done < n; done += step) {
        int64_t k = n - done < step ? n - done : step;
        if (st_llama_forward_seq_at(tm.model, tm.kv, ids + done, k, done, pos_offset, true, logits + done * vocab) !=
            STRATA_OK) {
            tool_print_error("logits");
            goto done;
        }
    }
    FILE *f = fopen(out_path, "wb");
    if (!f) {
        fprintf(stderr, "strata logits: cannot create %s: %s\n", out_path, strerror(errno));
        goto done;
    }
    size_t w = fwrite(logits, sizeof(float), (size_t)(n * vocab), f);
    if (fclose(f) != 0 || w != (size_t)(n * vocab)) {
        fprintf(stderr, "strata logits: write to %s failed\n", out_path);
        remove(out_path);
        goto done;
    }
    rc = 0;
done:
    free(logits);
    free(ids);
    tool_model_close(&tm);
    return rc;
}

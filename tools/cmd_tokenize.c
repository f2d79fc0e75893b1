/* strata tokenize MODEL TEXT [--special]: token ids of a text, one line. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata.h"

#include "commands.h"

static const char *const usage_text =
    "usage: strata tokenize MODEL TEXT [--special] [--decode]\n"
    "Prints the token ids of TEXT (\"-\" reads standard input) space-separated on one line.\n"
    "MODEL is a Hugging Face directory (tokenizer.json) or a .gguf file.\n"
    "  --special   add BOS/EOS as the tokenizer says and parse special-token strings\n"
    "              such as <|im_start|> (default: neither)\n"
    "  --decode    print the decoded text on a second line (a check of the round trip)\n";

static char *read_stdin(size_t *len) {
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    if (!b) return NULL;
    size_t r;
    while ((r = fread(b + n, 1, cap - 1 - n, stdin)) > 0) { /* room for the NUL */
        n += r;
        if (n == cap - 1) {
            char *nb = realloc(b, cap *= 2);
            if (!nb) {
                free(b);
                return NULL;
            }
            b = nb;
        }
    }
    b[n] = '\0';
    *len = n;
    return b;
}

int cmd_tokenize(int argc, char **argv) {
    const char *path = NULL, *text = NULL;
    bool special = false, decode = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage_text, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--special")) {
            special = true;
        } else if (!strcmp(argv[i], "--decode")) {
            decode = true;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fprintf(stderr, "strata tokenize: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (!path) {
            path = argv[i];
        } else if (!text) {
            text = argv[i];
        } else {
            fprintf(stderr, "strata tokenize: unexpected argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!path || !text) {
        fputs(usage_text, stderr);
        return 2;
    }
    char *owned = NULL;
    size_t len = strlen(text);
    if (!strcmp(text, "-")) {
        owned = read_stdin(&len);
        if (!owned) {
            fprintf(stderr, "strata tokenize: cannot read standard input\n");
            return 1;
        }
        text = owned;
    }
    int rc = 1;
    strata_model *m = NULL;
    int32_t *ids = NULL;
    char *back = NULL;
    size_t n = 0;
    const strata_model_params mp = {.device = "cpu"}; /* the tokenizer alone: no device needed */
    if (strata_model_open(path, &mp, &m) != STRATA_OK) goto fail;
    strata_status st = strata_tokenize_alloc(m, text, special, special, &ids, &n);
    if (st != STRATA_OK) goto fail;
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    if (decode) {
        size_t bl = 0;
        st = strata_detokenize(m, ids, n, NULL, 0, &bl);
        if (st == STRATA_ERR_NOMEM && (back = malloc(bl + 1)))
            st = strata_detokenize(m, ids, n, back, bl + 1, &bl);
        if (st != STRATA_OK) goto fail;
        fwrite(back, 1, bl, stdout);
        printf("\n");
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "strata tokenize: %s\n", strata_last_error());
done:
    free(back);
    free(ids);
    free(owned);
    strata_model_free(m);
    return rc;
}

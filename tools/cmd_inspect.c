/* strata inspect MODEL: configuration and tensor table. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "common.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"

static const char *rope_name(st_rope_scaling s) {
    switch (s) {
    case ST_ROPE_SCALING_NONE: return "none";
    case ST_ROPE_SCALING_LLAMA3: return "llama3";
    case ST_ROPE_SCALING_LINEAR: return "linear";
    }
    return "?";
}

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    bool tensors = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: strata inspect MODEL [--no-tensors]\n"
                   "Prints the architecture, hyper-parameters and the tensor table (dtype, shape, bytes)\n"
                   "of a Hugging Face directory or a .gguf file.\n");
            return 0;
        } else if (!strcmp(argv[i], "--no-tensors")) {
            tensors = false;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "strata inspect: unknown option '%s'\n", argv[i]);
            return 2;
        } else if (!path) {
            path = argv[i];
        } else {
            fprintf(stderr, "strata inspect: unexpected argument '%s'\n", argv[i]);
            return 2;
        }
    }
    if (!path) {
        fprintf(stderr, "usage: strata inspect MODEL [--no-tensors]\n");
        return 2;
    }
    st_model_files *m = NULL;
    if (st_model_open(path, &m) != STRATA_OK) {
        tool_print_error("inspect");
        return 1;
    }
    const st_config *c = &m->config;
    printf("model       %s\n", m->path);
    printf("format      %s (%d file%s)\n", m->format == ST_FORMAT_GGUF ? "gguf" : "safetensors",
           m->n_files, m->n_files == 1 ? "" : "s");
    printf("arch        llama: %lld layers, hidden %lld, ffn %lld, heads %lld (kv %lld), head_dim %lld, vocab %lld\n",
           (long long)c->n_layers, (long long)c->hidden_size, (long long)c->intermediate_size,
           (long long)c->n_heads, (long long)c->n_kv_heads, (long long)c->head_dim,
           (long long)c->vocab_size);
    printf("rope        theta %g, scaling %s", c->rope_theta, rope_name(c->rope_scaling));
    if (c->rope_scaling == ST_ROPE_SCALING_LLAMA3)
        printf(" (factor %g, low %g, high %g, original %lld)", c->rope_factor, c->rope_low_freq_factor,
               c->rope_high_freq_factor, (long long)c->rope_original_max_pos);
    printf(", %s pairs\n", c->rope_interleaved ? "interleaved" : "rotate-half");
    printf("norm eps    %g, max positions %lld, tied embeddings %s\n", c->rms_norm_eps,
           (long long)c->max_position_embeddings, c->tie_word_embeddings ? "yes" : "no");
    printf("tokens      bos %d, eos", c->bos_token_id);
    for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_token_ids[i]);
    printf("\n");
    st_tokenizer *tok = NULL;
    if (st_tokenizer_load(m, &tok) == STRATA_OK) {
        printf("tokenizer   %s, %lld tokens, bos %d, eos %d\n", st_tokenizer_kind(tok),
               (long long)st_tokenizer_vocab_size(tok), st_tokenizer_bos(tok), st_tokenizer_eos(tok));
        const char *tmpl = st_tokenizer_chat_template(tok);
        st_chat_template ct;
        if (!tmpl) {
            printf("chat        no chat template (use --no-chat or --chat-template NAME with strata run)\n");
        } else if (st_chat_detect(tmpl, &ct) == STRATA_OK) {
            printf("chat        template detected: %s\n", st_chat_kind_name(ct.kind));
            st_chat_template_clear(&ct);
        } else {
            printf("chat        template not recognised: %s\n", st_last_error());
        }
        st_tokenizer_free(tok);
    } else {
        printf("tokenizer   none: %s\n", st_last_error());
    }
    uint64_t total = 0;
    for (int64_t i = 0; i < m->n_tensors; i++) total += m->tensors[i].nbytes;
    printf("tensors     %lld, %.3f MB\n", (long long)m->n_tensors, total / 1e6);
    if (tensors) {
        for (int64_t i = 0; i < m->n_tensors; i++) {
            const st_tensor_desc *t = &m->tensors[i];
            char shape[96] = "";
            size_t off = 0;
            for (int d = 0; d < t->n_dims; d++)
                off += (size_t)snprintf(shape + off, sizeof shape - off, "%s%lld", d ? ", " : "",
                                        (long long)t->shape[d]);
            printf("  %-52s %-5s [%s] %llu B\n", t->name, st_dtype_name(t->dtype), shape,
                   (unsigned long long)t->nbytes);
        }
    }
    st_model_close(m);
    return 0;
}

/* Fuzzes a Hugging Face model directory: config.json (st_config_parse_json,
 * src/loader/config.c) and safetensors headers, single-file or sharded with
 * an index (src/loader/safetensors.c), through st_safetensors_open_dir.
 *
 * Input: parts cut at lines "--8<--" (fuzzutil.h):
 *   config.json
 *   model.safetensors                        (two parts), or
 *   model.safetensors.index.json, then the shards a.safetensors, b.safetensors,
 *   c.safetensors, d.safetensors             (three parts or more)
 * Seeds: tests/fuzz/corpus/safetensors/ (tests/fuzz/make_corpus.sh). */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "loader/loader.h"

#define MAX_SHARDS 4
static const char *const g_shards[MAX_SHARDS] = {"a.safetensors", "b.safetensors", "c.safetensors",
                                                 "d.safetensors"};
static volatile uint8_t g_sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_part parts[2 + MAX_SHARDS];
    size_t np = fuzz_split(data, size, parts, 2 + MAX_SHARDS);

    /* config.json alone, from memory */
    char *text = fuzz_strndup(parts[0].p, parts[0].n);
    st_config cfg;
    st_clear_error();
    strata_status st = st_config_parse_json(text, "fuzz/config.json", &cfg);
    fuzz_check_error(st, "fuzz/config.json");
    free(text);

    /* the directory */
    fuzz_remove("model.safetensors");
    fuzz_remove("model.safetensors.index.json");
    for (int k = 0; k < MAX_SHARDS; k++) fuzz_remove(g_shards[k]);
    fuzz_write("config.json", parts[0].p, parts[0].n);
    if (np == 2) fuzz_write("model.safetensors", parts[1].p, parts[1].n);
    if (np >= 3) fuzz_write("model.safetensors.index.json", parts[1].p, parts[1].n);
    for (size_t k = 2; k < np; k++) fuzz_write(g_shards[k - 2], parts[k].p, parts[k].n);

    st_model_files *m = NULL;
    st_clear_error();
    st = st_safetensors_open_dir(fuzz_dir(), &m);
    if (st != STRATA_OK) {
        FUZZ_CHECK(m == NULL, "a failed open returned a model");
        fuzz_check_error(st, fuzz_dir());
        return 0;
    }
    FUZZ_CHECK(np >= 2, "opened a directory without weights");
    for (int64_t i = 0; i < m->n_tensors; i++) {
        const st_tensor_desc *t = &m->tensors[i];
        FUZZ_CHECK(t->file >= 0 && t->file < m->n_files, "tensor '%s' in file %d of %d", t->name, t->file,
                   m->n_files);
        const uint64_t fsize = m->files[t->file].size;
        FUZZ_CHECK(t->offset <= fsize && t->nbytes <= fsize - t->offset,
                   "tensor '%s' [%llu, +%llu) outside its file of %llu bytes", t->name,
                   (unsigned long long)t->offset, (unsigned long long)t->nbytes, (unsigned long long)fsize);
        if (t->nbytes) {
            const uint8_t *p = st_tensor_data(m, t);
            g_sink ^= p[0] ^ p[t->nbytes - 1];
        }
        FUZZ_CHECK(st_model_find(m, t->name) != NULL, "tensor '%s' not found by name", t->name);
    }
    st_sampling_defaults sd;
    (void)st_sampling_defaults_read(m, &sd); /* no generation_config.json: nothing */
    st_model_close(m);
    return 0;
}

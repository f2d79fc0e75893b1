/* Weights are used from the file mapping, never expanded: after a forward pass
 * that touches every weight, the process's resident memory grows by about the
 * file size (mapped pages) plus the backend's own allocations (KV cache and
 * activations, measured by its budget) — not by an fp32 copy (2x a bf16 file). */
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "loader/loader.h"
#include "model/llama.h"
#include "testutil.h"

enum { VOCAB = 16384, HID = 512, HEADS = 8, KV = 2, HD = 64, INTER = 1536, LAYERS = 4 };

static long rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kb = strtol(line + 6, NULL, 10);
    fclose(f);
    return kb;
}

typedef struct { char name[96]; int64_t rows, cols; } tdef;

static uint32_t g_rng = 12345;
static float frand(void) { /* uniform in [-1, 1) */
    g_rng = g_rng * 1664525u + 1013904223u;
    return (float)((g_rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Writes a bf16 Llama model (config.json + model.safetensors); returns the
 * safetensors file size or 0. */
static uint64_t write_model(const char *dir) {
    tdef defs[4 + 9 * LAYERS];
    int nd = 0;
#define ADD(n, r, c) do { snprintf(defs[nd].name, sizeof defs[nd].name, "%s", n); \
        defs[nd].rows = r; defs[nd].cols = c; nd++; } while (0)
    ADD("model.embed_tokens.weight", VOCAB, HID);
    ADD("model.norm.weight", 1, HID);
    ADD("lm_head.weight", VOCAB, HID);
    for (int l = 0; l < LAYERS; l++) {
        char n[96];
#define ADDL(s, r, c) do { snprintf(n, sizeof n, "model.layers.%d.%s", l, s); ADD(n, r, c); } while (0)
        ADDL("input_layernorm.weight", 1, HID);
        ADDL("self_attn.q_proj.weight", HEADS * HD, HID);
        ADDL("self_attn.k_proj.weight", KV * HD, HID);
        ADDL("self_attn.v_proj.weight", KV * HD, HID);
        ADDL("self_attn.o_proj.weight", HID, HEADS * HD);
        ADDL("post_attention_layernorm.weight", 1, HID);
        ADDL("mlp.gate_proj.weight", INTER, HID);
        ADDL("mlp.up_proj.weight", INTER, HID);
        ADDL("mlp.down_proj.weight", HID, INTER);
    }
    size_t hcap = 64 * 1024, hl = 0;
    char *hdr = malloc(hcap);
    uint64_t off = 0;
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "{");
    for (int i = 0; i < nd; i++) {
        uint64_t nb = (uint64_t)(defs[i].rows * defs[i].cols) * 2;
        if (defs[i].rows == 1)
            hl += (size_t)snprintf(hdr + hl, hcap - hl, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld],\"data_offsets\":[%llu,%llu]}",
                                   i ? "," : "", defs[i].name, (long long)defs[i].cols,
                                   (unsigned long long)off, (unsigned long long)(off + nb));
        else
            hl += (size_t)snprintf(hdr + hl, hcap - hl, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld,%lld],\"data_offsets\":[%llu,%llu]}",
                                   i ? "," : "", defs[i].name, (long long)defs[i].rows, (long long)defs[i].cols,
                                   (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    hl += (size_t)snprintf(hdr + hl, hcap - hl, "}");
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    if (!f) { free(hdr); return 0; }
    uint64_t hlen = hl;
    fwrite(&hlen, 8, 1, f);
    fwrite(hdr, 1, hl, f);
    free(hdr);
    uint16_t *buf = malloc((size_t)INTER * HID * 2 + (size_t)VOCAB * HID * 2);
    for (int i = 0; i < nd; i++) {
        int64_t n = defs[i].rows * defs[i].cols;
        for (int64_t j = 0; j < n; j++)
            buf[j] = st_f32_to_bf16(defs[i].rows == 1 ? 1.0f : 0.05f * frand());
        fwrite(buf, 2, (size_t)n, f);
    }
    free(buf);
    if (fclose(f) != 0) return 0;
    snprintf(path, sizeof path, "%s/config.json", dir);
    char cfg[1024];
    int cl = snprintf(cfg, sizeof cfg,
                      "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":%d,"
                      "\"hidden_size\":%d,\"intermediate_size\":%d,\"num_hidden_layers\":%d,"
                      "\"num_attention_heads\":%d,\"num_key_value_heads\":%d,\"head_dim\":%d,"
                      "\"rms_norm_eps\":1e-5,\"rope_theta\":10000.0,\"max_position_embeddings\":64,"
                      "\"tie_word_embeddings\":false,\"bos_token_id\":1,\"eos_token_id\":2}",
                      VOCAB, HID, INTER, LAYERS, HEADS, KV, HD);
    if (!test_write_file(path, cfg, (size_t)cl)) return 0;
    return 8 + hlen + off;
}

int main(void) {
    const char *dir = test_tmpdir("resident");
    uint64_t fsize = write_model(dir);
    CHECK(fsize > 50u << 20);
    long before = rss_kb();
    st_model_files *m = NULL;
    strata_status st = st_model_open(dir, &m);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (st != STRATA_OK) return test_finish("test_resident_mem");
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 2};
    CHECK(st_backend_init(&bp, &be) == STRATA_OK);
    st_llama *model = NULL;
    st_kv_pool *kv = NULL;
    st_llama_params lp = {.max_seq_len = 16, .max_tokens = 8};
    st = test_llama_open(m, be, &lp, ST_KV_BF16, &model, &kv);
    CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
    if (st == STRATA_OK) {
        int32_t toks[8] = {1, 100, 2000, 3000, 4000, 5000, 6000, 16383};
        float *logits = malloc((size_t)8 * VOCAB * sizeof(float));
        st = st_llama_forward_seq(model, kv, toks, 8, 0, true, logits);
        CHECK_MSG(st == STRATA_OK, "%s", st_last_error());
        bool finite = true;
        for (int64_t i = 0; i < 8 * VOCAB; i++) finite = finite && logits[i] == logits[i];
        CHECK(finite);
        long after = rss_kb();
        double growth = (double)(after - before) * 1024.0;
        double backend = (double)be->device_budget.peak;
        double logits_b = 8.0 * VOCAB * sizeof(float);
        double bound = 1.10 * (double)fsize + backend + logits_b + (8 << 20);
        printf("file %.1f MB, RSS growth %.1f MB, backend allocations %.1f MB, bound %.1f MB "
               "(an fp32 copy of the weights would add %.1f MB)\n",
               fsize / 1e6, growth / 1e6, backend / 1e6, bound / 1e6, 2.0 * fsize / 1e6);
#if defined(__SANITIZE_ADDRESS__)
        /* ASan's shadow and quarantine make RSS meaningless; the normal build checks it. */
        printf("AddressSanitizer build: RSS bound not asserted\n");
#else
        CHECK_MSG(growth < bound, "RSS grew %.1f MB, bound %.1f MB", growth / 1e6, bound / 1e6);
        CHECK_MSG(growth > 0.5 * (double)fsize, "RSS grew only %.1f MB: were the weights read?", growth / 1e6);
#endif
        free(logits);
    }
    test_llama_close(model, kv);
    st_backend_free(be);
    st_model_close(m);
    return test_finish("test_resident_mem");
}

/* strata plan MODEL --device-mem SIZE --host-mem SIZE: where each weight group
 * would live (device, pinned host, SSD, or host memory computed by the CPU:
 * hybrid), what each tier holds, and the
 * decode step and prefill times the plan predicts from bandwidths measured
 * now (or given), with the bound that limits each. Loads nothing but the
 * model's metadata and the probes' buffers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "common.h"
#include "engine/runner.h"
#include "kv/kv_stream.h"
#include "kv/kv_tiers.h"

static void plan_usage(FILE *f) {
    fprintf(f,
            "usage: strata plan MODEL [--device-mem SIZE] [--host-mem SIZE] [--prompt N] [--groups] [options]\n"
            "Prints the weight placement for these budgets (bytes and groups per tier: device, host,\n"
            "ssd, and cpu: FFN groups kept in host memory and computed by the CPU in decode steps,\n"
            "see --cpu-layers), the predicted decode time per token and prefill time, and the bound\n"
            "limiting each.\n\n"
            "  --prompt N   prompt length of the prefill prediction (default 2048)\n"
            "  --groups     also list every group with its tier\n" TOOL_MODEL_OPTS_HELP TOOL_KV_TIER_OPTS_HELP TOOL_KV_STREAM_OPT_HELP);
}

static const char *bw_src(const st_wbw *bw, int i) { return bw->measured[i] ? "measured" : "given"; }

int cmd_plan(int argc, char **argv) {
    tool_model_opts mo = TOOL_ENGINE_OPTS_INIT;
    const char *path = NULL;
    int64_t prompt = 0;
    bool list = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        int r = tool_parse_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 2;
        if (r > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            plan_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--prompt")) {
            if (!tool_parse_i64(val, 1, 1 << 24, "--prompt", &prompt)) return 2;
            i++;
        } else if (!strcmp(a, "--groups")) {
            list = true;
        } else if (!tool_take_positional("plan", a, &path, plan_usage)) {
            return 2;
        }
    }
    if (!path) {
        plan_usage(stderr);
        return 2;
    }
    /* a streamed sequence's host share above what the machine has: refused as run and serve refuse it
     * (the weights' --host-mem is planned as given, for budgets of other machines) */
    const strata_model_params mp = {.kv_stream_mem = mo.kv_stream_mem};
    if (strata_check_memory(&mp) != STRATA_OK) {
        tool_print_error("plan");
        return 1;
    }
    st_model_files *files = NULL;
    if (st_model_open(path, &files) != STRATA_OK) {
        tool_print_error("plan");
        return 1;
    }
    st_backend_params bp = tool_backend_params(&mo);
    st_backend *be = NULL;
    if (st_backend_init(&bp, &be) != STRATA_OK) {
        tool_print_error("plan");
        st_model_close(files);
        return 1;
    }
    st_llama_params lp = tool_llama_params(&mo, files);
    lp.weights.prefill_tokens = prompt;
    st_wgroups *g = NULL;
    st_wplan p;
    if (st_llama_plan(files, be, &lp, &g, &p) != STRATA_OK) {
        tool_print_error("plan");
        st_backend_free(be);
        st_model_close(files);
        return 1;
    }
    char b[12][32];
#define B(i, x) st_fmt_bytes((double)(x), b[i], sizeof b[i])
    const st_config *c = &files->config;
    printf("model      %s: %lld layers, %d groups, %s of weights (%llu bytes)%s\n", files->path,
           (long long)c->n_layers, g->n, B(0, g->model_bytes), (unsigned long long)g->model_bytes,
           g->tied ? ", tied embeddings" : "");
    if (p.device_mem)
        printf("device     %s budget %s: KV cache %s + activations %s + backend reserve %s + ring %d x %s"
               " + embedding rows %s + resident weights %s = %s\n",
               be->ops->name, B(0, p.device_mem), B(1, p.device_kv), B(2, p.device_act), B(3, p.device_reserve),
               p.ring_slots, B(4, p.slot_bytes), B(5, p.device_embed_rows), B(6, p.device_resident),
               B(7, p.device_need));
    else
        printf("device     %s, no budget (--device-mem): every weight resident, %s in all\n", be->ops->name,
               B(0, p.device_need));
    printf("host       budget %s%s (pinned): staging %d x %s + embedding rows %s + host tier %s = %s"
           " (of the host tier, the cpu tier: %s)\n",
           B(0, p.host_mem), mo.host_mem ? "" : " (80% of available memory)", p.staging_chunks,
           B(1, p.staging_chunk), B(2, p.host_embed_rows), B(3, p.host_tier), B(4, p.host_need), B(5, p.host_cpu));
    printf("minimum    device %s (%zu bytes), host %s (%zu bytes)\n", B(0, p.device_min), p.device_min,
           B(1, p.host_min), p.host_min);
    printf("bandwidth  H2D %.2f GB/s (%s), SSD %.2f GB/s (%s%s), matmul weight read %.2f GB/s (%s), "
           "%.1f GFLOP/s (%s)\n",
           p.bw.h2d / 1e9, bw_src(&p.bw, 0), p.bw.ssd / 1e9, bw_src(&p.bw, 1),
           p.bw.measured[1] ? (p.bw.ssd_direct ? ", O_DIRECT" : ", page cache") : "", p.bw.dev_read / 1e9,
           bw_src(&p.bw, 2), p.bw.gemm / 1e9, bw_src(&p.bw, 3));
    if (p.bw.cpu > 0) {
        printf("cpu        matmul weight read from host memory %.2f GB/s (%s, %d threads, passes of %lld token%s%s)\n",
               p.bw.cpu / 1e9, bw_src(&p.bw, 4), mo.threads, (long long)p.pass_tokens, p.pass_tokens > 1 ? "s" : "",
               p.pass_tokens > 1 ? ": --cpu-pass-tokens, the split and the figures below are for such passes" : "");
        if (p.bw.h2d_shared > 0 && p.bw.cpu_shared > 0)
            printf("shared     both reading host memory at once: H2D %.2f GB/s + CPU %.2f GB/s = %.2f GB/s (%s)\n",
                   p.bw.h2d_shared / 1e9, p.bw.cpu_shared / 1e9, (p.bw.h2d_shared + p.bw.cpu_shared) / 1e9,
                   bw_src(&p.bw, 5));
    }
    else
        printf("cpu        no cpu tier (%s)\n",
               be->kind == ST_BACKEND_CPU ? "the CPU backend: every group runs on the CPU already"
               : mo.cpu_layers < 0       ? "--cpu-layers 0"
               : !p.device_mem           ? "no --device-mem: every weight resident"
                                         : "the CPU's rate is unknown");
    printf("tier       groups  embed  attn   ffn  output  bytes\n");
    uint64_t total = 0;
    int groups = 0;
    for (int t = 0; t < ST_TIER_COUNT; t++) {
        printf("  %-8s %6d %6d %5d %5d %7d  %llu (%s)\n", st_tier_name((st_tier)t), p.groups[t],
               p.kind_groups[t][ST_WG_EMBED], p.kind_groups[t][ST_WG_ATTN], p.kind_groups[t][ST_WG_FFN],
               p.kind_groups[t][ST_WG_OUTPUT], (unsigned long long)p.bytes[t], B(0, p.bytes[t]));
        total += p.bytes[t];
        groups += p.groups[t];
    }
    printf("  %-8s %6d %34s %llu (%s)\n", "total", groups, "", (unsigned long long)total, B(0, total));
    if (p.split_rows > 0)
        printf("cpu split  each cpu-tier FFN group in decode: the device computes %lld of its intermediate rows "
               "from a streamed copy (%s per token over PCIe, in the figures below) while the CPU computes the "
               "rest in place, both at once\n",
               (long long)p.split_rows, B(0, p.step_split_bytes));
    else if (p.groups[ST_TIER_CPU] > 0)
        printf("cpu split  none: the CPU computes each cpu-tier FFN group whole in decode, the device waiting%s\n",
               mo.cpu_split < 0 ? " (--cpu-split 0)" : "");
    if (p.embed_gather)
        printf("embedding  rows gathered from the file mapping per step (%s per token)\n",
               B(0, g->embed_row_bytes));
    printf("decode     %.3f ms/token predicted, bound: %s (SSD read %.3f ms, PCIe %.3f ms, device compute %.3f ms,"
           " CPU compute %.3f ms; max(SSD, PCIe, device + CPU): full overlap; no overlap at all: %.3f ms)\n",
           p.t_decode * 1e3, st_wbound_name(p.decode_bound), p.t_ssd * 1e3, p.t_pcie * 1e3, p.t_compute * 1e3,
           p.t_cpu * 1e3, p.t_decode_serial * 1e3);
    if (p.t_step > 0)
        printf("simulated  %.3f ms/token: the step group by group, the ring %d slots ahead, the device waiting while"
               " the CPU computes its groups%s\n", p.t_step * 1e3, p.ring_slots,
               p.bw.cpu > 0 && mo.cpu_layers >= 0 ? " (what placements were compared by)" : "");
    if (p.t_host > 0)
        printf("host mem   PCIe and CPU share host memory: their times above are at the shared rates until the first"
               " is done; together they need at least %.3f ms/token\n", p.t_host * 1e3);
    printf("split      per token: %s over PCIe (%.3f ms), %s read by the CPU (%.3f ms), %s read by the device"
           " in place\n",
           B(0, p.step_ssd_bytes + p.step_host_bytes), p.t_pcie * 1e3, B(1, p.step_cpu_bytes), p.t_cpu * 1e3,
           B(2, p.step_read_bytes - p.step_cpu_bytes - p.step_ssd_bytes - p.step_host_bytes));
    printf("per token  %llu bytes read from SSD (%s), %llu bytes over PCIe (%s; host tier %s)\n",
           (unsigned long long)p.step_ssd_img_bytes, B(0, p.step_ssd_img_bytes),
           (unsigned long long)(p.step_ssd_bytes + p.step_host_bytes), B(1, p.step_ssd_bytes + p.step_host_bytes),
           B(2, p.step_host_bytes));
    printf("prefill    %lld tokens: %.3f s predicted (%lld chunks of %lld), bound: %s (streaming %.3f s, "
           "compute %.3f s)\n",
           (long long)p.prefill_tokens, p.t_prefill,
           (long long)((p.prefill_tokens + p.prefill_chunk - 1) / p.prefill_chunk), (long long)p.prefill_chunk,
           st_wbound_name(p.prefill_bound), p.t_prefill_stream, p.t_prefill_compute);
    {   /* the KV cache's tiers, as run and serve would make them with these options */
        st_engine_params ep = {.kv_dtype = mo.kv_dtype, .kv_host_mem = mo.kv_host_mem,
                               .kv_ssd_dir = mo.kv_ssd_dir, .kv_ssd_size = mo.kv_ssd_size};
        if (st_engine_params_resolve(&ep, c) != STRATA_OK) {
            tool_print_error("plan");
        } else {
            const double tok = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, mo.kv_dtype);
            const st_kv_pool_params kp = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                                          .num_blocks = 1, .block_size = ep.kv_block_size, .dtype = mo.kv_dtype,
                                          .max_tokens = 1, .max_seq_len = 1};
            const double blk = (double)st_kv_tiers_block_bytes(&kp);
            const int64_t host_blocks = ep.kv_host_mem > 0 ? (int64_t)((double)ep.kv_host_mem / blk) : 0;
            const int64_t ssd_blocks = ep.kv_ssd_dir ? (int64_t)((double)ep.kv_ssd_size / (blk + 4096.0)) : 0;
            printf("kv cache   %s per token (%s), blocks of %lld tokens: device %s (%.0f tokens); host tier ",
                   B(0, tok), st_kv_dtype_name(mo.kv_dtype), (long long)ep.kv_block_size, B(1, p.device_kv),
                   (double)p.device_kv / tok);
            if (host_blocks)
                printf("%s (%lld tokens%s); ", B(2, host_blocks * blk), (long long)(host_blocks * ep.kv_block_size),
                       mo.kv_host_mem ? "" : ", 1/8 of available memory");
            else
                printf("off; ");
            if (ssd_blocks)
                printf("SSD tier %s in %s (%lld tokens, fewer if the disk has less room)\n",
                       B(3, ssd_blocks * (blk + 4096.0)), ep.kv_ssd_dir, (long long)(ssd_blocks * ep.kv_block_size));
            else
                printf("SSD tier off (--kv-ssd-dir)\n");
            /* where one sequence of --ctx tokens keeps its KV */
            const int64_t ctx = mo.ctx > 0 ? mo.ctx : 4096;
            const double need = (double)ctx * tok;
            if (!tool_kv_streamed(&mo, c)) {
                printf("context    %lld tokens: KV %s, in the device pool\n", (long long)ctx, B(0, need));
            } else {
                const st_kv_stream_params sp = tool_stream_params(&mo, c); /* --kv-stream-mem as run / serve */
                /* whole segments on the host up to its cap, the rest (with --kv-ssd-dir) in the SSD file */
                const size_t set = st_kv_stream_host_bytes(&sp, 1), all = st_kv_stream_host_bytes(&sp, ctx);
                const size_t host_cap = sp.host_mem ? sp.host_mem / set * set : all;
                const size_t host = all < host_cap ? all : host_cap, ssd = sp.ssd_dir ? all - host : 0;
                printf("context    %lld tokens: KV %s, over half the device budget: streamed from host memory "
                       "(%s pinned, layer by layer through a device ring of %s, counted above as the KV cache; "
                       "bench, and run / serve with --kv-stream)",
                       (long long)ctx, B(0, need), B(1, (double)host), B(2, (double)st_kv_stream_device_bytes(&sp)));
                if (ssd)
                    printf("; %s in segments of %lld tokens past the host's %s go to the SSD tier in %s%s",
                           B(3, (double)ssd), (long long)(sp.seg ? sp.seg : ST_KV_STREAM_SEG), B(0, (double)host_cap),
                           sp.ssd_dir,
                           sp.ssd_mem && ssd > sp.ssd_mem ? ", MORE than --kv-ssd-size" : "");
                else if (all > host)
                    printf("; MORE than the host holds (%s: --kv-stream-mem%s; --kv-ssd-dir would take the rest)",
                           B(3, (double)host_cap), mo.kv_stream_mem ? "" : ", 3/4 of the memory available now");
                printf("\n");
            }
        }
    }
    if (list) {
        printf("groups\n");
        for (int i = 0; i < g->n; i++)
            printf("  %-10s %-6s %12llu bytes, image %llu\n", g->g[i].name, st_tier_name(p.tier[i]),
                   (unsigned long long)g->g[i].bytes, (unsigned long long)g->g[i].img_bytes);
    }
#undef B
    st_wplan_free(&p);
    st_wgroups_free(g);
    st_backend_free(be);
    st_model_close(files);
    return 0;
}

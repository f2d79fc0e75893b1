/* strata bench-kv MODEL: the KV tiers (kv/kv_tiers.h) measured.
 *
 * 1. Time to first token of one long prompt (--prompt, default 32768 tokens)
 *    computed cold, then with its prefix cached in the device tier, the host
 *    tier (device cache emptied) and the SSD tier (host copies dropped too),
 *    each beside its floor measured in the same run: prefix KV bytes / the
 *    pinned host -> device bandwidth (host), / the SSD's O_DIRECT read
 *    bandwidth plus the host -> device copy (SSD). The outputs of every run
 *    are compared with the cold run's (same first token).
 * 2. With --serve: a closed-loop serving run over a working set of shared
 *    prefixes larger than the device pool (--prefixes x --prefix-len tokens,
 *    each request a random prefix + a fresh suffix, --concurrency at once),
 *    with the tiers on and off: throughput and TTFT percentiles.
 * Uses the engine internals (runner) on purpose: no tokenizer needed. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "commands.h"
#include "common.h"
#include "engine/runner.h"
#include "roofline.h"
#include "kv/kv_tiers.h"
#include "core/aio.h"
#include <xxhash.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: strata bench-kv MODEL --kv-ssd-dir DIR [--prompt N] [--serve] [options]\n"
            "Times the first token of a long prompt computed, and with its prefix in the device, host\n"
            "and SSD tiers of the KV cache, each beside its floor measured in the same run.\n\n"
            "  --prompt N        prompt tokens (default 32768)\n"
            "  --chunk N         prefill chunk (default 2048)\n"
            "  --serve           also a serving run with a working set of shared prefixes 4x the device\n"
            "                    pool, tiers on and off\n"
            "  --prefix-len N    tokens of each shared prefix (default 2048)\n"
            "  --requests N      requests of the serving run (default 256)\n"
            "  --concurrency N   requests at once (default 16)\n" TOOL_MODEL_OPTS_HELP TOOL_KV_TIER_OPTS_HELP);
}

typedef struct {
    double t_add, t_first;
    int32_t first;
    bool done;
    uint64_t logits_hash; /* of the first sampled position's logits row (the long-prompt runs) */
} req_t;

static void on_logits(void *user, uint64_t id, int64_t pos, const float *logits, int64_t n) {
    (void)pos;
    req_t *r = &((req_t *)user)[id];
    if (!r->logits_hash) r->logits_hash = XXH3_64bits(logits, (size_t)n * sizeof *logits) | 1;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One step; records each request's first-token time and counts the tokens
 * sampled (*n_tok, may be NULL). */
static bool step(st_runner *rn, req_t *rq, int64_t *n_tok) {
    st_runner_step_info si;
    if (st_runner_step(rn, &si) != STRATA_OK) {
        tool_print_error("bench-kv");
        return false;
    }
    const double now = st_time_now();
    for (int64_t k = 0; k < si.n_events; k++) {
        const st_runner_event *e = &si.events[k];
        req_t *r = &rq[e->seq->id];
        if (!r->t_first) {
            r->t_first = now;
            r->first = e->token;
        }
        if (n_tok) (*n_tok)++;
        if (e->finished) {
            r->done = true;
            st_seq_free(e->seq);
        }
    }
    return true;
}

/* Runs to completion. */
static bool drain(st_runner *rn, req_t *rq) {
    while (st_runner_has_work(rn))
        if (!step(rn, rq, NULL)) return false;
    return true;
}

static bool add(st_runner *rn, uint64_t id, const int32_t *p, int64_t n, int64_t max_tokens, req_t *rq) {
    st_sampler_params sp = st_sampler_params_default();
    sp.temperature = 0;
    const st_request r = {.prompt = p, .n_prompt = n, .sampler = sp, .max_tokens = max_tokens};
    const st_seq_limits lim = st_runner_limits(rn, NULL);
    st_seq *q = NULL;
    if (st_seq_create(&r, &lim, &(st_seq_callbacks){0}, id, &q) != STRATA_OK || st_runner_add(rn, q) != STRATA_OK) {
        st_seq_free(q);
        tool_print_error("bench-kv");
        return false;
    }
    rq[id] = (req_t){.t_add = st_time_now()};
    return true;
}


/* O_DIRECT read bandwidth of `path`'s first `bytes`: 8 MiB requests, 8 in
 * flight through core/aio (io_uring), the page cache dropped first. */
static double ssd_bw(const char *path, uint64_t bytes) {
    int fd = open(path, O_RDONLY | O_DIRECT);
    if (fd < 0) return 0;
    enum { DEPTH = 8 };
    const size_t chunk = (size_t)8 << 20;
    void *buf[DEPTH] = {0};
    st_aio *q = NULL;
    double bw = 0;
    for (int i = 0; i < DEPTH; i++)
        if (posix_memalign(&buf[i], 4096, chunk)) goto out;
    if (st_aio_init(DEPTH, false, "bench-kv", &q) != STRATA_OK) goto out;
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    bytes = bytes / chunk * chunk;
    uint64_t next = 0, done = 0;
    const double t0 = st_time_now();
    while (done < bytes) {
        while (next < bytes && st_aio_inflight(q) < DEPTH) {
            const st_aio_req r = {.fd = fd, .name = path, .direct = true, .off = next, .len = chunk, .need = chunk,
                                  .buf = buf[(next / chunk) % DEPTH], .tag = next};
            if (st_aio_submit(q, &r) != STRATA_OK) goto out;
            next += chunk;
        }
        bool got = false;
        st_aio_result res;
        if (st_aio_reap(q, true, &got, &res) != STRATA_OK || !got) goto out;
        done += res.done;
    }
    bw = (double)done / (st_time_now() - t0);
out:
    st_aio_free(q);
    for (int i = 0; i < DEPTH; i++) free(buf[i]);
    close(fd);
    return bw;
}

int cmd_bench_kv(int argc, char **argv) {
    tool_model_opts mo = TOOL_ENGINE_OPTS_INIT;
    const char *path = NULL;
    int64_t prompt = 32768, chunk = 2048, prefix_len = 2048, n_req = 256, conc = 16;
    bool serve = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        const int r = tool_parse_model_opt(argc, argv, &i, &mo);
        if (r < 0) return 2;
        if (r > 0 && (!strcmp(a, "--kv-stream") || !strcmp(a, "--kv-stream-mem") || !strcmp(a, "--kv-segment") ||
                      !strcmp(a, "--kv-cpu-attn"))) {
            fprintf(stderr, "strata bench-kv: %s is an option of run, serve, plan and bench (the tiers' "
                            "benchmark runs prompts that fit the device pool)\n", a);
            return 2;
        }
        if (r > 0) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--prompt")) {
            if (!tool_parse_i64(val, 32, 1 << 22, a, &prompt)) return 2;
            i++;
        } else if (!strcmp(a, "--chunk")) {
            if (!tool_parse_i64(val, 16, 1 << 16, a, &chunk)) return 2;
            i++;
        } else if (!strcmp(a, "--prefix-len")) {
            if (!tool_parse_i64(val, 32, 1 << 20, a, &prefix_len)) return 2;
            i++;
        } else if (!strcmp(a, "--requests")) {
            if (!tool_parse_i64(val, 1, 1 << 20, a, &n_req)) return 2;
            i++;
        } else if (!strcmp(a, "--concurrency")) {
            if (!tool_parse_i64(val, 1, 4096, a, &conc)) return 2;
            i++;
        } else if (!strcmp(a, "--serve")) {
            serve = true;
        } else if (!tool_take_positional("bench-kv", a, &path, usage)) {
            return 2;
        }
    }
    if (!path || !mo.kv_ssd_dir) {
        fprintf(stderr, "strata bench-kv: %s\n", path ? "--kv-ssd-dir DIR is required" : "no MODEL given");
        usage(stderr);
        return 2;
    }
    st_model_files *files = NULL;
    st_backend *be = NULL;
    int rc = 1;
    int32_t *tok = NULL;
    req_t *rq = NULL;
    st_runner *rn = NULL;
    if (st_model_open(path, &files) != STRATA_OK) {
        tool_print_error("bench-kv");
        return 1;
    }
    const st_backend_params bp = tool_backend_params(&mo);
    if (st_backend_init(&bp, &be) != STRATA_OK) {
        tool_print_error("bench-kv");
        goto out;
    }
    be->ops->set_fast_prefill(be, tool_fast_prefill(&mo, files));
    const st_config *c = &files->config;
    const double tok_bytes = st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, mo.kv_dtype);
    const int64_t bs = 16, V = c->vocab_size;
    const int64_t hit = (prompt - 1) / bs * bs;
    const double hit_bytes = (double)hit * tok_bytes;
    const double bw_h2d = tool_measure_h2d_bw(be, 0, 0);
    const size_t plane_row = (size_t)bs * (size_t)(c->n_kv_heads * c->head_dim) * st_kv_dtype_size(mo.kv_dtype);
    size_t blk_bytes = 0;
    {
        const st_kv_pool_params kp = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                                      .num_blocks = 1, .block_size = bs, .dtype = mo.kv_dtype, .max_tokens = 1,
                                      .max_seq_len = 1};
        blk_bytes = st_kv_tiers_block_bytes(&kp);
    }
    const double bw_h2d_2d = tool_measure_h2d_bw(be, plane_row, blk_bytes);
    uint64_t rng = 0x2545F4914F6CDD1Dull;
    tok = malloc((size_t)prompt * sizeof *tok);
    rq = calloc((size_t)n_req + 64, sizeof *rq);
    if (!tok || !rq) goto out;
    for (int64_t i = 0; i < prompt; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        tok[i] = (int32_t)(rng % (uint64_t)V);
    }
    {
        st_engine_params ep = {.max_batch = 4, .max_model_len = prompt + 16, .prefill_chunk = chunk,
                               .kv_dtype = mo.kv_dtype, .kv_blocks = (prompt + 16) / bs + 8,
                               .device_mem = mo.device_mem,
                               .kv_host_mem = mo.kv_host_mem ? mo.kv_host_mem : (int64_t)(hit_bytes * 1.5) + (64 << 20),
                               .kv_offload = mo.kv_offload_lazy ? ST_KV_OFFLOAD_LAZY : ST_KV_OFFLOAD_EAGER,
                               .kv_ssd_dir = mo.kv_ssd_dir,
                               .kv_ssd_size = mo.kv_ssd_size ? mo.kv_ssd_size : (uint64_t)(hit_bytes * 1.5) + (64 << 20),
                               .on_logits = on_logits, .hook_user = rq};
        /* what the tiers cost a cold prefill (the eager copies down): the same prompt without them */
        double ttft_off = 0;
        {
            st_engine_params off = ep;
            off.kv_host_mem = ST_KV_HOST_OFF;
            off.kv_ssd_dir = NULL;
            if (st_runner_init(files, be, &off, &rn) != STRATA_OK) {
                tool_print_error("bench-kv");
                goto out;
            }
            if (!add(rn, 0, tok + prompt - 64, 64, 1, rq) || !drain(rn, rq)) goto out;
            if (!add(rn, 1, tok, prompt, 1, rq) || !drain(rn, rq)) goto out;
            ttft_off = rq[1].t_first - rq[1].t_add;
            st_runner_free(rn);
            rn = NULL;
        }
        if (st_runner_init(files, be, &ep, &rn) != STRATA_OK) {
            tool_print_error("bench-kv");
            goto out;
        }
        st_kv_tiers *t = st_runner_tiers(rn);
        fprintf(stderr, "bench-kv: %lld-token prompt, %s KV (%.1f KB/token): prefix of %lld tokens = %.2f GB\n",
                (long long)prompt, st_kv_dtype_name(mo.kv_dtype), tok_bytes / 1e3, (long long)hit, hit_bytes / 1e9);
        /* warm-up (graphs, scratch): a short prompt */
        if (!add(rn, 0, tok + prompt - 64, 64, 1, rq) || !drain(rn, rq)) goto out;
        /* k = 4: the host tier again (the SSD run left the blocks there): repeatable? */
        const char *what[5] = {"computed (cold)", "device-tier hit", "host-tier hit", "SSD-tier hit", "host-tier again"};
        double ttft[5] = {0}, fwd[5] = {0};
        int32_t first[5] = {0};
        uint64_t lh[5] = {0};
        for (int k = 0; k < 5; k++) {
            if (k == 2 || k == 4) st_runner_clear_device_cache(rn);
            if (k == 3) {
                st_kv_tiers_drop_host(t, true);
                st_runner_clear_device_cache(rn);
            }
            if (k == 1 && st_kv_tiers_drain(t) != STRATA_OK) goto out; /* the SSD copies written */
            st_kv_tiers_stats s0;
            st_kv_tiers_get_stats(t, &s0);
            st_runner_stats r0, r1;
            st_runner_get_stats(rn, &r0);
            if (!add(rn, 1 + (uint64_t)k, tok, prompt, 1, rq) || !drain(rn, rq)) goto out;
            ttft[k] = rq[1 + k].t_first - rq[1 + k].t_add;
            first[k] = rq[1 + k].first;
            lh[k] = rq[1 + k].logits_hash;
            st_kv_tiers_stats s1;
            st_kv_tiers_get_stats(t, &s1);
            st_runner_get_stats(rn, &r1);
            fwd[k] = r1.forward_s - r0.forward_s;
            if ((k == 2 || k == 4) && s1.hit_tokens_host - s0.hit_tokens_host != hit)
                fprintf(stderr, "bench-kv: WARNING: host-tier hit of %lld tokens, wanted %lld\n",
                        (long long)(s1.hit_tokens_host - s0.hit_tokens_host), (long long)hit);
            if (k == 3 && s1.hit_tokens_ssd - s0.hit_tokens_ssd != hit)
                fprintf(stderr, "bench-kv: WARNING: SSD-tier hit of %lld tokens, wanted %lld\n",
                        (long long)(s1.hit_tokens_ssd - s0.hit_tokens_ssd), (long long)hit);
            if (k >= 2)
                printf("  %s: %lld copies up (%.2f MB each on average)\n", what[k],
                       (long long)(s1.copies_h2d - s0.copies_h2d),
                       (double)(s1.bytes_h2d - s0.bytes_h2d) / 1e6 / (double)(s1.copies_h2d - s0.copies_h2d + !(s1.copies_h2d - s0.copies_h2d)));
        }
        st_kv_tiers_stats s;
        st_kv_tiers_get_stats(t, &s);
        /* the SSD floor: the block file read back with O_DIRECT */
        char file[1200] = "";
        double bw_ssd = 0;
        {
            /* the tier's file: DIR/strata-kv-<id>.blocks, the only one there of this identity */
            DIR *d = opendir(mo.kv_ssd_dir);
            struct dirent *e;
            while (d && (e = readdir(d)))
                if (!strncmp(e->d_name, "strata-kv-", 10) && strstr(e->d_name, ".blocks"))
                    snprintf(file, sizeof file, "%s/%s", mo.kv_ssd_dir, e->d_name);
            if (d) closedir(d);
            if (file[0]) bw_ssd = ssd_bw(file, (uint64_t)hit_bytes);
        }
        printf("KV tiers, %lld-token prompt (prefix %lld tokens, %.2f GB of KV), first token:\n", (long long)prompt,
               (long long)hit, hit_bytes / 1e9);
        printf("  floors measured now: host -> device %.1f GB/s (pinned, 1 GiB copies; %.1f GB/s as 2-D copies of "
               "%zu-byte rows every %zu bytes, the tier's shape), SSD read %.2f GB/s (O_DIRECT, 8 MiB requests, 8 in "
               "flight, the tier's file)\n", bw_h2d / 1e9, bw_h2d_2d / 1e9, plane_row, blk_bytes, bw_ssd / 1e9);
        printf("  %-16s %8.3f s (no tiers: the cost of the eager copies down is %+.1f%%)\n", "computed, no tiers",
               ttft_off, 100.0 * (ttft[0] / ttft_off - 1.0));
        for (int k = 0; k < 5; k++) {
            printf("  %-16s %8.3f s (passes %.3f s) %6.1fx faster than computing", what[k], ttft[k], fwd[k],
                   ttft[0] / ttft[k]);
            if ((k == 2 || k == 4) && bw_h2d > 0)
                printf(", floor %.3f s (bytes / H2D): %.2fx of it", hit_bytes / bw_h2d, ttft[k] / (hit_bytes / bw_h2d));
            if (k == 3 && bw_ssd > 0 && bw_h2d > 0) {
                const double fl = hit_bytes / bw_ssd + hit_bytes / bw_h2d;
                printf(", floor %.3f s (bytes / SSD + bytes / H2D): %.2fx of it", fl, ttft[k] / fl);
            }
            printf("%s%s\n", first[k] == first[0] ? "" : "  FIRST TOKEN DIFFERS FROM THE COLD RUN",
                   k >= 2 && lh[k] != lh[1] ? "  LOGITS DIFFER FROM THE DEVICE-TIER HIT" : "");
        }
        printf("  last-position logits: device, host and SSD hits %s (bit for bit); cold run's first token %s\n",
               lh[1] == lh[2] && lh[2] == lh[3] && lh[3] == lh[4] ? "identical" : "DIFFERENT",
               first[1] == first[0] ? "the same" : "different (its last chunk runs another shape)");
        printf("  tiers: %lld host blocks of %.2f MB, %lld SSD slots; %.2f GB down, %.2f GB up, %.2f GB to SSD, "
               "%.2f GB from SSD\n", (long long)s.host_blocks, (double)s.block_bytes / 1e6, (long long)s.ssd_slots,
               (double)s.bytes_d2h / 1e9, (double)s.bytes_h2d / 1e9, (double)s.bytes_h2ssd / 1e9,
               (double)s.bytes_ssd2h / 1e9);
        st_runner_free(rn);
        rn = NULL;
        if (lh[1] != lh[2] || lh[2] != lh[3] || lh[3] != lh[4]) goto out;
    }
    if (serve) {
        /* a working set of shared prefixes 4x the device pool */
        const int64_t dev_tokens = 8 * prefix_len; /* the device pool: 8 prefixes */
        const int64_t n_pre = 4 * dev_tokens / prefix_len, suffix = 64, gen = 16;
        int32_t *pre = malloc((size_t)(n_pre * prefix_len) * sizeof *pre);
        int32_t *buf = malloc((size_t)(prefix_len + suffix) * sizeof *buf);
        if (!pre || !buf) goto out;
        for (int64_t i = 0; i < n_pre * prefix_len; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            pre[i] = (int32_t)(rng % (uint64_t)V);
        }
        for (int on = 1; on >= 0; on--) {
            st_engine_params ep = {.max_batch = conc, .max_model_len = prefix_len + suffix + gen + 1,
                                   .prefill_chunk = chunk < 512 ? chunk : 512, .kv_dtype = mo.kv_dtype,
                                   .kv_blocks = dev_tokens / bs, .device_mem = mo.device_mem,
                                   .kv_host_mem = on ? (int64_t)((double)(n_pre * prefix_len) * tok_bytes * 1.3) : ST_KV_HOST_OFF};
            if (st_runner_init(files, be, &ep, &rn) != STRATA_OK) {
                tool_print_error("bench-kv");
                goto out;
            }
            uint64_t r2 = 12345;
            int64_t added = 0, gen_tok = 0;
            double *tt = malloc((size_t)n_req * sizeof *tt);
            memset(rq, 0, (size_t)n_req * sizeof *rq);
            const double t0 = st_time_now();
            while (added < n_req || st_runner_has_work(rn)) {
                while (added < n_req && st_runner_num_running(rn) + st_runner_num_waiting(rn) < conc) {
                    r2 ^= r2 << 13, r2 ^= r2 >> 7, r2 ^= r2 << 17;
                    memcpy(buf, pre + (int64_t)(r2 % (uint64_t)n_pre) * prefix_len, (size_t)prefix_len * sizeof *buf);
                    for (int64_t k = 0; k < suffix; k++) {
                        r2 ^= r2 << 13, r2 ^= r2 >> 7, r2 ^= r2 << 17;
                        buf[prefix_len + k] = (int32_t)(r2 % (uint64_t)V);
                    }
                    if (!add(rn, (uint64_t)added, buf, prefix_len + suffix, gen, rq)) goto out;
                    added++;
                }
                if (!step(rn, rq, &gen_tok)) goto out;
            }
            const double wall = st_time_now() - t0;
            for (int64_t i = 0; i < n_req; i++) tt[i] = rq[i].t_first - rq[i].t_add;
            qsort(tt, (size_t)n_req, sizeof *tt, cmp_d);
            st_runner_stats rs;
            st_runner_get_stats(rn, &rs);
            printf("serving, %lld prefixes of %lld tokens (%.2f GB of KV, 4x the device pool of %lld tokens), %lld "
                   "requests (+%lld tokens, %lld out), %lld at once, tiers %s:\n",
                   (long long)n_pre, (long long)prefix_len, (double)(n_pre * prefix_len) * tok_bytes / 1e9,
                   (long long)dev_tokens, (long long)n_req, (long long)suffix, (long long)gen, (long long)conc,
                   on ? "on" : "off");
            printf("  %.1f requests/s, %.0f generated tok/s, TTFT p50 %.3f s p90 %.3f s p99 %.3f s; prompt tokens "
                   "computed %lld, from the cache %lld (host/SSD %lld)\n",
                   (double)n_req / wall, (double)gen_tok / wall, tt[n_req / 2], tt[n_req * 9 / 10],
                   tt[n_req * 99 / 100], (long long)rs.sched.prefill_tokens, (long long)rs.sched.cached_tokens,
                   (long long)rs.sched.lower_tokens);
            free(tt);
            st_runner_free(rn);
            rn = NULL;
        }
        free(pre);
        free(buf);
    }
    rc = 0;
out:
    st_runner_free(rn);
    free(tok);
    free(rq);
    st_backend_free(be);
    st_model_close(files);
    return rc;
}

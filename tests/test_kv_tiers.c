/* The KV tiers (src/kv/kv_tiers.h) end to end through the runner, on the CPU
 * backend (its device pool is plain memory, its host tier a second pool),
 * with a tiny reference model and the default model (SmolLM2-135M-Instruct
 * Q4_1; its absence is a failure). Every comparison is of the sampled tokens
 * AND the bits of every logits row (hashes) against a cold run with the
 * prefix cache off:
 *   (a) host tier: after the device cache is emptied, a repeated prompt
 *       takes its whole prefix from the host tier (counted per tier);
 *   (b) SSD tier: with the host copies dropped too, from the SSD tier;
 *   (c) restart: a new runner on the same directory finds the blocks and
 *       hits them; another model's directory is not used;
 *   (d) a corrupted block file: the hit stops at the bad block, same output;
 *   (e) a full disk (the Nth write fails): fewer cached blocks, no failure;
 *   (f) lazy offload: nothing moves until the device evicts, then a hit;
 *   (g) many concurrent requests sharing a prefix while it is offloaded;
 *   (h) preemption under a tight pool: sequences come back by swap (their
 *       KV from the host tier), outputs equal their solo runs. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>

#include "backend/backend.h"
#include "engine/runner.h"
#include "loader/loader.h"
#include "testutil.h"

#define MAXQ 16
#define MAXLEN 512

typedef struct {
    int32_t out[MAXLEN];
    int64_t n_out, n_cached;
    uint64_t lh[MAXLEN]; /* hash of the logits row predicting position p + 1 */
    bool done;
} result;

typedef struct {
    result r[MAXQ];
} results;

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h | 1;
}

static void on_logits(void *user, uint64_t id, int64_t pos, const float *logits, int64_t V) {
    results *rs = user;
    ST_ASSERT(id < MAXQ && pos >= 0 && pos < MAXLEN);
    rs->r[id].lh[pos] = hash_bytes(logits, (size_t)V * sizeof(float));
}

static st_runner *runner_new(const st_model_files *mf, st_backend *be, st_engine_params p, results *rs) {
    p.on_logits = on_logits;
    p.hook_user = rs;
    if (!p.max_model_len) p.max_model_len = MAXLEN;
    if (!p.kv_block_size) p.kv_block_size = 16;
    if (!p.prefill_chunk) p.prefill_chunk = -1;
    if (!p.step_tokens) p.step_tokens = 128;
    st_runner *rn = NULL;
    const strata_status st = st_runner_init(mf, be, &p, &rn);
    CHECK_MSG(st == STRATA_OK, "runner init: %s", st_last_error());
    return rn;
}

/* Runs requests ids [0, n) (prompts[i], greedy, max_tokens each) together to
 * completion on rn; results in rs->r[id]. */
static void run_reqs(st_runner *rn, results *rs, int32_t *const *prompts, const int64_t *n_prompt, int n,
                     int64_t max_tokens) {
    if (!rn) return;
    for (int i = 0; i < n; i++) {
        memset(&rs->r[i], 0, sizeof rs->r[i]);
        st_sampler_params sp = st_sampler_params_default();
        sp.temperature = 0;
        const st_request rq = {.prompt = prompts[i], .n_prompt = n_prompt[i], .sampler = sp, .max_tokens = max_tokens};
        const st_seq_limits lim = st_runner_limits(rn, NULL);
        const st_seq_callbacks cb = {.user = rs};
        st_seq *q = NULL;
        CHECK(st_seq_create(&rq, &lim, &cb, (uint64_t)i, &q) == STRATA_OK);
        CHECK(st_runner_add(rn, q) == STRATA_OK);
    }
    for (int step = 0; step < 100000 && st_runner_has_work(rn); step++) {
        st_runner_step_info si;
        const strata_status st = st_runner_step(rn, &si);
        CHECK_MSG(st == STRATA_OK, "step: %s", st_last_error());
        if (st) return;
        for (int64_t k = 0; k < si.n_events; k++) {
            const st_runner_event *e = &si.events[k];
            result *r = &rs->r[e->seq->id];
            if (e->token >= 0) r->out[r->n_out++] = e->token;
            if (e->finished) {
                r->done = true;
                r->n_cached = e->seq->fin.cached_tokens;
                st_seq_free(e->seq);
            }
        }
    }
    for (int i = 0; i < n; i++) CHECK(rs->r[i].done);
}

static void run1(st_runner *rn, results *rs, int32_t *prompt, int64_t n_prompt, int64_t max_tokens) {
    run_reqs(rn, rs, &prompt, &n_prompt, 1, max_tokens);
}

static bool same(const result *a, const result *b) {
    return a->n_out == b->n_out && !memcmp(a->out, b->out, (size_t)a->n_out * sizeof(int32_t)) &&
           !memcmp(a->lh, b->lh, sizeof a->lh);
}

static st_kv_tiers_stats tier_stats(st_runner *rn) {
    st_runner_stats s = {0};
    if (rn) st_runner_get_stats(rn, &s);
    CHECK(s.tiers);
    return s.tier;
}

/* The SSD tier's block file in dir (static buffer; "" when none). */
static const char *blocks_file(const char *dir) {
    static char path[1024];
    path[0] = 0;
    DIR *d = opendir(dir);
    if (!d) return path;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "strata-kv-", 10) && strstr(e->d_name, ".blocks"))
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    closedir(d);
    return path;
}

static void test_tiers(const char *name, const st_model_files *mf, st_backend *be, int64_t n_prompt) {
    const int64_t V = mf->config.vocab_size, bs = 16, max_tokens = 4;
    const int64_t hit = (n_prompt - 1) / bs * bs; /* whole blocks before the last token */
    uint64_t rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)n_prompt;
    int32_t *a = malloc((size_t)n_prompt * sizeof *a);
    for (int64_t i = 0; i < n_prompt; i++) a[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
    results *cold = calloc(1, sizeof *cold), *rs = calloc(1, sizeof *rs);
    char dir[512], tag[128], bf[1024];
    snprintf(tag, sizeof tag, "kv_tiers_ssd_%s", name);
    snprintf(dir, sizeof dir, "%s", test_tmpdir(tag));

    /* the reference: a cold run, no prefix cache, no tiers */
    st_runner *rn = runner_new(mf, be, (st_engine_params){.disable_prefix_cache = true}, cold);
    run1(rn, cold, a, n_prompt, max_tokens);
    st_runner_free(rn);

    /* (a) host tier */
    rn = runner_new(mf, be, (st_engine_params){.kv_host_mem = 64 << 20}, rs);
    run1(rn, rs, a, n_prompt, max_tokens);
    CHECK(same(&rs->r[0], &cold->r[0]) && rs->r[0].n_cached == 0);
    st_kv_tiers_stats s = tier_stats(rn);
    /* every full block of the run went down (the last sampled token is never run), its KV bytes exactly */
    const st_config *c = &mf->config;
    const uint64_t payload =
        (uint64_t)(st_kv_pool_bytes_per_token(c->n_layers, c->n_kv_heads, c->head_dim, ST_KV_F32) * (double)bs);
    const int64_t full = (n_prompt + max_tokens - 1) / bs;
    CHECK_MSG(s.host_cached == full && s.bytes_d2h == (uint64_t)full * payload,
              "%s: eager offload: %lld host blocks (want %lld), %llu bytes down (want %llu)", name,
              (long long)s.host_cached, (long long)full, (unsigned long long)s.bytes_d2h,
              (unsigned long long)((uint64_t)full * payload));
    st_runner_clear_device_cache(rn);
    run1(rn, rs, a, n_prompt, max_tokens);
    s = tier_stats(rn);
    CHECK_MSG(rs->r[0].n_cached == hit && s.hit_tokens_host == hit,
              "%s: host-tier hit of %lld tokens (%lld counted), wanted %lld", name, (long long)rs->r[0].n_cached,
              (long long)s.hit_tokens_host, (long long)hit);
    CHECK_MSG(same(&rs->r[0], &cold->r[0]), "%s: a host-tier hit changed the output or the logits", name);
    CHECK_MSG(s.bytes_h2d == (uint64_t)(hit / bs) * payload && s.copies_h2d >= 2 * c->n_layers &&
                  s.copies_h2d <= 2 * c->n_layers * (hit / bs),
              "%s: %llu bytes up in %lld copies", name, (unsigned long long)s.bytes_h2d, (long long)s.copies_h2d);
    printf("  (a) %s: host-tier hit of %lld tokens, %llu bytes up in %lld copies; same tokens and logits as cold\n",
           name, (long long)hit, (unsigned long long)s.bytes_h2d, (long long)s.copies_h2d);
    st_runner_free(rn);

    /* (b) SSD tier, (c) restart */
    const st_engine_params ps = {.kv_host_mem = 64 << 20, .kv_ssd_dir = dir, .kv_ssd_size = 64 << 20};
    rn = runner_new(mf, be, ps, rs);
    run1(rn, rs, a, n_prompt, max_tokens);
    CHECK(st_kv_tiers_drain(st_runner_tiers(rn)) == STRATA_OK);
    s = tier_stats(rn);
    CHECK_MSG(s.ssd_cached >= hit / bs, "%s: %lld blocks on the SSD tier after the drain", name, (long long)s.ssd_cached);
    st_kv_tiers_drop_host(st_runner_tiers(rn), false);
    st_runner_clear_device_cache(rn);
    s = tier_stats(rn);
    CHECK(s.host_cached == 0);
    run1(rn, rs, a, n_prompt, max_tokens);
    s = tier_stats(rn);
    CHECK_MSG(rs->r[0].n_cached == hit && s.hit_tokens_ssd == hit, "%s: SSD-tier hit of %lld tokens (%lld counted)",
              name, (long long)rs->r[0].n_cached, (long long)s.hit_tokens_ssd);
    CHECK_MSG(same(&rs->r[0], &cold->r[0]), "%s: an SSD-tier hit changed the output or the logits", name);
    snprintf(bf, sizeof bf, "%s", blocks_file(dir)); /* the only one yet */
    printf("  (b) %s: SSD-tier hit of %lld tokens (%llu bytes read); same tokens and logits as cold\n", name,
           (long long)hit, (unsigned long long)s.bytes_ssd2h);
    st_runner_free(rn);

    rn = runner_new(mf, be, ps, rs);
    s = tier_stats(rn);
    CHECK_MSG(s.ssd_found_at_start >= hit / bs, "%s: restart found %lld blocks", name, (long long)s.ssd_found_at_start);
    run1(rn, rs, a, n_prompt, max_tokens);
    s = tier_stats(rn);
    CHECK_MSG(rs->r[0].n_cached == hit && s.hit_tokens_ssd == hit, "%s: after a restart: %lld cached tokens", name,
              (long long)rs->r[0].n_cached);
    CHECK(same(&rs->r[0], &cold->r[0]));
    printf("  (c) %s: restart: %lld blocks found on the SSD tier, the prompt hits %lld tokens; same output\n", name,
           (long long)s.ssd_found_at_start, (long long)hit);
    st_runner_free(rn);
    {   /* another model's identity (a different KV dtype): the directory's blocks are not used */
        st_engine_params po = ps;
        po.kv_dtype = ST_KV_BF16;
        rn = runner_new(mf, be, po, rs);
        s = tier_stats(rn);
        CHECK_MSG(s.ssd_found_at_start == 0, "%s: another identity found %lld blocks", name,
                  (long long)s.ssd_found_at_start);
        st_runner_free(rn);
    }

    /* (d) one corrupted block: the hit ends before it */
    CHECK_MSG(bf[0], "%s: no block file in %s", name, dir);
    const int64_t bad = 2; /* the third block of the prompt was the third written */
    {
        rn = runner_new(mf, be, ps, rs);
        s = tier_stats(rn);
        st_runner_free(rn);
        const int64_t slot_bytes = 4096 + s.block_bytes;
        int fd = open(bf, O_RDWR);
        CHECK(fd >= 0);
        uint8_t byte = 0;
        const off_t off = (off_t)(bad * slot_bytes + 4096 + s.block_bytes / 2);
        CHECK(pread(fd, &byte, 1, off) == 1);
        byte ^= 0x5a;
        CHECK(pwrite(fd, &byte, 1, off) == 1);
        close(fd);
    }
    rn = runner_new(mf, be, ps, rs);
    run1(rn, rs, a, n_prompt, max_tokens);
    s = tier_stats(rn);
    CHECK_MSG(rs->r[0].n_cached == bad * bs && s.ssd_read_failures == 1,
              "%s: corrupt block %lld: %lld cached tokens, %lld read failures", name, (long long)bad,
              (long long)rs->r[0].n_cached, (long long)s.ssd_read_failures);
    CHECK_MSG(same(&rs->r[0], &cold->r[0]), "%s: a corrupt SSD block changed the output", name);
    printf("  (d) %s: block %lld corrupted on disk: hit of %lld tokens, %lld read failure, same output\n", name,
           (long long)bad, (long long)rs->r[0].n_cached, (long long)s.ssd_read_failures);
    st_runner_free(rn);

    /* (e) a full disk: the 3rd write fails; the request is fine, fewer blocks cached */
    char dir2[512];
    snprintf(tag, sizeof tag, "kv_tiers_full_%s", name);
    snprintf(dir2, sizeof dir2, "%s", test_tmpdir(tag));
    st_engine_params pf = ps;
    pf.kv_ssd_dir = dir2;
    pf.kv_ssd_fail_write_nth = 3;
    rn = runner_new(mf, be, pf, rs);
    run1(rn, rs, a, n_prompt, max_tokens);
    CHECK(st_kv_tiers_drain(st_runner_tiers(rn)) == STRATA_OK);
    s = tier_stats(rn);
    CHECK_MSG(s.ssd_write_failures == 1 && s.ssd_bad == 1 && s.ssd_cached == hit / bs - 1,
              "%s: full disk: %lld write failures, %lld slots given up, %lld cached", name,
              (long long)s.ssd_write_failures, (long long)s.ssd_bad, (long long)s.ssd_cached);
    CHECK(same(&rs->r[0], &cold->r[0]));
    printf("  (e) %s: a failed SSD write (full disk): %lld of %lld blocks on the SSD tier, request fine\n", name,
           (long long)s.ssd_cached, (long long)(hit / bs));
    st_runner_free(rn);

    /* (i) tiers smaller than the data: LRU in the host tier (4 blocks) and the SSD tier (6
     * slots) while two prompts go through; the last prompt's tail blocks stay hits, outputs
     * unchanged */
    {
        char dir3[512];
        snprintf(tag, sizeof tag, "kv_tiers_small_%s", name);
        snprintf(dir3, sizeof dir3, "%s", test_tmpdir(tag));
        const int64_t bb = s.block_bytes;
        st_engine_params pm = {.kv_host_mem = 4 * bb, .kv_ssd_dir = dir3, .kv_ssd_size = (uint64_t)(6 * (bb + 4096))};
        rn = runner_new(mf, be, pm, rs);
        int32_t *b = malloc((size_t)n_prompt * sizeof *b);
        for (int64_t i = 0; i < n_prompt; i++) b[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
        run1(rn, rs, a, n_prompt, max_tokens);
        CHECK(st_kv_tiers_drain(st_runner_tiers(rn)) == STRATA_OK);
        run1(rn, rs, b, n_prompt, max_tokens);
        CHECK(st_kv_tiers_drain(st_runner_tiers(rn)) == STRATA_OK);
        s = tier_stats(rn);
        CHECK_MSG(s.host_blocks == 4 && s.host_cached <= 4 && s.ssd_slots == 6 && s.ssd_cached == 6,
                  "%s: small tiers: host %lld of %lld, SSD %lld of %lld", name, (long long)s.host_cached,
                  (long long)s.host_blocks, (long long)s.ssd_cached, (long long)s.ssd_slots);
        /* b, the most recent prompt, kept its chain's head in the tiers (blocks go before their
         * parents): a hit of at least the host tier's 4 blocks (a block stays pinned in the host
         * tier until its SSD write completes, so a 4-block host tier skips some offloads) */
        st_runner_clear_device_cache(rn);
        results *rb = calloc(1, sizeof *rb);
        st_runner *ref = runner_new(mf, be, (st_engine_params){.disable_prefix_cache = true}, rb);
        run1(ref, rb, b, n_prompt, max_tokens);
        st_runner_free(ref);
        run1(rn, rs, b, n_prompt, max_tokens);
        const int64_t b_hit = rs->r[0].n_cached;
        CHECK_MSG(b_hit >= 4 * bs && same(&rs->r[0], &rb->r[0]), "%s: small tiers: the last prompt hit %lld tokens",
                  name, (long long)b_hit);
        st_runner_clear_device_cache(rn);
        run1(rn, rs, a, n_prompt, max_tokens); /* what is left of a's chain (its head, if anything) */
        CHECK_MSG(same(&rs->r[0], &cold->r[0]) && rs->r[0].n_cached < b_hit, "%s: small tiers: a hit %lld", name,
                  (long long)rs->r[0].n_cached);
        printf("  (i) %s: host tier of 4 blocks, SSD tier of 6 slots, two %lld-token prompts through them: "
               "LRU keeps them full (%lld / %lld), heads of chains kept (the last prompt hits %lld tokens), "
               "outputs unchanged\n",
               name, (long long)n_prompt, (long long)s.host_cached, (long long)s.ssd_cached, (long long)b_hit);
        free(rb);
        free(b);
        st_runner_free(rn);
    }

    /* (f) lazy: nothing goes down until the device evicts */
    {
        const int64_t nb = (n_prompt + max_tokens + bs) / bs + 1; /* one prompt's blocks, about */
        st_engine_params pl = {.kv_host_mem = 64 << 20, .kv_offload = ST_KV_OFFLOAD_LAZY, .kv_blocks = nb,
                               .max_model_len = nb * bs};
        rn = runner_new(mf, be, pl, rs);
        run1(rn, rs, a, n_prompt, max_tokens);
        s = tier_stats(rn);
        CHECK_MSG(s.bytes_d2h == 0, "%s: lazy offload moved %llu bytes without an eviction", name,
                  (unsigned long long)s.bytes_d2h);
        int32_t *b = malloc((size_t)n_prompt * sizeof *b);
        for (int64_t i = 0; i < n_prompt; i++) b[i] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
        run1(rn, rs, b, n_prompt, max_tokens); /* evicts a's blocks: they go down now */
        s = tier_stats(rn);
        CHECK_MSG(s.bytes_d2h > 0 && s.host_cached > 0, "%s: lazy: evictions moved nothing", name);
        run1(rn, rs, a, n_prompt, max_tokens);
        s = tier_stats(rn);
        CHECK_MSG(rs->r[0].n_cached > 0 && s.hit_tokens_host > 0, "%s: lazy: no host hit (%lld cached)", name,
                  (long long)rs->r[0].n_cached);
        CHECK_MSG(same(&rs->r[0], &cold->r[0]), "%s: lazy: a host hit changed the output", name);
        printf("  (f) %s: lazy offload: nothing down before evictions, then a host hit of %lld tokens\n", name,
               (long long)rs->r[0].n_cached);
        free(b);
        st_runner_free(rn);
    }

    /* (g) concurrent requests sharing the prefix, its blocks offloaded in the same steps (on the CPU
     * backend the copies are synchronous: this checks the bookkeeping of shared and deduplicated
     * blocks, not a race with a copy in flight; the GPU run of bench-kv covers that) */
    {
        enum { NQ = 6 };
        int32_t *pr[NQ];
        int64_t np[NQ];
        results *solo = calloc(1, sizeof *solo);
        for (int i = 0; i < NQ; i++) {
            np[i] = n_prompt + 8 + i;
            pr[i] = malloc((size_t)np[i] * sizeof(int32_t));
            memcpy(pr[i], a, (size_t)n_prompt * sizeof(int32_t));
            for (int64_t k = n_prompt; k < np[i]; k++) pr[i][k] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
        }
        rn = runner_new(mf, be, (st_engine_params){.disable_prefix_cache = true}, solo);
        for (int i = 0; i < NQ; i++) {
            run1(rn, solo, pr[i], np[i], max_tokens);
            solo->r[NQ + i] = solo->r[0];
        }
        st_runner_free(rn);
        rn = runner_new(mf, be, (st_engine_params){.kv_host_mem = 64 << 20, .kv_ssd_dir = dir2, .kv_ssd_size = 64 << 20},
                        rs);
        run_reqs(rn, rs, pr, np, NQ, max_tokens);
        st_runner_clear_device_cache(rn);
        run_reqs(rn, rs, pr, np, NQ, max_tokens); /* again, from the host tier, all at once */
        s = tier_stats(rn);
        int ok = 0;
        for (int i = 0; i < NQ; i++) ok += same(&rs->r[i], &solo->r[NQ + i]);
        CHECK_MSG(ok == NQ, "%s: %d of %d concurrent requests sharing a prefix equal their solo runs", name, ok, NQ);
        CHECK(s.hit_tokens_host >= hit);
        printf("  (g) %s: %d concurrent requests sharing a %lld-token prefix (offloaded, then hit from the host "
               "tier): all equal their solo runs\n",
               name, NQ, (long long)n_prompt);
        st_runner_free(rn);
        for (int i = 0; i < NQ; i++) free(pr[i]);
        free(solo);
    }
    free(a);
    free(cold);
    free(rs);
}

/* (h) preemption by swap: a pool too small for the load */
static void test_swap(const char *name, const st_model_files *mf, st_backend *be) {
    const int64_t V = mf->config.vocab_size, bs = 8, max_tokens = 24;
    enum { NQ = 5 };
    uint64_t rng = 77;
    int32_t *pr[NQ];
    int64_t np[NQ];
    for (int i = 0; i < NQ; i++) {
        np[i] = 30 + 7 * i;
        pr[i] = malloc((size_t)np[i] * sizeof(int32_t));
        for (int64_t k = 0; k < np[i]; k++) pr[i][k] = (int32_t)(test_rand_u32(&rng) % (uint32_t)V);
    }
    results *solo = calloc(1, sizeof *solo), *rs = calloc(1, sizeof *rs);
    st_runner *rn = runner_new(mf, be, (st_engine_params){.disable_prefix_cache = true, .kv_block_size = bs}, solo);
    for (int i = 0; i < NQ; i++) {
        run1(rn, solo, pr[i], np[i], max_tokens);
        solo->r[NQ + i] = solo->r[0];
    }
    st_runner_free(rn);
    const int64_t mml = 30 + 7 * (NQ - 1) + max_tokens + 1;
    rn = runner_new(mf, be,
                    (st_engine_params){.kv_host_mem = 64 << 20, .kv_block_size = bs, .max_model_len = mml,
                                       .kv_blocks = (mml + bs - 1) / bs + 2, .max_batch = NQ},
                    rs);
    run_reqs(rn, rs, pr, np, NQ, max_tokens);
    st_runner_stats s;
    st_runner_get_stats(rn, &s);
    int ok = 0;
    for (int i = 0; i < NQ; i++) ok += same(&rs->r[i], &solo->r[NQ + i]);
    CHECK_MSG(s.sched.preemptions > 0 && s.sched.swaps > 0, "%s: %lld preemptions, %lld swaps", name,
              (long long)s.sched.preemptions, (long long)s.sched.swaps);
    CHECK_MSG(ok == NQ, "%s: %d of %d preempted requests equal their solo runs", name, ok, NQ);
    printf("  (h) %s: %lld preemptions, %lld swapped back from the host tier (%lld tokens); %d/%d outputs equal "
           "their solo runs\n",
           name, (long long)s.sched.preemptions, (long long)s.sched.swaps, (long long)s.sched.lower_tokens, ok, NQ);
    st_runner_free(rn);
    for (int i = 0; i < NQ; i++) free(pr[i]);
    free(solo);
    free(rs);
}

int main(void) {
    const double t0 = st_time_now();
    st_backend *be = NULL;
    st_backend_params bp = {.kind = ST_BACKEND_CPU, .n_threads = 0};
    if (st_backend_init(&bp, &be) != STRATA_OK) return 2;
    st_model_files *mf = NULL;
    if (st_model_open(test_src_path("tests/data/models/gqa_f32"), &mf) == STRATA_OK) {
        test_tiers("gqa_f32", mf, be, 150);
        test_swap("gqa_f32", mf, be);
        st_model_close(mf);
    } else {
        CHECK_MSG(false, "tiny model: %s", st_last_error());
    }
    const char *smol = test_default_model_path();
    CHECK_MSG(smol != NULL, "the default model SmolLM2-135M-Instruct.Q4_1.gguf is missing (scripts/fetch-default-model.sh)");
    if (smol && st_model_open(smol, &mf) == STRATA_OK) {
        test_tiers("SmolLM2", mf, be, 120);
        test_swap("SmolLM2", mf, be);
        st_model_close(mf);
    }
    st_backend_free(be);
    printf("  %.1f s\n", st_time_now() - t0);
    return test_finish("test_kv_tiers");
}

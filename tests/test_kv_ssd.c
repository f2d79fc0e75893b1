/* kv/kv_ssd: the SSD tier's slot file.
 *  - write + poll + read of several slots, bytes equal, with io_uring and with
 *    pwrite/pread; reads while the writer writes other slots;
 *  - reopen: scan finds the blocks (hash, parent, tokens), the reads still match;
 *    a second store of the same file is refused (locked);
 *  - another identity in the same directory: sees nothing of the first, one
 *    warning, the first's file untouched and still found on reopen;
 *  - a flipped payload byte, a corrupt header, a torn slot (new header, old
 *    payload): ok = false for that slot only;
 *  - a smaller cap truncates the file and keeps the blocks below it;
 *  - full disk: an injected ENOSPC, and a real file size limit (RLIMIT_FSIZE,
 *    in a child): the writes past it fail, one warning, earlier slots read back;
 *  - the bounded write queue: STRATA_ERR_BUSY;
 *  - bad parameters: messages naming the parameter or directory. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kv/kv_ssd.h"
#include "testutil.h"

#define PAYLOAD 10000 /* -> 12288 allocated, slots of 16384 */
#define SLOT 16384u
#define TOK 16

/* ---- log capture (the writer thread logs too) ---- */
typedef struct {
    pthread_mutex_t mu;
    int n_warn;
    char warn[8][1024];
} log_cap;
static log_cap g_log = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void on_log(strata_log_level level, const char *msg, void *user) {
    log_cap *c = user;
    if (level < STRATA_LOG_WARN) return;
    pthread_mutex_lock(&c->mu);
    if (c->n_warn < 8) snprintf(c->warn[c->n_warn], sizeof c->warn[0], "%s", msg);
    c->n_warn++;
    pthread_mutex_unlock(&c->mu);
}
static void log_reset(void) {
    pthread_mutex_lock(&g_log.mu);
    g_log.n_warn = 0;
    pthread_mutex_unlock(&g_log.mu);
}
static int log_count(void) {
    pthread_mutex_lock(&g_log.mu);
    int n = g_log.n_warn;
    pthread_mutex_unlock(&g_log.mu);
    return n;
}

/* ---- helpers ---- */
static char g_root[256];

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

static void *aligned(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, 4096, n) == 0 ? p : NULL;
}

/* Payload of block `seed`: every allocated byte, from a seeded xorshift. */
static void fill(uint8_t *buf, size_t n, uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        buf[i] = (uint8_t)x;
    }
}
static void tokens_of(int32_t *t, int64_t seed) {
    for (int k = 0; k < TOK; k++) t[k] = (int32_t)(seed * 1000 + k);
}

static st_kv_ssd_params params(const char *dir, uint64_t identity, int64_t slots) {
    return (st_kv_ssd_params){.dir = dir, .max_bytes = (uint64_t)slots * SLOT, .payload_bytes = PAYLOAD,
                              .block_tokens = TOK, .identity = identity, .identity_text = "test model"};
}

static bool read_file(const char *path, uint8_t **data, size_t *n) {
    char *d = NULL;
    if (st_file_read_all(path, &d, n) != STRATA_OK) return false;
    *data = (uint8_t *)d;
    return true;
}

/* Waits for `want` completions (flush, then poll), recorded as ok[slot]. */
static int64_t collect(st_kv_ssd *s, int64_t want, int64_t *slots, bool *oks) {
    st_kv_ssd_flush(s);
    st_kv_ssd_done d[128];
    int64_t n = st_kv_ssd_poll(s, d, 128);
    for (int64_t i = 0; i < n && i < want; i++) {
        slots[i] = d[i].slot;
        oks[i] = d[i].ok;
    }
    return n;
}

/* Writes blocks seed 0..n-1 into slots 0..n-1 (hash 100 + seed, parent 99 + seed). */
static void write_blocks(st_kv_ssd *s, int n, uint8_t **bufs) {
    for (int i = 0; i < n; i++) {
        int32_t t[TOK];
        tokens_of(t, i);
        fill(bufs[i], st_kv_ssd_payload_alloc_bytes(s), (uint64_t)i);
        CHECK(st_kv_ssd_write(s, i, 100 + (uint64_t)i, 99 + (uint64_t)i, t, bufs[i]) == STRATA_OK);
    }
}

/* Reads slots 0..n-1 expecting blocks seed 0..n-1; ok[] out; bytes compared where ok. */
static void read_blocks(st_kv_ssd *s, int n, bool *ok, int *bytes_equal) {
    int64_t slots[16];
    uint64_t hashes[16];
    void *bufs[16];
    const size_t A = st_kv_ssd_payload_alloc_bytes(s);
    uint8_t *want = malloc(A);
    for (int i = 0; i < n; i++) {
        slots[i] = i;
        hashes[i] = 100 + (uint64_t)i;
        bufs[i] = aligned(A);
        memset(bufs[i], 0xee, A);
    }
    CHECK(st_kv_ssd_read(s, slots, hashes, bufs, n, ok) == STRATA_OK);
    *bytes_equal = 0;
    for (int i = 0; i < n; i++) {
        fill(want, A, (uint64_t)i);
        if (ok[i] && memcmp(bufs[i], want, PAYLOAD) == 0) (*bytes_equal)++;
        free(bufs[i]);
    }
    free(want);
}

typedef struct {
    int n;
    int64_t slot[16];
    uint64_t hash[16], parent[16];
    bool tokens_right[16];
} scan_rec;

static void on_block(int64_t slot, uint64_t hash, uint64_t parent, const int32_t *tokens, int64_t n_tokens,
                     void *user) {
    scan_rec *r = user;
    if (r->n >= 16) return;
    int32_t t[TOK];
    tokens_of(t, (int64_t)hash - 100);
    r->slot[r->n] = slot;
    r->hash[r->n] = hash;
    r->parent[r->n] = parent;
    r->tokens_right[r->n] = n_tokens == TOK && memcmp(t, tokens, sizeof t) == 0;
    r->n++;
}

/* ---- cases ---- */

static void check_bad_params(void) {
    char path[512];
    st_kv_ssd *s = (st_kv_ssd *)1;
    st_kv_ssd_params p = params(g_root, 1, 8);
    p.max_bytes = SLOT - 1;
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_INVALID_ARG, "--kv-ssd-size", "16383", "minimum is 16384");
    CHECK(s == NULL);
    printf("  too small -> %s\n", st_last_error());
    p = params(g_root, 1, 8);
    p.block_tokens = ST_KV_SSD_MAX_TOKENS + 1;
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_INVALID_ARG, "block_tokens 1005", "4096-byte slot header",
              "1 .. 1004");
    p.block_tokens = 0;
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_INVALID_ARG, "block_tokens 0");
    p = params(g_root, 1, 8);
    p.payload_bytes = 0;
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_INVALID_ARG, "payload_bytes 0");
    p = params(NULL, 1, 8);
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_INVALID_ARG, "no directory");
    /* the parent is missing (one level only is created) */
    snprintf(path, sizeof path, "%s/missing/kv", g_root);
    p = params(path, 1, 8);
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_IO, "cannot create the directory", path, "No such file");
    printf("  no parent -> %s\n", st_last_error());
    /* a plain file where the directory should be, and below it */
    snprintf(path, sizeof path, "%s/plain", g_root);
    CHECK(test_write_file(path, "x", 1));
    p = params(path, 1, 8);
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_IO, path, "is not a directory");
    snprintf(path, sizeof path, "%s/plain/kv", g_root);
    p = params(path, 1, 8);
    CHECK_ERR(st_kv_ssd_open(&p, &s), STRATA_ERR_IO, "cannot create the directory", path, "Not a directory");
    CHECK(s == NULL);
    /* exactly one slot is enough */
    snprintf(path, sizeof path, "%s/one", g_root);
    p = params(path, 7, 1);
    CHECK(st_kv_ssd_open(&p, &s) == STRATA_OK && s && st_kv_ssd_slots(s) == 1);
    st_kv_ssd_close(s);
    st_kv_ssd_close(NULL);
}

/* Roundtrip in dir (identity id), force_pread or not; leaves 5 blocks in slots 0..4. */
static void check_roundtrip(const char *dir, uint64_t id, bool pread_only) {
    st_kv_ssd_params p = params(dir, id, 8);
    p.force_pread = pread_only;
    st_kv_ssd *s = NULL;
    strata_status st = st_kv_ssd_open(&p, &s);
    CHECK_MSG(st == STRATA_OK, "open %s: %s", dir, st_last_error());
    if (st) return;
    CHECK(st_kv_ssd_slots(s) == 8 && st_kv_ssd_payload_alloc_bytes(s) == 12288 && st_kv_ssd_slot_bytes(s) == SLOT);
    char want[512];
    snprintf(want, sizeof want, "%s/strata-kv-%016llx.blocks", dir, (unsigned long long)id);
    CHECK_MSG(!strcmp(st_kv_ssd_path(s), want), "path %s", st_kv_ssd_path(s));
    snprintf(want, sizeof want, "%s/strata-kv-%016llx.txt", dir, (unsigned long long)id);
    uint8_t *txt = NULL;
    size_t n_txt = 0;
    CHECK(read_file(want, &txt, &n_txt) && n_txt == 11 && !memcmp(txt, "test model\n", 11));
    free(txt);
    int64_t found = -1;
    CHECK(st_kv_ssd_scan(s, NULL, NULL, &found) == STRATA_OK && found == 0);

    uint8_t *bufs[8];
    for (int i = 0; i < 8; i++) bufs[i] = aligned(12288);
    write_blocks(s, 5, bufs);
    int64_t slots[16];
    bool oks[16];
    CHECK(collect(s, 5, slots, oks) == 5);
    for (int i = 0; i < 5; i++) CHECK_MSG(slots[i] == i && oks[i], "completion %d: slot %lld ok %d", i,
                                          (long long)slots[i], oks[i]);
    CHECK(st_kv_ssd_poll(s, (st_kv_ssd_done[1]){0}, 1) == 0);

    /* reads of 0..4 while the writer writes 5..7 */
    for (int i = 5; i < 8; i++) {
        int32_t t[TOK];
        tokens_of(t, i);
        fill(bufs[i], 12288, (uint64_t)i);
        CHECK(st_kv_ssd_write(s, i, 100 + (uint64_t)i, 99 + (uint64_t)i, t, bufs[i]) == STRATA_OK);
    }
    bool ok[16];
    int equal = 0;
    read_blocks(s, 5, ok, &equal);
    CHECK_MSG(equal == 5, "%d of 5 blocks read back equal", equal);
    CHECK(collect(s, 3, slots, oks) == 3 && oks[0] && oks[1] && oks[2]);
    read_blocks(s, 8, ok, &equal);
    CHECK_MSG(equal == 8, "%d of 8 blocks read back equal", equal);

    /* a wrong hash, and a slot that holds nothing */
    {
        int64_t sl[2] = {1, 2};
        uint64_t h[2] = {101, 555};
        void *b[2] = {bufs[0], bufs[1]};
        bool k[2] = {false, true};
        CHECK(st_kv_ssd_read(s, sl, h, b, 2, k) == STRATA_OK && k[0] && !k[1]);
    }
    /* bad arguments: errors before anything is read */
    {
        int64_t sl[1] = {8};
        uint64_t h[1] = {100};
        void *b[1] = {bufs[0]};
        bool k[1];
        CHECK_ERR(st_kv_ssd_read(s, sl, h, b, 1, k), STRATA_ERR_INVALID_ARG, "slot 8", "8 slots");
        sl[0] = 0;
        b[0] = bufs[0] + 16;
        CHECK_ERR(st_kv_ssd_read(s, sl, h, b, 1, k), STRATA_ERR_INVALID_ARG, "not 4096-aligned");
        int32_t t[TOK] = {0};
        CHECK_ERR(st_kv_ssd_write(s, 9, 1, 0, t, bufs[0]), STRATA_ERR_INVALID_ARG, "slot 9", "8 slots");
        CHECK_ERR(st_kv_ssd_write(s, 0, 1, 0, t, bufs[0] + 8), STRATA_ERR_INVALID_ARG, "4096-aligned");
    }
    st_kv_ssd_stats ss;
    st_kv_ssd_get_stats(s, &ss);
    CHECK_MSG(ss.writes == 8 && ss.write_failures == 0 && ss.bytes_written == 8 * SLOT && ss.reads == 15 &&
                  ss.read_failures == 1 && ss.bytes_read == 15 * SLOT && ss.slots == 8,
              "stats: %lld writes (%lld failed, %llu bytes), %lld reads (%lld failed, %llu bytes)",
              (long long)ss.writes, (long long)ss.write_failures, (unsigned long long)ss.bytes_written,
              (long long)ss.reads, (long long)ss.read_failures, (unsigned long long)ss.bytes_read);
    if (pread_only) CHECK(!ss.uring);
    printf("  roundtrip (%s): 8 blocks written and read back, O_DIRECT %s, io_uring %s\n",
           pread_only ? "pwrite/pread" : "default", ss.direct ? "yes" : "no", ss.uring ? "yes" : "no");
    /* reopen the file with the same identity: blocks found; a second store is refused */
    st_kv_ssd_close(s);
    s = NULL;
    CHECK(st_kv_ssd_open(&p, &s) == STRATA_OK);
    if (s) {
        st_kv_ssd *again = (st_kv_ssd *)1;
        CHECK_ERR(st_kv_ssd_open(&p, &again), STRATA_ERR_IO, "in use by another KV cache store");
        CHECK(again == NULL);
        scan_rec r = {0};
        CHECK(st_kv_ssd_scan(s, on_block, &r, &found) == STRATA_OK);
        CHECK_MSG(found == 8 && r.n == 8, "reopened: %lld blocks found", (long long)found);
        for (int i = 0; i < r.n; i++)
            CHECK_MSG(r.slot[i] == i && r.hash[i] == 100 + (uint64_t)i && r.parent[i] == 99 + (uint64_t)i &&
                          r.tokens_right[i],
                      "scan %d: slot %lld hash %llu parent %llu tokens %d", i, (long long)r.slot[i],
                      (unsigned long long)r.hash[i], (unsigned long long)r.parent[i], r.tokens_right[i]);
        read_blocks(s, 8, ok, &equal);
        CHECK_MSG(equal == 8, "reopened: %d of 8 blocks read back equal", equal);
    }
    st_kv_ssd_close(s);
    for (int i = 0; i < 8; i++) free(bufs[i]);
}

static void check_identities_and_damage(const char *dir) {
    char a_path[512];
    snprintf(a_path, sizeof a_path, "%s/strata-kv-%016llx.blocks", dir, 0xa1ull);
    uint8_t *before = NULL, *after = NULL;
    size_t nb = 0, na = 0;
    CHECK(read_file(a_path, &before, &nb) && nb == 8 * SLOT);

    /* another identity: one warning naming the directory, nothing of A found */
    log_reset();
    st_kv_ssd *b = NULL;
    st_kv_ssd_params pb = params(dir, 0xb2, 8);
    CHECK(st_kv_ssd_open(&pb, &b) == STRATA_OK);
    CHECK_MSG(log_count() == 1 && strstr(g_log.warn[0], dir) && strstr(g_log.warn[0], "1 strata-kv-*.blocks file "),
              "%d warnings: %s", log_count(), log_count() ? g_log.warn[0] : "");
    int64_t found = -1;
    if (b) {
        CHECK(st_kv_ssd_scan(b, NULL, NULL, &found) == STRATA_OK && found == 0);
        uint8_t *buf = aligned(12288);
        int32_t t[TOK];
        tokens_of(t, 9);
        fill(buf, 12288, 9);
        CHECK(st_kv_ssd_write(b, 0, 109, 0, t, buf) == STRATA_OK);
        int64_t sl[1];
        bool k[1];
        CHECK(collect(b, 1, sl, k) == 1 && k[0]);
        /* A's block 0 read through B: another identity */
        st_kv_ssd_close(b);
        free(buf);
    }
    CHECK(read_file(a_path, &after, &na) && na == nb && !memcmp(before, after, nb));
    /* A's blocks under another identity's name (a renamed file): none of them counts */
    char f_path[512];
    snprintf(f_path, sizeof f_path, "%s/strata-kv-%016llx.blocks", dir, 0xf6ull);
    CHECK(test_write_file(f_path, before, nb));
    st_kv_ssd *f = NULL;
    st_kv_ssd_params pf = params(dir, 0xf6, 8);
    CHECK(st_kv_ssd_open(&pf, &f) == STRATA_OK);
    if (f) {
        CHECK(st_kv_ssd_scan(f, NULL, NULL, &found) == STRATA_OK && found == 0);
        bool ok[8] = {true};
        int equal = -1;
        read_blocks(f, 8, ok, &equal);
        CHECK(equal == 0 && !ok[0] && !ok[7]);
        st_kv_ssd_close(f);
    }
    free(before);
    free(after);

    /* A again: its blocks are there */
    log_reset();
    st_kv_ssd *a = NULL;
    st_kv_ssd_params pa = params(dir, 0xa1, 8);
    CHECK(st_kv_ssd_open(&pa, &a) == STRATA_OK);
    CHECK(log_count() == 1);
    if (!a) return;
    CHECK(st_kv_ssd_scan(a, NULL, NULL, &found) == STRATA_OK && found == 8);

    /* damage: a payload byte of slot 2, a token in slot 3's header */
    int fd = open(a_path, O_RDWR);
    CHECK(fd >= 0);
    uint8_t c = 0;
    CHECK(pread(fd, &c, 1, 2 * SLOT + 4096 + 777) == 1);
    c ^= 0x20;
    CHECK(pwrite(fd, &c, 1, 2 * SLOT + 4096 + 777) == 1);
    CHECK(pread(fd, &c, 1, 3 * SLOT + 80 + 5) == 1);
    c ^= 0x01;
    CHECK(pwrite(fd, &c, 1, 3 * SLOT + 80 + 5) == 1);
    /* slot 1's whole slot copied into slot 4: a valid block, but of another slot */
    uint8_t *whole = aligned(SLOT);
    CHECK(pread(fd, whole, SLOT, 1 * SLOT) == SLOT);
    CHECK(pwrite(fd, whole, SLOT, 4 * SLOT) == SLOT);
    {
        const int64_t s4[1] = {4};
        const uint64_t h1[1] = {101};
        void *const into[1] = {whole};
        bool k4[1] = {true};
        CHECK(st_kv_ssd_read(a, s4, h1, into, 1, k4) == STRATA_OK && !k4[0]);
    }
    free(whole);
    bool ok[16];
    int equal = 0;
    read_blocks(a, 8, ok, &equal);
    CHECK_MSG(ok[0] && ok[1] && !ok[2] && !ok[3] && !ok[4] && ok[5] && ok[6] && ok[7] && equal == 5,
              "after damage: ok %d%d%d%d%d%d%d%d, %d equal", ok[0], ok[1], ok[2], ok[3], ok[4], ok[5], ok[6], ok[7],
              equal);
    scan_rec r = {0};
    CHECK(st_kv_ssd_scan(a, on_block, &r, &found) == STRATA_OK && found == 6); /* slot 3's header is corrupt, */
    for (int i = 0; i < r.n; i++) CHECK(r.slot[i] != 3 && r.slot[i] != 4);     /* slot 4's names slot 1 */

    /* torn: block 50 written into slot 0, then slot 0's old payload put back */
    uint8_t *old = aligned(12288), *neu = aligned(12288), *got0 = aligned(12288), *got1 = aligned(12288);
    CHECK(pread(fd, old, 12288, 4096) == 12288);
    int32_t t[TOK];
    tokens_of(t, 50);
    fill(neu, 12288, 50);
    CHECK(st_kv_ssd_write(a, 0, 150, 149, t, neu) == STRATA_OK);
    int64_t sl[1];
    bool k[1];
    CHECK(collect(a, 1, sl, k) == 1 && sl[0] == 0 && k[0]);
    const int64_t s0[2] = {0, 0};
    const uint64_t h[2] = {150, 100};
    void *const into[2] = {got0, got1};
    bool kk[2] = {false, true};
    CHECK(st_kv_ssd_read(a, s0, h, into, 2, kk) == STRATA_OK && kk[0] && !kk[1]);
    CHECK(!memcmp(got0, neu, PAYLOAD));
    CHECK(pwrite(fd, old, 12288, 4096) == 12288); /* the new header stays, the old payload is back */
    kk[0] = kk[1] = true;
    CHECK(st_kv_ssd_read(a, s0, h, into, 2, kk) == STRATA_OK && !kk[0] && !kk[1]);
    free(got0);
    free(got1);
    close(fd);
    free(old);
    free(neu);
    st_kv_ssd_close(a);

    /* a smaller cap: the file is cut to 4 slots, their blocks stay (slot 0 is torn, slot 2 damaged) */
    pa.max_bytes = 4 * SLOT + SLOT / 2;
    a = NULL;
    CHECK(st_kv_ssd_open(&pa, &a) == STRATA_OK);
    struct stat sb;
    CHECK(stat(a_path, &sb) == 0 && sb.st_size == 4 * SLOT);
    if (a) {
        CHECK(st_kv_ssd_slots(a) == 4);
        r.n = 0;
        CHECK(st_kv_ssd_scan(a, on_block, &r, &found) == STRATA_OK && found == 3); /* 0 (its header is fine), 1, 2 */
        read_blocks(a, 4, ok, &equal);
        CHECK(!ok[0] && ok[1] && !ok[2] && !ok[3] && equal == 1);
    }
    st_kv_ssd_close(a);
}

static void check_injected_enospc(const char *dir) {
    st_kv_ssd_params p = params(dir, 0xc3, 8);
    p.fail_write_nth = 2;
    st_kv_ssd *s = NULL;
    CHECK(st_kv_ssd_open(&p, &s) == STRATA_OK);
    if (!s) return;
    log_reset();
    uint8_t *bufs[3];
    for (int i = 0; i < 3; i++) bufs[i] = aligned(12288);
    write_blocks(s, 3, bufs);
    int64_t sl[4];
    bool k[4];
    CHECK(collect(s, 3, sl, k) == 3 && sl[0] == 0 && k[0] && sl[1] == 1 && !k[1] && sl[2] == 2 && k[2]);
    CHECK_MSG(log_count() == 1 && strstr(g_log.warn[0], "slot 1") && strstr(g_log.warn[0], "No space left on device") &&
                  strstr(g_log.warn[0], st_kv_ssd_path(s)),
              "%d warnings: %s", log_count(), log_count() ? g_log.warn[0] : "");
    if (log_count() > 0) printf("  injected ENOSPC -> %s\n", g_log.warn[0]);
    bool ok[4];
    int equal = 0;
    read_blocks(s, 3, ok, &equal);
    CHECK(ok[0] && !ok[1] && ok[2] && equal == 2);
    st_kv_ssd_stats ss;
    st_kv_ssd_get_stats(s, &ss);
    CHECK(ss.writes == 3 && ss.write_failures == 1 && ss.bytes_written == 2 * SLOT);
    st_kv_ssd_close(s);
    for (int i = 0; i < 3; i++) free(bufs[i]);
}

/* In a child: a file size limit of 3 slots; writes of 6 slots; 3 fail. */
static int fsize_child(const char *dir, bool pread_only) {
    g_test_failures = 0; /* this process's own checks */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 3 * SLOT, .rlim_max = 3 * SLOT};
    CHECK(setrlimit(RLIMIT_FSIZE, &rl) == 0);
    st_kv_ssd_params p = params(dir, pread_only ? 0xd4 : 0xd5, 8);
    p.force_pread = pread_only;
    st_kv_ssd *s = NULL;
    CHECK(st_kv_ssd_open(&p, &s) == STRATA_OK);
    if (!s) return 1;
    log_reset();
    uint8_t *bufs[6];
    for (int i = 0; i < 6; i++) bufs[i] = aligned(12288);
    write_blocks(s, 6, bufs);
    int64_t sl[8];
    bool k[8];
    CHECK(collect(s, 6, sl, k) == 6);
    for (int i = 0; i < 6; i++)
        CHECK_MSG(sl[i] == i && k[i] == (i < 3), "%s: completion %d: slot %lld ok %d",
                  pread_only ? "pwrite" : "default", i, (long long)sl[i], k[i]);
    CHECK_MSG(log_count() == 1 && strstr(g_log.warn[0], "File too large") &&
                  strstr(g_log.warn[0], "the disk or the file size limit is full"),
              "%d warnings: %s", log_count(), log_count() ? g_log.warn[0] : "");
    if (log_count() > 0) printf("  file size limit (%s) -> %s\n", pread_only ? "pwrite" : "default", g_log.warn[0]);
    bool ok[8];
    int equal = 0;
    read_blocks(s, 6, ok, &equal);
    CHECK(ok[0] && ok[1] && ok[2] && !ok[3] && !ok[4] && !ok[5] && equal == 3);
    st_kv_ssd_close(s);
    for (int i = 0; i < 6; i++) free(bufs[i]);
    fflush(stdout); /* the child leaves with _exit */
    return g_test_failures ? 1 : 0;
}

static void check_file_size_limit(const char *dir) {
    for (int mode = 0; mode < 2; mode++) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) _exit(fsize_child(dir, mode == 1));
        int status = 0;
        CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "file size limit (%s): the child failed (status %d)",
                  mode ? "pwrite" : "default", status);
    }
}

static void check_queue_full(const char *dir) {
    st_kv_ssd_params p = params(dir, 0xe5, 80);
    p.payload_bytes = 4096;
    p.max_bytes = 80 * 8192;
    st_kv_ssd *s = NULL;
    CHECK(st_kv_ssd_open(&p, &s) == STRATA_OK);
    if (!s) return;
    uint8_t *buf = aligned(4096);
    fill(buf, 4096, 1);
    int32_t t[TOK] = {0};
    int accepted = 0;
    for (int i = 0; i < ST_KV_SSD_MAX_WRITES; i++) accepted += st_kv_ssd_write(s, i, 1000 + (uint64_t)i, 0, t, buf) == 0;
    CHECK(accepted == ST_KV_SSD_MAX_WRITES);
    CHECK_ERR(st_kv_ssd_write(s, 70, 7, 0, t, buf), STRATA_ERR_BUSY, "64 writes queued", "slot 70 not written");
    st_kv_ssd_flush(s);
    CHECK_ERR(st_kv_ssd_write(s, 70, 7, 0, t, buf), STRATA_ERR_BUSY, "64 writes"); /* finished but not polled */
    st_kv_ssd_done d[80];
    int64_t n = st_kv_ssd_poll(s, d, 10);
    CHECK(n == 10 && d[0].slot == 0 && d[9].slot == 9);
    n += st_kv_ssd_poll(s, d + 10, 80);
    int good = 0;
    for (int64_t i = 0; i < n; i++) good += d[i].ok && d[i].slot == i;
    CHECK_MSG(n == 64 && good == 64, "%lld completions, %d ok in order", (long long)n, good);
    CHECK(st_kv_ssd_write(s, 70, 7, 0, t, buf) == STRATA_OK);
    st_kv_ssd_close(s); /* flushes; the completion is dropped */
    free(buf);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/strata-kvssd-XXXXXX");
    if (!mkdtemp(g_root)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    st_log_set(on_log, &g_log, STRATA_LOG_WARN);
    char d1[300], d2[300], d3[300], d4[300], d5[300];
    snprintf(d1, sizeof d1, "%s/kv", g_root); /* created by the store */
    snprintf(d2, sizeof d2, "%s/pread", g_root);
    snprintf(d3, sizeof d3, "%s/enospc", g_root);
    snprintf(d4, sizeof d4, "%s/fsize", g_root);
    snprintf(d5, sizeof d5, "%s/queue", g_root);

    check_bad_params();
    check_roundtrip(d1, 0xa1, false);
    check_roundtrip(d2, 0xa1, true);
    check_identities_and_damage(d1);
    check_injected_enospc(d3);
    check_file_size_limit(d4);
    check_queue_full(d5);

    st_log_set(NULL, NULL, STRATA_LOG_INFO);
    nftw(g_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    struct stat sb;
    CHECK(stat(g_root, &sb) != 0);
    return test_finish("test_kv_ssd");
}

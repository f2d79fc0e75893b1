/* The P-D KV data path's rate between two processes of this host (UCX through
 * disagg/pd_xfer), beside the host memory copy bandwidth measured in the same
 * run: a sender process pushes `layers` messages of `blocks` x `layer_bytes`
 * (one layer of a run of blocks each, as a prefill node does) to a receiver
 * process that expects them in its own blocks, `rounds` times; the rate is
 * bytes / the time from the first send to the last landing.
 *
 *   bench_pd_xfer [layers 32] [blocks 128] [layer_bytes 65536] [rounds 4]
 *
 * (Llama-3-8B bf16, blocks of 16 tokens: 32 layers, 64 KiB per block and layer;
 * 128 blocks = a 2048-token prefill chunk: 6.25 MB per message.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"
#include "disagg/pd_xfer.h"

static volatile int g_done;
static void on_done(void *user, uint64_t ticket, strata_status st) {
    (void)user;
    (void)ticket;
    g_done = st == STRATA_OK ? 1 : -1;
}
static volatile long g_sent;
static void on_sent(void *user, strata_status st) {
    (void)user;
    if (st == STRATA_OK) __atomic_add_fetch(&g_sent, 1, __ATOMIC_SEQ_CST);
}

int main(int argc, char **argv) {
    const long L = argc > 1 ? atol(argv[1]) : 32, NB = argc > 2 ? atol(argv[2]) : 128;
    const size_t LB = argc > 3 ? (size_t)atol(argv[3]) : 65536;
    const int rounds = argc > 4 ? atoi(argv[4]) : 4;
    const size_t msg = (size_t)NB * LB, total = msg * (size_t)L;
    int up[2], down[2];
    if (pipe(up) || pipe(down)) return 1;
    const pid_t pid = fork();
    if (pid == 0) { /* receiver */
        pd_xfer *x = NULL;
        if (pd_xfer_create(&x)) return 1;
        size_t alen;
        const void *a = pd_xfer_address(x, &alen);
        uint8_t *mem = malloc(total);
        memset(mem, 0, total);
        void **dst = malloc((size_t)NB * sizeof *dst);
        for (long k = 0; k < NB; k++) dst[k] = mem + (size_t)k * LB * (size_t)L; /* host-tier block layout */
        if (write(up[1], &alen, sizeof alen) < 0 || write(up[1], a, alen) < 0) return 1;
        for (int r = 0; r < rounds; r++) {
            g_done = 0;
            pd_xfer_expect(x, (uint64_t)r + 1, L, LB, 0, NB, dst, on_done, NULL);
            char go = 1;
            if (write(up[1], &go, 1) < 0) return 1; /* expected: the sender may start */
            while (!g_done) usleep(50);
            pd_xfer_forget(x, (uint64_t)r + 1);
            if (write(up[1], (const char *)&g_done, 1) < 0) return 1;
        }
        char c;
        if (read(down[0], &c, 1) < 0) return 1;
        pd_xfer_destroy(x);
        return 0;
    }
    size_t alen = 0;
    if (read(up[0], &alen, sizeof alen) != sizeof alen) return 1;
    uint8_t *addr = malloc(alen);
    if (read(up[0], addr, alen) != (ssize_t)alen) return 1;
    pd_xfer *x = NULL;
    pd_peer *peer = NULL;
    if (pd_xfer_create(&x) || pd_xfer_connect(x, addr, alen, &peer)) {
        fprintf(stderr, "bench_pd_xfer: %s\n", st_last_error());
        return 1;
    }
    uint8_t *src = malloc(total);
    for (size_t i = 0; i < total; i++) src[i] = (uint8_t)(i * 31u);
    /* the copy bandwidth of this host, measured now */
    uint8_t *tmp = malloc(total);
    double best_copy = 0;
    for (int i = 0; i < 3; i++) {
        const double t = st_time_now();
        memcpy(tmp, src, total);
        const double bw = (double)total / (st_time_now() - t);
        if (bw > best_copy) best_copy = bw;
    }
    double best = 0;
    for (int r = 0; r < rounds; r++) {
        char c;
        if (read(up[0], &c, 1) != 1) return 1;
        g_sent = 0;
        const double t0 = st_time_now();
        for (long l = 0; l < L; l++) {
            const pd_msg h = {.ticket = (uint64_t)r + 1, .attempt = 1, .layer = (uint32_t)l, .first_block = 0,
                              .n_blocks = NB};
            pd_xfer_send(x, peer, &h, src + (size_t)l * msg, msg, on_sent, NULL);
        }
        if (read(up[0], &c, 1) != 1 || c != 1) {
            fprintf(stderr, "bench_pd_xfer: round %d did not land\n", r);
            return 1;
        }
        const double dt = st_time_now() - t0, bw = (double)total / dt;
        if (bw > best) best = bw;
        printf("round %d: %.1f MB in %ld messages of %.2f MB: %.3f s, %.2f GB/s\n", r, (double)total / 1e6, L,
               (double)msg / 1e6, dt, bw / 1e9);
    }
    printf("pd_xfer between two processes: best %.2f GB/s = %.0f%% of this host's memcpy (%.2f GB/s, same run)\n",
           best / 1e9, 100 * best / best_copy, best_copy / 1e9);
    char c = 0;
    if (write(down[1], &c, 1) < 0) return 1;
    waitpid(pid, NULL, 0);
    pd_xfer_destroy(x);
    return 0;
}

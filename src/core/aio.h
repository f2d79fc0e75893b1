/* core/aio: a queue of aligned reads and writes on plain file descriptors,
 * shared by the weight streamer (weights/ssd) and the KV cache's SSD tier
 * (kv/kv_ssd).
 *
 * Requests go through io_uring (liburing) with up to `depth` in flight. When
 * io_uring is not available (kernel, seccomp, or built without liburing) or
 * force_pread is set, each request is done with pread / pwrite at submission,
 * one at a time (its result still waits for st_aio_reap), and the log says so
 * once per queue (unless forced).
 *
 * Requests name their file descriptor and a file name (for messages); the
 * queue neither opens nor closes files. A request on a descriptor opened with
 * O_DIRECT (`direct`) must have its offset, length and buffer aligned to
 * ST_AIO_ALIGN (4096), checked at submission.
 *
 * Reads: `need` <= len says how many bytes must come back: an aligned range
 * may run past the end of the file, but a read that ends before `need` bytes
 * is a short read, an error. Writes: all `len` bytes must go out. A partial
 * transfer short of that (not at the end of the file for reads) is continued
 * where it stopped (for O_DIRECT only from an aligned position; otherwise it
 * is reported as short).
 *
 * Errors (st_aio_reap): STRATA_ERR_IO whose message names the file, the
 * offset, the length and the errno text ("read of F at offset O (L bytes)
 * failed: No space left on device"), or the bytes that came back of a short
 * transfer; st_aio_result gives the errno to callers that react by kind.
 *
 * Faults (tests): a request may carry an errno it fails with without reaching
 * the file, or (reads) come back short as if the file ended in its middle.
 *
 * A queue belongs to one thread at a time (no locking inside). */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "strata.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ST_AIO_ALIGN 4096u     /* O_DIRECT alignment: file offsets, lengths, buffers */
#define ST_AIO_MAX_LEN (1u << 30) /* the largest single request */

typedef struct st_aio st_aio;

typedef struct {
    int fd;
    const char *name;  /* the file, in messages; borrowed until the request is reaped */
    bool write;        /* false: read */
    bool direct;       /* fd was opened with O_DIRECT: off, len and buf aligned to ST_AIO_ALIGN */
    uint64_t off;
    uint64_t len;      /* 1 .. ST_AIO_MAX_LEN */
    uint64_t need;     /* reads: bytes that must come back (<= len); ignored for writes (all of len) */
    void *buf;         /* stays valid and untouched until the request is reaped */
    uint64_t tag;      /* comes back from st_aio_reap */
    int fail_errno;    /* tests: fails with this errno without reaching the file (0: no) */
    bool fail_short;   /* tests (reads): half of `need` (aligned down) comes back, then end of file */
} st_aio_req;

typedef struct {
    uint64_t tag;
    int err;        /* errno of a failed request; 0 when it succeeded or was short */
    uint64_t done;  /* bytes transferred */
} st_aio_result;

/* A queue of at most `depth` requests in flight (clamped to 1..4096).
 * force_pread skips io_uring. `what` (e.g. "weights") names the user in the
 * log line of the pread fallback. The caller owns *out. */
strata_status st_aio_init(int depth, bool force_pread, const char *what, st_aio **out);
/* Waits for the requests in flight, then frees the queue; NULL is a no-op. */
void st_aio_free(st_aio *q);
bool st_aio_uring(const st_aio *q);
int st_aio_inflight(const st_aio *q);
int st_aio_depth(const st_aio *q);

/* Queues *r (copied). STRATA_ERR_INVALID_ARG naming the file for a bad
 * length, a NULL buffer or (direct) a misaligned offset, length or buffer;
 * STRATA_ERR_INTERNAL when `depth` requests are in flight already. With
 * pread / pwrite the transfer happens here. */
strata_status st_aio_submit(st_aio *q, const st_aio_req *r);

/* Takes one finished request: *got = false when none is finished and !wait
 * (or nothing is in flight). A failed or short request returns STRATA_ERR_IO
 * with the message above; *res (tag, errno, bytes) is set whenever *got. */
strata_status st_aio_reap(st_aio *q, bool wait, bool *got, st_aio_result *res);

#ifdef __cplusplus
}
#endif

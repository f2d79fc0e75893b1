/* weights/ssd: aligned direct reads of the model files.
 *
 * st_ssd_files opens every file of a model a second time with O_DIRECT (the
 * loader's mapping stays for resident weights and embedding rows), remembers
 * each file's identity (device, inode, size, mtime) and checks it on demand:
 * a file truncated, rewritten or touched while in use is reported instead of
 * feeding wrong bytes to the model. Where O_DIRECT is refused (tmpfs, some
 * network file systems) the file is read through the page cache, and the log
 * says so. One st_ssd_files is shared by all threads.
 *
 * st_ssd_queue issues reads with many requests in flight through io_uring
 * (liburing); when io_uring is not available (kernel, seccomp, or built
 * without liburing) it falls back to pread, one request at a time, and logs
 * that. It is core/aio's queue (shared with the KV cache's SSD tier) plus the
 * files' table and fault counter. A queue belongs to one thread.
 *
 * Reads: file offset, length and buffer aligned to ST_WG_ALIGN (4096), as
 * O_DIRECT requires. `need` <= len says how many bytes must come back: an
 * aligned range may run past the end of the file, but a read that ends before
 * `need` bytes is a short read, an error. A partial read short of `need` that
 * is not at the end of the file is continued where it stopped.
 *
 * Faults (tests): st_ssd_faults makes the Nth read (counted from 1 over all
 * queues of a files object, in submission order) fail with EIO, or come back
 * short as if the file ended in its middle; or every read slow: its buffer is
 * filled with a poison pattern (0xA5 bytes) at submission and the read itself
 * is issued `delay_ms` later (at the first st_ssd_reap from then on, which
 * sleeps when it waits), so that a reader of the buffer before the read is
 * reaped sees the poison instead of the weights. */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t fail_nth;  /* 0: never; N: the Nth read fails with EIO */
    int64_t short_nth; /* 0: never; N: the Nth read returns half of its bytes, then end of file */
    int delay_ms;      /* 0: none; every read lands this many milliseconds after its submission */
} st_ssd_faults;

typedef struct st_ssd_files st_ssd_files;
typedef struct st_ssd_queue st_ssd_queue;

/* Opens the files of `m` for direct reads (`direct` false: page cache).
 * Borrows `m`; the caller owns *out. Fails when a file cannot be opened or is
 * no longer the file that was mapped (size or inode differ). */
strata_status st_ssd_files_open(const st_model_files *m, bool direct, const st_ssd_faults *faults,
                                st_ssd_files **out);
void st_ssd_files_close(st_ssd_files *f); /* NULL is a no-op */
/* STRATA_ERR_IO naming the file when any file's size or mtime changed since
 * it was opened. Thread-safe; one fstat per file. */
strata_status st_ssd_files_check(st_ssd_files *f);
/* True when every file is read with O_DIRECT. */
bool st_ssd_files_direct(const st_ssd_files *f);
/* Reads submitted so far over all queues (the fault counter). */
int64_t st_ssd_files_reads(const st_ssd_files *f);

/* A queue of at most `depth` reads in flight. force_pread skips io_uring. */
strata_status st_ssd_queue_init(st_ssd_files *f, int depth, bool force_pread, st_ssd_queue **out);
void st_ssd_queue_free(st_ssd_queue *q); /* waits for reads in flight; NULL is a no-op */
bool st_ssd_queue_uring(const st_ssd_queue *q);
int st_ssd_queue_inflight(const st_ssd_queue *q);
int st_ssd_queue_depth(const st_ssd_queue *q);

/* Queues a read of [off, off + len) of file `file` into dst; `tag` comes back
 * from st_ssd_reap. Requires st_ssd_queue_inflight(q) < depth. With pread the
 * read happens here (its result waits for st_ssd_reap). */
strata_status st_ssd_submit(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                            uint64_t tag);
/* Takes one finished read: *got = false when none is finished and !wait (or
 * nothing is in flight). A failed or short read returns STRATA_ERR_IO whose
 * message names the file, the offset and what happened (*tag is still set). */
strata_status st_ssd_reap(st_ssd_queue *q, bool wait, bool *got, uint64_t *tag);

/* Reads [off, off + len) of a file into dst (aligned), in pieces of at most
 * `piece` bytes with the queue full; returns when all are done. */
strata_status st_ssd_read(st_ssd_queue *q, int file, uint64_t off, uint64_t len, uint64_t need, void *dst,
                          uint64_t piece);

#ifdef __cplusplus
}
#endif

/* kv/kv_ssd: the KV cache's SSD tier, as storage: a file of fixed-size slots,
 * each holding one KV block (a header + an opaque payload).
 *
 * Pure storage. The caller (the KV tier manager) owns the index (which block
 * hash lives in which slot), slot allocation and eviction; this store only
 * writes a block into a slot, reads slots back and, at startup, lists the
 * valid blocks a previous run left in the file.
 *
 * File: DIR/strata-kv-<identity as 16 hex digits>.blocks, beside it
 * DIR/strata-kv-<16 hex>.txt holding identity_text (rewritten at each open).
 * The identity is the caller's hash of everything that makes a payload
 * meaningful (model, KV dtype, block size, layout): reopening with the same
 * identity keeps the file, and so the blocks, across restarts; files of other
 * identities in DIR are left alone (one warning says how many). A store locks
 * its file (flock): a second store of the same identity and DIR, in this
 * process or another, is refused.
 *
 * Slot i sits at offset i * slot_bytes, slot_bytes = 4096 (header) + payload
 * rounded up to 4096. The header (native byte order; the file is a host-local
 * cache) holds a magic, a version, the identity, the slot index, the block's
 * hash and parent hash, its block_tokens token ids, the payload size, an
 * XXH3-64 checksum of the payload bytes, and an XXH3-64 checksum of the
 * header itself. A header and its payload go out as two writes: whatever a
 * crash, a full disk or a torn write leaves behind fails the checks at read
 * (never an error: the block is simply not there).
 *
 * Size: the file never grows past `max_bytes` (slots = max_bytes /
 * slot_bytes); a longer file left by an earlier run is truncated. When the
 * file system has less room than that (free space + the file's current
 * size), the store uses fewer slots and warns: a full disk means fewer cached
 * blocks, never a failure (possibly 0 slots: the store then caches nothing).
 * Writes that still fail (another user filled the disk, a file size limit,
 * an I/O error) come back as failed completions.
 *
 * I/O: O_DIRECT where the file system allows it, else through the page cache
 * (the log says which, at info), through core/aio: io_uring, else
 * pread/pwrite. Writes are done by a writer thread the store owns, from a
 * bounded queue; reads happen on the calling thread, many in flight.
 *
 * Threads: st_kv_ssd_write / poll / flush may be called from any thread and
 * run concurrently with st_kv_ssd_read / scan (reads and scans are
 * serialized among themselves) and st_kv_ssd_get_stats. open and close are
 * not concurrent with anything. A slot must not be read while a write to it
 * is queued or in flight (the caller's index does not list it then); if it
 * is, the read sees a torn block and reports ok = false. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ST_KV_SSD_HEADER_BYTES 4096u
#define ST_KV_SSD_MAX_WRITES 64     /* default bound of the write queue */

typedef struct {
    const char *dir;            /* created if missing (one level, mode 0755); STRATA_ERR_IO naming it if impossible */
    uint64_t max_bytes;         /* size cap of the file (--kv-ssd-size): at least one slot, else INVALID_ARG
                                   naming --kv-ssd-size and the minimum */
    uint64_t payload_bytes;     /* bytes of one block's payload: 1 .. 1 GiB */
    int64_t block_tokens;       /* token ids in each header: 1 .. ST_KV_SSD_MAX_TOKENS (the 4096-byte header) */
    uint64_t identity;          /* hash of the model identity (the caller computes it) */
    const char *identity_text;  /* human-readable identity, written to the .txt beside the file (NULL: none) */
    bool force_pread;           /* skip io_uring */
    int max_writes;             /* bound of the write queue: writes queued, in flight or not yet polled
                                   (0: ST_KV_SSD_MAX_WRITES; at most 1024) */
    int64_t fail_write_nth;     /* tests: the Nth st_kv_ssd_write accepted (from 1) fails with ENOSPC
                                   without reaching the file (0: never) */
} st_kv_ssd_params;

/* The most token ids a 4096-byte header holds. */
#define ST_KV_SSD_MAX_TOKENS ((int64_t)((ST_KV_SSD_HEADER_BYTES - 80) / 4))

typedef struct st_kv_ssd st_kv_ssd;

/* Opens (creating DIR and the file where missing) the store of p->identity in
 * p->dir and starts its writer thread. Borrows nothing: *p may go after the
 * call. Errors: STRATA_ERR_INVALID_ARG naming the parameter (max_bytes as
 * --kv-ssd-size, with the minimum; payload_bytes; block_tokens, with the
 * maximum), STRATA_ERR_IO naming the directory or file (cannot create or
 * open, not a directory, locked by another store), STRATA_ERR_NOMEM. The
 * caller owns *out (NULL on error). */
strata_status st_kv_ssd_open(const st_kv_ssd_params *p, st_kv_ssd **out);
/* Flushes the queued writes, joins the writer, closes the file; NULL is a no-op. */
void st_kv_ssd_close(st_kv_ssd *s);

int64_t st_kv_ssd_slots(const st_kv_ssd *s);                /* slots usable: 0 .. max_bytes / slot_bytes */
size_t st_kv_ssd_payload_alloc_bytes(const st_kv_ssd *s);   /* payload rounded up to 4096: the size of the
                                                               (4096-aligned) buffers callers pass */
uint64_t st_kv_ssd_slot_bytes(const st_kv_ssd *s);          /* 4096 + st_kv_ssd_payload_alloc_bytes */
const char *st_kv_ssd_path(const st_kv_ssd *s);             /* DIR/strata-kv-<16 hex>.blocks */

/* Called by st_kv_ssd_scan for each valid block: `tokens` (n_tokens =
 * block_tokens ids) is valid during the call only. The callback must not call
 * st_kv_ssd_read or st_kv_ssd_scan. */
typedef void (*st_kv_ssd_scan_fn)(int64_t slot, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                                  int64_t n_tokens, void *user);

/* Startup: reads every slot's header (those the file reaches) and calls cb,
 * in slot order, for each valid one: magic, version, identity, block
 * geometry, header checksum and slot index all right. Headers only: payload
 * checksums are checked at read. *n_found = the number of valid blocks.
 * Unreadable or invalid headers are skipped (counted in the info line it
 * logs), never an error; errors are for bad arguments only. Meant for
 * startup, before the first write (a slot being written may read as
 * invalid). */
strata_status st_kv_ssd_scan(st_kv_ssd *s, st_kv_ssd_scan_fn cb, void *user, int64_t *n_found);

/* Queues the write of one block into `slot` (0 .. slots - 1): the header
 * (hash, parent_hash, block_tokens ids copied from `tokens` now, checksums
 * computed by the writer thread) and the payload. `payload` (4096-aligned,
 * st_kv_ssd_payload_alloc_bytes long; its first payload_bytes are the block)
 * must stay valid and unchanged until the write's completion is polled.
 * STRATA_ERR_BUSY when max_writes writes are queued, in flight or finished
 * but not polled: the caller simply does not cache that block (or polls and
 * tries again). STRATA_ERR_INVALID_ARG for a slot out of range, a slot with a
 * write queued or in flight, or a NULL / misaligned buffer. The slot holds
 * nothing valid from this call until its completion says ok. */
strata_status st_kv_ssd_write(st_kv_ssd *s, int64_t slot, uint64_t hash, uint64_t parent_hash,
                              const int32_t *tokens, const void *payload);

typedef struct {
    int64_t slot;
    bool ok;
} st_kv_ssd_done;

/* Non-blocking: takes up to `max` finished writes, oldest first. ok = false:
 * the write failed (full disk ENOSPC / EDQUOT, file size limit EFBIG, EIO,
 * short): logged as a warning once per kind of failure (the first message
 * names the file, offset and error), counted; the slot holds nothing valid.
 * Returns how many were written to out. */
int64_t st_kv_ssd_poll(st_kv_ssd *s, st_kv_ssd_done *out, int64_t max);

/* Waits until every queued write has finished (its completion still waits
 * for st_kv_ssd_poll). For shutdown and tests. */
void st_kv_ssd_flush(st_kv_ssd *s);

/* Reads n slots, synchronously on the calling thread (its own queue, many in
 * flight): slot slots[i]'s payload into payloads[i] (4096-aligned,
 * st_kv_ssd_payload_alloc_bytes long). ok[i] = the header is valid, names
 * this identity, slot slots[i] and hash expect_hash[i], AND the payload
 * checksum matches. A torn, corrupt, never written or unreadable block is
 * ok[i] = false (counted, logged at debug), never an error; payloads[i] then
 * holds unspecified bytes. Errors (STRATA_ERR_INVALID_ARG) only for bad
 * arguments (NULL arrays, a slot out of range, a NULL or misaligned buffer),
 * before anything is read. Callable while the writer thread writes other
 * slots. */
strata_status st_kv_ssd_read(st_kv_ssd *s, const int64_t *slots, const uint64_t *expect_hash,
                             void *const *payloads, int64_t n, bool *ok);

typedef struct {
    uint64_t bytes_written;   /* slot bytes of the writes that succeeded */
    uint64_t bytes_read;      /* slot bytes read (whatever the checks said) */
    int64_t writes;           /* writes finished, failed ones included */
    int64_t write_failures;   /* of which failed */
    int64_t reads;            /* slots read */
    int64_t read_failures;    /* of which ok = false */
    int64_t slots;            /* st_kv_ssd_slots */
    bool direct;              /* O_DIRECT (else the page cache) */
    bool uring;               /* io_uring (else pread/pwrite) */
} st_kv_ssd_stats;

/* A snapshot of the counters; thread-safe. */
void st_kv_ssd_get_stats(const st_kv_ssd *s, st_kv_ssd_stats *out);

#ifdef __cplusplus
}
#endif

/* kv/kv_tiers: the host and SSD tiers under the device KV pool.
 *
 * The device pool (kv/kv_pool.h) is the first tier; its blocks are named by
 * the block manager's chained hashes (kv/block_manager.h). This module keeps
 * copies of full, computed blocks further down:
 *
 *   host tier  a pool of host blocks, up to host_bytes, in 256 MiB chunks:
 *              on CUDA pinned by a thread from init on, on the CPU backend
 *              allocated as the tier fills. A block enters it when it is
 *              registered in the device prefix cache (eager offload, the
 *              default) or only when the device evicts it (lazy). Its LRU
 *              drops the least recently used unpinned block when full.
 *   SSD tier   (optional, kv/kv_ssd.h) a slot file in ssd_dir, written through
 *              from the host tier in the background as blocks arrive there
 *              (so a restart finds them: the file persists, its headers are
 *              scanned at init); LRU over its slots; a hit is read back into
 *              host blocks by a reader thread (the admission waits for it;
 *              other sequences keep running), then loaded like a host hit. A
 *              corrupt or torn block is a miss; a full disk means fewer slots.
 *
 * One index covers both: chained hash -> entry {parent hash, token ids, host
 * block, SSD slot}. A lookup of block i matches an entry only when the hash,
 * the parent's hash (h_{i-1}) and the block's token ids are all equal, so a
 * hash collision inside one block is a miss; a wrong hit needs two prompts
 * whose chained 64-bit hashes collide at an earlier block (the device tier
 * compares physical parents instead; this tier relies on XXH3's 64 bits).
 *
 * Host block layout: contiguous, per layer: K rows of the block's bs slots,
 * V rows, then (fp8) the K and V scales; rounded up to 4096 bytes (the SSD
 * payload is the host block byte for byte). Copies go through
 * backend copy_2d: one call per (layer, plane, run), a run being consecutive
 * host blocks that land in consecutive device blocks (a fresh pool hands out
 * consecutive ids, so a long prompt is typically one run: MBs per copy).
 *
 * Streams and events (no host synchronisation on the step's path):
 *   - device -> host copies run on the tiers' copy stream after an event the
 *     compute stream recorded after the pass that computed the blocks; a pass
 *     that hands such a block to new content (an eviction) before its copy
 *     completed waits for it on the device (st_kv_tiers_before_forward); a
 *     pass that writes only fresh blocks overlaps the copies;
 *   - host -> device loads are issued layer by layer when the pass begins
 *     (the pool's pass hook, called by the model right after it enqueued the
 *     batch metadata upload: queued behind 4 GB of loads on the copy engine,
 *     that upload would hold the whole pass back), one event per layer handed
 *     to the pool (st_kv_pool_set_ready): layer l's blocks arrive while layer
 *     l-1 computes;
 *   - completion is polled with event_query; a host block is rewritten (SSD
 *     read, new offload) only after every copy reading it completed, and is
 *     handed to the SSD writer only after its device copy completed.
 * On the CPU backend the copies are memcpy and the same logic runs (CI).
 *
 * Who calls what:
 *   block manager  st_kv_tiers_on_register / st_kv_tiers_on_evict (its hooks);
 *   scheduler      st_kv_tiers_lookup, st_kv_tiers_prefetch and
 *                  st_kv_tiers_load at an admission (after the device prefix:
 *                  how many more blocks the host tier holds, whether more are
 *                  coming from the SSD tier (then the admission waits), then
 *                  "bring these into these device blocks");
 *   runner         st_kv_tiers_before_forward / st_kv_tiers_after_step around
 *                  each pass.
 * Not thread safe: the stepping thread calls every function. Its own threads
 * (the pinner on CUDA, the SSD reader) touch only the chunk list and the read
 * jobs, under their locks; the SSD writer thread is kv_ssd's. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kv/kv_pool.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ST_KV_OFFLOAD_EAGER = 0, ST_KV_OFFLOAD_LAZY = 1 } st_kv_offload;
/* "eager", "lazy"; parse returns false for anything else. */
const char *st_kv_offload_name(st_kv_offload m);
bool st_kv_offload_parse(const char *s, st_kv_offload *out);

typedef struct {
    size_t host_bytes;          /* host tier capacity, >= one block */
    st_kv_offload offload;
    uint64_t hash_seed;         /* the block manager's (its default hash function is assumed) */
    const char *ssd_dir;        /* NULL or "": no SSD tier */
    uint64_t ssd_bytes;         /* SSD tier cap (its file), > 0 with ssd_dir */
    uint64_t identity;          /* the model's identity (st_kv_identity): an SSD directory of another is ignored */
    const char *identity_text;  /* readable form, written beside the SSD file */
    bool ssd_force_pread;       /* tests: no io_uring */
    int64_t ssd_fail_write_nth; /* tests: the Nth SSD write fails as on a full disk (0: never) */
} st_kv_tiers_params;

typedef struct st_kv_tiers st_kv_tiers;

/* Bytes of one block in the host tier (and of an SSD payload) for this pool. */
size_t st_kv_tiers_block_bytes(const st_kv_pool_params *p);

/* Makes the tiers under `pool` (borrowed; its backend too). With an SSD
 * directory, opens (creates) its file and scans it: blocks of earlier runs of
 * the same model become SSD-tier entries. INVALID_ARG naming the parameter
 * (--kv-host-mem, --kv-ssd-size, --kv-ssd-dir), IO when the directory cannot
 * be used. The caller owns *out (st_kv_tiers_free). */
strata_status st_kv_tiers_init(st_kv_pool *pool, const st_kv_tiers_params *p, st_kv_tiers **out);
/* Completes every copy, writes to the SSD tier the host blocks not yet there
 * (so a restart finds what this run cached), closes it and frees. NULL: no-op. */
void st_kv_tiers_free(st_kv_tiers *t);

/* ---- block manager hooks (st_bm_params.on_register / on_evict, tier_user = t) */
void st_kv_tiers_on_register(int32_t block, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                             int64_t n_tokens, void *tiers);
void st_kv_tiers_on_evict(int32_t block, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                          int64_t n_tokens, void *tiers);
/* The device cache was dropped without evictions (st_bm_clear_cache): its
 * blocks may be rewritten by the next pass, which then waits for their copies
 * down. */
void st_kv_tiers_device_dropped(st_kv_tiers *t);

/* ---- scheduler: admissions -------------------------------------------------------
 * Blocks from_block, from_block+1, ... of tokens[0..n_tokens) that the host
 * tier holds now, continuing the chain (the last token is never counted, like
 * st_bm_lookup). No side effects. */
int64_t st_kv_tiers_lookup(const st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block);
/* The chain's blocks from from_block on that only the SSD tier holds start
 * coming into host blocks, read by the tiers' reader thread (the stepping
 * thread never waits for the disk); returns how many blocks of the chain from
 * there are on their way (0: nothing to wait for). A block that reads back
 * torn or corrupt is dropped (the chain's hit ends before it). */
int64_t st_kv_tiers_prefetch(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block);
/* Whether SSD reads are in flight; st_kv_tiers_wait_reads blocks until one
 * batch is back (a runner with nothing else to do waits there, not spinning). */
bool st_kv_tiers_reading(const st_kv_tiers *t);
void st_kv_tiers_wait_reads(st_kv_tiers *t);
/* Brings blocks [from_block, from_block + n_blocks) of tokens, host-tier
 * blocks (st_kv_tiers_lookup), into device blocks dev_blocks[0..n_blocks)
 * before this step's pass: the copies are issued by the pass (the pool's pass
 * hook). Returns how many leading blocks will be there. */
int64_t st_kv_tiers_load(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                         int64_t n_blocks, const int32_t *dev_blocks);

/* ---- P-D: blocks computed by another node (a prefill node) ------------------------
 * A decode node reserves host blocks for the blocks a prefill node will push
 * (taken off the free list: never evicted, never handed out, not in the
 * index), lets the transfer write them (st_kv_tiers_host_block: layer l of a
 * block at l * layout.layer_bytes, st_kv_block_layout), then adopts them:
 * they enter the index as blocks [from_block, from_block + n) of tokens, as
 * if offloaded from the device (so an admission finds them like any host
 * hit; the SSD tier writes them through). Stepping thread only, like the rest.
 * reserve: NOMEM naming --kv-host-mem when the tier cannot give n blocks now
 * (none taken then). adopt returns how many entered the index (a block the
 * tier already holds goes back to the free list instead). unreserve gives
 * reserved blocks back (a cancelled transfer: the caller makes sure nothing
 * writes them any more). */
strata_status st_kv_tiers_reserve(st_kv_tiers *t, int64_t n, int64_t *host_blocks);
void st_kv_tiers_unreserve(st_kv_tiers *t, const int64_t *host_blocks, int64_t n);
void *st_kv_tiers_host_block(const st_kv_tiers *t, int64_t host_block);
int64_t st_kv_tiers_adopt(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block, int64_t n,
                          const int64_t *host_blocks);

/* A decode node's adopted blocks, brought to the device ahead of their
 * request's admission (so that its pass does not wait for ~1 GB of loads):
 * blocks [from_block, from_block + n) of tokens, all in the host tier
 * (st_kv_tiers_lookup), into device blocks dev_blocks[0..n) now, on the copy
 * stream, between passes (nothing waits for them: the caller holds the device
 * blocks privately until st_kv_tiers_copied(ticket) says they are there).
 * *ticket: the copies' batch. */
strata_status st_kv_tiers_preload(st_kv_tiers *t, const int32_t *tokens, int64_t n_tokens, int64_t from_block,
                                  int64_t n, const int32_t *dev_blocks, uint64_t *ticket);
bool st_kv_tiers_copied(st_kv_tiers *t, uint64_t ticket);

/* ---- runner: around one pass ------------------------------------------------------
 * Before the pass, on `compute` (the model's stream): issues the device ->
 * host copies of blocks the device evicted this step (lazy offload) and makes
 * the stream wait for copies out of blocks it may now overwrite. This step's
 * loads are issued by the pass itself (the pool's pass hook), layer by layer
 * with their events in the pool. */
strata_status st_kv_tiers_before_forward(st_kv_tiers *t, st_stream *compute);
/* After the pass (its results are on the host: the stream has completed):
 * issues the loads if no pass did, clears the pool's events, issues the
 * offload of blocks registered in this step (eager), polls copy and SSD
 * completions, queues SSD writes. */
strata_status st_kv_tiers_after_step(st_kv_tiers *t, st_stream *compute);

typedef struct {
    int64_t block_bytes, block_tokens;
    int64_t host_blocks;        /* capacity */
    int64_t host_cached;        /* host blocks holding a block */
    int64_t host_busy;          /* of those: being copied or written to the SSD */
    int64_t host_allocated;     /* host blocks whose memory exists (the pool grows in chunks) */
    int64_t ssd_slots;          /* capacity (0: no SSD tier) */
    int64_t ssd_cached;         /* slots holding a block */
    int64_t ssd_busy;           /* slots being written */
    int64_t ssd_bad;            /* slots given up after a failed write (full disk) */
    int64_t ssd_found_at_start; /* blocks of earlier runs found by the scan */
    int64_t hit_tokens_host, hit_tokens_ssd; /* tokens loaded from each tier at admissions */
    uint64_t bytes_d2h, bytes_h2d, bytes_h2ssd, bytes_ssd2h;
    int64_t copies_d2h, copies_h2d;      /* copy calls (bytes / copies: the average transfer) */
    int64_t offloads_skipped;   /* blocks not offloaded: every host block was busy */
    int64_t ssd_read_failures;  /* corrupt / torn / unreadable blocks (misses) */
    int64_t ssd_write_failures;
    int64_t host_reserved;      /* host blocks reserved for transfers from a prefill node */
    int64_t blocks_adopted;     /* blocks that came from a prefill node into the index */
} st_kv_tiers_stats;

void st_kv_tiers_get_stats(const st_kv_tiers *t, st_kv_tiers_stats *out);

/* Waits for every copy and SSD write in flight and takes their results (tests,
 * benchmarks, shutdown). */
strata_status st_kv_tiers_drain(st_kv_tiers *t);
/* Drops every host-tier copy that is also on the SSD tier or, with
 * `all`, every host-tier copy (benchmarks: a prefix then hits the SSD tier or
 * nothing). Drains first. */
void st_kv_tiers_drop_host(st_kv_tiers *t, bool all);

#ifdef __cplusplus
}
#endif

/* kv/kv_stream: the KV cache of one sequence longer than the device, kept in
 * host memory and streamed through the device layer by layer (issue 13:
 * streaming chunked prefill and decode over host KV).
 *
 * Host: per layer, a K and a V plane of rows in the cache's dtype (row =
 * n_kv_heads x head_dim elements, key j at row j: layer-major, so that a
 * piece of keys of one layer is one contiguous copy; fp8 also a K and a V
 * scale plane), held in segments of `seg` keys (ST_KV_STREAM_SEG) allocated
 * (pinned) as the sequence grows, counted against params.host_mem.
 *
 * SSD (params.ssd_dir): when the host holds host_mem / (one segment of every
 * layer and plane) segments and the sequence needs another, the newest
 * sealed segment (all its keys stored, below len) goes whole to a private
 * file in ssd_dir (created and unlinked at once: nothing is left behind,
 * O_DIRECT where the file system allows it and the pieces are 4096-byte
 * multiples), and its host memory takes the new segment. The segments a
 * pass writes into stay on the host, so stores never touch the file; a piece
 * of a segment on the SSD is read (core/aio) into a pinned staging buffer
 * of its ring slot, then copied up as a host piece is: the bits are the same
 * as with the whole sequence in host memory. The file is capped by ssd_mem;
 * a full disk or cap is NOMEM naming --kv-ssd-size / the file, with nothing
 * lost (the segment stays on the host and the pass is not begun).
 *
 * Device, all independent of the sequence's length:
 *   - a ring of two slots of `piece` keys (K and V): the keys of earlier
 *     pieces of a layer come up through it, slot (g mod 2) for the g-th
 *     piece of the pass, the copy of piece g + 2 issued when the compute
 *     stream has read piece g (its event), so that a copy always overlaps the
 *     attention of the piece before it, across layer boundaries too;
 *   - two areas (by layer parity) of ST_ATTN_RANGE + max_tokens keys: the
 *     keys of the pass's last range start (tail_start = len rounded down to
 *     ST_ATTN_RANGE) up to len come up into rows 0.., the pass's own keys are
 *     stored after them (slot = position - tail_start) and go down to the
 *     host once the layer stored them;
 *   - an int32 iota (0, 1, 2, ...) the model gathers rows with, and the
 *     pass's metadata buffer.
 * Attention per layer (model/llama.c): pieces [0, tail_start) from the ring,
 * then the area's keys [tail_start, len + n), merged in order by the
 * backend's attention_part: the ranges of ST_ATTN_RANGE keys are those of a
 * sequence whose KV fits the pool, so the bits on the CPU are the same.
 *
 * One pass (model/forward.c), all asynchronous on the compute stream and
 * the stream's own copy stream, ordered by events (no host sync):
 *   begin(n) -> per layer: layer_begin (the area's tail comes up), the model
 *   stores the layer's K/V in the area; per piece: piece() (the compute
 *   stream waits for it) then piece_read() once gathered; the model gathers
 *   the area, then layer_end() (the pass's rows go down) -> after the pass's host sync:
 *   commit() (len += n). A pass that failed is dropped with abort().
 *
 * Not thread safe: the stepping thread owns it. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Keys per segment by default (a multiple of every piece size used). */
#define ST_KV_STREAM_SEG 65536

typedef struct st_kv_stream st_kv_stream;

typedef struct {
    int64_t n_layers, n_kv_heads, head_dim; /* >= 1 */
    st_kv_dtype dtype;   /* the pool's element type (pieces are gathered to fp32 by kv_gather); fp8 adds
                            two planes of scales (a float per key and kv head) */
    int64_t piece;       /* keys per ring slot: a multiple of ST_ATTN_RANGE dividing ST_KV_STREAM_SEG */
    int64_t max_tokens;  /* tokens of one pass, >= 1 */
    int64_t max_len;     /* keys the sequence may hold, >= 1 */
    size_t host_mem;     /* cap on the host bytes, whole segments (0: none; --kv-stream-mem) */
    int64_t seg;         /* keys per segment (0: ST_KV_STREAM_SEG): a multiple of piece and of 4096 */
    const char *ssd_dir; /* where segments go once host_mem is full (NULL: nowhere; NOMEM then); created
                            (one level) if missing; borrowed until init returns */
    uint64_t ssd_mem;    /* cap on the SSD file's bytes (0: none) */
} st_kv_stream_params;

/* The host_mem of a sequence given none (--kv-stream-mem unset): 3/4 of the
 * memory available now, leaving the rest to the process and the machine
 * (0 when unknown: no cap). */
size_t st_kv_stream_default_host_mem(void);

/* Device bytes init takes (ring, areas, iota, each rounded to 256). */
size_t st_kv_stream_device_bytes(const st_kv_stream_params *p);
/* Host bytes of a sequence of len keys (whole segments). */
size_t st_kv_stream_host_bytes(const st_kv_stream_params *p, int64_t len);

/* INVALID_ARG naming the parameter; NOMEM (device budget). The caller owns
 * *out. */
strata_status st_kv_stream_init(st_backend *be, const st_kv_stream_params *p, st_kv_stream **out);
void st_kv_stream_free(st_kv_stream *ks); /* waits for its copies; NULL is a no-op */

const st_kv_stream_params *st_kv_stream_get_params(const st_kv_stream *ks);
int64_t st_kv_stream_len(const st_kv_stream *ks);   /* keys stored on the host */
size_t st_kv_stream_host_used(const st_kv_stream *ks);
void st_kv_stream_reset(st_kv_stream *ks);          /* len = 0 (the host segments are kept) */
/* A pass's metadata buffers (model/forward.c packs them): `bytes` of pinned
 * host staging and the device buffer it is copied to, max_tokens x
 * ST_KV_STREAM_META_PER_TOKEN bytes each. */
#define ST_KV_STREAM_META_PER_TOKEN 32
void st_kv_stream_meta(st_kv_stream *ks, void **host, void **dev, size_t *bytes);
/* Bytes moved up / down since init. */
void st_kv_stream_bytes(const st_kv_stream *ks, uint64_t *h2d, uint64_t *d2h);
/* The SSD tier: bytes read from and written to the file since init, the
 * file's bytes in use now, and the segments on the SSD / on the host now. */
typedef struct {
    uint64_t read, written, file_bytes;
    int64_t ssd_segs, host_segs;
} st_kv_stream_ssd_stats;
void st_kv_stream_ssd(const st_kv_stream *ks, st_kv_stream_ssd_stats *out);
/* The SSD tier's read rate, measured now on its own file through the same
 * path (up to 512 MiB of it in 4 MiB requests, or 1/16 of a smaller
 * file, 16 in flight; not counted in the stats): *bytes_per_s = 0 when nothing is in the file yet. */
strata_status st_kv_stream_ssd_probe(st_kv_stream *ks, double *bytes_per_s);

/* Allocates (pins) the host rows of keys up to `end` now rather than as
 * passes reach them (pinning takes ~0.1-0.2 s per GB on CUDA): NOMEM naming
 * --kv-stream-mem past the cap, INVALID_ARG past max_len. With an SSD tier it
 * stops at the cap (the passes place the rest). */
strata_status st_kv_stream_reserve(st_kv_stream *ks, int64_t end);

/* ---- one pass of n tokens at positions len .. len + n - 1 (model/forward.c) ---- */
/* Reserves the host rows, moving sealed segments to the SSD tier where the
 * host is full (NOMEM naming --kv-stream-mem, or --kv-ssd-size / the file,
 * when they do not fit; IO for a failed write; INVALID_ARG past max_len or
 * n > max_tokens) and issues the first pieces.
 * `compute` is the stream the model's ops run on. cpu_keys > 0: the pass's
 * caller attends keys [0, c) itself from host memory (st_kv_stream_host_rows),
 * c = cpu_keys rounded down to a multiple of ST_ATTN_RANGE, at most the tail
 * start and the keys of the host segments before the first one on the SSD
 * (st_kv_stream_cpu_keys says what it became): the ring carries keys from c
 * on only, its first piece cut to start there. */
strata_status st_kv_stream_begin(st_kv_stream *ks, st_stream *compute, int64_t n, int64_t cpu_keys);
int64_t st_kv_stream_tail_start(const st_kv_stream *ks); /* the area's first key */
int64_t st_kv_stream_cpu_keys(const st_kv_stream *ks);   /* the pass's c (0: none) */
int64_t st_kv_stream_n_pieces(const st_kv_stream *ks);   /* ring pieces per layer: [c, tail start) */
/* Host rows of layer l from key `key` (< c) to the end of its segment or c:
 * *rows views them (row 0 = key), *n their count. Valid until the next
 * begin; the pass writes no row below c. */
strata_status st_kv_stream_host_rows(st_kv_stream *ks, int64_t l, int64_t key, st_kv_layer *rows, int64_t *n);
const int32_t *st_kv_stream_iota(const st_kv_stream *ks); /* device [piece or more] = 0, 1, ... */
/* Layer l's area (*area: rows of keys tail_start..): the compute stream
 * waits until its tail rows arrived (and its previous use went down). */
strata_status st_kv_stream_layer_begin(st_kv_stream *ks, int64_t l, st_kv_layer *area);
/* Piece k of layer l: *slot holds keys *key0 .. *key0 + *n - 1 in rows 0..;
 * the compute stream waits for its copy. */
strata_status st_kv_stream_piece(st_kv_stream *ks, int64_t l, int64_t k, st_kv_layer *slot, int64_t *key0,
                                 int64_t *n);
/* After the compute stream's last read of the current piece: its slot
 * takes the next piece of the pass. */
strata_status st_kv_stream_piece_read(st_kv_stream *ks);
/* After the compute stream's last use of layer l's area (its rows stored
 * and gathered): the pass's new rows go down to the host, and the area is
 * free for layer l + 2 once they are. */
strata_status st_kv_stream_layer_end(st_kv_stream *ks, int64_t l);
/* After the pass completed (the host synced the compute stream, which the
 * last layer_end made wait for the copy stream): len += n. */
strata_status st_kv_stream_commit(st_kv_stream *ks);
/* After a failed pass: waits for the copies; len unchanged. */
void st_kv_stream_abort(st_kv_stream *ks);

#ifdef __cplusplus
}
#endif

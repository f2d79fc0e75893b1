/* kv/kv_pool: the device memory of the paged KV cache.
 *
 * One pool per engine. Per layer a K and a V array of num_blocks * block_size
 * token slots, each slot n_kv_heads * head_dim elements of the pool's dtype
 * (backend.h, st_kv_layer: bf16 by default, fp8 e4m3 with a scale per (slot,
 * kv head), or f32 for reference checks). Slot s = block * block_size +
 * offset is the same slot in every layer; which block holds which token is
 * the block manager's business (kv/block_manager.h), not this module's.
 *
 * Beside the K/V arrays the pool owns the device and pinned host buffers
 * through which one forward pass's slot mapping and block tables travel (a
 * fixed layout sized for max_tokens tokens and tables of max_seq_len
 * positions, so that a recorded graph reads every batch's values at the same
 * addresses; model/forward.c packs them).
 *
 * How the model gets a layer's KV: st_kv_pool_acquire(pool, layer) gives the
 * layer's st_kv_layer and an event; the compute stream waits on the event
 * (NULL: nothing moving) before it reads or writes the layer. The lower tiers
 * (kv/kv_tiers.h) set these events for one pass when they load blocks into
 * the pool (st_kv_pool_set_ready: layer l's copies are done when the event
 * is), so that layer l's KV arrives while layer l-1 computes; the runner
 * clears them after the pass. st_kv_pool_release(pool, layer, done) hands
 * back the event recorded after the layer's last op (unused so far: nothing
 * moves a layer's blocks out during a pass).
 *
 * Every allocation is counted in the backend's device budget. Not thread
 * safe: the stepping thread owns it. */
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "backend/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_kv_pool st_kv_pool;

typedef struct {
    int64_t n_layers;      /* >= 1 */
    int64_t n_kv_heads;    /* >= 1 */
    int64_t head_dim;      /* >= 1 */
    int64_t num_blocks;    /* >= 1, <= INT32_MAX (ids are int32) */
    int64_t block_size;    /* token slots per block, >= 1 */
    st_kv_dtype dtype;     /* element type (ST_KV_BF16 is the engines' default) */
    int64_t max_tokens;    /* tokens of one forward pass (the batch metadata's capacity), >= 1 */
    int64_t max_seq_len;   /* positions of one sequence: block-table rows hold ceil(max_seq_len /
                              block_size) entries, >= 1 */
} st_kv_pool_params;

/* How one block's KV of one layer lies in host memory (the host tier's
 * blocks, the SSD payload, P-D transfers): `n_planes` planes (K rows, V rows,
 * then with fp8 the K and V scales), plane i at off[i], block_size rows of
 * row[i] bytes each; layer_bytes in all. A host block is n_layers such parts,
 * layer l at l * layer_bytes. */
typedef struct {
    int64_t n_planes;
    size_t row[4], off[4];
    size_t layer_bytes;
} st_kv_block_layout;
void st_kv_block_layout_get(const st_kv_pool_params *p, st_kv_block_layout *out);

/* Device bytes st_kv_pool_init takes for these params (K and V of every
 * layer, fp8 scales, the batch metadata), each allocation rounded to 256
 * bytes. 0 for invalid params. */
size_t st_kv_pool_device_bytes(const st_kv_pool_params *p);
/* K and V bytes of one token in every layer (the per-token cost of the cache,
 * fp8 scales included). */
double st_kv_pool_bytes_per_token(int64_t n_layers, int64_t n_kv_heads, int64_t head_dim, st_kv_dtype dtype);

/* Makes a pool on `be` (borrowed: it must outlive the pool). The caller owns
 * *out (st_kv_pool_free). INVALID_ARG naming the bad parameter, NOMEM when
 * the device budget or memory runs out (nothing left allocated; the message
 * says how much the pool needed). */
strata_status st_kv_pool_init(st_backend *be, const st_kv_pool_params *p, st_kv_pool **out);
/* Waits for the device, frees everything. NULL is a no-op. Recorded graphs
 * that hold the pool's pointers must be dropped first (the model does it in
 * st_llama_forget_pool). */
void st_kv_pool_free(st_kv_pool *kv);

const st_kv_pool_params *st_kv_pool_get_params(const st_kv_pool *kv);
int64_t st_kv_pool_num_blocks(const st_kv_pool *kv);
int64_t st_kv_pool_block_size(const st_kv_pool *kv);
int64_t st_kv_pool_max_blocks(const st_kv_pool *kv); /* entries of a block-table row: ceil(max_seq_len / bs) */
st_backend *st_kv_pool_backend(const st_kv_pool *kv);

/* Layer `layer`'s storage for the compute stream: *out is valid until the
 * matching release; *ready (may be NULL) must be waited on by the stream
 * before any op reads or writes it. */
strata_status st_kv_pool_acquire(st_kv_pool *kv, int64_t layer, st_kv_layer *out, st_event **ready);
/* Ends the use of `layer` started by acquire; done (may be NULL) is recorded
 * on the compute stream after the layer's last op. */
void st_kv_pool_release(st_kv_pool *kv, int64_t layer, st_event *done);

/* A hook called by the model right after it enqueued layer `layer`'s
 * attention ops (its new keys and values are stored once `compute` reaches
 * that point), for every layer of the passes run while it is set (P-D: each
 * layer's new blocks leave while the next layers compute). A pass with a
 * layer hook is never recorded as a graph (st_kv_pool_has_ready). NULL fn:
 * none. */
typedef strata_status (*st_kv_pool_layer_fn)(void *user, int64_t layer, st_stream *compute);
void st_kv_pool_set_layer_hook(st_kv_pool *kv, st_kv_pool_layer_fn fn, void *user);
strata_status st_kv_pool_layer_done(st_kv_pool *kv, int64_t layer, st_stream *compute);

/* Layer `layer`'s arrays (NULL when out of range), for the tiers' copies. */
const st_kv_layer *st_kv_pool_layer(const st_kv_pool *kv, int64_t layer);
/* The event acquire hands out for `layer` until st_kv_pool_clear_ready (NULL:
 * none). The events are the caller's (they must outlive the pass). */
void st_kv_pool_set_ready(st_kv_pool *kv, int64_t layer, st_event *ready);
/* Exports layer `layer` of device blocks blocks[0..n) into host memory dst:
 * block k's part (st_kv_block_layout) at dst + k * layout.layer_bytes; copies
 * enqueued on `stream` (copy_2d per plane and run of consecutive blocks), the
 * caller synchronizes. (P-D: a prefill node's blocks on their way out.) */
strata_status st_kv_pool_export_layer(st_kv_pool *kv, st_stream *stream, int64_t layer, const int32_t *blocks,
                                      int64_t n, void *dst);
/* The inverse, from device memory laid out as export writes it (a P-D decode
 * node's landing arena: block k's part at src + k * layout.layer_bytes) into
 * layer `layer` of device blocks blocks[0..n). */
strata_status st_kv_pool_import_layer(st_kv_pool *kv, st_stream *stream, int64_t layer, const int32_t *blocks,
                                      int64_t n, const void *src);
void st_kv_pool_clear_ready(st_kv_pool *kv);
/* Whether some layer has a ready event (a pass that waits on them is not
 * recorded as a graph: it runs directly, layer by layer). */
bool st_kv_pool_has_ready(const st_kv_pool *kv);

/* A hook the model calls once per pass, after it enqueued the batch
 * metadata upload and before the layers (the tiers issue their loads there).
 * NULL fn: none. */
typedef strata_status (*st_kv_pool_pass_fn)(void *user);
void st_kv_pool_set_pass_hook(st_kv_pool *kv, st_kv_pool_pass_fn fn, void *user);
strata_status st_kv_pool_begin_pass(st_kv_pool *kv);

/* The batch metadata buffers: `bytes` of pinned host staging and the device
 * buffer it is copied to (both owned by the pool). */
void st_kv_pool_meta(st_kv_pool *kv, void **host, void **dev, size_t *bytes);
/* Bytes the metadata of max_tokens tokens and tables of max_blocks entries
 * of block_size-slot blocks take (the layout is model/forward.c's). */
size_t st_kv_pool_meta_bytes(int64_t max_tokens, int64_t max_blocks, int64_t block_size);

#ifdef __cplusplus
}
#endif

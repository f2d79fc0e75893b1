/* kv/block_manager: host-side bookkeeping of the paged KV cache.
 *
 * The device KV pool (allocated by the runner, one K and one V array per layer)
 * is cut into num_blocks blocks of block_size token slots. Physical slot
 * s = block * block_size + offset is the same slot in every layer's K and V
 * array. This module decides which block holds which token of which sequence;
 * it never touches device memory, has no GPU dependency and is not thread safe
 * (the engine calls it from its step loop only).
 *
 * Block states (every block is in exactly one):
 *   FREE    refcount 0, holds nothing useful; on the free stack.
 *   USED    refcount > 0: in refcount sequences' block tables.
 *   CACHED  refcount 0 but registered in the prefix cache: its KV is intact and a
 *           new sequence with the same prefix can take it back (refcount 1). Kept
 *           in LRU order (by the time it was last released); allocation takes a
 *           FREE block first and only then evicts the least recently released
 *           CACHED block, removing its hash entry.
 *
 * Prefix cache. A FULL block whose KV has been computed (st_bm_commit) is
 * registered under a chained hash:
 *   h_{-1} = params.hash_seed
 *   h_i    = XXH3_64bits_withSeed(bytes of token ids [i*bs, (i+1)*bs) as
 *                                 native int32, seed = h_{i-1})
 * (st_kv_hash_tokens; params.hash_fn replaces it, e.g. in tests to force
 * collisions). The hash table maps h_i to blocks and stores, for each
 * registered block, its token ids and its parent: the physical block of
 * position i-1 plus that block's generation (bumped every time a block leaves
 * the hash table). A lookup of block i of a prompt hits a registered block only
 * when ALL of these hold: equal hash, equal token ids (compared), and the parent
 * being exactly the block matched for position i-1 (same id, same generation;
 * no parent for i == 0). By induction over the chain a hit at block i means the
 * token ids of blocks 0..i are all equal, so a hash collision can only cost a
 * miss, never return wrong KV. The same tokens at another position, or after
 * another prefix, never hit.
 *
 * Invariants (checked by st_bm_validate; tests call it after every operation):
 *   - a block's refcount equals the number of table entries naming it; a table
 *     names a block at most once;
 *   - only full, computed blocks are shared or registered; the blocks of a table
 *     at and after index n_hashed (the partially filled last block and blocks
 *     whose KV is not all computed yet) are private (refcount 1) and unregistered.
 *     Nobody writes into a shared block, so no copy-on-write is needed: new
 *     tokens always go to the table's private tail (st_bm_append_slots asserts
 *     it);
 *   - with the prefix cache on, every full computed block of a table is
 *     registered: n_hashed == n_computed / block_size;
 *   - FREE + CACHED + USED == num_blocks;
 *   - chains are never broken: a registered block's parent is registered (same
 *     generation). A sequence holding a block holds its whole chain and
 *     releases it last to first, so descendants always precede their ancestors
 *     in the LRU list and are evicted first. (The generation check of a lookup
 *     is defence in depth on top of this.)
 *
 * Duplicates. Two sequences that compute the same prefix at the same time get
 * separate blocks; when the second commits a full block whose twin is already
 * registered, its table entry is switched to the registered twin (refcount++)
 * and its own copy goes back to FREE. The KV of both is identical, so this is
 * invisible to attention; the next step's block table simply names the twin.
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "core/core.h"
#ifdef __cplusplus
extern "C" {
#endif

/* The block hash: tokens[0..n) (ids), seed = the previous block's hash. */
typedef uint64_t (*st_kv_hash_fn)(const int32_t *tokens, int64_t n, uint64_t seed, void *user);

/* The lower KV tiers' hooks (kv/kv_tiers.h), both NULL-able:
 * on_register: a block was registered in the prefix cache by st_bm_commit
 *   (its KV is the pool's once the step that computed it completes; a block
 *   swapped for its registered twin is not reported);
 * on_evict: a CACHED block is evicted (just before it is handed to a new
 *   owner; its KV in the pool is still intact until the step's forward runs),
 *   so that a host tier can copy it out.
 * hash: the block's chained hash, parent_hash: its predecessor's (hash_seed for
 * a first block), tokens[0..n_tokens): its ids (borrowed). */
typedef void (*st_kv_block_fn)(int32_t block, uint64_t hash, uint64_t parent_hash, const int32_t *tokens,
                               int64_t n_tokens, void *user);

/* The default block hash: XXH3_64bits_withSeed over n int32 ids (native byte
 * order, little-endian on every supported machine). */
uint64_t st_kv_hash_tokens(const int32_t *tokens, int64_t n, uint64_t seed);

typedef struct {
    int64_t num_blocks;        /* > 0, <= INT32_MAX */
    int64_t block_size;        /* tokens per block, > 0 */
    bool disable_prefix_cache; /* true: no hashing, no hits; released blocks go straight to FREE */
    uint64_t hash_seed;        /* h_{-1}: lets distinct models / tokenizers never share a chain */
    st_kv_hash_fn hash_fn;     /* NULL: st_kv_hash_tokens */
    void *hash_user;
    st_kv_block_fn on_register; /* NULL: none */
    st_kv_block_fn on_evict;    /* NULL: none */
    void *tier_user;            /* passed to both */
} st_bm_params;

/* One sequence's block table. Owned by the sequence (st_block_table_init /
 * st_block_table_free manage its memory); its content is changed only by the
 * st_bm_* functions. Position p of the sequence lives in slot
 * blocks[p / block_size] * block_size + p % block_size. */
typedef struct {
    int32_t *blocks;     /* [n_blocks] physical block ids; owned */
    int64_t n_blocks;    /* == ceil(n_slots / block_size) */
    int64_t cap;         /* allocated entries of blocks */
    int64_t n_slots;     /* positions [0, n_slots) have a slot */
    int64_t n_computed;  /* positions [0, n_computed) hold valid KV; <= n_slots */
    int64_t n_hashed;    /* leading blocks registered in the prefix cache */
    uint64_t chain;      /* hash of block n_hashed-1 (hash_seed when n_hashed == 0) */
} st_block_table;

void st_block_table_init(st_block_table *t);
/* Frees the table's memory only. Its blocks must have been given back with
 * st_bm_seq_free first (or the block manager freed). NULL-safe. */
void st_block_table_free(st_block_table *t);

typedef struct st_block_manager st_block_manager;

/* Checks the parameters (INVALID_ARG naming the bad one) and allocates the
 * bookkeeping (about 60 bytes per block, plus block_size ids per block with
 * the prefix cache on). The caller owns *out (st_bm_free); *out is NULL on error.
 * All blocks start FREE; a fresh pool hands them out in id order 0, 1, 2, ...
 * (released FREE blocks are reused last released first). */
strata_status st_bm_init(const st_bm_params *p, st_block_manager **out);
/* NULL: no-op. Tables still holding blocks are not touched (free their memory
 * with st_block_table_free). */
void st_bm_free(st_block_manager *bm);

int64_t st_bm_block_size(const st_block_manager *bm);
int64_t st_bm_num_blocks(const st_block_manager *bm);
/* Blocks an allocation may take now: FREE + CACHED. */
int64_t st_bm_num_allocatable(const st_block_manager *bm);

/* ---- prefix lookup (no side effects) -------------------------------------------
 * The longest cached prefix of whole blocks among tokens[0 .. n_tokens-1): the
 * last token is never taken from the cache, so a caller always computes at
 * least one token and gets its logits. Returns the number of cached tokens (a
 * multiple of block_size, < n_tokens; 0 when n_tokens <= 0 or the cache is off).
 * *n_reactivated (may be NULL): how many of those blocks are CACHED (refcount 0)
 * and so would leave the allocatable pool if taken. */
int64_t st_bm_lookup(const st_block_manager *bm, const int32_t *tokens, int64_t n_tokens,
                     int64_t *n_reactivated);

/* New blocks st_bm_append_slots(t, n) would take. */
int64_t st_bm_blocks_needed(const st_block_manager *bm, const st_block_table *t, int64_t n);
/* Whether st_bm_append_slots(t, n) would succeed now. */
bool st_bm_can_append(const st_block_manager *bm, const st_block_table *t, int64_t n);
/* Whether a new sequence with tokens[0..n_tokens) could start now with slots
 * for its first n_slots positions (n_slots <= n_tokens; the cached prefix
 * counts): st_bm_seq_start followed by appending up to n_slots would succeed. */
bool st_bm_can_allocate(const st_block_manager *bm, const int32_t *tokens, int64_t n_tokens,
                        int64_t n_slots);

/* ---- a sequence's life ----------------------------------------------------------
 * Starts an empty table t (n_blocks == 0, else INVALID_ARG) for a sequence whose
 * known tokens are tokens[0..n_tokens) (n_tokens >= 1): takes the cached prefix
 * st_bm_lookup finds (those blocks are shared, refcount++; CACHED ones become
 * USED) and sets n_slots = n_computed = *n_cached (may be NULL). Counts
 * n_tokens queried and *n_cached hit tokens in the stats. Takes no new block,
 * so it cannot run out of blocks; NOMEM only when the table's array cannot
 * grow (t unchanged). */
strata_status st_bm_seq_start(st_block_manager *bm, st_block_table *t, const int32_t *tokens,
                              int64_t n_tokens, int64_t *n_cached);

/* Gives t slots for n more positions [n_slots, n_slots + n), taking a new block
 * whenever the last one is full (FREE first, then evicting the least recently
 * released CACHED block). All or nothing: NOMEM (t and the pool unchanged) when
 * fewer than st_bm_blocks_needed blocks are allocatable. n >= 0. */
strata_status st_bm_append_slots(st_block_manager *bm, st_block_table *t, int64_t n);

/* Records that the KV of positions [t->n_computed, n_computed) has been written
 * (t->n_computed <= n_computed <= t->n_slots, else INVALID_ARG);
 * tokens[0..n_computed) are the sequence's ids (borrowed, read only now). Every
 * block this completes is registered in the prefix cache with its chained hash
 * (or swapped for its registered twin, see Duplicates above). Cannot fail
 * otherwise. */
strata_status st_bm_commit(st_block_manager *bm, st_block_table *t, const int32_t *tokens,
                           int64_t n_computed);

/* Releases every block of t (refcount--) and empties it (memory kept). A block
 * whose refcount reaches 0 becomes CACHED when registered (its KV stays
 * findable), else FREE. The table's blocks are released last to first, so the
 * tail of a prompt is evicted before its head (heads are the likelier shared
 * prefix). */
/* Gives back the slots past position n (n_computed <= n <= n_slots): blocks
 * wholly past it return to the pool (speculative decoding: the slots of
 * rejected drafts). INVALID_ARG outside that range. */
strata_status st_bm_truncate_slots(st_block_manager *bm, st_block_table *t, int64_t n);
void st_bm_seq_free(st_block_manager *bm, st_block_table *t);

/* slots[k] = physical slot of position pos0 + k, for k in [0, n); the runner
 * writes the K/V of those tokens there. INVALID_ARG unless
 * 0 <= pos0 and pos0 + n <= t->n_slots. */
strata_status st_bm_slot_mapping(const st_block_manager *bm, const st_block_table *t, int64_t pos0,
                                 int64_t n, int64_t *slots);

/* Drops every CACHED block (CACHED -> FREE, hash entries removed; no on_evict
 * calls). USED blocks keep their registration. */
void st_bm_clear_cache(st_block_manager *bm);

/* ---- introspection ----------------------------------------------------------------*/
typedef struct {
    int64_t num_blocks, block_size;
    int64_t used;            /* refcount > 0 */
    int64_t shared;          /* refcount > 1 */
    int64_t free;            /* FREE */
    int64_t cached;          /* CACHED (refcount 0, evictable) */
    int64_t registered;      /* in the hash table (USED or CACHED) */
    int64_t queried_tokens;  /* sum of n_tokens over st_bm_seq_start */
    int64_t hit_tokens;      /* sum of the cached prefixes those calls took */
    int64_t evictions;       /* CACHED blocks reused for new content */
    int64_t dedups;          /* committed blocks swapped for a registered twin */
} st_bm_stats;

void st_bm_get_stats(const st_block_manager *bm, st_bm_stats *out);
/* hit_tokens / queried_tokens (0 when nothing was queried). */
double st_bm_hit_rate(const st_bm_stats *s);

typedef struct {
    int32_t refcount;
    bool registered;     /* in the hash table */
    uint64_t hash;       /* when registered */
    int32_t parent;      /* when registered: the chain's previous block, -1 for a first block */
} st_bm_block_info;

/* INVALID_ARG when block is out of range. */
strata_status st_bm_get_block(const st_block_manager *bm, int32_t block, st_bm_block_info *out);

/* Checks every invariant above over the pool and the given tables (all the
 * tables that hold blocks; tables[i] may be NULL), including the hash table and
 * the free / LRU lists. INTERNAL with a message naming the first violation;
 * NOMEM when its scratch cannot be allocated. O(num_blocks + total table size). */
strata_status st_bm_validate(const st_block_manager *bm, const st_block_table *const *tables,
                             int64_t n_tables);

#ifdef __cplusplus
}
#endif

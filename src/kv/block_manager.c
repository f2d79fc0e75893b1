/* kv/block_manager: see block_manager.h for the model (states, chained hashes,
 * invariants).
 *
 * Data structures, all arrays indexed by block id:
 *   ref[]                 refcount
 *   reg[], hash[], parent[], parent_gen[], tok[]   the hash-table entry of a
 *                         registered block (tok: block_size ids per block)
 *   gen[]                 bumped whenever a block leaves the hash table, so a
 *                         child naming (parent, parent_gen) stops matching once
 *                         its parent's memory holds something else
 *   hnext[]               singly linked bucket chains; buckets[] has a power of
 *                         two >= 2 * num_blocks heads, so it never grows
 *   lru_prev[], lru_next[] doubly linked LRU list of CACHED blocks, head = least
 *                         recently released (evicted first)
 *   free_stack[]          FREE blocks, top = next to hand out
 */
#include "kv/block_manager.h"

#include <string.h>
#include <xxhash.h>

#define NIL (-1)

struct st_block_manager {
    int64_t num_blocks, block_size;
    bool prefix_cache;
    uint64_t hash_seed;
    st_kv_hash_fn hash_fn;
    void *hash_user;
    st_kv_block_fn on_register, on_evict;
    void *tier_user;

    int32_t *ref;
    uint8_t *reg;
    uint64_t *hash;
    int32_t *parent;
    uint32_t *parent_gen;
    uint32_t *gen;
    int32_t *hnext;
    int32_t *lru_prev, *lru_next;
    int32_t *tok; /* [num_blocks * block_size] when the prefix cache is on */
    int32_t *buckets;
    uint64_t bucket_mask;

    int32_t *free_stack;
    int64_t n_free;
    int32_t lru_head, lru_tail;
    int64_t n_cached;
    int64_t n_used;
    int64_t n_registered;

    int64_t queried_tokens, hit_tokens, evictions, dedups;
};

uint64_t st_kv_hash_tokens(const int32_t *tokens, int64_t n, uint64_t seed) {
    return XXH3_64bits_withSeed(tokens, (size_t)n * sizeof(int32_t), seed);
}

static uint64_t default_hash(const int32_t *tokens, int64_t n, uint64_t seed, void *user) {
    (void)user;
    return st_kv_hash_tokens(tokens, n, seed);
}

/* ---- tables ---------------------------------------------------------------------*/

void st_block_table_init(st_block_table *t) { memset(t, 0, sizeof *t); }

void st_block_table_free(st_block_table *t) {
    if (!t) return;
    st_free(t->blocks);
    memset(t, 0, sizeof *t);
}

static strata_status table_reserve(st_block_table *t, int64_t n_blocks) {
    if (n_blocks <= t->cap) return STRATA_OK;
    int64_t cap = t->cap ? t->cap : 8;
    while (cap < n_blocks) cap *= 2;
    int32_t *nb = st_realloc(t->blocks, (size_t)cap * sizeof *nb);
    if (!nb) return st_err(STRATA_ERR_NOMEM, "block table: cannot grow to %lld blocks", (long long)cap);
    t->blocks = nb;
    t->cap = cap;
    return STRATA_OK;
}

/* ---- init / free ----------------------------------------------------------------*/

strata_status st_bm_init(const st_bm_params *p, st_block_manager **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "block manager: out is NULL");
    *out = NULL;
    if (!p) return st_err(STRATA_ERR_INVALID_ARG, "block manager: params is NULL");
    if (p->num_blocks <= 0 || p->num_blocks > INT32_MAX)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: num_blocks %lld is not in [1, %d]",
                      (long long)p->num_blocks, INT32_MAX);
    if (p->block_size <= 0 || p->block_size > (1 << 20))
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: block_size %lld is not in [1, %d]",
                      (long long)p->block_size, 1 << 20);
    const int64_t N = p->num_blocks;
    st_block_manager *bm = st_calloc(1, sizeof *bm);
    if (!bm) return st_err(STRATA_ERR_NOMEM, "block manager: out of memory for its state (%zu bytes)", sizeof *bm);
    bm->num_blocks = N;
    bm->block_size = p->block_size;
    bm->prefix_cache = !p->disable_prefix_cache;
    bm->hash_seed = p->hash_seed;
    bm->hash_fn = p->hash_fn ? p->hash_fn : default_hash;
    bm->hash_user = p->hash_user;
    bm->on_evict = p->on_evict;
    bm->on_register = p->on_register;
    bm->tier_user = p->tier_user;

    uint64_t nbuckets = 1;
    while (nbuckets < (uint64_t)N * 2) nbuckets <<= 1;
    bm->bucket_mask = nbuckets - 1;

    bm->ref = st_calloc((size_t)N, sizeof *bm->ref);
    bm->reg = st_calloc((size_t)N, sizeof *bm->reg);
    bm->hash = st_calloc((size_t)N, sizeof *bm->hash);
    bm->parent = st_calloc((size_t)N, sizeof *bm->parent);
    bm->parent_gen = st_calloc((size_t)N, sizeof *bm->parent_gen);
    bm->gen = st_calloc((size_t)N, sizeof *bm->gen);
    bm->hnext = st_calloc((size_t)N, sizeof *bm->hnext);
    bm->lru_prev = st_calloc((size_t)N, sizeof *bm->lru_prev);
    bm->lru_next = st_calloc((size_t)N, sizeof *bm->lru_next);
    bm->free_stack = st_calloc((size_t)N, sizeof *bm->free_stack);
    bm->buckets = st_calloc((size_t)nbuckets, sizeof *bm->buckets);
    uint64_t ntok = 0;
    bool tok_ovf = st_mul_ovf_u64((uint64_t)N, (uint64_t)p->block_size, &ntok) ||
                   ntok > SIZE_MAX / sizeof(int32_t);
    if (bm->prefix_cache && !tok_ovf) bm->tok = st_malloc((size_t)ntok * sizeof *bm->tok);
    if (!bm->ref || !bm->reg || !bm->hash || !bm->parent || !bm->parent_gen || !bm->gen ||
        !bm->hnext || !bm->lru_prev || !bm->lru_next || !bm->free_stack || !bm->buckets ||
        (bm->prefix_cache && !bm->tok)) {
        st_bm_free(bm);
        return st_err(STRATA_ERR_NOMEM, "block manager: cannot allocate the bookkeeping of %lld blocks of %lld tokens",
                      (long long)N, (long long)p->block_size);
    }
    for (uint64_t i = 0; i <= bm->bucket_mask; i++) bm->buckets[i] = NIL;
    for (int64_t i = 0; i < N; i++) {
        bm->free_stack[i] = (int32_t)(N - 1 - i); /* top of the stack: block 0 */
        bm->parent[i] = NIL;
        bm->hnext[i] = NIL;
        bm->lru_prev[i] = bm->lru_next[i] = NIL;
    }
    bm->n_free = N;
    bm->lru_head = bm->lru_tail = NIL;
    *out = bm;
    return STRATA_OK;
}

void st_bm_free(st_block_manager *bm) {
    if (!bm) return;
    st_free(bm->ref);
    st_free(bm->reg);
    st_free(bm->hash);
    st_free(bm->parent);
    st_free(bm->parent_gen);
    st_free(bm->gen);
    st_free(bm->hnext);
    st_free(bm->lru_prev);
    st_free(bm->lru_next);
    st_free(bm->tok);
    st_free(bm->buckets);
    st_free(bm->free_stack);
    st_free(bm);
}

int64_t st_bm_block_size(const st_block_manager *bm) { return bm->block_size; }
int64_t st_bm_num_blocks(const st_block_manager *bm) { return bm->num_blocks; }
int64_t st_bm_num_allocatable(const st_block_manager *bm) { return bm->n_free + bm->n_cached; }

/* ---- LRU list of CACHED blocks ----------------------------------------------------*/

static void lru_push_tail(st_block_manager *bm, int32_t b) {
    bm->lru_prev[b] = bm->lru_tail;
    bm->lru_next[b] = NIL;
    if (bm->lru_tail != NIL) bm->lru_next[bm->lru_tail] = b;
    else bm->lru_head = b;
    bm->lru_tail = b;
    bm->n_cached++;
}

static void lru_remove(st_block_manager *bm, int32_t b) {
    int32_t p = bm->lru_prev[b], n = bm->lru_next[b];
    if (p != NIL) bm->lru_next[p] = n;
    else bm->lru_head = n;
    if (n != NIL) bm->lru_prev[n] = p;
    else bm->lru_tail = p;
    bm->lru_prev[b] = bm->lru_next[b] = NIL;
    bm->n_cached--;
}

/* ---- hash table ---------------------------------------------------------------------*/

static const int32_t *block_tokens(const st_block_manager *bm, int32_t b) {
    return bm->tok + (int64_t)b * bm->block_size;
}

/* The registered block with hash h, ids tokens[0..block_size) and parent
 * (parent, gen[parent]) (parent NIL: a first block); NIL when none. */
static int32_t hash_find(const st_block_manager *bm, uint64_t h, const int32_t *tokens, int32_t parent) {
    const uint32_t pgen = parent == NIL ? 0 : bm->gen[parent];
    for (int32_t b = bm->buckets[h & bm->bucket_mask]; b != NIL; b = bm->hnext[b]) {
        if (bm->hash[b] != h || bm->parent[b] != parent || bm->parent_gen[b] != pgen) continue;
        if (memcmp(block_tokens(bm, b), tokens, (size_t)bm->block_size * sizeof *tokens) == 0) return b;
    }
    return NIL;
}

static void hash_insert(st_block_manager *bm, int32_t b, uint64_t h, const int32_t *tokens, int32_t parent) {
    ST_ASSERT(!bm->reg[b]);
    bm->reg[b] = 1;
    bm->hash[b] = h;
    bm->parent[b] = parent;
    bm->parent_gen[b] = parent == NIL ? 0 : bm->gen[parent];
    memcpy(bm->tok + (int64_t)b * bm->block_size, tokens, (size_t)bm->block_size * sizeof *tokens);
    int32_t *head = &bm->buckets[h & bm->bucket_mask];
    bm->hnext[b] = *head;
    *head = b;
    bm->n_registered++;
}

static void hash_remove(st_block_manager *bm, int32_t b) {
    ST_ASSERT(bm->reg[b]);
    int32_t *pp = &bm->buckets[bm->hash[b] & bm->bucket_mask];
    while (*pp != b) {
        ST_ASSERT(*pp != NIL);
        pp = &bm->hnext[*pp];
    }
    *pp = bm->hnext[b];
    bm->hnext[b] = NIL;
    bm->reg[b] = 0;
    bm->parent[b] = NIL;
    bm->gen[b]++;
    bm->n_registered--;
}

/* ---- block refcounts ----------------------------------------------------------------*/

/* refcount++ of a registered block found by a lookup (CACHED -> USED). */
static void block_acquire(st_block_manager *bm, int32_t b) {
    if (bm->ref[b] == 0) {
        ST_ASSERT(bm->reg[b]);
        lru_remove(bm, b);
        bm->n_used++;
    }
    bm->ref[b]++;
}

/* A block for new content, refcount 1: FREE first, else evict the LRU head.
 * The caller checked that one is allocatable. */
static int32_t block_take(st_block_manager *bm) {
    int32_t b;
    if (bm->n_free > 0) {
        b = bm->free_stack[--bm->n_free];
    } else {
        b = bm->lru_head;
        ST_ASSERT(b != NIL);
        lru_remove(bm, b);
        if (bm->on_evict) {
            const int32_t pb = bm->parent[b]; /* registered: descendants are evicted before their ancestors */
            bm->on_evict(b, bm->hash[b], pb != NIL ? bm->hash[pb] : bm->hash_seed, block_tokens(bm, b), bm->block_size,
                         bm->tier_user);
        }
        hash_remove(bm, b);
        bm->evictions++;
    }
    ST_ASSERT(bm->ref[b] == 0 && !bm->reg[b]);
    bm->ref[b] = 1;
    bm->n_used++;
    return b;
}

static void block_release(st_block_manager *bm, int32_t b) {
    ST_ASSERT(bm->ref[b] > 0);
    if (--bm->ref[b] > 0) return;
    bm->n_used--;
    if (bm->reg[b]) lru_push_tail(bm, b);
    else bm->free_stack[bm->n_free++] = b;
}

/* ---- lookup ---------------------------------------------------------------------------*/

/* Walks the chain over the whole blocks of tokens[0 .. n_tokens-1). Writes the
 * matched blocks to out (may be NULL; room for (n_tokens-1)/bs), returns how
 * many matched; *chain: the hash of the last match (hash_seed when none). */
static int64_t match_prefix(const st_block_manager *bm, const int32_t *tokens, int64_t n_tokens,
                            int32_t *out, uint64_t *chain, int64_t *n_reactivated) {
    uint64_t h = bm->hash_seed;
    int64_t n = 0, react = 0;
    if (bm->prefix_cache && n_tokens > 1 && tokens) {
        const int64_t bs = bm->block_size, max_blocks = (n_tokens - 1) / bs;
        int32_t parent = NIL;
        for (int64_t i = 0; i < max_blocks; i++) {
            const int32_t *blk = tokens + i * bs;
            uint64_t hi = bm->hash_fn(blk, bs, h, bm->hash_user);
            int32_t b = hash_find(bm, hi, blk, parent);
            if (b == NIL) break;
            if (out) out[n] = b;
            if (bm->ref[b] == 0) react++;
            n++;
            h = hi;
            parent = b;
        }
    }
    if (chain) *chain = h;
    if (n_reactivated) *n_reactivated = react;
    return n;
}

int64_t st_bm_lookup(const st_block_manager *bm, const int32_t *tokens, int64_t n_tokens,
                     int64_t *n_reactivated) {
    return match_prefix(bm, tokens, n_tokens, NULL, NULL, n_reactivated) * bm->block_size;
}

static int64_t blocks_for(const st_block_manager *bm, int64_t n_slots) {
    return (n_slots + bm->block_size - 1) / bm->block_size;
}

int64_t st_bm_blocks_needed(const st_block_manager *bm, const st_block_table *t, int64_t n) {
    if (n <= 0) return 0;
    return blocks_for(bm, t->n_slots + n) - t->n_blocks;
}

bool st_bm_can_append(const st_block_manager *bm, const st_block_table *t, int64_t n) {
    return st_bm_blocks_needed(bm, t, n) <= st_bm_num_allocatable(bm);
}

bool st_bm_can_allocate(const st_block_manager *bm, const int32_t *tokens, int64_t n_tokens,
                        int64_t n_slots) {
    int64_t react = 0;
    int64_t cached = st_bm_lookup(bm, tokens, n_tokens, &react);
    int64_t fresh = n_slots > cached ? blocks_for(bm, n_slots) - cached / bm->block_size : 0;
    return fresh + react <= st_bm_num_allocatable(bm);
}

/* ---- a sequence's life ---------------------------------------------------------------*/

strata_status st_bm_seq_start(st_block_manager *bm, st_block_table *t, const int32_t *tokens,
                              int64_t n_tokens, int64_t *n_cached) {
    if (n_cached) *n_cached = 0;
    if (!bm || !t || !tokens || n_tokens < 1)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: seq_start needs a table and >= 1 token");
    if (t->n_blocks != 0 || t->n_slots != 0)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: seq_start on a table that holds %lld blocks",
                      (long long)t->n_blocks);
    strata_status st = table_reserve(t, (n_tokens - 1) / bm->block_size);
    if (st) return st;
    uint64_t chain;
    int64_t n = match_prefix(bm, tokens, n_tokens, t->blocks, &chain, NULL);
    for (int64_t i = 0; i < n; i++) block_acquire(bm, t->blocks[i]);
    t->n_blocks = n;
    t->n_slots = t->n_computed = n * bm->block_size;
    t->n_hashed = n;
    t->chain = chain;
    bm->queried_tokens += n_tokens;
    bm->hit_tokens += t->n_computed;
    if (n_cached) *n_cached = t->n_computed;
    return STRATA_OK;
}

strata_status st_bm_append_slots(st_block_manager *bm, st_block_table *t, int64_t n) {
    if (n < 0) return st_err(STRATA_ERR_INVALID_ARG, "block manager: append of %lld slots", (long long)n);
    if (n == 0) return STRATA_OK;
    int64_t need = st_bm_blocks_needed(bm, t, n);
    if (need > st_bm_num_allocatable(bm))
        return st_err(STRATA_ERR_NOMEM, "KV cache: %lld more blocks needed, %lld allocatable (of %lld)",
                      (long long)need, (long long)st_bm_num_allocatable(bm), (long long)bm->num_blocks);
    strata_status st = table_reserve(t, t->n_blocks + need);
    if (st) return st;
    if (t->n_slots < t->n_blocks * bm->block_size) {
        /* the new tokens start in the partially filled last block: it must be private */
        int32_t last = t->blocks[t->n_blocks - 1];
        ST_ASSERT(bm->ref[last] == 1 && !bm->reg[last]);
    }
    for (int64_t i = 0; i < need; i++) t->blocks[t->n_blocks++] = block_take(bm);
    t->n_slots += n;
    return STRATA_OK;
}

strata_status st_bm_commit(st_block_manager *bm, st_block_table *t, const int32_t *tokens,
                           int64_t n_computed) {
    if (n_computed < t->n_computed || n_computed > t->n_slots)
        return st_err(STRATA_ERR_INVALID_ARG,
                      "block manager: commit of %lld computed positions, table has %lld computed of %lld slots",
                      (long long)n_computed, (long long)t->n_computed, (long long)t->n_slots);
    const int64_t bs = bm->block_size;
    if (bm->prefix_cache && n_computed / bs > t->n_hashed && !tokens)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: commit needs the token ids");
    t->n_computed = n_computed;
    if (!bm->prefix_cache) return STRATA_OK;
    const int64_t full = n_computed / bs;
    for (int64_t i = t->n_hashed; i < full; i++) {
        const int32_t *blk = tokens + i * bs;
        const uint64_t h = bm->hash_fn(blk, bs, t->chain, bm->hash_user);
        const int32_t parent = i > 0 ? t->blocks[i - 1] : NIL;
        const int32_t own = t->blocks[i];
        ST_ASSERT(bm->ref[own] == 1 && !bm->reg[own]);
        int32_t twin = hash_find(bm, h, blk, parent);
        if (twin != NIL) {
            block_acquire(bm, twin);
            t->blocks[i] = twin;
            block_release(bm, own); /* unregistered: back to FREE */
            bm->dedups++;
        } else {
            hash_insert(bm, own, h, blk, parent);
            if (bm->on_register) bm->on_register(own, h, t->chain, blk, bs, bm->tier_user);
        }
        t->chain = h;
        t->n_hashed = i + 1;
    }
    return STRATA_OK;
}

void st_bm_seq_free(st_block_manager *bm, st_block_table *t) {
    if (!bm || !t) return;
    for (int64_t i = t->n_blocks - 1; i >= 0; i--) block_release(bm, t->blocks[i]);
    t->n_blocks = t->n_slots = t->n_computed = t->n_hashed = 0;
    t->chain = 0;
}

strata_status st_bm_truncate_slots(st_block_manager *bm, st_block_table *t, int64_t n) {
    if (n < t->n_computed || n > t->n_slots)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: truncate to %lld slots, table has %lld computed of %lld",
                      (long long)n, (long long)t->n_computed, (long long)t->n_slots);
    const int64_t keep = (n + bm->block_size - 1) / bm->block_size;
    for (int64_t i = t->n_blocks - 1; i >= keep; i--) {
        /* past the computed positions: private, never registered */
        ST_ASSERT(bm->ref[t->blocks[i]] == 1 && !bm->reg[t->blocks[i]]);
        block_release(bm, t->blocks[i]);
    }
    t->n_blocks = keep;
    t->n_slots = n;
    return STRATA_OK;
}

strata_status st_bm_slot_mapping(const st_block_manager *bm, const st_block_table *t, int64_t pos0,
                                 int64_t n, int64_t *slots) {
    if (pos0 < 0 || n < 0 || pos0 + n > t->n_slots || (n > 0 && !slots))
        return st_err(STRATA_ERR_INVALID_ARG,
                      "block manager: slot mapping of positions [%lld, %lld) outside the %lld allocated",
                      (long long)pos0, (long long)(pos0 + n), (long long)t->n_slots);
    const int64_t bs = bm->block_size;
    for (int64_t k = 0; k < n; k++) {
        int64_t p = pos0 + k;
        slots[k] = (int64_t)t->blocks[p / bs] * bs + p % bs;
    }
    return STRATA_OK;
}

void st_bm_clear_cache(st_block_manager *bm) {
    while (bm->lru_head != NIL) {
        int32_t b = bm->lru_head;
        lru_remove(bm, b);
        hash_remove(bm, b);
        bm->free_stack[bm->n_free++] = b;
    }
}

/* ---- introspection ----------------------------------------------------------------*/

void st_bm_get_stats(const st_block_manager *bm, st_bm_stats *out) {
    memset(out, 0, sizeof *out);
    out->num_blocks = bm->num_blocks;
    out->block_size = bm->block_size;
    out->used = bm->n_used;
    for (int64_t b = 0; b < bm->num_blocks; b++)
        if (bm->ref[b] > 1) out->shared++;
    out->free = bm->n_free;
    out->cached = bm->n_cached;
    out->registered = bm->n_registered;
    out->queried_tokens = bm->queried_tokens;
    out->hit_tokens = bm->hit_tokens;
    out->evictions = bm->evictions;
    out->dedups = bm->dedups;
}

double st_bm_hit_rate(const st_bm_stats *s) {
    return s->queried_tokens > 0 ? (double)s->hit_tokens / (double)s->queried_tokens : 0.0;
}

strata_status st_bm_get_block(const st_block_manager *bm, int32_t block, st_bm_block_info *out) {
    if (block < 0 || block >= bm->num_blocks)
        return st_err(STRATA_ERR_INVALID_ARG, "block manager: block %d is not in [0, %lld)", block,
                      (long long)bm->num_blocks);
    out->refcount = bm->ref[block];
    out->registered = bm->reg[block] != 0;
    out->hash = bm->reg[block] ? bm->hash[block] : 0;
    out->parent = bm->reg[block] ? bm->parent[block] : NIL;
    return STRATA_OK;
}

#define VFAIL(...) do { st = st_err(STRATA_ERR_INTERNAL, "block manager invariant: " __VA_ARGS__); goto done; } while (0)

strata_status st_bm_validate(const st_block_manager *bm, const st_block_table *const *tables,
                             int64_t n_tables) {
    const int64_t N = bm->num_blocks, bs = bm->block_size;
    strata_status st = STRATA_OK;
    int32_t *count = st_calloc((size_t)N, sizeof *count);
    int64_t *seen_in = st_malloc((size_t)N * sizeof *seen_in); /* last table naming the block */
    uint8_t *where = st_calloc((size_t)N, 1);                  /* 1: free stack, 2: LRU */
    if (!count || !seen_in || !where) {
        st = st_err(STRATA_ERR_NOMEM, "block manager: validate: out of memory for the counts of %lld blocks "
                    "(%zu bytes)", (long long)N, (size_t)N * (sizeof *count + sizeof *seen_in + 1));
        goto done;
    }
    for (int64_t b = 0; b < N; b++) seen_in[b] = -1;

    for (int64_t ti = 0; ti < n_tables; ti++) {
        const st_block_table *t = tables[ti];
        if (!t) continue;
        if (t->n_computed < 0 || t->n_computed > t->n_slots)
            VFAIL("table %lld: n_computed %lld, n_slots %lld", (long long)ti, (long long)t->n_computed,
                  (long long)t->n_slots);
        if (t->n_blocks != blocks_for(bm, t->n_slots) || t->n_blocks > t->cap)
            VFAIL("table %lld: %lld blocks for %lld slots (cap %lld)", (long long)ti, (long long)t->n_blocks,
                  (long long)t->n_slots, (long long)t->cap);
        const int64_t want_hashed = bm->prefix_cache ? t->n_computed / bs : 0;
        if (t->n_hashed != want_hashed)
            VFAIL("table %lld: %lld hashed blocks, %lld full computed", (long long)ti, (long long)t->n_hashed,
                  (long long)want_hashed);
        for (int64_t i = 0; i < t->n_blocks; i++) {
            int32_t b = t->blocks[i];
            if (b < 0 || b >= N) VFAIL("table %lld names block %d", (long long)ti, b);
            if (seen_in[b] == ti) VFAIL("table %lld names block %d twice", (long long)ti, b);
            seen_in[b] = ti;
            count[b]++;
            if (i < t->n_hashed) {
                if (!bm->reg[b]) VFAIL("table %lld: full computed block %lld (%d) is not registered", (long long)ti, (long long)i, b);
                int32_t want_parent = i > 0 ? t->blocks[i - 1] : NIL;
                if (bm->parent[b] != want_parent || (want_parent != NIL && bm->parent_gen[b] != bm->gen[want_parent]))
                    VFAIL("table %lld: block %lld (%d) registered under parent %d, the table has %d", (long long)ti,
                          (long long)i, b, bm->parent[b], want_parent);
            } else {
                if (bm->reg[b]) VFAIL("table %lld: block %lld (%d) past the hashed prefix is registered", (long long)ti, (long long)i, b);
                if (bm->ref[b] != 1) VFAIL("table %lld: private block %lld (%d) has refcount %d", (long long)ti, (long long)i, b, bm->ref[b]);
            }
        }
    }
    for (int64_t i = 0; i < bm->n_free; i++) {
        int32_t b = bm->free_stack[i];
        if (b < 0 || b >= N || where[b]) VFAIL("free stack entry %lld (%d) is bad or repeated", (long long)i, b);
        where[b] = 1;
    }
    int64_t n_lru = 0;
    for (int32_t b = bm->lru_head, prev = NIL; b != NIL; prev = b, b = bm->lru_next[b]) {
        if (b < 0 || b >= N || where[b]) VFAIL("LRU list entry %d is bad or repeated", b);
        if (bm->lru_prev[b] != prev) VFAIL("LRU list: block %d's prev is %d, not %d", b, bm->lru_prev[b], prev);
        where[b] = 2;
        if (++n_lru > N) VFAIL("LRU list has a cycle");
        if (bm->lru_next[b] == NIL && bm->lru_tail != b) VFAIL("LRU tail is %d, list ends at %d", bm->lru_tail, b);
    }
    if (n_lru != bm->n_cached) VFAIL("LRU list has %lld blocks, counter %lld", (long long)n_lru, (long long)bm->n_cached);
    int64_t used = 0, reg = 0;
    for (int64_t b = 0; b < N; b++) {
        if (bm->ref[b] != count[b]) VFAIL("block %lld: refcount %d, named by %d tables", (long long)b, bm->ref[b], count[b]);
        if (bm->ref[b] > 0) {
            used++;
            if (where[b]) VFAIL("block %lld is used and on the %s list", (long long)b, where[b] == 1 ? "free" : "LRU");
        } else if (where[b] == 0) {
            VFAIL("block %lld is lost (refcount 0, on no list)", (long long)b);
        } else if ((where[b] == 2) != (bm->reg[b] != 0)) {
            VFAIL("block %lld: registered %d but on the %s list", (long long)b, bm->reg[b], where[b] == 1 ? "free" : "LRU");
        }
        if (bm->reg[b]) {
            reg++;
            int64_t hits = 0;
            for (int32_t x = bm->buckets[bm->hash[b] & bm->bucket_mask]; x != NIL; x = bm->hnext[x]) {
                if (x == b) hits++;
                if (hits > N) break;
            }
            if (hits != 1) VFAIL("registered block %lld is %lld times in its bucket", (long long)b, (long long)hits);
            /* chains are never broken: the parent is registered with the same
             * content (descendants always precede their ancestors in the LRU
             * list, so they are evicted first) */
            const int32_t par = bm->parent[b];
            if (par != NIL && (par < 0 || par >= N || !bm->reg[par] || bm->parent_gen[b] != bm->gen[par]))
                VFAIL("registered block %lld: its parent %d is gone", (long long)b, par);
            /* the stored ids hash to the stored hash, seeded by the parent's */
            uint64_t seed = par == NIL ? bm->hash_seed : bm->hash[par];
            if (bm->hash_fn(block_tokens(bm, b), bs, seed, bm->hash_user) != bm->hash[b])
                VFAIL("block %lld: its ids do not hash to its hash", (long long)b);
        }
    }
    if (used != bm->n_used) VFAIL("%lld used blocks, counter %lld", (long long)used, (long long)bm->n_used);
    if (reg != bm->n_registered) VFAIL("%lld registered blocks, counter %lld", (long long)reg, (long long)bm->n_registered);
    if (bm->n_free + bm->n_cached + bm->n_used != N)
        VFAIL("free %lld + cached %lld + used %lld != %lld blocks", (long long)bm->n_free, (long long)bm->n_cached,
              (long long)bm->n_used, (long long)N);
    uint64_t bucket_entries = 0;
    for (uint64_t i = 0; i <= bm->bucket_mask; i++)
        for (int32_t x = bm->buckets[i]; x != NIL; x = bm->hnext[x]) {
            if (!bm->reg[x] || (bm->hash[x] & bm->bucket_mask) != i) VFAIL("bucket %llu holds block %d wrongly", (unsigned long long)i, x);
            if (++bucket_entries > (uint64_t)N) VFAIL("bucket chains hold more entries than blocks");
        }
    if (bucket_entries != (uint64_t)reg) VFAIL("hash table holds %llu entries, %lld registered", (unsigned long long)bucket_entries, (long long)reg);
done:
    st_free(count);
    st_free(seen_in);
    st_free(where);
    return st;
}

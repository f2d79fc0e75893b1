/* Device memory pool of the CUDA backend: a few large cudaMalloc chunks carved
 * by a first-fit free list, so that no cudaMalloc happens per step.
 *
 * Each chunk keeps its segments (used or free) in a doubly linked list in
 * address order; a free segment is merged with free neighbours at once, so
 * two free segments are never adjacent. alloc walks the chunks in creation
 * order and takes the first free segment that fits, splitting off the rest
 * (when at least ST_CUDA_ALIGN bytes). The metadata lives in host memory; the
 * number of live blocks is small (weights, caches, activations, scratch), so
 * the linear walks cost nothing that matters off the hot path. */
#include <string.h>

#include "backend/cuda/cuda_internal.h"

typedef struct seg {
    uintptr_t addr;
    size_t size;
    bool free;
    struct seg *prev, *next; /* address order within the chunk */
} seg;

typedef struct {
    uintptr_t base;
    size_t size;
    seg *head;
} chunk;

struct st_cuda_pool {
    size_t cap, chunk_size, margin;
    size_t held; /* sum of chunk sizes */
    chunk *chunks;
    int n_chunks, cap_chunks;
};

/* Bytes past the end of each chunk that are never handed out: kernels that
 * decode packed blocks with aligned 4-byte loads may read up to 4 bytes past
 * the last block of a buffer. */
#define ST_CUDA_TAIL 256

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static strata_status add_chunk(st_cuda_pool *p, size_t size) {
    if (p->n_chunks == p->cap_chunks) {
        int nc = p->cap_chunks ? 2 * p->cap_chunks : 8;
        chunk *c = st_realloc(p->chunks, (size_t)nc * sizeof *c);
        if (!c) return st_err(STRATA_ERR_NOMEM, "cuda pool: out of host memory");
        p->chunks = c;
        p->cap_chunks = nc;
    }
    seg *s = st_calloc(1, sizeof *s);
    if (!s) return st_err(STRATA_ERR_NOMEM, "cuda pool: out of host memory");
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, size + ST_CUDA_TAIL);
    if (e != cudaSuccess) {
        st_free(s);
        (void)cudaGetLastError(); /* an out-of-memory error is not sticky: clear it */
        return st_err(STRATA_ERR_NOMEM, "cudaMalloc(&d, %zu) failed: %s at %s:%d in %s (pool holds %zu bytes)",
                      size, cudaGetErrorString(e), __FILE__, __LINE__, __func__, p->held);
    }
    s->addr = (uintptr_t)d;
    s->size = size;
    s->free = true;
    p->chunks[p->n_chunks++] = (chunk){(uintptr_t)d, size, s};
    p->held += size;
    return STRATA_OK;
}

strata_status st_cuda_pool_init(size_t cap, size_t chunk_size, size_t margin, bool eager,
                                st_cuda_pool **out) {
    *out = NULL;
    st_cuda_pool *p = st_calloc(1, sizeof *p);
    if (!p) return st_err(STRATA_ERR_NOMEM, "cuda pool: out of host memory");
    p->cap = cap ? round_up(cap, ST_CUDA_ALIGN) : 0;
    p->chunk_size = round_up(chunk_size ? chunk_size : ((size_t)1 << 30), ST_CUDA_ALIGN);
    p->margin = margin;
    if (eager && p->cap) {
        strata_status st = add_chunk(p, p->cap);
        if (st != STRATA_OK) {
            st_cuda_pool_free(p);
            return st;
        }
    }
    *out = p;
    return STRATA_OK;
}

void st_cuda_pool_free(st_cuda_pool *p) {
    if (!p) return;
    for (int i = 0; i < p->n_chunks; i++) {
        ST_CUDA_LOG(cudaFree((void *)p->chunks[i].base));
        seg *s = p->chunks[i].head;
        while (s) {
            seg *nx = s->next;
            st_free(s);
            s = nx;
        }
    }
    st_free(p->chunks);
    st_free(p);
}

size_t st_cuda_pool_chunk_bytes(const st_cuda_pool *p) { return p ? p->held : 0; }

/* Takes n bytes from free segment s (s->size >= n): s becomes used. */
static strata_status take(seg *s, size_t n) {
    if (s->size - n >= ST_CUDA_ALIGN) {
        seg *r = st_calloc(1, sizeof *r);
        if (!r) return st_err(STRATA_ERR_NOMEM, "cuda pool: out of host memory");
        r->addr = s->addr + n;
        r->size = s->size - n;
        r->free = true;
        r->prev = s;
        r->next = s->next;
        if (s->next) s->next->prev = r;
        s->next = r;
        s->size = n;
    }
    s->free = false;
    return STRATA_OK;
}

static seg *first_fit(st_cuda_pool *p, size_t n) {
    for (int i = 0; i < p->n_chunks; i++)
        for (seg *s = p->chunks[i].head; s; s = s->next)
            if (s->free && s->size >= n) return s;
    return NULL;
}

strata_status st_cuda_pool_alloc(st_cuda_pool *p, size_t n, void **out, size_t *got) {
    *out = NULL;
    *got = 0;
    if (n > SIZE_MAX - ST_CUDA_ALIGN) return st_err(STRATA_ERR_NOMEM, "cuda pool: %zu bytes is too large", n);
    n = round_up(n ? n : 1, ST_CUDA_ALIGN);
    seg *s = first_fit(p, n);
    if (!s) {
        size_t want = n > p->chunk_size ? n : p->chunk_size;
        if (p->cap) {
            if (p->held + n > p->cap)
                return st_err(STRATA_ERR_NOMEM,
                              "cuda pool: %zu bytes do not fit: %zu of the %zu-byte cap are carved and"
                              " no free block is large enough",
                              n, p->held, p->cap);
            if (p->held + want > p->cap) want = p->cap - p->held;
        } else {
            size_t free_b = 0, total_b = 0;
            ST_CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
            if (want + p->margin > free_b) want = n; /* a smaller chunk, just this block */
            if (n + p->margin > free_b)
                return st_err(STRATA_ERR_NOMEM,
                              "cuda pool: %zu bytes requested but the device has %zu bytes free"
                              " (keeping a margin of %zu)",
                              n, free_b, p->margin);
        }
        strata_status st = add_chunk(p, want);
        if (st != STRATA_OK) return st;
        s = p->chunks[p->n_chunks - 1].head;
    }
    strata_status st = take(s, n);
    if (st != STRATA_OK) return st;
    *out = (void *)s->addr;
    *got = n;
    return STRATA_OK;
}

bool st_cuda_pool_release(st_cuda_pool *p, void *ptr, size_t *got) {
    *got = 0;
    uintptr_t a = (uintptr_t)ptr;
    for (int i = 0; i < p->n_chunks; i++) {
        chunk *c = &p->chunks[i];
        if (a < c->base || a >= c->base + c->size) continue;
        for (seg *s = c->head; s; s = s->next) {
            if (s->addr > a) return false;
            if (s->addr != a) continue;
            if (s->free) return false; /* freed twice */
            *got = s->size;
            s->free = true;
            if (s->next && s->next->free) { /* merge the next one into s */
                seg *nx = s->next;
                s->size += nx->size;
                s->next = nx->next;
                if (nx->next) nx->next->prev = s;
                st_free(nx);
            }
            if (s->prev && s->prev->free) { /* merge s into the previous one */
                seg *pv = s->prev;
                pv->size += s->size;
                pv->next = s->next;
                if (s->next) s->next->prev = pv;
                st_free(s);
            }
            return true;
        }
        return false;
    }
    return false;
}

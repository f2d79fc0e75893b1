/* weights/groups: the units of weight residency of a Llama model.
 *
 * A group is what one step of the forward pass reads at once. Group ids are
 * the cyclic order in which a forward pass visits them:
 *   0          embed    [model.embed_tokens.weight]                     (gathered: a few rows per step)
 *   1 + 2l     attn.l   [input_layernorm, q_proj, k_proj, v_proj, o_proj]
 *   2 + 2l     ffn.l    [post_attention_layernorm, gate_proj, up_proj, down_proj]
 *   1 + 2L     output   [model.norm, lm_head]  (lm_head is the embedding table when tied)
 * With tied embeddings the table belongs to `output` (its bytes are counted
 * there, once); `embed` then holds no bytes of its own and gathers its rows
 * from wherever the output group's copy lives (or from the file).
 *
 * Three layouts of a group's bytes:
 *  - slot layout (device): each tensor at a ST_WG_SLOT_ALIGN-aligned offset,
 *    packed in role order; `slot_bytes` in all (a multiple of the alignment).
 *  - image layout (host tier, staging): the file ranges that hold the tensors,
 *    widened to ST_WG_ALIGN boundaries (what an O_DIRECT read must fetch) and
 *    concatenated (`img_bytes`). A tensor that does not start on an aligned
 *    offset sits inside its extent at (offset - extent start); nothing else of
 *    the file is read.
 *  - tensor bytes (`bytes`): what the math reads, the sum of nbytes.
 */
#pragma once
#include <stdbool.h>
#include <stdint.h>
#include "loader/loader.h"
#ifdef __cplusplus
extern "C" {
#endif

#define ST_WG_MAX_TENSORS 5
#define ST_WG_ALIGN 4096u      /* O_DIRECT alignment: file offsets, lengths, buffers */
#define ST_WG_SLOT_ALIGN 256u  /* device alignment of every tensor in a slot */

typedef enum { ST_WG_EMBED = 0, ST_WG_ATTN, ST_WG_FFN, ST_WG_OUTPUT } st_wg_kind;

/* Tensor roles (index into st_wgroup.t) per kind. */
enum { ST_WG_EMBED_TABLE = 0 };
enum { ST_WG_ATTN_NORM = 0, ST_WG_WQ, ST_WG_WK, ST_WG_WV, ST_WG_WO };
enum { ST_WG_FFN_NORM = 0, ST_WG_GATE, ST_WG_UP, ST_WG_DOWN };
enum { ST_WG_OUT_NORM = 0, ST_WG_LM_HEAD };

typedef struct {
    const st_tensor_desc *desc; /* borrowed from the model files */
    uint64_t slot_off;          /* start in the slot layout */
    uint64_t img_off;           /* start in the image layout */
} st_wg_tensor;

typedef struct {
    int file;          /* index into st_model_files.files */
    uint64_t file_off; /* aligned down to ST_WG_ALIGN */
    uint64_t len;      /* multiple of ST_WG_ALIGN; may run past the end of the file */
    uint64_t need;     /* bytes of it that must exist in the file (up to the last tensor's end) */
    uint64_t img_off;  /* start in the image layout */
} st_wg_extent;

typedef struct {
    st_wg_kind kind;
    int layer;          /* -1 for embed and output */
    char name[24];      /* "embed", "attn.3", "ffn.3", "output" */
    int n_tensors;
    st_wg_tensor t[ST_WG_MAX_TENSORS];
    int n_extents;
    st_wg_extent ext[ST_WG_MAX_TENSORS];
    uint64_t bytes;      /* tensor bytes this group owns (0 for a tied embed) */
    uint64_t slot_bytes; /* device footprint (0 for a tied embed) */
    uint64_t img_bytes;  /* bytes an aligned read of the group fetches (0 for a tied embed) */
} st_wgroup;

typedef struct {
    int n;               /* 2 * n_layers + 2 */
    int n_layers;
    st_wgroup *g;        /* [n], in cyclic order */
    bool tied;           /* output's lm_head is the embedding table */
    uint64_t model_bytes;    /* sum of every group's bytes: each tensor once */
    uint64_t max_slot_bytes; /* largest slot_bytes of any group */
    uint64_t embed_row_bytes;
    int64_t embed_cols;
    st_dtype embed_dtype;
} st_wgroups;

static inline int st_wg_embed_id(void) { return 0; }
static inline int st_wg_attn_id(int layer) { return 1 + 2 * layer; }
static inline int st_wg_ffn_id(int layer) { return 2 + 2 * layer; }
static inline int st_wg_output_id(const st_wgroups *g) { return g->n - 1; }

/* A split FFN group (plan.h: the CPU tier's split): during decode the
 * device computes the intermediate rows [I - rows, I) from a streamed copy of
 * those rows of gate and up, those columns of down and the norm, while the
 * CPU computes rows [0, I - rows) from the host copy in place (down read
 * with a row stride); the two down products add up to the layer's. The
 * device's part, per tensor: `height` runs of `width` bytes, the first
 * src_off bytes into the tensor, one every `pitch` bytes, packed densely at
 * the tensor's slot offset (one 2D copy). */
typedef struct {
    uint64_t src_off[ST_WG_MAX_TENSORS], width[ST_WG_MAX_TENSORS], pitch[ST_WG_MAX_TENSORS],
        height[ST_WG_MAX_TENSORS];
    int64_t rows;       /* the device's intermediate rows */
    int64_t cpu_rows;   /* the CPU's: I - rows */
    uint64_t dev_bytes; /* tensor bytes of the device's part (the norm included) */
    uint64_t cpu_bytes; /* the CPU's (the norm included) */
} st_wg_split;

/* The split of FFN group g at `rows` device rows; false when g is not an FFN
 * group or rows or I - rows is not a positive multiple of the granule. */
bool st_wg_split_of(const st_wgroup *g, int64_t rows, st_wg_split *out);
/* The granule of FFN group g's splits: the fewest columns of down, a whole
 * number of its quantization blocks and of 32, whose bytes are a multiple of
 * 16 (the device's packed rows stay aligned for vector loads); 0 when g is
 * not an FFN group. */
int64_t st_wg_split_granule(const st_wgroup *g);

/* Builds the group table of an opened Llama model. Borrows `m` (tensor
 * descriptors are pointed at, not copied); the caller owns *out
 * (st_wgroups_free). Errors: a tensor missing (named), an untied model
 * without lm_head. */
strata_status st_wgroups_build(const st_model_files *m, st_wgroups **out);
void st_wgroups_free(st_wgroups *g); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif

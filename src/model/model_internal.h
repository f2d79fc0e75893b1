/* model_internal: the st_llama struct shared by llama.c (init, ops),
 * forward.c (the layer loop) and graphs.c (recorded passes). Not for use
 * outside src/model. */
#pragma once
#include "model/llama.h"

#define TRY(x) do { strata_status st_ = (x); if (st_ != STRATA_OK) return st_; } while (0)

/* Device views of one batch's metadata (in the pool's metadata buffer). */
typedef struct {
    const int64_t *slots;
    const int32_t *tokens, *pos, *seq, *logit_rows;
    const int32_t *rope_pos; /* pos + the batch's pos_offset: the positions RoPE turns by */
    st_paged_kv pk;      /* .cache set per layer */
    /* gathered attention (forward.c batch_upload): > 0 when the batch is one
     * sequence's prefill chunk whose keys 0..gather_ctx-1 are gathered from
     * the pool (key_slots: their slots) into m->kg / m->vg for the
     * backend's contiguous tensor-core attention */
    int64_t gather_ctx;
    const int32_t *key_slots;
    /* a streamed sequence (st_llama_forward_stream): its keys before the
     * pass live in ks (kv/kv_stream.h); slots are rows of its area */
    st_kv_stream *ks;
} batch_dev;

/* One shape of pass and its recording. A recording holds every pointer and
 * launch configuration of the pass, so the key is everything those depend
 * on when the weights are resident: the token count, the logit rows, the
 * attention's bucketed context bound (its split count), whether the sample
 * op runs, and the KV pool. */
#define BG_SLOTS 32
#define BG_MAX_TOKENS 256    /* larger passes always run directly: their kernels are long enough to hide the
                                launches, and their shapes (prefill chunks) seldom repeat */
typedef struct {
    bool used;               /* the key is set: the shape ran directly at least once (its scratch is sized) */
    int64_t n, n_logits, max_ctx;
    bool sample;
    const st_kv_pool *kv;
    st_graph *g;             /* NULL: not recorded (yet) */
    int fails;
    uint64_t last_use;
} batch_graph;

struct st_llama {
    const st_model_files *files;
    st_backend *be;
    st_config cfg;
    int64_t max_seq_len, max_tokens;
    st_stream *stream;      /* compute stream */

    st_wgroups *groups;     /* weight groups: embed, attn.l, ffn.l, output */
    st_weight (*wshape)[ST_WG_MAX_TENSORS]; /* [groups->n]: each tensor's dtype and shape (no data):
                                               attn [norm 1 x H, q [heads*hd, H], k, v [kv*hd, H],
                                               o [H, heads*hd]]; ffn [norm 1 x H, gate, up [I, H],
                                               down [H, I]]; output [norm 1 x H, lm_head [V, H]] */
    st_wm *wm;              /* where the weights live: device, pinned host, SSD */

    /* activations, [max_tokens, ...] each but gate / up [ffn_rows, ...] (planner/planner.h st_plan_act_bytes) */
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *logits;
    float *inv_freq;        /* [head_dim/2] */
    float *lse;             /* [max_tokens, n_heads]: attention_part's running log-sum-exp */
    float *kg, *vg;         /* [gather_rows, kv_dim] one piece of one sequence's gathered keys / values
                               (planner/planner.h st_plan_gather_bytes) */
    int64_t piece, gather_rows; /* keys per attention piece; rows of kg / vg */
    int64_t ffn_rows;       /* rows of gate / up: a pass's FFN runs in sub-chunks of at most this many */
    /* device sampling: args and ids, device / pinned host [max_tokens] each */
    st_sample_args *d_sargs, *h_sargs;
    int32_t *d_sids, *h_sids;

    /* a batch padded to its shape bucket (forward.c pad_batch): host [max_tokens] each */
    int32_t *pad_tokens, *pad_pos, *pad_seq, *pad_rows;
    int64_t *pad_slots;

    /* the CPU tier's executor (llama.c init_cpu_exec; NULL cpu: no group on the CPU tier) */
    st_backend *cpu;        /* the model's own CPU backend */
    st_stream *cpu_stream;
    int64_t cpu_max_tokens; /* passes of at most this many tokens compute CPU-tier groups on the CPU;
                               larger ones stream them to the device */
    float *h_x, *h_tmp;     /* pinned host (the main backend's) [cpu_max_tokens, hidden] each */
    float *c_xn, *c_gate, *c_up; /* the CPU backend's [cpu_max_tokens, hidden / intermediate] */
    st_event *cpu_ev;       /* x and tmp are on the host (the CPU waits on it) */
    /* a streamed sequence's oldest keys attended on the CPU (params.cpu_attn; llama.c attn_cpu_part) */
    double cpu_attn;        /* the share of the earlier keys (0: none; < 0: planned at the first streamed pass) */
    double cpu_attn_bw, cpu_attn_h2d; /* the rates it was planned from (st_llama_cpu_attn) */
    double h2d_given;       /* params.weights.bw.h2d */
    int64_t cpu_attn_tokens; /* passes of at most this many tokens split (0: none) */
    st_backend *acpu;       /* its executor: the CPU tier's backend, the model's own when the model runs on
                               the CPU, else one of its own (acpu_owned) */
    bool acpu_owned;
    st_stream *acpu_stream; /* its stream (the compute stream when acpu is the model's backend) */
    float *h_q, *h_att, *h_lse; /* pinned host [cpu_attn_tokens, n_heads (x head_dim)] */
    int32_t *h_pos;         /* host [cpu_attn_tokens] */
    float *att2, *lse2;     /* device: the CPU's part, up */
    st_event *q_ev;         /* q is on the host */

    /* recorded passes (graphs.c) */
    batch_graph bg[BG_SLOTS];
    bool bg_off;            /* no graphs: params.no_graphs, st_llama_set_graphs, a backend without
                               graphs, or too many invalidations */
    uint64_t bg_takes;      /* be->device_budget.takes when the recordings were last known valid */
    uint64_t bg_clock;      /* LRU clock */
    int bg_invalid;         /* times the recordings were dropped for a device allocation */
    st_llama_graph_stats bg_stats;
};

/* llama.c: the ops of one group over n tokens (the Llama-specific math). */
strata_status st_llama_attn_ops(st_llama *m, const st_weight *w, const st_kv_layer *cache, batch_dev *d,
                                int64_t n, int64_t layer);
strata_status st_llama_ffn_ops(st_llama *m, const st_weight *w, int64_t n);
/* params.cpu_attn < 0: the share planned now for a stream of this dtype (llama.c). */
strata_status st_llama_plan_cpu_attn(st_llama *m, st_kv_dtype dtype);
/* Where an FFN runs: its backend, stream and buffers (x, tmp: the residual
 * stream and the previous group's output in, tmp the FFN's output out). */
typedef struct {
    st_backend *be;
    st_stream *stream;
    float *x, *tmp, *xn, *gate, *up;
    int64_t rows; /* rows of gate / up */
} st_ffn_exec;
/* The same ops on m->cpu over m->h_x / m->h_tmp (n <= m->cpu_max_tokens). */
strata_status st_llama_ffn_ops_cpu(st_llama *m, const st_weight *w, int64_t n);
strata_status st_llama_output_ops(st_llama *m, const st_weight *w, const batch_dev *d, int64_t n, int64_t n_out);

/* forward.c: the whole pass from the metadata on the device (d) to the
 * logits in m->logits and, when `sample`, the ids in m->h_sids. */
strata_status st_llama_batch_ops(st_llama *m, st_kv_pool *kv, batch_dev *d, const int32_t *tokens, int64_t n,
                                 int64_t n_logits, bool sample);

/* graphs.c: runs the pass as a replayed graph, a recording or directly. */
strata_status st_llama_batch_run(st_llama *m, st_kv_pool *kv, batch_dev *d, const st_batch *b, bool sample);
void st_llama_graphs_free(st_llama *m);

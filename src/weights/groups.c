/* weights/groups: the group table (see groups.h for the layouts). */
#include "weights/groups.h"

#include <stdio.h>
#include <string.h>

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Fills the slot/image layouts and extents of g from its tensors. */
static void layout_group(st_wgroup *g) {
    uint64_t so = 0;
    g->bytes = 0;
    for (int i = 0; i < g->n_tensors; i++) {
        g->t[i].slot_off = so;
        so += align_up(g->t[i].desc->nbytes, ST_WG_SLOT_ALIGN);
        g->bytes += g->t[i].desc->nbytes;
    }
    g->slot_bytes = so;

    /* tensors in file order, merged into extents where their aligned ranges meet */
    int idx[ST_WG_MAX_TENSORS];
    for (int i = 0; i < g->n_tensors; i++) idx[i] = i;
    for (int i = 1; i < g->n_tensors; i++) /* insertion sort by (file, offset) */
        for (int j = i; j > 0; j--) {
            const st_tensor_desc *a = g->t[idx[j - 1]].desc, *b = g->t[idx[j]].desc;
            if (a->file < b->file || (a->file == b->file && a->offset <= b->offset)) break;
            int tmp = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = tmp;
        }
    g->n_extents = 0;
    uint64_t img = 0;
    for (int k = 0; k < g->n_tensors; k++) {
        const st_tensor_desc *d = g->t[idx[k]].desc;
        const uint64_t lo = d->offset / ST_WG_ALIGN * ST_WG_ALIGN;
        const uint64_t hi = align_up(d->offset + d->nbytes, ST_WG_ALIGN);
        st_wg_extent *e = g->n_extents ? &g->ext[g->n_extents - 1] : NULL;
        if (e && e->file == d->file && lo <= e->file_off + e->len) {
            if (hi > e->file_off + e->len) {
                img += hi - (e->file_off + e->len);
                e->len = hi - e->file_off;
            }
            if (d->offset + d->nbytes - e->file_off > e->need) e->need = d->offset + d->nbytes - e->file_off;
        } else {
            e = &g->ext[g->n_extents++];
            e->file = d->file;
            e->file_off = lo;
            e->len = hi - lo;
            e->need = d->offset + d->nbytes - lo;
            e->img_off = img;
            img += e->len;
        }
        g->t[idx[k]].img_off = e->img_off + (d->offset - e->file_off);
    }
    g->img_bytes = img;
}

static strata_status add_tensor(const st_model_files *m, st_wgroup *g, const char *name) {
    const st_tensor_desc *d = st_model_find(m, name);
    if (!d) return st_err(STRATA_ERR_NOT_FOUND, "%s: tensor %s is missing", m->path, name);
    ST_ASSERT(g->n_tensors < ST_WG_MAX_TENSORS);
    g->t[g->n_tensors++].desc = d;
    return STRATA_OK;
}

strata_status st_wgroups_build(const st_model_files *m, st_wgroups **out) {
    if (!out) return st_err(STRATA_ERR_INVALID_ARG, "weight groups: out is NULL");
    *out = NULL;
    if (!m) return st_err(STRATA_ERR_INVALID_ARG, "weight groups: model is NULL");
    const int64_t L = m->config.n_layers;
    if (L <= 0 || L > (1 << 20))
        return st_err(STRATA_ERR_INVALID_ARG, "%s: %lld layers", m->path, (long long)L);
    st_wgroups *gs = st_calloc(1, sizeof *gs);
    if (!gs) return st_err(STRATA_ERR_NOMEM, "weight groups: out of memory for its state (%zu bytes)", sizeof *gs);
    gs->n_layers = (int)L;
    gs->n = 2 * (int)L + 2;
    gs->g = st_calloc((size_t)gs->n, sizeof *gs->g);
    if (!gs->g) {
        st_free(gs);
        return st_err(STRATA_ERR_NOMEM, "weight groups: out of memory for %d groups (%zu bytes)", gs->n,
                      (size_t)gs->n * sizeof *gs->g);
    }
    strata_status st = STRATA_OK;
    char name[256];

    st_wgroup *e = &gs->g[0];
    e->kind = ST_WG_EMBED;
    e->layer = -1;
    snprintf(e->name, sizeof e->name, "embed");
    if ((st = add_tensor(m, e, "model.embed_tokens.weight"))) goto fail;

    static const char *attn[] = {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                 "self_attn.v_proj.weight", "self_attn.o_proj.weight"};
    static const char *ffn[] = {"post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                "mlp.down_proj.weight"};
    for (int l = 0; l < (int)L; l++) {
        st_wgroup *a = &gs->g[st_wg_attn_id(l)], *f = &gs->g[st_wg_ffn_id(l)];
        a->kind = ST_WG_ATTN;
        f->kind = ST_WG_FFN;
        a->layer = f->layer = l;
        snprintf(a->name, sizeof a->name, "attn.%d", l);
        snprintf(f->name, sizeof f->name, "ffn.%d", l);
        for (int i = 0; i < 5; i++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, attn[i]);
            if ((st = add_tensor(m, a, name))) goto fail;
        }
        for (int i = 0; i < 4; i++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, ffn[i]);
            if ((st = add_tensor(m, f, name))) goto fail;
        }
    }

    st_wgroup *o = &gs->g[gs->n - 1];
    o->kind = ST_WG_OUTPUT;
    o->layer = -1;
    snprintf(o->name, sizeof o->name, "output");
    if ((st = add_tensor(m, o, "model.norm.weight"))) goto fail;
    if (st_model_find(m, "lm_head.weight")) {
        if ((st = add_tensor(m, o, "lm_head.weight"))) goto fail;
    } else if (m->config.tie_word_embeddings) {
        if ((st = add_tensor(m, o, "model.embed_tokens.weight"))) goto fail;
        gs->tied = true;
    } else {
        st = st_err(STRATA_ERR_NOT_FOUND, "%s: lm_head.weight is missing and embeddings are not tied", m->path);
        goto fail;
    }

    for (int i = 0; i < gs->n; i++) {
        layout_group(&gs->g[i]);
        if (i == 0 && gs->tied) { /* the table's bytes belong to output */
            gs->g[0].bytes = gs->g[0].slot_bytes = gs->g[0].img_bytes = 0;
            gs->g[0].n_extents = 0;
        }
        gs->model_bytes += gs->g[i].bytes;
        if (gs->g[i].slot_bytes > gs->max_slot_bytes) gs->max_slot_bytes = gs->g[i].slot_bytes;
    }
    const st_tensor_desc *et = gs->g[0].t[0].desc;
    if (et->n_dims != 2 || et->shape[0] != m->config.vocab_size) {
        st = st_err(STRATA_ERR_MISMATCH, "%s: model.embed_tokens.weight is not [vocab %lld, hidden]", m->path,
                    (long long)m->config.vocab_size);
        goto fail;
    }
    gs->embed_cols = et->shape[1];
    gs->embed_dtype = et->dtype;
    gs->embed_row_bytes = st_dtype_row_bytes(et->dtype, et->shape[1]);
    if (gs->embed_row_bytes * (uint64_t)et->shape[0] != et->nbytes) {
        st = st_err(STRATA_ERR_MISMATCH, "%s: model.embed_tokens.weight holds %llu bytes, not %lld rows of %llu",
                    m->path, (unsigned long long)et->nbytes, (long long)et->shape[0],
                    (unsigned long long)gs->embed_row_bytes);
        goto fail;
    }
    *out = gs;
    return STRATA_OK;
fail:
    st_wgroups_free(gs);
    return st;
}

int64_t st_wg_split_granule(const st_wgroup *g) {
    if (g->kind != ST_WG_FFN || g->n_tensors <= ST_WG_DOWN || !g->t[ST_WG_GATE].desc || !g->t[ST_WG_DOWN].desc)
        return 0;
    const st_dtype_info *di = st_dtype_get(g->t[ST_WG_DOWN].desc->dtype);
    if (!di) return 0;
    for (int64_t k = di->block_elems; k <= 64 * 256; k += di->block_elems)
        if (k % 32 == 0 && st_dtype_row_bytes(g->t[ST_WG_DOWN].desc->dtype, k) % 16 == 0) return k;
    return 0;
}

bool st_wg_split_of(const st_wgroup *g, int64_t rows, st_wg_split *out) {
    const int64_t q = st_wg_split_granule(g);
    if (q == 0) return false;
    const st_tensor_desc *gate = g->t[ST_WG_GATE].desc, *down = g->t[ST_WG_DOWN].desc;
    const int64_t I = gate->shape[0], H = down->shape[0];
    if (gate->n_dims != 2 || down->n_dims != 2 || down->shape[1] != I || rows <= 0 || rows >= I || rows % q ||
        (I - rows) % q)
        return false;
    const uint64_t dfull = st_dtype_row_bytes(down->dtype, I), dcpu = st_dtype_row_bytes(down->dtype, I - rows),
                   ddev = st_dtype_row_bytes(down->dtype, rows);
    if (dfull == 0 || dcpu == 0 || ddev == 0 || dcpu + ddev != dfull) return false;
    memset(out, 0, sizeof *out);
    out->rows = rows;
    out->cpu_rows = I - rows;
    const uint64_t norm = g->t[ST_WG_FFN_NORM].desc->nbytes;
    out->width[ST_WG_FFN_NORM] = out->pitch[ST_WG_FFN_NORM] = norm;
    out->height[ST_WG_FFN_NORM] = 1;
    out->dev_bytes = out->cpu_bytes = norm;
    for (int r = ST_WG_GATE; r <= ST_WG_UP; r++) { /* rows [I - rows, I): one run */
        const uint64_t rb = g->t[r].desc->nbytes / (uint64_t)I;
        out->src_off[r] = (uint64_t)(I - rows) * rb;
        out->width[r] = out->pitch[r] = (uint64_t)rows * rb;
        out->height[r] = 1;
        out->dev_bytes += out->width[r];
        out->cpu_bytes += out->src_off[r];
    }
    out->src_off[ST_WG_DOWN] = dcpu; /* columns [I - rows, I) of each of the H rows */
    out->width[ST_WG_DOWN] = ddev;
    out->pitch[ST_WG_DOWN] = dfull;
    out->height[ST_WG_DOWN] = (uint64_t)H;
    out->dev_bytes += ddev * (uint64_t)H;
    out->cpu_bytes += dcpu * (uint64_t)H;
    return true;
}

void st_wgroups_free(st_wgroups *g) {
    if (!g) return;
    st_free(g->g);
    st_free(g);
}

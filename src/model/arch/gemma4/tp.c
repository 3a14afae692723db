/*
 * tp.c - Gemma 4's tensor-parallel forward on the CPU (issue 25; docs/TP.md): Megatron
 *   sharding over N ranks, run one rank after another in this process, with the math and
 *   the reduction order a GPU rank would run.
 * Owns: the shard of one rank (gemma4_tp_shard: a rank copy of the Gemma data with every
 *   layer's KV heads the rank's, q/k/v heads and gate/up rows column-parallel, o_proj and
 *   down_proj columns row-parallel; norms, per-layer-input weights and embeddings
 *   replicated) and the sharded forward (gemma4_forward_tp):
 *     every rank: embed and per-layer inputs (replicated), per layer [RMSNorm, q/k/v of its
 *       heads (a KV-shared layer: q only, reading the same rank's donor cache, which holds
 *       the same KV heads), its cache append and attention, o_proj of its heads -> partial]
 *     all-reduce (tp_comm: rank 0 + rank 1 + ... in float32), then replicated: post-attention
 *       RMSNorm, residual, pre-FFN RMSNorm
 *     every rank: gate/up of its MLP slice, GeGLU, down_proj of its slice -> partial; with
 *       the MoE block, beside it the router (replicated: every rank routes alike) and its
 *       slices of the chosen experts -> a second partial
 *     all-reduce (and one of the experts' partials: their output is normed on its own), then
 *       replicated: post-FFN RMSNorm(s), residual, the per-layer-input block, the layer scalar
 *     every rank: its sliding layers' drop, final RMSNorm, lm_head of its vocabulary rows,
 *       the soft-cap of its slice (elementwise) -> all-gather -> logits.
 * Sliding and full layers keep their own head_dim: the split is by head, so a rank's q rows
 * of layer l are its heads' head_dim[l]-wide blocks.
 * Must not: let a row's bits depend on other rows or on the thread count (every piece is per
 *   token or batch invariant, the all-reduce is elementwise).
 */
#include <string.h>

#include "model/arch/gemma4/gemma4.h"
#include "model/tp/tp_forward.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// shard
// ---------------------------------------------------------------------------

/* Layer l's rank-r shard into S. */
static tqkv_status shard_layer(tqkv_model *rm, const tqkv_model *m, int l, int r, int n,
                               model_layer *S) {
    const g4_config *g = &gemma4_of(m)->cfg;
    const model_layer *L = &m->layers[l];
    const int hd = g->head_dim[l], QD = m->cfg.n_heads * hd, KD = g->n_kv[l] * hd, qr = QD / n;
    int h0, hn;
    tp_kv_range(g->n_kv[l], n, r, &h0, &hn);
    const int parts = g->donor[l] != l ? 1 : g->k_eq_v[l] ? 2 : 3;
    S->attn_norm = L->attn_norm; /* norms replicated: [hidden], q/k norms [head_dim] */
    S->ffn_norm = L->ffn_norm;
    S->q_norm = L->q_norm;
    S->k_norm = L->k_norm;
    tqkv_status rc = tp_shard_attn(rm, L, QD, KD, r * qr, (r + 1) * qr, h0 * hd, (h0 + hn) * hd,
                                   parts, S);
    if (rc == TQKV_OK) rc = tp_weight_cols(rm, &L->wo, r * qr, (r + 1) * qr, &S->wo);
    return rc ? rc : tp_shard_glu(rm, L, m->cfg.intermediate_size, r, n, S);
}

tqkv_status gemma4_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    const g4_model *G = gemma4_of(m);
    tqkv_status rc = tp_check_moe(&m->cfg, n);
    if (rc != TQKV_OK) return rc;
    g4_model *RG = model_own(rm, sizeof *RG); /* the rank's geometry: its KV heads per layer */
    if (!RG) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memcpy(RG, G, sizeof *RG);
    rm->arch = RG;
    RG->cfg.max_qd = RG->cfg.max_kd = 0;
    rm->cfg.moe_intermediate_size = m->cfg.moe_intermediate_size / n; /* the rank's experts */
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (m->cfg.n_experts > 0 &&
            (rc = tp_shard_moe(rm, &G->layers[l].moe, &m->cfg, r, n, &RG->layers[l].moe)))
            return rc;
        rc = tp_check_kv(G->cfg.n_kv[l], n, "KV heads of a layer");
        if (rc != TQKV_OK) return rc;
        int h0, hn;
        tp_kv_range(G->cfg.n_kv[l], n, r, &h0, &hn);
        RG->cfg.n_kv[l] = hn;
        const int hd = G->cfg.head_dim[l];
        if (rm->cfg.n_heads * hd > RG->cfg.max_qd) RG->cfg.max_qd = rm->cfg.n_heads * hd;
        if (hn * hd > RG->cfg.max_kd) RG->cfg.max_kd = hn * hd;
        if ((rc = shard_layer(rm, m, l, r, n, &rm->layers[l])) != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

/* Layer l on every rank (the file's comment). On failure every rank's appends of layers
 * [0, l] are undone. */
static tqkv_status tp_layer(const tqkv_model *m, model_tp *tp, int l, const g4_shape *f) {
    const int H = m->cfg.hidden_size;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n; r++) {
        const tqkv_model *rm = tp->model[r];
        tqkv_model_state *q = tp->rank[r];
        g4_qkv_project(rm, q, l, f);
        if ((rc = g4_attend(rm, q, l, f)) != TQKV_OK) { /* it undid its own [0, l] */
            tp_undo_ranks(tp, r, l, f->n, f->prefill, model_kv_trim_rollback);
            return rc;
        }
        g4_out_proj(rm, q, l, f); /* partial [T, hidden] */
    }
    if ((rc = tp_reduce_tmp(tp, f->T * (size_t)H)) == TQKV_OK) {
        for (int r = 0; r < tp->n; r++) g4_attn_residual(tp->model[r], tp->rank[r], l, f->T);
        for (int r = 0; r < tp->n; r++) g4_mlp(tp->model[r], tp->rank[r], l, f);
        rc = tp_reduce_tmp(tp, f->T * (size_t)H);
    }
    if (rc == TQKV_OK && m->cfg.n_experts > 0) { /* the experts' partials, normed after */
        float *h2[TP_MAX_RANKS];
        for (int r = 0; r < tp->n; r++) h2[r] = g4_moe_out(tp->rank[r]);
        rc = tp_reduce(tp, h2, f->T * (size_t)H);
    }
    if (rc != TQKV_OK) {
        tp_undo_ranks(tp, -1, l, f->n, f->prefill, model_kv_trim_rollback);
        return rc;
    }
    for (int r = 0; r < tp->n; r++) {
        g4_ffn_residual(tp->model[r], tp->rank[r], l, f->T);
        g4_ple_block(tp->model[r], tp->rank[r], l, f);
    }
    return TQKV_OK;
}

/* Every rank's scratch, token lists, positions, embeddings and per-layer inputs; the head's
 * buffers for the logits of mode (reserved here: after the sliding layers' drop nothing may
 * fail). */
static tqkv_status tp_begin(tqkv_model_state *s, const int32_t *tokens, const g4_shape *f,
                            tqkv_logits_mode mode) {
    model_tp *tp = s->tp;
    const int R = s->rows;
    tqkv_status rc = mode == TQKV_LOGITS_NONE ? TQKV_OK
                     : model_tp_head_buffers(tp, mode == TQKV_LOGITS_LAST ? (size_t)R : f->T);
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++)
        rc = gemma4_scratch(tp->rank[r], f->T, (size_t)R * (size_t)f->n);
    if (rc != TQKV_OK) return rc;
    tp_ranks_rows(s);
    for (int r = 0; r < tp->n; r++) {
        tqkv_model_state *q = tp->rank[r];
        model_forward_compact(q->len, R, f->n, q->tok_row, q->tok_col, NULL);
        g4_embed(tp->model[r], q, tokens, f); /* replicated on every rank */
    }
    return TQKV_OK;
}

/* Final RMSNorm, every rank's soft-capped vocabulary rows, gathered (tp_forward.h). */
static tqkv_status tp_head(const tqkv_model *m, tqkv_model_state *s, const g4_shape *f,
                           tqkv_logits_mode mode, float *logits) {
    const tp_head_args a = {.T = f->T, .n = f->n, .nq_pad = f->nq_pad,
                            .cap = gemma4_of(m)->cfg.softcap, .len = s->len};
    return tp_head_logits(m, s, NULL, &a, mode, logits);
}

tqkv_status gemma4_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits) {
    model_tp_sync(s); /* the parent's layers: rank 0's caches, the rows' positions */
    g4_shape f;
    tqkv_status rc = g4_preamble(m, s, tokens, lengths, n, prefill, &f);
    if (rc != TQKV_OK) return rc;
    if ((rc = tp_begin(s, tokens, &f, mode)) != TQKV_OK) return rc;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if ((rc = tp_layer(m, s->tp, l, &f)) != TQKV_OK) return rc;
    for (int r = 0; r < s->tp->n; r++) /* as the unsharded graph: before the head */
        if ((rc = g4_drop_sliding(s->tp->model[r], s->tp->rank[r])) != TQKV_OK) return rc;
    s->layers = s->tp->rank[0]->layers;
    if (mode == TQKV_LOGITS_NONE) return TQKV_OK;
    return tp_head(m, s, &f, mode, logits);
}

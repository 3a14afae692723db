/*
 * tp.c - the Llama family's tensor-parallel forward on the CPU (issue 25; docs/TP.md):
 *   Megatron sharding over N ranks, run one rank after another in this process, with the math
 *   and the reduction order a GPU rank would run.
 * Owns: the shard of one rank (llama_tp_shard: q/k/v heads and gate/up rows column-parallel,
 *   o_proj and down_proj columns row-parallel, the lm_head's vocabulary rows) and the sharded
 *   forward (llama_forward_tp):
 *     every rank: embed (replicated), per layer [RMSNorm, q/k/v of its heads, its KV heads'
 *       cache append and attention, o_proj of its heads -> partial [T, hidden]]
 *     all-reduce of the partials (tp_comm: rank 0 + rank 1 + ... in float32), + o_proj bias,
 *       residual, RMSNorm (replicated)
 *     every rank: gate/up of its MLP slice, SwiGLU, down_proj of its slice -> partial (or a
 *       graph's own feed-forward partial: llama_forward_tp_with, Qwen3-MoE's experts)
 *     all-reduce, residual
 *     every rank: final RMSNorm, lm_head of its vocabulary rows -> all-gather -> logits.
 * Column-parallel products are the unsharded ones restricted to some outputs (the same bits,
 * matmul.h); the row-parallel ones split the reduction over k into N partial sums joined in
 * rank order, so logits differ from the unsharded graph by float32 reassociation only.
 * Must not: let a row's bits depend on other rows (every piece is per token or batch
 *   invariant, the all-reduce is elementwise) or on the thread count.
 */
#include <string.h>

#include "model/arch/llama/llama.h"
#include "model/ops/ops.h"
#include "model/tp/tp_forward.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// shard
// ---------------------------------------------------------------------------

tqkv_status llama_tp_shard_attn(tqkv_model *rm, const model_layer *L, int r, int n,
                                const tqkv_model_config *c, model_layer *S) {
    const int hd = c->head_dim, QD = c->n_heads * hd, KD = c->n_kv_heads * hd, qr = QD / n;
    int h0, hn; /* the rank's KV heads (replicated when n > KV heads) */
    tp_kv_range(c->n_kv_heads, n, r, &h0, &hn);
    const int k0 = h0 * hd, kr = hn * hd;
    S->attn_norm = L->attn_norm; /* norms replicated: [hidden], q/k norms [head_dim] */
    S->ffn_norm = L->ffn_norm;
    S->q_norm = L->q_norm;
    S->k_norm = L->k_norm;
    if (L->bq) { /* head-major biases: the rank's heads are one contiguous range */
        S->bq = L->bq + r * qr;
        S->bk = L->bk + k0;
        S->bv = L->bv + k0;
    }
    S->bo = NULL; /* added once, after the all-reduce */
    tqkv_status rc = tp_shard_attn(rm, L, QD, KD, r * qr, (r + 1) * qr, k0, k0 + kr, 3, S);
    return rc ? rc : tp_weight_cols(rm, &L->wo, r * qr, (r + 1) * qr, &S->wo);
}

tqkv_status llama_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const model_layer *L = &m->layers[l];
        model_layer *S = &rm->layers[l];
        tqkv_status rc = llama_tp_shard_attn(rm, L, r, n, &m->cfg, S);
        if (rc == TQKV_OK) rc = tp_shard_glu(rm, L, m->cfg.intermediate_size, r, n, S);
        if (rc != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

/* llama_rollback as a tp_undo_fn (its status: as the unsharded graph, not reported). */
static void undo(tqkv_model_state *q, int done, int n, int prefill) {
    (void)llama_rollback(q, done, n, prefill);
}

/* Layer l: the attention block on every rank, all-reduce, + bias, residual, RMSNorm; then
 * the MLP block on every rank, all-reduce, residual. On failure every rank's appends of
 * layers [0, l] are undone. */
static tqkv_status tp_layer(const tqkv_model *m, model_tp *tp, int l, const llama_shape *f,
                            llama_tp_ffn_fn ffn) {
    const model_layer *L = &m->layers[l];
    const int H = m->cfg.hidden_size;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n; r++) {
        const tqkv_model *rm = tp->model[r];
        tqkv_model_state *q = tp->rank[r];
        llama_qkv_project(rm, q, &rm->layers[l], f);
        if ((rc = llama_attend(rm, q, l, f)) != TQKV_OK) { /* it undid its own [0, l] */
            tp_undo_ranks(tp, r, l, f->n, f->prefill, undo);
            return rc;
        }
        llama_out_matmul(rm, q, &rm->layers[l], f, NULL); /* partial [T, hidden] */
    }
    if ((rc = tp_reduce_tmp(tp, f->T * (size_t)H)) == TQKV_OK) {
        for (int r = 0; r < tp->n; r++)
            llama_residual(m, tp->rank[r], f->T, tp->rank[r]->tmp, L->bo, L->ffn_norm);
        for (int r = 0; r < tp->n && rc == TQKV_OK; r++)
            rc = ffn(tp->model[r], tp->rank[r], l, f->T, f->pf);
        if (rc == TQKV_OK) rc = tp_reduce_tmp(tp, f->T * (size_t)H);
    }
    if (rc != TQKV_OK) {
        tp_undo_ranks(tp, -1, l, f->n, f->prefill, undo);
        return rc;
    }
    for (int r = 0; r < tp->n; r++) llama_residual(m, tp->rank[r], f->T, tp->rank[r]->tmp, NULL, NULL);
    return TQKV_OK;
}

/* Final RMSNorm and every rank's vocabulary rows, gathered (tp_forward.h). */
static tqkv_status tp_head(const tqkv_model *m, tqkv_model_state *s, const llama_shape *f,
                           tqkv_logits_mode mode, float *logits) {
    const tp_head_args a = {.T = f->T, .n = f->n, .nq_pad = f->nq_pad, .len = s->len};
    return tp_head_logits(m, s, NULL, &a, mode, logits);
}

/* Every rank's scratch, token lists, positions and embeddings for this call. */
static tqkv_status tp_begin(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                            const llama_shape *f) {
    model_tp *tp = s->tp;
    const int R = s->rows;
    for (int r = 0; r < tp->n; r++) {
        tqkv_model_state *q = tp->rank[r];
        tqkv_status rc = llama_scratch(q, f->T, (size_t)R * (size_t)f->n);
        if (rc != TQKV_OK) return rc;
    }
    tp_ranks_rows(s);
    for (int r = 0; r < tp->n; r++) {
        tqkv_model_state *q = tp->rank[r];
        model_forward_compact(q->len, R, f->n, q->tok_row, q->tok_col, NULL);
        llama_embed(tp->model[r], q, tokens, f); /* replicated on every rank */
    }
    (void)m;
    return TQKV_OK;
}

/* The dense SwiGLU MLP's partial (llama_tp_ffn_fn). */
static tqkv_status ffn_dense(const tqkv_model *rm, tqkv_model_state *q, int l, size_t T, int pf) {
    llama_mlp(rm, q, &rm->layers[l], T, pf);
    return TQKV_OK;
}

tqkv_status llama_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                             const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                             float *logits) {
    return llama_forward_tp_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn_dense);
}

tqkv_status llama_forward_tp_with(const tqkv_model *m, tqkv_model_state *s,
                                  const int32_t *tokens, const int *lengths, int n, int prefill,
                                  tqkv_logits_mode mode, float *logits, llama_tp_ffn_fn ffn) {
    model_tp_sync(s);
    const int R = s->rows, V = m->cfg.vocab_size;
    tqkv_status rc = tqkv_model_state_check(s); /* rank 0's caches: the rows' offsets */
    if (rc != TQKV_OK) return rc;
    if ((rc = tqkv_batch_offsets(s->layers[0], s->off, NULL)) != TQKV_OK) return rc;
    llama_shape f = {.n = n, .prefill = prefill};
    if ((rc = model_forward_lengths(s, tokens, lengths, n, prefill, V, V, &f.T)) != TQKV_OK)
        return rc;
    f.as_dec = !prefill && n > 1 && s->p.extend_as_decode;
    f.pf = n > 1 && !f.as_dec;
    for (int r = 0; r < R; r++) f.nq_pad |= s->len[r] != n;
    if ((rc = tp_begin(m, s, tokens, &f)) != TQKV_OK) return rc;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if ((rc = tp_layer(m, s->tp, l, &f, ffn)) != TQKV_OK) return rc;
    if (mode == TQKV_LOGITS_NONE) return TQKV_OK;
    rc = tp_head(m, s, &f, mode, logits);
    if (rc != TQKV_OK) { /* the appends stand without their logits: undo them */
        tp_undo_ranks(s->tp, -1, m->cfg.n_layers - 1, f.n, f.prefill, undo);
    }
    return rc;
}

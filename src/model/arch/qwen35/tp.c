/*
 * tp.c - the Qwen 3.5 hybrid's tensor-parallel forward on the CPU (issue 25; docs/TP.md):
 *   Megatron sharding over N ranks, run one rank after another in this process, with the math
 *   and the reduction order a GPU rank would run.
 * Owns: the shard of one rank (qwen35_tp_shard) and the sharded forward (qwen35_forward_tp):
 *   - gated full-attention layers as the Llama family's: q_proj rows of the rank's heads (each
 *     head's hd query rows and hd gate rows, so the sigmoid gate stays with its head), k/v rows
 *     of its KV heads (replicated when N > KV heads), o_proj columns of its heads;
 *   - gated DeltaNet layers by head: N divides the key heads (and so the value heads), rank r
 *     holds key heads [r KH/N, (r+1) KH/N) and the value heads grouped under them
 *     [r NV/N, (r+1) NV/N) (value head h reads key head h / (NV/KH): the grouping is the same
 *     inside a rank). Its in-projection rows are the q and k channels of its key heads, the v
 *     and z rows of its value heads and their b / a rows, gathered into one matrix; its conv1d
 *     channels, A / dt_bias / conv state / recurrent state are its heads' only (the rank's
 *     recurrent rows: state/recurrent.c sized by the rank's head counts); out_proj's columns
 *     of its value heads are row-parallel;
 *   - the SwiGLU MLP column then row parallel (or a graph's own feed-forward partial:
 *     qwen35_forward_tp_with, Qwen 3.5 MoE's experts); norms and the embedding replicated; one
 *     all-reduce (tp_comm: rank 0 + rank 1 + ... in float32) after each mixer's output
 *     projection and one after down_proj; the vocabulary-parallel head and its all-gather.
 * The row operations move every rank's recurrent rows in lockstep with its caches
 * (tp/tp_rows.c with state/rows_impl.h, per rank).
 * Must not: let a row's bits depend on other rows or on the thread count (every piece is per
 *   token or batch invariant, the DeltaNet items per (row, head) in token order, the
 *   all-reduce elementwise).
 */
#include <string.h>

#include "model/arch/qwen35/qwen35.h"
#include "model/state/recurrent.h"
#include "model/tp/tp_forward.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// shard
// ---------------------------------------------------------------------------

/* A DeltaNet layer's rank-r shard into S (c: the whole model's config). */
static tqkv_status shard_linear(tqkv_model *rm, const tqkv_model_config *c, const model_layer *L,
                                int r, int n, model_layer *S) {
    const int KH = c->lin_k_heads, NV = c->lin_v_heads, DK = c->lin_k_dim, DV = c->lin_v_dim;
    const int LK = KH * DK, VD = NV * DV, CD = 2 * LK + VD;
    const int k0 = r * (KH / n) * DK, k1 = (r + 1) * (KH / n) * DK;
    const int v0 = r * (NV / n), v1 = (r + 1) * (NV / n);
    /* rows of the fused layout qkv (q | k | v) | z | b | a */
    const int ch[3][2] = {{k0, k1}, {LK + k0, LK + k1}, {2 * LK + v0 * DV, 2 * LK + v1 * DV}};
    const int fused = L->lin_in.data != NULL;
    const mm_weight *qkv = fused ? &L->lin_in : &L->lin_qkv;
    const tp_rows_part parts[6] = {
        {qkv, ch[0][0], ch[0][1]},
        {qkv, ch[1][0], ch[1][1]},
        {qkv, ch[2][0], ch[2][1]},
        {fused ? &L->lin_in : &L->lin_z, (fused ? CD : 0) + v0 * DV, (fused ? CD : 0) + v1 * DV},
        {fused ? &L->lin_in : &L->lin_b, (fused ? CD + VD : 0) + v0, (fused ? CD + VD : 0) + v1},
        {fused ? &L->lin_in : &L->lin_a, (fused ? CD + VD + NV : 0) + v0,
         (fused ? CD + VD + NV : 0) + v1},
    };
    tqkv_status rc = tp_weight_gather(rm, parts, 6, &S->lin_in);
    if (rc == TQKV_OK)
        rc = tp_floats_gather(rm, L->conv_w, c->lin_conv_kernel, ch, 3, &S->conv_w);
    if (rc == TQKV_OK) rc = tp_weight_cols(rm, &L->lin_out, v0 * DV, v1 * DV, &S->lin_out);
    S->lin_neg_a = L->lin_neg_a + v0; /* [NV / n] of the rank's value heads */
    S->dt_bias = L->dt_bias + v0;
    S->lin_norm = L->lin_norm; /* [DV], the same for every head */
    return rc;
}

/* A gated full-attention layer's rank-r shard into S: q_proj holds 2 hd rows per head (query
 * then gate), so the rank's heads are rows [r 2QD/n, (r+1) 2QD/n). */
static tqkv_status shard_full(tqkv_model *rm, const tqkv_model_config *c, const model_layer *L,
                              int r, int n, model_layer *S) {
    const int hd = c->head_dim, QD = c->n_heads * hd, KD = c->n_kv_heads * hd;
    int h0, hn;
    tp_kv_range(c->n_kv_heads, n, r, &h0, &hn);
    if (L->bq || L->bo)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel %d: Qwen 3.5 attention biases are "
                         "not sharded", n);
    S->q_norm = L->q_norm; /* [hd], replicated */
    S->k_norm = L->k_norm;
    tqkv_status rc = tp_shard_attn(rm, L, 2 * QD, KD, r * 2 * QD / n, (r + 1) * 2 * QD / n,
                                   h0 * hd, (h0 + hn) * hd, 3, S);
    return rc ? rc : tp_weight_cols(rm, &L->wo, r * QD / n, (r + 1) * QD / n, &S->wo);
}

tqkv_status qwen35_tp_shard_mixers(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    const tqkv_model_config *c = &m->cfg;
    if (c->n_linear > 0 && c->lin_k_heads % n)
        return tqkv_fail(TQKV_EINVAL, "tensor_parallel %d does not divide the model's %d "
                         "DeltaNet key heads: every rank needs whole key heads with their value "
                         "heads", n, c->lin_k_heads);
    rm->cfg.lin_k_heads = c->lin_k_heads / n; /* the rank's recurrent rows: its heads */
    rm->cfg.lin_v_heads = c->lin_v_heads / n;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        model_layer *S = &rm->layers[l];
        S->attn_norm = L->attn_norm; /* [hidden], replicated */
        S->ffn_norm = L->ffn_norm;
        tqkv_status rc = c->layer_type[l] == TQKV_LAYER_LINEAR ? shard_linear(rm, c, L, r, n, S)
                                                               : shard_full(rm, c, L, r, n, S);
        if (rc != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

tqkv_status qwen35_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    tqkv_status rc = qwen35_tp_shard_mixers(m, r, n, rm);
    for (int l = 0; l < m->cfg.n_layers && rc == TQKV_OK; l++)
        rc = tp_shard_glu(rm, &m->layers[l], m->cfg.intermediate_size, r, n, &rm->layers[l]);
    return rc;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

static qwen35_scratch *scr(const tqkv_model_state *q) { return q->ext; }

/* Every rank's mixer / MLP partial tmp [T, hidden] summed in rank order, in place. */
static tqkv_status reduce(model_tp *tp, size_t T, int H) {
    float *bufs[TP_MAX_RANKS];
    for (int r = 0; r < tp->n; r++) bufs[r] = scr(tp->rank[r])->tmp;
    return tp_reduce(tp, bufs, T * (size_t)H);
}

/* A failure at layer l after `lin` DeltaNet layers ran (rank `failed` left its own appends of
 * [0, l]; -1: every rank ran layer l): every rank's appends undone, its recurrent rows marked
 * broken when a DeltaNet layer changed them (as the unsharded graph). */
static void fail_layer(model_tp *tp, int failed, int l, int lin, const q35_shape *f) {
    if (failed >= 0) model_kv_trim_rollback(tp->rank[failed], l + 1, f->n, f->prefill);
    tp_undo_ranks(tp, failed, l, f->n, f->prefill, model_kv_trim_rollback);
    for (int r = 0; r < tp->n && lin > 0; r++) tp->rank[r]->rec->broken = 1;
}

/* Layer l on every rank (the file's comment); lin: DeltaNet layers before it. */
static tqkv_status tp_layer(const tqkv_model *m, model_tp *tp, int l, int lin,
                            const q35_shape *f, qwen35_tp_ffn_fn ffn) {
    const int H = m->cfg.hidden_size, now = lin + (m->cfg.layer_type[l] == TQKV_LAYER_LINEAR);
    tqkv_status rc;
    for (int r = 0; r < tp->n; r++)
        if ((rc = q35_mixer(tp->model[r], tp->rank[r], l, lin, f)) != TQKV_OK) {
            fail_layer(tp, r, l, lin, f);
            return rc;
        }
    if ((rc = reduce(tp, f->T, H)) == TQKV_OK) {
        for (int r = 0; r < tp->n; r++) q35_mixer_residual(tp->model[r], tp->rank[r], l, f->T);
        for (int r = 0; r < tp->n && rc == TQKV_OK; r++)
            rc = ffn(tp->model[r], tp->rank[r], l, f->T);
        if (rc == TQKV_OK) rc = reduce(tp, f->T, H);
    }
    if (rc != TQKV_OK) {
        fail_layer(tp, -1, l, now, f);
        return rc;
    }
    for (int r = 0; r < tp->n; r++) q35_add_tmp(tp->model[r], tp->rank[r], f->T);
    return TQKV_OK;
}

/* Every rank checked (its caches and recurrent rows), the call's shape from the parent, the
 * head's buffers, then every rank's scratch, rows, embeddings. Changes no row on failure. */
static tqkv_status tp_begin(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                            const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                            q35_shape *f) {
    model_tp *tp = s->tp;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) rc = q35_check(tp->model[r], tp->rank[r]);
    if (rc != TQKV_OK) return rc;
    memcpy(s->off, tp->rank[0]->off, sizeof(int) * (size_t)s->rows);
    if ((rc = q35_shape_of(s, tokens, lengths, n, prefill, f)) != TQKV_OK) return rc;
    if (mode != TQKV_LOGITS_NONE)
        rc = model_tp_head_buffers(tp, mode == TQKV_LOGITS_LAST ? (size_t)s->rows : f->T);
    if (rc != TQKV_OK) return rc;
    tp_ranks_rows(s);
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) rc = q35_begin(tp->model[r], tp->rank[r], tokens, f);
    (void)m;
    return rc;
}

/* The dense SwiGLU MLP's partial (qwen35_tp_ffn_fn). */
static tqkv_status ffn_dense(const tqkv_model *rm, tqkv_model_state *q, int l, size_t T) {
    q35_mlp(rm, q, &rm->layers[l], T);
    return TQKV_OK;
}

tqkv_status qwen35_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits) {
    return qwen35_forward_tp_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn_dense);
}

tqkv_status qwen35_forward_tp_with(const tqkv_model *m, tqkv_model_state *s,
                                   const int32_t *tokens, const int *lengths, int n, int prefill,
                                   tqkv_logits_mode mode, float *logits, qwen35_tp_ffn_fn ffn) {
    model_tp_sync(s);
    model_tp *tp = s->tp;
    q35_shape f;
    tqkv_status rc = tp_begin(m, s, tokens, lengths, n, prefill, mode, &f);
    if (rc != TQKV_OK) return rc;
    int lin = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if ((rc = tp_layer(m, tp, l, lin, &f, ffn)) != TQKV_OK) return rc;
        lin += m->cfg.layer_type[l] == TQKV_LAYER_LINEAR;
    }
    for (int r = 0; r < tp->n; r++) rec_advance(tp->rank[r]->rec, tp->rank[r]->len);
    if (mode == TQKV_LOGITS_NONE) return TQKV_OK;
    tp_head_rank rk[TP_MAX_RANKS];
    for (int r = 0; r < tp->n; r++) {
        const qwen35_scratch *k = scr(tp->rank[r]);
        rk[r] = (tp_head_rank){k->x, k->xn, k->mm};
    }
    const qwen35_scratch *k0 = scr(tp->rank[0]);
    const tp_head_args a = {.T = f.T, .n = n, .nq_pad = f.nq_pad, .len = s->len,
                            .row = k0->tok_row, .col = k0->tok_col};
    return tp_head_logits(m, s, rk, &a, mode, logits); /* cannot fail: buffers reserved */
}

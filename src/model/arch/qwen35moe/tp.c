/*
 * tp.c - Qwen 3.5 MoE's tensor-parallel forward on the CPU (issue 25; docs/TP.md): the
 *   hybrid's sharded forward (qwen35_forward_tp_with: gated DeltaNet and gated attention
 *   sharded by head) with the sparse block sharded Megatron style as its feed-forward.
 * Owns: the shard of one rank (qwen35moe_tp_shard: the hybrid's mixers, and on every layer
 *   the router and the shared expert's gate replicated, every expert and the shared expert
 *   split over their widths, tp_shard_moe) and the rank's feed-forward partial: every rank
 *   routes alike (the same router, the same xn), its partial is its slices' weighted sum plus
 *   sigmoid(gate . xn) times its slice of the shared expert; one all-reduce (rank order).
 * Must not: let a token's output depend on the other tokens of the call.
 */
#include "model/arch/qwen35/qwen35.h"
#include "model/arch/qwen35moe/qwen35moe.h"
#include "model/tp/tp_state.h"
#include "util/common.h"

tqkv_status qwen35moe_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    const tqkv_model_config *c = &m->cfg;
    tqkv_status rc = tp_check_moe(c, n);
    if (rc == TQKV_OK) rc = qwen35_tp_shard_mixers(m, r, n, rm);
    if (rc != TQKV_OK) return rc;
    q35m_model *RX = model_own(rm, sizeof *RX);
    moe_layer *layers = model_own(rm, sizeof(moe_layer) * (size_t)c->n_layers);
    if (!RX || !layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    RX->layers = layers;
    rm->arch = RX;
    rm->cfg.moe_intermediate_size = c->moe_intermediate_size / n; /* the rank's moe_shape */
    rm->cfg.moe_shared_intermediate_size = c->moe_shared_intermediate_size / n;
    for (int l = 0; l < c->n_layers && rc == TQKV_OK; l++)
        rc = tp_shard_moe(rm, &qwen35moe_of(m)->layers[l], c, r, n, &layers[l]);
    return rc;
}

/* Rank model rm's sparse block partial of layer l into its tmp (qwen35_tp_ffn_fn); cannot
 * fail: the scratch was reserved for the call. */
static tqkv_status ffn_partial(const tqkv_model *rm, tqkv_model_state *q, int l, size_t T) {
    const moe_shape sh = moe_shape_of(&rm->cfg);
    const qwen35_scratch *k = q->ext;
    return moe_experts(&qwen35moe_of(rm)->layers[l], &sh, NULL, k->xn, k->tmp, T, q->p.threads,
                       *qwen35_ffn_ext(q));
}

tqkv_status qwen35moe_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                 const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                 float *logits) {
    model_tp *tp = s->tp;
    for (int r = 0; r < tp->n; r++) { /* every rank's experts scratch, before anything changes */
        tqkv_model_state *q = tp->rank[r];
        if (!q->ext || !*qwen35_ffn_ext(q))
            return tqkv_fail(TQKV_ESTATE, "forward: rank %d has no experts scratch", r);
        const moe_shape sh = moe_shape_of(&tp->model[r]->cfg);
        tqkv_status rc = moe_scratch_reserve(*qwen35_ffn_ext(q), &sh, (size_t)s->rows * (size_t)n);
        if (rc != TQKV_OK) return rc;
    }
    return qwen35_forward_tp_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn_partial);
}

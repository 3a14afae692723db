/*
 * tp.c - Qwen3-MoE's tensor-parallel forward on the CPU (issue 25; docs/TP.md): the Llama
 *   family's sharded forward (llama_forward_tp_with) with the experts sharded Megatron style.
 * Owns: the shard of one rank (qwen3moe_tp_shard: the Qwen3 attention as the Llama family's;
 *   on a sparse layer the router replicated and every expert's gate / up rows and down_proj
 *   columns split by N over its intermediate width, as a dense MLP is; the dense layers'
 *   MLP as the Llama family's) and the rank's feed-forward partial:
 *     every rank routes every token on the same replicated router and the same xn, so every
 *     rank picks the same experts with the same weights; its partial is the weighted sum
 *     (ascending expert order) of its slice of each chosen expert; one all-reduce of the
 *     partials (rank order) then gives the layer's output, within float32 reassociation of
 *     the unsharded sum (w (a + b) against w a + w b, and down_proj's split reduction).
 * Must not: let a token's output depend on the other tokens of the call (moe.h's contract
 *   holds per rank; the all-reduce is elementwise).
 */
#include <string.h>

#include "model/arch/llama/llama.h"
#include "model/arch/qwen3moe/qwen3moe.h"
#include "model/tp/tp_state.h"
#include "util/common.h"

tqkv_status qwen3moe_tp_shard(const tqkv_model *m, int r, int n, tqkv_model *rm) {
    const tqkv_model_config *c = &m->cfg;
    const q3m_model *X = qwen3moe_of(m);
    tqkv_status rc0 = tp_check_moe(c, n);
    if (rc0 != TQKV_OK) return rc0;
    q3m_model *RX = model_own(rm, sizeof *RX);
    moe_layer *layers = model_own(rm, sizeof(moe_layer) * (size_t)c->n_layers);
    if (!RX || !layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memset(layers, 0, sizeof(moe_layer) * (size_t)c->n_layers);
    RX->layers = layers;
    rm->arch = RX;
    rm->cfg.moe_intermediate_size = c->moe_intermediate_size / n; /* the rank's moe_shape */
    rm->cfg.moe_shared_intermediate_size = c->moe_shared_intermediate_size / n;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        model_layer *S = &rm->layers[l];
        tqkv_status rc = llama_tp_shard_attn(rm, L, r, n, c, S);
        if (rc == TQKV_OK)
            rc = c->layer_moe[l] ? tp_shard_moe(rm, &X->layers[l], c, r, n, &layers[l])
                                 : tp_shard_glu(rm, L, c->intermediate_size, r, n, S);
        if (rc != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

/* Rank model rm's feed-forward partial of layer l into tmp (llama_tp_ffn_fn). */
static tqkv_status ffn_partial(const tqkv_model *rm, tqkv_model_state *q, int l, size_t T,
                               int pf) {
    if (!rm->cfg.layer_moe[l]) {
        llama_mlp(rm, q, &rm->layers[l], T, pf);
        return TQKV_OK;
    }
    const moe_shape sh = moe_shape_of(&rm->cfg);
    return moe_experts(&qwen3moe_of(rm)->layers[l], &sh, NULL, q->xn, q->tmp, T, q->p.threads,
                       q->ext);
}

tqkv_status qwen3moe_forward_tp(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                float *logits) {
    return llama_forward_tp_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn_partial);
}

/*
 * graph.c - the Qwen3-MoE CPU forward: the Llama family's forward (llama_forward_with) with
 *   the routed-experts feed-forward (src/model/ops/moe.h) on sparse layers and the dense MLP
 *   on the others.
 * Owns: the per-state experts scratch (s->ext).
 * Must not: let a token's output depend on the other tokens of the call (moe_forward's
 *   contract).
 */
#include <stdlib.h>

#include "model/arch/llama/llama.h"
#include "model/arch/qwen3moe/qwen3moe.h"
#include "util/common.h"

tqkv_status qwen3moe_state_init(tqkv_model_state *s) {
    s->ext = calloc(1, sizeof(moe_scratch));
    return s->ext ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
}

void qwen3moe_state_free(tqkv_model_state *s) {
    if (!s->ext) return;
    moe_scratch_free(s->ext);
    free(s->ext);
    s->ext = NULL;
}

static tqkv_status ffn(const tqkv_model *m, tqkv_model_state *s, int l, size_t T, int pf) {
    if (!m->cfg.layer_moe[l]) return llama_ffn_dense(m, s, l, T, pf);
    const moe_shape sh = moe_shape_of(&m->cfg);
    return moe_forward(&qwen3moe_of(m)->layers[l], &sh, s->xn, s->x, T, s->p.threads, s->ext);
}

tqkv_status qwen3moe_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                             const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                             float *logits) {
    if (s->tp) return qwen3moe_forward_tp(m, s, tokens, lengths, n, prefill, mode, logits);
    return llama_forward_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn);
}

/*
 * graph.c - the Qwen 3.5 MoE CPU forward: the hybrid's forward (qwen35_forward_with) with
 *   the sparse block (src/model/ops/moe.h: routed experts + gated shared expert) as every
 *   layer's feed-forward.
 * Owns: the per-state experts scratch (the hybrid state's ffn slot, qwen35_ffn_ext).
 * Must not: let a token's output depend on the other tokens of the call (moe_forward's
 *   contract; the hybrid's own parts keep theirs).
 */
#include <stdlib.h>

#include "model/arch/qwen35/qwen35.h"
#include "model/arch/qwen35moe/qwen35moe.h"
#include "util/common.h"

tqkv_status qwen35moe_state_init(tqkv_model_state *s) {
    if (s->tp) return TQKV_OK; /* sharded: every rank state holds its own (tp.c) */
    tqkv_status rc = qwen35_state_init(s);
    if (rc != TQKV_OK) return rc;
    moe_scratch *x = calloc(1, sizeof *x);
    if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    *qwen35_ffn_ext(s) = x;
    return TQKV_OK;
}

void qwen35moe_state_free(tqkv_model_state *s) {
    if (s->ext) {
        moe_scratch *x = *qwen35_ffn_ext(s);
        if (x) moe_scratch_free(x);
        free(x);
        *qwen35_ffn_ext(s) = NULL;
    }
    qwen35_state_free(s);
}

static tqkv_status ffn(const tqkv_model *m, tqkv_model_state *s, int l, const float *xn,
                       float *x, size_t T) {
    const moe_shape sh = moe_shape_of(&m->cfg);
    return moe_forward(&qwen35moe_of(m)->layers[l], &sh, xn, x, T, s->p.threads,
                       *qwen35_ffn_ext(s));
}

tqkv_status qwen35moe_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                              float *logits) {
    if (s->tp) return qwen35moe_forward_tp(m, s, tokens, lengths, n, prefill, mode, logits);
    if (!s->ext || !*qwen35_ffn_ext(s))
        return tqkv_fail(TQKV_ESTATE, "forward: state has no experts scratch");
    /* the scratch for every token the call may hold, before anything changes (a layer's
     * feed-forward then cannot fail midway) */
    const moe_shape sh = moe_shape_of(&m->cfg);
    tqkv_status rc = moe_scratch_reserve(*qwen35_ffn_ext(s), &sh, (size_t)s->rows * (size_t)n);
    if (rc != TQKV_OK) return rc;
    return qwen35_forward_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn);
}

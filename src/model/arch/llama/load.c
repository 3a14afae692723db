/*
 * load.c - the weights of a Llama-family checkpoint: tensor names and shapes of every layer;
 *   q/k/v and gate/up read in place, then packed into fused matrices (one GEMM instead of
 *   three / two) when the matrices are bf16.
 * Must not: run the forward pass; know other architectures' tensors.
 */
#include <stdio.h>
#include <string.h>

#include "model/arch/llama/llama.h"
#include "util/common.h"

tqkv_status llama_load_attention(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    const tqkv_model_config *c = &m->cfg;
    model_layer *L = &m->layers[l];
    int H = c->hidden_size, hd = c->head_dim, qd = c->n_heads * hd, kd = c->n_kv_heads * hd;
    char name[256];
    tqkv_status rc;
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix), name)
#define TRYL(x)                                                                                   \
    do {                                                                                          \
        if ((rc = (x)) != TQKV_OK) return rc;                                                     \
    } while (0)
    /* q/k/v and gate/up are read in place here and packed into fused matrices below */
    tqkv_model_load_params lpu = *lp;
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
    TRYL(model_load_vector(m, NAME("input_layernorm.weight"), H, &L->attn_norm));
    TRYL(model_load_vector(m, NAME("post_attention_layernorm.weight"), H, &L->ffn_norm));
    TRYL(model_load_matrix(m, &lpu, NAME("self_attn.q_proj.weight"), qd, H, &L->wq));
    TRYL(model_load_matrix(m, &lpu, NAME("self_attn.k_proj.weight"), kd, H, &L->wk));
    TRYL(model_load_matrix(m, &lpu, NAME("self_attn.v_proj.weight"), kd, H, &L->wv));
    TRYL(model_load_matrix(m, lp, NAME("self_attn.o_proj.weight"), H, qd, &L->wo));
    mm_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
    TRYL(model_fuse(m, lp, qkv, 3, &L->wqkv));
    if (c->qk_norm) {
        TRYL(model_load_vector(m, NAME("self_attn.q_norm.weight"), hd, &L->q_norm));
        TRYL(model_load_vector(m, NAME("self_attn.k_norm.weight"), hd, &L->k_norm));
    }
    if (c->qkv_bias) {
        TRYL(model_load_vector(m, NAME("self_attn.q_proj.bias"), qd, &L->bq));
        TRYL(model_load_vector(m, NAME("self_attn.k_proj.bias"), kd, &L->bk));
        TRYL(model_load_vector(m, NAME("self_attn.v_proj.bias"), kd, &L->bv));
    }
    if (c->o_bias) TRYL(model_load_vector(m, NAME("self_attn.o_proj.bias"), H, &L->bo));
    if (L->bq && L->wqkv.data) {
        L->bqkv = model_own(m, sizeof(float) * (size_t)(qd + 2 * kd));
        if (!L->bqkv) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        memcpy(L->bqkv, L->bq, sizeof(float) * (size_t)qd);
        memcpy(L->bqkv + qd, L->bk, sizeof(float) * (size_t)kd);
        memcpy(L->bqkv + qd + kd, L->bv, sizeof(float) * (size_t)kd);
    }
#undef NAME
#undef TRYL
    return TQKV_OK;
}

tqkv_status llama_load_mlp(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    tqkv_status rc;
    const int H = m->cfg.hidden_size, I = m->cfg.intermediate_size;
    model_layer *L = &m->layers[l];
    tqkv_model_load_params lpu = *lp;
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
    char name[256];
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix), name)
    if ((rc = model_load_matrix(m, &lpu, NAME("mlp.gate_proj.weight"), I, H, &L->wg)) ||
        (rc = model_load_matrix(m, &lpu, NAME("mlp.up_proj.weight"), I, H, &L->wu)) ||
        (rc = model_load_matrix(m, lp, NAME("mlp.down_proj.weight"), H, I, &L->wd)))
        return rc;
#undef NAME
    mm_weight *gu[2] = {&L->wg, &L->wu};
    return model_fuse(m, lp, gu, 2, &L->wgu);
}

/* Attention, then the dense MLP. */
static tqkv_status load_layer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    tqkv_status rc = llama_load_attention(m, lp, l);
    return rc != TQKV_OK ? rc : llama_load_mlp(m, lp, l);
}

tqkv_status llama_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp) {
    (void)dir;
    return model_load_decoder(m, lp, load_layer, NULL);
}

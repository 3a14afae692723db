/*
 * src/model/arch/qwen35/load.c - weights of the Qwen 3.5 hybrid graph (Qwen3_5ForCausalLM).
 * Owns: loading one layer, gated full attention (self_attn.*) or gated DeltaNet
 *   (linear_attn.*), with the dense MLP and norms (the mixer and norms alone for graphs built
 *   on this one: qwen35_load_mixer); the load-time transforms: zero-centred
 *   RMSNorm weights w -> 1 + w (HF computes normed * (1.0 + w) in float32, the same value),
 *   A_log -> -exp(A_log), and the partial RoPE frequency table.
 * Must not: run the graph (src/model/arch/qwen35/graph.c), parse config.json (src/model/arch/qwen35/config.c).
 *
 * Tensors (per layer l, prefix model.layers.l.):
 *   full:   self_attn.q_proj [2*NH*hd, H] (per head: hd query rows then hd gate rows),
 *           self_attn.{k,v}_proj [NKV*hd, H], self_attn.o_proj [H, NH*hd],
 *           self_attn.{q,k}_norm [hd]
 *   linear: linear_attn.in_proj_qkv [2*kd + vd, H], in_proj_z [vd, H], in_proj_{b,a} [nv, H],
 *           conv1d.weight [2*kd + vd, 1, K], A_log [nv], dt_bias [nv], norm.weight [dv],
 *           out_proj [H, vd]
 *   both:   input_layernorm, post_attention_layernorm [H], mlp.{gate,up,down}_proj
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch/qwen35/qwen35.h"
#include "model/ops/ops.h"
#include "util/common.h"

static float elem(const st_tensor *t, size_t i) {
    uint16_t h;
    float f;
    switch (t->dtype) {
    case ST_F32: memcpy(&f, t->data + 4 * i, 4); return f;
    case ST_F16: memcpy(&h, t->data + 2 * i, 2); return tqkv_f16_to_f32(h);
    default: memcpy(&h, t->data + 2 * i, 2); return tqkv_bf16_to_f32(h);
    }
}

static void add_one(float *w, int n) {
    for (int i = 0; i < n; i++) w[i] = 1.0f + w[i];
}

/* conv1d.weight [C, 1, K] (or [C, K]) -> owned f32 [C, K]. */
static tqkv_status load_conv(tqkv_model *m, const char *name, int C, int K, float **out) {
    const st_tensor *t = st_find(&m->st, name);
    if (!t) return tqkv_fail(TQKV_ECORRUPT, "missing tensor '%s' in %s", name, m->source);
    int ok = (t->ndim == 3 && t->shape[0] == C && t->shape[1] == 1 && t->shape[2] == K) ||
             (t->ndim == 2 && t->shape[0] == C && t->shape[1] == K);
    if (!ok)
        return tqkv_fail(TQKV_ECORRUPT, "tensor '%s' (%s) has the wrong shape, expected [%d, 1, %d]",
                         name, st_file_of(&m->st, t), C, K);
    if (t->dtype == ST_OTHER)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor '%s' has dtype %s (need F32, F16 or BF16)",
                         name, t->dtype_name);
    float *w = model_own(m, sizeof(float) * (size_t)C * (size_t)K);
    if (!w) return tqkv_fail(TQKV_ENOMEM, "out of memory loading '%s'", name);
    for (size_t i = 0; i < (size_t)C * (size_t)K; i++) w[i] = elem(t, i);
    m->n_params += (size_t)C * (size_t)K;
    *out = w;
    return TQKV_OK;
}

tqkv_status qwen35_load_mixer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    const tqkv_model_config *c = &m->cfg;
    model_layer *L = &m->layers[l];
    const int H = c->hidden_size, hd = c->head_dim;
    char name[256];
    tqkv_status rc;
    const char *pfx = c->weight_prefix[0] ? c->weight_prefix : "model.";
#define NAME(suffix) (snprintf(name, sizeof name, "%slayers.%d.%s", pfx, l, suffix), name)
#define TRYL(x)                                                                                   \
    do {                                                                                          \
        if ((rc = (x)) != TQKV_OK) return rc;                                                     \
    } while (0)
    /* matrices that are fused below are read in place (not packed twice) */
    tqkv_model_load_params lpu = *lp;
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
    TRYL(model_load_vector(m, NAME("input_layernorm.weight"), H, &L->attn_norm));
    TRYL(model_load_vector(m, NAME("post_attention_layernorm.weight"), H, &L->ffn_norm));
    add_one(L->attn_norm, H);
    add_one(L->ffn_norm, H);
    if (c->layer_type[l] == TQKV_LAYER_FULL) {
        int qd2 = 2 * c->n_heads * hd, kd = c->n_kv_heads * hd;
        TRYL(model_load_matrix(m, &lpu, NAME("self_attn.q_proj.weight"), qd2, H, &L->wq));
        TRYL(model_load_matrix(m, &lpu, NAME("self_attn.k_proj.weight"), kd, H, &L->wk));
        TRYL(model_load_matrix(m, &lpu, NAME("self_attn.v_proj.weight"), kd, H, &L->wv));
        TRYL(model_load_matrix(m, lp, NAME("self_attn.o_proj.weight"), H, c->n_heads * hd, &L->wo));
        TRYL(model_load_vector(m, NAME("self_attn.q_norm.weight"), hd, &L->q_norm));
        TRYL(model_load_vector(m, NAME("self_attn.k_norm.weight"), hd, &L->k_norm));
        add_one(L->q_norm, hd);
        add_one(L->k_norm, hd);
        mm_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
        TRYL(model_fuse(m, lp, qkv, 3, &L->wqkv));
    } else {
        int kd = c->lin_k_heads * c->lin_k_dim, vd = c->lin_v_heads * c->lin_v_dim,
            nv = c->lin_v_heads, cd = 2 * kd + vd;
        TRYL(model_load_matrix(m, &lpu, NAME("linear_attn.in_proj_qkv.weight"), cd, H, &L->lin_qkv));
        TRYL(model_load_matrix(m, &lpu, NAME("linear_attn.in_proj_z.weight"), vd, H, &L->lin_z));
        TRYL(model_load_matrix(m, &lpu, NAME("linear_attn.in_proj_b.weight"), nv, H, &L->lin_b));
        TRYL(model_load_matrix(m, &lpu, NAME("linear_attn.in_proj_a.weight"), nv, H, &L->lin_a));
        TRYL(model_load_matrix(m, lp, NAME("linear_attn.out_proj.weight"), H, vd, &L->lin_out));
        TRYL(load_conv(m, NAME("linear_attn.conv1d.weight"), cd, c->lin_conv_kernel, &L->conv_w));
        TRYL(model_load_vector(m, NAME("linear_attn.A_log"), nv, &L->lin_neg_a));
        TRYL(model_load_vector(m, NAME("linear_attn.dt_bias"), nv, &L->dt_bias));
        TRYL(model_load_vector(m, NAME("linear_attn.norm.weight"), c->lin_v_dim, &L->lin_norm));
        for (int h = 0; h < nv; h++) L->lin_neg_a[h] = -expf(L->lin_neg_a[h]);
        mm_weight *in[4] = {&L->lin_qkv, &L->lin_z, &L->lin_b, &L->lin_a};
        TRYL(model_fuse(m, lp, in, 4, &L->lin_in));
    }
#undef NAME
#undef TRYL
    return TQKV_OK;
}

/* The dense SwiGLU MLP of layer l (gate / up read in place and fused when bf16). */
static tqkv_status load_mlp(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    model_layer *L = &m->layers[l];
    const char *pfx = m->cfg.weight_prefix[0] ? m->cfg.weight_prefix : "model.";
    char pre[128];
    snprintf(pre, sizeof pre, "%slayers.%d.mlp.", pfx, l);
    return model_load_swiglu(m, lp, pre, m->cfg.intermediate_size, &L->wg, &L->wu, &L->wd,
                             &L->wgu);
}

static tqkv_status load_layer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    tqkv_status rc = qwen35_load_mixer(m, lp, l);
    return rc != TQKV_OK ? rc : load_mlp(m, lp, l);
}

tqkv_status qwen35_load_finish(tqkv_model *m) {
    add_one(m->final_norm, m->cfg.hidden_size);
    /* partial RoPE: inv_freq[i] = theta^(-2i / rotary_dim), i < rotary_dim / 2 */
    tqkv_model_config rc = m->cfg;
    rc.head_dim = m->cfg.rotary_dim;
    ops_rope_freqs(&rc, m->inv_freq);
    return TQKV_OK;
}

tqkv_status qwen35_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp) {
    (void)dir;
    return model_load_decoder(m, lp, load_layer, qwen35_load_finish);
}

/*
 * moe_ckpt.h - tiny random-weight checkpoints the device kernels take (hidden 256, head_dim
 * 128 / 256, vocab 256), written by the GPU tests of the mixture-of-experts graphs
 * (test_cuda_moe) and of their sharded device forward (test_cuda_tp): Qwen3-MoE (ck_write,
 * a ck_spec), Qwen 3.5 MoE (q35_write) and Gemma 4 MoE (g4m_write). The transformers
 * goldens in tests/golden/moe/ have head_dim 32, which the device refuses.
 * Must not: decide what a test asserts.
 */
#ifndef TQKV_TEST_MOE_CKPT_H
#define TQKV_TEST_MOE_CKPT_H

#include <math.h>
#include <string.h>

#include "moe_derive.h" /* dv_* tensors, config and safetensors writers */
#include "testutil.h"

enum { CK_V = 256 }; /* every checkpoint's vocabulary */

enum { CK_H = 256, CK_NH = 4, CK_NKV = 2, CK_HD = 128, CK_ID = 256 };

/* Routing that device rounding cannot flip: the routers read only the first CK_RD
 * dimensions of the residual stream, which no layer writes (o_proj's and every down
 * projection's rows there are zero), so they hold the token's embedding exactly and a
 * token's router logits are that exact dot product times one common factor (the RMSNorm's
 * 1 / rms): the device's rounding elsewhere scales them all alike and cannot reorder the
 * top k. Routing still differs from token to token (by its embedding). With random routers
 * on the whole stream, the f32 case's bf16 device cache moves a logit by ~1e-3 of its size,
 * which flips a near-tied k-th expert at a fraction of a percent of the decisions, and
 * a flip moves that token's hidden state by ~10% (estimates from these scales, not
 * measured): no logits bound could hold. */
enum { CK_RD = 32 };

/* Zero rows [0, CK_RD) of a bf16 [rows, cols] tensor from byte offset at. */
static inline void ck_zero_rows(dv_tensor *t, size_t at, int cols) {
    memset(t->data + at, 0, (size_t)CK_RD * cols * 2);
}

typedef struct {
    int layers, E, K, I, step, mlp_only; /* mlp_only: a layer index, or -1 */
    int norm, fused;
    int dense_equiv; /* experts 0 and 1 are the layer's dense MLP (E 2, K 1, I = CK_ID) */
    int dense;       /* write the dense Qwen3 checkpoint with the same weights instead */
    uint64_t seed;
} ck_spec;

/* The config keys every checkpoint here shares (hidden CK_H, head_dim CK_HD, vocab CK_V). */
static inline cJSON *ck_base_config(const char *arch, const char *type, int layers) {
    cJSON *c = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(c, "architectures");
    cJSON_AddItemToArray(a, cJSON_CreateString(arch));
    cJSON_AddStringToObject(c, "model_type", type);
    cJSON_AddStringToObject(c, "dtype", "bfloat16");
    cJSON_AddFalseToObject(c, "attention_bias");
    cJSON_AddFalseToObject(c, "tie_word_embeddings");
    cJSON_AddNumberToObject(c, "bos_token_id", 0);
    cJSON_AddNumberToObject(c, "eos_token_id", 0);
    cJSON_AddNumberToObject(c, "hidden_size", CK_H);
    cJSON_AddNumberToObject(c, "max_position_embeddings", 4096);
    cJSON_AddNumberToObject(c, "num_attention_heads", CK_NH);
    cJSON_AddNumberToObject(c, "num_key_value_heads", CK_NKV);
    cJSON_AddNumberToObject(c, "head_dim", CK_HD);
    cJSON_AddNumberToObject(c, "num_hidden_layers", layers);
    cJSON_AddNumberToObject(c, "rms_norm_eps", 1e-6);
    cJSON_AddNumberToObject(c, "vocab_size", CK_V);
    return c;
}

static inline void ck_config(const char *dir, const ck_spec *s) {
    cJSON *c = ck_base_config(s->dense ? "Qwen3ForCausalLM" : "Qwen3MoeForCausalLM",
                              s->dense ? "qwen3" : "qwen3_moe", s->layers);
    cJSON_AddNumberToObject(c, "intermediate_size", CK_ID);
    cJSON_AddNumberToObject(c, "rope_theta", 1e6);
    if (!s->dense) {
        cJSON_AddNumberToObject(c, "num_experts", s->E);
        cJSON_AddNumberToObject(c, "num_experts_per_tok", s->K);
        cJSON_AddNumberToObject(c, "moe_intermediate_size", s->I);
        cJSON_AddNumberToObject(c, "decoder_sparse_step", s->step);
        cJSON_AddBoolToObject(c, "norm_topk_prob", s->norm);
        cJSON *o = cJSON_AddArrayToObject(c, "mlp_only_layers");
        if (s->mlp_only >= 0) cJSON_AddItemToArray(o, cJSON_CreateNumber(s->mlp_only));
    }
    dv_write_config(dir, c);
}

static inline int ck_sparse(const ck_spec *s, int l) {
    return !s->dense && l != s->mlp_only && (l + 1) % s->step == 0;
}

/* Layer l's sparse block under pre, the dense MLP's tensors g, u, d ([Id, H] x 2, [H, Id]). */
static inline void ck_experts(dv_list *o, const char *pre, const ck_spec *s, const dv_tensor *g,
                              const dv_tensor *u, const dv_tensor *d, test_rng *r) {
    char nm[200];
    const int E = s->E, I = s->I, H = CK_H;
    const size_t one = (size_t)I * H * 2; /* bytes of one [I, H] */
    snprintf(nm, sizeof nm, "%sgate.weight", pre);
    dv_tensor *rt = dv_add(o, nm, 2, (int64_t[]){E, H}); /* [E, H]: columns < CK_RD only */
    for (int e = 0; e < E; e++) dv_random(rt, (size_t)e * H * 2, CK_RD, 0.35f, r);
    dv_tensor *fgu = NULL, *fd = NULL;
    if (s->fused) {
        snprintf(nm, sizeof nm, "%sexperts.gate_up_proj", pre);
        fgu = dv_add(o, nm, 3, (int64_t[]){E, 2 * I, H});
        snprintf(nm, sizeof nm, "%sexperts.down_proj", pre);
        fd = dv_add(o, nm, 3, (int64_t[]){E, H, I});
    }
    for (int e = 0; e < E; e++) {
        dv_tensor *tg = fgu, *tu = fgu, *td = fd;
        size_t ag = 2 * (size_t)e * one, au = ag + one, ad = (size_t)e * one;
        if (!s->fused) {
            snprintf(nm, sizeof nm, "%sexperts.%d.gate_proj.weight", pre, e);
            tg = dv_add(o, nm, 2, (int64_t[]){I, H});
            snprintf(nm, sizeof nm, "%sexperts.%d.up_proj.weight", pre, e);
            tu = dv_add(o, nm, 2, (int64_t[]){I, H});
            snprintf(nm, sizeof nm, "%sexperts.%d.down_proj.weight", pre, e);
            td = dv_add(o, nm, 2, (int64_t[]){H, I});
            ag = au = ad = 0;
        }
        if (s->dense_equiv) {
            memcpy(tg->data + ag, g->data, one);
            memcpy(tu->data + au, u->data, one);
            memcpy(td->data + ad, d->data, one);
        } else {
            dv_random(tg, ag, (size_t)I * H, 1.0f / 16.0f, r);
            dv_random(tu, au, (size_t)I * H, 1.0f / 16.0f, r);
            dv_random(td, ad, (size_t)I * H, 1.0f / sqrtf((float)I), r);
            ck_zero_rows(td, ad, I);
        }
    }
}

/* dir/{config.json, model.safetensors} for spec s. The attention, norms, embedding, head and
 * dense MLPs come from the seed alone, so a dense_equiv checkpoint and its dense twin (same
 * seed) share them. */
static inline void ck_write(const char *dir, const ck_spec *s) {
    ck_config(dir, s);
    const int H = CK_H, QD = CK_NH * CK_HD, KD = CK_NKV * CK_HD, V = CK_V;
    dv_list o = {0}, mlp = {0};
    test_rng r, rx; /* rx: the experts' own draws, so the rest does not depend on them */
    rng_init(&r, s->seed);
    rng_init(&rx, s->seed ^ 0x5eed5);
    dv_random(dv_add(&o, "model.embed_tokens.weight", 2, (int64_t[]){V, H}), 0, (size_t)V * H, 1.0f, &r);
    dv_random(dv_add(&o, "lm_head.weight", 2, (int64_t[]){V, H}), 0, (size_t)V * H, 2.0f / 16.0f, &r);
    dv_fill(dv_add(&o, "model.norm.weight", 1, (int64_t[]){H}), 0, H, 1.0f, 0.1f, &r);
    for (int l = 0; l < s->layers; l++) {
        char nm[200], pre[40];
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
#define T_(suffix) (snprintf(nm, sizeof nm, "%s%s", pre, suffix), nm)
        dv_fill(dv_add(&o, T_("input_layernorm.weight"), 1, (int64_t[]){H}), 0, H, 1.0f, 0.1f, &r);
        dv_fill(dv_add(&o, T_("post_attention_layernorm.weight"), 1, (int64_t[]){H}), 0, H, 1.0f, 0.1f, &r);
        dv_fill(dv_add(&o, T_("self_attn.q_norm.weight"), 1, (int64_t[]){CK_HD}), 0, CK_HD, 1.0f, 0.1f, &r);
        dv_fill(dv_add(&o, T_("self_attn.k_norm.weight"), 1, (int64_t[]){CK_HD}), 0, CK_HD, 1.0f, 0.1f, &r);
        dv_random(dv_add(&o, T_("self_attn.q_proj.weight"), 2, (int64_t[]){QD, H}), 0, (size_t)QD * H, 1.0f / 16.0f, &r);
        dv_random(dv_add(&o, T_("self_attn.k_proj.weight"), 2, (int64_t[]){KD, H}), 0, (size_t)KD * H, 1.0f / 16.0f, &r);
        dv_random(dv_add(&o, T_("self_attn.v_proj.weight"), 2, (int64_t[]){KD, H}), 0, (size_t)KD * H, 1.0f / 16.0f, &r);
        dv_tensor *wo = dv_add(&o, T_("self_attn.o_proj.weight"), 2, (int64_t[]){H, QD});
        dv_random(wo, 0, (size_t)QD * H, 1.0f / sqrtf((float)QD), &r);
        ck_zero_rows(wo, 0, QD);
        /* the dense MLP (drawn for every layer, so the stream of draws is the same for all specs) */
        dv_list *to = ck_sparse(s, l) ? &mlp : &o;
        dv_tensor *g = dv_add(to, T_("mlp.gate_proj.weight"), 2, (int64_t[]){CK_ID, H});
        dv_tensor *u = dv_add(to, T_("mlp.up_proj.weight"), 2, (int64_t[]){CK_ID, H});
        dv_tensor *d = dv_add(to, T_("mlp.down_proj.weight"), 2, (int64_t[]){H, CK_ID});
#undef T_
        dv_random(g, 0, (size_t)CK_ID * H, 1.0f / 16.0f, &r);
        dv_random(u, 0, (size_t)CK_ID * H, 1.0f / 16.0f, &r);
        dv_random(d, 0, (size_t)CK_ID * H, 1.0f / 16.0f, &r);
        ck_zero_rows(d, 0, CK_ID);
        if (ck_sparse(s, l)) {
            char mp[48];
            snprintf(mp, sizeof mp, "%smlp.", pre);
            ck_experts(&o, mp, s, g, u, d, &rx);
        }
    }
    dv_write_free(dir, &o);
    dv_list_free(&mlp);
}

// ---------------------------------------------------------------------------
// Qwen 3.5 MoE and Gemma 4 MoE checkpoints (head dims the device kernels take)
// ---------------------------------------------------------------------------

/* A bf16 matrix [rows, cols] of N(0, sd^2) under name, rows [0, CK_RD) zero when zr (a
 * projection into the residual stream: the routers' dimensions stay the embedding's). */
static inline dv_tensor *ck_mat(dv_list *o, const char *name, int rows, int cols, float sd, int zr,
                                test_rng *r) {
    dv_tensor *t = dv_add(o, name, 2, (int64_t[]){rows, cols});
    dv_random(t, 0, (size_t)rows * cols, sd, r);
    if (zr) ck_zero_rows(t, 0, cols);
    return t;
}

/* A vector [n] of mean + N(0, sd^2) (bf16, or f32). */
static inline void ck_vec(dv_list *o, const char *name, int n, float mean, float sd, int f32, test_rng *r) {
    dv_fill(dv_add_t(o, name, 1, (int64_t[]){n}, f32), 0, (size_t)n, mean, sd, r);
}

/* The routed experts under pre (experts.gate_up_proj / down_proj, fused) with a router
 * [E, H] named router that reads the columns < CK_RD only. */
static inline void ck_fused_experts(dv_list *o, const char *pre, const char *router, int E, int I,
                                    test_rng *r) {
    char nm[200];
    const int H = CK_H;
    snprintf(nm, sizeof nm, "%s%s", pre, router);
    dv_tensor *rt = dv_add(o, nm, 2, (int64_t[]){E, H});
    for (int e = 0; e < E; e++) dv_random(rt, (size_t)e * H * 2, CK_RD, 0.35f, r);
    snprintf(nm, sizeof nm, "%sexperts.gate_up_proj", pre);
    dv_random(dv_add(o, nm, 3, (int64_t[]){E, 2 * I, H}), 0, (size_t)E * 2 * I * H, 1.0f / 16.0f, r);
    snprintf(nm, sizeof nm, "%sexperts.down_proj", pre);
    dv_tensor *d = dv_add(o, nm, 3, (int64_t[]){E, H, I});
    dv_random(d, 0, (size_t)E * H * I, 1.0f / sqrtf((float)I), r);
    for (int e = 0; e < E; e++) ck_zero_rows(d, (size_t)e * H * I * 2, I);
}

/* dir/config.json from c (freed), then into o (r seeded) the embedding, the untied head and
 * the final norm (mean norm_mean: 0 for zero-centred norms). */
static inline void ck_begin(const char *dir, cJSON *c, dv_list *o, test_rng *r, uint64_t seed,
                            float norm_mean) {
    dv_write_config(dir, c);
    rng_init(r, seed);
    ck_mat(o, "model.embed_tokens.weight", CK_V, CK_H, 1.0f, 0, r);
    ck_mat(o, "lm_head.weight", CK_V, CK_H, 2.0f / 16.0f, 0, r);
    ck_vec(o, "model.norm.weight", CK_H, norm_mean, 0.1f, 0, r);
}

/* Qwen 3.5 MoE (Qwen3_5MoeForCausalLM): layers L F L F (gated DeltaNet: 2 key heads, 4
 * value heads, dims 64, conv 4; gated attention, head_dim 128, partial RoPE 25%), every
 * layer 8 experts of width 64, top 2 (always renormalised), a shared expert of width 96
 * and its sigmoid gate, fused experts. Norm weights are zero-centred (1 + w). */
enum { Q35_E = 8, Q35_K = 2, Q35_I = 64, Q35_S = 96, Q35_KH = 2, Q35_VH = 4, Q35_D = 64 };
static inline void q35_write(const char *dir, uint64_t seed) {
    cJSON *c = ck_base_config("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", 4);
    cJSON *lt = cJSON_AddArrayToObject(c, "layer_types");
    for (int l = 0; l < 4; l++)
        cJSON_AddItemToArray(lt, cJSON_CreateString(l % 2 ? "full_attention" : "linear_attention"));
    cJSON_AddNumberToObject(c, "linear_num_key_heads", Q35_KH);
    cJSON_AddNumberToObject(c, "linear_num_value_heads", Q35_VH);
    cJSON_AddNumberToObject(c, "linear_key_head_dim", Q35_D);
    cJSON_AddNumberToObject(c, "linear_value_head_dim", Q35_D);
    cJSON_AddNumberToObject(c, "linear_conv_kernel_dim", 4);
    cJSON *rp = cJSON_AddObjectToObject(c, "rope_parameters");
    cJSON_AddStringToObject(rp, "rope_type", "default");
    cJSON_AddNumberToObject(rp, "rope_theta", 1e7);
    cJSON_AddNumberToObject(rp, "partial_rotary_factor", 0.25);
    cJSON_AddNumberToObject(c, "num_experts", Q35_E);
    cJSON_AddNumberToObject(c, "num_experts_per_tok", Q35_K);
    cJSON_AddNumberToObject(c, "moe_intermediate_size", Q35_I);
    cJSON_AddNumberToObject(c, "shared_expert_intermediate_size", Q35_S);
    const int H = CK_H, hd = CK_HD, QD = CK_NH * hd, KD = CK_NKV * hd, kd = Q35_KH * Q35_D,
              vd = Q35_VH * Q35_D, cd = 2 * kd + vd;
    dv_list o = {0};
    test_rng r;
    ck_begin(dir, c, &o, &r, seed, 0.0f);
    for (int l = 0; l < 4; l++) {
        char nm[200], pre[40];
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
#define N_(suffix) (snprintf(nm, sizeof nm, "%s%s", pre, suffix), nm)
        ck_vec(&o, N_("input_layernorm.weight"), H, 0.0f, 0.1f, 0, &r);
        ck_vec(&o, N_("post_attention_layernorm.weight"), H, 0.0f, 0.1f, 0, &r);
        if (l % 2) { /* gated full attention: per head hd query rows then hd gate rows */
            ck_mat(&o, N_("self_attn.q_proj.weight"), 2 * QD, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("self_attn.k_proj.weight"), KD, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("self_attn.v_proj.weight"), KD, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("self_attn.o_proj.weight"), H, QD, 1.0f / sqrtf((float)QD), 1, &r);
            ck_vec(&o, N_("self_attn.q_norm.weight"), hd, 0.0f, 0.1f, 0, &r);
            ck_vec(&o, N_("self_attn.k_norm.weight"), hd, 0.0f, 0.1f, 0, &r);
        } else { /* gated DeltaNet */
            ck_mat(&o, N_("linear_attn.in_proj_qkv.weight"), cd, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("linear_attn.in_proj_z.weight"), vd, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("linear_attn.in_proj_b.weight"), Q35_VH, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("linear_attn.in_proj_a.weight"), Q35_VH, H, 1.0f / 16.0f, 0, &r);
            ck_mat(&o, N_("linear_attn.out_proj.weight"), H, vd, 1.0f / sqrtf((float)vd), 1, &r);
            dv_random(dv_add(&o, N_("linear_attn.conv1d.weight"), 3, (int64_t[]){cd, 1, 4}), 0,
                      (size_t)cd * 4, 0.25f, &r);
            ck_vec(&o, N_("linear_attn.A_log"), Q35_VH, 0.0f, 0.5f, 1, &r);
            ck_vec(&o, N_("linear_attn.dt_bias"), Q35_VH, 0.0f, 0.5f, 1, &r);
            ck_vec(&o, N_("linear_attn.norm.weight"), Q35_D, 1.0f, 0.1f, 0, &r);
        }
        ck_fused_experts(&o, N_("mlp."), "gate.weight", Q35_E, Q35_I, &r);
        ck_mat(&o, N_("mlp.shared_expert.gate_proj.weight"), Q35_S, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("mlp.shared_expert.up_proj.weight"), Q35_S, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("mlp.shared_expert.down_proj.weight"), H, Q35_S, 1.0f / sqrtf((float)Q35_S), 1, &r);
        ck_mat(&o, N_("mlp.shared_expert_gate.weight"), 1, H, 1.0f / 16.0f, 0, &r);
#undef N_
    }
    dv_write_free(dir, &o);
}

/* Gemma 4 with MoE blocks (Gemma4ForCausalLM, enable_moe_block): layers S F S F (sliding
 * window 16 at head_dim 128; full at head_dim 256, proportional RoPE 25%), the GeGLU MLP
 * of width 256 beside 8 GELU-tanh experts of width 64, top 2 (renormalised, times
 * router.per_expert_scale), routed on rmsnorm(x) * router.scale / sqrt(H); no per-layer
 * inputs, an untied head. */
enum { G4M_E = 8, G4M_K = 2, G4M_I = 64, G4M_WIN = 16 };
static inline void g4m_write(const char *dir, uint64_t seed) {
    cJSON *c = ck_base_config("Gemma4ForCausalLM", "gemma4_text", 4);
    cJSON *lt = cJSON_AddArrayToObject(c, "layer_types");
    for (int l = 0; l < 4; l++)
        cJSON_AddItemToArray(lt, cJSON_CreateString(l % 2 ? "full_attention" : "sliding_attention"));
    cJSON *plc = cJSON_AddObjectToObject(c, "per_layer_config");
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(plc, "1"), "head_dim", 2 * CK_HD);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(plc, "3"), "head_dim", 2 * CK_HD);
    cJSON_AddNumberToObject(c, "intermediate_size", CK_ID);
    cJSON_AddNumberToObject(c, "sliding_window", G4M_WIN);
    cJSON_AddNumberToObject(c, "hidden_size_per_layer_input", 0);
    cJSON_AddNumberToObject(c, "num_kv_shared_layers", 0);
    cJSON_AddStringToObject(c, "hidden_activation", "gelu_pytorch_tanh");
    cJSON *rp = cJSON_AddObjectToObject(c, "rope_parameters"), *rf, *rs;
    rf = cJSON_AddObjectToObject(rp, "full_attention");
    cJSON_AddNumberToObject(rf, "partial_rotary_factor", 0.25);
    cJSON_AddNumberToObject(rf, "rope_theta", 1e6);
    cJSON_AddStringToObject(rf, "rope_type", "proportional");
    rs = cJSON_AddObjectToObject(rp, "sliding_attention");
    cJSON_AddNumberToObject(rs, "rope_theta", 1e4);
    cJSON_AddStringToObject(rs, "rope_type", "default");
    cJSON_AddTrueToObject(c, "enable_moe_block");
    cJSON_AddNumberToObject(c, "num_experts", G4M_E);
    cJSON_AddNumberToObject(c, "top_k_experts", G4M_K);
    cJSON_AddNumberToObject(c, "moe_intermediate_size", G4M_I);
    const int H = CK_H;
    dv_list o = {0};
    test_rng r;
    ck_begin(dir, c, &o, &r, seed, 1.0f);
    for (int l = 0; l < 4; l++) {
        char nm[200], pre[40];
        const int hd = l % 2 ? 2 * CK_HD : CK_HD, QD = CK_NH * hd, KD = CK_NKV * hd;
        snprintf(pre, sizeof pre, "model.layers.%d.", l);
#define N_(suffix) (snprintf(nm, sizeof nm, "%s%s", pre, suffix), nm)
        const char *norms[] = {"input_layernorm.weight", "post_attention_layernorm.weight",
                               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                               "pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                               "post_feedforward_layernorm_2.weight", "router.scale"};
        for (int i = 0; i < 8; i++) ck_vec(&o, N_(norms[i]), H, 1.0f, 0.1f, 0, &r);
        ck_vec(&o, N_("self_attn.q_norm.weight"), hd, 1.0f, 0.1f, 0, &r);
        ck_vec(&o, N_("self_attn.k_norm.weight"), hd, 1.0f, 0.1f, 0, &r);
        ck_mat(&o, N_("self_attn.q_proj.weight"), QD, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("self_attn.k_proj.weight"), KD, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("self_attn.v_proj.weight"), KD, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("self_attn.o_proj.weight"), H, QD, 1.0f / sqrtf((float)QD), 1, &r);
        ck_mat(&o, N_("mlp.gate_proj.weight"), CK_ID, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("mlp.up_proj.weight"), CK_ID, H, 1.0f / 16.0f, 0, &r);
        ck_mat(&o, N_("mlp.down_proj.weight"), H, CK_ID, 1.0f / 16.0f, 1, &r);
        ck_vec(&o, N_("router.per_expert_scale"), G4M_E, 1.0f, 0.2f, 0, &r);
        ck_fused_experts(&o, pre, "router.proj.weight", G4M_E, G4M_I, &r);
#undef N_
    }
    dv_write_free(dir, &o);
}

#endif

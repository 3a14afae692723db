/*
 * src/model/arch/gemma4/load.c - loading the weights of a Gemma 4 text checkpoint (gemma4.h).
 * Owns: the gemma-specific config (re-read from config.json), tensor names and shapes of
 * every layer (no K/V weights on KV-shared layers, no v_proj under attention_k_eq_v),
 * per-layer input tables, the two RoPE frequency tables, the MoE block's router, experts
 * (model_load_experts) and norms.
 * Must not: run the forward pass; change how other architectures load (model.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/gemma4/gemma4.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// config
// ---------------------------------------------------------------------------

static tqkv_status read_config(tqkv_model *m, const char *dir, g4_config *g) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return tqkv_fail(TQKV_EIO, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = malloc((size_t)(n > 0 ? n : 1));
    size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)n) {
        free(buf);
        return tqkv_fail(TQKV_EIO, "cannot read %s", path);
    }
    cJSON *root = cJSON_ParseWithLength(buf, (size_t)n);
    free(buf);
    if (!root) return tqkv_fail(TQKV_ECORRUPT, "%s: JSON syntax error", path);
    tqkv_status rc = gemma4_config_parse(root, path, &m->cfg, g);
    cJSON_Delete(root);
    return rc;
}

/* inv_freq [hd/2] of one layer type, as transformers computes it in float32. */
static void rope_freqs(const g4_config *g, int type, int hd, float *inv) {
    int half = hd / 2, angles = half;
    if (g->proportional[type]) angles = (int)floor(g->partial[type] * hd / 2.0);
    for (int i = 0; i < half; i++) {
        if (i >= angles) {
            inv[i] = 0.0f;
            continue;
        }
        float e = (float)(2 * i) / (float)hd;
        float f = 1.0f / (float)pow(g->theta[type], (double)e);
        inv[i] = (float)(f / g->factor[type]);
    }
}

// ---------------------------------------------------------------------------
// weights
// ---------------------------------------------------------------------------

static tqkv_status load_layer(tqkv_model *m, const tqkv_model_load_params *lp, int l) {
    const tqkv_model_config *c = &m->cfg;
    g4_model *G = gemma4_of(m);
    const g4_config *g = &G->cfg;
    model_layer *L = &m->layers[l];
    g4_layer *X = &G->layers[l];
    int H = c->hidden_size, hd = g->head_dim[l], qd = c->n_heads * hd, kd = g->n_kv[l] * hd;
    int own_kv = g->donor[l] == l;
    char name[256];
    tqkv_status rc;
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix), name)
#define TRYL(x)                                                                                   \
    do {                                                                                          \
        if ((rc = (x)) != TQKV_OK) return rc;                                                     \
    } while (0)
    tqkv_model_load_params lpu = *lp; /* parts of fused matrices: read in place */
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
    TRYL(model_load_vector(m, NAME("input_layernorm.weight"), H, &L->attn_norm));
    TRYL(model_load_vector(m, NAME("post_attention_layernorm.weight"), H, &X->post_attn_norm));
    TRYL(model_load_vector(m, NAME("pre_feedforward_layernorm.weight"), H, &L->ffn_norm));
    TRYL(model_load_vector(m, NAME("post_feedforward_layernorm.weight"), H, &X->post_ffn_norm));
    TRYL(model_load_vector(m, NAME("self_attn.q_norm.weight"), hd, &L->q_norm));
    TRYL(model_load_matrix(m, &lpu, NAME("self_attn.q_proj.weight"), qd, H, &L->wq));
    if (own_kv) {
        TRYL(model_load_vector(m, NAME("self_attn.k_norm.weight"), hd, &L->k_norm));
        TRYL(model_load_matrix(m, &lpu, NAME("self_attn.k_proj.weight"), kd, H, &L->wk));
        if (!g->k_eq_v[l])
            TRYL(model_load_matrix(m, &lpu, NAME("self_attn.v_proj.weight"), kd, H, &L->wv));
        mm_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
        TRYL(model_fuse(m, lp, qkv, g->k_eq_v[l] ? 2 : 3, &L->wqkv));
    } else {
        mm_weight *q[1] = {&L->wq};
        TRYL(model_fuse(m, lp, q, 1, &L->wqkv));
    }
    TRYL(model_load_matrix(m, lp, NAME("self_attn.o_proj.weight"), H, qd, &L->wo));
    TRYL(model_load_matrix(m, &lpu, NAME("mlp.gate_proj.weight"), c->intermediate_size, H, &L->wg));
    TRYL(model_load_matrix(m, &lpu, NAME("mlp.up_proj.weight"), c->intermediate_size, H, &L->wu));
    TRYL(model_load_matrix(m, lp, NAME("mlp.down_proj.weight"), H, c->intermediate_size, &L->wd));
    mm_weight *gu[2] = {&L->wg, &L->wu};
    TRYL(model_fuse(m, lp, gu, 2, &L->wgu));
    if (g->ple_dim) {
        int P = g->ple_dim;
        TRYL(model_load_matrix(m, lp, NAME("per_layer_input_gate.weight"), P, H, &X->ple_gate));
        TRYL(model_load_matrix(m, lp, NAME("per_layer_projection.weight"), H, P, &X->ple_proj));
        TRYL(model_load_vector(m, NAME("post_per_layer_input_norm.weight"), H, &X->post_ple_norm));
    }
    if (c->n_experts > 0) { /* the MoE block: router, experts (either layout), its norms */
        const moe_shape sh = moe_shape_of(c);
        TRYL(model_load_matrix(m, lp, NAME("router.proj.weight"), sh.n_experts, H, &X->moe.router));
        TRYL(model_load_vector(m, NAME("router.scale"), H, &X->router_scale));
        float *pes;
        TRYL(model_load_vector(m, NAME("router.per_expert_scale"), sh.n_experts, &pes));
        X->moe.expert_scale = pes;
        TRYL(model_load_experts(m, lp, NAME("experts."), &sh, &X->moe));
        TRYL(model_load_vector(m, NAME("post_feedforward_layernorm_1.weight"), H, &X->post_ffn_norm_1));
        TRYL(model_load_vector(m, NAME("pre_feedforward_layernorm_2.weight"), H, &X->pre_ffn_norm_2));
        TRYL(model_load_vector(m, NAME("post_feedforward_layernorm_2.weight"), H, &X->post_ffn_norm_2));
    }
    if (!L->wk.data) L->wk.type = L->wq.type; /* absent (shared / k_eq_v): no "mixed" label */
    if (!L->wv.data) L->wv.type = L->wq.type;
    X->layer_scalar = 1.0f;
    if (st_find(&m->st, NAME("layer_scalar"))) {
        float *s;
        TRYL(model_load_vector(m, name, 1, &s));
        X->layer_scalar = s[0];
    }
#undef NAME
#undef TRYL
    return TQKV_OK;
}

tqkv_status gemma4_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp) {
    const tqkv_model_config *c = &m->cfg;
    g4_model *G = model_own(m, sizeof *G);
    if (!G) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    memset(G, 0, sizeof *G);
    m->arch = G;
    tqkv_status rc = read_config(m, dir, &G->cfg);
    if (rc != TQKV_OK) return rc;
    const g4_config *g = &G->cfg;
    int H = c->hidden_size, L = c->n_layers;

    /* rope tables per layer type */
    for (int t = 0; t < 2; t++) {
        int hd = 0;
        for (int l = 0; l < L && !hd; l++)
            if (g->sliding[l] == (t == 0)) hd = g->head_dim[l];
        for (int l = 0; l < L; l++)
            if (g->sliding[l] == (t == 0) && g->head_dim[l] != hd)
                return tqkv_fail(TQKV_EUNSUPPORTED, "%s: %s layers of different head_dim are not "
                                 "supported", m->source, t ? "full" : "sliding");
        G->half[t] = hd / 2;
        if (!hd) continue;
        G->inv_freq[t] = model_own(m, sizeof(float) * (size_t)(hd / 2));
        if (!G->inv_freq[t]) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        rope_freqs(g, t, hd, G->inv_freq[t]);
    }
    G->ones = model_own(m, sizeof(float) * (size_t)g->max_hd);
    if (!G->ones) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int i = 0; i < g->max_hd; i++) G->ones[i] = 1.0f;

    /* embeddings: read one row at a time, in place */
    tqkv_model_load_params lpe = *lp;
    lpe.weights_f32 = 0;
    lpe.blas = 0;
    lpe.no_pack = 1;
    lpe.no_f32_prefill = 1;
    rc = model_load_matrix(m, &lpe, "model.embed_tokens.weight", c->vocab_size, H, &m->embed);
    if (rc != TQKV_OK) return rc;
    if (g->ple_dim) {
        int LP = L * g->ple_dim;
        rc = model_load_matrix(m, &lpe, "model.embed_tokens_per_layer.weight", g->ple_vocab, LP,
                               &G->embed_ple);
        if (rc == TQKV_OK)
            rc = model_load_matrix(m, lp, "model.per_layer_model_projection.weight", LP, H,
                                   &G->ple_model_proj);
        if (rc == TQKV_OK)
            rc = model_load_vector(m, "model.per_layer_projection_norm.weight", g->ple_dim,
                                   &G->ple_norm);
        if (rc != TQKV_OK) return rc;
    }
    for (int l = 0; l < L; l++)
        if ((rc = load_layer(m, lp, l)) != TQKV_OK) return rc;
    rc = model_load_vector(m, "model.norm.weight", H, &m->final_norm);
    if (rc != TQKV_OK) return rc;
    return model_load_head(m, lp, "model.embed_tokens.weight");
}

int gemma4_position_layer(const tqkv_model *m) {
    if (!m || !gemma4_of(m)) return 0;
    return gemma4_of(m)->cfg.pos_layer >= 0 ? gemma4_of(m)->cfg.pos_layer : 0;
}

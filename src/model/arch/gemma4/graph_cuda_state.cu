/*
 * src/model/arch/gemma4/graph_cuda_state.cu - the Gemma 4 device graph's resources (part of
 * graph_cuda.cu's graph).
 * Owns: Gemma 4's device weights beyond mc_layer (per-layer inputs, post norms, layer
 * scalars, the MoE block's router scale and norms) and their upload; the per-state extras
 * (the sliding layers' window-view / drop scratch, the MoE block's buffers) and their
 * reservation before any capture; the device runtime's checks and RoPE rows for a Gemma 4
 * model (arch.h's cuda hooks).
 * Must not: queue forward work (graph_cuda.cu does).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/gemma4/graph_cuda_impl.cuh"

// ---------------------------------------------------------------------------
// weights
// ---------------------------------------------------------------------------

static void weights_free(void *p) {
    g4_cuda_weights *w = (g4_cuda_weights *)p;
    if (!w) return;
    for (int l = 0; w->layers && l < w->n_layers; l++) {
        g4_cuda_layer *X = &w->layers[l];
        void *ps[] = {X->post_attn,    X->post_ffn,  X->post_ple,   X->ple_gate,  X->ple_proj,
                      X->router_scale, X->pre_ffn_2, X->post_ffn_1, X->post_ffn_2};
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
        mc_moe_layer_free(X->moe);
    }
    free(w->layers);
    cudaFree(w->embed_ple);
    cudaFree(w->ple_model_proj);
    cudaFree(w->ple_norm);
    free(w);
}

/* Layer SX's MoE block (router, experts, per-expert scale, its norms) into X. */
static tqkv_status upload_moe(const tqkv_model *m, const g4_layer *SX, g4_cuda_layer *X) {
    const int H = m->cfg.hidden_size;
    const moe_shape sh = g4_moe_shape(m);
    tqkv_status st = mc_moe_layer_upload(&SX->moe, &sh, &X->moe);
    if (!st) st = mc_upload_vec(&X->router_scale, &SX->router_scale, &H, 1);
    if (!st) st = mc_upload_vec(&X->pre_ffn_2, &SX->pre_ffn_norm_2, &H, 1);
    if (!st) st = mc_upload_vec(&X->post_ffn_1, &SX->post_ffn_norm_1, &H, 1);
    if (!st) st = mc_upload_vec(&X->post_ffn_2, &SX->post_ffn_norm_2, &H, 1);
    if (!st && (!X->router_scale || !X->pre_ffn_2 || !X->post_ffn_1 || !X->post_ffn_2))
        st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: a Gemma 4 MoE block lacks a norm weight");
    return st;
}

/* Every layer's mc_layer (q|k|v stacked as the layer has them: q only on a KV-shared
 * layer, q|k under k_eq_v) and the Gemma extras. w->layers is allocated, zeroed. */
extern "C" tqkv_status g4_cuda_upload(const tqkv_model *m, model_cuda_weights *w) {
    const tqkv_model_config *c = &m->cfg;
    const g4_model *G = gemma4_of(m);
    const g4_config *g = &G->cfg;
    const int H = c->hidden_size, L = c->n_layers, P = g->ple_dim, LP = L * P;
    g4_cuda_weights *x = (g4_cuda_weights *)calloc(1, sizeof *x);
    if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    x->n_layers = L;
    x->layers = (g4_cuda_layer *)calloc((size_t)L, sizeof *x->layers);
    w->arch = x; /* freed with w on failure */
    w->arch_free = weights_free;
    if (!x->layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++) {
        const model_layer *S = &m->layers[l];
        const g4_layer *SX = &G->layers[l];
        mc_layer *D = &w->layers[l];
        g4_cuda_layer *X = &x->layers[l];
        const int hd = g->head_dim[l], own = g->donor[l] == l;
        const mm_weight *qkv[3] = {&S->wq, &S->wk, &S->wv}, *wo = &S->wo, *wd = &S->wd;
        const mm_weight *gu[2] = {&S->wg, &S->wu};
        const int nq = !own ? 1 : g->k_eq_v[l] ? 2 : 3;
        const float *an = S->attn_norm, *fn = S->ffn_norm, *qn = S->q_norm,
                    *kn = own ? S->k_norm : NULL;
        const float *pa = SX->post_attn_norm, *pf = SX->post_ffn_norm, *pp = SX->post_ple_norm;
        st = mc_upload_matrix(&D->wqkv, qkv, nq);
        if (!st) st = mc_upload_matrix(&D->wo, &wo, 1);
        if (!st) st = mc_upload_matrix(&D->wgu, gu, 2);
        if (!st) st = mc_upload_matrix(&D->wd, &wd, 1);
        if (!st) st = mc_upload_vec(&D->attn_norm, &an, &H, 1);
        if (!st) st = mc_upload_vec(&D->ffn_norm, &fn, &H, 1);
        if (!st) st = mc_upload_vec(&D->q_norm, &qn, &hd, 1);
        if (!st) st = mc_upload_vec(&D->k_norm, &kn, &hd, 1);
        if (!st) st = mc_upload_vec(&X->post_attn, &pa, &H, 1);
        if (!st) st = mc_upload_vec(&X->post_ffn, &pf, &H, 1);
        if (!st && P) {
            const mm_weight *pg = &SX->ple_gate, *pj = &SX->ple_proj;
            st = mc_upload_matrix(&X->ple_gate, &pg, 1);
            if (!st) st = mc_upload_matrix(&X->ple_proj, &pj, 1);
            if (!st) st = mc_upload_vec(&X->post_ple, &pp, &H, 1);
        }
        X->layer_scalar = SX->layer_scalar;
        if (!st && c->n_experts > 0) st = upload_moe(m, SX, X);
        if (!st && (!D->q_norm || (own && !D->k_norm) || !X->post_attn || !X->post_ffn ||
                    (P && !X->post_ple)))
            st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: Gemma 4 layer %d lacks a norm weight",
                           l);
    }
    if (!st && P) {
        const mm_weight *e = &G->embed_ple, *pm = &G->ple_model_proj;
        const float *pn = G->ple_norm;
        st = mc_upload_matrix(&x->embed_ple, &e, 1);
        if (!st) st = mc_upload_matrix(&x->ple_model_proj, &pm, 1);
        if (!st) st = mc_upload_vec(&x->ple_norm, &pn, &P, 1);
        if (!st && (LP % 8 || !x->ple_norm))
            st = tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: Gemma 4 per-layer inputs of %d", LP);
    }
    return st;
}

// ---------------------------------------------------------------------------
// per-state extras: window views, drop scratch
// ---------------------------------------------------------------------------

extern "C" void g4_cuda_state_free(model_cuda *g) {
    g4_cuda_state *S = g4s(g);
    if (!S) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    tqkv_cuda_slide_free(S->slide);
    mc_moe_state_free(g, &S->moe);
    cudaFree(S->xr);
    cudaFree(S->x2);
    cudaFree(S->h2);
    free(S);
    g->arch = NULL;
}

/* The first sliding layer with a cache (every sliding layer has the same shape), or -1. */
static int first_sliding(const model_cuda *g) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    for (int l = 0; l < c->n_layers; l++)
        if (c->sliding[l] && g->kv[l]) return l;
    return -1;
}

/* The MoE block's buffers for the g->cap_t tokens of the common scratch (graphs off). */
static tqkv_status prepare_moe(model_cuda *g, g4_cuda_state *S) {
    const moe_shape sh = g4_moe_shape(g->m);
    tqkv_status st = mc_moe_reserve(g, &sh, &S->moe);
    const size_t T = g->cap_t, bytes = T * (size_t)g->m->cfg.hidden_size * 4;
    if (st || T <= S->moe_cap) return st;
    size_t cap = 0;
    S->moe_cap = 0;
    st = mc_regrow(g, (void **)&S->xr, 0, bytes, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&S->x2, 0, bytes, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&S->h2, 0, bytes, &cap, T);
    if (!st) S->moe_cap = T;
    return st;
}

/* Buffers for g->rows rows, made before any capture (a new set bumps the generation). */
extern "C" tqkv_status g4_cuda_prepare(model_cuda *g) {
    if (!g->arch) {
        g4_cuda_state *S = (g4_cuda_state *)calloc(1, sizeof *S);
        if (!S) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        tqkv_status st = tqkv_cuda_slide_init(&S->slide);
        if (st) {
            free(S);
            return st;
        }
        g->arch = S;
    }
    if (g->m->cfg.n_experts > 0) {
        const tqkv_status sm = prepare_moe(g, g4s(g));
        if (sm) return sm;
    }
    const int ls = first_sliding(g);
    if (ls < 0) return TQKV_OK;
    int moved = 0;
    tqkv_status st = tqkv_cuda_slide_reserve(g4s(g)->slide, g->kv[ls], &moved);
    if (moved) g->gen++;
    return st;
}

// ---------------------------------------------------------------------------
// the device runtime's checks and RoPE rows for a Gemma 4 model (arch.h's cuda hooks)
// ---------------------------------------------------------------------------

/* Per-layer head dims and KV heads the device kernels take, a bounded position layer, and
 * per-layer inputs the scratch can hold. */
extern "C" tqkv_status g4_cuda_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const g4_config *g4 = &gemma4_of(m)->cfg;
    if (c->n_experts > 0) { /* the MoE blocks' expert shapes */
        const tqkv_status rc = mc_moe_check(m);
        if (rc) return rc;
    }
    for (int l = 0; l < c->n_layers; l++) {
        if (g4->head_dim[l] != CUDA_DIM && g4->head_dim[l] != CUDA_DIM_WIDE)
            return tqkv_fail(TQKV_EUNSUPPORTED,
                             "--device cuda: Gemma 4 layer %d head_dim %d (the "
                             "device kernels take %d and %d)",
                             l, g4->head_dim[l], CUDA_DIM, CUDA_DIM_WIDE);
        if (c->n_heads % g4->n_kv[l] || c->n_heads / g4->n_kv[l] > CUDA_MAX_G)
            return tqkv_fail(TQKV_EUNSUPPORTED,
                             "--device cuda: Gemma 4 layer %d: %d query heads "
                             "per KV head (at most %d)",
                             l, c->n_heads / g4->n_kv[l], CUDA_MAX_G);
    }
    if (g4->pos_layer < 0)
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "--device cuda: a Gemma 4 graph without a full "
                         "non-shared layer (its sliding layers could not be bounded)");
    if (g4->ple_dim && (g4->ple_dim % 8 || g4->ple_dim > c->intermediate_size))
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "--device cuda: per-layer input width %d (the device "
                         "needs a multiple of 8)",
                         g4->ple_dim);
    return TQKV_OK;
}

/* Both layer types' tables per token: sliding | full. */
extern "C" int g4_cuda_rope_width(const tqkv_model *m) {
    return 2 * (gemma4_of(m)->half[0] + gemma4_of(m)->half[1]);
}

extern "C" void g4_cuda_rope_row(const tqkv_model *m, int pos, float *rp) {
    for (int k = 0; k < 2; k++) {
        const int hk = gemma4_of(m)->half[k];
        if (hk) ops_rope_table(pos, gemma4_of(m)->inv_freq[k], hk, rp, rp + hk);
        rp += 2 * hk;
    }
}

extern "C" int g4_cuda_ple_width(const tqkv_model *m) { return gemma4_of(m)->cfg.ple_dim; }

/*
 * src/model/cuda/moe_cuda_state.cu - the device experts' weights and scratch (part of
 * moe_cuda.cu's sparse layer).
 * Owns: the upload and free of one sparse layer's device weights (mc_moe_layer), a state's
 * experts scratch (mc_moe_state) grown with the common scratch, and the hooks of a
 * moe_layer array behind the common device graph (Qwen3-MoE, Qwen 3.5 MoE).
 * Must not: queue a layer's work itself (moe_cuda.cu does; the ffn hook calls it).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"
#include "model/cuda/moe_cuda_impl.cuh"
#include "model/ops/gemm_cuda.h"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// device weights and state scratch
// ---------------------------------------------------------------------------

extern "C" void mc_moe_layer_free(mc_moe_layer *D) {
    if (!D) return;
    void *ps[] = {D->router, D->wgu, D->wd, D->sh_wgu, D->sh_wd, D->sh_gate, D->scale};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
    free(D);
}

/* Row 0.. n of host matrix w as float32 on the device (*out [n, k]). */
static tqkv_status upload_f32(const mm_weight *w, float **out) {
    const int n = w->n * w->k;
    float *r = (float *)malloc(sizeof(float) * (size_t)n);
    if (!r) return tqkv_fail(TQKV_ENOMEM, "out of memory staging a router");
    for (int e = 0; e < w->n; e++) mm_weight_row(w, e, r + (size_t)e * w->k);
    const float *rp = r;
    const tqkv_status st = mc_upload_vec(out, &rp, &n, 1);
    free(r);
    return st;
}

/* Gate | up of one gated MLP: the fused matrix, or gate then up. */
static int gate_up_parts(const mm_weight *gu, const mm_weight *g, const mm_weight *u,
                         const mm_weight **ws) {
    if (gu->data) {
        ws[0] = gu;
        return 1;
    }
    ws[0] = g;
    ws[1] = u;
    return 2;
}

extern "C" tqkv_status mc_moe_layer_upload(const moe_layer *X, const moe_shape *sh,
                                           mc_moe_layer **out) {
    const int E = sh->n_experts;
    *out = NULL;
    mc_moe_layer *D = (mc_moe_layer *)calloc(1, sizeof *D);
    const mm_weight **ws = (const mm_weight **)malloc(sizeof(mm_weight *) * 2 * (size_t)E);
    if (!D || !ws) {
        free(D);
        free(ws);
        return tqkv_fail(TQKV_ENOMEM, "out of memory staging the experts");
    }
    tqkv_status st = upload_f32(&X->router, &D->router);
    if (!st && X->expert_scale) st = mc_upload_vec(&D->scale, &X->expert_scale, &E, 1);
    int nw = 0; /* [E] fused gate|up, or gate, up per expert */
    for (int e = 0; e < E; e++) nw += gate_up_parts(&X->gu[e], &X->g[e], &X->u[e], ws + nw);
    if (!st) st = mc_upload_matrix(&D->wgu, ws, nw);
    for (int e = 0; e < E; e++) ws[e] = &X->down[e];
    if (!st) st = mc_upload_matrix(&D->wd, ws, E);
    if (!st && sh->shared_inter > 0) {
        nw = gate_up_parts(&X->sh_gu, &X->sh_g, &X->sh_u, ws);
        st = mc_upload_matrix(&D->sh_wgu, ws, nw);
        ws[0] = &X->sh_down;
        if (!st) st = mc_upload_matrix(&D->sh_wd, ws, 1);
        if (!st) st = upload_f32(&X->sh_gate, &D->sh_gate);
    }
    free(ws);
    if (st) mc_moe_layer_free(D);
    else *out = D;
    return st;
}

extern "C" void mc_moe_state_free(model_cuda *g, mc_moe_state **xp) {
    mc_moe_state *x = *xp;
    if (!x) return;
    cudaStreamSynchronize(g->stream);
    cudaFree(x->logits);
    cudaFree(x->idx);
    cudaFree(x->done);
    cudaFreeHost(x->h_back);
    void *ps[] = {x->xg, x->gu, x->h, x->y, x->sy, x->sg, x->xf};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
    free(x);
    *xp = NULL;
}

/* Scratch for the T tokens the common scratch holds (g->cap_t), grown with it. */
extern "C" tqkv_status mc_moe_reserve(model_cuda *g, const moe_shape *sh, mc_moe_state **xp) {
    if (!mc_moe_grouped_on() || g->cublas) g->graph.enabled = 0; /* a wait inside the step: no capture */
    mc_moe_state *x = *xp;
    if (!x) {
        x = (mc_moe_state *)calloc(1, sizeof *x);
        if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        *xp = x;
    }
    if (!x->done) { /* once per state: a counter the router's fused tail resets itself */
        tqkv_status st = mc_dmalloc((void **)&x->done, sizeof(int));
        /* on the stream the router runs on (non-blocking: the legacy stream would not order it) */
        if (!st) st = mc_ck(cudaMemsetAsync(x->done, 0, sizeof(int), g->stream), "experts counter");
        if (st) return st;
    }
    const size_t T = g->cap_t;
    if (T <= x->cap) return TQKV_OK;
    const size_t E = (size_t)sh->n_experts, K = (size_t)sh->top_k, P = T * K,
                 H = (size_t)sh->hidden, I = (size_t)sh->inter, S = (size_t)sh->shared_inter;
    const size_t GU = P * 2 * I > T * 2 * S ? P * 2 * I : T * 2 * S;
    size_t cap = 0; /* mc_regrow's; x->cap is set once everything is there */
    x->cap = 0;
    x->e_cap = (int)E;
    x->k_cap = (int)K;
    tqkv_status st = mc_regrow(g, (void **)&x->logits, 0, T * E * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->idx, 0, IDX_WORDS(E, P) * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h_back, 1, (E + 2) * 4, &cap, T);
    if (!st) st = mc_regrow(g, &x->xf, 0, tqkv_cuda_gemm_xf_bytes(P, H > I ? H : I), &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->xg, 0, P * H * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->gu, 0, GU * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h, 0, GU / 2 * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->y, 0, P * H * 4, &cap, T);
    if (!st && S) st = mc_regrow(g, (void **)&x->sy, 0, T * H * 4, &cap, T);
    if (!st && S) st = mc_regrow(g, (void **)&x->sg, 0, T * 4, &cap, T);
    if (!st) x->cap = T;
    return st;
}

// ---------------------------------------------------------------------------
// the hooks of a moe_layer array behind the common device graph
// ---------------------------------------------------------------------------

typedef struct {
    int            n_layers;
    moe_shape      sh;     /* SiLU experts */
    mc_moe_layer **layers; /* [L] (NULL on dense layers) */
} moe_dweights;

static void dweights_free(void *p) {
    moe_dweights *w = (moe_dweights *)p;
    if (!w) return;
    for (int l = 0; l < w->n_layers && w->layers; l++) mc_moe_layer_free(w->layers[l]);
    free(w->layers);
    free(w);
}

extern "C" tqkv_status mc_moe_upload_layers(const tqkv_model *m, const moe_layer *layers,
                                            model_cuda_weights *w) {
    const tqkv_model_config *c = &m->cfg;
    moe_dweights *d = (moe_dweights *)calloc(1, sizeof *d);
    if (!d) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    d->layers = (mc_moe_layer **)calloc((size_t)c->n_layers, sizeof(mc_moe_layer *));
    if (!d->layers) {
        free(d);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    d->n_layers = c->n_layers;
    d->sh = moe_shape_of(c);
    w->arch = d;
    w->arch_free = dweights_free; /* frees what was uploaded, also on failure */
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < c->n_layers && !st; l++)
        if (c->layer_moe[l]) st = mc_moe_layer_upload(&layers[l], &d->sh, &d->layers[l]);
    return st;
}

extern "C" tqkv_status mc_moe_prepare(model_cuda *g) {
    if (g->m->cfg.n_moe_layers == 0) return TQKV_OK;
    const moe_shape sh = moe_shape_of(&g->m->cfg);
    return mc_moe_reserve(g, &sh, (mc_moe_state **)&g->arch);
}

extern "C" void mc_moe_free(model_cuda *g) { mc_moe_state_free(g, (mc_moe_state **)&g->arch); }

extern "C" tqkv_status mc_moe_ffn(model_cuda *g, int l, int T) {
    if (!g->m->cfg.layer_moe[l]) return mc_ffn_dense(g, l, T);
    const moe_dweights *d = (const moe_dweights *)g->w->arch;
    return mc_moe_queue(g, d->layers[l], &d->sh, (mc_moe_state *)g->arch, g->xn, g->xn, g->tmp, T);
}

extern "C" tqkv_status mc_moe_ffn_block(model_cuda *g, int l, int T) {
    if (!g->m->cfg.layer_moe[l]) return mc_ffn_block_steps(g, l, T);
    const moe_dweights *d = (const moe_dweights *)g->w->arch;
    return mc_moe_block_queue(g, d->layers[l], &d->sh, (mc_moe_state *)g->arch,
                              g->w->layers[l].ffn_norm, mc_next_norm(g, l), T);
}

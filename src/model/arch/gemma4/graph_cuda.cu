/*
 * src/model/arch/gemma4/graph_cuda.cu - the Gemma 4 text graph on the device (the GPU twin of
 * src/model/arch/gemma4/graph.c; forward_cuda.cu dispatches a Gemma 4 state's forward queue here).
 * The graph's files: this one (the forward), graph_cuda_kernels.cu (the per-token kernels
 * and their launchers), graph_cuda_state.cu (device weights beyond mc_layer, per-state
 * extras, the device runtime's checks and RoPE rows); graph_cuda_impl.cuh between them.
 * Owns: the forward's order (the call's upload and embeddings, each layer's attention
 * block, feed-forward and end, the head with its softcap and pick), the KV-shared layers'
 * reads of their donor's device cache (no copy), the sliding layers' window views (decode
 * attention over the newest `window` keys) and their bounded caches (the device form of
 * tqkv_batch_drop_oldest, after each forward outside a spec round), the MoE block's place
 * in the layer (enable_moe_block; its experts are the shared device experts,
 * src/model/cuda/moe_cuda.h, so a MoE state's decode steps run kernel by kernel), and the
 * pieces a tensor-parallel rank runs (g4_cuda_tp).
 * Must not: make a row's result depend on other rows (per-token kernels, the batch-
 * invariant GEMM and attention: nothing here is shared across rows); change the other
 * graphs' device forward (forward_cuda.cu).
 *
 * The operations are src/model/arch/gemma4/graph.c's, in its order, with __f*_rn so nothing is contracted
 * into an FMA the CPU does not do (the CPU builds with -std=c11: no contraction); tanhf is
 * CUDA's (within two ulp of libm's), sums of squares are in double in another order, so the
 * results match the CPU within float32 rounding, not bit for bit.
 *
 * Window views and drops are the cache's (cache_cuda_slide.cu: tqkv_cuda_kv_window_view,
 * tqkv_cuda_kv_drop_oldest); this file decides when a layer takes them.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/gemma4/graph_cuda_impl.cuh"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// window views and the bounded sliding caches
// ---------------------------------------------------------------------------

/* Decode attention (q, out [R, NH, hd]) of sliding layer cache kv over the newest `window`
 * keys of each row as it stood `back` tokens ago. Capturable (a view and the decode
 * kernel); the split bound of the view's longest row is in the graph key (win_ws). */
static tqkv_status view_attend(model_cuda *g, cuda_kv *kv, int back, const float *q, int NH,
                               float *out) {
    cuda_kv *v = NULL;
    tqkv_status st = tqkv_cuda_kv_window_view(kv, g4s(g)->slide, gemma4_of(g->m)->cfg.window, back, &v);
    if (!st) st = tqkv_cuda_kv_attend_ws(v, q, NH, 1.0f, out, g->aws, g->aws_bytes);
    return st;
}

/* The verification window on a sliding layer: query j through its view n - 1 - j tokens
 * back (mc_attend_as_decode's copies, the view in place of attend_back). */
static tqkv_status view_attend_as_decode(model_cuda *g, cuda_kv *kv, int n, int NH, int hd) {
    const size_t R = (size_t)g->rows, vec = (size_t)hd * sizeof(float);
    float *q1 = g->att, *o1 = g->att + R * NH * hd;
    tqkv_status st = TQKV_OK;
    for (int j = 0; j < n && !st; j++) {
        st = mc_ck(cudaMemcpy2DAsync(q1, vec, g->qb + (size_t)j * hd, (size_t)n * vec, vec, R * NH,
                                     cudaMemcpyDeviceToDevice, g->stream),
                   "verification query copy");
        if (!st) st = view_attend(g, kv, n - 1 - j, q1, NH, o1);
        if (!st)
            st = mc_ck(cudaMemcpy2DAsync(g->ob + (size_t)j * hd, (size_t)n * vec, o1, vec, vec,
                                         R * NH, cudaMemcpyDeviceToDevice, g->stream),
                       "verification output copy");
    }
    return st;
}

extern "C" int g4_cuda_win_tokens(const model_cuda *g, int n) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    int most = 0;
    for (int l = 0; l < c->n_layers; l++) {
        if (!c->sliding[l] || !g->kv[l]) continue;
        const int *o = tqkv_cuda_kv_offsets(g->kv[l]);
        for (int r = 0; r < g->rows; r++) {
            const int k = o[r] + n < c->window ? o[r] + n : c->window;
            most = k > most ? k : most;
        }
    }
    return most;
}

extern "C" tqkv_status g4_cuda_drop_oldest(model_cuda *g) {
    const g4_config *c = &gemma4_of(g->m)->cfg;
    if (c->pos_layer < 0) return TQKV_OK; /* never: model_cuda_init refuses it */
    tqkv_status st = g4_cuda_prepare(g);
    const int keep = c->window + g->p.window_slack;
    for (int l = 0; l < c->n_layers && !st; l++)
        if (c->sliding[l] && g->kv[l] && !tqkv_cuda_kv_spec_active(g->kv[l]))
            st = tqkv_cuda_kv_drop_oldest(g->kv[l], g4s(g)->slide, keep);
    return st;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

/* The call's upload (token list, both RoPE tables), the scaled embeddings x [T, H], the
 * per-layer inputs from them, layer 0's input norm into xn (and its GEMM split). */
static tqkv_status g4_begin(model_cuda *g, int n) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_weights *X = (const g4_cuda_weights *)g->w->arch;
    const int H = c->hidden_size, NL = c->n_layers, P = gemma4_of(g->m)->cfg.ple_dim;
    const size_t T = (size_t)g->rows * n, LP = (size_t)NL * P, RW = (size_t)mc_rope_width(g->m);
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    if (!g->arch) return tqkv_fail(TQKV_ESTATE, "cuda forward: Gemma 4 buffers not prepared");
    tqkv_status st =
        mc_ck(cudaMemcpyAsync(g->tinfo, g->h_tinfo, T * 3 * 4, cudaMemcpyHostToDevice, s),
              "upload tokens");
    if (!st)
        st = mc_ck(cudaMemcpyAsync(g->rope, g->h_rope, T * RW * 4, cudaMemcpyHostToDevice, s),
                   "upload rope");
    if (st) return st;
    g4_embed_kernel<<<mc_grid_elems(T, H), 256, 0, s>>>(g->tinfo, g->w->embed, H, sqrtf((float)H), g->x);
    if (P) {
        st = mc_gemm(g, g->x, H, (int)T, X->ple_model_proj, (int)LP, H, NULL, g->ple, LP);
        if (st) return st;
        const size_t warps = T * (size_t)NL;
        g4_ple_kernel<<<(unsigned)((warps + 3) / 4), 128, 0, s>>>(
            g->ple, g->tinfo, (int)T, NL, P, X->embed_ple, X->ple_norm, eps, 1.0f / sqrtf((float)H),
            sqrtf((float)P), 1.0f / sqrtf(2.0f));
    }
    /* the kernels before a GEMM write its activation split where mc_split_xf says (none
     * with cuBLAS or TQKV_GEMM_PRESPLIT=0); mc_gemm_pre then skips the split launch */
    g4_rmsnorm_queue(g->x, g->w->layers[0].attn_norm, eps, H, 1.0f, g->xn, mc_split_xf(g),
                     g->gemm_parts, T, s);
    return TQKV_OK;
}

/* Layer l's attention of its query heads over its cache (decode, verification window or
 * causal prefill; sliding layers through their window views) into ob. */
static tqkv_status g4_attend(model_cuda *g, int l, int n, int as_decode) {
    const g4_config *gc = &gemma4_of(g->m)->cfg;
    const int R = g->rows, NH = g->m->cfg.n_heads, hd = gc->head_dim[l], ty = gc->sliding[l] ? 0 : 1;
    cuda_kv *kv = g->kv[gc->donor[l]]; /* a KV-shared layer: the donor's, appended earlier */
    if (n == 1)
        return ty ? tqkv_cuda_kv_attend_ws(kv, g->qb, NH, 1.0f, g->ob, g->aws, g->aws_bytes)
                  : view_attend(g, kv, 0, g->qb, NH, g->ob);
    if (as_decode)
        return ty ? mc_attend_as_decode(g, kv, n, NH, hd, 1.0f)
                  : view_attend_as_decode(g, kv, n, NH, hd);
    /* causal; sliding layers see the newest `window` keys, self included */
    const int *o = tqkv_cuda_kv_offsets(kv), *lp = tqkv_cuda_kv_left_pads(kv);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) {
            const int pos = o[r] - n + j; /* the token's index in this cache */
            const int lo = ty || pos + 1 <= gc->window ? 0 : pos + 1 - gc->window;
            g->h_lo[(size_t)r * n + j] = lp[r] + lo;
            g->h_hi[(size_t)r * n + j] = lp[r] + pos + 1;
        }
    return tqkv_cuda_kv_attend_masked(kv, g->qb, n, NH, 1.0f, g->h_lo, g->h_hi, g->ob);
}

/* Layer l's attention block: xn [T, H] -> q/k/v of the state's heads, the cache append (own
 * layers), attention, o_proj -> tmp [T, H]. *done = l + 1 once its cache took the append. */
static tqkv_status g4_mixer(model_cuda *g, int l, int n, int as_decode, int *lin, int *done) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_model *G = gemma4_of(g->m);
    const g4_config *gc = &G->cfg;
    const mc_layer *L = &g->w->layers[l];
    const int H = c->hidden_size, NH = c->n_heads, hd = gc->head_dim[l], NKV = gc->n_kv[l];
    const int own = gc->donor[l] == l, keqv = gc->k_eq_v[l], ty = gc->sliding[l] ? 0 : 1;
    const int QD = NH * hd, KD = NKV * hd, QS = QD + (own ? (keqv ? 1 : 2) * KD : 0);
    const int T = g->rows * n, RW = mc_rope_width(g->m);
    const float *rope = g->rope + (ty ? 2 * G->half[0] : 0);
    (void)lin; /* no recurrent layers */
    tqkv_status st = mc_gemm_pre(g, g->xn, H, T, L->wqkv, QS, H, NULL, g->qkv, QS); /* split: the norm before */
    if (!st)
        st = g4_qkv_launch(g, hd, QS, T, NH, own ? NKV : 0, n, keqv, L, c->rms_norm_eps, rope,
                           RW);
    if (!st && own) {
        st = tqkv_cuda_kv_append(g->kv[l], g->kb, g->vb, n);
        if (!st) *done = l + 1;
    }
    if (!st) st = g4_attend(g, l, n, as_decode);
    if (st) return st;
    g4_gather_kernel<<<mc_grid_elems((size_t)T, QD), 256, 0, g->stream>>>(
        g->ob, g->tinfo, NH, n, hd, g->att, mc_split_xf(g), g->gemm_parts);
    return mc_gemm_pre(g, g->att, QD, T, L->wo, H, QD, NULL, g->tmp, H);
}

/* After the attention (its output in tmp): x += post_attn_norm(o), xn = pre_ffn_norm(x);
 * the MoE block's experts of layer l into h2 (routed on xr, from x2) when it has one; the
 * GeGLU MLP of xn -> tmp [T, H]. */
static tqkv_status g4_ffn(model_cuda *g, int l, int T) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    const mc_layer *L = &g->w->layers[l];
    const int H = c->hidden_size, I = c->intermediate_size;
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    uint16_t *const xf = mc_split_xf(g);
    /* xn's split for the MLP's first GEMM unless the MoE block runs between (its GEMMs may
     * use g->xf) */
    uint16_t *const xf_mlp = XL->moe ? NULL : xf;
    g4_residual_queue(g->x, g->tmp, XL->post_attn, eps, H, 1.0f, L->ffn_norm, g->xn, xf_mlp,
                      g->gemm_parts, T, s);
    tqkv_status st = TQKV_OK;
    if (XL->moe) { /* xr = rmsnorm(x) * router.scale * H^-1/2, x2 = rmsnorm_pre_ffn_2(x) */
        g4_cuda_state *GS = g4s(g);
        const moe_shape msh = g4_moe_shape(g->m);
        g4_rmsnorm_queue(g->x, XL->router_scale, eps, H, 1.0f / sqrtf((float)H), GS->xr, NULL, 1,
                         T, s);
        g4_rmsnorm_queue(g->x, XL->pre_ffn_2, eps, H, 1.0f, GS->x2, NULL, 1, T, s);
        st = mc_moe_queue(g, XL->moe, &msh, GS->moe, GS->xr, GS->x2, GS->h2, T);
        if (st) return st;
    }
    st = xf_mlp ? mc_gemm_pre(g, g->xn, H, T, L->wgu, 2 * I, H, NULL, g->gu, 2 * (size_t)I)
                : mc_gemm(g, g->xn, H, T, L->wgu, 2 * I, H, NULL, g->gu, 2 * (size_t)I);
    if (st) return st;
    mc_geglu_queue(g->gu, I, g->hh, (size_t)T, xf, g->gemm_parts, 0, s); /* (Gemma 4: plain launches) */
    return mc_gemm_pre(g, g->hh, I, T, L->wd, H, I, NULL, g->tmp, H);
}

/* The experts' output h2 of layer l (a second partial of a sharded rank), or NULL. */
static float *g4_extra(model_cuda *g, int l) {
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    return XL->moe ? g4s(g)->h2 : NULL;
}

/* After the feed-forward (the MLP's output in tmp, the experts' in h2): with the MoE block
 * f = post_1(f) + post_2(h2); x += post_ffn_norm(f); the per-layer input block
 * x += post_ple_norm(W_proj(gelu(W_gate x) * ple[l])); x *= layer_scalar; xn = the next
 * block's norm (the final norm after the last layer). */
static tqkv_status g4_end(model_cuda *g, int l, int T) {
    const tqkv_model_config *c = &g->m->cfg;
    const g4_cuda_layer *XL = &((const g4_cuda_weights *)g->w->arch)->layers[l];
    const int H = c->hidden_size, NL = c->n_layers, P = gemma4_of(g->m)->cfg.ple_dim;
    const size_t LP = (size_t)NL * P;
    const float eps = c->rms_norm_eps;
    const cudaStream_t s = g->stream;
    const int parts = g->gemm_parts;
    uint16_t *const xf = mc_split_xf(g);
    if (XL->moe)
        g4_moe_mix_queue(g->tmp, g4s(g)->h2, XL->post_ffn_1, XL->post_ffn_2, eps, H, T, s);
    const float *nw = mc_next_norm(g, l);
    uint16_t *const xf_next = l + 1 < NL ? xf : NULL; /* the next qkv GEMM's (the lm_head splits) */
    if (!P) {
        g4_residual_queue(g->x, g->tmp, XL->post_ffn, eps, H, XL->layer_scalar, nw, g->xn,
                          xf_next, parts, T, s);
        return TQKV_OK;
    }
    g4_residual_queue(g->x, g->tmp, XL->post_ffn, eps, H, 1.0f, NULL, NULL, NULL, 1, T, s);
    tqkv_status st = mc_gemm(g, g->x, H, T, XL->ple_gate, P, H, NULL, g->pg, P);
    if (st) return st;
    g4_ple_gate_kernel<<<mc_grid_elems((size_t)T, P), 256, 0, s>>>(g->pg, g->ple, P, LP, l, xf, parts);
    st = mc_gemm_pre(g, g->pg, P, T, XL->ple_proj, H, P, NULL, g->tmp, H);
    if (st) return st;
    g4_residual_queue(g->x, g->tmp, XL->post_ple, eps, H, XL->layer_scalar, nw, g->xn, xf_next,
                      parts, T, s);
    return TQKV_OK;
}

/* The lm_head (head_n rows: a tensor-parallel rank's vocabulary slice, else V) over xn
 * into logits [rows or T, V], the soft-cap (elementwise: a slice gets the unsharded bits),
 * the copy to out (host; NULL: none), the device pick when pick > 0 (mode LAST). */
static tqkv_status g4_head_queue(model_cuda *g, int n, tqkv_logits_mode mode, float *out, int pick) {
    const int R = g->rows, H = g->m->cfg.hidden_size;
    const int V = g->head_n ? g->head_n : g->m->cfg.vocab_size;
    const size_t T = (size_t)R * n, nl = mode == TQKV_LOGITS_LAST ? (size_t)R : T;
    const float cap = gemma4_of(g->m)->cfg.softcap;
    const cudaStream_t s = g->stream;
    tqkv_status st;
    if (mode == TQKV_LOGITS_LAST) /* row r's last token is t = r n + n - 1 */
        st = mc_gemm(g, g->xn + (size_t)(n - 1) * H, (size_t)n * H, R, g->w->lm_head, V, H, NULL,
                     g->logits, V);
    else st = mc_gemm(g, g->xn, H, (int)T, g->w->lm_head, V, H, NULL, g->logits, V);
    if (!st && cap > 0) {
        const size_t cnt = nl * (size_t)V;
        g4_softcap_kernel<<<(unsigned)((cnt + 255) / 256), 256, 0, s>>>(g->logits, cnt, cap);
        st = mc_ck(cudaGetLastError(), "softcap");
    }
    /* the full rows leave before the pick's penalty changes them in place */
    if (!st && out)
        st = mc_ck(cudaMemcpyAsync(out, g->logits, nl * V * 4, cudaMemcpyDeviceToHost, s), "logits");
    if (!st && pick && mode == TQKV_LOGITS_LAST) st = mc_pick_queue(g, pick);
    return st;
}

static tqkv_status g4_head(model_cuda *g, int n, tqkv_logits_mode mode) {
    return g4_head_queue(g, n, mode, NULL, 0);
}

/* The pieces a tensor-parallel rank runs (arch.h; cuda/tp_cuda.cu): the attention's and the
 * MLP's partials all-reduced, and the experts' on their own (they are normed before they
 * join the MLP's), as src/model/arch/gemma4/tp.c on the CPU. */
extern "C" const model_arch_cuda_tp_ops g4_cuda_tp = {
    g4_begin, g4_mixer, g4_ffn, g4_extra, g4_end, g4_head,
};

/* forward_queue's contract (forward_cuda.cu) for src/model/arch/gemma4/graph.c's graph: the
 * pieces above in order. *done: the layers whose cache took this call's append
 * (forward_undo rewinds them). With n == 1 and !as_decode only kernels and copies between
 * fixed buffers, and host reads the graph key holds (rows, the attention shapes, storage
 * generations): capturable. */
extern "C" tqkv_status g4_cuda_forward_queue(model_cuda *g, int n, int as_decode,
                                             tqkv_logits_mode mode, float *out, int pick,
                                             int *done) {
    const int NL = g->m->cfg.n_layers, T = g->rows * n;
    int lin = 0;
    *done = 0;
    tqkv_status st = g4_begin(g, n);
    for (int l = 0; l < NL && !st; l++) {
        st = g4_mixer(g, l, n, as_decode, &lin, done);
        if (!st) st = g4_ffn(g, l, T);
        if (!st) st = g4_end(g, l, T);
    }
    if (!st) st = mc_ck(cudaGetLastError(), "forward kernels");
    if (st || mode == TQKV_LOGITS_NONE) return st;
    /* xn holds every token's final-normed state (the last layer's fused norm) */
    return g4_head_queue(g, n, mode, out, pick);
}

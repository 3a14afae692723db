/*
 * src/model/arch/gemma4/graph.c - the Gemma 4 text forward pass on the CPU (graph in gemma4.h).
 * Owns: the Gemma state's caches (one tqkv_batch per layer that has K/V; KV-shared layers
 * hold NULL and attend over their donor's batch: no copy, no second encode), its scratch,
 * the bounded sliding-layer caches (after each forward outside a spec round a sliding
 * layer keeps its newest window + window_slack tokens: trimming / rolling back by up to
 * window_slack tokens stays exact), and the forward itself.
 * Positions: a sliding layer's offsets count the tokens it still holds, so the rows'
 * positions are the offsets of a full non-shared layer (gemma4_position_layer).
 * Verification windows (extend_as_decode, n > 1): the matmuls of a decode and, on every
 * layer (full, sliding, KV-shared over its donor's cache), each query attended alone with
 * the decode kernel over what its single decode sees (model_attend_per_query: the newest
 * `window` keys as of its position on a sliding layer, on the token grid of a layer that
 * dropped as a single decode's would have), so a window's logits equal n single decodes
 * bit for bit. A decode on a sliding layer that holds more than window + slack tokens
 * (inside or right after a spec round) takes the same path, so no decode's bits depend on
 * when the layer last dropped its oldest tokens.
 * Must not: make a row's result depend on other rows (per-token kernels, batch-invariant
 * matmuls and attention, as in forward.c); change the other architectures' graph.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h"
#include "model/arch/gemma4/gemma4.h"
#include "model/ops/ops.h"
#include "util/common.h"

struct g4_state {
    tqkv_mask_lease *lease_full; /* masks of the full layers (s->lease: sliding layers) */
    float *ple;                  /* [T, n_layers * P] per-layer inputs */
    float *pe;                   /* [T, n_layers * P] per-layer embedding rows */
    float *pg;                   /* [T, P] per-layer gate */
    float *rc[2], *rs[2];        /* [T, half[t]] rope cos / sin per layer type */
    /* the MoE block (n_experts > 0) */
    size_t moe_cap;              /* tokens the buffers below hold */
    float *xr, *x2, *h2;         /* [T, H] router input, experts' input, experts' output */
    moe_scratch moe;
};
typedef struct g4_state g4_state;

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

void gemma4_state_free(tqkv_model_state *s) {
    if (!s || !s->ext) return;
    g4_state *S = s->ext;
    tqkv_mask_lease_free(S->lease_full);
    free(S->ple);
    free(S->pe);
    free(S->pg);
    for (int t = 0; t < 2; t++) {
        free(S->rc[t]);
        free(S->rs[t]);
    }
    free(S->xr);
    free(S->x2);
    free(S->h2);
    moe_scratch_free(&S->moe);
    free(S);
    s->ext = NULL;
}

/* Scratch for T compact tokens and RN = rows * n attention slots (the state's buffers are
 * sized for this model's largest layer; only this file uses them for a Gemma state). */
tqkv_status gemma4_scratch(tqkv_model_state *s, size_t T, size_t RN) {
    const tqkv_model *m = s->m;
    const g4_config *g = &gemma4_of(m)->cfg;
    if (!s->ext) {
        g4_state *S = tqkv_calloc(1, sizeof *S);
        if (!S) return TQKV_ENOMEM;
        if (tqkv_mask_lease_init(&S->lease_full) != TQKV_OK) {
            free(S);
            return tqkv_fail(TQKV_ENOMEM, "out of memory");
        }
        s->ext = S;
        s->cap_t = s->cap_rn = 0;
    }
    g4_state *S = s->ext;
    size_t H = (size_t)m->cfg.hidden_size, I = (size_t)m->cfg.intermediate_size;
    size_t QD = (size_t)g->max_qd, KD = (size_t)g->max_kd;
    size_t LP = (size_t)m->cfg.n_layers * (size_t)g->ple_dim, P = (size_t)g->ple_dim;
    size_t W = H > I ? H : I;
    if (W < QD) W = QD;
    if (T > s->cap_t) {
        size_t t = T < 16 ? 16 : T;
        int ok = tqkv_grow_floats(&s->x, t * H) && tqkv_grow_floats(&s->xn, t * H) && tqkv_grow_floats(&s->qkv, t * (QD + 2 * KD)) &&
                 tqkv_grow_floats(&s->att, t * QD) && tqkv_grow_floats(&s->gu, t * 2 * I) && tqkv_grow_floats(&s->h, t * I) &&
                 tqkv_grow_floats(&s->tmp, t * W) && tqkv_grow_floats(&s->mm_scratch, t * W) && tqkv_grow_floats(&S->ple, t * LP) && tqkv_grow_floats(&S->pe, t * LP) &&
                 tqkv_grow_floats(&S->pg, t * P);
        for (int k = 0; k < 2 && ok; k++)
            ok = tqkv_grow_floats(&S->rc[k], t * (size_t)gemma4_of(m)->half[k]) &&
                 tqkv_grow_floats(&S->rs[k], t * (size_t)gemma4_of(m)->half[k]);
        int32_t *a = ok ? realloc(s->tok_row, sizeof(int32_t) * t) : NULL;
        if (a) s->tok_row = a;
        int32_t *b = a ? realloc(s->tok_col, sizeof(int32_t) * t) : NULL;
        if (b) s->tok_col = b;
        if (!ok || !a || !b) {
            s->cap_t = 0; /* buffers may be smaller than needed: grow all again next time */
            return tqkv_fail(TQKV_ENOMEM, "out of memory for %zu tokens of activations", T);
        }
        s->cap_t = t;
    }
    if (m->cfg.n_experts > 0 && T > S->moe_cap) { /* reserved here: the block cannot fail */
        const moe_shape sh = moe_shape_of(&m->cfg);
        if (!tqkv_grow_floats(&S->xr, T * H) || !tqkv_grow_floats(&S->x2, T * H) ||
            !tqkv_grow_floats(&S->h2, T * H))
            return tqkv_fail(TQKV_ENOMEM, "out of memory for %zu tokens of the MoE block", T);
        tqkv_status rc = moe_scratch_reserve(&S->moe, &sh, T);
        if (rc != TQKV_OK) return rc;
        S->moe_cap = T;
    }
    if (RN > s->cap_rn) {
        int ok = tqkv_grow_floats(&s->qb, RN * QD) && tqkv_grow_floats(&s->kb, RN * KD) && tqkv_grow_floats(&s->vb, RN * KD) &&
                 tqkv_grow_floats(&s->ob, RN * QD);
        if (!ok) {
            s->cap_rn = 0;
            return tqkv_fail(TQKV_ENOMEM, "out of memory for the attention buffers");
        }
        s->cap_rn = RN;
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
static inline float gelu_tanh(float x) {
    float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

static void matmul_ld(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                      float *y, size_t ldy, int prefill) {
    if (s->p.blas && prefill && w->f32 && T > 1)
        mm_matmul_blas(x, T, w, NULL, y, ldy, s->p.threads);
    else
        mm_matmul_ld(x, T, w, NULL, y, ldy, s->p.threads, s->mm_scratch);
}

static void matmul(const tqkv_model_state *s, const float *x, int T, const mm_weight *w, float *y,
                   int prefill) {
    matmul_ld(s, x, T, w, y, (size_t)w->n, prefill);
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

/* Scaled embeddings, both layer types' RoPE tables and the per-layer embedding rows of the
 * T compact tokens; then the per-layer inputs
 * ple = (rmsnorm_P(W_plp x * H^-1/2) + pe) * 2^-1/2, per layer slice of P. */
void g4_embed(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                     const g4_shape *f) {
    const g4_model *G = gemma4_of(m);
    g4_state *S = s->ext;
    const int H = m->cfg.hidden_size, NL = m->cfg.n_layers, P = G->cfg.ple_dim, n = f->n,
              th = s->p.threads;
    const size_t T = f->T, LP = (size_t)NL * (size_t)P;
    const float escale = sqrtf((float)H), pscale = sqrtf((float)(P ? P : 1));
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        int r = s->tok_row[i], j = s->tok_col[i];
        int pos = s->off[r] + j - (n - s->len[r]);
        int32_t tok = tokens[(size_t)r * n + j];
        float *x = s->x + i * H;
        mm_weight_row(&m->embed, tok, x);
        for (int e = 0; e < H; e++) x[e] *= escale;
        for (int k = 0; k < 2; k++)
            if (G->half[k])
                ops_rope_table(pos, G->inv_freq[k], G->half[k], S->rc[k] + i * G->half[k],
                               S->rs[k] + i * G->half[k]);
        if (P) {
            float *pe = S->pe + i * LP;
            mm_weight_row(&G->embed_ple, tok, pe);
            for (size_t e = 0; e < LP; e++) pe[e] *= pscale;
        }
    }
    if (!P) return;
    matmul(s, s->x, (int)T, &G->ple_model_proj, S->ple, f->pf);
    const float hs = 1.0f / sqrtf((float)H), mix = 1.0f / sqrtf(2.0f),
                eps = m->cfg.rms_norm_eps;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 16)
    for (size_t i = 0; i < T; i++) {
        float *pl = S->ple + i * LP;
        const float *pe = S->pe + i * LP;
        for (size_t e = 0; e < LP; e++) pl[e] *= hs;
        for (int l = 0; l < NL; l++)
            ops_rmsnorm(pl + (size_t)l * P, G->ple_norm, eps, P, pl + (size_t)l * P);
        for (size_t e = 0; e < LP; e++) pl[e] = (pl[e] + pe[e]) * mix;
    }
}

/* Layer l's RMSNorm, q (and, on a layer with KV of its own, k and v) projections, q/k
 * norms, RoPE, the scale-free v norm; scatter to qb / kb / vb [rows, heads, n, hd]. */
void g4_qkv_project(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f) {
    const g4_model *G = gemma4_of(m);
    const g4_config *g = &G->cfg;
    const g4_state *S = s->ext;
    const model_layer *L = &m->layers[l];
    const int R = s->rows, H = m->cfg.hidden_size, NH = m->cfg.n_heads, n = f->n,
              th = s->p.threads, pf = f->pf;
    const int hd = g->head_dim[l], NKV = g->n_kv[l], ty = g->sliding[l] ? 0 : 1;
    const int half = G->half[ty], QD = NH * hd, KD = NKV * hd;
    const int own = g->donor[l] == l, keqv = g->k_eq_v[l];
    const size_t T = f->T, QS = (size_t)QD + (own ? (size_t)(keqv ? 1 : 2) * KD : 0);
    const float *rcos = S->rc[ty], *rsin = S->rs[ty], eps = m->cfg.rms_norm_eps;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) ops_rmsnorm(s->x + i * H, L->attn_norm, eps, H, s->xn + i * H);
    if (L->wqkv.data && !(s->p.blas && pf)) {
        matmul(s, s->xn, (int)T, &L->wqkv, s->qkv, pf);
    } else {
        matmul_ld(s, s->xn, (int)T, &L->wq, s->qkv, QS, pf);
        if (own) matmul_ld(s, s->xn, (int)T, &L->wk, s->qkv + QD, QS, pf);
        if (own && !keqv) matmul_ld(s, s->xn, (int)T, &L->wv, s->qkv + QD + KD, QS, pf);
    }
    if (f->nq_pad) {
        memset(s->qb, 0, sizeof(float) * (size_t)R * n * QD);
        if (own) {
            memset(s->kb, 0, sizeof(float) * (size_t)R * n * KD);
            memset(s->vb, 0, sizeof(float) * (size_t)R * n * KD);
        }
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        float *q = s->qkv + i * QS, *k = q + QD;
        size_t r = (size_t)s->tok_row[i], j = (size_t)s->tok_col[i];
        for (int h = 0; h < NH; h++) ops_rmsnorm(q + h * hd, L->q_norm, eps, hd, q + h * hd);
        ops_rope_apply(q, NH, hd, rcos + i * half, rsin + i * half);
        for (int h = 0; h < NH; h++)
            memcpy(s->qb + ((r * NH + h) * n + j) * hd, q + h * hd, sizeof(float) * hd);
        if (!own) continue;
        /* v: its own projection, or (k_eq_v) the raw k projection; RMSNorm without scale */
        const float *v = keqv ? k : k + KD;
        for (int h = 0; h < NKV; h++) {
            float *vd = s->vb + ((r * NKV + h) * n + j) * hd;
            ops_rmsnorm(v + h * hd, G->ones, eps, hd, vd);
        }
        for (int h = 0; h < NKV; h++) ops_rmsnorm(k + h * hd, L->k_norm, eps, hd, k + h * hd);
        ops_rope_apply(k, NKV, hd, rcos + i * half, rsin + i * half);
        for (int h = 0; h < NKV; h++)
            memcpy(s->kb + ((r * NKV + h) * n + j) * hd, k + h * hd, sizeof(float) * hd);
    }
}

/* Layer l's cache append (KV-shared layers read the donor's batch, appended earlier in this
 * pass) and attention: scaling 1.0; sliding layers see the newest `window` keys. Per query
 * (model_attend_per_query) for a verification window, and for a decode on a bounded sliding
 * layer holding more than window + slack tokens (after a spec round): each query on the
 * token grid of a single decode at its position, so the bits depend neither on the window
 * nor on when the layer last dropped its oldest tokens. On failure the appends of layers
 * [0, l] are rolled back. */
tqkv_status g4_attend(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f) {
    const g4_config *g = &gemma4_of(m)->cfg;
    g4_state *S = s->ext;
    const int n = f->n, ty = g->sliding[l] ? 0 : 1, own = g->donor[l] == l;
    tqkv_batch *b = s->layers[g->donor[l]];
    tqkv_status rc = TQKV_OK;
    batch_set_threads(b, s->p.threads);
    if (own) {
        if (f->prefill) {
            rc = tqkv_batch_prepare_prefill(b, s->len);
            if (rc == TQKV_OK) rc = tqkv_batch_append(b, s->kb, s->vb, n);
            if (rc == TQKV_OK) rc = tqkv_batch_finalize_prefill(b);
        } else {
            rc = tqkv_batch_append(b, s->kb, s->vb, n);
        }
        if (rc != TQKV_OK) {
            model_kv_trim_rollback(s, f->prefill ? l + 1 : l, n, f->prefill);
            return rc;
        }
    }
    const int win = ty ? 0 : g->window;
    const int keep = !ty && g->pos_layer >= 0 ? g->window + s->p.window_slack : 0;
    tqkv_kernel k = n == 1 || f->as_dec ? s->p.decode_kernel : s->p.prefill_kernel;
    if (k == TQKV_KERNEL_FUSED) k = TQKV_KERNEL_DEFERRED; /* Gemma 4's kernel set */
    tqkv_attn_params ap = {m->cfg.n_heads, 1.0f, k, s->p.threads};
    if (f->as_dec || (n == 1 && keep > 0 && model_attend_reindexes(s, b, 1, keep))) {
        rc = model_attend_per_query(s, b, s->qb, n, win, keep, &ap, s->ob);
    } else {
        const tqkv_mask *mask = NULL;
        rc = tqkv_batch_make_mask(b, ty ? S->lease_full : s->lease, n, win, &mask);
        if (rc == TQKV_OK) rc = tqkv_batch_attend(b, mask, s->qb, n, &ap, s->ob);
    }
    if (rc != TQKV_OK) model_kv_trim_rollback(s, l + 1, n, f->prefill);
    return rc;
}

/* The MoE block's inputs from the residual x [T, H] (before the FFN): the router's
 * xr = rmsnorm(x) * router.scale * H^-1/2 and the experts' x2 = rmsnorm_pre_ffn_2(x); then the
 * experts' output h2 [T, H] (not yet normed). */
static void g4_moe_block(const tqkv_model *m, tqkv_model_state *s, const g4_layer *X, size_t T) {
    g4_state *S = s->ext;
    const int H = m->cfg.hidden_size, th = s->p.threads;
    const float eps = m->cfg.rms_norm_eps, root = 1.0f / sqrtf((float)H);
    moe_shape sh = moe_shape_of(&m->cfg);
    sh.act = MOE_ACT_GELU_TANH;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        const float *x = s->x + i * H;
        float *xr = S->xr + i * H;
        ops_rmsnorm(x, X->router_scale, eps, H, xr);
        for (int e = 0; e < H; e++) xr[e] *= root;
        ops_rmsnorm(x, X->pre_ffn_norm_2, eps, H, S->x2 + i * H);
    }
    /* cannot fail: the scratch holds T tokens (ensure_scratch) */
    (void)moe_experts(&X->moe, &sh, S->xr, S->x2, S->h2, T, th, &S->moe);
}

/* Gather ob [rows, NH, n, hd] to token order att [T, NH * hd], then o_proj into tmp
 * [T, hidden]. */
void g4_out_proj(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f) {
    const int NH = m->cfg.n_heads, hd = gemma4_of(m)->cfg.head_dim[l], QD = NH * hd, n = f->n,
              th = s->p.threads;
    const size_t T = f->T;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        size_t r = (size_t)s->tok_row[i], j = (size_t)s->tok_col[i];
        for (int h = 0; h < NH; h++)
            memcpy(s->att + i * QD + (size_t)h * hd, s->ob + ((r * NH + h) * n + j) * hd,
                   sizeof(float) * hd);
    }
    matmul(s, s->att, (int)T, &m->layers[l].wo, s->tmp, f->pf);
}

/* x [T, hidden] += rmsnorm_post_attn(tmp); xn = rmsnorm_pre_ffn(x); beside it the MoE
 * block's experts when the model has one (their output in the state's h2). */
void g4_attn_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T) {
    const model_layer *L = &m->layers[l];
    const g4_layer *X = &gemma4_of(m)->layers[l];
    const int H = m->cfg.hidden_size, th = s->p.threads;
    const float eps = m->cfg.rms_norm_eps;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        float *x = s->x + i * H, *o = s->tmp + i * H;
        ops_rmsnorm(o, X->post_attn_norm, eps, H, o);
        for (int e = 0; e < H; e++) x[e] += o[e];
        ops_rmsnorm(x, L->ffn_norm, eps, H, s->xn + i * H);
    }
    if (m->cfg.n_experts > 0) g4_moe_block(m, s, X, T);
}

float *g4_moe_out(tqkv_model_state *s) { return ((g4_state *)s->ext)->h2; }

/* The GeGLU MLP of xn [T, hidden] into tmp [T, hidden] (down_proj's product). */
void g4_mlp(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f) {
    const model_layer *L = &m->layers[l];
    const int I = m->cfg.intermediate_size, th = s->p.threads, pf = f->pf;
    const size_t T = f->T;
    if (L->wgu.data && !(s->p.blas && pf)) {
        matmul(s, s->xn, (int)T, &L->wgu, s->gu, pf);
    } else {
        matmul_ld(s, s->xn, (int)T, &L->wg, s->gu, 2 * (size_t)I, pf);
        matmul_ld(s, s->xn, (int)T, &L->wu, s->gu + I, 2 * (size_t)I, pf);
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 16)
    for (size_t i = 0; i < T; i++) {
        const float *gg = s->gu + i * 2 * I, *uu = gg + I;
        float *hh = s->h + i * I;
        for (int e = 0; e < I; e++) hh[e] = gelu_tanh(gg[e]) * uu[e];
    }
    matmul(s, s->h, (int)T, &L->wd, s->tmp, pf);
}

/* x [T, hidden] += rmsnorm_post_ffn(tmp) (with the MoE block: of
 * rmsnorm_post_ffn_1(tmp) + rmsnorm_post_ffn_2(h2)). */
void g4_ffn_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T) {
    const g4_layer *X = &gemma4_of(m)->layers[l];
    const int H = m->cfg.hidden_size, th = s->p.threads, moe = m->cfg.n_experts > 0;
    const float eps = m->cfg.rms_norm_eps;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        float *x = s->x + i * H, *o = s->tmp + i * H;
        if (moe) { /* o = rmsnorm_post_ffn_1(o) + rmsnorm_post_ffn_2(h2) */
            float *h2 = ((g4_state *)s->ext)->h2 + i * H;
            ops_rmsnorm(o, X->post_ffn_norm_1, eps, H, o);
            ops_rmsnorm(h2, X->post_ffn_norm_2, eps, H, h2);
            for (int e = 0; e < H; e++) o[e] += h2[e];
        }
        ops_rmsnorm(o, X->post_ffn_norm, eps, H, o);
        for (int e = 0; e < H; e++) x[e] += o[e];
    }
}

/* Layer l's per-layer input block (x += rmsnorm(W_proj(gelu_tanh(W_gate x) * ple[l]))) and
 * its layer scalar. */
void g4_ple_block(const tqkv_model *m, tqkv_model_state *s, int l, const g4_shape *f) {
    const g4_layer *X = &gemma4_of(m)->layers[l];
    g4_state *S = s->ext;
    const int H = m->cfg.hidden_size, P = gemma4_of(m)->cfg.ple_dim, th = s->p.threads;
    const size_t T = f->T, LP = (size_t)m->cfg.n_layers * (size_t)P;
    const float eps = m->cfg.rms_norm_eps;
    if (P) {
        matmul(s, s->x, (int)T, &X->ple_gate, S->pg, f->pf);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *pg = S->pg + i * P;
            const float *pl = S->ple + i * LP + (size_t)l * P;
            for (int e = 0; e < P; e++) pg[e] = gelu_tanh(pg[e]) * pl[e];
        }
        matmul(s, S->pg, (int)T, &X->ple_proj, s->tmp, f->pf);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *x = s->x + i * H, *o = s->tmp + i * H;
            ops_rmsnorm(o, X->post_ple_norm, eps, H, o);
            for (int e = 0; e < H; e++) x[e] += o[e];
        }
    }
    if (X->layer_scalar != 1.0f) {
        const float ls = X->layer_scalar;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *x = s->x + i * H;
            for (int e = 0; e < H; e++) x[e] *= ls;
        }
    }
}

/* Final RMSNorm, lm_head, soft-capping: logits [rows, V] (LAST) or [rows, n, V] (ALL,
 * padding zero). */
static void g4_head(const tqkv_model *m, tqkv_model_state *s, const g4_shape *f,
                    tqkv_logits_mode mode, float *logits) {
    const int R = s->rows, H = m->cfg.hidden_size, V = m->cfg.vocab_size, n = f->n,
              th = s->p.threads;
    const size_t T = f->T;
    const float eps = m->cfg.rms_norm_eps, cap = gemma4_of(m)->cfg.softcap;
    if (mode == TQKV_LOGITS_NONE) return;
    if (mode == TQKV_LOGITS_LAST) {
        size_t at = 0;
        for (int r = 0; r < R; r++) {
            at += (size_t)s->len[r];
            ops_rmsnorm(s->x + (at - 1) * H, m->final_norm, eps, H, s->xn + (size_t)r * H);
        }
        matmul(s, s->xn, R, &m->lm_head, logits, 0);
        if (cap > 0)
            for (size_t i = 0; i < (size_t)R * V; i++) logits[i] = tanhf(logits[i] / cap) * cap;
        return;
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) ops_rmsnorm(s->x + i * H, m->final_norm, eps, H, s->xn + i * H);
    if (!f->nq_pad) {
        matmul(s, s->xn, (int)T, &m->lm_head, logits, f->pf);
    } else {
        size_t at = 0;
        for (int r = 0; r < R; r++) {
            int pad = n - s->len[r];
            float *dst = logits + (size_t)r * n * V;
            memset(dst, 0, sizeof(float) * (size_t)pad * V);
            matmul(s, s->xn + at * H, s->len[r], &m->lm_head, dst + (size_t)pad * V, f->pf);
            at += (size_t)s->len[r];
        }
    }
    if (cap > 0) {
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < (size_t)R * n; i++) {
            float *lg = logits + i * V;
            for (int e = 0; e < V; e++) lg[e] = tanhf(lg[e] / cap) * cap;
        }
    }
}

tqkv_status g4_preamble(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                        const int *lengths, int n, int prefill, g4_shape *f) {
    const int R = s->rows, V = m->cfg.vocab_size, NL = m->cfg.n_layers;
    for (int l = 0; l < NL; l++)
        if (s->layers[l] && tqkv_batch_rows(s->layers[l]) != R)
            return tqkv_fail(TQKV_ESTATE, "forward: layer %d cache holds %d rows, the state %d",
                             l, tqkv_batch_rows(s->layers[l]), R);
    tqkv_status rc = tqkv_batch_offsets(s->layers[gemma4_position_layer(m)], s->off, NULL);
    if (rc != TQKV_OK) return rc;
    *f = (g4_shape){.n = n, .prefill = prefill};
    rc = model_forward_lengths(s, tokens, lengths, n, prefill, V, m->ops->token_limit(m), &f->T);
    if (rc != TQKV_OK) return rc;
    /* a verification window (extend_as_decode) runs the decode path's matmuls (never BLAS)
     * and attention (model_attend_per_query), so each token gets its single decode's bits */
    f->as_dec = !prefill && n > 1 && s->p.extend_as_decode;
    f->pf = n > 1 && !f->as_dec;
    for (int r = 0; r < R; r++) f->nq_pad |= s->len[r] != n;
    return TQKV_OK;
}

tqkv_status g4_drop_sliding(const tqkv_model *m, tqkv_model_state *s) {
    const g4_config *g = &gemma4_of(m)->cfg;
    if (g->pos_layer < 0) return TQKV_OK;
    const int keep = g->window + s->p.window_slack;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!g->sliding[l] || !s->layers[l] || tqkv_batch_spec_active(s->layers[l])) continue;
        tqkv_status rc = tqkv_batch_drop_oldest(s->layers[l], keep);
        if (rc != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

tqkv_status gemma4_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits) {
    if (s->tp) return gemma4_forward_tp(m, s, tokens, lengths, n, prefill, mode, logits);
    const int R = s->rows, NL = m->cfg.n_layers;
    g4_shape f;
    tqkv_status rc = g4_preamble(m, s, tokens, lengths, n, prefill, &f); /* changes nothing */
    if (rc != TQKV_OK) return rc;
    rc = gemma4_scratch(s, f.T, (size_t)R * (size_t)n);
    if (rc != TQKV_OK) return rc;

    model_forward_compact(s->len, R, n, s->tok_row, s->tok_col, NULL);
    g4_embed(m, s, tokens, &f);
    for (int l = 0; l < NL; l++) {
        g4_qkv_project(m, s, l, &f);
        if ((rc = g4_attend(m, s, l, &f)) != TQKV_OK) return rc;
        g4_out_proj(m, s, l, &f);
        g4_attn_residual(m, s, l, f.T);
        g4_mlp(m, s, l, &f);
        g4_ffn_residual(m, s, l, f.T);
        g4_ple_block(m, s, l, &f);
    }
    /* bounded sliding layers: keep the newest window + slack tokens (not in a spec round:
     * a rollback must find the round's base) */
    if ((rc = g4_drop_sliding(m, s)) != TQKV_OK) return rc;
    g4_head(m, s, &f, mode, logits);
    return TQKV_OK;
}

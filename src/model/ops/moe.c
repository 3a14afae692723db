/*
 * moe.c - the routed-experts feed-forward of the mixture-of-experts graphs (moe.h says what
 *   it computes): routing, the experts over the tokens routed to each, the shared expert.
 * Owns: the scratch of moe.h and the addition order of a token's expert outputs.
 * Must not: know which graph calls it; make a token's result depend on the other tokens.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/ops/moe.h"
#include "model/ops/ops.h"
#include "util/common.h"

moe_shape moe_shape_of(const tqkv_model_config *c) {
    moe_shape sh = {c->hidden_size, c->n_experts, c->n_experts_used, c->moe_intermediate_size,
                    c->norm_topk_prob, c->moe_shared_intermediate_size, MOE_ACT_SILU};
    return sh;
}

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------

void moe_scratch_free(moe_scratch *x) {
    free(x->logits); free(x->wts); free(x->sel); free(x->tok); free(x->w1); free(x->xg);
    free(x->gu); free(x->h); free(x->y); free(x->acc); free(x->sg); free(x->perm);
    memset(x, 0, sizeof *x);
}

tqkv_status moe_scratch_reserve(moe_scratch *x, const moe_shape *sh, size_t T) {
    if (T <= x->cap) return TQKV_OK;
    moe_scratch_free(x);
    const size_t H = (size_t)sh->hidden, E = (size_t)sh->n_experts, K = (size_t)sh->top_k,
                 I = (size_t)(sh->inter > sh->shared_inter ? sh->inter : sh->shared_inter),
                 W = H > I ? H : I;
    x->logits = malloc(sizeof(float) * T * E);
    x->wts = malloc(sizeof(float) * T * K);
    x->sel = malloc(sizeof(int32_t) * T * K);
    x->tok = malloc(sizeof(int32_t) * T);
    x->w1 = malloc(sizeof(float) * T);
    x->xg = malloc(sizeof(float) * T * H);
    x->gu = malloc(sizeof(float) * T * 2 * I);
    x->h = malloc(sizeof(float) * T * I);
    x->y = malloc(sizeof(float) * T * H);
    x->acc = malloc(sizeof(float) * T * H);
    x->sg = malloc(sizeof(float) * T);
    x->perm = malloc(sizeof(float) * T * W);
    if (!x->logits || !x->wts || !x->sel || !x->tok || !x->w1 || !x->xg || !x->gu || !x->h ||
        !x->y || !x->acc || !x->sg || !x->perm) {
        moe_scratch_free(x);
        return tqkv_fail(TQKV_ENOMEM, "out of memory (experts scratch for %zu tokens)", T);
    }
    x->cap = T;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// routing
// ---------------------------------------------------------------------------

void moe_route_token(float *p, int E, int K, int norm, const float *scale, int32_t *sel,
                     float *w) {
    float mx = p[0];
    for (int e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        p[e] = expf(p[e] - mx);
        sum += p[e];
    }
    for (int e = 0; e < E; e++) p[e] /= sum;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= sel[j] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        sel[k] = best;
        w[k] = p[best];
    }
    if (norm) {
        float t = 0.0f;
        for (int k = 0; k < K; k++) t += w[k];
        for (int k = 0; k < K; k++) w[k] /= t;
    }
    if (scale)
        for (int k = 0; k < K; k++) w[k] *= scale[sel[k]];
}

// ---------------------------------------------------------------------------
// the experts
// ---------------------------------------------------------------------------

/* gelu_pytorch_tanh, the expression of src/model/arch/gemma4/graph.c */
static inline float gelu_tanh(float x) {
    float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(inner));
}

/* One gated MLP (gu fused, else g / u; act(gate) * up) over the n rows of in [n, hidden] ->
 * out [n, hidden]. */
static void gated_mlp(const mm_weight *gu, const mm_weight *g, const mm_weight *u,
                      const mm_weight *down, int I, int H, moe_act act, const float *in, int n,
                      float *out, int threads, moe_scratch *x) {
    if (gu->data) {
        mm_matmul_ld(in, n, gu, NULL, x->gu, 2 * (size_t)I, threads, x->perm);
    } else {
        mm_matmul_ld(in, n, g, NULL, x->gu, 2 * (size_t)I, threads, x->perm);
        mm_matmul_ld(in, n, u, NULL, x->gu + I, 2 * (size_t)I, threads, x->perm);
    }
    for (int i = 0; i < n; i++) {
        const float *gg = x->gu + (size_t)i * 2 * I, *uu = gg + I;
        float *hh = x->h + (size_t)i * I;
        if (act == MOE_ACT_SILU)
            ops_swiglu(gg, uu, I, hh);
        else
            for (int e = 0; e < I; e++) hh[e] = gelu_tanh(gg[e]) * uu[e];
    }
    mm_matmul_ld(x->h, n, down, NULL, out, (size_t)H, threads, x->perm);
}

/* acc [T, hidden] = the routed experts' weighted sum of xn (ascending expert order per
 * token), routed on xr. */
static void routed(const moe_layer *L, const moe_shape *sh, const float *xr, const float *xn,
                   float *acc, size_t T, int th, moe_scratch *x) {
    const int H = sh->hidden, E = sh->n_experts, K = sh->top_k;
    mm_matmul_ld(xr, (int)T, &L->router, NULL, x->logits, (size_t)E, th, x->perm);
    for (size_t t = 0; t < T; t++)
        moe_route_token(x->logits + t * E, E, K, sh->norm_topk, L->expert_scale, x->sel + t * K,
                    x->wts + t * K);
    memset(acc, 0, sizeof(float) * T * (size_t)H);
    for (int e = 0; e < E; e++) {
        int n = 0; // tokens routed to e, ascending
        for (size_t t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                if (x->sel[t * K + k] == e) {
                    x->tok[n] = (int32_t)t;
                    x->w1[n] = x->wts[t * K + k];
                    memcpy(x->xg + (size_t)n * H, xn + t * H, sizeof(float) * (size_t)H);
                    n++;
                }
        if (n == 0) continue;
        gated_mlp(&L->gu[e], &L->g[e], &L->u[e], &L->down[e], sh->inter, H, sh->act, x->xg, n,
                  x->y, th, x);
        for (int i = 0; i < n; i++) {
            float *a = acc + (size_t)x->tok[i] * H;
            const float *y = x->y + (size_t)i * H;
            for (int j = 0; j < H; j++) {
                const float v = y[j] * x->w1[i]; /* rounded, then added (transformers' order) */
                a[j] += v;
            }
        }
    }
}

tqkv_status moe_experts(const moe_layer *L, const moe_shape *sh, const float *xr,
                        const float *xn, float *out, size_t T, int threads, moe_scratch *sc) {
    const int H = sh->hidden;
    tqkv_status rc = moe_scratch_reserve(sc, sh, T);
    if (rc != TQKV_OK) return rc;
    routed(L, sh, xr ? xr : xn, xn, out, T, threads, sc);
    if (sh->shared_inter > 0) { /* out += sigmoid(gate . xn) * shared(xn), the product rounded */
        const int S = sh->shared_inter;
        gated_mlp(&L->sh_gu, &L->sh_g, &L->sh_u, &L->sh_down, S, H, sh->act, xn, (int)T, sc->y,
                  threads, sc);
        mm_matmul_ld(xn, (int)T, &L->sh_gate, NULL, sc->sg, 1, threads, sc->perm);
        for (size_t t = 0; t < T; t++) {
            const float g = 1.0f / (1.0f + expf(-sc->sg[t]));
            float *a = out + t * H;
            const float *y = sc->y + t * H;
            for (int j = 0; j < H; j++) {
                const float v = g * y[j];
                a[j] += v;
            }
        }
    }
    return TQKV_OK;
}

tqkv_status moe_forward(const moe_layer *L, const moe_shape *sh, const float *xn, float *x,
                        size_t T, int threads, moe_scratch *sc) {
    const int H = sh->hidden;
    tqkv_status rc = moe_scratch_reserve(sc, sh, T);
    if (rc != TQKV_OK) return rc;
    moe_experts(L, sh, NULL, xn, sc->acc, T, threads, sc);
    for (size_t t = 0; t < T; t++) {
        float *xr = x + t * H;
        const float *a = sc->acc + t * H;
        for (int j = 0; j < H; j++) xr[j] += a[j];
    }
    return TQKV_OK;
}

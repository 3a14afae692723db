/*
 * graph.c - the Qwen3-MoE CPU forward: the Llama family's forward (llama_forward_with) with
 *   the routed-experts feed-forward on sparse layers and the dense MLP on the others.
 * Owns: routing (router GEMM, float32 softmax, top-k, optional renormalisation), the experts'
 *   SwiGLU over the tokens routed to each, the weighted sum, the per-state scratch.
 * Must not: let a token's output depend on the other tokens of the call: each expert's
 *   products are row-independent GEMMs (mm_matmul_ld) and a token's expert outputs are added
 *   in ascending expert order, whatever else was routed with it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/llama/llama.h"
#include "model/arch/qwen3moe/qwen3moe.h"
#include "model/ops/ops.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// scratch (s->ext)
// ---------------------------------------------------------------------------

typedef struct {
    size_t   cap;      /* tokens the buffers hold */
    float   *logits;   /* [T, E] router logits, then probabilities */
    float   *wts;      /* [T, K] routing weights of the chosen experts */
    int32_t *sel;      /* [T, K] chosen experts, by descending probability */
    int32_t *tok;      /* [T] tokens routed to the current expert */
    float   *w1;       /* [T] their weights */
    float   *xg;       /* [T, hidden] their inputs */
    float   *gu;       /* [T, 2 * moe_inter] gate | up */
    float   *h;        /* [T, moe_inter] */
    float   *y;        /* [T, hidden] expert outputs */
    float   *acc;      /* [T, hidden] the weighted sum */
    float   *perm;     /* [T, max(hidden, moe_inter)] matmul scratch */
} q3m_scratch;

static void scratch_release(q3m_scratch *x) {
    free(x->logits); free(x->wts); free(x->sel); free(x->tok); free(x->w1); free(x->xg);
    free(x->gu); free(x->h); free(x->y); free(x->acc); free(x->perm);
    memset(x, 0, sizeof *x);
}

tqkv_status qwen3moe_state_init(tqkv_model_state *s) {
    s->ext = calloc(1, sizeof(q3m_scratch));
    return s->ext ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
}

void qwen3moe_state_free(tqkv_model_state *s) {
    if (!s->ext) return;
    scratch_release(s->ext);
    free(s->ext);
    s->ext = NULL;
}

static tqkv_status scratch_grow(q3m_scratch *x, const tqkv_model_config *c, size_t T) {
    if (T <= x->cap) return TQKV_OK;
    scratch_release(x);
    const size_t H = (size_t)c->hidden_size, I = (size_t)c->moe_intermediate_size,
                 E = (size_t)c->n_experts, K = (size_t)c->n_experts_used;
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
    x->perm = malloc(sizeof(float) * T * (H > I ? H : I));
    if (!x->logits || !x->wts || !x->sel || !x->tok || !x->w1 || !x->xg || !x->gu || !x->h ||
        !x->y || !x->acc || !x->perm) {
        scratch_release(x);
        return tqkv_fail(TQKV_ENOMEM, "out of memory (experts scratch for %zu tokens)", T);
    }
    x->cap = T;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// routing
// ---------------------------------------------------------------------------

/* One token: p = softmax(logits [E]) in place; the K most probable experts (ties: the lower
 * index) into sel [K] by descending p, their weights into w [K] (renormalised if asked). */
static void route_token(float *p, int E, int K, int norm, int32_t *sel, float *w) {
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
    if (!norm) return;
    float t = 0.0f;
    for (int k = 0; k < K; k++) t += w[k];
    for (int k = 0; k < K; k++) w[k] /= t;
}

// ---------------------------------------------------------------------------
// the experts' feed-forward
// ---------------------------------------------------------------------------

/* Expert e over the n tokens gathered in x->xg: y [n, hidden]. */
static void expert_run(const tqkv_model *m, const q3m_layer *X, int e, int n, int threads,
                       q3m_scratch *x) {
    const int I = m->cfg.moe_intermediate_size;
    if (X->gu[e].data) {
        mm_matmul_ld(x->xg, n, &X->gu[e], NULL, x->gu, 2 * (size_t)I, threads, x->perm);
    } else {
        mm_matmul_ld(x->xg, n, &X->g[e], NULL, x->gu, 2 * (size_t)I, threads, x->perm);
        mm_matmul_ld(x->xg, n, &X->u[e], NULL, x->gu + I, 2 * (size_t)I, threads, x->perm);
    }
    for (int i = 0; i < n; i++)
        ops_swiglu(x->gu + (size_t)i * 2 * I, x->gu + (size_t)i * 2 * I + I, I, x->h + (size_t)i * I);
    mm_matmul_ld(x->h, n, &X->down[e], NULL, x->y, (size_t)m->cfg.hidden_size, threads, x->perm);
}

/* Sparse layer: xn [T, hidden] -> x += sum of the chosen experts' outputs, weighted. */
static tqkv_status ffn_experts(const tqkv_model *m, tqkv_model_state *s, const q3m_layer *X,
                               size_t T) {
    const tqkv_model_config *c = &m->cfg;
    const int H = c->hidden_size, E = c->n_experts, K = c->n_experts_used, th = s->p.threads;
    q3m_scratch *x = s->ext;
    tqkv_status rc = scratch_grow(x, c, T);
    if (rc != TQKV_OK) return rc;
    mm_matmul_ld(s->xn, (int)T, &X->router, NULL, x->logits, (size_t)E, th, x->perm);
    for (size_t t = 0; t < T; t++)
        route_token(x->logits + t * E, E, K, c->norm_topk_prob, x->sel + t * K, x->wts + t * K);
    memset(x->acc, 0, sizeof(float) * T * (size_t)H);
    for (int e = 0; e < E; e++) {
        int n = 0; // tokens routed to e, ascending
        for (size_t t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                if (x->sel[t * K + k] == e) {
                    x->tok[n] = (int32_t)t;
                    x->w1[n] = x->wts[t * K + k];
                    memcpy(x->xg + (size_t)n * H, s->xn + t * H, sizeof(float) * (size_t)H);
                    n++;
                }
        if (n == 0) continue;
        expert_run(m, X, e, n, th, x);
        for (int i = 0; i < n; i++) {
            float *a = x->acc + (size_t)x->tok[i] * H;
            const float *y = x->y + (size_t)i * H;
            for (int j = 0; j < H; j++) {
                const float v = y[j] * x->w1[i]; /* rounded, then added (transformers' order) */
                a[j] += v;
            }
        }
    }
    for (size_t t = 0; t < T; t++) {
        float *xr = s->x + t * H;
        const float *a = x->acc + t * H;
        for (int j = 0; j < H; j++) xr[j] += a[j];
    }
    return TQKV_OK;
}

static tqkv_status ffn(const tqkv_model *m, tqkv_model_state *s, int l, size_t T, int pf) {
    if (!m->cfg.layer_moe[l]) return llama_ffn_dense(m, s, l, T, pf);
    return ffn_experts(m, s, &qwen3moe_of(m)->layers[l], T);
}

tqkv_status qwen3moe_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                             const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                             float *logits) {
    return llama_forward_with(m, s, tokens, lengths, n, prefill, mode, logits, ffn);
}

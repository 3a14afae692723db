/*
 * graph_cuda.cu - Qwen3-MoE's device hooks (arch.h, model_arch_cuda_ops): the common device
 *   graph of the Llama family (forward_cuda.cu) with the routed-experts feed-forward on the
 *   sparse layers (the GPU twin of src/model/ops/moe.c's moe_forward) and the dense MLP
 *   (mc_ffn_dense) on the others.
 * Owns: the experts' device weights (w->arch), a state's experts scratch (g->arch), the
 *   router / gather / combine kernels and the host routing step.
 * Must not: let a token's output depend on the other tokens of the call, or on how many
 *   tokens an expert got: every product is the invariant GEMM (tqkv_cuda_gemm, a row's result
 *   never depends on the rows beside it or on T), the router a fixed-order kernel, and a
 *   token's expert outputs are added in ascending expert order (moe.c's order).
 *
 * One sparse layer, T tokens, E experts, top K, expert width I, P = T K (token, expert) pairs:
 *   router_kernel   logits [T, E] = xn [T, H] . router [E, H]^T      (float32, fixed order)
 *   host            copy the logits back (one wait per sparse layer), moe_route_token per
 *                   token (moe.c's softmax, top-k, ties to the lower index, norm_topk_prob),
 *                   pairs grouped by expert: expert 0's tokens ascending, then expert 1's ...
 *   gather_kernel   xg [P, H] = xn [tok[p]]
 *   per expert e    gu = xg[o_e .. o_e + n_e) . wgu_e^T   [n_e, 2I]   (tqkv_cuda_gemm)
 *                   h = SwiGLU(gu)                        [P, I]      (the dense MLP's kernel)
 *                   y = h[o_e ..) . wd_e^T                [n_e, H]
 *   combine_kernel  tmp [T, H] = sum over the token's K pairs, ascending expert, of
 *                   round(w y[p]), from 0 (moe.c: acc += round(y w)); the caller's residual
 *                   norm then adds tmp to x as for the dense MLP.
 * The routing is data dependent and read on the host, so a sparse layer waits for its
 * router once: decode steps of a state with sparse layers run kernel by kernel (the
 * prepare hook turns CUDA graphs off for it: docs/CUDA.md, "Mixture of experts").
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"
extern "C" {
#include "model/arch/qwen3moe/qwen3moe.h"
}

// ---------------------------------------------------------------------------
// device weights and state scratch
// ---------------------------------------------------------------------------

typedef struct {
    float *router; /* [E, H] float32 (the router decides; kept at the host's precision) */
    bf16  *wgu;    /* [E, 2I, H] expert e's gate rows, then its up rows */
    bf16  *wd;     /* [E, H, I] */
} q3m_dlayer;

typedef struct {
    int         n_layers;
    q3m_dlayer *layers; /* [L] (NULL members on dense layers) */
} q3m_dweights;

typedef struct {
    size_t   cap;      /* tokens the buffers hold */
    float   *logits;   /* device [T, E] */
    float   *h_logits; /* pinned [T, E] */
    int32_t *idx;      /* device [3 P]: tok [P] | pair [T, K] | weight bits [T, K] */
    int32_t *h_idx;    /* pinned, the same */
    int32_t *sel;      /* host [T, K] chosen experts by descending probability */
    float   *wts;      /* host [T, K] their weights */
    int     *have;     /* host [T] pairs of each token placed so far */
    int     *n_of;     /* host [E] tokens routed to each expert */
    float   *xg;       /* device [P, H] */
    float   *gu;       /* device [P, 2I] */
    float   *h;        /* device [P, I] */
    float   *y;        /* device [P, H] */
} q3m_dstate;

static void dweights_free(void *p) {
    q3m_dweights *w = (q3m_dweights *)p;
    if (!w) return;
    for (int l = 0; l < w->n_layers && w->layers; l++) {
        cudaFree(w->layers[l].router);
        cudaFree(w->layers[l].wgu);
        cudaFree(w->layers[l].wd);
    }
    free(w->layers);
    free(w);
}

/* Sparse layer X's router (float32) and experts (bf16, stacked) into D. */
static tqkv_status upload_layer(const moe_layer *X, const moe_shape *sh, q3m_dlayer *D) {
    const int E = sh->n_experts, H = sh->hidden;
    float *r = (float *)malloc(sizeof(float) * (size_t)E * H);
    const mm_weight **ws = (const mm_weight **)malloc(sizeof(mm_weight *) * 2 * (size_t)E);
    if (!r || !ws) {
        free(r);
        free(ws);
        return tqkv_fail(TQKV_ENOMEM, "out of memory staging the experts");
    }
    for (int e = 0; e < E; e++) mm_weight_row(&X->router, e, r + (size_t)e * H);
    const int n = E * H;
    const float *rp = r;
    tqkv_status st = mc_upload_vec(&D->router, &rp, &n, 1);
    int nw = 0; /* [E] fused gate|up, or gate, up per expert */
    for (int e = 0; e < E; e++) {
        if (X->gu && X->gu[e].data) {
            ws[nw++] = &X->gu[e];
        } else {
            ws[nw++] = &X->g[e];
            ws[nw++] = &X->u[e];
        }
    }
    if (!st) st = mc_upload_matrix(&D->wgu, ws, nw);
    for (int e = 0; e < E; e++) ws[e] = &X->down[e];
    if (!st) st = mc_upload_matrix(&D->wd, ws, E);
    free(ws);
    free(r);
    return st;
}

tqkv_status q3m_cuda_upload(const tqkv_model *m, model_cuda_weights *w) {
    const tqkv_model_config *c = &m->cfg;
    const moe_shape sh = moe_shape_of(c);
    q3m_dweights *d = (q3m_dweights *)calloc(1, sizeof *d);
    if (!d) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    d->layers = (q3m_dlayer *)calloc((size_t)c->n_layers, sizeof(q3m_dlayer));
    if (!d->layers) {
        free(d);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    d->n_layers = c->n_layers;
    w->arch = d;
    w->arch_free = dweights_free; /* frees what was uploaded, also on failure */
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < c->n_layers && !st; l++)
        if (c->layer_moe[l]) st = upload_layer(&qwen3moe_of(m)->layers[l], &sh, &d->layers[l]);
    return st;
}

void q3m_cuda_state_free(model_cuda *g) {
    q3m_dstate *x = (q3m_dstate *)g->arch;
    if (!x) return;
    cudaStreamSynchronize(g->stream);
    cudaFree(x->logits);
    cudaFreeHost(x->h_logits);
    cudaFree(x->idx);
    cudaFreeHost(x->h_idx);
    free(x->sel);
    free(x->wts);
    free(x->have);
    free(x->n_of);
    cudaFree(x->xg);
    cudaFree(x->gu);
    cudaFree(x->h);
    cudaFree(x->y);
    free(x);
    g->arch = NULL;
}

/* Scratch for the T tokens the common scratch holds (g->cap_t), grown with it. */
tqkv_status q3m_cuda_prepare(model_cuda *g) {
    const tqkv_model_config *c = &g->m->cfg;
    if (c->n_moe_layers == 0) return TQKV_OK;
    g->graph.enabled = 0; /* the host routing waits inside the step: no capture */
    q3m_dstate *x = (q3m_dstate *)g->arch;
    if (!x) {
        x = (q3m_dstate *)calloc(1, sizeof *x);
        if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        g->arch = x;
    }
    const size_t T = g->cap_t;
    if (T <= x->cap) return TQKV_OK;
    const size_t E = (size_t)c->n_experts, K = (size_t)c->n_experts_used, P = T * K,
                 H = (size_t)c->hidden_size, I = (size_t)c->moe_intermediate_size;
    size_t cap = 0; /* mc_regrow's; x->cap is set once everything is there */
    x->cap = 0;
    free(x->sel);
    free(x->wts);
    free(x->have);
    free(x->n_of);
    x->sel = (int32_t *)malloc(sizeof(int32_t) * P);
    x->wts = (float *)malloc(sizeof(float) * P);
    x->have = (int *)malloc(sizeof(int) * T);
    x->n_of = (int *)malloc(sizeof(int) * E);
    if (!x->sel || !x->wts || !x->have || !x->n_of) return tqkv_fail(TQKV_ENOMEM, "out of memory (experts routing)");
    tqkv_status st = mc_regrow(g, (void **)&x->logits, 0, T * E * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h_logits, 1, T * E * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->idx, 0, 3 * P * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h_idx, 1, 3 * P * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->xg, 0, P * H * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->gu, 0, P * 2 * I * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h, 0, P * I * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->y, 0, P * H * 4, &cap, T);
    if (!st) x->cap = T;
    return st;
}

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* logits[t, e] = xn[t] . router[e]: one warp per (t, e); lane j sums k = j, j + 32, ... in
 * order (double), then a fixed xor butterfly. bf16x: xn rounded to bf16 first (the model's
 * bf16_act, as the CPU's product). grid ceil(T E / 4), block 128. */
__global__ void q3m_router_kernel(const float *__restrict__ xn, const float *__restrict__ rw,
                                  int T, int E, int H, int bf16x, float *__restrict__ logits) {
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (size_t)T * E) return;
    const size_t t = gw / E, e = gw % E;
    const float *a = xn + t * H, *b = rw + e * H;
    double s = 0;
    for (int k = lane; k < H; k += 32) {
        const float v = bf16x ? __bfloat162float(__float2bfloat16_rn(a[k])) : a[k];
        s += (double)v * b[k];
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) logits[gw] = (float)s;
}

/* xg[p] = xn[tok[p]], rows of H. grid P, block 128. */
__global__ void q3m_gather_kernel(const float *__restrict__ xn, const int32_t *__restrict__ tok,
                                  int H, float *__restrict__ xg) {
    const size_t p = blockIdx.x;
    const float *src = xn + (size_t)tok[p] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) xg[p * H + i] = src[i];
}

/* out[t, i] = sum over k < K (the token's pairs, ascending expert) of round(w y[pair, i]),
 * from 0. pair, wbits [T, K]. grid T, block 128. */
__global__ void q3m_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair,
                                   const int32_t *__restrict__ wbits, int K, int H,
                                   float *__restrict__ out) {
    const size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float a = 0.0f;
        for (int k = 0; k < K; k++) {
            const float w = __int_as_float(wbits[t * K + k]);
            a = __fadd_rn(a, __fmul_rn(y[(size_t)pair[t * K + k] * H + i], w));
        }
        out[t * H + i] = a;
    }
}

// ---------------------------------------------------------------------------
// the feed-forward hook
// ---------------------------------------------------------------------------

/* Host: route every token (moe.c's rule) and group the pairs by expert: h_idx gets tok [P]
 * (expert 0's tokens ascending, then expert 1's, ...), pair [T, K] and weight bits [T, K]
 * (each token's pairs in ascending expert order); n_of [E] the tokens of each expert. */
static void route_group(q3m_dstate *x, const tqkv_model_config *c, int T) {
    const int E = c->n_experts, K = c->n_experts_used;
    const size_t P = (size_t)T * K;
    int32_t *tok = x->h_idx, *pair = tok + P, *wb = pair + P;
    for (int t = 0; t < T; t++)
        moe_route_token(x->h_logits + (size_t)t * E, E, K, c->norm_topk_prob, NULL,
                        x->sel + (size_t)t * K, x->wts + (size_t)t * K);
    int *have = x->have, *n_of = x->n_of;
    memset(have, 0, sizeof(int) * (size_t)T);
    int p = 0;
    for (int e = 0; e < E; e++) {
        n_of[e] = 0;
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++)
                if (x->sel[(size_t)t * K + k] == e) {
                    const size_t slot = (size_t)t * K + have[t]++;
                    tok[p] = t;
                    pair[slot] = p;
                    memcpy(&wb[slot], &x->wts[(size_t)t * K + k], 4);
                    n_of[e]++;
                    p++;
                }
    }
}

tqkv_status q3m_cuda_ffn(model_cuda *g, int l, int T) {
    const tqkv_model_config *c = &g->m->cfg;
    if (!c->layer_moe[l]) return mc_ffn_dense(g, l, T);
    const q3m_dlayer *D = &((const q3m_dweights *)g->w->arch)->layers[l];
    q3m_dstate *x = (q3m_dstate *)g->arch;
    const int E = c->n_experts, K = c->n_experts_used, H = c->hidden_size,
              I = c->moe_intermediate_size;
    const size_t P = (size_t)T * K;
    const cudaStream_t s = g->stream;
    // ---- router logits [T, E], back to the host
    const size_t warps = (size_t)T * E;
    q3m_router_kernel<<<(unsigned)((warps + 3) / 4), 128, 0, s>>>(g->xn, D->router, T, E, H,
                                                                   g->m->bf16_act, x->logits);
    tqkv_status st = mc_ck(cudaMemcpyAsync(x->h_logits, x->logits, (size_t)T * E * 4,
                                           cudaMemcpyDeviceToHost, s), "router logits");
    if (!st) st = mc_ck(cudaStreamSynchronize(s), "router logits");
    if (st) return st;
    // ---- routing and grouping (host), up in one copy
    const int *n_of = x->n_of;
    route_group(x, c, T);
    st = mc_ck(cudaMemcpyAsync(x->idx, x->h_idx, 3 * P * 4, cudaMemcpyHostToDevice, s), "routing");
    if (!st) q3m_gather_kernel<<<(unsigned)P, 128, 0, s>>>(g->xn, x->idx, H, x->xg);
    // ---- experts over their gathered rows: gate|up, SwiGLU, down
    size_t o = 0;
    for (int e = 0; e < E && !st; o += (size_t)n_of[e], e++)
        if (n_of[e])
            st = mc_gemm(g, x->xg + o * H, H, n_of[e], D->wgu + (size_t)e * 2 * I * H, 2 * I, H, NULL,
                         x->gu + o * 2 * I, 2 * (size_t)I);
    if (!st) mc_swiglu_queue(x->gu, I, x->h, P, s);
    o = 0;
    for (int e = 0; e < E && !st; o += (size_t)n_of[e], e++)
        if (n_of[e])
            st = mc_gemm(g, x->h + o * I, I, n_of[e], D->wd + (size_t)e * H * I, H, I, NULL,
                         x->y + o * H, H);
    // ---- combine: tmp [T, H], each token's experts in ascending order
    if (!st)
        q3m_combine_kernel<<<(unsigned)T, 128, 0, s>>>(x->y, x->idx + P, x->idx + 2 * P, K, H, g->tmp);
    if (!st) st = mc_ck(cudaGetLastError(), "experts kernels");
    return st;
}

// ---------------------------------------------------------------------------
// check
// ---------------------------------------------------------------------------

tqkv_status q3m_cuda_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const int I = c->moe_intermediate_size;
    if (c->moe_shared_intermediate_size > 0)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: a shared expert has no device "
                         "kernels", c->arch_name);
    if (c->n_moe_layers && (I % 8 || c->hidden_size % 8))
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: expert width %d and hidden %d "
                         "must be multiples of 8", c->arch_name, I, c->hidden_size);
    if (c->n_moe_layers && I > c->hidden_size && I > c->intermediate_size)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: expert width %d above both the "
                         "hidden size and the dense MLP's width (the GEMM scratch's bound)",
                         c->arch_name, I);
    return TQKV_OK;
}

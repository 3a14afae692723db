/*
 * moe_cuda.cu - the routed-experts feed-forward on the device (moe_cuda.h), the GPU twin of
 *   src/model/ops/moe.c's moe_experts, for every mixture-of-experts graph: Qwen3-MoE and
 *   Qwen 3.5 MoE through the common device graph's `ffn` hook (the hooks at the end), Gemma 4's
 *   MoE block from its own forward queue (src/model/arch/gemma4/graph_cuda.cu).
 * Owns: the experts' device weights (mc_moe_layer), a state's experts scratch (mc_moe_state),
 *   the router / gather / combine kernels and the host routing step.
 * Must not: let a token's output depend on the other tokens of the call, or on how many
 *   tokens an expert got: every product is the invariant GEMM (tqkv_cuda_gemm, a row's result
 *   never depends on the rows beside it or on T), the routers a fixed-order kernel, and a
 *   token's expert outputs are added in ascending expert order (moe.c's order).
 *
 * One sparse layer, T tokens, E experts, top K, expert width I, shared expert width S
 * (0: none), P = T K (token, expert) pairs, xr the router's input, xn the experts':
 *   router_kernel   logits [T, E] = xr [T, H] . router [E, H]^T      (float32, fixed order)
 *   host            copy the logits back (one wait per sparse layer), moe_route_token per
 *                   token (moe.c's softmax, top-k, ties to the lower index, renormalised
 *                   when norm_topk, times the per-expert scale if any), pairs grouped by
 *                   expert: expert 0's tokens ascending, then expert 1's ...
 *   gather_kernel   xg [P, H] = xn [tok[p]]
 *   per expert e    gu = xg[o_e .. o_e + n_e) . wgu_e^T   [n_e, 2I]   (tqkv_cuda_gemm_grouped:
 *                                                                       every expert in one
 *                                                                       launch, bitwise the
 *                                                                       per-expert calls')
 *                   h = act(gate) * up                     [P, I]      (SiLU: the dense MLP's
 *                                                                       kernel; GELU-tanh)
 *                   y = h[o_e ..) . wd_e^T                [n_e, H]
 *   shared (S > 0)  sy = down(act(gate xn) * up xn) [T, H]; sg = xn . sh_gate [T] (the
 *                   router kernel with one expert)
 *   combine_kernel  out [T, H] = sum over the token's K pairs, ascending expert, of
 *                   round(w y[p]), from 0, then + round(sigmoid(sg) sy) (moe.c's order).
 * The routing is data dependent and read on the host, so a sparse layer waits for its
 * router once: decode steps of a state with sparse layers run kernel by kernel (the
 * scratch's reserve turns CUDA graphs off for it: docs/CUDA.md, "Mixture of experts").
 * TQKV_MOE_GROUPED=0 (or mc_moe_set_grouped(0)) runs one tqkv_cuda_gemm per expert instead
 * of the grouped launch (the same bits: test_cuda_moe checks it); so does --fast-gemm (cuBLAS).
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
#include "model/ops/gemm_cuda.h"

// ---------------------------------------------------------------------------
// device weights and state scratch
// ---------------------------------------------------------------------------

struct mc_moe_layer {
    float *router;             /* [E, H] float32 (the router decides; the host's precision) */
    bf16  *wgu;                /* [E, 2I, H] expert e's gate rows, then its up rows */
    bf16  *wd;                 /* [E, H, I] */
    bf16  *sh_wgu, *sh_wd;     /* [2S, H], [H, S] the shared expert, or NULL */
    float *sh_gate;            /* [H] float32 its gate, or NULL */
    const float *expert_scale; /* host [E] the routing weights' factors (the host model's), or NULL */
};

struct mc_moe_state {
    size_t   cap;      /* tokens the buffers hold */
    float   *logits;   /* device [T, E] */
    float   *h_logits; /* pinned [T, E] */
    int32_t *idx;      /* device [4 E + 3 P]: groups [E, 4] (row0, rows, expert, 0 of each
                        * expert with tokens) | tok [P] | pair [T, K] | weight bits [T, K] */
    int32_t *h_idx;    /* pinned, the same */
    void    *xf;       /* device: the grouped GEMMs' activations, [parts, P, max(H, I)] bf16 */
    int32_t *sel;      /* host [T, K] chosen experts by descending probability */
    float   *wts;      /* host [T, K] their weights */
    int     *have;     /* host [T] pairs of each token placed so far */
    int     *n_of;     /* host [E] tokens routed to each expert */
    float   *xg;       /* device [P, H] */
    float   *gu;       /* device [max(P 2I, T 2S)] */
    float   *h;        /* device [max(P I, T S)] */
    float   *y;        /* device [P, H] */
    float   *sy;       /* device [T, H] the shared expert's output (S > 0) */
    float   *sg;       /* device [T] its gate logits (S > 0) */
};

extern "C" void mc_moe_layer_free(mc_moe_layer *D) {
    if (!D) return;
    void *ps[] = {D->router, D->wgu, D->wd, D->sh_wgu, D->sh_wd, D->sh_gate};
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
    D->expert_scale = X->expert_scale;
    tqkv_status st = upload_f32(&X->router, &D->router);
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
    cudaFreeHost(x->h_logits);
    cudaFree(x->idx);
    cudaFreeHost(x->h_idx);
    free(x->sel);
    free(x->wts);
    free(x->have);
    free(x->n_of);
    void *ps[] = {x->xg, x->gu, x->h, x->y, x->sy, x->sg, x->xf};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
    free(x);
    *xp = NULL;
}

/* Scratch for the T tokens the common scratch holds (g->cap_t), grown with it. */
extern "C" tqkv_status mc_moe_reserve(model_cuda *g, const moe_shape *sh, mc_moe_state **xp) {
    g->graph.enabled = 0; /* the host routing waits inside the step: no capture */
    mc_moe_state *x = *xp;
    if (!x) {
        x = (mc_moe_state *)calloc(1, sizeof *x);
        if (!x) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        *xp = x;
    }
    const size_t T = g->cap_t;
    if (T <= x->cap) return TQKV_OK;
    const size_t E = (size_t)sh->n_experts, K = (size_t)sh->top_k, P = T * K,
                 H = (size_t)sh->hidden, I = (size_t)sh->inter, S = (size_t)sh->shared_inter;
    const size_t GU = P * 2 * I > T * 2 * S ? P * 2 * I : T * 2 * S;
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
    if (!st) st = mc_regrow(g, (void **)&x->idx, 0, (4 * E + 3 * P) * 4, &cap, T);
    if (!st) st = mc_regrow(g, (void **)&x->h_idx, 1, (4 * E + 3 * P) * 4, &cap, T);
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
// kernels
// ---------------------------------------------------------------------------

/* logits[t, e] = xr[t] . router[e]: one warp per (t, e); lane j sums k = j, j + 32, ... in
 * order (double), then a fixed xor butterfly. bf16x: xr rounded to bf16 first (the model's
 * bf16_act, as the CPU's product). grid ceil(T E / 4), block 128. */
__global__ void moe_router_kernel(const float *__restrict__ xr, const float *__restrict__ rw,
                                  int T, int E, int H, int bf16x, float *__restrict__ logits) {
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (size_t)T * E) return;
    const size_t t = gw / E, e = gw % E;
    const float *a = xr + t * H, *b = rw + e * H;
    double s = 0;
    for (int k = lane; k < H; k += 32) {
        const float v = bf16x ? __bfloat162float(__float2bfloat16_rn(a[k])) : a[k];
        s += (double)v * b[k];
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) logits[gw] = (float)s;
}

/* xg[p] = xn[tok[p]], rows of H. grid P, block 128. */
__global__ void moe_gather_kernel(const float *__restrict__ xn, const int32_t *__restrict__ tok,
                                  int H, float *__restrict__ xg) {
    const size_t p = blockIdx.x;
    const float *src = xn + (size_t)tok[p] * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) xg[p * H + i] = src[i];
}

/* out[t, i] = sum over k < K (the token's pairs, ascending expert) of round(w y[pair, i]),
 * from 0; then, with sy, + round(sigmoid(sg[t]) sy[t, i]). pair, wbits [T, K]. grid T,
 * block 128. */
__global__ void moe_combine_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair,
                                   const int32_t *__restrict__ wbits, int K, int H,
                                   const float *__restrict__ sy, const float *__restrict__ sg,
                                   float *__restrict__ out) {
    const size_t t = blockIdx.x;
    const float gate = sy ? __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(0.0f - sg[t]))) : 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float a = 0.0f;
        for (int k = 0; k < K; k++) {
            const float w = __int_as_float(wbits[t * K + k]);
            a = __fadd_rn(a, __fmul_rn(y[(size_t)pair[t * K + k] * H + i], w));
        }
        if (sy) a = __fadd_rn(a, __fmul_rn(gate, sy[t * H + i]));
        out[t * H + i] = a;
    }
}

// ---------------------------------------------------------------------------
// one sparse layer
// ---------------------------------------------------------------------------

/* The grouped GEMMs: -1 until the first use reads TQKV_MOE_GROUPED (0: off). */
static int g_grouped = -1;

extern "C" void mc_moe_set_grouped(int on) { g_grouped = on ? 1 : 0; }

static int grouped_on(void) {
    if (g_grouped < 0) {
        const char *e = getenv("TQKV_MOE_GROUPED");
        g_grouped = !(e && !strcmp(e, "0"));
    }
    return g_grouped;
}

/* Host: route every token (moe.c's rule) and group the pairs by expert: h_idx gets the
 * groups [G, 4] (row0, rows, expert, 0 of each expert with tokens, ascending), then tok [P]
 * (expert 0's tokens ascending, then expert 1's, ...), pair [T, K] and weight bits [T, K]
 * (each token's pairs in ascending expert order); n_of [E] the tokens of each expert, *G the
 * groups, *most the most tokens of an expert. */
static void route_group(mc_moe_state *x, const moe_shape *sh, const float *scale, int T, int *G,
                        int *most) {
    const int E = sh->n_experts, K = sh->top_k;
    const size_t P = (size_t)T * K;
    int32_t *grp = x->h_idx, *tok = grp + 4 * (size_t)E, *pair = tok + P, *wb = pair + P;
    for (int t = 0; t < T; t++)
        moe_route_token(x->h_logits + (size_t)t * E, E, K, sh->norm_topk, scale,
                        x->sel + (size_t)t * K, x->wts + (size_t)t * K);
    int *have = x->have, *n_of = x->n_of;
    memset(have, 0, sizeof(int) * (size_t)T);
    int p = 0;
    *G = *most = 0;
    for (int e = 0; e < E; e++) {
        const int row0 = p;
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
        if (!n_of[e]) continue;
        int32_t *gr = grp + 4 * (size_t)(*G)++;
        gr[0] = row0;
        gr[1] = n_of[e];
        gr[2] = e;
        gr[3] = 0;
        *most = n_of[e] > *most ? n_of[e] : *most;
    }
}

/* y [P, N] (rows of expert e at its group's rows) = x [P, K] . w_e^T, w_e = w + e N K: one
 * grouped launch, or one tqkv_cuda_gemm per expert with tokens (grouped off, or cuBLAS). */
static tqkv_status experts_gemm(model_cuda *g, mc_moe_state *x, const float *in, int K,
                                const bf16 *w, int N, float *y, int P, int G, int most,
                                int E) {
    if (grouped_on() && !g->cublas)
        return tqkv_cuda_gemm_grouped(in, K, P, (const uint16_t *)w, (size_t)N * K, N, K, y, N,
                                      x->idx, G, most, x->xf, g->gemm_parts, g->stream);
    tqkv_status st = TQKV_OK;
    size_t o = 0;
    for (int e = 0; e < E && !st; o += (size_t)x->n_of[e], e++)
        if (x->n_of[e])
            st = mc_gemm(g, in + o * K, K, x->n_of[e], w + (size_t)e * N * K, N, K, NULL,
                         y + o * N, N);
    return st;
}

/* h [n, W] = act(gate) * up of gu [n, 2W] on g's stream. */
static void act_queue(model_cuda *g, moe_act act, const float *gu, int W, float *h, size_t n) {
    if (act == MOE_ACT_SILU) mc_swiglu_queue(gu, W, h, n, g->stream);
    else mc_geglu_queue(gu, W, h, n, g->stream);
}

/* The shared expert of xn [T, H] into x->sy, its gate logits into x->sg. */
static tqkv_status shared_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                                mc_moe_state *x, const float *xn, int T) {
    const int H = sh->hidden, S = sh->shared_inter;
    tqkv_status st = mc_gemm(g, xn, H, T, D->sh_wgu, 2 * S, H, NULL, x->gu, 2 * (size_t)S);
    if (!st) act_queue(g, sh->act, x->gu, S, x->h, (size_t)T);
    if (!st) st = mc_gemm(g, x->h, S, T, D->sh_wd, H, S, NULL, x->sy, H);
    if (!st)
        moe_router_kernel<<<(unsigned)((T + 3) / 4), 128, 0, g->stream>>>(xn, D->sh_gate, T, 1, H,
                                                                          g->m->bf16_act, x->sg);
    return st;
}

extern "C" tqkv_status mc_moe_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                                    mc_moe_state *x, const float *xr, const float *xn,
                                    float *out, int T) {
    const int E = sh->n_experts, K = sh->top_k, H = sh->hidden, I = sh->inter;
    const size_t P = (size_t)T * K;
    const cudaStream_t s = g->stream;
    if (!x || (size_t)T > x->cap)
        return tqkv_fail(TQKV_ESTATE, "cuda forward: experts scratch holds %zu tokens, not %d",
                         x ? x->cap : 0, T);
    // ---- router logits [T, E], back to the host
    const size_t warps = (size_t)T * E;
    moe_router_kernel<<<(unsigned)((warps + 3) / 4), 128, 0, s>>>(xr, D->router, T, E, H,
                                                                   g->m->bf16_act, x->logits);
    tqkv_status st = mc_ck(cudaMemcpyAsync(x->h_logits, x->logits, (size_t)T * E * 4,
                                           cudaMemcpyDeviceToHost, s), "router logits");
    if (!st) st = mc_ck(cudaStreamSynchronize(s), "router logits");
    if (st) return st;
    // ---- routing and grouping (host), up in one copy
    int G = 0, most = 0;
    route_group(x, sh, D->expert_scale, T, &G, &most);
    const int32_t *tok = x->idx + 4 * (size_t)E, *pair = tok + P;
    st = mc_ck(cudaMemcpyAsync(x->idx, x->h_idx, (4 * (size_t)E + 3 * P) * 4,
                               cudaMemcpyHostToDevice, s), "routing");
    if (!st) moe_gather_kernel<<<(unsigned)P, 128, 0, s>>>(xn, tok, H, x->xg);
    // ---- experts over their gathered rows: gate|up, activation, down
    if (!st) st = experts_gemm(g, x, x->xg, H, D->wgu, 2 * I, x->gu, (int)P, G, most, E);
    if (!st) act_queue(g, sh->act, x->gu, I, x->h, P);
    if (!st) st = experts_gemm(g, x, x->h, I, D->wd, H, x->y, (int)P, G, most, E);
    // ---- the shared expert, then combine: out [T, H], each token's experts in ascending order
    const int shared = sh->shared_inter > 0;
    if (!st && shared) st = shared_queue(g, D, sh, x, xn, T);
    if (!st)
        moe_combine_kernel<<<(unsigned)T, 128, 0, s>>>(x->y, pair, pair + P, K, H,
                                                       shared ? x->sy : NULL, x->sg, out);
    if (!st) st = mc_ck(cudaGetLastError(), "experts kernels");
    return st;
}

extern "C" tqkv_status mc_moe_check(const tqkv_model *m) {
    const tqkv_model_config *c = &m->cfg;
    const int I = c->moe_intermediate_size, S = c->moe_shared_intermediate_size;
    if (c->n_moe_layers && (I % 8 || c->hidden_size % 8 || S % 8))
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %s: expert width %d, shared expert "
                         "width %d and hidden %d must be multiples of 8", c->arch_name, I, S,
                         c->hidden_size);
    return TQKV_OK;
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

/*
 * forward_cuda.cu - the model forward pass on the GPU (see model_cuda.h).
 * Owns: the per-token kernels (embedding, RMSNorm, q/k norm + RoPE + scatter, gather,
 * SwiGLU, residual; their shared device helpers in ops_cuda.cuh), a state's init / free,
 * and the graph (elsewhere: the weights, weights_cuda.cu; caches and scratch buffers,
 * buffers_cuda.cu; the twin's row operations, spec rounds and export / upload, state_cuda.cu):
 * embed -> per layer [RMSNorm, qkv GEMM, q/k norm, RoPE, device cache append (GPU encode),
 * attention (decode: split-KV fused kernel; n > 1: masked multi-query kernel, or with
 * extend_as_decode the decode kernel once per query), o GEMM, residual + RMSNorm, gate|up
 * GEMM, SwiGLU, down GEMM, residual] -> RMSNorm -> lm_head -> logits copied to the host,
 * and / or (model_cuda_decode_pick) the device pick (pick_cuda.h) and its records.
 * Must not: let an output element's reduction order depend on T, on the token's place in
 * a tile, or on other rows (batch invariance); call the host model's CPU forward.
 *
 * GEMMs: tqkv_cuda_gemm (gemm_cuda.h: tensor cores, activations as bf16 (the model's
 * bf16_act) or bf16 hi + lo, one running sum per output over K's k16 steps in order, so
 * batch invariant by construction).
 * RoPE cos / sin come from the host's ops_rope_table (the CPU's exact values).
 *
 * Stream and CUDA graph: every kernel and copy of a state runs on its own non-blocking
 * stream (g->stream, handed to the caches, the GEMMs and cuBLAS); a forward queues its work
 * there and waits once, at the end. A decode step (n == 1) is the same queue of work
 * captured into a CUDA graph and replayed (docs/CUDA.md, "Decode step as a CUDA graph"):
 * per-step data goes through fixed buffers (tokens and RoPE rows from pinned host buffers,
 * logits to a pinned one, the row table advanced on the device), and everything else a
 * launch takes from the host is in the graph's key (rows, logits or not, the pick's record
 * stride, the attention's launch shape, the generation of the buffers and cache storages).
 * The pick's plan and penalty tokens go up in a copy queued before the step (its size
 * changes from step to step), into a buffer the captured kernel reads at a fixed address.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/model_impl.h"
#include "model/ops/ops.h"
#include "util/common.h"
}
#include "util/env_switch.h"
#include "model/ops/gemm_cuda.h"
#include "model/cuda/model_cuda_impl.h"
#include "model/ops/ops_cuda.cuh"
#include "model/sample/pick_cuda.h"
#include "codec/codec_cuda_encode.cuh"

// ---------------------------------------------------------------------------
// state: model_cuda_impl.h
// ---------------------------------------------------------------------------

tqkv_status mc_ck(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return TQKV_OK;
    /* an API error such as an allocation failure is also the runtime's "last error":
     * clear it, or a later launch check would report it again (sticky errors stay) */
    (void)cudaGetLastError();
    const tqkv_status s = e == cudaErrorMemoryAllocation ? TQKV_ENOMEM : TQKV_EUNSUPPORTED;
    return tqkv_fail(s, "CUDA: %s: %s", what, cudaGetErrorString(e));
}

tqkv_status mc_dmalloc(void **p, size_t bytes) {
    *p = NULL;
    return mc_ck(cudaMalloc(p, bytes ? bytes : 16), "cudaMalloc (model)");
}

#define ck      mc_ck
#define dmalloc mc_dmalloc

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* x[t, :] = embed[tinfo[t].token, :]. grid mc_grid_elems(T, H), block 256. */
__global__ void embed_kernel(const int32_t *__restrict__ tinfo, const bf16 *__restrict__ e, int H,
                             float *__restrict__ x) {
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < H) x[t * H + i] = __bfloat162float(e[(size_t)tinfo[t * 3] * H + i]);
}

/* Optionally x[t] += add[t]; then out[t] = w * (x[t] * r), r = 1 / sqrt(mean(x^2) + eps)
 * (sum of squares in double, as the CPU). x, add, out [T, H]; with xf also out's GEMM split
 * (mc_split_store, `parts`). A thread's values are i, i + 128, ..., summed in that order.
 * NV > 0 (H <= 128 NV): they stay in registers between the two passes, and x, add and (NV
 * <= 32; 64 would spill) w are all loaded before the first addition (one memory round
 * trip; NV = 64: w's in the second pass); NV = 0 (any H): passes of
 * U loads, x read back in the second (the same values: this thread wrote them). The same
 * operations in the same order either way. grid T, block 128 (rmsnorm_queue). */
template <int NV>
__global__ void __launch_bounds__(128)
rmsnorm_kernel(float *__restrict__ x, const float *__restrict__ add, const float *__restrict__ w,
               float eps, int H, float *__restrict__ out, uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_wait();    /* programmatic (rmsnorm_queue's pdl): the kernel before has completed */
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    constexpr int U = NV > 0 ? NV : 8; /* a thread's values loaded U at a time */
    constexpr bool W_EARLY = NV > 0 && NV <= 32;
    __shared__ double sh[4];
    const size_t t = blockIdx.x;
    float *xr = x + t * H;
    const float *ar = add ? add + t * H : NULL;
    double s = 0;
    float v[U], g[U];
    if (W_EARLY) mc_load_strided<U>(g, w, threadIdx.x, 128, H);
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        float a[U];
        mc_load_strided<U>(v, xr, i0, 128, H);
        if (ar) mc_load_strided<U>(a, ar, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            if (ar) xr[i] = v[u] = v[u] + a[u];
            s += (double)v[u] * v[u];
        }
    }
    s = mc_block_sum128(s, sh);
    const float r = mc_rms_r(s, H, eps);
    for (int i0 = threadIdx.x; i0 < H; i0 += U * 128) {
        if (NV == 0) mc_load_strided<U>(v, xr, i0, 128, H);
        if (!W_EARLY) mc_load_strided<U>(g, w, i0, 128, H);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + 128 * u;
            if (i >= H) break;
            const float o = g[u] * (v[u] * r);
            out[t * H + i] = o;
            if (xf) mc_split_store(xf, (size_t)gridDim.x * H, t * H + i, o, parts);
        }
    }
}

/* Registers between the norm's passes (1, the default unless TQKV_NORM_REGS=0) or the
 * passes of 8 loads (0): the same bits. Read at the first launch; the setter's -1 goes back
 * to the environment. */
static env_switch g_norm_regs = ENV_SWITCH("TQKV_NORM_REGS");

extern "C" void model_cuda_set_norm_regs(int on) { env_switch_set(&g_norm_regs, on); }

int mc_norm_nv(int H, int max_nv) {
    const int on = env_switch_get(&g_norm_regs);
    const int nv = (H + 127) / 128;
    if (!on || nv > max_nv) return 0;
    return nv <= 8 ? 8 : nv <= 16 ? 16 : nv <= 32 ? 32 : 64;
}

/* rmsnorm_kernel over T rows of H on s (NV: mc_norm_nv). */
static void rmsnorm_queue(float *x, const float *add, const float *w, float eps, int H,
                          float *out, uint16_t *xf, int parts, size_t T, int pdl, cudaStream_t s) {
    const int nv = mc_norm_nv(H, 64);
    void (*k)(float *, const float *, const float *, float, int, float *, uint16_t *, int) =
        nv == 8 ? rmsnorm_kernel<8> : nv == 16 ? rmsnorm_kernel<16> : nv == 32 ? rmsnorm_kernel<32>
        : nv == 64 ? rmsnorm_kernel<64> : rmsnorm_kernel<0>;
    cuda_pdl_launch(pdl, k, dim3((unsigned)T), dim3(128), 0, s, x, add, w, eps, H, out, xf, parts);
}

extern "C" tqkv_status model_cuda_rmsnorm(float *x, const float *add, const float *w, float eps,
                                          int H, float *out, uint16_t *xf, int parts, int T) {
    if (!x || !w || !out || H < 1 || T < 1 || (parts != 1 && parts != 2))
        return tqkv_fail(TQKV_EINVAL, "device RMSNorm: bad arguments (H %d, T %d, parts %d)", H,
                         T, parts);
    rmsnorm_queue(x, add, w, eps, H, out, xf, parts, (size_t)T, 0, 0);
    return ck(cudaGetLastError(), "RMSNorm launch");
}

/* qkv_post's parameters: the projection rows qkv [T, QS] (query head h at h qs, qs = hd,
 * or 2 hd when each head's gate rows follow its query rows; then k, then v: QB = NH qs), the
 * heads, the call's n, the token list, the q/k norm weights (NULL: none), RoPE rows
 * [T, hd] (cos [half] | sin [half]) and the scatter targets qb [R, NH, n, hd], kb / vb
 * [R, NKV, n, hd]. hd == 128. */
struct qkv_post_args {
    const float *qkv;
    int QS, qs, T, NH, NKV, n;
    const int32_t *tinfo;
    const float *qn, *kn;
    float eps;
    const float *rope;
    int half;
    float *qb, *kb, *vb;
};

/* A warp's (token, head) of qkv_post_args after its q/k RMSNorm and RoPE: v[i] = dim lane +
 * 32 i; kind 0 q, 1 k, 2 v; hk the head within its kind; (row, j) the token's row and column.
 * sv: the warp's [128] floats of shared scratch (RoPE's pairs). */
struct qkv_head {
    int kind, hk, row, j;
};
__device__ __forceinline__ qkv_head qkv_post_head(const qkv_post_args &a, size_t t, int h,
                                                  float (&v)[4], float *sv) {
    const int lane = threadIdx.x & 31, NH = a.NH, NKV = a.NKV;
    qkv_head o;
    o.row = a.tinfo[t * 3 + 1], o.j = a.tinfo[t * 3 + 2];
    const float *src = a.qkv + t * (size_t)a.QS +
                       (h < NH ? (size_t)h * a.qs : (size_t)NH * a.qs + (size_t)(h - NH) * 128);
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = src[lane + 32 * i];
    o.kind = h < NH ? 0 : h < NH + NKV ? 1 : 2; /* q, k, v */
    o.hk = o.kind == 0 ? h : o.kind == 1 ? h - NH : h - NH - NKV;
    if (o.kind < 2) {
        const float *nw = o.kind == 0 ? a.qn : a.kn;
        float g[4];
#pragma unroll
        for (int i = 0; i < 4; i++) g[i] = nw ? nw[lane + 32 * i] : 0.0f;
        if (nw) {
            double s = (double)v[0] * v[0] + (double)v[1] * v[1] + (double)v[2] * v[2] +
                       (double)v[3] * v[3];
            for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
            const float r = mc_rms_r(s, 128, a.eps);
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = g[i] * (v[i] * r);
        }
        mc_warp_rope<4>(v, sv, a.rope + t * 128, a.half);
    }
    return o;
}

/* The head's scatter: qb / kb / vb at (row, head, column). */
__device__ __forceinline__ void qkv_post_store(const qkv_post_args &a, const qkv_head &o,
                                               const float (&v)[4]) {
    const int lane = threadIdx.x & 31, n = a.n;
    float *dst = o.kind == 0 ? a.qb + (((size_t)o.row * a.NH + o.hk) * n + o.j) * 128
               : (o.kind == 1 ? a.kb : a.vb) + (((size_t)o.row * a.NKV + o.hk) * n + o.j) * 128;
#pragma unroll
    for (int i = 0; i < 4; i++) dst[lane + 32 * i] = v[i];
}

/* One warp per (token, head) of q | k | v: q/k RMSNorm (if qn), RoPE on q and k (pairs
 * (d, d + half), d < half: all of the head when half = 64, Qwen 3.5's partial RoPE when
 * less), scatter to qb, kb, vb (qkv_post_args). grid ceil(T * (NH + 2 NKV) / 4), block 128. */
__global__ void qkv_post_kernel(const qkv_post_args a) {
    __shared__ float sv[4][128];
    cuda_pdl_wait(); /* programmatic (g->pdl): the qkv GEMM has completed */
    cuda_pdl_trigger();
    const int HT = a.NH + 2 * a.NKV;
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (gw >= (size_t)a.T * HT) return;
    float v[4];
    const qkv_head o = qkv_post_head(a, gw / HT, (int)(gw % HT), v, sv[threadIdx.x >> 5]);
    qkv_post_store(a, o, v);
}

/* qkv_post_kernel whose K and V heads go straight into the cache (tqkv_cuda_kv_append_begin's
 * A: codec_cuda_encode.cuh's ce_encode_vec at the row's col0 + column, the bytes the encode
 * kernel writes from kb / vb) instead of kb / vb; the queries as qkv_post_kernel's. */
__global__ void qkv_post_enc_kernel(const qkv_post_args a, const ce_args A) {
    __shared__ float sv[4][128];
    __shared__ double st[4][128];
    __shared__ uint8_t si[4][128];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float cl0 = A.C[0].cent[lane & 15], cl1 = A.C[1].cent[lane & 15];
    cuda_pdl_wait(); /* programmatic (g->pdl): the qkv GEMM has completed */
    cuda_pdl_trigger();
    const int HT = a.NH + 2 * a.NKV;
    const size_t gw = (size_t)blockIdx.x * 4 + w;
    if (gw >= (size_t)a.T * HT) return;
    float v[4];
    const qkv_head o = qkv_post_head(a, gw / HT, (int)(gw % HT), v, sv[w]);
    if (o.kind == 0) {
        qkv_post_store(a, o, v);
        return;
    }
    float xr[4]; /* dims 4 lane .. 4 lane + 3: the encode's layout */
#pragma unroll
    for (int i = 0; i < 4; i++) sv[w][lane + 32 * i] = v[i];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; k++) xr[k] = sv[w][4 * lane + k];
    const int p = o.kind - 1;
    const size_t slot = ((size_t)o.row * A.kvh + o.hk) * A.cap + (size_t)(A.rows[o.row].col0 + o.j);
    ce_encode_vec<128>(A.P[p], A.C[p], p ? cl1 : cl0, slot, xr, st[w], si[w], lane);
}

/* att[t, h * hd + d] = ob[((row * NH + h) * n + col) * hd + d], times sigmoid(gate) when
 * gate is set (Qwen 3.5's gated attention: head h's gate at gate[t * QS + h * 2 hd + d]).
 * With xf also att's GEMM split. grid mc_grid_elems(T, NH 128), block 256. */
__global__ void gather_kernel(const float *__restrict__ ob, const int32_t *__restrict__ tinfo,
                              int NH, int n, const float *__restrict__ gate, int QS,
                              float *__restrict__ att, uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_wait();    /* programmatic (g->pdl): the attention has completed */
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= NH * 128) return;
    const int r = tinfo[t * 3 + 1], j = tinfo[t * 3 + 2];
    const int h = i >> 7, d = i & 127;
    float o = ob[(((size_t)r * NH + h) * n + j) * 128 + d];
    if (gate) {
        const float x = gate[t * QS + (size_t)h * 256 + d];
        o = __fmul_rn(o, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))));
    }
    att[t * NH * 128 + i] = o;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * NH * 128, t * NH * 128 + i, o, parts);
}

/* h[t, i] = g / (1 + exp(-g)) * u with gu [T, 2I] = gate | up; with xf also h's GEMM
 * split. grid mc_grid_elems(T, I), block 256. */
__global__ void swiglu_kernel(const float *__restrict__ gu, int I, float *__restrict__ h,
                              uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_wait();    /* programmatic (pdl): the gate|up GEMM has completed */
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= I) return;
    const float g = gu[t * 2 * I + i], u = gu[t * 2 * I + I + i];
    const float o = mc_silu_mul(g, u);
    h[t * I + i] = o;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * I, t * I + i, o, parts);
}

// ---------------------------------------------------------------------------
// public
// ---------------------------------------------------------------------------

/* The layer geometry the device runtime sizes by (from each layer's info, arch.h): the
 * position layer kv0 (the architecture's, else the first attention layer) and the largest
 * head_dim, n_heads hd and kv_heads hd of an attention layer. */
static void mc_geometry(model_cuda *g) {
    const tqkv_model *m = g->m;
    const tqkv_model_config *c = &m->cfg;
    g->kv0 = -1;
    g->max_hd = 0;
    g->max_qd = g->max_kd = 0;
    for (int l = 0; l < c->n_layers; l++) {
        if (model_layer_kind_of(m, l) == MODEL_LAYER_RECURRENT) continue;
        tqkv_layer_info li;
        (void)tqkv_model_layer_info(m, l, &li);
        if (g->kv0 < 0) g->kv0 = l;
        const size_t qd = (size_t)c->n_heads * li.head_dim, kd = (size_t)li.kv_heads * li.head_dim;
        g->max_hd = li.head_dim > g->max_hd ? li.head_dim : g->max_hd;
        g->max_qd = qd > g->max_qd ? qd : g->max_qd;
        g->max_kd = kd > g->max_kd ? kd : g->max_kd;
    }
    if (m->ops->position_layer) g->kv0 = m->ops->position_layer(m);
}

extern "C" tqkv_status model_cuda_init(model_cuda **out, const tqkv_model *m,
                                       const tqkv_model_state_params *p, int rows) {
    if (!out || !m || !p || rows < 1) return tqkv_fail(TQKV_EINVAL, "model_cuda_init: bad argument");
    if (rows > CUDA_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %d rows (a device state holds at most %d)",
                         rows, CUDA_MAX_ROWS);
    if (!tqkv_cuda_available())
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: no CUDA device is available");
    /* the attention's one-time setup here, never first inside a graph capture */
    tqkv_status sst = tqkv_cuda_attn_setup();
    if (sst) return sst;
    const tqkv_model_config *c = &m->cfg;
    const model_arch_cuda_ops *ao = m->ops->cuda;
    if (!m->ops->device)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: the %s graph runs on the CPU only",
                         c->arch_name);
    if (ao && ao->check) {
        tqkv_status ck_st = ao->check(m);
        if (ck_st) return ck_st;
    }
    if (c->n_linear > 0 && !(ao && ao->linear))
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: the %s graph's recurrent layers have "
                         "no device kernels", c->arch_name);
    if (c->n_linear >= c->n_layers)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: a graph without attention layers");
    if (c->head_dim != CUDA_DIM && !(ao && ao->forward_queue)) /* the common graph's dim */
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: head_dim %d (the device kernels "
                         "need %d)", c->head_dim, CUDA_DIM);
    if (c->n_heads % c->n_kv_heads || c->n_heads / c->n_kv_heads > CUDA_MAX_G)
        return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: %d query heads per KV head (at "
                         "most %d)", c->n_heads / c->n_kv_heads, CUDA_MAX_G);
    /* every layer's pair (per-layer formats included): a device pair, or f32/f32 (bf16) */
    const tqkv_status fst = tqkv_kv_layers_device_check(m, p, NULL);
    if (fst) return fst;
    model_cuda *g = (model_cuda *)calloc(1, sizeof *g);
    if (!g) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    g->m = m;
    g->arch_ops = ao;
    g->p = *p;
    g->rows = rows;
    mc_geometry(g);
    if (c->n_linear > 0) { /* recurrent.h's row layout */
        mc_rec *rc = &g->rec;
        const size_t CD = 2 * (size_t)c->lin_k_heads * c->lin_k_dim + (size_t)c->lin_v_heads * c->lin_v_dim;
        rc->n_lin = c->n_linear;
        rc->conv_floats = CD * (size_t)(c->lin_conv_kernel - 1);
        rc->ssm_floats = (size_t)c->lin_v_heads * c->lin_k_dim * c->lin_v_dim;
        rc->row_floats = (size_t)c->n_linear * (rc->conv_floats + rc->ssm_floats);
    }
    const char *env = getenv("TQKV_CUDA_GRAPHS"); /* "0": off whatever the parameters say */
    g->graph.enabled = p->device_graphs && !(env && !strcmp(env, "0"));
    g->kv_ids = (uint64_t *)calloc((size_t)c->n_layers, sizeof(uint64_t));
    tqkv_status st = g->kv_ids ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (!st) st = ck(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), "state stream");
    if (!st && !m->gpu_weights) { /* first device state of this model: upload once */
        model_cuda_weights *w = NULL;
        st = mc_upload_weights(m, &w);
        if (!st) ((tqkv_model *)m)->gpu_weights = w;
    }
    g->w = m->gpu_weights;
    g->gemm_parts = m->bf16_act ? 1 : 2; /* the CPU's choice of activation precision */
    const char *pre = getenv("TQKV_GEMM_PRESPLIT"); /* "0": a split launch before each GEMM */
    g->presplit = !(pre && !strcmp(pre, "0"));
    /* the decode chain's programmatic launches (docs/CUDA.md "PDL"): on unless TQKV_PDL=0
     * (session 19: every kernel of a layer, 1.059x on the one-row Llama-8B step, 1.064x on
     * Qwen3-30B-A3B's, H100) */
    const char *pdl = getenv("TQKV_PDL");
    g->pdl = !(pdl && !strcmp(pdl, "0"));
    if (!st && g->pdl) g->pdl = tqkv_cuda_gemm_pdl_probe(g->stream); /* refused: plain */
    if (!st) st = mc_make_caches(g, rows);
    if (!st && p->device_fast_gemm) st = gemm_cublas_init(&g->cublas, g->stream);
    if (st) {
        model_cuda_free(g);
        return st;
    }
    *out = g;
    return TQKV_OK;
}

/* Everything is freed after the stream is idle, the stream last. */
extern "C" void model_cuda_free(model_cuda *g) {
    if (!g) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    mc_graph_drop(g);
    if (g->arch_ops && g->arch_ops->state_free) g->arch_ops->state_free(g);
    gemm_cublas_free(g->cublas);
    cudaFree(g->aws);
    mc_free_caches(g);
    mc_free_scratch(g);
    free(g->off);
    free(g->kv_ids);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

extern "C" void model_cuda_graph_stats_get(const model_cuda *g, model_cuda_graph_stats *out) {
    if (!out) return;
    memset(out, 0, sizeof *out);
    if (!g) return;
    *out = g->graph.stats;
    out->enabled = g->graph.enabled;
}

extern "C" tqkv_status model_cuda_reset(model_cuda *g, int rows) {
    if (!g || rows < 0) return tqkv_fail(TQKV_EINVAL, "model_cuda_reset: bad argument");
    return mc_make_caches(g, rows == 0 ? g->rows : rows);
}

extern "C" tqkv_status model_cuda_offsets(const model_cuda *g, int *offset) {
    if (!g || !offset) return tqkv_fail(TQKV_EINVAL, "model_cuda_offsets: NULL argument");
    memcpy(offset, tqkv_cuda_kv_offsets(g->kv[g->kv0]), sizeof(int) * (size_t)g->rows);
    return TQKV_OK;
}

/* Bytes of decode attention workspace for a call that attends each row r at its lengths
 * off[r] + 1 .. off[r] + n (a decode: n = 1; a verification window: n):
 * tqkv_cuda_attend_ws_bytes is monotone in the length, so the longest row's last length
 * decides. For a decode step it is also the graph key's attn_ws. */
/* The decode attention workspace for the state's layers: head_dim 128's need, or (Gemma 4
 * with full layers of 256) the larger of both dims' (a sliding layer's window view is never
 * longer than the full rows, so the longest row bounds it too). */
size_t mc_attend_ws_bytes(const model_cuda *g, int tokens) {
    const size_t b = tqkv_cuda_attend_ws_bytes(g->rows, g->m->cfg.n_heads, tokens);
    if (g->max_hd <= CUDA_DIM) return b;
    const size_t w =
        tqkv_cuda_attend_ws_bytes_dim(g->rows, g->m->cfg.n_heads, tokens, CUDA_DIM_WIDE);
    return w > b ? w : b; /* Gemma 4: layers of both head dims share it */
}

static size_t aws_need(const model_cuda *g, const int *off, int n) {
    int longest = 0;
    for (int r = 0; r < g->rows; r++) longest = off[r] > longest ? off[r] : longest;
    return mc_attend_ws_bytes(g, longest + n);
}

/* The shared decode attention workspace, at least `need` bytes (a new one: gen bump). */
static tqkv_status ensure_aws_bytes(model_cuda *g, size_t need) {
    if (need <= g->aws_bytes) return TQKV_OK;
    return mc_regrow(g, &g->aws, 0, need, &g->aws_bytes, need);
}

/* The workspace for rows of up to max_tokens tokens (monotone: the longest decides). */
static tqkv_status ensure_aws(model_cuda *g, int max_tokens) {
    return ensure_aws_bytes(g, mc_attend_ws_bytes(g, max_tokens));
}

/* The caches' new storage (if any) has new storage ids: the next step's key differs; the
 * executable graph is dropped all the same (its memory goes before the caches grow). */
extern "C" tqkv_status model_cuda_reserve(model_cuda *g, int tokens) {
    mc_graph_drop(g);
    tqkv_status st = ensure_aws(g, tokens);
    const tqkv_model *m = g->m;
    for (int l = 0; l < m->cfg.n_layers && !st; l++) {
        if (!g->kv[l]) continue;
        int t = tokens; /* a bounded sliding layer's columns stay below ~2 (window + slack) */
        if (model_layer_kind_of(m, l) == MODEL_LAYER_SLIDING) {
            const int keep = m->ops->sliding_keep(m, &g->p);
            t = t < 2 * keep ? t : 2 * keep;
        }
        st = tqkv_cuda_kv_reserve(g->kv[l], t);
    }
    return st;
}

/* Synthetic fill: chunks of FILL_CHUNK tokens of N(0, 1) K and V per row, through each
 * layer's own append (GPU encode), from temporary buffers freed before returning. */
#define FILL_CHUNK 16
extern "C" tqkv_status model_cuda_fill(model_cuda *g, int n, uint64_t seed) {
    const tqkv_model_config *c = &g->m->cfg;
    const size_t kdmax = g->max_kd;
    const size_t per = (size_t)g->rows * kdmax * FILL_CHUNK; /* [rows, NKV, chunk, hd] */
    float *k = NULL, *v = NULL;
    tqkv_status st = dmalloc((void **)&k, per * 4);
    if (!st) st = dmalloc((void **)&v, per * 4);
    int done = 0; /* tokens appended to every layer */
    while (!st && done < n) {
        const int m = n - done < FILL_CHUNK ? n - done : FILL_CHUNK;
        for (int l = 0; l < c->n_layers && !st; l++) {
            if (!g->kv[l]) continue; /* recurrent rows: their token count follows below */
            tqkv_layer_info li;
            (void)tqkv_model_layer_info(g->m, l, &li);
            const size_t cnt = (size_t)g->rows * m * ((size_t)li.kv_heads * li.head_dim);
            const uint64_t sd = seed ^ ((uint64_t)l << 40) ^ ((uint64_t)done << 8);
            /* all on g->stream: the next fill of k / v waits for this append's encode */
            st = tqkv_cuda_fill_normal_on(k, cnt, sd * 2 + 1, 1.0f, g->stream);
            if (!st) st = tqkv_cuda_fill_normal_on(v, cnt, sd * 2 + 2, 1.0f, g->stream);
            if (!st) st = tqkv_cuda_kv_append(g->kv[l], k, v, m);
            if (st) /* leave every layer at `done` tokens */
                for (int j = 0; j < l; j++)
                    if (g->kv[j]) tqkv_cuda_kv_trim(g->kv[j], m);
        }
        if (!st) done += m;
    }
    /* recurrent rows stay as they are (zeros after a reset) but count the tokens, so the
     * state stays consistent: a benchmark aid, not a model state */
    for (int r = 0; r < g->rows && g->rec.n_lin; r++) g->rec.tokens[r] += done;
    const tqkv_status ss = ck(cudaStreamSynchronize(g->stream), "synthetic fill");
    cudaFree(k);
    cudaFree(v);
    return st ? st : ss;
}

tqkv_status mc_gemm(model_cuda *g, const float *x, size_t ldx, int T, const bf16 *w, int N, int K,
                    const float *bias, float *y, size_t ldy) {
    if (g->cublas) /* xf holds >= T K 4 bytes: room for the bf16 activations */
        return gemm_cublas_run(g->cublas, x, ldx, T, (const uint16_t *)w, N, K, bias, y, ldy, g->xf);
    return tqkv_cuda_gemm(x, ldx, T, (const uint16_t *)w, N, K, bias, y, ldy, g->xf, g->gemm_parts, g->stream);
}

/* mc_gemm on x whose split the kernel before wrote into g->xf (the split it passes
 * mc_split_xf(g)): no split launch. With --fast-gemm (cuBLAS) x itself is read. */
tqkv_status mc_gemm_pre(model_cuda *g, const float *x, size_t ldx, int T, const bf16 *w,
                        int N, int K, const float *bias, float *y, size_t ldy) {
    if (g->cublas || !g->presplit) return mc_gemm(g, x, ldx, T, w, N, K, bias, y, ldy);
    /* decode sizes: a programmatic (PDL) launch, the weights' first stages streaming while
     * the kernel before (the one that wrote the split) finishes */
    return tqkv_cuda_gemm_presplit(T, (const uint16_t *)w, N, K, bias, y, ldy, g->xf,
                                   g->gemm_parts, g->pdl && T <= GEMM_CUDA_SMALL_T, g->stream);
}

/* Where a kernel before a GEMM writes that GEMM's split (NULL with cuBLAS, which splits
 * itself, or with presplit off). */
uint16_t *mc_split_xf(const model_cuda *g) {
    return g->cublas || !g->presplit ? NULL : (uint16_t *)g->xf;
}

/* Speculative verification (extend_as_decode, n > 1): query j of each row attends as that
 * token's single decode did, with the decode kernel over the row's tokens up to its own
 * position (tqkv_cuda_kv_attend_back, n - 1 - j tokens back), so the window's logits equal n
 * single-token decodes bit for bit (window 0; with the q8 window while n - 1 <= slack).
 * qb, ob [R, NH, n, hd]; att [T, QD] is free until the gather that follows and holds
 * q1 = att [R, NH, hd] and o1 = att + R QD [R, NH, hd] (2 R QD <= T QD since n >= 2).
 * Everything is queued on g->stream (the caches' stream). Never captured in the decode
 * graph (n > 1). */
tqkv_status mc_attend_as_decode(model_cuda *g, cuda_kv *kv, int n, int NH, int head_dim,
                                float scale) {
    const size_t R = (size_t)g->rows, hd = (size_t)head_dim, vec = hd * sizeof(float);
    float *q1 = g->att, *o1 = g->att + R * NH * hd;
    tqkv_status st = TQKV_OK;
    for (int j = 0; j < n && !st; j++) {
        st = ck(cudaMemcpy2DAsync(q1, vec, g->qb + (size_t)j * hd, (size_t)n * vec, vec, R * NH,
                                  cudaMemcpyDeviceToDevice, g->stream), "verification query copy");
        if (!st) st = tqkv_cuda_kv_attend_back(kv, n - 1 - j, q1, NH, scale, o1, g->aws, g->aws_bytes);
        if (!st) st = ck(cudaMemcpy2DAsync(g->ob + (size_t)j * hd, (size_t)n * vec, o1, vec, vec, R * NH,
                                           cudaMemcpyDeviceToDevice, g->stream), "verification output copy");
    }
    return st;
}

// ---------------------------------------------------------------------------
// forward: one call's device work as a queue on g->stream, run directly or, for a decode
// step, captured into a CUDA graph and replayed
// ---------------------------------------------------------------------------

/* The device pick after the lm_head (g->logits [rows, V]): the kernel on the plan already
 * uploaded to g->pick_in, then the records' copy to the pinned g->h_pick_rec. */
tqkv_status mc_pick_queue(model_cuda *g, int stride) {
    const int R = g->rows, V = g->m->cfg.vocab_size;
    tqkv_status st = pick_cuda_queue(g->logits, (size_t)V, R, V, g->pick_in, stride, g->pick_rec, g->stream);
    if (!st) st = ck(cudaMemcpyAsync(g->h_pick_rec, g->pick_rec, (size_t)R * PICK_REC_WORDS(stride) * 4,
                                     cudaMemcpyDeviceToHost, g->stream), "pick records");
    return st;
}

/* h [T, I] = SwiGLU of gu [T, 2I] (gate | up), the CPU's exp, on stream s; with xf also h's
 * GEMM split (`parts`). */
static void swiglu_queue(const float *gu, int I, float *h, size_t T, uint16_t *xf, int parts,
                         int pdl, cudaStream_t s) {
    if (T == 0) return;
    cuda_pdl_launch(pdl, swiglu_kernel, mc_grid_elems(T, (size_t)I), dim3(256), 0, s, gu, I, h, xf,
                    parts);
}

void mc_swiglu_queue(const float *gu, int I, float *h, size_t T, uint16_t *xf, int parts, int pdl,
                     cudaStream_t s) {
    swiglu_queue(gu, I, h, T, xf, parts, pdl, s);
}

/* h = gelu_tanh(g) * u, gu [T, 2I] = gate | up; with xf also h's GEMM split. grid (T,
 * ceil(I / 256)), block 256. */
__global__ void geglu_kernel(const float *__restrict__ gu, int I, float *__restrict__ h,
                             uint16_t *__restrict__ xf, int parts) {
    cuda_pdl_wait();    /* programmatic (pdl): the gate|up GEMM has completed */
    cuda_pdl_trigger(); /* the next GEMM (PDL) may start its weight stream */
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= I) return;
    const float o = mc_gelu_mul(gu[t * 2 * I + i], gu[t * 2 * I + I + i]);
    h[t * I + i] = o;
    if (xf) mc_split_store(xf, (size_t)gridDim.x * I, t * I + i, o, parts);
}

/* h [T, I] = GeGLU (GELU-tanh) of gu [T, 2I] (gate | up), on stream s (xf: h's split too). */
void mc_geglu_queue(const float *gu, int I, float *h, size_t T, uint16_t *xf, int parts, int pdl,
                    cudaStream_t s) {
    if (T == 0) return;
    cuda_pdl_launch(pdl, geglu_kernel, dim3((unsigned)T, (unsigned)((I + 255) / 256)), dim3(256), 0, s,
                    gu, I, h, xf, parts);
}

/* Layer l's dense MLP: tmp [T, H] = down(SwiGLU(gate|up xn [T, H])), through gu / hh. */
tqkv_status mc_ffn_dense(model_cuda *g, int l, int T) {
    const mc_layer *L = &g->w->layers[l];
    const int H = g->m->cfg.hidden_size, I = g->m->cfg.intermediate_size;
    /* xn's split: the RMSNorm before (forward_queue's) wrote it */
    tqkv_status st = mc_gemm_pre(g, g->xn, H, T, L->wgu, 2 * I, H, NULL, g->gu, 2 * (size_t)I);
    if (st) return st;
    swiglu_queue(g->gu, I, g->hh, (size_t)T, mc_split_xf(g), g->gemm_parts, g->pdl, g->stream);
    return mc_gemm_pre(g, g->hh, I, T, L->wd, H, I, NULL, g->tmp, H);
}

// ---------------------------------------------------------------------------
// the common graph's pieces (Qwen3 / Qwen2 / Llama, Qwen 3.5): forward_queue below runs
// them in order; the sharded forward (tp_cuda.cu) runs them per rank with all-reduces
// between. Each queues on g->stream and waits for nothing.
// ---------------------------------------------------------------------------

/* The call's upload (token list, RoPE rows, spec slots from the pinned host buffers), the
 * embedding x [T, H] and layer 0's attention RMSNorm into xn [T, H]. T = rows n. */
tqkv_status mc_queue_begin(model_cuda *g, int n) {
    const tqkv_model_config *c = &g->m->cfg;
    const int H = c->hidden_size, hd = c->head_dim;
    const size_t T = (size_t)g->rows * n;
    const cudaStream_t s = g->stream;
    tqkv_status st = ck(cudaMemcpyAsync(g->tinfo, g->h_tinfo, T * 3 * 4, cudaMemcpyHostToDevice, s),
                        "upload tokens");
    if (!st) st = ck(cudaMemcpyAsync(g->rope, g->h_rope, T * hd * 4, cudaMemcpyHostToDevice, s),
                     "upload rope");
    if (!st && g->rec.n_lin)
        st = ck(cudaMemcpyAsync(g->slot, g->h_slot, T * 4, cudaMemcpyHostToDevice, s), "upload slots");
    if (st) return st;
    embed_kernel<<<mc_grid_elems(T, (size_t)H), 256, 0, s>>>(g->tinfo, g->w->embed, H, g->x);
    rmsnorm_queue(g->x, NULL, g->w->layers[0].attn_norm, c->rms_norm_eps, H, g->xn, mc_split_xf(g),
                  g->gemm_parts, T, g->pdl, s);
    return TQKV_OK;
}

/* The decode's K and V encoded where qkv_post computes them (qkv_post_enc_kernel): on unless
 * the environment has TQKV_QKV_ENCODE=0 (then qkv_post_kernel and the cache's encode launch:
 * the same bytes). */
static env_switch g_qkv_encode = ENV_SWITCH("TQKV_QKV_ENCODE");

extern "C" void model_cuda_set_qkv_encode(int on) { env_switch_set(&g_qkv_encode, on); }

static unsigned long g_qkv_encode_runs; /* (tests) */

extern "C" unsigned long model_cuda_qkv_encode_runs(void) {
    return __atomic_load_n(&g_qkv_encode_runs, __ATOMIC_RELAXED);
}

/* The projection rows g->qkv of this call's n tokens a row: q/k norm, RoPE, the queries
 * into qb, K and V appended to the layer's cache kv (at n = 1 encoded by the same kernel,
 * when the cache takes it: tqkv_cuda_kv_append_begin). */
static tqkv_status qkv_post_append(model_cuda *g, const mc_layer *L, cuda_kv *kv, int n, int QS,
                                   int qs, int half) {
    const tqkv_model_config *c = &g->m->cfg;
    const int NH = c->n_heads, NKV = c->n_kv_heads, T = g->rows * n;
    const qkv_post_args a = {g->qkv, QS, qs, T, NH, NKV, n, g->tinfo, L->q_norm, L->k_norm,
                             c->rms_norm_eps, g->rope, half, g->qb, g->kb, g->vb};
    const dim3 grid((unsigned)(((size_t)T * (NH + 2 * NKV) + 3) / 4));
    int fused = 0;
    ce_args A;
    if (n == 1 && env_switch_get(&g_qkv_encode)) {
        const tqkv_status st = tqkv_cuda_kv_append_begin(kv, n, &A, &fused);
        if (st) return st;
    }
    if (!fused) {
        cuda_pdl_launch(g->pdl, qkv_post_kernel, grid, dim3(128), 0, g->stream, a);
        return tqkv_cuda_kv_append(kv, g->kb, g->vb, n);
    }
    cuda_pdl_launch(g->pdl, qkv_post_enc_kernel, grid, dim3(128), 0, g->stream, a, A);
    __atomic_add_fetch(&g_qkv_encode_runs, 1, __ATOMIC_RELAXED);
    return tqkv_cuda_kv_append_end(kv, n);
}

/* Layer l's token mixer: xn [T, H] -> tmp [T, H]. An attention layer: qkv GEMM, q/k norm +
 * RoPE + scatter, the cache append, attention (decode / verification window / masked
 * prefill), gather, o GEMM (+ its bias, when the layer has one); a linear layer (Qwen 3.5):
 * its projection, DeltaNet (*lin: linear layers so far, advanced) and output GEMM.
 * *done = l + 1 once the layer's cache took the append or its recurrent rows changed. */
tqkv_status mc_layer_mixer(model_cuda *g, int l, int n, int as_decode, int *lin, int *done) {
    const tqkv_model_config *c = &g->m->cfg;
    const int R = g->rows, H = c->hidden_size, hd = c->head_dim, NH = c->n_heads,
              NKV = c->n_kv_heads;
    const int gated = c->attn_output_gate; /* a gate row block per query head */
    const int qs = gated ? 2 * hd : hd, QD = NH * hd, KD = NKV * hd, QS = NH * qs + 2 * KD;
    const int half = (c->rotary_dim ? c->rotary_dim : hd) / 2;
    const int VD = c->lin_v_heads * c->lin_v_dim;
    const int PWL = 2 * c->lin_k_heads * c->lin_k_dim + 2 * VD + 2 * c->lin_v_heads;
    const size_t T = (size_t)R * n;
    const cudaStream_t s = g->stream;
    uint16_t *xf = mc_split_xf(g);
    const int parts = g->gemm_parts;
    const float scale = 1.0f / sqrtf((float)hd);
    const mc_layer *L = &g->w->layers[l];
    cuda_kv *kv = g->kv[l];
    tqkv_status st;
    if (!kv) { /* Qwen 3.5 gated DeltaNet: xn -> proj -> cv -> att [T, VD] -> tmp */
        st = mc_gemm_pre(g, g->xn, H, (int)T, L->lin_in, PWL, H, NULL, g->qkv, PWL);
        if (!st) st = g->arch_ops->linear(c, L, &g->rec, *lin, R, n, g->qkv, g->cv, g->slot, g->att, s);
        if (!st) (*lin)++;
        *done = l + 1; /* the recurrent rows changed: forward_fail marks the state broken */
        if (!st) st = mc_gemm(g, g->att, VD, (int)T, L->lin_out, H, VD, NULL, g->tmp, H);
        return st;
    }
    st = mc_gemm_pre(g, g->xn, H, (int)T, L->wqkv, QS, H, L->bqkv, g->qkv, QS);
    if (st) return st;
    st = qkv_post_append(g, L, kv, n, QS, qs, half);
    if (st) return st;
    *done = l + 1;
    int xf_done = 0; /* n = 1 without a gate: ob [R, NH, 1, hd] is att's layout, so the
                      * attention's merge may write the o GEMM's split (no gather) */
    if (n == 1) {
        st = tqkv_cuda_kv_attend_ws_xf(kv, g->qb, NH, scale, g->ob, gated ? NULL : xf, parts, g->aws,
                                       g->aws_bytes, &xf_done);
    } else if (as_decode) {
        st = mc_attend_as_decode(g, kv, n, NH, hd, scale);
    } else {
        for (int r = 0; r < R; r++)
            for (int j = 0; j < n; j++) {
                const int lp = tqkv_cuda_kv_left_pads(kv)[r];
                g->h_lo[(size_t)r * n + j] = lp;
                g->h_hi[(size_t)r * n + j] = lp + g->off[r] + j + 1;
            }
        st = tqkv_cuda_kv_attend_masked(kv, g->qb, n, NH, scale, g->h_lo, g->h_hi, g->ob);
    }
    if (st) return st;
    if (xf_done) /* the GEMM reads only xf (mc_gemm_pre with a split); ob is att */
        return mc_gemm_pre(g, g->ob, QD, (int)T, L->wo, H, QD, L->bo, g->tmp, H);
    cuda_pdl_launch(g->pdl, gather_kernel, mc_grid_elems(T, (size_t)NH * 128), dim3(256), 0, s,
                    g->ob, g->tinfo, NH, n, gated ? g->qkv + hd : NULL, QS, g->att, xf, parts);
    return mc_gemm_pre(g, g->att, QD, (int)T, L->wo, H, QD, L->bo, g->tmp, H);
}

/* x [T, H] += tmp; xn = RMSNorm(x) with weight w (and xn's GEMM split): the residual of a
 * block fused with the next block's norm. */
void mc_residual_norm(model_cuda *g, const float *w, size_t T) {
    const tqkv_model_config *c = &g->m->cfg;
    rmsnorm_queue(g->x, g->tmp, w, c->rms_norm_eps, c->hidden_size, g->xn, mc_split_xf(g),
                  g->gemm_parts, T, g->pdl, g->stream);
}

/* Layer l's feed-forward: xn [T, H] -> tmp [T, H] (the architecture's hook, e.g. routed
 * experts, or the dense MLP). */
tqkv_status mc_layer_ffn(model_cuda *g, int l, int T) {
    return g->arch_ops && g->arch_ops->ffn ? g->arch_ops->ffn(g, l, T) : mc_ffn_dense(g, l, T);
}

/* The norm weight after layer l's feed-forward: layer l + 1's attention norm, or the final
 * norm after the last layer. */
const float *mc_next_norm(const model_cuda *g, int l) {
    return l + 1 < g->m->cfg.n_layers ? g->w->layers[l + 1].attn_norm : g->w->final_norm;
}

tqkv_status mc_ffn_block_steps(model_cuda *g, int l, int T) {
    mc_residual_norm(g, g->w->layers[l].ffn_norm, (size_t)T);
    const tqkv_status st = mc_layer_ffn(g, l, T);
    /* residual x += tmp, then the next layer's attention norm (or the final norm) */
    if (!st) mc_residual_norm(g, mc_next_norm(g, l), (size_t)T);
    return st;
}

tqkv_status mc_layer_ffn_block(model_cuda *g, int l, int T) {
    if (g->arch_ops && g->arch_ops->ffn_block) return g->arch_ops->ffn_block(g, l, T);
    return mc_ffn_block_steps(g, l, T);
}

/* The head: lm_head rows [head_n, H] over xn (every token's final-normed state) into logits
 * [rows, head_n] (LAST: each row's last token, t = r n + n - 1) or [T, head_n] (ALL), their
 * copy to `out` (host; NULL: none) and, with pick > 0 (mode LAST), the device pick. */
tqkv_status mc_head(model_cuda *g, int n, tqkv_logits_mode mode, float *out, int pick) {
    const int R = g->rows, H = g->m->cfg.hidden_size;
    const int V = g->head_n ? g->head_n : g->m->cfg.vocab_size;
    const size_t T = (size_t)R * n;
    const cudaStream_t s = g->stream;
    tqkv_status st;
    if (mode == TQKV_LOGITS_LAST) {
        st = mc_gemm(g, g->xn + (size_t)(n - 1) * H, (size_t)n * H, R, g->w->lm_head, V, H, NULL,
                     g->logits, V);
        /* the full rows leave before the pick's penalty changes them in place */
        if (!st && out) st = ck(cudaMemcpyAsync(out, g->logits, (size_t)R * V * 4, cudaMemcpyDeviceToHost, s), "logits");
        if (!st && pick) st = mc_pick_queue(g, pick);
        return st;
    }
    st = mc_gemm(g, g->xn, H, (int)T, g->w->lm_head, V, H, NULL, g->logits, V);
    if (!st && out) st = ck(cudaMemcpyAsync(out, g->logits, T * V * 4, cudaMemcpyDeviceToHost, s), "logits");
    return st;
}

/* Queue one forward's device work on g->stream for the token list in h_tinfo / h_rope
 * (T = rows n tokens): its upload, the embedding, the layers, the lm_head, the logits'
 * copy to `out` (host memory; pinned when captured; NULL: no copy) and, with pick > 0
 * (a decode step, mode LAST), the device pick with record stride `pick`. Waits for
 * nothing. *done: the layers whose cache took this call's append (forward_undo rewinds
 * them) or whose recurrent rows it queued changes to. With n == 1 and !as_decode it only
 * launches kernels and copies between fixed buffers, and reads from the host only what the
 * graph key holds: capturable. */
static tqkv_status forward_queue(model_cuda *g, int n, int as_decode, tqkv_logits_mode mode,
                                 float *out, int pick, int *done) {
    if (g->arch_ops && g->arch_ops->forward_queue)
        return g->arch_ops->forward_queue(g, n, as_decode, mode, out, pick, done);
    const tqkv_model_config *c = &g->m->cfg;
    const size_t T = (size_t)g->rows * n;
    *done = 0;
    tqkv_status st = mc_queue_begin(g, n);
    int lin = 0; /* linear layers so far */
    for (int l = 0; l < c->n_layers && !st; l++) {
        st = mc_layer_mixer(g, l, n, as_decode, &lin, done);
        if (!st) st = mc_layer_ffn_block(g, l, (int)T);
    }
    if (!st) st = ck(cudaGetLastError(), "forward kernels");
    if (st || mode == TQKV_LOGITS_NONE) return st;
    /* xn holds every token's final-normed state (the last layer's fused norm) */
    return mc_head(g, n, mode, out, pick);
}

/* Undo the appends of a failed call to the first `done` layers (prefill: the rows were
 * empty, rewind leaves them empty; inside a spec round too). The row table is uploaded
 * from the host mirror, so it also undoes a captured append that never ran. */
static tqkv_status forward_undo(model_cuda *g, int done, int n) {
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < done; l++)
        if (g->kv[l]) {
            const tqkv_status rs = tqkv_cuda_kv_rewind(g->kv[l], n);
            if (!st) st = rs;
        }
    return st;
}

/* After a failed call that ran (some of) its queue: the KV rows go back (forward_undo);
 * recurrent rows cannot, so a state whose linear layers were reached (src/model/arch/qwen35/graph.c's
 * rule), or whose rewind failed, refuses forwards until it is reset or restored. */
static void forward_fail(model_cuda *g, int done, int n) {
    if (forward_undo(g, done, n)) g->broken = 1;
    for (int l = 0; l < done && g->rec.n_lin; l++)
        if (g->m->cfg.layer_type[l] == TQKV_LAYER_LINEAR) g->broken = 1;
}

void mc_forward_fail(model_cuda *g, int done, int n) { forward_fail(g, done, n); }

tqkv_status mc_forward_undo(model_cuda *g, int done, int n) { return forward_undo(g, done, n); }

static tqkv_status forward_direct(model_cuda *g, int n, int as_decode, tqkv_logits_mode mode,
                                  float *out, int pick) {
    int done = 0;
    const tqkv_status st = forward_queue(g, n, as_decode, mode, out, pick, &done);
    if (st) forward_fail(g, done, n);
    return st;
}

/* The decode step's key now. Cache storage ids that moved since the last step (a regrow
 * inside an append, or anything installed without install_caches) bump gen. */
static mc_graph_key graph_key(model_cuda *g, int logits, size_t attn_ws, int pick) {
    int moved = 0;
    for (int l = 0; l < g->m->cfg.n_layers; l++) {
        if (!g->kv[l]) continue;
        const uint64_t id = tqkv_cuda_kv_storage_id(g->kv[l]);
        if (id != g->kv_ids[l]) {
            g->kv_ids[l] = id;
            moved = 1;
        }
    }
    if (moved) g->gen++;
    mc_graph_key k;
    memset(&k, 0, sizeof k);
    k.valid = 1;
    k.rows = g->rows;
    k.logits = logits;
    k.attn_ws = attn_ws;
    k.pick = pick;
    k.win_ws = g->arch_ops && g->arch_ops->win_tokens
                   ? mc_attend_ws_bytes(g, g->arch_ops->win_tokens(g, 1)) : 0;
    k.gen = g->gen;
    return k;
}

static int graph_key_eq(const mc_graph_key *a, const mc_graph_key *b) {
    return a->valid && b->valid && a->rows == b->rows && a->logits == b->logits &&
           a->attn_ws == b->attn_ws && a->pick == b->pick && a->win_ws == b->win_ws &&
           a->gen == b->gen;
}

mc_graph_key mc_graph_key_now(model_cuda *g, int logits, size_t attn_ws, int pick) {
    return graph_key(g, logits, attn_ws, pick);
}

int mc_graph_key_same(const mc_graph_key *a, const mc_graph_key *b) { return graph_key_eq(a, b); }

/* The graph machinery failed (not the forward): graphs off for this state, said once on
 * stderr, and the step runs directly (the same bits). */
static tqkv_status graph_fallback(model_cuda *g, const char *why, tqkv_logits_mode mode, float *out,
                                  int pick) {
    (void)cudaGetLastError(); /* a capture error must not fail the direct run's launch check */
    mc_graph_drop(g);
    g->graph.enabled = 0;
    fprintf(stderr, "tqkv: CUDA graphs off for a device state (%s); its decode steps run kernel "
            "by kernel\n", why);
    g->graph.stats.direct++;
    return forward_direct(g, 1, 0, mode, out, pick);
}

/* One decode step (n == 1) through the graph: replay when the key equals the executable
 * graph's; capture (update or instantiate) and launch when it equals the previous step's;
 * else run directly and remember the key (a one-off shape costs no capture). */
static tqkv_status forward_decode_graph(model_cuda *g, tqkv_logits_mode mode, size_t attn_ws,
                                        float *out, int pick) {
    const int L = g->m->cfg.n_layers;
    mc_graph *gr = &g->graph;
    tqkv_status st = TQKV_OK;
    /* nothing may allocate inside a capture: the caches grow first (the append's own rule) */
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_reserve_append(g->kv[l], 1);
    if (st) return st;
    const mc_graph_key key = graph_key(g, out != NULL, attn_ws, pick);
    if (gr->exec && graph_key_eq(&key, &gr->key)) { /* replay; the appends' host half by hand */
        st = ck(cudaGraphLaunch(gr->exec, g->stream), "decode graph launch");
        for (int l = 0; l < L && !st; l++)
            if (g->kv[l]) st = tqkv_cuda_kv_replayed_append(g->kv[l], 1);
        if (!st) gr->stats.replays++;
        return st;
    }
    if (!graph_key_eq(&key, &gr->pending)) { /* a new key: direct, captured if it repeats */
        gr->stats.direct++;
        const tqkv_status ds = forward_direct(g, 1, 0, mode, out, pick);
        if (!ds) gr->pending = key; /* only a step that ran through is a shape worth capturing */
        return ds;
    }
    /* capture: the appends' host half runs now, their kernels when the graph is launched */
    if (cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        return graph_fallback(g, "cudaStreamBeginCapture failed", mode, out, pick);
    int done = 0;
    const tqkv_status qs = forward_queue(g, 1, 0, mode, out, pick, &done);
    cudaGraph_t graph = NULL;
    const cudaError_t ce = cudaStreamEndCapture(g->stream, &graph);
    if (qs || ce != cudaSuccess || !graph) {
        if (graph) cudaGraphDestroy(graph);
        (void)cudaGetLastError();
        if (forward_undo(g, done, 1)) { /* nothing ran: back to the step's start */
            g->broken = 1;
            return tqkv_fail(TQKV_ESTATE, "decode step: undoing a failed capture failed");
        }
        return graph_fallback(g, qs ? tqkv_last_error() : cudaGetErrorString(ce), mode, out, pick);
    }
    /* Update in place only where the topology is the same (rows, logits and pick or not
     * unchanged: only grids, copy sizes and pointers moved); anything else, or a refused
     * update, instantiates anew. */
    if (gr->exec && (key.rows != gr->key.rows || key.logits != gr->key.logits ||
                     (key.pick != 0) != (gr->key.pick != 0))) {
        cudaGraphExecDestroy(gr->exec);
        gr->exec = NULL;
    }
    if (gr->exec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(gr->exec, graph, &info) == cudaSuccess) {
            gr->stats.updates++;
        } else {
            (void)cudaGetLastError();
            if (getenv("TQKV_CUDA_GRAPH_DEBUG"))
                fprintf(stderr, "tqkv: graph update refused (result %d): instantiating anew\n", (int)info.result);
            cudaGraphExecDestroy(gr->exec);
            gr->exec = NULL;
        }
    }
    cudaError_t ie = cudaSuccess;
    if (!gr->exec) ie = cudaGraphInstantiate(&gr->exec, graph, 0);
    cudaGraphDestroy(graph);
    if (ie != cudaSuccess) {
        gr->exec = NULL;
        if (forward_undo(g, done, 1)) {
            g->broken = 1;
            return tqkv_fail(TQKV_ESTATE, "decode step: undoing a failed capture failed");
        }
        return graph_fallback(g, cudaGetErrorString(ie), mode, out, pick);
    }
    gr->key = key;
    gr->stats.captures++;
    st = ck(cudaGraphLaunch(gr->exec, g->stream), "decode graph launch");
    if (st) forward_fail(g, done, 1);
    return st;
}

/* A decode step's device pick (model_cuda_decode_pick): host plan [rows], penalty tokens
 * [n_pen], record stride, and where the records go [rows, PICK_REC_WORDS(stride)]. */
typedef struct {
    const pick_row *plan;
    const int32_t  *pen;
    int             n_pen;
    int             stride;
    int32_t        *rec;
} pick_req;

/* forward_run's first half: the checks of the rows and tokens, every buffer the call needs
 * (scratch, decode attention workspace -> *attn_ws, logits, the pick's) and the token list,
 * RoPE rows and the pick's upload in the pinned buffers. Nothing queued reads them yet. */
static tqkv_status forward_prepare(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                                   int prefill, tqkv_logits_mode mode, float *logits,
                                   const pick_req *pk, size_t *attn_ws_out) {
    const tqkv_model *m = g->m;
    const tqkv_model_config *c = &m->cfg;
    const int R = g->rows, hd = c->head_dim, V = c->vocab_size,
              half = (c->rotary_dim ? c->rotary_dim : hd) / 2, RW = mc_rope_width(m);
    const model_arch_cuda_ops *ao = g->arch_ops;
    const int tok_limit = m->ops->token_limit ? m->ops->token_limit(m) : V;
    mc_rec *rc = &g->rec;
    memcpy(g->off, tqkv_cuda_kv_offsets(g->kv[g->kv0]), sizeof(int) * (size_t)R);
    if (g->broken)
        return tqkv_fail(TQKV_ESTATE, "forward: an earlier forward failed midway and left rows it "
                         "could not undo; reset the state");
    if (rc->n_lin) { /* src/model/arch/qwen35/graph.c's checks, on the device rows */
        if (rc->spec_active != tqkv_cuda_kv_spec_active(g->kv[g->kv0]))
            return tqkv_fail(TQKV_ESTATE, "forward: spec round open on the %s but not on the %s",
                             rc->spec_active ? "recurrent rows" : "KV rows",
                             rc->spec_active ? "KV rows" : "recurrent rows");
        for (int r = 0; r < R; r++)
            if (rc->tokens[r] != g->off[r])
                return tqkv_fail(TQKV_ESTATE, "forward: row %d: recurrent state has absorbed %d "
                                 "tokens, its KV rows hold %d (recurrent rows cannot be trimmed; "
                                 "row operations must apply to both)", r, rc->tokens[r], g->off[r]);
    }
    for (int r = 0; r < R; r++) {
        if (lengths && lengths[r] != n)
            return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: padded prefill (row %d length %d "
                             "!= %d) is not supported on the device", r, lengths[r], n);
        if (prefill && g->off[r] != 0)
            return tqkv_fail(TQKV_ESTATE, "prefill: row %d already holds %d tokens (reset the "
                             "state or use extend)", r, g->off[r]);
        for (int j = 0; j < n; j++) {
            int32_t t = tokens[(size_t)r * n + j];
            if (t < 0 || t >= tok_limit)
                return tqkv_fail(TQKV_ERANGE, "forward: token %d at row %d position %d outside "
                                 "vocab %d", t, r, j, V);
        }
    }
    const size_t T = (size_t)R * n;
    const int as_decode = !prefill && n > 1 && g->p.extend_as_decode; /* verification window */
    /* decode logits land in the pinned staging buffer (a graph's copy needs a fixed,
     * pinned target), others straight in the caller's (a pageable copy waits for itself) */
    const int copy = mode != TQKV_LOGITS_NONE && logits;
    const size_t pick_in = pk ? (size_t)R * sizeof(pick_row) + (size_t)pk->n_pen * sizeof(int32_t) : 0;
    tqkv_status st = mc_ensure_scratch(g, T, T);
    size_t attn_ws = 0; /* decode attention: its workspace need, the graph key's launch shape */
    if (!st && (n == 1 || as_decode)) {
        attn_ws = aws_need(g, g->off, n);
        st = ensure_aws_bytes(g, attn_ws);
    }
    if (!st && mode != TQKV_LOGITS_NONE) st = mc_ensure_logits(g, mode == TQKV_LOGITS_ALL ? T : (size_t)R);
    if (!st && copy && n == 1) st = mc_ensure_hlogits(g, (size_t)R);
    if (!st && pk) st = mc_ensure_pick(g, pick_in, (size_t)R * PICK_REC_WORDS(pk->stride));
    if (!st && rc->spec_active) st = mc_rec_spec_reserve(g, n);
    if (!st && ao && ao->prepare) st = ao->prepare(g);
    if (st) return st;

    /* token list [T, 3] (id, row, column) and rope tables, in the pinned buffers the
     * queue uploads from */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) {
            const size_t t = (size_t)r * n + j;
            g->h_tinfo[t * 3] = tokens[t];
            g->h_tinfo[t * 3 + 1] = r;
            g->h_tinfo[t * 3 + 2] = j;
            if (ao && ao->rope_row) { /* the architecture's own tables */
                ao->rope_row(m, g->off[r] + j, g->h_rope + t * RW);
            } else {
                ops_rope_table(g->off[r] + j, m->inv_freq, half, g->h_rope + t * hd,
                               g->h_rope + t * hd + half);
            }
            /* the recurrent rows after this token go to snapshot slot steps + j + 1 */
            g->h_slot[t] = rc->spec_active ? rc->spec_steps[r] + j + 1 : -1;
        }
    /* the pick's plan and penalty tokens: one copy, ahead of the step in stream order */
    if (pk) {
        memcpy(g->h_pick_in, pk->plan, (size_t)R * sizeof(pick_row));
        if (pk->n_pen)
            memcpy((char *)g->h_pick_in + (size_t)R * sizeof(pick_row), pk->pen,
                   (size_t)pk->n_pen * sizeof(int32_t));
        st = ck(cudaMemcpyAsync(g->pick_in, g->h_pick_in, pick_in, cudaMemcpyHostToDevice, g->stream),
                "pick upload");
        if (st) return st;
    }
    *attn_ws_out = attn_ws;
    return TQKV_OK;
}

tqkv_status mc_forward_prepare(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                               int prefill, tqkv_logits_mode mode, size_t *attn_ws) {
    return forward_prepare(g, tokens, lengths, n, prefill, mode, NULL, NULL, attn_ws);
}

tqkv_status mc_forward_finish(model_cuda *g, int n) {
    const model_arch_cuda_ops *ao = g->arch_ops;
    mc_rec *rc = &g->rec;
    for (int r = 0; r < g->rows && rc->n_lin; r++) { /* rec_advance */
        rc->tokens[r] += n;
        if (rc->spec_active) rc->spec_steps[r] += n;
    }
    /* bounded sliding layers (after the forward, not in a spec round); their copies are
     * queued after the logits' and waited for by the next call */
    if (!ao || !ao->drop_oldest || tqkv_cuda_kv_spec_active(g->kv[g->kv0])) return TQKV_OK;
    const tqkv_status st = ao->drop_oldest(g);
    if (st) g->broken = 1; /* the layers may be out of step */
    return st;
}

/* model_cuda_forward's body; logits may be NULL with mode LAST when pk is set (the pick
 * alone). Arguments are checked by the callers. */
static tqkv_status forward_run(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                               int prefill, tqkv_logits_mode mode, float *logits, const pick_req *pk) {
    const int R = g->rows, V = g->m->cfg.vocab_size;
    const int copy = mode != TQKV_LOGITS_NONE && logits;
    size_t attn_ws = 0; /* decode attention: its workspace need, the graph key's launch shape */
    tqkv_status st = forward_prepare(g, tokens, lengths, n, prefill, mode, logits, pk, &attn_ws);
    if (st) return st;
    const int as_decode = !prefill && n > 1 && g->p.extend_as_decode; /* verification window */
    const int pick = pk ? pk->stride : 0;
    float *out = !copy ? NULL : n == 1 ? g->h_logits : logits;
    if (n == 1 && R > 0 && g->graph.enabled) {
        st = forward_decode_graph(g, mode, attn_ws, out, pick);
    } else {
        if (n == 1) g->graph.stats.direct++;
        st = forward_direct(g, n, as_decode, mode, out, pick);
    }
    /* one wait per call: the logits are on the host and the pinned buffers free again */
    const tqkv_status ss = ck(cudaStreamSynchronize(g->stream), "forward");
    if (!st) st = ss;
    if (ss) g->broken = 1; /* what ran of the step is unknown */
    if (!st) st = mc_forward_finish(g, n);
    if (!st && out && out == g->h_logits) memcpy(logits, g->h_logits, (size_t)R * V * sizeof(float));
    if (!st && pk) memcpy(pk->rec, g->h_pick_rec, (size_t)R * PICK_REC_WORDS(pk->stride) * sizeof(int32_t));
    return st;
}

extern "C" tqkv_status model_cuda_forward(model_cuda *g, const int32_t *tokens, const int *lengths,
                                          int n, int prefill, tqkv_logits_mode mode, float *logits) {
    if (n < 1) return tqkv_fail(TQKV_EINVAL, "forward: n must be >= 1, got %d", n);
    if ((unsigned)mode > TQKV_LOGITS_ALL || (mode != TQKV_LOGITS_NONE && !logits))
        return tqkv_fail(TQKV_EINVAL, "forward: bad logits mode or NULL logits");
    return forward_run(g, tokens, lengths, n, prefill, mode, logits, NULL);
}

extern "C" tqkv_status model_cuda_decode_pick(model_cuda *g, const int32_t *tokens, const pick_row *plan,
                                              const int32_t *pen, int n_pen, int stride, float *logits,
                                              int32_t *rec) {
    const int R = g->rows, V = g->m->cfg.vocab_size;
    if (!tokens || !plan || !rec || n_pen < 0 || (n_pen && !pen) || stride < 1 || stride > PICK_TOP_K_MAX)
        return tqkv_fail(TQKV_EINVAL, "device pick: NULL argument, or stride %d not in [1, %d]",
                         stride, PICK_TOP_K_MAX);
    for (int r = 0; r < R; r++) {
        const pick_row *p = &plan[r];
        const int pick = p->mode == PICK_GREEDY || p->mode == PICK_TOP_K;
        if ((p->mode != PICK_NONE && !pick) ||
            (p->mode == PICK_TOP_K && (p->k < 1 || p->k > stride || p->k >= V ||
                                       !(p->temp > 0 && isfinite(p->temp)))) ||
            (pick && p->pen_n > 0 && !(p->penalty > 0 && isfinite(p->penalty))) || p->pen_n < 0 ||
            p->pen_off < 0 || p->pen_n > n_pen - p->pen_off)
            return tqkv_fail(TQKV_EINVAL, "device pick: row %d: bad plan (mode %d, k %d of stride %d, "
                             "penalty tokens %d at %d of %d)", r, p->mode, p->k, stride, p->pen_n,
                             p->pen_off, n_pen);
    }
    for (int i = 0; i < n_pen; i++)
        if (pen[i] < 0 || pen[i] >= V)
            return tqkv_fail(TQKV_ERANGE, "device pick: penalty token %d outside vocab %d", pen[i], V);
    const pick_req pk = {plan, pen, n_pen, stride, rec};
    return forward_run(g, tokens, NULL, 1, 0, TQKV_LOGITS_LAST, logits, &pk);
}

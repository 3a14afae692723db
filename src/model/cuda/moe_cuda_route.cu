/*
 * src/model/cuda/moe_cuda_route.cu - the device experts' routing (part of moe_cuda.cu's
 * sparse layer; the table there lists the steps).
 * Owns: the router, route and place kernels (and the router's fused tail that routes and
 * places at decode sizes), the host side of one call's routing (the grouped GEMMs' bounds,
 * or the exact ones read back), the shared expert's gate launch, and the switches the
 * routing and the GEMMs' form read (TQKV_MOE_GROUPED, the fused tail, TQKV_MOE_ROUTE_FAST,
 * TQKV_MOE_ROUTER_WIDE, TQKV_MOE_FOLD_GATHER, TQKV_MOE_FOLD_NORM), and mc_moe_route_probe (one
 * routing, tests).
 * Must not: let a token's picks depend on the other tokens of the call (a warp per token,
 * ties to the lower index: moe.c's moe_route_token).
 */
#include <cuda_runtime.h>
#include <math.h>

extern "C" {
#include "util/common.h"
}
#include "util/env_switch.h"
#include "model/cuda/model_cuda_impl.h"
#include "model/cuda/moe_cuda.h"
#include "model/cuda/moe_cuda_impl.cuh"
#include "model/ops/gemm_cuda.h"
#include "model/ops/ops_cuda.cuh"

// ---------------------------------------------------------------------------
// switches
// ---------------------------------------------------------------------------

/* The grouped GEMMs: TQKV_MOE_GROUPED (0: off), read at the first use; the setter takes no
 * -1 (any nonzero is on). */
static env_switch g_grouped = ENV_SWITCH("TQKV_MOE_GROUPED");

extern "C" void mc_moe_set_grouped(int on) { env_switch_set(&g_grouped, on ? 1 : 0); }

int mc_moe_grouped_on(void) { return env_switch_get(&g_grouped); }

/* The routing fused into the router's last block at decode sizes (mc_moe_set_fused). */
static int g_fused = 1;

extern "C" void mc_moe_set_fused(int on) { g_fused = on ? 1 : 0; }

/* The routing's fast picks and one token's direct placement: TQKV_MOE_ROUTE_FAST (0: off),
 * read at the first use; the setter's -1 goes back to the environment. */
static env_switch g_route_fast = ENV_SWITCH("TQKV_MOE_ROUTE_FAST");

extern "C" void mc_moe_set_route_fast(int on) { env_switch_set(&g_route_fast, on); }

static int route_fast_on(void) { return env_switch_get(&g_route_fast); }

/* The router with its tail as a block per expert at few tokens: TQKV_MOE_ROUTER_WIDE (0: off),
 * as g_route_fast. */
static env_switch g_router_wide = ENV_SWITCH("TQKV_MOE_ROUTER_WIDE");

extern "C" void mc_moe_set_router_wide(int on) { env_switch_set(&g_router_wide, on); }

static int router_wide_on(void) { return env_switch_get(&g_router_wide); }

/* One token's gather folded into the router's block per expert: TQKV_MOE_FOLD_GATHER (0: off),
 * as g_route_fast. */
static env_switch g_fold_gather = ENV_SWITCH("TQKV_MOE_FOLD_GATHER");

extern "C" void mc_moe_set_fold_gather(int on) { env_switch_set(&g_fold_gather, on); }

static int fold_gather_on(void) { return env_switch_get(&g_fold_gather); }

/* The residual norm after a sparse layer of the common graph folded into its combine
 * (moe_cuda.cu's mc_moe_block_queue): TQKV_MOE_FOLD_NORM (0: off), as g_route_fast. */
static env_switch g_fold_norm = ENV_SWITCH("TQKV_MOE_FOLD_NORM");

extern "C" void mc_moe_set_fold_norm(int on) { env_switch_set(&g_fold_norm, on); }

extern "C" int mc_moe_folds_norm(const moe_shape *sh) {
    return env_switch_get(&g_fold_norm) && sh->hidden <= MOE_FOLD_H_MAX;
}

/* The experts' activation folded into the grouped gate|up GEMM's epilogue (moe_cuda.cu's
 * experts_queue): TQKV_MOE_FOLD_ACT (0: off), as g_route_fast. */
static env_switch g_fold_act = ENV_SWITCH("TQKV_MOE_FOLD_ACT");

extern "C" void mc_moe_set_fold_act(int on) { env_switch_set(&g_fold_act, on); }

int mc_moe_fold_act_on(void) { return env_switch_get(&g_fold_act); }

static unsigned long g_fold_act_runs; /* the folded launches queued (tests) */

void mc_moe_fold_act_count(void) { __atomic_add_fetch(&g_fold_act_runs, 1, __ATOMIC_RELAXED); }

extern "C" unsigned long mc_moe_fold_act_runs(void) {
    return __atomic_load_n(&g_fold_act_runs, __ATOMIC_RELAXED);
}

// ---------------------------------------------------------------------------
// routing kernels
// ---------------------------------------------------------------------------

/* Where the routing writes (moe_route_token, moe_place_block) and, for the router's fused
 * tail, the counter of its finished blocks (NULL: no tail; zero between launches). */
struct moe_route_out {
    int E, K, norm;
    int fast;                   /* the picks by warp reductions, one token placed directly
                                 * (mc_moe_set_route_fast) */
    const float *scale;         /* [E] the weights' factors, or NULL */
    int32_t *sel, *wbits;       /* [T, K] */
};
struct moe_place_out {
    int P, K, E, G;
    int32_t *groups, *tok, *pair, *count, *back;
};
/* One token's gather folded into the router (moe_router_wide_kernel; xg NULL: none): every
 * pair's row is the token's, xg [K, H] = xn [0] and xf its GEMM split, as moe_gather_kernel. */
struct moe_gather_one {
    const float *xn;            /* [1, H] the experts' input */
    float *xg;                  /* [K, H] */
    uint16_t *xf;               /* [parts, K, H], or NULL */
    int parts;
};
struct moe_tail {
    int *done;                  /* NULL: the router alone */
    moe_route_out r;
    moe_place_out p;
    moe_gather_one g1;          /* moe_router_wide_kernel only */
};

/* The router's fused tail: at most this many pairs (P = T K), and its block size. */
#define MOE_FUSED_P 256
/* The most tokens the router's block-per-expert form takes (moe_router_wide_kernel). */
#define MOE_WIDE_T 8
constexpr int MOE_TAIL_THREADS = 128;
constexpr int MOE_NJ = MOE_CUDA_E_MAX / 32; /* a lane's experts in the routing */

/* (v, i) the better of two candidates: the larger value, ties to the lower index, i < 0 none. */
__device__ __forceinline__ void route_better(float &v, int &i, float ov, int oi) {
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) v = ov, i = oi;
}

/* Lane 0: ps[0] + ps[1] + ... + ps[E - 1] in that order from 0 (float32). ps 16-byte aligned,
 * [E_MAX]; the next 32 values are loaded (float4) before the current 32 are added. */
__device__ __forceinline__ float route_sum(const float *ps, int E) {
    const float4 *q = reinterpret_cast<const float4 *>(ps);
    float4 c[8];
#pragma unroll
    for (int u = 0; u < 8; u++) c[u] = q[u];
    float a = 0.0f;
    for (int e0 = 0; e0 < E; e0 += 32) {
        float4 n[8];
        const bool more = e0 + 32 < E;
#pragma unroll
        for (int u = 0; u < 8; u++) n[u] = more ? q[(e0 + 32) / 4 + u] : c[u];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const float v[4] = {c[u].x, c[u].y, c[u].z, c[u].w};
#pragma unroll
            for (int w = 0; w < 4; w++)
                if (e0 + 4 * u + w < E) a = __fadd_rn(a, v[w]);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) c[u] = n[u];
    }
    return a;
}

/* One pick (every lane gets it): the largest p not taken, ties to the lower expert, (bv, bi)
 * = (0, -1) when none is left. Lane l holds experts l + 32 j. The xor butterfly of (value,
 * index) pairs, then lane 0's. */
template <int NJ>
__device__ __forceinline__ void route_pick_pairs(const float (&p)[NJ], unsigned taken, int E,
                                                 float &bv, int &bi) {
    const int lane = threadIdx.x & 31;
    bv = 0.0f, bi = -1;
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E && !((taken >> j) & 1u)) route_better(bv, bi, p[j], lane + 32 * j);
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        route_better(bv, bi, ov, oi);
    }
    bv = __shfl_sync(0xffffffffu, bv, 0); /* lane 0's pick, as the shared-memory version took */
    bi = __shfl_sync(0xffffffffu, bi, 0);
}

/* route_pick_pairs' pick while every p is a non-negative number (sign bit clear, not NaN:
 * then the unsigned order of the bits is the float order, and equal bits are equal floats,
 * so (value desc, index asc) is a total order and both give its first): the largest bits
 * + 1 (0: none) by one warp reduction, the lowest expert with them by another. */
template <int NJ>
__device__ __forceinline__ void route_pick_redux(const float (&p)[NJ], unsigned taken, int E,
                                                 float &bv, int &bi) {
    const int lane = threadIdx.x & 31;
    unsigned best = 0;
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E && !((taken >> j) & 1u)) best = max(best, __float_as_uint(p[j]) + 1u);
    const unsigned m = __reduce_max_sync(0xffffffffu, best);
    unsigned id = 0xffffffffu;
#pragma unroll
    for (int j = NJ - 1; j >= 0; j--) /* the lane's lowest with the best bits */
        if (lane + 32 * j < E && !((taken >> j) & 1u) && __float_as_uint(p[j]) + 1u == m)
            id = (unsigned)(lane + 32 * j);
    const unsigned w = __reduce_min_sync(0xffffffffu, id);
    bv = m ? __uint_as_float(m - 1u) : 0.0f;
    bi = m ? (int)w : -1;
}

/* Token t's routing (one warp; l: its logits [E], read past L1 as the fused tail needs; ps:
 * the warp's [E_MAX] floats of 16-byte aligned shared scratch), moe.c's moe_route_token step
 * for step (float32; the softmax's sum in expert order on lane 0, exp rounded from double:
 * within an ulp of glibc's expf (0.502 ulp), so a weight may differ from the CPU's in its
 * last bit; each pick the largest probability not taken, ties to the lower index), then its
 * K picks sorted by ascending expert (the combine's order): sel [T, K] and the weights' bits
 * wbits [T, K]. Lane l holds experts l + 32 j (j < E_MAX / 32: logits, probabilities and
 * taken flags in registers), pick k ends on lane k, which loads its scale at once and writes
 * at its rank among the picks' experts: *ms, *rank (lane k < K; others -1, 0). Every lane
 * sees each pick, so the renormalising sum runs in the loop (pick order, from 0: the same
 * additions as summing lane 0 .. K - 1 after it). */
template <int NJ>
__device__ void moe_route_token(const float *l, float *ps, const moe_route_out &o, size_t t,
                                int *ms_out, int *rank_out) {
    static_assert(NJ % 4 == 0 && 32 * NJ <= MOE_CUDA_E_MAX, "a lane's experts: groups of 4");
    const int lane = threadIdx.x & 31, E = o.E, K = o.K;
    float p[NJ];
#pragma unroll
    for (int j = 0; j < NJ; j++) p[j] = lane + 32 * j < E ? __ldcg(l + lane + 32 * j) : 0.0f;
    float mx = __ldcg(l);
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E) mx = p[j] > mx ? p[j] : mx;
    for (int off = 16; off > 0; off >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, mx, off);
        mx = v > mx ? v : mx;
    }
    /* exp and division four experts a lane at a time, unguarded inside a group (the
     * independent chains overlap; values past E are never used), groups past E skipped */
#pragma unroll
    for (int j0 = 0; j0 < NJ; j0 += 4) {
        if (32 * j0 >= E) break; /* uniform over the warp */
#pragma unroll
        for (int j = j0; j < j0 + 4; j++) p[j] = (float)exp((double)__fsub_rn(p[j], mx));
    }
#pragma unroll
    for (int j = 0; j < NJ; j++)
        if (lane + 32 * j < E) ps[lane + 32 * j] = p[j];
    __syncwarp();
    const float a = lane == 0 ? route_sum(ps, E) : 0.0f;
    const float sum = __shfl_sync(0xffffffffu, a, 0);
    bool num = true;          /* this lane's probabilities: non-negative numbers */
#pragma unroll
    for (int j0 = 0; j0 < NJ; j0 += 4) {
        if (32 * j0 >= E) break;
#pragma unroll
        for (int j = j0; j < j0 + 4; j++) {
            p[j] = __fdiv_rn(p[j], sum);
            if (lane + 32 * j < E) num = num && __float_as_uint(p[j]) <= 0x7f800000u;
        }
    }
    const bool redux = o.fast && __all_sync(0xffffffffu, num);
    unsigned taken = 0;       /* bit j: expert lane + 32 j picked */
    int ms = -1;              /* lane k < K: pick k's expert, weight, scale */
    float mw = 0.0f, msc = 1.0f, tot = 0.0f;
    for (int k = 0; k < K; k++) {
        float bv;
        int bi;
        if (redux) route_pick_redux(p, taken, E, bv, bi);
        else route_pick_pairs(p, taken, E, bv, bi);
        tot = __fadd_rn(tot, bv);
        if (bi >= 0 && lane == (bi & 31)) taken |= 1u << (bi >> 5);
        if (lane == k) {
            ms = bi, mw = bv;
            if (o.scale) msc = o.scale[bi];
        }
    }
    if (o.norm) mw = __fdiv_rn(mw, tot);
    if (o.scale) mw = __fmul_rn(mw, msc);
    int rank = 0;             /* picks with a lower expert (distinct experts) */
#pragma unroll 4
    for (int k = 0; k < K; k++) rank += __shfl_sync(0xffffffffu, ms, k) < ms;
    if (lane < K) {
        o.sel[t * K + rank] = ms;
        o.wbits[t * K + rank] = __float_as_int(mw);
    }
    *ms_out = ms, *rank_out = lane < K ? rank : 0;
    __syncwarp();             /* ps is read before the warp's next token writes it */
}

/* moe_place_block's outputs for one token (P = K pairs; one warp, lane k < K holding a pick:
 * its expert ms, valid and distinct, at rank `rank` among them): sel's K experts ascend,
 * so pair i is expert sel[i]'s only one, at place i (offset = experts with pairs before it =
 * i); group i = (i, 1, sel[i], 0); count 1 for the picked experts, else 0; K used groups of
 * at most 1 row. The same integers without the block's counting. */
__device__ void moe_place_one(int ms, int rank, const moe_place_out &o) {
    __shared__ unsigned picked[MOE_CUDA_E_MAX / 32]; /* bit l of word w: expert 32 w + l */
    const int lane = threadIdx.x & 31, K = o.K, E = o.E;
    for (int w = lane; w < MOE_CUDA_E_MAX / 32; w += 32) picked[w] = 0;
    __syncwarp();
    if (lane < K) atomicOr(&picked[ms >> 5], 1u << (ms & 31));
    __syncwarp();
    for (int j = lane; j < E; j += 32) o.count[j] = (int32_t)((picked[j >> 5] >> (j & 31)) & 1u);
    if (lane < K) {
        o.tok[rank] = 0;
        o.pair[rank] = rank;
        int32_t *gr = o.groups + 4 * (size_t)rank;
        gr[0] = rank, gr[1] = 1, gr[2] = ms, gr[3] = 0;
    }
    for (int j = K + lane; j < o.G; j += 32)
        o.groups[4 * j] = o.groups[4 * j + 1] = o.groups[4 * j + 2] = o.groups[4 * j + 3] = 0;
    if (lane == 0) o.back[0] = K, o.back[1] = K > 0 ? 1 : 0;
}

/* moe_place_kernel's outputs from one block of MOE_TAIL_THREADS (P <= MOE_FUSED_P pairs of
 * sel [P], written by this block before a __syncthreads): the per-expert counts, their
 * exclusive prefix sums over experts (pair offsets, group indices), each pair's place
 * (offset + pairs of its expert before it), the groups, count, back: the same integers. */
__device__ void moe_place_block(const int32_t *sel, const moe_place_out &o) {
    constexpr int NT = MOE_TAIL_THREADS, NWP = NT / 32, C = MOE_CUDA_E_MAX / NT;
    __shared__ int hist[MOE_CUDA_E_MAX], offs[MOE_CUDA_E_MAX], gix[MOE_CUDA_E_MAX];
    __shared__ int ssel[MOE_FUSED_P], wpo[NWP], wpn[NWP], wpm[NWP];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = o.E, P = o.P;
    for (int j = tid; j < E; j += NT) hist[j] = 0;
    for (int i = tid; i < P; i += NT) ssel[i] = sel[i];
    __syncthreads();
    for (int i = tid; i < P; i += NT) atomicAdd(&hist[ssel[i]], 1);
    __syncthreads();
    int so = 0, sn = 0, mx = 0; /* this thread's experts C tid .. C tid + C - 1 */
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int j = C * tid + c, h = j < E ? hist[j] : 0;
        so += h, sn += h > 0, mx = max(mx, h);
    }
    int io = so, in = sn;       /* inclusive scans over the warp */
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, io, d), b = __shfl_up_sync(0xffffffffu, in, d);
        if (lane >= d) io += a, in += b;
    }
#pragma unroll
    for (int m = 16; m; m >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, m));
    if (lane == 31) wpo[warp] = io, wpn[warp] = in;
    if (lane == 0) wpm[warp] = mx;
    __syncthreads();
    int ro = io - so, rn = in - sn, used = 0, most = 0;
#pragma unroll
    for (int w = 0; w < NWP; w++) {
        if (w < warp) ro += wpo[w], rn += wpn[w];
        used += wpn[w];
        most = max(most, wpm[w]);
    }
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int j = C * tid + c;
        if (j >= E) break;
        offs[j] = ro, gix[j] = rn;
        ro += hist[j], rn += hist[j] > 0;
    }
    __syncthreads();
    for (int i = tid; i < P; i += NT) {
        const int e = ssel[i];
        int before = 0;           /* its expert's pairs before it (token ascending) */
        for (int j = 0; j < i; j++) before += ssel[j] == e;
        const int p = offs[e] + before;
        o.tok[p] = i / o.K;
        o.pair[i] = p;
    }
    for (int j = tid; j < E; j += NT) {
        o.count[j] = hist[j];
        if (hist[j] > 0) {
            int32_t *gr = o.groups + 4 * (size_t)gix[j];
            gr[0] = offs[j], gr[1] = hist[j], gr[2] = j, gr[3] = 0;
        }
    }
    for (int j = used + tid; j < o.G; j += NT)
        o.groups[4 * j] = o.groups[4 * j + 1] = o.groups[4 * j + 2] = o.groups[4 * j + 3] = 0;
    if (tid == 0) o.back[0] = used, o.back[1] = most;
}

/* The router's last block (after every block's logits, which it reads past L1): each token's
 * routing (a warp per token; NJ: a lane's experts, E <= 32 NJ) and the pairs' placement (one
 * token with fast routing: moe_place_one by its warp, else moe_place_block), then the
 * counter back to 0. */
template <int NJ>
__device__ void moe_tail_run(const float *logits, int T, const moe_tail &tl) {
    __shared__ int last, one;
    __shared__ __align__(16) float ps[MOE_TAIL_THREADS / 32][MOE_CUDA_E_MAX];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(tl.done, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int ms = -1, rank = 0;
    for (int t = warp; t < T; t += MOE_TAIL_THREADS / 32)
        moe_route_token<NJ>(logits + (size_t)t * tl.r.E, ps[warp], tl.r, (size_t)t, &ms, &rank);
    if (T == 1 && warp == 0) {  /* every pick valid (K <= E): the direct placement */
        const bool ok = __all_sync(0xffffffffu, lane >= tl.r.K || ms >= 0);
        if (lane == 0) one = tl.r.fast && ok;
    }
    __syncthreads();
    if (T == 1 && one) {
        if (warp == 0) moe_place_one(ms, rank, tl.p);
    } else {
        moe_place_block(tl.r.sel, tl.p);
    }
    if (threadIdx.x == 0) *tl.done = 0;  /* (stream order publishes it to the next launch) */
}

/* A lane's first U values of the weight row b (k = lane, lane + 32, ..., 0 past H), which a
 * router loads before its grid dependency wait: no kernel writes the weights, so their trip
 * from memory overlaps the kernel before. */
template <int U>
__device__ __forceinline__ void router_row_first(const float *__restrict__ b, int H, float (&b0)[U]) {
    mc_load_strided<U>(b0, b, threadIdx.x & 31, 32, H);
}
/* Lane 0: the logit a . b over H (every lane of the warp calls it; b0: router_row_first of
 * b): lane j sums k = j, j + 32, ... in order (double fma from 0), then a fixed xor butterfly
 * (16, 8, 4, 2, 1), rounded to float. bf16x: a rounded to bf16 first (the model's bf16_act,
 * as the CPU's product). A lane's k loaded U at a time, summed in order (the same sums for
 * any U). */
template <int U>
__device__ __forceinline__ float router_dot_pre(const float *__restrict__ a, const float *__restrict__ b,
                                                int H, int bf16x, const float (&b0)[U]) {
    const int lane = threadIdx.x & 31;
    double s = 0;
    for (int k0 = lane; k0 < H; k0 += 32 * U) {
        float va[U], vb[U];
        mc_load_strided<U>(va, a, k0, 32, H);
        if (k0 == lane) {
#pragma unroll
            for (int u = 0; u < U; u++) vb[u] = b0[u];
        } else {
            mc_load_strided<U>(vb, b, k0, 32, H);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (k0 + 32 * u >= H) break;
            const float v = bf16x ? __bfloat162float(__float2bfloat16_rn(va[u])) : va[u];
            s += (double)v * vb[u]; /* one fma.rn.f64 (contracted, as always here) */
        }
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return (float)s;
}

/* logits[t, e] = xr[t] . router[e] (router_dot_pre): one warp per (t, e). With tail.done, the
 * last block to finish also routes and places every token (moe_tail_run: route and place
 * kernels in this launch, at P <= MOE_FUSED_P). U = 64 at decode sizes (H = 2048: one round
 * of loads; 213 registers), U = 32 otherwise (114: twice the warps per SM for long prefills'
 * DFMA chains); the same sums. grid ceil(T E / 4), block 128. */
template <int U>
__global__ void __launch_bounds__(MOE_TAIL_THREADS)
moe_router_kernel(const float *__restrict__ xr, const float *__restrict__ rw, int T, int E, int H,
                  int bf16x, float *__restrict__ logits, const moe_tail tail) {
    const size_t gw = (size_t)blockIdx.x * 4 + (threadIdx.x >> 5);
    const size_t t = gw / E, e = gw % E;
    float b0[U];              /* the weights' first values: no kernel writes them */
    if (gw < (size_t)T * E) router_row_first<U>(rw + e * H, H, b0);
    cuda_pdl_wait(); /* programmatic (route_launch's pdl): the norm that wrote xr has completed */
    cuda_pdl_trigger();
    if (gw < (size_t)T * E) {
        const float s = router_dot_pre<U>(xr + t * H, rw + e * H, H, bf16x, b0);
        if ((threadIdx.x & 31) == 0) logits[gw] = s;
    }
    if (tail.done) moe_tail_run<MOE_NJ>(logits, T, tail); /* uniform over the grid */
}

/* moe_router_kernel with its tail at few tokens (T <= MOE_WIDE_T; mc_moe_set_router_wide):
 * block b the logits [t, e] of expert e = b mod E for its 4 tokens t = 4 (b / E) + w, a warp
 * w each (the same router_dot_pre: the same bits). The E dot products of a token spread over E
 * SMs instead of E / 4, and the expert's row goes from DRAM once to the block's warps (L1)
 * instead of once a token. The tail's routing holds NJ experts a lane (NJ = 4 up to 128
 * experts: a quarter of the registers, code and guarded steps of MOE_NJ; the ones it leaves
 * out were never used). With tail.g1.xg (one token) the blocks' warps 1 .. 3, idle in the
 * dot, also write the experts' gathered rows (moe_gather_kernel's stores: its launch is then
 * left out).
 * grid E ceil(T / 4), block 128. */
template <int NJ>
__global__ void __launch_bounds__(MOE_TAIL_THREADS)
moe_router_wide_kernel(const float *__restrict__ xr, const float *__restrict__ rw, int T, int E,
                       int H, int bf16x, float *__restrict__ logits, const moe_tail tail) {
    const int e = (int)(blockIdx.x % (unsigned)E);
    const int t = (int)(blockIdx.x / (unsigned)E) * (MOE_TAIL_THREADS / 32) + (threadIdx.x >> 5);
    float b0[64];             /* expert e's first weights: no kernel writes them */
    if (t < T) router_row_first<64>(rw + (size_t)e * H, H, b0);
    cuda_pdl_wait(); /* programmatic (route_launch's pdl): the norm that wrote xr has completed */
    cuda_pdl_trigger();
    if (tail.g1.xg && threadIdx.x >= 32) { /* T = 1: tok [p] = 0 for every pair, whatever the
                                            * picks; warps 1 .. 3 (idle in the dot: t >= T), so
                                            * warp 0's dot does not wait behind these loads */
        constexpr unsigned NT = MOE_TAIL_THREADS - 32;
        const unsigned n = (unsigned)tail.r.K * (unsigned)H; /* K H < 2^32 (route_launch) */
        for (unsigned i = blockIdx.x * NT + threadIdx.x - 32; i < n; i += gridDim.x * NT) {
            const float v = tail.g1.xn[i % (unsigned)H];
            tail.g1.xg[i] = v;
            if (tail.g1.xf) mc_split_store(tail.g1.xf, n, i, v, tail.g1.parts);
        }
    }
    if (t < T) { /* uniform over the warp */
        const float s = router_dot_pre<64>(xr + (size_t)t * H, rw + (size_t)e * H, H, bf16x, b0);
        if ((threadIdx.x & 31) == 0) logits[(size_t)t * E + e] = s;
    }
    moe_tail_run<NJ>(logits, T, tail);
}

/* Each token's routing (moe_route_token) as its own launch (P > MOE_FUSED_P). grid T, block 32. */
__global__ void moe_route_kernel(const float *__restrict__ logits, const moe_route_out o) {
    __shared__ __align__(16) float ps[MOE_CUDA_E_MAX];
    int ms, rank;
    moe_route_token<MOE_NJ>(logits + (size_t)blockIdx.x * o.E, ps, o, blockIdx.x, &ms, &rank);
}

/* The sum of every thread's v over a block of 256 (part: 8 ints of shared memory), to all. */
__device__ int block_sum256(int v, int *part) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* part may still be read from a previous call */
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    int a = 0;
    for (int w = 0; w < 8; w++) a += part[w];
    return a;
}

/* Expert e's pairs in pair order (token ascending): tok[p] = t and pair[t K + k] = p at
 * p = its offset (the pairs of the experts before it) + rank; its group, if it has pairs,
 * at the index of the experts with pairs before it. Every block counts all the pairs per
 * expert in shared memory first (integer adds: the same counts in any order). Block E - 1
 * also writes count [E], gives the groups from the used ones up to the bound G no rows,
 * and back[0..1] = used groups, most rows. groups [G, 4]; grid E, block 256. */
__global__ void moe_place_kernel(const int32_t *__restrict__ sel, int P, int K, int E, int G,
                                 int32_t *__restrict__ groups, int32_t *__restrict__ tok,
                                 int32_t *__restrict__ pair, int32_t *__restrict__ count,
                                 int32_t *__restrict__ back) {
    __shared__ int hist[MOE_CUDA_E_MAX], part[8];
    const int e = blockIdx.x, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int j = threadIdx.x; j < E; j += blockDim.x) hist[j] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&hist[sel[i]], 1);
    __syncthreads();
    int o = 0, n = 0; /* pairs and experts with pairs before e */
    for (int j = threadIdx.x; j < e; j += blockDim.x) o += hist[j], n += hist[j] > 0;
    const int off = block_sum256(o, part), gi = block_sum256(n, part), mine = hist[e];
    int base = off;
    for (int i0 = 0; i0 < P && mine; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x, f = i < P && sel[i] == e;
        const unsigned b = __ballot_sync(0xffffffffu, f);
        __syncthreads(); /* part is rewritten */
        if (lane == 0) part[wid] = __popc(b);
        __syncthreads();
        int before = 0, all = 0;
        for (int w = 0; w < 8; w++) {
            before += w < wid ? part[w] : 0;
            all += part[w];
        }
        if (f) {
            const int p = base + before + __popc(b & ((1u << lane) - 1u));
            tok[p] = i / K;
            pair[i] = p;
        }
        base += all;
    }
    if (threadIdx.x == 0 && mine > 0) {
        int32_t *gr = groups + 4 * (size_t)gi;
        gr[0] = off, gr[1] = mine, gr[2] = e, gr[3] = 0;
    }
    if (e != E - 1) return;
    const int used = gi + (mine > 0);
    int most = 0;
    for (int j = threadIdx.x; j < E; j += blockDim.x) {
        count[j] = hist[j];
        most = hist[j] > most ? hist[j] : most;
    }
    for (int j = used + (int)threadIdx.x; j < G; j += blockDim.x)
        groups[4 * j] = groups[4 * j + 1] = groups[4 * j + 2] = groups[4 * j + 3] = 0;
    for (int o2 = 16; o2 > 0; o2 >>= 1) most = max(most, __shfl_xor_sync(0xffffffffu, most, o2));
    __syncthreads();
    if (lane == 0) part[wid] = most;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < 8; w++) most = max(most, part[w]);
    back[0] = used, back[1] = most;
}

// ---------------------------------------------------------------------------
// the routing of one call
// ---------------------------------------------------------------------------

/* The routing's launches of T tokens xr [T, H] on stream s into logits [T, E] and idx
 * (IDX_*; G = min(E, T K) groups): the router with its fused tail (up to MOE_FUSED_P pairs,
 * done: the zeroed counter), a block per expert up to MOE_WIDE_T tokens (router_wide_on), or
 * the router, route and place launches. g1.xg: one token's gather, which the block per
 * expert folds in (fold_gather_on): *gathered 1 when it did (2: the block per expert ran
 * without it, 0: another form). pdl: the router launched programmatically (its route and
 * place launches, when separate, are plain). */
static tqkv_status route_launch(cudaStream_t s, const float *router, const float *scale,
                                int bf16x, int E, int K, int H, int norm, int T, const float *xr,
                                float *logits, int32_t *idx, int *done, int *gathered,
                                const moe_gather_one &g1, int pdl) {
    const size_t P = (size_t)T * K;
    const int G = E < (int)P ? E : (int)P;
    moe_tail tl;
    tl.r = moe_route_out{E, K, norm, route_fast_on(), scale, idx + IDX_SEL(E, P),
                         idx + IDX_WB(E, P)};
    tl.p = moe_place_out{(int)P, K, E, G, idx, idx + IDX_TOK(E), idx + IDX_PAIR(E, P),
                         idx + IDX_COUNT(E, P), idx + IDX_COUNT(E, P) + E};
    /* up to MOE_FUSED_P pairs (decode) the router's last block routes and places too */
    tl.done = g_fused && P <= MOE_FUSED_P ? done : NULL;
    tl.g1 = moe_gather_one{NULL, NULL, NULL, 0};
    const unsigned nb = (unsigned)(((size_t)T * E + 3) / 4);
    *gathered = 0;
    if (tl.done && T <= MOE_WIDE_T && router_wide_on()) {
        *gathered = 2;
        if (T == 1 && g1.xg && (size_t)K * H < (1u << 31) && fold_gather_on())
            tl.g1 = g1, *gathered = 1;
        const unsigned nw = (unsigned)E * (unsigned)((T + 3) / 4);
        cuda_pdl_launch(pdl, E <= 128 ? moe_router_wide_kernel<4> : moe_router_wide_kernel<MOE_NJ>,
                        dim3(nw), dim3(MOE_TAIL_THREADS), 0, s, xr, router, T, E, H, bf16x, logits, tl);
    } else {
        cuda_pdl_launch(pdl, P <= MOE_FUSED_P ? moe_router_kernel<64> : moe_router_kernel<32>,
                        dim3(nb), dim3(MOE_TAIL_THREADS), 0, s, xr, router, T, E, H, bf16x, logits, tl);
    }
    if (!tl.done) {
        moe_route_kernel<<<(unsigned)T, 32, 0, s>>>(logits, tl.r);
        moe_place_kernel<<<(unsigned)E, 256, 0, s>>>(idx + IDX_SEL(E, P), (int)P, K, E, G, idx,
                                                     idx + IDX_TOK(E), idx + IDX_PAIR(E, P),
                                                     idx + IDX_COUNT(E, P), idx + IDX_COUNT(E, P) + E);
    }
    return mc_ck(cudaGetLastError(), "experts routing");
}

/* The routing of T tokens on g's stream (route_launch): router logits, each token's picks,
 * the pairs grouped by expert (x->idx), and at one token with the grouped GEMMs maybe the
 * gather of xn into x->xg (and its split into xf, when not NULL; r->gathered says). r gets
 * the grouped GEMMs' bounds (decode: min(E, P) groups of at most T rows, no wait) or, above
 * GEMM_CUDA_SMALL_T tokens and for the per-expert path, the exact ones read back (one wait;
 * r->count then points at the experts' counts). A step being captured (decode at any row
 * count) always takes the bounds. */
tqkv_status mc_moe_route_queue(model_cuda *g, const mc_moe_layer *D, const moe_shape *sh,
                               mc_moe_state *x, const float *xr, const float *xn, uint16_t *xf,
                               int T, moe_routing *r) {
    const int E = sh->n_experts, K = sh->top_k, H = sh->hidden;
    const size_t P = (size_t)T * K;
    const cudaStream_t s = g->stream;
    const int per_expert = !mc_moe_grouped_on() || g->cublas;
    r->E = E, r->P = (int)P, r->G = E < (int)P ? E : (int)P, r->most = T, r->count = NULL;
    /* one token's gather in the router, for the grouped GEMMs (the bounds: no read-back) */
    const moe_gather_one g1{xn, per_expert ? NULL : x->xg, xf, g->gemm_parts};
    tqkv_status st = route_launch(s, D->router, D->scale, g->m->bf16_act, E, K, H, sh->norm_topk,
                                  T, xr, x->logits, x->idx, x->done, &r->gathered, g1, g->pdl);
    r->gathered = r->gathered == 1;
    if (st || (T <= GEMM_CUDA_SMALL_T && !per_expert)) return st;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    st = mc_ck(cudaStreamIsCapturing(s, &cs), "experts routing");
    if (!st && cs != cudaStreamCaptureStatusNone) { /* a decode step of many rows: the bounds */
        if (per_expert)
            return tqkv_fail(TQKV_ESTATE, "cuda forward: the experts' per-expert GEMMs cannot "
                             "be captured in a graph");
        return TQKV_OK;
    }
    if (!st) st = mc_ck(cudaMemcpyAsync(x->h_back, x->idx + IDX_COUNT(E, P), ((size_t)E + 2) * 4,
                                        cudaMemcpyDeviceToHost, s), "experts routing");
    if (!st) st = mc_ck(cudaStreamSynchronize(s), "experts routing");
    if (st) return st;
    r->G = x->h_back[E], r->most = x->h_back[E + 1];
    if (per_expert) r->count = x->h_back;
    return TQKV_OK;
}

/* The device buffers of one probe call (probe_run). */
typedef struct {
    float   *rw, *sc, *xr, *logits;
    int32_t *idx;
    int     *done;
} probe_bufs;

static tqkv_status probe_run(probe_bufs *b, cudaStream_t s, const mc_moe_probe *q, float *logits,
                             int32_t *idx, int *wide) {
    const size_t E = (size_t)q->E, H = (size_t)q->H, T = (size_t)q->T,
                 W = IDX_WORDS(E, T * (size_t)q->K);
    tqkv_status st = mc_dmalloc((void **)&b->rw, E * H * 4);
    if (!st) st = mc_dmalloc((void **)&b->xr, T * H * 4);
    if (!st) st = mc_dmalloc((void **)&b->logits, T * E * 4);
    if (!st) st = mc_dmalloc((void **)&b->idx, W * 4);
    if (!st) st = mc_dmalloc((void **)&b->done, sizeof(int));
    if (!st && q->scale) st = mc_dmalloc((void **)&b->sc, E * 4);
    if (!st) st = mc_ck(cudaMemcpyAsync(b->rw, q->router, E * H * 4, cudaMemcpyHostToDevice, s), "probe");
    if (!st) st = mc_ck(cudaMemcpyAsync(b->xr, q->xr, T * H * 4, cudaMemcpyHostToDevice, s), "probe");
    if (!st && q->scale)
        st = mc_ck(cudaMemcpyAsync(b->sc, q->scale, E * 4, cudaMemcpyHostToDevice, s), "probe");
    if (!st) st = mc_ck(cudaMemsetAsync(b->idx, 0, W * 4, s), "probe");
    if (!st) st = mc_ck(cudaMemsetAsync(b->logits, 0, T * E * 4, s), "probe");
    if (!st) st = mc_ck(cudaMemsetAsync(b->done, 0, sizeof(int), s), "probe");
    int form = 0;
    if (!st) st = route_launch(s, b->rw, b->sc, q->bf16x, q->E, q->K, q->H, q->norm, q->T, b->xr,
                               b->logits, b->idx, b->done, &form,
                               moe_gather_one{NULL, NULL, NULL, 0}, 0);
    *wide = form == 2;
    if (!st) st = mc_ck(cudaMemcpyAsync(logits, b->logits, T * E * 4, cudaMemcpyDeviceToHost, s), "probe");
    if (!st) st = mc_ck(cudaMemcpyAsync(idx, b->idx, W * 4, cudaMemcpyDeviceToHost, s), "probe");
    if (!st) st = mc_ck(cudaStreamSynchronize(s), "probe");
    return st;
}

extern "C" tqkv_status mc_moe_route_probe(const mc_moe_probe *q, float *logits, int32_t *idx,
                                          int *wide) {
    if (!q || !q->router || !q->xr || !logits || !idx || !wide || q->T < 1 || q->E < 1 || q->H < 1 ||
        q->K < 1 || q->K > q->E || q->E > MOE_CUDA_E_MAX || q->K > MOE_CUDA_K_MAX)
        return tqkv_fail(TQKV_EINVAL, "mc_moe_route_probe: bad shape");
    cudaStream_t s;
    tqkv_status st = mc_ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "probe");
    if (st) return st;
    probe_bufs b = {};
    st = probe_run(&b, s, q, logits, idx, wide);
    cudaStreamSynchronize(s);
    void *ps[] = {b.rw, b.sc, b.xr, b.logits, b.idx, b.done};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
    cudaStreamDestroy(s);
    return st;
}

void mc_moe_gate_queue(model_cuda *g, const float *xn, const float *sh_gate, int T, int H,
                       float *sg) {
    moe_router_kernel<32><<<(unsigned)((T + 3) / 4), MOE_TAIL_THREADS, 0, g->stream>>>(
        xn, sh_gate, T, 1, H, g->m->bf16_act, sg, moe_tail{});
}

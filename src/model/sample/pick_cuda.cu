/*
 * pick_cuda.cu - picking the next token on the device (see pick.h for the plan and the
 * records, pick_cuda.h for the call).
 * Owns: the pick kernel: one 1024-thread CTA per row applies the row's repetition penalty in
 * place, then either the greedy argmax or the exact top-k selection below.
 * Must not: round differently from the CPU sampler (IEEE division and multiplication only,
 * no fast math), or let a row's result depend on another row.
 *
 * Top-k (the CPU's top_k_ids on l / T: value desc, id asc). Keys: pick_key(l / T), an
 * unsigned order equal to the float order with -0.0 == +0.0. A radix select in 4 passes of
 * 8 bits (shared histograms, lanes of a warp with the same digit add once) finds the k-th
 * largest key K and how many of the keys equal to K are needed (`need`); pass 0 also
 * gathers the row's finiteness flags (a row that fails stops there). One ordered pass then
 * collects every key > K (fewer than k) and the `need` lowest ids whose key is K (a block
 * scan of each 1024-id chunk, in id order), and a bitonic sort of (key, ~id) puts the k
 * candidates in the CPU's order. Values come back as the penalized logits l (the host
 * divides by T again, to the same bits).
 * Greedy: each thread keeps its first best number (NaN skipped), then warp and block
 * reductions under (value desc, id asc); by default at up to 8 rows (pick_split_kernel) a
 * greedy row is split over a cluster of 8 CTAs and CTA 0 reduces their bests (the same
 * (id, value): the order is total), so the row is read by 8 SMs instead of one (18.8 ..
 * 21.7 us for one CTA on 128256 .. 151936 logits, Nsight Compute on an H100); a device
 * that refuses the cluster launch gets pick_kernel instead (split_launch).
 * The row is read with plain loads (no __restrict__ / read-only path): the same CTA wrote
 * its penalized logits at the start of the kernel.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

extern "C" {
#include "util/common.h"
}
#include "util/env_switch.h"
#include "model/sample/pick_cuda.h"

#define PICK_THREADS 1024
#define PICK_WARPS (PICK_THREADS / 32)
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------
// kernel
// ---------------------------------------------------------------------------

struct pick_smem {
    unsigned long long cand[PICK_TOP_K_MAX]; /* (key << 32) | ~id: larger sorts first */
    int      hist[256];
    int      wsum[2][PICK_WARPS];            /* per-warp counts of one chunk (double buffered) */
    float    bv[PICK_WARPS];                 /* greedy: each warp's best */
    int      bi[PICK_WARPS];
    unsigned flags;
    uint32_t prefix;
    int      remaining;
    int      n_gt;
};

/* a is a better greedy answer than b (id < 0: none) */
__device__ __forceinline__ bool greedy_better(float av, int ai, float bv, int bi) {
    return ai >= 0 && (bi < 0 || av > bv || (av == bv && ai < bi));
}

/* The warp's best (value, id) into lane 0. */
__device__ __forceinline__ void warp_best(float &bv, int &bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(FULL_MASK, bv, o);
        const int oi = __shfl_down_sync(FULL_MASK, bi, o);
        if (greedy_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

/* The block's first best (value, id) over ids first, first + step, ... (< V): each thread
 * loads U of its ids at a time and keeps its first best in ascending order (NaN skipped),
 * then the warp and block reductions; the result is in warp 0 (lane 0 after its warp_best). */
template <int U>
__device__ __forceinline__ void block_best(const float *l, int V, int first, int step,
                                           pick_smem &sh, float &bv, int &bi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    bv = 0.0f, bi = -1;
    for (int i0 = first; i0 < V; i0 += U * step) {
        float x[U];
#pragma unroll
        for (int u = 0; u < U; u++) x[u] = i0 + u * step < V ? l[i0 + u * step] : 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + u * step;
            if (i < V && !isnan(x[u]) && (bi < 0 || x[u] > bv)) {
                bv = x[u];
                bi = i;
            }
        }
    }
    warp_best(bv, bi);
    if (lane == 0) {
        sh.bv[warp] = bv;
        sh.bi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = sh.bv[lane];
        bi = sh.bi[lane];
        warp_best(bv, bi);
    }
}

__device__ void pick_greedy(const float *l, int V, pick_smem &sh, int32_t *rec,
                            int stride) {
    float bv;
    int bi;
    block_best<16>(l, V, threadIdx.x, PICK_THREADS, sh, bv, bi);
    if (threadIdx.x == 0) {
        rec[0] = 0;
        rec[1] = bi >= 0 ? 1 : 0;
        rec[2] = bi;
        rec[2 + stride] = __float_as_int(bv);
    }
}

/* Warp 0: the digit bin of the `remaining`-th largest key among those matching the prefix
 * (bins high to low, 8 per lane); updates sh.prefix / sh.remaining. */
__device__ void pick_find_bin(pick_smem &sh, int shift) {
    const int lane = threadIdx.x & 31;
    const int hi = 255 - 8 * lane; /* this lane's bins: hi, hi - 1, .., hi - 7 */
    const int rem = sh.remaining;
    __syncwarp(); /* every lane has read it before one lane writes it */
    int c = 0;
    for (int b = 0; b < 8; b++) c += sh.hist[hi - b];
    int inc = c;
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(FULL_MASK, inc, o);
        if (lane >= o) inc += t;
    }
    const int exc = inc - c;
    if (exc < rem && rem <= inc) { /* exactly one lane */
        int acc = exc, b = 0;
        for (; b < 7; b++) {
            if (acc + sh.hist[hi - b] >= rem) break;
            acc += sh.hist[hi - b];
        }
        sh.prefix |= (uint32_t)(hi - b) << shift;
        sh.remaining = rem - acc;
    }
}

__device__ void pick_top_k(const float *l, int V, int k, float temp, pick_smem &sh,
                           int32_t *rec, int stride) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        sh.flags = 0;
        sh.prefix = 0;
        sh.remaining = k;
    }
    // ---- radix select of the k-th largest key, 8 bits a pass
    uint32_t mask = 0;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        for (int b = tid; b < 256; b += PICK_THREADS) sh.hist[b] = 0;
        __syncthreads();
        const uint32_t prefix = sh.prefix;
        unsigned f = 0;
        for (int base = 0; base < V; base += PICK_THREADS) { /* whole warps every round */
            const int i = base + tid;
            int bin = 256;
            if (i < V) {
                const float x = l[i], v = __fdiv_rn(x, temp);
                const uint32_t key = pick_key(v);
                if (pass == 0) {
                    if (isnan(x)) f |= PICK_F_NAN;
                    else if (v == INFINITY) f |= PICK_F_POS_INF;
                    if (v > -INFINITY) f |= PICK_F_ABOVE_NEG_INF;
                }
                if ((key & mask) == prefix) bin = (int)((key >> shift) & 255u);
            }
            const unsigned peers = __match_any_sync(FULL_MASK, bin);
            if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], __popc(peers));
        }
        if (pass == 0) {
            for (int o = 16; o > 0; o >>= 1) f |= __shfl_xor_sync(FULL_MASK, f, o);
            if (lane == 0 && f) atomicOr(&sh.flags, f);
        }
        __syncthreads();
        if (pass == 0) {
            const unsigned fl = sh.flags;
            if ((fl & (PICK_F_NAN | PICK_F_POS_INF)) || !(fl & PICK_F_ABOVE_NEG_INF)) {
                if (tid == 0) { /* the host fails the row as the CPU sampler does */
                    rec[0] = (int32_t)fl;
                    rec[1] = 0;
                }
                return;
            }
        }
        if (warp == 0) pick_find_bin(sh, shift);
        mask |= 255u << shift;
        __syncthreads();
    }
    // ---- every key > K, and the `need` lowest ids with key == K, in id order
    const uint32_t K = sh.prefix;
    const int need = sh.remaining, n_gt = k - need;
    if (tid == 0) sh.n_gt = 0;
    __syncthreads();
    int eq_base = 0, buf = 0;
    for (int base = 0; base < V; base += PICK_THREADS, buf ^= 1) {
        const int i = base + tid;
        bool gt = false, eq = false;
        uint32_t key = 0;
        if (i < V) {
            key = pick_key(__fdiv_rn(l[i], temp));
            gt = key > K;
            eq = key == K;
        }
        const unsigned long long c = ((unsigned long long)key << 32) | (uint32_t)~(uint32_t)i;
        if (gt) sh.cand[atomicAdd(&sh.n_gt, 1)] = c;
        const unsigned bal = __ballot_sync(FULL_MASK, eq);
        if (lane == 0) sh.wsum[buf][warp] = __popc(bal);
        __syncthreads();
        const int w = sh.wsum[buf][lane];
        int inc = w;
        for (int o = 1; o < 32; o <<= 1) {
            const int t = __shfl_up_sync(FULL_MASK, inc, o);
            if (lane >= o) inc += t;
        }
        const int woff = __shfl_sync(FULL_MASK, inc - w, warp), tot = __shfl_sync(FULL_MASK, inc, 31);
        if (eq) {
            const int rank = eq_base + woff + __popc(bal & ((1u << lane) - 1u));
            if (rank < need) sh.cand[n_gt + rank] = c;
        }
        eq_base += tot;
    }
    // ---- bitonic sort of the k candidates, descending (padding 0 sorts last)
    int n2 = 1;
    while (n2 < k) n2 <<= 1;
    for (int i = k + tid; i < n2; i += PICK_THREADS) sh.cand[i] = 0;
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1)
        for (int j = size >> 1; j > 0; j >>= 1) {
            if (tid < n2) {
                const int p = tid ^ j;
                if (p > tid) {
                    const unsigned long long a = sh.cand[tid], b = sh.cand[p];
                    const bool desc = (tid & size) == 0;
                    if (desc ? a < b : a > b) {
                        sh.cand[tid] = b;
                        sh.cand[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    int32_t *ids = rec + 2, *vals = rec + 2 + stride;
    for (int i = tid; i < k; i += PICK_THREADS) {
        const int32_t id = (int32_t)~(uint32_t)(sh.cand[i] & 0xffffffffu);
        ids[i] = id;
        vals[i] = __float_as_int(l[id]);
    }
    if (tid == 0) {
        rec[0] = (int32_t)sh.flags;
        rec[1] = k;
    }
}

/* Row l's pick by one CTA: the repetition penalty in place (distinct tokens, so no two
 * threads touch one logit), then the greedy argmax or the top-k candidates into out. */
__device__ void pick_row_run(float *l, int V, const pick_row &p, const int32_t *pen, pick_smem &sh,
                             int32_t *out, int stride) {
    for (int j = threadIdx.x; j < p.pen_n; j += PICK_THREADS) {
        const int32_t t = pen[p.pen_off + j];
        const float x = l[t];
        l[t] = x > 0.0f ? __fdiv_rn(x, p.penalty) : __fmul_rn(x, p.penalty);
    }
    __syncthreads(); /* the block's global writes are visible to it after the barrier */
    if (p.mode == PICK_GREEDY) pick_greedy(l, V, sh, out, stride);
    else pick_top_k(l, V, p.k, p.temp, sh, out, stride);
}

/* grid rows, block PICK_THREADS. */
__global__ void __launch_bounds__(PICK_THREADS)
pick_kernel(float *logits, size_t ld, int V, const pick_row *__restrict__ plan,
            const int32_t *__restrict__ pen, int stride, int32_t *__restrict__ rec) {
    __shared__ pick_smem sh;
    const int r = blockIdx.x;
    const pick_row p = plan[r];
    int32_t *out = rec + (size_t)r * PICK_REC_WORDS(stride);
    if (p.mode != PICK_GREEDY && p.mode != PICK_TOP_K) {
        if (threadIdx.x == 0) out[0] = out[1] = 0;
        return;
    }
    pick_row_run(logits + (size_t)r * ld, V, p, pen, sh, out, stride);
}

/* A greedy row split over a cluster of PICK_SPLIT CTAs: CTA c owns the 1024-id chunks c,
 * c + PICK_SPLIT, ... (the penalty on its own ids, then each thread's first best over its
 * ids in ascending order, the CTA's best by the same warp reductions), CTA 0 takes the best
 * of the CTAs' (distributed shared memory). (value desc, id asc) over the non-NaN logits is
 * a total order (ids differ; -0 == +0 ties by id), so every grouping finds the same
 * (id, value) as pick_kernel's one CTA. Other rows: CTA 0 alone, as pick_kernel.
 * grid (PICK_SPLIT, rows), block PICK_THREADS. */
#define PICK_SPLIT 8
/* Up to this many rows (clusters of 8 CTAs of 1024 threads: about 16 fit an H100 at once;
 * a top-k row keeps one CTA of its cluster busy and its cluster's SMs reserved, so many
 * rows go one CTA a row, pick_kernel, as before). */
#define PICK_SPLIT_ROWS 8
/* CTA c of a row split over PICK_SPLIT CTAs: its best (bv, bi) on thread 0 (bi < 0: none)
 * over its 1024-id chunks c, c + PICK_SPLIT, ...: each thread's first best number over its
 * ids in ascending order (NaN skipped), then the warp and block reductions. */
__device__ void pick_split_scan(const float *l, int V, int c, pick_smem &sh, float &bv, int &bi) {
    /* 24 of a thread's logits loaded at once (V <= 196608: one round) */
    block_best<24>(l, V, c * PICK_THREADS + threadIdx.x, PICK_SPLIT * PICK_THREADS, sh, bv, bi);
}

__global__ void __cluster_dims__(PICK_SPLIT, 1, 1) __launch_bounds__(PICK_THREADS)
pick_split_kernel(float *logits, size_t ld, int V, const pick_row *__restrict__ plan,
                  const int32_t *__restrict__ pen, int stride, int32_t *__restrict__ rec) {
    constexpr int NC = PICK_SPLIT;
    __shared__ pick_smem sh;
    __shared__ float cbv[NC];
    __shared__ int cbi[NC];
    namespace cg = cooperative_groups;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const pick_row p = plan[r];
    int32_t *out = rec + (size_t)r * PICK_REC_WORDS(stride);
    float *l = logits + (size_t)r * ld;
    if (p.mode != PICK_GREEDY) { /* uniform over the cluster: no cluster barrier */
        if (c != 0) return;
        if (p.mode == PICK_TOP_K) pick_row_run(l, V, p, pen, sh, out, stride);
        else if (tid == 0) out[0] = out[1] = 0;
        return;
    }
    cg::cluster_group cl = cg::this_cluster();
    cl.barrier_arrive(); /* this CTA has started (waited for before the shared writes below) */
    for (int j = tid; j < p.pen_n; j += PICK_THREADS) {
        const int32_t t = pen[p.pen_off + j];
        if ((t / PICK_THREADS) % NC != c) continue;
        const float x = l[t];
        l[t] = x > 0.0f ? __fdiv_rn(x, p.penalty) : __fmul_rn(x, p.penalty);
    }
    __syncthreads(); /* the block's global writes are visible to it after the barrier */
    float bv;
    int bi;
    pick_split_scan(l, V, c, sh, bv, bi);
    cl.barrier_wait();   /* every CTA of the cluster has started: CTA 0's shared memory is there */
    if (tid == 0) {
        *cl.map_shared_rank(&cbv[c], 0) = bv;
        *cl.map_shared_rank(&cbi[c], 0) = bi;
    }
    cl.sync();           /* the CTAs' bests are in CTA 0's cbv / cbi */
    if (c != 0 || tid >= 32) return;
    bv = lane < NC ? cbv[lane] : 0.0f;
    bi = lane < NC ? cbi[lane] : -1;
    warp_best(bv, bi);
    if (lane == 0) {
        out[0] = 0;
        out[1] = bi >= 0 ? 1 : 0;
        out[2] = bi;
        out[2 + stride] = __float_as_int(bv);
    }
}

// ---------------------------------------------------------------------------
// public
// ---------------------------------------------------------------------------

/* Greedy rows over a cluster (pick_split_kernel): TQKV_PICK_SPLIT (0: pick_kernel, one CTA
 * per row), read at the first launch; pick_cuda_set_split's -1 goes back to the environment. */
static env_switch g_split = ENV_SWITCH("TQKV_PICK_SPLIT");
/* 1 once the runtime refused a split launch (e.g. a device without clusters): every later
 * call picks one CTA a row (pick_kernel), as gemm_cuda.cu's refused PDL launches go plain. */
static int g_split_refused = 0;
/* Tests: 1 launches the split with an impossible block size, a real launch error. */
static int g_split_force_refusal = 0;

extern "C" void pick_cuda_set_split(int on) {
    env_switch_set(&g_split, on);
    __atomic_store_n(&g_split_refused, 0, __ATOMIC_RELAXED);
}

extern "C" void pick_cuda_split_force_refusal(int on) {
    __atomic_store_n(&g_split_force_refusal, on ? 1 : 0, __ATOMIC_RELAXED);
}

extern "C" int pick_cuda_split_refused(void) {
    return __atomic_load_n(&g_split_refused, __ATOMIC_RELAXED);
}

static int split_on(void) { return env_switch_get(&g_split); }

/* The split launch (a cluster of PICK_SPLIT CTAs per row) on s: 1, or 0 when the runtime
 * refused it (its error cleared, so nothing after is poisoned; remembered: later calls go
 * one CTA a row). Nothing ran then: the caller's pick_kernel gives the same records and
 * penalized logits (pick_split_kernel's comment). A refusal inside a decode step's capture
 * may end that capture; the forward's failed-capture path then runs the step directly. */
static int split_launch(float *logits, size_t ld, int rows, int V, const pick_row *plan,
                        const int32_t *pen, int stride, int32_t *rec, cudaStream_t s) {
    const int force = __atomic_load_n(&g_split_force_refusal, __ATOMIC_RELAXED);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(PICK_SPLIT, (unsigned)rows);
    cfg.blockDim = dim3(force ? 2 * PICK_THREADS : PICK_THREADS); /* 2048: never launchable */
    cfg.stream = s;
    if (cudaLaunchKernelEx(&cfg, pick_split_kernel, logits, ld, V, plan, pen, stride, rec) ==
        cudaSuccess)
        return 1;
    (void)cudaGetLastError();
    __atomic_store_n(&g_split_refused, 1, __ATOMIC_RELAXED);
    return 0;
}

extern "C" tqkv_status pick_cuda_queue(float *logits, size_t ld, int rows, int V, const void *in,
                                       int stride, int32_t *rec, void *stream) {
    if (!logits || !in || !rec || rows < 1 || V < 1 || (size_t)V > ld || stride < 1 ||
        stride > PICK_TOP_K_MAX)
        return tqkv_fail(TQKV_EINVAL, "device pick: bad arguments (rows %d, vocab %d, stride %d)",
                         rows, V, stride);
    const pick_row *plan = (const pick_row *)in;
    const int32_t *pen = (const int32_t *)(plan + rows);
    const cudaStream_t s = (cudaStream_t)stream;
    const int split = split_on() && rows <= PICK_SPLIT_ROWS && !pick_cuda_split_refused();
    if (!split || !split_launch(logits, ld, rows, V, plan, pen, stride, rec, s))
        pick_kernel<<<(unsigned)rows, PICK_THREADS, 0, s>>>(logits, ld, V, plan, pen, stride, rec);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: device pick launch: %s", cudaGetErrorString(e));
    return TQKV_OK;
}

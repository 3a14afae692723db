/*
 * attn_cuda_split.cuh - the split-KV flash-decoding kernel over the device cache, sm_90,
 * split_kernel<F, NG, ST, D>: F = tq4, tq3 (with the q8 recent window), fp8 (d = 128 only: e4m3
 * converted to fp16 by cvt, no table, no window) or the dense bf16 baseline (d = 128 only), or
 * a K/V pair (d = 128 only, with the window: F_TQ42 = tq4 K with
 * tq2 V, F_TQ2 = tq2 both, F_TQ43 = tq4 K with tq3 V, F_TQ32 = tq3 K with tq2 V;
 * attn_cuda_tile.cuh), head dim D = 128 or 256. Instantiated by attn_cuda.cu (d = 128) and
 * attn_cuda_wide.cu (d = 256), which prepare its queries, launch it and merge its partials.
 * Owns: the kernel's parameters (Params<D>), its shared-memory layout, work items and their
 * claims, the stream of staged tiles and its mbarrier phases, the online softmax, the merge of
 * a group's warps and the partials' layout ([rows, q_heads, nsmax, D] unnormalized outputs in
 * the V domain, [rows, q_heads, nsmax] (max, sum) in base 2), the coherent query load of a
 * programmatic launch (ld_coherent; P.pdl; the launch helpers are util/cuda_pdl.cuh's).
 * Must not: mutate the cache, or let a row's result depend on other rows: a row's split size
 * depends only on its own token count (attn_cuda_splits.h), every reduction runs in a fixed
 * order.
 *
 * Kernel shape (persistent: one CTA per SM of NG groups of 4 warps; a group takes work
 * items = (row, kv head, split) in turn; within an item each warp takes every 4th tile of
 * TT tokens of the split, TT = 32 for tq, 16 for bf16; tiles are 16-token subtiles; tq
 * tiles reach shared memory by bulk copies (TMA), ST per warp in flight, across items):
 *   S^T [16 tokens, 8 heads] = K [16, D] . Q^T [D, 8]        mma.m16n8k16 (fp16/bf16)
 *   O^T [D, 8 heads]       += V^T [D, 16] . P^T [16, 8]      mma.m16n8k16
 * (attn_cuda_tile.cuh: the fragments' head-dim and token orders, the lookups.) The per-token
 * fp16 K scale multiplies the score; the V scale enters the softmax exponent
 * (RESCALE_SLACK). A q8 window token's values are decoded relative to its largest block scale,
 * and that factor (q8_tok_factor) takes the scale's place.
 * Online softmax in base 2 per warp over scores plus log2 of the V factor, with a lazy
 * rescale (RESCALE_SLACK), merged across a group's warps in registers (two rounds through
 * exchange slots in shared memory), and across splits by the merge kernel in split order.
 * Staging runs on warp-uniform values (uni()): one elected lane issues a tile's bulk copies
 * from uniform registers.
 * d = 256: the same kernel with 16 k-steps (K decoded per head-dim half), 16 m-tiles
 * (acc[16][4], qb[16][2]), the tile read in place from its stage (Tile256) in the bank-
 * conflict-free token order and layout of Stg256; NG = 2 groups (256 threads, up to 255
 * registers), ST = 2 stages per warp (attn_cuda_wide.cu).
 */
#ifndef TQKV_ATTN_CUDA_SPLIT_CUH
#define TQKV_ATTN_CUDA_SPLIT_CUH

#include <stdio.h>

#include "util/cuda_pdl.cuh"
#include "attn/attn_cuda_splits.h"
#include "attn/attn_cuda_tile.cuh"

namespace {

/* A row's split length and count at head dim D (attn_cuda_splits.h). */
template <int D> __device__ __forceinline__ int dsplit_len(int ntok) {
    if constexpr (D == 128) return split_len(ntok);
    else return tsplit_len(ntok);
}
template <int D> __device__ __forceinline__ int dsplit_count(int ntok) {
    if constexpr (D == 128) return split_count(ntok);
    else return tsplit_count(ntok);
}
/* The row's splits that are numbered first (per kv head): those holding q8 window tokens (0
 * without a window: such rows keep their former order). They take the longest (a window tile is loaded by the
 * lanes, a main-plane tile is staged), so running them first keeps them off the end of the
 * launch: with the window's splits numbered among the rest, the launch ended up to 80%
 * later than without the window (batch 8 / 64k, +0.18 ms at both batch 8 and 32). Only the
 * order in which items are taken changes, not what an item computes. */
template <int D> __device__ __forceinline__ int dsplit_first(const cuda_row &row) {
    if (row.wstart >= row.ntok) return 0;                  /* no window (or an empty row) */
    return dsplit_count<D>(row.ntok) - row.wstart / dsplit_len<D>(row.ntok);
}

// ---------------------------------------------------------------------------
// The split kernel (persistent: one CTA per SM of NG groups of 4 warps sharing one table;
// each group takes work items (row, kv head, split): first item = its worker number
// (group-major, so the first items land on different SMs), later ones from a counter; an
// item's arithmetic does not depend on which group runs it)
// ---------------------------------------------------------------------------
template <int D> struct Params {
    Ctx base;                 /* pointers of (row 0, head 0) before offsets */
    Ring ring;
    const cuda_row *rows;
    const uint16_t *q;        /* [rows, qh, D] prepared queries (fp16 / bf16 bits, qdim order) */
    float *po;                /* [rows, qh, nsmax, D] split outputs (unnormalized, V domain) */
    float2 *pml;              /* [rows, qh, nsmax] (max of s + log2 f, sum) in base 2 */
    int nrows, kvh, G, qh, cap;
    int nsmax;                /* split stride of po / pml: >= every row's split_count */
    int *work;                /* [2] counters (next item, groups done), zero between launches */
    typename cuda_codec_of<D>::type kc, vc;  /* the kernel reads kc.cent (one format for K and V), and
                                              * vc.cent for the pairs of two formats */
    int pdl;                  /* launched programmatically after the query prep (cuda_pdl_launch):
                               * no query is read before cuda_pdl_wait */
};

/* The kernel's parameters for cache kv (both head dims' launchers): its planes, q8 ring and
 * device row table, the prepared queries qp and the partials po / pml of split stride nsmax,
 * and kv's codec (kc / vc: cuda_kv.kc / vc at 128, kc256 / vc256 at 256). */
template <int D>
inline Params<D> split_params(const cuda_kv *kv, const typename cuda_codec_of<D>::type &kc,
                              const typename cuda_codec_of<D>::type &vc, const uint16_t *qp, float *po,
                              float2 *pml, int q_heads, int nsmax) {
    Params<D> P;
    P.base.kb = kv->kd; P.base.vb = kv->vd;
    P.base.ksb = kv->ks; P.base.vsb = kv->vs;
    P.ring.kw = kv->kw; P.ring.vw = kv->vw;
    P.ring.kws = kv->kws; P.ring.vws = kv->vws;
    P.ring.ring = kv->ring;
    P.rows = kv->d_rows;
    P.q = qp;
    P.po = po;
    P.pml = pml;
    P.nrows = kv->rows;
    P.kvh = kv->kvh;
    P.G = q_heads / kv->kvh;
    P.qh = q_heads;
    P.cap = kv->cap;
    P.nsmax = nsmax;
    P.work = kv->d_work;
    P.kc = kc;
    P.vc = vc;
    P.pdl = 0;                /* a plain launch; the launchers set it (cuda_attn_pdl_on) */
    return P;
}

// ---------------------------------------------------------------------------
// Programmatic Dependent Launch (PDL, sm_90) of the decode launches: query prep -> split
// kernel -> merge (docs/CUDA.md "Decode attention: the launches overlap"; cuda_pdl_wait /
// cuda_pdl_trigger / cuda_pdl_launch: util/cuda_pdl.cuh)
// ---------------------------------------------------------------------------
/* A 16-byte load through the coherent path (a query written during this kernel's lifetime). */
__device__ __forceinline__ uint4 ld_coherent(const uint4 *p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

constexpr int NW = 4;                         /* warps per group (one work item at a time) */
constexpr int ATTN_MAX_ROWS = CUDA_MAX_ROWS;  /* rows of one decode attention call (s_pre) */
/* Per-warp shared area: tq: ST stages; bf16: an exchange slot of the merge (warps 0, 1). */
template <int F, int ST, int D> __host__ __device__ constexpr int warp_area() {
    if constexpr (F == F_BF16) return CUDA_MAX_G * D * 4;
    else if constexpr (D == 128) return ST * Stg<F>::BYTES;
    else return ST * Stg256<F>::BYTES;
}
/* Dynamic shared memory: [table 64 KiB (tq)] [warp areas] [mbarriers] [s_ml] [s_next]
 * [s_pre, s_pre0] [exchange slots (tq3: tq4 keeps them in the table's holes)]. The table is first:
 * it must start at TAB_BASE. */
template <int F, int NG, int ST, int D> __host__ __device__ constexpr int smem_tab() {
    return F == F_BF16 || F == F_FP8 ? 0 : 256 * 256;   /* fp8 converts, no table */
}
template <int F, int NG, int ST, int D> __host__ __device__ constexpr int smem_bar() {
    return smem_tab<F, NG, ST, D>() + NG * NW * warp_area<F, ST, D>();
}
template <int F, int NG, int ST, int D> __host__ __device__ constexpr int smem_ml() {
    return smem_bar<F, NG, ST, D>() + (F == F_BF16 ? 0 : NG * NW * ST * 8);
}
template <int F, int NG, int ST, int D> __host__ __device__ constexpr int smem_xs() {
    return (smem_ml<F, NG, ST, D>() + NG * 2 * 4 * 16 + NG * NW * 8 + 2 * (ATTN_MAX_ROWS + 1) * 4 + 15) / 16 * 16;  /* s_ml, s_next, s_pre, s_pre0 */
}
/* the merge's exchange slots after s_pre (tq3 and the pairs of two formats: the table's holes
 * hold a second table; fp8: no table) */
template <int F> __host__ __device__ constexpr bool xs_after() {
    return F == F_TQ3 || F == F_TQ42 || F == F_TQ43 || F == F_TQ32 || F == F_FP8;
}
template <int F, int NG, int ST, int D> __host__ __device__ constexpr int smem_bytes() {
    return smem_xs<F, NG, ST, D>() + (xs_after<F>() ? NG * 2 * (D / 4) * 128 : 0);  /* D / 4 slot rows per lane */
}

/* Group barrier (ids 1..NG; 0 is __syncthreads). */
__device__ __forceinline__ void grp_sync(int grp) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "n"(NW * 32) : "memory");
}

/* The online softmax's max step for a tile (heads 2c, 2c+1 of this lane; the D = 128 and 256
 * tile bodies share it): the tile's scores sc against the running max m, the lazy rescale of
 * m, l and the NM m-tiles of acc, and mu = the max the tile's weights are taken against. */
template <int SUB, int NM>
__device__ __forceinline__ void tile_rescale(const float (&sc)[SUB][4], float (&m)[2], float (&l)[2],
                                             float (&acc)[NM][4], float (&mu)[2]) {
    /* this lane's tokens (no -inf start: fmaxf drops a NaN operand, and every use of mx below
     * compares or takes fmaxf, where an all-NaN mx acts as -inf does) */
    float mx[2] = {fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[0][1], sc[0][3])};
#pragma unroll
    for (int u = 1; u < SUB; u++) {
        mx[0] = fmaxf(mx[0], fmaxf(sc[u][0], sc[u][2]));
        mx[1] = fmaxf(mx[1], fmaxf(sc[u][1], sc[u][3]));
    }
    /* rescale only when some score exceeds its head's running max by more than RESCALE_SLACK:
     * below that the weights are taken against the stale max, so they reach at most
     * 2^RESCALE_SLACK (fp16 holds them at full precision); m, l and acc stay consistent,
     * whichever max they refer to. So the tile's max over the warp is needed only then. On
     * random data the exact rule rescaled about half the tiles (batch 32 / 64k); this one, 4%
     * (Nsight, RESULTS). (A difference, exact near m: m + RESCALE_SLACK would round for |m| >=
     * 2^25; an all-masked tile, -inf - m, does not rescale.) (Columns of unused heads vote
     * too: their s' is the tokens' log2 f, their query being 0, so a V scale 2^4 above the
     * running max's rescales; letting only heads in use vote cost the loop 40 instructions,
     * SASS.) */
    if (__any_sync(0xffffffffu, mx[0] - m[0] > RESCALE_SLACK || mx[1] - m[1] > RESCALE_SLACK)) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {                     /* over the lanes of heads 2c, 2c+1 */
            mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
            mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
        }
        float al[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const float mn = fmaxf(m[k], mx[k]);
            mu[k] = mn;                                        /* >= M_START: finite or +inf */
            al[k] = ex2(m[k] - mu[k]);
            m[k] = mn;
            l[k] *= al[k];
        }
#pragma unroll
        for (int i = 0; i < NM; i++) {
            acc[i][0] *= al[0]; acc[i][1] *= al[1];
            acc[i][2] *= al[0]; acc[i][3] *= al[1];
        }
    } else {
        mu[0] = m[0];
        mu[1] = m[1];
    }
}

/* The P^T fragments (B of PV) of this lane from the packed weights of its S rows A (plo) and B
 * (phi): slots 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1) of head g's column are rows A / B of the
 * lanes with g = c and g = 4 + c (orders_match, layout256_ok), column g >> 1. (Columns g >= G,
 * unused heads, are not zeroed: an mma column depends on its own B column only, and those
 * heads' outputs are never stored.) */
__device__ __forceinline__ void p_frags(uint32_t plo, uint32_t phi, int g, int c, uint32_t &b0, uint32_t &b1) {
    const int src = 4 * c + (g >> 1);
    const uint32_t x0 = __shfl_sync(0xffffffffu, plo, src), x1 = __shfl_sync(0xffffffffu, plo, src + 16);
    const uint32_t x2 = __shfl_sync(0xffffffffu, phi, src), x3 = __shfl_sync(0xffffffffu, phi, src + 16);
    const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
    b0 = prmt(x0, x1, sel);
    b1 = prmt(x2, x3, sel);
}

/* The kernel's codebook tables (tq formats): entry e of table t (2 tables: tq3 and the pairs of
 * two formats; fp8 builds none). */
template <int F> __host__ __device__ constexpr int tab_count() { return F == F_FP8 ? 0 : xs_after<F>() ? 2 : 1; }
template <int F, int D> __device__ __forceinline__ uint32_t tab_value(const Params<D> &P, int e, int t) {
    if constexpr (F == F_TQ42 || F == F_TQ2 || F == F_TQ43 || F == F_TQ32) return tab_entry_pair<F>(P.kc.cent, P.vc.cent, e, t);
    else return tab_entry<F>(P.kc.cent, e, t);
}

/* NG groups of NW warps per CTA, ST stages per warp (tq). bf16: each warp's next tile is
 * loaded into registers (double buffer) while this one is computed. */
template <int F, int NG, int ST, int D>
__global__ void __launch_bounds__(NG * NW * 32, 1) split_kernel(const Params<D> P) {
    constexpr int SUB = F == F_BF16 ? 1 : 2, TT = 16 * SUB;
    constexpr int NM = D / 16;                /* m-tiles of O^T (8 / 16) */
    using RawT = Raw<F, SUB>;
    static_assert(D == 128 || (D == 256 && (F == F_TQ4 || F == F_TQ3)),
                  "d = 256: tq4 / tq3 (bf16 and the pairs stay on the float32 kernel)");
    static_assert(F != F_BF16 || warp_area<F, ST, D>() >= CUDA_MAX_G * D * 4, "bf16: exchange slots in the warp areas");
    static_assert(F != F_TQ4 || NG * 2 * (4 * NM) <= 256, "tq4: the exchange slots fit the table's holes");
    static_assert(F != F_TQ2 || NG * 2 * (4 * NM) <= 256, "tq2: the exchange slots fit the table's holes");
    static_assert(smem_bytes<F, NG, ST, D>() <= 227 * 1024, "one CTA per SM");
    extern __shared__ __align__(16) uint32_t s_dyn[];
    char *const sbytes = reinterpret_cast<char *>(s_dyn);
    const int lane = threadIdx.x & 31, wc = threadIdx.x >> 5, grp = wc / NW, w = wc % NW;
    const int g = lane >> 2, c = lane & 3;
    const int G = P.G;
    /* after the table, the warp areas and the mbarriers: the merge's (m0, m1, l0, l1) per
     * (group, slot, lane column) */
    float4 *const s_mlg = reinterpret_cast<float4 *>(sbytes + smem_ml<F, NG, ST, D>());   /* [NG][2][4] */
    int *const s_next = reinterpret_cast<int *>(s_mlg + NG * 2 * 4);   /* [2][NG * NW] */
    int *const s_pre = s_next + 2 * NG * NW;                      /* [rows + 1] */
    int *const s_pre0 = s_pre + ATTN_MAX_ROWS + 1;                /* [rows + 1] */
    /* this warp's area and mbarriers (uniform: the staging arithmetic runs once per warp) */
    char *const wa = sbytes + uni((uint32_t)(smem_tab<F, NG, ST, D>() + wc * warp_area<F, ST, D>()));
    const uint32_t win = (uint32_t)__cvta_generic_to_shared(s_dyn);
    const uint32_t wa_s = uni(win + smem_tab<F, NG, ST, D>() + wc * warp_area<F, ST, D>());
    const uint32_t bar_s = uni(win + smem_bar<F, NG, ST, D>() + wc * ST * 8);
    /* pdl: the merge may launch now (its CTAs take SMs as this grid's leave, then wait for
     * this grid to complete); the query prep may still run: no query is read before cuda_pdl_wait */
    bool dep = P.pdl != 0;
    if (dep) cuda_pdl_trigger();

    if constexpr (F != F_BF16) {
        for (int i = threadIdx.x; F != F_FP8 && i < tab_count<F>() * 256 * 32; i += NG * NW * 32) {
            const int t = i >> 13, e = (i >> 5) & 255;           /* table, entry */
            s_dyn[e * 64 + 32 * t + (i & 31)] = tab_value<F, D>(P, e, t);
        }
        if (lane < ST) mbar_init(bar_s + 8 * lane, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if ((win & 0xFFFFu) != TAB_BASE) __trap(); /* a static __shared__ added here would move it */
    const Tab T = {4u * (uint32_t)lane | (win & 0xFFFF0000u)};
    /* lane offsets: d = 128 the same in the stage and in global memory; d = 256 the stage's
     * (lo) and global memory's (log) differ by the stage's pads */
    const LaneOff lo = [&] {
        if constexpr (D == 128) return lane_off<F>(g, c);
        else return lane_off256<F, true>(g, c);
    }();
    uint64_t pol = 0;
    if constexpr (F != F_BF16) {
        /* K/V are read once: evict-first (measured ~1% faster than evict-normal, RESULTS) */
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        pol = uni(pol);
    }

    // ---- the work items: (row, kv head, split) for every split of every row, so none is
    //      empty, numbered in two runs: first the splits of dsplit_first (the window's),
    //      then the others, each run row by row (within a row head-major). s_pre0[r] /
    //      s_pre[r] = row r's first item in run 0 / 1 (exclusive scans of kvh x the row's
    //      split counts in each run over the row table; run 1 counted from 0).
    {
        constexpr int NT = NG * NW * 32;
        const int per = (P.nrows + NT - 1) / NT, r0 = threadIdx.x * per;
        int sum0 = 0, sum1 = 0;
        for (int r = r0; r < r0 + per && r < P.nrows; r++) {
            const int f = dsplit_first<D>(P.rows[r]);
            sum0 += P.kvh * f;
            sum1 += P.kvh * (dsplit_count<D>(P.rows[r].ntok) - f);
        }
        int inc0 = sum0, inc1 = sum1;                          /* inclusive scans in the warp */
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y0 = __shfl_up_sync(0xffffffffu, inc0, o), y1 = __shfl_up_sync(0xffffffffu, inc1, o);
            if (lane >= o) {
                inc0 += y0;
                inc1 += y1;
            }
        }
        if (lane == 31) {                                      /* warp totals (s_next reused) */
            s_next[wc] = inc0;
            s_next[NG * NW + wc] = inc1;
        }
        __syncthreads();                                       /* also: the table and mbarriers */
        int base0 = 0, base1 = 0;
        for (int ww = 0; ww < wc; ww++) {
            base0 += s_next[ww];
            base1 += s_next[NG * NW + ww];
        }
        int run0 = base0 + inc0 - sum0, run1 = base1 + inc1 - sum1;
        for (int r = r0; r < r0 + per && r < P.nrows; r++) {
            const int f = dsplit_first<D>(P.rows[r]);
            s_pre0[r] = run0;
            s_pre[r] = run1;
            run0 += P.kvh * f;
            run1 += P.kvh * (dsplit_count<D>(P.rows[r].ntok) - f);
        }
        if (threadIdx.x == NT - 1) {
            s_pre0[P.nrows] = base0 + inc0;
            s_pre[P.nrows] = base1 + inc1;
        }
        __syncthreads();
    }
    const int total0 = s_pre0[P.nrows], total = total0 + s_pre[P.nrows];
    const int workers = (int)gridDim.x * NG;
    /* worker k's first two items are k and k + workers; with more items than that the rest
     * are claimed from the counter (items 2 workers, 2 workers + 1, ...), each claim made
     * an item ahead of its use, so its latency hides behind a whole item. With at most
     * `workers` items no atomic is touched at all. */
    const bool claims = total > workers;
    const int gt = threadIdx.x - grp * NW * 32, wc0 = grp * NW;   /* thread in group, its first warp */
    /* an item's place: (row, head, split), its tokens [a, z), and this warp's tiles
     * t0 = a + (w + NW k) TT, of which the fast ones (fully in the main plane and in range)
     * are k < nf; nf = 0 for no item */
    struct Item {
        int r, h, sp, a, z, fast_end, first, nf;
        size_t rh, col;                                        /* col: token 0 of (row, head) */
        cuda_row row;
    };
    auto locate = [&](int item) {
        Item x;
        if (item >= total) {
            x.nf = 0;
            return x;
        }
        const bool run0 = item < total0;
        const int *const pre = run0 ? s_pre0 : s_pre;
        const int it = run0 ? item : item - total0;
        int lo_r = 0, hi_r = P.nrows - 1;                      /* last r with pre[r] <= it */
        while (lo_r < hi_r) {
            const int mid = (lo_r + hi_r + 1) >> 1;
            if (pre[mid] <= it) lo_r = mid;
            else hi_r = mid - 1;
        }
        x.r = lo_r;
        x.row = P.rows[x.r];
        const int ntok = x.row.ntok;
        const int nsr = dsplit_count<D>(ntok), f = dsplit_first<D>(x.row), local = it - pre[x.r];
        const int n = run0 ? f : nsr - f;                      /* > 0: the row holds item */
        x.h = local / n;
        x.sp = local - x.h * n + (run0 ? nsr - f : 0);
        const int seg = dsplit_len<D>(ntok);
        x.a = x.sp * seg;
        x.z = min(ntok, x.a + seg);
        x.rh = (size_t)x.r * P.kvh + x.h;
        x.col = x.rh * P.cap + (size_t)x.row.left_pad;
        x.fast_end = min(x.z, x.row.wstart);
        x.first = x.a + w * TT;
        x.nf = x.first + TT <= x.fast_end ? (x.fast_end - TT - x.first) / (NW * TT) + 1 : 0;
        return x;
    };
    /* The warp's staged tiles form one stream across its items: position k of an item is
     * its fast tile k for k < nf, then the next item's tile k - nf. Stream use q (seq + k)
     * takes stage q % ST with parity (q / ST) & 1; ST positions are in flight, so the next
     * item's first tiles are on their way while this item ends. */
    uint32_t seq = 0;                                          /* stream positions consumed */
    int pre = 0;                                               /* of this item, already issued */
    int item = grp * (int)gridDim.x + (int)blockIdx.x;
    int nxt_item = claims && item + workers < total ? item + workers : total;
    Item cur = locate(item);
    while (item < total) {
        const char *nq; /* this lane's line of the next query */
        /* the item after the next, published through the merge's barriers */
        int claim = total;
        if (claims && gt == 0) claim = 2 * workers + atomicAdd(P.work, 1);
#if TQKV_COPY_TOK32
        uint32_t nxt_tt;                                       /* the next item's staging needs only these */
        int nxt_nf;
        {
            const Item x = locate(nxt_item);
            nxt_nf = uni(x.nf);                                /* uniform: the staging runs on them */
            nxt_tt = nxt_nf > 0 ? uni((uint32_t)x.col + (uint32_t)x.first) : 0; /* its first tile in the planes */
#else
        size_t nxt_col;                                        /* the next item's staging needs only these */
        int nxt_first, nxt_nf;
        {
            const Item x = locate(nxt_item);
            nxt_nf = uni(x.nf);                                /* uniform: the staging runs on them */
            nxt_col = nxt_nf > 0 ? uni((uint64_t)x.col) : 0;
            nxt_first = nxt_nf > 0 ? uni(x.first) : 0;
#endif
            /* its query (G heads, up to 2 / 4 KiB) into L1 now, so the next item starts without
             * waiting (dep: once the prep has completed, below) */
            const uint16_t *const xq = P.q + ((size_t)x.r * P.qh + (size_t)x.h * G) * D;
            const bool pf = x.nf > 0 && lane < CUDA_MAX_G * D / 64 && lane * 128 < G * D * 2;
            nq = pf ? reinterpret_cast<const char *>(xq) + 128 * lane : nullptr;
            if (!dep && nq) asm volatile("prefetch.global.L1 [%0];" ::"l"(nq));
        }
        const int r = cur.r, h = cur.h, sp = cur.sp, a = cur.a, z = cur.z, fast_end = cur.fast_end;
        const int nf = uni(cur.nf), first = uni(cur.first);  /* cur is a located item */
        const cuda_row row = cur.row;
        const size_t rh = cur.rh, col = uni((uint64_t)cur.col);
        (void)a;
        /* window slot pointers, built where a slow tile needs them */
        auto ring_of = [&]() {
            Ring y = P.ring;
            y.kw += rh * y.ring * D;
            y.vw += rh * y.ring * D;
            y.kws += rh * y.ring * (D / 32);
            y.vws += rh * y.ring * (D / 32);
            return y;
        };
        /* The window tiles of this warp (the item's tiles from k = nf on, past fast_end) read
         * their q8 values and block scales with loads that wait where they are used: their
         * lines go to L2 now (a prefetch per token and plane), while the fast tiles run, so
         * those loads wait on L2, not HBM (the window item is the longest on the critical
         * path: it carries a full split's main-plane tiles too). */
        if constexpr (F != F_BF16 && F != F_FP8) {
            if (row.wstart < z) {
                const Ring x = ring_of();
                for (int t0 = first + nf * NW * TT; t0 < z; t0 += NW * TT) {
                    const int t = t0 + lane;
                    if (t >= row.wstart && t < z) {
                        const size_t slot = (size_t)(t % x.ring);
#pragma unroll
                        for (int b = 0; b < D; b += 128) {
                            l2_prefetch(x.kw + slot * D + b);
                            l2_prefetch(x.vw + slot * D + b);
                        }
                        l2_prefetch(x.kws + slot * (D / 32));
                        l2_prefetch(x.vws + slot * (D / 32));
                    }
                }
            }
        }
#if TQKV_COPY_TOK32
        const uint32_t tt0 = (uint32_t)col + (uint32_t)first, ntt0 = nxt_tt - (uint32_t)(nf * NW * TT);
#endif
        /* the whole warp (k uniform): stream position k of this item into its stage */
        auto issue = [&](int k, uint32_t st) {               /* st = (seq + k) % ST */
            if constexpr (F != F_BF16 && D == 128) {
                const uint32_t dst = wa_s + st * Stg<F>::BYTES, bar = bar_s + 8 * st;
#if TQKV_COPY_TOK32
                /* position k: this item's tile k (tt0 + k NW TT) or the next's tile k - nf */
                const uint32_t tt = (k < nf ? tt0 : ntt0) + (uint32_t)k * (NW * TT);
                stage_issue<F>(P.base, tt, dst, bar, pol);
#else
                const bool here = k < nf;
                stage_issue<F>(P.base, here ? col : nxt_col, here ? first + k * NW * TT : nxt_first + (k - nf) * NW * TT,
                               dst, bar, pol);
#endif
            } else if constexpr (F != F_BF16) {
                const uint32_t dst = wa_s + st * Stg256<F>::BYTES, bar = bar_s + 8 * st;
#if TQKV_COPY_TOK32
                const uint32_t tt = (k < nf ? tt0 : ntt0) + (uint32_t)k * (NW * TT);
                stage_issue256<F>(P.base, tt, dst, bar, pol);
#else
                const bool here = k < nf;
                const size_t tt = (here ? col : nxt_col) + (size_t)(here ? first + k * NW * TT : nxt_first + (k - nf) * NW * TT);
                stage_issue256<F>(P.base, tt, dst, bar, pol);
#endif
            }
        };
        const int avail = nf + nxt_nf;                         /* positions this item can issue */
        if constexpr (F != F_BF16) { /* the first stages' copies fly while the query loads */
            for (int k = pre; k < ST && k < avail; k++) issue(k, (seq + (uint32_t)k) % ST);
        }
        if (dep) { /* the first item (pdl): its copies fly, the query prep completes */
            cuda_pdl_wait();
            if (nq) asm volatile("prefetch.global.L1 [%0];" ::"l"(nq));
        }

        // ---- query fragments (B of QK^T): head g, pairs 2s / 2s+1 (stored in qdim order:
        //      d = 256 pairs 16 h .. of K's column c at 128 h + 32 c, four uint4 per half)
        uint32_t qb[NM][2];
        if (g < G) {
            const uint4 *q = reinterpret_cast<const uint4 *>(P.q + ((size_t)r * P.qh + (size_t)h * G + g) * D + 32 * c);
            uint4 v[D / 32];
            /* dep: the prep wrote the queries while this kernel ran, so not the read-only path
             * (ld.global.nc wants data unchanged for the kernel's lifetime; cuda_pdl_wait makes the
             * prep's writes visible to the grid, so this is caution, as cheap as it looks: four
             * loads per group and launch) */
            if (dep) {
#pragma unroll
                for (int k = 0; k < D / 32; k++) v[k] = ld_coherent(q + 16 * (k >> 2) + (k & 3));
            } else {
#pragma unroll
                for (int k = 0; k < D / 32; k++) v[k] = __ldg(q + 16 * (k >> 2) + (k & 3));
            }
#pragma unroll
            for (int k = 0; k < D / 32; k++) {
                qb[2 * k][0] = v[k].x;
                qb[2 * k][1] = v[k].y;
                qb[2 * k + 1][0] = v[k].z;
                qb[2 * k + 1][1] = v[k].w;
            }
        } else {
#pragma unroll
            for (int s = 0; s < NM; s++) qb[s][0] = qb[s][1] = 0u;
        }

        dep = false; /* later items: their queries were written before cuda_pdl_wait */
        float acc[NM][4];
#pragma unroll
        for (int i = 0; i < NM; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m[2] = {M_START, M_START}, l[2] = {0.0f, 0.0f};

        /* d = 128: a tile in registers (R: from the stage or loaded by load_tile) */
        auto process = [&](const RawT &R, int t0, bool slow) {
            /* a tile holding window tokens (warp-uniform): their q8 values replace the
             * lookups (their tq bytes are not loaded: lim = fast_end); wsl: the ring slot of
             * token t0 + lane (every slot is valid: the ring exists), shuffled to the
             * fragments' tokens */
            const bool wt = F != F_BF16 && F != F_FP8 && slow && row.wstart < min(z, t0 + TT); /* fp8: no ring */
            const int wsl = wt ? (t0 + lane) % P.ring.ring : 0;
            // ---- per-lane token factors (token t0 + lane): K's, log2 of V's and its inverse
            float kf = 1.0f, vl = 0.0f, vi = 1.0f;  /* (see RESCALE_SLACK) */
            float vf = 1.0f;                          /* (the window's V fragments use it) */
            {
                const int t = t0 + lane;
                if constexpr (F != F_BF16) {
                    kf = __half2float(__ushort_as_half((uint16_t)R.ksc));
                    vf = __half2float(__ushort_as_half((uint16_t)R.vsc));
                    if constexpr (F == F_FP8 && FP8_FACTOR != 1.0f) {  /* TQKV_FP8_CVT=0: h(b) x 256 */
                        kf *= FP8_FACTOR;
                        vf *= FP8_FACTOR;
                    }
                    if (wt && t >= row.wstart && t < z) {     /* q8_tok_factor */
                        const Ring x = ring_of();
                        const size_t slot = (size_t)wsl;
                        kf = q8_tok_factor(x.kws + slot * (D / 32));
                        vf = q8_tok_factor(x.vws + slot * (D / 32));
                    }
                    vl = lg2(vf < VSCALE_MIN ? VSCALE_MIN : vf); /* NaN stays NaN */
                    vi = ex2(-vl);
                }
                if (slow && (t >= z || lane >= TT)) { /* masked: a score of -inf below */
                    kf = vl = vi = 0.0f;
                }
            }
            float sc[SUB][4];
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                uint32_t pa[16], pb[16];
                deq_k<F, SUB>(R, T, u, 0, pa);
                deq_k<F, SUB>(R, T, u, 1, pb);
                if constexpr (F != F_BF16) {
                    if (wt) { /* window tokens: q8 values with their block scale */
                        const Ring x = ring_of();
                        Q8K kq[2];
                        float kb[2], tf[2];
#pragma unroll
                        for (int row2 = 0; row2 < 2; row2++) {   /* every load first (valid slots) */
                            const size_t slot = (size_t)__shfl_sync(0xffffffffu, wsl, 16 * u + krow_tok<F>(g, row2));
                            kq[row2] = q8k_load(x.kw + slot * D, c);
                            kb[row2] = __half2float(__ushort_as_half(__ldg(x.kws + slot * (D / 32) + c)));
                            tf[row2] = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, row2)); /* its factor */
                        }
#pragma unroll
                        for (int row2 = 0; row2 < 2; row2++) {
                            const int t = t0 + 16 * u + krow_tok<F>(g, row2);
                            if (t >= row.wstart && t < z) q8k_pairs<F>(kq[row2], q8_rel(kb[row2], tf[row2]), row2 ? pb : pa);
                        }
                    }
                }
                float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s4b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int s = 0; s < 8; s++) { /* two accumulators: half the dependent chain */
                    const uint32_t af[4] = {pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1]};
                    mma<F>(s & 1 ? s4b : s4, af, qb[s][0], qb[s][1]);
                }
#pragma unroll
                for (int k = 0; k < 4; k++) s4[k] += s4b[k];
                const float fA = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, 0));
                const float fB = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, 1));
                if constexpr (F == F_BF16) {
                    sc[u][0] = s4[0] * fA; sc[u][1] = s4[1] * fA;
                    sc[u][2] = s4[2] * fB; sc[u][3] = s4[3] * fB;
                } else {
                    const float lA = __shfl_sync(0xffffffffu, vl, 16 * u + krow_tok<F>(g, 0));
                    const float lB = __shfl_sync(0xffffffffu, vl, 16 * u + krow_tok<F>(g, 1));
                    sc[u][0] = fmaf(s4[0], fA, lA); sc[u][1] = fmaf(s4[1], fA, lA);
                    sc[u][2] = fmaf(s4[2], fB, lB); sc[u][3] = fmaf(s4[3], fB, lB);
                }
                if (slow) {
                    if (t0 + 16 * u + krow_tok<F>(g, 0) >= z) sc[u][0] = sc[u][1] = -INFINITY;
                    if (t0 + 16 * u + krow_tok<F>(g, 1) >= z) sc[u][2] = sc[u][3] = -INFINITY;
                }
            }
            // ---- online softmax (heads 2c, 2c+1) ----------------------------------------
            float mu[2];
            tile_rescale<SUB, NM>(sc, m, l, acc, mu);
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                float p[4];
#pragma unroll
                for (int k = 0; k < 4; k++) p[k] = ex2(sc[u][k] - mu[k & 1]);
                if constexpr (F == F_BF16) {
                    l[0] += p[0] + p[2];
                    l[1] += p[1] + p[3];
                } else {                      /* 2^(s' - m) / f = 2^(s - m) */
                    const float iA = __shfl_sync(0xffffffffu, vi, 16 * u + krow_tok<F>(g, 0));
                    const float iB = __shfl_sync(0xffffffffu, vi, 16 * u + krow_tok<F>(g, 1));
                    l[0] = fmaf(p[0], iA, fmaf(p[2], iB, l[0]));
                    l[1] = fmaf(p[1], iA, fmaf(p[3], iB, l[1]));
                }
                uint32_t b0, b1;
                p_frags(pack2<F>(p[0], p[1]), pack2<F>(p[2], p[3]), g, c, b0, b1);
                uint32_t va[8][4];
                deq_v<F, SUB>(R, T, u, g, va);
                if constexpr (F != F_BF16) {
                    if (wt) {
                        const Ring x = ring_of();
                        Q8V vq[4];
                        float vb[4], tf[4];
#pragma unroll
                        for (int j = 0; j < 4; j++) {    /* every load first (valid slots) */
                            const size_t slot = (size_t)__shfl_sync(0xffffffffu, wsl, 16 * u + vcol_tok<F>(c, j));
                            vq[j] = q8v_load<F>(x.vw + slot * D, vdim<F>(g, 0, 0));
                            vb[j] = __half2float(__ushort_as_half(__ldg(x.vws + slot * (D / 32) + (g >> 1))));
                            tf[j] = __shfl_sync(0xffffffffu, vf, 16 * u + vcol_tok<F>(c, j)); /* its factor */
                        }
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const int t = t0 + 16 * u + vcol_tok<F>(c, j);
                            if (t >= row.wstart && t < z) {
                                const float bs = q8_rel(vb[j], tf[j]);
#pragma unroll
                                for (int i = 0; i < 8; i++)
#pragma unroll
                                    for (int e = 0; e < 2; e++)
                                        va[i][2 * (j >> 1) + e] = set_half(va[i][2 * (j >> 1) + e], j & 1,
                                                                           q8v_at<F>(vq[j], i, e) * bs);
                            }
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < 8; i++) mma<F>(acc[i], va[i], b0, b1);
            }
        };

        /* d = 256 (tq4, tq3): process's steps in its order, each head-dim half in turn; the
         * tile's words are read from S where they are used (Tile256: the warp's stage, or global
         * memory for slow tiles); ksc / vsc: the fp16 scales of token t0 + lane. Tokens:
         * ktok256 / vtok256. */
        auto process_w = [&](const auto &S, uint32_t ksc, uint32_t vsc, int t0, bool slow) {
            /* a tile holding window tokens (warp-uniform) and the ring slot of token t0 +
             * lane, as process */
            const bool wt = slow && row.wstart < min(z, t0 + TT);
            const int wsl = wt ? (t0 + lane) % P.ring.ring : 0;
            // ---- per-lane token factors (token t0 + lane): K's, log2 of V's and its inverse
            float kf, vl, vi, vf;
            {
                const int t = t0 + lane;
                kf = __half2float(__ushort_as_half((uint16_t)ksc));
                vf = __half2float(__ushort_as_half((uint16_t)vsc));
                if (wt && t >= row.wstart && t < z) {     /* q8_tok_factor8 */
                    const Ring x = ring_of();
                    const size_t slot = (size_t)wsl;
                    kf = q8_tok_factor8(x.kws + slot * (D / 32));
                    vf = q8_tok_factor8(x.vws + slot * (D / 32));
                }
                vl = lg2(vf < VSCALE_MIN ? VSCALE_MIN : vf); /* NaN stays NaN */
                vi = ex2(-vl);
                if (slow && (t >= z || lane >= TT)) { /* masked: a score of -inf below */
                    kf = vl = vi = 0.0f;
                }
            }
            float sc[SUB][4];
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s4b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                float tf[2] = {0.0f, 0.0f};           /* the rows' factors (window tokens) */
                if (wt) {
#pragma unroll
                    for (int row2 = 0; row2 < 2; row2++) tf[row2] = __shfl_sync(0xffffffffu, kf, ktok256(u, g, row2));
                }
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {      /* dims 128 hh ..: groups c + 4 hh */
                    uint32_t pa[16], pb[16];
                    S.deq_k(T, u, 0, hh, pa);
                    S.deq_k(T, u, 1, hh, pb);
                    if (wt) { /* window tokens: q8 values with their block scale (kdim256: the half's kdim) */
                        const Ring x = ring_of();
                        Q8K kq[2];
                        float kb[2];
#pragma unroll
                        for (int row2 = 0; row2 < 2; row2++) {   /* every load first (valid slots) */
                            const size_t slot = (size_t)__shfl_sync(0xffffffffu, wsl, ktok256(u, g, row2));
                            kq[row2] = q8k_load(x.kw + slot * D + 128 * hh, c);
                            kb[row2] = __half2float(__ushort_as_half(__ldg(x.kws + slot * (D / 32) + c + 4 * hh)));
                        }
#pragma unroll
                        for (int row2 = 0; row2 < 2; row2++) {
                            const int t = t0 + ktok256(u, g, row2);
                            if (t >= row.wstart && t < z) q8k_pairs<F>(kq[row2], q8_rel(kb[row2], tf[row2]), row2 ? pb : pa);
                        }
                    }
#pragma unroll
                    for (int s = 0; s < 8; s++) { /* two accumulators: half the dependent chain */
                        const uint32_t af[4] = {pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1]};
                        mma<F>(s & 1 ? s4b : s4, af, qb[8 * hh + s][0], qb[8 * hh + s][1]);
                    }
                }
#pragma unroll
                for (int k = 0; k < 4; k++) s4[k] += s4b[k];
                const float fA = __shfl_sync(0xffffffffu, kf, ktok256(u, g, 0));
                const float fB = __shfl_sync(0xffffffffu, kf, ktok256(u, g, 1));
                const float lA = __shfl_sync(0xffffffffu, vl, ktok256(u, g, 0));
                const float lB = __shfl_sync(0xffffffffu, vl, ktok256(u, g, 1));
                sc[u][0] = fmaf(s4[0], fA, lA); sc[u][1] = fmaf(s4[1], fA, lA);
                sc[u][2] = fmaf(s4[2], fB, lB); sc[u][3] = fmaf(s4[3], fB, lB);
                if (slow) {
                    if (t0 + ktok256(u, g, 0) >= z) sc[u][0] = sc[u][1] = -INFINITY;
                    if (t0 + ktok256(u, g, 1) >= z) sc[u][2] = sc[u][3] = -INFINITY;
                }
            }
            // ---- online softmax (heads 2c, 2c+1): as process ------------------------------
            float mu[2];
            tile_rescale<SUB, NM>(sc, m, l, acc, mu);
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                float p[4];
#pragma unroll
                for (int k = 0; k < 4; k++) p[k] = ex2(sc[u][k] - mu[k & 1]);
                {                             /* 2^(s' - m) / f = 2^(s - m) */
                    const float iA = __shfl_sync(0xffffffffu, vi, ktok256(u, g, 0));
                    const float iB = __shfl_sync(0xffffffffu, vi, ktok256(u, g, 1));
                    l[0] = fmaf(p[0], iA, fmaf(p[2], iB, l[0]));
                    l[1] = fmaf(p[1], iA, fmaf(p[3], iB, l[1]));
                }
                uint32_t b0, b1;      /* S rows c, c + 4 are P's slots of column c: layout256_ok */
                p_frags(pack2<F>(p[0], p[1]), pack2<F>(p[2], p[3]), g, c, b0, b1);
                float tfv[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* the slots' factors (window tokens) */
                if (wt) {
#pragma unroll
                    for (int j = 0; j < 4; j++) tfv[j] = __shfl_sync(0xffffffffu, vf, vtok256(u, c, j));
                }
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {      /* m-tiles 8 hh ..: dims 128 hh .. */
                    uint32_t va[8][4];
                    S.deq_v(T, u, hh, va);
                    if (wt) {                         /* vdim256: the half's vdim */
                        const Ring x = ring_of();
                        Q8V vq[4];
                        float vb[4];
#pragma unroll
                        for (int j = 0; j < 4; j++) {    /* every load first (valid slots) */
                            const size_t slot = (size_t)__shfl_sync(0xffffffffu, wsl, vtok256(u, c, j));
                            vq[j] = q8v_load<F>(x.vw + slot * D + 128 * hh, vdim<F>(g, 0, 0));
                            vb[j] = __half2float(__ushort_as_half(__ldg(x.vws + slot * (D / 32) + (g >> 1) + 4 * hh)));
                        }
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const int t = t0 + vtok256(u, c, j);
                            if (t >= row.wstart && t < z) {
                                const float bs = q8_rel(vb[j], tfv[j]);
#pragma unroll
                                for (int i = 0; i < 8; i++)
#pragma unroll
                                    for (int e = 0; e < 2; e++)
                                        va[i][2 * (j >> 1) + e] = set_half(va[i][2 * (j >> 1) + e], j & 1,
                                                                           q8v_at<F>(vq[j], i, e) * bs);
                            }
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++) mma<F>(acc[8 * hh + i], va[i], b0, b1);
                }
            }
        };
        (void)process;
        (void)process_w;                      /* one of the two is used per head dim */

        // ---- fast tiles ------------------------------------------------------------------
        int t0 = first;
        if constexpr (F != F_BF16) {
            /* staged: tile k waits on stage (seq + k) % ST; once tile k is computed (its
             * values consumed) the stage is refilled with tile k + ST. A warp's tiles are NW TT
             * = 128 tokens apart, so their scales' offset in a 16-byte unit is the same for all */
            const int misk = (int)((reinterpret_cast<uintptr_t>(P.base.ksb + col + first) & 15) >> 1);
            const int misv = (int)((reinterpret_cast<uintptr_t>(P.base.vsb + col + first) & 15) >> 1);
            uint32_t st = seq % ST, ph = (seq / ST) & 1;       /* of stream position seq + k */
            for (int k = 0; k < nf; k++, t0 += NW * TT) {
                mbar_wait(bar_s + 8 * st, ph);
                if constexpr (D == 128) {
                    RawT R;
                    load_stage<F, SUB>(R, wa + st * Stg<F>::BYTES, lo, misk, misv, lane);
                    process(R, t0, false);
                } else {
                    using G = Stg256<F>;
                    const char *const sg = wa + st * G::BYTES;
                    const Tile256<F, false> S = {sg, sg, lo, 0, g, c};
                    process_w(S, reinterpret_cast<const uint16_t *>(sg + G::KS_OFF)[misk + lane],
                              reinterpret_cast<const uint16_t *>(sg + G::VS_OFF)[misv + lane], t0, false);
                }
                if (k + ST < avail && k + ST >= pre) { /* the stage's values are consumed */
                    __syncwarp();
                    issue(k + ST, st);                         /* position k + ST: the same stage */
                }
                if (++st == ST) {
                    st = 0;
                    ph ^= 1;
                }
            }
            seq += (uint32_t)nf;
            /* positions of the next item issued so far: those below ST + nf (or all) */
            pre = min(max(pre, nf + ST) - nf, nxt_nf);
        } else if (nf > 0) {
            /* two named buffers so that nothing is copied */
            RawT ra, rb;
            load_tile<F, SUB, false>(ra, P.base, col, lo, t0, 0, g, c, lane);
            for (;;) {
                int tn = t0 + NW * TT;
                bool more = tn + TT <= fast_end;
                if (more) load_tile<F, SUB, false>(rb, P.base, col, lo, tn, 0, g, c, lane);
                process(ra, t0, false);
                t0 = tn;
                if (!more) break;
                tn = t0 + NW * TT;
                more = tn + TT <= fast_end;
                if (more) load_tile<F, SUB, false>(ra, P.base, col, lo, tn, 0, g, c, lane);
                process(rb, t0, false);
                t0 = tn;
                if (!more) break;
            }
        }
        // ---- remaining tiles: partial, or reaching into the q8 window --------------------
        for (; t0 < z; t0 += NW * TT) {
            if constexpr (D == 128) {
                RawT cur;
                load_tile<F, SUB, true>(cur, P.base, col, lo, t0, fast_end, g, c, lane);
                process(cur, t0, true);
            } else {                          /* from global memory: the plain layout */
                constexpr int PAY = Fmt<F, D>::PAY;
                const size_t tt = col + (size_t)t0;
                const Tile256<F, true> S = {reinterpret_cast<const char *>(P.base.kb + tt * PAY),
                                            reinterpret_cast<const char *>(P.base.vb + tt * PAY),
                                            lane_off256<F, false>(g, c), fast_end - t0, g, c};
                const bool ok = t0 + lane < fast_end;
                process_w(S, ok ? (uint32_t)__ldg(P.base.ksb + tt + lane) : 0u,
                          ok ? (uint32_t)__ldg(P.base.vsb + tt + lane) : 0u, t0, true);
            }
        }

        // ---- merge the group's warps: 2 + 3 into 0 + 1, then 1 into 0, in registers ----
        /* exchange slots, lane-major (conflict free): element j = (i, e, k) of lane l. tq4, tq2:
         * in the table's holes (the stages hold the next item's tiles); tq3, tq4/tq2: after
         * s_pre; bf16: the warp areas of warps 0 and 1. */
        auto slot_off = [&](int s_, int j) {
            if constexpr (F == F_BF16) return (wc0 + s_) * warp_area<F, ST, D>() + (j * 32 + lane) * 4;
            else if constexpr (xs_after<F>()) return smem_xs<F, NG, ST, D>() + ((grp * 2 + s_) * (4 * NM) + j) * 128 + lane * 4;
            else return ((grp * 2 + s_) * (4 * NM) + j) * 256 + 128 + lane * 4;
        };
#pragma unroll
        for (int k = 0; k < 2; k++)
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) l[k] += __shfl_xor_sync(0xffffffffu, l[k], o);
        float4 *const s_ml = s_mlg + grp * 2 * 4;             /* [slot][c] */
        /* acc[i][2 e + k] of this lane in slot s_ */
        auto slot = [&](int s_, int i, int e, int k) -> float & {
            return *reinterpret_cast<float *>(sbytes + slot_off(s_, (i * 2 + e) * 2 + k));
        };
        auto put = [&](int s_) {
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int k = 0; k < 2; k++) slot(s_, i, e, k) = acc[i][2 * e + k];
            if (g == 0) s_ml[s_ * 4 + c] = make_float4(m[0], m[1], l[0], l[1]);
        };
        auto take = [&](int s_) {
            const float4 o = s_ml[s_ * 4 + c];
            const float mo[2] = {o.x, o.y}, lo2[2] = {o.z, o.w};
            float fa[2], fb[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const float M = fmaxf(m[k], mo[k]);
                fa[k] = m[k] == -INFINITY ? 0.0f : exp2f(m[k] - M);
                fb[k] = mo[k] == -INFINITY ? 0.0f : exp2f(mo[k] - M);
                m[k] = M;
                l[k] = l[k] * fa[k] + lo2[k] * fb[k];
            }
#pragma unroll
            for (int i = 0; i < NM; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int k = 0; k < 2; k++) acc[i][2 * e + k] = acc[i][2 * e + k] * fa[k] + slot(s_, i, e, k) * fb[k];
        };
        if (w >= 2) put(w - 2);
        if (gt == 0) s_next[wc0] = claim;
        grp_sync(grp);
        const int claimed = s_next[wc0];    /* read before the next barrier (then rewritten) */
        if (w < 2) take(w);
        __syncwarp();                       /* s_ml read by the whole warp before lanes 0-3 rewrite it */
        if (w == 1) put(1);                 /* its own slot, just read */
        grp_sync(grp);
        if (w == 0) take(1);
        grp_sync(grp);                /* the slots are read before the next item writes them */
        if (w == 0) {
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const int hd = 2 * c + k;
                if (hd >= G) continue;
                const size_t pi = ((size_t)r * P.qh + (size_t)h * G + hd) * P.nsmax + sp;
                /* 16-byte stores: four consecutive dims of vdim() per store (a quarter of the
                 * L2 sectors of 4-byte stores) */
                float *const dst = P.po + pi * D;
                if constexpr (F == F_BF16 || F == F_FP8) {  /* vdim(g, i, e) = 16 g + 2 i + e */
#pragma unroll
                    for (int i = 0; i < 8; i += 2)
                        *reinterpret_cast<float4 *>(dst + vdim<F>(g, i, 0)) =
                            make_float4(acc[i][k], acc[i][2 + k], acc[i + 1][k], acc[i + 1][2 + k]);
                } else {                      /* vdim(g, 4 q + t, e) = vdim(g, 4 q, e) + t (also vdim256) */
#pragma unroll
                    for (int e = 0; e < 2; e++)
#pragma unroll
                        for (int q4 = 0; q4 < NM; q4 += 4)
                            *reinterpret_cast<float4 *>(dst + vdim_of<F, D>(g, q4, e)) =
                                make_float4(acc[q4][2 * e + k], acc[q4 + 1][2 * e + k], acc[q4 + 2][2 * e + k],
                                            acc[q4 + 3][2 * e + k]);
                }
                if (g == 0) P.pml[pi] = make_float2(m[k], l[k]);
            }
        }
        item = nxt_item;
        nxt_item = claims ? claimed : total;
        cur = locate(item);
    }
    /* the last group out resets the counters for the next launch (stream order publishes it) */
    if (claims && (threadIdx.x & (NW * 32 - 1)) == 0) {
        __threadfence();
        if (atomicAdd(P.work + 1, 1) == workers - 1) {
            atomicExch(P.work, 0);
            atomicExch(P.work + 1, 0);
        }
    }
}

} // namespace

#endif

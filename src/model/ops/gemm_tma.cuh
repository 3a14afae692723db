/*
 * gemm_tma.cuh - the invariant GEMM's warp-specialised TMA tiles "tl" / "txl" and the
 * clustered "cxl" (Hopper, sm_90a), included by gemm_cuda.cu after gemm_wgmma.cuh, whose k16
 * stage (wg_stage) and epilogue (wg_store) they run unchanged.
 *
 * Same contract and the same arithmetic as wl / wxl: every output adds its k16 steps in
 * ascending order, hi then lo, from 0, in f32, through the same wgmma instruction, operand
 * layout and accumulator places; only the way the stages are filled and the CTAs are
 * scheduled differ. So every output has the bits of every other tile shape.
 *
 * Shape: 384 threads = three warpgroups. Warpgroup 0 is the producer (its registers cut to
 * 40 by setmaxnreg): one thread issues, per k stage, the copy engine's tensor loads
 * (cp.async.bulk.tensor) of the weight tile [128 rows x 64 k] and each activation part's tile
 * [BN tokens x 64 k] with the 128-byte swizzle (the cp.async tiles' chunk layout: chunk c of
 * row r at c ^ (r & 7) once a tile starts on 1024 bytes) into a ring of ST stages, each
 * announced on its mbarrier full[s] with the stage's byte count. Warpgroups 1 and 2 are the
 * consumers (registers raised to 232), weight rows 64 g .. 64 g + 63 (g = 0, 1) of the
 * CTA's 128 and all BN tokens: wait on full[s], queue the stage's 4 x P wgmmas behind the
 * last stage's, wait for the last stage's (wgmma.wait_group 1: they have read their shared
 * memory) and only then release that stage's slot on empty[s] (one arrival per consumer
 * warp, 8). Rows past T or N and k past K are the copy engine's zero fill (the cp.async
 * tiles' zero-size copies likewise leave zeros), so every stage holds the same bytes as the
 * wl / wxl stage; rows past T or N are never stored.
 * Persistent: grid = min(tiles, SMs); CTA b takes tiles b, b + grid, ... in wl's order
 * (token tile fastest), and the ring and its phases run on across tiles, so the producer
 * loads the next tile's first stages while the consumers store this one's outputs.
 * cxl (CL = 2, opt-in): clusters of two CTAs on neighbouring weight tiles of one token tile;
 * each loads its own weight tile and half the activation tile, multicast into both CTAs'
 * stage (same offsets, both full[s] barriers), so L2 serves 2 / 3 of txl's bytes per tile.
 * A slot is then released on both CTAs' empty[s] (16 arrivals), both barriers are set up
 * before either CTA starts (a cluster barrier), and a producer exits only once its slots'
 * last uses are released (the other CTA's remote arrivals have landed).
 * Phases: stage s's i-th use (i = it / ST over the CTA's running stage count it) waits on
 * full[s] with parity i & 1; the producer refills it (i >= 1) after empty[s]'s (i - 1)-th
 * completion, parity (i - 1) & 1. A slot is never more than one phase ahead of its waiter.
 */
#pragma once

#include <cuda.h> /* CUtensorMap and its enums (types only: the encoder comes from the runtime) */

// ---------------------------------------------------------------------------
// PTX: mbarriers, the copy engine's tensor loads, register reallocation
// ---------------------------------------------------------------------------

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mb_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* the inits visible to the copy engine (async proxy) before any use */
__device__ __forceinline__ void mb_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
/* one arrival (the producer's) that also expects `bytes` of transactions this phase */
__device__ __forceinline__ void mb_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* until the phase of parity `parity` has completed (acquire) */
__device__ __forceinline__ void mb_wait(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
/* box of map at (c0 inner, c1[, c2]) -> shared dst, completing bytes on bar */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1,
                                            int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
/* cluster of two (cxl): the box lands at dst's offset in every CTA of ctas (a bit mask) and
 * completes its bytes on each one's barrier at bar's offset */
__device__ __forceinline__ void tma_load_3d_mc(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1,
                                               int c2, uint16_t ctas) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4, %5}], [%2], %6;\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(ctas)
                 : "memory");
}
/* one arrival on the barrier at bar's offset in cluster CTA `cta` (release, cluster scope) */
__device__ __forceinline__ void mb_arrive_cta(uint32_t bar, uint32_t cta) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar), "r"(cta) : "memory");
}
/* mb_wait, acquiring at cluster scope (the arrivals of the other CTA's consumers) */
__device__ __forceinline__ void mb_wait_cluster(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
/* every thread of the cluster's CTAs (all warps converged) */
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
template <int R> __device__ __forceinline__ void reg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void reg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
#else
__device__ __forceinline__ void mb_init(uint32_t, uint32_t) {}
__device__ __forceinline__ void mb_init_fence() {}
__device__ __forceinline__ void mb_expect_tx(uint32_t, uint32_t) {}
__device__ __forceinline__ void mb_arrive(uint32_t) {}
__device__ __forceinline__ void mb_wait(uint32_t, uint32_t) {}
__device__ __forceinline__ void tma_load_2d(uint32_t, const CUtensorMap *, uint32_t, int, int) {}
__device__ __forceinline__ void tma_load_3d(uint32_t, const CUtensorMap *, uint32_t, int, int, int) {}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *) {}
__device__ __forceinline__ void tma_load_3d_mc(uint32_t, const CUtensorMap *, uint32_t, int, int, int, uint16_t) {}
__device__ __forceinline__ void mb_arrive_cta(uint32_t, uint32_t) {}
__device__ __forceinline__ void mb_wait_cluster(uint32_t, uint32_t) {}
__device__ __forceinline__ uint32_t cluster_rank() { return 0; }
__device__ __forceinline__ void cluster_sync() {}
template <int R> __device__ __forceinline__ void reg_dec() {}
template <int R> __device__ __forceinline__ void reg_inc() {}
#endif

// ---------------------------------------------------------------------------
// the tile
// ---------------------------------------------------------------------------

/* WTile's stages (the consumers' wg_stage / wg_store read C::BN, C::WBYTES, C::XBYTES), then
 * the mbarriers full[ST], empty[ST]; SMEM: + the 1024-byte alignment + the barriers. CL: CTAs
 * per cluster (1: tl / txl; 2: cxl, each CTA loading half of the activation tile for both). */
template <int BN, int P, int ST, int CL> struct TTile {
    using C = WTile<BN, P, ST>;
    static constexpr int THREADS = 384, BARS = ST * C::STAGE;
    static constexpr int SMEM = ST * C::STAGE + 1024 + 16 * ST;
    static constexpr int ARRIVALS = 8 * CL; /* empty[s]: each consumer warp of each CTA */
    static constexpr int XROWS = BN / CL;   /* an activation box's rows: this CTA's share */
    static_assert(SMEM <= 227 * 1024 && (CL == 1 || CL == 2) && XROWS % 8 == 0, "shape");
};

/* The CTA's work in order: unit u (u = first, first + step, .. < units) is tokens
 * (u % ntt) BN .. and weight rows ((u / ntt) CL + rank) 128 ..: a cluster's CTAs take
 * neighbouring weight tiles of one token tile (CL = 2 needs an even count of them). */
struct TSched {
    int ntt, units, first, step, rank;
};

template <int BN, int CL> __device__ __forceinline__ int sched_t0(const TSched &sc, int u) { return (u % sc.ntt) * BN; }
template <int BN, int CL> __device__ __forceinline__ int sched_n0(const TSched &sc, int u) {
    return ((u / sc.ntt) * CL + sc.rank) * 128;
}

/* A consumer warp's release of a slot (its wgmmas retired): CL = 1 on this CTA's barrier;
 * CL = 2 on both CTAs' (each multicast half into both, so each producer waits for both). */
template <int CL> __device__ __forceinline__ void tma_release(uint32_t bar) {
    if (CL == 1) {
        mb_arrive(bar);
    } else {
        mb_arrive_cta(bar, 0);
        mb_arrive_cta(bar, 1);
    }
}

/* Producer (one thread): every k stage of every unit of this CTA, in order, into the ring;
 * CL = 2: then waits until every slot's last use is released by both CTAs' consumers (their
 * arrivals on this CTA's barriers have landed: it may exit). */
template <int BN, int P, int ST, int CL>
__device__ __forceinline__ void tma_produce(const CUtensorMap *wmap, const CUtensorMap *xmap, uint32_t sbase,
                                            TSched sc, int nk) {
    using C = WTile<BN, P, ST>;
    constexpr int XR = TTile<BN, P, ST, CL>::XROWS;
    const uint32_t full = sbase + TTile<BN, P, ST, CL>::BARS, empty = full + 8 * ST;
    tma_prefetch_map(wmap);
    tma_prefetch_map(xmap);
    cuda_pdl_wait(); /* a programmatic launch: the kernel that wrote xb has completed */
    uint32_t it = 0;
    for (int u = sc.first; u < sc.units; u += sc.step) {
        const int t0 = sched_t0<BN, CL>(sc, u), n0 = sched_n0<BN, CL>(sc, u);
        for (int kt = 0; kt < nk; kt++, it++) {
            const uint32_t s = it % ST, st = sbase + s * C::STAGE, fb = full + 8 * s;
            if (it >= (uint32_t)ST) { /* slot s's last use released */
                if (CL == 1) mb_wait(empty + 8 * s, ((it / ST) - 1) & 1);
                else mb_wait_cluster(empty + 8 * s, ((it / ST) - 1) & 1);
            }
            mb_expect_tx(fb, (uint32_t)C::STAGE); /* the boxes' bytes, zero fill included */
            tma_load_2d(st, wmap, fb, 64 * kt, n0);
#pragma unroll
            for (int p = 0; p < P; p++) {
                const uint32_t xs = st + C::WBYTES + p * C::XBYTES + sc.rank * XR * 128;
                if (CL == 1) tma_load_3d(xs, xmap, fb, 64 * kt, t0, p);
                else tma_load_3d_mc(xs, xmap, fb, 64 * kt, t0 + sc.rank * XR, p, (uint16_t)3);
            }
        }
    }
    for (int j = 0; CL == 2 && j < ST; j++, it++)
        if (it >= (uint32_t)ST) mb_wait_cluster(empty + 8 * (it % ST), ((it / ST) - 1) & 1);
}

/* Consumer warpgroup wg (0, 1): weight rows 64 wg .. of every unit of this CTA. */
template <int BN, int P, int ST, int CL>
__device__ __forceinline__ void tma_consume(int T, int N, const float *__restrict__ bias, float *__restrict__ y,
                                            size_t ldy, uint32_t sbase, TSched sc, int nk, int wg) {
    using C = WTile<BN, P, ST>;
    const uint32_t full = sbase + TTile<BN, P, ST, CL>::BARS, empty = full + 8 * ST;
    const bool lead = (threadIdx.x & 31) == 0;
    cuda_pdl_wait(); /* y: a programmatic launch writes only after the kernel ahead completed */
    uint32_t it = 0;
    for (int u = sc.first; u < sc.units; u += sc.step) {
        float d[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
        for (int kt = 0; kt < nk; kt++, it++) {
            const uint32_t s = it % ST;
            mb_wait(full + 8 * s, (it / ST) & 1);       /* stage it has landed */
            __syncwarp();                                /* converged for the .aligned wgmmas */
            wg_stage<C, P>(d, sbase + s * C::STAGE, wg); /* queued behind stage it - 1's */
            wg_wait<1>();                                /* stage it - 1's wgmmas are done */
            if (kt > 0 && lead) tma_release<CL>(empty + 8 * ((it - 1) % ST)); /* ... its slot is free */
        }
        __syncwarp(); /* converged after the lead's release, for the .aligned wait */
        wg_wait<0>();
        if (lead) tma_release<CL>(empty + 8 * ((it - 1) % ST));
        wg_store<C>(d, T, N, bias, y, ldy, sched_t0<BN, CL>(sc, u), sched_n0<BN, CL>(sc, u) + 64 * wg);
    }
}

/* wmap: W [N rows][K] bf16, box 64 x 128; xmap: xb [P][T][K] bf16, box 64 x BN / CL x 1;
 * both 128-byte swizzle, zero fill. grid: CL x min(units, resident clusters) (units = token
 * tiles x weight tiles / CL), clusters of CL, block 384, dynamic shared TTile::SMEM. */
template <int BN, int P, int ST, int CL>
__global__ void __launch_bounds__(384, 1)
gemm_tma_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, int T, int K,
                int N, const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    GEMM_WG_TRAP();
    using TT = TTile<BN, P, ST, CL>;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(sm) + 1023u) & ~1023u;
    const uint32_t full = sbase + TT::BARS, empty = full + 8 * ST;
    const int ntt = (T + BN - 1) / BN;
    const TSched sc = {ntt, ntt * ((N + 127) / 128) / CL, (int)blockIdx.x / CL, (int)gridDim.x / CL,
                       CL == 1 ? 0 : (int)cluster_rank()};
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < ST; s++) {
            mb_init(full + 8 * s, 1); /* the producer's expect_tx arrival (+ the bytes) */
            mb_init(empty + 8 * s, TT::ARRIVALS);
        }
        mb_init_fence();
    }
    if (CL == 1) {
        __syncthreads();
    } else {
        __syncwarp();   /* thread 0's warp converged for the .aligned cluster barrier */
        cluster_sync(); /* both CTAs' barriers are set up before any multicast or remote arrival */
    }
    if (threadIdx.x < 128) {
        reg_dec<40>();
        if (threadIdx.x == 0) tma_produce<BN, P, ST, CL>(&wmap, &xmap, sbase, sc, (K + 63) / 64);
    } else {
        reg_inc<232>();
        tma_consume<BN, P, ST, CL>(T, N, bias, y, ldy, sbase, sc, (K + 63) / 64, (threadIdx.x >> 7) - 1);
    }
}

// ---------------------------------------------------------------------------
// s8t: the decode tile (gemm_cuda.cu's gemm_tile at 16 weight rows a warp, 8 tokens)
// fed by the copy engine
// ---------------------------------------------------------------------------

/* s8n (one warp, 16 stages of cp.async) issues an instruction every three cycles with one
 * warp an SM (Nsight Compute, 2048 x 4096 at one token): the per-lane copies' addresses,
 * predicates and zero-size token copies. Here a producer warp's one thread issues each
 * stage's weight box [BM rows x 64 k] and token boxes [8 x 64 k] per part (rows past T or N
 * zero-filled, as the cp.async tiles' zero-size copies) and NW consumer warps run gemm_stage
 * on them unchanged: the same bytes in the same swizzled slots, the same mma steps in the
 * same order, so the same bits. A slot is released (empty[s], one arrival per consumer warp)
 * once the warp's mmas have their fragments, i.e. its ldmatrix reads are done. Measured on an
 * H100 (bench/RESULTS.md "Session 17"): 37% fewer instructions, 20.2 -> 16.0 us at Nsight's
 * locked clocks, 0.8-1.5% on a 1-row decode step: what is left is each output's chain of
 * K / 16 dependent mmas (stall reason "wait"). */
template <int NW, int P, int ST> struct STile {
    static constexpr int THREADS = 32 * (NW + 1), BM = 16 * NW, BN = 8;
    static constexpr int WBYTES = BM * 128, XBYTES = BN * 128, STAGE = WBYTES + P * XBYTES;
    static constexpr int BARS = ST * STAGE, SMEM = ST * STAGE + 1024 + 16 * ST;
    static_assert(STAGE % 1024 == 0 && SMEM <= 227 * 1024 && ST >= 2, "stages start on 1024 bytes");
};

/* The producer (one thread): the first ST stages' weight boxes before the grid dependency
 * wait (no kernel writes W), their token boxes after it, then every later stage once its
 * slot's last use is released. */
template <int NW, int P, int ST>
__device__ __forceinline__ void st_produce(const CUtensorMap *wmap, const CUtensorMap *xmap, uint32_t sbase,
                                          int t0, int n0, int nk) {
    using C = STile<NW, P, ST>;
    const uint32_t full = sbase + C::BARS, empty = full + 8 * ST;
    tma_prefetch_map(wmap);
    tma_prefetch_map(xmap);
    const int pre = nk < ST ? nk : ST;
    for (int kt = 0; kt < pre; kt++) {
        mb_expect_tx(full + 8 * kt, (uint32_t)C::STAGE); /* the boxes' bytes, zero fill included */
        tma_load_2d(sbase + kt * C::STAGE, wmap, full + 8 * kt, 64 * kt, n0);
    }
    cuda_pdl_wait(); /* a programmatic launch: the kernel that wrote xb has completed */
    cuda_pdl_trigger(); /* a programmatic kernel after this one may launch (and wait) */
    for (int kt = 0; kt < nk; kt++) {
        const uint32_t s = kt % ST, st = sbase + s * C::STAGE, fb = full + 8 * s;
        if (kt >= ST) {
            mb_wait(empty + 8 * s, ((kt / ST) - 1) & 1);
            mb_expect_tx(fb, (uint32_t)C::STAGE);
            tma_load_2d(st, wmap, fb, 64 * kt, n0);
        }
#pragma unroll
        for (int p = 0; p < P; p++) tma_load_3d(st + C::WBYTES + p * C::XBYTES, xmap, fb, 64 * kt, t0, p);
    }
}

/* wmap: W [N rows][K] bf16, box 64 x BM; xmap: xb [P][T][K] bf16, box 64 x 8 x 1; both
 * 128-byte swizzle, zero fill. grid (ceil(T / 8), ceil(N / BM)), block 32 (NW + 1), dynamic
 * shared STile::SMEM. Warp NW produces; warps 0 .. NW - 1 take 16 weight rows each. */
template <int NW, int P, int ST>
__global__ void __launch_bounds__(32 * (NW + 1))
gemm_st_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, int T, int K,
               int N, const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    GEMM_WG_TRAP();
    using C = STile<NW, P, ST>;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(sm) + 1023u) & ~1023u;
    const uint32_t full = sbase + C::BARS, empty = full + 8 * ST;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nk = (K + 63) / 64;
    const int t0 = blockIdx.x * C::BN, n0 = blockIdx.y * C::BM;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; s++) {
            mb_init(full + 8 * s, 1); /* the producer's expect_tx arrival (+ the bytes) */
            mb_init(empty + 8 * s, NW);
        }
        mb_init_fence();
    }
    __syncthreads();
    if (warp == NW) {
        if (lane == 0) st_produce<NW, P, ST>(&wmap, &xmap, sbase, t0, n0, nk);
        return;
    }
    float acc[1][1][4] = {{{0.f, 0.f, 0.f, 0.f}}};
    for (int kt = 0; kt < nk; kt++) {
        const uint32_t s = kt % ST;
        mb_wait(full + 8 * s, (kt / ST) & 1);
        gemm_stage<C, 1, 1, P>(acc, sbase + s * C::STAGE, 16 * warp, 0, lane);
        __syncwarp();
        if (lane == 0) mb_arrive(empty + 8 * s);
    }
    cuda_pdl_wait(); /* y: a programmatic launch writes only after the kernel ahead completed */
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int n = n0 + 16 * warp + g + (q >> 1) * 8, t = t0 + 2 * c + (q & 1);
        if (n < N && t < T) y[(size_t)t * ldy + n] = bias ? acc[0][0][q] + bias[n] : acc[0][0][q];
    }
}

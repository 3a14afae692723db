/*
 * gemm_wgmma.cuh - the invariant GEMM's warpgroup tiles (Hopper wgmma, sm_90a), included by
 * gemm_cuda.cu after its Tile, loaders and PTX helpers.
 *
 * Same contract as the mma.sync tiles: every output adds its k16 steps in ascending order,
 * hi then lo, from 0, in f32. One wgmma k16 step rounds exactly as one mma.sync m16n8k16 step
 * (dev/experiments/wgmma_probe.cu: 61,440 outputs of spread-exponent bf16 inputs, K 16..4096,
 * bitwise equal on an H100), so these tiles give every output the bits of every other shape.
 *
 * Shape: a CTA is two warpgroups (256 threads); warpgroup g owns weight rows 64 g .. 64 g + 63
 * of the CTA's BM = 128 and all BN tokens (BN = 128: "wl"; 256: "wxl"). Stages are the
 * mma.sync tiles' own (cp.async by every thread into 128-byte rows, chunk c of row r at
 * c ^ (r & 7)): that is wgmma's 128-byte swizzle when a tile starts on 1024 bytes, so the
 * stage buffer is aligned to 1024 and read through K-major SWIZZLE_128B descriptors.
 * Per stage: wait for its copies, make them visible to the async proxy, barrier, queue its
 * 4 x P wgmmas behind the last stage's, wait for the last stage's (not this one's), barrier,
 * then refill the last stage's slot: the tensor cores always hold a stage's work.
 */
#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_WG_TRAP() __trap() /* built without sm_90a: the host never picks these shapes */
#else
#define GEMM_WG_TRAP()
#endif

// ---------------------------------------------------------------------------
// PTX: descriptors, fences, the k16 step
// ---------------------------------------------------------------------------

/* K-major SWIZZLE_128B shared-memory descriptor: start >> 4 (bits 0-13), leading offset 1
 * (unused when swizzled), stride 1024 >> 4 between 8-row groups (bits 32-45), layout 1 =
 * 128-byte swizzle (bits 62-63). Advancing k by 16 adds 32 bytes to the start. */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define WG_F8(i)                                                                                   \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),     \
        "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_F64(i)                                                                                  \
    WG_F8(i), WG_F8(i + 8), WG_F8(i + 16), WG_F8(i + 24), WG_F8(i + 32), WG_F8(i + 40),           \
        WG_F8(i + 48), WG_F8(i + 56)

/* d [64 x 128] += A . B^T over one k16 step, A and B K-major in shared memory (descriptors) */
__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_F64(0)
                 : "l"(da), "l"(db));
}
/* d [64 x 256] += A . B^T over one k16 step, A and B K-major in shared memory (descriptors) */
__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : WG_F64(0), WG_F64(64)
                 : "l"(da), "l"(db));
}
#undef WG_F64
#undef WG_F8
#else
__device__ __forceinline__ void wg_fence() {}
__device__ __forceinline__ void wg_commit() {}
template <int N> __device__ __forceinline__ void wg_wait() {}
__device__ __forceinline__ void wg_proxy_fence() {}
__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint64_t, uint64_t) { (void)d; }
__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t, uint64_t) { (void)d; }
#endif

template <int BN> __device__ __forceinline__ void wgmma_step(float (&d)[BN / 2], uint64_t da, uint64_t db) {
    if constexpr (BN == 128) wgmma_n128(d, da, db);
    else wgmma_n256(d, da, db);
}

// ---------------------------------------------------------------------------
// the tile
// ---------------------------------------------------------------------------

/* The loaders' view (gemm_load_w / gemm_load_x): 256 threads, BM = 128, BN tokens. */
template <int BN_, int P, int ST> struct WTile {
    static constexpr int THREADS = 256, BM = 128, BN = BN_;
    static constexpr int WBYTES = BM * 128, XBYTES = BN * 128, STAGE = WBYTES + P * XBYTES;
    static constexpr int SMEM = ST * STAGE + 1024; /* + the 1024-byte alignment */
    static constexpr int WCP = BM * 8 / THREADS, XCP = BN * 8 / THREADS;
    static_assert(STAGE % 1024 == 0 && ST >= 2, "stages start on 1024 bytes");
};

/* One stage's k16 steps: per step kk, per part p, d += W[rows of this warpgroup][k] . X_p[k]. */
template <class C, int P>
__device__ __forceinline__ void wg_stage(float (&d)[C::BN / 2], uint32_t st, int wg) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int p = 0; p < P; p++)
            wgmma_step<C::BN>(d, wg_desc(st + wg * 64 * 128 + 32 * kk),
                              wg_desc(st + C::WBYTES + p * C::XBYTES + 32 * kk));
    wg_commit();
}

/* y[t * ldy + n] = d (+ bias[n]) for this thread's outputs: warp w of the warpgroup holds rows
 * 16 w + g (+ 8), and per 8-token block j the tokens 8 j + 2 c (+ 1). */
template <class C>
__device__ __forceinline__ void wg_store(const float (&d)[C::BN / 2], int T, int N, const float *bias,
                                         float *y, size_t ldy, int t0, int n0) {
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < C::BN / 2; i++) {
        const int n = n0 + 16 * w + g + 8 * ((i >> 1) & 1), t = t0 + 8 * (i >> 2) + 2 * c + (i & 1);
        if (n < N && t < T) y[(size_t)t * ldy + n] = bias ? d[i] + bias[n] : d[i];
    }
}

/* One CTA's tile: weight rows n0 .. n0 + 128, tokens t0 .. t0 + BN of T (parts TS rows apart). */
template <int BN, int P, int ST>
__device__ __forceinline__ void gemm_wg_tile(const uint16_t *__restrict__ xb, int T, int TS, int K,
                                             const uint16_t *__restrict__ w, int N,
                                             const float *__restrict__ bias, float *__restrict__ y,
                                             size_t ldy, int t0, int n0) {
    GEMM_WG_TRAP();
    using C = WTile<BN, P, ST>;
    extern __shared__ __align__(128) uint8_t sm[];
    const uint32_t sbase = ((uint32_t)__cvta_generic_to_shared(sm) + 1023u) & ~1023u;
    const int wg = threadIdx.x >> 7, nk = (K + 63) / 64;
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    gemm_prologue<C, P, ST>(sbase, w, N, xb, T, TS, K, n0, t0, nk); /* the mma.sync tile's */
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait<ST - 2>(); /* stage kt has landed (this thread's copies) */
        wg_proxy_fence();        /* ... and is visible to the wgmma's async proxy */
        __syncthreads();         /* ... everyone's */
        wg_stage<C, P>(d, sbase + (kt % ST) * C::STAGE, wg); /* queued behind stage kt - 1's */
        wg_wait<1>();            /* stage kt - 1's wgmmas are done (this warpgroup's) */
        __syncthreads();         /* ... both warpgroups': its slot is free */
        const int nx = kt + ST - 1;
        if (nx < nk) gemm_load<C, P>(sbase + (nx % ST) * C::STAGE, w, N, xb, T, TS, K, n0, t0, nx);
        cp_async_commit();
    }
    wg_wait<0>();
    cp_async_wait<0>();
    wg_store<C>(d, T, N, bias, y, ldy, t0, n0 + 64 * wg);
}

/* grid (ceil(T / BN), ceil(N / 128)), block 256, dynamic shared memory WTile::SMEM. */
template <int BN, int P, int ST>
__global__ void __launch_bounds__(256, 1)
gemm_wg_kernel(const uint16_t *__restrict__ xb, int T, int K, const uint16_t *__restrict__ w, int N,
               const float *__restrict__ bias, float *__restrict__ y, size_t ldy) {
    gemm_wg_tile<BN, P, ST>(xb, T, T, K, w, N, bias, y, ldy, blockIdx.x * BN, blockIdx.y * 128);
}

// wgmma_probe.cu - does Hopper's wgmma give the same bits as mma.sync for one bf16 GEMM
// whose every output is one running f32 sum over K's k16 steps in ascending order?
//
// The invariant GEMM (src/model/ops/gemm_cuda.cu) is built on mma.sync m16n8k16 with that
// order for every tile shape, so any tile gives a row the same bits at any T. A wgmma tile
// (warpgroup MMA, the instruction Hopper's fast GEMMs use) can join it only if one k16 step
// of wgmma rounds exactly as one of mma.sync. This probe runs both over the same inputs:
//   mma.sync : 4 warps, warp w owns rows 16w..16w+15, D += A(16x16) B(16x8) per k16 step;
//   wgmma    : one warpgroup, m64n8k16, A from registers (the same fragments), B from shared
//              memory (no swizzle, K-major core matrices), D += per k16 step, waited each step;
// and counts outputs whose bits differ, beside the error of each against a float64 sum.
// Inputs: random bf16 with exponents spread over 2^-8..2^8 (cancellation and alignment
// shifts inside a k16 step, where rounding differences would show).
// Build: nvcc -O2 -gencode arch=compute_90a,code=sm_90a -o wgmma_probe dev/experiments/wgmma_probe.cu
// Run:   ./wgmma_probe [trials]     (prints one line per K, then a verdict; exit 1 if differ)
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_common.cuh"

#define M 64
#define N 8

// ---- fragments (A row-major [M, K], B stored [N, K]: K contiguous per column n) ----------

// A fragment of m16n8k16 for rows r0..r0+15, k step s (PTX ISA "mma.m16n8k16", .bf16)
__device__ static void load_a(const __nv_bfloat16 *A, int K, int r0, int s, uint32_t a[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, k0 = s * 16;
    const __nv_bfloat16 *p = A + (size_t)(r0 + g) * K + k0 + t * 2;
    a[0] = *(const uint32_t *)(p);
    a[1] = *(const uint32_t *)(p + 8 * K);
    a[2] = *(const uint32_t *)(p + 8);
    a[3] = *(const uint32_t *)(p + 8 * K + 8);
}

// ---- mma.sync reference order ------------------------------------------------------------

__global__ void mma_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, float *D, int K) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float d[4] = {0, 0, 0, 0};
    for (int s = 0; s < K / 16; s++) {
        uint32_t a[4], b[2];
        load_a(A, K, 16 * w, s, a);
        const __nv_bfloat16 *pb = B + (size_t)g * K + s * 16 + t * 2; // column n = g
        b[0] = *(const uint32_t *)pb;
        b[1] = *(const uint32_t *)(pb + 8);
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    const int r = 16 * w + g;
    D[r * N + t * 2] = d[0];
    D[r * N + t * 2 + 1] = d[1];
    D[(r + 8) * N + t * 2] = d[2];
    D[(r + 8) * N + t * 2 + 1] = d[3];
}

// ---- wgmma m64n8k16, A in registers, B in shared memory ----------------------------------

// Shared-memory matrix descriptor, no swizzle: start >> 4, leading (K direction) byte offset
// >> 4 at bit 16, stride (N direction) byte offset >> 4 at bit 32.
__device__ static uint64_t smem_desc(const void *p, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(sbo >> 4) << 32);
}

__global__ void wgmma_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, float *D, int K,
                             int lbo_first) {
    // B tile of one k16 step: two core matrices (k 0..7, k 8..15), each 8 rows (n) x 16 bytes
    __shared__ __align__(128) __nv_bfloat16 sb[2][N][8];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    float d[4] = {0, 0, 0, 0};
    for (int s = 0; s < K / 16; s++) {
        __syncthreads();
        if (threadIdx.x < 2 * N * 8 / 2) { // 64 threads store 2 values each
            const int i = threadIdx.x * 2, c = i / (N * 8), n = (i / 8) % N, k = i % 8;
            sb[c][n][k] = B[(size_t)n * K + s * 16 + c * 8 + k];
            sb[c][n][k + 1] = B[(size_t)n * K + s * 16 + c * 8 + k + 1];
        }
        __syncthreads();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        uint32_t a[4];
        load_a(A, K, 16 * w, s, a);
        const uint64_t desc = lbo_first ? smem_desc(&sb[0][0][0], 128, 256)
                                        : smem_desc(&sb[0][0][0], 256, 128);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    (void)g;
    const int r = 16 * w + (lane >> 2);
    D[r * N + t * 2] = d[0];
    D[r * N + t * 2 + 1] = d[1];
    D[(r + 8) * N + t * 2] = d[2];
    D[(r + 8) * N + t * 2 + 1] = d[3];
}

// ---- host: inputs, float64 reference, comparison -----------------------------------------

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}
static float spread(void) { // sign * 2^U(-8, 8) * U(1, 2)
    const double v = ldexp(1.0 + urand(), (int)floor(urand() * 16) - 8);
    return (float)(urand() < 0.5 ? -v : v);
}

// One trial at K: returns outputs whose bits differ; err[0..1] get max |x - ref| / sum |a b|.
static int trial(int K, int lbo_first, double err[2]) {
    const size_t na = (size_t)M * K, nb = (size_t)N * K;
    __nv_bfloat16 *ha = (__nv_bfloat16 *)malloc(na * 2), *hb = (__nv_bfloat16 *)malloc(nb * 2);
    for (size_t i = 0; i < na; i++) ha[i] = __float2bfloat16(spread());
    for (size_t i = 0; i < nb; i++) hb[i] = __float2bfloat16(spread());
    __nv_bfloat16 *da, *db;
    float *d1, *d2, h1[M * N], h2[M * N];
    CK(cudaMalloc(&da, na * 2));
    CK(cudaMalloc(&db, nb * 2));
    CK(cudaMalloc(&d1, sizeof h1));
    CK(cudaMalloc(&d2, sizeof h2));
    CK(cudaMemcpy(da, ha, na * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, hb, nb * 2, cudaMemcpyHostToDevice));
    mma_kernel<<<1, 128>>>(da, db, d1, K);
    wgmma_kernel<<<1, 128>>>(da, db, d2, K, lbo_first);
    CK(cudaGetLastError());
    CK(cudaMemcpy(h1, d1, sizeof h1, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2, d2, sizeof h2, cudaMemcpyDeviceToHost));
    int differ = 0;
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            double ref = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double p = (double)__bfloat162float(ha[(size_t)r * K + k]) *
                                 (double)__bfloat162float(hb[(size_t)n * K + k]);
                ref += p, mag += fabs(p);
            }
            const float x1 = h1[r * N + n], x2 = h2[r * N + n];
            err[0] = fmax(err[0], fabs(x1 - ref) / mag);
            err[1] = fmax(err[1], fabs(x2 - ref) / mag);
            differ += memcmp(&x1, &x2, 4) != 0;
        }
    cudaFree(da), cudaFree(db), cudaFree(d1), cudaFree(d2);
    free(ha), free(hb);
    return differ;
}

int main(int argc, char **argv) {
    const int trials = argc > 1 ? atoi(argv[1]) : 20;
    const int ks[] = {16, 32, 64, 256, 1024, 4096};
    int total = 0, lbo_first = 1;
    for (int pass = 0; pass < 2; pass++) { // find the descriptor's field order by the reference
        double err[2] = {0, 0};
        trial(64, lbo_first, err);
        printf("descriptor %s: mma err %.2e, wgmma err %.2e\n",
               lbo_first ? "LBO=K step" : "LBO=N step", err[0], err[1]);
        if (err[1] < 1e-3) break;
        lbo_first = !lbo_first;
    }
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        double err[2] = {0, 0};
        int differ = 0;
        for (int t = 0; t < trials; t++) differ += trial(ks[i], lbo_first, err);
        total += differ;
        printf("K %5d: %d of %d outputs differ in bits; max err / sum|ab|: mma %.2e wgmma %.2e\n",
               ks[i], differ, trials * M * N, err[0], err[1]);
    }
    printf("verdict: %s\n", total ? "wgmma and mma.sync round differently"
                                  : "wgmma == mma.sync bitwise on every output");
    return total != 0;
}

// kchunk_probe.cu - how fast could a one-token GEMM be if every output summed K in fixed
// chunks (each chunk's k16 steps a running f32 sum from 0, the chunk sums then added in
// ascending chunk order) instead of one running sum over all of K?
//
// Session 17 (bench/RESULTS.md "Session 17") found the invariant GEMM's one-token tiles
// bound by each output's chain of K / 16 dependent mma steps: at N <= 4096 there are one or
// two warps an SM and nothing hides the chain (fewer instructions, deeper pipelines and
// narrower warps all left it at 0.8-1.5%). A fixed chunk length, the same for every T and
// every tile, keeps batch invariance (issue 22: "no split-K that depends on T") and lets a
// CTA run its chunks in parallel warps. This probe times that before anyone changes the
// production order (which changes every output's bits once):
//   base : one warp a CTA, 16 weight rows, one chain over K (the s8n tile's arithmetic);
//   c<KC>: CW warps a CTA on the same 16 rows, warp w taking chunks w, w + CW, .. of KC k;
//          each chunk's sum to shared memory, then lane r of warp 0 adds row r's chunk sums
//          in ascending order.
// Each warp streams its chunk through its own 16-slot cp.async ring (64 k a slot). Inputs are
// random bf16; every output is checked against a float64 sum (relative to sum |x w|).
// Build: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o kchunk_probe dev/experiments/kchunk_probe.cu
// Measured (session 18, bench/RESULTS.md "Session 18"): "base" here is slower than the production
// s8n (78 against 58 us at 4096 x 14336), so the 2-4x it shows at small N overstated the gain;
// the order built on it (tag s18-kchunk) did not move the one-row Llama-8B step.
// Run:   ./kchunk_probe [reps] [--json]   (a table on stderr, one line per shape and variant:
//         us, GB/s, worst error; --json: the same rows as a JSON array on stdout)
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_common.cuh"


enum { SLOT = 16 * 128 + 8 * 128, MAXCH = 64 }; /* a slot: W [16][64 k], x [8][64 k] */

// ---- PTX ---------------------------------------------------------------------------------

__device__ static void cp16(uint32_t dst, const void *src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ static void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int ST> __device__ static void wait_st2() { asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2) : "memory"); }
__device__ static void wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ static void ldsm4(uint32_t (&r)[4], uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ static void ldsm2(uint32_t &r0, uint32_t &r1, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
__device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ static uint32_t swz(int r, int c) { return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4)); }

// ---- the kernel --------------------------------------------------------------------------

/* One slot: W rows n0 .. n0 + 15 and token 0 (rows 1..7 zero) at k 64 kt .., zero past N / K. */
__device__ static void load_slot(uint32_t s, const uint16_t *w, const uint16_t *x, int N, int K, int n0, int kt,
                                 int lane) {
    const int kc = K / 8;
    for (int h = 0; h < 4; h++) {
        const int q = lane + 32 * h, r = q >> 3, c = q & 7, kq = kt * 8 + c;
        const bool ok = n0 + r < N && kq < kc;
        cp16(s + swz(r, c), ok ? (const void *)(w + (size_t)(n0 + r) * K + 8 * kq) : (const void *)w, ok ? 16u : 0u);
    }
    for (int h = 0; h < 2; h++) {
        const int q = lane + 32 * h, r = q >> 3, c = q & 7, kq = kt * 8 + c;
        const bool ok = r == 0 && kq < kc;
        cp16(s + 2048 + swz(r, c), ok ? (const void *)(x + 8 * kq) : (const void *)x, ok ? 16u : 0u);
    }
}

/* Step i of warp w's stages: its (i / spc)-th chunk (w + (i / spc) CW), stage i % spc of it. */
__device__ static int step_kt(int i, int w, int CW, int spc) { return (w + (i / spc) * CW) * spc + i % spc; }

/* grid ceil(N / 16), block 32 CW; each warp an ST-slot ring running on across its chunks.
 * KC: the chunk length (a multiple of 64; K itself: one chain, the s8n arithmetic). */
template <int CW, int ST>
__global__ void __launch_bounds__(32 * CW) chunk_kernel(const uint16_t *w, const uint16_t *x, float *y, int N, int K,
                                                        int KC) {
    extern __shared__ __align__(128) uint8_t sm[];
    __shared__ float part[MAXCH][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n0 = blockIdx.x * 16;
    const int nch = (K + KC - 1) / KC, spc = KC / 64, nkt = (K + 63) / 64;
    const uint32_t ring = (uint32_t)__cvta_generic_to_shared(sm) + warp * ST * SLOT;
    const int mine = warp < nch ? (nch - warp + CW - 1) / CW : 0, last = warp + (mine - 1) * CW;
    const int total = mine ? (mine - 1) * spc + min(spc, nkt - last * spc) : 0;
    for (int s = 0; s < ST - 1; s++) {
        if (s < total) load_slot(ring + s * SLOT, w, x, N, K, n0, step_kt(s, warp, CW, spc), lane);
        commit();
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < total; i++) {
        wait_st2<ST>();
        __syncwarp();
        const int nx = i + ST - 1;
        if (nx < total) load_slot(ring + (nx % ST) * SLOT, w, x, N, K, n0, step_kt(nx, warp, CW, spc), lane);
        commit();
        const uint32_t st = ring + (i % ST) * SLOT;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t a[4], b0, b1;
            ldsm4(a, st + swz(lane & 15, 2 * kk + (lane >> 4)));
            ldsm2(b0, b1, st + 2048 + swz(lane & 7, 2 * kk + ((lane >> 3) & 1)));
            mma(acc, a, b0, b1);
        }
        if (i % spc == spc - 1 || i == total - 1) { /* the chunk's sum; token 0 is d0 / d2 of lanes 4 g */
            const int ch = warp + (i / spc) * CW;
            if ((lane & 3) == 0) {
                part[ch][lane >> 2] = acc[0];
                part[ch][(lane >> 2) + 8] = acc[2];
            }
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
        }
    }
    wait_all();
    __syncthreads();
    if (warp == 0 && lane < 16 && n0 + lane < N) {
        float t = part[0][lane];
        for (int ch = 1; ch < nch; ch++) t += part[ch][lane];
        y[n0 + lane] = t;
    }
}

// ---- host --------------------------------------------------------------------------------

static uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static float bf16_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

template <int CW, int ST>
static double run(const uint16_t *dw, const uint16_t *dx, float *dy, int N, int K, int KC, int reps) {
    const size_t smem = (size_t)CW * ST * SLOT;
    CK(cudaFuncSetAttribute(chunk_kernel<CW, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const dim3 grid((unsigned)((N + 15) / 16));
    chunk_kernel<CW, ST><<<grid, 32 * CW, smem>>>(dw, dx, dy, N, K, KC);
    CK(cudaGetLastError());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    for (int r = 0; r < reps; r++) chunk_kernel<CW, ST><<<grid, 32 * CW, smem>>>(dw, dx, dy, N, K, KC);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3 * ms / reps;
}

/* worst |y - ref| / sum |x w| over the N outputs */
static double check(const float *y, const uint16_t *w, const uint16_t *x, int N, int K) {
    double worst = 0;
    for (int n = 0; n < N; n++) {
        double ref = 0, mag = 0;
        for (int k = 0; k < K; k++) {
            const double p = (double)bf16_float(x[k]) * bf16_float(w[(size_t)n * K + k]);
            ref += p;
            mag += fabs(p);
        }
        const double e = fabs(y[n] - ref) / mag;
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

int main(int argc, char **argv) {
    int reps = 50, json = 0, first = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else reps = atoi(argv[i]);
    }
    if (reps < 1) {
        fprintf(stderr, "usage: kchunk_probe [reps >= 1] [--json]\n");
        return 2;
    }
    if (json) printf("[");
    const int shapes[][2] = {{2048, 4096}, {5120, 2048}, {4096, 4096}, {6144, 4096}, {4096, 14336}, {28672, 4096}};
    fprintf(stderr, "%-12s %-8s %10s %10s %12s\n", "N x K", "variant", "us", "GB/s", "worst err");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int N = shapes[s][0], K = shapes[s][1];
        uint16_t *w = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)N * K), *x = (uint16_t *)malloc(2 * (size_t)K);
        float *y = (float *)malloc(sizeof(float) * N);
        srand(1234 + (unsigned)s);
        for (size_t i = 0; i < (size_t)N * K; i++) w[i] = bf16_bits(0.05f * ((float)rand() / RAND_MAX - 0.5f));
        for (int k = 0; k < K; k++) x[k] = bf16_bits((float)rand() / RAND_MAX - 0.5f);
        uint16_t *dw, *dx;
        float *dy;
        CK(cudaMalloc(&dw, sizeof(uint16_t) * (size_t)N * K));
        CK(cudaMalloc(&dx, 2 * (size_t)K));
        CK(cudaMalloc(&dy, sizeof(float) * N));
        CK(cudaMemcpy(dw, w, sizeof(uint16_t) * (size_t)N * K, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, x, 2 * (size_t)K, cudaMemcpyHostToDevice));
        const struct {
            const char *name;
            int cw, kc;
        } vs[] = {{"base", 1, K}, {"c2048/2", 2, 2048}, {"c1024/4", 4, 1024}, {"c512/4", 4, 512}, {"c512/8", 8, 512}};
        for (size_t v = 0; v < sizeof vs / sizeof vs[0]; v++) {
            if ((K + vs[v].kc - 1) / vs[v].kc > MAXCH) continue;
            /* rings: 16 slots a warp (48 KB a CTA) for one and two warps, 12 for four, 8 for eight */
            const double us = vs[v].cw == 1 ? run<1, 16>(dw, dx, dy, N, K, vs[v].kc, reps)
                            : vs[v].cw == 2 ? run<2, 16>(dw, dx, dy, N, K, vs[v].kc, reps)
                            : vs[v].cw == 4 ? run<4, 12>(dw, dx, dy, N, K, vs[v].kc, reps)
                                            : run<8, 8>(dw, dx, dy, N, K, vs[v].kc, reps);
            CK(cudaMemcpy(y, dy, sizeof(float) * N, cudaMemcpyDeviceToHost));
            char shape[32];
            snprintf(shape, sizeof shape, "%dx%d", N, K);
            const double err = check(y, w, x, N, K), gbs = 2.0 * N * K / (us * 1e3);
            fprintf(stderr, "%-12s %-8s %10.2f %10.1f %12.3g\n", shape, vs[v].name, us, gbs, err);
            if (json)
                printf("%s\n{\"n\": %d, \"k\": %d, \"variant\": \"%s\", \"warps\": %d, \"chunk\": %d, "
                       "\"us\": %.3f, \"gbps\": %.1f, \"worst_err\": %.3g}",
                       first ? "" : ",", N, K, vs[v].name, vs[v].cw, vs[v].kc, us, gbs, err);
            first = 0;
        }
        CK(cudaFree(dw));
        CK(cudaFree(dx));
        CK(cudaFree(dy));
        free(w);
        free(x);
        free(y);
    }
    if (json) printf("\n]\n");
    return 0;
}

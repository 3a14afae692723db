// stage_probe.cu - what does one step of a decode chain cost at its boundary: a kernel
// boundary (CUDA graph, plain or with programmatic dependent launch) against a grid-wide
// barrier inside one persistent kernel (the "megakernel" of docs/CUDA.md "Not done")?
//
// Issue 24's one-row MoE layer is ~15 kernels, most of them small: session 21's trace put
// ~35 us of a 91 us layer (H100) in kernels that move a few MB or less. Whether a persistent
// kernel would win depends on what a stage transition costs there against a PDL kernel
// boundary, which this probe times before anyone writes one. Every variant runs S stages;
// stage s streams a fresh slice of a 1 GiB buffer (R float4 a thread: no L2 reuse between
// stages), sums it and writes one float per block (so the loads stay):
//   graph      : S kernels in a CUDA graph, each stage's loads after its start;
//   pdl_wait   : the same with programmatic dependent launch, every kernel waiting for the
//                one before (griddepcontrol.wait) before its loads: a true data dependency;
//   pdl_pre    : PDL, the loads issued before the wait (data no kernel writes: weights), as
//                the production GEMMs stream their weights;
//   bar        : one persistent kernel (grid = the blocks resident at once), a grid barrier
//                (a counter and an acquire spin) between stages, each stage's loads after it;
//   bar_pre    : the same, the next stage's loads issued before the barrier.
// Per variant: us a stage, and the bytes a stage moves over that time. R = 0 gives the bare
// transition. The ideal at R > 0 is bytes / DRAM peak.
// Build: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o stage_probe dev/experiments/stage_probe.cu
// Measured (session 21, H100, bench/RESULTS.md "Session 21"): a bare transition 0.76 us under
// PDL, 1.02 in a plain graph, 1.46 through the grid barrier; the barrier slower at 4 and 17 MB too.
// Run:   ./stage_probe [stages] [reps] [--json]   (a table on stderr; --json: rows on stdout)
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "probe_common.cuh"

enum { NT = 256, RMAX = 16 };
static const size_t BUF_F4 = (size_t)1 << 26; /* 1 GiB of float4 */

__device__ __forceinline__ void dep_wait(void) { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void dep_trigger(void) { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

/* Stage s's slice for block b, thread t: R float4 at a stride of the grid's threads. */
__device__ __forceinline__ size_t slice_at(int s, int R, int r) {
    const size_t per = (size_t)gridDim.x * NT * (size_t)(R > 0 ? R : 1);
    const size_t base = ((size_t)s * per) % (BUF_F4 - per);
    return base + (size_t)r * gridDim.x * NT + (size_t)blockIdx.x * NT + threadIdx.x;
}

template <int R> __device__ __forceinline__ void stage_load(const float4 *buf, int s, float4 *v) {
#pragma unroll
    for (int r = 0; r < R; r++) v[r] = __ldcs(buf + slice_at(s, R, r));
}

template <int R> __device__ __forceinline__ void stage_use(const float4 *v, float *out, int s) {
    float a = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) a += v[r].x + v[r].y + v[r].z + v[r].w;
    if (a == 12345.678f) out[(size_t)s * gridDim.x + blockIdx.x] = a; /* never true; keeps the loads */
    if (threadIdx.x == 0) out[(size_t)s * gridDim.x + blockIdx.x] = (float)s;
}

// ---- kernel per stage ---------------------------------------------------------------------

template <int R, int MODE> /* 0 plain, 1 pdl: wait then load, 2 pdl: load then wait */
__global__ void __launch_bounds__(NT) stage_kernel(const float4 *buf, float *out, int s) {
    float4 v[R > 0 ? R : 1];
    if (MODE == 2) stage_load<R>(buf, s, v);
    if (MODE > 0) {
        dep_wait();
        dep_trigger();
    }
    if (MODE != 2) stage_load<R>(buf, s, v);
    stage_use<R>(v, out, s);
}

// ---- one persistent kernel ----------------------------------------------------------------

/* All blocks past generation `gen` (a monotonically increasing counter: no reset). */
__device__ __forceinline__ void grid_barrier(unsigned *count, unsigned gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        const unsigned want = gen * gridDim.x;
        unsigned c;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(count) : "memory");
        } while (c < want);
    }
    __syncthreads();
}

template <int R, int PRE>
__global__ void __launch_bounds__(NT) persist_kernel(const float4 *buf, float *out, int S,
                                                     unsigned *count, unsigned gen0) {
    float4 v[R > 0 ? R : 1];
    if (PRE) stage_load<R>(buf, 0, v);
    for (int s = 0; s < S; s++) {
        if (!PRE) stage_load<R>(buf, s, v);
        stage_use<R>(v, out, s);
        if (PRE && s + 1 < S) stage_load<R>(buf, s + 1, v); /* in flight across the barrier */
        grid_barrier(count, gen0 + (unsigned)s + 1);
    }
}

// ---- host ---------------------------------------------------------------------------------

struct Ctx {
    float4 *buf;
    float *out;
    unsigned *count;
    unsigned gen; /* barrier generations used so far */
    int grid, S;
    cudaStream_t st;
};

template <int R, int MODE> static cudaGraphExec_t graph_of(Ctx &c) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(c.st, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < c.S; s++) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        cfg.gridDim = dim3(c.grid);
        cfg.blockDim = dim3(NT);
        cfg.stream = c.st;
        if (MODE > 0) {
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = at;
            cfg.numAttrs = 1;
        }
        CK(cudaLaunchKernelEx(&cfg, stage_kernel<R, MODE>, (const float4 *)c.buf, c.out, s));
    }
    CK(cudaStreamEndCapture(c.st, &g));
    cudaGraphExec_t ex;
    CK(cudaGraphInstantiate(&ex, g, 0));
    CK(cudaGraphDestroy(g));
    return ex;
}

/* us a stage: the median of reps timed runs (one warm-up). */
static double median(double *t, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j]; t[j] = t[j - 1]; t[j - 1] = x;
        }
    return t[n / 2];
}

template <int R> static double run_variant(Ctx &c, int v, int reps) {
    cudaGraphExec_t ex = NULL;
    if (v == 0) ex = graph_of<R, 0>(c);
    if (v == 1) ex = graph_of<R, 1>(c);
    if (v == 2) ex = graph_of<R, 2>(c);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    double t[64];
    for (int i = 0; i <= reps; i++) {
        CK(cudaEventRecord(a, c.st));
        if (ex) {
            CK(cudaGraphLaunch(ex, c.st));
        } else {
            if (v == 3) persist_kernel<R, 0><<<c.grid, NT, 0, c.st>>>(c.buf, c.out, c.S, c.count, c.gen);
            else persist_kernel<R, 1><<<c.grid, NT, 0, c.st>>>(c.buf, c.out, c.S, c.count, c.gen);
            CK(cudaGetLastError());
            c.gen += (unsigned)c.S;
        }
        CK(cudaEventRecord(b, c.st));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (i) t[i - 1] = ms * 1e3 / c.S;
    }
    if (ex) CK(cudaGraphExecDestroy(ex));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return median(t, reps);
}

int main(int argc, char **argv) {
    int S = 200, reps = 15, json = 0, pos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (pos++ == 0) S = atoi(argv[i]);
        else reps = atoi(argv[i]);
    }
    if (S < 1 || reps < 1 || reps > 63) {
        fprintf(stderr, "usage: stage_probe [stages >= 1] [reps 1..63] [--json]\n");
        return 2;
    }
    Ctx c = {};
    c.S = S;
    CK(cudaStreamCreate(&c.st));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int per_sm = 0; /* the persistent kernel's blocks must all be resident: the smaller fit */
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persist_kernel<RMAX, 1>, NT, 0));
    c.grid = p.multiProcessorCount * (per_sm < 2 ? per_sm : 2);
    CK(cudaMalloc(&c.buf, BUF_F4 * sizeof(float4)));
    CK(cudaMemset(c.buf, 0, BUF_F4 * sizeof(float4)));
    CK(cudaMalloc(&c.out, (size_t)S * c.grid * sizeof(float)));
    CK(cudaMalloc(&c.count, sizeof(unsigned)));
    CK(cudaMemset(c.count, 0, sizeof(unsigned)));
    fprintf(stderr, "%s, %d SMs, grid %d x %d threads, %d stages, median of %d\n", p.name,
            p.multiProcessorCount, c.grid, NT, S, reps);
    fprintf(stderr, "%-9s %3s %9s %10s %8s\n", "variant", "R", "MB/stage", "us/stage", "GB/s");
    static const char *const name[5] = {"graph", "pdl_wait", "pdl_pre", "bar", "bar_pre"};
    const int Rs[3] = {0, 4, RMAX};
    if (json) printf("[");
    int first = 1;
    for (int ri = 0; ri < 3; ri++)
        for (int v = 0; v < 5; v++) {
            const int R = Rs[ri];
            const double us = R == 0 ? run_variant<0>(c, v, reps) : R == 4 ? run_variant<4>(c, v, reps)
                                                                           : run_variant<RMAX>(c, v, reps);
            const double mb = (double)c.grid * NT * 16.0 * R / 1e6;
            fprintf(stderr, "%-9s %3d %9.2f %10.3f %8.0f\n", name[v], R, mb, us, R ? mb * 1e3 / us : 0.0);
            if (json)
                printf("%s{\"gpu\":\"%s\",\"variant\":\"%s\",\"R\":%d,\"mb_per_stage\":%.3f,\"us_per_stage\":%.4f}",
                       first ? "" : ",", p.name, name[v], R, mb, us);
            first = 0;
        }
    if (json) printf("]\n");
    CK(cudaFree(c.buf));
    CK(cudaFree(c.out));
    CK(cudaFree(c.count));
    CK(cudaStreamDestroy(c.st));
    return 0;
}

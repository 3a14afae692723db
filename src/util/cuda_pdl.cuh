/*
 * cuda_pdl.cuh - Programmatic Dependent Launch (PDL, sm_90; docs/CUDA.md "PDL"), shared by
 * every layer's kernels (model, attn, cache, codec): the two grid-dependency instructions and
 * a launcher that asks for a programmatic launch.
 * Owns: cuda_pdl_wait, cuda_pdl_trigger, cuda_pdl_config, cuda_pdl_launch.
 * Must not: change any arithmetic (they only move when a kernel may start).
 *
 * A kernel launched programmatically (cuda_pdl_launch with pdl set) may start while the
 * kernel before it on the stream still runs, once every block of that one has triggered
 * (cuda_pdl_trigger) or exited. It must call cuda_pdl_wait before it reads or writes
 * anything another kernel touches: the wait returns once the kernel before has completed
 * and its writes are visible. The chain stays transitive because each kernel completes only
 * after its own wait. Both are no-ops for a plain launch and before sm_90.
 * The decode chain's kernels call `cuda_pdl_wait(); cuda_pdl_trigger();` first: the next
 * kernel's blocks then become resident while this one runs (one kernel ahead, never more),
 * and only the launch latency between them is hidden.
 */
#ifndef TQKV_UTIL_CUDA_PDL_CUH
#define TQKV_UTIL_CUDA_PDL_CUH

#include <cuda_runtime.h>
#include <stdio.h>

__device__ __forceinline__ void cuda_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void cuda_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* The launch configuration of a programmatic launch (the programmatic serialization
 * attribute in *at, which must outlive the launch): the kernel may start before the one ahead
 * of it on the stream has finished; its own cuda_pdl_wait orders its dependent reads. */
static inline cudaLaunchConfig_t cuda_pdl_config(dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                                                 cudaLaunchAttribute *at) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    *at = cudaLaunchAttribute{};
    at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at->val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* fn<<<grid, block, smem, s>>>(args...), programmatically when pdl is set (inside a stream
 * capture the graph records a programmatic edge); a launch the runtime refuses so is made
 * plainly (said once per kernel and file on stderr). The launch's error is left for
 * cudaGetLastError, as with <<<>>>. static: internal linkage, so its `told` flag is no symbol
 * of the libraries. */
template <typename... E, typename... A>
static inline void cuda_pdl_launch(int pdl, void (*fn)(E...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t s, A... args) {
    static int told;
    if (pdl) {
        cudaLaunchAttribute at;
        const cudaLaunchConfig_t cfg = cuda_pdl_config(grid, block, smem, s, &at);
        const cudaError_t e = cudaLaunchKernelEx(&cfg, fn, ((E)args)...);
        if (e == cudaSuccess) return;
        (void)cudaGetLastError();
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            fprintf(stderr, "tqkv: a programmatic launch was refused (%s): plain launches\n",
                    cudaGetErrorString(e));
    }
    fn<<<grid, block, smem, s>>>(((E)args)...);
}

#endif

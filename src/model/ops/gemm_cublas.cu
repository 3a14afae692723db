/*
 * gemm_cublas.cu - the GPU forward's fast, non-invariant GEMM through cuBLAS loaded with
 * dlopen (see gemm_cublas.h).
 * Owns: the dlopen / dlsym of the six cuBLAS entry points used, the handle (bound to its
 * user's stream, with its own workspace), the f32 -> bf16 activation kernel and the bias
 * kernel.
 * Must not: link libcublas (the packaged libraries stay as they are), be the default.
 *
 * Layout: cuBLAS is column-major, so y[T, N] row-major (row stride ldy) is C[N, T] with
 * ldc = ldy; W[N, K] row-major is a column-major [K, N] matrix (lda = K) used transposed;
 * x_bf16[T, K] row-major is a column-major [K, T] matrix (ldb = K):
 *     C[N, T] = W^T' . x'   ->   cublasGemmEx(OP_T, OP_N, N, T, K, W, K, x, K, y, ldy)
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "util/common.h"
}
#include "model/ops/gemm_cublas.h"

// ---------------------------------------------------------------------------
// the library, loaded once
// ---------------------------------------------------------------------------

/* cublasGemmEx's 32-bit form (C++ also declares an overload) */
typedef cublasStatus_t (*gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                     int, const void *, const void *, cudaDataType, int,
                                     const void *, cudaDataType, int, const void *, void *,
                                     cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

static struct {
    void *lib;
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    gemm_ex_fn gemm;
    decltype(&cublasSetMathMode) math;
    decltype(&cublasSetStream_v2) stream;
    decltype(&cublasSetWorkspace_v2) workspace;
    char err[256];
} cb;
static pthread_once_t cb_once = PTHREAD_ONCE_INIT;

static void cb_load(void) {
    const char *names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !cb.lib; i++)
        cb.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!cb.lib) {
        const char *e = dlerror();
        snprintf(cb.err, sizeof cb.err, "%s", e ? e : "dlopen failed");
        return;
    }
    cb.create = (decltype(cb.create))dlsym(cb.lib, "cublasCreate_v2");
    cb.destroy = (decltype(cb.destroy))dlsym(cb.lib, "cublasDestroy_v2");
    cb.gemm = (decltype(cb.gemm))dlsym(cb.lib, "cublasGemmEx");
    cb.math = (decltype(cb.math))dlsym(cb.lib, "cublasSetMathMode");
    cb.stream = (decltype(cb.stream))dlsym(cb.lib, "cublasSetStream_v2");
    cb.workspace = (decltype(cb.workspace))dlsym(cb.lib, "cublasSetWorkspace_v2");
    if (!cb.create || !cb.destroy || !cb.gemm || !cb.math || !cb.stream || !cb.workspace) {
        snprintf(cb.err, sizeof cb.err, "a cuBLAS entry point is missing");
        dlclose(cb.lib);
        cb.lib = NULL;
    }
}

struct gemm_cublas {
    cublasHandle_t h;
    cudaStream_t   stream; /* the user's (NULL: legacy default) */
    void          *ws;     /* [GEMM_CUBLAS_WS] bytes, device */
};

extern "C" tqkv_status gemm_cublas_init(gemm_cublas **out, void *stream) {
    *out = NULL;
    pthread_once(&cb_once, cb_load);
    if (!cb.lib)
        return tqkv_fail(TQKV_EUNSUPPORTED, "fast GEMM: cuBLAS could not be loaded (%s); put "
                         "libcublas on the library path or use the invariant GEMM", cb.err);
    gemm_cublas *c = (gemm_cublas *)calloc(1, sizeof *c);
    if (!c) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (cb.create(&c->h) != CUBLAS_STATUS_SUCCESS) {
        free(c);
        return tqkv_fail(TQKV_EUNSUPPORTED, "fast GEMM: cublasCreate failed");
    }
    cb.math(c->h, CUBLAS_DEFAULT_MATH);
    c->stream = (cudaStream_t)stream;
    const cudaError_t e = cudaMalloc(&c->ws, GEMM_CUBLAS_WS);
    if (e != cudaSuccess) {
        gemm_cublas_free(c);
        return tqkv_fail(e == cudaErrorMemoryAllocation ? TQKV_ENOMEM : TQKV_EUNSUPPORTED,
                         "CUDA: fast GEMM workspace: %s", cudaGetErrorString(e));
    }
    /* the stream first: cublasSetStream resets the workspace to the default pool */
    if (cb.stream(c->h, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cb.workspace(c->h, c->ws, GEMM_CUBLAS_WS) != CUBLAS_STATUS_SUCCESS) {
        gemm_cublas_free(c);
        return tqkv_fail(TQKV_EUNSUPPORTED, "fast GEMM: cublasSetStream / cublasSetWorkspace failed");
    }
    *out = c;
    return TQKV_OK;
}

extern "C" void gemm_cublas_free(gemm_cublas *c) {
    if (!c) return;
    if (c->stream) cudaStreamSynchronize(c->stream);
    cb.destroy(c->h);
    cudaFree(c->ws);
    free(c);
}

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* xb[t, k] = bf16(x[t * ldx + k]) (round to nearest even). */
__global__ void cublas_x_kernel(const float *__restrict__ x, size_t ldx, int T, int K,
                                __nv_bfloat16 *__restrict__ xb) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * K) return;
    const size_t t = i / (size_t)K, k = i % (size_t)K;
    xb[i] = __float2bfloat16_rn(x[t * ldx + k]);
}

/* y[t * ldy + n] += bias[n]. */
__global__ void cublas_bias_kernel(float *__restrict__ y, size_t ldy, int T, int N,
                                   const float *__restrict__ bias) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * N) return;
    y[(i / (size_t)N) * ldy + i % (size_t)N] += bias[i % (size_t)N];
}

extern "C" tqkv_status gemm_cublas_run(gemm_cublas *c, const float *x, size_t ldx, int T,
                                       const uint16_t *w, int N, int K, const float *bias,
                                       float *y, size_t ldy, void *scratch) {
    if (!c || !x || !w || !y || !scratch || T < 1 || N < 1 || K < 1)
        return tqkv_fail(TQKV_EINVAL, "fast GEMM: bad argument (T %d, N %d, K %d)", T, N, K);
    const size_t tk = (size_t)T * K;
    __nv_bfloat16 *xb = (__nv_bfloat16 *)scratch;
    cublas_x_kernel<<<(unsigned)((tk + 255) / 256), 256, 0, c->stream>>>(x, ldx, T, K, xb);
    const float one = 1.0f, zero = 0.0f;
    const cublasStatus_t s = cb.gemm(c->h, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w, CUDA_R_16BF,
                                     K, xb, CUDA_R_16BF, K, &zero, y, CUDA_R_32F, (int)ldy,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "fast GEMM: cublasGemmEx failed (status %d)", (int)s);
    if (bias) {
        const size_t tn = (size_t)T * N;
        cublas_bias_kernel<<<(unsigned)((tn + 255) / 256), 256, 0, c->stream>>>(y, ldy, T, N, bias);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA: fast GEMM: %s", cudaGetErrorString(e));
    return TQKV_OK;
}

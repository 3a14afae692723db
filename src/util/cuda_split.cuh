/*
 * cuda_split.cuh - the two bf16 parts of a float activation as the device GEMM reads them
 * (src/model/ops/gemm_cuda.h: x = hi + lo), shared by every layer that writes a GEMM's input
 * (the model's kernels, the decode attention's merge).
 * Owns: cuda_split_hi, cuda_split_lo.
 * Must not: round any other way (every writer of a split must give the same bits).
 */
#ifndef TQKV_UTIL_CUDA_SPLIT_CUH
#define TQKV_UTIL_CUDA_SPLIT_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* hi = bf16(v) (nearest even) */
__device__ __forceinline__ uint16_t cuda_split_hi(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
/* lo = bf16(v - hi) */
__device__ __forceinline__ uint16_t cuda_split_lo(float v, uint16_t hi) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v - __bfloat162float(__ushort_as_bfloat16(hi))));
}

#endif

// probe_common.cuh - what the standalone CUDA probes of dev/experiments share: CK(call) exits
// with the runtime's message (file and line) when a CUDA call fails.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
            exit(2);                                                                         \
        }                                                                                    \
    } while (0)

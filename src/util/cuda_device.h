/*
 * cuda_device.h - which GPU is current, as a bit, for the kernels' one-time setups.
 * Owns: cuda_device_bit (bit d of a mask for device d).
 * Must not: be included from C files (it is CUDA only), allocate, launch.
 *
 * A kernel attribute (cudaFuncSetAttribute: the dynamic shared memory above 48 KiB) belongs
 * to the device that was current when it was set, so a setup runs once per device, not once
 * per process: tensor parallelism drives several GPUs from one process (docs/TP.md).
 */
#ifndef TQKV_CUDA_DEVICE_H
#define TQKV_CUDA_DEVICE_H

#include <cuda_runtime.h>

/* 1 << the current device for devices 0..31; 0 past them (no bit: their setup runs on every
 * call, which is idempotent, only slower). */
static inline unsigned cuda_device_bit(void) {
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess || d < 0) d = 0;
    return d < 32 ? 1u << d : 0u;
}

#endif

/*
 * codec_cuda_dims.h - the head dims of the CUDA backend's kernels (C and CUDA).
 */
#ifndef TQKV_CODEC_CUDA_DIMS_H
#define TQKV_CODEC_CUDA_DIMS_H

#define CUDA_DIM 128          /* the head_dim of the tuned decode (split) kernel */
#define CUDA_DIM_WIDE 256     /* the other head_dim of the device cache (Gemma 4's full layers) */

#endif

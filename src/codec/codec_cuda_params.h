/*
 * codec_cuda_params.h - what the CUDA codec's encode kernel takes: the codec parameters
 * passed to kernels by value (one struct per head_dim: cuda_codec at 128, whose layout the
 * tuned decode kernel's Params embed, and cuda_codec256), one plane's device buffers, the
 * append target of each row, and the encode launcher.
 * Must not: know the cache's structs (src/cache/ fills these from its own), be included
 * from C files (CUDA C++ only).
 */
#ifndef TQKV_CODEC_CUDA_PARAMS_H
#define TQKV_CODEC_CUDA_PARAMS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "codec/codec_cuda_dims.h"

/* Kernel-side codec parameters of a d = 128 cache (passed by value, ~700 bytes). Its
 * layout is part of the split kernel's Params<128> (attn_cuda_split.cuh): keep it as it is. */
typedef struct {
    float cent[16];           /* tq centroids (c[k] = LM[k] / sqrt(d)), ascending */
    float bounds[15];         /* midpoints */
    float signs[CUDA_DIM];    /* +-1 */
    float inv;                /* (float)(1 / sqrt(d)) */
    int   bits;               /* tq: 2..4; fp8: CUDA_BITS_FP8; 0 otherwise */
} cuda_codec;

/* The same for a d = 256 cache (~1.2 KB). */
typedef struct {
    float cent[16];
    float bounds[15];
    float signs[256];
    float inv;
    int   bits;
} cuda_codec256;

/* cuda_codec(256).bits of an fp8 plane (e4m3 values in the original domain, not rotated). */
#define CUDA_BITS_FP8 8
/* A plane of these parameters holds rotated-domain tq indices (2..4 bits). */
#define CUDA_BITS_ROTATED(b) ((b) >= 2 && (b) <= 4)

/* The codec parameters of head_dim DIM (kernels templated on the dim take this type). */
template <int DIM> struct cuda_codec_of;
template <> struct cuda_codec_of<128> { typedef cuda_codec type; };
template <> struct cuda_codec_of<256> { typedef cuda_codec256 type; };

/* Per-row state as the kernels read it: [rows] of these. */
typedef struct {
    int ntok;                 /* tokens held */
    int left_pad;             /* padding columns before token 0 */
    int wstart;               /* first token read from the q8 ring (== ntok: none) */
    int col0;                 /* append target column (left_pad + ntok) */
    int win_lo;               /* lowest token the q8 ring still holds (h_win_lo) */
} cuda_row;

/* One plane (K or V) of a device cache as the encode kernel writes it. */
struct ce_plane {
    uint8_t *data;      /* [rows, kvh, cap, pay] */
    uint16_t *scales;   /* [rows, kvh, cap, ns] */
    int8_t *win;        /* [rows, kvh, ring, d] or NULL */
    uint16_t *wsc;      /* [rows, kvh, ring, d/32] */
    int8_t *ext;        /* side buffer [rows, kvh, xcap, d] or NULL: the q8 copies of the
                         * append's tokens that do not land in the ring (cache_cuda_impl.h) */
    uint16_t *exs;      /* [rows, kvh, xcap, d/32] */
    const int *xlo;     /* device [rows]: token held in side-buffer slot 0 */
    int xcap;
    int pay;
    int bf16;
};

/* Encode k and v [rows, kvh, n, d] into planes P[0] (K) and P[1] (V) at each row's col0, in
 * one launch (d = CUDA_DIM with the K and V codecs k128, v128, or CUDA_DIM_WIDE with k256,
 * v256), queued on stream, programmatically when pdl is set (util/cuda_pdl.cuh: it waits for
 * the kernel before it first); the launch's error (no wait). */
cudaError_t codec_cuda_encode(const float *k, const float *v, const ce_plane P[2],
                              const cuda_codec &k128, const cuda_codec &v128,
                              const cuda_codec256 &k256, const cuda_codec256 &v256, int d,
                              const cuda_row *rows, int nrows, int kvh, int n, int cap, int ring,
                              int pdl, cudaStream_t stream);

/* The same for an fp8 plane (codec_cuda_fp8.cu): payload [d] e4m3 bytes and one fp16 scale
 * per vector; P.win is ignored (fp8 has no q8 window). */
cudaError_t codec_cuda_encode_fp8(const float *x, const ce_plane &P, int d, const cuda_row *rows,
                                  int nrows, int kvh, int n, int cap, cudaStream_t stream);

#endif

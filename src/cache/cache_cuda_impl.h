/*
 * cache_cuda_impl.h - private layout of the device cache, shared by the .cu files of the
 * CUDA backend (src/cache/cache_cuda.cu, src/codec/codec_cuda.cu, src/attn/attn_cuda.cu).
 * Owns: struct cuda_kv, the codec parameters passed to kernels by value, the launcher
 * prototypes that cross .cu files (no relocatable device code: each kernel lives in one
 * file and is reached through a host function).
 * Must not: be included from C files (it is C++/CUDA only).
 */
#ifndef TQKV_CACHE_CUDA_IMPL_H
#define TQKV_CACHE_CUDA_IMPL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache_cuda.h"


/* Kernel-side codec parameters (passed by value, ~700 bytes). */
typedef struct {
    float cent[16];           /* tq centroids (c[k] = LM[k] / sqrt(d)), ascending */
    float bounds[15];         /* midpoints */
    float signs[CUDA_DIM];    /* +-1 */
    float inv;                /* (float)(1 / sqrt(d)) */
    int   bits;               /* 2..4, 0 for non-tq */
} cuda_codec;

/* Per-row state as the kernels read it: [rows] of these. */
typedef struct {
    int ntok;                 /* tokens held */
    int left_pad;             /* padding columns before token 0 */
    int wstart;               /* first token read from the q8 ring (== ntok: none) */
    int col0;                 /* append target column (left_pad + ntok) */
    int win_lo;               /* lowest token the q8 ring still holds (h_win_lo) */
} cuda_row;

struct cuda_kv {
    tqkv_cache_config cfg;
    int bf16;
    int rows, cap, ring, d, kvh;
    tqkv_format kfmt, vfmt;
    size_t kpay, vpay;        /* payload bytes per vector (bf16: 2d) */
    int kns, vns;             /* fp16 scales per vector */
    int kwin, vwin;           /* plane has a q8 window */
    uint8_t  *kd, *vd;        /* [rows, kvh, cap, pay] */
    uint16_t *ks, *vs;        /* [rows, kvh, cap, ns] */
    int8_t   *kw, *vw;        /* [rows, kvh, ring, d] */
    uint16_t *kws, *vws;      /* [rows, kvh, ring, d / 32] */
    int *h_offset, *h_left_pad, *h_win_lo; /* host mirror [rows] */
    int *h_spec_base;         /* [rows] offset at spec_begin */
    int  spec_active;
    cuda_row *d_rows;         /* device [rows] */
    cuda_codec kc, vc;
    /* attention workspace */
    void  *ws;                /* partials */
    size_t ws_bytes;
    cudaStream_t stream;      /* every kernel of this cache runs here (0: legacy default) */
    int *d_work;              /* device [2]: the attention's work counters (zero between launches) */
    uint64_t storage_id;      /* process-unique id of the storage (planes, ring, d_rows): a
                               * new one at every init, so a row op or a regrow (which
                               * install a freshly made cache) changes it; CUDA graphs that
                               * captured the old pointers key on it */
};

/* cache_cuda.cu: an empty cache as tqkv_cuda_kv_init, whose copies already run on `stream`
 * (row operations make their new storage on the source's stream). */
tqkv_status cuda_kv_init_on(cuda_kv **out, const tqkv_cache_config *cfg, int bf16, int rows,
                            int cap, cudaStream_t stream);

/* cache_cuda_rows.cu: make sure every row can hold `need` columns (rebuilds the storage
 * with a larger cap, geometric growth). */
tqkv_status cuda_kv_reserve(cuda_kv *kv, int need);

/* Upload the per-row state (host mirror -> d_rows): an asynchronous copy on kv->stream
 * (from pageable memory: staged before the call returns). */
tqkv_status cuda_kv_sync_rows(cuda_kv *kv);
/* After an append of n tokens to every row: advance d_rows on the device with the host
 * mirror's rule (no copy, so a decode step queues without waiting on the GPU). */
tqkv_status cuda_kv_advance_rows(cuda_kv *kv, int n);

/* codec_cuda.cu: encode n tokens of every row into the planes at each row's col0. */
tqkv_status codec_cuda_append(cuda_kv *kv, const float *k, const float *v, int n);

/* Convert a cudaError_t into a tqkv failure (returns TQKV_OK on cudaSuccess). */
tqkv_status cuda_check(cudaError_t e, const char *what);

#endif

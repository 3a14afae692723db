/*
 * cache_cuda_impl.h - private layout of the device cache, shared by the .cu files of the
 * CUDA backend (src/cache/, src/codec/codec_cuda.cu, src/attn/attn_cuda*.cu).
 * Owns: struct cuda_kv, the codec parameters passed to kernels by value (one struct per
 * head_dim: cuda_codec at 128, whose layout the tuned decode kernel's Params embed, and
 * cuda_codec256), the launcher prototypes that cross .cu files (no relocatable device
 * code: each kernel lives in one file and is reached through a host function).
 * Must not: be included from C files (it is C++/CUDA only).
 */
#ifndef TQKV_CACHE_CUDA_IMPL_H
#define TQKV_CACHE_CUDA_IMPL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache_cuda.h"
#include "codec/codec_cuda_params.h"


struct cuda_kv {
    tqkv_cache_config cfg;
    int bf16;
    int rows, cap, ring, d, kvh;
    int row_cap;              /* rows the planes, ring, row table and host mirror hold room
                               * for (>= rows): rows join and leave in place below it */
    tqkv_format kfmt, vfmt;
    size_t kpay, vpay;        /* payload bytes per vector (bf16: 2d) */
    int kns, vns;             /* fp16 scales per vector */
    int kwin, vwin;           /* plane has a q8 window */
    uint8_t  *kd, *vd;        /* [row_cap, kvh, cap, pay] */
    uint16_t *ks, *vs;        /* [row_cap, kvh, cap, ns] */
    int8_t   *kw, *vw;        /* [row_cap, kvh, ring, d] */
    uint16_t *kws, *vws;      /* [row_cap, kvh, ring, d / 32] */
    /* side buffer of the last append (the CPU's ext_*, batch.h): an append longer than
     * window_slack + 1 pushes q8 copies its own early queries need out of the ring; they
     * are kept here for the masked attention that follows (transient, never exported) */
    int8_t   *kx, *vx;        /* [rows, kvh, xcap, d] */
    uint16_t *kxs, *vxs;      /* [rows, kvh, xcap, d / 32] */
    int      *d_x;            /* device [2, rows]: tokens [xlo, xhi) held per row */
    int       xcap, xrows;    /* token slots per row, rows allocated */
    int       x_valid;        /* the side buffer belongs to the last append */
    int      *h_x_off;        /* [rows] offset right after that append */
    int *h_offset, *h_left_pad, *h_win_lo; /* host mirror [row_cap] (rows in use) */
    int *h_spec_base;         /* [row_cap] offset at spec_begin */
    int  spec_active;
    cuda_row *d_rows;         /* device [row_cap] */
    cuda_codec kc, vc;        /* d = 128 caches (zero otherwise) */
    cuda_codec256 kc256, vc256; /* d = 256 caches (zero otherwise) */
    /* attention workspace */
    void  *ws;                /* partials */
    size_t ws_bytes;
    cudaStream_t stream;      /* every kernel of this cache runs here (0: legacy default) */
    int *d_work;              /* device [2]: the attention's work counters (zero between launches) */
    /* the masked attention's visible ranges (attn_cuda_prefill.cu): pinned host and device
     * [2, rng_cap] ints, refilled once the copy recorded in rng_ev has run */
    int *h_rng, *d_rng;
    size_t rng_cap;
    cudaEvent_t rng_ev;
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

/* cache_cuda.cu: the side buffer's device ranges [2, rows] (xlo then xhi per row) when it
 * belongs to the rows as they are now (the last append made it, nothing changed them since),
 * else NULL. */
const int *cuda_kv_side_ranges(const cuda_kv *kv);

/* cache_cuda.cu: encode n new tokens per row of k and v into kv's planes (codec_cuda.cu's
 * kernel, queued on kv->stream). */
tqkv_status codec_cuda_append(cuda_kv *kv, const float *k, const float *v, int n);

/* attn_cuda_wide.cu: decode attention of a cache whose head_dim is 256: the tensor-core split
 * kernel (tq4 / tq3; TQKV_WIDE_TC=0 in the environment: the float32 one) or the float32 split
 * kernel (the dense bf16 cache), work items (row, kv head, split) with the row's split length
 * from its own length, and a merge, each row's length read from the device row table (so a
 * CUDA graph replay follows the rows).
 * q, out: DEVICE [rows, q_heads, d]. ws == NULL: kv's own workspace (grown here); else at
 * least tqkv_cuda_attend_ws_bytes_dim(rows, q_heads, .., d) bytes: then nothing is
 * allocated, freed or waited for (capture safe). Asynchronous on kv->stream. */
tqkv_status cuda_attend_decode_wide(cuda_kv *kv, const float *q, int q_heads, float scale,
                                    float *out, void *ws, size_t ws_bytes);
/* attn_cuda_fmt.cu: 1 when kv's decode attention is the float32 kernel of attn_cuda_fmt.cu
 * (fp8/fp8, tq2/tq2, tq K and V of different bits; not the bf16 baseline, tq4/tq4, tq3/tq3,
 * nor at d = 128 tq2/tq2, tq4/tq2, tq4/tq3 and tq3/tq2, which attn_cuda.cu's tensor-core split
 * kernel takes: at 128 only fp8). */
int cuda_kv_fmt_generic(const cuda_kv *kv);
/* attn_cuda_fmt.cu: decode attention of such a cache at head_dim 128 or 256 (query prep, the
 * float32 split kernel, the merge), each row's splits from its own length on the device.
 * q, out: DEVICE [rows, q_heads, d]. ws == NULL: kv's own workspace (grown here); else at least
 * tqkv_cuda_attend_ws_bytes_dim(rows, q_heads, .., d) bytes: then nothing is allocated, freed
 * or waited for (capture safe). Asynchronous on kv->stream. */
tqkv_status cuda_attend_decode_fmt(cuda_kv *kv, const float *q, int q_heads, float scale,
                                   float *out, void *ws, size_t ws_bytes);
/* attn_cuda_wide.cu: the d = 256 tensor-core kernels' one-time setup (shared-memory limits,
 * persistent grids for `sms` SMs, the kernel choice from TQKV_WIDE_TC); tqkv_cuda_attn_setup
 * runs it under its lock. */
tqkv_status cuda_wide_setup(int sms);
/* cache_cuda.cu: 1 when a decode step's cache kernels launch programmatically (the append's
 * encode and row advance; the tensor-core attention's query prep, split kernel and merge,
 * both head dims: tqkv_cuda_attn_pdl, TQKV_ATTN_PDL), else 0. */
int cuda_attn_pdl_on(void);
/* attn_cuda_prefill.cu: the masked kernels' one-time setup (their dynamic shared-memory
 * limits); thread safe, idempotent; tqkv_cuda_attn_setup runs it. */
tqkv_status cuda_prefill_setup(void);

/* Convert a cudaError_t into a tqkv failure (returns TQKV_OK on cudaSuccess). */
tqkv_status cuda_check(cudaError_t e, const char *what);

#endif

/*
 * model_cuda_impl.h - the device twin's private state, shared by forward_cuda.cu (weights,
 * scratch, the forward and its CUDA graph) and state_cuda.cu (row operations, spec rounds,
 * export / upload).
 * Must not: be included from C files (CUDA types) or outside src/model.
 */
#ifndef TQKV_MODEL_CUDA_IMPL_H
#define TQKV_MODEL_CUDA_IMPL_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cache/cache_cuda.h"
#include "model/gemm_cublas.h"
#include "model/model_cuda.h"

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

typedef struct {
    float *attn_norm, *ffn_norm, *q_norm, *k_norm; /* [H], [H], [hd], [hd] or NULL */
    float *bqkv;                                    /* [QD + 2 KD] or NULL */
    float *bo;                                      /* [H] or NULL */
    bf16  *wqkv;                                    /* [QD + 2 KD, H] */
    bf16  *wo;                                      /* [H, QD] */
    bf16  *wgu;                                     /* [2 I, H] */
    bf16  *wd;                                      /* [H, I] */
} mc_layer;

/* The device weights of one model: uploaded by its first device state, shared by all of
 * them, freed by tqkv_model_free (model.c) through model_cuda_weights_free. */
struct model_cuda_weights {
    int       n_layers;
    mc_layer *layers;    /* [L] */
    bf16     *embed;     /* [V, H] */
    bf16     *lm_head;   /* [V, H] (== embed when tied) */
    float    *final_norm;/* [H] */
};

/* What a captured decode step took from the host besides the fixed buffers: a replay
 * needs all of it equal (docs/CUDA.md, "Decode step as a CUDA graph"). */
typedef struct {
    int      valid;
    int      rows;       /* T = rows: grids of every per-token kernel and GEMM */
    int      logits;     /* the lm_head GEMM and the full logits' copy are in the step */
    size_t   attn_ws;    /* max over rows of tqkv_cuda_attend_ws_bytes(rows, NH, tokens):
                          * the attention's split count (its grid and partials layout) */
    int      pick;       /* the device pick's record stride (its kernel and the records'
                          * copy are in the step; the lm_head too), 0 = no pick */
    uint64_t gen;        /* model_cuda.gen: every buffer and cache storage pointer */
} mc_graph_key;

typedef struct {
    int              enabled;  /* params.device_graphs and not TQKV_CUDA_GRAPHS=0 */
    cudaGraphExec_t  exec;     /* the executable of `key`, or NULL */
    mc_graph_key     key;      /* what exec captured */
    mc_graph_key     pending;  /* the last step's key run directly: captured when seen again */
    model_cuda_graph_stats stats;
} mc_graph;

struct model_cuda {
    const tqkv_model       *m;
    const model_cuda_weights *w;
    tqkv_model_state_params p;
    int                     rows;
    cuda_kv               **kv;        /* [L] */
    cudaStream_t            stream;    /* non-blocking: every kernel and copy of this state */
    uint64_t                gen;       /* bumped whenever a buffer or cache storage a decode
                                        * step reads may have moved (the graph's key) */
    uint64_t               *kv_ids;    /* [L] cache storage ids seen by the last step */
    mc_graph                graph;     /* the decode step's CUDA graph */
    /* device scratch, grown on demand */
    size_t  cap_t, cap_rn;
    float  *x, *xn;      /* [T, H] */
    float  *qkv;         /* [T, QD + 2 KD] */
    float  *att;         /* [T, QD] */
    float  *gu;          /* [T, 2 I] */
    float  *hh;          /* [T, I] */
    float  *tmp;         /* [T, H] */
    float  *rope;        /* [T, hd] cos | sin per token */
    void   *xf;          /* GEMM activations, fragment order (gemm_cuda.h) */
    float  *part;        /* GEMM segment partials [nseg, 32, N] */
    float  *logits;      /* [cap_logits, V] */
    size_t  cap_logits;
    int32_t *tinfo;      /* [T, 3] token id, row, column */
    void   *aws;         /* decode attention workspace shared by the layers */
    size_t  aws_bytes;
    gemm_cublas *cublas; /* device_fast_gemm: the non-invariant cuBLAS path, else NULL */
    float  *qb, *ob;     /* [rows, NH, n, hd] */
    float  *kb, *vb;     /* [rows, NKV, n, hd] */
    /* host scratch (h_rope, h_tinfo, h_logits pinned: copied on the stream, in a graph) */
    float   *h_rope;     /* [T, hd] */
    int32_t *h_tinfo;    /* [T, 3] */
    float   *h_logits;   /* [cap_hlogits, V] decode logits staging */
    size_t   cap_hlogits;
    int32_t *h_lo, *h_hi;/* [rows, n] */
    /* device pick (pick.h): the step's upload and its records, pinned staging beside */
    void    *pick_in, *h_pick_in;   /* [cap_pick_in] bytes: pick_row [rows] | int32 tokens */
    size_t   cap_pick_in;
    int32_t *pick_rec, *h_pick_rec; /* [rows, PICK_REC_WORDS(stride)], cap_pick_rec words */
    size_t   cap_pick_rec;
    int     *off;        /* [rows] */
};

/* Install new per-layer caches of `rows` rows (g's old ones are freed), moved to g's
 * stream; the decode graph is dropped. On failure kv is freed and g is unchanged. */
tqkv_status mc_install_caches(model_cuda *g, cuda_kv **kv, int rows);
/* Free an array of L caches (entries may be NULL) and the array. */
void        mc_free_cache_array(cuda_kv **kv, int L);

#endif

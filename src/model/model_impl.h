/*
 * model_impl.h - internal layout of tqkv_model and tqkv_model_state.
 * Owns: the structs shared by config.c (JSON), model.c (weights), forward.c (graph).
 * Must not: be included outside src/model and tests.
 */
#ifndef TQKV_MODEL_IMPL_H
#define TQKV_MODEL_IMPL_H

#include "model/matmul.h"
#include "model/safetensors.h"
#include "tqkv_model.h"

// ---------------------------------------------------------------------------
// config.c
// ---------------------------------------------------------------------------

/* Parse dir/config.json and (optional) dir/generation_config.json. */
tqkv_status model_config_load(const char *dir, tqkv_model_config *cfg, tqkv_generation_config *gen);
/* Parse config.json text (name used in messages). */
tqkv_status model_config_parse(const char *json, size_t len, const char *name,
                               tqkv_model_config *cfg);
tqkv_status model_generation_parse(const char *json, size_t len, const char *name,
                                   tqkv_model_config *cfg, tqkv_generation_config *gen);

// ---------------------------------------------------------------------------
// weights
// ---------------------------------------------------------------------------

typedef struct {
    float    *attn_norm;   /* [hidden] */
    float    *ffn_norm;    /* [hidden] */
    float    *q_norm;      /* [head_dim] or NULL */
    float    *k_norm;      /* [head_dim] or NULL */
    float    *bq, *bk, *bv; /* [n_heads*hd], [n_kv*hd], [n_kv*hd] or NULL */
    float    *bo;          /* [hidden] or NULL */
    mm_weight wq;          /* [n_heads*hd, hidden] */
    mm_weight wk;          /* [n_kv*hd, hidden] */
    mm_weight wv;          /* [n_kv*hd, hidden] */
    mm_weight wo;          /* [hidden, n_heads*hd] */
    mm_weight wg;          /* [inter, hidden] */
    mm_weight wu;          /* [inter, hidden] */
    mm_weight wd;          /* [hidden, inter] */
    /* fused (packed bf16 only; data NULL otherwise): one GEMM instead of three / two */
    mm_weight wqkv;        /* [n_heads*hd + 2*n_kv*hd, hidden] = q; k; v rows */
    float    *bqkv;        /* [n_heads*hd + 2*n_kv*hd] or NULL */
    mm_weight wgu;         /* [2*inter, hidden] = gate; up rows */
} model_layer;

struct tqkv_model {
    tqkv_model_config      cfg;
    tqkv_generation_config gen;
    st_archive             st;
    model_layer           *layers;      /* [n_layers] */
    mm_weight              embed;       /* [vocab, hidden] */
    mm_weight              lm_head;     /* [vocab, hidden] (the embedding when tied) */
    float                 *final_norm;  /* [hidden] */
    float                 *inv_freq;    /* [head_dim / 2] */
    void                 **owned;       /* converted / aligned copies */
    int                    n_owned, cap_owned;
    size_t                 n_params;
    char                   wtype[8];
    char                   source[1024]; /* weights file or index, for messages */
    struct model_cuda_weights *gpu_weights; /* --device cuda: bf16 weights in GPU memory,
                                               uploaded by the first device state (model_cuda.h) */
    struct g4_model       *g4;          /* Gemma 4 extras (gemma4.h), NULL otherwise */
};

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

struct tqkv_model_state {
    const tqkv_model       *m;
    tqkv_model_state_params p;
    int                     rows;
    tqkv_batch            **layers;     /* [n_layers] */
    tqkv_mask_lease        *lease;
    /* scratch, grown on demand */
    size_t   cap_t;      /* compact tokens */
    size_t   cap_rn;     /* rows * n */
    float   *x;          /* [T, hidden] residual stream */
    float   *xn;         /* [T, hidden] normed */
    float   *qkv;        /* [T, n_heads*hd + 2*n_kv*hd]: q | k | v per token */
    float   *att;        /* [T, n_heads*hd] attention output, token-major */
    float   *gu;         /* [T, 2*inter]: gate | up per token */
    float   *h;          /* [T, inter] */
    float   *tmp;        /* [T, max(hidden, inter)] */
    float   *mm_scratch; /* [T, max(hidden, inter)] permuted matmul input */
    float   *rc, *rs;    /* [T, hd/2] rope cos / sin */
    float   *qb;         /* [rows, n_heads, n, hd] */
    float   *kb, *vb;    /* [rows, n_kv, n, hd] */
    float   *ob;         /* [rows, n_heads, n, hd] */
    int32_t *tok_row;    /* [T] row of each compact token */
    int32_t *tok_col;    /* [T] column (0..n) of each compact token */
    int     *off;        /* [rows] */
    int     *len;        /* [rows] */
    struct model_cuda *gpu; /* --device cuda: the device twin that runs the forward (NULL: CPU) */
    struct g4_state *g4; /* Gemma 4 scratch (graph_gemma4.c), NULL otherwise */
};

#endif

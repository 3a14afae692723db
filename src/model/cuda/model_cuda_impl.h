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

extern "C" {
#include "model/arch/arch.h"
#include "model/model_impl.h"
}
#include "cache/cache_cuda.h"
#include "model/ops/gemm_cublas.h"
#include "model/cuda/model_cuda.h"

typedef __nv_bfloat16 bf16;

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

/* One layer's device weights. Attention layers (every layer of Qwen3 / Qwen2 / Llama; the
 * full layers of Qwen 3.5) use wqkv..k_norm; Qwen 3.5's gated-attention q rows hold, per
 * head, hd query rows then hd gate rows (QS = 2 QD + 2 KD). Qwen 3.5's linear (gated
 * DeltaNet) layers use the lin_* fields instead (kd = k_heads k_dim, vd = v_heads v_dim,
 * CD = 2 kd + vd, nv = v_heads). */
typedef struct mc_layer {
    float *attn_norm, *ffn_norm, *q_norm, *k_norm; /* [H], [H], [hd], [hd] or NULL */
    float *bqkv;                                    /* [QD + 2 KD] or NULL */
    float *bo;                                      /* [H] or NULL */
    bf16  *wqkv;                                    /* [QS, H] */
    bf16  *wo;                                      /* [H, QD] */
    bf16  *wgu;                                     /* [2 I, H] */
    bf16  *wd;                                      /* [H, I] */
    bf16  *lin_in;                                  /* [CD + vd + 2 nv, H] qkv | z | b | a */
    bf16  *lin_out;                                 /* [H, vd] */
    float *conv_w;                                  /* [CD, conv_kernel] */
    float *lin_neg_a, *dt_bias;                     /* [nv] -exp(A_log), dt bias */
    float *lin_norm;                                /* [v_dim] gated RMSNorm weight */
} mc_layer;

/* The device weights of one model: uploaded by its first device state, shared by all of
 * them, freed by tqkv_model_free (model.c) through model_cuda_weights_free. */
struct model_cuda_weights {
    int       n_layers;
    mc_layer *layers;    /* [L] */
    bf16     *embed;     /* [V, H] */
    bf16     *lm_head;   /* [V, H] (== embed when tied) */
    float    *final_norm;/* [H] */
    void     *arch;      /* the architecture's own device weights (its upload hook), or NULL */
    void    (*arch_free)(void *arch);
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
    size_t   win_ws;     /* Gemma 4: mc_attend_ws_bytes of the sliding layers' window
                          * views' longest row, i.e. their decode attention's split bound
                          * (the launch shape, not the length: below the window the views
                          * grow every step, their split bound only at 256-token steps),
                          * else 0. Implied by attn_ws today (a view is min(row + 1,
                          * window) of a row attn_ws covers); kept so that the key names
                          * every launch shape of the step should views and rows diverge */
    uint64_t gen;        /* model_cuda.gen: every buffer and cache storage pointer */
} mc_graph_key;

typedef struct {
    int              enabled;  /* params.device_graphs and not TQKV_CUDA_GRAPHS=0 */
    cudaGraphExec_t  exec;     /* the executable of `key`, or NULL */
    mc_graph_key     key;      /* what exec captured */
    mc_graph_key     pending;  /* the last step's key run directly: captured when seen again */
    model_cuda_graph_stats stats;
} mc_graph;

/* Qwen 3.5's recurrent rows on the device, with recurrent.h's row layout (per row, for
 * each linear layer j: conv [CD, conv_kernel - 1] oldest first, then the DeltaNet state
 * [v_heads, k_dim, v_dim]), so export / upload are plain copies of model_recurrent rows.
 * Spec rounds: snapshot slot s of row r (slot 0: the state at begin; slot k: after the
 * round's k-th token) at snap + (r (spec_cap + 1) + s) row_floats. */
typedef struct mc_rec {
    int     n_lin;            /* linear layers (0: the graph has no recurrent rows) */
    size_t  conv_floats, ssm_floats, row_floats;
    float  *state;            /* device [rows, row_floats] */
    int    *tokens;           /* host [rows] tokens absorbed (== the KV offsets) */
    int     spec_active;
    int     spec_cap;         /* snapshot slots per row beyond slot 0 */
    int    *spec_steps;       /* host [rows] tokens appended since spec_begin */
    float  *snap;             /* device [rows, spec_cap + 1, row_floats] */
} mc_rec;

struct model_cuda {
    const tqkv_model       *m;
    const model_arch_cuda_ops *arch_ops; /* the architecture's device hooks, or NULL */
    const model_cuda_weights *w;
    tqkv_model_state_params p;
    int                     rows;
    cuda_kv **kv;                      /* [L]; NULL for a linear (recurrent) layer and a
                                        * Gemma 4 KV-shared layer (it reads its donor's) */
    int max_hd;                        /* the largest head_dim of an attention layer */
    size_t max_qd, max_kd;             /* the largest n_heads hd, kv_heads hd of a layer */
    int kv0;                           /* the layer whose offsets are the rows' positions
                                        * (the first with a cache; Gemma 4: its position
                                        * layer, a full one; spec rounds) */
    mc_rec                  rec;       /* recurrent rows (Qwen 3.5), or n_lin 0 */
    int                     broken;    /* a failed forward left rows it could not undo (a
                                        * linear layer reached, or a KV rewind failed):
                                        * forwards and row operations refused until reset
                                        * or import */
    cudaStream_t            stream;    /* non-blocking: every kernel and copy of this state */
    uint64_t                gen;       /* bumped whenever a buffer or cache storage a decode
                                        * step reads may have moved (the graph's key) */
    uint64_t               *kv_ids;    /* [L] cache storage ids seen by the last step */
    mc_graph                graph;     /* the decode step's CUDA graph */
    /* device scratch, grown on demand */
    size_t  cap_t, cap_rn;
    float  *x, *xn;      /* [T, H] */
    float  *qkv;         /* [T, PW] projections: QS, or Qwen 3.5's linear CD + vd + 2 nv */
    float  *att;         /* [T, max(QD, vd)] */
    float  *cv;          /* [T, CD] conv + SiLU output of a linear layer (NULL: none) */
    int32_t *slot;       /* [T] the spec snapshot slot each token writes, or -1 */
    float  *gu;          /* [T, 2 I] */
    float  *hh;          /* [T, I] */
    float  *tmp;         /* [T, H] */
    float *rope;         /* [T, RW] cos | sin per token (RW = hd; Gemma 4: both layer
                          * types' tables, sliding then full, mc_rope_width) */
    float *ple;          /* [T, n_layers P] per-layer inputs (arch ple_width P), else NULL */
    float *pg;           /* [T, P] per-layer gate, else NULL */
    void  *arch;         /* the architecture's own state buffers (its prepare hook), or NULL */
    void   *xf;          /* GEMM activations as bf16 parts [parts, T, K] (gemm_cuda.h) */
    int     gemm_parts;  /* 1: bf16 activations (the model's bf16_act); 2: hi + lo */
    int     presplit;    /* the kernel before a GEMM writes its activation split (default;
                            TQKV_GEMM_PRESPLIT=0: a split launch before every GEMM) */
    int     pdl;         /* the forward's kernels launch programmatically (PDL; util/cuda_pdl.cuh):
                            the decode-size GEMMs, the norms, q/k post, gather, activations and
                            the experts' kernels; on unless TQKV_PDL=0 or the device refused
                            the attribute */
    float  *logits;      /* [cap_logits, V] (a tensor-parallel rank: [cap_logits, head_n]) */
    int     head_n;      /* lm_head rows: 0 = the vocabulary (a tensor-parallel rank: its
                          * vocabulary slice, tp_cuda.cu) */
    size_t  cap_logits;
    int32_t *tinfo;      /* [T, 3] token id, row, column */
    void   *aws;         /* decode attention workspace shared by the layers */
    size_t  aws_bytes;
    gemm_cublas *cublas; /* device_fast_gemm: the non-invariant cuBLAS path, else NULL */
    float  *qb, *ob;     /* [rows, NH, n, hd] */
    float  *kb, *vb;     /* [rows, NKV, n, hd] */
    /* host scratch (h_rope, h_tinfo, h_logits pinned: copied on the stream, in a graph) */
    float *h_rope;       /* [T, RW] */
    int32_t *h_tinfo;    /* [T, 3] */
    int32_t *h_slot;     /* [T] */
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
 * stream, and (hybrid graphs) new recurrent rows: rec_state [rows, row_floats] device
 * memory and rec_tokens [rows] host memory, both taken over (NULL for graphs without
 * recurrent rows); the spec round ends and the decode graph is dropped. On failure kv and
 * the recurrent rows are freed and g is unchanged. */
tqkv_status mc_install_caches(model_cuda *g, cuda_kv **kv, float *rec_state, int *rec_tokens,
                              int rows);
/* The fallible half of mc_install_caches: the same arguments, taken over also on failure,
 * into *out (model_cuda.h's model_cuda_rows; install with model_cuda_rows_install). kv NULL:
 * the caches keep their storage (their rows changed in place); the rest is installed. */
tqkv_status mc_rows_make(model_cuda *g, cuda_kv **kv, float *rec_state, int *rec_tokens, int rows,
                         model_cuda_rows **out);
/* Fresh zero recurrent rows for `rows` rows (*state device, zeroed on g's stream; *tokens
 * host; both NULL when the graph has none). */
tqkv_status mc_rec_alloc(const model_cuda *g, int rows, float **state, int **tokens);
/* Free an array of L caches (entries may be NULL) and the array. */
void        mc_free_cache_array(cuda_kv **kv, int L);
/* (buffers_cuda.cu) g's caches of `rows` rows as its state parameters ask (each layer its
 * own K/V pair, tqkv_kv_layer_formats; f32/f32: the dense bf16 cache, no window), installed. */
tqkv_status mc_make_caches(model_cuda *g, int rows);
/* Free g's caches and recurrent rows (waits for its stream); the twin is then unbroken. */
void        mc_free_caches(model_cuda *g);
/* Free every scratch buffer (device and pinned host; waits for the stream first). */
void        mc_free_scratch(model_cuda *g);
/* Drop the decode step's executable graph (it holds pointers that are about to go stale;
 * the generation bump makes every key taken before unequal to the next ones). */
void        mc_graph_drop(model_cuda *g);
/* Replace *p (device, or pinned host with `pinned`) by a new allocation of `bytes` once
 * nothing queued reads it (bumps the generation); *cap = new_cap on success, 0 otherwise. */
tqkv_status mc_regrow(model_cuda *g, void **p, int pinned, size_t bytes, size_t *cap, size_t new_cap);
/* Scratch for T tokens and RN = rows x n query slots; pinned logits staging for `rows`
 * rows; device logits rows; the pick's upload (bytes) and records (int32 words). */
tqkv_status mc_ensure_scratch(model_cuda *g, size_t T, size_t RN);
tqkv_status mc_ensure_hlogits(model_cuda *g, size_t rows);
tqkv_status mc_ensure_logits(model_cuda *g, size_t rows);
tqkv_status mc_ensure_pick(model_cuda *g, size_t in_bytes, size_t rec_words);

/* 1 when layer l of m has a device cache of its own (not a recurrent layer, not a
 * KV-shared one). */
static inline int mc_layer_has_kv(const tqkv_model *m, int l) {
    const int k = model_layer_kind_of(m, l);
    return k == MODEL_LAYER_KV || k == MODEL_LAYER_SLIDING;
}

// ---------------------------------------------------------------------------
// forward_cuda.cu's and weights_cuda.cu's helpers shared with src/model/arch/gemma4/graph_cuda.cu
// ---------------------------------------------------------------------------

tqkv_status mc_ck(cudaError_t e, const char *what);
tqkv_status mc_dmalloc(void **p, size_t bytes);
/* Upload the rows of ws[0..nw) stacked into one device bf16 matrix [sum n, k]. */
tqkv_status mc_upload_matrix(bf16 **out, const mm_weight *const *ws, int nw);
/* Concatenate host float vectors (NULL parts as zeros) into one device array; all-NULL -> NULL. */
tqkv_status mc_upload_vec(float **out, const float *const *parts, const int *lens, int np);
/* The model's weights on the device (weights_cuda.cu), once per model by its first state. */
tqkv_status mc_upload_weights(const tqkv_model *m, model_cuda_weights **out);
/* y [T, N] (ldy) = x [T, K] (ldx) . w^T (+ bias): the invariant GEMM (or cuBLAS) on g's stream. */
tqkv_status mc_gemm(model_cuda *g, const float *x, size_t ldx, int T, const bf16 *w, int N, int K,
                    const float *bias, float *y, size_t ldy);
/* mc_gemm on x whose split [gemm_parts, T, K] the kernel before wrote into g->xf (where
 * mc_split_xf(g) told it to): no split launch; plain mc_gemm with cuBLAS or presplit off. */
tqkv_status mc_gemm_pre(model_cuda *g, const float *x, size_t ldx, int T, const bf16 *w, int N,
                        int K, const float *bias, float *y, size_t ldy);
/* Where a kernel before an mc_gemm_pre writes that GEMM's split: g->xf, or NULL (cuBLAS, which
 * splits itself, or presplit off: TQKV_GEMM_PRESPLIT=0). */
uint16_t   *mc_split_xf(const model_cuda *g);
/* h [T, I] = SwiGLU of gu [T, 2I] (gate | up) with the CPU's exp, queued on s (pdl: a
 * programmatic launch, util/cuda_pdl.cuh; g->pdl in a forward); with xf also h's GEMM split
 * [parts, T, I] (mc_split_store), else NULL. */
void        mc_swiglu_queue(const float *gu, int I, float *h, size_t T, uint16_t *xf, int parts,
                            int pdl, cudaStream_t s);
/* h [T, I] = GeGLU (gelu_tanh(gate) * up) of gu [T, 2I], queued on s (Gemma 4, its experts);
 * xf, parts, pdl as for mc_swiglu_queue. */
void        mc_geglu_queue(const float *gu, int I, float *h, size_t T, uint16_t *xf, int parts,
                           int pdl, cudaStream_t s);
/* Layer l's dense MLP of xn [T, H] into tmp [T, H] (gu, hh as scratch), on g's stream: the
 * common feed-forward, and an architecture's ffn hook's for the layers it does not own. */
tqkv_status mc_ffn_dense(model_cuda *g, int l, int T);
/* The device pick after the lm_head (g->logits [rows, V]) and its records' copy. */
tqkv_status mc_pick_queue(model_cuda *g, int stride);
/* The verification window's attention on kv (head_dim hd): query j of each row through the
 * decode kernel n - 1 - j tokens back (qb, ob [R, NH, n, hd]; att as scratch). */
tqkv_status mc_attend_as_decode(model_cuda *g, cuda_kv *kv, int n, int NH, int hd, float scale);
/* Per-token floats of the RoPE tables (h_rope, rope): hd, or Gemma 4's two tables. */
int mc_rope_width(const tqkv_model *m);
/* Bytes of decode-attention workspace for rows of up to `tokens` tokens over every layer
 * (head dims above 128 scale it: see the definition). */
size_t mc_attend_ws_bytes(const model_cuda *g, int tokens);

/* The common graph's pieces (forward_cuda.cu), each queued on g->stream, in forward order:
 * begin (upload, embed, layer 0's norm -> xn), per layer [mixer: xn -> tmp; residual_norm
 * (ffn_norm); ffn: xn -> tmp; residual_norm (mc_next_norm)], head. The sharded forward
 * (tp_cuda.cu) runs them per rank with its all-reduces of tmp between. */
tqkv_status  mc_queue_begin(model_cuda *g, int n);
/* Layer l's mixer xn [T, H] -> tmp [T, H] (o GEMM bias included when the layer has one);
 * *lin: linear layers so far (advanced); *done = l + 1 once the layer's rows changed. */
tqkv_status  mc_layer_mixer(model_cuda *g, int l, int n, int as_decode, int *lin, int *done);
/* x [T, H] += tmp; xn = RMSNorm(x) w (and its GEMM split). */
void         mc_residual_norm(model_cuda *g, const float *w, size_t T);
/* The values per thread a 128-thread norm kernel keeps in registers between its passes for
 * rows of H: the smallest of 8, 16, 32 with H <= 128 NV (64 when max_nv allows), else 0
 * (the passes of loads); 0 as well with TQKV_NORM_REGS=0 (an A/B switch: the same bits). */
int          mc_norm_nv(int H, int max_nv);
tqkv_status  mc_layer_ffn(model_cuda *g, int l, int T);
const float *mc_next_norm(const model_cuda *g, int l);
/* Layer l's block after its mixer: residual_norm (ffn_norm), ffn, residual_norm
 * (mc_next_norm) as those steps (mc_ffn_block_steps) or the architecture's ffn_block hook. */
tqkv_status  mc_layer_ffn_block(model_cuda *g, int l, int T);
tqkv_status  mc_ffn_block_steps(model_cuda *g, int l, int T);
/* lm_head (head_n rows, else V) over xn into logits, the copy to out (host, NULL: none),
 * the device pick when pick > 0. */
tqkv_status  mc_head(model_cuda *g, int n, tqkv_logits_mode mode, float *out, int pick);

/* A forward's host half without running it (a tensor-parallel rank, tp_cuda.cu): the checks
 * of rows and tokens, every buffer for mode (no host logits staging, no pick) and the
 * token list / RoPE rows in the pinned buffers mc_queue_begin uploads. */
tqkv_status  mc_forward_prepare(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                                int prefill, tqkv_logits_mode mode, size_t *attn_ws);
/* After a forward's queue ran and its stream was waited for: the recurrent rows' token
 * counts advanced by n, the bounded sliding layers' drop (outside a spec round; a failure
 * marks the state broken). */
tqkv_status  mc_forward_finish(model_cuda *g, int n);
/* The appends of a call's first `done` layers rewound (a capture that never ran: nothing
 * else changed); a failed rewind's status. */
tqkv_status  mc_forward_undo(model_cuda *g, int done, int n);
/* The decode step's graph key now (logits copied or not, the decode attention's workspace
 * need from mc_forward_prepare, the pick stride) and the equality of two keys: a graph
 * captured under one replays under an equal one (the sharded step's graph, tp_cuda.cu). */
mc_graph_key mc_graph_key_now(model_cuda *g, int logits, size_t attn_ws, int pick);
int          mc_graph_key_same(const mc_graph_key *a, const mc_graph_key *b);
/* After a failed call whose queue ran (some of) `done` layers: their appends rewound (a
 * failed rewind, or a recurrent layer reached, marks the state broken). */
void         mc_forward_fail(model_cuda *g, int done, int n);

/* state_cuda.cu: room in the spec round's snapshots for n more tokens per row (a bigger
 * buffer: the old slots copied over, the generation bumped). */
tqkv_status mc_rec_spec_reserve(model_cuda *g, int n);

#endif

/*
 * model_impl.h - internal layout of tqkv_model and tqkv_model_state.
 * Owns: the structs shared by config.c (JSON), model.c (weights), forward.c (graph).
 * Must not: be included outside src/model and tests.
 */
#ifndef TQKV_MODEL_IMPL_H
#define TQKV_MODEL_IMPL_H

#include "model/ops/matmul.h"
#include "model/ops/moe.h"
#include "model/load/safetensors.h"
#include "tqkv_model.h"

// ---------------------------------------------------------------------------
// config.c
// ---------------------------------------------------------------------------

/* Parse dir/config.json and (optional) dir/generation_config.json. */
tqkv_status model_config_load(const char *dir, tqkv_model_config *cfg, tqkv_generation_config *gen);
/* Parse config.json text (name used in messages). */
tqkv_status model_config_parse(const char *json, size_t len, const char *name,
                               tqkv_model_config *cfg);
/* Every layer_types entry of config.json (if present) is one of kinds[] (NULL-ended). */
struct cJSON;
tqkv_status model_config_check_layer_types(const struct cJSON *root, const char *name,
                                           const char *const *kinds);
/* config.json field readers for the architectures' own fields: an integer in [lo, hi]
 * (def < -1: required, else its default when absent or null); a boolean (true / false or a
 * number; def when absent or of another type). */
tqkv_status model_config_int(const struct cJSON *o, const char *key, const char *name, long def,
                             long lo, long hi, int *out);
int         model_config_bool(const struct cJSON *o, const char *key, int def);
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
    /* ---- qwen35: gated DeltaNet (TQKV_LAYER_LINEAR layers only; see src/model/arch/qwen35/graph.c) ---- */
    mm_weight lin_in;      /* [2*kd + vd + vd + nv + nv, hidden] = qkv; z; b; a rows (fused
                              when packable, else data NULL and the four below are used) */
    mm_weight lin_qkv;     /* [2*kd + vd, hidden] (kd = k_heads*k_dim, vd = v_heads*v_dim) */
    mm_weight lin_z;       /* [vd, hidden] */
    mm_weight lin_b;       /* [nv, hidden] */
    mm_weight lin_a;       /* [nv, hidden] */
    mm_weight lin_out;     /* [hidden, vd] */
    float    *conv_w;      /* [2*kd + vd, conv_kernel] depthwise causal conv1d */
    float    *lin_neg_a;   /* [nv] -exp(A_log) */
    float    *dt_bias;     /* [nv] */
    float    *lin_norm;    /* [v_dim] gated RMSNorm weight */
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
    int                    bf16_act;    /* load parameter: bf16 activations in the products
                                           (CPU AVX512_BF16 kernels; device GEMM parts 1) */
    char                   source[1024]; /* weights file or index, for messages */
    struct model_cuda_weights *gpu_weights; /* --device cuda: bf16 weights in GPU memory,
                                               uploaded by the first device state (model_cuda.h) */
    struct model_tp_models *tp_models;  /* tensor parallelism: the rank models of one N, made
                                           by its first sharded state, shared by the later ones
                                           (tp/tp_state.h), or NULL */
    const struct model_arch_ops *ops;   /* the architecture (arch/arch.h) */
    void                  *arch;        /* the architecture's own model data (its load sets
                                           it; memory from model_own), or NULL */
};

/* model.c's loaders, for the graph files: tensors found by name with shape checks. */
tqkv_status model_load_vector(tqkv_model *m, const char *name, int n, float **out);
tqkv_status model_load_matrix(tqkv_model *m, const tqkv_model_load_params *lp, const char *name,
                              int rows, int cols, mm_weight *w);
/* Fused packed copy of parts (bf16, packable) or out->data == NULL. */
tqkv_status model_fuse(tqkv_model *m, const tqkv_model_load_params *lp, mm_weight **parts, int n,
                       mm_weight *out);
/* A SwiGLU MLP: pre + "{gate,up}_proj.weight" [inter, hidden] (read in place) and
 * pre + "down_proj.weight" [hidden, inter], gate / up fused into *gu when packable (else
 * gu->data NULL). */
tqkv_status model_load_swiglu(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                              int inter, mm_weight *g, mm_weight *u, mm_weight *down,
                              mm_weight *gu);
/* The routed experts of one sparse layer under pre ("model.layers.L.mlp.experts."), in
 * either layout: fused (pre + "gate_up_proj" [E, 2 * inter, hidden] = gate rows then up
 * rows per expert, pre + "down_proj" [E, hidden, inter]) or one tensor per expert
 * (pre + "E.{gate,up,down}_proj.weight"); X->gu / g / u / down allocated here. */
tqkv_status model_load_experts(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                               const moe_shape *sh, moe_layer *X);
/* Memory freed with the model. */
void       *model_own(tqkv_model *m, size_t bytes);
/* The token embedding `name` (kept in place) and the lm_head (or the tied embedding). */
tqkv_status model_load_embedding(tqkv_model *m, const tqkv_model_load_params *lp,
                                 const char *name);
tqkv_status model_load_head(tqkv_model *m, const tqkv_model_load_params *lp,
                            const char *embed_name);
/* The common decoder layout (embedding, layers, final norm, head) with the architecture's
 * per-layer loader and an optional finishing step after the final norm. */
tqkv_status model_load_decoder(tqkv_model *m, const tqkv_model_load_params *lp,
                               tqkv_status (*layer)(tqkv_model *m,
                                                    const tqkv_model_load_params *lp, int l),
                               tqkv_status (*finish)(tqkv_model *m));
/* registry.c: the ops of a parsed config's architecture. */
const struct model_arch_ops *model_arch_ops_of(tqkv_arch id);

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
    void    *ext;        /* the architecture's own per-state data (its state_init / forward
                            own it), NULL when it has none */
    /* recurrent rows of graphs with TQKV_LAYER_LINEAR layers (state/recurrent.h), NULL
     * otherwise; layers[l] is NULL for such a layer (it has no KV rows) */
    struct model_recurrent *rec;
    struct model_pick      *pick; /* tqkv_model_decode_pick's scratch (pick.c), NULL until used */
    /* tensor_parallel > 1 (tp/tp_state.h): the ranks, each with its shard of the weights and
     * the caches of its KV heads; layers is then rank 0's. NULL otherwise. */
    struct model_tp        *tp;
};

/* state.c: fresh empty caches for `rows` rows, one per layer with KV of its own (shared and
 * recurrent layers NULL), shaped by m's layer geometry; and their free (NULL is fine). */
tqkv_status model_state_make_layers(const tqkv_model *m, const tqkv_model_state_params *p,
                                    int rows, tqkv_batch ***out);
void        model_state_free_layers(tqkv_batch **layers, int n);

/* forward.c: skeleton pieces of a forward call shared by every graph.
 * model_forward_lengths: check each row's real-token count (lengths[r], or n when NULL) is
 * in [1, n], that prefill rows are empty (s->off must be current) and that every real
 * token of tokens [rows, n] is in [0, tok_limit) (messages name vocab V); records the
 * counts in s->len and their total in *T. Changes nothing else.
 * model_forward_compact: the compact token list of rows whose len[r] real tokens sit at
 * the end of n columns: tok_row / tok_col [T]; first [rows + 1] (may be NULL) gets each
 * row's first compact token.
 * model_kv_trim_rollback: undo the KV appends of layers [0, done) after a failure
 * (extend: trim n tokens; prefill: empty the layer); NULL layers are skipped. */
tqkv_status model_forward_lengths(tqkv_model_state *s, const int32_t *tokens, const int *lengths,
                                  int n, int prefill, int V, int tok_limit, size_t *T);
void        model_forward_compact(const int *len, int rows, int n, int32_t *tok_row,
                                  int32_t *tok_col, int *first);
void        model_kv_trim_rollback(tqkv_model_state *s, int done, int n, int prefill);

/* forward.c: attention of the n newest queries of each row (q, out [rows, NH, n, hd], the
 * tokens this call appended to b; s->off: the rows' positions before the call, every row
 * n real tokens) as n one-query calls through ap->kernel (the decode engine), query j
 * seeing exactly what its own single decode sees: the row's tokens up to its position,
 * the newest `window` of them when window > 0 (a sliding layer; 0: all), in the same
 * order and on the same token grid. The decode engine's split points are on a row's token
 * grid, so keep > 0 names a bounded sliding layer (after each forward outside a spec round
 * it keeps its newest `keep` tokens, src/model/arch/gemma4/graph.c): row r's query j is then attended on
 * a read-only view of b whose row starts as many tokens later as the layer would have
 * dropped before a single decode at that position (min(position, keep) tokens held), so
 * its bits do not depend on when the layer dropped (no view over a q8 ring: its slots are
 * indexed by b's tokens). Used by the verification window (extend_as_decode: logits equal
 * n single decodes bit for bit with window 0) of every CPU graph, and by Gemma 4's sliding
 * decodes on a layer holding more than keep tokens (inside or right after a spec round).
 * model_attend_reindexes: 1 when that view would shift some row for one of the n queries. */
tqkv_status model_attend_per_query(tqkv_model_state *s, const tqkv_batch *b, const float *q,
                                   int n, int window, int keep, const tqkv_attn_params *ap,
                                   float *out);
int         model_attend_reindexes(const tqkv_model_state *s, const tqkv_batch *b, int n,
                                   int keep);

/* rows.c: the rows' positions (tokens seen): the position layer's offsets, the recurrent
 * rows' token counts, or the device twin's. */
tqkv_status model_state_positions(const tqkv_model_state *s, int *pos);
/* state.c: the public forward's preamble (arguments, rows, context limit); nothing changes. */
tqkv_status model_forward_check(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, tqkv_logits_mode mode,
                                const float *logits);
/* state.c: free the common scratch (x, xn, qkv, ...; a graph's scratch growth failed). */
void        model_state_free_scratch(tqkv_model_state *s);
/* layer_info.c: layer l's kind (MODEL_LAYER_*, arch.h) and the layer whose KV it reads. */
int         model_layer_kind_of(const tqkv_model *m, int l);
int         model_layer_donor(const tqkv_model *m, int l);

/* pick.c: free the state's decode-and-pick scratch (NULL is fine). */
void        model_pick_free(struct model_pick *p);

/* kernel_set.c: the graph's attention kernel set (its ops' kset). */
void        model_kernel_set(const tqkv_model *m, tqkv_kernel *prefill, tqkv_kernel *decode);

#endif

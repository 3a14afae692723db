/*
 * tp_state.h - a tensor-parallel model state (issue 25; docs/TP.md): N rank states, each with
 *   its own shard of the weights (a rank model) and the compressed caches of its own KV heads
 *   (1/N of the cache bytes), in lockstep, and the communicator that joins them.
 * Owns: the ranks' lifecycle (init / free / reset), the weight slicing helpers the
 *   architectures' tp_shard hooks use (views of row ranges, copies of column ranges), the
 *   vocabulary split of the lm_head.
 * Must not: compute a graph (the architecture's forward runs the ranks: arch/<name>/tp.c,
 *   with the shared steps of tp_forward.h); name an architecture.
 *
 * The parent state's `layers` are rank 0's caches (rank 0's state owns them), so everything
 * that reads positions and offsets from the parent (the forward preamble, offsets, state
 * checks) sees the ranks' common rows. Reset, the forward and the row operations (merge,
 * filter, extract, spec rounds, export / import: tp_rows.c, called by state/rows.c after its
 * argument checks) act on every rank in lockstep: every rank changes or none does.
 */
#ifndef TQKV_TP_STATE_H
#define TQKV_TP_STATE_H

#include "model/model_impl.h"
#include "model/tp/tp_comm.h"

typedef struct model_tp {
    int               n;                        /* ranks */
    tp_comm          *comm;                     /* the model's communicator for N ranks on
                                                 * this side (CPU or device), shared by its
                                                 * sharded states (refcounted: tp_state.c) */
    tqkv_model       *model[TP_MAX_RANKS];      /* rank r's shard (arch tp_shard), the
                                                 * model's kept one (model_tp_models_free) */
    tqkv_model_state *rank[TP_MAX_RANKS];       /* rank r's state: its caches and scratch */
    int               vchunk;                   /* lm_head rows per rank (multiple of 8) */
    float            *head_out[TP_MAX_RANKS];   /* [M, vchunk] rank r's logits slice */
    float            *head_all;                 /* [N, M, vchunk] gathered slices */
    size_t            cap_head;                 /* M * vchunk the buffers hold */
    /* params.device 1: the ranks are device states (src/model/cuda/tp_cuda.cu runs the
     * forward), comm is NCCL or the device-local backend */
    int               on_device;
    int               device[TP_MAX_RANKS];     /* rank r's GPU: r % visible GPUs */
    float            *bo[TP_MAX_RANKS];         /* device [L, H] o_proj biases on rank r's
                                                 * GPU (NULL: no layer has one) */
    struct tp_graph  *graph;                    /* the sharded decode step's CUDA graph
                                                 * (TQKV_TP_GRAPHS; cuda/tp_cuda.cu), or NULL */
} model_tp;

/* The ranks a state of these params has: tensor_parallel when > 1; 1 for tensor_parallel 1
 * on the device with TQKV_TP_ONE_RANK=1 in the environment (a 1-rank sharded device state:
 * the NCCL path on one GPU, for tests; docs/TP.md); else 0 (not sharded). */
int         model_tp_ranks(const tqkv_model_state_params *p);

/* The refusal of a tensor_parallel value for this model and params (nothing changes):
 * TQKV_EINVAL when N does not divide the query heads or MLP width, N neither divides the KV
 * heads nor is a multiple of them (replication, tp_kv_range), or N is out of
 * 0..TP_MAX_RANKS; TQKV_EUNSUPPORTED for a graph without a sharded forward, a device other
 * than the CPU (0) or CUDA (1), a graph with a device forward queue of its own but no tp
 * pieces for it on CUDA (arch.h; none today), or BLAS products. N <= 1 is accepted (off) unless
 * model_tp_ranks makes it a 1-rank state. */
tqkv_status model_tp_check(const tqkv_model *m, const tqkv_model_state_params *p);
/* model_tp_ranks(&s->p) > 0: the ranks (s->layers becomes rank 0's caches); on the device
 * (params.device 1) each rank is a device state on GPU r % visible GPUs. */
tqkv_status model_tp_init(tqkv_model_state *s);
/* The rank models a model keeps (tqkv_model.tp_models), one set per N: made by the first
 * sharded state of that N, shared by every later one (their weight slices copied once, and
 * on the device their uploaded weights: once per model and rank, not per state), freed here
 * by tqkv_model_free. Not thread safe: a model's sharded states are made from one thread
 * (as its first device state). */
void        model_tp_models_free(tqkv_model *m);
/* The sharded states of m with n ranks on the CPU (on_device 0) or the device (1) holding
 * the model's one communicator for them (0: none is kept; it is freed with its last user). */
int         model_tp_comm_users(const tqkv_model *m, int n, int on_device);
void        model_tp_free(tqkv_model_state *s);
/* Every rank's caches emptied with `rows` rows (and the parent's off / len); on failure
 * nothing changed. */
tqkv_status model_tp_reset(tqkv_model_state *s, int rows);
/* The rank states in step with the parent before a forward (rows, rank 0's caches). */
void        model_tp_sync(tqkv_model_state *s);
/* head_out / head_all for m rows of logits. */
tqkv_status model_tp_head_buffers(model_tp *tp, size_t m);

/* ---- row operations in lockstep (tp_rows.c); rows.c has checked the arguments, the
 * parent state (rank 0) and that no spec round is open (merge, filter, extract, export) or
 * one is (rollback, commit). Each changes every rank or none. ---- */
/* A sharded device state's check: every rank's device check, and every rank's rows,
 * offsets and spec round equal rank 0's. */
tqkv_status model_tp_check_device(const tqkv_model_state *s);
/* Every rank consistent with the parent: its rows, positions pos0 [rows] and round spec0. */
tqkv_status model_tp_check_ranks(const tqkv_model_state *s, const int *pos0, int spec0);
/* src: sharded states over the same N (checked by rows.c); rows: the merged row count. */
tqkv_status model_tp_merge(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                           int rows);
tqkv_status model_tp_filter(tqkv_model_state *s, const int *keep, int n_keep);
/* Row `row` of every rank into the fresh 1-row sharded state n (same params). */
tqkv_status model_tp_extract(const tqkv_model_state *s, int row, tqkv_model_state *n);
/* Spec rounds: begin on every rank (a failure closes the rounds opened); rollback with keep
 * checked against every rank before any rolls back; commit (rows.c has checked the round). */
tqkv_status model_tp_spec_begin(tqkv_model_state *s);
tqkv_status model_tp_spec_rollback(tqkv_model_state *s, const int *keep, int n_keep);
tqkv_status model_tp_spec_commit(tqkv_model_state *s);
/* Export: "TQKVTP01" | u32 N | u32 rows | per rank: u64 length, that rank's state export
 * (the unsharded "TQKVMS02" format of its KV heads). */
tqkv_status model_tp_export(const tqkv_model_state *s, uint8_t **out, size_t *len);
/* buf starts with the sharded export's magic. */
int         model_tp_is_export(const uint8_t *buf, size_t len);
/* Import a sharded export into a state of p->tensor_parallel ranks (the same N); refuses an
 * unsharded export into a sharded state and a sharded one into an unsharded state. */
tqkv_status model_tp_import(tqkv_model_state **out, const tqkv_model *m,
                            const tqkv_model_state_params *p, const uint8_t *buf, size_t len);

/* ---- for the architectures' tp_shard hooks ---- */
/* Rows [n0, n1) of src: a view into src's storage when its layout allows (unpacked, or packed
 * with n0, n1 multiples of 8), else a copy owned by `owner`. Same element type, packing and
 * bf16 activation mode, so every output element is computed exactly as by src. */
tqkv_status tp_weight_rows(tqkv_model *owner, const mm_weight *src, int n0, int n1,
                           mm_weight *out);
/* Columns [k0, k1) of src copied (owned by `owner`), packed when src was and the slice can
 * be. */
tqkv_status tp_weight_cols(tqkv_model *owner, const mm_weight *src, int k0, int k1,
                           mm_weight *out);
/* A layer's attention projections of one rank into S: query rows [q0, q1) of wq (QD rows),
 * K / V rows [k0, k1) of wk / wv (KD rows each), taken from the fused q|k|v (wqkv) when L has
 * one (its packing and activation mode are what the unsharded graph runs; S->wqkv stays
 * empty); parts: 1 (q only: a layer reading another's cache), 2 (q, k: V is K's raw
 * projection) or 3. o_proj's columns are the caller's (tp_weight_cols). */
tqkv_status tp_shard_attn(tqkv_model *owner, const model_layer *L, int QD, int KD, int q0,
                          int q1, int k0, int k1, int parts, model_layer *S);
/* Row ranges of one or more matrices stacked into one copy (owned by `owner`): the rows
 * [n0, n1) of each part in order, packed when the first part was and the result can be
 * (rows % 8 == 0; else unpacked: the same f32 numerics, matmul.h), its activation mode.
 * The parts must share element type and k. */
typedef struct {
    const mm_weight *w;
    int              n0, n1;
} tp_rows_part;
tqkv_status tp_weight_gather(tqkv_model *owner, const tp_rows_part *parts, int n_parts,
                             mm_weight *out);
/* Rows [ranges[i][0], ranges[i][1]) of a float matrix src [*, width], stacked into a copy
 * owned by `owner`. */
tqkv_status tp_floats_gather(tqkv_model *owner, const float *src, int width,
                             const int (*ranges)[2], int n_ranges, float **out);
/* A layer's gated MLP slice of rank r of n (width I, n | I) into S: gate / up rows
 * [r I/n, (r+1) I/n) (views into the fused gate|up when L has one), down_proj's columns (a
 * copy). */
tqkv_status tp_shard_glu(tqkv_model *owner, const model_layer *L, int I, int r, int n,
                         model_layer *S);
/* A sparse layer's rank-r shard into S (c: the whole model's config): the router and the
 * per-expert scale replicated (every rank routes alike), every expert's SwiGLU and the
 * shared expert's (if any) split over their widths as tp_shard_glu splits an MLP, the shared
 * expert's gate replicated. */
tqkv_status tp_shard_moe(tqkv_model *owner, const moe_layer *X, const tqkv_model_config *c,
                         int r, int n, moe_layer *S);
/* The refusal (TQKV_EINVAL) of n not dividing an expert width of c (experts, shared expert). */
tqkv_status tp_check_moe(const tqkv_model_config *c, int n);
/* The refusal of n for kv_heads KV heads (what) unless n divides them or is a multiple. */
tqkv_status tp_check_kv(int kv_heads, int n, const char *what);
/* Rank r's KV heads [*h0, *h0 + *hn): NKV / n heads each when n divides NKV, else (n a
 * multiple of NKV) one head replicated on n / NKV ranks (its cache then held n / NKV times). */
void        tp_kv_range(int kv_heads, int n, int r, int *h0, int *hn);
/* Rank r's vocabulary rows of the lm_head: [r * chunk, min((r + 1) * chunk, V)). */
void        tp_vocab_range(int vocab, int n, int r, int *v0, int *v1, int *chunk);

#endif

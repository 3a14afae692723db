/*
 * tp_forward.h - the architecture-free pieces of a sharded forward on the CPU (issue 25;
 *   docs/TP.md): the all-reduce of the ranks' partial products and the vocabulary-parallel
 *   head with its all-gather, shared by every graph's tp.c.
 * Owns: nothing but these steps; the buffers are the ranks' (their states' scratch) and the
 *   head buffers of model_tp.
 * Must not: know a graph's layers; reduce in another order than tp_comm's.
 */
#ifndef TQKV_TP_FORWARD_H
#define TQKV_TP_FORWARD_H

#include "model/tp/tp_state.h"

/* bufs[r] [count]: every rank's partial product, summed in rank order, in place (each rank's
 * buffer then holds the sum). */
tqkv_status tp_reduce(model_tp *tp, float *const *bufs, size_t count);
/* The same over every rank state's tmp [count] (the graphs whose partials live there). */
tqkv_status tp_reduce_tmp(model_tp *tp, size_t count);

/* A graph's undo of a state's KV appends of layers [0, done) after a failure. */
typedef void (*tp_undo_fn)(tqkv_model_state *q, int done, int n, int prefill);
/* Undo every rank's appends of a forward that failed at layer l: on rank `failed` (which
 * undid its own [0, l] already) and after it layers [0, l) stand, before it [0, l]; failed
 * < 0 (a failure after every rank's layer l): [0, l] on every rank. */
void tp_undo_ranks(model_tp *tp, int failed, int l, int n, int prefill, tp_undo_fn undo);

/* Every rank's rows, their positions (off) and real-token counts (len) from the parent
 * (after the parent's preamble). */
void tp_ranks_rows(tqkv_model_state *s);

/* One rank's view of the head's inputs. */
typedef struct {
    const float *x; /* [T, hidden] the residual stream */
    float       *xn; /* [T, hidden] scratch for the normed tokens */
    float       *mm; /* the matmul scratch (mm_matmul_ld) */
} tp_head_rank;

/* The sharded head: on every rank the final RMSNorm of the head's tokens (LAST: each row's
 * last compact token, len[r] real tokens per row; ALL: the T compact tokens) and its
 * vocabulary rows into [M, vchunk], then cap * tanh(l / cap) of its slice when cap > 0
 * (elementwise: the bits of the unsharded softcap); all-gathered into logits [rows, V]
 * (LAST) or [rows, n, V] (ALL, padding zero; row / col: the compact tokens' places). */
typedef struct {
    size_t         T;      /* compact tokens */
    int            n;      /* columns per row */
    int            nq_pad; /* some row has fewer than n real tokens */
    float          cap;    /* final logit soft-capping (0: none) */
    const int     *len;    /* [rows] */
    const int32_t *row, *col; /* [T] */
} tp_head_args;
/* rk: per rank; NULL: every rank state's own x, xn and mm_scratch (row / col NULL: rank 0's
 * tok_row / tok_col). */
tqkv_status tp_head_logits(const tqkv_model *m, tqkv_model_state *s, const tp_head_rank *rk,
                           const tp_head_args *a, tqkv_logits_mode mode, float *logits);

#endif

/*
 * tp_forward.c - the architecture-free pieces of a sharded forward (tp_forward.h): the
 *   rank-order all-reduce of partial products, the ranks' rows, the vocabulary-parallel head
 *   and the all-gather of its slices.
 * Must not: know a graph's layers (the graphs' tp.c run them); let a row's bits depend on
 *   other rows (per-token norms, batch-invariant products, an elementwise gather).
 */
#include <math.h>
#include <string.h>

#include "model/ops/ops.h"
#include "model/tp/tp_forward.h"

tqkv_status tp_reduce(model_tp *tp, float *const *bufs, size_t count) {
    return tp_allreduce_sum(tp->comm, bufs, count, NULL);
}

tqkv_status tp_reduce_tmp(model_tp *tp, size_t count) {
    float *bufs[TP_MAX_RANKS];
    for (int r = 0; r < tp->n; r++) bufs[r] = tp->rank[r]->tmp;
    return tp_reduce(tp, bufs, count);
}

void tp_undo_ranks(model_tp *tp, int failed, int l, int n, int prefill, tp_undo_fn undo) {
    for (int r = 0; r < tp->n; r++) {
        if (r == failed) continue;
        undo(tp->rank[r], failed < 0 || r < failed ? l + 1 : l, n, prefill);
    }
}

void tp_ranks_rows(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    for (int r = 0; r < tp->n; r++) {
        tqkv_model_state *q = tp->rank[r];
        memcpy(q->off, s->off, sizeof(int) * (size_t)s->rows);
        memcpy(q->len, s->len, sizeof(int) * (size_t)s->rows);
    }
}

/* Rank r's slice: final RMSNorm of the M head tokens, its vocabulary rows into head_out[r]
 * [M, vchunk], soft-capped over its own columns. */
static void head_slice(const tqkv_model *m, tqkv_model_state *s, int r, const tp_head_rank *rk,
                       const tp_head_args *a, size_t M, int last) {
    model_tp *tp = s->tp;
    const tqkv_model_config *c = &m->cfg;
    const int H = c->hidden_size, C = tp->vchunk;
    size_t at = 0;
    for (size_t i = 0; i < M; i++) { /* LAST: each row's last compact token */
        const size_t t = last ? (at += (size_t)a->len[i]) - 1 : i;
        ops_rmsnorm(rk->x + t * H, m->final_norm, c->rms_norm_eps, H, rk->xn + i * H);
    }
    const mm_weight *w = &tp->model[r]->lm_head; /* [v1 - v0, hidden] */
    float *out = tp->head_out[r];                /* [M, C] */
    mm_matmul_ld(rk->xn, (int)M, w, NULL, out, (size_t)C, s->p.threads, rk->mm);
    if (a->cap > 0) {
        const float cap = a->cap;
        for (size_t i = 0; i < M; i++)
            for (int e = 0; e < w->n; e++)
                out[i * C + e] = tanhf(out[i * C + e] / cap) * cap;
    }
}

tqkv_status tp_head_logits(const tqkv_model *m, tqkv_model_state *s, const tp_head_rank *rk,
                           const tp_head_args *a, tqkv_logits_mode mode, float *logits) {
    model_tp *tp = s->tp;
    const int R = s->rows, V = m->cfg.vocab_size, n = a->n, C = tp->vchunk;
    const int last = mode == TQKV_LOGITS_LAST;
    const size_t M = last ? (size_t)R : a->T;
    tqkv_status rc = model_tp_head_buffers(tp, M);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < tp->n; r++) {
        const tqkv_model_state *q = tp->rank[r];
        const tp_head_rank own = {q->x, q->xn, q->mm_scratch};
        head_slice(m, s, r, rk ? &rk[r] : &own, a, M, last);
    }
    const int32_t *row = a->row ? a->row : tp->rank[0]->tok_row;
    const int32_t *col = a->col ? a->col : tp->rank[0]->tok_col;
    float *recv[TP_MAX_RANKS]; /* the CPU backend: one gathered copy serves every rank */
    for (int r = 0; r < tp->n; r++) recv[r] = tp->head_all;
    rc = tp_allgather(tp->comm, (const float *const *)tp->head_out, recv, M * (size_t)C, NULL);
    if (rc != TQKV_OK) return rc;
    if (!last && a->nq_pad) memset(logits, 0, sizeof(float) * (size_t)R * n * V);
    for (size_t i = 0; i < M; i++) {
        float *dst = last ? logits + i * V : logits + ((size_t)row[i] * n + col[i]) * V;
        for (int r = 0; r < tp->n; r++) {
            int v0, v1, chunk;
            tp_vocab_range(V, tp->n, r, &v0, &v1, &chunk);
            memcpy(dst + v0, tp->head_all + ((size_t)r * M + i) * C,
                   sizeof(float) * (size_t)(v1 - v0));
        }
    }
    return TQKV_OK;
}

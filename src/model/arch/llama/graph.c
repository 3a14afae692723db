/*
 * graph.c - the Llama-family forward pass on the CPU (LlamaForCausalLM, Qwen3ForCausalLM,
 * Qwen2ForCausalLM; MiniCPM5's public checkpoints are Llama).
 * Owns: the graph: embed -> per layer [RMSNorm, q/k/v (+bias), q/k RMSNorm (Qwen3), RoPE,
 *   cache append, attention, o_proj (+bias), residual, RMSNorm, SwiGLU MLP, residual] ->
 *   RMSNorm -> lm_head, and its scratch.
 * Activations are kept compact, token-major ([T, dim], T = real tokens of all rows), so
 * padding costs no matmul work; queries/keys/values are scattered to the cache's
 * [rows, heads, n, head_dim] layout only around the cache and attention calls.
 * Must not: check arguments the common preamble checks (state/state.c); make a row's result
 * depend on other rows: every per-token kernel works on its own token, matmuls are batch
 * invariant (ops/matmul.c), attention is by contract.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h"
#include "model/arch/llama/llama.h"
#include "model/ops/ops.h"
#include "util/common.h"
#include "util/pool.h"

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------

tqkv_status llama_scratch(tqkv_model_state *s, size_t T, size_t RN) {
    const tqkv_model_config *c = &s->m->cfg;
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size, hd = (size_t)c->head_dim;
    size_t QD = (size_t)c->n_heads * hd, KD = (size_t)c->n_kv_heads * hd;
    size_t W = H > I ? H : I;
    if (W < QD) W = QD;
    if (T > s->cap_t) {
        size_t t = T < 16 ? 16 : T;
        int ok = tqkv_grow_floats(&s->x, t * H) && tqkv_grow_floats(&s->xn, t * H) && tqkv_grow_floats(&s->qkv, t * (QD + 2 * KD)) &&
                 tqkv_grow_floats(&s->att, t * QD) && tqkv_grow_floats(&s->gu, t * 2 * I) && tqkv_grow_floats(&s->h, t * I) &&
                 tqkv_grow_floats(&s->tmp, t * W) &&
                 tqkv_grow_floats(&s->mm_scratch, t * W) && tqkv_grow_floats(&s->rc, t * hd / 2) && tqkv_grow_floats(&s->rs, t * hd / 2);
        int32_t *a = realloc(s->tok_row, sizeof(int32_t) * t);
        if (a) s->tok_row = a;
        int32_t *b = realloc(s->tok_col, sizeof(int32_t) * t);
        if (b) s->tok_col = b;
        if (!ok || !a || !b) {
            model_state_free_scratch(s);
            return tqkv_fail(TQKV_ENOMEM, "out of memory for %zu tokens of activations", T);
        }
        s->cap_t = t;
    }
    if (RN > s->cap_rn) {
        int ok = tqkv_grow_floats(&s->qb, RN * QD) && tqkv_grow_floats(&s->kb, RN * KD) && tqkv_grow_floats(&s->vb, RN * KD) &&
                 tqkv_grow_floats(&s->ob, RN * QD);
        if (!ok) {
            model_state_free_scratch(s);
            return tqkv_fail(TQKV_ENOMEM, "out of memory for the attention buffers");
        }
        s->cap_rn = RN;
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

void llama_matmul_ld(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                     const float *bias, float *y, size_t ldy, int prefill) {
    if (s->p.blas && prefill && w->f32 && T > 1)
        mm_matmul_blas(x, T, w, bias, y, ldy, s->p.threads);
    else
        mm_matmul_ld(x, T, w, bias, y, ldy, s->p.threads, s->mm_scratch);
}

void llama_matmul(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                  const float *bias, float *y, int prefill) {
    llama_matmul_ld(s, x, T, w, bias, y, (size_t)w->n, prefill);
}

/* Undo the appends of layers [0, done) after a failure (extend: rewind n, also inside a
 * spec round; prefill: empty). Neither can fail after the checks forward() made: rows
 * held >= n tokens more than before, and an empty batch of the same config is a small
 * allocation; if even that fails the layer stays as appended and the state says so. */
tqkv_status llama_rollback(tqkv_model_state *s, int done, int n, int prefill) {
    tqkv_status worst = TQKV_OK;
    for (int l = 0; l < done; l++) {
        tqkv_status rc;
        if (prefill) {
            tqkv_batch *nb = NULL;
            rc = tqkv_batch_init(&nb, tqkv_batch_get_config(s->layers[l]), s->rows);
            if (rc == TQKV_OK) {
                tqkv_batch_free(s->layers[l]);
                s->layers[l] = nb;
            }
        } else {
            rc = tqkv_batch_rewind(s->layers[l], n);
        }
        if (rc != TQKV_OK) worst = rc;
    }
    return worst;
}

// ---------------------------------------------------------------------------
// per-token loops (the compute pool, util/pool.h)
// ---------------------------------------------------------------------------

/* Tokens from which a per-token loop is split over the threads: below, the fork and join
 * cost more than the work (a token's norm of 512 floats takes ~0.1 us). */
#define LLAMA_LOOP_MIN 16

/* What a per-token loop body reads; each body fills the fields it needs. */
typedef struct {
    const tqkv_model *m;
    tqkv_model_state *s;
    const model_layer *L;
    const llama_shape *f;
    const int32_t *tokens;
    const float *o, *bias, *norm;
} llama_loop;

static void loop_run(const llama_loop *c, size_t T, pool_index_fn body) {
    pool_for_each(c->s->p.threads, T, LLAMA_LOOP_MIN, body, (void *)c);
}

/* Embedding rows and RoPE tables of the T compact tokens. */
static void embed_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    const tqkv_model *m = c->m;
    tqkv_model_state *s = c->s;
    const int H = m->cfg.hidden_size, half = m->cfg.head_dim / 2, n = c->f->n;
    int r = s->tok_row[i], j = s->tok_col[i];
    int pos = s->off[r] + j - (n - s->len[r]);
    mm_weight_row(&m->embed, c->tokens[(size_t)r * n + j], s->x + i * H);
    ops_rope_table(pos, m->inv_freq, half, s->rc + i * half, s->rs + i * half);
}

void llama_embed(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                 const llama_shape *f) {
    llama_loop c = {.m = m, .s = s, .f = f, .tokens = tokens};
    loop_run(&c, f->T, embed_tok);
}

/* RMSNorm of x into xn with norm (c->norm). */
static void norm_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    const int H = c->m->cfg.hidden_size;
    ops_rmsnorm(c->s->x + i * H, c->norm, c->m->cfg.rms_norm_eps, H, c->s->xn + i * H);
}

/* q/k norm, RoPE, scatter of token i's q/k/v to qb / kb / vb. */
static void qkv_scatter_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    const tqkv_model_config *cf = &c->m->cfg;
    tqkv_model_state *s = c->s;
    const model_layer *L = c->L;
    const int hd = cf->head_dim, NH = cf->n_heads, NKV = cf->n_kv_heads, half = hd / 2, n = c->f->n;
    const int QD = NH * hd, KD = NKV * hd;
    const size_t QS = (size_t)QD + 2 * (size_t)KD;
    float *q = s->qkv + i * QS, *k = q + QD, *v = k + KD;
    if (L->q_norm) {
        for (int h = 0; h < NH; h++) ops_rmsnorm(q + h * hd, L->q_norm, cf->rms_norm_eps, hd, q + h * hd);
        for (int h = 0; h < NKV; h++) ops_rmsnorm(k + h * hd, L->k_norm, cf->rms_norm_eps, hd, k + h * hd);
    }
    ops_rope_apply(q, NH, hd, s->rc + i * half, s->rs + i * half);
    ops_rope_apply(k, NKV, hd, s->rc + i * half, s->rs + i * half);
    size_t r = (size_t)s->tok_row[i], j = (size_t)s->tok_col[i];
    for (int h = 0; h < NH; h++)
        memcpy(s->qb + ((r * NH + h) * n + j) * hd, q + h * hd, sizeof(float) * hd);
    for (int h = 0; h < NKV; h++) {
        memcpy(s->kb + ((r * NKV + h) * n + j) * hd, k + h * hd, sizeof(float) * hd);
        memcpy(s->vb + ((r * NKV + h) * n + j) * hd, v + h * hd, sizeof(float) * hd);
    }
}

/* RMSNorm, q/k/v projections, q/k norm, RoPE, scatter to qb / kb / vb
 * [rows, heads, n, hd] (padding positions zero). */
void llama_qkv_project(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                       const llama_shape *f) {
    const tqkv_model_config *c = &m->cfg;
    const int R = s->rows, hd = c->head_dim, n = f->n, pf = f->pf;
    const int QD = c->n_heads * hd, KD = c->n_kv_heads * hd;
    const size_t T = f->T, QS = (size_t)QD + 2 * (size_t)KD;
    llama_loop lp = {.m = m, .s = s, .L = L, .f = f, .norm = L->attn_norm};
    loop_run(&lp, T, norm_tok);
    if (L->wqkv.data && !(s->p.blas && pf)) {
        llama_matmul(s, s->xn, (int)T, &L->wqkv, L->bqkv, s->qkv, pf);
    } else {
        llama_matmul_ld(s, s->xn, (int)T, &L->wq, L->bq, s->qkv, QS, pf);
        llama_matmul_ld(s, s->xn, (int)T, &L->wk, L->bk, s->qkv + QD, QS, pf);
        llama_matmul_ld(s, s->xn, (int)T, &L->wv, L->bv, s->qkv + QD + KD, QS, pf);
    }
    if (f->nq_pad) {
        memset(s->qb, 0, sizeof(float) * (size_t)R * n * QD);
        memset(s->kb, 0, sizeof(float) * (size_t)R * n * KD);
        memset(s->vb, 0, sizeof(float) * (size_t)R * n * KD);
    }
    loop_run(&lp, T, qkv_scatter_tok);
}

/* Layer l's cache append and attention: ob [rows, NH, n, hd]. On failure the appends of
 * layers [0, l] are rolled back. */
tqkv_status llama_attend(const tqkv_model *m, tqkv_model_state *s, int l, const llama_shape *f) {
    tqkv_batch *b = s->layers[l];
    const int n = f->n;
    tqkv_status rc;
    batch_set_threads(b, s->p.threads);
    if (f->prefill) {
        rc = tqkv_batch_prepare_prefill(b, s->len);
        if (rc == TQKV_OK) rc = tqkv_batch_append(b, s->kb, s->vb, n);
        if (rc == TQKV_OK) rc = tqkv_batch_finalize_prefill(b);
    } else {
        rc = tqkv_batch_append(b, s->kb, s->vb, n);
    }
    if (rc != TQKV_OK) {
        (void)llama_rollback(s, f->prefill ? l + 1 : l, n, f->prefill);
        return rc;
    }
    const tqkv_mask *mask = NULL;
    rc = tqkv_batch_make_mask(b, s->lease, n, 0, &mask);
    if (rc == TQKV_OK) {
        const float scale = 1.0f / sqrtf((float)m->cfg.head_dim);
        tqkv_attn_params ap = {m->cfg.n_heads, scale,
                               n == 1 ? s->p.decode_kernel : s->p.prefill_kernel, s->p.threads};
        if (f->as_dec) {
            ap.kernel = s->p.decode_kernel;
            rc = model_attend_per_query(s, b, s->qb, n, 0, 0, &ap, s->ob);
        } else {
            rc = tqkv_batch_attend(b, mask, s->qb, n, &ap, s->ob);
        }
    }
    if (rc != TQKV_OK) (void)llama_rollback(s, l + 1, n, f->prefill);
    return rc;
}

/* Gather ob [rows, NH, n, hd] to token order att [T, NH * hd], then o_proj (+ bias) into
 * tmp [T, hidden]. */
static void gather_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    tqkv_model_state *s = c->s;
    const int hd = c->m->cfg.head_dim, NH = c->m->cfg.n_heads, QD = NH * hd, n = c->f->n;
    size_t r = (size_t)s->tok_row[i], j = (size_t)s->tok_col[i];
    for (int h = 0; h < NH; h++)
        memcpy(s->att + i * QD + (size_t)h * hd, s->ob + ((r * NH + h) * n + j) * hd,
               sizeof(float) * hd);
}

void llama_out_matmul(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                      const llama_shape *f, const float *bias) {
    llama_loop c = {.m = m, .s = s, .f = f};
    loop_run(&c, f->T, gather_tok);
    llama_matmul(s, s->att, (int)f->T, &L->wo, bias, s->tmp, f->pf);
}

/* x [T, hidden] += o [T, hidden] (+ bias [hidden] after it when not NULL); then, when norm is
 * not NULL, RMSNorm of x into xn. */
static void residual_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    const int H = c->m->cfg.hidden_size;
    float *x = c->s->x + i * H;
    const float *oi = c->o + i * H, *bias = c->bias;
    if (bias)
        for (int e = 0; e < H; e++) x[e] += oi[e] + bias[e];
    else
        for (int e = 0; e < H; e++) x[e] += oi[e];
    if (c->norm) ops_rmsnorm(x, c->norm, c->m->cfg.rms_norm_eps, H, c->s->xn + i * H);
}

void llama_residual(const tqkv_model *m, tqkv_model_state *s, size_t T, const float *o,
                    const float *bias, const float *norm) {
    llama_loop c = {.m = m, .s = s, .o = o, .bias = bias, .norm = norm};
    loop_run(&c, T, residual_tok);
}

static void swiglu_tok(void *arg, size_t i) {
    const llama_loop *c = arg;
    const size_t I = (size_t)c->m->cfg.intermediate_size;
    ops_swiglu(c->s->gu + i * 2 * I, c->s->gu + i * 2 * I + I, (int)I, c->s->h + i * I);
}

/* The SwiGLU MLP of xn [T, hidden] into tmp [T, hidden] (down_proj's product). */
void llama_mlp(const tqkv_model *m, tqkv_model_state *s, const model_layer *L, size_t T, int pf) {
    const int I = m->cfg.intermediate_size;
    if (L->wgu.data && !(s->p.blas && pf)) {
        llama_matmul(s, s->xn, (int)T, &L->wgu, NULL, s->gu, pf);
    } else {
        llama_matmul_ld(s, s->xn, (int)T, &L->wg, NULL, s->gu, 2 * (size_t)I, pf);
        llama_matmul_ld(s, s->xn, (int)T, &L->wu, NULL, s->gu + I, 2 * (size_t)I, pf);
    }
    llama_loop c = {.m = m, .s = s};
    loop_run(&c, T, swiglu_tok);
    llama_matmul(s, s->h, (int)T, &L->wd, NULL, s->tmp, pf);
}

/* The dense SwiGLU MLP of xn [T, hidden], added to the residual stream x. */
tqkv_status llama_ffn_dense(const tqkv_model *m, tqkv_model_state *s, int l, size_t T, int pf) {
    llama_mlp(m, s, &m->layers[l], T, pf);
    llama_residual(m, s, T, s->tmp, NULL, NULL);
    return TQKV_OK;
}

/* Final RMSNorm and lm_head: logits [rows, V] (LAST) or [rows, n, V] (ALL, padding zero). */
static void head(const tqkv_model *m, tqkv_model_state *s, const llama_shape *f,
                 tqkv_logits_mode mode, float *logits) {
    const tqkv_model_config *c = &m->cfg;
    const int R = s->rows, H = c->hidden_size, V = c->vocab_size, n = f->n;
    const size_t T = f->T;
    if (mode == TQKV_LOGITS_NONE) return;
    if (mode == TQKV_LOGITS_LAST) {
        /* each row's last token is the last compact token of the row */
        size_t at = 0;
        for (int r = 0; r < R; r++) {
            at += (size_t)s->len[r];
            ops_rmsnorm(s->x + (at - 1) * H, m->final_norm, c->rms_norm_eps, H, s->xn + (size_t)r * H);
        }
        llama_matmul(s, s->xn, R, &m->lm_head, NULL, logits, 0);
        return;
    }
    llama_loop lp = {.m = m, .s = s, .norm = m->final_norm};
    loop_run(&lp, T, norm_tok);
    if (!f->nq_pad) { /* compact order == [rows, n] order */
        llama_matmul(s, s->xn, (int)T, &m->lm_head, NULL, logits, f->pf);
        return;
    }
    /* padded: compute per row into its slot, zero the padding positions */
    size_t at = 0;
    for (int r = 0; r < R; r++) {
        int pad = n - s->len[r];
        float *dst = logits + (size_t)r * n * V;
        memset(dst, 0, sizeof(float) * (size_t)pad * V);
        llama_matmul(s, s->xn + at * H, s->len[r], &m->lm_head, NULL, dst + (size_t)pad * V, f->pf);
        at += (size_t)s->len[r];
    }
}

/* tokens [rows, n]; lens[r] real tokens at the end of each row (prefill) or n (extend);
 * ffn(m, s, l, T, pf): layer l's feed-forward of xn [T, hidden], added to x. */
tqkv_status llama_forward_with(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                               const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                               float *logits, llama_ffn_fn ffn) {
    const int R = s->rows, V = m->cfg.vocab_size;
    /* validate before touching anything (a scheduler may have filtered a layer's rows) */
    tqkv_status rc = tqkv_model_state_check(s); /* rows, offsets, spec round: every layer */
    if (rc != TQKV_OK) return rc;
    rc = tqkv_batch_offsets(s->layers[0], s->off, NULL);
    if (rc != TQKV_OK) return rc;
    llama_shape f = {.n = n, .prefill = prefill};
    rc = model_forward_lengths(s, tokens, lengths, n, prefill, V, V, &f.T);
    if (rc != TQKV_OK) return rc;
    rc = llama_scratch(s, f.T, (size_t)R * (size_t)n);
    if (rc != TQKV_OK) return rc;

    model_forward_compact(s->len, R, n, s->tok_row, s->tok_col, NULL);
    llama_embed(m, s, tokens, &f);
    /* a verification window (extend_as_decode) runs the decode path's matmuls (never BLAS),
     * so each of its tokens gets the bits of its single decode */
    f.as_dec = !prefill && n > 1 && s->p.extend_as_decode;
    f.pf = n > 1 && !f.as_dec;
    for (int r = 0; r < R; r++) f.nq_pad |= s->len[r] != n;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const model_layer *L = &m->layers[l];
        llama_qkv_project(m, s, L, &f);
        if ((rc = llama_attend(m, s, l, &f)) != TQKV_OK) return rc;
        llama_out_matmul(m, s, L, &f, L->bo);
        llama_residual(m, s, f.T, s->tmp, NULL, L->ffn_norm);
        if ((rc = ffn(m, s, l, f.T, f.pf)) != TQKV_OK) {
            (void)llama_rollback(s, l + 1, n, prefill);
            return rc;
        }
    }
    head(m, s, &f, mode, logits);
    return TQKV_OK;
}

tqkv_status llama_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                          const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                          float *logits) {
    if (s->tp) return llama_forward_tp(m, s, tokens, lengths, n, prefill, mode, logits);
    return llama_forward_with(m, s, tokens, lengths, n, prefill, mode, logits, llama_ffn_dense);
}

/*
 * src/model/arch/qwen35/graph.c - the Qwen 3.5 hybrid forward pass on the CPU (Qwen3_5ForCausalLM).
 * Owns: the graph
 *   embed -> per layer [zero-centred RMSNorm,
 *      full:   q|gate, k, v projections, q/k norms, partial RoPE (rotary_dim), cache append,
 *              attention, o * sigmoid(gate), o_proj;
 *      linear: qkv|z|b|a projections, depthwise causal conv1d + SiLU, L2-normalised q/k,
 *              beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), gated delta rule,
 *              gated RMSNorm (w * norm(o) * silu(z)), out_proj;
 *      residual, RMSNorm, SwiGLU MLP (or a graph's own feed-forward: qwen35_forward_with),
 *      residual] -> RMSNorm -> lm_head
 *   and its scratch.
 * Must not: make a row's result depend on other rows or on the thread count: matmuls are
 * batch invariant, every conv channel / DeltaNet (row, value head) item is computed by one
 * thread in token order, attention is by contract.
 *
 * Delta rule: one recurrent implementation for prefill and decode (token by token, in
 * float32, per value head h with key head h / (v_heads / k_heads)):
 *   S <- exp(g) S;  d = beta (v - S^T k);  S <- S + k d^T;  o = S^T q / sqrt(k_dim)
 * with S [k_dim, v_dim]. This is transformers' torch_recurrent_gated_delta_rule; its
 * torch_chunk_gated_delta_rule (used by HF for prefill) is the same recurrence reordered,
 * equal within float32 rounding (checked by the parity tests against HF's chunked prefill).
 * Left padding never reaches the state: only each row's real tokens are processed, from
 * its stored state (zeros after a reset, HF's initial state).
 * Verification windows (extend_as_decode, n > 1) equal n single decodes bit for bit: the
 * DeltaNet layers already run token by token with the same code for any n, the matmuls are
 * batch invariant (never BLAS here), and the full layers attend each query alone with the
 * decode kernel and its own causal end (model_attend_per_query).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif
#include "cache/batch.h"
#include "model/arch/qwen35/qwen35.h"
#include "model/ops/ops.h"
#include "model/state/recurrent.h"
#include "model/tp/tp_state.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------


static void scratch_free(qwen35_scratch *k) {
    if (!k) return;
    float **f[] = {&k->x, &k->xn, &k->proj, &k->cv, &k->att, &k->gu, &k->h, &k->tmp, &k->mm,
                   &k->rc, &k->rs, &k->qb, &k->ob, &k->kb, &k->vb};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(*f[i]);
    free(k->tok_row);
    free(k->tok_col);
    free(k->first);
    free(k);
}

static tqkv_status scratch_ensure(const tqkv_model_config *c, qwen35_scratch *k, size_t T,
                                  size_t RN, int R) {
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size, hd = (size_t)c->head_dim;
    size_t QD = (size_t)c->n_heads * hd, KD = (size_t)c->n_kv_heads * hd;
    size_t LK = (size_t)c->lin_k_heads * (size_t)c->lin_k_dim;
    size_t VD = (size_t)c->lin_v_heads * (size_t)c->lin_v_dim, NV = (size_t)c->lin_v_heads;
    size_t CD = 2 * LK + VD;
    size_t PW = 2 * QD + 2 * KD;
    if (CD + VD + 2 * NV > PW) PW = CD + VD + 2 * NV;
    size_t AW = QD > VD ? QD : VD;
    size_t W = H > I ? H : I;
    if (W < AW) W = AW;
    size_t half = (size_t)c->rotary_dim / 2;
    if (T > k->cap_t) {
        size_t t = T < 16 ? 16 : T;
        int ok = tqkv_grow_floats(&k->x, t * H) && tqkv_grow_floats(&k->xn, t * H) && tqkv_grow_floats(&k->proj, t * PW) &&
                 tqkv_grow_floats(&k->cv, t * (CD ? CD : 1)) && tqkv_grow_floats(&k->att, t * AW) &&
                 tqkv_grow_floats(&k->gu, t * 2 * I) && tqkv_grow_floats(&k->h, t * I) && tqkv_grow_floats(&k->tmp, t * W) &&
                 tqkv_grow_floats(&k->mm, t * W) && tqkv_grow_floats(&k->rc, t * half) && tqkv_grow_floats(&k->rs, t * half);
        int32_t *a = realloc(k->tok_row, sizeof(int32_t) * t);
        if (a) k->tok_row = a;
        int32_t *b = realloc(k->tok_col, sizeof(int32_t) * t);
        if (b) k->tok_col = b;
        if (!ok || !a || !b) return tqkv_fail(TQKV_ENOMEM, "out of memory for %zu tokens of activations", T);
        k->cap_t = t;
    }
    if (RN > k->cap_rn) {
        int ok = tqkv_grow_floats(&k->qb, RN * QD) && tqkv_grow_floats(&k->ob, RN * QD) && tqkv_grow_floats(&k->kb, RN * KD) &&
                 tqkv_grow_floats(&k->vb, RN * KD);
        if (!ok) return tqkv_fail(TQKV_ENOMEM, "out of memory for the attention buffers");
        k->cap_rn = RN;
    }
    int *f = realloc(k->first, sizeof(int) * (size_t)(R + 1));
    if (!f) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    k->first = f;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// state hooks (called from forward.c)
// ---------------------------------------------------------------------------

tqkv_status qwen35_state_init(tqkv_model_state *s) {
    if (s->tp) return TQKV_OK; /* sharded: each rank state holds its heads' rows (tp.c) */
    qwen35_scratch *k = tqkv_calloc(1, sizeof *k);
    if (!k) return TQKV_ENOMEM;
    s->ext = k;
    return rec_init(&s->rec, &s->m->cfg, s->rows);
}

void **qwen35_ffn_ext(tqkv_model_state *s) { return &((qwen35_scratch *)s->ext)->ffn_ext; }

void qwen35_state_free(tqkv_model_state *s) {
    rec_free(s->rec);
    scratch_free(s->ext);
    s->rec = NULL;
    s->ext = NULL;
}

// ---------------------------------------------------------------------------
// small kernels
// ---------------------------------------------------------------------------

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float siluf(float x) { return x / (1.0f + expf(-x)); }
static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* x * 1/sqrt(sum(x^2) + 1e-6) in place (HF l2norm, eps 1e-6). [n] */
static void l2norm(float *x, int n) {
    float s = 0;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    float r = 1.0f / sqrtf(s + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= r;
}

static void matmul_ld(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                      float *y, size_t ldy) {
    mm_matmul_ld(x, T, w, NULL, y, ldy, s->p.threads, ((qwen35_scratch *)s->ext)->mm);
}

// ---------------------------------------------------------------------------
// gated DeltaNet layer (linear-attention): xn [T, H] -> att [T, VD]
// ---------------------------------------------------------------------------

static void deltanet(const tqkv_model *m, tqkv_model_state *s, const model_layer *L, int j,
                     int T, int n, const int *step0) {
    const tqkv_model_config *c = &m->cfg;
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    model_recurrent *rec = s->rec;
    const int R = s->rows, th = s->p.threads, KH = c->lin_k_heads, NV = c->lin_v_heads,
              DK = c->lin_k_dim, DV = c->lin_v_dim, LK = KH * DK, VD = NV * DV, CD = 2 * LK + VD,
              KW = c->lin_conv_kernel, HIST = KW - 1;
    const size_t PW = (size_t)CD + VD + 2 * (size_t)NV;
    const size_t per = rec->conv_floats + rec->ssm_floats, lay = (size_t)j * per;
    (void)n;
    /* projections: proj[i] = qkv (CD) | z (VD) | b (NV) | a (NV) */
    if (L->lin_in.data) {
        matmul_ld(s, k->xn, T, &L->lin_in, k->proj, PW);
    } else {
        matmul_ld(s, k->xn, T, &L->lin_qkv, k->proj, PW);
        matmul_ld(s, k->xn, T, &L->lin_z, k->proj + CD, PW);
        matmul_ld(s, k->xn, T, &L->lin_b, k->proj + CD + VD, PW);
        matmul_ld(s, k->xn, T, &L->lin_a, k->proj + CD + VD + NV, PW);
    }
    /* depthwise causal conv1d + SiLU: one item per channel, rows and tokens in order */
#pragma omp parallel for num_threads(th) schedule(static) if (T * CD >= 4096)
    for (int ch = 0; ch < CD; ch++) {
        const float *w = L->conv_w + (size_t)ch * KW;
        for (int r = 0; r < R; r++) {
            float *hist = rec_conv(rec, r, j) + (size_t)ch * HIST; /* oldest first */
            for (int i = k->first[r], t = 0; i < k->first[r + 1]; i++, t++) {
                float xin = k->proj[(size_t)i * PW + ch];
                float y = w[KW - 1] * xin;
                for (int q = 0; q < HIST; q++) y += w[q] * hist[q];
                for (int q = 0; q + 1 < HIST; q++) hist[q] = hist[q + 1];
                if (HIST > 0) hist[HIST - 1] = xin;
                k->cv[(size_t)i * CD + ch] = siluf(y);
                float *slot = rec_spec_slot(rec, r, step0[r] + t + 1);
                if (slot) memcpy(slot + lay + (size_t)ch * HIST, hist, sizeof(float) * (size_t)HIST);
            }
        }
    }
    /* delta rule + gated RMSNorm: one item per (row, value head), tokens in order */
    const float qscale = 1.0f / sqrtf((float)DK);
#pragma omp parallel for num_threads(th) schedule(dynamic, 1) if (R * NV > 1 && T * NV >= 64)
    for (int it = 0; it < R * NV; it++) {
        int r = it / NV, h = it % NV, kh = h / (NV / KH);
        float *S = rec_ssm(rec, r, j) + (size_t)h * DK * DV; /* [DK, DV] */
        float q[512], kk[512], mem[512], d[512];
        for (int i = k->first[r], t = 0; i < k->first[r + 1]; i++, t++) {
            const float *cv = k->cv + (size_t)i * CD, *pr = k->proj + (size_t)i * PW;
            memcpy(q, cv + (size_t)kh * DK, sizeof(float) * (size_t)DK);
            memcpy(kk, cv + LK + (size_t)kh * DK, sizeof(float) * (size_t)DK);
            const float *v = cv + 2 * LK + (size_t)h * DV;
            l2norm(q, DK);
            l2norm(kk, DK);
            for (int e = 0; e < DK; e++) q[e] *= qscale;
            float beta = sigmoidf(pr[CD + VD + h]);
            float g = L->lin_neg_a[h] * softplusf(pr[CD + VD + NV + h] + L->dt_bias[h]);
            float eg = expf(g);
            /* the e loops are elementwise (no reduction over e): `omp simd` vectorizes them
             * with exactly the scalar operations per element, so the bits do not change */
            for (int e = 0; e < DV; e++) mem[e] = 0;
            for (int a = 0; a < DK; a++) {
                float *Sa = S + (size_t)a * DV;
                float ka = kk[a];
#pragma omp simd
                for (int e = 0; e < DV; e++) {
                    Sa[e] *= eg;
                    mem[e] += Sa[e] * ka;
                }
            }
            for (int e = 0; e < DV; e++) d[e] = (v[e] - mem[e]) * beta;
            float *o = k->att + (size_t)i * VD + (size_t)h * DV;
            for (int e = 0; e < DV; e++) o[e] = 0;
            for (int a = 0; a < DK; a++) {
                float *Sa = S + (size_t)a * DV;
                float ka = kk[a], qa = q[a];
#pragma omp simd
                for (int e = 0; e < DV; e++) {
                    Sa[e] += ka * d[e];
                    o[e] += Sa[e] * qa;
                }
            }
            /* gated RMSNorm: w * (o / rms(o)) * silu(z) */
            float ss = 0;
            for (int e = 0; e < DV; e++) ss += o[e] * o[e];
            float rn = 1.0f / sqrtf(ss / (float)DV + c->rms_norm_eps);
            const float *z = pr + CD + (size_t)h * DV;
            for (int e = 0; e < DV; e++) o[e] = L->lin_norm[e] * (o[e] * rn) * siluf(z[e]);
            float *slot = rec_spec_slot(rec, r, step0[r] + t + 1);
            if (slot)
                memcpy(slot + lay + rec->conv_floats + (size_t)h * DK * DV, S,
                       sizeof(float) * (size_t)DK * DV);
        }
    }
    matmul_ld(s, k->att, T, &L->lin_out, k->tmp, (size_t)c->hidden_size);
}

// ---------------------------------------------------------------------------
// gated full attention: xn [T, H] -> tmp [T, H]
// ---------------------------------------------------------------------------

static tqkv_status full_attention(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                                  tqkv_batch *b, int T, int n, int prefill, int nq_pad,
                                  const int *len) {
    const tqkv_model_config *c = &m->cfg;
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int R = s->rows, hd = c->head_dim, NH = c->n_heads, NKV = c->n_kv_heads, th = s->p.threads;
    const int QD = NH * hd, KD = NKV * hd, rd = c->rotary_dim, half = rd / 2;
    const size_t PW = 2 * (size_t)QD + 2 * (size_t)KD;
    if (L->wqkv.data) {
        matmul_ld(s, k->xn, T, &L->wqkv, k->proj, PW);
    } else {
        matmul_ld(s, k->xn, T, &L->wq, k->proj, PW);
        matmul_ld(s, k->xn, T, &L->wk, k->proj + 2 * QD, PW);
        matmul_ld(s, k->xn, T, &L->wv, k->proj + 2 * QD + KD, PW);
    }
    if (nq_pad) {
        memset(k->qb, 0, sizeof(float) * (size_t)R * n * QD);
        memset(k->kb, 0, sizeof(float) * (size_t)R * n * KD);
        memset(k->vb, 0, sizeof(float) * (size_t)R * n * KD);
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (int i = 0; i < T; i++) {
        float *p = k->proj + (size_t)i * PW, *kv = p + 2 * QD, *vv = kv + KD;
        size_t r = (size_t)k->tok_row[i], jc = (size_t)k->tok_col[i];
        for (int h = 0; h < NH; h++) {
            float *q = p + (size_t)h * 2 * hd;
            ops_rmsnorm(q, L->q_norm, c->rms_norm_eps, hd, q);
            ops_rope_apply(q, 1, rd, k->rc + (size_t)i * half, k->rs + (size_t)i * half);
            memcpy(k->qb + ((r * NH + h) * n + jc) * hd, q, sizeof(float) * hd);
        }
        for (int h = 0; h < NKV; h++) {
            float *kh = kv + (size_t)h * hd;
            ops_rmsnorm(kh, L->k_norm, c->rms_norm_eps, hd, kh);
            ops_rope_apply(kh, 1, rd, k->rc + (size_t)i * half, k->rs + (size_t)i * half);
            memcpy(k->kb + ((r * NKV + h) * n + jc) * hd, kh, sizeof(float) * hd);
            memcpy(k->vb + ((r * NKV + h) * n + jc) * hd, vv + (size_t)h * hd, sizeof(float) * hd);
        }
    }
    tqkv_status rc;
    batch_set_threads(b, th);
    if (prefill) {
        rc = tqkv_batch_prepare_prefill(b, len);
        if (rc == TQKV_OK) rc = tqkv_batch_append(b, k->kb, k->vb, n);
        if (rc == TQKV_OK) rc = tqkv_batch_finalize_prefill(b);
    } else {
        rc = tqkv_batch_append(b, k->kb, k->vb, n);
    }
    if (rc != TQKV_OK) return rc;
    /* a verification window (extend_as_decode): each query through the decode engine with
     * its own causal end, as its single decode (the rest of the graph already is: per-token
     * kernels, invariant matmuls, the recurrent layers token by token) */
    const int as_dec = !prefill && n > 1 && s->p.extend_as_decode;
    tqkv_attn_params ap = {NH, 1.0f / sqrtf((float)hd),
                           n == 1 || as_dec ? s->p.decode_kernel : s->p.prefill_kernel, th};
    if (as_dec) {
        rc = model_attend_per_query(s, b, k->qb, n, 0, 0, &ap, k->ob);
    } else {
        const tqkv_mask *mask = NULL;
        rc = tqkv_batch_make_mask(b, s->lease, n, 0, &mask);
        if (rc == TQKV_OK) rc = tqkv_batch_attend(b, mask, k->qb, n, &ap, k->ob);
    }
    if (rc != TQKV_OK) return rc;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (int i = 0; i < T; i++) {
        size_t r = (size_t)k->tok_row[i], jc = (size_t)k->tok_col[i];
        const float *p = k->proj + (size_t)i * PW;
        for (int h = 0; h < NH; h++) {
            const float *o = k->ob + ((r * NH + h) * n + jc) * hd, *gate = p + (size_t)h * 2 * hd + hd;
            float *a = k->att + (size_t)i * QD + (size_t)h * hd;
            for (int e = 0; e < hd; e++) a[e] = o[e] * sigmoidf(gate[e]);
        }
    }
    matmul_ld(s, k->att, T, &L->wo, k->tmp, (size_t)c->hidden_size);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// dense MLP: x [T, H] += down(silu(gate xn) * up xn)
// ---------------------------------------------------------------------------

/* x [T, H] += tmp [T, H]. */
void q35_add_tmp(const tqkv_model *m, tqkv_model_state *s, size_t T) {
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int H = m->cfg.hidden_size, th = s->p.threads;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        float *x = k->x + i * H;
        const float *o = k->tmp + i * H;
        for (int e = 0; e < H; e++) x[e] += o[e];
    }
}

/* The SwiGLU MLP of xn [T, H] into tmp [T, H] (down_proj's product). */
void q35_mlp(const tqkv_model *m, tqkv_model_state *s, const model_layer *L, size_t T) {
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int H = m->cfg.hidden_size, I = m->cfg.intermediate_size, th = s->p.threads;
    if (L->wgu.data) {
        matmul_ld(s, k->xn, (int)T, &L->wgu, k->gu, 2 * (size_t)I);
    } else {
        matmul_ld(s, k->xn, (int)T, &L->wg, k->gu, 2 * (size_t)I);
        matmul_ld(s, k->xn, (int)T, &L->wu, k->gu + I, 2 * (size_t)I);
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 16)
    for (size_t i = 0; i < T; i++)
        ops_swiglu(k->gu + i * 2 * I, k->gu + i * 2 * I + I, I, k->h + i * I);
    matmul_ld(s, k->h, (int)T, &L->wd, k->tmp, (size_t)H);
}

static tqkv_status ffn_dense(const tqkv_model *m, tqkv_model_state *s, const model_layer *L,
                             size_t T) {
    q35_mlp(m, s, L, T);
    q35_add_tmp(m, s, T);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

tqkv_status q35_check(const tqkv_model *m, tqkv_model_state *s) {
    const tqkv_model_config *c = &m->cfg;
    const int R = s->rows;
    model_recurrent *rec = s->rec;
    if (!rec || !((qwen35_scratch *)s->ext)) return tqkv_fail(TQKV_ESTATE, "forward: state has no recurrent rows");
    if (rec->broken)
        return tqkv_fail(TQKV_ESTATE, "forward: an earlier forward failed midway and left the "
                         "recurrent rows inconsistent; reset the state");
    int first_full = -1;
    for (int l = 0; l < c->n_layers; l++) {
        if (!s->layers[l]) continue;
        if (first_full < 0) first_full = l;
        if (tqkv_batch_rows(s->layers[l]) != R)
            return tqkv_fail(TQKV_ESTATE, "forward: layer %d cache holds %d rows, the state %d",
                             l, tqkv_batch_rows(s->layers[l]), R);
    }
    if (rec->rows != R)
        return tqkv_fail(TQKV_ESTATE, "forward: recurrent state holds %d rows, the state %d",
                         rec->rows, R);
    tqkv_status rc = tqkv_batch_offsets(s->layers[first_full], s->off, NULL);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < R; r++)
        if (rec->tokens[r] != s->off[r])
            return tqkv_fail(TQKV_ESTATE, "forward: row %d: recurrent state has absorbed %d tokens, "
                             "its KV rows hold %d (recurrent rows cannot be trimmed; row "
                             "operations must apply to both)", r, rec->tokens[r], s->off[r]);
    if (rec->spec_active != tqkv_batch_spec_active(s->layers[first_full]))
        return tqkv_fail(TQKV_ESTATE, "forward: spec round open on the %s but not on the %s",
                         rec->spec_active ? "recurrent rows" : "KV rows",
                         rec->spec_active ? "KV rows" : "recurrent rows");
    return TQKV_OK;
}

tqkv_status q35_begin(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                      const q35_shape *f) {
    const tqkv_model_config *c = &m->cfg;
    const int R = s->rows, H = c->hidden_size, th = s->p.threads, half = c->rotary_dim / 2,
              n = f->n;
    const size_t T = f->T;
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    tqkv_status rc = scratch_ensure(c, k, T, (size_t)R * (size_t)n, R);
    if (rc == TQKV_OK) rc = rec_spec_reserve(s->rec, n);
    if (rc != TQKV_OK) return rc;
    /* compact tokens, embeddings, rope tables */
    model_forward_compact(s->len, R, n, k->tok_row, k->tok_col, k->first);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        int r = k->tok_row[i], jj = k->tok_col[i];
        int pos = s->off[r] + jj - (n - s->len[r]);
        mm_weight_row(&m->embed, tokens[(size_t)r * n + jj], k->x + i * H);
        ops_rope_table(pos, m->inv_freq, half, k->rc + i * half, k->rs + i * half);
    }
    return TQKV_OK;
}

tqkv_status q35_mixer(const tqkv_model *m, tqkv_model_state *s, int l, int lin,
                      const q35_shape *f) {
    const tqkv_model_config *c = &m->cfg;
    const model_layer *L = &m->layers[l];
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int H = c->hidden_size, th = s->p.threads;
    const size_t T = f->T;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++)
        ops_rmsnorm(k->x + i * H, L->attn_norm, c->rms_norm_eps, H, k->xn + i * H);
    if (c->layer_type[l] == TQKV_LAYER_LINEAR) {
        deltanet(m, s, L, lin, (int)T, f->n, s->rec->spec_steps);
        return TQKV_OK;
    }
    return full_attention(m, s, L, s->layers[l], (int)T, f->n, f->prefill, f->nq_pad, s->len);
}

void q35_mixer_residual(const tqkv_model *m, tqkv_model_state *s, int l, size_t T) {
    const tqkv_model_config *c = &m->cfg;
    const model_layer *L = &m->layers[l];
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int H = c->hidden_size, th = s->p.threads;
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        float *x = k->x + i * H;
        const float *o = k->tmp + i * H;
        for (int e = 0; e < H; e++) x[e] += o[e];
        ops_rmsnorm(x, L->ffn_norm, c->rms_norm_eps, H, k->xn + i * H);
    }
}

/* Final RMSNorm and lm_head: logits [rows, V] (LAST) or [rows, n, V] (ALL, padding zero). */
static void head(const tqkv_model *m, tqkv_model_state *s, const q35_shape *f,
                 tqkv_logits_mode mode, float *logits) {
    const tqkv_model_config *c = &m->cfg;
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    const int R = s->rows, H = c->hidden_size, V = c->vocab_size, th = s->p.threads, n = f->n;
    const size_t T = f->T;
    if (mode == TQKV_LOGITS_NONE) return;
    if (mode == TQKV_LOGITS_LAST) {
        for (int r = 0; r < R; r++)
            ops_rmsnorm(k->x + (size_t)(k->first[r + 1] - 1) * H, m->final_norm, c->rms_norm_eps,
                        H, k->xn + (size_t)r * H);
        mm_matmul(k->xn, R, &m->lm_head, NULL, logits, th, k->mm);
        return;
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++)
        ops_rmsnorm(k->x + i * H, m->final_norm, c->rms_norm_eps, H, k->xn + i * H);
    if (!f->nq_pad) {
        mm_matmul(k->xn, (int)T, &m->lm_head, NULL, logits, th, k->mm);
        return;
    }
    for (int r = 0; r < R; r++) {
        int pad = n - s->len[r];
        float *dst = logits + (size_t)r * n * V;
        memset(dst, 0, sizeof(float) * (size_t)pad * V);
        mm_matmul(k->xn + (size_t)k->first[r] * H, s->len[r], &m->lm_head, NULL,
                  dst + (size_t)pad * V, th, k->mm);
    }
}

tqkv_status q35_shape_of(tqkv_model_state *s, const int32_t *tokens, const int *lengths, int n,
                         int prefill, q35_shape *f) {
    const int V = s->m->cfg.vocab_size;
    *f = (q35_shape){.n = n, .prefill = prefill};
    tqkv_status rc = model_forward_lengths(s, tokens, lengths, n, prefill, V, V, &f->T);
    if (rc != TQKV_OK) return rc;
    if (f->T > (size_t)1 << 30) return tqkv_fail(TQKV_ERANGE, "forward: too many tokens");
    for (int r = 0; r < s->rows; r++) f->nq_pad |= s->len[r] != n;
    return TQKV_OK;
}

tqkv_status qwen35_forward_with(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                float *logits, qwen35_ffn_fn ffn) {
    const tqkv_model_config *c = &m->cfg;
    /* validate before touching anything */
    tqkv_status rc = q35_check(m, s);
    q35_shape f;
    if (rc == TQKV_OK) rc = q35_shape_of(s, tokens, lengths, n, prefill, &f);
    if (rc == TQKV_OK) rc = q35_begin(m, s, tokens, &f);
    if (rc != TQKV_OK) return rc;
    qwen35_scratch *k = ((qwen35_scratch *)s->ext);
    int lin = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        const int is_lin = c->layer_type[l] == TQKV_LAYER_LINEAR;
        rc = q35_mixer(m, s, l, lin, &f);
        lin += is_lin;
        if (rc == TQKV_OK) {
            q35_mixer_residual(m, s, l, f.T);
            rc = ffn ? ffn(m, s, l, k->xn, k->x, f.T) : ffn_dense(m, s, L, f.T);
        }
        if (rc != TQKV_OK) {
            model_kv_trim_rollback(s, l + 1, n, prefill);
            if (lin > 0) s->rec->broken = 1;
            return rc;
        }
    }
    rec_advance(s->rec, s->len);
    head(m, s, &f, mode, logits);
    return TQKV_OK;
}

tqkv_status qwen35_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits) {
    if (s->tp) return qwen35_forward_tp(m, s, tokens, lengths, n, prefill, mode, logits);
    return qwen35_forward_with(m, s, tokens, lengths, n, prefill, mode, logits, NULL);
}

size_t tqkv_model_state_row_fixed_bytes(const tqkv_model_state *s) {
#ifdef TQKV_HAVE_CUDA
    if (s && s->gpu) return model_cuda_row_fixed_bytes(s->gpu);
#endif
    if (s && s->tp) { /* every rank's share (its heads' rows) */
        size_t b = 0;
        for (int r = 0; r < s->tp->n; r++) b += tqkv_model_state_row_fixed_bytes(s->tp->rank[r]);
        return b;
    }
    return s && s->rec ? rec_row_bytes(s->rec) : 0;
}

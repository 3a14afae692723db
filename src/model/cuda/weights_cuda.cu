/*
 * weights_cuda.cu - the model's weights on the device (model_cuda_weights,
 * model_cuda_impl.h): bf16 matrices stacked as the forward's GEMMs read them (q|k|v,
 * gate|up), float vectors (norms, biases, the DeltaNet parameters), uploaded once per model
 * by its first device state and shared by all of them (tqkv_model.gpu_weights).
 * Owns: the upload helpers (also used by architectures' own upload hooks) and the
 * weights' free. Must not: change a weight's values (bf16 sources are copied as they are,
 * anything else rounded to nearest even once).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/model_impl.h"
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"

#define ck      mc_ck
#define dmalloc mc_dmalloc


/* Upload the rows of ws[0..nw) stacked into one device bf16 matrix [sum n, k]. */
tqkv_status mc_upload_matrix(bf16 **out, const mm_weight *const *ws, int nw) {
    const int k = ws[0]->k;
    size_t rows = 0;
    for (int i = 0; i < nw; i++) {
        if (!ws[i]->data || ws[i]->k != k)
            return tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: a weight matrix is missing or its "
                             "width differs");
        rows += (size_t)ws[i]->n;
    }
    if (k % 8) return tqkv_fail(TQKV_EUNSUPPORTED, "cuda forward: matrix width %d is not a multiple of 8", k);
    uint16_t *h = (uint16_t *)malloc(rows * k * sizeof(uint16_t));
    float *f = (float *)malloc((size_t)k * sizeof(float));
    if (!h || !f) {
        free(h);
        free(f);
        return tqkv_fail(TQKV_ENOMEM, "out of memory staging a weight matrix");
    }
    size_t at = 0;
    for (int i = 0; i < nw; i++)
        for (int r = 0; r < ws[i]->n; r++, at++) {
            if (ws[i]->type == MM_BF16 && !ws[i]->packed) { /* the bytes as they are */
                memcpy(h + at * k, (const uint16_t *)ws[i]->data + (size_t)r * k, (size_t)k * 2);
                continue;
            }
            mm_weight_row(ws[i], r, f);
            for (int c = 0; c < k; c++) /* nearest even (exact for bf16 sources) */
                h[at * k + c] = tqkv_f32_to_bf16(f[c]);
        }
    free(f);
    tqkv_status st = dmalloc((void **)out, rows * k * sizeof(uint16_t));
    if (!st) st = ck(cudaMemcpy(*out, h, rows * k * sizeof(uint16_t), cudaMemcpyHostToDevice), "upload weights");
    free(h);
    return st;
}

/* Concatenate host float vectors (NULL parts as zeros) into one device array; all-NULL -> NULL. */
tqkv_status mc_upload_vec(float **out, const float *const *parts, const int *lens, int np) {
    *out = NULL;
    int any = 0;
    size_t n = 0;
    for (int i = 0; i < np; i++) {
        any |= parts[i] != NULL;
        n += (size_t)lens[i];
    }
    if (!any) return TQKV_OK;
    float *h = (float *)calloc(n, sizeof(float));
    if (!h) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    size_t at = 0;
    for (int i = 0; i < np; i++) {
        if (parts[i]) memcpy(h + at, parts[i], sizeof(float) * lens[i]);
        at += (size_t)lens[i];
    }
    tqkv_status st = dmalloc((void **)out, n * sizeof(float));
    if (!st) st = ck(cudaMemcpy(*out, h, n * sizeof(float), cudaMemcpyHostToDevice), "upload vector");
    free(h);
    return st;
}

extern "C" void model_cuda_weights_free(model_cuda_weights *w) {
    if (!w) return;
    if (w->layers)
        for (int l = 0; l < w->n_layers; l++) {
            mc_layer *L = &w->layers[l];
            void *ps[] = {L->attn_norm, L->ffn_norm, L->q_norm, L->k_norm, L->bqkv, L->bo,
                          L->wqkv, L->wo, L->wgu, L->wd, L->lin_in, L->lin_out, L->conv_w,
                          L->lin_neg_a, L->dt_bias, L->lin_norm};
            for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) cudaFree(ps[i]);
        }
    free(w->layers);
    if (w->arch_free) w->arch_free(w->arch);
    if (w->lm_head != w->embed) cudaFree(w->lm_head);
    cudaFree(w->embed);
    cudaFree(w->final_norm);
    free(w);
}

tqkv_status mc_upload_weights(const tqkv_model *m, model_cuda_weights **out) {
    const tqkv_model_config *c = &m->cfg;
    const int H = c->hidden_size, hd = c->head_dim, QD = c->n_heads * hd, KD = c->n_kv_heads * hd;
    model_cuda_weights *g = (model_cuda_weights *)calloc(1, sizeof *g);
    if (!g) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    g->n_layers = c->n_layers;
    g->layers = (mc_layer *)calloc((size_t)c->n_layers, sizeof(mc_layer));
    if (!g->layers) {
        free(g);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    const model_arch_cuda_ops *ao = m->ops->cuda;
    const int own = ao && ao->upload; /* the architecture uploads its own layers */
    tqkv_status st = own ? ao->upload(m, g) : TQKV_OK;
    for (int l = 0; l < c->n_layers && !st && !own; l++) {
        const model_layer *S = &m->layers[l];
        mc_layer *L = &g->layers[l];
        const mm_weight *gu[2] = {&S->wg, &S->wu}, *wd = &S->wd;
        const float *an = S->attn_norm, *fn = S->ffn_norm;
        const int mlp = !(ao && ao->ffn && !S->wg.data); /* else the ffn hook's own layer */
        if (mlp) st = mc_upload_matrix(&L->wgu, gu, 2);
        if (!st && mlp) st = mc_upload_matrix(&L->wd, &wd, 1);
        if (!st) st = mc_upload_vec(&L->attn_norm, &an, &H, 1);
        if (!st) st = mc_upload_vec(&L->ffn_norm, &fn, &H, 1);
        if (st) break;
        if (c->layer_type[l] == TQKV_LAYER_LINEAR) { /* Qwen 3.5 gated DeltaNet */
            const int NV = c->lin_v_heads, VD = NV * c->lin_v_dim,
                      CD = 2 * c->lin_k_heads * c->lin_k_dim + VD, CK = CD * c->lin_conv_kernel;
            /* qkv | z | b | a: the parts, or a tensor-parallel rank's gathered rows of them
             * (src/model/arch/qwen35/tp.c: lin_in alone, in the same order) */
            const mm_weight *in[4] = {&S->lin_qkv, &S->lin_z, &S->lin_b, &S->lin_a}, *out = &S->lin_out;
            const mm_weight *gathered = &S->lin_in;
            const float *cw = S->conv_w, *na = S->lin_neg_a, *db = S->dt_bias, *nw = S->lin_norm;
            st = S->lin_qkv.data ? mc_upload_matrix(&L->lin_in, in, 4)
                                 : mc_upload_matrix(&L->lin_in, &gathered, 1);
            if (!st) st = mc_upload_matrix(&L->lin_out, &out, 1);
            if (!st) st = mc_upload_vec(&L->conv_w, &cw, &CK, 1);
            if (!st) st = mc_upload_vec(&L->lin_neg_a, &na, &NV, 1);
            if (!st) st = mc_upload_vec(&L->dt_bias, &db, &NV, 1);
            if (!st) st = mc_upload_vec(&L->lin_norm, &nw, &c->lin_v_dim, 1);
            continue;
        }
        const mm_weight *qkv[3] = {&S->wq, &S->wk, &S->wv}, *wo = &S->wo;
        const float *qn = S->q_norm, *kn = S->k_norm, *bo = S->bo;
        const float *bq[3] = {S->bq, S->bk, S->bv};
        const int lq[3] = {QD, KD, KD};
        st = mc_upload_matrix(&L->wqkv, qkv, 3);
        if (!st) st = mc_upload_matrix(&L->wo, &wo, 1);
        if (!st) st = mc_upload_vec(&L->q_norm, &qn, &hd, 1);
        if (!st) st = mc_upload_vec(&L->k_norm, &kn, &hd, 1);
        if (!st) st = mc_upload_vec(&L->bqkv, bq, lq, 3);
        if (!st) st = mc_upload_vec(&L->bo, &bo, &H, 1);
    }
    if (!st && ao && ao->ffn_upload) st = ao->ffn_upload(m, g); /* its feed-forward layers */
    const mm_weight *e = &m->embed, *lm = &m->lm_head;
    const float *fnorm = m->final_norm;
    if (!st) st = mc_upload_matrix(&g->embed, &e, 1);
    if (!st) {
        if (m->lm_head.data == m->embed.data && m->lm_head.type == m->embed.type &&
            m->lm_head.packed == m->embed.packed)
            g->lm_head = g->embed;
        else st = mc_upload_matrix(&g->lm_head, &lm, 1);
    }
    if (!st) st = mc_upload_vec(&g->final_norm, &fnorm, &H, 1);
    /* cudaMemcpy from pageable memory may return before its DMA lands, and the states'
     * non-blocking streams do not wait for the legacy stream: wait once, here */
    if (!st) st = ck(cudaStreamSynchronize(0), "upload weights");
    if (st) model_cuda_weights_free(g);
    else *out = g;
    return st;
}

/*
 * model.c - loading a checkpoint into an immutable tqkv_model.
 * Owns: tensor lookup with shape checks, the weight representation (matrices read in place
 * from the mapping in bf16/f16/f32; small vectors converted to f32), tied embeddings.
 * Must not: run the forward pass or hold per-sequence state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "model/ops/moe.h"
#include "model/ops/ops.h"
#include "model/tp/tp_state.h"
#include "util/common.h"
#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif

// ---------------------------------------------------------------------------
// owned buffers
// ---------------------------------------------------------------------------

static void *own(tqkv_model *m, size_t bytes) {
    if (m->n_owned == m->cap_owned) {
        int nc = m->cap_owned ? m->cap_owned * 2 : 64;
        void **no = realloc(m->owned, sizeof(void *) * (size_t)nc);
        if (!no) return NULL;
        m->owned = no;
        m->cap_owned = nc;
    }
    void *p = malloc(bytes ? bytes : 1);
    if (p) m->owned[m->n_owned++] = p;
    return p;
}

// ---------------------------------------------------------------------------
// tensors
// ---------------------------------------------------------------------------

static const char *shape_str(const st_tensor *t, char *buf, size_t cap) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int d = 0; d < t->ndim && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* Find `name` with shape [d0] (d1 == 0) or [d0, d1]. */
static tqkv_status find_tensor(const tqkv_model *m, const char *name, int d0, int d1,
                               const st_tensor **out) {
    const st_tensor *t = st_find(&m->st, name);
    if (!t) return tqkv_fail(TQKV_ECORRUPT, "missing tensor '%s' in %s", name, m->source);
    int nd = d1 ? 2 : 1;
    if (t->ndim != nd || t->shape[0] != d0 || (nd == 2 && t->shape[1] != d1)) {
        char got[96];
        if (nd == 2)
            return tqkv_fail(TQKV_ECORRUPT, "tensor '%s' (%s) has shape %s, expected [%d, %d]", name,
                             st_file_of(&m->st, t), shape_str(t, got, sizeof got), d0, d1);
        return tqkv_fail(TQKV_ECORRUPT, "tensor '%s' (%s) has shape %s, expected [%d]", name,
                         st_file_of(&m->st, t), shape_str(t, got, sizeof got), d0);
    }
    if (t->dtype == ST_OTHER)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor '%s' (%s) has dtype %s (need F32, F16 or BF16)",
                         name, st_file_of(&m->st, t), t->dtype_name);
    *out = t;
    return TQKV_OK;
}

static float elem_f32(const st_tensor *t, size_t i) {
    uint16_t h;
    switch (t->dtype) {
    case ST_F32: {
        float f;
        memcpy(&f, t->data + 4 * i, 4);
        return f;
    }
    case ST_F16: memcpy(&h, t->data + 2 * i, 2); return tqkv_f16_to_f32(h);
    default: memcpy(&h, t->data + 2 * i, 2); return tqkv_bf16_to_f32(h);
    }
}

/* A vector [n] converted to owned f32. */
static tqkv_status load_vector(tqkv_model *m, const char *name, int n, float **out) {
    const st_tensor *t;
    tqkv_status rc = find_tensor(m, name, n, 0, &t);
    if (rc != TQKV_OK) return rc;
    float *v = own(m, sizeof(float) * (size_t)n);
    if (!v) return tqkv_fail(TQKV_ENOMEM, "out of memory loading '%s'", name);
    for (int i = 0; i < n; i++) v[i] = elem_f32(t, (size_t)i);
    m->n_params += (size_t)n;
    *out = v;
    return TQKV_OK;
}

/* f32 pair-permuted copy of a bf16 matrix for products of many rows (prefill): the f32
 * kernels reach 1.5-1.8x the FLOP rate of the bf16 ones (measured) with the same bits. */
static tqkv_status add_f32p(tqkv_model *m, const tqkv_model_load_params *lp, mm_weight *w,
                            const char *name) {
    if (lp->no_f32_prefill || !mm_can_f32p(w)) return TQKV_OK;
    if (w->packed && tqkv_cpu_has_avx512()) return TQKV_OK; /* its kernels beat the f32 tiles */
    float *f = own(m, sizeof(float) * (size_t)w->n * (size_t)w->k);
    if (!f) return tqkv_fail(TQKV_ENOMEM, "out of memory converting '%s'", name);
    mm_make_f32p(w, f, lp->threads > 0 ? lp->threads : 1);
    w->f32p = f;
    return TQKV_OK;
}
#define TQKV_TRY_F32P(m, lp, w, name)                                                             \
    do {                                                                                          \
        tqkv_status rc_ = add_f32p(m, lp, w, name);                                               \
        if (rc_ != TQKV_OK) return rc_;                                                           \
    } while (0)

/* A matrix [rows, cols] read in place (or converted when asked / misaligned; bf16 packed
 * unless lp->no_pack). */
static tqkv_status load_matrix_t(tqkv_model *m, const tqkv_model_load_params *lp,
                                 const char *name, const st_tensor *t, int rows, int cols,
                                 mm_weight *w) {
    size_t n = (size_t)rows * (size_t)cols;
    size_t esz = st_dtype_size(t->dtype);
    memset(w, 0, sizeof *w);
    w->n = rows;
    w->k = cols;
    int aligned = ((uintptr_t)t->data % esz) == 0;
    if (t->dtype == ST_F32 || lp->weights_f32) {
        if (t->dtype == ST_F32 && aligned) {
            w->data = t->data;
        } else {
            float *f = own(m, sizeof(float) * n);
            if (!f) return tqkv_fail(TQKV_ENOMEM, "out of memory converting '%s'", name);
            for (size_t i = 0; i < n; i++) f[i] = elem_f32(t, i);
            w->data = f;
        }
        w->type = MM_F32;
    } else {
        w->type = t->dtype == ST_F16 ? MM_F16 : MM_BF16;
        if (aligned) {
            w->data = t->data;
        } else {
            void *c = own(m, 2 * n);
            if (!c) return tqkv_fail(TQKV_ENOMEM, "out of memory copying '%s'", name);
            memcpy(c, t->data, 2 * n);
            w->data = c;
        }
        /* bf16 matrices are repacked once so that a GEMV streams one contiguous run per
         * 8 rows: 2.4x the decode bandwidth of reading 8 rows in place (measured) */
        if (!lp->no_pack && mm_can_pack(w)) {
            uint16_t *pk = own(m, 2 * n);
            if (!pk) return tqkv_fail(TQKV_ENOMEM, "out of memory packing '%s'", name);
            mm_pack(w, pk, lp->threads > 0 ? lp->threads : 1);
            w->data = pk;
            w->packed = 1;
            w->bf16_act = lp->bf16_act;
        }
        TQKV_TRY_F32P(m, lp, w, name);
    }
    if (lp->blas) {
        if (w->type == MM_F32) {
            w->f32 = w->data;
        } else {
            float *f = own(m, sizeof(float) * n);
            if (!f) return tqkv_fail(TQKV_ENOMEM, "out of memory converting '%s'", name);
            for (size_t i = 0; i < n; i++) f[i] = elem_f32(t, i);
            w->f32 = f;
        }
    }
    m->n_params += n;
    return TQKV_OK;
}

static tqkv_status load_matrix(tqkv_model *m, const tqkv_model_load_params *lp, const char *name,
                               int rows, int cols, mm_weight *w) {
    const st_tensor *t;
    tqkv_status rc = find_tensor(m, name, rows, cols, &t);
    if (rc != TQKV_OK) return rc;
    return load_matrix_t(m, lp, name, t, rows, cols, w);
}

/* Slice i of the 3-d tensor `name` [n, rows, cols] as a matrix [rows, cols] (a view of the
 * slice's bytes loaded as load_matrix loads a 2-d tensor). */
static tqkv_status load_slice(tqkv_model *m, const tqkv_model_load_params *lp, const char *name,
                              int i, int n, int rows, int cols, mm_weight *w) {
    const st_tensor *t = st_find(&m->st, name);
    if (!t) return tqkv_fail(TQKV_ECORRUPT, "missing tensor '%s' in %s", name, m->source);
    if (t->ndim != 3 || t->shape[0] != n || t->shape[1] != rows || t->shape[2] != cols) {
        char got[96];
        return tqkv_fail(TQKV_ECORRUPT, "tensor '%s' (%s) has shape %s, expected [%d, %d, %d]",
                         name, st_file_of(&m->st, t), shape_str(t, got, sizeof got), n, rows, cols);
    }
    if (t->dtype == ST_OTHER)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor '%s' (%s) has dtype %s (need F32, F16 or BF16)",
                         name, st_file_of(&m->st, t), t->dtype_name);
    st_tensor v = *t;
    const size_t bytes = (size_t)rows * (size_t)cols * st_dtype_size(t->dtype);
    v.ndim = 2;
    v.shape[0] = rows;
    v.shape[1] = cols;
    v.data = t->data + (size_t)i * bytes;
    v.nbytes = bytes;
    return load_matrix_t(m, lp, name, &v, rows, cols, w);
}

/* Pack bf16 matrices parts[0..n) (same k) into one fused packed matrix; 0 if not possible. */
static tqkv_status fuse(tqkv_model *m, const tqkv_model_load_params *lp, mm_weight **parts, int n,
                        mm_weight *out) {
    memset(out, 0, sizeof *out);
    if (lp->no_pack) return TQKV_OK;
    int rows = 0;
    for (int i = 0; i < n; i++) {
        if (!mm_can_pack(parts[i]) || parts[i]->k != parts[0]->k) return TQKV_OK;
        rows += parts[i]->n;
    }
    size_t k = (size_t)parts[0]->k;
    uint16_t *buf = own(m, sizeof(uint16_t) * (size_t)rows * k);
    if (!buf) return tqkv_fail(TQKV_ENOMEM, "out of memory fusing matrices");
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        mm_pack(parts[i], buf + at, lp->threads > 0 ? lp->threads : 1);
        at += (size_t)parts[i]->n * k;
    }
    out->data = buf;
    out->type = MM_BF16;
    out->n = rows;
    out->k = (int)k;
    out->packed = 1;
    out->bf16_act = lp->bf16_act;
    return add_f32p(m, lp, out, "fused matrix");
}

// ---------------------------------------------------------------------------
// load / free
// ---------------------------------------------------------------------------

tqkv_model_load_params tqkv_model_load_params_default(void) {
    tqkv_model_load_params p = {1, 0, 0, 0, 0, 0, 0};
    return p;
}

void tqkv_model_free(tqkv_model *m) {
    if (!m) return;
    model_tp_models_free(m); /* its rank models first: they view its weights */
#ifdef TQKV_HAVE_CUDA
    model_cuda_weights_free(m->gpu_weights);
#endif
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    st_close(&m->st);
    free(m);
}

tqkv_status tqkv_model_load(tqkv_model **out, const char *dir, const tqkv_model_load_params *lp_in) {
    if (!out || !dir) return tqkv_fail(TQKV_EINVAL, "tqkv_model_load: NULL argument");
    tqkv_model_load_params lp = lp_in ? *lp_in : tqkv_model_load_params_default();
    double t0 = tqkv_now_s();
    tqkv_model *m = tqkv_calloc(1, sizeof *m);
    if (!m) return TQKV_ENOMEM;
    m->bf16_act = lp.bf16_act;
    tqkv_status rc = model_config_load(dir, &m->cfg, &m->gen);
    if (rc != TQKV_OK) goto fail;
    m->ops = model_arch_ops_of(m->cfg.arch);
    const tqkv_model_config *c = &m->cfg;
    if (lp.verbose)
        fprintf(stderr, "tqkv: loading %s: %s, %d layers, hidden %d, heads %d/%d x %d, vocab %d\n",
                dir, c->arch_name, c->n_layers, c->hidden_size, c->n_heads, c->n_kv_heads,
                c->head_dim, c->vocab_size);
    rc = st_open_dir(&m->st, dir);
    if (rc != TQKV_OK) goto fail;
    if (m->st.n_files == 1)
        snprintf(m->source, sizeof m->source, "%s", m->st.files[0].path);
    else
        snprintf(m->source, sizeof m->source, "%s/model.safetensors.index.json (%d shards)", dir,
                 m->st.n_files);
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    m->inv_freq = own(m, sizeof(float) * (size_t)(c->head_dim / 2));
    if (!m->layers || !m->inv_freq) {
        rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
        goto fail;
    }
    ops_rope_freqs(c, m->inv_freq);
    rc = m->ops->load(m, dir, &lp); /* the architecture's weights (arch/<name>/load.c) */
    if (rc != TQKV_OK) goto fail;
    /* weight type summary */
    int types = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const mm_weight *ws[7] = {&m->layers[l].wq, &m->layers[l].wk, &m->layers[l].wv,
                                  &m->layers[l].wo, &m->layers[l].wg, &m->layers[l].wu,
                                  &m->layers[l].wd};
        for (int i = 0; i < 7; i++)
            if (ws[i]->data) types |= 1 << ws[i]->type; /* linear layers: no q/k/v/o */
    }
    types |= 1 << m->lm_head.type;
    snprintf(m->wtype, sizeof m->wtype, "%s",
             types == 1 << MM_F32 ? "f32" : types == 1 << MM_BF16 ? "bf16"
                                    : types == 1 << MM_F16  ? "f16" : "mixed");
    if (lp.verbose)
        fprintf(stderr, "tqkv: loaded %.1fM params (%s matrices, %d file%s) in %.0f ms\n",
                (double)m->n_params / 1e6, m->wtype, m->st.n_files, m->st.n_files == 1 ? "" : "s",
                (tqkv_now_s() - t0) * 1e3);
    tqkv_clear_error();
    *out = m;
    return TQKV_OK;
fail:
    tqkv_model_free(m);
    return rc;
}

// ---------------------------------------------------------------------------
// accessors
// ---------------------------------------------------------------------------

const tqkv_model_config *tqkv_model_get_config(const tqkv_model *m) { return m ? &m->cfg : NULL; }
const tqkv_generation_config *tqkv_model_get_generation(const tqkv_model *m) {
    return m ? &m->gen : NULL;
}

int tqkv_model_is_eos(const tqkv_model *m, int token) {
    if (!m) return 0;
    for (int i = 0; i < m->cfg.n_eos; i++)
        if (m->cfg.eos_ids[i] == token) return 1;
    return 0;
}

size_t tqkv_model_params(const tqkv_model *m) { return m ? m->n_params : 0; }
const char *tqkv_model_weight_type(const tqkv_model *m) { return m ? m->wtype : ""; }
const char *tqkv_model_graph_name(const tqkv_model *m) {
    return m ? model_arch_graph_name(m->cfg.arch) : "";
}

static size_t wbytes(const mm_weight *w) {
    return (size_t)w->n * (size_t)w->k * (w->type == MM_F32 ? 4u : 2u);
}

size_t tqkv_model_weight_bytes(const tqkv_model *m) {
    if (!m) return 0;
    size_t b = wbytes(&m->lm_head) + (size_t)m->cfg.hidden_size * (m->embed.type == MM_F32 ? 4 : 2);
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const model_layer *L = &m->layers[l];
        b += wbytes(&L->wq) + wbytes(&L->wk) + wbytes(&L->wv) + wbytes(&L->wo) + wbytes(&L->wg) +
             wbytes(&L->wu) + wbytes(&L->wd);
        b += wbytes(&L->lin_qkv) + wbytes(&L->lin_z) + wbytes(&L->lin_b) + wbytes(&L->lin_a) +
             wbytes(&L->lin_out); /* qwen35: DeltaNet layers (zero elsewhere) */
    }
    return b;
}

// ---------------------------------------------------------------------------
// loaders for the graph files (src/model/arch/gemma4/load.c, src/model/arch/qwen35/load.c): the helpers above
// ---------------------------------------------------------------------------

tqkv_status model_load_vector(tqkv_model *m, const char *name, int n, float **out) {
    return load_vector(m, name, n, out);
}

tqkv_status model_load_matrix(tqkv_model *m, const tqkv_model_load_params *lp, const char *name,
                              int rows, int cols, mm_weight *w) {
    return load_matrix(m, lp, name, rows, cols, w);
}

tqkv_status model_fuse(tqkv_model *m, const tqkv_model_load_params *lp, mm_weight **parts, int n,
                       mm_weight *out) {
    return fuse(m, lp, parts, n, out);
}

void *model_own(tqkv_model *m, size_t bytes) { return own(m, bytes); }

tqkv_status model_load_swiglu(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                              int inter, mm_weight *g, mm_weight *u, mm_weight *down,
                              mm_weight *gu) {
    const int H = m->cfg.hidden_size;
    char name[320];
    tqkv_status rc;
    tqkv_model_load_params lpu = *lp; /* gate / up in place: packed into the fused copy */
    lpu.no_pack = 1;
    lpu.no_f32_prefill = 1;
#define NAME(part) (snprintf(name, sizeof name, "%s%s_proj.weight", pre, part), name)
    if ((rc = load_matrix(m, &lpu, NAME("gate"), inter, H, g)) ||
        (rc = load_matrix(m, &lpu, NAME("up"), inter, H, u)) ||
        (rc = load_matrix(m, lp, NAME("down"), H, inter, down)))
        return rc;
#undef NAME
    mm_weight *parts[2] = {g, u};
    return fuse(m, lp, parts, 2, gu);
}

/* Expert e of `pre` in either layout into X->gu / g / u / down [e]. */
static tqkv_status load_expert(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                               int fused, int e, const moe_shape *sh, moe_layer *X) {
    const int H = sh->hidden, I = sh->inter, E = sh->n_experts;
    char name[320];
    tqkv_status rc;
    memset(&X->g[e], 0, sizeof X->g[e]);
    memset(&X->u[e], 0, sizeof X->u[e]);
    if (fused) { /* gate; up rows of slice e: already the fused layout */
        snprintf(name, sizeof name, "%sgate_up_proj", pre);
        if ((rc = load_slice(m, lp, name, e, E, 2 * I, H, &X->gu[e])) != TQKV_OK) return rc;
        snprintf(name, sizeof name, "%sdown_proj", pre);
        return load_slice(m, lp, name, e, E, H, I, &X->down[e]);
    }
    snprintf(name, sizeof name, "%s%d.", pre, e);
    return model_load_swiglu(m, lp, name, I, &X->g[e], &X->u[e], &X->down[e], &X->gu[e]);
}

tqkv_status model_load_experts(tqkv_model *m, const tqkv_model_load_params *lp, const char *pre,
                               const moe_shape *sh, moe_layer *X) {
    const int E = sh->n_experts;
    char name[320];
    X->gu = own(m, sizeof(mm_weight) * (size_t)E);
    X->g = own(m, sizeof(mm_weight) * (size_t)E);
    X->u = own(m, sizeof(mm_weight) * (size_t)E);
    X->down = own(m, sizeof(mm_weight) * (size_t)E);
    if (!X->gu || !X->g || !X->u || !X->down) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    snprintf(name, sizeof name, "%sgate_up_proj", pre);
    const int fused = st_find(&m->st, name) != NULL;
    for (int e = 0; e < E; e++) {
        tqkv_status rc = load_expert(m, lp, pre, fused, e, sh, X);
        if (rc != TQKV_OK) return rc;
    }
    return TQKV_OK;
}

/* The token embedding [vocab, hidden]: only ever read one row at a time, so kept in place
 * (never converted, packed or copied for prefill). */
tqkv_status model_load_embedding(tqkv_model *m, const tqkv_model_load_params *lp,
                                 const char *name) {
    tqkv_model_load_params lpe = *lp;
    lpe.weights_f32 = 0;
    lpe.blas = 0;
    lpe.no_pack = 1;
    lpe.no_f32_prefill = 1;
    return load_matrix(m, &lpe, name, m->cfg.vocab_size, m->cfg.hidden_size, &m->embed);
}

/* lm_head.weight, or the embedding `embed_name` when tied (shared in place, or a second
 * copy in the form the head's products need when weights are converted or packed). */
tqkv_status model_load_head(tqkv_model *m, const tqkv_model_load_params *lp,
                            const char *embed_name) {
    const tqkv_model_config *c = &m->cfg;
    if (st_find(&m->st, "lm_head.weight"))
        return load_matrix(m, lp, "lm_head.weight", c->vocab_size, c->hidden_size, &m->lm_head);
    if (!c->tie_word_embeddings)
        return tqkv_fail(TQKV_ECORRUPT, "missing tensor 'lm_head.weight' in %s "
                         "(tie_word_embeddings is false)", m->source);
    if (!(lp->weights_f32 || lp->blas || !lp->no_pack)) {
        m->lm_head = m->embed;
        return TQKV_OK;
    }
    tqkv_status rc = load_matrix(m, lp, embed_name, c->vocab_size, c->hidden_size, &m->lm_head);
    if (rc == TQKV_OK) m->n_params -= (size_t)c->vocab_size * (size_t)c->hidden_size;
    return rc;
}

/* The common decoder layout: the embedding, every layer through `layer`, the final norm,
 * `finish` (may be NULL) and the head; names under "model." or a wrapper's text-model
 * prefix (config weight_prefix). */
tqkv_status model_load_decoder(tqkv_model *m, const tqkv_model_load_params *lp,
                               tqkv_status (*layer)(tqkv_model *m,
                                                    const tqkv_model_load_params *lp, int l),
                               tqkv_status (*finish)(tqkv_model *m)) {
    const tqkv_model_config *c = &m->cfg;
    char embed_name[96], norm_name[96];
    const char *pfx = c->weight_prefix[0] ? c->weight_prefix : "model.";
    snprintf(embed_name, sizeof embed_name, "%sembed_tokens.weight", pfx);
    snprintf(norm_name, sizeof norm_name, "%snorm.weight", pfx);
    tqkv_status rc = model_load_embedding(m, lp, embed_name);
    for (int l = 0; l < c->n_layers && rc == TQKV_OK; l++) rc = layer(m, lp, l);
    if (rc == TQKV_OK) rc = model_load_vector(m, norm_name, c->hidden_size, &m->final_norm);
    if (rc == TQKV_OK && finish) rc = finish(m);
    if (rc == TQKV_OK) rc = model_load_head(m, lp, embed_name);
    return rc;
}

/*
 * forward.c - per-batch state and the forward pass (Qwen3 / Qwen2 / Llama graph) on the CPU.
 * Owns: the state's caches (one tqkv_batch per layer), mask lease and scratch; the graph:
 *   embed -> per layer [RMSNorm, q/k/v (+bias), q/k RMSNorm, RoPE, cache append,
 *   attention, o_proj, residual, RMSNorm, SwiGLU MLP, residual] -> RMSNorm -> lm_head.
 * Activations are kept compact, token-major ([T, dim], T = real tokens of all rows), so
 * padding costs no matmul work; queries/keys/values are scattered to the cache's
 * [rows, heads, n, head_dim] layout only around the cache and attention calls.
 * Also owns model_attend_per_query (model_impl.h), the verification window's attention of
 * every CPU graph: a read-only view of a layer's batch per query (cache/batch.h layout).
 * Must not: make a row's result depend on other rows: every per-token kernel works on its
 * own token, matmuls are batch invariant (matmul.c), attention is by contract.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h" /* model_attend_per_query's read-only view */
#include "model/gemma4.h"
#include "model/model_impl.h"
#include "model/ops.h"
#include "model/recurrent.h"
#include "util/common.h"
#ifdef TQKV_HAVE_CUDA
#include "model/model_cuda.h"
#endif

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

tqkv_model_state_params tqkv_model_state_params_default(void) {
    tqkv_model_state_params p;
    memset(&p, 0, sizeof p);
    p.rows = 1;
    p.k_format = TQKV_F32;
    p.v_format = TQKV_F32;
    p.window = 0;
    p.window_slack = 32;
    p.kv_seed = 0;
    p.threads = 1;
    p.prefill_kernel = TQKV_KERNEL_BY_GRAPH;
    p.decode_kernel = TQKV_KERNEL_BY_GRAPH;
    p.blas = 0;
    p.device_graphs = 1;
    return p;
}

static void free_layers(tqkv_batch **layers, int n) {
    if (!layers) return;
    for (int l = 0; l < n; l++) tqkv_batch_free(layers[l]);
    free(layers);
}

/* Fresh empty caches for `rows` rows. */
static tqkv_status make_layers(const tqkv_model *m, const tqkv_model_state_params *p, int rows,
                               tqkv_batch ***out) {
    if (m->g4) return gemma4_make_layers(m, p, rows, out);
    int L = m->cfg.n_layers;
    tqkv_batch **layers = calloc((size_t)L, sizeof *layers);
    if (!layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L; l++) {
        if (m->cfg.layer_type[l] == TQKV_LAYER_LINEAR) continue; /* recurrent rows, no KV */
        tqkv_cache_config cc = tqkv_cache_config_default();
        cc.kv_heads = m->cfg.n_kv_heads;
        cc.head_dim = m->cfg.head_dim;
        tqkv_kv_layer_formats(p, l, &cc.k_format, &cc.v_format);
        cc.seed = p->kv_seed + (uint64_t)l;
        cc.window = p->window;
        cc.window_slack = p->window_slack;
        tqkv_status rc = tqkv_batch_init(&layers[l], &cc, rows);
        if (rc != TQKV_OK) {
            free_layers(layers, l);
            return rc;
        }
    }
    *out = layers;
    return TQKV_OK;
}

static void free_scratch(tqkv_model_state *s) {
    float **f[] = {&s->x, &s->xn, &s->qkv, &s->att, &s->gu, &s->h, &s->tmp,
                   &s->mm_scratch, &s->rc, &s->rs, &s->qb, &s->kb, &s->vb, &s->ob};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        free(*f[i]);
        *f[i] = NULL;
    }
    free(s->tok_row);
    free(s->tok_col);
    s->tok_row = s->tok_col = NULL;
    s->cap_t = s->cap_rn = 0;
}

tqkv_status tqkv_model_state_init(tqkv_model_state **out, const tqkv_model *m,
                                  const tqkv_model_state_params *p_in) {
    if (!out || !m) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_init: NULL argument");
    tqkv_model_state_params p = p_in ? *p_in : tqkv_model_state_params_default();
    tqkv_kernel kp, kd; /* TQKV_KERNEL_BY_GRAPH: the graph's kernel set (kernel_set.c) */
    model_kernel_set(&m->cfg, &kp, &kd);
    if (p.prefill_kernel == TQKV_KERNEL_BY_GRAPH) p.prefill_kernel = kp;
    if (p.decode_kernel == TQKV_KERNEL_BY_GRAPH) p.decode_kernel = kd;
    if (p.rows < 1 || p.threads < 1 || p.window < 0 || p.window_slack < 0)
        return tqkv_fail(TQKV_EINVAL, "model state: need rows >= 1, threads >= 1, window >= 0");
    if ((unsigned)p.prefill_kernel >= TQKV_KERNEL_COUNT ||
        (unsigned)p.decode_kernel >= TQKV_KERNEL_COUNT)
        return tqkv_fail(TQKV_EINVAL, "model state: invalid attention kernel");
    if (p.device_fast_gemm && p.device != 1)
        return tqkv_fail(TQKV_EINVAL, "model state: device_fast_gemm needs device 1 (CUDA)");
    for (int l = 0; l < TQKV_MAX_KV_LAYERS; l++) {
        if (p.layer_k[l] > TQKV_FORMAT_COUNT || p.layer_v[l] > TQKV_FORMAT_COUNT)
            return tqkv_fail(TQKV_EINVAL, "model state: invalid per-layer KV format at layer %d", l);
        if (p.device && (p.layer_k[l] || p.layer_v[l]))
            return tqkv_fail(TQKV_EUNSUPPORTED, "model state: per-layer KV formats run on the "
                             "CPU only (layer %d)", l);
    }
    tqkv_model_state *s = tqkv_calloc(1, sizeof *s);
    if (!s) return TQKV_ENOMEM;
    s->m = m;
    s->p = p;
    s->rows = p.rows;
    tqkv_status rc = make_layers(m, &p, p.rows, &s->layers);
    if (rc == TQKV_OK) rc = tqkv_mask_lease_init(&s->lease);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && p.device == 1) rc = model_cuda_init(&s->gpu, m, &p, p.rows);
#endif
    if (rc == TQKV_OK && p.device != 0 && !s->gpu)
        rc = tqkv_fail(TQKV_EUNSUPPORTED, "model state: device %d is not built in", p.device);
    /* a device state's recurrent rows live in its twin (model_cuda_impl.h) */
    if (rc == TQKV_OK && m->cfg.n_linear > 0 && !s->gpu) rc = model_qwen35_state_init(s);
    if (rc == TQKV_OK) {
        s->off = calloc((size_t)p.rows, sizeof(int));
        s->len = calloc((size_t)p.rows, sizeof(int));
        if (!s->off || !s->len) rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    if (rc != TQKV_OK) {
        tqkv_model_state_free(s);
        return rc;
    }
    *out = s;
    return TQKV_OK;
}

void tqkv_model_state_free(tqkv_model_state *s) {
    if (!s) return;
    free_layers(s->layers, s->m->cfg.n_layers);
#ifdef TQKV_HAVE_CUDA
    model_cuda_free(s->gpu);
#endif
    model_qwen35_state_free(s);
    tqkv_mask_lease_free(s->lease);
    gemma4_state_free(s);
    model_pick_free(s->pick);
    free_scratch(s);
    free(s->off);
    free(s->len);
    free(s);
}

tqkv_status tqkv_model_state_reset(tqkv_model_state *s, int rows) {
    if (!s) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_reset: NULL");
    if (rows < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_reset: rows %d", rows);
    if (rows == 0) rows = s->rows;
    tqkv_batch **layers = NULL;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) {
        tqkv_status grc = model_cuda_reset(s->gpu, rows);
        if (grc != TQKV_OK) return grc;
    }
#endif
    tqkv_status rc = make_layers(s->m, &s->p, rows, &layers);
    if (rc != TQKV_OK) return rc;
    int *off = calloc((size_t)rows, sizeof(int)), *len = calloc((size_t)rows, sizeof(int));
    if (!off || !len) {
        free(off);
        free(len);
        free_layers(layers, s->m->cfg.n_layers);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    if (s->rec && (rc = rec_reset(s->rec, rows)) != TQKV_OK) {
        free(off);
        free(len);
        free_layers(layers, s->m->cfg.n_layers);
        return rc;
    }
    free_layers(s->layers, s->m->cfg.n_layers);
    free(s->off);
    free(s->len);
    s->layers = layers;
    s->off = off;
    s->len = len;
    if (rows != s->rows) s->cap_rn = 0; /* row-shaped buffers are re-sized on next use */
    s->rows = rows;
    s->p.rows = rows;
    return TQKV_OK;
}

int tqkv_model_state_rows(const tqkv_model_state *s) { return s ? s->rows : 0; }

tqkv_status tqkv_model_state_set_threads(tqkv_model_state *s, int threads) {
    if (!s || threads < 1) return tqkv_fail(TQKV_EINVAL, "set_threads: need threads >= 1");
    s->p.threads = threads;
    return TQKV_OK;
}

tqkv_status tqkv_model_state_reserve(tqkv_model_state *s, int tokens) {
    if (!s || tokens < 1) return tqkv_fail(TQKV_EINVAL, "state_reserve: NULL state or tokens < 1");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_reserve(s->gpu, tokens);
#endif
    return TQKV_OK;
}

tqkv_status tqkv_model_state_fill_synthetic(tqkv_model_state *s, int n, uint64_t seed) {
    if (!s || n < 1) return tqkv_fail(TQKV_EINVAL, "state_fill_synthetic: NULL state or n < 1");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_fill(s->gpu, n, seed);
#endif
    (void)seed;
    return tqkv_fail(TQKV_EUNSUPPORTED, "state_fill_synthetic: device states only");
}

tqkv_status tqkv_model_state_offsets(const tqkv_model_state *s, int *offset) {
    if (!s || !offset) return tqkv_fail(TQKV_EINVAL, "state_offsets: NULL argument");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_offsets(s->gpu, offset);
#endif
    int l = 0; /* Gemma 4: a full layer (sliding layers hold fewer tokens) */
    if (s->m->g4) l = gemma4_position_layer(s->m);
    else /* hybrid graphs: the first layer with KV rows */
        while (l + 1 < s->m->cfg.n_layers && !s->layers[l]) l++;
    return tqkv_batch_offsets(s->layers[l], offset, NULL);
}

tqkv_batch *tqkv_model_state_layer(tqkv_model_state *s, int layer) {
    if (!s || layer < 0 || layer >= s->m->cfg.n_layers || s->gpu) return NULL;
    return s->layers[layer];
}

double tqkv_model_state_kv_bytes_per_token(const tqkv_model_state *s) {
    if (!s) return 0;
    double b = 0;
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) b += tqkv_batch_bytes_per_token(s->layers[l]);
    return b;
}

double tqkv_model_state_kv_bits_per_value(const tqkv_model_state *s) {
    if (!s) return 0;
    double bits = 0, vals = 0; /* layers with their own K/V, weighted by their values */
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        const tqkv_cache_config *c = s->layers && s->layers[l] ? tqkv_batch_get_config(s->layers[l]) : NULL;
        if (!c) continue;
        const double n = (double)c->kv_heads * c->head_dim;
        bits += n * (tqkv_format_bits_per_value(c->k_format, c->head_dim) +
                     tqkv_format_bits_per_value(c->v_format, c->head_dim));
        vals += 2 * n;
    }
    if (vals > 0) return bits / vals;
    const int d = s->m->cfg.head_dim;
    return 0.5 * (tqkv_format_bits_per_value(s->p.k_format, d) +
                  tqkv_format_bits_per_value(s->p.v_format, d));
}

size_t tqkv_model_state_kv_bytes_used(const tqkv_model_state *s) {
    if (!s) return 0;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_kv_bytes(s->gpu); /* device bytes held (capacity) */
#endif
    size_t b = 0;
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) b += tqkv_batch_bytes_used(s->layers[l]);
    return b + (s->rec ? (size_t)s->rows * rec_row_bytes(s->rec) : 0);
}

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------

static int grow(float **p, size_t n) {
    float *q = realloc(*p, sizeof(float) * (n ? n : 1));
    if (!q) return 0;
    *p = q;
    return 1;
}

static tqkv_status ensure_scratch(tqkv_model_state *s, size_t T, size_t RN) {
    const tqkv_model_config *c = &s->m->cfg;
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size, hd = (size_t)c->head_dim;
    size_t QD = (size_t)c->n_heads * hd, KD = (size_t)c->n_kv_heads * hd;
    size_t W = H > I ? H : I;
    if (W < QD) W = QD;
    if (T > s->cap_t) {
        size_t t = T < 16 ? 16 : T;
        int ok = grow(&s->x, t * H) && grow(&s->xn, t * H) && grow(&s->qkv, t * (QD + 2 * KD)) &&
                 grow(&s->att, t * QD) && grow(&s->gu, t * 2 * I) && grow(&s->h, t * I) &&
                 grow(&s->tmp, t * W) &&
                 grow(&s->mm_scratch, t * W) && grow(&s->rc, t * hd / 2) && grow(&s->rs, t * hd / 2);
        int32_t *a = realloc(s->tok_row, sizeof(int32_t) * t);
        if (a) s->tok_row = a;
        int32_t *b = realloc(s->tok_col, sizeof(int32_t) * t);
        if (b) s->tok_col = b;
        if (!ok || !a || !b) {
            free_scratch(s);
            return tqkv_fail(TQKV_ENOMEM, "out of memory for %zu tokens of activations", T);
        }
        s->cap_t = t;
    }
    if (RN > s->cap_rn) {
        int ok = grow(&s->qb, RN * QD) && grow(&s->kb, RN * KD) && grow(&s->vb, RN * KD) &&
                 grow(&s->ob, RN * QD);
        if (!ok) {
            free_scratch(s);
            return tqkv_fail(TQKV_ENOMEM, "out of memory for the attention buffers");
        }
        s->cap_rn = RN;
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

static void matmul_ld(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                      const float *bias, float *y, size_t ldy, int prefill) {
    if (s->p.blas && prefill && w->f32 && T > 1)
        mm_matmul_blas(x, T, w, bias, y, ldy, s->p.threads);
    else
        mm_matmul_ld(x, T, w, bias, y, ldy, s->p.threads, s->mm_scratch);
}

static void matmul(const tqkv_model_state *s, const float *x, int T, const mm_weight *w,
                   const float *bias, float *y, int prefill) {
    matmul_ld(s, x, T, w, bias, y, (size_t)w->n, prefill);
}

/* Undo the appends of layers [0, done) after a failure (extend: rewind n, also inside a
 * spec round; prefill: empty). Neither can fail after the checks forward() made: rows
 * held >= n tokens more than before, and an empty batch of the same config is a small
 * allocation; if even that fails the layer stays as appended and the state says so. */
static tqkv_status rollback(tqkv_model_state *s, int done, int n, int prefill) {
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

/* Shift of row r's token grid for its query j of this call (model_impl.h): how many more
 * tokens than b has dropped so far the row's own single decode at that position would have
 * dropped (a bounded sliding layer holds min(position, keep) tokens before a decode). */
static int reindex_shift(const tqkv_model_state *s, const struct tqkv_batch *b, int r, int n,
                         int j, int keep) {
    if (keep <= 0 || b->ring > 0) return 0; /* a q8 ring is indexed by b's own tokens */
    const int pos = s->off[r] + j, canon = pos > keep ? pos - keep : 0;
    const int dropped = s->off[r] + n - b->offset[r];
    const int d = canon - dropped, end = b->offset[r] - n + j + 1;
    return d < 0 ? 0 : d > end - 1 ? end - 1 : d;
}

int model_attend_reindexes(const tqkv_model_state *s, const tqkv_batch *b, int n, int keep) {
    for (int r = 0; r < s->rows; r++)
        for (int j = 0; j < n; j++)
            if (reindex_shift(s, b, r, n, j, keep) > 0) return 1;
    return 0;
}

tqkv_status model_attend_per_query(tqkv_model_state *s, const tqkv_batch *b, const float *q,
                                   int n, int window, int keep, const tqkv_attn_params *ap,
                                   float *out) {
    const int R = s->rows, NH = ap->q_heads, hd = b->cfg.head_dim;
    if (window < 0 || keep < 0 || (keep > 0 && keep < window))
        return tqkv_fail(TQKV_EINVAL, "attention: window %d / keep %d", window, keep);
    int *vo = malloc(sizeof(int) * 2 * (size_t)R);             /* [rows] offset then left_pad */
    int32_t *lo = malloc(sizeof(int32_t) * 2 * (size_t)R);     /* [rows] lo then hi */
    float *q1 = malloc(sizeof(float) * (size_t)R * NH * hd);   /* [rows, NH, 1, hd] */
    float *o1 = malloc(sizeof(float) * (size_t)R * NH * hd);   /* [rows, NH, 1, hd] */
    tqkv_status rc = TQKV_OK;
    if (!vo || !lo || !q1 || !o1) rc = tqkv_fail(TQKV_ENOMEM, "attention: out of memory");
    /* the view: b's bytes and q8 ring, each row's token grid and length as query j's own
     * decode saw them (read only; attention never keeps it) */
    struct tqkv_batch v = *b;
    v.offset = vo;
    v.left_pad = vo + R;
    for (int j = 0; j < n && rc == TQKV_OK; j++) {
        for (int r = 0; r < R; r++) {
            const int d = reindex_shift(s, b, r, n, j, keep);
            v.left_pad[r] = b->left_pad[r] + d;
            v.offset[r] = b->offset[r] - n + j + 1 - d;
            const int c = v.left_pad[r] + v.offset[r] - 1; /* query j's column (b's too) */
            lo[r] = window > 0 && c - window + 1 > v.left_pad[r] ? c - window + 1 : v.left_pad[r];
            lo[R + r] = c + 1;
            for (int h = 0; h < NH; h++)
                memcpy(q1 + ((size_t)r * NH + h) * hd, q + (((size_t)r * NH + h) * n + j) * hd,
                       sizeof(float) * hd);
        }
        tqkv_mask mk = {.rows = R, .n_query = 1, .window = window, .lo = lo, .hi = lo + R};
        rc = tqkv_batch_attend(&v, &mk, q1, 1, ap, o1);
        for (int r = 0; r < R && rc == TQKV_OK; r++)
            for (int h = 0; h < NH; h++)
                memcpy(out + (((size_t)r * NH + h) * n + j) * hd, o1 + ((size_t)r * NH + h) * hd,
                       sizeof(float) * hd);
    }
    free(vo);
    free(lo);
    free(q1);
    free(o1);
    return rc;
}

// ---------------------------------------------------------------------------
// Forward skeleton pieces shared by the graphs (declared in model_impl.h)
// ---------------------------------------------------------------------------

tqkv_status model_forward_lengths(tqkv_model_state *s, const int32_t *tokens, const int *lengths,
                                  int n, int prefill, int V, int tok_limit, size_t *T) {
    const int R = s->rows;
    size_t total = 0;
    for (int r = 0; r < R; r++) {
        int len = lengths ? lengths[r] : n;
        if (len < 1 || len > n)
            return tqkv_fail(TQKV_EINVAL, "prefill: lengths[%d] = %d outside [1, %d]", r, len, n);
        if (prefill && s->off[r] != 0)
            return tqkv_fail(TQKV_ESTATE, "prefill: row %d already holds %d tokens (reset the state "
                             "or use extend)", r, s->off[r]);
        s->len[r] = len;
        total += (size_t)len;
        for (int j = n - len; j < n; j++) {
            int32_t t = tokens[(size_t)r * n + j];
            if (t < 0 || t >= tok_limit)
                return tqkv_fail(TQKV_ERANGE, "forward: token %d at row %d position %d outside "
                                 "vocab %d", t, r, j, V);
        }
    }
    *T = total;
    return TQKV_OK;
}

void model_forward_compact(const int *len, int rows, int n, int32_t *tok_row, int32_t *tok_col,
                           int *first) {
    size_t t = 0;
    for (int r = 0; r < rows; r++) {
        if (first) first[r] = (int)t;
        for (int j = n - len[r]; j < n; j++, t++) {
            tok_row[t] = r;
            tok_col[t] = j;
        }
    }
    if (first) first[rows] = (int)t;
}

void model_kv_trim_rollback(tqkv_model_state *s, int done, int n, int prefill) {
    for (int l = 0; l < done; l++) {
        if (!s->layers[l]) continue;
        if (prefill) {
            tqkv_batch *nb = NULL;
            if (tqkv_batch_init(&nb, tqkv_batch_get_config(s->layers[l]), s->rows) == TQKV_OK) {
                tqkv_batch_free(s->layers[l]);
                s->layers[l] = nb;
            }
        } else {
            tqkv_batch_trim(s->layers[l], n);
        }
    }
}

/* tokens [rows, n]; lens[r] real tokens at the end of each row (prefill) or n (extend). */
static tqkv_status forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits) {
    if (!m || !s || !tokens || s->m != m)
        return tqkv_fail(TQKV_EINVAL, "forward: NULL argument or state of another model");
    /* every graph (and the device) needs a row: a state filtered to none holds no buffers */
    if (s->rows < 1) return tqkv_fail(TQKV_ESTATE, "forward: the state has no rows");
    if (m->g4 && !s->gpu) return gemma4_forward(m, s, tokens, lengths, n, prefill, mode, logits);
    if (n < 1) return tqkv_fail(TQKV_EINVAL, "forward: n must be >= 1, got %d", n);
    if ((unsigned)mode > TQKV_LOGITS_ALL || (mode != TQKV_LOGITS_NONE && !logits))
        return tqkv_fail(TQKV_EINVAL, "forward: bad logits mode or NULL logits");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_forward(s->gpu, tokens, lengths, n, prefill, mode, logits);
#endif
    if (m->cfg.arch == TQKV_ARCH_QWEN35) /* hybrid graph: graph_qwen35.c */
        return model_qwen35_forward(m, s, tokens, lengths, n, prefill, mode, logits);
    const tqkv_model_config *c = &m->cfg;
    const int R = s->rows, H = c->hidden_size, hd = c->head_dim, NH = c->n_heads,
              NKV = c->n_kv_heads, I = c->intermediate_size, V = c->vocab_size, half = hd / 2;
    const int QD = NH * hd, KD = NKV * hd, th = s->p.threads;

    /* validate before touching anything (a scheduler may have filtered a layer's rows) */
    tqkv_status rc = tqkv_model_state_check(s); /* rows, offsets, spec round: every layer */
    if (rc != TQKV_OK) return rc;
    rc = tqkv_batch_offsets(s->layers[0], s->off, NULL);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < R; r++) {
        int len = lengths ? lengths[r] : n;
        if ((long long)s->off[r] + len > c->max_position_embeddings)
            return tqkv_fail(TQKV_ERANGE, "forward: row %d would reach %lld tokens, past the "
                             "model's context limit of %d (max_position_embeddings)", r,
                             (long long)s->off[r] + len, c->max_position_embeddings);
    }
    size_t T = 0;
    rc = model_forward_lengths(s, tokens, lengths, n, prefill, V, V, &T);
    if (rc != TQKV_OK) return rc;
    rc = ensure_scratch(s, T, (size_t)R * (size_t)n);
    if (rc != TQKV_OK) return rc;

    /* compact token list, embeddings, rope tables */
    model_forward_compact(s->len, R, n, s->tok_row, s->tok_col, NULL);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) {
        int r = s->tok_row[i], j = s->tok_col[i];
        int pos = s->off[r] + j - (n - s->len[r]);
        mm_weight_row(&m->embed, tokens[(size_t)r * n + j], s->x + i * H);
        ops_rope_table(pos, m->inv_freq, half, s->rc + i * half, s->rs + i * half);
    }

    /* a verification window (extend_as_decode) runs the decode path's matmuls (never BLAS),
     * so each of its tokens gets the bits of its single decode */
    const int as_dec = !prefill && n > 1 && s->p.extend_as_decode, pf = n > 1 && !as_dec;
    const float scale = 1.0f / sqrtf((float)hd);
    int nq_pad = 0;
    for (int r = 0; r < R; r++) nq_pad |= s->len[r] != n;
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &m->layers[l];
        tqkv_batch *b = s->layers[l];
        // ---- attention block
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++)
            ops_rmsnorm(s->x + i * H, L->attn_norm, c->rms_norm_eps, H, s->xn + i * H);
        const size_t QS = (size_t)QD + 2 * (size_t)KD;
        if (L->wqkv.data && !(s->p.blas && pf)) {
            matmul(s, s->xn, (int)T, &L->wqkv, L->bqkv, s->qkv, pf);
        } else {
            matmul_ld(s, s->xn, (int)T, &L->wq, L->bq, s->qkv, QS, pf);
            matmul_ld(s, s->xn, (int)T, &L->wk, L->bk, s->qkv + QD, QS, pf);
            matmul_ld(s, s->xn, (int)T, &L->wv, L->bv, s->qkv + QD + KD, QS, pf);
        }
        /* q/k norm, rope, scatter to [rows, heads, n, hd] */
        if (nq_pad) {
            memset(s->qb, 0, sizeof(float) * (size_t)R * n * QD);
            memset(s->kb, 0, sizeof(float) * (size_t)R * n * KD);
            memset(s->vb, 0, sizeof(float) * (size_t)R * n * KD);
        }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *q = s->qkv + i * QS, *k = q + QD, *v = k + KD;
            if (L->q_norm) {
                for (int h = 0; h < NH; h++) ops_rmsnorm(q + h * hd, L->q_norm, c->rms_norm_eps, hd, q + h * hd);
                for (int h = 0; h < NKV; h++) ops_rmsnorm(k + h * hd, L->k_norm, c->rms_norm_eps, hd, k + h * hd);
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
        /* cache */
        if (prefill) {
            rc = tqkv_batch_prepare_prefill(b, s->len);
            if (rc == TQKV_OK) rc = tqkv_batch_append(b, s->kb, s->vb, n);
            if (rc == TQKV_OK) rc = tqkv_batch_finalize_prefill(b);
        } else {
            rc = tqkv_batch_append(b, s->kb, s->vb, n);
        }
        if (rc != TQKV_OK) {
            (void)rollback(s, prefill ? l + 1 : l, n, prefill);
            return rc;
        }
        /* attention */
        const tqkv_mask *mask = NULL;
        rc = tqkv_batch_make_mask(b, s->lease, n, 0, &mask);
        if (rc == TQKV_OK) {
            tqkv_attn_params ap = {NH, scale, n == 1 ? s->p.decode_kernel : s->p.prefill_kernel, th};
            if (as_dec) {
                ap.kernel = s->p.decode_kernel;
                rc = model_attend_per_query(s, b, s->qb, n, 0, 0, &ap, s->ob);
            } else {
                rc = tqkv_batch_attend(b, mask, s->qb, n, &ap, s->ob);
            }
        }
        if (rc != TQKV_OK) {
            (void)rollback(s, l + 1, n, prefill);
            return rc;
        }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            size_t r = (size_t)s->tok_row[i], j = (size_t)s->tok_col[i];
            for (int h = 0; h < NH; h++)
                memcpy(s->att + i * QD + (size_t)h * hd, s->ob + ((r * NH + h) * n + j) * hd,
                       sizeof(float) * hd);
        }
        matmul(s, s->att, (int)T, &L->wo, L->bo, s->tmp, pf);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *x = s->x + i * H;
            const float *o = s->tmp + i * H;
            for (int e = 0; e < H; e++) x[e] += o[e];
            ops_rmsnorm(x, L->ffn_norm, c->rms_norm_eps, H, s->xn + i * H);
        }
        // ---- MLP block
        if (L->wgu.data && !(s->p.blas && pf)) {
            matmul(s, s->xn, (int)T, &L->wgu, NULL, s->gu, pf);
        } else {
            matmul_ld(s, s->xn, (int)T, &L->wg, NULL, s->gu, 2 * (size_t)I, pf);
            matmul_ld(s, s->xn, (int)T, &L->wu, NULL, s->gu + I, 2 * (size_t)I, pf);
        }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 16)
        for (size_t i = 0; i < T; i++)
            ops_swiglu(s->gu + i * 2 * I, s->gu + i * 2 * I + I, I, s->h + i * I);
        matmul(s, s->h, (int)T, &L->wd, NULL, s->tmp, pf);
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
        for (size_t i = 0; i < T; i++) {
            float *x = s->x + i * H;
            const float *o = s->tmp + i * H;
            for (int e = 0; e < H; e++) x[e] += o[e];
        }
    }

    // ---- head
    if (mode == TQKV_LOGITS_NONE) return TQKV_OK;
    if (mode == TQKV_LOGITS_LAST) {
        /* each row's last token is the last compact token of the row */
        size_t at = 0;
        for (int r = 0; r < R; r++) {
            at += (size_t)s->len[r];
            ops_rmsnorm(s->x + (at - 1) * H, m->final_norm, c->rms_norm_eps, H, s->xn + (size_t)r * H);
        }
        matmul(s, s->xn, R, &m->lm_head, NULL, logits, 0);
        return TQKV_OK;
    }
#pragma omp parallel for num_threads(th) schedule(static) if (T >= 64)
    for (size_t i = 0; i < T; i++) ops_rmsnorm(s->x + i * H, m->final_norm, c->rms_norm_eps, H, s->xn + i * H);
    if (!nq_pad) { /* compact order == [rows, n] order */
        matmul(s, s->xn, (int)T, &m->lm_head, NULL, logits, pf);
        return TQKV_OK;
    }
    /* padded: compute per row into its slot, zero the padding positions */
    size_t at = 0;
    for (int r = 0; r < R; r++) {
        int pad = n - s->len[r];
        float *dst = logits + (size_t)r * n * V;
        memset(dst, 0, sizeof(float) * (size_t)pad * V);
        matmul(s, s->xn + at * H, s->len[r], &m->lm_head, NULL, dst + (size_t)pad * V, pf);
        at += (size_t)s->len[r];
    }
    return TQKV_OK;
}

tqkv_status tqkv_model_prefill(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                               const int *lengths, int n, tqkv_logits_mode mode, float *logits) {
    return forward(m, s, tokens, lengths, n, 1, mode, logits);
}

tqkv_status tqkv_model_extend(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              int n, tqkv_logits_mode mode, float *logits) {
    return forward(m, s, tokens, NULL, n, 0, mode, logits);
}

tqkv_status tqkv_model_decode(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              float *logits) {
    return forward(m, s, tokens, NULL, 1, 0, logits ? TQKV_LOGITS_LAST : TQKV_LOGITS_NONE, logits);
}

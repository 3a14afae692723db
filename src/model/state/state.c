/*
 * state.c - a model state's lifecycle and the one public forward preamble.
 * Owns: the state's caches (one tqkv_batch per layer that has KV, made from each layer's
 *   geometry), mask lease and common scratch, the architecture's state extension (through
 *   its ops), byte accounting; tqkv_model_prefill / extend / decode: argument checks, the
 *   rows' context limit (max_position_embeddings) for every architecture and both devices,
 *   then the architecture's forward or the device twin's; the skeleton pieces every CPU
 *   graph shares (model_impl.h): token checks, the compact token list, KV rollback, and
 *   model_attend_per_query, the verification window's attention (a read-only view of a
 *   layer's batch per query, cache/batch.h layout).
 * Must not: compute a graph (arch/<name>/graph.c), name an architecture.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h" /* model_attend_per_query's read-only view */
#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "model/ops/ops.h"
#include "model/state/recurrent.h"
#include "model/tp/tp_state.h"
#include "util/common.h"
#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
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

void model_state_free_layers(tqkv_batch **layers, int n) {
    if (!layers) return;
    for (int l = 0; l < n; l++) tqkv_batch_free(layers[l]);
    free(layers);
}

/* Fresh empty caches for `rows` rows: one per layer with KV of its own (shared and
 * recurrent layers hold NULL), shaped by the layer's geometry. */
tqkv_status model_state_make_layers(const tqkv_model *m, const tqkv_model_state_params *p,
                                    int rows, tqkv_batch ***out) {
    int L = m->cfg.n_layers;
    tqkv_batch **layers = calloc((size_t)L, sizeof *layers);
    if (!layers) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L; l++) {
        const int kind = model_layer_kind_of(m, l);
        if (kind != MODEL_LAYER_KV && kind != MODEL_LAYER_SLIDING) continue;
        tqkv_layer_info li;
        (void)tqkv_model_layer_info(m, l, &li);
        tqkv_cache_config cc = tqkv_cache_config_default();
        cc.kv_heads = li.kv_heads;
        cc.head_dim = li.head_dim;
        tqkv_kv_layer_formats(p, l, &cc.k_format, &cc.v_format);
        cc.seed = p->kv_seed + (uint64_t)l;
        cc.window = p->window;
        cc.window_slack = p->window_slack;
        cc.window_keys_only = p->window_keys_only;
        tqkv_status rc = tqkv_batch_init(&layers[l], &cc, rows);
        if (rc != TQKV_OK) {
            model_state_free_layers(layers, l);
            return rc;
        }
    }
    *out = layers;
    return TQKV_OK;
}

void model_state_free_scratch(tqkv_model_state *s) {
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

/* Per-layer formats: valid values; on the device every layer's pair a device pair or f32/f32
 * (tqkv_kv_layers_device_check), and none on a sharded device state (its ranks' import and
 * export checks assume one format). */
static tqkv_status state_check_layer_formats(const tqkv_model *m, const tqkv_model_state_params *p) {
    int per_layer = 0;
    for (int l = 0; l < TQKV_MAX_KV_LAYERS; l++) {
        if (p->layer_k[l] > TQKV_FORMAT_COUNT || p->layer_v[l] > TQKV_FORMAT_COUNT)
            return tqkv_fail(TQKV_EINVAL, "model state: invalid per-layer KV format at layer %d", l);
        per_layer |= p->layer_k[l] | p->layer_v[l];
    }
    if (!p->device || !per_layer) return TQKV_OK; /* the whole-state pair: model_cuda_init */
    if (model_tp_ranks(p))
        return tqkv_fail(TQKV_EUNSUPPORTED, "model state: per-layer KV formats with "
                         "tensor_parallel run on the CPU only");
    return tqkv_kv_layers_device_check(m, p, NULL);
}

tqkv_status tqkv_model_state_init(tqkv_model_state **out, const tqkv_model *m,
                                  const tqkv_model_state_params *p_in) {
    if (!out || !m) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_init: NULL argument");
    tqkv_model_state_params p = p_in ? *p_in : tqkv_model_state_params_default();
    tqkv_kernel kp, kd; /* TQKV_KERNEL_BY_GRAPH: the graph's kernel set (kernel_set.c) */
    model_kernel_set(m, &kp, &kd);
    if (p.prefill_kernel == TQKV_KERNEL_BY_GRAPH) p.prefill_kernel = kp;
    if (p.decode_kernel == TQKV_KERNEL_BY_GRAPH) p.decode_kernel = kd;
    if (p.rows < 1 || p.threads < 1 || p.window < 0 || p.window_slack < 0)
        return tqkv_fail(TQKV_EINVAL, "model state: need rows >= 1, threads >= 1, window >= 0");
    if ((unsigned)p.prefill_kernel >= TQKV_KERNEL_COUNT ||
        (unsigned)p.decode_kernel >= TQKV_KERNEL_COUNT)
        return tqkv_fail(TQKV_EINVAL, "model state: invalid attention kernel");
    if (p.window_keys_only != 0 && p.window_keys_only != 1)
        return tqkv_fail(TQKV_EINVAL, "model state: window_keys_only must be 0 or 1, got %d",
                         p.window_keys_only);
    if (p.device && p.window_keys_only)
        return tqkv_fail(TQKV_EUNSUPPORTED, "model state: a keys-only q8 window runs on the CPU "
                         "only (the device cache keeps K and V windows)");
    if (p.device_fast_gemm && p.device != 1)
        return tqkv_fail(TQKV_EINVAL, "model state: device_fast_gemm needs device 1 (CUDA)");
    tqkv_status rc = state_check_layer_formats(m, &p);
    if (rc != TQKV_OK) return rc;
    rc = model_tp_check(m, &p); /* tensor_parallel (tp/tp_state.h) */
    if (rc != TQKV_OK) return rc;
    tqkv_model_state *s = tqkv_calloc(1, sizeof *s);
    if (!s) return TQKV_ENOMEM;
    s->m = m;
    s->p = p;
    s->rows = p.rows;
    /* tensor parallel: the ranks hold the caches (s->layers: rank 0's) */
    rc = model_tp_ranks(&p) ? model_tp_init(s)
                               : model_state_make_layers(m, &p, p.rows, &s->layers);
    if (rc == TQKV_OK) rc = tqkv_mask_lease_init(&s->lease);
#ifdef TQKV_HAVE_CUDA
    /* a sharded device state's ranks are the device states (tp/tp_state.c) */
    if (rc == TQKV_OK && p.device == 1 && !s->tp) rc = model_cuda_init(&s->gpu, m, &p, p.rows);
#endif
    if (rc == TQKV_OK && p.device != 0 && !s->gpu && !(s->tp && s->tp->on_device))
        rc = tqkv_fail(TQKV_EUNSUPPORTED, "model state: device %d is not built in", p.device);
    /* the architecture's host extension (a device state keeps its own in the twin) */
    if (rc == TQKV_OK && !s->gpu && !(s->tp && s->tp->on_device) && m->ops->state_init)
        rc = m->ops->state_init(s);
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
    model_tp_free(s); /* the ranks and their caches; s->layers was rank 0's */
    model_state_free_layers(s->layers, s->m->cfg.n_layers);
#ifdef TQKV_HAVE_CUDA
    model_cuda_free(s->gpu);
#endif
    if (s->m->ops->state_free) s->m->ops->state_free(s);
    tqkv_mask_lease_free(s->lease);
    model_pick_free(s->pick);
    model_state_free_scratch(s);
    free(s->off);
    free(s->len);
    free(s);
}

tqkv_status tqkv_model_state_reset(tqkv_model_state *s, int rows) {
    if (!s) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_reset: NULL");
    if (rows < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_model_state_reset: rows %d", rows);
    if (rows == 0) rows = s->rows;
    if (s->tp) return model_tp_reset(s, rows);
    tqkv_batch **layers = NULL;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) {
        tqkv_status grc = model_cuda_reset(s->gpu, rows);
        if (grc != TQKV_OK) return grc;
    }
#endif
    tqkv_status rc = model_state_make_layers(s->m, &s->p, rows, &layers);
    if (rc != TQKV_OK) return rc;
    int *off = calloc((size_t)rows, sizeof(int)), *len = calloc((size_t)rows, sizeof(int));
    if (!off || !len) {
        free(off);
        free(len);
        model_state_free_layers(layers, s->m->cfg.n_layers);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    if (s->rec && (rc = rec_reset(s->rec, rows)) != TQKV_OK) {
        free(off);
        free(len);
        model_state_free_layers(layers, s->m->cfg.n_layers);
        return rc;
    }
    model_state_free_layers(s->layers, s->m->cfg.n_layers);
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
    if (s->tp && s->tp->on_device) { /* every rank's caches (its GPU current) */
        tqkv_status rc = TQKV_OK;
        for (int r = 0; r < s->tp->n && rc == TQKV_OK; r++) {
            rc = model_cuda_set_device(s->tp->device[r]);
            if (rc == TQKV_OK) rc = model_cuda_reserve(s->tp->rank[r]->gpu, tokens);
        }
        model_cuda_select_device(s->tp->device[0]);
        return rc;
    }
#endif
    return TQKV_OK;
}

tqkv_status tqkv_model_state_fill_synthetic(tqkv_model_state *s, int n, uint64_t seed) {
    if (!s || n < 1) return tqkv_fail(TQKV_EINVAL, "state_fill_synthetic: NULL state or n < 1");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_fill(s->gpu, n, seed);
    if (s->tp && s->tp->on_device) { /* every rank's KV heads (the same seed per rank) */
        tqkv_status rc = TQKV_OK;
        for (int r = 0; r < s->tp->n && rc == TQKV_OK; r++) {
            rc = model_cuda_set_device(s->tp->device[r]);
            if (rc == TQKV_OK) rc = model_cuda_fill(s->tp->rank[r]->gpu, n, seed);
        }
        model_cuda_select_device(s->tp->device[0]);
        return rc;
    }
#endif
    (void)seed;
    return tqkv_fail(TQKV_EUNSUPPORTED, "state_fill_synthetic: device states only");
}

tqkv_status tqkv_model_state_offsets(const tqkv_model_state *s, int *offset) {
    if (!s || !offset) return tqkv_fail(TQKV_EINVAL, "state_offsets: NULL argument");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_offsets(s->gpu, offset);
#endif
    return model_state_positions(s, offset);
}

tqkv_batch *tqkv_model_state_layer(tqkv_model_state *s, int layer) {
    if (!s || layer < 0 || layer >= s->m->cfg.n_layers || s->gpu || (s->tp && s->tp->on_device))
        return NULL; /* the caches are on the device */
    return s->layers[layer];
}

double tqkv_model_state_kv_bytes_per_token(const tqkv_model_state *s) {
    if (!s) return 0;
    double b = 0;
    if (s->tp) { /* every rank's share */
        for (int r = 0; r < s->tp->n; r++) b += tqkv_model_state_kv_bytes_per_token(s->tp->rank[r]);
        return b;
    }
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return (double)model_cuda_kv_token_bytes(s->gpu); /* the device's own format */
#endif
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
    if (s->tp) { /* every rank's share */
        for (int r = 0; r < s->tp->n; r++) b += tqkv_model_state_kv_bytes_used(s->tp->rank[r]);
        return b;
    }
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) b += tqkv_batch_bytes_used(s->layers[l]);
    return b + (s->rec ? (size_t)s->rows * rec_row_bytes(s->rec) : 0);
}

size_t tqkv_model_state_kv_bytes_rank(const tqkv_model_state *s, int rank) {
    if (!s) return 0;
    if (!s->tp) return rank == 0 ? tqkv_model_state_kv_bytes_used(s) : 0;
    return rank >= 0 && rank < s->tp->n ? tqkv_model_state_kv_bytes_used(s->tp->rank[rank]) : 0;
}

int tqkv_model_state_tensor_parallel(const tqkv_model_state *s) {
    return s && s->tp ? s->tp->n : 1;
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

// ---------------------------------------------------------------------------
// The public forward: one preamble for every architecture and both devices
// ---------------------------------------------------------------------------

/* Arguments, rows and the context limit; nothing is changed. */
tqkv_status model_forward_check(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, tqkv_logits_mode mode,
                                const float *logits) {
    if (!m || !s || !tokens || s->m != m)
        return tqkv_fail(TQKV_EINVAL, "forward: NULL argument or state of another model");
    /* every graph (and the device) needs a row: a state filtered to none holds no buffers */
    if (s->rows < 1) return tqkv_fail(TQKV_ESTATE, "forward: the state has no rows");
    if (n < 1) return tqkv_fail(TQKV_EINVAL, "forward: n must be >= 1, got %d", n);
    if ((unsigned)mode > TQKV_LOGITS_ALL || (mode != TQKV_LOGITS_NONE && !logits))
        return tqkv_fail(TQKV_EINVAL, "forward: bad logits mode or NULL logits");
    int stack[64], *pos = s->rows <= 64 ? stack : malloc(sizeof(int) * (size_t)s->rows);
    if (!pos) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_status rc = model_state_positions(s, pos);
    const int limit = m->cfg.max_position_embeddings;
    for (int r = 0; r < s->rows && rc == TQKV_OK; r++) {
        const long long end = (long long)pos[r] + (lengths ? lengths[r] : n);
        if (end > limit)
            rc = tqkv_fail(TQKV_ERANGE, "forward: row %d would reach %lld tokens, past the "
                           "model's context limit of %d (max_position_embeddings)", r, end,
                           limit);
    }
    if (pos != stack) free(pos);
    return rc;
}

/* tokens [rows, n]; lengths[r] real tokens at the end of each row (prefill) or n (extend). */
static tqkv_status forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits) {
    tqkv_status rc = model_forward_check(m, s, tokens, lengths, n, mode, logits);
    if (rc != TQKV_OK) return rc;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_forward(s->gpu, tokens, lengths, n, prefill, mode, logits);
    if (s->tp && s->tp->on_device) /* the sharded device forward (cuda/tp_cuda.cu) */
        return model_cuda_tp_forward(s, tokens, lengths, n, prefill, mode, logits);
#endif
    return m->ops->forward(m, s, tokens, lengths, n, prefill, mode, logits);
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

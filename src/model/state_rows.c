/*
 * state_rows.c - row operations on a model state, across all layers at once: merge
 * (add rows: newcomers prefilled as their own state, then their encoded bytes copied in),
 * filter (remove rows), extract one row (prompt reuse, export), spec rounds (begin,
 * commit, rollback to a per-row keep), consistency checks, byte projections, and the
 * state export format used by the engine's prompt cache.
 * Owns: the rule that every layer changes or none does: each operation first builds or
 * validates every layer, then installs all of them.
 * Must not: run the graph (forward.c), schedule requests (src/engine).
 *
 * Extension point: every per-layer row operation goes through rows_layer_* below, which
 * switch on rows_layer_kind(). Today every layer is ROWS_LAYER_KV (one tqkv_batch); a
 * graph with other per-row state (a layer reading a donor layer's cache, a recurrent
 * state) adds its kind there and handles it in each switch.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h" /* spec_base for validation (read only) */
#include "model/model_impl.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Per-layer dispatch (the one place new layer kinds hook in)
// ---------------------------------------------------------------------------

typedef enum {
    ROWS_LAYER_KV = 0, /* a tqkv_batch of K/V rows */
} rows_layer_kind;

static rows_layer_kind rows_layer_kind_of(const tqkv_model_state *s, int l) {
    (void)s;
    (void)l;
    return ROWS_LAYER_KV;
}

/* New layer l holding the rows keep[0..n) of s (s unchanged). */
static tqkv_status rows_layer_select(const tqkv_model_state *s, int l, const int *keep, int n,
                                     tqkv_batch **out) {
    switch (rows_layer_kind_of(s, l)) {
    case ROWS_LAYER_KV: return tqkv_batch_select(s->layers[l], keep, n, out);
    }
    return tqkv_fail(TQKV_EUNSUPPORTED, "state rows: unknown layer kind");
}

/* New layer l = rows of s then rows of src[0..n_src) (all unchanged). */
static tqkv_status rows_layer_merge(const tqkv_model_state *s, tqkv_model_state *const *src,
                                    int n_src, int l, tqkv_batch **out) {
    switch (rows_layer_kind_of(s, l)) {
    case ROWS_LAYER_KV: {
        tqkv_cache_ref *it = calloc((size_t)n_src + 1, sizeof *it);
        if (!it) return tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
        it[0].batch = s->layers[l];
        for (int i = 0; i < n_src; i++) it[i + 1].batch = src[i]->layers[l];
        tqkv_status rc = tqkv_batch_merge(out, it, n_src + 1);
        free(it);
        return rc;
    }
    }
    return tqkv_fail(TQKV_EUNSUPPORTED, "state rows: unknown layer kind");
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static void free_batches(tqkv_batch **b, int n) {
    if (!b) return;
    for (int i = 0; i < n; i++) tqkv_batch_free(b[i]);
    free(b);
}

/* Install new layers and a new row count (per-row arrays resized). Takes ownership. */
static tqkv_status install_layers(tqkv_model_state *s, tqkv_batch **layers, int rows) {
    int *off = calloc((size_t)(rows ? rows : 1), sizeof(int));
    int *len = calloc((size_t)(rows ? rows : 1), sizeof(int));
    if (!off || !len) {
        free(off);
        free(len);
        free_batches(layers, s->m->cfg.n_layers);
        return tqkv_fail(TQKV_ENOMEM, "state rows: out of memory");
    }
    free_batches(s->layers, s->m->cfg.n_layers);
    free(s->off);
    free(s->len);
    s->layers = layers;
    s->off = off;
    s->len = len;
    if (rows != s->rows) s->cap_rn = 0; /* row-shaped scratch is re-sized on next use */
    s->rows = rows;
    s->p.rows = rows;
    return TQKV_OK;
}

static int same_cache_params(const tqkv_model_state *a, const tqkv_model_state *b) {
    return a->p.k_format == b->p.k_format && a->p.v_format == b->p.v_format &&
           a->p.window == b->p.window && a->p.window_slack == b->p.window_slack &&
           a->p.kv_seed == b->p.kv_seed;
}

// ---------------------------------------------------------------------------
// Checks and projections
// ---------------------------------------------------------------------------

tqkv_status tqkv_model_state_check(const tqkv_model_state *s) {
    if (!s) return tqkv_fail(TQKV_EINVAL, "state check: NULL state");
    const int L = s->m->cfg.n_layers, R = s->rows;
    int *o0 = malloc(sizeof(int) * (size_t)(R ? 2 * R : 2)), *o1 = malloc(sizeof(int) * (size_t)(R ? 2 * R : 2));
    if (!o0 || !o1) {
        free(o0);
        free(o1);
        return tqkv_fail(TQKV_ENOMEM, "state check: out of memory");
    }
    tqkv_status rc = TQKV_OK;
    int spec0 = tqkv_batch_spec_active(s->layers[0]);
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        const tqkv_batch *b = s->layers[l];
        if (tqkv_batch_rows(b) != R) {
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d cache holds %d rows, the state %d", l,
                           tqkv_batch_rows(b), R);
            break;
        }
        if (tqkv_batch_spec_active(b) != spec0) {
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d %s in a spec round, layer 0 %s", l,
                           spec0 ? "is not" : "is", spec0 ? "is" : "is not");
            break;
        }
        if ((rc = tqkv_batch_offsets(b, l ? o1 : o0, (l ? o1 : o0) + R)) != TQKV_OK) break;
        if (l == 0) continue;
        for (int r = 0; r < R; r++)
            if (o1[r] != o0[r]) {
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d holds %d tokens in layer %d but %d in "
                               "layer 0", r, o1[r], l, o0[r]);
                break;
            }
    }
    free(o0);
    free(o1);
    return rc;
}

size_t tqkv_model_state_projected_bytes(const tqkv_model_state *s, int tokens) {
    if (!s || tokens <= 0) return 0;
    size_t b = 0;
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        b += tqkv_batch_projected_bytes(s->layers[l], tokens);
    return b;
}

int tqkv_model_state_min_reusable_offset(const tqkv_model_state *s, int row) {
    if (!s || row < 0 || row >= s->rows) return 0;
    int mx = 0;
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        int v = tqkv_batch_min_reusable_offset(s->layers[l], row);
        if (v > mx) mx = v;
    }
    return mx;
}

int tqkv_model_context_len(const tqkv_model *m) {
    return m ? m->cfg.max_position_embeddings : 0;
}

// ---------------------------------------------------------------------------
// Merge / filter / extract
// ---------------------------------------------------------------------------

tqkv_status tqkv_model_state_merge(tqkv_model_state *s, tqkv_model_state *const *src, int n_src) {
    if (!s || (n_src > 0 && !src) || n_src < 0)
        return tqkv_fail(TQKV_EINVAL, "state merge: NULL argument or n_src < 0");
    if (n_src == 0) return TQKV_OK;
    long long rows = s->rows;
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    for (int i = 0; i < n_src; i++) {
        if (!src[i] || src[i] == s)
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d is NULL or the target", i);
        if (src[i]->m != s->m)
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d belongs to another model", i);
        if (!same_cache_params(s, src[i]))
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d has other cache parameters "
                             "(formats, window, seed)", i);
        if ((rc = tqkv_model_state_check(src[i])) != TQKV_OK) return rc;
        rows += src[i]->rows;
    }
    if (rows > (1 << 20)) return tqkv_fail(TQKV_ERANGE, "state merge: too many rows (%lld)", rows);
    const int L = s->m->cfg.n_layers;
    tqkv_batch **nl = calloc((size_t)L, sizeof *nl);
    if (!nl) return tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
    for (int l = 0; l < L; l++)
        if ((rc = rows_layer_merge(s, src, n_src, l, &nl[l])) != TQKV_OK) {
            free_batches(nl, L);
            return rc;
        }
    return install_layers(s, nl, (int)rows);
}

tqkv_status tqkv_model_state_filter(tqkv_model_state *s, const int *keep, int n_keep) {
    if (!s || (n_keep > 0 && !keep) || n_keep < 0)
        return tqkv_fail(TQKV_EINVAL, "state filter: NULL argument or n_keep < 0");
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    const int L = s->m->cfg.n_layers;
    tqkv_batch **nl = calloc((size_t)L, sizeof *nl);
    if (!nl) return tqkv_fail(TQKV_ENOMEM, "state filter: out of memory");
    for (int l = 0; l < L; l++)
        if ((rc = rows_layer_select(s, l, keep, n_keep, &nl[l])) != TQKV_OK) {
            free_batches(nl, L);
            return rc;
        }
    return install_layers(s, nl, n_keep);
}

tqkv_status tqkv_model_state_extract_row(const tqkv_model_state *s, int row,
                                         tqkv_model_state **out) {
    if (!s || !out) return tqkv_fail(TQKV_EINVAL, "state extract: NULL argument");
    if (row < 0 || row >= s->rows)
        return tqkv_fail(TQKV_ERANGE, "state extract: row %d not in [0, %d)", row, s->rows);
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (tqkv_batch_spec_active(s->layers[0]))
        return tqkv_fail(TQKV_ESTATE, "state extract: a spec round is active");
    tqkv_model_state_params p = s->p;
    p.rows = 1;
    tqkv_model_state *n = NULL;
    if ((rc = tqkv_model_state_init(&n, s->m, &p)) != TQKV_OK) return rc;
    const int L = s->m->cfg.n_layers;
    tqkv_batch **nl = calloc((size_t)L, sizeof *nl);
    if (!nl) {
        tqkv_model_state_free(n);
        return tqkv_fail(TQKV_ENOMEM, "state extract: out of memory");
    }
    for (int l = 0; l < L; l++)
        if ((rc = rows_layer_select(s, l, &row, 1, &nl[l])) != TQKV_OK) {
            free_batches(nl, L);
            tqkv_model_state_free(n);
            return rc;
        }
    if ((rc = install_layers(n, nl, 1)) != TQKV_OK) {
        tqkv_model_state_free(n);
        return rc;
    }
    *out = n;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Spec rounds over every layer
// ---------------------------------------------------------------------------

tqkv_status tqkv_model_state_spec_begin(tqkv_model_state *s) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (tqkv_batch_spec_active(s->layers[0]))
        return tqkv_fail(TQKV_ESTATE, "spec_begin: a spec round is already active");
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if ((rc = tqkv_batch_spec_begin(s->layers[l])) != TQKV_OK) return rc; /* not reached */
    return TQKV_OK;
}

tqkv_status tqkv_model_state_spec_commit(tqkv_model_state *s) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (!tqkv_batch_spec_active(s->layers[0]))
        return tqkv_fail(TQKV_ESTATE, "spec_commit: no spec round is active");
    for (int l = 0; l < s->m->cfg.n_layers; l++) tqkv_batch_spec_commit(s->layers[l]);
    return TQKV_OK;
}

/* keep: n_keep == 1 (all rows) or rows; validated against every layer before any change. */
tqkv_status tqkv_model_state_spec_rollback(tqkv_model_state *s, const int *keep, int n_keep) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (!keep) return tqkv_fail(TQKV_EINVAL, "spec_rollback: keep is NULL");
    if (!tqkv_batch_spec_active(s->layers[0]))
        return tqkv_fail(TQKV_ESTATE, "spec_rollback: no spec round is active");
    if (n_keep != 1 && n_keep != s->rows)
        return tqkv_fail(TQKV_EINVAL, "spec_rollback: n_keep must be 1 or rows (%d), got %d",
                         s->rows, n_keep);
    /* every layer holds the same offsets (checked); the layer-0 bound holds for all */
    for (int r = 0; r < s->rows; r++) {
        int k = keep[n_keep == 1 ? 0 : r];
        int appended = s->layers[0]->offset[r] - s->layers[0]->spec_base[r];
        if (k < 0 || k > appended)
            return tqkv_fail(TQKV_ERANGE, "spec_rollback: keep[%d] = %d not in [0, %d]", r, k,
                             appended);
    }
    for (int l = 0; l < s->m->cfg.n_layers; l++) tqkv_batch_spec_rollback(s->layers[l], keep, n_keep);
    return TQKV_OK;
}

int tqkv_model_state_spec_active(const tqkv_model_state *s) {
    return s && s->rows >= 0 ? tqkv_batch_spec_active(s->layers[0]) : 0;
}

// ---------------------------------------------------------------------------
// Export / import (prompt cache files)
// ---------------------------------------------------------------------------
/* Layout (little endian): "TQKVMS01" | u32 n_layers | u32 rows | per layer: u64 length,
 * then that layer's tqkv_batch_export bytes (its own versioned, checksummed format). */

static const char STATE_MAGIC[8] = {'T', 'Q', 'K', 'V', 'M', 'S', '0', '1'};

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

tqkv_status tqkv_model_state_export(const tqkv_model_state *s, uint8_t **out, size_t *len) {
    if (!s || !out || !len) return tqkv_fail(TQKV_EINVAL, "state export: NULL argument");
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (tqkv_batch_spec_active(s->layers[0]))
        return tqkv_fail(TQKV_ESTATE, "state export: a spec round is active");
    const int L = s->m->cfg.n_layers;
    uint8_t **blob = calloc((size_t)L, sizeof *blob);
    size_t *bl = calloc((size_t)L, sizeof *bl);
    size_t total = 16;
    if (!blob || !bl) rc = tqkv_fail(TQKV_ENOMEM, "state export: out of memory");
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        rc = tqkv_batch_export(s->layers[l], &blob[l], &bl[l]);
        total += 8 + bl[l];
    }
    uint8_t *buf = rc == TQKV_OK ? malloc(total) : NULL;
    if (rc == TQKV_OK && !buf) rc = tqkv_fail(TQKV_ENOMEM, "state export: out of memory");
    if (rc == TQKV_OK) {
        memcpy(buf, STATE_MAGIC, 8);
        put_u32(buf + 8, (uint32_t)L);
        put_u32(buf + 12, (uint32_t)s->rows);
        size_t at = 16;
        for (int l = 0; l < L; l++) {
            put_u64(buf + at, bl[l]);
            memcpy(buf + at + 8, blob[l], bl[l]);
            at += 8 + bl[l];
        }
        *out = buf;
        *len = total;
    }
    for (int l = 0; blob && l < L; l++) free(blob[l]);
    free(blob);
    free(bl);
    return rc;
}

tqkv_status tqkv_model_state_import(tqkv_model_state **out, const tqkv_model *m,
                                    const tqkv_model_state_params *p_in, const uint8_t *buf,
                                    size_t len) {
    if (!out || !m || !buf) return tqkv_fail(TQKV_EINVAL, "state import: NULL argument");
    tqkv_model_state_params p = p_in ? *p_in : tqkv_model_state_params_default();
    if (len < 16 || memcmp(buf, STATE_MAGIC, 8))
        return tqkv_fail(TQKV_ECORRUPT, "state import: not a tqkv model state (bad magic)");
    const int L = m->cfg.n_layers;
    uint32_t nl = get_u32(buf + 8), rows = get_u32(buf + 12);
    if ((int)nl != L || nl > 100000)
        return tqkv_fail(TQKV_EINVAL, "state import: the state has %u layers, this model %d "
                         "(state of another model)", nl, L);
    if (rows < 1 || rows > (1u << 20))
        return tqkv_fail(TQKV_ECORRUPT, "state import: bad row count %u", rows);
    tqkv_batch **layers = calloc((size_t)L, sizeof *layers);
    if (!layers) return tqkv_fail(TQKV_ENOMEM, "state import: out of memory");
    tqkv_status rc = TQKV_OK;
    size_t at = 16;
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        if (len - at < 8) {
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: truncated before layer %d", l);
            break;
        }
        uint64_t bl = get_u64(buf + at);
        at += 8;
        if (bl > len - at) {
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: layer %d truncated", l);
            break;
        }
        if ((rc = tqkv_batch_restore(&layers[l], buf + at, (size_t)bl)) != TQKV_OK) break;
        at += (size_t)bl;
        const tqkv_cache_config *c = tqkv_batch_get_config(layers[l]);
        if (c->kv_heads != m->cfg.n_kv_heads || c->head_dim != m->cfg.head_dim)
            rc = tqkv_fail(TQKV_EINVAL, "state import: layer %d has %d kv heads of dim %d, this "
                           "model %d of dim %d (state of another model)", l, c->kv_heads,
                           c->head_dim, m->cfg.n_kv_heads, m->cfg.head_dim);
        else if (c->k_format != p.k_format || c->v_format != p.v_format)
            rc = tqkv_fail(TQKV_EINVAL, "state import: KV format %s/%s, expected %s/%s",
                           tqkv_format_name(c->k_format), tqkv_format_name(c->v_format),
                           tqkv_format_name(p.k_format), tqkv_format_name(p.v_format));
        else if (c->window != p.window || c->window_slack != p.window_slack ||
                 c->seed != p.kv_seed + (uint64_t)l)
            rc = tqkv_fail(TQKV_EINVAL, "state import: window %d slack %d seed %llu at layer %d, "
                           "expected %d, %d, %llu", c->window, c->window_slack,
                           (unsigned long long)c->seed, l, p.window, p.window_slack,
                           (unsigned long long)(p.kv_seed + (uint64_t)l));
        else if (tqkv_batch_rows(layers[l]) != (int)rows || tqkv_batch_spec_active(layers[l]))
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: layer %d holds %d rows, header %u", l,
                           tqkv_batch_rows(layers[l]), rows);
    }
    if (rc == TQKV_OK && at != len)
        rc = tqkv_fail(TQKV_ECORRUPT, "state import: %zu trailing bytes", len - at);
    tqkv_model_state *s = NULL;
    if (rc == TQKV_OK) {
        p.rows = (int)rows;
        rc = tqkv_model_state_init(&s, m, &p);
    }
    if (rc != TQKV_OK) {
        free_batches(layers, L);
        return rc;
    }
    if ((rc = install_layers(s, layers, (int)rows)) == TQKV_OK) rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) {
        tqkv_model_state_free(s);
        return rc;
    }
    *out = s;
    return TQKV_OK;
}

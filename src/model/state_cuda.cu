/*
 * state_cuda.cu - the device twin's row operations, spec rounds and state export / upload
 * (state_rows.c's device branch; declared in model_cuda.h).
 * Owns: building every layer's new device cache (merge, filter, extract, upload) before
 * installing any, and validating every layer before a spec round changes one.
 * Must not: launch kernels itself (the cache module does), or run the forward
 * (forward_cuda.cu).
 */
#include <stdlib.h>

extern "C" {
#include "model/model_impl.h"
#include "util/common.h"
}
#include "model/model_cuda_impl.h"

// ---------------------------------------------------------------------------
// row operations (state_rows.c's device branch): new caches are built for every layer
// first, then installed, so a failure leaves the twin as it was
// ---------------------------------------------------------------------------

extern "C" tqkv_status model_cuda_merge(model_cuda *g, model_cuda *const *src, int n) {
    const int L = g->m->cfg.n_layers;
    int rows = g->rows;
    for (int i = 0; i < n; i++) rows += src[i]->rows;
    if (rows > CUDA_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state merge: %d rows (a device state holds at most %d)",
                         rows, CUDA_MAX_ROWS);
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    cuda_kv **items = (cuda_kv **)calloc((size_t)n + 1, sizeof *items);
    tqkv_status st = nk && items ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        items[0] = g->kv[l];
        for (int i = 0; i < n; i++) items[i + 1] = src[i]->kv[l];
        st = tqkv_cuda_kv_merge(&nk[l], items, n + 1);
    }
    free(items);
    if (st) {
        mc_free_cache_array(nk, L);
        return st;
    }
    return mc_install_caches(g, nk, rows);
}

extern "C" tqkv_status model_cuda_filter(model_cuda *g, const int *keep, int n) {
    const int L = g->m->cfg.n_layers;
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    tqkv_status st = nk ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) st = tqkv_cuda_kv_select(g->kv[l], keep, n, &nk[l]);
    if (st) {
        mc_free_cache_array(nk, L);
        return st;
    }
    return mc_install_caches(g, nk, n);
}

extern "C" tqkv_status model_cuda_extract(const model_cuda *g, int row, model_cuda *dst) {
    const int L = g->m->cfg.n_layers;
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    tqkv_status st = nk ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) st = tqkv_cuda_kv_extract(g->kv[l], row, &nk[l]);
    if (st) {
        mc_free_cache_array(nk, L);
        return st;
    }
    return mc_install_caches(dst, nk, 1);
}

extern "C" tqkv_status model_cuda_check(const model_cuda *g) {
    const int *o0 = tqkv_cuda_kv_offsets(g->kv[0]), *b0 = tqkv_cuda_kv_spec_bases(g->kv[0]);
    const int spec0 = tqkv_cuda_kv_spec_active(g->kv[0]);
    for (int l = 1; l < g->m->cfg.n_layers; l++) {
        const int *o = tqkv_cuda_kv_offsets(g->kv[l]), *b = tqkv_cuda_kv_spec_bases(g->kv[l]);
        if (tqkv_cuda_kv_spec_active(g->kv[l]) != spec0)
            return tqkv_fail(TQKV_ESTATE, "state: device layer %d %s in a spec round, layer 0 %s",
                             l, spec0 ? "is not" : "is", spec0 ? "is" : "is not");
        for (int r = 0; r < g->rows; r++) {
            if (o[r] != o0[r])
                return tqkv_fail(TQKV_ESTATE, "state: device layer %d row %d holds %d tokens, "
                                 "layer 0 %d", l, r, o[r], o0[r]);
            if (spec0 && b[r] != b0[r])
                return tqkv_fail(TQKV_ESTATE, "state: device layer %d row %d began its spec round "
                                 "at %d tokens, layer 0 at %d", l, r, b[r], b0[r]);
        }
    }
    return TQKV_OK;
}

extern "C" size_t model_cuda_projected_bytes(const model_cuda *g, int tokens) {
    size_t b = 0;
    for (int l = 0; l < g->m->cfg.n_layers; l++) {
        size_t ring = 0;
        b += tqkv_cuda_kv_token_bytes(g->kv[l], &ring) * (size_t)tokens + ring;
    }
    return b;
}

extern "C" size_t model_cuda_kv_bytes(const model_cuda *g) {
    size_t b = 0;
    if (g && g->kv)
        for (int l = 0; l < g->m->cfg.n_layers; l++) b += tqkv_cuda_kv_bytes(g->kv[l]);
    return b;
}

// ---------------------------------------------------------------------------
// spec rounds, export and upload (state_rows.c's device branch): every layer is validated
// (or built) before any is changed
// ---------------------------------------------------------------------------

extern "C" int model_cuda_spec_active(const model_cuda *g) {
    return g && g->kv ? tqkv_cuda_kv_spec_active(g->kv[0]) : 0;
}

extern "C" tqkv_status model_cuda_spec_begin(model_cuda *g) {
    const int L = g->m->cfg.n_layers;
    for (int l = 0; l < L; l++)
        if (tqkv_cuda_kv_spec_active(g->kv[l]))
            return tqkv_fail(TQKV_ESTATE, "spec_begin: a spec round is already active (layer %d)", l);
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++) st = tqkv_cuda_kv_spec_begin(g->kv[l]); /* cannot fail: checked */
    return st;
}

extern "C" tqkv_status model_cuda_spec_commit(model_cuda *g) {
    const int L = g->m->cfg.n_layers;
    for (int l = 0; l < L; l++)
        if (!tqkv_cuda_kv_spec_active(g->kv[l]))
            return tqkv_fail(TQKV_ESTATE, "spec_commit: no spec round is active (layer %d)", l);
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++) st = tqkv_cuda_kv_spec_commit(g->kv[l]); /* cannot fail: checked */
    return st;
}

/* Only the row-table upload of each layer can fail after the checks (a CUDA error), and
 * then the layers are out of step: model_cuda_check reports it. */
extern "C" tqkv_status model_cuda_spec_rollback(model_cuda *g, const int *keep, int n_keep) {
    const int L = g->m->cfg.n_layers, R = g->rows;
    if (!keep) return tqkv_fail(TQKV_EINVAL, "spec_rollback: keep is NULL");
    if (n_keep != 1 && n_keep != R)
        return tqkv_fail(TQKV_EINVAL, "spec_rollback: n_keep must be 1 or rows (%d), got %d", R, n_keep);
    for (int l = 0; l < L; l++) {
        if (!tqkv_cuda_kv_spec_active(g->kv[l]))
            return tqkv_fail(TQKV_ESTATE, "spec_rollback: no spec round is active (layer %d)", l);
        const int *o = tqkv_cuda_kv_offsets(g->kv[l]), *b = tqkv_cuda_kv_spec_bases(g->kv[l]);
        for (int r = 0; r < R; r++) {
            const int k = keep[n_keep == 1 ? 0 : r], appended = o[r] - b[r];
            if (k < 0 || k > appended)
                return tqkv_fail(TQKV_ERANGE, "spec_rollback: keep[%d] = %d not in [0, %d] "
                                 "(layer %d)", r, k, appended, l);
        }
    }
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++) st = tqkv_cuda_kv_spec_rollback(g->kv[l], keep, n_keep);
    return st;
}

extern "C" tqkv_status model_cuda_export_layer(const model_cuda *g, int l, uint8_t **out, size_t *len) {
    if (!g || !out || !len || l < 0 || l >= g->m->cfg.n_layers)
        return tqkv_fail(TQKV_EINVAL, "state export: bad device layer argument");
    if (g->p.k_format == TQKV_F32 || g->p.v_format == TQKV_F32)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state export: a device state with f32 KV holds a dense "
                         "bf16 cache, which has no state format (export device states with tq4 or "
                         "tq3 KV)");
    return tqkv_cuda_kv_export(g->kv[l], out, len);
}

extern "C" tqkv_status model_cuda_upload(model_cuda *g, tqkv_batch *const *layers, int rows) {
    const int L = g->m->cfg.n_layers;
    if (!layers || rows < 0) return tqkv_fail(TQKV_EINVAL, "state upload: bad argument");
    if (rows > CUDA_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state import: %d rows (a device state holds at most %d)",
                         rows, CUDA_MAX_ROWS);
    if (g->p.k_format == TQKV_F32 || g->p.v_format == TQKV_F32)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state import: a device state with f32 KV holds a dense "
                         "bf16 cache, which has no state format (import into tq4 or tq3 KV)");
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    int *off = (int *)calloc((size_t)(rows ? 2 * rows : 2), sizeof(int)); /* [rows] offsets | left pads */
    tqkv_status st = nk && off ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        if (!layers[l] || tqkv_batch_rows(layers[l]) != rows) {
            st = tqkv_fail(TQKV_EINVAL, "state upload: layer %d is missing or holds other than %d rows",
                           l, rows);
            break;
        }
        if ((st = tqkv_batch_offsets(layers[l], off, off + rows))) break;
        int cap = 1; /* room for every row's end column */
        for (int r = 0; r < rows; r++) cap = off[rows + r] + off[r] > cap ? off[rows + r] + off[r] : cap;
        st = tqkv_cuda_kv_init(&nk[l], tqkv_batch_get_config(layers[l]), 0, rows, cap);
        if (!st) st = tqkv_cuda_kv_upload(nk[l], layers[l]);
    }
    free(off);
    if (st) {
        mc_free_cache_array(nk, L);
        return st;
    }
    return mc_install_caches(g, nk, rows);
}


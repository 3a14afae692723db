/*
 * batch_engine.c - batch helpers a serving engine needs beside the row changes of
 * batch_rows.c: an out-of-place row selection (so that a model state can rebuild every
 * layer first and install them all, or none), a rewind that also works inside a spec
 * round (undo of a failed forward), and the per-row byte projection / reusable prefix.
 * Owns: nothing new in the batch layout; it reuses store_* and batch_* helpers.
 * Must not: decode, rotate or requantize anything.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Select: a new batch holding rows keep[0..n_keep) of b (b unchanged)
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_select(const tqkv_batch *b, const int *keep, int n_keep,
                              tqkv_batch **out) {
    CACHE_CHECK(b && out, TQKV_EINVAL, "batch_select: NULL argument");
    CACHE_CHECK(n_keep >= 0 && n_keep <= b->rows, TQKV_ERANGE,
                "batch_select: n_keep = %d not in [0, %d]", n_keep, b->rows);
    CACHE_CHECK(keep || n_keep == 0, TQKV_EINVAL, "batch_select: keep is NULL");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_select: a prefill is in progress");
    int min_pad = 0, need = 0;
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (r < 0 || r >= b->rows)
            return tqkv_fail(TQKV_ERANGE, "batch_select: keep[%d] = %d not in [0, %d)", i, r,
                             b->rows);
        for (int j = 0; j < i; j++)
            if (keep[j] == r) return tqkv_fail(TQKV_EINVAL, "batch_select: row %d listed twice", r);
        if (i == 0 || b->left_pad[r] < min_pad) min_pad = b->left_pad[r];
    }
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (b->left_pad[r] - min_pad + b->offset[r] > need)
            need = b->left_pad[r] - min_pad + b->offset[r];
    }
    struct tqkv_batch *nb;
    tqkv_status st = batch_create(&nb, &b->cfg, 0, 0, 0);
    if (st) return st;
    batch_store s;
    if ((st = store_alloc(nb, n_keep, need, &s))) {
        batch_destroy(nb);
        return st;
    }
    for (int i = 0; i < n_keep; i++) store_move_row(&s, i, b->left_pad[keep[i]] - min_pad, b, keep[i]);
    store_install(nb, &s);
    nb->spec_active = b->spec_active; /* spec_base moved with the rows */
    *out = nb;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Rewind: drop the newest n tokens of every row, in or out of a spec round
// ---------------------------------------------------------------------------

/* Exact (bytes as before the append) when n <= window_slack or the batch has no window;
 * in a spec round a row may not go below its spec_begin offset. */
tqkv_status tqkv_batch_rewind(tqkv_batch *b, int n) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_rewind: batch is NULL");
    CACHE_CHECK(n >= 0, TQKV_EINVAL, "batch_rewind: n must be >= 0, got %d", n);
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_rewind: a prefill is in progress");
    for (int r = 0; r < b->rows; r++) {
        int floor = b->spec_active ? b->spec_base[r] : 0;
        if (b->offset[r] - n < floor)
            return tqkv_fail(TQKV_ERANGE, "batch_rewind: n = %d takes row %d below %d tokens", n,
                             r, floor);
    }
    for (int r = 0; r < b->rows; r++) b->offset[r] -= n;
    batch_clamp_win_lo(b);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Per-row projections
// ---------------------------------------------------------------------------

/* Bytes one row holding `tokens` tokens takes (main planes + its share of the q8 ring):
 * the same formula as tqkv_cache_projected_bytes. */
size_t tqkv_batch_projected_bytes(const tqkv_batch *b, int tokens) {
    if (!b || tokens <= 0) return 0;
    size_t H = (size_t)b->cfg.kv_heads;
    size_t bytes = (size_t)tokens * H * (plane_vec_bytes(&b->k) + plane_vec_bytes(&b->v));
    size_t win = (size_t)(tokens < b->ring ? tokens : b->ring);
    bytes += win * H * plane_win_bytes(b) * (size_t)(b->k.has_window + b->v.has_window);
    return bytes;
}

/* tqkv_cache_min_reusable_offset for row `row` (0 when row is out of range). */
int tqkv_batch_min_reusable_offset(const tqkv_batch *b, int row) {
    if (!b || row < 0 || row >= b->rows) return 0;
    if (b->ring <= 0 || b->win_lo[row] == 0) return 0;
    return b->win_lo[row] + b->cfg.window;
}

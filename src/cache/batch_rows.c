/*
 * batch_rows.c - row changes: merge, filter, extract, align.
 * Owns: moving rows between caches by copying encoded bytes (main planes column by
 * column, the q8 ring slot for slot, since slots are indexed by token, not column).
 * Every call builds the new storage completely, then installs it: a failure leaves
 * every object as it was.
 * Must not: decode, rotate or requantize anything.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Merge
// ---------------------------------------------------------------------------

static const struct tqkv_batch *ref_batch(const tqkv_cache_ref *it) {
    return it->batch ? it->batch : it->single->b;
}

/* Rows of every item in order, right-aligned: left_pad = max offset - offset.
 * Items may be batches or singles; they must share kv_heads, head_dim, formats, seed,
 * window and slack, and none may be in a prefill or spec round. */
tqkv_status tqkv_batch_merge(tqkv_batch **out, const tqkv_cache_ref *items, int n_items) {
    CACHE_CHECK(out, TQKV_EINVAL, "batch_merge: out is NULL");
    CACHE_CHECK(items, TQKV_EINVAL, "batch_merge: items is NULL");
    CACHE_CHECK(n_items >= 1, TQKV_EINVAL, "batch_merge: need at least one item, got %d",
                n_items);
    long long rows = 0;
    int maxlen = 0;
    const struct tqkv_batch *first = NULL;
    for (int i = 0; i < n_items; i++) {
        const tqkv_cache_ref *it = &items[i];
        if ((it->batch != NULL) == (it->single != NULL))
            return tqkv_fail(TQKV_EINVAL, "batch_merge: item %d must set exactly one of batch "
                             "and single", i);
        if (it->single && !it->single->b)
            return tqkv_fail(TQKV_EINVAL, "batch_merge: item %d is an invalid single cache", i);
        const struct tqkv_batch *ib = ref_batch(it);
        if (ib->spec_active)
            return tqkv_fail(TQKV_ESTATE, "batch_merge: item %d is in a spec round", i);
        if (ib->prefill_active)
            return tqkv_fail(TQKV_ESTATE, "batch_merge: item %d is in a prefill", i);
        if (!first) {
            first = ib;
        } else {
            char what[160];
            if (cache_config_diff(&first->cfg, &ib->cfg, what, sizeof what))
                return tqkv_fail(TQKV_EINVAL, "batch_merge: item %d differs from item 0: %s", i,
                                 what);
        }
        rows += ib->rows;
        for (int r = 0; r < ib->rows; r++)
            if (ib->offset[r] > maxlen) maxlen = ib->offset[r];
    }
    if (rows > (1 << 24)) return tqkv_fail(TQKV_ERANGE, "batch_merge: too many rows (%lld)", rows);
    struct tqkv_batch *nb;
    tqkv_status st = batch_create(&nb, &first->cfg, 0, 0, 0);
    if (st) return st;
    batch_store s;
    /* headroom: the next append must not copy the whole batch again at once */
    int cap = maxlen + batch_headroom(maxlen);
    if (cap > CACHE_MAX_COLUMNS) cap = CACHE_MAX_COLUMNS;
    if ((st = store_alloc(nb, (int)rows, cap, &s))) {
        batch_destroy(nb);
        return st;
    }
    int dr = 0;
    for (int i = 0; i < n_items; i++) {
        const struct tqkv_batch *ib = ref_batch(&items[i]);
        for (int r = 0; r < ib->rows; r++, dr++)
            store_move_row(&s, dr, maxlen - ib->offset[r], ib, r);
    }
    store_install(nb, &s);
    *out = nb;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Filter
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_filter(tqkv_batch *b, const int *keep, int n_keep) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_filter: batch is NULL");
    CACHE_CHECK(n_keep >= 0, TQKV_EINVAL, "batch_filter: n_keep must be >= 0, got %d", n_keep);
    CACHE_CHECK(keep || n_keep == 0, TQKV_EINVAL, "batch_filter: keep is NULL");
    CACHE_CHECK(n_keep <= b->rows, TQKV_ERANGE,
                "batch_filter: n_keep = %d exceeds rows (%d) (indices must be distinct)", n_keep,
                b->rows);
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_filter: a prefill is in progress");
    char *seen = calloc((size_t)(b->rows ? b->rows : 1), 1);
    if (!seen) return tqkv_fail(TQKV_ENOMEM, "batch_filter: out of memory");
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (r < 0 || r >= b->rows) {
            free(seen);
            return tqkv_fail(TQKV_ERANGE, "batch_filter: keep[%d] = %d not in [0, %d)", i, r,
                             b->rows);
        }
        if (seen[r]) {
            free(seen);
            return tqkv_fail(TQKV_EINVAL, "batch_filter: row %d listed twice", r);
        }
        seen[r] = 1;
    }
    free(seen);
    int min_pad = 0, need = 0;
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (i == 0 || b->left_pad[r] < min_pad) min_pad = b->left_pad[r];
    }
    for (int i = 0; i < n_keep; i++) {
        int r = keep[i];
        if (b->left_pad[r] - min_pad + b->offset[r] > need)
            need = b->left_pad[r] - min_pad + b->offset[r];
    }
    int cap = b->cap - min_pad > need ? b->cap - min_pad : need; /* keep spare capacity */
    batch_store s;
    tqkv_status st = store_alloc(b, n_keep, cap, &s);
    if (st) return st;
    /* a spec round survives filtering (spec_base moves with the row) */
    for (int i = 0; i < n_keep; i++)
        store_move_row(&s, i, b->left_pad[keep[i]] - min_pad, b, keep[i]);
    store_install(b, &s);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Extract
// ---------------------------------------------------------------------------

/* A single cache holding row `row`'s tokens (no padding, same window state). */
tqkv_status tqkv_batch_extract(const tqkv_batch *b, int row, tqkv_cache **out) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_extract: batch is NULL");
    CACHE_CHECK(out, TQKV_EINVAL, "batch_extract: out is NULL");
    CACHE_CHECK(row >= 0 && row < b->rows, TQKV_ERANGE, "batch_extract: row %d not in [0, %d)",
                row, b->rows);
    struct tqkv_batch *nb;
    tqkv_status st = batch_create(&nb, &b->cfg, 0, 0, 1);
    if (st) return st;
    batch_store s;
    if ((st = store_alloc(nb, 1, b->offset[row], &s))) {
        batch_destroy(nb);
        return st;
    }
    store_move_row(&s, 0, 0, b, row);
    store_install(nb, &s);
    return cache_wrap(out, nb);
}

// ---------------------------------------------------------------------------
// Align
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_align(tqkv_batch *b, const int *left_pad) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_align: batch is NULL");
    CACHE_CHECK(left_pad || b->rows == 0, TQKV_EINVAL, "batch_align: left_pad is NULL");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_align: a prefill is in progress");
    int need = 0;
    for (int r = 0; r < b->rows; r++) {
        if (left_pad[r] < 0)
            return tqkv_fail(TQKV_EINVAL, "batch_align: left_pad[%d] = %d must be >= 0", r,
                             left_pad[r]);
        if ((long long)left_pad[r] + b->offset[r] > CACHE_MAX_COLUMNS)
            return tqkv_fail(TQKV_ERANGE, "batch_align: row %d would need %lld columns (limit %d)",
                             r, (long long)left_pad[r] + b->offset[r], CACHE_MAX_COLUMNS);
        if (left_pad[r] + b->offset[r] > need) need = left_pad[r] + b->offset[r];
    }
    int cap = need > b->cap ? need : b->cap;
    batch_store s;
    tqkv_status st = store_alloc(b, b->rows, cap, &s);
    if (st) return st;
    for (int r = 0; r < b->rows; r++) store_move_row(&s, r, left_pad[r], b, r);
    store_install(b, &s);
    return TQKV_OK;
}

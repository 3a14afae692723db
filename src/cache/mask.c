/*
 * mask.c - attention masks as per-(row, query) column ranges, leased once per forward.
 * Owns: struct tqkv_mask_lease (the last mask and its key), make_mask, to_dense.
 *   Query i of row r sits at column c = end - n_query + i, end = left_pad + offset.
 *   c < left_pad (a padding query): lo = hi = c (sees nothing).
 *   else lo = max(left_pad, window ? c - window + 1 : left_pad), hi = c + 1.
 * Must not: touch the cache's bytes or run attention.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Lease
// ---------------------------------------------------------------------------

tqkv_status tqkv_mask_lease_init(tqkv_mask_lease **out) {
    CACHE_CHECK(out, TQKV_EINVAL, "mask_lease_init: out is NULL");
    tqkv_mask_lease *l = calloc(1, sizeof *l);
    if (!l) return tqkv_fail(TQKV_ENOMEM, "out of memory allocating a mask lease");
    *out = l;
    return TQKV_OK;
}

void tqkv_mask_lease_free(tqkv_mask_lease *l) {
    if (!l) return;
    free(l->key_offset);
    free(l->key_pad);
    free(l->lo);
    free(l->hi);
    free(l);
}

int tqkv_mask_lease_builds(const tqkv_mask_lease *l) { return l ? l->builds : 0; }

static int lease_key_matches(const tqkv_mask_lease *l, const struct tqkv_batch *b, int n_query,
                             int window) {
    if (!l->valid || l->key_rows != b->rows || l->key_nq != n_query || l->key_window != window)
        return 0;
    if (b->rows == 0) return 1;
    return !memcmp(l->key_offset, b->offset, (size_t)b->rows * sizeof(int)) &&
           !memcmp(l->key_pad, b->left_pad, (size_t)b->rows * sizeof(int));
}

/* Fill lo/hi [rows, n_query] for the given per-row offsets and pads. */
static void mask_fill(int rows, const int *offset, const int *pad, int n_query, int window,
                      int32_t *lo, int32_t *hi) {
    for (int r = 0; r < rows; r++) {
        int end = pad[r] + offset[r];
        for (int i = 0; i < n_query; i++) {
            int c = end - n_query + i;
            size_t j = (size_t)r * n_query + i;
            if (c < pad[r]) {
                lo[j] = hi[j] = c;
                continue;
            }
            int l = pad[r];
            if (window > 0 && c - window + 1 > l) l = c - window + 1;
            lo[j] = l;
            hi[j] = c + 1;
        }
    }
}

tqkv_status tqkv_batch_make_mask(const tqkv_batch *b, tqkv_mask_lease *lease, int n_query,
                                 int window, const tqkv_mask **out) {
    CACHE_CHECK(b, TQKV_EINVAL, "make_mask: batch is NULL");
    CACHE_CHECK(lease, TQKV_EINVAL, "make_mask: lease is NULL");
    CACHE_CHECK(out, TQKV_EINVAL, "make_mask: out is NULL");
    CACHE_CHECK(n_query >= 1, TQKV_EINVAL, "make_mask: n_query must be >= 1, got %d", n_query);
    CACHE_CHECK(window >= 0, TQKV_EINVAL, "make_mask: window must be >= 0, got %d", window);
    for (int r = 0; r < b->rows; r++)
        if (n_query > b->left_pad[r] + b->offset[r])
            return tqkv_fail(TQKV_ERANGE, "make_mask: n_query = %d exceeds row %d's columns "
                             "(left_pad %d + offset %d)", n_query, r, b->left_pad[r],
                             b->offset[r]);
    if (n_query == 1 && window == 0 && batch_is_uniform(b)) {
        *out = NULL;
        return TQKV_OK;
    }
    if (lease_key_matches(lease, b, n_query, window)) {
        *out = &lease->mask;
        return TQKV_OK;
    }
    if ((long long)b->rows * n_query > (1LL << 30))
        return tqkv_fail(TQKV_ERANGE, "make_mask: rows x n_query = %lld too large",
                         (long long)b->rows * n_query);
    int entries = b->rows * n_query;
    /* allocate everything first: on failure the lease keeps its previous mask */
    int32_t *lo = lease->lo, *hi = lease->hi;
    int *ko = lease->key_offset, *kp = lease->key_pad;
    int grow_mask = entries > lease->alloc || !lo;
    int grow_key = b->rows > lease->key_alloc || !ko;
    if (grow_mask) {
        lo = malloc((size_t)(entries ? entries : 1) * sizeof *lo);
        hi = malloc((size_t)(entries ? entries : 1) * sizeof *hi);
    }
    if (grow_key) {
        ko = malloc((size_t)(b->rows ? b->rows : 1) * sizeof *ko);
        kp = malloc((size_t)(b->rows ? b->rows : 1) * sizeof *kp);
    }
    if (!lo || !hi || !ko || !kp) {
        if (grow_mask) { free(lo); free(hi); }
        if (grow_key) { free(ko); free(kp); }
        return tqkv_fail(TQKV_ENOMEM, "make_mask: out of memory (%d entries)", entries);
    }
    if (grow_mask) {
        free(lease->lo);
        free(lease->hi);
        lease->lo = lo;
        lease->hi = hi;
        lease->alloc = entries ? entries : 1;
    }
    if (grow_key) {
        free(lease->key_offset);
        free(lease->key_pad);
        lease->key_offset = ko;
        lease->key_pad = kp;
        lease->key_alloc = b->rows ? b->rows : 1;
    }
    mask_fill(b->rows, b->offset, b->left_pad, n_query, window, lease->lo, lease->hi);
    if (b->rows) {
        memcpy(lease->key_offset, b->offset, (size_t)b->rows * sizeof(int));
        memcpy(lease->key_pad, b->left_pad, (size_t)b->rows * sizeof(int));
    }
    lease->key_rows = b->rows;
    lease->key_nq = n_query;
    lease->key_window = window;
    lease->valid = 1;
    lease->builds++;
    lease->mask.rows = b->rows;
    lease->mask.n_query = n_query;
    lease->mask.window = window;
    lease->mask.lo = lease->lo;
    lease->mask.hi = lease->hi;
    *out = &lease->mask;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Dense form
// ---------------------------------------------------------------------------

tqkv_status tqkv_mask_to_dense(const tqkv_mask *m, int cols, float *out) {
    CACHE_CHECK(m, TQKV_EINVAL, "mask_to_dense: mask is NULL");
    CACHE_CHECK(m->rows >= 0 && m->n_query >= 0, TQKV_EINVAL,
                "mask_to_dense: bad mask shape rows=%d n_query=%d", m->rows, m->n_query);
    CACHE_CHECK(cols >= 0, TQKV_EINVAL, "mask_to_dense: cols must be >= 0, got %d", cols);
    size_t entries = (size_t)m->rows * (size_t)m->n_query;
    CACHE_CHECK(entries == 0 || (m->lo && m->hi), TQKV_EINVAL, "mask_to_dense: lo/hi is NULL");
    CACHE_CHECK(entries == 0 || cols == 0 || out, TQKV_EINVAL, "mask_to_dense: out is NULL");
    for (size_t j = 0; j < entries; j++)
        if (m->lo[j] < m->hi[j] && (m->lo[j] < 0 || m->hi[j] > cols))
            return tqkv_fail(TQKV_ERANGE, "mask_to_dense: range [%d, %d) of entry %zu exceeds "
                             "cols %d", (int)m->lo[j], (int)m->hi[j], j, cols);
    for (size_t j = 0; j < entries; j++) {
        float *o = out + j * (size_t)cols; // [rows, n_query, cols]
        for (int c = 0; c < cols; c++) o[c] = (c >= m->lo[j] && c < m->hi[j]) ? 0.0f : -INFINITY;
    }
    return TQKV_OK;
}

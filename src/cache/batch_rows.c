/*
 * batch_rows.c - row changes: merge, filter, extract, align.
 * Owns: moving rows between caches by copying encoded bytes (main planes column by
 * column, the q8 ring slot for slot, since slots are indexed by token, not column).
 * A call that builds new storage builds it completely, then installs it; the in-place
 * forms (filter with rows in order, append) first make every allocation they need and
 * then move bytes, which cannot fail: either way a failure leaves every object as it was.
 * Must not: decode, rotate or requantize anything.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"
#include "util/keep_order.h"

// ---------------------------------------------------------------------------
// Merge
// ---------------------------------------------------------------------------

static const struct tqkv_batch *ref_batch(const tqkv_cache_ref *it) {
    return it->batch ? it->batch : it->single->b;
}

/* The items' checks shared by merge and append: each sets exactly one of batch / single,
 * is in no spec round or prefill, and has the configuration of `ref` (NULL: of item 0,
 * returned in *first), which it may not be. Adds their rows to *rows and raises *maxlen to
 * their longest. `who` prefixes the messages. */
static tqkv_status items_check(const char *who, const struct tqkv_batch *ref,
                               const tqkv_cache_ref *items, int n_items,
                               const struct tqkv_batch **first, long long *rows, int *maxlen) {
    for (int i = 0; i < n_items; i++) {
        const tqkv_cache_ref *it = &items[i];
        if ((it->batch != NULL) == (it->single != NULL))
            return tqkv_fail(TQKV_EINVAL, "%s: item %d must set exactly one of batch and single",
                             who, i);
        if (it->single && !it->single->b)
            return tqkv_fail(TQKV_EINVAL, "%s: item %d is an invalid single cache", who, i);
        const struct tqkv_batch *ib = ref_batch(it);
        if (ref && ib == ref) return tqkv_fail(TQKV_EINVAL, "%s: item %d is the batch itself", who, i);
        if (ib->spec_active) return tqkv_fail(TQKV_ESTATE, "%s: item %d is in a spec round", who, i);
        if (ib->prefill_active) return tqkv_fail(TQKV_ESTATE, "%s: item %d is in a prefill", who, i);
        const struct tqkv_batch *cmp = ref ? ref : *first;
        char what[160];
        if (!cmp) *first = ib;
        else if (cache_config_diff(&cmp->cfg, &ib->cfg, what, sizeof what))
            return tqkv_fail(TQKV_EINVAL, "%s: item %d differs from %s: %s", who, i,
                             ref ? "the batch" : "item 0", what);
        *rows += ib->rows;
        for (int r = 0; r < ib->rows; r++)
            if (ib->offset[r] > *maxlen) *maxlen = ib->offset[r];
    }
    return TQKV_OK;
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
    tqkv_status st = items_check("batch_merge", NULL, items, n_items, &first, &rows, &maxlen);
    if (st) return st;
    if (rows > (1 << 24)) return tqkv_fail(TQKV_ERANGE, "batch_merge: too many rows (%lld)", rows);
    struct tqkv_batch *nb;
    st = batch_create(&nb, &first->cfg, 0, 0, 0);
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

static tqkv_status batch_resize_rows(struct tqkv_batch *b, int rows);

/* Move row rs of plane p to row rd <= rs, its tokens `shift` columns to the left (same
 * storage: every destination lies below every source still to be read). */
static void plane_move_row(struct tqkv_batch *b, tqkv_plane *p, int rs, int rd, int shift) {
    const size_t H = (size_t)b->cfg.kv_heads, cap = (size_t)b->cap, pay = p->codec.payload;
    const size_t nsc = (size_t)p->codec.n_scales, lp = (size_t)b->left_pad[rs];
    const size_t n = (size_t)b->offset[rs];
    for (size_t h = 0; h < H && n > 0; h++) {
        const size_t si = ((size_t)rs * H + h) * cap + lp, di = ((size_t)rd * H + h) * cap + lp - shift;
        memmove(p->data + di * pay, p->data + si * pay, n * pay);
        memmove(p->scales + di * nsc, p->scales + si * nsc, n * nsc * 2);
    }
    if (p->has_window && rs != rd) {
        const size_t per = H * (size_t)b->ring, dim = (size_t)b->cfg.head_dim;
        memmove(p->win_data + (size_t)rd * per * dim, p->win_data + (size_t)rs * per * dim, per * dim);
        memmove(p->win_scales + (size_t)rd * per * (dim / 32),
                p->win_scales + (size_t)rs * per * (dim / 32), per * (dim / 32) * 2);
    }
}

/* keep in an in-place order (keep_order.h: distinct, row i from row keep[i] >= i): compact
 * the rows in place, tokens moved left by the common pad; no allocation, cannot fail. The
 * storage keeps its room (rows_cap, cap) for the rows that join next. */
static void batch_filter_inplace(struct tqkv_batch *b, const int *keep, int n_keep) {
    int min_pad = 0;
    for (int i = 0; i < n_keep; i++)
        if (i == 0 || b->left_pad[keep[i]] < min_pad) min_pad = b->left_pad[keep[i]];
    for (int i = 0; i < n_keep; i++) {
        const int r = keep[i];
        plane_move_row(b, &b->k, r, i, min_pad);
        plane_move_row(b, &b->v, r, i, min_pad);
        b->offset[i] = b->offset[r];
        b->left_pad[i] = b->left_pad[r] - min_pad;
        b->win_lo[i] = b->win_lo[r];
        b->spec_base[i] = b->spec_base[r];
        b->prefill_pad[i] = b->prefill_pad[r];
    }
    b->rows = n_keep;
    b->ext_valid = 0; /* rows moved: the side buffer no longer matches them */
    /* most rows gone (a server going idle): give the room back, keeping a quarter spare */
    if (b->rows_cap > 2 * n_keep + 8) (void)batch_resize_rows(b, n_keep + n_keep / 4 + 4);
}

tqkv_status tqkv_batch_filter(tqkv_batch *b, const int *keep, int n_keep) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_filter: batch is NULL");
    CACHE_CHECK(n_keep >= 0, TQKV_EINVAL, "batch_filter: n_keep must be >= 0, got %d", n_keep);
    CACHE_CHECK(keep || n_keep == 0, TQKV_EINVAL, "batch_filter: keep is NULL");
    CACHE_CHECK(n_keep <= b->rows, TQKV_ERANGE,
                "batch_filter: n_keep = %d exceeds rows (%d) (indices must be distinct)", n_keep,
                b->rows);
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_filter: a prefill is in progress");
    if (keep_in_place(keep, n_keep, b->rows)) {
        batch_filter_inplace(b, keep, n_keep);
        return TQKV_OK;
    }
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
// Append (in place)
// ---------------------------------------------------------------------------

/* Storage for `rows` rows (>= b->rows), grown or shrunk by realloc: rows are the outer
 * dimension, so the held rows keep their bytes. Growing can fail (ENOMEM; an array already
 * grown stays grown, rows_cap is raised only once all have); shrinking cannot (a refused
 * shrink keeps the larger block). */
static tqkv_status batch_resize_rows(struct tqkv_batch *b, int rows) {
    const size_t H = (size_t)b->cfg.kv_heads, cap = (size_t)b->cap, dim = (size_t)b->cfg.head_dim;
    const size_t ring = (size_t)b->ring, R = (size_t)rows;
    const int grow = rows > b->rows_cap;
    int ok = 1;
#define RESIZE(ptr, row_bytes)                                                                  \
    do {                                                                                        \
        const size_t n_ = tqkv_mul(R, (row_bytes), &ok);                                        \
        void *q_ = ok ? realloc((ptr), n_ ? n_ : 1) : NULL;                                     \
        if (q_) (ptr) = q_;                                                                     \
        else if (grow) goto oom;                                                                \
    } while (0)
    RESIZE(b->k.data, H * cap * b->k.codec.payload);
    RESIZE(b->v.data, H * cap * b->v.codec.payload);
    RESIZE(b->k.scales, H * cap * 2 * (size_t)b->k.codec.n_scales);
    RESIZE(b->v.scales, H * cap * 2 * (size_t)b->v.codec.n_scales);
    if (b->k.has_window) {
        RESIZE(b->k.win_data, H * ring * dim);
        RESIZE(b->k.win_scales, H * ring * 2 * (dim / 32));
    }
    if (b->v.has_window) {
        RESIZE(b->v.win_data, H * ring * dim);
        RESIZE(b->v.win_scales, H * ring * 2 * (dim / 32));
    }
    RESIZE(b->offset, sizeof(int));
    RESIZE(b->left_pad, sizeof(int));
    RESIZE(b->win_lo, sizeof(int));
    RESIZE(b->prefill_pad, sizeof(int));
    RESIZE(b->spec_base, sizeof(int));
#undef RESIZE
    b->rows_cap = rows;
    return TQKV_OK;
oom:
    return tqkv_fail(TQKV_ENOMEM, "out of memory growing cache storage to %d rows x %d heads x "
                     "%d columns", rows, b->cfg.kv_heads, b->cap);
}

/* Rows the items add, the longest of them, and whether they can join b (the checks of
 * tqkv_batch_merge, b as item 0). */
static tqkv_status append_check(const struct tqkv_batch *b, const tqkv_cache_ref *items,
                                int n_items, long long *rows, int *maxlen) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_append_rows: batch is NULL");
    CACHE_CHECK(items || n_items == 0, TQKV_EINVAL, "batch_append_rows: items is NULL");
    CACHE_CHECK(n_items >= 0, TQKV_EINVAL, "batch_append_rows: n_items must be >= 0, got %d", n_items);
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE, "batch_append_rows: the batch is in a spec round");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "batch_append_rows: the batch is in a prefill");
    *rows = b->rows;
    *maxlen = 0;
    const struct tqkv_batch *first = NULL;
    tqkv_status st = items_check("batch_append_rows", b, items, n_items, &first, rows, maxlen);
    if (st) return st;
    if (*rows > (1 << 24)) return tqkv_fail(TQKV_ERANGE, "batch_append_rows: too many rows (%lld)", *rows);
    return TQKV_OK;
}

/* The column a joining row of n tokens ends at: the batch's last end column when it fits
 * (rows end together, as tqkv_batch_merge lays them out), else n (left_pad 0). */
static int append_end(const struct tqkv_batch *b, int n) {
    int end = 0;
    for (int r = 0; r < b->rows; r++)
        if (b->left_pad[r] + b->offset[r] > end) end = b->left_pad[r] + b->offset[r];
    return n <= end ? end : n;
}

tqkv_status tqkv_batch_append_rows_reserve(tqkv_batch *b, const tqkv_cache_ref *items, int n_items) {
    long long rows = 0;
    int maxlen = 0;
    tqkv_status st = append_check(b, items, n_items, &rows, &maxlen);
    if (st) return st;
    const int need = append_end(b, maxlen);
    if (need > b->cap && (st = batch_reserve(b, need))) return st;
    if (rows > b->rows_cap) { /* a quarter spare: rows join and leave all the time */
        long long want = (long long)b->rows_cap + b->rows_cap / 4 + 4;
        if (want < rows) want = rows;
        if (want > (1 << 24)) want = rows;
        if ((st = batch_resize_rows(b, (int)want))) return st;
    }
    return TQKV_OK;
}

tqkv_status tqkv_batch_append_rows(tqkv_batch *b, const tqkv_cache_ref *items, int n_items) {
    tqkv_status st = tqkv_batch_append_rows_reserve(b, items, n_items);
    if (st) return st;
    const size_t H = (size_t)b->cfg.kv_heads, cap = (size_t)b->cap;
    const int end = append_end(b, 0);
    for (int i = 0; i < n_items; i++) {
        const struct tqkv_batch *ib = ref_batch(&items[i]);
        for (int r = 0; r < ib->rows; r++) {
            const int dr = b->rows, n = ib->offset[r], pad = (n <= end ? end : n) - n;
            /* the new row's columns start as zeros, as in storage made by store_alloc */
            memset(b->k.data + (size_t)dr * H * cap * b->k.codec.payload, 0, H * cap * b->k.codec.payload);
            memset(b->v.data + (size_t)dr * H * cap * b->v.codec.payload, 0, H * cap * b->v.codec.payload);
            memset(b->k.scales + (size_t)dr * H * cap * b->k.codec.n_scales, 0, H * cap * 2 * b->k.codec.n_scales);
            memset(b->v.scales + (size_t)dr * H * cap * b->v.codec.n_scales, 0, H * cap * 2 * b->v.codec.n_scales);
            copy_plane_row(ib, &ib->k, r, ib->left_pad[r], b->k.data, b->k.scales, b->k.win_data,
                           b->k.win_scales, b->cap, dr, pad, n);
            copy_plane_row(ib, &ib->v, r, ib->left_pad[r], b->v.data, b->v.scales, b->v.win_data,
                           b->v.win_scales, b->cap, dr, pad, n);
            b->offset[dr] = n;
            b->left_pad[dr] = pad;
            b->win_lo[dr] = ib->win_lo[r];
            b->spec_base[dr] = ib->spec_base[r];
            b->prefill_pad[dr] = ib->prefill_pad[r];
            b->rows++;
        }
    }
    b->ext_valid = 0;
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

/*
 * batch_spec.c - batched prefill (left-padded and right-padded) and speculative rounds.
 * Owns: the prefill_* and spec_* fields of struct tqkv_batch and their state machine:
 *   idle --prepare_prefill--> prefill --append(n == max)--> prefill(appended)
 *        --finalize_prefill--> idle
 *   idle --spec_begin--> spec --append*--> spec --commit | rollback--> idle
 * Prefill and spec rounds exclude each other. Cutting rows back (rollback, prefill ends)
 * only lowers offsets: stored bytes stay, and tokens whose q8 copy is still in the ring
 * (t >= win_lo) are read from it again, so a cut by <= window_slack is exact.
 * Must not: encode, decode or move stored bytes.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Prefill
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_prepare_prefill(tqkv_batch *b, const int *lengths) {
    CACHE_CHECK(b, TQKV_EINVAL, "prepare_prefill: batch is NULL");
    CACHE_CHECK(lengths || b->rows == 0, TQKV_EINVAL, "prepare_prefill: lengths is NULL");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE,
                "prepare_prefill: a prefill is already in progress");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE, "prepare_prefill: a spec round is active");
    int mx = 0;
    for (int r = 0; r < b->rows; r++) {
        if (b->offset[r] != 0)
            return tqkv_fail(TQKV_ESTATE, "prepare_prefill: row %d is not empty (%d tokens)", r,
                             b->offset[r]);
        if (lengths[r] < 1)
            return tqkv_fail(TQKV_EINVAL, "prepare_prefill: lengths[%d] must be >= 1, got %d", r,
                             lengths[r]);
        if (lengths[r] > CACHE_MAX_COLUMNS)
            return tqkv_fail(TQKV_ERANGE, "prepare_prefill: lengths[%d] = %d exceeds %d", r,
                             lengths[r], CACHE_MAX_COLUMNS);
        if (lengths[r] > mx) mx = lengths[r];
    }
    /* room for the prefill append now (keeps cap >= every row's end column) */
    tqkv_status st = batch_reserve(b, mx);
    if (st) return st;
    for (int r = 0; r < b->rows; r++) {
        b->prefill_pad[r] = mx - lengths[r];
        b->left_pad[r] = mx - lengths[r];
        b->win_lo[r] = 0;
    }
    b->prefill_n = mx;
    b->prefill_active = 1;
    b->prefill_appended = 0;
    return TQKV_OK;
}

tqkv_status tqkv_batch_finalize_prefill(tqkv_batch *b) {
    CACHE_CHECK(b, TQKV_EINVAL, "finalize_prefill: batch is NULL");
    CACHE_CHECK(b->prefill_active, TQKV_ESTATE, "finalize_prefill: no prefill in progress");
    CACHE_CHECK(b->prefill_appended || b->rows == 0, TQKV_ESTATE,
                "finalize_prefill: the prefill append (n == %d) has not happened", b->prefill_n);
    b->prefill_active = 0;
    b->prefill_appended = 0;
    b->prefill_n = 0;
    for (int r = 0; r < b->rows; r++) b->prefill_pad[r] = 0;
    return TQKV_OK;
}

/* Right-padded prefill: every row appended the same n tokens, the tail of the shorter
 * ones being padding; cut each row back to ends[r]. Like trim, not allowed during a
 * left-padded prefill or a spec round. */
tqkv_status tqkv_batch_restore_prefill_ends(tqkv_batch *b, const int *ends) {
    CACHE_CHECK(b, TQKV_EINVAL, "restore_prefill_ends: batch is NULL");
    CACHE_CHECK(ends || b->rows == 0, TQKV_EINVAL, "restore_prefill_ends: ends is NULL");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE,
                "restore_prefill_ends: a left-padded prefill is in progress");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE, "restore_prefill_ends: a spec round is active");
    for (int r = 0; r < b->rows; r++)
        if (ends[r] < 0 || ends[r] > b->offset[r])
            return tqkv_fail(TQKV_ERANGE, "restore_prefill_ends: ends[%d] = %d not in [0, %d]", r,
                             ends[r], b->offset[r]);
    for (int r = 0; r < b->rows; r++) b->offset[r] = ends[r];
    batch_clamp_win_lo(b);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Speculative rounds
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_spec_begin(tqkv_batch *b) {
    CACHE_CHECK(b, TQKV_EINVAL, "spec_begin: batch is NULL");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE, "spec_begin: a spec round is already active");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE, "spec_begin: a prefill is in progress");
    for (int r = 0; r < b->rows; r++) b->spec_base[r] = b->offset[r];
    b->spec_active = 1;
    return TQKV_OK;
}

tqkv_status tqkv_batch_spec_commit(tqkv_batch *b) {
    CACHE_CHECK(b, TQKV_EINVAL, "spec_commit: batch is NULL");
    CACHE_CHECK(b->spec_active, TQKV_ESTATE, "spec_commit: no spec round is active");
    b->spec_active = 0;
    return TQKV_OK;
}

/* keep[r]: tokens of this round row r keeps (0 <= keep <= appended since begin). */
tqkv_status tqkv_batch_spec_rollback(tqkv_batch *b, const int *keep, int n_keep) {
    CACHE_CHECK(b, TQKV_EINVAL, "spec_rollback: batch is NULL");
    CACHE_CHECK(b->spec_active, TQKV_ESTATE, "spec_rollback: no spec round is active "
                "(call spec_begin first)");
    CACHE_CHECK(keep, TQKV_EINVAL, "spec_rollback: keep is NULL");
    CACHE_CHECK(n_keep == 1 || n_keep == b->rows, TQKV_EINVAL,
                "spec_rollback: n_keep must be 1 or rows (%d), got %d", b->rows, n_keep);
    for (int r = 0; r < b->rows; r++) {
        int k = keep[n_keep == 1 ? 0 : r];
        int appended = b->offset[r] - b->spec_base[r];
        if (k < 0 || k > appended)
            return tqkv_fail(TQKV_ERANGE,
                             "spec_rollback: keep[%d] = %d not in [0, %d] (tokens appended to "
                             "row %d since spec_begin)", r, k, appended, r);
    }
    for (int r = 0; r < b->rows; r++) b->offset[r] = b->spec_base[r] + keep[n_keep == 1 ? 0 : r];
    batch_clamp_win_lo(b);
    b->spec_active = 0;
    return TQKV_OK;
}

int tqkv_batch_spec_active(const tqkv_batch *b) { return b ? b->spec_active : 0; }

/*
 * rows_impl.h - rows.c's building blocks for states that change several host states in
 *   lockstep (the tensor-parallel ranks: tp/tp_rows.c). Each row operation is split into a
 *   fallible part that changes no row of the state, and an infallible part that installs,
 *   so that a caller can run the first on every rank before the second on any.
 * Must not: be used on device states (their rows live in the device twin).
 */
#ifndef TQKV_ROWS_IMPL_H
#define TQKV_ROWS_IMPL_H

#include "model/model_impl.h"
#include "model/state/recurrent.h"

/* What an in-place merge made before it moves rows: the per-row arrays [rows], the merged
 * recurrent rows (NULL without), the item list of tqkv_batch_append_rows [n_src]. */
typedef struct {
    int             *off, *len;
    model_recurrent *rec;
    tqkv_cache_ref  *it;
} rows_prep;

/* off / len of a state of `rows` rows (calloc'd). On failure both NULL. */
tqkv_status rows_arrays_alloc(int rows, int **off, int **len);
/* New layers, recurrent rows (NULL: unchanged), row count and arrays into s; cannot fail,
 * takes ownership of all. */
void        rows_install(tqkv_model_state *s, tqkv_batch **layers, model_recurrent *rec,
                         int rows, int *off, int *len);
/* New layers and recurrent rows holding rows keep[0..n) of s (s unchanged). */
tqkv_status rows_select_all(const tqkv_model_state *s, const int *keep, int n,
                            tqkv_batch ***layers, model_recurrent **rec);
/* In-place filter with an increasing keep: cannot fail on a state without recurrent rows. */
tqkv_status rows_filter_inplace(tqkv_model_state *s, const int *keep, int n);
/* In-place merge of src[0..n_src) after s's rows, to `rows` rows: reserve (fallible; room
 * in the layers changes no row), then apply (cannot fail; consumes pr). */
tqkv_status rows_merge_reserve(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                               int rows, rows_prep *pr);
void        rows_merge_apply(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                             int rows, rows_prep *pr);
void        rows_prep_free(rows_prep *pr);
/* Spec rounds of a checked host state: begin (fallible: memory; on failure no round is
 * open), the validation of a rollback's keep (changes nothing), the rollback of a validated
 * keep and the commit (cannot fail). */
tqkv_status rows_spec_begin_host(tqkv_model_state *s);
tqkv_status rows_spec_rollback_check(const tqkv_model_state *s, const int *keep, int n_keep);
void        rows_spec_rollback_host(tqkv_model_state *s, const int *keep, int n_keep);
void        rows_spec_commit_host(tqkv_model_state *s);

#endif

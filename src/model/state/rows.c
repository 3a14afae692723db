/*
 * rows.c - row operations on a model state, across all layers at once: merge
 * (add rows: newcomers prefilled as their own state, then their encoded bytes copied in),
 * filter (remove rows), extract one row (prompt reuse, export), spec rounds (begin,
 * commit, rollback to a per-row keep), consistency checks, byte projections, and the
 * state export format used by the engine's prompt cache.
 * Owns: the rule that every layer changes or none does: each operation first builds or
 * validates every layer (and the recurrent rows), then installs all of them; host states'
 * merge and in-order filter change the layers in place, every allocation first.
 * Must not: run the graph (arch/<name>/graph.c), schedule requests (src/engine), name an
 *   architecture.
 * Device states (s->gpu): every operation goes to the device twin (model_cuda.h) after the
 * same argument checks; export / import share this file's format and validation.
 * Tensor-parallel states (s->tp): after the same checks every operation goes to
 * tp/tp_rows.c, which applies it to every rank's state in lockstep with the halves below
 * (rows_impl.h); their export is the ranks' exports under a sharded header.
 *
 * Layer kinds (the architecture's, arch.h: model_layer_kind_of):
 *   KV        a tqkv_batch of K/V rows whose offsets are the rows' positions;
 *   SLIDING   a bounded cache: after each forward outside a spec round, and when a spec
 *             round begins, it keeps the newest ops->sliding_keep tokens (window +
 *             window_slack), so it holds min(position, keep) <= offset <= position tokens
 *             per row (more only between a spec round's end and the next forward or round);
 *   SHARED    NULL, reads its donor's cache (the donor moves);
 *   RECURRENT NULL; the state's recurrent rows (s->rec, one block for all recurrent
 *             layers) move with the KV rows in every operation.
 * Positions come from the position layer (ops->position_layer, else the first layer with KV
 * rows); without any KV layer, from the recurrent rows' token counts.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/batch.h" /* spec_base for validation (read only) */
#include "model/arch/arch.h"
#include "model/model_impl.h"
#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif
#include "model/state/recurrent.h"
#include "util/keep_order.h"
#include "model/state/rows_impl.h"
#include "model/tp/tp_state.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Per-layer dispatch: each layer's kind comes from the architecture (arch.h)
// ---------------------------------------------------------------------------

static model_layer_kind rows_layer_kind_of(const tqkv_model *m, int l) {
    return (model_layer_kind)model_layer_kind_of(m, l);
}

static int has_kv(model_layer_kind k) { return k == MODEL_LAYER_KV || k == MODEL_LAYER_SLIDING; }

/* Tokens a bounded sliding layer keeps after a forward (0: the graph has none). */
static int sliding_keep(const tqkv_model_state *s) {
    return s->m->ops->sliding_keep ? s->m->ops->sliding_keep(s->m, &s->p) : 0;
}

/* The layer whose offsets are the rows' positions, or -1 (no KV layer: rec tokens). */
static int position_layer(const tqkv_model_state *s) {
    if (s->m->ops->position_layer) return s->m->ops->position_layer(s->m);
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (has_kv(rows_layer_kind_of(s->m, l))) return l;
    return -1;
}

tqkv_status model_state_positions(const tqkv_model_state *s, int *pos) {
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_offsets(s->gpu, pos);
#endif
    if (s->tp && s->tp->on_device) return model_state_positions(s->tp->rank[0], pos);
    const int pl = position_layer(s);
    if (pl < 0) {
        if (!s->rec) return tqkv_fail(TQKV_ESTATE, "state: no layer holds the rows' positions");
        memcpy(pos, s->rec->tokens, sizeof(int) * (size_t)s->rows);
        return TQKV_OK;
    }
    if (!s->layers[pl] || tqkv_batch_rows(s->layers[pl]) != s->rows)
        return tqkv_fail(TQKV_ESTATE, "state: layer %d holds %d rows, the state %d", pl,
                         s->layers[pl] ? tqkv_batch_rows(s->layers[pl]) : 0, s->rows);
    return tqkv_batch_offsets(s->layers[pl], pos, NULL);
}

/* New layer l holding the rows keep[0..n) of s (s unchanged); NULL for layers without KV. */
static tqkv_status rows_layer_select(const tqkv_model_state *s, int l, const int *keep, int n,
                                     tqkv_batch **out) {
    switch (rows_layer_kind_of(s->m, l)) {
    case MODEL_LAYER_KV:
    case MODEL_LAYER_SLIDING: return tqkv_batch_select(s->layers[l], keep, n, out);
    case MODEL_LAYER_SHARED:
    case MODEL_LAYER_RECURRENT: *out = NULL; return TQKV_OK;
    }
    return tqkv_fail(TQKV_EUNSUPPORTED, "state rows: unknown layer kind");
}

/* New layer l = rows of s then rows of src[0..n_src) (all unchanged). A sliding layer's rows
 * keep their own (bounded) lengths: the merge right-aligns each layer on its own. */
static tqkv_status rows_layer_merge(const tqkv_model_state *s, tqkv_model_state *const *src,
                                    int n_src, int l, tqkv_batch **out) {
    switch (rows_layer_kind_of(s->m, l)) {
    case MODEL_LAYER_KV:
    case MODEL_LAYER_SLIDING: {
        tqkv_cache_ref *it = calloc((size_t)n_src + 1, sizeof *it);
        if (!it) return tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
        it[0].batch = s->layers[l];
        for (int i = 0; i < n_src; i++) it[i + 1].batch = src[i]->layers[l];
        tqkv_status rc = tqkv_batch_merge(out, it, n_src + 1);
        free(it);
        return rc;
    }
    case MODEL_LAYER_SHARED:
    case MODEL_LAYER_RECURRENT: *out = NULL; return TQKV_OK;
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

/* The per-row arrays of a state of `rows` rows (off, len): the fallible half of an
 * install, so that callers changing several states (tensor-parallel ranks) can make every
 * allocation before they change any state. */
tqkv_status rows_arrays_alloc(int rows, int **off, int **len) {
    *off = calloc((size_t)(rows ? rows : 1), sizeof(int));
    *len = calloc((size_t)(rows ? rows : 1), sizeof(int));
    if (*off && *len) return TQKV_OK;
    free(*off);
    free(*len);
    *off = *len = NULL;
    return tqkv_fail(TQKV_ENOMEM, "state rows: out of memory");
}

/* Install new layers, new recurrent rows (rec: NULL when the graph has none), the per-row
 * arrays (rows_arrays_alloc) and a new row count; cannot fail, takes ownership of all. */
void rows_install(tqkv_model_state *s, tqkv_batch **layers, model_recurrent *rec, int rows,
                  int *off, int *len) {
    free_batches(s->layers, s->m->cfg.n_layers);
    free(s->off);
    free(s->len);
    s->layers = layers;
    if (rec) {
        rec_free(s->rec);
        s->rec = rec;
    }
    s->off = off;
    s->len = len;
    if (rows != s->rows) s->cap_rn = 0; /* row-shaped scratch is re-sized on next use */
    s->rows = rows;
    s->p.rows = rows;
}

/* rows_arrays_alloc then rows_install. Takes ownership of layers and rec, also on failure. */
static tqkv_status install_layers(tqkv_model_state *s, tqkv_batch **layers, model_recurrent *rec,
                                  int rows) {
    int *off = NULL, *len = NULL;
    tqkv_status rc = rows_arrays_alloc(rows, &off, &len);
    if (rc != TQKV_OK) {
        free_batches(layers, s->m->cfg.n_layers);
        rec_free(rec);
        return rc;
    }
    rows_install(s, layers, rec, rows, off, len);
    return TQKV_OK;
}

static int same_cache_params(const tqkv_model_state *a, const tqkv_model_state *b) {
    return a->p.k_format == b->p.k_format && a->p.v_format == b->p.v_format &&
           a->p.window == b->p.window && a->p.window_slack == b->p.window_slack &&
           a->p.window_keys_only == b->p.window_keys_only &&
           a->p.kv_seed == b->p.kv_seed && a->p.device == b->p.device &&
           !memcmp(a->p.layer_k, b->p.layer_k, sizeof a->p.layer_k) &&
           !memcmp(a->p.layer_v, b->p.layer_v, sizeof a->p.layer_v);
}

/* Device states (params.device = 1): the caches live in the device twin (s->gpu); the host
 * layers stay empty batches with the same rows, reshaped alongside, and never enter a spec
 * round (the device twin holds the round). Row operations build the device caches first
 * (the step that can run out of memory), then the host layers. Export / import use the
 * host format (f32 KV excepted: the device holds it as dense bf16, which has none). */
static int spec_active_of(const tqkv_model_state *s) {
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_spec_active(s->gpu);
#endif
    if (s->tp && s->tp->on_device) return spec_active_of(s->tp->rank[0]); /* its twin's */
    int pl = position_layer(s);
    if (pl >= 0) return tqkv_batch_spec_active(s->layers[pl]);
    return s->rec ? s->rec->spec_active : 0;
}

// ---------------------------------------------------------------------------
// Checks and projections
// ---------------------------------------------------------------------------

tqkv_status tqkv_model_state_check(const tqkv_model_state *s) {
    if (!s) return tqkv_fail(TQKV_EINVAL, "state check: NULL state");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_check(s->gpu);
#endif
    if (s->tp && s->tp->on_device) return model_tp_check_device(s); /* tp/tp_state.c */
    const tqkv_model *m = s->m;
    const int L = m->cfg.n_layers, R = s->rows, pl = position_layer(s);
    if (!s->layers) return tqkv_fail(TQKV_ESTATE, "state: no layers");
    if (pl >= 0 && !s->layers[pl])
        return tqkv_fail(TQKV_ESTATE, "state: position layer %d has no cache", pl);
    if (m->cfg.n_linear > 0 && !s->rec && !s->tp) /* sharded: the ranks' (checked below) */
        return tqkv_fail(TQKV_ESTATE, "state: hybrid graph without recurrent rows");
    if (pl < 0 && !s->rec) return tqkv_fail(TQKV_ESTATE, "state: no layer holds rows");
    int *o0 = malloc(sizeof(int) * (size_t)(R ? 2 * R : 2)), *o1 = malloc(sizeof(int) * (size_t)(R ? 2 * R : 2));
    if (!o0 || !o1) {
        free(o0);
        free(o1);
        return tqkv_fail(TQKV_ENOMEM, "state check: out of memory");
    }
    tqkv_status rc = TQKV_OK;
    const int spec0 = spec_active_of(s), keep = sliding_keep(s);
    if (pl >= 0) {
        if (tqkv_batch_rows(s->layers[pl]) != R)
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d cache holds %d rows, the state %d", pl,
                           tqkv_batch_rows(s->layers[pl]), R);
        else rc = tqkv_batch_offsets(s->layers[pl], o0, o0 + R);
    } else {
        if (s->rec->rows != R)
            rc = tqkv_fail(TQKV_ESTATE, "state: recurrent rows hold %d rows, the state %d",
                           s->rec->rows, R);
        else memcpy(o0, s->rec->tokens, sizeof(int) * (size_t)R);
    }
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        model_layer_kind k = rows_layer_kind_of(m, l);
        const tqkv_batch *b = s->layers[l];
        if (!has_kv(k)) {
            if (b) rc = tqkv_fail(TQKV_ESTATE, "state: layer %d (%s) holds a cache", l,
                                  k == MODEL_LAYER_SHARED ? "KV-shared" : "recurrent");
            else if (k == MODEL_LAYER_SHARED && !s->layers[model_layer_donor(m, l)])
                rc = tqkv_fail(TQKV_ESTATE, "state: layer %d's donor %d has no cache", l,
                               model_layer_donor(m, l));
            continue;
        }
        if (!b) {
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d has no cache", l);
            break;
        }
        if (tqkv_batch_rows(b) != R) {
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d cache holds %d rows, the state %d", l,
                           tqkv_batch_rows(b), R);
            break;
        }
        if (tqkv_batch_spec_active(b) != spec0) {
            rc = tqkv_fail(TQKV_ESTATE, "state: layer %d %s in a spec round, the position layer "
                           "%s", l, spec0 ? "is not" : "is", spec0 ? "is" : "is not");
            break;
        }
        if (l == pl) continue;
        if ((rc = tqkv_batch_offsets(b, o1, o1 + R)) != TQKV_OK) break;
        for (int r = 0; r < R; r++) {
            if (k == MODEL_LAYER_KV && o1[r] != o0[r]) {
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d holds %d tokens in layer %d but %d in "
                               "the position layer %d", r, o1[r], l, o0[r], pl);
                break;
            }
            int lo = o0[r] < keep ? o0[r] : keep;
            if (k == MODEL_LAYER_SLIDING && (o1[r] > o0[r] || o1[r] < lo)) {
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d holds %d tokens in sliding layer %d, "
                               "expected %d..%d (position %d, window + slack %d)", r, o1[r], l,
                               lo, o0[r], o0[r], keep);
                break;
            }
        }
    }
    if (rc == TQKV_OK && s->tp) rc = model_tp_check_ranks(s, o0, spec0);
    if (rc == TQKV_OK && s->rec) {
        const model_recurrent *q = s->rec;
        if (q->rows != R)
            rc = tqkv_fail(TQKV_ESTATE, "state: recurrent rows hold %d rows, the state %d",
                           q->rows, R);
        else if (q->broken)
            rc = tqkv_fail(TQKV_ESTATE, "state: a forward failed midway and left the recurrent "
                           "rows inconsistent; reset the state");
        else if (q->spec_active != spec0)
            rc = tqkv_fail(TQKV_ESTATE, "state: spec round open on the %s but not on the %s",
                           q->spec_active ? "recurrent rows" : "KV rows",
                           q->spec_active ? "KV rows" : "recurrent rows");
        for (int r = 0; r < R && rc == TQKV_OK; r++)
            if (q->tokens[r] != o0[r])
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d: recurrent rows absorbed %d tokens, "
                               "its KV rows hold %d", r, q->tokens[r], o0[r]);
    }
    free(o0);
    free(o1);
    return rc;
}

/* Sliding layers are bounded by window + slack; recurrent rows are a fixed per-row cost
 * (tqkv_model_state_row_fixed_bytes), included here so admission needs one call. */
size_t tqkv_model_state_projected_bytes_spec(const tqkv_model_state *s, int tokens,
                                             int draft_tokens) {
    if (!s || tokens <= 0 || draft_tokens < 0) return 0;
    const int round = draft_tokens ? draft_tokens + 1 : 0; /* held between a round's end and
                                                               the next forward */
#ifdef TQKV_HAVE_CUDA
    if (s->gpu)
        return model_cuda_projected_bytes(s->gpu, tokens, round) + model_cuda_row_fixed_bytes(s->gpu);
#endif
    size_t b = 0;
    if (s->tp) { /* every rank's share */
        for (int r = 0; r < s->tp->n; r++)
            b += tqkv_model_state_projected_bytes_spec(s->tp->rank[r], tokens, draft_tokens);
        return b;
    }
    const int keep = sliding_keep(s) + round;
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        model_layer_kind k = rows_layer_kind_of(s->m, l);
        if (!has_kv(k) || !s->layers[l]) continue;
        int t = k == MODEL_LAYER_SLIDING && tokens > keep ? keep : tokens;
        b += tqkv_batch_projected_bytes(s->layers[l], t);
    }
    return b + tqkv_model_state_row_fixed_bytes(s);
}

size_t tqkv_model_state_projected_bytes(const tqkv_model_state *s, int tokens) {
    return tqkv_model_state_projected_bytes_spec(s, tokens, 0);
}

/* A row can be trimmed back to a prefix with fresh-prefill bytes only when every layer
 * still holds that prefix: a sliding layer that dropped tokens, or recurrent rows (which
 * cannot be trimmed at all), leave no shorter reusable prefix: the value is then above
 * the row's length (sliding drop) or the length itself (recurrent: only the whole row).
 * The engine's prefix cache never trims: it stores states taken at the prefix length. */
int tqkv_model_state_min_reusable_offset(const tqkv_model_state *s, int row) {
    if (!s || row < 0 || row >= s->rows) return 0;
    if (s->tp && s->tp->on_device) return tqkv_model_state_min_reusable_offset(s->tp->rank[0], row);
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) { /* conservative: only the whole row */
        int *o = malloc(sizeof(int) * (size_t)s->rows), pos = 1 << 30;
        if (o && model_cuda_offsets(s->gpu, o) == TQKV_OK) pos = o[row];
        free(o);
        return pos;
    }
#endif
    int pl = position_layer(s);
    int pos = 0;
    if (pl >= 0) {
        int *o = malloc(sizeof(int) * (size_t)s->rows);
        if (!o || tqkv_batch_offsets(s->layers[pl], o, NULL) != TQKV_OK) {
            free(o);
            return 1 << 30; /* unknown: nothing reusable */
        }
        pos = o[row];
        free(o);
    } else if (s->rec) {
        pos = s->rec->tokens[row];
    }
    int mx = 0;
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        model_layer_kind k = rows_layer_kind_of(s->m, l);
        if (!has_kv(k) || !s->layers[l]) continue;
        if (k == MODEL_LAYER_SLIDING) {
            int *o = malloc(sizeof(int) * (size_t)s->rows);
            int held = -1;
            if (o && tqkv_batch_offsets(s->layers[l], o, NULL) == TQKV_OK) held = o[row];
            free(o);
            if (held != pos) return pos + 1; /* dropped tokens: no prefix is reusable */
        }
        int v = tqkv_batch_min_reusable_offset(s->layers[l], row);
        if (v > mx) mx = v;
    }
    if (s->rec && pos > mx) mx = pos;
    return mx;
}

int tqkv_model_context_len(const tqkv_model *m) {
    return m ? m->cfg.max_position_embeddings : 0;
}

// ---------------------------------------------------------------------------
// Merge / filter / extract
// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// In place (host states): the running batch of a server changes rows every few steps,
// so its KV layers are compacted and appended where they are instead of rebuilt (no
// second copy of every row, no fresh pages to fault in). Same every-layer-or-none rule:
// every allocation first (the recurrent rows' new block, the append's room in each layer,
// the per-row arrays), then the byte moves, which cannot fail.
// ---------------------------------------------------------------------------

static void set_rows(tqkv_model_state *s, int rows) {
    if (rows != s->rows) s->cap_rn = 0; /* row-shaped scratch is re-sized on next use */
    s->rows = rows;
    s->p.rows = rows;
}

tqkv_status rows_filter_inplace(tqkv_model_state *s, const int *keep, int n) {
    model_recurrent *nr = NULL;
    tqkv_status rc = s->rec ? rec_select(s->rec, keep, n, &nr) : TQKV_OK;
    for (int l = 0; rc == TQKV_OK && l < s->m->cfg.n_layers; l++)
        if (has_kv(rows_layer_kind_of(s->m, l))) rc = tqkv_batch_filter(s->layers[l], keep, n);
    if (rc != TQKV_OK) { /* only rec_select can fail (before any layer moved) */
        rec_free(nr);
        return rc;
    }
    if (nr) {
        rec_free(s->rec);
        s->rec = nr;
    }
    set_rows(s, n);
    return TQKV_OK;
}

/* The fallible half of an in-place merge: the new per-row arrays and recurrent rows, and
 * room for the sources' rows in every layer (room alone changes no row). On failure
 * nothing is held and every layer holds its rows as before. */
tqkv_status rows_merge_reserve(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                               int rows, rows_prep *pr) {
    const int L = s->m->cfg.n_layers;
    memset(pr, 0, sizeof *pr);
    pr->it = calloc((size_t)n_src, sizeof *pr->it);
    model_recurrent **items = s->rec ? calloc((size_t)n_src + 1, sizeof *items) : NULL;
    tqkv_status rc = pr->it && (items || !s->rec)
                         ? rows_arrays_alloc(rows, &pr->off, &pr->len)
                         : tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
    if (rc == TQKV_OK && s->rec) {
        items[0] = s->rec;
        for (int i = 0; i < n_src; i++) items[i + 1] = src[i]->rec;
        rc = rec_concat(&pr->rec, items, n_src + 1);
    }
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        if (!has_kv(rows_layer_kind_of(s->m, l))) continue;
        for (int i = 0; i < n_src; i++) pr->it[i].batch = src[i]->layers[l];
        rc = tqkv_batch_append_rows_reserve(s->layers[l], pr->it, n_src);
    }
    free(items);
    if (rc != TQKV_OK) rows_prep_free(pr);
    return rc;
}

void rows_prep_free(rows_prep *pr) {
    free(pr->off);
    free(pr->len);
    free(pr->it);
    rec_free(pr->rec);
    memset(pr, 0, sizeof *pr);
}

/* The other half: the rows moved in (tqkv_batch_append_rows cannot fail after
 * rows_merge_reserve with the same sources), the arrays and recurrent rows installed; pr
 * is consumed. */
void rows_merge_apply(tqkv_model_state *s, tqkv_model_state *const *src, int n_src, int rows,
                      rows_prep *pr) {
    for (int l = 0; l < s->m->cfg.n_layers; l++) {
        if (!has_kv(rows_layer_kind_of(s->m, l))) continue;
        for (int i = 0; i < n_src; i++) pr->it[i].batch = src[i]->layers[l];
        tqkv_batch_append_rows(s->layers[l], pr->it, n_src);
    }
    free(s->off);
    free(s->len);
    s->off = pr->off;
    s->len = pr->len;
    if (pr->rec) {
        rec_free(s->rec);
        s->rec = pr->rec;
    }
    free(pr->it);
    memset(pr, 0, sizeof *pr);
    set_rows(s, rows);
}

static tqkv_status merge_inplace(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                                 int rows) {
    rows_prep pr;
    tqkv_status rc = rows_merge_reserve(s, src, n_src, rows, &pr);
    if (rc == TQKV_OK) rows_merge_apply(s, src, n_src, rows, &pr);
    return rc;
}

tqkv_status tqkv_model_state_merge(tqkv_model_state *s, tqkv_model_state *const *src, int n_src) {
    if (!s || (n_src > 0 && !src) || n_src < 0)
        return tqkv_fail(TQKV_EINVAL, "state merge: NULL argument or n_src < 0");
    if (n_src == 0) return TQKV_OK;
    long long rows = s->rows;
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "state merge: a spec round is active");
    for (int i = 0; i < n_src; i++) {
        if (!src[i] || src[i] == s)
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d is NULL or the target", i);
        if (src[i]->m != s->m)
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d belongs to another model", i);
        if (!same_cache_params(s, src[i]))
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d has other cache parameters "
                             "(formats, window, seed)", i);
        if (tqkv_model_state_tensor_parallel(src[i]) != tqkv_model_state_tensor_parallel(s))
            return tqkv_fail(TQKV_EINVAL, "state merge: source %d is sharded over %d ranks, the "
                             "target over %d (tensor_parallel must match)", i,
                             tqkv_model_state_tensor_parallel(src[i]),
                             tqkv_model_state_tensor_parallel(s));
        if ((rc = tqkv_model_state_check(src[i])) != TQKV_OK) return rc;
        if (spec_active_of(src[i]))
            return tqkv_fail(TQKV_ESTATE, "state merge: source %d is in a spec round", i);
        rows += src[i]->rows;
    }
    if (rows > (1 << 20)) return tqkv_fail(TQKV_ERANGE, "state merge: too many rows (%lld)", rows);
    if (s->tp) return model_tp_merge(s, src, n_src, (int)rows); /* every rank in lockstep */
    if (!s->gpu) return merge_inplace(s, src, n_src, (int)rows);
    const int L = s->m->cfg.n_layers;
    tqkv_batch **nl = calloc((size_t)L, sizeof *nl);
    if (!nl) return tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
    for (int l = 0; l < L; l++)
        if ((rc = rows_layer_merge(s, src, n_src, l, &nl[l])) != TQKV_OK) {
            free_batches(nl, L);
            return rc;
        }
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) {
        struct model_cuda **g = calloc((size_t)n_src, sizeof *g);
        if (!g) rc = tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
        for (int i = 0; g && i < n_src; i++) g[i] = src[i]->gpu;
        if (rc == TQKV_OK) rc = model_cuda_merge(s->gpu, g, n_src);
        free(g);
        if (rc != TQKV_OK) {
            free_batches(nl, L);
            return rc;
        }
    }
#endif
    model_recurrent *nr = NULL;
    if (s->rec) {
        model_recurrent **items = calloc((size_t)n_src + 1, sizeof *items);
        if (!items) rc = tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
        else {
            items[0] = s->rec;
            for (int i = 0; i < n_src; i++) items[i + 1] = src[i]->rec;
            rc = rec_concat(&nr, items, n_src + 1);
            free(items);
        }
        if (rc != TQKV_OK) {
            free_batches(nl, L);
            return rc;
        }
    }
    return install_layers(s, nl, nr, (int)rows);
}

/* New layers and recurrent rows holding rows keep[0..n) of s (s unchanged). */
tqkv_status rows_select_all(const tqkv_model_state *s, const int *keep, int n,
                                   tqkv_batch ***layers, model_recurrent **rec) {
    const int L = s->m->cfg.n_layers;
    tqkv_batch **nl = calloc((size_t)L, sizeof *nl);
    if (!nl) return tqkv_fail(TQKV_ENOMEM, "state rows: out of memory");
    tqkv_status rc = TQKV_OK;
    for (int l = 0; l < L && rc == TQKV_OK; l++) rc = rows_layer_select(s, l, keep, n, &nl[l]);
    *rec = NULL;
    if (rc == TQKV_OK && s->rec) rc = rec_select(s->rec, keep, n, rec);
    if (rc != TQKV_OK) {
        free_batches(nl, L);
        return rc;
    }
    *layers = nl;
    return TQKV_OK;
}

tqkv_status tqkv_model_state_filter(tqkv_model_state *s, const int *keep, int n_keep) {
    if (!s || (n_keep > 0 && !keep) || n_keep < 0)
        return tqkv_fail(TQKV_EINVAL, "state filter: NULL argument or n_keep < 0");
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "state filter: a spec round is active");
    if (s->tp) return model_tp_filter(s, keep, n_keep); /* every rank in lockstep */
    if (!s->gpu && keep_in_place(keep, n_keep, s->rows))
        return rows_filter_inplace(s, keep, n_keep);
    tqkv_batch **nl = NULL;
    model_recurrent *nr = NULL;
    if ((rc = rows_select_all(s, keep, n_keep, &nl, &nr)) != TQKV_OK) return rc;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu && (rc = model_cuda_filter(s->gpu, keep, n_keep)) != TQKV_OK) {
        free_batches(nl, s->m->cfg.n_layers);
        rec_free(nr);
        return rc;
    }
#endif
    return install_layers(s, nl, nr, n_keep);
}

tqkv_status tqkv_model_state_extract_row(const tqkv_model_state *s, int row,
                                         tqkv_model_state **out) {
    if (!s || !out) return tqkv_fail(TQKV_EINVAL, "state extract: NULL argument");
    if (row < 0 || row >= s->rows)
        return tqkv_fail(TQKV_ERANGE, "state extract: row %d not in [0, %d)", row, s->rows);
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "state extract: a spec round is active");
    tqkv_model_state_params p = s->p;
    p.rows = 1;
    tqkv_model_state *n = NULL;
    if ((rc = tqkv_model_state_init(&n, s->m, &p)) != TQKV_OK) return rc;
    if (s->tp) { /* a sharded 1-row state: every rank's row */
        if ((rc = model_tp_extract(s, row, n)) != TQKV_OK) {
            tqkv_model_state_free(n);
            return rc;
        }
        *out = n;
        return TQKV_OK;
    }
    tqkv_batch **nl = NULL;
    model_recurrent *nr = NULL;
    if ((rc = rows_select_all(s, &row, 1, &nl, &nr)) != TQKV_OK) {
        tqkv_model_state_free(n);
        return rc;
    }
#ifdef TQKV_HAVE_CUDA
    if (s->gpu && (rc = model_cuda_extract(s->gpu, row, n->gpu)) != TQKV_OK) {
        free_batches(nl, s->m->cfg.n_layers);
        rec_free(nr);
        tqkv_model_state_free(n);
        return rc;
    }
#endif
    if ((rc = install_layers(n, nl, nr, 1)) != TQKV_OK) {
        tqkv_model_state_free(n);
        return rc;
    }
    *out = n;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Spec rounds over every layer (and the recurrent rows' snapshots)
// ---------------------------------------------------------------------------

/* A checked host state not in a round. */
tqkv_status rows_spec_begin_host(tqkv_model_state *s) {
    /* Bounded sliding layers first drop what they hold beyond window + slack (what the last
     * round kept: a round never drops at the front, so rows that only run rounds would grow
     * them without bound). Their attention reads the same bits before and after a drop
     * (model_attend_per_query's token grid), and no row reads the dropped tokens again. A
     * failure (memory) leaves the state valid: no round open, some layers dropped. */
    tqkv_status rc;
    const int keep = sliding_keep(s);
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (rows_layer_kind_of(s->m, l) == MODEL_LAYER_SLIDING &&
            (rc = tqkv_batch_drop_oldest(s->layers[l], keep)) != TQKV_OK)
            return rc;
    if (s->rec && (rc = rec_spec_begin(s->rec)) != TQKV_OK) return rc; /* can fail: memory */
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) tqkv_batch_spec_begin(s->layers[l]); /* cannot fail: checked */
    return TQKV_OK;
}

tqkv_status tqkv_model_state_spec_begin(tqkv_model_state *s) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "spec_begin: a spec round is already active");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_spec_begin(s->gpu);
#endif
    if (s->tp) return model_tp_spec_begin(s); /* every rank in lockstep */
    return rows_spec_begin_host(s);
}

void rows_spec_commit_host(tqkv_model_state *s) {
    if (s->rec) rec_spec_commit(s->rec);
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) tqkv_batch_spec_commit(s->layers[l]);
}

tqkv_status tqkv_model_state_spec_commit(tqkv_model_state *s) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (!spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "spec_commit: no spec round is active");
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_spec_commit(s->gpu);
#endif
    if (s->tp) return model_tp_spec_commit(s); /* checked on every rank: cannot fail */
    rows_spec_commit_host(s);
    return TQKV_OK;
}

/* keep (n_keep 1 or rows) against every layer and the recurrent rows of a host state in a
 * round; changes nothing. */
tqkv_status rows_spec_rollback_check(const tqkv_model_state *s, const int *keep, int n_keep) {
    for (int r = 0; r < s->rows; r++) {
        int k = keep[n_keep == 1 ? 0 : r];
        for (int l = 0; l < s->m->cfg.n_layers; l++) {
            const tqkv_batch *b = s->layers[l];
            if (!b) continue;
            int appended = b->offset[r] - b->spec_base[r];
            if (k < 0 || k > appended)
                return tqkv_fail(TQKV_ERANGE, "spec_rollback: keep[%d] = %d not in [0, %d] "
                                 "(layer %d)", r, k, appended, l);
        }
        if (s->rec && (k < 0 || k > s->rec->spec_steps[r]))
            return tqkv_fail(TQKV_ERANGE, "spec_rollback: keep[%d] = %d not in [0, %d] "
                             "(recurrent rows)", r, k, s->rec->spec_steps[r]);
    }
    return TQKV_OK;
}

/* A keep that passed rows_spec_rollback_check (the recurrent rollback then only re-checks). */
void rows_spec_rollback_host(tqkv_model_state *s, const int *keep, int n_keep) {
    if (s->rec) rec_spec_rollback(s->rec, keep, n_keep);
    for (int l = 0; l < s->m->cfg.n_layers; l++)
        if (s->layers[l]) tqkv_batch_spec_rollback(s->layers[l], keep, n_keep);
}

/* keep: n_keep == 1 (all rows) or rows; validated against every layer and the recurrent
 * rows (of every rank) before any change. Sliding layers are never trimmed at the front
 * during a round, so their rollback is exact as every other layer's. */
tqkv_status tqkv_model_state_spec_rollback(tqkv_model_state *s, const int *keep, int n_keep) {
    tqkv_status rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) return rc;
    if (!keep) return tqkv_fail(TQKV_EINVAL, "spec_rollback: keep is NULL");
    if (!spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "spec_rollback: no spec round is active");
    if (n_keep != 1 && n_keep != s->rows)
        return tqkv_fail(TQKV_EINVAL, "spec_rollback: n_keep must be 1 or rows (%d), got %d",
                         s->rows, n_keep);
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return model_cuda_spec_rollback(s->gpu, keep, n_keep); /* validates every layer first */
#endif
    if (s->tp) return model_tp_spec_rollback(s, keep, n_keep); /* every rank's keep first */
    if ((rc = rows_spec_rollback_check(s, keep, n_keep)) != TQKV_OK) return rc;
    rows_spec_rollback_host(s, keep, n_keep);
    return TQKV_OK;
}

int tqkv_model_state_spec_active(const tqkv_model_state *s) {
    return s && s->rows >= 0 ? spec_active_of(s) : 0;
}

// ---------------------------------------------------------------------------
// Export / import (prompt cache files)
// ---------------------------------------------------------------------------
/* Layout (little endian):
 *   "TQKVMS02" | u32 n_layers | u32 rows
 *   per layer: u64 length, then that layer's tqkv_batch_export bytes (its own versioned,
 *              checksummed format); length 0 for a layer without KV rows (KV-shared,
 *              recurrent)
 *   u64 length, then rec_export bytes of the recurrent rows (0: the graph has none)
 * Import also reads "TQKVMS01" (no recurrent section, every layer present). */

static const char STATE_MAGIC[8] = {'T', 'Q', 'K', 'V', 'M', 'S', '0', '2'};
static const char STATE_MAGIC_V1[8] = {'T', 'Q', 'K', 'V', 'M', 'S', '0', '1'};

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
    if (spec_active_of(s)) return tqkv_fail(TQKV_ESTATE, "state export: a spec round is active");
    if (s->tp) return model_tp_export(s, out, len); /* the ranks' exports (tp_rows.c) */
    const int L = s->m->cfg.n_layers;
    uint8_t **blob = calloc((size_t)L + 1, sizeof *blob); /* [L] = recurrent rows */
    size_t *bl = calloc((size_t)L + 1, sizeof *bl);
    size_t total = 16 + 8;
    if (!blob || !bl) rc = tqkv_fail(TQKV_ENOMEM, "state export: out of memory");
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
#ifdef TQKV_HAVE_CUDA
        if (s->gpu) { /* a recurrent layer exports as length 0, as on the host */
            rc = model_cuda_export_layer(s->gpu, l, &blob[l], &bl[l]);
            total += 8 + bl[l];
            continue;
        }
#endif
        if (s->layers[l]) rc = tqkv_batch_export(s->layers[l], &blob[l], &bl[l]);
        total += 8 + bl[l];
    }
    if (rc == TQKV_OK && s->rec) rc = rec_export(s->rec, &blob[L], &bl[L]);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && s->gpu) rc = model_cuda_export_rec(s->gpu, &blob[L], &bl[L]);
#endif
    if (rc == TQKV_OK) total += bl[L];
    uint8_t *buf = rc == TQKV_OK ? malloc(total) : NULL;
    if (rc == TQKV_OK && !buf) rc = tqkv_fail(TQKV_ENOMEM, "state export: out of memory");
    if (rc == TQKV_OK) {
        memcpy(buf, STATE_MAGIC, 8);
        put_u32(buf + 8, (uint32_t)L);
        put_u32(buf + 12, (uint32_t)s->rows);
        size_t at = 16;
        for (int l = 0; l <= L; l++) {
            put_u64(buf + at, bl[l]);
            if (bl[l]) memcpy(buf + at + 8, blob[l], bl[l]);
            at += 8 + bl[l];
        }
        *out = buf;
        *len = total;
    }
    for (int l = 0; blob && l <= L; l++) free(blob[l]);
    free(blob);
    free(bl);
    return rc;
}

/* The next length-prefixed section of an export: bytes sec, length sl (0: empty). */
static tqkv_status read_section(const uint8_t *buf, size_t len, size_t *at, const char *what,
                                int l, const uint8_t **sec, size_t *sl) {
    if (len - *at < 8)
        return tqkv_fail(TQKV_ECORRUPT, "state import: truncated before %s %d", what, l);
    uint64_t n = get_u64(buf + *at);
    *at += 8;
    if (n > len - *at) return tqkv_fail(TQKV_ECORRUPT, "state import: %s %d truncated", what, l);
    *sec = buf + *at;
    *sl = (size_t)n;
    *at += (size_t)n;
    return TQKV_OK;
}

tqkv_status tqkv_model_state_import(tqkv_model_state **out, const tqkv_model *m,
                                    const tqkv_model_state_params *p_in, const uint8_t *buf,
                                    size_t len) {
    if (!out || !m || !buf) return tqkv_fail(TQKV_EINVAL, "state import: NULL argument");
    tqkv_model_state_params p = p_in ? *p_in : tqkv_model_state_params_default();
    if (model_tp_ranks(&p) || model_tp_is_export(buf, len)) /* sharded (tp_rows.c) */
        return model_tp_import(out, m, &p, buf, len);
    if (p.device != 0) { /* f32/f32 layers: the dense bf16 cache, which has no state format */
        int dense = 0;
        tqkv_status dc = tqkv_kv_layers_device_check(m, &p, &dense);
        if (dc != TQKV_OK) return dc;
        if (dense)
            return tqkv_fail(TQKV_EUNSUPPORTED, "state import: a device state with f32 KV on a "
                             "layer holds a dense bf16 cache there, which has no state format "
                             "(import into tq or fp8 KV on every layer)");
    }
    int v1 = len >= 16 && !memcmp(buf, STATE_MAGIC_V1, 8); /* no recurrent section */
    if (len < 16 || (!v1 && memcmp(buf, STATE_MAGIC, 8)))
        return tqkv_fail(TQKV_ECORRUPT, "state import: not a tqkv model state (bad magic)");
    const int L = m->cfg.n_layers;
    uint32_t nl = get_u32(buf + 8), rows = get_u32(buf + 12);
    if ((int)nl != L || nl > 100000)
        return tqkv_fail(TQKV_EINVAL, "state import: the state has %u layers, this model %d "
                         "(state of another model)", nl, L);
    if (rows < 1 || rows > (1u << 20))
        return tqkv_fail(TQKV_ECORRUPT, "state import: bad row count %u", rows);
    /* the expected shape of every layer: a fresh state with these parameters */
    p.rows = (int)rows;
    tqkv_model_state *s = NULL;
    tqkv_status rc = tqkv_model_state_init(&s, m, &p);
    if (rc != TQKV_OK) return rc;
    tqkv_batch **layers = calloc((size_t)L, sizeof *layers);
    if (!layers) {
        tqkv_model_state_free(s);
        return tqkv_fail(TQKV_ENOMEM, "state import: out of memory");
    }
    size_t at = 16;
    for (int l = 0; l < L && rc == TQKV_OK; l++) {
        const uint8_t *sec = NULL;
        size_t sl = 0;
        if ((rc = read_section(buf, len, &at, "layer", l, &sec, &sl)) != TQKV_OK) break;
        if (!s->layers[l]) {
            if (sl) rc = tqkv_fail(TQKV_EINVAL, "state import: layer %d holds KV rows, this "
                                   "model's layer %d has none (state of another model)", l, l);
            continue;
        }
        if (!sl) {
            rc = tqkv_fail(TQKV_EINVAL, "state import: layer %d has no KV rows, this model's "
                           "does (state of another model)", l);
            break;
        }
        if ((rc = tqkv_batch_restore(&layers[l], sec, sl)) != TQKV_OK) break;
        const tqkv_cache_config *c = tqkv_batch_get_config(layers[l]);
        const tqkv_cache_config *e = tqkv_batch_get_config(s->layers[l]);
        if (c->kv_heads != e->kv_heads || c->head_dim != e->head_dim)
            rc = tqkv_fail(TQKV_EINVAL, "state import: layer %d has %d kv heads of dim %d, this "
                           "model %d of dim %d (state of another model)", l, c->kv_heads,
                           c->head_dim, e->kv_heads, e->head_dim);
        else if (c->k_format != e->k_format || c->v_format != e->v_format)
            rc = tqkv_fail(TQKV_EINVAL, "state import: KV format %s/%s, expected %s/%s",
                           tqkv_format_name(c->k_format), tqkv_format_name(c->v_format),
                           tqkv_format_name(e->k_format), tqkv_format_name(e->v_format));
        else if (c->window_keys_only != e->window_keys_only)
            rc = tqkv_fail(TQKV_EINVAL, "state import: %s q8 window at layer %d, expected %s",
                           c->window_keys_only ? "a keys-only" : "a K and V", l,
                           e->window_keys_only ? "keys only" : "K and V");
        else if (c->window != e->window || c->window_slack != e->window_slack || c->seed != e->seed)
            rc = tqkv_fail(TQKV_EINVAL, "state import: window %d slack %d seed %llu at layer %d, "
                           "expected %d, %d, %llu", c->window, c->window_slack,
                           (unsigned long long)c->seed, l, e->window, e->window_slack,
                           (unsigned long long)e->seed);
        else if (tqkv_batch_rows(layers[l]) != (int)rows || tqkv_batch_spec_active(layers[l]))
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: layer %d holds %d rows, header %u", l,
                           tqkv_batch_rows(layers[l]), rows);
    }
    model_recurrent *rec = NULL;
    const int has_rec = m->cfg.n_linear > 0; /* host rows in s->rec, device rows in s->gpu */
    if (rc == TQKV_OK && !v1) {
        const uint8_t *sec = NULL;
        size_t sl = 0;
        rc = read_section(buf, len, &at, "recurrent section", 0, &sec, &sl);
        if (rc == TQKV_OK && !has_rec && sl)
            rc = tqkv_fail(TQKV_EINVAL, "state import: the state has recurrent rows, this model "
                           "none (state of another model)");
        else if (rc == TQKV_OK && has_rec && !sl)
            rc = tqkv_fail(TQKV_EINVAL, "state import: the state has no recurrent rows, this "
                           "model needs them (state of another model)");
        else if (rc == TQKV_OK && sl && (rc = rec_restore(&rec, &m->cfg, sec, sl)) == TQKV_OK &&
                 rec->rows != (int)rows)
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: recurrent rows hold %d rows, header %u",
                           rec->rows, rows);
    } else if (rc == TQKV_OK && has_rec) {
        rc = tqkv_fail(TQKV_EINVAL, "state import: a TQKVMS01 state has no recurrent rows, this "
                       "model needs them");
    }
    if (rc == TQKV_OK && at != len)
        rc = tqkv_fail(TQKV_ECORRUPT, "state import: %zu trailing bytes", len - at);
    if (rc != TQKV_OK) {
        free_batches(layers, L);
        rec_free(rec);
        tqkv_model_state_free(s);
        return rc;
    }
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) { /* device state: the restored (validated) layers become its device caches;
                   * its host layers stay the fresh empty batches of `rows` rows */
        rc = model_cuda_upload(s->gpu, layers, rec, (int)rows);
        free_batches(layers, L);
        rec_free(rec);
        if (rc == TQKV_OK) rc = tqkv_model_state_check(s);
        if (rc != TQKV_OK) {
            tqkv_model_state_free(s);
            return rc;
        }
        *out = s;
        return TQKV_OK;
    }
#endif
    if ((rc = install_layers(s, layers, rec, (int)rows)) == TQKV_OK) rc = tqkv_model_state_check(s);
    if (rc != TQKV_OK) {
        tqkv_model_state_free(s);
        return rc;
    }
    *out = s;
    return TQKV_OK;
}

/*
 * state_cuda.cu - the device twin's row operations, spec rounds and state export / upload
 * (src/model/state/rows.c's device branch; declared in model_cuda.h).
 * Owns: building every layer's new device cache (merge, filter, extract, upload) and the
 * new recurrent rows (Qwen 3.5) before installing any, validating every layer before a
 * spec round changes one, and the recurrent rows' spec snapshots (begin copies the rows to
 * slot 0, the forward writes one slot per token, rollback copies slot keep[r] back).
 * Must not: launch kernels itself (the cache module does; recurrent rows move by copies),
 * or run the forward (forward_cuda.cu).
 */
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/model_impl.h"
#include "model/state/recurrent.h"
#include "util/common.h"
#include "util/env_switch.h"
#include "util/keep_order.h"
}
#include "model/cuda/model_cuda_impl.h"

static tqkv_status ckc(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return TQKV_OK;
    (void)cudaGetLastError();
    return tqkv_fail(e == cudaErrorMemoryAllocation ? TQKV_ENOMEM : TQKV_EUNSUPPORTED, "CUDA: %s: %s",
                     what, cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------
// recurrent rows (Qwen 3.5): new rows as copies of existing ones
// ---------------------------------------------------------------------------

/* New recurrent rows on dst's stream: row i is row rows[i] of items[i]'s (every item's
 * stream is waited for first). *state / *tokens NULL when the graph has none. */
static tqkv_status rec_gather(const model_cuda *dst, const model_cuda *const *items, const int *rows,
                              int n, float **state, int **tokens) {
    tqkv_status st = mc_rec_alloc(dst, n, state, tokens);
    if (st || !*state) return st;
    const size_t rb = dst->rec.row_floats * sizeof(float);
    for (int i = 0; i < n && !st; i++) {
        const model_cuda *it = items[i];
        if (i == 0 || it != items[i - 1]) st = ckc(cudaStreamSynchronize(it->stream), "recurrent rows");
        if (!st)
            st = ckc(cudaMemcpyAsync(*state + (size_t)i * dst->rec.row_floats,
                                     it->rec.state + (size_t)rows[i] * it->rec.row_floats, rb,
                                     cudaMemcpyDeviceToDevice, dst->stream), "recurrent rows");
        (*tokens)[i] = it->rec.tokens[rows[i]];
    }
    if (st) {
        cudaStreamSynchronize(dst->stream);
        cudaFree(*state);
        free(*tokens);
        *state = NULL;
        *tokens = NULL;
    }
    return st;
}

/* rec_gather over `n` rows taken from one state g (rows[i] of g) or from g then src[..]
 * (every row of each, in order): items / rows built here. */
static tqkv_status rec_rows(const model_cuda *dst, const model_cuda *g, model_cuda *const *src,
                            int n_src, const int *keep, int n, float **state, int **tokens) {
    *state = NULL;
    *tokens = NULL;
    if (!g->rec.n_lin) return TQKV_OK;
    const model_cuda **items = (const model_cuda **)malloc(sizeof *items * (size_t)(n ? n : 1));
    int *rows = (int *)malloc(sizeof(int) * (size_t)(n ? n : 1));
    tqkv_status st = items && rows ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int i = 0, at = 0; !st && i <= (keep ? 0 : n_src); i++) {
        const model_cuda *it = i == 0 ? g : src[i - 1];
        const int cnt = keep ? n : it->rows;
        for (int r = 0; r < cnt; r++, at++) {
            items[at] = it;
            rows[at] = keep ? keep[r] : r;
        }
    }
    if (!st) st = rec_gather(dst, items, rows, n, state, tokens);
    free(items);
    free(rows);
    return st;
}

// ---------------------------------------------------------------------------
// row operations (src/model/state/rows.c's device branch): new caches are built for every layer
// first, then installed, so a failure leaves the twin as it was
// ---------------------------------------------------------------------------

/* The new caches nk [L] and recurrent rows of an operation, made ready to install into
 * `into` (*out), or all freed. */
static tqkv_status rows_ready(model_cuda *into, tqkv_status st, cuda_kv **nk, float *rs, int *rt,
                             int rows, model_cuda_rows **out) {
    if (st) {
        mc_free_cache_array(nk, into->m->cfg.n_layers);
        return st;
    }
    return mc_rows_make(into, nk, rs, rt, rows, out);
}

extern "C" tqkv_status model_cuda_merge_build(model_cuda *g, model_cuda *const *src, int n,
                                              model_cuda_rows **out) {
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
        if (!g->kv[l]) continue; /* recurrent layer */
        items[0] = g->kv[l];
        for (int i = 0; i < n; i++) items[i + 1] = src[i]->kv[l];
        st = tqkv_cuda_kv_merge(&nk[l], items, n + 1);
    }
    free(items);
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = rec_rows(g, g, src, n, NULL, rows, &rs, &rt);
    return rows_ready(g, st, nk, rs, rt, rows, out);
}

extern "C" tqkv_status model_cuda_filter_build(model_cuda *g, const int *keep, int n,
                                               model_cuda_rows **out) {
    const int L = g->m->cfg.n_layers;
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    tqkv_status st = nk ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_select(g->kv[l], keep, n, &nk[l]);
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = rec_rows(g, g, NULL, 0, keep, n, &rs, &rt);
    return rows_ready(g, st, nk, rs, rt, n, out);
}

extern "C" tqkv_status model_cuda_extract_build(const model_cuda *g, int row, model_cuda *dst,
                                                model_cuda_rows **out) {
    const int L = g->m->cfg.n_layers;
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    tqkv_status st = nk ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_extract(g->kv[l], row, &nk[l]);
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = rec_rows(dst, g, NULL, 0, &row, 1, &rs, &rt);
    return rows_ready(dst, st, nk, rs, rt, 1, out);
}

// ---------------------------------------------------------------------------
// in place (the engine's running batch: rows join and leave every few steps): every layer's
// cache changes its rows where they are (tqkv_cuda_kv_append_rows / _filter) instead of
// being rebuilt. Every allocation first (each layer's room, the recurrent rows, the per-row
// arrays), then the moves, which fail only on a CUDA error (the state is then marked broken).
// TQKV_KV_INPLACE=0 rebuilds instead (the A/B).
// ---------------------------------------------------------------------------

static env_switch g_inplace = ENV_SWITCH("TQKV_KV_INPLACE");

static tqkv_status merge_inplace(model_cuda *g, model_cuda *const *src, int n, int rows) {
    const int L = g->m->cfg.n_layers;
    cuda_kv **items = (cuda_kv **)calloc((size_t)n, sizeof *items);
    tqkv_status st = items ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        if (!g->kv[l]) continue;
        for (int i = 0; i < n; i++) items[i] = src[i]->kv[l];
        st = tqkv_cuda_kv_append_rows_reserve(g->kv[l], items, n);
    }
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = rec_rows(g, g, src, n, NULL, rows, &rs, &rt);
    model_cuda_rows *b = NULL;
    if (!st) st = mc_rows_make(g, NULL, rs, rt, rows, &b);
    /* every layer's copies queued, then one wait: every installed cache runs on g's stream
     * (mc_rows_make set it when they were installed), and the callers free src next */
    for (int l = 0; l < L && !st; l++) {
        if (!g->kv[l]) continue;
        for (int i = 0; i < n; i++) items[i] = src[i]->kv[l];
        if ((st = tqkv_cuda_kv_append_rows_queue(g->kv[l], items, n))) g->broken = 1;
    }
    if (!st && (st = mc_ck(cudaStreamSynchronize(g->stream), "join"))) g->broken = 1;
    free(items);
    if (st) model_cuda_rows_free(b);
    else model_cuda_rows_install(g, b);
    return st;
}

static tqkv_status filter_inplace(model_cuda *g, const int *keep, int n) {
    float *rs = NULL;
    int *rt = NULL;
    tqkv_status st = rec_rows(g, g, NULL, 0, keep, n, &rs, &rt);
    model_cuda_rows *b = NULL;
    if (!st) st = mc_rows_make(g, NULL, rs, rt, n, &b);
    for (int l = 0; l < g->m->cfg.n_layers && !st; l++)
        if (g->kv[l] && (st = tqkv_cuda_kv_filter(g->kv[l], keep, n))) g->broken = 1;
    if (st) model_cuda_rows_free(b);
    else model_cuda_rows_install(g, b);
    return st;
}

extern "C" tqkv_status model_cuda_merge(model_cuda *g, model_cuda *const *src, int n) {
    int rows = g->rows;
    for (int i = 0; i < n; i++) rows += src[i]->rows;
    if (rows <= CUDA_MAX_ROWS && env_switch_get(&g_inplace)) return merge_inplace(g, src, n, rows);
    model_cuda_rows *b = NULL;
    const tqkv_status st = model_cuda_merge_build(g, src, n, &b);
    if (!st) model_cuda_rows_install(g, b);
    return st;
}

extern "C" tqkv_status model_cuda_filter(model_cuda *g, const int *keep, int n) {
    if (keep_in_place(keep, n, g->rows) && env_switch_get(&g_inplace)) return filter_inplace(g, keep, n);
    model_cuda_rows *b = NULL;
    const tqkv_status st = model_cuda_filter_build(g, keep, n, &b);
    if (!st) model_cuda_rows_install(g, b);
    return st;
}

extern "C" tqkv_status model_cuda_extract(const model_cuda *g, int row, model_cuda *dst) {
    model_cuda_rows *b = NULL;
    const tqkv_status st = model_cuda_extract_build(g, row, dst, &b);
    if (!st) model_cuda_rows_install(dst, b);
    return st;
}

extern "C" tqkv_status model_cuda_check(const model_cuda *g) {
    if (g->broken) /* before any row operation could carry the rows on */
        return tqkv_fail(TQKV_ESTATE, "state: a forward failed midway and left rows it could not "
                         "undo; reset the state");
    const int k0 = g->kv0;
    const int *o0 = tqkv_cuda_kv_offsets(g->kv[k0]), *b0 = tqkv_cuda_kv_spec_bases(g->kv[k0]);
    const int spec0 = tqkv_cuda_kv_spec_active(g->kv[k0]);
    /* bounded sliding layers hold min(position, window + slack) .. position
     * tokens (src/model/state/rows.c's SLIDING rule) and, in a round, the same tokens appended */
    const tqkv_model *m = g->m;
    const int keep = m->ops->sliding_keep ? m->ops->sliding_keep(m, &g->p) : 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!g->kv[l] || l == k0) continue;
        const int *o = tqkv_cuda_kv_offsets(g->kv[l]), *b = tqkv_cuda_kv_spec_bases(g->kv[l]);
        const int sliding = model_layer_kind_of(m, l) == MODEL_LAYER_SLIDING;
        if (tqkv_cuda_kv_spec_active(g->kv[l]) != spec0)
            return tqkv_fail(TQKV_ESTATE, "state: device layer %d %s in a spec round, layer %d %s",
                             l, spec0 ? "is not" : "is", k0, spec0 ? "is" : "is not");
        for (int r = 0; r < g->rows; r++) {
            const int lo = o0[r] < keep ? o0[r] : keep;
            if (sliding && (o[r] > o0[r] || o[r] < lo))
                return tqkv_fail(TQKV_ESTATE,
                                 "state: device row %d holds %d tokens in sliding layer "
                                 "%d, expected %d..%d (position %d, window + slack %d)",
                                 r, o[r], l, lo, o0[r], o0[r], keep);
            if (!sliding && o[r] != o0[r])
                return tqkv_fail(TQKV_ESTATE, "state: device layer %d row %d holds %d tokens, "
                                 "layer %d %d", l, r, o[r], k0, o0[r]);
            if (spec0 && (sliding ? o[r] - b[r] != o0[r] - b0[r] : b[r] != b0[r]))
                return tqkv_fail(TQKV_ESTATE, "state: device layer %d row %d began its spec round "
                                 "at %d tokens, layer %d at %d", l, r, b[r], k0, b0[r]);
        }
    }
    const mc_rec *rc = &g->rec;
    if (rc->n_lin) {
        if (rc->spec_active != spec0)
            return tqkv_fail(TQKV_ESTATE, "state: device recurrent rows %s in a spec round, layer "
                             "%d %s", rc->spec_active ? "are" : "are not", k0, spec0 ? "is" : "is not");
        for (int r = 0; r < g->rows; r++)
            if (rc->tokens[r] != o0[r])
                return tqkv_fail(TQKV_ESTATE, "state: device row %d: recurrent rows absorbed %d "
                                 "tokens, layer %d holds %d", r, rc->tokens[r], k0, o0[r]);
    }
    return TQKV_OK;
}

/* Gemma 4's sliding layers count at most window + slack tokens (src/model/state/rows.c's rule);
 * KV-shared layers hold nothing. */
extern "C" size_t model_cuda_projected_bytes(const model_cuda *g, int tokens, int round) {
    const tqkv_model *m = g->m;
    const int keep = (m->ops->sliding_keep ? m->ops->sliding_keep(m, &g->p) : 0) + round;
    size_t b = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        if (!g->kv[l]) continue;
        size_t ring = 0;
        const int t = model_layer_kind_of(m, l) == MODEL_LAYER_SLIDING && tokens > keep ? keep
                                                                                     : tokens;
        b += tqkv_cuda_kv_token_bytes(g->kv[l], &ring) * (size_t)t + ring;
    }
    return b;
}

extern "C" size_t model_cuda_kv_token_bytes(const model_cuda *g) {
    size_t b = 0, ring;
    for (int l = 0; l < g->m->cfg.n_layers; l++)
        if (g->kv[l]) b += tqkv_cuda_kv_token_bytes(g->kv[l], &ring);
    return b;
}

extern "C" size_t model_cuda_kv_bytes(const model_cuda *g) {
    size_t b = 0;
    if (g && g->kv)
        for (int l = 0; l < g->m->cfg.n_layers; l++)
            if (g->kv[l]) b += tqkv_cuda_kv_bytes(g->kv[l]);
    if (g && g->rec.n_lin) /* recurrent rows and their spec snapshots */
        b += (size_t)g->rows * g->rec.row_floats * sizeof(float) *
             (1 + (g->rec.snap ? (size_t)g->rec.spec_cap + 1 : 0));
    return b;
}

extern "C" size_t model_cuda_row_fixed_bytes(const model_cuda *g) {
    return g ? g->rec.row_floats * sizeof(float) : 0;
}

// ---------------------------------------------------------------------------
// spec rounds, export and upload (src/model/state/rows.c's device branch): every layer is validated
// (or built) before any is changed
// ---------------------------------------------------------------------------

extern "C" int model_cuda_spec_active(const model_cuda *g) {
    return g && g->kv ? tqkv_cuda_kv_spec_active(g->kv[g->kv0]) : 0;
}

/* Snapshot buffer of cap slots per row beyond slot 0; the old slots 0..spec_cap are kept. */
static tqkv_status snap_grow(model_cuda *g, int cap) {
    mc_rec *rc = &g->rec;
    if (rc->snap && cap <= rc->spec_cap) return TQKV_OK;
    const size_t rb = rc->row_floats * sizeof(float), R = (size_t)g->rows;
    float *ns = NULL;
    tqkv_status st = ckc(cudaMalloc((void **)&ns, R * (cap + 1) * rb + 16), "spec snapshots");
    /* row by row (a 2D copy's pitch may not exceed cudaDeviceProp::memPitch) */
    for (size_t r = 0; !st && rc->snap && r < R; r++)
        st = ckc(cudaMemcpyAsync((char *)ns + r * (cap + 1) * rb,
                                 (const char *)rc->snap + r * ((size_t)rc->spec_cap + 1) * rb,
                                 ((size_t)rc->spec_cap + 1) * rb, cudaMemcpyDeviceToDevice, g->stream),
                 "spec snapshots");
    if (!st) st = ckc(cudaStreamSynchronize(g->stream), "spec snapshots");
    if (st) {
        cudaFree(ns);
        return st;
    }
    cudaFree(rc->snap);
    rc->snap = ns;
    rc->spec_cap = cap;
    g->gen++; /* the forward's kernels take the buffer and its stride as arguments */
    return TQKV_OK;
}

tqkv_status mc_rec_spec_reserve(model_cuda *g, int n) {
    const mc_rec *rc = &g->rec;
    int most = 0;
    for (int r = 0; r < g->rows; r++) most = rc->spec_steps[r] > most ? rc->spec_steps[r] : most;
    if (most + n <= rc->spec_cap) return TQKV_OK;
    const int want = most + n, grown = rc->spec_cap + rc->spec_cap / 2;
    return snap_grow(g, want > grown ? want : grown);
}

extern "C" tqkv_status model_cuda_spec_begin(model_cuda *g) {
    const int L = g->m->cfg.n_layers;
    for (int l = 0; l < L; l++)
        if (g->kv[l] && tqkv_cuda_kv_spec_active(g->kv[l]))
            return tqkv_fail(TQKV_ESTATE, "spec_begin: a spec round is already active (layer %d)", l);
    /* bounded sliding layers first drop what they hold beyond window + slack,
     * as the CPU's tqkv_model_state_spec_begin (src/model/state/rows.c): a round never drops at the
     * front, so rows that only run rounds would grow them without bound. The window views
     * read the same bits before and after a drop. A failure leaves no round open. */
    if (g->arch_ops && g->arch_ops->drop_oldest) {
        const tqkv_status sd = g->arch_ops->drop_oldest(g);
        if (sd) {
            g->broken = 1; /* the layers may be out of step */
            return sd;
        }
    }
    mc_rec *rc = &g->rec;
    if (rc->n_lin) { /* slot 0 = the rows now (the only step that can fail, before any change) */
        if (rc->spec_active) return tqkv_fail(TQKV_ESTATE, "spec_begin: a spec round is already active");
        const size_t rb = rc->row_floats * sizeof(float);
        tqkv_status st = snap_grow(g, rc->spec_cap > 4 ? rc->spec_cap : 4);
        for (int r = 0; !st && r < g->rows; r++)
            st = ckc(cudaMemcpyAsync((char *)rc->snap + (size_t)r * ((size_t)rc->spec_cap + 1) * rb,
                                     (const char *)rc->state + (size_t)r * rb, rb,
                                     cudaMemcpyDeviceToDevice, g->stream), "spec snapshots");
        if (st) return st;
        memset(rc->spec_steps, 0, sizeof(int) * (size_t)g->rows);
        rc->spec_active = 1;
    }
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_spec_begin(g->kv[l]); /* cannot fail: checked */
    return st;
}

extern "C" tqkv_status model_cuda_spec_commit(model_cuda *g) {
    const int L = g->m->cfg.n_layers;
    for (int l = 0; l < L; l++)
        if (g->kv[l] && !tqkv_cuda_kv_spec_active(g->kv[l]))
            return tqkv_fail(TQKV_ESTATE, "spec_commit: no spec round is active (layer %d)", l);
    if (g->rec.n_lin && !g->rec.spec_active)
        return tqkv_fail(TQKV_ESTATE, "spec_commit: no spec round is active (recurrent rows)");
    g->rec.spec_active = 0;
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_spec_commit(g->kv[l]); /* cannot fail: checked */
    return st;
}

/* Only the row-table upload of each layer and the recurrent rows' copies can fail after
 * the checks (a CUDA error), and then the layers are out of step: model_cuda_check
 * reports it. */
extern "C" tqkv_status model_cuda_spec_rollback_check(const model_cuda *g, const int *keep,
                                                      int n_keep) {
    const int L = g->m->cfg.n_layers, R = g->rows;
    if (!keep) return tqkv_fail(TQKV_EINVAL, "spec_rollback: keep is NULL");
    if (n_keep != 1 && n_keep != R)
        return tqkv_fail(TQKV_EINVAL, "spec_rollback: n_keep must be 1 or rows (%d), got %d", R, n_keep);
    for (int l = 0; l < L; l++) {
        if (!g->kv[l]) continue;
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
    const mc_rec *rc = &g->rec;
    if (!rc->n_lin) return TQKV_OK;
    if (!rc->spec_active)
        return tqkv_fail(TQKV_ESTATE, "spec_rollback: no spec round is active (recurrent rows)");
    for (int r = 0; r < R; r++) {
        const int k = keep[n_keep == 1 ? 0 : r];
        if (k > rc->spec_steps[r])
            return tqkv_fail(TQKV_ERANGE, "spec_rollback: keep[%d] = %d not in [0, %d] "
                             "(recurrent rows)", r, k, rc->spec_steps[r]);
    }
    return TQKV_OK;
}

/* Only the row-table upload of each layer and the recurrent rows' copies can fail after
 * the checks (a CUDA error), and then the layers are out of step: model_cuda_check
 * reports it. */
extern "C" tqkv_status model_cuda_spec_rollback(model_cuda *g, const int *keep, int n_keep) {
    const int L = g->m->cfg.n_layers, R = g->rows;
    tqkv_status st = model_cuda_spec_rollback_check(g, keep, n_keep);
    if (st) return st;
    mc_rec *rc = &g->rec;
    if (rc->n_lin) {
        const size_t rb = rc->row_floats * sizeof(float);
        for (int r = 0; r < R && !st; r++) {
            const int k = keep[n_keep == 1 ? 0 : r];
            st = ckc(cudaMemcpyAsync(rc->state + (size_t)r * rc->row_floats,
                                     rc->snap + ((size_t)r * (rc->spec_cap + 1) + k) * rc->row_floats, rb,
                                     cudaMemcpyDeviceToDevice, g->stream), "spec rollback");
            rc->tokens[r] -= rc->spec_steps[r] - k;
        }
        rc->spec_active = 0;
    }
    for (int l = 0; l < L && !st; l++)
        if (g->kv[l]) st = tqkv_cuda_kv_spec_rollback(g->kv[l], keep, n_keep);
    return st;
}

extern "C" tqkv_status model_cuda_export_layer(const model_cuda *g, int l, uint8_t **out, size_t *len) {
    if (!g || !out || !len || l < 0 || l >= g->m->cfg.n_layers)
        return tqkv_fail(TQKV_EINVAL, "state export: bad device layer argument");
    *out = NULL;
    *len = 0;
    if (!g->kv[l]) return TQKV_OK; /* a recurrent layer: its rows go in model_cuda_export_rec */
    tqkv_format k, v;
    tqkv_kv_layer_formats(&g->p, l, &k, &v); /* f32/f32: the dense bf16 cache */
    if (k == TQKV_F32 || v == TQKV_F32)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state export: device layer %d has f32 KV, held as a "
                         "dense bf16 cache, which has no state format (export device states with "
                         "tq or fp8 KV on every layer)", l);
    return tqkv_cuda_kv_export(g->kv[l], out, len);
}

extern "C" tqkv_status model_cuda_export_rec(const model_cuda *g, uint8_t **out, size_t *len) {
    if (!g || !out || !len) return tqkv_fail(TQKV_EINVAL, "state export: NULL argument");
    *out = NULL;
    *len = 0;
    if (!g->rec.n_lin) return TQKV_OK;
    model_recurrent *h = NULL;
    tqkv_status st = rec_init(&h, &g->m->cfg, g->rows);
    if (!st && h->row_floats != g->rec.row_floats)
        st = tqkv_fail(TQKV_ESTATE, "state export: recurrent row layouts differ (%zu, %zu floats)",
                       h->row_floats, g->rec.row_floats);
    if (!st) st = ckc(cudaStreamSynchronize(g->stream), "state export");
    if (!st && g->rows)
        st = ckc(cudaMemcpy(h->state, g->rec.state, (size_t)g->rows * h->row_floats * sizeof(float),
                            cudaMemcpyDeviceToHost), "state export");
    if (!st) {
        memcpy(h->tokens, g->rec.tokens, sizeof(int) * (size_t)g->rows);
        st = rec_export(h, out, len);
    }
    rec_free(h);
    return st;
}

extern "C" tqkv_status model_cuda_upload(model_cuda *g, tqkv_batch *const *layers,
                                         const model_recurrent *rec, int rows) {
    const tqkv_model_config *c = &g->m->cfg;
    const int L = c->n_layers;
    if (!layers || rows < 0) return tqkv_fail(TQKV_EINVAL, "state upload: bad argument");
    if (rows > CUDA_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "state import: %d rows (a device state holds at most %d)",
                         rows, CUDA_MAX_ROWS);
    int dense = 0; /* a layer on the dense bf16 cache (f32/f32) */
    tqkv_status st = tqkv_kv_layers_device_check(g->m, &g->p, &dense);
    if (!st && dense)
        st = tqkv_fail(TQKV_EUNSUPPORTED, "state import: a device state with f32 KV on a layer "
                       "holds a dense bf16 cache there, which has no state format (import into "
                       "tq or fp8 KV on every layer)");
    if (st) return st;
    if (g->rec.n_lin && (!rec || rec->rows != rows || rec->row_floats != g->rec.row_floats))
        return tqkv_fail(TQKV_EINVAL, "state upload: recurrent rows missing or of another shape");
    cuda_kv **nk = (cuda_kv **)calloc((size_t)L, sizeof *nk);
    int *off = (int *)calloc((size_t)(rows ? 2 * rows : 2), sizeof(int)); /* [rows] offsets | left pads */
    st = nk && off ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        if (!mc_layer_has_kv(g->m, l)) continue; /* linear, or Gemma 4 KV-shared */
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
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = mc_rec_alloc(g, rows, &rs, &rt);
    if (!st && rs && rows) { /* pageable source: the copy is complete when the stream is */
        st = ckc(cudaMemcpyAsync(rs, rec->state, (size_t)rows * rec->row_floats * sizeof(float),
                                 cudaMemcpyHostToDevice, g->stream), "state upload");
        if (!st) st = ckc(cudaStreamSynchronize(g->stream), "state upload");
        if (!st) memcpy(rt, rec->tokens, sizeof(int) * (size_t)rows);
    }
    if (st) {
        mc_free_cache_array(nk, L);
        if (rs) cudaStreamSynchronize(g->stream); /* its zeroing / upload may be queued */
        cudaFree(rs);
        free(rt);
        return st;
    }
    return mc_install_caches(g, nk, rs, rt, rows);
}

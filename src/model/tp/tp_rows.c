/*
 * tp_rows.c - row operations on a tensor-parallel state (tp_state.h; docs/TP.md): merge,
 *   filter, extract, spec rounds, export / import, applied to every rank's state in
 *   lockstep, and the check that the ranks agree.
 * Owns: the every-rank-or-none rule: each operation runs its fallible part (rows_impl.h:
 *   allocations, reserved room, validation) on every rank before it changes any rank; the
 *   sharded export format.
 * Must not: check arguments rows.c has checked (it calls here after them); run a graph;
 *   name an architecture.
 *
 * The parent state keeps its own per-row arrays and row count; its `layers` are rank 0's
 * and are re-pointed after every operation that replaces them.
 *
 * Sharded device states (tp->on_device: every rank a device state, model_cuda.h): each rank's
 * caches are its device twin's; its host layers are empty batches of the same rows, reshaped
 * alongside (as rows.c does for an unsharded device state). The twins' operations come in
 * the same two halves (model_cuda_*_build: every allocation, changes no twin; then
 * model_cuda_rows_install: cannot fail), so the rule is the same: every rank's device build
 * and host fallible half first, with rank r's GPU current, then every rank's install.
 */
#include <stdlib.h>
#include <string.h>

#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif
#include "model/state/rows_impl.h"
#include "model/tp/tp_state.h"
#include "util/common.h"
#include "util/keep_order.h"

struct model_cuda_rows; /* a device twin's built rows (model_cuda.h; CUDA builds only) */

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/* The parent after its ranks changed: `rows` rows, new per-row arrays (NULL: keep the ones
 * it has, which hold at least `rows`), rank 0's layers. */
static void parent_rows(tqkv_model_state *s, int rows, int *off, int *len) {
    if (off) {
        free(s->off);
        free(s->len);
        s->off = off;
        s->len = len;
    }
    if (rows != s->rows) s->cap_rn = 0; /* row-shaped scratch is re-sized on next use */
    s->rows = s->p.rows = rows;
    s->layers = s->tp->rank[0]->layers;
}

// ---------------------------------------------------------------------------
// The device twins' halves of sharded device states (no-ops on the CPU)
// ---------------------------------------------------------------------------

/* Rank r's GPU current (sharded device states; nothing on the CPU). */
static tqkv_status rank_enter(const model_tp *tp, int r) {
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) return model_cuda_set_device(tp->device[r]);
#endif
    (void)tp;
    (void)r;
    return TQKV_OK;
}

/* GPU tp->device[r] current on a path that cannot fail (cleanup, installs; a failure to
 * switch is ignored: every allocation was made, nothing is launched). */
static void rank_select(const model_tp *tp, int r) {
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) model_cuda_select_device(tp->device[r]);
#endif
    (void)tp;
    (void)r;
}

/* Every rank's built rows b[r] installed into its twin (the GPU of each current), or freed
 * (install 0); b[r] NULL on the CPU. Ends with rank 0's GPU current. */
static void dev_finish(const model_tp *tp, struct model_cuda_rows **b, int install) {
    for (int r = 0; r < tp->n; r++) {
        if (!b[r]) continue;
        rank_select(tp, r);
#ifdef TQKV_HAVE_CUDA
        if (install) model_cuda_rows_install(tp->rank[r]->gpu, b[r]);
        else model_cuda_rows_free(b[r]);
#else
        (void)install;
#endif
        b[r] = NULL;
    }
    rank_select(tp, 0);
}

/* Rank r's twin merged with its sources' twins (rs [n_src]: the sources' rank r states),
 * built into *b; nothing on the CPU. */
static tqkv_status dev_merge_build(const model_tp *tp, int r, tqkv_model_state *const *rs,
                                   int n_src, struct model_cuda_rows **b) {
    if (!tp->on_device) return TQKV_OK;
#ifdef TQKV_HAVE_CUDA
    struct model_cuda **g = calloc((size_t)n_src, sizeof *g);
    if (!g) return tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
    for (int i = 0; i < n_src; i++) g[i] = rs[i]->gpu;
    const tqkv_status rc = model_cuda_merge_build(tp->rank[r]->gpu, g, n_src, b);
    free(g);
    return rc;
#else
    (void)r, (void)rs, (void)n_src, (void)b;
    return tqkv_fail(TQKV_EUNSUPPORTED, "state merge: not a CUDA build");
#endif
}

static tqkv_status dev_filter_build(const model_tp *tp, int r, const int *keep, int n_keep,
                                    struct model_cuda_rows **b) {
    if (!tp->on_device) return TQKV_OK;
#ifdef TQKV_HAVE_CUDA
    return model_cuda_filter_build(tp->rank[r]->gpu, keep, n_keep, b);
#else
    (void)r, (void)keep, (void)n_keep, (void)b;
    return tqkv_fail(TQKV_EUNSUPPORTED, "state filter: not a CUDA build");
#endif
}

/* Tests: TQKV_TP_FAIL_RANK=r in the environment fails the fallible half of a merge, a
 * rebuilt or device filter and a spec begin on rank r, after the ranks before it did theirs
 * (the all-or-nothing path; test_tp_rows, test_cuda_tp). */
static tqkv_status injected(int r) {
    const char *v = getenv("TQKV_TP_FAIL_RANK");
    if (!v || !*v || atoi(v) != r) return TQKV_OK;
    return tqkv_fail(TQKV_ENOMEM, "state rows: injected failure on rank %d (TQKV_TP_FAIL_RANK)", r);
}

static void rank_sources(tqkv_model_state *const *src, int n_src, int r, tqkv_model_state **out) {
    for (int i = 0; i < n_src; i++) out[i] = src[i]->tp->rank[r];
}

tqkv_status model_tp_check_ranks(const tqkv_model_state *s, const int *pos0, int spec0) {
    const model_tp *tp = s->tp;
    const int R = s->rows;
    if (s->layers != tp->rank[0]->layers)
        return tqkv_fail(TQKV_ESTATE, "state: the parent's caches are not rank 0's");
    int *pos = malloc(sizeof(int) * (size_t)(R ? R : 1));
    if (!pos) return tqkv_fail(TQKV_ENOMEM, "state check: out of memory");
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) {
        const tqkv_model_state *q = tp->rank[r];
        if (q->rows != R) {
            rc = tqkv_fail(TQKV_ESTATE, "state: rank %d holds %d rows, the state %d", r, q->rows, R);
            break;
        }
        if (r == 0 && !q->rec) continue; /* its caches are the parent's, checked */
        if ((rc = tqkv_model_state_check(q)) != TQKV_OK) break;
        if (tqkv_model_state_spec_active(q) != spec0) {
            rc = tqkv_fail(TQKV_ESTATE, "state: rank %d %s in a spec round, rank 0 %s", r,
                           spec0 ? "is not" : "is", spec0 ? "is" : "is not");
            break;
        }
        if ((rc = model_state_positions(q, pos)) != TQKV_OK) break;
        for (int i = 0; i < R; i++)
            if (pos[i] != pos0[i]) {
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d holds %d tokens on rank %d, %d on "
                               "rank 0", i, pos[i], r, pos0[i]);
                break;
            }
    }
    free(pos);
    return rc;
}

// ---------------------------------------------------------------------------
// Merge / filter / extract
// ---------------------------------------------------------------------------

tqkv_status model_tp_merge(tqkv_model_state *s, tqkv_model_state *const *src, int n_src,
                           int rows) {
    model_tp *tp = s->tp;
    rows_prep pr[TP_MAX_RANKS];
    memset(pr, 0, sizeof pr);
    struct model_cuda_rows *dev[TP_MAX_RANKS] = {0}; /* rank r's twin's new rows */
    tqkv_model_state **rs = calloc((size_t)n_src, sizeof *rs);
    int *off = NULL, *len = NULL; /* the parent's [rows] */
    tqkv_status rc = rs ? rows_arrays_alloc(rows, &off, &len)
                        : tqkv_fail(TQKV_ENOMEM, "state merge: out of memory");
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) { /* room on every rank first */
        rank_sources(src, n_src, r, rs);
        if ((rc = rank_enter(tp, r)) == TQKV_OK) rc = dev_merge_build(tp, r, rs, n_src, &dev[r]);
        if (rc == TQKV_OK) rc = rows_merge_reserve(tp->rank[r], rs, n_src, rows, &pr[r]);
        if (rc == TQKV_OK) rc = injected(r);
    }
    if (rc != TQKV_OK) { /* reserved room and built twins change no row: every rank as before */
        dev_finish(tp, dev, 0);
        for (int r = 0; r < tp->n; r++) rows_prep_free(&pr[r]);
        free(rs);
        free(off);
        free(len);
        return rc;
    }
    dev_finish(tp, dev, 1);
    for (int r = 0; r < tp->n; r++) {
        rank_sources(src, n_src, r, rs);
        rows_merge_apply(tp->rank[r], rs, n_src, rows, &pr[r]);
    }
    free(rs);
    parent_rows(s, rows, off, len);
    return TQKV_OK;
}

tqkv_status model_tp_filter(tqkv_model_state *s, const int *keep, int n_keep) {
    model_tp *tp = s->tp;
    const int N = tp->n, L = s->m->cfg.n_layers;
    struct model_cuda_rows *dev[TP_MAX_RANKS] = {0}; /* every rank's twin first (device) */
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < N && rc == TQKV_OK; r++)
        if ((rc = rank_enter(tp, r)) == TQKV_OK && tp->on_device &&
            (rc = dev_filter_build(tp, r, keep, n_keep, &dev[r])) == TQKV_OK)
            rc = injected(r);
    if (rc != TQKV_OK) {
        dev_finish(tp, dev, 0);
        return rc;
    }
    int has_rec = 0;
    for (int r = 0; r < N; r++) has_rec |= tp->rank[r]->rec != NULL;
    if (!has_rec && keep_in_place(keep, n_keep, s->rows)) {
        dev_finish(tp, dev, 1);
        for (int r = 0; r < N; r++) /* in place: cannot fail without recurrent rows */
            rows_filter_inplace(tp->rank[r], keep, n_keep);
        parent_rows(s, n_keep, NULL, NULL);
        return TQKV_OK;
    }
    /* rebuilt: every rank's new layers and arrays [N], and the parent's arrays [N] */
    tqkv_batch **nl[TP_MAX_RANKS] = {0};
    model_recurrent *nr[TP_MAX_RANKS] = {0};
    int *off[TP_MAX_RANKS + 1] = {0}, *len[TP_MAX_RANKS + 1] = {0};
    for (int r = 0; r <= N && rc == TQKV_OK; r++) {
        if (r < N && (rc = rows_select_all(tp->rank[r], keep, n_keep, &nl[r], &nr[r])) == TQKV_OK)
            rc = injected(r);
        if (rc == TQKV_OK) rc = rows_arrays_alloc(n_keep, &off[r], &len[r]);
    }
    if (rc != TQKV_OK) {
        dev_finish(tp, dev, 0);
        for (int r = 0; r <= N; r++) {
            if (r < N) {
                model_state_free_layers(nl[r], L);
                rec_free(nr[r]);
            }
            free(off[r]);
            free(len[r]);
        }
        return rc;
    }
    dev_finish(tp, dev, 1);
    for (int r = 0; r < N; r++) rows_install(tp->rank[r], nl[r], nr[r], n_keep, off[r], len[r]);
    parent_rows(s, n_keep, off[N], len[N]);
    return TQKV_OK;
}

/* Rank r's row `row` into rank r of the fresh sharded state n: its twin's (device) and its
 * host layers. */
static tqkv_status rank_extract(const model_tp *tp, int r, int row, tqkv_model_state *n) {
    tqkv_status rc = rank_enter(tp, r);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && tp->on_device)
        rc = model_cuda_extract(tp->rank[r]->gpu, row, n->tp->rank[r]->gpu);
#endif
    if (rc != TQKV_OK) return rc;
    tqkv_batch **nl = NULL;
    model_recurrent *nr = NULL;
    int *off = NULL, *len = NULL;
    rc = rows_select_all(tp->rank[r], &row, 1, &nl, &nr);
    if (rc == TQKV_OK && (rc = rows_arrays_alloc(1, &off, &len)) != TQKV_OK) {
        model_state_free_layers(nl, tp->rank[r]->m->cfg.n_layers);
        rec_free(nr);
    }
    if (rc == TQKV_OK) rows_install(n->tp->rank[r], nl, nr, 1, off, len);
    return rc;
}

tqkv_status model_tp_extract(const tqkv_model_state *s, int row, tqkv_model_state *n) {
    const model_tp *tp = s->tp;
    if (!n->tp || n->tp->n != tp->n || n->tp->on_device != tp->on_device)
        return tqkv_fail(TQKV_ESTATE, "state extract: the new state is not sharded alike");
    tqkv_status rc = TQKV_OK; /* n is fresh: a failure frees it (rows.c) */
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) rc = rank_extract(tp, r, row, n);
    rank_select(tp, 0);
    if (rc == TQKV_OK) parent_rows(n, 1, NULL, NULL);
    return rc;
}

// ---------------------------------------------------------------------------
// Spec rounds: the ranks' rounds in lockstep (rows.c has checked the state and the round)
// ---------------------------------------------------------------------------

static tqkv_status rank_spec_begin(const model_tp *tp, int r) {
    tqkv_status rc = injected(r);
    if (rc == TQKV_OK) rc = rank_enter(tp, r);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && tp->on_device) return model_cuda_spec_begin(tp->rank[r]->gpu);
#endif
    return rc == TQKV_OK ? rows_spec_begin_host(tp->rank[r]) : rc;
}

/* keep against rank r's round; changes nothing. */
static tqkv_status rank_rollback_check(const model_tp *tp, int r, const int *keep, int n_keep) {
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) return model_cuda_spec_rollback_check(tp->rank[r]->gpu, keep, n_keep);
#endif
    return rows_spec_rollback_check(tp->rank[r], keep, n_keep);
}

/* A checked keep: on the CPU it cannot fail; a device twin's fails only on a CUDA error. */
static tqkv_status rank_rollback(const model_tp *tp, int r, const int *keep, int n_keep) {
    tqkv_status rc = rank_enter(tp, r);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && tp->on_device) return model_cuda_spec_rollback(tp->rank[r]->gpu, keep, n_keep);
#endif
    if (rc == TQKV_OK) rows_spec_rollback_host(tp->rank[r], keep, n_keep);
    return rc;
}

tqkv_status model_tp_spec_begin(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) {
        if ((rc = rank_spec_begin(tp, r)) == TQKV_OK) continue;
        /* rank r opened none; close the rounds opened before it: a rollback keeping
         * nothing of nothing appended */
        const int zero = 0;
        for (int q = 0; q < r; q++) (void)rank_rollback(tp, q, &zero, 1);
    }
    rank_select(tp, 0);
    return rc;
}

tqkv_status model_tp_spec_rollback(tqkv_model_state *s, const int *keep, int n_keep) {
    model_tp *tp = s->tp;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) /* every rank's keep before any change */
        rc = rank_rollback_check(tp, r, keep, n_keep);
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) { /* then every rank, even after an error */
        const tqkv_status e = rank_rollback(tp, r, keep, n_keep);
        if (e != TQKV_OK && rc == TQKV_OK) rc = e; /* the state check then reports the ranks */
    }
    rank_select(tp, 0);
    return rc;
}

tqkv_status model_tp_spec_commit(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n; r++) { /* checked on every rank (rows.c): cannot fail */
#ifdef TQKV_HAVE_CUDA
        if (tp->on_device) {
            tqkv_status e = rank_enter(tp, r);
            if (e == TQKV_OK) e = model_cuda_spec_commit(tp->rank[r]->gpu);
            if (e != TQKV_OK && rc == TQKV_OK) rc = e;
            continue;
        }
#endif
        rows_spec_commit_host(tp->rank[r]);
    }
    rank_select(tp, 0);
    return rc;
}

// ---------------------------------------------------------------------------
// Export / import
// ---------------------------------------------------------------------------
/* "TQKVTP01" | u32 N | u32 rows | N x (u64 length, rank r's tqkv_model_state_export). A
 * rank's export is the unsharded format of its own KV heads, validated as such on import
 * against rank r's geometry. */

static const char TP_MAGIC[8] = {'T', 'Q', 'K', 'V', 'T', 'P', '0', '1'};

static void put_le(uint8_t *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

int model_tp_is_export(const uint8_t *buf, size_t len) {
    return buf && len >= 8 && !memcmp(buf, TP_MAGIC, 8);
}

tqkv_status model_tp_export(const tqkv_model_state *s, uint8_t **out, size_t *len) {
    const model_tp *tp = s->tp;
    uint8_t *blob[TP_MAX_RANKS] = {0};
    size_t bl[TP_MAX_RANKS] = {0}, total = 16;
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) { /* a device rank's: its twin's caches */
        if ((rc = rank_enter(tp, r)) == TQKV_OK)
            rc = tqkv_model_state_export(tp->rank[r], &blob[r], &bl[r]);
        total += 8 + bl[r];
    }
    rank_select(tp, 0);
    uint8_t *buf = rc == TQKV_OK ? malloc(total) : NULL;
    if (rc == TQKV_OK && !buf) rc = tqkv_fail(TQKV_ENOMEM, "state export: out of memory");
    if (rc == TQKV_OK) {
        memcpy(buf, TP_MAGIC, 8);
        put_le(buf + 8, (uint64_t)tp->n, 4);
        put_le(buf + 12, (uint64_t)s->rows, 4);
        size_t at = 16;
        for (int r = 0; r < tp->n; r++) {
            put_le(buf + at, bl[r], 8);
            memcpy(buf + at + 8, blob[r], bl[r]);
            at += 8 + bl[r];
        }
        *out = buf;
        *len = total;
    }
    for (int r = 0; r < tp->n; r++) free(blob[r]);
    return rc;
}

/* The header's refusals: not sharded, another N, a bad header. */
static tqkv_status import_header(const tqkv_model_state_params *p, const uint8_t *buf,
                                 size_t len, int *n, int *rows) {
    const int want = model_tp_ranks(p) ? model_tp_ranks(p) : 1; /* a forced 1-rank state: 1 */
    if (!model_tp_is_export(buf, len))
        return tqkv_fail(TQKV_EINVAL, "state import: an unsharded state export does not import "
                         "into a state of tensor_parallel %d (export and import with the same "
                         "tensor_parallel)", want);
    if (len < 16) return tqkv_fail(TQKV_ECORRUPT, "state import: truncated sharded header");
    const uint64_t N = get_le(buf + 8, 4), R = get_le(buf + 12, 4);
    if (N < 1 || N > TP_MAX_RANKS)
        return tqkv_fail(TQKV_ECORRUPT, "state import: bad rank count %llu", (unsigned long long)N);
    if (!model_tp_ranks(p))
        return tqkv_fail(TQKV_EINVAL, "state import: the export is sharded over %llu ranks; "
                         "import it into a state of tensor_parallel %llu", (unsigned long long)N,
                         (unsigned long long)N);
    if ((int)N != want)
        return tqkv_fail(TQKV_EINVAL, "state import: the export is sharded over %llu ranks, the "
                         "state over %d (tensor_parallel must match)", (unsigned long long)N, want);
    if (R < 1 || R > (1u << 20))
        return tqkv_fail(TQKV_ECORRUPT, "state import: bad row count %llu", (unsigned long long)R);
    *n = (int)N;
    *rows = (int)R;
    return TQKV_OK;
}

/* Rank r's export (buf [len]) for rank r of the fresh state s: on the CPU a rank state of
 * its own in *got (validated against rank r's geometry); on the device restored the same way
 * on the host (*got NULL after), then uploaded into rank r's twin. */
static tqkv_status rank_import(tqkv_model_state *s, int r, const uint8_t *buf, size_t len,
                               int rows, tqkv_model_state **got) {
    const model_tp *tp = s->tp;
    tqkv_model_state_params p = tp->rank[r]->p;
    if (tp->on_device) { /* f32 KV: the twin's dense bf16 cache has no state format */
        if (p.k_format == TQKV_F32 || p.v_format == TQKV_F32)
            return tqkv_fail(TQKV_EUNSUPPORTED, "state import: a device state with f32 KV holds "
                             "a dense bf16 cache, which has no state format (import into tq4 or "
                             "tq3 KV)");
        p.device = 0;
        p.device_fast_gemm = 0;
    }
    tqkv_status rc = tqkv_model_state_import(got, tp->model[r], &p, buf, len);
    if (rc == TQKV_OK && tqkv_model_state_rows(*got) != rows)
        rc = tqkv_fail(TQKV_ECORRUPT, "state import: rank %d holds %d rows, header %d", r,
                       tqkv_model_state_rows(*got), rows);
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && tp->on_device) {
        if ((rc = rank_enter(tp, r)) == TQKV_OK)
            rc = model_cuda_upload(tp->rank[r]->gpu, (*got)->layers, (*got)->rec, rows);
        rank_select(tp, 0);
        tqkv_model_state_free(*got); /* host memory: its GPU need not be current */
        *got = NULL;
    }
#endif
    return rc;
}

tqkv_status model_tp_import(tqkv_model_state **out, const tqkv_model *m,
                            const tqkv_model_state_params *p_in, const uint8_t *buf, size_t len) {
    int N = 0, rows = 0;
    tqkv_status rc = import_header(p_in, buf, len, &N, &rows);
    if (rc != TQKV_OK) return rc;
    tqkv_model_state_params p = *p_in;
    p.rows = rows;
    tqkv_model_state *s = NULL; /* the expected shape of every rank */
    if ((rc = tqkv_model_state_init(&s, m, &p)) != TQKV_OK) return rc;
    tqkv_model_state *got[TP_MAX_RANKS] = {0};
    size_t at = 16;
    for (int r = 0; r < N && rc == TQKV_OK; r++) {
        if (len - at < 8) {
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: truncated before rank %d", r);
            break;
        }
        const uint64_t sl = get_le(buf + at, 8);
        at += 8;
        if (sl > len - at) {
            rc = tqkv_fail(TQKV_ECORRUPT, "state import: rank %d truncated", r);
            break;
        }
        rc = rank_import(s, r, buf + at, (size_t)sl, rows, &got[r]);
        at += (size_t)sl;
    }
    if (rc == TQKV_OK && at != len)
        rc = tqkv_fail(TQKV_ECORRUPT, "state import: %zu trailing bytes", len - at);
    if (rc == TQKV_OK) {
        for (int r = 0; r < N && got[r]; r++) { /* the imported rank states replace the fresh
                                                    * ones (CPU; a device rank took the upload) */
            tqkv_model_state_free(s->tp->rank[r]);
            s->tp->rank[r] = got[r];
            got[r] = NULL;
        }
        s->layers = s->tp->rank[0]->layers;
        rc = tqkv_model_state_check(s); /* the ranks agree on every row's position */
    }
    if (rc != TQKV_OK) {
        for (int r = 0; r < N; r++) tqkv_model_state_free(got[r]);
        tqkv_model_state_free(s);
        return rc;
    }
    *out = s;
    return TQKV_OK;
}

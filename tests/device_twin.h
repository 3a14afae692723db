/*
 * device_twin.h - helpers for the tests that run a model state on the device beside its CPU
 * twin (test_cuda_hybrid.c, test_cuda_gemma4.c): state params and init, random tokens,
 * offsets / logits / export comparisons, the GPU-vs-CPU logits bound, the sections of a
 * "TQKVMS02" export, the decode-graph counters, graph twins and twin decode steps.
 * The includer defines TWIN_MODEL (the model the current test runs), TWIN_V (its vocab) and
 * TWIN_THREADS (CPU threads per state) first.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_TESTS_DEVICE_TWIN_H
#define TQKV_TESTS_DEVICE_TWIN_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_helpers.h"
#include "testutil.h"
#include "tqkv_model.h"
#include "model/cuda/model_cuda.h"
#include "model/model_impl.h"

static inline tqkv_model_state_params hparams(int device, tqkv_format f, int rows) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = p.v_format = f;
    p.threads = TWIN_THREADS;
    p.device = device;
    return p;
}

static inline tqkv_model_state *mk(const tqkv_model_state_params *p) {
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, TWIN_MODEL, p) != TQKV_OK)
        fail_msg("state init (device %d, %s): %s", p->device, tqkv_format_name(p->k_format),
                 tqkv_last_error());
    return s;
}

static inline tqkv_model_state *new_state(int rows, tqkv_format f, int device) {
    const tqkv_model_state_params p = hparams(device, f, rows);
    return mk(&p);
}

static inline void random_tokens(test_rng *r, int32_t *t, size_t n) {
    for (size_t i = 0; i < n; i++) t[i] = rng_int(r, 1, TWIN_V - 1);
}

static inline void expect_offsets(const tqkv_model_state *s, const int *want, const char *what) {
    int off[8];
    const int R = tqkv_model_state_rows(s);
    OK(tqkv_model_state_offsets(s, off));
    for (int i = 0; i < R; i++)
        if (off[i] != want[i])
            fail_msg("%s: row %d holds %d tokens, expected %d", what, i, off[i], want[i]);
    OK(tqkv_model_state_check(s));
}

static inline void expect_same(const float *a, const float *b, size_t n, const char *what, int i) {
    if (memcmp(a, b, sizeof(float) * n)) fail_msg("%s (%d): logits differ", what, i);
}

static inline uint8_t *export_of(const tqkv_model_state *s, size_t *len) {
    uint8_t *b = NULL;
    OK(tqkv_model_state_export(s, &b, len));
    return b;
}

static inline void assert_export_equal(const tqkv_model_state *s, const uint8_t *b, size_t len,
                                       const char *what) {
    size_t l2 = 0;
    uint8_t *b2 = export_of(s, &l2);
    if (l2 != len || memcmp(b2, b, len)) fail_msg("%s: the export bytes differ", what);
    free(b2);
}

static inline int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* GPU logits g vs CPU logits c [n, V]: the median position's rel L2 within tol_med, every
 * position's within tol_worst, and every argmax flip explained by the position's error: where
 * the GPU's top token a differs from the CPU's b, the CPU's own logits must put them within
 * 2 e of each other, e = max_i |g_i - c_i| at that position (logits that far apart cannot
 * swap under an error of e; closer ones legitimately can: near-ties). A fixed share of
 * equal argmaxes (90% before) failed on legitimate near-ties, e.g. 9 / 10 extend positions
 * at the floor; a broken forward fails the L2 bounds and flips with no near-tie behind them,
 * and at least half the positions must still agree. */
static inline void expect_close(const char *what, const float *g, const float *c, int n,
                                double tol_med, double tol_worst) {
    double *e = malloc(sizeof(double) * (size_t)n);
    int same = 0, unexplained = 0;
    double worst_gap = 0; /* of the flips: CPU logit gap / (2 e) */
    for (int i = 0; i < n; i++) {
        const float *gi = g + (size_t)i * TWIN_V, *ci = c + (size_t)i * TWIN_V;
        e[i] = rel_l2(gi, ci, (size_t)TWIN_V);
        if (e[i] != e[i]) e[i] = 1e30; /* NaN fails */
        const int a = argmax(gi, TWIN_V), b = argmax(ci, TWIN_V);
        if (a == b) {
            same++;
            continue;
        }
        double ea = 0;
        for (int v = 0; v < TWIN_V; v++) {
            const double d = fabs((double)gi[v] - ci[v]);
            ea = d > ea ? d : ea;
        }
        const double gap = (double)ci[b] - ci[a], r = ea > 0 ? gap / (2 * ea) : INFINITY;
        worst_gap = r > worst_gap ? r : worst_gap;
        unexplained += !(r <= 1.0);
    }
    qsort(e, (size_t)n, sizeof(double), cmp_double);
    const double med = e[n / 2], worst = e[n - 1];
    free(e);
    printf("%s: rel L2 median %.3g worst %.3g, argmax equal %d/%d (flips: CPU gap up to %.2f of "
           "2 x the error)\n", what, med, worst, same, n, worst_gap);
    if (!(med < tol_med) || !(worst < tol_worst) || unexplained || 2 * same < n)
        fail_msg("%s GPU vs CPU: median %g (< %g), worst %g (< %g), argmax %d/%d (>= 50%%), %d "
                 "flips not explained by the error", what, med, tol_med, worst, tol_worst, same, n,
                 unexplained);
}

/* Greedy decode of both twins (GPU sg, CPU sc; R rows) for `steps` steps from the CPU's logits
 * of the last position, last [R, V] rows `stride` floats apart: both take the CPU's greedy
 * token, so they stay on the same sequence. Step t's logits go to lg / lc + t R V. */
static inline void twin_greedy(tqkv_model_state *sg, tqkv_model_state *sc, int R, const float *last,
                               size_t stride, int steps, float *lg, float *lc) {
    int32_t next[16];
    assert_true(R <= 16);
    for (int i = 0; i < R; i++) next[i] = argmax(last + (size_t)i * stride, TWIN_V);
    for (int t = 0; t < steps; t++) {
        float *g = lg + (size_t)t * R * TWIN_V, *c = lc + (size_t)t * R * TWIN_V;
        OK(tqkv_model_decode(TWIN_MODEL, sg, next, g));
        OK(tqkv_model_decode(TWIN_MODEL, sc, next, c));
        for (int i = 0; i < R; i++) next[i] = argmax(c + (size_t)i * TWIN_V, TWIN_V);
    }
}

/* Lengths of the L layer sections and the recurrent one ([L]) of a "TQKVMS02" export. */
static inline void sections(const uint8_t *b, size_t len, int L, uint64_t *out) {
    if (len < 16 || memcmp(b, "TQKVMS02", 8)) fail_msg("export: no TQKVMS02 header");
    uint32_t nl = 0;
    memcpy(&nl, b + 8, 4); /* little endian host */
    assert_int_equal(nl, L);
    size_t at = 16;
    for (int l = 0; l <= L; l++) {
        if (at + 8 > len) fail_msg("export: section %d past the end", l);
        memcpy(&out[l], b + at, 8);
        at += 8 + (size_t)out[l];
    }
    assert_int_equal(at, len);
}

static inline model_cuda_graph_stats graph_stats(const tqkv_model_state *s) {
    model_cuda_graph_stats gs;
    model_cuda_graph_stats_get(s->gpu, &gs);
    return gs;
}

/* Graph twins: s[0] runs its decode steps kernel by kernel, s[1] as CUDA graphs, both on
 * `rows` rows prefilled with prompt [rows, n] (format f, q8 window `window`).
 * TQKV_CUDA_GRAPHS is unset meanwhile (=0 would make the graph twin a second
 * kernel-by-kernel one); twin_graphs_free puts it back and frees both. */
typedef struct {
    tqkv_model_state *s[2];
    char *env; /* TQKV_CUDA_GRAPHS as it was, or NULL */
} twin_graphs;

static inline twin_graphs twin_graphs_init(tqkv_format f, int window, int rows,
                                           const int32_t *prompt, int n) {
    twin_graphs t;
    t.env = getenv("TQKV_CUDA_GRAPHS") ? strdup(getenv("TQKV_CUDA_GRAPHS")) : NULL;
    unsetenv("TQKV_CUDA_GRAPHS");
    for (int tw = 0; tw < 2; tw++) {
        tqkv_model_state_params p = hparams(1, f, rows);
        p.device_graphs = tw;
        p.window = window;
        t.s[tw] = mk(&p);
        OK(tqkv_model_prefill(TWIN_MODEL, t.s[tw], prompt, NULL, n, TQKV_LOGITS_NONE, NULL));
    }
    return t;
}

static inline void twin_graphs_free(twin_graphs *t) {
    if (t->env) setenv("TQKV_CUDA_GRAPHS", t->env, 1);
    free(t->env);
    tqkv_model_state_free(t->s[0]);
    tqkv_model_state_free(t->s[1]);
}

static inline void twin_steps(tqkv_model_state *const *s, int steps, test_rng *r, float *l0,
                              float *l1, const char *phase) {
    const int R = tqkv_model_state_rows(s[0]);
    int32_t tok[8];
    for (int t = 0; t < steps; t++) {
        random_tokens(r, tok, (size_t)R);
        OK(tqkv_model_decode(TWIN_MODEL, s[0], tok, l0));
        OK(tqkv_model_decode(TWIN_MODEL, s[1], tok, l1));
        expect_same(l0, l1, (size_t)R * TWIN_V, phase, t);
    }
}

#endif

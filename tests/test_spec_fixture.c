/*
 * test_spec_fixture.c - speculative rounds on the CPU for the trained Gemma 4 and Qwen 3.5
 * fixtures (../shared/models/gemma4-code-30m, ../shared/models/qwen35-code-hybrid-30m;
 * each test SKIPPED, visibly, when its fixture is absent; exit 77 when both are).
 * For tq4, tq3 and f32 KV, rows of different lengths prefilled as one left-padded batch:
 *  - a verification window of K + 1 tokens (extend_as_decode, LOGITS_ALL) gives logits
 *    bitwise equal to the same tokens fed as single decodes to a copy of the state;
 *  - after a per-row rollback (keeps 0..K+1) the state continues (plain decodes, then a
 *    second round from the rolled-back state, committed) bitwise like each row alone that
 *    never saw the rejected tokens; offsets and the state check agree.
 * Gemma 4 (window 512): rows sit just below the window, just below window + slack (the
 * bounded sliding caches start dropping during the round), past it (a cache that drops on
 * every decode) and short; one format runs with a slack smaller than the window's length.
 * Qwen 3.5: the recurrent rows roll back to each row's keep.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/arch/gemma4/gemma4.h" /* which layers slide */
#include "model/model_impl.h"
#include "testutil.h"
#include "tqkv_model.h"

#define OK(x)                                                                                     \
    do {                                                                                          \
        tqkv_status rc_ = (x);                                                                    \
        if (rc_ != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

enum { R = 4, K = 4, W = K + 1 };

typedef struct {
    const char *rel; /* under ../shared */
    tqkv_model *m;
    int V, gemma;
} fixture;

static fixture g_fx[2] = {{"models/gemma4-code-30m", NULL, 0, 1},
                          {"models/qwen35-code-hybrid-30m", NULL, 0, 0}};

static tqkv_model_state_params params(tqkv_format f, int slack, int as_decode) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = R;
    p.k_format = p.v_format = f;
    p.window_slack = slack;
    p.threads = 2;
    p.extend_as_decode = as_decode;
    return p;
}

static void random_tokens(test_rng *r, int V, int32_t *t, int n) {
    for (int i = 0; i < n; i++) t[i] = rng_int(r, 3, V - 1);
}

/* Row r of `a` ([rows, V] or one row) against `b`, bitwise. */
static void same_row(const fixture *fx, const float *a, const float *b, const char *what, int r,
                     int j) {
    if (memcmp(a, b, sizeof(float) * (size_t)fx->V)) {
        int d = 0;
        for (int v = 0; v < fx->V; v++) d += a[v] != b[v];
        fail_msg("%s: %s row %d token %d: %d of %d logits differ", fx->rel, what, r, j, d, fx->V);
    }
}

/* Each row's own reference state decodes its token; every row's logits in lg [R, V] must
 * equal its reference's. */
static void refs_decode(const fixture *fx, tqkv_model_state **ref, const int32_t *tok,
                        const float *lg, float *l1, const char *what, int j) {
    for (int r = 0; r < R; r++) {
        OK(tqkv_model_decode(fx->m, ref[r], &tok[r], l1));
        if (lg) same_row(fx, lg + (size_t)r * fx->V, l1, what, r, j);
    }
}

/* Every KV layer of s holds each row's position (full layers) or at most window + slack
 * tokens (bounded sliding layers): after a forward outside a round or a round's begin. */
static void sliding_bounded(const fixture *fx, tqkv_model_state *s, int keep) {
    int pos[R], off[R], bounded = 0;
    OK(tqkv_model_state_offsets(s, pos));
    for (int l = 0; l < tqkv_model_get_config(fx->m)->n_layers; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (!b) continue; /* KV-shared: reads its donor */
        OK(tqkv_batch_offsets(b, off, NULL));
        const int sliding = gemma4_of(fx->m)->cfg.sliding[l];
        for (int r = 0; r < R; r++) {
            if (!sliding) {
                assert_int_equal(off[r], pos[r]);
                continue;
            }
            assert_int_equal(off[r], pos[r] < keep ? pos[r] : keep);
            bounded += pos[r] > keep;
        }
    }
    assert_true(bounded > 0); /* rows past window + slack exist in every case */
}

static void spec_case(fixture *fx, tqkv_format f, int slack, test_rng *rng) {
    if (!fx->m) {
        printf("SKIPPED: ../shared/%s absent\n", fx->rel);
        skip();
    }
    const int V = fx->V;
    /* Gemma 4: below the window (crosses 512 in the round), below window + slack (the
     * sliding caches start dropping in the round), past it, short. Qwen 3.5: short rows. */
    const int keep_sl = 512 + slack;
    int lens[R];
    if (fx->gemma) {
        lens[0] = 512 - 2;
        lens[1] = keep_sl - 2;
        lens[2] = keep_sl + rng_int(rng, 10, 60);
        lens[3] = rng_int(rng, 5, 40);
    } else {
        for (int r = 0; r < R; r++) lens[r] = rng_int(rng, 2, 150);
    }
    int n = 0;
    for (int r = 0; r < R; r++) n = lens[r] > n ? lens[r] : n;
    int32_t *tok = calloc((size_t)R * n, sizeof(int32_t));
    for (int r = 0; r < R; r++) random_tokens(rng, V, tok + (size_t)r * n + (n - lens[r]), lens[r]);
    float *la = malloc(sizeof(float) * (size_t)R * W * V), *lb = malloc(sizeof(float) * (size_t)R * V),
          *l1 = malloc(sizeof(float) * (size_t)V);

    /* one left-padded prefill; A (verification windows) and B (single decodes) are copies
     * of it, ref[r] row r alone */
    tqkv_model_state_params pa = params(f, slack, 1), pb = params(f, slack, 0);
    tqkv_model_state *s0 = NULL, *A = NULL, *B = NULL, *ref[R];
    OK(tqkv_model_state_init(&s0, fx->m, &pb));
    OK(tqkv_model_prefill(fx->m, s0, tok, lens, n, TQKV_LOGITS_NONE, NULL));
    uint8_t *bytes = NULL;
    size_t len = 0;
    OK(tqkv_model_state_export(s0, &bytes, &len));
    OK(tqkv_model_state_import(&A, fx->m, &pa, bytes, len));
    OK(tqkv_model_state_import(&B, fx->m, &pb, bytes, len));
    for (int r = 0; r < R; r++) OK(tqkv_model_state_extract_row(s0, r, &ref[r]));
    free(bytes);
    tqkv_model_state_free(s0);

    char what[96];
    /* ---- round 1: the window equals single decodes; per-row rollback ---- */
    int32_t win[R * W], t1[R];
    random_tokens(rng, V, win, R * W);
    int before[R], after[R], keep[R] = {0, W, rng_int(rng, 1, K), rng_int(rng, 1, W)};
    OK(tqkv_model_state_offsets(A, before));
    OK(tqkv_model_state_spec_begin(A));
    OK(tqkv_model_extend(fx->m, A, win, W, TQKV_LOGITS_ALL, la));
    OK(tqkv_model_state_check(A));
    for (int j = 0; j < W; j++) {
        for (int r = 0; r < R; r++) t1[r] = win[r * W + j];
        OK(tqkv_model_decode(fx->m, B, t1, lb));
        snprintf(what, sizeof what, "%s slack %d: window vs single decodes", tqkv_format_name(f),
                 slack);
        for (int r = 0; r < R; r++) same_row(fx, la + ((size_t)r * W + j) * V, lb + (size_t)r * V, what, r, j);
    }
    OK(tqkv_model_state_spec_rollback(A, keep, R));
    OK(tqkv_model_state_check(A));
    OK(tqkv_model_state_offsets(A, after));
    for (int r = 0; r < R; r++) {
        assert_int_equal(after[r], before[r] + keep[r]);
        for (int j = 0; j < keep[r]; j++) { /* the rows alone never see the rejected tokens */
            OK(tqkv_model_decode(fx->m, ref[r], &win[r * W + j], l1));
            snprintf(what, sizeof what, "%s slack %d: window vs the row alone", tqkv_format_name(f),
                     slack);
            same_row(fx, la + ((size_t)r * W + j) * V, l1, what, r, j);
        }
    }
    /* ---- round 2 straight from the rolled-back state, committed: its begin bounds the
     * sliding layers again ---- */
    OK(tqkv_model_state_spec_begin(A));
    if (fx->gemma) sliding_bounded(fx, A, keep_sl);
    random_tokens(rng, V, win, R * W);
    OK(tqkv_model_extend(fx->m, A, win, W, TQKV_LOGITS_ALL, la));
    OK(tqkv_model_state_spec_commit(A));
    OK(tqkv_model_state_check(A));
    for (int r = 0; r < R; r++)
        for (int j = 0; j < W; j++) {
            OK(tqkv_model_decode(fx->m, ref[r], &win[r * W + j], l1));
            snprintf(what, sizeof what, "%s slack %d: second window vs the row alone",
                     tqkv_format_name(f), slack);
            same_row(fx, la + ((size_t)r * W + j) * V, l1, what, r, j);
        }
    /* ---- round 3: draft-like single decodes inside the round (the first right after the
     * commit, on sliding layers holding up to K + 1 more than window + slack), per-row
     * rollback; then plain decodes: all like the rows alone ---- */
    OK(tqkv_model_state_spec_begin(A));
    int32_t d3[2][R];
    for (int j = 0; j < 2; j++) {
        random_tokens(rng, V, d3[j], R);
        OK(tqkv_model_decode(fx->m, A, d3[j], la + (size_t)j * R * V));
    }
    int keep3[R] = {2, 0, 1, rng_int(rng, 0, 2)};
    OK(tqkv_model_state_spec_rollback(A, keep3, R));
    OK(tqkv_model_state_check(A));
    for (int r = 0; r < R; r++)
        for (int j = 0; j < keep3[r]; j++) {
            OK(tqkv_model_decode(fx->m, ref[r], &d3[j][r], l1));
            snprintf(what, sizeof what, "%s slack %d: decode in a round vs the row alone",
                     tqkv_format_name(f), slack);
            same_row(fx, la + ((size_t)j * R + r) * V, l1, what, r, j);
        }
    for (int j = 0; j < 2; j++) {
        random_tokens(rng, V, t1, R);
        OK(tqkv_model_decode(fx->m, A, t1, lb));
        OK(tqkv_model_state_check(A));
        snprintf(what, sizeof what, "%s slack %d: decode after the rounds", tqkv_format_name(f),
                 slack);
        refs_decode(fx, ref, t1, lb, l1, what, j);
    }
    if (fx->gemma) sliding_bounded(fx, A, keep_sl); /* after a forward outside a round */
    printf("%s %s slack %d: rows %d %d %d %d, keeps %d %d %d %d: windows == single decodes, "
           "rollback == rows alone\n", fx->rel, tqkv_format_name(f), slack, lens[0], lens[1],
           lens[2], lens[3], keep[0], keep[1], keep[2], keep[3]);
    tqkv_model_state_free(A);
    tqkv_model_state_free(B);
    for (int r = 0; r < R; r++) tqkv_model_state_free(ref[r]);
    free(tok);
    free(la);
    free(lb);
    free(l1);
}

static test_rng g_rng;

static void test_gemma4_tq4(void **st) { (void)st; spec_case(&g_fx[0], TQKV_TQ4, 32, &g_rng); }
static void test_gemma4_tq3(void **st) { (void)st; spec_case(&g_fx[0], TQKV_TQ3, 3, &g_rng); }
static void test_gemma4_f32(void **st) { (void)st; spec_case(&g_fx[0], TQKV_F32, 32, &g_rng); }
static void test_qwen35_tq4(void **st) { (void)st; spec_case(&g_fx[1], TQKV_TQ4, 32, &g_rng); }
static void test_qwen35_tq3(void **st) { (void)st; spec_case(&g_fx[1], TQKV_TQ3, 32, &g_rng); }
static void test_qwen35_f32(void **st) { (void)st; spec_case(&g_fx[1], TQKV_F32, 32, &g_rng); }

int main(void) {
    int any = 0;
    for (int i = 0; i < 2; i++) {
        char p[1024];
        const char *dir = shared_path(g_fx[i].rel, p, sizeof p);
        tqkv_model_load_params lp = tqkv_model_load_params_default();
        if (!dir) {
            printf("test_spec_fixture: ../shared/%s absent: its tests SKIPPED\n", g_fx[i].rel);
            continue;
        }
        if (tqkv_model_load(&g_fx[i].m, dir, &lp) != TQKV_OK) {
            fprintf(stderr, "load %s: %s\n", dir, tqkv_last_error());
            return 1;
        }
        g_fx[i].V = tqkv_model_get_config(g_fx[i].m)->vocab_size;
        any = 1;
    }
    if (!any) {
        printf("SKIPPED: ../shared fixtures absent\n");
        return 77;
    }
    rng_init(&g_rng, test_seed());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemma4_tq4), cmocka_unit_test(test_gemma4_tq3),
        cmocka_unit_test(test_gemma4_f32), cmocka_unit_test(test_qwen35_tq4),
        cmocka_unit_test(test_qwen35_tq3), cmocka_unit_test(test_qwen35_f32),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < 2; i++) tqkv_model_free(g_fx[i].m);
    return rc;
}

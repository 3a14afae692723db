/*
 * test_model_rows.c - row operations of a model state (src/model/state/rows.c) on the
 * bundled model: a state whose rows are merged, filtered, extracted, rolled back or
 * exported gives logits bitwise equal to fresh per-row states fed the same tokens; a
 * window extend with extend_as_decode equals single decodes; failures (bad token, context
 * limit, bad keep, mismatched merge) leave every byte of the state as it was.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"
#include "tqkv_model.h"

static tqkv_model *g_m;
static int V;

#define OK(x)                                                                                     \
    do {                                                                                          \
        tqkv_status rc_ = (x);                                                                    \
        if (rc_ != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

static tqkv_model_state *new_state(int rows, tqkv_format k, tqkv_format v, int window) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = k;
    p.v_format = v;
    p.window = window;
    p.window_slack = 8;
    p.threads = 2;
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, g_m, &p));
    return s;
}

static void random_tokens(test_rng *r, int32_t *t, int n) {
    for (int i = 0; i < n; i++) t[i] = rng_int(r, 1, V - 1);
}

/* Export bytes of a state (for "unchanged" checks). */
static uint8_t *snap(const tqkv_model_state *s, size_t *len) {
    uint8_t *b = NULL;
    OK(tqkv_model_state_export(s, &b, len));
    return b;
}

static void assert_same_state(const tqkv_model_state *s, const uint8_t *b, size_t len) {
    size_t l2;
    uint8_t *b2 = snap(s, &l2);
    assert_int_equal(l2, len);
    assert_memory_equal(b2, b, len);
    free(b2);
}

/* Row reference: a fresh 1-row state fed prompt then the decode tokens. */
typedef struct {
    tqkv_model_state *s;
    int32_t prompt[300];
    int n;
} ref_row;

// ---------------------------------------------------------------------------
// merge / filter / extract vs fresh rows
// ---------------------------------------------------------------------------

static void test_merge_filter_extract_bitwise(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 101);
    const tqkv_format fm[][2] = {{TQKV_TQ4, TQKV_TQ4}, {TQKV_TQ3, TQKV_F16}};
    for (int f = 0; f < 2; f++) {
        int window = f == 0 ? 16 : 0;
        enum { R = 4, STEPS = 5 };
        ref_row ref[R];
        tqkv_model_state *src[R];
        float *la = malloc(sizeof(float) * (size_t)R * V), *lb = malloc(sizeof(float) * (size_t)V);
        for (int i = 0; i < R; i++) {
            ref[i].n = rng_int(&r, 1, 120);
            random_tokens(&r, ref[i].prompt, ref[i].n);
            ref[i].s = new_state(1, fm[f][0], fm[f][1], window);
            src[i] = new_state(1, fm[f][0], fm[f][1], window);
            OK(tqkv_model_prefill(g_m, ref[i].s, ref[i].prompt, NULL, ref[i].n, TQKV_LOGITS_NONE, NULL));
            OK(tqkv_model_prefill(g_m, src[i], ref[i].prompt, NULL, ref[i].n, TQKV_LOGITS_NONE, NULL));
        }
        /* run: rows 0,1 merged, decoded, then 2,3 join, then row 1 leaves, row 0 extracted */
        tqkv_model_state *run = new_state(1, fm[f][0], fm[f][1], window);
        OK(tqkv_model_state_filter(run, NULL, 0));
        assert_int_equal(tqkv_model_state_rows(run), 0);
        { /* a state with no rows refuses a forward (it holds no buffers to run on) */
            const int32_t none[1] = {0};
            assert_int_equal(tqkv_model_decode(g_m, run, none, NULL), TQKV_ESTATE);
        }
        OK(tqkv_model_state_merge(run, src, 2));
        int rows[R] = {0, 1, -1, -1}, nr = 2;
        for (int step = 0; step < STEPS; step++) {
            if (step == 2) { /* newcomers 2 and 3 prefilled as their own left-padded batch */
                int n2 = ref[2].n, n3 = ref[3].n, nn = n2 > n3 ? n2 : n3, lens[2] = {n2, n3};
                int32_t *tk = calloc((size_t)2 * nn, sizeof(int32_t)); /* [2, nn] */
                memcpy(tk + (nn - n2), ref[2].prompt, sizeof(int32_t) * (size_t)n2);
                memcpy(tk + nn + (nn - n3), ref[3].prompt, sizeof(int32_t) * (size_t)n3);
                tqkv_model_state *pair = new_state(2, fm[f][0], fm[f][1], window);
                OK(tqkv_model_prefill(g_m, pair, tk, lens, nn, TQKV_LOGITS_NONE, NULL));
                OK(tqkv_model_state_merge(run, &pair, 1));
                tqkv_model_state_free(pair);
                free(tk);
                rows[2] = 2;
                rows[3] = 3;
                nr = 4;
            }
            if (step == 3) { /* row 1 leaves: keep 3, 0, 2 (reordered) */
                int keep[3] = {2, 0, 3};
                OK(tqkv_model_state_filter(run, keep, 3));
                int nrows[R] = {rows[2], rows[0], rows[3], -1};
                memcpy(rows, nrows, sizeof rows);
                nr = 3;
            }
            assert_int_equal(tqkv_model_state_rows(run), nr);
            OK(tqkv_model_state_check(run));
            int32_t tok[R];
            for (int i = 0; i < nr; i++) tok[i] = rng_int(&r, 1, V - 1);
            OK(tqkv_model_decode(g_m, run, tok, la));
            for (int i = 0; i < nr; i++) {
                OK(tqkv_model_decode(g_m, ref[rows[i]].s, &tok[i], lb));
                assert_memory_equal(la + (size_t)i * V, lb, sizeof(float) * (size_t)V);
            }
            /* rows that are not in run get the same token stream only while in it */
        }
        /* extract row 1 of run (which is ref row 0) and continue it alone */
        tqkv_model_state *one = NULL;
        OK(tqkv_model_state_extract_row(run, 1, &one));
        int32_t t = 7;
        OK(tqkv_model_decode(g_m, one, &t, la));
        OK(tqkv_model_decode(g_m, ref[rows[1]].s, &t, lb));
        assert_memory_equal(la, lb, sizeof(float) * (size_t)V);
        /* export / import round trip of the running state */
        size_t len;
        uint8_t *b = snap(run, &len);
        tqkv_model_state_params p = tqkv_model_state_params_default();
        p.k_format = fm[f][0];
        p.v_format = fm[f][1];
        p.window = window;
        p.window_slack = 8;
        tqkv_model_state *imp = NULL;
        OK(tqkv_model_state_import(&imp, g_m, &p, b, len));
        assert_same_state(imp, b, len);
        p.k_format = TQKV_Q8; /* wrong format: refused with a message */
        tqkv_model_state *bad = NULL;
        assert_int_equal(tqkv_model_state_import(&bad, g_m, &p, b, len), TQKV_EINVAL);
        assert_non_null(strstr(tqkv_last_error(), "format"));
        assert_null(bad);
        free(b);
        tqkv_model_state_free(imp);
        tqkv_model_state_free(one);
        tqkv_model_state_free(run);
        for (int i = 0; i < R; i++) {
            tqkv_model_state_free(ref[i].s);
            tqkv_model_state_free(src[i]);
        }
        free(la);
        free(lb);
    }
}

// ---------------------------------------------------------------------------
// spec rounds and extend_as_decode
// ---------------------------------------------------------------------------

static void test_spec_rollback_and_exact_extend(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 202);
    enum { R = 3, K = 4 };
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 2;
    p.extend_as_decode = 1;
    tqkv_model_state *run = NULL, *ref[R], *src[R];
    int32_t prompt[R][64];
    int n[R];
    float *lw = malloc(sizeof(float) * (size_t)R * (K + 1) * V), *lb = malloc(sizeof(float) * (size_t)V);
    p.rows = 1;
    for (int i = 0; i < R; i++) {
        n[i] = rng_int(&r, 1, 60);
        random_tokens(&r, prompt[i], n[i]);
        OK(tqkv_model_state_init(&ref[i], g_m, &p));
        OK(tqkv_model_state_init(&src[i], g_m, &p));
        OK(tqkv_model_prefill(g_m, ref[i], prompt[i], NULL, n[i], TQKV_LOGITS_NONE, NULL));
        OK(tqkv_model_prefill(g_m, src[i], prompt[i], NULL, n[i], TQKV_LOGITS_NONE, NULL));
    }
    OK(tqkv_model_state_extract_row(src[0], 0, &run));
    OK(tqkv_model_state_merge(run, src + 1, R - 1));
    for (int round = 0; round < 4; round++) {
        int32_t win[R * (K + 1)];
        random_tokens(&r, win, R * (K + 1));
        int keep[R], before[R], after[R];
        for (int i = 0; i < R; i++) keep[i] = rng_int(&r, 0, K + 1);
        OK(tqkv_model_state_offsets(run, before));
        OK(tqkv_model_state_spec_begin(run));
        assert_int_equal(tqkv_model_state_spec_active(run), 1);
        assert_int_equal(tqkv_model_state_spec_begin(run), TQKV_ESTATE);
        OK(tqkv_model_extend(g_m, run, win, K + 1, TQKV_LOGITS_ALL, lw));
        /* a keep beyond the appended tokens is refused and changes nothing */
        int bad[R] = {0, K + 2, 0};
        assert_int_equal(tqkv_model_state_spec_rollback(run, bad, R), TQKV_ERANGE);
        assert_int_equal(tqkv_model_state_spec_active(run), 1);
        OK(tqkv_model_state_offsets(run, after));
        for (int i = 0; i < R; i++) assert_int_equal(after[i], before[i] + K + 1);
        OK(tqkv_model_state_spec_rollback(run, keep, R));
        OK(tqkv_model_state_offsets(run, after));
        /* kept positions: window logits equal single decodes bit for bit */
        for (int i = 0; i < R; i++) {
            assert_int_equal(after[i], before[i] + keep[i]);
            for (int j = 0; j < keep[i]; j++) {
                OK(tqkv_model_decode(g_m, ref[i], &win[i * (K + 1) + j], lb));
                assert_memory_equal(lw + ((size_t)i * (K + 1) + j) * V, lb,
                                    sizeof(float) * (size_t)V);
            }
        }
    }
    int32_t t[R] = {5, 6, 7};
    OK(tqkv_model_decode(g_m, run, t, lw));
    for (int i = 0; i < R; i++) {
        OK(tqkv_model_decode(g_m, ref[i], &t[i], lb));
        assert_memory_equal(lw + (size_t)i * V, lb, sizeof(float) * (size_t)V);
    }
    tqkv_model_state_free(run);
    for (int i = 0; i < R; i++) {
        tqkv_model_state_free(ref[i]);
        tqkv_model_state_free(src[i]);
    }
    free(lw);
    free(lb);
}

// ---------------------------------------------------------------------------
// failures leave the state as it was
// ---------------------------------------------------------------------------

static void test_failures_unchanged(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 303);
    tqkv_model_state *s = new_state(2, TQKV_TQ4, TQKV_TQ3, 0);
    int32_t pr[2 * 40];
    random_tokens(&r, pr, 80);
    int lens[2] = {40, 17};
    OK(tqkv_model_prefill(g_m, s, pr, lens, 40, TQKV_LOGITS_NONE, NULL));
    size_t len;
    uint8_t *b = snap(s, &len);
    float *lg = malloc(sizeof(float) * 2 * (size_t)V * 8);
    /* a token outside the vocabulary */
    int32_t bad[2] = {3, V + 5};
    assert_int_equal(tqkv_model_decode(g_m, s, bad, lg), TQKV_ERANGE);
    assert_same_state(s, b, len);
    /* in a spec round too */
    OK(tqkv_model_state_spec_begin(s));
    assert_int_equal(tqkv_model_decode(g_m, s, bad, lg), TQKV_ERANGE);
    int zero = 0;
    OK(tqkv_model_state_spec_rollback(s, &zero, 1));
    assert_same_state(s, b, len);
    /* the undo a failed forward runs inside a spec round (tqkv_batch_rewind on every
     * layer appended to) restores the state and keeps the round */
    OK(tqkv_model_state_spec_begin(s));
    int32_t three[2 * 3] = {1, 2, 3, 4, 5, 6};
    OK(tqkv_model_extend(g_m, s, three, 3, TQKV_LOGITS_NONE, NULL));
    const tqkv_model_config *cc = tqkv_model_get_config(g_m);
    for (int l = 0; l < cc->n_layers; l++) {
        assert_int_equal(tqkv_batch_rewind(tqkv_model_state_layer(s, l), 4), TQKV_ERANGE);
        OK(tqkv_batch_rewind(tqkv_model_state_layer(s, l), 3));
    }
    assert_int_equal(tqkv_model_state_spec_active(s), 1);
    OK(tqkv_model_state_spec_commit(s));
    assert_same_state(s, b, len);
    /* the context limit: a window that would pass max_position_embeddings */
    const tqkv_model_config *c = tqkv_model_get_config(g_m);
    assert_int_equal(tqkv_model_context_len(g_m), c->max_position_embeddings);
    int big = c->max_position_embeddings - 40 + 1;
    int32_t *many = calloc((size_t)2 * big, sizeof(int32_t));
    assert_int_equal(tqkv_model_extend(g_m, s, many, big, TQKV_LOGITS_NONE, NULL), TQKV_ERANGE);
    assert_non_null(strstr(tqkv_last_error(), "context"));
    assert_same_state(s, b, len);
    tqkv_model_state *fresh = new_state(1, TQKV_TQ4, TQKV_TQ3, 0);
    int32_t *long_p = calloc((size_t)c->max_position_embeddings + 1, sizeof(int32_t));
    assert_int_equal(tqkv_model_prefill(g_m, fresh, long_p, NULL, c->max_position_embeddings + 1,
                                        TQKV_LOGITS_NONE, NULL), TQKV_ERANGE);
    /* merge of a state with other cache parameters, filter with bad indices */
    tqkv_model_state *other = new_state(1, TQKV_Q8, TQKV_Q8, 0);
    assert_int_equal(tqkv_model_state_merge(s, &other, 1), TQKV_EINVAL);
    int dup[2] = {1, 1}, oob[1] = {2};
    assert_int_equal(tqkv_model_state_filter(s, dup, 2), TQKV_EINVAL);
    assert_int_equal(tqkv_model_state_filter(s, oob, 1), TQKV_ERANGE);
    tqkv_model_state *x = NULL;
    assert_int_equal(tqkv_model_state_extract_row(s, 2, &x), TQKV_ERANGE);
    assert_same_state(s, b, len);
    /* a layer out of step with the others is caught before any work */
    int keep1[1] = {0};
    OK(tqkv_batch_filter(tqkv_model_state_layer(s, 3), keep1, 1));
    assert_int_equal(tqkv_model_decode(g_m, s, pr, lg), TQKV_ESTATE);
    assert_non_null(strstr(tqkv_last_error(), "layer 3"));
    free(b);
    free(many);
    free(long_p);
    free(lg);
    tqkv_model_state_free(s);
    tqkv_model_state_free(fresh);
    tqkv_model_state_free(other);
}

int main(void) {
    char d[1024];
    source_path("models/qwen3-code-28m", d, sizeof d);
    struct stat st;
    if (stat(d, &st) != 0) {
        fprintf(stderr, "test_model_rows: bundled model absent: SKIPPED\n");
        return 77;
    }
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    if (tqkv_model_load(&g_m, d, &lp) != TQKV_OK) {
        fprintf(stderr, "load: %s\n", tqkv_last_error());
        return 1;
    }
    V = tqkv_model_get_config(g_m)->vocab_size;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_merge_filter_extract_bitwise),
        cmocka_unit_test(test_spec_rollback_and_exact_extend),
        cmocka_unit_test(test_failures_unchanged),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tqkv_model_free(g_m);
    return rc;
}

/*
 * test_tp_rows.c - row operations, spec rounds, state export / import and the serving
 *   engine on tensor-parallel states (issue 25; docs/TP.md), N = 2 on the bundled model:
 *   - merge (in place), filter (in place and rebuilt), extract on sharded states: every row
 *     then decodes the bits of the same row decoded alone in its own sharded state (batch
 *     invariance: a row's logits depend only on its row), f32 and tq4 KV;
 *   - spec rounds in lockstep: a verification window, a per-row rollback and a commit give
 *     the bits of the same operations on the rows alone; a rollback with a bad keep refuses
 *     and leaves the round as it was;
 *   - export / import: the import decodes as the exported state, its export is the same
 *     bytes; a mismatched N, an unsharded target or source, a truncated export refuse;
 *   - refusals (a source of another N, bad keeps) change nothing on any rank; a failure of
 *     rank 1's fallible half (TQKV_TP_FAIL_RANK=1) after rank 0 did its own (merge, rebuilt
 *     filter, spec begin) leaves both ranks as they were;
 *   - the engine with tensor_parallel 2: requests together give the tokens (and logprob
 *     bits) they give alone, a prefix-cache hit (memory and directory) equals a miss, an
 *     unsharded draft changes nothing, and the greedy tokens equal the unsharded engine's.
 * The same on the ../shared fixtures of Gemma 4 (sliding, KV-shared layers) and Qwen 3.5
 * (every rank's recurrent rows move with its caches: merged, filtered, extracted, rolled back
 * per row in a spec round, exported), skipped when ../shared is absent; and (the state
 * operations, not the engine) on the in-tree random checkpoints of Qwen3-MoE, Qwen 3.5 MoE
 * and Gemma 4 with its MoE block (tests/golden/moe/).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_helpers.h"
#include "tp_rows_check.h"
#include "testutil.h"
#include "tqkv_model.h"

static tqkv_model *g_m;
static int V;
static char g_dir[1024];

enum { TP = 2 };

static tqkv_model_state *new_state(int rows, int tp, tqkv_format kv) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = p.v_format = kv;
    p.threads = 2;
    p.tensor_parallel = tp;
    p.extend_as_decode = 1; /* verification windows: the bits of single decodes */
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, g_m, &p));
    return s;
}

/* A 1-row sharded state holding a random prompt of n tokens. */
static tqkv_model_state *prefilled(test_rng *rg, int n, tqkv_format kv) {
    int32_t tok[64];
    for (int i = 0; i < n; i++) tok[i] = rng_int(rg, 3, V - 1);
    tqkv_model_state *s = new_state(1, TP, kv);
    OK(tqkv_model_prefill(g_m, s, tok, NULL, n, TQKV_LOGITS_NONE, NULL));
    return s;
}

// ---------------------------------------------------------------------------
// merge / filter / extract
// ---------------------------------------------------------------------------

static void test_merge_filter_extract(void **state) {
    (void)state;
    test_rng rg;
    rng_init(&rg, test_seed() ^ 0x25a);
    const tqkv_format kvs[] = {TQKV_F32, TQKV_TQ4};
    const int len[4] = {21, 13, 8, 17};
    for (int k = 0; k < 2; k++) {
        tqkv_model_state *ref[4], *src[4];
        for (int i = 0; i < 4; i++) {
            ref[i] = prefilled(&rg, len[i], kvs[k]);
            src[i] = tp_copy_of(ref[i]);
        }
        tp_rows_sequence(g_m, ref, src, &rg, 1);
        print_message("kv %s: merge / filter / extract on tp %d == rows alone\n",
                      tqkv_format_name(kvs[k]), TP);
        for (int i = 0; i < 4; i++) {
            tqkv_model_state_free(ref[i]);
            tqkv_model_state_free(src[i]);
        }
    }
}

// ---------------------------------------------------------------------------
// spec rounds, export / import
// ---------------------------------------------------------------------------

static void test_spec_and_export(void **state) {
    (void)state;
    test_rng rg;
    rng_init(&rg, test_seed() ^ 0x5bec);
    tqkv_model_state *ref[2], *src[2];
    ref[0] = prefilled(&rg, 19, TQKV_TQ4);
    ref[1] = prefilled(&rg, 11, TQKV_TQ4);
    for (int i = 0; i < 2; i++) src[i] = tp_copy_of(ref[i]);
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 1));
    const int map[2] = {0, 1};
    tp_spec_sequence(g_m, s, ref, &rg); /* a per-row rollback, a commit */
    uint8_t *blob = NULL;
    size_t blen = 0;
    /* export / import: the same rows, the same bytes again */
    OK(tqkv_model_state_export(s, &blob, &blen));
    assert_memory_equal(blob, "TQKVTP01", 8);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 2;
    p.extend_as_decode = 1;
    p.tensor_parallel = TP;
    tqkv_model_state *im = NULL;
    OK(tqkv_model_state_import(&im, g_m, &p, blob, blen));
    assert_int_equal(tqkv_model_state_tensor_parallel(im), TP);
    assert_int_equal(tqkv_model_state_rows(im), 2);
    assert_int_equal(tqkv_model_state_kv_bytes_used(im), tqkv_model_state_kv_bytes_used(s));
    uint8_t *blob2 = NULL;
    size_t blen2 = 0;
    OK(tqkv_model_state_export(im, &blob2, &blen2));
    assert_int_equal(blen2, blen);
    assert_memory_equal(blob2, blob, blen);
    free(blob2);
    /* the import decodes as the rows alone (and so as s) */
    tqkv_model_state *refc[2] = {tp_copy_of(ref[0]), tp_copy_of(ref[1])};
    tp_step_compare(g_m, im, refc, map, &rg, "imported");
    tqkv_model_state_free(refc[0]);
    tqkv_model_state_free(refc[1]);

    /* refusals: another N, an unsharded target, an unsharded source, truncation */
    tqkv_model_state *none = NULL;
    p.tensor_parallel = 4;
    assert_int_equal(tqkv_model_state_import(&none, g_m, &p, blob, blen), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "tensor_parallel must match"));
    p.tensor_parallel = 1;
    assert_int_equal(tqkv_model_state_import(&none, g_m, &p, blob, blen), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "import it into a state of tensor_parallel 2"));
    p.tensor_parallel = TP;
    assert_int_equal(tqkv_model_state_import(&none, g_m, &p, blob, blen - 1), TQKV_ECORRUPT);
    uint8_t *longer = malloc(blen + 1);
    memcpy(longer, blob, blen);
    longer[blen] = 0;
    assert_int_equal(tqkv_model_state_import(&none, g_m, &p, longer, blen + 1), TQKV_ECORRUPT);
    free(longer);
    tqkv_model_state *u = new_state(1, 1, TQKV_TQ4);
    int32_t t3[3] = {5, 6, 7};
    OK(tqkv_model_prefill(g_m, u, t3, NULL, 3, TQKV_LOGITS_NONE, NULL));
    uint8_t *ub = NULL;
    size_t ul = 0;
    OK(tqkv_model_state_export(u, &ub, &ul));
    assert_memory_equal(ub, "TQKVMS02", 8); /* the unsharded format as before */
    assert_int_equal(tqkv_model_state_import(&none, g_m, &p, ub, ul), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "unsharded"));
    assert_null(none);
    free(ub);
    tqkv_model_state_free(u);
    free(blob);
    tqkv_model_state_free(im);
    tqkv_model_state_free(s);
    tqkv_model_state_free(src[1]);
    for (int i = 0; i < 2; i++) tqkv_model_state_free(ref[i]);
}

// ---------------------------------------------------------------------------
// refusals leave every rank unchanged
// ---------------------------------------------------------------------------

static void test_refusals_unchanged(void **state) {
    (void)state;
    test_rng rg;
    rng_init(&rg, test_seed() ^ 0x4ef);
    tqkv_model_state *ref[2], *src[2];
    ref[0] = prefilled(&rg, 12, TQKV_TQ4);
    ref[1] = prefilled(&rg, 7, TQKV_TQ4);
    for (int i = 0; i < 2; i++) src[i] = tp_copy_of(ref[i]);
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 1));
    size_t rb[TP];
    for (int r = 0; r < TP; r++) rb[r] = tqkv_model_state_kv_bytes_rank(s, r);
    /* a source of another N (where the model allows N = 4) */
    tqkv_model_state_params p4 = tqkv_model_state_params_default();
    p4.k_format = p4.v_format = TQKV_TQ4;
    p4.threads = 2;
    p4.tensor_parallel = 4;
    tqkv_model_state *t4 = NULL;
    if (tqkv_model_state_init(&t4, g_m, &p4) == TQKV_OK) {
        int32_t t3[3] = {9, 10, 11};
        OK(tqkv_model_prefill(g_m, t4, t3, NULL, 3, TQKV_LOGITS_NONE, NULL));
        assert_int_equal(tqkv_model_state_merge(s, &t4, 1), TQKV_EINVAL);
        assert_non_null(strstr(tqkv_last_error(), "sharded over 4 ranks, the target over 2"));
    }
    tp_bad_keeps_refused(s); /* bad keeps, a row out of range, rollback outside a round */
    assert_int_equal(tqkv_model_state_rows(s), 2);
    for (int r = 0; r < TP; r++) assert_int_equal(tqkv_model_state_kv_bytes_rank(s, r), rb[r]);
    OK(tqkv_model_state_check(s));
    const int map[2] = {0, 1};
    tp_step_compare(g_m, s, ref, map, &rg, "after refusals");
    tqkv_model_state_free(t4);
    tqkv_model_state_free(s);
    tqkv_model_state_free(src[1]);
    for (int i = 0; i < 2; i++) tqkv_model_state_free(ref[i]);
}

/* Rank 1 fails after rank 0 did its part (TQKV_TP_FAIL_RANK=1): merge, rebuilt filter and
 * spec begin change nothing on either rank; then the same operations succeed. */
static void test_rank_failure_unchanged(void **state) {
    (void)state;
    test_rng rg;
    rng_init(&rg, test_seed() ^ 0xfa1);
    tqkv_model_state *ref[3], *src[3];
    const int len[3] = {14, 9, 5};
    for (int i = 0; i < 3; i++) {
        ref[i] = prefilled(&rg, len[i], TQKV_TQ4);
        src[i] = tp_copy_of(ref[i]);
    }
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 1));
    size_t rb[TP];
    for (int r = 0; r < TP; r++) rb[r] = tqkv_model_state_kv_bytes_rank(s, r);
    int off[2], off2[2];
    OK(tqkv_model_state_offsets(s, off));
    const int rev[2] = {1, 0};
    setenv("TQKV_TP_FAIL_RANK", "1", 1);
    assert_int_equal(tqkv_model_state_merge(s, &src[2], 1), TQKV_ENOMEM);
    assert_non_null(strstr(tqkv_last_error(), "rank 1"));
    assert_int_equal(tqkv_model_state_filter(s, rev, 2), TQKV_ENOMEM);
    assert_int_equal(tqkv_model_state_spec_begin(s), TQKV_ENOMEM);
    unsetenv("TQKV_TP_FAIL_RANK");
    assert_int_equal(tqkv_model_state_rows(s), 2);
    assert_int_equal(tqkv_model_state_spec_active(s), 0);
    for (int r = 0; r < TP; r++) assert_int_equal(tqkv_model_state_kv_bytes_rank(s, r), rb[r]);
    OK(tqkv_model_state_check(s));
    OK(tqkv_model_state_offsets(s, off2));
    assert_memory_equal(off, off2, sizeof off);
    const int map[2] = {0, 1};
    tp_step_compare(g_m, s, ref, map, &rg, "after rank 1's failures");
    OK(tqkv_model_state_merge(s, &src[2], 1)); /* then it works */
    OK(tqkv_model_state_filter(s, (const int[]){2, 0}, 2));
    const int map2[2] = {2, 0};
    tp_step_compare(g_m, s, ref, map2, &rg, "merge and filter after the failures");
    print_message("tp %d: rank 1 failing after rank 0 (merge, filter, spec begin): no rank "
                  "changed\n", TP);
    tqkv_model_state_free(s);
    for (int i = 1; i < 3; i++) tqkv_model_state_free(src[i]);
    for (int i = 0; i < 3; i++) tqkv_model_state_free(ref[i]);
}

// ---------------------------------------------------------------------------
// the engine
// ---------------------------------------------------------------------------

static tqkv_engine *tp_engine(int tp, size_t prefix_bytes, const char *cache_dir,
                              const char *draft) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_dir;
    p.draft_dir = draft;
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 2;
    p.prefill_chunk = 32;
    p.prefix_cache_bytes = prefix_bytes;
    p.prompt_cache_dir = cache_dir;
    p.tensor_parallel = tp;
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    return e;
}

static void test_engine_tp(void **state) {
    (void)state;
    tp_engine_check(tp_engine, TP, V, g_dir, test_seed() ^ 0xe25);
}

static void test_engine_tp_prefix(void **state) {
    (void)state;
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/tqkv_test_tp_pc_%d", (int)getpid());
    tp_engine_prefix_check(tp_engine, TP, V, dir, test_seed() ^ 0xfc);
}

/* An engine at tensor_parallel tp, with the model as its own draft (draft 1) whose states
 * are at draft_tensor_parallel dtp, or without a draft; f32 KV (exact: sharded greedy ==
 * unsharded, test_tp); init's status into *rc. */
static tqkv_engine *draft_engine(int tp, int draft, int dtp, tqkv_status *rc) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_dir;
    p.draft_dir = draft ? g_dir : NULL;
    p.k_format = p.v_format = TQKV_F32;
    p.threads = 2;
    p.tensor_parallel = tp;
    p.draft_tensor_parallel = dtp;
    tqkv_engine *e = NULL;
    *rc = tqkv_engine_init(&e, &p);
    return e;
}

static void test_engine_draft_tp(void **state) {
    (void)state;
    tp_engine_draft_check(draft_engine, TP, V, 1, test_seed() ^ 0xd7a);
}

/* The model `rel` into g_m / g_dir: ../shared's (in_tree 0) or the source tree's. 0; 77
 * when ../shared lacks it; 1 on a load failure. */
static int load_model(const char *rel, int in_tree) {
    const char *dir = in_tree ? source_path(rel, g_dir, sizeof g_dir)
                              : shared_path(rel, g_dir, sizeof g_dir);
    if (!dir) {
        printf("test_tp_rows: %s absent: its group SKIPPED\n", rel);
        return 77;
    }
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    if (tqkv_model_load(&g_m, g_dir, &lp) != TQKV_OK) {
        fprintf(stderr, "load %s: %s\n", g_dir, tqkv_last_error());
        return 1;
    }
    V = tqkv_model_get_config(g_m)->vocab_size;
    return 0;
}

int main(void) {
    source_path("models/qwen3-code-28m", g_dir, sizeof g_dir);
    struct stat st;
    if (stat(g_dir, &st) != 0) {
        fprintf(stderr, "test_tp_rows: bundled model absent: SKIPPED\n");
        return 77;
    }
    if (load_model("models/qwen3-code-28m", 1)) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_merge_filter_extract),
        cmocka_unit_test(test_spec_and_export),
        cmocka_unit_test(test_refusals_unchanged),
        cmocka_unit_test(test_rank_failure_unchanged),
        cmocka_unit_test(test_engine_tp),
        cmocka_unit_test(test_engine_tp_prefix),
        cmocka_unit_test(test_engine_draft_tp),
    };
    int rc = cmocka_run_group_tests_name("qwen3", tests, NULL, NULL);
    tqkv_model_free(g_m);
    /* the other graphs' row operations (and, on ../shared's fixtures, the engine) */
    const struct CMUnitTest states[] = {
        cmocka_unit_test(test_merge_filter_extract),
        cmocka_unit_test(test_spec_and_export),
        cmocka_unit_test(test_refusals_unchanged),
        cmocka_unit_test(test_engine_tp),
    };
    const struct {
        const char *rel;
        int in_tree;
    } models[] = {
        {"models/gemma4-code-30m", 0},
        {"models/qwen35-code-hybrid-30m", 0},
        {"tests/golden/moe/qwen3moe", 1},
        {"tests/golden/moe/qwen35moe", 1},
        {"tests/golden/moe/gemma4moe", 1},
    };
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        int lr = load_model(models[i].rel, models[i].in_tree);
        if (lr == 1) return 1;
        if (lr) continue;
        const size_t count = models[i].in_tree ? 3 : 4; /* the engine: ../shared's (tokenizer) */
        rc |= _cmocka_run_group_tests(strrchr(models[i].rel, '/') + 1, states, count, NULL, NULL);
        tqkv_model_free(g_m);
    }
    return rc;
}

/*
 * tp_rows_check.h - the row-operation checks that test_tp_rows.c (sharded CPU states) and
 * test_cuda_tp.c (sharded device states) share (issue 25; docs/TP.md): a sharded batch's rows
 * against the same rows alone in their own sharded states, bit for bit, after merges,
 * filters, extracts and spec rounds.
 * Must not: make states (each test makes its own: CPU or device parameters).
 */
#ifndef TQKV_TP_ROWS_CHECK_H
#define TQKV_TP_ROWS_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_helpers.h" /* OK() */
#include "testutil.h"
#include "tqkv_model.h"

/* A 1-row copy of a 1-row sharded state (through the lockstep extract). */
static inline tqkv_model_state *tp_copy_of(const tqkv_model_state *s) {
    tqkv_model_state *c = NULL;
    OK(tqkv_model_state_extract_row(s, 0, &c));
    assert_int_equal(tqkv_model_state_tensor_parallel(c), tqkv_model_state_tensor_parallel(s));
    return c;
}

/* One decode of random tokens on s and, row by row, on the lone row ref[map[i]]: the same
 * bits. */
static inline void tp_step_compare(const tqkv_model *m, tqkv_model_state *s,
                                   tqkv_model_state **ref, const int *map, test_rng *rg,
                                   const char *what) {
    const int R = tqkv_model_state_rows(s), V = tqkv_model_get_config(m)->vocab_size;
    int32_t in[8];
    float *ls = malloc(sizeof(float) * (size_t)(R ? R : 1) * V), *lr = malloc(sizeof(float) * (size_t)V);
    for (int i = 0; i < R; i++) in[i] = rng_int(rg, 3, V - 1);
    OK(tqkv_model_decode(m, s, in, ls));
    for (int i = 0; i < R; i++) {
        OK(tqkv_model_decode(m, ref[map[i]], &in[i], lr));
        if (memcmp(ls + (size_t)i * V, lr, sizeof(float) * (size_t)V))
            fail_msg("%s: row %d differs from its row alone (%d)", what, i, map[i]);
    }
    free(ls);
    free(lr);
}

/* A verification window of W tokens per row (in a spec round): s's window logits equal the
 * lone rows' windows. */
enum { TP_W = 3 };
static inline void tp_window_compare(const tqkv_model *m, tqkv_model_state *s,
                                     tqkv_model_state **ref, const int *map, test_rng *rg) {
    const int R = tqkv_model_state_rows(s), V = tqkv_model_get_config(m)->vocab_size;
    int32_t win[8 * TP_W];
    float *ls = malloc(sizeof(float) * (size_t)R * TP_W * V), *lr = malloc(sizeof(float) * TP_W * (size_t)V);
    for (int i = 0; i < R * TP_W; i++) win[i] = rng_int(rg, 3, V - 1);
    OK(tqkv_model_extend(m, s, win, TP_W, TQKV_LOGITS_ALL, ls));
    for (int i = 0; i < R; i++) {
        OK(tqkv_model_extend(m, ref[map[i]], win + i * TP_W, TP_W, TQKV_LOGITS_ALL, lr));
        if (memcmp(ls + (size_t)i * TP_W * V, lr, sizeof(float) * TP_W * (size_t)V))
            fail_msg("window: row %d differs from its row alone", i);
    }
    free(ls);
    free(lr);
}

/* ref[4]: 1-row sharded states; src[4]: their copies (src[0] becomes the batch): merges (two
 * sources, then one), filters (in order, reordered, to one row, to none), an extract; every
 * row checked against its row alone after each. same_bytes: the extract holds the bytes of
 * its row alone on every rank (exact host allocations; device capacities differ). */
static inline void tp_rows_sequence(const tqkv_model *m, tqkv_model_state **ref,
                                    tqkv_model_state **src, test_rng *rg, int same_bytes) {
    const int N = tqkv_model_state_tensor_parallel(src[0]);
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 2)); /* 3 rows of different lengths */
    assert_int_equal(tqkv_model_state_rows(s), 3);
    OK(tqkv_model_state_check(s));
    const int map3[3] = {0, 1, 2};
    for (int t = 0; t < 2; t++) tp_step_compare(m, s, ref, map3, rg, "merged");
    const int inc[2] = {0, 2}, map2[2] = {0, 2};
    OK(tqkv_model_state_filter(s, inc, 2)); /* in order (in place on the CPU) */
    tp_step_compare(m, s, ref, map2, rg, "filtered in order");
    OK(tqkv_model_state_merge(s, &src[3], 1));
    const int map3b[3] = {0, 2, 3};
    tp_step_compare(m, s, ref, map3b, rg, "merged again");
    const int rev[2] = {2, 0}, map2b[2] = {3, 0};
    OK(tqkv_model_state_filter(s, rev, 2)); /* reordered: rebuilt */
    tp_step_compare(m, s, ref, map2b, rg, "filtered reordered");
    const size_t bytes = tqkv_model_state_kv_bytes_used(s);
    tqkv_model_state *e = NULL; /* row 0 (ref 3): a 1-row sharded state; s unchanged */
    OK(tqkv_model_state_extract_row(s, 0, &e));
    assert_int_equal(tqkv_model_state_tensor_parallel(e), N);
    assert_int_equal(tqkv_model_state_rows(e), 1);
    assert_int_equal(tqkv_model_state_kv_bytes_used(s), bytes);
    for (int r = 0; r < N && same_bytes; r++)
        assert_int_equal(tqkv_model_state_kv_bytes_rank(e, r), tqkv_model_state_kv_bytes_rank(ref[3], r));
    const int map1[1] = {3};
    tp_step_compare(m, e, ref, map1, rg, "extracted");
    const int one = 1, map1b[1] = {0}; /* s's row 0 is now behind ref 3: keep row 1 (ref 0) */
    OK(tqkv_model_state_filter(s, &one, 1));
    tp_step_compare(m, s, ref, map1b, rg, "filtered to one");
    OK(tqkv_model_state_filter(s, NULL, 0)); /* to no rows and back */
    assert_int_equal(tqkv_model_state_rows(s), 0);
    OK(tqkv_model_state_merge(s, &e, 1));
    tp_step_compare(m, s, ref, map1, rg, "merged into an empty state");
    tqkv_model_state_free(e);
}

/* s: 2 rows, ref[0], ref[1] alone (1-row states in step with them, extend_as_decode): a
 * round rolled back per row (keep 1 and TP_W of the TP_W appended; a keep past what a row
 * appended refused first, the round as it was), then a round committed; the rows checked
 * against the rows alone after each. */
static inline void tp_spec_sequence(const tqkv_model *m, tqkv_model_state *s,
                                    tqkv_model_state **ref, test_rng *rg) {
    const int map[2] = {0, 1};
    OK(tqkv_model_state_spec_begin(s));
    assert_int_equal(tqkv_model_state_spec_active(s), 1);
    assert_int_equal(tqkv_model_state_spec_begin(s), TQKV_ESTATE);
    for (int i = 0; i < 2; i++) OK(tqkv_model_state_spec_begin(ref[i]));
    tp_window_compare(m, s, ref, map, rg);
    int off[2], off2[2];
    OK(tqkv_model_state_offsets(s, off));
    const int bad[2] = {1, TP_W + 1};
    assert_int_equal(tqkv_model_state_spec_rollback(s, bad, 2), TQKV_ERANGE);
    assert_int_equal(tqkv_model_state_spec_active(s), 1);
    OK(tqkv_model_state_check(s));
    OK(tqkv_model_state_offsets(s, off2));
    assert_memory_equal(off, off2, sizeof off);
    uint8_t *blob = NULL;
    size_t blen = 0;
    assert_int_equal(tqkv_model_state_export(s, &blob, &blen), TQKV_ESTATE); /* in a round */
    assert_null(blob);
    const int keep[2] = {1, TP_W};
    OK(tqkv_model_state_spec_rollback(s, keep, 2));
    for (int i = 0; i < 2; i++) OK(tqkv_model_state_spec_rollback(ref[i], &keep[i], 1));
    assert_int_equal(tqkv_model_state_spec_active(s), 0);
    OK(tqkv_model_state_offsets(s, off2));
    assert_int_equal(off2[0], off[0] - TP_W + 1);
    assert_int_equal(off2[1], off[1]);
    tp_step_compare(m, s, ref, map, rg, "after a per-row rollback");
    OK(tqkv_model_state_spec_begin(s));
    for (int i = 0; i < 2; i++) OK(tqkv_model_state_spec_begin(ref[i]));
    tp_window_compare(m, s, ref, map, rg);
    OK(tqkv_model_state_spec_commit(s));
    for (int i = 0; i < 2; i++) OK(tqkv_model_state_spec_commit(ref[i]));
    assert_int_equal(tqkv_model_state_spec_commit(s), TQKV_ESTATE);
    tp_step_compare(m, s, ref, map, rg, "after a commit");
}

/* A 2-row sharded state s refuses keeps out of range or repeated, a row out of range and a
 * rollback outside a round (the caller checks that nothing changed). */
static inline void tp_bad_keeps_refused(tqkv_model_state *s) {
    const int oob[1] = {2}, dup[2] = {1, 1}, neg[1] = {-1};
    assert_true(tqkv_model_state_filter(s, oob, 1) != TQKV_OK);
    assert_true(tqkv_model_state_filter(s, dup, 2) != TQKV_OK);
    assert_true(tqkv_model_state_filter(s, neg, 1) != TQKV_OK);
    tqkv_model_state *e = NULL;
    assert_int_equal(tqkv_model_state_extract_row(s, 2, &e), TQKV_ERANGE);
    assert_null(e);
    assert_int_equal(tqkv_model_state_spec_rollback(s, oob, 1), TQKV_ESTATE); /* no round */
}

/* ---- the engine on sharded states ---- */

/* An engine of the test's kind (CPU or device) with tensor_parallel tp (0: off). */
typedef tqkv_engine *(*tp_engine_open)(int tp, size_t prefix_bytes, const char *cache_dir,
                                       const char *draft);

/* NJ random jobs (one seeded sampled) at N ranks: run alone, then joining a running batch
 * (merge, filter), then with draft_dir as an unsharded draft: the same tokens and logprob
 * bits; the unsharded engine: the same greedy tokens. */
enum { TP_NJ = 4 };
static inline void tp_engine_check(tp_engine_open open, int N, int V, const char *draft_dir,
                                   uint64_t seed) {
    test_rng rg;
    rng_init(&rg, seed);
    job j[TP_NJ];
    for (int i = 0; i < TP_NJ; i++) {
        memset(&j[i], 0, sizeof j[i]);
        j[i].n_prompt = rng_int(&rg, 5, 60);
        for (int t = 0; t < j[i].n_prompt; t++) j[i].prompt[t] = rng_int(&rg, 1, V - 1);
        j[i].max_tokens = rng_int(&rg, 4, 10);
        j[i].top_logprobs = 1;
    }
    j[TP_NJ - 1].temp = 0.8f; /* one seeded sampled request */
    j[TP_NJ - 1].seed = rng_u64(&rg);
    result alone[TP_NJ], together[TP_NJ], other[TP_NJ];
    tqkv_engine *e = open(N, 0, NULL, NULL);
    for (int i = 0; i < TP_NJ; i++) {
        submit(e, &j[i], &alone[i]);
        run_until_idle(e);
        assert_int_equal(alone[i].n_tok, j[i].max_tokens);
    }
    run_staggered(e, j, TP_NJ, together, 2); /* joining a running batch: merge, filter */
    for (int i = 0; i < TP_NJ; i++) assert_same_tokens(&together[i], &alone[i]);
    tqkv_engine_stats st;
    OK(tqkv_engine_stats_get(e, &st));
    assert_true(st.kv_bytes_per_token > 0);
    tqkv_engine_free(e);
    e = open(N, 0, NULL, draft_dir); /* an unsharded draft: spec rounds on the sharded rows */
    run_staggered(e, j, TP_NJ, other, 1);
    for (int i = 0; i < TP_NJ; i++) assert_same_tokens(&other[i], &alone[i]);
    OK(tqkv_engine_stats_get(e, &st));
    assert_true(st.spec_drafted > 0);
    tqkv_engine_free(e);
    e = open(0, 0, NULL, NULL); /* the unsharded engine: the same greedy tokens */
    int greedy = 0;
    for (int i = 0; i < TP_NJ; i++) {
        if (j[i].temp > 0) continue;
        submit(e, &j[i], &other[i]);
        run_until_idle(e);
        assert_int_equal(other[i].n_tok, alone[i].n_tok);
        assert_memory_equal(other[i].toks, alone[i].toks, sizeof(int32_t) * (size_t)alone[i].n_tok);
        greedy++;
    }
    tqkv_engine_free(e);
    print_message("engine tp %d: %d requests together == alone (tokens, logprob bits), with a "
                  "draft too; %d greedy == unsharded\n", N, TP_NJ, greedy);
}

/* An engine of the test's kind at tensor_parallel tp with the model as its own draft (draft
 * 1) at draft_tensor_parallel dtp, or without a draft (draft 0); init's status in *rc. */
typedef tqkv_engine *(*tp_draft_open)(int tp, int draft, int dtp, tqkv_status *rc);

/* The draft's states sharded too (draft_tensor_parallel N, and -1 = the target's N): the
 * model drafting for itself (greedy requests joining a running batch) gives the tokens and
 * logprob bits of the engine without a draft; with same_accept (exact products: sharded
 * greedy == unsharded) its drafts are accepted exactly as often as the unsharded draft's
 * (the same proposals; a wrongly sharded draft would propose others), else some are; a
 * draft N its heads do not split (3: the fixtures' 2 KV heads) or one out of range fails
 * init naming the draft. */
static inline void tp_engine_draft_check(tp_draft_open open, int N, int V, int same_accept,
                                         uint64_t seed) {
    test_rng rg;
    rng_init(&rg, seed);
    enum { NJ = 3 };
    job j[NJ];
    for (int i = 0; i < NJ; i++) {
        memset(&j[i], 0, sizeof j[i]);
        j[i].n_prompt = rng_int(&rg, 5, 60);
        for (int t = 0; t < j[i].n_prompt; t++) j[i].prompt[t] = rng_int(&rg, 1, V - 1);
        j[i].max_tokens = rng_int(&rg, 6, 12);
        j[i].top_logprobs = 1;
    }
    result plain[NJ], drafted[NJ];
    tqkv_status rc;
    tqkv_engine_stats st0, st;
    tqkv_engine *e = open(N, 1, 0, &rc); /* the unsharded draft's acceptance */
    OK(rc);
    run_staggered(e, j, NJ, drafted, 1);
    OK(tqkv_engine_stats_get(e, &st0));
    tqkv_engine_free(e);
    e = open(N, 0, 0, &rc); /* no draft: the reference */
    OK(rc);
    run_staggered(e, j, NJ, plain, 1);
    tqkv_engine_free(e);
    const int dtps[2] = {N, -1};
    for (int k = 0; k < 2; k++) {
        e = open(N, 1, dtps[k], &rc);
        OK(rc);
        run_staggered(e, j, NJ, drafted, 1);
        for (int i = 0; i < NJ; i++) assert_same_tokens(&drafted[i], &plain[i]);
        OK(tqkv_engine_stats_get(e, &st));
        assert_true(st.spec_drafted > 0 && st.spec_accepted > 0);
        if (same_accept) {
            assert_int_equal(st.spec_drafted, st0.spec_drafted);
            assert_int_equal(st.spec_accepted, st0.spec_accepted);
        }
        print_message("engine tp %d, draft tensor_parallel %d: %d requests == no draft (tokens, "
                      "logprob bits); %llu of %llu drafts accepted (unsharded draft: %llu of "
                      "%llu)\n", N, dtps[k], NJ, (unsigned long long)st.spec_accepted,
                      (unsigned long long)st.spec_drafted, (unsigned long long)st0.spec_accepted,
                      (unsigned long long)st0.spec_drafted);
        tqkv_engine_free(e);
    }
    const int bad[2] = {3, 9};
    const char *why[2] = {"the draft model's states: tensor_parallel 3", "draft_tensor_parallel 9"};
    for (int k = 0; k < 2; k++) {
        e = open(N, 1, bad[k], &rc);
        assert_int_equal(rc, TQKV_EINVAL);
        assert_null(e);
        if (!strstr(tqkv_last_error(), why[k]))
            fail_msg("draft_tensor_parallel %d: message '%s'", bad[k], tqkv_last_error());
    }
}

/* A prefix-cache hit at N ranks (in memory, then from the directory `dir` after a restart)
 * gives the tokens of a miss; an unsharded engine does not read the sharded entries. */
static inline void tp_engine_prefix_check(tp_engine_open open, int N, int V, const char *dir,
                                          uint64_t seed) {
    test_rng rg;
    rng_init(&rg, seed);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    job a, b;
    make_prefix_pair(&rg, V, 6, &a, &b); /* b shares 100 tokens, then differs */
    result ma, mb, ha, hb;
    tqkv_engine *e = open(N, 0, NULL, NULL);
    submit(e, &a, &ma);
    run_until_idle(e);
    submit(e, &b, &mb);
    run_until_idle(e);
    tqkv_engine_free(e);
    e = open(N, 64 << 20, dir, NULL);
    submit(e, &a, &ha);
    run_until_idle(e);
    assert_int_equal(ha.cached, 0);
    submit(e, &b, &hb);
    run_until_idle(e);
    assert_int_equal(hb.cached, 96); /* the longest chunk boundary inside the shared prefix */
    assert_same_tokens(&ha, &ma);
    assert_same_tokens(&hb, &mb);
    tqkv_engine_free(e);
    e = open(N, 64 << 20, dir, NULL); /* restart: the entries from the directory (import) */
    submit(e, &b, &hb);
    run_until_idle(e);
    assert_true(hb.cached >= 96);
    assert_same_tokens(&hb, &mb);
    tqkv_engine_free(e);
    e = open(0, 64 << 20, dir, NULL); /* another fingerprint: not read */
    submit(e, &b, &hb);
    run_until_idle(e);
    assert_int_equal(hb.cached, 0);
    tqkv_engine_free(e);
    assert_int_equal(system(cmd), 0);
    print_message("engine tp %d: prefix-cache hits (memory, directory after a restart) == misses\n", N);
}

#endif

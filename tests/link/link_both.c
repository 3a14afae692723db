/*
 * link_both.c - a program linking BOTH installed shared libraries, libtqkv.so and
 * libtqkv-model.so, through their public headers only (no src/ include path).
 * Owns: the checks that the two libraries share the one piece of state the core has, the
 * thread's error message, although libtqkv-model runs its own hidden copy of the core
 * (docs/ARCHITECTURE.md, "Libraries"): a failure inside libtqkv-model (its private copy
 * of the file helpers, its tokenizer) is what tqkv_last_error() from libtqkv returns, and a
 * cache the model made is read and changed by libtqkv's own functions.
 * CMake builds it twice, with the libraries in either order on the link line
 * (link_both_model_first, link_both_core_first).
 * Must not: include anything from src/, or call an internal function.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "tqkv.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

/* ------------------------------------------------------------------------- */
/* The error message                                                          */
/* ------------------------------------------------------------------------- */

/* A missing file, reported by libtqkv-model's copy of the file helpers. */
static void test_model_file_error_reaches_last_error(void **st) {
    (void)st;
    tqkv_clear_error();
    assert_string_equal(tqkv_last_error(), "");
    tqkv_tokenizer *t = NULL;
    const char *path = "/nonexistent-tqkv-link-both/tokenizer.json";
    tqkv_status s = tqkv_tokenizer_load_file(&t, path);
    assert_int_equal(s, TQKV_EIO);
    assert_null(t);
    printf("model error: %s\n", tqkv_last_error());
    assert_non_null(strstr(tqkv_last_error(), path));
    tqkv_clear_error();
    assert_string_equal(tqkv_last_error(), "");
}

/* Malformed JSON, reported by the tokenizer itself (libtqkv-model's own code). */
static void test_model_parse_error_reaches_last_error(void **st) {
    (void)st;
    tqkv_clear_error();
    tqkv_tokenizer *t = NULL;
    tqkv_status s = tqkv_tokenizer_load_json(&t, "{\"model\": [", 11, "link-both-json");
    assert_int_equal(s, TQKV_ECORRUPT);
    printf("model error: %s\n", tqkv_last_error());
    assert_non_null(strstr(tqkv_last_error(), "link-both-json"));
}

/* libtqkv's own failures still land in the same place. */
static void test_core_error_reaches_last_error(void **st) {
    (void)st;
    tqkv_clear_error();
    tqkv_format f;
    assert_int_equal(tqkv_format_parse("tq9-link-both", &f), TQKV_EINVAL);
    printf("core error: %s\n", tqkv_last_error());
    assert_non_null(strstr(tqkv_last_error(), "tq9-link-both"));
}

/* ------------------------------------------------------------------------- */
/* A cache made by libtqkv-model, used through libtqkv                        */
/* ------------------------------------------------------------------------- */

static void test_model_cache_through_libtqkv(void **st) {
    (void)st;
    const char *dir = TQKV_SOURCE_DIR "/models/qwen3-code-28m";
    tqkv_model *m = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    assert_int_equal(tqkv_model_load(&m, dir, &lp), TQKV_OK);
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.k_format = TQKV_TQ4;
    sp.v_format = TQKV_TQ4;
    tqkv_model_state *s = NULL;
    assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
    const int32_t tokens[5] = {11, 22, 33, 44, 55};
    assert_int_equal(tqkv_model_prefill(m, s, tokens, NULL, 5, TQKV_LOGITS_NONE, NULL), TQKV_OK);

    tqkv_batch *b = tqkv_model_state_layer(s, 0);
    assert_non_null(b);
    assert_int_equal(tqkv_batch_rows(b), 1);
    int offset = -1, left_pad = -1;
    assert_int_equal(tqkv_batch_offsets(b, &offset, &left_pad), TQKV_OK);
    assert_int_equal(offset, 5);
    assert_int_equal(left_pad, 0);
    assert_true(tqkv_batch_bytes_used(b) > 0);
    assert_int_equal(tqkv_batch_get_config(b)->k_format, TQKV_TQ4);

    /* libtqkv refuses a bad trim of the model's cache, with its message, unchanged */
    tqkv_clear_error();
    assert_int_equal(tqkv_batch_trim(b, 6), TQKV_ERANGE);
    assert_true(strlen(tqkv_last_error()) > 0);
    assert_int_equal(tqkv_batch_offsets(b, &offset, &left_pad), TQKV_OK);
    assert_int_equal(offset, 5);

    /* libtqkv trims it; the model's own view of the state sees the change */
    assert_int_equal(tqkv_batch_trim(b, 2), TQKV_OK);
    int state_offset = -1;
    int n_layers = tqkv_model_get_config(m)->n_layers;
    for (int l = 1; l < n_layers; l++)
        assert_int_equal(tqkv_batch_trim(tqkv_model_state_layer(s, l), 2), TQKV_OK);
    assert_int_equal(tqkv_model_state_offsets(s, &state_offset), TQKV_OK);
    assert_int_equal(state_offset, 3);

    tqkv_model_state_free(s);
    tqkv_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_file_error_reaches_last_error),
        cmocka_unit_test(test_model_parse_error_reaches_last_error),
        cmocka_unit_test(test_core_error_reaches_last_error),
        cmocka_unit_test(test_model_cache_through_libtqkv),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

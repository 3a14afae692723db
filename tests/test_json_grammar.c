/*
 * test_json_grammar.c - the JSON-object automaton of constrained decoding
 * (src/engine/json_grammar.c): accepts exactly the JSON objects (fixed cases, and fresh
 * random documents printed by cJSON, whose every strict prefix must be accepted and
 * not complete); and its token mask over the bundled tokenizer equals, token by token,
 * feeding the token's bytes to the automaton (the trie walk against a plain loop), in
 * random reachable states.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "engine/json_grammar.h"
#include "testutil.h"

/* 1 when the whole text is accepted and complete. */
static int accepts(const char *t) {
    jg_state s;
    jg_init(&s);
    for (const char *p = t; *p; p++)
        if (!jg_feed(&s, (unsigned char)*p)) return 0;
    return jg_complete(&s);
}

static void test_cases(void **state) {
    (void)state;
    const char *good[] = {"{}", " {\"a\":1}", "{\"a\": [1, 2.5, -3e+2, 0, -0.0, true, false, null]}",
                          "{\"k\": {\"n\": {\"s\": \"x\\\"y\\\\\\u00e9\\n\"}}, \"e\": []}",
                          "{\"utf8\": \"caf\xc3\xa9\"}", "{\"a\":{},\"b\":[[]]}", "{\"n\": 1E5}"};
    const char *bad[] = {"", "[]", "1", "\"s\"", "{", "{\"a\"}", "{\"a\":}", "{\"a\":1,}", "{a:1}",
                         "{\"a\":01}", "{\"a\":1.}", "{\"a\":.5}", "{\"a\":tru}", "{\"a\":\"\x01\"}",
                         "{\"a\":\"\\x\"}", "{\"a\":\"\\u12g4\"}", "{\"a\":[1,]}", "{} {}", "{}x",
                         "{\"a\":1]", "{\"a\":[1}", "{\"a\":-}", "{\"a\":1e}", "{\"a\":NaN}"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        if (!accepts(good[i])) fail_msg("refused valid %s", good[i]);
    }
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (accepts(bad[i])) fail_msg("accepted invalid %s", bad[i]);
    }
    /* whitespace padding is bounded */
    char pad[64] = "{";
    memset(pad + 1, ' ', 20);
    strcpy(pad + 21, "}");
    assert_false(accepts(pad));
}

static cJSON *random_value(test_rng *r, int depth) {
    int k = rng_int(r, 0, depth > 3 ? 4 : 6);
    switch (k) {
    case 0: return cJSON_CreateNumber(rng_int(r, -1000, 1000) / (double)rng_int(r, 1, 7));
    case 1: {
        char s[16];
        int n = rng_int(r, 0, 12);
        for (int i = 0; i < n; i++) s[i] = (char)rng_int(r, 1, 126);
        s[n] = 0;
        return cJSON_CreateString(s);
    }
    case 2: return cJSON_CreateBool(rng_int(r, 0, 1));
    case 3: return cJSON_CreateNull();
    case 4: return cJSON_CreateNumber(rng_int(r, -5, 5));
    case 5: {
        cJSON *a = cJSON_CreateArray();
        for (int i = rng_int(r, 0, 4); i > 0; i--) cJSON_AddItemToArray(a, random_value(r, depth + 1));
        return a;
    }
    default: {
        cJSON *o = cJSON_CreateObject();
        for (int i = rng_int(r, 0, 4); i > 0; i--) {
            char key[16];
            snprintf(key, sizeof key, "k%d", rng_int(r, 0, 99));
            cJSON_AddItemToObject(o, key, random_value(r, depth + 1));
        }
        return o;
    }
    }
}

static cJSON *random_object(test_rng *r) {
    cJSON *o = cJSON_CreateObject();
    for (int i = rng_int(r, 0, 5); i > 0; i--) {
        char key[16];
        snprintf(key, sizeof key, "f%d", i);
        cJSON_AddItemToObject(o, key, random_value(r, 1));
    }
    return o;
}

static void test_random_documents(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    for (int it = 0; it < 500; it++) {
        cJSON *o = random_object(&r);
        char *t = it % 2 ? cJSON_Print(o) : cJSON_PrintUnformatted(o);
        jg_state s;
        jg_init(&s);
        size_t n = strlen(t);
        for (size_t i = 0; i < n; i++) {
            assert_false(jg_complete(&s));
            if (!jg_feed(&s, (unsigned char)t[i])) fail_msg("refused byte %zu of %s", i, t);
        }
        assert_true(jg_complete(&s));
        free(t);
        cJSON_Delete(o);
    }
}

static void test_mask_equals_bytes(void **state) {
    (void)state;
    char dir[4096];
    source_path("models/qwen3-code-28m", dir, sizeof dir);
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    assert_int_equal(tqkv_model_load(&m, dir, &lp), TQKV_OK);
    assert_int_equal(tqkv_tokenizer_load(&tok, dir), TQKV_OK);
    jg_vocab *v = NULL;
    assert_int_equal(jg_vocab_init(&v, tok, m), TQKV_OK);
    const int V = tqkv_model_get_config(m)->vocab_size, TV = tqkv_tokenizer_vocab_size(tok);
    float *l = malloc(sizeof(float) * (size_t)V);
    test_rng r;
    rng_init(&r, test_seed());
    int states = 0;
    double mask_s = 0;
    for (int it = 0; it < 40; it++) {
        /* a reachable state: a random prefix of a random document */
        cJSON *o = random_object(&r);
        char *t = cJSON_PrintUnformatted(o);
        size_t cut = (size_t)rng_int(&r, 0, (int)strlen(t));
        jg_state s;
        jg_init(&s);
        for (size_t i = 0; i < cut; i++) assert_true(jg_feed(&s, (unsigned char)t[i]));
        for (int id = 0; id < V; id++) l[id] = 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        jg_mask(v, &s, l);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        mask_s += (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        int allowed = 0;
        for (int id = 0; id < V; id++) {
            int want;
            const char *b;
            size_t n;
            if (id < TV && !tqkv_tokenizer_is_special(tok, id) &&
                tqkv_tokenizer_id_bytes(tok, id, &b, &n) == TQKV_OK && n > 0) {
                jg_state u = s;
                want = 1;
                for (size_t k = 0; k < n && want; k++) want = jg_feed(&u, (unsigned char)b[k]);
            } else {
                want = tqkv_model_is_eos(m, id) && jg_complete(&s);
            }
            if (want != (l[id] == 0)) fail_msg("state %d (prefix '%.*s'): token %d mask %g, bytes say %d", it,
                                               (int)cut, t, id, (double)l[id], want);
            allowed += want;
        }
        assert_true(allowed > 0);
        states++;
        free(t);
        cJSON_Delete(o);
    }
    fprintf(stderr, "%d states, vocab %d, jg_mask %.1f us per call (mostly cache misses; printed, not asserted)\n",
            states, V, 1e6 * mask_s / states);
    free(l);
    jg_vocab_free(v);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cases),
        cmocka_unit_test(test_random_documents),
        cmocka_unit_test(test_mask_equals_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_json_schema.c - the JSON-Schema automaton of structured output
 * (src/engine/json_schema.c) on the fixed corpus of 100 schemas (json_schema_corpus.h):
 * every random valid instance (compact and pretty-printed) is accepted and complete,
 * every strict prefix incomplete; an instance with an extra property, a missing one, or
 * a value of another type is refused; the schema mask over the bundled vocabulary equals
 * feeding each token's bytes in random reachable states; unsupported schemas are refused
 * with the keyword named; with a token budget no smaller than the shortest completion,
 * random walks among the tokens js_mask_budget allows always close in time; the budgeted
 * mask (its cached tables) equals the rule computed token by token from the bytes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/json_schema.h"
#include "json_schema_corpus.h"

static int accepts(const js_schema *s, const char *t, int *complete) {
    js_state st;
    js_init(s, &st);
    for (const char *p = t; *p; p++)
        if (!js_feed(s, &st, (unsigned char)*p)) return 0;
    *complete = js_complete(&st);
    return 1;
}

static js_schema *compile(const cJSON *schema) {
    char *txt = cJSON_PrintUnformatted(schema);
    js_schema *s = NULL;
    if (js_compile(&s, txt, 16) != TQKV_OK) fail_msg("compile %s: %s", txt, tqkv_last_error());
    free(txt);
    return s;
}

static void test_corpus_instances(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    int accepted = 0, refused = 0;
    for (int i = 0; i < CORPUS_N; i++) {
        cJSON *schema = corpus_schema(i);
        js_schema *s = compile(schema);
        for (int k = 0; k < 10; k++) {
            cJSON *v = corpus_instance(schema, &r);
            assert_true(corpus_validate(schema, v));
            char *t = k % 2 ? cJSON_Print(v) : cJSON_PrintUnformatted(v);
            int complete = 0;
            if (!accepts(s, t, &complete) || !complete) {
                char *st = cJSON_PrintUnformatted(schema);
                fail_msg("schema %d %s refused valid %s", i, st, t);
            }
            accepted++;
            /* strict prefixes are not complete */
            size_t n = strlen(t);
            js_state st;
            js_init(s, &st);
            for (size_t b = 0; b + 1 < n; b++) {
                assert_true(js_feed(s, &st, (unsigned char)t[b]));
                assert_false(js_complete(&st));
            }
            free(t);
            /* an extra property, a missing one, a wrong type: refused */
            cJSON *x = cJSON_Duplicate(v, 1);
            cJSON_AddNumberToObject(x, "zz_extra", 1);
            t = cJSON_PrintUnformatted(x);
            assert_false(accepts(s, t, &complete) && complete);
            free(t);
            cJSON_Delete(x);
            x = cJSON_Duplicate(v, 1);
            cJSON_DeleteItemFromArray(x, 0);
            t = cJSON_PrintUnformatted(x);
            assert_false(accepts(s, t, &complete) && complete);
            free(t);
            cJSON_Delete(x);
            x = cJSON_Duplicate(v, 1);
            cJSON *first = cJSON_GetArrayItem(x, 0);
            cJSON *wrong = cJSON_IsObject(first) ? cJSON_CreateNumber(7) : cJSON_CreateObject();
            cJSON_ReplaceItemInObject(x, first->string, wrong);
            t = cJSON_PrintUnformatted(x);
            if (!corpus_validate(schema, x)) {
                assert_false(accepts(s, t, &complete) && complete);
                refused++;
            }
            free(t);
            cJSON_Delete(x);
            cJSON_Delete(v);
        }
        js_free(s);
        cJSON_Delete(schema);
    }
    fprintf(stderr, "%d valid instances accepted over %d schemas; %d wrong-type instances refused\n",
            accepted, CORPUS_N, refused);
}

static void test_unsupported(void **state) {
    (void)state;
    const char *bad[] = {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"x\"}}}",
                         "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/x\"}}}",
                         "{\"anyOf\":[{\"type\":\"object\"}]}", "{\"type\":\"array\",\"items\":{\"type\":\"string\"}}",
                         "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"date\"}}}", "not json",
                         "{\"type\":\"object\",\"properties\":{\"a\":{}}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        js_schema *s = NULL;
        assert_int_equal(js_compile(&s, bad[i], 16), TQKV_EINVAL);
        assert_non_null(strstr(tqkv_last_error(), "json schema"));
    }
    js_schema *s = NULL;
    assert_int_equal(js_compile(&s, bad[0], 16), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "pattern"));
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
    for (int it = 0; it < 30; it++) {
        cJSON *schema = corpus_schema(rng_int(&r, 0, CORPUS_N - 1));
        char *txt = cJSON_PrintUnformatted(schema);
        js_schema *s = NULL;
        assert_int_equal(js_compile(&s, txt, V), TQKV_OK);
        cJSON *inst = corpus_instance(schema, &r);
        char *t = cJSON_PrintUnformatted(inst);
        size_t cut = (size_t)rng_int(&r, 0, (int)strlen(t));
        js_state st;
        js_init(s, &st);
        for (size_t i = 0; i < cut; i++) assert_true(js_feed(s, &st, (unsigned char)t[i]));
        for (int id = 0; id < V; id++) l[id] = 0;
        js_mask(s, v, &st, l);
        int allowed = 0;
        for (int id = 0; id < V; id++) {
            const char *b;
            size_t n;
            int want;
            if (id < TV && !tqkv_tokenizer_is_special(tok, id) &&
                tqkv_tokenizer_id_bytes(tok, id, &b, &n) == TQKV_OK && n > 0) {
                js_state u = st;
                want = 1;
                for (size_t k = 0; k < n && want; k++) want = js_feed(s, &u, (unsigned char)b[k]);
            } else {
                want = tqkv_model_is_eos(m, id) && js_complete(&st);
            }
            if (want != (l[id] == 0))
                fail_msg("schema %s prefix '%.*s': token %d mask %g, bytes say %d", txt, (int)cut, t, id,
                         (double)l[id], want);
            allowed += want;
        }
        assert_true(allowed > 0);
        free(t);
        free(txt);
        cJSON_Delete(inst);
        cJSON_Delete(schema);
        js_free(s);
    }
    free(l);
    jg_vocab_free(v);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
}

/* The token budget: from random reachable states with a random budget no smaller than the
 * shortest completion, tokens drawn at random among those js_mask_budget allows close the
 * document within the budget, every time. */
static void test_budget_closes(void **state) {
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
    const int V = tqkv_model_get_config(m)->vocab_size;
    float *l = malloc(sizeof(float) * (size_t)V);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)V);
    test_rng r;
    rng_init(&r, test_seed());
    int runs = 0;
    for (int it = 0; it < 60; it++) {
        cJSON *schema = it % 3 == 0 ? NULL : corpus_schema(rng_int(&r, 0, CORPUS_N - 1));
        char *txt = schema ? cJSON_PrintUnformatted(schema) : NULL;
        js_schema *s = NULL;
        assert_int_equal(js_compile(&s, txt, V), TQKV_OK);
        js_state st;
        js_init(s, &st);
        /* a reachable start: a prefix of a valid instance (json_object: of {"a": [1, "x"]}) */
        cJSON *inst = schema ? corpus_instance(schema, &r) : cJSON_Parse("{\"a\": [1, \"xy\", {\"b\": null}]}");
        char *t = cJSON_Print(inst);
        size_t cut = (size_t)rng_int(&r, 0, (int)strlen(t) - 1);
        for (size_t i = 0; i < cut; i++) assert_true(js_feed(s, &st, (unsigned char)t[i]));
        int left = js_min_close(s, &st) + rng_int(&r, 0, 12);
        if (left < 1) left = 1;
        char trail[4096];
        size_t tl = 0;
        while (!js_complete(&st)) {
            if (left < 1) fail_msg("schema %s prefix '%.*s' then '%.*s': over budget (need now %d)", txt ? txt : "(object)",
                                   (int)cut, t, (int)tl, trail, js_min_close(s, &st));
            for (int id = 0; id < V; id++) l[id] = 0;
            js_mask_budget(s, v, &st, left, l);
            int n = 0;
            for (int id = 0; id < V; id++)
                if (l[id] == 0 && !tqkv_model_is_eos(m, id)) ids[n++] = id;
            assert_true(n > 0);
            int32_t pick = ids[rng_int(&r, 0, n - 1)];
            const char *pb;
            size_t pn;
            tqkv_tokenizer_id_bytes(tok, pick, &pb, &pn);
            if (tl + pn + 8 < sizeof trail) {
                trail[tl++] = '|';
                memcpy(trail + tl, pb, pn);
                tl += pn;
            }
            int before = js_min_close(s, &st);
            assert_true(js_accept(s, v, &st, pick));
            if (js_min_close(s, &st) > left - 1)
                fail_msg("token '%.*s' (need %d -> %d) with %d left; trail %.*s", (int)pn, pb, before,
                         js_min_close(s, &st), left, (int)tl, trail);
            left--;
        }
        runs++;
        free(t);
        free(txt);
        cJSON_Delete(inst);
        cJSON_Delete(schema);
        js_free(s);
    }
    fprintf(stderr, "%d budgeted random walks closed in time\n", runs);
    free(ids);
    free(l);
    jg_vocab_free(v);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
}

/* The budgeted mask from the schema's cache (bitsets, tables sorted by threshold, reused
 * across budgets and states) equals the rule computed here token by token: the tokens whose
 * bytes are accepted, whose logit is above -inf and after which the shortest completion
 * fits in the tokens left after them; none such: the plain mask. Random reachable states of
 * corpus schemas and json_object, budgets from 1 to past the far bound, ~1% of the logits
 * -inf beforehand; one schema serves many states (its cache warm). */
static void test_budget_equals_rule(void **state) {
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
    const int V = tqkv_model_get_config(m)->vocab_size;
    float *l = malloc(sizeof(float) * (size_t)V), *l0 = malloc(sizeof(float) * (size_t)V);
    uint8_t *want = malloc((size_t)V);
    test_rng r;
    rng_init(&r, test_seed());
    int checks = 0, narrowed = 0;
    for (int sch = 0; sch < 8; sch++) {
        cJSON *schema = sch % 4 == 0 ? NULL : corpus_schema(rng_int(&r, 0, CORPUS_N - 1));
        char *txt = schema ? cJSON_PrintUnformatted(schema) : NULL;
        js_schema *s = NULL;
        assert_int_equal(js_compile(&s, txt, V), TQKV_OK);
        for (int it = 0; it < 12; it++) {
            cJSON *inst = schema ? corpus_instance(schema, &r)
                                 : cJSON_Parse("{\"a\": [1, \"xy z\", {\"b\": null, \"c\": -2.5e3}], \"d\": true}");
            char *t = it % 2 ? cJSON_Print(inst) : cJSON_PrintUnformatted(inst);
            size_t cut = (size_t)rng_int(&r, 0, (int)strlen(t) - 1);
            js_state st;
            js_init(s, &st);
            for (size_t i = 0; i < cut; i++) assert_true(js_feed(s, &st, (unsigned char)t[i]));
            const int need = js_min_close(s, &st);
            for (int b = 0; b < 4; b++) {
                const int left = b == 0 ? 1 : b == 1 ? need + 1 : b == 2 ? need + rng_int(&r, 0, 24)
                                                                        : need + rng_int(&r, 0, 400);
                for (int id = 0; id < V; id++)
                    l0[id] = rng_int(&r, 0, 99) == 0 ? -INFINITY : (float)rng_int(&r, -1000, 1000) / 100.0f;
                /* the rule, from the bytes */
                int kept = 0;
                for (int id = 0; id < V; id++) {
                    js_state u = st;
                    want[id] = (uint8_t)js_accept(s, v, &u, id); /* bytes accepted (EOS: done) */
                    if (want[id] && l0[id] != -INFINITY && (js_complete(&st) || js_min_close(s, &u) <= left - 1)) {
                        want[id] = 2;
                        kept++;
                    }
                }
                memcpy(l, l0, sizeof(float) * (size_t)V);
                js_mask_budget(s, v, &st, left, l);
                int differ = 0;
                for (int id = 0; id < V; id++) {
                    const int allowed = kept ? want[id] == 2 : want[id] != 0;
                    const float exp_l = allowed ? l0[id] : -INFINITY;
                    if (memcmp(&exp_l, &l[id], sizeof exp_l)) {
                        if (!differ++)
                            fail_msg("schema %s prefix '%.*s' left %d (need %d): token %d logit %g, the rule says %g",
                                     txt ? txt : "(object)", (int)cut, t, left, need, id, (double)l[id], (double)exp_l);
                    }
                }
                checks++;
                for (int id = 0; id < V && kept; id++)
                    if (want[id] == 1 && l0[id] != -INFINITY) {
                        narrowed++;
                        break;
                    }
            }
            free(t);
            cJSON_Delete(inst);
        }
        free(txt);
        cJSON_Delete(schema);
        js_free(s);
    }
    fprintf(stderr, "%d budgeted masks equal the rule (%d of them narrowed by the budget)\n", checks, narrowed);
    assert_true(narrowed > 0); /* the budget path ran */
    free(want);
    free(l0);
    free(l);
    jg_vocab_free(v);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corpus_instances),
        cmocka_unit_test(test_unsupported),
        cmocka_unit_test(test_mask_equals_bytes),
        cmocka_unit_test(test_budget_closes),
        cmocka_unit_test(test_budget_equals_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

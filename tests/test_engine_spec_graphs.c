/*
 * test_engine_spec_graphs.c - speculative decoding in the engine for Gemma 4 and Qwen 3.5
 * targets on the CPU: the fixtures ../shared/models/gemma4-code-30m and
 * ../shared/models/qwen35-code-hybrid-30m with the draft ../shared/models/qwen3-code-draft-4m
 * (the same tokenizer). Requests joining a running batch (greedy code prompts, random
 * prompts, one seeded sampled request) give exactly the tokens, text and logprobs of the
 * engine without a draft; the statistics count proposals and acceptances. For Gemma 4,
 * two code prompts sit just below the 512-token sliding window and below window + slack,
 * so rows cross both while they generate; admission with a draft counts the sliding
 * layers' tokens past window + slack that a round leaves. Each test SKIPPED, visibly, when its fixture or
 * the draft is absent (exit 77 when nothing can run).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine_helpers.h"
#include "testutil.h"
#include "tqkv_engine.h"
#include "tqkv_model.h"

enum { NJ = 5, K = 3 };

static char g_draft[1024];
static int g_have_draft;

/* Code text of about `want` tokens (a snippet repeated with a counter, then truncated). */
static int code_prompt(const tqkv_tokenizer *tk, int want, int32_t *out) {
    char text[16384];
    size_t at = 0;
    for (int i = 0; at + 400 < sizeof text; i++)
        at += (size_t)snprintf(text + at, sizeof text - at,
                               "def f%d(xs):\n    total = 0\n    for x in xs:\n        total += x"
                               " * %d\n    return total\n\n", i, i + 1);
    int32_t *ids = NULL;
    size_t n = 0;
    OK(tqkv_tokenizer_encode(tk, text, at, 0, &ids, &n));
    assert_true((int)n >= want);
    memcpy(out, ids, sizeof(int32_t) * (size_t)want);
    free(ids);
    return want;
}

static void spec_graph(const char *rel, int gemma) {
    char dir[1024];
    struct stat sb;
    if (!shared_path(rel, dir, sizeof dir) || stat(dir, &sb) != 0 || !g_have_draft) {
        printf("SKIPPED: ../shared/%s or the draft ../shared/models/qwen3-code-draft-4m "
               "absent\n", rel);
        skip();
    }
    test_rng r;
    rng_init(&r, test_seed() ^ (gemma ? 0x9e4 : 0x35));
    tqkv_engine *plain = engine_open(dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    const int V = tqkv_model_get_config(tqkv_engine_model(plain))->vocab_size;
    const tqkv_tokenizer *tk = tqkv_engine_tokenizer(plain);
    job j[NJ];
    make_jobs(&r, j, NJ, V); /* random prompts; job 2 seeded sampled */
    const char *texts[] = {"import numpy as np\n\ndef softmax(x):\n",
                           "for (int i = 0; i < n; i++) {\n"};
    for (int i = 0; i < 2; i++) {
        if (gemma) { /* rows cross the window (512) and window + slack (544) as they run */
            j[i].n_prompt = code_prompt(tk, i ? 530 : 500, j[i].prompt);
        } else {
            int32_t *ids = NULL;
            size_t n = 0;
            OK(tqkv_tokenizer_encode(tk, texts[i], strlen(texts[i]), 0, &ids, &n));
            memcpy(j[i].prompt, ids, sizeof(int32_t) * n);
            j[i].n_prompt = (int)n;
            free(ids);
        }
        j[i].temp = 0.0f;
    }
    for (int i = 0; i < NJ; i++) j[i].max_tokens = rng_int(&r, 20, 28);
    result ref[NJ], out[NJ];
    run_staggered(plain, j, NJ, ref, 2);
    tqkv_engine_free(plain);
    tqkv_engine *e = engine_open(dir, TQKV_TQ4, 64, 0, NULL, 0, g_draft, K, 0);
    run_staggered(e, j, NJ, out, 2);
    for (int i = 0; i < NJ; i++) {
        assert_int_equal(out[i].done, 1);
        assert_same_tokens(&out[i], &ref[i]);
    }
    tqkv_engine_stats st;
    OK(tqkv_engine_stats_get(e, &st));
    assert_true(st.spec_rounds > 0);
    assert_true(st.spec_accepted > 0 && st.spec_accepted <= st.spec_drafted);
    printf("%s + draft (K=%d): %d requests == no draft (tokens, text, logprobs); %llu rounds, "
           "accepted %llu of %llu drafted\n", rel, K, NJ, (unsigned long long)st.spec_rounds,
           (unsigned long long)st.spec_accepted, (unsigned long long)st.spec_drafted);
    tqkv_engine_free(e);
}

/* Admission with a draft counts what a Gemma 4 sliding layer holds between a round's end and
 * the next begin: up to K + 1 tokens past window + slack. Budget P0 = the request's projection
 * without them (target state at window + slack, plus the draft's): the engine with a draft
 * must refuse the request as one that can never fit (it admitted it before); budget P1 = with
 * them: admitted. */
static void test_gemma4_draft_budget(void **st) {
    (void)st;
    char dir[1024];
    struct stat sb;
    if (!shared_path("models/gemma4-code-30m", dir, sizeof dir) || stat(dir, &sb) != 0 ||
        !g_have_draft) {
        printf("SKIPPED: ../shared/models/gemma4-code-30m or the draft absent\n");
        skip();
    }
    enum { NP = 40, MAXT = 600 }; /* 640 tokens: past window + slack (544) */
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    tqkv_model *m = NULL, *dm = NULL;
    OK(tqkv_model_load(&m, dir, &lp));
    OK(tqkv_model_load(&dm, g_draft, &lp));
    tqkv_model_state_params sp = tqkv_model_state_params_default(); /* the engine's (engine.c) */
    sp.k_format = sp.v_format = TQKV_TQ4;
    sp.threads = 2;
    sp.extend_as_decode = 1;
    tqkv_model_state_params sp1 = sp, dsp = tqkv_model_state_params_default();
    sp1.window_slack += K + 1;
    dsp.k_format = dsp.v_format = TQKV_TQ4;
    dsp.threads = 2;
    tqkv_model_state *s0 = NULL, *s1 = NULL, *ds = NULL;
    OK(tqkv_model_state_init(&s0, m, &sp));
    OK(tqkv_model_state_init(&s1, m, &sp1));
    OK(tqkv_model_state_init(&ds, dm, &dsp));
    const size_t d = tqkv_model_state_projected_bytes(ds, NP + MAXT);
    const size_t p0 = tqkv_model_state_projected_bytes(s0, NP + MAXT) + d;
    const size_t p1 = tqkv_model_state_projected_bytes(s1, NP + MAXT) + d;
    assert_true(p1 > p0); /* the sliding layers' K + 1 tokens */
    tqkv_model_state_free(s0);
    tqkv_model_state_free(s1);
    tqkv_model_state_free(ds);
    tqkv_model_free(m);
    tqkv_model_free(dm);
    test_rng r;
    rng_init(&r, test_seed() ^ 0xb0d6);
    job j;
    memset(&j, 0, sizeof j);
    j.n_prompt = NP;
    j.max_tokens = MAXT;
    for (int i = 0; i < NP; i++) j.prompt[i] = rng_int(&r, 1, 8000);
    const size_t budgets[2] = {p0, p1};
    for (int b = 0; b < 2; b++) {
        tqkv_engine_params p = tqkv_engine_params_default();
        p.model_dir = dir;
        p.draft_dir = g_draft;
        p.draft_tokens = K;
        p.k_format = p.v_format = TQKV_TQ4;
        p.threads = 2;
        p.kv_budget = budgets[b];
        tqkv_engine *e = NULL;
        OK(tqkv_engine_init(&e, &p));
        result res;
        submit(e, &j, &res);
        int busy;
        OK(tqkv_engine_step(e, &busy));
        tqkv_engine_stats es;
        OK(tqkv_engine_stats_get(e, &es));
        if (b == 0 && !(res.done && res.finish == TQKV_FINISH_ERROR))
            fail_msg("budget %zu (window + slack, no round overhang): the request was admitted "
                     "(running %d, queued %d)", p0, es.running, es.queued);
        if (b == 1 && !(es.running == 1 && !res.done))
            fail_msg("budget %zu (with the round overhang): not admitted (running %d, done %d)",
                     p1, es.running, res.done);
        tqkv_engine_free(e);
    }
    printf("gemma4 + draft (K=%d): %d + %d tokens refused at %zu bytes, admitted at %zu (the "
           "sliding layers' K + 1 tokens past window + slack counted)\n", K, NP, MAXT, p0, p1);
}

static void test_gemma4_draft(void **st) { (void)st; spec_graph("models/gemma4-code-30m", 1); }
static void test_qwen35_draft(void **st) { (void)st; spec_graph("models/qwen35-code-hybrid-30m", 0); }

int main(void) {
    struct stat sb;
    g_have_draft = shared_path("models/qwen3-code-draft-4m", g_draft, sizeof g_draft) &&
                   stat(g_draft, &sb) == 0;
    char a[1024], b[1024];
    if (!g_have_draft || (!shared_path("models/gemma4-code-30m", a, sizeof a) &&
                          !shared_path("models/qwen35-code-hybrid-30m", b, sizeof b))) {
        printf("SKIPPED: ../shared draft or target fixtures absent\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemma4_draft),
        cmocka_unit_test(test_qwen35_draft),
        cmocka_unit_test(test_gemma4_draft_budget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

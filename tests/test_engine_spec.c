/*
 * test_engine_spec.c - batched speculative decoding in the engine with the fixture draft
 * model (../shared/models/qwen3-code-draft-4m; SKIPPED with 77 when absent): greedy and
 * seeded sampled requests give exactly the tokens of the engine without a draft, alone
 * and in a batch that changes as requests join and leave; the draft proposes, and the
 * statistics count what it proposed and what was accepted.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine_helpers.h"
#include "testutil.h"
#include "tqkv_engine.h"

static char g_dir[1024], g_draft[1024];

static tqkv_engine *engine_new(tqkv_format kv, int chunk, size_t prefix_bytes, const char *dir,
                               int queue_max, const char *draft, int K) {
    return engine_open(g_dir, kv, chunk, prefix_bytes, dir, queue_max, draft, K, 0);
}

// ---------------------------------------------------------------------------
// Draft == no draft
// ---------------------------------------------------------------------------

enum { NJ = 6 };

static void run_batch(tqkv_engine *e, job *j, result *res) { run_staggered(e, j, NJ, res, 3); }

static void test_draft_equals_plain(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 5);
    tqkv_engine *plain = engine_new(TQKV_TQ4, 64, 0, NULL, 0, NULL, 0);
    int V = tqkv_model_get_config(tqkv_engine_model(plain))->vocab_size;
    const tqkv_tokenizer *tk = tqkv_engine_tokenizer(plain);
    /* code prompts (the draft agrees often on code), random-token prompts too */
    const char *texts[] = {"import numpy as np\n\ndef softmax(x):\n",
                           "for (int i = 0; i < n; i++) {\n", "class Stack:\n    def __init__(self):"};
    job j[NJ];
    make_jobs(&r, j, NJ, V);
    for (int i = 0; i < 3; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        OK(tqkv_tokenizer_encode(tk, texts[i], strlen(texts[i]), 0, &ids, &n));
        memcpy(j[i].prompt, ids, sizeof(int32_t) * n);
        j[i].n_prompt = (int)n;
        free(ids);
    }
    for (int i = 0; i < NJ; i++) j[i].max_tokens = rng_int(&r, 8, 28);
    result ref[NJ], alone[NJ], batch[NJ];
    run_batch(plain, j, ref);
    tqkv_engine_free(plain);
    for (int K = 3; K <= 3; K++) {
        tqkv_engine *e = engine_new(TQKV_TQ4, 64, 0, NULL, 0, g_draft, K);
        for (int i = 0; i < NJ; i++) {
            submit(e, &j[i], &alone[i]);
            run_until_idle(e);
            assert_same_tokens(&alone[i], &ref[i]);
        }
        run_batch(e, j, batch);
        for (int i = 0; i < NJ; i++) assert_same_tokens(&batch[i], &ref[i]);
        tqkv_engine_stats st;
        OK(tqkv_engine_stats_get(e, &st));
        assert_true(st.spec_rounds > 0);
        assert_true(st.spec_accepted <= st.spec_drafted);
        assert_true(st.spec_accepted > 0); /* greedy code continuations agree sometimes */
        fprintf(stderr, "K=%d: %llu rounds, accepted %llu of %llu drafted\n", K,
                (unsigned long long)st.spec_rounds, (unsigned long long)st.spec_accepted,
                (unsigned long long)st.spec_drafted);
        tqkv_engine_free(e);
    }
}

int main(void) {
    source_path("models/qwen3-code-28m", g_dir, sizeof g_dir);
    struct stat s;
    if (stat(g_dir, &s) != 0 || !shared_path("models/qwen3-code-draft-4m", g_draft, sizeof g_draft) ||
        stat(g_draft, &s) != 0) {
        fprintf(stderr, "test_engine_spec: model or ../shared draft model absent: SKIPPED\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_draft_equals_plain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

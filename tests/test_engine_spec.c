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

#include "testutil.h"
#include "tqkv_engine.h"

static char g_dir[1024], g_draft[1024];

#define OK(x)                                                                                     \
    do {                                                                                          \
        tqkv_status rc_ = (x);                                                                    \
        if (rc_ != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

// ---------------------------------------------------------------------------
// Collecting events
// ---------------------------------------------------------------------------

typedef struct {
    int32_t toks[512];
    int     n_tok;
    char    text[8192];
    size_t  text_len;
    int     done, events, finish, cached, completion;
    float   lp[512];
    int32_t top0[512];
    int     n_top;
} result;

static void on_event(void *user, uint64_t id, const tqkv_engine_event *ev) {
    (void)id;
    result *r = user;
    assert_int_equal(r->done, 0); /* nothing after the final event */
    r->events++;
    if (ev->token >= 0 && r->n_tok < 512) {
        r->lp[r->n_tok] = ev->logprob;
        r->top0[r->n_tok] = ev->n_top > 0 ? ev->top_ids[0] : -1;
        r->n_top = ev->n_top;
        for (int i = 1; i < ev->n_top; i++) assert_true(ev->top_logprobs[i] <= ev->top_logprobs[i - 1]);
        r->toks[r->n_tok++] = ev->token;
    }
    if (ev->text_len && r->text_len + ev->text_len < sizeof r->text) {
        memcpy(r->text + r->text_len, ev->text, ev->text_len);
        r->text_len += ev->text_len;
    }
    if (ev->done) {
        r->done = 1;
        r->finish = ev->finish;
        r->cached = ev->cached_tokens;
        r->completion = ev->completion_tokens;
    }
}

typedef struct {
    int32_t prompt[700];
    int     n_prompt, max_tokens;
    float   temp;
    uint64_t seed;
    const char *stop[2];
    int     n_stop, top_logprobs;
} job;

static tqkv_engine *engine_new(tqkv_format kv, int chunk, size_t prefix_bytes, const char *dir,
                               int queue_max, const char *draft, int K) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_dir;
    p.draft_dir = draft;
    p.draft_tokens = K;
    p.k_format = p.v_format = kv;
    p.threads = 2;
    p.prefill_chunk = chunk;
    p.prefix_cache_bytes = prefix_bytes;
    p.prompt_cache_dir = dir;
    if (queue_max) p.queue_max = queue_max;
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    return e;
}

static uint64_t submit(tqkv_engine *e, const job *j, result *r) {
    memset(r, 0, sizeof *r);
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j->prompt;
    q.n_prompt = j->n_prompt;
    q.max_tokens = j->max_tokens;
    q.sampling = tqkv_sampler_params_default();
    q.sampling.temperature = j->temp;
    q.sampling.top_p = j->temp > 0 ? 0.9f : 1.0f;
    q.sampling.seed = j->seed;
    q.stop = j->stop;
    q.n_stop = j->n_stop;
    q.ignore_eos = 1;
    q.top_logprobs = j->top_logprobs ? j->top_logprobs : -1;
    q.on_event = on_event;
    q.user = r;
    uint64_t id = 0;
    OK(tqkv_engine_submit(e, &q, &id));
    return id;
}

static void run_until_idle(tqkv_engine *e) {
    int busy = 1, guard = 0;
    while (busy) {
        OK(tqkv_engine_step(e, &busy));
        assert_true(++guard < 100000);
    }
}

static void make_jobs(test_rng *r, job *j, int n, int V) {
    for (int i = 0; i < n; i++) {
        memset(&j[i], 0, sizeof j[i]);
        j[i].n_prompt = rng_int(r, 1, 200);
        for (int t = 0; t < j[i].n_prompt; t++) j[i].prompt[t] = rng_int(r, 1, V - 1);
        j[i].max_tokens = rng_int(r, 1, 24);
        j[i].temp = i % 3 == 2 ? 0.8f : 0.0f;
        j[i].seed = rng_u64(r);
        j[i].top_logprobs = i % 2 ? 3 : 1;
    }
}

static void assert_same_tokens(const result *a, const result *b) {
    assert_int_equal(a->n_tok, b->n_tok);
    assert_memory_equal(a->toks, b->toks, sizeof(int32_t) * (size_t)a->n_tok);
    assert_int_equal(a->text_len, b->text_len);
    assert_memory_equal(a->text, b->text, a->text_len);
    assert_int_equal(a->finish, b->finish);
    /* logprobs come from the raw logits: equal floats mean bitwise equal logits */
    assert_memory_equal(a->lp, b->lp, sizeof(float) * (size_t)a->n_tok);
}

// ---------------------------------------------------------------------------
// Draft == no draft
// ---------------------------------------------------------------------------

enum { NJ = 6 };

static void run_batch(tqkv_engine *e, job *j, result *res) {
    int next = 0, busy = 1, steps = 0;
    while (busy || next < NJ) {
        if (next < NJ && steps % 3 == 0) {
            submit(e, &j[next], &res[next]);
            next++;
        }
        OK(tqkv_engine_step(e, &busy));
        steps++;
    }
}

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

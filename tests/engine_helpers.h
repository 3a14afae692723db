/*
 * engine_helpers.h - helpers for the engine tests (test_engine.c, test_engine_spec.c):
 * collecting a request's events, random jobs, opening an engine, submitting a job,
 * stepping the engine until idle (or while jobs join), comparing two requests' outputs bit
 * for bit. Used by test_engine.c, test_engine_spec.c and test_cuda_model.c.
 * Must not: hide assertions about the behaviour under test (they stay in the tests).
 */
#ifndef TQKV_ENGINE_HELPERS_H
#define TQKV_ENGINE_HELPERS_H

#include <string.h>

#include "testutil.h"
#include "tqkv_engine.h"

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

static inline void on_event(void *user, uint64_t id, const tqkv_engine_event *ev) {
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

// ---------------------------------------------------------------------------
// Submitting, stepping, comparing
// ---------------------------------------------------------------------------

static inline uint64_t submit(tqkv_engine *e, const job *j, result *r) {
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

static inline void run_until_idle(tqkv_engine *e) {
    int busy = 1, guard = 0;
    while (busy) {
        OK(tqkv_engine_step(e, &busy));
        assert_true(++guard < 100000);
    }
}

/* An engine on model `dir` with the tests' settings (2 threads, KV kv/kv, prefill chunk
 * `chunk`); the other arguments as in tqkv_engine_params (0 / NULL: default). */
static inline tqkv_engine *engine_open(const char *dir, tqkv_format kv, int chunk,
                                       size_t prefix_bytes, const char *cache_dir, int queue_max,
                                       const char *draft, int K, int device) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = dir;
    p.draft_dir = draft;
    if (K) p.draft_tokens = K;
    p.k_format = p.v_format = kv;
    p.threads = 2;
    p.prefill_chunk = chunk;
    p.prefix_cache_bytes = prefix_bytes;
    p.prompt_cache_dir = cache_dir;
    if (queue_max) p.queue_max = queue_max;
    p.device = device;
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    return e;
}

/* Submit jobs j[0..n) one every `every` engine steps, so rows join a running batch; step
 * until idle. */
static inline void run_staggered(tqkv_engine *e, const job *j, int n, result *res, int every) {
    int next = 0, busy = 1, steps = 0;
    while (busy || next < n) {
        if (next < n && steps % every == 0) {
            submit(e, &j[next], &res[next]);
            next++;
        }
        OK(tqkv_engine_step(e, &busy));
        steps++;
    }
}

static inline void make_jobs(test_rng *r, job *j, int n, int V) {
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

/* Two jobs for prefix-cache tests: a, a random 150-token prompt (top_logprobs 2); b, the
 * same first 100 tokens, then 40 of its own. */
static inline void make_prefix_pair(test_rng *r, int V, int max_tokens, job *a, job *b) {
    memset(a, 0, sizeof *a);
    a->n_prompt = 150;
    for (int t = 0; t < a->n_prompt; t++) a->prompt[t] = rng_int(r, 1, V - 1);
    a->max_tokens = max_tokens;
    a->top_logprobs = 2;
    *b = *a;
    b->n_prompt = 140;
    for (int t = 100; t < b->n_prompt; t++) b->prompt[t] = rng_int(r, 1, V - 1);
}

static inline void assert_same_tokens(const result *a, const result *b) {
    assert_int_equal(a->n_tok, b->n_tok);
    assert_memory_equal(a->toks, b->toks, sizeof(int32_t) * (size_t)a->n_tok);
    assert_int_equal(a->text_len, b->text_len);
    assert_memory_equal(a->text, b->text, a->text_len);
    assert_int_equal(a->finish, b->finish);
    /* logprobs come from the raw logits: equal floats mean bitwise equal logits */
    assert_memory_equal(a->lp, b->lp, sizeof(float) * (size_t)a->n_tok);
}

#endif

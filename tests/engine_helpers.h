/*
 * engine_helpers.h - helpers for the engine tests (test_engine.c, test_engine_spec.c):
 * collecting a request's events, random jobs, submitting a job, stepping the engine until
 * idle, comparing two requests' outputs bit for bit.
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

/*
 * engine_fork.c - n choices of one request (OpenAI's n > 1): the prompt is prefilled once
 * in the request's 1-row state; when that is done the row is copied (a byte copy of its
 * compressed KV, tqkv_model_state_extract_row) into one state per further choice, each
 * choice gets its own sampler (seed + index) and picks its first token from the same
 * logits. From there every choice is an ordinary row of the running batch (batch
 * invariance: choice i's tokens are those of a single request with seed + i).
 * Owns: the making of choices 1..n-1 and their samplers.
 * Must not: schedule (engine.c), format output (engine_request.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_impl.h"
#include "util/common.h"

/* The sampler's constraint of a JSON row: mask what cannot continue its document. */
static void json_constrain(void *ctx, float *logits, int vocab) {
    (void)vocab;
    const eng_req *q = ctx;
    /* tokens this row may still take (submit refused n_prompt + max_tokens > the context,
     * so max_tokens is the limit) */
    int left = q->max_tokens - q->n_gen;
    js_mask_budget(q->js, q->jv, &q->jst, left, logits);
}

tqkv_status engine_req_sampler(tqkv_engine *e, eng_req *q, uint64_t seed) {
    const int V = tqkv_model_get_config(e->m)->vocab_size;
    tqkv_sampler_params sp = q->sp;
    sp.seed = seed;
    if (q->js) {
        sp.constrain = json_constrain;
        sp.constrain_ctx = q;
    }
    tqkv_status rc = tqkv_sampler_init(&q->sampler, &sp, V);
    /* the repetition penalty reads the prompt too; OpenAI's penalties only what follows */
    if (rc == TQKV_OK && sp.repetition_penalty != 1.0f)
        for (int i = 0; i < q->n_prompt && rc == TQKV_OK; i++)
            rc = tqkv_sampler_accept(q->sampler, q->prompt[i]);
    if (rc == TQKV_OK) tqkv_sampler_mark_prompt_end(q->sampler);
    return rc;
}

/* A copy of q's request fields for choice `index` (no state, no output yet). */
static eng_req *choice_new(tqkv_engine *e, const eng_req *q, int index, tqkv_status *rc) {
    eng_req *c = tqkv_calloc(1, sizeof *c);
    if (!c) return *rc = TQKV_ENOMEM, NULL;
    c->id = q->id;
    c->phase = REQ_PREFILL;
    c->n_prompt = q->n_prompt;
    c->max_tokens = q->max_tokens;
    c->sp = q->sp;
    c->ignore_eos = q->ignore_eos;
    c->top_logprobs = q->top_logprobs;
    c->fn = q->fn;
    c->user = q->user;
    c->n_choices = q->n_choices;
    c->index = index;
    c->forked = 1;
    c->js = js_ref(q->js);
    c->jst = q->jst;
    c->jv = q->jv;
    c->prefilled = q->prefilled;
    c->dprefilled = q->dprefilled;
    c->cached = q->cached;
    c->last = -1;
    c->t_submit = q->t_submit;
    c->prompt = malloc(sizeof(int32_t) * (size_t)q->n_prompt);
    c->stop = q->n_stop ? calloc((size_t)q->n_stop, sizeof(char *)) : NULL;
    if (!c->prompt || (q->n_stop && !c->stop)) goto oom;
    memcpy(c->prompt, q->prompt, sizeof(int32_t) * (size_t)q->n_prompt);
    for (int i = 0; i < q->n_stop; i++, c->n_stop++) {
        size_t n = strlen(q->stop[i]) + 1;
        if (!(c->stop[i] = malloc(n))) goto oom;
        memcpy(c->stop[i], q->stop[i], n);
    }
    if (q->sp.n_bias > 0) {
        c->bias_ids = malloc(sizeof(int32_t) * (size_t)q->sp.n_bias);
        c->bias_vals = malloc(sizeof(float) * (size_t)q->sp.n_bias);
        if (!c->bias_ids || !c->bias_vals) goto oom;
        memcpy(c->bias_ids, q->bias_ids, sizeof(int32_t) * (size_t)q->sp.n_bias);
        memcpy(c->bias_vals, q->bias_vals, sizeof(float) * (size_t)q->sp.n_bias);
        c->sp.bias_ids = c->bias_ids;
        c->sp.bias_vals = c->bias_vals;
    }
    if ((*rc = engine_req_sampler(e, c, q->sp.seed + (uint64_t)index)) != TQKV_OK) goto fail;
    if ((*rc = tqkv_decode_stream_init(&c->ds, e->tok, TQKV_DECODE_SKIP_SPECIAL)) != TQKV_OK) goto fail;
    if ((*rc = tqkv_model_state_extract_row(q->pre, 0, &c->pre)) != TQKV_OK) goto fail;
    if (q->dpre && (*rc = tqkv_model_state_extract_row(q->dpre, 0, &c->dpre)) != TQKV_OK) goto fail;
    return c;
oom:
    *rc = tqkv_fail(TQKV_ENOMEM, "engine: out of memory for a choice");
fail:
    req_free(c);
    return NULL;
}

void engine_fork_choices(tqkv_engine *e, eng_req *q, const float *logits) {
    q->forked = 1;
    const int n = q->n_choices;
    const size_t share = q->reserved / (size_t)n;
    for (int i = 1; i < n; i++) {
        tqkv_status rc = TQKV_OK;
        eng_req *c = choice_new(e, q, i, &rc);
        int32_t tok;
        tok_info ti;
        if (c && (rc = req_pick(e, c, logits, &tok, &ti)) != TQKV_OK) {
            req_free(c);
            c = NULL;
        }
        pthread_mutex_lock(&e->mu);
        int ok = c && engine_grow_ptrs((void ***)&e->pre, &e->cap_pre, e->n_pre + 1);
        if (ok) {
            c->reserved = share; /* moved from q: each choice releases its own */
            q->reserved -= share;
            e->pre[e->n_pre++] = c;
        }
        pthread_mutex_unlock(&e->mu);
        if (ok) {
            c->phase = REQ_RUNNING;
            req_take(e, c, tok, &ti);
            continue;
        }
        /* this choice cannot run: its final event, from a stand-in that holds nothing */
        char msg[256];
        snprintf(msg, sizeof msg, "choice %d: %s", i, c ? "out of memory" : tqkv_last_error());
        eng_req standin;
        memset(&standin, 0, sizeof standin);
        standin.id = q->id;
        standin.n_prompt = q->n_prompt;
        standin.fn = q->fn;
        standin.user = q->user;
        standin.index = i;
        standin.n_choices = n;
        standin.forked = 1;
        standin.top_logprobs = -1;
        req_finish_plain(e, &standin, TQKV_FINISH_ERROR, msg);
        req_free(c);
    }
}

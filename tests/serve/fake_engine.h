/*
 * fake_engine.h - a test double of the serving engine for the HTTP tests: a thread that
 * "generates" a deterministic token sequence per request (token i of a request is a hash
 * of its prompt and i), with round-robin interleaving of all open requests, stop strings,
 * max_tokens, top logprobs, a bounded queue (TQKV_EBUSY) and cancellation. It checks the
 * server's HTTP/JSON/SSE layer and fault handling without the cost of a model; the
 * real-engine tests (test_serve_engine.c) check generation itself.
 */
#ifndef TQKV_FAKE_ENGINE_H
#define TQKV_FAKE_ENGINE_H

#include "server/server.h"

typedef struct fake_engine fake_engine;

#define FAKE_FAIL_MESSAGE "CUDA: out of memory (fake engine: a KV cache allocation failed)"

typedef struct {
    int   queue_max;      /* open requests beyond this: TQKV_EBUSY */
    int   step_us;        /* sleep per generated token (all requests) */
    int   context_len;
    int   first_us;       /* sleep before the first token of each request */
    const char *script;   /* non-NULL: every request (every choice) generates the tokens of
                             this text (a forced output, e.g. a tool call), then stops */
    int   fail_after;     /* > 0: every request fails after this many tokens (final event
                             TQKV_FINISH_ERROR with a message), as the real engine ends the
                             running rows when a device allocation fails mid-generation */
} fake_params;

int         fake_engine_init(fake_engine **out, const fake_params *p, const tqkv_tokenizer *tok);
void        fake_engine_free(fake_engine *f);
srv_engine  fake_engine_bind(fake_engine *f);
/* The token sequence a request with this prompt gets (for expected outputs); choice c of
 * n > 1 gets fake_engine_token(prompt, n_prompt, i + 7919 * c, vocab). */
int32_t     fake_engine_token(const int32_t *prompt, int n_prompt, int i, int32_t vocab);
/* Requests cancelled so far. */
int         fake_engine_cancelled(fake_engine *f);
/* Open requests now. */
int         fake_engine_open(fake_engine *f);

#endif

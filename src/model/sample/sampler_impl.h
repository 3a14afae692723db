/*
 * sampler_impl.h - the sampler's internals (sampler.c) for decode-and-pick
 * (tqkv_model_decode_pick, pick.c): which rows can be picked from a few candidates, the
 * tokens the repetition penalty applies to, and the host's finish of a row whose
 * candidates were selected elsewhere (the device: pick_cuda.cu).
 * Owns: nothing beyond sampler.c's own state; every function gives the token
 * tqkv_sampler_sample would give on the same row (bitwise the same logic and RNG draws).
 * Must not: be included outside src/model and tests.
 */
#ifndef TQKV_SAMPLER_IMPL_H
#define TQKV_SAMPLER_IMPL_H

#include <stdint.h>

#include "tqkv_model.h"

/* How a row of this sampler can be picked when only some of its logits come back. */
typedef enum {
    SAMPLER_PICK_GREEDY = 0, /* temperature 0: argmax after the penalty */
    SAMPLER_PICK_TOP_K,      /* temperature > 0, 0 < top_k < vocab, top_k <= the limit:
                                the top_k candidates decide the token */
    SAMPLER_PICK_FULL        /* anything else needs the whole row */
} sampler_pick_kind;

/* The kind for a candidate limit of k_limit; *k (may be NULL) gets top_k for TOP_K,
 * 1 for GREEDY, 0 for FULL. */
sampler_pick_kind sampler_pick_kind_of(const tqkv_sampler *s, int k_limit, int *k);
int   sampler_vocab(const tqkv_sampler *s);
/* 1 when the sampler masks through a constraint callback (whose state may be shared with
 * other rows' samplers: such rows are picked on one thread). */
int   sampler_constrained(const tqkv_sampler *s);
float sampler_temperature(const tqkv_sampler *s);
/* The repetition penalty factor r (logit l becomes l > 0 ? l / r : l * r), 1 = none. */
float sampler_penalty(const tqkv_sampler *s);
/* At most this many tokens come out of sampler_penalty_tokens (the penalty window). */
int   sampler_penalty_bound(const tqkv_sampler *s);
/* The distinct tokens of the penalty window, first occurrence first, into out
 * [sampler_penalty_bound]: the tokens tqkv_sampler_sample penalizes, each once. Returns
 * the count (0 when the penalty is 1 or the history is empty). */
int   sampler_penalty_tokens(tqkv_sampler *s, int32_t *out);

/* Greedy argmax of l [V] with the sampler's rule: NaN never picked, lowest id on ties
 * (-0.0 equals +0.0); TQKV_EINVAL (the sampler's message) when no logit is above -inf. */
tqkv_status sampler_argmax(const float *l, int V, int *token);
/* The greedy answer when the argmax was found elsewhere: id < 0 (every logit NaN) or
 * val == -inf fail as sampler_argmax does; else *token = id. */
tqkv_status sampler_finish_greedy(int32_t id, float val, int *token);
/* Finish a TOP_K row of s from its candidates: val [n] the logits after the repetition
 * penalty (before the temperature), id [n] their ids, n == top_k; they must be the top_k
 * of the row by (logit / temperature desc, id asc), in any order. finite: 0 when the row
 * (after the penalty) holds a NaN, a logit / temperature equal to +inf or nothing above
 * -inf, i.e. when tqkv_sampler_sample's sum over the vocab is not finite: its error then.
 * Otherwise temperature, softmax over the candidates, top-p, min-p and the draw, with one
 * RNG draw, exactly as tqkv_sampler_sample. */
tqkv_status sampler_finish_top_k(tqkv_sampler *s, const float *val, const int32_t *id, int n,
                                 int finite, int *token);

#endif

/*
 * pick.h - decode-and-pick on the device: what goes up per step, what comes back per row,
 * and the order key the device selects with. Plain C, shared by pick.c (the host side of
 * tqkv_model_decode_pick), forward_cuda.cu (the decode step that queues the pick) and
 * pick_cuda.cu (the kernel); the tests use pick_key for a host reference of the selection.
 * Owns: the per-row plan (pick_row), the result record layout, PICK_TOP_K_MAX.
 * Must not: hold sampling logic (sampler.c: the host finishes every row with its code).
 *
 * Per row the device does one of (pick_row.mode):
 *   PICK_NONE    nothing (the row needs its full logits: the CPU sampler runs on them);
 *   PICK_GREEDY  the repetition penalty, then argmax (NaN never picked, lowest id on ties,
 *                -0.0 == +0.0): 1 candidate;
 *   PICK_TOP_K   the penalty, then the k best by (l / temperature desc, id asc), with l / T
 *                rounded as the CPU divides (IEEE), plus the row's finiteness flags: k
 *                candidates (the penalized logit l, before the temperature, and its id).
 * The penalty is l > 0 ? l / r : l * r in float (IEEE, no fast math), once per distinct
 * token of the sampler's window (sampler_penalty_tokens), applied in place on the device
 * logits (after any full copy of them was queued).
 *
 * Upload (one copy per step, exact size): pick_row [rows], then the penalty tokens int32
 * [n_pen] (row r's at pen_off .. pen_off + pen_n).
 * Result (one copy per step): per row PICK_REC_WORDS(stride) int32 words:
 *   [0] flags (PICK_F_*), [1] n candidates written, [2, 2 + stride) ids,
 *   [2 + stride, 2 + 2 stride) values (float bits); stride >= every row's k.
 */
#ifndef TQKV_PICK_H
#define TQKV_PICK_H

#include <stdint.h>
#include <string.h>

/* Largest top_k the device selects (one 1024-thread block sorts the candidates); rows with a
 * larger top_k take the full-row path. */
#define PICK_TOP_K_MAX 1024

enum { PICK_NONE = 0, PICK_GREEDY = 1, PICK_TOP_K = 2 };

/* Row flags (PICK_TOP_K): the CPU sampler's sum over the vocab is finite iff
 * ABOVE_NEG_INF is set and NAN and POS_INF are not. */
#define PICK_F_NAN 1u           /* a penalized logit is NaN */
#define PICK_F_POS_INF 2u       /* some l / T is +inf (an inf logit, or an overflow) */
#define PICK_F_ABOVE_NEG_INF 4u /* some l / T is above -inf */

typedef struct {
    int32_t mode;    /* PICK_NONE / PICK_GREEDY / PICK_TOP_K */
    int32_t k;       /* candidates (TOP_K: top_k; GREEDY: 1) */
    int32_t pen_off; /* first penalty token of the row in the token list */
    int32_t pen_n;   /* its distinct penalty tokens (0: no penalty) */
    float   temp;    /* TOP_K: temperature (> 0) */
    float   penalty; /* r (pen_n > 0) */
} pick_row;

#define PICK_REC_WORDS(stride) (2 + 2 * (size_t)(stride))

#if defined(__CUDACC__)
#define PICK_HD static __host__ __device__ __forceinline__
#else
#define PICK_HD static inline
#endif

/* The selection's order key of a value v: unsigned order equals float order, with -0.0
 * mapped to +0.0 (equal, as the CPU compares them). -inf -> 0x007fffff, the least of the
 * non-NaN keys; NaN keys are meaningless (a NaN row is an error). */
PICK_HD uint32_t pick_key(float v) {
    uint32_t u;
    if (v == 0.0f) v = 0.0f;
    memcpy(&u, &v, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#endif

/*
 * pick_ref.h - a plain C reference of the device pick (src/model/sample/pick_cuda.cu), for
 * test_sampler.c (its results finished by sampler_impl.h must equal tqkv_sampler_sample)
 * and test_cuda_model.c (the kernel's records must equal it).
 * Owns: pick_ref_row: the repetition penalty in place, then the greedy argmax as the
 * kernel's thread-strided scan and reductions, or the top-k as its radix select (4 passes
 * of 8 bits over pick_key(l / T)), gather (keys above the threshold, the lowest ids equal
 * to it) and sort by (key desc, id asc); the same flags and record layout (pick.h).
 * pick_ref_gen_row: the rows both tests draw (ties, signed zeros, -inf, NaN, +inf, overflow).
 * Must not: call the sampler (the point is to check the device's algorithm against it).
 */
#ifndef TQKV_PICK_REF_H
#define TQKV_PICK_REF_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/sample/pick.h"
#include "testutil.h"

#define PICK_REF_THREADS 1024 /* the kernel's block: its greedy scan stride */

typedef struct {
    uint64_t c; /* (key << 32) | ~id: larger sorts first */
} pick_ref_cand;

static inline int pick_ref_cmp(const void *a, const void *b) {
    const uint64_t x = ((const pick_ref_cand *)a)->c, y = ((const pick_ref_cand *)b)->c;
    return x < y ? 1 : x > y ? -1 : 0; /* descending */
}

static inline int pick_ref_greedy_better(float av, int ai, float bv, int bi) {
    return ai >= 0 && (bi < 0 || av > bv || (av == bv && ai < bi));
}

/* Row l [V] (modified by the penalty) with plan p and its penalty tokens pen [p->pen_n];
 * writes rec [PICK_REC_WORDS(stride)] as the kernel does. */
static inline void pick_ref_row(float *l, int V, const pick_row *p, const int32_t *pen, int stride,
                                int32_t *rec) {
    rec[0] = rec[1] = 0;
    if (p->mode != PICK_GREEDY && p->mode != PICK_TOP_K) return;
    for (int j = 0; j < p->pen_n; j++) {
        const float x = l[pen[j]];
        l[pen[j]] = x > 0.0f ? x / p->penalty : x * p->penalty;
    }
    int32_t *ids = rec + 2, *vals = rec + 2 + stride;
    if (p->mode == PICK_GREEDY) {
        float bv = 0.0f;
        int bi = -1;
        for (int t = 0; t < PICK_REF_THREADS; t++) { /* each thread's first best, then merged */
            float tv = 0.0f;
            int ti = -1;
            for (int i = t; i < V; i += PICK_REF_THREADS)
                if (!isnan(l[i]) && (ti < 0 || l[i] > tv)) {
                    tv = l[i];
                    ti = i;
                }
            if (pick_ref_greedy_better(tv, ti, bv, bi)) {
                bv = tv;
                bi = ti;
            }
        }
        rec[1] = bi >= 0;
        ids[0] = bi;
        memcpy(&vals[0], &bv, 4);
        return;
    }
    const int k = p->k;
    const float T = p->temp;
    unsigned flags = 0;
    for (int i = 0; i < V; i++) {
        const float v = l[i] / T;
        if (isnan(l[i])) flags |= PICK_F_NAN;
        else if (v == INFINITY) flags |= PICK_F_POS_INF;
        if (v > -INFINITY) flags |= PICK_F_ABOVE_NEG_INF;
    }
    rec[0] = (int32_t)flags;
    if ((flags & (PICK_F_NAN | PICK_F_POS_INF)) || !(flags & PICK_F_ABOVE_NEG_INF)) return;
    uint32_t prefix = 0, mask = 0;
    int remaining = k;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        int hist[256] = {0};
        for (int i = 0; i < V; i++) {
            const uint32_t key = pick_key(l[i] / T);
            if ((key & mask) == prefix) hist[(key >> shift) & 255u]++;
        }
        int acc = 0, b = 255;
        for (; b > 0; b--) {
            if (acc + hist[b] >= remaining) break;
            acc += hist[b];
        }
        prefix |= (uint32_t)b << shift;
        mask |= 255u << shift;
        remaining -= acc;
    }
    const int need = remaining, n_gt = k - need;
    pick_ref_cand *cand = (pick_ref_cand *)malloc(sizeof(pick_ref_cand) * (size_t)k);
    int gt = 0, eq = 0;
    for (int i = 0; i < V; i++) {
        const uint32_t key = pick_key(l[i] / T);
        const uint64_t c = ((uint64_t)key << 32) | (uint32_t)~(uint32_t)i;
        if (key > prefix) cand[gt++].c = c;
        else if (key == prefix && eq < need) cand[n_gt + eq++].c = c;
    }
    qsort(cand, (size_t)k, sizeof *cand, pick_ref_cmp);
    for (int i = 0; i < k; i++) {
        const int32_t id = (int32_t)~(uint32_t)(cand[i].c & 0xffffffffu);
        ids[i] = id;
        memcpy(&vals[i], &l[id], 4);
    }
    rec[1] = k;
    free(cand);
}

/* A fresh row of V logits: shape 0 distinct normals, 1 coarse (many ties, signed zeros),
 * 2 five levels with signed zeros and -inf, 3 normals with 10% -inf, 4 one value
 * everywhere (+0.0 / -0.0 mixed), 5 huge magnitudes (l / T and l * r overflow). Then,
 * rarely, a NaN, a +inf, or every logit -inf. */
static inline void pick_ref_gen_row(test_rng *r, float *l, int V, int shape) {
    for (int i = 0; i < V; i++) {
        float x = (float)rng_normal(r);
        switch (shape) {
        case 1: x = roundf(x * 2.0f) / 2.0f; break;
        case 2:
            x = (float)rng_int(r, -2, 2);
            if (x == -2.0f) x = -INFINITY;
            break;
        case 3: x = rng_uniform(r) < 0.1 ? -INFINITY : x * 3.0f; break;
        case 4: x = 0.0f; break;
        case 5: x *= 8e37f; break; /* |l| / T overflows for T < ~0.5 */
        default: x *= 2.0f; break;
        }
        if (x == 0.0f && rng_uniform(r) < 0.5) x = -0.0f;
        l[i] = x;
    }
    const double u = rng_uniform(r);
    if (u < 0.03) l[rng_int(r, 0, V - 1)] = NAN;
    else if (u < 0.06) l[rng_int(r, 0, V - 1)] = INFINITY;
    else if (u < 0.08)
        for (int i = 0; i < V; i++) l[i] = -INFINITY;
}

#endif

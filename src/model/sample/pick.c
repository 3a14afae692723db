/*
 * pick.c - tqkv_model_decode_pick: one decode step, then each row's next token.
 * Owns: the state's pick scratch (struct model_pick), the choice of path per row and the
 * host's finish of the rows picked on the device.
 * Must not: sample with anything but sampler.c's code (tqkv_sampler_sample, or the
 * sampler_impl.h functions that finish a row from device candidates), or call up into the
 * engine.
 *
 * Paths. CPU states: the step's logits go to scratch and every row runs the CPU sampler.
 * Device states (pick.h), per row:
 *   - greedy (NULL sampler, or temperature 0): the device applies the penalty and returns
 *     the argmax: one (id, logit) per row;
 *   - temperature > 0 with 0 < top_k < vocab and top_k <= PICK_TOP_K_MAX: the device applies
 *     the penalty and returns the top_k (penalized logit, id) candidates and the row's
 *     finiteness flags; the host finishes (sampler_finish_top_k);
 *   - anything else: the step also copies the full rows back (all rows of the batch, once)
 *     and those rows run tqkv_sampler_sample, as after tqkv_model_decode.
 * Every path gives the token tqkv_sampler_sample gives on the step's logits.
 */
#include <stdlib.h>
#include <string.h>

#include "model/model_impl.h"
#include "model/sample/pick.h"
#include "model/sample/sampler_impl.h"
#include "util/common.h"
#include "util/pool.h"
#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------

struct model_pick {
    float    *logits;  /* [rows, V]: CPU states; device rows that need the full row */
    size_t    cap_logits;
    pick_row *plan;    /* [rows] */
    size_t    cap_plan;
    int32_t  *pen;     /* [n_pen] penalty tokens of every row */
    size_t    cap_pen;
    int32_t  *rec;     /* [rows, PICK_REC_WORDS(stride)] */
    size_t    cap_rec;
};

void model_pick_free(struct model_pick *p) {
    if (!p) return;
    free(p->logits);
    free(p->plan);
    free(p->pen);
    free(p->rec);
    free(p);
}

/* *buf holds at least n elements of `size` bytes (contents dropped); 0 when out of memory. */
static int grow(void **buf, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return 1;
    void *b = malloc((n ? n : 1) * size);
    if (!b) return 0;
    free(*buf);
    *buf = b;
    *cap = n;
    return 1;
}

// ---------------------------------------------------------------------------
// rows
// ---------------------------------------------------------------------------

/* The CPU sampler on a full row l [V] (modified); NULL sampler: greedy with its rule.
 * A failure leaves -1 and the sampler's message. */
static int32_t pick_full_row(tqkv_sampler *smp, float *l, int V) {
    int t = -1;
    const tqkv_status st = smp ? tqkv_sampler_sample(smp, l, &t) : sampler_argmax(l, V, &t);
    return st == TQKV_OK ? t : -1;
}

/* Rows picked on the host, one per item (util/pool.h): each row reads its own logits
 * and draws from its own sampler, so any thread gives the same pick. */
typedef struct {
    tqkv_sampler *const *samplers;
    float *logits; // [R, V]
    int32_t *next; // [R]
    int V;
} pick_host_job;

static void pick_host_row(void *arg, size_t r) {
    const pick_host_job *j = arg;
    j->next[r] = pick_full_row(j->samplers ? j->samplers[r] : NULL, j->logits + r * j->V, j->V);
}

#ifdef TQKV_HAVE_CUDA
/* The host's half of a row picked on the device, from its record. */
static int32_t pick_finish_row(tqkv_sampler *smp, const pick_row *p, const int32_t *rec,
                               int stride, int row) {
    const unsigned flags = (unsigned)rec[0];
    const int n = rec[1];
    const int32_t *ids = rec + 2;
    float vals[PICK_TOP_K_MAX];
    memcpy(vals, rec + 2 + stride, sizeof(float) * (size_t)(n > 0 && n <= stride ? n : 0));
    int t = -1;
    tqkv_status st;
    if (p->mode == PICK_GREEDY) {
        st = sampler_finish_greedy(n == 1 ? ids[0] : -1, n == 1 ? vals[0] : 0.0f, &t);
    } else {
        const int finite = !(flags & (PICK_F_NAN | PICK_F_POS_INF)) && (flags & PICK_F_ABOVE_NEG_INF);
        if (finite && n != p->k)
            st = tqkv_fail(TQKV_EINVAL, "device pick: row %d came back with %d of %d candidates",
                           row, n, p->k);
        else
            st = sampler_finish_top_k(smp, vals, ids, p->k, finite, &t);
    }
    return st == TQKV_OK ? t : -1;
}

/* The device path: plan every row, one step with the pick, finish on the host. */
static tqkv_status pick_device(tqkv_model_state *s, struct model_pick *pk, const int32_t *tokens,
                               tqkv_sampler *const *samplers, int32_t *next) {
    const int R = s->rows, V = s->m->cfg.vocab_size;
    size_t pen_cap = 0;
    int stride = 1, full = 0;
    for (int r = 0; r < R; r++) {
        tqkv_sampler *smp = samplers ? samplers[r] : NULL;
        int k = 1;
        const sampler_pick_kind kind = smp ? sampler_pick_kind_of(smp, PICK_TOP_K_MAX, &k)
                                           : SAMPLER_PICK_GREEDY;
        full |= kind == SAMPLER_PICK_FULL;
        if (kind != SAMPLER_PICK_FULL && smp) pen_cap += (size_t)sampler_penalty_bound(smp);
        while (stride < k) stride <<= 1; /* a power of two: fewer graph keys as k varies */
    }
    if (!grow((void **)&pk->plan, &pk->cap_plan, (size_t)R, sizeof(pick_row)) ||
        !grow((void **)&pk->pen, &pk->cap_pen, pen_cap, sizeof(int32_t)) ||
        !grow((void **)&pk->rec, &pk->cap_rec, (size_t)R * PICK_REC_WORDS(stride), sizeof(int32_t)) ||
        (full && !grow((void **)&pk->logits, &pk->cap_logits, (size_t)R * V, sizeof(float))))
        return tqkv_fail(TQKV_ENOMEM, "decode pick: out of memory");
    int n_pen = 0;
    for (int r = 0; r < R; r++) {
        tqkv_sampler *smp = samplers ? samplers[r] : NULL;
        pick_row *p = &pk->plan[r];
        memset(p, 0, sizeof *p);
        int k = 1;
        const sampler_pick_kind kind = smp ? sampler_pick_kind_of(smp, PICK_TOP_K_MAX, &k)
                                           : SAMPLER_PICK_GREEDY;
        p->mode = kind == SAMPLER_PICK_GREEDY ? PICK_GREEDY : kind == SAMPLER_PICK_TOP_K ? PICK_TOP_K
                                                                                        : PICK_NONE;
        p->k = kind == SAMPLER_PICK_FULL ? 0 : k;
        p->temp = kind == SAMPLER_PICK_TOP_K ? sampler_temperature(smp) : 1.0f;
        p->penalty = 1.0f;
        p->pen_off = n_pen;
        if (smp && kind != SAMPLER_PICK_FULL) { /* a full row's sampler penalizes on the host */
            p->pen_n = sampler_penalty_tokens(smp, pk->pen + n_pen);
            p->penalty = sampler_penalty(smp);
            n_pen += p->pen_n;
        }
    }
    tqkv_status rc = model_cuda_decode_pick(s->gpu, tokens, pk->plan, pk->pen, n_pen, stride,
                                            full ? pk->logits : NULL, pk->rec);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < R; r++) {
        tqkv_sampler *smp = samplers ? samplers[r] : NULL;
        const pick_row *p = &pk->plan[r];
        next[r] = p->mode == PICK_NONE
                      ? pick_full_row(smp, pk->logits + (size_t)r * V, V)
                      : pick_finish_row(smp, p, pk->rec + (size_t)r * PICK_REC_WORDS(stride), stride, r);
    }
    return TQKV_OK;
}
#endif

// ---------------------------------------------------------------------------
// public
// ---------------------------------------------------------------------------

tqkv_status tqkv_model_decode_pick(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                   tqkv_sampler *const *samplers, int32_t *next) {
    if (!m || !s || !tokens || !next || s->m != m)
        return tqkv_fail(TQKV_EINVAL, "decode pick: NULL argument or state of another model");
    const int R = s->rows, V = m->cfg.vocab_size;
    if (R < 1) return tqkv_fail(TQKV_ESTATE, "decode pick: the state has no rows");
    for (int r = 0; samplers && r < R; r++)
        if (samplers[r] && sampler_vocab(samplers[r]) != V)
            return tqkv_fail(TQKV_EINVAL, "decode pick: row %d's sampler has vocab %d, the model %d",
                             r, sampler_vocab(samplers[r]), V);
    if (!s->pick && !(s->pick = calloc(1, sizeof *s->pick)))
        return tqkv_fail(TQKV_ENOMEM, "decode pick: out of memory");
    struct model_pick *pk = s->pick;
#ifdef TQKV_HAVE_CUDA
    if (s->gpu) return pick_device(s, pk, tokens, samplers, next);
#endif
    if (!grow((void **)&pk->logits, &pk->cap_logits, (size_t)R * V, sizeof(float)))
        return tqkv_fail(TQKV_ENOMEM, "decode pick: out of memory");
    tqkv_status rc = tqkv_model_decode(m, s, tokens, pk->logits);
    if (rc != TQKV_OK) return rc;
    int shared = 0; /* constrained samplers may share state: then one thread picks */
    for (int r = 0; samplers && r < R; r++) shared |= samplers[r] && sampler_constrained(samplers[r]);
    pick_host_job j = {samplers, pk->logits, next, V};
    pool_for_each(shared ? 1 : s->p.threads, (size_t)R, 2, pick_host_row, &j);
    /* a refused row's reason went to its thread's error slot: the last one again here */
    for (int r = R - 1; r >= 0; r--)
        if (next[r] < 0) {
            if (samplers && samplers[r]) (void)tqkv_sampler_sample(samplers[r], pk->logits + (size_t)r * V, &(int){0});
            else (void)sampler_argmax(pk->logits + (size_t)r * V, V, &(int){0});
            break;
        }
    return TQKV_OK;
}

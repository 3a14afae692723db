/*
 * engine_spec.c - one generation step over the engine's running batch: a plain batched
 * decode, or a speculative round (draft proposals verified by one target window).
 * Owns: the logits / token scratch sizing for a step, the speculative statistics.
 * Must not: admit, prefill, merge or retire rows (engine.c), or format output
 * (engine_request.c).
 */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_impl.h"
#include "util/common.h"
#include "util/pool.h"

// ---------------------------------------------------------------------------
// Decode steps
// ---------------------------------------------------------------------------

static int ensure_tok(tqkv_engine *e, size_t n) {
    return engine_grow((void **)&e->tokbuf, &e->cap_tok, n, sizeof(int32_t));
}

static int ensure_smp(tqkv_engine *e, size_t n) {
    return engine_grow((void **)&e->smpbuf, &e->cap_smp, n, sizeof(tqkv_sampler *));
}

/* Decode step whose rows need no raw logits: tqkv_model_decode_pick (on a device state the
 * tokens are picked there; the same tokens as req_pick). Finished or cancelled rows pick
 * greedily and are skipped. */
static tqkv_status step_decode_pick(tqkv_engine *e) {
    const int R = e->n_rows;
    if (!ensure_tok(e, 2 * (size_t)R) || !ensure_smp(e, (size_t)R))
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    int32_t *next = e->tokbuf + R;
    for (int i = 0; i < R; i++) {
        eng_req *q = e->rows[i];
        e->tokbuf[i] = q->last;
        e->smpbuf[i] = q->finished || q->cancel ? NULL : q->sampler;
    }
    tqkv_status rc = tqkv_model_decode_pick(e->m, e->run, e->tokbuf, e->smpbuf, next);
    if (rc == TQKV_OK && e->drun) rc = tqkv_model_decode(e->dm, e->drun, e->tokbuf, NULL);
    if (rc != TQKV_OK) return rc;
    for (int i = 0; i < R; i++) {
        eng_req *q = e->rows[i];
        if (q->finished || q->cancel) continue;
        if (next[i] < 0) { /* no pick (tqkv_model_decode_pick); tqkv_last_error() holds only
                            * the last failed row's reason, so say what any of them means */
            req_finish_plain(e, q, TQKV_FINISH_ERROR,
                             "no token could be picked: the row's logits are NaN or +inf, or none is above -inf");
            continue;
        }
        tok_info ti;
        memset(&ti, 0, sizeof ti);
        req_take(e, q, next[i], &ti);
    }
    return TQKV_OK;
}

/* The rows' picks of a raw-logits step, one row per item (util/pool.h): each row has
 * its own sampler and scratch, so the picks are those of a loop in row order. */
typedef struct {
    tqkv_engine *e;
    float *tmp;         // [R, V]
    int V;
} pick_job;

static void pick_row(void *arg, size_t i) {
    const pick_job *j = arg;
    eng_req *q = j->e->rows[i];
    eng_pick *pk = &j->e->picks[i];
    pk->rc = TQKV_OK;
    if (q->finished || q->cancel) return;
    pk->rc = req_pick_with(j->e, q, j->e->logits + i * j->V, j->tmp + i * j->V, &pk->tok, &pk->ti);
}

static int ensure_picks(tqkv_engine *e, size_t n) {
    return engine_grow((void **)&e->picks, &e->cap_picks, n, sizeof(eng_pick));
}

/* Plain decode step over all running rows: decode-and-pick unless a row asked for
 * logprobs (those need the raw logits of every row's step, here the host's). The picks
 * (sampling, log-softmax over the vocabulary) run on the compute threads; the tokens are
 * then taken in row order. */
tqkv_status engine_step_decode(tqkv_engine *e) {
    const int R = e->n_rows, V = tqkv_model_get_config(e->m)->vocab_size;
    int raw = 0;
    for (int i = 0; i < R && !raw; i++)
        raw = !e->rows[i]->finished && !e->rows[i]->cancel && e->rows[i]->top_logprobs >= 0;
    if (!raw) return step_decode_pick(e);
    if (!engine_grow_floats(&e->logits, &e->cap_logits, (size_t)R * V) || !ensure_tok(e, (size_t)R) ||
        !engine_grow_floats(&e->picktmp, &e->cap_picktmp, (size_t)R * V) || !ensure_picks(e, (size_t)R))
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    for (int i = 0; i < R; i++) e->tokbuf[i] = e->rows[i]->last;
    tqkv_status rc = tqkv_model_decode(e->m, e->run, e->tokbuf, e->logits);
    if (rc == TQKV_OK && e->drun) rc = tqkv_model_decode(e->dm, e->drun, e->tokbuf, NULL);
    if (rc != TQKV_OK) return rc;
    /* constrained rows share their schema's mask cache: then one thread picks */
    int shared = 0;
    for (int i = 0; i < R; i++) shared |= e->rows[i]->js != NULL;
    pick_job j = {e, e->picktmp, V};
    pool_for_each(shared ? 1 : e->p.threads, (size_t)R, 2, pick_row, &j);
    for (int i = 0; i < R; i++) {
        eng_req *q = e->rows[i];
        eng_pick *pk = &e->picks[i];
        if (q->finished || q->cancel) continue;
        /* a refused row is picked again here, for its message (this thread's error slot) */
        if (pk->rc != TQKV_OK && req_pick(e, q, e->logits + (size_t)i * V, &pk->tok, &pk->ti) != TQKV_OK) {
            req_finish_plain(e, q, TQKV_FINISH_ERROR, tqkv_last_error());
            continue;
        }
        req_take(e, q, pk->tok, &pk->ti);
    }
    return TQKV_OK;
}

/* Speculative round: the draft proposes K tokens per row (greedy), the target checks
 * all rows in one window of K + 1 whose logits equal single decodes; each row takes its
 * own picks (the same sampler calls as without a draft) while they agree with the draft. */
tqkv_status engine_step_spec(tqkv_engine *e) {
    const int R = e->n_rows, K = e->p.draft_tokens, V = tqkv_model_get_config(e->m)->vocab_size;
    const int W = K + 1;
    if (!engine_grow_floats(&e->logits, &e->cap_logits, (size_t)R * W * V) ||
        !engine_grow_floats(&e->dlogits, &e->cap_dlogits, (size_t)R * V))
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory for logits");
    if (!ensure_tok(e, (size_t)R * (W + 2)))
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    int32_t *win = e->tokbuf;           /* [R, W]: last, d1..dK */
    int32_t *in = e->tokbuf + (size_t)R * W; /* [R] */
    int *keep = (int *)(e->tokbuf + (size_t)R * (W + 1)); /* [R] */
    tqkv_status rc = tqkv_model_state_spec_begin(e->drun);
    if (rc != TQKV_OK) return rc;
    for (int i = 0; i < R; i++) in[i] = win[(size_t)i * W] = e->rows[i]->last;
    for (int j = 0; j < W && rc == TQKV_OK; j++) {
        rc = tqkv_model_decode(e->dm, e->drun, in, j < K ? e->dlogits : NULL);
        if (j == K || rc != TQKV_OK) break;
        for (int i = 0; i < R; i++) {
            const float *l = e->dlogits + (size_t)i * V;
            int b = 0;
            for (int v = 1; v < V; v++)
                if (l[v] > l[b]) b = v;
            in[i] = win[(size_t)i * W + j + 1] = b;
        }
    }
    if (rc == TQKV_OK) rc = tqkv_model_state_spec_begin(e->run);
    if (rc == TQKV_OK) {
        rc = tqkv_model_extend(e->m, e->run, win, W, TQKV_LOGITS_ALL, e->logits);
        if (rc != TQKV_OK) {
            int zero = 0;
            tqkv_model_state_spec_rollback(e->run, &zero, 1);
        }
    }
    if (rc != TQKV_OK) {
        int zero = 0;
        tqkv_model_state_spec_rollback(e->drun, &zero, 1);
        return rc;
    }
    uint64_t acc = 0;
    for (int i = 0; i < R; i++) {
        eng_req *q = e->rows[i];
        int a = 0;
        for (int j = 0; j < W; j++) {
            if (q->finished || q->cancel) break;
            int32_t tok;
            tok_info ti;
            if (req_pick(e, q, e->logits + ((size_t)i * W + j) * V, &tok, &ti) != TQKV_OK) {
                req_finish_plain(e, q, TQKV_FINISH_ERROR, tqkv_last_error());
                break;
            }
            int done = req_take(e, q, tok, &ti);
            if (done || j == K || tok != win[(size_t)i * W + j + 1]) break;
            a++;
        }
        keep[i] = a + 1;
        acc += (uint64_t)a;
    }
    rc = tqkv_model_state_spec_rollback(e->run, keep, R);
    if (rc == TQKV_OK) rc = tqkv_model_state_spec_rollback(e->drun, keep, R);
    pthread_mutex_lock(&e->mu);
    e->st.spec_rounds++;
    e->st.spec_drafted += (uint64_t)R * K;
    e->st.spec_accepted += acc;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

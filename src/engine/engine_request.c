/*
 * engine_request.c - per-request output of the serving engine: latency histograms, events
 * to the request's callback, and the accounting of each generated token (logprobs, text
 * decoding, stop strings, EOS, max_tokens / context limits).
 * Owns: eng_req's output fields (out, released, n_gen, last, finished, ds) and the
 * latency histograms / finish counters of tqkv_engine_stats.
 * Must not: touch the queue, the running batch or model states (engine.c schedules),
 * call the callback with the engine lock held.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_impl.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Latency histograms
// ---------------------------------------------------------------------------

static const double LAT_BUCKETS[TQKV_ENGINE_LAT_BUCKETS] = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0};

const double *tqkv_engine_latency_buckets(void) { return LAT_BUCKETS; }

static void hist_add(tqkv_engine_histogram *h, double v) {
    h->count++;
    h->sum += v;
    for (int i = 0; i < TQKV_ENGINE_LAT_BUCKETS; i++)
        if (v <= LAT_BUCKETS[i]) h->bucket[i]++;
    h->bucket[TQKV_ENGINE_LAT_BUCKETS]++;
}

// ---------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------

static void req_emit(tqkv_engine *e, eng_req *q, int32_t tok, const tok_info *ti, const char *text,
                     size_t n, int done, tqkv_finish_reason fin, const char *err) {
    tqkv_engine_event ev;
    memset(&ev, 0, sizeof ev);
    ev.token = tok;
    ev.text = text ? text : "";
    ev.text_len = text ? n : 0;
    if (ti && q->top_logprobs >= 0) {
        ev.logprob = ti->logprob;
        ev.n_top = ti->n_top;
        ev.top_ids = ti->top_ids;
        ev.top_logprobs = ti->top_lp;
    }
    ev.done = done;
    ev.finish = done ? fin : TQKV_FINISH_NONE;
    ev.error = err;
    ev.prompt_tokens = q->n_prompt;
    ev.completion_tokens = q->n_gen;
    ev.cached_tokens = q->cached;
    ev.index = q->index;
    double now = engine_now();
    if (tok >= 0) {
        pthread_mutex_lock(&e->mu);
        if (q->n_gen == 1) hist_add(&e->st.ttft, now - q->t_submit);
        else hist_add(&e->st.itl, now - q->t_last);
        pthread_mutex_unlock(&e->mu);
        q->t_last = now;
    }
    if (done) {
        q->finished = 1;
        pthread_mutex_lock(&e->mu);
        e->st.requests_finished[fin]++;
        pthread_mutex_unlock(&e->mu);
    }
    q->fn(q->user, q->id, &ev);
}

/* Final event with no token (cancel, error). */
void req_finish_plain(tqkv_engine *e, eng_req *q, tqkv_finish_reason fin, const char *err) {
    if (q->finished) return;
    if (q->n_choices > 1 && !q->forked) { /* the other choices never started: end them too */
        tqkv_engine_event ev;
        memset(&ev, 0, sizeof ev);
        ev.token = -1;
        ev.text = "";
        ev.done = 1;
        ev.finish = fin;
        ev.error = err;
        ev.prompt_tokens = q->n_prompt;
        for (int i = 1; i < q->n_choices; i++) {
            ev.index = i;
            q->fn(q->user, q->id, &ev);
        }
        q->forked = 1;
    }
    req_emit(e, q, -1, NULL, NULL, 0, 1, fin, err);
}

// ---------------------------------------------------------------------------
// Token handling: logprobs, text, stop strings, EOS, max_tokens
// ---------------------------------------------------------------------------

static void logprob_info(const float *raw, int V, int32_t tok, int n_top, tok_info *ti) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (raw[i] > mx) mx = raw[i];
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)raw[i] - mx);
    double lse = (double)mx + log(sum);
    ti->logprob = (float)((double)raw[tok] - lse);
    ti->n_top = n_top;
    /* insertion into a best-first list of n_top (ties: lower id first) */
    int k = 0;
    for (int i = 0; i < V && n_top > 0; i++) {
        float v = raw[i];
        if (k == n_top && !(v > raw[ti->top_ids[k - 1]])) continue;
        int j = k < n_top ? k++ : n_top - 1;
        while (j > 0 && v > raw[ti->top_ids[j - 1]]) {
            ti->top_ids[j] = ti->top_ids[j - 1];
            j--;
        }
        ti->top_ids[j] = i;
    }
    for (int i = 0; i < n_top; i++) ti->top_lp[i] = (float)((double)raw[ti->top_ids[i]] - lse);
}

static int out_append(eng_req *q, const char *s, size_t n) {
    if (q->out_len + n + 1 > q->out_cap) {
        size_t nc = q->out_cap ? q->out_cap * 2 : 256;
        while (nc < q->out_len + n + 1) nc *= 2;
        char *b = realloc(q->out, nc);
        if (!b) return 0;
        q->out = b;
        q->out_cap = nc;
    }
    memcpy(q->out + q->out_len, s, n);
    q->out_len += n;
    q->out[q->out_len] = 0;
    return 1;
}

/* Pick the next token of q from raw logits [V]; scratch [V]. */
tqkv_status req_pick(tqkv_engine *e, eng_req *q, const float *raw, int32_t *tok,
                     tok_info *ti) {
    return req_pick_with(e, q, raw, e->tmp, tok, ti);
}

tqkv_status req_pick_with(const tqkv_engine *e, eng_req *q, const float *raw, float *tmp,
                          int32_t *tok, tok_info *ti) {
    int V = tqkv_model_get_config(e->m)->vocab_size;
    memcpy(tmp, raw, sizeof(float) * (size_t)V);
    int t = 0;
    tqkv_status rc = tqkv_sampler_sample(q->sampler, tmp, &t);
    if (rc != TQKV_OK) return rc;
    *tok = t;
    if (q->top_logprobs >= 0) logprob_info(raw, V, t, q->top_logprobs, ti);
    return TQKV_OK;
}

/* q's text from byte `rel` on (q->out stays NULL until the first byte: no offset on NULL) */
static const char *out_at(const eng_req *q, size_t rel) { return q->out ? q->out + rel : ""; }

/* Account a generated token: text, stop strings, EOS, limits, and its event. Returns 1
 * when the request finished with this token. */
int req_take(tqkv_engine *e, eng_req *q, int32_t tok, const tok_info *ti) {
    q->n_gen++;
    q->last = tok;
    pthread_mutex_lock(&e->mu);
    e->st.generated_tokens++;
    pthread_mutex_unlock(&e->mu);
    if (tqkv_sampler_needs_history(q->sampler)) tqkv_sampler_accept(q->sampler, tok);
    if (q->js) (void)js_accept(q->js, q->jv, &q->jst, tok); /* masked: always accepted */
    if (!q->ignore_eos && tqkv_model_is_eos(e->m, tok)) {
        /* release what was held back for stop matching */
        const char *fl = NULL;
        size_t fn = 0;
        tqkv_decode_stream_flush(q->ds, &fl, &fn);
        if (fn) out_append(q, fl, fn);
        size_t rel = q->released;
        q->released = q->out_len;
        req_emit(e, q, tok, ti, out_at(q, rel), q->out_len - rel, 1, TQKV_FINISH_STOP, NULL);
        return 1;
    }
    const char *piece = NULL;
    size_t pn = 0;
    if (tqkv_decode_stream_push(q->ds, tok, &piece, &pn) != TQKV_OK) pn = 0;
    if (pn && !out_append(q, piece, pn)) {
        req_finish_plain(e, q, TQKV_FINISH_ERROR, "out of memory");
        return 1;
    }
    /* a constrained document that just closed ends the request (as EOS would next) */
    const int json_done = q->js && js_complete(&q->jst);
    int at_limit = q->n_gen >= q->max_tokens || q->n_prompt + q->n_gen >= e->ctx || json_done;
    if (at_limit) {
        const char *fl = NULL;
        size_t fn = 0;
        tqkv_decode_stream_flush(q->ds, &fl, &fn);
        if (fn) out_append(q, fl, fn);
    }
    /* earliest stop string that starts at or after the released text */
    size_t cut = (size_t)-1;
    for (int i = 0; i < q->n_stop; i++) {
        size_t sl = strlen(q->stop[i]);
        size_t from = q->released;
        for (size_t p = from; p + sl <= q->out_len && p < cut; p++)
            if (!memcmp(q->out + p, q->stop[i], sl)) {
                cut = p;
                break;
            }
    }
    if (cut != (size_t)-1) {
        size_t rel = q->released;
        q->released = cut;
        req_emit(e, q, tok, ti, out_at(q, rel), cut - rel, 1, TQKV_FINISH_STOP, NULL);
        return 1;
    }
    if (at_limit) {
        size_t rel = q->released;
        q->released = q->out_len;
        req_emit(e, q, tok, ti, out_at(q, rel), q->out_len - rel, 1,
                 json_done ? TQKV_FINISH_STOP : TQKV_FINISH_LENGTH, NULL);
        return 1;
    }
    /* release everything except a tail that could start a stop string */
    size_t safe = q->out_len;
    for (int i = 0; i < q->n_stop; i++) {
        size_t sl = strlen(q->stop[i]);
        for (size_t k = sl - 1; k >= 1; k--) {
            if (k > q->out_len - q->released) continue;
            if (!memcmp(q->out + q->out_len - k, q->stop[i], k)) {
                if (q->out_len - k < safe) safe = q->out_len - k;
                break;
            }
        }
    }
    size_t rel = q->released;
    q->released = safe;
    req_emit(e, q, tok, ti, out_at(q, rel), safe - rel, 0, TQKV_FINISH_NONE, NULL);
    return 0;
}

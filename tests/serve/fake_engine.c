/*
 * fake_engine.c - the HTTP tests' engine double (see fake_engine.h).
 * Owns: a request list and one generator thread. Must not: be linked into tqkv.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fake_engine.h"

typedef struct freq {
    struct freq *next;
    uint64_t     id;
    int32_t     *prompt;   /* [n_prompt] */
    int          n_prompt, max_tokens, n_gen, top;
    char        *stop[SRV_MAX_STOP];
    int          n_stop;
    char        *out;      /* generated text so far [out_len] */
    size_t       out_len, released;
    int          cancel;
    int          index;    /* choice */
    tqkv_engine_event_fn fn;
    void        *user;
} freq;

struct fake_engine {
    fake_params           p;
    const tqkv_tokenizer *tok;
    pthread_mutex_t       mu;
    pthread_cond_t        cv;
    pthread_t             th;
    int                   quit, open, cancelled;
    uint64_t              next_id, gen_tokens, prompt_tokens, finished[TQKV_FINISH_ERROR + 1];
    freq                 *head;
    int32_t              *script;  /* [n_script] the forced output's tokens */
    size_t                n_script;
};

int32_t fake_engine_token(const int32_t *prompt, int n_prompt, int i, int32_t vocab) {
    uint64_t h = 1469598103934665603ull;
    for (int k = 0; k < n_prompt; k++) h = (h ^ (uint32_t)prompt[k]) * 1099511628211ull;
    h = (h ^ (uint64_t)i) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    /* ids 100..vocab-1: avoid special tokens at the bottom of the vocab */
    return (int32_t)(100 + h % (uint64_t)(vocab - 200));
}

static void freq_free(freq *r) {
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->out);
    free(r);
}

/* One token for r; returns 1 when r finished (final event sent). Called unlocked. */
static int step_one(fake_engine *f, freq *r, int cancel) {
    tqkv_engine_event ev;
    memset(&ev, 0, sizeof ev);
    ev.prompt_tokens = r->n_prompt;
    if (cancel || (f->p.fail_after > 0 && r->n_gen >= f->p.fail_after)) {
        ev.token = -1;
        ev.text = "";
        ev.done = 1;
        ev.finish = cancel ? TQKV_FINISH_CANCELLED : TQKV_FINISH_ERROR;
        ev.error = cancel ? NULL : FAKE_FAIL_MESSAGE;
        ev.completion_tokens = r->n_gen;
        r->fn(r->user, r->id, &ev);
        return 1;
    }
    int32_t vocab = tqkv_tokenizer_vocab_size(f->tok);
    int32_t t = f->script ? f->script[r->n_gen]
                          : fake_engine_token(r->prompt, r->n_prompt, r->n_gen + 7919 * r->index, vocab);
    const char *b = "";
    size_t n = 0;
    tqkv_tokenizer_id_bytes(f->tok, t, &b, &n);
    char *no = realloc(r->out, r->out_len + n + 1);
    if (!no) abort();
    r->out = no;
    /* ASCII only (non-ASCII bytes -> '?'), so every event's text is complete UTF-8 */
    for (size_t k = 0; k < n; k++)
        r->out[r->out_len + k] = (unsigned char)b[k] < 0x80 && b[k] ? b[k] : '?';
    r->out_len += n;
    r->out[r->out_len] = 0;
    r->n_gen++;
    /* stop strings: cut the output before the first match */
    int stopped = 0;
    size_t keep = r->out_len;
    for (int i = 0; i < r->n_stop; i++) {
        char *hit = strstr(r->out, r->stop[i]);
        if (hit && (size_t)(hit - r->out) < keep) keep = (size_t)(hit - r->out), stopped = 1;
    }
    /* hold back a suffix that could start a stop string */
    size_t rel = keep;
    if (!stopped)
        for (int i = 0; i < r->n_stop; i++) {
            size_t sl = strlen(r->stop[i]);
            for (size_t k = sl - 1; k > 0; k--)
                if (k <= keep && !memcmp(r->out + keep - k, r->stop[i], k)) {
                    if (keep - k < rel) rel = keep - k;
                    break;
                }
        }
    if (f->script && (size_t)r->n_gen >= f->n_script) stopped = 1; /* the script's end: as EOS */
    int done = stopped || r->n_gen >= r->max_tokens;
    if (done) rel = keep;
    if (rel < r->released) rel = r->released;
    int32_t top_ids[TQKV_MAX_TOP_LOGPROBS];
    float top_lp[TQKV_MAX_TOP_LOGPROBS];
    int nt = r->top > 0 ? r->top : 0;
    for (int k = 0; k < nt; k++) {
        top_ids[k] = k == 0 ? t : fake_engine_token(r->prompt, r->n_prompt, r->n_gen + 1000 * k, vocab);
        top_lp[k] = -0.25f * (float)(k + 1);
    }
    ev.token = t;
    ev.index = r->index;
    ev.text = r->out + r->released;
    ev.text_len = rel - r->released;
    r->released = rel;
    ev.logprob = -0.25f;
    ev.n_top = nt;
    ev.top_ids = top_ids;
    ev.top_logprobs = top_lp;
    ev.done = done;
    ev.finish = done ? (stopped ? TQKV_FINISH_STOP : TQKV_FINISH_LENGTH) : TQKV_FINISH_NONE;
    ev.completion_tokens = r->n_gen;
    r->fn(r->user, r->id, &ev);
    return done;
}

static void *run(void *arg) {
    fake_engine *f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->quit && !f->head) pthread_cond_wait(&f->cv, &f->mu);
        if (f->quit && !f->head) break;
        /* one token for every open request, round robin */
        freq **pp = &f->head;
        while (*pp) {
            freq *r = *pp;
            int cancel = r->cancel || f->quit;
            pthread_mutex_unlock(&f->mu);
            if (!cancel && r->n_gen == 0 && f->p.first_us) usleep((useconds_t)f->p.first_us);
            int done = step_one(f, r, cancel);
            pthread_mutex_lock(&f->mu);
            if (done) {
                *pp = r->next;
                f->open--;
                f->gen_tokens += (uint64_t)r->n_gen;
                f->finished[cancel ? TQKV_FINISH_CANCELLED : TQKV_FINISH_STOP]++;
                if (cancel) f->cancelled++;
                freq_free(r);
            } else {
                pp = &r->next;
            }
        }
        if (f->p.step_us) {
            pthread_mutex_unlock(&f->mu);
            usleep((useconds_t)f->p.step_us);
            pthread_mutex_lock(&f->mu);
        }
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static tqkv_status f_submit(void *ctx, const tqkv_engine_request *q, uint64_t *id) {
    fake_engine *f = ctx;
    if (!q || !q->prompt || q->n_prompt < 1 || q->max_tokens < 1 || !q->on_event || q->n_stop > SRV_MAX_STOP)
        return TQKV_EINVAL;
    if (q->n_prompt + q->max_tokens > f->p.context_len) return TQKV_ERANGE;
    const int n = q->n > 1 ? q->n : 1;
    freq *rs[16];
    if (n > 16) return TQKV_EINVAL;
    for (int c = 0; c < n; c++) {
    freq *r = rs[c] = calloc(1, sizeof *r);
    if (!r || !(r->prompt = malloc(sizeof(int32_t) * (size_t)q->n_prompt))) abort();
    memcpy(r->prompt, q->prompt, sizeof(int32_t) * (size_t)q->n_prompt);
    r->n_prompt = q->n_prompt;
    r->max_tokens = q->max_tokens;
    r->top = q->top_logprobs;
    for (int i = 0; i < q->n_stop; i++) r->stop[i] = strdup(q->stop[i]);
    r->n_stop = q->n_stop;
    r->fn = q->on_event;
    r->user = q->user;
    r->index = c;
    }
    pthread_mutex_lock(&f->mu);
    if (f->open >= f->p.queue_max) {
        pthread_mutex_unlock(&f->mu);
        for (int c = 0; c < n; c++) freq_free(rs[c]);
        return TQKV_EBUSY;
    }
    *id = ++f->next_id;
    f->prompt_tokens += (uint64_t)q->n_prompt;
    for (int c = 0; c < n; c++) {
        rs[c]->id = *id;
        /* append at the tail */
        freq **pp = &f->head;
        while (*pp) pp = &(*pp)->next;
        *pp = rs[c];
        f->open++;
    }
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return TQKV_OK;
}

static tqkv_status f_cancel(void *ctx, uint64_t id) {
    fake_engine *f = ctx;
    pthread_mutex_lock(&f->mu);
    tqkv_status st = TQKV_EINVAL;
    for (freq *r = f->head; r; r = r->next)
        if (r->id == id) r->cancel = 1, st = TQKV_OK;
    pthread_mutex_unlock(&f->mu);
    return st;
}

static const double BUCKETS[TQKV_ENGINE_LAT_BUCKETS] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                        0.5, 1, 2.5, 5, 10, 30};

static tqkv_status f_stats(void *ctx, tqkv_engine_stats *o) {
    fake_engine *f = ctx;
    memset(o, 0, sizeof *o);
    pthread_mutex_lock(&f->mu);
    o->generated_tokens = f->gen_tokens;
    o->prompt_tokens = f->prompt_tokens;
    o->running = f->open;
    memcpy(o->requests_finished, f->finished, sizeof o->requests_finished);
    pthread_mutex_unlock(&f->mu);
    return TQKV_OK;
}

int fake_engine_init(fake_engine **out, const fake_params *p, const tqkv_tokenizer *tok) {
    fake_engine *f = calloc(1, sizeof *f);
    if (!f) return -1;
    f->p = *p;
    f->tok = tok;
    if (p->script) {
        if (tqkv_tokenizer_encode(tok, p->script, strlen(p->script), 0, &f->script, &f->n_script) != TQKV_OK ||
            f->n_script == 0) {
            free(f);
            return -1;
        }
    }
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (pthread_create(&f->th, NULL, run, f)) {
        free(f);
        return -1;
    }
    *out = f;
    return 0;
}

void fake_engine_free(fake_engine *f) {
    if (!f) return;
    pthread_mutex_lock(&f->mu);
    f->quit = 1;
    pthread_cond_signal(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->th, NULL);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f->script);
    free(f);
}

srv_engine fake_engine_bind(fake_engine *f) {
    srv_engine e = {f, f_submit, f_cancel, f_stats, BUCKETS, f->tok, "fake-model", f->p.context_len};
    return e;
}

int fake_engine_cancelled(fake_engine *f) {
    pthread_mutex_lock(&f->mu);
    int n = f->cancelled;
    pthread_mutex_unlock(&f->mu);
    return n;
}

int fake_engine_open(fake_engine *f) {
    pthread_mutex_lock(&f->mu);
    int n = f->open;
    pthread_mutex_unlock(&f->mu);
    return n;
}

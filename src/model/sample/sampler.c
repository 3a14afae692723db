/*
 * sampler.c - token sampling: repetition penalty, OpenAI frequency / presence penalties,
 * logit_bias, greedy, temperature, top-k, top-p, min-p.
 * Owns: the sampler's history and its RNG (xoshiro256**, seeded per sampler); the internals
 * of sampler_impl.h (a row finished from candidates selected elsewhere, through the same
 * code as tqkv_sampler_sample).
 * Must not: keep global state or depend on anything but its logits, history and seed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/sample/sampler_impl.h"
#include "tqkv_model.h"
#include "util/common.h"

struct tqkv_sampler {
    tqkv_sampler_params p;
    int       vocab;
    uint64_t  rng[4];
    int32_t  *hist;       /* [cap] accepted tokens */
    int       n_hist, cap;
    int       gen0;       /* history entries [gen0, n_hist) are generated (OpenAI penalties) */
    uint32_t *count;      /* [vocab] scratch counts for the OpenAI penalties, or NULL */
    int32_t  *bias_ids;   /* [n_bias] logit_bias (own copy) */
    float    *bias_vals;
    uint8_t  *seen;       /* [vocab] scratch for the penalty */
    int32_t  *idx;        /* [vocab] candidate ids */
    float    *prob;       /* [vocab] */
};

// ---------------------------------------------------------------------------
// RNG
// ---------------------------------------------------------------------------

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro(uint64_t *s) {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

static double uniform01(uint64_t *s) { return (double)(xoshiro(s) >> 11) * (1.0 / 9007199254740992.0); }

// ---------------------------------------------------------------------------
// lifecycle
// ---------------------------------------------------------------------------

tqkv_sampler_params tqkv_sampler_params_default(void) {
    tqkv_sampler_params p;
    memset(&p, 0, sizeof p);
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    return p;
}

void tqkv_sampler_reset(tqkv_sampler *s, uint64_t seed) {
    if (!s) return;
    uint64_t z = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix(&z);
    s->n_hist = 0;
    s->gen0 = 0;
    s->p.seed = seed;
}

tqkv_status tqkv_sampler_init(tqkv_sampler **out, const tqkv_sampler_params *p, int vocab) {
    if (!out || !p) return tqkv_fail(TQKV_EINVAL, "sampler: NULL argument");
    if (vocab < 1) return tqkv_fail(TQKV_EINVAL, "sampler: vocab %d", vocab);
    if (!(p->temperature >= 0 && isfinite(p->temperature)) || p->top_k < 0 ||
        !(p->top_p > 0 && p->top_p <= 1) || !(p->min_p >= 0 && p->min_p <= 1) ||
        !(p->repetition_penalty > 0 && isfinite(p->repetition_penalty)) || p->penalty_last_n < 0 ||
        !isfinite(p->frequency_penalty) || !isfinite(p->presence_penalty))
        return tqkv_fail(TQKV_EINVAL,
                         "sampler: need finite temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                         "0 <= min_p <= 1, finite repetition_penalty > 0, finite frequency and "
                         "presence penalties");
    if (p->n_bias < 0 || (p->n_bias > 0 && (!p->bias_ids || !p->bias_vals)))
        return tqkv_fail(TQKV_EINVAL, "sampler: n_bias %d without ids and values", p->n_bias);
    for (int i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0 || p->bias_ids[i] >= vocab || !isfinite(p->bias_vals[i]))
            return tqkv_fail(TQKV_EINVAL, "sampler: logit_bias entry %d (token %d, bias %g) is "
                             "outside the vocab %d or not finite", i, p->bias_ids[i],
                             (double)p->bias_vals[i], vocab);
        for (int j = 0; j < i; j++)
            if (p->bias_ids[j] == p->bias_ids[i])
                return tqkv_fail(TQKV_EINVAL, "sampler: logit_bias has token %d twice", p->bias_ids[i]);
    }
    tqkv_sampler *s = tqkv_calloc(1, sizeof *s);
    if (!s) return TQKV_ENOMEM;
    s->p = *p;
    s->vocab = vocab;
    s->cap = 256;
    s->hist = malloc(sizeof(int32_t) * (size_t)s->cap);
    s->seen = calloc((size_t)vocab, 1);
    s->idx = malloc(sizeof(int32_t) * (size_t)vocab);
    s->prob = malloc(sizeof(float) * (size_t)vocab);
    int openai = p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
    if (openai) s->count = calloc((size_t)vocab, sizeof(uint32_t));
    if (p->n_bias) {
        s->bias_ids = malloc(sizeof(int32_t) * (size_t)p->n_bias);
        s->bias_vals = malloc(sizeof(float) * (size_t)p->n_bias);
        if (s->bias_ids && s->bias_vals) {
            memcpy(s->bias_ids, p->bias_ids, sizeof(int32_t) * (size_t)p->n_bias);
            memcpy(s->bias_vals, p->bias_vals, sizeof(float) * (size_t)p->n_bias);
        }
    }
    s->p.bias_ids = s->bias_ids;
    s->p.bias_vals = s->bias_vals;
    if (!s->hist || !s->seen || !s->idx || !s->prob || (openai && !s->count) ||
        (p->n_bias && (!s->bias_ids || !s->bias_vals))) {
        tqkv_sampler_free(s);
        return tqkv_fail(TQKV_ENOMEM, "sampler: out of memory");
    }
    tqkv_sampler_reset(s, p->seed);
    *out = s;
    return TQKV_OK;
}

void tqkv_sampler_free(tqkv_sampler *s) {
    if (!s) return;
    free(s->hist);
    free(s->seen);
    free(s->idx);
    free(s->prob);
    free(s->count);
    free(s->bias_ids);
    free(s->bias_vals);
    free(s);
}

void tqkv_sampler_mark_prompt_end(tqkv_sampler *s) {
    if (s) s->gen0 = s->n_hist;
}

int tqkv_sampler_needs_history(const tqkv_sampler *s) {
    return s && (s->p.repetition_penalty != 1.0f || s->count != NULL);
}

tqkv_status tqkv_sampler_accept(tqkv_sampler *s, int token) {
    if (!s) return tqkv_fail(TQKV_EINVAL, "sampler: NULL");
    if (token < 0 || token >= s->vocab)
        return tqkv_fail(TQKV_ERANGE, "sampler: token %d outside vocab %d", token, s->vocab);
    if (s->n_hist == s->cap) {
        int32_t *h = realloc(s->hist, sizeof(int32_t) * (size_t)s->cap * 2);
        if (!h) return tqkv_fail(TQKV_ENOMEM, "sampler: out of memory");
        s->hist = h;
        s->cap *= 2;
    }
    s->hist[s->n_hist++] = token;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// sampling
// ---------------------------------------------------------------------------

/* Descending by value, ascending id on ties (a total order, so results are reproducible). */
static int before(const float *v, int32_t i, int32_t j) { /* i sorts before j */
    return v[i] > v[j] || (v[i] == v[j] && i < j);
}

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *v = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    return before(v, i, j) ? -1 : before(v, j, i) ? 1 : 0;
}

/* The k best ids of v [n] into idx [k], sorted (heap of the k best, worst on top). */
static void top_k_ids(const float *v, int n, int k, int32_t *idx) {
    int h = 0;
    for (int32_t i = 0; i < n; i++) {
        if (h == k && !before(v, i, idx[0])) continue;
        int pos;
        if (h < k) {
            pos = h++;
            while (pos > 0) { /* sift up: parent must be worse (sort after) than child */
                int par = (pos - 1) / 2;
                if (!before(v, idx[par], i)) break;
                idx[pos] = idx[par];
                pos = par;
            }
            idx[pos] = i;
            continue;
        }
        pos = 0; /* replace the worst, sift down */
        for (;;) {
            int c = 2 * pos + 1;
            if (c >= h) break;
            if (c + 1 < h && before(v, idx[c], idx[c + 1])) c++;
            if (!before(v, i, idx[c])) break;
            idx[pos] = idx[c];
            pos = c;
        }
        idx[pos] = i;
    }
    qsort_r(idx, (size_t)h, sizeof(int32_t), cmp_desc, (void *)v);
}

/* The penalty window: history entries [h0, n_hist). */
static int penalty_start(const tqkv_sampler *s) {
    const int n = s->p.penalty_last_n;
    return n > 0 && s->n_hist > n ? s->n_hist - n : 0;
}

static tqkv_status fail_greedy(void) {
    return tqkv_fail(TQKV_EINVAL, "sampler: no logit above -inf (all NaN or -inf; greedy)");
}

static tqkv_status fail_not_finite(const tqkv_sampler *s) {
    return tqkv_fail(TQKV_EINVAL, "sampler: logits are not finite (NaN/inf, or overflow "
                     "at temperature %g)", (double)s->p.temperature);
}

tqkv_status sampler_argmax(const float *l, int V, int *token) {
    /* argmax over the logits that are numbers (a NaN is never picked, wherever it sits);
     * with none above -inf there is no answer: refuse, as the sampled path does */
    int best = -1;
    for (int i = 0; i < V; i++)
        if (!isnan(l[i]) && (best < 0 || l[i] > l[best])) best = i;
    if (best < 0 || l[best] == -INFINITY) return fail_greedy();
    *token = best;
    return TQKV_OK;
}

/* top-p, min-p and the draw over the sorted candidates s->idx [n] with their unnormalized
 * probabilities in s->prob (indexed by id); one RNG draw. */
static void draw_candidates(tqkv_sampler *s, int n, int *token) {
    const tqkv_sampler_params *p = &s->p;
    /* top-p on the sorted candidates, renormalized */
    if (p->top_p < 1.0f) {
        double tot = 0, c = 0;
        for (int i = 0; i < n; i++) tot += s->prob[s->idx[i]];
        for (int i = 0; i < n; i++) {
            c += s->prob[s->idx[i]];
            if (c >= p->top_p * tot) {
                n = i + 1;
                break;
            }
        }
    }
    /* min-p relative to the best candidate */
    if (p->min_p > 0) {
        float top = s->prob[s->idx[0]];
        int keep = 1;
        while (keep < n && s->prob[s->idx[keep]] >= p->min_p * top) keep++;
        n = keep;
    }
    double tot = 0;
    for (int i = 0; i < n; i++) tot += s->prob[s->idx[i]];
    double u = uniform01(s->rng) * tot, c = 0;
    int pick = s->idx[n - 1];
    for (int i = 0; i < n; i++) {
        c += s->prob[s->idx[i]];
        if (u < c) {
            pick = s->idx[i];
            break;
        }
    }
    *token = pick;
}

/* OpenAI's penalties over the generated history, then logit_bias (after the repetition
 * penalty): l -= frequency_penalty * c + presence_penalty * (c > 0), l += bias. */
static void sampler_apply_openai(tqkv_sampler *s, float *logits) {
    if (s->count && s->n_hist > s->gen0) {
        const float f = s->p.frequency_penalty, pr = s->p.presence_penalty;
        for (int i = s->gen0; i < s->n_hist; i++) s->count[s->hist[i]]++;
        for (int i = s->gen0; i < s->n_hist; i++) {
            const int t = s->hist[i];
            if (!s->count[t]) continue;
            logits[t] -= f * (float)s->count[t] + pr;
            s->count[t] = 0;
        }
    }
    for (int i = 0; i < s->p.n_bias; i++) logits[s->bias_ids[i]] += s->bias_vals[i];
    if (s->p.constrain) s->p.constrain(s->p.constrain_ctx, logits, s->vocab);
}

tqkv_status tqkv_sampler_sample(tqkv_sampler *s, float *logits, int *token) {
    if (!s || !logits || !token) return tqkv_fail(TQKV_EINVAL, "sampler: NULL argument");
    int V = s->vocab;
    const tqkv_sampler_params *p = &s->p;
    /* repetition penalty (HF: each distinct previous token once) */
    if (p->repetition_penalty != 1.0f && s->n_hist > 0) {
        int h0 = penalty_start(s);
        for (int i = h0; i < s->n_hist; i++) {
            int t = s->hist[i];
            if (s->seen[t]) continue;
            s->seen[t] = 1;
            logits[t] = logits[t] > 0 ? logits[t] / p->repetition_penalty
                                      : logits[t] * p->repetition_penalty;
        }
        for (int i = h0; i < s->n_hist; i++) s->seen[s->hist[i]] = 0;
    }
    sampler_apply_openai(s, logits);
    if (p->temperature == 0.0f) return sampler_argmax(logits, V, token);
    /* temperature; unnormalized probabilities prob = exp(l - max) (max -> 1) */
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) {
        logits[i] /= p->temperature;
        if (logits[i] > mx) mx = logits[i];
    }
    double sum = 0;
    for (int i = 0; i < V; i++) {
        s->prob[i] = (float)exp((double)(logits[i] - mx));
        sum += s->prob[i];
    }
    /* a NaN or +inf logit (or an overflow of l / T) makes every probability NaN, and then no
     * candidate would survive the filters below: refuse instead of reading idx[-1]. The
     * sum is not finite exactly when a logit is NaN, one l / T is +inf, or every l / T is
     * -inf (mx stays -inf): sampler_finish_top_k's `finite` flag. */
    if (!isfinite(sum)) return fail_not_finite(s);
    int n = 0;
    if (p->top_k > 0 && p->top_k < V) {
        top_k_ids(logits, V, p->top_k, s->idx);
        n = p->top_k;
    } else if (p->top_p < 1.0f || p->min_p > 0) {
        /* below (1 - top_p) / V of the mass a token can never enter the nucleus, and below
         * min_p (of the max, which is 1) min-p drops it: skip those before sorting */
        double cut = p->top_p < 1.0f ? (1.0 - p->top_p) / V * sum : 0;
        if (p->min_p > cut) cut = p->min_p;
        for (int i = 0; i < V; i++)
            if (s->prob[i] >= cut) s->idx[n++] = i;
        qsort_r(s->idx, (size_t)n, sizeof(int32_t), cmp_desc, logits);
    } else {
        for (int i = 0; i < V; i++) s->idx[n++] = i; /* plain temperature: no order needed */
    }
    draw_candidates(s, n, token);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// internals for decode-and-pick (sampler_impl.h)
// ---------------------------------------------------------------------------

sampler_pick_kind sampler_pick_kind_of(const tqkv_sampler *s, int k_limit, int *k) {
    sampler_pick_kind kind = SAMPLER_PICK_FULL;
    int kk = 0;
    if (s->count || s->p.n_bias || s->p.constrain) {
        /* OpenAI penalties and logit_bias are applied on the host only: the whole row */
    } else if (s->p.temperature == 0.0f) {
        kind = SAMPLER_PICK_GREEDY;
        kk = 1;
    } else if (s->p.top_k > 0 && s->p.top_k < s->vocab && s->p.top_k <= k_limit) {
        kind = SAMPLER_PICK_TOP_K;
        kk = s->p.top_k;
    }
    if (k) *k = kk;
    return kind;
}

int sampler_vocab(const tqkv_sampler *s) { return s->vocab; }
int sampler_constrained(const tqkv_sampler *s) { return s->p.constrain != NULL; }
float sampler_temperature(const tqkv_sampler *s) { return s->p.temperature; }

float sampler_penalty(const tqkv_sampler *s) {
    return s->n_hist > 0 ? s->p.repetition_penalty : 1.0f;
}

int sampler_penalty_bound(const tqkv_sampler *s) {
    if (sampler_penalty(s) == 1.0f) return 0;
    const int n = s->n_hist - penalty_start(s);
    return n < s->vocab ? n : s->vocab;
}

int sampler_penalty_tokens(tqkv_sampler *s, int32_t *out) {
    if (sampler_penalty(s) == 1.0f) return 0;
    const int h0 = penalty_start(s);
    int n = 0;
    for (int i = h0; i < s->n_hist; i++) {
        const int t = s->hist[i];
        if (s->seen[t]) continue;
        s->seen[t] = 1;
        out[n++] = t;
    }
    for (int i = 0; i < n; i++) s->seen[out[i]] = 0;
    return n;
}

tqkv_status sampler_finish_greedy(int32_t id, float val, int *token) {
    if (id < 0 || val == -INFINITY) return fail_greedy();
    *token = id;
    return TQKV_OK;
}

tqkv_status sampler_finish_top_k(tqkv_sampler *s, const float *val, const int32_t *id, int n,
                                 int finite, int *token) {
    if (!s || !val || !id || !token) return tqkv_fail(TQKV_EINVAL, "sampler: NULL argument");
    int k = 0;
    if (sampler_pick_kind_of(s, s->vocab, &k) != SAMPLER_PICK_TOP_K || n != k)
        return tqkv_fail(TQKV_EINVAL, "sampler: %d candidates for a sampler that is not top-k "
                         "%d with temperature > 0", n, s->p.top_k);
    if (!finite) return fail_not_finite(s);
    /* ids in range and distinct (s->seen as the marks, cleared again) */
    int bad = 0, i = 0;
    for (; i < n && !bad; i++) {
        bad = id[i] < 0 || id[i] >= s->vocab || s->seen[id[i]];
        if (!bad) s->seen[id[i]] = 1;
    }
    for (int j = 0; j < i - bad; j++) s->seen[id[j]] = 0;
    if (bad) return tqkv_fail(TQKV_EINVAL, "sampler: candidate id out of range or repeated");
    /* temperature as tqkv_sampler_sample divides, then its order: prob [V] holds l / T at
     * each candidate's id for cmp_desc, then exp(l / T - mx) in place */
    for (int j = 0; j < n; j++) {
        s->idx[j] = id[j];
        s->prob[id[j]] = val[j] / s->p.temperature;
    }
    qsort_r(s->idx, (size_t)n, sizeof(int32_t), cmp_desc, s->prob);
    /* with every logit finite the best candidate holds the vocab's max (mx) */
    const float mx = s->prob[s->idx[0]];
    for (int j = 0; j < n; j++) {
        const int32_t t = s->idx[j];
        s->prob[t] = (float)exp((double)(s->prob[t] - mx));
    }
    draw_candidates(s, n, token);
    return TQKV_OK;
}

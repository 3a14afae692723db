/*
 * sampler.c - token sampling: repetition penalty, greedy, temperature, top-k, top-p, min-p.
 * Owns: the sampler's history and its RNG (xoshiro256**, seeded per sampler).
 * Must not: keep global state or depend on anything but its logits, history and seed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tqkv_model.h"
#include "util/common.h"

struct tqkv_sampler {
    tqkv_sampler_params p;
    int       vocab;
    uint64_t  rng[4];
    int32_t  *hist;       /* [cap] accepted tokens */
    int       n_hist, cap;
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
    tqkv_sampler_params p = {0.0f, 0, 1.0f, 0.0f, 1.0f, 0, 0};
    return p;
}

void tqkv_sampler_reset(tqkv_sampler *s, uint64_t seed) {
    if (!s) return;
    uint64_t z = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix(&z);
    s->n_hist = 0;
    s->p.seed = seed;
}

tqkv_status tqkv_sampler_init(tqkv_sampler **out, const tqkv_sampler_params *p, int vocab) {
    if (!out || !p) return tqkv_fail(TQKV_EINVAL, "sampler: NULL argument");
    if (vocab < 1) return tqkv_fail(TQKV_EINVAL, "sampler: vocab %d", vocab);
    if (!(p->temperature >= 0 && isfinite(p->temperature)) || p->top_k < 0 ||
        !(p->top_p > 0 && p->top_p <= 1) || !(p->min_p >= 0 && p->min_p <= 1) ||
        !(p->repetition_penalty > 0 && isfinite(p->repetition_penalty)) || p->penalty_last_n < 0)
        return tqkv_fail(TQKV_EINVAL,
                         "sampler: need finite temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                         "0 <= min_p <= 1, finite repetition_penalty > 0");
    tqkv_sampler *s = tqkv_calloc(1, sizeof *s);
    if (!s) return TQKV_ENOMEM;
    s->p = *p;
    s->vocab = vocab;
    s->cap = 256;
    s->hist = malloc(sizeof(int32_t) * (size_t)s->cap);
    s->seen = calloc((size_t)vocab, 1);
    s->idx = malloc(sizeof(int32_t) * (size_t)vocab);
    s->prob = malloc(sizeof(float) * (size_t)vocab);
    if (!s->hist || !s->seen || !s->idx || !s->prob) {
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
    free(s);
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

tqkv_status tqkv_sampler_sample(tqkv_sampler *s, float *logits, int *token) {
    if (!s || !logits || !token) return tqkv_fail(TQKV_EINVAL, "sampler: NULL argument");
    int V = s->vocab;
    const tqkv_sampler_params *p = &s->p;
    /* repetition penalty (HF: each distinct previous token once) */
    if (p->repetition_penalty != 1.0f && s->n_hist > 0) {
        int h0 = p->penalty_last_n > 0 && s->n_hist > p->penalty_last_n ? s->n_hist - p->penalty_last_n : 0;
        for (int i = h0; i < s->n_hist; i++) {
            int t = s->hist[i];
            if (s->seen[t]) continue;
            s->seen[t] = 1;
            logits[t] = logits[t] > 0 ? logits[t] / p->repetition_penalty
                                      : logits[t] * p->repetition_penalty;
        }
        for (int i = h0; i < s->n_hist; i++) s->seen[s->hist[i]] = 0;
    }
    if (p->temperature == 0.0f) {
        /* argmax over the logits that are numbers (a NaN is never picked, wherever it
         * sits); with none above -inf there is no answer: refuse, as the sampled path does */
        int best = -1;
        for (int i = 0; i < V; i++)
            if (!isnan(logits[i]) && (best < 0 || logits[i] > logits[best])) best = i;
        if (best < 0 || logits[best] == -INFINITY)
            return tqkv_fail(TQKV_EINVAL, "sampler: no logit above -inf (all NaN or -inf; greedy)");
        *token = best;
        return TQKV_OK;
    }
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
     * candidate would survive the filters below: refuse instead of reading idx[-1] */
    if (!isfinite(sum))
        return tqkv_fail(TQKV_EINVAL, "sampler: logits are not finite (NaN/inf, or overflow "
                         "at temperature %g)", (double)p->temperature);
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
    return TQKV_OK;
}

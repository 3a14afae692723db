/*
 * outlier_split.c - experiment (issue 23, session 5): does the TurboQuant paper's
 * outlier-channel split give a lower K/V reconstruction error per bit than plain tq?
 * Not part of the product: built only with -DTQKV_EXPERIMENTS=ON, never installed.
 *
 * Owns: three f32-cache prefills (two calibration windows, one evaluation window) of a
 * model, the capture of every layer that holds its own K/V (as `tqkv kv-error` does), and a
 * float64 simulation of the split: per layer and KV head, the C channels with the largest
 * per-channel RMS over the calibration window go to their own group at b_hi bits, the other
 * d - C channels to a second group at b_lo bits; each group is a TurboQuant vector (random
 * signs, orthogonal transform, norm, nearest Lloyd-Max centroid, norm-corrected fp16 scale).
 * Must not: be used by the library or the CLI.
 *
 * Non-power-of-two groups (128 - 32 = 96): "kron" layout = one group, transform
 * H_{2^k} (x) DCT_m with d - C = m 2^k (m odd; orthogonal, one scale); "pow2" layout = the
 * binary decomposition 96 = 64 + 32, one Hadamard group and one fp16 scale each.
 * Outlier group modes: tq at 2..6 bits, q8 (int8, one fp16 scale per group), fp16.
 * Controls: the same layout with C channels chosen at random (fixed seed), and the oracle
 * set (chosen on the evaluation window itself).
 *
 * Figures: relative MSE sum ||x - x^||^2 / sum ||x||^2 per layer, and its mean over layers;
 * bits per value with every scale counted. Usage:
 *   exp_outlier_split --model DIR --text FILE [--ctx 2048] [--eval 0] [--calib 60]
 *                     [--calib2 120] [--json OUT.json]
 *   exp_outlier_split --model DIR --text FILE --calib 60 --plan C:hmode:hbits:lobits
 *                     --plan-out PLAN.txt
 * The second form writes a plan file for the library's EXPERIMENTAL probe
 * (src/model/ops/exp_ksplit.c, env TQKV_EXP_KSPLIT): per layer and KV head the C key
 * channels with the largest RMS over the calibration window (hmode 0 tq, 1 q8, 2 f16).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tqkv.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

#define MAXL 64
#define MAXD 512

/* ---- Lloyd-Max codebooks of N(0,1), 1..6 bits (float64 Lloyd iteration) ---- */

static double LM[7][64];

static double npdf(double x) { return exp(-0.5 * x * x) / sqrt(2 * M_PI); }
static double ncdf(double x) { return 0.5 * erfc(-x / sqrt(2)); }

static void lm_init(void) {
    for (int b = 1; b <= 6; b++) {
        const int L = 1 << b;
        double *c = LM[b];
        for (int i = 0; i < L; i++) c[i] = -3.0 + 6.0 * (i + 0.5) / L;
        for (int it = 0; it < 20000; it++) {
            double lo = -INFINITY;
            for (int i = 0; i < L; i++) {
                const double hi = i + 1 < L ? 0.5 * (c[i] + c[i + 1]) : INFINITY;
                const double pl = isinf(lo) ? 0 : npdf(lo), ph = isinf(hi) ? 0 : npdf(hi);
                const double p = ncdf(hi) - ncdf(lo);
                if (p > 0) c[i] = (pl - ph) / p;
                lo = hi;
            }
        }
    }
}

/* ---- fp16 rounding (nearest even), values in fp16's normal range ---- */

static double to_f16(double v) {
    if (v == 0 || !isfinite(v)) return v;
    int e;
    frexp(v, &e);                       /* v = f 2^e, f in [0.5, 1) */
    if (e < -13) e = -13;               /* subnormal step 2^-24 */
    const double q = ldexp(1.0, e - 11); /* 11 significant bits */
    double r = nearbyint(v / q) * q;
    return r > 65504 ? 65504 : r;
}

/* ---- orthogonal transforms ---- */

static void fwht(double *x, int n) {
    for (int h = 1; h < n; h <<= 1)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const double a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const double s = 1 / sqrt((double)n);
    for (int i = 0; i < n; i++) x[i] *= s;
}

/* Forward transform of a group of n = m 2^k (m odd): signs, then H_{2^k} on each of the m
 * rows, then the orthonormal DCT-II over the m rows of every column. */
static void group_fwd(double *x, int n, const double *sg) {
    int m = n;
    while (!(m & 1)) m >>= 1;
    const int p = n / m;
    for (int i = 0; i < n; i++) x[i] *= sg[i];
    for (int r = 0; r < m; r++) fwht(x + r * p, p);
    if (m == 1) return;
    double t[MAXD];
    for (int col = 0; col < p; col++) {
        for (int k = 0; k < m; k++) {
            double a = 0;
            for (int r = 0; r < m; r++) a += x[r * p + col] * cos(M_PI * (r + 0.5) * k / m);
            t[k] = a * sqrt((k ? 2.0 : 1.0) / m);
        }
        for (int k = 0; k < m; k++) x[k * p + col] = t[k];
    }
}

static void group_inv(double *x, int n, const double *sg) {
    int m = n;
    while (!(m & 1)) m >>= 1;
    const int p = n / m;
    if (m > 1) {
        double t[MAXD];
        for (int col = 0; col < p; col++) {
            for (int r = 0; r < m; r++) {
                double a = 0;
                for (int k = 0; k < m; k++)
                    a += x[k * p + col] * sqrt((k ? 2.0 : 1.0) / m) * cos(M_PI * (r + 0.5) * k / m);
                t[r] = a;
            }
            for (int r = 0; r < m; r++) x[r * p + col] = t[r];
        }
    }
    for (int r = 0; r < m; r++) fwht(x + r * p, p);
    for (int i = 0; i < n; i++) x[i] *= sg[i];
}

/* ---- one group through a mode; returns the bits it costs ---- */

enum { MODE_TQ = 0, MODE_Q8 = 1, MODE_F16 = 2 };

/* Quantize x [n] in place (x <- x^). tq: bits 1..6. */
static void group_quant(double *x, int n, int mode, int bits, const double *sg) {
    if (mode == MODE_F16) {
        for (int i = 0; i < n; i++) x[i] = to_f16(x[i]);
        return;
    }
    if (mode == MODE_Q8) {
        double amax = 0;
        for (int i = 0; i < n; i++) amax = fmax(amax, fabs(x[i]));
        const double d = to_f16(amax / 127);
        for (int i = 0; i < n; i++) {
            double q = d > 0 ? nearbyint(x[i] / d) : 0;
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            x[i] = q * d;
        }
        return;
    }
    group_fwd(x, n, sg);
    double nn = 0;
    for (int i = 0; i < n; i++) nn += x[i] * x[i];
    nn = sqrt(nn);
    if (nn == 0) return;
    const int L = 1 << bits;
    const double *c = LM[bits], sq = sqrt((double)n);
    double cc = 0;
    for (int i = 0; i < n; i++) {
        const double u = x[i] / nn * sq;
        int lo = 0, hi = L - 1; /* nearest centroid by bisection over the midpoints */
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (u > 0.5 * (c[mid] + c[mid + 1])) lo = mid + 1; else hi = mid;
        }
        x[i] = c[lo] / sq;
        cc += x[i] * x[i];
    }
    const double s = to_f16(nn / sqrt(cc));
    for (int i = 0; i < n; i++) x[i] *= s;
    group_inv(x, n, sg);
}

static double group_bits(int n, int mode, int bits) {
    return mode == MODE_F16 ? 16.0 * n : mode == MODE_Q8 ? 8.0 * n + 16 : (double)bits * n + 16;
}

/* ---- a scheme: C outlier channels at (hmode, hbits), the rest at lo bits ---- */

typedef struct {
    int C, hmode, hbits, lobits, pow2, sel; /* sel: 0 calib, 1 oracle, 2 random, 3 calib2 */
    char name[64];
} scheme;

static double scheme_bits(const scheme *s, int d) {
    if (s->C == 0) return group_bits(d, MODE_TQ, s->lobits) / d;
    double b = group_bits(s->C, s->hmode, s->hbits);
    int r = d - s->C;
    if (!s->pow2) return (b + group_bits(r, MODE_TQ, s->lobits)) / d;
    for (int g = MAXD; g >= 1; g >>= 1)
        if (r & g) b += group_bits(g, MODE_TQ, s->lobits);
    return b / d;
}

/* Quantize vector x [d] given the outlier channel list ch [C] (ascending flags in isout). */
static void scheme_apply(const scheme *s, const float *x, int d, const uint8_t *isout,
                         const double *sg, double *y) {
    double a[MAXD], b[MAXD];
    int na = 0, nb = 0, ia[MAXD], ib[MAXD];
    for (int i = 0; i < d; i++) {
        if (s->C && isout[i]) { ia[na] = i; a[na++] = x[i]; }
        else { ib[nb] = i; b[nb++] = x[i]; }
    }
    if (na) group_quant(a, na, s->hmode, s->hbits, sg);
    if (!s->pow2 || s->C == 0) {
        group_quant(b, nb, MODE_TQ, s->lobits, sg + MAXD);
    } else {
        int off = 0;
        for (int g = MAXD; g >= 1; g >>= 1)
            if (nb & g) {
                group_quant(b + off, g, MODE_TQ, s->lobits, sg + MAXD + off);
                off += g;
            }
    }
    for (int i = 0; i < na; i++) y[ia[i]] = a[i];
    for (int i = 0; i < nb; i++) y[ib[i]] = b[i];
}

/* ---- capture ---- */

typedef struct {
    int n_layers, layer[MAXL], H[MAXL], d[MAXL], tok[MAXL];
    float *K[MAXL], *V[MAXL]; /* [H, tok, d] */
} capture;

static int capture_window(tqkv_model *m, const int32_t *ids, int ctx, capture *cap) {
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    tqkv_model_state *s = NULL;
    float *lg = malloc(sizeof(float) * (size_t)tqkv_model_get_config(m)->vocab_size);
    if (!lg || tqkv_model_state_init(&s, m, &sp) != TQKV_OK ||
        tqkv_model_prefill(m, s, ids, NULL, ctx, TQKV_LOGITS_LAST, lg) != TQKV_OK) {
        fprintf(stderr, "prefill: %s\n", tqkv_last_error());
        return -1;
    }
    cap->n_layers = 0;
    for (int l = 0; l < tqkv_model_get_config(m)->n_layers; l++) {
        tqkv_layer_info li;
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (!b || tqkv_model_layer_info(m, l, &li) != TQKV_OK || li.kv_from != l) continue;
        const tqkv_cache_config *c = tqkv_batch_get_config(b);
        const int cols = tqkv_batch_columns(b), H = c->kv_heads, d = c->head_dim;
        int off = 0, lp = 0;
        float *K = malloc(sizeof(float) * (size_t)H * cols * d + 4);
        float *V = malloc(sizeof(float) * (size_t)H * cols * d + 4);
        if (!K || !V || tqkv_batch_capture(b, K, V, &off, &lp) != TQKV_OK) return -1;
        for (int h = 0; h < H; h++) {
            memmove(K + (size_t)h * off * d, K + ((size_t)h * cols + lp) * d, sizeof(float) * (size_t)off * d);
            memmove(V + (size_t)h * off * d, V + ((size_t)h * cols + lp) * d, sizeof(float) * (size_t)off * d);
        }
        const int i = cap->n_layers++;
        cap->layer[i] = l; cap->H[i] = H; cap->d[i] = d; cap->tok[i] = off;
        cap->K[i] = K; cap->V[i] = V;
    }
    tqkv_model_state_free(s);
    free(lg);
    return 0;
}

/* Per-channel RMS of head h -> flags of the top C channels. */
static void top_channels(const float *X, int tok, int d, int C, uint8_t *isout) {
    double r[MAXD];
    for (int j = 0; j < d; j++) r[j] = 0;
    for (int t = 0; t < tok; t++)
        for (int j = 0; j < d; j++) r[j] += (double)X[(size_t)t * d + j] * X[(size_t)t * d + j];
    memset(isout, 0, (size_t)d);
    for (int k = 0; k < C; k++) {
        int best = -1;
        for (int j = 0; j < d; j++)
            if (!isout[j] && (best < 0 || r[j] > r[best])) best = j;
        isout[best] = 1;
    }
}

static uint64_t sm_state;
static uint64_t splitmix(void) {
    uint64_t z = (sm_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* ---- plan file for the library probe ---- */

static int write_plan(tqkv_model *m, const int32_t *ids, int ctx, const char *plan, const char *out) {
    int C, hm, hb, lb;
    if (sscanf(plan, "%d:%d:%d:%d", &C, &hm, &hb, &lb) != 4) { fprintf(stderr, "bad --plan\n"); return 2; }
    capture c;
    if (capture_window(m, ids, ctx, &c)) return 1;
    FILE *f = fopen(out, "w");
    if (!f) { perror(out); return 1; }
    for (int li = 0; li < c.n_layers; li++)
        for (int h = 0; h < c.H[li]; h++) {
            const int d = c.d[li];
            uint8_t o[MAXD];
            top_channels(c.K[li] + (size_t)h * c.tok[li] * d, c.tok[li], d, C, o);
            fprintf(f, "%d %d %d %d %d %d %d %llu", c.layer[li], h, d, C, hm, hb, lb,
                    (unsigned long long)(0x5eed + 1000 * c.layer[li] + h));
            for (int j = 0; j < d; j++)
                if (o[j]) fprintf(f, " %d", j);
            fprintf(f, "\n");
        }
    fclose(f);
    return 0;
}

/* ---- summary: per scheme, bits and the mean over layers of the relative MSE ---- */

static double kerr[512][MAXL], verr[512][MAXL], kbits[512][MAXL];

static void print_summary(const scheme *S, int ns, const capture *evp, FILE *js) {
    const capture ev = *evp;
    printf("\n%-34s %8s %8s %9s %9s   per-layer K rel MSE\n", "scheme", "bits128", "bits256", "K mean", "V mean");
    for (int si = 0; si < ns; si++) {
        double sk = 0, sv = 0, b128 = -1, b256 = -1;
        int n = 0;
        for (int li = 0; li < ev.n_layers; li++) {
            if (kbits[si][li] < 0) continue;
            sk += kerr[si][li]; sv += verr[si][li]; n++;
            if (ev.d[li] == 128) b128 = kbits[si][li]; else if (ev.d[li] == 256) b256 = kbits[si][li]; else b128 = kbits[si][li];
        }
        if (!n) continue;
        printf("%-34s %8.4f %8.4f %9.5f %9.5f  ", S[si].name, b128, b256, sk / n, sv / n);
        for (int li = 0; li < ev.n_layers; li++) printf(" %.5f", kbits[si][li] < 0 ? NAN : kerr[si][li]);
        printf("\n");
        if (js) {
            fprintf(js, "%s{\"scheme\": \"%s\", \"C\": %d, \"bits_d128\": %.4f, \"bits_d256\": %.4f, \"k_rel_mse_mean\": %.6f, \"v_rel_mse_mean\": %.6f, \"k_rel_mse\": [",
                    si ? ",\n" : "", S[si].name, S[si].C, b128, b256, sk / n, sv / n);
            for (int li = 0; li < ev.n_layers; li++) fprintf(js, "%s%.6f", li ? ", " : "", kbits[si][li] < 0 ? -1.0 : kerr[si][li]);
            fprintf(js, "]}");
        }
    }
}

/* ---- main ---- */

static void add_scheme(scheme *S, int *n, int C, int hmode, int hbits, int lobits, int pow2, int sel) {
    scheme *s = &S[(*n)++];
    *s = (scheme){C, hmode, hbits, lobits, pow2, sel, ""};
    static const char *seln[] = {"calib", "oracle", "random", "calib2"};
    if (!C) snprintf(s->name, sizeof s->name, "tq%d", lobits);
    else snprintf(s->name, sizeof s->name, "C%d:%s%d+tq%d/%s/%s", C,
                  hmode == MODE_TQ ? "tq" : hmode == MODE_Q8 ? "q" : "f", hmode == MODE_TQ ? hbits : hmode == MODE_Q8 ? 8 : 16,
                  lobits, pow2 ? "pow2" : "kron", seln[sel]);
}

int main(int argc, char **argv) {
    const char *dir = NULL, *text = NULL, *jpath = NULL, *plan = NULL, *plan_out = NULL;
    int ctx = 2048, wev = 0, wc1 = 60, wc2 = 120;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) dir = argv[i + 1];
        else if (!strcmp(argv[i], "--text")) text = argv[i + 1];
        else if (!strcmp(argv[i], "--ctx")) ctx = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--eval")) wev = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--calib")) wc1 = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--calib2")) wc2 = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--json")) jpath = argv[i + 1];
        else if (!strcmp(argv[i], "--plan")) plan = argv[i + 1];
        else if (!strcmp(argv[i], "--plan-out")) plan_out = argv[i + 1];
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    if (!dir || !text) { fprintf(stderr, "usage: see the file's top comment\n"); return 2; }
    lm_init();
    FILE *f = fopen(text, "rb");
    if (!f) { perror(text); return 1; }
    fseek(f, 0, SEEK_END);
    const long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)len + 1);
    if (!buf || fread(buf, 1, (size_t)len, f) != (size_t)len) return 1;
    fclose(f);
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    if (tqkv_model_load(&m, dir, &lp) != TQKV_OK || tqkv_tokenizer_load(&tok, dir) != TQKV_OK ||
        tqkv_tokenizer_encode(tok, buf, (size_t)len, 0, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "%s\n", tqkv_last_error());
        return 1;
    }
    int wmax = wev > wc1 ? wev : wc1;
    wmax = wmax > wc2 ? wmax : wc2;
    if ((size_t)ctx * (wmax + 1) > n_ids) { fprintf(stderr, "text too short\n"); return 1; }
    capture ev, c1, c2;
    if (plan && plan_out) return write_plan(m, ids + (size_t)ctx * wc1, ctx, plan, plan_out);
    if (capture_window(m, ids + (size_t)ctx * wev, ctx, &ev) || capture_window(m, ids + (size_t)ctx * wc1, ctx, &c1) ||
        capture_window(m, ids + (size_t)ctx * wc2, ctx, &c2))
        return 1;

    /* schemes */
    static scheme S[512];
    int ns = 0;
    for (int b = 2; b <= 5; b++) add_scheme(S, &ns, 0, 0, 0, b, 0, 0);
    const int Cs[] = {8, 16, 32, 64};
    for (int ci = 0; ci < 4; ci++)
        for (int sel = 0; sel < 4; sel++) {
            const int C = Cs[ci];
            for (int pow2 = 0; pow2 <= 1; pow2++) {
                if (pow2 && sel) continue; /* layout comparison on the calibrated set only */
                add_scheme(S, &ns, C, MODE_TQ, 3, 2, pow2, sel);
                add_scheme(S, &ns, C, MODE_TQ, 4, 3, pow2, sel);
                add_scheme(S, &ns, C, MODE_TQ, 5, 3, pow2, sel);
                add_scheme(S, &ns, C, MODE_TQ, 5, 4, pow2, sel);
                add_scheme(S, &ns, C, MODE_TQ, 6, 4, pow2, sel);
                add_scheme(S, &ns, C, MODE_Q8, 8, 4, pow2, sel);
                add_scheme(S, &ns, C, MODE_Q8, 8, 3, pow2, sel);
                add_scheme(S, &ns, C, MODE_F16, 16, 4, pow2, sel);
            }
        }

    FILE *js = jpath ? fopen(jpath, "w") : NULL;
    if (js) fprintf(js, "{\"model\": \"%s\", \"ctx\": %d, \"eval_window\": %d, \"calib_window\": %d, \"calib2_window\": %d, \"layers\": [\n",
                    dir, ctx, wev, wc1, wc2);
    /* per-layer: overlap, energy fractions; then per scheme relMSE per layer */
    for (int li = 0; li < ev.n_layers; li++) {
        const int H = ev.H[li], d = ev.d[li];
        printf("layer %d (d %d, %d tokens eval, %d calib):", ev.layer[li], d, ev.tok[li], c1.tok[li]);
        if (js) fprintf(js, "%s{\"layer\": %d, \"head_dim\": %d, \"heads\": [", li ? ",\n" : "", ev.layer[li], d);
        for (int h = 0; h < H; h++) {
            if (js) fprintf(js, "%s{\"head\": %d", h ? ", " : "", h);
            for (int ci = 0; ci < 4; ci++) {
                const int C = Cs[ci];
                if (C >= d / 2) continue;
                uint8_t a[MAXD], b[MAXD], o[MAXD];
                top_channels(c1.K[li] + (size_t)h * c1.tok[li] * d, c1.tok[li], d, C, a);
                top_channels(c2.K[li] + (size_t)h * c2.tok[li] * d, c2.tok[li], d, C, b);
                top_channels(ev.K[li] + (size_t)h * ev.tok[li] * d, ev.tok[li], d, C, o);
                int ov = 0, ovo = 0;
                double eo = 0, et = 0;
                const float *X = ev.K[li] + (size_t)h * ev.tok[li] * d;
                for (int j = 0; j < d; j++) { ov += a[j] && b[j]; ovo += a[j] && o[j]; }
                for (size_t t = 0; t < (size_t)ev.tok[li]; t++)
                    for (int j = 0; j < d; j++) {
                        const double v2 = (double)X[t * d + j] * X[t * d + j];
                        et += v2;
                        if (a[j]) eo += v2;
                    }
                printf(" h%d C%d overlap(c1,c2) %d eval-oracle %d energy %.3f;", h, C, ov, ovo, eo / et);
                if (js) fprintf(js, ", \"C%d\": {\"overlap_calib_calib2\": %d, \"overlap_calib_oracle\": %d, \"k_energy_fraction\": %.4f}",
                                C, ov, ovo, eo / et);
            }
            if (js) fprintf(js, "}");
        }
        printf("\n");
        if (js) fprintf(js, "]}");
        for (int si = 0; si < ns; si++) {
            const scheme *s = &S[si];
            kbits[si][li] = -1;
            if (s->C >= d / 2) continue;
            kbits[si][li] = scheme_bits(s, d);
            double nk = 0, dk = 0, nv = 0, dv = 0;
            for (int h = 0; h < H; h++) {
                uint8_t ok[MAXD], ovv[MAXD];
                const capture *cs = s->sel == 1 ? &ev : s->sel == 3 ? &c2 : &c1;
                if (s->sel == 2) {
                    sm_state = 1234 + 77 * (uint64_t)li + h;
                    memset(ok, 0, (size_t)d);
                    for (int k = 0; k < s->C;) {
                        const int j = (int)(splitmix() % (uint64_t)d);
                        if (!ok[j]) { ok[j] = 1; k++; }
                    }
                    memcpy(ovv, ok, (size_t)d);
                } else {
                    top_channels(cs->K[li] + (size_t)h * cs->tok[li] * d, cs->tok[li], d, s->C, ok);
                    top_channels(cs->V[li] + (size_t)h * cs->tok[li] * d, cs->tok[li], d, s->C, ovv);
                }
                double sg[2 * MAXD];
                sm_state = 0x5eed + 1000 * (uint64_t)li + h;
                for (int j = 0; j < 2 * MAXD; j++) sg[j] = (splitmix() >> 63) ? -1.0 : 1.0;
                for (int t = 0; t < ev.tok[li]; t++) {
                    double y[MAXD];
                    const float *xk = ev.K[li] + ((size_t)h * ev.tok[li] + t) * d;
                    const float *xv = ev.V[li] + ((size_t)h * ev.tok[li] + t) * d;
                    scheme_apply(s, xk, d, ok, sg, y);
                    for (int j = 0; j < d; j++) { nk += (xk[j] - y[j]) * (xk[j] - y[j]); dk += (double)xk[j] * xk[j]; }
                    scheme_apply(s, xv, d, ovv, sg, y);
                    for (int j = 0; j < d; j++) { nv += (xv[j] - y[j]) * (xv[j] - y[j]); dv += (double)xv[j] * xv[j]; }
                }
            }
            kerr[si][li] = nk / dk;
            verr[si][li] = nv / dv;
        }
    }
    if (js) fprintf(js, "\n], \"schemes\": [\n");
    print_summary(S, ns, &ev, js);
    if (js) { fprintf(js, "\n]}\n"); fclose(js); }
    return 0;
}

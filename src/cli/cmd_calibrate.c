/*
 * cmd_calibrate.c - `tqkv calibrate`: per-layer KV sensitivity on a text, and the per-layer
 * K/V formats that minimise the predicted loss within B bits per value (a KV policy file,
 * kv_policy.h; use it with --kv-policy FILE).
 * Owns: the sensitivity scan, the greedy choice, the policy text it writes.
 * Must not: contain model, cache or tokenizer logic.
 *
 * Sensitivity: for each layer l with its own K/V, each plane (K or V) and each candidate
 * format f, the mean KL(p_f32 || p) over the calibration windows when only that plane of
 * that layer is stored at f (every other plane f32), with the q8 window W on the tq planes.
 * Choice: the predicted loss of a configuration is the sum of its planes' sensitivities;
 * starting from every plane at the cheapest format, the upgrade (one plane to a format of
 * more bits) with the largest loss drop per bit that still fits B is taken until none fits
 * (bits counted as `tqkv ppl --json` kv_bits_per_value, at --ctx); then the window grows to
 * spend what is left, as the presets' windows do.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "kv_policy.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "calibrate";

#define CAL_MAX_FMT 8
#define CAL_MAX_BUDGETS 8

typedef struct {
    const char *model_arg, *text_path, *out, *out_dir, *budgets, *formats;
    int ctx, max_windows, first_window, window, threads, json, no_check;
    char dir[4096];
    int n_budget;
    double budget[CAL_MAX_BUDGETS];
    int n_fmt;
    tqkv_format fmt[CAL_MAX_FMT]; /* most bits first */
} cal_opts;

/* What was measured: layers with their own K/V, and per (layer, plane, format) the mean KLD
 * and the bytes the plane takes at ctx (with the window). */
typedef struct {
    int n_own, own[TQKV_MAX_KV_LAYERS];
    double kld[TQKV_MAX_KV_LAYERS][2][CAL_MAX_FMT];
    double bytes[TQKV_MAX_KV_LAYERS][2][CAL_MAX_FMT]; /* plane bytes at ctx */
    double vals;                                      /* values at ctx, all layers */
} cal_table;

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

/* "a,b,c" of formats into o->fmt, sorted by bits (most first); 0 or -1 (message). */
static int cal_parse_formats(cal_opts *o) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", o->formats);
    o->n_fmt = 0;
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        tqkv_format k, v;
        if (o->n_fmt == CAL_MAX_FMT || tqkv_kv_spec_parse(t, &k, &v) != TQKV_OK || k != v) {
            fprintf(stderr, "tqkv calibrate: --formats '%s': up to %d single formats, e.g. "
                    "q8,tq4,tq3,tq2\n", o->formats, CAL_MAX_FMT);
            return -1;
        }
        int i = o->n_fmt++;
        while (i > 0 && tqkv_format_bits_per_value(o->fmt[i - 1], 128) <
                            tqkv_format_bits_per_value(k, 128)) {
            o->fmt[i] = o->fmt[i - 1];
            i--;
        }
        o->fmt[i] = k;
    }
    return o->n_fmt ? 0 : -1;
}

/* "4.25,3.25" into o->budget; 0 or -1 (message). */
static int cal_parse_budgets(cal_opts *o) {
    const char *s = o->budgets;
    o->n_budget = 0;
    while (*s) {
        char *end;
        double b = strtod(s, &end);
        if (end == s || !(b > 0) || o->n_budget == CAL_MAX_BUDGETS || (*end && *end != ',')) {
            fprintf(stderr, "tqkv calibrate: --budget '%s': bits per value, e.g. 4.25 or "
                    "4.25,3.25\n", o->budgets);
            return -1;
        }
        o->budget[o->n_budget++] = b;
        s = *end ? end + 1 : end;
    }
    return o->n_budget ? 0 : -1;
}

static int cal_parse_args(int argc, char **argv, cal_opts *o) {
    *o = (cal_opts){.model_arg = MCLI_DEFAULT_MODEL, .budgets = "4.25",
                    .formats = "q8,tq4,tq3,tq2", .ctx = 2048, .max_windows = 2,
                    .first_window = 64, .window = 30};
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--text", ARG_STR, &o->text_path, "calibration text (windows of --ctx tokens)"},
        {"--ctx", ARG_INT, &o->ctx, "window length in tokens, and the context bits are counted at (default 2048)"},
        {"--max-windows", ARG_INT, &o->max_windows, "calibration windows (default 2)"},
        {"--first-window", ARG_INT, &o->first_window, "first window used (default 64: keep clear of the windows `tqkv ppl` scores first)"},
        {"--window", ARG_INT, &o->window, "q8 window on the tq planes while measuring, and the least the policy keeps (default 30)"},
        {"--formats", ARG_STR, &o->formats, "candidate formats per plane (default q8,tq4,tq3,tq2)"},
        {"--budget", ARG_STR, &o->budgets, "bits per value, or a comma list (default 4.25)"},
        {"--out", ARG_STR, &o->out, "policy file to write (one budget)"},
        {"--out-dir", ARG_STR, &o->out_dir, "write DIR/kv-policy-B.txt per budget B"},
        {"--threads", ARG_INT, &o->threads, "threads (default: all CPUs)"},
        {"--no-check", ARG_FLAG, &o->no_check, "do not measure the choice against auto:B on the calibration windows"},
        {"--json", ARG_FLAG, &o->json, "end with a JSON line: sensitivities and the choices"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!o->text_path) {
        fprintf(stderr, "tqkv calibrate: --text is required\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    if (o->ctx < 2 || o->max_windows < 1 || o->first_window < 0 || o->window < 0 ||
        o->threads < 0) {
        fprintf(stderr, "tqkv calibrate: need --ctx >= 2, --max-windows >= 1, non-negative counts\n");
        return 2;
    }
    if (cal_parse_formats(o) || cal_parse_budgets(o)) return 2;
    if (o->out && o->n_budget != 1) {
        fprintf(stderr, "tqkv calibrate: --out takes one budget; use --out-dir for several\n");
        return 2;
    }
    if (o->threads == 0) o->threads = mcli_cpus();
    if (!mcli_resolve_model(CMD, o->model_arg, o->dir, sizeof o->dir)) return 1;
    return 0;
}

// ---------------------------------------------------------------------------
// Measurement
// ---------------------------------------------------------------------------

/* State params: every plane f32 but plane `plane` (0 K, 1 V) of layer l at f (l < 0: none),
 * window W on the tq planes, no slack. */
static tqkv_model_state_params cal_params(const cal_opts *o, int l, int plane, tqkv_format f) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = p.v_format = TQKV_F32;
    p.window = o->window;
    p.window_slack = 0;
    p.threads = o->threads;
    p.rows = 1;
    if (l >= 0) (plane ? p.layer_v : p.layer_k)[l] = (uint8_t)(f + 1);
    return p;
}

/* Logits [ctx, V] of window tok [ctx] through a fresh state with params p; 0 or -1. */
static int cal_forward(const tqkv_model *m, const tqkv_model_state_params *p,
                       const int32_t *tok, int ctx, float *lg) {
    tqkv_model_state *s = NULL;
    int rc = tqkv_model_state_init(&s, m, p) == TQKV_OK &&
             tqkv_model_prefill(m, s, tok, NULL, ctx, TQKV_LOGITS_ALL, lg) == TQKV_OK ? 0 : -1;
    if (rc) fprintf(stderr, "tqkv calibrate: %s\n", tqkv_last_error());
    tqkv_model_state_free(s);
    return rc;
}

/* In place: logits [n, V] to log-probabilities. */
static void cal_log_softmax(float *x, int n, int V, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++) {
        float *l = x + (size_t)j * V, mx = -INFINITY;
        for (int v = 0; v < V; v++) mx = l[v] > mx ? l[v] : mx;
        double s = 0;
        for (int v = 0; v < V; v++) s += exp((double)(l[v] - mx));
        const float z = (float)((double)mx + log(s));
        for (int v = 0; v < V; v++) l[v] -= z;
    }
}

/* Mean over n positions of KL(p_ref || p), both given as log-probabilities [n, V]. */
static double cal_kld(const float *ref, const float *lp, int n, int V, int threads) {
    double *pos = malloc(sizeof(double) * (size_t)n); // [n]
    if (!pos) return NAN;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++) {
        const float *r = ref + (size_t)j * V, *q = lp + (size_t)j * V;
        double acc = 0;
        for (int v = 0; v < V; v++) acc += exp((double)r[v]) * ((double)r[v] - (double)q[v]);
        pos[j] = acc;
    }
    double sum = 0;
    for (int j = 0; j < n; j++) sum += pos[j];
    free(pos);
    return sum / n;
}

/* The KLD of every (own layer, plane, format) on window tok [ctx], added into t->kld with
 * weight w; progress on stderr. 0 or -1. */
static int cal_scan_window(const cal_opts *o, const tqkv_model *m, const int32_t *tok,
                           double w, float *ref, float *lg, cal_table *t, int win, int n_win) {
    const int V = tqkv_model_get_config(m)->vocab_size, ctx = o->ctx;
    tqkv_model_state_params p = cal_params(o, -1, 0, TQKV_F32);
    if (cal_forward(m, &p, tok, ctx, ref)) return -1;
    cal_log_softmax(ref, ctx, V, o->threads);
    for (int i = 0; i < t->n_own; i++) {
        const int l = t->own[i];
        double t0 = mcli_now();
        for (int plane = 0; plane < 2; plane++)
            for (int f = 0; f < o->n_fmt; f++) {
                p = cal_params(o, l, plane, o->fmt[f]);
                if (cal_forward(m, &p, tok, ctx, lg)) return -1;
                cal_log_softmax(lg, ctx, V, o->threads);
                t->kld[i][plane][f] += w * cal_kld(ref, lg, ctx, V, o->threads);
            }
        fprintf(stderr, "window %d/%d  layer %d (%d/%d)  K %s %.5f  V %s %.5f  %.1f s\n",
                win + 1, n_win, l, i + 1, t->n_own, tqkv_format_name(o->fmt[o->n_fmt - 1]),
                t->kld[i][0][o->n_fmt - 1] / (w * (win + 1)),
                tqkv_format_name(o->fmt[o->n_fmt - 1]), t->kld[i][1][o->n_fmt - 1] / (w * (win + 1)),
                mcli_now() - t0);
    }
    return 0;
}

/* Bytes per own layer at ctx of params p into by[n_own]; values into *vals. 0 or -1. */
static int cal_layer_bytes(const cal_opts *o, const tqkv_model *m, const cal_table *t,
                           const tqkv_model_state_params *p, double *by, double *vals) {
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, m, p) != TQKV_OK) {
        fprintf(stderr, "tqkv calibrate: %s\n", tqkv_last_error());
        return -1;
    }
    *vals = 0;
    for (int i = 0; i < t->n_own; i++) { /* as mcli_kv_bits counts */
        tqkv_layer_info li;
        tqkv_batch *b = tqkv_model_state_layer(s, t->own[i]);
        (void)tqkv_model_layer_info(m, t->own[i], &li);
        const tqkv_cache_config *c = tqkv_batch_get_config(b);
        int tokens = o->ctx;
        if (li.window > 0 && li.window + c->window_slack < tokens) tokens = li.window + c->window_slack;
        by[i] = (double)tqkv_batch_projected_bytes(b, tokens);
        *vals += 2.0 * tokens * c->kv_heads * c->head_dim;
    }
    tqkv_model_state_free(s);
    return 0;
}

/* t->bytes of every (layer, plane, format): a plane at f with the other f32, less half the
 * all-f32 layer (what the layer costs beside its planes is split between them). 0 or -1. */
static int cal_bytes(const cal_opts *o, const tqkv_model *m, cal_table *t) {
    double b0[TQKV_MAX_KV_LAYERS], b[TQKV_MAX_KV_LAYERS];
    tqkv_model_state_params p = cal_params(o, -1, 0, TQKV_F32);
    p.threads = 1;
    if (cal_layer_bytes(o, m, t, &p, b0, &t->vals)) return -1;
    for (int plane = 0; plane < 2; plane++)
        for (int f = 0; f < o->n_fmt; f++) {
            double v;
            tqkv_model_state_params q = p;
            *(plane ? &q.v_format : &q.k_format) = o->fmt[f];
            if (cal_layer_bytes(o, m, t, &q, b, &v)) return -1;
            for (int i = 0; i < t->n_own; i++) t->bytes[i][plane][f] = b[i] - 0.5 * b0[i];
        }
    return 0;
}

// ---------------------------------------------------------------------------
// Choice
// ---------------------------------------------------------------------------

/* Bits per value of choice ch [n_own][2] (format indices). */
static double cal_bits(const cal_table *t, int ch[][2]) {
    double by = 0;
    for (int i = 0; i < t->n_own; i++) by += t->bytes[i][0][ch[i][0]] + t->bytes[i][1][ch[i][1]];
    return 8.0 * by / t->vals;
}

/* Greedy choice within budget B into ch [n_own][2]; its predicted loss, or -1 when even the
 * cheapest formats do not fit. */
static double cal_choose(const cal_opts *o, const cal_table *t, double B, int ch[][2]) {
    for (int i = 0; i < t->n_own; i++) ch[i][0] = ch[i][1] = o->n_fmt - 1;
    if (cal_bits(t, ch) > B + 1e-9) return -1;
    for (;;) {
        double best = 0;
        int bi = -1, bp = 0, bf = 0;
        const double now = cal_bits(t, ch);
        for (int i = 0; i < t->n_own; i++)
            for (int p = 0; p < 2; p++)
                for (int f = 0; f < ch[i][p]; f++) { /* formats of more bits */
                    const int was = ch[i][p];
                    ch[i][p] = f;
                    const double nb = cal_bits(t, ch), gain = t->kld[i][p][was] - t->kld[i][p][f];
                    ch[i][p] = was;
                    if (nb > B + 1e-9 || gain <= 0 || nb <= now) continue;
                    if (gain / (nb - now) > best) best = gain / (nb - now), bi = i, bp = p, bf = f;
                }
        if (bi < 0) break;
        ch[bi][bp] = bf;
    }
    double loss = 0;
    for (int i = 0; i < t->n_own; i++) loss += t->kld[i][0][ch[i][0]] + t->kld[i][1][ch[i][1]];
    return loss;
}

/* Policy of choice ch: the most common K/V pair as kv, the other layers grouped by pair in
 * kv-layers. */
static void cal_policy(const cal_opts *o, const tqkv_model *m, const cal_table *t,
                       int ch[][2], kv_policy *pol) {
    int cnt[CAL_MAX_FMT][CAL_MAX_FMT] = {{0}}, dk = 0, dv = 0;
    for (int i = 0; i < t->n_own; i++) cnt[ch[i][0]][ch[i][1]]++;
    for (int a = 0; a < o->n_fmt; a++)
        for (int b = 0; b < o->n_fmt; b++)
            if (cnt[a][b] > cnt[dk][dv]) dk = a, dv = b;
    memset(pol, 0, sizeof *pol);
    pol->layers = tqkv_model_get_config(m)->n_layers;
    snprintf(pol->kv, sizeof pol->kv, "%s/%s", tqkv_format_name(o->fmt[dk]),
             tqkv_format_name(o->fmt[dv]));
    size_t n = 0;
    for (int a = 0; a < o->n_fmt; a++)
        for (int b = 0; b < o->n_fmt; b++) {
            if ((a == dk && b == dv) || !cnt[a][b]) continue;
            n += (size_t)snprintf(pol->kv_layers + n, sizeof pol->kv_layers - n, "%s", n ? ";" : "");
            int first = 1;
            for (int i = 0; i < t->n_own; i++)
                if (ch[i][0] == a && ch[i][1] == b) {
                    n += (size_t)snprintf(pol->kv_layers + n, sizeof pol->kv_layers - n, "%s%d",
                                          first ? "" : ",", t->own[i]);
                    first = 0;
                }
            n += (size_t)snprintf(pol->kv_layers + n, sizeof pol->kv_layers - n, ":%s/%s",
                                  tqkv_format_name(o->fmt[a]), tqkv_format_name(o->fmt[b]));
        }
    pol->window = o->window;
    pol->ctx = o->ctx;
}

/* Grow pol's window (bisection on the counted bits) to spend budget B; pol->bits set.
 * 0, or -1 when the policy does not fit at all (message). */
static int cal_grow_window(const cal_opts *o, const tqkv_model *m, kv_policy *pol, double B) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    char desc[256];
    pol->budget = B;
    if (kvpol_apply(CMD, m, pol, o->ctx, &p, desc, sizeof desc)) return -1;
    pol->bits = kvpol_bits(m, &p, o->ctx);
    int has_tq = tqkv_format_is_tq(p.k_format) || tqkv_format_is_tq(p.v_format);
    for (int l = 0; l < TQKV_MAX_KV_LAYERS; l++)
        has_tq |= (p.layer_k[l] && tqkv_format_is_tq((tqkv_format)(p.layer_k[l] - 1))) ||
                  (p.layer_v[l] && tqkv_format_is_tq((tqkv_format)(p.layer_v[l] - 1)));
    if (!has_tq || pol->window == 0) return 0;
    int lo = pol->window, hi = o->ctx;
    while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        p.window = mid;
        const double b = kvpol_bits(m, &p, o->ctx);
        if (b >= 0 && b <= B + 1e-9) lo = mid, pol->bits = b;
        else hi = mid;
    }
    pol->window = lo;
    return 0;
}

// ---------------------------------------------------------------------------
// Check: the choice against the ranked preset auto:B on the calibration windows
// ---------------------------------------------------------------------------

/* Mean KLD from the f32 cache of params a and b over the n_win calibration windows. 0/-1. */
static int cal_compare(const cal_opts *o, const tqkv_model *m, const int32_t *ids, int n_win,
                       const tqkv_model_state_params *a, const tqkv_model_state_params *b,
                       double *ka, double *kb) {
    const int V = tqkv_model_get_config(m)->vocab_size, ctx = o->ctx;
    float *ref = malloc(sizeof(float) * (size_t)ctx * V); // [ctx, vocab]
    float *lg = malloc(sizeof(float) * (size_t)ctx * V);  // [ctx, vocab]
    const tqkv_model_state_params rp = cal_params(o, -1, 0, TQKV_F32);
    int rc = ref && lg ? 0 : -1;
    *ka = *kb = 0;
    for (int w = 0; w < n_win && !rc; w++) {
        const int32_t *tok = ids + (size_t)(o->first_window + w) * ctx;
        rc = cal_forward(m, &rp, tok, ctx, ref);
        if (!rc) cal_log_softmax(ref, ctx, V, o->threads);
        for (int i = 0; i < 2 && !rc; i++) {
            rc = cal_forward(m, i ? b : a, tok, ctx, lg);
            if (rc) break;
            cal_log_softmax(lg, ctx, V, o->threads);
            *(i ? kb : ka) += cal_kld(ref, lg, ctx, V, o->threads) / n_win;
        }
    }
    free(ref);
    free(lg);
    return rc;
}

/* Policy of params p (formats, per-layer formats, window) into pol. */
static void cal_policy_of(const tqkv_model *m, const tqkv_model_state_params *p, kv_policy *pol) {
    const int L = tqkv_model_get_config(m)->n_layers;
    pol->layers = L;
    snprintf(pol->kv, sizeof pol->kv, "%s/%s", tqkv_format_name(p->k_format),
             tqkv_format_name(p->v_format));
    size_t n = 0;
    pol->kv_layers[0] = 0;
    for (int l = 0; l < L && l < TQKV_MAX_KV_LAYERS; l++) {
        if (!p->layer_k[l] && !p->layer_v[l]) continue;
        tqkv_format k, v;
        tqkv_kv_layer_formats(p, l, &k, &v);
        n += (size_t)snprintf(pol->kv_layers + n, sizeof pol->kv_layers - n, "%s%d:%s/%s",
                              n ? ";" : "", l, tqkv_format_name(k), tqkv_format_name(v));
    }
    pol->window = p->window;
}

/* Measure pol against auto:B on the calibration windows; when the preset measures better,
 * pol becomes the preset's configuration. *kp, *kr: the two KLDs. 0 or -1. */
static int cal_check(const cal_opts *o, const tqkv_model *m, const int32_t *ids, int n_win,
                     kv_policy *pol, double B, double *kp, double *kr) {
    tqkv_model_state_params a = cal_params(o, -1, 0, TQKV_F32), b = a;
    char desc[256], name[32];
    snprintf(name, sizeof name, "auto:%.6g", B);
    memset(b.layer_k, 0, sizeof b.layer_k);
    memset(b.layer_v, 0, sizeof b.layer_v);
    if (kvpol_apply(CMD, m, pol, o->ctx, &a, desc, sizeof desc) ||
        kvp_resolve(CMD, m, name, o->ctx, &b, desc, sizeof desc) ||
        cal_compare(o, m, ids, n_win, &a, &b, kp, kr))
        return -1;
    fprintf(stderr, "tqkv calibrate: %.4g bits: calibrated KLD %.5f, %s (%s) %.5f on the "
            "calibration windows\n", B, *kp, name, desc, *kr);
    if (*kr < *kp) {
        cal_policy_of(m, &b, pol);
        pol->bits = kvpol_bits(m, &b, o->ctx);
        fprintf(stderr, "tqkv calibrate: %.4g bits: the preset measured better; the policy "
                "holds its configuration\n", B);
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Output and command
// ---------------------------------------------------------------------------

/* Write pol to path with a comment of how it was made; 0 or -1 (message). */
static int cal_write(const cal_opts *o, const kv_policy *pol, const char *path, double loss,
                     double kp, double kr) {
    FILE *f = fopen(path, "w");
    char c[1024];
    int n = snprintf(c, sizeof c, "tqkv calibrate: %d window(s) from %d of %s, ctx %d, measured "
                     "with window %d; predicted KLD %.5f", o->max_windows, o->first_window,
                     o->text_path, o->ctx, o->window, loss);
    if (!o->no_check && n > 0 && (size_t)n < sizeof c)
        snprintf(c + n, sizeof c - (size_t)n, "; measured KLD %.5f against auto:%g's %.5f%s", kp,
                 pol->budget, kr, kr < kp ? " (so this is the preset's configuration)" : "");
    int bad = !f || kvpol_write(f, pol, c);
    if ((f && fclose(f)) || bad) {
        fprintf(stderr, "tqkv calibrate: cannot write %s\n", path);
        return -1;
    }
    fprintf(stderr, "tqkv calibrate: wrote %s (kv %s, layers '%s', window %d, %.4f bits)\n",
            path, pol->kv, pol->kv_layers, pol->window, pol->bits);
    return 0;
}

/* The sensitivity table as a JSON array of {layer, plane, format, kld, bits}. */
static cJSON *cal_json_table(const cal_opts *o, const cal_table *t) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < t->n_own; i++)
        for (int p = 0; p < 2; p++)
            for (int f = 0; f < o->n_fmt; f++) {
                cJSON *e = cJSON_CreateObject();
                if (!e) break;
                cJSON_AddNumberToObject(e, "layer", t->own[i]);
                cJSON_AddStringToObject(e, "plane", p ? "v" : "k");
                cJSON_AddStringToObject(e, "format", tqkv_format_name(o->fmt[f]));
                json_add_num(e, "kld", t->kld[i][p][f], 7);
                json_add_num(e, "plane_bits", 8.0 * t->bytes[i][p][f] / t->vals, 5);
                cJSON_AddItemToArray(a, e);
            }
    return a;
}

/* Choose, write and report a policy per budget; 0 or -1. */
static int cal_emit(const cal_opts *o, const tqkv_model *m, const cal_table *t,
                    const int32_t *ids, int n_win) {
    cJSON *j = cJSON_CreateObject(), *pols = cJSON_CreateArray();
    int rc = 0;
    for (int b = 0; b < o->n_budget && !rc; b++) {
        int ch[TQKV_MAX_KV_LAYERS][2];
        kv_policy pol;
        const double loss = cal_choose(o, t, o->budget[b], ch);
        if (loss < 0) {
            fprintf(stderr, "tqkv calibrate: the cheapest formats (%s) take %.4f bits per "
                    "value, over %.4g\n", tqkv_format_name(o->fmt[o->n_fmt - 1]),
                    cal_bits(t, ch), o->budget[b]);
            rc = -1;
            break;
        }
        cal_policy(o, m, t, ch, &pol);
        if (cal_grow_window(o, m, &pol, o->budget[b])) rc = -1;
        double kp = NAN, kr = NAN;
        if (!rc && !o->no_check && cal_check(o, m, ids, n_win, &pol, o->budget[b], &kp, &kr))
            rc = -1;
        char path[4200];
        if (o->out_dir) snprintf(path, sizeof path, "%s/kv-policy-%g.txt", o->out_dir, o->budget[b]);
        if (!rc && (o->out || o->out_dir)) rc = cal_write(o, &pol, o->out ? o->out : path, loss, kp, kr);
        if (!rc && !o->out && !o->out_dir && !o->json) kvpol_write(stdout, &pol, NULL);
        cJSON *e = cJSON_CreateObject();
        json_add_num(e, "budget", o->budget[b], 4);
        cJSON_AddStringToObject(e, "kv", pol.kv);
        cJSON_AddStringToObject(e, "kv_layers", pol.kv_layers);
        cJSON_AddNumberToObject(e, "window", pol.window);
        json_add_num(e, "kv_bits_per_value", pol.bits, 4);
        json_add_num(e, "predicted_kld", loss, 6);
        json_add_num(e, "checked_kld", kp, 6); /* null with --no-check */
        json_add_num(e, "checked_kld_preset", kr, 6);
        cJSON_AddItemToArray(pols, e);
    }
    if (o->json && !rc) {
        cJSON_AddNumberToObject(j, "windows", n_win);
        cJSON_AddNumberToObject(j, "first_window", o->first_window);
        cJSON_AddNumberToObject(j, "ctx", o->ctx);
        cJSON_AddNumberToObject(j, "window", o->window);
        cJSON_AddItemToObject(j, "sensitivity", cal_json_table(o, t));
        cJSON_AddItemToObject(j, "policies", pols);
        pols = NULL;
        rc = json_print(stdout, j, 0, CMD) ? -1 : 0;
    } else {
        cJSON_Delete(j);
    }
    cJSON_Delete(pols);
    return rc;
}

/* The scan over n_win windows of ids from o->first_window; 0 or -1. */
static int cal_scan(const cal_opts *o, const tqkv_model *m, const int32_t *ids, int n_win,
                    cal_table *t) {
    const int V = tqkv_model_get_config(m)->vocab_size, L = tqkv_model_get_config(m)->n_layers;
    t->n_own = 0;
    for (int l = 0; l < L && l < TQKV_MAX_KV_LAYERS; l++) {
        tqkv_layer_info li;
        if (tqkv_model_layer_info(m, l, &li) == TQKV_OK && li.kv_from == l) t->own[t->n_own++] = l;
    }
    if (!t->n_own) {
        fprintf(stderr, "tqkv calibrate: the model has no layer with a KV cache\n");
        return -1;
    }
    float *ref = malloc(sizeof(float) * (size_t)o->ctx * V); // [ctx, vocab]
    float *lg = malloc(sizeof(float) * (size_t)o->ctx * V);  // [ctx, vocab]
    int rc = ref && lg ? 0 : -1;
    if (rc) fprintf(stderr, "tqkv calibrate: out of memory\n");
    for (int w = 0; w < n_win && !rc; w++)
        rc = cal_scan_window(o, m, ids + (size_t)(o->first_window + w) * o->ctx, 1.0 / n_win,
                             ref, lg, t, w, n_win);
    free(ref);
    free(lg);
    return rc ? -1 : cal_bytes(o, m, t);
}

int cmd_calibrate(int argc, char **argv) {
    cal_opts o;
    int rc = cal_parse_args(argc, argv, &o);
    if (rc) return rc;
    rc = 1;
    char *text = NULL;
    size_t text_len = 0, n_ids = 0;
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    cal_table *t = calloc(1, sizeof *t);
    if (!t || mcli_read_file(CMD, o.text_path, &text, &text_len) ||
        mcli_load(CMD, o.dir, 0, 0, o.threads, &m))
        goto done;
    if (tqkv_tokenizer_load(&tok, o.dir) != TQKV_OK ||
        tqkv_tokenizer_encode(tok, text, text_len, 0, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv calibrate: %s\n", tqkv_last_error());
        goto done;
    }
    const long have = n_ids > 1 ? (long)((n_ids - 1) / (size_t)o.ctx) - o.first_window : 0;
    if (have < 1) {
        fprintf(stderr, "tqkv calibrate: the text has no window %d of %d tokens\n",
                o.first_window, o.ctx);
        goto done;
    }
    const int n_win = have < o.max_windows ? (int)have : o.max_windows;
    fprintf(stderr, "tqkv calibrate: %zu tokens, windows %d..%d of %d tokens, %d formats, "
            "window %d\n", n_ids, o.first_window, o.first_window + n_win - 1, o.ctx, o.n_fmt,
            o.window);
    if (cal_scan(&o, m, ids, n_win, t) || cal_emit(&o, m, t, ids, n_win)) goto done;
    rc = 0;
done:
    free(t);
    free(ids);
    free(text);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
    return rc;
}

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
 * --device-formats: only policies a --device cuda state takes: candidate formats fp8 (where
 * q8 would be), tq4, tq3, tq2; an upgrade moves a layer to any pair the device cache holds
 * (tq K bits >= V bits, fp8/fp8) with no fewer bits per plane; K and V windows only; the
 * check measures the preset a device state resolves.
 * Candidates (session 11): the choice is made once per ring in --try-windows (the q8 window
 * the formats must leave room for; with --try-keys-only each also as a keys-only window),
 * and the check measures every candidate and auto:B on the calibration windows and keeps
 * the best: a longer window can be worth more than the plane upgrades it displaces, which
 * the summed sensitivities (measured at one window) cannot tell.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cuda.h" /* tqkv_cuda_kv_formats_ok (inline: no device code) */
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
#define CAL_MAX_RINGS 16 /* candidate rings: windows x (K and V, keys only) */

/* A candidate q8 window: tokens, and whether it holds keys only. */
typedef struct {
    int window, keys_only;
} cal_ring;

typedef struct {
    const char *model_arg, *text_path, *out, *out_dir, *budgets, *formats, *try_windows;
    int ctx, max_windows, first_window, window, threads, json, no_check, try_keys_only;
    int device_formats; /* only pairs a device state holds (tqkv_cuda_kv_formats_ok) */
    int n_ring;
    cal_ring ring[CAL_MAX_RINGS]; /* ring[0]: --window, K and V */
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

/* With --device-formats: 1 when f is a format the device cache holds (fp8 or tq), else 0
 * with a message. */
static int cal_device_format(const cal_opts *o, tqkv_format f) {
    if (!o->device_formats || tqkv_cuda_kv_formats_ok(f, f)) return 1;
    fprintf(stderr, "tqkv calibrate: --device-formats: %s has no device cache (candidates: fp8, "
            "tq4, tq3, tq2; fp8 stands in for q8)\n", tqkv_format_name(f));
    return 0;
}

/* "a,b,c" of formats into o->fmt, sorted by bits (most first); 0 or -1 (message). The
 * default list: q8,tq4,tq3,tq2, or with --device-formats fp8,tq4,tq3,tq2. */
static int cal_parse_formats(cal_opts *o) {
    char buf[256];
    if (!o->formats) o->formats = o->device_formats ? "fp8,tq4,tq3,tq2" : "q8,tq4,tq3,tq2";
    snprintf(buf, sizeof buf, "%s", o->formats);
    o->n_fmt = 0;
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        tqkv_format k, v;
        if (o->n_fmt == CAL_MAX_FMT || tqkv_kv_spec_parse(t, &k, &v) != TQKV_OK || k != v) {
            fprintf(stderr, "tqkv calibrate: --formats '%s': up to %d single formats, e.g. "
                    "q8,tq4,tq3,tq2\n", o->formats, CAL_MAX_FMT);
            return -1;
        }
        if (!cal_device_format(o, k)) return -1;
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

/* Add ring {w, k} to o->ring unless there already; 0 or -1 when full. */
static int cal_add_ring(cal_opts *o, int w, int k) {
    for (int i = 0; i < o->n_ring; i++)
        if (o->ring[i].window == w && o->ring[i].keys_only == k) return 0;
    if (o->n_ring == CAL_MAX_RINGS) return -1;
    o->ring[o->n_ring++] = (cal_ring){w, k};
    return 0;
}

/* The candidate rings: --window (K and V) first, then each of --try-windows, each also keys
 * only with --try-keys-only; 0 or -1 (message). */
static int cal_parse_rings(cal_opts *o) {
    o->n_ring = 0;
    int bad = cal_add_ring(o, o->window, 0) ||
              (o->try_keys_only && o->window > 0 && cal_add_ring(o, o->window, 1));
    for (const char *s = o->try_windows ? o->try_windows : ""; *s && !bad;) {
        char *end;
        long w = strtol(s, &end, 10);
        bad = end == s || w < 1 || w > o->ctx || (*end && *end != ',') ||
              cal_add_ring(o, (int)w, 0) || (o->try_keys_only && cal_add_ring(o, (int)w, 1));
        s = *end ? end + 1 : end;
    }
    if (bad)
        fprintf(stderr, "tqkv calibrate: --try-windows '%s': windows in [1, --ctx], e.g. "
                "60,120 (at most %d candidates with --window and --try-keys-only)\n",
                o->try_windows, CAL_MAX_RINGS);
    return bad ? -1 : 0;
}

static int cal_parse_args(int argc, char **argv, cal_opts *o) {
    *o = (cal_opts){.model_arg = MCLI_DEFAULT_MODEL, .budgets = "4.25",
                    .ctx = 2048, .max_windows = 2,
                    .first_window = 64, .window = 30};
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--text", ARG_STR, &o->text_path, "calibration text (windows of --ctx tokens)"},
        {"--ctx", ARG_INT, &o->ctx, "window length in tokens, and the context bits are counted at (default 2048)"},
        {"--max-windows", ARG_INT, &o->max_windows, "calibration windows (default 2)"},
        {"--first-window", ARG_INT, &o->first_window, "first window used (default 64: keep clear of the windows `tqkv ppl` scores first)"},
        {"--window", ARG_INT, &o->window, "q8 window on the tq planes while measuring, and the least the policy keeps (default 30)"},
        {"--formats", ARG_STR, &o->formats, "candidate formats per plane (default q8,tq4,tq3,tq2; with --device-formats fp8,tq4,tq3,tq2)"},
        {"--device-formats", ARG_FLAG, &o->device_formats, "only per-layer K/V pairs a --device cuda state holds (tq4/tq4, tq3/tq3, fp8/fp8, tq K bits >= V bits; fp8 for q8), a K and V window: a policy the device takes"},
        {"--budget", ARG_STR, &o->budgets, "bits per value, or a comma list (default 4.25)"},
        {"--out", ARG_STR, &o->out, "policy file to write (one budget)"},
        {"--out-dir", ARG_STR, &o->out_dir, "write DIR/kv-policy-B.txt per budget B"},
        {"--threads", ARG_INT, &o->threads, "threads (default: all CPUs)"},
        {"--try-windows", ARG_STR, &o->try_windows, "more q8 windows to choose formats around, e.g. 60,120,240 (each candidate is measured; the best is kept)"},
        {"--try-keys-only", ARG_FLAG, &o->try_keys_only, "also try each window as a keys-only window (values from their format)"},
        {"--no-check", ARG_FLAG, &o->no_check, "do not measure the choice against auto:B on the calibration windows (keeps the --window candidate)"},
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
    if (o->device_formats && o->try_keys_only) {
        fprintf(stderr, "tqkv calibrate: --device-formats: the device holds K and V windows "
                "only; drop --try-keys-only\n");
        return 2;
    }
    if (cal_parse_formats(o) || cal_parse_budgets(o) || cal_parse_rings(o)) return 2;
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

/* t->bytes of every (layer, plane, format) with ring r: a plane at f with the other f32,
 * less half the all-f32 layer (what the layer costs beside its planes is split between
 * them). 0 or -1. */
static int cal_bytes(const cal_opts *o, const tqkv_model *m, cal_table *t, const cal_ring *r) {
    double b0[TQKV_MAX_KV_LAYERS], b[TQKV_MAX_KV_LAYERS];
    tqkv_model_state_params p = cal_params(o, -1, 0, TQKV_F32);
    p.threads = 1;
    p.window = r->window;
    p.window_keys_only = r->window > 0 && r->keys_only;
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

/* 1 when a layer may hold K at format index fk with V at fv: any pair, or with
 * --device-formats a pair the device cache holds. */
static int cal_pair_ok(const cal_opts *o, int fk, int fv) {
    return !o->device_formats || tqkv_cuda_kv_formats_ok(o->fmt[fk], o->fmt[fv]);
}

/* The upgrade of ch [n_own][2] with the largest loss drop per bit that fits B: layer *bi to
 * formats (*bk, *bv) of no fewer bits per plane. One plane at a time, or with
 * --device-formats any allowed pair (fp8/fp8 is no single step from tq4/tq4). *bi -1: none. */
static void cal_best_move(const cal_opts *o, const cal_table *t, double B, int ch[][2],
                          int *bi, int *bk, int *bv) {
    double best = 0;
    const double now = cal_bits(t, ch);
    *bi = -1;
    for (int i = 0; i < t->n_own; i++) {
        const int k0 = ch[i][0], v0 = ch[i][1];
        for (int fk = 0; fk <= k0; fk++)
            for (int fv = 0; fv <= v0; fv++) {
                if ((fk == k0 && fv == v0) || !cal_pair_ok(o, fk, fv)) continue;
                if (!o->device_formats && fk != k0 && fv != v0) continue; /* one plane */
                ch[i][0] = fk, ch[i][1] = fv;
                const double nb = cal_bits(t, ch);
                const double gain = t->kld[i][0][k0] - t->kld[i][0][fk] + t->kld[i][1][v0] -
                                    t->kld[i][1][fv];
                ch[i][0] = k0, ch[i][1] = v0;
                if (nb > B + 1e-9 || gain <= 0 || nb <= now) continue;
                if (gain / (nb - now) > best) best = gain / (nb - now), *bi = i, *bk = fk, *bv = fv;
            }
    }
}

/* Greedy choice within budget B into ch [n_own][2]; its predicted loss, or -1 when even the
 * cheapest formats do not fit. */
static double cal_choose(const cal_opts *o, const cal_table *t, double B, int ch[][2]) {
    for (int i = 0; i < t->n_own; i++) ch[i][0] = ch[i][1] = o->n_fmt - 1;
    if (cal_bits(t, ch) > B + 1e-9) return -1;
    for (;;) {
        int bi, bk = 0, bv = 0;
        cal_best_move(o, t, B, ch, &bi, &bk, &bv);
        if (bi < 0) break;
        ch[bi][0] = bk;
        ch[bi][1] = bv;
    }
    double loss = 0;
    for (int i = 0; i < t->n_own; i++) loss += t->kld[i][0][ch[i][0]] + t->kld[i][1][ch[i][1]];
    return loss;
}

/* Policy of choice ch: the most common K/V pair as kv, the other layers grouped by pair in
 * kv-layers. */
static void cal_policy(const cal_opts *o, const tqkv_model *m, const cal_table *t,
                       int ch[][2], const cal_ring *r, kv_policy *pol) {
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
    pol->window = r->window;
    pol->window_keys_only = r->window > 0 && r->keys_only;
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

/* Mean KLD from the f32 cache of each of params a [n] over the n_win calibration windows
 * into kld [n]. 0/-1. */
static int cal_compare(const cal_opts *o, const tqkv_model *m, const int32_t *ids, int n_win,
                       const tqkv_model_state_params *a, int n, double *kld) {
    const int V = tqkv_model_get_config(m)->vocab_size, ctx = o->ctx;
    float *ref = malloc(sizeof(float) * (size_t)ctx * V); // [ctx, vocab]
    float *lg = malloc(sizeof(float) * (size_t)ctx * V);  // [ctx, vocab]
    const tqkv_model_state_params rp = cal_params(o, -1, 0, TQKV_F32);
    int rc = ref && lg ? 0 : -1;
    for (int i = 0; i < n; i++) kld[i] = 0;
    for (int w = 0; w < n_win && !rc; w++) {
        const int32_t *tok = ids + (size_t)(o->first_window + w) * ctx;
        rc = cal_forward(m, &rp, tok, ctx, ref);
        if (!rc) cal_log_softmax(ref, ctx, V, o->threads);
        for (int i = 0; i < n && !rc; i++) {
            rc = cal_forward(m, &a[i], tok, ctx, lg);
            if (rc) break;
            cal_log_softmax(lg, ctx, V, o->threads);
            kld[i] += cal_kld(ref, lg, ctx, V, o->threads) / n_win;
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
    pol->window_keys_only = p->window > 0 && p->window_keys_only;
}

/* Measure the n candidates cand [n] and auto:B on the calibration windows; *pol becomes the
 * best of them (the preset's configuration when it measures best). *kp: the kept
 * candidate's KLD, *kr: the preset's; kc [n]: each candidate's. 0 or -1. */
static int cal_check(const cal_opts *o, const tqkv_model *m, const int32_t *ids, int n_win,
                     const kv_policy *cand, int n, double B, kv_policy *pol, double *kp,
                     double *kr, double *kc) {
    tqkv_model_state_params a[CAL_MAX_RINGS + 1];
    double kld[CAL_MAX_RINGS + 1];
    char desc[256], name[32];
    snprintf(name, sizeof name, "auto:%.6g", B);
    for (int i = 0; i <= n; i++) a[i] = cal_params(o, -1, 0, TQKV_F32);
    memset(a[n].layer_k, 0, sizeof a[n].layer_k);
    memset(a[n].layer_v, 0, sizeof a[n].layer_v);
    for (int i = 0; i < n; i++)
        if (kvpol_apply(CMD, m, &cand[i], o->ctx, &a[i], desc, sizeof desc)) return -1;
    a[n].device = o->device_formats; /* the preset a device state would take (measured here) */
    if (kvp_resolve(CMD, m, name, o->ctx, &a[n], desc, sizeof desc)) return -1;
    a[n].device = 0;
    if (cal_compare(o, m, ids, n_win, a, n + 1, kld)) return -1;
    int best = 0;
    for (int i = 0; i < n; i++) {
        kc[i] = kld[i];
        fprintf(stderr, "tqkv calibrate: %.4g bits: candidate %d (window %d%s) KLD %.5f on the "
                "calibration windows\n", B, i, cand[i].window,
                cand[i].window_keys_only ? ", keys only" : "", kld[i]);
        if (kld[i] < kld[best]) best = i;
    }
    *pol = cand[best];
    *kp = kld[best];
    *kr = kld[n];
    fprintf(stderr, "tqkv calibrate: %.4g bits: calibrated KLD %.5f (candidate %d), %s (%s) "
            "%.5f on the calibration windows\n", B, *kp, best, name, desc, *kr);
    if (*kr < *kp) {
        cal_policy_of(m, &a[n], pol);
        pol->bits = kvpol_bits(m, &a[n], o->ctx);
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
                     "with window %d, %d candidate ring(s); predicted KLD %.5f", o->max_windows,
                     o->first_window, o->text_path, o->ctx, o->window, o->n_ring, loss);
    if (!o->no_check && n > 0 && (size_t)n < sizeof c)
        snprintf(c + n, sizeof c - (size_t)n, "; measured KLD %.5f against auto:%g's %.5f%s", kp,
                 pol->budget, kr, kr < kp ? " (so this is the preset's configuration)" : "");
    int bad = !f || kvpol_write(f, pol, c);
    if ((f && fclose(f)) || bad) {
        fprintf(stderr, "tqkv calibrate: cannot write %s\n", path);
        return -1;
    }
    fprintf(stderr, "tqkv calibrate: wrote %s (kv %s, layers '%s', window %d%s, %.4f bits)\n",
            path, pol->kv, pol->kv_layers, pol->window,
            pol->window_keys_only ? " keys only" : "", pol->bits);
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

/* One candidate policy per ring within budget B into cand [o->n_ring] (rings where even the
 * cheapest formats do not fit are left out), their predicted losses into loss; the count,
 * or -1 (message) when none fits or a window cannot be grown. */
static int cal_candidates(const cal_opts *o, const tqkv_model *m, cal_table *t, double B,
                          kv_policy *cand, double *loss) {
    int n = 0;
    for (int r = 0; r < o->n_ring; r++) {
        int ch[TQKV_MAX_KV_LAYERS][2];
        if (cal_bytes(o, m, t, &o->ring[r])) return -1;
        const double l = cal_choose(o, t, B, ch);
        if (l < 0) {
            fprintf(stderr, "tqkv calibrate: window %d%s: the cheapest formats (%s) take %.4f "
                    "bits per value, over %.4g\n", o->ring[r].window,
                    o->ring[r].keys_only ? " (keys only)" : "",
                    tqkv_format_name(o->fmt[o->n_fmt - 1]), cal_bits(t, ch), B);
            continue;
        }
        cal_policy(o, m, t, ch, &o->ring[r], &cand[n]);
        if (cal_grow_window(o, m, &cand[n], B)) return -1;
        int dup = 0; /* grown windows may meet (window 30 keys only grows to 60) */
        for (int i = 0; i < n; i++)
            dup |= cand[i].window == cand[n].window && !strcmp(cand[i].kv, cand[n].kv) &&
                   cand[i].window_keys_only == cand[n].window_keys_only &&
                   !strcmp(cand[i].kv_layers, cand[n].kv_layers);
        if (!dup) loss[n++] = l;
    }
    return n ? n : -1;
}

/* The JSON entry of the policy kept for budget B (kp, kr: checked KLDs, NaN with
 * --no-check), with every candidate measured. */
static cJSON *cal_json_policy(const kv_policy *pol, double B, double loss, double kp, double kr,
                              const kv_policy *cand, const double *kc, int n) {
    cJSON *e = cJSON_CreateObject(), *a = cJSON_CreateArray();
    json_add_num(e, "budget", B, 4);
    cJSON_AddStringToObject(e, "kv", pol->kv);
    cJSON_AddStringToObject(e, "kv_layers", pol->kv_layers);
    cJSON_AddNumberToObject(e, "window", pol->window);
    cJSON_AddBoolToObject(e, "window_keys_only", pol->window_keys_only != 0);
    json_add_num(e, "kv_bits_per_value", pol->bits, 4);
    json_add_num(e, "predicted_kld", loss, 6);
    json_add_num(e, "checked_kld", kp, 6); /* null with --no-check */
    json_add_num(e, "checked_kld_preset", kr, 6);
    for (int i = 0; a && i < n; i++) {
        cJSON *c = cJSON_CreateObject();
        if (!c) break;
        cJSON_AddStringToObject(c, "kv", cand[i].kv);
        cJSON_AddStringToObject(c, "kv_layers", cand[i].kv_layers);
        cJSON_AddNumberToObject(c, "window", cand[i].window);
        cJSON_AddBoolToObject(c, "window_keys_only", cand[i].window_keys_only != 0);
        json_add_num(c, "kv_bits_per_value", cand[i].bits, 4);
        json_add_num(c, "checked_kld", kc[i], 6);
        cJSON_AddItemToArray(a, c);
    }
    cJSON_AddItemToObject(e, "candidates", a);
    return e;
}

/* Choose, write and report a policy per budget; 0 or -1. */
static int cal_emit(const cal_opts *o, const tqkv_model *m, cal_table *t, const int32_t *ids,
                    int n_win) {
    cJSON *j = cJSON_CreateObject(), *pols = cJSON_CreateArray();
    int rc = 0;
    for (int b = 0; b < o->n_budget && !rc; b++) {
        kv_policy cand[CAL_MAX_RINGS], pol;
        double loss[CAL_MAX_RINGS], kc[CAL_MAX_RINGS], kp = NAN, kr = NAN;
        const int n = cal_candidates(o, m, t, o->budget[b], cand, loss);
        if (n < 0) {
            rc = -1;
            break;
        }
        pol = cand[0];
        for (int i = 0; i < n; i++) kc[i] = NAN;
        if (!o->no_check && cal_check(o, m, ids, n_win, cand, n, o->budget[b], &pol, &kp, &kr, kc))
            rc = -1;
        double pl = loss[0];
        for (int i = 0; i < n; i++)
            if (cand[i].window == pol.window && cand[i].window_keys_only == pol.window_keys_only &&
                !strcmp(cand[i].kv_layers, pol.kv_layers))
                pl = loss[i];
        char path[4200];
        if (o->out_dir) snprintf(path, sizeof path, "%s/kv-policy-%g.txt", o->out_dir, o->budget[b]);
        if (!rc && (o->out || o->out_dir)) rc = cal_write(o, &pol, o->out ? o->out : path, pl, kp, kr);
        if (!rc && !o->out && !o->out_dir && !o->json) kvpol_write(stdout, &pol, NULL);
        cJSON_AddItemToArray(pols, cal_json_policy(&pol, o->budget[b], pl, kp, kr, cand, kc, n));
    }
    if (!rc) rc = cal_bytes(o, m, t, &o->ring[0]); /* the table's plane bits: --window */
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
    return rc;
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

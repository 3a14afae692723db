/*
 * kv_preset.c - `--kv auto:B` presets: the best measured KV configuration within B bits per
 * value (K and V averaged, everything counted at the context being run: scales, per-layer
 * mix, the q8 window ring, Gemma 4's bounded sliding layers; see mcli_kv_bits).
 * Owns: the ranked candidate table (measured on the held-out text, docs/QUALITY.md), the
 * resolution of a preset to formats + per-layer formats + window for one model and context,
 * and the preset rows of `tqkv formats --json`.
 * Must not: measure anything at run time (the ranking is data), or touch a cache.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_out.h"
#include "kv_policy.h"
#include "kv_preset.h"
#include "kv_shipped.h"
#include "model_cli.h"

// ---------------------------------------------------------------------------
// Candidates, best measured quality first (docs/QUALITY.md). layers: which layers take
// layer_kv instead of kv (0: none, 1: the first layer with its own K/V, 2: the first and
// the last such layer, "boundary").
// ---------------------------------------------------------------------------
typedef struct {
    const char *kv;
    int         layers;
    const char *layer_kv;
    int         window;
} kv_candidate;

static const kv_candidate RANK[] = {
    {"q8", 0, NULL, 0},
    {"fp8", 0, NULL, 0},
    {"q8/tq4", 0, NULL, 0},
    {"tq4", 0, NULL, 30},
    {"tq4", 0, NULL, 0},
    {"tq4/tq2", 0, NULL, 14},
    {"tq4/tq3", 2, "q8/tq3", 0},
    {"tq3", 0, NULL, 14},
    {"tq3", 0, NULL, 0},
    {"tq2", 0, NULL, 40},
    {"tq2", 0, NULL, 0},
};
#define N_RANK ((int)(sizeof RANK / sizeof RANK[0]))

/* The budgets `tqkv formats` lists (the targets); any B is accepted. */
static const double LISTED[] = {4.25, 3.25, 2.5};

int kvp_is_preset(const char *kv) { return kv && !strncmp(kv, "auto:", 5); }

/* "a,b" of the first / last layers with their own K/V into buf; "" when none. */
static void layer_set(const tqkv_model *m, int which, char *buf, size_t cap) {
    buf[0] = 0;
    if (!which) return;
    int first = -1, last = -1;
    for (int l = 0; l < tqkv_model_get_config(m)->n_layers; l++) {
        tqkv_layer_info li;
        if (tqkv_model_layer_info(m, l, &li) != TQKV_OK || li.kv_from != l) continue;
        if (first < 0) first = l;
        last = l;
    }
    if (first < 0) return;
    if (which == 1 || last == first) snprintf(buf, cap, "%d", first);
    else snprintf(buf, cap, "%d,%d", first, last);
}

/* Apply candidate c to p (formats, per-layer formats, window); 0 on success. */
static int apply(const tqkv_model *m, const kv_candidate *c, tqkv_model_state_params *p,
                 char *layers, size_t cap) {
    if (tqkv_kv_spec_parse(c->kv, &p->k_format, &p->v_format) != TQKV_OK) return -1;
    layer_set(m, c->layers, layers, cap);
    char spec[160] = "";
    if (layers[0]) snprintf(spec, sizeof spec, "%s:%s", layers, c->layer_kv);
    if (tqkv_kv_layers_parse(spec, p) != TQKV_OK) return -1;
    p->window = c->window;
    /* no extra ring slots: run and ppl never trim; the engine adds draft_tokens + 1 for
     * speculative rounds itself (and counts them) */
    if (c->window > 0) p->window_slack = 0;
    return 0;
}

/* Bits per value of candidate parameters t with window w at ctx tokens (mcli_kv_bits on a
 * CPU state of one row); -1 when no state can be made. */
static double window_bits(const tqkv_model *m, const tqkv_model_state_params *t, int w, int ctx) {
    tqkv_model_state_params c = *t;
    c.window = w;
    return mcli_params_bits(m, &c, ctx);
}

/* The window of candidate t at ctx within budget: its measured window w0 (ranked at ctx
 * 2048) when that fits, grown to the largest that fits (a longer context pays less per
 * window token, so the same bits buy a longer window: about w0 ctx / 2048 where the cache
 * is the whole context), else shrunk, down to w0 / 2. -1 when none fits; *bits: its bits,
 * *smallest: the least seen. */
static int window_fit(const tqkv_model *m, const tqkv_model_state_params *t, int w0, int ctx,
                      double budget, double *bits, double *smallest) {
    double b = window_bits(m, t, w0, ctx);
    if (b < 0) return -1;
    if (b < *smallest) *smallest = b;
    if (b <= budget + 1e-9) {
        *bits = b;
        if (w0 == 0) return 0;
        int lo = w0, hi = ctx; /* lo fits; a window past the context buys nothing */
        while (hi - lo > 1) {
            const int mid = lo + (hi - lo) / 2;
            const double bm = window_bits(m, t, mid, ctx);
            if (bm >= 0 && bm <= budget + 1e-9) lo = mid, *bits = bm;
            else hi = mid;
        }
        return lo;
    }
    for (int w = w0 - 1; w >= w0 / 2 && w > 0; w--) { /* the ring costs more on short contexts */
        b = window_bits(m, t, w, ctx);
        if (b < 0) return -1;
        if (b < *smallest) *smallest = b;
        if (b <= budget + 1e-9) {
            *bits = b;
            return w;
        }
    }
    return -1;
}

int kvp_resolve(const char *cmd, const tqkv_model *m, const char *kv, int ctx,
                tqkv_model_state_params *p, char *desc, size_t cap) {
    char *end;
    const double budget = strtod(kv + 5, &end);
    if (end == kv + 5 || *end || !(budget > 0)) {
        fprintf(stderr, "tqkv %s: --kv '%s': a preset is auto:B with B the bits per value "
                "(e.g. auto:4.25)\n", cmd, kv);
        return -1;
    }
    double smallest = 1e9;
    for (int i = 0; i < N_RANK; i++) {
        const kv_candidate *c = &RANK[i];
        tqkv_model_state_params t = *p;
        char layers[64];
        if (apply(m, c, &t, layers, sizeof layers)) continue;
        /* the device cache's pairs (tq with K bits >= V bits, fp8) on every layer */
        if (t.device && tqkv_kv_layers_device_check(m, &t, NULL) != TQKV_OK) continue;
        double bits = 0;
        const int w = window_fit(m, &t, c->window, ctx, budget, &bits, &smallest);
        if (w < 0 && smallest > 1e8) { /* no state could be made: say why, not "too big" */
            fprintf(stderr, "tqkv %s: --kv %s: %s\n", cmd, kv, tqkv_last_error());
            return -1;
        }
        if (w < 0) continue;
        t.window = w;
        *p = t;
        snprintf(desc, cap, "%s%s%s%s%s window %d (%.4f bits/value at ctx %d)", c->kv,
                 layers[0] ? " layers " : "", layers[0] ? layers : "", layers[0] ? ":" : "",
                 layers[0] ? c->layer_kv : "", w, bits, ctx);
        return 0;
    }
    fprintf(stderr, "tqkv %s: --kv %s: no configuration fits %.4g bits per value at ctx %d "
            "(the smallest takes %.4f)\n", cmd, kv, budget, ctx, smallest);
    return -1;
}

/* Policy file DIR/kv-policy-B<suffix>.txt applied to t within budget at ctx: 0 taken (desc
 * "policy PATH: spec"), 1 absent or not applicable here (why [cap]: "policy PATH not used:
 * REASON", "" when absent), -1 when it does not parse (message on stderr). */
static int policy_try(const char *cmd, const tqkv_model *m, const char *dir, const char *kv,
                      const char *suffix, double budget, int ctx, tqkv_model_state_params *p,
                      char *desc, size_t cap, char *why, size_t wcap) {
    char path[4200];
    snprintf(path, sizeof path, "%s/kv-policy-%s%s.txt", dir, kv + 5, suffix);
    why[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    fclose(f);
    kv_policy pol;
    if (kvpol_load(cmd, path, &pol)) return -1;
    if (!(pol.budget > 0) || pol.budget > budget) pol.budget = budget;
    char d[400];
    tqkv_model_state_params t = *p;
    if (kvpol_apply(cmd, m, &pol, ctx, &t, d, sizeof d) == 0) { /* device: device pairs only */
        *p = t;
        snprintf(desc, cap, "policy %s: %s", path, d);
        return 0;
    }
    fprintf(stderr, "tqkv %s: --kv %s: %s does not apply here; %sthe ranked presets decide\n",
            cmd, kv, path, *suffix ? "the plain policy, then " : "");
    char *r = strstr(d, " ("); /* kvpol_apply's reason, its explanation left on stderr */
    if (r) *r = 0;
    snprintf(why, wcap, "policy %s not used: %s", path, d);
    return 1;
}

int kvp_resolve_model(const char *cmd, const tqkv_model *m, const char *dir, const char *kv,
                      int ctx, tqkv_model_state_params *p, char *desc, size_t cap) {
    const double budget = strtod(kv + 5, NULL);
    if (!dir || p->tensor_parallel > 1 || !(budget > 0))
        return kvp_resolve(cmd, m, kv, ctx, p, desc, cap);
    /* a device state: the device policy kv-policy-B.device.txt first (CPU states never
     * read it), then kv-policy-B.txt, then the presets */
    const char *suffix[2] = {".device", ""};
    char why[2][4700] = {"", ""}, r[256]; /* "policy PATH not used: REASON" */
    char shipped[1024]; /* a longer shipped folder is not found (kvship_find) */
    const char *pdir = kvship_policy_dir(dir, kv + 5, p->device, shipped, sizeof shipped);
    for (int i = p->device ? 0 : 1; i < 2; i++) {
        const int rc = policy_try(cmd, m, pdir, kv, suffix[i], budget, ctx, p, desc, cap,
                                  why[i], sizeof why[i]);
        if (rc < 0) return rc;
        if (rc == 0 && i == 1 && p->device && why[0][0]) { /* the .device file did not apply */
            const size_t n = strlen(desc);
            snprintf(desc + n, cap - n, " (%s)", why[0]);
        }
        if (rc == 0) return 0;
    }
    if (kvp_resolve(cmd, m, kv, ctx, p, r, sizeof r)) return -1;
    const int n0 = why[0][0] != 0, n1 = why[1][0] != 0;
    snprintf(desc, cap, "%s%s%s%s%s%s", r, n0 || n1 ? " (" : "", why[0], n0 && n1 ? "; " : "",
             why[1], n0 || n1 ? ")" : "");
    return 0;
}

/* Bits of candidate c (its full window) on a uniform graph: L layers of head_dim dim, all with their own K/V,
 * ctx tokens, window slack `slack`. */
static double generic_bits(const kv_candidate *c, int L, int dim, int ctx, int slack) {
    tqkv_format k, v, lk = TQKV_F32, lv = TQKV_F32;
    tqkv_kv_spec_parse(c->kv, &k, &v);
    if (c->layer_kv) tqkv_kv_spec_parse(c->layer_kv, &lk, &lv);
    const int nb = c->layers == 2 ? 2 : c->layers;
    double bits = 0;
    for (int l = 0; l < L; l++) {
        const int over = (nb >= 1 && l == 0) || (nb == 2 && l == L - 1);
        const tqkv_format fk = over ? lk : k, fv = over ? lv : v;
        bits += 0.5 * (tqkv_format_bits_per_value(fk, dim) + tqkv_format_bits_per_value(fv, dim));
        if (c->window > 0) {
            const int ring = c->window + slack < ctx ? c->window + slack : ctx;
            const int planes = tqkv_format_is_tq(fk) + tqkv_format_is_tq(fv);
            bits += 0.5 * planes * 8.0 * (double)tqkv_format_bytes(TQKV_Q8, dim) / dim * ring / ctx;
        }
    }
    return bits / L;
}

int kvp_list_json(cJSON *arr, int dim) {
    const int L = 8, ctx = 2048, slack = 0;
    for (size_t b = 0; b < sizeof LISTED / sizeof LISTED[0]; b++) {
        for (int i = 0; i < N_RANK; i++) {
            kv_candidate c = RANK[i];
            double bits = generic_bits(&c, L, dim, ctx, slack);
            if (bits > LISTED[b] + 1e-9) continue;
            while (c.window > 0 && c.window < ctx) { /* grown as kvp_resolve grows it */
                kv_candidate g = c;
                g.window++;
                const double gb = generic_bits(&g, L, dim, ctx, slack);
                if (gb > LISTED[b] + 1e-9) break;
                c = g, bits = gb;
            }
            cJSON *o = cJSON_CreateObject();
            if (!o) return -1;
            char name[32];
            snprintf(name, sizeof name, "auto:%g", LISTED[b]);
            cJSON_AddStringToObject(o, "preset", name);
            cJSON_AddStringToObject(o, "kv", c.kv);
            cJSON_AddStringToObject(o, "layers", c.layers == 2 ? "first,last"
                                                 : c.layers == 1 ? "first" : "");
            cJSON_AddStringToObject(o, "layer_kv", c.layer_kv ? c.layer_kv : "");
            cJSON_AddNumberToObject(o, "window", c.window);
            cJSON_AddNumberToObject(o, "dim", dim);
            json_add_num(o, "bits_per_value", bits, 4);
            cJSON_AddStringToObject(o, "bits_at", "8 layers with their own K/V, ctx 2048, "
                                                  "window slack 0");
            cJSON_AddItemToArray(arr, o);
            break;
        }
    }
    return 0;
}

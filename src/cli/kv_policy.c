/*
 * kv_policy.c - KV policy files (format in kv_policy.h): parse, write, apply to a model's
 * state params with the checks a policy needs (layer count, layers named, budget).
 * Owns: the policy text format. Must not: measure anything or touch a cache's contents.
 */
#include "kv_policy.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_cli.h"

// ---------------------------------------------------------------------------
// Parse
// ---------------------------------------------------------------------------

enum { K_LAYERS, K_KV, K_KVL, K_WINDOW, K_WPLANES, K_BUDGET, K_CTX, K_BITS, K_N };
static const char *KEYS[K_N] = {"layers",       "kv",     "kv-layers", "window",
                                "window-planes", "budget", "ctx",       "bits"};

/* An int in [lo, hi] from s (whole string); 1 on success. */
static int read_int(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi) return 0;
    *out = (int)v;
    return 1;
}

/* A positive finite double from s (whole string); 1 on success. */
static int read_pos(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > 0 && v < 1e6)) return 0;
    *out = v;
    return 1;
}

/* Value val of key k into pol; 1 on success. */
static int set_key(kv_policy *pol, int k, const char *val) {
    tqkv_model_state_params t = tqkv_model_state_params_default();
    tqkv_format a, b;
    switch (k) {
    case K_LAYERS: return read_int(val, 1, TQKV_MAX_KV_LAYERS, &pol->layers);
    case K_KV:
        if (strlen(val) >= sizeof pol->kv || tqkv_kv_spec_parse(val, &a, &b) != TQKV_OK) return 0;
        snprintf(pol->kv, sizeof pol->kv, "%s", val);
        return 1;
    case K_KVL:
        if (strlen(val) >= sizeof pol->kv_layers || tqkv_kv_layers_parse(val, &t) != TQKV_OK)
            return 0;
        snprintf(pol->kv_layers, sizeof pol->kv_layers, "%s", val);
        return 1;
    case K_WINDOW: return read_int(val, 0, 1 << 20, &pol->window);
    case K_WPLANES: /* which tq planes keep the q8 window: "kv" (both) or "k" (keys only) */
        if (strcmp(val, "kv") && strcmp(val, "k")) return 0;
        pol->window_keys_only = !strcmp(val, "k");
        return 1;
    case K_BUDGET: return read_pos(val, &pol->budget);
    case K_CTX: return read_int(val, 1, 1 << 24, &pol->ctx);
    case K_BITS: return read_pos(val, &pol->bits);
    }
    return 0;
}

/* Trim line [s, e) of comment and blanks into buf [cap]; its length, or cap when it does
 * not fit (nothing copied: a long line is refused, never cut). */
static size_t clean_line(const char *s, const char *e, char *buf, size_t cap) {
    const char *h = memchr(s, '#', (size_t)(e - s));
    if (h) e = h;
    while (s < e && isspace((unsigned char)*s)) s++;
    while (e > s && isspace((unsigned char)e[-1])) e--;
    const size_t n = (size_t)(e - s);
    if (n >= cap) return cap;
    memcpy(buf, s, n);
    buf[n] = 0;
    return n;
}

int kvpol_parse(const char *text, kv_policy *out, char *err, size_t cap) {
    kv_policy pol = {0};
    int seen[K_N] = {0}, version = 0, line = 0;
    tqkv_clear_error();
    for (const char *s = text; *s;) {
        const char *e = strchr(s, '\n');
        if (!e) e = s + strlen(s);
        char buf[640], *val;
        line++;
        size_t n = clean_line(s, e, buf, sizeof buf);
        s = *e ? e + 1 : e;
        if (n == sizeof buf)
            return snprintf(err, cap, "line %d is longer than %zu characters", line, sizeof buf - 1), -1;
        if (!n) continue;
        val = buf + strcspn(buf, " \t");
        if (*val) *val++ = 0;
        while (isspace((unsigned char)*val)) val++;
        if (!version) {
            if (strcmp(buf, "tqkv-kv-policy") || !read_int(val, 1, 1 << 20, &version))
                return snprintf(err, cap, "not a KV policy: the first line must be "
                                "'tqkv-kv-policy %d' (line %d)", KVPOL_VERSION, line), -1;
            if (version != KVPOL_VERSION)
                return snprintf(err, cap, "KV policy version %d, this build reads %d (line %d)",
                                version, KVPOL_VERSION, line), -1;
            continue;
        }
        int k = 0;
        while (k < K_N && strcmp(buf, KEYS[k])) k++;
        if (k == K_N) return snprintf(err, cap, "unknown key '%s' (line %d)", buf, line), -1;
        if (seen[k]) return snprintf(err, cap, "key '%s' given twice (line %d)", buf, line), -1;
        seen[k] = 1;
        if (!set_key(&pol, k, val))
            return snprintf(err, cap, "bad value '%s' for '%s' (line %d)%s%s", val, buf, line,
                            tqkv_last_error()[0] ? ": " : "", tqkv_last_error()), -1;
    }
    if (!version) return snprintf(err, cap, "empty KV policy"), -1;
    if (!seen[K_LAYERS] || !seen[K_KV])
        return snprintf(err, cap, "KV policy lacks '%s'", seen[K_LAYERS] ? "kv" : "layers"), -1;
    *out = pol;
    return 0;
}

int kvpol_load(const char *cmd, const char *path, kv_policy *out) {
    char *text = NULL, err[256];
    size_t len = 0;
    if (mcli_read_file(cmd, path, &text, &len)) return -1;
    int rc = strlen(text) != len ? (snprintf(err, sizeof err, "NUL byte in the file"), -1)
                                 : kvpol_parse(text, out, err, sizeof err);
    free(text);
    if (rc) fprintf(stderr, "tqkv %s: --kv-policy %s: %s\n", cmd, path, err);
    return rc;
}

// ---------------------------------------------------------------------------
// Write and apply
// ---------------------------------------------------------------------------

int kvpol_write(FILE *f, const kv_policy *pol, const char *comment) {
    fprintf(f, "tqkv-kv-policy %d\n", KVPOL_VERSION);
    if (comment) fprintf(f, "# %s\n", comment);
    fprintf(f, "layers %d\nkv %s\nkv-layers %s\nwindow %d\n", pol->layers, pol->kv,
            pol->kv_layers, pol->window);
    if (pol->window_keys_only) fprintf(f, "window-planes k\n"); /* older readers: K and V */
    if (pol->budget > 0) fprintf(f, "budget %.6g\n", pol->budget);
    if (pol->ctx > 0) fprintf(f, "ctx %d\n", pol->ctx);
    if (pol->bits > 0) fprintf(f, "bits %.4f\n", pol->bits);
    return ferror(f) ? -1 : 0;
}

double kvpol_bits(const tqkv_model *m, const tqkv_model_state_params *t, int ctx) {
    tqkv_model_state_params c = *t;
    c.tensor_parallel = 0; /* one state holds every layer's planes */
    return mcli_params_bits(m, &c, ctx);
}

/* A refusal of kvpol_apply: the message on stderr ("tqkv CMD: ...") and in desc [cap]; -1. */
static int apply_fail(const char *cmd, char *desc, size_t cap, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "tqkv %s: %s\n", cmd, msg);
    if (cap) snprintf(desc, cap, "%s", msg);
    return -1;
}

/* A device state (t->device) takes the policy when every layer's pair is a device pair (or
 * f32/f32) and its window holds K and V; 0, or -1 (apply_fail). */
static int apply_device_check(const char *cmd, const tqkv_model *m,
                              const tqkv_model_state_params *t, char *desc, size_t cap) {
    if (!t->device) return 0;
    if (t->window_keys_only)
        return apply_fail(cmd, desc, cap, "KV policy: its keys-only q8 window (window-planes k) "
                          "runs on the CPU only");
    if (tqkv_kv_layers_device_check(m, t, NULL) != TQKV_OK)
        return apply_fail(cmd, desc, cap, "KV policy: %s", tqkv_last_error());
    return 0;
}

int kvpol_apply(const char *cmd, const tqkv_model *m, const kv_policy *pol, int ctx,
                tqkv_model_state_params *p, char *desc, size_t cap) {
    const int L = tqkv_model_get_config(m)->n_layers;
    if (pol->layers != L)
        return apply_fail(cmd, desc, cap, "KV policy is for a model of %d layers, this one "
                          "has %d", pol->layers, L);
    tqkv_model_state_params t = *p;
    if (tqkv_kv_spec_parse(pol->kv, &t.k_format, &t.v_format) != TQKV_OK ||
        tqkv_kv_layers_parse(pol->kv_layers, &t) != TQKV_OK)
        return apply_fail(cmd, desc, cap, "KV policy: %s", tqkv_last_error());
    for (int l = L; l < TQKV_MAX_KV_LAYERS; l++)
        if (t.layer_k[l] || t.layer_v[l])
            return apply_fail(cmd, desc, cap, "KV policy names layer %d, the model has %d", l, L);
    t.window = pol->window;
    t.window_keys_only = pol->window > 0 && pol->window_keys_only;
    if (pol->window > 0) t.window_slack = 0; /* as the presets: run and ppl never trim */
    if (apply_device_check(cmd, m, &t, desc, cap)) return -1;
    const double bits = kvpol_bits(m, &t, ctx);
    if (bits < 0) return apply_fail(cmd, desc, cap, "KV policy: %s", tqkv_last_error());
    if (pol->budget > 0 && bits > pol->budget + 1e-9)
        return apply_fail(cmd, desc, cap, "KV policy takes %.4f bits per value at ctx %d, over "
                          "its budget %.4g", bits, ctx, pol->budget);
    *p = t;
    snprintf(desc, cap, "%s%s%s window %d%s (%.4f bits/value at ctx %d)", pol->kv,
             pol->kv_layers[0] ? " layers " : "", pol->kv_layers, pol->window,
             t.window_keys_only ? " (keys only)" : "", bits, ctx);
    return 0;
}

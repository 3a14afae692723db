/*
 * cmd_kv_error.c - `tqkv kv-error --model DIR --text FILE [--ctx 2048] [--window-index 0]
 * [--kv tq4,tq3,fp8,q8] [--json]`: per layer, the reconstruction error of the model's real
 * K and V under each KV format (fidelity diagnostics, issue 23: where does a graph's error
 * come from).
 * Owns: one f32-cache prefill of one window of the text, the capture of every layer that
 * holds its own K/V, the encode/decode of those vectors with the cache's codec (seed
 * kv_seed + layer, as the cache uses) and the error summary.
 * Must not: contain codec or model logic (asks libtqkv).
 *
 * Figures per (layer, format): relative MSE sum ||x - x^||^2 / sum ||x||^2 for K and for V,
 * and the keys' outlier ratio max / median over channels of the per-channel RMS (over
 * tokens and heads). A Gemma 4 sliding layer holds its newest window + slack tokens after
 * the prefill: those are measured.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "kv-error";

/* Relative MSE of n vectors x [n, d] through format f (seed); -1 on error. */
static double rel_mse(const float *x, size_t n, int d, tqkv_format f, uint64_t seed) {
    tqkv_codec *c = NULL;
    if (tqkv_codec_init(&c, f, d, seed) != TQKV_OK) return -1;
    const size_t B = tqkv_codec_bytes(c);
    uint8_t *e = malloc(B * n);
    float *y = malloc(sizeof(float) * n * (size_t)d);
    double num = 0, den = 0;
    if (e && y && tqkv_codec_encode(c, x, n, e) == TQKV_OK && tqkv_codec_decode(c, e, n, y) == TQKV_OK) {
        for (size_t i = 0; i < n * (size_t)d; i++) {
            const double dx = (double)x[i] - y[i];
            num += dx * dx;
            den += (double)x[i] * x[i];
        }
    } else {
        num = -1;
    }
    free(e);
    free(y);
    tqkv_codec_free(c);
    return num < 0 || den <= 0 ? -1 : num / den;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* max / median over channels of per-channel RMS of x [n, d]. */
static double outlier_ratio(const float *x, size_t n, int d) {
    double *r = calloc((size_t)d, sizeof(double));
    if (!r || !n) { free(r); return 0; }
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < d; j++) r[j] += (double)x[i * d + j] * x[i * d + j];
    double mx = 0;
    for (int j = 0; j < d; j++) {
        r[j] = sqrt(r[j] / (double)n);
        if (r[j] > mx) mx = r[j];
    }
    qsort(r, (size_t)d, sizeof(double), cmp_double);
    const double med = 0.5 * (r[(d - 1) / 2] + r[d / 2]);
    free(r);
    return med > 0 ? mx / med : 0;
}

int cmd_kv_error(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *text_path = NULL, *kvlist = "tq4,tq3,fp8,q8";
    int ctx = 2048, widx = 0, threads = 0, json = 0;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--text", ARG_STR, &text_path, "text file"},
        {"--ctx", ARG_INT, &ctx, "window length in tokens (default 2048)"},
        {"--window-index", ARG_INT, &widx, "which window of the text (default 0)"},
        {"--kv", ARG_STR, &kvlist, "comma list of formats (default tq4,tq3,fp8,q8)"},
        {"--threads", ARG_INT, &threads, "threads (default: all CPUs)"},
        {"--json", ARG_FLAG, &json, "end with a JSON summary line"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!text_path || ctx < 2 || widx < 0 || threads < 0) {
        fprintf(stderr, "tqkv kv-error: --text is required, --ctx >= 2\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    tqkv_format fmts[16];
    int nf = 0;
    {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", kvlist);
        for (char *t = strtok(buf, ","); t && nf < 16; t = strtok(NULL, ",")) {
            if (tqkv_format_parse(t, &fmts[nf]) != TQKV_OK) {
                fprintf(stderr, "tqkv kv-error: %s\n", tqkv_last_error());
                return 2;
            }
            nf++;
        }
    }
    if (threads == 0) threads = mcli_cpus();
    char dir[4096];
    if (!mcli_resolve_model(CMD, model_arg, dir, sizeof dir)) return 1;
    int rc = 1;
    char *text = NULL;
    size_t text_len = 0, n_ids = 0;
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    tqkv_model_state *s = NULL;
    int32_t *ids = NULL;
    float *lg = NULL, *K = NULL, *V = NULL;
    cJSON *arr = json ? cJSON_CreateArray() : NULL;
    if (mcli_read_file(CMD, text_path, &text, &text_len)) goto done;
    if (mcli_load_dev(CMD, dir, 0, 0, threads, 0, &m)) goto done;
    if (tqkv_tokenizer_load(&tok, dir) != TQKV_OK ||
        tqkv_tokenizer_encode(tok, text, text_len, 0, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv kv-error: %s\n", tqkv_last_error());
        goto done;
    }
    if ((size_t)ctx * (widx + 1) > n_ids) {
        fprintf(stderr, "tqkv kv-error: text too short for window %d of %d tokens\n", widx, ctx);
        goto done;
    }
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.threads = threads;
    lg = malloc(sizeof(float) * (size_t)tqkv_model_get_config(m)->vocab_size);
    if (!lg || tqkv_model_state_init(&s, m, &sp) != TQKV_OK ||
        tqkv_model_prefill(m, s, ids + (size_t)ctx * widx, NULL, ctx, TQKV_LOGITS_LAST, lg) != TQKV_OK) {
        fprintf(stderr, "tqkv kv-error: %s\n", tqkv_last_error());
        goto done;
    }
    printf("layer tokens  K outl |");
    for (int f = 0; f < nf; f++) printf(" K %-5s V %-5s |", tqkv_format_name(fmts[f]), tqkv_format_name(fmts[f]));
    printf("   (relative MSE)\n");
    for (int l = 0; l < tqkv_model_get_config(m)->n_layers; l++) {
        tqkv_layer_info li;
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (!b || tqkv_model_layer_info(m, l, &li) != TQKV_OK || li.kv_from != l) continue;
        const tqkv_cache_config *c = tqkv_batch_get_config(b);
        const int cols = tqkv_batch_columns(b), H = c->kv_heads, d = c->head_dim;
        int off = 0, lp = 0;
        free(K);
        free(V);
        K = malloc(sizeof(float) * (size_t)H * cols * d + 1);
        V = malloc(sizeof(float) * (size_t)H * cols * d + 1);
        if (!K || !V || tqkv_batch_capture(b, K, V, &off, &lp) != TQKV_OK) {
            fprintf(stderr, "tqkv kv-error: %s\n", tqkv_last_error());
            goto done;
        }
        /* [H, cols, d] -> the off tokens of every head, packed [H * off, d] */
        for (int h = 0; h < H; h++) {
            memmove(K + (size_t)h * off * d, K + ((size_t)h * cols + lp) * d, sizeof(float) * (size_t)off * d);
            memmove(V + (size_t)h * off * d, V + ((size_t)h * cols + lp) * d, sizeof(float) * (size_t)off * d);
        }
        const size_t n = (size_t)H * off;
        const double outl = outlier_ratio(K, n, d);
        printf("%5d %6d %7.2f |", l, off, outl);
        cJSON *o = arr ? cJSON_CreateObject() : NULL;
        if (o) {
            cJSON_AddNumberToObject(o, "layer", l);
            cJSON_AddNumberToObject(o, "tokens", off);
            cJSON_AddNumberToObject(o, "head_dim", d);
            json_add_num(o, "k_outlier_ratio", outl, 3);
        }
        for (int f = 0; f < nf; f++) {
            const double ek = rel_mse(K, n, d, fmts[f], sp.kv_seed + (uint64_t)l);
            const double ev = rel_mse(V, n, d, fmts[f], sp.kv_seed + (uint64_t)l);
            printf(" %7.5f %7.5f |", ek, ev);
            if (o) {
                char key[64];
                snprintf(key, sizeof key, "k_rel_mse_%s", tqkv_format_name(fmts[f]));
                json_add_num(o, key, ek, 6);
                snprintf(key, sizeof key, "v_rel_mse_%s", tqkv_format_name(fmts[f]));
                json_add_num(o, key, ev, 6);
            }
        }
        printf("\n");
        if (o) cJSON_AddItemToArray(arr, o);
    }
    if (arr) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "model", dir);
        cJSON_AddNumberToObject(root, "ctx", ctx);
        cJSON_AddNumberToObject(root, "window_index", widx);
        cJSON_AddItemToObject(root, "layers", arr);
        arr = NULL;
        if (json_print(stdout, root, 0, CMD)) goto done;
    }
    rc = 0;
done:
    cJSON_Delete(arr);
    free(K);
    free(V);
    free(lg);
    free(ids);
    free(text);
    tqkv_model_state_free(s);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
    return rc;
}

/*
 * cmd_bench_model.c - `tqkv bench model`: prefill and decode tokens per second of the model
 * for every (context, KV format) pair in one run.
 * Owns: the benchmark loop, its table and --json array.
 * Must not: contain model or cache logic.
 *
 * For each ctx and KV format: a fresh state, prefill ctx tokens (pp t/s = ctx / time), then
 * --gen greedy decode steps at that depth (tg t/s = gen / time). Token ids are a fixed
 * pseudo-random sequence (speed does not depend on the text). Best of --reps rounds;
 * each round measures every configuration once, so noise spreads evenly.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "model_cli.h"
#include "tqkv_model.h"

static const char *CMD = "bench model";

/* Split "a,b,c" into items (pointers into a strdup'd copy); -1 if more than cap. */
static int split_list(char *s, char **items, int cap) {
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == cap) return -1;
        items[n++] = tok;
    }
    return n;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One configuration: fresh state, prefill ctx tokens per row (all rows share one
 * left-padded prefill), then gen greedy decode steps. Returns nonzero on failure. */
static int measure(const tqkv_model *m, const tqkv_model_state_params *sp, const int32_t *tok,
                   int ctx, int rows, int gen, float *logits, double *pp, double *tg,
                   double *bpt) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, m, sp) != TQKV_OK) return 1;
    int32_t *pt = malloc(sizeof(int32_t) * (size_t)ctx * rows); // [rows, ctx]
    if (!pt) {
        tqkv_model_state_free(s);
        return 1;
    }
    for (int r = 0; r < rows; r++) memcpy(pt + (size_t)r * ctx, tok, sizeof(int32_t) * ctx);
    double t0 = mcli_now();
    tqkv_status st = tqkv_model_prefill(m, s, pt, NULL, ctx, TQKV_LOGITS_LAST, logits);
    double tp = mcli_now() - t0, td = 0;
    free(pt);
    for (int g = 0; g < gen && st == TQKV_OK; g++) {
        int32_t next[64]; // [rows], rows <= 64
        for (int r = 0; r < rows; r++) next[r] = argmax(logits + (size_t)r * V, V);
        t0 = mcli_now();
        st = tqkv_model_decode(m, s, next, logits);
        td += mcli_now() - t0;
    }
    *pp = (double)ctx * rows / tp;
    *tg = (double)gen * rows / td;
    *bpt = tqkv_model_state_kv_bytes_per_token(s);
    tqkv_model_state_free(s);
    return st != TQKV_OK;
}

int cmd_bench_model(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *ctx_list = "512,4096",
               *kv_list = "f32,f16,q8,tq4,tq3", *prefill_kernel = "graph",
               *decode_kernel = "graph", *device = "cpu";
    int threads = 2, gen = 64, json = 0, window = 0, reps = 3, blas = 0, f32w = 0, rows = 1;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--ctx", ARG_STR, &ctx_list, "comma-separated prefill lengths (default 512,4096)"},
        {"--kv", ARG_STR, &kv_list, "comma-separated KV formats (default f32,f16,q8,tq4,tq3)"},
        {"--threads", ARG_INT, &threads, "threads (default 2)"},
        {"--gen", ARG_INT, &gen, "decode steps after the prefill (default 64)"},
        {"--window", ARG_INT, &window, "q8 recent window of tq caches (default 0)"},
        {"--rows", ARG_INT, &rows, "rows decoded together (default 1; prefill is per row)"},
        {"--reps", ARG_INT, &reps, "rounds over all configurations, best kept (default 3)"},
        {"--prefill-kernel", ARG_STR, &prefill_kernel, "attention kernel for prefill: graph (the graph's kernel set, default), dense, deferred, fused"},
        {"--decode-kernel", ARG_STR, &decode_kernel, "attention kernel for decode: graph (default), dense, deferred, fused"},
        {"--blas", ARG_FLAG, &blas, "OpenBLAS sgemm for prefill matmuls (not batch invariant)"},
        {"--f32-weights", ARG_FLAG, &f32w, "convert weights to f32 at load"},
        {"--device", ARG_STR, &device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--json", ARG_FLAG, &json, "print a JSON array of results on stdout"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (threads < 1 || gen < 1 || reps < 1 || window < 0 || rows < 1 || rows > 64) {
        fprintf(stderr, "tqkv bench model: --threads, --gen, --reps, --rows must be >= 1 (rows <= 64)\n");
        return 2;
    }
    tqkv_kernel pk, dk;
    int dev = 0;
    if (mcli_parse_kernel(CMD, prefill_kernel, &pk) || mcli_parse_kernel(CMD, decode_kernel, &dk) ||
        mcli_parse_device(CMD, device, &dev))
        return 2;
    char *ctx_copy = strdup(ctx_list), *kv_copy = strdup(kv_list);
    if (!ctx_copy || !kv_copy) {
        fprintf(stderr, "tqkv bench model: out of memory\n");
        free(ctx_copy);
        free(kv_copy);
        return 1;
    }
    char *ctx_items[32], *kv_items[32];
    int n_ctx = split_list(ctx_copy, ctx_items, 32), n_kv = split_list(kv_copy, kv_items, 32);
    int ctxs[32];
    tqkv_format kf[32], vf[32];
    int bad = n_ctx <= 0 || n_kv <= 0;
    if (bad) fprintf(stderr, "tqkv bench model: --ctx and --kv take 1 to 32 comma-separated items\n");
    for (int i = 0; i < n_ctx && !bad; i++) {
        char *end = NULL;
        long v = strtol(ctx_items[i], &end, 10);
        ctxs[i] = (end && !*end && v >= 1 && v <= 1 << 20) ? (int)v : 0;
        if (ctxs[i] < 1) {
            fprintf(stderr, "tqkv bench model: bad --ctx item '%s'\n", ctx_items[i]);
            bad = 1;
        }
    }
    for (int i = 0; i < n_kv && !bad; i++) bad = mcli_parse_kv(CMD, kv_items[i], &kf[i], &vf[i]) != 0;
    char dir[4096];
    tqkv_model *m = NULL;
    if (bad || !mcli_resolve_model(CMD, model_arg, dir, sizeof dir) ||
        mcli_load_dev(CMD, dir, blas, f32w, threads, dev, &m)) {
        free(ctx_copy);
        free(kv_copy);
        return bad ? 2 : 1;
    }
    const int V = tqkv_model_get_config(m)->vocab_size;
    int max_ctx = 1;
    for (int i = 0; i < n_ctx; i++) max_ctx = ctxs[i] > max_ctx ? ctxs[i] : max_ctx;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)max_ctx);
    float *logits = malloc(sizeof(float) * (size_t)V * rows); // [rows, vocab]
    if (!tok || !logits) {
        fprintf(stderr, "tqkv bench model: out of memory\n");
        free(tok);
        free(logits);
        free(ctx_copy);
        free(kv_copy);
        tqkv_model_free(m);
        return 1;
    }
    uint64_t z = 12345;
    for (int i = 0; i < max_ctx; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((z >> 33) % (uint64_t)V);
    }
    { /* "graph": the graph's kernel set, resolved here so the header names it */
        tqkv_kernel gp, gd;
        tqkv_model_kernel_set(m, NULL, &gp, &gd);
        if (pk == TQKV_KERNEL_BY_GRAPH) pk = gp;
        if (dk == TQKV_KERNEL_BY_GRAPH) dk = gd;
    }
    fprintf(stderr, "tqkv bench model: %s weights, %d threads, gen %d, rows %d, prefill kernel %s, "
            "decode kernel %s%s\n", tqkv_model_weight_type(m), threads, gen, rows,
            tqkv_kernel_name(pk), tqkv_kernel_name(dk), blas ? ", blas" : "");
    /* the table is the progress display: on stderr when stdout carries JSON */
    FILE *tab = json ? stderr : stdout;
    fprintf(tab, "%-8s %-10s %12s %12s %14s\n", "ctx", "kv", "pp t/s", "tg t/s", "kv B/token");
    /* warm-up: map the weights in */
    {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.threads = threads;
        sp.device = dev;
        tqkv_model_state *s = NULL;
        if (tqkv_model_state_init(&s, m, &sp) == TQKV_OK)
            tqkv_model_prefill(m, s, tok, NULL, max_ctx < 64 ? max_ctx : 64, TQKV_LOGITS_LAST, logits);
        tqkv_model_state_free(s);
    }
    /* Repetitions are the outer loop, so every configuration is measured once per round
     * and machine noise spreads over all of them alike; the best round is kept. */
    int rc = 0;
    double best_pp[32 * 32] = {0}, best_tg[32 * 32] = {0}, bpt[32 * 32] = {0};
    for (int r = 0; r < reps && !rc; r++) {
        if (reps > 1) fprintf(stderr, "tqkv bench model: round %d/%d\n", r + 1, reps);
        for (int c = 0; c < n_ctx && !rc; c++)
            for (int k = 0; k < n_kv && !rc; k++) {
                tqkv_model_state_params sp = tqkv_model_state_params_default();
                sp.rows = rows;
                sp.k_format = kf[k];
                sp.v_format = vf[k];
                sp.window = window;
                sp.threads = threads;
                sp.prefill_kernel = pk;
                sp.decode_kernel = dk;
                sp.blas = blas;
                sp.device = dev;
                double pp = 0, tg = 0;
                int i = c * 32 + k;
                if (measure(m, &sp, tok, ctxs[c], rows, gen, logits, &pp, &tg, &bpt[i])) {
                    fprintf(stderr, "tqkv bench model: %s\n", tqkv_last_error());
                    rc = 1;
                }
                if (pp > best_pp[i]) best_pp[i] = pp;
                if (tg > best_tg[i]) best_tg[i] = tg;
            }
    }
    cJSON *arr = cJSON_CreateArray();
    for (int c = 0; c < n_ctx && !rc; c++)
        for (int k = 0; k < n_kv; k++) {
            int i = c * 32 + k;
            fprintf(tab, "%-8d %-10s %12.1f %12.1f %14.1f\n", ctxs[c], kv_items[k], best_pp[i],
                    best_tg[i], bpt[i]);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddItemToArray(arr, o);
            cJSON_AddNumberToObject(o, "ctx", ctxs[c]);
            cJSON_AddStringToObject(o, "device", dev ? "cuda" : "cpu");
            cJSON_AddStringToObject(o, "kv", kv_items[k]);
            json_add_num(o, "prefill_tokens_per_s", best_pp[i], 2);
            json_add_num(o, "decode_tokens_per_s", best_tg[i], 2);
            json_add_num(o, "kv_bytes_per_token", bpt[i], 1);
            cJSON_AddNumberToObject(o, "threads", threads);
            cJSON_AddNumberToObject(o, "gen", gen);
            cJSON_AddNumberToObject(o, "rows", rows);
            cJSON_AddNumberToObject(o, "window", window);
        }
    if (json && !rc) rc = json_print(stdout, arr, 0, "bench model") ? 1 : 0;
    else cJSON_Delete(arr);
    free(tok);
    free(logits);
    free(ctx_copy);
    free(kv_copy);
    tqkv_model_free(m);
    return rc;
}

/*
 * cmd_bench_model.c - `tqkv bench model`: prefill and decode tokens per second of the model
 * for every (context, KV format) pair in one run.
 * Owns: the benchmark loop, its table and --json array.
 * Must not: contain model or cache logic.
 *
 * For each ctx and KV format: a fresh state, prefill ctx tokens (pp t/s = ctx / time), then
 * --gen greedy decode steps at that depth (tg t/s = gen / time; a step's time includes
 * picking its next tokens). Token ids are a fixed pseudo-random sequence (speed does not
 * depend on the text). Best of --reps rounds; each round measures every configuration
 * once, so noise spreads evenly.
 * With --device cuda, --graphs 0,1 measures every configuration with the decode step
 * launched kernel by kernel and as a CUDA graph, side by side, and prints their ratio;
 * --pick host,device likewise the next token picked on the host (the logits [rows, vocab]
 * copied back, argmax there) and on the device (tqkv_model_decode_pick: one int per row).
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

/* Configuration index of (ctx, kv format, --graphs value, --pick value) indices. */
#define CONF(c, k, gi, pi) ((((c) * 32 + (k)) * 2 + (gi)) * 2 + (pi))

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One configuration: fresh state with room for ctx + gen tokens per row, then either a
 * prefill of ctx tokens per row (all rows in one call) or, with synth, ctx synthetic tokens
 * put straight into the caches (tqkv_model_state_fill_synthetic: no prefill figure), then
 * gen greedy decode steps, each with its pick: on the host (decode's logits, argmax) or,
 * with pick_dev, tqkv_model_decode_pick. */
static tqkv_status measure(const tqkv_model *m, const tqkv_model_state_params *sp, const int32_t *tok,
                   int ctx, int rows, int gen, int synth, int pick_dev, float *logits, double *pp,
                   double *tg, double *bpt) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    tqkv_model_state *s = NULL;
    tqkv_status st0 = tqkv_model_state_init(&s, m, sp);
    if (st0 != TQKV_OK) return st0;
    int32_t *pt = malloc(sizeof(int32_t) * (size_t)(synth ? 1 : ctx) * rows); // [rows, ctx]
    int32_t *next = malloc(sizeof(int32_t) * (size_t)rows * 2);               // [2, rows]
    int32_t *picked = next ? next + rows : NULL;
    /* synth: one more decode step (the untimed first one gives the first tokens) */
    tqkv_status st = pt && next ? tqkv_model_state_reserve(s, ctx + gen + synth) : TQKV_ENOMEM;
    double t0 = mcli_now(), tp = 0, td = 0;
    if (st == TQKV_OK && synth) {
        st = tqkv_model_state_fill_synthetic(s, ctx, 0x5eed);
        for (int r = 0; r < rows; r++) next[r] = tok[r % ctx];
        t0 = mcli_now(); /* the first step is a warm-up: it gives the first tokens */
        if (st == TQKV_OK) st = tqkv_model_decode(m, s, next, logits);
    } else if (st == TQKV_OK) {
        for (int r = 0; r < rows; r++) memcpy(pt + (size_t)r * ctx, tok, sizeof(int32_t) * ctx);
        st = tqkv_model_prefill(m, s, pt, NULL, ctx, TQKV_LOGITS_LAST, logits);
    }
    tp = mcli_now() - t0;
    free(pt);
    if (st == TQKV_OK)
        for (int r = 0; r < rows; r++) next[r] = argmax(logits + (size_t)r * V, V);
    for (int g = 0; g < gen && st == TQKV_OK; g++) {
        t0 = mcli_now();
        if (pick_dev) {
            st = tqkv_model_decode_pick(m, s, next, NULL, picked);
            if (st == TQKV_OK) memcpy(next, picked, sizeof(int32_t) * (size_t)rows);
        } else {
            st = tqkv_model_decode(m, s, next, logits);
            if (st == TQKV_OK)
                for (int r = 0; r < rows; r++) next[r] = argmax(logits + (size_t)r * V, V);
        }
        td += mcli_now() - t0;
    }
    free(next);
    *pp = synth ? 0 : (double)ctx * rows / tp;
    *tg = (double)gen * rows / td;
    *bpt = tqkv_model_state_kv_bytes_per_token(s);
    tqkv_model_state_free(s);
    return st;
}

/* Does a state of `rows` rows with room for `tokens` tokens each fit, take a synthetic
 * fill and run a decode step? (Device memory: the reserve allocates the caches and the
 * attention workspace for that depth exactly.) */
static int fits(const tqkv_model *m, const tqkv_model_state_params *base, int rows, int tokens,
                float **logits) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    tqkv_model_state_params sp = *base;
    sp.rows = rows;
    float *lg = realloc(*logits, sizeof(float) * (size_t)V * rows);
    int32_t *next = calloc((size_t)rows, sizeof(int32_t));
    if (lg) *logits = lg;
    tqkv_model_state *s = NULL;
    int ok = lg && next && tqkv_model_state_init(&s, m, &sp) == TQKV_OK &&
             tqkv_model_state_reserve(s, tokens) == TQKV_OK &&
             tqkv_model_state_fill_synthetic(s, 16, 1) == TQKV_OK && /* its temporaries too */
             tqkv_model_decode(m, s, next, lg) == TQKV_OK;
    tqkv_model_state_free(s);
    free(next);
    return ok;
}

/* Largest row count for which fits() holds (0 if not even one row), by doubling then
 * bisection over real allocations. */
static int max_rows(const tqkv_model *m, const tqkv_model_state_params *base, int tokens,
                    float **logits) {
    int lo = 0, hi = 1;
    while (hi <= 1 << 16 && fits(m, base, hi, tokens, logits)) {
        lo = hi;
        hi *= 2;
    }
    while (hi - lo > 1) {
        const int mid = lo + (hi - lo) / 2;
        if (fits(m, base, mid, tokens, logits)) lo = mid;
        else hi = mid;
    }
    return lo;
}

int cmd_bench_model(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *ctx_list = "512,4096",
               *kv_list = "f32,f16,q8,tq4,tq3", *prefill_kernel = "graph",
               *decode_kernel = "graph", *device = "cpu";
    const char *fill = "prefill", *graphs_list = "1", *pick_list = NULL;
    int threads = 2, gen = 64, json = 0, window = 0, reps = 3, blas = 0, f32w = 0, rows = 1,
        find_max = 0, fast_gemm = 0;
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
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--f32-weights", ARG_FLAG, &f32w, "convert weights to f32 at load"},
        {"--device", ARG_STR, &device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
        {"--graphs", ARG_STR, &graphs_list, "with --device cuda: 1 (default): decode steps as replayed CUDA graphs; 0: kernel by kernel; 0,1: both, side by side, with their ratio"},
        {"--pick", ARG_STR, &pick_list, "how a decode step picks its next tokens: host (logits copied back, argmax on the host), device (tqkv_model_decode_pick: argmax on the GPU, one int per row back), or host,device: both, side by side, with their ratio; default device with --device cuda, else host"},
        {"--fill", ARG_STR, &fill, "prefill (default): run ctx tokens through the model; synthetic: put ctx tokens of random K/V straight into the caches (device only, no pp figure)"},
        {"--max-rows", ARG_FLAG, &find_max, "also find the most rows whose caches for ctx + gen + 1 tokens fit (device memory; real allocations)"},
        {"--json", ARG_FLAG, &json, "print a JSON array of results on stdout"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (threads < 1 || gen < 1 || reps < 1 || window < 0 || rows < 1 || rows > 4096) {
        fprintf(stderr, "tqkv bench model: --threads, --gen, --reps, --rows must be >= 1 (rows <= 4096)\n");
        return 2;
    }
    const int synth = !strcmp(fill, "synthetic");
    if (find_max && strcmp(device, "cuda")) {
        fprintf(stderr, "tqkv bench model: --max-rows measures device memory (--device cuda)\n");
        return 2;
    }
    if (!synth && strcmp(fill, "prefill")) {
        fprintf(stderr, "tqkv bench model: --fill takes prefill or synthetic, not '%s'\n", fill);
        return 2;
    }
    tqkv_kernel pk, dk;
    int dev = 0;
    if (mcli_parse_kernel(CMD, prefill_kernel, &pk) || mcli_parse_kernel(CMD, decode_kernel, &dk) ||
        mcli_parse_device(CMD, device, &dev))
        return 2;
    /* --graphs: the device_graphs values measured, in the order given */
    int gv[2], n_gv = 0;
    {
        int bad_g = 0;
        for (const char *q = graphs_list; *q && !bad_g; q++) {
            if (*q == ',') continue;
            const int v = *q == '0' ? 0 : *q == '1' ? 1 : -1;
            bad_g = v < 0 || (q[1] && q[1] != ',') || n_gv == 2 || (n_gv == 1 && gv[0] == v);
            if (!bad_g) gv[n_gv++] = v;
        }
        if (bad_g || n_gv == 0) {
            fprintf(stderr, "tqkv bench model: --graphs takes 0, 1, 0,1 or 1,0, not '%s'\n", graphs_list);
            return 2;
        }
        if (!dev && (n_gv != 1 || gv[0] != 1)) {
            fprintf(stderr, "tqkv bench model: --graphs needs --device cuda (CUDA graphs of the decode step)\n");
            return 2;
        }
    }
    /* --pick: device pick (1) or host pick (0), in the order given */
    int pv[2], n_pv = 0;
    {
        char buf[64];
        snprintf(buf, sizeof buf, "%s", pick_list ? pick_list : dev ? "device" : "host");
        int bad_p = pick_list && strlen(pick_list) >= sizeof buf;
        for (char *it = strtok(buf, ","); it && !bad_p; it = strtok(NULL, ",")) {
            const int v = !strcmp(it, "device") ? 1 : !strcmp(it, "host") ? 0 : -1;
            bad_p = v < 0 || n_pv == 2 || (n_pv == 1 && pv[0] == v);
            if (!bad_p) pv[n_pv++] = v;
        }
        if (bad_p || n_pv == 0) {
            fprintf(stderr, "tqkv bench model: --pick takes host, device, host,device or device,host, not '%s'\n",
                    pick_list ? pick_list : "");
            return 2;
        }
        if (!dev && (n_pv != 1 || pv[0] != 0)) {
            fprintf(stderr, "tqkv bench model: --pick device needs --device cuda\n");
            return 2;
        }
    }
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
    if (dev) fprintf(tab, "%-8s %-10s %6s %6s %12s %12s %14s\n", "ctx", "kv", "graphs", "pick", "pp t/s", "tg t/s", "kv B/token");
    else fprintf(tab, "%-8s %-10s %12s %12s %14s\n", "ctx", "kv", "pp t/s", "tg t/s", "kv B/token");
    /* every state's parameters; per configuration rows and the KV formats change */
    tqkv_model_state_params base = tqkv_model_state_params_default();
    base.window = window;
    base.threads = threads;
    base.prefill_kernel = pk;
    base.decode_kernel = dk;
    base.blas = blas;
    base.device = dev;
    base.device_fast_gemm = fast_gemm;
    /* warm-up: map the weights in */
    {
        tqkv_model_state_params sp = base;
        sp.window = 0;
        tqkv_model_state *s = NULL;
        if (tqkv_model_state_init(&s, m, &sp) == TQKV_OK)
            tqkv_model_prefill(m, s, tok, NULL, max_ctx < 64 ? max_ctx : 64, TQKV_LOGITS_LAST, logits);
        tqkv_model_state_free(s);
    }
    /* Repetitions are the outer loop, so every configuration is measured once per round
     * and machine noise spreads over all of them alike; the best round is kept. */
    int rc = 0;
    double best_pp[32 * 32 * 4] = {0}, best_tg[32 * 32 * 4] = {0}, bpt[32 * 32 * 4] = {0};
    int oom[32 * 32 * 4] = {0}, maxr[32 * 32] = {0};
    for (int r = 0; r < reps && !rc; r++) {
        if (reps > 1) fprintf(stderr, "tqkv bench model: round %d/%d\n", r + 1, reps);
        for (int c = 0; c < n_ctx && !rc; c++)
            for (int k = 0; k < n_kv && !rc; k++)
                for (int gi = 0; gi < n_gv && !rc; gi++)
                for (int pi = 0; pi < n_pv && !rc; pi++) {
                    tqkv_model_state_params sp = base;
                    sp.rows = rows;
                    sp.k_format = kf[k];
                    sp.v_format = vf[k];
                    sp.device_graphs = gv[gi];
                    double pp = 0, tg = 0;
                    int i = CONF(c, k, gi, pi);
                    if (oom[i]) continue;
                    tqkv_status st = measure(m, &sp, tok, ctxs[c], rows, gen, synth, pv[pi], logits, &pp, &tg, &bpt[i]);
                    if (st == TQKV_ENOMEM) { /* does not fit: reported, not fatal */
                        fprintf(stderr, "tqkv bench model: ctx %d kv %s rows %d: does not fit (%s)\n",
                                ctxs[c], kv_items[k], rows, tqkv_last_error());
                        oom[i] = 1;
                        continue;
                    }
                    if (st != TQKV_OK) {
                        fprintf(stderr, "tqkv bench model: %s\n", tqkv_last_error());
                        rc = 1;
                        continue;
                    }
                    fprintf(stderr, "tqkv bench model: ctx %d kv %s rows %d%s%s: pp %.1f t/s, tg %.1f t/s\n",
                            ctxs[c], kv_items[k], rows, !dev ? "" : gv[gi] ? " graphs" : " no graphs",
                            !dev ? "" : pv[pi] ? ", device pick" : ", host pick", pp, tg);
                    if (pp > best_pp[i]) best_pp[i] = pp;
                    if (tg > best_tg[i]) best_tg[i] = tg;
                }
    }
    for (int c = 0; c < n_ctx && !rc && find_max; c++)
        for (int k = 0; k < n_kv; k++) {
            tqkv_model_state_params sp = base;
            sp.k_format = kf[k];
            sp.v_format = vf[k];
            float *lg = NULL;
            maxr[c * 32 + k] = max_rows(m, &sp, ctxs[c] + gen + 1, &lg); /* as measure, synth */
            free(lg);
            fprintf(stderr, "tqkv bench model: ctx %d kv %s: at most %d rows fit\n", ctxs[c],
                    kv_items[k], maxr[c * 32 + k]);
        }
    cJSON *arr = cJSON_CreateArray();
    if (find_max) fprintf(tab, "%-8s %-10s %*s%12s %12s %14s %9s\n", "", "", dev ? 14 : 0, "", "", "", "", "max rows");
    for (int c = 0; c < n_ctx && !rc; c++)
        for (int k = 0; k < n_kv; k++)
            for (int gi = 0; gi < n_gv; gi++)
            for (int pi = 0; pi < n_pv; pi++) {
                const int i = CONF(c, k, gi, pi), i0 = CONF(c, k, 1 - gi, pi), ip = CONF(c, k, gi, 1 - pi);
                /* both measured: the graph row carries the ratio of its decode speed to the
                 * kernel-by-kernel one's, the device-pick row the ratio to the host pick's
                 * (same run, same rounds) */
                const int both = n_gv == 2 && gv[gi] && !oom[i] && !oom[i0] && best_tg[i0] > 0;
                const int both_p = n_pv == 2 && pv[pi] && !oom[i] && !oom[ip] && best_tg[ip] > 0;
                fprintf(tab, "%-8d %-10s ", ctxs[c], kv_items[k]);
                if (dev) fprintf(tab, "%6d %6s ", gv[gi], pv[pi] ? "device" : "host");
                if (oom[i]) fprintf(tab, "%12s %12s %14s", "-", "oom", "-");
                else fprintf(tab, "%12.1f %12.1f %14.1f", best_pp[i], best_tg[i], bpt[i]);
                if (find_max) fprintf(tab, " %9d", maxr[c * 32 + k]);
                if (both) fprintf(tab, "   graphs / no graphs: tg %.3fx", best_tg[i] / best_tg[i0]);
                if (both_p) fprintf(tab, "   device / host pick: tg %.3fx", best_tg[i] / best_tg[ip]);
                fputc('\n', tab);
                cJSON *o = cJSON_CreateObject();
                cJSON_AddItemToArray(arr, o);
                cJSON_AddNumberToObject(o, "ctx", ctxs[c]);
                cJSON_AddStringToObject(o, "device", dev ? "cuda" : "cpu");
                cJSON_AddStringToObject(o, "kv", kv_items[k]);
                cJSON_AddStringToObject(o, "fill", synth ? "synthetic" : "prefill");
                cJSON_AddStringToObject(o, "gemm", fast_gemm ? "cublas" : "invariant");
                cJSON_AddStringToObject(o, "matmul", dev ? "device" : mcli_matmul_name(mcli_exact));
                if (dev) cJSON_AddBoolToObject(o, "graphs", gv[gi]);
                cJSON_AddStringToObject(o, "pick", pv[pi] ? "device" : "host");
                if (oom[i] || synth) cJSON_AddNullToObject(o, "prefill_tokens_per_s");
                else json_add_num(o, "prefill_tokens_per_s", best_pp[i], 2);
                if (oom[i]) cJSON_AddNullToObject(o, "decode_tokens_per_s");
                else json_add_num(o, "decode_tokens_per_s", best_tg[i], 2);
                if (both) json_add_num(o, "decode_graphs_speedup", best_tg[i] / best_tg[i0], 4);
                if (both_p) json_add_num(o, "decode_pick_speedup", best_tg[i] / best_tg[ip], 4);
                if (oom[i]) cJSON_AddStringToObject(o, "error", "out of memory");
                json_add_num(o, "kv_bytes_per_token", bpt[i], 1);
                cJSON_AddNumberToObject(o, "threads", threads);
                cJSON_AddNumberToObject(o, "gen", gen);
                cJSON_AddNumberToObject(o, "rows", rows);
                cJSON_AddNumberToObject(o, "window", window);
                if (find_max) cJSON_AddNumberToObject(o, "max_rows", maxr[c * 32 + k]);
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

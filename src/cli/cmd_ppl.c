/*
 * cmd_ppl.c - `tqkv ppl`: perplexity (and KL divergence from an f32 cache) of a text file.
 * Owns: windowing and scoring, progress lines, the --json summary.
 * Must not: contain model, cache or tokenizer logic.
 *
 * Scoring matches shared/tools/kvq_reference.py: the whole file is tokenized with no BOS;
 * W = min(--max-windows, (N - 1) / ctx) windows; window i feeds tokens [ctx i, ctx (i+1))
 * and position j predicts token ctx i + j + 1, for every j in [0, ctx) (the last position's
 * target is the first token of the next window), so tokens = W * ctx predictions.
 * --kld runs an f32-cache pass over the same window (always one prefill) and adds
 * KL(p_f32 || p_kv) per token.
 * --chunk C feeds a window as a prefill of C tokens then extends of C tokens (default: the
 * whole window at once). With --window W every query reads its own newest W keys at q8 at
 * any C (the cache's per-query window), as decoding (C = 1) does.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "ppl";

/* Feed window tokens [n] through state s in chunks; logits [n, V]. */
static int run_window(const tqkv_model *m, tqkv_model_state *s, const int32_t *tok, int n,
                      int chunk, float *logits) {
    int V = tqkv_model_get_config(m)->vocab_size;
    if (tqkv_model_state_reset(s, 1) != TQKV_OK) return -1;
    int c0 = chunk < n ? chunk : n;
    if (tqkv_model_prefill(m, s, tok, NULL, c0, TQKV_LOGITS_ALL, logits) != TQKV_OK) return -1;
    for (int at = c0; at < n; at += chunk) {
        int c = n - at < chunk ? n - at : chunk;
        if (tqkv_model_extend(m, s, tok + at, c, TQKV_LOGITS_ALL, logits + (size_t)at * V) != TQKV_OK)
            return -1;
    }
    return 0;
}

/* log-sum-exp of x [n] in double. */
static double lse(const float *x, int n) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)(x[i] - mx));
    return (double)mx + log(s);
}

int cmd_ppl(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *text_path = NULL, *kv = "f32";
    const char *prefill_kernel = "graph", *device = "cpu", *kv_layers = "";
    int ctx = 2048, max_windows = 0, window = 0, kld = 0, threads = 0, json = 0, kv_seed = 0;
    int chunk = 0, blas = 0, fast_gemm = 0, slack = 32;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--text", ARG_STR, &text_path, "text file to score"},
        {"--ctx", ARG_INT, &ctx, "window length in tokens (default 2048)"},
        {"--max-windows", ARG_INT, &max_windows, "score at most N windows (default all)"},
        {"--kv", ARG_STR, &kv, "KV cache format (default f32)"},
        {"--kv-layers", ARG_STR, &kv_layers, "per-layer KV formats, e.g. '0,7:q8' or '0-1:q8;7:tq4/q8'"},
        {"--window", ARG_INT, &window, "newest tokens kept at q8 beside a tq cache (default 0)"},
        {"--window-slack", ARG_INT, &slack, "extra q8 ring slots for trims (default 32; counted in kv_bits_per_value)"},
        {"--chunk", ARG_INT, &chunk, "feed each window in chunks of N tokens (default: whole)"},
        {"--kv-seed", ARG_INT, &kv_seed, "rotation seed of the KV cache (layer l: seed + l)"},
        {"--kld", ARG_FLAG, &kld, "also the mean KL divergence from an f32-cache pass"},
        {"--threads", ARG_INT, &threads, "threads (default: all CPUs)"},
        {"--prefill-kernel", ARG_STR, &prefill_kernel, "attention kernel for n_query > 1 (default graph: the graph's kernel set)"},
        {"--blas", ARG_FLAG, &blas, "OpenBLAS sgemm for prefill matmuls"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--device", ARG_STR, &device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
        {"--json", ARG_FLAG, &json, "end with a JSON summary line"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!text_path) {
        fprintf(stderr, "tqkv ppl: --text is required\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    if (ctx < 2 || max_windows < 0 || window < 0 || threads < 0 || chunk < 0 || slack < 0) {
        fprintf(stderr, "tqkv ppl: need --ctx >= 2 and non-negative counts\n");
        return 2;
    }
    if (threads == 0) threads = mcli_cpus();
    if (chunk == 0 || chunk > ctx) chunk = ctx;
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.device_fast_gemm = fast_gemm;
    const int preset = kvp_is_preset(kv);
    if (preset && (window || kv_layers[0])) {
        fprintf(stderr, "tqkv ppl: --kv %s chooses the window and per-layer formats itself; "
                "drop --window / --kv-layers\n", kv);
        return 2;
    }
    if ((!preset && (mcli_parse_kv(CMD, kv, &sp.k_format, &sp.v_format) ||
                     mcli_parse_kv_layers(CMD, kv_layers, &sp) ||
                     mcli_check_window(CMD, window, sp.k_format, sp.v_format))) ||
        mcli_parse_kernel(CMD, prefill_kernel, &sp.prefill_kernel) ||
        mcli_parse_device(CMD, device, &sp.device))
        return 2;
    char dir[4096];
    if (!mcli_resolve_model(CMD, model_arg, dir, sizeof dir)) return 1;

    int rc = 1;
    char *text = NULL;
    size_t text_len = 0;
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    tqkv_model_state *s = NULL, *ref = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    float *lg = NULL, *lr = NULL;
    double *pos_nll = NULL, *pos_kl = NULL;
    if (mcli_read_file(CMD, text_path, &text, &text_len)) goto done;
    if (mcli_load_dev(CMD, dir, blas, 0, threads, sp.device, &m)) goto done;
    if (tqkv_tokenizer_load(&tok, dir) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        goto done;
    }
    double t0 = mcli_now();
    if (tqkv_tokenizer_encode(tok, text, text_len, 0, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        goto done;
    }
    int n_win = n_ids > 1 ? (int)((n_ids - 1) / (size_t)ctx) : 0;
    if (max_windows > 0 && n_win > max_windows) n_win = max_windows;
    fprintf(stderr, "tqkv ppl: %zu tokens (tokenized in %.1f s), %d windows x %d, kv %s%s\n", n_ids,
            mcli_now() - t0, n_win, ctx, kv, kld ? ", with KLD" : "");
    if (n_win == 0) {
        fprintf(stderr, "tqkv ppl: text too short for one window of %d tokens (+1)\n", ctx);
        goto done;
    }
    const int V = tqkv_model_get_config(m)->vocab_size;
    sp.rows = 1;
    sp.window = window;
    sp.window_slack = slack;
    char resolved[256] = "";
    if (preset) {
        if (kvp_resolve(CMD, m, kv, ctx, &sp, resolved, sizeof resolved)) goto done;
        window = sp.window;
        fprintf(stderr, "tqkv ppl: --kv %s -> %s\n", kv, resolved);
    }
    sp.kv_seed = (uint64_t)kv_seed;
    sp.threads = threads;
    sp.blas = blas;
    if (tqkv_model_state_init(&s, m, &sp) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        goto done;
    }
    int do_kld = kld && !(sp.k_format == TQKV_F32 && sp.v_format == TQKV_F32);
    if (do_kld) {
        tqkv_model_state_params rp = sp;
        rp.k_format = rp.v_format = TQKV_F32;
        rp.window = 0;
        if (tqkv_model_state_init(&ref, m, &rp) != TQKV_OK) {
            fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
            goto done;
        }
    }
    lg = malloc(sizeof(float) * (size_t)ctx * V);
    lr = do_kld ? malloc(sizeof(float) * (size_t)ctx * V) : NULL;
    pos_nll = malloc(sizeof(double) * (size_t)ctx);
    pos_kl = malloc(sizeof(double) * (size_t)ctx);
    if (!lg || (do_kld && !lr) || !pos_nll || !pos_kl) {
        fprintf(stderr, "tqkv ppl: out of memory\n");
        goto done;
    }
    double nll = 0, kl = 0, t_fwd = 0;
    size_t cnt = 0;
    t0 = mcli_now();
    for (int w = 0; w < n_win; w++) {
        const int32_t *x = ids + (size_t)w * ctx;
        double tw = mcli_now();
        if (run_window(m, s, x, ctx, chunk, lg) ||
            (do_kld && run_window(m, ref, x, ctx, ctx, lr))) {
            fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
            goto done;
        }
        t_fwd += mcli_now() - tw;
        /* per-position terms in parallel, summed in order (same result at any thread count) */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int j = 0; j < ctx; j++) {
            const float *l = lg + (size_t)j * V;
            double z = lse(l, V);
            pos_nll[j] = z - (double)l[x[j + 1]];
            pos_kl[j] = 0;
            if (do_kld) {
                const float *r = lr + (size_t)j * V;
                double zr = lse(r, V), acc = 0;
                for (int v = 0; v < V; v++) {
                    double lpr = (double)r[v] - zr, lpq = (double)l[v] - z;
                    acc += exp(lpr) * (lpr - lpq);
                }
                pos_kl[j] = acc;
            }
        }
        for (int j = 0; j < ctx; j++) {
            nll += pos_nll[j];
            kl += pos_kl[j];
        }
        cnt += (size_t)ctx;
        double el = mcli_now() - t0;
        if (do_kld)
            fprintf(stderr, "window %d/%d  ppl %.4f  kld %.5f  %.0f tokens/s\n", w + 1, n_win,
                    exp(nll / (double)cnt), kl / (double)cnt, (double)cnt * 2 / (el > 0 ? el : 1));
        else
            fprintf(stderr, "window %d/%d  ppl %.4f  %.0f tokens/s\n", w + 1, n_win,
                    exp(nll / (double)cnt), (double)cnt / (el > 0 ? el : 1));
    }
    double ppl = exp(nll / (double)cnt);
    const double kv_bits = mcli_kv_bits(m, s, ctx);
    printf("ppl %.4f over %zu tokens (%d windows x %d), kv %s", ppl, cnt, n_win, ctx, kv);
    if (kv_layers[0]) printf(" layers %s", kv_layers);
    if (window) printf(" window %d", window);
    printf(" (%.4f bits/value)", kv_bits);
    if (do_kld) printf(", kld %.5f", kl / (double)cnt);
    printf("\n");
    if (json) {
        cJSON *o = cJSON_CreateObject();
        json_add_num(o, "ppl", ppl, 6);
        if (kld) json_add_num(o, "kld", do_kld ? kl / (double)cnt : 0.0, 6);
        else cJSON_AddNullToObject(o, "kld");
        cJSON_AddNumberToObject(o, "windows", n_win);
        cJSON_AddNumberToObject(o, "tokens", (double)cnt);
        cJSON_AddStringToObject(o, "device", sp.device ? "cuda" : "cpu");
        cJSON_AddStringToObject(o, "gemm", sp.device_fast_gemm ? "cublas" : "invariant");
        cJSON_AddStringToObject(o, "matmul", sp.device ? "device" : mcli_matmul_name(mcli_exact));
        cJSON_AddStringToObject(o, "kv", kv);
        cJSON_AddStringToObject(o, "kv_layers", kv_layers);
        if (preset) cJSON_AddStringToObject(o, "kv_resolved", resolved);
        else cJSON_AddNullToObject(o, "kv_resolved");
        /* everything counted at ctx: scales, per-layer mix, window ring, sliding layers */
        json_add_num(o, "kv_bits_per_value", kv_bits, 4);
        json_add_num(o, "kv_format_bits", tqkv_model_state_kv_bits_per_value(s), 4);
        cJSON_AddNumberToObject(o, "ctx", ctx);
        cJSON_AddNumberToObject(o, "window", window);
        cJSON_AddNumberToObject(o, "window_slack", sp.window_slack);
        cJSON_AddNumberToObject(o, "chunk", chunk);
        json_add_num(o, "forward_tokens_per_s",
                     t_fwd > 0 ? (double)cnt * (do_kld ? 2 : 1) / t_fwd : 0.0, 1);
        if (json_print(stdout, o, 0, CMD)) goto done;
    }
    fflush(stdout);
    rc = 0;
done:
    free(pos_nll);
    free(pos_kl);
    free(lg);
    free(lr);
    free(ids);
    free(text);
    tqkv_model_state_free(s);
    tqkv_model_state_free(ref);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
    return rc;
}

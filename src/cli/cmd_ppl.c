/*
 * cmd_ppl.c - `tqkv ppl`: perplexity (and KL divergence from an f32 cache) of a text file.
 * Owns: windowing and scoring, progress lines, the --json summary.
 * Must not: contain model, cache or tokenizer logic.
 *
 * Scoring matches shared/tools/kvq_reference.py: the whole file is tokenized with no BOS;
 * W = min(--max-windows, (N - 1) / ctx - F) windows (F = --first-window, default 0); window
 * i (from F) feeds tokens [ctx i, ctx (i+1))
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
#include "kv_policy.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "ppl";

// ---------------------------------------------------------------------------
// Windows
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

typedef struct {
    const char *model_arg, *text_path, *kv;
    const char *prefill_kernel, *device, *kv_layers, *kv_policy;
    kv_policy pol;               /* --kv-policy FILE, applied once the model is loaded */
    int ctx, max_windows, window, kld, threads, json, kv_seed;
    int chunk, blas, fast_gemm, slack, tp;
    int window_k;                /* --window-keys-only */
    int first_window;            /* --first-window: windows before it are skipped */
    int preset;                  /* --kv is a preset (auto:B), resolved once the model is loaded */
    tqkv_model_state_params sp;  /* formats, kernel, device from the options */
    char dir[4096];              /* the resolved model directory */
} ppl_opts;

/* Defaults, the command line and its checks; 0, or the exit code (message printed). */
static int ppl_parse_args(int argc, char **argv, ppl_opts *o) {
    *o = (ppl_opts){
        .model_arg = MCLI_DEFAULT_MODEL, .kv = "f32",
        .prefill_kernel = "graph", .device = "cpu", .kv_layers = "",
        .ctx = 2048, .slack = 32,
    };
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--text", ARG_STR, &o->text_path, "text file to score"},
        {"--ctx", ARG_INT, &o->ctx, "window length in tokens (default 2048)"},
        {"--max-windows", ARG_INT, &o->max_windows, "score at most N windows (default all)"},
        {"--first-window", ARG_INT, &o->first_window, "skip the windows before this one (default 0; e.g. 64 scores the windows `tqkv calibrate` measures on)"},
        {"--kv", ARG_STR, &o->kv, "KV cache format (default f32)"},
        {"--kv-layers", ARG_STR, &o->kv_layers, "per-layer KV formats, e.g. '0,7:q8' or '0-1:q8;7:tq4/q8'"},
        {"--kv-policy", ARG_STR, &o->kv_policy, "KV policy file from `tqkv calibrate` (formats, per-layer formats, window; instead of --kv)"},
        {"--window", ARG_INT, &o->window, "newest tokens kept at q8 beside a tq cache (default 0)"},
        {"--window-keys-only", ARG_FLAG, &o->window_k, "the --window ring holds keys only (values read from their format; half the ring's bits)"},
        {"--window-slack", ARG_INT, &o->slack, "extra q8 ring slots for trims (default 32; counted in kv_bits_per_value)"},
        {"--chunk", ARG_INT, &o->chunk, "feed each window in chunks of N tokens (default: whole)"},
        {"--kv-seed", ARG_INT, &o->kv_seed, "rotation seed of the KV cache (layer l: seed + l)"},
        {"--kld", ARG_FLAG, &o->kld, "also the mean KL divergence and the top-1 agreement with an f32-cache pass"},
        {"--threads", ARG_INT, &o->threads, "threads (default: all CPUs)"},
        {"--prefill-kernel", ARG_STR, &o->prefill_kernel, "attention kernel for n_query > 1 (default graph: the graph's kernel set)"},
        {"--blas", ARG_FLAG, &o->blas, "OpenBLAS sgemm for prefill matmuls"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--device", ARG_STR, &o->device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &o->fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
        {"--tensor-parallel", ARG_INT, &o->tp, MCLI_TP_HELP},
        {"--json", ARG_FLAG, &o->json, "end with a JSON summary line"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!o->text_path) {
        fprintf(stderr, "tqkv ppl: --text is required\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    if (o->ctx < 2 || o->max_windows < 0 || o->window < 0 || o->threads < 0 || o->chunk < 0 ||
        o->slack < 0 || o->first_window < 0) {
        fprintf(stderr, "tqkv ppl: need --ctx >= 2 and non-negative counts\n");
        return 2;
    }
    if (o->threads == 0) o->threads = mcli_cpus();
    if (o->chunk == 0 || o->chunk > o->ctx) o->chunk = o->ctx;
    tqkv_model_state_params *sp = &o->sp;
    *sp = tqkv_model_state_params_default();
    sp->device_fast_gemm = o->fast_gemm;
    o->preset = kvp_is_preset(o->kv);
    if (o->kv_policy &&
        (o->preset || o->window || o->window_k || o->kv_layers[0] || strcmp(o->kv, "f32"))) {
        fprintf(stderr, "tqkv ppl: --kv-policy sets the formats and the window; drop --kv, "
                "--window, --window-keys-only and --kv-layers\n");
        return 2;
    }
    if (o->kv_policy && kvpol_load(CMD, o->kv_policy, &o->pol)) return 2;
    if (o->preset && (o->window || o->window_k || o->kv_layers[0])) {
        fprintf(stderr, "tqkv ppl: --kv %s chooses the window and per-layer formats itself; "
                "drop --window / --window-keys-only / --kv-layers\n", o->kv);
        return 2;
    }
    if ((!o->preset && (mcli_parse_kv(CMD, o->kv, &sp->k_format, &sp->v_format) ||
                        mcli_parse_kv_layers(CMD, o->kv_layers, sp) ||
                        mcli_check_window(CMD, o->window, sp->k_format, sp->v_format) ||
                        mcli_check_window_k(CMD, o->window_k, o->window))) ||
        mcli_parse_kernel(CMD, o->prefill_kernel, &sp->prefill_kernel) ||
        mcli_parse_device(CMD, o->device, &sp->device) ||
        mcli_parse_tp(CMD, o->tp, sp->device, sp))
        return 2;
    if (!mcli_resolve_model(CMD, o->model_arg, o->dir, sizeof o->dir)) return 1;
    return 0;
}

// ---------------------------------------------------------------------------
// States
// ---------------------------------------------------------------------------

/* The scored state *s (a preset resolved at ctx into resolved [KVP_DESC], o->window updated)
 * and, with --kld on a non-f32 cache, the f32 reference state *ref; 0 or -1 (message
 * printed; what was made is left for the caller to free). */
static int ppl_states_init(ppl_opts *o, const tqkv_model *m, tqkv_model_state **s,
                           tqkv_model_state **ref, char *resolved) {
    tqkv_model_state_params *sp = &o->sp;
    sp->rows = 1;
    sp->window = o->window;
    sp->window_slack = o->slack;
    sp->window_keys_only = o->window_k;
    if (o->preset) {
        if (kvp_resolve_model(CMD, m, o->dir, o->kv, o->ctx, sp, resolved, KVP_DESC))
            return -1;
        o->window = sp->window;
        fprintf(stderr, "tqkv ppl: --kv %s -> %s\n", o->kv, resolved);
    }
    if (o->kv_policy) {
        if (kvpol_apply(CMD, m, &o->pol, o->ctx, sp, resolved, KVP_DESC)) return -1;
        o->window = sp->window;
        o->window_k = sp->window_keys_only;
        o->kv = o->pol.kv;
        o->kv_layers = o->pol.kv_layers;
        fprintf(stderr, "tqkv ppl: --kv-policy %s -> %s\n", o->kv_policy, resolved);
    }
    sp->kv_seed = (uint64_t)o->kv_seed;
    sp->threads = o->threads;
    sp->blas = o->blas;
    if (tqkv_model_state_init(s, m, sp) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        return -1;
    }
    int all_f32 = sp->k_format == TQKV_F32 && sp->v_format == TQKV_F32;
    for (int l = 0; l < TQKV_MAX_KV_LAYERS; l++)
        all_f32 &= (!sp->layer_k[l] || sp->layer_k[l] == TQKV_F32 + 1) &&
                   (!sp->layer_v[l] || sp->layer_v[l] == TQKV_F32 + 1);
    if (o->kld && !all_f32) {
        /* the reference is f32 on every layer: no per-layer formats, no window (before
         * session 10 it kept the per-layer formats, so --kv-layers runs' KLD was measured
         * against a partly quantized cache) */
        tqkv_model_state_params rp = *sp;
        rp.k_format = rp.v_format = TQKV_F32;
        memset(rp.layer_k, 0, sizeof rp.layer_k);
        memset(rp.layer_v, 0, sizeof rp.layer_v);
        rp.window = 0;
        rp.window_keys_only = 0;
        if (tqkv_model_state_init(ref, m, &rp) != TQKV_OK) {
            fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
            return -1;
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Scoring
// ---------------------------------------------------------------------------

/* Sums over all scored positions. */
typedef struct {
    double nll, kl, t_fwd; /* t_fwd: seconds in the forward passes */
    size_t cnt;            /* predictions */
    size_t top1;           /* with a reference: positions whose argmax equals the f32 cache's */
} ppl_sums;

/* Index of the largest of x [n] (ties: the lowest index). */
static int ppl_argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Scores n_win windows of ids through s (and ref, when not NULL: the KL terms), with a
 * progress line per window; 0 or -1 (message printed). */
static int ppl_score(const ppl_opts *o, const tqkv_model *m, tqkv_model_state *s,
                     tqkv_model_state *ref, const int32_t *ids, int n_win, ppl_sums *r) {
    const int V = tqkv_model_get_config(m)->vocab_size, ctx = o->ctx, do_kld = ref != NULL;
    float *lg = malloc(sizeof(float) * (size_t)ctx * V);                    // [ctx, vocab]
    float *lr = do_kld ? malloc(sizeof(float) * (size_t)ctx * V) : NULL;    // [ctx, vocab]
    double *pos_nll = malloc(sizeof(double) * (size_t)ctx);                 // [ctx]
    double *pos_kl = malloc(sizeof(double) * (size_t)ctx);                  // [ctx]
    char *pos_top = malloc((size_t)ctx);                                    // [ctx]
    int rc = -1;
    if (!lg || (do_kld && !lr) || !pos_nll || !pos_kl || !pos_top) {
        fprintf(stderr, "tqkv ppl: out of memory\n");
        goto done;
    }
    *r = (ppl_sums){0};
    double t0 = mcli_now();
    for (int w = 0; w < n_win; w++) {
        const int32_t *x = ids + (size_t)w * ctx;
        double tw = mcli_now();
        if (run_window(m, s, x, ctx, o->chunk, lg) ||
            (do_kld && run_window(m, ref, x, ctx, ctx, lr))) {
            fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
            goto done;
        }
        r->t_fwd += mcli_now() - tw;
        /* per-position terms in parallel, summed in order (same result at any thread count) */
#pragma omp parallel for num_threads(o->threads) schedule(static)
        for (int j = 0; j < ctx; j++) {
            const float *l = lg + (size_t)j * V;
            double z = lse(l, V);
            pos_nll[j] = z - (double)l[x[j + 1]];
            pos_kl[j] = 0;
            pos_top[j] = 0;
            if (do_kld) {
                const float *rl = lr + (size_t)j * V;
                double zr = lse(rl, V), acc = 0;
                for (int v = 0; v < V; v++) {
                    double lpr = (double)rl[v] - zr, lpq = (double)l[v] - z;
                    acc += exp(lpr) * (lpr - lpq);
                }
                pos_kl[j] = acc;
                pos_top[j] = ppl_argmax(l, V) == ppl_argmax(rl, V);
            }
        }
        for (int j = 0; j < ctx; j++) {
            r->nll += pos_nll[j];
            r->kl += pos_kl[j];
            r->top1 += (size_t)pos_top[j];
        }
        r->cnt += (size_t)ctx;
        double el = mcli_now() - t0;
        if (do_kld)
            fprintf(stderr, "window %d/%d  ppl %.4f  kld %.5f  %.0f tokens/s\n", w + 1, n_win,
                    exp(r->nll / (double)r->cnt), r->kl / (double)r->cnt,
                    (double)r->cnt * 2 / (el > 0 ? el : 1));
        else
            fprintf(stderr, "window %d/%d  ppl %.4f  %.0f tokens/s\n", w + 1, n_win,
                    exp(r->nll / (double)r->cnt), (double)r->cnt / (el > 0 ? el : 1));
    }
    rc = 0;
done:
    free(pos_nll);
    free(pos_kl);
    free(pos_top);
    free(lg);
    free(lr);
    return rc;
}

// ---------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------

/* The summary line and, with --json, the JSON line; 0 or -1. */
static int ppl_report(const ppl_opts *o, const tqkv_model *m, tqkv_model_state *s,
                      int do_kld, int n_win, const ppl_sums *r, const char *resolved) {
    const int ctx = o->ctx;
    const size_t cnt = r->cnt;
    double ppl = exp(r->nll / (double)cnt);
    const double kv_bits = mcli_kv_bits(m, s, ctx);
    printf("ppl %.4f over %zu tokens (%d windows x %d), kv %s", ppl, cnt, n_win, ctx, o->kv);
    if (o->kv_layers[0]) printf(" layers %s", o->kv_layers);
    if (o->window) printf(" window %d%s", o->window, o->window_k ? " (keys only)" : "");
    printf(" (%.4f bits/value)", kv_bits);
    if (do_kld) printf(", kld %.5f, top-1 agreement %.4f", r->kl / (double)cnt, (double)r->top1 / (double)cnt);
    printf("\n");
    if (o->json) {
        const tqkv_model_state_params *sp = &o->sp;
        cJSON *j = cJSON_CreateObject();
        json_add_num(j, "ppl", ppl, 6);
        if (o->kld) json_add_num(j, "kld", do_kld ? r->kl / (double)cnt : 0.0, 6);
        else cJSON_AddNullToObject(j, "kld");
        /* the share of positions whose most likely token is the f32 cache's (with --kld) */
        if (do_kld) json_add_num(j, "top1_agreement", (double)r->top1 / (double)cnt, 6);
        else cJSON_AddNullToObject(j, "top1_agreement");
        cJSON_AddNumberToObject(j, "windows", n_win);
        cJSON_AddNumberToObject(j, "first_window", o->first_window);
        cJSON_AddNumberToObject(j, "tokens", (double)cnt);
        cJSON_AddStringToObject(j, "device", sp->device ? "cuda" : "cpu");
        cJSON_AddNumberToObject(j, "tensor_parallel", tqkv_model_state_tensor_parallel(s));
        cJSON_AddStringToObject(j, "gemm", sp->device_fast_gemm ? "cublas" : "invariant");
        cJSON_AddStringToObject(j, "matmul", sp->device ? "device" : mcli_matmul_name(mcli_exact));
        cJSON_AddStringToObject(j, "kv", o->kv);
        cJSON_AddStringToObject(j, "kv_layers", o->kv_layers);
        if (o->kv_policy) cJSON_AddStringToObject(j, "kv_policy", o->kv_policy);
        else cJSON_AddNullToObject(j, "kv_policy");
        if (o->preset || o->kv_policy) cJSON_AddStringToObject(j, "kv_resolved", resolved);
        else cJSON_AddNullToObject(j, "kv_resolved");
        /* everything counted at ctx: scales, per-layer mix, window ring, sliding layers */
        json_add_num(j, "kv_bits_per_value", kv_bits, 4);
        json_add_num(j, "kv_format_bits", tqkv_model_state_kv_bits_per_value(s), 4);
        cJSON_AddNumberToObject(j, "ctx", ctx);
        cJSON_AddNumberToObject(j, "window", o->window);
        cJSON_AddBoolToObject(j, "window_keys_only", o->window_k != 0);
        cJSON_AddNumberToObject(j, "window_slack", sp->window_slack);
        cJSON_AddNumberToObject(j, "chunk", o->chunk);
        json_add_num(j, "forward_tokens_per_s",
                     r->t_fwd > 0 ? (double)cnt * (do_kld ? 2 : 1) / r->t_fwd : 0.0, 1);
        if (json_print(stdout, j, 0, CMD)) return -1;
    }
    fflush(stdout);
    return 0;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_ppl(int argc, char **argv) {
    ppl_opts o;
    int rc = ppl_parse_args(argc, argv, &o);
    if (rc) return rc;

    rc = 1;
    char *text = NULL;
    size_t text_len = 0;
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    tqkv_model_state *s = NULL, *ref = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (mcli_read_file(CMD, o.text_path, &text, &text_len)) goto done;
    if (mcli_load_dev(CMD, o.dir, o.blas, 0, o.threads, o.sp.device, &m)) goto done;
    if (tqkv_tokenizer_load(&tok, o.dir) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        goto done;
    }
    double t0 = mcli_now();
    if (tqkv_tokenizer_encode(tok, text, text_len, 0, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv ppl: %s\n", tqkv_last_error());
        goto done;
    }
    int n_win = n_ids > 1 ? (int)((n_ids - 1) / (size_t)o.ctx) : 0;
    n_win = n_win > o.first_window ? n_win - o.first_window : 0;
    if (o.max_windows > 0 && n_win > o.max_windows) n_win = o.max_windows;
    fprintf(stderr, "tqkv ppl: %zu tokens (tokenized in %.1f s), %d windows x %d, kv %s%s\n", n_ids,
            mcli_now() - t0, n_win, o.ctx, o.kv, o.kld ? ", with KLD" : "");
    if (n_win == 0) {
        fprintf(stderr, "tqkv ppl: text too short for one window of %d tokens (+1) from window "
                "%d\n", o.ctx, o.first_window);
        goto done;
    }
    char resolved[KVP_DESC] = "";
    ppl_sums sums;
    if (ppl_states_init(&o, m, &s, &ref, resolved) ||
        ppl_score(&o, m, s, ref, ids + (size_t)o.first_window * o.ctx, n_win, &sums) ||
        ppl_report(&o, m, s, ref != NULL, n_win, &sums, resolved))
        goto done;
    rc = 0;
done:
    free(ids);
    free(text);
    tqkv_model_state_free(s);
    tqkv_model_state_free(ref);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
    return rc;
}

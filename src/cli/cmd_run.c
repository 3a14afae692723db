/*
 * cmd_run.c - `tqkv run`: generate text from a prompt, streamed to stdout.
 * Owns: argument handling, the prompt (plain or ChatML), the generation loop, streaming
 * decode output and the --json summary line.
 * Must not: contain model, cache or tokenizer logic.
 *
 * Sampling defaults follow Hugging Face generate(): with generation_config.json
 * do_sample = true, its temperature / top_k / top_p / min_p / repetition_penalty; without it
 * (the bundled model), greedy. Any sampling flag given on the command line overrides, and
 * --temp > 0 alone turns sampling on (top-k/top-p off unless given).
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "json_out.h"
#include "kv_policy.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "run";

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

/* UNSET: an int the parser cannot produce (it reads -2147483647 .. 2147483647) */
enum { UNSET = INT_MIN };

typedef struct {
    const char *model_arg, *prompt, *prompt_file;
    const char *kv, *kv_layers, *prefill_kernel, *decode_kernel, *kv_policy;
    kv_policy pol;                  /* --kv-policy FILE, applied once the model is loaded */
    const char *device;
    int n_gen, top_k, seed, window, threads, chat, json, fast_gemm, tp;
    int ignore_eos, kv_seed, blas, f32w;
    double temp, top_p, min_p, rep; /* NAN: not given */
    int preset;                     /* --kv is a preset (auto:B), resolved once the model is loaded */
    tqkv_model_state_params sp;     /* formats, kernels, device from the options */
    char dir[4096];                 /* the resolved model directory */
    char resolved[KVP_DESC];        /* the preset's resolved spec ("" when --kv is no preset) */
} run_opts;

/* Out-of-range sampling options are refused here, never replaced by a default; 0 or -1
 * (message printed). */
static int run_check_sampling(const run_opts *o) {
    if (o->top_k != UNSET && o->top_k < 0) {
        fprintf(stderr, "tqkv run: --top-k must be >= 0 (0 = off), got %d\n", o->top_k);
        return -1;
    }
    if (o->seed != UNSET && o->seed < 0) {
        fprintf(stderr, "tqkv run: --seed must be >= 0, got %d\n", o->seed);
        return -1;
    }
    if ((!isnan(o->temp) && o->temp < 0) || (!isnan(o->top_p) && !(o->top_p > 0 && o->top_p <= 1)) ||
        (!isnan(o->min_p) && !(o->min_p >= 0 && o->min_p <= 1)) || (!isnan(o->rep) && !(o->rep > 0))) {
        fprintf(stderr, "tqkv run: need --temp >= 0, 0 < --top-p <= 1, 0 <= --min-p <= 1, "
                "--repeat-penalty > 0\n");
        return -1;
    }
    return 0;
}

/* Defaults, the command line and its checks; 0, or the exit code (message printed). */
static int run_parse_args(int argc, char **argv, run_opts *o) {
    *o = (run_opts){
        .model_arg = MCLI_DEFAULT_MODEL, .kv_layers = "",
        .prefill_kernel = "graph", .decode_kernel = "graph", .device = "cpu",
        .n_gen = 128, .top_k = UNSET, .seed = UNSET,
        .temp = NAN, .top_p = NAN, .min_p = NAN, .rep = NAN,
    };
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--prompt", ARG_STR, &o->prompt, "prompt text"},
        {"--prompt-file", ARG_STR, &o->prompt_file, "read the prompt from a file (- = stdin)"},
        {"-n", ARG_INT, &o->n_gen, "tokens to generate (default 128)"},
        {"--temp", ARG_DOUBLE, &o->temp, "temperature; 0 = greedy (default: generation_config, else greedy)"},
        {"--top-k", ARG_INT, &o->top_k, "top-k (0 = off)"},
        {"--top-p", ARG_DOUBLE, &o->top_p, "top-p (1 = off)"},
        {"--min-p", ARG_DOUBLE, &o->min_p, "min-p (0 = off)"},
        {"--repeat-penalty", ARG_DOUBLE, &o->rep, "repetition penalty (1 = off)"},
        {"--seed", ARG_INT, &o->seed, "sampling seed (default: from the clock)"},
        {"--kv", ARG_STR, &o->kv, "KV cache format: f32|f16|q8|q4|tq2|tq3|tq4|fp8, K/V, or a preset auto:B (default " MCLI_DEFAULT_KV "; tq4 with --window or --kv-layers)"},
        {"--kv-layers", ARG_STR, &o->kv_layers, "per-layer KV formats, e.g. '0,7:q8'"},
        {"--kv-policy", ARG_STR, &o->kv_policy, "KV policy file from `tqkv calibrate` (formats, per-layer formats, window; instead of --kv)"},
        {"--window", ARG_INT, &o->window, "newest tokens kept at q8 beside a tq cache (default 0)"},
        {"--kv-seed", ARG_INT, &o->kv_seed, "rotation seed of the KV cache (layer l: seed + l)"},
        {"--threads", ARG_INT, &o->threads, "threads (default: all CPUs)"},
        {"--chat", ARG_FLAG, &o->chat, "wrap the prompt in the ChatML template"},
        {"--ignore-eos", ARG_FLAG, &o->ignore_eos, "do not stop at end-of-sequence tokens"},
        {"--json", ARG_FLAG, &o->json, "end with a JSON summary line"},
        {"--prefill-kernel", ARG_STR, &o->prefill_kernel, "attention kernel for prefill: graph (the graph's kernel set, default), dense, deferred, fused"},
        {"--decode-kernel", ARG_STR, &o->decode_kernel, "attention kernel for decode: graph (default), dense, deferred, fused"},
        {"--blas", ARG_FLAG, &o->blas, "OpenBLAS sgemm for prefill matmuls (not batch invariant)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--f32-weights", ARG_FLAG, &o->f32w, "convert weights to f32 at load"},
        {"--device", ARG_STR, &o->device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &o->fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
        {"--tensor-parallel", ARG_INT, &o->tp, MCLI_TP_HELP},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!o->prompt == !o->prompt_file) {
        fprintf(stderr, "tqkv run: give exactly one of --prompt or --prompt-file\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    if (o->n_gen < 0 || o->n_gen > (1 << 24) || o->window < 0 || o->threads < 0) {
        fprintf(stderr, "tqkv run: -n (at most 16777216), --window and --threads must be >= 0\n");
        return 2;
    }
    if (run_check_sampling(o)) return 2;
    if (o->threads == 0) o->threads = mcli_cpus();
    tqkv_model_state_params *sp = &o->sp;
    *sp = tqkv_model_state_params_default();
    sp->device_fast_gemm = o->fast_gemm;
    if (o->kv_policy && (o->kv || o->window || o->kv_layers[0])) {
        fprintf(stderr, "tqkv run: --kv-policy sets the formats and the window; drop --kv, "
                "--window and --kv-layers\n");
        return 2;
    }
    if (o->kv_policy && kvpol_load(CMD, o->kv_policy, &o->pol)) return 2;
    if (!o->kv) o->kv = mcli_default_kv(o->window || o->kv_layers[0] || o->kv_policy);
    o->preset = kvp_is_preset(o->kv);
    if (o->preset && (o->window || o->kv_layers[0])) {
        fprintf(stderr, "tqkv run: --kv %s chooses the window and per-layer formats itself; "
                "drop --window / --kv-layers\n", o->kv);
        return 2;
    }
    if ((!o->preset && (mcli_parse_kv(CMD, o->kv, &sp->k_format, &sp->v_format) ||
                        mcli_parse_kv_layers(CMD, o->kv_layers, sp) ||
                        mcli_check_window(CMD, o->window, sp->k_format, sp->v_format))) ||
        mcli_parse_kernel(CMD, o->prefill_kernel, &sp->prefill_kernel) ||
        mcli_parse_kernel(CMD, o->decode_kernel, &sp->decode_kernel) ||
        mcli_parse_device(CMD, o->device, &sp->device) ||
        mcli_parse_tp(CMD, o->tp, sp->device, sp))
        return 2;
    if (!mcli_resolve_model(CMD, o->model_arg, o->dir, sizeof o->dir)) return 1;
    return 0;
}

/* The prompt's bytes (--prompt or --prompt-file, wrapped in ChatML with --chat) into
 * *text [*len] (may hold NUL bytes); 0 or -1 (message printed). */
static int run_read_prompt(const run_opts *o, char **text, size_t *len) {
    char *ptext = NULL;
    size_t plen = 0;
    if (o->prompt_file) {
        if (mcli_read_file(CMD, o->prompt_file, &ptext, &plen)) return -1;
    } else {
        plen = strlen(o->prompt);
        ptext = strdup(o->prompt);
    }
    if (ptext && o->chat) {
        const char *pre = "<|im_start|>user\n", *post = "<|im_end|>\n<|im_start|>assistant\n";
        size_t n = strlen(pre) + plen + strlen(post);
        char *w = malloc(n + 1);
        if (w) {
            memcpy(w, pre, strlen(pre));
            memcpy(w + strlen(pre), ptext, plen); /* the prompt may hold NUL bytes */
            memcpy(w + strlen(pre) + plen, post, strlen(post) + 1);
        }
        free(ptext);
        ptext = w;
        plen = n;
    }
    if (!ptext) {
        fprintf(stderr, "tqkv run: out of memory\n");
        return -1;
    }
    *text = ptext;
    *len = plen;
    return 0;
}

/* Sampling parameters: generation_config.json's when it samples, then the options. */
static tqkv_sampler_params run_sampler_params(const run_opts *o, const tqkv_generation_config *gc) {
    tqkv_sampler_params pp = tqkv_sampler_params_default();
    if (gc->do_sample) {
        pp.temperature = gc->temperature;
        pp.top_k = gc->top_k;
        pp.top_p = gc->top_p;
        pp.min_p = gc->min_p;
    }
    pp.repetition_penalty = gc->repetition_penalty;
    if (!isnan(o->temp)) {
        pp.temperature = (float)o->temp;
        if (!gc->do_sample) pp.top_k = 0;
    }
    if (o->top_k != UNSET) pp.top_k = o->top_k;
    if (!isnan(o->top_p)) pp.top_p = (float)o->top_p;
    if (!isnan(o->min_p)) pp.min_p = (float)o->min_p;
    if (!isnan(o->rep)) pp.repetition_penalty = (float)o->rep;
    pp.seed = o->seed != UNSET ? (uint64_t)o->seed : (uint64_t)time(NULL);
    return pp;
}

// ---------------------------------------------------------------------------
// Session: model, tokenizer, sampler, state
// ---------------------------------------------------------------------------

typedef struct {
    tqkv_model *m;
    tqkv_tokenizer *tok;
    tqkv_model_state *s;
    tqkv_sampler *smp;
    tqkv_decode_stream *ds;
    tqkv_sampler_params pp;
    int32_t *ids;     /* [n_ids] prompt tokens */
    size_t n_ids;
    int32_t *gen;     /* [n_gen + 1] generated tokens */
    float *logits;    /* [vocab] */
    int32_t im_end;   /* a chat turn also ends here; -1: none */
} run_session;

static void run_session_free(run_session *r) {
    free(r->logits);
    free(r->gen);
    free(r->ids);
    tqkv_decode_stream_free(r->ds);
    tqkv_sampler_free(r->smp);
    tqkv_model_state_free(r->s);
    tqkv_tokenizer_free(r->tok);
    tqkv_model_free(r->m);
}

/* Loads model and tokenizer, tokenizes the prompt ptext [plen], makes the sampler, caps
 * o->n_gen at the context, makes state, decode stream and buffers; 0 or -1 (message
 * printed; what was made is left in r for run_session_free). */
static int run_session_init(run_opts *o, const char *ptext, size_t plen, run_session *r) {
    if (mcli_load_dev(CMD, o->dir, o->blas, o->f32w, o->threads, o->sp.device, &r->m)) return -1;
    if (tqkv_tokenizer_load(&r->tok, o->dir) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    if (tqkv_tokenizer_encode(r->tok, ptext, plen, TQKV_ENCODE_ADD_SPECIAL, &r->ids, &r->n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    if (r->n_ids == 0) {
        fprintf(stderr, "tqkv run: the prompt has no tokens\n");
        return -1;
    }
    const tqkv_model_config *cfg = tqkv_model_get_config(r->m);
    r->pp = run_sampler_params(o, tqkv_model_get_generation(r->m));
    if (tqkv_sampler_init(&r->smp, &r->pp, cfg->vocab_size) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    for (size_t i = 0; i < r->n_ids; i++) tqkv_sampler_accept(r->smp, r->ids[i]);
    r->im_end = -1; /* a chat turn also ends at <|im_end|> */
    if (o->chat && tqkv_tokenizer_token_to_id(r->tok, "<|im_end|>", 10, &r->im_end) != TQKV_OK)
        r->im_end = -1;

    /* the context limit (max_position_embeddings): refuse a prompt past it, stop there */
    const int ctx_len = tqkv_model_context_len(r->m);
    if ((long long)r->n_ids > ctx_len) {
        fprintf(stderr, "tqkv run: the prompt has %zu tokens, more than the model's context of %d "
                "tokens (max_position_embeddings)\n", r->n_ids, ctx_len);
        return -1;
    }
    if ((long long)r->n_ids + o->n_gen > ctx_len) {
        fprintf(stderr, "tqkv run: -n %d would pass the context of %d tokens; generating at most "
                "%lld\n", o->n_gen, ctx_len, (long long)ctx_len - (long long)r->n_ids);
        o->n_gen = ctx_len - (int)r->n_ids;
    }
    tqkv_model_state_params *sp = &o->sp;
    sp->rows = 1;
    sp->window = o->window;
    if (o->preset) { /* resolved at the model's context length */
        if (kvp_resolve_model(CMD, r->m, o->dir, o->kv, ctx_len, sp, o->resolved,
                              sizeof o->resolved)) return -1;
        fprintf(stderr, "tqkv run: --kv %s -> %s\n", o->kv, o->resolved);
    }
    if (o->kv_policy) { /* checked at the model's context length */
        if (kvpol_apply(CMD, r->m, &o->pol, ctx_len, sp, o->resolved, sizeof o->resolved))
            return -1;
        o->kv = o->pol.kv;
        fprintf(stderr, "tqkv run: --kv-policy %s -> %s\n", o->kv_policy, o->resolved);
    }
    sp->kv_seed = (uint64_t)o->kv_seed;
    sp->threads = o->threads;
    sp->blas = o->blas;
    if (tqkv_model_state_init(&r->s, r->m, sp) != TQKV_OK ||
        tqkv_decode_stream_init(&r->ds, r->tok, TQKV_DECODE_SKIP_SPECIAL) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    r->logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    r->gen = malloc(sizeof(int32_t) * (size_t)(o->n_gen + 1));
    if (!r->logits || !r->gen) {
        fprintf(stderr, "tqkv run: out of memory\n");
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------

/* What came out: text streamed so far and the timings. */
typedef struct {
    char *text;         /* [text_len] the decoded text, also streamed to stdout */
    size_t text_len, text_cap;
    int n_out, n_decode, last_nl;
    double t_prefill, t_decode;
} run_output;

/* Append piece [n] to the growing buffer *buf [*len of *cap]; 0 or -1 (buffer kept). */
static int text_append(char **buf, size_t *len, size_t *cap, const char *piece, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 4096;
        while (*len + n + 1 > nc) nc *= 2;
        char *nb = realloc(*buf, nc);
        if (!nb) return -1;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, piece, n);
    *len += n;
    return 0;
}

/* Streams piece [n] to stdout (flushed when asked) and keeps it in out; 0 or -1. */
static int run_emit(run_output *out, const char *piece, size_t n, int flush) {
    fwrite(piece, 1, n, stdout);
    if (flush) fflush(stdout);
    out->last_nl = piece[n - 1] == '\n';
    return text_append(&out->text, &out->text_len, &out->text_cap, piece, n);
}

/* Prefill, then up to o->n_gen tokens streamed to stdout (stopping at end of sequence
 * unless --ignore-eos); 0 or -1 (message printed). */
static int run_generate(const run_opts *o, run_session *r, run_output *out) {
    *out = (run_output){.last_nl = 1};
    const int n_gen = o->n_gen, device = o->sp.device;
    fprintf(stderr, "tqkv run: %zu prompt tokens, kv %s (%.3f bits/value), %d threads, %s\n",
            r->n_ids, o->kv, tqkv_model_state_kv_bits_per_value(r->s), o->threads,
            r->pp.temperature == 0 ? "greedy" : "sampling");
    double t0 = mcli_now();
    if (tqkv_model_prefill(r->m, r->s, r->ids, NULL, (int)r->n_ids, TQKV_LOGITS_LAST, r->logits) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    out->t_prefill = mcli_now() - t0;
    /* the first token from the prefill's logits; then each step gives the next: on the
     * device it is picked there (tqkv_model_decode_pick: the same token as the sampler on
     * the full row, but one token or top_k candidates come back instead of vocab logits),
     * on the CPU the sampler runs on the step's logits */
    int t = -1;
    if (n_gen > 0 && tqkv_sampler_sample(r->smp, r->logits, &t) != TQKV_OK) {
        fprintf(stderr, "\ntqkv run: %s\n", tqkv_last_error());
        return -1;
    }
    while (out->n_out < n_gen) {
        if (!o->ignore_eos && (tqkv_model_is_eos(r->m, t) || t == r->im_end)) break;
        r->gen[out->n_out++] = t;
        tqkv_sampler_accept(r->smp, t);
        const char *piece;
        size_t plen2;
        if (tqkv_decode_stream_push(r->ds, t, &piece, &plen2) == TQKV_OK && plen2 &&
            run_emit(out, piece, plen2, 1))
            goto oom;
        if (out->n_out == n_gen) break;
        double td = mcli_now();
        int32_t in = t, picked = -1;
        tqkv_status st;
        if (device) {
            st = tqkv_model_decode_pick(r->m, r->s, &in, &r->smp, &picked);
            if (st == TQKV_OK && picked < 0) st = TQKV_EINVAL; /* the sampler's error */
        } else {
            st = tqkv_model_decode(r->m, r->s, &in, r->logits);
        }
        out->t_decode += mcli_now() - td;
        out->n_decode++;
        if (st == TQKV_OK && !device) st = tqkv_sampler_sample(r->smp, r->logits, &picked);
        if (st != TQKV_OK) {
            fprintf(stderr, "\ntqkv run: %s\n", tqkv_last_error());
            return -1;
        }
        t = picked;
    }
    const char *piece;
    size_t plen2;
    if (tqkv_decode_stream_flush(r->ds, &piece, &plen2) == TQKV_OK && plen2 &&
        run_emit(out, piece, plen2, 0))
        goto oom;
    return 0;
oom:
    fprintf(stderr, "\ntqkv run: out of memory\n");
    return -1;
}

/* The speed line on stderr and, with --json, the summary line; 0 or -1. */
static int run_report(const run_opts *o, const run_session *r, const run_output *out) {
    double pp_tps = out->t_prefill > 0 ? (double)r->n_ids / out->t_prefill : 0;
    double tg_tps = out->t_decode > 0 ? out->n_decode / out->t_decode : 0;
    fprintf(stderr, "%stqkv run: prompt %zu tokens in %.1f ms (%.1f t/s); generated %d tokens, "
            "decode %.1f t/s\n", out->last_nl ? "" : "\n", r->n_ids, out->t_prefill * 1e3, pp_tps,
            out->n_out, tg_tps);
    if (o->json) {
        if (!out->last_nl) fputc('\n', stdout);
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(j, "text", json_bytes(out->text ? out->text : "", out->text_len));
        json_add_ints(j, "tokens", r->gen, (size_t)out->n_out);
        cJSON_AddNumberToObject(j, "prompt_tokens", (double)r->n_ids);
        cJSON_AddStringToObject(j, "kv", o->kv);
        if (o->preset || o->kv_policy) cJSON_AddStringToObject(j, "kv_resolved", o->resolved);
        json_add_num(j, "kv_bits_per_value", tqkv_model_state_kv_bits_per_value(r->s), 4);
        json_add_num(j, "kv_bytes_per_token", tqkv_model_state_kv_bytes_per_token(r->s), 1);
        cJSON_AddNumberToObject(j, "tensor_parallel", tqkv_model_state_tensor_parallel(r->s));
        /* the cache bytes one rank holds (all of them without tensor parallelism) */
        cJSON_AddNumberToObject(j, "kv_bytes_rank0", (double)tqkv_model_state_kv_bytes_rank(r->s, 0));
        json_add_num(j, "prefill_tokens_per_s", pp_tps, 2);
        json_add_num(j, "decode_tokens_per_s", tg_tps, 2);
        cJSON_AddNumberToObject(j, "seed", (double)r->pp.seed);
        json_add_num(j, "temperature", r->pp.temperature, 6);
        if (json_print(stdout, j, 0, CMD)) return -1;
    } else if (!out->last_nl) {
        fputc('\n', stdout);
    }
    fflush(stdout);
    return 0;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_run(int argc, char **argv) {
    run_opts o;
    int rc = run_parse_args(argc, argv, &o);
    if (rc) return rc;
    char *ptext = NULL;
    size_t plen = 0;
    if (run_read_prompt(&o, &ptext, &plen)) return 1;
    run_session r = {0};
    run_output out = {0};
    rc = run_session_init(&o, ptext, plen, &r) || run_generate(&o, &r, &out) ||
                 run_report(&o, &r, &out)
             ? 1
             : 0;
    free(out.text);
    free(ptext);
    run_session_free(&r);
    return rc;
}

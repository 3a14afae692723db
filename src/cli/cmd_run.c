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
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

static const char *CMD = "run";

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

int cmd_run(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *prompt = NULL, *prompt_file = NULL;
    const char *kv = "f32", *kv_layers = "", *prefill_kernel = "graph", *decode_kernel = "graph";
    const char *device = "cpu";
    /* UNSET: an int the parser cannot produce (it reads -2147483647 .. 2147483647) */
    enum { UNSET = INT_MIN };
    int n_gen = 128, top_k = UNSET, seed = UNSET, window = 0, threads = 0, chat = 0, json = 0, fast_gemm = 0;
    int ignore_eos = 0, kv_seed = 0, blas = 0, f32w = 0;
    double temp = NAN, top_p = NAN, min_p = NAN, rep = NAN;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--prompt", ARG_STR, &prompt, "prompt text"},
        {"--prompt-file", ARG_STR, &prompt_file, "read the prompt from a file (- = stdin)"},
        {"-n", ARG_INT, &n_gen, "tokens to generate (default 128)"},
        {"--temp", ARG_DOUBLE, &temp, "temperature; 0 = greedy (default: generation_config, else greedy)"},
        {"--top-k", ARG_INT, &top_k, "top-k (0 = off)"},
        {"--top-p", ARG_DOUBLE, &top_p, "top-p (1 = off)"},
        {"--min-p", ARG_DOUBLE, &min_p, "min-p (0 = off)"},
        {"--repeat-penalty", ARG_DOUBLE, &rep, "repetition penalty (1 = off)"},
        {"--seed", ARG_INT, &seed, "sampling seed (default: from the clock)"},
        {"--kv", ARG_STR, &kv, "KV cache format: f32|f16|q8|q4|tq2|tq3|tq4|fp8, K/V, or a preset auto:B (default f32)"},
        {"--kv-layers", ARG_STR, &kv_layers, "per-layer KV formats, e.g. '0,7:q8'"},
        {"--window", ARG_INT, &window, "newest tokens kept at q8 beside a tq cache (default 0)"},
        {"--kv-seed", ARG_INT, &kv_seed, "rotation seed of the KV cache (layer l: seed + l)"},
        {"--threads", ARG_INT, &threads, "threads (default: all CPUs)"},
        {"--chat", ARG_FLAG, &chat, "wrap the prompt in the ChatML template"},
        {"--ignore-eos", ARG_FLAG, &ignore_eos, "do not stop at end-of-sequence tokens"},
        {"--json", ARG_FLAG, &json, "end with a JSON summary line"},
        {"--prefill-kernel", ARG_STR, &prefill_kernel, "attention kernel for prefill: graph (the graph's kernel set, default), dense, deferred, fused"},
        {"--decode-kernel", ARG_STR, &decode_kernel, "attention kernel for decode: graph (default), dense, deferred, fused"},
        {"--blas", ARG_FLAG, &blas, "OpenBLAS sgemm for prefill matmuls (not batch invariant)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--f32-weights", ARG_FLAG, &f32w, "convert weights to f32 at load"},
        {"--device", ARG_STR, &device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (!prompt == !prompt_file) {
        fprintf(stderr, "tqkv run: give exactly one of --prompt or --prompt-file\n");
        args_usage(stderr, CMD, specs, n_specs);
        return 2;
    }
    if (n_gen < 0 || n_gen > (1 << 24) || window < 0 || threads < 0) {
        fprintf(stderr, "tqkv run: -n (at most 16777216), --window and --threads must be >= 0\n");
        return 2;
    }
    /* out-of-range sampling options are refused here, never replaced by a default */
    if (top_k != UNSET && top_k < 0) {
        fprintf(stderr, "tqkv run: --top-k must be >= 0 (0 = off), got %d\n", top_k);
        return 2;
    }
    if (seed != UNSET && seed < 0) {
        fprintf(stderr, "tqkv run: --seed must be >= 0, got %d\n", seed);
        return 2;
    }
    if ((!isnan(temp) && temp < 0) || (!isnan(top_p) && !(top_p > 0 && top_p <= 1)) ||
        (!isnan(min_p) && !(min_p >= 0 && min_p <= 1)) || (!isnan(rep) && !(rep > 0))) {
        fprintf(stderr, "tqkv run: need --temp >= 0, 0 < --top-p <= 1, 0 <= --min-p <= 1, "
                "--repeat-penalty > 0\n");
        return 2;
    }
    if (threads == 0) threads = mcli_cpus();
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.device_fast_gemm = fast_gemm;
    const int preset = kvp_is_preset(kv);
    if (preset && (window || kv_layers[0])) {
        fprintf(stderr, "tqkv run: --kv %s chooses the window and per-layer formats itself; "
                "drop --window / --kv-layers\n", kv);
        return 2;
    }
    if ((!preset && (mcli_parse_kv(CMD, kv, &sp.k_format, &sp.v_format) ||
                     mcli_parse_kv_layers(CMD, kv_layers, &sp) ||
                     mcli_check_window(CMD, window, sp.k_format, sp.v_format))) ||
        mcli_parse_kernel(CMD, prefill_kernel, &sp.prefill_kernel) ||
        mcli_parse_kernel(CMD, decode_kernel, &sp.decode_kernel) ||
        mcli_parse_device(CMD, device, &sp.device))
        return 2;
    char dir[4096];
    if (!mcli_resolve_model(CMD, model_arg, dir, sizeof dir)) return 1;

    char *ptext = NULL;
    size_t plen = 0;
    if (prompt_file) {
        if (mcli_read_file(CMD, prompt_file, &ptext, &plen)) return 1;
    } else {
        plen = strlen(prompt);
        ptext = strdup(prompt);
    }
    if (ptext && chat) {
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
        return 1;
    }

    int rc = 1;
    tqkv_model *m = NULL;
    tqkv_tokenizer *tok = NULL;
    tqkv_model_state *s = NULL;
    tqkv_sampler *smp = NULL;
    tqkv_decode_stream *ds = NULL;
    int32_t *ids = NULL, *gen = NULL;
    size_t n_ids = 0;
    float *logits = NULL;
    if (mcli_load_dev(CMD, dir, blas, f32w, threads, sp.device, &m)) goto done;
    if (tqkv_tokenizer_load(&tok, dir) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        goto done;
    }
    if (tqkv_tokenizer_encode(tok, ptext, plen, TQKV_ENCODE_ADD_SPECIAL, &ids, &n_ids) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        goto done;
    }
    if (n_ids == 0) {
        fprintf(stderr, "tqkv run: the prompt has no tokens\n");
        goto done;
    }
    const tqkv_model_config *cfg = tqkv_model_get_config(m);
    const tqkv_generation_config *gc = tqkv_model_get_generation(m);

    /* sampling parameters */
    tqkv_sampler_params pp = tqkv_sampler_params_default();
    if (gc->do_sample) {
        pp.temperature = gc->temperature;
        pp.top_k = gc->top_k;
        pp.top_p = gc->top_p;
        pp.min_p = gc->min_p;
    }
    pp.repetition_penalty = gc->repetition_penalty;
    if (!isnan(temp)) {
        pp.temperature = (float)temp;
        if (!gc->do_sample) pp.top_k = 0;
    }
    if (top_k != UNSET) pp.top_k = top_k;
    if (!isnan(top_p)) pp.top_p = (float)top_p;
    if (!isnan(min_p)) pp.min_p = (float)min_p;
    if (!isnan(rep)) pp.repetition_penalty = (float)rep;
    pp.seed = seed != UNSET ? (uint64_t)seed : (uint64_t)time(NULL);
    if (tqkv_sampler_init(&smp, &pp, cfg->vocab_size) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        goto done;
    }
    for (size_t i = 0; i < n_ids; i++) tqkv_sampler_accept(smp, ids[i]);
    int32_t im_end = -1; /* a chat turn also ends at <|im_end|> */
    if (chat && tqkv_tokenizer_token_to_id(tok, "<|im_end|>", 10, &im_end) != TQKV_OK) im_end = -1;

    /* the context limit (max_position_embeddings): refuse a prompt past it, stop there */
    const int ctx_len = tqkv_model_context_len(m);
    if ((long long)n_ids > ctx_len) {
        fprintf(stderr, "tqkv run: the prompt has %zu tokens, more than the model's context of %d "
                "tokens (max_position_embeddings)\n", n_ids, ctx_len);
        goto done;
    }
    if ((long long)n_ids + n_gen > ctx_len) {
        fprintf(stderr, "tqkv run: -n %d would pass the context of %d tokens; generating at most "
                "%lld\n", n_gen, ctx_len, (long long)ctx_len - (long long)n_ids);
        n_gen = ctx_len - (int)n_ids;
    }
    sp.rows = 1;
    sp.window = window;
    if (preset) { /* resolved at the model's context length */
        char resolved[256];
        if (kvp_resolve(CMD, m, kv, ctx_len, &sp, resolved, sizeof resolved)) goto done;
        fprintf(stderr, "tqkv run: --kv %s -> %s\n", kv, resolved);
    }
    sp.kv_seed = (uint64_t)kv_seed;
    sp.threads = threads;
    sp.blas = blas;
    if (tqkv_model_state_init(&s, m, &sp) != TQKV_OK ||
        tqkv_decode_stream_init(&ds, tok, TQKV_DECODE_SKIP_SPECIAL) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        goto done;
    }
    logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    gen = malloc(sizeof(int32_t) * (size_t)(n_gen + 1));
    if (!logits || !gen) {
        fprintf(stderr, "tqkv run: out of memory\n");
        goto done;
    }

    fprintf(stderr, "tqkv run: %zu prompt tokens, kv %s (%.3f bits/value), %d threads, %s\n", n_ids,
            kv, tqkv_model_state_kv_bits_per_value(s), threads,
            pp.temperature == 0 ? "greedy" : "sampling");
    double t0 = mcli_now();
    if (tqkv_model_prefill(m, s, ids, NULL, (int)n_ids, TQKV_LOGITS_LAST, logits) != TQKV_OK) {
        fprintf(stderr, "tqkv run: %s\n", tqkv_last_error());
        goto done;
    }
    double t_prefill = mcli_now() - t0, t_decode = 0;
    int n_out = 0, n_decode = 0;
    size_t text_cap = 0, text_len = 0;
    char *text = NULL;
    int last_nl = 1;
    /* the first token from the prefill's logits; then each step gives the next: on the
     * device it is picked there (tqkv_model_decode_pick: the same token as the sampler on
     * the full row, but one token or top_k candidates come back instead of vocab logits),
     * on the CPU the sampler runs on the step's logits */
    int t = -1;
    if (n_gen > 0 && tqkv_sampler_sample(smp, logits, &t) != TQKV_OK) {
        fprintf(stderr, "\ntqkv run: %s\n", tqkv_last_error());
        free(text);
        goto done;
    }
    while (n_out < n_gen) {
        if (!ignore_eos && (tqkv_model_is_eos(m, t) || t == im_end)) break;
        gen[n_out++] = t;
        tqkv_sampler_accept(smp, t);
        const char *piece;
        size_t plen2;
        if (tqkv_decode_stream_push(ds, t, &piece, &plen2) == TQKV_OK && plen2) {
            fwrite(piece, 1, plen2, stdout);
            fflush(stdout);
            last_nl = piece[plen2 - 1] == '\n';
            if (text_append(&text, &text_len, &text_cap, piece, plen2)) goto oom;
        }
        if (n_out == n_gen) break;
        double td = mcli_now();
        int32_t in = t, picked = -1;
        tqkv_status st;
        if (sp.device) {
            st = tqkv_model_decode_pick(m, s, &in, &smp, &picked);
            if (st == TQKV_OK && picked < 0) st = TQKV_EINVAL; /* the sampler's error */
        } else {
            st = tqkv_model_decode(m, s, &in, logits);
        }
        t_decode += mcli_now() - td;
        n_decode++;
        if (st == TQKV_OK && !sp.device) st = tqkv_sampler_sample(smp, logits, &picked);
        if (st != TQKV_OK) {
            fprintf(stderr, "\ntqkv run: %s\n", tqkv_last_error());
            free(text);
            goto done;
        }
        t = picked;
    }
    const char *piece;
    size_t plen2;
    if (tqkv_decode_stream_flush(ds, &piece, &plen2) == TQKV_OK && plen2) {
        fwrite(piece, 1, plen2, stdout);
        last_nl = piece[plen2 - 1] == '\n';
        if (text_append(&text, &text_len, &text_cap, piece, plen2)) goto oom;
    }
    double pp_tps = t_prefill > 0 ? (double)n_ids / t_prefill : 0;
    double tg_tps = t_decode > 0 ? n_decode / t_decode : 0;
    fprintf(stderr, "%stqkv run: prompt %zu tokens in %.1f ms (%.1f t/s); generated %d tokens, "
            "decode %.1f t/s\n", last_nl ? "" : "\n", n_ids, t_prefill * 1e3, pp_tps, n_out, tg_tps);
    if (json) {
        if (!last_nl) fputc('\n', stdout);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "text", json_bytes(text ? text : "", text_len));
        json_add_ints(o, "tokens", gen, (size_t)n_out);
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)n_ids);
        cJSON_AddStringToObject(o, "kv", kv);
        json_add_num(o, "kv_bits_per_value", tqkv_model_state_kv_bits_per_value(s), 4);
        json_add_num(o, "kv_bytes_per_token", tqkv_model_state_kv_bytes_per_token(s), 1);
        json_add_num(o, "prefill_tokens_per_s", pp_tps, 2);
        json_add_num(o, "decode_tokens_per_s", tg_tps, 2);
        cJSON_AddNumberToObject(o, "seed", (double)pp.seed);
        json_add_num(o, "temperature", pp.temperature, 6);
        if (json_print(stdout, o, 0, CMD)) goto done;
    } else if (!last_nl) {
        fputc('\n', stdout);
    }
    fflush(stdout);
    free(text);
    rc = 0;
    goto done;
oom:
    fprintf(stderr, "\ntqkv run: out of memory\n");
    free(text);
done:
    free(logits);
    free(gen);
    free(ids);
    free(ptext);
    tqkv_decode_stream_free(ds);
    tqkv_sampler_free(smp);
    tqkv_model_state_free(s);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(m);
    return rc;
}

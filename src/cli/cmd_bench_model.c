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
 * launched kernel by kernel and as a CUDA graph, side by side, and prints their ratio
 * (with --tensor-parallel N too: the sharded decode graph, TQKV_TP_GRAPHS, is opted in
 * unless the environment says otherwise);
 * --pick host,device likewise the next token picked on the host (the logits [rows, vocab]
 * copied back, argmax there) and on the device (tqkv_model_decode_pick: one int per row).
 * --rows takes a list (every row count measured from one model load: a 61 GB checkpoint
 * loads once); --max-rows finds the most rows whose caches fit per (ctx, kv), and
 * --at-max-rows then measures decode at that many rows; --shape names the model's shape
 * in every JSON row (e.g. qwen3-30b-a3b for a random checkpoint of that shape).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "tqkv_model.h"

static const char *CMD = "bench model";

// ---------------------------------------------------------------------------
// One configuration
// ---------------------------------------------------------------------------

/* Split "a,b,c" into items (pointers into a strdup'd copy); -1 if more than cap. */
static int split_list(char *s, char **items, int cap) {
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == cap) return -1;
        items[n++] = tok;
    }
    return n;
}

/* Configuration index of (--rows item, ctx, kv format, --graphs value, --pick value) indices. */
#define BM_MAX_ROWS_ITEMS 8
#define CONF(ri, c, k, gi, pi) (((((ri) * 32 + (c)) * 32 + (k)) * 2 + (gi)) * 2 + (pi))
#define BM_CONFS (BM_MAX_ROWS_ITEMS * 32 * 32 * 4)

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One configuration: fresh state with room for ctx + gen tokens per row, then either a
 * prefill of ctx tokens per row (all rows in one call; timed after an untimed warm-up one)
 * or, with synth, ctx synthetic tokens
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
        /* a warm-up prefill, then the state emptied: the timed one finds its scratch mapped,
         * as a server's reused prefill states do (and as llama-bench's warm-up run does) */
        st = tqkv_model_prefill(m, s, pt, NULL, ctx, TQKV_LOGITS_LAST, logits);
        if (st == TQKV_OK) st = tqkv_model_state_reset(s, rows);
        if (st == TQKV_OK) st = tqkv_model_state_reserve(s, ctx + gen);
        t0 = mcli_now();
        if (st == TQKV_OK) st = tqkv_model_prefill(m, s, pt, NULL, ctx, TQKV_LOGITS_LAST, logits);
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

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

typedef struct {
    const char *model_arg, *ctx_list, *kv_list, *prefill_kernel, *decode_kernel, *device;
    const char *fill, *graphs_list, *pick_list, *rows_list, *shape;
    int threads, gen, json, window, reps, blas, f32w, find_max, at_max, fast_gemm, tp;
    int synth, dev;            /* --fill synthetic; --device cuda */
    int tp_graphs;             /* the sharded decode step may run as a graph (--graphs 1
                                  with --tensor-parallel on the device: bm_tp_graphs) */
    int moe;                   /* sparse layers with the per-expert GEMMs (--fast-gemm or
                                  TQKV_MOE_GROUPED=0): device decode steps run kernel by
                                  kernel, whatever --graphs asks */
    tqkv_kernel pk, dk;        /* prefill / decode kernels */
    int gv[2], n_gv;           /* --graphs: the device_graphs values measured, in order */
    int pv[2], n_pv;           /* --pick: device pick (1) or host pick (0), in order */
    char *ctx_copy, *kv_copy, *rows_copy; /* the lists' copies, which the items point into */
    char *ctx_items[32], *kv_items[32], *rows_items[BM_MAX_ROWS_ITEMS];
    int n_ctx, n_kv, n_rows;
    int rowv[BM_MAX_ROWS_ITEMS]; /* [n_rows] --rows */
    int most_rows;             /* the largest of them */
    int ctxs[32];              /* [n_ctx] */
    tqkv_format kf[32], vf[32]; /* [n_kv] */
    int is_preset[32];         /* [n_kv] --kv item k is a preset (auto:B) */
    tqkv_model_state_params *pre; /* [n_ctx * 32 + k] presets resolved at ctx + gen + 1 */
    char (*pre_desc)[KVP_DESC]; /* [n_ctx * 32 + k] their resolved specs */
} bm_opts;

/* --graphs into o->gv [o->n_gv]; 0 or -1 (message printed). */
static int bm_parse_graphs(bm_opts *o) {
    int bad_g = 0;
    o->n_gv = 0;
    for (const char *q = o->graphs_list; *q && !bad_g; q++) {
        if (*q == ',') continue;
        const int v = *q == '0' ? 0 : *q == '1' ? 1 : -1;
        bad_g = v < 0 || (q[1] && q[1] != ',') || o->n_gv == 2 || (o->n_gv == 1 && o->gv[0] == v);
        if (!bad_g) o->gv[o->n_gv++] = v;
    }
    if (bad_g || o->n_gv == 0) {
        fprintf(stderr, "tqkv bench model: --graphs takes 0, 1, 0,1 or 1,0, not '%s'\n", o->graphs_list);
        return -1;
    }
    if (!o->dev && (o->n_gv != 1 || o->gv[0] != 1)) {
        fprintf(stderr, "tqkv bench model: --graphs needs --device cuda (CUDA graphs of the decode step)\n");
        return -1;
    }
    return 0;
}

/* --tensor-parallel N on the device: the sharded decode step's CUDA graphs follow
 * TQKV_TP_GRAPHS (docs/TP.md). When the environment does not say, this run opts them in
 * (set before any state exists; each state's graphs then follow --graphs as an unsharded
 * state's do), so --graphs 0,1 times the sharded graphs against direct steps in one run. */
static void bm_tp_graphs(bm_opts *o) {
    o->tp_graphs = 1;
    if (!o->dev || o->tp < 2) return;
    const char *e = getenv("TQKV_TP_GRAPHS");
    if (!e) setenv("TQKV_TP_GRAPHS", "1", 1);
    o->tp_graphs = !e || !strcmp(e, "1");
    if (!o->tp_graphs && (o->gv[0] || (o->n_gv == 2 && o->gv[1])))
        fprintf(stderr, "tqkv bench model: TQKV_TP_GRAPHS=%s: sharded decode steps run kernel by "
                "kernel, whatever --graphs asks\n", e);
}

/* --pick into o->pv [o->n_pv]; 0 or -1 (message printed). */
static int bm_parse_pick(bm_opts *o) {
    char buf[64];
    snprintf(buf, sizeof buf, "%s", o->pick_list ? o->pick_list : o->dev ? "device" : "host");
    int bad_p = o->pick_list && strlen(o->pick_list) >= sizeof buf;
    o->n_pv = 0;
    for (char *it = strtok(buf, ","); it && !bad_p; it = strtok(NULL, ",")) {
        const int v = !strcmp(it, "device") ? 1 : !strcmp(it, "host") ? 0 : -1;
        bad_p = v < 0 || o->n_pv == 2 || (o->n_pv == 1 && o->pv[0] == v);
        if (!bad_p) o->pv[o->n_pv++] = v;
    }
    if (bad_p || o->n_pv == 0) {
        fprintf(stderr, "tqkv bench model: --pick takes host, device, host,device or device,host, not '%s'\n",
                o->pick_list ? o->pick_list : "");
        return -1;
    }
    if (!o->dev && (o->n_pv != 1 || o->pv[0] != 0)) {
        fprintf(stderr, "tqkv bench model: --pick device needs --device cuda\n");
        return -1;
    }
    return 0;
}

/* Defaults, the command line and its checks (not yet --ctx / --kv); 0, or the exit code
 * (message printed). */
static int bm_parse_args(int argc, char **argv, bm_opts *o) {
    *o = (bm_opts){
        .model_arg = MCLI_DEFAULT_MODEL, .ctx_list = "512,4096",
        .kv_list = "f32,f16,q8,tq4,tq3", .prefill_kernel = "graph",
        .decode_kernel = "graph", .device = "cpu",
        .fill = "prefill", .graphs_list = "1", .rows_list = "1",
        .threads = 2, .gen = 64, .reps = 3,
    };
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--ctx", ARG_STR, &o->ctx_list, "comma-separated prefill lengths (default 512,4096)"},
        {"--kv", ARG_STR, &o->kv_list, "comma-separated KV formats or presets auto:B (default f32,f16,q8,tq4,tq3)"},
        {"--threads", ARG_INT, &o->threads, "threads (default 2)"},
        {"--gen", ARG_INT, &o->gen, "decode steps after the prefill (default 64)"},
        {"--window", ARG_INT, &o->window, "q8 recent window of tq caches (default 0)"},
        {"--rows", ARG_STR, &o->rows_list, "comma-separated counts of rows decoded together, each measured (default 1; at most 8 items; prefill is per row)"},
        {"--reps", ARG_INT, &o->reps, "rounds over all configurations, best kept (default 3)"},
        {"--prefill-kernel", ARG_STR, &o->prefill_kernel, "attention kernel for prefill: graph (the graph's kernel set, default), dense, deferred, fused"},
        {"--decode-kernel", ARG_STR, &o->decode_kernel, "attention kernel for decode: graph (default), dense, deferred, fused"},
        {"--blas", ARG_FLAG, &o->blas, "OpenBLAS sgemm for prefill matmuls (not batch invariant)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--f32-weights", ARG_FLAG, &o->f32w, "convert weights to f32 at load"},
        {"--device", ARG_STR, &o->device, "cpu|cuda: where the forward runs (default cpu)"},
        {"--fast-gemm", ARG_FLAG, &o->fast_gemm, "with --device cuda: cuBLAS bf16 GEMMs, faster but NOT batch invariant"},
        {"--graphs", ARG_STR, &o->graphs_list, "with --device cuda: 1 (default): decode steps as replayed CUDA graphs; 0: kernel by kernel; 0,1: both, side by side, with their ratio (with --tensor-parallel: the sharded decode graph, opted in unless TQKV_TP_GRAPHS is set)"},
        {"--pick", ARG_STR, &o->pick_list, "how a decode step picks its next tokens: host (logits copied back, argmax on the host), device (tqkv_model_decode_pick: argmax on the GPU, one int per row back), or host,device: both, side by side, with their ratio; default device with --device cuda, else host"},
        {"--fill", ARG_STR, &o->fill, "prefill (default): run ctx tokens through the model; synthetic: put ctx tokens of random K/V straight into the caches (device only, no pp figure)"},
        {"--max-rows", ARG_FLAG, &o->find_max, "also find the most rows whose caches for ctx + gen + 1 tokens fit (device memory; real allocations)"},
        {"--at-max-rows", ARG_FLAG, &o->at_max, "with --max-rows: then measure decode at that many rows per ctx and KV format (JSON rows with at_max_rows true)"},
        {"--shape", ARG_STR, &o->shape, "a name for the model's shape, copied into every JSON row as \"shape\""},
        {"--json", ARG_FLAG, &o->json, "print a JSON array of results on stdout"},
        {"--tensor-parallel", ARG_INT, &o->tp, MCLI_TP_HELP},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    if (o->threads < 1 || o->gen < 1 || o->reps < 1 || o->window < 0) {
        fprintf(stderr, "tqkv bench model: --threads, --gen, --reps must be >= 1\n");
        return 2;
    }
    if (o->at_max && !o->find_max) {
        fprintf(stderr, "tqkv bench model: --at-max-rows needs --max-rows\n");
        return 2;
    }
    o->synth = !strcmp(o->fill, "synthetic");
    if (o->find_max && strcmp(o->device, "cuda")) {
        fprintf(stderr, "tqkv bench model: --max-rows measures device memory (--device cuda)\n");
        return 2;
    }
    if (!o->synth && strcmp(o->fill, "prefill")) {
        fprintf(stderr, "tqkv bench model: --fill takes prefill or synthetic, not '%s'\n", o->fill);
        return 2;
    }
    if (mcli_parse_kernel(CMD, o->prefill_kernel, &o->pk) ||
        mcli_parse_kernel(CMD, o->decode_kernel, &o->dk) || mcli_parse_device(CMD, o->device, &o->dev))
        return 2;
    tqkv_model_state_params tpp; /* checks --tensor-parallel against --device */
    if (mcli_parse_tp(CMD, o->tp, o->dev, &tpp)) return 2;
    if (bm_parse_graphs(o) || bm_parse_pick(o)) return 2;
    bm_tp_graphs(o);
    return 0;
}

/* --rows into o->rowv [o->n_rows] (o->rows_copy set); 0 or 2 (message printed). */
static int bm_parse_rows(bm_opts *o) {
    o->n_rows = split_list(o->rows_copy, o->rows_items, BM_MAX_ROWS_ITEMS);
    if (o->n_rows <= 0) {
        fprintf(stderr, "tqkv bench model: --rows takes 1 to %d comma-separated counts\n",
                BM_MAX_ROWS_ITEMS);
        return 2;
    }
    o->most_rows = 1;
    for (int i = 0; i < o->n_rows; i++) {
        char *end = NULL;
        const long v = strtol(o->rows_items[i], &end, 10);
        if (!end || *end || v < 1 || v > 4096) {
            fprintf(stderr, "tqkv bench model: bad --rows item '%s' (1 to 4096)\n", o->rows_items[i]);
            return 2;
        }
        o->rowv[i] = (int)v;
        o->most_rows = o->rowv[i] > o->most_rows ? o->rowv[i] : o->most_rows;
    }
    return 0;
}

/* --ctx, --kv and --rows into o's items, lengths, formats and counts; 0, or the exit code
 * (message printed; the copies are freed by bm_opts_free). */
static int bm_parse_lists(bm_opts *o) {
    o->ctx_copy = strdup(o->ctx_list);
    o->kv_copy = strdup(o->kv_list);
    o->rows_copy = strdup(o->rows_list);
    if (!o->ctx_copy || !o->kv_copy || !o->rows_copy) {
        fprintf(stderr, "tqkv bench model: out of memory\n");
        return 1;
    }
    o->n_ctx = split_list(o->ctx_copy, o->ctx_items, 32);
    o->n_kv = split_list(o->kv_copy, o->kv_items, 32);
    int bad = o->n_ctx <= 0 || o->n_kv <= 0;
    if (bad) fprintf(stderr, "tqkv bench model: --ctx and --kv take 1 to 32 comma-separated items\n");
    for (int i = 0; i < o->n_ctx && !bad; i++) {
        char *end = NULL;
        long v = strtol(o->ctx_items[i], &end, 10);
        o->ctxs[i] = (end && !*end && v >= 1 && v <= 1 << 20) ? (int)v : 0;
        if (o->ctxs[i] < 1) {
            fprintf(stderr, "tqkv bench model: bad --ctx item '%s'\n", o->ctx_items[i]);
            bad = 1;
        }
    }
    for (int i = 0; i < o->n_kv && !bad; i++) {
        o->is_preset[i] = kvp_is_preset(o->kv_items[i]);
        if (o->is_preset[i] && o->window) {
            fprintf(stderr, "tqkv bench model: --kv %s chooses the window itself; drop --window\n",
                    o->kv_items[i]);
            bad = 1;
        }
        if (!o->is_preset[i]) bad = mcli_parse_kv(CMD, o->kv_items[i], &o->kf[i], &o->vf[i]) != 0;
    }
    return bad ? 2 : bm_parse_rows(o);
}

static void bm_opts_free(bm_opts *o) {
    free(o->pre);
    free(o->pre_desc);
    free(o->ctx_copy);
    free(o->kv_copy);
    free(o->rows_copy);
}

// ---------------------------------------------------------------------------
// Benchmark
// ---------------------------------------------------------------------------

/* Best figures per configuration (index CONF), max rows per (ctx, kv) (c * 32 + k) and
 * the decode figures at those rows (--at-max-rows, same index). */
typedef struct {
    double best_pp[BM_CONFS], best_tg[BM_CONFS], bpt[BM_CONFS];
    int oom[BM_CONFS], maxr[32 * 32];
    double max_tg[32 * 32], max_bpt[32 * 32];
    int max_oom[32 * 32];
} bm_results;

/* Fixed pseudo-random token ids tok [n] below V. */
static void bm_fill_tokens(int32_t *tok, int n, int V) {
    uint64_t z = 12345;
    for (int i = 0; i < n; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int32_t)((z >> 33) % (uint64_t)V);
    }
}

/* Resolves "graph" kernels, prints the header line and the table's head, and returns
 * every state's parameters (per configuration rows and the KV formats change). */
static tqkv_model_state_params bm_prepare(bm_opts *o, const tqkv_model *m, FILE *tab) {
    { /* "graph": the graph's kernel set, resolved here so the header names it */
        tqkv_kernel gp, gd;
        tqkv_model_kernel_set(m, NULL, &gp, &gd);
        if (o->pk == TQKV_KERNEL_BY_GRAPH) o->pk = gp;
        if (o->dk == TQKV_KERNEL_BY_GRAPH) o->dk = gd;
    }
    fprintf(stderr, "tqkv bench model: %s weights, %d threads, gen %d, rows %s, prefill kernel %s, "
            "decode kernel %s%s\n", tqkv_model_weight_type(m), o->threads, o->gen, o->rows_list,
            tqkv_kernel_name(o->pk), tqkv_kernel_name(o->dk), o->blas ? ", blas" : "");
    if (o->dev && o->moe)
        fprintf(stderr, "tqkv bench model: sparse (MoE) layers with one GEMM per expert: decode "
                "steps run kernel by kernel (the counts come back), whatever --graphs asks\n");
    if (o->dev) fprintf(tab, "%-8s %-10s %6s %6s %12s %12s %14s\n", "ctx", "kv", "graphs", "pick", "pp t/s", "tg t/s", "kv B/token");
    else fprintf(tab, "%-8s %-10s %12s %12s %14s\n", "ctx", "kv", "pp t/s", "tg t/s", "kv B/token");
    tqkv_model_state_params base = tqkv_model_state_params_default();
    base.window = o->window;
    base.threads = o->threads;
    base.prefill_kernel = o->pk;
    base.decode_kernel = o->dk;
    base.blas = o->blas;
    base.device = o->dev;
    base.device_fast_gemm = o->fast_gemm;
    base.tensor_parallel = o->tp;
    return base;
}

/* Warm-up: map the weights in (a prefill of up to 64 tokens of tok [max_ctx]). */
static void bm_warm_up(const tqkv_model *m, const tqkv_model_state_params *base,
                       const int32_t *tok, int max_ctx, float *logits) {
    tqkv_model_state_params sp = *base;
    sp.window = 0;
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, m, &sp) == TQKV_OK)
        tqkv_model_prefill(m, s, tok, NULL, max_ctx < 64 ? max_ctx : 64, TQKV_LOGITS_LAST, logits);
    tqkv_model_state_free(s);
}

/* The presets among --kv, resolved for m (loaded from dir) at each --ctx (the context run:
 * ctx + gen + 1) from base (so the device's own candidates), as run and ppl resolve them: a
 * calibrated policy beside the model, else the shipped one, else the ranked presets
 * (kvp_resolve_model); 0, or 1 (message printed). */
static int bm_resolve_presets(bm_opts *o, const tqkv_model *m, const char *dir,
                              const tqkv_model_state_params *base) {
    int any = 0;
    for (int k = 0; k < o->n_kv; k++) any |= o->is_preset[k];
    if (!any) return 0;
    o->pre = calloc((size_t)o->n_ctx * 32, sizeof *o->pre);
    o->pre_desc = calloc((size_t)o->n_ctx * 32, sizeof *o->pre_desc);
    if (!o->pre || !o->pre_desc) {
        fprintf(stderr, "tqkv bench model: out of memory\n");
        return 1;
    }
    for (int c = 0; c < o->n_ctx; c++)
        for (int k = 0; k < o->n_kv; k++) {
            if (!o->is_preset[k]) continue;
            const int j = c * 32 + k;
            o->pre[j] = *base;
            if (kvp_resolve_model(CMD, m, dir, o->kv_items[k], o->ctxs[c] + o->gen + 1,
                                  &o->pre[j], o->pre_desc[j], sizeof o->pre_desc[j]))
                return 1;
            fprintf(stderr, "tqkv bench model: ctx %d: --kv %s -> %s\n", o->ctxs[c], o->kv_items[k],
                    o->pre_desc[j]);
        }
    return 0;
}

/* The state parameters of (ctx c, kv k): base with kv item k's formats, or its preset. */
static tqkv_model_state_params bm_params(const bm_opts *o, const tqkv_model_state_params *base,
                                         int c, int k) {
    if (o->is_preset[k]) return o->pre[c * 32 + k];
    tqkv_model_state_params sp = *base;
    sp.k_format = o->kf[k];
    sp.v_format = o->vf[k];
    return sp;
}

/* One measure() of `rows` rows at (ctx c, kv k, graphs gi, pick pi), its line on stderr.
 * TQKV_ENOMEM (does not fit) is reported as such; another failure's message is printed. */
static tqkv_status bm_measure_one(const bm_opts *o, const tqkv_model *m,
                                  const tqkv_model_state_params *base, const int32_t *tok,
                                  float *logits, int rows, int c, int k, int gi, int pi,
                                  double *pp, double *tg, double *bpt) {
    tqkv_model_state_params sp = bm_params(o, base, c, k);
    sp.rows = rows;
    sp.device_graphs = o->gv[gi];
    const tqkv_status st = measure(m, &sp, tok, o->ctxs[c], rows, o->gen, o->synth, o->pv[pi],
                                   logits, pp, tg, bpt);
    if (st == TQKV_ENOMEM) /* does not fit: reported, not fatal */
        fprintf(stderr, "tqkv bench model: ctx %d kv %s rows %d: does not fit (%s)\n", o->ctxs[c],
                o->kv_items[k], rows, tqkv_last_error());
    else if (st != TQKV_OK)
        fprintf(stderr, "tqkv bench model: %s\n", tqkv_last_error());
    else
        fprintf(stderr, "tqkv bench model: ctx %d kv %s rows %d%s%s: pp %.1f t/s, tg %.1f t/s\n",
                o->ctxs[c], o->kv_items[k], rows, !o->dev ? "" : o->gv[gi] ? " graphs" : " no graphs",
                !o->dev ? "" : o->pv[pi] ? ", device pick" : ", host pick", *pp, *tg);
    return st;
}

/* Repetitions are the outer loop, so every configuration is measured once per round
 * and machine noise spreads over all of them alike; the best round is kept. logits holds
 * [most_rows, V]. 0 or 1. */
static int bm_measure_all(const bm_opts *o, const tqkv_model *m, const tqkv_model_state_params *base,
                          const int32_t *tok, float *logits, bm_results *res) {
    int rc = 0;
    for (int r = 0; r < o->reps && !rc; r++) {
        if (o->reps > 1) fprintf(stderr, "tqkv bench model: round %d/%d\n", r + 1, o->reps);
        for (int ri = 0; ri < o->n_rows && !rc; ri++)
        for (int c = 0; c < o->n_ctx && !rc; c++)
            for (int k = 0; k < o->n_kv && !rc; k++)
                for (int gi = 0; gi < o->n_gv && !rc; gi++)
                for (int pi = 0; pi < o->n_pv && !rc; pi++) {
                    const int i = CONF(ri, c, k, gi, pi);
                    double pp = 0, tg = 0;
                    if (res->oom[i]) continue;
                    const tqkv_status st = bm_measure_one(o, m, base, tok, logits, o->rowv[ri], c, k,
                                                          gi, pi, &pp, &tg, &res->bpt[i]);
                    res->oom[i] = st == TQKV_ENOMEM;
                    rc = st != TQKV_OK && st != TQKV_ENOMEM;
                    if (pp > res->best_pp[i]) res->best_pp[i] = pp;
                    if (tg > res->best_tg[i]) res->best_tg[i] = tg;
                }
    }
    return rc;
}

/* --max-rows: the most rows that fit, per (ctx, kv). */
static void bm_find_max_rows(const bm_opts *o, const tqkv_model *m,
                             const tqkv_model_state_params *base, bm_results *res) {
    for (int c = 0; c < o->n_ctx; c++)
        for (int k = 0; k < o->n_kv; k++) {
            tqkv_model_state_params sp = bm_params(o, base, c, k);
            float *lg = NULL;
            res->maxr[c * 32 + k] = max_rows(m, &sp, o->ctxs[c] + o->gen + 1, &lg); /* as measure, synth */
            free(lg);
            fprintf(stderr, "tqkv bench model: ctx %d kv %s: at most %d rows fit\n", o->ctxs[c],
                    o->kv_items[k], res->maxr[c * 32 + k]);
        }
}

/* --at-max-rows: decode at the most rows that fit, per (ctx, kv) (the first --graphs and
 * --pick values), best of --reps rounds. *logits grows to [rows, V]. 0 or 1. */
static int bm_measure_at_max(const bm_opts *o, const tqkv_model *m,
                             const tqkv_model_state_params *base, const int32_t *tok,
                             float **logits, bm_results *res) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    int rc = 0;
    for (int r = 0; r < o->reps && !rc; r++)
        for (int c = 0; c < o->n_ctx && !rc; c++)
            for (int k = 0; k < o->n_kv && !rc; k++) {
                const int j = c * 32 + k, rows = res->maxr[j];
                double pp = 0, tg = 0;
                if (rows < 1 || res->max_oom[j]) continue;
                float *lg = realloc(*logits, sizeof(float) * (size_t)V * rows);
                if (!lg) return 1;
                *logits = lg;
                const tqkv_status st = bm_measure_one(o, m, base, tok, lg, rows, c, k, 0, 0, &pp,
                                                      &tg, &res->max_bpt[j]);
                res->max_oom[j] = st == TQKV_ENOMEM;
                rc = st != TQKV_OK && st != TQKV_ENOMEM;
                if (tg > res->max_tg[j]) res->max_tg[j] = tg;
            }
    return rc;
}

// ---------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------

/* A JSON row's fields that say what was measured: (ctx c, kv k, graphs gi, pick pi) at
 * `rows` rows. */
static cJSON *bm_json_conf(const bm_opts *o, cJSON *arr, int c, int k, int gi, int pi, int rows) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddItemToArray(arr, j);
    if (o->shape) cJSON_AddStringToObject(j, "shape", o->shape);
    cJSON_AddNumberToObject(j, "ctx", o->ctxs[c]);
    cJSON_AddStringToObject(j, "device", o->dev ? "cuda" : "cpu");
    cJSON_AddStringToObject(j, "kv", o->kv_items[k]);
    cJSON_AddStringToObject(j, "fill", o->synth ? "synthetic" : "prefill");
    cJSON_AddStringToObject(j, "gemm", o->fast_gemm ? "cublas" : "invariant");
    cJSON_AddStringToObject(j, "matmul", o->dev ? "device" : mcli_matmul_name(mcli_exact));
    if (o->dev) cJSON_AddBoolToObject(j, "graphs", o->gv[gi] && !o->moe && o->tp_graphs);
    cJSON_AddStringToObject(j, "pick", o->pv[pi] ? "device" : "host");
    cJSON_AddNumberToObject(j, "threads", o->threads);
    cJSON_AddNumberToObject(j, "gen", o->gen);
    cJSON_AddNumberToObject(j, "rows", rows);
    cJSON_AddNumberToObject(j, "tensor_parallel", o->tp > 1 ? o->tp : 1);
    cJSON_AddNumberToObject(j, "window", o->is_preset[k] ? o->pre[c * 32 + k].window : o->window);
    if (o->is_preset[k]) cJSON_AddStringToObject(j, "kv_resolved", o->pre_desc[c * 32 + k]);
    return j;
}

/* One configuration's JSON object, appended to arr. */
static void bm_json_row(const bm_opts *o, const bm_results *res, cJSON *arr, int ri, int c, int k,
                        int gi, int pi, int both, int both_p, int i0, int ip) {
    const int i = CONF(ri, c, k, gi, pi);
    cJSON *j = bm_json_conf(o, arr, c, k, gi, pi, o->rowv[ri]);
    if (res->oom[i] || o->synth) cJSON_AddNullToObject(j, "prefill_tokens_per_s");
    else json_add_num(j, "prefill_tokens_per_s", res->best_pp[i], 2);
    if (res->oom[i]) cJSON_AddNullToObject(j, "decode_tokens_per_s");
    else json_add_num(j, "decode_tokens_per_s", res->best_tg[i], 2);
    if (both) json_add_num(j, "decode_graphs_speedup", res->best_tg[i] / res->best_tg[i0], 4);
    if (both_p) json_add_num(j, "decode_pick_speedup", res->best_tg[i] / res->best_tg[ip], 4);
    if (res->oom[i]) cJSON_AddStringToObject(j, "error", "out of memory");
    json_add_num(j, "kv_bytes_per_token", res->bpt[i], 1);
    if (o->find_max) cJSON_AddNumberToObject(j, "max_rows", res->maxr[c * 32 + k]);
}

/* --at-max-rows: a table line and a JSON row (at_max_rows true) per (ctx, kv). */
static void bm_report_at_max(const bm_opts *o, const bm_results *res, FILE *tab, cJSON *arr) {
    for (int c = 0; c < o->n_ctx; c++)
        for (int k = 0; k < o->n_kv; k++) {
            const int j = c * 32 + k, rows = res->maxr[j];
            fprintf(tab, "%-8d %-10s at the most rows that fit (%d): ", o->ctxs[c], o->kv_items[k], rows);
            if (rows < 1 || res->max_oom[j]) fprintf(tab, "tg -%s\n", rows < 1 ? "" : " (oom)");
            else fprintf(tab, "tg %.1f t/s\n", res->max_tg[j]);
            if (rows < 1) continue;
            cJSON *r = bm_json_conf(o, arr, c, k, 0, 0, rows);
            cJSON_AddBoolToObject(r, "at_max_rows", 1);
            cJSON_AddNullToObject(r, "prefill_tokens_per_s");
            if (res->max_oom[j]) {
                cJSON_AddNullToObject(r, "decode_tokens_per_s");
                cJSON_AddStringToObject(r, "error", "out of memory");
            } else {
                json_add_num(r, "decode_tokens_per_s", res->max_tg[j], 2);
            }
            json_add_num(r, "kv_bytes_per_token", res->max_bpt[j], 1);
            cJSON_AddNumberToObject(r, "max_rows", rows);
        }
}

/* The table's rows on tab and, with --json and rc 0, the JSON array on stdout; the exit
 * code (rc, or 1 if the JSON could not be printed). */
static int bm_report(const bm_opts *o, const bm_results *res, FILE *tab, int rc) {
    cJSON *arr = cJSON_CreateArray();
    if (o->find_max) fprintf(tab, "%-8s %-10s %*s%12s %12s %14s %9s\n", "", "", o->dev ? 14 : 0, "", "", "", "", "max rows");
    for (int ri = 0; ri < o->n_rows && !rc; ri++) {
        if (o->n_rows > 1) fprintf(tab, "rows %d\n", o->rowv[ri]);
        for (int c = 0; c < o->n_ctx; c++)
            for (int k = 0; k < o->n_kv; k++)
                for (int gi = 0; gi < o->n_gv; gi++)
                for (int pi = 0; pi < o->n_pv; pi++) {
                    const int i = CONF(ri, c, k, gi, pi), i0 = CONF(ri, c, k, 1 - gi, pi),
                              ip = CONF(ri, c, k, gi, 1 - pi);
                    /* both measured: the graph row carries the ratio of its decode speed to
                     * the kernel-by-kernel one's, the device-pick row the ratio to the host
                     * pick's (same run, same rounds) */
                    const int both = o->n_gv == 2 && o->gv[gi] && !res->oom[i] && !res->oom[i0] && res->best_tg[i0] > 0;
                    const int both_p = o->n_pv == 2 && o->pv[pi] && !res->oom[i] && !res->oom[ip] && res->best_tg[ip] > 0;
                    fprintf(tab, "%-8d %-10s ", o->ctxs[c], o->kv_items[k]);
                    if (o->dev) fprintf(tab, "%6d %6s ", o->gv[gi], o->pv[pi] ? "device" : "host");
                    if (res->oom[i]) fprintf(tab, "%12s %12s %14s", "-", "oom", "-");
                    else fprintf(tab, "%12.1f %12.1f %14.1f", res->best_pp[i], res->best_tg[i], res->bpt[i]);
                    if (o->find_max) fprintf(tab, " %9d", res->maxr[c * 32 + k]);
                    if (both) fprintf(tab, "   graphs / no graphs: tg %.3fx", res->best_tg[i] / res->best_tg[i0]);
                    if (both_p) fprintf(tab, "   device / host pick: tg %.3fx", res->best_tg[i] / res->best_tg[ip]);
                    fputc('\n', tab);
                    bm_json_row(o, res, arr, ri, c, k, gi, pi, both, both_p, i0, ip);
                }
    }
    if (o->at_max && !rc) bm_report_at_max(o, res, tab, arr);
    if (o->json && !rc) rc = json_print(stdout, arr, 0, "bench model") ? 1 : 0;
    else cJSON_Delete(arr);
    return rc;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_bench_model(int argc, char **argv) {
    bm_opts o;
    int rc = bm_parse_args(argc, argv, &o);
    if (rc) return rc;
    rc = bm_parse_lists(&o);
    char dir[4096];
    tqkv_model *m = NULL;
    if (rc || !mcli_resolve_model(CMD, o.model_arg, dir, sizeof dir) ||
        mcli_load_dev(CMD, dir, o.blas, o.f32w, o.threads, o.dev, &m)) {
        bm_opts_free(&o);
        return rc ? rc : 1;
    }
    const int V = tqkv_model_get_config(m)->vocab_size;
    const char *grouped = getenv("TQKV_MOE_GROUPED");
    o.moe = tqkv_model_get_config(m)->n_moe_layers > 0 &&
            (o.fast_gemm || (grouped && !strcmp(grouped, "0")));
    int max_ctx = 1;
    for (int i = 0; i < o.n_ctx; i++) max_ctx = o.ctxs[i] > max_ctx ? o.ctxs[i] : max_ctx;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)max_ctx);         // [max_ctx]
    float *logits = malloc(sizeof(float) * (size_t)V * o.most_rows); // [rows, vocab]
    bm_results *res = calloc(1, sizeof *res);
    if (!tok || !logits || !res) {
        fprintf(stderr, "tqkv bench model: out of memory\n");
        rc = 1;
        goto done;
    }
    bm_fill_tokens(tok, max_ctx, V);
    /* the table is the progress display: on stderr when stdout carries JSON */
    FILE *tab = o.json ? stderr : stdout;
    const tqkv_model_state_params base = bm_prepare(&o, m, tab);
    rc = bm_resolve_presets(&o, m, dir, &base);
    if (rc) goto done;
    bm_warm_up(m, &base, tok, max_ctx, logits);
    rc = bm_measure_all(&o, m, &base, tok, logits, res);
    if (!rc && o.find_max) bm_find_max_rows(&o, m, &base, res);
    if (!rc && o.at_max) rc = bm_measure_at_max(&o, m, &base, tok, &logits, res);
    rc = bm_report(&o, res, tab, rc);
done:
    free(res);
    free(tok);
    free(logits);
    bm_opts_free(&o);
    tqkv_model_free(m);
    return rc;
}

/*
 * cmd_bench_engine.c - `tqkv bench engine`: the serving engine without HTTP. Closed-loop
 * clients keep C requests in flight (prompts cut from held-out code, greedy), for each
 * concurrency C of --concurrency; reports aggregate generated tokens/s, p50/p99 time to
 * first token and inter-token latency, and checks that every request's tokens equal the
 * tokens it got at concurrency 1. --draft adds speculative decoding (acceptance, speedup
 * against the same points without it, run side by side); --prefix measures a prefix-cache
 * hit against a miss; --load N runs N busy processes beside the benchmark.
 * --json-object / --json-schema add constrained decoding (OpenAI's response_format) on two
 * engines: the constrained points first alone on each (rep -1: cold mask caches), then
 * --reps rounds of two pairs, constrained on one engine beside plain on the other and the
 * other way round, the two engines' steps taking turns, so the machine's other work falls
 * on both alike. A constrained row ends when its document closes, so the plain requests
 * get the lengths of the constrained runs alone as their max_tokens: both then have the
 * same rows in every step. Reported: the time per token of the decode-only steps (no row
 * prefilling), wall and process CPU, and the median constrained / plain ratio of the
 * rounds (each the geometric mean of its two pairs).
 * Owns: the load generator, its table and --json output.
 * Must not: contain engine, model or cache logic.
 */
#include <math.h>
#include <signal.h>
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "json_out.h"
#include "model_cli.h"
#include "tqkv_engine.h"

static const char *CMD = "bench engine";

// ---------------------------------------------------------------------------
// Per-request record
// ---------------------------------------------------------------------------

typedef struct {
    double   t_submit, t_first, t_prev, t_done;
    double  *itl;        /* [max_tokens] gaps between tokens */
    int      n_itl, n_tok, done, cached;
    uint64_t hash;       /* FNV of the token ids */
} rec;

static void on_event(void *user, uint64_t id, const tqkv_engine_event *ev) {
    (void)id;
    rec *r = user;
    double now = mcli_now();
    if (ev->token >= 0) {
        if (r->n_tok == 0) r->t_first = now;
        else r->itl[r->n_itl++] = now - r->t_prev;
        r->t_prev = now;
        r->n_tok++;
        const uint8_t *b = (const uint8_t *)&ev->token;
        for (int i = 0; i < 4; i++) r->hash = (r->hash ^ b[i]) * 1099511628211ull;
    }
    if (ev->done) {
        r->done = 1;
        r->t_done = now;
        r->cached = ev->cached_tokens;
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, size_t n, double p) {
    if (!n) return 0;
    qsort(v, n, sizeof *v, cmp_d);
    size_t i = (size_t)ceil(p * (double)n) - 1;
    return v[i >= n ? n - 1 : i];
}

// ---------------------------------------------------------------------------
// One point: C clients, N requests
// ---------------------------------------------------------------------------

typedef struct {
    double   tok_s, ttft50, ttft99, itl50, itl99, wall;
    uint64_t gen, drafted, accepted;
    uint64_t *hashes; /* [N] */
    int      prefix_hits;
    int     *ntok;    /* [N] tokens each request got (or NULL) */
    double   dec_s;   /* decode-only steps (every row in flight decoding, none prefilling) */
    double   dec_cpu; /* their process CPU seconds (what other work on the machine takes
                         from the wall time is not in it) */
    int      dec_steps, dec_tok;
} point;

/* What the requests of a point ask for: sampling, and the JSON constraint. */
typedef struct {
    float       temperature;
    int         json;       /* 1: response_format json_object (or json_schema) */
    const char *schema;     /* JSON Schema text, or NULL */
    const int  *lens;       /* [N] max_tokens of each request, or NULL: max_tokens */
} be_mode;

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Tokens generated so far by requests [0, n) and how many of them are decoding (started,
 * not done). */
static int recs_tokens(const rec *recs, int n, int *decoding) {
    int t = 0, d = 0;
    for (int i = 0; i < n; i++) {
        t += recs[i].n_tok;
        d += recs[i].n_tok > 0 && !recs[i].done;
    }
    *decoding = d;
    return t;
}

/* One point in progress: C clients keeping N requests in flight on engine e, a step at a
 * time (two runners can take turns: their steps interleave). */
typedef struct {
    tqkv_engine         *e;
    int32_t *const      *prompts;
    int                  n_prompt, N, C, max_tokens;
    be_mode              mode;
    point               *pt;
    rec                 *recs;   /* [N] */
    double              *itl;    /* [N, max_tokens] */
    double              *ttft;   /* [N] */
    int                  next, done, inflight;
    double               t0;     /* start (wall) */
    tqkv_engine_stats    s0;
} runner;

static void runner_free(runner *r) {
    free(r->recs);
    free(r->itl);
    free(r->ttft);
}

static int runner_init(runner *r, tqkv_engine *e, int32_t *const *prompts, int n_prompt, int N,
                       int C, int max_tokens, const be_mode *mode, point *pt) {
    *r = (runner){.e = e, .prompts = prompts, .n_prompt = n_prompt, .N = N, .C = C,
                  .max_tokens = max_tokens, .mode = *mode, .pt = pt};
    r->recs = calloc((size_t)N, sizeof *r->recs);
    r->itl = calloc((size_t)N * max_tokens, sizeof *r->itl);
    r->ttft = calloc((size_t)N, sizeof *r->ttft);
    if (!r->recs || !r->itl || !r->ttft) {
        runner_free(r);
        return -1;
    }
    for (int i = 0; i < N; i++) {
        r->recs[i].itl = r->itl + (size_t)i * max_tokens;
        r->recs[i].hash = 1469598103934665603ull;
    }
    tqkv_engine_stats_get(e, &r->s0);
    r->t0 = mcli_now();
    pt->wall = pt->dec_s = pt->dec_cpu = 0;
    pt->dec_steps = pt->dec_tok = 0;
    return 0;
}

/* Submit what the clients may, then one engine step; 1 when all N are done, 0 not yet,
 * -1 failed (message printed). */
static int runner_step(runner *r) {
    point *pt = r->pt;
    while (r->next < r->N && r->inflight < r->C) {
        tqkv_engine_request q;
        memset(&q, 0, sizeof q);
        q.prompt = r->prompts[r->next];
        q.n_prompt = r->n_prompt;
        q.max_tokens = r->mode.lens ? r->mode.lens[r->next] : r->max_tokens;
        q.sampling = tqkv_sampler_params_default();
        q.sampling.temperature = r->mode.temperature;
        q.sampling.seed = 1000 + (uint64_t)r->next;
        q.json_object = r->mode.json;
        q.json_schema = r->mode.json ? r->mode.schema : NULL;
        q.ignore_eos = 1;
        q.top_logprobs = -1;
        q.on_event = on_event;
        q.user = &r->recs[r->next];
        r->recs[r->next].t_submit = mcli_now();
        uint64_t id;
        if (tqkv_engine_submit(r->e, &q, &id) != TQKV_OK) {
            fprintf(stderr, "tqkv %s: submit: %s\n", CMD, tqkv_last_error());
            return -1;
        }
        r->next++;
        r->inflight++;
    }
    /* a decode-only step: every request in flight was decoding before it (none
     * prefilling) and each gave a token */
    int dec0, dec1, busy = 1;
    const int tok0 = recs_tokens(r->recs, r->next, &dec0);
    const double ts = mcli_now(), cs = cpu_now();
    if (tqkv_engine_step(r->e, &busy) != TQKV_OK) {
        fprintf(stderr, "tqkv %s: step: %s\n", CMD, tqkv_last_error());
        return -1;
    }
    const double dt = mcli_now() - ts, dc = cpu_now() - cs;
    pt->wall += dt;
    if (dec0 > 0 && dec0 == r->inflight && recs_tokens(r->recs, r->next, &dec1) - tok0 == dec0) {
        pt->dec_s += dt;
        pt->dec_cpu += dc;
        pt->dec_steps++;
        pt->dec_tok += dec0;
    }
    int d = 0;
    for (int i = 0; i < r->next; i++) d += r->recs[i].done;
    r->inflight -= d - r->done;
    r->done = d;
    return r->done == r->N;
}

/* The point's figures; wall: since the start, or (own_steps) the runner's own steps. */
static void runner_finish(runner *r, int own_steps) {
    point *pt = r->pt;
    if (!own_steps) pt->wall = mcli_now() - r->t0;
    const int N = r->N;
    tqkv_engine_stats s1;
    tqkv_engine_stats_get(r->e, &s1);
    size_t n_itl = 0;
    pt->gen = 0;
    for (int i = 0; i < N; i++) {
        const rec *c = &r->recs[i];
        r->ttft[i] = c->t_first - c->t_submit;
        for (int k = 0; k < c->n_itl; k++) r->itl[n_itl++] = c->itl[k];
        pt->gen += (uint64_t)c->n_tok;
        pt->hashes[i] = c->hash;
        if (pt->ntok) pt->ntok[i] = c->n_tok;
    }
    pt->tok_s = pt->wall > 0 ? (double)pt->gen / pt->wall : 0;
    pt->ttft50 = pct(r->ttft, (size_t)N, 0.5);
    pt->ttft99 = pct(r->ttft, (size_t)N, 0.99);
    pt->itl50 = pct(r->itl, n_itl, 0.5);
    pt->itl99 = pct(r->itl, n_itl, 0.99);
    pt->drafted = s1.spec_drafted - r->s0.spec_drafted;
    pt->accepted = s1.spec_accepted - r->s0.spec_accepted;
    pt->prefix_hits = (int)(s1.prefix_hits - r->s0.prefix_hits);
    runner_free(r);
}

static int run_point(tqkv_engine *e, int32_t *const *prompts, int n_prompt, int N, int C,
                     int max_tokens, const be_mode *mode, point *pt) {
    runner r;
    if (runner_init(&r, e, prompts, n_prompt, N, C, max_tokens, mode, pt)) return -1;
    int st = 0;
    while ((st = runner_step(&r)) == 0) {}
    if (st < 0) {
        runner_free(&r);
        return -1;
    }
    runner_finish(&r, 0);
    return 0;
}

/* Two points at once, their steps taking turns (a step of a, then of b, ..., b first when
 * b_first): what the machine's other work takes falls on both alike. wall, tok/s: each
 * one's own steps; TTFT and ITL include the other's steps. */
static int run_pair(tqkv_engine *ea, const be_mode *ma, point *pa, tqkv_engine *eb,
                    const be_mode *mb, point *pb, int32_t *const *prompts, int n_prompt, int N,
                    int C, int max_tokens, int b_first) {
    runner r[2];
    if (runner_init(&r[0], ea, prompts, n_prompt, N, C, max_tokens, ma, pa)) return -1;
    if (runner_init(&r[1], eb, prompts, n_prompt, N, C, max_tokens, mb, pb)) {
        runner_free(&r[0]);
        return -1;
    }
    int st[2] = {0, 0};
    while ((!st[0] || !st[1]) && st[0] >= 0 && st[1] >= 0)
        for (int k = 0; k < 2; k++) {
            const int i = b_first ? 1 - k : k;
            if (!st[i]) st[i] = runner_step(&r[i]);
        }
    if (st[0] < 0 || st[1] < 0) {
        runner_free(&r[0]);
        runner_free(&r[1]);
        return -1;
    }
    runner_finish(&r[0], 1);
    runner_finish(&r[1], 1);
    return 0;
}

// ---------------------------------------------------------------------------
// Background load
// ---------------------------------------------------------------------------

static void load_start(int n, pid_t *pids) {
    for (int i = 0; i < n; i++) {
        pids[i] = fork();
        if (pids[i] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the benchmark */
            volatile unsigned long x = 0;
            for (;;) x++;
        }
    }
}

static void load_stop(int n, pid_t *pids) {
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
            waitpid(pids[i], NULL, 0);
        }
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

typedef struct {
    const char *model_arg, *draft, *kv, *text_path;
    const char *conc_arg, *device, *schema_path;
    char *schema;         /* --json-schema's text */
    double temperature;
    int json_object;      /* --json-object or --json-schema: constrained points */
    int control;          /* --control: those run unconstrained (the noise floor) */
    int prompt_tokens, max_tokens, requests, threads, K, json;
    int window, prefix, load, chunk, step, no_check, reps;
    double budget_mb;
    int conc[16], n_conc; /* --concurrency values */
    char mdir[1024];      /* the resolved model directory */
    char tbuf[1100];      /* the default --text path */
} be_opts;

/* OpenMP teams must not spin on a shared machine: libgomp reads OMP_WAIT_POLICY at
 * start-up, so with threads > 1 and no policy set, re-execute with passive waits
 * (returns only when there is no need or the exec failed). */
static void be_reexec_passive(int argc, char **argv, int threads) {
    if (threads > 1 && !getenv("OMP_WAIT_POLICY")) {
        char **nargv = calloc((size_t)argc + 4, sizeof *nargv);
        if (nargv) {
            nargv[0] = "tqkv";
            nargv[1] = "bench";
            nargv[2] = "engine";
            for (int i = 0; i < argc; i++) nargv[3 + i] = argv[i];
            setenv("OMP_WAIT_POLICY", "passive", 1);
            execv("/proc/self/exe", nargv);
            free(nargv); /* exec failed: run as we are */
        }
    }
}

/* Defaults, the command line and its checks; 0, or the exit code (message printed). */
static int be_parse_args(int argc, char **argv, be_opts *o) {
    *o = (be_opts){
        .model_arg = MCLI_DEFAULT_MODEL, .kv = "tq4",
        .conc_arg = "1,4,16", .device = "cpu",
        .prompt_tokens = 200, .max_tokens = 128, .threads = 1, .K = 4,
        .chunk = 0, .reps = 1,
    };
    const arg_spec specs[] = {
        {"--model", ARG_STR, &o->model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--kv", ARG_STR, &o->kv, "KV format, e.g. tq4 or tq4/tq3 (default tq4)"},
        {"--window", ARG_INT, &o->window, "q8 recent window (default 0)"},
        {"--concurrency", ARG_STR, &o->conc_arg, "comma-separated in-flight requests (default 1,4,16)"},
        {"--requests", ARG_INT, &o->requests, "requests per point (default 2 x concurrency, >= 4)"},
        {"--prompt-tokens", ARG_INT, &o->prompt_tokens, "prompt length (default 200)"},
        {"--max-tokens", ARG_INT, &o->max_tokens, "tokens generated per request (default 128)"},
        {"--text", ARG_STR, &o->text_path, "prompt source (default ../shared/data/heldout-code.txt)"},
        {"--threads", ARG_INT, &o->threads, "compute threads (default 1)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--prefill-chunk", ARG_INT, &o->chunk, "prefill chunk (default 256 on the CPU, 2048 on the device)"},
        {"--prefill-step", ARG_INT, &o->step, "prompt tokens prefilled per step, whole chunks (default: the engine's)"},
        {"--kv-budget-mb", ARG_DOUBLE, &o->budget_mb, "KV budget in MiB (default: a quarter of RAM)"},
        {"--draft", ARG_STR, &o->draft, "draft model: every point also runs with it, side by side"},
        {"--draft-tokens", ARG_INT, &o->K, "draft tokens per round (default 4)"},
        {"--prefix", ARG_INT, &o->prefix, "also measure a prefix-cache hit: shared prefix of N tokens"},
        {"--load", ARG_INT, &o->load, "busy processes to run beside the benchmark (default 0)"},
        {"--reps", ARG_INT, &o->reps, "repeat each point (plain/draft or plain/constrained alternating) (default 1)"},
        {"--temperature", ARG_DOUBLE, &o->temperature, "sampling temperature, seed 1000 + request (default 0: greedy)"},
        {"--json-object", ARG_FLAG, &o->json_object, "also run every point constrained to a JSON object, side by side"},
        {"--json-schema", ARG_STR, &o->schema_path, "also run every point constrained to this JSON Schema file"},
        {"--control", ARG_FLAG, &o->control, "with --json-*: the constrained points run unconstrained (the noise floor)"},
        {"--no-check", ARG_FLAG, &o->no_check, "skip the check against concurrency 1"},
        {"--device", ARG_STR, &o->device, "cpu|cuda: where the model runs (default cpu)"},
        {"--json", ARG_FLAG, &o->json, "print one JSON object"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    be_reexec_passive(argc, argv, o->threads);
    o->n_conc = 0;
    for (const char *p = o->conc_arg; *p && o->n_conc < 16;) {
        o->conc[o->n_conc] = atoi(p);
        if (o->conc[o->n_conc] < 1 || o->conc[o->n_conc] > 256) {
            fprintf(stderr, "tqkv %s: --concurrency values must be in [1, 256]\n", CMD);
            return 2;
        }
        o->n_conc++;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    if (o->prompt_tokens < 1 || o->max_tokens < 1 || o->threads < 1 || o->K < 1 || o->prefix < 0 ||
        o->load < 0 || o->load > 64 || o->chunk < 0 || o->step < 0 || o->reps < 1 || o->reps > 16) {
        fprintf(stderr, "tqkv %s: bad numeric option\n", CMD);
        return 2;
    }
    if (!(o->temperature >= 0 && o->temperature <= 100)) {
        fprintf(stderr, "tqkv %s: --temperature must be in [0, 100]\n", CMD);
        return 2;
    }
    if (o->schema_path) {
        size_t n = 0;
        if (mcli_read_file(CMD, o->schema_path, &o->schema, &n)) return 1;
        o->json_object = 1;
    }
    if (o->json_object && o->draft) {
        fprintf(stderr, "tqkv %s: --draft and --json-object / --json-schema are measured apart\n", CMD);
        return 2;
    }
    return 0;
}

/* Requests per point at concurrency C: --requests, else 2 C (at least 4). */
static int be_requests(const be_opts *o, int C) {
    return o->requests ? o->requests : (2 * C < 4 ? 4 : 2 * C);
}

/* The engine's parameters (model resolved, default --text set); 0, or the exit code
 * (message printed). */
static int be_engine_params(be_opts *o, tqkv_engine_params *ep) {
    if (!mcli_resolve_model(CMD, o->model_arg, o->mdir, sizeof o->mdir)) return 1;
    if (!o->text_path) {
        snprintf(o->tbuf, sizeof o->tbuf, "%s/../../../shared/data/heldout-code.txt", o->mdir);
        o->text_path = o->tbuf;
    }
    *ep = tqkv_engine_params_default();
    ep->model_dir = o->mdir;
    ep->threads = o->threads;
    ep->bf16_act = !mcli_exact;
    ep->window = o->window;
    ep->prefill_chunk = o->chunk;
    ep->prefill_step = o->step;
    ep->kv_budget = (size_t)(o->budget_mb * 1048576.0);
    if (mcli_parse_device(CMD, o->device, &ep->device)) return 2;
    if (mcli_parse_kv(CMD, o->kv, &ep->k_format, &ep->v_format)) return 2;
    int maxc = 1;
    for (int i = 0; i < o->n_conc; i++) maxc = o->conc[i] > maxc ? o->conc[i] : maxc;
    ep->parallel = maxc;
    ep->queue_max = 4096;
    return 0;
}

/* Prompt tokens: the held-out text's first 4 MB tokenized into *ids [*n_ids], enough for
 * Nmax prompts (and the prefix measure); 0 or -1 (message printed). */
static int be_tokens(const be_opts *o, tqkv_engine *e, int Nmax, int32_t **ids, size_t *n_ids) {
    char *text = NULL;
    size_t tlen = 0;
    if (mcli_read_file(CMD, o->text_path, &text, &tlen)) return -1;
    size_t use = tlen < 4000000 ? tlen : 4000000;
    tqkv_status st = tqkv_tokenizer_encode(tqkv_engine_tokenizer(e), text, use, 0, ids, n_ids);
    free(text);
    if (st != TQKV_OK) {
        fprintf(stderr, "tqkv %s: tokenize: %s\n", CMD, tqkv_last_error());
        return -1;
    }
    if (*n_ids < (size_t)o->prompt_tokens * Nmax + (size_t)o->prefix + 64) {
        fprintf(stderr, "tqkv %s: the text has %zu tokens, too few for %d prompts of %d\n", CMD,
                *n_ids, Nmax, o->prompt_tokens);
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Points and their report
// ---------------------------------------------------------------------------

/* Variant names: d = 0 plain, 1 draft or constrained. */
static const char *be_variant(const be_opts *o, int d) {
    return !d ? "plain" : o->draft ? "draft" : o->schema ? "schema" : "json";
}

/* Seconds per token of p's decode-only steps. */
static double dec_per_token(const point *p) { return p->dec_tok > 0 ? p->dec_s / p->dec_tok : 0; }
static double dec_cpu_per_token(const point *p) { return p->dec_tok > 0 ? p->dec_cpu / p->dec_tok : 0; }

/* One measured point: a table row, or an object in pts with --json. */
static void be_report_point(const be_opts *o, cJSON *pts, const point *p, int d, int rep, int C,
                            int N, int same) {
    double acc = p->drafted ? (double)p->accepted / (double)p->drafted : 0;
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToArray(pts, j);
        cJSON_AddStringToObject(j, "mode", be_variant(o, d));
        cJSON_AddNumberToObject(j, "rep", rep);
        cJSON_AddNumberToObject(j, "concurrency", C);
        cJSON_AddNumberToObject(j, "requests", N);
        cJSON_AddNumberToObject(j, "generated", (double)p->gen);
        json_add_num(j, "wall_s", p->wall, 3);
        json_add_num(j, "tok_s", p->tok_s, 2);
        json_add_num(j, "ttft_p50_s", p->ttft50, 4);
        json_add_num(j, "ttft_p99_s", p->ttft99, 4);
        json_add_num(j, "itl_p50_s", p->itl50, 5);
        json_add_num(j, "itl_p99_s", p->itl99, 5);
        cJSON_AddNumberToObject(j, "spec_drafted", (double)p->drafted);
        cJSON_AddNumberToObject(j, "spec_accepted", (double)p->accepted);
        json_add_num(j, "acceptance", acc, 4);
        uint64_t fnv = 1469598103934665603ull; /* every request's tokens, in order */
        for (int k = 0; k < N; k++)
            for (int i = 0; i < 8; i++) fnv = (fnv ^ ((p->hashes[k] >> (8 * i)) & 255)) * 1099511628211ull;
        char hx[24];
        snprintf(hx, sizeof hx, "%016llx", (unsigned long long)fnv);
        cJSON_AddStringToObject(j, "tokens_fnv", hx);
        cJSON_AddNumberToObject(j, "decode_steps", p->dec_steps);
        cJSON_AddNumberToObject(j, "decode_step_tokens", p->dec_tok);
        json_add_num(j, "decode_s_per_token", dec_per_token(p), 7);
        json_add_num(j, "decode_cpu_s_per_token", dec_cpu_per_token(p), 7);
        if (o->no_check || same < 0) cJSON_AddNullToObject(j, "same_as_alone");
        else cJSON_AddBoolToObject(j, "same_as_alone", same);
    } else {
        printf("%-6s %-5d %9.1f %9.3f %9.3f %9.2f %9.2f %8.3f %8s %9.1f %6d\n", be_variant(o, d), C,
               p->tok_s, p->ttft50, p->ttft99, 1e3 * p->itl50, 1e3 * p->itl99, acc,
               o->no_check || same < 0 ? "-" : same ? "yes" : "NO", 1e6 * dec_per_token(p), p->dec_steps);
        /* (a speculative round gives several tokens a row: its steps are not decode-only) */
    }
    fflush(stdout);
}

/* The pair's ratio: draft / plain tokens/s, or constrained / plain time per token of the
 * decode-only steps (cpu: their process CPU time). Returns the ratio, 0 when there is none. */
static double be_pair_ratio(const be_opts *o, const point *pp, const point *pv, int cpu) {
    if (o->draft) return pp->tok_s > 0 ? pv->tok_s / pp->tok_s : 0;
    const double tp = cpu ? dec_cpu_per_token(pp) : dec_per_token(pp);
    const double tv = cpu ? dec_cpu_per_token(pv) : dec_per_token(pv);
    return tp > 0 ? tv / tp : 0;
}

/* "x1.012, x0.998, ..." of r [n], in the order measured. */
static void print_ratios(const double *r, int n) {
    for (int i = 0; i < n; i++) printf("%sx%.3f", i ? ", " : "", r[i]);
}

/* The cold pair's ratios (one pair; the engines' own difference not cancelled). */
static void be_report_cold(const be_opts *o, cJSON *pts, int C, double wall, double cpu) {
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToArray(pts, j);
        cJSON_AddStringToObject(j, "mode", "constrained_cost_cold");
        cJSON_AddNumberToObject(j, "concurrency", C);
        json_add_num(j, "time_per_token_ratio", wall, 4);
        json_add_num(j, "cpu_per_token_ratio", cpu, 4);
    } else {
        printf("constrained (%s) cost at concurrency %d with cold mask caches (one pair, the "
               "engines' difference not cancelled): wall time per token x%.3f, process CPU time "
               "per token x%.3f\n", be_variant(o, 1), C, wall, cpu);
    }
}

/* The median ratios of the pairs of concurrency C (wall [n], and CPU [n] with a
 * constraint): a line, or an object in pts. */
static void be_report_ratio(const be_opts *o, cJSON *pts, int C, const double *wall,
                            const double *cpu, int n) {
    double sw[32], sc[32];
    memcpy(sw, wall, sizeof(double) * (size_t)n);
    memcpy(sc, cpu, sizeof(double) * (size_t)n);
    const double med = pct(sw, (size_t)n, 0.5), medc = pct(sc, (size_t)n, 0.5);
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToArray(pts, j);
        cJSON_AddStringToObject(j, "mode", o->draft ? "speedup" : "constrained_cost");
        cJSON_AddNumberToObject(j, "concurrency", C);
        cJSON_AddNumberToObject(j, o->draft ? "pairs" : "rounds", n);
        if (o->draft) {
            json_add_num(j, "draft_over_plain_median", med, 3);
            return;
        }
        cJSON *rs = cJSON_AddArrayToObject(j, "time_per_token_ratios");
        cJSON *rc = cJSON_AddArrayToObject(j, "cpu_per_token_ratios");
        for (int i = 0; i < n; i++) {
            cJSON_AddItemToArray(rs, cJSON_CreateNumber(round(wall[i] * 1e4) / 1e4));
            cJSON_AddItemToArray(rc, cJSON_CreateNumber(round(cpu[i] * 1e4) / 1e4));
        }
        json_add_num(j, "time_per_token_ratio_median", med, 4);
        json_add_num(j, "cpu_per_token_ratio_median", medc, 4);
    } else if (o->draft) {
        printf("speedup at concurrency %d: draft / plain tokens/s, median of %d "
               "side-by-side pairs: %.2fx\n", C, n, med);
    } else {
        printf("constrained (%s) cost at concurrency %d, decode-only steps (plain rows as long as "
               "the constrained ones), constrained / plain, median of %d rounds: wall time per "
               "token x%.3f (", be_variant(o, 1), C, n, med);
        print_ratios(wall, n);
        printf("); process CPU time per token x%.3f (", medc);
        print_ratios(cpu, n);
        printf(")\n");
    }
}

/* The pair's two points: ratios appended to wall / cpu [*n] (at most 32). */
static void be_add_ratio(const be_opts *o, const point *pp, double *wall, double *cpu, int *n) {
    if (*n >= 32) return;
    const double x = be_pair_ratio(o, &pp[0], &pp[1], 0);
    cpu[*n] = be_pair_ratio(o, &pp[0], &pp[1], 1);
    if (x > 0) wall[(*n)++] = x;
}

/* A constraint at concurrency C on two engines: first the constrained points alone on
 * engine 0 (rep -1: cold mask caches; they give each request's length), then beside plain
 * points on engine 1 (rep -1: a pair with engine 1's caches cold), then --reps rounds of
 * two pairs whose steps interleave, plain requests given those lengths as their
 * max_tokens: constrained on engine 0 beside plain on engine 1, then the other way round
 * (two engines of one model differ by a few percent: a round's ratio, the geometric mean of
 * its two pairs, cancels that). --control: the "constrained" points run unconstrained (the
 * noise floor). 0 or -1. */
static int be_constrained(const be_opts *o, tqkv_engine *e0, tqkv_engine *e1,
                          int32_t *const *prompts, const uint64_t *refv, int C, int N, point *pp,
                          cJSON *pts) {
    tqkv_engine *eng[2] = {e0, e1};
    double wall[34], cpu[34], pw[2], pc[2];
    int n = 0, same_len = 1;
    int *lens = calloc((size_t)N, sizeof *lens);
    if (!lens) return -1;
    const be_mode mp = {(float)o->temperature, 0, NULL, lens};
    const be_mode mc = {(float)o->temperature, !o->control, o->schema, NULL};
    int ok = 1;
    for (int r = -1; r < o->reps && ok; r++)
        for (int k = 0; k < 2 && ok; k++) {
            const int alone = r < 0 && k == 0, ec = k; /* ec: the constrained points' engine */
            fprintf(stderr, "tqkv %s: concurrency %d, %d requests: %s on engine %d%s\n", CMD, C, N,
                    be_variant(o, 1), ec, alone ? " alone (cold caches)"
                    : r < 0 ? " (cold caches), plain beside it, steps interleaved"
                            : ", plain beside it, steps interleaved");
            if (alone) ok = !run_point(eng[0], prompts, o->prompt_tokens, N, C, o->max_tokens, &mc, &pp[1]);
            else ok = !run_pair(eng[1 - ec], &mp, &pp[0], eng[ec], &mc, &pp[1], prompts,
                                o->prompt_tokens, N, C, o->max_tokens, (r + k) % 2);
            if (!ok) break;
            if (alone) memcpy(lens, pp[1].ntok, sizeof(int) * (size_t)N);
            else same_len &= !memcmp(lens, pp[1].ntok, sizeof(int) * (size_t)N);
            int same = 1;
            if (!o->no_check)
                for (int q = 0; q < N; q++) same &= pp[1].hashes[q] == refv[q];
            if (!alone) be_report_point(o, pts, &pp[0], 0, r, C, N, -1); /* shortened: no reference */
            be_report_point(o, pts, &pp[1], 1, r, C, N, same);
            if (alone) continue;
            pw[k] = be_pair_ratio(o, &pp[0], &pp[1], 0);
            pc[k] = be_pair_ratio(o, &pp[0], &pp[1], 1);
            if (r < 0) {
                be_report_cold(o, pts, C, pw[1], pc[1]);
            } else if (k == 1 && n < 32 && pw[0] > 0 && pw[1] > 0) {
                wall[n] = sqrt(pw[0] * pw[1]);
                cpu[n++] = sqrt(pc[0] * pc[1]);
            }
        }
    if (!same_len)
        fprintf(stderr, "tqkv %s: WARNING: the constrained runs gave different lengths\n", CMD);
    if (n > 0) be_report_ratio(o, pts, C, wall, cpu, n);
    free(lens);
    return ok ? 0 : -1;
}

/* Every point at concurrency C (plain; with a draft, plain and draft one after the other,
 * --reps times; with a constraint, be_constrained), then the median ratio of the pairs
 * measured; 0 or -1 (a point failed: message printed, the ratio of the pairs before it
 * still reported). ed: the draft engine, or the constrained points' engine. ref / refv:
 * each variant's tokens at concurrency 1. */
static int be_concurrency(const be_opts *o, tqkv_engine *e, tqkv_engine *ed,
                          int32_t *const *prompts, const uint64_t *ref, const uint64_t *refv,
                          int C, cJSON *pts) {
    const int N = be_requests(o, C);
    double wall[32], cpu[32];
    int n_ratio = 0, ok = 1;
    point pp[2];
    memset(pp, 0, sizeof pp);
    for (int k = 0; k < 2 && ok; k++) {
        pp[k].hashes = calloc((size_t)N, sizeof(uint64_t));
        pp[k].ntok = calloc((size_t)N, sizeof(int));
        ok = pp[k].hashes && pp[k].ntok;
    }
    if (ok && o->json_object) ok = !be_constrained(o, e, ed, prompts, o->control ? ref : refv, C, N, pp, pts);
    for (int r = 0; r < o->reps && ok && !o->json_object; r++)
        for (int d = 0; d < (ed ? 2 : 1) && ok; d++) {
            point *p = &pp[d];
            const be_mode mode = {(float)o->temperature, 0, NULL, NULL};
            fprintf(stderr, "tqkv %s: %s concurrency %d, %d requests\n", CMD, be_variant(o, d), C, N);
            if (run_point(d ? ed : e, prompts, o->prompt_tokens, N, C, o->max_tokens, &mode, p)) {
                ok = 0;
                break;
            }
            int same = 1;
            if (!o->no_check)
                for (int k = 0; k < N; k++) same &= p->hashes[k] == ref[k];
            be_report_point(o, pts, p, d, r, C, N, same);
            if (d == 1) be_add_ratio(o, pp, wall, cpu, &n_ratio);
        }
    if (n_ratio > 0) be_report_ratio(o, pts, C, wall, cpu, n_ratio);
    for (int k = 0; k < 2; k++) {
        free(pp[k].hashes);
        free(pp[k].ntok);
    }
    return ok ? 0 : -1;
}

/* Prefix cache: one miss then hits on requests sharing o->prefix tokens of ids, on an
 * engine of its own; reported as a line, or as root's "prefix" with --json. */
static void be_prefix(const be_opts *o, const tqkv_engine_params *ep, const int32_t *ids,
                      cJSON *root) {
    const int prefix = o->prefix;
    tqkv_engine_params pp = *ep;
    pp.prefix_cache_bytes = (size_t)256 << 20;
    pp.parallel = 1;
    tqkv_engine *ep2 = NULL;
    if (tqkv_engine_init(&ep2, &pp) != TQKV_OK) return;
    enum { NP = 5 };
    int plen = prefix + 32;
    int32_t *pr = malloc(sizeof(int32_t) * (size_t)plen * NP); // [NP, plen]
    int32_t *pv[NP];
    for (int k = 0; k < NP; k++) {
        memcpy(pr + (size_t)k * plen, ids, sizeof(int32_t) * (size_t)prefix);
        memcpy(pr + (size_t)k * plen + prefix, ids + prefix + 32 * (k + 1), sizeof(int32_t) * 32);
        pv[k] = pr + (size_t)k * plen;
    }
    double ttft[NP];
    int cached[NP];
    for (int k = 0; k < NP; k++) {
        point p;
        uint64_t h;
        memset(&p, 0, sizeof p);
        p.hashes = &h;
        const be_mode greedy = {0.0f, 0, NULL, NULL};
        run_point(ep2, pv + k, plen, 1, 1, 1, &greedy, &p);
        ttft[k] = p.ttft50;
        tqkv_engine_stats st;
        tqkv_engine_stats_get(ep2, &st);
        cached[k] = (int)st.prefix_tokens_reused;
    }
    double hit = 0;
    for (int k = 1; k < NP; k++) hit += ttft[k];
    hit /= NP - 1;
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(root, "prefix", j);
        cJSON_AddNumberToObject(j, "prefix_tokens", prefix);
        cJSON_AddNumberToObject(j, "prompt_tokens", plen);
        json_add_num(j, "miss_ttft_s", ttft[0], 4);
        json_add_num(j, "hit_ttft_s", hit, 4);
        cJSON_AddNumberToObject(j, "tokens_reused", cached[NP - 1] - cached[NP - 2]);
        json_add_num(j, "saved", 1.0 - hit / ttft[0], 3);
    } else
        printf("prefix cache: prompt %d tokens (shared %d): miss TTFT %.3f s, hit TTFT "
               "%.3f s (mean of %d), %d tokens reused per hit, %.0f%% of the TTFT saved\n", plen,
               prefix, ttft[0], hit, NP - 1, cached[NP - 1] - cached[NP - 2],
               100 * (1 - hit / ttft[0]));
    free(pr);
    tqkv_engine_free(ep2);
}

/* The JSON document's head; its "points" array in *pts. */
static cJSON *be_json_root(const be_opts *o, const tqkv_engine_params *ep, cJSON **pts) {
    cJSON *root = cJSON_CreateObject();
    *pts = cJSON_CreateArray();
    cJSON_AddStringToObject(root, "command", "bench engine");
    cJSON_AddStringToObject(root, "kv", o->kv);
    cJSON_AddStringToObject(root, "device", ep->device ? "cuda" : "cpu");
    cJSON_AddNumberToObject(root, "threads", o->threads);
    cJSON_AddNumberToObject(root, "load", o->load);
    cJSON_AddNumberToObject(root, "prompt_tokens", o->prompt_tokens);
    cJSON_AddNumberToObject(root, "max_tokens", o->max_tokens);
    json_add_num(root, "temperature", o->temperature, 3);
    cJSON_AddStringToObject(root, "constraint", !o->json_object ? "none" : o->schema ? "json_schema" : "json_object");
    cJSON_AddBoolToObject(root, "control", o->control);
    if (o->schema_path) cJSON_AddStringToObject(root, "schema_file", o->schema_path);
    cJSON_AddItemToObject(root, "points", *pts);
    return root;
}

/* The reference runs (each variant's tokens at concurrency 1), every concurrency and the
 * prefix measure; 1 when all points ran, else 0. */
static int be_measure(const be_opts *o, const tqkv_engine_params *ep, tqkv_engine *e,
                      tqkv_engine *ed, int32_t *const *prompts, const int32_t *ids, int Nmax,
                      cJSON *root, cJSON *pts) {
    int sched_ok = 1;
    uint64_t *ref = calloc((size_t)Nmax, sizeof *ref), *refv = calloc((size_t)Nmax, sizeof *refv);
    if (!o->json) printf("%-6s %-5s %9s %9s %9s %9s %9s %8s %8s %9s %6s\n", "mode", "conc", "tok/s", "ttft50",
                         "ttft99", "itl50ms", "itl99ms", "accept", "same", "dec_us/t", "dsteps");
    for (int d = 0; d < (o->json_object && !o->control ? 2 : 1) && !o->no_check && sched_ok; d++) {
        point p;
        memset(&p, 0, sizeof p);
        p.hashes = d ? refv : ref;
        const be_mode mode = {(float)o->temperature, d, o->schema, NULL};
        fprintf(stderr, "tqkv %s: %s reference run at concurrency 1 (%d requests)\n", CMD,
                be_variant(o, d), Nmax);
        if (run_point(e, prompts, o->prompt_tokens, Nmax, 1, o->max_tokens, &mode, &p)) sched_ok = 0;
    }
    for (int i = 0; i < o->n_conc && sched_ok; i++)
        if (be_concurrency(o, e, ed, prompts, ref, refv, o->conc[i], pts)) sched_ok = 0;
    if (o->prefix > 0 && sched_ok) be_prefix(o, ep, ids, root);
    free(ref);
    free(refv);
    return sched_ok;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_bench_engine(int argc, char **argv) {
    be_opts o;
    int rc = be_parse_args(argc, argv, &o);
    if (rc) return rc;
    tqkv_engine_params ep;
    if ((rc = be_engine_params(&o, &ep))) return rc;

    tqkv_engine *e = NULL, *ed = NULL;
    if (tqkv_engine_init(&e, &ep) != TQKV_OK) {
        fprintf(stderr, "tqkv %s: %s\n", CMD, tqkv_last_error());
        return 1;
    }
    if (o.json_object && tqkv_engine_init(&ed, &ep) != TQKV_OK) { /* the constrained points' */
        fprintf(stderr, "tqkv %s: %s\n", CMD, tqkv_last_error());
        tqkv_engine_free(e);
        return 1;
    }
    if (o.draft) {
        tqkv_engine_params dp = ep;
        dp.draft_dir = o.draft;
        dp.draft_tokens = o.K;
        if (tqkv_engine_init(&ed, &dp) != TQKV_OK) {
            fprintf(stderr, "tqkv %s: %s\n", CMD, tqkv_last_error());
            tqkv_engine_free(e);
            return 1;
        }
    }
    /* prompts: consecutive windows of the held-out text */
    int Nmax = 0;
    for (int i = 0; i < o.n_conc; i++) {
        int n = be_requests(&o, o.conc[i]);
        Nmax = n > Nmax ? n : Nmax;
    }
    int32_t *ids = NULL, **prompts = NULL;
    size_t n_ids = 0;
    rc = 1;
    if (be_tokens(&o, e, Nmax, &ids, &n_ids)) goto done;
    prompts = malloc(sizeof(int32_t *) * (size_t)Nmax);
    for (int i = 0; i < Nmax; i++) prompts[i] = ids + (size_t)i * o.prompt_tokens;

    pid_t pids[64] = {0};
    load_start(o.load, pids);
    cJSON *pts = NULL, *root = be_json_root(&o, &ep, &pts);
    int sched_ok = be_measure(&o, &ep, e, ed, prompts, ids, Nmax, root, pts);
    /* the document is printed whole, also after a failed point (the exit status says so) */
    int jrc = o.json ? json_print(stdout, root, 0, CMD) : 0; /* frees root */
    if (!o.json) cJSON_Delete(root);
    load_stop(o.load, pids);
    rc = sched_ok && !jrc ? 0 : 1;
done:
    free(prompts);
    free(ids);
    tqkv_engine_free(e);
    tqkv_engine_free(ed);
    free(o.schema);
    return rc;
}

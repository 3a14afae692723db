/*
 * cmd_bench_attention.c - `tqkv bench attention`: decode attention (n_query = 1) over
 * B rows of N tokens of random data, for every requested format and kernel set.
 *
 *   tqkv bench attention --ctx N --batch B --q-heads 32 --kv-heads 8 --dim 128 --threads T
 *        [--formats f32,f16,q8,q4,tq4,tq3,tq2] [--kernels dense,deferred,fused]
 *        [--window W] [--reps R] [--json] [--device cpu|cuda]
 *   (--device cuda runs the GPU benchmark of cmd_bench_attention_cuda.c instead)
 *
 * Every configuration lives in its own cache, filled before any timing. After one
 * warm-up call each, the repetitions run round-robin over the configurations (rep 1 of
 * all, then rep 2 of all, ...) so that machine noise and cache eviction hit all of them
 * alike; ms is the median. ratio_vs_f32 = dense f32 ms / this ms (dense f32 is always
 * measured, printed only when requested). bytes_per_token = K+V bytes the kernel reads
 * per token (all kv heads; window tokens at q8); gb_per_s = those bytes / time.
 * Owns: the benchmark driver and its output. Must not: contain attention logic (public
 * API only).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tqkv.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
typedef struct { uint64_t s; } ba_rng;

static uint64_t ba_u64(ba_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void ba_fill_normal(ba_rng *r, float *x, size_t n) {
    for (size_t i = 0; i + 1 < n; i += 2) {
        const double u1 = ((double)(ba_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
        const double u2 = (double)(ba_u64(r) >> 11) * (1.0 / 9007199254740992.0);
        const double m = sqrt(-2.0 * log(u1));
        x[i] = (float)(m * cos(6.283185307179586 * u2));
        x[i + 1] = (float)(m * sin(6.283185307179586 * u2));
    }
    if (n & 1) x[n - 1] = 0.5f;
}

static int ba_cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Split a comma list into up to cap tokens (in place copy in buf). */
static int ba_split(const char *list, char *buf, size_t bufcap, char **tok, int cap) {
    snprintf(buf, bufcap, "%s", list);
    int n = 0;
    for (char *s = strtok(buf, ","); s && n < cap; s = strtok(NULL, ",")) tok[n++] = s;
    return n;
}

// ---------------------------------------------------------------------------
// Benchmark
// ---------------------------------------------------------------------------
typedef struct {
    tqkv_format fmt;
    tqkv_kernel kern;
    int shown;         /* requested by the user (dense f32 may be a hidden baseline) */
    int cache;         /* index into the caches */
    double *ms;        /* [reps] */
    double median;
} ba_config;

/* K+V bytes read per token, averaged over the context (window tokens read at q8). */
static double ba_bytes_per_token(tqkv_format f, int kvh, int dim, int window, int ctx) {
    const double main = (double)tqkv_format_bytes(f, dim);
    if (!tqkv_format_is_tq(f) || window <= 0) return 2.0 * kvh * main;
    const int w = window < ctx ? window : ctx;
    const double q8 = (double)tqkv_format_bytes(TQKV_Q8, dim);
    return 2.0 * kvh * ((double)(ctx - w) * main + (double)w * q8) / (double)ctx;
}

int cmd_bench_attention_cuda(int argc, char **argv); /* cmd_bench_attention_cuda.c */

/* The benchmark's options. */
typedef struct {
    int ctx, batch, q_heads, kv_heads, dim, threads, window, reps, json;
    const char *formats, *kernels;
} ba_opts;

/* Everything one run holds: its configurations (plus the hidden dense f32 baseline) and
 * one cache per distinct format. */
typedef struct {
    ba_config   cfgs[(TQKV_FORMAT_COUNT + 1) * (TQKV_KERNEL_COUNT + 1) + 1];
    int         ncfg, base;
    tqkv_format cache_fmt[TQKV_FORMAT_COUNT + 2];
    tqkv_batch *caches[TQKV_FORMAT_COUNT + 2];
    int         ncache;
} ba_run;

/* --formats x --kernels (duplicates dropped) and the dense f32 baseline; 0 or 2. */
static int ba_plan(const ba_opts *o, ba_run *R) {
    char fbuf[256], kbuf[256];
    char *ftok[TQKV_FORMAT_COUNT + 1], *ktok[TQKV_KERNEL_COUNT + 1];
    const int nf = ba_split(o->formats, fbuf, sizeof fbuf, ftok, TQKV_FORMAT_COUNT + 1);
    const int nk = ba_split(o->kernels, kbuf, sizeof kbuf, ktok, TQKV_KERNEL_COUNT + 1);
    tqkv_format fmts[TQKV_FORMAT_COUNT + 1];
    tqkv_kernel kerns[TQKV_KERNEL_COUNT + 1];
    if (nf < 1 || nk < 1) {
        fprintf(stderr, "tqkv bench attention: empty --formats or --kernels\n");
        return 2;
    }
    for (int i = 0; i < nf; i++)
        if (tqkv_format_parse(ftok[i], &fmts[i]) != TQKV_OK) {
            fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
            return 2;
        }
    for (int i = 0; i < nk; i++)
        if (tqkv_kernel_parse(ktok[i], &kerns[i]) != TQKV_OK) {
            fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
            return 2;
        }
    R->ncfg = R->ncache = 0;
    R->base = -1;
    for (int i = 0; i < nf; i++) {
        int dup = 0;
        for (int j = 0; j < i; j++) dup |= fmts[j] == fmts[i];
        if (dup) continue;
        R->cache_fmt[R->ncache] = fmts[i];
        for (int k = 0; k < nk; k++) {
            int kd = 0;
            for (int j = 0; j < k; j++) kd |= kerns[j] == kerns[k];
            if (kd) continue;
            ba_config *c = &R->cfgs[R->ncfg];
            memset(c, 0, sizeof *c);
            c->fmt = fmts[i];
            c->kern = kerns[k];
            c->shown = 1;
            c->cache = R->ncache;
            if (c->fmt == TQKV_F32 && c->kern == TQKV_KERNEL_DENSE) R->base = R->ncfg;
            R->ncfg++;
        }
        R->ncache++;
    }
    if (R->base < 0) {
        int fc = -1;
        for (int i = 0; i < R->ncache; i++)
            if (R->cache_fmt[i] == TQKV_F32) fc = i;
        if (fc < 0) {
            fc = R->ncache;
            R->cache_fmt[R->ncache++] = TQKV_F32;
        }
        ba_config *c = &R->cfgs[R->ncfg];
        memset(c, 0, sizeof *c);
        c->fmt = TQKV_F32;
        c->kern = TQKV_KERNEL_DENSE;
        c->shown = 0;
        c->cache = fc;
        R->base = R->ncfg++;
    }
    return 0;
}

/* One cache per format, filled with ctx tokens of N(0, 1) K and V per row; 0 or 1. */
static int ba_fill(const ba_opts *o, ba_run *R, ba_rng *rng) {
    const int chunk = o->ctx < 512 ? o->ctx : 512;
    const size_t chunk_floats = (size_t)o->batch * o->kv_heads * chunk * o->dim;
    float *kbufv = malloc(sizeof(float) * chunk_floats), *vbufv = malloc(sizeof(float) * chunk_floats);
    int rc = kbufv && vbufv ? 0 : 1;
    if (rc) fprintf(stderr, "tqkv bench attention: out of memory\n");
    for (int ci = 0; ci < R->ncache && !rc; ci++) {
        tqkv_cache_config cc = tqkv_cache_config_default();
        cc.kv_heads = o->kv_heads;
        cc.head_dim = o->dim;
        cc.k_format = cc.v_format = R->cache_fmt[ci];
        cc.seed = 12345;
        cc.window = tqkv_format_is_tq(R->cache_fmt[ci]) ? o->window : 0;
        cc.window_slack = cc.window ? 32 : 0;
        if (tqkv_batch_init(&R->caches[ci], &cc, o->batch) != TQKV_OK) {
            fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
            rc = 1;
            break;
        }
        const double t0 = tqkv_now_s();
        fprintf(stderr, "[bench attention] filling %s cache: %d rows x %d tokens x %d kv heads\n",
                tqkv_format_name(R->cache_fmt[ci]), o->batch, o->ctx, o->kv_heads);
        for (int t = 0; t < o->ctx && !rc; t += chunk) {
            const int n = o->ctx - t < chunk ? o->ctx - t : chunk;
            const size_t cnt = (size_t)o->batch * o->kv_heads * n * o->dim;
            ba_fill_normal(rng, kbufv, cnt);
            ba_fill_normal(rng, vbufv, cnt);
            if (tqkv_batch_append(R->caches[ci], kbufv, vbufv, n) != TQKV_OK) {
                fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
                rc = 1;
            }
        }
        if (!rc)
            fprintf(stderr, "[bench attention]   %s filled in %.1f s (%.1f MiB)\n",
                    tqkv_format_name(R->cache_fmt[ci]), tqkv_now_s() - t0,
                    (double)tqkv_batch_bytes_used(R->caches[ci]) / (1024.0 * 1024.0));
    }
    free(kbufv);
    free(vbufv);
    return rc;
}

/* Warm-up, then round-robin repetitions; each configuration's median. 0 or 1. */
static int ba_measure(const ba_opts *o, ba_run *R, const float *q, float *out) {
    tqkv_attn_params p = {.q_heads = o->q_heads, .scale = 1.0f / sqrtf((float)o->dim),
                          .kernel = TQKV_KERNEL_DENSE, .threads = o->threads};
    fprintf(stderr, "[bench attention] measuring %d configurations x %d reps (threads %d)\n",
            R->ncfg, o->reps, o->threads);
    for (int rep = -1; rep < o->reps; rep++) {
        for (int i = 0; i < R->ncfg; i++) {
            p.kernel = R->cfgs[i].kern;
            const double t0 = tqkv_now_s();
            if (tqkv_batch_attend(R->caches[R->cfgs[i].cache], NULL, q, 1, &p, out) != TQKV_OK) {
                fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
                return 1;
            }
            const double dt = tqkv_now_s() - t0;
            if (rep >= 0) R->cfgs[i].ms[rep] = dt * 1e3;
        }
    }
    const int reps = o->reps;
    for (int i = 0; i < R->ncfg; i++) {
        qsort(R->cfgs[i].ms, (size_t)reps, sizeof(double), ba_cmp);
        R->cfgs[i].median = reps & 1 ? R->cfgs[i].ms[reps / 2]
                                     : 0.5 * (R->cfgs[i].ms[reps / 2 - 1] + R->cfgs[i].ms[reps / 2]);
    }
    return 0;
}

static void ba_report(const ba_opts *o, const ba_run *R) {
    const double base_ms = R->cfgs[R->base].median;
    const int ctx = o->ctx, batch = o->batch, kv_heads = o->kv_heads, dim = o->dim;
    if (o->json) {
        cJSON *arr = cJSON_CreateArray();
        for (int i = 0; i < R->ncfg; i++) {
            if (!R->cfgs[i].shown) continue;
            const ba_config *c = &R->cfgs[i];
            const double bpt = ba_bytes_per_token(c->fmt, kv_heads, dim, o->window, ctx);
            cJSON *j = cJSON_CreateObject();
            cJSON_AddStringToObject(j, "format", tqkv_format_name(c->fmt));
            cJSON_AddStringToObject(j, "kernel", tqkv_kernel_name(c->kern));
            cJSON_AddNumberToObject(j, "ms", c->median);
            cJSON_AddNumberToObject(j, "ratio_vs_f32", base_ms / c->median);
            cJSON_AddNumberToObject(j, "bytes_per_token", bpt);
            cJSON_AddNumberToObject(j, "gb_per_s", bpt * ctx * batch / (c->median * 1e-3) / 1e9);
            cJSON_AddNumberToObject(j, "ctx", ctx);
            cJSON_AddNumberToObject(j, "batch", batch);
            cJSON_AddNumberToObject(j, "q_heads", o->q_heads);
            cJSON_AddNumberToObject(j, "kv_heads", kv_heads);
            cJSON_AddNumberToObject(j, "dim", dim);
            cJSON_AddNumberToObject(j, "threads", o->threads);
            cJSON_AddNumberToObject(j, "window", o->window);
            cJSON_AddNumberToObject(j, "reps", o->reps);
            cJSON_AddItemToArray(arr, j);
        }
        char *s = cJSON_Print(arr);
        if (s) printf("%s\n", s);
        free(s);
        cJSON_Delete(arr);
        return;
    }
    printf("decode attention: ctx %d, batch %d, %d q / %d kv heads, dim %d, threads %d, "
           "window %d, median of %d reps\n", ctx, batch, o->q_heads, kv_heads, dim, o->threads,
           o->window, o->reps);
    printf("%-6s %-9s %10s %12s %15s %9s\n", "format", "kernel", "ms", "ratio_vs_f32",
           "bytes_per_token", "gb_per_s");
    for (int i = 0; i < R->ncfg; i++) {
        if (!R->cfgs[i].shown) continue;
        const ba_config *c = &R->cfgs[i];
        const double bpt = ba_bytes_per_token(c->fmt, kv_heads, dim, o->window, ctx);
        printf("%-6s %-9s %10.3f %12.2f %15.1f %9.2f\n", tqkv_format_name(c->fmt),
               tqkv_kernel_name(c->kern), c->median, base_ms / c->median, bpt,
               bpt * ctx * batch / (c->median * 1e-3) / 1e9);
    }
}

int cmd_bench_attention(int argc, char **argv) {
    /* --device cuda: the GPU benchmark (its own options); --device cpu: this one */
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--device")) {
            if (!strcmp(argv[i + 1], "cuda")) return cmd_bench_attention_cuda(argc, argv);
            if (strcmp(argv[i + 1], "cpu")) {
                fprintf(stderr, "tqkv bench attention: --device must be cpu or cuda\n");
                return 2;
            }
            for (int j = i; j + 2 < argc; j++) argv[j] = argv[j + 2];
            argc -= 2;
            break;
        }
    ba_opts o = {.ctx = 4096, .batch = 1, .q_heads = 32, .kv_heads = 8, .dim = 128,
                 .threads = 2, .window = 0, .reps = 15, .json = 0,
                 .formats = "f32,f16,q8,q4,tq4,tq3,tq2", .kernels = "dense,deferred,fused"};
    const arg_spec specs[] = {
        {"--ctx", ARG_INT, &o.ctx, "tokens per row (default 4096)"},
        {"--batch", ARG_INT, &o.batch, "rows (default 1)"},
        {"--q-heads", ARG_INT, &o.q_heads, "query heads (default 32)"},
        {"--kv-heads", ARG_INT, &o.kv_heads, "kv heads (default 8)"},
        {"--dim", ARG_INT, &o.dim, "head dim (default 128)"},
        {"--threads", ARG_INT, &o.threads, "attention threads (default 2)"},
        {"--formats", ARG_STR, &o.formats, "comma list (default f32,f16,q8,q4,tq4,tq3,tq2)"},
        {"--kernels", ARG_STR, &o.kernels, "comma list (default dense,deferred,fused)"},
        {"--window", ARG_INT, &o.window, "q8 recent window of tq caches (default 0)"},
        {"--reps", ARG_INT, &o.reps, "timed repetitions per configuration (default 15)"},
        {"--json", ARG_FLAG, &o.json, "JSON output"},
    };
    const int nspecs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse("bench attention", argc, argv, specs, nspecs) != 0) return 2;
    if (o.ctx < 1 || o.batch < 1 || o.kv_heads < 1 || o.q_heads < 1 || o.q_heads % o.kv_heads ||
        o.threads < 1 || o.reps < 1 || o.window < 0 || tqkv_check_dim(o.dim) != TQKV_OK) {
        fprintf(stderr, "tqkv bench attention: need ctx, batch, threads, reps >= 1, window >= 0, "
                        "q-heads a multiple of kv-heads, dim a power of two in [32, 512]\n");
        return 2;
    }
    ba_run *R = calloc(1, sizeof *R);
    if (!R) return 1;
    int rc = ba_plan(&o, R);
    if (rc) {
        free(R);
        return rc;
    }
    ba_rng rng = {0x7a11c0ffee1234ull};
    const size_t qn = (size_t)o.batch * o.q_heads * o.dim;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn);
    rc = q && out ? 0 : 1;
    for (int i = 0; i < R->ncfg && !rc; i++) {
        R->cfgs[i].ms = malloc(sizeof(double) * (size_t)o.reps);
        if (!R->cfgs[i].ms) rc = 1;
    }
    if (rc) fprintf(stderr, "tqkv bench attention: out of memory\n");
    if (!rc) {
        ba_fill_normal(&rng, q, qn);
        rc = ba_fill(&o, R, &rng);
    }
    if (!rc) rc = ba_measure(&o, R, q, out);
    if (!rc) ba_report(&o, R);
    for (int i = 0; i < R->ncache; i++) tqkv_batch_free(R->caches[i]);
    for (int i = 0; i < R->ncfg; i++) free(R->cfgs[i].ms);
    free(R);
    free(q);
    free(out);
    return rc;
}

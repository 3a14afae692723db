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

static double ba_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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
    int ctx = 4096, batch = 1, q_heads = 32, kv_heads = 8, dim = 128, threads = 2;
    int window = 0, reps = 15, json = 0;
    const char *formats = "f32,f16,q8,q4,tq4,tq3,tq2", *kernels = "dense,deferred,fused";
    const arg_spec specs[] = {
        {"--ctx", ARG_INT, &ctx, "tokens per row (default 4096)"},
        {"--batch", ARG_INT, &batch, "rows (default 1)"},
        {"--q-heads", ARG_INT, &q_heads, "query heads (default 32)"},
        {"--kv-heads", ARG_INT, &kv_heads, "kv heads (default 8)"},
        {"--dim", ARG_INT, &dim, "head dim (default 128)"},
        {"--threads", ARG_INT, &threads, "attention threads (default 2)"},
        {"--formats", ARG_STR, &formats, "comma list (default f32,f16,q8,q4,tq4,tq3,tq2)"},
        {"--kernels", ARG_STR, &kernels, "comma list (default dense,deferred,fused)"},
        {"--window", ARG_INT, &window, "q8 recent window of tq caches (default 0)"},
        {"--reps", ARG_INT, &reps, "timed repetitions per configuration (default 15)"},
        {"--json", ARG_FLAG, &json, "JSON output"},
    };
    const int nspecs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse("bench attention", argc, argv, specs, nspecs) != 0) return 2;
    if (ctx < 1 || batch < 1 || kv_heads < 1 || q_heads < 1 || q_heads % kv_heads ||
        threads < 1 || reps < 1 || window < 0 || tqkv_check_dim(dim) != TQKV_OK) {
        fprintf(stderr, "tqkv bench attention: need ctx, batch, threads, reps >= 1, window >= 0, "
                        "q-heads a multiple of kv-heads, dim a power of two in [32, 512]\n");
        return 2;
    }

    // ---- parse lists ------------------------------------------------------------
    char fbuf[256], kbuf[256];
    char *ftok[TQKV_FORMAT_COUNT + 1], *ktok[TQKV_KERNEL_COUNT + 1];
    const int nf = ba_split(formats, fbuf, sizeof fbuf, ftok, TQKV_FORMAT_COUNT + 1);
    const int nk = ba_split(kernels, kbuf, sizeof kbuf, ktok, TQKV_KERNEL_COUNT + 1);
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

    // ---- configurations (plus the dense f32 baseline) ------------------------------
    ba_config cfgs[(TQKV_FORMAT_COUNT + 1) * (TQKV_KERNEL_COUNT + 1) + 1];
    int ncfg = 0, base = -1;
    tqkv_format cache_fmt[TQKV_FORMAT_COUNT + 2];
    int ncache = 0;
    for (int i = 0; i < nf; i++) {
        int dup = 0;
        for (int j = 0; j < i; j++) dup |= fmts[j] == fmts[i];
        if (dup) continue;
        cache_fmt[ncache] = fmts[i];
        for (int k = 0; k < nk; k++) {
            int kd = 0;
            for (int j = 0; j < k; j++) kd |= kerns[j] == kerns[k];
            if (kd) continue;
            ba_config *c = &cfgs[ncfg];
            memset(c, 0, sizeof *c);
            c->fmt = fmts[i];
            c->kern = kerns[k];
            c->shown = 1;
            c->cache = ncache;
            if (c->fmt == TQKV_F32 && c->kern == TQKV_KERNEL_DENSE) base = ncfg;
            ncfg++;
        }
        ncache++;
    }
    if (base < 0) {
        int fc = -1;
        for (int i = 0; i < ncache; i++)
            if (cache_fmt[i] == TQKV_F32) fc = i;
        if (fc < 0) {
            fc = ncache;
            cache_fmt[ncache++] = TQKV_F32;
        }
        ba_config *c = &cfgs[ncfg];
        memset(c, 0, sizeof *c);
        c->fmt = TQKV_F32;
        c->kern = TQKV_KERNEL_DENSE;
        c->shown = 0;
        c->cache = fc;
        base = ncfg++;
    }

    // ---- fill the caches ---------------------------------------------------------
    ba_rng rng = {0x7a11c0ffee1234ull};
    tqkv_batch *caches[TQKV_FORMAT_COUNT + 2] = {0};
    const int chunk = ctx < 512 ? ctx : 512;
    const size_t chunk_floats = (size_t)batch * kv_heads * chunk * dim;
    float *kbufv = malloc(sizeof(float) * chunk_floats), *vbufv = malloc(sizeof(float) * chunk_floats);
    const size_t qn = (size_t)batch * q_heads * dim;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn);
    int rc = 1;
    for (int i = 0; i < ncfg; i++) {
        cfgs[i].ms = malloc(sizeof(double) * (size_t)reps);
        if (!cfgs[i].ms) goto done;
    }
    if (!kbufv || !vbufv || !q || !out) {
        fprintf(stderr, "tqkv bench attention: out of memory\n");
        goto done;
    }
    ba_fill_normal(&rng, q, qn);
    for (int ci = 0; ci < ncache; ci++) {
        tqkv_cache_config cc = tqkv_cache_config_default();
        cc.kv_heads = kv_heads;
        cc.head_dim = dim;
        cc.k_format = cc.v_format = cache_fmt[ci];
        cc.seed = 12345;
        cc.window = tqkv_format_is_tq(cache_fmt[ci]) ? window : 0;
        cc.window_slack = cc.window ? 32 : 0;
        if (tqkv_batch_init(&caches[ci], &cc, batch) != TQKV_OK) {
            fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
            goto done;
        }
        const double t0 = ba_now();
        fprintf(stderr, "[bench attention] filling %s cache: %d rows x %d tokens x %d kv heads\n",
                tqkv_format_name(cache_fmt[ci]), batch, ctx, kv_heads);
        for (int t = 0; t < ctx; t += chunk) {
            const int n = ctx - t < chunk ? ctx - t : chunk;
            const size_t cnt = (size_t)batch * kv_heads * n * dim;
            ba_fill_normal(&rng, kbufv, cnt);
            ba_fill_normal(&rng, vbufv, cnt);
            if (tqkv_batch_append(caches[ci], kbufv, vbufv, n) != TQKV_OK) {
                fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
                goto done;
            }
        }
        fprintf(stderr, "[bench attention]   %s filled in %.1f s (%.1f MiB)\n",
                tqkv_format_name(cache_fmt[ci]), ba_now() - t0,
                (double)tqkv_batch_bytes_used(caches[ci]) / (1024.0 * 1024.0));
    }

    // ---- measure: warm-up, then round-robin repetitions ----------------------------
    tqkv_attn_params p = {.q_heads = q_heads, .scale = 1.0f / sqrtf((float)dim),
                          .kernel = TQKV_KERNEL_DENSE, .threads = threads};
    fprintf(stderr, "[bench attention] measuring %d configurations x %d reps (threads %d)\n",
            ncfg, reps, threads);
    for (int rep = -1; rep < reps; rep++) {
        for (int i = 0; i < ncfg; i++) {
            p.kernel = cfgs[i].kern;
            const double t0 = ba_now();
            if (tqkv_batch_attend(caches[cfgs[i].cache], NULL, q, 1, &p, out) != TQKV_OK) {
                fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
                goto done;
            }
            const double dt = ba_now() - t0;
            if (rep >= 0) cfgs[i].ms[rep] = dt * 1e3;
        }
    }
    for (int i = 0; i < ncfg; i++) {
        qsort(cfgs[i].ms, (size_t)reps, sizeof(double), ba_cmp);
        cfgs[i].median = reps & 1 ? cfgs[i].ms[reps / 2]
                                  : 0.5 * (cfgs[i].ms[reps / 2 - 1] + cfgs[i].ms[reps / 2]);
    }

    // ---- report --------------------------------------------------------------------
    const double base_ms = cfgs[base].median;
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        for (int i = 0; i < ncfg; i++) {
            if (!cfgs[i].shown) continue;
            const ba_config *c = &cfgs[i];
            const double bpt = ba_bytes_per_token(c->fmt, kv_heads, dim, window, ctx);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "format", tqkv_format_name(c->fmt));
            cJSON_AddStringToObject(o, "kernel", tqkv_kernel_name(c->kern));
            cJSON_AddNumberToObject(o, "ms", c->median);
            cJSON_AddNumberToObject(o, "ratio_vs_f32", base_ms / c->median);
            cJSON_AddNumberToObject(o, "bytes_per_token", bpt);
            cJSON_AddNumberToObject(o, "gb_per_s", bpt * ctx * batch / (c->median * 1e-3) / 1e9);
            cJSON_AddNumberToObject(o, "ctx", ctx);
            cJSON_AddNumberToObject(o, "batch", batch);
            cJSON_AddNumberToObject(o, "q_heads", q_heads);
            cJSON_AddNumberToObject(o, "kv_heads", kv_heads);
            cJSON_AddNumberToObject(o, "dim", dim);
            cJSON_AddNumberToObject(o, "threads", threads);
            cJSON_AddNumberToObject(o, "window", window);
            cJSON_AddNumberToObject(o, "reps", reps);
            cJSON_AddItemToArray(arr, o);
        }
        char *s = cJSON_Print(arr);
        if (s) printf("%s\n", s);
        free(s);
        cJSON_Delete(arr);
    } else {
        printf("decode attention: ctx %d, batch %d, %d q / %d kv heads, dim %d, threads %d, "
               "window %d, median of %d reps\n", ctx, batch, q_heads, kv_heads, dim, threads,
               window, reps);
        printf("%-6s %-9s %10s %12s %15s %9s\n", "format", "kernel", "ms", "ratio_vs_f32",
               "bytes_per_token", "gb_per_s");
        for (int i = 0; i < ncfg; i++) {
            if (!cfgs[i].shown) continue;
            const ba_config *c = &cfgs[i];
            const double bpt = ba_bytes_per_token(c->fmt, kv_heads, dim, window, ctx);
            printf("%-6s %-9s %10.3f %12.2f %15.1f %9.2f\n", tqkv_format_name(c->fmt),
                   tqkv_kernel_name(c->kern), c->median, base_ms / c->median, bpt,
                   bpt * ctx * batch / (c->median * 1e-3) / 1e9);
        }
    }
    rc = 0;

done:
    for (int i = 0; i < ncache; i++) tqkv_batch_free(caches[i]);
    for (int i = 0; i < ncfg; i++) free(cfgs[i].ms);
    free(kbufv);
    free(vbufv);
    free(q);
    free(out);
    return rc;
}

/*
 * cmd_bench_attention_cuda.c - `tqkv bench attention --device cuda`: GPU decode attention
 * over B rows of N tokens of random data, for the dense bf16 baseline and the compressed
 * formats, beside a device-to-device copy and (optionally) an anchor measured by another
 * program in the same run (scripts/cuda_anchor.py: PyTorch cuDNN SDPA on bf16).
 *
 *   tqkv bench attention --device cuda [--batches 1,8,32] [--ctxs 4096,16384,65536,131072]
 *        [--formats bf16,tq4,tq3,tq4w,fp8,tq2,tq4/tq2w] [--window 128] [--q-heads 32] [--kv-heads 8]
 *        [--dim 128|256] [--reps 30] [--anchor anchor.json] [--out bench.json] [--json]
 *
 * Caches are filled on the GPU (random normal K/V, encoded by the GPU append). Each timed
 * repetition is preceded by a 256 MiB write that evicts L2, and timed with CUDA events
 * around the attention call alone; ms is the median. gbps = the bytes the kernel must read
 * (K + V of every token at its format; tq4w: the newest `window` tokens at q8) / ms.
 * copy_gbps = 2 x bytes / ms of a 2 GiB cudaMemcpy device-to-device (read + write).
 * speedup = anchor_ms / ms (anchor: same batch and ctx, from --anchor).
 * --dim 256: caches of head_dim 256 (Gemma 4's full layers; scale 1 / 16): tq on the
 * tensor-core split kernel, or on the float32 one with TQKV_WIDE_TC=0 in the environment (the
 * "kernel" key says which), bf16 on the float32 one. fp8, tq2 and mixed tq K/V decode on the
 * float32 kernel of attn_cuda_fmt.cu ("kernel": "f32"), but tq2, mixed tq and fp8 at d = 128 on
 * the tensor-core split kernel ("tc"; fp8 on the float32 one with TQKV_FP8_TC=0 in the
 * environment, for A/B runs). The anchor script
 * measures d = 128 only.
 * Owns: the benchmark driver and its output. Must not: contain attention logic.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tqkv.h"

int cmd_bench_attention_cuda(int argc, char **argv);

#ifndef TQKV_HAVE_CUDA
int cmd_bench_attention_cuda(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "tqkv bench attention: this build has no CUDA backend (configure with nvcc)\n");
    return 2;
}
#else
#include "cache/cache_cuda.h"

static int bc_cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int bc_ints(const char *list, int *out, int cap) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    int n = 0;
    for (char *s = strtok(buf, ","); s && n < cap; s = strtok(NULL, ",")) out[n++] = atoi(s);
    return n;
}

/* Anchor ms for (batch, ctx) from the anchor JSON array, or NAN. */
static double bc_anchor(const cJSON *arr, int batch, int ctx) {
    const cJSON *o;
    cJSON_ArrayForEach(o, arr) {
        const cJSON *b = cJSON_GetObjectItem(o, "batch"), *c = cJSON_GetObjectItem(o, "ctx");
        const cJSON *m = cJSON_GetObjectItem(o, "ms");
        if (cJSON_IsNumber(b) && cJSON_IsNumber(c) && cJSON_IsNumber(m) && b->valueint == batch &&
            c->valueint == ctx)
            return m->valuedouble;
    }
    return NAN;
}

static cJSON *bc_read_json(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    cJSON *j = NULL;
    if (s && fread(s, 1, (size_t)n, f) == (size_t)n) {
        s[n] = 0;
        j = cJSON_Parse(s);
    }
    free(s);
    fclose(f);
    return j;
}

typedef struct {
    char name[32];
    int bf16;
    tqkv_format fmt, vfmt; /* K and V formats (bf16: unused) */
    int window;
} bc_format;

#define BC_MAX_FORMATS 8

/* --formats: bf16, or a K/V spec the device cache holds (tq4, tq3, tq2, fp8, tq4/tq2, ...:
 * tqkv_cuda_kv_formats_ok) with a trailing 'w' for the q8 window (tq4w: tq4 + the window);
 * the count, or -1 (printed). */
static int bc_formats(const char *formats_s, int window, bc_format *fmts) {
    int nf = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", formats_s);
    for (char *s = strtok(buf, ","); s; s = strtok(NULL, ",")) {
        if (nf == BC_MAX_FORMATS) {
            fprintf(stderr, "tqkv bench attention: at most %d formats\n", BC_MAX_FORMATS);
            return -1;
        }
        bc_format f;
        memset(&f, 0, sizeof f);
        const size_t len = strlen(s);
        if (!strcmp(s, "bf16")) {
            f.bf16 = 1;
            f.fmt = f.vfmt = TQKV_TQ4;
            snprintf(f.name, sizeof f.name, "bf16");
            fmts[nf++] = f;
            continue;
        }
        const int win = len > 1 && len < sizeof f.name - 8 && s[len - 1] == 'w';
        char spec[24];
        snprintf(spec, sizeof spec, "%.*s", (int)(len - (size_t)win), s);
        if (len >= sizeof f.name - 8 || tqkv_kv_spec_parse(spec, &f.fmt, &f.vfmt) != TQKV_OK ||
            !tqkv_cuda_kv_formats_ok(f.fmt, f.vfmt) ||
            (win && !(tqkv_format_is_tq(f.fmt) && tqkv_format_is_tq(f.vfmt)))) {
            fprintf(stderr, "tqkv bench attention: unknown format '%s' (bf16, or K/V formats the "
                    "device holds: tq4, tq3, tq2, fp8, tq4/tq3, tq4/tq2, tq3/tq2; a trailing w: "
                    "the q8 window of tq formats)\n", s);
            return -1;
        }
        f.window = win ? window : 0;
        snprintf(f.name, sizeof f.name, "%s%s", spec, win ? "+q8win" : "");
        fmts[nf++] = f;
    }
    return nf;
}

/* One run's fixed parts. */
typedef struct {
    int qh, kvh, dim, reps, json, wide_tc;
    double copy_gbps;
    const char *gpu;
    void *flush;
    size_t flush_bytes;
    double *t; /* [reps] */
} bc_run;

/* K + V bytes a decode over B rows of N tokens reads (docs/FORMATS.md): bf16 2 d per token
 * and kv head and plane, the formats their vector bytes (tq4 d / 2 + 2, tq3 3 d / 8 + 2, tq2
 * d / 4 + 2, fp8 d + 2), a q8 window token d + d / 16. */
static double bc_bytes(const bc_format *f, int B, int N, int kvh, int dim) {
    const int w = f->window < N ? f->window : N;
    const double per_tok = f->bf16 ? 2.0 * 2 * dim
                                   : (double)(tqkv_format_bytes(f->fmt, dim) + tqkv_format_bytes(f->vfmt, dim));
    if (!f->window) return (double)B * kvh * (double)N * per_tok;
    return (double)B * kvh * ((double)(N - w) * per_tok + (double)w * 2.0 * (dim + dim / 16));
}

/* The median decode time of a filled cache, the L2 flushed before each call. */
static tqkv_status bc_time(const bc_run *R, cuda_kv *kv, const float *q, float *out, double *ms) {
    const float scale = 1.0f / sqrtf((float)R->dim);
    tqkv_status st = TQKV_OK;
    for (int rep = -3; !st && rep < R->reps; rep++) {
        void *tm = NULL;
        st = tqkv_cuda_fill_normal(R->flush, R->flush_bytes / 4, (uint64_t)rep, 1.0f);
        if (!st) st = tqkv_cuda_timer_start(&tm);
        if (!st) st = tqkv_cuda_kv_attend(kv, q, R->qh, scale, out);
        double t = 0;
        if (!st) st = tqkv_cuda_timer_stop(tm, &t);
        if (rep >= 0) R->t[rep] = t;
    }
    if (st) return st;
    qsort(R->t, (size_t)R->reps, sizeof(double), bc_cmp);
    *ms = R->t[R->reps / 2];
    return TQKV_OK;
}

/* One point: a cache of format f with B rows of N tokens, timed; its JSON object added to
 * arr (and a table line). 0, or 1 when the timing failed (a fill that fails skips it). */
static int bc_point(const bc_run *R, const bc_format *f, int B, int N, double anchor_ms,
                    cJSON *arr) {
    const int kvh = R->kvh, dim = R->dim;
    tqkv_cache_config cfg = tqkv_cache_config_default();
    cfg.kv_heads = kvh;
    cfg.head_dim = dim;
    cfg.k_format = f->fmt;
    cfg.v_format = f->vfmt;
    cfg.seed = 12345;
    cfg.window = f->window;
    cfg.window_slack = f->window ? 32 : 0;
    cuda_kv *kv = NULL;
    float *kbuf = NULL, *vbuf = NULL, *q = NULL, *out = NULL;
    const int chunk = N < 1024 ? N : 1024;
    const size_t cn = (size_t)B * kvh * chunk * dim, qn = (size_t)B * R->qh * dim;
    tqkv_status st = tqkv_cuda_kv_init(&kv, &cfg, f->bf16, B, N);
    if (!st) st = tqkv_cuda_malloc((void **)&kbuf, cn * 4);
    if (!st) st = tqkv_cuda_malloc((void **)&vbuf, cn * 4);
    if (!st) st = tqkv_cuda_malloc((void **)&q, qn * 4);
    if (!st) st = tqkv_cuda_malloc((void **)&out, qn * 4);
    if (!st) st = tqkv_cuda_fill_normal(q, qn, 99, 1.0f);
    for (int tt = 0, k = 0; !st && tt < N; tt += chunk, k++) {
        const int n = N - tt < chunk ? N - tt : chunk;
        st = tqkv_cuda_fill_normal(kbuf, (size_t)B * kvh * n * dim, 1000 + 2 * k, 1.0f);
        if (!st) st = tqkv_cuda_fill_normal(vbuf, (size_t)B * kvh * n * dim, 1001 + 2 * k, 1.0f);
        if (!st) st = tqkv_cuda_kv_append(kv, kbuf, vbuf, n);
    }
    int rc = 0;
    double ms = 0;
    if (st) {
        fprintf(stderr, "[bench cuda] %s batch %d ctx %d skipped: %s\n", f->name, B, N,
                tqkv_last_error());
    } else if (bc_time(R, kv, q, out, &ms) != TQKV_OK) {
        fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
        rc = 1;
    } else {
        const double bytes = bc_bytes(f, B, N, kvh, dim), gbps = bytes / (ms * 1e-3) / 1e9;
        const double speedup = anchor_ms / ms;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "format", f->name);
        cJSON_AddNumberToObject(o, "batch", B);
        cJSON_AddNumberToObject(o, "ctx", N);
        cJSON_AddNumberToObject(o, "ms", ms);
        if (isnan(anchor_ms)) {
            cJSON_AddNullToObject(o, "anchor_ms");
            cJSON_AddNullToObject(o, "speedup");
        } else {
            cJSON_AddNumberToObject(o, "anchor_ms", anchor_ms);
            cJSON_AddNumberToObject(o, "speedup", speedup);
        }
        cJSON_AddNumberToObject(o, "gbps", gbps);
        cJSON_AddNumberToObject(o, "copy_gbps", R->copy_gbps);
        cJSON_AddNumberToObject(o, "bytes", bytes);
        cJSON_AddNumberToObject(o, "window", f->window);
        cJSON_AddNumberToObject(o, "q_heads", R->qh);
        cJSON_AddNumberToObject(o, "kv_heads", kvh);
        cJSON_AddNumberToObject(o, "head_dim", dim);
        /* the tensor-core split kernel's formats (d = 128 also tq2, the mixed tq K/V and fp8/fp8
         * unless TQKV_FP8_TC=0) */
        const char *fp8_env = getenv("TQKV_FP8_TC");
        const int fp8_tc = !(fp8_env && *fp8_env && atoi(fp8_env) == 0);
        const int tuned = (f->fmt == f->vfmt && (f->fmt == TQKV_TQ4 || f->fmt == TQKV_TQ3)) ||
                          (dim == 128 && f->fmt != TQKV_FP8 && f->vfmt != TQKV_FP8) ||
                          (dim == 128 && f->fmt == TQKV_FP8 && f->vfmt == TQKV_FP8 && fp8_tc);
        cJSON_AddStringToObject(o, "kernel", f->bf16 ? (dim == 256 ? "f32" : "tc")
                                             : !tuned ? "f32" : R->wide_tc ? "tc" : "f32");
        cJSON_AddNumberToObject(o, "reps", R->reps);
        cJSON_AddStringToObject(o, "gpu", R->gpu);
        cJSON_AddItemToArray(arr, o);
        if (!R->json)
            printf("%-10s %5d %7d %9.4f %9.4f %8.2f %8.0f %9.0f\n", f->name, B, N, ms, anchor_ms,
                   speedup, gbps, R->copy_gbps);
        fflush(stdout);
    }
    tqkv_cuda_free(kbuf);
    tqkv_cuda_free(vbuf);
    tqkv_cuda_free(q);
    tqkv_cuda_free(out);
    tqkv_cuda_kv_free(kv);
    return rc;
}

/* The device's name and copy bandwidth (printed), the head_dim 256 kernel; 0 or 1. */
static int bc_device(bc_run *R, char *gpu, size_t cap) {
    int sms = 0, memclk = 0, bus = 0, smclk = 0;
    tqkv_cuda_device_info(gpu, cap, &sms, &memclk, &bus, &smclk);
    double copy_ms = 0;
    const size_t copy_bytes = (size_t)2 << 30;
    if (tqkv_cuda_copy_ms(copy_bytes, 20, &copy_ms) != TQKV_OK) {
        fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
        return 1;
    }
    R->copy_gbps = 2.0 * (double)copy_bytes / (copy_ms * 1e-3) / 1e9;
    fprintf(stderr, "[bench cuda] %s, %d SMs, sm clock %d MHz, mem clock %d MHz, bus %d bit; "
            "d2d copy %.0f GB/s (read + write)\n", gpu, sms, smclk / 1000, memclk / 1000, bus,
            R->copy_gbps);
    /* the tq kernel at this head dim: d = 128 always the tensor-core one */
    R->wide_tc = R->dim == 256 ? tqkv_cuda_wide_tc() : 1;
    if (R->wide_tc < 0) {
        fprintf(stderr, "tqkv bench attention: %s\n", tqkv_last_error());
        return 1;
    }
    if (R->dim == 256)
        fprintf(stderr, "[bench cuda] head_dim 256: tq on the %s kernel, bf16 on the float32 one\n",
                R->wide_tc ? "tensor-core" : "float32 (TQKV_WIDE_TC=0)");
    return 0;
}

/* The JSON array to stdout (--json) and to out_path; 0 or 1. */
static int bc_write(const cJSON *arr, int json, const char *out_path) {
    int rc = 0;
    char *s = cJSON_Print(arr);
    if (json && s) printf("%s\n", s);
    if (out_path && s) {
        FILE *fo = fopen(out_path, "w");
        if (fo) {
            fprintf(fo, "%s\n", s);
            fclose(fo);
        } else {
            fprintf(stderr, "tqkv bench attention: cannot write %s\n", out_path);
            rc = 1;
        }
    }
    free(s);
    return rc;
}

int cmd_bench_attention_cuda(int argc, char **argv) {
    const char *device = "cuda", *batches_s = "1,8,32", *ctxs_s = "4096,16384,65536,131072";
    const char *formats_s = "bf16,tq4,tq3,tq4w", *anchor_path = NULL, *out_path = NULL;
    int window = 128, qh = 32, kvh = 8, reps = 30, json = 0, dim = 128;
    const arg_spec specs[] = {
        {"--device", ARG_STR, &device, "cuda"},
        {"--batches", ARG_STR, &batches_s, "comma list of rows (default 1,8,32)"},
        {"--ctxs", ARG_STR, &ctxs_s, "comma list of tokens per row (default 4096,16384,65536,131072)"},
        {"--formats", ARG_STR, &formats_s, "bf16,tq4,tq3,tq4w (also fp8, tq2, tq4/tq2, tq4/tq3, "
         "tq3/tq2; a trailing w: + the q8 window)"},
        {"--window", ARG_INT, &window, "q8 window of tq4w (default 128)"},
        {"--q-heads", ARG_INT, &qh, "query heads (default 32)"},
        {"--kv-heads", ARG_INT, &kvh, "kv heads (default 8)"},
        {"--dim", ARG_INT, &dim, "head_dim 128 or 256 (default 128)"},
        {"--reps", ARG_INT, &reps, "timed repetitions (default 30)"},
        {"--anchor", ARG_STR, &anchor_path, "anchor JSON [{batch, ctx, ms}] (scripts/cuda_anchor.py)"},
        {"--out", ARG_STR, &out_path, "write the JSON array here too"},
        {"--json", ARG_FLAG, &json, "JSON output"},
    };
    if (args_parse("bench attention --device cuda", argc, argv, specs,
                   (int)(sizeof specs / sizeof specs[0])) != 0)
        return 2;
    if (strcmp(device, "cuda") || reps < 1 || window < 1 || qh < 1 || kvh < 1 || qh % kvh ||
        (dim != 128 && dim != 256)) {
        fprintf(stderr, "tqkv bench attention: bad arguments\n");
        return 2;
    }
    if (!tqkv_cuda_available()) {
        fprintf(stderr, "tqkv bench attention: no CUDA device\n");
        return 1;
    }
    int batches[8], ctxs[8];
    const int nb = bc_ints(batches_s, batches, 8), nc = bc_ints(ctxs_s, ctxs, 8);
    bc_format fmts[BC_MAX_FORMATS];
    const int nf = bc_formats(formats_s, window, fmts);
    if (nf < 0) return 2;
    cJSON *anchor = anchor_path ? bc_read_json(anchor_path) : NULL;
    if (anchor_path && !anchor) fprintf(stderr, "[bench cuda] warning: cannot read anchor %s\n", anchor_path);

    char gpu[128] = "";
    bc_run R = {.qh = qh, .kvh = kvh, .dim = dim, .reps = reps, .json = json, .gpu = gpu,
                .flush_bytes = (size_t)256 << 20};
    if (bc_device(&R, gpu, sizeof gpu)) {
        cJSON_Delete(anchor);
        return 1;
    }
    if (tqkv_cuda_malloc(&R.flush, R.flush_bytes) != TQKV_OK) {
        cJSON_Delete(anchor);
        return 1;
    }
    cJSON *arr = cJSON_CreateArray();
    R.t = malloc(sizeof(double) * (size_t)reps);
    int rc = R.t ? 0 : 1;
    if (!json)
        printf("%-10s %5s %7s %9s %9s %8s %8s %9s\n", "format", "batch", "ctx", "ms", "anchor_ms",
               "speedup", "gbps", "copy_gbps");
    for (int bi = 0; bi < nb && !rc; bi++)
        for (int ci = 0; ci < nc && !rc; ci++) {
            const int B = batches[bi], N = ctxs[ci];
            const double anchor_ms = anchor ? bc_anchor(anchor, B, N) : NAN;
            for (int fi = 0; fi < nf && !rc; fi++) rc = bc_point(&R, &fmts[fi], B, N, anchor_ms, arr);
        }
    if (bc_write(arr, json, out_path)) rc = 1;
    cJSON_Delete(arr);
    cJSON_Delete(anchor);
    free(R.t);
    tqkv_cuda_free(R.flush);
    return rc;
}
#endif

/*
 * cmd_bench_gemm.c - `tqkv bench gemm`: the GPU forward's batch-invariant GEMM
 * (tqkv_cuda_gemm, src/model/ops/gemm_cuda.h) on given shapes and token counts, beside a
 * device-to-device copy measured in the same run.
 *
 *   tqkv bench gemm [--shapes 6144x4096,4096x4096,28672x4096,4096x14336] [--tokens 1,8,32,512]
 *        [--parts 1|2] [--reps 20] [--json]
 *
 * Shapes are N x K (the default: Llama-3.1-8B's qkv, o, gate|up and down matrices), weights
 * random bf16, activations random f32. Before each repetition a 256 MiB write evicts L2
 * (a decode step never finds its weights there); each is timed with CUDA events around
 * one tqkv_cuda_gemm call (activation kernel + MMA kernel), and, alternating with it in
 * the same loop, one cuBLAS bf16 call (the --fast-gemm path: its activation kernel +
 * cublasGemmEx); ms and cublas_ms are the medians, ratio = ms / cublas_ms.
 * --parts 1: bf16 activations (the default, cuBLAS's arithmetic class); 2: hi + lo.
 * weight_gbps = N K 2 bytes / ms (what a decode step must stream); tflops = 2 T N K / ms
 * (useful work, not counting the second MMA of --parts 2);
 * copy_gbps = 2 x bytes / ms of a 2 GiB device-to-device cudaMemcpy (read + write).
 * Owns: the benchmark driver and its output. Must not: contain GEMM logic.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "tqkv.h"

#ifndef TQKV_HAVE_CUDA
int cmd_bench_gemm(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "tqkv bench gemm: this build has no CUDA backend (configure with nvcc)\n");
    return 2;
}
#else
#include "cache/cache_cuda.h"
#include "model/ops/gemm_cublas.h"
#include "model/ops/gemm_cuda.h"

static const char *CMD = "bench gemm";

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int cmd_bench_gemm(int argc, char **argv) {
    const char *shapes_s = "6144x4096,4096x4096,28672x4096,4096x14336", *tokens_s = "1,8,32,512";
    int reps = 20, json = 0, parts = 1;
    const arg_spec specs[] = {
        {"--shapes", ARG_STR, &shapes_s, "comma-separated NxK weight shapes (default: Llama-3.1-8B's)"},
        {"--tokens", ARG_STR, &tokens_s, "comma-separated token counts T (default 1,8,32,512)"},
        {"--parts", ARG_INT, &parts, "activation parts: 1 bf16 (default), 2 hi + lo"},
        {"--reps", ARG_INT, &reps, "timed repetitions, median kept (default 20)"},
        {"--json", ARG_FLAG, &json, "print a JSON array on stdout"},
    };
    if (args_parse(CMD, argc, argv, specs, (int)(sizeof specs / sizeof specs[0]))) return 2;
    int ns = 0, nt = 0, N[16], K[16], T[16];
    char buf[512];
    snprintf(buf, sizeof buf, "%s", shapes_s);
    for (char *s = strtok(buf, ","); s; s = strtok(NULL, ",")) {
        if (ns == 16 || sscanf(s, "%dx%d", &N[ns], &K[ns]) != 2 || N[ns] < 1 || K[ns] < 8 || K[ns] % 8) {
            fprintf(stderr, "tqkv bench gemm: bad shape '%s' (NxK, K a multiple of 8, at most 16)\n", s);
            return 2;
        }
        ns++;
    }
    snprintf(buf, sizeof buf, "%s", tokens_s);
    for (char *s = strtok(buf, ","); s; s = strtok(NULL, ",")) {
        if (nt == 16 || (T[nt] = atoi(s)) < 1 || T[nt] > 65536) {
            fprintf(stderr, "tqkv bench gemm: bad token count '%s' (1..65536, at most 16)\n", s);
            return 2;
        }
        nt++;
    }
    if (ns < 1 || nt < 1 || reps < 1 || (parts != 1 && parts != 2)) {
        fprintf(stderr, "tqkv bench gemm: need shapes, tokens, --reps >= 1 and --parts 1 or 2\n");
        return 2;
    }
    if (!tqkv_cuda_available()) {
        fprintf(stderr, "tqkv bench gemm: no CUDA device\n");
        return 1;
    }
    size_t nmax = 0, kmax = 0, tmax = 0;
    for (int i = 0; i < ns; i++) {
        nmax = (size_t)N[i] > nmax ? (size_t)N[i] : nmax;
        kmax = (size_t)K[i] > kmax ? (size_t)K[i] : kmax;
    }
    for (int i = 0; i < nt; i++) tmax = (size_t)T[i] > tmax ? (size_t)T[i] : tmax;
    float *x = NULL, *y = NULL, *wf = NULL, *flush = NULL;
    gemm_cublas *cb = NULL;
    const size_t flush_n = (size_t)64 << 20; /* floats: 256 MiB */
    void *xf = NULL;
    double copy_ms = 0, *ms = malloc(sizeof(double) * (size_t)reps), *cms = malloc(sizeof(double) * (size_t)reps);
    /* weights: random floats reinterpreted as bf16 pairs (finite: N(0, 1) halves) */
    tqkv_status st = ms && cms ? TQKV_OK : TQKV_ENOMEM;
    if (!st) st = tqkv_cuda_malloc((void **)&flush, flush_n * 4);
    if (!st) st = tqkv_cuda_malloc((void **)&wf, nmax * kmax * 2 + 16);
    if (!st) st = tqkv_cuda_malloc((void **)&x, tmax * kmax * 4);
    if (!st) st = tqkv_cuda_malloc((void **)&y, tmax * nmax * 4);
    if (!st) st = tqkv_cuda_malloc(&xf, tqkv_cuda_gemm_xf_bytes(tmax, kmax));
    if (!st) st = gemm_cublas_init(&cb, NULL);
    if (!st) st = tqkv_cuda_fill_normal(wf, nmax * kmax / 2, 1, 0.02f);
    if (!st) st = tqkv_cuda_fill_normal(x, tmax * kmax, 2, 1.0f);
    if (!st) st = tqkv_cuda_copy_ms((size_t)1 << 31, 10, &copy_ms);
    const double copy_gbps = st ? 0 : 2.0 * (double)(1ull << 31) / (copy_ms * 1e6);
    cJSON *arr = cJSON_CreateArray();
    FILE *tab = json ? stderr : stdout;
    if (!st) fprintf(tab, "copy (device to device): %.0f GB/s, activation parts %d\n%-14s %7s %5s %10s %10s %7s %12s %10s\n",
                     copy_gbps, parts, "N x K", "T", "tile", "ms", "cublas_ms", "ratio", "weight GB/s", "TFLOP/s");
    for (int i = 0; i < ns && !st; i++)
        for (int j = 0; j < nt && !st; j++) {
            const uint16_t *w = (const uint16_t *)wf;
            for (int r = -2; r < reps && !st; r++) /* two warm-up rounds */
                for (int which = 0; which < 2 && !st; which++) {
                    void *tm = NULL;
                    double t = 0;
                    st = tqkv_cuda_fill_normal(flush, flush_n, (uint64_t)r + 7, 1.0f);
                    if (!st) st = tqkv_cuda_timer_start(&tm);
                    if (!st && which == 0)
                        st = tqkv_cuda_gemm(x, (size_t)K[i], T[j], w, N[i], K[i], NULL, y, (size_t)N[i], xf, parts, NULL);
                    else if (!st)
                        st = gemm_cublas_run(cb, x, (size_t)K[i], T[j], w, N[i], K[i], NULL, y, (size_t)N[i], xf);
                    if (tm) {
                        tqkv_status s2 = tqkv_cuda_timer_stop(tm, &t);
                        st = st ? st : s2;
                    }
                    if (r >= 0) (which ? cms : ms)[r] = t;
                }
            if (st) break;
            qsort(ms, (size_t)reps, sizeof(double), cmp_d);
            qsort(cms, (size_t)reps, sizeof(double), cmp_d);
            const double m = ms[reps / 2], cm = cms[reps / 2], wb = (double)N[i] * K[i] * 2;
            const double gbps = wb / (m * 1e6), tfl = 2.0 * T[j] * (double)N[i] * K[i] / (m * 1e9);
            char shape[32];
            snprintf(shape, sizeof shape, "%dx%d", N[i], K[i]);
            const char *tile = tqkv_cuda_gemm_tile(T[j], N[i], parts);
            fprintf(tab, "%-14s %7d %5s %10.4f %10.4f %7.2f %12.0f %10.1f\n", shape, T[j], tile, m, cm,
                    m / cm, gbps, tfl);
            cJSON *o = cJSON_CreateObject();
            cJSON_AddItemToArray(arr, o);
            cJSON_AddNumberToObject(o, "n", N[i]);
            cJSON_AddNumberToObject(o, "k", K[i]);
            cJSON_AddNumberToObject(o, "tokens", T[j]);
            cJSON_AddNumberToObject(o, "parts", parts);
            cJSON_AddStringToObject(o, "tile", tile);
            json_add_num(o, "ms", m, 4);
            json_add_num(o, "cublas_ms", cm, 4);
            json_add_num(o, "ratio", m / cm, 3);
            json_add_num(o, "weight_gbps", gbps, 1);
            json_add_num(o, "tflops", tfl, 2);
            json_add_num(o, "copy_gbps", copy_gbps, 1);
        }
    int rc = 0;
    if (st) {
        fprintf(stderr, "tqkv bench gemm: %s\n", tqkv_last_error());
        rc = 1;
        cJSON_Delete(arr);
    } else if (json) rc = json_print(stdout, arr, 0, "bench gemm") ? 1 : 0;
    else cJSON_Delete(arr);
    tqkv_cuda_free(wf); tqkv_cuda_free(x); tqkv_cuda_free(y); tqkv_cuda_free(xf);
    tqkv_cuda_free(flush);
    gemm_cublas_free(cb);
    free(ms);
    free(cms);
    return rc;
}
#endif

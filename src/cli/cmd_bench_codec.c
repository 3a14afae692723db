/*
 * cmd_bench_codec.c - `tqkv bench codec [--dim 128] [--n 100000] [--json]`: per format,
 * bits per value, MSE and inner-product error on random unit vectors, and single-thread
 * encode / decode throughput (median of --reps repetitions).
 * Owns: the benchmark driver and its output. Must not: contain codec logic (public API only).
 *
 *   mse        = mean over vectors of ||x - x_hat||^2   (x uniform on the unit sphere)
 *   ip_rel_err = RMS_i(<q_i, x_hat_i> - <q_i, x_i>) / RMS_i(<q_i, x_i>),
 *                q_i uniform unit vectors independent of x_i
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

typedef struct { uint64_t s; } bench_rng;

static uint64_t bench_u64(bench_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double bench_normal(bench_rng *r) {
    double u1 = ((double)(bench_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(bench_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* x: [n, dim] unit vectors with uniformly random directions. */
static void bench_unit_vectors(bench_rng *r, float *x, size_t n, int dim) {
    double v[512];
    for (size_t i = 0; i < n; i++) {
        double s = 0;
        for (int j = 0; j < dim; j++) {
            v[j] = bench_normal(r);
            s += v[j] * v[j];
        }
        s = 1.0 / sqrt(s);
        for (int j = 0; j < dim; j++) x[i * (size_t)dim + (size_t)j] = (float)(v[j] * s);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Periodic progress line on stderr once the run has taken more than ~1.5 s. */
typedef struct {
    double start, last;
} bench_status;

static void status_tick(bench_status *st, const char *fmt_name, const char *phase, int rep,
                        int reps) {
    double t = tqkv_now_s();
    if (t - st->start > 1.5 && t - st->last > 1.0) {
        fprintf(stderr, "[bench codec] %s: %s rep %d/%d (%.1f s elapsed)\n", fmt_name, phase,
                rep + 1, reps, t - st->start);
        st->last = t;
    }
}

typedef struct {
    tqkv_format f;
    double bits, mse, ip_rel_err, encode_vps, decode_vps;
    size_t bytes;
} bench_row;

#define BENCH_CHUNK 4096

// ---------------------------------------------------------------------------
// One format
// ---------------------------------------------------------------------------

static int bench_format(tqkv_format f, int dim, size_t n, int reps, uint64_t seed,
                        const float *x, const float *q, bench_status *st, bench_row *row) {
    tqkv_codec *c = NULL;
    if (tqkv_codec_init(&c, f, dim, seed) != TQKV_OK) {
        fprintf(stderr, "tqkv bench codec: %s\n", tqkv_last_error());
        return 1;
    }
    const size_t B = tqkv_codec_bytes(c), d = (size_t)dim;
    uint8_t *e = malloc(n * B);               // [n, bytes]
    float *y = malloc(n * d * sizeof(float)); // [n, dim]
    double *te = malloc((size_t)reps * sizeof(double));
    double *td = malloc((size_t)reps * sizeof(double));
    int rc = 1;
    if (!e || !y || !te || !td) {
        fprintf(stderr, "tqkv bench codec: out of memory (n = %zu)\n", n);
        goto done;
    }
    const char *name = tqkv_format_name(f);
    for (int r = 0; r < reps; r++) {
        double t0 = tqkv_now_s();
        for (size_t i = 0; i < n; i += BENCH_CHUNK) {
            size_t m = n - i < BENCH_CHUNK ? n - i : BENCH_CHUNK;
            if (tqkv_codec_encode(c, x + i * d, m, e + i * B) != TQKV_OK) goto fail;
            status_tick(st, name, "encode", r, reps);
        }
        te[r] = tqkv_now_s() - t0;
        t0 = tqkv_now_s();
        for (size_t i = 0; i < n; i += BENCH_CHUNK) {
            size_t m = n - i < BENCH_CHUNK ? n - i : BENCH_CHUNK;
            if (tqkv_codec_decode(c, e + i * B, m, y + i * d) != TQKV_OK) goto fail;
            status_tick(st, name, "decode", r, reps);
        }
        td[r] = tqkv_now_s() - t0;
    }
    qsort(te, (size_t)reps, sizeof(double), cmp_double);
    qsort(td, (size_t)reps, sizeof(double), cmp_double);

    double se = 0, sip = 0, sref = 0;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * d, *yi = y + i * d, *qi = q + i * d;
        double err = 0, ipx = 0, ipy = 0;
        for (size_t j = 0; j < d; j++) {
            double t = (double)xi[j] - (double)yi[j];
            err += t * t;
            ipx += (double)qi[j] * xi[j];
            ipy += (double)qi[j] * yi[j];
        }
        se += err;
        sip += (ipy - ipx) * (ipy - ipx);
        sref += ipx * ipx;
    }
    row->f = f;
    row->bytes = B;
    row->bits = tqkv_format_bits_per_value(f, dim);
    row->mse = se / (double)n;
    row->ip_rel_err = sref > 0 ? sqrt(sip / sref) : 0.0;
    row->encode_vps = (double)n / te[reps / 2];
    row->decode_vps = (double)n / td[reps / 2];
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "tqkv bench codec: %s\n", tqkv_last_error());
done:
    free(e);
    free(y);
    free(te);
    free(td);
    tqkv_codec_free(c);
    return rc;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_bench_codec(int argc, char **argv) {
    int dim = 128, n = 100000, json = 0, reps = 5, seed = 1;
    const arg_spec specs[] = {
        {"--dim", ARG_INT, &dim, "head_dim: power of two in [32, 512] (default 128)"},
        {"--n", ARG_INT, &n, "random unit vectors per format (default 100000)"},
        {"--reps", ARG_INT, &reps, "timing repetitions, median reported (default 5)"},
        {"--seed", ARG_INT, &seed, "seed of the data and the rotation (default 1)"},
        {"--json", ARG_FLAG, &json, "print a JSON array, one object per format"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse("bench codec", argc, argv, specs, n_specs) != 0) return 2;
    if (tqkv_check_dim(dim) != TQKV_OK) {
        fprintf(stderr, "tqkv bench codec: %s\n", tqkv_last_error());
        return 2;
    }
    if (n < 1 || n > 20000000) {
        fprintf(stderr, "tqkv bench codec: --n must be in [1, 20000000], got %d\n", n);
        return 2;
    }
    if (reps < 1 || reps > 1000) {
        fprintf(stderr, "tqkv bench codec: --reps must be in [1, 1000], got %d\n", reps);
        return 2;
    }

    const size_t N = (size_t)n, d = (size_t)dim;
    float *x = malloc(N * d * sizeof(float)); // [n, dim]
    float *q = malloc(N * d * sizeof(float)); // [n, dim]
    if (!x || !q) {
        fprintf(stderr, "tqkv bench codec: out of memory for %d vectors of dim %d\n", n, dim);
        free(x);
        free(q);
        return 1;
    }
    bench_status st = {tqkv_now_s(), tqkv_now_s()};
    bench_rng r = {(uint64_t)(uint32_t)seed * 0x9E3779B97F4A7C15ull + 1};
    bench_unit_vectors(&r, x, N, dim);
    bench_unit_vectors(&r, q, N, dim);

    bench_row rows[TQKV_FORMAT_COUNT];
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
        if (bench_format((tqkv_format)f, dim, N, reps, (uint64_t)(uint32_t)seed, x, q, &st,
                         &rows[f]) != 0) {
            free(x);
            free(q);
            return 1;
        }
    }
    free(x);
    free(q);

    // ---- output ----
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        if (!arr) return 1;
        for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
            const bench_row *b = &rows[f];
            cJSON *o = cJSON_CreateObject();
            if (!o) { cJSON_Delete(arr); return 1; }
            cJSON_AddStringToObject(o, "format", tqkv_format_name(b->f));
            cJSON_AddNumberToObject(o, "dim", dim);
            cJSON_AddNumberToObject(o, "n", n);
            cJSON_AddNumberToObject(o, "bytes_per_vector", (double)b->bytes);
            cJSON_AddNumberToObject(o, "bits_per_value", b->bits);
            cJSON_AddNumberToObject(o, "mse", b->mse);
            cJSON_AddNumberToObject(o, "ip_rel_err", b->ip_rel_err);
            cJSON_AddNumberToObject(o, "encode_vps", b->encode_vps);
            cJSON_AddNumberToObject(o, "decode_vps", b->decode_vps);
            cJSON_AddItemToArray(arr, o);
        }
        char *s = cJSON_Print(arr);
        cJSON_Delete(arr);
        if (!s) return 1;
        printf("%s\n", s);
        free(s);
        return 0;
    }
    printf("dim %d, %d random unit vectors, median of %d reps, 1 thread\n", dim, n, reps);
    printf("%-7s %6s %9s %12s %11s %13s %13s\n", "format", "bytes", "bits/val", "mse",
           "ip_rel_err", "encode_vps", "decode_vps");
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
        const bench_row *b = &rows[f];
        printf("%-7s %6zu %9.4f %12.4e %11.4e %13.0f %13.0f\n", tqkv_format_name(b->f), b->bytes,
               b->bits, b->mse, b->ip_rel_err, b->encode_vps, b->decode_vps);
    }
    return 0;
}

/*
 * model_cli.c - helpers shared by the model subcommands (see model_cli.h).
 * Owns: argument-level conveniences only. Must not: contain model or cache logic.
 */
#include "model_cli.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util/common.h"

const char *mcli_resolve_model(const char *cmd, const char *arg, char *buf, size_t cap) {
    struct stat st;
    if (stat(arg, &st) == 0 && S_ISDIR(st.st_mode)) {
        snprintf(buf, cap, "%s", arg);
        return buf;
    }
    if (arg[0] != '/') {
        char exe[4096];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = 0;
                snprintf(buf, cap, "%s/../%s", exe, arg);
                if (stat(buf, &st) == 0 && S_ISDIR(st.st_mode)) return buf;
            }
        }
    }
    fprintf(stderr, "tqkv %s: model directory '%s' not found (tried the current directory and "
            "next to the executable)\n", cmd, arg);
    return NULL;
}

int mcli_load(const char *cmd, const char *dir, int blas, int f32_weights, int threads,
              tqkv_model **out) {
    return mcli_load_dev(cmd, dir, blas, f32_weights, threads, 0, out);
}

int mcli_exact = 0;

const char *mcli_matmul_name(int exact) {
    return !exact && tqkv_cpu_has_avx512_bf16() ? "bf16-act" : "exact";
}

int mcli_load_dev(const char *cmd, const char *dir, int blas, int f32_weights, int threads,
                  int device, tqkv_model **out) {
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.bf16_act = !mcli_exact;
    if (device) {
        lp.no_pack = 1;
        lp.no_f32_prefill = 1;
    }
    lp.blas = blas;
    lp.weights_f32 = f32_weights;
    lp.threads = threads;
    lp.verbose = 1;
    tqkv_status rc = tqkv_model_load(out, dir, &lp);
    if (rc != TQKV_OK) {
        fprintf(stderr, "tqkv %s: %s\n", cmd, tqkv_last_error());
        return -1;
    }
    return 0;
}

int mcli_parse_kv(const char *cmd, const char *spec, tqkv_format *k, tqkv_format *v) {
    if (tqkv_kv_spec_parse(spec, k, v) != TQKV_OK) {
        fprintf(stderr, "tqkv %s: --kv '%s': %s\n", cmd, spec, tqkv_last_error());
        return -1;
    }
    return 0;
}

int mcli_parse_kv_layers(const char *cmd, const char *spec, tqkv_model_state_params *p) {
    if (tqkv_kv_layers_parse(spec, p) != TQKV_OK) {
        fprintf(stderr, "tqkv %s: --kv-layers '%s': %s\n", cmd, spec ? spec : "",
                tqkv_last_error());
        return -1;
    }
    return 0;
}

double mcli_kv_bits(const tqkv_model *m, tqkv_model_state *s, int ctx) {
    double bytes = 0, vals = 0;
    const int L = tqkv_model_get_config(m)->n_layers;
    for (int l = 0; l < L; l++) {
        tqkv_layer_info li;
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (!b || tqkv_model_layer_info(m, l, &li) != TQKV_OK || li.kv_from != l) continue;
        const tqkv_cache_config *c = tqkv_batch_get_config(b);
        int tokens = ctx;   /* a sliding layer holds its newest window + slack */
        if (li.window > 0 && li.window + c->window_slack < tokens) tokens = li.window + c->window_slack;
        bytes += (double)tqkv_batch_projected_bytes(b, tokens);
        vals += 2.0 * tokens * c->kv_heads * c->head_dim;
    }
    return vals > 0 ? 8.0 * bytes / vals : 0.0;
}

double mcli_params_bits(const tqkv_model *m, const tqkv_model_state_params *t, int ctx) {
    tqkv_model_state_params cpu = *t;
    cpu.device = 0; /* and none of the device's own options */
    cpu.device_fast_gemm = 0;
    cpu.device_graphs = 0;
    cpu.rows = 1;
    tqkv_model_state *s = NULL;
    if (tqkv_model_state_init(&s, m, &cpu) != TQKV_OK) return -1;
    const double bits = mcli_kv_bits(m, s, ctx);
    tqkv_model_state_free(s);
    return bits;
}

int mcli_parse_kernel(const char *cmd, const char *name, tqkv_kernel *out) {
    if (!strcmp(name, "graph")) { /* the graph's kernel set (src/model/kernel_set.c) */
        *out = TQKV_KERNEL_BY_GRAPH;
        return 0;
    }
    if (tqkv_kernel_parse(name, out) != TQKV_OK) {
        fprintf(stderr, "tqkv %s: %s\n", cmd, tqkv_last_error());
        return -1;
    }
    return 0;
}

const char *mcli_default_kv(int own_window) { return own_window ? "tq4" : MCLI_DEFAULT_KV; }

int mcli_check_window_k(const char *cmd, int keys_only, int window) {
    if (keys_only && window <= 0) {
        fprintf(stderr, "tqkv %s: --window-keys-only says which planes the q8 window holds: it "
                "needs --window W > 0\n", cmd);
        return -1;
    }
    return 0;
}

int mcli_check_window(const char *cmd, int window, tqkv_format k, tqkv_format v) {
    if (window > 0 && !tqkv_format_is_tq(k) && !tqkv_format_is_tq(v)) {
        fprintf(stderr, "tqkv %s: --window keeps a q8 copy beside a tq cache; --kv %s%s%s has "
                "no tq plane\n", cmd, tqkv_format_name(k), k == v ? "" : "/",
                k == v ? "" : tqkv_format_name(v));
        return -1;
    }
    return 0;
}

int mcli_parse_device(const char *cmd, const char *name, int *out) {
    if (!strcmp(name, "cpu")) *out = 0;
    else if (!strcmp(name, "cuda")) *out = 1;
    else {
        fprintf(stderr, "tqkv %s: --device must be cpu or cuda, got '%s'\n", cmd, name);
        return -1;
    }
    return 0;
}

int mcli_parse_tp(const char *cmd, int n, int device, tqkv_model_state_params *p) {
    if (n < 0 || n > 8) {
        fprintf(stderr, "tqkv %s: --tensor-parallel must be in 1..8, got %d\n", cmd, n);
        return -1;
    }
    (void)device; /* every command runs sharded device states (docs/TP.md) */
    p->tensor_parallel = n;
    return 0;
}

int mcli_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n >= 1 ? (int)n : 1;
}

int mcli_read_file(const char *cmd, const char *path, char **out, size_t *len) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) {
        fprintf(stderr, "tqkv %s: cannot open %s\n", cmd, path);
        return -1;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        if (n == cap) {
            char *p = realloc(buf, cap * 2 + 1);
            if (!p) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = p;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int err = !buf || ferror(f);
    if (f != stdin) fclose(f);
    if (err) {
        fprintf(stderr, "tqkv %s: cannot read %s\n", cmd, path);
        free(buf);
        return -1;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

double mcli_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

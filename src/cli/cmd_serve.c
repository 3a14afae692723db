/*
 * cmd_serve.c - `tqkv serve`: the OpenAI-compatible HTTP server on the serving engine.
 * Owns: options, engine + server start, signal handling (SIGTERM/SIGINT: stop admission,
 * drain the engine, wait for open responses, exit 0).
 * Must not: contain HTTP, JSON or scheduling logic (src/server and the engine own them).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "kv_policy.h"
#include "kv_preset.h"
#include "model_cli.h"
#include "serve_mem.h"
#include "server/server.h"
#include "tqkv_engine.h"

static const char *CMD = "serve";

// ---------------------------------------------------------------------------
// Sizes and machine defaults
// ---------------------------------------------------------------------------

/* "123", "64M", "2G" -> bytes; 0 or -1. */
static int parse_bytes(const char *s, size_t *out) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (!end || end == s || v < 0) return -1;
    double mul = 1;
    if (*end == 'k' || *end == 'K') mul = 1024.0, end++;
    else if (*end == 'm' || *end == 'M') mul = 1024.0 * 1024, end++;
    else if (*end == 'g' || *end == 'G') mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'i' || *end == 'B') end++;
    if (*end == 'B') end++;
    if (*end) return -1;
    *out = (size_t)(v * mul);
    return 0;
}

/* Physical cores this process may run on: distinct (package, core) pairs of the CPUs in
 * its affinity mask (sysfs topology); the CPU count where that is unreadable; >= 1. */
static int physical_cores(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set)) return 1;
    enum { MAXC = 1024 };
    static long seen[MAXC];
    int n_seen = 0, n_cpu = 0;
    for (int c = 0; c < CPU_SETSIZE && c < MAXC; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        n_cpu++;
        long core = -1, pkg = -1;
        char path[128];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        FILE *f = fopen(path, "r");
        if (f) {
            if (fscanf(f, "%ld", &core) != 1) core = -1;
            fclose(f);
        }
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        if ((f = fopen(path, "r"))) {
            if (fscanf(f, "%ld", &pkg) != 1) pkg = -1;
            fclose(f);
        }
        if (core < 0 || pkg < 0) return n_cpu > 0 ? CPU_COUNT(&set) : 1; /* no topology */
        long key = pkg * 65536 + core;
        int dup = 0;
        for (int i = 0; i < n_seen && !dup; i++) dup = seen[i] == key;
        if (!dup) seen[n_seen++] = key;
    }
    return n_seen > 0 ? n_seen : 1;
}

/* Default prefix cache: 1/16 of physical memory, in [64 MiB, 2 GiB]. */
static size_t default_prefix_cache(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    size_t b = pages > 0 && psz > 0 ? (size_t)pages * (size_t)psz / 16 : (size_t)256 << 20;
    if (b < ((size_t)64 << 20)) b = (size_t)64 << 20;
    if (b > ((size_t)2 << 30)) b = (size_t)2 << 30;
    return b;
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

#define MAX_ALIASES 16

typedef struct {
    const char *model, *host, *kv, *draft;
    const char *budget, *api_key, *port_file, *cache_dir;
    const char *prefix_bytes, *max_body, *device;
    const char *alias_last, *kv_layers, *kv_policy;
    int port, window, parallel, draft_tokens, threads, queue;
    int chunk, step, verbose, max_conns, metrics_auth;
    /* slow-client defence (src/server/conn_guard.c) */
    int idle_timeout, header_timeout, body_timeout, max_conns_ip;
    int reserved_conns;
    int tp;       /* --tensor-parallel (docs/TP.md) */
    int draft_tp; /* --draft-tensor-parallel: the draft's ranks (-1: --tensor-parallel's) */
    const char *aliases[MAX_ALIASES]; /* --alias / --served-model-name, in order */
    int n_aliases;
} serve_opts;

/* Defaults, then the command line; 0 or -1 (message printed). */
static int serve_parse_args(int argc, char **argv, serve_opts *o) {
    *o = (serve_opts){
        .model = MCLI_DEFAULT_MODEL, .host = "127.0.0.1", .device = "cpu",
        .port = 8080, .parallel = 16, .draft_tokens = 4, .queue = 256,
        .chunk = 0, .max_conns = 512,
        .idle_timeout = 600, .header_timeout = 20, .body_timeout = 60,
        .reserved_conns = -1,
    };
    arg_spec specs[] = {
        {"--model", ARG_STR, &o->model, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--host", ARG_STR, &o->host, "address to listen on: IPv4, IPv6 (\"::\" = all, IPv4 too) or a host name (default 127.0.0.1)"},
        {"--port", ARG_INT, &o->port, "TCP port (default 8080; 0 = any free port)"},
        {"--port-file", ARG_STR, &o->port_file, "write the bound port to this file once listening"},
        {"--kv", ARG_STR, &o->kv, "KV format: f16|q8|q4|tq2|tq3|tq4|fp8, K/V, or a preset auto:B (the best measured configuration within B bits per value at the model's context; default " MCLI_DEFAULT_KV "; tq4 with --window, --kv-layers or --draft)"},
        {"--kv-layers", ARG_STR, &o->kv_layers, "per-layer KV formats, e.g. '0,7:q8' or '0-1:q8;7:tq4/q8' (cuda: device pairs only)"},
        {"--kv-policy", ARG_STR, &o->kv_policy, "KV policy file from `tqkv calibrate` (formats, per-layer formats, window; cuda: device pairs only; instead of --kv)"},
        {"--window", ARG_INT, &o->window, "q8 recent window in tokens (default 0 = off)"},
        {"--draft", ARG_STR, &o->draft, "draft model directory for speculative decoding"},
        {"--draft-tokens", ARG_INT, &o->draft_tokens, "tokens drafted per round (default 4)"},
        {"--parallel", ARG_INT, &o->parallel, "most rows decoding at once (default 16)"},
        {"--kv-budget", ARG_STR, &o->budget, "KV bytes for running rows, e.g. 512M (default: engine's)"},
        {"--queue", ARG_INT, &o->queue, "requests waiting for admission before 503 (default 256)"},
        {"--threads", ARG_INT, &o->threads, "compute threads (default: the physical cores)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--tensor-parallel", ARG_INT, &o->tp, MCLI_TP_HELP "; a --draft stays unsharded unless --draft-tensor-parallel"},
        {"--draft-tensor-parallel", ARG_INT, &o->draft_tp, "ranks of the --draft model's states: 0 or 1 = unsharded (default), N = N ranks (its heads and MLP width must split), -1 = --tensor-parallel's"},
        {"--prefill-chunk", ARG_INT, &o->chunk, "a prompt is prefilled in chunks of this many tokens (default 256 on the CPU, 2048 on the device)"},
        {"--prefill-step", ARG_INT, &o->step, "prompt tokens prefilled per scheduler step, whole chunks, before the running rows' decode step (default: 1 chunk on the CPU, about 4096 tokens on the device)"},
        {"--prefix-cache", ARG_STR, &o->prefix_bytes, "prefix cache bytes, e.g. 64M; 0 = off (default 1/16 of RAM, 64M..2G)"},
        {"--prompt-cache-dir", ARG_STR, &o->cache_dir, "persist the prefix cache in this directory"},
        {"--api-key", ARG_STR, &o->api_key, "require Authorization: Bearer KEY (or env TQKV_API_KEY)"},
        {"--metrics-auth", ARG_FLAG, &o->metrics_auth, "/metrics needs the API key too (default: open)"},
        {"--alias", ARG_STR, &o->alias_last, "serve the model under this name (repeatable; the first is reported)"},
        {"--served-model-name", ARG_STR, &o->alias_last, "same as --alias"},
        {"--max-body", ARG_STR, &o->max_body, "request body limit (default 1M)"},
        {"--max-conns", ARG_INT, &o->max_conns, "simultaneous connections (default 512)"},
        {"--device", ARG_STR, &o->device, "cpu|cuda: where the model (and --draft) runs (default cpu; cuda: --prompt-cache-dir needs tq4 or tq3 KV)"},
        {"--verbose", ARG_FLAG, &o->verbose, "progress lines on stderr"},
        {"--timeout", ARG_INT, &o->idle_timeout, "seconds a connection may stay silent while sending a request or reading a reply (default 600, as llama-server; never cuts a generation)"},
        {"--header-timeout", ARG_INT, &o->header_timeout, "seconds for a whole request head, from connecting or from the previous reply on a kept-alive connection (default 20; 0 = none)"},
        {"--body-timeout", ARG_INT, &o->body_timeout, "seconds for a whole request body after its head (default 60; 0 = none)"},
        {"--max-conns-per-ip", ARG_INT, &o->max_conns_ip, "connections per client address (default 0 = no cap: a reverse proxy is one address)"},
        {"--reserved-conns", ARG_INT, &o->reserved_conns, "of --max-conns, slots only requests that have fully arrived may use; a new connection evicts the longest-sending one when the others are full (default max-conns / 8)"},
    };
    return args_parse(CMD, argc, argv, specs, (int)(sizeof specs / sizeof specs[0])) ? -1 : 0;
}

/* Every --alias / --served-model-name value, in order (the parser keeps only the last);
 * 0 or -1 (message printed). */
static int serve_collect_aliases(int argc, char **argv, serve_opts *o) {
    o->n_aliases = 0;
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--alias") || !strcmp(argv[i], "--served-model-name")) {
            if (o->n_aliases == MAX_ALIASES || !argv[i + 1][0]) {
                fprintf(stderr, "tqkv serve: at most %d non-empty --alias names\n", MAX_ALIASES);
                return -1;
            }
            o->aliases[o->n_aliases++] = argv[++i];
        }
    return 0;
}

/* OpenMP teams must not spin: the HTTP threads and other processes share the cores.
 * libgomp reads OMP_WAIT_POLICY at start-up, so re-execute with passive waits (returns
 * only when there is no need or the exec failed). */
static void serve_reexec_passive(int argc, char **argv, int threads) {
    if (threads > 1 && !getenv("OMP_WAIT_POLICY")) {
        char **nargv = calloc((size_t)argc + 3, sizeof *nargv);
        if (nargv) {
            nargv[0] = "tqkv";
            nargv[1] = "serve";
            for (int i = 0; i < argc; i++) nargv[2 + i] = argv[i];
            setenv("OMP_WAIT_POLICY", "passive", 1);
            execv("/proc/self/exe", nargv);
            free(nargv); /* exec failed: run as we are */
        }
    }
}

/* Range checks of the numeric options; 0 or -1 (message printed). */
static int serve_check_opts(serve_opts *o) {
    if (o->kv_policy && (o->kv || o->window || o->kv_layers || o->draft)) {
        fprintf(stderr, "tqkv serve: --kv-policy sets the formats and the window; drop --kv, "
                "--window, --kv-layers and --draft\n");
        return -1;
    }
    if (!o->kv) o->kv = mcli_default_kv(o->window || o->kv_layers || o->draft || o->kv_policy);
    if (o->port < 0 || o->port > 65535 || o->parallel < 1 || o->draft_tokens < 1 ||
        o->threads < 1 || o->queue < 0 || o->chunk < 0 || o->step < 0 || o->window < 0 || o->max_conns < 1) {
        fprintf(stderr, "tqkv serve: --port must be 0..65535; --parallel, --draft-tokens, --threads, "
                        "--max-conns >= 1; --queue, --window, --prefill-chunk, --prefill-step >= 0 (0: the default)\n");
        return -1;
    }
    if (o->idle_timeout < 1 || o->header_timeout < 0 || o->body_timeout < 0 ||
        o->max_conns_ip < 0 || o->reserved_conns >= o->max_conns || o->reserved_conns < -1) {
        fprintf(stderr, "tqkv serve: --timeout >= 1; --header-timeout, --body-timeout, "
                        "--max-conns-per-ip >= 0; --reserved-conns 0..max-conns - 1\n");
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------------------
// Engine and server parameters
// ---------------------------------------------------------------------------

/* --kv auto:B, --kv-layers and --kv-policy, applied by the engine once the model is loaded. */
typedef struct {
    const char *kv, *layers, *dir; /* dir: the model's, for a policy beside it (auto:B) */
    const kv_policy *pol;  /* NULL: none */
    char        desc[KVP_DESC]; /* the resolved preset, for the start-up line */
} serve_kv;

static tqkv_status serve_kv_setup(const tqkv_model *m, tqkv_model_state_params *sp, void *user) {
    serve_kv *k = user;
    if (kvp_is_preset(k->kv) &&
        kvp_resolve_model(CMD, m, k->dir, k->kv, tqkv_model_context_len(m), sp, k->desc,
                          sizeof k->desc))
        return tqkv_fail(TQKV_EINVAL, "--kv %s: no configuration (see above)", k->kv);
    if (k->pol && kvpol_apply(CMD, m, k->pol, tqkv_model_context_len(m), sp, k->desc,
                              sizeof k->desc))
        return tqkv_fail(TQKV_EINVAL, "--kv-policy: not applied (see above)");
    if (k->layers) return tqkv_kv_layers_parse(k->layers, sp);
    return TQKV_OK;
}

static serve_kv g_serve_kv;
static kv_policy g_serve_pol;

/* Engine parameters from the options (model paths resolved into mbuf / dbuf [4096]) and
 * the server's byte limit; 0 or -1 (message printed). */
static int serve_engine_params(const serve_opts *o, char *mbuf, char *dbuf,
                               tqkv_engine_params *ep, srv_params *sp) {
    const char *dir = mcli_resolve_model(CMD, o->model, mbuf, 4096);
    if (!dir) return -1;
    *ep = tqkv_engine_params_default();
    ep->model_dir = dir;
    if (o->draft) {
        if (!(ep->draft_dir = mcli_resolve_model(CMD, o->draft, dbuf, 4096))) return -1;
        ep->draft_tokens = o->draft_tokens;
        ep->draft_tensor_parallel = o->draft_tp; /* checked by tqkv_engine_init */
    } else if (o->draft_tp) {
        fprintf(stderr, "tqkv serve: --draft-tensor-parallel needs --draft\n");
        return -1;
    }
    if (kvp_is_preset(o->kv)) {
        if (o->window || o->draft) {
            fprintf(stderr, "tqkv serve: a preset (--kv %s) chooses the window itself and takes "
                    "no --window or --draft\n", o->kv);
            return -1;
        }
    } else if (mcli_parse_kv(CMD, o->kv, &ep->k_format, &ep->v_format)) {
        return -1;
    }
    if (o->kv_policy && kvpol_load(CMD, o->kv_policy, &g_serve_pol)) return -1;
    if (kvp_is_preset(o->kv) || o->kv_layers || o->kv_policy) {
        g_serve_kv = (serve_kv){.kv = o->kv, .layers = o->kv_layers, .dir = dir,
                                .pol = o->kv_policy ? &g_serve_pol : NULL};
        ep->kv_setup = serve_kv_setup;
        ep->kv_setup_user = &g_serve_kv;
    }
    ep->window = o->window;
    ep->parallel = o->parallel;
    ep->queue_max = o->queue;
    ep->threads = o->threads;
    ep->bf16_act = !mcli_exact;
    ep->prefill_chunk = o->chunk;
    ep->prefill_step = o->step;
    ep->prompt_cache_dir = o->cache_dir;
    ep->verbose = o->verbose;
    if (mcli_parse_device(CMD, o->device, &ep->device)) return -1;
    tqkv_model_state_params tpp = tqkv_model_state_params_default();
    if (mcli_parse_tp(CMD, o->tp, ep->device, &tpp)) return -1;
    ep->tensor_parallel = tpp.tensor_parallel;
    *sp = srv_params_default();
    if ((o->budget && parse_bytes(o->budget, &ep->kv_budget)) ||
        (o->prefix_bytes && parse_bytes(o->prefix_bytes, &ep->prefix_cache_bytes)) ||
        (o->max_body && parse_bytes(o->max_body, &sp->max_body))) {
        fprintf(stderr, "tqkv serve: byte sizes are N, NK, NM or NG\n");
        return -1;
    }
    if (!o->prefix_bytes) ep->prefix_cache_bytes = default_prefix_cache();
    if (o->cache_dir && !ep->prefix_cache_bytes) ep->prefix_cache_bytes = (size_t)64 << 20;
    return 0;
}

/* The server's options (the byte limit is already in sp). */
static void serve_server_params(const serve_opts *o, srv_params *sp) {
    sp->host = o->host;
    sp->port = o->port;
    sp->api_key = o->api_key && o->api_key[0] ? o->api_key : NULL;
    sp->max_conns = o->max_conns;
    sp->verbose = o->verbose;
    sp->idle_timeout_s = o->idle_timeout;
    sp->header_timeout_s = o->header_timeout;
    sp->body_timeout_s = o->body_timeout;
    sp->max_conns_per_ip = o->max_conns_ip;
    sp->reserved_conns = o->reserved_conns;
    sp->aliases = o->n_aliases ? o->aliases : NULL;
    sp->n_aliases = o->n_aliases;
    sp->metrics_auth = o->metrics_auth;
}

// ---------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------

/* Writes the bound port to --port-file; 0 or -1 (message printed). */
static int serve_write_port(const char *port_file, int bound) {
    FILE *f = fopen(port_file, "w");
    if (!f || fprintf(f, "%d\n", bound) < 0 || fclose(f)) {
        fprintf(stderr, "tqkv serve: cannot write --port-file %s\n", port_file);
        return -1;
    }
    return 0;
}

/* Starts engine and server, serves until a signal of `set`, then drains and stops;
 * the exit code. */
static int serve_run(serve_opts *o, const tqkv_engine_params *ep, srv_params *sp,
                     const sigset_t *set) {
    fprintf(stderr, "tqkv serve: loading %s\n", ep->model_dir);
    tqkv_engine *e = NULL;
    if (tqkv_engine_init(&e, ep) != TQKV_OK || tqkv_engine_start(e) != TQKV_OK) {
        fprintf(stderr, "tqkv serve: %s\n", tqkv_last_error());
        tqkv_engine_free(e);
        return 1;
    }
    srv_engine eng = srv_engine_bind(e);
    serve_server_params(o, sp);
    srv_server *srv = NULL;
    if (srv_start(&srv, sp, &eng) != TQKV_OK) {
        fprintf(stderr, "tqkv serve: %s\n", tqkv_last_error());
        tqkv_engine_free(e);
        return 1;
    }
    int bound = srv_port(srv);
    if (o->port_file && serve_write_port(o->port_file, bound)) {
        srv_free(srv);
        tqkv_engine_free(e);
        return 1;
    }
    char tpd[40] = "";
    if (ep->tensor_parallel > 1)
        snprintf(tpd, sizeof tpd, ", tensor parallel %d", ep->tensor_parallel);
    fprintf(stderr, "tqkv serve: model %s, kv %s%s%s%s%s%s, threads %d, prefix cache %zu bytes, "
            "listening on http://%s%s%s:%d\n", o->n_aliases ? o->aliases[0] : eng.model_name,
            o->kv_policy ? o->kv_policy : o->kv, g_serve_kv.desc[0] ? " = " : "", g_serve_kv.desc,
            o->kv_layers ? ", layers " : "", o->kv_layers ? o->kv_layers : "", tpd,
            o->threads, ep->prefix_cache_bytes, strchr(o->host, ':') ? "[" : "", o->host,
            strchr(o->host, ':') ? "]" : "", bound);

    serve_trimmer *trim = serve_trimmer_start(e); /* freed memory back after bursts */
    int sig = 0;
    sigwait(set, &sig);
    fprintf(stderr, "tqkv serve: %s: stopping admission, draining\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    srv_stop_admission(srv);
    int rc = 0;
    if (tqkv_engine_drain(e) != TQKV_OK) {
        fprintf(stderr, "tqkv serve: drain: %s\n", tqkv_last_error());
        rc = 1;
    }
    /* responses still being written (slow readers) get a bounded time */
    int left = srv_wait_idle(srv, 30.0);
    if (left) fprintf(stderr, "tqkv serve: %d responses still open after 30 s; closing them\n", left);
    srv_free(srv);
    serve_trimmer_stop(trim);
    tqkv_engine_free(e);
    fprintf(stderr, "tqkv serve: stopped\n");
    return rc;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_serve(int argc, char **argv) {
    serve_opts o;
    if (serve_parse_args(argc, argv, &o)) return 2;
    serve_mem_policy(); /* before any thread: few arenas, big buffers returned when freed */
    if (serve_collect_aliases(argc, argv, &o)) return 2;
    if (o.threads == 0) o.threads = physical_cores();
    serve_reexec_passive(argc, argv, o.threads);
    if (!o.api_key) o.api_key = getenv("TQKV_API_KEY");
    if (serve_check_opts(&o)) return 2;
    char mbuf[4096], dbuf[4096];
    tqkv_engine_params ep;
    srv_params sp;
    if (serve_engine_params(&o, mbuf, dbuf, &ep, &sp)) return 2;

    /* Block the stop signals in every thread (the engine's and the server's inherit the
     * mask); this thread takes them with sigwait. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    return serve_run(&o, &ep, &sp, &set);
}

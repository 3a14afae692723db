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
#include "model_cli.h"
#include "serve_mem.h"
#include "server/server.h"
#include "tqkv_engine.h"

static const char *CMD = "serve";

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

#define MAX_ALIASES 16

int cmd_serve(int argc, char **argv) {
    const char *model = MCLI_DEFAULT_MODEL, *host = "127.0.0.1", *kv = "tq4", *draft = NULL;
    const char *budget = NULL, *api_key = NULL, *port_file = NULL, *cache_dir = NULL;
    const char *prefix_bytes = NULL, *max_body = NULL, *device = "cpu";
    const char *alias_last = NULL;
    int port = 8080, window = 0, parallel = 16, draft_tokens = 4, threads = 0, queue = 256;
    int chunk = 256, verbose = 0, max_conns = 512, metrics_auth = 0;
    /* slow-client defence (src/server/conn_guard.c) */
    int idle_timeout = 600, header_timeout = 20, body_timeout = 60, max_conns_ip = 0;
    int reserved_conns = -1;
    arg_spec specs[] = {
        {"--model", ARG_STR, &model, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--host", ARG_STR, &host, "address to listen on: IPv4, IPv6 (\"::\" = all, IPv4 too) or a host name (default 127.0.0.1)"},
        {"--port", ARG_INT, &port, "TCP port (default 8080; 0 = any free port)"},
        {"--port-file", ARG_STR, &port_file, "write the bound port to this file once listening"},
        {"--kv", ARG_STR, &kv, "KV format: f16|q8|q4|tq2|tq3|tq4|fp8 or K/V (default tq4)"},
        {"--window", ARG_INT, &window, "q8 recent window in tokens (default 0 = off)"},
        {"--draft", ARG_STR, &draft, "draft model directory for speculative decoding"},
        {"--draft-tokens", ARG_INT, &draft_tokens, "tokens drafted per round (default 4)"},
        {"--parallel", ARG_INT, &parallel, "most rows decoding at once (default 16)"},
        {"--kv-budget", ARG_STR, &budget, "KV bytes for running rows, e.g. 512M (default: engine's)"},
        {"--queue", ARG_INT, &queue, "requests waiting for admission before 503 (default 256)"},
        {"--threads", ARG_INT, &threads, "compute threads (default: the physical cores)"},
        {"--exact", ARG_FLAG, &mcli_exact, MCLI_EXACT_HELP},
        {"--prefill-chunk", ARG_INT, &chunk, "prompt tokens prefilled per step (default 256)"},
        {"--prefix-cache", ARG_STR, &prefix_bytes, "prefix cache bytes, e.g. 64M; 0 = off (default 1/16 of RAM, 64M..2G)"},
        {"--prompt-cache-dir", ARG_STR, &cache_dir, "persist the prefix cache in this directory"},
        {"--api-key", ARG_STR, &api_key, "require Authorization: Bearer KEY (or env TQKV_API_KEY)"},
        {"--metrics-auth", ARG_FLAG, &metrics_auth, "/metrics needs the API key too (default: open)"},
        {"--alias", ARG_STR, &alias_last, "serve the model under this name (repeatable; the first is reported)"},
        {"--served-model-name", ARG_STR, &alias_last, "same as --alias"},
        {"--max-body", ARG_STR, &max_body, "request body limit (default 1M)"},
        {"--max-conns", ARG_INT, &max_conns, "simultaneous connections (default 512)"},
        {"--device", ARG_STR, &device, "cpu|cuda: where the model (and --draft) runs (default cpu; cuda: --prompt-cache-dir needs tq4 or tq3 KV)"},
        {"--verbose", ARG_FLAG, &verbose, "progress lines on stderr"},
        {"--timeout", ARG_INT, &idle_timeout, "seconds a connection may stay silent while sending a request or reading a reply (default 600, as llama-server; never cuts a generation)"},
        {"--header-timeout", ARG_INT, &header_timeout, "seconds for a whole request head, from connecting or from the previous reply on a kept-alive connection (default 20; 0 = none)"},
        {"--body-timeout", ARG_INT, &body_timeout, "seconds for a whole request body after its head (default 60; 0 = none)"},
        {"--max-conns-per-ip", ARG_INT, &max_conns_ip, "connections per client address (default 0 = no cap: a reverse proxy is one address)"},
        {"--reserved-conns", ARG_INT, &reserved_conns, "of --max-conns, slots only requests that have fully arrived may use; a new connection evicts the longest-sending one when the others are full (default max-conns / 8)"},
    };
    if (args_parse(CMD, argc, argv, specs, (int)(sizeof specs / sizeof specs[0]))) return 2;
    serve_mem_policy(); /* before any thread: few arenas, big buffers returned when freed */
    const char *aliases[MAX_ALIASES];
    int n_aliases = 0;
    for (int i = 0; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--alias") || !strcmp(argv[i], "--served-model-name")) {
            if (n_aliases == MAX_ALIASES || !argv[i + 1][0]) {
                fprintf(stderr, "tqkv serve: at most %d non-empty --alias names\n", MAX_ALIASES);
                return 2;
            }
            aliases[n_aliases++] = argv[++i];
        }
    if (threads == 0) threads = physical_cores();
    /* OpenMP teams must not spin: the HTTP threads and other processes share the cores.
     * libgomp reads OMP_WAIT_POLICY at start-up, so re-execute with passive waits. */
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
    if (!api_key) api_key = getenv("TQKV_API_KEY");
    if (port < 0 || port > 65535 || parallel < 1 || draft_tokens < 1 || threads < 1 || queue < 0 ||
        chunk < 1 || window < 0 || max_conns < 1) {
        fprintf(stderr, "tqkv serve: --port must be 0..65535; --parallel, --draft-tokens, --threads, "
                        "--prefill-chunk, --max-conns >= 1; --queue, --window >= 0\n");
        return 2;
    }
    if (idle_timeout < 1 || header_timeout < 0 || body_timeout < 0 || max_conns_ip < 0 ||
        reserved_conns >= max_conns || reserved_conns < -1) {
        fprintf(stderr, "tqkv serve: --timeout >= 1; --header-timeout, --body-timeout, "
                        "--max-conns-per-ip >= 0; --reserved-conns 0..max-conns - 1\n");
        return 2;
    }
    char mbuf[4096], dbuf[4096];
    const char *dir = mcli_resolve_model(CMD, model, mbuf, sizeof mbuf);
    if (!dir) return 2;
    tqkv_engine_params ep = tqkv_engine_params_default();
    ep.model_dir = dir;
    if (draft) {
        if (!(ep.draft_dir = mcli_resolve_model(CMD, draft, dbuf, sizeof dbuf))) return 2;
        ep.draft_tokens = draft_tokens;
    }
    if (mcli_parse_kv(CMD, kv, &ep.k_format, &ep.v_format)) return 2;
    ep.window = window;
    ep.parallel = parallel;
    ep.queue_max = queue;
    ep.threads = threads;
    ep.bf16_act = !mcli_exact;
    ep.prefill_chunk = chunk;
    ep.prompt_cache_dir = cache_dir;
    ep.verbose = verbose;
    if (mcli_parse_device(CMD, device, &ep.device)) return 2;
    srv_params sp = srv_params_default();
    if ((budget && parse_bytes(budget, &ep.kv_budget)) ||
        (prefix_bytes && parse_bytes(prefix_bytes, &ep.prefix_cache_bytes)) ||
        (max_body && parse_bytes(max_body, &sp.max_body))) {
        fprintf(stderr, "tqkv serve: byte sizes are N, NK, NM or NG\n");
        return 2;
    }
    if (!prefix_bytes) ep.prefix_cache_bytes = default_prefix_cache();
    if (cache_dir && !ep.prefix_cache_bytes) ep.prefix_cache_bytes = (size_t)64 << 20;

    /* Block the stop signals in every thread (the engine's and the server's inherit the
     * mask); this thread takes them with sigwait. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    fprintf(stderr, "tqkv serve: loading %s\n", dir);
    tqkv_engine *e = NULL;
    if (tqkv_engine_init(&e, &ep) != TQKV_OK || tqkv_engine_start(e) != TQKV_OK) {
        fprintf(stderr, "tqkv serve: %s\n", tqkv_last_error());
        tqkv_engine_free(e);
        return 1;
    }
    srv_engine eng = srv_engine_bind(e);
    sp.host = host;
    sp.port = port;
    sp.api_key = api_key && api_key[0] ? api_key : NULL;
    sp.max_conns = max_conns;
    sp.verbose = verbose;
    sp.idle_timeout_s = idle_timeout;
    sp.header_timeout_s = header_timeout;
    sp.body_timeout_s = body_timeout;
    sp.max_conns_per_ip = max_conns_ip;
    sp.reserved_conns = reserved_conns;
    sp.aliases = n_aliases ? aliases : NULL;
    sp.n_aliases = n_aliases;
    sp.metrics_auth = metrics_auth;
    srv_server *srv = NULL;
    if (srv_start(&srv, &sp, &eng) != TQKV_OK) {
        fprintf(stderr, "tqkv serve: %s\n", tqkv_last_error());
        tqkv_engine_free(e);
        return 1;
    }
    int bound = srv_port(srv);
    if (port_file) {
        FILE *f = fopen(port_file, "w");
        if (!f || fprintf(f, "%d\n", bound) < 0 || fclose(f)) {
            fprintf(stderr, "tqkv serve: cannot write --port-file %s\n", port_file);
            srv_free(srv);
            tqkv_engine_free(e);
            return 1;
        }
    }
    fprintf(stderr, "tqkv serve: model %s, kv %s, threads %d, prefix cache %zu bytes, "
            "listening on http://%s%s%s:%d\n", n_aliases ? aliases[0] : eng.model_name, kv,
            threads, ep.prefix_cache_bytes, strchr(host, ':') ? "[" : "", host,
            strchr(host, ':') ? "]" : "", bound);

    serve_trimmer *trim = serve_trimmer_start(e); /* freed memory back after bursts */
    int sig = 0;
    sigwait(&set, &sig);
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

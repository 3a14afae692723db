/*
 * fake_serve_main.c - `tqkv serve`'s HTTP layer on the engine test double, as a process
 * for clients written in other languages (tests/serve/openai/tools.mjs): every request
 * generates the text of SCRIPT_FILE (a forced output, e.g. a tool call), with the
 * bundled model's tokenizer. Usage: fake_serve SCRIPT_FILE PORT_FILE [API_KEY]. Writes
 * the bound port to PORT_FILE, serves until SIGTERM / SIGINT, exits 0.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_engine.h"
#include "testutil.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: fake_serve SCRIPT_FILE PORT_FILE [API_KEY]\n");
        return 2;
    }
    static char script[1 << 16];
    FILE *f = fopen(argv[1], "rb");
    if (!f) return 1;
    size_t n = fread(script, 1, sizeof script - 1, f);
    fclose(f);
    script[n] = 0;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    char path[4096];
    tqkv_tokenizer *tok = NULL;
    if (tqkv_tokenizer_load(&tok, source_path("models/qwen3-code-28m", path, sizeof path)) != TQKV_OK) return 1;
    fake_params fp = {64, 0, 4096, 0, script, 0};
    fake_engine *fe = NULL;
    if (fake_engine_init(&fe, &fp, tok)) return 1;
    srv_engine eng = fake_engine_bind(fe);
    srv_params sp = srv_params_default();
    sp.port = 0;
    sp.api_key = argc > 3 ? argv[3] : NULL;
    srv_server *srv = NULL;
    if (srv_start(&srv, &sp, &eng) != TQKV_OK) {
        fprintf(stderr, "fake_serve: %s\n", tqkv_last_error());
        return 1;
    }
    FILE *pf = fopen(argv[2], "w");
    if (!pf) return 1;
    fprintf(pf, "%d\n", srv_port(srv));
    fclose(pf);
    int sig = 0;
    sigwait(&set, &sig);
    srv_stop_admission(srv);
    fake_engine_free(fe);
    srv_wait_idle(srv, 30.0);
    srv_free(srv);
    tqkv_tokenizer_free(tok);
    return 0;
}

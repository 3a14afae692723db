/*
 * fuzz_config.c - libFuzzer target for the config.json and generation_config.json readers
 * (load/config.c and each architecture's config_parse, arch/<name>/config.c), which take
 * untrusted JSON from a checkpoint directory.
 * Owns: feeding arbitrary bytes as config.json text: the parse must succeed with a config
 * the runtime can size (layers, heads, dims in range, head_dim a supported cache dim), or
 * fail with a status and a message; then the same bytes as generation_config.json over
 * the parsed config. With TQKV_FUZZ_WRITE_SEEDS=<dir> it writes the committed checkpoints'
 * configs (argv[1..]) there as seeds and exits.
 * Must not: touch anything but memory.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_impl.h"

static void die(const char *what) {
    fprintf(stderr, "fuzz_config: %s (%s)\n", what, tqkv_last_error());
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tqkv_model_config c;
    memset(&c, 0, sizeof c);
    tqkv_status st = model_config_parse((const char *)data, size, "config.json", &c);
    if (st != TQKV_OK) {
        if (!tqkv_last_error()[0]) die("refusal without a message");
        return 0;
    }
    if (c.n_layers < 1 || c.n_layers > TQKV_MAX_LAYERS || c.hidden_size < 1 || c.n_heads < 1 ||
        c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads || c.vocab_size < 1 ||
        tqkv_check_dim(c.head_dim) != TQKV_OK || c.max_position_embeddings < 1 ||
        c.n_eos < 0 || c.n_eos > TQKV_MAX_EOS || c.n_linear < 0 || c.n_linear > c.n_layers)
        die("accepted a config the runtime cannot size");
    tqkv_generation_config g;
    st = model_generation_parse((const char *)data, size, "generation_config.json", &c, &g);
    if (st != TQKV_OK && !tqkv_last_error()[0]) die("refusal without a message");
    return 0;
}

/* Seeds: the committed checkpoints' config.json files. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *dir = getenv("TQKV_FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    for (int i = 1; i < *argc; i++) {
        FILE *in = fopen((*argv)[i], "rb");
        if (!in) continue;
        char out[4096];
        snprintf(out, sizeof out, "%s/seed-%d.json", dir, i);
        FILE *o = fopen(out, "wb");
        char buf[65536];
        size_t n;
        while (o && (n = fread(buf, 1, sizeof buf, in)) > 0) fwrite(buf, 1, n, o);
        if (o) fclose(o);
        fclose(in);
    }
    exit(0);
}

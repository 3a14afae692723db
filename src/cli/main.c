/*
 * main.c - entry point of the tqkv CLI: dispatches to subcommands.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

typedef struct {
    const char *name;
    const char *sub; /* second word, or NULL */
    int (*fn)(int, char **);
    const char *help;
} command;

static const command COMMANDS[] = {
    {"formats", NULL, cmd_formats, "list KV formats with bits per value"},
    {"bench", "codec", cmd_bench_codec, "codec MSE, inner-product error and throughput"},
    {"bench", "attention", cmd_bench_attention, "decode attention: every format and kernel set"},
    {"tokenize", NULL, cmd_tokenize, "tokenize text with a model's tokenizer.json"},
    {"run", NULL, cmd_run, "generate text from a prompt"},
    {"ppl", NULL, cmd_ppl, "perplexity (and KL divergence) of a text file"},
    {"calibrate", NULL, cmd_calibrate, "per-layer KV sensitivity and a KV policy within B bits per value"},
    {"kv-error", NULL, cmd_kv_error, "per-layer reconstruction error of a model's real K/V per format"},
    {"bench", "gemm", cmd_bench_gemm, "GPU: the batch-invariant GEMM's weight bandwidth and TFLOP/s"},
    {"bench", "model", cmd_bench_model, "model prefill/decode tokens per second per KV format"},
    {"chat-template", NULL, cmd_chat_template, "render a conversation with the model's chat template"},
    {"info", NULL, cmd_info, "a checkpoint's graph, kernel set and KV bytes per token"},
    {"bench", "capacity", cmd_bench_capacity, "concurrent conversations that fit a KV budget per format"},
    {"serve", NULL, cmd_serve, "OpenAI-compatible HTTP server (continuous batching)"},
    {"bench", "engine", cmd_bench_engine, "serving engine: concurrent requests, draft, prefix cache"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: tqkv <command> [options]   (tqkv <command> --help)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s%s%s", COMMANDS[i].name, COMMANDS[i].sub ? " " : "",
                 COMMANDS[i].sub ? COMMANDS[i].sub : "");
        fprintf(f, "  %-18s %s\n", name, COMMANDS[i].help);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++) {
        const command *c = &COMMANDS[i];
        if (strcmp(argv[1], c->name)) continue;
        if (!c->sub) return c->fn(argc - 2, argv + 2);
        if (argc >= 3 && !strcmp(argv[2], c->sub)) return c->fn(argc - 3, argv + 3);
    }
    int group = 0; /* argv[1] names a group of subcommands ("bench") */
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (COMMANDS[i].sub && !strcmp(argv[1], COMMANDS[i].name)) group = 1;
    if (group && argc < 3)
        fprintf(stderr, "tqkv %s: missing subcommand\n", argv[1]);
    else if (group)
        fprintf(stderr, "tqkv %s: unknown subcommand '%s'\n", argv[1], argv[2]);
    else
        fprintf(stderr, "tqkv: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

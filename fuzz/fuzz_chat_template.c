/*
 * fuzz_chat_template.c - libFuzzer target for the chat-template engine (tqkv_chat.h).
 * Owns: feeding arbitrary bytes as a template source (up to the first 0xFF byte) and the
 * rest as message contents, then rendering: init must succeed or fail cleanly, render must
 * succeed (text of the reported length, no NUL inside) or fail cleanly with a message.
 * With TQKV_FUZZ_WRITE_SEEDS=<dir> it copies the committed real templates
 * (the .jinja files of tests/golden/chat, given as argv[1..]) there as seeds and exits.
 * Must not: depend on anything but the public API.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tqkv_chat.h"

static void die(const char *what) {
    fprintf(stderr, "fuzz_chat_template: %s (%s)\n", what, tqkv_last_error());
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t cut = 0;
    while (cut < size && data[cut] != 0xFF) cut++;
    char *src = malloc(cut + 1);
    if (!src) return 0;
    memcpy(src, data, cut);
    src[cut] = 0; /* an embedded NUL just ends the template early */
    size_t rest = cut < size ? size - cut - 1 : 0;
    char *content = malloc(rest + 1);
    if (!content) {
        free(src);
        return 0;
    }
    memcpy(content, data + size - rest, rest);
    content[rest] = 0;

    tqkv_chat_template *t = NULL;
    tqkv_status st = tqkv_chat_template_init(&t, src);
    if (st == TQKV_OK) {
        tqkv_chat_message conv[4] = {
            {"system", "You are helpful."}, {"user", content}, {"assistant", "<think>\nx\n</think>\n\ny"}, {"user", content}};
        for (int agp = 0; agp < 2; agp++)
            for (int n = 0; n <= 4; n += 2) {
                char *out = NULL;
                size_t len = 0;
                st = tqkv_chat_template_render(t, conv + (n == 4 ? 0 : 1), n == 0 ? 1 : n, agp, "<s>", "</s>", &out, &len);
                if (st == TQKV_OK) {
                    if (!out || strlen(out) > len) die("render output shorter than its length");
                    free(out);
                } else if (!tqkv_last_error()[0]) die("render failed without a message");
            }
        tqkv_chat_template_free(t);
    } else if (!tqkv_last_error()[0]) die("init failed without a message");
    free(src);
    free(content);
    return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *dir = getenv("TQKV_FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    for (int i = 1; i < *argc; i++) {
        FILE *in = fopen((*argv)[i], "rb");
        if (!in) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/seed_%d.jinja", dir, i);
        FILE *out = fopen(path, "wb");
        int c;
        while (out && (c = fgetc(in)) != EOF) fputc(c, out);
        if (out) {
            fputc(0xFF, out);
            fputs("Hello {{ world }} \xc3\xa9 <think>a</think>", out);
            fclose(out);
        }
        fclose(in);
    }
    exit(0);
}

/*
 * fuzz_request.c - libFuzzer target of the server's request parser: arbitrary bytes as
 * the body of /v1/completions and /v1/chat/completions. The parser must return 0 with a
 * request that frees cleanly, or -1 with an OpenAI error (4xx/5xx, non-empty message);
 * never read past the input, leak, or crash. TQKV_FUZZ_WRITE_SEEDS=DIR writes a seed
 * corpus of valid and near-valid bodies and exits.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

static const char *const SEEDS[] = {
    "{\"model\":\"m\",\"prompt\":\"def f(x):\",\"max_tokens\":16,\"temperature\":0,\"stream\":true,"
    "\"stream_options\":{\"include_usage\":true},\"stop\":[\"\\n\\n\",\"def\"],\"logprobs\":2,\"seed\":7}",
    "{\"prompt\":[1,2,3],\"n\":1,\"top_p\":0.9}",
    "{\"prompt\":[\"one\"],\"echo\":false,\"best_of\":1}",
    "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
    "[{\"type\":\"text\",\"text\":\"hi\"}]},{\"role\":\"assistant\",\"content\":null}],"
    "\"max_completion_tokens\":4,\"logprobs\":true,\"top_logprobs\":3,\"stop\":\"x\"}",
    "{\"messages\":[{\"role\":\"user\",\"content\":\"\\u00e9\\ud83d\\ude00\"}],\"frequency_penalty\":0}",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    srv_limits lim = {"m", 4096, 8192, NULL, 0};
    for (int api = 0; api < 2; api++) {
        /* a copy of exactly `size` bytes so ASan catches any read past the end */
        char *body = malloc(size ? size : 1);
        if (!body) return 0;
        if (size) memcpy(body, data, size);
        srv_request r;
        srv_error err;
        memset(&err, 0, sizeof err);
        if (srv_request_parse((srv_api)api, body, size, &lim, &r, &err) == 0) {
            if (r.api != (srv_api)api) abort();
            if (api == SRV_API_CHAT && (r.n_msgs < 1 || !r.msgs)) abort();
            if (api == SRV_API_COMPLETIONS && !r.prompt && r.n_prompt_ids < 1) abort();
            if (r.max_tokens != -1 && (r.max_tokens < 1 || r.max_tokens > lim.context_len)) abort();
            if (r.n_stop < 0 || r.n_stop > SRV_MAX_STOP) abort();
            if (r.top_logprobs < -1 || r.top_logprobs > TQKV_MAX_TOP_LOGPROBS) abort();
            for (int i = 0; i < r.n_prompt_ids; i++)
                if (r.prompt_ids[i] < 0 || r.prompt_ids[i] >= lim.vocab_size) abort();
            srv_request_free(&r);
        } else {
            if (err.http_status < 400 || err.http_status > 599 || !err.message[0]) abort();
            char *js = srv_error_json(&err);
            if (!js) abort();
            free(js);
        }
        free(body);
    }
    return 0;
}

/* Seed corpus writer (not part of the fuzzing run). */
__attribute__((constructor)) static void write_seeds(void) {
    const char *dir = getenv("TQKV_FUZZ_WRITE_SEEDS");
    if (!dir) return;
    for (size_t i = 0; i < sizeof SEEDS / sizeof SEEDS[0]; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/seed-%zu.json", dir, i);
        FILE *f = fopen(path, "wb");
        if (!f) exit(1);
        fwrite(SEEDS[i], 1, strlen(SEEDS[i]), f);
        fclose(f);
    }
    exit(0);
}

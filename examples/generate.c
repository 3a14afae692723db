/*
 * generate.c - libtqkv-model: load a Hugging Face checkpoint, tokenize a prompt and
 * generate greedily with a tq4 KV cache, streaming the text to stdout.
 * usage: generate MODEL_DIR [PROMPT] [N_TOKENS]
 * Build: cc generate.c $(pkg-config --cflags --libs tqkv-model)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tqkv_model.h>
#include <tqkv_tokenizer.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        if ((call) != TQKV_OK) {                                                                   \
            fprintf(stderr, "%s failed: %s\n", #call, tqkv_last_error());                          \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL_DIR [PROMPT] [N_TOKENS]\n", argv[0]);
        return 2;
    }
    const char *prompt = argc > 2 ? argv[2] : "def fibonacci(n):\n";
    int n_new = argc > 3 ? atoi(argv[3]) : 32;

    // ---- load weights and tokenizer ----
    tqkv_model *model;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    CHECK(tqkv_model_load(&model, argv[1], &lp));
    tqkv_tokenizer *tok;
    CHECK(tqkv_tokenizer_load(&tok, argv[1]));
    int vocab = tqkv_model_get_config(model)->vocab_size;

    // ---- one row, K and V in tq4 ----
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.k_format = TQKV_TQ4;
    sp.v_format = TQKV_TQ4;
    sp.threads = 2;
    tqkv_model_state *state;
    CHECK(tqkv_model_state_init(&state, model, &sp));

    // ---- prompt -> ids -> prefill ----
    int32_t *ids;
    size_t n_ids;
    CHECK(tqkv_tokenizer_encode(tok, prompt, strlen(prompt), 0, &ids, &n_ids));
    float *logits = malloc(sizeof(float) * (size_t)vocab); // [vocab]
    if (!logits || n_ids == 0) return 1;
    CHECK(tqkv_model_prefill(model, state, ids, NULL, (int)n_ids, TQKV_LOGITS_LAST, logits));

    // ---- greedy decode, streaming complete UTF-8 ----
    tqkv_sampler_params smp = tqkv_sampler_params_default(); // temperature 0: greedy
    tqkv_sampler *sampler;
    CHECK(tqkv_sampler_init(&sampler, &smp, vocab));
    tqkv_decode_stream *stream;
    CHECK(tqkv_decode_stream_init(&stream, tok, TQKV_DECODE_SKIP_SPECIAL));
    const char *text;
    size_t len;
    fputs(prompt, stdout);
    for (int i = 0; i < n_new; i++) {
        int next;
        CHECK(tqkv_sampler_sample(sampler, logits, &next));
        if (tqkv_model_is_eos(model, next)) break;
        CHECK(tqkv_decode_stream_push(stream, next, &text, &len));
        fwrite(text, 1, len, stdout);
        fflush(stdout);
        int32_t t = next;
        CHECK(tqkv_model_decode(model, state, &t, logits));
    }
    CHECK(tqkv_decode_stream_flush(stream, &text, &len));
    fwrite(text, 1, len, stdout);
    fprintf(stderr, "\n[%.1f KV bytes per token over all layers]\n",
            tqkv_model_state_kv_bytes_per_token(state));

    tqkv_decode_stream_free(stream);
    tqkv_sampler_free(sampler);
    free(logits);
    free(ids);
    tqkv_model_state_free(state);
    tqkv_tokenizer_free(tok);
    tqkv_model_free(model);
    return 0;
}

/*
 * cmd_tokenize.c - `tqkv tokenize`: text -> token ids with a model's tokenizer.json.
 *
 * Owns: argument handling and printing of the tokenize subcommand. Must not: contain
 * tokenizer logic (that is src/tokenizer/tokenizer*.c behind tqkv_tokenizer.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "model_cli.h"
#include "tqkv_tokenizer.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static const char *DESCRIPTION =
    "Tokenize text with a Hugging Face tokenizer.json (byte-level BPE), ids equal to HF tokenizers.\n"
    "Exactly one of --text or --file (\"-\" reads stdin).\n"
    "Output: the ids space-separated on stdout, the count on stderr.\n"
    "With --json: one JSON object on stdout:\n"
    "  {\"ids\": [id, ...], \"n_tokens\": N, \"tokens\": [\"piece\", ...]}\n"
    "where tokens are the vocab strings of the ids (byte-level, e.g. \"Ġworld\" for \" world\").\n";

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_tokenize(int argc, char **argv) {
    const char *model = "models/qwen3-code-28m", *text = NULL, *file = NULL;
    int json = 0, add_special = 0, special_as_text = 0;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model, "model directory or tokenizer.json (default models/qwen3-code-28m)"},
        {"--text", ARG_STR, &text, "text to tokenize"},
        {"--file", ARG_STR, &file, "file to tokenize (\"-\" = stdin)"},
        {"--json", ARG_FLAG, &json, "print {\"ids\": [...], \"n_tokens\": N, \"tokens\": [...]}"},
        {"--add-special", ARG_FLAG, &add_special, "apply the post-processor (e.g. a BOS token)"},
        {"--special-as-text", ARG_FLAG, &special_as_text, "treat special tokens written in the text as plain text"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(DESCRIPTION, stdout);
            args_usage(stdout, "tokenize", specs, n_specs);
            return 0;
        }
    if (args_parse("tokenize", argc, argv, specs, n_specs) != 0) return 2;
    if (!text == !file) {
        fprintf(stderr, "tqkv tokenize: give exactly one of --text or --file\n");
        args_usage(stderr, "tokenize", specs, n_specs);
        return 2;
    }

    char *buf = NULL;
    size_t len = 0;
    if (file) {
        if (mcli_read_file("tokenize", file, &buf, &len) != 0) return 1;
    } else {
        len = strlen(text);
    }
    tqkv_tokenizer *tok = NULL;
    tqkv_status st = tqkv_tokenizer_load(&tok, model);
    if (st) {
        fprintf(stderr, "tqkv tokenize: %s\n", tqkv_last_error());
        free(buf);
        return 1;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    unsigned flags = (add_special ? TQKV_ENCODE_ADD_SPECIAL : 0u) | (special_as_text ? TQKV_ENCODE_SPECIAL_AS_TEXT : 0u);
    st = tqkv_tokenizer_encode(tok, file ? buf : text, len, flags, &ids, &n);
    free(buf);
    if (st) {
        fprintf(stderr, "tqkv tokenize: %s\n", tqkv_last_error());
        tqkv_tokenizer_free(tok);
        return 1;
    }

    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON *a = cJSON_AddArrayToObject(o, "ids");
        for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
        cJSON_AddNumberToObject(o, "n_tokens", (double)n);
        cJSON *t = cJSON_AddArrayToObject(o, "tokens");
        for (size_t i = 0; t && i < n; i++) {
            const char *piece = "";
            size_t plen = 0;
            tqkv_tokenizer_id_to_token(tok, ids[i], &piece, &plen);  // ids come from encode
            cJSON_AddItemToArray(t, json_bytes(piece, plen));
        }
        if (json_print(stdout, o, 0, "tokenize")) {
            free(ids);
            tqkv_tokenizer_free(tok);
            return 1;
        }
    } else {
        for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        fputc('\n', stdout);
        fprintf(stderr, "%zu tokens\n", n);
    }
    free(ids);
    tqkv_tokenizer_free(tok);
    return fflush(stdout) == 0 ? 0 : 1;
}

/*
 * cmd_chat_template.c - `tqkv chat-template`: render a conversation with a model's own chat
 * template (chat_template.jinja / tokenizer_config.json), optionally tokenized.
 *
 * Owns: argument handling and printing of the chat-template subcommand. Must not: contain
 * template logic (that is src/chat/chat_*.c behind tqkv_chat.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "model_cli.h"
#include "tqkv_chat.h"
#include "tqkv_tokenizer.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static const char *DESCRIPTION =
    "Render a conversation with the model's own chat template, as transformers'\n"
    "apply_chat_template(tokenize=False) does. The conversation is --messages (a JSON array of\n"
    "OpenAI-style messages; \"-\" reads stdin) or --prompt (one user message, after --system if given).\n"
    "--extra gives further template variables as a JSON object, e.g. '{\"enable_thinking\": false}'.\n"
    "Output: the text on stdout. With --tokens, the token count (special tokens split out, no BOS\n"
    "added) on stderr. With --json: one JSON object on stdout:\n"
    "  {\"text\": \"...\", \"bytes\": N[, \"n_tokens\": N, \"ids\": [...]][, \"render_us\": T]}\n"
    "--repeat N renders N times and reports the mean time per render (render_us; stderr without --json).\n";

static int fail(const char *what) {
    fprintf(stderr, "tqkv chat-template: %s%s%s\n", what, tqkv_last_error()[0] ? ": " : "", tqkv_last_error());
    return 1;
}

// ---------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------

int cmd_chat_template(int argc, char **argv) {
    const char *model = "models/qwen3-code-28m", *messages = NULL, *prompt = NULL, *system = NULL, *extra = NULL;
    const char *template_file = NULL, *bos_arg = NULL, *eos_arg = NULL;
    int json = 0, agp = 0, tokens = 0, repeat = 0;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model, "model directory (default models/qwen3-code-28m)"},
        {"--template", ARG_STR, &template_file, "a template file to use instead of the model's"},
        {"--bos", ARG_STR, &bos_arg, "bos_token string (default: the model's tokenizer_config.json)"},
        {"--eos", ARG_STR, &eos_arg, "eos_token string (default: the model's tokenizer_config.json)"},
        {"--messages", ARG_STR, &messages, "JSON file with the messages array (\"-\" = stdin)"},
        {"--prompt", ARG_STR, &prompt, "one user message (instead of --messages)"},
        {"--system", ARG_STR, &system, "system message before --prompt"},
        {"--extra", ARG_STR, &extra, "extra template variables as a JSON object"},
        {"--generation-prompt", ARG_FLAG, &agp, "add_generation_prompt=True"},
        {"--tokens", ARG_FLAG, &tokens, "also tokenize the text with the model's tokenizer"},
        {"--json", ARG_FLAG, &json, "print {\"text\", \"bytes\"[, \"n_tokens\", \"ids\"][, \"render_us\"]}"},
        {"--repeat", ARG_INT, &repeat, "render N times and report the mean time per render"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(DESCRIPTION, stdout);
            args_usage(stdout, "chat-template", specs, n_specs);
            return 0;
        }
    if (args_parse("chat-template", argc, argv, specs, n_specs) != 0) return 2;
    if (!messages == !prompt || (system && !prompt)) {
        fprintf(stderr, "tqkv chat-template: give exactly one of --messages or --prompt (--system goes with --prompt)\n");
        args_usage(stderr, "chat-template", specs, n_specs);
        return 2;
    }

    char *msg_json = NULL;
    size_t len = 0;
    if (messages) {
        if (mcli_read_file("chat-template", messages, &msg_json, &len) != 0) return 1;
    } else {
        cJSON *arr = cJSON_CreateArray(), *m;
        if (system) {
            m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "system");
            cJSON_AddStringToObject(m, "content", system);
            cJSON_AddItemToArray(arr, m);
        }
        m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", prompt);
        cJSON_AddItemToArray(arr, m);
        msg_json = cJSON_PrintUnformatted(arr);
        cJSON_Delete(arr);
    }

    tqkv_chat_template *t = NULL;
    char *bos = NULL, *eos = NULL, *text = NULL;
    size_t text_len = 0;
    int rc = 0;
    if (template_file) {
        char *src = NULL;
        size_t src_len = 0;
        if (mcli_read_file("chat-template", template_file, &src, &src_len) != 0) rc = 1;
        else if (tqkv_chat_template_init(&t, src) != TQKV_OK) rc = fail("cannot parse the template");
        free(src);
    } else if (tqkv_chat_template_load(&t, model, &bos, &eos) != TQKV_OK)
        rc = fail("cannot load the chat template");
    if (bos_arg) {
        free(bos);
        bos = strdup(bos_arg);
    }
    if (eos_arg) {
        free(eos);
        eos = strdup(eos_arg);
    }
    if (!rc && tqkv_chat_template_render_json(t, msg_json, agp, bos, eos, extra, &text, &text_len) != TQKV_OK)
        rc = fail("render failed");
    double render_us = 0;
    if (!rc && repeat > 0) {
        double t0 = tqkv_now_s();
        for (int i = 0; i < repeat && !rc; i++) {
            char *again = NULL;
            if (tqkv_chat_template_render_json(t, msg_json, agp, bos, eos, extra, &again, NULL) != TQKV_OK)
                rc = fail("render failed");
            free(again);
        }
        render_us = (tqkv_now_s() - t0) / repeat * 1e6;
    }
    free(msg_json);
    free(bos);
    free(eos);
    tqkv_chat_template_free(t);
    if (rc) {
        free(text);
        return rc;
    }

    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (tokens) {
        tqkv_tokenizer *tok = NULL;
        if (tqkv_tokenizer_load(&tok, model) != TQKV_OK) rc = fail("cannot load the tokenizer");
        else if (tqkv_tokenizer_encode(tok, text, text_len, 0, &ids, &n_ids) != TQKV_OK) rc = fail("encode failed");
        tqkv_tokenizer_free(tok);
        if (rc) {
            free(text);
            return rc;
        }
    }
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "text", text);
        cJSON_AddNumberToObject(o, "bytes", (double)text_len);
        if (tokens) {
            cJSON_AddNumberToObject(o, "n_tokens", (double)n_ids);
            cJSON *a = cJSON_AddArrayToObject(o, "ids");
            for (size_t i = 0; i < n_ids; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
        }
        if (repeat > 0) cJSON_AddNumberToObject(o, "render_us", render_us);
        char *s = cJSON_PrintUnformatted(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
    } else {
        fwrite(text, 1, text_len, stdout);
        if (tokens) fprintf(stderr, "%zu tokens\n", n_ids);
        if (repeat > 0) fprintf(stderr, "%.1f us per render (mean of %d)\n", render_us, repeat);
    }
    free(ids);
    free(text);
    return 0;
}

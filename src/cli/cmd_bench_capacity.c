/*
 * cmd_bench_capacity.c - `tqkv bench capacity`: how many concurrent conversations of a
 * given length fit one KV budget, per KV format, from the model state's projected bytes
 * (the figure the serving engine admits requests by).
 * Owns: options and the table / --json line. Must not: contain cache or model logic.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "json_out.h"
#include "model_cli.h"
#include "tqkv_model.h"

static const char *CMD = "bench capacity";

int cmd_bench_capacity(int argc, char **argv) {
    const char *model = MCLI_DEFAULT_MODEL, *kvs = "f16,tq4,tq3", *budget_s = "128M";
    int tokens = 2048, json = 0, window = 0;
    arg_spec specs[] = {
        {"--model", ARG_STR, &model, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--kv", ARG_STR, &kvs, "comma-separated KV specs (default f16,tq4,tq3)"},
        {"--kv-budget", ARG_STR, &budget_s, "KV budget in bytes, K/M/G suffix (default 128M)"},
        {"--tokens", ARG_INT, &tokens, "tokens per conversation (default 2048)"},
        {"--window", ARG_INT, &window, "q8 recent window (default 0)"},
        {"--json", ARG_FLAG, &json, "one JSON line on stdout"},
    };
    if (args_parse(CMD, argc, argv, specs, (int)(sizeof specs / sizeof specs[0]))) return 2;
    char *end = NULL;
    double b = strtod(budget_s, &end);
    double mul = 1;
    if (end && (*end == 'K' || *end == 'k')) mul = 1024.0;
    if (end && (*end == 'M' || *end == 'm')) mul = 1024.0 * 1024;
    if (end && (*end == 'G' || *end == 'g')) mul = 1024.0 * 1024 * 1024;
    if (!end || end == budget_s || b <= 0 || tokens < 1 || window < 0) {
        fprintf(stderr, "tqkv %s: --kv-budget must be a positive size, --tokens >= 1\n", CMD);
        return 2;
    }
    size_t budget = (size_t)(b * mul);
    char mbuf[4096];
    const char *dir = mcli_resolve_model(CMD, model, mbuf, sizeof mbuf);
    tqkv_model *m = NULL;
    if (!dir || mcli_load(CMD, dir, 0, 0, 1, &m)) return 1;
    char *list = strdup(kvs);
    if (!list) return 1;
    cJSON *root = cJSON_CreateObject(), *arr = cJSON_CreateArray();
    cJSON_AddNumberToObject(root, "budget_bytes", (double)budget);
    cJSON_AddNumberToObject(root, "tokens", tokens);
    cJSON_AddItemToObject(root, "formats", arr);
    if (!json) printf("%-8s %14s %14s %14s\n", "kv", "bytes/token", "bytes/conv", "conversations");
    int rc = 0;
    for (char *save = NULL, *spec = strtok_r(list, ",", &save); spec; spec = strtok_r(NULL, ",", &save)) {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.window = window;
        tqkv_model_state *s = NULL;
        if (mcli_parse_kv(CMD, spec, &sp.k_format, &sp.v_format) ||
            tqkv_model_state_init(&s, m, &sp) != TQKV_OK) {
            if (s == NULL && tqkv_last_error()[0]) fprintf(stderr, "tqkv %s: %s\n", CMD, tqkv_last_error());
            rc = 1;
            break;
        }
        size_t per = tqkv_model_state_projected_bytes(s, tokens);
        double bpt = tqkv_model_state_kv_bytes_per_token(s);
        size_t n = per ? budget / per : 0;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToArray(arr, o);
        cJSON_AddStringToObject(o, "kv", spec);
        json_add_num(o, "kv_bytes_per_token", bpt, 3);
        cJSON_AddNumberToObject(o, "projected_bytes", (double)per);
        cJSON_AddNumberToObject(o, "conversations", (double)n);
        if (!json) printf("%-8s %14.1f %14zu %14zu\n", spec, bpt, per, n);
        tqkv_model_state_free(s);
    }
    /* JSON only when every format was measured: never a truncated document */
    if (json && !rc) rc = json_print(stdout, root, 0, CMD) ? 1 : 0; /* frees root */
    else cJSON_Delete(root);
    free(list);
    tqkv_model_free(m);
    return rc;
}

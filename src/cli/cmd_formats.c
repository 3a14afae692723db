/*
 * cmd_formats.c - `tqkv formats [--dim 128] [--json]`: every KV format with its
 * bytes per vector and bits per value (all metadata counted).
 * Owns: printing the format table. Must not: contain codec logic (asks libtqkv).
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "kv_preset.h"
#include "tqkv.h"

int cmd_formats(int argc, char **argv) {
    int dim = 128, json = 0;
    const arg_spec specs[] = {
        {"--dim", ARG_INT, &dim, "head_dim: power of two in [32, 512] (default 128)"},
        {"--json", ARG_FLAG, &json, "print a JSON array"},
    };
    if (args_parse("formats", argc, argv, specs, 2) != 0) return 2;
    if (tqkv_check_dim(dim) != TQKV_OK) {
        fprintf(stderr, "tqkv formats: %s\n", tqkv_last_error());
        return 2;
    }

    // ---- JSON ----
    if (json) {
        cJSON *arr = cJSON_CreateArray();
        if (!arr) return 1;
        for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
            cJSON *o = cJSON_CreateObject();
            if (!o) { cJSON_Delete(arr); return 1; }
            cJSON_AddStringToObject(o, "format", tqkv_format_name((tqkv_format)f));
            cJSON_AddNumberToObject(o, "dim", dim);
            cJSON_AddNumberToObject(o, "bytes_per_vector",
                                    (double)tqkv_format_bytes((tqkv_format)f, dim));
            cJSON_AddNumberToObject(o, "bits_per_value",
                                    tqkv_format_bits_per_value((tqkv_format)f, dim));
            cJSON_AddItemToArray(arr, o);
        }
        if (kvp_list_json(arr, dim)) { cJSON_Delete(arr); return 1; }
        char *s = cJSON_Print(arr);
        cJSON_Delete(arr);
        if (!s) return 1;
        printf("%s\n", s);
        free(s);
        return 0;
    }

    // ---- table ----
    printf("%-8s %16s %14s   (dim %d)\n", "format", "bytes_per_vector", "bits_per_value", dim);
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++)
        printf("%-8s %16zu %14.4f\n", tqkv_format_name((tqkv_format)f),
               tqkv_format_bytes((tqkv_format)f, dim),
               tqkv_format_bits_per_value((tqkv_format)f, dim));
    return 0;
}

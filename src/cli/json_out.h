/*
 * json_out.h - the one way the CLI writes --json output: cJSON trees, printed by cJSON.
 * Owns: small helpers for what cJSON lacks (byte strings with NULs, rounded numbers,
 * printing one line). Must not: escape JSON by hand or hold state.
 */
#ifndef TQKV_CLI_JSON_OUT_H
#define TQKV_CLI_JSON_OUT_H

#include <stddef.h>
#include <stdio.h>

#include <cjson/cJSON.h>

/* A JSON string item of `len` bytes of UTF-8 that may hold NUL bytes (written \u0000;
 * cJSON strings end at the first NUL). NULL on out of memory. */
cJSON *json_bytes(const char *s, size_t len);
/* Add `key`: v rounded to `decimals` places (null when v is not finite). */
void json_add_num(cJSON *o, const char *key, double v, int decimals);
/* Add `key`: an array of n ints. */
void json_add_ints(cJSON *o, const char *key, const int *v, size_t n);
/* Print root on one line (pretty = 0) or indented, then "\n", and free root.
 * 0, or -1 (message on stderr) when root is NULL (a failed allocation) or printing fails. */
int json_print(FILE *f, cJSON *root, int pretty, const char *cmd);

#endif

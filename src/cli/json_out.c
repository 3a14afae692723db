/*
 * json_out.c - cJSON helpers for the CLI's --json output (see json_out.h).
 * Owns: NUL-safe strings, rounding, one-line printing. Must not: escape by hand.
 */
#include "json_out.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------------------
// strings
// ---------------------------------------------------------------------------

cJSON *json_bytes(const char *s, size_t len) {
    if (!memchr(s, 0, len)) { /* the usual case: a plain C string of len bytes */
        char *z = malloc(len + 1);
        if (!z) return NULL;
        memcpy(z, s, len);
        z[len] = 0;
        cJSON *item = cJSON_CreateString(z);
        free(z);
        return item;
    }
    /* NUL bytes: cJSON escapes each NUL-free segment; the segments are joined with \u0000
     * into a raw (already escaped) string item */
    char *raw = NULL; // escaped text, quotes included
    size_t n = 0;
    FILE *m = open_memstream(&raw, &n);
    if (!m) return NULL;
    fputc('"', m);
    for (size_t i = 0;;) {
        const char *nul = memchr(s + i, 0, len - i);
        size_t seg = nul ? (size_t)(nul - (s + i)) : len - i;
        cJSON *part = json_bytes(s + i, seg); /* NUL-free: the plain path above */
        char *esc = part ? cJSON_PrintUnformatted(part) : NULL;
        cJSON_Delete(part);
        if (!esc) {
            fclose(m);
            free(raw);
            return NULL;
        }
        fwrite(esc + 1, 1, strlen(esc) - 2, m); /* without its quotes */
        free(esc);
        if (!nul) break;
        fputs("\\u0000", m);
        i += seg + 1;
    }
    fputc('"', m);
    if (fclose(m) != 0) {
        free(raw);
        return NULL;
    }
    cJSON *item = cJSON_CreateRaw(raw);
    free(raw);
    return item;
}

// ---------------------------------------------------------------------------
// numbers
// ---------------------------------------------------------------------------

void json_add_num(cJSON *o, const char *key, double v, int decimals) {
    if (!isfinite(v)) {
        cJSON_AddNullToObject(o, key);
        return;
    }
    double p = pow(10.0, decimals);
    double r = round(v * p) / p;
    cJSON_AddNumberToObject(o, key, isfinite(r) ? r : v);
}

void json_add_ints(cJSON *o, const char *key, const int *v, size_t n) {
    cJSON *a = cJSON_AddArrayToObject(o, key);
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
}

// ---------------------------------------------------------------------------
// printing
// ---------------------------------------------------------------------------

int json_print(FILE *f, cJSON *root, int pretty, const char *cmd) {
    char *s = root ? (pretty ? cJSON_Print(root) : cJSON_PrintUnformatted(root)) : NULL;
    cJSON_Delete(root);
    if (!s) {
        fprintf(stderr, "tqkv %s: out of memory writing JSON\n", cmd);
        return -1;
    }
    int rc = fprintf(f, "%s\n", s) < 0 ? -1 : 0;
    free(s);
    return rc;
}

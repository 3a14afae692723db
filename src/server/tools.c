/*
 * tools.c - tool calls in a model's output, in the formats the bundled chat templates
 * teach their models:
 *   Qwen / Hermes:  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>  (repeatable)
 *   Llama 3:        {"name": "f", "parameters": {...}}  as the whole output, optionally
 *                   after <|python_tag|>
 *   Gemma 4:        <|tool_call>call:f{key:<|"|>text<|"|>,n:3}<tool_call|>  (repeatable)
 * Owns: parsing a finished output into OpenAI tool calls plus the content before them,
 * and the length of a growing output that can be streamed as content (what cannot be the
 * start of a call). A call that does not parse leaves the whole output as content.
 * Must not: touch the engine, HTTP or the template.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "server/server.h"

static const char *const OPENERS[] = {"<tool_call>", "<|tool_call>", "<|python_tag|>"};
#define N_OPENERS 3

static const char *find_n(const char *h, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(h + i, needle, k)) return h + i;
    return NULL;
}

static size_t skip_ws(const char *s, size_t i, size_t n) {
    while (i < n && (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) i++;
    return i;
}

size_t srv_tool_safe_len(const char *text, size_t len) {
    /* a Llama 3 call is a JSON object as the whole output: hold everything once the
     * output (past leading whitespace) starts with '{' */
    size_t i = skip_ws(text, 0, len);
    if (i == len) return 0;
    if (text[i] == '{') return 0;
    size_t safe = len;
    for (int o = 0; o < N_OPENERS; o++) {
        const char *hit = find_n(text, len, OPENERS[o]);
        if (hit && (size_t)(hit - text) < safe) safe = (size_t)(hit - text);
        /* a tail that may grow into an opener */
        size_t k = strlen(OPENERS[o]);
        for (size_t t = k - 1; t >= 1; t--)
            if (t <= len && !memcmp(text + len - t, OPENERS[o], t)) {
                if (len - t < safe) safe = len - t;
                break;
            }
    }
    /* trailing whitespace may precede a call (the content then ends before it): hold it */
    while (safe > 0 && (text[safe - 1] == ' ' || text[safe - 1] == '\n' || text[safe - 1] == '\r' ||
                        text[safe - 1] == '\t'))
        safe--;
    return safe;
}

void srv_tool_calls_free(srv_tool_call *c, int n) {
    for (int i = 0; c && i < n; i++) {
        free(c[i].id);
        free(c[i].name);
        free(c[i].arguments);
    }
    free(c);
}

/* ------------------------------------------------------------------------- */
/* One call                                                                  */
/* ------------------------------------------------------------------------- */

typedef struct {
    srv_tool_call *v;
    int            n, cap;
    const char    *req_id;
    int            choice;
} call_list;

static int list_add(call_list *l, const char *name, const cJSON *args) {
    if (l->n == l->cap) {
        int nc = l->cap ? l->cap * 2 : 4;
        srv_tool_call *nv = realloc(l->v, sizeof *nv * (size_t)nc);
        if (!nv) return -1;
        l->v = nv;
        l->cap = nc;
    }
    srv_tool_call *c = &l->v[l->n];
    memset(c, 0, sizeof *c);
    char id[96];
    snprintf(id, sizeof id, "call_%s_%d_%d", l->req_id, l->choice, l->n);
    c->id = strdup(id);
    c->name = strdup(name);
    c->arguments = args ? cJSON_PrintUnformatted(args) : strdup("{}");
    l->n++;
    return c->id && c->name && c->arguments ? 0 : -1;
}

/* {"name": "...", "arguments" | "parameters": {...} or "json string"}: 1 added, 0 not a
 * call, -1 out of memory. */
static int add_json_call(call_list *l, const char *s, size_t n) {
    cJSON *j = cJSON_ParseWithLength(s, n);
    if (!j) return 0;
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "arguments");
    if (!a) a = cJSON_GetObjectItemCaseSensitive(j, "parameters");
    int rc = 0;
    cJSON *parsed = NULL;
    if (a && cJSON_IsString(a)) a = parsed = cJSON_Parse(a->valuestring);
    if (cJSON_IsObject(j) && cJSON_IsString(nm) && nm->valuestring[0] && (!a || cJSON_IsObject(a)))
        rc = list_add(l, nm->valuestring, a) ? -1 : 1;
    cJSON_Delete(parsed);
    cJSON_Delete(j);
    return rc;
}

/* Gemma 4's value syntax -> cJSON (NULL: not valid). *i advances past the value. */
static cJSON *gemma_value(const char *s, size_t n, size_t *i, int depth);

static char *gemma_string(const char *s, size_t n, size_t *i) {
    static const char Q[] = "<|\"|>";
    if (*i + 5 > n || memcmp(s + *i, Q, 5)) return NULL;
    const char *end = find_n(s + *i + 5, n - *i - 5, Q);
    if (!end) return NULL;
    size_t len = (size_t)(end - (s + *i + 5));
    char *o = malloc(len + 1);
    if (!o) return NULL;
    memcpy(o, s + *i + 5, len);
    o[len] = 0;
    *i = (size_t)(end - s) + 5;
    return o;
}

static cJSON *gemma_object(const char *s, size_t n, size_t *i, int depth) {
    cJSON *o = cJSON_CreateObject();
    (*i)++; /* '{' */
    while (o && *i < n && s[*i] != '}') {
        char *key = NULL;
        if (s[*i] == '<') key = gemma_string(s, n, i);
        else {
            size_t k0 = *i;
            while (*i < n && s[*i] != ':' && s[*i] != '}' && s[*i] != ',') (*i)++;
            if ((key = malloc(*i - k0 + 1))) {
                memcpy(key, s + k0, *i - k0);
                key[*i - k0] = 0;
            }
        }
        cJSON *v = NULL;
        if (key && key[0] && *i < n && s[*i] == ':') {
            (*i)++;
            v = gemma_value(s, n, i, depth + 1);
        }
        if (!v) {
            free(key);
            cJSON_Delete(o);
            return NULL;
        }
        cJSON_AddItemToObject(o, key, v);
        free(key);
        if (*i < n && s[*i] == ',') (*i)++;
    }
    if (!o || *i >= n) {
        cJSON_Delete(o);
        return NULL;
    }
    (*i)++; /* '}' */
    return o;
}

static cJSON *gemma_value(const char *s, size_t n, size_t *i, int depth) {
    if (depth > 32 || *i >= n) return NULL;
    char c = s[*i];
    if (c == '<') {
        char *str = gemma_string(s, n, i);
        cJSON *v = str ? cJSON_CreateString(str) : NULL;
        free(str);
        return v;
    }
    if (c == '{') return gemma_object(s, n, i, depth);
    if (c == '[') {
        cJSON *a = cJSON_CreateArray();
        (*i)++;
        while (a && *i < n && s[*i] != ']') {
            cJSON *v = gemma_value(s, n, i, depth + 1);
            if (!v) {
                cJSON_Delete(a);
                return NULL;
            }
            cJSON_AddItemToArray(a, v);
            if (*i < n && s[*i] == ',') (*i)++;
        }
        if (!a || *i >= n) {
            cJSON_Delete(a);
            return NULL;
        }
        (*i)++;
        return a;
    }
    /* a bare scalar: true, false, null, a number */
    size_t k0 = *i;
    while (*i < n && s[*i] != ',' && s[*i] != '}' && s[*i] != ']') (*i)++;
    cJSON *v = cJSON_ParseWithLength(s + k0, *i - k0);
    if (v && (cJSON_IsObject(v) || cJSON_IsArray(v) || cJSON_IsString(v))) {
        cJSON_Delete(v);
        return NULL;
    }
    return v;
}

/* "call:name{...}" (between <|tool_call> and <tool_call|>): 1, 0 or -1. */
static int add_gemma_call(call_list *l, const char *s, size_t n) {
    if (n < 6 || memcmp(s, "call:", 5)) return 0;
    size_t i = 5, k0 = 5;
    while (i < n && s[i] != '{') i++;
    if (i == n || i == k0) return 0;
    char name[72];
    if (i - k0 >= sizeof name) return 0;
    memcpy(name, s + k0, i - k0);
    name[i - k0] = 0;
    cJSON *args = gemma_object(s, n, &i, 0);
    if (!args) return 0;
    int rc = skip_ws(s, i, n) == n ? (list_add(l, name, args) ? -1 : 1) : 0;
    cJSON_Delete(args);
    return rc;
}

/* ------------------------------------------------------------------------- */
/* A whole output                                                            */
/* ------------------------------------------------------------------------- */

/* Blocks open .. close after the content; 1 all parsed, 0 some did not, -1 oom. */
static int parse_blocks(call_list *l, const char *t, size_t n, const char *open, const char *close,
                        int gemma) {
    size_t i = 0, ko = strlen(open), kc = strlen(close);
    int any = 0;
    for (;;) {
        i = skip_ws(t, i, n);
        if (i == n) return any;
        if (n - i < ko || memcmp(t + i, open, ko)) return 0; /* text between or after calls */
        i += ko;
        const char *end = find_n(t + i, n - i, close);
        size_t body_end = end ? (size_t)(end - t) : n; /* the last may be cut off by a stop */
        size_t b0 = skip_ws(t, i, body_end), b1 = body_end;
        while (b1 > b0 && (t[b1 - 1] == ' ' || t[b1 - 1] == '\n' || t[b1 - 1] == '\r' || t[b1 - 1] == '\t')) b1--;
        int rc = gemma ? add_gemma_call(l, t + b0, b1 - b0) : add_json_call(l, t + b0, b1 - b0);
        if (rc <= 0) return rc;
        any = 1;
        i = end ? body_end + kc : n;
    }
}

int srv_tool_parse(const char *text, size_t len, const char *req_id, int choice, int parallel,
                   srv_tool_call **calls, int *n_calls, size_t *content_end) {
    *calls = NULL;
    *n_calls = 0;
    *content_end = len;
    call_list l = {NULL, 0, 0, req_id, choice};
    int rc = 0;
    size_t start = len;
    const char *h;
    if ((h = find_n(text, len, "<tool_call>"))) {
        start = (size_t)(h - text);
        rc = parse_blocks(&l, text + start, len - start, "<tool_call>", "</tool_call>", 0);
    } else if ((h = find_n(text, len, "<|tool_call>"))) {
        start = (size_t)(h - text);
        rc = parse_blocks(&l, text + start, len - start, "<|tool_call>", "<tool_call|>", 1);
    } else {
        size_t i = skip_ws(text, 0, len);
        if (len - i >= 14 && !memcmp(text + i, "<|python_tag|>", 14)) i = skip_ws(text, i + 14, len);
        if (i < len && text[i] == '{') {
            /* Llama 3: one object, or several separated by ';' */
            start = 0;
            size_t a = i;
            rc = 1;
            while (a < len && rc == 1) {
                const char *semi = find_n(text + a, len - a, "};");
                size_t b = semi ? (size_t)(semi - text) + 1 : len;
                rc = add_json_call(&l, text + a, b - a);
                a = skip_ws(text, semi ? b + 1 : len, len);
            }
        }
    }
    if (rc < 0) {
        srv_tool_calls_free(l.v, l.n);
        return -1;
    }
    if (rc == 0 || l.n == 0) { /* not calls: all of it is content */
        srv_tool_calls_free(l.v, l.n);
        return 0;
    }
    if (!parallel && l.n > 1) { /* parallel_tool_calls false: the first call only */
        for (int k = 1; k < l.n; k++) {
            free(l.v[k].id);
            free(l.v[k].name);
            free(l.v[k].arguments);
        }
        l.n = 1;
    }
    while (start > 0 && (text[start - 1] == ' ' || text[start - 1] == '\n' || text[start - 1] == '\r' || text[start - 1] == '\t'))
        start--;
    *calls = l.v;
    *n_calls = l.n;
    *content_end = start;
    return 0;
}

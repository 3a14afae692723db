/*
 * json_schema_corpus.h - the fixed corpus of JSON schemas of the structured-output tests
 * (test_json_schema.c, test_engine_choices.c): schema i is drawn by a generator seeded
 * with 2700 + i (the corpus does not change between runs), in the strict subset of
 * src/engine/json_schema.h (objects with all properties required and
 * additionalProperties false, arrays with items, strings, numbers, integers, booleans,
 * null, type lists with null, enums, const); plus a validator for that subset and a
 * generator of random valid instances (keys in the schema's order).
 */
#ifndef TQKV_JSON_SCHEMA_CORPUS_H
#define TQKV_JSON_SCHEMA_CORPUS_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "testutil.h"

#define CORPUS_N 100

static cJSON *corpus_node(test_rng *r, int depth);

static cJSON *corpus_object(test_rng *r, int depth) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "object");
    cJSON *props = cJSON_AddObjectToObject(o, "properties");
    cJSON *req = cJSON_AddArrayToObject(o, "required");
    static const char *const NAMES[] = {"id", "name", "title", "count", "price", "tags", "active",
                                        "kind", "items", "note", "size", "owner", "level", "x", "y"};
    int n = rng_int(r, 1, depth == 0 ? 5 : 3);
    for (int i = 0; i < n; i++) {
        char key[32];
        int w = snprintf(key, sizeof key, "%s%s", NAMES[rng_int(r, 0, 14)], i ? "_" : "");
        if (cJSON_GetObjectItemCaseSensitive(props, key)) snprintf(key + w, sizeof key - (size_t)w, "%d", i % 10);
        cJSON_AddItemToObject(props, key, corpus_node(r, depth + 1));
        cJSON_AddItemToArray(req, cJSON_CreateString(key));
    }
    cJSON_AddFalseToObject(o, "additionalProperties");
    return o;
}

static cJSON *corpus_node(test_rng *r, int depth) {
    int k = rng_int(r, 0, depth >= 3 ? 6 : 8);
    cJSON *o;
    switch (k) {
    case 0: o = cJSON_CreateObject(); cJSON_AddStringToObject(o, "type", "string"); return o;
    case 1: o = cJSON_CreateObject(); cJSON_AddStringToObject(o, "type", "integer"); return o;
    case 2: o = cJSON_CreateObject(); cJSON_AddStringToObject(o, "type", "number"); return o;
    case 3: o = cJSON_CreateObject(); cJSON_AddStringToObject(o, "type", "boolean"); return o;
    case 4: {
        o = cJSON_CreateObject();
        cJSON *t = cJSON_AddArrayToObject(o, "type");
        cJSON_AddItemToArray(t, cJSON_CreateString(rng_int(r, 0, 1) ? "string" : "integer"));
        cJSON_AddItemToArray(t, cJSON_CreateString("null"));
        return o;
    }
    case 5: {
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "string");
        cJSON *e = cJSON_AddArrayToObject(o, "enum");
        static const char *const V[] = {"red", "green", "blue", "small", "large", "on", "off"};
        int n = rng_int(r, 2, 4), start = rng_int(r, 0, 3);
        for (int i = 0; i < n; i++) cJSON_AddItemToArray(e, cJSON_CreateString(V[(start + i) % 7]));
        return o;
    }
    case 6: {
        o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "enum", cJSON_CreateIntArray((const int[]){1, 2, 10, 20}, 4));
        return o;
    }
    case 7: {
        o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "type", "array");
        cJSON_AddItemToObject(o, "items", corpus_node(r, depth + 1));
        return o;
    }
    default: return corpus_object(r, depth);
    }
}

/* Schema i of the corpus (a fresh cJSON tree, root an object). */
static inline cJSON *corpus_schema(int i) {
    test_rng r;
    rng_init(&r, 2700 + (uint64_t)i);
    return corpus_object(&r, 0);
}

static int type_is(const cJSON *v, const char *t) {
    if (!strcmp(t, "string")) return cJSON_IsString(v);
    if (!strcmp(t, "number")) return cJSON_IsNumber(v);
    if (!strcmp(t, "integer")) return cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(t, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(t, "null")) return cJSON_IsNull(v);
    if (!strcmp(t, "object")) return cJSON_IsObject(v);
    if (!strcmp(t, "array")) return cJSON_IsArray(v);
    return 0;
}

/* 1 when v is valid for schema s (the corpus subset). */
static inline int corpus_validate(const cJSON *s, const cJSON *v) {
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    if (en) {
        const cJSON *x;
        cJSON_ArrayForEach(x, en) if (cJSON_Compare(x, v, 1)) return 1;
        return 0;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
    int ok = 0;
    if (cJSON_IsString(t)) ok = type_is(v, t->valuestring);
    else {
        const cJSON *x;
        cJSON_ArrayForEach(x, t) ok |= type_is(v, x->valuestring);
    }
    if (!ok) return 0;
    if (cJSON_IsObject(v)) {
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties"), *p;
        if (!props) return 1;
        if (cJSON_GetArraySize(v) != cJSON_GetArraySize(props)) return 0; /* all, no extra */
        cJSON_ArrayForEach(p, props) {
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(v, p->string);
            if (!x || !corpus_validate(p, x)) return 0;
        }
    }
    if (cJSON_IsArray(v)) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items"), *x;
        cJSON_ArrayForEach(x, v) if (items && !corpus_validate(items, x)) return 0;
    }
    return 1;
}

/* A random valid instance of schema s. */
static inline cJSON *corpus_instance(const cJSON *s, test_rng *r) {
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    if (en) return cJSON_Duplicate(cJSON_GetArrayItem(en, rng_int(r, 0, cJSON_GetArraySize(en) - 1)), 1);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
    const char *ty = cJSON_IsString(t) ? t->valuestring
                                       : cJSON_GetArrayItem(t, rng_int(r, 0, cJSON_GetArraySize(t) - 1))->valuestring;
    if (!strcmp(ty, "string")) {
        char buf[24];
        int n = rng_int(r, 0, 12);
        for (int i = 0; i < n; i++) buf[i] = (char)rng_int(r, 32, 126);
        buf[n] = 0;
        return cJSON_CreateString(buf);
    }
    if (!strcmp(ty, "integer")) return cJSON_CreateNumber(rng_int(r, -500, 500));
    if (!strcmp(ty, "number")) return cJSON_CreateNumber(rng_int(r, -5000, 5000) / 8.0);
    if (!strcmp(ty, "boolean")) return cJSON_CreateBool(rng_int(r, 0, 1));
    if (!strcmp(ty, "null")) return cJSON_CreateNull();
    if (!strcmp(ty, "array")) {
        cJSON *a = cJSON_CreateArray();
        for (int i = rng_int(r, 0, 3); i > 0; i--)
            cJSON_AddItemToArray(a, corpus_instance(cJSON_GetObjectItemCaseSensitive(s, "items"), r));
        return a;
    }
    cJSON *o = cJSON_CreateObject();
    const cJSON *p;
    cJSON_ArrayForEach(p, cJSON_GetObjectItemCaseSensitive(s, "properties"))
        cJSON_AddItemToObject(o, p->string, corpus_instance(p, r));
    return o;
}

#endif

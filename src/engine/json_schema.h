/*
 * json_schema.h - constrained decoding to a JSON Schema (OpenAI's response_format
 * json_schema, strict) and to any JSON object (json_object): the schema is compiled to
 * nodes, a pushdown automaton walks them byte by byte, and the mask over the vocabulary
 * comes from the vocabulary trie of json_grammar.h.
 *
 * The subset (as OpenAI's strict mode): the root is an object; "type" (a name or a list
 * of names: object, array, string, number, integer, boolean, null), "properties",
 * "required", "additionalProperties": false, "items", "enum", "const", and the
 * annotations "title", "description", "$schema", "strict". Objects with properties are
 * written with every property, in the schema's order (strict mode requires them all);
 * an object without properties is any JSON object. Anything else is refused at compile
 * with a message naming the keyword.
 *
 * Owns: js_schema (nodes, a cache of recent states' masks as bitsets and, near a token
 * budget, their allowed tokens sorted by the tokens they need after them), js_state
 * (copied by value: a choice forks with a copy). Must not: sample or schedule; keep global
 * state. js_mask / js_mask_budget use the schema's cache: one caller at a time (the
 * engine's compute thread); js_ref / js_free may come from any thread.
 */
#ifndef TQKV_JSON_SCHEMA_H
#define TQKV_JSON_SCHEMA_H

#include <stdint.h>

#include "engine/json_grammar.h"

#define JS_MAX_DEPTH 12
#define JS_MAX_ENUM 64

typedef struct {
    uint16_t node;
    uint8_t  phase;
    uint8_t  pad;
    uint16_t idx;   /* property index / items so far */
    uint16_t off;   /* bytes of the property name matched */
} js_frame;

typedef struct {
    js_frame f[JS_MAX_DEPTH];
    uint8_t  depth;      /* frames in use; 0 with done = 1: the root value is complete */
    uint8_t  done;
    uint8_t  ws;         /* consecutive whitespace bytes (bounded) */
    uint8_t  scalar;     /* 1: the top frame's value is read by sc */
    uint8_t  integer;    /* the scalar is an integer (no '.', 'e') */
    uint8_t  pad[3];
    uint16_t enum_off;   /* enum: bytes matched */
    uint64_t enum_live;  /* enum: candidates still matching */
    jg_state sc;         /* scalar / free-object sub-automaton */
} js_state;

typedef struct js_schema js_schema;

/* Compile a schema (JSON text); NULL = any JSON object (json_object). TQKV_EINVAL with
 * "json schema: ..." naming what is not supported. */
tqkv_status js_compile(js_schema **out, const char *schema_json, int vocab);
/* Another owner (choices share their request's schema and its mask cache). */
js_schema  *js_ref(js_schema *s);
/* Drop an owner; the last frees. */
void        js_free(js_schema *s);
void        js_init(const js_schema *s, js_state *st);
/* Feed one byte; 1 accepted (st advanced), 0 refused (st unchanged). */
int         js_feed(const js_schema *s, js_state *st, unsigned char c);
int         js_complete(const js_state *st);
/* Set logits [vocab] of tokens that cannot come next to -inf (EOS only when complete). */
void        js_mask(js_schema *s, const jg_vocab *v, const js_state *st, float *logits);
/* The fewest bytes that complete the document from st (0 when complete). */
int         js_min_close(const js_schema *s, const js_state *st);
/* js_mask for a row that may generate `left` more tokens (this one included): near the
 * limit only tokens after which js_min_close still fits in left - 1 are allowed, so the
 * document closes within max_tokens (when max_tokens allows it at all). */
void        js_mask_budget(js_schema *s, const jg_vocab *v, const js_state *st, int left,
                           float *logits);
/* Advance st by token id (EOS / specials: unchanged); 1 accepted, 0 refused. */
int         js_accept(const js_schema *s, const jg_vocab *v, js_state *st, int32_t id);

#endif

/*
 * json_grammar.h - constrained decoding to JSON (OpenAI's response_format json_object):
 * a byte-level pushdown automaton for one JSON object (RFC 8259; strings take any UTF-8
 * byte >= 0x80 as is, control characters refused), and the token mask it gives over a
 * tokenizer's vocabulary: a token is allowed when all its bytes are accepted from the
 * row's state; EOS only once the object is closed, and then only EOS.
 * Owns: jg_state (copied by value: a choice forks with a copy), jg_vocab (token bytes,
 * special and EOS flags, a byte trie so that tokens sharing a prefix share its steps).
 * Must not: sample, schedule, or keep global state. Engine-internal (src/engine only).
 */
#ifndef TQKV_JSON_GRAMMAR_H
#define TQKV_JSON_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

#define JG_MAX_DEPTH 64
#define JG_MAX_WS 6      /* e.g. a newline and five levels of indentation */
#define JG_CACHE 32     /* masks of recent states kept by the vocabulary */

typedef struct {
    uint8_t  mode;      /* jg_mode (json_grammar.c) */
    uint8_t  sub;       /* literal position, \u hex digits left, number sub-state */
    uint8_t  lit;       /* which literal: 0 true, 1 false, 2 null */
    uint8_t  key;       /* the string being read is an object key */
    uint8_t  ws;        /* consecutive whitespace bytes outside strings (at most
                           JG_MAX_WS: a model cannot pad forever) */
    int      depth;     /* open containers */
    uint64_t stack;     /* bit d: container d is an array (1) or object (0) */
} jg_state;

/* The start: whitespace, then one object. */
void jg_init(jg_state *s);
/* Feed one byte; 1 accepted (s advanced), 0 refused (s unchanged). */
int  jg_feed(jg_state *s, unsigned char c);
/* 1 when the object is closed (only EOS may follow). */
int  jg_complete(const jg_state *s);

typedef struct jg_vocab jg_vocab;

/* The vocabulary of model m's tokenizer tok: ids [0, vocab) (model vocab; ids past the
 * tokenizer's are never allowed). */
tqkv_status jg_vocab_init(jg_vocab **out, const tqkv_tokenizer *tok, const tqkv_model *m);
void        jg_vocab_free(jg_vocab *v);
/* Set logits [vocab] of every token not allowed from s to -inf. Uses (and fills) the
 * vocabulary's cache of recent states' masks: one caller at a time. */
void        jg_mask(jg_vocab *v, const jg_state *s, float *logits);
/* The trie walked with any byte automaton: a state of `size` bytes (<= 512) fed by
 * feed(ctx, state, byte) (1 accepted and state advanced, 0 refused); visit(vctx, after, id)
 * for every token whose bytes are all accepted from state (after: the state past them). */
typedef int (*jg_feed_fn)(const void *ctx, void *state, unsigned char c);
typedef void (*jg_visit_fn)(void *vctx, const void *after, int32_t id);
void jg_walk(const jg_vocab *v, const void *state, size_t size, jg_feed_fn feed, const void *ctx,
             jg_visit_fn visit, void *vctx);
/* An ordinary token's length in bytes; 0: special, EOS, beyond the tokenizer. */
int  jg_token_len(const jg_vocab *v, int32_t id);
/* s with the fields its mode does not read cleared (stale sub-states, stack bits above
 * the depth): two states that accept the same bytes in the same way compare equal. */
void jg_canon(const jg_state *s, jg_state *out);
int  jg_vocab_size(const jg_vocab *v);
/* The longest ordinary token, in bytes. */
int  jg_vocab_max_len(const jg_vocab *v);
int  jg_is_eos(const jg_vocab *v, int32_t id);
/* An ordinary token's bytes: 1, or 0 (special, EOS, beyond the tokenizer). */
int  jg_token_bytes(const jg_vocab *v, int32_t id, const char **b, size_t *n);
/* A number read by s (the sub-automaton of a scalar) may end here. */
int  jg_number_can_end(const jg_state *s);
/* The fewest bytes that complete the value s reads (its open string, number, literal,
 * pending key and containers); 0 when complete. */
int  jg_min_close(const jg_state *s);
/* s is inside a string (escapes included). */
int  jg_in_string(const jg_state *s);
/* s starts reading one value at depth 0 (it is complete when the value is). */
void jg_init_value(jg_state *s);

/* Advance s by token id's bytes (EOS and specials: unchanged); 1 accepted, 0 refused. */
int         jg_accept(const jg_vocab *v, jg_state *s, int32_t id);

#endif

/*
 * tokenizer_internal.h - internal layout of tqkv_tokenizer, shared by the tokenizer_*.c
 * files (load, text/unicode helpers, pre-tokenizers, BPE, public calls).
 *
 * Owns: the tokenizer struct, hash maps, piece lists, the regex wrapper (the per-call
 * encoder scratch is private to tokenizer_encode.c). Must not: be included outside
 * src/tokenizer/tokenizer*.c; hold global mutable state (everything lives in a tokenizer or
 * in one encode call's scratch).
 * Internal names are prefixed tkz_. Files: tokenizer_text.c (buffers, maps, UTF-8, regex),
 * tokenizer_load.c (JSON -> tables), tokenizer_encode.c (text -> ids), tokenizer.c
 * (ids -> text, streaming, lookups).
 */
#ifndef TQKV_TOKENIZER_INTERNAL_H
#define TQKV_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "tqkv_tokenizer.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Growable byte buffer and piece lists
// ---------------------------------------------------------------------------

typedef struct {
    char  *p;   // [cap] bytes; p[n] is kept 0 when cap > n (NUL-terminated view)
    size_t n, cap;
} tkz_buf;

tqkv_status tkz_buf_reserve(tkz_buf *b, size_t extra);
tqkv_status tkz_buf_append(tkz_buf *b, const void *d, size_t n);
void        tkz_buf_free(tkz_buf *b);

typedef struct {
    size_t off, len;
} tkz_span;

/* A list of strings stored back to back in one buffer. */
typedef struct {
    tkz_buf   text;  // [total bytes]
    tkz_span *sp;    // [n] pieces into text
    size_t    n, cap;
} tkz_pieces;

tqkv_status tkz_pieces_add(tkz_pieces *p, const char *s, size_t len);
void        tkz_pieces_clear(tkz_pieces *p);
void        tkz_pieces_free(tkz_pieces *p);

// ---------------------------------------------------------------------------
// Hash maps
// ---------------------------------------------------------------------------

/* String -> int32 map; the key bytes live in a caller-owned arena (passed per call,
 * since the arena may move when it grows). Open addressing, power-of-two capacity. */
typedef struct {
    uint64_t hash;  // 0 = empty slot
    size_t   off;   // key bytes at arena + off
    uint32_t len;
    int32_t  val;
} tkz_entry;

typedef struct {
    tkz_entry *e;   // [cap]
    size_t     cap, n;
} tkz_strmap;

/* Insert or overwrite. */
tqkv_status tkz_strmap_put(tkz_strmap *m, const char *arena, size_t off, uint32_t len, int32_t val);
/* -1 when absent. */
int32_t     tkz_strmap_get(const tkz_strmap *m, const char *arena, const char *key, size_t len);
void        tkz_strmap_free(tkz_strmap *m);

/* (left id, right id) -> (rank, merged id). */
typedef struct {
    uint64_t key;   // ((left+1) << 32) | (right+1); 0 = empty
    uint32_t rank;
    int32_t  id;
} tkz_merge;

typedef struct {
    tkz_merge *e;   // [cap]
    size_t     cap, n;
} tkz_mergemap;

tqkv_status      tkz_mergemap_put(tkz_mergemap *m, int32_t a, int32_t b, uint32_t rank, int32_t id);
const tkz_merge *tkz_mergemap_get(const tkz_mergemap *m, int32_t a, int32_t b);
void             tkz_mergemap_free(tkz_mergemap *m);

// ---------------------------------------------------------------------------
// Regex (PCRE2, UTF + UCP, Oniguruma-compatible find_iter)
// ---------------------------------------------------------------------------

typedef struct {
    pcre2_code *code;
    int         jit;    // 1 when JIT-compiled
} tkz_regex;

/* literal: match `pattern` as a plain string (Split/Replace "String" patterns). `what`
 * names the regex in error messages. The pattern is Oniguruma syntax; `\s` is widened
 * to include U+0085 as Oniguruma does. */
tqkv_status tkz_regex_compile(tkz_regex *r, const char *pattern, size_t len, int literal,
                              const char *what);
void        tkz_regex_free(tkz_regex *r);

/* One (start, end, is_match) of a find_matches result: matches and the gaps between
 * them, covering the whole string (HF Pattern::find_matches). */
typedef struct {
    size_t start, end;
    int    is_match;
} tkz_match;

typedef struct {
    tkz_match *m;   // [n]
    size_t     n, cap;
} tkz_matches;

/* HF find_matches of a regex on s[0..len) (Oniguruma find_iter semantics for empty
 * matches). md: match data from pcre2_match_data_create(.., NULL). */
tqkv_status tkz_regex_find_matches(const tkz_regex *r, pcre2_match_data *md, const char *s,
                                   size_t len, tkz_matches *out);

// ---------------------------------------------------------------------------
// Unicode / UTF-8 helpers (tokenizer_text.c)
// ---------------------------------------------------------------------------

/* Strict UTF-8 (no overlongs, surrogates, > U+10FFFF): returns len if valid, else the
 * offset of the first bad byte. */
size_t   tkz_utf8_valid_prefix(const char *s, size_t len);
/* Decode one code point of valid UTF-8 at s (len >= 1): returns its byte length. */
int      tkz_utf8_decode(const char *s, size_t len, int32_t *cp);
int      tkz_utf8_encode(int32_t cp, char out[4]);
/* Rust char::is_whitespace (Unicode White_Space). */
int      tkz_is_whitespace(int32_t cp);
/* Unicode \w of Rust's regex crate (HF single_word): L*, M*, Nd, Nl, Pc, Join_Control
 * (Alphabetic approximated by general category). */
int      tkz_is_word(int32_t cp);
/* Append bytes[0..len) to out with Rust String::from_utf8_lossy replacement. When
 * !final, an incomplete but so-far-valid sequence at the very end is not consumed:
 * returns the number of bytes consumed. */
size_t   tkz_utf8_lossy_append(tkz_buf *out, const char *bytes, size_t len, int final,
                               tqkv_status *st);

// ---------------------------------------------------------------------------
// Normalizers, pre-tokenizers, added tokens, model
// ---------------------------------------------------------------------------

typedef enum {
    TKZ_NORM_NFC, TKZ_NORM_NFD, TKZ_NORM_NFKC, TKZ_NORM_NFKD, TKZ_NORM_LOWERCASE,
    TKZ_NORM_STRIP_ACCENTS, TKZ_NORM_STRIP, TKZ_NORM_REPLACE, TKZ_NORM_PREPEND
} tkz_norm_kind;

typedef struct {
    tkz_norm_kind kind;
    int           left, right;  // Strip
    tkz_regex     re;           // Replace
    char         *content;      // Replace content / Prepend string (malloc'd)
    size_t        content_len;
} tkz_norm_step;

typedef enum { TKZ_PRE_BYTELEVEL, TKZ_PRE_SPLIT, TKZ_PRE_DIGITS } tkz_pre_kind;

typedef enum {
    TKZ_SPLIT_REMOVED, TKZ_SPLIT_ISOLATED, TKZ_SPLIT_MERGED_PREV, TKZ_SPLIT_MERGED_NEXT,
    TKZ_SPLIT_CONTIGUOUS
} tkz_split_behavior;

typedef struct {
    tkz_pre_kind       kind;
    int                add_prefix_space, use_regex;  // ByteLevel
    tkz_regex          re;                           // Split (ByteLevel uses t->gpt2)
    tkz_split_behavior behavior;                     // Split
    int                invert;                       // Split
    int                individual_digits;            // Digits
} tkz_pre_step;

typedef struct {
    size_t   off;       // content bytes in t->arena
    uint32_t len;
    int32_t  id;
    uint8_t  special, lstrip, rstrip, single_word, normalized;
} tkz_added;

/* Patterns of one added-token matching set, sorted by first byte then length desc:
 * pat[first[b] .. first[b+1]) start with byte b. */
typedef struct {
    size_t   off;       // pattern bytes in t->arena
    uint32_t len;
    int      added;     // index into t->added
} tkz_pat;

typedef struct {
    tkz_pat *pat;       // [n]
    int      n;
    int      first[257];
} tkz_matchset;

typedef enum { TKZ_DEC_NONE, TKZ_DEC_BYTELEVEL } tkz_dec_kind;

struct tqkv_tokenizer {
    char       *source;      // file name for messages (malloc'd)
    tkz_buf     arena;       // all token strings, decoded bytes, added-token patterns
    int32_t     n_ids;       // vocab size: 1 + max id
    int32_t     max_vocab_id;// largest id of model.vocab
    tkz_span   *tok;         // [n_ids] token string per id; len SIZE_MAX = no token
    tkz_span   *dec;         // [n_ids] decoder bytes per id
    uint8_t    *special;     // [n_ids] 1 if a special added token
    tkz_strmap  vocab;       // model vocab: token -> id
    tkz_strmap  added_map;   // added token content -> id
    tkz_mergemap merges;

    tkz_added  *added;       // [n_added]
    int         n_added;
    tkz_matchset set_raw;    // normalized = false: matched on the raw text
    tkz_matchset set_norm;   // normalized = true: matched on the normalized text

    tkz_norm_step *norm;     // [n_norm] flattened Sequence
    int            n_norm;
    tkz_pre_step  *pre;      // [n_pre] flattened Sequence
    int            n_pre;
    tkz_regex      gpt2;     // ByteLevel use_regex pattern (code NULL if unused)

    // model BPE
    int32_t     unk_id;      // -1: none
    int         fuse_unk, byte_fallback, ignore_merges;
    char       *cont_prefix; // continuing_subword_prefix or NULL
    char       *eow_suffix;  // end_of_word_suffix or NULL
    int32_t     byte_fb[256];// "<0xXX>" ids for byte_fallback (-1 missing)

    tkz_dec_kind decoder;
    int32_t    *post_prefix; // [n_post_prefix] ids added by the post-processor
    int32_t    *post_suffix; // [n_post_suffix]
    int         n_post_prefix, n_post_suffix;
    char       *post_unsupported; // type name when the post-processor is unsupported

    int32_t     eos, bos, pad;
    char       *chat_template;

    // ByteLevel byte <-> char tables
    char        byte_utf8[256][3];  // UTF-8 of the char for byte b, NUL-terminated
    uint8_t     byte_utf8_len[256];
    int16_t     char_byte[512];     // code point (< 512) -> byte, -1 if not a byte char
};

/* tokenizer_encode.c. Normalize s into out (tmp: scratch); mm: scratch matches. Also used
 * by the loader to normalize the patterns of normalized added tokens. */
tqkv_status tkz_normalize(const tqkv_tokenizer *t, pcre2_match_data *md, tkz_matches *mm,
                          const char *s, size_t len, tkz_buf *out, tkz_buf *tmp);

#endif

/*
 * tqkv_tokenizer.h - public API of the tokenizer: a Hugging Face tokenizer.json
 * (byte-level BPE) tokenizer whose ids equal those of HF `tokenizers`.
 *
 * Owns: the tokenizer boundary: load, encode, decode, streaming decode, lookups.
 * Must not: expose internal layout, keep global mutable state. Every call returns a
 * tqkv_status (see tqkv.h); on failure the message is in tqkv_last_error() and the
 * object is unchanged. A loaded tokenizer is read-only: encode/decode/lookups take a
 * const pointer and may be called from several threads at once (each call keeps its
 * own word cache). A decode stream belongs to one thread.
 *
 * Pipeline of encode (HF `tokenizers` 0.2x semantics, checked against 0.23.2):
 *   1. added tokens are split out first: those with normalized=false are matched on the
 *      raw text, the others on the normalized text, leftmost-longest, honouring lstrip /
 *      rstrip (Unicode White_Space), single_word (regex \w boundaries) and special (see
 *      TQKV_ENCODE_SPECIAL_AS_TEXT). Ids follow HF's AddedVocabulary: a token whose
 *      content is already in the vocab gets that id, a new one the next id after the
 *      vocab; id -> token of a normalized added token is its normalized content;
 *   2. normalizer: NFC, NFD, NFKC, NFKD, Lowercase, StripAccents, Strip, Replace (String
 *      or Regex), Prepend, Sequence of those, or none;
 *   3. pre-tokenizer: ByteLevel (add_prefix_space, use_regex with the GPT-2 pattern),
 *      Split (String or Regex pattern; Removed / Isolated / MergedWithPrevious /
 *      MergedWithNext / Contiguous; invert), Digits, Sequence of those, or none.
 *      Regexes are Oniguruma syntax run on PCRE2 (UTF + UCP; ^/$ match at lines);
 *   4. model BPE: merges by rank (lowest first, leftmost on ties, as HF's heap), a
 *      per-call word cache, ignore_merges, byte_fallback, unk_token / fuse_unk,
 *      continuing_subword_prefix, end_of_word_suffix; merges as "a b" or [a, b];
 *   5. post-processor, only with TQKV_ENCODE_ADD_SPECIAL: TemplateProcessing (single),
 *      BertProcessing / RobertaProcessing (cls ... sep), ByteLevel (no-op), Sequence.
 * Decoder: ByteLevel, or none (tokens joined by " " as HF does). decode output is valid
 * UTF-8: invalid byte sequences become U+FFFD exactly as Rust's String::from_utf8_lossy.
 *
 * Not supported (TQKV_EUNSUPPORTED naming the type): models other than BPE (WordPiece,
 * Unigram, WordLevel), BPE dropout, normalizers BertNormalizer / Precompiled / NMT /
 * pre-tokenizers Metaspace / Whitespace / Punctuation
 * / BertPreTokenizer / CharDelimiterSplit / UnicodeScripts, decoders other than
 * ByteLevel; other post-processors only fail when TQKV_ENCODE_ADD_SPECIAL asks for them.
 * truncation / padding in tokenizer.json are ignored. Pairs of sequences are not encoded.
 * Known differences from HF: character classes come from PCRE2's and utf8proc's Unicode
 * tables (14.0 / 15.0 here), so code points assigned or re-categorized in other Unicode
 * versions (e.g. CJK Ext H/I, Unicode 16 scripts) may split or normalize differently, and
 * StripAccents removes every Mn/Mc/Me mark (HF's table is older).
 *
 * Ids are int32_t. Arrays returned through `**out` are malloc'd: free() them.
 */
#ifndef TQKV_TOKENIZER_H
#define TQKV_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tqkv_tokenizer tqkv_tokenizer;

/* ------------------------------------------------------------------------- */
/* Load / free                                                                */
/* ------------------------------------------------------------------------- */

/* From a model directory: DIR/tokenizer.json (required), DIR/tokenizer_config.json
 * (optional: eos_token / bos_token / pad_token names, chat_template) and
 * DIR/chat_template.jinja (optional; takes precedence over the config's template).
 * A path to a tokenizer.json file instead of a directory works like _load_file.
 * Errors: TQKV_EIO (missing/unreadable file), TQKV_ECORRUPT (malformed JSON, with file
 * and line:column; or a structurally invalid tokenizer), TQKV_EUNSUPPORTED. */
TQKV_API tqkv_status tqkv_tokenizer_load(tqkv_tokenizer **out, const char *model_dir);
/* From a tokenizer.json path alone (no config: eos/bos/pad are -1, no chat template). */
TQKV_API tqkv_status tqkv_tokenizer_load_file(tqkv_tokenizer **out, const char *tokenizer_json);
/* From tokenizer.json bytes in memory; `name` is used in error messages. */
TQKV_API tqkv_status tqkv_tokenizer_load_json(tqkv_tokenizer **out, const char *json, size_t len,
                                              const char *name);
TQKV_API void        tqkv_tokenizer_free(tqkv_tokenizer *t);

/* ------------------------------------------------------------------------- */
/* Encode / decode                                                            */
/* ------------------------------------------------------------------------- */

enum {
    /* Apply the post-processor (e.g. a BOS from TemplateProcessing). HF's
     * add_special_tokens=True. Off by default: plain text -> ids. */
    TQKV_ENCODE_ADD_SPECIAL = 1u << 0,
    /* Treat special added tokens in the text as plain text (HF encode_special_tokens).
     * Non-special added tokens are still split out. */
    TQKV_ENCODE_SPECIAL_AS_TEXT = 1u << 1,
};

/* text: `len` bytes of UTF-8 (need not be NUL-terminated; invalid UTF-8 is TQKV_EINVAL
 * naming the byte offset). *ids: [*n_ids] malloc'd (NULL when *n_ids == 0). */
TQKV_API tqkv_status tqkv_tokenizer_encode(const tqkv_tokenizer *t, const char *text, size_t len,
                                           unsigned flags, int32_t **ids, size_t *n_ids);

enum {
    TQKV_DECODE_SKIP_SPECIAL = 1u << 0, /* drop special added tokens (HF skip_special_tokens) */
};

/* ids: [n] -> *out: malloc'd, NUL-terminated, valid UTF-8, *out_len bytes (without the
 * NUL; out_len may be NULL). An id with no token is TQKV_ERANGE. */
TQKV_API tqkv_status tqkv_tokenizer_decode(const tqkv_tokenizer *t, const int32_t *ids, size_t n,
                                           unsigned flags, char **out, size_t *out_len);

/* ------------------------------------------------------------------------- */
/* Streaming decode: push ids one at a time, get back only complete UTF-8      */
/* ------------------------------------------------------------------------- */
/* The concatenation of every push's output and the final flush equals
 * tqkv_tokenizer_decode() of all ids pushed; every chunk is valid UTF-8 on its own (an
 * incomplete trailing multi-byte sequence is held back until it completes or flush). */

typedef struct tqkv_decode_stream tqkv_decode_stream;

/* flags: TQKV_DECODE_*. The tokenizer must outlive the stream. */
TQKV_API tqkv_status tqkv_decode_stream_init(tqkv_decode_stream **out, const tqkv_tokenizer *t,
                                             unsigned flags);
TQKV_API void        tqkv_decode_stream_free(tqkv_decode_stream *s);
/* *text: [*len] bytes (NUL-terminated) owned by the stream, valid until the next call
 * on it; *len may be 0. An id with no token is TQKV_ERANGE and changes nothing. */
TQKV_API tqkv_status tqkv_decode_stream_push(tqkv_decode_stream *s, int32_t id, const char **text,
                                             size_t *len);
/* Emits what is held back (an incomplete sequence becomes U+FFFD) and resets the
 * stream to its initial state, ready for a new sequence. */
TQKV_API tqkv_status tqkv_decode_stream_flush(tqkv_decode_stream *s, const char **text,
                                              size_t *len);

/* ------------------------------------------------------------------------- */
/* Lookups                                                                    */
/* ------------------------------------------------------------------------- */

/* Number of id slots: 1 + the largest id of the model vocab and the added tokens. */
TQKV_API int32_t     tqkv_tokenizer_vocab_size(const tqkv_tokenizer *t);
/* Token string -> id (added tokens first, then the model vocab). Not found: TQKV_EINVAL. */
TQKV_API tqkv_status tqkv_tokenizer_token_to_id(const tqkv_tokenizer *t, const char *token,
                                                size_t len, int32_t *id);
/* id -> token string as stored in the vocab (e.g. "Ġworld"); *piece is owned by the
 * tokenizer and NUL-terminated. No such id: TQKV_ERANGE. */
TQKV_API tqkv_status tqkv_tokenizer_id_to_token(const tqkv_tokenizer *t, int32_t id,
                                                const char **piece, size_t *len);
/* id -> the bytes the decoder makes of it alone (may be part of a UTF-8 character);
 * *bytes is owned by the tokenizer. No such id: TQKV_ERANGE. */
TQKV_API tqkv_status tqkv_tokenizer_id_bytes(const tqkv_tokenizer *t, int32_t id,
                                             const char **bytes, size_t *len);
/* 1 if id is a special added token, else 0 (also for invalid ids). */
TQKV_API int         tqkv_tokenizer_is_special(const tqkv_tokenizer *t, int32_t id);
/* From tokenizer_config.json; -1 when absent or not in the vocab. */
TQKV_API int32_t     tqkv_tokenizer_eos_id(const tqkv_tokenizer *t);
TQKV_API int32_t     tqkv_tokenizer_bos_id(const tqkv_tokenizer *t);
TQKV_API int32_t     tqkv_tokenizer_pad_id(const tqkv_tokenizer *t);
/* Jinja chat template (chat_template.jinja, else tokenizer_config.json), or NULL. */
TQKV_API const char *tqkv_tokenizer_chat_template(const tqkv_tokenizer *t);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_TOKENIZER_H */

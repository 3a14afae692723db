/*
 * tokenizer.c - ids -> text (whole and streaming) and vocab lookups.
 *
 * Owns: tqkv_tokenizer_decode, the tqkv_decode_stream object, token/id lookups and the
 * config getters. Must not: parse files, encode, hold global mutable state.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

// ---------------------------------------------------------------------------
// Lookups
// ---------------------------------------------------------------------------

static int has_token(const tqkv_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->tok[id].len != SIZE_MAX;
}

static tqkv_status bad_id(const tqkv_tokenizer *t, const char *fn, int32_t id) {
    if (id < 0 || id >= t->n_ids)
        return tqkv_fail(TQKV_ERANGE, "%s: token id %d out of range [0, %d)", fn, id, t->n_ids);
    return tqkv_fail(TQKV_ERANGE, "%s: token id %d has no token in the vocab", fn, id);
}

int32_t tqkv_tokenizer_vocab_size(const tqkv_tokenizer *t) { return t ? t->n_ids : 0; }

tqkv_status tqkv_tokenizer_token_to_id(const tqkv_tokenizer *t, const char *token, size_t len,
                                       int32_t *id) {
    if (!t || (!token && len) || !id) return tqkv_fail(TQKV_EINVAL, "tokenizer_token_to_id: NULL argument");
    if (!token) token = ""; /* (NULL, 0): the empty string, never NULL into memcmp */
    int32_t v = tkz_strmap_get(&t->added_map, t->arena.p, token, len);
    if (v < 0) v = tkz_strmap_get(&t->vocab, t->arena.p, token, len);
    if (v < 0)
        return tqkv_fail(TQKV_EINVAL, "tokenizer_token_to_id: '%.*s' is not in the vocab",
                         (int)(len > 64 ? 64 : len), token);
    *id = v;
    return TQKV_OK;
}

tqkv_status tqkv_tokenizer_id_to_token(const tqkv_tokenizer *t, int32_t id, const char **piece,
                                       size_t *len) {
    if (!t || !piece) return tqkv_fail(TQKV_EINVAL, "tokenizer_id_to_token: NULL argument");
    if (!has_token(t, id)) return bad_id(t, "tokenizer_id_to_token", id);
    *piece = t->arena.p + t->tok[id].off;
    if (len) *len = t->tok[id].len;
    return TQKV_OK;
}

tqkv_status tqkv_tokenizer_id_bytes(const tqkv_tokenizer *t, int32_t id, const char **bytes,
                                    size_t *len) {
    if (!t || !bytes || !len) return tqkv_fail(TQKV_EINVAL, "tokenizer_id_bytes: NULL argument");
    if (!has_token(t, id)) return bad_id(t, "tokenizer_id_bytes", id);
    *bytes = t->arena.p + t->dec[id].off;
    *len = t->dec[id].len;
    return TQKV_OK;
}

int tqkv_tokenizer_is_special(const tqkv_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_ids && t->special[id];
}

int32_t tqkv_tokenizer_eos_id(const tqkv_tokenizer *t) { return t ? t->eos : -1; }
int32_t tqkv_tokenizer_bos_id(const tqkv_tokenizer *t) { return t ? t->bos : -1; }
int32_t tqkv_tokenizer_pad_id(const tqkv_tokenizer *t) { return t ? t->pad : -1; }
const char *tqkv_tokenizer_chat_template(const tqkv_tokenizer *t) { return t ? t->chat_template : NULL; }

// ---------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------

/* Raw decoder bytes of one id (with the " " joiner when there is no decoder). */
static tqkv_status append_raw(const tqkv_tokenizer *t, int32_t id, int first, tkz_buf *raw) {
    if (t->decoder == TKZ_DEC_NONE && !first) {
        tqkv_status st = tkz_buf_append(raw, " ", 1);
        if (st) return st;
    }
    return tkz_buf_append(raw, t->arena.p + t->dec[id].off, t->dec[id].len);
}

tqkv_status tqkv_tokenizer_decode(const tqkv_tokenizer *t, const int32_t *ids, size_t n,
                                  unsigned flags, char **out, size_t *out_len) {
    if (!t || (!ids && n) || !out) return tqkv_fail(TQKV_EINVAL, "tokenizer_decode: NULL argument");
    if (flags & ~(unsigned)TQKV_DECODE_SKIP_SPECIAL)
        return tqkv_fail(TQKV_EINVAL, "tokenizer_decode: unknown flags 0x%x", flags);
    for (size_t i = 0; i < n; i++)
        if (!has_token(t, ids[i]))
            return tqkv_fail(TQKV_ERANGE, "tokenizer_decode: token id %d at position %zu %s (vocab size %d)",
                             ids[i], i, ids[i] < 0 || ids[i] >= t->n_ids ? "is out of range" : "has no token",
                             t->n_ids);
    tkz_buf raw = {0}, txt = {0};
    tqkv_status st = tkz_buf_append(&raw, "", 0);
    int first = 1;
    for (size_t i = 0; i < n && !st; i++) {
        if ((flags & TQKV_DECODE_SKIP_SPECIAL) && t->special[ids[i]]) continue;
        st = append_raw(t, ids[i], first, &raw);
        first = 0;
    }
    if (!st) tkz_utf8_lossy_append(&txt, raw.p, raw.n, 1, &st);
    tkz_buf_free(&raw);
    if (st) {
        tkz_buf_free(&txt);
        return st;
    }
    *out = txt.p;
    if (out_len) *out_len = txt.n;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Streaming decode
// ---------------------------------------------------------------------------

struct tqkv_decode_stream {
    const tqkv_tokenizer *t;
    unsigned flags;
    int      first;       // no token emitted yet (for the " " joiner)
    char     pending[4];  // held-back incomplete UTF-8 sequence
    size_t   n_pending;
    tkz_buf  raw;         // pending + new bytes
    tkz_buf  out;         // what the last call returned
};

tqkv_status tqkv_decode_stream_init(tqkv_decode_stream **out, const tqkv_tokenizer *t,
                                    unsigned flags) {
    if (!out || !t) return tqkv_fail(TQKV_EINVAL, "decode_stream_init: NULL argument");
    if (flags & ~(unsigned)TQKV_DECODE_SKIP_SPECIAL)
        return tqkv_fail(TQKV_EINVAL, "decode_stream_init: unknown flags 0x%x", flags);
    tqkv_decode_stream *s = calloc(1, sizeof *s);
    if (!s) return tqkv_fail(TQKV_ENOMEM, "decode_stream_init: out of memory");
    s->t = t;
    s->flags = flags;
    s->first = 1;
    if (tkz_buf_reserve(&s->out, 64) || tkz_buf_reserve(&s->raw, 64)) {
        tqkv_decode_stream_free(s);
        return TQKV_ENOMEM;
    }
    s->out.p[0] = 0;
    *out = s;
    return TQKV_OK;
}

void tqkv_decode_stream_free(tqkv_decode_stream *s) {
    if (!s) return;
    tkz_buf_free(&s->raw);
    tkz_buf_free(&s->out);
    free(s);
}

tqkv_status tqkv_decode_stream_push(tqkv_decode_stream *s, int32_t id, const char **text,
                                    size_t *len) {
    if (!s || !text || !len) return tqkv_fail(TQKV_EINVAL, "decode_stream_push: NULL argument");
    const tqkv_tokenizer *t = s->t;
    if (!has_token(t, id)) return bad_id(t, "decode_stream_push", id);
    s->out.n = 0;
    s->out.p[0] = 0;
    if ((s->flags & TQKV_DECODE_SKIP_SPECIAL) && t->special[id]) {
        *text = s->out.p;
        *len = 0;
        return TQKV_OK;
    }
    s->raw.n = 0;
    tqkv_status st = tkz_buf_append(&s->raw, s->pending, s->n_pending);
    if (!st) st = append_raw(t, id, s->first, &s->raw);
    size_t used = 0;
    if (!st) used = tkz_utf8_lossy_append(&s->out, s->raw.p, s->raw.n, 0, &st);
    if (st) {
        s->out.n = 0;
        s->out.p[0] = 0;
        return st;
    }
    // what is left is an incomplete sequence: at most 3 bytes
    s->n_pending = s->raw.n - used;
    memcpy(s->pending, s->raw.p + used, s->n_pending);
    s->first = 0;
    *text = s->out.p;
    *len = s->out.n;
    return TQKV_OK;
}

tqkv_status tqkv_decode_stream_flush(tqkv_decode_stream *s, const char **text, size_t *len) {
    if (!s || !text || !len) return tqkv_fail(TQKV_EINVAL, "decode_stream_flush: NULL argument");
    s->out.n = 0;
    tqkv_status st = TQKV_OK;
    tkz_utf8_lossy_append(&s->out, s->pending, s->n_pending, 1, &st);
    if (st) {
        s->out.n = 0;
        s->out.p[0] = 0;
        return st;
    }
    s->n_pending = 0;
    s->first = 1;
    *text = s->out.p;
    *len = s->out.n;
    return TQKV_OK;
}

/*
 * tokenizer_encode.c - text -> ids: added-token split, normalizers, pre-tokenizers,
 * byte-level mapping and BPE, following HF `tokenizers` step by step.
 *
 * Owns: tqkv_tokenizer_encode and the pipeline behind it. Must not: change the
 * tokenizer (all scratch, the word cache included, lives in one call's tkz_encoder),
 * parse JSON, hold global mutable state.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tokenizer_internal.h"

// ---------------------------------------------------------------------------
// Output and scratch
// ---------------------------------------------------------------------------

struct tkz_sym {
    int32_t  id;
    int32_t  prev, next;  // -1 = none
    uint32_t len;         // bytes; 0 = merged away
};

struct tkz_heap_e {
    uint32_t rank;
    uint32_t pos;
    int32_t  id;
};

enum { TKZ_CACHE_MAX_WORD = 256, TKZ_CACHE_MAX_ENTRIES = 1 << 20 };

/* Scratch of one encode call (word cache included): nothing in the tokenizer changes. */
typedef struct {
    const tqkv_tokenizer *t;
    unsigned          flags;
    int32_t          *ids;       // [n] output
    size_t            n, cap;
    pcre2_match_data *md;
    tkz_pieces        pa, pb;    // pre-tokenizer ping-pong
    tkz_buf           tmp;       // scratch
    tkz_matches       matches;   // find_matches results
    tkz_matches       matches2;  // split behavior results
    // BPE scratch
    struct tkz_sym   *sym;       // [sym_cap]
    size_t            sym_cap;
    struct tkz_heap_e *heap;     // [heap_cap]
    size_t            heap_cap;
    // word cache: word bytes -> ids
    tkz_strmap        cache;
    tkz_buf           cache_keys;
    int32_t          *cache_ids; // pool
    size_t            cache_ids_n, cache_ids_cap;
    tkz_span         *cache_val; // [cache entries] span into cache_ids
    size_t            cache_val_n, cache_val_cap;
} tkz_encoder;

static tqkv_status tkz_push_id(tkz_encoder *e, int32_t id) {
    if (e->n == e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 256;
        int32_t *p = realloc(e->ids, cap * sizeof *p);
        if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (%zu ids)", cap);
        e->ids = p;
        e->cap = cap;
    }
    e->ids[e->n++] = id;
    return TQKV_OK;
}

static void tkz_encoder_free(tkz_encoder *e) {
    free(e->ids);
    if (e->md) pcre2_match_data_free(e->md);
    tkz_pieces_free(&e->pa);
    tkz_pieces_free(&e->pb);
    tkz_buf_free(&e->tmp);
    free(e->matches.m);
    free(e->matches2.m);
    free(e->sym);
    free(e->heap);
    tkz_strmap_free(&e->cache);
    tkz_buf_free(&e->cache_keys);
    free(e->cache_ids);
    free(e->cache_val);
    memset(e, 0, sizeof *e);
}

// ---------------------------------------------------------------------------
// Normalizers
// ---------------------------------------------------------------------------

/* HF NormalizedString::lowercase: Rust char::to_lowercase per char (no final-sigma
 * context); U+0130 is the one multi-char mapping. */
static tqkv_status lowercase(const char *s, size_t len, tkz_buf *out) {
    tqkv_status st = tkz_buf_reserve(out, len + 16);
    for (size_t i = 0; i < len && !st;) {
        int32_t c;
        int n = tkz_utf8_decode(s + i, len - i, &c);
        char u[8];
        int un;
        if (c < 0x80) {
            u[0] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
            un = 1;
        } else if (c == 0x130) {
            un = tkz_utf8_encode('i', u);
            un += tkz_utf8_encode(0x307, u + un);
        } else {
            un = tkz_utf8_encode(utf8proc_tolower(c), u);
        }
        st = tkz_buf_append(out, u, (size_t)un);
        i += (size_t)n;
    }
    return st;
}

static tqkv_status norm_step(const tkz_norm_step *ns, pcre2_match_data *md, tkz_matches *mm,
                             const char *s, size_t len, tkz_buf *out) {
    tqkv_status st = TQKV_OK;
    switch (ns->kind) {
    case TKZ_NORM_NFC: case TKZ_NORM_NFD: case TKZ_NORM_NFKC: case TKZ_NORM_NFKD: {
        if (!len) return tkz_buf_append(out, "", 0);
        utf8proc_option_t o = ns->kind == TKZ_NORM_NFC   ? UTF8PROC_COMPOSE
                              : ns->kind == TKZ_NORM_NFD ? UTF8PROC_DECOMPOSE
                              : ns->kind == TKZ_NORM_NFKC
                                  ? (utf8proc_option_t)(UTF8PROC_COMPOSE | UTF8PROC_COMPAT)
                                  : (utf8proc_option_t)(UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &dst, o);
        if (n < 0) {
            free(dst);
            return tqkv_fail(n == UTF8PROC_ERROR_NOMEM ? TQKV_ENOMEM : TQKV_EINVAL,
                             "tokenizer: unicode normalization failed: %s", utf8proc_errmsg(n));
        }
        st = tkz_buf_append(out, dst, (size_t)n);
        free(dst);
        return st;
    }
    case TKZ_NORM_LOWERCASE:
        return lowercase(s, len, out);
    case TKZ_NORM_STRIP_ACCENTS:
        st = tkz_buf_reserve(out, len);
        for (size_t i = 0; i < len && !st;) {
            int32_t c;
            int n = tkz_utf8_decode(s + i, len - i, &c);
            utf8proc_category_t k = c < 0x300 ? UTF8PROC_CATEGORY_CN : utf8proc_category(c);
            if (k != UTF8PROC_CATEGORY_MN && k != UTF8PROC_CATEGORY_MC && k != UTF8PROC_CATEGORY_ME)
                st = tkz_buf_append(out, s + i, (size_t)n);
            i += (size_t)n;
        }
        return st ? st : tkz_buf_append(out, "", 0);
    case TKZ_NORM_STRIP: {
        size_t a = 0, b = len;
        while (ns->left && a < b) {
            int32_t c;
            int n = tkz_utf8_decode(s + a, b - a, &c);
            if (!tkz_is_whitespace(c)) break;
            a += (size_t)n;
        }
        while (ns->right && b > a) {
            size_t k = b - 1;
            while (k > a && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
            int32_t c;
            tkz_utf8_decode(s + k, b - k, &c);
            if (!tkz_is_whitespace(c)) break;
            b = k;
        }
        return tkz_buf_append(out, s + a, b - a);
    }
    case TKZ_NORM_REPLACE:
        st = tkz_regex_find_matches(&ns->re, md, s, len, mm);
        for (size_t i = 0; i < mm->n && !st; i++) {
            const tkz_match *m = &mm->m[i];
            st = m->is_match ? tkz_buf_append(out, ns->content, ns->content_len)
                             : tkz_buf_append(out, s + m->start, m->end - m->start);
        }
        return st ? st : tkz_buf_append(out, "", 0);
    case TKZ_NORM_PREPEND:
        if (len) st = tkz_buf_append(out, ns->content, ns->content_len);
        return st ? st : tkz_buf_append(out, s, len);
    }
    return tqkv_fail(TQKV_EINVAL, "tokenizer: bad normalizer step");
}

tqkv_status tkz_normalize(const tqkv_tokenizer *t, pcre2_match_data *md, tkz_matches *mm,
                          const char *s, size_t len, tkz_buf *out, tkz_buf *tmp) {
    out->n = 0;
    tqkv_status st = tkz_buf_append(out, s, len);
    for (int k = 0; k < t->n_norm && !st; k++) {
        tmp->n = 0;
        st = norm_step(&t->norm[k], md, mm, out->p, out->n, tmp);
        if (!st) {
            tkz_buf x = *out;
            *out = *tmp;
            *tmp = x;
        }
    }
    return st;
}

// ---------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------

/* Append s mapped byte by byte to ByteLevel chars, as one piece. */
static tqkv_status add_bytelevel(const tqkv_tokenizer *t, tkz_pieces *p, const char *s, size_t len) {
    tqkv_status st = tkz_pieces_add(p, "", 0);
    if (st) return st;
    st = tkz_buf_reserve(&p->text, 2 * len);
    if (st) return st;
    char *o = p->text.p + p->text.n;
    for (size_t i = 0; i < len; i++) {
        uint8_t b = (uint8_t)s[i];
        o[0] = t->byte_utf8[b][0];
        if (t->byte_utf8_len[b] == 2) { o[1] = t->byte_utf8[b][1]; o += 2; }
        else o += 1;
    }
    size_t n = (size_t)(o - (p->text.p + p->text.n));
    p->text.n += n;
    p->text.p[p->text.n] = 0;
    p->sp[p->n - 1].len = n;
    return TQKV_OK;
}

/* Apply a split behavior to matches and add the kept, non-empty pieces. */
static tqkv_status split_emit(tkz_encoder *e, const tkz_matches *mm, tkz_split_behavior bh,
                              const char *s, tkz_pieces *out) {
    tkz_matches *o = &e->matches2;
    o->n = 0;
    if (o->cap < mm->n) {
        tkz_match *m = realloc(o->m, mm->n * sizeof *m);
        if (!m) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (splits)");
        o->m = m;
        o->cap = mm->n;
    }
    // o->m[k].is_match now means "remove"
    if (bh == TKZ_SPLIT_ISOLATED || bh == TKZ_SPLIT_REMOVED) {
        for (size_t i = 0; i < mm->n; i++) {
            o->m[o->n] = mm->m[i];
            o->m[o->n].is_match = bh == TKZ_SPLIT_REMOVED ? mm->m[i].is_match : 0;
            o->n++;
        }
    } else if (bh == TKZ_SPLIT_CONTIGUOUS || bh == TKZ_SPLIT_MERGED_PREV) {
        int prev = 0;
        for (size_t i = 0; i < mm->n; i++) {
            int m = mm->m[i].is_match;
            int merge = bh == TKZ_SPLIT_CONTIGUOUS ? m == prev : (m && !prev);
            if (merge && o->n) {
                o->m[o->n - 1].end = mm->m[i].end;
            } else {
                o->m[o->n] = mm->m[i];
                o->m[o->n].is_match = 0;
                o->n++;
            }
            prev = m;
        }
    } else {  // MergedWithNext: right to left, then reverse
        int prev = 0;
        for (size_t i = mm->n; i-- > 0;) {
            int m = mm->m[i].is_match;
            if (m && !prev && o->n) {
                o->m[o->n - 1].start = mm->m[i].start;
            } else {
                o->m[o->n] = mm->m[i];
                o->m[o->n].is_match = 0;
                o->n++;
            }
            prev = m;
        }
        for (size_t i = 0; i < o->n / 2; i++) {
            tkz_match x = o->m[i];
            o->m[i] = o->m[o->n - 1 - i];
            o->m[o->n - 1 - i] = x;
        }
    }
    for (size_t i = 0; i < o->n; i++) {
        if (o->m[i].is_match || o->m[i].end == o->m[i].start) continue;
        tqkv_status st = tkz_pieces_add(out, s + o->m[i].start, o->m[i].end - o->m[i].start);
        if (st) return st;
    }
    return TQKV_OK;
}

/* Digits: every numeric char (Rust char::is_numeric: Nd, Nl, No) is its own match (HF
 * char-predicate pattern). */
static int is_numeric(int32_t c) {
    if (c < 0x80) return c >= '0' && c <= '9';
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

static tqkv_status digit_matches(const char *s, size_t len, tkz_matches *mm) {
    mm->n = 0;
    size_t need = 2 * len + 1;
    if (mm->cap < need) {
        tkz_match *m = realloc(mm->m, need * sizeof *m);
        if (!m) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (digits)");
        mm->m = m;
        mm->cap = need;
    }
    if (!len) {
        mm->m[mm->n++] = (tkz_match){0, 0, 0};
        return TQKV_OK;
    }
    size_t last = 0;
    for (size_t i = 0; i < len;) {
        int32_t c;
        size_t n = (size_t)tkz_utf8_decode(s + i, len - i, &c);
        if (is_numeric(c)) {
            if (last < i) mm->m[mm->n++] = (tkz_match){last, i, 0};
            mm->m[mm->n++] = (tkz_match){i, i + n, 1};
            last = i + n;
        }
        i += n;
    }
    if (last < len) mm->m[mm->n++] = (tkz_match){last, len, 0};
    return TQKV_OK;
}

static tqkv_status pre_step(tkz_encoder *e, const tkz_pre_step *ps, const char *s, size_t len,
                            tkz_pieces *out) {
    const tqkv_tokenizer *t = e->t;
    tqkv_status st = TQKV_OK;
    if (ps->kind == TKZ_PRE_BYTELEVEL) {
        if (ps->add_prefix_space && (len == 0 || s[0] != ' ')) {
            e->tmp.n = 0;
            st = tkz_buf_append(&e->tmp, " ", 1);
            if (!st) st = tkz_buf_append(&e->tmp, s, len);
            if (st) return st;
            s = e->tmp.p;
            len = e->tmp.n;
        }
        if (!ps->use_regex) return len ? add_bytelevel(t, out, s, len) : TQKV_OK;
        st = tkz_regex_find_matches(&t->gpt2, e->md, s, len, &e->matches);
        for (size_t i = 0; i < e->matches.n && !st; i++) {
            const tkz_match *m = &e->matches.m[i];
            if (m->end > m->start) st = add_bytelevel(t, out, s + m->start, m->end - m->start);
        }
        return st;
    }
    if (ps->kind == TKZ_PRE_SPLIT) {
        st = tkz_regex_find_matches(&ps->re, e->md, s, len, &e->matches);
        if (st) return st;
        if (ps->invert)
            for (size_t i = 0; i < e->matches.n; i++) e->matches.m[i].is_match ^= 1;
        return split_emit(e, &e->matches, ps->behavior, s, out);
    }
    st = digit_matches(s, len, &e->matches);  // TKZ_PRE_DIGITS
    if (st) return st;
    return split_emit(e, &e->matches,
                      ps->individual_digits ? TKZ_SPLIT_ISOLATED : TKZ_SPLIT_CONTIGUOUS, s, out);
}

/* Pre-tokenize s into e->pa (pieces are the words given to the model). */
static tqkv_status tkz_pretokenize(tkz_encoder *e, const char *s, size_t len) {
    const tqkv_tokenizer *t = e->t;
    tkz_pieces_clear(&e->pa);
    if (!len) return TQKV_OK;
    tqkv_status st = tkz_pieces_add(&e->pa, s, len);
    for (int k = 0; k < t->n_pre && !st; k++) {
        tkz_pieces_clear(&e->pb);
        for (size_t i = 0; i < e->pa.n && !st; i++)
            st = pre_step(e, &t->pre[k], e->pa.text.p + e->pa.sp[i].off, e->pa.sp[i].len, &e->pb);
        tkz_pieces x = e->pa;
        e->pa = e->pb;
        e->pb = x;
    }
    return st;
}

// ---------------------------------------------------------------------------
// BPE
// ---------------------------------------------------------------------------

static tqkv_status sym_add(tkz_encoder *e, size_t *n, int32_t id, uint32_t len) {
    if (*n == e->sym_cap) {
        size_t cap = e->sym_cap ? e->sym_cap * 2 : 64;
        struct tkz_sym *p = realloc(e->sym, cap * sizeof *p);
        if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (BPE symbols)");
        e->sym = p;
        e->sym_cap = cap;
    }
    struct tkz_sym *y = &e->sym[*n];
    y->id = id;
    y->len = len;
    y->prev = (int32_t)*n - 1;
    y->next = -1;
    if (*n) e->sym[*n - 1].next = (int32_t)*n;
    (*n)++;
    return TQKV_OK;
}

static inline int heap_less(const struct tkz_heap_e *a, const struct tkz_heap_e *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static tqkv_status heap_push(tkz_encoder *e, size_t *n, uint32_t rank, uint32_t pos, int32_t id) {
    if (*n == e->heap_cap) {
        size_t cap = e->heap_cap ? e->heap_cap * 2 : 64;
        struct tkz_heap_e *p = realloc(e->heap, cap * sizeof *p);
        if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (BPE heap)");
        e->heap = p;
        e->heap_cap = cap;
    }
    struct tkz_heap_e *h = e->heap, x = {rank, pos, id};
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
    return TQKV_OK;
}

static struct tkz_heap_e heap_pop(tkz_encoder *e, size_t *n) {
    struct tkz_heap_e *h = e->heap, top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c])) c++;
        if (!heap_less(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = x;
    return top;
}

/* HF Word::merge_all: pop the lowest (rank, position) pair, skip stale entries. */
static tqkv_status merge_all(tkz_encoder *e, size_t n_sym) {
    const tkz_mergemap *mm = &e->t->merges;
    struct tkz_sym *y = e->sym;
    size_t hn = 0;
    tqkv_status st = TQKV_OK;
    for (size_t i = 0; i + 1 < n_sym && !st; i++) {
        const tkz_merge *m = tkz_mergemap_get(mm, y[i].id, y[i + 1].id);
        if (m) st = heap_push(e, &hn, m->rank, (uint32_t)i, m->id);
    }
    while (hn && !st) {
        y = e->sym;
        struct tkz_heap_e top = heap_pop(e, &hn);
        struct tkz_sym *a = &y[top.pos];
        if (a->len == 0 || a->next < 0) continue;
        int32_t nx = a->next;
        const tkz_merge *m = tkz_mergemap_get(mm, a->id, y[nx].id);
        if (!m || m->id != top.id) continue;
        a->id = top.id;
        a->len += y[nx].len;
        a->next = y[nx].next;
        y[nx].len = 0;
        if (a->next >= 0) y[a->next].prev = (int32_t)top.pos;
        if (a->prev >= 0) {
            m = tkz_mergemap_get(mm, y[a->prev].id, a->id);
            if (m) st = heap_push(e, &hn, m->rank, (uint32_t)a->prev, m->id);
        }
        a = &e->sym[top.pos];
        if (!st && a->next >= 0) {
            m = tkz_mergemap_get(mm, a->id, e->sym[a->next].id);
            if (m) st = heap_push(e, &hn, m->rank, top.pos, m->id);
        }
    }
    return st;
}

static int32_t vocab_get(const tqkv_tokenizer *t, const char *s, size_t len) {
    return tkz_strmap_get(&t->vocab, t->arena.p, s, len);
}

/* HF BPE::merge_word + merge_all, appending the ids to e->ids. */
static tqkv_status bpe_compute(tkz_encoder *e, const char *w, size_t len) {
    const tqkv_tokenizer *t = e->t;
    tqkv_status st = TQKV_OK;
    if (t->ignore_merges) {
        int32_t id = vocab_get(t, w, len);
        if (id >= 0) return tkz_push_id(e, id);
    }
    size_t n_sym = 0;
    int have_unk = 0;
    uint32_t unk_len = 0;
    size_t pre_len = t->cont_prefix ? strlen(t->cont_prefix) : 0;
    size_t suf_len = t->eow_suffix ? strlen(t->eow_suffix) : 0;
    for (size_t i = 0; i < len && !st;) {
        int32_t cp;
        size_t cl = (size_t)tkz_utf8_decode(w + i, len - i, &cp);
        const char *s = w + i;
        size_t sl = cl;
        int first = i == 0, last = i + cl >= len;
        if ((!first && pre_len) || (last && suf_len)) {
            e->tmp.n = 0;
            if (!first && pre_len) st = tkz_buf_append(&e->tmp, t->cont_prefix, pre_len);
            if (!st) st = tkz_buf_append(&e->tmp, w + i, cl);
            if (!st && last && suf_len) st = tkz_buf_append(&e->tmp, t->eow_suffix, suf_len);
            if (st) break;
            s = e->tmp.p;
            sl = e->tmp.n;
        }
        int32_t id = vocab_get(t, s, sl);
        if (id >= 0) {
            if (have_unk) st = sym_add(e, &n_sym, t->unk_id, unk_len);
            have_unk = 0;
            if (!st) st = sym_add(e, &n_sym, id, (uint32_t)cl);
        } else {
            int done = 0;
            if (t->byte_fallback) {
                size_t k = 0;
                while (k < sl && t->byte_fb[(uint8_t)s[k]] >= 0) k++;
                if (k == sl) {
                    for (k = 0; k < sl && !st; k++) st = sym_add(e, &n_sym, t->byte_fb[(uint8_t)s[k]], 1);
                    done = 1;
                }
            }
            if (!done && t->unk_id != -1) {
                if (t->unk_id < 0)
                    return tqkv_fail(TQKV_ECORRUPT, "tokenizer: unk_token of %s is not in the vocab",
                                     t->source);
                if (have_unk && t->fuse_unk) {
                    unk_len += (uint32_t)cl;
                } else {
                    if (have_unk) st = sym_add(e, &n_sym, t->unk_id, unk_len);
                    have_unk = 1;
                    unk_len = (uint32_t)cl;
                }
            }
            // no unk token and no byte fallback: HF drops the character
        }
        i += cl;
    }
    if (!st && have_unk) st = sym_add(e, &n_sym, t->unk_id, unk_len);
    if (!st) st = merge_all(e, n_sym);
    for (size_t i = 0; i < n_sym && !st; i++)
        if (e->sym[i].len) st = tkz_push_id(e, e->sym[i].id);
    return st;
}

/* Append the ids of one word to e->ids (through the word cache). */
static tqkv_status tkz_bpe_word(tkz_encoder *e, const char *w, size_t len) {
    if (!len) return TQKV_OK;
    int32_t ci = tkz_strmap_get(&e->cache, e->cache_keys.p, w, len);
    if (ci >= 0) {
        tkz_span v = e->cache_val[ci];
        for (size_t k = 0; k < v.len; k++) {
            tqkv_status st = tkz_push_id(e, e->cache_ids[v.off + k]);
            if (st) return st;
        }
        return TQKV_OK;
    }
    size_t start = e->n;
    tqkv_status st = bpe_compute(e, w, len);
    if (st || len > TKZ_CACHE_MAX_WORD || e->cache_val_n >= TKZ_CACHE_MAX_ENTRIES) return st;
    // remember the word (a failed insert only costs speed, but report ENOMEM honestly)
    size_t cnt = e->n - start;
    if (e->cache_ids_n + cnt > e->cache_ids_cap) {
        size_t cap = e->cache_ids_cap ? e->cache_ids_cap * 2 : 4096;
        while (cap < e->cache_ids_n + cnt) cap *= 2;
        int32_t *p = realloc(e->cache_ids, cap * sizeof *p);
        if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (word cache)");
        e->cache_ids = p;
        e->cache_ids_cap = cap;
    }
    if (e->cache_val_n == e->cache_val_cap) {
        size_t cap = e->cache_val_cap ? e->cache_val_cap * 2 : 1024;
        tkz_span *p = realloc(e->cache_val, cap * sizeof *p);
        if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (word cache)");
        e->cache_val = p;
        e->cache_val_cap = cap;
    }
    size_t koff = e->cache_keys.n;
    st = tkz_buf_append(&e->cache_keys, w, len);
    if (st) return st;
    if (cnt) memcpy(e->cache_ids + e->cache_ids_n, e->ids + start, cnt * sizeof(int32_t));
    e->cache_val[e->cache_val_n] = (tkz_span){e->cache_ids_n, cnt};
    e->cache_ids_n += cnt;
    st = tkz_strmap_put(&e->cache, e->cache_keys.p, koff, (uint32_t)len, (int32_t)e->cache_val_n);
    if (!st) e->cache_val_n++;
    return st;
}

// ---------------------------------------------------------------------------
// Added tokens (HF AddedVocabulary::find_matches) and the whole pipeline
// ---------------------------------------------------------------------------

static int32_t last_char(const char *s, size_t end) {
    size_t k = end - 1;
    while (k > 0 && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
    int32_t c;
    tkz_utf8_decode(s + k, end - k, &c);
    return c;
}

static tqkv_status words_to_ids(tkz_encoder *e, const char *s, size_t len) {
    tqkv_status st = tkz_pretokenize(e, s, len);
    // pieces live in e->pa; BPE does not touch pa/pb
    for (size_t i = 0; i < e->pa.n && !st; i++)
        st = tkz_bpe_word(e, e->pa.text.p + e->pa.sp[i].off, e->pa.sp[i].len);
    return st;
}

static tqkv_status split_added(tkz_encoder *e, const tkz_matchset *set, const char *s, size_t len,
                               int level);

/* A stretch of text between added tokens. level 0: raw (normalize next); 1: normalized. */
static tqkv_status text_piece(tkz_encoder *e, const char *s, size_t len, int level) {
    if (!len) return TQKV_OK;
    if (level == 1) return words_to_ids(e, s, len);
    const tqkv_tokenizer *t = e->t;
    if (!t->n_norm) return split_added(e, &t->set_norm, s, len, 1);
    // normalize into a fresh buffer: split_added recurses into pieces of it
    tkz_buf out = {0}, tmp = {0};
    tqkv_status st = tkz_normalize(t, e->md, &e->matches, s, len, &out, &tmp);
    tkz_buf_free(&tmp);
    if (!st) st = split_added(e, &t->set_norm, out.p, out.n, 1);
    tkz_buf_free(&out);
    return st;
}

static tqkv_status split_added(tkz_encoder *e, const tkz_matchset *set, const char *s, size_t len,
                               int level) {
    const tqkv_tokenizer *t = e->t;
    tqkv_status st = TQKV_OK;
    size_t start_offset = 0, i = 0;
    if (!set->n) return text_piece(e, s, len, level);
    while (i < len && !st) {
        uint8_t b = (uint8_t)s[i];
        const tkz_pat *hit = NULL;
        for (int k = set->first[b]; k < set->first[b + 1]; k++) {
            const tkz_pat *p = &set->pat[k];
            if (p->len <= len - i && !memcmp(t->arena.p + p->off, s + i, p->len)) { hit = p; break; }
        }
        if (!hit) { i++; continue; }
        const tkz_added *a = &t->added[hit->added];
        size_t start = i, stop = i + hit->len;
        i = stop;  // matches never overlap
        if ((e->flags & TQKV_ENCODE_SPECIAL_AS_TEXT) && a->special) continue;
        if (a->single_word) {
            int32_t c;
            int start_space = start == 0 || !tkz_is_word(last_char(s, start));
            int stop_space = stop == len || (tkz_utf8_decode(s + stop, len - stop, &c), !tkz_is_word(c));
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t k = ns - 1;
                while (k > 0 && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
                int32_t c;
                tkz_utf8_decode(s + k, ns - k, &c);
                if (!tkz_is_whitespace(c)) break;
                ns = k;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip) {
            while (stop < len) {
                int32_t c;
                int n = tkz_utf8_decode(s + stop, len - stop, &c);
                if (!tkz_is_whitespace(c)) break;
                stop += (size_t)n;
            }
        }
        if (start_offset < start) st = text_piece(e, s + start_offset, start - start_offset, level);
        if (!st) st = tkz_push_id(e, a->id);
        start_offset = stop;
    }
    if (!st && start_offset < len) st = text_piece(e, s + start_offset, len - start_offset, level);
    return st;
}

tqkv_status tqkv_tokenizer_encode(const tqkv_tokenizer *t, const char *text, size_t len,
                                  unsigned flags, int32_t **ids, size_t *n_ids) {
    if (!t || !ids || !n_ids || (!text && len))
        return tqkv_fail(TQKV_EINVAL, "tokenizer_encode: NULL argument");
    if (flags & ~(unsigned)(TQKV_ENCODE_ADD_SPECIAL | TQKV_ENCODE_SPECIAL_AS_TEXT))
        return tqkv_fail(TQKV_EINVAL, "tokenizer_encode: unknown flags 0x%x", flags);
    if ((flags & TQKV_ENCODE_ADD_SPECIAL) && t->post_unsupported)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tokenizer_encode: post_processor type '%s' of %s is not supported",
                         t->post_unsupported, t->source);
    size_t bad = tkz_utf8_valid_prefix(text, len);
    if (bad != len)
        return tqkv_fail(TQKV_EINVAL, "tokenizer_encode: invalid UTF-8 at byte %zu of %zu (0x%02x)",
                         bad, len, (unsigned)(uint8_t)text[bad]);
    tkz_encoder e;
    memset(&e, 0, sizeof e);
    e.t = t;
    e.flags = flags;
    e.md = pcre2_match_data_create(1, NULL);
    if (!e.md) return tqkv_fail(TQKV_ENOMEM, "tokenizer_encode: out of memory");
    tqkv_status st = TQKV_OK;
    if (flags & TQKV_ENCODE_ADD_SPECIAL)
        for (int k = 0; k < t->n_post_prefix && !st; k++) st = tkz_push_id(&e, t->post_prefix[k]);
    if (!st) st = split_added(&e, &t->set_raw, text, len, 0);
    if (flags & TQKV_ENCODE_ADD_SPECIAL)
        for (int k = 0; k < t->n_post_suffix && !st; k++) st = tkz_push_id(&e, t->post_suffix[k]);
    if (st) {
        tkz_encoder_free(&e);
        return st;
    }
    *n_ids = e.n;
    *ids = e.n ? e.ids : NULL;
    if (!e.n) free(e.ids);
    e.ids = NULL;
    tkz_encoder_free(&e);
    return TQKV_OK;
}

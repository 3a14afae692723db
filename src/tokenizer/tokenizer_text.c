/*
 * tokenizer_text.c - building blocks of the tokenizer: byte buffers, piece lists, hash
 * maps, strict UTF-8, Rust-compatible char classes and lossy UTF-8, and the PCRE2
 * regex wrapper with Oniguruma find_iter semantics.
 *
 * Owns: data structures and text primitives only. Must not: know about tokenizer.json,
 * hold global mutable state.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tokenizer_internal.h"

// ---------------------------------------------------------------------------
// Byte buffers and piece lists
// ---------------------------------------------------------------------------

tqkv_status tkz_buf_reserve(tkz_buf *b, size_t extra) {
    if (extra > SIZE_MAX - b->n - 1) return tqkv_fail(TQKV_ENOMEM, "tokenizer: buffer size overflow");
    size_t need = b->n + extra + 1;  // + NUL
    if (need <= b->cap) return TQKV_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->p, cap);
    if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (%zu bytes)", cap);
    b->p = p;
    b->cap = cap;
    return TQKV_OK;
}

tqkv_status tkz_buf_append(tkz_buf *b, const void *d, size_t n) {
    tqkv_status st = tkz_buf_reserve(b, n);
    if (st) return st;
    if (n) memcpy(b->p + b->n, d, n);
    b->n += n;
    b->p[b->n] = 0;
    return TQKV_OK;
}

void tkz_buf_free(tkz_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

tqkv_status tkz_pieces_add(tkz_pieces *p, const char *s, size_t len) {
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        tkz_span *sp = realloc(p->sp, cap * sizeof *sp);
        if (!sp) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (pieces)");
        p->sp = sp;
        p->cap = cap;
    }
    size_t off = p->text.n;
    tqkv_status st = tkz_buf_append(&p->text, s, len);
    if (st) return st;
    p->sp[p->n].off = off;
    p->sp[p->n].len = len;
    p->n++;
    return TQKV_OK;
}

void tkz_pieces_clear(tkz_pieces *p) {
    p->n = 0;
    p->text.n = 0;
}

void tkz_pieces_free(tkz_pieces *p) {
    tkz_buf_free(&p->text);
    free(p->sp);
    memset(p, 0, sizeof *p);
}

// ---------------------------------------------------------------------------
// Hash maps
// ---------------------------------------------------------------------------

static uint64_t tkz_hash(const char *s, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then a final mix
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h ? h : 1;
}

static tqkv_status strmap_grow(tkz_strmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 256;
    tkz_entry *e = calloc(cap, sizeof *e);
    if (!e) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (hash map of %zu)", cap);
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->e[i].hash) continue;
        size_t j = m->e[i].hash & (cap - 1);
        while (e[j].hash) j = (j + 1) & (cap - 1);
        e[j] = m->e[i];
    }
    free(m->e);
    m->e = e;
    m->cap = cap;
    return TQKV_OK;
}

tqkv_status tkz_strmap_put(tkz_strmap *m, const char *arena, size_t off, uint32_t len, int32_t val) {
    if ((m->n + 1) * 4 > m->cap * 3) {
        tqkv_status st = strmap_grow(m);
        if (st) return st;
    }
    uint64_t h = tkz_hash(arena + off, len);
    size_t j = h & (m->cap - 1);
    while (m->e[j].hash) {
        tkz_entry *x = &m->e[j];
        if (x->hash == h && x->len == len && !memcmp(arena + x->off, arena + off, len)) {
            x->val = val;
            return TQKV_OK;
        }
        j = (j + 1) & (m->cap - 1);
    }
    m->e[j].hash = h;
    m->e[j].off = off;
    m->e[j].len = len;
    m->e[j].val = val;
    m->n++;
    return TQKV_OK;
}

int32_t tkz_strmap_get(const tkz_strmap *m, const char *arena, const char *key, size_t len) {
    if (!m->cap) return -1;
    uint64_t h = tkz_hash(key, len);
    size_t j = h & (m->cap - 1);
    while (m->e[j].hash) {
        const tkz_entry *x = &m->e[j];
        if (x->hash == h && x->len == len && !memcmp(arena + x->off, key, len)) return x->val;
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

void tkz_strmap_free(tkz_strmap *m) {
    free(m->e);
    memset(m, 0, sizeof *m);
}

static inline size_t merge_slot(uint64_t key, size_t cap) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

tqkv_status tkz_mergemap_put(tkz_mergemap *m, int32_t a, int32_t b, uint32_t rank, int32_t id) {
    if ((m->n + 1) * 2 > m->cap) {  // load <= 1/2
        size_t cap = m->cap ? m->cap * 2 : 1024;
        tkz_merge *e = calloc(cap, sizeof *e);
        if (!e) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (merge map of %zu)", cap);
        for (size_t i = 0; i < m->cap; i++) {
            if (!m->e[i].key) continue;
            size_t j = merge_slot(m->e[i].key, cap);
            while (e[j].key) j = (j + 1) & (cap - 1);
            e[j] = m->e[i];
        }
        free(m->e);
        m->e = e;
        m->cap = cap;
    }
    uint64_t key = ((uint64_t)(uint32_t)(a + 1) << 32) | (uint32_t)(b + 1);
    size_t j = merge_slot(key, m->cap);
    while (m->e[j].key && m->e[j].key != key) j = (j + 1) & (m->cap - 1);
    if (!m->e[j].key) m->n++;
    m->e[j].key = key;  // a repeated pair takes the later rank (HF collects into a HashMap)
    m->e[j].rank = rank;
    m->e[j].id = id;
    return TQKV_OK;
}

const tkz_merge *tkz_mergemap_get(const tkz_mergemap *m, int32_t a, int32_t b) {
    if (!m->cap) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)(a + 1) << 32) | (uint32_t)(b + 1);
    size_t j = merge_slot(key, m->cap);
    while (m->e[j].key) {
        if (m->e[j].key == key) return &m->e[j];
        j = (j + 1) & (m->cap - 1);
    }
    return NULL;
}

void tkz_mergemap_free(tkz_mergemap *m) {
    free(m->e);
    memset(m, 0, sizeof *m);
}

// ---------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------

size_t tkz_utf8_valid_prefix(const char *s, size_t len) {
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < len) {
        uint8_t c = p[i];
        if (c < 0x80) { i++; continue; }
        size_t n;
        uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
        if (c >= 0xC2 && c <= 0xDF) n = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else return i;
        if (i + n > len) return i;
        if (p[i + 1] < lo || p[i + 1] > hi) return i;
        for (size_t k = 2; k < n; k++)
            if ((p[i + k] & 0xC0) != 0x80) return i;
        i += n;
    }
    return len;
}

int tkz_utf8_decode(const char *s, size_t len, int32_t *cp) {
    const uint8_t *p = (const uint8_t *)s;
    uint8_t c = p[0];
    if (c < 0x80 || len < 2) { *cp = c; return 1; }
    if (c < 0xE0) { *cp = ((c & 0x1F) << 6) | (p[1] & 0x3F); return 2; }
    if (c < 0xF0 || len < 4) {
        if (len < 3) { *cp = c; return 1; }
        *cp = ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        return 3;
    }
    *cp = ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    return 4;
}

int tkz_utf8_encode(int32_t cp, char out[4]) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

int tkz_is_whitespace(int32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

int tkz_is_word(int32_t c) {
    if (c < 0x80)
        return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || c == '_';
    if (c == 0x200C || c == 0x200D) return 1;  // Join_Control
    utf8proc_category_t k = utf8proc_category(c);
    return (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_ME) || k == UTF8PROC_CATEGORY_ND ||
           k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_PC;
}

/* Rust core::str::lossy::Utf8Chunks: a maximal valid prefix of a sequence that turns
 * out invalid is replaced by one U+FFFD. */
size_t tkz_utf8_lossy_append(tkz_buf *out, const char *bytes, size_t len, int final,
                             tqkv_status *st) {
    static const char REPL[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
    const uint8_t *s = (const uint8_t *)bytes;
    *st = tkz_buf_reserve(out, len * 3 + 3);  // worst case: every byte becomes U+FFFD
    if (*st) return 0;
    size_t i = 0, valid_start = 0;
#define GET(k) ((k) < len ? s[k] : 0)
    while (i < len) {
        size_t lead = i;
        uint8_t c = s[i++];
        if (c < 0x80) continue;
        int ok = 1, w = 0;
        if (c >= 0xC2 && c <= 0xDF) w = 2;
        else if (c >= 0xE0 && c <= 0xEF) w = 3;
        else if (c >= 0xF0 && c <= 0xF4) w = 4;
        if (w == 2) {
            if ((GET(i) & 0xC0) != 0x80) ok = 0;
            else i++;
        } else if (w == 3) {
            uint8_t d = GET(i);
            int good = (c == 0xE0 && d >= 0xA0 && d <= 0xBF) ||
                       (c >= 0xE1 && c <= 0xEC && d >= 0x80 && d <= 0xBF) ||
                       (c == 0xED && d >= 0x80 && d <= 0x9F) ||
                       (c >= 0xEE && c <= 0xEF && d >= 0x80 && d <= 0xBF);
            if (!good) {
                ok = 0;
            } else {
                i++;
                if ((GET(i) & 0xC0) != 0x80) ok = 0;
                else i++;
            }
        } else if (w == 4) {
            uint8_t d = GET(i);
            int good = (c == 0xF0 && d >= 0x90 && d <= 0xBF) ||
                       (c >= 0xF1 && c <= 0xF3 && d >= 0x80 && d <= 0xBF) ||
                       (c == 0xF4 && d >= 0x80 && d <= 0x8F);
            if (!good) {
                ok = 0;
            } else {
                i++;
                if ((GET(i) & 0xC0) != 0x80) {
                    ok = 0;
                } else {
                    i++;
                    if ((GET(i) & 0xC0) != 0x80) ok = 0;
                    else i++;
                }
            }
        } else {
            ok = 0;
        }
        if (ok) continue;
        // s[lead .. i) is invalid; i is the byte that broke it (or len)
        if (i >= len && w && !final) {  // incomplete at the end: hold back
            memcpy(out->p + out->n, s + valid_start, lead - valid_start);
            out->n += lead - valid_start;
            out->p[out->n] = 0;
            return lead;
        }
        memcpy(out->p + out->n, s + valid_start, lead - valid_start);
        out->n += lead - valid_start;
        memcpy(out->p + out->n, REPL, 3);
        out->n += 3;
        valid_start = i;
    }
#undef GET
    memcpy(out->p + out->n, s + valid_start, len - valid_start);
    out->n += len - valid_start;
    out->p[out->n] = 0;
    return len;
}

// ---------------------------------------------------------------------------
// Regex
// ---------------------------------------------------------------------------

/* Oniguruma (Ruby syntax) -> PCRE2: `\s` must match U+0085 as Oniguruma's does (PCRE2
 * 10.42 with UCP already does; older builds did not), `\h` is a hex digit. Everything
 * else is passed through. */
static tqkv_status regex_translate(const char *p, size_t len, tkz_buf *out) {
    tqkv_status st = TQKV_OK;
    int in_class = 0;
    for (size_t i = 0; i < len && !st; i++) {
        char c = p[i];
        if (c == '\\' && i + 1 < len) {
            char d = p[++i];
            const char *rep = NULL;
            if (d == 's') rep = in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
            else if (d == 'S' && !in_class) rep = "[^\\s\\x{85}]";
            else if (d == 'h') rep = in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
            else if (d == 'H' && !in_class) rep = "[^0-9a-fA-F]";
            if (rep) {
                st = tkz_buf_append(out, rep, strlen(rep));
            } else {
                char two[2] = {c, d};
                st = tkz_buf_append(out, two, 2);
            }
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            st = tkz_buf_append(out, &c, 1);
            // a ']' right after '[' or '[^' is a literal
            if (!st && i + 1 < len && p[i + 1] == '^') st = tkz_buf_append(out, &p[++i], 1);
            if (!st && i + 1 < len && p[i + 1] == ']') st = tkz_buf_append(out, &p[++i], 1);
            continue;
        }
        if (in_class && c == '[' && i + 1 < len && p[i + 1] == ':') {  // [:alpha:]
            const char *end = NULL;
            for (size_t k = i + 2; k + 1 < len; k++)
                if (p[k] == ':' && p[k + 1] == ']') { end = p + k + 2; break; }
            if (end) {
                st = tkz_buf_append(out, p + i, (size_t)(end - (p + i)));
                i = (size_t)(end - p) - 1;
                continue;
            }
        }
        if (in_class && c == ']') in_class = 0;
        st = tkz_buf_append(out, &c, 1);
    }
    if (!st && !out->p) st = tkz_buf_append(out, "", 0);
    return st;
}

tqkv_status tkz_regex_compile(tkz_regex *r, const char *pattern, size_t len, int literal,
                              const char *what) {
    tkz_buf pat = {0};
    tqkv_status st;
    uint32_t opts = PCRE2_UTF;
    if (literal) {
        opts |= PCRE2_LITERAL;
        st = tkz_buf_append(&pat, pattern, len);
    } else {
        opts |= PCRE2_UCP | PCRE2_MULTILINE;  // Ruby syntax: ^ and $ are line anchors
        st = regex_translate(pattern, len, &pat);
    }
    if (st) { tkz_buf_free(&pat); return st; }
    int err = 0;
    PCRE2_SIZE eoff = 0;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)pat.p, pat.n, opts, &err, &eoff, NULL);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        st = tqkv_fail(TQKV_EUNSUPPORTED, "tokenizer: cannot compile %s regex '%.*s': %s at offset %zu",
                       what, (int)(len > 200 ? 200 : len), pattern, (const char *)msg, (size_t)eoff);
        tkz_buf_free(&pat);
        return st;
    }
    tkz_buf_free(&pat);
    r->code = code;
    r->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return TQKV_OK;
}

void tkz_regex_free(tkz_regex *r) {
    if (r->code) pcre2_code_free(r->code);
    r->code = NULL;
    r->jit = 0;
}

/* One search from `start`: 1 found, 0 none, or a negative tqkv_status. */
static int regex_search(const tkz_regex *r, pcre2_match_data *md, const char *s, size_t len,
                        size_t start, size_t *ms, size_t *me) {
    int rc = pcre2_match(r->code, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // deep backtracking: the interpreter uses the heap
        rc = pcre2_match(r->code, (PCRE2_SPTR)s, len, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                         NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        tqkv_fail(TQKV_EINVAL, "tokenizer: regex match failed: %s", (const char *)msg);
        return -1;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    if (*me < *ms) *me = *ms;  // \K tricks; never in tokenizer patterns
    return 1;
}

static tqkv_status matches_add(tkz_matches *o, size_t a, size_t b, int is_match) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        tkz_match *m = realloc(o->m, cap * sizeof *m);
        if (!m) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (matches)");
        o->m = m;
        o->cap = cap;
    }
    o->m[o->n].start = a;
    o->m[o->n].end = b;
    o->m[o->n].is_match = is_match;
    o->n++;
    return TQKV_OK;
}

tqkv_status tkz_regex_find_matches(const tkz_regex *r, pcre2_match_data *md, const char *s,
                                   size_t len, tkz_matches *out) {
    out->n = 0;
    if (len == 0) return matches_add(out, 0, 0, 0);
    size_t prev = 0, last_end = 0, last_match_end = SIZE_MAX;
    tqkv_status st = TQKV_OK;
    while (last_end <= len) {
        size_t ms, me;
        int rc = regex_search(r, md, s, len, last_end, &ms, &me);
        if (rc < 0) return TQKV_EINVAL;
        if (rc == 0) break;
        if (ms == me && last_match_end == me) {
            // onig: no empty match right after the previous match; step one char
            if (last_end < len) {
                int32_t cp;
                last_end += (size_t)tkz_utf8_decode(s + last_end, len - last_end, &cp);
            } else {
                last_end++;
            }
            continue;
        }
        last_end = me;
        last_match_end = me;
        if (prev != ms) st = matches_add(out, prev, ms, 0);
        if (!st) st = matches_add(out, ms, me, 1);
        if (st) return st;
        prev = me;
    }
    if (prev != len) st = matches_add(out, prev, len, 0);
    return st;
}

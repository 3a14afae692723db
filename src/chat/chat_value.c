/*
 * chat_value.c - the chat-template engine's arena and values: growable strings, dicts,
 * UTF-8 helpers, and Python's str() / repr() / json.dumps() of a value.
 *
 * Owns: how values print and compare (Python semantics, as Jinja2 renders them).
 * Must not: evaluate templates, set the thread's error message (callers report OOM).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "chat/chat_internal.h"
#include "tokenizer/tokenizer_internal.h"

/* ------------------------------------------------------------------------- */
/* Arena                                                                      */
/* ------------------------------------------------------------------------- */

struct chat_arena_block {
    chat_arena_block *next;
    size_t            used, cap;
    max_align_t       data[]; /* [cap bytes] */
};

#define CHAT_ARENA_BLOCK (64u * 1024u)

void chat_arena_init(chat_arena *a, size_t limit) {
    a->head = NULL;
    a->total = 0;
    a->limit = limit;
}

void chat_arena_free(chat_arena *a) {
    chat_arena_block *b = a->head;
    while (b) {
        chat_arena_block *next = b->next;
        free(b);
        b = next;
    }
    a->head = NULL;
    a->total = 0;
}

void *chat_arena_alloc(chat_arena *a, size_t n) {
    const size_t align = sizeof(max_align_t);
    if (n == 0) n = 1;
    if (n > SIZE_MAX / 2) return NULL;
    n = (n + align - 1) / align * align;
    if (a->limit && (n > a->limit || a->total > a->limit - n)) return NULL;
    chat_arena_block *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > CHAT_ARENA_BLOCK ? n : CHAT_ARENA_BLOCK;
        b = malloc(sizeof(chat_arena_block) + cap);
        if (!b) return NULL;
        b->cap = cap;
        b->used = 0;
        b->next = a->head;
        a->head = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    a->total += n;
    memset(p, 0, n);
    return p;
}

/* ------------------------------------------------------------------------- */
/* Constructors, buffers, dicts                                               */
/* ------------------------------------------------------------------------- */

chat_value chat_str(const char *s, size_t n) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_STR;
    v.u.str.s = s ? s : "";
    v.u.str.n = s ? n : 0;
    return v;
}

chat_value chat_int(int64_t i) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_INT;
    v.u.i = i;
    return v;
}

chat_value chat_bool(int b) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_BOOL;
    v.u.i = b ? 1 : 0;
    return v;
}

int chat_buf_put(chat_arena *a, chat_buf *b, const char *s, size_t n) {
    if (b->cap - b->n < n + 1 || !b->s) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap - b->n < n + 1) {
            if (cap > SIZE_MAX / 4) return -1;
            cap *= 2;
        }
        char *p = chat_arena_alloc(a, cap);
        if (!p) return -1;
        if (b->n) memcpy(p, b->s, b->n);
        b->s = p;
        b->cap = cap;
    }
    if (n) memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
    return 0;
}

int chat_buf_putc(chat_arena *a, chat_buf *b, char c) { return chat_buf_put(a, b, &c, 1); }

chat_dict *chat_dict_new(chat_arena *a, size_t cap) {
    chat_dict *d = chat_arena_alloc(a, sizeof *d);
    if (!d) return NULL;
    if (cap < 4) cap = 4;
    d->keys = chat_arena_alloc(a, cap * sizeof *d->keys);
    d->klen = chat_arena_alloc(a, cap * sizeof *d->klen);
    d->vals = chat_arena_alloc(a, cap * sizeof *d->vals);
    if (!d->keys || !d->klen || !d->vals) return NULL;
    d->cap = cap;
    return d;
}

const chat_value *chat_dict_get(const chat_dict *d, const char *k, size_t kn) {
    for (size_t i = 0; i < d->n; i++)
        if (d->klen[i] == kn && memcmp(d->keys[i], k, kn) == 0) return &d->vals[i];
    return NULL;
}

int chat_dict_set(chat_arena *a, chat_dict *d, const char *k, size_t kn, chat_value v) {
    for (size_t i = 0; i < d->n; i++)
        if (d->klen[i] == kn && memcmp(d->keys[i], k, kn) == 0) {
            d->vals[i] = v;
            return 0;
        }
    if (d->n == d->cap) {
        size_t cap = d->cap * 2;
        const char **keys = chat_arena_alloc(a, cap * sizeof *keys);
        size_t *klen = chat_arena_alloc(a, cap * sizeof *klen);
        chat_value *vals = chat_arena_alloc(a, cap * sizeof *vals);
        if (!keys || !klen || !vals) return -1;
        memcpy(keys, d->keys, d->n * sizeof *keys);
        memcpy(klen, d->klen, d->n * sizeof *klen);
        memcpy(vals, d->vals, d->n * sizeof *vals);
        d->keys = keys;
        d->klen = klen;
        d->vals = vals;
        d->cap = cap;
    }
    d->keys[d->n] = k;
    d->klen[d->n] = kn;
    d->vals[d->n] = v;
    d->n++;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* UTF-8                                                                      */
/* ------------------------------------------------------------------------- */

uint32_t chat_utf8_next(const char *s, size_t n, size_t *i) {
    const unsigned char *p = (const unsigned char *)s + *i;
    size_t left = n - *i;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len <= 1 || (size_t)len > left) {
        *i += 1;
        return c;
    }
    uint32_t cp = c & (0x7Fu >> len);
    for (int k = 1; k < len; k++) {
        if ((p[k] & 0xC0) != 0x80) {
            *i += 1;
            return c;
        }
        cp = (cp << 6) | (p[k] & 0x3F);
    }
    *i += (size_t)len;
    return cp;
}

size_t chat_utf8_put(uint32_t cp, char out[4]) {
    return (size_t)tkz_utf8_encode((int32_t)cp, out); /* the tokenizer's encoder */
}

int chat_py_space(uint32_t cp) {
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return 1;
    if (cp < 0x85) return 0;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* ------------------------------------------------------------------------- */
/* str() / repr() / json                                                      */
/* ------------------------------------------------------------------------- */

const char *chat_kind_name(chat_kind k) {
    switch (k) {
    case CV_UNDEF: return "undefined";
    case CV_NONE: return "NoneType";
    case CV_BOOL: return "bool";
    case CV_INT: return "int";
    case CV_FLOAT: return "float";
    case CV_STR: return "str";
    case CV_LIST: return "list";
    case CV_DICT: return "dict";
    case CV_NS: return "Namespace";
    case CV_MACRO: return "Macro";
    case CV_FUNC: return "function";
    }
    return "?";
}

/* Python's repr(float): the shortest text that round-trips, in Python's layout. */
static int put_float(chat_arena *a, chat_buf *b, double f) {
    char tmp[64];
    if (isnan(f)) return chat_buf_put(a, b, "nan", 3);
    if (isinf(f)) return f > 0 ? chat_buf_put(a, b, "inf", 3) : chat_buf_put(a, b, "-inf", 4);
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp = d.ddde[+-]XX with prec significant digits */
    char digits[32];
    int nd = 0, neg = 0;
    const char *p = tmp;
    if (*p == '-') {
        neg = 1;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char out[64];
    int o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= 16 || exp10 < -4) {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++) out[o++] = digits[i];
        }
        o += snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+',
                      exp10 < 0 ? -exp10 : exp10);
    } else if (exp10 < 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = 0; i < -exp10 - 1; i++) out[o++] = '0';
        for (int i = 0; i < nd; i++) out[o++] = digits[i];
    } else {
        for (int i = 0; i <= exp10; i++) out[o++] = i < nd ? digits[i] : '0';
        out[o++] = '.';
        if (nd > exp10 + 1)
            for (int i = exp10 + 1; i < nd; i++) out[o++] = digits[i];
        else
            out[o++] = '0';
    }
    return chat_buf_put(a, b, out, (size_t)o);
}

static int put_int(chat_arena *a, chat_buf *b, int64_t i) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%lld", (long long)i);
    return chat_buf_put(a, b, tmp, (size_t)n);
}

/* Python's str.isprintable() for one code point. */
static int py_printable(uint32_t cp) {
    if (cp > 0x10FFFF) return 0;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return 0;
    default: return 1;
    }
}

static int put_repr_str(chat_arena *a, chat_buf *b, const char *s, size_t n) {
    int has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    if (chat_buf_putc(a, b, q)) return -1;
    for (size_t i = 0; i < n;) {
        size_t start = i;
        uint32_t cp = chat_utf8_next(s, n, &i);
        char tmp[16];
        int r = 0;
        if (cp == (uint32_t)q || cp == '\\') {
            tmp[0] = '\\';
            tmp[1] = (char)cp;
            r = chat_buf_put(a, b, tmp, 2);
        } else if (cp == '\n') r = chat_buf_put(a, b, "\\n", 2);
        else if (cp == '\r') r = chat_buf_put(a, b, "\\r", 2);
        else if (cp == '\t') r = chat_buf_put(a, b, "\\t", 2);
        else if (cp != ' ' && !py_printable(cp)) { /* as Python's repr: \xNN, \uNNNN, \UNNNNNNNN */
            int k = snprintf(tmp, sizeof tmp, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x", (unsigned)cp);
            r = chat_buf_put(a, b, tmp, (size_t)k);
        } else r = chat_buf_put(a, b, s + start, i - start);
        if (r) return -1;
    }
    return chat_buf_putc(a, b, q);
}

int chat_value_repr(chat_arena *a, chat_buf *b, chat_value v) {
    switch (v.kind) {
    case CV_UNDEF: return chat_buf_put(a, b, "Undefined", 9);
    case CV_STR: return put_repr_str(a, b, v.u.str.s, v.u.str.n);
    case CV_LIST:
        if (chat_buf_putc(a, b, v.u.list->tuple ? '(' : '[')) return -1;
        for (size_t i = 0; i < v.u.list->n; i++) {
            if (i && chat_buf_put(a, b, ", ", 2)) return -1;
            if (chat_value_repr(a, b, v.u.list->items[i])) return -1;
        }
        if (v.u.list->tuple && v.u.list->n == 1 && chat_buf_putc(a, b, ',')) return -1;
        return chat_buf_putc(a, b, v.u.list->tuple ? ')' : ']');
    case CV_DICT:
        if (chat_buf_putc(a, b, '{')) return -1;
        for (size_t i = 0; i < v.u.dict->n; i++) {
            if (i && chat_buf_put(a, b, ", ", 2)) return -1;
            if (put_repr_str(a, b, v.u.dict->keys[i], v.u.dict->klen[i])) return -1;
            if (chat_buf_put(a, b, ": ", 2)) return -1;
            if (chat_value_repr(a, b, v.u.dict->vals[i])) return -1;
        }
        return chat_buf_putc(a, b, '}');
    default: return chat_value_str(a, b, v);
    }
}

int chat_value_str(chat_arena *a, chat_buf *b, chat_value v) {
    switch (v.kind) {
    case CV_UNDEF: return 0;
    case CV_NONE: return chat_buf_put(a, b, "None", 4);
    case CV_BOOL: return v.u.i ? chat_buf_put(a, b, "True", 4) : chat_buf_put(a, b, "False", 5);
    case CV_INT: return put_int(a, b, v.u.i);
    case CV_FLOAT: return put_float(a, b, v.u.f);
    case CV_STR: return chat_buf_put(a, b, v.u.str.s, v.u.str.n);
    case CV_LIST:
    case CV_DICT: return chat_value_repr(a, b, v);
    case CV_NS: return chat_buf_put(a, b, "<Namespace>", 11);
    case CV_MACRO: return chat_buf_put(a, b, "<Macro>", 7);
    case CV_FUNC: return chat_buf_put(a, b, "<function>", 10);
    }
    return 0;
}

static int put_json_str(chat_arena *a, chat_buf *b, const char *s, size_t n) {
    if (chat_buf_putc(a, b, '"')) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char tmp[8];
        int r;
        if (c == '"') r = chat_buf_put(a, b, "\\\"", 2);
        else if (c == '\\') r = chat_buf_put(a, b, "\\\\", 2);
        else if (c == '\n') r = chat_buf_put(a, b, "\\n", 2);
        else if (c == '\r') r = chat_buf_put(a, b, "\\r", 2);
        else if (c == '\t') r = chat_buf_put(a, b, "\\t", 2);
        else if (c == '\b') r = chat_buf_put(a, b, "\\b", 2);
        else if (c == '\f') r = chat_buf_put(a, b, "\\f", 2);
        else if (c < 0x20) {
            int k = snprintf(tmp, sizeof tmp, "\\u%04x", c);
            r = chat_buf_put(a, b, tmp, (size_t)k);
        } else r = chat_buf_putc(a, b, (char)c);
        if (r) return -1;
    }
    return chat_buf_putc(a, b, '"');
}

static int put_indent(chat_arena *a, chat_buf *b, int indent, int depth) {
    if (chat_buf_putc(a, b, '\n')) return -1;
    for (int i = 0; i < indent * depth; i++)
        if (chat_buf_putc(a, b, ' ')) return -1;
    return 0;
}

int chat_value_json(chat_arena *a, chat_buf *b, chat_value v, int indent, int depth,
                    int sort_keys, const char *item_sep, const char *key_sep) {
    if (depth > 64) return -2;
    switch (v.kind) {
    case CV_NONE: return chat_buf_put(a, b, "null", 4);
    case CV_BOOL: return v.u.i ? chat_buf_put(a, b, "true", 4) : chat_buf_put(a, b, "false", 5);
    case CV_INT: return put_int(a, b, v.u.i);
    case CV_FLOAT:
        if (isnan(v.u.f)) return chat_buf_put(a, b, "NaN", 3);
        if (isinf(v.u.f))
            return v.u.f > 0 ? chat_buf_put(a, b, "Infinity", 8) : chat_buf_put(a, b, "-Infinity", 9);
        return put_float(a, b, v.u.f);
    case CV_STR: return put_json_str(a, b, v.u.str.s, v.u.str.n);
    case CV_LIST: {
        const chat_list *l = v.u.list;
        if (l->n == 0) return chat_buf_put(a, b, "[]", 2);
        if (chat_buf_putc(a, b, '[')) return -1;
        for (size_t i = 0; i < l->n; i++) {
            if (i && chat_buf_put(a, b, item_sep, strlen(item_sep))) return -1;
            if (indent >= 0 && put_indent(a, b, indent, depth + 1)) return -1;
            int r = chat_value_json(a, b, l->items[i], indent, depth + 1, sort_keys, item_sep, key_sep);
            if (r) return r;
        }
        if (indent >= 0 && put_indent(a, b, indent, depth)) return -1;
        return chat_buf_putc(a, b, ']');
    }
    case CV_DICT:
    case CV_NS: {
        const chat_dict *d = v.u.dict;
        if (d->n == 0) return chat_buf_put(a, b, "{}", 2);
        size_t *order = chat_arena_alloc(a, d->n * sizeof *order);
        if (!order) return -1;
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (sort_keys) /* insertion sort: stable, small dicts */
            for (size_t i = 1; i < d->n; i++) {
                size_t k = order[i], j = i;
                while (j > 0) {
                    size_t p = order[j - 1];
                    size_t m = d->klen[p] < d->klen[k] ? d->klen[p] : d->klen[k];
                    int c = memcmp(d->keys[p], d->keys[k], m);
                    if (c < 0 || (c == 0 && d->klen[p] <= d->klen[k])) break;
                    order[j] = p;
                    j--;
                }
                order[j] = k;
            }
        if (chat_buf_putc(a, b, '{')) return -1;
        for (size_t q = 0; q < d->n; q++) {
            size_t i = order[q];
            if (q && chat_buf_put(a, b, item_sep, strlen(item_sep))) return -1;
            if (indent >= 0 && put_indent(a, b, indent, depth + 1)) return -1;
            if (put_json_str(a, b, d->keys[i], d->klen[i])) return -1;
            if (chat_buf_put(a, b, key_sep, strlen(key_sep))) return -1;
            int r = chat_value_json(a, b, d->vals[i], indent, depth + 1, sort_keys, item_sep, key_sep);
            if (r) return r;
        }
        if (indent >= 0 && put_indent(a, b, indent, depth)) return -1;
        return chat_buf_putc(a, b, '}');
    }
    default: return -2;
    }
}

/* ------------------------------------------------------------------------- */
/* Truth and equality                                                         */
/* ------------------------------------------------------------------------- */

int chat_truthy(chat_value v) {
    switch (v.kind) {
    case CV_UNDEF:
    case CV_NONE: return 0;
    case CV_BOOL:
    case CV_INT: return v.u.i != 0;
    case CV_FLOAT: return v.u.f != 0.0;
    case CV_STR: return v.u.str.n != 0;
    case CV_LIST: return v.u.list->n != 0;
    case CV_DICT: return v.u.dict->n != 0;
    default: return 1;
    }
}

static int is_num(chat_value v) { return v.kind == CV_BOOL || v.kind == CV_INT || v.kind == CV_FLOAT; }

int chat_equal(chat_value x, chat_value y) {
    if (is_num(x) && is_num(y)) {
        if (x.kind == CV_FLOAT || y.kind == CV_FLOAT) {
            double a = x.kind == CV_FLOAT ? x.u.f : (double)x.u.i;
            double b = y.kind == CV_FLOAT ? y.u.f : (double)y.u.i;
            return a == b;
        }
        return x.u.i == y.u.i;
    }
    if (x.kind != y.kind) return 0;
    switch (x.kind) {
    case CV_UNDEF:
    case CV_NONE: return 1;
    case CV_STR: return x.u.str.n == y.u.str.n && memcmp(x.u.str.s, y.u.str.s, x.u.str.n) == 0;
    case CV_LIST:
        if (x.u.list->n != y.u.list->n) return 0;
        for (size_t i = 0; i < x.u.list->n; i++)
            if (!chat_equal(x.u.list->items[i], y.u.list->items[i])) return 0;
        return 1;
    case CV_DICT:
        if (x.u.dict->n != y.u.dict->n) return 0;
        for (size_t i = 0; i < x.u.dict->n; i++) {
            const chat_value *o = chat_dict_get(y.u.dict, x.u.dict->keys[i], x.u.dict->klen[i]);
            if (!o || !chat_equal(x.u.dict->vals[i], *o)) return 0;
        }
        return 1;
    case CV_NS: return x.u.dict == y.u.dict;
    case CV_MACRO: return x.u.macro == y.u.macro;
    case CV_FUNC: return x.u.i == y.u.i;
    default: return 0;
    }
}

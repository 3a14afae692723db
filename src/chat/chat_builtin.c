/*
 * chat_builtin.c - the chat-template engine's filters, tests, string/dict methods and
 * global functions, with the semantics of Jinja2 (and Python's str methods) as
 * transformers' chat-template environment provides them.
 *
 * Owns: the list of supported names (the parser refuses others at init) and what each does.
 * Must not: evaluate syntax nodes other than through chat_eval.h's helpers.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <utf8proc.h>

#include "chat/chat_eval.h"
#include "util/common.h"

/* ------------------------------------------------------------------------- */
/* Names                                                                      */
/* ------------------------------------------------------------------------- */

static const char *const k_filters[] = {
    "trim", "length", "count", "tojson", "first", "last", "string", "default", "d", "join",
    "upper", "lower", "capitalize", "title", "list", "items", "dictsort", "map", "select",
    "reject", "selectattr", "rejectattr", "safe", "int", "float", "abs", "replace", "reverse",
    NULL};
static const char *const k_tests[] = {
    "defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
    "integer", "float", "boolean", "true", "false", "callable", "eq", "equalto", "==", "ne",
    "!=", "lt", "le", "gt", "ge", "in", "odd", "even", "divisibleby", "lower", "upper",
    "sameas", NULL};
static const char *const k_methods[] = {
    "startswith", "endswith", "strip", "lstrip", "rstrip", "split", "replace", "upper",
    "lower", "title", "capitalize", "find", "count", "join", "items", "keys", "values", "get",
    NULL};
static const char *const k_funcs[CF_COUNT] = {"raise_exception", "namespace", "range", "dict",
                                              "strftime_now"};

static int in_list(const char *const *list, const char *name, size_t n) {
    for (int i = 0; list[i]; i++)
        if (strlen(list[i]) == n && memcmp(list[i], name, n) == 0) return 1;
    return 0;
}

int chat_filter_known(const char *name, size_t n) { return in_list(k_filters, name, n); }
int chat_test_known(const char *name, size_t n) { return in_list(k_tests, name, n); }
int chat_method_known(const char *name, size_t n) { return in_list(k_methods, name, n); }
int chat_func_lookup(const char *name, size_t n) {
    for (int i = 0; i < CF_COUNT; i++)
        if (strlen(k_funcs[i]) == n && memcmp(k_funcs[i], name, n) == 0) return i;
    return -1;
}

static int is(const char *name, size_t n, const char *s) { return strlen(s) == n && memcmp(name, s, n) == 0; }

/* ------------------------------------------------------------------------- */
/* Argument helpers                                                           */
/* ------------------------------------------------------------------------- */

typedef struct {
    const chat_value *args;
    int               n_args;
    const char *const *kwn;
    const size_t     *kwl;
    const chat_value *kw;
    int               n_kw;
} argv_t;

/* Argument `pos` or keyword `name`; NULL if absent. */
static const chat_value *arg(const argv_t *A, int pos, const char *name) {
    if (pos >= 0 && pos < A->n_args) return &A->args[pos];
    for (int i = 0; i < A->n_kw; i++)
        if (is(A->kwn[i], A->kwl[i], name)) return &A->kw[i];
    return NULL;
}

static void check_arity(chat_ev *E, const chat_node *at, const argv_t *A, int max_pos, const char *const *kw_ok,
                        const char *what, const char *name, size_t name_n) {
    if (A->n_args > max_pos)
        chat_ev_fail(E, at, TQKV_EINVAL, "%s '%.*s' takes at most %d positional argument(s)", what, (int)name_n,
                     name, max_pos);
    for (int i = 0; i < A->n_kw; i++) {
        int ok = 0;
        for (int k = 0; kw_ok && kw_ok[k] && !ok; k++) ok = is(A->kwn[i], A->kwl[i], kw_ok[k]);
        if (!ok)
            chat_ev_fail(E, at, TQKV_EINVAL, "%s '%.*s' got an unexpected keyword argument '%.*s'", what,
                         (int)name_n, name, (int)A->kwl[i], A->kwn[i]);
    }
}

static chat_value want_str(chat_ev *E, const chat_node *at, chat_value v, const char *what) {
    if (v.kind == CV_UNDEF) chat_ev_undefined(E, at, v);
    if (v.kind != CV_STR)
        chat_ev_fail(E, at, TQKV_EINVAL, "%s expects a string, got '%s'", what, chat_kind_name(v.kind));
    return v;
}

static int64_t want_int(chat_ev *E, const chat_node *at, chat_value v, const char *what) {
    if (v.kind == CV_INT || v.kind == CV_BOOL) return v.u.i;
    chat_ev_fail(E, at, TQKV_EINVAL, "%s expects an integer, got '%s'", what, chat_kind_name(v.kind));
}

static chat_value str_from_buf(chat_buf *b) { return chat_str(b->s ? b->s : "", b->n); }

static void bput(chat_ev *E, chat_buf *b, const char *s, size_t n) {
    if (chat_buf_put(E->a, b, s, n)) chat_ev_oom(E);
}

/* ------------------------------------------------------------------------- */
/* String operations (Python str semantics)                                   */
/* ------------------------------------------------------------------------- */

/* Is code point cp in chars (UTF-8)? chars == NULL: Python whitespace. */
static int in_chars(uint32_t cp, const chat_value *chars) {
    if (!chars) return chat_py_space(cp);
    for (size_t i = 0; i < chars->u.str.n;) {
        if (chat_utf8_next(chars->u.str.s, chars->u.str.n, &i) == cp) return 1;
    }
    return 0;
}

/* strip: which = 1 left, 2 right, 3 both. */
static chat_value str_strip(chat_value s, const chat_value *chars, int which) {
    size_t b = 0, e = s.u.str.n;
    if (which & 1)
        while (b < e) {
            size_t i = b;
            uint32_t cp = chat_utf8_next(s.u.str.s, e, &i);
            if (!in_chars(cp, chars)) break;
            b = i;
        }
    if (which & 2)
        while (e > b) {
            size_t p = e - 1;
            while (p > b && ((unsigned char)s.u.str.s[p] & 0xC0) == 0x80) p--;
            size_t i = p;
            uint32_t cp = chat_utf8_next(s.u.str.s, e, &i);
            if (i != e || !in_chars(cp, chars)) break;
            e = p;
        }
    return chat_str(s.u.str.s + b, e - b);
}

static chat_value str_map_case(chat_ev *E, chat_value s, int mode /* 0 lower 1 upper 2 capitalize 3 title */) {
    chat_buf b = {0};
    bput(E, &b, "", 0);
    int first = 1, prev_cased = 0;
    for (size_t i = 0; i < s.u.str.n;) {
        size_t st = i;
        uint32_t cp = chat_utf8_next(s.u.str.s, s.u.str.n, &i);
        if (i - st == 1 && cp >= 0x80) { /* invalid byte: copy as is */
            bput(E, &b, s.u.str.s + st, 1);
            continue;
        }
        int32_t out = (int32_t)cp;
        int up;
        if (mode == 0) up = 0;
        else if (mode == 1) up = 1;
        else if (mode == 2) up = first;
        else up = !prev_cased;
        out = up ? utf8proc_toupper((int32_t)cp) : utf8proc_tolower((int32_t)cp);
        const utf8proc_property_t *p = utf8proc_get_property((int32_t)cp);
        int cased = p->category == UTF8PROC_CATEGORY_LU || p->category == UTF8PROC_CATEGORY_LL ||
                    p->category == UTF8PROC_CATEGORY_LT;
        prev_cased = cased;
        first = 0;
        char u[4];
        bput(E, &b, u, chat_utf8_put((uint32_t)out, u));
    }
    return str_from_buf(&b);
}

/* Jinja's title filter: a word starts after a run of '-', whitespace, '(', '{', '[' or '<';
 * its first character is upper-cased, the rest lower-cased. */
static chat_value jinja_title(chat_ev *E, chat_value s) {
    chat_buf b = {0};
    bput(E, &b, "", 0);
    int at_start = 1;
    for (size_t i = 0; i < s.u.str.n;) {
        size_t st = i;
        uint32_t cp = chat_utf8_next(s.u.str.s, s.u.str.n, &i);
        int sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || chat_py_space(cp);
        chat_value one = str_map_case(E, chat_str(s.u.str.s + st, i - st), at_start ? 1 : 0);
        bput(E, &b, one.u.str.s, one.u.str.n);
        at_start = sep;
    }
    return str_from_buf(&b);
}

static chat_value str_replace(chat_ev *E, chat_value s, chat_value old, chat_value neu, int64_t count) {
    chat_buf b = {0};
    bput(E, &b, "", 0);
    if (old.u.str.n == 0) { /* Python inserts between every character */
        int64_t done = 0;
        for (size_t i = 0; i <= s.u.str.n;) {
            if (count < 0 || done < count) {
                bput(E, &b, neu.u.str.s, neu.u.str.n);
                done++;
            }
            if (i == s.u.str.n) break;
            size_t st = i;
            chat_utf8_next(s.u.str.s, s.u.str.n, &i);
            bput(E, &b, s.u.str.s + st, i - st);
        }
        return str_from_buf(&b);
    }
    size_t i = 0;
    int64_t done = 0;
    while (i < s.u.str.n) {
        const char *hit = (count < 0 || done < count)
                              ? memmem(s.u.str.s + i, s.u.str.n - i, old.u.str.s, old.u.str.n)
                              : NULL;
        if (!hit) break;
        size_t at = (size_t)(hit - s.u.str.s);
        bput(E, &b, s.u.str.s + i, at - i);
        bput(E, &b, neu.u.str.s, neu.u.str.n);
        i = at + old.u.str.n;
        done++;
    }
    bput(E, &b, s.u.str.s + i, s.u.str.n - i);
    return str_from_buf(&b);
}

static chat_value str_split(chat_ev *E, const chat_node *at, chat_value s, const chat_value *sep, int64_t maxsplit) {
    size_t cap = 8, n = 0;
    chat_value *items = chat_ev_alloc(E, cap * sizeof *items);
#define PUSH(v)                                                                  \
    do {                                                                         \
        if (n == cap) {                                                          \
            chat_value *p_ = chat_ev_alloc(E, cap * 2 * sizeof *p_);             \
            memcpy(p_, items, cap * sizeof *p_);                                 \
            items = p_;                                                          \
            cap *= 2;                                                            \
        }                                                                        \
        items[n++] = (v);                                                        \
    } while (0)
    if (!sep || sep->kind == CV_NONE) { /* runs of whitespace, no empty items */
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            while (i < s.u.str.n) {
                size_t j = i;
                if (!chat_py_space(chat_utf8_next(s.u.str.s, s.u.str.n, &j))) break;
                i = j;
            }
            if (i >= s.u.str.n) break;
            if (maxsplit >= 0 && splits >= maxsplit) {
                /* rest, with trailing whitespace stripped */
                chat_value rest = str_strip(chat_str(s.u.str.s + i, s.u.str.n - i), NULL, 2);
                PUSH(rest);
                break;
            }
            size_t st = i;
            while (i < s.u.str.n) {
                size_t j = i;
                if (chat_py_space(chat_utf8_next(s.u.str.s, s.u.str.n, &j))) break;
                i = j;
            }
            PUSH(chat_str(s.u.str.s + st, i - st));
            splits++;
        }
    } else {
        chat_value sp = want_str(E, at, *sep, "split()");
        if (sp.u.str.n == 0) chat_ev_fail(E, at, TQKV_EINVAL, "empty separator");
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            const char *hit = (maxsplit < 0 || splits < maxsplit)
                                  ? memmem(s.u.str.s + i, s.u.str.n - i, sp.u.str.s, sp.u.str.n)
                                  : NULL;
            if (!hit) {
                PUSH(chat_str(s.u.str.s + i, s.u.str.n - i));
                break;
            }
            size_t p = (size_t)(hit - s.u.str.s);
            PUSH(chat_str(s.u.str.s + i, p - i));
            i = p + sp.u.str.n;
            splits++;
        }
    }
#undef PUSH
    chat_value l = chat_ev_list(E, n);
    memcpy(l.u.list->items, items, n * sizeof *items);
    return l;
}

static chat_value join(chat_ev *E, const chat_node *at, chat_value seq, chat_value sep, const chat_value *attr) {
    chat_value items = chat_ev_iterable(E, at, seq);
    chat_buf b = {0};
    bput(E, &b, "", 0);
    for (size_t i = 0; i < items.u.list->n; i++) {
        if (i) bput(E, &b, sep.u.str.s, sep.u.str.n);
        chat_value v = items.u.list->items[i];
        if (attr) v = chat_ev_getattr(E, at, v, attr->u.str.s, attr->u.str.n);
        if (chat_value_str(E->a, &b, v)) chat_ev_oom(E);
    }
    return str_from_buf(&b);
}

/* ------------------------------------------------------------------------- */
/* Tests                                                                      */
/* ------------------------------------------------------------------------- */

static int test_apply(chat_ev *E, const chat_node *at, const char *name, size_t nn, chat_value v,
                      const chat_value *args, int n_args) {
    const chat_value *a0 = n_args > 0 ? &args[0] : NULL;
#define NEED_ARG()                                                                         \
    do {                                                                                   \
        if (!a0) chat_ev_fail(E, at, TQKV_EINVAL, "test '%.*s' needs an argument", (int)nn, name); \
    } while (0)
    if (is(name, nn, "defined")) return v.kind != CV_UNDEF;
    if (is(name, nn, "undefined")) return v.kind == CV_UNDEF;
    if (is(name, nn, "none")) return v.kind == CV_NONE;
    if (is(name, nn, "string")) return v.kind == CV_STR;
    if (is(name, nn, "mapping")) return v.kind == CV_DICT;
    if (is(name, nn, "iterable"))
        return v.kind == CV_STR || v.kind == CV_LIST || v.kind == CV_DICT || v.kind == CV_UNDEF;
    if (is(name, nn, "sequence"))
        return v.kind == CV_STR || v.kind == CV_LIST || v.kind == CV_DICT || v.kind == CV_UNDEF;
    if (is(name, nn, "number")) return v.kind == CV_INT || v.kind == CV_FLOAT || v.kind == CV_BOOL;
    if (is(name, nn, "integer")) return v.kind == CV_INT;
    if (is(name, nn, "float")) return v.kind == CV_FLOAT;
    if (is(name, nn, "boolean")) return v.kind == CV_BOOL;
    if (is(name, nn, "true")) return v.kind == CV_BOOL && v.u.i;
    if (is(name, nn, "false")) return v.kind == CV_BOOL && !v.u.i;
    if (is(name, nn, "callable")) return v.kind == CV_MACRO || v.kind == CV_FUNC || v.kind == CV_UNDEF;
    if (is(name, nn, "lower") || is(name, nn, "upper")) {
        v = chat_ev_to_str(E, v);
        chat_value m = str_map_case(E, v, is(name, nn, "upper"));
        return chat_equal(m, v) && !chat_equal(str_map_case(E, v, is(name, nn, "lower")), v);
    }
    if (is(name, nn, "odd") || is(name, nn, "even")) {
        int odd;
        if (v.kind == CV_FLOAT) odd = fmod(v.u.f, 2.0) != 0.0;
        else odd = (want_int(E, at, v, "odd/even") % 2) != 0;
        return is(name, nn, "odd") ? odd : !odd;
    }
    NEED_ARG();
    if (is(name, nn, "eq") || is(name, nn, "equalto") || is(name, nn, "==")) return chat_equal(v, *a0);
    if (is(name, nn, "ne") || is(name, nn, "!=")) return !chat_equal(v, *a0);
    if (is(name, nn, "sameas")) {
        if (v.kind != a0->kind) return 0;
        if (v.kind == CV_NONE || v.kind == CV_UNDEF) return 1;
        if (v.kind == CV_BOOL || v.kind == CV_INT) return v.u.i == a0->u.i;
        return chat_equal(v, *a0);
    }
    if (is(name, nn, "divisibleby")) {
        if (v.kind == CV_FLOAT || a0->kind == CV_FLOAT) {
            double x = v.kind == CV_FLOAT ? v.u.f : (double)want_int(E, at, v, "divisibleby");
            double d = a0->kind == CV_FLOAT ? a0->u.f : (double)want_int(E, at, *a0, "divisibleby");
            if (d == 0) chat_ev_fail(E, at, TQKV_EINVAL, "float modulo");
            return fmod(x, d) == 0.0;
        }
        int64_t d = want_int(E, at, *a0, "divisibleby");
        if (d == 0) chat_ev_fail(E, at, TQKV_EINVAL, "integer division or modulo by zero");
        if (d == -1) return 1;
        return want_int(E, at, v, "divisibleby") % d == 0;
    }
    if (is(name, nn, "in")) {
        if (a0->kind == CV_STR)
            return v.kind == CV_STR && (v.u.str.n == 0 || memmem(a0->u.str.s, a0->u.str.n, v.u.str.s, v.u.str.n));
        if (a0->kind == CV_LIST) {
            for (size_t i = 0; i < a0->u.list->n; i++)
                if (chat_equal(v, a0->u.list->items[i])) return 1;
            return 0;
        }
        if (a0->kind == CV_DICT) return v.kind == CV_STR && chat_dict_get(a0->u.dict, v.u.str.s, v.u.str.n);
        chat_ev_fail(E, at, TQKV_EINVAL, "argument of type '%s' is not iterable", chat_kind_name(a0->kind));
    }
    /* lt le gt ge */
    int c;
    if ((v.kind == CV_INT || v.kind == CV_FLOAT || v.kind == CV_BOOL) &&
        (a0->kind == CV_INT || a0->kind == CV_FLOAT || a0->kind == CV_BOOL)) {
        double x = v.kind == CV_FLOAT ? v.u.f : (double)v.u.i, y = a0->kind == CV_FLOAT ? a0->u.f : (double)a0->u.i;
        c = x < y ? -1 : x > y;
    } else if (v.kind == CV_STR && a0->kind == CV_STR) {
        size_t m = v.u.str.n < a0->u.str.n ? v.u.str.n : a0->u.str.n;
        c = memcmp(v.u.str.s, a0->u.str.s, m);
        if (!c) c = v.u.str.n < a0->u.str.n ? -1 : v.u.str.n > a0->u.str.n;
    } else chat_ev_fail(E, at, TQKV_EINVAL, "cannot compare '%s' and '%s'", chat_kind_name(v.kind), chat_kind_name(a0->kind));
    if (is(name, nn, "lt")) return c < 0;
    if (is(name, nn, "le")) return c <= 0;
    if (is(name, nn, "gt")) return c > 0;
    return c >= 0;
#undef NEED_ARG
}

int chat_ev_test(chat_ev *E, const chat_node *at, const char *name, size_t name_n, chat_value v,
                 const chat_value *args, int n_args) {
    return test_apply(E, at, name, name_n, v, args, n_args);
}

/* ------------------------------------------------------------------------- */
/* Filters                                                                    */
/* ------------------------------------------------------------------------- */

static int64_t length_of(chat_ev *E, const chat_node *at, chat_value v) {
    switch (v.kind) {
    case CV_UNDEF: return 0;
    case CV_STR: {
        int64_t c = 0;
        for (size_t i = 0; i < v.u.str.n;) {
            chat_utf8_next(v.u.str.s, v.u.str.n, &i);
            c++;
        }
        return c;
    }
    case CV_LIST: return (int64_t)v.u.list->n;
    case CV_DICT: return (int64_t)v.u.dict->n;
    default: chat_ev_fail(E, at, TQKV_EINVAL, "object of type '%s' has no len()", chat_kind_name(v.kind));
    }
}

static chat_value dict_items(chat_ev *E, const chat_node *at, chat_value v) {
    if (v.kind == CV_UNDEF) return chat_ev_list(E, 0);
    if (v.kind != CV_DICT)
        chat_ev_fail(E, at, TQKV_EINVAL, "items expects a mapping, got '%s'", chat_kind_name(v.kind));
    chat_value l = chat_ev_list(E, v.u.dict->n);
    for (size_t i = 0; i < v.u.dict->n; i++) {
        chat_value pair = chat_ev_list(E, 2);
        pair.u.list->tuple = 1;
        pair.u.list->items[0] = chat_str(v.u.dict->keys[i], v.u.dict->klen[i]);
        pair.u.list->items[1] = v.u.dict->vals[i];
        l.u.list->items[i] = pair;
    }
    return l;
}

static int sort_key_cmp(chat_ev *E, chat_value x, chat_value y, int case_sensitive) {
    if (x.kind == CV_STR && y.kind == CV_STR) {
        if (!case_sensitive) {
            x = str_map_case(E, x, 0);
            y = str_map_case(E, y, 0);
        }
        size_t m = x.u.str.n < y.u.str.n ? x.u.str.n : y.u.str.n;
        int c = memcmp(x.u.str.s, y.u.str.s, m);
        if (c) return c;
        return x.u.str.n < y.u.str.n ? -1 : x.u.str.n > y.u.str.n;
    }
    if ((x.kind == CV_INT || x.kind == CV_FLOAT || x.kind == CV_BOOL) &&
        (y.kind == CV_INT || y.kind == CV_FLOAT || y.kind == CV_BOOL)) {
        double a = x.kind == CV_FLOAT ? x.u.f : (double)x.u.i, b = y.kind == CV_FLOAT ? y.u.f : (double)y.u.i;
        return a < b ? -1 : a > b;
    }
    return -2; /* not comparable */
}

static chat_value dictsort(chat_ev *E, const chat_node *at, chat_value v, const argv_t *A) {
    static const char *const kw_ok[] = {"case_sensitive", "by", "reverse", NULL};
    check_arity(E, at, A, 3, kw_ok, "filter", "dictsort", 8);
    const chat_value *cs = arg(A, 0, "case_sensitive"), *by = arg(A, 1, "by"), *rev = arg(A, 2, "reverse");
    int case_sensitive = cs ? chat_truthy(*cs) : 0;
    int by_value = 0;
    if (by) {
        chat_value b = want_str(E, at, *by, "dictsort(by=)");
        if (is(b.u.str.s, b.u.str.n, "value")) by_value = 1;
        else if (!is(b.u.str.s, b.u.str.n, "key"))
            chat_ev_fail(E, at, TQKV_EINVAL, "You can only sort by either \"key\" or \"value\"");
    }
    int reverse = rev ? chat_truthy(*rev) : 0;
    if (v.kind == CV_UNDEF) chat_ev_undefined(E, at, v);
    chat_value l = dict_items(E, at, v);
    chat_value *it = l.u.list->items;
    size_t n = l.u.list->n;
    for (size_t i = 1; i < n; i++) { /* stable insertion sort */
        chat_value k = it[i];
        size_t j = i;
        while (j > 0) {
            chat_value x = it[j - 1].u.list->items[by_value], y = k.u.list->items[by_value];
            int c = sort_key_cmp(E, x, y, case_sensitive);
            if (c == -2)
                chat_ev_fail(E, at, TQKV_EINVAL, "'<' not supported between '%s' and '%s'", chat_kind_name(x.kind),
                             chat_kind_name(y.kind));
            if (reverse ? c >= 0 : c <= 0) break;
            it[j] = it[j - 1];
            j--;
        }
        it[j] = k;
    }
    return l;
}

/* select / reject / selectattr / rejectattr / map */
static chat_value select_like(chat_ev *E, const chat_node *at, chat_value v, const argv_t *A, int attr, int keep) {
    /* Jinja iterates only a truthy value: none, false, 0, "" select nothing */
    chat_value items = chat_truthy(v) ? chat_ev_iterable(E, at, v) : chat_ev_list(E, 0);
    int p = 0;
    const chat_value *attr_name = NULL;
    if (attr) {
        if (A->n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "selectattr/rejectattr need an attribute name");
        attr_name = &A->args[p++];
        want_str(E, at, *attr_name, "attribute name");
    }
    const chat_value *test = p < A->n_args ? &A->args[p++] : NULL;
    if (test) {
        want_str(E, at, *test, "test name");
        if (!chat_test_known(test->u.str.s, test->u.str.n))
            chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "test '%.*s' is not supported", (int)test->u.str.n, test->u.str.s);
    }
    chat_value out = chat_ev_list(E, items.u.list->n);
    size_t k = 0;
    for (size_t i = 0; i < items.u.list->n; i++) {
        chat_value x = items.u.list->items[i];
        chat_value probe = attr_name ? chat_ev_getattr(E, at, x, attr_name->u.str.s, attr_name->u.str.n) : x;
        int t = test ? test_apply(E, at, test->u.str.s, test->u.str.n, probe, A->args + p, A->n_args - p)
                     : chat_truthy(probe);
        if (t == keep) out.u.list->items[k++] = x;
    }
    out.u.list->n = k;
    return out;
}

static chat_value filter_apply(chat_ev *E, const chat_node *at, const char *name, size_t nn, chat_value v,
                               const argv_t *A);

static chat_value map_filter(chat_ev *E, const chat_node *at, chat_value v, const argv_t *A) {
    chat_value items = chat_truthy(v) ? chat_ev_iterable(E, at, v) : chat_ev_list(E, 0);
    chat_value out = chat_ev_list(E, items.u.list->n);
    const chat_value *attr = arg(A, -1, "attribute");
    if (attr) {
        want_str(E, at, *attr, "map(attribute=)");
        const chat_value *dflt = arg(A, -1, "default");
        for (size_t i = 0; i < items.u.list->n; i++) {
            chat_value x = chat_ev_getattr(E, at, items.u.list->items[i], attr->u.str.s, attr->u.str.n);
            if (x.kind == CV_UNDEF && dflt) x = *dflt;
            out.u.list->items[i] = x;
        }
        return out;
    }
    if (A->n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "map needs a filter name or attribute=");
    chat_value fname = want_str(E, at, A->args[0], "map filter name");
    if (!chat_filter_known(fname.u.str.s, fname.u.str.n) || is(fname.u.str.s, fname.u.str.n, "map"))
        chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "filter '%.*s' is not supported", (int)fname.u.str.n, fname.u.str.s);
    argv_t B = *A;
    B.args = A->args + 1;
    B.n_args = A->n_args - 1;
    for (size_t i = 0; i < items.u.list->n; i++)
        out.u.list->items[i] = filter_apply(E, at, fname.u.str.s, fname.u.str.n, items.u.list->items[i], &B);
    return out;
}

static chat_value tojson(chat_ev *E, const chat_node *at, chat_value v, const argv_t *A) {
    static const char *const kw_ok[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
    check_arity(E, at, A, 4, kw_ok, "filter", "tojson", 6);
    const chat_value *ea = arg(A, 0, "ensure_ascii"), *ind = arg(A, 1, "indent");
    const chat_value *seps = arg(A, 2, "separators"), *sk = arg(A, 3, "sort_keys");
    if (ea && chat_truthy(*ea))
        chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "tojson(ensure_ascii=True) is not supported");
    int indent = -1;
    if (ind && ind->kind != CV_NONE) {
        int64_t x = want_int(E, at, *ind, "tojson(indent=)");
        if (x < 0 || x > 64) chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "tojson indent out of range");
        indent = (int)x;
    }
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    if (seps && seps->kind != CV_NONE) {
        if (seps->kind != CV_LIST || seps->u.list->n != 2 || seps->u.list->items[0].kind != CV_STR ||
            seps->u.list->items[1].kind != CV_STR)
            chat_ev_fail(E, at, TQKV_EINVAL, "tojson separators must be a pair of strings");
        chat_value s0 = chat_ev_to_str(E, seps->u.list->items[0]), s1 = chat_ev_to_str(E, seps->u.list->items[1]);
        char *a = chat_ev_alloc(E, s0.u.str.n + 1), *b = chat_ev_alloc(E, s1.u.str.n + 1);
        memcpy(a, s0.u.str.s, s0.u.str.n);
        memcpy(b, s1.u.str.s, s1.u.str.n);
        item_sep = a;
        key_sep = b;
    }
    if (v.kind == CV_UNDEF) chat_ev_undefined(E, at, v);
    chat_buf b = {0};
    bput(E, &b, "", 0);
    int r = chat_value_json(E->a, &b, v, indent, 0, sk ? chat_truthy(*sk) : 0, item_sep, key_sep);
    if (r == -1) chat_ev_oom(E);
    if (r) chat_ev_fail(E, at, TQKV_EINVAL, "Object of type %s is not JSON serializable (or nested too deeply)",
                        chat_kind_name(v.kind));
    return str_from_buf(&b);
}

/* upper, lower, capitalize, title */
static chat_value filter_case(chat_ev *E, const chat_node *at, const char *name, size_t nn,
                              chat_value v, const argv_t *A) {
    check_arity(E, at, A, 0, NULL, "filter", name, nn);
    int mode = is(name, nn, "lower") ? 0 : is(name, nn, "upper") ? 1 : is(name, nn, "capitalize") ? 2 : 3;
    chat_value s = chat_ev_to_str(E, v);
    if (mode == 2) { /* first upper, rest lower */
        chat_value low = str_map_case(E, s, 0);
        size_t i = 0;
        if (low.u.str.n == 0) return low;
        chat_utf8_next(low.u.str.s, low.u.str.n, &i);
        chat_value head = str_map_case(E, chat_str(low.u.str.s, i), 1);
        chat_buf b = {0};
        bput(E, &b, head.u.str.s, head.u.str.n);
        bput(E, &b, low.u.str.s + i, low.u.str.n - i);
        return str_from_buf(&b);
    }
    if (mode == 3) return jinja_title(E, s);
    return str_map_case(E, s, mode);
}

static chat_value filter_reverse(chat_ev *E, const chat_node *at, const char *name, size_t nn,
                                 chat_value v, const argv_t *A) {
    check_arity(E, at, A, 0, NULL, "filter", name, nn);
    if (v.kind == CV_STR) {
        chat_value chars = chat_ev_iterable(E, at, v);
        chat_buf b = {0};
        bput(E, &b, "", 0);
        for (size_t i = chars.u.list->n; i-- > 0;)
            bput(E, &b, chars.u.list->items[i].u.str.s, chars.u.list->items[i].u.str.n);
        return str_from_buf(&b);
    }
    chat_value items = chat_ev_iterable(E, at, v);
    chat_value l = chat_ev_list(E, items.u.list->n);
    for (size_t i = 0; i < items.u.list->n; i++) l.u.list->items[i] = items.u.list->items[items.u.list->n - 1 - i];
    return l;
}

static chat_value filter_int(chat_ev *E, const chat_node *at, const char *name, size_t nn,
                             chat_value v, const argv_t *A) {
    static const char *const kw_ok[] = {"default", "base", NULL};
    check_arity(E, at, A, 2, kw_ok, "filter", name, nn);
    const chat_value *dv = arg(A, 0, "default");
    chat_value d = dv ? *dv : chat_int(0);
    if (v.kind == CV_UNDEF) chat_ev_undefined(E, at, v);
    if (v.kind == CV_INT) return v;
    if (v.kind == CV_BOOL) return chat_int(v.u.i);
    if (v.kind == CV_FLOAT) return isfinite(v.u.f) && fabs(v.u.f) < 9.2e18 ? chat_int((int64_t)v.u.f) : d;
    if (v.kind == CV_STR) {
        char tmp[64];
        chat_value s = str_strip(v, NULL, 3);
        if (s.u.str.n == 0 || s.u.str.n >= sizeof tmp) return d;
        memcpy(tmp, s.u.str.s, s.u.str.n);
        tmp[s.u.str.n] = 0;
        char *end;
        long long x = strtoll(tmp, &end, 10);
        if (*end == 0) return chat_int(x);
        double f = strtod(tmp, &end);
        if (*end == 0 && isfinite(f) && fabs(f) < 9.2e18) return chat_int((int64_t)f);
    }
    return d;
}

static chat_value filter_float(chat_ev *E, const chat_node *at, const char *name, size_t nn,
                               chat_value v, const argv_t *A) {
    static const char *const kw_ok[] = {"default", NULL};
    check_arity(E, at, A, 1, kw_ok, "filter", name, nn);
    const chat_value *dv = arg(A, 0, "default");
    chat_value r;
    memset(&r, 0, sizeof r);
    r.kind = CV_FLOAT;
    if (v.kind == CV_UNDEF) chat_ev_undefined(E, at, v);
    if (v.kind == CV_FLOAT) return v;
    if (v.kind == CV_INT || v.kind == CV_BOOL) {
        r.u.f = (double)v.u.i;
        return r;
    }
    if (v.kind == CV_STR) {
        char tmp[64];
        chat_value s = str_strip(v, NULL, 3);
        if (s.u.str.n && s.u.str.n < sizeof tmp) {
            memcpy(tmp, s.u.str.s, s.u.str.n);
            tmp[s.u.str.n] = 0;
            char *end;
            r.u.f = strtod(tmp, &end);
            if (*end == 0) return r;
        }
    }
    if (dv) return *dv;
    r.u.f = 0.0;
    return r;
}

static chat_value filter_abs(chat_ev *E, const chat_node *at, const char *name, size_t nn,
                             chat_value v, const argv_t *A) {
    check_arity(E, at, A, 0, NULL, "filter", name, nn);
    if (v.kind == CV_INT || v.kind == CV_BOOL) {
        if (v.u.i == INT64_MIN) chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "integer overflow in abs");
        return chat_int(v.u.i < 0 ? -v.u.i : v.u.i);
    }
    if (v.kind == CV_FLOAT) {
        chat_value r = v;
        r.u.f = fabs(v.u.f);
        return r;
    }
    chat_ev_fail(E, at, TQKV_EINVAL, "bad operand type for abs(): '%s'", chat_kind_name(v.kind));
}

static chat_value filter_apply(chat_ev *E, const chat_node *at, const char *name, size_t nn, chat_value v,
                               const argv_t *A) {
    if (is(name, nn, "trim")) {
        static const char *const kw_ok[] = {"chars", NULL};
        check_arity(E, at, A, 1, kw_ok, "filter", name, nn);
        const chat_value *chars = arg(A, 0, "chars");
        if (chars && chars->kind == CV_NONE) chars = NULL;
        if (chars) want_str(E, at, *chars, "trim(chars)");
        return str_strip(chat_ev_to_str(E, v), chars, 3);
    }
    if (is(name, nn, "length") || is(name, nn, "count")) {
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        return chat_int(length_of(E, at, v));
    }
    if (is(name, nn, "tojson")) return tojson(E, at, v, A);
    if (is(name, nn, "first") || is(name, nn, "last")) {
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        if (v.kind == CV_UNDEF) return chat_ev_undef("No first item, sequence was empty.", 34);
        chat_value items = chat_ev_iterable(E, at, v);
        if (items.u.list->n == 0) return chat_ev_undef("No first item, sequence was empty.", 34);
        return is(name, nn, "first") ? items.u.list->items[0] : items.u.list->items[items.u.list->n - 1];
    }
    if (is(name, nn, "string")) {
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        return chat_ev_to_str(E, v);
    }
    if (is(name, nn, "safe")) { /* Markup(str(value)); autoescape is off, so only the str() shows */
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        return chat_ev_to_str(E, v);
    }
    if (is(name, nn, "default") || is(name, nn, "d")) {
        static const char *const kw_ok[] = {"default_value", "boolean", NULL};
        check_arity(E, at, A, 2, kw_ok, "filter", name, nn);
        const chat_value *dv = arg(A, 0, "default_value"), *bo = arg(A, 1, "boolean");
        int use = v.kind == CV_UNDEF || (bo && chat_truthy(*bo) && !chat_truthy(v));
        if (!use) return v;
        return dv ? *dv : chat_str("", 0);
    }
    if (is(name, nn, "join")) {
        static const char *const kw_ok[] = {"d", "attribute", NULL};
        check_arity(E, at, A, 2, kw_ok, "filter", name, nn);
        const chat_value *sep = arg(A, 0, "d"), *attr = arg(A, 1, "attribute");
        if (attr) want_str(E, at, *attr, "join(attribute=)");
        return join(E, at, v, sep ? chat_ev_to_str(E, *sep) : chat_str("", 0), attr);
    }
    if (is(name, nn, "upper") || is(name, nn, "lower") || is(name, nn, "capitalize") || is(name, nn, "title"))
        return filter_case(E, at, name, nn, v, A);
    if (is(name, nn, "list")) {
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        chat_value items = chat_ev_iterable(E, at, v);
        chat_value l = chat_ev_list(E, items.u.list->n);
        memcpy(l.u.list->items, items.u.list->items, items.u.list->n * sizeof(chat_value));
        return l;
    }
    if (is(name, nn, "reverse")) return filter_reverse(E, at, name, nn, v, A);
    if (is(name, nn, "items")) {
        check_arity(E, at, A, 0, NULL, "filter", name, nn);
        return dict_items(E, at, v);
    }
    if (is(name, nn, "dictsort")) return dictsort(E, at, v, A);
    if (is(name, nn, "map")) return map_filter(E, at, v, A);
    if (is(name, nn, "select")) return select_like(E, at, v, A, 0, 1);
    if (is(name, nn, "reject")) return select_like(E, at, v, A, 0, 0);
    if (is(name, nn, "selectattr")) return select_like(E, at, v, A, 1, 1);
    if (is(name, nn, "rejectattr")) return select_like(E, at, v, A, 1, 0);
    if (is(name, nn, "int")) return filter_int(E, at, name, nn, v, A);
    if (is(name, nn, "float")) return filter_float(E, at, name, nn, v, A);
    if (is(name, nn, "abs")) return filter_abs(E, at, name, nn, v, A);
    if (is(name, nn, "replace")) {
        static const char *const kw_ok[] = {"old", "new", "count", NULL};
        check_arity(E, at, A, 3, kw_ok, "filter", name, nn);
        const chat_value *o = arg(A, 0, "old"), *w = arg(A, 1, "new"), *c = arg(A, 2, "count");
        if (!o || !w) chat_ev_fail(E, at, TQKV_EINVAL, "replace needs old and new");
        int64_t count = c && c->kind != CV_NONE ? want_int(E, at, *c, "replace(count)") : -1;
        return str_replace(E, chat_ev_to_str(E, v), chat_ev_to_str(E, *o), chat_ev_to_str(E, *w), count);
    }
    chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "filter '%.*s' is not supported", (int)nn, name);
}

chat_value chat_ev_filter(chat_ev *E, const chat_node *at, const char *name, size_t name_n, chat_value v,
                          const chat_value *args, int n_args, const char *const *kwn, const size_t *kwl,
                          const chat_value *kw, int n_kw) {
    argv_t A = {args, n_args, kwn, kwl, kw, n_kw};
    return filter_apply(E, at, name, name_n, v, &A);
}

/* ------------------------------------------------------------------------- */
/* Methods                                                                    */
/* ------------------------------------------------------------------------- */

static int prefix_match(chat_ev *E, const chat_node *at, chat_value s, chat_value p, int suffix) {
    if (p.kind == CV_LIST) { /* tuple of prefixes */
        for (size_t i = 0; i < p.u.list->n; i++)
            if (prefix_match(E, at, s, p.u.list->items[i], suffix)) return 1;
        return 0;
    }
    want_str(E, at, p, suffix ? "endswith()" : "startswith()");
    if (p.u.str.n > s.u.str.n) return 0;
    const char *at_s = suffix ? s.u.str.s + s.u.str.n - p.u.str.n : s.u.str.s;
    return memcmp(at_s, p.u.str.s, p.u.str.n) == 0;
}

chat_value chat_ev_method(chat_ev *E, const chat_node *at, chat_value obj, const char *name, size_t nn,
                          const chat_value *args, int n_args, const char *const *kwn, const size_t *kwl,
                          const chat_value *kw, int n_kw) {
    argv_t A = {args, n_args, kwn, kwl, kw, n_kw};
    if (obj.kind == CV_UNDEF) chat_ev_undefined(E, at, obj);
    if (obj.kind == CV_STR) {
        if (is(name, nn, "startswith") || is(name, nn, "endswith")) {
            check_arity(E, at, &A, 1, NULL, "method", name, nn);
            if (n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "%.*s() needs an argument", (int)nn, name);
            return chat_bool(prefix_match(E, at, obj, args[0], is(name, nn, "endswith")));
        }
        if (is(name, nn, "strip") || is(name, nn, "lstrip") || is(name, nn, "rstrip")) {
            check_arity(E, at, &A, 1, NULL, "method", name, nn);
            const chat_value *chars = n_args > 0 && args[0].kind != CV_NONE ? &args[0] : NULL;
            if (chars) want_str(E, at, *chars, "strip()");
            return str_strip(obj, chars, name[0] == 'l' ? 1 : name[0] == 'r' ? 2 : 3);
        }
        if (is(name, nn, "split")) {
            static const char *const kw_ok[] = {"sep", "maxsplit", NULL};
            check_arity(E, at, &A, 2, kw_ok, "method", name, nn);
            const chat_value *sep = arg(&A, 0, "sep"), *mx = arg(&A, 1, "maxsplit");
            return str_split(E, at, obj, sep, mx ? want_int(E, at, *mx, "split(maxsplit)") : -1);
        }
        if (is(name, nn, "replace")) {
            check_arity(E, at, &A, 3, NULL, "method", name, nn);
            if (n_args < 2) chat_ev_fail(E, at, TQKV_EINVAL, "replace() needs old and new");
            return str_replace(E, obj, want_str(E, at, args[0], "replace()"), want_str(E, at, args[1], "replace()"),
                               n_args > 2 ? want_int(E, at, args[2], "replace(count)") : -1);
        }
        if (is(name, nn, "title")) { /* Python's str.title(), not Jinja's title filter */
            check_arity(E, at, &A, 0, NULL, "method", name, nn);
            return str_map_case(E, str_map_case(E, obj, 0), 3);
        }
        if (is(name, nn, "upper") || is(name, nn, "lower") || is(name, nn, "capitalize")) {
            check_arity(E, at, &A, 0, NULL, "method", name, nn);
            return filter_apply(E, at, name, nn, obj, &A);
        }
        if (is(name, nn, "find") || is(name, nn, "count")) {
            check_arity(E, at, &A, 1, NULL, "method", name, nn);
            if (n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "%.*s() needs an argument", (int)nn, name);
            chat_value sub = want_str(E, at, args[0], "find()/count()");
            if (is(name, nn, "find")) {
                const char *hit = sub.u.str.n ? memmem(obj.u.str.s, obj.u.str.n, sub.u.str.s, sub.u.str.n) : obj.u.str.s;
                if (!hit) return chat_int(-1);
                int64_t cps = 0; /* code point index */
                for (size_t i = 0; i < (size_t)(hit - obj.u.str.s);) {
                    chat_utf8_next(obj.u.str.s, obj.u.str.n, &i);
                    cps++;
                }
                return chat_int(cps);
            }
            if (sub.u.str.n == 0) return chat_int(length_of(E, at, obj) + 1);
            int64_t c = 0;
            for (size_t i = 0; i < obj.u.str.n;) {
                const char *hit = memmem(obj.u.str.s + i, obj.u.str.n - i, sub.u.str.s, sub.u.str.n);
                if (!hit) break;
                c++;
                i = (size_t)(hit - obj.u.str.s) + sub.u.str.n;
            }
            return chat_int(c);
        }
        if (is(name, nn, "join")) {
            check_arity(E, at, &A, 1, NULL, "method", name, nn);
            if (n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "join() needs an argument");
            chat_value items = chat_ev_iterable(E, at, args[0]);
            for (size_t i = 0; i < items.u.list->n; i++)
                if (items.u.list->items[i].kind != CV_STR)
                    chat_ev_fail(E, at, TQKV_EINVAL, "sequence item %zu: expected str instance, %s found", i,
                                 chat_kind_name(items.u.list->items[i].kind));
            return join(E, at, items, obj, NULL);
        }
    }
    if (obj.kind == CV_DICT) {
        if (is(name, nn, "items")) {
            check_arity(E, at, &A, 0, NULL, "method", name, nn);
            return dict_items(E, at, obj);
        }
        if (is(name, nn, "keys") || is(name, nn, "values")) {
            check_arity(E, at, &A, 0, NULL, "method", name, nn);
            chat_value l = chat_ev_list(E, obj.u.dict->n);
            for (size_t i = 0; i < obj.u.dict->n; i++)
                l.u.list->items[i] = name[0] == 'k' ? chat_str(obj.u.dict->keys[i], obj.u.dict->klen[i])
                                                    : obj.u.dict->vals[i];
            return l;
        }
        if (is(name, nn, "get")) {
            check_arity(E, at, &A, 2, NULL, "method", name, nn);
            if (n_args < 1) chat_ev_fail(E, at, TQKV_EINVAL, "get() needs a key");
            const chat_value *v = args[0].kind == CV_STR ? chat_dict_get(obj.u.dict, args[0].u.str.s, args[0].u.str.n) : NULL;
            if (v) return *v;
            if (n_args > 1) return args[1];
            chat_value none;
            memset(&none, 0, sizeof none);
            none.kind = CV_NONE;
            return none;
        }
    }
    chat_ev_fail(E, at, TQKV_EINVAL, "'%s' object has no method '%.*s'", chat_kind_name(obj.kind), (int)nn, name);
}

/* ------------------------------------------------------------------------- */
/* Global functions                                                           */
/* ------------------------------------------------------------------------- */

chat_value chat_ev_func(chat_ev *E, const chat_node *at, int func, const chat_value *args, int n_args,
                        const char *const *kwn, const size_t *kwl, const chat_value *kw, int n_kw) {
    switch (func) {
    case CF_RAISE: {
        chat_value m = n_args > 0 ? chat_ev_to_str(E, args[0]) : chat_str("", 0);
        /* the template's own message, verbatim (it is what the caller shows to users); an
         * empty one (raise_exception() or raise_exception('')) still says what failed */
        if (m.u.str.n == 0) tqkv_fail(TQKV_EINVAL, "chat template: raise_exception() without a message");
        else tqkv_fail(TQKV_EINVAL, "%.*s", (int)(m.u.str.n > 400 ? 400 : m.u.str.n), m.u.str.s);
        E->err = TQKV_EINVAL;
        longjmp(E->jb, 1);
    }
    case CF_NAMESPACE:
    case CF_DICT: {
        chat_value d = chat_ev_new_dict(E, func == CF_NAMESPACE ? CV_NS : CV_DICT);
        if (n_args > 1) chat_ev_fail(E, at, TQKV_EINVAL, "%s() takes at most 1 positional argument", k_funcs[func]);
        if (n_args == 1) {
            if (args[0].kind != CV_DICT && args[0].kind != CV_NS)
                chat_ev_fail(E, at, TQKV_EINVAL, "%s() positional argument must be a mapping", k_funcs[func]);
            for (size_t i = 0; i < args[0].u.dict->n; i++)
                chat_ev_dict_set(E, d.u.dict, args[0].u.dict->keys[i], args[0].u.dict->klen[i], args[0].u.dict->vals[i]);
        }
        for (int i = 0; i < n_kw; i++) chat_ev_dict_set(E, d.u.dict, kwn[i], kwl[i], kw[i]);
        return d;
    }
    case CF_RANGE: {
        if (n_kw) chat_ev_fail(E, at, TQKV_EINVAL, "range() takes no keyword arguments");
        if (n_args < 1 || n_args > 3) chat_ev_fail(E, at, TQKV_EINVAL, "range expected 1 to 3 arguments");
        int64_t start = 0, stop, step = 1;
        if (n_args == 1) stop = want_int(E, at, args[0], "range()");
        else {
            start = want_int(E, at, args[0], "range()");
            stop = want_int(E, at, args[1], "range()");
            if (n_args == 3) step = want_int(E, at, args[2], "range()");
        }
        if (step == 0) chat_ev_fail(E, at, TQKV_EINVAL, "range() arg 3 must not be zero");
        double count = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                                : ceil(((double)start - (double)stop) / (double)-step);
        if (count < 0) count = 0;
        if (count > CHAT_MAX_RANGE)
            chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "range() longer than %d items", CHAT_MAX_RANGE);
        chat_value l = chat_ev_list(E, (size_t)count);
        for (size_t i = 0; i < (size_t)count; i++) l.u.list->items[i] = chat_int(start + (int64_t)i * step);
        return l;
    }
    case CF_STRFTIME_NOW: {
        if (n_args != 1) chat_ev_fail(E, at, TQKV_EINVAL, "strftime_now() takes one format argument");
        chat_value f = want_str(E, at, args[0], "strftime_now()");
        char fmt[128], out[256];
        if (f.u.str.n >= sizeof fmt) chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "strftime_now format too long");
        memcpy(fmt, f.u.str.s, f.u.str.n);
        fmt[f.u.str.n] = 0;
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        size_t k = strftime(out, sizeof out, fmt, &tmv);
        char *p = chat_ev_alloc(E, k + 1);
        memcpy(p, out, k);
        return chat_str(p, k);
    }
    default: chat_ev_fail(E, at, TQKV_EINVAL, "internal: unknown function");
    }
}

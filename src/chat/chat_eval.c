/*
 * chat_eval.c - the chat-template evaluator: runs a parsed template over the render's
 * variables with Jinja2's semantics (scoping, undefined values, Python operators).
 *
 * Owns: statements (output, if, for + loop object, set, macro, break/continue),
 * expressions (names, attributes, subscripts, slices, calls, operators), the
 * render entry point.
 * Must not: parse, keep state between renders, touch the template (renders may run
 * concurrently on one template).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "chat/chat_eval.h"
#include "util/common.h"

/* ------------------------------------------------------------------------- */
/* Errors and checked helpers                                                 */
/* ------------------------------------------------------------------------- */

_Noreturn void chat_ev_fail(chat_ev *E, const chat_node *at, tqkv_status s, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at) tqkv_fail(s, "chat template %d:%d: %s", at->line, at->col, msg);
    else tqkv_fail(s, "chat template: %s", msg);
    E->err = s;
    longjmp(E->jb, 1);
}

_Noreturn void chat_ev_oom(chat_ev *E) {
    tqkv_fail(TQKV_ENOMEM, "chat template: out of memory (render arena limit or malloc)");
    E->err = TQKV_ENOMEM;
    longjmp(E->jb, 1);
}

_Noreturn void chat_ev_undefined(chat_ev *E, const chat_node *at, chat_value u) {
    if (u.u.str.s && u.u.str.n)
        chat_ev_fail(E, at, TQKV_EINVAL, "%.*s", (int)(u.u.str.n > 200 ? 200 : u.u.str.n), u.u.str.s);
    chat_ev_fail(E, at, TQKV_EINVAL, "value is undefined");
}

void *chat_ev_alloc(chat_ev *E, size_t n) {
    void *p = chat_arena_alloc(E->a, n);
    if (!p) chat_ev_oom(E);
    return p;
}

chat_value chat_ev_undef(const char *msg, size_t n) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_UNDEF;
    v.u.str.s = msg;
    v.u.str.n = n;
    return v;
}

chat_value chat_ev_list(chat_ev *E, size_t n) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_LIST;
    v.u.list = chat_ev_alloc(E, sizeof *v.u.list);
    v.u.list->n = n;
    v.u.list->items = chat_ev_alloc(E, (n ? n : 1) * sizeof(chat_value));
    return v;
}

chat_value chat_ev_new_dict(chat_ev *E, chat_kind kind) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = kind;
    v.u.dict = chat_dict_new(E->a, 8);
    if (!v.u.dict) chat_ev_oom(E);
    return v;
}

void chat_ev_dict_set(chat_ev *E, chat_dict *d, const char *k, size_t kn, chat_value v) {
    if (chat_dict_set(E->a, d, k, kn, v)) chat_ev_oom(E);
}

chat_value chat_ev_to_str(chat_ev *E, chat_value v) {
    if (v.kind == CV_STR) return v;
    chat_buf b = {0};
    if (chat_buf_put(E->a, &b, "", 0) || chat_value_str(E->a, &b, v)) chat_ev_oom(E);
    return chat_str(b.s, b.n);
}

static chat_value fmt_undef(chat_ev *E, const char *fmt, const char *s, size_t n) {
    char tmp[256];
    int k = snprintf(tmp, sizeof tmp, fmt, (int)(n > 100 ? 100 : n), s);
    if (k < 0) k = 0;
    if ((size_t)k >= sizeof tmp) k = (int)sizeof tmp - 1;
    char *p = chat_ev_alloc(E, (size_t)k + 1);
    memcpy(p, tmp, (size_t)k);
    return chat_ev_undef(p, (size_t)k);
}

chat_value chat_ev_iterable(chat_ev *E, const chat_node *at, chat_value v) {
    switch (v.kind) {
    case CV_LIST: return v;
    case CV_UNDEF: return chat_ev_list(E, 0);
    case CV_DICT: {
        chat_value l = chat_ev_list(E, v.u.dict->n);
        for (size_t i = 0; i < v.u.dict->n; i++) l.u.list->items[i] = chat_str(v.u.dict->keys[i], v.u.dict->klen[i]);
        return l;
    }
    case CV_STR: {
        size_t count = 0;
        for (size_t i = 0; i < v.u.str.n;) {
            chat_utf8_next(v.u.str.s, v.u.str.n, &i);
            count++;
        }
        chat_value l = chat_ev_list(E, count);
        size_t k = 0;
        for (size_t i = 0; i < v.u.str.n;) {
            size_t s = i;
            chat_utf8_next(v.u.str.s, v.u.str.n, &i);
            l.u.list->items[k++] = chat_str(v.u.str.s + s, i - s);
        }
        return l;
    }
    default:
        chat_ev_fail(E, at, TQKV_EINVAL, "'%s' object is not iterable", chat_kind_name(v.kind));
    }
}

chat_value chat_ev_getattr(chat_ev *E, const chat_node *at, chat_value obj, const char *name, size_t n) {
    if (obj.kind == CV_UNDEF) chat_ev_undefined(E, at, obj);
    if (obj.kind == CV_DICT || obj.kind == CV_NS) {
        const chat_value *v = chat_dict_get(obj.u.dict, name, n);
        if (v) return *v;
        return fmt_undef(E, obj.kind == CV_NS ? "'Namespace' object has no attribute '%.*s'"
                                              : "'dict object' has no attribute '%.*s'", name, n);
    }
    char what[64];
    snprintf(what, sizeof what, "'%s object' has no attribute '%%.*s'", chat_kind_name(obj.kind));
    return fmt_undef(E, what, name, n);
}

/* ------------------------------------------------------------------------- */
/* Variables                                                                  */
/* ------------------------------------------------------------------------- */

static const chat_value *lookup(const chat_frame *f, const char *name, size_t n) {
    for (; f; f = f->parent) {
        const chat_value *v = chat_dict_get(f->vars, name, n);
        if (v) return v;
    }
    return NULL;
}

static chat_frame *frame_new(chat_ev *E, chat_frame *parent) {
    chat_frame *f = chat_ev_alloc(E, sizeof *f);
    f->parent = parent;
    f->vars = chat_dict_new(E->a, 8);
    if (!f->vars) chat_ev_oom(E);
    return f;
}

/* ------------------------------------------------------------------------- */
/* Operators                                                                  */
/* ------------------------------------------------------------------------- */

static int is_num(chat_value v) { return v.kind == CV_BOOL || v.kind == CV_INT || v.kind == CV_FLOAT; }
static double as_f(chat_value v) { return v.kind == CV_FLOAT ? v.u.f : (double)v.u.i; }

static chat_value mk_float(double f) {
    chat_value v;
    memset(&v, 0, sizeof v);
    v.kind = CV_FLOAT;
    v.u.f = f;
    return v;
}

static const char *op_text(int op) {
    switch (op) {
    case OP_ADD: return "+";
    case OP_SUB: return "-";
    case OP_MUL: return "*";
    case OP_DIV: return "/";
    case OP_FLOORDIV: return "//";
    case OP_MOD: return "%";
    case OP_POW: return "**";
    case OP_LT: return "<";
    case OP_LE: return "<=";
    case OP_GT: return ">";
    case OP_GE: return ">=";
    default: return "?";
    }
}

static _Noreturn void bad_operands(chat_ev *E, const chat_node *at, int op, chat_value x, chat_value y) {
    if (x.kind == CV_UNDEF) chat_ev_undefined(E, at, x);
    if (y.kind == CV_UNDEF) chat_ev_undefined(E, at, y);
    chat_ev_fail(E, at, TQKV_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'", op_text(op),
                 chat_kind_name(x.kind), chat_kind_name(y.kind));
}

static chat_value concat(chat_ev *E, chat_value x, chat_value y) {
    chat_buf b = {0};
    if (chat_buf_put(E->a, &b, x.u.str.s, x.u.str.n) || chat_buf_put(E->a, &b, y.u.str.s, y.u.str.n))
        chat_ev_oom(E);
    return chat_str(b.s, b.n);
}

static chat_value arith(chat_ev *E, const chat_node *at, int op, chat_value x, chat_value y) {
    if (op == OP_TILDE) return concat(E, chat_ev_to_str(E, x), chat_ev_to_str(E, y));
    if (op == OP_ADD && x.kind == CV_STR && y.kind == CV_STR) return concat(E, x, y);
    if (op == OP_ADD && x.kind == CV_LIST && y.kind == CV_LIST) {
        chat_value l = chat_ev_list(E, x.u.list->n + y.u.list->n);
        memcpy(l.u.list->items, x.u.list->items, x.u.list->n * sizeof(chat_value));
        memcpy(l.u.list->items + x.u.list->n, y.u.list->items, y.u.list->n * sizeof(chat_value));
        return l;
    }
    if (op == OP_MUL && ((x.kind == CV_STR && (y.kind == CV_INT || y.kind == CV_BOOL)) ||
                         (y.kind == CV_STR && (x.kind == CV_INT || x.kind == CV_BOOL)))) {
        chat_value s = x.kind == CV_STR ? x : y;
        int64_t times = x.kind == CV_STR ? y.u.i : x.u.i;
        chat_buf b = {0};
        if (chat_buf_put(E->a, &b, "", 0)) chat_ev_oom(E);
        for (int64_t i = 0; i < times; i++)
            if (chat_buf_put(E->a, &b, s.u.str.s, s.u.str.n)) chat_ev_oom(E);
        return chat_str(b.s, b.n);
    }
    if (op == OP_MUL && ((x.kind == CV_LIST && (y.kind == CV_INT || y.kind == CV_BOOL)) ||
                         (y.kind == CV_LIST && (x.kind == CV_INT || x.kind == CV_BOOL)))) {
        chat_value l = x.kind == CV_LIST ? x : y;
        int64_t times = x.kind == CV_LIST ? y.u.i : x.u.i;
        if (times < 0) times = 0;
        if (l.u.list->n && (uint64_t)times > (uint64_t)CHAT_MAX_RANGE / l.u.list->n)
            chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "list repetition longer than %d items", CHAT_MAX_RANGE);
        chat_value r = chat_ev_list(E, l.u.list->n * (size_t)times);
        r.u.list->tuple = l.u.list->tuple;
        for (int64_t k = 0; k < times; k++)
            memcpy(r.u.list->items + (size_t)k * l.u.list->n, l.u.list->items, l.u.list->n * sizeof(chat_value));
        return r;
    }
    if (!is_num(x) || !is_num(y)) bad_operands(E, at, op, x, y);
    if (x.kind != CV_FLOAT && y.kind != CV_FLOAT && op != OP_DIV) {
        int64_t a = x.u.i, b = y.u.i, r = 0;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(a, b, &r)) goto overflow;
            return chat_int(r);
        case OP_SUB:
            if (__builtin_sub_overflow(a, b, &r)) goto overflow;
            return chat_int(r);
        case OP_MUL:
            if (__builtin_mul_overflow(a, b, &r)) goto overflow;
            return chat_int(r);
        case OP_FLOORDIV:
        case OP_MOD: {
            if (b == 0) chat_ev_fail(E, at, TQKV_EINVAL, "integer division or modulo by zero");
            if (a == INT64_MIN && b == -1) goto overflow;
            int64_t q = a / b, m = a % b;
            if (m != 0 && ((m < 0) != (b < 0))) {
                q -= 1;
                m += b;
            }
            return chat_int(op == OP_FLOORDIV ? q : m);
        }
        case OP_POW: {
            if (b < 0) return mk_float(pow((double)a, (double)b));
            int64_t acc = 1;
            for (int64_t i = 0; i < b; i++)
                if (__builtin_mul_overflow(acc, a, &acc)) goto overflow;
            return chat_int(acc);
        }
        default: break;
        }
    }
    {
        double a = as_f(x), b = as_f(y);
        switch (op) {
        case OP_ADD: return mk_float(a + b);
        case OP_SUB: return mk_float(a - b);
        case OP_MUL: return mk_float(a * b);
        case OP_DIV:
            if (b == 0) chat_ev_fail(E, at, TQKV_EINVAL, "division by zero");
            return mk_float(a / b);
        case OP_FLOORDIV:
            if (b == 0) chat_ev_fail(E, at, TQKV_EINVAL, "float floor division by zero");
            return mk_float(floor(a / b));
        case OP_MOD: {
            if (b == 0) chat_ev_fail(E, at, TQKV_EINVAL, "float modulo by zero");
            double m = fmod(a, b);
            if (m != 0 && ((m < 0) != (b < 0))) m += b;
            return mk_float(m);
        }
        case OP_POW: return mk_float(pow(a, b));
        default: break;
        }
    }
overflow:
    chat_ev_fail(E, at, TQKV_EUNSUPPORTED, "integer overflow (64-bit) in '%s'", op_text(op));
}

static int str_cmp(chat_value x, chat_value y) {
    size_t m = x.u.str.n < y.u.str.n ? x.u.str.n : y.u.str.n;
    int c = memcmp(x.u.str.s, y.u.str.s, m);
    if (c) return c;
    return x.u.str.n < y.u.str.n ? -1 : x.u.str.n > y.u.str.n ? 1 : 0;
}

static int contains(chat_ev *E, const chat_node *at, chat_value item, chat_value seq) {
    switch (seq.kind) {
    case CV_STR:
        if (item.kind != CV_STR)
            chat_ev_fail(E, at, TQKV_EINVAL, "'in <string>' requires string as left operand, not %s",
                         chat_kind_name(item.kind));
        if (item.u.str.n == 0) return 1;
        return memmem(seq.u.str.s, seq.u.str.n, item.u.str.s, item.u.str.n) != NULL;
    case CV_LIST:
        for (size_t i = 0; i < seq.u.list->n; i++)
            if (chat_equal(item, seq.u.list->items[i])) return 1;
        return 0;
    case CV_DICT:
    case CV_NS:
        if (item.kind == CV_LIST || item.kind == CV_DICT)
            chat_ev_fail(E, at, TQKV_EINVAL, "unhashable type: '%s'", chat_kind_name(item.kind));
        return item.kind == CV_STR && chat_dict_get(seq.u.dict, item.u.str.s, item.u.str.n) != NULL;
    case CV_UNDEF: return 0;
    default:
        chat_ev_fail(E, at, TQKV_EINVAL, "argument of type '%s' is not iterable", chat_kind_name(seq.kind));
    }
}

static int compare(chat_ev *E, const chat_node *at, int op, chat_value x, chat_value y) {
    switch (op) {
    case OP_EQ: return chat_equal(x, y);
    case OP_NE: return !chat_equal(x, y);
    case OP_IN: return contains(E, at, x, y);
    case OP_NOTIN: return !contains(E, at, x, y);
    default: break;
    }
    int c;
    if (is_num(x) && is_num(y)) {
        double a = as_f(x), b = as_f(y);
        if (x.kind != CV_FLOAT && y.kind != CV_FLOAT) c = x.u.i < y.u.i ? -1 : x.u.i > y.u.i;
        else c = a < b ? -1 : a > b ? 1 : 0;
        if (isnan(a) || isnan(b)) return 0;
    } else if (x.kind == CV_STR && y.kind == CV_STR) c = str_cmp(x, y);
    else if (x.kind == CV_LIST && y.kind == CV_LIST) { /* lexicographic, as Python */
        size_t k = 0;
        while (k < x.u.list->n && k < y.u.list->n && chat_equal(x.u.list->items[k], y.u.list->items[k])) k++;
        if (k < x.u.list->n && k < y.u.list->n) return compare(E, at, op, x.u.list->items[k], y.u.list->items[k]);
        c = x.u.list->n < y.u.list->n ? -1 : x.u.list->n > y.u.list->n;
    } else bad_operands(E, at, op, x, y);
    switch (op) {
    case OP_LT: return c < 0;
    case OP_LE: return c <= 0;
    case OP_GT: return c > 0;
    default: return c >= 0;
    }
}

/* ------------------------------------------------------------------------- */
/* Subscripts and slices (Python semantics; strings index by code point)     */
/* ------------------------------------------------------------------------- */

/* Byte offsets of each code point of s, plus the end: offs[0..count]. */
static size_t *cp_offsets(chat_ev *E, chat_value s, size_t *count) {
    size_t c = 0;
    for (size_t i = 0; i < s.u.str.n;) {
        chat_utf8_next(s.u.str.s, s.u.str.n, &i);
        c++;
    }
    size_t *offs = chat_ev_alloc(E, (c + 1) * sizeof *offs);
    size_t k = 0;
    for (size_t i = 0; i < s.u.str.n;) {
        offs[k++] = i;
        chat_utf8_next(s.u.str.s, s.u.str.n, &i);
    }
    offs[c] = s.u.str.n;
    *count = c;
    return offs;
}

static int as_index(chat_value v, int64_t *out) {
    if (v.kind == CV_INT || v.kind == CV_BOOL) {
        *out = v.u.i;
        return 1;
    }
    return 0;
}

static chat_value get_item(chat_ev *E, const chat_node *at, chat_value obj, chat_value key) {
    int64_t i;
    switch (obj.kind) {
    case CV_UNDEF: chat_ev_undefined(E, at, obj);
    case CV_LIST:
        if (!as_index(key, &i)) break;
        if (i < 0) i += (int64_t)obj.u.list->n;
        if (i < 0 || i >= (int64_t)obj.u.list->n) return chat_ev_undef("list index out of range", 23);
        return obj.u.list->items[i];
    case CV_STR: {
        if (!as_index(key, &i)) break;
        size_t count;
        size_t *offs = cp_offsets(E, obj, &count);
        if (i < 0) i += (int64_t)count;
        if (i < 0 || i >= (int64_t)count) return chat_ev_undef("string index out of range", 25);
        return chat_str(obj.u.str.s + offs[i], offs[i + 1] - offs[i]);
    }
    case CV_DICT:
    case CV_NS:
        if (key.kind != CV_STR) break;
        return chat_ev_getattr(E, at, obj, key.u.str.s, key.u.str.n);
    default: break;
    }
    if (key.kind == CV_STR) return chat_ev_getattr(E, at, obj, key.u.str.s, key.u.str.n);
    return fmt_undef(E, "'%.*s object' has no such item", chat_kind_name(obj.kind), strlen(chat_kind_name(obj.kind)));
}

static int64_t slice_bound(chat_ev *E, const chat_node *at, chat_value v, int64_t dflt, int64_t len, int64_t step) {
    int64_t x;
    if (v.kind == CV_UNDEF || v.kind == CV_NONE) return dflt;
    if (!as_index(v, &x)) chat_ev_fail(E, at, TQKV_EINVAL, "slice indices must be integers or None");
    if (x < 0) {
        x += len;
        if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= len) x = step < 0 ? len - 1 : len;
    return x;
}

static chat_value do_slice(chat_ev *E, const chat_node *at, chat_value obj, chat_value vs, chat_value ve,
                           chat_value vstep) {
    int64_t step = 1;
    if (vstep.kind != CV_UNDEF && vstep.kind != CV_NONE && !as_index(vstep, &step))
        chat_ev_fail(E, at, TQKV_EINVAL, "slice indices must be integers or None");
    if (step == 0) chat_ev_fail(E, at, TQKV_EINVAL, "slice step cannot be zero");
    size_t count = 0, *offs = NULL;
    if (obj.kind == CV_LIST) count = obj.u.list->n;
    else if (obj.kind == CV_STR) offs = cp_offsets(E, obj, &count);
    else if (obj.kind == CV_UNDEF) chat_ev_undefined(E, at, obj);
    else chat_ev_fail(E, at, TQKV_EINVAL, "'%s' object is not subscriptable", chat_kind_name(obj.kind));
    int64_t len = (int64_t)count;
    int64_t start = slice_bound(E, at, vs, step < 0 ? len - 1 : 0, len, step);
    int64_t stop = slice_bound(E, at, ve, step < 0 ? -1 : len, len, step);
    size_t n = 0;
    if (step > 0 && stop > start) n = (size_t)((stop - start + step - 1) / step);
    if (step < 0 && start > stop) n = (size_t)((start - stop + (-step) - 1) / (-step));
    if (obj.kind == CV_LIST) {
        chat_value l = chat_ev_list(E, n);
        l.u.list->tuple = obj.u.list->tuple;
        for (size_t k = 0; k < n; k++) l.u.list->items[k] = obj.u.list->items[start + (int64_t)k * step];
        return l;
    }
    chat_buf b = {0};
    if (chat_buf_put(E->a, &b, "", 0)) chat_ev_oom(E);
    for (size_t k = 0; k < n; k++) {
        int64_t i = start + (int64_t)k * step;
        if (chat_buf_put(E->a, &b, obj.u.str.s + offs[i], offs[i + 1] - offs[i])) chat_ev_oom(E);
    }
    return chat_str(b.s, b.n);
}

/* ------------------------------------------------------------------------- */
/* Expressions                                                                */
/* ------------------------------------------------------------------------- */

static chat_value eval(chat_ev *E, const chat_node *n, chat_frame *f);
static void exec(chat_ev *E, const chat_node *n, chat_frame *f, chat_buf *out);

typedef struct {
    chat_value        *args;
    chat_value        *kw;
} evargs;

static evargs eval_args(chat_ev *E, const chat_node *n, chat_frame *f) {
    evargs r;
    r.args = chat_ev_alloc(E, (size_t)(n->n_args + 1) * sizeof(chat_value));
    r.kw = chat_ev_alloc(E, (size_t)(n->n_kw + 1) * sizeof(chat_value));
    for (int i = 0; i < n->n_args; i++) r.args[i] = eval(E, n->args[i], f);
    for (int i = 0; i < n->n_kw; i++) r.kw[i] = eval(E, n->kw[i], f);
    return r;
}

static chat_value call_macro(chat_ev *E, const chat_node *at, const chat_node *m, const chat_value *args,
                             int n_args, const char *const *kwn, const size_t *kwl, const chat_value *kw,
                             int n_kw) {
    if (n_args > m->n_names)
        chat_ev_fail(E, at, TQKV_EINVAL, "macro '%.*s' takes not more than %d argument(s)", (int)m->name_n,
                     m->name, m->n_names);
    if (E->depth >= CHAT_MAX_DEPTH) chat_ev_fail(E, at, TQKV_EINVAL, "macro calls nested too deeply");
    chat_frame *mf = frame_new(E, E->root);
    for (int k = 0; k < n_kw; k++) {
        int found = 0;
        for (int p = 0; p < m->n_names && !found; p++)
            found = m->names_n[p] == kwl[k] && memcmp(m->names[p], kwn[k], kwl[k]) == 0;
        if (!found)
            chat_ev_fail(E, at, TQKV_EINVAL, "macro '%.*s' has no parameter '%.*s'", (int)m->name_n, m->name,
                         (int)kwl[k], kwn[k]);
    }
    for (int p = 0; p < m->n_names; p++) {
        chat_value v;
        int have = 0;
        if (p < n_args) {
            v = args[p];
            have = 1;
        }
        for (int k = 0; k < n_kw; k++)
            if (m->names_n[p] == kwl[k] && memcmp(m->names[p], kwn[k], kwl[k]) == 0) {
                if (have)
                    chat_ev_fail(E, at, TQKV_EINVAL, "macro '%.*s' got multiple values for '%.*s'",
                                 (int)m->name_n, m->name, (int)kwl[k], kwn[k]);
                v = kw[k];
                have = 1;
            }
        if (!have) {
            if (m->kw[p]) v = eval(E, m->kw[p], mf);
            else v = fmt_undef(E, "parameter '%.*s' was not provided", m->names[p], m->names_n[p]);
        }
        chat_ev_dict_set(E, mf->vars, m->names[p], m->names_n[p], v);
    }
    chat_buf b = {0};
    if (chat_buf_put(E->a, &b, "", 0)) chat_ev_oom(E);
    E->depth++;
    exec(E, m->bodies[0], mf, &b);
    E->depth--;
    E->loop_ctl = 0;
    return chat_str(b.s, b.n);
}

static chat_value eval_call(chat_ev *E, const chat_node *n, chat_frame *f) {
    const chat_node *callee = n->a;
    if (callee->kind == N_ATTR) {
        chat_value obj = eval(E, callee->a, f);
        evargs r = eval_args(E, n, f);
        return chat_ev_method(E, n, obj, callee->name, callee->name_n, r.args, n->n_args, n->names,
                              n->names_n, r.kw, n->n_kw);
    }
    const chat_value *v = lookup(f, callee->name, callee->name_n);
    evargs r = eval_args(E, n, f);
    if (v && v->kind == CV_MACRO)
        return call_macro(E, n, v->u.macro, r.args, n->n_args, n->names, n->names_n, r.kw, n->n_kw);
    int fn = v ? (v->kind == CV_FUNC ? (int)v->u.i : -1) : chat_func_lookup(callee->name, callee->name_n);
    if (fn < 0) {
        if (!v || v->kind == CV_UNDEF)
            chat_ev_fail(E, n, TQKV_EINVAL, "'%.*s' is undefined", (int)callee->name_n, callee->name);
        chat_ev_fail(E, n, TQKV_EINVAL, "'%.*s' is not callable", (int)callee->name_n, callee->name);
    }
    return chat_ev_func(E, n, fn, r.args, n->n_args, n->names, n->names_n, r.kw, n->n_kw);
}

static chat_value eval(chat_ev *E, const chat_node *n, chat_frame *f) {
    if (++E->depth > CHAT_MAX_DEPTH + 400) chat_ev_fail(E, n, TQKV_EINVAL, "expression nested too deeply");
    if (++E->steps > CHAT_MAX_STEPS)
        chat_ev_fail(E, n, TQKV_EUNSUPPORTED, "render stopped after %d steps (template loops too long)", CHAT_MAX_STEPS);
    chat_value r;
    switch (n->kind) {
    case N_LIT: r = n->lit; break;
    case N_NAME: {
        const chat_value *v = lookup(f, n->name, n->name_n);
        if (v) r = *v;
        else {
            int fn = chat_func_lookup(n->name, n->name_n);
            if (fn >= 0) {
                memset(&r, 0, sizeof r);
                r.kind = CV_FUNC;
                r.u.i = fn;
            } else r = fmt_undef(E, "'%.*s' is undefined", n->name, n->name_n);
        }
        break;
    }
    case N_ATTR: r = chat_ev_getattr(E, n, eval(E, n->a, f), n->name, n->name_n); break;
    case N_ITEM: {
        chat_value obj = eval(E, n->a, f);
        r = get_item(E, n, obj, eval(E, n->b, f));
        break;
    }
    case N_SLICE: {
        chat_value obj = eval(E, n->a, f);
        chat_value s = n->b ? eval(E, n->b, f) : chat_ev_undef(NULL, 0);
        chat_value e = n->c ? eval(E, n->c, f) : chat_ev_undef(NULL, 0);
        chat_value st = n->d ? eval(E, n->d, f) : chat_ev_undef(NULL, 0);
        r = do_slice(E, n, obj, s, e, st);
        break;
    }
    case N_CALL: r = eval_call(E, n, f); break;
    case N_FILTER: {
        chat_value v = eval(E, n->a, f);
        evargs a = eval_args(E, n, f);
        r = chat_ev_filter(E, n, n->name, n->name_n, v, a.args, n->n_args, n->names, n->names_n, a.kw, n->n_kw);
        break;
    }
    case N_TEST: {
        chat_value v = eval(E, n->a, f);
        evargs a = eval_args(E, n, f);
        int t = chat_ev_test(E, n, n->name, n->name_n, v, a.args, n->n_args);
        r = chat_bool(n->flag ? !t : t);
        break;
    }
    case N_UNARY: {
        chat_value v = eval(E, n->a, f);
        if (n->op == OP_NOT) r = chat_bool(!chat_truthy(v));
        else if (v.kind == CV_INT || v.kind == CV_BOOL) {
            if (n->op == OP_NEG && v.u.i == INT64_MIN)
                chat_ev_fail(E, n, TQKV_EUNSUPPORTED, "integer overflow (64-bit) in unary '-'");
            r = chat_int(n->op == OP_NEG ? -v.u.i : v.u.i);
        } else if (v.kind == CV_FLOAT) r = mk_float(n->op == OP_NEG ? -v.u.f : v.u.f);
        else if (v.kind == CV_UNDEF) chat_ev_undefined(E, n, v);
        else chat_ev_fail(E, n, TQKV_EINVAL, "bad operand type for unary %s: '%s'", n->op == OP_NEG ? "-" : "+",
                          chat_kind_name(v.kind));
        break;
    }
    case N_BINARY: {
        chat_value x = eval(E, n->a, f);
        chat_value y = eval(E, n->b, f);
        r = arith(E, n, n->op, x, y);
        break;
    }
    case N_AND: {
        chat_value x = eval(E, n->a, f);
        r = chat_truthy(x) ? eval(E, n->b, f) : x;
        break;
    }
    case N_OR: {
        chat_value x = eval(E, n->a, f);
        r = chat_truthy(x) ? x : eval(E, n->b, f);
        break;
    }
    case N_COMPARE: {
        chat_value x = eval(E, n->a, f);
        r = chat_bool(1);
        for (int i = 0; i < n->n_args; i++) {
            chat_value y = eval(E, n->args[i], f);
            if (!compare(E, n, n->ops[i], x, y)) {
                r = chat_bool(0);
                break;
            }
            x = y;
        }
        break;
    }
    case N_COND:
        if (chat_truthy(eval(E, n->a, f))) r = eval(E, n->b, f);
        else r = n->c ? eval(E, n->c, f) : chat_ev_undef("conditional expression evaluated to undefined", 44);
        break;
    case N_LIST: {
        r = chat_ev_list(E, (size_t)n->n_args);
        r.u.list->tuple = n->flag;
        for (int i = 0; i < n->n_args; i++) r.u.list->items[i] = eval(E, n->args[i], f);
        break;
    }
    case N_DICT: {
        r = chat_ev_new_dict(E, CV_DICT);
        for (int i = 0; i < n->n_args; i++) {
            chat_value k = eval(E, n->args[i], f);
            if (k.kind != CV_STR) chat_ev_fail(E, n, TQKV_EUNSUPPORTED, "dict keys must be strings");
            chat_ev_dict_set(E, r.u.dict, k.u.str.s, k.u.str.n, eval(E, n->kw[i], f));
        }
        break;
    }
    default: chat_ev_fail(E, n, TQKV_EINVAL, "internal: statement used as expression");
    }
    E->depth--;
    return r;
}

/* ------------------------------------------------------------------------- */
/* Statements                                                                 */
/* ------------------------------------------------------------------------- */

static void put(chat_ev *E, chat_buf *out, const char *s, size_t n) {
    if (chat_buf_put(E->a, out, s, n)) chat_ev_oom(E);
}

static void bind_targets(chat_ev *E, const chat_node *n, chat_frame *f, chat_value item) {
    if (n->n_names == 1) {
        chat_ev_dict_set(E, f->vars, n->names[0], n->names_n[0], item);
        return;
    }
    chat_value l = item;
    if (l.kind == CV_STR) l = chat_ev_iterable(E, n, l);
    if (l.kind != CV_LIST || l.u.list->n != (size_t)n->n_names)
        chat_ev_fail(E, n, TQKV_EINVAL, "cannot unpack %s into %d loop variables", chat_kind_name(item.kind),
                     n->n_names);
    for (int k = 0; k < n->n_names; k++) chat_ev_dict_set(E, f->vars, n->names[k], n->names_n[k], l.u.list->items[k]);
}

static void exec_for(chat_ev *E, const chat_node *n, chat_frame *f, chat_buf *out) {
    chat_value it = eval(E, n->a, f);
    if (it.kind == CV_NS) chat_ev_fail(E, n, TQKV_EINVAL, "'Namespace' object is not iterable");
    chat_value items = chat_ev_iterable(E, n, it);
    if (n->b) { /* {% for x in xs if cond %}: filter first, loop.length counts the kept items */
        chat_value kept = chat_ev_list(E, items.u.list->n);
        size_t k = 0;
        for (size_t i = 0; i < items.u.list->n; i++) {
            chat_frame *tf = frame_new(E, f);
            bind_targets(E, n, tf, items.u.list->items[i]);
            if (chat_truthy(eval(E, n->b, tf))) kept.u.list->items[k++] = items.u.list->items[i];
        }
        kept.u.list->n = k;
        items = kept;
    }
    size_t len = items.u.list->n;
    if (len == 0) {
        if (n->n_bodies > 1) exec(E, n->bodies[1], f, out);
        return;
    }
    for (size_t i = 0; i < len; i++) {
        chat_frame *lf = frame_new(E, f);
        bind_targets(E, n, lf, items.u.list->items[i]);
        chat_value loop = chat_ev_new_dict(E, CV_DICT);
        chat_dict *d = loop.u.dict;
        chat_ev_dict_set(E, d, "index", 5, chat_int((int64_t)i + 1));
        chat_ev_dict_set(E, d, "index0", 6, chat_int((int64_t)i));
        chat_ev_dict_set(E, d, "revindex", 8, chat_int((int64_t)(len - i)));
        chat_ev_dict_set(E, d, "revindex0", 9, chat_int((int64_t)(len - i - 1)));
        chat_ev_dict_set(E, d, "first", 5, chat_bool(i == 0));
        chat_ev_dict_set(E, d, "last", 4, chat_bool(i + 1 == len));
        chat_ev_dict_set(E, d, "length", 6, chat_int((int64_t)len));
        chat_ev_dict_set(E, d, "depth", 5, chat_int(1));
        chat_ev_dict_set(E, d, "depth0", 6, chat_int(0));
        if (i > 0) chat_ev_dict_set(E, d, "previtem", 8, items.u.list->items[i - 1]);
        if (i + 1 < len) chat_ev_dict_set(E, d, "nextitem", 8, items.u.list->items[i + 1]);
        chat_ev_dict_set(E, lf->vars, "loop", 4, loop);
        exec(E, n->bodies[0], lf, out);
        if (E->loop_ctl == 1) {
            E->loop_ctl = 0;
            break;
        }
        E->loop_ctl = 0;
    }
}

static void exec(chat_ev *E, const chat_node *n, chat_frame *f, chat_buf *out) {
    if (++E->steps > CHAT_MAX_STEPS)
        chat_ev_fail(E, n, TQKV_EUNSUPPORTED, "render stopped after %d steps (template loops too long)", CHAT_MAX_STEPS);
    switch (n->kind) {
    case N_BODY:
        for (int i = 0; i < n->n_args && !E->loop_ctl; i++) exec(E, n->args[i], f, out);
        return;
    case N_TEXT: put(E, out, n->lit.u.str.s, n->lit.u.str.n); return;
    case N_OUTPUT: {
        chat_value v = eval(E, n->a, f);
        if (chat_value_str(E->a, out, v)) chat_ev_oom(E);
        return;
    }
    case N_IF:
        for (int i = 0; i < n->n_args; i++)
            if (chat_truthy(eval(E, n->args[i], f))) {
                exec(E, n->bodies[i], f, out);
                return;
            }
        if (n->n_bodies > n->n_args) exec(E, n->bodies[n->n_args], f, out);
        return;
    case N_FOR: exec_for(E, n, f, out); return;
    case N_SET: {
        chat_value v = eval(E, n->a, f);
        if (n->name2) {
            const chat_value *ns = lookup(f, n->name, n->name_n);
            if (!ns || ns->kind != CV_NS)
                chat_ev_fail(E, n, TQKV_EINVAL, "cannot assign attribute on non-namespace object '%.*s'",
                             (int)n->name_n, n->name);
            chat_ev_dict_set(E, ns->u.dict, n->name2, n->name2_n, v);
        } else chat_ev_dict_set(E, f->vars, n->name, n->name_n, v);
        return;
    }
    case N_SET_BLOCK: {
        chat_buf b = {0};
        if (chat_buf_put(E->a, &b, "", 0)) chat_ev_oom(E);
        exec(E, n->bodies[0], f, &b);
        chat_ev_dict_set(E, f->vars, n->name, n->name_n, chat_str(b.s, b.n));
        return;
    }
    case N_MACRO: {
        chat_value m;
        memset(&m, 0, sizeof m);
        m.kind = CV_MACRO;
        m.u.macro = n;
        chat_ev_dict_set(E, f->vars, n->name, n->name_n, m);
        return;
    }
    case N_BREAK: E->loop_ctl = 1; return;
    case N_CONTINUE: E->loop_ctl = 2; return;
    default: chat_ev_fail(E, n, TQKV_EINVAL, "internal: expression used as statement");
    }
}

/* ------------------------------------------------------------------------- */
/* Entry                                                                      */
/* ------------------------------------------------------------------------- */

tqkv_status chat_eval_render(const chat_node *root, chat_arena *arena, const char *const *names,
                             const chat_value *vals, int n_vars, const char **out, size_t *out_len) {
    chat_ev E;
    memset(&E, 0, sizeof E);
    E.a = arena;
    if (setjmp(E.jb)) return E.err;
    E.root = frame_new(&E, NULL);
    for (int i = 0; i < n_vars; i++) chat_ev_dict_set(&E, E.root->vars, names[i], strlen(names[i]), vals[i]);
    chat_buf b = {0};
    put(&E, &b, "", 0);
    exec(&E, root, E.root, &b);
    *out = b.s;
    *out_len = b.n;
    return TQKV_OK;
}

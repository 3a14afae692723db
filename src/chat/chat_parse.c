/*
 * chat_parse.c - the chat-template parser: tokens -> syntax tree, with Jinja2's
 * grammar and operator precedence, for the subset the engine evaluates.
 *
 * Owns: the grammar, and the init-time refusal of everything outside the subset
 * (statements, filters, tests, methods, global functions) with its line:column.
 * Must not: evaluate anything, read variables.
 */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include "chat/chat_internal.h"
#include "util/common.h"

#define CHAT_MAX_NESTING 200

/* ------------------------------------------------------------------------- */
/* Parser state                                                               */
/* ------------------------------------------------------------------------- */

typedef struct {
    chat_arena        *a;
    const chat_token  *t;      /* [n] */
    size_t             n, pos;
    int                depth;  /* expression / block nesting */
    jmp_buf            jb;
    tqkv_status        err;
    /* calls to plain names, checked against macros + globals at the end */
    const chat_node  **calls;  /* [n_calls] */
    int                n_calls, cap_calls;
    const char       **macros; /* [n_macros] names */
    size_t            *macros_n;
    int                n_macros, cap_macros;
} parser;

static _Noreturn void perr(parser *P, const chat_token *at, tqkv_status s, const char *fmt, const char *arg,
                           size_t arg_n) {
    char what[192];
    if (arg) {
        int k = (int)(arg_n > 80 ? 80 : arg_n);
        snprintf(what, sizeof what, fmt, k, arg);
    } else snprintf(what, sizeof what, "%s", fmt);
    tqkv_fail(s, "chat template %d:%d: %s", at->line, at->col, what);
    P->err = s;
    longjmp(P->jb, 1);
}

static _Noreturn void oom(parser *P) {
    tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
    P->err = TQKV_ENOMEM;
    longjmp(P->jb, 1);
}

static const chat_token *cur(parser *P) { return &P->t[P->pos]; }
static const chat_token *peek(parser *P, size_t k) {
    size_t i = P->pos + k;
    return &P->t[i < P->n ? i : P->n - 1];
}
static void advance(parser *P) {
    if (P->pos + 1 < P->n) P->pos++;
}

static int is_name(const chat_token *t, const char *s) {
    return t->kind == TK_NAME && t->n == strlen(s) && memcmp(t->s, s, t->n) == 0;
}
static int is_op(const chat_token *t, int op) { return t->kind == TK_OP && t->op == op; }

static int skip_name(parser *P, const char *s) {
    if (is_name(cur(P), s)) {
        advance(P);
        return 1;
    }
    return 0;
}
static int skip_op(parser *P, int op) {
    if (is_op(cur(P), op)) {
        advance(P);
        return 1;
    }
    return 0;
}

static const char *tok_desc(const chat_token *t) {
    switch (t->kind) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "text";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "'}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "'%}'";
    case TK_NAME: return "a name";
    case TK_STRING: return "a string";
    case TK_INT:
    case TK_FLOAT: return "a number";
    case TK_OP: return "an operator";
    }
    return "?";
}

static _Noreturn void expected(parser *P, const char *what) {
    char msg[128];
    snprintf(msg, sizeof msg, "expected %s, found %s", what, tok_desc(cur(P)));
    perr(P, cur(P), TQKV_EINVAL, msg, NULL, 0);
}

static void expect_op(parser *P, int op, const char *what) {
    if (!skip_op(P, op)) expected(P, what);
}

static const chat_token *expect_name(parser *P) {
    const chat_token *t = cur(P);
    if (t->kind != TK_NAME) expected(P, "a name");
    advance(P);
    return t;
}

static chat_node *node(parser *P, chat_node_kind k, const chat_token *at) {
    chat_node *n = chat_arena_alloc(P->a, sizeof *n);
    if (!n) oom(P);
    n->kind = k;
    n->line = at->line;
    n->col = at->col;
    return n;
}

/* Growable pointer / name arrays while parsing. */
typedef struct {
    chat_node  **v;
    int          n, cap;
} nodevec;

static void nv_push(parser *P, nodevec *v, chat_node *x) {
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 8;
        chat_node **p = chat_arena_alloc(P->a, (size_t)cap * sizeof *p);
        if (!p) oom(P);
        if (v->n) memcpy(p, v->v, (size_t)v->n * sizeof *p);
        v->v = p;
        v->cap = cap;
    }
    v->v[v->n++] = x;
}

typedef struct {
    const char **s;
    size_t      *n;
    int          count, cap;
} namevec;

static void nm_push(parser *P, namevec *v, const char *s, size_t n) {
    if (v->count == v->cap) {
        int cap = v->cap ? v->cap * 2 : 8;
        const char **ps = chat_arena_alloc(P->a, (size_t)cap * sizeof *ps);
        size_t *pn = chat_arena_alloc(P->a, (size_t)cap * sizeof *pn);
        if (!ps || !pn) oom(P);
        if (v->count) {
            memcpy(ps, v->s, (size_t)v->count * sizeof *ps);
            memcpy(pn, v->n, (size_t)v->count * sizeof *pn);
        }
        v->s = ps;
        v->n = pn;
        v->cap = cap;
    }
    v->s[v->count] = s;
    v->n[v->count] = n;
    v->count++;
}

static void enter(parser *P) {
    if (++P->depth > CHAT_MAX_NESTING)
        perr(P, cur(P), TQKV_EUNSUPPORTED, "nesting deeper than 200 levels", NULL, 0);
}
static void leave(parser *P) { P->depth--; }

/* ------------------------------------------------------------------------- */
/* Expressions                                                                */
/* ------------------------------------------------------------------------- */

static chat_node *parse_expr(parser *P);
static chat_node *parse_or(parser *P);
static chat_node *parse_unary(parser *P, int with_filter);
static chat_node *parse_postfix(parser *P, chat_node *n);
static chat_node *parse_primary(parser *P);

/* a, b, c -> tuple; a -> a. with_cond: allow `x if c else y` items. */
static chat_node *parse_tuple(parser *P, int with_cond) {
    const chat_token *at = cur(P);
    nodevec items = {0};
    int comma = 0;
    for (;;) {
        nv_push(P, &items, with_cond ? parse_expr(P) : parse_or(P));
        if (!skip_op(P, OP_COMMA)) break;
        comma = 1;
        const chat_token *t = cur(P);
        if (t->kind == TK_VAR_END || t->kind == TK_BLOCK_END || is_op(t, OP_RPAREN)) break;
    }
    if (!comma) return items.v[0];
    chat_node *n = node(P, N_LIST, at);
    n->flag = 1;
    n->args = items.v;
    n->n_args = items.n;
    return n;
}

/* ( args ) after the '(' has been seen; fills n->args / kw / names. */
static void parse_call_args(parser *P, chat_node *n) {
    nodevec args = {0}, kw = {0};
    namevec names = {0};
    expect_op(P, OP_LPAREN, "'('");
    while (!is_op(cur(P), OP_RPAREN)) {
        if (args.n || kw.n) expect_op(P, OP_COMMA, "',' or ')'");
        if (is_op(cur(P), OP_RPAREN)) break;
        if (is_op(cur(P), OP_MUL) || is_op(cur(P), OP_POW))
            perr(P, cur(P), TQKV_EUNSUPPORTED, "*args / **kwargs in calls are not supported", NULL, 0);
        if (cur(P)->kind == TK_NAME && is_op(peek(P, 1), OP_ASSIGN)) {
            const chat_token *k = cur(P);
            advance(P);
            advance(P);
            nm_push(P, &names, k->s, k->n);
            nv_push(P, &kw, parse_expr(P));
        } else {
            if (kw.n) perr(P, cur(P), TQKV_EINVAL, "positional argument after keyword argument", NULL, 0);
            nv_push(P, &args, parse_expr(P));
        }
    }
    advance(P); /* ')' */
    n->args = args.v;
    n->n_args = args.n;
    n->kw = kw.v;
    n->n_kw = kw.n;
    n->names = names.s;
    n->names_n = names.n;
    n->n_names = names.count;
}

static chat_node *parse_filter(parser *P, chat_node *target) {
    /* at '|' */
    advance(P);
    const chat_token *nt = expect_name(P);
    if (is_op(cur(P), OP_DOT))
        perr(P, cur(P), TQKV_EUNSUPPORTED, "dotted filter names are not supported", NULL, 0);
    if (!chat_filter_known(nt->s, nt->n))
        perr(P, nt, TQKV_EUNSUPPORTED, "filter '%.*s' is not supported", nt->s, nt->n);
    chat_node *n = node(P, N_FILTER, nt);
    n->a = target;
    n->name = nt->s;
    n->name_n = nt->n;
    if (is_op(cur(P), OP_LPAREN)) parse_call_args(P, n);
    return n;
}

static chat_node *parse_test(parser *P, chat_node *target) {
    /* at 'is' */
    advance(P);
    int neg = skip_name(P, "not");
    const chat_token *nt = expect_name(P);
    if (!chat_test_known(nt->s, nt->n))
        perr(P, nt, TQKV_EUNSUPPORTED, "test '%.*s' is not supported", nt->s, nt->n);
    chat_node *n = node(P, N_TEST, nt);
    n->a = target;
    n->flag = neg;
    n->name = nt->s;
    n->name_n = nt->n;
    const chat_token *t = cur(P);
    if (is_op(t, OP_LPAREN)) parse_call_args(P, n);
    else if ((t->kind == TK_NAME || t->kind == TK_STRING || t->kind == TK_INT || t->kind == TK_FLOAT ||
              is_op(t, OP_LBRACKET) || is_op(t, OP_LBRACE)) &&
             !is_name(t, "else") && !is_name(t, "or") && !is_name(t, "and")) {
        if (is_name(t, "is")) perr(P, t, TQKV_EINVAL, "cannot chain multiple tests with 'is'", NULL, 0);
        chat_node *arg = parse_postfix(P, parse_primary(P));
        n->args = chat_arena_alloc(P->a, sizeof *n->args);
        if (!n->args) oom(P);
        n->args[0] = arg;
        n->n_args = 1;
    }
    return n;
}

static chat_node *parse_filter_expr(parser *P, chat_node *n) {
    for (;;) {
        if (is_op(cur(P), OP_PIPE)) n = parse_filter(P, n);
        else if (is_name(cur(P), "is")) n = parse_test(P, n);
        else if (is_op(cur(P), OP_LPAREN))
            perr(P, cur(P), TQKV_EUNSUPPORTED, "calling the result of a filter or test is not supported",
                 NULL, 0);
        else return n;
    }
}

static chat_node *parse_subscript(parser *P, chat_node *target, const chat_token *at) {
    /* after '[' */
    chat_node *parts[3] = {NULL, NULL, NULL};
    int is_slice = 0, k = 0;
    for (;;) {
        if (!is_op(cur(P), OP_COLON) && !is_op(cur(P), OP_RBRACKET)) parts[k] = parse_expr(P);
        if (skip_op(P, OP_COLON)) {
            is_slice = 1;
            if (++k > 2) perr(P, cur(P), TQKV_EINVAL, "too many ':' in slice", NULL, 0);
            continue;
        }
        break;
    }
    if (is_op(cur(P), OP_COMMA))
        perr(P, cur(P), TQKV_EUNSUPPORTED, "tuple subscripts are not supported", NULL, 0);
    expect_op(P, OP_RBRACKET, "']'");
    if (!is_slice) {
        if (!parts[0]) perr(P, at, TQKV_EINVAL, "empty subscript", NULL, 0);
        chat_node *n = node(P, N_ITEM, at);
        n->a = target;
        n->b = parts[0];
        return n;
    }
    chat_node *n = node(P, N_SLICE, at);
    n->a = target;
    n->b = parts[0];
    n->c = parts[1];
    n->d = parts[2];
    return n;
}

static void note_call(parser *P, const chat_node *n) {
    if (P->n_calls == P->cap_calls) {
        int cap = P->cap_calls ? P->cap_calls * 2 : 16;
        const chat_node **p = chat_arena_alloc(P->a, (size_t)cap * sizeof *p);
        if (!p) oom(P);
        if (P->n_calls) memcpy(p, P->calls, (size_t)P->n_calls * sizeof *p);
        P->calls = p;
        P->cap_calls = cap;
    }
    P->calls[P->n_calls++] = n;
}

static chat_node *parse_postfix(parser *P, chat_node *n) {
    for (;;) {
        const chat_token *t = cur(P);
        if (is_op(t, OP_DOT)) {
            advance(P);
            const chat_token *nt = cur(P);
            if (nt->kind == TK_INT) { /* x.0 == x[0] */
                advance(P);
                chat_node *idx = node(P, N_LIT, nt);
                idx->lit = chat_int(nt->i);
                chat_node *m = node(P, N_ITEM, t);
                m->a = n;
                m->b = idx;
                n = m;
                continue;
            }
            nt = expect_name(P);
            chat_node *m = node(P, N_ATTR, nt);
            m->a = n;
            m->name = nt->s;
            m->name_n = nt->n;
            n = m;
        } else if (is_op(t, OP_LBRACKET)) {
            advance(P);
            enter(P);
            n = parse_subscript(P, n, t);
            leave(P);
        } else if (is_op(t, OP_LPAREN)) {
            if (n->kind == N_ATTR) {
                if (!chat_method_known(n->name, n->name_n))
                    perr(P, t, TQKV_EUNSUPPORTED, "method '%.*s' is not supported", n->name, n->name_n);
            } else if (n->kind != N_NAME) {
                perr(P, t, TQKV_EUNSUPPORTED, "only named functions, macros and methods can be called",
                     NULL, 0);
            }
            chat_node *m = node(P, N_CALL, t);
            m->a = n;
            enter(P);
            parse_call_args(P, m);
            leave(P);
            if (n->kind == N_NAME) note_call(P, m);
            n = m;
        } else return n;
    }
}

static chat_node *parse_primary(parser *P) {
    const chat_token *t = cur(P);
    chat_node *n;
    switch (t->kind) {
    case TK_NAME:
        advance(P);
        n = node(P, N_LIT, t);
        if (is_name(t, "true") || is_name(t, "True")) n->lit = chat_bool(1);
        else if (is_name(t, "false") || is_name(t, "False")) n->lit = chat_bool(0);
        else if (is_name(t, "none") || is_name(t, "None")) n->lit.kind = CV_NONE;
        else {
            n->kind = N_NAME;
            n->name = t->s;
            n->name_n = t->n;
        }
        return n;
    case TK_STRING: {
        advance(P);
        n = node(P, N_LIT, t);
        if (cur(P)->kind != TK_STRING) {
            n->lit = chat_str(t->s, t->n);
            return n;
        }
        chat_buf b = {0};
        if (chat_buf_put(P->a, &b, t->s, t->n)) oom(P);
        while (cur(P)->kind == TK_STRING) { /* adjacent literals concatenate */
            if (chat_buf_put(P->a, &b, cur(P)->s, cur(P)->n)) oom(P);
            advance(P);
        }
        n->lit = chat_str(b.s, b.n);
        return n;
    }
    case TK_INT:
        advance(P);
        n = node(P, N_LIT, t);
        n->lit = chat_int(t->i);
        return n;
    case TK_FLOAT:
        advance(P);
        n = node(P, N_LIT, t);
        n->lit.kind = CV_FLOAT;
        n->lit.u.f = t->f;
        return n;
    case TK_OP:
        if (t->op == OP_LPAREN) {
            advance(P);
            enter(P);
            if (skip_op(P, OP_RPAREN)) { /* () empty tuple */
                n = node(P, N_LIST, t);
                n->flag = 1;
                leave(P);
                return n;
            }
            n = parse_tuple(P, 1);
            expect_op(P, OP_RPAREN, "')'");
            leave(P);
            return n;
        }
        if (t->op == OP_LBRACKET) {
            advance(P);
            enter(P);
            nodevec items = {0};
            while (!is_op(cur(P), OP_RBRACKET)) {
                if (items.n) expect_op(P, OP_COMMA, "',' or ']'");
                if (is_op(cur(P), OP_RBRACKET)) break;
                nv_push(P, &items, parse_expr(P));
            }
            advance(P);
            leave(P);
            n = node(P, N_LIST, t);
            n->args = items.v;
            n->n_args = items.n;
            return n;
        }
        if (t->op == OP_LBRACE) {
            advance(P);
            enter(P);
            nodevec keys = {0}, vals = {0};
            while (!is_op(cur(P), OP_RBRACE)) {
                if (keys.n) expect_op(P, OP_COMMA, "',' or '}'");
                if (is_op(cur(P), OP_RBRACE)) break;
                nv_push(P, &keys, parse_expr(P));
                expect_op(P, OP_COLON, "':'");
                nv_push(P, &vals, parse_expr(P));
            }
            advance(P);
            leave(P);
            n = node(P, N_DICT, t);
            n->args = keys.v;
            n->n_args = keys.n;
            n->kw = vals.v;
            n->n_kw = vals.n;
            return n;
        }
        break;
    default: break;
    }
    expected(P, "an expression");
}

static chat_node *parse_unary(parser *P, int with_filter) {
    const chat_token *t = cur(P);
    chat_node *n;
    enter(P);
    if (is_op(t, OP_SUB) || is_op(t, OP_ADD)) {
        advance(P);
        n = node(P, N_UNARY, t);
        n->op = t->op == OP_SUB ? OP_NEG : OP_POS;
        n->a = parse_unary(P, 0);
    } else n = parse_primary(P);
    n = parse_postfix(P, n);
    if (with_filter) n = parse_filter_expr(P, n);
    leave(P);
    return n;
}

static chat_node *binary(parser *P, const chat_token *at, int op, chat_node *a, chat_node *b) {
    chat_node *n = node(P, N_BINARY, at);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static chat_node *parse_pow(parser *P) {
    chat_node *a = parse_unary(P, 1);
    while (is_op(cur(P), OP_POW)) {
        const chat_token *t = cur(P);
        advance(P);
        a = binary(P, t, OP_POW, a, parse_unary(P, 1));
    }
    return a;
}

static chat_node *parse_math2(parser *P) {
    chat_node *a = parse_pow(P);
    for (;;) {
        const chat_token *t = cur(P);
        if (!(is_op(t, OP_MUL) || is_op(t, OP_DIV) || is_op(t, OP_FLOORDIV) || is_op(t, OP_MOD))) return a;
        advance(P);
        a = binary(P, t, t->op, a, parse_pow(P));
    }
}

static chat_node *parse_concat(parser *P) {
    chat_node *a = parse_math2(P);
    while (is_op(cur(P), OP_TILDE)) {
        const chat_token *t = cur(P);
        advance(P);
        a = binary(P, t, OP_TILDE, a, parse_math2(P));
    }
    return a;
}

static chat_node *parse_math1(parser *P) {
    chat_node *a = parse_concat(P);
    for (;;) {
        const chat_token *t = cur(P);
        if (!(is_op(t, OP_ADD) || is_op(t, OP_SUB))) return a;
        advance(P);
        a = binary(P, t, t->op, a, parse_concat(P));
    }
}

static chat_node *parse_compare(parser *P) {
    const chat_token *at = cur(P);
    chat_node *first = parse_math1(P);
    nodevec rhs = {0};
    int ops[64];
    for (;;) {
        const chat_token *t = cur(P);
        int op = 0;
        if (t->kind == TK_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LE ||
                                 t->op == OP_GT || t->op == OP_GE)) {
            op = t->op;
            advance(P);
        } else if (is_name(t, "in")) {
            op = OP_IN;
            advance(P);
        } else if (is_name(t, "not") && is_name(peek(P, 1), "in")) {
            op = OP_NOTIN;
            advance(P);
            advance(P);
        } else break;
        if (rhs.n == 64) perr(P, t, TQKV_EUNSUPPORTED, "comparison chain too long", NULL, 0);
        ops[rhs.n] = op;
        nv_push(P, &rhs, parse_math1(P));
    }
    if (!rhs.n) return first;
    chat_node *n = node(P, N_COMPARE, at);
    n->a = first;
    n->args = rhs.v;
    n->n_args = rhs.n;
    n->ops = chat_arena_alloc(P->a, (size_t)rhs.n * sizeof *n->ops);
    if (!n->ops) oom(P);
    memcpy(n->ops, ops, (size_t)rhs.n * sizeof *ops);
    return n;
}

static chat_node *parse_not(parser *P) {
    const chat_token *t = cur(P);
    if (is_name(t, "not")) {
        advance(P);
        enter(P);
        chat_node *n = node(P, N_UNARY, t);
        n->op = OP_NOT;
        n->a = parse_not(P);
        leave(P);
        return n;
    }
    return parse_compare(P);
}

static chat_node *parse_and(parser *P) {
    chat_node *a = parse_not(P);
    while (is_name(cur(P), "and")) {
        const chat_token *t = cur(P);
        advance(P);
        chat_node *n = node(P, N_AND, t);
        n->a = a;
        n->b = parse_not(P);
        a = n;
    }
    return a;
}

static chat_node *parse_or(parser *P) {
    chat_node *a = parse_and(P);
    while (is_name(cur(P), "or")) {
        const chat_token *t = cur(P);
        advance(P);
        chat_node *n = node(P, N_OR, t);
        n->a = a;
        n->b = parse_and(P);
        a = n;
    }
    return a;
}

static chat_node *parse_expr(parser *P) {
    enter(P);
    chat_node *a = parse_or(P);
    while (is_name(cur(P), "if")) {
        const chat_token *t = cur(P);
        advance(P);
        chat_node *n = node(P, N_COND, t);
        n->a = parse_or(P);
        n->b = a;
        if (skip_name(P, "else")) n->c = parse_expr(P);
        a = n;
    }
    leave(P);
    return a;
}

/* ------------------------------------------------------------------------- */
/* Statements                                                                 */
/* ------------------------------------------------------------------------- */

static void expect_block_end(parser *P) {
    if (cur(P)->kind != TK_BLOCK_END) expected(P, "'%}'");
    advance(P);
}

/* Parses statements until `{% <one of ends> ...`; leaves the position on that name.
 * ends is a NULL-terminated list; NULL ends = until end of template. */
static chat_node *parse_body(parser *P, const char *const *ends, const chat_token *opened_at,
                             const char *opened_what);

static chat_node *parse_if(parser *P, const chat_token *at) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    chat_node *n = node(P, N_IF, at);
    nodevec conds = {0}, bodies = {0};
    for (;;) {
        nv_push(P, &conds, parse_tuple(P, 0));
        expect_block_end(P);
        nv_push(P, &bodies, parse_body(P, ends, at, "if"));
        if (skip_name(P, "elif")) continue;
        if (skip_name(P, "else")) {
            expect_block_end(P);
            static const char *const end_only[] = {"endif", NULL};
            nv_push(P, &bodies, parse_body(P, end_only, at, "if"));
        }
        break;
    }
    if (!skip_name(P, "endif")) expected(P, "'endif'");
    expect_block_end(P);
    n->args = conds.v;
    n->n_args = conds.n;
    n->bodies = bodies.v;
    n->n_bodies = bodies.n;
    return n;
}

static chat_node *parse_for(parser *P, const chat_token *at) {
    chat_node *n = node(P, N_FOR, at);
    namevec targets = {0};
    int paren = skip_op(P, OP_LPAREN);
    do {
        const chat_token *nt = expect_name(P);
        nm_push(P, &targets, nt->s, nt->n);
    } while (skip_op(P, OP_COMMA));
    if (paren) expect_op(P, OP_RPAREN, "')'");
    if (!skip_name(P, "in")) expected(P, "'in'");
    n->a = parse_tuple(P, 0);
    if (skip_name(P, "if")) n->b = parse_expr(P);
    if (is_name(cur(P), "recursive"))
        perr(P, cur(P), TQKV_EUNSUPPORTED, "recursive for loops are not supported", NULL, 0);
    expect_block_end(P);
    static const char *const ends[] = {"else", "endfor", NULL};
    nodevec bodies = {0};
    nv_push(P, &bodies, parse_body(P, ends, at, "for"));
    if (skip_name(P, "else")) {
        expect_block_end(P);
        static const char *const end_only[] = {"endfor", NULL};
        nv_push(P, &bodies, parse_body(P, end_only, at, "for"));
    }
    if (!skip_name(P, "endfor")) expected(P, "'endfor'");
    expect_block_end(P);
    n->names = targets.s;
    n->names_n = targets.n;
    n->n_names = targets.count;
    n->bodies = bodies.v;
    n->n_bodies = bodies.n;
    return n;
}

static chat_node *parse_set(parser *P, const chat_token *at) {
    const chat_token *nt = expect_name(P);
    chat_node *n = node(P, N_SET, at);
    n->name = nt->s;
    n->name_n = nt->n;
    if (skip_op(P, OP_DOT)) {
        const chat_token *attr = expect_name(P);
        n->name2 = attr->s;
        n->name2_n = attr->n;
    }
    if (is_op(cur(P), OP_COMMA))
        perr(P, cur(P), TQKV_EUNSUPPORTED, "tuple unpacking in set is not supported", NULL, 0);
    if (skip_op(P, OP_ASSIGN)) {
        n->a = parse_tuple(P, 1);
        expect_block_end(P);
        return n;
    }
    if (n->name2) expected(P, "'='");
    if (is_op(cur(P), OP_PIPE))
        perr(P, cur(P), TQKV_EUNSUPPORTED, "filtered block set is not supported", NULL, 0);
    expect_block_end(P);
    n->kind = N_SET_BLOCK;
    static const char *const ends[] = {"endset", NULL};
    n->bodies = chat_arena_alloc(P->a, sizeof *n->bodies);
    if (!n->bodies) oom(P);
    n->bodies[0] = parse_body(P, ends, at, "set");
    n->n_bodies = 1;
    advance(P); /* endset */
    expect_block_end(P);
    return n;
}

static chat_node *parse_macro(parser *P, const chat_token *at) {
    const chat_token *nt = expect_name(P);
    chat_node *n = node(P, N_MACRO, at);
    n->name = nt->s;
    n->name_n = nt->n;
    namevec params = {0};
    nodevec defaults = {0};
    expect_op(P, OP_LPAREN, "'('");
    while (!is_op(cur(P), OP_RPAREN)) {
        if (params.count) expect_op(P, OP_COMMA, "',' or ')'");
        if (is_op(cur(P), OP_RPAREN)) break;
        const chat_token *pt = expect_name(P);
        nm_push(P, &params, pt->s, pt->n);
        if (skip_op(P, OP_ASSIGN)) nv_push(P, &defaults, parse_expr(P));
        else {
            if (defaults.n && defaults.v[defaults.n - 1])
                perr(P, pt, TQKV_EINVAL, "parameter without default after one with a default", NULL, 0);
            nv_push(P, &defaults, NULL);
        }
    }
    advance(P);
    expect_block_end(P);
    static const char *const ends[] = {"endmacro", NULL};
    n->bodies = chat_arena_alloc(P->a, sizeof *n->bodies);
    if (!n->bodies) oom(P);
    n->bodies[0] = parse_body(P, ends, at, "macro");
    n->n_bodies = 1;
    advance(P); /* endmacro */
    if (cur(P)->kind == TK_NAME) advance(P); /* {% endmacro name %} */
    expect_block_end(P);
    n->names = params.s;
    n->names_n = params.n;
    n->n_names = params.count;
    n->kw = defaults.v;
    n->n_kw = defaults.n;
    if (P->n_macros == P->cap_macros) {
        int cap = P->cap_macros ? P->cap_macros * 2 : 8;
        const char **m = chat_arena_alloc(P->a, (size_t)cap * sizeof *m);
        size_t *mn = chat_arena_alloc(P->a, (size_t)cap * sizeof *mn);
        if (!m || !mn) oom(P);
        if (P->n_macros) {
            memcpy(m, P->macros, (size_t)P->n_macros * sizeof *m);
            memcpy(mn, P->macros_n, (size_t)P->n_macros * sizeof *mn);
        }
        P->macros = m;
        P->macros_n = mn;
        P->cap_macros = cap;
    }
    P->macros[P->n_macros] = n->name;
    P->macros_n[P->n_macros] = n->name_n;
    P->n_macros++;
    return n;
}

static const char *const k_unsupported_stmts[] = {
    "raw", "include", "import", "from", "extends", "block", "call", "filter", "with",
    "autoescape", "do", "trans", "pluralize", NULL};

static chat_node *parse_statement(parser *P) {
    const chat_token *at = cur(P); /* '{%' */
    advance(P);
    const chat_token *kw = cur(P);
    if (kw->kind != TK_NAME) expected(P, "a statement name");
    advance(P);
    enter(P);
    chat_node *n;
    if (is_name(kw, "if")) n = parse_if(P, at);
    else if (is_name(kw, "for")) n = parse_for(P, at);
    else if (is_name(kw, "set")) n = parse_set(P, at);
    else if (is_name(kw, "macro")) n = parse_macro(P, at);
    else if (is_name(kw, "break") || is_name(kw, "continue")) {
        n = node(P, is_name(kw, "break") ? N_BREAK : N_CONTINUE, kw);
        expect_block_end(P);
    } else if (is_name(kw, "generation")) { /* transformers' AssistantTracker: renders its body */
        expect_block_end(P);
        static const char *const ends[] = {"endgeneration", NULL};
        n = parse_body(P, ends, at, "generation");
        advance(P);
        expect_block_end(P);
    } else {
        for (int i = 0; k_unsupported_stmts[i]; i++)
            if (is_name(kw, k_unsupported_stmts[i]))
                perr(P, kw, TQKV_EUNSUPPORTED, "statement '%.*s' is not supported", kw->s, kw->n);
        perr(P, kw, TQKV_EINVAL, "unknown or misplaced statement '%.*s'", kw->s, kw->n);
    }
    leave(P);
    return n;
}

static chat_node *parse_body(parser *P, const char *const *ends, const chat_token *opened_at,
                             const char *opened_what) {
    chat_node *body = node(P, N_BODY, cur(P));
    nodevec stmts = {0};
    for (;;) {
        const chat_token *t = cur(P);
        if (t->kind == TK_EOF) {
            if (!ends) break;
            char msg[96];
            snprintf(msg, sizeof msg, "'%s' opened here is never closed", opened_what);
            perr(P, opened_at, TQKV_EINVAL, msg, NULL, 0);
        }
        if (t->kind == TK_TEXT) {
            chat_node *n = node(P, N_TEXT, t);
            n->lit = chat_str(t->s, t->n);
            nv_push(P, &stmts, n);
            advance(P);
        } else if (t->kind == TK_VAR_BEGIN) {
            advance(P);
            chat_node *n = node(P, N_OUTPUT, t);
            n->a = parse_tuple(P, 1);
            if (cur(P)->kind != TK_VAR_END) expected(P, "'}}'");
            advance(P);
            nv_push(P, &stmts, n);
        } else if (t->kind == TK_BLOCK_BEGIN) {
            const chat_token *kw = peek(P, 1);
            if (ends)
                for (int i = 0; ends[i]; i++)
                    if (is_name(kw, ends[i])) {
                        advance(P); /* onto the end name */
                        body->args = stmts.v;
                        body->n_args = stmts.n;
                        return body;
                    }
            nv_push(P, &stmts, parse_statement(P));
        } else expected(P, "text or a tag");
    }
    body->args = stmts.v;
    body->n_args = stmts.n;
    return body;
}

tqkv_status chat_parse(chat_arena *a, const chat_tokens *toks, chat_node **root) {
    parser P;
    memset(&P, 0, sizeof P);
    P.a = a;
    P.t = toks->toks;
    P.n = toks->n;
    if (setjmp(P.jb)) return P.err;
    chat_node *body = parse_body(&P, NULL, cur(&P), "template");
    /* Calls to plain names: a macro of this template or a known global function. */
    for (int i = 0; i < P.n_calls; i++) {
        const chat_node *c = P.calls[i];
        const chat_node *callee = c->a;
        int ok = chat_func_lookup(callee->name, callee->name_n) >= 0;
        for (int m = 0; m < P.n_macros && !ok; m++)
            ok = P.macros_n[m] == callee->name_n && memcmp(P.macros[m], callee->name, callee->name_n) == 0;
        if (!ok) {
            chat_token at = {0};
            at.line = callee->line;
            at.col = callee->col;
            perr(&P, &at, TQKV_EUNSUPPORTED, "function '%.*s' is not supported (not a macro of this template)",
                 callee->name, callee->name_n);
        }
    }
    *root = body;
    return TQKV_OK;
}

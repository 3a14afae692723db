/*
 * chat_internal.h - the chat-template engine's private types: arena, values, tokens,
 * syntax tree, and the entry points that the lexer, parser and evaluator share.
 *
 * Owns: the shapes that chat_lex.c, chat_parse.c, chat_value.c, chat_eval.c and
 * chat_template.c pass between them.
 * Must not: be included outside src/chat/chat_*.c; hold global state.
 *
 * Memory: every allocation of a parse goes to the template's arena (freed with the
 * template), every allocation of a render to the render's arena (freed when the render
 * returns). Values are immutable once built (namespaces excepted), so they are shared
 * freely, never copied, never freed one by one.
 */
#ifndef TQKV_CHAT_INTERNAL_H
#define TQKV_CHAT_INTERNAL_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"
#include "tqkv_chat.h"

/* ------------------------------------------------------------------------- */
/* Arena                                                                      */
/* ------------------------------------------------------------------------- */

typedef struct chat_arena_block chat_arena_block;
typedef struct {
    chat_arena_block *head;
    size_t            total;  /* bytes handed out so far */
    size_t            limit;  /* refuse past this many bytes (0 = none) */
} chat_arena;

void  chat_arena_init(chat_arena *a, size_t limit);
void  chat_arena_free(chat_arena *a);
/* NULL when malloc fails or the limit would be passed. Memory is zeroed. */
void *chat_arena_alloc(chat_arena *a, size_t n);

/* ------------------------------------------------------------------------- */
/* Values                                                                     */
/* ------------------------------------------------------------------------- */

typedef enum {
    CV_UNDEF = 0, CV_NONE, CV_BOOL, CV_INT, CV_FLOAT, CV_STR, CV_LIST, CV_DICT,
    CV_NS,    /* namespace(): a dict whose entries `set ns.x = ...` may change */
    CV_MACRO, /* a {% macro %} of the template */
    CV_FUNC   /* a global function (raise_exception, namespace, range, ...) */
} chat_kind;

typedef struct chat_list chat_list;
typedef struct chat_dict chat_dict;
typedef struct chat_node chat_node;

typedef struct {
    chat_kind kind;
    union {
        int64_t          i;     /* CV_BOOL (0/1), CV_INT, CV_FUNC (chat_func id) */
        double           f;
        struct { const char *s; size_t n; } str; /* UTF-8, not NUL-terminated */
        chat_list       *list;
        chat_dict       *dict;  /* CV_DICT, CV_NS */
        const chat_node *macro;
    } u;
} chat_value;

struct chat_list {
    size_t      n;
    chat_value *items; /* [n] */
    int         tuple; /* prints as (a, b) */
};

struct chat_dict {
    size_t      n, cap;
    const char **keys;   /* [cap] UTF-8 keys */
    size_t      *klen;   /* [cap] */
    chat_value  *vals;   /* [cap] */
};

/* The global functions a template may call. */
typedef enum {
    CF_RAISE = 0, CF_NAMESPACE, CF_RANGE, CF_DICT, CF_STRFTIME_NOW, CF_COUNT
} chat_func;

/* Growable UTF-8 string in an arena. */
typedef struct {
    char   *s;
    size_t  n, cap;
} chat_buf;

/* ------------------------------------------------------------------------- */
/* Tokens                                                                     */
/* ------------------------------------------------------------------------- */

typedef enum {
    TK_EOF = 0, TK_TEXT, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END,
    TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP
} chat_tok_kind;

/* Operators (TK_OP's `op`). */
enum {
    OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_TILDE,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_ASSIGN,
    OP_LPAREN, OP_RPAREN, OP_LBRACKET, OP_RBRACKET, OP_LBRACE, OP_RBRACE,
    OP_COMMA, OP_DOT, OP_COLON, OP_PIPE,
    /* evaluator-only */
    OP_AND, OP_OR, OP_NOT, OP_IN, OP_NOTIN, OP_NEG, OP_POS
};

typedef struct {
    chat_tok_kind kind;
    int           op;        /* TK_OP */
    const char   *s;         /* TK_TEXT, TK_NAME, TK_STRING: decoded text (arena) */
    size_t        n;
    int64_t       i;         /* TK_INT */
    double        f;         /* TK_FLOAT */
    int           line, col; /* 1-based position in the template source */
} chat_token;

typedef struct {
    chat_token *toks; /* [n] */
    size_t      n;
} chat_tokens;

/* Lexes source into tokens (whitespace control, trim_blocks, lstrip_blocks applied).
 * On failure returns a status with the message set (line:column included). */
tqkv_status chat_lex(chat_arena *a, const char *source, chat_tokens *out);

/* ------------------------------------------------------------------------- */
/* Syntax tree                                                                */
/* ------------------------------------------------------------------------- */

typedef enum {
    /* expressions */
    N_LIT = 1, N_NAME, N_ATTR, N_ITEM, N_SLICE, N_CALL, N_FILTER, N_TEST,
    N_UNARY, N_BINARY, N_AND, N_OR, N_COMPARE, N_COND, N_LIST, N_DICT,
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SET_BLOCK, N_MACRO, N_BREAK, N_CONTINUE,
    N_BODY
} chat_node_kind;

/* One node; which fields mean what depends on kind:
 * N_LIT        lit
 * N_NAME       name
 * N_ATTR       a.name
 * N_ITEM       a[b]
 * N_SLICE      a[b:c:d] (b, c, d may be NULL)
 * N_CALL       a(args.., kw..)           (a: N_NAME, or N_ATTR for a method)
 * N_FILTER     a | name(args.., kw..)
 * N_TEST       a is [not] name(args..)   flag: negated
 * N_UNARY      op a                      (OP_NOT, OP_NEG, OP_POS)
 * N_BINARY     a op b                    (arithmetic, ~)
 * N_AND/N_OR   a and/or b
 * N_COMPARE    a (ops[i] args[i])...     ops in kwn as ints
 * N_COND       b if a else c             (c may be NULL)
 * N_LIST       [args..]                  flag: 1 for a tuple
 * N_DICT       {args[i]: kw[i]}
 * N_TEXT       lit (a string)
 * N_OUTPUT     {{ a }}
 * N_IF         args[i] conditions, bodies[i] bodies (n_bodies = n_args or n_args + 1 with else)
 * N_FOR        targets names[], a iterable, b filter (NULL), bodies[0] body, bodies[1] else
 * N_SET        name (or name2 = attribute of namespace name), a value
 * N_SET_BLOCK  name, bodies[0]
 * N_MACRO      name, params names[] with kw[] defaults (NULL = required), bodies[0]
 * N_BODY       args[] statements
 */
struct chat_node {
    chat_node_kind kind;
    int            line, col;
    int            op, flag;
    const char    *name;  size_t name_n;
    const char    *name2; size_t name2_n;
    chat_value     lit;
    chat_node     *a, *b, *c, *d;
    chat_node    **args;  int n_args;     /* positional args / items / conditions */
    chat_node    **kw;    int n_kw;       /* keyword values / dict values / defaults */
    const char   **names; size_t *names_n; int n_names; /* keyword names / targets / params */
    int           *ops;                    /* N_COMPARE */
    chat_node    **bodies; int n_bodies;
};

/* Parses tokens into a N_BODY root. Fails with TQKV_EINVAL (bad syntax) or
 * TQKV_EUNSUPPORTED (valid Jinja outside the subset), naming line:column. */
tqkv_status chat_parse(chat_arena *a, const chat_tokens *toks, chat_node **root);

/* ------------------------------------------------------------------------- */
/* Names the evaluator knows (the parser checks templates against them)      */
/* ------------------------------------------------------------------------- */

int chat_filter_known(const char *name, size_t n);
int chat_test_known(const char *name, size_t n);
int chat_method_known(const char *name, size_t n);
int chat_func_lookup(const char *name, size_t n); /* chat_func id or -1 */

/* ------------------------------------------------------------------------- */
/* Render                                                                     */
/* ------------------------------------------------------------------------- */

/* Renders root with the given top-level variables (names[i] = vals[i]). Output lives in
 * arena. On failure returns a status with the message set. */
tqkv_status chat_eval_render(const chat_node *root, chat_arena *arena,
                             const char *const *names, const chat_value *vals, int n_vars,
                             const char **out, size_t *out_len);

/* ------------------------------------------------------------------------- */
/* Value helpers (chat_value.c); `jb`-free: they return NULL/-1 on OOM        */
/* ------------------------------------------------------------------------- */

chat_value chat_str(const char *s, size_t n);
chat_value chat_int(int64_t i);
chat_value chat_bool(int b);
int        chat_buf_put(chat_arena *a, chat_buf *b, const char *s, size_t n); /* 0 ok, -1 OOM */
int        chat_buf_putc(chat_arena *a, chat_buf *b, char c);
chat_dict *chat_dict_new(chat_arena *a, size_t cap);
int        chat_dict_set(chat_arena *a, chat_dict *d, const char *k, size_t kn, chat_value v);
const chat_value *chat_dict_get(const chat_dict *d, const char *k, size_t kn);
int        chat_py_space(uint32_t cp); /* Python str.isspace() */
/* Decodes one UTF-8 code point at s[*i] (< n), advancing *i; invalid bytes decode as
 * themselves (one byte, cp = byte). */
uint32_t   chat_utf8_next(const char *s, size_t n, size_t *i);
size_t     chat_utf8_put(uint32_t cp, char out[4]);
/* Python str(v) / repr(v) / json.dumps(v, ensure_ascii=False, ...) appended to b.
 * 0 ok, -1 OOM, -2 not representable (tojson of a macro, ...). */
int chat_value_str(chat_arena *a, chat_buf *b, chat_value v);
int chat_value_repr(chat_arena *a, chat_buf *b, chat_value v);
int chat_value_json(chat_arena *a, chat_buf *b, chat_value v, int indent, int depth,
                    int sort_keys, const char *item_sep, const char *key_sep);
int chat_truthy(chat_value v);
int chat_equal(chat_value x, chat_value y);
const char *chat_kind_name(chat_kind k);

#endif /* TQKV_CHAT_INTERNAL_H */

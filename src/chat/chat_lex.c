/*
 * chat_lex.c - the chat-template lexer: template source -> tokens, with Jinja2's
 * whitespace control as transformers configures it (trim_blocks=True,
 * lstrip_blocks=True, keep_trailing_newline=False, `{%-` / `-%}` / `+`).
 *
 * Owns: where text ends and tags begin, string-literal escapes, number literals.
 * Must not: know statement or expression grammar (chat_parse.c does).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat_internal.h"
#include "util/common.h"

/* ------------------------------------------------------------------------- */
/* Lexer state                                                                */
/* ------------------------------------------------------------------------- */

typedef struct {
    chat_arena  *a;
    const char  *src;   /* normalized source [n] */
    size_t       n;
    size_t       pos;
    chat_token  *toks;  /* [cap] */
    size_t       n_toks, cap;
    tqkv_status  err;
    size_t       lc_pos; /* line/column of lc_pos, advanced incrementally */
    int          lc_line, lc_col;
} lexer;

static void pos_of(lexer *L, size_t at, int *line, int *col) {
    if (at < L->lc_pos) { /* restart from the top (rare: errors only) */
        L->lc_pos = 0;
        L->lc_line = 1;
        L->lc_col = 1;
    }
    for (size_t i = L->lc_pos; i < at && i < L->n; i++) {
        if (L->src[i] == '\n') {
            L->lc_line++;
            L->lc_col = 1;
        } else if (((unsigned char)L->src[i] & 0xC0) != 0x80) L->lc_col++;
    }
    L->lc_pos = at;
    *line = L->lc_line;
    *col = L->lc_col;
}

static tqkv_status lex_fail(lexer *L, size_t at, tqkv_status s, const char *what) {
    int line, col;
    pos_of(L, at, &line, &col);
    L->err = s;
    return tqkv_fail(s, "chat template %d:%d: %s", line, col, what);
}

static chat_token *push(lexer *L, chat_tok_kind kind, size_t at) {
    if (L->n_toks == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        chat_token *t = chat_arena_alloc(L->a, cap * sizeof *t);
        if (!t) return NULL;
        if (L->n_toks) memcpy(t, L->toks, L->n_toks * sizeof *t);
        L->toks = t;
        L->cap = cap;
    }
    chat_token *t = &L->toks[L->n_toks++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    pos_of(L, at, &t->line, &t->col);
    return t;
}

/* Python whitespace at s[i..] : returns its byte length or 0. */
static size_t space_len(const char *s, size_t n, size_t i) {
    size_t j = i;
    uint32_t cp = chat_utf8_next(s, n, &j);
    return chat_py_space(cp) ? j - i : 0;
}

/* Strip trailing Python whitespace of s[start, *end). */
static void rstrip(const char *s, size_t start, size_t *end) {
    for (;;) {
        size_t e = *end;
        if (e <= start) return;
        /* step back one code point */
        size_t b = e - 1;
        while (b > start && ((unsigned char)s[b] & 0xC0) == 0x80) b--;
        if (space_len(s, e, b) == e - b) *end = b;
        else return;
    }
}

/* ------------------------------------------------------------------------- */
/* Expression tokens inside a tag                                             */
/* ------------------------------------------------------------------------- */

static int is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes a string literal starting at L->pos (on the quote). */
static int lex_string(lexer *L) {
    size_t start = L->pos;
    char q = L->src[L->pos++];
    chat_buf b = {0};
    if (chat_buf_put(L->a, &b, "", 0)) return -1;
    while (L->pos < L->n && L->src[L->pos] != q) {
        char c = L->src[L->pos];
        if (c != '\\') {
            if (chat_buf_putc(L->a, &b, c)) return -1;
            L->pos++;
            continue;
        }
        if (L->pos + 1 >= L->n) break;
        char e = L->src[L->pos + 1];
        L->pos += 2;
        int hexn = 0;
        const char *simple = NULL;
        switch (e) {
        case 'n': simple = "\n"; break;
        case 't': simple = "\t"; break;
        case 'r': simple = "\r"; break;
        case '\\': simple = "\\"; break;
        case '\'': simple = "'"; break;
        case '"': simple = "\""; break;
        case 'a': simple = "\a"; break;
        case 'b': simple = "\b"; break;
        case 'f': simple = "\f"; break;
        case 'v': simple = "\v"; break;
        case '\n': simple = ""; break; /* line continuation */
        case 'x': hexn = 2; break;
        case 'u': hexn = 4; break;
        case 'U': hexn = 8; break;
        default: break;
        }
        if (simple) {
            if (chat_buf_put(L->a, &b, simple, strlen(simple))) return -1;
        } else if (hexn) {
            uint32_t cp = 0;
            for (int k = 0; k < hexn; k++) {
                int h = L->pos < L->n ? hexval(L->src[L->pos]) : -1;
                if (h < 0) {
                    lex_fail(L, start, TQKV_EINVAL, "bad \\x/\\u escape in string literal");
                    return -1;
                }
                cp = cp * 16 + (uint32_t)h;
                L->pos++;
            }
            if (cp > 0x10FFFF) {
                lex_fail(L, start, TQKV_EINVAL, "escape out of Unicode range");
                return -1;
            }
            char u[4];
            if (chat_buf_put(L->a, &b, u, chat_utf8_put(cp, u))) return -1;
        } else if (e >= '0' && e <= '7') {
            uint32_t cp = (uint32_t)(e - '0');
            for (int k = 0; k < 2 && L->pos < L->n && L->src[L->pos] >= '0' && L->src[L->pos] <= '7'; k++)
                cp = cp * 8 + (uint32_t)(L->src[L->pos++] - '0');
            char u[4];
            if (chat_buf_put(L->a, &b, u, chat_utf8_put(cp, u))) return -1;
        } else { /* unknown escape: kept as written */
            char two[2] = {'\\', e};
            if (chat_buf_put(L->a, &b, two, 2)) return -1;
        }
    }
    if (L->pos >= L->n) {
        lex_fail(L, start, TQKV_EINVAL, "unterminated string literal");
        return -1;
    }
    L->pos++; /* closing quote */
    chat_token *t = push(L, TK_STRING, start);
    if (!t) return -1;
    t->s = b.s;
    t->n = b.n;
    return 0;
}

static int lex_number(lexer *L) {
    size_t start = L->pos;
    int is_float = 0;
    char tmp[128];
    size_t k = 0;
    while (L->pos < L->n && (is_digit(L->src[L->pos]) || L->src[L->pos] == '_')) {
        if (L->src[L->pos] != '_' && k < sizeof tmp - 1) tmp[k++] = L->src[L->pos];
        L->pos++;
    }
    if (L->pos + 1 < L->n && L->src[L->pos] == '.' && is_digit(L->src[L->pos + 1])) {
        is_float = 1;
        if (k < sizeof tmp - 1) tmp[k++] = '.';
        L->pos++;
        while (L->pos < L->n && (is_digit(L->src[L->pos]) || L->src[L->pos] == '_')) {
            if (L->src[L->pos] != '_' && k < sizeof tmp - 1) tmp[k++] = L->src[L->pos];
            L->pos++;
        }
    }
    if (L->pos < L->n && (L->src[L->pos] == 'e' || L->src[L->pos] == 'E')) {
        size_t p = L->pos + 1;
        if (p < L->n && (L->src[p] == '+' || L->src[p] == '-')) p++;
        if (p < L->n && is_digit(L->src[p])) {
            is_float = 1;
            for (size_t q = L->pos; q < p; q++)
                if (k < sizeof tmp - 1) tmp[k++] = L->src[q];
            L->pos = p;
            while (L->pos < L->n && is_digit(L->src[L->pos])) {
                if (k < sizeof tmp - 1) tmp[k++] = L->src[L->pos];
                L->pos++;
            }
        }
    }
    tmp[k] = '\0';
    chat_token *t = push(L, is_float ? TK_FLOAT : TK_INT, start);
    if (!t) return -1;
    errno = 0;
    if (is_float) t->f = strtod(tmp, NULL);
    else {
        long long v = strtoll(tmp, NULL, 10);
        if (errno == ERANGE) {
            lex_fail(L, start, TQKV_EUNSUPPORTED, "integer literal does not fit 64 bits");
            return -1;
        }
        t->i = v;
    }
    return 0;
}

static const struct { const char *s; int op; } k_ops[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {"<=", OP_LE},
    {">=", OP_GE}, {"+", OP_ADD}, {"-", OP_SUB}, {"*", OP_MUL}, {"/", OP_DIV},
    {"%", OP_MOD}, {"~", OP_TILDE}, {"<", OP_LT}, {">", OP_GT}, {"=", OP_ASSIGN},
    {"(", OP_LPAREN}, {")", OP_RPAREN}, {"[", OP_LBRACKET}, {"]", OP_RBRACKET},
    {"{", OP_LBRACE}, {"}", OP_RBRACE}, {",", OP_COMMA}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE},
};

/* Lexes expression tokens up to the tag's end (`end` = "}}" or "%}"), consuming it.
 * *strip_after is set when the end carried '-', *plus_after for '+'. */
static int lex_tag_body(lexer *L, const char *end, int *strip_after, int *plus_after) {
    int depth = 0;
    *strip_after = 0;
    *plus_after = 0;
    for (;;) {
        while (L->pos < L->n && space_len(L->src, L->n, L->pos))
            L->pos += space_len(L->src, L->n, L->pos);
        if (L->pos >= L->n) {
            lex_fail(L, L->pos, TQKV_EINVAL, end[0] == '}' ? "unclosed '{{'" : "unclosed '{%'");
            return -1;
        }
        const char *p = L->src + L->pos;
        size_t left = L->n - L->pos;
        if (depth == 0) {
            if (left >= 2 && memcmp(p, end, 2) == 0) {
                L->pos += 2;
                return 0;
            }
            if (left >= 3 && (p[0] == '-' || p[0] == '+') && memcmp(p + 1, end, 2) == 0) {
                if (p[0] == '-') *strip_after = 1;
                else *plus_after = 1;
                L->pos += 3;
                return 0;
            }
        }
        char c = p[0];
        if (c == '\'' || c == '"') {
            if (lex_string(L)) return -1;
            continue;
        }
        if (is_digit(c)) {
            if (lex_number(L)) return -1;
            continue;
        }
        if (is_name_start(c)) {
            size_t s = L->pos;
            while (L->pos < L->n && (is_name_start(L->src[L->pos]) || is_digit(L->src[L->pos]))) L->pos++;
            chat_token *t = push(L, TK_NAME, s);
            if (!t) return -1;
            t->s = L->src + s;
            t->n = L->pos - s;
            continue;
        }
        int op = 0;
        size_t len = 0;
        for (size_t k = 0; k < sizeof k_ops / sizeof k_ops[0]; k++) {
            size_t ol = strlen(k_ops[k].s);
            if (left >= ol && memcmp(p, k_ops[k].s, ol) == 0) {
                op = k_ops[k].op;
                len = ol;
                break;
            }
        }
        if (!op) {
            lex_fail(L, L->pos, TQKV_EINVAL, "unexpected character in tag");
            return -1;
        }
        if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) depth++;
        if ((op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) && depth > 0) depth--;
        chat_token *t = push(L, TK_OP, L->pos);
        if (!t) return -1;
        t->op = op;
        L->pos += len;
    }
}

/* ------------------------------------------------------------------------- */
/* Text and tags                                                              */
/* ------------------------------------------------------------------------- */

tqkv_status chat_lex(chat_arena *a, const char *source, chat_tokens *out) {
    lexer L;
    memset(&L, 0, sizeof L);
    L.a = a;
    L.lc_line = 1;
    L.lc_col = 1;
    L.err = TQKV_ENOMEM;
    /* newlines normalized to \n; one trailing newline dropped (keep_trailing_newline=False) */
    size_t sn = strlen(source);
    char *src = chat_arena_alloc(a, sn + 1);
    if (!src) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
    size_t n = 0;
    for (size_t i = 0; i < sn; i++) {
        if (source[i] == '\r') {
            src[n++] = '\n';
            if (i + 1 < sn && source[i + 1] == '\n') i++;
        } else src[n++] = source[i];
    }
    if (n && src[n - 1] == '\n') n--;
    src[n] = '\0';
    L.src = src;
    L.n = n;

    int line_starting = 1; /* the previous token ended a line (or start of source) */
    int strip_next = 0;    /* the previous tag ended with '-' */
    while (L.pos <= L.n) {
        /* find the next tag start */
        size_t t = L.pos;
        int kind = 0; /* 1 = {{, 2 = {%, 3 = {# */
        while (t + 1 < L.n) {
            if (L.src[t] == '{') {
                char c = L.src[t + 1];
                if (c == '{') kind = 1;
                else if (c == '%') kind = 2;
                else if (c == '#') kind = 3;
                if (kind) break;
            }
            t++;
        }
        if (!kind) t = L.n;
        size_t text_start = L.pos, text_end = t;
        if (strip_next)
            while (text_start < text_end && space_len(L.src, text_end, text_start))
                text_start += space_len(L.src, text_end, text_start);
        char sign = kind && t + 2 < L.n ? L.src[t + 2] : 0;
        if (kind && sign == '-') rstrip(L.src, text_start, &text_end);
        else if (kind && kind != 1 && sign != '+') { /* lstrip_blocks */
            size_t l_pos = text_end;
            while (l_pos > text_start && L.src[l_pos - 1] != '\n') l_pos--;
            int only_ws = 1;
            for (size_t q = l_pos; q < text_end && only_ws;) {
                size_t sl = space_len(L.src, text_end, q);
                if (!sl) only_ws = 0;
                q += sl ? sl : 1;
            }
            if ((l_pos > text_start || line_starting) && only_ws) text_end = l_pos;
        }
        if (text_end > text_start) {
            chat_token *tk = push(&L, TK_TEXT, text_start);
            if (!tk) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
            tk->s = L.src + text_start;
            tk->n = text_end - text_start;
        }
        if (!kind) break;
        size_t tag_at = t;
        L.pos = t + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
        int strip_after = 0, plus_after = 0;
        if (kind == 3) { /* comment */
            const char *e = NULL;
            for (size_t q = L.pos; q + 1 < L.n; q++)
                if (L.src[q] == '#' && L.src[q + 1] == '}') {
                    e = L.src + q;
                    break;
                }
            if (!e) return lex_fail(&L, tag_at, TQKV_EINVAL, "unclosed comment '{#'");
            size_t q = (size_t)(e - L.src);
            if (q > L.pos && L.src[q - 1] == '-') strip_after = 1;
            if (q > L.pos && L.src[q - 1] == '+') plus_after = 1;
            L.pos = q + 2;
        } else {
            chat_token *tk = push(&L, kind == 1 ? TK_VAR_BEGIN : TK_BLOCK_BEGIN, tag_at);
            if (!tk) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
            if (lex_tag_body(&L, kind == 1 ? "}}" : "%}", &strip_after, &plus_after)) {
                if (L.err == TQKV_ENOMEM) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
                return L.err;
            }
            tk = push(&L, kind == 1 ? TK_VAR_END : TK_BLOCK_END, L.pos - 2);
            if (!tk) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
        }
        line_starting = 0;
        strip_next = strip_after;
        /* trim_blocks: a block or comment tag eats one newline after it */
        if (!strip_after && !plus_after && kind != 1 && L.pos < L.n && L.src[L.pos] == '\n') {
            L.pos++;
            line_starting = 1;
        }
    }
    chat_token *tk = push(&L, TK_EOF, L.n);
    if (!tk) return tqkv_fail(TQKV_ENOMEM, "chat template: out of memory");
    out->toks = L.toks;
    out->n = L.n_toks;
    return TQKV_OK;
}

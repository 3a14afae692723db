/*
 * json_grammar.c - the JSON-object automaton and its token mask (json_grammar.h).
 * Owns: the byte automaton's transitions; the vocabulary trie walked with the automaton
 * (a subtree is skipped as soon as its prefix is refused).
 * Must not: sample or schedule; keep global state. jg_mask uses the vocabulary's scratch:
 * one caller at a time (the engine's compute thread).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/json_grammar.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Automaton
// ---------------------------------------------------------------------------

enum {
    M_TOP = 0,  /* before the object: whitespace, '{' */
    M_VALUE,    /* a value */
    M_OBJ_OPEN, /* after '{': a key or '}' */
    M_OBJ_KEY,  /* after ',' in an object: a key */
    M_COLON,    /* after a key */
    M_AFTER,    /* after a value inside a container: ',' or its close */
    M_ARR_OPEN, /* after '[': a value or ']' */
    M_STR,      /* inside a string */
    M_ESC,      /* after '\' */
    M_HEX,      /* \uXXXX: sub = hex digits left */
    M_NUM,      /* inside a number: sub = N_* */
    M_LIT,      /* inside true / false / null: sub = bytes matched */
    M_DONE      /* the object is closed */
};

enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP };

static const char *const LITS[3] = {"true", "false", "null"};

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static int is_hex(unsigned char c) {
    return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

void jg_init(jg_state *s) {
    memset(s, 0, sizeof *s);
    s->mode = M_TOP;
}

int jg_complete(const jg_state *s) { return s->mode == M_DONE; }

static int top_is_array(const jg_state *s) { return (s->stack >> (s->depth - 1)) & 1; }

/* A value ended: back to its container, or done at depth 0. */
static void value_end(jg_state *s) { s->mode = s->depth == 0 ? M_DONE : M_AFTER; }

static int open_container(jg_state *s, int array) {
    if (s->depth >= JG_MAX_DEPTH) return 0;
    if (array) s->stack |= (uint64_t)1 << s->depth;
    else s->stack &= ~((uint64_t)1 << s->depth);
    s->depth++;
    s->mode = array ? M_ARR_OPEN : M_OBJ_OPEN;
    return 1;
}

static int close_container(jg_state *s, int array) {
    if (s->depth == 0 || top_is_array(s) != array) return 0;
    s->depth--;
    value_end(s);
    return 1;
}

/* The first byte of a value. */
static int value_start(jg_state *s, unsigned char c) {
    switch (c) {
    case '"': s->mode = M_STR; s->key = 0; return 1;
    case '{': return open_container(s, 0);
    case '[': return open_container(s, 1);
    case '-': s->mode = M_NUM; s->sub = N_MINUS; return 1;
    case 't': case 'f': case 'n':
        s->mode = M_LIT;
        s->lit = c == 't' ? 0 : c == 'f' ? 1 : 2;
        s->sub = 1;
        return 1;
    default:
        if (!is_digit(c)) return 0;
        s->mode = M_NUM;
        s->sub = c == '0' ? N_ZERO : N_INT;
        return 1;
    }
}

static int feed_num(jg_state *s, unsigned char c) {
    switch (s->sub) {
    case N_MINUS: if (is_digit(c)) return s->sub = c == '0' ? N_ZERO : N_INT, 1; return 0;
    case N_ZERO:
        if (c == '.') return s->sub = N_DOT, 1;
        if (c == 'e' || c == 'E') return s->sub = N_E, 1;
        break;
    case N_INT:
        if (is_digit(c)) return 1;
        if (c == '.') return s->sub = N_DOT, 1;
        if (c == 'e' || c == 'E') return s->sub = N_E, 1;
        break;
    case N_DOT: return is_digit(c) ? (s->sub = N_FRAC, 1) : 0;
    case N_FRAC:
        if (is_digit(c)) return 1;
        if (c == 'e' || c == 'E') return s->sub = N_E, 1;
        break;
    case N_E:
        if (c == '+' || c == '-') return s->sub = N_ESIGN, 1;
        return is_digit(c) ? (s->sub = N_EXP, 1) : 0;
    case N_ESIGN: return is_digit(c) ? (s->sub = N_EXP, 1) : 0;
    case N_EXP: if (is_digit(c)) return 1; break;
    default: return 0;
    }
    /* the number ended (a terminal sub-state): c belongs to what follows */
    value_end(s);
    return jg_feed(s, c);
}

static int feed(jg_state *s, unsigned char c) {
    switch (s->mode) {
    case M_TOP: return is_ws(c) || (c == '{' && open_container(s, 0));
    case M_VALUE: return is_ws(c) || value_start(s, c);
    case M_OBJ_OPEN:
        if (is_ws(c)) return 1;
        if (c == '}') return close_container(s, 0);
        if (c == '"') return s->mode = M_STR, s->key = 1, 1;
        return 0;
    case M_OBJ_KEY:
        if (is_ws(c)) return 1;
        if (c == '"') return s->mode = M_STR, s->key = 1, 1;
        return 0;
    case M_COLON:
        if (is_ws(c)) return 1;
        return c == ':' ? (s->mode = M_VALUE, 1) : 0;
    case M_AFTER:
        if (is_ws(c)) return 1;
        if (c == ',') return s->mode = top_is_array(s) ? M_VALUE : M_OBJ_KEY, 1;
        if (c == '}') return close_container(s, 0);
        if (c == ']') return close_container(s, 1);
        return 0;
    case M_ARR_OPEN:
        if (is_ws(c)) return 1;
        if (c == ']') return close_container(s, 1);
        return value_start(s, c);
    case M_STR:
        if (c == '"') {
            if (s->key) s->mode = M_COLON;
            else value_end(s);
            return 1;
        }
        if (c == '\\') return s->mode = M_ESC, 1;
        return c >= 0x20; /* control characters must be escaped; UTF-8 bytes pass */
    case M_ESC:
        if (c == 'u') return s->mode = M_HEX, s->sub = 4, 1;
        if (strchr("\"\\/bfnrt", c) && c) return s->mode = M_STR, 1;
        return 0;
    case M_HEX:
        if (!is_hex(c)) return 0;
        if (--s->sub == 0) s->mode = M_STR;
        return 1;
    case M_NUM: return feed_num(s, c);
    case M_LIT:
        if (c != (unsigned char)LITS[s->lit][s->sub]) return 0;
        if (LITS[s->lit][++s->sub] == 0) value_end(s);
        return 1;
    default: return 0; /* M_DONE: nothing but EOS */
    }
}

int jg_feed(jg_state *s, unsigned char c) {
    jg_state t = *s;
    const int outside = s->mode != M_STR && s->mode != M_ESC && s->mode != M_HEX;
    if (outside && is_ws(c) && s->ws >= JG_MAX_WS) return 0;
    if (!feed(&t, c)) return 0;
    t.ws = outside && is_ws(c) ? (uint8_t)(s->ws + 1) : 0;
    *s = t;
    return 1;
}

// ---------------------------------------------------------------------------
// Vocabulary trie and mask
// ---------------------------------------------------------------------------

typedef struct {
    int32_t child;   /* first child node, -1 none */
    int32_t sibling; /* next sibling, -1 none */
    int32_t first;   /* first token ending here (list through tok_next), -1 none */
    uint8_t byte;
} trie_node;

struct jg_vocab {
    int        V;          /* model vocab */
    int        max_len;    /* longest ordinary token (bytes) */
    trie_node *nodes;      /* [n_nodes]; node 0 = root */
    int32_t    n_nodes, cap_nodes;
    int32_t   *tok_next;   /* [V] next token ending at the same node, -1 end */
    uint8_t   *eos;        /* [V] */
    uint8_t   *text;       /* [V] 1 = an ordinary token with bytes (in the trie) */
    uint16_t  *len;        /* [V] its length in bytes (0: not in the trie) */
    uint8_t   *allowed;    /* [JG_CACHE][V] masks of recent states (rows repeat states: inside
                              a string, after a key, ...) */
    jg_state   keys[JG_CACHE];
    uint64_t   used[JG_CACHE]; /* LRU clock, 0 = empty */
    uint64_t   clock;
    void      *frames;     /* [n_nodes] walk stack (each node is pushed at most once) */
    const tqkv_tokenizer *tok;
};

static int32_t node_new(jg_vocab *v, uint8_t byte) {
    if (v->n_nodes == v->cap_nodes) {
        int32_t nc = v->cap_nodes ? v->cap_nodes * 2 : 4096;
        trie_node *n = realloc(v->nodes, sizeof *n * (size_t)nc);
        if (!n) return -1;
        v->nodes = n;
        v->cap_nodes = nc;
    }
    trie_node *n = &v->nodes[v->n_nodes];
    n->child = n->sibling = n->first = -1;
    n->byte = byte;
    return v->n_nodes++;
}

static int32_t child_of(jg_vocab *v, int32_t at, uint8_t byte) {
    for (int32_t c = v->nodes[at].child; c >= 0; c = v->nodes[c].sibling)
        if (v->nodes[c].byte == byte) return c;
    int32_t c = node_new(v, byte);
    if (c < 0) return -1;
    v->nodes[c].sibling = v->nodes[at].child;
    v->nodes[at].child = c;
    return c;
}

void jg_vocab_free(jg_vocab *v) {
    if (!v) return;
    free(v->nodes);
    free(v->tok_next);
    free(v->eos);
    free(v->text);
    free(v->len);
    free(v->allowed);
    free(v->frames);
    free(v);
}

tqkv_status jg_vocab_init(jg_vocab **out, const tqkv_tokenizer *tok, const tqkv_model *m) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    const int TV = tqkv_tokenizer_vocab_size(tok);
    jg_vocab *v = tqkv_calloc(1, sizeof *v);
    if (!v) return TQKV_ENOMEM;
    v->V = V;
    v->tok = tok;
    v->tok_next = malloc(sizeof(int32_t) * (size_t)V);
    v->eos = calloc((size_t)V, 1);
    v->text = calloc((size_t)V, 1);
    v->len = calloc((size_t)V, sizeof *v->len);
    v->allowed = calloc((size_t)V * JG_CACHE, 1);
    if (!v->tok_next || !v->eos || !v->text || !v->len || !v->allowed || node_new(v, 0) < 0) goto oom;
    for (int32_t id = 0; id < V; id++) {
        v->tok_next[id] = -1;
        v->eos[id] = (uint8_t)(tqkv_model_is_eos(m, id) != 0);
        const char *b;
        size_t n;
        if (id >= TV || tqkv_tokenizer_is_special(tok, id) ||
            tqkv_tokenizer_id_bytes(tok, id, &b, &n) != TQKV_OK || n == 0)
            continue;
        int32_t at = 0;
        for (size_t i = 0; i < n && at >= 0; i++) at = child_of(v, at, (uint8_t)b[i]);
        if (at < 0) goto oom;
        v->tok_next[id] = v->nodes[at].first;
        v->nodes[at].first = id;
        v->text[id] = 1;
        v->len[id] = (uint16_t)(n < 65535 ? n : 65535);
        if ((int)n > v->max_len) v->max_len = (int)n;
    }
    if (!(v->frames = malloc((sizeof(int32_t) + sizeof(jg_state)) * 2 * (size_t)v->n_nodes))) goto oom;
    *out = v;
    return TQKV_OK;
oom:
    jg_vocab_free(v);
    return tqkv_fail(TQKV_ENOMEM, "json grammar: out of memory for the vocabulary");
}

/* Depth-first over the trie from node `at` in state s: mark tokens whose bytes are all
 * accepted. The stack holds (node, state) pairs: no recursion. */
static void walk(const jg_vocab *v, const jg_state *s0, uint8_t *allowed) {
    typedef struct { int32_t node; jg_state st; } frame;
    frame *stack = v->frames;
    const int MAXF = v->n_nodes; /* a node is pushed at most once */
    int sp = 0;
    for (int32_t c = v->nodes[0].child; c >= 0; c = v->nodes[c].sibling) {
        jg_state t = *s0;
        if (jg_feed(&t, v->nodes[c].byte) && sp < MAXF) stack[sp++] = (frame){c, t};
    }
    while (sp > 0) {
        frame f = stack[--sp];
        for (int32_t id = v->nodes[f.node].first; id >= 0; id = v->tok_next[id]) allowed[id] = 1;
        for (int32_t c = v->nodes[f.node].child; c >= 0; c = v->nodes[c].sibling) {
            jg_state t = f.st;
            if (jg_feed(&t, v->nodes[c].byte) && sp < MAXF) stack[sp++] = (frame){c, t};
        }
    }
}

static int same_state(const jg_state *a, const jg_state *b) {
    return a->mode == b->mode && a->sub == b->sub && a->lit == b->lit && a->key == b->key &&
           a->ws == b->ws && a->depth == b->depth && a->stack == b->stack;
}

void jg_mask(jg_vocab *v, const jg_state *s, float *logits) {
    /* the mask is a function of the state only: reuse a recent one */
    int k = -1, lru = 0;
    for (int i = 0; i < JG_CACHE && k < 0; i++) {
        if (v->used[i] && same_state(&v->keys[i], s)) k = i;
        if (v->used[i] < v->used[lru]) lru = i;
    }
    uint8_t *allowed;
    if (k >= 0) {
        allowed = v->allowed + (size_t)k * (size_t)v->V;
    } else {
        k = lru;
        allowed = v->allowed + (size_t)k * (size_t)v->V;
        memset(allowed, 0, (size_t)v->V);
        if (jg_complete(s)) {
            for (int id = 0; id < v->V; id++) allowed[id] = v->eos[id];
        } else {
            walk(v, s, allowed);
        }
        v->keys[k] = *s;
    }
    v->used[k] = ++v->clock;
    for (int id = 0; id < v->V; id++)
        if (!allowed[id]) logits[id] = -INFINITY;
}

/* Depth-first along the trie: one state per byte of the path (tokens are short). */
static void walk_rec(const jg_vocab *v, int32_t node, const void *state, size_t size,
                     jg_feed_fn feed, const void *ctx, jg_visit_fn visit, void *vctx, int depth) {
    unsigned char buf[512];
    if (depth > 256) return;
    for (int32_t c = v->nodes[node].child; c >= 0; c = v->nodes[c].sibling) {
        memcpy(buf, state, size);
        if (!feed(ctx, buf, v->nodes[c].byte)) continue;
        for (int32_t id = v->nodes[c].first; id >= 0; id = v->tok_next[id]) visit(vctx, buf, id);
        if (v->nodes[c].child >= 0) walk_rec(v, c, buf, size, feed, ctx, visit, vctx, depth + 1);
    }
}

void jg_walk(const jg_vocab *v, const void *state, size_t size, jg_feed_fn feed, const void *ctx,
             jg_visit_fn visit, void *vctx) {
    if (size > 512) return;
    walk_rec(v, 0, state, size, feed, ctx, visit, vctx, 0);
}

int jg_token_len(const jg_vocab *v, int32_t id) { return id >= 0 && id < v->V ? v->len[id] : 0; }

void jg_canon(const jg_state *s, jg_state *out) {
    memset(out, 0, sizeof *out);
    out->mode = s->mode;
    out->ws = s->ws;
    out->depth = s->depth;
    out->stack = s->depth >= 64 ? s->stack : s->stack & (((uint64_t)1 << s->depth) - 1);
    if (s->mode == M_NUM || s->mode == M_LIT || s->mode == M_HEX) out->sub = s->sub;
    if (s->mode == M_LIT) out->lit = s->lit;
    if (s->mode == M_STR || s->mode == M_ESC || s->mode == M_HEX) out->key = s->key;
}

int jg_vocab_size(const jg_vocab *v) { return v->V; }
int jg_vocab_max_len(const jg_vocab *v) { return v->max_len; }
int jg_is_eos(const jg_vocab *v, int32_t id) { return id >= 0 && id < v->V && v->eos[id]; }

int jg_token_bytes(const jg_vocab *v, int32_t id, const char **b, size_t *n) {
    if (id < 0 || id >= v->V || !v->text[id]) return 0;
    return tqkv_tokenizer_id_bytes(v->tok, id, b, n) == TQKV_OK;
}

int jg_number_can_end(const jg_state *s) {
    return s->mode == M_NUM && (s->sub == N_ZERO || s->sub == N_INT || s->sub == N_FRAC || s->sub == N_EXP);
}

int jg_min_close(const jg_state *s) {
    int n = s->depth; /* a close per open container */
    switch (s->mode) {
    case M_TOP: return 2;                /* {} */
    case M_VALUE: return n + 1;          /* 0 */
    case M_OBJ_KEY: return n + 4;        /* "":0 */
    case M_COLON: return n + 2;          /* :0 */
    case M_STR: return n + 1 + (s->key ? 2 : 0);
    case M_ESC: return n + 2 + (s->key ? 2 : 0);
    case M_HEX: return n + s->sub + 1 + (s->key ? 2 : 0);
    case M_NUM: return n + (s->sub == N_MINUS || s->sub == N_DOT || s->sub == N_E || s->sub == N_ESIGN);
    case M_LIT: return n + (int)strlen(LITS[s->lit]) - s->sub;
    case M_DONE: return 0;
    default: return n; /* M_OBJ_OPEN, M_AFTER, M_ARR_OPEN */
    }
}

int jg_in_string(const jg_state *s) { return s->mode == M_STR || s->mode == M_ESC || s->mode == M_HEX; }

void jg_init_value(jg_state *s) {
    jg_init(s);
    s->mode = M_VALUE;
}

int jg_accept(const jg_vocab *v, jg_state *s, int32_t id) {
    if (id < 0 || id >= v->V) return 0;
    if (!v->text[id]) return v->eos[id] && jg_complete(s);
    const char *b;
    size_t n;
    if (tqkv_tokenizer_id_bytes(v->tok, id, &b, &n) != TQKV_OK) return 0;
    jg_state t = *s;
    for (size_t i = 0; i < n; i++)
        if (!jg_feed(&t, (unsigned char)b[i])) return 0;
    *s = t;
    return 1;
}

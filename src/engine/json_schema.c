/*
 * json_schema.c - schema compile, the schema automaton and its mask (json_schema.h).
 * Owns: js_schema's nodes and mask cache; the frames of js_state.
 * Must not: sample, schedule, keep global state.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine/json_schema.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Schema nodes
// ---------------------------------------------------------------------------

enum { T_OBJECT = 1, T_ARRAY = 2, T_STRING = 4, T_NUMBER = 8, T_INTEGER = 16, T_BOOL = 32, T_NULL = 64 };

typedef struct {
    unsigned types;     /* T_* allowed (0 with n_enum: an enum) */
    int      n_props;   /* object: properties in order; 0 = any object */
    char   **names;     /* [n_props] */
    int     *props;     /* [n_props] node ids */
    int      items;     /* array: item node (-1 = any value) */
    int      n_enum;
    char   **enums;     /* [n_enum] serialized values */
    int      minv;      /* the shortest value (bytes), set once compiled (memo_nodes) */
    int     *suf;       /* object: [n_props + 1] suffix sums of len(name) + 3 + minv */
} js_node;

/* Masks of recent states (rows repeat states: inside a string, after a key, ...; choices
 * and requests share a schema): as many as JS_CACHE_BYTES of bits hold, within [64, 512]
 * (a schema's documents visit a few hundred states); budget tables of as many as
 * JS_TABLE_BYTES hold (6 bytes an allowed token). */
#define JS_CACHE_BYTES ((size_t)4 << 20)
#define JS_CACHE_MIN 64
#define JS_CACHE_MAX 512
#define JS_TABLE_BYTES ((size_t)8 << 20)
#define JS_THR_SAT 65535

/* One cached state: its mask and, once a budget needs it, its allowed tokens ordered by
 * the tokens they need after them. */
typedef struct {
    js_state  key;       /* canonical (state_key); hash and LRU clock in js_schema */
    uint64_t *bits;      /* [W] bit id: token id may come next */
    /* budget table (have_thr): each allowed token's threshold, the fewest tokens that must
     * be left after it (js_mask_budget), ascending; JS_THR_SAT: that or more */
    int       have_thr, n_thr, cap_thr;
    int32_t  *thr_id;    /* [n_thr] */
    uint16_t *thr;       /* [n_thr] */
} js_entry;

struct js_schema {
    atomic_int refs;               /* owners: requests on any thread (js_ref / js_free) */
    int      max_branch;           /* the costliest shortest completion of any branch a
                                      value's first bytes may choose (bytes) */
    js_node *nodes;
    int      n_nodes, cap;
    int      V, W;                 /* vocab, 64-bit words of a mask */
    int       n_cache;             /* cache entries */
    uint64_t *bits;                /* [n_cache, W] */
    js_entry *cache;               /* [n_cache] */
    uint64_t *hash, *used;         /* [n_cache] each entry's key hash, LRU clock (0 = empty) */
    size_t    table_bytes;         /* budget tables allocated */
    uint64_t  clock;
};

static int node_add(js_schema *s) {
    if (s->n_nodes == s->cap) {
        int nc = s->cap ? s->cap * 2 : 16;
        js_node *n = realloc(s->nodes, sizeof *n * (size_t)nc);
        if (!n) return -1;
        s->nodes = n;
        s->cap = nc;
    }
    memset(&s->nodes[s->n_nodes], 0, sizeof s->nodes[0]);
    s->nodes[s->n_nodes].items = -1;
    return s->n_nodes++;
}

static unsigned type_bit(const char *t) {
    static const struct { const char *n; unsigned b; } T[] = {
        {"object", T_OBJECT}, {"array", T_ARRAY}, {"string", T_STRING}, {"number", T_NUMBER},
        {"integer", T_INTEGER}, {"boolean", T_BOOL}, {"null", T_NULL}};
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (!strcmp(t, T[i].n)) return T[i].b;
    return 0;
}

static tqkv_status bad(const char *what, const char *name) {
    return tqkv_fail(TQKV_EINVAL, "json schema: %s '%.60s' is not supported", what, name);
}

static tqkv_status compile_node(js_schema *s, const cJSON *j, int depth, int *out);
static int min_value(const js_schema *s, int node, int depth);
static int rest_obj(const js_schema *s, const js_node *n, int from, int comma_first, int depth);

static tqkv_status compile_object(js_schema *s, int id, const cJSON *j, int depth) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(j, "properties");
    const cJSON *ap = cJSON_GetObjectItemCaseSensitive(j, "additionalProperties");
    if (ap && !cJSON_IsFalse(ap) && props && cJSON_GetArraySize(props) > 0)
        return tqkv_fail(TQKV_EINVAL, "json schema: additionalProperties must be false with properties");
    if (!props) return TQKV_OK;
    if (!cJSON_IsObject(props)) return tqkv_fail(TQKV_EINVAL, "json schema: properties must be an object");
    int n = cJSON_GetArraySize(props);
    if (n > 256) return tqkv_fail(TQKV_EINVAL, "json schema: more than 256 properties");
    char **names = calloc((size_t)(n ? n : 1), sizeof *names);
    int *ids = calloc((size_t)(n ? n : 1), sizeof *ids);
    if (!names || !ids) {
        free(names);
        free(ids);
        return tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
    }
    s->nodes[id].names = names;
    s->nodes[id].props = ids;
    const cJSON *p;
    int k = 0;
    cJSON_ArrayForEach(p, props) {
        /* the name as it appears between the quotes (JSON-escaped) */
        cJSON *str = cJSON_CreateString(p->string);
        char *q = str ? cJSON_PrintUnformatted(str) : NULL;
        cJSON_Delete(str);
        if (!q) return tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
        size_t ql = strlen(q);
        memmove(q, q + 1, ql - 2);
        q[ql - 2] = 0;
        names[k] = q;
        s->nodes[id].n_props = k + 1;
        int child;
        tqkv_status rc = compile_node(s, p, depth + 1, &child);
        if (rc != TQKV_OK) return rc;
        s->nodes[id].props[k++] = child; /* nodes may have moved: index again */
    }
    return TQKV_OK;
}

static tqkv_status compile_node(js_schema *s, const cJSON *j, int depth, int *out) {
    if (depth >= JS_MAX_DEPTH - 1) return tqkv_fail(TQKV_EINVAL, "json schema: nested deeper than %d", JS_MAX_DEPTH - 2);
    if (!cJSON_IsObject(j)) return tqkv_fail(TQKV_EINVAL, "json schema: a schema must be an object");
    static const char *const KEYS[] = {"type", "properties", "required", "additionalProperties",
                                       "items", "enum", "const", "title", "description", "$schema",
                                       "strict", "name"};
    const cJSON *it;
    cJSON_ArrayForEach(it, j) {
        int ok = 0;
        for (size_t i = 0; i < sizeof KEYS / sizeof KEYS[0] && !ok; i++) ok = !strcmp(it->string, KEYS[i]);
        if (!ok) return bad("keyword", it->string);
    }
    int id = node_add(s);
    if (id < 0) return tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
    *out = id;
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(j, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(j, "const");
    if (en || cn) {
        if (en && (!cJSON_IsArray(en) || cJSON_GetArraySize(en) < 1 || cJSON_GetArraySize(en) > JS_MAX_ENUM))
            return tqkv_fail(TQKV_EINVAL, "json schema: enum must be an array of 1 to %d values", JS_MAX_ENUM);
        int n = en ? cJSON_GetArraySize(en) : 1;
        char **v = calloc((size_t)n, sizeof *v);
        if (!v) return tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
        s->nodes[id].enums = v;
        for (int i = 0; i < n; i++) {
            const cJSON *x = en ? cJSON_GetArrayItem(en, i) : cn;
            if (cJSON_IsObject(x) || cJSON_IsArray(x))
                return tqkv_fail(TQKV_EINVAL, "json schema: enum / const values must be scalars");
            if (!(v[i] = cJSON_PrintUnformatted(x))) return tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
            s->nodes[id].n_enum = i + 1;
        }
        return TQKV_OK;
    }
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(j, "type");
    unsigned types = 0;
    if (cJSON_IsString(ty)) {
        if (!(types = type_bit(ty->valuestring))) return bad("type", ty->valuestring);
    } else if (cJSON_IsArray(ty)) {
        cJSON_ArrayForEach(it, ty) {
            if (!cJSON_IsString(it) || !type_bit(it->valuestring))
                return bad("type", cJSON_IsString(it) ? it->valuestring : "(not a string)");
            types |= type_bit(it->valuestring);
        }
    } else {
        return tqkv_fail(TQKV_EINVAL, "json schema: every schema needs a 'type' (or enum / const)");
    }
    if ((types & T_OBJECT) && (types & T_ARRAY))
        return tqkv_fail(TQKV_EINVAL, "json schema: a type list with both object and array is not supported");
    s->nodes[id].types = types;
    if (types & T_OBJECT) {
        tqkv_status rc = compile_object(s, id, j, depth);
        if (rc != TQKV_OK) return rc;
    }
    if (types & T_ARRAY) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(j, "items");
        if (items) {
            int child;
            tqkv_status rc = compile_node(s, items, depth + 1, &child);
            if (rc != TQKV_OK) return rc;
            s->nodes[id].items = child;
        }
    }
    return TQKV_OK;
}

js_schema *js_ref(js_schema *s) {
    if (s) atomic_fetch_add(&s->refs, 1);
    return s;
}

void js_free(js_schema *s) {
    if (!s || atomic_fetch_sub(&s->refs, 1) > 1) return;
    for (int i = 0; i < s->n_nodes; i++) {
        js_node *n = &s->nodes[i];
        for (int k = 0; k < n->n_props; k++) free(n->names[k]);
        free(n->names);
        free(n->props);
        for (int k = 0; k < n->n_enum; k++) free(n->enums[k]);
        free(n->enums);
        free(n->suf);
    }
    for (int i = 0; i < s->n_cache && s->cache; i++) {
        free(s->cache[i].thr_id);
        free(s->cache[i].thr);
    }
    free(s->cache);
    free(s->hash);
    free(s->used);
    free(s->nodes);
    free(s->bits);
    free(s);
}

/* minv of every node and suf of every object (children come after their parent: from the
 * last node up); 0 or -1 out of memory. */
static int memo_nodes(js_schema *s) {
    for (int i = s->n_nodes - 1; i >= 0; i--) {
        js_node *n = &s->nodes[i];
        if (n->n_props) {
            if (!(n->suf = malloc(sizeof(int) * (size_t)(n->n_props + 1)))) return -1;
            n->suf[n->n_props] = 0;
            for (int k = n->n_props - 1; k >= 0; k--)
                n->suf[k] = n->suf[k + 1] + (int)strlen(n->names[k]) + 3 + s->nodes[n->props[k]].minv;
        }
        n->minv = min_value(s, i, 0);
    }
    return 0;
}

tqkv_status js_compile(js_schema **out, const char *schema_json, int vocab) {
    js_schema *s = tqkv_calloc(1, sizeof *s);
    if (!s) return TQKV_ENOMEM;
    s->V = vocab;
    s->W = (vocab + 63) / 64;
    atomic_init(&s->refs, 1);
    size_t nc = JS_CACHE_BYTES / (sizeof(uint64_t) * (size_t)s->W);
    s->n_cache = nc < JS_CACHE_MIN ? JS_CACHE_MIN : nc > JS_CACHE_MAX ? JS_CACHE_MAX : (int)nc;
    s->bits = calloc((size_t)s->W * (size_t)s->n_cache, sizeof *s->bits); /* pages touched as used */
    s->cache = calloc((size_t)s->n_cache, sizeof *s->cache);
    s->hash = calloc((size_t)s->n_cache, sizeof *s->hash);
    s->used = calloc((size_t)s->n_cache, sizeof *s->used);
    tqkv_status rc = s->bits && s->cache && s->hash && s->used
                         ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
    for (int i = 0; i < s->n_cache && rc == TQKV_OK; i++) s->cache[i].bits = s->bits + (size_t)i * s->W;
    cJSON *j = NULL;
    if (rc == TQKV_OK && schema_json) {
        j = cJSON_Parse(schema_json);
        if (!j) rc = tqkv_fail(TQKV_EINVAL, "json schema: not valid JSON");
    }
    int root = 0;
    if (rc == TQKV_OK && j) rc = compile_node(s, j, 0, &root);
    else if (rc == TQKV_OK) { /* json_object: any object */
        root = node_add(s);
        if (root < 0) rc = tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
        else s->nodes[root].types = T_OBJECT;
    }
    if (rc == TQKV_OK && (s->nodes[root].types != T_OBJECT || s->nodes[root].n_enum))
        rc = tqkv_fail(TQKV_EINVAL, "json schema: the root must be of type object");
    cJSON_Delete(j);
    if (rc == TQKV_OK && memo_nodes(s)) rc = tqkv_fail(TQKV_ENOMEM, "json schema: out of memory");
    if (rc != TQKV_OK) {
        js_free(s);
        return rc;
    }
    for (int i = 0; i < s->n_nodes; i++) { /* every enum value and every allowed type */
        const js_node *n = &s->nodes[i];
        int m = 5; /* "false" */
        for (int k = 0; k < n->n_enum; k++)
            if ((int)strlen(n->enums[k]) > m) m = (int)strlen(n->enums[k]);
        if ((n->types & T_OBJECT) && n->n_props && 1 + rest_obj(s, n, 0, 0, 0) > m) m = 1 + rest_obj(s, n, 0, 0, 0);
        if (m > s->max_branch) s->max_branch = m;
    }
    *out = s;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Automaton
// ---------------------------------------------------------------------------

enum {
    P_VALUE = 0, /* the node's value is next */
    P_ENUM,      /* inside an enum value (enum_off, enum_live) */
    P_SCALAR,    /* inside a scalar / free object (sc) */
    O_OPEN,      /* after '{' */
    O_KEY,       /* inside property idx's name (off bytes matched) */
    O_KEY_END,   /* the closing quote of the name */
    O_COLON,
    O_AFTER,     /* after property idx's value */
    O_NEXT,      /* after ',' */
    A_OPEN,      /* after '[' */
    A_AFTER,     /* after an item */
    A_NEXT       /* after ',' */
};

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

void js_init(const js_schema *s, js_state *st) {
    (void)s;
    memset(st, 0, sizeof *st);
    st->depth = 1;
    st->f[0].node = 0;
    st->f[0].phase = P_VALUE;
}

int js_complete(const js_state *st) { return st->done; }

/* The top frame's value is complete: pop it; the parent is already in its AFTER phase. */
static void pop(js_state *st) {
    st->depth--;
    st->scalar = 0;
    if (st->depth == 0) st->done = 1;
}

static int push(js_state *st, int node) {
    if (st->depth >= JS_MAX_DEPTH) return 0;
    js_frame *f = &st->f[st->depth++];
    memset(f, 0, sizeof *f);
    f->node = (uint16_t)node;
    f->phase = P_VALUE;
    return 1;
}

static int feed(const js_schema *s, js_state *st, unsigned char c);

/* The first byte of the top frame's value. */
static int value_start(const js_schema *s, js_state *st, unsigned char c) {
    js_frame *f = &st->f[st->depth - 1];
    const js_node *n = &s->nodes[f->node];
    if (n->n_enum) {
        uint64_t live = 0;
        for (int k = 0; k < n->n_enum; k++)
            if ((unsigned char)n->enums[k][0] == c) live |= (uint64_t)1 << k;
        if (!live) return 0;
        f->phase = P_ENUM;
        st->enum_live = live;
        st->enum_off = 1;
        return 1;
    }
    unsigned need = c == '"' ? T_STRING : c == '{' ? T_OBJECT : c == '[' ? T_ARRAY
                  : c == 't' || c == 'f' ? T_BOOL : c == 'n' ? T_NULL
                  : (c == '-' || (c >= '0' && c <= '9')) ? (T_NUMBER | T_INTEGER) : 0;
    if (!(n->types & need)) return 0;
    if (c == '{' && n->n_props > 0) {
        f->phase = O_OPEN;
        return 1;
    }
    if (c == '[') {
        f->phase = A_OPEN;
        return 1;
    }
    /* a scalar, or an object without properties (any object): the JSON automaton */
    f->phase = P_SCALAR;
    st->scalar = 1;
    st->integer = need == (T_NUMBER | T_INTEGER) && !(n->types & T_NUMBER);
    jg_init_value(&st->sc);
    if (!jg_feed(&st->sc, c)) return 0;
    if (jg_complete(&st->sc)) pop(st); /* never for a first byte, kept for clarity */
    return 1;
}

static int enum_feed(const js_schema *s, js_state *st, unsigned char c) {
    js_frame *f = &st->f[st->depth - 1];
    const js_node *n = &s->nodes[f->node];
    uint64_t live = 0, ended = 0;
    for (int k = 0; k < n->n_enum; k++) {
        if (!((st->enum_live >> k) & 1)) continue;
        size_t len = strlen(n->enums[k]);
        if (st->enum_off < len && (unsigned char)n->enums[k][st->enum_off] == c) live |= (uint64_t)1 << k;
        if (st->enum_off == len) ended |= (uint64_t)1 << k;
    }
    if (live) {
        st->enum_live = live;
        st->enum_off++;
        /* a string value (quoted) ends with its last byte; other scalars need what follows */
        for (int k = 0; k < n->n_enum; k++)
            if (((live >> k) & 1) && strlen(n->enums[k]) == st->enum_off && n->enums[k][0] == '"' &&
                live == ((uint64_t)1 << k)) {
                pop(st);
                return 1;
            }
        return 1;
    }
    if (!ended) return 0;
    pop(st); /* a value matched completely: c belongs to the parent */
    return st->done ? 0 : feed(s, st, c);
}

static int feed(const js_schema *s, js_state *st, unsigned char c) {
    if (st->done) return 0;
    js_frame *f = &st->f[st->depth - 1];
    const js_node *n = &s->nodes[f->node];
    switch (f->phase) {
    case P_VALUE: return is_ws(c) || value_start(s, st, c);
    case P_ENUM: return enum_feed(s, st, c);
    case P_SCALAR: {
        if (st->integer && (c == '.' || c == 'e' || c == 'E')) return 0; /* integers: digits only */
        if (jg_feed(&st->sc, c)) {
            if (jg_complete(&st->sc)) pop(st);
            return 1;
        }
        if (!jg_number_can_end(&st->sc)) return 0;
        pop(st); /* the number ended: c belongs to the parent */
        return st->done ? 0 : feed(s, st, c);
    }
    case O_OPEN:
    case O_NEXT:
        if (is_ws(c)) return 1;
        if (c != '"') return 0;
        f->phase = O_KEY;
        f->off = 0;
        return 1;
    case O_KEY: {
        const char *name = n->names[f->idx];
        if (name[f->off] == 0) return c == '"' ? (f->phase = O_COLON, 1) : 0; /* (a NUL byte too) */
        if ((unsigned char)name[f->off] != c) return 0;
        f->off++;
        return 1;
    }
    case O_COLON:
        if (is_ws(c)) return 1;
        if (c != ':') return 0;
        f->phase = O_AFTER;
        return push(st, n->props[f->idx]);
    case O_AFTER:
        if (is_ws(c)) return 1;
        if (c == ',' && f->idx + 1 < n->n_props) {
            f->idx++;
            f->phase = O_NEXT;
            return 1;
        }
        if (c == '}' && f->idx + 1 == n->n_props) {
            pop(st);
            return 1;
        }
        return 0;
    case A_OPEN:
    case A_NEXT:
        if (is_ws(c)) return 1;
        if (c == ']' && f->phase == A_OPEN) {
            pop(st);
            return 1;
        }
        f->phase = A_AFTER;
        if (n->items < 0) { /* any value */
            if (!push(st, 0)) return 0;
            js_frame *g = &st->f[st->depth - 1];
            g->phase = P_SCALAR;
            st->scalar = 1;
            st->integer = 0;
            jg_init_value(&st->sc);
            if (!jg_feed(&st->sc, c)) return 0;
            if (jg_complete(&st->sc)) pop(st);
            return 1;
        }
        if (!push(st, n->items)) return 0;
        return value_start(s, st, c);
    case A_AFTER:
        if (is_ws(c)) return 1;
        if (c == ',') return f->phase = A_NEXT, 1;
        if (c == ']') {
            pop(st);
            return 1;
        }
        return 0;
    default: return 0;
    }
}

int js_feed(const js_schema *s, js_state *st, unsigned char c) {
    js_state t = *st;
    int outside = !(t.scalar && jg_in_string(&t.sc)) &&
                  t.f[t.depth ? t.depth - 1 : 0].phase != O_KEY && t.f[t.depth ? t.depth - 1 : 0].phase != P_ENUM;
    if (outside && is_ws(c) && t.ws >= JG_MAX_WS) return 0;
    if (!feed(s, &t, c)) return 0;
    t.ws = outside && is_ws(c) ? (uint8_t)(st->ws + 1) : 0;
    *st = t;
    return 1;
}

// ---------------------------------------------------------------------------
// Mask
// ---------------------------------------------------------------------------

static int feed_cb(const void *ctx, void *state, unsigned char c) {
    return js_feed(ctx, state, c);
}

/* st with what its frames and phase do not read cleared (frames above the depth, the
 * scalar automaton when no scalar is read, the enum match outside an enum, padding): the
 * cache key. The mask and the shortest completions are functions of this. */
static void state_key(const js_state *st, js_state *k) {
    memset(k, 0, sizeof *k);
    k->depth = st->depth;
    k->done = st->done;
    k->ws = st->ws;
    for (int d = 0; d < st->depth && d < JS_MAX_DEPTH; d++) {
        k->f[d].node = st->f[d].node;
        k->f[d].phase = st->f[d].phase;
        k->f[d].idx = st->f[d].idx;
        k->f[d].off = st->f[d].off;
    }
    if (st->scalar) {
        k->scalar = 1;
        k->integer = st->integer;
        jg_canon(&st->sc, &k->sc);
    }
    if (st->depth > 0 && st->f[st->depth - 1].phase == P_ENUM) {
        k->enum_off = st->enum_off;
        k->enum_live = st->enum_live;
    }
}

static uint64_t key_hash(const js_state *k) {
    uint64_t h = 0x9E3779B97F4A7C15ull, w;
    const unsigned char *p = (const unsigned char *)k;
    size_t i = 0;
    for (; i + 8 <= sizeof *k; i += 8) {
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    for (; i < sizeof *k; i++) h = (h ^ p[i]) * 0x100000001B3ull;
    return h;
}

static void visit_bit(void *vctx, const void *after, int32_t id) {
    (void)after;
    uint64_t *bits = vctx;
    bits[id >> 6] |= (uint64_t)1 << (id & 63);
}

/* Free the budget table of c. */
static void table_drop(js_schema *s, js_entry *c) {
    if (c->thr_id) s->table_bytes -= (size_t)c->cap_thr * (sizeof *c->thr_id + sizeof *c->thr);
    free(c->thr_id);
    free(c->thr);
    c->thr_id = NULL;
    c->thr = NULL;
    c->have_thr = 0;
}

/* The cache entry of st: found, or made (the LRU entry refilled by a walk of the trie). */
static js_entry *entry_of(js_schema *s, const jg_vocab *v, const js_state *st) {
    js_state key;
    state_key(st, &key);
    const uint64_t h = key_hash(&key);
    for (int i = 0; i < s->n_cache; i++)
        if (s->hash[i] == h && s->used[i] && !memcmp(&s->cache[i].key, &key, sizeof key)) {
            s->used[i] = ++s->clock;
            return &s->cache[i];
        }
    int lru = 0;
    for (int i = 1; i < s->n_cache; i++)
        if (s->used[i] < s->used[lru]) lru = i;
    js_entry *c = &s->cache[lru];
    table_drop(s, c);
    memcpy(&c->key, &key, sizeof key); /* (padding too: keys compare with memcmp) */
    s->hash[lru] = h;
    s->used[lru] = ++s->clock;
    memset(c->bits, 0, sizeof(uint64_t) * (size_t)s->W);
    if (st->done) {
        for (int id = 0; id < s->V; id++)
            if (jg_is_eos(v, id)) c->bits[id >> 6] |= (uint64_t)1 << (id & 63);
    } else {
        jg_walk(v, &key, sizeof key, feed_cb, s, visit_bit, c->bits);
    }
    return c;
}

/* -inf at every token whose bit is clear. */
static void apply_bits(const uint64_t *bits, int V, float *logits) {
    for (int w = 0; w * 64 < V; w++) {
        uint64_t clear = ~bits[w];
        if (V - w * 64 < 64) clear &= ((uint64_t)1 << (V - w * 64)) - 1;
        while (clear) {
            logits[w * 64 + __builtin_ctzll(clear)] = -INFINITY;
            clear &= clear - 1;
        }
    }
}

void js_mask(js_schema *s, const jg_vocab *v, const js_state *st, float *logits) {
    apply_bits(entry_of(s, v, st)->bits, s->V, logits);
}

// ---------------------------------------------------------------------------
// Closing within a token budget
// ---------------------------------------------------------------------------

static int min_value(const js_schema *s, int node, int depth);

/* Properties from..n-1 of an object node, each "name":value, commas between, then '}'
 * (n->suf set: the suffix sum; else, while compiling, summed here). */
static int rest_obj(const js_schema *s, const js_node *n, int from, int comma_first, int depth) {
    if (n->suf) return 1 + n->suf[from] + (from < n->n_props ? n->n_props - from - 1 + comma_first : 0);
    int b = 1;
    for (int k = from; k < n->n_props; k++)
        b += (k > from || comma_first) + (int)strlen(n->names[k]) + 3 + min_value(s, n->props[k], depth + 1);
    return b;
}

/* The shortest value of node (bytes): computed from its children (their minv once memo_nodes
 * set it; the schema's depth is bounded at compile, so depth never reaches the cap). */
static int min_value_of(const js_schema *s, const js_node *n, int depth) {
    if (n->n_enum) {
        int b = 1 << 20;
        for (int k = 0; k < n->n_enum; k++)
            if ((int)strlen(n->enums[k]) < b) b = (int)strlen(n->enums[k]);
        return b;
    }
    int b = 1 << 20;
    if (n->types & (T_NUMBER | T_INTEGER)) b = 1;
    if ((n->types & T_STRING) && b > 2) b = 2;
    if ((n->types & T_ARRAY) && b > 2) b = 2;
    if ((n->types & (T_BOOL | T_NULL)) && b > 4) b = 4;
    if (n->types & T_OBJECT) {
        int o = n->n_props ? 1 + rest_obj(s, n, 0, 0, depth) : 2;
        if (o < b) b = o;
    }
    return b;
}

static int min_value(const js_schema *s, int node, int depth) {
    const js_node *n = &s->nodes[node];
    if (depth > JS_MAX_DEPTH) return 1;
    if (n->minv) return n->minv;
    return min_value_of(s, n, depth);
}

/* Bytes to finish frame f (the top one: its own pending part; below: after its child). */
static int frame_close(const js_schema *s, const js_state *st, int d) {
    const js_frame *f = &st->f[d];
    const js_node *n = &s->nodes[f->node];
    switch (f->phase) {
    case P_VALUE: return min_value(s, f->node, d);
    case P_SCALAR: return jg_min_close(&st->sc);
    case P_ENUM: {
        int b = 1 << 20;
        for (int k = 0; k < n->n_enum; k++)
            if ((st->enum_live >> k) & 1) {
                int r = (int)strlen(n->enums[k]) - st->enum_off;
                if (r < b) b = r;
            }
        return b < 0 ? 0 : b;
    }
    case O_OPEN: return rest_obj(s, n, 0, 0, d);
    case O_NEXT: return rest_obj(s, n, f->idx, 0, d);
    case O_KEY:
        return (int)strlen(n->names[f->idx]) - f->off + 2 + min_value(s, n->props[f->idx], d + 1) +
               rest_obj(s, n, f->idx + 1, 1, d);
    case O_COLON: return 1 + min_value(s, n->props[f->idx], d + 1) + rest_obj(s, n, f->idx + 1, 1, d);
    case O_AFTER: return rest_obj(s, n, f->idx + 1, 1, d);
    case A_OPEN: case A_AFTER: return 1;
    case A_NEXT: return (n->items >= 0 ? min_value(s, n->items, d + 1) : 1) + 1;
    default: return 0;
    }
}

int js_min_close(const js_schema *s, const js_state *st) {
    if (st->done) return 0;
    int b = 0;
    for (int d = 0; d < st->depth; d++) b += frame_close(s, st, d);
    return b;
}

typedef struct {
    const js_schema *s;
    const jg_vocab  *v;
    js_entry        *c;
    int              base; /* need + the costliest branch (the byte bound's constant) */
} thr_ctx;

/* The walk past an allowed token: its threshold, the byte bound (need + 4 n + branch, the
 * most the token can raise the shortest completion to) or, when lower, the shortest
 * completion itself. */
static void visit_thr(void *vctx, const void *after, int32_t id) {
    thr_ctx *x = vctx;
    js_entry *c = x->c;
    if (c->n_thr == c->cap_thr) return; /* (never: cap_thr = allowed tokens) */
    int t = x->base + 4 * jg_token_len(x->v, id);
    const int b = js_min_close(x->s, after);
    if (b < t) t = b;
    c->thr_id[c->n_thr] = id;
    c->thr[c->n_thr++] = (uint16_t)(t < JS_THR_SAT ? t : JS_THR_SAT);
}

/* The entry's budget table (a second walk of the trie and a counting sort, once); 0 out of
 * memory. */
static int entry_thr(js_schema *s, const jg_vocab *v, js_entry *c, int need) {
    if (c->have_thr) return 1;
    table_drop(s, c);
    int n = 0;
    for (int w = 0; w < s->W; w++) n += __builtin_popcountll(c->bits[w]);
    const size_t bytes = (size_t)n * (sizeof(int32_t) + sizeof(uint16_t));
    while (s->table_bytes > 0 && s->table_bytes + bytes > JS_TABLE_BYTES) { /* drop LRU tables */
        int lru = -1;
        for (int i = 0; i < s->n_cache; i++)
            if (s->cache[i].thr_id && (lru < 0 || s->used[i] < s->used[lru])) lru = i;
        if (lru < 0) break;
        table_drop(s, &s->cache[lru]);
    }
    int32_t *id = malloc(sizeof *id * (size_t)(n ? n : 1) * 2);
    uint16_t *th = malloc(sizeof *th * (size_t)(n ? n : 1) * 2);
    if (!id || !th) {
        free(id);
        free(th);
        return 0;
    }
    thr_ctx x = {s, v, c, need + s->max_branch};
    c->thr_id = id;
    c->thr = th;
    c->cap_thr = n;
    c->n_thr = 0;
    jg_walk(v, &c->key, sizeof c->key, feed_cb, s, visit_thr, &x);
    /* ascending by threshold, ids ascending within one (a stable counting sort on the
     * clamped value into the second halves) */
    enum { NB = 1024 };
    int cnt[NB + 1] = {0};
    for (int i = 0; i < c->n_thr; i++) cnt[(th[i] < NB ? th[i] : NB - 1) + 1]++;
    for (int k = 0; k < NB; k++) cnt[k + 1] += cnt[k];
    int32_t *id2 = id + n;
    uint16_t *th2 = th + n;
    for (int i = 0; i < c->n_thr; i++) {
        const int k = cnt[th[i] < NB ? th[i] : NB - 1]++;
        id2[k] = id[i];
        th2[k] = th[i];
    }
    /* the clamped top bucket in exact order (insertion: rare and short) */
    for (int i = 1; i < c->n_thr; i++)
        for (int j = i; j > 0 && th2[j - 1] > th2[j]; j--) {
            uint16_t tt = th2[j]; th2[j] = th2[j - 1]; th2[j - 1] = tt;
            int32_t ti = id2[j]; id2[j] = id2[j - 1]; id2[j - 1] = ti;
        }
    memmove(id, id2, sizeof *id * (size_t)c->n_thr);
    memmove(th, th2, sizeof *th * (size_t)c->n_thr);
    int32_t *id1 = realloc(id, sizeof *id * (size_t)(n ? n : 1)); /* the sorting halves go */
    uint16_t *th1 = realloc(th, sizeof *th * (size_t)(n ? n : 1));
    if (id1) c->thr_id = id1;
    if (th1) c->thr = th1;
    s->table_bytes += bytes;
    c->have_thr = 1;
    return 1;
}

/* Token id (allowed from st) keeps the document closable in the `room` tokens after it:
 * its threshold fits (JS_THR_SAT: the exact figure). */
static int thr_keeps(const js_schema *s, const jg_vocab *v, const js_state *st, int32_t id,
                     uint16_t thr, int room) {
    if (thr < JS_THR_SAT) return thr <= room;
    js_state t = *st;
    return js_accept(s, v, &t, id) && js_min_close(s, &t) <= room;
}

void js_mask_budget(js_schema *s, const jg_vocab *v, const js_state *st, int left, float *logits) {
    js_entry *c = entry_of(s, v, st);
    apply_bits(c->bits, s->V, logits);
    const int need = js_min_close(s, st);
    /* A byte raises the shortest completion by at most 4 (',' opening a key of a free
     * object: "":0), and a value's first byte by at most the costliest branch it may pick
     * (a type of a union, an enum value): a token of n bytes by at most 4 n + that. Far
     * from the limit no token can make the document unclosable in time. */
    const int branch = s->max_branch, far = need + 4 * jg_vocab_max_len(v) + branch;
    if (st->done || left > far) return;
    /* near it: keep the tokens after which the shortest completion still fits in the
     * tokens left (each token has at least one byte, and a one-byte step towards the end
     * exists in a byte-level vocabulary); short tokens pass by the bound alone. None
     * kept (no allowed token with a logit above -inf fits): the mask is left as it is. */
    if (!entry_thr(s, v, c, need)) return;
    const int room = left - 1;
    int kept = 0;
    for (int i = 0; i < c->n_thr && !kept && c->thr[i] <= room; i++)
        kept = logits[c->thr_id[i]] != -INFINITY;
    for (int i = c->n_thr - 1; i >= 0 && !kept && c->thr[i] == JS_THR_SAT; i--)
        kept = logits[c->thr_id[i]] != -INFINITY && thr_keeps(s, v, st, c->thr_id[i], c->thr[i], room);
    if (!kept) return;
    for (int i = c->n_thr - 1; i >= 0 && c->thr[i] > room; i--)
        if (!thr_keeps(s, v, st, c->thr_id[i], c->thr[i], room)) logits[c->thr_id[i]] = -INFINITY;
}

int js_accept(const js_schema *s, const jg_vocab *v, js_state *st, int32_t id) {
    const char *b;
    size_t n;
    if (!jg_token_bytes(v, id, &b, &n)) return jg_is_eos(v, id) && st->done;
    js_state t = *st;
    for (size_t i = 0; i < n; i++)
        if (!js_feed(s, &t, (unsigned char)b[i])) return 0;
    *st = t;
    return 1;
}

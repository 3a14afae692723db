/*
 * tokenizer_load.c - tokenizer.json (+ tokenizer_config.json, chat_template.jinja) ->
 * tqkv_tokenizer, with cJSON.
 *
 * Owns: file reading, JSON validation, building the vocab / merges / added tokens /
 * normalizer / pre-tokenizer / decoder / post-processor tables, and tqkv_tokenizer_free.
 * Must not: encode or decode text, keep the JSON tree after loading, hold global mutable
 * state (cJSON's global error pointer is not used: parse errors come from
 * cJSON_ParseWithLengthOpts' return_parse_end).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer/tokenizer_internal.h"
#include "util/file.h"

// ---------------------------------------------------------------------------
// Files and JSON
// ---------------------------------------------------------------------------

static tqkv_status read_file(const char *path, char **out, size_t *len) {
    return tqkv_file_read_all(path, (size_t)1 << 30, out, len, NULL);
}

static tqkv_status parse_json(const char *text, size_t len, const char *name, cJSON **out) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    size_t off = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
    if (root) {  // only whitespace (or NUL padding) may follow the value, as in serde_json
        while (off < len && (!text[off] || strchr(" \t\r\n", text[off]))) off++;
        if (off == len) {
            *out = root;
            return TQKV_OK;
        }
        cJSON_Delete(root);  // trailing data: reported like a syntax error, where it starts
    }
    size_t line = 1, col = 1;
    for (size_t i = 0; i < off; i++) {
        if (text[i] == '\n') { line++; col = 1; }
        else col++;
    }
    char near[33];
    size_t k = 0;
    for (; k < 32 && off + k < len; k++) {
        char c = text[off + k];
        near[k] = (c >= 0x20 && c < 0x7F) ? c : ' ';
    }
    near[k] = 0;
    return tqkv_fail(TQKV_ECORRUPT, "tokenizer: malformed JSON in %s at line %zu column %zu (byte %zu) near '%s'",
                     name, line, col, off, near);
}

// ---------------------------------------------------------------------------
// Small JSON accessors
// ---------------------------------------------------------------------------

/* Object member, treating JSON null as absent. */
static const cJSON *member(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNull(v) ? NULL : v;
}

/* Optional bool: absent -> def; anything but a bool -> -1. */
static int get_bool(const cJSON *o, const char *key, int def) {
    const cJSON *v = member(o, key);
    if (!v) return def;
    if (!cJSON_IsBool(v)) return -1;
    return cJSON_IsTrue(v);
}

/* Optional string: absent -> NULL (*bad = 0); non-string -> NULL (*bad = 1). */
static const char *get_str(const cJSON *o, const char *key, int *bad) {
    const cJSON *v = member(o, key);
    if (!v) return NULL;
    if (!cJSON_IsString(v) || !v->valuestring) { *bad = 1; return NULL; }
    return v->valuestring;
}

static int get_id(const cJSON *v, int32_t *id) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    if (!(d >= 0 && d < (double)(1 << 28)) || d != (double)(int32_t)d) return 0;
    *id = (int32_t)d;
    return 1;
}

static char *dup_str(const char *s) {
    size_t n = strlen(s);
    char *p = malloc(n + 1);
    if (p) memcpy(p, s, n + 1);
    return p;
}

// ---------------------------------------------------------------------------
// Building
// ---------------------------------------------------------------------------

#define BAD(...) tqkv_fail(TQKV_ECORRUPT, __VA_ARGS__)

static tqkv_status arena_add(tqkv_tokenizer *t, const char *s, size_t len, size_t *off) {
    *off = t->arena.n;
    return tkz_buf_append(&t->arena, s, len) ? TQKV_ENOMEM : tkz_buf_append(&t->arena, "", 1);
}

static void bytelevel_tables(tqkv_tokenizer *t) {
    int n = 0;
    for (int i = 0; i < 512; i++) t->char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        int cp = printable ? b : 256 + n++;
        char u[4];
        int len = tkz_utf8_encode(cp, u);
        memcpy(t->byte_utf8[b], u, (size_t)len);
        t->byte_utf8[b][len] = 0;
        t->byte_utf8_len[b] = (uint8_t)len;
        t->char_byte[cp] = (int16_t)b;
    }
}

static tqkv_status parse_pattern(const cJSON *o, const char *what, const char *src, tkz_regex *re) {
    const cJSON *p = member(o, "pattern");
    const cJSON *s = p ? member(p, "String") : NULL;
    const cJSON *r = p ? member(p, "Regex") : NULL;
    if (cJSON_IsString(s)) return tkz_regex_compile(re, s->valuestring, strlen(s->valuestring), 1, what);
    if (cJSON_IsString(r)) return tkz_regex_compile(re, r->valuestring, strlen(r->valuestring), 0, what);
    return BAD("tokenizer: %s in %s needs pattern {\"String\": ...} or {\"Regex\": ...}", what, src);
}

static tqkv_status add_norm(tqkv_tokenizer *t, tkz_norm_step s) {
    tkz_norm_step *p = realloc(t->norm, (size_t)(t->n_norm + 1) * sizeof *p);
    if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    t->norm = p;
    t->norm[t->n_norm++] = s;
    return TQKV_OK;
}

static tqkv_status parse_normalizer(tqkv_tokenizer *t, const cJSON *n, int depth) {
    if (!n) return TQKV_OK;
    const char *src = t->source;
    int bad = 0;
    const char *type = cJSON_IsObject(n) ? get_str(n, "type", &bad) : NULL;
    if (!type || depth > 16) return BAD("tokenizer: normalizer in %s has no type", src);
    tkz_norm_step s;
    memset(&s, 0, sizeof s);
    if (!strcmp(type, "Sequence")) {
        const cJSON *arr = member(n, "normalizers"), *c;
        if (!cJSON_IsArray(arr)) return BAD("tokenizer: Sequence normalizer in %s has no normalizers array", src);
        cJSON_ArrayForEach(c, arr) {
            tqkv_status st = parse_normalizer(t, c, depth + 1);
            if (st) return st;
        }
        return TQKV_OK;
    }
    if (!strcmp(type, "NFC")) s.kind = TKZ_NORM_NFC;
    else if (!strcmp(type, "NFD")) s.kind = TKZ_NORM_NFD;
    else if (!strcmp(type, "NFKC")) s.kind = TKZ_NORM_NFKC;
    else if (!strcmp(type, "NFKD")) s.kind = TKZ_NORM_NFKD;
    else if (!strcmp(type, "Lowercase")) s.kind = TKZ_NORM_LOWERCASE;
    else if (!strcmp(type, "StripAccents")) s.kind = TKZ_NORM_STRIP_ACCENTS;
    else if (!strcmp(type, "Strip")) {
        s.kind = TKZ_NORM_STRIP;
        s.left = get_bool(n, "strip_left", 1);
        s.right = get_bool(n, "strip_right", 1);
        if (s.left < 0 || s.right < 0) return BAD("tokenizer: Strip normalizer in %s: bad strip_left/right", src);
    } else if (!strcmp(type, "Replace") || !strcmp(type, "Prepend")) {
        int is_rep = type[0] == 'R';
        const char *c = get_str(n, is_rep ? "content" : "prepend", &bad);
        if (!c) return BAD("tokenizer: %s normalizer in %s has no %s string", type, src, is_rep ? "content" : "prepend");
        s.kind = is_rep ? TKZ_NORM_REPLACE : TKZ_NORM_PREPEND;
        s.content = dup_str(c);
        s.content_len = strlen(c);
        if (!s.content) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
        if (is_rep) {
            tqkv_status st = parse_pattern(n, "Replace normalizer", src, &s.re);
            if (st) { free(s.content); return st; }
        }
    } else {
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "tokenizer: normalizer type '%s' in %s is not supported (NFC, NFD, NFKC, NFKD, "
                         "Lowercase, StripAccents, Strip, Replace, Prepend, Sequence)", type, src);
    }
    tqkv_status st = add_norm(t, s);
    if (st) { free(s.content); tkz_regex_free(&s.re); }
    return st;
}

static tqkv_status add_pre(tqkv_tokenizer *t, tkz_pre_step s) {
    tkz_pre_step *p = realloc(t->pre, (size_t)(t->n_pre + 1) * sizeof *p);
    if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    t->pre = p;
    t->pre[t->n_pre++] = s;
    return TQKV_OK;
}

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static tqkv_status parse_pretok(tqkv_tokenizer *t, const cJSON *n, int depth) {
    if (!n) return TQKV_OK;
    const char *src = t->source;
    int bad = 0;
    const char *type = cJSON_IsObject(n) ? get_str(n, "type", &bad) : NULL;
    if (!type || depth > 16) return BAD("tokenizer: pre_tokenizer in %s has no type", src);
    tkz_pre_step s;
    memset(&s, 0, sizeof s);
    if (!strcmp(type, "Sequence")) {
        const cJSON *arr = member(n, "pretokenizers"), *c;
        if (!cJSON_IsArray(arr)) return BAD("tokenizer: Sequence pre_tokenizer in %s has no pretokenizers array", src);
        cJSON_ArrayForEach(c, arr) {
            tqkv_status st = parse_pretok(t, c, depth + 1);
            if (st) return st;
        }
        return TQKV_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        s.kind = TKZ_PRE_BYTELEVEL;
        s.add_prefix_space = get_bool(n, "add_prefix_space", 1);
        s.use_regex = get_bool(n, "use_regex", 1);
        if (s.add_prefix_space < 0 || s.use_regex < 0)
            return BAD("tokenizer: ByteLevel pre_tokenizer in %s: bad add_prefix_space/use_regex", src);
        if (s.use_regex && !t->gpt2.code) {
            tqkv_status st = tkz_regex_compile(&t->gpt2, GPT2_PATTERN, sizeof GPT2_PATTERN - 1, 0, "ByteLevel");
            if (st) return st;
        }
    } else if (!strcmp(type, "Split")) {
        static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        const char *b = get_str(n, "behavior", &bad);
        int k = 0;
        while (b && k < 5 && strcmp(b, names[k])) k++;
        if (!b || k == 5) return BAD("tokenizer: Split pre_tokenizer in %s: bad behavior '%s'", src, b ? b : "(none)");
        s.kind = TKZ_PRE_SPLIT;
        s.behavior = (tkz_split_behavior)k;
        s.invert = get_bool(n, "invert", 0);
        if (s.invert < 0) return BAD("tokenizer: Split pre_tokenizer in %s: bad invert", src);
        tqkv_status st = parse_pattern(n, "Split pre_tokenizer", src, &s.re);
        if (st) return st;
    } else if (!strcmp(type, "Digits")) {
        s.kind = TKZ_PRE_DIGITS;
        s.individual_digits = get_bool(n, "individual_digits", 0);
        if (s.individual_digits < 0) return BAD("tokenizer: Digits pre_tokenizer in %s: bad individual_digits", src);
    } else {
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "tokenizer: pre_tokenizer type '%s' in %s is not supported (ByteLevel, Split, "
                         "Digits, Sequence)", type, src);
    }
    tqkv_status st = add_pre(t, s);
    if (st) tkz_regex_free(&s.re);
    return st;
}

static tqkv_status parse_decoder(tqkv_tokenizer *t, const cJSON *n) {
    t->decoder = TKZ_DEC_NONE;
    if (!n) return TQKV_OK;
    int bad = 0;
    const char *type = cJSON_IsObject(n) ? get_str(n, "type", &bad) : NULL;
    if (!type) return BAD("tokenizer: decoder in %s has no type", t->source);
    if (!strcmp(type, "Sequence")) {  // a Sequence holding exactly one ByteLevel
        const cJSON *arr = member(n, "decoders");
        if (cJSON_IsArray(arr) && cJSON_GetArraySize(arr) == 1) return parse_decoder(t, cJSON_GetArrayItem(arr, 0));
    }
    if (!strcmp(type, "ByteLevel")) {
        t->decoder = TKZ_DEC_BYTELEVEL;
        return TQKV_OK;
    }
    return tqkv_fail(TQKV_EUNSUPPORTED, "tokenizer: decoder type '%s' in %s is not supported (ByteLevel)",
                     type, t->source);
}

static tqkv_status push_ids(int32_t **arr, int *n, const int32_t *ids, int k) {
    if (!k) return TQKV_OK;
    int32_t *p = realloc(*arr, (size_t)(*n + k) * sizeof *p);
    if (!p) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    memcpy(p + *n, ids, (size_t)k * sizeof *p);
    *arr = p;
    *n += k;
    return TQKV_OK;
}

static tqkv_status token_pair_id(tqkv_tokenizer *t, const cJSON *pair, int32_t *id) {
    // ["[CLS]", 101]
    if (!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2 || !get_id(cJSON_GetArrayItem(pair, 1), id))
        return BAD("tokenizer: post_processor in %s: bad [token, id] pair", t->source);
    return TQKV_OK;
}

static tqkv_status parse_post(tqkv_tokenizer *t, const cJSON *n, int depth) {
    if (!n) return TQKV_OK;
    int bad = 0;
    const char *type = cJSON_IsObject(n) ? get_str(n, "type", &bad) : NULL;
    if (!type || depth > 8) return BAD("tokenizer: post_processor in %s has no type", t->source);
    if (!strcmp(type, "ByteLevel")) return TQKV_OK;  // offsets only
    if (!strcmp(type, "Sequence")) {
        const cJSON *arr = member(n, "processors"), *c;
        if (!cJSON_IsArray(arr)) return BAD("tokenizer: Sequence post_processor in %s has no processors", t->source);
        cJSON_ArrayForEach(c, arr) {
            tqkv_status st = parse_post(t, c, depth + 1);
            if (st) return st;
        }
        return TQKV_OK;
    }
    if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
        int32_t cls, sep;
        tqkv_status st = token_pair_id(t, member(n, "cls"), &cls);
        if (!st) st = token_pair_id(t, member(n, "sep"), &sep);
        // an outer processor wraps what the inner ones produced
        if (!st) {
            int32_t *pre = malloc((size_t)(t->n_post_prefix + 1) * sizeof *pre);
            if (!pre) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
            pre[0] = cls;
            if (t->n_post_prefix) memcpy(pre + 1, t->post_prefix, (size_t)t->n_post_prefix * sizeof *pre);
            free(t->post_prefix);
            t->post_prefix = pre;
            t->n_post_prefix++;
            st = push_ids(&t->post_suffix, &t->n_post_suffix, &sep, 1);
        }
        return st;
    }
    if (!strcmp(type, "TemplateProcessing")) {
        const cJSON *single = member(n, "single"), *specials = member(n, "special_tokens"), *it;
        if (!cJSON_IsArray(single)) return BAD("tokenizer: TemplateProcessing in %s has no single template", t->source);
        int32_t *pre = NULL, *suf = NULL;
        int npre = 0, nsuf = 0, seen_seq = 0;
        tqkv_status st = TQKV_OK;
        cJSON_ArrayForEach(it, single) {
            const cJSON *sp = member(it, "SpecialToken");
            if (member(it, "Sequence")) {
                seen_seq = 1;
                continue;
            }
            const char *name = sp ? get_str(sp, "id", &bad) : NULL;
            const cJSON *tok = name && specials ? member(specials, name) : NULL;
            const cJSON *ids = tok ? member(tok, "ids") : NULL, *x;
            if (!cJSON_IsArray(ids)) {
                st = BAD("tokenizer: TemplateProcessing in %s: special token '%s' has no ids", t->source,
                         name ? name : "?");
                break;
            }
            cJSON_ArrayForEach(x, ids) {
                int32_t id;
                if (!get_id(x, &id)) { st = BAD("tokenizer: TemplateProcessing in %s: bad id", t->source); break; }
                st = seen_seq ? push_ids(&suf, &nsuf, &id, 1) : push_ids(&pre, &npre, &id, 1);
                if (st) break;
            }
            if (st) break;
        }
        // wrap: new prefix = template prefix + old prefix; new suffix = old suffix + template suffix
        if (!st) st = push_ids(&pre, &npre, t->post_prefix, t->n_post_prefix);
        if (!st) st = push_ids(&t->post_suffix, &t->n_post_suffix, suf, nsuf);
        if (st) { free(pre); free(suf); return st; }
        free(t->post_prefix);
        t->post_prefix = pre;
        t->n_post_prefix = npre;
        free(suf);
        return TQKV_OK;
    }
    if (!t->post_unsupported) {
        t->post_unsupported = dup_str(type);
        if (!t->post_unsupported) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    }
    return TQKV_OK;
}

/* Split "a b" (legacy merges) at its only space. */
static int split_merge(const char *line, size_t *alen, const char **b) {
    const char *sp = strchr(line, ' ');
    if (!sp || strchr(sp + 1, ' ')) return 0;
    *alen = (size_t)(sp - line);
    *b = sp + 1;
    return 1;
}

static tqkv_status parse_model(tqkv_tokenizer *t, const cJSON *model) {
    const char *src = t->source;
    int bad = 0;
    if (!cJSON_IsObject(model)) return BAD("tokenizer: %s has no \"model\" object", src);
    const char *type = get_str(model, "type", &bad);
    if (bad) return BAD("tokenizer: model.type in %s is not a string", src);
    if (!type && !member(model, "merges")) return BAD("tokenizer: model in %s has no type", src);
    if (type && strcmp(type, "BPE"))
        return tqkv_fail(TQKV_EUNSUPPORTED, "tokenizer: model type '%s' in %s is not supported (only BPE)", type, src);
    const cJSON *dropout = member(model, "dropout");
    if (dropout && (!cJSON_IsNumber(dropout) || dropout->valuedouble != 0.0))
        return tqkv_fail(TQKV_EUNSUPPORTED, "tokenizer: BPE dropout in %s is not supported", src);
    const cJSON *vocab = member(model, "vocab"), *merges = member(model, "merges"), *it;
    if (!cJSON_IsObject(vocab)) return BAD("tokenizer: model.vocab in %s is not an object", src);
    if (merges && !cJSON_IsArray(merges)) return BAD("tokenizer: model.merges in %s is not an array", src);

    // ---- model vocab (the id table is sized once the added tokens have their ids)
    tqkv_status st = TQKV_OK;
    t->max_vocab_id = -1;
    cJSON_ArrayForEach(it, vocab) {
        int32_t id = 0;
        if (!it->string || !get_id(it, &id))
            return BAD("tokenizer: vocab entry '%s' in %s has a bad id", it->string ? it->string : "?", src);
        if (id > t->max_vocab_id) t->max_vocab_id = id;
        size_t off, len = strlen(it->string);
        if ((st = arena_add(t, it->string, len, &off))) return st;
        if ((st = tkz_strmap_put(&t->vocab, t->arena.p, off, (uint32_t)len, id))) return st;
    }

    // ---- options
    int fuse = get_bool(model, "fuse_unk", 0), bfb = get_bool(model, "byte_fallback", 0);
    int ign = get_bool(model, "ignore_merges", 0);
    if (fuse < 0 || bfb < 0 || ign < 0) return BAD("tokenizer: model options in %s must be booleans", src);
    t->fuse_unk = fuse;
    t->byte_fallback = bfb;
    t->ignore_merges = ign;
    const char *unk = get_str(model, "unk_token", &bad);
    const char *cpre = get_str(model, "continuing_subword_prefix", &bad);
    const char *esuf = get_str(model, "end_of_word_suffix", &bad);
    if (bad) return BAD("tokenizer: unk_token / continuing_subword_prefix / end_of_word_suffix in %s must be strings", src);
    t->unk_id = -1;
    if (unk) {
        t->unk_id = tkz_strmap_get(&t->vocab, t->arena.p, unk, strlen(unk));
        if (t->unk_id < 0) t->unk_id = -2;  // HF fails only when the unk token is needed
    }
    if (cpre && *cpre && !(t->cont_prefix = dup_str(cpre))) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    if (esuf && *esuf && !(t->eow_suffix = dup_str(esuf))) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_fb[b] = tkz_strmap_get(&t->vocab, t->arena.p, name, strlen(name));
    }

    // ---- merges
    size_t pre_len = t->cont_prefix ? strlen(t->cont_prefix) : 0;
    uint32_t rank = 0;
    tkz_buf cat = {0};
    int index = 0;
    cJSON_ArrayForEach(it, merges) {
        index++;
        const char *a, *b;
        size_t alen;
        if (cJSON_IsString(it)) {
            if (!strncmp(it->valuestring, "#version", 8)) continue;
            if (!split_merge(it->valuestring, &alen, &b)) {
                st = BAD("tokenizer: merge #%d '%s' in %s is not \"a b\"", index, it->valuestring, src);
                break;
            }
            a = it->valuestring;
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 0)) && cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            a = cJSON_GetArrayItem(it, 0)->valuestring;
            alen = strlen(a);
            b = cJSON_GetArrayItem(it, 1)->valuestring;
        } else {
            st = BAD("tokenizer: merge #%d in %s is neither \"a b\" nor [a, b]", index, src);
            break;
        }
        size_t blen = strlen(b);
        int32_t ia = tkz_strmap_get(&t->vocab, t->arena.p, a, alen);
        int32_t ib = tkz_strmap_get(&t->vocab, t->arena.p, b, blen);
        size_t skip = pre_len <= blen ? pre_len : blen;
        cat.n = 0;
        if ((st = tkz_buf_append(&cat, a, alen)) || (st = tkz_buf_append(&cat, b + skip, blen - skip))) break;
        int32_t ic = tkz_strmap_get(&t->vocab, t->arena.p, cat.p, cat.n);
        if (ia < 0 || ib < 0 || ic < 0) {
            st = BAD("tokenizer: merge #%d '%.*s' + '%s' in %s uses a token not in the vocab ('%s')", index,
                     (int)alen, a, b, src, ia < 0 ? "left" : ib < 0 ? "right" : cat.p);
            break;
        }
        if ((st = tkz_mergemap_put(&t->merges, ia, ib, rank++, ic))) break;
    }
    tkz_buf_free(&cat);
    return st;
}

static int pat_cmp(const void *x, const void *y, void *arena) {
    const tkz_pat *a = x, *b = y;
    uint8_t fa = (uint8_t)((const char *)arena)[a->off], fb = (uint8_t)((const char *)arena)[b->off];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->added - b->added;
}

static tqkv_status build_set(tqkv_tokenizer *t, tkz_matchset *set) {
    if (set->n > 1) qsort_r(set->pat, (size_t)set->n, sizeof *set->pat, pat_cmp, t->arena.p);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < set->n && (uint8_t)t->arena.p[set->pat[k].off] < b) k++;
        set->first[b] = k;
    }
    set->first[256] = set->n;
    return TQKV_OK;
}

/* HF AddedVocabulary::add_tokens: an added token whose content is already known (an
 * earlier added token, then the model vocab) takes that id; a new one gets the next id
 * after the model vocab (vocab entry count) or after the largest added id. The id in
 * the JSON is only checked by HF (with a warning), so it is ignored here too. */
static tqkv_status assign_added(tqkv_tokenizer *t, const cJSON *arr) {
    const char *src = t->source;
    const cJSON *it;
    int n = cJSON_GetArraySize(arr);
    if (n && !(t->added = calloc((size_t)n, sizeof *t->added))) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    int32_t vocab_count = (int32_t)t->vocab.n, max_added = -1;
    tqkv_status st = TQKV_OK;
    cJSON_ArrayForEach(it, arr) {
        int32_t json_id;
        if (!cJSON_IsObject(it) || !get_id(member(it, "id"), &json_id) || !cJSON_IsString(member(it, "content")))
            return BAD("tokenizer: added_tokens entry in %s needs an id and a content string", src);
        const char *content = member(it, "content")->valuestring;
        size_t len = strlen(content), off;
        int sp = get_bool(it, "special", 0);
        int lst = get_bool(it, "lstrip", 0), rst = get_bool(it, "rstrip", 0);
        int sw = get_bool(it, "single_word", 0), nm = get_bool(it, "normalized", sp > 0 ? 0 : 1);
        if (sp < 0 || lst < 0 || rst < 0 || sw < 0 || nm < 0)
            return BAD("tokenizer: added token '%s' in %s: flags must be booleans", content, src);
        if (tkz_utf8_valid_prefix(content, len) != len)
            return BAD("tokenizer: added token content in %s is not valid UTF-8", src);
        if (!len) continue;  // HF ignores empty tokens
        tkz_added a;
        memset(&a, 0, sizeof a);
        a.special = (uint8_t)sp;
        a.lstrip = (uint8_t)lst;
        a.rstrip = (uint8_t)rst;
        a.single_word = (uint8_t)sw;
        a.normalized = (uint8_t)nm;
        int32_t known = tkz_strmap_get(&t->added_map, t->arena.p, content, len);
        if (known >= 0) {  // same content again: the later flags win, special sticks
            for (int k = 0; k < t->n_added; k++) {
                tkz_added *b = &t->added[k];
                if (b->id != known) continue;
                a.special |= b->special;
                a.off = b->off;
                a.len = b->len;
                a.id = b->id;
                *b = a;
            }
            continue;
        }
        a.id = tkz_strmap_get(&t->vocab, t->arena.p, content, len);
        if (a.id < 0)
            a.id = max_added < 0 ? vocab_count
                   : (max_added >= vocab_count || vocab_count == 0) ? max_added + 1 : vocab_count;
        if (a.id > max_added) max_added = a.id;
        if ((st = arena_add(t, content, len, &off))) return st;
        a.off = off;
        a.len = (uint32_t)len;
        if ((st = tkz_strmap_put(&t->added_map, t->arena.p, off, (uint32_t)len, a.id))) return st;
        t->added[t->n_added++] = a;
    }
    return TQKV_OK;
}

/* Id table (token string per id, added tokens first) and the added-token match sets. */
static tqkv_status build_ids(tqkv_tokenizer *t) {
    int32_t max_id = t->max_vocab_id;
    for (int k = 0; k < t->n_added; k++)
        if (t->added[k].id > max_id) max_id = t->added[k].id;
    if (max_id < 0) return BAD("tokenizer: %s has an empty vocab", t->source);
    // the id tables are dense: refuse ids far beyond the token count (a crafted file
    // would otherwise make a few bytes of JSON allocate and touch gigabytes)
    long long tokens = (long long)t->vocab.n + t->n_added;
    if (max_id > 4 * tokens + 65536)
        return BAD("tokenizer: %s has token id %d for only %lld tokens (ids must be nearly dense)",
                   t->source, max_id, tokens);
    t->n_ids = max_id + 1;
    t->tok = malloc((size_t)t->n_ids * sizeof *t->tok);
    t->dec = malloc((size_t)t->n_ids * sizeof *t->dec);
    t->special = calloc((size_t)t->n_ids, 1);
    if (!t->tok || !t->dec || !t->special) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory (%d ids)", t->n_ids);
    for (int32_t i = 0; i < t->n_ids; i++) {
        t->tok[i].off = 0;
        t->tok[i].len = SIZE_MAX;
        t->dec[i] = t->tok[i];
    }
    for (size_t j = 0; j < t->vocab.cap; j++) {
        const tkz_entry *e = &t->vocab.e[j];
        if (!e->hash) continue;
        t->tok[e->val].off = e->off;
        t->tok[e->val].len = e->len;
    }
    if (t->n_added) {
        t->set_raw.pat = calloc((size_t)t->n_added, sizeof(tkz_pat));
        t->set_norm.pat = calloc((size_t)t->n_added, sizeof(tkz_pat));
        if (!t->set_raw.pat || !t->set_norm.pat) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    }
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    tkz_matches mm = {0};
    tkz_buf norm = {0}, tmp = {0};
    tqkv_status st = md ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    for (int k = 0; k < t->n_added && !st; k++) {
        const tkz_added *a = &t->added[k];
        t->tok[a->id].off = a->off;  // added tokens take precedence in id -> token
        t->tok[a->id].len = a->len;
        if (a->special) {
            t->special[a->id] = 1;
            int32_t v = tkz_strmap_get(&t->vocab, t->arena.p, t->arena.p + a->off, a->len);
            if (v >= 0) t->special[v] = 1;  // HF skips by token string
        }
        tkz_matchset *set = a->normalized ? &t->set_norm : &t->set_raw;
        tkz_pat *p = &set->pat[set->n];
        p->added = k;
        p->off = a->off;
        p->len = a->len;
        if (a->normalized && t->n_norm) {  // matched on normalized text: normalize the pattern too
            char *content = malloc(a->len + 1);
            if (!content) { st = tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory"); break; }
            memcpy(content, t->arena.p + a->off, a->len);
            st = tkz_normalize(t, md, &mm, content, a->len, &norm, &tmp);
            free(content);
            if (!st) st = arena_add(t, norm.p, norm.n, &p->off);
            p->len = (uint32_t)norm.n;
        }
        if (st) break;
        // HF id -> token gives the normalized content of a normalized token
        t->tok[a->id].off = p->off;
        t->tok[a->id].len = p->len;
        if (p->len) set->n++;
    }
    if (md) pcre2_match_data_free(md);
    free(mm.m);
    tkz_buf_free(&norm);
    tkz_buf_free(&tmp);
    if (st) return st;
    build_set(t, &t->set_raw);
    build_set(t, &t->set_norm);
    return TQKV_OK;
}

/* Decoder bytes of every id. */
static tqkv_status build_decoded(tqkv_tokenizer *t) {
    tkz_buf b = {0};
    tqkv_status st = TQKV_OK;
    for (int32_t id = 0; id < t->n_ids && !st; id++) {
        if (t->tok[id].len == SIZE_MAX) continue;
        const char *s = t->arena.p + t->tok[id].off;
        size_t len = t->tok[id].len;
        b.n = 0;
        int all = t->decoder == TKZ_DEC_BYTELEVEL;
        for (size_t i = 0; i < len && all && !st;) {
            int32_t cp;
            i += (size_t)tkz_utf8_decode(s + i, len - i, &cp);
            if (cp >= 512 || t->char_byte[cp] < 0) { all = 0; break; }
            char c = (char)t->char_byte[cp];
            st = tkz_buf_append(&b, &c, 1);
        }
        if (st) break;
        if (all) {
            st = arena_add(t, b.p ? b.p : "", b.n, &t->dec[id].off);
            t->dec[id].len = b.n;
        } else {
            t->dec[id] = t->tok[id];  // not all byte-level chars: HF keeps the token's UTF-8
        }
    }
    tkz_buf_free(&b);
    return st;
}

static int32_t lookup_token(const tqkv_tokenizer *t, const char *s) {
    size_t len = strlen(s);
    int32_t id = tkz_strmap_get(&t->added_map, t->arena.p, s, len);
    return id >= 0 ? id : tkz_strmap_get(&t->vocab, t->arena.p, s, len);
}

static tqkv_status build(tqkv_tokenizer *t, const cJSON *root) {
    const char *src = t->source;
    if (!cJSON_IsObject(root)) return BAD("tokenizer: %s is not a JSON object", src);
    const cJSON *added = member(root, "added_tokens");
    if (added && !cJSON_IsArray(added)) return BAD("tokenizer: added_tokens in %s is not an array", src);
    bytelevel_tables(t);
    t->eos = t->bos = t->pad = -1;
    tqkv_status st = parse_model(t, member(root, "model"));
    if (!st) st = parse_normalizer(t, member(root, "normalizer"), 0);
    if (!st) st = parse_pretok(t, member(root, "pre_tokenizer"), 0);
    if (!st) st = parse_decoder(t, member(root, "decoder"));
    if (!st) st = parse_post(t, member(root, "post_processor"), 0);
    if (!st) st = assign_added(t, added);
    if (!st) st = build_ids(t);  // after the normalizer: normalized patterns
    if (!st) st = build_decoded(t);
    for (int k = 0; k < t->n_post_prefix + t->n_post_suffix && !st; k++) {
        int32_t id = k < t->n_post_prefix ? t->post_prefix[k] : t->post_suffix[k - t->n_post_prefix];
        if (id >= t->n_ids || t->tok[id].len == SIZE_MAX)
            st = BAD("tokenizer: post_processor in %s uses id %d which has no token", src, id);
    }
    return st;
}

// ---------------------------------------------------------------------------
// tokenizer_config.json
// ---------------------------------------------------------------------------

static const char *config_token(const cJSON *cfg, const char *key) {
    const cJSON *v = member(cfg, key);
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v) && cJSON_IsString(member(v, "content"))) return member(v, "content")->valuestring;
    return NULL;
}

static tqkv_status apply_config(tqkv_tokenizer *t, const cJSON *cfg, const char *name) {
    if (!cJSON_IsObject(cfg)) return BAD("tokenizer: %s is not a JSON object", name);
    const char *s;
    if ((s = config_token(cfg, "eos_token"))) t->eos = lookup_token(t, s);
    if ((s = config_token(cfg, "bos_token"))) t->bos = lookup_token(t, s);
    if ((s = config_token(cfg, "pad_token"))) t->pad = lookup_token(t, s);
    const cJSON *ct = member(cfg, "chat_template");
    const char *tmpl = NULL;
    if (cJSON_IsString(ct)) {
        tmpl = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {  // [{"name": ..., "template": ...}]: "default", else the first
        const cJSON *it;
        cJSON_ArrayForEach(it, ct) {
            const cJSON *nm = member(it, "name"), *tp = member(it, "template");
            if (!cJSON_IsString(tp)) continue;
            if (!tmpl) tmpl = tp->valuestring;
            if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default")) { tmpl = tp->valuestring; break; }
        }
    }
    if (tmpl && !(t->chat_template = dup_str(tmpl))) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Public
// ---------------------------------------------------------------------------

void tqkv_tokenizer_free(tqkv_tokenizer *t) {
    if (!t) return;
    free(t->source);
    tkz_buf_free(&t->arena);
    free(t->tok);
    free(t->dec);
    free(t->special);
    tkz_strmap_free(&t->vocab);
    tkz_strmap_free(&t->added_map);
    tkz_mergemap_free(&t->merges);
    free(t->added);
    free(t->set_raw.pat);
    free(t->set_norm.pat);
    for (int k = 0; k < t->n_norm; k++) {
        tkz_regex_free(&t->norm[k].re);
        free(t->norm[k].content);
    }
    free(t->norm);
    for (int k = 0; k < t->n_pre; k++) tkz_regex_free(&t->pre[k].re);
    free(t->pre);
    tkz_regex_free(&t->gpt2);
    free(t->cont_prefix);
    free(t->eow_suffix);
    free(t->post_prefix);
    free(t->post_suffix);
    free(t->post_unsupported);
    free(t->chat_template);
    free(t);
}

tqkv_status tqkv_tokenizer_load_json(tqkv_tokenizer **out, const char *json, size_t len,
                                     const char *name) {
    if (!out || !json) return tqkv_fail(TQKV_EINVAL, "tokenizer_load_json: NULL argument");
    if (!name) name = "tokenizer.json";
    cJSON *root = NULL;
    tqkv_status st = parse_json(json, len, name, &root);
    if (st) return st;
    tqkv_tokenizer *t = calloc(1, sizeof *t);
    if (!t || !(t->source = dup_str(name))) {
        free(t);
        cJSON_Delete(root);
        return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    }
    st = build(t, root);
    cJSON_Delete(root);
    if (st) {
        tqkv_tokenizer_free(t);
        return st;
    }
    *out = t;
    return TQKV_OK;
}

tqkv_status tqkv_tokenizer_load_file(tqkv_tokenizer **out, const char *path) {
    if (!out || !path) return tqkv_fail(TQKV_EINVAL, "tokenizer_load_file: NULL argument");
    char *buf;
    size_t len;
    tqkv_status st = read_file(path, &buf, &len);
    if (st) return st;
    st = tqkv_tokenizer_load_json(out, buf, len, path);
    free(buf);
    return st;
}

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

tqkv_status tqkv_tokenizer_load(tqkv_tokenizer **out, const char *dir) {
    if (!out || !dir) return tqkv_fail(TQKV_EINVAL, "tokenizer_load: NULL argument");
    size_t dl = strlen(dir);
    char *path = malloc(dl + 32);
    if (!path) return tqkv_fail(TQKV_ENOMEM, "tokenizer: out of memory");
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        tqkv_status st = tqkv_fail(TQKV_EIO, "tokenizer: cannot open model directory %s: %s", dir, strerror(errno));
        free(path);
        return st;
    }
    if (!S_ISDIR(sb.st_mode)) {  // a tokenizer.json path works too
        free(path);
        return tqkv_tokenizer_load_file(out, dir);
    }
    tqkv_tokenizer *t = NULL;
    snprintf(path, dl + 32, "%s/tokenizer.json", dir);
    tqkv_status st = tqkv_tokenizer_load_file(&t, path);
    char *buf = NULL;
    size_t len = 0;
    snprintf(path, dl + 32, "%s/tokenizer_config.json", dir);
    if (!st && file_exists(path)) {
        cJSON *cfg = NULL;
        st = read_file(path, &buf, &len);
        if (!st) st = parse_json(buf, len, path, &cfg);
        if (!st) st = apply_config(t, cfg, path);
        cJSON_Delete(cfg);
        free(buf);
        buf = NULL;
    }
    snprintf(path, dl + 32, "%s/chat_template.jinja", dir);
    if (!st && file_exists(path)) {
        st = read_file(path, &buf, &len);
        if (!st) {
            free(t->chat_template);
            t->chat_template = buf;  // NUL-terminated by read_file
        }
    }
    free(path);
    if (st) {
        tqkv_tokenizer_free(t);
        return st;
    }
    *out = t;
    return TQKV_OK;
}

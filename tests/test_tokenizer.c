/*
 * test_tokenizer.c - the tokenizer.json tokenizer against HF `tokenizers`:
 *   - the whole ../shared heldout file: count, crc32 and per-chunk crc32 equal the golden
 *     (tests/golden/tokenizer.json), and every golden case (ids, decode);
 *   - tokenizer variants built from the real vocab (Qwen2 / Llama-3 style Split +
 *     ByteLevel, normalizers, added-token flags, byte_fallback / unk) against ids that
 *     HF tokenizers 0.23.2 produced for the same JSON;
 *   - decode(encode(text)) == text on fresh random multilingual text;
 *   - streaming decode: valid UTF-8 chunks whose concatenation is decode(all);
 *   - errors: malformed JSON, unsupported types, missing files, bad input.
 * Owns: these tests only. Must not: time anything in an assertion.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "testutil.h"
#include "tokenizer_variant_cases.h"
#include "tqkv_tokenizer.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

static char *read_bytes(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[n] = 0;
    if (len) *len = (size_t)n;
    return b;
}

static void write_bytes(const char *path, const char *s, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(s, 1, len, f), len);
    fclose(f);
}

static void tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "/tmp/tqkv_tok_%ld_%s", (long)getpid(), name);
}

static tqkv_tokenizer *load_base(void) {
    char dir[1024];
    source_path("models/qwen3-code-28m", dir, sizeof dir);
    tqkv_tokenizer *t = NULL;
    tqkv_status st = tqkv_tokenizer_load(&t, dir);
    if (st) fprintf(stderr, "load %s: %s\n", dir, tqkv_last_error());
    assert_int_equal(st, TQKV_OK);
    return t;
}

/* Independent strict UTF-8 check (not the library's). */
static int utf8_ok(const char *p, size_t n) {
    const unsigned char *s = (const unsigned char *)p;
    for (size_t i = 0; i < n;) {
        unsigned c = s[i], need, min;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xE0) == 0xC0) { need = 1; min = 0x80; c &= 0x1F; }
        else if ((c & 0xF0) == 0xE0) { need = 2; min = 0x800; c &= 0x0F; }
        else if ((c & 0xF8) == 0xF0) { need = 3; min = 0x10000; c &= 0x07; }
        else return 0;
        if (i + need >= n) return 0;  // bytes i+1 .. i+need must exist
        for (unsigned k = 1; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            c = (c << 6) | (s[i + k] & 0x3F);
        }
        if (c < min || c > 0x10FFFF || (c >= 0xD800 && c < 0xE000)) return 0;
        i += need + 1;
    }
    return 1;
}

static size_t put_cp(char *o, uint32_t c) {
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | (c >> 6)); o[1] = (char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12));
        o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18));
    o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

static uint32_t crc_ids(const int32_t *ids, size_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    unsigned char b[4096 * 4];
    for (size_t i = 0; i < n;) {
        size_t k = 0;
        for (; k < 4096 && i < n; k++, i++) {
            uint32_t v = (uint32_t)ids[i];
            b[4 * k] = (unsigned char)v;
            b[4 * k + 1] = (unsigned char)(v >> 8);
            b[4 * k + 2] = (unsigned char)(v >> 16);
            b[4 * k + 3] = (unsigned char)(v >> 24);
        }
        c = crc32(c, b, (uInt)(4 * k));
    }
    return (uint32_t)c;
}

static void print_hex(const char *what, const char *s, size_t n) {
    fprintf(stderr, "%s (%zu bytes):", what, n);
    for (size_t i = 0; i < n && i < 400; i++) fprintf(stderr, " %02x", (unsigned char)s[i]);
    fprintf(stderr, "\n");
}

static void roundtrip_check(const tqkv_tokenizer *t, const char *s, size_t len) {
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tqkv_tokenizer_encode(t, s, len, 0, &ids, &n), TQKV_OK);
    char *d = NULL;
    size_t dl = 0;
    assert_int_equal(tqkv_tokenizer_decode(t, ids, n, 0, &d, &dl), TQKV_OK);
    if (dl != len || memcmp(d, s, len)) {
        print_hex("input", s, len);
        print_hex("decoded", d, dl);
        fail_msg("decode(encode(text)) != text");
    }
    free(d);
    free(ids);
}

// ---------------------------------------------------------------------------
// Goldens from HF tokenizers (tests/golden/tokenizer.json)
// ---------------------------------------------------------------------------

static cJSON *load_golden(void) {
    char path[1024];
    source_path("tests/golden/tokenizer.json", path, sizeof path);
    size_t len;
    char *txt = read_bytes(path, &len);
    if (!txt) fail_msg("golden file %s is missing", path);
    cJSON *g = cJSON_ParseWithLength(txt, len);
    free(txt);
    if (!g) fail_msg("golden file %s is not valid JSON", path);
    return g;
}

static int hexval(char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; }

static void test_heldout_golden(void **state) {
    (void)state;
    char path[1024];
    if (!shared_path("data/heldout-code.txt", path, sizeof path)) {
        fprintf(stderr, "../shared/data/heldout-code.txt absent: skipping\n");
        skip();
    }
    cJSON *g = load_golden();
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(g, "heldout");
    if (!cJSON_IsObject(h)) h = g;  // flat layout
    const cJSON *jn = cJSON_GetObjectItemCaseSensitive(h, "n_tokens");
    const cJSON *jcrc = cJSON_GetObjectItemCaseSensitive(h, "crc32");
    const cJSON *jchunk = cJSON_GetObjectItemCaseSensitive(h, "chunk");
    const cJSON *jcc = cJSON_GetObjectItemCaseSensitive(h, "chunk_crc32");
    const cJSON *jhead = cJSON_GetObjectItemCaseSensitive(h, "head");
    assert_true(cJSON_IsNumber(jn) && cJSON_IsNumber(jcrc) && cJSON_IsArray(jhead));

    size_t len;
    char *text = read_bytes(path, &len);
    assert_non_null(text);
    tqkv_tokenizer *t = load_base();
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tqkv_tokenizer_encode(t, text, len, 0, &ids, &n), TQKV_OK);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double sec = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    fprintf(stderr, "heldout: %zu bytes -> %zu tokens in %.3f s (%.1f MB/s)\n", len, n, sec, len / sec / 1e6);

    // first differing id within the head, then the first differing chunk
    int nh = cJSON_GetArraySize(jhead);
    for (int i = 0; i < nh; i++) {
        int want = cJSON_GetArrayItem(jhead, i)->valueint;
        if ((size_t)i >= n || ids[i] != want)
            fail_msg("heldout: first differing id at %d: got %d, want %d", i, (size_t)i < n ? ids[i] : -1, want);
    }
    if (cJSON_IsNumber(jchunk) && cJSON_IsArray(jcc)) {
        size_t chunk = (size_t)jchunk->valuedouble;
        int nc = cJSON_GetArraySize(jcc);
        for (int c = 0; c < nc; c++) {
            size_t s = (size_t)c * chunk;
            size_t e = s + chunk < n ? s + chunk : n;
            uint32_t got = s < n ? crc_ids(ids + s, e - s) : 0;
            uint32_t want = (uint32_t)cJSON_GetArrayItem(jcc, c)->valuedouble;
            if (got != want)
                fail_msg("heldout: first differing chunk %d (ids %zu..%zu): crc32 0x%08x, want 0x%08x", c, s,
                         s + chunk, got, want);
        }
    }
    assert_int_equal(n, (size_t)jn->valuedouble);
    assert_int_equal(crc_ids(ids, n), (uint32_t)jcrc->valuedouble);

    // and it decodes back to the file
    char *d = NULL;
    size_t dl = 0;
    assert_int_equal(tqkv_tokenizer_decode(t, ids, n, 0, &d, &dl), TQKV_OK);
    assert_int_equal(dl, len);
    assert_memory_equal(d, text, len);
    free(d);
    free(ids);
    free(text);
    tqkv_tokenizer_free(t);
    cJSON_Delete(g);
}

static void test_golden_cases(void **state) {
    (void)state;
    cJSON *g = load_golden();
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(g, "cases"), *c;
    assert_true(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) > 0);
    tqkv_tokenizer *t = load_base();
    int k = 0;
    cJSON_ArrayForEach(c, cases) {
        const cJSON *hex = cJSON_GetObjectItemCaseSensitive(c, "utf8_hex");
        const cJSON *txt = cJSON_GetObjectItemCaseSensitive(c, "text");
        const cJSON *jids = cJSON_GetObjectItemCaseSensitive(c, "ids");
        const cJSON *dec = cJSON_GetObjectItemCaseSensitive(c, "decoded");
        const cJSON *pieces = cJSON_GetObjectItemCaseSensitive(c, "pieces");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(c, "name");
        char *in;
        size_t len;
        if (cJSON_IsString(hex)) {  // exact input bytes
            len = strlen(hex->valuestring) / 2;
            in = malloc(len + 1);
            for (size_t i = 0; i < len; i++)
                in[i] = (char)(hexval(hex->valuestring[2 * i]) * 16 + hexval(hex->valuestring[2 * i + 1]));
        } else {
            assert_true(cJSON_IsString(txt));
            len = strlen(txt->valuestring);
            in = malloc(len + 1);
            memcpy(in, txt->valuestring, len);
        }
        const char *label = cJSON_IsString(name) ? name->valuestring : "?";
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(tqkv_tokenizer_encode(t, in, len, 0, &ids, &n), TQKV_OK);
        int want_n = cJSON_GetArraySize(jids);
        for (int i = 0; i < want_n || (size_t)i < n; i++) {
            int want = i < want_n ? cJSON_GetArrayItem(jids, i)->valueint : -1;
            int got = (size_t)i < n ? ids[i] : -1;
            if (want != got) {
                print_hex("input", in, len);
                fail_msg("case %d '%s': id %d is %d, want %d (%zu ids, want %d)", k, label, i, got, want, n, want_n);
            }
        }
        if (cJSON_IsArray(pieces))
            for (size_t i = 0; i < n; i++) {
                const char *p;
                size_t pl;
                assert_int_equal(tqkv_tokenizer_id_to_token(t, ids[i], &p, &pl), TQKV_OK);
                const char *want = cJSON_GetArrayItem(pieces, (int)i)->valuestring;
                assert_int_equal(pl, strlen(want));
                assert_memory_equal(p, want, pl);
            }
        char *d = NULL;
        size_t dl = 0;
        assert_int_equal(tqkv_tokenizer_decode(t, ids, n, 0, &d, &dl), TQKV_OK);
        assert_true(cJSON_IsString(dec));
        if (dl != strlen(dec->valuestring) || memcmp(d, dec->valuestring, dl)) {
            print_hex("decoded", d, dl);
            print_hex("want", dec->valuestring, strlen(dec->valuestring));
            fail_msg("case %d '%s': decode differs", k, label);
        }
        free(d);
        free(ids);
        free(in);
        k++;
    }
    fprintf(stderr, "%d golden cases match\n", k);
    tqkv_tokenizer_free(t);
    cJSON_Delete(g);
}

// ---------------------------------------------------------------------------
// Variants of the real tokenizer.json, checked against HF tokenizers 0.23.2
// ---------------------------------------------------------------------------

static const char QWEN2_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static cJSON *split_obj(const char *kind, const char *pattern, const char *behavior, int invert) {
    cJSON *o = cJSON_CreateObject(), *p = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "Split");
    cJSON_AddStringToObject(p, kind, pattern);
    cJSON_AddItemToObject(o, "pattern", p);
    cJSON_AddStringToObject(o, "behavior", behavior);
    cJSON_AddBoolToObject(o, "invert", invert);
    return o;
}

static cJSON *bytelevel_obj(int add_prefix_space, int use_regex) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "ByteLevel");
    cJSON_AddBoolToObject(o, "add_prefix_space", add_prefix_space);
    cJSON_AddBoolToObject(o, "trim_offsets", 1);
    cJSON_AddBoolToObject(o, "use_regex", use_regex);
    return o;
}

static cJSON *typed(const char *type) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    return o;
}

static cJSON *seq(const char *type, const char *key, cJSON **items, int n) {
    cJSON *o = typed(type), *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, items[i]);
    cJSON_AddItemToObject(o, key, a);
    return o;
}

static void set_item(cJSON *o, const char *key, cJSON *v) {
    if (cJSON_GetObjectItemCaseSensitive(o, key)) cJSON_ReplaceItemInObjectCaseSensitive(o, key, v);
    else cJSON_AddItemToObject(o, key, v);
}

static cJSON *added_obj(int id, const char *content, int single_word, int lstrip, int rstrip, int normalized,
                        int special) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", id);
    cJSON_AddStringToObject(o, "content", content);
    cJSON_AddBoolToObject(o, "single_word", single_word);
    cJSON_AddBoolToObject(o, "lstrip", lstrip);
    cJSON_AddBoolToObject(o, "rstrip", rstrip);
    cJSON_AddBoolToObject(o, "normalized", normalized);
    cJSON_AddBoolToObject(o, "special", special);
    return o;
}

static const char TINY_JSON[] =
    "{\"version\": \"1.0\", \"added_tokens\": [], \"normalizer\": null,"
    " \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, \"behavior\": \"Removed\", \"invert\": false},"
    " \"post_processor\": null, \"decoder\": null,"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": \"<unk>\", \"continuing_subword_prefix\": \"##\","
    " \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": true, \"ignore_merges\": false,"
    " \"vocab\": {\"<unk>\": 0, \"a\": 1, \"b\": 2, \"ab\": 3, \"##b\": 4, \"a##b\": 5, \"c\": 6, \"<0xC3>\": 7,"
    " \"<0xA9>\": 8, \"<0x64>\": 9, \"##c\": 10, \"abc\": 11, \"##a\": 12},"
    " \"merges\": [[\"a\", \"##b\"], [\"ab\", \"##c\"]]}}";

/* Build variant `name` of the real tokenizer.json (or the tiny one) and load it. */
static tqkv_tokenizer *load_variant(const char *name) {
    cJSON *j;
    if (!strncmp(name, "tiny", 4)) {
        j = cJSON_Parse(TINY_JSON);
        cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "model");
        if (!strcmp(name, "tinyunk")) {
            set_item(m, "byte_fallback", cJSON_CreateFalse());
            set_item(m, "fuse_unk", cJSON_CreateTrue());
        } else if (!strcmp(name, "tinynounk")) {
            set_item(m, "byte_fallback", cJSON_CreateFalse());
            set_item(m, "unk_token", cJSON_CreateNull());
        }
    } else {
        char path[1024];
        source_path("models/qwen3-code-28m/tokenizer.json", path, sizeof path);
        char *txt = read_bytes(path, NULL);
        assert_non_null(txt);
        j = cJSON_Parse(txt);
        free(txt);
    }
    assert_non_null(j);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    if (!strcmp(name, "qwen2")) {
        set_item(j, "normalizer", typed("NFC"));
        cJSON *p[] = {split_obj("Regex", QWEN2_RE, "Isolated", 0), bytelevel_obj(0, 0)};
        set_item(j, "pre_tokenizer", seq("Sequence", "pretokenizers", p, 2));
    } else if (!strcmp(name, "llama3")) {
        cJSON *nm[] = {typed("NFKC"), typed("Lowercase")};
        set_item(j, "normalizer", seq("Sequence", "normalizers", nm, 2));
        cJSON *p[] = {split_obj("Regex", LLAMA3_RE, "Isolated", 0), bytelevel_obj(1, 0)};
        set_item(j, "pre_tokenizer", seq("Sequence", "pretokenizers", p, 2));
        // merges as legacy "a b" strings, and ignore_merges
        cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges"), *legacy = cJSON_CreateArray(), *it;
        cJSON_ArrayForEach(it, merges) {
            const char *a = cJSON_GetArrayItem(it, 0)->valuestring, *b = cJSON_GetArrayItem(it, 1)->valuestring;
            char *buf = malloc(strlen(a) + strlen(b) + 2);
            sprintf(buf, "%s %s", a, b);
            cJSON_AddItemToArray(legacy, cJSON_CreateString(buf));
            free(buf);
        }
        set_item(model, "merges", legacy);
        set_item(model, "ignore_merges", cJSON_CreateTrue());
    } else if (!strcmp(name, "added")) {
        set_item(j, "normalizer", typed("Lowercase"));
        cJSON *at = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
        cJSON_AddItemToArray(at, added_obj(8192, "<tool>", 0, 1, 1, 0, 0));
        cJSON_AddItemToArray(at, added_obj(8193, "fn", 1, 0, 0, 0, 0));  // in the vocab: HF uses its id
        cJSON_AddItemToArray(at, added_obj(8194, "Hello", 0, 0, 0, 1, 0));
        cJSON_AddItemToArray(at, added_obj(8195, "<|sys|>", 0, 0, 0, 0, 1));
        cJSON_AddItemToArray(at, added_obj(8196, "<|sys|>x", 0, 0, 0, 0, 1));
    } else if (!strcmp(name, "splits")) {
        cJSON *dg = typed("Digits");
        cJSON_AddBoolToObject(dg, "individual_digits", 1);
        cJSON *p[] = {dg, split_obj("String", "_", "MergedWithNext", 0), split_obj("Regex", "\\s+", "MergedWithPrevious", 0),
                      split_obj("Regex", "[a-z]", "Contiguous", 1), bytelevel_obj(0, 1)};
        set_item(j, "pre_tokenizer", seq("Sequence", "pretokenizers", p, 5));
    } else if (!strcmp(name, "norms")) {
        cJSON *strip = typed("Strip"), *r1 = typed("Replace"), *r2 = typed("Replace"), *pre = typed("Prepend");
        cJSON_AddBoolToObject(strip, "strip_left", 1);
        cJSON_AddBoolToObject(strip, "strip_right", 1);
        cJSON *p1 = cJSON_CreateObject(), *p2 = cJSON_CreateObject();
        cJSON_AddStringToObject(p1, "String", "  ");
        cJSON_AddItemToObject(r1, "pattern", p1);
        cJSON_AddStringToObject(r1, "content", "\t");
        cJSON_AddStringToObject(p2, "Regex", "[0-9]+");
        cJSON_AddItemToObject(r2, "pattern", p2);
        cJSON_AddStringToObject(r2, "content", "#");
        cJSON_AddStringToObject(pre, "prepend", "^");
        cJSON *nm[] = {typed("NFD"), typed("StripAccents"), strip, r1, r2, pre};
        set_item(j, "normalizer", seq("Sequence", "normalizers", nm, 6));
        cJSON *dg = typed("Digits");
        cJSON_AddBoolToObject(dg, "individual_digits", 0);
        cJSON *p[] = {dg, split_obj("Regex", "\\s", "Removed", 0), bytelevel_obj(1, 1)};
        set_item(j, "pre_tokenizer", seq("Sequence", "pretokenizers", p, 3));
    } else if (!strcmp(name, "template")) {  // post-processor adding <|im_start|> ... <|im_end|>
        cJSON *tp = cJSON_Parse(
            "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<|im_start|>\", \"type_id\": 0}},"
            " {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": \"<|im_end|>\", \"type_id\": 0}}],"
            " \"pair\": [], \"special_tokens\": {\"<|im_start|>\": {\"id\": \"<|im_start|>\", \"ids\": [1], \"tokens\": [\"<|im_start|>\"]},"
            " \"<|im_end|>\": {\"id\": \"<|im_end|>\", \"ids\": [2], \"tokens\": [\"<|im_end|>\"]}}}");
        set_item(j, "post_processor", tp);
    }
    char *out = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    char path[256], label[64];
    snprintf(label, sizeof label, "variant_%s.json", name);
    tmp_path(path, sizeof path, label);
    write_bytes(path, out, strlen(out));
    free(out);
    tqkv_tokenizer *t = NULL;
    tqkv_status st = tqkv_tokenizer_load_file(&t, path);
    unlink(path);
    if (st) fail_msg("variant %s: %s", name, tqkv_last_error());
    return t;
}

static void test_variants_match_hf(void **state) {
    (void)state;
    const size_t nc = sizeof VARIANT_CASES / sizeof VARIANT_CASES[0];
    tqkv_tokenizer *t = NULL;
    const char *cur = "";
    for (size_t c = 0; c < nc; c++) {
        const variant_case *vc = &VARIANT_CASES[c];
        if (strcmp(cur, vc->variant)) {
            tqkv_tokenizer_free(t);
            t = load_variant(vc->variant);
            cur = vc->variant;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(tqkv_tokenizer_encode(t, vc->text, strlen(vc->text), 0, &ids, &n), TQKV_OK);
        for (int i = 0; i < vc->n || (size_t)i < n; i++) {
            int want = i < vc->n ? vc->ids[i] : -1, got = (size_t)i < n ? ids[i] : -1;
            if (want != got) fail_msg("variant %s case %zu: id %d is %d, want %d", vc->variant, c, i, got, want);
        }
        char *d = NULL;
        assert_int_equal(tqkv_tokenizer_decode(t, ids, n, 0, &d, NULL), TQKV_OK);
        if (strcmp(d, vc->decoded)) fail_msg("variant %s case %zu: decoded '%s', want '%s'", vc->variant, c, d, vc->decoded);
        free(d);
        assert_int_equal(tqkv_tokenizer_decode(t, ids, n, TQKV_DECODE_SKIP_SPECIAL, &d, NULL), TQKV_OK);
        if (strcmp(d, vc->decoded_skip))
            fail_msg("variant %s case %zu: decoded (skip special) '%s', want '%s'", vc->variant, c, d, vc->decoded_skip);
        free(d);
        free(ids);
    }
    tqkv_tokenizer_free(t);

    // added tokens: HF ids (content already in the vocab keeps the vocab id; new ones follow the vocab)
    t = load_variant("added");
    int32_t id;
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "fn", 2, &id), TQKV_OK);
    assert_int_equal(id, 1230);
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "Hello", 5, &id), TQKV_OK);
    assert_int_equal(id, 8193);
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "<|sys|>x", 8, &id), TQKV_OK);
    assert_int_equal(id, 8195);
    const char *piece;
    assert_int_equal(tqkv_tokenizer_id_to_token(t, 8193, &piece, NULL), TQKV_OK);
    assert_string_equal(piece, "hello");  // HF gives the normalized content
    assert_int_equal(tqkv_tokenizer_vocab_size(t), 8196);
    assert_true(tqkv_tokenizer_is_special(t, 8194));
    assert_false(tqkv_tokenizer_is_special(t, 8192));
    // special tokens as text: <|sys|> is not split out, <tool> (not special) still is
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tqkv_tokenizer_encode(t, "<|sys|><tool>", 13, TQKV_ENCODE_SPECIAL_AS_TEXT, &ids, &n), TQKV_OK);
    assert_true(n >= 3);
    assert_int_equal(ids[n - 1], 8192);
    for (size_t i = 0; i < n; i++) assert_int_not_equal(ids[i], 8194);
    free(ids);
    tqkv_tokenizer_free(t);

    // post-processor template, applied only with TQKV_ENCODE_ADD_SPECIAL
    t = load_variant("template");
    assert_int_equal(tqkv_tokenizer_encode(t, "hi", 2, TQKV_ENCODE_ADD_SPECIAL, &ids, &n), TQKV_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 2754);
    assert_int_equal(ids[2], 2);
    free(ids);
    assert_int_equal(tqkv_tokenizer_encode(t, "hi", 2, 0, &ids, &n), TQKV_OK);
    assert_int_equal(n, 1);
    free(ids);
    tqkv_tokenizer_free(t);
}

// ---------------------------------------------------------------------------
// Round trip on random text
// ---------------------------------------------------------------------------

/* Random valid UTF-8: code points from many scripts, whitespace runs, specials. */
static size_t random_text(test_rng *r, char *o, size_t cap) {
    static const uint32_t WS[] = {' ', '\t', '\n', '\r', 0x0B, 0x0C, 0xA0, 0x85, 0x2028, 0x3000, 0x200B, 0x1680};
    static const uint32_t RANGES[][2] = {
        {0x20, 0x7E},     {0xC0, 0x24F},    {0x370, 0x4FF},   {0x300, 0x36F},   {0x600, 0x6FF},
        {0x900, 0x97F},   {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0x1F300, 0x1FAFF}, {0x3040, 0x30FF},
        {0xFF00, 0xFFEF}, {0x0, 0x1F},      {0x2000, 0x206F}, {0xE000, 0xF8FF}};
    static const char *SPECIAL[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_", "'s", "'LL"};
    size_t n = 0;
    int parts = rng_int(r, 1, 40);
    for (int p = 0; p < parts && n + 64 < cap; p++) {
        int kind = rng_int(r, 0, 9);
        if (kind <= 1) {  // whitespace run
            int k = rng_int(r, 1, 6);
            uint32_t w = WS[rng_int(r, 0, (int)(sizeof WS / sizeof WS[0]) - 1)];
            for (int i = 0; i < k; i++) n += put_cp(o + n, rng_int(r, 0, 2) ? w : ' ');
        } else if (kind == 2) {
            const char *s = SPECIAL[rng_int(r, 0, 5)];
            memcpy(o + n, s, strlen(s));
            n += strlen(s);
        } else if (kind == 3) {  // any scalar value
            uint32_t c;
            do c = (uint32_t)rng_int(r, 0, 0x10FFFF);
            while (c >= 0xD800 && c < 0xE000);
            n += put_cp(o + n, c);
        } else {  // a word from one script (emoji with ZWJ / variation selectors now and then)
            int ri = rng_int(r, 0, (int)(sizeof RANGES / sizeof RANGES[0]) - 1), k = rng_int(r, 1, 8);
            for (int i = 0; i < k; i++) {
                n += put_cp(o + n, (uint32_t)rng_int(r, (int)RANGES[ri][0], (int)RANGES[ri][1]));
                if (ri == 8 && rng_int(r, 0, 3) == 0) n += put_cp(o + n, rng_int(r, 0, 1) ? 0x200D : 0xFE0F);
            }
        }
    }
    return n;
}

static void test_roundtrip_random(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 0x70c);
    tqkv_tokenizer *t = load_base();
    char a[4096], b[4096], ab[8300];
    for (int it = 0; it < 400; it++) {
        size_t na = random_text(&r, a, sizeof a);
        assert_true(utf8_ok(a, na));
        roundtrip_check(t, a, na);
        // added tokens split the text: ids(a <|endoftext|> b) == ids(a) 0 ids(b)
        size_t nb = random_text(&r, b, sizeof b);
        memcpy(ab, a, na);
        memcpy(ab + na, "<|endoftext|>", 13);
        memcpy(ab + na + 13, b, nb);
        int32_t *ia, *ib, *iab;
        size_t ka, kb, kab;
        assert_int_equal(tqkv_tokenizer_encode(t, a, na, 0, &ia, &ka), TQKV_OK);
        assert_int_equal(tqkv_tokenizer_encode(t, b, nb, 0, &ib, &kb), TQKV_OK);
        assert_int_equal(tqkv_tokenizer_encode(t, ab, na + 13 + nb, 0, &iab, &kab), TQKV_OK);
        assert_int_equal(kab, ka + 1 + kb);
        if (ka) assert_memory_equal(iab, ia, ka * sizeof(int32_t));
        assert_int_equal(iab[ka], 0);
        if (kb) assert_memory_equal(iab + ka + 1, ib, kb * sizeof(int32_t));
        free(ia);
        free(ib);
        free(iab);
    }
    roundtrip_check(t, "", 0);
    tqkv_tokenizer_free(t);
}

// ---------------------------------------------------------------------------
// Streaming decode
// ---------------------------------------------------------------------------

/* Push ids one by one; every chunk must be valid UTF-8 and the whole must equal
 * decode(ids). Returns how many pushes emitted nothing. */
static int stream_check(const tqkv_tokenizer *t, const int32_t *ids, size_t n, unsigned flags) {
    tqkv_decode_stream *s = NULL;
    assert_int_equal(tqkv_decode_stream_init(&s, t, flags), TQKV_OK);
    size_t cap = n * 64 + 16;
    char *all = malloc(cap);
    size_t len = 0;
    int empty = 0;
    for (int pass = 0; pass < 2; pass++) {  // a flushed stream starts over
        len = 0;
        empty = 0;
        for (size_t i = 0; i < n; i++) {
            const char *chunk;
            size_t cl;
            assert_int_equal(tqkv_decode_stream_push(s, ids[i], &chunk, &cl), TQKV_OK);
            if (!utf8_ok(chunk, cl)) {
                print_hex("chunk", chunk, cl);
                fail_msg("stream chunk %zu is not valid UTF-8", i);
            }
            assert_int_equal(chunk[cl], 0);  // NUL-terminated
            assert_true(len + cl <= cap);
            memcpy(all + len, chunk, cl);
            len += cl;
            empty += cl == 0;
            if (i == n / 2) {  // a bad id changes nothing
                assert_int_equal(tqkv_decode_stream_push(s, -5, &chunk, &cl), TQKV_ERANGE);
                assert_int_equal(tqkv_decode_stream_push(s, tqkv_tokenizer_vocab_size(t), &chunk, &cl), TQKV_ERANGE);
            }
        }
        const char *chunk;
        size_t cl;
        assert_int_equal(tqkv_decode_stream_flush(s, &chunk, &cl), TQKV_OK);
        assert_true(utf8_ok(chunk, cl));
        assert_true(len + cl <= cap);
        memcpy(all + len, chunk, cl);
        len += cl;
        char *d = NULL;
        size_t dl = 0;
        assert_int_equal(tqkv_tokenizer_decode(t, ids, n, flags, &d, &dl), TQKV_OK);
        if (dl != len || memcmp(d, all, len)) {
            print_hex("stream", all, len);
            print_hex("decode", d, dl);
            fail_msg("streamed text differs from decode(all)");
        }
        free(d);
    }
    free(all);
    tqkv_decode_stream_free(s);
    return empty;
}

static void test_stream_decode(void **state) {
    (void)state;
    tqkv_tokenizer *t = load_base();
    const char *text =
        "日本語のテキスト 👨‍👩‍👧‍👦 family 🇺🇸🇯🇵 café ✓ 한국어 😀😃😄 Ωμέγα ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 "
        "<|im_start|>user\n中文 emoji 🎉<|im_end|>\n";
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tqkv_tokenizer_encode(t, text, strlen(text), 0, &ids, &n), TQKV_OK);
    // the test is only meaningful if some tokens split characters
    int split = 0;
    for (size_t i = 0; i < n; i++) {
        const char *b;
        size_t bl;
        assert_int_equal(tqkv_tokenizer_id_bytes(t, ids[i], &b, &bl), TQKV_OK);
        split += !utf8_ok(b, bl);
    }
    assert_true(split > 10);
    int held = stream_check(t, ids, n, 0);
    assert_true(held > 0);  // something was held back
    stream_check(t, ids, n, TQKV_DECODE_SKIP_SPECIAL);
    free(ids);

    // random id sequences: invalid UTF-8 becomes U+FFFD exactly as decode() does it
    test_rng r;
    rng_init(&r, test_seed() ^ 0x57e);
    int32_t rid[600];
    for (int it = 0; it < 30; it++) {
        size_t k = (size_t)rng_int(&r, 1, 600);
        for (size_t i = 0; i < k; i++) rid[i] = rng_int(&r, 0, tqkv_tokenizer_vocab_size(t) - 1);
        stream_check(t, rid, k, it & 1 ? TQKV_DECODE_SKIP_SPECIAL : 0);
    }
    tqkv_tokenizer_free(t);
}

// ---------------------------------------------------------------------------
// Lookups and config
// ---------------------------------------------------------------------------

static void test_lookups_and_config(void **state) {
    (void)state;
    tqkv_tokenizer *t = load_base();
    assert_int_equal(tqkv_tokenizer_vocab_size(t), 8192);
    assert_int_equal(tqkv_tokenizer_eos_id(t), 0);
    assert_int_equal(tqkv_tokenizer_pad_id(t), 0);
    assert_int_equal(tqkv_tokenizer_bos_id(t), -1);
    int32_t id = -1;
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "<|im_start|>", 12, &id), TQKV_OK);
    assert_int_equal(id, 1);
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "\xc4\xa0world", 7, &id), TQKV_OK);  // "Ġworld"
    assert_int_equal(tqkv_tokenizer_token_to_id(t, "no such token", 13, &id), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "no such token"));
    const char *p;
    size_t pl;
    assert_int_equal(tqkv_tokenizer_id_to_token(t, 2, &p, &pl), TQKV_OK);
    assert_string_equal(p, "<|im_end|>");
    assert_int_equal(tqkv_tokenizer_id_to_token(t, 8192, &p, &pl), TQKV_ERANGE);
    assert_int_equal(tqkv_tokenizer_id_to_token(t, -1, &p, &pl), TQKV_ERANGE);
    assert_true(tqkv_tokenizer_is_special(t, 0) && tqkv_tokenizer_is_special(t, 2));
    assert_false(tqkv_tokenizer_is_special(t, 3) || tqkv_tokenizer_is_special(t, -1));

    // chat template: chat_template.jinja wins
    char path[1024];
    source_path("models/qwen3-code-28m/chat_template.jinja", path, sizeof path);
    char *jinja = read_bytes(path, NULL);
    assert_non_null(jinja);
    assert_non_null(tqkv_tokenizer_chat_template(t));
    assert_string_equal(tqkv_tokenizer_chat_template(t), jinja);
    free(jinja);

    // special tokens as text / skipped on decode
    int32_t *ids;
    size_t n;
    assert_int_equal(tqkv_tokenizer_encode(t, "a<|endoftext|>b", 15, 0, &ids, &n), TQKV_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[1], 0);
    char *d;
    assert_int_equal(tqkv_tokenizer_decode(t, ids, n, TQKV_DECODE_SKIP_SPECIAL, &d, NULL), TQKV_OK);
    assert_string_equal(d, "ab");
    free(d);
    free(ids);
    assert_int_equal(tqkv_tokenizer_encode(t, "a<|endoftext|>b", 15, TQKV_ENCODE_SPECIAL_AS_TEXT, &ids, &n), TQKV_OK);
    assert_true(n > 3);
    for (size_t i = 0; i < n; i++) assert_false(tqkv_tokenizer_is_special(t, ids[i]));
    assert_int_equal(tqkv_tokenizer_decode(t, ids, n, 0, &d, NULL), TQKV_OK);
    assert_string_equal(d, "a<|endoftext|>b");
    free(d);
    free(ids);

    // a tokenizer.json path loads too (no config: no eos, no template)
    tqkv_tokenizer *f = NULL;
    source_path("models/qwen3-code-28m/tokenizer.json", path, sizeof path);
    assert_int_equal(tqkv_tokenizer_load_file(&f, path), TQKV_OK);
    assert_int_equal(tqkv_tokenizer_eos_id(f), -1);
    assert_null(tqkv_tokenizer_chat_template(f));
    tqkv_tokenizer_free(f);
    tqkv_tokenizer_free(t);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/* Load `json` from a temp file: expect status `want` and `needle` in the message. */
static void expect_load_error(const char *json, tqkv_status want, const char *needle, int needle_is_path) {
    char path[256];
    tmp_path(path, sizeof path, "err.json");
    write_bytes(path, json, strlen(json));
    tqkv_tokenizer *t = (tqkv_tokenizer *)(uintptr_t)0x1234;
    tqkv_status st = tqkv_tokenizer_load_file(&t, path);
    unlink(path);
    if (st != want) fail_msg("load of %s: status %s, want %s (%s)", json, tqkv_status_name(st), tqkv_status_name(want), tqkv_last_error());
    assert_ptr_equal(t, (tqkv_tokenizer *)(uintptr_t)0x1234);  // untouched on failure
    if (!strstr(tqkv_last_error(), needle)) fail_msg("message '%s' lacks '%s'", tqkv_last_error(), needle);
    if (needle_is_path && !strstr(tqkv_last_error(), path)) fail_msg("message '%s' lacks the path", tqkv_last_error());
}

static void test_errors(void **state) {
    (void)state;
    // malformed JSON: ECORRUPT naming the file and where
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,}}}", TQKV_ECORRUPT, "line 1", 1);
    expect_load_error("{\n  \"model\": {\n    \"type\": \"BPE\",\n    \"vocab\": [1, 2,,]\n  }\n}", TQKV_ECORRUPT, "line 4", 1);
    expect_load_error("", TQKV_ECORRUPT, "malformed JSON", 1);
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}\n}", TQKV_ECORRUPT,
                      "line 2 column 1", 1);  // trailing data after the object
    // unsupported model / components: EUNSUPPORTED naming the type
    expect_load_error("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}, \"unk_token\": \"[UNK]\"}}",
                      TQKV_EUNSUPPORTED, "WordPiece", 1);
    expect_load_error("{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}", TQKV_EUNSUPPORTED, "Unigram", 0);
    expect_load_error("{\"normalizer\": {\"type\": \"BertNormalizer\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
                      TQKV_EUNSUPPORTED, "BertNormalizer", 0);
    expect_load_error("{\"pre_tokenizer\": {\"type\": \"Metaspace\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
                      TQKV_EUNSUPPORTED, "Metaspace", 0);
    expect_load_error("{\"decoder\": {\"type\": \"WordPiece\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
                      TQKV_EUNSUPPORTED, "decoder type 'WordPiece'", 0);
    expect_load_error("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a\"}, \"behavior\": \"Isolated\"},"
                      " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
                      TQKV_EUNSUPPORTED, "regex", 0);
    // structurally wrong
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}",
                      TQKV_ECORRUPT, "not in the vocab", 0);
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b c\"]}}",
                      TQKV_ECORRUPT, "merge #1", 0);
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}", TQKV_ECORRUPT, "bad id", 0);
    expect_load_error("[1, 2]", TQKV_ECORRUPT, "not a JSON object", 0);
    // one huge id would size the dense id tables: refused before allocating them
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 200000000}, \"merges\": []}}",
                      TQKV_ECORRUPT, "nearly dense", 0);
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"added_tokens\": [{\"content\": \"x\"}]}",
                      TQKV_ECORRUPT, "added_tokens", 0);
    // a minimal valid one loads, and merges as [a, b] pairs work
    {
        const char *ok = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [[\"a\", \"b\"]]}}";
        tqkv_tokenizer *t = NULL;
        assert_int_equal(tqkv_tokenizer_load_json(&t, ok, strlen(ok), "inline"), TQKV_OK);
        int32_t *ids;
        size_t n;
        assert_int_equal(tqkv_tokenizer_encode(t, "abab", 4, 0, &ids, &n), TQKV_OK);
        assert_int_equal(n, 2);  // no pre-tokenizer: one word "abab" -> "ab" "ab"
        assert_int_equal(ids[0], 2);
        assert_int_equal(ids[1], 2);
        free(ids);
        tqkv_tokenizer_free(t);
    }

    // missing files: EIO naming the path
    char path[256];
    tmp_path(path, sizeof path, "does-not-exist.json");
    tqkv_tokenizer *t = NULL;
    assert_int_equal(tqkv_tokenizer_load_file(&t, path), TQKV_EIO);
    assert_non_null(strstr(tqkv_last_error(), path));
    assert_null(t);
    tmp_path(path, sizeof path, "no-such-dir");
    assert_int_equal(tqkv_tokenizer_load(&t, path), TQKV_EIO);
    assert_non_null(strstr(tqkv_last_error(), path));
    // a directory without tokenizer.json; then one with a malformed tokenizer_config.json
    tmp_path(path, sizeof path, "model");
    mkdir(path, 0700);
    assert_int_equal(tqkv_tokenizer_load(&t, path), TQKV_EIO);
    assert_non_null(strstr(tqkv_last_error(), "tokenizer.json"));
    char file[512];
    snprintf(file, sizeof file, "%s/tokenizer.json", path);
    const char *ok = "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}";
    write_bytes(file, ok, strlen(ok));
    char cfg[512];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", path);
    write_bytes(cfg, "{\"eos_token\": ", strlen("{\"eos_token\": "));
    assert_int_equal(tqkv_tokenizer_load(&t, path), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "tokenizer_config.json"));
    const char *cfg_ok = "{\"eos_token\": {\"content\": \"a\"}, \"chat_template\": \"T\"}";
    write_bytes(cfg, cfg_ok, strlen(cfg_ok));
    assert_int_equal(tqkv_tokenizer_load(&t, path), TQKV_OK);
    assert_int_equal(tqkv_tokenizer_eos_id(t), 0);
    assert_string_equal(tqkv_tokenizer_chat_template(t), "T");
    unlink(cfg);
    unlink(file);
    rmdir(path);

    // bad input to encode / decode: status + message, outputs untouched
    int32_t *ids = (int32_t *)(uintptr_t)0x99;
    size_t n = 77;
    assert_int_equal(tqkv_tokenizer_encode(t, "ab\xff" "c", 4, 0, &ids, &n), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "byte 2"));
    assert_int_equal(tqkv_tokenizer_encode(t, "a\xed\xa0\x80", 4, 0, &ids, &n), TQKV_EINVAL);  // surrogate
    assert_int_equal(tqkv_tokenizer_encode(t, "\xc0\xaf", 2, 0, &ids, &n), TQKV_EINVAL);        // overlong
    assert_int_equal(tqkv_tokenizer_encode(t, "a", 1, 0x80, &ids, &n), TQKV_EINVAL);
    assert_ptr_equal(ids, (int32_t *)(uintptr_t)0x99);
    assert_int_equal(n, 77);
    int32_t bad[] = {0, 5};
    char *d = (char *)(uintptr_t)0x98;
    assert_int_equal(tqkv_tokenizer_decode(t, bad, 2, 0, &d, NULL), TQKV_ERANGE);
    assert_non_null(strstr(tqkv_last_error(), "position 1"));
    assert_ptr_equal(d, (char *)(uintptr_t)0x98);
    tqkv_tokenizer_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heldout_golden),
        cmocka_unit_test(test_golden_cases),
        cmocka_unit_test(test_variants_match_hf),
        cmocka_unit_test(test_roundtrip_random),
        cmocka_unit_test(test_stream_decode),
        cmocka_unit_test(test_lookups_and_config),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_layout.c - the source tree keeps its rooms (docs/ARCHITECTURE.md):
 *   - outside src/model/arch/ no code names a specific architecture (identifiers such as
 *     TQKV_ARCH_*, gemma4_*, g4_*, qwen35_*, q35_*, or a struct member g4): the runtime asks
 *     the architecture's ops instead (the device runtime its cuda hooks). Comments and
 *     strings may name them;
 *   - includes flow one way: cli -> server -> engine -> model -> attn -> cache -> codec ->
 *     util (chat -> tokenizer -> util beside them); a file never includes a header of a
 *     module above its own.
 * Owns: reading the tree under TQKV_SOURCE_DIR/src. Must not: depend on a build or ../shared.
 */
#include <ctype.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* Module order, lowest first: a file may include headers of its own module or lower ones. */
static const char *const LEVELS[][3] = {
    {"util", NULL, NULL}, {"codec", NULL, NULL}, {"cache", NULL, NULL}, {"attn", NULL, NULL},
    {"model", "tokenizer", "chat"}, {"engine", NULL, NULL}, {"server", NULL, NULL},
    {"cli", NULL, NULL},
};
#define N_LEVELS (int)(sizeof LEVELS / sizeof LEVELS[0])

static int g_arch_fail, g_include_fail, g_files, g_quiet;

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    fclose(f);
    if (b) b[n] = 0;
    *len = (size_t)n;
    return b;
}

/* Blank out comments and string / char literals (newlines kept), so only code is scanned. */
static void strip(char *s) {
    for (char *p = s; *p; p++) {
        if (p[0] == '/' && p[1] == '/') {
            while (*p && *p != '\n') *p++ = ' ';
            if (!*p) return;
        } else if (p[0] == '/' && p[1] == '*') {
            for (; *p && !(p[0] == '*' && p[1] == '/'); p++)
                if (*p != '\n') *p = ' ';
            if (!*p) return;
            p[0] = p[1] = ' ';
            p++;
        } else if (*p == '"' || *p == '\'') {
            const char q = *p++;
            for (; *p && *p != q && *p != '\n'; p++) {
                if (*p == '\\' && p[1]) *p++ = ' ';
                *p = ' ';
            }
            if (!*p) return;
        }
    }
}

static int names_arch(const char *id) {
    static const char *const prefixes[] = {"TQKV_ARCH_", "gemma4", "g4_", "qwen35", "q35_",
                                           "GEMMA4", "QWEN35", "G4_", "Q35_"};
    if (!strcmp(id, "g4")) return 1;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
        if (!strncmp(id, prefixes[i], strlen(prefixes[i]))) return 1;
    return 0;
}

static int level_of(const char *module) {
    for (int i = 0; i < N_LEVELS; i++)
        for (int k = 0; k < 3 && LEVELS[i][k]; k++)
            if (!strcmp(module, LEVELS[i][k])) return i;
    return -1;
}

/* "src/<module>/..." -> module's level; -1 if not under a known module */
static int level_of_path(const char *rel) {
    char mod[64];
    if (sscanf(rel, "src/%63[^/]/", mod) != 1) return -1;
    return level_of(mod);
}

static void scan_arch(const char *rel, const char *code) {
    if (!strncmp(rel, "src/model/arch/", 15)) return;
    int line = 1;
    for (const char *p = code; *p;) {
        if (*p == '\n') line++;
        if (isalpha((unsigned char)*p) || *p == '_') {
            const char *b = p;
            while (isalnum((unsigned char)*p) || *p == '_') p++;
            char id[128];
            const size_t n = (size_t)(p - b) < sizeof id - 1 ? (size_t)(p - b) : sizeof id - 1;
            memcpy(id, b, n);
            id[n] = 0;
            if (names_arch(id)) {
                if (!g_quiet) print_error("%s:%d names an architecture in code: %s\n", rel, line, id);
                g_arch_fail++;
            }
            continue;
        }
        p++;
    }
}

static void scan_includes(const char *rel, const char *text) {
    const int own = level_of_path(rel);
    if (own < 0) return;
    int line = 1;
    for (const char *p = text; *p; p++) {
        if (*p == '\n') line++;
        if (strncmp(p, "#include \"", 10) || (p != text && p[-1] != '\n')) continue;
        char mod[64];
        if (sscanf(p + 10, "%63[^/\"]/", mod) != 1) continue;
        const int lv = level_of(mod);
        if (lv > own) {
            print_error("%s:%d includes a header of a higher module (%s)\n", rel, line, mod);
            g_include_fail++;
        }
    }
}

static int visit(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)ftw;
    if (flag != FTW_F) return 0;
    const char *ext = strrchr(path, '.');
    if (!ext || (strcmp(ext, ".c") && strcmp(ext, ".h") && strcmp(ext, ".cu") &&
                 strcmp(ext, ".cuh")))
        return 0;
    const char *rel = path + strlen(TQKV_SOURCE_DIR) + 1;
    size_t len;
    char *text = slurp(path, &len);
    if (!text) return 0;
    g_files++;
    scan_includes(rel, text);
    strip(text);
    scan_arch(rel, text);
    free(text);
    return 0;
}

static void walk(void) {
    static int done;
    if (done) return;
    done = 1;
    char root[1024];
    snprintf(root, sizeof root, "%s/src", TQKV_SOURCE_DIR);
    assert_int_equal(nftw(root, visit, 16, FTW_PHYS), 0);
    assert_true(g_files > 50);
}

static void test_arch_names(void **state) {
    (void)state;
    walk();
    print_message("%d source files scanned\n", g_files);
    assert_int_equal(g_arch_fail, 0);
}

static void test_include_direction(void **state) {
    (void)state;
    walk();
    assert_int_equal(g_include_fail, 0);
}

/* The scanner itself: a name in code is found, in a comment or string it is not. */
static void test_scanner(void **state) {
    (void)state;
    char code[] = "/* gemma4_load */ int x = g4_y; const char *s = \"qwen35_forward\";\n"
                  "// TQKV_ARCH_QWEN3\n m->g4->cfg;";
    strip(code);
    assert_null(strstr(code, "gemma4_load"));
    assert_null(strstr(code, "qwen35_forward"));
    assert_null(strstr(code, "TQKV_ARCH_QWEN3"));
    assert_non_null(strstr(code, "g4_y"));
    const int before = g_arch_fail;
    g_quiet = 1; /* the synthetic hits are expected: no message */
    scan_arch("src/engine/fake.c", code);
    g_quiet = 0;
    assert_int_equal(g_arch_fail - before, 2); /* g4_y and the member g4 */
    g_arch_fail = before;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scanner),
        cmocka_unit_test(test_arch_names),
        cmocka_unit_test(test_include_direction),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

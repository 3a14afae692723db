/*
 * test_chat_template.c - chat templates (include/tqkv_chat.h): the real templates of
 * Qwen3, Qwen 3.5, Llama 3.x, Gemma 3 and Gemma 4 rendered over the conversations of
 * tests/golden/chat/goldens.json must equal transformers' apply_chat_template byte for
 * byte (or fail with the same raise_exception message); the fixtures' ChatML template
 * against a hand-built rendering of random conversations; Jinja semantics the templates
 * rely on; and the init / render errors.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "testutil.h"
#include "tqkv_chat.h"

/* ------------------------------------------------------------------------- */
/* Helpers                                                                    */
/* ------------------------------------------------------------------------- */

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

/* Renders src over msgs; returns the malloc'd text or NULL (status in *st). */
static char *render_src(const char *src, const tqkv_chat_message *msgs, int n, int agp, const char *bos,
                        const char *eos, tqkv_status *st) {
    tqkv_chat_template *t = NULL;
    *st = tqkv_chat_template_init(&t, src);
    if (*st != TQKV_OK) return NULL;
    char *out = NULL;
    size_t len = 0;
    *st = tqkv_chat_template_render(t, msgs, n, agp, bos, eos, &out, &len);
    tqkv_chat_template_free(t);
    if (*st == TQKV_OK) assert_int_equal(len, strlen(out));
    return out;
}

/* Renders a template with no messages; asserts success and returns the text. */
static void expect_render(const char *src, const char *expected) {
    tqkv_status st;
    tqkv_chat_message m = {"user", "hi"};
    char *out = render_src(src, &m, 1, 0, "<s>", "</s>", &st);
    if (st != TQKV_OK) fail_msg("template %s failed: %s", src, tqkv_last_error());
    if (strcmp(out, expected) != 0) fail_msg("template %s\n  got      [%s]\n  expected [%s]", src, out, expected);
    free(out);
}

static void expect_fail(const char *src, tqkv_status want, const char *msg_part) {
    tqkv_status st;
    tqkv_chat_message m = {"user", "hi"};
    char *out = render_src(src, &m, 1, 0, "<s>", "</s>", &st);
    if (st != want)
        fail_msg("template %s: status %s (%s), expected %s", src, tqkv_status_name(st), out ? out : tqkv_last_error(),
                 tqkv_status_name(want));
    if (msg_part && !strstr(tqkv_last_error(), msg_part))
        fail_msg("template %s: message [%s] lacks [%s]", src, tqkv_last_error(), msg_part);
    free(out);
}

/* ------------------------------------------------------------------------- */
/* Goldens from transformers                                                  */
/* ------------------------------------------------------------------------- */

/* Checks one rendering against a case's expected text or error; prints a mismatch. */
static int check_case(const cJSON *c, const char *how, tqkv_status st, const char *out) {
    const char *tname = cJSON_GetObjectItem(c, "template")->valuestring;
    const char *cname = cJSON_GetObjectItem(c, "conversation")->valuestring;
    int agp = cJSON_IsTrue(cJSON_GetObjectItem(c, "add_generation_prompt"));
    const cJSON *exp = cJSON_GetObjectItem(c, "expected");
    const cJSON *err = cJSON_GetObjectItem(c, "error");
    const cJSON *kind = cJSON_GetObjectItem(c, "error_kind");
    if (exp) {
        if (st == TQKV_OK && strcmp(out, exp->valuestring) == 0) return 1;
        size_t d = 0;
        if (st == TQKV_OK)
            while (out[d] && out[d] == exp->valuestring[d]) d++;
        printf("MISMATCH %s %s/%s agp=%d: %s; first difference at byte %zu\n  got: [%.120s]\n  exp: [%.120s]\n", how,
               tname, cname, agp, st == TQKV_OK ? "text differs" : tqkv_last_error(), d, st == TQKV_OK ? out + d : "",
               exp->valuestring + d);
        return 0;
    }
    /* raise_exception(): the same message; a Python-level failure (TypeError, ...): any EINVAL */
    int exact = !kind || strcmp(kind->valuestring, "TemplateError") == 0;
    if (st == TQKV_EINVAL && (!exact || strcmp(tqkv_last_error(), err->valuestring) == 0)) return 1;
    printf("MISMATCH %s %s/%s agp=%d: expected error [%s], got %s [%s]\n", how, tname, cname, agp, err->valuestring,
           tqkv_status_name(st), st == TQKV_OK ? out : tqkv_last_error());
    return 0;
}

/* Renders every case of a goldens file through render_json (and through render when the
 * case has only string role/content and no extra variables); returns the mismatches. */
static int run_goldens(const char *gpath, int *n_cases_out, int *n_err_out, int *n_templates_out) {
    char path[4096], tpath[4096];
    char *text = read_file(gpath, NULL);
    if (!text) fail_msg("cannot read %s", gpath);
    cJSON *doc = cJSON_Parse(text);
    assert_non_null(doc);
    const cJSON *gen = cJSON_GetObjectItem(doc, "generator");
    printf("%s: %s\n", gpath, cJSON_IsString(gen) ? gen->valuestring : "?");
    const cJSON *cases = cJSON_GetObjectItem(doc, "cases");
    assert_true(cJSON_IsArray(cases));
    int n_cases = 0, n_bad = 0, n_err = 0, n_templates = 0;
    char templates_seen[32][64];
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *tname = cJSON_GetObjectItem(c, "template")->valuestring;
        int agp = cJSON_IsTrue(cJSON_GetObjectItem(c, "add_generation_prompt"));
        const char *bos = cJSON_GetObjectItem(c, "bos_token")->valuestring;
        const char *eos = cJSON_GetObjectItem(c, "eos_token")->valuestring;
        const cJSON *msgs = cJSON_GetObjectItem(c, "messages");
        const cJSON *extra = cJSON_GetObjectItem(c, "extra");
        snprintf(tpath, sizeof tpath, "tests/golden/chat/%s.jinja", tname);
        char *src = read_file(source_path(tpath, path, sizeof path), NULL);
        if (!src) fail_msg("cannot read template %s", tpath);
        int seen = 0;
        for (int k = 0; k < n_templates; k++) seen |= strcmp(templates_seen[k], tname) == 0;
        if (!seen && n_templates < 32) snprintf(templates_seen[n_templates++], 64, "%s", tname);
        tqkv_chat_template *t = NULL;
        if (tqkv_chat_template_init(&t, src) != TQKV_OK) fail_msg("init %s: %s", tname, tqkv_last_error());
        /* the JSON path: messages (and extra variables) as JSON text */
        char *mj = cJSON_PrintUnformatted(msgs), *xj = extra ? cJSON_PrintUnformatted(extra) : NULL;
        char *out = NULL;
        tqkv_status st = tqkv_chat_template_render_json(t, mj, agp, bos, eos, xj, &out, NULL);
        n_bad += !check_case(c, "render_json", st, out);
        free(out);
        /* the struct path, where it can express the case */
        int n = cJSON_GetArraySize(msgs), plain = !extra;
        tqkv_chat_message *m = calloc((size_t)n + 1, sizeof *m);
        for (int i = 0; i < n; i++) {
            const cJSON *mi = cJSON_GetArrayItem(msgs, i);
            const cJSON *role = cJSON_GetObjectItem(mi, "role"), *content = cJSON_GetObjectItem(mi, "content");
            plain &= cJSON_GetArraySize(mi) == 2 && cJSON_IsString(role) && cJSON_IsString(content);
            m[i].role = cJSON_IsString(role) ? role->valuestring : "";
            m[i].content = cJSON_IsString(content) ? content->valuestring : "";
        }
        if (plain) {
            out = NULL;
            st = tqkv_chat_template_render(t, m, n, agp, bos, eos, &out, NULL);
            n_bad += !check_case(c, "render", st, out);
            free(out);
        }
        n_err += cJSON_GetObjectItem(c, "error") != NULL;
        n_cases++;
        free(m);
        free(mj);
        free(xj);
        tqkv_chat_template_free(t);
        free(src);
    }
    printf("  %d cases (%d expected errors) over %d templates, %d mismatches\n", n_cases, n_err, n_templates, n_bad);
    cJSON_Delete(doc);
    free(text);
    *n_cases_out = n_cases;
    *n_err_out = n_err;
    *n_templates_out = n_templates;
    return n_bad;
}

static void test_goldens(void **state) {
    (void)state;
    char path[4096];
    const char *gpath = getenv("TQKV_CHAT_GOLDENS");
    if (!gpath) gpath = source_path("tests/golden/chat/goldens.json", path, sizeof path);
    int n_cases, n_err, n_templates;
    int bad = run_goldens(gpath, &n_cases, &n_err, &n_templates);
    assert_true(n_cases >= 100);
    assert_true(n_templates >= 5);
    assert_true(n_err >= 2);
    assert_int_equal(bad, 0);
}

/* tools, tool calls, reasoning_content, enable_thinking, content parts, extra variables */
static void test_goldens_extended(void **state) {
    (void)state;
    char path[4096];
    const char *gpath = source_path("tests/golden/chat/goldens_extended.json", path, sizeof path);
    int n_cases, n_err, n_templates;
    int bad = run_goldens(gpath, &n_cases, &n_err, &n_templates);
    assert_true(n_cases >= 50);
    assert_int_equal(bad, 0);
}

/* ------------------------------------------------------------------------- */
/* The fixtures' ChatML template over random conversations                   */
/* ------------------------------------------------------------------------- */

static void random_text(test_rng *r, char *buf, int cap) {
    static const char *const pieces[] = {"a", "Z", " ", "\n", "\t", "{{", "}}", "{%", "%}", "{#", "'", "\"", "\\",
                                         "é", "世", "🙂", "<|im_end|>", "-", "0", "  "};
    int n = rng_int(r, 0, 40), k = 0;
    for (int i = 0; i < n; i++) {
        const char *p = pieces[rng_int(r, 0, (int)(sizeof pieces / sizeof pieces[0]) - 1)];
        int l = (int)strlen(p);
        if (k + l >= cap) break;
        memcpy(buf + k, p, (size_t)l);
        k += l;
    }
    buf[k] = 0;
}

static void check_chatml(const char *src, test_rng *r) {
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    for (int trial = 0; trial < 200; trial++) {
        int n = rng_int(r, 0, 6), agp = rng_int(r, 0, 1);
        tqkv_chat_message m[6];
        char content[6][256];
        char expected[8192];
        int k = 0;
        expected[0] = '\0';
        for (int i = 0; i < n; i++) {
            random_text(r, content[i], sizeof content[i]);
            m[i].role = roles[rng_int(r, 0, 3)];
            m[i].content = content[i];
            k += snprintf(expected + k, sizeof expected - (size_t)k, "<|im_start|>%s\n%s<|im_end|>\n", m[i].role,
                          m[i].content);
        }
        if (agp) k += snprintf(expected + k, sizeof expected - (size_t)k, "<|im_start|>assistant\n");
        tqkv_status st;
        char *out = render_src(src, m, n, agp, NULL, NULL, &st);
        if (st != TQKV_OK) fail_msg("chatml render failed: %s", tqkv_last_error());
        if (strcmp(out, expected) != 0)
            fail_msg("chatml trial %d (%d messages, agp %d): got %zu bytes [%s], expected %zu bytes [%s]", trial, n, agp,
                     strlen(out), out, strlen(expected), expected);
        free(out);
    }
}

static void test_fixture_chatml(void **state) {
    (void)state;
    char path[4096];
    test_rng r;
    rng_init(&r, test_seed());
    char *src = read_file(source_path("tests/golden/chat/chatml_fixture.jinja", path, sizeof path), NULL);
    assert_non_null(src);
    check_chatml(src, &r);
    free(src);
    /* the fixture models' own file, when ../shared is present */
    const char *sp = shared_path("models/qwen3-code-28m/chat_template.jinja", path, sizeof path);
    char *shared = sp ? read_file(sp, NULL) : NULL;
    if (!shared) {
        printf("../shared absent: fixture model template not checked\n");
        return;
    }
    check_chatml(shared, &r);
    free(shared);
}

/* One template object rendered many times must give the same text each time. */
static void test_reuse(void **state) {
    (void)state;
    char path[4096];
    char *src = read_file(source_path("tests/golden/chat/qwen3.jinja", path, sizeof path), NULL);
    assert_non_null(src);
    tqkv_chat_template *t = NULL;
    assert_int_equal(tqkv_chat_template_init(&t, src), TQKV_OK);
    tqkv_chat_message m[3] = {{"user", "x"}, {"assistant", "<think>\nr\n</think>\n\ny"}, {"user", "z"}};
    char *first = NULL;
    for (int i = 0; i < 50; i++) {
        char *out = NULL;
        assert_int_equal(tqkv_chat_template_render(t, m, 3, i & 1, NULL, NULL, &out, NULL), TQKV_OK);
        if (i == 0) first = out;
        else if (i % 2 == 0) {
            assert_string_equal(out, first);
            free(out);
        } else free(out);
    }
    assert_string_equal(first, "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n"
                               "<|im_start|>user\nz<|im_end|>\n");
    free(first);
    tqkv_chat_template_free(t);
    free(src);
}

/* Renders of one template on several threads at once give the single-thread text. */
typedef struct {
    const tqkv_chat_template *t;
    const char               *expected;
    int                       bad;
} thread_job;

static void *render_thread(void *arg) {
    thread_job *j = arg;
    tqkv_chat_message m[4] = {{"system", "s"}, {"user", "a"}, {"assistant", "<think>\nr\n</think>\n\nb"}, {"user", "c"}};
    for (int i = 0; i < 100; i++) {
        char *out = NULL;
        if (tqkv_chat_template_render_json(j->t, "[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":\"a\"},"
                                           "{\"role\":\"assistant\",\"content\":\"<think>\\nr\\n</think>\\n\\nb\"},"
                                           "{\"role\":\"user\",\"content\":\"c\"}]",
                                           1, "<s>", "</s>", NULL, &out, NULL) != TQKV_OK ||
            strcmp(out, j->expected) != 0)
            j->bad++;
        free(out);
        out = NULL;
        if (tqkv_chat_template_render(j->t, m, 4, 1, "<s>", "</s>", &out, NULL) != TQKV_OK || strcmp(out, j->expected) != 0)
            j->bad++;
        free(out);
    }
    return NULL;
}

static void test_concurrent(void **state) {
    (void)state;
    char path[4096];
    char *src = read_file(source_path("tests/golden/chat/qwen3.5.jinja", path, sizeof path), NULL);
    assert_non_null(src);
    tqkv_chat_template *t = NULL;
    assert_int_equal(tqkv_chat_template_init(&t, src), TQKV_OK);
    tqkv_chat_message m[4] = {{"system", "s"}, {"user", "a"}, {"assistant", "<think>\nr\n</think>\n\nb"}, {"user", "c"}};
    char *expected = NULL;
    assert_int_equal(tqkv_chat_template_render(t, m, 4, 1, "<s>", "</s>", &expected, NULL), TQKV_OK);
    assert_string_equal(expected, "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                                  "<|im_start|>assistant\n<think>\nr\n</think>\n\nb<|im_end|>\n"
                                  "<|im_start|>user\nc<|im_end|>\n"
                                  "<|im_start|>assistant\n<think>\n");
    thread_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (thread_job){t, expected, 0};
        assert_int_equal(pthread_create(&th[i], NULL, render_thread, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].bad, 0);
    }
    free(expected);
    tqkv_chat_template_free(t);
    free(src);
}

/* ------------------------------------------------------------------------- */
/* Semantics (expected values are what jinja2 3.1 renders, with transformers'  */
/* trim_blocks / lstrip_blocks settings)                                      */
/* ------------------------------------------------------------------------- */

static void test_semantics(void **state) {
    (void)state;
    /* whitespace control */
    expect_render("a  {%- if true %} b {% endif -%}  c", "a b c");
    expect_render("x\n    {% if true %}\n  y\n    {% endif %}\nz", "x\n  y\nz");
    expect_render("{% if true %}+{% endif %}\n{{ 1 }}\n", "+1");
    expect_render("a\n  {%+ if true %}b{% endif +%}\nc", "a\n  b\nc");
    expect_render("{# comment #}\nx {#- c -#} y", "xy");
    /* literals and operators */
    expect_render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}",
                  "7 3 -4 2 3.5 1024");
    expect_render("{{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 10 / 5 }} {{ true + 1 }}", "1.0 1e+20 0.30000000000000004 2.0 2");
    expect_render("{{ [1, 'a', none, true] }} {{ {'a': 1} }} {{ none }}", "[1, 'a', None, True] {'a': 1} None");
    expect_render("{{ 'a' ~ 1 ~ none }} {{ 'ab' * 2 }} {{ 'x' 'y' }}", "a1None abab xy");
    expect_render("{{ 1 < 2 < 3 }} {{ 'a' in 'cat' }} {{ 2 not in [1, 3] }} {{ 'k' in {'k': 1} }}", "True True True True");
    expect_render("{{ 'yes' if 0 else 'no' }} {{ 0 or 'b' }} {{ 'a' and 'b' }} {{ not none }}", "no b b True");
    /* subscripts and slices (code points) */
    expect_render("{{ 'abc'[::-1] }} {{ [1, 2, 3][1:] }} {{ 'héllo'[1] }} {{ 'héllo'[-2:] }} {{ [1,2,3,4,5][::2] }}",
                  "cba [2, 3] é lo [1, 3, 5]");
    expect_render("{{ 'héllo'|length }} {{ messages|length }} {{ messages[0].role }} {{ messages[0]['content'] }}",
                  "5 1 user hi");
    /* string methods */
    expect_render("{{ '  x  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\na'.lstrip('\\n') }}|{{ 'a\\n'.rstrip() }}",
                  "x|a|a|a");
    expect_render("{{ 'a b  c'.split() }} {{ 'a,b'.split(',') }} {{ 'a<t>b<t>c'.split('<t>')[-1] }}",
                  "['a', 'b', 'c'] ['a', 'b'] c");
    expect_render("{{ 'Hello'.startswith('He') }} {{ 'Hello'.endswith(('x', 'lo')) }} {{ 'aXa'.replace('a', 'b') }}",
                  "True True bXb");
    expect_render("{{ 'abc'.upper() }} {{ 'ÉCOLE'.lower() }} {{ 'hello world'|title }} {{ 'hELLo'|capitalize }}",
                  "ABC école Hello World Hello");
    /* filters */
    expect_render("{{ '  x '|trim }}|{{ ' \\u00a0y\\u3000'|trim }}|{{ '  x '|trim('x ') }}|{{ u|trim }}", "x|y||");
    expect_render("{{ [1,'a']|join('-') }} {{ [1,2]|first }} {{ [1,2]|last }} {{ 5|string + 'a' }}", "1-a 1 2 5a");
    expect_render("{{ u|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ u|length }}", "d  d 0");
    expect_render("{{ {'b': 1, 'A': 2}|dictsort }} {{ 'xy'|list }} {{ ['a', 'b']|map('upper')|list }}",
                  "[('A', 2), ('b', 1)] ['x', 'y'] ['A', 'B']");
    expect_render("{{ [1, none, 2]|select|list }} {{ ['a', 'code_interpreter']|reject('equalto', 'code_interpreter')|join(', ') }}",
                  "[1, 2] a");
    expect_render("{{ {'a': [1, 2], 'b': 'é\"'}|tojson }} {{ [1]|tojson(indent=2) }} {{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
                  "{\"a\": [1, 2], \"b\": \"é\\\"\"} [\n  1\n] {\"a\": 2, \"b\": 1}");
    expect_render("{% for k, v in {'x': 1, 'y': 2}|items %}{{ k }}={{ v }};{% endfor %}", "x=1;y=2;");
    /* tests */
    expect_render("{{ u is defined }} {{ u is undefined }} {{ none is none }} {{ 'a' is string }} {{ {} is mapping }}",
                  "False True True True True");
    expect_render("{{ false is false }} {{ 0 is false }} {{ true is boolean }} {{ 3 is divisibleby 3 }} {{ [] is iterable }}",
                  "True False True True True");
    expect_render("{{ 1 is not none }} {{ 'x' is not string }} {{ 4 is even }} {{ 2 is eq 2 }}", "True False True True");
    /* loops */
    expect_render("{% for x in [1,2,3] %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
                  "01TrueFalse3|12FalseFalse3|23FalseTrue3|");
    expect_render("{% for x in [1,2,3] %}{{ loop.previtem }}-{{ loop.nextitem }},{% endfor %}", "-2,1-3,2-,");
    expect_render("{% for x in [] %}a{% else %}empty{% endfor %}", "empty");
    expect_render("{% for x in range(10) if x is odd %}{{ x }}{% if loop.last %}({{ loop.length }}){% endif %}{% endfor %}",
                  "13579(5)");
    expect_render("{% for x in range(9) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
                  "0134");
    /* scoping: set in a loop does not leak and does not persist across iterations */
    expect_render("{% for x in [1,2] %}{% if loop.first %}{% set y = 1 %}{% endif %}[{{ y }}]{% endfor %}{{ y }}", "[1][]");
    expect_render("{% set ns = namespace(n=0) %}{% for x in [1,2,3] %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", "6");
    expect_render("{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}", "2");
    expect_render("{% macro f(a, b='B', c=none) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ f(1) }} {{ f(1, c=3) }} {{ f(1, 2, 3)|trim }}",
                  "1BNone 1B3 123");
    expect_render("{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}", "321");
    expect_render("{% set b %}in {{ 1 + 1 }}{% endset %}[{{ b }}]", "[in 2]");
    expect_render("{% set messages = messages[1:] %}{{ messages|length }} {{ bos_token }}{{ eos_token }}", "0 <s></s>");
    expect_render("{{ add_generation_prompt }} {{ tools is none }} {{ enable_thinking is defined }}", "False True False");
    expect_render("{% generation %}g{% endgeneration %}", "g");
    /* found by tools/chat_differential.py against jinja2 */
    expect_render("{{ [u, 'a\u00a0b\u200d', '\u3000'] }} {{ (1, 2)[1:] }} {{ (1,) }}", "[Undefined, 'a\\xa0b\\u200d', '\\u3000'] (2,) (1,)");
    expect_render("{{ '</think>x'|title }} {{ '</think>x'.title() }} {{ 'a-b(c d'|title }}", "</think>x </Think>X A-B(C D");
    expect_render("{{ none|select|list }} {{ 0|map('upper')|list }} {{ false|selectattr('x')|list }}", "[] [] []");
    expect_render("{{ 1e3 is divisibleby 3 }} {{ 2.0 is even }} {{ [1, 2] < [1, 3] }} {{ [1] < [1, 0] }}", "False True True True");
    expect_render("{{ [1, 'a'] * 2 }} {{ true * [0] }} {{ (not 'x')|safe|list }} {{ {'a': 1} is lower }}",
                  "[1, 'a', 1, 'a'] [0] ['F', 'a', 'l', 's', 'e'] True");
}

/* ------------------------------------------------------------------------- */
/* Errors                                                                     */
/* ------------------------------------------------------------------------- */

static void test_errors(void **state) {
    (void)state;
    /* unsupported constructs fail at init with line:column */
    expect_fail("a\n  {% include 'x.jinja' %}", TQKV_EUNSUPPORTED, "2:6");
    expect_fail("{% raw %}x{% endraw %}", TQKV_EUNSUPPORTED, "statement 'raw'");
    expect_fail("{{ x|wordwrap }}", TQKV_EUNSUPPORTED, "filter 'wordwrap'");
    expect_fail("{{ x is sameas_not }}", TQKV_EUNSUPPORTED, "test 'sameas_not'");
    expect_fail("{{ 'a'.zfill(3) }}", TQKV_EUNSUPPORTED, "method 'zfill'");
    expect_fail("{{ lipsum() }}", TQKV_EUNSUPPORTED, "function 'lipsum'");
    expect_fail("{% for x in y recursive %}{% endfor %}", TQKV_EUNSUPPORTED, "recursive");
    expect_fail("{{ f(*args) }}{% macro f() %}{% endmacro %}", TQKV_EUNSUPPORTED, "*args");
    /* bad syntax fails at init with line:column */
    expect_fail("{% if x %}never closed", TQKV_EINVAL, "1:1");
    expect_fail("line1\n{{ 1 + }}", TQKV_EINVAL, "2:");
    expect_fail("{{ 'unterminated }}", TQKV_EINVAL, "unterminated string");
    expect_fail("{{ x", TQKV_EINVAL, "unclosed");
    expect_fail("{% endif %}", TQKV_EINVAL, "endif");
    expect_fail("{% frobnicate %}", TQKV_EINVAL, "frobnicate");
    char deep[1024];
    int k = snprintf(deep, sizeof deep, "{{ ");
    for (int i = 0; i < 300; i++) deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 300; i++) deep[k++] = ')';
    snprintf(deep + k, sizeof deep - (size_t)k, " }}");
    expect_fail(deep, TQKV_EUNSUPPORTED, "nesting");
    /* raise_exception fails render with the template's own message */
    expect_fail("{{ raise_exception('Conversation roles must alternate') }}", TQKV_EINVAL, NULL);
    assert_string_equal(tqkv_last_error(), "Conversation roles must alternate");
    /* an empty one still gives a message (the chat-template fuzzer found it empty) */
    expect_fail("{{ raise_exception() }}", TQKV_EINVAL, "raise_exception() without a message");
    expect_fail("{{ raise_exception('') }}", TQKV_EINVAL, "raise_exception() without a message");
    /* runtime errors */
    expect_fail("{{ u.x }}", TQKV_EINVAL, "'u' is undefined");
    expect_fail("{{ 'a' + 1 }}", TQKV_EINVAL, "unsupported operand");
    expect_fail("{{ 1 // 0 }}", TQKV_EINVAL, "zero");
    expect_fail("{% set x.y = 1 %}", TQKV_EINVAL, "namespace");
    expect_fail("{{ 1 in 'abc' }}", TQKV_EINVAL, "requires string");
    expect_fail("{{ [1] in {'a': 1} }}", TQKV_EINVAL, "unhashable");
    expect_fail("{{ u|int }}", TQKV_EINVAL, "'u' is undefined");
    expect_fail("{{ u|dictsort }}", TQKV_EINVAL, "'u' is undefined");
    expect_fail("{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}", TQKV_EINVAL, "deeply");
    expect_fail("{% for i in range(100000000) %}{% endfor %}", TQKV_EUNSUPPORTED, "range");
    expect_fail("{% set ns = namespace(s='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx') %}"
                "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
                TQKV_ENOMEM, NULL);
    /* API misuse */
    tqkv_chat_template *t = NULL;
    assert_int_equal(tqkv_chat_template_init(&t, NULL), TQKV_EINVAL);
    assert_int_equal(tqkv_chat_template_init(NULL, "x"), TQKV_EINVAL);
    assert_int_equal(tqkv_chat_template_init(&t, "{{ messages|length }}"), TQKV_OK);
    char *out = (char *)0x1;
    tqkv_chat_message bad = {"user", NULL};
    assert_int_equal(tqkv_chat_template_render(t, &bad, 1, 0, NULL, NULL, &out, NULL), TQKV_EINVAL);
    assert_ptr_equal(out, (char *)0x1); /* unchanged on failure */
    assert_int_equal(tqkv_chat_template_render(t, NULL, -1, 0, NULL, NULL, &out, NULL), TQKV_EINVAL);
    assert_int_equal(tqkv_chat_template_render(t, NULL, 0, 0, NULL, NULL, &out, NULL), TQKV_OK);
    assert_string_equal(out, "0");
    free(out);
    /* render_json: malformed input fails cleanly and leaves *out alone */
    out = (char *)0x1;
    assert_int_equal(tqkv_chat_template_render_json(t, "[{\"role\": ", 0, NULL, NULL, NULL, &out, NULL), TQKV_EINVAL);
    assert_int_equal(tqkv_chat_template_render_json(t, "{\"role\": \"user\"}", 0, NULL, NULL, NULL, &out, NULL),
                     TQKV_EINVAL);
    assert_int_equal(tqkv_chat_template_render_json(t, "[]", 0, NULL, NULL, "[1]", &out, NULL), TQKV_EINVAL);
    char nested[400];
    memset(nested, '[', 100);
    memset(nested + 100, ']', 100);
    nested[200] = 0;
    assert_int_equal(tqkv_chat_template_render_json(t, nested, 0, NULL, NULL, NULL, &out, NULL), TQKV_EINVAL);
    assert_ptr_equal(out, (char *)0x1);
    assert_int_equal(tqkv_chat_template_render_json(t, "[1, 2.5, null]", 0, NULL, NULL, "{\"x\": 1}", &out, NULL),
                     TQKV_OK);
    assert_string_equal(out, "3");
    free(out);
    tqkv_chat_template_free(t);
    tqkv_chat_template_free(NULL);
}

/* ------------------------------------------------------------------------- */
/* Loading from a model directory                                             */
/* ------------------------------------------------------------------------- */

static void write_text(const char *dir, const char *name, const char *text) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_file(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    remove(path);
}

/* Loads dir and renders one user message "u"; returns the text (malloc'd) or NULL. */
static char *load_render(const char *dir, tqkv_status *st, char **bos, char **eos) {
    tqkv_chat_template *t = NULL;
    *st = tqkv_chat_template_load(&t, dir, bos, eos);
    if (*st != TQKV_OK) return NULL;
    tqkv_chat_message m = {"user", "u"};
    char *out = NULL;
    *st = tqkv_chat_template_render(t, &m, 1, 1, bos ? *bos : NULL, eos ? *eos : NULL, &out, NULL);
    tqkv_chat_template_free(t);
    return out;
}

static void test_load(void **state) {
    (void)state;
    char dir[] = "/tmp/tqkv_chat_XXXXXX";
    assert_non_null(mkdtemp(dir));
    tqkv_status st;
    char *bos = NULL, *eos = NULL, *out;
    /* nothing there */
    out = load_render(dir, &st, &bos, &eos);
    assert_int_equal(st, TQKV_EUNSUPPORTED);
    assert_non_null(strstr(tqkv_last_error(), "no chat template"));
    /* tokenizer_config.json: string template, AddedToken bos, string eos */
    write_text(dir, "tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<B>\", \"lstrip\": false}, \"eos_token\": \"<E>\","
               " \"chat_template\": \"{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
               "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}\"}");
    out = load_render(dir, &st, &bos, &eos);
    assert_int_equal(st, TQKV_OK);
    assert_string_equal(bos, "<B>");
    assert_string_equal(eos, "<E>");
    assert_string_equal(out, "<B>[user:u]><E>");
    free(out);
    free(bos);
    free(eos);
    /* a list of named templates: "default" is used; null bos */
    write_text(dir, "tokenizer_config.json",
               "{\"bos_token\": null, \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
               " {\"name\": \"default\", \"template\": \"D{{ messages|length }}\"}]}");
    out = load_render(dir, &st, &bos, &eos);
    assert_int_equal(st, TQKV_OK);
    assert_null(bos);
    assert_null(eos);
    assert_string_equal(out, "D1");
    free(out);
    /* chat_template.jinja takes precedence over tokenizer_config.json */
    write_text(dir, "chat_template.jinja", "J{{ messages[0].content }}\n");
    out = load_render(dir, &st, NULL, NULL);
    assert_int_equal(st, TQKV_OK);
    assert_string_equal(out, "Ju");
    free(out);
    /* a template outside the subset fails at load with its position */
    write_text(dir, "chat_template.jinja", "ok\n{% include 'x' %}");
    out = load_render(dir, &st, NULL, NULL);
    assert_int_equal(st, TQKV_EUNSUPPORTED);
    assert_non_null(strstr(tqkv_last_error(), "2:4"));
    remove_file(dir, "chat_template.jinja");
    /* a broken config */
    write_text(dir, "tokenizer_config.json", "{\"chat_template\": ");
    out = load_render(dir, &st, NULL, NULL);
    assert_int_equal(st, TQKV_ECORRUPT);
    remove_file(dir, "tokenizer_config.json");
    rmdir(dir);
    /* the fixture model (chat_template.jinja + eos "<|endoftext|>", bos null) */
    char path[4096];
    const char *model = shared_path("models/qwen3-code-28m", path, sizeof path);
    if (!model) {
        printf("../shared absent: fixture model not loaded\n");
        return;
    }
    out = load_render(model, &st, &bos, &eos);
    if (st != TQKV_OK) fail_msg("fixture load: %s", tqkv_last_error());
    assert_null(bos);
    assert_string_equal(eos, "<|endoftext|>");
    assert_string_equal(out, "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    free(eos);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_goldens),
        cmocka_unit_test(test_goldens_extended),
        cmocka_unit_test(test_fixture_chatml),
        cmocka_unit_test(test_reuse),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_semantics),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_load),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_cli_json.c - the CLI's --json output is written by cJSON and parses back:
 *   - json_bytes() round-trips random byte strings (NULs, quotes, control bytes, UTF-8)
 *     through cJSON_Print / cJSON_Parse exactly (NULs as \u0000);
 *   - json_add_num() rounds and writes null for non-finite values;
 *   - `tqkv tokenize --json` and `tqkv run --json` print one line that parses, whose
 *     fields agree with each other and with the library (ids == tqkv_tokenizer_encode);
 *   - `tqkv bench capacity --json` likewise, and prints nothing when a format fails.
 * Owns: temporary files under /tmp. Must not: depend on ../shared.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "testutil.h"
#include "cli/json_out.h"
#include "tqkv_tokenizer.h"

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/* json_bytes(s) printed, then read back: cJSON_Parse stops a string at an escaped NUL,
 * so the printed form is split at each \u0000 and every part parsed and compared. */
static void check_roundtrip(const char *s, size_t len) {
    cJSON *item = json_bytes(s, len);
    assert_non_null(item);
    char *txt = cJSON_PrintUnformatted(item);
    cJSON_Delete(item);
    assert_non_null(txt);
    size_t tl = strlen(txt);
    assert_true(tl >= 2 && txt[0] == '"' && txt[tl - 1] == '"');
    size_t at = 0; /* position in s */
    char *p = txt + 1;
    txt[tl - 1] = 0;
    for (;;) {
        /* the next escaped NUL: scan escape by escape, so that an escaped backslash
         * followed by "u0000" (the alphabet's literal "\\u0000") is not taken for one */
        char *u = NULL;
        for (char *q = p; *q && !u; q++) {
            if (*q != '\\') continue;
            if (!strncmp(q, "\\u0000", 6)) u = q;
            else q++; /* skip the escaped character */
        }
        if (u) *u = 0;
        char buf[4096];
        snprintf(buf, sizeof buf, "\"%s\"", p);
        cJSON *seg = cJSON_Parse(buf);
        if (!seg) fail_msg("segment does not parse: %s", buf);
        assert_true(cJSON_IsString(seg));
        size_t sl = strlen(seg->valuestring);
        assert_true(at + sl <= len);
        assert_memory_equal(seg->valuestring, s + at, sl);
        at += sl;
        cJSON_Delete(seg);
        if (!u) break;
        assert_true(at < len && s[at] == 0);
        at++;
        p = u + 6;
    }
    assert_int_equal(at, len);
    free(txt);
}

/* Run `tqkv ARGS` (stderr discarded); the last stdout line in out; returns exit status. */
static int run_cli(const char *args, char *out, size_t cap) {
    return test_run_last_line(TQKV_CLI_PATH, args, out, cap);
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

static void test_json_bytes_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    static const char *ALPHA[] = {"a",    "\"",   "\\",    "\n",       "\t",
                                  "\x01", "\x1f", "\x7f",  "\xc3\xa9", "\xe2\x82\xac",
                                  "/",    " ",    "u0000", "\\u0000"};
    const size_t n_alpha = sizeof ALPHA / sizeof ALPHA[0];
    for (int it = 0; it < 300; it++) {
        char s[512];
        size_t len = 0;
        int n = rng_int(&r, 0, 40);
        for (int i = 0; i < n; i++) {
            if (rng_int(&r, 0, 4) == 0) {
                s[len++] = 0;
                continue;
            }
            const char *a = ALPHA[rng_int(&r, 0, (int)n_alpha - 1)];
            memcpy(s + len, a, strlen(a));
            len += strlen(a);
        }
        check_roundtrip(s, len);
    }
    check_roundtrip("", 0);
    check_roundtrip("\0", 1);
}

static void test_json_numbers(void **state) {
    (void)state;
    cJSON *o = cJSON_CreateObject();
    json_add_num(o, "a", 3.14159265, 2);
    json_add_num(o, "b", NAN, 2);
    json_add_num(o, "c", INFINITY, 2);
    json_add_num(o, "d", 1234.5678, 1);
    char *t = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    assert_string_equal(t, "{\"a\":3.14,\"b\":null,\"c\":null,\"d\":1234.6}");
    free(t);
}

static void test_cli_tokenize_json(void **state) {
    (void)state;
    char model[1024], path[256], args[2048], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    snprintf(path, sizeof path, "/tmp/tqkv_cli_json_%d.txt", (int)getpid());
    static const char TEXT[] = "def f(x):\n\treturn \"a\\\\b\" \x01 \xe2\x82\xac\n";
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite(TEXT, 1, sizeof TEXT - 1, f);
    fclose(f);
    snprintf(args, sizeof args, "tokenize --model '%s' --file '%s' --json", model, path);
    int rc = run_cli(args, out, sizeof out);
    unlink(path);
    assert_int_equal(rc, 0);
    cJSON *o = cJSON_Parse(out);
    if (!o) fail_msg("not JSON: %s", out);
    const cJSON *ids = cJSON_GetObjectItem(o, "ids"), *toks = cJSON_GetObjectItem(o, "tokens");
    const cJSON *n = cJSON_GetObjectItem(o, "n_tokens");
    assert_true(cJSON_IsArray(ids) && cJSON_IsArray(toks) && cJSON_IsNumber(n));
    // the ids are the library's
    tqkv_tokenizer *tok;
    assert_int_equal(tqkv_tokenizer_load(&tok, model), TQKV_OK);
    int32_t *want;
    size_t n_want;
    assert_int_equal(tqkv_tokenizer_encode(tok, TEXT, sizeof TEXT - 1, 0, &want, &n_want), TQKV_OK);
    assert_int_equal((size_t)cJSON_GetArraySize(ids), n_want);
    assert_int_equal((size_t)cJSON_GetArraySize(toks), n_want);
    assert_int_equal((size_t)n->valuedouble, n_want);
    for (size_t i = 0; i < n_want; i++) {
        assert_int_equal(cJSON_GetArrayItem(ids, (int)i)->valueint, want[i]);
        const char *piece;
        size_t plen;
        assert_int_equal(tqkv_tokenizer_id_to_token(tok, want[i], &piece, &plen), TQKV_OK);
        const cJSON *t = cJSON_GetArrayItem(toks, (int)i);
        assert_true(cJSON_IsString(t));
        assert_int_equal(strlen(t->valuestring), plen);
        assert_memory_equal(t->valuestring, piece, plen);
    }
    free(want);
    tqkv_tokenizer_free(tok);
    cJSON_Delete(o);
}

static void test_cli_run_json(void **state) {
    (void)state;
    char model[1024], args[2048], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    snprintf(args, sizeof args,
             "run --model '%s' --prompt 'def add(a, b):' -n 6 --temp 0 --kv tq4 --threads 2 "
             "--json",
             model);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    cJSON *o = cJSON_Parse(out);
    if (!o) fail_msg("not JSON: %s", out);
    const cJSON *text = cJSON_GetObjectItem(o, "text"), *toks = cJSON_GetObjectItem(o, "tokens");
    assert_true(cJSON_IsString(text) && cJSON_IsArray(toks));
    assert_true(cJSON_GetArraySize(toks) >= 1 && cJSON_GetArraySize(toks) <= 6);
    assert_string_equal(cJSON_GetObjectItem(o, "kv")->valuestring, "tq4");
    assert_true(fabs(cJSON_GetObjectItem(o, "kv_bits_per_value")->valuedouble - 4.125) < 1e-9);
    assert_true(cJSON_GetObjectItem(o, "prompt_tokens")->valuedouble >= 1);
    // the text is the decode of the tokens (stream decode == decode of all ids)
    tqkv_tokenizer *tok;
    assert_int_equal(tqkv_tokenizer_load(&tok, model), TQKV_OK);
    int32_t ids[8];
    int n = cJSON_GetArraySize(toks);
    for (int i = 0; i < n; i++) ids[i] = cJSON_GetArrayItem(toks, i)->valueint;
    char *dec;
    size_t dl;
    assert_int_equal(
        tqkv_tokenizer_decode(tok, ids, (size_t)n, TQKV_DECODE_SKIP_SPECIAL, &dec, &dl), TQKV_OK);
    assert_string_equal(text->valuestring, dec);
    free(dec);
    tqkv_tokenizer_free(tok);
    cJSON_Delete(o);
}

/* With no --kv, `tqkv run` takes the default preset: auto:4.25, resolved to the calibrated
 * policy beside the bundled model (models/qwen3-code-28m/kv-policy-4.25.txt) when it is there,
 * else to a tq4 cache with a q8 window; with --window, plain tq4 and that window. */
static void test_cli_run_default_kv(void **state) {
    (void)state;
    char model[1024], args[2048], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    const char *extra[2] = {"", "--window 8"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "run --model '%s' --prompt 'def add(a, b):' -n 4 --temp 0 "
                 "--threads 2 --json %s", model, extra[i]);
        assert_int_equal(run_cli(args, out, sizeof out), 0);
        cJSON *o = cJSON_Parse(out);
        if (!o) fail_msg("not JSON: %s", out);
        const cJSON *res = cJSON_GetObjectItem(o, "kv_resolved");
        if (i == 0) {
            assert_string_equal(cJSON_GetObjectItem(o, "kv")->valuestring, "auto:4.25");
            assert_true(cJSON_IsString(res));
            /* resolved at the model's context (4096): the window measured at ctx 2048 (30)
             * grows until the 4.25 bits are spent, to within one window token (8.5 / ctx) */
            int w = 0, ctx = 0;
            double bits = 0;
            char pol[1100];
            snprintf(pol, sizeof pol, "%s/kv-policy-4.25.txt", model);
            const char *win = strstr(res->valuestring, " window ");
            if (access(pol, R_OK) == 0) { /* the policy: its own window, within 4.25 at 4096 */
                if (strncmp(res->valuestring, "policy ", 7) || !strstr(res->valuestring, pol) || !win ||
                    sscanf(win, " window %d (%lf bits/value at ctx %d)", &w, &bits, &ctx) != 3)
                    fail_msg("kv_resolved: %s (policy %s)", res->valuestring, pol);
                assert_int_equal(ctx, 4096);
                assert_true(w > 0 && bits <= 4.25);
            } else {
                if (sscanf(res->valuestring, "tq4 window %d (%lf bits/value at ctx %d)", &w, &bits, &ctx) != 3)
                    fail_msg("kv_resolved: %s", res->valuestring);
                assert_int_equal(ctx, 4096);
                assert_true(w > 30 && bits <= 4.25 && bits > 4.25 - 8.5 / ctx);
            }
        } else {
            assert_string_equal(cJSON_GetObjectItem(o, "kv")->valuestring, "tq4");
            assert_null(res);
        }
        cJSON_Delete(o);
    }
}

/* `tqkv ppl --kld --json`: KL divergence and top-1 agreement with the f32 cache, in range
 * and ordered by the formats' error (q8 agrees more and diverges less than tq2). */
static void test_cli_ppl_kld_json(void **state) {
    (void)state;
    char model[1024], text[1024], args[4096], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    source_path("src/util/common.c", text, sizeof text);
    double kld[2], top[2];
    const char *kv[2] = {"q8", "tq2"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "ppl --model '%s' --text '%s' --ctx 128 --max-windows 2 "
                 "--threads 2 --kv %s --kld --json", model, text, kv[i]);
        assert_int_equal(run_cli(args, out, sizeof out), 0);
        cJSON *o = cJSON_Parse(strrchr(out, '{') ? strrchr(out, '{') : out);
        if (!o) fail_msg("not JSON: %s", out);
        kld[i] = cJSON_GetObjectItem(o, "kld")->valuedouble;
        top[i] = cJSON_GetObjectItem(o, "top1_agreement")->valuedouble;
        assert_true(kld[i] >= 0 && top[i] > 0 && top[i] <= 1);
        cJSON_Delete(o);
    }
    assert_true(kld[0] < kld[1] && top[0] > top[1]);
}

/* `tqkv run --tensor-parallel 2 --exact`: the same greedy tokens as unsharded, rank 0 holding
 * half the cache bytes; refusals (a rank count that splits no head evenly, out of range) exit
 * non-zero with nothing on stdout. */
static void test_cli_tensor_parallel(void **state) {
    (void)state;
    char model[1024], args[2048], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    double rank0[2] = {0, 0};
    char toks[2][512];
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "run --model '%s' --prompt 'def add(a, b):' -n 12 --temp 0 "
                 "--kv tq4 --threads 2 --exact --tensor-parallel %d --json", model, i + 1);
        assert_int_equal(run_cli(args, out, sizeof out), 0);
        cJSON *o = cJSON_Parse(out);
        if (!o) fail_msg("not JSON: %s", out);
        assert_int_equal(cJSON_GetObjectItem(o, "tensor_parallel")->valueint, i + 1);
        rank0[i] = cJSON_GetObjectItem(o, "kv_bytes_rank0")->valuedouble;
        char *t = cJSON_PrintUnformatted(cJSON_GetObjectItem(o, "tokens"));
        snprintf(toks[i], sizeof toks[i], "%s", t);
        free(t);
        cJSON_Delete(o);
    }
    assert_string_equal(toks[1], toks[0]);
    assert_true(rank0[0] > 0 && rank0[1] == rank0[0] / 2);
    const char *bad[] = {"--tensor-parallel 3", "--tensor-parallel -1", /* (--device cuda is */
                         "--tensor-parallel 9"};                        /* test_cuda_tp's) */
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "run --model '%s' --prompt 'x' -n 2 --json %s", model, bad[i]);
        assert_int_not_equal(run_cli(args, out, sizeof out), 0);
        assert_int_equal(strlen(out), 0);
    }
}

/* `tqkv bench capacity --json`: one document that parses, whose figures agree with each
 * other; a bad format in the list fails with nothing on stdout (never a truncated
 * document). */
static void test_cli_capacity_json(void **state) {
    (void)state;
    char model[1024], args[2048], out[1 << 16];
    source_path("models/qwen3-code-28m", model, sizeof model);
    snprintf(args, sizeof args, "bench capacity --model '%s' --kv f16,tq4,tq3 --tokens 1000 "
             "--kv-budget 64M --json 2>/dev/null", model);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    cJSON *o = cJSON_Parse(out);
    if (!o) fail_msg("not JSON: %s", out);
    assert_true(cJSON_GetObjectItem(o, "budget_bytes")->valuedouble == 64.0 * 1048576);
    const cJSON *f = cJSON_GetObjectItem(o, "formats");
    assert_int_equal(cJSON_GetArraySize(f), 3);
    double prev = 0;
    for (int i = 0; i < 3; i++) {
        const cJSON *x = cJSON_GetArrayItem(f, i);
        const double per = cJSON_GetObjectItem(x, "projected_bytes")->valuedouble;
        const double n = cJSON_GetObjectItem(x, "conversations")->valuedouble;
        assert_true(per > 0 && n == floor(64.0 * 1048576 / per));
        assert_true(n > prev); /* f16 < tq4 < tq3 */
        prev = n;
    }
    cJSON_Delete(o);
    snprintf(args, sizeof args, "bench capacity --model '%s' --kv f16,bogus --json 2>/dev/null", model);
    assert_int_not_equal(run_cli(args, out, sizeof out), 0);
    assert_int_equal(strlen(out), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_bytes_roundtrip),
        cmocka_unit_test(test_json_numbers),
        cmocka_unit_test(test_cli_tokenize_json),
        cmocka_unit_test(test_cli_run_json),
        cmocka_unit_test(test_cli_run_default_kv),
        cmocka_unit_test(test_cli_ppl_kld_json),
        cmocka_unit_test(test_cli_tensor_parallel),
        cmocka_unit_test(test_cli_capacity_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

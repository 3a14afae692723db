/*
 * test_kv_policy.c - KV policy files (src/cli/kv_policy.c) and `tqkv calibrate`:
 *   - the parser takes a well-formed policy and refuses bad ones (header, version, unknown or
 *     duplicate key, bad formats, bad numbers, missing keys) with a message, leaving its
 *     output unchanged;
 *   - kvpol_apply on the bundled qwen3-code-28m: the formats, per-layer formats and window
 *     of the policy; refuses a wrong layer count, a layer the model lacks and bits over the
 *     budget, leaving the params unchanged;
 *   - a state made from a policy exports and imports with its per-layer formats, and its
 *     export is refused by a state without them;
 *   - `tqkv calibrate` writes a policy within its budget, and `tqkv ppl --kv-policy` gives
 *     the same ppl, KLD and bits as the explicit --kv / --kv-layers / --window it holds;
 *   - session 11: "window-planes k" (a keys-only window) parses, writes, applies (fewer
 *     bits than the K and V window), and a state made with it (tq1 planes too) exports and
 *     imports with it, refused by a state with a K and V window; ppl --kv-policy with it
 *     equals ppl --window-keys-only.
 *   - device states (checked without a device): kvpol_apply takes a policy of device pairs
 *     and a K and V window and refuses others (params unchanged, the reason in desc);
 *     `--kv auto:B` takes such a policy file and otherwise falls back to a device preset,
 *     saying why; the bundled model's policies resolve to device ones on a device state; `tqkv calibrate --device-formats` writes only device pairs (the same run
 *     without it does not), and refuses q8 candidates and --try-keys-only;
 *   - session 12: a device state takes DIR/kv-policy-B.device.txt before kv-policy-B.txt
 *     (each file not used named in the resolved spec, with why), a CPU state never reads it,
 *     and one that does not parse is an error on the device.
 * Owns: temporary files under /tmp. Must not: depend on ../shared. Skips (77) when the
 * bundled model is absent.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "testutil.h"
#include "cli/kv_policy.h"
#include "cli/kv_preset.h"
#include "cli/kv_shipped.h"
#include "tqkv_model.h"

static const char GOOD[] = "tqkv-kv-policy 1\n# a comment\nlayers 8\nkv tq4/tq2\n"
                           "kv-layers 3:q8/tq2;5,6:tq3  # trailing comment\nwindow 30\n"
                           "budget 4.25\nctx 2048\nbits 4.2\n";

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/* Write text to DIR/name. */
static void write_text(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* dir: a fresh folder (under /tmp) of links to the bundled model md's files, without the
 * model's own kv-policy-*.txt unless keep_policies; with text as dir/name (name NULL: none). */
static void link_model(const char *md, const char *dir, int keep_policies, const char *name,
                       const char *text) {
    char args[4096];
    snprintf(args, sizeof args, "rm -rf '%s' && mkdir -p '%s' && ln -sf '%s'/* '%s'/", dir, dir, md,
             dir);
    assert_int_equal(system(args), 0);
    if (!keep_policies) {
        snprintf(args, sizeof args, "rm -f '%s'/kv-policy-*.txt", dir);
        assert_int_equal(system(args), 0);
    }
    if (name) write_text(dir, name, text);
}

/* Run `tqkv ARGS` (stderr discarded); the last stdout line in out; the exit status. */
static int run_cli(const char *args, char *out, size_t cap) {
    return test_run_last_line(TQKV_CLI_PATH, args, out, cap);
}

/* Run `tqkv ARGS`, which must exit 0 and print JSON last; that JSON (the caller frees it). */
static cJSON *run_cli_json(const char *args) {
    static char out[1 << 16];
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    cJSON *j = cJSON_Parse(out);
    if (!j) fail_msg("not JSON: %s", out);
    return j;
}

/* Parse pol text that must fail; checks the message and that out is unchanged. */
static void parse_bad(const char *text) {
    kv_policy out, before;
    memset(&out, 0x5a, sizeof out);
    before = out;
    char err[256] = "";
    if (kvpol_parse(text, &out, err, sizeof err) == 0) fail_msg("accepted: %s", text);
    assert_true(err[0] != 0);
    assert_memory_equal(&out, &before, sizeof out);
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

static void test_parse(void **state) {
    (void)state;
    kv_policy p;
    char err[256];
    if (kvpol_parse(GOOD, &p, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(p.layers, 8);
    assert_string_equal(p.kv, "tq4/tq2");
    assert_string_equal(p.kv_layers, "3:q8/tq2;5,6:tq3");
    assert_int_equal(p.window, 30);
    assert_true(p.budget == 4.25 && p.ctx == 2048 && p.bits == 4.2);
    /* written and read back */
    char buf[1024];
    FILE *f = fmemopen(buf, sizeof buf, "w");
    assert_int_equal(kvpol_write(f, &p, "note"), 0);
    fclose(f);
    kv_policy q;
    if (kvpol_parse(buf, &q, err, sizeof err)) fail_msg("%s: %s", err, buf);
    assert_memory_equal(&p, &q, sizeof p);
    const char *bad[] = {
        "",
        "layers 8\nkv tq4\n",                               /* no header */
        "tqkv-kv-policy 2\nlayers 8\nkv tq4\n",             /* version */
        "tqkv-kv-policy 1\nlayers 8\n",                     /* no kv */
        "tqkv-kv-policy 1\nkv tq4\n",                       /* no layers */
        "tqkv-kv-policy 1\nlayers 8\nkv tq9\n",             /* unknown format */
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nkv-layers 3:zz\n",
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nkv-layers 99:q8\n",
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nwindow -1\n",
        "tqkv-kv-policy 1\nlayers 0\nkv tq4\n",
        "tqkv-kv-policy 1\nlayers 8x\nkv tq4\n",
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nbudget 0\n",
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nbudget abc\n",
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\nlayers 8\n",   /* duplicate */
        "tqkv-kv-policy 1\nlayers 8\nkv tq4\ncolour blue\n", /* unknown key */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) parse_bad(bad[i]);
    /* a line longer than the parser's line buffer is refused as such, before any key sees
     * a cut value */
    char longp[2048] = "tqkv-kv-policy 1\nlayers 8\nkv tq4\nkv-layers 1:q8", err2[256] = "";
    while (strlen(longp) < 900) strcat(longp, ";1:q8");
    parse_bad(longp);
    assert_int_equal(kvpol_parse(longp, &q, err2, sizeof err2), -1);
    if (!strstr(err2, "line 4 is longer than")) fail_msg("long line: %s", err2);
}

static const char KONLY[] = "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq2\n"
                            "kv-layers 3:q8/tq2;5,6:tq3;2:tq1/tq1\nwindow 30\n"
                            "window-planes k\nbudget 4.25\n";

/* "window-planes k": parsed, written back, applied with fewer bits than the K and V ring. */
static void test_keys_only(void **state) {
    (void)state;
    char md[1024], err[256], desc[256], buf[1024];
    kv_policy p, q;
    if (kvpol_parse(KONLY, &p, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(p.window_keys_only, 1);
    assert_int_equal(kvpol_parse(GOOD, &q, err, sizeof err), 0);
    assert_int_equal(q.window_keys_only, 0); /* files without the key: K and V */
    FILE *f = fmemopen(buf, sizeof buf, "w");
    assert_int_equal(kvpol_write(f, &p, NULL), 0);
    fclose(f);
    assert_non_null(strstr(buf, "window-planes k\n"));
    if (kvpol_parse(buf, &q, err, sizeof err)) fail_msg("%s: %s", err, buf);
    assert_memory_equal(&p, &q, sizeof p);
    parse_bad("tqkv-kv-policy 1\nlayers 8\nkv tq4\nwindow-planes v\n");
    parse_bad("tqkv-kv-policy 1\nlayers 8\nkv tq4\nwindow-planes k\nwindow-planes kv\n");
    tqkv_model *m = test_load_bundled(md, sizeof md);
    tqkv_model_state_params a = tqkv_model_state_params_default(), b = a;
    assert_int_equal(kvpol_apply("test", m, &p, 2048, &a, desc, sizeof desc), 0);
    assert_int_equal(a.window_keys_only, 1);
    assert_non_null(strstr(desc, "keys only"));
    p.window_keys_only = 0;
    assert_int_equal(kvpol_apply("test", m, &p, 2048, &b, desc, sizeof desc), 0);
    assert_int_equal(b.window_keys_only, 0);
    /* the keys-only ring: the tq K planes' rings only, no V ring */
    const double ba = kvpol_bits(m, &a, 2048), bb = kvpol_bits(m, &b, 2048);
    fprintf(stderr, "keys-only policy %.4f bits, K and V window %.4f\n", ba, bb);
    assert_true(ba > 0 && ba < bb - 0.05);
    /* a state made from it exports and imports; a K and V window state refuses the export */
    tqkv_model_state *s = NULL, *r = NULL;
    a.threads = b.threads = 2;
    assert_int_equal(tqkv_model_state_init(&s, m, &a), TQKV_OK);
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = 300 + 5 * i;
    const int V = tqkv_model_get_config(m)->vocab_size;
    float *la = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)V);
    assert_int_equal(tqkv_model_prefill(m, s, tok, NULL, 39, TQKV_LOGITS_LAST, la), TQKV_OK);
    uint8_t *st = NULL;
    size_t len = 0;
    assert_int_equal(tqkv_model_state_export(s, &st, &len), TQKV_OK);
    assert_int_not_equal(tqkv_model_state_import(&r, m, &b, st, len), TQKV_OK);
    assert_null(r);
    assert_int_equal(tqkv_model_state_import(&r, m, &a, st, len), TQKV_OK);
    const tqkv_cache_config *c2 = tqkv_batch_get_config(tqkv_model_state_layer(r, 2));
    assert_true(c2->k_format == TQKV_TQ1 && c2->v_format == TQKV_TQ1 && c2->window_keys_only);
    assert_int_equal(tqkv_model_extend(m, s, tok + 39, 1, TQKV_LOGITS_LAST, la), TQKV_OK);
    assert_int_equal(tqkv_model_extend(m, r, tok + 39, 1, TQKV_LOGITS_LAST, lb), TQKV_OK);
    assert_memory_equal(la, lb, sizeof(float) * (size_t)V);
    free(st);
    free(la);
    free(lb);
    tqkv_model_state_free(r);
    tqkv_model_state_free(s);
    tqkv_model_free(m);
}

static void test_apply(void **state) {
    (void)state;
    char md[1024], err[256], desc[256];
    tqkv_model *m = test_load_bundled(md, sizeof md);
    kv_policy pol;
    assert_int_equal(kvpol_parse(GOOD, &pol, err, sizeof err), 0);
    tqkv_model_state_params p = tqkv_model_state_params_default(), want = p;
    assert_int_equal(kvpol_apply("test", m, &pol, 2048, &p, desc, sizeof desc), 0);
    assert_int_equal(tqkv_kv_spec_parse("tq4/tq2", &want.k_format, &want.v_format), TQKV_OK);
    assert_int_equal(tqkv_kv_layers_parse("3:q8/tq2;5,6:tq3", &want), TQKV_OK);
    want.window = 30;
    want.window_slack = 0;
    assert_memory_equal(&p, &want, sizeof p);
    /* refused, params unchanged */
    kv_policy bad[3] = {pol, pol, pol};
    bad[0].layers = 9;
    snprintf(bad[1].kv_layers, sizeof bad[1].kv_layers, "8:q8");
    bad[2].budget = 3.0; /* tq4/tq2 with q8 on layer 3 takes more */
    for (int i = 0; i < 3; i++) {
        tqkv_model_state_params q = tqkv_model_state_params_default(), q0 = q;
        assert_int_equal(kvpol_apply("test", m, &bad[i], 2048, &q, desc, sizeof desc), -1);
        assert_memory_equal(&q, &q0, sizeof q);
    }
    tqkv_model_free(m);
}

/* A state made from a policy exports and imports with its per-layer formats. */
static void test_state_roundtrip(void **state) {
    (void)state;
    char md[1024], err[256], desc[256];
    tqkv_model *m = test_load_bundled(md, sizeof md);
    kv_policy pol;
    assert_int_equal(kvpol_parse(GOOD, &pol, err, sizeof err), 0);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.threads = 2;
    assert_int_equal(kvpol_apply("test", m, &pol, 2048, &p, desc, sizeof desc), 0);
    tqkv_model_state *s = NULL, *r = NULL;
    assert_int_equal(tqkv_model_state_init(&s, m, &p), TQKV_OK);
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = 200 + 3 * i;
    const int V = tqkv_model_get_config(m)->vocab_size;
    float *a = malloc(sizeof(float) * (size_t)V), *b = malloc(sizeof(float) * (size_t)V);
    assert_int_equal(tqkv_model_prefill(m, s, tok, NULL, 39, TQKV_LOGITS_LAST, a), TQKV_OK);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(tqkv_model_state_export(s, &buf, &len), TQKV_OK);
    assert_int_equal(tqkv_model_state_import(&r, m, &p, buf, len), TQKV_OK);
    const tqkv_cache_config *c3 = tqkv_batch_get_config(tqkv_model_state_layer(r, 3));
    assert_true(c3->k_format == TQKV_Q8 && c3->v_format == TQKV_TQ2 && c3->window == 30);
    assert_int_equal(tqkv_batch_get_config(tqkv_model_state_layer(r, 5))->k_format, TQKV_TQ3);
    /* the next token's logits are the same from the restored state */
    assert_int_equal(tqkv_model_extend(m, s, tok + 39, 1, TQKV_LOGITS_LAST, a), TQKV_OK);
    assert_int_equal(tqkv_model_extend(m, r, tok + 39, 1, TQKV_LOGITS_LAST, b), TQKV_OK);
    assert_memory_equal(a, b, sizeof(float) * (size_t)V);
    tqkv_model_state_free(r);
    r = NULL;
    tqkv_model_state_params other = p; /* the same formats without the per-layer ones */
    assert_int_equal(tqkv_kv_layers_parse("", &other), TQKV_OK);
    assert_int_not_equal(tqkv_model_state_import(&r, m, &other, buf, len), TQKV_OK);
    assert_null(r);
    free(buf);
    free(a);
    free(b);
    tqkv_model_state_free(s);
    tqkv_model_free(m);
}

/* One field of a JSON line as a number (fails when absent). */
static double jnum(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    if (!cJSON_IsNumber(v)) fail_msg("no number '%s'", k);
    return v->valuedouble;
}

/* `tqkv calibrate` on a source file of this repository (code, as the held-out text), then ppl
 * with the policy against ppl with the explicit options it holds. */
static void test_cli_calibrate(void **state) {
    (void)state;
    char md[1024], text[1024], pol_path[256], args[4096], out[1 << 16], err[256];
    test_bundled_dir(md, sizeof md);
    source_path("src/cli/cmd_ppl.c", text, sizeof text);
    snprintf(pol_path, sizeof pol_path, "/tmp/tqkv_kv_policy_%d.txt", (int)getpid());
    snprintf(args, sizeof args, "calibrate --model '%s' --text '%s' --ctx 128 --max-windows 1 "
             "--first-window 1 --window 8 --budget 3.5 --threads 2 --try-windows 16 "
             "--try-keys-only --out '%s'", md, text, pol_path);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    char *ptext = NULL;
    FILE *f = fopen(pol_path, "r");
    assert_non_null(f);
    ptext = calloc(1, 4096);
    assert_true(fread(ptext, 1, 4095, f) > 0);
    fclose(f);
    kv_policy pol;
    if (kvpol_parse(ptext, &pol, err, sizeof err)) fail_msg("%s: %s", err, ptext);
    free(ptext);
    assert_true(pol.layers == 8 && pol.budget == 3.5 && pol.bits > 2 && pol.bits <= 3.5);
    assert_true(pol.window >= 8);
    /* ppl --kv-policy == ppl with the explicit --kv / --kv-layers / --window */
    const char *common = "--ctx 128 --max-windows 2 --threads 2 --kld --json";
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s --kv-policy '%s'", md, text,
             common, pol_path);
    cJSON *a = run_cli_json(args);
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s --kv %s --kv-layers '%s' "
             "--window %d --window-slack 0%s", md, text, common, pol.kv, pol.kv_layers, pol.window,
             pol.window_keys_only ? " --window-keys-only" : "");
    cJSON *b = run_cli_json(args);
    assert_true(jnum(a, "ppl") == jnum(b, "ppl") && jnum(a, "kld") == jnum(b, "kld"));
    assert_true(jnum(a, "kv_bits_per_value") == jnum(b, "kv_bits_per_value"));
    assert_true(fabs(jnum(a, "kv_bits_per_value") - pol.bits) < 1e-4);
    assert_true(jnum(a, "kv_bits_per_value") <= 3.5);
    cJSON_Delete(a);
    cJSON_Delete(b);
    /* a policy that does not fit its budget at a shorter context is refused */
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' --ctx 16 --max-windows 1 "
             "--threads 2 --kv-policy '%s'", md, text, pol_path);
    assert_int_not_equal(run_cli(args, out, sizeof out), 0);
    unlink(pol_path);
}

/* ppl --kld's reference is f32 on every layer: per-layer formats that name the default's
 * formats give the default's KLD (the reference once kept the per-layer formats), and a
 * cache f32 by default but tq4 per layer is measured (it once had no reference: KLD 0). */
static void test_cli_kld_reference(void **state) {
    (void)state;
    char md[1024], text[1024], args[4096];
    test_bundled_dir(md, sizeof md);
    source_path("src/cli/cmd_ppl.c", text, sizeof text);
    const char *kv[3] = {"--kv tq4 --window 8", "--kv q8/tq4 --kv-layers 0-7:tq4 --window 8",
                         "--kv f32 --kv-layers 0-7:tq4"};
    double kld[3], ppl[3];
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "ppl --model '%s' --text '%s' --ctx 128 --max-windows 1 "
                 "--threads 2 --kld --json --window-slack 0 %s", md, text, kv[i]);
        cJSON *a = run_cli_json(args);
        kld[i] = jnum(a, "kld");
        ppl[i] = jnum(a, "ppl");
        cJSON_Delete(a);
    }
    assert_true(ppl[0] == ppl[1] && kld[0] == kld[1] && kld[0] > 0);
    assert_true(kld[2] > kld[0]); /* tq4 without a window: more divergence, not none */
}

/* `--kv auto:B` takes DIR/kv-policy-B.txt when it fits, else the ranked presets. */
static void test_cli_auto_policy(void **state) {
    (void)state;
    char md[1024], text[1024], dir[256], args[4096], out[1 << 16];
    test_bundled_dir(md, sizeof md);
    source_path("src/cli/cmd_ppl.c", text, sizeof text);
    snprintf(dir, sizeof dir, "/tmp/tqkv_kv_policy_model_%d", (int)getpid());
    link_model(md, dir, 1, "kv-policy-4.5.txt",
               "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq3\nkv-layers 0:q8/tq3\nwindow 4\n");
    const char *common = "--ctx 64 --max-windows 1 --threads 2 --json";
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s --kv auto:4.5", dir, text, common);
    cJSON *a = run_cli_json(args);
    const cJSON *r = cJSON_GetObjectItem(a, "kv_resolved");
    assert_true(cJSON_IsString(r) && strstr(r->valuestring, "policy ") == r->valuestring);
    assert_true(jnum(a, "kv_bits_per_value") <= 4.5 && jnum(a, "window") == 4);
    cJSON_Delete(a);
    /* bench model resolves presets as ppl does: the policy beside the model */
    snprintf(args, sizeof args, "bench model --model '%s' --kv auto:4.5 --ctx 64 --gen 2 "
             "--rows 1 --reps 1 --threads 2 --json", dir);
    a = run_cli_json(args);
    r = cJSON_GetObjectItem(cJSON_GetArrayItem(a, 0), "kv_resolved");
    if (!cJSON_IsString(r) || strstr(r->valuestring, "policy ") != r->valuestring)
        fail_msg("bench model: %s", cJSON_IsString(r) ? r->valuestring : "no kv_resolved");
    cJSON_Delete(a);
    /* the same policy under a budget it does not fit: the ranked presets */
    snprintf(args, sizeof args, "mv '%s/kv-policy-4.5.txt' '%s/kv-policy-3.5.txt'", dir, dir);
    assert_int_equal(system(args), 0);
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s --kv auto:3.5", dir, text, common);
    a = run_cli_json(args);
    r = cJSON_GetObjectItem(a, "kv_resolved"); /* a preset, saying why the policy is not */
    assert_true(cJSON_IsString(r) && strstr(r->valuestring, "policy ") != r->valuestring);
    if (!strstr(r->valuestring, "not used: KV policy takes")) fail_msg("%s", r->valuestring);
    assert_true(jnum(a, "kv_bits_per_value") <= 3.5);
    cJSON_Delete(a);
    /* a file that does not parse is an error */
    snprintf(args, sizeof args, "echo junk > '%s/kv-policy-3.5.txt'", dir);
    assert_int_equal(system(args), 0);
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s --kv auto:3.5", dir, text, common);
    assert_int_not_equal(run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "rm -rf '%s'", dir);
    assert_int_equal(system(args), 0);
}

/* Device states: kvpol_apply with p.device = 1 takes only device pairs and K and V windows. */
static void test_apply_device(void **state) {
    (void)state;
    char md[1024], err[256], desc[256];
    tqkv_model *m = test_load_bundled(md, sizeof md);
    const char *ok_text = "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq2\nkv-layers 3:fp8;5,6:tq3\n"
                          "window 30\n";
    kv_policy good, pol, keys;
    assert_int_equal(kvpol_parse(ok_text, &good, err, sizeof err), 0);
    assert_int_equal(kvpol_parse(GOOD, &pol, err, sizeof err), 0); /* layer 3 q8/tq2 */
    keys = good;
    keys.window_keys_only = 1;
    tqkv_model_state_params p = tqkv_model_state_params_default(), p0;
    p.device = 1;
    p0 = p;
    assert_int_equal(kvpol_apply("test", m, &good, 2048, &p, desc, sizeof desc), 0);
    tqkv_format k, v;
    tqkv_kv_layer_formats(&p, 3, &k, &v);
    assert_true(k == TQKV_FP8 && v == TQKV_FP8 && p.window == 30 && p.device == 1);
    const kv_policy *bad[2] = {&pol, &keys};
    const char *says[2] = {"layer 3 KV q8/tq2", "keys-only"};
    for (int i = 0; i < 2; i++) {
        tqkv_model_state_params q = p0;
        desc[0] = 0;
        assert_int_equal(kvpol_apply("test", m, bad[i], 2048, &q, desc, sizeof desc), -1);
        assert_memory_equal(&q, &p0, sizeof q);
        if (!strstr(desc, says[i])) fail_msg("%s", desc);
    }
    /* --kv auto:B with DIR/kv-policy-B.txt: taken when device-capable, else a device preset
     * that says why the policy was not used */
    char dir[256], path[300];
    snprintf(dir, sizeof dir, "/tmp/tqkv_kv_policy_dev_%d", (int)getpid());
    snprintf(path, sizeof path, "%s/kv-policy-6.txt", dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    const char *texts[2] = {ok_text, GOOD};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(texts[i], f);
        fclose(f);
        tqkv_model_state_params q = p0;
        assert_int_equal(kvp_resolve_model("test", m, dir, "auto:6", 2048, &q, desc, sizeof desc), 0);
        assert_int_equal(tqkv_kv_layers_device_check(m, &q, NULL), TQKV_OK);
        if (i == 0 && strstr(desc, "policy ") != desc) fail_msg("%s", desc);
        if (i == 1 && !strstr(desc, "not used: KV policy: --device cuda: layer 3 KV q8/tq2"))
            fail_msg("%s", desc);
    }
    unlink(path);
    rmdir(dir);
    /* the shipped policies (docs/QUALITY.md): 2.5 holds device pairs only; 3.25 has layer 0
     * at tq2/tq3 (K bits < V bits) and 4.25 q8 keys, so device states take their .device
     * files (session 12, `calibrate --device-formats`); CPU states the plain ones */
    const char *budgets[3] = {"2.5", "3.25", "4.25"};
    for (int i = 0; i < 3; i++) {
        char kv[16], want[1200], dlong[KVP_DESC];
        snprintf(kv, sizeof kv, "auto:%s", budgets[i]);
        for (int dev = 0; dev < 2; dev++) {
            tqkv_model_state_params q = p0;
            q.device = dev;
            assert_int_equal(kvp_resolve_model("test", m, md, kv, 2048, &q, dlong,
                                               sizeof dlong), 0);
            printf("  %s %s -> %s\n", dev ? "device" : "cpu", kv, dlong);
            snprintf(want, sizeof want, "policy %s/kv-policy-%s%s.txt: ", md, budgets[i],
                     dev && i ? ".device" : "");
            if (strstr(dlong, want) != dlong) fail_msg("%s", dlong);
            if (dev) assert_int_equal(tqkv_kv_layers_device_check(m, &q, NULL), TQKV_OK);
        }
    }
    tqkv_model_free(m);
}

/* kvp_resolve_model on a device (device 1) or CPU state for auto:6 in dir: its status, the
 * resolved spec in desc, layer 3's pair in *k / *v; params unchanged on failure. */
static int resolve6(const tqkv_model *m, const char *dir, int device, char *desc, size_t cap,
                    tqkv_format *k, tqkv_format *v) {
    tqkv_model_state_params q = tqkv_model_state_params_default(), q0;
    q.device = device;
    q0 = q;
    desc[0] = 0;
    const int rc = kvp_resolve_model("test", m, dir, "auto:6", 2048, &q, desc, cap);
    if (rc) assert_memory_equal(&q, &q0, sizeof q);
    if (!rc && device) assert_int_equal(tqkv_kv_layers_device_check(m, &q, NULL), TQKV_OK);
    tqkv_kv_layer_formats(&q, 3, k, v);
    printf("  %s: %d %s\n", device ? "device" : "cpu", rc, desc);
    return rc;
}

/* Session 12: kv-policy-B.device.txt beside kv-policy-B.txt. A device state takes the
 * .device file first, then the plain one if device-capable, then the presets (each file
 * not used is named, with why, in the resolved spec); a CPU state never reads the .device
 * file; a .device file that does not parse is an error on the device. */
static void test_device_policy_file(void **state) {
    (void)state;
    char md[1024], dir[256], desc[KVP_DESC], dev[300], plain[300];
    tqkv_model *m = test_load_bundled(md, sizeof md);
    static const char DEV[] = "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq2\nkv-layers 3:fp8\n"
                              "window 30\n";
    static const char PLAIN_DEV[] = "tqkv-kv-policy 1\nlayers 8\nkv tq4\nkv-layers "
                                    "3:tq3/tq3\nwindow 20\n";
    snprintf(dir, sizeof dir, "/tmp/tqkv_kv_policy_devfile_%d", (int)getpid());
    snprintf(dev, sizeof dev, "policy %s/kv-policy-6.device.txt: ", dir);
    snprintf(plain, sizeof plain, "policy %s/kv-policy-6.txt: ", dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    tqkv_format k, v;
    /* a CPU-only plain policy and a device one: each state takes its own */
    write_text(dir, "kv-policy-6.txt", GOOD);
    write_text(dir, "kv-policy-6.device.txt", DEV);
    assert_int_equal(resolve6(m, dir, 1, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, dev) != desc) fail_msg("%s", desc);
    assert_true(k == TQKV_FP8 && v == TQKV_FP8);
    assert_int_equal(resolve6(m, dir, 0, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, plain) != desc) fail_msg("%s", desc);
    assert_true(k == TQKV_Q8 && v == TQKV_TQ2);
    /* a device-capable plain policy: the device still takes the .device one */
    write_text(dir, "kv-policy-6.txt", PLAIN_DEV);
    assert_int_equal(resolve6(m, dir, 1, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, dev) != desc) fail_msg("%s", desc);
    /* a .device file the device cannot take: the plain one, saying why */
    write_text(dir, "kv-policy-6.device.txt", GOOD);
    assert_int_equal(resolve6(m, dir, 1, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, plain) != desc || !strstr(desc, "kv-policy-6.device.txt not used: KV "
                                               "policy: --device cuda: layer 3 KV q8/tq2"))
        fail_msg("%s", desc);
    assert_true(k == TQKV_TQ3 && v == TQKV_TQ3);
    /* neither applies: a device preset naming both */
    write_text(dir, "kv-policy-6.txt", GOOD);
    assert_int_equal(resolve6(m, dir, 1, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, "policy ") == desc || !strstr(desc, "6.device.txt not used: ") ||
        !strstr(desc, "6.txt not used: "))
        fail_msg("%s", desc);
    /* a .device file that does not parse: an error on the device, unread on the CPU */
    write_text(dir, "kv-policy-6.device.txt", "junk\n");
    assert_int_equal(resolve6(m, dir, 1, desc, sizeof desc, &k, &v), -1);
    assert_int_equal(resolve6(m, dir, 0, desc, sizeof desc, &k, &v), 0);
    if (strstr(desc, plain) != desc) fail_msg("%s", desc);
    char path[300];
    snprintf(path, sizeof path, "%s/kv-policy-6.device.txt", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/kv-policy-6.txt", dir);
    unlink(path);
    assert_int_equal(rmdir(dir), 0);
    tqkv_model_free(m);
}

/* The per-layer pairs of policy file path, applied to a device state: 0 when the device
 * takes them, -1 when not; the policy text into pol. */
static int policy_device_ok(const tqkv_model *m, const char *path, kv_policy *pol) {
    char err[256], desc[256];
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char *text = calloc(1, 4096);
    assert_true(fread(text, 1, 4095, f) > 0);
    fclose(f);
    if (kvpol_parse(text, pol, err, sizeof err)) fail_msg("%s: %s", err, text);
    free(text);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.device = 1;
    return kvpol_apply("test", m, pol, 128, &p, desc, sizeof desc);
}

/* `tqkv calibrate --device-formats`: a policy of device pairs (fp8 for q8), where the same
 * run without the flag chooses a pair the device lacks; q8 candidates and keys-only windows
 * are refused with it. */
static void test_cli_calibrate_device(void **state) {
    (void)state;
    char md[1024], text[1024], path[2][256], args[4096], out[1 << 16];
    tqkv_model *m = test_load_bundled(md, sizeof md);
    source_path("src/cli/cmd_ppl.c", text, sizeof text);
    kv_policy pol[2];
    for (int d = 0; d < 2; d++) {
        snprintf(path[d], sizeof path[d], "/tmp/tqkv_kv_policy_cal%d_%d.txt", d, (int)getpid());
        snprintf(args, sizeof args, "calibrate --model '%s' --text '%s' --ctx 128 --max-windows "
                 "1 --first-window 1 --window 8 --budget 6 --threads 2 --no-check --out '%s'%s",
                 md, text, path[d], d ? " --device-formats" : "");
        assert_int_equal(run_cli(args, out, sizeof out), 0);
    }
    assert_int_equal(policy_device_ok(m, path[0], &pol[0]), -1); /* q8 planes: not on device */
    assert_int_equal(policy_device_ok(m, path[1], &pol[1]), 0);
    fprintf(stderr, "  calibrated: kv %s layers '%s'; --device-formats: kv %s layers '%s'\n",
            pol[0].kv, pol[0].kv_layers, pol[1].kv, pol[1].kv_layers);
    assert_true(pol[1].bits > 0 && pol[1].bits <= 6 && !strstr(pol[1].kv_layers, "q8"));
    for (int d = 0; d < 2; d++) unlink(path[d]);
    const char *refused[2] = {"--formats q8,tq4", "--try-keys-only"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "calibrate --model '%s' --text '%s' --ctx 128 --max-windows "
                 "1 --device-formats %s", md, text, refused[i]);
        assert_int_equal(run_cli(args, out, sizeof out), 2);
    }
    tqkv_model_free(m);
}

/* Shipped policies (kv_shipped.c): the fingerprint is FNV-1a 64 of config.json (the standard
 * test vector of "a"); kvship_find takes $TQKV_POLICY_DIR/<fp>/kv-policy-B.txt. */
static void test_shipped_policy(void **state) {
    (void)state;
    char dir[200], pol[256], args[4096], fp[32], sd[4200];
    snprintf(dir, sizeof dir, "/tmp/tqkv_kv_shipped_%d", (int)getpid());
    snprintf(pol, sizeof pol, "%s_pol", dir);
    snprintf(args, sizeof args, "rm -rf '%s' '%s' && mkdir -p '%s/af63dc4c8601ec8c' '%s' && "
             "printf a > '%s/config.json' && echo x > '%s/af63dc4c8601ec8c/kv-policy-4.25.txt'",
             dir, pol, pol, dir, dir, pol);
    assert_int_equal(system(args), 0);
    assert_int_equal(kvship_fingerprint(dir, fp, sizeof fp), 0);
    assert_string_equal(fp, "af63dc4c8601ec8c");
    assert_int_equal(kvship_fingerprint("/nonexistent-tqkv", fp, sizeof fp), -1);
    setenv("TQKV_POLICY_DIR", pol, 1);
    assert_int_equal(kvship_find(dir, "4.25", sd, sizeof sd), 0);
    snprintf(args, sizeof args, "%s/af63dc4c8601ec8c", pol);
    assert_string_equal(sd, args);
    assert_int_equal(kvship_find(dir, "3.25", sd, sizeof sd), 1);
    unsetenv("TQKV_POLICY_DIR");
    snprintf(args, sizeof args, "rm -rf '%s' '%s'", dir, pol);
    assert_int_equal(system(args), 0);
}

/* `--kv auto:B` on the bundled model's files without its policies, a 4.25 policy shipped
 * (TQKV_POLICY_DIR): ppl reads the shipped folder, a device state its .device file first,
 * and a policy beside the model wins. Skipped without the bundled model. */
static void test_shipped_policy_cli(void **state) {
    (void)state;
    static const char TQ4_TQ3_W4[] = "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq3\nwindow 4\n";
    char md[1024], text[1024], dir[200], pol[256], shipped[300], args[4096], fp[32], sd[4200];
    test_bundled_dir(md, sizeof md);
    source_path("src/cli/cmd_ppl.c", text, sizeof text);
    snprintf(dir, sizeof dir, "/tmp/tqkv_kv_shipped_cli_%d", (int)getpid());
    snprintf(pol, sizeof pol, "%s_pol", dir);
    setenv("TQKV_POLICY_DIR", pol, 1);
    link_model(md, dir, 0, NULL, NULL);
    assert_int_equal(kvship_fingerprint(dir, fp, sizeof fp), 0);
    snprintf(shipped, sizeof shipped, "%s/%s", pol, fp);
    snprintf(args, sizeof args, "mkdir -p '%s'", shipped);
    assert_int_equal(system(args), 0);
    write_text(shipped, "kv-policy-4.25.txt", "tqkv-kv-policy 1\nlayers 8\nkv tq4/tq2\nwindow 4\n");
    const char *common = "--ctx 64 --max-windows 1 --threads 2 --json --kv auto:4.25";
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s", dir, text, common);
    cJSON *a = run_cli_json(args);
    const cJSON *r = cJSON_GetObjectItem(a, "kv_resolved");
    snprintf(sd, sizeof sd, "policy %s/%s/kv-policy-4.25.txt: ", pol, fp);
    if (!cJSON_IsString(r) || strstr(r->valuestring, sd) != r->valuestring)
        fail_msg("%s", cJSON_IsString(r) ? r->valuestring : "no kv_resolved");
    cJSON_Delete(a);
    /* a device state reads the shipped folder's .device file first (no device needed) */
    write_text(shipped, "kv-policy-4.25.device.txt", TQ4_TQ3_W4);
    tqkv_model *m = test_load_bundled(md, sizeof md);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.device = 1;
    char desc[1024];
    assert_int_equal(kvp_resolve_model("test", m, dir, "auto:4.25", 2048, &p, desc,
                                       sizeof desc), 0);
    snprintf(sd, sizeof sd, "policy %s/%s/kv-policy-4.25.device.txt: ", pol, fp);
    if (strstr(desc, sd) != desc) fail_msg("%s", desc);
    assert_int_equal(p.k_format, TQKV_TQ4);
    assert_int_equal(p.v_format, TQKV_TQ3);
    tqkv_model_free(m);
    /* a policy beside the model wins over the shipped one */
    write_text(dir, "kv-policy-4.25.txt", TQ4_TQ3_W4);
    snprintf(args, sizeof args, "ppl --model '%s' --text '%s' %s", dir, text, common);
    a = run_cli_json(args);
    r = cJSON_GetObjectItem(a, "kv_resolved");
    snprintf(sd, sizeof sd, "policy %s/kv-policy-4.25.txt: ", dir);
    if (!cJSON_IsString(r) || strstr(r->valuestring, sd) != r->valuestring)
        fail_msg("%s", cJSON_IsString(r) ? r->valuestring : "no kv_resolved");
    cJSON_Delete(a);
    unsetenv("TQKV_POLICY_DIR");
    snprintf(args, sizeof args, "rm -rf '%s' '%s'", dir, pol);
    assert_int_equal(system(args), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse), cmocka_unit_test(test_apply),
        cmocka_unit_test(test_keys_only), cmocka_unit_test(test_apply_device),
        cmocka_unit_test(test_device_policy_file),
        cmocka_unit_test(test_cli_calibrate_device),
        cmocka_unit_test(test_state_roundtrip), cmocka_unit_test(test_cli_calibrate),
        cmocka_unit_test(test_cli_auto_policy), cmocka_unit_test(test_cli_kld_reference),
        cmocka_unit_test(test_shipped_policy), cmocka_unit_test(test_shipped_policy_cli)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

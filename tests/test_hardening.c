/*
 * test_hardening.c - regressions for hostile input to the loaders and the CLI:
 *   - a FIFO in place of a shard, an index, config.json or tokenizer.json fails at once
 *     (an alarm turns a hang into a failure);
 *   - safetensors data_offsets that overlap, leave a hole or leave trailing bytes are
 *     refused; a shape whose byte count overflows says so (not "shape needs 0");
 *   - every eos_token_id of a long list is kept; a list beyond TQKV_MAX_EOS is refused;
 *   - greedy sampling refuses all-NaN / all -inf logits like the sampled path, and never
 *     picks a NaN (one at index 0 used to win);
 *   - tqkv run refuses --temp nan, --top-p nan, --top-k -3, --seed -7 and --window with
 *     a format that has no window; `tqkv bench` alone names the missing subcommand.
 * Owns: nothing but temporary files under /tmp. Must not: depend on ../shared.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "model/model_impl.h"
#include "model/load/safetensors.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

static char g_dir[256]; /* this process's scratch directory */

static const char *tmp_path(const char *name, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", g_dir, name);
    return buf;
}

static void write_file(const char *path, const void *data, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    fclose(f);
}

static void assert_error_has(const char *needle) {
    const char *e = tqkv_last_error();
    if (!strstr(e, needle)) fail_msg("error '%s' lacks '%s'", e, needle);
}

/* A safetensors file: 8-byte header length, the JSON header, `data_len` data bytes. */
static void write_st(const char *path, const char *header, size_t data_len) {
    size_t hl = strlen(header);
    size_t n = 8 + hl + data_len;
    uint8_t *b = calloc(1, n); // [8 + header + data]
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < data_len; i++) b[8 + hl + i] = (uint8_t)i;
    write_file(path, b, n);
    free(b);
}

static int setup(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/tqkv_hardening_%d", (int)getpid());
    return mkdir(g_dir, 0700) == 0 || errno == EEXIST ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "test_hardening: a loader blocked on a FIFO (alarm)\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(1);
}

static const char *TINY_CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 97, \"hidden_size\": 64,"
    " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 32, \"rms_norm_eps\": 1e-6,"
    " \"rope_theta\": 1e6, \"tie_word_embeddings\": true, \"hidden_act\": \"silu\"%s}";

// ---------------------------------------------------------------------------
// FIFOs in place of files
// ---------------------------------------------------------------------------

static void test_fifo_refused(void **state) {
    (void)state;
    signal(SIGALRM, on_alarm);
    alarm(30);
    char d[512], p[600], cfg[1024];
    // config.json is a FIFO
    snprintf(d, sizeof d, "%s/fifo_config", g_dir);
    assert_int_equal(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/config.json", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    tqkv_model *m = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    assert_int_equal(tqkv_model_load(&m, d, &lp), TQKV_EIO);
    assert_null(m);
    assert_error_has("not a regular file");

    // the single shard is a FIFO (config.json valid)
    snprintf(d, sizeof d, "%s/fifo_shard", g_dir);
    assert_int_equal(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/config.json", d);
    snprintf(cfg, sizeof cfg, TINY_CONFIG, "");
    write_file(p, cfg, strlen(cfg));
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    assert_int_equal(tqkv_model_load(&m, d, &lp), TQKV_EIO);
    assert_error_has("model.safetensors: not a regular file");

    // the shard index is a FIFO
    st_archive a;
    snprintf(d, sizeof d, "%s/fifo_index", g_dir);
    assert_int_equal(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    assert_int_equal(st_open_dir(&a, d), TQKV_EIO);
    assert_error_has("not a regular file");

    // tokenizer.json is a FIFO (as a directory entry and as a path)
    snprintf(d, sizeof d, "%s/fifo_tok", g_dir);
    assert_int_equal(mkdir(d, 0700), 0);
    snprintf(p, sizeof p, "%s/tokenizer.json", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    tqkv_tokenizer *t = NULL;
    assert_int_equal(tqkv_tokenizer_load(&t, d), TQKV_EIO);
    assert_int_equal(tqkv_tokenizer_load_file(&t, p), TQKV_EIO);
    assert_null(t);
    assert_error_has("not a regular file");
    alarm(0);
}

// ---------------------------------------------------------------------------
// safetensors data_offsets
// ---------------------------------------------------------------------------

static void test_safetensors_tiling(void **state) {
    (void)state;
    char p[600];
    st_archive a;
    tmp_path("tiling.safetensors", p, sizeof p);
    // control: two F32 tensors of 4 and 2 values tile [0, 24) exactly (listed out of order)
    write_st(p,
             "{\"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [16, 24]},"
             " \"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
             24);
    assert_int_equal(st_open_file(&a, p), TQKV_OK);
    assert_int_equal(a.n_tensors, 2);
    st_close(&a);

    // overlap: b starts inside a
    write_st(p,
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [8, 24]}}",
             24);
    assert_int_equal(st_open_file(&a, p), TQKV_ECORRUPT);
    assert_error_has("overlap");

    // the same range twice
    write_st(p,
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}",
             16);
    assert_int_equal(st_open_file(&a, p), TQKV_ECORRUPT);
    assert_error_has("overlap");

    // trailing bytes after the last tensor
    write_st(p, "{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]}}", 20);
    assert_int_equal(st_open_file(&a, p), TQKV_ECORRUPT);
    assert_error_has("4 trailing bytes");

    // a hole between tensors
    write_st(p,
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
             " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [12, 20]}}",
             20);
    assert_int_equal(st_open_file(&a, p), TQKV_ECORRUPT);
    assert_error_has("unused bytes");
}

static void test_safetensors_shape_overflow(void **state) {
    (void)state;
    char p[600];
    st_archive a;
    tmp_path("huge.safetensors", p, sizeof p);
    write_st(p,
             "{\"a\": {\"dtype\": \"F32\", \"shape\": [1099511627776, 1099511627776],"
             " \"data_offsets\": [0, 16]}}",
             16);
    assert_int_equal(st_open_file(&a, p), TQKV_ECORRUPT);
    assert_error_has("shape [1099511627776, 1099511627776] is too large");
    if (strstr(tqkv_last_error(), "needs 0")) fail_msg("%s", tqkv_last_error());
}

// ---------------------------------------------------------------------------
// eos_token_id lists
// ---------------------------------------------------------------------------

static void test_eos_list_kept(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    enum { N = 20 };
    int ids[N];
    char list[512] = ", \"eos_token_id\": [";
    for (int i = 0; i < N; i++) {
        ids[i] = rng_int(&r, 0, 96);
        size_t k = strlen(list);
        snprintf(list + k, sizeof list - k, "%s%d", i ? ", " : "", ids[i]);
    }
    strcat(list, "]");
    char cfg[2048];
    snprintf(cfg, sizeof cfg, TINY_CONFIG, list);
    tqkv_model_config c;
    assert_int_equal(model_config_parse(cfg, strlen(cfg), "config.json", &c), TQKV_OK);
    assert_int_equal(c.n_eos, N);
    for (int i = 0; i < N; i++) assert_int_equal(c.eos_ids[i], ids[i]);

    // generation_config.json's list replaces it, all of it
    char gen[512] = "{\"eos_token_id\": [";
    for (int i = 0; i < N; i++) {
        size_t k = strlen(gen);
        snprintf(gen + k, sizeof gen - k, "%s%d", i ? ", " : "", 96 - i);
    }
    strcat(gen, "]}");
    tqkv_generation_config g;
    assert_int_equal(model_generation_parse(gen, strlen(gen), "generation_config.json", &c, &g),
                     TQKV_OK);
    assert_int_equal(c.n_eos, N);
    assert_int_equal(c.eos_ids[N - 1], 96 - (N - 1));

    // more than TQKV_MAX_EOS ids: refused, never cut
    char big[4096] = ", \"eos_token_id\": [";
    for (int i = 0; i <= TQKV_MAX_EOS; i++) {
        size_t k = strlen(big);
        snprintf(big + k, sizeof big - k, "%s%d", i ? ", " : "", i % 97);
    }
    strcat(big, "]");
    char cfg2[8192];
    snprintf(cfg2, sizeof cfg2, TINY_CONFIG, big);
    assert_int_equal(model_config_parse(cfg2, strlen(cfg2), "config.json", &c), TQKV_EUNSUPPORTED);
    assert_error_has("eos_token_id");
}

// ---------------------------------------------------------------------------
// greedy sampling over non-finite logits
// ---------------------------------------------------------------------------

static void test_greedy_nonfinite(void **state) {
    (void)state;
    enum { V = 50 };
    test_rng r;
    rng_init(&r, test_seed() + 1);
    tqkv_sampler *s;
    tqkv_sampler_params p = tqkv_sampler_params_default(); // greedy
    assert_int_equal(tqkv_sampler_init(&s, &p, V), TQKV_OK);
    float lg[V];
    int tok = -1;
    // control: -inf entries are fine, the argmax wins
    int best = rng_int(&r, 0, V - 1);
    for (int i = 0; i < V; i++) lg[i] = i % 3 ? -INFINITY : (float)rng_normal(&r);
    lg[best] = 100.0f;
    assert_int_equal(tqkv_sampler_sample(s, lg, &tok), TQKV_OK);
    assert_int_equal(tok, best);
    // a NaN at index 0 (or anywhere) is never the argmax
    for (int i = 0; i < V; i++) lg[i] = (float)rng_normal(&r);
    best = rng_int(&r, 1, V - 1);
    lg[best] = 100.0f;
    lg[0] = NAN;
    assert_int_equal(tqkv_sampler_sample(s, lg, &tok), TQKV_OK);
    assert_int_equal(tok, best);
    // all NaN, all -inf, NaN and -inf mixed: refused, token untouched
    for (int c = 0; c < 3; c++) {
        for (int i = 0; i < V; i++) lg[i] = c == 0 || (c == 2 && i % 2) ? NAN : -INFINITY;
        tok = -7;
        assert_int_equal(tqkv_sampler_sample(s, lg, &tok), TQKV_EINVAL);
        assert_int_equal(tok, -7);
    }
    tqkv_sampler_free(s);
    // non-finite parameters are refused at init
    p.temperature = INFINITY;
    assert_int_equal(tqkv_sampler_init(&s, &p, V), TQKV_EINVAL);
    p.temperature = 1.0f;
    p.repetition_penalty = NAN;
    assert_int_equal(tqkv_sampler_init(&s, &p, V), TQKV_EINVAL);
}

// ---------------------------------------------------------------------------
// the CLI
// ---------------------------------------------------------------------------

/* Run `tqkv ARGS` with stderr captured; returns the exit status, output in out. */
static int run_cli(const char *args, char *out, size_t cap) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", TQKV_CLI_PATH, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_cli_refuses_bad_values(void **state) {
    (void)state;
    static const struct {
        const char *args, *needle;
    } CASES[] = {
        {"run --prompt x --temp nan", "--temp expects a finite number"},
        {"run --prompt x --temp inf", "--temp expects a finite number"},
        {"run --prompt x --top-p nan", "--top-p expects a finite number"},
        {"run --prompt x --top-p 1.5", "0 < --top-p <= 1"},
        {"run --prompt x --top-k -3", "--top-k must be >= 0"},
        {"run --prompt x --seed -7", "--seed must be >= 0"},
        {"run --prompt x --window 8 --kv f32", "no tq plane"},
        {"run --prompt x --window 8 --kv auto:4.25", "drop --window"},
        {"run --prompt x --window 8 --kv f16", "no tq plane"},
        {"ppl --text /dev/null --window 8 --kv q8", "no tq plane"},
        {"bench", "tqkv bench: missing subcommand"},
        {"bench nope", "unknown subcommand 'nope'"},
        {"bench model --fill nope", "--fill takes prefill or synthetic"},
        {"bench model --max-rows", "--max-rows measures device memory"},
        {"bench model --graphs 0,1", "--graphs needs --device cuda"},
        {"bench model --device cuda --graphs 2", "--graphs takes 0, 1, 0,1 or 1,0"},
        {"bench gemm --shapes 12x7", "tqkv bench gemm:"},
        {"serve --device tpu", "tpu"},
    };
    char out[8192];
    // control: a valid command succeeds (so a broken binary cannot pass the refusals)
    assert_int_equal(run_cli("formats --json", out, sizeof out), 0);
    assert_non_null(strstr(out, "\"tq4\""));
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        int rc = run_cli(CASES[i].args, out, sizeof out);
        if (rc != 2 || !strstr(out, CASES[i].needle))
            fail_msg("tqkv %s: rc %d, output '%s' (want rc 2 and '%s')", CASES[i].args, rc, out,
                     CASES[i].needle);
    }
    /* once the model is loaded (exit 1): the default preset says why no state can be made
     * (a rank count that splits no KV head), not that nothing fits its bits */
    int rc = run_cli("run --prompt x --tensor-parallel 3", out, sizeof out);
    if (rc != 1 || !strstr(out, "neither divides") || strstr(out, "no configuration fits"))
        fail_msg("tqkv run --tensor-parallel 3: rc %d, output '%s'", rc, out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fifo_refused),
        cmocka_unit_test(test_safetensors_tiling),
        cmocka_unit_test(test_safetensors_shape_overflow),
        cmocka_unit_test(test_eos_list_kept),
        cmocka_unit_test(test_greedy_nonfinite),
        cmocka_unit_test(test_cli_refuses_bad_values),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

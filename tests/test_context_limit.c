/*
 * test_context_limit.c - the public forward refuses to pass max_position_embeddings with
 * TQKV_ERANGE and changes nothing, on every architecture (the common preamble in
 * src/model/state/state.c), on the CPU and, where a GPU is present, on the device.
 * Checkpoints: the tiny random-weight goldens in tests/golden/ (Gemma 4, Qwen 3.5 hybrid,
 * a Llama-shaped MiniCPM5, Qwen3-MoE), the bundled Qwen3, and Qwen 3.5 MoE and Gemma 4 MoE
 * checkpoints derived from the dense goldens (moe_derive.h, in temporary directories removed
 * at the end). The loaded config's limit is lowered to a few dozen tokens (RoPE has no position
 * table, so any limit is a valid model), which keeps each case to a short prefill. A graph
 * that runs on the CPU only (Qwen 3.5 MoE, Gemma 4 MoE), or a head_dim the device kernels
 * lack, must be refused clearly on the device.
 * Owns: nothing on disk but that temporary directory. Must not: depend on ../shared.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "moe_derive.h"
#include "testutil.h"
#include "tqkv_model.h"
#ifdef TQKV_HAVE_CUDA
#include "cache/cache_cuda.h" /* tqkv_cuda_available */
#define HAVE_GPU() tqkv_cuda_available()
#else
#define HAVE_GPU() 0
#endif

#define LIMIT 48

static const char *const CHECKPOINTS[] = {
    "models/qwen3-code-28m",          /* Qwen3ForCausalLM (the Llama family's graph) */
    "tests/golden/qwen35/minicpm5",   /* LlamaForCausalLM */
    "tests/golden/gemma4/base",       /* Gemma4ForCausalLM */
    "tests/golden/qwen35/hybrid",     /* Qwen3_5ForCausalLM */
    "tests/golden/moe/qwen3moe",      /* Qwen3MoeForCausalLM */
    NULL,                             /* Qwen3_5MoeForCausalLM: derived (g_derived[0]) */
    NULL,                             /* Gemma4ForCausalLM with MoE blocks: g_derived[1] */
};
static char g_derived[2][40] = {"/tmp/tqkv_ctxlim_q35moeXXXXXX", "/tmp/tqkv_ctxlim_g4moeXXXXXX"};
#define N_CHECKPOINTS (int)(sizeof CHECKPOINTS / sizeof CHECKPOINTS[0])

#define OK(x) assert_int_equal((x), TQKV_OK)

/* CHECKPOINTS[i], or the derived checkpoint of its NULL entry (the last two). */
static tqkv_model *load(int i) {
    const char *rel = CHECKPOINTS[i];
    char dir[1024];
    if (rel)
        snprintf(dir, sizeof dir, "%s/%s", TQKV_SOURCE_DIR, rel);
    else
        snprintf(dir, sizeof dir, "%s", g_derived[i - (N_CHECKPOINTS - 2)]);
    tqkv_model *m = NULL;
    if (tqkv_model_load(&m, dir, NULL) != TQKV_OK) fail_msg("%s: %s", dir, tqkv_last_error());
    /* the limit under test: lowered in the loaded copy only */
    ((tqkv_model_config *)tqkv_model_get_config(m))->max_position_embeddings = LIMIT;
    return m;
}

static void positions(const tqkv_model_state *s, int rows, int *out) {
    OK(tqkv_model_state_offsets(s, out));
    (void)rows;
}

/* One checkpoint on one device: every way past the limit is refused, nothing changes, and
 * the state still runs up to the limit exactly. */
static void check_limit(tqkv_model *m, int device, test_rng *rng) {
    const int V = tqkv_model_get_config(m)->vocab_size, R = 2;
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = R;
    p.device = device;
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, m, &p));
    int32_t tok[2 * (LIMIT + 1)];
    for (int i = 0; i < 2 * (LIMIT + 1); i++) tok[i] = rng_int(rng, 3, V - 1);
    float *logits = malloc(sizeof(float) * (size_t)R * (LIMIT + 1) * V);
    assert_non_null(logits);

    /* a prefill one token past the limit, in either row */
    int len[2] = {LIMIT, LIMIT + 1};
    assert_int_equal(tqkv_model_prefill(m, s, tok, len, LIMIT + 1, TQKV_LOGITS_LAST, logits),
                     TQKV_ERANGE);
    assert_non_null(strstr(tqkv_last_error(), "max_position_embeddings"));
    int pos[2];
    positions(s, R, pos);
    assert_int_equal(pos[0], 0);
    assert_int_equal(pos[1], 0);

    /* up to the limit minus 3, then an extend of 4 and a decode at the limit */
    const int n0 = LIMIT - 3;
    OK(tqkv_model_prefill(m, s, tok, NULL, n0, TQKV_LOGITS_LAST, logits));
    assert_int_equal(tqkv_model_extend(m, s, tok, 4, TQKV_LOGITS_ALL, logits), TQKV_ERANGE);
    positions(s, R, pos);
    assert_int_equal(pos[0], n0);
    assert_int_equal(pos[1], n0);
    OK(tqkv_model_extend(m, s, tok, 3, TQKV_LOGITS_ALL, logits)); /* exactly to the limit */
    assert_int_equal(tqkv_model_decode(m, s, tok, logits), TQKV_ERANGE);
    positions(s, R, pos);
    assert_int_equal(pos[0], LIMIT);
    assert_int_equal(pos[1], LIMIT);
    free(logits);
    tqkv_model_state_free(s);
}

static void test_cpu(void **state) {
    (void)state;
    test_rng rng;
    rng_init(&rng, test_seed());
    for (int i = 0; i < N_CHECKPOINTS; i++) {
        tqkv_model *m = load(i);
        check_limit(m, 0, &rng);
        tqkv_model_free(m);
    }
}

static void test_device(void **state) {
    (void)state;
    if (!HAVE_GPU()) {
        print_message("no CUDA device (or a build without it): the device cases are skipped\n");
        skip();
        return;
    }
    test_rng rng;
    rng_init(&rng, test_seed());
    for (int i = 0; i < N_CHECKPOINTS; i++) {
        tqkv_model *m = load(i);
        tqkv_model_state_params p = tqkv_model_state_params_default();
        p.device = 1;
        tqkv_model_state *s = NULL;
        const tqkv_status rc = tqkv_model_state_init(&s, m, &p);
        /* a refusal the device states clearly: a CPU-only graph, or a head_dim the
         * common device graph has no kernels for (the tiny goldens' 32 / 64) */
        if (rc == TQKV_EUNSUPPORTED && (strstr(tqkv_last_error(), "CPU only") ||
                                        strstr(tqkv_last_error(), "head_dim"))) {
            print_message("%s: %s\n", CHECKPOINTS[i] ? CHECKPOINTS[i] : "(derived)",
                          tqkv_last_error());
        } else {
            OK(rc);
            tqkv_model_state_free(s);
            check_limit(m, 1, &rng);
        }
        tqkv_model_free(m);
    }
}

int main(void) {
    if (!mkdtemp(g_derived[0]) || !mkdtemp(g_derived[1])) {
        perror("mkdtemp");
        return 1;
    }
    const derive_spec d = {4, 2, 16, 24, 1, 0, 7, 0};
    derive_qwen35moe(g_derived[0], &d);
    const derive_g4_spec d4 = {4, 2, 16, 0, 8};
    derive_gemma4moe(g_derived[1], &d4);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu),
        cmocka_unit_test(test_device),
    };
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    derive_remove(g_derived[0]);
    derive_remove(g_derived[1]);
    return rc;
}

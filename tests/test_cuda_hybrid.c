/*
 * test_cuda_hybrid.c - the Qwen 3.5 hybrid graph (gated DeltaNet + gated attention) on the
 * GPU (tqkv_model_state_params.device = 1) against the CPU state, through the public
 * model-state API, on the fixture ../shared/models/qwen35-code-hybrid-30m (8 layers, 3 and
 * 7 full attention, the others linear; 4 q / 2 KV heads of 128; vocab 8192):
 *  - prefill (every position) and greedy decode logits, GPU vs CPU, for f32 (dense bf16
 *    cache on the device), tq4 and tq3, 3 rows, within a stated relative L2, every argmax
 *    flip a near-tie within the position's error (device_twin.h);
 *  - batch invariance on the device: a row alone and as row 1 of 3, bitwise;
 *  - spec rounds (extend_as_decode): the window's logits equal single decodes, a per-row
 *    rollback equals the rows run without the rejected tokens, a commit equals the
 *    tokens decoded one by one, bitwise; offsets base + keep;
 *  - filter, merge and extract mid-generation: every row bitwise equal to its sequence
 *    run alone from scratch, offsets as expected;
 *  - export / import: device -> device and device -> CPU byte for byte, decoding on from a
 *    device import bitwise, from a CPU import within the parity tolerance; a CPU export
 *    of the same tokens has the device export's layout and imports on the device;
 *  - decode steps as CUDA graphs (also inside a spec round) equal kernel by kernel;
 *  - misuse (rollback without a round, padded prefill, f32 export) refused, nothing
 *    changed.
 * Exits 77 (skipped) when the build has no CUDA, no GPU is present or the fixture is absent.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tqkv_model.h"
#include "engine_helpers.h"
#include "model_helpers.h"

#ifdef TQKV_HAVE_CUDA
#include "cache/cache_cuda.h"
#include "model/model_impl.h"
#include "model/cuda/model_cuda.h"

static tqkv_model *g_model;
static uint64_t    g_seed;
static int         g_V;

#define TWIN_MODEL   g_model
#define TWIN_V       g_V
#define TWIN_THREADS 4
#include "device_twin.h"

// ---------------------------------------------------------------------------
// Parity: device vs CPU, 3 rows, prefill of every position + greedy decode
// ---------------------------------------------------------------------------

/* Tolerances as test_cuda_model's: the device GEMM uses bf16 weights and a bf16 hi + lo
 * split of the activations (another summation order, not the CPU's bits); f32 runs on a
 * bf16 device cache; tq decode on fp16 tensor cores. The recurrent rows carry the
 * difference forward token by token, so the decode steps are the sharper check. */
static void parity(tqkv_format f, double tol_med, double tol_worst) {
    enum { R = 3, N = 48, STEPS = 8 };
    const int V = g_V;
    test_rng r;
    rng_init(&r, g_seed ^ 0x9a41 ^ (uint64_t)f * 77);
    int32_t tok[R * N];
    random_tokens(&r, tok, (size_t)R * N);
    float *lg = malloc(sizeof(float) * (size_t)R * N * V), *lc = malloc(sizeof(float) * (size_t)R * N * V);
    tqkv_model_state *sg = new_state(R, f, 1), *sc = new_state(R, f, 0);
    OK(tqkv_model_prefill(g_model, sg, tok, NULL, N, TQKV_LOGITS_ALL, lg));
    OK(tqkv_model_prefill(g_model, sc, tok, NULL, N, TQKV_LOGITS_ALL, lc));
    char what[96];
    snprintf(what, sizeof what, "%s: prefill %d x %d positions", tqkv_format_name(f), R, N);
    expect_close(what, lg, lc, R * N, tol_med, tol_worst);
    /* decode: both take the CPU's greedy token, so they stay on the same sequence */
    twin_greedy(sg, sc, R, lc + (size_t)(N - 1) * V, (size_t)N * V, STEPS, lg, lc);
    snprintf(what, sizeof what, "%s: decode %d steps x %d rows", tqkv_format_name(f), STEPS, R);
    expect_close(what, lg, lc, STEPS * R, tol_med, tol_worst);
    const int want[R] = {N + STEPS, N + STEPS, N + STEPS};
    expect_offsets(sg, want, "device after decode");
    expect_offsets(sc, want, "CPU after decode");
    tqkv_model_state_free(sg);
    tqkv_model_state_free(sc);
    free(lg);
    free(lc);
}

static void test_parity_f32(void **st) { (void)st; parity(TQKV_F32, 1e-2, 3e-2); }
static void test_parity_tq4(void **st) { (void)st; parity(TQKV_TQ4, 1e-2, 1e-1); }
static void test_parity_tq3(void **st) { (void)st; parity(TQKV_TQ3, 1e-2, 1e-1); }

// ---------------------------------------------------------------------------
// Batch invariance on the device: row 1 of 3 == the row alone, bitwise
// ---------------------------------------------------------------------------

static void invariance(tqkv_format f) {
    enum { R = 3, N = 37, STEPS = 4 };
    const int V = g_V;
    test_rng r;
    rng_init(&r, g_seed ^ 0x1a7a ^ (uint64_t)f);
    int32_t tok[R * N], step[STEPS][R];
    random_tokens(&r, tok, (size_t)R * N);
    random_tokens(&r, &step[0][0], (size_t)STEPS * R);
    float *l1 = malloc(sizeof(float) * (size_t)N * V), *lb = malloc(sizeof(float) * (size_t)R * N * V);
    tqkv_model_state *s1 = new_state(1, f, 1), *sb = new_state(R, f, 1);
    OK(tqkv_model_prefill(g_model, s1, tok + N, NULL, N, TQKV_LOGITS_ALL, l1));
    OK(tqkv_model_prefill(g_model, sb, tok, NULL, N, TQKV_LOGITS_ALL, lb));
    expect_same(l1, lb + (size_t)N * V, (size_t)N * V, "prefill: row alone vs row 1 of 3", N);
    for (int t = 0; t < STEPS; t++) {
        OK(tqkv_model_decode(g_model, s1, &step[t][1], l1));
        OK(tqkv_model_decode(g_model, sb, step[t], lb));
        expect_same(l1, lb + V, (size_t)V, "decode step: row alone vs row 1 of 3", t);
    }
    assert_true(memcmp(lb, lb + V, sizeof(float) * (size_t)V) != 0); /* the rows do differ */
    printf("%s: row alone == row 1 of 3, bitwise (prefill %d, decode %d)\n", tqkv_format_name(f), N, STEPS);
    tqkv_model_state_free(s1);
    tqkv_model_state_free(sb);
    free(l1);
    free(lb);
}

static void test_invariance_tq4(void **st) { (void)st; invariance(TQKV_TQ4); }
static void test_invariance_f32(void **st) { (void)st; invariance(TQKV_F32); }

// ---------------------------------------------------------------------------
// Spec rounds: rollback with per-row keep, commit (the recurrent snapshots)
// ---------------------------------------------------------------------------

static tqkv_model_state *spec_state(int rows, int as_decode, int graphs) {
    tqkv_model_state_params p = hparams(1, TQKV_TQ4, rows);
    p.extend_as_decode = as_decode;
    p.device_graphs = graphs;
    return mk(&p);
}

/* A 3-row round (extend 4, keep {1, 4, 0}) and a committed round (extend 3), each row
 * against a 1-row device state that decoded only the kept tokens. */
static void test_spec_rounds(void **st) {
    (void)st;
    enum { R = 3, N = 29, W = 4, C = 3 };
    const int V = g_V;
    test_rng r;
    rng_init(&r, g_seed ^ 0x5bec);
    int32_t prompt[R * N], win[R * W], com[R * C], t1[R], t2[R];
    random_tokens(&r, prompt, (size_t)R * N);
    random_tokens(&r, win, (size_t)R * W);
    random_tokens(&r, com, (size_t)R * C);
    random_tokens(&r, t1, R);
    random_tokens(&r, t2, R);
    tqkv_model_state *run = spec_state(R, 1, 1), *ref[R];
    OK(tqkv_model_prefill(g_model, run, prompt, NULL, N, TQKV_LOGITS_NONE, NULL));
    for (int i = 0; i < R; i++) {
        ref[i] = spec_state(1, 0, 1);
        OK(tqkv_model_prefill(g_model, ref[i], prompt + i * N, NULL, N, TQKV_LOGITS_NONE, NULL));
    }
    float *lw = malloc(sizeof(float) * (size_t)R * W * V), *lb = malloc(sizeof(float) * (size_t)V);
    /* the round: 4 tokens per row appended, then keep {1, 4, 0} */
    const int keep[R] = {1, W, 0};
    int want[R] = {N + W, N + W, N + W};
    OK(tqkv_model_state_spec_begin(run));
    assert_int_equal(tqkv_model_state_spec_active(run), 1);
    OK(tqkv_model_extend(g_model, run, win, W, TQKV_LOGITS_ALL, lw));
    expect_offsets(run, want, "inside the round");
    OK(tqkv_model_state_spec_rollback(run, keep, R));
    assert_int_equal(tqkv_model_state_spec_active(run), 0);
    for (int i = 0; i < R; i++) want[i] = N + keep[i];
    expect_offsets(run, want, "after rollback {1, 4, 0}");
    /* kept positions: the verification logits equal the reference's single decodes */
    for (int i = 0; i < R; i++)
        for (int j = 0; j < keep[i]; j++) {
            OK(tqkv_model_decode(g_model, ref[i], &win[i * W + j], lb));
            expect_same(lw + ((size_t)i * W + j) * V, lb, (size_t)V, "window position vs single decode", j);
        }
    /* the next decode: each row as if the rejected tokens were never seen (a recurrent row
     * restored from the wrong snapshot, or not at all, differs here) */
    OK(tqkv_model_decode(g_model, run, t1, lw));
    for (int i = 0; i < R; i++) {
        OK(tqkv_model_decode(g_model, ref[i], &t1[i], lb));
        expect_same(lw + (size_t)i * V, lb, (size_t)V, "after rollback: row vs the row without the rejected tokens", i);
        want[i]++;
    }
    /* a committed round: extend 3 == the 3 tokens decoded one at a time */
    OK(tqkv_model_state_spec_begin(run));
    OK(tqkv_model_extend(g_model, run, com, C, TQKV_LOGITS_ALL, lw));
    OK(tqkv_model_state_spec_commit(run));
    assert_int_equal(tqkv_model_state_spec_active(run), 0);
    for (int i = 0; i < R; i++) {
        want[i] += C;
        for (int j = 0; j < C; j++) {
            OK(tqkv_model_decode(g_model, ref[i], &com[i * C + j], lb));
            expect_same(lw + ((size_t)i * C + j) * V, lb, (size_t)V, "committed window vs single decode", j);
        }
    }
    expect_offsets(run, want, "after commit");
    OK(tqkv_model_decode(g_model, run, t2, lw));
    for (int i = 0; i < R; i++) {
        OK(tqkv_model_decode(g_model, ref[i], &t2[i], lb));
        expect_same(lw + (size_t)i * V, lb, (size_t)V, "after commit: row vs single decodes", i);
        expect_offsets(ref[i], &(int){want[i] + 1}, "reference row");
    }
    assert_true(memcmp(lw, lw + V, sizeof(float) * (size_t)V) != 0); /* the rows do differ */
    printf("tq4 spec rounds: rollback keep {1, 4, 0} and commit of 3 == single decodes, bitwise\n");
    tqkv_model_state_free(run);
    for (int i = 0; i < R; i++) tqkv_model_state_free(ref[i]);
    free(lw);
    free(lb);
}

// ---------------------------------------------------------------------------
// Row operations: filter, merge, extract (the recurrent rows move with the KV rows)
// ---------------------------------------------------------------------------

/* Five sequences: A's three rows (24 tokens) and B's two (15: merged, they are left
 * padded). Each has a 1-row reference state that decodes its tokens alone. */
enum { NSEQ = 5, RSTEPS = 8 };
typedef struct {
    tqkv_model_state *ref[NSEQ];
    int32_t gen[NSEQ][RSTEPS];
    int     plen[NSEQ], cnt[NSEQ];
    float  *la, *lb;
} rows_ctx;

/* One decode step of s, whose rows are sequences seq[0..n): every row bitwise equal to its
 * reference taking the same token; then the offsets. */
static void rows_step(rows_ctx *c, tqkv_model_state *s, const int *seq, int n, const char *phase) {
    int32_t tk[NSEQ];
    int want[NSEQ];
    assert_int_equal(tqkv_model_state_rows(s), n);
    for (int i = 0; i < n; i++) tk[i] = c->gen[seq[i]][c->cnt[seq[i]]];
    OK(tqkv_model_decode(g_model, s, tk, c->la));
    for (int i = 0; i < n; i++) {
        OK(tqkv_model_decode(g_model, c->ref[seq[i]], &tk[i], c->lb));
        if (memcmp(c->la + (size_t)i * g_V, c->lb, sizeof(float) * (size_t)g_V))
            fail_msg("%s: row %d (sequence %d) differs from the sequence run alone", phase, i, seq[i]);
        want[i] = c->plen[seq[i]] + ++c->cnt[seq[i]];
    }
    expect_offsets(s, want, phase);
}

static void test_rows(void **st) {
    (void)st;
    rows_ctx c = {.plen = {24, 24, 24, 15, 15}};
    test_rng r;
    rng_init(&r, g_seed ^ 0x40a5);
    int32_t pa[3 * 24], pb[2 * 15];
    random_tokens(&r, pa, sizeof pa / sizeof pa[0]);
    random_tokens(&r, pb, sizeof pb / sizeof pb[0]);
    random_tokens(&r, &c.gen[0][0], (size_t)NSEQ * RSTEPS);
    c.la = malloc(sizeof(float) * NSEQ * (size_t)g_V);
    c.lb = malloc(sizeof(float) * (size_t)g_V);
    for (int k = 0; k < NSEQ; k++) {
        c.ref[k] = new_state(1, TQKV_TQ4, 1);
        const int32_t *p = k < 3 ? pa + k * 24 : pb + (k - 3) * 15;
        OK(tqkv_model_prefill(g_model, c.ref[k], p, NULL, c.plen[k], TQKV_LOGITS_NONE, NULL));
    }
    tqkv_model_state *a = new_state(3, TQKV_TQ4, 1), *b = new_state(2, TQKV_TQ4, 1), *x = NULL;
    OK(tqkv_model_prefill(g_model, a, pa, NULL, 24, TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_prefill(g_model, b, pb, NULL, 15, TQKV_LOGITS_NONE, NULL));
    rows_step(&c, a, (const int[]){0, 1, 2}, 3, "A before the row operations");
    rows_step(&c, b, (const int[]){3, 4}, 2, "B before the row operations");
    /* filter: keep {2, 0} */
    OK(tqkv_model_state_filter(a, (const int[]){2, 0}, 2));
    rows_step(&c, a, (const int[]){2, 0}, 2, "after filter {2, 0}");
    rows_step(&c, b, (const int[]){3, 4}, 2, "B");
    /* merge: A's rows, then B's (other lengths); B is unchanged */
    OK(tqkv_model_state_merge(a, &b, 1));
    expect_offsets(b, (const int[]){15 + 2, 15 + 2}, "merge source");
    rows_step(&c, a, (const int[]){2, 0, 3, 4}, 4, "after merge A + B");
    /* extract row 1 (sequence 0); A itself keeps all 4 rows, then drops it by a filter */
    OK(tqkv_model_state_extract_row(a, 1, &x));
    assert_int_equal(tqkv_model_state_rows(a), 4);
    expect_offsets(x, (const int[]){24 + 3}, "extracted row");
    OK(tqkv_model_state_filter(a, (const int[]){0, 2, 3}, 3));
    rows_step(&c, x, (const int[]){0}, 1, "extracted row 1");
    rows_step(&c, a, (const int[]){2, 3, 4}, 3, "after extract + filter {0, 2, 3}");
    printf("device rows: filter, merge, extract mid-generation == each sequence alone, bitwise\n");
    tqkv_model_state_free(a);
    tqkv_model_state_free(b);
    tqkv_model_state_free(x);
    for (int k = 0; k < NSEQ; k++) tqkv_model_state_free(c.ref[k]);
    free(c.la);
    free(c.lb);
}

// ---------------------------------------------------------------------------
// Export / import: the host format, device <-> CPU
// ---------------------------------------------------------------------------


static void test_export_import(void **st) {
    (void)st;
    enum { R = 2, N = 40, STEPS = 8 };
    const int V = g_V, L = tqkv_model_get_config(g_model)->n_layers;
    const tqkv_model_config *cfg = tqkv_model_get_config(g_model);
    test_rng r;
    rng_init(&r, g_seed ^ 0xe4b0);
    int32_t tok[R * N], two[2][R], next[R];
    random_tokens(&r, tok, (size_t)R * N);
    random_tokens(&r, &two[0][0], 2 * R);
    const tqkv_model_state_params pd = hparams(1, TQKV_TQ4, R), pc = hparams(0, TQKV_TQ4, R);
    tqkv_model_state *dev = mk(&pd), *cpu = mk(&pc), *di = NULL, *ci = NULL, *dc = NULL;
    float *la = malloc(sizeof(float) * (size_t)R * V), *lb = malloc(sizeof(float) * (size_t)R * V);
    float *g = malloc(sizeof(float) * (size_t)STEPS * R * V), *c = malloc(sizeof(float) * (size_t)STEPS * R * V);
    OK(tqkv_model_prefill(g_model, dev, tok, NULL, N, TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_prefill(g_model, cpu, tok, NULL, N, TQKV_LOGITS_NONE, NULL));
    for (int t = 0; t < 2; t++) {
        OK(tqkv_model_decode(g_model, dev, two[t], la));
        OK(tqkv_model_decode(g_model, cpu, two[t], lb));
    }
    size_t dl = 0, cl = 0;
    uint8_t *d = export_of(dev, &dl), *h = export_of(cpu, &cl);
    /* the layout: a section per layer (empty for the linear ones), then the recurrent rows;
     * the CPU's export of the same tokens has the same sizes (the floats differ slightly) */
    uint64_t sd[TQKV_MAX_LAYERS + 1], sc[TQKV_MAX_LAYERS + 1];
    sections(d, dl, L, sd);
    sections(h, cl, L, sc);
    assert_int_equal(dl, cl);
    assert_memory_equal(d, h, 16); /* magic, layers, rows */
    for (int l = 0; l <= L; l++) {
        assert_int_equal(sd[l], sc[l]);
        const int empty = l < L && cfg->layer_type[l] == TQKV_LAYER_LINEAR;
        if ((sd[l] == 0) != empty)
            fail_msg("export: section %d has %llu bytes (%s)", l, (unsigned long long)sd[l],
                     empty ? "a linear layer: none expected" : "expected some");
    }
    /* device export -> device and CPU imports, both export the same bytes again */
    OK(tqkv_model_state_import(&di, g_model, &pd, d, dl));
    OK(tqkv_model_state_import(&ci, g_model, &pc, d, dl));
    assert_export_equal(di, d, dl, "device export imported on the device");
    assert_export_equal(ci, d, dl, "device export imported on the CPU");
    const int want[R] = {N + 2, N + 2};
    expect_offsets(di, want, "device import");
    expect_offsets(ci, want, "CPU import");
    /* decoding on (greedy tokens of the original): the device import bitwise, the CPU
     * import within the parity tolerance */
    for (int i = 0; i < R; i++) next[i] = argmax(la + (size_t)i * V, V);
    for (int t = 0; t < STEPS; t++) {
        float *gt = g + (size_t)t * R * V;
        OK(tqkv_model_decode(g_model, dev, next, gt));
        OK(tqkv_model_decode(g_model, di, next, lb));
        OK(tqkv_model_decode(g_model, ci, next, c + (size_t)t * R * V));
        expect_same(gt, lb, (size_t)R * V, "device import vs the original, decode step", t);
        for (int i = 0; i < R; i++) next[i] = argmax(gt + (size_t)i * V, V);
    }
    expect_close("tq4: decode after a CPU import of the device export", g, c, STEPS * R, 1e-2, 1e-1);
    /* the CPU export imported on the device: same bytes back, and it decodes */
    OK(tqkv_model_state_import(&dc, g_model, &pd, h, cl));
    assert_export_equal(dc, h, cl, "CPU export imported on the device");
    expect_offsets(dc, want, "device import of the CPU export");
    OK(tqkv_model_decode(g_model, dc, two[0], la));
    printf("device export / import: %zu bytes, %d layer sections + recurrent rows (%llu bytes); "
           "device <-> CPU byte for byte\n", dl, L, (unsigned long long)sd[L]);
    tqkv_model_state_free(dev);
    tqkv_model_state_free(cpu);
    tqkv_model_state_free(di);
    tqkv_model_state_free(ci);
    tqkv_model_state_free(dc);
    free(d); free(h); free(la); free(lb); free(g); free(c);
}

// ---------------------------------------------------------------------------
// CUDA graphs: decode steps replayed == kernel by kernel (also inside a spec round)
// ---------------------------------------------------------------------------


static void graphs_case(tqkv_format f) {
    enum { R = 2, N = 30 };
    test_rng r;
    rng_init(&r, g_seed ^ 0x69a9 ^ (uint64_t)f);
    int32_t prompt[R * N];
    random_tokens(&r, prompt, (size_t)R * N);
    twin_graphs tg = twin_graphs_init(f, 0, R, prompt, N);
    tqkv_model_state *const *s = tg.s;
    float *l0 = malloc(sizeof(float) * R * (size_t)g_V), *l1 = malloc(sizeof(float) * R * (size_t)g_V);
    assert_int_equal(graph_stats(s[0]).enabled, 0);
    assert_int_equal(graph_stats(s[1]).enabled, 1);
    twin_steps(s, 6, &r, l0, l1, "decode, graphs vs kernel by kernel");
    const model_cuda_graph_stats g6 = graph_stats(s[1]);
    /* the twin did replay (else this compares two direct runs) */
    if (g6.captures < 1 || g6.replays < 1)
        fail_msg("%s: %llu captures, %llu replays in 6 decode steps: the steps did not run as graphs",
                 tqkv_format_name(f), (unsigned long long)g6.captures, (unsigned long long)g6.replays);
    /* inside a spec round: 3 single steps, rollback to 1, 2 more */
    for (int tw = 0; tw < 2; tw++) OK(tqkv_model_state_spec_begin(s[tw]));
    twin_steps(s, 3, &r, l0, l1, "decode inside a spec round");
    const int keep = 1;
    for (int tw = 0; tw < 2; tw++) OK(tqkv_model_state_spec_rollback(s[tw], &keep, 1));
    expect_offsets(s[1], (const int[]){N + 7, N + 7}, "graph twin after rollback");
    twin_steps(s, 2, &r, l0, l1, "decode after the rollback");
    assert_true(memcmp(l1, l1 + g_V, sizeof(float) * (size_t)g_V) != 0); /* the rows do differ */
    const model_cuda_graph_stats ga = graph_stats(s[1]), gk = graph_stats(s[0]);
    assert_int_equal(gk.captures + gk.replays, 0);
    printf("%s: 11 decode steps with graphs == kernel by kernel, bitwise (graphs: %llu captured, "
           "%llu replayed, %llu direct)\n", tqkv_format_name(f), (unsigned long long)ga.captures,
           (unsigned long long)ga.replays, (unsigned long long)ga.direct);
    twin_graphs_free(&tg);
    free(l0);
    free(l1);
}

static void test_graphs_tq4(void **st) { (void)st; graphs_case(TQKV_TQ4); }
static void test_graphs_f32(void **st) { (void)st; graphs_case(TQKV_F32); }

// ---------------------------------------------------------------------------
// Misuse: refused, nothing changed
// ---------------------------------------------------------------------------

static void test_errors(void **st) {
    (void)st;
    enum { R = 2, N = 12 };
    const int V = g_V;
    test_rng r;
    rng_init(&r, g_seed ^ 0xe770);
    int32_t tok[R * N], t1[R];
    random_tokens(&r, tok, (size_t)R * N);
    random_tokens(&r, t1, R);
    float *la = malloc(sizeof(float) * (size_t)R * N * V), *lb = malloc(sizeof(float) * (size_t)R * N * V);
    /* rollback / commit without a round: TQKV_ESTATE; the state decodes (and exports) as
     * its twin that never saw the calls */
    tqkv_model_state *s = new_state(R, TQKV_TQ4, 1), *t = new_state(R, TQKV_TQ4, 1);
    OK(tqkv_model_prefill(g_model, s, tok, NULL, N, TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_prefill(g_model, t, tok, NULL, N, TQKV_LOGITS_NONE, NULL));
    size_t tl = 0;
    uint8_t *tb = export_of(t, &tl);
    const int zero = 0;
    assert_int_equal(tqkv_model_state_spec_rollback(s, &zero, 1), TQKV_ESTATE);
    assert_non_null(strstr(tqkv_last_error(), "no spec round"));
    assert_int_equal(tqkv_model_state_spec_commit(s), TQKV_ESTATE);
    assert_int_equal(tqkv_model_state_spec_active(s), 0);
    expect_offsets(s, (const int[]){N, N}, "after a refused rollback");
    assert_export_equal(s, tb, tl, "after a refused rollback");
    OK(tqkv_model_decode(g_model, s, t1, la));
    OK(tqkv_model_decode(g_model, t, t1, lb));
    expect_same(la, lb, (size_t)R * V, "decode after a refused rollback vs a state without it", 0);
    free(tb);
    tqkv_model_state_free(s);
    tqkv_model_state_free(t);
    /* a padded prefill (lengths differ): refused, offsets 0; the state then prefills as a
     * fresh one, bit for bit (no recurrent row was touched) */
    s = new_state(R, TQKV_TQ4, 1);
    t = new_state(R, TQKV_TQ4, 1);
    const int lengths[R] = {N, N - 4};
    assert_int_equal(tqkv_model_prefill(g_model, s, tok, lengths, N, TQKV_LOGITS_LAST, la),
                     TQKV_EUNSUPPORTED);
    expect_offsets(s, (const int[]){0, 0}, "after a refused padded prefill");
    OK(tqkv_model_prefill(g_model, s, tok, NULL, N, TQKV_LOGITS_ALL, la));
    OK(tqkv_model_prefill(g_model, t, tok, NULL, N, TQKV_LOGITS_ALL, lb));
    expect_same(la, lb, (size_t)R * N * V, "prefill after a refused padded prefill vs a fresh state", 0);
    tqkv_model_state_free(s);
    tqkv_model_state_free(t);
    /* f32 runs on the dense bf16 device cache, which has no state format */
    s = new_state(1, TQKV_F32, 1);
    OK(tqkv_model_prefill(g_model, s, tok, NULL, 5, TQKV_LOGITS_NONE, NULL));
    uint8_t *fb = NULL;
    size_t fl = 0;
    assert_int_equal(tqkv_model_state_export(s, &fb, &fl), TQKV_EUNSUPPORTED);
    assert_null(fb);
    tqkv_model_state_free(s);
    printf("device hybrid: rollback / commit without a round, padded prefill, f32 export "
           "refused; nothing changed\n");
    free(la);
    free(lb);
}

int main(void) {
    if (!tqkv_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    char d[1024];
    if (!shared_path("models/qwen35-code-hybrid-30m/config.json", d, sizeof d)) {
        printf("SKIPPED: fixture ../shared/models/qwen35-code-hybrid-30m absent\n");
        return 77;
    }
    *strrchr(d, '/') = 0;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.threads = 4;
    if (tqkv_model_load(&g_model, d, &lp) != TQKV_OK) {
        fprintf(stderr, "load failed: %s\n", tqkv_last_error());
        return 1;
    }
    const tqkv_model_config *cfg = tqkv_model_get_config(g_model);
    if (cfg->arch != TQKV_ARCH_QWEN35 || cfg->n_linear == 0 || cfg->n_linear == cfg->n_layers) {
        fprintf(stderr, "%s is not a hybrid Qwen 3.5 model (%s, %d linear of %d layers)\n", d,
                cfg->arch_name, cfg->n_linear, cfg->n_layers);
        return 1;
    }
    g_V = cfg->vocab_size;
    g_seed = test_seed();
    /* the device graph refuses Qwen 3.5 until this test has passed on a GPU (forward_cuda.cu) */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity_f32),
        cmocka_unit_test(test_parity_tq4),
        cmocka_unit_test(test_parity_tq3),
        cmocka_unit_test(test_invariance_tq4),
        cmocka_unit_test(test_invariance_f32),
        cmocka_unit_test(test_spec_rounds),
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_export_import),
        cmocka_unit_test(test_graphs_tq4),
        cmocka_unit_test(test_graphs_f32),
        cmocka_unit_test(test_errors),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tqkv_model_free(g_model);
    return rc;
}
#else
int main(void) {
    printf("SKIPPED: built without CUDA\n");
    return 77;
}
#endif

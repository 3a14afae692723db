/*
 * test_cuda_tp.c - tensor parallelism on the GPU (issue 25; docs/TP.md): the sharded device
 * forward (src/model/cuda/tp_cuda.cu) on the bundled model (models/qwen3-code-28m, or the
 * directory in TQKV_TEST_MODEL), every rank on GPU rank % visible GPUs, fresh random tokens:
 *  - the collectives: the NCCL backend's self check at n = 1 (and n = visible GPUs when
 *    >= 2, else SKIPPED), the device-local backend's (n ranks on GPU 0) at n = 1, 2, 3, 4, 8:
 *    bit for bit the host rank-order sum and the sent blocks;
 *  - N = 1 (TQKV_TP_ONE_RANK=1: the NCCL all-reduce path with one rank) against the
 *    unsharded device state: prefill logits of every position and decode logits within a
 *    relative L2 of 1e-6 (bitwise is expected; printed);
 *  - N = 2 and 4 on one GPU (the device-local backend; N = 4 replicates the model's 2 KV
 *    heads) against the unsharded device state and against the CPU sharded forward of the
 *    same N, f32 and tq4 KV: within test_cuda_model's CPU / GPU parity bounds; greedy tokens
 *    equal to the unsharded device state's over 16 decode steps;
 *  - batch invariance for a fixed N: a row alone and as row 1 of 3 (other rows, other
 *    tokens; the same length: the device refuses padded prefill and sharded device states
 *    have no merge) give the same bits, prefill and decodes;
 *  - each rank's cache bytes are its KV heads' share of the unsharded state's;
 *  - row operations on N = 2 sharded device states (both ranks on GPU 0 or on GPUs 0 and 1),
 *    as test_tp_rows does on the CPU: merge, filter (in order and reordered, to no rows and
 *    back), extract: every row then decodes the bits of the same row decoded alone in its
 *    own sharded device state (tq4 and f32 KV); spec rounds (a verification window, a
 *    per-row rollback, a commit) give the bits of the same operations on the rows alone;
 *    export / import (tq4): "TQKVTP01", the import decodes as the rows alone and exports the
 *    same bytes;
 *  - refusals change nothing on any rank: a merge past the device's row limit (CUDA_MAX_ROWS:
 *    cannot fit; refused by rank 0's build), a source of another N, bad keeps, a rollback
 *    outside a round or with a keep past what a row appended, an export of f32 KV, and rank
 *    1's device build failing after rank 0's succeeded (TQKV_TP_FAIL_RANK=1: merge, filter
 *    in order and reordered, spec begin);
 *  - the engine at N = 2 on the device: requests joining a running batch give the tokens and
 *    logprob bits they give alone, with an unsharded device draft too, a prefix-cache hit
 *    (memory, and the directory after a restart: export / import) equals a miss, and the
 *    greedy tokens equal the unsharded device engine's; a sharded device draft
 *    (draft_tensor_parallel 2 and -1) gives the tokens and logprob bits of no draft;
 *  - reset works and a second prefill gives the first one's bits;
 *  - the sharded decode step as one CUDA graph (TQKV_TP_GRAPHS=1, opt in) gives the direct
 *    steps' bits (3 rows, N = 2, tq4, 12 steps), captured and replayed;
 *  - the model's sharded device states of one N share one communicator, freed with the
 *    last; a decode graph is captured again (not replayed) after another state's longer
 *    prefill moved the shared scratch, and its steps keep the direct steps' bits;
 *  - the other graphs (issue 25 item 1: Qwen 3.5 hybrid and Gemma 4 on the ../shared fixtures,
 *    SKIPPED without them; Qwen3-MoE, Qwen 3.5 MoE and Gemma 4 MoE on checkpoints written here
 *    by moe_ckpt.h), each: N = 1 through NCCL bitwise the unsharded device state (every
 *    prefill and decode position), N = 2 on one GPU against the unsharded device state and
 *    the CPU sharded forward (f32 and tq4 KV; Gemma 4's CPU / GPU bounds are
 *    test_cuda_gemma4's), greedy equal, each rank's cache bytes half; batch invariance at
 *    N = 2 bitwise; row operations, spec rounds and export / import at N = 2 (tq4) against
 *    the rows alone, bitwise; the sharded decode graph as above; the engine at N = 2 as
 *    above (the graph's own model as the unsharded device draft) and its prefix cache
 *    (the fixtures only: the written checkpoints have no tokenizer, SKIPPED).
 * Prints "PASS" / "FAIL" per case (cmocka's [ OK ] / [ FAILED ]). Exits 77 (skipped) when
 * the build has no CUDA, no GPU is present or the model is absent.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <unistd.h>

#include "engine_helpers.h" /* OK(), jobs, results, stepping an engine */
#include "moe_ckpt.h"       /* the MoE graphs' checkpoints */
#include "tp_rows_check.h"
#include "testutil.h"
#include "tqkv_model.h"

#ifdef TQKV_HAVE_CUDA
#include "cache/cache_cuda.h"
#include "model/cuda/model_cuda.h"
#include "model/tp/tp_comm.h"
#include "model/tp/tp_state.h" /* a sharded state's rank device states */

static tqkv_model *g_model;
static uint64_t    g_seed;
static int         V;
static char        g_dir[1024];
static const char *g_cur_dir = g_dir; /* the directory of g_model (a graph case's: its own) */

/* A state of `rows` rows: device 0 / 1, tensor_parallel tp (1 with one_rank: the 1-rank
 * sharded device state). */
static tqkv_model_state *new_state(int rows, tqkv_format f, int device, int tp, int one_rank) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = p.v_format = f;
    p.threads = 4;
    p.device = device;
    p.tensor_parallel = tp;
    if (one_rank) setenv("TQKV_TP_ONE_RANK", "1", 1);
    tqkv_model_state *s = NULL;
    const tqkv_status rc = tqkv_model_state_init(&s, g_model, &p);
    unsetenv("TQKV_TP_ONE_RANK");
    if (rc != TQKV_OK) fail_msg("state init (device %d, tp %d): %s", device, tp, tqkv_last_error());
    return s;
}

static void random_tokens(test_rng *r, int32_t *t, size_t n) {
    for (size_t i = 0; i < n; i++) t[i] = rng_int(r, 1, V - 1);
}

static int argmax_of(const float *x) {
    int b = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* One row: prefill n tokens (logits of every position) then `steps` greedy decode steps
 * (each state decodes its own argmax); lg [n + steps, V]; toks [steps] the picked tokens. */
static void run_row(tqkv_model_state *s, const int32_t *prompt, int n, int steps, float *lg,
                    int32_t *toks) {
    OK(tqkv_model_prefill(g_model, s, prompt, NULL, n, TQKV_LOGITS_ALL, lg));
    int32_t t = argmax_of(lg + (size_t)(n - 1) * V);
    for (int i = 0; i < steps; i++) {
        toks[i] = t;
        float *o = lg + (size_t)(n + i) * V;
        OK(tqkv_model_decode(g_model, s, &t, o));
        t = argmax_of(o);
    }
}

/* Relative L2 per position of a against b [npos, V]: the median and the largest; bitwise
 * equal positions counted. */
static void compare(const float *a, const float *b, int npos, double *med, double *worst, int *bits) {
    double *e = malloc(sizeof(double) * (size_t)npos);
    *bits = 0;
    for (int i = 0; i < npos; i++) {
        e[i] = rel_l2(a + (size_t)i * V, b + (size_t)i * V, (size_t)V);
        if (e[i] != e[i]) e[i] = 1e30;
        *bits += !memcmp(a + (size_t)i * V, b + (size_t)i * V, sizeof(float) * (size_t)V);
    }
    for (int i = 1; i < npos; i++) /* insertion sort: npos is small */
        for (int j = i; j > 0 && e[j] < e[j - 1]; j--) {
            const double t = e[j];
            e[j] = e[j - 1];
            e[j - 1] = t;
        }
    *med = e[npos / 2];
    *worst = e[npos - 1];
    free(e);
}

/* 1 when the model's query heads and MLP width split over N ranks (else the case prints
 * SKIPPED: e.g. N = 4 on the 2-head draft fixture). */
static int tp_fits(int N) {
    const tqkv_model_config *c = tqkv_model_get_config(g_model);
    if (c->n_heads % N == 0 && c->intermediate_size % N == 0 &&
        (c->n_kv_heads % N == 0 || N % c->n_kv_heads == 0))
        return 1;
    print_message("N = %d does not split this model's %d heads / MLP %d: SKIPPED\n", N,
                  c->n_heads, c->intermediate_size);
    return 0;
}

// ---------------------------------------------------------------------------
// collectives
// ---------------------------------------------------------------------------

static void test_nccl_selftest(void **st) {
    (void)st;
    tqkv_status rc = tp_comm_nccl_selftest(1, g_seed);
    if (rc == TQKV_EUNSUPPORTED) {
        print_message("NCCL self-check n = 1: SKIPPED (%s)\n", tqkv_last_error());
        skip();
        return;
    }
    OK(rc);
    print_message("NCCL self-check n = 1: PASS\n");
    int have = 0;
    for (int n = 2; n <= TP_MAX_RANKS; n++) /* the visible GPUs: the largest n that inits */
        if (tp_comm_nccl_selftest(n, g_seed) == TQKV_OK) have = n;
        else if (tqkv_last_error() && !strstr(tqkv_last_error(), "visible"))
            fail_msg("NCCL self-check n = %d: %s", n, tqkv_last_error());
        else break;
    if (have >= 2) print_message("NCCL self-check n = 2..%d: PASS\n", have);
    else print_message("NCCL self-check n >= 2: SKIPPED (one GPU visible)\n");
}

static void test_device_selftest(void **st) {
    (void)st;
    const int ns[] = {1, 2, 3, 4, 8};
    for (int i = 0; i < 5; i++) {
        OK(tp_comm_device_selftest(ns[i], g_seed + (uint64_t)i));
        print_message("device-local all-reduce / all-gather n = %d on GPU 0: PASS\n", ns[i]);
    }
}

// ---------------------------------------------------------------------------
// the sharded forward
// ---------------------------------------------------------------------------

/* N = 1 through the NCCL path against the unsharded device state: every position bit for
 * bit when `bitwise`, else within a relative L2 of 1e-6 (the bits printed). */
static void tp1_case(int bitwise) {
    enum { n = 37, steps = 8 };
    test_rng r;
    rng_init(&r, g_seed ^ 0x71);
    int32_t prompt[n], ta[steps], tb[steps];
    random_tokens(&r, prompt, n);
    float *a = malloc(sizeof(float) * (size_t)(n + steps) * V);
    float *b = malloc(sizeof(float) * (size_t)(n + steps) * V);
    tqkv_model_state *s = new_state(1, TQKV_TQ4, 1, 1, 1), *u = new_state(1, TQKV_TQ4, 1, 0, 0);
    assert_int_equal(tqkv_model_state_tensor_parallel(s), 1);
    run_row(s, prompt, n, steps, a, ta);
    run_row(u, prompt, n, steps, b, tb);
    double med, worst;
    int bits;
    compare(a, b, n + steps, &med, &worst, &bits);
    /* the sharded state takes NCCL when it is built in (tp_cuda.cu), else the device-local
     * collective: say which one this run covered */
    const int nccl = tp_comm_nccl_selftest(1, g_seed) == TQKV_OK;
    print_message("N = 1 (%s) vs unsharded device: rel L2 median %.3g worst %.3g, %d of %d "
                  "positions bitwise\n", nccl ? "NCCL path" : "NCCL not built in: device-local path",
                  med, worst, bits, n + steps);
    assert_true(worst <= 1e-6);
    if (bitwise && bits != n + steps)
        fail_msg("N = 1: %d of %d positions differ from the unsharded device state's bits",
                 n + steps - bits, n + steps);
    assert_memory_equal(ta, tb, sizeof ta);
    tqkv_model_state_free(s);
    tqkv_model_state_free(u);
    free(a);
    free(b);
}

static void test_tp1_nccl(void **st) {
    (void)st;
    tp1_case(0);
}

/* How a greedy run is held to the reference's: equal, equal up to a near-tie (the
 * reference's top two within TIE_FRAC of its logit range: tq4 codes may flip one), or only
 * printed (the CPU's, whose error is the GPU's rounding). */
enum { GREEDY_EQUAL, GREEDY_TIE_OK, GREEDY_PRINT };
#define TIE_FRAC 1e-3

/* Bounds on the relative L2 of logits (the median position and the worst) and the greedy
 * rule, against one reference. */
typedef struct {
    double med, worst;
    int    greedy;
} tp_bounds;

/* The first step at which two greedy runs of `steps` picked different tokens, or steps. */
static int first_diff(const int32_t *a, const int32_t *b, int steps) {
    int i = 0;
    while (i < steps && a[i] == b[i]) i++;
    return i;
}

/* 1 when picking `have` instead of ref's argmax `want` at one position [V] is a near-tie:
 * ref[want] - ref[have] <= TIE_FRAC (max - min of ref). */
static int near_tie(const float *ref, int want, int have) {
    float lo = ref[0], hi = ref[0];
    for (int j = 1; j < V; j++) {
        lo = fminf(lo, ref[j]);
        hi = fmaxf(hi, ref[j]);
    }
    return (double)ref[want] - ref[have] <= TIE_FRAC * ((double)hi - lo);
}

/* The greedy run tg against the reference's tu (its logits u [n + steps, V]): the steps they
 * agree on (the positions compared are those whose inputs agree); a difference is held to
 * b.greedy. */
static int greedy_agree(const char *what, const float *u, const int32_t *tg, const int32_t *tu,
                        int n, int steps, tp_bounds b) {
    const int d = first_diff(tg, tu, steps);
    if (d == steps) return d;
    const int tie = near_tie(u + (size_t)(n - 1 + d) * V, tu[d], tg[d]);
    print_message("  %s: greedy step %d: token %d, the reference's %d (%s)\n", what, d, tg[d],
                  tu[d], tie ? "a near-tie" : "not a near-tie");
    if (b.greedy == GREEDY_EQUAL || (b.greedy == GREEDY_TIE_OK && !tie))
        fail_msg("%s: greedy step %d: token %d, the reference's %d", what, d, tg[d], tu[d]);
    return d;
}

/* Each rank of sg holds its KV heads' share of su's cache (N > KV heads: one replicated). */
static void rank_bytes_check(tqkv_model_state *sg, tqkv_model_state *su, int N) {
    const int nkv = tqkv_model_get_config(g_model)->n_kv_heads;
    const int per = nkv >= N ? nkv / N : 1;
    const double full = (double)tqkv_model_state_kv_bytes_used(su);
    for (int k = 0; k < N; k++) {
        const double rb = (double)tqkv_model_state_kv_bytes_rank(sg, k);
        print_message("  rank %d cache %.0f bytes, unsharded %.0f (share %d/%d)\n", k, rb, full,
                      per, nkv);
        assert_true(fabs(rb * nkv / per - full) <= 0.01 * full);
    }
}

/* N ranks on one GPU against the unsharded device state (within dev) and the CPU sharded
 * forward of the same N (within cpu: the graph's CPU / GPU bounds), over the positions whose
 * inputs agree; greedy tokens as each bounds' rule says. */
static void parity_case_within(int N, tqkv_format f, tp_bounds dev, tp_bounds cpu) {
    enum { n = 48, steps = 16 };
    if (!tp_fits(N)) {
        skip();
        return;
    }
    test_rng r;
    rng_init(&r, g_seed ^ ((uint64_t)N << 8) ^ (uint64_t)f);
    int32_t prompt[n], tg[steps], tu[steps], tc[steps];
    random_tokens(&r, prompt, n);
    const size_t sz = sizeof(float) * (size_t)(n + steps) * V;
    float *g = malloc(sz), *u = malloc(sz), *c = malloc(sz);
    tqkv_model_state *sg = new_state(1, f, 1, N, 0), *su = new_state(1, f, 1, 0, 0),
                     *sc = new_state(1, f, 0, N, 0);
    assert_int_equal(tqkv_model_state_tensor_parallel(sg), N);
    /* exact allocations: the cache bytes below compare like for like */
    OK(tqkv_model_state_reserve(sg, n + steps + 8));
    OK(tqkv_model_state_reserve(su, n + steps + 8));
    run_row(sg, prompt, n, steps, g, tg);
    run_row(su, prompt, n, steps, u, tu);
    run_row(sc, prompt, n, steps, c, tc);
    const int du = greedy_agree("vs unsharded device", u, tg, tu, n, steps, dev);
    const int dc = greedy_agree("vs CPU", c, tg, tc, n, steps, cpu);
    double med, worst, cmed, cworst;
    int bits, cbits;
    compare(g, u, n + du, &med, &worst, &bits);
    compare(g, c, n + dc, &cmed, &cworst, &cbits);
    print_message("N = %d %s: vs unsharded device rel L2 median %.3g worst %.3g (%d positions); "
                  "vs CPU N = %d median %.3g worst %.3g (%d); greedy %d/%d as the CPU's\n", N,
                  tqkv_format_name(f), med, worst, n + du, N, cmed, cworst, n + dc, dc, steps);
    if (!(med < dev.med) || !(worst < dev.worst) || !(cmed < cpu.med) || !(cworst < cpu.worst))
        fail_msg("N = %d %s: outside the parity bounds (device median < %g, worst < %g; CPU "
                 "median < %g, worst < %g)", N, tqkv_format_name(f), dev.med, dev.worst, cpu.med,
                 cpu.worst);
    rank_bytes_check(sg, su, N);
    tqkv_model_state_free(sg);
    tqkv_model_state_free(su);
    tqkv_model_state_free(sc);
    free(g);
    free(u);
    free(c);
}

/* test_cuda_model's parity bounds against both references. */
static void parity_case(int N, tqkv_format f, double tol_med, double tol_worst) {
    const tp_bounds dev = {tol_med, tol_worst, GREEDY_EQUAL}, cpu = {tol_med, tol_worst, GREEDY_PRINT};
    parity_case_within(N, f, dev, cpu);
}

static void test_parity_n2_tq4(void **st) { (void)st; parity_case(2, TQKV_TQ4, 1e-2, 1e-1); }
static void test_parity_n4_tq4(void **st) { (void)st; parity_case(4, TQKV_TQ4, 1e-2, 1e-1); }
static void test_parity_n2_f32(void **st) { (void)st; parity_case(2, TQKV_F32, 1e-2, 3e-2); }
static void test_parity_n4_f32(void **st) { (void)st; parity_case(4, TQKV_F32, 1e-2, 3e-2); }

/* A row alone and as row 1 of 3 (other tokens in rows 0 and 2): the same bits. */
static void invariance_case(int N, tqkv_format f) {
    enum { n = 29, steps = 6, R = 3 };
    if (!tp_fits(N)) {
        skip();
        return;
    }
    test_rng r;
    rng_init(&r, g_seed ^ 0x1a7 ^ ((uint64_t)N << 4) ^ (uint64_t)f);
    int32_t batch[R * n];
    random_tokens(&r, batch, (size_t)R * n);
    const size_t row = sizeof(float) * (size_t)V;
    float *one = malloc(row * (size_t)(n + steps)), *all = malloc(row * (size_t)R * n);
    float *d1 = malloc(row), *d3 = malloc(row * R);
    tqkv_model_state *s1 = new_state(1, f, 1, N, 0), *s3 = new_state(R, f, 1, N, 0);
    OK(tqkv_model_prefill(g_model, s1, batch + n, NULL, n, TQKV_LOGITS_ALL, one));
    OK(tqkv_model_prefill(g_model, s3, batch, NULL, n, TQKV_LOGITS_ALL, all));
    for (int j = 0; j < n; j++)
        if (memcmp(one + (size_t)j * V, all + ((size_t)n + j) * V, row))
            fail_msg("N = %d %s: prefill position %d differs alone and in a batch", N,
                     tqkv_format_name(f), j);
    for (int i = 0; i < steps; i++) {
        int32_t t3[R];
        for (int k = 0; k < R; k++) t3[k] = rng_int(&r, 1, V - 1);
        OK(tqkv_model_decode(g_model, s1, &t3[1], d1));
        OK(tqkv_model_decode(g_model, s3, t3, d3));
        if (memcmp(d1, d3 + V, row))
            fail_msg("N = %d %s: decode step %d differs alone and in a batch", N, tqkv_format_name(f), i);
    }
    print_message("N = %d %s: a row alone and as row 1 of 3: bitwise over %d prefill positions "
                  "and %d decodes\n", N, tqkv_format_name(f), n, steps);
    tqkv_model_state_free(s1);
    tqkv_model_state_free(s3);
    free(one);
    free(all);
    free(d1);
    free(d3);
}

static void test_invariance_n2_tq4(void **st) { (void)st; invariance_case(2, TQKV_TQ4); }
static void test_invariance_n4_f32(void **st) { (void)st; invariance_case(4, TQKV_F32); }

/* Reset: the rows emptied (and another row count), then the same prefill gives the same
 * bits. */
static void test_reset(void **st) {
    (void)st;
    enum { n = 21 };
    test_rng r;
    rng_init(&r, g_seed ^ 0x5e7);
    int32_t prompt[3 * n]; /* [2 rows, n] from 0, and again from n after the reset */
    random_tokens(&r, prompt, 3 * n);
    const size_t row = sizeof(float) * (size_t)V;
    float *a = malloc(row * 2), *c = malloc(row * 2);
    tqkv_model_state *s = new_state(2, TQKV_TQ4, 1, 2, 0);
    OK(tqkv_model_prefill(g_model, s, prompt, NULL, n, TQKV_LOGITS_LAST, a));
    int pos[2];
    OK(tqkv_model_state_reset(s, 0));
    OK(tqkv_model_state_offsets(s, pos));
    assert_true(pos[0] == 0 && pos[1] == 0);
    OK(tqkv_model_prefill(g_model, s, prompt + n, NULL, n, TQKV_LOGITS_LAST, a));
    OK(tqkv_model_state_reset(s, 1)); /* another row count */
    OK(tqkv_model_state_reset(s, 2));
    OK(tqkv_model_prefill(g_model, s, prompt + n, NULL, n, TQKV_LOGITS_LAST, c));
    assert_memory_equal(a, c, row * 2);
    print_message("sharded device state: reset and re-prefill bitwise\n");
    tqkv_model_state_free(s);
    free(a);
    free(c);
}

// ---------------------------------------------------------------------------
// row operations on sharded device states (N = 2), as test_tp_rows on the CPU
// ---------------------------------------------------------------------------

enum { TPR = 2 };

/* A 1-row N = 2 sharded device state (extend_as_decode: verification windows give the bits
 * of single decodes) holding a random prompt of n tokens. */
static tqkv_model_state *rows_state(int rows, tqkv_format kv) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = p.v_format = kv;
    p.threads = 4;
    p.device = 1;
    p.tensor_parallel = TPR;
    p.extend_as_decode = 1;
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, g_model, &p));
    return s;
}

static tqkv_model_state *prefilled(test_rng *rg, int n, tqkv_format kv) {
    int32_t tok[64];
    for (int i = 0; i < n; i++) tok[i] = rng_int(rg, 3, V - 1);
    tqkv_model_state *s = rows_state(1, kv);
    OK(tqkv_model_prefill(g_model, s, tok, NULL, n, TQKV_LOGITS_NONE, NULL));
    return s;
}

static void rows_case(tqkv_format kv) {
    if (!tp_fits(TPR)) {
        skip();
        return;
    }
    test_rng rg;
    rng_init(&rg, g_seed ^ 0x25a ^ (uint64_t)kv);
    const int len[4] = {21, 13, 8, 17};
    tqkv_model_state *ref[4], *src[4];
    for (int i = 0; i < 4; i++) {
        ref[i] = prefilled(&rg, len[i], kv);
        src[i] = tp_copy_of(ref[i]);
    }
    tp_rows_sequence(g_model, ref, src, &rg, 0); /* device bytes are capacities */
    print_message("N = %d on the device, kv %s: merge / filter / extract == rows alone, bitwise\n",
                  TPR, tqkv_format_name(kv));
    for (int i = 0; i < 4; i++) {
        tqkv_model_state_free(ref[i]);
        tqkv_model_state_free(src[i]);
    }
}

static void test_rows_n2_tq4(void **st) { (void)st; rows_case(TQKV_TQ4); }
static void test_rows_n2_f32(void **st) { (void)st; rows_case(TQKV_F32); }

/* Export, import (tq4: the device's f32 KV has no state format), the import's export. */
static void export_import_check(tqkv_model_state *s, tqkv_model_state **ref, test_rng *rg) {
    uint8_t *blob = NULL, *blob2 = NULL;
    size_t blen = 0, blen2 = 0;
    OK(tqkv_model_state_export(s, &blob, &blen));
    assert_memory_equal(blob, "TQKVTP01", 8);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 4;
    p.device = 1;
    p.extend_as_decode = 1;
    p.tensor_parallel = TPR;
    tqkv_model_state *im = NULL, *none = NULL;
    OK(tqkv_model_state_import(&im, g_model, &p, blob, blen));
    assert_int_equal(tqkv_model_state_tensor_parallel(im), TPR);
    assert_int_equal(tqkv_model_state_rows(im), tqkv_model_state_rows(s));
    OK(tqkv_model_state_export(im, &blob2, &blen2));
    assert_int_equal(blen2, blen);
    assert_memory_equal(blob2, blob, blen);
    int o1[2], o2[2];
    OK(tqkv_model_state_offsets(s, o1));
    OK(tqkv_model_state_offsets(im, o2));
    assert_memory_equal(o1, o2, sizeof o1);
    tqkv_model_state *refc[2] = {tp_copy_of(ref[0]), tp_copy_of(ref[1])};
    const int map[2] = {0, 1};
    tp_step_compare(g_model, im, refc, map, rg, "imported");
    p.tensor_parallel = 4; /* another N: refused */
    assert_int_equal(tqkv_model_state_import(&none, g_model, &p, blob, blen), TQKV_EINVAL);
    p.tensor_parallel = TPR;
    assert_int_equal(tqkv_model_state_import(&none, g_model, &p, blob, blen - 1), TQKV_ECORRUPT);
    assert_null(none);
    tqkv_model_state_free(refc[0]);
    tqkv_model_state_free(refc[1]);
    tqkv_model_state_free(im);
    free(blob);
    free(blob2);
}

/* Two rows merged, spec rounds on them, export / import: each as the rows alone. */
static void spec_export_case(void) {
    if (!tp_fits(TPR)) {
        skip();
        return;
    }
    test_rng rg;
    rng_init(&rg, g_seed ^ 0x5bec);
    tqkv_model_state *ref[2], *src[2];
    ref[0] = prefilled(&rg, 19, TQKV_TQ4);
    ref[1] = prefilled(&rg, 11, TQKV_TQ4);
    for (int i = 0; i < 2; i++) src[i] = tp_copy_of(ref[i]);
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 1));
    tp_spec_sequence(g_model, s, ref, &rg); /* a per-row rollback, a commit */
    export_import_check(s, ref, &rg);
    print_message("N = %d on the device: spec rounds (per-row rollback, commit) == rows alone; "
                  "export / import round trip bytewise, decodes bitwise\n", TPR);
    tqkv_model_state_free(s);
    tqkv_model_state_free(src[1]);
    for (int i = 0; i < 2; i++) tqkv_model_state_free(ref[i]);
}

static void test_spec_export_n2(void **st) {
    (void)st;
    spec_export_case();
}

/* A decode step of s with TQKV_TP_GRAPHS set to `on` (1 or 0) for the call. */
static void decode_graphs(tqkv_model_state *s, const int32_t *t, float *out, int on) {
    setenv("TQKV_TP_GRAPHS", on ? "1" : "0", 1);
    const tqkv_status rc = tqkv_model_decode(g_model, s, t, out);
    unsetenv("TQKV_TP_GRAPHS");
    OK(rc);
}

/* The sharded decode step as one CUDA graph (TQKV_TP_GRAPHS=1) against the same steps
 * launched directly: 3 rows at N = 2 (tq4), the same prompts and fed tokens, every step's
 * logits bitwise; the graph state captured and replayed (when the rank states have graphs
 * on: the experts' per-expert path turns them off). */
static void graphs_case(void) {
    enum { n = 23, steps = 12, R = 3 };
    if (!tp_fits(TPR)) {
        skip();
        return;
    }
    test_rng r;
    rng_init(&r, g_seed ^ 0x96a);
    int32_t prompt[R * n], t[R];
    random_tokens(&r, prompt, (size_t)R * n);
    const size_t row = sizeof(float) * (size_t)V;
    float *a = malloc(row * R), *b = malloc(row * R);
    tqkv_model_state *sg = new_state(R, TQKV_TQ4, 1, TPR, 0), *sd = new_state(R, TQKV_TQ4, 1, TPR, 0);
    OK(tqkv_model_prefill(g_model, sg, prompt, NULL, n, TQKV_LOGITS_LAST, a));
    OK(tqkv_model_prefill(g_model, sd, prompt, NULL, n, TQKV_LOGITS_LAST, b));
    for (int i = 0; i < steps; i++) {
        for (int k = 0; k < R; k++) t[k] = rng_int(&r, 1, V - 1);
        decode_graphs(sg, t, a, 1);
        decode_graphs(sd, t, b, 0);
        if (memcmp(a, b, row * R))
            fail_msg("N = %d: decode step %d through the sharded graph differs from the direct "
                     "step", TPR, i);
    }
    uint64_t cap = 0, rep = 0, dir = 0, c2 = 0, r2 = 0, d2 = 0;
    model_cuda_tp_graph_counts(sg, &cap, &rep, &dir);
    model_cuda_tp_graph_counts(sd, &c2, &r2, &d2);
    model_cuda_graph_stats gs;
    model_cuda_graph_stats_get(sg->tp->rank[0]->gpu, &gs);
    print_message("N = %d graphs: %d decodes bitwise the direct ones; %llu direct, %llu captured, "
                  "%llu replayed (rank graphs %s)\n", TPR, steps, (unsigned long long)dir,
                  (unsigned long long)cap, (unsigned long long)rep, gs.enabled ? "on" : "off");
    assert_true(c2 == 0 && r2 == 0 && d2 == 0); /* the direct state never took the graph path */
    if (gs.enabled) assert_true(cap >= 1 && rep >= 1);
    tqkv_model_state_free(sg);
    tqkv_model_state_free(sd);
    free(a);
    free(b);
}

static void test_graphs_n2(void **st) {
    (void)st;
    graphs_case();
}

/* The model's one communicator for N = 2 on the device (tp_state.h): two states share it,
 * freed with the last. A graph state's decode graph captured the shared scratch's address;
 * another state's longer prefill then moves the scratch (tp_comm_scratch_gen), and the graph
 * state's next steps must be captured again, not replayed on the freed scratch: every step
 * bitwise the same steps of a state launched directly. */
static void test_comm_shared_n2(void **st) {
    (void)st;
    enum { n = 9, big = 300, steps = 10 };
    if (!tp_fits(TPR)) {
        skip();
        return;
    }
    test_rng r;
    rng_init(&r, g_seed ^ 0x5c0);
    int32_t prompt[big], t;
    random_tokens(&r, prompt, big);
    const size_t row = sizeof(float) * (size_t)V;
    float *a = malloc(row * big), *b = malloc(row * big);
    assert_int_equal(model_tp_comm_users(g_model, TPR, 1), 0);
    tqkv_model_state *sg = new_state(1, TQKV_TQ4, 1, TPR, 0),
                     *sd = new_state(1, TQKV_TQ4, 1, TPR, 0);
    assert_ptr_equal(sg->tp->comm, sd->tp->comm);
    assert_int_equal(model_tp_comm_users(g_model, TPR, 1), 2);
    OK(tqkv_model_prefill(g_model, sg, prompt, NULL, n, TQKV_LOGITS_LAST, a));
    OK(tqkv_model_prefill(g_model, sd, prompt, NULL, n, TQKV_LOGITS_LAST, b));
    unsigned long long gen0 = tp_comm_scratch_gen(sg->tp->comm);
    for (int i = 0; i < steps; i++) {
        if (i == steps / 2) { /* a longer prefill on a third state: the scratch moves */
            tqkv_model_state *x = new_state(1, TQKV_TQ4, 1, TPR, 0);
            assert_ptr_equal(x->tp->comm, sg->tp->comm);
            OK(tqkv_model_prefill(g_model, x, prompt, NULL, big, TQKV_LOGITS_LAST, a));
            tqkv_model_state_free(x);
            assert_true(tp_comm_scratch_gen(sg->tp->comm) > gen0);
        }
        t = rng_int(&r, 1, V - 1);
        decode_graphs(sg, &t, a, 1);
        decode_graphs(sd, &t, b, 0);
        if (memcmp(a, b, row))
            fail_msg("decode step %d through the sharded graph on the shared communicator "
                     "differs from the direct step", i);
    }
    uint64_t cap = 0, rep = 0, dir = 0;
    model_cuda_tp_graph_counts(sg, &cap, &rep, &dir);
    model_cuda_graph_stats gs;
    model_cuda_graph_stats_get(sg->tp->rank[0]->gpu, &gs);
    print_message("N = %d: one communicator for 2 states (3 with the long prefill); %d graph "
                  "decodes bitwise the direct ones across the scratch move: %llu direct, %llu "
                  "captured, %llu replayed (rank graphs %s)\n", TPR, steps,
                  (unsigned long long)dir, (unsigned long long)cap, (unsigned long long)rep,
                  gs.enabled ? "on" : "off");
    if (gs.enabled) assert_true(cap >= 2 && rep >= 2); /* captured again after the move */
    tqkv_model_state_free(sg);
    assert_int_equal(model_tp_comm_users(g_model, TPR, 1), 1);
    tqkv_model_state_free(sd);
    assert_int_equal(model_tp_comm_users(g_model, TPR, 1), 0);
    free(a);
    free(b);
}

/* Refusals change nothing on any rank: the rows, every rank's cache bytes, the next decode. */
static void test_refusals_unchanged_n2(void **st) {
    (void)st;
    if (!tp_fits(TPR)) {
        skip();
        return;
    }
    test_rng rg;
    rng_init(&rg, g_seed ^ 0x4ef);
    tqkv_model_state *ref[2], *src[2];
    ref[0] = prefilled(&rg, 12, TQKV_TQ4);
    ref[1] = prefilled(&rg, 7, TQKV_TQ4);
    for (int i = 0; i < 2; i++) src[i] = tp_copy_of(ref[i]);
    tqkv_model_state *s = src[0];
    OK(tqkv_model_state_merge(s, &src[1], 1));
    size_t rb[TPR];
    for (int r = 0; r < TPR; r++) rb[r] = tqkv_model_state_kv_bytes_rank(s, r);
    /* a merge that cannot fit: past the device's rows (CUDA_MAX_ROWS) */
    tqkv_model_state *big = rows_state(CUDA_MAX_ROWS - 1, TQKV_TQ4);
    assert_int_equal(tqkv_model_state_merge(s, &big, 1), TQKV_EUNSUPPORTED);
    print_message("merge of %d + %d rows refused: %s\n", 2, CUDA_MAX_ROWS - 1, tqkv_last_error());
    tqkv_model_state_free(big);
    /* a source of another N */
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = p.v_format = TQKV_TQ4;
    p.device = 1;
    p.tensor_parallel = 1;
    tqkv_model_state *u = NULL;
    OK(tqkv_model_state_init(&u, g_model, &p));
    assert_int_equal(tqkv_model_state_merge(s, &u, 1), TQKV_EINVAL);
    tqkv_model_state_free(u);
    tp_bad_keeps_refused(s); /* bad keeps, a row out of range, rollback outside a round */
    /* rank 1's device build fails after rank 0 built its own (TQKV_TP_FAIL_RANK=1) */
    tqkv_model_state *x = tp_copy_of(ref[0]);
    const int inc[1] = {1}, rev[2] = {1, 0};
    setenv("TQKV_TP_FAIL_RANK", "1", 1);
    assert_int_equal(tqkv_model_state_merge(s, &x, 1), TQKV_ENOMEM);
    assert_int_equal(tqkv_model_state_filter(s, inc, 1), TQKV_ENOMEM);
    assert_int_equal(tqkv_model_state_filter(s, rev, 2), TQKV_ENOMEM);
    assert_int_equal(tqkv_model_state_spec_begin(s), TQKV_ENOMEM);
    unsetenv("TQKV_TP_FAIL_RANK");
    tqkv_model_state_free(x);
    assert_int_equal(tqkv_model_state_spec_active(s), 0);
    assert_int_equal(tqkv_model_state_rows(s), 2);
    for (int r = 0; r < TPR; r++) assert_int_equal(tqkv_model_state_kv_bytes_rank(s, r), rb[r]);
    OK(tqkv_model_state_check(s));
    const int map[2] = {0, 1};
    tp_step_compare(g_model, s, ref, map, &rg, "after refusals");
    /* f32 KV: the device's dense bf16 cache has no state format */
    tqkv_model_state *f = rows_state(1, TQKV_F32);
    uint8_t *blob = NULL;
    size_t blen = 0;
    assert_int_equal(tqkv_model_state_export(f, &blob, &blen), TQKV_EUNSUPPORTED);
    assert_null(blob);
    tqkv_model_state_free(f);
    print_message("N = %d on the device: refusals (a merge past %d rows, another N, bad keeps, "
                  "rollback outside a round, f32 export) and rank 1 failing after rank 0 (merge, "
                  "filter, spec begin) left every rank unchanged\n", TPR, CUDA_MAX_ROWS);
    tqkv_model_state_free(s);
    tqkv_model_state_free(src[1]);
    for (int i = 0; i < 2; i++) tqkv_model_state_free(ref[i]);
}

// ---------------------------------------------------------------------------
// the engine at N = 2 on the device
// ---------------------------------------------------------------------------

static tqkv_engine *dev_engine(int tp, size_t prefix_bytes, const char *cache_dir,
                               const char *draft) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_cur_dir;
    p.draft_dir = draft;
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 4;
    p.prefill_chunk = 32;
    p.prefix_cache_bytes = prefix_bytes;
    p.prompt_cache_dir = cache_dir;
    p.device = 1;
    p.tensor_parallel = tp;
    p.bf16_act = 0; /* as the states above */
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    return e;
}

/* 1 when g_model's directory has the tokenizer an engine loads (the checkpoints written
 * here have none: their engine cases print SKIPPED). */
static int engine_fits(void) {
    char p[1100];
    struct stat sb;
    snprintf(p, sizeof p, "%.1023s/tokenizer.json", g_cur_dir);
    if (stat(p, &sb) == 0) return tp_fits(TPR);
    print_message("engine: no tokenizer in %s: SKIPPED\n", g_cur_dir);
    return 0;
}

/* The engine at N = 2 (an unsharded device draft of the same model), and its prefix cache. */
static void engine_case(void) {
    if (!engine_fits()) {
        skip();
        return;
    }
    tp_engine_check(dev_engine, TPR, V, g_cur_dir, g_seed ^ 0xe25);
}

static void engine_prefix_case(void) {
    if (!engine_fits()) {
        skip();
        return;
    }
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/tqkv_test_cuda_tp_pc_%d", (int)getpid());
    tp_engine_prefix_check(dev_engine, TPR, V, dir, g_seed ^ 0xfc);
}

static void test_engine_n2(void **st) {
    (void)st;
    engine_case();
}

/* The device engine at N = 2 with the model as its own draft, or none (draft 0); the draft's
 * states at draft_tensor_parallel dtp (tq4 KV, exact products as the states above). */
static tqkv_engine *dev_draft_engine(int tp, int draft, int dtp, tqkv_status *rc) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_cur_dir;
    p.draft_dir = draft ? g_cur_dir : NULL;
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 4;
    p.device = 1;
    p.tensor_parallel = tp;
    p.draft_tensor_parallel = dtp;
    p.bf16_act = 0;
    tqkv_engine *e = NULL;
    *rc = tqkv_engine_init(&e, &p);
    return e;
}

/* A sharded device draft (draft_tensor_parallel 2 and -1): tokens and logprob bits of the
 * engine without a draft; acceptance printed beside the unsharded draft's (not asserted
 * equal: the device's sharded and unsharded logits differ by rounding). */
static void test_engine_n2_draft_tp(void **st) {
    (void)st;
    if (!engine_fits()) {
        skip();
        return;
    }
    tp_engine_draft_check(dev_draft_engine, TPR, V, 0, g_seed ^ 0xd7a);
}

static void test_engine_n2_prefix(void **st) {
    (void)st;
    engine_prefix_case();
}

// ---------------------------------------------------------------------------
// the other graphs (issue 25 item 1): each graph's sharded device forward
// ---------------------------------------------------------------------------

/* The graphs beside the Llama family: the ../shared fixtures of Qwen 3.5 and Gemma 4 (their
 * cases print SKIPPED without them) and checkpoints written here for the MoE graphs
 * (moe_ckpt.h: head dims the device takes; the goldens in tests/golden/ have head_dim 32 and
 * DeltaNet key dim 32, which the device refuses). */
enum { GR_Q35, GR_G4, GR_Q3M, GR_Q35M, GR_G4M, GR_N };
static const char *const GR_NAME[GR_N] = {"Qwen 3.5 hybrid", "Gemma 4", "Qwen3-MoE",
                                          "Qwen 3.5 MoE", "Gemma 4 MoE"};
static tqkv_model *g_graph[GR_N];  /* NULL: absent */
static char        g_gdir[GR_N][1024];
static int         g_written[GR_N]; /* g_gdir is a temporary checkpoint to remove */
static tqkv_model *g_base;          /* the bundled model, g_model again after each case */
static int         g_base_v;

/* Qwen3-MoE: 3 layers, layer 1 dense (mlp_only), 8 experts of width 64, top 2 renormalised,
 * one tensor per expert (test_cuda_moe's checkpoint A). */
static const ck_spec Q3M_SPEC = {3, 8, 2, 64, 1, 1, 1, 0, 0, 0, 0xa11ce};

static tqkv_model *graph_load(const char *dir) {
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.threads = 4;
    lp.bf16_act = 0; /* as the bundled model's cases: reassociation is the only difference */
    tqkv_model *m = NULL;
    if (tqkv_model_load(&m, dir, &lp) != TQKV_OK) {
        fprintf(stderr, "load %s: %s\n", dir, tqkv_last_error());
        exit(1);
    }
    return m;
}

/* Every graph's model: a fixture when present, a written checkpoint otherwise. */
static void graphs_load(void) {
    const char *fixture[GR_N] = {"models/qwen35-code-hybrid-30m/config.json",
                                 "models/gemma4-code-30m/config.json", NULL, NULL, NULL};
    for (int i = 0; i < GR_N; i++) {
        if (fixture[i]) {
            if (!shared_path(fixture[i], g_gdir[i], sizeof g_gdir[i])) continue;
            *strrchr(g_gdir[i], '/') = 0;
        } else {
            snprintf(g_gdir[i], sizeof g_gdir[i], "/tmp/tqkv_cuda_tp_g%dXXXXXX", i);
            if (!mkdtemp(g_gdir[i])) {
                perror("mkdtemp");
                exit(1);
            }
            g_written[i] = 1;
            if (i == GR_Q3M) ck_write(g_gdir[i], &Q3M_SPEC);
            else if (i == GR_Q35M) q35_write(g_gdir[i], 0x35e);
            else g4m_write(g_gdir[i], 0x94e);
        }
        g_graph[i] = graph_load(g_gdir[i]);
    }
}

static void graphs_free(void) {
    for (int i = 0; i < GR_N; i++) {
        tqkv_model_free(g_graph[i]);
        if (!g_written[i]) continue;
        char p[1200];
        snprintf(p, sizeof p, "%.1023s/config.json", g_gdir[i]);
        unlink(p);
        snprintf(p, sizeof p, "%.1023s/model.safetensors", g_gdir[i]);
        unlink(p);
        rmdir(g_gdir[i]);
    }
}

/* Graph gi becomes g_model for the case (graph_leave restores the bundled model); 0 (the
 * case SKIPPED) when its fixture is absent. */
static int graph_enter(int gi) {
    if (!g_graph[gi]) {
        print_message("%s: SKIPPED (fixture absent: ../shared/%s)\n", GR_NAME[gi],
                      gi == GR_Q35 ? "models/qwen35-code-hybrid-30m" : "models/gemma4-code-30m");
        skip();
        return 0;
    }
    g_model = g_graph[gi];
    g_cur_dir = g_gdir[gi];
    V = tqkv_model_get_config(g_model)->vocab_size;
    print_message("-- %s (%s)\n", GR_NAME[gi], g_gdir[gi]);
    return 1;
}

static int graph_leave(void **st) {
    (void)st;
    g_model = g_base;
    g_cur_dir = g_dir;
    V = g_base_v;
    return 0;
}

/* CPU / GPU bounds of each graph against its CPU sharded forward: test_cuda_model's
 * (test_cuda_hybrid's, test_cuda_moe's dense ones), Gemma 4's test_cuda_gemma4 ones (its
 * scaling-1.0 attention; see there). The device-to-device bounds are test_cuda_model's. */
static tp_bounds cpu_bounds(int gi, tqkv_format f) {
    const int g4 = gi == GR_G4 || gi == GR_G4M;
    const int p = GREEDY_PRINT;
    if (f == TQKV_F32) return g4 ? (tp_bounds){2.5e-2, 1.5e-1, p} : (tp_bounds){1e-2, 3e-2, p};
    return g4 ? (tp_bounds){1e-1, 8e-1, p} : (tp_bounds){1e-2, 1e-1, p}; /* main's 005b355: 0.1 */
}

static void graph_parity(int gi, tqkv_format f) {
    /* greedy equal, or (tq4) a near-tie its codes' flips explain (the CPU test's Gemma 4 case
     * saw one: docs/TP.md) */
    const tp_bounds dev = f == TQKV_F32 ? (tp_bounds){1e-2, 3e-2, GREEDY_EQUAL}
                                        : (tp_bounds){1e-2, 1e-1, GREEDY_TIE_OK};
    if (graph_enter(gi)) parity_case_within(2, f, dev, cpu_bounds(gi, f));
}

/* Per graph: N = 1 through NCCL bitwise the unsharded device state; N = 2 on one GPU (the
 * device-local collective) within the parity bounds, greedy equal; a row alone and in a
 * batch bitwise at N = 2; at N = 2 (tq4) the row operations (merge / filter / extract) and
 * spec rounds, export / import against the rows alone, bitwise (the Llama family's cases). */
#define GRAPH_CASES(tag, gi)                                                                     \
    static void test_##tag##_tp1(void **st) {                                                    \
        (void)st;                                                                                \
        if (graph_enter(gi)) tp1_case(1);                                                        \
    }                                                                                            \
    static void test_##tag##_n2_tq4(void **st) {                                                 \
        (void)st;                                                                                \
        graph_parity(gi, TQKV_TQ4);                                                              \
    }                                                                                            \
    static void test_##tag##_n2_f32(void **st) {                                                 \
        (void)st;                                                                                \
        graph_parity(gi, TQKV_F32);                                                              \
    }                                                                                            \
    static void test_##tag##_invariance(void **st) {                                             \
        (void)st;                                                                                \
        if (graph_enter(gi)) invariance_case(2, TQKV_TQ4);                                       \
    }                                                                                            \
    static void test_##tag##_rows(void **st) {                                                   \
        (void)st;                                                                                \
        if (graph_enter(gi)) rows_case(TQKV_TQ4);                                                \
    }                                                                                            \
    static void test_##tag##_spec_export(void **st) {                                            \
        (void)st;                                                                                \
        if (graph_enter(gi)) spec_export_case();                                                 \
    }                                                                                            \
    static void test_##tag##_graphs(void **st) {                                                 \
        (void)st;                                                                                \
        if (graph_enter(gi)) graphs_case();                                                      \
    }                                                                                            \
    static void test_##tag##_engine(void **st) {                                                 \
        (void)st;                                                                                \
        if (graph_enter(gi)) engine_case();                                                      \
    }                                                                                            \
    static void test_##tag##_engine_prefix(void **st) {                                          \
        (void)st;                                                                                \
        if (graph_enter(gi)) engine_prefix_case();                                               \
    }
GRAPH_CASES(q35, GR_Q35)
GRAPH_CASES(g4, GR_G4)
GRAPH_CASES(q3m, GR_Q3M)
GRAPH_CASES(q35m, GR_Q35M)
GRAPH_CASES(g4m, GR_G4M)
#undef GRAPH_CASES

#define GRAPH_TESTS(tag)                                                                         \
    cmocka_unit_test_teardown(test_##tag##_tp1, graph_leave),                                    \
        cmocka_unit_test_teardown(test_##tag##_n2_tq4, graph_leave),                             \
        cmocka_unit_test_teardown(test_##tag##_n2_f32, graph_leave),                             \
        cmocka_unit_test_teardown(test_##tag##_invariance, graph_leave),                         \
        cmocka_unit_test_teardown(test_##tag##_rows, graph_leave),                               \
        cmocka_unit_test_teardown(test_##tag##_spec_export, graph_leave),                        \
        cmocka_unit_test_teardown(test_##tag##_graphs, graph_leave),                             \
        cmocka_unit_test_teardown(test_##tag##_engine, graph_leave),                             \
        cmocka_unit_test_teardown(test_##tag##_engine_prefix, graph_leave)

int main(void) {
    if (!tqkv_cuda_available()) {
        printf("SKIPPED: no CUDA device\n");
        return 77;
    }
    char *d = g_dir;
    const size_t dn = sizeof g_dir;
    const char *env = getenv("TQKV_TEST_MODEL");
    if (env) snprintf(d, dn, "%s", env);
    else source_path("models/qwen3-code-28m", d, dn);
    struct stat sb;
    if (stat(d, &sb) != 0) {
        printf("SKIPPED: no model at %s\n", d);
        return 77;
    }
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.threads = 4;
    lp.bf16_act = 0; /* the GEMMs' hi + lo activations (~16 bits): the sharded logits then
                      * differ from the unsharded ones by float32 reassociation only */
    if (tqkv_model_load(&g_model, d, &lp) != TQKV_OK) {
        fprintf(stderr, "load failed: %s\n", tqkv_last_error());
        return 1;
    }
    V = tqkv_model_get_config(g_model)->vocab_size;
    g_base = g_model;
    g_base_v = V;
    g_seed = test_seed();
    graphs_load();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nccl_selftest),
        cmocka_unit_test(test_device_selftest),
        cmocka_unit_test(test_tp1_nccl),
        cmocka_unit_test(test_parity_n2_tq4),
        cmocka_unit_test(test_parity_n4_tq4),
        cmocka_unit_test(test_parity_n2_f32),
        cmocka_unit_test(test_parity_n4_f32),
        cmocka_unit_test(test_invariance_n2_tq4),
        cmocka_unit_test(test_invariance_n4_f32),
        cmocka_unit_test(test_reset),
        cmocka_unit_test(test_rows_n2_tq4),
        cmocka_unit_test(test_rows_n2_f32),
        cmocka_unit_test(test_spec_export_n2),
        cmocka_unit_test(test_graphs_n2),
        cmocka_unit_test(test_comm_shared_n2),
        cmocka_unit_test(test_refusals_unchanged_n2),
        cmocka_unit_test(test_engine_n2),
        cmocka_unit_test(test_engine_n2_prefix),
        cmocka_unit_test(test_engine_n2_draft_tp),
        GRAPH_TESTS(q35),
        GRAPH_TESTS(g4),
        GRAPH_TESTS(q3m),
        GRAPH_TESTS(q35m),
        GRAPH_TESTS(g4m),
    };
    const char *only = getenv("TQKV_TEST_FILTER");
    if (only) cmocka_set_test_filter(only);
    const int rc = cmocka_run_group_tests(tests, NULL, NULL);
    printf("%s\n", rc ? "FAIL" : "PASS");
    graphs_free();
    tqkv_model_free(g_model);
    return rc;
}
#else
int main(void) {
    printf("SKIPPED: built without CUDA\n");
    return 77;
}
#endif

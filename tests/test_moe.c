/*
 * test_moe.c - the mixture-of-experts graphs against transformers fp32 goldens of tiny
 * random-weight checkpoints (tests/golden/moe/, made on the GPU machine by
 * tools/make_graph_goldens_moe.py):
 *   - qwen3moe: Qwen3-MoE, 8 experts, top 2 renormalised, layer 1 dense (mlp_only_layers);
 *   - qwen3moe_s2: 6 experts, top 3 raw weights, every second layer sparse;
 *   - qwen35moe / qwen35moe_split: Qwen 3.5 MoE (the hybrid with routed experts and a gated
 *     shared expert on every layer), fused / per-expert tensors;
 *   - gemma4moe: Gemma 4 with MoE blocks beside every MLP;
 *   (the last three skipped, visibly, when their goldens are not in the tree)
 * every prompt alone at every position (rel. L2 < 1e-3), the left-padded batch bitwise equal
 * to the rows alone at 1 and 3 threads (a token's routing and expert sums never depend on
 * the other tokens), prefill + per-token decode, greedy equal to generate(); the sparse
 * layers as loaded; q8 / tq4 caches near the f32 one; config refusals naming the bad field.
 * Without goldens: the experts block (src/model/ops/moe.c) against a float64 reference,
 * and Qwen 3.5 MoE checkpoints derived from the dense Qwen 3.5 golden (moe_derive.h): one
 * whose experts are the dense MLP must give the dense graph's logits bit for bit (either
 * expert layout); a random one must be batch invariant, decode as it prefills, run tq4;
 * Gemma 4 MoE checkpoints derived from gemma4/plain: with the experts' output normed by zero
 * the dense logits (up to one more RMSNorm), with random ones the same invariance checks.
 * Skipped (77) when the Qwen3-MoE goldens are absent.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "graph_golden.h"
#include "model/model_impl.h"
#include "model/ops/moe.h"
#include "model_helpers.h"
#include "moe_derive.h"
#include "testutil.h"
#include "tqkv_model.h"
#include "util/common.h"

static void test_qwen3moe_parity(void **st) {
    (void)st;
    check_parity("moe", "qwen3moe");
}
static void test_qwen3moe_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("moe", "qwen3moe");
}
static void test_qwen3moe_s2_parity(void **st) {
    (void)st;
    check_parity("moe", "qwen3moe_s2");
}
static void test_qwen3moe_s2_decode_greedy(void **st) {
    (void)st;
    check_decode_greedy("moe", "qwen3moe_s2");
}

/* The config as loaded: experts, top-k, sparse layers (decoder_sparse_step / mlp_only_layers). */
static void test_config(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "moe", "qwen3moe");
    tqkv_model *m = load_model(&g);
    const tqkv_model_config *c = tqkv_model_get_config(m);
    assert_int_equal(c->arch, TQKV_ARCH_QWEN3_MOE);
    assert_int_equal(c->n_experts, 8);
    assert_int_equal(c->n_experts_used, 2);
    assert_int_equal(c->norm_topk_prob, 1);
    assert_int_equal(c->n_moe_layers, 2);
    assert_int_equal(c->layer_moe[0], 1);
    assert_int_equal(c->layer_moe[1], 0);
    assert_int_equal(c->layer_moe[2], 1);
    tqkv_model_free(m);
    golden_free(&g);
    golden_load(&g, "moe", "qwen3moe_s2");
    m = load_model(&g);
    c = tqkv_model_get_config(m);
    for (int l = 0; l < 4; l++) assert_int_equal(c->layer_moe[l], l % 2 == 1);
    assert_int_equal(c->norm_topk_prob, 0);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Compressed KV on the MoE graph: q8 and tq4 caches against the f32 cache over every position
 * of prompt 0. Routing is discontinuous (a token whose top-k flips under the cache's error
 * takes other experts), so the bounds are looser than a dense graph's at this size
 * (test_qwen35 minicpm5, the same attention shape: tq4 7.7e-2); q8 must stay far below tq4. */
static void test_qwen3moe_kv_formats(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "moe", "qwen3moe");
    tqkv_model *m = load_model(&g);
    const int V = g.vocab, n = g.n[0];
    const tqkv_format fm[3] = {TQKV_F32, TQKV_Q8, TQKV_TQ4};
    float *out[3];
    for (int k = 0; k < 3; k++) {
        out[k] = malloc(sizeof(float) * (size_t)n * V);
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.rows = 1;
        sp.threads = 2;
        sp.k_format = sp.v_format = fm[k];
        tqkv_model_state *s = NULL;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(tqkv_model_prefill(m, s, g.ids[0], NULL, n, TQKV_LOGITS_ALL, out[k]), TQKV_OK);
        tqkv_model_state_free(s);
    }
    const double e8 = rel_l2(out[1], out[0], (size_t)n * V), e4 = rel_l2(out[2], out[0], (size_t)n * V);
    printf("qwen3moe vs the f32 cache, %d positions: q8 rel L2 %.3g, tq4 %.3g\n", n, e8, e4);
    assert_true(e8 > 0 && e8 < 0.02);
    assert_true(e4 > e8 && e4 < 0.3);
    for (int k = 0; k < 3; k++) free(out[k]);
    tqkv_model_free(m);
    golden_free(&g);
}

/* Each bad field is refused with a message naming it. */
static void test_refusals(void **st) {
    (void)st;
    char p[1024];
    char *text = slurp(source_path("tests/golden/moe/qwen3moe/config.json", p, sizeof p), NULL);
    assert_non_null(text);
    /* (the goldens' config says num_local_experts, as transformers 5 saves it) */
    const struct { const char *key; double v; int del; } bad[] = {
        {"num_local_experts", 0, 0}, {"num_experts_per_tok", 9, 0}, {"num_local_experts", 0, 1},
        {"moe_intermediate_size", 0, 1}, {"decoder_sparse_step", 0, 0}, {"num_experts", 1.5, 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *j = cJSON_Parse(text);
        assert_non_null(j);
        cJSON_DeleteItemFromObject(j, bad[i].key);
        if (!bad[i].del) cJSON_AddNumberToObject(j, bad[i].key, bad[i].v);
        char *out = cJSON_PrintUnformatted(j);
        tqkv_model_config c;
        const tqkv_status rc = model_config_parse(out, strlen(out), "bad.json", &c);
        printf("refused (%d): %s\n", (int)rc, tqkv_last_error());
        assert_int_equal(rc, TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), bad[i].key));
        free(out);
        cJSON_Delete(j);
    }
    cJSON *j = cJSON_Parse(text);
    cJSON_DeleteItemFromObject(j, "mlp_only_layers");
    cJSON *l = cJSON_CreateIntArray((const int[]){0, 7}, 2);
    cJSON_AddItemToObject(j, "mlp_only_layers", l);
    char *out = cJSON_PrintUnformatted(j);
    tqkv_model_config c;
    assert_int_equal(model_config_parse(out, strlen(out), "bad.json", &c), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "mlp_only_layers"));
    free(out);
    cJSON_Delete(j);
    free(text);
}

// ---------------------------------------------------------------------------
// the experts block (src/model/ops/moe.c) against float64
// ---------------------------------------------------------------------------

static mm_weight f32_weight(float *w, int n, int k, test_rng *r, float sd) {
    rng_fill_normal(r, w, (size_t)n * k, sd);
    mm_weight m = {0};
    m.data = w;
    m.type = MM_F32;
    m.n = n;
    m.k = k;
    return m;
}

static double dot_d(const float *w, const float *x, int k) {
    double s = 0;
    for (int i = 0; i < k; i++) s += (double)w[i] * x[i];
    return s;
}

/* y [H] += wgt * down(act(g x) * u x) in float64 (act: SiLU, or GELU-tanh if gelu). */
static void swiglu_ref(const float *g, const float *u, const float *dn, int I, int H,
                       const float *x, double wgt, int gelu, double *y) {
    double *h = malloc(sizeof(double) * I);
    for (int i = 0; i < I; i++) {
        double a = dot_d(g + (size_t)i * H, x, H), b = dot_d(u + (size_t)i * H, x, H);
        h[i] = (gelu ? 0.5 * a * (1 + tanh(0.79788456080286536 * (a + 0.044715 * a * a * a)))
                     : a / (1 + exp(-a))) * b;
    }
    for (int j = 0; j < H; j++) {
        double s = 0;
        for (int i = 0; i < I; i++) s += (double)dn[(size_t)j * I + i] * h[i];
        y[j] += wgt * s;
    }
    free(h);
}

/* One shape: moe_forward's increment vs float64, and token 3 alone bitwise equal to token 3
 * in the batch. Experts unfused (g / u), the shared expert fused (sh_gu). gemma: GELU-tanh
 * experts, a per-expert scale of the weights and the router on its own input (moe_experts). */
static void moe_case(test_rng *r, moe_shape sh, int T, int gemma) {
    const int H = sh.hidden, E = sh.n_experts, I = sh.inter, S = sh.shared_inter;
    float *rw = malloc(sizeof(float) * E * H), *gw = malloc(sizeof(float) * E * I * H),
          *uw = malloc(sizeof(float) * E * I * H), *dw = malloc(sizeof(float) * E * H * I);
    float *sgu = malloc(sizeof(float) * (2 * S + 1) * H), *sdw = malloc(sizeof(float) * (H * S + 1)),
          *sgw = malloc(sizeof(float) * H);
    moe_layer L = {0};
    L.router = f32_weight(rw, E, H, r, 1.0f);
    L.gu = calloc((size_t)E, sizeof(mm_weight));
    L.g = calloc((size_t)E, sizeof(mm_weight));
    L.u = calloc((size_t)E, sizeof(mm_weight));
    L.down = calloc((size_t)E, sizeof(mm_weight));
    for (int e = 0; e < E; e++) {
        L.g[e] = f32_weight(gw + (size_t)e * I * H, I, H, r, 1.0f / sqrtf((float)H));
        L.u[e] = f32_weight(uw + (size_t)e * I * H, I, H, r, 1.0f / sqrtf((float)H));
        L.down[e] = f32_weight(dw + (size_t)e * H * I, H, I, r, 1.0f / sqrtf((float)I));
    }
    if (S) {
        L.sh_gu = f32_weight(sgu, 2 * S, H, r, 1.0f / sqrtf((float)H));
        L.sh_down = f32_weight(sdw, H, S, r, 1.0f / sqrtf((float)S));
        L.sh_gate = f32_weight(sgw, 1, H, r, 1.0f);
    }
    float *xn = malloc(sizeof(float) * T * H), *x0 = malloc(sizeof(float) * T * H),
          *x = malloc(sizeof(float) * T * H), *got = malloc(sizeof(float) * T * H),
          *xr = malloc(sizeof(float) * T * H), escale[64];
    double *ref = calloc((size_t)T * H, sizeof(double));
    rng_fill_normal(r, xn, (size_t)T * H, 1.0f);
    rng_fill_normal(r, x0, (size_t)T * H, 1.0f);
    rng_fill_normal(r, xr, (size_t)T * H, 1.0f);
    for (int e = 0; e < E; e++) escale[e] = 1.0f + 0.3f * (float)rng_normal(r);
    if (gemma) {
        sh.act = MOE_ACT_GELU_TANH;
        L.expert_scale = escale;
    }
    memcpy(x, x0, sizeof(float) * T * H);
    moe_scratch sc = {0};
    if (gemma) {
        assert_int_equal(moe_scratch_reserve(&sc, &sh, (size_t)T), TQKV_OK);
        assert_int_equal(moe_experts(&L, &sh, xr, xn, sc.acc, (size_t)T, 2, &sc), TQKV_OK);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] += sc.acc[i];
    } else {
        assert_int_equal(moe_forward(&L, &sh, xn, x, (size_t)T, 2, &sc), TQKV_OK);
    }
    for (int t = 0; t < T; t++) {
        const float *v = xn + (size_t)t * H, *vr = gemma ? xr + (size_t)t * H : v;
        double p[64], mx = -1e300, sum = 0;
        for (int e = 0; e < E; e++) mx = fmax(mx, p[e] = dot_d(rw + (size_t)e * H, vr, H));
        for (int e = 0; e < E; e++) sum += p[e] = exp(p[e] - mx);
        int sel[64] = {0};
        double w[64], wsum = 0;
        for (int k = 0; k < sh.top_k; k++) {
            int b = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int j = 0; j < k; j++) taken |= sel[j] == e;
                if (!taken && (b < 0 || p[e] > p[b])) b = e;
            }
            sel[k] = b;
            wsum += w[k] = p[b] / sum;
        }
        for (int k = 0; k < sh.top_k; k++) {
            const int e = sel[k];
            const double wk = (sh.norm_topk ? w[k] / wsum : w[k]) * (gemma ? escale[e] : 1.0);
            swiglu_ref(gw + (size_t)e * I * H, uw + (size_t)e * I * H, dw + (size_t)e * H * I, I, H,
                       v, wk, gemma, ref + (size_t)t * H);
        }
        if (S) {
            const double gs = 1 / (1 + exp(-dot_d(sgw, v, H)));
            swiglu_ref(sgu, sgu + (size_t)S * H, sdw, S, H, v, gs, gemma, ref + (size_t)t * H);
        }
    }
    for (size_t i = 0; i < (size_t)T * H; i++) got[i] = x[i] - x0[i];
    const double err = rel_l2_d(got, ref, (size_t)T * H);
    printf("moe block H %d, %d experts top %d%s, shared %d, %d tokens%s: rel L2 vs float64 %.2e\n",
           H, E, sh.top_k, sh.norm_topk ? " renormalised" : "", S, T,
           gemma ? " (GELU, per-expert scale, own router input)" : "", err);
    assert_true(err < 1e-5);
    /* token 3 alone: the same bits as in the batch */
    float *x1 = malloc(sizeof(float) * H);
    memcpy(x1, x0 + 3 * (size_t)H, sizeof(float) * H);
    if (gemma) {
        assert_int_equal(moe_experts(&L, &sh, xr + 3 * (size_t)H, xn + 3 * (size_t)H, sc.acc, 1, 1,
                                     &sc), TQKV_OK);
        for (int j = 0; j < H; j++) x1[j] += sc.acc[j];
    } else {
        assert_int_equal(moe_forward(&L, &sh, xn + 3 * (size_t)H, x1, 1, 1, &sc), TQKV_OK);
    }
    assert_memory_equal(x1, x + 3 * (size_t)H, sizeof(float) * H);
    moe_scratch_free(&sc);
    free(x1); free(xn); free(x0); free(x); free(got); free(ref); free(xr);
    free(L.gu); free(L.g); free(L.u); free(L.down);
    free(rw); free(gw); free(uw); free(dw); free(sgu); free(sdw); free(sgw);
}

static void test_moe_block_reference(void **st) {
    (void)st;
    test_rng r;
    rng_init(&r, test_seed());
    moe_case(&r, (moe_shape){48, 5, 2, 24, 1, 0, MOE_ACT_SILU}, 9, 0);   /* Qwen3-MoE-like */
    moe_case(&r, (moe_shape){48, 6, 3, 16, 0, 0, MOE_ACT_SILU}, 7, 0);   /* raw top-k weights */
    moe_case(&r, (moe_shape){64, 8, 2, 16, 1, 40, MOE_ACT_SILU}, 11, 0); /* Qwen 3.5 MoE */
    moe_case(&r, (moe_shape){32, 4, 4, 8, 1, 12, MOE_ACT_SILU}, 6, 0);   /* every expert */
    moe_case(&r, (moe_shape){64, 8, 2, 24, 1, 0, MOE_ACT_SILU}, 10, 1);  /* Gemma 4 */
}

// ---------------------------------------------------------------------------
// Qwen 3.5 MoE on checkpoints derived from the dense Qwen 3.5 golden
// ---------------------------------------------------------------------------

static tqkv_model *load_dir(const char *dir) {
    tqkv_model *m = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    tqkv_status rc = tqkv_model_load(&m, dir, &lp);
    if (rc != TQKV_OK) fprintf(stderr, "load %s: %s\n", dir, tqkv_last_error());
    assert_int_equal(rc, TQKV_OK);
    return m;
}

/* Logits of every prompt of g alone, every position: [n_prompts][nmax, V]. */
static float *prompts_alone(const tqkv_model *m, const golden *g, int nmax, int threads,
                            tqkv_format fmt) {
    const int V = g->vocab;
    float *out = calloc((size_t)g->n_prompts * nmax * V, sizeof(float));
    for (int i = 0; i < g->n_prompts; i++) {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.rows = 1;
        sp.threads = threads;
        sp.k_format = sp.v_format = fmt;
        tqkv_model_state *s = NULL;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(tqkv_model_prefill(m, s, g->ids[i], NULL, g->n[i], TQKV_LOGITS_ALL,
                                            out + (size_t)i * nmax * V), TQKV_OK);
        tqkv_model_state_free(s);
    }
    return out;
}

static int max_len(const golden *g) {
    int n = 0;
    for (int i = 0; i < g->n_prompts; i++) n = g->n[i] > n ? g->n[i] : n;
    return n;
}

/* Median over the n positions of each position's rel L2 of a against b ([n, V]): a
 * compressed cache's error without the few positions where a routing flip (a token taking
 * other experts under the cache's error) dominates the total. */
static double median_pos_err(const float *a, const float *b, int n, int V) {
    double *e = malloc(sizeof(double) * (size_t)n);
    for (int i = 0; i < n; i++) e[i] = rel_l2(a + (size_t)i * V, b + (size_t)i * V, (size_t)V);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && e[j] < e[j - 1]; j--) {
            const double t = e[j];
            e[j] = e[j - 1];
            e[j - 1] = t;
        }
    const double med = e[n / 2];
    free(e);
    return med;
}

/* Experts that are the dense MLP (top 1 of 2, weight exactly 1; shared expert zero): the
 * dense graph's logits bit for bit, with fused and with per-expert tensors. */
static void test_qwen35moe_dense_equiv(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    tqkv_model *dense = load_model(&g);
    const int nmax = max_len(&g), V = g.vocab;
    float *want = prompts_alone(dense, &g, nmax, 2, TQKV_F32);
    for (int fused = 0; fused <= 1; fused++) {
        char dir[] = "/tmp/tqkv_q35moe_eqXXXXXX";
        assert_non_null(mkdtemp(dir));
        derive_spec d = {2, 1, tqkv_model_get_config(dense)->intermediate_size, 8, fused, 1,
                         test_seed(), 0};
        derive_qwen35moe(dir, &d);
        tqkv_model *m = load_dir(dir);
        assert_int_equal(tqkv_model_get_config(m)->arch, TQKV_ARCH_QWEN35_MOE);
        float *got = prompts_alone(m, &g, nmax, 2, TQKV_F32);
        for (int i = 0; i < g.n_prompts; i++)
            assert_memory_equal(got + (size_t)i * nmax * V, want + (size_t)i * nmax * V,
                                sizeof(float) * g.n[i] * V);
        printf("qwen35moe with the dense MLP as experts (%s): %d prompts bitwise equal to the "
               "dense graph\n", fused ? "fused tensors" : "one tensor per expert", g.n_prompts);
        free(got);
        tqkv_model_free(m);
        derive_remove(dir);
    }
    free(want);
    tqkv_model_free(dense);
    golden_free(&g);
}

/* Random experts: the left-padded batch bitwise equal to the rows alone (1 and 3 threads),
 * prefill then per-token decode near the full prefill, q8 / tq4 caches near f32. */
static void test_qwen35moe_derived_rows(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    char dir[] = "/tmp/tqkv_q35moe_rdXXXXXX";
    assert_non_null(mkdtemp(dir));
    derive_spec d = {6, 2, 32, 24, 1, 0, test_seed(), 0};
    derive_qwen35moe(dir, &d);
    tqkv_model *m = load_dir(dir);
    const tqkv_model_config *c = tqkv_model_get_config(m);
    assert_int_equal(c->n_moe_layers, c->n_layers);
    assert_int_equal(c->moe_shared_intermediate_size, 24);
    assert_int_equal(c->intermediate_size, 0);
    assert_int_equal(c->norm_topk_prob, 1);
    const int nmax = max_len(&g), V = g.vocab, R = g.n_prompts;
    float *alone = prompts_alone(m, &g, nmax, 2, TQKV_F32);
    int32_t *tok = calloc((size_t)R * nmax, sizeof(int32_t));
    int lens[4];
    for (int r = 0; r < R; r++) {
        lens[r] = g.n[r];
        memcpy(tok + (size_t)r * nmax + (nmax - g.n[r]), g.ids[r], sizeof(int32_t) * g.n[r]);
    }
    float *lb = malloc(sizeof(float) * (size_t)R * nmax * V);
    for (int threads = 1; threads <= 3; threads += 2) {
        tqkv_model_state *s = new_state(m, R, threads);
        assert_int_equal(tqkv_model_prefill(m, s, tok, lens, nmax, TQKV_LOGITS_ALL, lb), TQKV_OK);
        for (int r = 0; r < R; r++)
            assert_memory_equal(lb + ((size_t)r * nmax + (nmax - g.n[r])) * V,
                                alone + (size_t)r * nmax * V, sizeof(float) * g.n[r] * V);
        tqkv_model_state_free(s);
    }
    /* prefill 40 tokens of prompt 0, decode the rest */
    tqkv_model_state *s = new_state(m, 1, 2);
    const int n0 = 40;
    assert_int_equal(tqkv_model_prefill(m, s, g.ids[0], NULL, n0, TQKV_LOGITS_LAST, lb), TQKV_OK);
    double worst = rel_l2(lb, alone + (size_t)(n0 - 1) * V, (size_t)V);
    for (int j = n0; j < g.n[0]; j++) {
        assert_int_equal(tqkv_model_decode(m, s, &g.ids[0][j], lb), TQKV_OK);
        const double e = rel_l2(lb, alone + (size_t)j * V, (size_t)V);
        worst = e > worst ? e : worst;
    }
    printf("qwen35moe derived: decode %d..%d vs prefill worst rel L2 %.2e\n", n0, g.n[0] - 1, worst);
    assert_true(worst < 1e-4);
    tqkv_model_state_free(s);
    /* compressed KV (prompt 0 alone) */
    float *q8 = prompts_alone(m, &g, nmax, 2, TQKV_Q8), *t4 = prompts_alone(m, &g, nmax, 2, TQKV_TQ4);
    const double e8 = rel_l2(q8, alone, (size_t)g.n[0] * V), e4 = rel_l2(t4, alone, (size_t)g.n[0] * V),
                 m8 = median_pos_err(q8, alone, g.n[0], V), m4 = median_pos_err(t4, alone, g.n[0], V);
    printf("qwen35moe derived vs the f32 cache, %d positions: q8 rel L2 %.3g (median position "
           "%.3g), tq4 %.3g (median %.3g)\n", g.n[0], e8, m8, e4, m4);
    assert_true(m8 > 0 && m8 < 0.02);
    assert_true(m4 > m8 && m4 < 0.3 && e4 < 0.5);
    free(q8);
    free(t4);
    free(lb);
    free(tok);
    free(alone);
    tqkv_model_free(m);
    derive_remove(dir);
    golden_free(&g);
}

/* The text model of a Qwen3_5MoeForConditionalGeneration checkpoint (text_config, tensors
 * under model.language_model.): the plain checkpoint's logits, bitwise. */
static void test_qwen35moe_wrapper(void **st) {
    (void)st;
    golden g;
    golden_load(&g, "qwen35", "hybrid");
    char a[] = "/tmp/tqkv_q35moe_plXXXXXX", b[] = "/tmp/tqkv_q35moe_wrXXXXXX";
    assert_non_null(mkdtemp(a));
    assert_non_null(mkdtemp(b));
    derive_spec d = {4, 2, 16, 24, 0, 0, test_seed(), 0};
    derive_qwen35moe(a, &d);
    d.wrapped = 1;
    derive_qwen35moe(b, &d);
    tqkv_model *ma = load_dir(a), *mb = load_dir(b);
    assert_string_equal(tqkv_model_get_config(mb)->arch_name, "Qwen3_5MoeForConditionalGeneration");
    assert_int_equal(tqkv_model_get_config(mb)->arch, TQKV_ARCH_QWEN35_MOE);
    const int nmax = max_len(&g);
    float *la = prompts_alone(ma, &g, nmax, 2, TQKV_F32), *lb = prompts_alone(mb, &g, nmax, 2, TQKV_F32);
    assert_memory_equal(la, lb, sizeof(float) * (size_t)g.n_prompts * nmax * g.vocab);
    free(la);
    free(lb);
    tqkv_model_free(ma);
    tqkv_model_free(mb);
    derive_remove(a);
    derive_remove(b);
    golden_free(&g);
}

/* Refusals: each bad field of a Qwen 3.5 MoE config named; the dense name with experts and
 * Qwen3-Next refused as unsupported. */
static void test_qwen35moe_refusals(void **st) {
    (void)st;
    char dir[] = "/tmp/tqkv_q35moe_cfXXXXXX", p[1200];
    assert_non_null(mkdtemp(dir));
    derive_spec d = {4, 2, 16, 8, 1, 0, 1, 0};
    derive_qwen35moe(dir, &d);
    snprintf(p, sizeof p, "%s/config.json", dir);
    char *text = slurp(p, NULL);
    assert_non_null(text);
    const struct { const char *key; double v; int del; } bad[] = {
        {"num_experts", 0, 0}, {"num_experts_per_tok", 5, 0}, {"num_experts", 0, 1},
        {"moe_intermediate_size", 0, 1}, {"shared_expert_intermediate_size", 0, 1},
        {"shared_expert_intermediate_size", 2.5, 0},
    };
    tqkv_model_config c;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *j = cJSON_Parse(text);
        cJSON_DeleteItemFromObject(j, bad[i].key);
        if (!bad[i].del) cJSON_AddNumberToObject(j, bad[i].key, bad[i].v);
        char *out = cJSON_PrintUnformatted(j);
        const tqkv_status rc = model_config_parse(out, strlen(out), "bad.json", &c);
        printf("refused (%d): %s\n", (int)rc, tqkv_last_error());
        assert_int_equal(rc, TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), bad[i].key));
        free(out);
        cJSON_Delete(j);
    }
    /* accepted as is; the dense architecture name with experts is refused */
    assert_int_equal(model_config_parse(text, strlen(text), "ok.json", &c), TQKV_OK);
    assert_int_equal(c.arch, TQKV_ARCH_QWEN35_MOE);
    cJSON *j = cJSON_Parse(text);
    cJSON_DeleteItemFromObject(j, "architectures");
    cJSON_DeleteItemFromObject(j, "model_type");
    cJSON_AddStringToObject(j, "model_type", "qwen3_5_text");
    cJSON_AddNumberToObject(j, "intermediate_size", 128);
    char *out = cJSON_PrintUnformatted(j);
    assert_int_equal(model_config_parse(out, strlen(out), "dense.json", &c), TQKV_EUNSUPPORTED);
    printf("refused: %s\n", tqkv_last_error());
    assert_non_null(strstr(tqkv_last_error(), "Qwen3_5MoeForCausalLM"));
    free(out);
    cJSON_Delete(j);
    const char *next = "{\"architectures\":[\"Qwen3NextForCausalLM\"],\"model_type\":\"qwen3_next\"}";
    assert_int_equal(model_config_parse(next, strlen(next), "next.json", &c), TQKV_EUNSUPPORTED);
    assert_non_null(strstr(tqkv_last_error(), "Qwen3-Next"));
    free(text);
    derive_remove(dir);
}

/* The Qwen 3.5 MoE goldens, when they are in the tree (else skipped, visibly). */
static int have_golden(const char *variant) {
    char rel[256], p[1024];
    snprintf(rel, sizeof rel, "tests/golden/moe/%s/goldens.json", variant);
    FILE *f = fopen(source_path(rel, p, sizeof p), "rb");
    if (!f) {
        printf("SKIPPED: %s missing (tools/make_graph_goldens_moe.py --only %s makes it)\n", p,
               variant);
        return 0;
    }
    fclose(f);
    return 1;
}
static void test_qwen35moe_parity(void **st) {
    (void)st;
    if (!have_golden("qwen35moe")) { skip(); return; }
    check_parity("moe", "qwen35moe");
}
static void test_qwen35moe_decode_greedy(void **st) {
    (void)st;
    if (!have_golden("qwen35moe")) { skip(); return; }
    check_decode_greedy("moe", "qwen35moe");
}
static void test_qwen35moe_split_parity(void **st) {
    (void)st;
    if (!have_golden("qwen35moe_split")) { skip(); return; }
    check_parity("moe", "qwen35moe_split");
}
static void test_qwen35moe_split_decode_greedy(void **st) {
    (void)st;
    if (!have_golden("qwen35moe_split")) { skip(); return; }
    check_decode_greedy("moe", "qwen35moe_split");
}

// ---------------------------------------------------------------------------
// Gemma 4 with MoE blocks on checkpoints derived from the dense Gemma 4 golden
// ---------------------------------------------------------------------------

/* Rows of random tokens (lengths len[r], left-padded to n) prefilled alone: [R][n, V]. */
static float *g4_alone(const tqkv_model *m, const int32_t *tok, const int *len, int R, int n,
                       int threads, tqkv_format fmt) {
    const int V = tqkv_model_get_config(m)->vocab_size;
    float *out = calloc((size_t)R * n * V, sizeof(float));
    for (int r = 0; r < R; r++) {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        sp.rows = 1;
        sp.threads = threads;
        sp.k_format = sp.v_format = fmt;
        tqkv_model_state *s = NULL;
        assert_int_equal(tqkv_model_state_init(&s, m, &sp), TQKV_OK);
        assert_int_equal(tqkv_model_prefill(m, s, tok + (size_t)r * n + (n - len[r]), NULL, len[r],
                                            TQKV_LOGITS_ALL, out + (size_t)r * n * V), TQKV_OK);
        tqkv_model_state_free(s);
    }
    return out;
}

static void g4_tokens(test_rng *r, int V, int32_t *tok, int *len, int R, int n) {
    for (int i = 0; i < R; i++) {
        len[i] = i == 0 ? n : rng_int(r, 3, n);
        for (int j = 0; j < n; j++) tok[(size_t)i * n + j] = j < n - len[i] ? 0 : rng_int(r, 1, V - 1);
    }
}

/* The experts' output normed by a zero weight: the dense graph's logits up to the second
 * RMSNorm of the MLP output (the dense checkpoint's own weights everywhere else). */
static void test_gemma4moe_near_dense(void **st) {
    (void)st;
    char dir[] = "/tmp/tqkv_g4moe_ndXXXXXX", src[1024];
    assert_non_null(mkdtemp(dir));
    derive_g4_spec d = {4, 2, 32, 1, test_seed()};
    derive_gemma4moe(dir, &d);
    tqkv_model *m = load_dir(dir), *dense = load_dir(source_path("tests/golden/gemma4/plain", src, sizeof src));
    const tqkv_model_config *c = tqkv_model_get_config(m);
    assert_int_equal(c->arch, TQKV_ARCH_GEMMA4);
    assert_int_equal(c->n_experts, 4);
    assert_int_equal(c->n_experts_used, 2);
    assert_int_equal(c->n_moe_layers, c->n_layers);
    test_rng r;
    rng_init(&r, test_seed() ^ 44);
    enum { R = 3, N = 20 };
    int32_t tok[R * N];
    int len[R];
    g4_tokens(&r, c->vocab_size, tok, len, R, N);
    float *a = g4_alone(m, tok, len, R, N, 2, TQKV_F32), *b = g4_alone(dense, tok, len, R, N, 2, TQKV_F32);
    const double e = rel_l2(a, b, (size_t)R * N * c->vocab_size);
    printf("gemma4moe with a zero expert-output norm vs dense gemma4/plain: rel L2 %.2e\n", e);
    assert_true(e > 0 && e < 1e-4);
    free(a);
    free(b);
    tqkv_model_free(m);
    tqkv_model_free(dense);
    derive_remove(dir);
}

/* Random experts: the left-padded batch bitwise equal to the rows alone (1 and 3 threads),
 * decode near prefill (past the sliding window), q8 / tq4 near f32; refusals. */
static void test_gemma4moe_derived_rows(void **st) {
    (void)st;
    char dir[] = "/tmp/tqkv_g4moe_rdXXXXXX";
    assert_non_null(mkdtemp(dir));
    derive_g4_spec d = {6, 2, 24, 0, test_seed()};
    derive_gemma4moe(dir, &d);
    tqkv_model *m = load_dir(dir);
    const int V = tqkv_model_get_config(m)->vocab_size;
    test_rng r;
    rng_init(&r, test_seed() ^ 45);
    enum { R = 3, N = 24 };
    int32_t tok[R * N];
    int len[R];
    g4_tokens(&r, V, tok, len, R, N);
    float *alone = g4_alone(m, tok, len, R, N, 2, TQKV_F32), *lb = malloc(sizeof(float) * R * N * V);
    for (int threads = 1; threads <= 3; threads += 2) {
        tqkv_model_state *s = new_state(m, R, threads);
        assert_int_equal(tqkv_model_prefill(m, s, tok, len, N, TQKV_LOGITS_ALL, lb), TQKV_OK);
        for (int i = 0; i < R; i++)
            assert_memory_equal(lb + ((size_t)i * N + (N - len[i])) * V, alone + (size_t)i * N * V,
                                sizeof(float) * len[i] * V);
        tqkv_model_state_free(s);
    }
    tqkv_model_state *s = new_state(m, 1, 2);
    const int n0 = 6;
    assert_int_equal(tqkv_model_prefill(m, s, tok, NULL, n0, TQKV_LOGITS_LAST, lb), TQKV_OK);
    double worst = rel_l2(lb, alone + (size_t)(n0 - 1) * V, (size_t)V);
    for (int j = n0; j < N; j++) {
        assert_int_equal(tqkv_model_decode(m, s, &tok[j], lb), TQKV_OK);
        const double e = rel_l2(lb, alone + (size_t)j * V, (size_t)V);
        worst = e > worst ? e : worst;
    }
    printf("gemma4moe derived: decode %d..%d vs prefill worst rel L2 %.2e\n", n0, N - 1, worst);
    assert_true(worst < 1e-4);
    tqkv_model_state_free(s);
    float *q8 = g4_alone(m, tok, len, 1, N, 2, TQKV_Q8), *t4 = g4_alone(m, tok, len, 1, N, 2, TQKV_TQ4);
    const double e8 = rel_l2(q8, alone, (size_t)N * V), e4 = rel_l2(t4, alone, (size_t)N * V),
                 m8 = median_pos_err(q8, alone, N, V), m4 = median_pos_err(t4, alone, N, V);
    printf("gemma4moe derived vs the f32 cache, %d positions: q8 rel L2 %.3g (median position "
           "%.3g), tq4 %.3g (median %.3g)\n", N, e8, m8, e4, m4);
    assert_true(m8 > 0 && m8 < 0.02);
    assert_true(m4 > m8 && m4 < 0.3 && e4 < 0.5);
    /* refusals of the block's fields */
    char p[1200];
    snprintf(p, sizeof p, "%s/config.json", dir);
    char *text = slurp(p, NULL);
    const struct { const char *key; double v; int del; } bad[] = {
        {"num_experts", 0, 1}, {"top_k_experts", 7, 0}, {"moe_intermediate_size", 0, 1},
        {"top_k_experts", 0, 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *j = cJSON_Parse(text);
        cJSON_DeleteItemFromObject(j, bad[i].key);
        if (!bad[i].del) cJSON_AddNumberToObject(j, bad[i].key, bad[i].v);
        char *out = cJSON_PrintUnformatted(j);
        tqkv_model_config c;
        const tqkv_status rc = model_config_parse(out, strlen(out), "bad.json", &c);
        printf("refused (%d): %s\n", (int)rc, tqkv_last_error());
        assert_int_equal(rc, TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), bad[i].key));
        free(out);
        cJSON_Delete(j);
    }
    free(text);
    free(q8);
    free(t4);
    free(lb);
    free(alone);
    tqkv_model_free(m);
    derive_remove(dir);
}

/* The goldens' configs as loaded, and their compressed caches (every prompt, every
 * position; the median position's rel L2, as for the derived checkpoints). */
static void golden_config_kv(const char *variant, tqkv_arch arch, int E, int K, int I, int S) {
    golden g;
    golden_load(&g, "moe", variant);
    tqkv_model *m = load_model(&g);
    const tqkv_model_config *c = tqkv_model_get_config(m);
    assert_int_equal(c->arch, arch);
    assert_int_equal(c->n_experts, E);
    assert_int_equal(c->n_experts_used, K);
    assert_int_equal(c->moe_intermediate_size, I);
    assert_int_equal(c->moe_shared_intermediate_size, S);
    assert_int_equal(c->n_moe_layers, c->n_layers);
    assert_int_equal(c->norm_topk_prob, 1);
    const int nmax = max_len(&g), V = g.vocab;
    float *f = prompts_alone(m, &g, nmax, 2, TQKV_F32), *q8 = prompts_alone(m, &g, nmax, 2, TQKV_Q8),
          *t4 = prompts_alone(m, &g, nmax, 2, TQKV_TQ4);
    const double m8 = median_pos_err(q8, f, g.n[0], V), m4 = median_pos_err(t4, f, g.n[0], V);
    printf("%s vs the f32 cache, prompt 0 (%d positions): q8 rel L2 %.3g (median position %.3g), "
           "tq4 %.3g (median %.3g)\n", variant, g.n[0], rel_l2(q8, f, (size_t)g.n[0] * V), m8,
           rel_l2(t4, f, (size_t)g.n[0] * V), m4);
    assert_true(m8 > 0 && m8 < 0.02);
    assert_true(m4 > m8 && m4 < 0.3);
    free(f);
    free(q8);
    free(t4);
    tqkv_model_free(m);
    golden_free(&g);
}
static void test_moe_golden_configs(void **st) {
    (void)st;
    if (!have_golden("qwen35moe") || !have_golden("qwen35moe_split") || !have_golden("gemma4moe")) {
        skip();
        return;
    }
    golden_config_kv("qwen35moe", TQKV_ARCH_QWEN35_MOE, 8, 2, 32, 48);
    golden_config_kv("qwen35moe_split", TQKV_ARCH_QWEN35_MOE, 6, 3, 24, 40);
    golden_config_kv("gemma4moe", TQKV_ARCH_GEMMA4, 8, 2, 32, 0);
}

static void test_gemma4moe_parity(void **st) {
    (void)st;
    if (!have_golden("gemma4moe")) { skip(); return; }
    check_parity("moe", "gemma4moe");
}
static void test_gemma4moe_decode_greedy(void **st) {
    (void)st;
    if (!have_golden("gemma4moe")) { skip(); return; }
    check_decode_greedy("moe", "gemma4moe");
}

int main(void) {
    char p[1024];
    FILE *f = fopen(source_path("tests/golden/moe/qwen3moe/goldens.json", p, sizeof p), "rb");
    if (!f) {
        printf("SKIPPED: %s missing (tools/make_graph_goldens_moe.py makes it)\n", p);
        return 77;
    }
    fclose(f);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3moe_parity),      cmocka_unit_test(test_qwen3moe_decode_greedy),
        cmocka_unit_test(test_qwen3moe_s2_parity),   cmocka_unit_test(test_qwen3moe_s2_decode_greedy),
        cmocka_unit_test(test_config),               cmocka_unit_test(test_qwen3moe_kv_formats),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_moe_block_reference),  cmocka_unit_test(test_qwen35moe_dense_equiv),
        cmocka_unit_test(test_qwen35moe_derived_rows), cmocka_unit_test(test_qwen35moe_refusals),
        cmocka_unit_test(test_qwen35moe_wrapper),
        cmocka_unit_test(test_qwen35moe_parity),     cmocka_unit_test(test_qwen35moe_decode_greedy),
        cmocka_unit_test(test_qwen35moe_split_parity),
        cmocka_unit_test(test_qwen35moe_split_decode_greedy),
        cmocka_unit_test(test_gemma4moe_near_dense), cmocka_unit_test(test_gemma4moe_derived_rows),
        cmocka_unit_test(test_gemma4moe_parity),     cmocka_unit_test(test_gemma4moe_decode_greedy),
        cmocka_unit_test(test_moe_golden_configs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * test_model_rows_graphs.c - model-level row operations (src/model/state/rows.c) and the
 * engine on the two new graphs, with the tiny random-weight checkpoints committed under
 * tests/golden: Gemma 4 (gemma4/base: sliding window 8 with bounded caches, KV-shared
 * layers), Qwen 3.5 (qwen35/hybrid: gated DeltaNet layers with recurrent state rows) and
 * Qwen3-MoE (moe/qwen3moe: routed experts; rows and engine only) and Qwen 3.5 MoE
 * (moe/qwen35moe: the hybrid's recurrent rows with routed experts and a shared expert; rows
 * and engine only; until its goldens are in the tree, checkpoints derived from the hybrid
 * golden by moe_derive.h in a temporary directory), and Gemma 4 with MoE blocks (derived
 * from gemma4/plain: sliding window 4, bounded caches; rows and engine only).
 * For each graph: rows merged into a running state mid-generation, filtered (reordered),
 * extracted and re-inserted, and spec rounds with a per-row rollback give logits BITWISE
 * equal to each row run alone without those operations; export / import round-trips
 * byte for byte and refuses another model's state; the state check catches a recurrent
 * row out of step; projected bytes bound the sliding layers and count the recurrent rows;
 * and the engine gives N concurrent requests exactly the tokens of the same requests run
 * one at a time, with a prefix-cache hit equal to a miss, and with a draft model (the
 * target itself; another tiny checkpoint of its vocab) exactly the tokens and logprobs of
 * the engine without one, greedy and seeded sampled (verification windows reproduce single
 * decodes bit for bit: extend_as_decode).
 * Needs no ../shared fixture (the checkpoints are in the source tree, or derived from one).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/arch/gemma4/gemma4.h"
#include "model/model_impl.h"
#include "model/state/recurrent.h"
#include "moe_derive.h"
#include "testutil.h"
#include "tqkv_engine.h"
#include "tqkv_model.h"

#define OK(x)                                                                                     \
    do {                                                                                          \
        tqkv_status rc_ = (x);                                                                    \
        if (rc_ != TQKV_OK) fail_msg("%s: %s", #x, tqkv_last_error());                            \
    } while (0)

enum { SLACK = 4 };

typedef struct {
    const char *variant; /* under tests/golden, or an absolute directory */
    tqkv_model *m;
    int V;
} graph;

#define N_GRAPHS 5
static graph g_graph[N_GRAPHS] = {{"gemma4/base", NULL, 0}, {"qwen35/hybrid", NULL, 0},
                                  {"moe/qwen3moe", NULL, 0}, {"moe/qwen35moe", NULL, 0},
                                  {"(derived gemma4moe)", NULL, 0}};
/* each graph's other checkpoint of the same vocab (a draft that rejects) */
static const char *g_other[N_GRAPHS] = {"gemma4/plain", "qwen35/minicpm5", "moe/qwen3moe_s2",
                                        "moe/qwen35moe_split", "(derived)"};
/* derived checkpoints (moe_derive.h): Qwen 3.5 MoE when its goldens are absent ([0], [1]),
 * Gemma 4 MoE always ([2], [3]) */
static char g_derived[4][64];

/* The directory of a variant (tests/golden/<variant>, or the variant itself if absolute). */
static const char *variant_dir(const char *variant, char *buf, size_t cap) {
    if (variant[0] == '/') {
        snprintf(buf, cap, "%s", variant);
        return buf;
    }
    char rel[256];
    snprintf(rel, sizeof rel, "tests/golden/%s", variant);
    return source_path(rel, buf, cap);
}

static tqkv_model_state *new_state(const graph *g, int rows, tqkv_format k, tqkv_format v) {
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.rows = rows;
    p.k_format = k;
    p.v_format = v;
    p.window_slack = SLACK;
    p.threads = 2;
    tqkv_model_state *s = NULL;
    OK(tqkv_model_state_init(&s, g->m, &p));
    return s;
}

static void random_tokens(test_rng *r, int V, int32_t *t, int n) {
    for (int i = 0; i < n; i++) t[i] = rng_int(r, 1, V - 1);
}

static uint8_t *snap(const tqkv_model_state *s, size_t *len) {
    uint8_t *b = NULL;
    OK(tqkv_model_state_export(s, &b, len));
    return b;
}

/* Run row i of `run` (rows[i] names its reference) one decode step: every row's logits
 * bitwise equal to its reference state decoding the same token alone. */
static void decode_compare(const graph *g, tqkv_model_state *run, tqkv_model_state **ref,
                           const int *rows, int nr, test_rng *r, float *la, float *lb,
                           const char *what) {
    const int V = g->V;
    int32_t tok[8];
    random_tokens(r, V, tok, nr);
    OK(tqkv_model_decode(g->m, run, tok, la));
    OK(tqkv_model_state_check(run));
    for (int i = 0; i < nr; i++) {
        OK(tqkv_model_decode(g->m, ref[rows[i]], &tok[i], lb));
        if (memcmp(la + (size_t)i * V, lb, sizeof(float) * (size_t)V))
            fail_msg("%s, %s: row %d (ref %d) logits differ from the row run alone", g->variant,
                     what, i, rows[i]);
    }
}

// ---------------------------------------------------------------------------
// merge / filter / extract / spec rounds vs rows run alone
// ---------------------------------------------------------------------------

static void rows_bitwise(const graph *g, tqkv_format kf, tqkv_format vf, test_rng *r) {
    enum { R = 4, K = 3 };
    const int V = g->V;
    tqkv_model_state *ref[R], *src[R];
    int32_t prompt[R][64];
    int n[R];
    float *la = malloc(sizeof(float) * (size_t)R * V), *lb = malloc(sizeof(float) * (size_t)V);
    for (int i = 0; i < R; i++) {
        n[i] = rng_int(r, 1, 40); /* longer than window + slack (12): sliding layers drop */
        random_tokens(r, V, prompt[i], n[i]);
        ref[i] = new_state(g, 1, kf, vf);
        src[i] = new_state(g, 1, kf, vf);
        OK(tqkv_model_prefill(g->m, ref[i], prompt[i], NULL, n[i], TQKV_LOGITS_NONE, NULL));
        OK(tqkv_model_prefill(g->m, src[i], prompt[i], NULL, n[i], TQKV_LOGITS_NONE, NULL));
    }
    /* an empty running state; rows 0 and 1 join */
    tqkv_model_state *run = new_state(g, 1, kf, vf);
    OK(tqkv_model_state_filter(run, NULL, 0));
    { /* a state with no rows refuses a forward (it holds no buffers to run on) */
        const int32_t none[1] = {0};
        assert_int_equal(tqkv_model_decode(g->m, run, none, NULL), TQKV_ESTATE);
    }
    OK(tqkv_model_state_merge(run, src, 2));
    int rows[R] = {0, 1, -1, -1}, nr = 2;
    for (int step = 0; step < 14; step++) {
        if (step == 3) { /* newcomers 2, 3 prefilled as their own left-padded batch, merged */
            int nn = n[2] > n[3] ? n[2] : n[3], lens[2] = {n[2], n[3]};
            int32_t *tk = calloc((size_t)2 * nn, sizeof(int32_t)); /* [2, nn] */
            memcpy(tk + (nn - n[2]), prompt[2], sizeof(int32_t) * (size_t)n[2]);
            memcpy(tk + nn + (nn - n[3]), prompt[3], sizeof(int32_t) * (size_t)n[3]);
            tqkv_model_state *pair = new_state(g, 2, kf, vf);
            OK(tqkv_model_prefill(g->m, pair, tk, lens, nn, TQKV_LOGITS_NONE, NULL));
            OK(tqkv_model_state_merge(run, &pair, 1));
            tqkv_model_state_free(pair);
            free(tk);
            rows[2] = 2;
            rows[3] = 3;
            nr = 4;
        }
        if (step == 6) { /* row 1 leaves; the others reordered */
            int keep[3] = {2, 0, 3};
            OK(tqkv_model_state_filter(run, keep, 3));
            int nrows[R] = {rows[2], rows[0], rows[3], -1};
            memcpy(rows, nrows, sizeof rows);
            nr = 3;
        }
        if (step == 8) { /* extract row 0, drop it, re-insert it at the end */
            tqkv_model_state *one = NULL;
            OK(tqkv_model_state_extract_row(run, 0, &one));
            int keep[2] = {1, 2};
            OK(tqkv_model_state_filter(run, keep, 2));
            OK(tqkv_model_state_merge(run, &one, 1));
            tqkv_model_state_free(one);
            int nrows[R] = {rows[1], rows[2], rows[0], -1};
            memcpy(rows, nrows, sizeof rows);
        }
        if (step == 10 || step == 12) { /* a spec round: K drafts by decode, per-row keep */
            int32_t d[K][R];
            int keep[R], before[R], after[R];
            for (int i = 0; i < nr; i++) keep[i] = rng_int(r, 0, K);
            if (step == 12) keep[0] = 0; /* a fully rejected row */
            OK(tqkv_model_state_offsets(run, before));
            OK(tqkv_model_state_spec_begin(run));
            assert_int_equal(tqkv_model_state_spec_active(run), 1);
            assert_int_equal(tqkv_model_state_spec_begin(run), TQKV_ESTATE);
            for (int k = 0; k < K; k++) {
                random_tokens(r, V, d[k], nr);
                OK(tqkv_model_decode(g->m, run, d[k], la));
                OK(tqkv_model_state_check(run));
            }
            /* refused while the round is open, and a keep past the drafts: nothing changes */
            tqkv_model_state *x = NULL;
            assert_int_equal(tqkv_model_state_extract_row(run, 0, &x), TQKV_ESTATE);
            int bad[R];
            memcpy(bad, keep, sizeof bad);
            bad[nr - 1] = K + 1;
            assert_int_equal(tqkv_model_state_spec_rollback(run, bad, nr), TQKV_ERANGE);
            assert_int_equal(tqkv_model_state_spec_active(run), 1);
            OK(tqkv_model_state_spec_rollback(run, keep, nr));
            assert_int_equal(tqkv_model_state_spec_active(run), 0);
            OK(tqkv_model_state_check(run));
            OK(tqkv_model_state_offsets(run, after));
            for (int i = 0; i < nr; i++) {
                assert_int_equal(after[i], before[i] + keep[i]);
                for (int k = 0; k < keep[i]; k++) /* the reference never drafted */
                    OK(tqkv_model_decode(g->m, ref[rows[i]], &d[k][i], lb));
            }
        }
        char what[64];
        snprintf(what, sizeof what, "%s/%s step %d", tqkv_format_name(kf), tqkv_format_name(vf),
                 step);
        decode_compare(g, run, ref, rows, nr, r, la, lb, what);
    }
    /* export / import: byte-identical, continues bitwise; another model's state refused */
    size_t len, len2;
    uint8_t *b = snap(run, &len);
    tqkv_model_state_params p = tqkv_model_state_params_default();
    p.k_format = kf;
    p.v_format = vf;
    p.window_slack = SLACK;
    p.threads = 2;
    tqkv_model_state *imp = NULL;
    OK(tqkv_model_state_import(&imp, g->m, &p, b, len));
    uint8_t *b2 = snap(imp, &len2);
    assert_int_equal(len2, len);
    assert_memory_equal(b2, b, len);
    free(b2);
    decode_compare(g, imp, ref, rows, nr, r, la, lb, "after import");
    const graph *other = g == &g_graph[0] ? &g_graph[1] : &g_graph[0];
    tqkv_model_state *bad = NULL;
    assert_int_not_equal(tqkv_model_state_import(&bad, other->m, &p, b, len), TQKV_OK);
    assert_null(bad);
    printf("%s %s/%s: refused import into the other graph: %s\n", g->variant,
           tqkv_format_name(kf), tqkv_format_name(vf), tqkv_last_error());
    b[len / 2] ^= 0x40; /* a flipped byte inside a section: refused (checksums) */
    assert_int_not_equal(tqkv_model_state_import(&bad, g->m, &p, b, len), TQKV_OK);
    assert_null(bad);
    free(b);
    tqkv_model_state_free(imp);
    tqkv_model_state_free(run);
    for (int i = 0; i < R; i++) {
        tqkv_model_state_free(ref[i]);
        tqkv_model_state_free(src[i]);
    }
    free(la);
    free(lb);
}

static void test_rows_gemma4(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 41);
    rows_bitwise(&g_graph[0], TQKV_TQ4, TQKV_TQ4, &r);
    rows_bitwise(&g_graph[0], TQKV_TQ3, TQKV_F16, &r);
}

static void test_rows_qwen35(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 35);
    rows_bitwise(&g_graph[1], TQKV_TQ4, TQKV_TQ4, &r);
    rows_bitwise(&g_graph[1], TQKV_TQ3, TQKV_F16, &r);
}

static void test_rows_moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 24);
    rows_bitwise(&g_graph[2], TQKV_TQ4, TQKV_TQ4, &r);
    rows_bitwise(&g_graph[2], TQKV_TQ3, TQKV_F16, &r);
}

// ---------------------------------------------------------------------------
// checks, projections, prefix reuse
// ---------------------------------------------------------------------------

static void test_invariants_and_bytes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 7);
    /* Gemma 4: sliding layers bounded, shared layers NULL; bytes bounded by window + slack */
    const graph *g = &g_graph[0];
    tqkv_model_state *s = new_state(g, 1, TQKV_TQ4, TQKV_TQ4);
    int32_t t[60];
    random_tokens(&r, g->V, t, 60);
    OK(tqkv_model_prefill(g->m, s, t, NULL, 60, TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_state_check(s));
    size_t p100 = tqkv_model_state_projected_bytes(s, 100),
           p200 = tqkv_model_state_projected_bytes(s, 200);
    size_t full = 0; /* bytes of the non-sliding layers only grow with tokens */
    for (int l = 0; l < g->m->cfg.n_layers; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (b && !gemma4_of(g->m)->cfg.sliding[l])
            full += tqkv_batch_projected_bytes(b, 200) - tqkv_batch_projected_bytes(b, 100);
    }
    assert_int_equal(p200 - p100, full); /* sliding layers contribute a bounded amount */
    /* a row whose sliding layers dropped tokens: no shorter prefix is reusable */
    assert_true(tqkv_model_state_min_reusable_offset(s, 0) > 60);
    tqkv_model_state *sh = new_state(g, 1, TQKV_TQ4, TQKV_TQ4);
    OK(tqkv_model_prefill(g->m, sh, t, NULL, 10, TQKV_LOGITS_NONE, NULL));
    assert_true(tqkv_model_state_min_reusable_offset(sh, 0) <= 10);
    tqkv_model_state_free(sh);
    tqkv_model_state_free(s);

    /* Qwen 3.5: recurrent rows are a fixed per-row cost; a row out of step is caught */
    g = &g_graph[1];
    s = new_state(g, 2, TQKV_TQ4, TQKV_TQ4);
    size_t fixed = tqkv_model_state_row_fixed_bytes(s);
    assert_true(fixed > 0);
    size_t kvonly = 0;
    for (int l = 0; l < g->m->cfg.n_layers; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        if (b) kvonly += tqkv_batch_projected_bytes(b, 50);
    }
    assert_int_equal(tqkv_model_state_projected_bytes(s, 50), kvonly + fixed);
    int32_t t2[2 * 20];
    random_tokens(&r, g->V, t2, 40);
    OK(tqkv_model_prefill(g->m, s, t2, NULL, 20, TQKV_LOGITS_NONE, NULL));
    OK(tqkv_model_state_check(s));
    assert_int_equal(tqkv_model_state_min_reusable_offset(s, 1), 20); /* only the whole row */
    s->rec->tokens[1]++;
    assert_int_equal(tqkv_model_state_check(s), TQKV_ESTATE);
    assert_non_null(strstr(tqkv_last_error(), "recurrent"));
    tqkv_model_state *x = NULL;
    assert_int_equal(tqkv_model_state_extract_row(s, 0, &x), TQKV_ESTATE);
    assert_int_equal(tqkv_model_state_filter(s, (int[]){0}, 1), TQKV_ESTATE);
    assert_int_equal(tqkv_model_state_rows(s), 2);
    s->rec->tokens[1]--;
    OK(tqkv_model_state_check(s));
    tqkv_model_state_free(s);
}

// ---------------------------------------------------------------------------
// engine: concurrent == one at a time; prefix-cache hit == miss
// ---------------------------------------------------------------------------

typedef struct {
    int32_t toks[64];
    int     n_tok, done, cached;
    float   lp[64];
} result;

static void on_event(void *user, uint64_t id, const tqkv_engine_event *ev) {
    (void)id;
    result *r = user;
    if (ev->token >= 0 && r->n_tok < 64) {
        r->lp[r->n_tok] = ev->logprob;
        r->toks[r->n_tok++] = ev->token;
    }
    if (ev->done) {
        r->done = 1;
        r->cached = ev->cached_tokens;
    }
}

typedef struct {
    int32_t  prompt[128];
    int      n_prompt, max_tokens;
    float    temp;  /* 0: greedy */
    uint64_t seed;
} job;

/* A model directory for the engine: the tiny checkpoint plus the bundled tokenizer (its
 * ids cover the tiny vocab; prompts are given as ids). */
static void make_engine_dir(const graph *g, char *dir, size_t cap) {
    char src[1024], tok[1024], cmd[8192];
    snprintf(dir, cap, "/tmp/tqkv_rows_graph_%d_%d", (int)getpid(), (int)(g - g_graph));
    variant_dir(g->variant, src, sizeof src);
    source_path("models/qwen3-code-28m/tokenizer.json", tok, sizeof tok);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s' && ln -s '%s/config.json' "
             "'%s/model.safetensors' '%s' '%s/'", dir, dir, src, src, tok, dir);
    assert_int_equal(system(cmd), 0);
}

static tqkv_engine *engine_new(const char *dir, size_t prefix_bytes, const char *draft) {
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = dir;
    p.draft_dir = draft;
    p.draft_tokens = 3;
    p.k_format = p.v_format = TQKV_TQ4;
    p.threads = 2;
    p.prefill_chunk = 16;
    p.prefix_cache_bytes = prefix_bytes;
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    return e;
}

static void submit(tqkv_engine *e, const job *j, result *r) {
    memset(r, 0, sizeof *r);
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j->prompt;
    q.n_prompt = j->n_prompt;
    q.max_tokens = j->max_tokens;
    q.sampling = tqkv_sampler_params_default();
    q.sampling.temperature = j->temp;
    q.sampling.seed = j->seed;
    q.ignore_eos = 1;
    q.top_logprobs = 1;
    q.on_event = on_event;
    q.user = r;
    uint64_t id = 0;
    OK(tqkv_engine_submit(e, &q, &id));
}

static void run_until_idle(tqkv_engine *e) {
    int busy = 1, guard = 0;
    while (busy) {
        OK(tqkv_engine_step(e, &busy));
        assert_true(++guard < 100000);
    }
}

/* Submit j[0..n) one every 2 engine steps (rows join a running batch), run until idle. */
static void run_joining(tqkv_engine *e, const job *j, int n, result *res) {
    int next = 0, busy = 1, steps = 0;
    while (busy || next < n) {
        if (next < n && steps % 2 == 0) {
            submit(e, &j[next], &res[next]);
            next++;
        }
        OK(tqkv_engine_step(e, &busy));
        assert_true(++steps < 100000);
    }
}

static void assert_same(const result *a, const result *b, const char *what, int i) {
    if (a->n_tok != b->n_tok || memcmp(a->toks, b->toks, sizeof(int32_t) * (size_t)a->n_tok) ||
        memcmp(a->lp, b->lp, sizeof(float) * (size_t)a->n_tok))
        fail_msg("%s: request %d differs (%d vs %d tokens)", what, i, a->n_tok, b->n_tok);
}

static void engine_graph(const graph *g, test_rng *r) {
    enum { NJ = 6 };
    char dir[512];
    make_engine_dir(g, dir, sizeof dir);
    tqkv_engine *e = engine_new(dir, 0, NULL);
    job j[NJ];
    memset(j, 0, sizeof j); /* greedy */
    for (int i = 0; i < NJ; i++) {
        j[i].n_prompt = rng_int(r, 1, 90); /* several chunks; past window + slack (40) */
        random_tokens(r, g->V, j[i].prompt, j[i].n_prompt);
        j[i].max_tokens = rng_int(r, 1, 20);
    }
    result alone[NJ], together[NJ];
    for (int i = 0; i < NJ; i++) {
        submit(e, &j[i], &alone[i]);
        run_until_idle(e);
        assert_int_equal(alone[i].done, 1);
        assert_int_equal(alone[i].n_tok, j[i].max_tokens);
    }
    run_joining(e, j, NJ, together);
    for (int i = 0; i < NJ; i++) assert_same(&together[i], &alone[i], g->variant, i);
    tqkv_engine_free(e);

    /* prefix cache: a prompt sharing 70 tokens with an earlier one hits at a chunk
     * boundary (64) and gives the miss's tokens */
    job a = j[0], b;
    a.n_prompt = 100;
    random_tokens(r, g->V, a.prompt, a.n_prompt);
    a.max_tokens = 10;
    b = a;
    b.n_prompt = 90;
    random_tokens(r, g->V, b.prompt + 70, 20);
    result ma, mb, ha, hb;
    e = engine_new(dir, 0, NULL);
    submit(e, &a, &ma);
    run_until_idle(e);
    submit(e, &b, &mb);
    run_until_idle(e);
    tqkv_engine_free(e);
    e = engine_new(dir, 32 << 20, NULL);
    submit(e, &a, &ha);
    run_until_idle(e);
    submit(e, &b, &hb);
    run_until_idle(e);
    assert_int_equal(ha.cached, 0);
    assert_int_equal(hb.cached, 64);
    assert_same(&ha, &ma, "prefix miss", 0);
    assert_same(&hb, &mb, "prefix hit", 1);
    tqkv_engine_free(e);

    /* a draft model: the same tokens and logprobs as without one, for greedy and seeded
     * sampled requests joining a running batch. Drafts: the target itself (greedy rows
     * accept every proposal) and another tiny checkpoint of the same vocab (random weights:
     * proposals almost always rejected, so every round rolls rows back) */
    char other[1024];
    const char *orel = g_other[g - g_graph];
    variant_dir(orel, other, sizeof other);
    const char *drafts[2] = {dir, other};
    job dj[NJ];
    result dref[NJ], dout[NJ];
    for (int i = 0; i < NJ; i++) {
        dj[i] = j[i];
        dj[i].temp = i % 2 ? 0.8f : 0.0f;
        dj[i].seed = 1000 + (uint64_t)i;
    }
    e = engine_new(dir, 0, NULL);
    run_joining(e, dj, NJ, dref);
    tqkv_engine_free(e);
    for (int d = 0; d < 2; d++) {
        e = engine_new(dir, 0, drafts[d]);
        run_joining(e, dj, NJ, dout);
        for (int i = 0; i < NJ; i++) assert_same(&dout[i], &dref[i], "draft", i);
        tqkv_engine_stats st;
        OK(tqkv_engine_stats_get(e, &st));
        assert_true(st.spec_rounds > 0 && st.spec_accepted <= st.spec_drafted);
        if (d == 0) assert_true(st.spec_accepted > 0);
        printf("%s, draft %s: %d requests == no draft; %llu rounds, %llu of %llu accepted\n",
               g->variant, d ? orel : "itself", NJ, (unsigned long long)st.spec_rounds,
               (unsigned long long)st.spec_accepted, (unsigned long long)st.spec_drafted);
        tqkv_engine_free(e);
    }
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_engine_gemma4(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 404);
    engine_graph(&g_graph[0], &r);
}

static void test_engine_qwen35(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 353);
    engine_graph(&g_graph[1], &r);
}

static void test_engine_moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 2424);
    engine_graph(&g_graph[2], &r);
}

static void test_rows_qwen35moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 3524);
    rows_bitwise(&g_graph[3], TQKV_TQ4, TQKV_TQ4, &r);
    rows_bitwise(&g_graph[3], TQKV_TQ3, TQKV_F16, &r);
}

static void test_engine_qwen35moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 352424);
    engine_graph(&g_graph[3], &r);
}

static void test_rows_gemma4moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 4424);
    rows_bitwise(&g_graph[4], TQKV_TQ4, TQKV_TQ4, &r);
    rows_bitwise(&g_graph[4], TQKV_TQ3, TQKV_F16, &r);
}

static void test_engine_gemma4moe(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 442424);
    engine_graph(&g_graph[4], &r);
}

static int derive_dir(int i) {
    snprintf(g_derived[i], sizeof g_derived[i], "/tmp/tqkv_rows_moe_%d_%d", (int)getpid(), i);
    return mkdir(g_derived[i], 0755);
}

/* Qwen 3.5 MoE: its goldens, else two checkpoints derived from the hybrid golden; Gemma 4
 * MoE: two derived from gemma4/plain. */
static int derive_missing(void) {
    char d[1024];
    variant_dir(g_graph[3].variant, d, sizeof d);
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", d);
    if (access(p, R_OK) != 0) {
        const derive_spec spec[2] = {{6, 2, 32, 24, 1, 0, 11, 0}, {4, 3, 16, 40, 0, 0, 12, 0}};
        for (int i = 0; i < 2; i++) {
            if (derive_dir(i) != 0) return -1;
            derive_qwen35moe(g_derived[i], &spec[i]);
        }
        printf("qwen35moe goldens absent: rows and engine on checkpoints derived from "
               "qwen35/hybrid (%s, %s)\n", g_derived[0], g_derived[1]);
        g_graph[3].variant = g_derived[0];
        g_other[3] = g_derived[1];
    }
    const derive_g4_spec g4[2] = {{6, 2, 24, 0, 21}, {4, 2, 16, 0, 22}};
    for (int i = 0; i < 2; i++) {
        if (derive_dir(2 + i) != 0) return -1;
        derive_gemma4moe(g_derived[2 + i], &g4[i]);
    }
    g_graph[4].variant = g_derived[2];
    g_other[4] = g_derived[3];
    return 0;
}

int main(void) {
    if (derive_missing() != 0) {
        perror("mkdir");
        return 1;
    }
    for (int i = 0; i < N_GRAPHS; i++) {
        char d[1024];
        variant_dir(g_graph[i].variant, d, sizeof d);
        tqkv_model_load_params lp = tqkv_model_load_params_default();
        if (tqkv_model_load(&g_graph[i].m, d, &lp) != TQKV_OK) {
            fprintf(stderr, "load %s: %s\n", d, tqkv_last_error());
            return 1;
        }
        g_graph[i].V = tqkv_model_get_config(g_graph[i].m)->vocab_size;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_gemma4),
        cmocka_unit_test(test_rows_qwen35),
        cmocka_unit_test(test_invariants_and_bytes),
        cmocka_unit_test(test_engine_gemma4),
        cmocka_unit_test(test_engine_qwen35),
        cmocka_unit_test(test_rows_moe),
        cmocka_unit_test(test_engine_moe),
        cmocka_unit_test(test_rows_qwen35moe),
        cmocka_unit_test(test_engine_qwen35moe),
        cmocka_unit_test(test_rows_gemma4moe),
        cmocka_unit_test(test_engine_gemma4moe),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < N_GRAPHS; i++) tqkv_model_free(g_graph[i].m);
    for (int i = 0; i < 4; i++)
        if (g_derived[i][0]) derive_remove(g_derived[i]);
    return rc;
}

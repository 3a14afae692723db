/*
 * test_engine_choices.c - n choices per request (OpenAI's n) and OpenAI's sampling
 * parameters in the serving engine, on the bundled model:
 *   - n = 4 greedy: every choice equals a single request (tokens, text, logprobs), and
 *     the request costs one prefill: the engine's prefill_tokens counter grows by the
 *     prompt once, against four times for four single requests;
 *   - n = 3 sampled with a seed: choice i equals a single request with seed + i, alone
 *     and beside other rows; every choice carries logprobs;
 *   - frequency / presence penalties and logit_bias through the engine equal the same
 *     parameters decoded one token at a time with tqkv_model_decode + tqkv_sampler
 *     (the reference loop here), and change the output;
 *   - cancel ends every choice; n beyond parallel is refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine_helpers.h"
#include "json_schema_corpus.h"

static char g_dir[4096];
static const char *g_schema; /* json_schema of submit_json (NULL: none) */

/* Events of an n-choice request, split by index. */
typedef struct {
    result ch[8];
    int    bad_index;
} multi;

static void on_multi(void *user, uint64_t id, const tqkv_engine_event *ev) {
    multi *m = user;
    if (ev->index < 0 || ev->index >= 8) {
        m->bad_index = 1;
        return;
    }
    on_event(&m->ch[ev->index], id, ev);
}

typedef struct {
    float   freq, pres;
    int32_t bias_ids[4];
    float   bias_vals[4];
    int     n_bias;
} openai_p;

static uint64_t submit_n(tqkv_engine *e, const job *j, int n, const openai_p *op, multi *m) {
    memset(m, 0, sizeof *m);
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j->prompt;
    q.n_prompt = j->n_prompt;
    q.max_tokens = j->max_tokens;
    q.sampling = tqkv_sampler_params_default();
    q.sampling.temperature = j->temp;
    q.sampling.top_p = j->temp > 0 ? 0.9f : 1.0f;
    q.sampling.seed = j->seed;
    if (op) {
        q.sampling.frequency_penalty = op->freq;
        q.sampling.presence_penalty = op->pres;
        q.sampling.bias_ids = op->bias_ids;
        q.sampling.bias_vals = op->bias_vals;
        q.sampling.n_bias = op->n_bias;
    }
    q.ignore_eos = 1;
    q.top_logprobs = j->top_logprobs ? j->top_logprobs : -1;
    q.on_event = on_multi;
    q.user = m;
    q.n = n;
    uint64_t id = 0;
    OK(tqkv_engine_submit(e, &q, &id));
    return id;
}

static uint64_t prefill_count(tqkv_engine *e) {
    tqkv_engine_stats st;
    OK(tqkv_engine_stats_get(e, &st));
    return st.prefill_tokens;
}

static void random_job(test_rng *r, job *j, int V, int n_prompt, int max_tokens, float temp) {
    memset(j, 0, sizeof *j);
    j->n_prompt = n_prompt;
    for (int t = 0; t < n_prompt; t++) j->prompt[t] = rng_int(r, 1, V - 1);
    j->max_tokens = max_tokens;
    j->temp = temp;
    j->seed = rng_u64(r);
    j->top_logprobs = 2;
}

static void test_n4_greedy_one_prefill(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine *e = engine_open(g_dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    int V = tqkv_model_get_config(tqkv_engine_model(e))->vocab_size;
    job j;
    random_job(&r, &j, V, 150, 12, 0.0f);
    multi m;
    uint64_t p0 = prefill_count(e);
    submit_n(e, &j, 4, NULL, &m);
    run_until_idle(e);
    uint64_t p1 = prefill_count(e);
    assert_false(m.bad_index);
    result single[4];
    for (int i = 0; i < 4; i++) submit(e, &j, &single[i]);
    run_until_idle(e);
    uint64_t p2 = prefill_count(e);
    fprintf(stderr, "prefill tokens: n=4 request %llu, four single requests %llu (prompt %d)\n",
            (unsigned long long)(p1 - p0), (unsigned long long)(p2 - p1), j.n_prompt);
    assert_int_equal(p1 - p0, (uint64_t)j.n_prompt);      /* one prefill */
    assert_int_equal(p2 - p1, 4 * (uint64_t)j.n_prompt);  /* four (no prefix cache here) */
    for (int i = 0; i < 4; i++) {
        assert_true(m.ch[i].done);
        assert_int_equal(m.ch[i].n_tok, j.max_tokens);
        assert_same_tokens(&m.ch[i], &single[i]); /* logprobs included: every choice has them */
        assert_int_equal(m.ch[i].n_top, 2);
    }
    tqkv_engine_free(e);
}

static void test_n3_seeded_beside_others(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine *e = engine_open(g_dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    int V = tqkv_model_get_config(tqkv_engine_model(e))->vocab_size;
    job j, other;
    random_job(&r, &j, V, 90, 10, 0.9f);
    random_job(&r, &other, V, 40, 16, 0.0f);
    multi m;
    result ro, alone[3];
    submit(e, &other, &ro); /* a row already running when the choices join */
    OK(tqkv_engine_step(e, NULL));
    submit_n(e, &j, 3, NULL, &m);
    run_until_idle(e);
    for (int i = 0; i < 3; i++) {
        job ji = j;
        ji.seed = j.seed + (uint64_t)i;
        submit(e, &ji, &alone[i]);
        run_until_idle(e);
        assert_same_tokens(&m.ch[i], &alone[i]);
    }
    /* sampled choices differ from each other (with 10 tokens at T 0.9, all equal would be
     * a bug in the seeding) */
    assert_true(memcmp(m.ch[0].toks, m.ch[1].toks, sizeof(int32_t) * 10) ||
                memcmp(m.ch[0].toks, m.ch[2].toks, sizeof(int32_t) * 10));
    tqkv_engine_free(e);
}

/* The reference: one row decoded token by token with the model and a sampler. */
static void reference_run(tqkv_engine *e, const job *j, const openai_p *op, int32_t *out) {
    const tqkv_model *m = tqkv_engine_model(e);
    int V = tqkv_model_get_config(m)->vocab_size;
    tqkv_model_state_params sp = tqkv_model_state_params_default();
    sp.k_format = sp.v_format = TQKV_TQ4;
    sp.threads = 2;
    tqkv_model_state *st = NULL;
    OK(tqkv_model_state_init(&st, m, &sp));
    float *l = malloc(sizeof(float) * (size_t)V);
    /* the engine prefills in chunks of 64 at fixed boundaries: the same here */
    for (int at = 0; at < j->n_prompt; at += 64) {
        int n = j->n_prompt - at < 64 ? j->n_prompt - at : 64;
        tqkv_logits_mode mode = at + n == j->n_prompt ? TQKV_LOGITS_LAST : TQKV_LOGITS_NONE;
        if (at == 0) OK(tqkv_model_prefill(m, st, j->prompt, NULL, n, mode, l));
        else OK(tqkv_model_extend(m, st, j->prompt + at, n, mode, l));
    }
    tqkv_sampler_params p = tqkv_sampler_params_default();
    p.temperature = j->temp;
    p.top_p = j->temp > 0 ? 0.9f : 1.0f;
    p.seed = j->seed;
    p.frequency_penalty = op->freq;
    p.presence_penalty = op->pres;
    p.bias_ids = op->bias_ids;
    p.bias_vals = op->bias_vals;
    p.n_bias = op->n_bias;
    tqkv_sampler *s = NULL;
    OK(tqkv_sampler_init(&s, &p, V));
    tqkv_sampler_mark_prompt_end(s);
    for (int i = 0; i < j->max_tokens; i++) {
        int t = -1;
        OK(tqkv_sampler_sample(s, l, &t));
        out[i] = t;
        OK(tqkv_sampler_accept(s, t));
        if (i + 1 < j->max_tokens) {
            int32_t tk = t;
            OK(tqkv_model_decode(m, st, &tk, l));
        }
    }
    tqkv_sampler_free(s);
    free(l);
    tqkv_model_state_free(st);
}

static void test_penalties_and_bias(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine *e = engine_open(g_dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    int V = tqkv_model_get_config(tqkv_engine_model(e))->vocab_size;
    job j;
    random_job(&r, &j, V, 70, 24, 0.0f);
    j.top_logprobs = 0;
    openai_p none = {0}, op = {0};
    op.freq = 1.5f;
    op.pres = 0.5f;
    multi plain, pen, both;
    submit_n(e, &j, 1, &none, &plain);
    run_until_idle(e);
    /* the plain greedy output's first token banned, its next other token favoured (a
     * token given twice is refused: outputs may repeat their first token) */
    int32_t fav = (plain.ch[0].toks[0] + 1) % V;
    for (int i = 1; i < j.max_tokens; i++)
        if (plain.ch[0].toks[i] != plain.ch[0].toks[0]) {
            fav = plain.ch[0].toks[i];
            break;
        }
    op.n_bias = 2;
    op.bias_ids[0] = plain.ch[0].toks[0];
    op.bias_vals[0] = -100;
    op.bias_ids[1] = fav;
    op.bias_vals[1] = 3;
    submit_n(e, &j, 1, &op, &pen);
    job js = j;
    js.temp = 0.7f;
    submit_n(e, &js, 2, &op, &both); /* sampled, two choices, beside the greedy row */
    run_until_idle(e);
    int32_t ref[64];
    reference_run(e, &j, &op, ref);
    assert_memory_equal(pen.ch[0].toks, ref, sizeof(int32_t) * (size_t)j.max_tokens);
    assert_true(memcmp(pen.ch[0].toks, plain.ch[0].toks, sizeof(int32_t) * (size_t)j.max_tokens) != 0);
    assert_true(pen.ch[0].toks[0] != plain.ch[0].toks[0]);
    for (int c = 0; c < 2; c++) {
        job jc = js;
        jc.seed = js.seed + (uint64_t)c;
        reference_run(e, &jc, &op, ref);
        assert_memory_equal(both.ch[c].toks, ref, sizeof(int32_t) * (size_t)j.max_tokens);
    }
    tqkv_engine_free(e);
}

static void test_cancel_and_limits(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine_params p = tqkv_engine_params_default();
    p.model_dir = g_dir;
    p.threads = 2;
    p.parallel = 4;
    tqkv_engine *e = NULL;
    OK(tqkv_engine_init(&e, &p));
    int V = tqkv_model_get_config(tqkv_engine_model(e))->vocab_size;
    job j;
    random_job(&r, &j, V, 30, 40, 0.0f);
    multi m;
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j.prompt;
    q.n_prompt = j.n_prompt;
    q.max_tokens = 4;
    q.sampling = tqkv_sampler_params_default();
    q.top_logprobs = -1;
    q.on_event = on_multi;
    q.user = &m;
    q.n = 5; /* beyond parallel 4 */
    uint64_t id;
    assert_int_equal(tqkv_engine_submit(e, &q, &id), TQKV_EINVAL);
    /* cancel while the choices run: every one gets its final event */
    id = submit_n(e, &j, 4, NULL, &m);
    OK(tqkv_engine_step(e, NULL));
    OK(tqkv_engine_step(e, NULL));
    OK(tqkv_engine_cancel(e, id));
    run_until_idle(e);
    for (int i = 0; i < 4; i++) {
        assert_true(m.ch[i].done);
        assert_int_equal(m.ch[i].finish, TQKV_FINISH_CANCELLED);
    }
    /* cancel before the prefill finished: still one final event per choice */
    id = submit_n(e, &j, 3, NULL, &m);
    OK(tqkv_engine_cancel(e, id));
    run_until_idle(e);
    for (int i = 0; i < 3; i++) {
        assert_true(m.ch[i].done);
        assert_int_equal(m.ch[i].finish, TQKV_FINISH_CANCELLED);
    }
    tqkv_engine_free(e);
}

/* ------------------------------------------------------------------------- */
/* JSON-object constraint                                                    */
/* ------------------------------------------------------------------------- */

static uint64_t submit_json(tqkv_engine *e, const job *j, int n, int json, multi *m);
static uint64_t submit_json_eos(tqkv_engine *e, const job *j, int n, int json, multi *m, int ignore_eos);

static uint64_t submit_json(tqkv_engine *e, const job *j, int n, int json, multi *m) {
    return submit_json_eos(e, j, n, json, m, 0);
}

static uint64_t submit_json_eos(tqkv_engine *e, const job *j, int n, int json, multi *m, int ignore_eos) {
    memset(m, 0, sizeof *m);
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j->prompt;
    q.n_prompt = j->n_prompt;
    q.max_tokens = j->max_tokens;
    q.sampling = tqkv_sampler_params_default();
    q.sampling.temperature = j->temp;
    q.sampling.seed = j->seed;
    q.top_logprobs = -1;
    q.on_event = on_multi;
    q.user = m;
    q.n = n;
    q.json_object = json;
    q.json_schema = g_schema;
    q.ignore_eos = ignore_eos;
    uint64_t id = 0;
    OK(tqkv_engine_submit(e, &q, &id));
    return id;
}

static void test_json_object(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine *e = engine_open(g_dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    const tqkv_tokenizer *tok = tqkv_engine_tokenizer(e);
    static const char *const prompts[] = {
        "# config as JSON\nconfig = ", "data = json.loads('", "{\"name\": \"", "const settings = ",
        "response = {\"status\": ", "def to_json(self):\n    return ", "payload = ", "[1, 2, 3]\nx = "};
    enum { NP = 8, NC = 2 };
    multi m[NP];
    job j[NP];
    for (int i = 0; i < NP; i++) {
        memset(&j[i], 0, sizeof j[i]);
        int32_t *ids = NULL;
        size_t n = 0;
        OK(tqkv_tokenizer_encode(tok, prompts[i], strlen(prompts[i]), 0, &ids, &n));
        memcpy(j[i].prompt, ids, sizeof(int32_t) * n);
        free(ids);
        j[i].n_prompt = (int)n;
        j[i].max_tokens = 200;
        j[i].temp = i % 2 ? 0.8f : 0.0f;
        j[i].seed = rng_u64(&r);
        submit_json(e, &j[i], NC, 1, &m[i]);
    }
    run_until_idle(e);
    int parsed = 0, cut = 0;
    for (int i = 0; i < NP; i++)
        for (int c = 0; c < NC; c++) {
            result *o = &m[i].ch[c];
            assert_true(o->done);
            o->text[o->text_len] = 0;
            const char *t = o->text;
            while (*t == ' ' || *t == '\n' || *t == '\t' || *t == '\r') t++;
            assert_int_equal(*t, '{'); /* always an object's start */
            if (o->finish == TQKV_FINISH_LENGTH) {
                cut++;
                continue;
            }
            assert_int_equal(o->finish, TQKV_FINISH_STOP);
            cJSON *doc = cJSON_Parse(o->text);
            if (!doc || !cJSON_IsObject(doc)) fail_msg("prompt %d choice %d: not a JSON object: %s", i, c, o->text);
            cJSON_Delete(doc);
            parsed++;
        }
    fprintf(stderr, "json_object: %d of %d outputs closed and parsed, %d cut by max_tokens 200\n",
            parsed, NP * NC, cut);
    assert_true(parsed >= NP * NC / 2);

    /* the cost at 16 streams is measured by `tqkv bench engine --json-object` (constrained
     * and plain steps interleaved, plain rows as long as the constrained ones), not here */
    tqkv_engine_free(e);
}

/* The fixed corpus of 100 schemas through the engine: every output that closed parses and
 * validates against its schema (outputs cut by max_tokens are counted apart). */
static void test_json_schema_corpus(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    tqkv_engine *e = engine_open(g_dir, TQKV_TQ4, 64, 0, NULL, 0, NULL, 0, 0);
    const tqkv_tokenizer *tok = tqkv_engine_tokenizer(e);
    enum { BATCH = 16 };
    int closed = 0, cut = 0, valid = 0;
    for (int b0 = 0; b0 < CORPUS_N; b0 += BATCH) {
        multi m[BATCH];
        cJSON *sch[BATCH];
        char *txt[BATCH];
        int nb = CORPUS_N - b0 < BATCH ? CORPUS_N - b0 : BATCH;
        for (int i = 0; i < nb; i++) {
            sch[i] = corpus_schema(b0 + i);
            txt[i] = cJSON_PrintUnformatted(sch[i]);
            char prompt[512];
            snprintf(prompt, sizeof prompt, "# data %d as JSON\nrecord = ", b0 + i);
            job j;
            memset(&j, 0, sizeof j);
            int32_t *ids = NULL;
            size_t n = 0;
            OK(tqkv_tokenizer_encode(tok, prompt, strlen(prompt), 0, &ids, &n));
            memcpy(j.prompt, ids, sizeof(int32_t) * n);
            free(ids);
            j.n_prompt = (int)n;
            j.max_tokens = 256;
            j.temp = (b0 + i) % 2 ? 0.7f : 0.0f;
            j.seed = rng_u64(&r);
            g_schema = txt[i];
            submit_json(e, &j, 1, 0, &m[i]);
            g_schema = NULL;
        }
        run_until_idle(e);
        for (int i = 0; i < nb; i++) {
            result *o = &m[i].ch[0];
            assert_true(o->done);
            o->text[o->text_len] = 0;
            if (o->finish == TQKV_FINISH_LENGTH) {
                cut++;
            } else {
                assert_int_equal(o->finish, TQKV_FINISH_STOP);
                closed++;
                cJSON *v = cJSON_Parse(o->text);
                if (!v || !corpus_validate(sch[i], v))
                    fail_msg("schema %d %s: output does not validate: %s", b0 + i, txt[i], o->text);
                valid++;
                cJSON_Delete(v);
            }
            free(txt[i]);
            cJSON_Delete(sch[i]);
        }
    }
    fprintf(stderr, "json_schema corpus: %d of %d outputs closed, %d of them valid (100%%); %d cut by "
            "max_tokens 256\n", closed, CORPUS_N, valid, cut);
    assert_int_equal(valid, closed);
    assert_true(closed >= CORPUS_N / 2);
    /* a schema outside the subset is refused at submit, naming the keyword */
    job j;
    memset(&j, 0, sizeof j);
    j.prompt[0] = 100;
    j.n_prompt = 1;
    j.max_tokens = 4;
    multi mm;
    memset(&mm, 0, sizeof mm);
    tqkv_engine_request q;
    memset(&q, 0, sizeof q);
    q.prompt = j.prompt;
    q.n_prompt = 1;
    q.max_tokens = 4;
    q.sampling = tqkv_sampler_params_default();
    q.top_logprobs = -1;
    q.on_event = on_multi;
    q.user = &mm;
    q.json_schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"oneOf\":[]}}}";
    uint64_t id;
    assert_int_equal(tqkv_engine_submit(e, &q, &id), TQKV_EINVAL);
    assert_non_null(strstr(tqkv_last_error(), "oneOf"));
    tqkv_engine_free(e);
}

int main(void) {
    source_path("models/qwen3-code-28m", g_dir, sizeof g_dir);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_n4_greedy_one_prefill),
        cmocka_unit_test(test_n3_seeded_beside_others),
        cmocka_unit_test(test_penalties_and_bias),
        cmocka_unit_test(test_cancel_and_limits),
        cmocka_unit_test(test_json_object),
        cmocka_unit_test(test_json_schema_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

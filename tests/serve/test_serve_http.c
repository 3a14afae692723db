/*
 * test_serve_http.c - the HTTP layer of `tqkv serve` against the engine test double:
 * OpenAI response shapes (completions and chat, whole and streamed, logprobs, usage),
 * error JSON and status for bad input, body limit, API key, unknown routes, queue full,
 * client disconnect -> cancel, draining, malformed and truncated requests, concurrency,
 * an engine failure mid-generation (error object in the stream, 500 when whole).
 * Generation itself (real model) is tested in test_serve_engine.c.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fake_engine.h"
#include "serve_util.h"
#include "testutil.h"

typedef struct {
    tqkv_tokenizer *tok;
    fake_engine    *fe;
    srv_server     *srv;
    int             port;
} fixture;

static int start_ex(fixture *fx, int queue_max, int step_us, const char *api_key, size_t max_body,
                    int first_us, int idle_timeout_s, int fail_after) {
    char path[4096];
    memset(fx, 0, sizeof *fx);
    if (tqkv_tokenizer_load(&fx->tok, source_path("models/qwen3-code-28m", path, sizeof path)) != TQKV_OK)
        return -1;
    fake_params fp = {queue_max, step_us, 4096, first_us, NULL, fail_after};
    if (fake_engine_init(&fx->fe, &fp, fx->tok)) return -1;
    srv_engine eng = fake_engine_bind(fx->fe);
    srv_params sp = srv_params_default();
    sp.port = 0;
    sp.api_key = api_key;
    if (max_body) sp.max_body = max_body;
    if (idle_timeout_s) sp.idle_timeout_s = idle_timeout_s;
    if (srv_start(&fx->srv, &sp, &eng) != TQKV_OK) return -1;
    fx->port = srv_port(fx->srv);
    return fx->port > 0 ? 0 : -1;
}

static int start(fixture *fx, int queue_max, int step_us, const char *api_key, size_t max_body) {
    return start_ex(fx, queue_max, step_us, api_key, max_body, 0, 0, 0);
}

static void stop(fixture *fx) {
    srv_stop_admission(fx->srv);
    fake_engine_free(fx->fe); /* finishes open requests (cancelled) */
    assert_int_equal(srv_wait_idle(fx->srv, 60.0), 0);
    srv_free(fx->srv);
    tqkv_tokenizer_free(fx->tok);
}

/* The fake engine's output for a completions prompt text, max_tokens n. */
static char *expected(const fixture *fx, const char *prompt, int n) {
    int32_t *ids = NULL;
    size_t ni = 0;
    assert_int_equal(tqkv_tokenizer_encode(fx->tok, prompt, strlen(prompt), TQKV_ENCODE_ADD_SPECIAL,
                                           &ids, &ni), TQKV_OK);
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    for (int i = 0; i < n; i++) {
        int32_t t = fake_engine_token(ids, (int)ni, i, tqkv_tokenizer_vocab_size(fx->tok));
        const char *b;
        size_t bn;
        assert_int_equal(tqkv_tokenizer_id_bytes(fx->tok, t, &b, &bn), TQKV_OK);
        while (len + bn + 1 > cap) s = realloc(s, cap *= 2);
        for (size_t k = 0; k < bn; k++) s[len++] = (unsigned char)b[k] < 0x80 && b[k] ? b[k] : '?';
    }
    s[len] = 0;
    free(ids);
    return s;
}

static cJSON *parse_ok(const http_resp *r) {
    cJSON *j = cJSON_Parse(r->body);
    assert_non_null(j);
    return j;
}

/* Error response: status and OpenAI error shape with the expected param (or NULL). */
static void check_error(const http_resp *r, int status, const char *param) {
    if (r->status != status) fprintf(stderr, "status %d body %s\n", r->status, r->body);
    assert_int_equal(r->status, status);
    cJSON *j = parse_ok(r);
    cJSON *e = cJSON_GetObjectItem(j, "error");
    assert_non_null(e);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_true(strlen(cJSON_GetObjectItem(e, "message")->valuestring) > 0);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "type")));
    assert_non_null(cJSON_GetObjectItem(e, "code"));
    cJSON *p = cJSON_GetObjectItem(e, "param");
    assert_non_null(p);
    if (param) {
        assert_true(cJSON_IsString(p));
        assert_string_equal(p->valuestring, param);
    }
    cJSON_Delete(j);
}

static void post_expect_error(int port, const char *path, const char *body, int status,
                              const char *param) {
    http_resp r;
    assert_int_equal(http_do(port, "POST", path, NULL, body, &r), 0);
    check_error(&r, status, param);
    http_resp_free(&r);
}

/* ------------------------------------------------------------------------- */

static void test_completion_shapes(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 0), 0);
    const char *prompt = "def fibonacci(n):";
    char *want = expected(&fx, prompt, 12);
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL,
                             "{\"model\":\"fake-model\",\"prompt\":\"def fibonacci(n):\","
                             "\"max_tokens\":12,\"temperature\":0,\"logprobs\":3}", &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_ok(&r);
    assert_string_equal(cJSON_GetObjectItem(j, "object")->valuestring, "text_completion");
    assert_string_equal(cJSON_GetObjectItem(j, "model")->valuestring, "fake-model");
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, want);
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "length");
    cJSON *lp = cJSON_GetObjectItem(ch, "logprobs");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")), 12);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "token_logprobs")), 12);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "text_offset")), 12);
    cJSON *top0 = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), 0);
    assert_true(cJSON_IsObject(top0) && cJSON_GetArraySize(top0) >= 1 && cJSON_GetArraySize(top0) <= 3);
    cJSON *u = cJSON_GetObjectItem(j, "usage");
    int32_t *ids;
    size_t ni;
    tqkv_tokenizer_encode(fx.tok, prompt, strlen(prompt), TQKV_ENCODE_ADD_SPECIAL, &ids, &ni);
    free(ids);
    assert_int_equal(cJSON_GetObjectItem(u, "prompt_tokens")->valueint, (int)ni);
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, 12);
    assert_int_equal(cJSON_GetObjectItem(u, "total_tokens")->valueint, (int)ni + 12);
    cJSON_Delete(j);
    http_resp_free(&r);

    /* streamed: same text, usage chunk, [DONE] */
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL,
                             "{\"prompt\":\"def fibonacci(n):\",\"max_tokens\":12,\"stream\":true,"
                             "\"stream_options\":{\"include_usage\":true}}", &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strcasestr(r.headers, "content-type: text/event-stream"));
    char finish[32];
    cJSON *usage = NULL;
    int chunks = 0;
    char *got = sse_collect(r.body, 0, finish, sizeof finish, &usage, &chunks);
    assert_non_null(got);
    assert_string_equal(got, want);
    assert_string_equal(finish, "length");
    assert_non_null(usage);
    assert_int_equal(cJSON_GetObjectItem(usage, "completion_tokens")->valueint, 12);
    assert_true(chunks >= 2);
    free(got);
    cJSON_Delete(usage);
    http_resp_free(&r);

    /* a token-id prompt is taken as is; default max_tokens is 16 */
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL,
                             "{\"prompt\":[1000,1001,1002]}", &r), 0);
    assert_int_equal(r.status, 200);
    j = parse_ok(&r);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens")->valueint, 3);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valueint, 16);
    cJSON_Delete(j);
    http_resp_free(&r);
    free(want);
    stop(&fx);
}

static void test_stop_strings(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 0), 0);
    char *full = expected(&fx, "hello world", 40);
    /* pick a stop string from the middle of the output: 3 bytes at a random offset */
    test_rng rng;
    rng_init(&rng, test_seed());
    size_t L = strlen(full);
    assert_true(L > 20);
    size_t off = (size_t)rng_int(&rng, 5, (int)L - 6);
    char stop_s[4] = {full[off], full[off + 1], full[off + 2], 0};
    if (strchr(stop_s, '"') || strchr(stop_s, '\\')) stop_s[0] = stop_s[1] = stop_s[2] = 'q', stop_s[1] = 0;
    char *cut = strstr(full, stop_s);
    size_t want_len = cut ? (size_t)(cut - full) : L;
    for (int stream = 0; stream < 2; stream++) {
        char body[256];
        snprintf(body, sizeof body, "{\"prompt\":\"hello world\",\"max_tokens\":40,\"stop\":[\"%s\"],"
                 "\"stream\":%s}", stop_s, stream ? "true" : "false");
        http_resp r;
        assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, body, &r), 0);
        assert_int_equal(r.status, 200);
        char finish[32];
        char *got = stream ? sse_collect(r.body, 0, finish, sizeof finish, NULL, NULL)
                           : resp_text(r.body, 0, finish, sizeof finish);
        assert_non_null(got);
        assert_int_equal(strlen(got), want_len);
        assert_memory_equal(got, full, want_len);
        assert_string_equal(finish, cut ? "stop" : "length");
        free(got);
        http_resp_free(&r);
    }
    free(full);
    stop(&fx);
}

static void test_bad_requests(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 4096), 0);
    int p = fx.port;
    const char *C = "/v1/completions", *H = "/v1/chat/completions";
    post_expect_error(p, C, "{\"prompt\":", 400, NULL);                     /* truncated */
    post_expect_error(p, C, "", 400, NULL);                                 /* empty */
    post_expect_error(p, C, "[1,2]", 400, "body");                          /* not an object */
    post_expect_error(p, C, "{\"prompt\":\"x\"} trailing", 400, NULL);
    post_expect_error(p, C, "{\"max_tokens\":3}", 400, "prompt");           /* missing */
    post_expect_error(p, C, "{\"prompt\":5}", 400, "prompt");               /* wrong type */
    post_expect_error(p, C, "{\"prompt\":\"x\",\"max_tokens\":\"3\"}", 400, "max_tokens");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"max_tokens\":2.5}", 400, "max_tokens");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"max_tokens\":5000}", 400, "max_tokens");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"temperature\":2.5}", 400, "temperature");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"n\":17}", 400, "n");
    post_expect_error(p, C, "{\"prompt\":[\"a\",\"b\"]}", 400, "prompt");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"stop\":[1]}", 400, "stop");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"stop\":\"\"}", 400, "stop");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"stream\":1}", 400, "stream");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"logprobs\":21}", 400, "logprobs");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"seed\":\"s\"}", 400, "seed");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"ignore_eos\":3}", 400, "ignore_eos");
    post_expect_error(p, C, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400,
                      "stream_options");
    post_expect_error(p, C, "{\"prompt\":[999999]}", 400, "prompt");        /* id beyond vocab */
    post_expect_error(p, C, "{\"prompt\":\"\"}", 400, "prompt");            /* 0 tokens */
    post_expect_error(p, C, "{\"model\":\"gpt-4\",\"prompt\":\"x\"}", 404, "model");
    post_expect_error(p, H, "{\"messages\":\"hi\"}", 400, "messages");
    post_expect_error(p, H, "{\"messages\":[]}", 400, "messages");
    post_expect_error(p, H, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400,
                      "messages[0].role");
    post_expect_error(p, H, "{\"messages\":[{\"role\":\"user\",\"content\":7}]}", 400,
                      "messages[0].content");
    post_expect_error(p, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}",
                      400, "top_logprobs");
    /* prompt beyond the context (4096): 3000 token ids + max_tokens 2000 */
    {
        size_t cap = 3000 * 6 + 64, o = 0;
        char *b = malloc(cap);
        o += (size_t)snprintf(b + o, cap - o, "{\"prompt\":[");
        for (int i = 0; i < 3000; i++) o += (size_t)snprintf(b + o, cap - o, "%s1000", i ? "," : "");
        snprintf(b + o, cap - o, "],\"max_tokens\":2000}");
        http_resp r;
        /* over the 4 KiB body limit of this fixture: 413 */
        assert_int_equal(http_do(p, "POST", C, NULL, b, &r), 0);
        check_error(&r, 413, NULL);
        http_resp_free(&r);
        free(b);
    }
    /* routes and methods */
    http_resp r;
    assert_int_equal(http_do(p, "GET", "/v1/nothing", NULL, NULL, &r), 0);
    check_error(&r, 404, NULL);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", C, NULL, NULL, &r), 0);
    check_error(&r, 405, NULL);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "POST", "/v1/models", NULL, "{}", &r), 0);
    check_error(&r, 405, NULL);
    http_resp_free(&r);
    /* still serving */
    assert_int_equal(http_do(p, "GET", "/health", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    stop(&fx);
}

static void test_context_limit(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 0), 0);
    size_t cap = 3000 * 6 + 64, o = 0;
    char *b = malloc(cap);
    o += (size_t)snprintf(b + o, cap - o, "{\"prompt\":[");
    for (int i = 0; i < 3000; i++) o += (size_t)snprintf(b + o, cap - o, "%s1000", i ? "," : "");
    snprintf(b + o, cap - o, "],\"max_tokens\":2000}");
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, b, &r), 0);
    check_error(&r, 400, "max_tokens");
    assert_non_null(strstr(r.body, "context_length_exceeded"));
    http_resp_free(&r);
    /* a 5000-token text prompt alone */
    free(b);
    b = malloc(5000 * 4 + 64);
    o = (size_t)sprintf(b, "{\"prompt\":\"");
    for (int i = 0; i < 5000; i++) o += (size_t)sprintf(b + o, " %c", 'a' + i % 26);
    sprintf(b + o, "\"}");
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, b, &r), 0);
    check_error(&r, 400, "prompt");
    http_resp_free(&r);
    free(b);
    stop(&fx);
}

static void test_api_key_models_metrics(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, "s3cret-key", 0), 0);
    http_resp r;
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":2}";
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, body, &r), 0);
    check_error(&r, 401, NULL);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", "s3cret-kez", body, &r), 0);
    check_error(&r, 401, NULL);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", "s3cret-key-longer", body, &r), 0);
    check_error(&r, 401, NULL);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", "s3cret-key", body, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "GET", "/health", NULL, NULL, &r), 0); /* no key needed */
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "GET", "/v1/models", "s3cret-key", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_ok(&r);
    cJSON *m = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "data"), 0);
    assert_string_equal(cJSON_GetObjectItem(m, "id")->valuestring, "fake-model");
    assert_int_equal(cJSON_GetObjectItem(m, "context_length")->valueint, 4096);
    cJSON_Delete(j);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "GET", "/metrics", "s3cret-key", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "tqkv_http_requests_total{code=\"401\"} 3\n"));
    assert_non_null(strstr(r.body, "tqkv_http_requests_total{code=\"200\"} 3\n"));
    assert_non_null(strstr(r.body, "tqkv_generated_tokens_total 2\n"));
    assert_non_null(strstr(r.body, "tqkv_draft_prefill_tokens_total 0\n")); /* no draft */
    assert_non_null(strstr(r.body, "# TYPE tqkv_engine_decode_seconds_total counter\n"));
    assert_non_null(strstr(r.body, "\ntqkv_engine_prefill_seconds_total "));
    assert_non_null(strstr(r.body, "# TYPE tqkv_time_to_first_token_seconds histogram"));
    assert_non_null(strstr(r.body, "tqkv_inter_token_latency_seconds_bucket{le=\"+Inf\"}"));
    assert_non_null(strstr(r.body, "tqkv_kv_bytes_per_token"));
    assert_non_null(strstr(r.body, "tqkv_spec_acceptance_rate"));
    assert_non_null(strstr(r.body, "tqkv_prefix_cache_hits_total"));
    http_resp_free(&r);
    stop(&fx);
}

static void test_chat(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 0), 0);
    const char *body = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                       "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Write a loop\"}]}],"
                       "\"max_completion_tokens\":9,\"logprobs\":true,\"top_logprobs\":2%s}";
    char b[512];
    snprintf(b, sizeof b, body, "");
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", "/v1/chat/completions", NULL, b, &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = parse_ok(&r);
    assert_string_equal(cJSON_GetObjectItem(j, "object")->valuestring, "chat.completion");
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(ch, "message");
    assert_string_equal(cJSON_GetObjectItem(msg, "role")->valuestring, "assistant");
    char *whole = strdup(cJSON_GetObjectItem(msg, "content")->valuestring);
    cJSON *content = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "content");
    assert_int_equal(cJSON_GetArraySize(content), 9);
    cJSON *e0 = cJSON_GetArrayItem(content, 0);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e0, "token")));
    assert_true(cJSON_IsArray(cJSON_GetObjectItem(e0, "bytes")));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(e0, "top_logprobs")), 2);
    cJSON_Delete(j);
    http_resp_free(&r);
    snprintf(b, sizeof b, body, ",\"stream\":true");
    assert_int_equal(http_do(fx.port, "POST", "/v1/chat/completions", NULL, b, &r), 0);
    assert_int_equal(r.status, 200);
    char finish[32];
    char *got = sse_collect(r.body, 1, finish, sizeof finish, NULL, NULL);
    assert_non_null(got);
    assert_string_equal(got, whole);
    assert_string_equal(finish, "length");
    assert_non_null(strstr(r.body, "\"role\":\"assistant\""));
    free(got);
    free(whole);
    http_resp_free(&r);
    stop(&fx);
}

/* ------------------------------------------------------------------------- */
/* Faults                                                                    */
/* ------------------------------------------------------------------------- */

static int connect_lo(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static void wait_for(int (*cond)(fake_engine *), fake_engine *fe, int want) {
    for (int i = 0; i < 300 && cond(fe) < want; i++) usleep(100 * 1000); /* bounded: 30 s */
    assert_true(cond(fe) >= want);
}
static int open_zero(fake_engine *fe) { return fake_engine_open(fe) == 0; }

static void test_disconnect_cancels(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 2000, NULL, 0), 0);
    for (int stream = 0; stream < 2; stream++) {
        int fd = connect_lo(fx.port);
        char req[512];
        const char *body = stream ? "{\"prompt\":\"x\",\"max_tokens\":4000,\"stream\":true}"
                                  : "{\"prompt\":\"x\",\"max_tokens\":4000}";
        int n = snprintf(req, sizeof req, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
        assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
        if (stream) { /* read the first bytes of the stream */
            char buf[256];
            assert_true(recv(fd, buf, sizeof buf, 0) > 0);
        } else {
            usleep(50 * 1000);
        }
        close(fd);
        wait_for(fake_engine_cancelled, fx.fe, stream + 1);
    }
    wait_for(open_zero, fx.fe, 1);
    http_resp r;
    assert_int_equal(http_do(fx.port, "GET", "/health", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    stop(&fx);
}

static void test_queue_full_and_drain(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 1, 2000, NULL, 0), 0);
    /* one long request occupies the only slot */
    int fd = connect_lo(fx.port);
    const char *body = "{\"prompt\":\"x\",\"max_tokens\":300,\"stream\":true}";
    char req[512];
    int n = snprintf(req, sizeof req, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(body), body);
    assert_int_equal(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    char buf[256];
    assert_true(recv(fd, buf, sizeof buf, 0) > 0);
    post_expect_error(fx.port, "/v1/completions", "{\"prompt\":\"y\",\"max_tokens\":2}", 503, NULL);
    /* draining: new requests 503, health says draining, the running stream completes */
    srv_stop_admission(fx.srv);
    post_expect_error(fx.port, "/v1/completions", "{\"prompt\":\"y\",\"max_tokens\":2}", 503, NULL);
    http_resp r;
    assert_int_equal(http_do(fx.port, "GET", "/health", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 503);
    http_resp_free(&r);
    size_t cap = 1 << 16, got = 0;
    char *all = malloc(cap);
    ssize_t k;
    while ((k = recv(fd, all + got, cap - got - 1, 0)) > 0) {
        got += (size_t)k;
        if (got + 1024 > cap) all = realloc(all, cap *= 2);
        all[got] = 0;
        if (strstr(all, "data: [DONE]")) break;
    }
    all[got] = 0;
    assert_non_null(strstr(all, "\"finish_reason\":\"length\""));
    assert_non_null(strstr(all, "data: [DONE]"));
    free(all);
    close(fd);
    stop(&fx);
}

static void test_malformed_never_crash(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 64, 0, NULL, 1 << 16), 0);
    test_rng rng;
    rng_init(&rng, test_seed());
    const char *valid = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        "Content-Length: 94\r\n\r\n{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                        "\"max_tokens\":3,\"stream\":true,\"seed\":1}";
    size_t vl = strlen(valid);
    for (int it = 0; it < 300; it++) {
        char buf[512];
        size_t n;
        int kind = it % 4;
        if (kind == 0) { /* truncated request */
            n = (size_t)rng_int(&rng, 0, (int)vl - 1);
            memcpy(buf, valid, n);
        } else if (kind == 1) { /* random byte flips */
            n = vl;
            memcpy(buf, valid, n);
            for (int f = 0; f < 1 + it % 8; f++) buf[rng_int(&rng, 0, (int)n - 1)] = (char)rng_int(&rng, 0, 255);
        } else if (kind == 2) { /* pure garbage */
            n = (size_t)rng_int(&rng, 1, (int)sizeof buf);
            for (size_t i = 0; i < n; i++) buf[i] = (char)rng_int(&rng, 0, 255);
        } else { /* valid headers, truncated/garbled JSON body with matching length */
            const char *js[] = {"{\"prompt\":[", "{\"prompt\":\"\\ud800\"}", "{\"prompt\":\"a\",\"stop\":[\"",
                                "{\"messages\":[{\"role\":\"user\"}]}", "{\"prompt\":\"x\",\"max_tokens\":1e309}",
                                "{\"prompt\":\"x\",\"logprobs\":-1}", "\xff\xfe{}", "{\"prompt\":[-1]}"};
            const char *b = js[rng_int(&rng, 0, 7)];
            n = (size_t)snprintf(buf, sizeof buf, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Length: %zu\r\n\r\n%s", strlen(b), b);
        }
        http_resp r;
        http_raw(fx.port, buf, n, 1, &r); /* any answer or none; the server must survive */
        if (r.status) assert_true(r.status == 200 || (r.status >= 400 && r.status < 600));
        if (r.status >= 400 && r.status < 500 && kind == 3) check_error(&r, r.status, NULL);
        http_resp_free(&r);
    }
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"ok\",\"max_tokens\":2}", &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    stop(&fx);
}

/* A first token later than the idle timeout (a long queue or prefill) must not cut the
 * response: the timeout only guards reading requests. */
static void test_slow_first_token(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start_ex(&fx, 64, 0, NULL, 0, 2500 * 1000, 1, 0), 0);
    for (int stream = 0; stream < 2; stream++) {
        char body[128];
        snprintf(body, sizeof body, "{\"prompt\":\"slow\",\"max_tokens\":3,\"stream\":%s}",
                 stream ? "true" : "false");
        http_resp r;
        assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL, body, &r), 0);
        assert_int_equal(r.status, 200);
        char *want = expected(&fx, "slow", 3);
        char *got = stream ? sse_collect(r.body, 0, NULL, 0, NULL, NULL) : resp_text(r.body, 0, NULL, 0);
        assert_non_null(got);
        assert_string_equal(got, want);
        free(got);
        free(want);
        http_resp_free(&r);
    }
    stop(&fx);
}

typedef struct {
    fixture *fx;
    int      idx, ok;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    for (int k = 0; k < 8; k++) {
        char prompt[64], body[256];
        snprintf(prompt, sizeof prompt, "prompt %d-%d", w->idx, k);
        int stream = (w->idx + k) % 2;
        snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":%d,\"stream\":%s}", prompt,
                 5 + (w->idx + k) % 7, stream ? "true" : "false");
        http_resp r;
        if (http_do(w->fx->port, "POST", "/v1/completions", NULL, body, &r) || r.status != 200) {
            fprintf(stderr, "worker %d: status %d %s\n", w->idx, r.status, r.body ? r.body : "");
            return NULL;
        }
        char *got = stream ? sse_collect(r.body, 0, NULL, 0, NULL, NULL) : resp_text(r.body, 0, NULL, 0);
        char *want = expected(w->fx, prompt, 5 + (w->idx + k) % 7);
        int same = got && !strcmp(got, want);
        free(got);
        free(want);
        http_resp_free(&r);
        if (!same) {
            fprintf(stderr, "worker %d: mismatch\n", w->idx);
            return NULL;
        }
    }
    w->ok = 1;
    return NULL;
}

/* An engine failure after some tokens (the GPU engine ends its running rows so when a KV
 * allocation fails mid-generation): a stream already answered 200 carries the tokens
 * made so far, then an error object with the engine's message, then [DONE]; a whole
 * response is a 500 with the message. Never a 200 with nothing in it. */
static void test_mid_stream_error(void **state) {
    (void)state;
    fixture fx;
    const int after = 3;
    assert_int_equal(start_ex(&fx, 64, 0, NULL, 0, 0, 0, after), 0);
    char *want = expected(&fx, "def f(x):", after);
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL,
                             "{\"prompt\":\"def f(x):\",\"max_tokens\":12,\"stream\":true,"
                             "\"stream_options\":{\"include_usage\":true}}", &r), 0);
    assert_int_equal(r.status, 200);
    /* the tokens before the failure, in chunks of their own */
    const char *err = strstr(r.body, "data: {\"error\"");
    if (!err) fail_msg("stream without an error object: %s", r.body);
    const size_t hn = (size_t)(err - r.body);
    char *head = malloc(hn + 16); /* the chunks before the error, closed as sse_collect wants */
    assert_non_null(head);
    memcpy(head, r.body, hn);
    memcpy(head + hn, "data: [DONE]\n\n", 15);
    char finish[32];
    cJSON *usage = NULL;
    char *got = sse_collect(head, 0, finish, sizeof finish, &usage, NULL);
    free(head);
    if (!got) fail_msg("stream before the error does not parse: %s", r.body);
    assert_string_equal(got, want);
    assert_null(usage); /* no usage chunk: the request did not complete */
    free(got);
    /* then the error, the engine's message in it, and [DONE] last */
    const char *eol = strstr(err, "\n\n");
    assert_non_null(eol);
    cJSON *j = cJSON_ParseWithLength(err + 6, (size_t)(eol - err - 6));
    assert_non_null(j);
    cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message");
    assert_true(cJSON_IsString(m));
    assert_non_null(strstr(m->valuestring, "out of memory"));
    cJSON_Delete(j);
    assert_string_equal(eol + 2, "data: [DONE]\n\n");
    http_resp_free(&r);
    /* whole: a 500 with the message */
    assert_int_equal(http_do(fx.port, "POST", "/v1/completions", NULL,
                             "{\"prompt\":\"def f(x):\",\"max_tokens\":12}", &r), 0);
    check_error(&r, 500, NULL);
    assert_non_null(strstr(r.body, "out of memory"));
    http_resp_free(&r);
    free(want);
    stop(&fx);
}

static void test_concurrent(void **state) {
    (void)state;
    fixture fx;
    assert_int_equal(start(&fx, 256, 200, NULL, 0), 0);
    enum { N = 32 };
    pthread_t th[N];
    worker w[N];
    for (int i = 0; i < N; i++) {
        w[i] = (worker){&fx, i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, work, &w[i]), 0);
    }
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) assert_true(w[i].ok);
    stop(&fx);
}

int main(void) {
    char path[4096];
    FILE *f = fopen(source_path("models/qwen3-code-28m/tokenizer.json", path, sizeof path), "r");
    if (!f) {
        fprintf(stderr, "SKIP: models/qwen3-code-28m tokenizer absent\n");
        return 77;
    }
    fclose(f);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_shapes),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_context_limit),
        cmocka_unit_test(test_api_key_models_metrics),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_disconnect_cancels),
        cmocka_unit_test(test_queue_full_and_drain),
        cmocka_unit_test(test_malformed_never_crash),
        cmocka_unit_test(test_concurrent),
        cmocka_unit_test(test_mid_stream_error),
        cmocka_unit_test(test_slow_first_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

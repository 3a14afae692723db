/*
 * test_serve_api.c - OpenAI API completeness of `tqkv serve` (issue 27) against the
 * engine test double: unknown / unsupported fields and wrong types get a 400 naming
 * the field, an escaped NUL is refused (never a truncation), tiny top_p is served,
 * Retry-After on 503, GET /v1/models/{id}, model aliases, /metrics outside the API key
 * (unless asked), IPv6 listening.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

typedef struct {
    const char        *host;
    const char        *api_key;
    const char *const *aliases;
    int                n_aliases;
    int                metrics_auth;
    int                queue_max;
    int                step_us;
} fx_opts;

static int start(fixture *fx, const fx_opts *o) {
    char path[4096];
    memset(fx, 0, sizeof *fx);
    if (tqkv_tokenizer_load(&fx->tok, source_path("models/qwen3-code-28m", path, sizeof path)) != TQKV_OK)
        return -1;
    fake_params fp = {o->queue_max ? o->queue_max : 64, o->step_us, 4096, 0};
    if (fake_engine_init(&fx->fe, &fp, fx->tok)) return -1;
    srv_engine eng = fake_engine_bind(fx->fe);
    srv_params sp = srv_params_default();
    sp.port = 0;
    if (o->host) sp.host = o->host;
    sp.api_key = o->api_key;
    sp.aliases = o->aliases;
    sp.n_aliases = o->n_aliases;
    sp.metrics_auth = o->metrics_auth;
    if (srv_start(&fx->srv, &sp, &eng) != TQKV_OK) {
        fprintf(stderr, "srv_start: %s\n", tqkv_last_error());
        return -1;
    }
    fx->port = srv_port(fx->srv);
    return fx->port > 0 ? 0 : -1;
}

static void stop(fixture *fx) {
    srv_stop_admission(fx->srv);
    fake_engine_free(fx->fe);
    assert_int_equal(srv_wait_idle(fx->srv, 60.0), 0);
    srv_free(fx->srv);
    tqkv_tokenizer_free(fx->tok);
}

static void check_error(const http_resp *r, int status, const char *param) {
    if (r->status != status || !param || !strstr(r->body, param))
        fprintf(stderr, "want %d %s, got status %d body %s\n", status, param ? param : "",
                r->status, r->body);
    assert_int_equal(r->status, status);
    cJSON *j = cJSON_Parse(r->body);
    assert_non_null(j);
    cJSON *e = cJSON_GetObjectItem(j, "error");
    assert_non_null(e);
    cJSON *p = cJSON_GetObjectItem(e, "param");
    cJSON *m = cJSON_GetObjectItem(e, "message");
    assert_true(cJSON_IsString(m));
    if (param) {
        assert_true(cJSON_IsString(p));
        assert_string_equal(p->valuestring, param);
        /* the message names the parameter too */
        assert_non_null(strstr(m->valuestring, param));
    }
    cJSON_Delete(j);
}

static void expect(int port, const char *path, const char *body, int status, const char *param) {
    http_resp r;
    assert_int_equal(http_do(port, "POST", path, NULL, body, &r), 0);
    if (status == 200) {
        if (r.status != 200) fprintf(stderr, "want 200 for %s, got %d %s\n", body, r.status, r.body);
        assert_int_equal(r.status, 200);
    } else {
        check_error(&r, status, param);
    }
    http_resp_free(&r);
}

static const char *C = "/v1/completions", *H = "/v1/chat/completions";
#define MSG "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

/* ------------------------------------------------------------------------- */

static void test_unknown_and_unsupported_fields(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    assert_int_equal(start(&fx, &o), 0);
    int p = fx.port;
    expect(p, C, "{\"prompt\":\"x\",\"max_tokens\":2,\"foo\":1}", 400, "foo");
    expect(p, C, "{\"prompt\":\"x\",\"max_tokens\":2,\"foo\":null}", 400, "foo");
    expect(p, H, "{" MSG ",\"max_tokens\":2,\"temprature\":0.5}", 400, "temprature");
    expect(p, H, "{" MSG ",\"functions\":[]}", 400, "functions");
    expect(p, H, "{" MSG ",\"audio\":{}}", 400, "audio");
    expect(p, C, "{\"prompt\":\"x\",\"tools\":[]}", 400, "tools"); /* chat-only field */
    expect(p, C, "{\"prompt\":\"x\",\"top_k\":5}", 400, "top_k");
    expect(p, H, "{" MSG ",\"stream\":true,\"stream_options\":{\"include_usage\":true,\"x\":1}}", 400,
           "stream_options.x");
    expect(p, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"colour\":\"red\"}]}", 400,
           "messages[0].colour");
    expect(p, H, "{\"messages\":[{\"role\":\"tool\",\"content\":\"42\"}]}", 400,
           "messages[0].tool_call_id");
    expect(p, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}]}", 400,
           "messages[0].tool_calls");
    /* user: accepted (an end-user id in OpenAI's API; it never changes the output) */
    expect(p, H, "{" MSG ",\"max_tokens\":2,\"user\":\"u-17\"}", 200, NULL);
    expect(p, C, "{\"prompt\":\"x\",\"max_tokens\":2,\"user\":\"u-17\"}", 200, NULL);
    expect(p, C, "{\"prompt\":\"x\",\"user\":17}", 400, "user");
    /* null is "absent" for known fields */
    expect(p, C, "{\"prompt\":\"x\",\"max_tokens\":2,\"logit_bias\":null,\"n\":null}", 200, NULL);
    stop(&fx);
}

static void test_wrong_types(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    assert_int_equal(start(&fx, &o), 0);
    int p = fx.port;
    expect(p, H, "{" MSG ",\"tools\":\"get_weather\"}", 400, "tools");
    expect(p, H, "{" MSG ",\"tools\":[5]}", 400, "tools[0]");
    expect(p, H, "{" MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":7}}]}", 400,
           "tools[0].function.name");
    expect(p, H, "{" MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]}",
           400, "tools[0].function.parameters");
    expect(p, H, "{" MSG ",\"tools\":[{\"type\":\"retrieval\"}]}", 400, "tools[0].type");
    expect(p, H, "{" MSG ",\"tool_choice\":5}", 400, "tool_choice");
    expect(p, H, "{" MSG ",\"tool_choice\":\"maybe\"}", 400, "tool_choice");
    expect(p, H, "{" MSG ",\"tool_choice\":\"auto\"}", 400, "tool_choice"); /* no tools */
    expect(p, H, "{" MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
           "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}", 400, "tool_choice");
    expect(p, H, "{" MSG ",\"parallel_tool_calls\":\"yes\"}", 400, "parallel_tool_calls");
    expect(p, H, "{" MSG ",\"response_format\":\"json\"}", 400, "response_format");
    expect(p, H, "{" MSG ",\"response_format\":{\"type\":\"xml\"}}", 400, "response_format.type");
    expect(p, H, "{" MSG ",\"response_format\":{\"type\":\"json_schema\"}}", 400,
           "response_format.json_schema");
    expect(p, H, "{" MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":3}}}",
           400, "response_format.json_schema.schema");
    expect(p, H, "{" MSG ",\"logit_bias\":[1,2]}", 400, "logit_bias");
    expect(p, H, "{" MSG ",\"logit_bias\":{\"abc\":1}}", 400, "logit_bias");
    expect(p, H, "{" MSG ",\"logit_bias\":{\"5\":\"up\"}}", 400, "logit_bias");
    expect(p, H, "{" MSG ",\"logit_bias\":{\"5\":101}}", 400, "logit_bias");
    expect(p, H, "{" MSG ",\"logit_bias\":{\"99999999\":1}}", 400, "logit_bias");
    expect(p, C, "{\"prompt\":\"x\",\"frequency_penalty\":\"lots\"}", 400, "frequency_penalty");
    expect(p, C, "{\"prompt\":\"x\",\"presence_penalty\":2.5}", 400, "presence_penalty");
    expect(p, C, "{\"prompt\":\"x\",\"n\":1.5}", 400, "n");
    expect(p, C, "{\"prompt\":\"x\",\"n\":0}", 400, "n");
    expect(p, C, "{\"prompt\":\"x\",\"best_of\":3}", 400, "best_of");
    stop(&fx);
}

static void test_nul_and_top_p(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    assert_int_equal(start(&fx, &o), 0);
    int p = fx.port;
    expect(p, C, "{\"prompt\":\"abc\\u0000def\",\"max_tokens\":2}", 400, "prompt");
    expect(p, C, "{\"max_tokens\":2,\"prompt\":[\"abc\\u0000\"]}", 400, "prompt");
    expect(p, H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", 400, "messages");
    expect(p, C, "{\"prompt\":\"x\",\"stop\":[\"\\u0000\"]}", 400, "stop");
    /* an escaped backslash followed by u0000 is text, not a NUL */
    expect(p, C, "{\"prompt\":\"a\\\\u0000b\",\"max_tokens\":2}", 200, NULL);
    /* tiny but positive top_p: served (keeps the best token), not a 400 */
    expect(p, C, "{\"prompt\":\"x\",\"max_tokens\":2,\"top_p\":1e-300,\"temperature\":1}", 200, NULL);
    expect(p, C, "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p");
    stop(&fx);
}

static void *long_call(void *arg) {
    http_resp rr;
    if (http_do(*(int *)arg, "POST", C, NULL, "{\"prompt\":\"x\",\"max_tokens\":20}", &rr) == 0)
        http_resp_free(&rr);
    return NULL;
}

static void test_retry_after(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    o.queue_max = 0 + 1;
    o.step_us = 200000;
    assert_int_equal(start(&fx, &o), 0);
    /* one long request occupies the queue of 1 (streamed, so the call returns at once) */
    http_resp r1, r2;
    char body[] = "{\"prompt\":\"x\",\"max_tokens\":3}";
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, long_call, &fx.port), 0);
    int saw = 0;
    for (int t = 0; t < 50 && !saw; t++) {
        usleep(50000);
        assert_int_equal(http_do(fx.port, "POST", C, NULL, body, &r1), 0);
        if (r1.status == 503) {
            saw = 1;
            assert_non_null(strstr(r1.headers, "Retry-After: 1"));
        }
        http_resp_free(&r1);
    }
    assert_true(saw);
    /* draining: 503 with Retry-After too */
    srv_stop_admission(fx.srv);
    assert_int_equal(http_do(fx.port, "POST", C, NULL, body, &r2), 0);
    assert_int_equal(r2.status, 503);
    assert_non_null(strstr(r2.headers, "Retry-After:"));
    http_resp_free(&r2);
    stop(&fx);
    pthread_join(th, NULL);
}

static void test_models_aliases_metrics(void **state) {
    (void)state;
    fixture fx;
    const char *al[] = {"qwen-small", "gpt-3.5-turbo"};
    fx_opts o = {0};
    o.aliases = al;
    o.n_aliases = 2;
    o.api_key = "k3y";
    assert_int_equal(start(&fx, &o), 0);
    int p = fx.port;
    http_resp r;
    /* /metrics is outside the key by default */
    assert_int_equal(http_do(p, "GET", "/metrics", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", "/v1/models", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 401);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", "/v1/models", "k3y", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    cJSON *d = cJSON_GetObjectItem(j, "data");
    assert_int_equal(cJSON_GetArraySize(d), 2);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(d, 0), "id")->valuestring, "qwen-small");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(d, 1), "id")->valuestring, "gpt-3.5-turbo");
    cJSON_Delete(j);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", "/v1/models/gpt-3.5-turbo", "k3y", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    j = cJSON_Parse(r.body);
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, "gpt-3.5-turbo");
    assert_string_equal(cJSON_GetObjectItem(j, "object")->valuestring, "model");
    cJSON_Delete(j);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", "/v1/models/fake-model", "k3y", NULL, &r), 0);
    check_error(&r, 404, "model");
    http_resp_free(&r);
    assert_int_equal(http_do(p, "GET", "/v1/models/qwen-small", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 401);
    http_resp_free(&r);
    /* a request under an alias reports that alias; without a model the first alias */
    assert_int_equal(http_do(p, "POST", C, "k3y", "{\"model\":\"gpt-3.5-turbo\",\"prompt\":\"x\",\"max_tokens\":1}", &r), 0);
    assert_int_equal(r.status, 200);
    j = cJSON_Parse(r.body);
    assert_string_equal(cJSON_GetObjectItem(j, "model")->valuestring, "gpt-3.5-turbo");
    cJSON_Delete(j);
    http_resp_free(&r);
    assert_int_equal(http_do(p, "POST", C, "k3y", "{\"prompt\":\"x\",\"max_tokens\":1}", &r), 0);
    j = cJSON_Parse(r.body);
    assert_string_equal(cJSON_GetObjectItem(j, "model")->valuestring, "qwen-small");
    cJSON_Delete(j);
    http_resp_free(&r);
    /* the engine's own name is not served when aliases are given */
    assert_int_equal(http_do(p, "POST", C, "k3y", "{\"model\":\"fake-model\",\"prompt\":\"x\"}", &r), 0);
    check_error(&r, 404, "model");
    http_resp_free(&r);
    stop(&fx);

    /* --metrics-auth: /metrics behind the key */
    fx_opts o2 = {0};
    o2.api_key = "k3y";
    o2.metrics_auth = 1;
    assert_int_equal(start(&fx, &o2), 0);
    assert_int_equal(http_do(fx.port, "GET", "/metrics", NULL, NULL, &r), 0);
    assert_int_equal(r.status, 401);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "GET", "/metrics", "k3y", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    assert_int_equal(http_do(fx.port, "GET", "/v1/models/fake-model", "k3y", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    stop(&fx);
}

/* GET path over IPv6 or IPv4 loopback; returns the HTTP status or -1. */
static int get_status(int v6, int port, const char *path) {
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    int rc = -1;
    if (v6) {
        struct sockaddr_in6 a;
        memset(&a, 0, sizeof a);
        a.sin6_family = AF_INET6;
        a.sin6_port = htons((uint16_t)port);
        inet_pton(AF_INET6, "::1", &a.sin6_addr);
        rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    } else {
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    }
    if (rc) {
        close(fd);
        return -1;
    }
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    char buf[64] = {0};
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    int st = -1;
    if (got > 12) sscanf(buf, "HTTP/1.%*d %d", &st);
    return st;
}

static void test_ipv6(void **state) {
    (void)state;
    int s6 = socket(AF_INET6, SOCK_STREAM, 0);
    if (s6 < 0) {
        fprintf(stderr, "no IPv6 sockets here: IPv6 part not run\n");
        return;
    }
    close(s6);
    fixture fx;
    fx_opts o = {0};
    o.host = "::1";
    assert_int_equal(start(&fx, &o), 0);
    assert_int_equal(get_status(1, fx.port, "/health"), 200);
    assert_int_equal(get_status(0, fx.port, "/health"), -1); /* not on IPv4 */
    stop(&fx);
    o.host = "::"; /* all addresses, IPv4-mapped too */
    assert_int_equal(start(&fx, &o), 0);
    assert_int_equal(get_status(1, fx.port, "/health"), 200);
    assert_int_equal(get_status(0, fx.port, "/health"), 200);
    stop(&fx);
    o.host = "[::1]";
    assert_int_equal(start(&fx, &o), 0);
    assert_int_equal(get_status(1, fx.port, "/v1/models/fake-model"), 200);
    stop(&fx);
    o.host = "no.such.host.invalid";
    assert_int_not_equal(start(&fx, &o), 0);
    fake_engine_free(fx.fe);
    tqkv_tokenizer_free(fx.tok);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unknown_and_unsupported_fields),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_nul_and_top_p),
        cmocka_unit_test(test_retry_after),
        cmocka_unit_test(test_models_aliases_metrics),
        cmocka_unit_test(test_ipv6),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

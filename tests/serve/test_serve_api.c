/*
 * test_serve_api.c - OpenAI API completeness of `tqkv serve` (issue 27) against the
 * engine test double: unknown / unsupported fields and wrong types get a 400 naming
 * the field, an escaped NUL is refused (never a truncation), tiny top_p is served,
 * Retry-After on 503, GET /v1/models/{id}, model aliases, /metrics outside the API key
 * (unless asked), IPv6 listening; n choices (whole and streamed, logprobs for each);
 * tool calls: the parser's formats, the template's rendering of tools and of a tool
 * round trip's history, tool calls whole and streamed from a forced output. Then the
 * real `tqkv serve` defaults: threads = physical cores (lscpu as the reference), the
 * prefix cache on, aliases, "::".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity */
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
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
    const char        *script;
} fx_opts;

static int start(fixture *fx, const fx_opts *o) {
    char path[4096];
    memset(fx, 0, sizeof *fx);
    if (tqkv_tokenizer_load(&fx->tok, source_path("models/qwen3-code-28m", path, sizeof path)) != TQKV_OK)
        return -1;
    fake_params fp = {o->queue_max ? o->queue_max : 64, o->step_us, 4096, 0, o->script, 0};
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
    /* json_schema and json_object are served (the engine double does not constrain) */
    expect(p, H, "{" MSG ",\"max_tokens\":2,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"object\"}}}}",
           200, NULL);
    expect(p, H, "{" MSG ",\"max_tokens\":2,\"response_format\":{\"type\":\"json_object\"}}", 200, NULL);
    expect(p, H, "{" MSG ",\"max_tokens\":2,\"response_format\":{\"type\":\"text\"}}", 200, NULL);
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

/* ------------------------------------------------------------------------- */
/* n choices                                                                 */
/* ------------------------------------------------------------------------- */

/* The fake engine's text of choice c for prompt text, max_tokens n. */
static char *fake_text(const fixture *fx, const int32_t *ids, int ni, int c, int n) {
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    for (int i = 0; i < n; i++) {
        int32_t t = fake_engine_token(ids, ni, i + 7919 * c, tqkv_tokenizer_vocab_size(fx->tok));
        const char *b;
        size_t bn;
        assert_int_equal(tqkv_tokenizer_id_bytes(fx->tok, t, &b, &bn), TQKV_OK);
        while (len + bn + 1 > cap) s = realloc(s, cap *= 2);
        for (size_t k = 0; k < bn; k++) s[len++] = (unsigned char)b[k] < 0x80 && b[k] ? b[k] : '?';
    }
    s[len] = 0;
    return s;
}

/* Per-index content / finish of an SSE body (n choices); every chunk parses. */
static void sse_by_index(const char *body, int chat, int n, char **text, char (*finish)[32], int *lp_entries) {
    for (int i = 0; i < n; i++) {
        text[i] = calloc(1, 1);
        finish[i][0] = 0;
        if (lp_entries) lp_entries[i] = 0;
    }
    int done = 0;
    for (const char *p = body; *p;) {
        const char *eol = strstr(p, "\n\n");
        assert_non_null(eol);
        assert_int_equal(strncmp(p, "data: ", 6), 0);
        if (!strncmp(p + 6, "[DONE]", 6)) {
            done = 1;
            break;
        }
        cJSON *j = cJSON_ParseWithLength(p + 6, (size_t)(eol - p - 6));
        assert_non_null(j);
        assert_null(cJSON_GetObjectItem(j, "error"));
        cJSON *ch;
        cJSON_ArrayForEach(ch, cJSON_GetObjectItem(j, "choices")) {
            int i = cJSON_GetObjectItem(ch, "index")->valueint;
            assert_true(i >= 0 && i < n);
            cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content")
                            : cJSON_GetObjectItem(ch, "text");
            if (cJSON_IsString(t)) {
                text[i] = realloc(text[i], strlen(text[i]) + strlen(t->valuestring) + 1);
                strcat(text[i], t->valuestring);
            }
            cJSON *fr = cJSON_GetObjectItem(ch, "finish_reason");
            if (cJSON_IsString(fr)) snprintf(finish[i], 32, "%s", fr->valuestring);
            cJSON *lp = cJSON_GetObjectItem(ch, "logprobs");
            if (lp_entries && cJSON_IsObject(lp))
                lp_entries[i] += cJSON_GetArraySize(chat ? cJSON_GetObjectItem(lp, "content")
                                                         : cJSON_GetObjectItem(lp, "tokens"));
        }
        cJSON_Delete(j);
        p = eol + 2;
    }
    assert_true(done);
}

static void test_n_choices(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    assert_int_equal(start(&fx, &o), 0);
    int32_t *ids = NULL;
    size_t ni = 0;
    assert_int_equal(tqkv_tokenizer_encode(fx.tok, "hello", 5, TQKV_ENCODE_ADD_SPECIAL, &ids, &ni), TQKV_OK);
    http_resp r;
    assert_int_equal(http_do(fx.port, "POST", C, NULL,
                             "{\"prompt\":\"hello\",\"max_tokens\":5,\"n\":3,\"logprobs\":2}", &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    cJSON *chs = cJSON_GetObjectItem(j, "choices");
    assert_int_equal(cJSON_GetArraySize(chs), 3);
    for (int c = 0; c < 3; c++) {
        cJSON *ch = cJSON_GetArrayItem(chs, c);
        assert_int_equal(cJSON_GetObjectItem(ch, "index")->valueint, c);
        char *want = fake_text(&fx, ids, (int)ni, c, 5);
        assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, want);
        free(want);
        /* logprobs for every choice */
        assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "logprobs"), "tokens")), 5);
        assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "length");
    }
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valueint, 15);
    cJSON_Delete(j);
    http_resp_free(&r);
    /* streamed chat, n = 4: every choice complete, with its own finish and logprobs */
    assert_int_equal(http_do(fx.port, "POST", H, NULL,
                             "{" MSG ",\"max_tokens\":6,\"n\":4,\"stream\":true,\"logprobs\":true}", &r), 0);
    assert_int_equal(r.status, 200);
    char *text[4];
    char fin[4][32];
    int lpn[4];
    sse_by_index(r.body, 1, 4, text, fin, lpn);
    for (int c = 0; c < 4; c++) {
        assert_string_equal(fin[c], "length");
        assert_int_equal(lpn[c], 6);
        assert_true(strlen(text[c]) > 0);
        for (int k = 0; k < c; k++) assert_string_not_equal(text[c], text[k]);
    }
    for (int c = 0; c < 4; c++) free(text[c]); /* after every comparison (k < c reads them) */
    http_resp_free(&r);
    free(ids);
    stop(&fx);
}

/* ------------------------------------------------------------------------- */
/* Tool calls                                                                */
/* ------------------------------------------------------------------------- */

static void parse_expect(const char *text, int n_calls, const char *content, const char *name0,
                         const char *args0) {
    srv_tool_call *calls = NULL;
    int n = -1;
    size_t ce = 0;
    assert_int_equal(srv_tool_parse(text, strlen(text), "chatcmpl-9", 1, 1, &calls, &n, &ce), 0);
    if (n != n_calls) fprintf(stderr, "parse '%s': %d calls, want %d\n", text, n, n_calls);
    assert_int_equal(n, n_calls);
    assert_int_equal(ce, strlen(content));
    assert_memory_equal(text, content, ce);
    if (n_calls) {
        assert_string_equal(calls[0].name, name0);
        cJSON *a = cJSON_Parse(calls[0].arguments), *b = cJSON_Parse(args0);
        assert_non_null(a);
        assert_true(cJSON_Compare(a, b, 1));
        cJSON_Delete(a);
        cJSON_Delete(b);
        assert_string_equal(calls[0].id, "call_chatcmpl-9_1_0");
    }
    srv_tool_calls_free(calls, n);
}

static void test_tool_parser(void **state) {
    (void)state;
    /* Qwen / Hermes */
    parse_expect("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                 1, "", "get_weather", "{\"city\":\"Paris\"}");
    parse_expect("Let me check.\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n"
                 "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
                 2, "Let me check.", "f", "{}");
    /* arguments given as a JSON string; a last block cut off before its close tag */
    parse_expect("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}", 1, "", "f", "{\"a\":1}");
    /* not calls: the whole text is content */
    parse_expect("<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}}\n</tool_call>", 0,
                 "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}}\n</tool_call>", NULL, NULL);
    parse_expect("<tool_call>{\"name\": \"f\"}</tool_call> and then text", 0,
                 "<tool_call>{\"name\": \"f\"}</tool_call> and then text", NULL, NULL);
    parse_expect("plain answer {not json}", 0, "plain answer {not json}", NULL, NULL);
    parse_expect("{\"answer\": 42}", 0, "{\"answer\": 42}", NULL, NULL); /* JSON, no name */
    /* Llama 3 */
    parse_expect("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", 1, "",
                 "get_weather", "{\"city\":\"Oslo\"}");
    parse_expect("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": true}}", 1, "", "f", "{\"q\":true}");
    /* Gemma 4 */
    parse_expect("<|tool_call>call:get_weather{city:<|\"|>Paris, FR<|\"|>,days:3,units:[<|\"|>c<|\"|>],x:{on:true}}<tool_call|>",
                 1, "", "get_weather", "{\"city\":\"Paris, FR\",\"days\":3,\"units\":[\"c\"],\"x\":{\"on\":true}}");
    /* parallel_tool_calls false: the first call only */
    const char *two = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
    srv_tool_call *calls = NULL;
    int n = 0;
    size_t ce = 0;
    assert_int_equal(srv_tool_parse(two, strlen(two), "x", 0, 0, &calls, &n, &ce), 0);
    assert_int_equal(n, 1);
    srv_tool_calls_free(calls, n);
    /* streaming: nothing of a (possible) call goes out as content */
    assert_int_equal(srv_tool_safe_len("Hi <tool_call>{", 15), 2);
    assert_int_equal(srv_tool_safe_len("Hi <tool_c", 10), 2);
    assert_int_equal(srv_tool_safe_len("Hi <", 4), 2);
    assert_int_equal(srv_tool_safe_len("Hi there", 8), 8);
    assert_int_equal(srv_tool_safe_len("Hi there\n", 9), 8); /* whitespace may precede a call */
    assert_int_equal(srv_tool_safe_len("  {\"name", 8), 0);
    assert_int_equal(srv_tool_safe_len("ok <|tool_call>call:f{", 22), 2);
}

static const char *TOOLS =
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather of a city\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]";

/* The chat template gets the tools and the history's tool calls and tool results. */
static void test_render_tools(void **state) {
    (void)state;
    char path[4096];
    FILE *f = fopen(source_path("tests/golden/chat/qwen3.jinja", path, sizeof path), "rb");
    assert_non_null(f);
    static char src[1 << 16];
    size_t n = fread(src, 1, sizeof src - 1, f);
    fclose(f);
    src[n] = 0;
    tqkv_chat_template *t = NULL;
    assert_int_equal(tqkv_chat_template_init(&t, src), TQKV_OK);
    char body[4096];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
             "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"18 C, sunny\"}],%s,"
             "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}}", TOOLS);
    srv_limits lim = {"", 4096, 1000, NULL, 0};
    srv_request rq;
    srv_error err;
    if (srv_request_parse(SRV_API_CHAT, body, strlen(body), &lim, &rq, &err)) fail_msg("%s", err.message);
    char *out = NULL;
    size_t len = 0;
    char forced[160];
    assert_int_equal(srv_render_chat(t, src, &rq, "", "<|im_end|>", &out, &len, forced, sizeof forced), TQKV_OK);
    assert_non_null(strstr(out, "<tools>"));
    assert_non_null(strstr(out, "\"name\": \"get_weather\""));  /* the tool's signature */
    assert_non_null(strstr(out, "Weather of a city"));
    assert_non_null(strstr(out, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
    assert_non_null(strstr(out, "<tool_response>\n18 C, sunny\n</tool_response>"));
    /* tool_choice named: the prompt ends inside that call */
    assert_string_equal(forced, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ");
    assert_true(len > strlen(forced) && !strcmp(out + len - strlen(forced), forced));
    free(out);
    srv_request_free(&rq);
    /* tool_choice none: no tools in the prompt, nothing forced */
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],%s,\"tool_choice\":\"none\"}", TOOLS);
    assert_int_equal(srv_request_parse(SRV_API_CHAT, body, strlen(body), &lim, &rq, &err), 0);
    assert_int_equal(srv_render_chat(t, src, &rq, "", "<|im_end|>", &out, &len, forced, sizeof forced), TQKV_OK);
    assert_null(strstr(out, "<tools>"));
    assert_string_equal(forced, "");
    free(out);
    srv_request_free(&rq);
    tqkv_chat_template_free(t);
}

static const char *SCRIPT =
    "I will look it up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

static void test_tool_calls_http(void **state) {
    (void)state;
    fixture fx;
    fx_opts o = {0};
    o.script = SCRIPT;
    assert_int_equal(start(&fx, &o), 0);
    char body[2048];
    http_resp r;
    snprintf(body, sizeof body, "{" MSG ",%s,\"max_tokens\":200}", TOOLS);
    assert_int_equal(http_do(fx.port, "POST", H, NULL, body, &r), 0);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *m = cJSON_GetObjectItem(ch, "message");
    assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "tool_calls");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, "I will look it up.");
    cJSON *tc = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0);
    assert_non_null(tc);
    assert_string_equal(cJSON_GetObjectItem(tc, "type")->valuestring, "function");
    assert_true(strlen(cJSON_GetObjectItem(tc, "id")->valuestring) > 5);
    cJSON *fn = cJSON_GetObjectItem(tc, "function");
    assert_string_equal(cJSON_GetObjectItem(fn, "name")->valuestring, "get_weather");
    cJSON *args = cJSON_Parse(cJSON_GetObjectItem(fn, "arguments")->valuestring);
    assert_string_equal(cJSON_GetObjectItem(args, "city")->valuestring, "Paris");
    cJSON_Delete(args);
    cJSON_Delete(j);
    http_resp_free(&r);
    /* streamed, n = 4, a few times: content before the call, then delta.tool_calls, finish
     * tool_calls; a choice that finishes in an earlier write than the others must not send
     * its call's text as content when their events come (it did, under load) */
    for (int rep = 0; rep < 6; rep++) {
        snprintf(body, sizeof body, "{" MSG ",%s,\"stream\":true,\"n\":4}", TOOLS);
        assert_int_equal(http_do(fx.port, "POST", H, NULL, body, &r), 0);
        assert_int_equal(r.status, 200);
        char *text[4];
        char fin[4][32];
        sse_by_index(r.body, 1, 4, text, fin, NULL);
        for (int c = 0; c < 4; c++) {
            if (strcmp(text[c], "I will look it up.") || strcmp(fin[c], "tool_calls"))
                fail_msg("streamed tool call, request %d, choice %d: content '%s', finish '%s'",
                         rep, c, text[c], fin[c]);
            free(text[c]);
        }
        assert_non_null(strstr(r.body, "\"tool_calls\":[{\"index\":0,\"id\":\"call_"));
        assert_non_null(strstr(r.body, "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\""));
        assert_null(strstr(r.body, "<tool_call>"));
        http_resp_free(&r);
    }
    /* tool_choice none: the same output is plain content */
    snprintf(body, sizeof body, "{" MSG ",%s,\"tool_choice\":\"none\"}", TOOLS);
    assert_int_equal(http_do(fx.port, "POST", H, NULL, body, &r), 0);
    j = cJSON_Parse(r.body);
    m = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "message");
    assert_string_equal(cJSON_GetObjectItem(m, "content")->valuestring, SCRIPT);
    assert_null(cJSON_GetObjectItem(m, "tool_calls"));
    cJSON_Delete(j);
    http_resp_free(&r);
    /* the history of a tool round trip is accepted */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather?\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
             "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{}\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"call_1\",\"content\":\"sunny\"}],%s}", TOOLS);
    assert_int_equal(http_do(fx.port, "POST", H, NULL, body, &r), 0);
    assert_int_equal(r.status, 200);
    http_resp_free(&r);
    stop(&fx);
}

/* ------------------------------------------------------------------------- */
/* `tqkv serve` defaults (real engine, bundled model)                         */
/* ------------------------------------------------------------------------- */

/* Physical cores of this process's CPUs, from lscpu (the reference); 0 if unknown. */
static int lscpu_cores(void) {
    FILE *p = popen("lscpu -p=CPU,CORE,SOCKET 2>/dev/null", "r");
    if (!p) return 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    char line[256];
    long seen[1024];
    int n = 0;
    while (fgets(line, sizeof line, p)) {
        int cpu, core, sock;
        if (line[0] == '#' || sscanf(line, "%d,%d,%d", &cpu, &core, &sock) != 3) continue;
        if (cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &set)) continue;
        long key = (long)sock * 65536 + core;
        int dup = 0;
        for (int i = 0; i < n; i++) dup |= seen[i] == key;
        if (!dup && n < 1024) seen[n++] = key;
    }
    pclose(p);
    return n;
}

static void test_serve_defaults(void **state) {
    (void)state;
    char logpath[] = "/tmp/tqkv-serve-log-XXXXXX";
    int lfd = mkstemp(logpath);
    assert_true(lfd >= 0);
    /* the child inherits stderr: point it at the log while spawning */
    int saved = dup(2);
    dup2(lfd, 2);
    int port = 0;
    const char *extra[] = {"--alias", "tiny", "--alias", "gpt-4o-mini", "--host", "::", NULL};
    pid_t pid = serve_spawn(extra, &port);
    dup2(saved, 2);
    close(saved);
    close(lfd);
    assert_true(pid > 0);
    char log[4096] = {0};
    FILE *f = fopen(logpath, "r");
    size_t n = fread(log, 1, sizeof log - 1, f);
    fclose(f);
    log[n] = 0;
    unlink(logpath);
    const char *t = strstr(log, "threads ");
    assert_non_null(t);
    int threads = atoi(t + 8);
    int want = lscpu_cores();
    fprintf(stderr, "serve default threads %d, lscpu physical cores %d\n", threads, want);
    if (want > 0) assert_int_equal(threads, want);
    else assert_true(threads >= 1);
    const char *pc = strstr(log, "prefix cache ");
    assert_non_null(pc);
    assert_true(strtoull(pc + 13, NULL, 10) >= ((size_t)64 << 20));
    /* the prefix cache is on: the second request with a long prompt reuses its prefix */
    char body[8192];
    size_t o = (size_t)snprintf(body, sizeof body, "{\"model\":\"gpt-4o-mini\",\"max_tokens\":2,\"prompt\":\"");
    for (int i = 0; i < 400 && o < sizeof body - 64; i++) o += (size_t)snprintf(body + o, sizeof body - o, "x%d ", i);
    snprintf(body + o, sizeof body - o, "\"}");
    int cached = -1;
    for (int k = 0; k < 2; k++) {
        http_resp r;
        assert_int_equal(http_do(port, "POST", C, NULL, body, &r), 0);
        assert_int_equal(r.status, 200);
        cJSON *j = cJSON_Parse(r.body);
        assert_string_equal(cJSON_GetObjectItem(j, "model")->valuestring, "gpt-4o-mini");
        cached = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens_details"),
                                     "cached_tokens")->valueint;
        cJSON_Delete(j);
        http_resp_free(&r);
    }
    assert_true(cached >= 256);
    /* structured output on the real engine: a schema outside the subset is a 400 naming
     * the schema parameter; a supported one constrains the output */
    const char *sbad = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
                       "\"json_schema\",\"json_schema\":{\"name\":\"s\",\"strict\":true,\"schema\":{\"type\":\"object\","
                       "\"properties\":{\"a\":{\"type\":\"string\",\"pattern\":\"^x\"}}}}}}";
    expect(port, H, sbad, 400, "response_format.json_schema.schema");
    const char *sok = "{\"messages\":[{\"role\":\"user\",\"content\":\"A point.\"}],\"max_tokens\":120,"
                      "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"strict\":true,"
                      "\"schema\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"},\"ok\":"
                      "{\"type\":\"boolean\"}},\"required\":[\"x\",\"ok\"],\"additionalProperties\":false}}}}";
    http_resp sr;
    assert_int_equal(http_do(port, "POST", H, NULL, sok, &sr), 0);
    assert_int_equal(sr.status, 200);
    {
        cJSON *j = cJSON_Parse(sr.body);
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        const char *content = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content")->valuestring;
        fprintf(stderr, "json_schema output: %s (%s)\n", content, cJSON_GetObjectItem(ch, "finish_reason")->valuestring);
        if (!strcmp(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "stop")) {
            cJSON *v = cJSON_Parse(content);
            assert_non_null(v);
            assert_true(cJSON_IsNumber(cJSON_GetObjectItem(v, "x")));
            assert_true(cJSON_IsBool(cJSON_GetObjectItem(v, "ok")));
            assert_int_equal(cJSON_GetArraySize(v), 2);
            cJSON_Delete(v);
        }
        cJSON_Delete(j);
    }
    http_resp_free(&sr);
    /* "::" serves IPv6 too */
    assert_int_equal(get_status(1, port, "/v1/models/tiny"), 200);
    assert_int_equal(serve_stop(pid), 0);
}

static int teardown(void **state) {
    (void)state;
    serve_kill_all();
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unknown_and_unsupported_fields),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_nul_and_top_p),
        cmocka_unit_test(test_retry_after),
        cmocka_unit_test(test_models_aliases_metrics),
        cmocka_unit_test(test_ipv6),
        cmocka_unit_test(test_n_choices),
        cmocka_unit_test(test_tool_parser),
        cmocka_unit_test(test_render_tools),
        cmocka_unit_test(test_tool_calls_http),
        cmocka_unit_test_teardown(test_serve_defaults, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

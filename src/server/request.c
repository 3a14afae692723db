/*
 * request.c - parse and validate one OpenAI request body into an srv_request.
 * Owns: JSON bytes -> request struct, with OpenAI-style errors (status, param, message).
 * Must not: tokenize, touch the engine, allocate anything the caller cannot free with
 * srv_request_free. A pure function of its inputs: this is the request-parser fuzz target.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "server/server.h"

/* ------------------------------------------------------------------------- */
/* Errors                                                                    */
/* ------------------------------------------------------------------------- */

int srv_error_set(srv_error *err, int http_status, const char *type, const char *code,
                  const char *param, const char *fmt, ...) {
    if (!err) return -1;
    err->http_status = http_status;
    err->type = type ? type : "invalid_request_error";
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return -1;
}

#define BAD(param, ...) \
    srv_error_set(err, 400, "invalid_request_error", "invalid_value", param, __VA_ARGS__)
#define BADTYPE(param, want) \
    srv_error_set(err, 400, "invalid_request_error", "invalid_type", param, \
                  "'%s' must be %s", param, want)

/* ------------------------------------------------------------------------- */
/* Field helpers                                                             */
/* ------------------------------------------------------------------------- */

static char *dup_str(const char *s, size_t *len_out) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n + 1);
    if (len_out) *len_out = n;
    return d;
}

/* A JSON number that is an integer in [lo, hi]; 1 ok, 0 not (err set). */
static int get_int(const cJSON *v, const char *name, double lo, double hi, long long *out,
                   srv_error *err) {
    if (!cJSON_IsNumber(v)) return BADTYPE(name, "an integer"), 0;
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d)) return BADTYPE(name, "an integer"), 0;
    if (d < lo || d > hi) return BAD(name, "'%s' must be in [%.0f, %.0f], got %.17g", name, lo, hi, d), 0;
    *out = (long long)d;
    return 1;
}

static int get_num(const cJSON *v, const char *name, double lo, double hi, double *out,
                   srv_error *err) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return BADTYPE(name, "a number"), 0;
    double d = v->valuedouble;
    if (d < lo || d > hi) return BAD(name, "'%s' must be in [%g, %g], got %.17g", name, lo, hi, d), 0;
    *out = d;
    return 1;
}

static int get_bool(const cJSON *v, const char *name, int *out, srv_error *err) {
    if (!cJSON_IsBool(v)) return BADTYPE(name, "a boolean"), 0;
    *out = cJSON_IsTrue(v);
    return 1;
}

/* Present and not JSON null. */
static const cJSON *field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static int oom(srv_error *err) {
    return srv_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
}

/* ------------------------------------------------------------------------- */
/* Prompt / messages                                                         */
/* ------------------------------------------------------------------------- */

static int parse_prompt(const cJSON *p, const srv_limits *lim, srv_request *r, srv_error *err) {
    if (!p) return BAD("prompt", "'prompt' is required");
    if (cJSON_IsString(p)) {
        if (!(r->prompt = dup_str(p->valuestring, &r->prompt_len))) return oom(err);
        return 0;
    }
    if (!cJSON_IsArray(p)) return BADTYPE("prompt", "a string, an array of one string or an array of token ids");
    int n = cJSON_GetArraySize(p);
    if (n == 0) return BAD("prompt", "'prompt' must not be empty");
    const cJSON *first = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(first)) {
        if (n != 1)
            return BAD("prompt", "only one prompt per request is supported (n=1), got %d", n);
        if (!(r->prompt = dup_str(first->valuestring, &r->prompt_len))) return oom(err);
        return 0;
    }
    if (cJSON_IsArray(first))
        return BAD("prompt", "only one prompt per request is supported (n=1)");
    if (!(r->prompt_ids = malloc(sizeof(int32_t) * (size_t)n))) return oom(err);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, p) {
        long long id;
        if (!get_int(it, "prompt", 0, (double)(lim && lim->vocab_size > 0 ? lim->vocab_size - 1 : 2147483647.0), &id, err))
            return -1;
        r->prompt_ids[i++] = (int32_t)id;
    }
    r->n_prompt_ids = n;
    return 0;
}

/* content: string, null (empty), or an array of {"type":"text","text":...} parts. */
static int parse_content(const cJSON *c, int idx, char **out, srv_error *err) {
    char param[48];
    snprintf(param, sizeof param, "messages[%d].content", idx);
    if (!c) {
        *out = dup_str("", NULL);
        return *out ? 0 : oom(err);
    }
    if (cJSON_IsString(c)) {
        *out = dup_str(c->valuestring, NULL);
        return *out ? 0 : oom(err);
    }
    if (!cJSON_IsArray(c)) return BADTYPE(param, "a string or an array of text parts");
    size_t total = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text"))
            return srv_error_set(err, 400, "invalid_request_error", "unsupported_content", param,
                                 "'%s': only parts of type \"text\" are supported", param);
        if (!cJSON_IsString(text)) return BADTYPE(param, "text parts with a string 'text'");
        total += strlen(text->valuestring);
    }
    char *s = malloc(total + 1);
    if (!s) return oom(err);
    size_t o = 0;
    cJSON_ArrayForEach(part, c) {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        size_t n = strlen(t);
        memcpy(s + o, t, n);
        o += n;
    }
    s[o] = 0;
    *out = s;
    return 0;
}

static int parse_messages(const cJSON *m, srv_request *r, srv_error *err) {
    if (!m) return BAD("messages", "'messages' is required");
    if (!cJSON_IsArray(m)) return BADTYPE("messages", "an array of messages");
    int n = cJSON_GetArraySize(m);
    if (n == 0) return BAD("messages", "'messages' must not be empty");
    if (!(r->msgs = calloc((size_t)n, sizeof *r->msgs))) return oom(err);
    cJSON *hist = cJSON_CreateArray(); /* normalized history for the template */
    if (!hist) return oom(err);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, m) {
        char param[48];
        snprintf(param, sizeof param, "messages[%d]", i);
        if (!cJSON_IsObject(it)) return cJSON_Delete(hist), BADTYPE(param, "an object");
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        snprintf(param, sizeof param, "messages[%d].role", i);
        if (!cJSON_IsString(role)) return cJSON_Delete(hist), BADTYPE(param, "a string");
        static const char *const roles[] = {"system", "user", "assistant", "developer", "tool"};
        int ok = 0;
        for (size_t k = 0; k < sizeof roles / sizeof roles[0]; k++)
            ok |= !strcmp(role->valuestring, roles[k]);
        if (!ok) {
            cJSON_Delete(hist);
            return BAD(param, "'%s' must be one of system, user, assistant, developer, tool", param);
        }
        char *content = NULL;
        if (parse_content(field(it, "content"), i, &content, err)) return cJSON_Delete(hist), -1;
        char *rl = dup_str(role->valuestring, NULL);
        cJSON *hm = cJSON_CreateObject();
        if (!rl || !hm) {
            free(content);
            free(rl);
            cJSON_Delete(hm);
            cJSON_Delete(hist);
            return oom(err);
        }
        cJSON_AddItemToArray(hist, hm);
        cJSON_AddStringToObject(hm, "role", rl);
        cJSON_AddStringToObject(hm, "content", content);
        r->msgs[i].role = rl;
        r->msgs[i].content = content;
        r->n_msgs = ++i;
        if (srv_message_ext(it, i - 1, hm, err)) return cJSON_Delete(hist), -1;
    }
    r->messages_json = cJSON_PrintUnformatted(hist);
    cJSON_Delete(hist);
    return r->messages_json ? 0 : oom(err);
}

static int parse_stop(const cJSON *s, srv_request *r, srv_error *err) {
    if (!s) return 0;
    if (cJSON_IsString(s)) {
        if (!s->valuestring[0]) return BAD("stop", "'stop' strings must not be empty");
        if (!(r->stop[0] = dup_str(s->valuestring, NULL))) return oom(err);
        r->n_stop = 1;
        return 0;
    }
    if (!cJSON_IsArray(s)) return BADTYPE("stop", "a string or an array of strings");
    int n = cJSON_GetArraySize(s);
    if (n > SRV_MAX_STOP) return BAD("stop", "'stop' has at most %d strings, got %d", SRV_MAX_STOP, n);
    const cJSON *it;
    cJSON_ArrayForEach(it, s) {
        if (!cJSON_IsString(it)) return BADTYPE("stop", "a string or an array of strings");
        if (!it->valuestring[0]) return BAD("stop", "'stop' strings must not be empty");
        if (!(r->stop[r->n_stop] = dup_str(it->valuestring, NULL))) return oom(err);
        r->n_stop++;
    }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Entry point                                                               */
/* ------------------------------------------------------------------------- */

static int parse_root(srv_api api, const cJSON *root, const srv_limits *lim, srv_request *r,
                      srv_error *err) {
    if (!cJSON_IsObject(root)) return BADTYPE("body", "a JSON object");
    if (srv_request_check_fields(api, root, err)) return -1;
    const cJSON *v;

    if ((v = field(root, "model"))) {
        if (!cJSON_IsString(v)) return BADTYPE("model", "a string");
        int known = !lim || !lim->model_name || !lim->model_name[0];
        if (lim && lim->n_aliases > 0)
            for (int i = 0; i < lim->n_aliases; i++) known |= !strcmp(v->valuestring, lim->aliases[i]);
        else if (!known)
            known = !strcmp(v->valuestring, lim->model_name);
        if (!known)
            return srv_error_set(err, 404, "invalid_request_error", "model_not_found", "model",
                                 "The model '%.120s' does not exist; this server serves '%.120s'",
                                 v->valuestring,
                                 lim->n_aliases > 0 ? lim->aliases[0] : lim->model_name);
        if (!(r->model = dup_str(v->valuestring, NULL))) return oom(err);
    }

    if (api == SRV_API_COMPLETIONS) {
        if (parse_prompt(field(root, "prompt"), lim, r, err)) return -1;
        if ((v = field(root, "echo"))) {
            int echo;
            if (!get_bool(v, "echo", &echo, err)) return -1;
            if (echo) return BAD("echo", "'echo' is not supported");
        }
        if ((v = field(root, "suffix"))) return BAD("suffix", "'suffix' is not supported");
    } else {
        if (parse_messages(field(root, "messages"), r, err)) return -1;
    }

    double ctx = lim && lim->context_len > 0 ? lim->context_len : 2147483647.0;
    long long ll;
    const char *mt_name = "max_tokens";
    v = field(root, "max_tokens");
    if (!v && api == SRV_API_CHAT && (v = field(root, "max_completion_tokens")))
        mt_name = "max_completion_tokens";
    if (v) {
        if (!get_int(v, mt_name, 1, ctx, &ll, err)) return -1;
        r->max_tokens = (int)ll;
    }
    if ((v = field(root, "temperature")) && !get_num(v, "temperature", 0, 2, &r->temperature, err))
        return -1;
    if ((v = field(root, "top_p"))) {
        if (!get_num(v, "top_p", 0, 1, &r->top_p, err)) return -1;
        if (r->top_p <= 0) return BAD("top_p", "'top_p' must be in (0, 1], got %g", r->top_p);
        /* a positive top_p below the smallest float keeps only the best token, as it says */
        if ((float)r->top_p <= 0) r->top_p = 1.1754943508222875e-38;
    }
    if ((v = field(root, "seed"))) {
        if (!get_int(v, "seed", -9007199254740991.0, 9007199254740991.0, &ll, err)) return -1;
        r->seed = (uint64_t)ll;
        r->has_seed = 1;
    }
    if ((v = field(root, "stream")) && !get_bool(v, "stream", &r->stream, err)) return -1;
    if ((v = field(root, "stream_options"))) {
        if (!cJSON_IsObject(v)) return BADTYPE("stream_options", "an object");
        if (!r->stream)
            return BAD("stream_options", "'stream_options' is only allowed with stream=true");
        const cJSON *iu = field(v, "include_usage");
        if (iu && !get_bool(iu, "stream_options.include_usage", &r->include_usage, err)) return -1;
    }
    if ((v = field(root, "stop")) && parse_stop(v, r, err)) return -1;
    if ((v = field(root, "ignore_eos")) && !get_bool(v, "ignore_eos", &r->ignore_eos, err)) return -1;
    if (srv_request_parse_ext(root, lim, r, err)) return -1;

    if (api == SRV_API_COMPLETIONS) {
        if ((v = field(root, "logprobs"))) {
            if (!get_int(v, "logprobs", 0, TQKV_MAX_TOP_LOGPROBS, &ll, err)) return -1;
            r->top_logprobs = (int)ll;
        }
    } else {
        int lp = 0;
        if ((v = field(root, "logprobs")) && !get_bool(v, "logprobs", &lp, err)) return -1;
        if ((v = field(root, "top_logprobs"))) {
            if (!get_int(v, "top_logprobs", 0, TQKV_MAX_TOP_LOGPROBS, &ll, err)) return -1;
            if (!lp) return BAD("top_logprobs", "'top_logprobs' requires 'logprobs': true");
            r->top_logprobs = (int)ll;
        } else if (lp) {
            r->top_logprobs = 0;
        }
    }
    return 0;
}

int srv_request_parse(srv_api api, const char *body, size_t len, const srv_limits *lim,
                      srv_request *out, srv_error *err) {
    srv_request r;
    memset(&r, 0, sizeof r);
    r.api = api;
    r.max_tokens = -1;
    r.temperature = 1.0;
    r.top_p = 1.0;
    r.top_logprobs = -1;
    r.n = 1;
    memset(out, 0, sizeof *out);
    if (!body || len == 0)
        return srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                             "request body is empty; expected a JSON object");
    char nul_param[64];
    if (srv_body_find_nul(body, len, nul_param, sizeof nul_param))
        return srv_error_set(err, 400, "invalid_request_error", "invalid_value", nul_param,
                             "'%s' contains a NUL character (\\u0000), which this server does "
                             "not accept in text", nul_param);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        size_t off = end && end >= body && end <= body + len ? (size_t)(end - body) : 0;
        return srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                             "request body is not valid JSON (error near byte %zu)", off);
    }
    /* trailing bytes after the value: only whitespace (or one NUL) is allowed */
    for (const char *p = end; p && p < body + len; p++) {
        if (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n' || (*p == 0 && p + 1 == body + len)) continue;
        cJSON_Delete(root);
        return srv_error_set(err, 400, "invalid_request_error", "invalid_json", NULL,
                             "request body has trailing bytes after the JSON value (byte %zu)",
                             (size_t)(p - body));
    }
    int rc = parse_root(api, root, lim, &r, err);
    cJSON_Delete(root);
    if (rc) {
        srv_request_free(&r);
        return -1;
    }
    *out = r;
    return 0;
}

void srv_request_free(srv_request *r) {
    if (!r) return;
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    for (int i = 0; i < r->n_msgs; i++) {
        free((char *)r->msgs[i].role);
        free((char *)r->msgs[i].content);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->bias_ids);
    free(r->bias_vals);
    free(r->messages_json);
    free(r->tools_json);
    free(r->tool_name);
    free(r->schema_json);
    memset(r, 0, sizeof *r);
    r->n = 1;
    r->top_logprobs = -1;
    r->max_tokens = -1;
}

/*
 * request_ext.c - the strict part of request parsing (issue 27): which top-level and
 * nested fields a request may carry (unknown or unsupported ones get a 400 naming them),
 * escaped NULs in strings (refused, never truncated), and the fields of the OpenAI API
 * that go beyond plain generation: n, penalties, logit_bias, tools, tool_choice,
 * response_format, and the chat history as JSON for the template (tool calls and tool
 * messages included).
 * Owns: the field tables and the parse of those fields into srv_request.
 * Must not: tokenize, render templates, touch the engine. Pure, like request.c.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "server/server.h"

#define BAD(param, ...) \
    srv_error_set(err, 400, "invalid_request_error", "invalid_value", param, __VA_ARGS__)
#define BADTYPE(param, want) \
    srv_error_set(err, 400, "invalid_request_error", "invalid_type", param, \
                  "'%s' must be %s", param, want)
#define UNSUPPORTED(param) \
    srv_error_set(err, 400, "invalid_request_error", "unsupported_parameter", param, \
                  "'%s' is not supported by this server", param)
#define UNKNOWN(param) \
    srv_error_set(err, 400, "invalid_request_error", "unknown_parameter", param, \
                  "Unrecognized request argument supplied: '%s'", param)

static int oom(srv_error *err) {
    return srv_error_set(err, 500, "server_error", "out_of_memory", NULL, "out of memory");
}

static const cJSON *field(const cJSON *root, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static char *dup_s(const char *s) {
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* ------------------------------------------------------------------------- */
/* Field tables                                                              */
/* ------------------------------------------------------------------------- */

/* A field this server reads (1), or one of the OpenAI API that it refuses (0): a field
 * missing from both is unknown. `user` is read and ignored: in OpenAI's API it is only an
 * end-user identifier for abuse monitoring, it never changes the output. */
typedef struct { const char *name; int supported; } field_rule;

static const field_rule CHAT_FIELDS[] = {
    {"model", 1}, {"messages", 1}, {"max_tokens", 1}, {"max_completion_tokens", 1},
    {"temperature", 1}, {"top_p", 1}, {"seed", 1}, {"n", 1}, {"stream", 1},
    {"stream_options", 1}, {"stop", 1}, {"frequency_penalty", 1}, {"presence_penalty", 1},
    {"logit_bias", 1}, {"logprobs", 1}, {"top_logprobs", 1}, {"user", 1}, {"tools", 1},
    {"tool_choice", 1}, {"parallel_tool_calls", 1}, {"response_format", 1},
    {"ignore_eos", 1},
    {"functions", 0}, {"function_call", 0}, {"audio", 0}, {"modalities", 0},
    {"prediction", 0}, {"store", 0}, {"metadata", 0}, {"service_tier", 0},
    {"reasoning_effort", 0}, {"web_search_options", 0}, {"verbosity", 0},
    {"prompt_cache_key", 0}, {"safety_identifier", 0}, {"top_k", 0}, {"min_p", 0},
    {"repetition_penalty", 0},
};

static const field_rule CMPL_FIELDS[] = {
    {"model", 1}, {"prompt", 1}, {"max_tokens", 1}, {"temperature", 1}, {"top_p", 1},
    {"seed", 1}, {"n", 1}, {"stream", 1}, {"stream_options", 1}, {"stop", 1},
    {"frequency_penalty", 1}, {"presence_penalty", 1}, {"logit_bias", 1}, {"logprobs", 1},
    {"user", 1}, {"echo", 1}, {"suffix", 1}, {"best_of", 1}, {"ignore_eos", 1},
    {"top_k", 0}, {"min_p", 0}, {"repetition_penalty", 0},
};

/* Every key of obj must be in names [n] (nested objects: stream_options, messages...). */
static int check_keys(const cJSON *obj, const char *prefix, const char *const *names, int n,
                      srv_error *err) {
    const cJSON *it;
    cJSON_ArrayForEach(it, obj) {
        int ok = 0;
        for (int i = 0; i < n && !ok; i++) ok = !strcmp(it->string, names[i]);
        if (!ok) {
            char p[64];
            snprintf(p, sizeof p, "%s%s", prefix, it->string);
            return UNKNOWN(p);
        }
    }
    return 0;
}

int srv_request_check_fields(srv_api api, const cJSON *root, srv_error *err) {
    const field_rule *t = api == SRV_API_CHAT ? CHAT_FIELDS : CMPL_FIELDS;
    int n = api == SRV_API_CHAT ? (int)(sizeof CHAT_FIELDS / sizeof CHAT_FIELDS[0])
                                : (int)(sizeof CMPL_FIELDS / sizeof CMPL_FIELDS[0]);
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        int k = 0;
        while (k < n && strcmp(t[k].name, it->string)) k++;
        if (k == n) {
            char p[64];
            snprintf(p, sizeof p, "%s", it->string);
            return UNKNOWN(p);
        }
        if (!t[k].supported && !cJSON_IsNull(it)) return UNSUPPORTED(t[k].name);
    }
    const cJSON *so = field(root, "stream_options");
    static const char *const SO[] = {"include_usage"};
    if (so && cJSON_IsObject(so) && check_keys(so, "stream_options.", SO, 1, err)) return -1;
    const cJSON *u = field(root, "user");
    if (u && !cJSON_IsString(u)) return BADTYPE("user", "a string");
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Escaped NULs                                                              */
/* ------------------------------------------------------------------------- */

/* cJSON decodes "\u0000" into a C string, which would end the string there: a prompt
 * or message would be silently cut. This scan finds one before parsing and names the
 * top-level field it sits in. Returns 1 (param filled) or 0. The body need not be
 * valid JSON (the parser judges that afterwards). */
int srv_body_find_nul(const char *body, size_t len, char *param, size_t cap) {
    int depth = 0, in_str = 0;
    size_t key0 = 0, key1 = 0, s0 = 0;
    char key[64] = "";
    for (size_t i = 0; i < len; i++) {
        char c = body[i];
        if (in_str) {
            if (c == '\\' && i + 1 < len) {
                if (body[i + 1] == 'u' && i + 5 < len && !memcmp(body + i + 2, "0000", 4)) {
                    snprintf(param, cap, "%s", key[0] ? key : "body");
                    return 1;
                }
                i++;
            } else if (c == '"') {
                in_str = 0;
                key0 = s0, key1 = i;
            }
            continue;
        }
        switch (c) {
        case '"': in_str = 1; s0 = i + 1; break;
        case '{': case '[': depth++; break;
        case '}': case ']': depth--; break;
        case ':':
            if (depth == 1) { /* the string just closed was a top-level key */
                size_t n = key1 > key0 ? key1 - key0 : 0;
                if (n >= sizeof key) n = sizeof key - 1;
                memcpy(key, body + key0, n);
                key[n] = 0;
            }
            break;
        default: break;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------- */
/* n, penalties, logit_bias                                                  */
/* ------------------------------------------------------------------------- */

static int parse_bias(const cJSON *v, const srv_limits *lim, srv_request *r, srv_error *err) {
    if (!cJSON_IsObject(v)) return BADTYPE("logit_bias", "an object mapping token ids to numbers");
    int n = cJSON_GetArraySize(v);
    if (n > SRV_MAX_BIAS) return BAD("logit_bias", "'logit_bias' has at most %d entries, got %d", SRV_MAX_BIAS, n);
    if (n == 0) return 0;
    r->bias_ids = malloc(sizeof(int32_t) * (size_t)n);
    r->bias_vals = malloc(sizeof(float) * (size_t)n);
    if (!r->bias_ids || !r->bias_vals) return oom(err);
    const cJSON *it;
    long vocab = lim && lim->vocab_size > 0 ? lim->vocab_size : 2147483647L;
    cJSON_ArrayForEach(it, v) {
        char *end = NULL;
        long id = strtol(it->string, &end, 10);
        if (!it->string[0] || *end || id < 0 || id >= vocab)
            return BAD("logit_bias", "'logit_bias' keys must be token ids in [0, %ld), got '%.40s'",
                       vocab, it->string);
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
            return BADTYPE("logit_bias", "an object mapping token ids to numbers");
        if (it->valuedouble < -100 || it->valuedouble > 100)
            return BAD("logit_bias", "'logit_bias' values must be in [-100, 100], got %.17g",
                       it->valuedouble);
        for (int k = 0; k < r->n_bias; k++)
            if (r->bias_ids[k] == (int32_t)id)
                return BAD("logit_bias", "'logit_bias' has token %ld twice", id);
        r->bias_ids[r->n_bias] = (int32_t)id;
        r->bias_vals[r->n_bias++] = (float)it->valuedouble;
    }
    return 0;
}

static int parse_sampling_ext(const cJSON *root, const srv_limits *lim, srv_request *r,
                              srv_error *err) {
    const cJSON *v;
    if ((v = field(root, "n"))) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || !isfinite(v->valuedouble))
            return BADTYPE("n", "an integer");
        if (v->valuedouble < 1 || v->valuedouble > SRV_MAX_N)
            return BAD("n", "'n' must be in [1, %d], got %.17g", SRV_MAX_N, v->valuedouble);
        r->n = (int)v->valuedouble;
    }
    if (r->api == SRV_API_COMPLETIONS && (v = field(root, "best_of"))) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
            return BADTYPE("best_of", "an integer");
        if (v->valuedouble != r->n)
            return BAD("best_of", "'best_of' other than n is not supported (got %.17g, n = %d)",
                       v->valuedouble, r->n);
    }
    for (int i = 0; i < 2; i++) {
        const char *pen = i ? "presence_penalty" : "frequency_penalty";
        if (!(v = field(root, pen))) continue;
        if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return BADTYPE(pen, "a number");
        if (v->valuedouble < -2 || v->valuedouble > 2)
            return BAD(pen, "'%s' must be in [-2, 2], got %.17g", pen, v->valuedouble);
        *(i ? &r->presence_penalty : &r->frequency_penalty) = v->valuedouble;
    }
    if ((v = field(root, "logit_bias")) && parse_bias(v, lim, r, err)) return -1;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Tools and response_format                                                 */
/* ------------------------------------------------------------------------- */

static int valid_fn_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static int parse_tools(const cJSON *v, srv_request *r, srv_error *err) {
    if (!cJSON_IsArray(v)) return BADTYPE("tools", "an array of tools");
    int n = cJSON_GetArraySize(v);
    if (n > SRV_MAX_TOOLS) return BAD("tools", "'tools' has at most %d entries, got %d", SRV_MAX_TOOLS, n);
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, v) {
        char p[64];
        snprintf(p, sizeof p, "tools[%d]", i);
        if (!cJSON_IsObject(t)) return BADTYPE(p, "an object");
        static const char *const TK[] = {"type", "function"};
        if (check_keys(t, "tools[].", TK, 2, err)) return -1;
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(t, "type");
        snprintf(p, sizeof p, "tools[%d].type", i);
        if (!cJSON_IsString(ty)) return BADTYPE(p, "a string");
        if (strcmp(ty->valuestring, "function")) return BAD(p, "'%s' must be \"function\"", p);
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        snprintf(p, sizeof p, "tools[%d].function", i);
        if (!cJSON_IsObject(f)) return BADTYPE(p, "an object");
        static const char *const FK[] = {"name", "description", "parameters", "strict"};
        if (check_keys(f, "tools[].function.", FK, 4, err)) return -1;
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name");
        snprintf(p, sizeof p, "tools[%d].function.name", i);
        if (!cJSON_IsString(nm)) return BADTYPE(p, "a string");
        if (!valid_fn_name(nm->valuestring))
            return BAD(p, "'%s' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", p);
        for (int k = 0; k < i; k++) {
            const cJSON *o = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(v, k), "function"), "name");
            if (!strcmp(o->valuestring, nm->valuestring))
                return BAD(p, "tool name '%s' appears twice", nm->valuestring);
        }
        const cJSON *d = field(f, "description"), *pa = field(f, "parameters"), *st = field(f, "strict");
        snprintf(p, sizeof p, "tools[%d].function.description", i);
        if (d && !cJSON_IsString(d)) return BADTYPE(p, "a string");
        snprintf(p, sizeof p, "tools[%d].function.parameters", i);
        if (pa && !cJSON_IsObject(pa)) return BADTYPE(p, "a JSON Schema object");
        snprintf(p, sizeof p, "tools[%d].function.strict", i);
        if (st && !cJSON_IsBool(st)) return BADTYPE(p, "a boolean");
        i++;
    }
    r->n_tools = n;
    if (n && !(r->tools_json = cJSON_PrintUnformatted(v))) return oom(err);
    return 0;
}

static int parse_tool_choice(const cJSON *v, const cJSON *tools, srv_request *r, srv_error *err) {
    if (cJSON_IsString(v)) {
        const char *s = v->valuestring;
        if (!strcmp(s, "none")) r->tool_choice = SRV_TOOL_NONE;
        else if (!strcmp(s, "auto")) r->tool_choice = SRV_TOOL_AUTO;
        else if (!strcmp(s, "required")) r->tool_choice = SRV_TOOL_REQUIRED;
        else return BAD("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                        "{\"type\":\"function\",\"function\":{\"name\":...}}");
    } else if (cJSON_IsObject(v)) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(v, "type");
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(v, "function");
        const cJSON *nm = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "name") : NULL;
        static const char *const K[] = {"type", "function"}, *const FK[] = {"name"};
        if (check_keys(v, "tool_choice.", K, 2, err)) return -1;
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "function") || !cJSON_IsString(nm))
            return BADTYPE("tool_choice", "\"none\", \"auto\", \"required\" or "
                           "{\"type\":\"function\",\"function\":{\"name\":...}}");
        if (check_keys(f, "tool_choice.function.", FK, 1, err)) return -1;
        r->tool_choice = SRV_TOOL_NAMED;
        if (!(r->tool_name = dup_s(nm->valuestring))) return oom(err);
    } else {
        return BADTYPE("tool_choice", "a string or an object");
    }
    if (r->tool_choice != SRV_TOOL_NONE && !r->n_tools)
        return BAD("tool_choice", "'tool_choice' is only allowed when 'tools' are specified");
    if (r->tool_choice == SRV_TOOL_NAMED) {
        int found = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, tools) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
            found |= !strcmp(nm->valuestring, r->tool_name);
        }
        if (!found)
            return BAD("tool_choice", "'tool_choice' names '%.64s', which is not in 'tools'", r->tool_name);
    }
    return 0;
}

static int parse_response_format(const cJSON *v, srv_request *r, srv_error *err) {
    if (!cJSON_IsObject(v)) return BADTYPE("response_format", "an object");
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(v, "type");
    if (!cJSON_IsString(ty)) return BADTYPE("response_format.type", "a string");
    if (!strcmp(ty->valuestring, "text") || !strcmp(ty->valuestring, "json_object")) {
        static const char *const K[] = {"type"};
        if (check_keys(v, "response_format.", K, 1, err)) return -1;
        r->format = ty->valuestring[0] == 't' ? SRV_FORMAT_TEXT : SRV_FORMAT_JSON_OBJECT;
        return 0;
    }
    if (strcmp(ty->valuestring, "json_schema"))
        return BAD("response_format.type", "'response_format.type' must be \"text\", "
                   "\"json_object\" or \"json_schema\"");
    static const char *const K[] = {"type", "json_schema"};
    if (check_keys(v, "response_format.", K, 2, err)) return -1;
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(v, "json_schema");
    if (!cJSON_IsObject(js)) return BADTYPE("response_format.json_schema", "an object");
    static const char *const JK[] = {"name", "description", "schema", "strict"};
    if (check_keys(js, "response_format.json_schema.", JK, 4, err)) return -1;
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(js, "name");
    if (!cJSON_IsString(nm)) return BADTYPE("response_format.json_schema.name", "a string");
    if (!valid_fn_name(nm->valuestring))
        return BAD("response_format.json_schema.name",
                   "'response_format.json_schema.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
    const cJSON *d = field(js, "description"), *sc = field(js, "schema"), *st = field(js, "strict");
    if (d && !cJSON_IsString(d)) return BADTYPE("response_format.json_schema.description", "a string");
    if (sc && !cJSON_IsObject(sc)) return BADTYPE("response_format.json_schema.schema", "an object");
    if (st && !cJSON_IsBool(st)) return BADTYPE("response_format.json_schema.strict", "a boolean");
    r->format = SRV_FORMAT_JSON_SCHEMA;
    r->schema_json = sc ? cJSON_PrintUnformatted(sc) : dup_s("{}");
    return r->schema_json ? 0 : oom(err);
}

/* ------------------------------------------------------------------------- */
/* Chat history as JSON for the template                                     */
/* ------------------------------------------------------------------------- */

/* One assistant tool call of the history: {"id","type":"function","function":{name,
 * arguments}} with arguments a JSON string; the template gets arguments parsed into an
 * object when it is one (the Qwen, Llama and Gemma templates print objects with tojson
 * and strings as they are). */
static cJSON *history_tool_call(const cJSON *tc, int i, int k, srv_error *err) {
    char p[80];
    snprintf(p, sizeof p, "messages[%d].tool_calls[%d]", i, k);
    if (!cJSON_IsObject(tc)) return BADTYPE(p, "an object"), NULL;
    static const char *const K[] = {"id", "type", "function"}, *const FK[] = {"name", "arguments"};
    if (check_keys(tc, "messages[].tool_calls[].", K, 3, err)) return NULL;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(tc, "function");
    const cJSON *id = field(tc, "id"), *ty = field(tc, "type");
    if (id && !cJSON_IsString(id)) return BADTYPE(p, "an object with a string 'id'"), NULL;
    if (ty && (!cJSON_IsString(ty) || strcmp(ty->valuestring, "function")))
        return BAD(p, "'%s.type' must be \"function\"", p), NULL;
    if (!cJSON_IsObject(f)) return BADTYPE(p, "an object with a 'function' object"), NULL;
    if (check_keys(f, "messages[].tool_calls[].function.", FK, 2, err)) return NULL;
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name");
    const cJSON *ar = cJSON_GetObjectItemCaseSensitive(f, "arguments");
    if (!cJSON_IsString(nm) || !cJSON_IsString(ar))
        return BADTYPE(p, "a function with string 'name' and 'arguments'"), NULL;
    cJSON *o = cJSON_CreateObject();
    if (id) cJSON_AddStringToObject(o, "id", id->valuestring);
    cJSON_AddStringToObject(o, "type", "function");
    cJSON *fo = cJSON_AddObjectToObject(o, "function");
    cJSON_AddStringToObject(fo, "name", nm->valuestring);
    cJSON *args = cJSON_Parse(ar->valuestring);
    if (args && cJSON_IsObject(args)) cJSON_AddItemToObject(fo, "arguments", args);
    else {
        cJSON_Delete(args);
        cJSON_AddStringToObject(fo, "arguments", ar->valuestring);
    }
    return o;
}

/* messages[i] beyond role and content: keys allowed, tool_calls, tool_call_id, name;
 * appended to the normalized message m (content already a string there). */
int srv_message_ext(const cJSON *msg, int i, cJSON *m, srv_error *err) {
    static const char *const K[] = {"role", "content", "name", "tool_calls", "tool_call_id",
                                    "refusal", "reasoning_content"};
    char p[64];
    snprintf(p, sizeof p, "messages[%d].", i);
    if (check_keys(msg, p, K, 7, err)) return -1;
    const char *role = cJSON_GetObjectItemCaseSensitive(msg, "role")->valuestring;
    const cJSON *v;
    if ((v = field(msg, "name"))) {
        snprintf(p, sizeof p, "messages[%d].name", i);
        if (!cJSON_IsString(v)) return BADTYPE(p, "a string");
        cJSON_AddStringToObject(m, "name", v->valuestring);
    }
    if ((v = field(msg, "refusal"))) {
        snprintf(p, sizeof p, "messages[%d].refusal", i);
        return UNSUPPORTED(p);
    }
    if ((v = field(msg, "reasoning_content"))) {
        snprintf(p, sizeof p, "messages[%d].reasoning_content", i);
        if (strcmp(role, "assistant")) return BAD(p, "'%s' is only allowed on assistant messages", p);
        if (!cJSON_IsString(v)) return BADTYPE(p, "a string");
        cJSON_AddStringToObject(m, "reasoning_content", v->valuestring);
    }
    if ((v = field(msg, "tool_calls"))) {
        snprintf(p, sizeof p, "messages[%d].tool_calls", i);
        if (strcmp(role, "assistant")) return BAD(p, "'%s' is only allowed on assistant messages", p);
        if (!cJSON_IsArray(v)) return BADTYPE(p, "an array");
        cJSON *arr = cJSON_AddArrayToObject(m, "tool_calls");
        int k = 0;
        const cJSON *tc;
        cJSON_ArrayForEach(tc, v) {
            cJSON *o = history_tool_call(tc, i, k++, err);
            if (!o) return -1;
            cJSON_AddItemToArray(arr, o);
        }
    }
    v = field(msg, "tool_call_id");
    snprintf(p, sizeof p, "messages[%d].tool_call_id", i);
    if (v && strcmp(role, "tool")) return BAD(p, "'%s' is only allowed on tool messages", p);
    if (v && !cJSON_IsString(v)) return BADTYPE(p, "a string");
    if (!v && !strcmp(role, "tool")) return BAD(p, "'%s' is required for tool messages", p);
    if (v) cJSON_AddStringToObject(m, "tool_call_id", v->valuestring);
    return 0;
}

/* ------------------------------------------------------------------------- */
/* Entry                                                                     */
/* ------------------------------------------------------------------------- */

int srv_request_parse_ext(const cJSON *root, const srv_limits *lim, srv_request *r,
                          srv_error *err) {
    if (parse_sampling_ext(root, lim, r, err)) return -1;
    if (r->api != SRV_API_CHAT) return 0;
    const cJSON *v, *tools = field(root, "tools");
    if (tools && parse_tools(tools, r, err)) return -1;
    r->tool_choice = r->n_tools ? SRV_TOOL_AUTO : SRV_TOOL_NONE;
    if ((v = field(root, "tool_choice")) && parse_tool_choice(v, tools, r, err)) return -1;
    r->parallel_tool_calls = 1;
    if ((v = field(root, "parallel_tool_calls"))) {
        if (!cJSON_IsBool(v)) return BADTYPE("parallel_tool_calls", "a boolean");
        r->parallel_tool_calls = cJSON_IsTrue(v);
    }
    if ((v = field(root, "response_format")) && parse_response_format(v, r, err)) return -1;
    return 0;
}

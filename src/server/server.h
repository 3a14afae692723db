/*
 * server.h - the OpenAI-compatible HTTP server of `tqkv serve` (internal to the tqkv
 * executable and its tests; not a public header).
 *
 * Owns: the split of the server by concern:
 *   request.c  - pure parse + validation of a request body (JSON bytes -> srv_request);
 *                the fuzz target;
 *   request_ext.c - the strict part of it: unknown / unsupported fields, escaped NULs,
 *                n, penalties, logit_bias, tools, tool_choice, response_format, the chat
 *                history as JSON for the template;
 *   chat_render.c - a chat request's prompt through the template (tools, forced call start);
 *   tools.c    - tool calls parsed from an output (Qwen/Hermes, Llama 3, Gemma 4);
 *   response.c - JSON bodies, SSE chunks and OpenAI-style error JSON (cJSON);
 *   metrics.c  - Prometheus text for /metrics;
 *   http.c     - libmicrohttpd plumbing: routing, body limit, API key, per-request job
 *                queues fed by the engine callback, disconnect -> cancel, drain.
 *   conn_guard.c - slow-client defence: header / body deadlines, reserved slots for
 *                requests that have arrived, eviction of the longest-sending connection.
 * Must not: run the model or schedule requests (the engine does), print to stdout.
 *
 * The server reaches the engine only through srv_engine (a table of functions), so its
 * tests can drive it with a test double and the real engine is bound by the CLI.
 */
#ifndef TQKV_SERVER_H
#define TQKV_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"
#include "tqkv_chat.h"
#include "tqkv_engine.h"
#include "tqkv_tokenizer.h"

/* ------------------------------------------------------------------------- */
/* Request parsing (request.c)                                               */
/* ------------------------------------------------------------------------- */

typedef enum { SRV_API_COMPLETIONS = 0, SRV_API_CHAT } srv_api;

#define SRV_MAX_STOP 16
#define SRV_MAX_N 16       /* choices per request */
#define SRV_MAX_BIAS 1024  /* logit_bias entries */
#define SRV_MAX_TOOLS 128

typedef enum { SRV_TOOL_NONE = 0, SRV_TOOL_AUTO, SRV_TOOL_REQUIRED, SRV_TOOL_NAMED } srv_tool_choice;
typedef enum { SRV_FORMAT_TEXT = 0, SRV_FORMAT_JSON_OBJECT, SRV_FORMAT_JSON_SCHEMA } srv_format;

typedef struct {
    int         http_status;  /* 400, 401, 404, 405, 413, 500, 503 */
    const char *type;         /* "invalid_request_error", "authentication_error", ... */
    const char *code;         /* short machine code or NULL */
    char        param[64];    /* offending field, "" = none */
    char        message[320];
} srv_error;

typedef struct {
    srv_api            api;
    char              *model;        /* NULL when absent */
    /* completions: text prompt, or token ids */
    char              *prompt;       /* NUL-terminated UTF-8, or NULL */
    size_t             prompt_len;
    int32_t           *prompt_ids;   /* [n_prompt_ids] or NULL */
    int                n_prompt_ids;
    /* chat: messages (role and content strings owned here) */
    tqkv_chat_message *msgs;         /* [n_msgs] */
    int                n_msgs;
    int                max_tokens;   /* -1 = not given */
    double             temperature;  /* default 1.0 as in OpenAI */
    double             top_p;        /* default 1.0 */
    uint64_t           seed;
    int                has_seed;
    char              *stop[SRV_MAX_STOP];
    int                n_stop;
    int                stream;
    int                include_usage;
    int                top_logprobs; /* -1 = no logprobs */
    int                ignore_eos;   /* extension (llama-server's): generate past EOS */
    /* beyond plain generation (request_ext.c) */
    int                n;            /* choices, 1..SRV_MAX_N */
    double             frequency_penalty, presence_penalty; /* [-2, 2], 0 = off */
    int32_t           *bias_ids;     /* [n_bias] logit_bias token ids */
    float             *bias_vals;    /* [n_bias] their biases, [-100, 100] */
    int                n_bias;
    char              *messages_json; /* chat: the history as the template gets it */
    char              *tools_json;   /* the "tools" array as JSON, NULL = none */
    int                n_tools;
    srv_tool_choice    tool_choice;
    char              *tool_name;    /* SRV_TOOL_NAMED */
    int                parallel_tool_calls;
    srv_format         format;       /* response_format */
    char              *schema_json;  /* SRV_FORMAT_JSON_SCHEMA: the schema, JSON */
} srv_request;

typedef struct {
    const char *model_name;  /* the one served model ("" accepts any) */
    int         context_len; /* max prompt + generated tokens */
    int32_t     vocab_size;  /* for token-id prompts */
    const char *const *aliases; /* [n_aliases]: when given, the names a request may use
                                   instead of model_name */
    int         n_aliases;
} srv_limits;

/* Parse body [len] (need not be NUL-terminated). 0 and *out filled (free with
 * srv_request_free), or -1 with *err filled and *out zeroed. Never reads past len. */
int  srv_request_parse(srv_api api, const char *body, size_t len, const srv_limits *lim,
                       srv_request *out, srv_error *err);
void srv_request_free(srv_request *r);

/* request_ext.c (called by srv_request_parse): unknown / unsupported top-level fields
 * (400 naming them); the fields beyond plain generation; a message's fields beyond role
 * and content, appended to m (its normalized JSON for the template); an escaped NUL in
 * any string of body (1 and *param = the top-level field holding it, else 0). */
struct cJSON;
int  srv_request_check_fields(srv_api api, const struct cJSON *root, srv_error *err);
int  srv_request_parse_ext(const struct cJSON *root, const srv_limits *lim, srv_request *r,
                           srv_error *err);
int  srv_message_ext(const struct cJSON *msg, int i, struct cJSON *m, srv_error *err);
int  srv_body_find_nul(const char *body, size_t len, char *param, size_t cap);
/* chat_render.c: the prompt text of a chat request (history, tools) with template t (its
 * source src, for the tool-call format). tool_choice required / named: the start of a
 * call in that format ends the prompt and is copied to forced [forced_cap] (the output
 * continues it), else forced = "". */
tqkv_status srv_render_chat(const tqkv_chat_template *t, const char *src, const srv_request *rq,
                            const char *bos, const char *eos, char **out, size_t *out_len,
                            char *forced, size_t forced_cap);
/* Fill *err; returns -1 (for "return srv_error_set(...)"). */
int  srv_error_set(srv_error *err, int http_status, const char *type, const char *code,
                   const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* ------------------------------------------------------------------------- */
/* Responses (response.c)                                                    */
/* ------------------------------------------------------------------------- */

/* One generated token as recorded for a response. */
typedef struct {
    int32_t token;
    float   logprob;
    int     n_top;
    int32_t top_ids[TQKV_MAX_TOP_LOGPROBS];
    float   top_lp[TQKV_MAX_TOP_LOGPROBS];
    size_t  text_off;  /* byte offset of this event's released text in the output */
    size_t  text_len;
} srv_piece;

typedef struct {
    srv_api     api;
    const char *id;         /* "chatcmpl-7" / "cmpl-7" */
    long long   created;    /* unix seconds */
    const char *model;
    int         top_logprobs; /* -1 = none */
    const tqkv_tokenizer *tok;
} srv_resp_ctx;

typedef struct {
    int prompt_tokens, completion_tokens, cached_tokens;
} srv_usage;

/* A tool call parsed from a choice's output (tools.c). */
typedef struct {
    char *id;         /* "call_<request id>_<choice>_<k>" */
    char *name;
    char *arguments;  /* JSON text of the arguments object */
} srv_tool_call;

/* One choice of a response. */
typedef struct {
    const char          *text;      /* content [text_len] (tool calls taken out) */
    size_t               text_len;
    const srv_piece     *pieces;    /* [n_pieces] for logprobs */
    int                  n_pieces;
    const char          *finish;    /* "stop", "length", "tool_calls" */
    const srv_tool_call *calls;     /* [n_calls] chat only */
    int                  n_calls;
} srv_choice_out;

/* All return malloc'd NUL-terminated text or NULL on allocation failure. */
char *srv_error_json(const srv_error *err);
/* The whole non-streamed response: choices [n]. */
char *srv_response_json(const srv_resp_ctx *c, const srv_choice_out *ch, int n,
                        const srv_usage *u);
/* "data: {...}\n\n" of choice `index`: content [len] (has_content 0: no content field),
 * logprobs of pieces [n]; first = 1 adds the assistant role (chat). finish != NULL: the
 * closing chunk with finish_reason. */
char *srv_chunk_sse(const srv_resp_ctx *c, int index, const char *content, size_t len,
                    int has_content, const srv_piece *pieces, int n, int first,
                    const char *finish);
/* tools.c: tool calls in a finished output text [len] (Qwen/Hermes <tool_call> blocks,
 * Llama 3 JSON, Gemma 4 <|tool_call>): 0 and *calls [*n_calls] (NULL / 0 when the text is
 * not calls; parallel 0 keeps the first) and *content_end = the length of the content
 * before them; -1 out of memory. Ids are call_<req_id>_<choice>_<k>. */
int    srv_tool_parse(const char *text, size_t len, const char *req_id, int choice, int parallel,
                      srv_tool_call **calls, int *n_calls, size_t *content_end);
/* Bytes of a growing output that can go out as content: none of a possible call. */
size_t srv_tool_safe_len(const char *text, size_t len);
void   srv_tool_calls_free(srv_tool_call *c, int n);
/* A chat chunk carrying delta.tool_calls [n] of choice index (each whole: id, type,
 * name and the complete arguments). */
char *srv_tool_calls_sse(const srv_resp_ctx *c, int index, const srv_tool_call *calls, int n);
/* The usage chunk (choices []) of stream_options.include_usage. */
char *srv_usage_sse(const srv_resp_ctx *c, const srv_usage *u);
/* "data: {"error":...}\n\n" */
char *srv_error_sse(const srv_error *err);
const char *srv_finish_name(tqkv_finish_reason f);

/* ------------------------------------------------------------------------- */
/* Engine binding and server                                                 */
/* ------------------------------------------------------------------------- */

typedef struct {
    void                 *ctx;
    tqkv_status         (*submit)(void *ctx, const tqkv_engine_request *r, uint64_t *id);
    tqkv_status         (*cancel)(void *ctx, uint64_t id);
    tqkv_status         (*stats)(void *ctx, tqkv_engine_stats *out);
    const double         *lat_buckets;  /* [TQKV_ENGINE_LAT_BUCKETS] */
    const tqkv_tokenizer *tok;
    const char           *model_name;
    int                   context_len;
} srv_engine;

/* The real engine as an srv_engine (engine_bind.c; only built with the engine). */
srv_engine srv_engine_bind(tqkv_engine *e);

typedef struct {
    const char *host;          /* "127.0.0.1" */
    int         port;          /* 0 = any free port */
    const char *api_key;       /* NULL = no auth */
    size_t      max_body;      /* bytes (default 1 MiB) */
    int         max_conns;     /* simultaneous connections (default 512) */
    int         default_max_tokens; /* completions without max_tokens (OpenAI: 16) */
    int         idle_timeout_s;     /* connection idle limit while reading a request
                                       (default 600); none once generation started */
    int         verbose;
    /* slow-client defence (conn_guard.c); 0 = off unless said */
    int         header_timeout_s;   /* request head within this of connecting or of the
                                       previous response (default 20) */
    int         body_timeout_s;     /* request body within this of its head (default 60) */
    int         max_conns_per_ip;   /* connections per client address (default 0 = no cap) */
    int         reserved_conns;     /* slots only requests that have arrived may use
                                       (-1 = max_conns / 8, the default) */
    const char *const *aliases; /* [n_aliases] model names to serve under (--alias); the
                                   first is the reported one; none: the engine's name */
    int         n_aliases;
    int         metrics_auth;  /* 1: /metrics needs the API key too (default: open) */
} srv_params;

srv_params srv_params_default(void);

typedef struct srv_server srv_server;

/* Starts listening (libmicrohttpd thread per connection + internal accept thread).
 * The chat template comes from the tokenizer; a checkpoint without one serves
 * /v1/chat/completions with 400. */
tqkv_status srv_start(srv_server **out, const srv_params *p, const srv_engine *eng);
int         srv_port(const srv_server *s);
/* Stop admission: new generation requests get 503 (draining). */
void        srv_stop_admission(srv_server *s);
/* Wait until no generation request is open (after the engine drained), at most
 * timeout_s seconds (< 0: no limit). Returns the number still open. */
int         srv_wait_idle(srv_server *s, double timeout_s);
/* Stop listening and free. */
void        srv_free(srv_server *s);

/* Prometheus text (metrics.c); malloc'd. http_counts [n_status] by status code. */
typedef struct { int status; uint64_t count; } srv_status_count;
char *srv_metrics_text(const tqkv_engine_stats *st, const double *lat_buckets,
                       const srv_status_count *http_counts, int n_status, int open_requests);

/* 1 if the Authorization value [n] (not NUL-terminated: bytes after a NUL count) is
 * "Bearer " + exactly key; constant time in the value's length (http.c). */
int srv_auth_ok(const char *key, const char *value, size_t n);

#endif

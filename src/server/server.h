/*
 * server.h - the OpenAI-compatible HTTP server of `tqkv serve` (internal to the tqkv
 * executable and its tests; not a public header).
 *
 * Owns: the split of the server by concern:
 *   request.c  - pure parse + validation of a request body (JSON bytes -> srv_request);
 *                the fuzz target;
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
} srv_request;

typedef struct {
    const char *model_name;  /* the one served model ("" accepts any) */
    int         context_len; /* max prompt + generated tokens */
    int32_t     vocab_size;  /* for token-id prompts */
} srv_limits;

/* Parse body [len] (need not be NUL-terminated). 0 and *out filled (free with
 * srv_request_free), or -1 with *err filled and *out zeroed. Never reads past len. */
int  srv_request_parse(srv_api api, const char *body, size_t len, const srv_limits *lim,
                       srv_request *out, srv_error *err);
void srv_request_free(srv_request *r);
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

/* All return malloc'd NUL-terminated text or NULL on allocation failure. */
char *srv_error_json(const srv_error *err);
/* The whole non-streamed response. */
char *srv_response_json(const srv_resp_ctx *c, const char *text, size_t text_len,
                        const srv_piece *pieces, int n_pieces, const char *finish,
                        const srv_usage *u);
/* "data: {...}\n\n" for pieces [n] (their text taken from text); first = 1 adds the
 * assistant role (chat). finish != NULL: the closing chunk with finish_reason. */
char *srv_chunk_sse(const srv_resp_ctx *c, const char *text, const srv_piece *pieces, int n,
                    int first, const char *finish);
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

/*
 * http.c - libmicrohttpd plumbing of `tqkv serve`: routes, body limit (413), API key
 * (401, constant time), generation jobs fed by the engine's event callback (one output
 * per choice of n; tool calls parsed out of each when the request offers tools), SSE
 * streaming, client disconnect -> engine cancel, admission stop and idle wait.
 * Owns: the daemon, per-connection contexts and per-request jobs.
 * Must not: parse request JSON itself (request.c), format bodies (response.c), run the
 * model. Threading: libmicrohttpd's internal accept thread plus one thread per
 * connection (a handler may block waiting for its tokens without stalling others);
 * engine events arrive on the engine's thread and only append to a job under its lock.
 */
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cjson/cJSON.h>

#include <microhttpd.h>

#include "server/conn_guard.h"
#include "server/server.h"
#include "util/common.h"

/* ------------------------------------------------------------------------- */
/* Types                                                                     */
/* ------------------------------------------------------------------------- */

static const int STATUS_CODES[] = {200, 400, 401, 404, 405, 413, 500, 503};
#define N_STATUS ((int)(sizeof STATUS_CODES / sizeof STATUS_CODES[0]))

struct srv_server {
    srv_params          p;
    srv_engine          eng;
    struct MHD_Daemon  *d;
    tqkv_chat_template *tmpl;          /* NULL: checkpoint has no chat template */
    char               *tmpl_error;    /* why tmpl is NULL when a template exists */
    const char         *bos, *eos;     /* token strings for the template */
    pthread_mutex_t     mu;
    pthread_cond_t      idle_cv;
    int                 open;          /* jobs alive */
    int                 draining;
    uint64_t            next_id;
    uint64_t            counts[N_STATUS + 1]; /* last: other */
    conn_guard         *guard;         /* slow-client defence (conn_guard.c) */
};

/* One choice's output (n > 1: several per request). */
typedef struct {
    char              *text;       /* [text_len] output so far */
    size_t             text_len, text_cap;
    srv_piece         *pieces;     /* [n_pieces] */
    int                n_pieces, cap_pieces;
    int                done;
    tqkv_finish_reason finish;
    int                completion_tokens;
    /* stream writer state (connection thread only) */
    int                sent;        /* pieces sent */
    size_t             content_sent; /* bytes of text sent as content */
    int                first_sent, finish_sent, closed;
} job_choice;

typedef struct job {
    srv_server     *srv;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             refs;
    uint64_t        eid;          /* engine id */
    int             submitted;
    int             cancel_sent;
    MHD_socket      fd;
    char            idbuf[48];
    char            model[128];   /* the name the response reports */
    srv_resp_ctx    rc;
    /* filled by the engine callback under mu */
    job_choice     *ch;           /* [n_ch] one per choice (n) */
    int             n_ch;
    int             n_done;       /* choices whose final event came */
    uint64_t        events;       /* events recorded (streaming waits on it) */
    int             done;         /* every choice finished */
    int             oom;
    tqkv_finish_reason finish;    /* STOP/LENGTH, or the first choice's error/cancel */
    char            errmsg[256];
    srv_usage       usage;
    /* tool calls (chat with tools): parsed from each choice's text */
    int             tools;        /* 1: the output may hold tool calls */
    int             parallel_tools;
    /* stream writer state (connection thread only) */
    int             stream, include_usage;
    int             tail_done;
    uint64_t        events_seen;  /* events already formatted */
    char           *out;          /* [out_len] pending SSE bytes, out_off sent */
    size_t          out_len, out_cap, out_off;
} job;

typedef struct {
    char *body;      /* [len] request body so far */
    size_t len, cap;
    int   too_large;
    job  *job;
} conn_ctx;

/* ------------------------------------------------------------------------- */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------- */

srv_params srv_params_default(void) {
    srv_params p;
    memset(&p, 0, sizeof p);
    p.host = "127.0.0.1";
    p.port = 8080;
    p.max_body = (size_t)1 << 20;
    p.max_conns = 512;
    p.default_max_tokens = 16;
    p.idle_timeout_s = 600; /* llama-server's --timeout */
    p.header_timeout_s = 20;
    p.body_timeout_s = 60;
    p.max_conns_per_ip = 0;
    p.reserved_conns = -1;
    return p;
}

/* Constant-time check of an Authorization header value [n] against "Bearer " + key. The
 * whole value counts, length included (a NUL and more bytes after the key are a different
 * key); the time depends only on n, never on where the bytes differ. */
int srv_auth_ok(const char *key, const char *value, size_t n) {
    static const char prefix[] = "Bearer ";
    size_t nk = key ? strlen(key) : 0;
    if (!value || nk == 0) return 0;
    unsigned diff = (unsigned)(n != nk + 7);
    for (size_t i = 0; i < n; i++) {
        unsigned char want = i < 7 ? (unsigned char)prefix[i] : (unsigned char)key[(i - 7) % nk];
        diff |= (unsigned char)value[i] ^ want;
    }
    return diff == 0;
}

/* ---- a NUL inside the Authorization value ----
 * libmicrohttpd 0.9.75 parses the request head in place (line ends and the ':' become
 * NULs) and reports a value's length up to its first NUL, so "Bearer KEY\0more" reads as
 * "Bearer KEY". The head is [method, method + header size) in its buffer; after a value
 * only line-end bytes (now NULs) and whitespace may come before the next header's name
 * or the end of the head. Anything else is a client's NUL followed by more bytes. */
typedef struct { const char *at; int found; } key_probe;

static enum MHD_Result probe_key(void *cls, enum MHD_ValueKind kind, const char *key,
                                 size_t key_size, const char *value, size_t value_size) {
    (void)kind;
    (void)key_size;
    (void)value;
    (void)value_size;
    key_probe *kp = cls;
    if (key == kp->at) kp->found = 1;
    return MHD_YES;
}

static int auth_hidden_tail(struct MHD_Connection *c, const char *method, const char *auth,
                            size_t n) {
    const union MHD_ConnectionInfo *hi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (!hi || !method || !auth) return 0;
    const char *end = method + hi->header_size;
    if (auth < method || auth + n >= end) return 0; /* not parsed in place: nothing hidden */
    const char *q = auth + n;
    while (q < end && (*q == 0 || *q == '\r' || *q == '\n' || *q == ' ' || *q == '\t')) q++;
    if (q == end) return 0;
    key_probe kp = {q, 0};
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, probe_key, &kp);
    return !kp.found;
}

static void count_status(srv_server *s, int status) {
    int k = N_STATUS;
    for (int i = 0; i < N_STATUS; i++)
        if (STATUS_CODES[i] == status) k = i;
    pthread_mutex_lock(&s->mu);
    s->counts[k]++;
    pthread_mutex_unlock(&s->mu);
}

static enum MHD_Result queue_buf(srv_server *s, struct MHD_Connection *c, int status,
                                 const char *ctype, char *body /* malloc'd, taken */) {
    if (!body) {
        status = 500;
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":null,\"code\":null}}");
        if (!body) return MHD_NO;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    count_status(s, status);
    return ret;
}

static enum MHD_Result queue_error(srv_server *s, struct MHD_Connection *c, const srv_error *e) {
    return queue_buf(s, c, e->http_status, "application/json", srv_error_json(e));
}

static enum MHD_Result queue_simple_error(srv_server *s, struct MHD_Connection *c, int status,
                                          const char *type, const char *code, const char *msg) {
    srv_error e;
    srv_error_set(&e, status, type, code, NULL, "%s", msg);
    return queue_error(s, c, &e);
}

/* ------------------------------------------------------------------------- */
/* Jobs                                                                      */
/* ------------------------------------------------------------------------- */

static job *job_new(srv_server *s, const srv_request *rq, int n_prompt, const char *forced) {
    job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->n_ch = rq->n > 1 ? rq->n : 1;
    if (!(j->ch = calloc((size_t)j->n_ch, sizeof *j->ch))) {
        free(j);
        return NULL;
    }
    j->tools = rq->api == SRV_API_CHAT && rq->n_tools > 0 && rq->tool_choice != SRV_TOOL_NONE;
    j->parallel_tools = rq->parallel_tool_calls;
    /* a forced call start is part of each choice's output (parsed, never sent as content) */
    size_t fl = strlen(forced);
    for (int i = 0; fl && i < j->n_ch; i++) {
        job_choice *c = &j->ch[i];
        if (!(c->text = malloc(fl + 256))) {
            for (int k = 0; k < i; k++) free(j->ch[k].text);
            free(j->ch);
            free(j);
            return NULL;
        }
        memcpy(c->text, forced, fl + 1);
        c->text_len = c->content_sent = fl;
        c->text_cap = fl + 256;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->srv = s;
    j->refs = 1;
    j->fd = MHD_INVALID_SOCKET;
    pthread_mutex_lock(&s->mu);
    uint64_t id = ++s->next_id;
    s->open++;
    pthread_mutex_unlock(&s->mu);
    snprintf(j->idbuf, sizeof j->idbuf, "%s-%llu", rq->api == SRV_API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)id);
    j->rc.api = rq->api;
    j->rc.id = j->idbuf;
    j->rc.created = (long long)time(NULL);
    snprintf(j->model, sizeof j->model, "%s",
             rq->model ? rq->model : s->p.n_aliases > 0 ? s->p.aliases[0] : s->eng.model_name);
    j->rc.model = j->model;
    j->rc.top_logprobs = rq->top_logprobs;
    j->rc.tok = s->eng.tok;
    j->stream = rq->stream;
    j->include_usage = rq->include_usage;
    j->usage.prompt_tokens = n_prompt;
    return j;
}

static void job_unref(job *j) {
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    srv_server *s = j->srv;
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    for (int i = 0; i < j->n_ch; i++) {
        free(j->ch[i].text);
        free(j->ch[i].pieces);
    }
    free(j->ch);
    free(j->out);
    free(j);
    pthread_mutex_lock(&s->mu);
    if (--s->open == 0) pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->mu);
}

static void job_ref(job *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
}

/* Append an event's token and text to choice c; 0 or -1 (out of memory). */
static int choice_record(job_choice *c, const tqkv_engine_event *ev) {
    if (c->text_len + ev->text_len + 1 > c->text_cap) {
        size_t nc = c->text_cap ? c->text_cap * 2 : 256;
        while (nc < c->text_len + ev->text_len + 1) nc *= 2;
        char *nt = realloc(c->text, nc);
        if (!nt) return -1;
        c->text = nt, c->text_cap = nc;
    }
    if (c->n_pieces == c->cap_pieces) {
        int nc = c->cap_pieces ? c->cap_pieces * 2 : 32;
        srv_piece *np = realloc(c->pieces, sizeof *np * (size_t)nc);
        if (!np) return -1;
        c->pieces = np, c->cap_pieces = nc;
    }
    srv_piece *p = &c->pieces[c->n_pieces++];
    p->token = ev->token;
    p->logprob = ev->logprob;
    p->n_top = ev->n_top < TQKV_MAX_TOP_LOGPROBS ? ev->n_top : TQKV_MAX_TOP_LOGPROBS;
    if (p->n_top < 0 || !ev->top_ids || !ev->top_logprobs) p->n_top = 0;
    for (int k = 0; k < p->n_top; k++) {
        p->top_ids[k] = ev->top_ids[k];
        p->top_lp[k] = ev->top_logprobs[k];
    }
    p->text_off = c->text_len;
    p->text_len = ev->text_len;
    if (ev->text_len) memcpy(c->text + c->text_len, ev->text, ev->text_len);
    c->text_len += ev->text_len;
    c->text[c->text_len] = 0;
    return 0;
}

/* Engine thread: record the event, wake the connection thread. Returns quickly. */
static void on_event(void *user, uint64_t id, const tqkv_engine_event *ev) {
    (void)id;
    job *j = user;
    pthread_mutex_lock(&j->mu);
    job_choice *c = ev->index >= 0 && ev->index < j->n_ch ? &j->ch[ev->index] : NULL;
    if (c && !c->done && (ev->token >= 0 || ev->text_len) && choice_record(c, ev)) j->oom = 1;
    int last = 0;
    if (c && ev->done && !c->done) {
        c->done = 1;
        c->finish = j->oom ? TQKV_FINISH_ERROR : ev->finish;
        c->completion_tokens = ev->completion_tokens;
        if ((c->finish == TQKV_FINISH_ERROR || c->finish == TQKV_FINISH_CANCELLED) &&
            j->finish != TQKV_FINISH_ERROR && j->finish != TQKV_FINISH_CANCELLED) {
            j->finish = c->finish;
            snprintf(j->errmsg, sizeof j->errmsg, "%s",
                     j->oom ? "out of memory while recording the output"
                            : ev->error ? ev->error : "generation failed");
        } else if (j->finish == TQKV_FINISH_NONE) {
            j->finish = c->finish;
        }
        j->usage.prompt_tokens = ev->prompt_tokens;
        j->usage.completion_tokens += ev->completion_tokens;
        j->usage.cached_tokens = ev->cached_tokens;
        last = ++j->n_done == j->n_ch;
        if (last) j->done = 1;
    }
    j->events++;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (last) job_unref(j); /* the engine's reference */
}

/* 1 if the client closed its side of the connection. */
static int peer_gone(MHD_socket fd) {
    if (fd == MHD_INVALID_SOCKET) return 0;
    struct pollfd pf = {.fd = fd, .events = POLLRDHUP, .revents = 0};
    if (poll(&pf, 1, 0) <= 0) return 0;
    return (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* With j->mu held: wait until more than `have` events were recorded or the job is done.
 * A client that hangs up meanwhile gets its engine request cancelled. */
static void job_wait(job *j, uint64_t have) {
    while (!j->done && j->events <= have) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && !j->cancel_sent && peer_gone(j->fd)) {
            j->cancel_sent = 1;
            pthread_mutex_unlock(&j->mu);
            j->srv->eng.cancel(j->srv->eng.ctx, j->eid);
            pthread_mutex_lock(&j->mu);
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Streaming                                                                 */
/* ------------------------------------------------------------------------- */

static int out_append(job *j, char *s /* taken */) {
    if (!s) return -1;
    size_t n = strlen(s);
    if (j->out_len + n > j->out_cap) {
        size_t nc = j->out_cap ? j->out_cap * 2 : 4096;
        while (nc < j->out_len + n) nc *= 2;
        char *no = realloc(j->out, nc);
        if (!no) {
            free(s);
            return -1;
        }
        j->out = no;
        j->out_cap = nc;
    }
    memcpy(j->out + j->out_len, s, n);
    j->out_len += n;
    free(s);
    return 0;
}

/* A snapshot of one choice for the stream writer (taken under the job's lock). */
typedef struct {
    srv_piece         *pieces; /* [to - from] new pieces */
    int                from, to;
    char              *text;   /* the whole text so far [text_len] */
    size_t             text_len;
    int                done;
    tqkv_finish_reason finish;
} choice_snap;

/* Chunks of choice i from its snapshot into j->out: content (tool mode: only what cannot
 * start a tool call), logprobs, and when done its tool calls and finish chunk. */
static int stream_choice(job *j, int i, const choice_snap *sn) {
    job_choice *c = &j->ch[i];
    int rc = 0, chat = j->rc.api == SRV_API_CHAT;
    if (!c->first_sent && chat)
        rc |= out_append(j, srv_chunk_sse(&j->rc, i, "", 0, 1, NULL, 0, 1, NULL));
    c->first_sent = 1;
    if (!j->tools) {
        for (int k = 0; k < sn->to - sn->from && !rc; k++) {
            const srv_piece *p = &sn->pieces[k];
            if (p->text_len || (j->rc.top_logprobs >= 0 && p->token >= 0))
                rc |= out_append(j, srv_chunk_sse(&j->rc, i, sn->text + p->text_off, p->text_len,
                                                  1, p, 1, 0, NULL));
        }
        c->content_sent = sn->text_len;
    } else {
        /* content up to where a tool call could begin; logprobs with it. A closed choice
         * (its calls parsed and sent by an earlier fill: another choice's events bring it
         * here again) has no content left. */
        size_t safe = c->closed    ? c->content_sent
                      : sn->done ? sn->text_len
                                 : srv_tool_safe_len(sn->text, sn->text_len);
        srv_tool_call *calls = NULL;
        int n_calls = 0;
        size_t content_end = safe;
        if (sn->done && !c->closed) {
            c->closed = 1;
            if (srv_tool_parse(sn->text, sn->text_len, j->idbuf, i, j->parallel_tools, &calls,
                               &n_calls, &content_end))
                return -1;
        }
        if (content_end < c->content_sent) content_end = c->content_sent;
        if (content_end > c->content_sent || (j->rc.top_logprobs >= 0 && sn->to > sn->from))
            rc |= out_append(j, srv_chunk_sse(&j->rc, i, sn->text + c->content_sent,
                                              content_end - c->content_sent, 1, sn->pieces,
                                              sn->to - sn->from, 0, NULL));
        c->content_sent = content_end;
        if (n_calls) rc |= out_append(j, srv_tool_calls_sse(&j->rc, i, calls, n_calls));
        if (sn->done && !c->finish_sent && (sn->finish == TQKV_FINISH_STOP || sn->finish == TQKV_FINISH_LENGTH)) {
            rc |= out_append(j, srv_chunk_sse(&j->rc, i, NULL, 0, 0, NULL, 0, 0,
                                              n_calls && sn->finish == TQKV_FINISH_STOP
                                                  ? "tool_calls" : srv_finish_name(sn->finish)));
            c->finish_sent = 1;
        }
        srv_tool_calls_free(calls, n_calls);
    }
    if (sn->done && !c->finish_sent && (sn->finish == TQKV_FINISH_STOP || sn->finish == TQKV_FINISH_LENGTH)) {
        rc |= out_append(j, srv_chunk_sse(&j->rc, i, NULL, 0, 0, NULL, 0, 0, srv_finish_name(sn->finish)));
        c->finish_sent = 1;
    }
    c->sent = sn->to;
    return rc ? -1 : 0;
}

/* Wait for new events and format them into j->out; 0 or -1 (out of memory). */
static int stream_fill(job *j) {
    j->out_off = j->out_len = 0;
    choice_snap *sn = calloc((size_t)j->n_ch, sizeof *sn);
    if (!sn) return -1;
    pthread_mutex_lock(&j->mu);
    uint64_t seen = j->events_seen;
    job_wait(j, seen);
    j->events_seen = j->events;
    int bad = 0;
    for (int i = 0; i < j->n_ch; i++) {
        job_choice *c = &j->ch[i];
        sn[i].from = c->sent;
        sn[i].to = c->n_pieces;
        sn[i].done = c->done;
        sn[i].finish = c->finish;
        sn[i].text_len = c->text_len;
        sn[i].pieces = malloc(sizeof(srv_piece) * (size_t)(sn[i].to - sn[i].from + 1));
        sn[i].text = malloc(c->text_len + 1);
        if (!sn[i].pieces || !sn[i].text) {
            bad = 1;
            continue;
        }
        if (sn[i].to > sn[i].from) /* a choice with no pieces yet has none to copy (NULL) */
            memcpy(sn[i].pieces, c->pieces + sn[i].from, sizeof(srv_piece) * (size_t)(sn[i].to - sn[i].from));
        memcpy(sn[i].text, c->text ? c->text : "", c->text_len);
        sn[i].text[c->text_len] = 0;
    }
    int done = j->done;
    tqkv_finish_reason finish = j->finish;
    char errmsg[256];
    memcpy(errmsg, j->errmsg, sizeof errmsg);
    srv_usage u = j->usage;
    pthread_mutex_unlock(&j->mu);
    int rc = bad ? -1 : 0;
    for (int i = 0; i < j->n_ch && !rc; i++) rc |= stream_choice(j, i, &sn[i]);
    for (int i = 0; i < j->n_ch; i++) {
        free(sn[i].pieces);
        free(sn[i].text);
    }
    free(sn);
    if (done && !rc) {
        if (finish == TQKV_FINISH_STOP || finish == TQKV_FINISH_LENGTH) {
            if (j->include_usage) rc |= out_append(j, srv_usage_sse(&j->rc, &u));
        } else {
            srv_error e;
            srv_error_set(&e, 500, "server_error", srv_finish_name(finish), NULL, "%s",
                          finish == TQKV_FINISH_CANCELLED ? "request cancelled" : errmsg);
            rc |= out_append(j, srv_error_sse(&e));
        }
        rc |= out_append(j, strdup("data: [DONE]\n\n"));
        j->tail_done = 1;
    }
    return rc ? -1 : 0;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    job *j = cls;
    while (j->out_off == j->out_len) {
        if (j->tail_done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (stream_fill(j)) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = j->out_len - j->out_off;
    if (n > max) n = max;
    memcpy(buf, j->out + j->out_off, n);
    j->out_off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) { job_unref(cls); }

/* ------------------------------------------------------------------------- */
/* Generation endpoints                                                      */
/* ------------------------------------------------------------------------- */

/* Prompt ids of a parsed request: 0, or -1 with *err set. *ids malloc'd. forced
 * [forced_cap]: the start of a tool call the prompt ends with ("" none). */
static int build_prompt(srv_server *s, const srv_request *rq, int32_t **ids, int *n,
                        char *forced, size_t forced_cap, srv_error *err) {
    forced[0] = 0;
    *ids = NULL;
    *n = 0;
    if (rq->prompt_ids) {
        *ids = malloc(sizeof(int32_t) * (size_t)rq->n_prompt_ids);
        if (!*ids) return srv_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        memcpy(*ids, rq->prompt_ids, sizeof(int32_t) * (size_t)rq->n_prompt_ids);
        *n = rq->n_prompt_ids;
        return 0;
    }
    const char *text = rq->prompt;
    size_t len = rq->prompt_len;
    char *rendered = NULL;
    unsigned flags = TQKV_ENCODE_ADD_SPECIAL;
    if (rq->api == SRV_API_CHAT) {
        if (!s->tmpl)
            return srv_error_set(err, 400, "invalid_request_error", "no_chat_template", "messages",
                                 "this model has no usable chat template%s%s; use /v1/completions",
                                 s->tmpl_error ? ": " : "", s->tmpl_error ? s->tmpl_error : "");
        if (srv_render_chat(s->tmpl, tqkv_tokenizer_chat_template(s->eng.tok), rq, s->bos, s->eos,
                            &rendered, &len, forced, forced_cap) != TQKV_OK)
            return srv_error_set(err, 400, "invalid_request_error", "chat_template_error", "messages",
                                 "chat template: %s", tqkv_last_error());
        text = rendered;
        flags = 0; /* the template writes the special tokens itself */
    }
    size_t nn = 0;
    tqkv_status st = tqkv_tokenizer_encode(s->eng.tok, text, len, flags, ids, &nn);
    free(rendered);
    if (st != TQKV_OK)
        return srv_error_set(err, 400, "invalid_request_error", "invalid_prompt",
                             rq->api == SRV_API_CHAT ? "messages" : "prompt", "'%s': %s",
                             rq->api == SRV_API_CHAT ? "messages" : "prompt",
                             tqkv_last_error());
    if (nn == 0) {
        free(*ids);
        *ids = NULL;
        return srv_error_set(err, 400, "invalid_request_error", "invalid_value",
                             rq->api == SRV_API_CHAT ? "messages" : "prompt",
                             "the prompt is empty (0 tokens)");
    }
    *n = (int)nn;
    return 0;
}

/* The non-streamed body of a finished job (tool calls parsed out of each choice). */
static char *job_response(job *j) {
    srv_choice_out *o = calloc((size_t)j->n_ch, sizeof *o);
    srv_tool_call **calls = calloc((size_t)j->n_ch, sizeof *calls);
    char *body = NULL;
    int ok = o && calls;
    for (int i = 0; i < j->n_ch && ok; i++) {
        job_choice *c = &j->ch[i];
        o[i].text = c->text ? c->text : "";
        o[i].text_len = c->text_len;
        o[i].pieces = c->pieces;
        o[i].n_pieces = c->n_pieces;
        o[i].finish = srv_finish_name(c->finish);
        if (j->tools) {
            size_t content_end = c->text_len;
            if (srv_tool_parse(o[i].text, c->text_len, j->idbuf, i, j->parallel_tools, &calls[i],
                               &o[i].n_calls, &content_end)) {
                ok = 0;
                break;
            }
            o[i].text_len = content_end;
            o[i].calls = calls[i];
            if (o[i].n_calls && c->finish == TQKV_FINISH_STOP) o[i].finish = "tool_calls";
        }
    }
    if (ok) body = srv_response_json(&j->rc, o, j->n_ch, &j->usage);
    for (int i = 0; calls && i < j->n_ch; i++) srv_tool_calls_free(calls[i], o ? o[i].n_calls : 0);
    free(calls);
    free(o);
    return body;
}

static enum MHD_Result handle_generate(srv_server *s, struct MHD_Connection *c, conn_ctx *cc,
                                       srv_api api) {
    srv_error err;
    pthread_mutex_lock(&s->mu);
    int draining = s->draining;
    pthread_mutex_unlock(&s->mu);
    if (draining)
        return queue_simple_error(s, c, 503, "server_error", "shutting_down",
                                  "the server is shutting down and accepts no new requests");
    srv_limits lim = {s->eng.model_name, s->eng.context_len, tqkv_tokenizer_vocab_size(s->eng.tok),
                      s->p.aliases, s->p.n_aliases};
    srv_request rq;
    if (srv_request_parse(api, cc->body, cc->len, &lim, &rq, &err)) return queue_error(s, c, &err);
    int32_t *ids = NULL;
    int n_prompt = 0;
    char forced[160];
    if (build_prompt(s, &rq, &ids, &n_prompt, forced, sizeof forced, &err)) {
        srv_request_free(&rq);
        return queue_error(s, c, &err);
    }
    int ctx = s->eng.context_len;
    int max_tokens = rq.max_tokens;
    if (max_tokens < 0)
        max_tokens = api == SRV_API_COMPLETIONS ? s->p.default_max_tokens : ctx - n_prompt;
    if (n_prompt >= ctx || max_tokens < 1 || (long)n_prompt + max_tokens > ctx) {
        srv_error_set(&err, 400, "invalid_request_error", "context_length_exceeded",
                      rq.max_tokens >= 0 ? "max_tokens" : (api == SRV_API_CHAT ? "messages" : "prompt"),
                      "This model's maximum context length is %d tokens. However, you requested "
                      "%ld tokens (%d in the prompt, %d for the completion).",
                      ctx, (long)n_prompt + (max_tokens > 0 ? max_tokens : 0), n_prompt,
                      max_tokens > 0 ? max_tokens : 0);
        free(ids);
        srv_request_free(&rq);
        return queue_error(s, c, &err);
    }
    job *j = job_new(s, &rq, n_prompt, forced);
    if (!j) {
        free(ids);
        srv_request_free(&rq);
        return queue_simple_error(s, c, 500, "server_error", NULL, "out of memory");
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) j->fd = ci->connect_fd;
    /* The idle timeout guards header/body reading only: a generation may legitimately
     * wait longer than it for its first token (queue, long prefills); it is bounded by
     * max_tokens and a client hang-up cancels it. */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned int)0);
    cc->job = j; /* the connection's reference */

    tqkv_engine_request er;
    memset(&er, 0, sizeof er);
    er.prompt = ids;
    er.n_prompt = n_prompt;
    er.max_tokens = max_tokens;
    er.sampling = tqkv_sampler_params_default();
    er.sampling.temperature = (float)rq.temperature;
    er.sampling.top_p = (float)rq.top_p;
    er.sampling.seed = rq.has_seed ? rq.seed : (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)j << 7);
    er.stop = (const char *const *)rq.stop;
    er.n_stop = rq.n_stop;
    er.top_logprobs = rq.top_logprobs;
    er.ignore_eos = rq.ignore_eos;
    er.n = rq.n;
    er.json_object = rq.format == SRV_FORMAT_JSON_OBJECT;
    er.json_schema = rq.format == SRV_FORMAT_JSON_SCHEMA ? rq.schema_json : NULL;
    int schema_req = er.json_schema != NULL;
    er.sampling.frequency_penalty = (float)rq.frequency_penalty;
    er.sampling.presence_penalty = (float)rq.presence_penalty;
    er.sampling.bias_ids = rq.bias_ids;
    er.sampling.bias_vals = rq.bias_vals;
    er.sampling.n_bias = rq.n_bias;
    er.on_event = on_event;
    er.user = j;
    job_ref(j); /* the engine's reference, dropped by the final event */
    uint64_t eid = 0;
    /* Events may arrive on the engine thread before submit returns; they never read eid
     * or submitted (only this connection's thread does), so no lock is held across the
     * call: the engine may hold its own lock while it runs callbacks. */
    tqkv_status st = s->eng.submit(s->eng.ctx, &er, &eid);
    if (st == TQKV_OK) j->eid = eid, j->submitted = 1;
    free(ids);
    srv_request_free(&rq);
    if (st != TQKV_OK) {
        job_unref(j); /* no events will come */
        const char *msg = tqkv_last_error();
        if (!msg || !msg[0])
            msg = st == TQKV_EBUSY ? "the request queue is full; retry later"
                  : st == TQKV_ESTATE ? "the server is shutting down"
                                      : "the engine refused the request";
        if (st == TQKV_EBUSY)
            return queue_simple_error(s, c, 503, "server_error", "queue_full", msg);
        if (st == TQKV_ESTATE)
            return queue_simple_error(s, c, 503, "server_error", "shutting_down", msg);
        if (st == TQKV_EINVAL && schema_req && !strncmp(msg, "json schema", 11)) {
            srv_error e; /* a schema outside the supported subset: name the parameter */
            srv_error_set(&e, 400, "invalid_request_error", "unsupported_schema",
                          "response_format.json_schema.schema", "'response_format.json_schema.schema': %s", msg);
            return queue_error(s, c, &e);
        }
        if (st == TQKV_EINVAL || st == TQKV_ERANGE) {
            /* the engine names its field: report the request's parameter */
            static const struct { const char *eng, *param; } P[] = {
                {"engine_submit: n ", "n"}, {"engine_submit: max_tokens", "max_tokens"},
                {"engine_submit: top_logprobs", "logprobs"}, {"engine_submit: stop", "stop"},
                {"engine_submit: prompt", "prompt"}};
            const char *param = st == TQKV_ERANGE ? "max_tokens" : NULL;
            for (size_t i = 0; i < sizeof P / sizeof P[0] && !param; i++)
                if (!strncmp(msg, P[i].eng, strlen(P[i].eng))) param = P[i].param;
            srv_error e;
            srv_error_set(&e, 400, "invalid_request_error",
                          st == TQKV_ERANGE ? "context_length_exceeded" : "invalid_value", param,
                          "%s%s%s", param ? "'" : "", param ? param : "", param ? "': " : "");
            size_t ml = strlen(e.message);
            snprintf(e.message + ml, sizeof e.message - ml, "%s", msg);
            return queue_error(s, c, &e);
        }
        return queue_simple_error(s, c, 500, "server_error", NULL, msg);
    }

    if (j->stream) {
        job_ref(j); /* the response's reference */
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, j, stream_free);
        if (!r) {
            job_unref(j);
            return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        count_status(s, 200);
        return ret;
    }

    pthread_mutex_lock(&j->mu);
    while (!j->done) job_wait(j, j->events);
    pthread_mutex_unlock(&j->mu);
    /* done: the engine no longer writes to the job */
    if (j->finish == TQKV_FINISH_ERROR || j->finish == TQKV_FINISH_CANCELLED)
        return queue_simple_error(s, c, 500, "server_error", srv_finish_name(j->finish),
                                  j->finish == TQKV_FINISH_CANCELLED ? "request cancelled" : j->errmsg);
    return queue_buf(s, c, 200, "application/json", job_response(j));
}

/* ------------------------------------------------------------------------- */
/* Other endpoints                                                           */
/* ------------------------------------------------------------------------- */

/* The names this server answers to: the aliases, else the engine's name. */
static int model_names(const srv_server *s, const char *const **names, const char **one) {
    if (s->p.n_aliases > 0) {
        *names = s->p.aliases;
        return s->p.n_aliases;
    }
    *names = one;
    one[0] = s->eng.model_name;
    return 1;
}

static cJSON *model_obj(const srv_server *s, const char *name) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "tqkv");
    cJSON_AddNumberToObject(m, "context_length", s->eng.context_len);
    return m;
}

/* GET /v1/models (id NULL) or /v1/models/{id}. */
static enum MHD_Result handle_models(srv_server *s, struct MHD_Connection *c, const char *id) {
    const char *one[1];
    const char *const *names;
    int n = model_names(s, &names, one);
    cJSON *r = NULL;
    if (!id) {
        r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "object", "list");
        cJSON *d = cJSON_AddArrayToObject(r, "data");
        for (int i = 0; i < n; i++) cJSON_AddItemToArray(d, model_obj(s, names[i]));
    } else {
        for (int i = 0; i < n && !r; i++)
            if (!strcmp(names[i], id)) r = model_obj(s, names[i]);
        if (!r) {
            srv_error e;
            srv_error_set(&e, 404, "invalid_request_error", "model_not_found", "model",
                          "The model '%.120s' does not exist", id);
            return queue_error(s, c, &e);
        }
    }
    char *body = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    return queue_buf(s, c, 200, "application/json", body);
}

/* The connection guard's counters appended to the metrics text (taken, returned). */
static char *metrics_append_guard(srv_server *s, char *text) {
    if (!text) return NULL;
    conn_guard_stats g;
    conn_guard_get_stats(s->guard, &g);
    char extra[1024];
    int k = snprintf(extra, sizeof extra,
                     "# HELP tqkv_http_connections_closed_total Connections the server closed: "
                     "timeout = request head or body past its deadline, evicted = a slow sender "
                     "closed to admit a new connection, refused = every slot busy.\n"
                     "# TYPE tqkv_http_connections_closed_total counter\n"
                     "tqkv_http_connections_closed_total{reason=\"timeout\"} %llu\n"
                     "tqkv_http_connections_closed_total{reason=\"evicted\"} %llu\n"
                     "tqkv_http_connections_closed_total{reason=\"refused\"} %llu\n"
                     "# HELP tqkv_http_connections Open connections: reading = sending a request, "
                     "busy = request received.\n"
                     "# TYPE tqkv_http_connections gauge\n"
                     "tqkv_http_connections{state=\"reading\"} %d\n"
                     "tqkv_http_connections{state=\"busy\"} %d\n",
                     (unsigned long long)g.timed_out, (unsigned long long)g.evicted,
                     (unsigned long long)g.refused, g.readers, g.busy);
    size_t n = strlen(text);
    char *out = realloc(text, n + (size_t)k + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memcpy(out + n, extra, (size_t)k + 1);
    return out;
}

static enum MHD_Result handle_metrics(srv_server *s, struct MHD_Connection *c) {
    tqkv_engine_stats st;
    memset(&st, 0, sizeof st);
    if (s->eng.stats(s->eng.ctx, &st) != TQKV_OK)
        return queue_simple_error(s, c, 500, "server_error", NULL, tqkv_last_error());
    srv_status_count counts[N_STATUS + 1];
    int n = 0, open;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < N_STATUS; i++) counts[n++] = (srv_status_count){STATUS_CODES[i], s->counts[i]};
    if (s->counts[N_STATUS]) counts[n++] = (srv_status_count){0, s->counts[N_STATUS]};
    open = s->open;
    pthread_mutex_unlock(&s->mu);
    char *text = srv_metrics_text(&st, s->eng.lat_buckets, counts, n, open);
    return queue_buf(s, c, 200, "text/plain; version=0.0.4", metrics_append_guard(s, text));
}

/* ------------------------------------------------------------------------- */
/* Dispatch                                                                  */
/* ------------------------------------------------------------------------- */

typedef enum { R_NONE, R_HEALTH, R_MODELS, R_MODEL, R_METRICS, R_CHAT, R_CMPL } route;

static route route_of(const char *url, int *post) {
    if (!strncmp(url, "/v1/models/", 11) && url[11]) { /* GET /v1/models/{id} */
        *post = 0;
        return R_MODEL;
    }
    static const struct { const char *url; route r; int post; } T[] = {
        {"/health", R_HEALTH, 0}, {"/v1/health", R_HEALTH, 0}, {"/v1/models", R_MODELS, 0},
        {"/metrics", R_METRICS, 0}, {"/v1/chat/completions", R_CHAT, 1},
        {"/v1/completions", R_CMPL, 1}};
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (!strcmp(url, T[i].url)) {
            *post = T[i].post;
            return T[i].r;
        }
    return R_NONE;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
    (void)version;
    srv_server *s = cls;
    conn_ctx *cc = *con_cls;
    if (!cc) { /* first call: headers only */
        conn_guard_phase(s->guard, c, CG_BODY);
        cc = calloc(1, sizeof *cc);
        if (!cc) return MHD_NO;
        *con_cls = cc;
        int post = 0;
        route r = route_of(url, &post);
        if (r == R_NONE)
            return queue_simple_error(s, c, 404, "invalid_request_error", "not_found", "unknown endpoint");
        if (strcmp(method, post ? "POST" : "GET"))
            return queue_simple_error(s, c, 405, "invalid_request_error", "method_not_allowed",
                                      post ? "use POST" : "use GET");
        if (s->p.api_key && r != R_HEALTH && (r != R_METRICS || s->p.metrics_auth)) {
            const char *auth = NULL;
            size_t auth_len = 0;
            if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION,
                                              strlen(MHD_HTTP_HEADER_AUTHORIZATION), &auth,
                                              &auth_len) != MHD_YES)
                auth = NULL;
            if (!srv_auth_ok(s->p.api_key, auth, auth_len) || auth_hidden_tail(c, method, auth, auth_len))
                return queue_simple_error(s, c, 401, "authentication_error", "invalid_api_key",
                                          "missing or invalid API key (Authorization: Bearer KEY)");
        }
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > s->p.max_body) {
            char msg[96];
            snprintf(msg, sizeof msg, "request body exceeds %zu bytes", s->p.max_body);
            return queue_simple_error(s, c, 413, "invalid_request_error", "request_too_large", msg);
        }
        return MHD_YES;
    }
    if (*upload_data_size) { /* body bytes */
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (cc->too_large || cc->len + n > s->p.max_body) {
            cc->too_large = 1;
            return MHD_YES;
        }
        if (cc->len + n + 1 > cc->cap) {
            size_t nc = cc->cap ? cc->cap * 2 : 4096;
            while (nc < cc->len + n + 1) nc *= 2;
            char *nb = realloc(cc->body, nc);
            if (!nb) return MHD_NO;
            cc->body = nb;
            cc->cap = nc;
        }
        memcpy(cc->body + cc->len, upload_data, n);
        cc->len += n;
        cc->body[cc->len] = 0;
        return MHD_YES;
    }
    conn_guard_phase(s->guard, c, CG_BUSY); /* the whole request has arrived */
    if (cc->too_large) {
        char msg[96];
        snprintf(msg, sizeof msg, "request body exceeds %zu bytes", s->p.max_body);
        return queue_simple_error(s, c, 413, "invalid_request_error", "request_too_large", msg);
    }
    int post = 0;
    switch (route_of(url, &post)) {
    case R_HEALTH: {
        pthread_mutex_lock(&s->mu);
        int dr = s->draining;
        pthread_mutex_unlock(&s->mu);
        return queue_buf(s, c, dr ? 503 : 200, "application/json",
                         strdup(dr ? "{\"status\":\"draining\"}" : "{\"status\":\"ok\"}"));
    }
    case R_MODELS: return handle_models(s, c, NULL);
    case R_MODEL: return handle_models(s, c, url + 11);
    case R_METRICS: return handle_metrics(s, c);
    case R_CHAT: return handle_generate(s, c, cc, SRV_API_CHAT);
    case R_CMPL: return handle_generate(s, c, cc, SRV_API_COMPLETIONS);
    default: return MHD_NO;
    }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)toe;
    srv_server *s = cls;
    conn_guard_phase(s->guard, c, CG_READING); /* kept alive: waits for its next request */
    conn_ctx *cc = *con_cls;
    if (!cc) return;
    if (cc->job) {
        job *j = cc->job;
        pthread_mutex_lock(&j->mu);
        int cancel = j->submitted && !j->done && !j->cancel_sent;
        j->cancel_sent |= cancel;
        pthread_mutex_unlock(&j->mu);
        if (cancel) j->srv->eng.cancel(j->srv->eng.ctx, j->eid); /* client went away */
        job_unref(j);
    }
    free(cc->body);
    free(cc);
    *con_cls = NULL;
}

/* ------------------------------------------------------------------------- */
/* Lifecycle                                                                 */
/* ------------------------------------------------------------------------- */

/* host ("127.0.0.1", "::", "::1", "localhost") and port -> a socket address; *v6 set for
 * IPv6 ones. "::" listens on IPv6 and (where the system allows, the Linux default)
 * IPv4-mapped addresses too. 0 or -1. */
static int listen_addr(const char *host, int port, struct sockaddr_storage *out, int *v6) {
    memset(out, 0, sizeof *out);
    struct sockaddr_in *a4 = (struct sockaddr_in *)out;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)out;
    char buf[64];
    /* "[::1]" as in URLs */
    size_t n = strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']' && n - 2 < sizeof buf) {
        memcpy(buf, host + 1, n - 2);
        buf[n - 2] = 0;
        host = buf;
    }
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)port);
        *v6 = 0;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        *v6 = 1;
        return 0;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, NULL, &hints, &res) || !res) return -1;
    int rc = -1;
    if (res->ai_addrlen <= sizeof *out && (res->ai_family == AF_INET || res->ai_family == AF_INET6)) {
        memcpy(out, res->ai_addr, res->ai_addrlen);
        *v6 = res->ai_family == AF_INET6;
        if (*v6) a6->sin6_port = htons((uint16_t)port);
        else a4->sin_port = htons((uint16_t)port);
        rc = 0;
    }
    freeaddrinfo(res);
    return rc;
}

tqkv_status srv_start(srv_server **out, const srv_params *p, const srv_engine *eng) {
    if (!out || !p || !eng || !eng->submit || !eng->cancel || !eng->stats || !eng->tok || !eng->model_name)
        return tqkv_fail(TQKV_EINVAL, "srv_start: NULL argument");
    srv_server *s = calloc(1, sizeof *s);
    if (!s) return tqkv_fail(TQKV_ENOMEM, "srv_start: out of memory");
    s->p = *p;
    s->eng = *eng;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    const char *src = tqkv_tokenizer_chat_template(eng->tok);
    if (src && tqkv_chat_template_init(&s->tmpl, src) != TQKV_OK) {
        s->tmpl = NULL;
        s->tmpl_error = strdup(tqkv_last_error());
    }
    size_t n;
    int32_t bos = tqkv_tokenizer_bos_id(eng->tok), eos = tqkv_tokenizer_eos_id(eng->tok);
    if (bos < 0 || tqkv_tokenizer_id_to_token(eng->tok, bos, &s->bos, &n) != TQKV_OK) s->bos = "";
    if (eos < 0 || tqkv_tokenizer_id_to_token(eng->tok, eos, &s->eos, &n) != TQKV_OK) s->eos = "";

    struct sockaddr_storage addr;
    int v6 = 0;
    if (listen_addr(p->host ? p->host : "127.0.0.1", p->port, &addr, &v6)) {
        srv_free(s);
        return tqkv_fail(TQKV_EINVAL, "serve: --host must be an IPv4 or IPv6 address or a "
                         "resolvable host name, got '%s'", p->host);
    }
    int max_conns = p->max_conns > 0 ? p->max_conns : 512;
    int reserved = p->reserved_conns >= 0 ? p->reserved_conns : max_conns / 8;
    if (conn_guard_init(&s->guard, max_conns, reserved, p->header_timeout_s, p->body_timeout_s)) {
        srv_free(s);
        return tqkv_fail(TQKV_ENOMEM, "srv_start: out of memory");
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL;
    if (v6) /* "::" also takes IPv4 (mapped) connections, as llama-server's does */
        flags |= IN6_IS_ADDR_UNSPECIFIED(&((struct sockaddr_in6 *)&addr)->sin6_addr)
                     ? MHD_USE_DUAL_STACK : MHD_USE_IPv6;
    if (p->verbose) flags |= MHD_USE_ERROR_LOG;
    /* The guard admits connections (conn_guard_accept) and counts them against max_conns;
     * libmicrohttpd's own limit leaves room for evicted ones still closing. */
    s->d = MHD_start_daemon(flags, (uint16_t)p->port, conn_guard_accept, s->guard, on_request, s,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                            MHD_OPTION_CONNECTION_LIMIT, conn_guard_hard_limit(s->guard),
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                            (unsigned)(p->max_conns_per_ip > 0 ? p->max_conns_per_ip : 0),
                            MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)(p->idle_timeout_s > 0 ? p->idle_timeout_s : 120),
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_NOTIFY_CONNECTION, conn_guard_notify, s->guard,
                            MHD_OPTION_END);
    if (!s->d) {
        srv_free(s);
        return tqkv_fail(TQKV_EIO, "serve: cannot listen on %s:%d (in use, or no permission)",
                             p->host, p->port);
    }
    *out = s;
    return TQKV_OK;
}

int srv_port(const srv_server *s) {
    const union MHD_DaemonInfo *i = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    return i ? i->port : -1;
}

void srv_stop_admission(srv_server *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = 1;
    pthread_mutex_unlock(&s->mu);
}

int srv_wait_idle(srv_server *s, double timeout_s) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout_s >= 0) {
        until.tv_sec += (time_t)timeout_s;
        until.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
        if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (s->open > 0) {
        if (timeout_s < 0) pthread_cond_wait(&s->idle_cv, &s->mu);
        else if (pthread_cond_timedwait(&s->idle_cv, &s->mu, &until)) break;
    }
    int left = s->open;
    pthread_mutex_unlock(&s->mu);
    return left;
}

void srv_free(srv_server *s) {
    if (!s) return;
    if (s->d) MHD_stop_daemon(s->d);
    conn_guard_free(s->guard);
    tqkv_chat_template_free(s->tmpl);
    free(s->tmpl_error);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->idle_cv);
    free(s);
}

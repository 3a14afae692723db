/*
 * response.c - OpenAI response bodies: completions and chat completions (whole and as
 * SSE chunks), logprobs in each API's own shape, usage, and error JSON.
 * Owns: JSON text of responses (cJSON). Must not: touch the engine, sockets or HTTP.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "server/server.h"

/* ------------------------------------------------------------------------- */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------- */

const char *srv_finish_name(tqkv_finish_reason f) {
    switch (f) {
    case TQKV_FINISH_STOP: return "stop";
    case TQKV_FINISH_LENGTH: return "length";
    case TQKV_FINISH_CANCELLED: return "cancelled";
    case TQKV_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* Length of the valid UTF-8 sequence at s[0..n), 0 if invalid (RFC 3629). */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t k;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) k = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) k = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) k = 4, min = 0x10000;
    else return 0;
    if (n < k) return 0;
    unsigned cp = c & (0xFF >> (k + 1));
    for (size_t i = 1; i < k; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return k;
}

/* bytes [n] -> malloc'd valid UTF-8 (invalid bytes become U+FFFD), NUL-terminated. */
static char *utf8_lossy(const char *bytes, size_t n) {
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    size_t j = 0;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq((const unsigned char *)bytes + i, n - i);
        if (k && !(k == 1 && bytes[i] == 0)) {
            memcpy(o + j, bytes + i, k);
            j += k;
            i += k;
        } else if (k) { /* NUL: drop, cJSON strings are NUL-terminated */
            i++;
        } else {
            memcpy(o + j, "\xEF\xBF\xBD", 3);
            j += 3;
            i++;
        }
    }
    o[j] = 0;
    return o;
}

static cJSON *add_text(cJSON *obj, const char *name, const char *text, size_t n) {
    char *s = utf8_lossy(text ? text : "", text ? n : 0);
    if (!s) return NULL;
    cJSON *v = cJSON_AddStringToObject(obj, name, s);
    free(s);
    return v;
}

static char *print_and_free(cJSON *root) {
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

static char *sse_wrap(char *json) {
    if (!json) return NULL;
    size_t n = strlen(json);
    char *s = malloc(n + 9);
    if (s) {
        memcpy(s, "data: ", 6);
        memcpy(s + 6, json, n);
        memcpy(s + 6 + n, "\n\n", 3);
    }
    free(json);
    return s;
}

/* ------------------------------------------------------------------------- */
/* Logprobs                                                                  */
/* ------------------------------------------------------------------------- */

static void token_text(const srv_resp_ctx *c, int32_t id, const char **b, size_t *n) {
    if (!c->tok || tqkv_tokenizer_id_bytes(c->tok, id, b, n) != TQKV_OK) {
        *b = "";
        *n = 0;
    }
}

/* chat: {"token","logprob","bytes":[...],"top_logprobs":[{token,logprob,bytes}]} */
static cJSON *chat_lp_entry(const srv_resp_ctx *c, int32_t id, float lp) {
    cJSON *e = cJSON_CreateObject();
    const char *b;
    size_t n;
    token_text(c, id, &b, &n);
    add_text(e, "token", b, n);
    cJSON_AddNumberToObject(e, "logprob", lp);
    cJSON *bytes = cJSON_AddArrayToObject(e, "bytes");
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(bytes, cJSON_CreateNumber((unsigned char)b[i]));
    return e;
}

static cJSON *chat_logprobs(const srv_resp_ctx *c, const srv_piece *p, int n) {
    cJSON *lp = cJSON_CreateObject();
    cJSON *content = cJSON_AddArrayToObject(lp, "content");
    for (int i = 0; i < n; i++) {
        if (p[i].token < 0) continue;
        cJSON *e = chat_lp_entry(c, p[i].token, p[i].logprob);
        cJSON *tops = cJSON_AddArrayToObject(e, "top_logprobs");
        int nt = p[i].n_top < c->top_logprobs ? p[i].n_top : c->top_logprobs;
        for (int k = 0; k < nt; k++) cJSON_AddItemToArray(tops, chat_lp_entry(c, p[i].top_ids[k], p[i].top_lp[k]));
        cJSON_AddItemToArray(content, e);
    }
    cJSON_AddNullToObject(lp, "refusal");
    return lp;
}

/* completions: {"tokens","token_logprobs","top_logprobs":[{tok:lp}],"text_offset"} */
static cJSON *cmpl_logprobs(const srv_resp_ctx *c, const srv_piece *p, int n, size_t base_off) {
    cJSON *lp = cJSON_CreateObject();
    cJSON *toks = cJSON_AddArrayToObject(lp, "tokens");
    cJSON *tlp = cJSON_AddArrayToObject(lp, "token_logprobs");
    cJSON *top = cJSON_AddArrayToObject(lp, "top_logprobs");
    cJSON *off = cJSON_AddArrayToObject(lp, "text_offset");
    for (int i = 0; i < n; i++) {
        if (p[i].token < 0) continue;
        const char *b;
        size_t bn;
        token_text(c, p[i].token, &b, &bn);
        char *s = utf8_lossy(b, bn);
        cJSON_AddItemToArray(toks, cJSON_CreateString(s ? s : ""));
        free(s);
        cJSON_AddItemToArray(tlp, cJSON_CreateNumber(p[i].logprob));
        cJSON *m = cJSON_CreateObject();
        int nt = p[i].n_top < c->top_logprobs ? p[i].n_top : c->top_logprobs;
        for (int k = 0; k < nt; k++) {
            token_text(c, p[i].top_ids[k], &b, &bn);
            s = utf8_lossy(b, bn);
            if (s && !cJSON_GetObjectItemCaseSensitive(m, s))
                cJSON_AddNumberToObject(m, s, p[i].top_lp[k]);
            free(s);
        }
        cJSON_AddItemToArray(top, m);
        cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(p[i].text_off - base_off)));
    }
    return lp;
}

static cJSON *usage_obj(const srv_usage *u) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompt_tokens", u->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", u->completion_tokens);
    cJSON_AddNumberToObject(o, "total_tokens", u->prompt_tokens + u->completion_tokens);
    cJSON *d = cJSON_AddObjectToObject(o, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", u->cached_tokens);
    return o;
}

static cJSON *envelope(const srv_resp_ctx *c, const char *object) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "id", c->id);
    cJSON_AddStringToObject(r, "object", object);
    cJSON_AddNumberToObject(r, "created", (double)c->created);
    cJSON_AddStringToObject(r, "model", c->model);
    return r;
}

/* ------------------------------------------------------------------------- */
/* Bodies                                                                    */
/* ------------------------------------------------------------------------- */

static cJSON *tool_calls_arr(const srv_tool_call *calls, int n, int with_index) {
    cJSON *a = cJSON_CreateArray();
    for (int k = 0; k < n; k++) {
        cJSON *t = cJSON_CreateObject();
        if (with_index) cJSON_AddNumberToObject(t, "index", k);
        cJSON_AddStringToObject(t, "id", calls[k].id);
        cJSON_AddStringToObject(t, "type", "function");
        cJSON *f = cJSON_AddObjectToObject(t, "function");
        cJSON_AddStringToObject(f, "name", calls[k].name);
        cJSON_AddStringToObject(f, "arguments", calls[k].arguments);
        cJSON_AddItemToArray(a, t);
    }
    return a;
}

char *srv_response_json(const srv_resp_ctx *c, const srv_choice_out *cho, int n_ch,
                        const srv_usage *u) {
    int chat = c->api == SRV_API_CHAT;
    cJSON *r = envelope(c, chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(r, "choices");
    for (int i = 0; i < n_ch; i++) {
        const srv_choice_out *o = &cho[i];
        cJSON *ch = cJSON_CreateObject();
        cJSON_AddItemToArray(choices, ch);
        cJSON_AddNumberToObject(ch, "index", i);
        if (chat) {
            cJSON *m = cJSON_AddObjectToObject(ch, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            if (o->n_calls && o->text_len == 0) cJSON_AddNullToObject(m, "content");
            else add_text(m, "content", o->text, o->text_len);
            cJSON_AddNullToObject(m, "refusal");
            if (o->n_calls) cJSON_AddItemToObject(m, "tool_calls", tool_calls_arr(o->calls, o->n_calls, 0));
        } else {
            add_text(ch, "text", o->text, o->text_len);
        }
        if (c->top_logprobs >= 0)
            cJSON_AddItemToObject(ch, "logprobs", chat ? chat_logprobs(c, o->pieces, o->n_pieces)
                                                       : cmpl_logprobs(c, o->pieces, o->n_pieces, 0));
        else
            cJSON_AddNullToObject(ch, "logprobs");
        if (o->finish) cJSON_AddStringToObject(ch, "finish_reason", o->finish);
        else cJSON_AddNullToObject(ch, "finish_reason");
    }
    cJSON_AddItemToObject(r, "usage", usage_obj(u));
    return print_and_free(r);
}

char *srv_chunk_sse(const srv_resp_ctx *c, int index, const char *content, size_t len,
                    int has_content, const srv_piece *pieces, int n, int first,
                    const char *finish) {
    int chat = c->api == SRV_API_CHAT;
    cJSON *r = envelope(c, chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(r, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, ch);
    cJSON_AddNumberToObject(ch, "index", index);
    if (chat) {
        cJSON *d = cJSON_AddObjectToObject(ch, "delta");
        if (first) cJSON_AddStringToObject(d, "role", "assistant");
        if (has_content || first) add_text(d, "content", content ? content : "", content ? len : 0);
    } else {
        add_text(ch, "text", content ? content : "", content ? len : 0);
    }
    if (c->top_logprobs >= 0 && n > 0)
        cJSON_AddItemToObject(ch, "logprobs", chat ? chat_logprobs(c, pieces, n)
                                                   : cmpl_logprobs(c, pieces, n, 0));
    else
        cJSON_AddNullToObject(ch, "logprobs");
    if (finish) cJSON_AddStringToObject(ch, "finish_reason", finish);
    else cJSON_AddNullToObject(ch, "finish_reason");
    return sse_wrap(print_and_free(r));
}

char *srv_tool_calls_sse(const srv_resp_ctx *c, int index, const srv_tool_call *calls, int n) {
    cJSON *r = envelope(c, "chat.completion.chunk");
    cJSON *choices = cJSON_AddArrayToObject(r, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, ch);
    cJSON_AddNumberToObject(ch, "index", index);
    cJSON *d = cJSON_AddObjectToObject(ch, "delta");
    cJSON_AddItemToObject(d, "tool_calls", tool_calls_arr(calls, n, 1));
    cJSON_AddNullToObject(ch, "logprobs");
    cJSON_AddNullToObject(ch, "finish_reason");
    return sse_wrap(print_and_free(r));
}

char *srv_usage_sse(const srv_resp_ctx *c, const srv_usage *u) {
    cJSON *r = envelope(c, c->api == SRV_API_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddArrayToObject(r, "choices");
    cJSON_AddItemToObject(r, "usage", usage_obj(u));
    return sse_wrap(print_and_free(r));
}

static cJSON *error_obj(const srv_error *err) {
    cJSON *r = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(r, "error");
    add_text(e, "message", err->message, strlen(err->message));
    cJSON_AddStringToObject(e, "type", err->type ? err->type : "invalid_request_error");
    if (err->param[0]) add_text(e, "param", err->param, strlen(err->param));
    else cJSON_AddNullToObject(e, "param");
    if (err->code) cJSON_AddStringToObject(e, "code", err->code);
    else cJSON_AddNullToObject(e, "code");
    return r;
}

char *srv_error_json(const srv_error *err) { return print_and_free(error_obj(err)); }

char *srv_error_sse(const srv_error *err) { return sse_wrap(srv_error_json(err)); }

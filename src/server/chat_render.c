/*
 * chat_render.c - a chat request's prompt text through the checkpoint's own template:
 * the history as JSON (tool calls of assistant turns and tool messages included) and,
 * when the request offers tools and tool_choice is not "none", the "tools" variable the
 * Qwen, Llama 3 and Gemma templates read (OpenAI's tool objects, as transformers passes
 * them).
 * Owns: the template variables of a request. Must not: tokenize or touch the engine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"
#include "util/common.h"

/* The start of a call in the template's own format, for tool_choice required (any
 * function) or named (that one): appended to the prompt, so the model continues inside a
 * call. "" when the template's format is unknown (then nothing is forced). */
static void forced_start(const char *src, const srv_request *rq, char *buf, size_t cap) {
    buf[0] = 0;
    if (!src || (rq->tool_choice != SRV_TOOL_REQUIRED && rq->tool_choice != SRV_TOOL_NAMED)) return;
    int named = rq->tool_choice == SRV_TOOL_NAMED;
    const char *nm = named ? rq->tool_name : "";
    if (strstr(src, "<tool_call>")) /* Qwen / Hermes */
        snprintf(buf, cap, "<tool_call>\n{\"name\": \"%s%s", nm, named ? "\", \"arguments\": " : "");
    else if (strstr(src, "<|tool_call>")) /* Gemma 4 */
        snprintf(buf, cap, "<|tool_call>call:%s%s", nm, named ? "{" : "");
    else if (strstr(src, "\"parameters\": ")) /* Llama 3 */
        snprintf(buf, cap, "{\"name\": \"%s%s", nm, named ? "\", \"parameters\": " : "");
}

tqkv_status srv_render_chat(const tqkv_chat_template *t, const char *src, const srv_request *rq,
                            const char *bos, const char *eos, char **out, size_t *out_len,
                            char *forced, size_t forced_cap) {
    char *extra = NULL;
    forced[0] = 0;
    if (rq->tools_json && rq->tool_choice != SRV_TOOL_NONE) {
        size_t n = strlen(rq->tools_json) + 16;
        if (!(extra = malloc(n))) return tqkv_fail(TQKV_ENOMEM, "chat: out of memory");
        snprintf(extra, n, "{\"tools\":%s}", rq->tools_json);
    }
    tqkv_status st = tqkv_chat_template_render_json(t, rq->messages_json, 1, bos, eos, extra, out,
                                                    out_len);
    free(extra);
    if (st != TQKV_OK || !rq->tools_json) return st;
    forced_start(src, rq, forced, forced_cap);
    size_t fl = strlen(forced), n = out_len ? *out_len : strlen(*out);
    if (!fl) return TQKV_OK;
    char *o = realloc(*out, n + fl + 1);
    if (!o) {
        free(*out);
        *out = NULL;
        return tqkv_fail(TQKV_ENOMEM, "chat: out of memory");
    }
    memcpy(o + n, forced, fl + 1);
    *out = o;
    if (out_len) *out_len = n + fl;
    return TQKV_OK;
}

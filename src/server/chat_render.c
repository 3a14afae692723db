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

tqkv_status srv_render_chat(const tqkv_chat_template *t, const srv_request *rq, const char *bos,
                            const char *eos, char **out, size_t *out_len) {
    char *extra = NULL;
    if (rq->tools_json && rq->tool_choice != SRV_TOOL_NONE) {
        size_t n = strlen(rq->tools_json) + 16;
        if (!(extra = malloc(n))) return tqkv_fail(TQKV_ENOMEM, "chat: out of memory");
        snprintf(extra, n, "{\"tools\":%s}", rq->tools_json);
    }
    tqkv_status st = tqkv_chat_template_render_json(t, rq->messages_json, 1, bos, eos, extra, out,
                                                    out_len);
    free(extra);
    return st;
}

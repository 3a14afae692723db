/*
 * tqkv_chat.h - chat templates: render a conversation into prompt text with the
 * checkpoint's own Jinja chat template (chat_template.jinja or tokenizer_config.json),
 * as transformers' apply_chat_template(tokenize=False) does.
 *
 * Owns: a Jinja subset (statements, expressions, filters and tests that the Qwen3,
 * Qwen 3.5, Llama 3 and Gemma templates use), parsed once and rendered many times.
 * Must not: tokenize (the caller encodes the text with tqkv_tokenizer_encode, which
 * splits out special tokens), read files, keep global state.
 * A template that uses something outside the subset fails at init with
 * TQKV_EUNSUPPORTED naming the construct and its line:column; raise_exception() in a
 * template fails render with TQKV_EINVAL and the template's message.
 */
#ifndef TQKV_CHAT_H
#define TQKV_CHAT_H

#include <stddef.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *role;    /* "system", "user", "assistant", ... */
    const char *content; /* UTF-8 text */
} tqkv_chat_message;

typedef struct tqkv_chat_template tqkv_chat_template;

/* source: the template text (NUL-terminated). */
TQKV_API tqkv_status tqkv_chat_template_init(tqkv_chat_template **out, const char *source);
TQKV_API void        tqkv_chat_template_free(tqkv_chat_template *t);

/* Render msgs [n_msgs]; bos_token / eos_token are the strings the template sees (may be
 * NULL = ""). *out: malloc'd NUL-terminated UTF-8 of *out_len bytes (out_len may be NULL).
 * The template is not modified: renders may run concurrently. */
TQKV_API tqkv_status tqkv_chat_template_render(const tqkv_chat_template *t,
                                               const tqkv_chat_message *msgs, int n_msgs,
                                               int add_generation_prompt,
                                               const char *bos_token, const char *eos_token,
                                               char **out, size_t *out_len);

/* Like tqkv_chat_template_render, with the conversation as JSON (an OpenAI request's
 * "messages" array as is): messages_json is an array of message objects with any fields
 * (role, content as a string or a list of parts, tool_calls, reasoning_content, ...).
 * extra_json (may be NULL) is an object of further top-level variables that override the
 * defaults (tools = none, documents = none): "tools", "enable_thinking", "date_string", ...
 * JSON numbers without a fraction or exponent become integers, others floats.
 * Bad JSON fails with TQKV_EINVAL. */
TQKV_API tqkv_status tqkv_chat_template_render_json(const tqkv_chat_template *t, const char *messages_json,
                                                    int add_generation_prompt, const char *bos_token,
                                                    const char *eos_token, const char *extra_json,
                                                    char **out, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_CHAT_H */

/*
 * llama.h - the Llama family (LlamaForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM) inside
 * its folder: config checks, weights, CPU forward.
 * Must not: be included outside src/model/arch/llama/ (the rest of the runtime reaches this
 *   graph through model_arch_llama, arch.h).
 */
#ifndef TQKV_ARCH_LLAMA_H
#define TQKV_ARCH_LLAMA_H

#include "model/arch/arch.h"
#include "model/model_impl.h"

tqkv_status llama_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status llama_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
tqkv_status llama_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                          const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                          float *logits);

#endif

/*
 * qwen35.h - the Qwen 3.5 hybrid graph (Qwen3_5ForCausalLM, model_type qwen3_5_text) inside
 * its folder: config, weights, recurrent state rows, the CPU forward.
 * Must not: be included outside src/model/arch/qwen35/ (the runtime reaches this graph
 *   through model_arch_qwen35, arch.h; its device kernels through graph_cuda.cu).
 */
#ifndef TQKV_ARCH_QWEN35_H
#define TQKV_ARCH_QWEN35_H

#include "model/arch/arch.h"
#include "model/model_impl.h"

tqkv_status qwen35_config_parse(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status qwen35_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
/* recurrent rows (state/recurrent.h) and the graph's scratch (s->ext) of a CPU state */
tqkv_status qwen35_state_init(tqkv_model_state *s);
void        qwen35_state_free(tqkv_model_state *s);
tqkv_status qwen35_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits);
/* graph_cuda.cu (CUDA builds): the device hooks of model_arch_qwen35 (arch.h): the DeltaNet
 * shapes the kernels take, and a linear layer's conv + gated delta rule queued on s. */
tqkv_status q35_cuda_check(const tqkv_model *m);
tqkv_status q35_cuda_linear(const tqkv_model_config *c, const struct mc_layer *L,
                            struct mc_rec *rec, int j, int R, int n, const float *proj, float *cv,
                            const int32_t *slot, float *att, struct CUstream_st *s);

#endif

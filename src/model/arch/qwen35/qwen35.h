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
/* The hybrid's fields alone (layer types, DeltaNet sizes, partial RoPE, gate, norms), for
 * graphs built on this one; qwen35_config_parse also refuses experts. */
tqkv_status qwen35_config_hybrid(const cJSON *root, const char *name, tqkv_model_config *c);
tqkv_status qwen35_load(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
/* recurrent rows (state/recurrent.h) and the graph's scratch (s->ext) of a CPU state */
tqkv_status qwen35_state_init(tqkv_model_state *s);
void        qwen35_state_free(tqkv_model_state *s);
tqkv_status qwen35_forward(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                           const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                           float *logits);

/* For graphs built on this one (Qwen 3.5 MoE, src/model/arch/qwen35moe/): the hybrid with
 * its own feed-forward. ffn(m, s, l, xn, x, T): x [T, hidden] += layer l's feed-forward of
 * xn [T, hidden] (a failure rolls the call back as an attention failure does); NULL: the
 * dense SwiGLU MLP (qwen35_forward). qwen35_ffn_ext: the state's slot for the hook's own
 * data (NULL after qwen35_state_init; its owner frees it before qwen35_state_free).
 * qwen35_load_mixer: layer l's norms and token mixer (everything but the MLP);
 * qwen35_load_finish: the step after the final norm (model_load_decoder's finish). */
typedef tqkv_status (*qwen35_ffn_fn)(const tqkv_model *m, tqkv_model_state *s, int l,
                                     const float *xn, float *x, size_t T);
tqkv_status qwen35_forward_with(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                                const int *lengths, int n, int prefill, tqkv_logits_mode mode,
                                float *logits, qwen35_ffn_fn ffn);
void      **qwen35_ffn_ext(tqkv_model_state *s);
tqkv_status qwen35_load_mixer(tqkv_model *m, const tqkv_model_load_params *lp, int l);
tqkv_status qwen35_load_finish(tqkv_model *m);
/* graph_cuda.cu (CUDA builds): the device hooks of model_arch_qwen35 (arch.h): the DeltaNet
 * shapes the kernels take, and a linear layer's conv + gated delta rule queued on s. */
tqkv_status q35_cuda_check(const tqkv_model *m);
tqkv_status q35_cuda_linear(const tqkv_model_config *c, const struct mc_layer *L,
                            struct mc_rec *rec, int j, int R, int n, const float *proj, float *cv,
                            const int32_t *slot, float *att, struct CUstream_st *s);

#endif

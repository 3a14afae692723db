/*
 * arch.c - Qwen3-MoE's entry in the architecture interface (arch.h): every layer a full
 * attention KV layer (the common geometry), the Llama family's deferred kernel set, a
 * per-state experts scratch; on the GPU the common device graph with the experts' own
 * feed-forward hook (graph_cuda.cu).
 */
#include "model/arch/qwen3moe/qwen3moe.h"

#ifdef TQKV_HAVE_CUDA
static const model_arch_cuda_ops cuda_ops = {
    .check = q3m_cuda_check,
    .prepare = q3m_cuda_prepare,
    .state_free = q3m_cuda_state_free,
    .ffn_upload = q3m_cuda_upload,
    .ffn = q3m_cuda_ffn,
};
#endif

const model_arch_ops model_arch_qwen3moe = {
    .name = "qwen3moe",
    .kset = MODEL_KSET_DEFERRED,
    .config_parse = qwen3moe_config_parse,
    .load = qwen3moe_load,
    .state_init = qwen3moe_state_init,
    .state_free = qwen3moe_state_free,
    .forward = qwen3moe_forward,
    .device = 1,
    .cuda = MODEL_ARCH_CUDA(&cuda_ops),
};

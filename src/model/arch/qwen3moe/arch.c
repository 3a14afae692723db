/*
 * arch.c - Qwen3-MoE's entry in the architecture interface (arch.h): every layer a full
 * attention KV layer (the common geometry), the Llama family's deferred kernel set, a
 * per-state experts scratch; on the GPU the common device graph with the experts' own
 * feed-forward hook (the shared device experts, src/model/cuda/moe_cuda.h).
 */
#include "model/arch/qwen3moe/qwen3moe.h"
#include "model/cuda/moe_cuda.h"

#ifdef TQKV_HAVE_CUDA
static tqkv_status cuda_upload(const tqkv_model *m, struct model_cuda_weights *w) {
    return mc_moe_upload_layers(m, qwen3moe_of(m)->layers, w);
}

static const model_arch_cuda_ops cuda_ops = {
    .check = mc_moe_check,
    .prepare = mc_moe_prepare,
    .state_free = mc_moe_free,
    .ffn_upload = cuda_upload,
    .ffn = mc_moe_ffn,
    .ffn_block = mc_moe_ffn_block,
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
    .tp_shard = qwen3moe_tp_shard, /* tensor_parallel > 1 (tp.c) */
    .device = 1,
    .cuda = MODEL_ARCH_CUDA(&cuda_ops),
};

/*
 * arch.c - Qwen 3.5 MoE's entry in the architecture interface (arch.h): the hybrid's layer
 * kinds (gated DeltaNet recurrent rows between gated full-attention KV layers) and kernel
 * set, the experts as every layer's feed-forward (intermediate_size optional); on the GPU
 * the common device graph with the hybrid's DeltaNet hook (src/model/arch/qwen35/) and the
 * shared device experts as the feed-forward hook (src/model/cuda/moe_cuda.h: routed experts,
 * the shared expert and its gate).
 */
#include "model/arch/qwen35/qwen35.h"
#include "model/arch/qwen35moe/qwen35moe.h"
#include "model/cuda/moe_cuda.h"

#ifdef TQKV_HAVE_CUDA
static tqkv_status cuda_check(const tqkv_model *m) {
    const tqkv_status rc = q35_cuda_check(m);
    return rc != TQKV_OK ? rc : mc_moe_check(m);
}

static tqkv_status cuda_upload(const tqkv_model *m, struct model_cuda_weights *w) {
    return mc_moe_upload_layers(m, qwen35moe_of(m)->layers, w);
}

static const model_arch_cuda_ops cuda_ops = {
    .check = cuda_check,
    .prepare = mc_moe_prepare,
    .state_free = mc_moe_free,
    .ffn_upload = cuda_upload,
    .ffn = mc_moe_ffn,
    .ffn_block = mc_moe_ffn_block,
    .linear = q35_cuda_linear,
};
#endif

const model_arch_ops model_arch_qwen35moe = {
    .name = "qwen35moe",
    .kset = MODEL_KSET_DENSE,
    .config_parse = qwen35moe_config_parse,
    .load = qwen35moe_load,
    .state_init = qwen35moe_state_init,
    .state_free = qwen35moe_state_free,
    .forward = qwen35moe_forward,
    .tp_shard = qwen35moe_tp_shard, /* tensor_parallel > 1 (tp.c) */
    .experts_only = 1,
    .device = 1,
    .cuda = MODEL_ARCH_CUDA(&cuda_ops),
};

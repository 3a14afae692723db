/*
 * arch.c - Qwen 3.5's entry in the architecture interface (arch.h): gated DeltaNet layers
 * (TQKV_LAYER_LINEAR: recurrent state rows, no KV cache) between gated full-attention
 * layers (the common geometry describes both), host recurrent rows for CPU states (a device
 * state keeps them on the GPU), the dense kernel set (as the seed system).
 */
#include "model/arch/qwen35/qwen35.h"

#ifdef TQKV_HAVE_CUDA
static const model_arch_cuda_ops cuda_ops = {
    .check = q35_cuda_check,
    .linear = q35_cuda_linear,
};
#endif

const model_arch_ops model_arch_qwen35 = {
    .name = "qwen35",
    .kset = MODEL_KSET_DENSE,
    .config_parse = qwen35_config_parse,
    .load = qwen35_load,
    .state_init = qwen35_state_init,
    .state_free = qwen35_state_free,
    .forward = qwen35_forward,
    .tp_shard = qwen35_tp_shard, /* tensor_parallel > 1 (tp.c) */
    .device = 1,
    .cuda = MODEL_ARCH_CUDA(&cuda_ops),
};

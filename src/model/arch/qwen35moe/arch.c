/*
 * arch.c - Qwen 3.5 MoE's entry in the architecture interface (arch.h): the hybrid's layer
 * kinds (gated DeltaNet recurrent rows between gated full-attention KV layers) and kernel
 * set, the experts as every layer's feed-forward (intermediate_size optional); CPU only for
 * now (no device graph: --device cuda is refused).
 */
#include "model/arch/qwen35moe/qwen35moe.h"

const model_arch_ops model_arch_qwen35moe = {
    .name = "qwen35moe",
    .kset = MODEL_KSET_DENSE,
    .config_parse = qwen35moe_config_parse,
    .load = qwen35moe_load,
    .state_init = qwen35moe_state_init,
    .state_free = qwen35moe_state_free,
    .forward = qwen35moe_forward,
    .experts_only = 1,
    .device = 0,
};

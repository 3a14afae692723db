/*
 * arch.c - Qwen3-MoE's entry in the architecture interface (arch.h): every layer a full
 * attention KV layer (the common geometry), the Llama family's deferred kernel set, a
 * per-state experts scratch; CPU only for now (no device graph: --device cuda is refused).
 */
#include "model/arch/qwen3moe/qwen3moe.h"

const model_arch_ops model_arch_qwen3moe = {
    .name = "qwen3moe",
    .kset = MODEL_KSET_DEFERRED,
    .config_parse = qwen3moe_config_parse,
    .load = qwen3moe_load,
    .state_init = qwen3moe_state_init,
    .state_free = qwen3moe_state_free,
    .forward = qwen3moe_forward,
    .device = 0,
};

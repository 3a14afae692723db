/*
 * arch.c - the Llama family's entry in the architecture interface (arch.h): every layer a
 * full-attention KV layer (the common geometry), the deferred kernel set (fused decode:
 * measured faster on the bundled Qwen3 at depth 4096, kernel_set.c), the common device graph.
 */
#include "model/arch/llama/llama.h"

const model_arch_ops model_arch_llama = {
    .name = "llama",
    .kset = MODEL_KSET_DEFERRED,
    .config_parse = llama_config_parse,
    .load = llama_load,
    .forward = llama_forward,
    .tp_shard = llama_tp_shard, /* tensor_parallel > 1 (tp.c) */
    .device = 1, /* the common device graph (src/model/cuda/forward_cuda.cu) */
};

/*
 * model_cuda.h - the model forward pass on the GPU (CUDA backend), C-callable.
 * Owns: a device-side twin of a tqkv_model_state: the weights as bf16 in device memory
 * (uploaded once per model, by its first device state, kept in tqkv_model.gpu_weights and
 * shared by the model's device states; creating a model's FIRST device state concurrently
 * from two threads is not supported), one device KV cache (cuda_kv) per layer, device scratch, and
 * the Qwen3 / Qwen2 / Llama graph run with our own batch-invariant GEMM kernel and the
 * device cache's encode / attention kernels. Logits are copied back to the host (sampling
 * stays on the host).
 * Must not: be called when the build has no CUDA (forward.c guards with TQKV_HAVE_CUDA),
 * or make a row's logits depend on the other rows or the batch size.
 *
 * Supported: head_dim 128, q_heads / kv_heads <= 8, K/V tq4/tq4 or tq3/tq3 (with or
 * without the q8 window), or f32/f32 which runs on the device's dense bf16 cache;
 * prefill without padding (every row's length == n), extend, decode.
 */
#ifndef TQKV_MODEL_CUDA_H
#define TQKV_MODEL_CUDA_H

#include <stdint.h>

#include "tqkv_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct model_cuda model_cuda;
typedef struct model_cuda_weights model_cuda_weights;

/* Free a model's device weights (tqkv_model_free; NULL is fine). */
void        model_cuda_weights_free(model_cuda_weights *w);

/* Upload the weights and make empty device caches of `rows` rows. */
tqkv_status model_cuda_init(model_cuda **out, const tqkv_model *m,
                            const tqkv_model_state_params *p, int rows);
void        model_cuda_free(model_cuda *g);
/* Empty every layer's cache; rows > 0 changes the row count. */
tqkv_status model_cuda_reset(model_cuda *g, int rows);
/* Tokens held per row: offset [rows]. */
tqkv_status model_cuda_offsets(const model_cuda *g, int *offset);
/* Device bytes held by the caches. */
size_t      model_cuda_kv_bytes(const model_cuda *g);
/* The forward of forward.c (same arguments and logits layout), on the device. */
tqkv_status model_cuda_forward(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                               int prefill, tqkv_logits_mode mode, float *logits);

#ifdef __cplusplus
}
#endif

#endif

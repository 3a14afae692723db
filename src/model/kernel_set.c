/*
 * kernel_set.c - which attention kernel set a graph runs: its ops' kset (arch.h).
 * Owns: translating a kernel set into the prefill / decode kernels, tqkv_model_kernel_set.
 * Must not: run attention, read weights, name an architecture.
 *
 * Kernel sets (see src/attn/attn.c for what each kernel does):
 *   dense     prefill dense,    decode dense:  K and V decoded to floats in the original
 *             domain, standard attention.
 *   deferred  prefill deferred, decode fused:  attention runs on rotated K/V, q rotated once
 *             and each output un-rotated once (fused is the in-register decode of the same).
 * Each architecture's arch.c says which set it runs and why (the Llama family: deferred,
 * measured: on the bundled Qwen3 at depth 4096 tq4 decode runs 0.66x f16 with the dense set
 * and 1.25x with the fused decode, bench/RESULTS.md; Qwen 3.5: dense and Gemma 4: deferred,
 * as the seed system).
 *
 * Override: a state's prefill_kernel / decode_kernel set to anything but
 * TQKV_KERNEL_BY_GRAPH (CLI: --prefill-kernel / --decode-kernel) replaces the graph's
 * choice, for tests and benchmarks.
 */
#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "util/common.h"

void model_kernel_set(const tqkv_model *m, tqkv_kernel *prefill, tqkv_kernel *decode) {
    const model_kset k = m->ops->kset;
    if (prefill) *prefill = k == MODEL_KSET_DENSE ? TQKV_KERNEL_DENSE : TQKV_KERNEL_DEFERRED;
    if (decode) *decode = k == MODEL_KSET_DENSE ? TQKV_KERNEL_DENSE : TQKV_KERNEL_FUSED;
}

tqkv_status tqkv_model_kernel_set(const tqkv_model *m, const char **name, tqkv_kernel *prefill,
                                  tqkv_kernel *decode) {
    if (!m) return tqkv_fail(TQKV_EINVAL, "tqkv_model_kernel_set: NULL model");
    if (name) *name = m->ops->kset == MODEL_KSET_DENSE ? "dense" : "deferred";
    model_kernel_set(m, prefill, decode);
    return TQKV_OK;
}

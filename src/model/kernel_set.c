/*
 * kernel_set.c - which attention kernel set each graph runs (the one table of it).
 * Owns: the graph -> kernel set table and its lookup.
 * Must not: run attention, read weights.
 *
 * Kernel sets (see src/attn/attn.c for what each kernel does):
 *   dense     prefill dense,    decode dense:  K and V decoded to floats in the original
 *             domain, standard attention.
 *   deferred  prefill deferred, decode fused:  attention runs on rotated K/V, q rotated once
 *             and each output un-rotated once (fused is the in-register decode of the same).
 *
 *   graph (tqkv_arch)                  kernel set   why
 *   Qwen3_5ForCausalLM (hybrid)        dense        as the seed system
 *   LlamaForCausalLM (incl. MiniCPM5)  deferred     as the seed system (MiniCPM5's public
 *                                                   checkpoints are Llama)
 *   Gemma4ForCausalLM                  deferred     as the seed system
 *   Qwen3ForCausalLM, Qwen2ForCausalLM deferred     measured: on the bundled Qwen3 at depth
 *                                                   4096, tq4 decode runs 0.66x f16 with the
 *                                                   dense set and 1.25x with the fused decode
 *                                                   (bench/RESULTS.md), so the runtime keeps
 *                                                   the faster set it shipped with
 *
 * Override: a state's prefill_kernel / decode_kernel set to anything but
 * TQKV_KERNEL_BY_GRAPH (CLI: --prefill-kernel / --decode-kernel) replaces the table's
 * choice, for tests and benchmarks.
 */
#include "model/model_impl.h"
#include "util/common.h"

typedef enum { KSET_DENSE = 0, KSET_DEFERRED } kset;

static const struct {
    tqkv_arch   arch;
    kset        set;
} KERNEL_TABLE[] = {
    {TQKV_ARCH_QWEN35, KSET_DENSE},
    {TQKV_ARCH_LLAMA, KSET_DEFERRED},
    {TQKV_ARCH_GEMMA4, KSET_DEFERRED},
    {TQKV_ARCH_QWEN3, KSET_DEFERRED},
    {TQKV_ARCH_QWEN2, KSET_DEFERRED},
};

static kset lookup(tqkv_arch a) {
    for (size_t i = 0; i < sizeof KERNEL_TABLE / sizeof KERNEL_TABLE[0]; i++)
        if (KERNEL_TABLE[i].arch == a) return KERNEL_TABLE[i].set;
    return KSET_DEFERRED;
}

void model_kernel_set(const tqkv_model_config *c, tqkv_kernel *prefill, tqkv_kernel *decode) {
    kset k = lookup(c->arch);
    if (prefill) *prefill = k == KSET_DENSE ? TQKV_KERNEL_DENSE : TQKV_KERNEL_DEFERRED;
    if (decode) *decode = k == KSET_DENSE ? TQKV_KERNEL_DENSE : TQKV_KERNEL_FUSED;
}

tqkv_status tqkv_model_kernel_set(const tqkv_model *m, const char **name, tqkv_kernel *prefill,
                                  tqkv_kernel *decode) {
    if (!m) return tqkv_fail(TQKV_EINVAL, "tqkv_model_kernel_set: NULL model");
    if (name) *name = lookup(m->cfg.arch) == KSET_DENSE ? "dense" : "deferred";
    model_kernel_set(&m->cfg, prefill, decode);
    return TQKV_OK;
}

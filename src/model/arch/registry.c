/*
 * registry.c - which architecture runs a checkpoint: the one table of Hugging Face
 * architecture names / model_types -> ops (arch.h).
 * Owns: the registry lines, name lookup, the refusal of names this build knows but does not
 *   run (Qwen3-Next), wrapper checkpoints (a multimodal model around a text
 *   model this build runs).
 * Must not: parse sizes or load weights (load/config.c, the architectures' own files).
 *
 * Adding an architecture: one line in REGISTRY below (docs/ARCHITECTURE.md).
 */
#include <stdio.h>
#include <string.h>

#include "model/arch/arch.h"
#include "model/model_impl.h"
#include "util/common.h"

typedef struct {
    const char           *hf_arch;    /* config.json "architectures"[0] */
    const char           *model_type; /* config.json "model_type" */
    tqkv_arch             id;
    const char           *graph;      /* short graph name (`tqkv info`) */
    const model_arch_ops *ops;
    int                   by_type;    /* model_type alone decides, whatever the name says */
} arch_entry;

static const arch_entry REGISTRY[] = {
    {"Qwen3ForCausalLM", "qwen3", TQKV_ARCH_QWEN3, "qwen3", &model_arch_llama, 0},
    {"Qwen2ForCausalLM", "qwen2", TQKV_ARCH_QWEN2, "qwen2", &model_arch_llama, 0},
    {"LlamaForCausalLM", "llama", TQKV_ARCH_LLAMA, "llama", &model_arch_llama, 0},
    {"Gemma4ForCausalLM", "gemma4_text", TQKV_ARCH_GEMMA4, "gemma4", &model_arch_gemma4, 0},
    {"Qwen3_5ForCausalLM", "qwen3_5_text", TQKV_ARCH_QWEN35, "qwen3.5 hybrid", &model_arch_qwen35, 1},
    {"Qwen3MoeForCausalLM", "qwen3_moe", TQKV_ARCH_QWEN3_MOE, "qwen3moe", &model_arch_qwen3moe, 0},
    {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", TQKV_ARCH_QWEN35_MOE, "qwen3.5 moe hybrid",
     &model_arch_qwen35moe, 1},
};
#define N_REGISTRY (sizeof REGISTRY / sizeof REGISTRY[0])

/* Names known and refused: prefix of the architecture or model_type -> what runs instead. */
static const struct {
    const char *arch_prefix, *type_prefix, *what;
} REFUSED[] = {
    {"Qwen3Next", "qwen3_next", "a Qwen3-Next checkpoint (its DeltaNet projections are laid "
                                "out unlike Qwen 3.5's); the hybrid MoE graph this build runs "
                                "is Qwen 3.5 MoE (Qwen3_5MoeForCausalLM)"},
};

/* Wrapper checkpoints: the text model inside, the model_type its text_config gets, the
 * weight prefix of the text model. */
static const struct {
    const char *hf_arch, *model_type, *text_type, *prefix;
} WRAPPERS[] = {
    {"Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_text", "model.language_model."},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_text",
     "model.language_model."},
};

const char *model_arch_name_of_type(const char *model_type) {
    for (size_t i = 0; model_type && i < N_REGISTRY; i++)
        if (!strcmp(REGISTRY[i].model_type, model_type)) return REGISTRY[i].hf_arch;
    return NULL;
}

const model_arch_ops *model_arch_ops_of(tqkv_arch id) {
    for (size_t i = 0; i < N_REGISTRY; i++)
        if (REGISTRY[i].id == id) return REGISTRY[i].ops;
    return NULL;
}

const char *model_arch_graph_name(tqkv_arch id) {
    for (size_t i = 0; i < N_REGISTRY; i++)
        if (REGISTRY[i].id == id) return REGISTRY[i].graph;
    return "unknown";
}

static int has_prefix(const char *s, const char *p) { return s && !strncmp(s, p, strlen(p)); }

const model_arch_ops *model_arch_find(const char *arch, const char *model_type,
                                      const char *name, tqkv_arch *id, tqkv_status *rc) {
    *rc = TQKV_OK;
    const char *a = arch ? arch : "", *t = model_type ? model_type : "";
    for (size_t i = 0; i < N_REGISTRY; i++) {
        /* the architecture name decides; the model_type when there is none (or by_type) */
        const int type_ok = !strcmp(REGISTRY[i].model_type, t) && (!arch || REGISTRY[i].by_type);
        if (strcmp(REGISTRY[i].hf_arch, a) && !type_ok) continue;
        *id = REGISTRY[i].id;
        return REGISTRY[i].ops;
    }
    for (size_t i = 0; i < sizeof REFUSED / sizeof REFUSED[0]; i++)
        if (has_prefix(a, REFUSED[i].arch_prefix) || has_prefix(t, REFUSED[i].type_prefix)) {
            *rc = tqkv_fail(TQKV_EUNSUPPORTED, "%s: '%s' is %s", name, arch ? arch : t,
                            REFUSED[i].what);
            return NULL;
        }
    char list[512];
    size_t o = 0;
    for (size_t i = 0; i < N_REGISTRY && o < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s%s", i ? ", " : "", REGISTRY[i].hf_arch);
    *rc = tqkv_fail(TQKV_EUNSUPPORTED, "%s: unknown architecture '%s' (supported: %s)", name,
                    arch ? arch : t,
                    list);
    return NULL;
}

int model_arch_unwrap(const char *arch, const char *model_type, const cJSON *root,
                      const char *name, cJSON **text, char *arch_name, size_t arch_cap,
                      char *prefix, size_t prefix_cap, tqkv_status *rc) {
    *rc = TQKV_OK;
    for (size_t i = 0; i < sizeof WRAPPERS / sizeof WRAPPERS[0]; i++) {
        if ((!arch || strcmp(arch, WRAPPERS[i].hf_arch)) &&
            (!model_type || strcmp(model_type, WRAPPERS[i].model_type)))
            continue;
        /* text_config parsed as the text model's config (top-level tie_word_embeddings / eos
         * ids used when text_config lacks them); the other towers' weights are ignored */
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (!cJSON_IsObject(tc)) {
            *rc = tqkv_fail(TQKV_ECORRUPT, "%s: %s config without \"text_config\"", name,
                            WRAPPERS[i].hf_arch);
            return 1;
        }
        cJSON *t = cJSON_Duplicate(tc, 1);
        if (!t) {
            *rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
            return 1;
        }
        const char *inherit[] = {"tie_word_embeddings", "eos_token_id", "bos_token_id",
                                 "pad_token_id"};
        for (size_t k = 0; k < sizeof inherit / sizeof inherit[0]; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, inherit[k]);
            if (v && !cJSON_GetObjectItemCaseSensitive(t, inherit[k]))
                cJSON_AddItemToObject(t, inherit[k], cJSON_Duplicate(v, 1));
        }
        cJSON_DeleteItemFromObjectCaseSensitive(t, "architectures");
        cJSON_DeleteItemFromObjectCaseSensitive(t, "model_type");
        cJSON_AddStringToObject(t, "model_type", WRAPPERS[i].text_type);
        *text = t;
        snprintf(arch_name, arch_cap, "%s", WRAPPERS[i].hf_arch);
        snprintf(prefix, prefix_cap, "%s", WRAPPERS[i].prefix);
        return 1;
    }
    return 0;
}

/*
 * arch.c - Gemma 4's entry in the architecture interface (arch.h): sliding and full layers of
 * their own head dims and KV heads, KV-shared layers reading a donor's cache, the bounded
 * sliding caches (window + window_slack), per-layer inputs that limit the token ids, the
 * deferred kernel set (as the seed system).
 */
#include "model/arch/gemma4/gemma4.h"

static tqkv_status config_parse(const cJSON *root, const char *name, tqkv_model_config *c) {
    return gemma4_config_parse(root, name, c, NULL);
}

static void layer_info(const tqkv_model *m, int l, tqkv_layer_info *li, model_layer_kind *kind) {
    const g4_config *g = &gemma4_of(m)->cfg;
    const int t = g->sliding[l] ? 0 : 1;
    li->kv_heads = g->n_kv[l];
    li->head_dim = g->head_dim[l];
    li->rope_theta = g->theta[t];
    li->rotary_dim = g->proportional[t] ? (int)(g->partial[t] * g->head_dim[l] + 0.5)
                                        : g->head_dim[l];
    li->window = g->sliding[l] ? g->window : 0;
    li->kv_from = g->donor[l];
    if (g->donor[l] != l) *kind = MODEL_LAYER_SHARED;
    else if (g->sliding[l] && g->pos_layer >= 0) *kind = MODEL_LAYER_SLIDING;
    else *kind = MODEL_LAYER_KV;
}

/* Tokens a bounded sliding layer keeps after a forward outside a spec round. */
static int sliding_keep(const tqkv_model *m, const tqkv_model_state_params *p) {
    return gemma4_of(m)->cfg.window + p->window_slack;
}

/* Per-layer inputs index a table of ple_vocab rows: a token must fit both tables. */
static int token_limit(const tqkv_model *m) {
    const g4_config *g = &gemma4_of(m)->cfg;
    return g->ple_dim && g->ple_vocab < m->cfg.vocab_size ? g->ple_vocab : m->cfg.vocab_size;
}

#ifdef TQKV_HAVE_CUDA
static const model_arch_cuda_ops cuda_ops = {
    .check = g4_cuda_check,
    .upload = g4_cuda_upload,
    .prepare = g4_cuda_prepare,
    .state_free = g4_cuda_state_free,
    .forward_queue = g4_cuda_forward_queue,
    .drop_oldest = g4_cuda_drop_oldest,
    .win_tokens = g4_cuda_win_tokens,
    .rope_width = g4_cuda_rope_width,
    .rope_row = g4_cuda_rope_row,
    .ple_width = g4_cuda_ple_width,
    .tp = &g4_cuda_tp, /* --device cuda --tensor-parallel N (cuda/tp_cuda.cu) */
};
#endif

const model_arch_ops model_arch_gemma4 = {
    .name = "gemma4",
    .kset = MODEL_KSET_DEFERRED,
    .config_parse = config_parse,
    .load = gemma4_load,
    .layer_info = layer_info,
    .position_layer = gemma4_position_layer,
    .sliding_keep = sliding_keep,
    .token_limit = token_limit,
    .state_free = gemma4_state_free,
    .forward = gemma4_forward,
    .tp_shard = gemma4_tp_shard, /* tensor_parallel > 1 (tp.c) */
    .device = 1,
    .cuda = MODEL_ARCH_CUDA(&cuda_ops),
};

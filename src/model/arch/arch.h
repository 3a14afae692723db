/*
 * arch.h - the architecture interface: one ops table per graph, found by the registry.
 * Owns: what an architecture tells the rest of the runtime (config fields of its own, weight
 *   loading, per-layer kinds and geometry, state extensions, the CPU forward, the attention kernel set, the sliding layers' keep) and the registry lookup by Hugging
 *   Face architecture name / model_type.
 * Must not: be bypassed. Code outside src/model/arch/ never asks which architecture a model
 *   is: it asks m->ops (docs/ARCHITECTURE.md, "Adding an architecture").
 *
 * An architecture lives in src/model/arch/<name>/: config.c, load.c, graph.c (CPU),
 * graph_cuda.cu (device hooks, optional) and arch.c, which defines its `model_arch_ops`.
 * registry.c lists every (architecture name, model_type) -> ops line.
 */
#ifndef TQKV_MODEL_ARCH_H
#define TQKV_MODEL_ARCH_H

#include <cjson/cJSON.h>

#include "tqkv_model.h"

/* How a layer holds its token mixer's state (state/rows.c moves every kind with the rows). */
typedef enum {
    MODEL_LAYER_KV = 0,    /* a tqkv_batch of K/V rows whose offsets are the rows' positions */
    MODEL_LAYER_SLIDING,   /* a bounded tqkv_batch: keeps its newest ops->sliding_keep tokens */
    MODEL_LAYER_SHARED,    /* no cache: attends over its donor's (tqkv_layer_info.kv_from) */
    MODEL_LAYER_RECURRENT, /* no cache: the state's recurrent rows (state/recurrent.h) */
} model_layer_kind;

/* Attention kernel set of a graph (kernel_set.c says what each runs). */
typedef enum { MODEL_KSET_DENSE = 0, MODEL_KSET_DEFERRED } model_kset;

/* The CPU forward after the common preamble (state/state.c: arguments, rows, context
 * limit): tokens [rows, n], lengths[r] real tokens at the end of row r (NULL: all n). */
typedef tqkv_status (*model_forward_fn)(const tqkv_model *m, tqkv_model_state *s,
                                        const int32_t *tokens, const int *lengths, int n,
                                        int prefill, tqkv_logits_mode mode, float *logits);

/* The device runtime's types the hooks below take (src/model/cuda/model_cuda_impl.h). */
struct model_cuda;
struct model_cuda_weights;
struct mc_layer;
struct mc_rec;
struct CUstream_st; /* cudaStream_t */

/* Device hooks of an architecture (arch/<name>/graph_cuda.cu; only in a CUDA build). The
 * device runtime (src/model/cuda/) runs the common graph where a hook is NULL. */
typedef struct model_arch_cuda_ops {
    /* a refusal (TQKV_EUNSUPPORTED, with a message) of a config its device graph cannot run */
    tqkv_status (*check)(const tqkv_model *m);
    /* its own layers' upload into w (the common upload otherwise) and their free */
    tqkv_status (*upload)(const tqkv_model *m, struct model_cuda_weights *w);
    /* a state's own device buffers: before a forward, and freed with the state */
    tqkv_status (*prepare)(struct model_cuda *g);
    void (*state_free)(struct model_cuda *g);
    /* its own forward queue (cuda/forward_cuda.cu's forward_queue contract) */
    tqkv_status (*forward_queue)(struct model_cuda *g, int n, int as_decode,
                                 tqkv_logits_mode mode, float *out, int pick, int *done);
    /* the bounded sliding layers' drop, after a forward outside a spec round and when a
     * round begins */
    tqkv_status (*drop_oldest)(struct model_cuda *g);
    /* the longest row of its window views in a step of n tokens (the graph key) */
    int (*win_tokens)(const struct model_cuda *g, int n);
    /* floats of one token's RoPE tables and the row itself (NULL: head_dim, one table) */
    int (*rope_width)(const tqkv_model *m);
    void (*rope_row)(const tqkv_model *m, int pos, float *row);
    /* per-token floats of per-layer inputs the scratch holds (NULL: none) */
    int (*ple_width)(const tqkv_model *m);
    /* its own feed-forward layers (NULL: every layer's is the dense MLP). ffn_upload: their
     * device weights (in w->arch, with w->arch_free), beside the common upload, which then
     * skips the MLP of every layer whose host weights have none (no gate matrix); ffn: queue
     * layer l's feed-forward of g->xn [T, H] into g->tmp [T, H] on g->stream (a layer it
     * does not own: mc_ffn_dense, the common MLP) */
    tqkv_status (*ffn_upload)(const tqkv_model *m, struct model_cuda_weights *w);
    tqkv_status (*ffn)(struct model_cuda *g, int l, int T);
    /* layer l's whole block after the mixer (NULL: the common steps, which use ffn): x +=
     * tmp, xn = RMSNorm(x) ffn_norm, the feed-forward, x += its output, xn = RMSNorm(x) with
     * the next norm (and xn's GEMM split), the same bits as those steps; tmp undefined after */
    tqkv_status (*ffn_block)(struct model_cuda *g, int l, int T);
    /* queue recurrent layer j's mixer for R rows of n tokens (TQKV_LAYER_LINEAR layers) */
    tqkv_status (*linear)(const tqkv_model_config *c, const struct mc_layer *L,
                          struct mc_rec *rec, int j, int R, int n, const float *proj, float *cv,
                          const int32_t *slot, float *att, struct CUstream_st *s);
    /* a graph with its own forward_queue: the pieces of it a tensor-parallel rank runs
     * (cuda/tp_cuda.cu; NULL: no sharded device forward). The common graph's are
     * tp_cuda.cu's own. */
    const struct model_arch_cuda_tp_ops *tp;
} model_arch_cuda_ops;

/* One rank's share of a forward, in the order the sharded device forward (cuda/tp_cuda.cu)
 * queues them on the rank's stream, with all-reduces of the partials between; each queues
 * on g's stream and waits for nothing. T = rows n. */
typedef struct model_arch_cuda_tp_ops {
    /* upload the call's token list and tables, embed, layer 0's input norm */
    tqkv_status (*begin)(struct model_cuda *g, int n);
    /* layer l's token mixer of the rank's heads -> partial g->tmp [T, H]; *lin: recurrent
     * layers so far (advanced); *done = l + 1 once the layer's rows changed */
    tqkv_status (*mixer)(struct model_cuda *g, int l, int n, int as_decode, int *lin, int *done);
    /* after the mixer's all-reduce (the sum in tmp): its residual, then the rank's slice of
     * the feed-forward -> partial tmp (and the partial `extra` names) */
    tqkv_status (*ffn)(struct model_cuda *g, int l, int T);
    /* a second partial [T, H] of layer l's feed-forward all-reduced beside tmp, or NULL */
    float *(*extra)(struct model_cuda *g, int l);
    /* after the feed-forward's all-reduce: its residual and the next layer's input norm */
    tqkv_status (*end)(struct model_cuda *g, int l, int T);
    /* the rank's lm_head rows (g->head_n) into g->logits (mode LAST or ALL), no copy */
    tqkv_status (*head)(struct model_cuda *g, int n, tqkv_logits_mode mode);
} model_arch_cuda_tp_ops;

typedef struct model_arch_ops {
    const char *name;   /* the folder under src/model/arch/ */
    model_kset  kset;   /* the graph's attention kernel set */
    /* config.json: the architecture's own fields and checks, after the common ones
     * (load/config.c); may change the common ones (e.g. qk_norm, biases) */
    tqkv_status (*config_parse)(const cJSON *root, const char *name, tqkv_model_config *c);
    /* every weight, after the config and the safetensors are open (load/weights.c) */
    tqkv_status (*load)(tqkv_model *m, const char *dir, const tqkv_model_load_params *lp);
    /* one layer's kind and geometry (NULL: the common config's, TQKV_LAYER_LINEAR layers
     * recurrent); filled once at load into m->info / m->kind */
    void (*layer_info)(const tqkv_model *m, int l, tqkv_layer_info *li, model_layer_kind *k);
    /* the layer whose offsets are the rows' positions (NULL: the first KV layer) */
    int (*position_layer)(const tqkv_model *m);
    /* tokens a MODEL_LAYER_SLIDING layer keeps after a forward (NULL: no sliding layers) */
    int (*sliding_keep)(const tqkv_model *m, const tqkv_model_state_params *p);
    /* tokens must be below this (NULL: vocab_size) */
    int (*token_limit)(const tqkv_model *m);
    /* host state extensions (recurrent rows, scratch) of a CPU state; NULL: none */
    tqkv_status (*state_init)(tqkv_model_state *s);
    void (*state_free)(tqkv_model_state *s);
    model_forward_fn forward; /* the CPU graph */
    int experts_only;         /* 1: every layer's feed-forward is the experts, so config.json
                                 need not give intermediate_size (0 when absent) */
    /* tensor parallelism (tp/tp_state.h, docs/TP.md): rank r of n's shard of every layer into
     * rm, a copy of m with the rank's geometry (n_heads, n_kv_heads, intermediate_size / n),
     * its lm_head already the rank's vocabulary rows and its layers zeroed; slices through
     * tp_weight_rows / tp_weight_cols, memory from model_own(rm). The forward then runs the
     * ranks when s->tp is set. NULL: tensor_parallel > 1 is refused. */
    tqkv_status (*tp_shard)(const tqkv_model *m, int r, int n, tqkv_model *rm);
    int device;                      /* 1: runs on the GPU (--device cuda) */
    const model_arch_cuda_ops *cuda; /* its device hooks (NULL: the common device graph, or
                                        a build without CUDA) */
} model_arch_ops;

/* An arch.c's .cuda member: its hooks in a CUDA build, NULL otherwise. */
#ifdef TQKV_HAVE_CUDA
#define MODEL_ARCH_CUDA(ops) (ops)
#else
#define MODEL_ARCH_CUDA(ops) NULL
#endif

/* registry.c: the ops of a config.json's architecture (architectures[0], else model_type).
 * *id gets the public tqkv_arch, *graph a short graph name ("qwen3"). A name some
 * architecture knows but refuses (an MoE variant) returns NULL with *rc its refusal; an
 * unknown name returns NULL with *rc TQKV_EUNSUPPORTED naming the supported ones. */
const model_arch_ops *model_arch_find(const char *arch, const char *model_type,
                                      const char *name, tqkv_arch *id, tqkv_status *rc);
/* model_type -> architecture name of a config without "architectures" (NULL: unknown). */
const char *model_arch_name_of_type(const char *model_type);
/* A wrapper checkpoint (a multimodal model around a text model this build runs): its text
 * model's config to parse instead (*text, caller frees), the arch_name / weight_prefix to
 * keep after that parse. 0 if the config is no known wrapper. */
int model_arch_unwrap(const char *arch, const char *model_type, const cJSON *root,
                      const char *name, cJSON **text, char *arch_name, size_t arch_cap,
                      char *prefix, size_t prefix_cap, tqkv_status *rc);
/* Graph name of a tqkv_arch ("qwen3", "gemma4", ...). */
const char *model_arch_graph_name(tqkv_arch id);

/* The architectures (arch/<name>/arch.c). */
extern const model_arch_ops model_arch_llama;
extern const model_arch_ops model_arch_gemma4;
extern const model_arch_ops model_arch_qwen35;
extern const model_arch_ops model_arch_qwen3moe;
extern const model_arch_ops model_arch_qwen35moe;

#endif

/*
 * tqkv_model.h - public API of the model runtime: load a Hugging Face checkpoint
 * (config.json + safetensors, single or sharded), run a batched forward pass on the CPU
 * whose KV cache is a tqkv_batch per layer, and sample tokens.
 *
 * Owns: the model boundary. A tqkv_model is immutable after load (weights mmapped, shared
 * by any number of states); a tqkv_model_state holds the per-batch caches, the mask
 * lease and scratch. Every call returns a tqkv_status with the message in
 * tqkv_last_error(); on failure the object is unchanged unless the call says otherwise.
 * Must not: tokenize text (tqkv_tokenizer.h), schedule requests, keep global state.
 *
 * Batch invariance (product rule): a row's logits are bitwise identical whether it runs
 * alone or beside other rows of other lengths and padding, at any thread count.
 */
#ifndef TQKV_MODEL_H
#define TQKV_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Configuration (config.json, generation_config.json)                        */
/* ------------------------------------------------------------------------- */

typedef enum {
    TQKV_ARCH_QWEN3 = 0, /* Qwen3ForCausalLM: q_norm/k_norm per head */
    TQKV_ARCH_QWEN2,     /* Qwen2ForCausalLM: q/k/v bias */
    TQKV_ARCH_LLAMA,     /* LlamaForCausalLM: attention_bias flag (q/k/v/o bias) */
    TQKV_ARCH_GEMMA4,    /* Gemma4ForCausalLM (gemma4_text): sliding/full layers, KV sharing;
                            head_dim/n_kv_heads here are the sliding layers' */
    TQKV_ARCH_QWEN35,    /* Qwen3_5ForCausalLM (qwen3_5_text): gated DeltaNet + gated attention */
    TQKV_ARCH_QWEN3_MOE, /* Qwen3MoeForCausalLM (qwen3_moe): Qwen3 attention, routed experts */
    TQKV_ARCH_QWEN35_MOE /* Qwen3_5MoeForCausalLM (qwen3_5_moe_text): the Qwen 3.5 hybrid with
                            routed experts and a gated shared expert on every layer */
} tqkv_arch;

/* Kind of a layer's token mixer (tqkv_model_config.layer_type). */
typedef enum {
    TQKV_LAYER_FULL = 0, /* softmax attention over a KV cache */
    TQKV_LAYER_LINEAR    /* gated DeltaNet: recurrent state rows, no KV cache */
} tqkv_layer_type;

#define TQKV_MAX_LAYERS 1024

typedef enum {
    TQKV_ROPE_DEFAULT = 0,
    TQKV_ROPE_LINEAR, /* positions / factor */
    TQKV_ROPE_LLAMA3  /* Llama 3.x frequency-dependent scaling */
} tqkv_rope_type;

/* End-of-sequence ids a config may list (config.json / generation_config.json); a longer
 * list is refused at load, never cut. */
#define TQKV_MAX_EOS 64

typedef struct {
    tqkv_arch      arch;
    char           arch_name[64];    /* "Qwen3ForCausalLM" */
    int            vocab_size;
    int            hidden_size;
    int            intermediate_size;
    int            n_layers;
    int            n_heads;          /* query heads */
    int            n_kv_heads;
    int            head_dim;
    int            max_position_embeddings;
    float          rms_norm_eps;
    double         rope_theta;
    tqkv_rope_type rope_type;
    double         rope_factor;          /* linear / llama3 */
    double         rope_low_freq_factor;  /* llama3 */
    double         rope_high_freq_factor; /* llama3 */
    int            rope_original_max_pos; /* llama3 */
    int            qk_norm;          /* per-head RMSNorm of q and k before RoPE */
    int            qkv_bias;         /* q/k/v projections have a bias */
    int            o_bias;           /* o_proj has a bias */
    int            tie_word_embeddings;
    int            bos_token_id;     /* -1 if none */
    int            pad_token_id;     /* -1 if none */
    int            eos_ids[TQKV_MAX_EOS];
    int            n_eos;
    /* ---- hybrid graphs (Qwen 3.5); zero / TQKV_LAYER_FULL for the other archs ---- */
    unsigned char  layer_type[TQKV_MAX_LAYERS]; /* tqkv_layer_type per layer */
    int            n_linear;         /* layers of type TQKV_LAYER_LINEAR */
    int            rotary_dim;       /* dims of each head that RoPE rotates (head_dim if 0) */
    int            attn_output_gate; /* q_proj also yields a per-head gate: o *= sigmoid(gate) */
    int            norm_zero_centred; /* RMSNorm weights are stored as w - 1 (applied as 1 + w) */
    int            lin_k_heads;      /* DeltaNet key (and query) heads */
    int            lin_v_heads;      /* DeltaNet value heads (a multiple of lin_k_heads) */
    int            lin_k_dim;        /* DeltaNet key head dim */
    int            lin_v_dim;        /* DeltaNet value head dim */
    int            lin_conv_kernel;  /* depthwise causal conv1d width */
    /* ---- mixture-of-experts graphs (Qwen3-MoE, Qwen 3.5 MoE); zero for dense ones ---- */
    int            n_experts;        /* routed experts of an MoE layer */
    int            n_experts_used;   /* experts each token runs (top-k) */
    int            moe_intermediate_size; /* one expert's SwiGLU width */
    int            norm_topk_prob;   /* the top-k routing weights renormalised to sum 1 */
    unsigned char  layer_moe[TQKV_MAX_LAYERS]; /* 1: the layer's feed-forward is the experts */
    int            n_moe_layers;     /* layers whose layer_moe is 1 */
    int            moe_shared_intermediate_size; /* the shared expert's SwiGLU width, scaled
                                                    by sigmoid(shared_expert_gate); 0: none */
    char           weight_prefix[32]; /* tensor name prefix of the text model: "" means
                                         "model."; "model.language_model." for the text part
                                         of a multimodal wrapper (Qwen3_5ForConditionalGeneration) */
} tqkv_model_config;

/* Sampling defaults from generation_config.json (HF semantics: without do_sample=true,
 * generation is greedy, which is also tqkv's default). */
typedef struct {
    int   do_sample;
    float temperature;        /* 1.0 if absent */
    int   top_k;              /* 50 if absent (used only with do_sample) */
    float top_p;              /* 1.0 if absent */
    float min_p;              /* 0 if absent */
    float repetition_penalty; /* 1.0 if absent */
} tqkv_generation_config;

/* ------------------------------------------------------------------------- */
/* Model: immutable weights                                                   */
/* ------------------------------------------------------------------------- */

typedef struct tqkv_model tqkv_model;

typedef struct {
    int threads;     /* threads for load-time conversions (>= 1) */
    int weights_f32; /* convert bf16/f16 matrices to f32 at load (default: read bf16 in place) */
    int blas;        /* also keep f32 matrices for the OpenBLAS prefill path */
    int verbose;     /* progress/status lines on stderr while loading */
    int no_pack;     /* read bf16 matrices in place instead of repacking them for GEMV */
    int no_f32_prefill; /* no f32 copies of bf16 matrices for prefill (saves 2 bytes per
                           weight; prefill matmuls ~1.6x slower, same bits). Never made on
                           CPUs with AVX-512, whose kernels read the packed bf16 faster. */
    int bf16_act;    /* 1: products with (packed) bf16 matrices round the activations to bf16
                        and run as AVX512_BF16 dot products with f32 sums, where the CPU has
                        them (2-3x the f32 kernels' rate; batch invariant, but not the f32
                        numerics: see bench/RESULTS.md for perplexity). 0 (default): the
                        exact f32 path (transformers fp32 perplexity). On the device the
                        same choice: 1 = the GEMMs round activations to bf16 (one MMA per
                        product); 0 = activations as bf16 hi + lo (two MMAs, ~16 bits). */
} tqkv_model_load_params;

TQKV_API tqkv_model_load_params tqkv_model_load_params_default(void);

/* dir holds config.json, model.safetensors or model.safetensors.index.json + shards,
 * optionally generation_config.json. Errors name the file or tensor at fault. */
TQKV_API tqkv_status tqkv_model_load(tqkv_model **out, const char *dir,
                                     const tqkv_model_load_params *p);
TQKV_API void        tqkv_model_free(tqkv_model *m);
TQKV_API const tqkv_model_config     *tqkv_model_get_config(const tqkv_model *m);
TQKV_API const tqkv_generation_config *tqkv_model_get_generation(const tqkv_model *m);
TQKV_API int         tqkv_model_is_eos(const tqkv_model *m, int token);
/* Bytes of weights the forward pass reads per token (matrices + embedding row + lm_head). */
TQKV_API size_t      tqkv_model_weight_bytes(const tqkv_model *m);
/* One layer's attention geometry as the forward runs it (for `tqkv info`, schedulers and
 * bindings): Gemma 4's per-layer head dims, sliding windows and KV-sharing donors, Qwen 3.5's
 * linear (recurrent) layers, or the uniform geometry of the other graphs. */
typedef struct {
    tqkv_layer_type type;   /* TQKV_LAYER_FULL (KV rows) or TQKV_LAYER_LINEAR (recurrent) */
    int q_heads;            /* query heads (linear: key heads) */
    int kv_heads;           /* KV heads (linear: value heads) */
    int head_dim;           /* (linear: key head dim) */
    int rotary_dim;         /* dims of each head RoPE rotates (0 for linear layers) */
    double rope_theta;
    int window;             /* sliding window in tokens (0 = full causal) */
    int kv_from;            /* layer whose KV rows it reads: itself, a donor, or -1 (linear) */
} tqkv_layer_info;
TQKV_API tqkv_status tqkv_model_layer_info(const tqkv_model *m, int layer, tqkv_layer_info *out);
/* Parameter count (elements of all tensors used). */
TQKV_API size_t      tqkv_model_params(const tqkv_model *m);
/* "bf16", "f16", "f32" or "mixed": the element type of the matrices as read by matmul. */
TQKV_API const char *tqkv_model_weight_type(const tqkv_model *m);
/* Short name of the graph that runs the model ("qwen3", "llama", "gemma4", ...). */
TQKV_API const char *tqkv_model_graph_name(const tqkv_model *m);

/* ------------------------------------------------------------------------- */
/* State: per-batch KV caches (one tqkv_batch per layer), mask lease, scratch */
/* ------------------------------------------------------------------------- */

typedef struct tqkv_model_state tqkv_model_state;

typedef struct {
    int         rows;           /* rows of the batch (>= 1) */
    tqkv_format k_format;       /* default f32 */
    tqkv_format v_format;
    int         window;         /* q8 recent window of the cache (0 = off) */
    int         window_slack;   /* tqkv_cache_config.window_slack */
    uint64_t    kv_seed;        /* layer l uses kv_seed + l */
    int         threads;        /* matmul and attention threads (>= 1) */
    tqkv_kernel prefill_kernel; /* attention kernel for n_query > 1 */
    tqkv_kernel decode_kernel;  /* attention kernel for n_query == 1 */
    int         blas;           /* use cblas_sgemm for prefill matmuls (not batch invariant
                                   across M; needs a model loaded with blas = 1) */
    int         device;         /* 0 = CPU; 1 = CUDA (docs/CUDA.md: weights and caches in GPU
                                   memory; f32 KV runs on a dense bf16 device cache; logits
                                   come back to the host; no padded prefill) */
    int         device_fast_gemm; /* device only: 1 = cuBLAS bf16 GEMMs (loaded at run time;
                                   activations rounded to bf16): faster, NOT batch
                                   invariant (a row's logits may change with the other
                                   rows); default 0, the invariant GEMM (docs/CUDA.md) */
    int         extend_as_decode; /* extend with n > 1 attends each query like a decode
                                   (decode kernel, own causal end): logits bitwise equal to
                                   n single-token decodes when window == 0 (speculative
                                   verification); default 0 */
    int         device_graphs;  /* device only: 1 (the default) = a decode step (one token
                                   per row) is captured into a CUDA graph and replayed while
                                   its shape holds (docs/CUDA.md); 0 = kernel by kernel. The
                                   logits are bitwise the same either way. The environment
                                   variable TQKV_CUDA_GRAPHS=0 turns graphs off for every
                                   state. */
    /* Per-layer KV formats (tqkv_kv_layers_parse, "0,7:q8"): entry l = 0 keeps k_format /
     * v_format for layer l, f + 1 selects format f. Layers >= TQKV_MAX_KV_LAYERS use the
     * defaults. A device state (device 1) takes them when every layer's pair is a device
     * pair or f32/f32 (tqkv_kv_layers_device_check); not with tensor_parallel there. */
    uint8_t     layer_k[64];
    uint8_t     layer_v[64];
    /* Tensor parallelism (docs/TP.md): 0 or 1 = off; N in 2..8 shards the graph Megatron-style
     * over N ranks (heads, MLP columns / rows, lm_head vocabulary), each rank holding the
     * compressed cache of its own KV heads, joined by all-reduces in a fixed rank order. N
     * must divide the query heads, KV heads and intermediate size (else TQKV_EINVAL). CPU
     * only for now (the ranks run one after another in this process; Llama-family graphs);
     * row operations (merge, filter, extract, spec rounds, export) refuse such a state. */
    int         tensor_parallel;
    /* 1: the q8 window (window > 0) holds keys only, values read from their own format
     * (tqkv_cache_config.window_keys_only; half the ring's bits). CPU states only. */
    int         window_keys_only;
} tqkv_model_state_params;

#define TQKV_MAX_KV_LAYERS 64

/* Parse a per-layer KV spec into p->layer_k / layer_v: groups "LAYERS:FMT[/VFMT]" joined by
 * ';', LAYERS a comma list of layer indices or ranges a-b, e.g. "0,7:q8" or "0-1:q8;7:tq4/q8".
 * "" or NULL clears the overrides. On failure p is unchanged. */
TQKV_API tqkv_status tqkv_kv_layers_parse(const char *spec, tqkv_model_state_params *p);
/* The K/V formats layer l of a state with params p uses. */
TQKV_API void        tqkv_kv_layer_formats(const tqkv_model_state_params *p, int layer,
                                           tqkv_format *k, tqkv_format *v);
/* TQKV_OK when a device (CUDA) state of m can hold p's KV: every layer with a cache of its
 * own (recurrent and KV-shared layers aside) has a pair the device cache holds (tq4/tq4,
 * tq3/tq3, fp8/fp8, tq K and V with K bits >= V bits) or f32/f32, which runs on the dense
 * bf16 device cache (no q8 window, no state format: such a state does not export). Else
 * TQKV_EUNSUPPORTED naming the first other layer and its pair. Needs no device. *dense
 * (may be NULL): 1 when some layer runs on the dense bf16 cache. */
TQKV_API tqkv_status tqkv_kv_layers_device_check(const tqkv_model *m,
                                                 const tqkv_model_state_params *p, int *dense);

/* prefill_kernel / decode_kernel value meaning "the graph's kernel set" (the default):
 * resolved at tqkv_model_state_init from the table in src/model/kernel_set.c. Any other
 * value overrides the table (tests, benchmarks). */
#define TQKV_KERNEL_BY_GRAPH ((tqkv_kernel)TQKV_KERNEL_COUNT)

/* rows 1, f32/f32, window 0 (slack 32), seed 0, threads 1, kernels by graph, device
 * graphs on. */
TQKV_API tqkv_model_state_params tqkv_model_state_params_default(void);

/* The graph's kernel set (the documented table in src/model/kernel_set.c): its name
 * ("dense" or "deferred") and the kernels a state uses by default for prefill (n_query > 1)
 * and decode. Any pointer may be NULL. */
TQKV_API tqkv_status tqkv_model_kernel_set(const tqkv_model *m, const char **name,
                                           tqkv_kernel *prefill, tqkv_kernel *decode);

/* Fixed bytes every row holds whatever its length (recurrent state of linear-attention
 * layers: conv history + DeltaNet state); 0 for graphs without such layers. */
TQKV_API size_t      tqkv_model_state_row_fixed_bytes(const tqkv_model_state *s);

TQKV_API tqkv_status tqkv_model_state_init(tqkv_model_state **out, const tqkv_model *m,
                                           const tqkv_model_state_params *p);
TQKV_API void        tqkv_model_state_free(tqkv_model_state *s);
/* Empty every layer's cache; rows > 0 changes the row count. */
TQKV_API tqkv_status tqkv_model_state_reset(tqkv_model_state *s, int rows);
TQKV_API int         tqkv_model_state_rows(const tqkv_model_state *s);
TQKV_API tqkv_status tqkv_model_state_set_threads(tqkv_model_state *s, int threads);
/* Tokens held per row (the next RoPE position of each row). offset: [rows] */
TQKV_API tqkv_status tqkv_model_state_offsets(const tqkv_model_state *s, int *offset);
/* The cache of one layer (for schedulers: merge/filter/export). Rows of every layer must
 * stay consistent (same offsets and padding) between forward calls. NULL for:
 *   - a Gemma 4 KV-shared layer (it reads its donor's cache); a Gemma 4 sliding layer holds
 *     only its newest window + window_slack tokens per row (its offsets count those, so take
 *     positions from tqkv_model_state_offsets), and is not trimmed during a spec round;
 *   - a linear-attention layer of a hybrid graph (Qwen 3.5): it holds recurrent state rows
 *     instead (src/model/state/recurrent.h), to which every row operation must apply too;
 *   - every layer of a state on the device (params.device == 1).
 * With tensor_parallel > 1 it is rank 0's cache (its KV heads only); the other ranks' caches
 * are not reachable here (the row operations below move every rank's rows in lockstep). */
TQKV_API tqkv_batch *tqkv_model_state_layer(tqkv_model_state *s, int layer);
/* Room for `tokens` tokens per row (its left padding aside) in every layer's cache, so
 * that appends up to that length allocate nothing. Device states allocate exactly here
 * (TQKV_ENOMEM when the rows do not fit; the state is unchanged and usable); CPU states
 * accept the call and keep growing their caches on demand. */
TQKV_API tqkv_status tqkv_model_state_reserve(tqkv_model_state *s, int tokens);
/* Benchmark aid: append n synthetic tokens to every row of every layer's cache, without
 * running the model: standard normal K and V through the cache's own encoder. Offsets (and
 * so RoPE positions) advance by n, as after a prefill of n tokens; the logits of later
 * calls mean nothing. Device states only (TQKV_EUNSUPPORTED on the CPU). On failure every
 * layer is left at the same length. */
TQKV_API tqkv_status tqkv_model_state_fill_synthetic(tqkv_model_state *s, int n, uint64_t seed);
/* KV bytes per token over all layers (K and V, main planes + window). */
TQKV_API double      tqkv_model_state_kv_bytes_per_token(const tqkv_model_state *s);
/* Bits per stored K/V value, averaged over K and V (window excluded). */
TQKV_API double      tqkv_model_state_kv_bits_per_value(const tqkv_model_state *s);
/* Bytes the caches hold now (every rank's with tensor_parallel). */
TQKV_API size_t      tqkv_model_state_kv_bytes_used(const tqkv_model_state *s);
/* Bytes the caches of one tensor-parallel rank hold now (rank 0 of an unsharded state: all;
 * 0 for a rank out of range). */
TQKV_API size_t      tqkv_model_state_kv_bytes_rank(const tqkv_model_state *s, int rank);
/* The state's tensor-parallel ranks (1 when off). */
TQKV_API int         tqkv_model_state_tensor_parallel(const tqkv_model_state *s);

/* ------------------------------------------------------------------------- */
/* Forward                                                                    */
/* ------------------------------------------------------------------------- */

typedef enum {
    TQKV_LOGITS_NONE = 0, /* logits may be NULL */
    TQKV_LOGITS_LAST,     /* logits [rows, vocab]: each row's last token */
    TQKV_LOGITS_ALL       /* logits [rows, n, vocab]: every position (padding rows zero) */
} tqkv_logits_mode;

/* Left-padded batched prefill; every row must be empty. tokens [rows, n]: row r's
 * lengths[r] tokens are its LAST lengths[r] entries (the first n - lengths[r] are ignored);
 * lengths NULL means all n. Positions start at 0 for every row. */
TQKV_API tqkv_status tqkv_model_prefill(const tqkv_model *m, tqkv_model_state *s,
                                        const int32_t *tokens, const int *lengths, int n,
                                        tqkv_logits_mode mode, float *logits);
/* Window append of n tokens to every row (rows may already hold tokens): tokens [rows, n],
 * RoPE positions offset[r] .. offset[r] + n - 1. */
TQKV_API tqkv_status tqkv_model_extend(const tqkv_model *m, tqkv_model_state *s,
                                       const int32_t *tokens, int n, tqkv_logits_mode mode,
                                       float *logits);
/* One token per row: tokens [rows], logits [rows, vocab]. */
TQKV_API tqkv_status tqkv_model_decode(const tqkv_model *m, tqkv_model_state *s,
                                       const int32_t *tokens, float *logits);

/* ------------------------------------------------------------------------- */
/* Row operations (src/model/state/rows.c): a state whose rows change between  */
/* forward calls. Each changes every layer or, on failure, none.              */
/* ------------------------------------------------------------------------- */

/* Largest number of tokens a row may hold (max_position_embeddings); forward calls that
 * would go past it fail with TQKV_ERANGE. */
TQKV_API int         tqkv_model_context_len(const tqkv_model *m);
/* Every layer holds the state's rows with the same positions and spec round (a sliding
 * layer may hold fewer: min(position, window + slack) up to the position; recurrent rows
 * count the same tokens): TQKV_OK, else TQKV_ESTATE naming the layer. */
TQKV_API tqkv_status tqkv_model_state_check(const tqkv_model_state *s);
/* Append the rows of src[0..n_src) (states of the same model, cache parameters and
 * tensor_parallel, not in a spec round) after s's rows, copying encoded bytes; sources are
 * unchanged. With tensor_parallel > 1 this and every row operation below act on every
 * rank's caches in lockstep (each rank changes, or on failure none). */
TQKV_API tqkv_status tqkv_model_state_merge(tqkv_model_state *s, tqkv_model_state *const *src,
                                            int n_src);
/* Keep rows keep[0..n_keep) in that order (n_keep may be 0: a state with no rows, which
 * only merge may grow again). */
TQKV_API tqkv_status tqkv_model_state_filter(tqkv_model_state *s, const int *keep, int n_keep);
/* A new 1-row state (same parameters) holding a copy of row `row`. Inserting a row back is
 * tqkv_model_state_merge with that state. */
TQKV_API tqkv_status tqkv_model_state_extract_row(const tqkv_model_state *s, int row,
                                                  tqkv_model_state **out);
/* Speculative rounds over every layer: rollback keeps keep[r] tokens appended since begin
 * (n_keep 1: the same for all rows) and ends the round; commit keeps everything. */
TQKV_API tqkv_status tqkv_model_state_spec_begin(tqkv_model_state *s);
TQKV_API tqkv_status tqkv_model_state_spec_commit(tqkv_model_state *s);
TQKV_API tqkv_status tqkv_model_state_spec_rollback(tqkv_model_state *s, const int *keep,
                                                    int n_keep);
TQKV_API int         tqkv_model_state_spec_active(const tqkv_model_state *s);
/* Bytes one row holding `tokens` tokens takes over all layers: sliding layers count at most
 * window + slack tokens, KV-shared layers nothing, plus the fixed recurrent bytes per row. */
TQKV_API size_t      tqkv_model_state_projected_bytes(const tqkv_model_state *s, int tokens);
/* The same when speculative rounds of up to draft_tokens drafted tokens run on the state
 * between forwards: a round can hold draft_tokens + 1 tokens beyond what a bounded layer
 * keeps (draft_tokens 0: tqkv_model_state_projected_bytes). */
TQKV_API size_t      tqkv_model_state_projected_bytes_spec(const tqkv_model_state *s, int tokens,
                                                           int draft_tokens);
/* Smallest prefix of row `row` reusable with bytes identical to a fresh prefill (max over
 * layers of tqkv_batch_min_reusable_offset; position + 1, i.e. none, once a sliding layer
 * has dropped tokens; at least the position on hybrid graphs, whose recurrent rows cannot be
 * trimmed). */
TQKV_API int         tqkv_model_state_min_reusable_offset(const tqkv_model_state *s, int row);
/* Export every layer of a state (not in a spec round): "TQKVMS02" header, layer count, each
 * layer's tqkv_batch_export (length 0 for KV-shared and recurrent layers), then the
 * recurrent rows (docs/ENGINE.md). Import also reads "TQKVMS01". *out malloc'd. A state of
 * tensor_parallel N > 1 exports "TQKVTP01", N, rows, then each rank's export (docs/TP.md),
 * which imports only with the same tensor_parallel N (an unsharded export only without). */
TQKV_API tqkv_status tqkv_model_state_export(const tqkv_model_state *s, uint8_t **out,
                                             size_t *len);
/* Rebuild a state of model m from an export; p gives threads/kernels and the cache
 * parameters the export must match (formats, window, slack, seed: else TQKV_EINVAL with
 * what differs). */
TQKV_API tqkv_status tqkv_model_state_import(tqkv_model_state **out, const tqkv_model *m,
                                             const tqkv_model_state_params *p,
                                             const uint8_t *buf, size_t len);

/* ------------------------------------------------------------------------- */
/* Sampling                                                                   */
/* ------------------------------------------------------------------------- */
/*
 * Pipeline (HF order): repetition penalty over the history (logit > 0 ? /r : *r), then
 * OpenAI's penalties over the tokens accepted after tqkv_sampler_mark_prompt_end (logit -=
 * frequency_penalty * count + presence_penalty * (count > 0)), then logit_bias (logit +=
 * bias), then the constraint (constrain), then
 * temperature 0 -> argmax (lowest id on ties); else logits / T, top-k, softmax, top-p
 * (smallest prefix of the sorted distribution with mass >= p), min-p (p_i >= min_p * p_max),
 * renormalize, draw with the sampler's own RNG (xoshiro256**, seeded; no global state).
 */
typedef struct {
    float    temperature;        /* 0 = greedy */
    int      top_k;              /* 0 = off */
    float    top_p;              /* 1 = off */
    float    min_p;              /* 0 = off */
    float    repetition_penalty; /* 1 = off */
    int      penalty_last_n;     /* history tokens penalized; 0 = all (HF) */
    uint64_t seed;
    float    frequency_penalty;  /* OpenAI, finite; 0 = off */
    float    presence_penalty;   /* OpenAI, finite; 0 = off */
    const int32_t *bias_ids;     /* [n_bias] logit_bias: distinct ids in the vocab (copied
                                    by tqkv_sampler_init) */
    const float   *bias_vals;    /* [n_bias] finite biases added to those logits */
    int      n_bias;
    /* constrained decoding: called with each row's logits [vocab] after logit_bias, before
     * the pick; sets the logits of tokens that may not come next to -inf (NULL = none).
     * Such rows are always picked from the whole row on the host. */
    void   (*constrain)(void *ctx, float *logits, int vocab);
    void    *constrain_ctx;
} tqkv_sampler_params;

typedef struct tqkv_sampler tqkv_sampler;

TQKV_API tqkv_sampler_params tqkv_sampler_params_default(void); /* greedy, seed 0 */
TQKV_API tqkv_status tqkv_sampler_init(tqkv_sampler **out, const tqkv_sampler_params *p, int vocab);
TQKV_API void        tqkv_sampler_free(tqkv_sampler *s);
/* Forget the history and reseed. */
TQKV_API void        tqkv_sampler_reset(tqkv_sampler *s, uint64_t seed);
/* Add a token to the history (prompt and generated tokens) used by the penalty. */
TQKV_API tqkv_status tqkv_sampler_accept(tqkv_sampler *s, int token);
/* The history so far is the prompt: frequency and presence penalties count only the
 * tokens accepted after this call (without it, the whole history). */
TQKV_API void        tqkv_sampler_mark_prompt_end(tqkv_sampler *s);
/* 1 when the sampler reads its history (a penalty is on): the caller must accept the
 * tokens it generates. */
TQKV_API int         tqkv_sampler_needs_history(const tqkv_sampler *s);
/* Pick a token from logits [vocab] (the array is used as scratch and modified).
 * Sampling (temperature > 0) fails with TQKV_EINVAL on NaN / +inf logits. */
TQKV_API tqkv_status tqkv_sampler_sample(tqkv_sampler *s, float *logits, int *token);

/* ------------------------------------------------------------------------- */
/* Decode and pick: one decode step, then each row's next token                */
/* ------------------------------------------------------------------------- */
/*
 * tokens [rows] as tqkv_model_decode; samplers [rows] (the array may be NULL, and so may an
 * entry: greedy, no penalty); next [rows] gets each row's token: the one
 * tqkv_sampler_sample would pick from that row's logits of the step (the same history,
 * parameters and RNG draws). It does not call tqkv_sampler_accept: the caller still adds the
 * token to the history. CPU states decode into internal scratch and run the CPU sampler.
 * Device states pick on the GPU where that gives the same token (docs/CUDA.md, "Picking on
 * the device"): greedy rows and rows with temperature > 0 and 0 < top_k <= 1024 (and
 * top_k < vocab) return one token or top_k candidates instead of vocab logits; other rows
 * (top_k off or larger) bring their full rows back and run the CPU sampler.
 * Errors before the step (NULL arguments, a sampler of another vocab, and every error of
 * tqkv_model_decode) leave the state unchanged. Once the step has run the call returns
 * TQKV_OK; a row whose logits allow no pick (the sampler's TQKV_EINVAL: NaN / inf logits,
 * or nothing above -inf) gets next[r] = -1, with that error in tqkv_last_error() (the last
 * failed row's, when several fail). Logprobs need the raw logits: use tqkv_model_decode and
 * the sampler for those rows.
 */
TQKV_API tqkv_status tqkv_model_decode_pick(const tqkv_model *m, tqkv_model_state *s,
                                            const int32_t *tokens, tqkv_sampler *const *samplers,
                                            int32_t *next);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_MODEL_H */

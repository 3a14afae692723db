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
    TQKV_ARCH_LLAMA      /* LlamaForCausalLM: attention_bias flag (q/k/v/o bias) */
} tqkv_arch;

typedef enum {
    TQKV_ROPE_DEFAULT = 0,
    TQKV_ROPE_LINEAR, /* positions / factor */
    TQKV_ROPE_LLAMA3  /* Llama 3.x frequency-dependent scaling */
} tqkv_rope_type;

#define TQKV_MAX_EOS 8

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
                           weight; prefill matmuls ~1.6x slower, same bits) */
} tqkv_model_load_params;

tqkv_model_load_params tqkv_model_load_params_default(void);

/* dir holds config.json, model.safetensors or model.safetensors.index.json + shards,
 * optionally generation_config.json. Errors name the file or tensor at fault. */
tqkv_status tqkv_model_load(tqkv_model **out, const char *dir, const tqkv_model_load_params *p);
void        tqkv_model_free(tqkv_model *m);
const tqkv_model_config     *tqkv_model_get_config(const tqkv_model *m);
const tqkv_generation_config *tqkv_model_get_generation(const tqkv_model *m);
int         tqkv_model_is_eos(const tqkv_model *m, int token);
/* Bytes of weights the forward pass reads per token (matrices + embedding row + lm_head). */
size_t      tqkv_model_weight_bytes(const tqkv_model *m);
/* Parameter count (elements of all tensors used). */
size_t      tqkv_model_params(const tqkv_model *m);
/* "bf16", "f16", "f32" or "mixed": the element type of the matrices as read by matmul. */
const char *tqkv_model_weight_type(const tqkv_model *m);

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
    int         extend_as_decode; /* extend with n > 1 attends each query like a decode
                                   (decode kernel, own causal end): logits bitwise equal to
                                   n single-token decodes when window == 0 (speculative
                                   verification); default 0 */
} tqkv_model_state_params;

/* rows 1, f32/f32, window 0 (slack 32), seed 0, threads 1, prefill deferred, decode fused. */
tqkv_model_state_params tqkv_model_state_params_default(void);

tqkv_status tqkv_model_state_init(tqkv_model_state **out, const tqkv_model *m,
                                  const tqkv_model_state_params *p);
void        tqkv_model_state_free(tqkv_model_state *s);
/* Empty every layer's cache; rows > 0 changes the row count. */
tqkv_status tqkv_model_state_reset(tqkv_model_state *s, int rows);
int         tqkv_model_state_rows(const tqkv_model_state *s);
tqkv_status tqkv_model_state_set_threads(tqkv_model_state *s, int threads);
/* Tokens held per row (the next RoPE position of each row). offset: [rows] */
tqkv_status tqkv_model_state_offsets(const tqkv_model_state *s, int *offset);
/* The cache of one layer (for schedulers: merge/filter/export). Rows of every layer must
 * stay consistent (same offsets and padding) between forward calls. */
tqkv_batch *tqkv_model_state_layer(tqkv_model_state *s, int layer);
/* KV bytes per token over all layers (K and V, main planes + window). */
double      tqkv_model_state_kv_bytes_per_token(const tqkv_model_state *s);
/* Bits per stored K/V value, averaged over K and V (window excluded). */
double      tqkv_model_state_kv_bits_per_value(const tqkv_model_state *s);
/* Bytes the caches hold now. */
size_t      tqkv_model_state_kv_bytes_used(const tqkv_model_state *s);

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
tqkv_status tqkv_model_prefill(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                               const int *lengths, int n, tqkv_logits_mode mode, float *logits);
/* Window append of n tokens to every row (rows may already hold tokens): tokens [rows, n],
 * RoPE positions offset[r] .. offset[r] + n - 1. */
tqkv_status tqkv_model_extend(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              int n, tqkv_logits_mode mode, float *logits);
/* One token per row: tokens [rows], logits [rows, vocab]. */
tqkv_status tqkv_model_decode(const tqkv_model *m, tqkv_model_state *s, const int32_t *tokens,
                              float *logits);

/* ------------------------------------------------------------------------- */
/* Row operations (src/model/state_rows.c): a state whose rows change between  */
/* forward calls. Each changes every layer or, on failure, none.              */
/* ------------------------------------------------------------------------- */

/* Largest number of tokens a row may hold (max_position_embeddings); forward calls that
 * would go past it fail with TQKV_ERANGE. */
TQKV_API int         tqkv_model_context_len(const tqkv_model *m);
/* Every layer holds the state's rows with the same offsets and spec round: TQKV_OK, else
 * TQKV_ESTATE naming the layer. */
TQKV_API tqkv_status tqkv_model_state_check(const tqkv_model_state *s);
/* Append the rows of src[0..n_src) (states of the same model and cache parameters, not in
 * a spec round) after s's rows, copying encoded bytes; sources are unchanged. */
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
/* Bytes one row holding `tokens` tokens takes over all layers. */
TQKV_API size_t      tqkv_model_state_projected_bytes(const tqkv_model_state *s, int tokens);
/* Smallest prefix of row `row` reusable with bytes identical to a fresh prefill (max over
 * layers of tqkv_batch_min_reusable_offset). */
TQKV_API int         tqkv_model_state_min_reusable_offset(const tqkv_model_state *s, int row);
/* Export every layer of a state (not in a spec round): "TQKVMS" header, layer count, then
 * each layer's tqkv_batch_export. *out malloc'd. */
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
} tqkv_sampler_params;

typedef struct tqkv_sampler tqkv_sampler;

tqkv_sampler_params tqkv_sampler_params_default(void); /* greedy, seed 0 */
tqkv_status tqkv_sampler_init(tqkv_sampler **out, const tqkv_sampler_params *p, int vocab);
void        tqkv_sampler_free(tqkv_sampler *s);
/* Forget the history and reseed. */
void        tqkv_sampler_reset(tqkv_sampler *s, uint64_t seed);
/* Add a token to the history (prompt and generated tokens) used by the penalty. */
tqkv_status tqkv_sampler_accept(tqkv_sampler *s, int token);
/* Pick a token from logits [vocab] (the array is used as scratch and modified).
 * Sampling (temperature > 0) fails with TQKV_EINVAL on NaN / +inf logits. */
tqkv_status tqkv_sampler_sample(tqkv_sampler *s, float *logits, int *token);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_MODEL_H */

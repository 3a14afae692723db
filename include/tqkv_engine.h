/*
 * tqkv_engine.h - public API of the serving engine: continuous batching of generation
 * requests over one model state whose rows are the running requests, on the batched
 * compressed KV cache.
 *
 * Owns: the scheduler (queue, admission by KV budget, chunked prefill of newcomers,
 * merge into the running batch, decode steps, filter of finished rows), per-request
 * sampling, stop strings and EOS, batched speculative decoding with a draft model, and
 * the prefix cache of compressed rows (in memory, optionally persisted to a directory).
 * Must not: speak HTTP or JSON, render chat templates (callers pass token ids), print.
 *
 * Threading: tqkv_engine_submit / _cancel / _stats / _drain are thread-safe. Either
 * call tqkv_engine_start() once (steps run on an engine thread) or drive the engine
 * with tqkv_engine_step() from one thread (tests, the CLI); not both.
 *
 * Determinism (product rule): a greedy request, or a sampled one with a seed, yields
 * the same tokens whether it runs alone or beside any other requests, with or without
 * a draft model, on a prefix-cache hit or a miss.
 *
 * Every call returns a tqkv_status with the message in tqkv_last_error(); a failing
 * call changes nothing.
 */
#ifndef TQKV_ENGINE_H
#define TQKV_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"
#include "tqkv_model.h"
#include "tqkv_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Engine parameters                                                          */
/* ------------------------------------------------------------------------- */

typedef struct {
    const char *model_dir;        /* required: HF checkpoint directory */
    const char *draft_dir;        /* draft model for speculation; NULL = none */
    int         draft_tokens;     /* K tokens drafted per round (default 4) */
    tqkv_format k_format;         /* default tq4 */
    tqkv_format v_format;         /* default tq4 */
    int         window;           /* q8 recent window (0 = off) */
    int         parallel;         /* most rows decoding at once (default 16) */
    size_t      kv_budget;        /* bytes of KV (plus per-row state) for running rows and
                                     their projected growth; 0 = default (documented in
                                     the implementation: a fraction of physical RAM; on the
                                     device 80% of the memory free after the weights). On
                                     the device it also bounds the caches' storage at its
                                     peak (padding, growth, a merge's old and new copies) */
    int         queue_max;        /* requests waiting for admission; past it submit
                                     returns TQKV_EBUSY (default 256) */
    int         threads;          /* compute threads (default 1) */
    int         prefill_chunk;    /* a prompt is prefilled in chunks of this many tokens, at
                                     fixed multiples of it (0 = the default: 256 on the CPU,
                                     2048 on the device, where each chunk is one GPU pass;
                                     it is part of what a request computes, so of the
                                     prefix cache's key) */
    int         prefill_step;     /* prompt tokens prefilled per scheduler step, in whole
                                     chunks, oldest newcomer first, before the running rows'
                                     decode step: bounds the step time of running rows
                                     (TPOT) against the newcomers' TTFT. It never changes a
                                     token (the chunks are the same). A draft model's
                                     prompt goes in the same chunks, within the same
                                     budget (its catch-up chunks after a prefix-cache
                                     hit count too). 0 = the default: one
                                     chunk on the CPU; on the device whole chunks of about
                                     4096 tokens (2 of 2048, 16 of 256), at least one,
                                     where a decode step of many rows costs about as much
                                     as 4096 prompt tokens */
    size_t      prefix_cache_bytes; /* in-memory prefix cache budget; 0 = off */
    const char *prompt_cache_dir; /* persist prefix-cache entries here (state export
                                     format); NULL = memory only */
    int         verbose;          /* progress lines on stderr */
    int         device;           /* 0 = CPU; 1 = CUDA (docs/CUDA.md): weights, caches and
                                     the forward on the GPU (the draft model too; a
                                     prompt_cache_dir needs tq4 / tq3 KV there; at most
                                     1024 rows: parallel <= 1024); kv_budget 0 = 80% of the
                                     device memory free once the weights are uploaded */
    int         bf16_act;         /* CPU matrices with bf16 activations (AVX512_BF16 dot
                                     products): tqkv_model_load_params.bf16_act (default 0:
                                     the exact f32 path; tqkv serve turns it on unless
                                     --exact) */
    /* Optional: called once the model is loaded, with the running rows' state params
     * (k_format / v_format / window above already applied; device set): it may change
     * the KV part of them (formats, per-layer formats layer_k / layer_v, window,
     * window_slack) for this model, e.g. to resolve a `--kv auto:B` preset. Its failure
     * (a status with a message) fails tqkv_engine_init. NULL: none. */
    tqkv_status (*kv_setup)(const tqkv_model *m, tqkv_model_state_params *sp, void *user);
    void       *kv_setup_user;
    int         tensor_parallel;  /* the running rows' (and prefix cache's) states sharded
                                     over N ranks (tqkv_model_state_params.tensor_parallel,
                                     docs/TP.md; the CPU or the device); 0 or 1 = off. */
    int         draft_tensor_parallel; /* the draft model's states sharded over N ranks:
                                     0 or 1 (the default) = unsharded (on the device: on
                                     GPU 0, beside rank 0); N in 2..8 = N ranks (rank r on
                                     GPU r % visible GPUs, as the target's); -1 = the
                                     target's tensor_parallel. The draft's heads and MLP
                                     width must split over N (else tqkv_engine_init fails
                                     naming the draft). Unused without a draft model (a value
                                     outside -1..8 is refused all the same). */
} tqkv_engine_params;

TQKV_API tqkv_engine_params tqkv_engine_params_default(void);

typedef struct tqkv_engine tqkv_engine;

/* Loads the model (and draft) and its tokenizer. */
TQKV_API tqkv_status tqkv_engine_init(tqkv_engine **out, const tqkv_engine_params *p);
/* Stops the engine thread if any; requests still open get a final CANCELLED event. */
TQKV_API void        tqkv_engine_free(tqkv_engine *e);

TQKV_API const tqkv_model     *tqkv_engine_model(const tqkv_engine *e);
TQKV_API const tqkv_tokenizer *tqkv_engine_tokenizer(const tqkv_engine *e);
/* Largest prompt + generated tokens a request may reach (max_position_embeddings). */
TQKV_API int                   tqkv_engine_context_len(const tqkv_engine *e);
/* Model name for /v1/models: the checkpoint directory's last path component. */
TQKV_API const char           *tqkv_engine_model_name(const tqkv_engine *e);

/* ------------------------------------------------------------------------- */
/* Requests and their events                                                  */
/* ------------------------------------------------------------------------- */

typedef enum {
    TQKV_FINISH_NONE = 0,  /* not finished (a token event) */
    TQKV_FINISH_STOP,      /* EOS or a stop string */
    TQKV_FINISH_LENGTH,    /* max_tokens or the context limit */
    TQKV_FINISH_CANCELLED, /* tqkv_engine_cancel, or engine freed */
    TQKV_FINISH_ERROR      /* see event.error */
} tqkv_finish_reason;

#define TQKV_MAX_TOP_LOGPROBS 20

/* One event per generated token, then one final event (done = 1). The final event may
 * carry the last token too (token >= 0) or none (token = -1). Pointers in an event are
 * valid only during the callback. */
typedef struct {
    int32_t            token;         /* generated token id, or -1 */
    const char        *text;          /* UTF-8 released with this event (may be empty:
                                         held back for stop-string matching or an
                                         incomplete character); never includes a stop
                                         string; concatenated over events = the output */
    size_t             text_len;
    float              logprob;       /* log-softmax of the model's raw logits at token */
    int                n_top;         /* entries in top_ids / top_logprobs */
    const int32_t     *top_ids;       /* [n_top] most likely tokens, best first */
    const float       *top_logprobs;  /* [n_top] */
    int                done;          /* 1 on the last event */
    tqkv_finish_reason finish;        /* set when done */
    const char        *error;         /* message when finish == TQKV_FINISH_ERROR */
    int                prompt_tokens;
    int                completion_tokens;
    int                cached_tokens; /* prompt tokens served from the prefix cache */
    int                index;         /* the choice, in [0, n) of the request */
} tqkv_engine_event;

/* Called on the engine's thread; must return quickly and must not call the engine
 * except tqkv_engine_cancel. */
typedef void (*tqkv_engine_event_fn)(void *user, uint64_t id, const tqkv_engine_event *ev);

typedef struct {
    const int32_t      *prompt;       /* [n_prompt] token ids, n_prompt >= 1 (copied) */
    int                 n_prompt;
    int                 max_tokens;   /* >= 1 */
    tqkv_sampler_params sampling;     /* temperature 0 = greedy; seed used when sampling */
    const char *const  *stop;         /* [n_stop] stop strings (copied), n_stop <= 16 */
    int                 n_stop;
    int                 ignore_eos;
    int                 top_logprobs; /* -1 = no logprobs; 0..TQKV_MAX_TOP_LOGPROBS */
    tqkv_engine_event_fn on_event;    /* required */
    void               *user;
    int                 n;            /* choices (0 = 1), at most parallel and
                                         TQKV_ENGINE_MAX_CHOICES: the prompt is prefilled once
                                         and its row copied into n rows; choice i samples
                                         with seed + i; each choice sends its own events
                                         (event.index) and its own final event; cancel
                                         ends them all */
    int                 json_object;  /* 1: the output is constrained to one JSON object
                                         (OpenAI's response_format json_object): tokens
                                         that cannot continue it are masked, EOS only
                                         once it is closed; max_tokens can still cut it */
    const char         *json_schema;  /* non-NULL: constrained to this JSON Schema (strict
                                         subset, src/engine/json_schema.h; an unsupported
                                         keyword: TQKV_EINVAL "json schema: ..."); implies
                                         json_object */
} tqkv_engine_request;

#define TQKV_ENGINE_MAX_CHOICES 16

/* Queue a request. TQKV_EINVAL: bad field (message names it). TQKV_ERANGE: n_prompt +
 * max_tokens exceeds tqkv_engine_context_len (message gives both). TQKV_EBUSY: the wait
 * queue is full. TQKV_ESTATE: draining. On success *id identifies the request and
 * events will follow (possibly before this call returns when the engine is threaded). */
TQKV_API tqkv_status tqkv_engine_submit(tqkv_engine *e, const tqkv_engine_request *r,
                                        uint64_t *id);
/* The request's row is freed at the next step; its final event has FINISH_CANCELLED.
 * Unknown or finished id: TQKV_EINVAL. */
TQKV_API tqkv_status tqkv_engine_cancel(tqkv_engine *e, uint64_t id);

/* ------------------------------------------------------------------------- */
/* Driving the engine                                                         */
/* ------------------------------------------------------------------------- */

/* One scheduler step on the calling thread: admit, prefill a chunk, decode (or run a
 * speculative round), emit events, retire. *busy = 1 while requests remain. */
TQKV_API tqkv_status tqkv_engine_step(tqkv_engine *e, int *busy);
/* Run steps on an engine thread until drained or freed. */
TQKV_API tqkv_status tqkv_engine_start(tqkv_engine *e);
/* Stop admission (submit -> TQKV_ESTATE), then block until every queued and running
 * request has finished. */
TQKV_API tqkv_status tqkv_engine_drain(tqkv_engine *e);

/* ------------------------------------------------------------------------- */
/* Statistics (for /metrics)                                                  */
/* ------------------------------------------------------------------------- */

/* Latency histogram bucket upper bounds in seconds (Prometheus "le"), +Inf implied. */
#define TQKV_ENGINE_LAT_BUCKETS 12
TQKV_API const double *tqkv_engine_latency_buckets(void); /* [TQKV_ENGINE_LAT_BUCKETS] */

typedef struct {
    uint64_t count;                                /* observations */
    double   sum;                                  /* seconds */
    uint64_t bucket[TQKV_ENGINE_LAT_BUCKETS + 1];  /* cumulative counts, last = +Inf */
} tqkv_engine_histogram;

typedef struct {
    uint64_t requests_finished[TQKV_FINISH_ERROR + 1]; /* by finish reason */
    uint64_t prompt_tokens;        /* prompt tokens of admitted requests */
    uint64_t prefill_tokens;       /* prompt tokens run through the model (prefix-cache
                                      hits and the shared prompt of n > 1 excluded) */
    uint64_t generated_tokens;
    int      running;              /* rows in the batch */
    int      queued;               /* requests waiting */
    size_t   kv_bytes_used;        /* bytes the running rows' caches hold now */
    size_t   kv_budget;
    double   kv_bytes_per_token;   /* over all layers, K and V */
    uint64_t prefix_hits, prefix_misses;
    uint64_t prefix_tokens_reused;
    size_t   prefix_cache_bytes;   /* held by the prefix cache now */
    uint64_t spec_rounds;
    uint64_t spec_drafted;         /* draft tokens proposed */
    uint64_t spec_accepted;        /* of which the target accepted */
    tqkv_engine_histogram ttft;    /* submit -> first token */
    tqkv_engine_histogram itl;     /* between consecutive tokens of a request */
    uint64_t prompt_cache_refused; /* prompt-cache files refused (wrong model, weights or KV
                                      spec, checksum, not a regular file, over the cap) */
    size_t   kv_bytes_allocated;   /* storage the running and prefilling rows' caches occupy
                                      (padding and spare columns included; >= kv_bytes_used;
                                      device states: their device storage);
                                      admission also waits while this + a newcomer's
                                      projection exceeds kv_budget */
    uint64_t draft_prefill_tokens; /* prompt tokens run through the draft model (its chunks
                                      go with the target's, within prefill_step; after a
                                      prefix-cache hit it also runs the reused tokens) */
    /* Where the scheduler's steps spend their time (wall clock; every forward waits for
     * its device work, so each part holds its own): */
    uint64_t steps;                /* tqkv_engine_step calls that found work */
    uint64_t decode_steps;         /* steps that decoded (or ran a spec round on) the rows */
    uint64_t decode_rows;          /* live rows summed over decode steps (mean batch =
                                      decode_rows / decode_steps) */
    double   prefill_seconds;      /* prompt chunks (target and draft) */
    double   decode_seconds;       /* decode steps and spec rounds of the running rows */
    double   merge_seconds;        /* joining prefilled rows to the running batch */
} tqkv_engine_stats;

TQKV_API tqkv_status tqkv_engine_stats_get(tqkv_engine *e, tqkv_engine_stats *out);

/* ------------------------------------------------------------------------- */
/* Prompt cache files (added by branch engine)                                */
/* ------------------------------------------------------------------------- */

/* Load one prompt-cache file (DIR/<hash>-<n>.tqkvp, written by an engine with
 * prompt_cache_dir) into the prefix cache. A file from another model, other weights
 * (entries are keyed by the content of the model's files) or another KV format is refused
 * with TQKV_EINVAL and a message naming both; a file that is not a regular file (symlink,
 * FIFO, device), is over the size cap, or whose checksum over tokens and state fails is
 * refused with TQKV_ECORRUPT. Init loads every file of prompt_cache_dir this way and skips
 * refused ones, each reported on stderr and counted in prompt_cache_refused. */
TQKV_API tqkv_status tqkv_engine_prefix_import(tqkv_engine *e, const char *path);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_ENGINE_H */

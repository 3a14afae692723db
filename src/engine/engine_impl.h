/*
 * engine_impl.h - internal layout of the serving engine (src/engine only).
 * Owns: the request record, the engine struct, the prefix cache interface.
 * Must not: be included outside src/engine and its tests.
 */
#ifndef TQKV_ENGINE_IMPL_H
#define TQKV_ENGINE_IMPL_H

#include <pthread.h>

#include "engine/json_schema.h"
#include "tqkv_engine.h"

// ---------------------------------------------------------------------------
// Prefix cache (prefix.c): 1-row model states keyed by their token prefix
// ---------------------------------------------------------------------------

typedef struct {
    int32_t          *tokens;  /* [n] */
    int               n;
    tqkv_model_state *st;      /* 1 row holding exactly tokens[0..n) */
    size_t            bytes;
    uint64_t          used;    /* LRU clock */
    uint64_t          hash;
} prefix_entry;

typedef struct {
    prefix_entry *e;           /* [n] */
    int           n, cap;
    size_t        bytes, budget;
    uint64_t      clock;
    char         *dir;         /* persisted entries (NULL: memory only) */
    uint64_t      fingerprint; /* model + KV parameters */
    char          desc[256];   /* "model qwen3-code-28m, kv tq4/tq4, window 0" for messages */
    int           model_keyed; /* fingerprint includes the model files' content key */
    uint64_t      refused;     /* prompt-cache files refused (stats, /metrics) */
} prefix_cache;

tqkv_status prefix_init(prefix_cache *pc, size_t budget, const char *dir, uint64_t fingerprint,
                        const char *desc);
void        prefix_free(prefix_cache *pc);
/* Longest entry whose tokens are a prefix of tokens[0..n) with length <= max_len; NULL. */
prefix_entry *prefix_lookup(prefix_cache *pc, const int32_t *tokens, int n, int max_len);
/* Store a copy of row 0 of st (which holds tokens[0..n)); evicts LRU entries to fit.
 * Persists to dir when set. Returns TQKV_OK also when the entry does not fit. */
tqkv_status prefix_insert(prefix_cache *pc, const int32_t *tokens, int n,
                          const tqkv_model_state *st);
/* Fold the content key of the model directory (prefix_file.c) into the fingerprint, once;
 * needed before any file is written or read. */
tqkv_status prefix_key_model(prefix_cache *pc, const char *model_dir, int verbose);
/* Load one persisted entry file (refuses another model/format with a message). */
tqkv_status prefix_load_file(prefix_cache *pc, const tqkv_model *m,
                             const tqkv_model_state_params *sp, const char *path);
/* Load every *.tqkvp file of pc->dir; each refused file is reported on stderr (the first
 * 16 by name, then a count) and counted in pc->refused. */
void        prefix_load_dir(prefix_cache *pc, const tqkv_model *m,
                            const tqkv_model_state_params *sp, int verbose);

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

typedef enum { REQ_QUEUED = 0, REQ_PREFILL, REQ_RUNNING, REQ_DONE } req_phase;

typedef struct eng_req {
    uint64_t              id;
    req_phase             phase;
    int32_t              *prompt;       /* [n_prompt] */
    int                   n_prompt;
    int                   max_tokens;
    tqkv_sampler_params   sp;
    tqkv_sampler         *sampler;
    char                **stop;         /* [n_stop] */
    int                   n_stop;
    int                   ignore_eos;
    int                   top_logprobs;
    tqkv_engine_event_fn  fn;
    void                 *user;
    int32_t              *bias_ids;     /* [sp.n_bias] logit_bias (own copies) */
    float                *bias_vals;
    int                   n_choices;    /* n of the request (1 = plain) */
    int                   index;        /* this row's choice */
    int                   forked;       /* the other choices exist (engine_fork.c) */
    js_schema            *js;           /* JSON constraint (json_object / json_schema), or NULL */
    js_state              jst;          /* its automaton after the generated tokens */
    const jg_vocab       *jv;           /* the engine's vocabulary trie */
    int                   cancel;       /* set by tqkv_engine_cancel (under the lock) */
    size_t                reserved;     /* budget bytes held while admitted */
    /* prefill */
    tqkv_model_state     *pre;          /* 1-row target state while prefilling */
    tqkv_model_state     *dpre;         /* 1-row draft state */
    int                   pre_spare;    /* pre came from engine_pre_take (psp, recyclable) */
    int                   prefilled;    /* prompt tokens in pre */
    int                   dprefilled;   /* prompt tokens in dpre (== prefilled, but behind
                                           it after a prefix-cache hit until it catches up) */
    int                   cached;       /* prompt tokens from the prefix cache */
    /* generation */
    int                   n_gen;        /* tokens generated (emitted or not) */
    int32_t               last;         /* newest generated token, not yet in the cache */
    int                   finished;     /* final event sent */
    tqkv_decode_stream   *ds;
    char                 *out;          /* text decoded so far [out_len] */
    size_t                out_len, out_cap, released;
    double                t_submit, t_last;
    struct eng_req       *next;         /* queue link */
} eng_req;

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

#define ENGINE_SCHEMAS 8 /* distinct JSON constraints kept compiled */
#define ENGINE_SPARE_PRE 4 /* emptied prefill states kept between requests */

struct tqkv_engine {
    tqkv_engine_params      p;
    char                   *model_dir, *draft_dir, *name;
    tqkv_model             *m, *dm;
    tqkv_tokenizer         *tok;
    tqkv_model_state_params sp, dsp;      /* running target / draft state parameters */
    tqkv_model_state_params psp;          /* prefill states and prefix entries: sp with
                                             extend_as_decode off (chunks attend like a
                                             plain prefill, with or without a draft) */
    int                     ctx;          /* context limit */
    /* running batch: row i of run (and drun) is rows[i] */
    tqkv_model_state       *run, *drun;
    eng_req               **rows;
    int                     n_rows, cap_rows;
    /* emptied prefill states kept for the next requests (their scratch stays mapped and
       faulted in); freed when the engine goes idle */
    tqkv_model_state       *spare[ENGINE_SPARE_PRE];
    int                     n_spare;
    /* admitted, prefilling (FIFO) */
    eng_req               **pre;
    int                     n_pre, cap_pre;
    /* waiting */
    eng_req                *q_head, *q_tail;
    int                     n_queue;
    size_t                  reserved;     /* budget bytes held by admitted requests */
    uint64_t                next_id;
    /* threading */
    pthread_mutex_t         mu;
    pthread_cond_t          cv_work, cv_idle;
    pthread_t               thread;
    int                     started, stop, draining;
    /* scratch */
    float                  *logits, *dlogits, *tmp;
    size_t                  cap_logits, cap_dlogits;
    float                  *picktmp;      /* [rows, V] the picks' scratch (engine_step_decode) */
    size_t                  cap_picktmp;
    struct eng_pick        *picks;        /* [rows] the picks' results (engine_step_decode) */
    size_t                  cap_picks;
    int32_t                *tokbuf;
    size_t                  cap_tok;
    tqkv_sampler          **smpbuf;       /* [cap_smp] each row's sampler for a decode pick */
    size_t                  cap_smp;
    prefix_cache            pc;
    tqkv_engine_stats       st;
    jg_vocab               *jv;           /* JSON constraint vocabulary (made on first use) */
    /* compiled JSON constraints shared by the requests that ask for the same one (and
     * so their mask caches); under mu. text NULL: json_object */
    struct { char *text; js_schema *js; uint64_t used; } schemas[ENGINE_SCHEMAS];
    uint64_t                schema_clock;
};

// ---------------------------------------------------------------------------
// Request output (engine_request.c)
// ---------------------------------------------------------------------------

/* Logprob of a sampled token and its top alternatives (best first). */
typedef struct {
    float   logprob;
    int     n_top;
    int32_t top_ids[TQKV_MAX_TOP_LOGPROBS];
    float   top_lp[TQKV_MAX_TOP_LOGPROBS];
} tok_info;

/* One row's pick in a raw-logits decode step (engine_step_decode). */
typedef struct eng_pick {
    int32_t     tok;
    tqkv_status rc;
    tok_info    ti;
} eng_pick;

/* Final event with no token (cancel, error); nothing when q already finished. */
void        req_finish_plain(tqkv_engine *e, eng_req *q, tqkv_finish_reason fin, const char *err);
/* Pick the next token of q from raw logits [V] (e->tmp is scratch [V]); fills ti when
 * q asked for logprobs. */
tqkv_status req_pick(tqkv_engine *e, eng_req *q, const float *raw, int32_t *tok, tok_info *ti);
/* The same with tmp [V] as scratch: touches only q (its sampler), so rows may be picked
 * on several threads at once. */
tqkv_status req_pick_with(const tqkv_engine *e, eng_req *q, const float *raw, float *tmp,
                          int32_t *tok, tok_info *ti);
/* Account a generated token: text, stop strings, EOS, limits, and its event. Returns 1
 * when the request finished with this token. */
int         req_take(tqkv_engine *e, eng_req *q, int32_t tok, const tok_info *ti);

// ---------------------------------------------------------------------------
// Choices (engine_fork.c)
// ---------------------------------------------------------------------------

/* q (index 0 of n_choices > 1) has prefilled its prompt: make choices 1..n-1 as rows
 * copied from q->pre (and q->dpre), each with its own sampler (seed + index), pick each
 * one's first token from logits [V] and put them on the prefill list as ready. Budget:
 * each takes its share of q's reservation. A failure finishes those choices with an
 * error event (q goes on). */
void        engine_fork_choices(tqkv_engine *e, eng_req *q, const float *logits);
/* Sampler of q from q->sp (seed given), its prompt history and the generated mark. */
tqkv_status engine_req_sampler(tqkv_engine *e, eng_req *q, uint64_t seed);
void        req_free(eng_req *q);
int         engine_grow_ptrs(void ***a, int *cap, int need);

// ---------------------------------------------------------------------------
// Generation steps (engine_spec.c)
// ---------------------------------------------------------------------------

/* Plain decode step over all running rows. */
tqkv_status engine_step_decode(tqkv_engine *e);
/* Speculative round over all running rows (needs the draft states). */
tqkv_status engine_step_spec(tqkv_engine *e);

// ---------------------------------------------------------------------------
// Helpers (engine.c)
// ---------------------------------------------------------------------------

double engine_now(void);
/* Grow *a [*cap] to at least need floats (contents kept); 0 when out of memory. */
/* *a (room for *cap elements of size bytes) grown to hold need; 0 without memory (*a kept). */
int    engine_grow(void **a, size_t *cap, size_t need, size_t size);
int    engine_grow_floats(float **a, size_t *cap, size_t need);

#endif

/*
 * engine.c - the serving engine's scheduler: a queue of requests, admission by projected
 * KV bytes against a budget, chunked prefill of each newcomer in its own 1-row state,
 * merge into the running batch, batched decode steps or speculative rounds, retirement of
 * finished rows, statistics. The decode step and the speculative round are in
 * engine_spec.c; per-row sampling, stop strings, EOS, logprobs and events in
 * engine_request.c.
 * Owns: struct tqkv_engine's lists and counters, the engine thread.
 * Must not: speak HTTP or JSON, render chat templates, print (except verbose progress).
 *
 * Determinism: every request runs the same sequence of model calls whatever else runs:
 * its prompt in chunks at fixed boundaries (multiples of prefill_chunk) in a 1-row state,
 * then one decode per token (or, with a draft, verification windows whose logits equal
 * single decodes, see tqkv_model_state_params.extend_as_decode). Rows are independent in
 * every kernel (batch invariance), and each request owns its sampler and seed, so its
 * tokens do not depend on the other rows, on the prefix cache, or on the draft.
 *
 * Threading: compute runs on one thread (the engine thread, or the caller of
 * tqkv_engine_step) with params.threads OpenMP threads inside the model calls; the
 * default of 1 thread never spins, so request threads (HTTP) and other processes keep
 * their cores. Events are sent without the lock held.
 *
 * Budget: kv_budget 0 means a quarter of physical RAM. A request reserves
 * projected_bytes(n_prompt + max_tokens) of the target (and draft) state when admitted
 * and releases it when it finishes, so running rows can never outgrow the budget.
 * On the device the budget also bounds the storage really allocated at its peak
 * (device_peak below: padded columns, growth slack, and the old and new running states
 * side by side while a join regrows them), so a request that would not fit waits
 * in the queue instead of failing the running batch with an allocation error.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine_impl.h"
#ifdef TQKV_HAVE_CUDA
#include "cache/cache_cuda.h"
#endif
#include "util/common.h"
#include "util/keep_order.h"

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

double engine_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char *str_dup(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

int engine_grow_ptrs(void ***a, int *cap, int need) {
    if (need <= *cap) return 1;
    int nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    void **n = realloc(*a, sizeof(void *) * (size_t)nc);
    if (!n) return 0;
    *a = n;
    *cap = nc;
    return 1;
}

int engine_grow(void **a, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return 1;
    void *n = realloc(*a, size * need);
    if (!n) return 0;
    *a = n;
    *cap = need;
    return 1;
}

int engine_grow_floats(float **a, size_t *cap, size_t need) {
    return engine_grow((void **)a, cap, need, sizeof(float));
}

static size_t default_budget(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || psz <= 0) return (size_t)1 << 30;
    return (size_t)pages * (size_t)psz / 4;
}

// ---------------------------------------------------------------------------
// Parameters, init, free
// ---------------------------------------------------------------------------

tqkv_engine_params tqkv_engine_params_default(void) {
    tqkv_engine_params p;
    memset(&p, 0, sizeof p);
    p.draft_tokens = 4;
    p.k_format = TQKV_TQ4;
    p.v_format = TQKV_TQ4;
    p.parallel = 16;
    p.queue_max = 256;
    p.threads = 1;
    p.prefill_chunk = 0; /* engine_params_resolve: 256 on the CPU, 2048 on the device */
    return p;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Model + KV parameters: what a persisted prefix entry must match. */
static uint64_t engine_fingerprint(const tqkv_engine *e) {
    const tqkv_model_config *c = tqkv_model_get_config(e->m);
    uint64_t h = 1469598103934665603ull;
    int f[] = {(int)c->arch, c->vocab_size, c->hidden_size, c->intermediate_size, c->n_layers,
               c->n_heads, c->n_kv_heads, c->head_dim, c->max_position_embeddings,
               (int)e->sp.k_format, (int)e->sp.v_format, e->sp.window, e->sp.window_slack,
               (int)e->sp.kv_seed, e->p.prefill_chunk};
    h = fnv(h, f, sizeof f);
    h = fnv(h, &c->rope_theta, sizeof c->rope_theta);
    size_t wb = tqkv_model_params(e->m);
    h = fnv(h, &wb, sizeof wb);
    /* device states hold the GPU forward's K/V (equal to the CPU's only within rounding):
     * entries are not shared across devices (CPU fingerprints are as before) */
    if (e->sp.device) h = fnv(h, "device cuda", 11);
    /* sharded states export per rank (docs/TP.md): their entries are kept apart too */
    if (e->sp.tensor_parallel > 1) h = fnv(h, &e->sp.tensor_parallel, sizeof e->sp.tensor_parallel);
    int per_layer = 0; /* per-layer formats (a preset's): hashed only when set, so plain
                          configurations keep their fingerprints */
    for (size_t l = 0; l < sizeof e->sp.layer_k; l++) per_layer |= e->sp.layer_k[l] | e->sp.layer_v[l];
    if (per_layer) {
        h = fnv(h, e->sp.layer_k, sizeof e->sp.layer_k);
        h = fnv(h, e->sp.layer_v, sizeof e->sp.layer_v);
    }
    return fnv(h, e->name, strlen(e->name));
}

static void engine_spares_free(tqkv_engine *e) {
    for (int i = 0; i < e->n_spare; i++) tqkv_model_state_free(e->spare[i]);
    e->n_spare = 0;
}

static void engine_release(tqkv_engine *e) {
    engine_spares_free(e);
    tqkv_model_state_free(e->run);
    tqkv_model_state_free(e->drun);
    prefix_free(&e->pc); /* its states refer to the model */
    jg_vocab_free(e->jv);
    for (int i = 0; i < ENGINE_SCHEMAS; i++) {
        js_free(e->schemas[i].js);
        free(e->schemas[i].text);
    }
    tqkv_model_free(e->m);
    tqkv_model_free(e->dm);
    tqkv_tokenizer_free(e->tok);
    free(e->rows);
    free(e->pre);
    free(e->logits);
    free(e->picktmp);
    free(e->picks);
    free(e->dlogits);
    free(e->tmp);
    free(e->tokbuf);
    free(e->smpbuf);
    free(e->model_dir);
    free(e->draft_dir);
    free(e->name);
    free(e);
}

/* The running rows', prefill probes' and draft's state params from e->p (and the
 * kv_setup callback, which may choose the KV for the loaded model). */
static tqkv_status engine_state_params(tqkv_engine *e) {
    e->sp = tqkv_model_state_params_default();
    e->sp.k_format = e->p.k_format;
    e->sp.v_format = e->p.v_format;
    e->sp.window = e->p.window;
    e->sp.threads = e->p.threads;
    e->sp.extend_as_decode = e->dm != NULL;
    e->sp.device = e->p.device;
    e->sp.tensor_parallel = e->p.tensor_parallel; /* the draft's: dsp below */
    if (e->p.kv_setup) { /* a preset / per-layer formats chosen for this model */
        tqkv_model_state_params t = e->sp;
        tqkv_status rc = e->p.kv_setup(e->m, &t, e->p.kv_setup_user);
        if (rc == TQKV_OK && e->dm && t.window > 0)
            rc = tqkv_fail(TQKV_EUNSUPPORTED, "engine: the KV setup chose a q8 window, which a "
                           "draft model cannot take (verification needs window 0)");
        if (rc != TQKV_OK) return rc;
        e->sp.k_format = t.k_format;
        e->sp.v_format = t.v_format;
        e->sp.window = t.window;
        e->sp.window_slack = t.window_slack;
        e->sp.window_keys_only = t.window_keys_only; /* a policy's "window-planes k" */
        memcpy(e->sp.layer_k, t.layer_k, sizeof t.layer_k);
        memcpy(e->sp.layer_v, t.layer_v, sizeof t.layer_v);
        e->p.k_format = t.k_format;
        e->p.v_format = t.v_format;
        e->p.window = t.window;
    }
    int dense = 0; /* a per-layer f32/f32 layer: the device's dense bf16 cache, no export */
    if (e->p.device && e->p.prompt_cache_dir &&
        tqkv_kv_layers_device_check(e->m, &e->sp, &dense) == TQKV_OK && dense)
        return tqkv_fail(TQKV_EUNSUPPORTED, "engine: a persisted prompt cache on the device needs "
                         "tq or fp8 KV on every layer (f32 KV runs on a dense bf16 device cache, "
                         "which has no state format); use the in-memory prefix cache");
    e->psp = e->sp;
    e->psp.extend_as_decode = 0;
    e->dsp = tqkv_model_state_params_default();
    e->dsp.k_format = e->p.k_format;
    e->dsp.v_format = e->p.v_format;
    e->dsp.threads = e->p.threads;
    e->dsp.device = e->p.device; /* the draft runs where the target does */
    e->dsp.tensor_parallel = e->p.draft_tensor_parallel < 0 ? e->p.tensor_parallel
                                                            : e->p.draft_tensor_parallel;
    return TQKV_OK;
}

/* The engine's params: *pp with its defaults filled in (0 = the default) and checked. On
 * an error (the message names the field) *pp is unchanged. */
static tqkv_status engine_params_resolve(tqkv_engine_params *pp) {
    tqkv_engine_params p = *pp;
    tqkv_engine_params d = tqkv_engine_params_default();
    if (p.draft_tokens == 0) p.draft_tokens = d.draft_tokens;
    if (p.parallel == 0) p.parallel = d.parallel;
    if (p.queue_max == 0) p.queue_max = d.queue_max;
    if (p.threads == 0) p.threads = d.threads;
    /* the device's prefill forward is a GPU pass per chunk: 2048-token chunks run it near
     * bench model's one-pass rate (bench/RESULTS.md, session 12: 256-token chunks held a
     * served 8192-token burst to about half of it) */
    if (p.prefill_chunk == 0) p.prefill_chunk = p.device == 1 ? 2048 : 256;
    if (p.prefill_step < 0)
        return tqkv_fail(TQKV_EINVAL, "engine: prefill_step %d must be >= 0", p.prefill_step);
    if (p.draft_tokens < 1 || p.draft_tokens > 16)
        return tqkv_fail(TQKV_EINVAL, "engine: draft_tokens %d not in [1, 16]", p.draft_tokens);
    if (p.draft_tensor_parallel < -1 || p.draft_tensor_parallel > 8)
        return tqkv_fail(TQKV_EINVAL, "engine: draft_tensor_parallel %d not in -1..8",
                         p.draft_tensor_parallel);
    if (p.parallel < 1 || p.queue_max < 1 || p.threads < 1 || p.prefill_chunk < 1 ||
        p.window < 0)
        return tqkv_fail(TQKV_EINVAL, "engine: parallel, queue_max, threads, prefill_chunk must "
                         "be >= 1 and window >= 0");
    if (p.prefill_step == 0) { /* one chunk on the CPU; on the device whole chunks of about
                                 * 4096 tokens (16 of 256, 2 of 2048), at least one */
        const int k = p.device == 1 && p.prefill_chunk < 4096 ? 4096 / p.prefill_chunk : 1;
        p.prefill_step = p.prefill_chunk > INT_MAX / k ? INT_MAX : k * p.prefill_chunk;
    }
    if ((unsigned)p.k_format >= TQKV_FORMAT_COUNT || (unsigned)p.v_format >= TQKV_FORMAT_COUNT)
        return tqkv_fail(TQKV_EINVAL, "engine: invalid KV format");
    if (p.draft_dir && p.window > 0)
        return tqkv_fail(TQKV_EUNSUPPORTED, "engine: a draft model needs window 0 (verification "
                         "windows equal single decodes only without the q8 window)");
    if (p.device != 0 && p.device != 1)
        return tqkv_fail(TQKV_EINVAL, "engine: device %d (0 = CPU, 1 = CUDA)", p.device);
#ifdef TQKV_HAVE_CUDA
    if (p.device && p.parallel > CUDA_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "engine: parallel %d on the device (at most %d rows)",
                         p.parallel, CUDA_MAX_ROWS);
#endif
    if (p.device && p.prompt_cache_dir && (p.k_format == TQKV_F32 || p.v_format == TQKV_F32))
        return tqkv_fail(TQKV_EUNSUPPORTED, "engine: a persisted prompt cache on the device needs "
                         "tq4 or tq3 KV (f32 KV runs on a dense bf16 device cache, which has no "
                         "state format); use the in-memory prefix cache");
    if (p.kv_budget == 0 && !p.device) p.kv_budget = default_budget();
    *pp = p;
    return TQKV_OK;
}

/* The states init makes once to check them: bytes per token of one row (for stats), from
 * an empty 1-row state (device: uploads the weights); the draft's states must be possible
 * too (device: its graph; an error says whose); on the device, kv_budget 0 = 80% of the
 * memory then free. */
static tqkv_status engine_probe_states(tqkv_engine *e) {
    tqkv_model_state *tmp = NULL;
    tqkv_status rc = tqkv_model_state_init(&tmp, e->m, &e->sp);
    if (rc == TQKV_OK) e->st.kv_bytes_per_token = tqkv_model_state_kv_bytes_per_token(tmp);
    tqkv_model_state_free(tmp);
    if (rc == TQKV_OK && e->dm) {
        tmp = NULL;
        rc = tqkv_model_state_init(&tmp, e->dm, &e->dsp);
        tqkv_model_state_free(tmp);
        if (rc != TQKV_OK) { /* say whose states */
            char why[512];
            snprintf(why, sizeof why, "%s", tqkv_last_error());
            rc = tqkv_fail(rc, "engine: the draft model's states: %s", why);
        }
    }
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && e->p.device && e->p.kv_budget == 0) {
        size_t fr = 0, total = 0;
        rc = tqkv_cuda_mem_info(&fr, &total);
        e->p.kv_budget = fr / 10 * 8;
    }
#endif
    return rc;
}

tqkv_status tqkv_engine_init(tqkv_engine **out, const tqkv_engine_params *pin) {
    if (!out || !pin || !pin->model_dir)
        return tqkv_fail(TQKV_EINVAL, "engine_init: NULL argument or no model_dir");
    tqkv_engine_params p = *pin;
    tqkv_status rc = engine_params_resolve(&p);
    if (rc != TQKV_OK) return rc;
    tqkv_engine *e = tqkv_calloc(1, sizeof *e);
    if (!e) return TQKV_ENOMEM;
    e->p = p;
    e->model_dir = str_dup(p.model_dir);
    e->draft_dir = str_dup(p.draft_dir);
    e->p.model_dir = e->model_dir;
    e->p.draft_dir = e->draft_dir;
    e->p.prompt_cache_dir = NULL;
    e->next_id = 1;
    /* name: last path component */
    const char *nm = p.model_dir;
    size_t nl = strlen(nm);
    while (nl > 1 && nm[nl - 1] == '/') nl--;
    size_t st = nl;
    while (st > 0 && nm[st - 1] != '/') st--;
    e->name = malloc(nl - st + 1);
    if (!e->model_dir || (p.draft_dir && !e->draft_dir) || !e->name) {
        engine_release(e);
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    }
    memcpy(e->name, nm + st, nl - st);
    e->name[nl - st] = 0;

    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.threads = p.threads;
    lp.verbose = p.verbose;
    lp.no_pack = lp.no_f32_prefill = p.device; /* the device keeps its own bf16 copy */
    lp.bf16_act = p.bf16_act;
    rc = tqkv_model_load(&e->m, p.model_dir, &lp);
    if (rc == TQKV_OK) rc = tqkv_tokenizer_load(&e->tok, p.model_dir);
    /* every graph's verification window reproduces single decodes bit for bit
     * (extend_as_decode, CPU and device): a draft is fine for any target */
    if (rc == TQKV_OK && p.draft_dir) {
        rc = tqkv_model_load(&e->dm, p.draft_dir, &lp);
        if (rc == TQKV_OK &&
            tqkv_model_get_config(e->dm)->vocab_size != tqkv_model_get_config(e->m)->vocab_size)
            rc = tqkv_fail(TQKV_EINVAL, "engine: draft vocab %d differs from the model's %d",
                           tqkv_model_get_config(e->dm)->vocab_size,
                           tqkv_model_get_config(e->m)->vocab_size);
    }
    if (rc != TQKV_OK) {
        engine_release(e);
        return rc;
    }
    e->ctx = tqkv_model_context_len(e->m);
    if (e->dm && tqkv_model_context_len(e->dm) < e->ctx) e->ctx = tqkv_model_context_len(e->dm);
    if ((rc = engine_state_params(e)) != TQKV_OK) {
        engine_release(e);
        return rc;
    }
    if (pthread_mutex_init(&e->mu, NULL) || pthread_cond_init(&e->cv_work, NULL) ||
        pthread_cond_init(&e->cv_idle, NULL)) {
        engine_release(e);
        return tqkv_fail(TQKV_ENOMEM, "engine: cannot create lock");
    }
    e->tmp = malloc(sizeof(float) * (size_t)tqkv_model_get_config(e->m)->vocab_size);
    if (!e->tmp) {
        engine_release(e);
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    }
    char desc[256];
    char tpd[32] = "";
    if (e->sp.tensor_parallel > 1) snprintf(tpd, sizeof tpd, ", tensor parallel %d", e->sp.tensor_parallel);
    snprintf(desc, sizeof desc, "model %s, kv %s/%s, window %d, chunk %d%s%s", e->name,
             tqkv_format_name(e->p.k_format), tqkv_format_name(e->p.v_format), e->p.window,
             p.prefill_chunk, p.device ? ", device cuda" : "", tpd);
    rc = prefix_init(&e->pc, p.prefix_cache_bytes, p.prompt_cache_dir, engine_fingerprint(e), desc);
    if (rc != TQKV_OK) {
        engine_release(e);
        return rc;
    }
    if (e->pc.dir) { /* entries are keyed by the model files' content too */
        rc = prefix_key_model(&e->pc, p.model_dir, p.verbose);
        if (rc != TQKV_OK) {
            engine_release(e);
            return rc;
        }
        prefix_load_dir(&e->pc, e->m, &e->psp, p.verbose);
    }
    if ((rc = engine_probe_states(e)) != TQKV_OK) {
        engine_release(e);
        return rc;
    }
    e->st.kv_budget = e->p.kv_budget;
    *out = e;
    return TQKV_OK;
}

const tqkv_model *tqkv_engine_model(const tqkv_engine *e) { return e ? e->m : NULL; }
const tqkv_tokenizer *tqkv_engine_tokenizer(const tqkv_engine *e) { return e ? e->tok : NULL; }
int tqkv_engine_context_len(const tqkv_engine *e) { return e ? e->ctx : 0; }
const char *tqkv_engine_model_name(const tqkv_engine *e) { return e ? e->name : NULL; }

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

void req_free(eng_req *q) {
    if (!q) return;
    free(q->prompt);
    free(q->bias_ids);
    free(q->bias_vals);
    js_free(q->js);
    for (int i = 0; i < q->n_stop; i++) free(q->stop[i]);
    free(q->stop);
    tqkv_sampler_free(q->sampler);
    tqkv_model_state_free(q->pre);
    tqkv_model_state_free(q->dpre);
    tqkv_decode_stream_free(q->ds);
    free(q->out);
    free(q);
}

/* Bytes a request holds at most: its row grown to n_prompt + max_tokens tokens, as the
 * model projects it (bounded sliding layers, KV-shared layers, recurrent rows, and with a
 * draft what a speculative round holds: tqkv_model_state_projected_bytes_spec). */
static size_t req_projected(const tqkv_engine *e, const eng_req *q, tqkv_model_state *probe,
                            tqkv_model_state *dprobe) {
    int n = q->n_prompt + q->max_tokens;
    const int K = e->dm ? e->p.draft_tokens : 0; /* rounds of K drafts between forwards */
    size_t b = tqkv_model_state_projected_bytes_spec(probe, n, K);
    if (dprobe) b += tqkv_model_state_projected_bytes_spec(dprobe, n, K);
    return b;
}

/* The compiled constraint for schema text (NULL: json_object), shared with the requests
 * that asked for the same text (their masks are cached once); a new reference in *out.
 * Called under e->mu. */
static tqkv_status engine_schema(tqkv_engine *e, const char *text, int V, js_schema **out) {
    int lru = 0;
    for (int i = 0; i < ENGINE_SCHEMAS; i++) {
        if (e->schemas[i].js && (text ? e->schemas[i].text && !strcmp(text, e->schemas[i].text)
                                      : !e->schemas[i].text)) {
            e->schemas[i].used = ++e->schema_clock;
            *out = js_ref(e->schemas[i].js);
            return TQKV_OK;
        }
        if (e->schemas[i].used < e->schemas[lru].used) lru = i;
    }
    js_schema *js = NULL;
    char *t = text ? str_dup(text) : NULL;
    if (text && !t) return TQKV_ENOMEM;
    tqkv_status rc = js_compile(&js, text, V);
    if (rc != TQKV_OK) {
        free(t);
        return rc;
    }
    js_free(e->schemas[lru].js); /* requests still holding it keep it */
    free(e->schemas[lru].text);
    e->schemas[lru].js = js;
    e->schemas[lru].text = t;
    e->schemas[lru].used = ++e->schema_clock;
    *out = js_ref(js);
    return TQKV_OK;
}

tqkv_status tqkv_engine_submit(tqkv_engine *e, const tqkv_engine_request *r, uint64_t *id) {
    if (!e || !r || !id) return tqkv_fail(TQKV_EINVAL, "engine_submit: NULL argument");
    if (!r->on_event) return tqkv_fail(TQKV_EINVAL, "engine_submit: on_event is required");
    if (!r->prompt || r->n_prompt < 1)
        return tqkv_fail(TQKV_EINVAL, "engine_submit: the prompt needs at least one token");
    if (r->max_tokens < 1)
        return tqkv_fail(TQKV_EINVAL, "engine_submit: max_tokens must be >= 1, got %d",
                         r->max_tokens);
    if (r->n_stop < 0 || r->n_stop > 16 || (r->n_stop > 0 && !r->stop))
        return tqkv_fail(TQKV_EINVAL, "engine_submit: n_stop must be in [0, 16]");
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i] || !r->stop[i][0])
            return tqkv_fail(TQKV_EINVAL, "engine_submit: stop[%d] is NULL or empty", i);
    if (r->n < 0 || r->n > TQKV_ENGINE_MAX_CHOICES || r->n > e->p.parallel)
        return tqkv_fail(TQKV_EINVAL, "engine_submit: n %d not in [0, %d] (at most parallel = %d)",
                         r->n, TQKV_ENGINE_MAX_CHOICES, e->p.parallel);
    if (r->top_logprobs < -1 || r->top_logprobs > TQKV_MAX_TOP_LOGPROBS)
        return tqkv_fail(TQKV_EINVAL, "engine_submit: top_logprobs %d not in [-1, %d]",
                         r->top_logprobs, TQKV_MAX_TOP_LOGPROBS);
    const tqkv_sampler_params *s = &r->sampling;
    if (!(s->temperature >= 0) || !isfinite(s->temperature) || !(s->top_p > 0 && s->top_p <= 1) ||
        !(s->min_p >= 0 && s->min_p <= 1) || s->top_k < 0 || !(s->repetition_penalty > 0) ||
        s->penalty_last_n < 0)
        return tqkv_fail(TQKV_EINVAL, "engine_submit: sampling parameters out of range "
                         "(temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, top_k >= 0, "
                         "repetition_penalty > 0)");
    int V = tqkv_model_get_config(e->m)->vocab_size;
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= V)
            return tqkv_fail(TQKV_EINVAL, "engine_submit: prompt token %d at %d outside vocab %d",
                             r->prompt[i], i, V);
    if ((long long)r->n_prompt + r->max_tokens > e->ctx)
        return tqkv_fail(TQKV_ERANGE, "engine_submit: prompt (%d tokens) + max_tokens (%d) = %lld "
                         "exceeds the context length %d", r->n_prompt, r->max_tokens,
                         (long long)r->n_prompt + r->max_tokens, e->ctx);
    eng_req *q = tqkv_calloc(1, sizeof *q);
    if (!q) return TQKV_ENOMEM;
    q->prompt = malloc(sizeof(int32_t) * (size_t)r->n_prompt);
    q->stop = r->n_stop ? calloc((size_t)r->n_stop, sizeof(char *)) : NULL;
    tqkv_status rc = (!q->prompt || (r->n_stop && !q->stop)) ? TQKV_ENOMEM : TQKV_OK;
    if (rc == TQKV_OK) {
        memcpy(q->prompt, r->prompt, sizeof(int32_t) * (size_t)r->n_prompt);
        q->n_prompt = r->n_prompt;
        for (int i = 0; i < r->n_stop; i++, q->n_stop++)
            if (!(q->stop[i] = str_dup(r->stop[i]))) rc = TQKV_ENOMEM;
    }
    q->sp = *s;
    q->sp.n_bias = 0;
    q->sp.bias_ids = NULL;
    q->sp.bias_vals = NULL;
    if (rc == TQKV_OK && s->n_bias > 0) { /* the choices' samplers are made later: own copies */
        q->bias_ids = malloc(sizeof(int32_t) * (size_t)s->n_bias);
        q->bias_vals = malloc(sizeof(float) * (size_t)s->n_bias);
        if (!q->bias_ids || !q->bias_vals || !s->bias_ids || !s->bias_vals) {
            rc = s->bias_ids && s->bias_vals ? TQKV_ENOMEM
                                             : tqkv_fail(TQKV_EINVAL, "engine_submit: n_bias without ids and values");
        } else {
            memcpy(q->bias_ids, s->bias_ids, sizeof(int32_t) * (size_t)s->n_bias);
            memcpy(q->bias_vals, s->bias_vals, sizeof(float) * (size_t)s->n_bias);
            q->sp.n_bias = s->n_bias;
            q->sp.bias_ids = q->bias_ids;
            q->sp.bias_vals = q->bias_vals;
        }
    }
    if (rc == TQKV_OK && (r->json_object || r->json_schema)) {
        pthread_mutex_lock(&e->mu); /* the vocabulary trie is made once, on first use */
        if (!e->jv) rc = jg_vocab_init(&e->jv, e->tok, e->m);
        if (rc == TQKV_OK) rc = engine_schema(e, r->json_schema, V, &q->js);
        pthread_mutex_unlock(&e->mu);
        if (rc == TQKV_OK) {
            q->jv = e->jv;
            js_init(q->js, &q->jst);
        }
    }
    if (rc == TQKV_OK) rc = engine_req_sampler(e, q, s->seed);
    if (rc == TQKV_OK) rc = tqkv_decode_stream_init(&q->ds, e->tok, TQKV_DECODE_SKIP_SPECIAL);
    if (rc != TQKV_OK) {
        req_free(q);
        return rc == TQKV_ENOMEM ? tqkv_fail(TQKV_ENOMEM, "engine_submit: out of memory") : rc;
    }
    q->max_tokens = r->max_tokens;
    q->n_choices = r->n > 1 ? r->n : 1;
    q->ignore_eos = r->ignore_eos;
    q->top_logprobs = r->top_logprobs;
    q->fn = r->on_event;
    q->user = r->user;
    q->last = -1;
    q->t_submit = engine_now();

    pthread_mutex_lock(&e->mu);
    if (e->draining || e->stop) {
        pthread_mutex_unlock(&e->mu);
        req_free(q);
        return tqkv_fail(TQKV_ESTATE, "engine_submit: the engine is draining");
    }
    if (e->n_queue >= e->p.queue_max) {
        int qm = e->p.queue_max;
        pthread_mutex_unlock(&e->mu);
        req_free(q);
        return tqkv_fail(TQKV_EBUSY, "engine_submit: the wait queue is full (%d requests); "
                         "retry later", qm);
    }
    q->id = e->next_id++;
    q->phase = REQ_QUEUED;
    if (e->q_tail) e->q_tail->next = q;
    else e->q_head = q;
    e->q_tail = q;
    e->n_queue++;
    *id = q->id;
    pthread_cond_signal(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
    return TQKV_OK;
}

tqkv_status tqkv_engine_cancel(tqkv_engine *e, uint64_t id) {
    if (!e) return tqkv_fail(TQKV_EINVAL, "engine_cancel: NULL engine");
    pthread_mutex_lock(&e->mu);
    eng_req *hit = NULL;
    /* every choice of the request (they share its id) */
    for (eng_req *q = e->q_head; q; q = q->next)
        if (q->id == id) hit = q, q->cancel = 1;
    for (int i = 0; i < e->n_pre; i++)
        if (e->pre[i]->id == id) hit = e->pre[i], hit->cancel = 1;
    for (int i = 0; i < e->n_rows; i++)
        if (e->rows[i]->id == id && !e->rows[i]->finished) hit = e->rows[i], hit->cancel = 1;
    if (hit) pthread_cond_signal(&e->cv_work);
    pthread_mutex_unlock(&e->mu);
    if (!hit) return tqkv_fail(TQKV_EINVAL, "engine_cancel: no open request with id %llu",
                               (unsigned long long)id);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Scheduler pieces
// ---------------------------------------------------------------------------

/* Device storage at its peak if q joins (the budget's second bound on the device). A
 * device state stores every row in as many columns (rows of unequal length padded to a
 * common end), grows by 1.25x (at least 256 columns) when an append needs room
 * (cuda_kv_reserve), and a merge (newcomers joining) that needs more room than the storage
 * holds regrows it, old and new side by side, while the newcomers' 1-row prefill states
 * still exist (joins and filters that fit run in place, with no second copy, but the bound
 * must hold for the regrow). So:
 *   c    = longest final length + (other rows ? longest max_tokens : 0)
 *          (a row joining late is padded by at most the others' remaining tokens)
 *   cols = c + max(c / 4, 256) (the growth step)
 *   peak = bytes the running state holds now + (rows after q + prefill rows incl. q's)
 *          x a row's projected bytes at cols.
 * For an idle engine this is q's own peak (the too-large check), so a request that passes
 * that check is always admitted once the engine is idle. Called under e->mu. */
static size_t device_peak(const tqkv_engine *e, const eng_req *q, tqkv_model_state *probe,
                          tqkv_model_state *dprobe) {
    int fin = q->n_prompt + q->max_tokens, newt = q->max_tokens, rows = 0, pre_rows = q->n_choices;
    for (int i = 0; i < e->n_rows; i++) {
        const eng_req *r = e->rows[i];
        if (r->n_prompt + r->max_tokens > fin) fin = r->n_prompt + r->max_tokens;
        if (r->max_tokens > newt) newt = r->max_tokens;
        rows++;
    }
    for (int i = 0; i < e->n_pre; i++) {
        const eng_req *r = e->pre[i];
        const int n = r->forked ? 1 : r->n_choices;
        if (r->n_prompt + r->max_tokens > fin) fin = r->n_prompt + r->max_tokens;
        if (r->max_tokens > newt) newt = r->max_tokens;
        rows += n;
        pre_rows += n;
    }
    long cols = (long)fin + (rows > 0 ? newt : 0) + (e->dm ? e->p.draft_tokens : 0);
    cols += cols / 4 > 256 ? cols / 4 : 256;
    const int K = e->dm ? e->p.draft_tokens : 0;
    size_t row = tqkv_model_state_projected_bytes_spec(probe, (int)cols, K);
    if (dprobe) row += tqkv_model_state_projected_bytes_spec(dprobe, (int)cols, K);
    const size_t held = (e->run ? tqkv_model_state_kv_bytes_used(e->run) : 0) +
                        (e->drun ? tqkv_model_state_kv_bytes_used(e->drun) : 0);
    return held + (size_t)(rows + q->n_choices + pre_rows) * row;
}

/* Queue: drop cancelled requests, admit from the head while slots and budget allow. */
static void sched_admit(tqkv_engine *e, eng_req **dropped, int *n_dropped, int cap_dropped) {
    /* probes for projections: empty 1-row states of the same parameters */
    tqkv_model_state *probe = NULL, *dprobe = NULL;
    pthread_mutex_lock(&e->mu);
    eng_req **pp = &e->q_head, *prev = NULL;
    while (*pp) {
        eng_req *q = *pp;
        if (q->cancel && *n_dropped < cap_dropped) {
            *pp = q->next;
            if (e->q_tail == q) e->q_tail = prev;
            e->n_queue--;
            dropped[(*n_dropped)++] = q;
            continue;
        }
        prev = q;
        pp = &q->next;
    }
    for (;;) {
        eng_req *q = e->q_head;
        if (!q) break;
        /* slots: running rows, prefilling requests with all their choices to come */
        int slots = e->n_rows;
        for (int i = 0; i < e->n_pre; i++) slots += e->pre[i]->forked ? 1 : e->pre[i]->n_choices;
        if (slots + q->n_choices > e->p.parallel) break;
        if (!probe) {
            pthread_mutex_unlock(&e->mu);
            /* with a draft, the model counts what a speculative round holds beyond what
             * its layers keep (req_projected: tqkv_model_state_projected_bytes_spec) */
            tqkv_status rc = tqkv_model_state_init(&probe, e->m, &e->sp);
            if (rc == TQKV_OK && e->dm) rc = tqkv_model_state_init(&dprobe, e->dm, &e->dsp);
            pthread_mutex_lock(&e->mu);
            if (rc != TQKV_OK) break;
            continue; /* the head may have changed while unlocked */
        }
        size_t need = req_projected(e, q, probe, dprobe) * (size_t)q->n_choices;
        const int idle = e->n_rows + e->n_pre == 0;
        const size_t peak = e->sp.device ? device_peak(e, q, probe, dprobe) : 0;
        if (need > e->p.kv_budget || (idle && peak > e->p.kv_budget)) {
            /* can never fit: fail it rather than block the queue */
            e->q_head = q->next;
            if (!e->q_head) e->q_tail = NULL;
            e->n_queue--;
            q->reserved = 0;
            q->cancel = 2; /* marks "too large" for the caller */
            if (*n_dropped < cap_dropped) dropped[(*n_dropped)++] = q;
            continue;
        }
        if (e->reserved + need > e->p.kv_budget) break; /* wait for rows to finish */
        if (peak > e->p.kv_budget) break; /* device: its storage's peak must fit too */
        /* the storage really held (padding of rows of unequal lengths, spare columns)
         * counts too: the budget bounds memory, not only the projected token bytes */
        if (e->st.kv_bytes_allocated + need > e->p.kv_budget && e->n_rows + e->n_pre > 0) break;
        if (!engine_grow_ptrs((void ***)&e->pre, &e->cap_pre, e->n_pre + 1)) break;
        e->q_head = q->next;
        if (!e->q_head) e->q_tail = NULL;
        e->n_queue--;
        q->next = NULL;
        q->reserved = need;
        e->reserved += need;
        q->phase = REQ_PREFILL;
        e->pre[e->n_pre++] = q;
        e->st.prompt_tokens += (uint64_t)q->n_prompt;
    }
    pthread_mutex_unlock(&e->mu);
    tqkv_model_state_free(probe);
    tqkv_model_state_free(dprobe);
}

static void release_budget(tqkv_engine *e, eng_req *q) {
    pthread_mutex_lock(&e->mu);
    e->reserved -= q->reserved;
    q->reserved = 0;
    pthread_mutex_unlock(&e->mu);
}

/* A 1-row prefill state with e->psp: an emptied one kept from an earlier request (its
 * scratch already mapped and faulted in: in `tqkv serve`, whose mmap threshold is 256 KiB,
 * a fresh state's buffers cost page faults in every layer of its first chunk), else new. */
static tqkv_status engine_pre_take(tqkv_engine *e, tqkv_model_state **out) {
    if (e->n_spare > 0) {
        *out = e->spare[--e->n_spare];
        return TQKV_OK;
    }
    return tqkv_model_state_init(out, e->m, &e->psp);
}

/* Keeps s emptied for the next request when it came from engine_pre_take and there is
 * room, else frees it. */
static void engine_pre_give(tqkv_engine *e, tqkv_model_state *s, int spare) {
    if (s && spare && e->n_spare < ENGINE_SPARE_PRE && tqkv_model_state_reset(s, 1) == TQKV_OK) {
        e->spare[e->n_spare++] = s;
        return;
    }
    tqkv_model_state_free(s);
}

/* The draft's prompt tokens [dprefilled, dprefilled + n) into q's 1-row draft state (made at
 * its first chunk): a prefill, then extends, no logits. */
static tqkv_status draft_chunk(tqkv_engine *e, eng_req *q, int n) {
    tqkv_status rc = TQKV_OK;
    if (!q->dpre) rc = tqkv_model_state_init(&q->dpre, e->dm, &e->dsp);
    const int32_t *tk = q->prompt + q->dprefilled;
    if (rc == TQKV_OK && q->dprefilled == 0)
        rc = tqkv_model_prefill(e->dm, q->dpre, tk, NULL, n, TQKV_LOGITS_NONE, NULL);
    else if (rc == TQKV_OK) rc = tqkv_model_extend(e->dm, q->dpre, tk, n, TQKV_LOGITS_NONE, NULL);
    if (rc != TQKV_OK) return rc;
    q->dprefilled += n;
    pthread_mutex_lock(&e->mu);
    e->st.draft_prefill_tokens += (uint64_t)n;
    pthread_mutex_unlock(&e->mu);
    return TQKV_OK;
}

/* One prefill chunk of q: tokens [prefilled, prefilled + C) at fixed multiples of C, and
 * with a draft model the same tokens in the draft's state (so the draft's prefill follows
 * prefill_step too); after a prefix-cache hit the draft first catches up on the reused
 * tokens, a chunk a call, which counts as that chunk's tokens. On the target's last chunk
 * (the draft's too), picks the first token. Returns tokens processed, or -1 on error
 * (request finished with an error event). */
static int prefill_chunk(tqkv_engine *e, eng_req *q) {
    const int C = e->p.prefill_chunk, V = tqkv_model_get_config(e->m)->vocab_size;
    tqkv_status rc = TQKV_OK;
    if (!q->pre) {
        int hit_n = 0;
        if (e->pc.budget) { /* the lock keeps the entry from eviction by an import */
            pthread_mutex_lock(&e->mu);
            prefix_entry *hit = prefix_lookup(&e->pc, q->prompt, q->n_prompt, q->n_prompt - 1);
            if (hit && (rc = tqkv_model_state_extract_row(hit->st, 0, &q->pre)) == TQKV_OK) {
                hit_n = hit->n;
                e->st.prefix_hits++;
                e->st.prefix_tokens_reused += (uint64_t)hit_n;
            } else if (!hit) {
                e->st.prefix_misses++;
            }
            pthread_mutex_unlock(&e->mu);
        }
        if (rc == TQKV_OK && hit_n) q->prefilled = q->cached = hit_n;
        else if (rc == TQKV_OK && (rc = engine_pre_take(e, &q->pre)) == TQKV_OK) q->pre_spare = 1;
        if (rc != TQKV_OK) goto fail;
    }
    if (e->dm && q->dprefilled < q->prefilled) { /* the draft has no prefix cache */
        const int dn = q->prefilled - q->dprefilled < C ? q->prefilled - q->dprefilled : C;
        if ((rc = draft_chunk(e, q, dn)) != TQKV_OK) goto fail;
        return dn;
    }
    int n = q->n_prompt - q->prefilled < C ? q->n_prompt - q->prefilled : C;
    int last = q->prefilled + n == q->n_prompt;
    if (!engine_grow_floats(&e->logits, &e->cap_logits, (size_t)V)) {
        rc = tqkv_fail(TQKV_ENOMEM, "engine: out of memory for logits");
        goto fail;
    }
    const int32_t *tk = q->prompt + q->prefilled;
    tqkv_logits_mode mode = last ? TQKV_LOGITS_LAST : TQKV_LOGITS_NONE;
    if (q->prefilled == 0) rc = tqkv_model_prefill(e->m, q->pre, tk, NULL, n, mode, e->logits);
    else rc = tqkv_model_extend(e->m, q->pre, tk, n, mode, e->logits);
    if (rc == TQKV_OK && e->dm) rc = draft_chunk(e, q, n); /* the same tokens */
    if (rc != TQKV_OK) goto fail;
    q->prefilled += n;
    pthread_mutex_lock(&e->mu);
    e->st.prefill_tokens += (uint64_t)n;
    pthread_mutex_unlock(&e->mu);
    if (!last && e->pc.budget && q->prefilled % C == 0) {
        pthread_mutex_lock(&e->mu);
        prefix_entry *x = prefix_lookup(&e->pc, q->prompt, q->prefilled, q->prefilled);
        if (!x || x->n != q->prefilled) (void)prefix_insert(&e->pc, q->prompt, q->prefilled, q->pre);
        pthread_mutex_unlock(&e->mu);
    }
    if (last) {
        int32_t tok;
        tok_info ti;
        if (q->n_choices > 1 && !q->forked) engine_fork_choices(e, q, e->logits);
        if ((rc = req_pick(e, q, e->logits, &tok, &ti)) != TQKV_OK) goto fail;
        q->phase = REQ_RUNNING;
        req_take(e, q, tok, &ti);
    }
    return n;
fail:
    req_finish_plain(e, q, TQKV_FINISH_ERROR, tqkv_last_error());
    return -1;
}

/* Remove finished requests from the prefill list (free them). */
static void sweep_pre(tqkv_engine *e, eng_req **ready, int *n_ready) {
    for (int i = 0; i < e->n_pre; i++)
        if (e->pre[i]->cancel && !e->pre[i]->finished)
            req_finish_plain(e, e->pre[i], TQKV_FINISH_CANCELLED, NULL);
    eng_req **gone = malloc(sizeof(eng_req *) * (size_t)(e->n_pre ? e->n_pre : 1));
    int k = 0, ng = 0;
    pthread_mutex_lock(&e->mu); /* cancel() reads the list */
    for (int i = 0; i < e->n_pre; i++) {
        eng_req *q = e->pre[i];
        if (q->finished && gone) {
            q->phase = REQ_DONE;
            gone[ng++] = q;
        } else if (q->phase == REQ_RUNNING && !q->finished) {
            ready[(*n_ready)++] = q;
        } else {
            e->pre[k++] = q;
        }
    }
    e->n_pre = k;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < ng; i++) {
        release_budget(e, gone[i]);
        req_free(gone[i]);
    }
    free(gone);
}

/* Filter finished rows out of the running states; merge ready newcomers in. */
static tqkv_status sched_rows(tqkv_engine *e, eng_req **ready, int n_ready) {
    int R = e->n_rows;
    int *keep = malloc(sizeof(int) * (size_t)(R ? R : 1));
    unsigned char *stay = malloc((size_t)(R ? R : 1));
    if (!keep || !stay) {
        free(keep);
        free(stay);
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    }
    for (int i = 0; i < R; i++) {
        eng_req *q = e->rows[i];
        if (q->cancel && !q->finished) req_finish_plain(e, q, TQKV_FINISH_CANCELLED, NULL);
        stay[i] = !q->finished;
    }
    /* holes filled from the tail: a finished row's slot takes one of the last running rows,
     * so the states move one row per finished one (an increasing list would slide every row
     * after it) */
    const int k = keep_fill_tail(stay, R, keep);
    free(stay);
    tqkv_status rc = TQKV_OK;
    if (k < R) {
        rc = tqkv_model_state_filter(e->run, keep, k);
        if (rc == TQKV_OK && e->drun) rc = tqkv_model_state_filter(e->drun, keep, k);
        if (rc != TQKV_OK) {
            free(keep);
            return rc;
        }
        eng_req **gone = malloc(sizeof(eng_req *) * (size_t)(R - k));
        int ng = 0;
        pthread_mutex_lock(&e->mu);
        for (int i = 0; i < R; i++) /* the finished rows first, then the slots refilled */
            if (e->rows[i]->finished && gone) gone[ng++] = e->rows[i];
        for (int i = 0; i < k; i++) e->rows[i] = e->rows[keep[i]]; /* keep[i] >= i: read first */
        e->n_rows = k;
        pthread_mutex_unlock(&e->mu);
        for (int i = 0; i < ng; i++) {
            release_budget(e, gone[i]);
            req_free(gone[i]);
        }
        free(gone);
    }
    free(keep);
    if (n_ready == 0) return TQKV_OK;
    tqkv_model_state **src = malloc(sizeof *src * (size_t)n_ready);
    tqkv_model_state **dsrc = malloc(sizeof *dsrc * (size_t)n_ready);
    if (!src || !dsrc || !engine_grow_ptrs((void ***)&e->rows, &e->cap_rows, e->n_rows + n_ready)) {
        free(src);
        free(dsrc);
        return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    }
    for (int i = 0; i < n_ready; i++) {
        src[i] = ready[i]->pre;
        dsrc[i] = ready[i]->dpre;
    }
    if (!e->run) { /* empty running states with the running parameters */
        rc = tqkv_model_state_init(&e->run, e->m, &e->sp);
        if (rc == TQKV_OK) rc = tqkv_model_state_filter(e->run, NULL, 0);
        if (rc == TQKV_OK && e->dm) {
            rc = tqkv_model_state_init(&e->drun, e->dm, &e->dsp);
            if (rc == TQKV_OK) rc = tqkv_model_state_filter(e->drun, NULL, 0);
        }
        if (rc != TQKV_OK) {
            tqkv_model_state_free(e->run);
            tqkv_model_state_free(e->drun);
            e->run = e->drun = NULL;
        }
    }
    if (rc == TQKV_OK) rc = tqkv_model_state_merge(e->run, src, n_ready);
    if (rc == TQKV_OK && e->dm) {
        rc = tqkv_model_state_merge(e->drun, dsrc, n_ready);
        if (rc != TQKV_OK) { /* keep target and draft in step */
            int *kp = malloc(sizeof(int) * (size_t)(e->n_rows ? e->n_rows : 1));
            for (int i = 0; kp && i < e->n_rows; i++) kp[i] = i;
            if (kp) tqkv_model_state_filter(e->run, kp, e->n_rows);
            free(kp);
        }
    }
    free(src);
    free(dsrc);
    if (rc != TQKV_OK) return rc;
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < n_ready; i++) {
        engine_pre_give(e, ready[i]->pre, ready[i]->pre_spare);
        tqkv_model_state_free(ready[i]->dpre);
        ready[i]->pre = ready[i]->dpre = NULL;
        e->rows[e->n_rows++] = ready[i];
    }
    pthread_mutex_unlock(&e->mu);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Step
// ---------------------------------------------------------------------------

/* Bytes of KV storage of a state's layers (each batch once: KV-shared layers may name
 * their donor's); for a device state, its caches' device storage (capacity). */
static size_t state_kv_allocated(tqkv_model_state *s, const tqkv_model *m, int device) {
    if (!s || !m) return 0;
    if (device) return tqkv_model_state_kv_bytes_used(s);
    int L = tqkv_model_get_config(m)->n_layers;
    size_t total = 0;
    for (int l = 0; l < L; l++) {
        tqkv_batch *b = tqkv_model_state_layer(s, l);
        int seen = 0;
        for (int k = 0; k < l && b && !seen; k++) seen = tqkv_model_state_layer(s, k) == b;
        if (b && !seen) total += tqkv_batch_bytes_allocated(b);
    }
    /* a sharded state's layers are rank 0's; every rank holds as many KV heads and the same
     * rows (the row operations move them in lockstep), so as many bytes */
    return total * (size_t)tqkv_model_state_tensor_parallel(s);
}

/* The running states plus the 1-row states of requests still prefilling. */
static size_t engine_kv_allocated(tqkv_engine *e) {
    const int d = e->sp.device;
    size_t total = state_kv_allocated(e->run, e->m, d) + state_kv_allocated(e->drun, e->dm, d);
    for (int i = 0; i < e->n_pre; i++)
        total += state_kv_allocated(e->pre[i]->pre, e->m, d) + state_kv_allocated(e->pre[i]->dpre, e->dm, d);
    return total;
}

/* One step's share of the stats (e->mu held): `live` rows decoded, seconds spent in the
 * prompt chunks, the rows' decode and the merge of newly prefilled rows. */
static void step_times_add(tqkv_engine_stats *st, int live, double pre, double dec, double merge) {
    st->steps++;
    st->decode_steps += live > 0;
    st->decode_rows += (uint64_t)live;
    st->prefill_seconds += pre;
    st->decode_seconds += dec;
    st->merge_seconds += merge;
}

tqkv_status tqkv_engine_step(tqkv_engine *e, int *busy) {
    if (!e) return tqkv_fail(TQKV_EINVAL, "engine_step: NULL engine");
    enum { DROP_CAP = 64 };
    eng_req *dropped[DROP_CAP];
    int n_dropped = 0;
    sched_admit(e, dropped, &n_dropped, DROP_CAP);
    for (int i = 0; i < n_dropped; i++) {
        eng_req *q = dropped[i];
        if (q->cancel == 2) {
            char msg[200];
            snprintf(msg, sizeof msg, "request needs more KV memory than the whole budget "
                     "(%zu bytes)", e->p.kv_budget);
            req_finish_plain(e, q, TQKV_FINISH_ERROR, msg);
        } else {
            req_finish_plain(e, q, TQKV_FINISH_CANCELLED, NULL);
        }
        req_free(q);
    }
    /* prefill: whole chunks, oldest newcomer first, about prefill_step tokens in all */
    const double t0 = tqkv_now_s();
    int budget = e->p.prefill_step;
    for (int i = 0; i < e->n_pre && budget > 0; i++) {
        eng_req *q = e->pre[i];
        while (budget > 0 && !q->cancel && !q->finished && q->phase == REQ_PREFILL &&
               q->prefilled < q->n_prompt) {
            int n = prefill_chunk(e, q);
            if (n <= 0) break;
            budget -= n;
        }
    }
    eng_req **ready = malloc(sizeof(eng_req *) * (size_t)(e->n_pre ? e->n_pre : 1));
    if (!ready) return tqkv_fail(TQKV_ENOMEM, "engine: out of memory");
    int n_ready = 0;
    sweep_pre(e, ready, &n_ready);
    /* decode the running rows (newcomers join after this step) */
    const double t1 = tqkv_now_s();
    tqkv_status rc = TQKV_OK;
    int live = 0;
    for (int i = 0; i < e->n_rows; i++) live += !e->rows[i]->finished && !e->rows[i]->cancel;
    if (live > 0) {
        int spec = e->dm != NULL;
        for (int i = 0; i < e->n_rows && spec; i++) {
            eng_req *q = e->rows[i];
            if (q->n_prompt + q->n_gen + e->p.draft_tokens > e->ctx) spec = 0;
        }
        rc = spec ? engine_step_spec(e) : engine_step_decode(e);
        if (rc != TQKV_OK) { /* the state is unchanged: fail the running requests */
            char msg[256];
            snprintf(msg, sizeof msg, "%s", tqkv_last_error());
            for (int i = 0; i < e->n_rows; i++)
                req_finish_plain(e, e->rows[i], TQKV_FINISH_ERROR, msg);
        }
    }
    const double t2 = tqkv_now_s();
    tqkv_status rc2 = sched_rows(e, ready, n_ready);
    const double t3 = tqkv_now_s();
    if (rc2 != TQKV_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "%s", tqkv_last_error());
        for (int i = 0; i < n_ready; i++) {
            req_finish_plain(e, ready[i], TQKV_FINISH_ERROR, msg);
            release_budget(e, ready[i]);
            req_free(ready[i]);
        }
    }
    free(ready);
    pthread_mutex_lock(&e->mu);
    step_times_add(&e->st, live, t1 - t0, t2 - t1, t3 - t2);
    int b = e->n_queue + e->n_pre + e->n_rows > 0;
    e->st.running = e->n_rows;
    e->st.queued = e->n_queue;
    e->st.kv_bytes_used = (e->run ? tqkv_model_state_kv_bytes_used(e->run) : 0) +
                          (e->drun ? tqkv_model_state_kv_bytes_used(e->drun) : 0);
    e->st.kv_bytes_allocated = engine_kv_allocated(e);
    e->st.prefix_cache_bytes = e->pc.bytes;
    if (!b) pthread_cond_broadcast(&e->cv_idle);
    pthread_mutex_unlock(&e->mu);
    if (!b) engine_spares_free(e); /* idle: hold only the weights and the kept prefixes */
    if (busy) *busy = b;
    return rc != TQKV_OK ? rc : rc2;
}

// ---------------------------------------------------------------------------
// Thread, drain, free, stats
// ---------------------------------------------------------------------------

static void *engine_thread(void *arg) {
    tqkv_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && e->n_queue + e->n_pre + e->n_rows == 0)
            pthread_cond_wait(&e->cv_work, &e->mu);
        int stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        int busy = 0;
        tqkv_engine_step(e, &busy);
    }
    return NULL;
}

tqkv_status tqkv_engine_start(tqkv_engine *e) {
    if (!e) return tqkv_fail(TQKV_EINVAL, "engine_start: NULL engine");
    pthread_mutex_lock(&e->mu);
    if (e->started) {
        pthread_mutex_unlock(&e->mu);
        return tqkv_fail(TQKV_ESTATE, "engine_start: already started");
    }
    e->started = 1;
    pthread_mutex_unlock(&e->mu);
    if (pthread_create(&e->thread, NULL, engine_thread, e)) {
        pthread_mutex_lock(&e->mu);
        e->started = 0;
        pthread_mutex_unlock(&e->mu);
        return tqkv_fail(TQKV_ENOMEM, "engine_start: cannot create the engine thread");
    }
    return TQKV_OK;
}

tqkv_status tqkv_engine_drain(tqkv_engine *e) {
    if (!e) return tqkv_fail(TQKV_EINVAL, "engine_drain: NULL engine");
    pthread_mutex_lock(&e->mu);
    e->draining = 1;
    int started = e->started;
    if (started) {
        while (e->n_queue + e->n_pre + e->n_rows > 0) pthread_cond_wait(&e->cv_idle, &e->mu);
        pthread_mutex_unlock(&e->mu);
        return TQKV_OK;
    }
    pthread_mutex_unlock(&e->mu);
    int busy = 1;
    while (busy) {
        tqkv_status rc = tqkv_engine_step(e, &busy);
        if (rc != TQKV_OK && !busy) return rc;
    }
    return TQKV_OK;
}

void tqkv_engine_free(tqkv_engine *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv_work);
    int started = e->started;
    pthread_mutex_unlock(&e->mu);
    if (started) pthread_join(e->thread, NULL);
    /* close every open request */
    while (e->q_head) {
        eng_req *q = e->q_head;
        e->q_head = q->next;
        req_finish_plain(e, q, TQKV_FINISH_CANCELLED, NULL);
        req_free(q);
    }
    for (int i = 0; i < e->n_pre; i++) {
        req_finish_plain(e, e->pre[i], TQKV_FINISH_CANCELLED, NULL);
        req_free(e->pre[i]);
    }
    for (int i = 0; i < e->n_rows; i++) {
        req_finish_plain(e, e->rows[i], TQKV_FINISH_CANCELLED, NULL);
        req_free(e->rows[i]);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv_work);
    pthread_cond_destroy(&e->cv_idle);
    engine_release(e);
}

tqkv_status tqkv_engine_stats_get(tqkv_engine *e, tqkv_engine_stats *out) {
    if (!e || !out) return tqkv_fail(TQKV_EINVAL, "engine_stats_get: NULL argument");
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    out->queued = e->n_queue;
    out->kv_budget = e->p.kv_budget;
    out->prefix_cache_bytes = e->pc.bytes;
    out->prompt_cache_refused = e->pc.refused;
    pthread_mutex_unlock(&e->mu);
    return TQKV_OK;
}

/*
 * model_cuda.h - the model forward pass on the GPU (CUDA backend), C-callable.
 * Owns: a device-side twin of a tqkv_model_state: the weights as bf16 in device memory
 * (uploaded once per model, by its first device state, kept in tqkv_model.gpu_weights and
 * shared by the model's device states; creating a model's FIRST device state concurrently
 * from two threads is not supported), one device KV cache (cuda_kv) per layer, device scratch,
 * the state's CUDA stream and the decode step's CUDA graph, and
 * the Qwen3 / Qwen2 / Llama and Qwen 3.5 graphs run with our own batch-invariant GEMM
 * kernel, the device cache's encode / attention kernels and (Qwen 3.5's gated DeltaNet
 * layers) src/model/arch/qwen35/graph_cuda.cu's kernels on device recurrent rows. Logits are copied back to the host, or a
 * decode step picks each row's next token on the device (model_cuda_decode_pick).
 * Must not: be called when the build has no CUDA (forward.c guards with TQKV_HAVE_CUDA),
 * or make a row's logits depend on the other rows or the batch size.
 *
 * Supported: head_dim 128, q_heads / kv_heads <= 8, DeltaNet key dim 64 / 128 and value
 * dim a multiple of 32 up to 256, K/V tq4/tq4, tq3/tq3, tq2/tq2 or tq K and V with K bits
 * >= V bits (with or without the q8 window), fp8/fp8 (tqkv_cuda_kv_formats_ok), or f32/f32
 * which runs on the device's dense bf16 cache (no window), each layer its own such pair
 * (per-layer formats: tqkv_kv_layers_device_check);
 * prefill without padding (every row's length == n), extend (with extend_as_decode: each
 * query attends as its single decode would), decode; spec rounds; export / upload of the
 * caches in the host state format (tq and fp8 layers only: the bf16 cache has none).
 */
#ifndef TQKV_MODEL_CUDA_H
#define TQKV_MODEL_CUDA_H

#include <stdint.h>

#include "model/sample/pick.h"
#include "tqkv_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct model_cuda model_cuda;
struct model_recurrent;
typedef struct model_cuda_weights model_cuda_weights;

/* Free a model's device weights (tqkv_model_free; NULL is fine). */
void        model_cuda_weights_free(model_cuda_weights *w);

/* Upload the weights and make empty device caches of `rows` rows. */
tqkv_status model_cuda_init(model_cuda **out, const tqkv_model *m,
                            const tqkv_model_state_params *p, int rows);
void        model_cuda_free(model_cuda *g);
/* Empty every layer's cache; rows > 0 changes the row count. */
tqkv_status model_cuda_reset(model_cuda *g, int rows);
/* Tokens held per row: offset [rows]. */
tqkv_status model_cuda_offsets(const model_cuda *g, int *offset);
/* Room for `tokens` tokens per row in every layer's cache, allocated exactly. */
tqkv_status model_cuda_reserve(model_cuda *g, int tokens);
/* Benchmark aid: append n tokens of N(0, 1) K/V to every row of every layer (GPU encode),
 * without running the model. */
tqkv_status model_cuda_fill(model_cuda *g, int n, uint64_t seed);
/* Row operations (each builds every layer's new cache, then installs; a failure leaves g
 * unchanged): append the rows of src[0..n) after g's; keep rows keep[0..n); make dst (a
 * fresh 1-row twin of the same model and parameters) hold a copy of row `row`. */
tqkv_status model_cuda_merge(model_cuda *g, model_cuda *const *src, int n);
tqkv_status model_cuda_filter(model_cuda *g, const int *keep, int n);
tqkv_status model_cuda_extract(const model_cuda *g, int row, model_cuda *dst);
/* The same three operations in two halves, for callers that change several twins in
 * lockstep (a sharded state's ranks, tp/tp_rows.c): the build (every allocation: the new
 * caches and per-row arrays, built on the target's stream; fallible, changes no twin) into
 * *out, then model_cuda_rows_install into the target (g; dst for an extract), which cannot
 * fail and consumes it, or model_cuda_rows_free. The sources must stay unchanged between. */
typedef struct model_cuda_rows model_cuda_rows;
tqkv_status model_cuda_merge_build(model_cuda *g, model_cuda *const *src, int n,
                                   model_cuda_rows **out);
tqkv_status model_cuda_filter_build(model_cuda *g, const int *keep, int n, model_cuda_rows **out);
tqkv_status model_cuda_extract_build(const model_cuda *g, int row, model_cuda *dst,
                                     model_cuda_rows **out);
void        model_cuda_rows_install(model_cuda *g, model_cuda_rows *b);
void        model_cuda_rows_free(model_cuda_rows *b);
/* Every layer holds the same tokens per row and the same spec round (else TQKV_ESTATE). */
tqkv_status model_cuda_check(const model_cuda *g);
/* Spec rounds over every layer's cache, with tqkv_model_state_spec_*'s semantics (the
 * caller has checked the state and the round): begin records each row's offset; commit
 * keeps everything; rollback keeps keep[r] (n_keep 1: keep[0] for every row) of the tokens
 * appended to row r since begin, validated on every layer before any changes. */
tqkv_status model_cuda_spec_begin(model_cuda *g);
tqkv_status model_cuda_spec_commit(model_cuda *g);
tqkv_status model_cuda_spec_rollback(model_cuda *g, const int *keep, int n_keep);
int         model_cuda_spec_active(const model_cuda *g);
/* model_cuda_spec_rollback's validation alone (a round open on every layer, keep within what
 * every row appended): changes nothing. After it succeeds the rollback fails only on a CUDA
 * error (model_cuda_check then reports the twin broken or out of step). */
tqkv_status model_cuda_spec_rollback_check(const model_cuda *g, const int *keep, int n_keep);
/* Layer l's cache as tqkv_batch_export bytes (through host memory; the same bytes as a
 * host batch holding the same tokens). TQKV_EUNSUPPORTED for f32 KV (the device's dense
 * bf16 cache has no state format). */
tqkv_status model_cuda_export_layer(const model_cuda *g, int l, uint8_t **out, size_t *len);
/* The recurrent rows (Qwen 3.5) as rec_export bytes (recurrent.h; *out NULL, *len 0 when
 * the graph has none). A layer without KV rows exports as *out NULL, *len 0. */
tqkv_status model_cuda_export_rec(const model_cuda *g, uint8_t **out, size_t *len);
/* Make every attention layer's cache a copy of host batch layers[l] (rows rows, the
 * configuration of g's caches; linear layers' entries are ignored) and the recurrent rows
 * a copy of rec's (required when the graph has them, else ignored), built first, then
 * installed: a failure leaves g unchanged. */
tqkv_status model_cuda_upload(model_cuda *g, tqkv_batch *const *layers,
                              const struct model_recurrent *rec, int rows);
/* Fixed device bytes one row's recurrent rows take (0 without any). */
size_t      model_cuda_row_fixed_bytes(const model_cuda *g);
/* Device bytes one row of `tokens` tokens takes over all layers (planes, scales, q8 ring);
 * bounded sliding layers hold their keep + `round` tokens (a speculative round's). */
size_t      model_cuda_projected_bytes(const model_cuda *g, int tokens, int round);
/* Device bytes one token takes over all layers, K and V (the dense cache's bf16 for f32). */
size_t      model_cuda_kv_token_bytes(const model_cuda *g);
/* Device bytes held by the caches. */
size_t      model_cuda_kv_bytes(const model_cuda *g);
/* The forward of forward.c (same arguments and logits layout), on the device. Queued on
 * the state's stream and waited for before returning; a decode step (n == 1) runs as a
 * replayed CUDA graph unless graphs are off (params.device_graphs = 0 or the environment
 * variable TQKV_CUDA_GRAPHS=0), with logits bitwise equal to the kernel-by-kernel run. */
tqkv_status model_cuda_forward(model_cuda *g, const int32_t *tokens, const int *lengths, int n,
                               int prefill, tqkv_logits_mode mode, float *logits);
/* One decode step (tokens [rows]) that also picks on the device (pick.h): plan [rows] and
 * the penalty tokens pen [n_pen] go up in one copy queued before the step, the pick kernel
 * and the copy of the records rec [rows, PICK_REC_WORDS(stride)] run inside it, after the
 * lm_head (in its CUDA graph when graphs are on; the stride is in the graph key). logits
 * [rows, V] (NULL: not copied) gets the full rows as model_cuda_forward would, copied
 * before the penalty changes them (rows planned PICK_NONE need them). Same failure
 * behaviour as model_cuda_forward. */
tqkv_status model_cuda_decode_pick(model_cuda *g, const int32_t *tokens, const pick_row *plan,
                                   const int32_t *pen, int n_pen, int stride, float *logits,
                                   int32_t *rec);

/* The norm kernels (forward_cuda.cu's RMSNorm, Gemma 4's) keep a thread's values in
 * registers between their passes (1, the default unless the environment has
 * TQKV_NORM_REGS=0) or run passes of loads (0): the same bits; -1: as the environment says
 * (what tests put back). For tests and A/B runs; not while a forward runs on another thread. */
void        model_cuda_set_norm_regs(int on);
/* The common graph's decode writes each K and V head into the cache from the kernel that
 * normalises and rotates it (1, the default unless the environment has TQKV_QKV_ENCODE=0;
 * caches without a q8 window, not fp8: tqkv_cuda_kv_append_begin) or through kb / vb and the
 * cache's encode launch (0): the same bytes; -1: as the environment says. For tests and A/B
 * runs; not while a forward runs on another thread. */
void        model_cuda_set_qkv_encode(int on);
/* The queued launches of that fused form in this process so far (captured ones count once),
 * for the tests. */
unsigned long model_cuda_qkv_encode_runs(void);
/* The forward's RMSNorm alone, for its tests: on T rows of H (device pointers), x += add
 * (when add), out = w (x r) and with xf out's GEMM split (`parts`: 1 or 2, [parts, T, H]
 * bf16), on the legacy stream. */
tqkv_status model_cuda_rmsnorm(float *x, const float *add, const float *w, float eps, int H,
                               float *out, uint16_t *xf, int parts, int T);

/* ---- tensor parallelism on the device (tp_cuda.cu; docs/TP.md) ---- */
struct model_tp;
struct tp_comm;
/* CUDA devices visible (0 when none or no driver). */
int         model_cuda_device_count(void);
tqkv_status model_cuda_set_device(int device);
/* The same on cleanup paths: a failure is ignored and leaves the last error message alone. */
void        model_cuda_select_device(int device);
/* After a sharded state's rank states (device states of the rank models, on GPUs
 * tp->device[r]) are made: each rank's lm_head slice width and the o_proj biases on every
 * rank's GPU. Ends with GPU tp->device[0] current. */
tqkv_status model_cuda_tp_setup(tqkv_model_state *s);
/* Frees what model_cuda_tp_setup made (and the state's decode graph). */
void        model_cuda_tp_free(struct model_tp *tp);
/* A communicator for n ranks of this process on GPUs device[0..n): NCCL
 * (tp_comm_init_nccl_local) when the GPUs are all distinct and NCCL is built in, else the
 * device-local backend (several ranks on one GPU). Ends with GPU device[0] current. The
 * sharded states of one model and N share one (tp_state.c keeps it, refcounted). */
tqkv_status model_cuda_tp_comm_init(int n, const int *device, struct tp_comm **out);
/* The sharded forward of a state whose ranks are device states: model_cuda_forward's
 * arguments and logits layout (the caller has run model_forward_check); direct launches,
 * or with the sharded graphs on (TQKV_TP_GRAPHS=1; unset: TP_GRAPHS_DEFAULT in tp_cuda.cu;
 * any other value: off) and the ranks' device_graphs on, decode steps as one CUDA graph over
 * every rank's stream (a new shape direct, captured when it repeats or when the shared
 * communicator's scratch moved, then replayed; a failed capture turns them off for the
 * state, said on stderr).
 * On failure every rank's appends are undone. */
tqkv_status model_cuda_tp_forward(tqkv_model_state *s, const int32_t *tokens, const int *lengths,
                                  int n, int prefill, tqkv_logits_mode mode, float *logits);
/* How a sharded device state's decode steps ran through its graph (tests): captured,
 * replayed, direct (a new shape); all 0 while the sharded graphs are off. */
void        model_cuda_tp_graph_counts(const tqkv_model_state *s, uint64_t *captures,
                                       uint64_t *replays, uint64_t *direct);

/* How the decode steps of a state ran (tests, benchmarks). A step whose graph key is new
 * runs kernel by kernel; the next with the same key is captured (applied to the existing
 * executable graph through cudaGraphExecUpdate when the topology allows, else
 * instantiated) and launched; the following ones replay it. */
typedef struct {
    int      enabled;        /* graphs on for this state */
    uint64_t direct;         /* decode steps launched kernel by kernel */
    uint64_t captures;       /* decode steps captured, then launched as a graph */
    uint64_t updates;        /* of those, applied to the existing executable (no instantiation) */
    uint64_t replays;        /* decode steps that replayed a graph without capturing */
    uint64_t invalidations;  /* executable graphs dropped (row operations, reset, reserve) */
} model_cuda_graph_stats;
void        model_cuda_graph_stats_get(const model_cuda *g, model_cuda_graph_stats *out);

#ifdef __cplusplus
}
#endif

#endif

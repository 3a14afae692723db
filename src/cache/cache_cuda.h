/*
 * cache_cuda.h - the batched KV cache in GPU memory (CUDA backend), C-callable.
 * Owns: the device copy of a tqkv_batch's layout (same planes, same bytes as batch.h:
 * data [rows, kv_heads, cap, payload], scales [rows, kv_heads, cap, n_scales], the q8 ring
 * [rows, kv_heads, ring, head_dim] + [.., head_dim / 32]), its per-row state mirrored on
 * the host, the GPU encode (append) and the GPU decode attention entry points, and a dense
 * bf16 baseline layout [rows, kv_heads, cap, head_dim] bf16 that is NOT a tqkv format (it
 * exists only to measure the compressed kernels against).
 * Internal (not exported): linked into libtqkv-model, whose GPU forward is its only
 * caller besides the CLI and the tests (libtqkv's public API has no device entry).
 * Must not: define a second byte format for tq/q8 data, or be called when tqkv_cuda_available()
 * is 0. Every entry returns tqkv_status and calls tqkv_fail on failure.
 *
 * Supported on the device: head_dim 128 or 256; K/V formats tq4/tq4 and tq3/tq3 (with or
 * without the q8 window; the tuned tensor-core decode kernels), fp8/fp8 (no window), tq2/tq2
 * and the mixed tq4/tq3, tq4/tq2, tq3/tq2 (with or without the window; these and fp8 decode
 * on the float32 split kernel of attn_cuda_fmt.cu), or the bf16 baseline (no window);
 * q_heads / kv_heads <= 8.
 * head_dim 256 has the same encode, masked attention and row operations; its decode
 * attention is the tensor-core split kernel at 256 for tq (batch invariant, capture safe) and a
 * float32 split-KV kernel for the bf16 baseline (and for tq with TQKV_WIDE_TC=0).
 */
#ifndef TQKV_CACHE_CUDA_H
#define TQKV_CACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "codec/codec_cuda_dims.h" /* CUDA_DIM, CUDA_DIM_WIDE */
#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tqkv_batch;

#define CUDA_MAX_G 8          /* q_heads / kv_heads */
#define CUDA_MAX_ROWS 1024    /* rows of one decode attention call (its work-item scan) */

typedef struct cuda_kv cuda_kv;

/* 1 when the device cache holds K format k with V format v (tqkv_cuda_kv_init's rule, also
 * for callers that pick formats without a device: presets, the model's checks): tq4/tq4,
 * tq3/tq3, fp8/fp8, or tq K and V with K bits >= V bits (tq2/tq2, tq4/tq3, tq4/tq2, tq3/tq2). */
static inline int tqkv_cuda_kv_formats_ok(tqkv_format k, tqkv_format v) {
    if (k == TQKV_FP8 || v == TQKV_FP8) return k == v;
    const int kb = k == TQKV_TQ4 ? 4 : k == TQKV_TQ3 ? 3 : k == TQKV_TQ2 ? 2 : 0;
    const int vb = v == TQKV_TQ4 ? 4 : v == TQKV_TQ3 ? 3 : v == TQKV_TQ2 ? 2 : 0;
    return kb && vb && kb >= vb;
}

/* 1 when a CUDA device is usable (driver present, >= 1 device), else 0 (never fails). */
int tqkv_cuda_available(void);
/* Name, SM count, memory clock (kHz) and bus width of device 0 (for reports). */
tqkv_status tqkv_cuda_device_info(char *name, size_t cap, int *sms, int *mem_clock_khz,
                                  int *bus_bits, int *sm_clock_khz);

/* An empty device cache of `rows` rows with room for `cap` tokens each; cfg->head_dim
 * CUDA_DIM or CUDA_DIM_WIDE (else TQKV_EUNSUPPORTED, nothing allocated).
 * bf16 != 0: the dense bf16 baseline (cfg formats ignored, no window; head_dim 128 or 256). */
tqkv_status tqkv_cuda_kv_init(cuda_kv **out, const tqkv_cache_config *cfg, int bf16, int rows,
                              int cap);
void        tqkv_cuda_kv_free(cuda_kv *kv);
/* Run every later kernel and copy of kv on `stream` (a cudaStream_t; NULL = the legacy
 * default stream, where a new cache starts), after waiting for the work queued on the old
 * one. Row operations give the caches they make the source's stream. Calls that return
 * data to the host (offsets aside: a host mirror) wait for the stream themselves. */
tqkv_status tqkv_cuda_kv_set_stream(cuda_kv *kv, void *stream);
/* Process-unique id of kv's device storage: it changes whenever the planes, the ring or
 * the row table move (init, regrow, row operations that install new storage), so a CUDA
 * graph that captured kv's pointers can tell it is stale. */
uint64_t    tqkv_cuda_kv_storage_id(const cuda_kv *kv);
/* Room for `tokens` tokens per row (after its left padding), allocated exactly (appends
 * otherwise grow the planes geometrically, with old and new planes both held while rows
 * move). A cap already large enough is kept. */
tqkv_status tqkv_cuda_kv_reserve(cuda_kv *kv, int tokens);
/* The cache's head_dim (CUDA_DIM or CUDA_DIM_WIDE). */
int         tqkv_cuda_kv_head_dim(const cuda_kv *kv);
/* Bytes of device memory held by the planes and rings. */
size_t      tqkv_cuda_kv_bytes(const cuda_kv *kv);

/* Copy a host cache (same config, rows <= kv rows, columns <= cap) into kv: bytes, rings
 * and row state (offset, left_pad, win_lo). */
tqkv_status tqkv_cuda_kv_upload(cuda_kv *kv, const struct tqkv_batch *b);
/* Copy the device planes back: kd/vd [rows, kv_heads, cap, payload], ks/vs
 * [rows, kv_heads, cap, n_scales], kw/vw [rows, kv_heads, ring, head_dim] int8 and
 * kws/vws [rows, kv_heads, ring, head_dim/32] (NULL pointers are skipped). */
tqkv_status tqkv_cuda_kv_download(const cuda_kv *kv, uint8_t *kd, uint16_t *ks, uint8_t *vd,
                                  uint16_t *vs, int8_t *kw, uint16_t *kws, int8_t *vw,
                                  uint16_t *vws);
/* Rows' token counts and left padding [rows] (host mirror). */
const int  *tqkv_cuda_kv_offsets(const cuda_kv *kv);
const int  *tqkv_cuda_kv_left_pads(const cuda_kv *kv);

/* GPU encode: append n tokens to every row. k, v: DEVICE pointers [rows, kv_heads, n,
 * head_dim] float (original domain); bytes equal to tqkv_batch_append's. Asynchronous on
 * kv's stream (k and v are read there); the host mirror (offsets) is updated at once.
 * Grows the storage first when a row lacks room (geometric growth: a new storage id). */
tqkv_status tqkv_cuda_kv_append(cuda_kv *kv, const float *k, const float *v, int n);
/* tqkv_cuda_kv_append around the caller's own encode: for a kernel that computes K and V
 * itself and encodes them where it computes them (codec/codec_cuda_encode.cuh's
 * ce_encode_vec on *A's planes and codecs, each vector at its row's A->rows[r].col0 +
 * column; CUDA C++ only, *A a ce_args). _begin: *fused = 1 when the cache takes that form (a
 * d = 128 tq or bf16 cache without a q8 window, rows > 0): the growth done and *A filled
 * (k and v NULL); else *fused = 0 and nothing changed (use tqkv_cuda_kv_append). _end, after
 * that kernel is queued on kv's stream: the rows advance by n (device and host mirror), as
 * tqkv_cuda_kv_append's end; the same bytes. */
struct ce_args;
tqkv_status tqkv_cuda_kv_append_begin(cuda_kv *kv, int n, struct ce_args *A, int *fused);
tqkv_status tqkv_cuda_kv_append_end(cuda_kv *kv, int n);
/* The growth of tqkv_cuda_kv_append for an append of n tokens, alone (so an append that
 * follows allocates nothing: e.g. one captured into a CUDA graph). */
tqkv_status tqkv_cuda_kv_reserve_append(cuda_kv *kv, int n);
/* The host half of tqkv_cuda_kv_append (offsets and window bounds advance by n) for an
 * append whose kernels ran without it: a CUDA graph replaying a captured append (its
 * kernels advance the device row table). Needs room for n more tokens in every row. */
tqkv_status tqkv_cuda_kv_replayed_append(cuda_kv *kv, int n);

/* The decode attention kernels' one-time setup (shared-memory attributes, persistent grid
 * sizes, a check of where shared memory starts); thread safe, idempotent. Called by the
 * first attention call and by every device model state at init (so it is never first
 * called inside a CUDA graph capture). */
tqkv_status tqkv_cuda_attn_setup(void);
/* 1 when d = 256 decode attention over tq caches runs the tensor-core split kernel, 0 when it
 * runs the float32 one (TQKV_WIDE_TC=0 in the environment when the setup ran, or a build with
 * -DTQKV_WIDE_TC=0); -1 when the setup fails. Runs the setup. */
int tqkv_cuda_wide_tc(void);
/* Whether decode attention's tensor-core path (tq formats, fp8 and the bf16 baseline at d =
 * 128; tq4 / tq3 at 256) launches its split kernel and merge with Programmatic Dependent
 * Launch (sm_90), and so do the query prep and the append's encode and row advance (each
 * waits for the kernel before it first): a kernel's launch overlaps the one before it; every
 * output bit is the same either way. on = 1 / 0 sets it, on < 0 only asks; returns the setting
 * before the call (1 on, 0 off). On unless set off here or TQKV_ATTN_PDL=0 is in the
 * environment when the setup first runs. Not to be changed while a call is being captured into
 * a graph (the capture keeps the launches made). */
int tqkv_cuda_attn_pdl(int on);

/* GPU decode attention (one query per row). q: DEVICE [rows, q_heads, head_dim] float,
 * out: DEVICE [rows, q_heads, head_dim] float. Asynchronous on kv's stream: synchronize it
 * (tqkv_cuda_sync() for the legacy default stream) before reading out on the host.
 * Split-KV with a per-row split that depends only on that row's token count (batch
 * invariant): d = 128 the tensor-core split kernel; d = 256 the same kernel at 256 for tq4 /
 * tq3 (or, with TQKV_WIDE_TC=0 in the environment, and always for the dense bf16 cache, a
 * float32 split kernel), each row's length from the device row table. Its launch
 * shape may depend on the host only through kv's rows and storage,
 * q_heads, the workspace pointer and max over rows of tqkv_cuda_attend_ws_bytes(rows,
 * q_heads, that row's tokens) (the model's CUDA graph of a decode step keys on these). */
tqkv_status tqkv_cuda_kv_attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out);
/* The same with a caller's workspace (e.g. one shared by every layer of a model state,
 * which run one after another on one stream) of at least
 * tqkv_cuda_attend_ws_bytes_dim(rows, q_heads, the longest row's tokens, head_dim) bytes
 * (monotone in max_tokens); TQKV_ERANGE when it is smaller. */
size_t      tqkv_cuda_attend_ws_bytes(int rows, int q_heads, int max_tokens);
/* The same for a cache of head_dim `head_dim` (128 or 256): tqkv_cuda_attend_ws_bytes at
 * 128; at 256 the partials of 4x d = 128's split bound plus the queries, so it changes
 * exactly where the 128 figure does (monotone in max_tokens). A workspace shared by layers
 * of both dims needs the larger of the two; that maximum changes whenever either does. */
size_t      tqkv_cuda_attend_ws_bytes_dim(int rows, int q_heads, int max_tokens,
                                          int head_dim);
tqkv_status tqkv_cuda_kv_attend_ws(cuda_kv *kv, const float *q, int q_heads, float scale,
                                   float *out, void *ws, size_t ws_bytes);
/* tqkv_cuda_kv_attend_ws that also writes the output's GEMM split where it can (the
 * head_dim-128 split kernels of tq and the dense bf16 cache: their merge), so the GEMM that
 * reads it needs no kernel between: xf DEVICE [parts, rows q_heads head_dim] bf16 (16-byte
 * aligned; util/cuda_split.cuh's hi, then lo when parts = 2), or NULL. *xf_done: 1 when xf
 * was written, 0 when only out was (the caller splits out itself). */
tqkv_status tqkv_cuda_kv_attend_ws_xf(cuda_kv *kv, const float *q, int q_heads, float scale,
                                      float *out, uint16_t *xf, int parts, void *ws,
                                      size_t ws_bytes, int *xf_done);

/* GPU attention of n_query queries per row with visible ranges (prefill, windows):
 * q, out: DEVICE [rows, q_heads, n_query, head_dim] float; lo, hi: HOST [rows, n_query]
 * column ranges [lo, hi) as in tqkv_mask (token t is column left_pad + t; lo == hi: zeros).
 * The tensor-core kernel (fp16 / bf16 operands, float32 accumulation, as decode):
 * asynchronous on kv's stream (synchronize it before reading out on the host; the ranges
 * go through a pinned buffer of kv, so the caller's lo / hi may change on return). With
 * tqkv_cuda_prefill_tc(0) or TQKV_PREFILL_TC=0 the float32 kernel, synchronous. */
/* Which masked kernel runs: 2 the 8-warp tensor-core one (the default), 1 the 4-warp
 * tensor-core one it replaced (TQKV_PREFILL_TC=1), 0 the float32 one, -1 leaves it.
 * Returns the choice now (-1 when the setup fails). For tests and A/B runs. */
int tqkv_cuda_prefill_tc(int on);
tqkv_status tqkv_cuda_kv_attend_masked(cuda_kv *kv, const float *q, int n_query, int q_heads,
                                       float scale, const int32_t *lo, const int32_t *hi,
                                       float *out);

// ---- row operations in device memory (cache_cuda_rows.cu; semantics of the tqkv_batch_*
// calls of the same names: encoded bytes are copied, never decoded) ----------------------
tqkv_status tqkv_cuda_kv_trim(cuda_kv *kv, int n);
/* In place (no new storage, the same storage id) when keep is in an order util/keep_order.h
 * accepts: rows that stay shift left by the kept rows' common pad on the device, the others
 * move; with holes filled from the tail only the tail rows move. Any other order rebuilds
 * (tqkv_cuda_kv_select, then installed). The row room (row_cap) stays for rows that join
 * next, unless most rows left. */
tqkv_status tqkv_cuda_kv_filter(cuda_kv *kv, const int *keep, int n_keep);
/* tqkv_batch_append_rows on the device: the items' rows join kv's after its last row, in
 * place, each ending at the rows' last end column (or, when longer, at its own length:
 * left_pad 0); only the joining rows are copied. _reserve makes every allocation it needs
 * first (room for the columns and rows: a regrow, with an eighth of the rows spare and a new
 * storage id), so that an append_rows with the same items after it allocates nothing and
 * fails only on a CUDA error. Items must differ from kv, share its config and be outside a
 * spec round; returns once the copies are done (the caller may free the items). _queue: the
 * same, but returns with the copies queued on kv's stream (the caller waits for that stream
 * before it frees or changes the items: one wait for many caches on one stream). */
tqkv_status tqkv_cuda_kv_append_rows_reserve(cuda_kv *kv, cuda_kv *const *items, int n_items);
tqkv_status tqkv_cuda_kv_append_rows(cuda_kv *kv, cuda_kv *const *items, int n_items);
tqkv_status tqkv_cuda_kv_append_rows_queue(cuda_kv *kv, cuda_kv *const *items, int n_items);
/* A new cache holding rows keep[0..n_keep) of kv in that order (kv unchanged): the
 * storage tqkv_cuda_kv_filter installs. */
tqkv_status tqkv_cuda_kv_select(const cuda_kv *kv, const int *keep, int n_keep, cuda_kv **out);
/* Device bytes per token of one row (K + V planes and scales; the q8 ring aside) and the
 * ring's fixed bytes per row. */
size_t      tqkv_cuda_kv_token_bytes(const cuda_kv *kv, size_t *ring_bytes_per_row);
tqkv_status tqkv_cuda_kv_align(cuda_kv *kv, const int *left_pad);
tqkv_status tqkv_cuda_kv_extract(const cuda_kv *kv, int row, cuda_kv **out);
/* New cache whose rows are all the items' rows in order, right-aligned (left-padded). */
tqkv_status tqkv_cuda_kv_merge(cuda_kv **out, cuda_kv *const *items, int n_items);
tqkv_status tqkv_cuda_kv_spec_begin(cuda_kv *kv);
tqkv_status tqkv_cuda_kv_spec_commit(cuda_kv *kv);
tqkv_status tqkv_cuda_kv_spec_rollback(cuda_kv *kv, const int *keep, int n_keep);
/* 1 while a spec round is open; each row's offset at spec_begin [rows] (host mirror). */
int         tqkv_cuda_kv_spec_active(const cuda_kv *kv);
const int  *tqkv_cuda_kv_spec_bases(const cuda_kv *kv);
/* Drop the newest n tokens of every row, also inside a spec round (not below a row's
 * spec_begin offset): tqkv_batch_rewind's semantics (the undo of a failed forward). */
tqkv_status tqkv_cuda_kv_rewind(cuda_kv *kv, int n);

/* ---- sliding-window layers (cache_cuda_slide.cu, the device form of batch_slide.c) ---- */
/* Scratch for window views and drops: a view row table, per-row shifts and a rotated copy
 * of one cache's q8 ring. One serves every cache of the same rows / kv heads / ring / dim,
 * one call at a time, in the caches' stream order. */
typedef struct cuda_kv_slide cuda_kv_slide;
tqkv_status tqkv_cuda_slide_init(cuda_kv_slide **out);
/* Frees the buffers: the caller has waited for the stream that used them. */
void tqkv_cuda_slide_free(cuda_kv_slide *s);
/* Size s for kv (before any capture: views then allocate nothing); *moved = 1 when the
 * buffers were reallocated (a captured graph holding the old ones must be dropped). */
tqkv_status tqkv_cuda_slide_reserve(cuda_kv_slide *s, const cuda_kv *kv, int *moved);
/* A view of kv whose rows are each row's newest `window` tokens as the cache stood `back`
 * tokens ago (its q8 ring rotated to match): attend over *view with tqkv_cuda_kv_attend_ws.
 * Queued on kv's stream, capture safe; *view is owned by s and valid until the next call
 * on s or a change of kv. */
tqkv_status tqkv_cuda_kv_window_view(cuda_kv *kv, cuda_kv_slide *s, int window, int back,
                                     cuda_kv **view);
/* tqkv_batch_drop_oldest(kv, keep) on a device cache: each row's oldest tokens beyond keep
 * token), win_lo follows; once every row's padding reaches keep the common padding goes (a
 * filter of every row, as the CPU's compaction: in place, the rows' tokens shifted left on
 * the device, the same storage id). Refused in a spec round. */
tqkv_status tqkv_cuda_kv_drop_oldest(cuda_kv *kv, cuda_kv_slide *s, int keep);
/* Decode attention (tqkv_cuda_kv_attend_ws: q, out DEVICE [rows, q_heads, head_dim]) as the
 * cache stood `back` tokens ago: every row sees only its first offset - back tokens
 * (0 <= back <= every row's offset). The same bits as the decode call made then when the
 * cache has no q8 window or back <= window_slack (the ring still holds what that call
 * read). Speculative verification (extend_as_decode). The row table is uploaded before and
 * after (copies on kv's stream); the cache is unchanged. */
tqkv_status tqkv_cuda_kv_attend_back(cuda_kv *kv, int back, const float *q, int q_heads,
                                     float scale, float *out, void *ws, size_t ws_bytes);
/* The bytes of tqkv_batch_export for the same state (through host memory), and back. */
tqkv_status tqkv_cuda_kv_export(const cuda_kv *kv, uint8_t **out, size_t *len);
tqkv_status tqkv_cuda_kv_restore(cuda_kv **out, const uint8_t *buf, size_t len);

// ---- small device-memory helpers for tests and benchmarks ----------------------------
tqkv_status tqkv_cuda_malloc(void **p, size_t bytes);
void        tqkv_cuda_free(void *p);
tqkv_status tqkv_cuda_h2d(void *dst, const void *src, size_t bytes);
tqkv_status tqkv_cuda_d2h(void *dst, const void *src, size_t bytes);
tqkv_status tqkv_cuda_sync(void);
/* Free and total bytes of device 0's memory (cudaMemGetInfo). */
tqkv_status tqkv_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);
/* Fill x [n] with N(0, sd) pseudo-random floats from (seed) on the device. */
tqkv_status tqkv_cuda_fill_normal(float *x, size_t n, uint64_t seed, float sd);
/* The same queued on `stream` (a cudaStream_t), without waiting. */
tqkv_status tqkv_cuda_fill_normal_on(float *x, size_t n, uint64_t seed, float sd,
                                     void *stream);
/* Median over reps of (cudaEvent) milliseconds of a device-to-device copy of bytes. */
tqkv_status tqkv_cuda_copy_ms(size_t bytes, int reps, double *ms);
/* CUDA graph helpers for tests (cudaStream_t / cudaGraphExec_t as void *): a non-blocking
 * stream; capture of what is queued on it between begin and end
 * (cudaStreamCaptureModeThreadLocal: a call that allocates or waits inside fails the
 * capture) into an executable graph; its launch on a stream; waiting for a stream. */
tqkv_status tqkv_cuda_stream_create(void **stream);
void        tqkv_cuda_stream_destroy(void *stream);
tqkv_status tqkv_cuda_stream_sync(void *stream);
tqkv_status tqkv_cuda_capture_begin(void *stream);
tqkv_status tqkv_cuda_capture_end(void *stream, void **exec);
tqkv_status tqkv_cuda_graph_launch(void *exec, void *stream);
void        tqkv_cuda_graph_free(void *exec);
/* Event timer: start, then stop returning milliseconds since start. */
tqkv_status tqkv_cuda_timer_start(void **t);
tqkv_status tqkv_cuda_timer_stop(void *t, double *ms);

#ifdef __cplusplus
}
#endif

#endif

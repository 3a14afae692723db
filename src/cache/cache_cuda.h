/*
 * cache_cuda.h - the batched KV cache in GPU memory (CUDA backend), C-callable.
 * Owns: the device copy of a tqkv_batch's layout (same planes, same bytes as batch.h:
 * data [rows, kv_heads, cap, payload], scales [rows, kv_heads, cap, n_scales], the q8 ring
 * [rows, kv_heads, ring, head_dim] + [.., head_dim / 32]), its per-row state mirrored on
 * the host, the GPU encode (append) and the GPU decode attention entry points, and a dense
 * bf16 baseline layout [rows, kv_heads, cap, head_dim] bf16 that is NOT a tqkv format (it
 * exists only to measure the compressed kernels against).
 * Must not: define a second byte format for tq/q8 data, or be called when cuda_available()
 * is 0. Every entry returns tqkv_status and calls tqkv_fail on failure.
 *
 * Supported on the device: head_dim 128; K/V formats tq4/tq4 and tq3/tq3 (with or without
 * the q8 window), or the bf16 baseline; q_heads / kv_heads <= 8.
 */
#ifndef TQKV_CACHE_CUDA_H
#define TQKV_CACHE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tqkv_batch;

typedef struct cuda_kv cuda_kv;

/* 1 when a CUDA device is usable (driver present, >= 1 device), else 0 (never fails). */
int cuda_available(void);
/* Name, SM count, memory clock (kHz) and bus width of device 0 (for reports). */
tqkv_status cuda_device_info(char *name, size_t cap, int *sms, int *mem_clock_khz,
                             int *bus_bits, int *sm_clock_khz);

/* An empty device cache of `rows` rows with room for `cap` tokens each.
 * bf16 != 0: the dense bf16 baseline (cfg formats ignored, no window). */
tqkv_status cuda_kv_init(cuda_kv **out, const tqkv_cache_config *cfg, int bf16, int rows,
                         int cap);
void        cuda_kv_free(cuda_kv *kv);
/* Bytes of device memory held by the planes and rings. */
size_t      cuda_kv_bytes(const cuda_kv *kv);

/* Copy a host cache (same config, rows <= kv rows, columns <= cap) into kv: bytes, rings
 * and row state (offset, left_pad, win_lo). */
tqkv_status cuda_kv_upload(cuda_kv *kv, const struct tqkv_batch *b);
/* Copy the device planes back: kd/vd [rows, kv_heads, cap, payload], ks/vs
 * [rows, kv_heads, cap, n_scales], kw/vw [rows, kv_heads, ring, head_dim] int8 and
 * kws/vws [rows, kv_heads, ring, head_dim/32] (NULL pointers are skipped). */
tqkv_status cuda_kv_download(const cuda_kv *kv, uint8_t *kd, uint16_t *ks, uint8_t *vd,
                             uint16_t *vs, int8_t *kw, uint16_t *kws, int8_t *vw,
                             uint16_t *vws);
/* Rows' token counts [rows] (host mirror). */
const int  *cuda_kv_offsets(const cuda_kv *kv);

/* GPU encode: append n tokens to every row. k, v: DEVICE pointers [rows, kv_heads, n,
 * head_dim] float (original domain); bytes equal to tqkv_batch_append's. Synchronous. */
tqkv_status cuda_kv_append(cuda_kv *kv, const float *k, const float *v, int n);

/* GPU decode attention (one query per row). q: DEVICE [rows, q_heads, head_dim] float,
 * out: DEVICE [rows, q_heads, head_dim] float. Asynchronous on the default stream: call
 * cuda_sync() before reading out on the host. Split-KV with a per-row split that depends
 * only on that row's token count (batch invariant). */
tqkv_status cuda_kv_attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out);

/* GPU attention of n_query queries per row with visible ranges (prefill, windows):
 * q, out: DEVICE [rows, q_heads, n_query, head_dim] float; lo, hi: HOST [rows, n_query]
 * column ranges [lo, hi) as in tqkv_mask (token t is column left_pad + t; lo == hi: zeros).
 * Float32 (attn_cuda_prefill.cu). Synchronous. */
tqkv_status cuda_kv_attend_masked(cuda_kv *kv, const float *q, int n_query, int q_heads,
                                  float scale, const int32_t *lo, const int32_t *hi, float *out);

// ---- row operations in device memory (cache_cuda_rows.cu; semantics of the tqkv_batch_*
// calls of the same names: encoded bytes are copied, never decoded) ----------------------
tqkv_status cuda_kv_trim(cuda_kv *kv, int n);
tqkv_status cuda_kv_filter(cuda_kv *kv, const int *keep, int n_keep);
tqkv_status cuda_kv_align(cuda_kv *kv, const int *left_pad);
tqkv_status cuda_kv_extract(const cuda_kv *kv, int row, cuda_kv **out);
/* New cache whose rows are all the items' rows in order, right-aligned (left-padded). */
tqkv_status cuda_kv_merge(cuda_kv **out, cuda_kv *const *items, int n_items);
tqkv_status cuda_kv_spec_begin(cuda_kv *kv);
tqkv_status cuda_kv_spec_commit(cuda_kv *kv);
tqkv_status cuda_kv_spec_rollback(cuda_kv *kv, const int *keep, int n_keep);
/* The bytes of tqkv_batch_export for the same state (through host memory), and back. */
tqkv_status cuda_kv_export(const cuda_kv *kv, uint8_t **out, size_t *len);
tqkv_status cuda_kv_restore(cuda_kv **out, const uint8_t *buf, size_t len);

// ---- small device-memory helpers for tests and benchmarks ----------------------------
tqkv_status cuda_malloc(void **p, size_t bytes);
void        cuda_free(void *p);
tqkv_status cuda_h2d(void *dst, const void *src, size_t bytes);
tqkv_status cuda_d2h(void *dst, const void *src, size_t bytes);
tqkv_status cuda_sync(void);
/* Fill x [n] with N(0, sd) pseudo-random floats from (seed) on the device. */
tqkv_status cuda_fill_normal(float *x, size_t n, uint64_t seed, float sd);
/* Median over reps of (cudaEvent) milliseconds of a device-to-device copy of bytes. */
tqkv_status cuda_copy_ms(size_t bytes, int reps, double *ms);
/* Event timer: start, then stop returning milliseconds since start. */
tqkv_status cuda_timer_start(void **t);
tqkv_status cuda_timer_stop(void *t, double *ms);

#ifdef __cplusplus
}
#endif

#endif

/*
 * pick_cuda.h - the device pick kernel (pick_cuda.cu), C-callable: per row of device logits,
 * the repetition penalty in place, then the greedy argmax or the top-k candidates of the
 * CPU sampler's order, written as pick.h's result records.
 * Owns: nothing (no buffers): the caller passes the logits, the uploaded plan and the
 * record buffer, so any decode step (the model twin's, a later tensor-parallel shard's)
 * can queue it.
 * Must not: allocate, wait or read anything from the host (it is captured in the decode
 * step's CUDA graph).
 */
#ifndef TQKV_PICK_CUDA_H
#define TQKV_PICK_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "model/sample/pick.h"
#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Queue the pick of `rows` rows on `stream` (a cudaStream_t; NULL: the legacy stream).
 * logits [rows, ld] device floats, V <= ld valid per row: the penalty is applied in place.
 * in: device copy of the upload, pick_row [rows] then the int32 penalty tokens (pick.h);
 * rec: device [rows, PICK_REC_WORDS(stride)] int32; stride >= every row's k, k <=
 * PICK_TOP_K_MAX and k < V for TOP_K rows. Up to 8 rows: one cluster of 8 1024-thread
 * CTAs per row (a greedy row's argmax split over them, other rows in the first alone);
 * more rows: one 1024-thread CTA per row. */
tqkv_status pick_cuda_queue(float *logits, size_t ld, int rows, int V, const void *in,
                            int stride, int32_t *rec, void *stream);

/* Greedy rows split over a cluster (1, the default unless the environment has
 * TQKV_PICK_SPLIT=0) or one CTA per row (0): the same records and penalized logits; -1: as
 * the environment says (what tests put back). The split launches clusters of 8 CTAs (sm_90);
 * TQKV_PICK_SPLIT=0 avoids them. For tests and A/B runs; not while a pick is queued on
 * another thread. */
void        pick_cuda_set_split(int on);

/* A split launch the runtime refuses (clusters unsupported, its resources refused) falls
 * back to one CTA per row for that call, clears the CUDA error and is remembered for the
 * process: pick_cuda_split_refused() is 1 from then on (pick_cuda_set_split forgets it).
 * pick_cuda_split_force_refusal(1), for tests: every split launch is made with an
 * impossible block size, a real launch error the runtime refuses; 0: normal launches. */
int         pick_cuda_split_refused(void);
void        pick_cuda_split_force_refusal(int on);

#ifdef __cplusplus
}
#endif

#endif

/*
 * batch.h - internal layout of the batched cache (and the single cache built on it).
 * Owns: row storage, per-row offsets / left padding, the q8 recent window, spec and
 * prefill state. Attention kernels read this layout directly.
 * Must not: run attention or know about models.
 *
 * Storage (one plane per K and per V), every row's planes contiguous per head:
 *   data   [rows, kv_heads, cap, payload]      encoded main-format vectors
 *   scales [rows, kv_heads, cap, n_scales]     fp16 scales of those vectors
 * Token t of row r sits at column left_pad[r] + t (0 <= t < offset[r]); columns before
 * left_pad[r] are padding and are never read. Rows may end at different columns.
 *
 * Recent window (tq planes only, cfg.window > 0): every appended vector is encoded to
 * the main format AND, in the rotated domain, to q8 in a ring of `ring` slots:
 *   win_data   [rows, kv_heads, ring, head_dim]   int8
 *   win_scales [rows, kv_heads, ring, head_dim/32] fp16
 * Token t lives in ring slot t % ring. Readers take token t from the ring when
 *   t >= offset - window  and  t >= win_lo[r]   (win_lo: oldest token whose q8 copy
 * is still in the ring), else from the main plane. So trimming / rolling back by up
 * to window_slack tokens restores exactly the bytes a fresh cache would hold.
 *
 * Per-query window (attention with n_query > 1): query i of an append of n tokens sits at
 * token p = offset - n + i and reads token t from its q8 copy when t >= p + 1 - window
 * (and a copy exists), exactly what a decode step at p reads. An append longer than
 * window_slack + 1 pushes copies that its own early queries need out of the ring, so the
 * append also keeps them in a side buffer (transient, never exported):
 *   ext_data   [rows, kv_heads, ext_cap, head_dim]   int8 (q8 of the rotated vector)
 *   ext_scales [rows, kv_heads, ext_cap, head_dim/32] fp16
 * Row r holds tokens [ext_lo[r], ext_hi[r]) (ext_hi == win_lo after the append), valid
 * while ext_valid and offset[r] == ext_off[r] (any reshaping clears ext_valid).
 */
#ifndef TQKV_BATCH_H
#define TQKV_BATCH_H

#include <stdint.h>

#include "codec/codec.h"
#include "tqkv.h"

typedef struct {
    struct tqkv_codec codec;    /* main format of this plane */
    struct tqkv_codec q8;       /* q8 codec for the window (format Q8, same dim) */
    int       has_window;       /* tq format and cfg.window > 0 */
    uint8_t  *data;             /* [rows, kv_heads, cap, codec.payload] */
    uint16_t *scales;           /* [rows, kv_heads, cap, codec.n_scales] */
    int8_t   *win_data;         /* [rows, kv_heads, ring, head_dim] */
    uint16_t *win_scales;       /* [rows, kv_heads, ring, head_dim / 32] */
    int8_t   *ext_data;         /* [ext_rows, kv_heads, ext_cap, head_dim] (side buffer) */
    uint16_t *ext_scales;       /* [ext_rows, kv_heads, ext_cap, head_dim / 32] */
} tqkv_plane;

struct tqkv_batch {
    tqkv_cache_config cfg;
    int   rows;
    int   rows_cap;             /* rows the storage has room for (>= rows): rows are the
                                   outer dimension, so appending rows in place moves none */
    int   cap;                  /* columns allocated per row (>= max end column) */
    int   ring;                 /* window + window_slack when a plane has a window, else 0 */
    int  *offset;               /* [rows] tokens held */
    int  *left_pad;             /* [rows] padding columns before the first token */
    int  *win_lo;               /* [rows] oldest token with a valid q8 copy */
    tqkv_plane k, v;
    int   threads;              /* compute-pool threads an append may encode with (<= 1:
                                   the caller alone); batch_set_threads */

    int   ext_valid;            /* the side buffer belongs to the last append */
    int   ext_rows, ext_cap;    /* allocated rows and token slots of the side buffer */
    int  *ext_lo, *ext_hi;      /* [ext_rows] tokens held in the side buffer */
    int  *ext_off;              /* [ext_rows] offset right after that append */

    int   prefill_active;       /* between prepare_prefill and finalize_prefill */
    int   prefill_appended;     /* the prefill append has happened */
    int  *prefill_pad;          /* [rows] padding tokens in the prefill append */
    int   prefill_n;            /* tokens per row the prefill append must carry (max length) */

    int   spec_active;
    int  *spec_base;            /* [rows] offset at spec_begin */
    char  signature[48];
};

struct tqkv_cache {
    struct tqkv_batch *b;       /* one row, never padded */
};

struct tqkv_mask_lease {
    tqkv_mask mask;
    int       builds;
    int       valid;
    /* key */
    int       key_rows, key_nq, key_window;
    int      *key_offset;       /* [key_rows] */
    int      *key_pad;          /* [key_rows] */
    int32_t  *lo, *hi;          /* [rows, n_query] */
    int       alloc;            /* entries allocated in lo/hi */
    int       key_alloc;        /* entries allocated in key arrays */
};

/* Pointers to token t of row r, head h (main plane). */
static inline const uint8_t *plane_data(const tqkv_plane *p, const struct tqkv_batch *b, int r,
                                        int h, int col) {
    return p->data + (((size_t)r * b->cfg.kv_heads + h) * b->cap + col) * p->codec.payload;
}
static inline const uint16_t *plane_scales(const tqkv_plane *p, const struct tqkv_batch *b, int r,
                                           int h, int col) {
    return p->scales + (((size_t)r * b->cfg.kv_heads + h) * b->cap + col) * p->codec.n_scales;
}
static inline const int8_t *plane_win_data(const tqkv_plane *p, const struct tqkv_batch *b, int r,
                                           int h, int t) {
    return p->win_data + (((size_t)r * b->cfg.kv_heads + h) * b->ring + (t % b->ring)) *
                             (size_t)b->cfg.head_dim;
}
static inline const uint16_t *plane_win_scales(const tqkv_plane *p, const struct tqkv_batch *b,
                                               int r, int h, int t) {
    return p->win_scales + (((size_t)r * b->cfg.kv_heads + h) * b->ring + (t % b->ring)) *
                               (size_t)(b->cfg.head_dim / 32);
}
/* First token of row r read from the q8 window of plane p (== offset[r] if none). */
static inline int plane_window_start(const tqkv_plane *p, const struct tqkv_batch *b, int r) {
    if (!p->has_window) return b->offset[r];
    int s = b->offset[r] - b->cfg.window;
    if (s < b->win_lo[r]) s = b->win_lo[r];
    if (s < 0) s = 0;
    return s;
}

/* 1 when row r's side buffer holds tokens for the current offset. */
static inline int batch_ext_ok(const struct tqkv_batch *b, int r) {
    return b->ext_valid && r < b->ext_rows && b->ext_off[r] == b->offset[r] &&
           b->ext_lo[r] < b->ext_hi[r];
}
/* Oldest token of row r with a q8 copy (ring or side buffer); == offset without a ring. */
static inline int batch_q8_lo(const struct tqkv_batch *b, int r) {
    if (b->ring <= 0) return b->offset[r];
    return batch_ext_ok(b, r) ? b->ext_lo[r] : b->win_lo[r];
}
/* q8 copy of token t (batch_q8_lo <= t < offset) of row r, head h in plane p, and the
 * end of the contiguous run holding it (side buffer end or ring wrap). */
static inline int plane_q8_at(const tqkv_plane *p, const struct tqkv_batch *b, int r, int h,
                              int t, const int8_t **data, const uint16_t **scales) {
    const size_t d = (size_t)b->cfg.head_dim;
    if (batch_ext_ok(b, r) && t < b->ext_hi[r]) {
        const size_t slot = ((size_t)r * b->cfg.kv_heads + h) * b->ext_cap + (t - b->ext_lo[r]);
        *data = p->ext_data + slot * d;
        *scales = p->ext_scales + slot * (d / 32);
        return b->ext_hi[r];
    }
    *data = plane_win_data(p, b, r, h, t);
    *scales = plane_win_scales(p, b, r, h, t);
    const int e = t - t % b->ring + b->ring;
    return e < b->offset[r] ? e : b->offset[r];
}

/* Decode token t of row r, head h of plane p to out [head_dim] in the original domain:
 * from the main plane (q8 == 0) or from its q8 copy (q8 != 0, plane with a window,
 * batch_q8_lo <= t < offset). For references in tests and tools. */
void batch_decode_token(const struct tqkv_batch *b, const tqkv_plane *p, int r, int h, int t,
                        int q8, float *out);

/* Decode tokens [t0, t1) of row r, head h into out [t1-t0, head_dim].
 * rotated != 0 keeps tq planes in the rotated domain (window tokens too). */
void batch_decode_range(const struct tqkv_batch *b, const tqkv_plane *p, int r, int h, int t0,
                        int t1, int rotated, float *out);

/* Validate a config; returns TQKV_OK or a failure with a message. */
tqkv_status batch_check_config(const tqkv_cache_config *cfg);

/* Internal attention entry (src/attn): rows are independent. */
tqkv_status attn_batch(const struct tqkv_batch *b, const tqkv_mask *mask, const float *q,
                       int n_query, const tqkv_attn_params *p, float *out);

/* Threads of the compute pool (util/pool.h) that appends may encode with: the model sets
 * its state's threads. Rows, heads and planes are encoded independently, so the bytes
 * never depend on it. */
void batch_set_threads(struct tqkv_batch *b, int threads);

#endif

/*
 * cache_impl.h - private helpers shared by the .c files of src/cache (not a contract:
 * attention and model code read batch.h only).
 * Owns: row-storage allocation/installation, column copies, canonical window bounds.
 * Must not: be included outside src/cache and tests of the cache, decode or requantize.
 */
#ifndef TQKV_CACHE_IMPL_H
#define TQKV_CACHE_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cache/batch.h"
#include "util/common.h"

/* Sanity limits checked by batch_check_config (documented in docs/STATE.md). */
#define CACHE_MAX_KV_HEADS 1024
#define CACHE_MAX_RING     (1 << 16)   /* window + window_slack */
/* Largest column count (left_pad + offset) a row may reach. */
#define CACHE_MAX_COLUMNS  (1 << 30)

// ---------------------------------------------------------------------------
// Storage: every array of a batch that depends on (rows, cap), allocated together
// so that a reshaping call can build the new storage, then install it (or fail
// having changed nothing).
// ---------------------------------------------------------------------------
typedef struct {
    int       rows, cap;
    uint8_t  *kd, *vd;      // [rows, kv_heads, cap, payload]
    uint16_t *ks, *vs;      // [rows, kv_heads, cap, n_scales]
    int8_t   *kwd, *vwd;    // [rows, kv_heads, ring, head_dim]   (NULL if no window)
    uint16_t *kws, *vws;    // [rows, kv_heads, ring, head_dim/32]
    int      *offset, *left_pad, *win_lo, *prefill_pad, *spec_base; // [rows]
} batch_store;

/* Copy row rs of one plane (n token columns from column cs, and the whole ring) into
 * storage row rd at column cd of arrays with dcap columns a row. */
void copy_plane_row(const struct tqkv_batch *src, const tqkv_plane *sp, int rs, int cs,
                    uint8_t *dd, uint16_t *ds, int8_t *dwd, uint16_t *dws, int dcap, int rd,
                    int cd, int n);
/* Spare columns given to a batch that grows or is rebuilt around cap used columns. */
int batch_headroom(int cap);
/* Allocate zeroed storage for b's config with the given rows and cap. */
tqkv_status store_alloc(const struct tqkv_batch *b, int rows, int cap, batch_store *s);
/* Free b's current arrays and take over s's (s is emptied). */
void        store_install(struct tqkv_batch *b, batch_store *s);

/* Move row rs of src into storage row rd with left padding pad: its token columns and
 * its whole q8 ring (encoded bytes only) and its row state (offset, win_lo, spec_base,
 * prefill_pad; left_pad = pad). */
void store_move_row(batch_store *dst, int rd, int pad, const struct tqkv_batch *src, int rs);

// ---------------------------------------------------------------------------
// Batch object helpers
// ---------------------------------------------------------------------------
/* ring slots for cfg: window + slack when window > 0 and K or V is tq, else 0. */
int  batch_ring_for(const tqkv_cache_config *cfg);
/* Create a batch (rows >= 0) with storage for cap columns; single picks the signature. */
tqkv_status batch_create(struct tqkv_batch **out, const tqkv_cache_config *cfg, int rows,
                         int cap, int single);
void batch_destroy(struct tqkv_batch *b);
/* Grow capacity so that every row can hold `need` columns (geometric). */
tqkv_status batch_reserve(struct tqkv_batch *b, int need);
/* Canonical first window token of row r: max(0, offset - window, win_lo); == offset
 * when there is no ring. This is what readers see and what export writes. */
int  batch_window_lo(const struct tqkv_batch *b, int r);
/* 1 when every row is unpadded and all rows hold the same number of tokens. */
int  batch_is_uniform(const struct tqkv_batch *b);
/* After cutting rows back: keep win_lo <= offset. */
void batch_clamp_win_lo(struct tqkv_batch *b);
/* Bytes of one encoded main vector (payload + scales) and of one q8 window vector. */
size_t plane_vec_bytes(const tqkv_plane *p);
size_t plane_win_bytes(const struct tqkv_batch *b);
/* Compare two configs: 0 if compatible for row moves, else writes what differs. */
int  cache_config_diff(const tqkv_cache_config *a, const tqkv_cache_config *b, char *what,
                       size_t cap);
/* Common argument guard for public entry points. */
#define CACHE_CHECK(cond, code, ...)                                                       \
    do {                                                                                   \
        if (!(cond)) return tqkv_fail(code, __VA_ARGS__);                                  \
    } while (0)

/* Wrap a 1-row, unpadded batch as a single cache (takes ownership; frees b on failure). */
tqkv_status cache_wrap(tqkv_cache **out, struct tqkv_batch *b);

/* State export/restore shared by batch and single (state.c). kind: 0 batch, 1 single. */
tqkv_status state_export(const struct tqkv_batch *b, int kind, uint8_t **out, size_t *len);
tqkv_status state_restore(struct tqkv_batch **out, int kind, const uint8_t *buf, size_t len);

#endif

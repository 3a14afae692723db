/*
 * tqkv.h - public API of libtqkv: a TurboQuant-compressed transformer KV cache
 * that attention reads in place.
 *
 * Owns: the public boundary. Every type here is either a plain value struct or an
 * opaque handle; every call returns a tqkv_status; on failure the message is in
 * tqkv_last_error() (thread-local, like errno) and the object is unchanged.
 * Must not: expose internal layout, keep global mutable state.
 *
 * Shapes are written as C row-major arrays: [rows, kv_heads, tokens, head_dim].
 */
#ifndef TQKV_H
#define TQKV_H

#include <stddef.h>
#include <stdint.h>

/* TQKV_API marks the exported symbols of the shared libraries (built with
 * -fvisibility=hidden). Every public declaration carries it. */
#ifndef TQKV_API
#  if defined(__GNUC__) || defined(__clang__)
#    define TQKV_API __attribute__((visibility("default")))
#  else
#    define TQKV_API
#  endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Status                                                                     */
/* ------------------------------------------------------------------------- */

typedef enum {
    TQKV_OK = 0,
    TQKV_EINVAL,      /* bad argument: shape, format, index, NULL */
    TQKV_ERANGE,      /* row/token index or count out of range */
    TQKV_ESTATE,      /* call not valid in the object's current state */
    TQKV_ENOMEM,      /* allocation failed */
    TQKV_ECORRUPT,    /* state/file bytes truncated, corrupt or wrong version */
    TQKV_EIO,         /* file could not be read/mapped */
    TQKV_EUNSUPPORTED, /* valid input that this build does not handle */
    TQKV_EBUSY         /* a bounded resource is full right now (queue, budget); retry later */
} tqkv_status;

/* Message for the last failing call on this thread ("" if none). */
TQKV_API const char *tqkv_last_error(void);
TQKV_API const char *tqkv_status_name(tqkv_status s);

#if defined(__GNUC__) || defined(__clang__)
#  define TQKV_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#  define TQKV_PRINTF(a, b)
#endif
/* Set this thread's tqkv_last_error() message (printf format) and return s; clear it.
 * For code built on libtqkv that reports failures the same way: libtqkv-model does, so
 * one message per thread serves both libraries. Use as
 *     return tqkv_fail(TQKV_EINVAL, "n %d < 1", n); */
TQKV_API tqkv_status tqkv_fail(tqkv_status s, const char *fmt, ...) TQKV_PRINTF(2, 3);
TQKV_API void        tqkv_clear_error(void);

/* ------------------------------------------------------------------------- */
/* Formats                                                                    */
/* ------------------------------------------------------------------------- */
/*
 * Bytes per vector of d values (d a power of two, 32..512):
 *   f32  4d                       32 bits/value
 *   f16  2d                       16
 *   q8   d + 2*(d/32)             8.5   (32-value blocks, fp16 absmax scale, int8)
 *   q4   d/2 + 2*(d/32)           4.5   (32-value blocks, fp16 scale, ggml q4_0 rounding)
 *   tqB  B*d/8 + 2                B + 16/d  (packed B-bit Lloyd-Max indices + fp16 scale)
 *   fp8  d + 2                    8 + 16/d  (OCP e4m3 per value, one fp16 scale per vector)
 * At d=128: tq4 66 B (4.125 b/v), tq3 50 B (3.125), tq2 34 B (2.125), tq1 18 B (1.125).
 * tq1 (B = 1) is for the planes a calibrated policy finds nearly free (the CPU cache only:
 * the CUDA cache refuses it).
 */
typedef enum {
    TQKV_F32 = 0,
    TQKV_F16,
    TQKV_Q8,
    TQKV_Q4,
    TQKV_TQ2,
    TQKV_TQ3,
    TQKV_TQ4,
    TQKV_FP8,      /* appended: format ids are stored in exported state */
    TQKV_TQ1,      /* appended (session 11): 1-bit Lloyd-Max (the sign, one scale); CPU only */
    TQKV_FORMAT_COUNT
} tqkv_format;

TQKV_API tqkv_status tqkv_format_parse(const char *name, tqkv_format *out);
TQKV_API const char *tqkv_format_name(tqkv_format f);
TQKV_API int         tqkv_format_is_tq(tqkv_format f);            /* 1 for tq1/tq2/tq3/tq4 */
TQKV_API int         tqkv_format_tq_bits(tqkv_format f);          /* 1..4, 0 otherwise */
/* Bytes of one encoded vector of `dim` values; 0 if dim or format is invalid. */
TQKV_API size_t      tqkv_format_bytes(tqkv_format f, int dim);
TQKV_API double      tqkv_format_bits_per_value(tqkv_format f, int dim);
/* dim must be a power of two in [32, 512]. */
TQKV_API tqkv_status tqkv_check_dim(int dim);

/* ------------------------------------------------------------------------- */
/* Codec: one format at one dim, with its rotation                            */
/* ------------------------------------------------------------------------- */

typedef struct tqkv_codec tqkv_codec;

/* seed picks the rotation's sign flips (tq formats); it is part of a cache's state. */
TQKV_API tqkv_status tqkv_codec_init(tqkv_codec **out, tqkv_format f, int dim, uint64_t seed);
TQKV_API void        tqkv_codec_free(tqkv_codec *c);
TQKV_API size_t      tqkv_codec_bytes(const tqkv_codec *c);       /* bytes per vector */
/* x: [n, dim] floats -> out: [n, bytes] (payload then scales, see docs/FORMATS.md) */
TQKV_API tqkv_status tqkv_codec_encode(const tqkv_codec *c, const float *x, size_t n, uint8_t *out);
/* in: [n, bytes] -> x: [n, dim] */
TQKV_API tqkv_status tqkv_codec_decode(const tqkv_codec *c, const uint8_t *in, size_t n, float *x);
/* Randomized Hadamard rotation of n vectors in place: x <- H D x / sqrt(dim). */
TQKV_API tqkv_status tqkv_codec_rotate(const tqkv_codec *c, float *x, size_t n);
TQKV_API tqkv_status tqkv_codec_unrotate(const tqkv_codec *c, float *x, size_t n);

/* ------------------------------------------------------------------------- */
/* Cache configuration                                                        */
/* ------------------------------------------------------------------------- */

typedef struct {
    int         kv_heads;      /* >= 1 */
    int         head_dim;      /* power of two, 32..512 */
    tqkv_format k_format;
    tqkv_format v_format;
    uint64_t    seed;          /* rotation seed (tq formats) */
    int         window;        /* newest tokens held at q8 beside the main format (0 = off) */
    int         window_slack;  /* extra q8 slots so rollback/trim by up to this many stays exact */
    /* 0: every tq plane keeps the q8 window; 1: the K plane only (values are always read
     * from their own format: the ring costs half the bits). The CUDA cache refuses 1. */
    int         window_keys_only;
    /* Reserved for channel groups (outlier split) and future fields: must be zero. */
    int         reserved[7];
} tqkv_cache_config;

/* kv_heads 1, head_dim 128, tq4/tq4, seed 0, window off, slack 32. */
TQKV_API tqkv_cache_config tqkv_cache_config_default(void);
/* Parses "tq4", "tq4/tq3", "f16" into k/v formats. */
TQKV_API tqkv_status tqkv_kv_spec_parse(const char *spec, tqkv_format *k, tqkv_format *v);

/* ------------------------------------------------------------------------- */
/* Attention kernels                                                          */
/* ------------------------------------------------------------------------- */

typedef enum {
    TQKV_KERNEL_DENSE = 0, /* decode K and V to floats, standard attention */
    TQKV_KERNEL_DEFERRED,  /* rotate q once, attend on rotated K/V, un-rotate output once */
    TQKV_KERNEL_FUSED,     /* score against codebook values in registers, online softmax */
    TQKV_KERNEL_COUNT
} tqkv_kernel;

TQKV_API tqkv_status tqkv_kernel_parse(const char *name, tqkv_kernel *out);
TQKV_API const char *tqkv_kernel_name(tqkv_kernel k);

typedef struct {
    int         q_heads;   /* multiple of kv_heads */
    float       scale;     /* softmax scale, usually 1/sqrt(head_dim) */
    tqkv_kernel kernel;
    int         threads;   /* >= 1 */
} tqkv_attn_params;

/* ------------------------------------------------------------------------- */
/* Masks: per (row, query) visible column ranges, leased once per forward     */
/* ------------------------------------------------------------------------- */
/*
 * A mask is causal, hides each row's left padding and, with window > 0, columns
 * older than window tokens before the query. Query i of a row (0 <= i < n_query)
 * sits at column end - n_query + i, where end = left_pad + offset after the append.
 * It sees columns [lo, hi); lo == hi means it sees nothing (padding query; output 0).
 */
typedef struct {
    int      rows;
    int      n_query;
    int      window;
    const int32_t *lo;     /* [rows, n_query] */
    const int32_t *hi;     /* [rows, n_query] */
} tqkv_mask;

/* A lease holds the last mask built and its key (n_query, window, offsets, pads). */
typedef struct tqkv_mask_lease tqkv_mask_lease;
TQKV_API tqkv_status tqkv_mask_lease_init(tqkv_mask_lease **out);
TQKV_API void        tqkv_mask_lease_free(tqkv_mask_lease *l);
/* How many masks this lease has built (a rebuild happens only when the key changes). */
TQKV_API int         tqkv_mask_lease_builds(const tqkv_mask_lease *l);
/* Dense additive form for tests and other backends: out [rows, n_query, cols], 0 or -inf. */
TQKV_API tqkv_status tqkv_mask_to_dense(const tqkv_mask *m, int cols, float *out);

/* ------------------------------------------------------------------------- */
/* Single-sequence cache (one layer)                                          */
/* ------------------------------------------------------------------------- */

typedef struct tqkv_cache tqkv_cache;

TQKV_API tqkv_status tqkv_cache_init(tqkv_cache **out, const tqkv_cache_config *cfg);
TQKV_API void        tqkv_cache_free(tqkv_cache *c);
TQKV_API const tqkv_cache_config *tqkv_cache_get_config(const tqkv_cache *c);
TQKV_API int         tqkv_cache_length(const tqkv_cache *c);
/* k, v: [kv_heads, n, head_dim] */
TQKV_API tqkv_status tqkv_cache_append(tqkv_cache *c, const float *k, const float *v, int n);
/* Decode tokens [start, start+n) back to floats: k, v: [kv_heads, n, head_dim]. */
TQKV_API tqkv_status tqkv_cache_read(const tqkv_cache *c, int start, int n, float *k, float *v);
/* q, out: [q_heads, n_query, head_dim]; the queries are the newest n_query tokens (causal). */
TQKV_API tqkv_status tqkv_cache_attend(const tqkv_cache *c, const float *q, int n_query,
                                       const tqkv_attn_params *p, float *out);
TQKV_API tqkv_status tqkv_cache_trim(tqkv_cache *c, int n);
TQKV_API double      tqkv_cache_bytes_per_token(const tqkv_cache *c);
TQKV_API size_t      tqkv_cache_projected_bytes(const tqkv_cache *c, int tokens);
/* Smallest length this cache can be trimmed back to with bytes identical to a fresh
 * cache fed the same prefix (a prompt cache may reuse any prefix at least this long).
 * Above the length when no non-empty prefix qualifies (after a trim beyond window_slack). */
TQKV_API int         tqkv_cache_min_reusable_offset(const tqkv_cache *c);
/* State: versioned, checksummed. *out is malloc'd; free() it. */
TQKV_API tqkv_status tqkv_cache_export(const tqkv_cache *c, uint8_t **out, size_t *len);
TQKV_API tqkv_status tqkv_cache_restore(tqkv_cache **out, const uint8_t *buf, size_t len);

/* ------------------------------------------------------------------------- */
/* Batched cache (one layer, many rows)                                       */
/* ------------------------------------------------------------------------- */

typedef struct tqkv_batch tqkv_batch;

/* rows may be 0 (make_empty_batch). */
TQKV_API tqkv_status tqkv_batch_init(tqkv_batch **out, const tqkv_cache_config *cfg, int rows);
TQKV_API void        tqkv_batch_free(tqkv_batch *b);   /* dispose */
TQKV_API const tqkv_cache_config *tqkv_batch_get_config(const tqkv_batch *b);
TQKV_API int         tqkv_batch_rows(const tqkv_batch *b);
/* Tokens held per row and left padding per row; either pointer may be NULL. [rows] */
TQKV_API tqkv_status tqkv_batch_offsets(const tqkv_batch *b, int *offset, int *left_pad);
/* Columns in use: max over rows of left_pad + offset. */
TQKV_API int         tqkv_batch_columns(const tqkv_batch *b);
/* "kv:batched-tq:4:3" style name of the format. */
TQKV_API const char *tqkv_batch_signature(const tqkv_batch *b);

/* Append n tokens to every row. k, v: [rows, kv_heads, n, head_dim].
 * n == 1 is a decode append; n > 1 a window append. During a prefill (below),
 * the first pad[r] tokens of row r are padding and are not stored. */
TQKV_API tqkv_status tqkv_batch_append(tqkv_batch *b, const float *k, const float *v, int n);

/* Left-padded batched prefill. Rows must be empty. lengths: [rows], each >= 1.
 * The next append must carry max(lengths) tokens per row; row r's first
 * max - lengths[r] are padding. finalize ends the prefill state. */
TQKV_API tqkv_status tqkv_batch_prepare_prefill(tqkv_batch *b, const int *lengths);
TQKV_API tqkv_status tqkv_batch_finalize_prefill(tqkv_batch *b);
/* Right-padded prefill: cut each row back to ends[r] tokens (ends[r] <= offset[r]). */
TQKV_API tqkv_status tqkv_batch_restore_prefill_ends(tqkv_batch *b, const int *ends);

/* Drop the newest n tokens of every row (n <= min offset). */
TQKV_API tqkv_status tqkv_batch_trim(tqkv_batch *b, int n);
/* Drop each row's OLDEST tokens so that it holds at most keep (>= 1) (sliding-window
 * layers). Dropped columns become left padding (the newest column does not move; every
 * held token keeps its bytes, q8 window copy included); once every row's padding reaches
 * keep, the common padding is removed, so a row's columns stay below about
 * 2 * (keep + longest append). Offsets then count the tokens held, not positions.
 * TQKV_ESTATE during a prefill or a spec round. */
TQKV_API tqkv_status tqkv_batch_drop_oldest(tqkv_batch *b, int keep);

/* Row changes: copy encoded bytes; never decode, rotate or requantize. */
typedef struct {
    const tqkv_batch *batch;   /* exactly one of the two is set */
    const tqkv_cache *single;
} tqkv_cache_ref;
/* New batch whose rows are the items' rows in order, right-aligned (left-padded). */
TQKV_API tqkv_status tqkv_batch_merge(tqkv_batch **out, const tqkv_cache_ref *items, int n_items);
/* Keep rows keep[0..n_keep) in that order (indices distinct); common left pad removed.
 * With keep in increasing order the rows are compacted in place (no allocation; the
 * storage keeps its room for rows that join later), else the batch is rebuilt. */
TQKV_API tqkv_status tqkv_batch_filter(tqkv_batch *b, const int *keep, int n_keep);
/* Append the items' rows to b in place (b's rows keep their bytes and places; a joining
 * row ends at b's last end column when it fits, else starts at column 0). The checks of
 * tqkv_batch_merge apply. tqkv_batch_append_rows_reserve makes every allocation the append
 * needs (rows grow by a quarter, columns as appends do) without changing b's contents;
 * after it, tqkv_batch_append_rows with the same items cannot fail, so callers changing
 * several batches together reserve on all first. */
TQKV_API tqkv_status tqkv_batch_append_rows_reserve(tqkv_batch *b,
                                                    const tqkv_cache_ref *items,
                                                    int n_items);
TQKV_API tqkv_status tqkv_batch_append_rows(tqkv_batch *b, const tqkv_cache_ref *items, int n_items);
TQKV_API tqkv_status tqkv_batch_extract(const tqkv_batch *b, int row, tqkv_cache **out);
/* Move each row so that its left padding is left_pad[r]. [rows] */
TQKV_API tqkv_status tqkv_batch_align(tqkv_batch *b, const int *left_pad);

/* Speculative rounds. keep: n_keep == 1 (same for all rows) or n_keep == rows. */
TQKV_API tqkv_status tqkv_batch_spec_begin(tqkv_batch *b);
TQKV_API tqkv_status tqkv_batch_spec_commit(tqkv_batch *b);
TQKV_API tqkv_status tqkv_batch_spec_rollback(tqkv_batch *b, const int *keep, int n_keep);
TQKV_API int         tqkv_batch_spec_active(const tqkv_batch *b);

/* Mask for n_query queries per row (the newest n_query columns). *out is NULL when
 * no mask is needed: n_query == 1, window == 0, every row unpadded at one offset.
 * The mask lives in the lease until the next call with a different key. */
TQKV_API tqkv_status tqkv_batch_make_mask(const tqkv_batch *b, tqkv_mask_lease *lease, int n_query,
                                          int window, const tqkv_mask **out);

/* q, out: [rows, q_heads, n_query, head_dim]. mask may be NULL only when make_mask
 * would return NULL. Rows are independent: a row's output is bitwise identical
 * whatever the other rows hold. */
TQKV_API tqkv_status tqkv_batch_attend(const tqkv_batch *b, const tqkv_mask *mask, const float *q,
                                       int n_query, const tqkv_attn_params *p, float *out);

/* Donor capture: decode every row to dense floats.
 * k, v: [rows, kv_heads, cols, head_dim] with cols = tqkv_batch_columns(); padding
 * columns are zero. offset, left_pad: [rows] (may be NULL). */
TQKV_API tqkv_status tqkv_batch_capture(const tqkv_batch *b, float *k, float *v, int *offset,
                                        int *left_pad);

TQKV_API double      tqkv_batch_bytes_per_token(const tqkv_batch *b);
/* Bytes the rows hold now (main planes + window), excluding spare capacity. */
TQKV_API size_t      tqkv_batch_bytes_used(const tqkv_batch *b);
/* Bytes the batch's storage occupies: rows x cap columns (padding and spare capacity
 * included), the q8 rings and per-row bookkeeping. >= bytes_used. */
TQKV_API size_t      tqkv_batch_bytes_allocated(const tqkv_batch *b);

TQKV_API tqkv_status tqkv_batch_export(const tqkv_batch *b, uint8_t **out, size_t *len);
TQKV_API tqkv_status tqkv_batch_restore(tqkv_batch **out, const uint8_t *buf, size_t len);

/* ---- engine helpers (branch engine) ---- */
/* New batch holding rows keep[0..n_keep) of b in that order (common left pad removed;
 * a spec round carries over); b is unchanged. */
TQKV_API tqkv_status tqkv_batch_select(const tqkv_batch *b, const int *keep, int n_keep,
                                       tqkv_batch **out);
/* Drop the newest n tokens of every row, also inside a spec round (not below a row's
 * spec_begin offset). Exact when n <= window_slack or without a window. */
TQKV_API tqkv_status tqkv_batch_rewind(tqkv_batch *b, int n);
/* Bytes one row of this batch takes when it holds `tokens` tokens. */
TQKV_API size_t      tqkv_batch_projected_bytes(const tqkv_batch *b, int tokens);
/* tqkv_cache_min_reusable_offset of one row. */
TQKV_API int         tqkv_batch_min_reusable_offset(const tqkv_batch *b, int row);

#ifdef __cplusplus
}
#endif
#endif /* TQKV_H */

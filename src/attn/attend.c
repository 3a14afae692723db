/*
 * attend.c - public attention entry points for caches: tqkv_batch_attend, tqkv_cache_attend.
 * Owns: validating every argument (shapes, params, mask against the batch) so that the
 * kernels behind attn_batch() may trust them; the single cache's causal mask.
 * Lives in src/attn (moved from src/cache, issue 9): attention reads the cache's layout
 * (cache/batch.h), the cache never calls up into attention.
 * Must not: compute attention itself, or change a cache.
 */
#include <math.h>
#include <stdlib.h>

#include "cache/batch.h"
#include "util/common.h"

#define ATTEND_CHECK(cond, code, ...)                                                      \
    do {                                                                                   \
        if (!(cond)) return tqkv_fail(code, __VA_ARGS__);                                  \
    } while (0)

/* Every row unpadded and all rows at one offset (then no mask is needed for one query). */
static int attend_batch_uniform(const struct tqkv_batch *b) {
    for (int r = 0; r < b->rows; r++)
        if (b->left_pad[r] != 0 || b->offset[r] != b->offset[0]) return 0;
    return 1;
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

static tqkv_status attend_check_params(const struct tqkv_batch *b, const tqkv_attn_params *p) {
    ATTEND_CHECK(p, TQKV_EINVAL, "attend: params is NULL");
    ATTEND_CHECK(p->q_heads >= 1 && p->q_heads % b->cfg.kv_heads == 0, TQKV_EINVAL,
                "attend: q_heads (%d) must be a positive multiple of kv_heads (%d)", p->q_heads,
                b->cfg.kv_heads);
    ATTEND_CHECK(p->threads >= 1, TQKV_EINVAL, "attend: threads must be >= 1, got %d", p->threads);
    ATTEND_CHECK((unsigned)p->kernel < TQKV_KERNEL_COUNT, TQKV_EINVAL, "attend: invalid kernel %d",
                (int)p->kernel);
    ATTEND_CHECK(isfinite(p->scale), TQKV_EINVAL, "attend: scale must be finite");
    return TQKV_OK;
}

/* The mask must match the batch's shape, and every non-empty range must lie inside the
 * row's tokens: kernels never read padding or past the end. */
static tqkv_status attend_check_mask(const struct tqkv_batch *b, const tqkv_mask *m, int n_query) {
    if (!m) {
        if (n_query != 1 || !attend_batch_uniform(b))
            return tqkv_fail(TQKV_EINVAL, "attend: mask is NULL but this batch needs one "
                             "(n_query %d, padded or uneven rows); use tqkv_batch_make_mask",
                             n_query);
        return TQKV_OK;
    }
    ATTEND_CHECK(m->rows == b->rows, TQKV_EINVAL, "attend: mask has %d rows, batch has %d", m->rows,
                b->rows);
    ATTEND_CHECK(m->n_query == n_query, TQKV_EINVAL, "attend: mask n_query %d != n_query %d",
                m->n_query, n_query);
    ATTEND_CHECK(b->rows == 0 || (m->lo && m->hi), TQKV_EINVAL, "attend: mask lo/hi is NULL");
    for (int r = 0; r < b->rows; r++) {
        int lp = b->left_pad[r], end = lp + b->offset[r];
        for (int i = 0; i < n_query; i++) {
            size_t j = (size_t)r * n_query + i;
            int lo = m->lo[j], hi = m->hi[j];
            if (lo < hi && (lo < lp || hi > end))
                return tqkv_fail(TQKV_ERANGE, "attend: mask range [%d, %d) of row %d query %d "
                                 "is outside the row's tokens [%d, %d)", lo, hi, r, i, lp, end);
        }
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Public wrappers
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_attend(const tqkv_batch *b, const tqkv_mask *mask, const float *q,
                              int n_query, const tqkv_attn_params *p, float *out) {
    ATTEND_CHECK(b, TQKV_EINVAL, "batch_attend: batch is NULL");
    ATTEND_CHECK(n_query >= 1, TQKV_EINVAL, "batch_attend: n_query must be >= 1, got %d", n_query);
    tqkv_status st = attend_check_params(b, p);
    if (st) return st;
    if (b->rows == 0) return TQKV_OK;
    ATTEND_CHECK(q && out, TQKV_EINVAL, "batch_attend: q or out is NULL");
    for (int r = 0; r < b->rows; r++)
        if (n_query > b->left_pad[r] + b->offset[r])
            return tqkv_fail(TQKV_ERANGE, "batch_attend: n_query = %d exceeds row %d's columns "
                             "(%d)", n_query, r, b->left_pad[r] + b->offset[r]);
    if ((st = attend_check_mask(b, mask, n_query))) return st;
    return attn_batch(b, mask, q, n_query, p, out);
}

/* Causal attention of the newest n_query tokens over the whole sequence. */
tqkv_status tqkv_cache_attend(const tqkv_cache *c, const float *q, int n_query,
                              const tqkv_attn_params *p, float *out) {
    ATTEND_CHECK(c && c->b, TQKV_EINVAL, "cache_attend: cache is NULL");
    const struct tqkv_batch *b = c->b;
    ATTEND_CHECK(q && out, TQKV_EINVAL, "cache_attend: q or out is NULL");
    ATTEND_CHECK(n_query >= 1, TQKV_EINVAL, "cache_attend: n_query must be >= 1, got %d", n_query);
    ATTEND_CHECK(n_query <= b->offset[0], TQKV_ERANGE,
                "cache_attend: n_query = %d exceeds the cache length %d", n_query, b->offset[0]);
    tqkv_status st = attend_check_params(b, p);
    if (st) return st;
    if (n_query == 1) return attn_batch(b, NULL, q, 1, p, out);
    int32_t *lo = malloc((size_t)n_query * sizeof *lo); // [1, n_query]
    int32_t *hi = malloc((size_t)n_query * sizeof *hi); // [1, n_query]
    if (!lo || !hi) {
        free(lo);
        free(hi);
        return tqkv_fail(TQKV_ENOMEM, "cache_attend: out of memory");
    }
    int len = b->offset[0];
    for (int i = 0; i < n_query; i++) {
        lo[i] = 0;
        hi[i] = len - n_query + i + 1;
    }
    tqkv_mask m = {.rows = 1, .n_query = n_query, .window = 0, .lo = lo, .hi = hi};
    st = attn_batch(b, &m, q, n_query, p, out);
    free(lo);
    free(hi);
    return st;
}

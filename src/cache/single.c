/*
 * single.c - the single-sequence cache: a thin wrapper over a 1-row, never padded batch.
 * Owns: tqkv_cache_* entry points (except attend, in src/attn/attend.c), min_reusable_offset and
 * projected_bytes.
 * Must not: duplicate batch logic (delegate), or let its row acquire left padding.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

tqkv_status cache_wrap(tqkv_cache **out, struct tqkv_batch *b) {
    tqkv_cache *c = calloc(1, sizeof *c);
    if (!c) {
        batch_destroy(b);
        return tqkv_fail(TQKV_ENOMEM, "out of memory allocating a cache");
    }
    c->b = b;
    *out = c;
    return TQKV_OK;
}

tqkv_status tqkv_cache_init(tqkv_cache **out, const tqkv_cache_config *cfg) {
    CACHE_CHECK(out, TQKV_EINVAL, "cache_init: out is NULL");
    struct tqkv_batch *b;
    tqkv_status st = batch_create(&b, cfg, 1, 0, 1);
    if (st) return st;
    return cache_wrap(out, b);
}

void tqkv_cache_free(tqkv_cache *c) {
    if (!c) return;
    batch_destroy(c->b);
    free(c);
}

const tqkv_cache_config *tqkv_cache_get_config(const tqkv_cache *c) {
    return c && c->b ? &c->b->cfg : NULL;
}

int tqkv_cache_length(const tqkv_cache *c) { return c && c->b ? c->b->offset[0] : 0; }

/* k, v: [kv_heads, n, head_dim] (== the 1-row batch layout). */
tqkv_status tqkv_cache_append(tqkv_cache *c, const float *k, const float *v, int n) {
    CACHE_CHECK(c && c->b, TQKV_EINVAL, "cache_append: cache is NULL");
    return tqkv_batch_append(c->b, k, v, n);
}

/* Tokens [start, start+n) as floats in the original domain; the newest `window` tokens
 * come from the q8 window when the format has one (what attention sees). */
tqkv_status tqkv_cache_read(const tqkv_cache *c, int start, int n, float *k, float *v) {
    CACHE_CHECK(c && c->b, TQKV_EINVAL, "cache_read: cache is NULL");
    const struct tqkv_batch *b = c->b;
    CACHE_CHECK(n >= 0 && start >= 0, TQKV_EINVAL, "cache_read: start (%d) and n (%d) must be "
                ">= 0", start, n);
    CACHE_CHECK((long long)start + n <= b->offset[0], TQKV_ERANGE,
                "cache_read: tokens [%d, %lld) exceed the length %d", start, (long long)start + n,
                b->offset[0]);
    if (n == 0) return TQKV_OK;
    CACHE_CHECK(k && v, TQKV_EINVAL, "cache_read: k or v is NULL");
    size_t per_head = (size_t)n * b->cfg.head_dim; // k, v: [kv_heads, n, head_dim]
    for (int h = 0; h < b->cfg.kv_heads; h++) {
        batch_decode_range(b, &b->k, 0, h, start, start + n, 0, k + h * per_head);
        batch_decode_range(b, &b->v, 0, h, start, start + n, 0, v + h * per_head);
    }
    return TQKV_OK;
}

tqkv_status tqkv_cache_trim(tqkv_cache *c, int n) {
    CACHE_CHECK(c && c->b, TQKV_EINVAL, "cache_trim: cache is NULL");
    return tqkv_batch_trim(c->b, n);
}

double tqkv_cache_bytes_per_token(const tqkv_cache *c) {
    return c ? tqkv_batch_bytes_per_token(c->b) : 0.0;
}

/* tokens * main bytes + min(tokens, window + slack) q8 copies, per head, for K and V
 * (the q8 part only for planes with a window). */
size_t tqkv_cache_projected_bytes(const tqkv_cache *c, int tokens) {
    if (!c || !c->b || tokens <= 0) return 0;
    const struct tqkv_batch *b = c->b;
    size_t H = (size_t)b->cfg.kv_heads;
    size_t bytes = (size_t)tokens * H * (plane_vec_bytes(&b->k) + plane_vec_bytes(&b->v));
    size_t win = (size_t)(tokens < b->ring ? tokens : b->ring);
    bytes += win * H * plane_win_bytes(b) * (size_t)(b->k.has_window + b->v.has_window);
    return bytes;
}

/* Smallest L such that trim to L gives the bytes of a fresh cache fed L tokens: the
 * fresh cache reads [L - window, L) from q8, so every such token must still have its
 * q8 copy (t >= win_lo): L >= win_lo + window, unless win_lo == 0 (nothing lost).
 * After a cut deeper than window_slack this exceeds the length: no non-empty prefix
 * reads like a fresh cache (not even the whole cache), so none may be reused. */
int tqkv_cache_min_reusable_offset(const tqkv_cache *c) {
    if (!c || !c->b) return 0;
    const struct tqkv_batch *b = c->b;
    if (b->ring <= 0 || b->win_lo[0] == 0) return 0;
    return b->win_lo[0] + b->cfg.window; /* <= 2^30 + 2^16: no overflow */
}

tqkv_status tqkv_cache_export(const tqkv_cache *c, uint8_t **out, size_t *len) {
    CACHE_CHECK(c && c->b, TQKV_EINVAL, "cache_export: cache is NULL");
    return state_export(c->b, 1, out, len);
}

tqkv_status tqkv_cache_restore(tqkv_cache **out, const uint8_t *buf, size_t len) {
    CACHE_CHECK(out, TQKV_EINVAL, "cache_restore: out is NULL");
    struct tqkv_batch *b;
    tqkv_status st = state_restore(&b, 1, buf, len);
    if (st) return st;
    return cache_wrap(out, b);
}

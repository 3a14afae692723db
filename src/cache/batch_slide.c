/*
 * batch_slide.c - tqkv_batch_drop_oldest (tqkv.h): dropping each row's oldest tokens.
 * Owns: turning dropped columns into left padding, re-indexing the q8 ring (slots are
 * indexed by token: token t moves to t - d), compacting common padding.
 * Must not: decode, rotate or requantize anything.
 */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"

/* Rotate each head's ring of row r left by d slots: new[s] = old[(s + d) % ring]. */
static int ring_rotate(struct tqkv_batch *b, int r, int d) {
    if (b->ring <= 0 || d % b->ring == 0) return 1;
    int ring = b->ring, H = b->cfg.kv_heads, dim = b->cfg.head_dim;
    size_t sd = (size_t)dim, ss = (size_t)(dim / 32) * sizeof(uint16_t);
    size_t big = sd > ss ? sd : ss;
    uint8_t *tmp = malloc((size_t)ring * big);
    if (!tmp) return 0;
    int sh = d % ring;
    tqkv_plane *planes[2] = {&b->k, &b->v};
    for (int p = 0; p < 2; p++) {
        tqkv_plane *pl = planes[p];
        if (!pl->has_window) continue;
        for (int h = 0; h < H; h++) {
            size_t base = (size_t)r * H + (size_t)h;
            uint8_t *wd = (uint8_t *)pl->win_data + base * (size_t)ring * sd;
            uint8_t *ws = (uint8_t *)pl->win_scales + base * (size_t)ring * ss;
            for (int s = 0; s < ring; s++)
                memcpy(tmp + (size_t)s * sd, wd + (size_t)((s + sh) % ring) * sd, sd);
            memcpy(wd, tmp, (size_t)ring * sd);
            for (int s = 0; s < ring; s++)
                memcpy(tmp + (size_t)s * ss, ws + (size_t)((s + sh) % ring) * ss, ss);
            memcpy(ws, tmp, (size_t)ring * ss);
        }
    }
    free(tmp);
    return 1;
}

tqkv_status tqkv_batch_drop_oldest(tqkv_batch *b, int keep) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_drop_oldest: batch is NULL");
    CACHE_CHECK(keep >= 1, TQKV_EINVAL, "batch_drop_oldest: keep must be >= 1, got %d",
                keep);
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE,
                "batch_drop_oldest: a prefill is in progress");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE, "batch_drop_oldest: a spec round is active");
    for (int r = 0; r < b->rows; r++) {
        int d = b->offset[r] - keep;
        if (d <= 0) continue;
        if (!ring_rotate(b, r, d))
            return tqkv_fail(TQKV_ENOMEM, "batch_drop_oldest: out of memory");
        b->left_pad[r] += d;
        b->offset[r] -= d;
        b->win_lo[r] = b->win_lo[r] > d ? b->win_lo[r] - d : 0;
    }
    int min_pad = -1;
    for (int r = 0; r < b->rows; r++)
        if (min_pad < 0 || b->left_pad[r] < min_pad) min_pad = b->left_pad[r];
    if (min_pad < keep) return TQKV_OK;
    /* compaction: every row loses min_pad padding columns (filter keeps spare capacity
     * of cap - min_pad, so the columns shrink to about 2 * keep) */
    int *all = malloc(sizeof(int) * (size_t)b->rows);
    if (!all) return tqkv_fail(TQKV_ENOMEM, "batch_drop_oldest: out of memory");
    for (int r = 0; r < b->rows; r++) all[r] = r;
    tqkv_status st = tqkv_batch_filter(b, all, b->rows);
    free(all);
    return st;
}

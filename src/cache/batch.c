/*
 * batch.c - the batched cache's storage: init/free, config, append (encode + q8 window),
 * offsets, trim, capacity growth, decode of a token range, byte accounting, signature.
 * Owns: the layout described in batch.h and its invariants:
 *   - 0 <= win_lo[r] <= offset[r]; after every append win_lo = max(win_lo, offset - ring);
 *   - left_pad[r] + offset[r] <= cap; columns outside tokens are never read;
 *   - failing calls change nothing (allocate first, then mutate).
 * Must not: run attention, requantize stored bytes, or know about models.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"
#include "util/pool.h"

// ---------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------

tqkv_cache_config tqkv_cache_config_default(void) {
    tqkv_cache_config c;
    memset(&c, 0, sizeof c);
    c.kv_heads = 1;
    c.head_dim = 128;
    c.k_format = TQKV_TQ4;
    c.v_format = TQKV_TQ4;
    c.seed = 0;
    c.window = 0;
    c.window_slack = 32;
    return c;
}

tqkv_status batch_check_config(const tqkv_cache_config *cfg) {
    if (!cfg) return tqkv_fail(TQKV_EINVAL, "cache config is NULL");
    if (cfg->kv_heads < 1 || cfg->kv_heads > CACHE_MAX_KV_HEADS)
        return tqkv_fail(TQKV_EINVAL, "kv_heads must be in [1, %d], got %d", CACHE_MAX_KV_HEADS,
                         cfg->kv_heads);
    if (cfg->head_dim < 32 || cfg->head_dim > 512 || (cfg->head_dim & (cfg->head_dim - 1)))
        return tqkv_fail(TQKV_EINVAL, "head_dim must be a power of two in [32, 512], got %d",
                         cfg->head_dim);
    if ((unsigned)cfg->k_format >= TQKV_FORMAT_COUNT)
        return tqkv_fail(TQKV_EINVAL, "invalid K format %d", (int)cfg->k_format);
    if ((unsigned)cfg->v_format >= TQKV_FORMAT_COUNT)
        return tqkv_fail(TQKV_EINVAL, "invalid V format %d", (int)cfg->v_format);
    if (cfg->window < 0) return tqkv_fail(TQKV_EINVAL, "window must be >= 0, got %d", cfg->window);
    if (cfg->window_slack < 0)
        return tqkv_fail(TQKV_EINVAL, "window_slack must be >= 0, got %d", cfg->window_slack);
    if ((long long)cfg->window + cfg->window_slack > CACHE_MAX_RING)
        return tqkv_fail(TQKV_EINVAL, "window + window_slack must be <= %d, got %d + %d",
                         CACHE_MAX_RING, cfg->window, cfg->window_slack);
    if (cfg->window_keys_only != 0 && cfg->window_keys_only != 1)
        return tqkv_fail(TQKV_EINVAL, "window_keys_only must be 0 or 1, got %d",
                         cfg->window_keys_only);
    for (int i = 0; i < 7; i++)
        if (cfg->reserved[i])
            return tqkv_fail(TQKV_EINVAL, "cache config reserved[%d] must be zero, got %d", i,
                             cfg->reserved[i]);
    return TQKV_OK;
}

int batch_ring_for(const tqkv_cache_config *cfg) {
    if (cfg->window <= 0) return 0;
    const int v_tq = !cfg->window_keys_only && tqkv_format_is_tq(cfg->v_format);
    if (!tqkv_format_is_tq(cfg->k_format) && !v_tq) return 0;
    return cfg->window + cfg->window_slack;
}

int cache_config_diff(const tqkv_cache_config *a, const tqkv_cache_config *b, char *what,
                      size_t cap) {
    if (a->kv_heads != b->kv_heads)
        return snprintf(what, cap, "kv_heads %d vs %d", a->kv_heads, b->kv_heads), 1;
    if (a->head_dim != b->head_dim)
        return snprintf(what, cap, "head_dim %d vs %d", a->head_dim, b->head_dim), 1;
    if (a->k_format != b->k_format)
        return snprintf(what, cap, "K format %s vs %s", tqkv_format_name(a->k_format),
                        tqkv_format_name(b->k_format)), 1;
    if (a->v_format != b->v_format)
        return snprintf(what, cap, "V format %s vs %s", tqkv_format_name(a->v_format),
                        tqkv_format_name(b->v_format)), 1;
    if (a->seed != b->seed)
        return snprintf(what, cap, "seed %llu vs %llu", (unsigned long long)a->seed,
                        (unsigned long long)b->seed), 1;
    if (a->window != b->window)
        return snprintf(what, cap, "window %d vs %d", a->window, b->window), 1;
    if (a->window_slack != b->window_slack)
        return snprintf(what, cap, "window_slack %d vs %d", a->window_slack, b->window_slack), 1;
    if (a->window_keys_only != b->window_keys_only)
        return snprintf(what, cap, "window_keys_only %d vs %d", a->window_keys_only,
                        b->window_keys_only), 1;
    if (memcmp(a->reserved, b->reserved, sizeof a->reserved))
        return snprintf(what, cap, "reserved fields"), 1;
    return 0;
}

// ---------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------

size_t plane_vec_bytes(const tqkv_plane *p) {
    return p->codec.payload + 2 * (size_t)p->codec.n_scales;
}

size_t plane_win_bytes(const struct tqkv_batch *b) {
    return (size_t)b->cfg.head_dim + 2 * (size_t)(b->cfg.head_dim / 32);
}

static void *store_calloc(size_t a, size_t b, size_t c, int *ok) {
    size_t n = tqkv_mul(tqkv_mul(a, b, ok), c, ok);
    if (!*ok) return NULL;
    void *p = calloc(n ? n : 1, 1);
    if (!p) *ok = 0;
    return p;
}

static void store_free(batch_store *s) {
    free(s->kd); free(s->vd); free(s->ks); free(s->vs);
    free(s->kwd); free(s->vwd); free(s->kws); free(s->vws);
    free(s->offset); free(s->left_pad); free(s->win_lo); free(s->prefill_pad);
    free(s->spec_base);
    memset(s, 0, sizeof *s);
}


tqkv_status store_alloc(const struct tqkv_batch *b, int rows, int cap, batch_store *s) {
    memset(s, 0, sizeof *s);
    s->rows = rows;
    s->cap = cap;
    int ok = 1;
    size_t rh = (size_t)rows * (size_t)b->cfg.kv_heads;
    size_t dim = (size_t)b->cfg.head_dim;
    s->kd = store_calloc(rh, (size_t)cap, b->k.codec.payload, &ok);
    if (ok) s->vd = store_calloc(rh, (size_t)cap, b->v.codec.payload, &ok);
    if (ok) s->ks = store_calloc(rh, (size_t)cap, 2 * (size_t)b->k.codec.n_scales, &ok);
    if (ok) s->vs = store_calloc(rh, (size_t)cap, 2 * (size_t)b->v.codec.n_scales, &ok);
    if (ok && b->k.has_window) {
        s->kwd = store_calloc(rh, (size_t)b->ring, dim, &ok);
        if (ok) s->kws = store_calloc(rh, (size_t)b->ring, 2 * (dim / 32), &ok);
    }
    if (ok && b->v.has_window) {
        s->vwd = store_calloc(rh, (size_t)b->ring, dim, &ok);
        if (ok) s->vws = store_calloc(rh, (size_t)b->ring, 2 * (dim / 32), &ok);
    }
    if (ok) s->offset = store_calloc((size_t)rows, sizeof(int), 1, &ok);
    if (ok) s->left_pad = store_calloc((size_t)rows, sizeof(int), 1, &ok);
    if (ok) s->win_lo = store_calloc((size_t)rows, sizeof(int), 1, &ok);
    if (ok) s->prefill_pad = store_calloc((size_t)rows, sizeof(int), 1, &ok);
    if (ok) s->spec_base = store_calloc((size_t)rows, sizeof(int), 1, &ok);
    if (!ok) {
        store_free(s);
        return tqkv_fail(TQKV_ENOMEM, "out of memory allocating cache storage (%d rows x %d "
                         "heads x %d columns)", rows, b->cfg.kv_heads, cap);
    }
    return TQKV_OK;
}

void store_install(struct tqkv_batch *b, batch_store *s) {
    free(b->k.data); free(b->k.scales); free(b->v.data); free(b->v.scales);
    free(b->k.win_data); free(b->k.win_scales); free(b->v.win_data); free(b->v.win_scales);
    free(b->offset); free(b->left_pad); free(b->win_lo); free(b->prefill_pad); free(b->spec_base);
    b->rows = b->rows_cap = s->rows;
    b->cap = s->cap;
    b->k.data = s->kd; b->k.scales = s->ks; b->v.data = s->vd; b->v.scales = s->vs;
    b->k.win_data = s->kwd; b->k.win_scales = s->kws;
    b->v.win_data = s->vwd; b->v.win_scales = s->vws;
    b->offset = s->offset; b->left_pad = s->left_pad; b->win_lo = s->win_lo;
    b->prefill_pad = s->prefill_pad; b->spec_base = s->spec_base;
    b->ext_valid = 0; /* rows moved: the side buffer no longer matches them */
    memset(s, 0, sizeof *s);
}

static void ext_free(struct tqkv_batch *b) {
    free(b->k.ext_data); free(b->k.ext_scales); free(b->v.ext_data); free(b->v.ext_scales);
    free(b->ext_lo); free(b->ext_hi); free(b->ext_off);
    b->k.ext_data = b->v.ext_data = NULL;
    b->k.ext_scales = b->v.ext_scales = NULL;
    b->ext_lo = b->ext_hi = b->ext_off = NULL;
    b->ext_rows = b->ext_cap = b->ext_valid = 0;
}

/* Side buffer for `need` tokens per row (allocate first: on failure nothing changes). */
static tqkv_status ext_reserve(struct tqkv_batch *b, int need) {
    if (b->ext_rows == b->rows && b->ext_cap >= need) return TQKV_OK;
    int ok = 1, cap = need > b->ext_cap ? need : b->ext_cap;
    const size_t rh = (size_t)b->rows * (size_t)b->cfg.kv_heads, d = (size_t)b->cfg.head_dim;
    int8_t *kd = NULL, *vd = NULL;
    uint16_t *ks = NULL, *vs = NULL;
    if (b->k.has_window) {
        kd = store_calloc(rh, (size_t)cap, d, &ok);
        if (ok) ks = store_calloc(rh, (size_t)cap, 2 * (d / 32), &ok);
    }
    if (ok && b->v.has_window) {
        vd = store_calloc(rh, (size_t)cap, d, &ok);
        if (ok) vs = store_calloc(rh, (size_t)cap, 2 * (d / 32), &ok);
    }
    int *lo = ok ? store_calloc((size_t)b->rows, sizeof(int), 1, &ok) : NULL;
    int *hi = ok ? store_calloc((size_t)b->rows, sizeof(int), 1, &ok) : NULL;
    int *off = ok ? store_calloc((size_t)b->rows, sizeof(int), 1, &ok) : NULL;
    if (!ok) {
        free(kd); free(vd); free(ks); free(vs); free(lo); free(hi); free(off);
        return tqkv_fail(TQKV_ENOMEM, "out of memory for the prefill window buffer (%d rows x "
                         "%d tokens)", b->rows, need);
    }
    ext_free(b);
    b->k.ext_data = kd; b->k.ext_scales = ks; b->v.ext_data = vd; b->v.ext_scales = vs;
    b->ext_lo = lo; b->ext_hi = hi; b->ext_off = off;
    b->ext_rows = b->rows;
    b->ext_cap = cap;
    return TQKV_OK;
}

/* Copy row rs of one plane (n token columns from column cs, and the whole ring) into
 * storage row rd at column cd. */
void copy_plane_row(const struct tqkv_batch *src, const tqkv_plane *sp, int rs, int cs,
                           uint8_t *dd, uint16_t *ds, int8_t *dwd, uint16_t *dws, int dcap,
                           int rd, int cd, int n) {
    int H = src->cfg.kv_heads;
    size_t pay = sp->codec.payload, nsc = (size_t)sp->codec.n_scales;
    for (int h = 0; h < H && n > 0; h++) {
        size_t di = ((size_t)rd * H + h) * (size_t)dcap + (size_t)cd;
        memcpy(dd + di * pay, plane_data(sp, src, rs, h, cs), (size_t)n * pay);
        memcpy(ds + di * nsc, plane_scales(sp, src, rs, h, cs), (size_t)n * nsc * 2);
    }
    if (sp->has_window) {
        size_t dim = (size_t)src->cfg.head_dim, per = (size_t)H * src->ring;
        memcpy(dwd + (size_t)rd * per * dim, sp->win_data + (size_t)rs * per * dim, per * dim);
        memcpy(dws + (size_t)rd * per * (dim / 32), sp->win_scales + (size_t)rs * per * (dim / 32),
               per * (dim / 32) * 2);
    }
}

void store_move_row(batch_store *dst, int rd, int pad, const struct tqkv_batch *src, int rs) {
    int cs = src->left_pad[rs], n = src->offset[rs];
    copy_plane_row(src, &src->k, rs, cs, dst->kd, dst->ks, dst->kwd, dst->kws, dst->cap, rd, pad,
                   n);
    copy_plane_row(src, &src->v, rs, cs, dst->vd, dst->vs, dst->vwd, dst->vws, dst->cap, rd, pad,
                   n);
    dst->offset[rd] = n;
    dst->left_pad[rd] = pad;
    dst->win_lo[rd] = src->win_lo[rs];
    dst->spec_base[rd] = src->spec_base[rs];
    dst->prefill_pad[rd] = src->prefill_pad[rs];
}

// ---------------------------------------------------------------------------
// Create / destroy
// ---------------------------------------------------------------------------

static void batch_set_signature(struct tqkv_batch *b, int single) {
    const char *pre = single ? "kv:" : "kv:batched-";
    tqkv_format kf = b->cfg.k_format, vf = b->cfg.v_format;
    /* Rule: both tq -> "<pre>tq:<Kbits>:<Vbits>"; otherwise "<pre><K name>:<V name>". */
    if (tqkv_format_is_tq(kf) && tqkv_format_is_tq(vf))
        snprintf(b->signature, sizeof b->signature, "%stq:%d:%d", pre, tqkv_format_tq_bits(kf),
                 tqkv_format_tq_bits(vf));
    else
        snprintf(b->signature, sizeof b->signature, "%s%s:%s", pre, tqkv_format_name(kf),
                 tqkv_format_name(vf));
}

void batch_destroy(struct tqkv_batch *b) {
    if (!b) return;
    batch_store empty;
    memset(&empty, 0, sizeof empty);
    store_install(b, &empty);
    ext_free(b);
    codec_teardown(&b->k.codec);
    codec_teardown(&b->k.q8);
    codec_teardown(&b->v.codec);
    codec_teardown(&b->v.q8);
    free(b);
}

tqkv_status batch_create(struct tqkv_batch **out, const tqkv_cache_config *cfg, int rows,
                         int cap, int single) {
    tqkv_status st = batch_check_config(cfg);
    if (st) return st;
    struct tqkv_batch *b = calloc(1, sizeof *b);
    if (!b) return tqkv_fail(TQKV_ENOMEM, "out of memory allocating a batch");
    b->cfg = *cfg;
    b->ring = batch_ring_for(cfg);
    if ((st = codec_setup(&b->k.codec, cfg->k_format, cfg->head_dim, cfg->seed)) ||
        (st = codec_setup(&b->v.codec, cfg->v_format, cfg->head_dim, cfg->seed)) ||
        (st = codec_setup(&b->k.q8, TQKV_Q8, cfg->head_dim, cfg->seed)) ||
        (st = codec_setup(&b->v.q8, TQKV_Q8, cfg->head_dim, cfg->seed))) {
        batch_destroy(b);
        return st ? st : tqkv_fail(TQKV_EINVAL, "codec setup failed");
    }
    b->k.has_window = b->ring > 0 && tqkv_format_is_tq(cfg->k_format);
    b->v.has_window = b->ring > 0 && tqkv_format_is_tq(cfg->v_format) && !cfg->window_keys_only;
    batch_store s;
    if ((st = store_alloc(b, rows, cap, &s))) {
        batch_destroy(b);
        return st;
    }
    store_install(b, &s);
    batch_set_signature(b, single);
    *out = b;
    return TQKV_OK;
}

tqkv_status batch_reserve(struct tqkv_batch *b, int need) {
    if (need <= b->cap) return TQKV_OK;
    if (need > CACHE_MAX_COLUMNS)
        return tqkv_fail(TQKV_ERANGE, "cache would need %d columns (limit %d)", need,
                         CACHE_MAX_COLUMNS);
    /* grow by an eighth (at least 16 columns), not by doubling: a batch holds
     * rows x cap columns, so doubling could leave up to half of it spare; the copies
     * stay amortized O(1) per column */
    long long nc = (long long)b->cap + batch_headroom(b->cap);
    if (nc < need) nc = need;
    if (nc > CACHE_MAX_COLUMNS) nc = CACHE_MAX_COLUMNS;
    batch_store s;
    tqkv_status st = store_alloc(b, b->rows, (int)nc, &s);
    if (st) return st;
    /* token columns only (padding is never read; the new storage holds zeros there) */
    for (int r = 0; r < b->rows; r++) store_move_row(&s, r, b->left_pad[r], b, r);
    store_install(b, &s);
    return TQKV_OK;
}

int batch_headroom(int cap) { return cap / 8 > 16 ? cap / 8 : 16; }

int batch_window_lo(const struct tqkv_batch *b, int r) {
    /* both windowed planes share win_lo; with no ring neither has a window (-> offset) */
    return plane_window_start(b->k.has_window ? &b->k : &b->v, b, r);
}

int batch_is_uniform(const struct tqkv_batch *b) {
    for (int r = 0; r < b->rows; r++)
        if (b->left_pad[r] != 0 || b->offset[r] != b->offset[0]) return 0;
    return 1;
}

void batch_clamp_win_lo(struct tqkv_batch *b) {
    for (int r = 0; r < b->rows; r++)
        if (b->win_lo[r] > b->offset[r]) b->win_lo[r] = b->offset[r];
}

// ---------------------------------------------------------------------------
// Public: lifecycle and queries
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_init(tqkv_batch **out, const tqkv_cache_config *cfg, int rows) {
    CACHE_CHECK(out, TQKV_EINVAL, "batch_init: out is NULL");
    CACHE_CHECK(rows >= 0, TQKV_EINVAL, "batch_init: rows must be >= 0, got %d", rows);
    return batch_create(out, cfg, rows, 0, 0);
}

void tqkv_batch_free(tqkv_batch *b) { batch_destroy(b); }

const tqkv_cache_config *tqkv_batch_get_config(const tqkv_batch *b) { return b ? &b->cfg : NULL; }

int tqkv_batch_rows(const tqkv_batch *b) { return b ? b->rows : 0; }

tqkv_status tqkv_batch_offsets(const tqkv_batch *b, int *offset, int *left_pad) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_offsets: batch is NULL");
    if (offset && b->rows) memcpy(offset, b->offset, (size_t)b->rows * sizeof(int));
    if (left_pad && b->rows) memcpy(left_pad, b->left_pad, (size_t)b->rows * sizeof(int));
    return TQKV_OK;
}

int tqkv_batch_columns(const tqkv_batch *b) {
    if (!b) return 0;
    int c = 0;
    for (int r = 0; r < b->rows; r++)
        if (b->left_pad[r] + b->offset[r] > c) c = b->left_pad[r] + b->offset[r];
    return c;
}

const char *tqkv_batch_signature(const tqkv_batch *b) { return b ? b->signature : ""; }

/* Main bytes per token: kv_heads * (K vector bytes + V vector bytes). The q8 window
 * copies are not included (they are a bounded per-row overhead, see bytes_used). */
double tqkv_batch_bytes_per_token(const tqkv_batch *b) {
    if (!b) return 0.0;
    return (double)b->cfg.kv_heads * (double)(plane_vec_bytes(&b->k) + plane_vec_bytes(&b->v));
}

/* Bytes the rows hold: for each row, offset tokens of main K and V vectors, plus the
 * valid q8 copies in the ring (offset - win_lo, at most ring) of each windowed plane.
 * Padding columns and spare capacity are not counted. */
size_t tqkv_batch_bytes_allocated(const tqkv_batch *b) {
    if (!b) return 0;
    size_t rh = (size_t)b->rows_cap * (size_t)b->cfg.kv_heads, dim = (size_t)b->cfg.head_dim;
    size_t per_col = b->k.codec.payload + b->v.codec.payload +
                     2 * ((size_t)b->k.codec.n_scales + (size_t)b->v.codec.n_scales);
    size_t ring = (size_t)b->ring * (dim + 2 * (dim / 32)) *
                  (size_t)(b->k.has_window + b->v.has_window);
    return rh * ((size_t)b->cap * per_col + ring) + (size_t)b->rows_cap * 5 * sizeof(int);
}

size_t tqkv_batch_bytes_used(const tqkv_batch *b) {
    if (!b) return 0;
    size_t main = (size_t)b->cfg.kv_heads * (plane_vec_bytes(&b->k) + plane_vec_bytes(&b->v));
    size_t win = (size_t)b->cfg.kv_heads * plane_win_bytes(b) *
                 (size_t)(b->k.has_window + b->v.has_window);
    size_t total = 0;
    for (int r = 0; r < b->rows; r++) {
        total += (size_t)b->offset[r] * main;
        if (b->ring > 0) total += (size_t)(b->offset[r] - b->win_lo[r]) * win;
    }
    return total;
}

// ---------------------------------------------------------------------------
// Append
// ---------------------------------------------------------------------------

/* Encode n consecutive tokens x [n, dim] of row r head h into plane p, starting at token t0.
 * The q8 copy of token t goes to the side buffer when t < ext_hi (it would leave the ring
 * within this append), else to the ring. */
static void plane_encode(struct tqkv_batch *b, tqkv_plane *p, int r, int h, int t0,
                         const float *x, int n, int ext_lo, int ext_hi) {
    int dim = b->cfg.head_dim;
    int col = b->left_pad[r] + t0;
    uint8_t *pd = (uint8_t *)plane_data(p, b, r, h, col);
    uint16_t *ps = (uint16_t *)plane_scales(p, b, r, h, col);
    if (!p->codec.rotated) {
        codec_encode(&p->codec, x, (size_t)n, pd, ps);
        return;
    }
    float tmp[512]; // [head_dim], rotated domain
    for (int i = 0; i < n; i++) {
        memcpy(tmp, x + (size_t)i * dim, (size_t)dim * sizeof(float));
        codec_rotate_n(&p->codec, tmp, 1);
        codec_encode_rotated(&p->codec, tmp, 1, pd + (size_t)i * p->codec.payload,
                             ps + (size_t)i * p->codec.n_scales);
        if (!p->has_window) continue;
        const int t = t0 + i;
        if (t < ext_hi) {
            const size_t slot = ((size_t)r * b->cfg.kv_heads + h) * b->ext_cap + (t - ext_lo);
            codec_encode(&p->q8, tmp, 1, (uint8_t *)(p->ext_data + slot * dim),
                         p->ext_scales + slot * (dim / 32));
        } else {
            codec_encode(&p->q8, tmp, 1, (uint8_t *)plane_win_data(p, b, r, h, t),
                         (uint16_t *)plane_win_scales(p, b, r, h, t));
        }
    }
}

/* Side-buffer range of row r for an append of cnt tokens: the q8 copies that the queries of
 * this append need ([offset - W + 1, ...)) but the ring will not hold after it
 * ([..., offset + cnt - ring)). Empty (lo >= hi) for short appends. */
static void ext_range(const struct tqkv_batch *b, int r, int cnt, int *lo, int *hi) {
    const int off = b->offset[r], w = b->cfg.window;
    int a = off - w + 1;
    if (a < b->win_lo[r]) a = b->win_lo[r];
    if (a < 0) a = 0;
    *lo = a;
    *hi = off + cnt - b->ring;
}

/* Copy the ring's q8 copies of tokens [lo, hi) of row r (all heads) into the side buffer. */
static void ext_save_ring(struct tqkv_batch *b, int r, int lo, int hi) {
    const size_t d = (size_t)b->cfg.head_dim;
    for (int h = 0; h < b->cfg.kv_heads; h++)
        for (int t = lo; t < hi; t++) {
            const size_t slot = ((size_t)r * b->cfg.kv_heads + h) * b->ext_cap + (t - lo);
            tqkv_plane *ps[2] = {&b->k, &b->v};
            for (int k = 0; k < 2; k++) {
                tqkv_plane *p = ps[k];
                if (!p->has_window) continue;
                memcpy(p->ext_data + slot * d, plane_win_data(p, b, r, h, t), d);
                memcpy(p->ext_scales + slot * (d / 32), plane_win_scales(p, b, r, h, t),
                       2 * (d / 32));
            }
        }
}

static int all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

void batch_set_threads(struct tqkv_batch *b, int threads) {
    if (b) b->threads = threads;
}

/* One (row, head, plane) of an append (item i of rows x kv_heads x 2): each writes its own
 * bytes, from the row's offset and side-buffer range as they were before the append. */
typedef struct {
    struct tqkv_batch *b;
    const float *k, *v;
    int n, prefill;
    size_t per_row;
} append_job;

static void append_item(void *arg, size_t i, int slot) {
    (void)slot;
    const append_job *j = arg;
    struct tqkv_batch *b = j->b;
    const int H = b->cfg.kv_heads, dim = b->cfg.head_dim;
    const int r = (int)(i / ((size_t)H * 2)), h = (int)(i / 2 % (size_t)H), plane = (int)(i % 2);
    const int skip = j->prefill ? b->prefill_pad[r] : 0;
    const int lo = b->ext_valid ? b->ext_lo[r] : 0, hi = b->ext_valid ? b->ext_hi[r] : 0;
    const size_t o = (size_t)r * j->per_row + ((size_t)h * j->n + skip) * dim;
    plane_encode(b, plane ? &b->v : &b->k, r, h, b->offset[r], (plane ? j->v : j->k) + o,
                 j->n - skip, lo, hi);
}

tqkv_status tqkv_batch_append(tqkv_batch *b, const float *k, const float *v, int n) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_append: batch is NULL");
    CACHE_CHECK(n >= 1, TQKV_EINVAL, "batch_append: n must be >= 1, got %d", n);
    if (b->rows == 0) return TQKV_OK;
    CACHE_CHECK(k && v, TQKV_EINVAL, "batch_append: k or v is NULL");
    /* The first append after prepare_prefill carries prefill_n tokens per row; row r's
     * first prefill_pad[r] are padding: not validated, not encoded. Later appends (e.g.
     * chunked prefill continuation before finalize) are ordinary appends. */
    int prefill = b->prefill_active && !b->prefill_appended;
    if (prefill && n != b->prefill_n)
        return tqkv_fail(TQKV_EINVAL, "batch_append: the prefill append must carry %d tokens "
                         "per row (max length), got %d", b->prefill_n, n);
    int H = b->cfg.kv_heads, dim = b->cfg.head_dim;
    size_t per_row = (size_t)H * (size_t)n * (size_t)dim; // [kv_heads, n, head_dim]
    int need = 0;
    for (int r = 0; r < b->rows; r++) {
        int skip = prefill ? b->prefill_pad[r] : 0;
        if ((long long)b->left_pad[r] + b->offset[r] + (n - skip) > CACHE_MAX_COLUMNS)
            return tqkv_fail(TQKV_ERANGE, "batch_append: row %d would exceed %d columns", r,
                             CACHE_MAX_COLUMNS);
        int end = b->left_pad[r] + b->offset[r] + (n - skip);
        if (end > need) need = end;
        for (int h = 0; h < H; h++) {
            size_t o = (size_t)r * per_row + ((size_t)h * n + skip) * dim;
            size_t cnt = (size_t)(n - skip) * dim;
            if (!all_finite(k + o, cnt) || !all_finite(v + o, cnt))
                return tqkv_fail(TQKV_EINVAL,
                                 "batch_append: non-finite value in row %d head %d (NaN/Inf "
                                 "would poison the cache)", r, h);
        }
    }
    tqkv_status st = batch_reserve(b, need);
    if (st) return st;
    int ext_need = 0; /* side-buffer slots per row (see batch.h, per-query window) */
    for (int r = 0; r < b->rows && b->ring > 0; r++) {
        int lo, hi;
        ext_range(b, r, n - (prefill ? b->prefill_pad[r] : 0), &lo, &hi);
        if (hi - lo > ext_need) ext_need = hi - lo;
    }
    if (ext_need > 0 && (st = ext_reserve(b, ext_need))) return st;
    b->ext_valid = ext_need > 0;
    for (int r = 0; r < b->rows && b->ext_valid; r++) { /* before any of the row's encodes */
        int lo, hi;
        ext_range(b, r, n - (prefill ? b->prefill_pad[r] : 0), &lo, &hi);
        if (hi < lo) hi = lo;
        ext_save_ring(b, r, lo, hi < b->offset[r] ? hi : b->offset[r]);
        b->ext_lo[r] = lo;
        b->ext_hi[r] = hi;
        b->ext_off[r] = b->offset[r] + n - (prefill ? b->prefill_pad[r] : 0);
    }
    append_job j = {b, k, v, n, prefill, per_row};
    pool_for(b->threads, (size_t)b->rows * H * 2, append_item, &j);
    for (int r = 0; r < b->rows; r++) {
        b->offset[r] += n - (prefill ? b->prefill_pad[r] : 0);
        if (b->ring > 0 && b->win_lo[r] < b->offset[r] - b->ring)
            b->win_lo[r] = b->offset[r] - b->ring;
    }
    if (prefill) b->prefill_appended = 1;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Trim
// ---------------------------------------------------------------------------

/* Drop the newest n tokens of every row (0 <= n <= min offset, else ERANGE). Refused
 * during a prefill and during a spec round (ESTATE: a round ends with spec_rollback,
 * which knows the round's base). Bytes stay; win_lo is clamped to the new offset, so a
 * cut by <= window_slack reads (and exports) exactly like a fresh cache. */
tqkv_status tqkv_batch_trim(tqkv_batch *b, int n) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_trim: batch is NULL");
    CACHE_CHECK(n >= 0, TQKV_EINVAL, "batch_trim: n must be >= 0, got %d", n);
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE,
                "batch_trim: a prefill is in progress (finalize_prefill first)");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE,
                "batch_trim: a spec round is active (use spec_rollback or spec_commit)");
    for (int r = 0; r < b->rows; r++)
        if (n > b->offset[r])
            return tqkv_fail(TQKV_ERANGE, "batch_trim: n = %d exceeds row %d's length %d", n, r,
                             b->offset[r]);
    for (int r = 0; r < b->rows; r++) b->offset[r] -= n;
    batch_clamp_win_lo(b);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Decode
// ---------------------------------------------------------------------------

void batch_decode_range(const struct tqkv_batch *b, const tqkv_plane *p, int r, int h, int t0,
                        int t1, int rotated, float *out) {
    if (t1 <= t0) return;
    int dim = b->cfg.head_dim;
    int ws = plane_window_start(p, b, r);
    int m1 = t1 < ws ? t1 : ws;
    if (m1 > t0) {
        int col = b->left_pad[r] + t0;
        if (rotated)
            codec_decode_rotated(&p->codec, plane_data(p, b, r, h, col),
                                 plane_scales(p, b, r, h, col), (size_t)(m1 - t0), out);
        else
            codec_decode(&p->codec, plane_data(p, b, r, h, col), plane_scales(p, b, r, h, col),
                         (size_t)(m1 - t0), out);
    }
    int w0 = t0 > ws ? t0 : ws;
    for (int t = w0; t < t1; t++) {
        float *o = out + (size_t)(t - t0) * dim;
        /* the ring holds q8 of the rotated vector */
        codec_decode(&p->q8, (const uint8_t *)plane_win_data(p, b, r, h, t),
                     plane_win_scales(p, b, r, h, t), 1, o);
        if (!rotated && p->codec.rotated) codec_unrotate(&p->codec, o);
    }
}

void batch_decode_token(const struct tqkv_batch *b, const tqkv_plane *p, int r, int h, int t,
                        int q8, float *out) {
    if (!q8 || !p->has_window) {
        int col = b->left_pad[r] + t;
        codec_decode(&p->codec, plane_data(p, b, r, h, col), plane_scales(p, b, r, h, col), 1,
                     out);
        return;
    }
    const int8_t *d;
    const uint16_t *sc;
    plane_q8_at(p, b, r, h, t, &d, &sc);
    codec_decode(&p->q8, (const uint8_t *)d, sc, 1, out);
    codec_unrotate(&p->codec, out);
}

// ---------------------------------------------------------------------------
// Capture (donor): dense floats in the original domain
// ---------------------------------------------------------------------------

tqkv_status tqkv_batch_capture(const tqkv_batch *b, float *k, float *v, int *offset,
                               int *left_pad) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_capture: batch is NULL");
    int cols = tqkv_batch_columns(b);
    int H = b->cfg.kv_heads, dim = b->cfg.head_dim;
    CACHE_CHECK((k && v) || cols == 0 || b->rows == 0, TQKV_EINVAL,
                "batch_capture: k or v is NULL");
    for (int r = 0; r < b->rows && cols > 0; r++) {
        for (int h = 0; h < H; h++) {
            size_t base = ((size_t)r * H + h) * (size_t)cols * dim; // [rows, kv_heads, cols, head_dim]
            int lp = b->left_pad[r], off = b->offset[r];
            memset(k + base, 0, (size_t)lp * dim * sizeof(float));
            memset(v + base, 0, (size_t)lp * dim * sizeof(float));
            batch_decode_range(b, &b->k, r, h, 0, off, 0, k + base + (size_t)lp * dim);
            batch_decode_range(b, &b->v, r, h, 0, off, 0, v + base + (size_t)lp * dim);
            size_t tail = (size_t)(cols - lp - off) * dim;
            memset(k + base + (size_t)(lp + off) * dim, 0, tail * sizeof(float));
            memset(v + base + (size_t)(lp + off) * dim, 0, tail * sizeof(float));
        }
    }
    return tqkv_batch_offsets(b, offset, left_pad);
}

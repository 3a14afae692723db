/*
 * state.c - export / restore of batched and single caches (format: docs/STATE.md).
 * Owns: the byte format: "TQKV", u32 version, TLV sections (u32 tag, u64 length,
 * payload), u32 crc32 of everything before it. All integers little endian.
 * The export is canonical: only tokens (no padding, no spare capacity) and only the q8
 * copies a reader uses (tokens [win_lo', offset), win_lo' = max(0, offset - window,
 * win_lo)), so two caches that read the same hold the same bytes.
 * Restore validates every length and index before allocating or copying and never
 * reads outside [buf, buf + len).
 * Must not: encode or decode vectors, or export transient state (spec / prefill).
 */
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "cache/cache_impl.h"

// ---------------------------------------------------------------------------
// Format constants
// ---------------------------------------------------------------------------

#define STATE_MAGIC       "TQKV"
#define STATE_VERSION     1u
#define STATE_HEADER      8u          /* magic + version */
#define STATE_SEC_HEADER  12u         /* u32 tag + u64 length */
#define STATE_OPTIONAL    0x80000000u /* tag bit: readers that do not know it skip it */
#define SEC_CONFIG        1u
#define SEC_ROWS          2u
#define SEC_KPLANE        3u
#define SEC_VPLANE        4u
#define SEC_WINDOW        5u
#define CONFIG_BYTES      68u
/* Restore refuses states whose padding/ring storage (not backed by state bytes) would
 * exceed this much beyond 16x the state's size. */
#define STATE_UNBACKED_LIMIT ((uint64_t)256 << 20)

// ---------------------------------------------------------------------------
// Little-endian writer / reader
// ---------------------------------------------------------------------------

typedef struct {
    uint8_t *p;
    size_t   n;
} wbuf;

static void put_u32(wbuf *w, uint32_t x) {
    for (int i = 0; i < 4; i++) w->p[w->n++] = (uint8_t)(x >> (8 * i));
}
static void put_u64(wbuf *w, uint64_t x) {
    for (int i = 0; i < 8; i++) w->p[w->n++] = (uint8_t)(x >> (8 * i));
}
static void put_i32(wbuf *w, int32_t x) { put_u32(w, (uint32_t)x); }
static void put_u16(wbuf *w, uint16_t x) {
    w->p[w->n++] = (uint8_t)x;
    w->p[w->n++] = (uint8_t)(x >> 8);
}
static void put_bytes(wbuf *w, const void *src, size_t n) {
    if (n) memcpy(w->p + w->n, src, n);
    w->n += n;
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }
static int32_t  get_i32(const uint8_t *p) { return (int32_t)get_u32(p); }
static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static uint32_t state_crc(const uint8_t *p, size_t n) {
    uLong crc = crc32(0L, Z_NULL, 0);
    while (n > 0) {
        uInt chunk = n > (1u << 30) ? (1u << 30) : (uInt)n;
        crc = crc32(crc, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return (uint32_t)crc;
}

// ---------------------------------------------------------------------------
// Sizes (shared by export and restore)
// ---------------------------------------------------------------------------

/* Bytes of a plane section: sum_r offset[r] * kv_heads * vector bytes. 0 + !ok on overflow. */
static uint64_t plane_section_bytes(int rows, const int *offset, int heads, size_t vec, int *ok) {
    uint64_t tokens = 0;
    for (int r = 0; r < rows; r++) tokens += (uint64_t)offset[r];
    uint64_t per = (uint64_t)heads * vec;
    if (per && tokens > UINT64_MAX / per) { *ok = 0; return 0; }
    return tokens * per;
}

static uint64_t window_section_bytes(int rows, const int *offset, const int *wlo, int heads,
                                     size_t q8vec, int planes, int *ok) {
    uint64_t tokens = 0;
    for (int r = 0; r < rows; r++) tokens += (uint64_t)(offset[r] - wlo[r]);
    uint64_t per = (uint64_t)heads * q8vec * (uint64_t)planes;
    if (per && tokens > UINT64_MAX / per) { *ok = 0; return 0; }
    return tokens * per;
}

// ---------------------------------------------------------------------------
// Export
// ---------------------------------------------------------------------------

static void write_plane(wbuf *w, const struct tqkv_batch *b, const tqkv_plane *p) {
    size_t pay = p->codec.payload;
    int nsc = p->codec.n_scales;
    for (int r = 0; r < b->rows; r++)
        for (int h = 0; h < b->cfg.kv_heads; h++) {
            const uint8_t *d = plane_data(p, b, r, h, b->left_pad[r]);
            const uint16_t *s = plane_scales(p, b, r, h, b->left_pad[r]);
            for (int t = 0; t < b->offset[r]; t++) { /* public vector form: payload, scales */
                put_bytes(w, d + (size_t)t * pay, pay);
                for (int i = 0; i < nsc; i++) put_u16(w, s[(size_t)t * nsc + i]);
            }
        }
}

static void write_window(wbuf *w, const struct tqkv_batch *b, const tqkv_plane *p, int r) {
    int dim = b->cfg.head_dim;
    int lo = batch_window_lo(b, r);
    for (int h = 0; h < b->cfg.kv_heads; h++)
        for (int t = lo; t < b->offset[r]; t++) {
            put_bytes(w, plane_win_data(p, b, r, h, t), (size_t)dim);
            const uint16_t *s = plane_win_scales(p, b, r, h, t);
            for (int i = 0; i < dim / 32; i++) put_u16(w, s[i]);
        }
}

tqkv_status state_export(const struct tqkv_batch *b, int kind, uint8_t **out, size_t *len) {
    CACHE_CHECK(out && len, TQKV_EINVAL, "export: out or len is NULL");
    CACHE_CHECK(!b->spec_active, TQKV_ESTATE,
                "export: a spec round is active (commit or roll back first)");
    CACHE_CHECK(!b->prefill_active, TQKV_ESTATE,
                "export: a prefill is in progress (finalize_prefill first)");
    int ok = 1;
    int *wlo = malloc((size_t)(b->rows ? b->rows : 1) * sizeof(int)); // [rows]
    if (!wlo) return tqkv_fail(TQKV_ENOMEM, "export: out of memory");
    for (int r = 0; r < b->rows; r++) wlo[r] = batch_window_lo(b, r);
    int H = b->cfg.kv_heads;
    int has_win = b->k.has_window || b->v.has_window;
    uint64_t kb = plane_section_bytes(b->rows, b->offset, H, plane_vec_bytes(&b->k), &ok);
    uint64_t vb = plane_section_bytes(b->rows, b->offset, H, plane_vec_bytes(&b->v), &ok);
    uint64_t wb = has_win ? window_section_bytes(b->rows, b->offset, wlo, H, plane_win_bytes(b),
                                                 b->k.has_window + b->v.has_window, &ok)
                          : 0;
    uint64_t rb = 4 + 12 * (uint64_t)b->rows;
    uint64_t total = STATE_HEADER + 4 * (uint64_t)STATE_SEC_HEADER + CONFIG_BYTES + rb + kb + vb +
                     (has_win ? STATE_SEC_HEADER + wb : 0) + 4;
    if (!ok || total > SIZE_MAX) {
        free(wlo);
        return tqkv_fail(TQKV_ERANGE, "export: state too large");
    }
    wbuf w = {malloc((size_t)total), 0};
    if (!w.p) {
        free(wlo);
        return tqkv_fail(TQKV_ENOMEM, "export: out of memory (%llu bytes)",
                         (unsigned long long)total);
    }
    put_bytes(&w, STATE_MAGIC, 4);
    put_u32(&w, STATE_VERSION);
    // ---- config
    put_u32(&w, SEC_CONFIG);
    put_u64(&w, CONFIG_BYTES);
    put_u32(&w, (uint32_t)kind);
    put_i32(&w, b->cfg.kv_heads);
    put_i32(&w, b->cfg.head_dim);
    put_u32(&w, (uint32_t)b->cfg.k_format);
    put_u32(&w, (uint32_t)b->cfg.v_format);
    put_u64(&w, b->cfg.seed);
    put_i32(&w, b->cfg.window);
    put_i32(&w, b->cfg.window_slack);
    put_i32(&w, b->cfg.window_keys_only); /* was reserved[0]: older states hold 0 */
    for (int i = 0; i < 7; i++) put_i32(&w, b->cfg.reserved[i]);
    // ---- rows
    put_u32(&w, SEC_ROWS);
    put_u64(&w, rb);
    put_i32(&w, b->rows);
    for (int r = 0; r < b->rows; r++) {
        put_i32(&w, b->offset[r]);
        put_i32(&w, b->left_pad[r]);
        put_i32(&w, has_win ? wlo[r] : 0);
    }
    // ---- planes
    put_u32(&w, SEC_KPLANE);
    put_u64(&w, kb);
    write_plane(&w, b, &b->k);
    put_u32(&w, SEC_VPLANE);
    put_u64(&w, vb);
    write_plane(&w, b, &b->v);
    // ---- window rings (token order, only the tokens readers take from q8)
    if (has_win) {
        put_u32(&w, SEC_WINDOW);
        put_u64(&w, wb);
        for (int r = 0; r < b->rows; r++) {
            if (b->k.has_window) write_window(&w, b, &b->k, r);
            if (b->v.has_window) write_window(&w, b, &b->v, r);
        }
    }
    put_u32(&w, state_crc(w.p, w.n));
    free(wlo);
    if (w.n != total) { /* internal consistency: never hand out a malformed state */
        free(w.p);
        return tqkv_fail(TQKV_ECORRUPT, "export: internal size mismatch (%zu vs %llu)", w.n,
                         (unsigned long long)total);
    }
    *out = w.p;
    *len = w.n;
    return TQKV_OK;
}

tqkv_status tqkv_batch_export(const tqkv_batch *b, uint8_t **out, size_t *len) {
    CACHE_CHECK(b, TQKV_EINVAL, "batch_export: batch is NULL");
    return state_export(b, 0, out, len);
}

// ---------------------------------------------------------------------------
// Restore
// ---------------------------------------------------------------------------

typedef struct {
    const uint8_t *p;
    uint64_t       n;
    int            present;
} section;

static void read_plane(struct tqkv_batch *b, tqkv_plane *p, const uint8_t *src) {
    size_t pay = p->codec.payload;
    int nsc = p->codec.n_scales;
    for (int r = 0; r < b->rows; r++)
        for (int h = 0; h < b->cfg.kv_heads; h++) {
            uint8_t *d = (uint8_t *)plane_data(p, b, r, h, b->left_pad[r]);
            uint16_t *s = (uint16_t *)plane_scales(p, b, r, h, b->left_pad[r]);
            for (int t = 0; t < b->offset[r]; t++) {
                memcpy(d + (size_t)t * pay, src, pay);
                src += pay;
                for (int i = 0; i < nsc; i++, src += 2) s[(size_t)t * nsc + i] = get_u16(src);
            }
        }
}

static const uint8_t *read_window(struct tqkv_batch *b, tqkv_plane *p, int r,
                                  const uint8_t *src) {
    int dim = b->cfg.head_dim;
    for (int h = 0; h < b->cfg.kv_heads; h++)
        for (int t = b->win_lo[r]; t < b->offset[r]; t++) {
            memcpy((int8_t *)plane_win_data(p, b, r, h, t), src, (size_t)dim);
            src += dim;
            uint16_t *s = (uint16_t *)plane_win_scales(p, b, r, h, t);
            for (int i = 0; i < dim / 32; i++, src += 2) s[i] = get_u16(src);
        }
    return src;
}

#define CORRUPT(...) tqkv_fail(TQKV_ECORRUPT, __VA_ARGS__)

/* The envelope (magic, version, checksum) and the sections of buf: sec[tag] for the known
 * tags; unknown optional sections skipped. */
static tqkv_status restore_sections(const uint8_t *buf, size_t len, const char *what,
                                    section sec[6]) {
    if (len < STATE_HEADER + 4)
        return CORRUPT("%s: state truncated (%zu bytes, need at least %u)", what, len,
                       STATE_HEADER + 4);
    if (memcmp(buf, STATE_MAGIC, 4))
        return CORRUPT("%s: bad magic (not a tqkv state)", what);
    uint32_t version = get_u32(buf + 4);
    if (version != STATE_VERSION)
        return CORRUPT("%s: state version %u is not supported (this build reads version %u)",
                       what, version, STATE_VERSION);
    size_t body = len - 4;
    uint32_t want = get_u32(buf + body), have = state_crc(buf, body);
    if (want != have)
        return CORRUPT("%s: checksum mismatch (stored %08x, computed %08x): state truncated or "
                       "corrupt", what, want, have);
    memset(sec, 0, 6 * sizeof *sec);
    size_t pos = STATE_HEADER;
    while (pos < body) {
        if (body - pos < STATE_SEC_HEADER)
            return CORRUPT("%s: truncated section header at byte %zu", what, pos);
        uint32_t tag = get_u32(buf + pos);
        uint64_t n = get_u64(buf + pos + 4);
        pos += STATE_SEC_HEADER;
        if (n > body - pos)
            return CORRUPT("%s: section 0x%08x at byte %zu claims %llu bytes, only %zu left", what,
                           tag, pos - STATE_SEC_HEADER, (unsigned long long)n, body - pos);
        if (tag >= SEC_CONFIG && tag <= SEC_WINDOW) {
            if (sec[tag].present) return CORRUPT("%s: duplicate section %u", what, tag);
            sec[tag].p = buf + pos;
            sec[tag].n = n;
            sec[tag].present = 1;
        } else if (!(tag & STATE_OPTIONAL)) {
            return CORRUPT("%s: unknown required section 0x%08x (written by a newer version?)",
                           what, tag);
        }
        pos += (size_t)n;
    }
    if (!sec[SEC_CONFIG].present) return CORRUPT("%s: missing config section", what);
    if (!sec[SEC_ROWS].present) return CORRUPT("%s: missing rows section", what);
    if (!sec[SEC_KPLANE].present || !sec[SEC_VPLANE].present)
        return CORRUPT("%s: missing K or V plane section", what);
    return TQKV_OK;
}

/* The config section: a valid cache config of the kind asked for. */
static tqkv_status restore_config(const section *sc, int kind, const char *what,
                                  tqkv_cache_config *cfg) {
    if (sc->n != CONFIG_BYTES)
        return CORRUPT("%s: config section is %llu bytes, expected %u", what,
                       (unsigned long long)sc->n, CONFIG_BYTES);
    const uint8_t *c = sc->p;
    uint32_t skind = get_u32(c);
    if (skind > 1) return CORRUPT("%s: unknown cache kind %u", what, skind);
    if ((int)skind != kind)
        return tqkv_fail(TQKV_EINVAL, "%s: the state holds a %s; use %s", what,
                         skind ? "single cache" : "batched cache",
                         skind ? "tqkv_cache_restore" : "tqkv_batch_restore");
    memset(cfg, 0, sizeof *cfg);
    cfg->kv_heads = get_i32(c + 4);
    cfg->head_dim = get_i32(c + 8);
    uint32_t kf = get_u32(c + 12), vf = get_u32(c + 16);
    if (kf >= TQKV_FORMAT_COUNT || vf >= TQKV_FORMAT_COUNT)
        return CORRUPT("%s: invalid formats %u/%u", what, kf, vf);
    cfg->k_format = (tqkv_format)kf;
    cfg->v_format = (tqkv_format)vf;
    cfg->seed = get_u64(c + 20);
    cfg->window = get_i32(c + 28);
    cfg->window_slack = get_i32(c + 32);
    cfg->window_keys_only = get_i32(c + 36);
    for (int i = 0; i < 7; i++) cfg->reserved[i] = get_i32(c + 40 + 4 * i);
    if (batch_check_config(cfg) != TQKV_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", tqkv_last_error());
        return CORRUPT("%s: invalid config: %s", what, msg);
    }
    return TQKV_OK;
}

/* The rows section: *rows, and off [3, rows] (offsets, left pads, window starts; the
 * caller frees it), checked against cfg; *cols the columns they need. */
static tqkv_status restore_rows(const section *sr, int kind, const tqkv_cache_config *cfg,
                                const char *what, int *rows_out, int **off_out, int *cols_out) {
    const uint8_t *rp = sr->p;
    if (sr->n < 4) return CORRUPT("%s: rows section too short", what);
    int32_t rows = get_i32(rp);
    if (rows < 0) return CORRUPT("%s: negative row count %d", what, rows);
    if (sr->n != 4 + 12 * (uint64_t)rows)
        return CORRUPT("%s: rows section is %llu bytes, expected %llu for %d rows", what,
                       (unsigned long long)sr->n, (unsigned long long)(4 + 12 * (uint64_t)rows),
                       rows);
    if (kind == 1 && rows != 1)
        return CORRUPT("%s: a single cache state must have 1 row, has %d", what, rows);
    const int ring = batch_ring_for(cfg);
    int cols = 0;
    int *off = malloc((size_t)(rows ? rows : 1) * 3 * sizeof(int)); // [3, rows]
    if (!off) return tqkv_fail(TQKV_ENOMEM, "%s: out of memory", what);
    int *pad = off + rows, *wlo = off + 2 * rows;
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < rows && !st; r++) {
        off[r] = get_i32(rp + 4 + 12 * (size_t)r);
        pad[r] = get_i32(rp + 8 + 12 * (size_t)r);
        wlo[r] = get_i32(rp + 12 + 12 * (size_t)r);
        long long lo_min = ring ? (off[r] > cfg->window ? off[r] - cfg->window : 0) : 0;
        if (off[r] < 0 || pad[r] < 0 || (long long)off[r] + pad[r] > CACHE_MAX_COLUMNS)
            st = CORRUPT("%s: row %d: offset %d / left_pad %d out of range", what, r, off[r],
                         pad[r]);
        else if (kind == 1 && pad[r] != 0)
            st = CORRUPT("%s: a single cache has no padding (left_pad %d)", what, pad[r]);
        else if (ring ? (wlo[r] < lo_min || wlo[r] > off[r]) : wlo[r] != 0)
            st = CORRUPT("%s: row %d: window start %d out of range [%lld, %d]", what, r, wlo[r],
                         lo_min, ring ? off[r] : 0);
        else if (off[r] + pad[r] > cols)
            cols = off[r] + pad[r];
    }
    if (st) {
        free(off);
        return st;
    }
    *rows_out = rows;
    *off_out = off;
    *cols_out = cols;
    return TQKV_OK;
}

/* The plane and window sections hold exactly the rows' bytes, and the storage the state
 * asks for beyond them (padding columns, ring slots) stays within the limit. */
static tqkv_status restore_check_sizes(const struct tqkv_batch *b, const section sec[6],
                                       int rows, const int *off, int cols, size_t len,
                                       const char *what) {
    const int *wlo = off + 2 * rows, H = b->cfg.kv_heads, ring = batch_ring_for(&b->cfg);
    int ok = 1;
    uint64_t kb = plane_section_bytes(rows, off, H, plane_vec_bytes(&b->k), &ok);
    uint64_t vb = plane_section_bytes(rows, off, H, plane_vec_bytes(&b->v), &ok);
    int planes = b->k.has_window + b->v.has_window;
    uint64_t wb = window_section_bytes(rows, off, wlo, H, plane_win_bytes(b), planes, &ok);
    /* storage not backed by bytes of the state: padding columns and ring slots */
    double unbacked = 0; /* double: cannot overflow, exact enough for a limit */
    for (int r = 0; r < rows; r++) unbacked += (double)(cols - off[r]);
    unbacked *= (double)H * (double)(plane_vec_bytes(&b->k) + plane_vec_bytes(&b->v));
    unbacked += (double)rows * H * (double)ring * (double)plane_win_bytes(b) * planes;
    if (!ok) return CORRUPT("%s: plane sizes overflow", what);
    if (sec[SEC_KPLANE].n != kb || sec[SEC_VPLANE].n != vb)
        return CORRUPT("%s: plane sections are %llu/%llu bytes, rows need %llu/%llu", what,
                       (unsigned long long)sec[SEC_KPLANE].n,
                       (unsigned long long)sec[SEC_VPLANE].n, (unsigned long long)kb,
                       (unsigned long long)vb);
    if (planes && !sec[SEC_WINDOW].present) return CORRUPT("%s: missing window section", what);
    if (!planes && sec[SEC_WINDOW].present)
        return CORRUPT("%s: window section present but the config has no window", what);
    if (planes && sec[SEC_WINDOW].n != wb)
        return CORRUPT("%s: window section is %llu bytes, rows need %llu", what,
                       (unsigned long long)sec[SEC_WINDOW].n, (unsigned long long)wb);
    if (unbacked > 16.0 * (double)len + (double)STATE_UNBACKED_LIMIT)
        return tqkv_fail(TQKV_EUNSUPPORTED, "%s: state asks for %.0f bytes of padding/window "
                         "storage; refusing (limit 16 x state size + %llu)", what, unbacked,
                         (unsigned long long)STATE_UNBACKED_LIMIT);
    return TQKV_OK;
}

tqkv_status state_restore(struct tqkv_batch **out, int kind, const uint8_t *buf, size_t len) {
    const char *what = kind ? "cache_restore" : "batch_restore";
    CACHE_CHECK(out, TQKV_EINVAL, "%s: out is NULL", what);
    CACHE_CHECK(buf || len == 0, TQKV_EINVAL, "%s: buf is NULL", what);
    section sec[6];
    tqkv_cache_config cfg;
    tqkv_status st = restore_sections(buf, len, what, sec);
    if (!st) st = restore_config(&sec[SEC_CONFIG], kind, what, &cfg);
    if (st) return st;
    int rows = 0, cols = 0, *off = NULL;
    st = restore_rows(&sec[SEC_ROWS], kind, &cfg, what, &rows, &off, &cols);
    if (st) return st;
    // ---- build
    struct tqkv_batch *b = NULL;
    st = batch_create(&b, &cfg, 0, 0, kind);
    if (!st) st = restore_check_sizes(b, sec, rows, off, cols, len, what);
    batch_store s;
    if (!st) st = store_alloc(b, rows, cols, &s);
    if (st) {
        batch_destroy(b);
        free(off);
        return st;
    }
    store_install(b, &s);
    for (int r = 0; r < rows; r++) {
        b->offset[r] = off[r];
        b->left_pad[r] = off[rows + r];
        b->win_lo[r] = off[2 * rows + r];
    }
    free(off);
    read_plane(b, &b->k, sec[SEC_KPLANE].p);
    read_plane(b, &b->v, sec[SEC_VPLANE].p);
    if (sec[SEC_WINDOW].present) {
        const uint8_t *src = sec[SEC_WINDOW].p;
        for (int r = 0; r < rows; r++) {
            if (b->k.has_window) src = read_window(b, &b->k, r, src);
            if (b->v.has_window) src = read_window(b, &b->v, r, src);
        }
    }
    *out = b;
    return TQKV_OK;
}

tqkv_status tqkv_batch_restore(tqkv_batch **out, const uint8_t *buf, size_t len) {
    return state_restore(out, 0, buf, len);
}

/*
 * recurrent.c - recurrent state rows of hybrid graphs (see recurrent.h).
 * Owns: the rows' bytes, their row operations, export / restore and spec snapshots.
 * Must not: compute anything from the bytes: row operations copy, never recompute.
 */
#include "model/state/recurrent.h"

#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "util/common.h"

// ---------------------------------------------------------------------------
// shape
// ---------------------------------------------------------------------------

static void rec_shape(model_recurrent *r, const tqkv_model_config *c) {
    r->n_lin = c->n_linear;
    r->conv_dim = 2 * c->lin_k_heads * c->lin_k_dim + c->lin_v_heads * c->lin_v_dim;
    r->conv_hist = c->lin_conv_kernel - 1;
    r->v_heads = c->lin_v_heads;
    r->k_dim = c->lin_k_dim;
    r->v_dim = c->lin_v_dim;
    r->conv_floats = (size_t)r->conv_dim * (size_t)r->conv_hist;
    r->ssm_floats = (size_t)r->v_heads * (size_t)r->k_dim * (size_t)r->v_dim;
    r->row_floats = (size_t)r->n_lin * (r->conv_floats + r->ssm_floats);
}

static model_recurrent *rec_alloc_like(const model_recurrent *shape, int rows) {
    model_recurrent *r = tqkv_calloc(1, sizeof *r);
    if (!r) return NULL;
    *r = *shape;
    r->rows = rows;
    r->spec_active = 0;
    r->spec_cap = 0;
    r->spec_steps = NULL;
    r->snap = NULL;
    r->broken = 0;
    r->tokens = NULL;
    r->state = calloc(rows ? (size_t)rows * r->row_floats : 1, sizeof(float));
    r->spec_steps = calloc(rows ? (size_t)rows : 1, sizeof(int));
    r->tokens = calloc(rows ? (size_t)rows : 1, sizeof(int));
    if (!r->state || !r->spec_steps || !r->tokens) {
        rec_free(r);
        tqkv_fail(TQKV_ENOMEM, "out of memory for %d recurrent state rows", rows);
        return NULL;
    }
    return r;
}

tqkv_status rec_init(model_recurrent **out, const tqkv_model_config *cfg, int rows) {
    if (!out || !cfg || rows < 0 || cfg->n_linear < 1)
        return tqkv_fail(TQKV_EINVAL, "rec_init: bad arguments");
    model_recurrent shape;
    memset(&shape, 0, sizeof shape);
    rec_shape(&shape, cfg);
    model_recurrent *r = rec_alloc_like(&shape, rows);
    if (!r) return TQKV_ENOMEM;
    *out = r;
    return TQKV_OK;
}

void rec_free(model_recurrent *r) {
    if (!r) return;
    free(r->state);
    free(r->spec_steps);
    free(r->tokens);
    free(r->snap);
    free(r);
}

/* Fresh zeroed planes for `rows` rows: state [rows, row_floats], spec_steps and tokens [rows]. */
static int rows_alloc(const model_recurrent *r, int rows, float **st, int **steps, int **tok) {
    *st = calloc(rows ? (size_t)rows * r->row_floats : 1, sizeof(float));
    *steps = calloc(rows ? (size_t)rows : 1, sizeof(int));
    *tok = calloc(rows ? (size_t)rows : 1, sizeof(int));
    if (*st && *steps && *tok) return 0;
    free(*st);
    free(*steps);
    free(*tok);
    return -1;
}

/* Replace r's planes with new ones of `rows` rows; any spec round and snapshot are dropped. */
static void rows_install(model_recurrent *r, float *st, int *steps, int *tok, int rows) {
    free(r->state);
    free(r->spec_steps);
    free(r->tokens);
    free(r->snap);
    r->state = st;
    r->spec_steps = steps;
    r->tokens = tok;
    r->snap = NULL;
    r->spec_cap = 0;
    r->spec_active = 0;
    r->rows = rows;
}

tqkv_status rec_reset(model_recurrent *r, int rows) {
    if (!r || rows < 0) return tqkv_fail(TQKV_EINVAL, "rec_reset: bad arguments");
    if (rows == 0) rows = r->rows;
    float *st;
    int *steps, *tok;
    if (rows_alloc(r, rows, &st, &steps, &tok))
        return tqkv_fail(TQKV_ENOMEM, "out of memory for %d recurrent state rows", rows);
    rows_install(r, st, steps, tok, rows);
    r->broken = 0;
    return TQKV_OK;
}

float *rec_conv(const model_recurrent *r, int row, int j) {
    return r->state + (size_t)row * r->row_floats + (size_t)j * (r->conv_floats + r->ssm_floats);
}

float *rec_ssm(const model_recurrent *r, int row, int j) { return rec_conv(r, row, j) + r->conv_floats; }

size_t rec_row_bytes(const model_recurrent *r) { return r ? r->row_floats * sizeof(float) : 0; }

// ---------------------------------------------------------------------------
// row operations (copy bytes)
// ---------------------------------------------------------------------------

tqkv_status rec_filter(model_recurrent *r, const int *keep, int n_keep) {
    if (!r || (!keep && n_keep > 0) || n_keep < 0)
        return tqkv_fail(TQKV_EINVAL, "rec_filter: bad arguments");
    for (int i = 0; i < n_keep; i++) {
        if (keep[i] < 0 || keep[i] >= r->rows)
            return tqkv_fail(TQKV_ERANGE, "rec_filter: keep[%d] = %d outside [0, %d)", i, keep[i],
                             r->rows);
        for (int k = 0; k < i; k++)
            if (keep[k] == keep[i])
                return tqkv_fail(TQKV_EINVAL, "rec_filter: row %d kept twice", keep[i]);
    }
    float *st;
    int *steps, *tok;
    if (rows_alloc(r, n_keep, &st, &steps, &tok))
        return tqkv_fail(TQKV_ENOMEM, "rec_filter: out of memory");
    for (int i = 0; i < n_keep; i++) {
        memcpy(st + (size_t)i * r->row_floats, r->state + (size_t)keep[i] * r->row_floats,
               sizeof(float) * r->row_floats);
        tok[i] = r->tokens[keep[i]];
    }
    rows_install(r, st, steps, tok, n_keep);
    return TQKV_OK;
}

static int same_shape(const model_recurrent *a, const model_recurrent *b) {
    return a->n_lin == b->n_lin && a->conv_dim == b->conv_dim && a->conv_hist == b->conv_hist &&
           a->v_heads == b->v_heads && a->k_dim == b->k_dim && a->v_dim == b->v_dim;
}

tqkv_status rec_merge(model_recurrent **out, model_recurrent *const *items, const int *rows,
                      int n_items) {
    if (!out || !items || !rows || n_items < 1)
        return tqkv_fail(TQKV_EINVAL, "rec_merge: bad arguments");
    for (int i = 0; i < n_items; i++) {
        if (!items[i] || !same_shape(items[i], items[0]))
            return tqkv_fail(TQKV_EINVAL, "rec_merge: item %d is NULL or of another shape", i);
        if (rows[i] < 0 || rows[i] >= items[i]->rows)
            return tqkv_fail(TQKV_ERANGE, "rec_merge: item %d row %d outside [0, %d)", i, rows[i],
                             items[i]->rows);
    }
    model_recurrent *r = rec_alloc_like(items[0], n_items);
    if (!r) return TQKV_ENOMEM;
    for (int i = 0; i < n_items; i++) {
        memcpy(r->state + (size_t)i * r->row_floats,
               items[i]->state + (size_t)rows[i] * r->row_floats, sizeof(float) * r->row_floats);
        r->tokens[i] = items[i]->tokens[rows[i]];
    }
    *out = r;
    return TQKV_OK;
}

tqkv_status rec_select(const model_recurrent *r, const int *keep, int n_keep, model_recurrent **out) {
    if (!r || !out || n_keep < 0 || (!keep && n_keep > 0))
        return tqkv_fail(TQKV_EINVAL, "rec_select: bad arguments");
    for (int i = 0; i < n_keep; i++) {
        if (keep[i] < 0 || keep[i] >= r->rows)
            return tqkv_fail(TQKV_ERANGE, "rec_select: keep[%d] = %d outside [0, %d)", i, keep[i],
                             r->rows);
        for (int k = 0; k < i; k++)
            if (keep[k] == keep[i])
                return tqkv_fail(TQKV_EINVAL, "rec_select: row %d kept twice", keep[i]);
    }
    model_recurrent *o = rec_alloc_like(r, n_keep);
    if (!o) return TQKV_ENOMEM;
    for (int i = 0; i < n_keep; i++) {
        memcpy(o->state + (size_t)i * o->row_floats, r->state + (size_t)keep[i] * r->row_floats,
               sizeof(float) * r->row_floats);
        o->tokens[i] = r->tokens[keep[i]];
    }
    *out = o;
    return TQKV_OK;
}

tqkv_status rec_concat(model_recurrent **out, model_recurrent *const *items, int n_items) {
    if (!out || !items || n_items < 1) return tqkv_fail(TQKV_EINVAL, "rec_concat: bad arguments");
    int rows = 0;
    for (int i = 0; i < n_items; i++) {
        if (!items[i] || !same_shape(items[i], items[0]))
            return tqkv_fail(TQKV_EINVAL, "rec_concat: item %d is NULL or of another shape", i);
        rows += items[i]->rows;
    }
    model_recurrent *o = rec_alloc_like(items[0], rows);
    if (!o) return TQKV_ENOMEM;
    int at = 0;
    for (int i = 0; i < n_items; i++) {
        memcpy(o->state + (size_t)at * o->row_floats, items[i]->state,
               sizeof(float) * (size_t)items[i]->rows * o->row_floats);
        memcpy(o->tokens + at, items[i]->tokens, sizeof(int) * (size_t)items[i]->rows);
        at += items[i]->rows;
    }
    *out = o;
    return TQKV_OK;
}

tqkv_status rec_extract(const model_recurrent *r, int row, model_recurrent **out) {
    if (!r || !out) return tqkv_fail(TQKV_EINVAL, "rec_extract: NULL argument");
    model_recurrent *const items[1] = {(model_recurrent *)r};
    int rows[1] = {row};
    return rec_merge(out, items, rows, 1);
}

// ---------------------------------------------------------------------------
// export / restore
// ---------------------------------------------------------------------------

#define REC_MAGIC "TQRS"
#define REC_VERSION 1u
#define REC_HEADER 40 /* magic, version, rows, n_lin, conv_dim, conv_hist, v_heads, k_dim, v_dim, reserved */

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

tqkv_status rec_export(const model_recurrent *r, uint8_t **out, size_t *len) {
    if (!r || !out || !len) return tqkv_fail(TQKV_EINVAL, "rec_export: NULL argument");
    size_t body = (size_t)r->rows * r->row_floats * sizeof(float), tk = 4 * (size_t)r->rows;
    size_t n = REC_HEADER + tk + body + 4;
    uint8_t *b = malloc(n);
    if (!b) return tqkv_fail(TQKV_ENOMEM, "rec_export: out of memory for %zu bytes", n);
    memcpy(b, REC_MAGIC, 4);
    uint32_t h[9] = {REC_VERSION, (uint32_t)r->rows, (uint32_t)r->n_lin, (uint32_t)r->conv_dim,
                     (uint32_t)r->conv_hist, (uint32_t)r->v_heads, (uint32_t)r->k_dim,
                     (uint32_t)r->v_dim, 0};
    for (int i = 0; i < 9; i++) put_u32(b + 4 + 4 * i, h[i]);
    /* floats little endian (the only hosts tqkv builds for are little endian) */
    for (int i = 0; i < r->rows; i++) put_u32(b + REC_HEADER + 4 * (size_t)i, (uint32_t)r->tokens[i]);
    memcpy(b + REC_HEADER + tk, r->state, body);
    put_u32(b + n - 4, (uint32_t)crc32(0L, b, (uInt)(n - 4)));
    *out = b;
    *len = n;
    return TQKV_OK;
}

tqkv_status rec_restore(model_recurrent **out, const tqkv_model_config *cfg, const uint8_t *buf,
                        size_t len) {
    if (!out || !cfg || !buf) return tqkv_fail(TQKV_EINVAL, "rec_restore: NULL argument");
    if (len < REC_HEADER + 4 || memcmp(buf, REC_MAGIC, 4))
        return tqkv_fail(TQKV_ECORRUPT, "recurrent state: bad magic or truncated (%zu bytes)", len);
    if ((uint32_t)crc32(0L, buf, (uInt)(len - 4)) != get_u32(buf + len - 4))
        return tqkv_fail(TQKV_ECORRUPT, "recurrent state: checksum mismatch");
    if (get_u32(buf + 4) != REC_VERSION)
        return tqkv_fail(TQKV_ECORRUPT, "recurrent state: version %u (this build reads %u)",
                         get_u32(buf + 4), REC_VERSION);
    model_recurrent shape;
    memset(&shape, 0, sizeof shape);
    rec_shape(&shape, cfg);
    uint32_t rows = get_u32(buf + 8);
    if (get_u32(buf + 12) != (uint32_t)shape.n_lin || get_u32(buf + 16) != (uint32_t)shape.conv_dim ||
        get_u32(buf + 20) != (uint32_t)shape.conv_hist ||
        get_u32(buf + 24) != (uint32_t)shape.v_heads || get_u32(buf + 28) != (uint32_t)shape.k_dim ||
        get_u32(buf + 32) != (uint32_t)shape.v_dim || get_u32(buf + 36) != 0)
        return tqkv_fail(TQKV_ECORRUPT, "recurrent state: shape does not match the model");
    if (rows > (1u << 20) ||
        (size_t)rows * (shape.row_floats * sizeof(float) + 4) != len - REC_HEADER - 4)
        return tqkv_fail(TQKV_ECORRUPT, "recurrent state: %u rows do not match %zu bytes", rows, len);
    for (uint32_t i = 0; i < rows; i++)
        if (get_u32(buf + REC_HEADER + 4 * (size_t)i) > (1u << 30))
            return tqkv_fail(TQKV_ECORRUPT, "recurrent state: row %u token count out of range", i);
    model_recurrent *r = rec_alloc_like(&shape, (int)rows);
    if (!r) return TQKV_ENOMEM;
    for (uint32_t i = 0; i < rows; i++) r->tokens[i] = (int)get_u32(buf + REC_HEADER + 4 * (size_t)i);
    memcpy(r->state, buf + REC_HEADER + 4 * (size_t)rows, len - REC_HEADER - 4 - 4 * (size_t)rows);
    *out = r;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// speculative rounds
// ---------------------------------------------------------------------------

static float *snap_slot(const model_recurrent *r, int row, int step) {
    return r->snap + ((size_t)row * (size_t)(r->spec_cap + 1) + (size_t)step) * r->row_floats;
}

tqkv_status rec_spec_begin(model_recurrent *r) {
    if (!r) return tqkv_fail(TQKV_EINVAL, "rec_spec_begin: NULL");
    if (r->spec_active) return tqkv_fail(TQKV_ESTATE, "rec_spec_begin: a spec round is active");
    free(r->snap);
    r->snap = NULL;
    r->spec_cap = 0;
    r->snap = malloc(sizeof(float) * (r->rows ? (size_t)r->rows * r->row_floats : 1));
    if (!r->snap) return tqkv_fail(TQKV_ENOMEM, "rec_spec_begin: out of memory");
    memcpy(r->snap, r->state, sizeof(float) * (size_t)r->rows * r->row_floats);
    for (int i = 0; i < r->rows; i++) r->spec_steps[i] = 0;
    r->spec_active = 1;
    return TQKV_OK;
}

tqkv_status rec_spec_reserve(model_recurrent *r, int n) {
    if (!r->spec_active) return TQKV_OK;
    int need = 0;
    for (int i = 0; i < r->rows; i++)
        if (r->spec_steps[i] + n > need) need = r->spec_steps[i] + n;
    if (need <= r->spec_cap) return TQKV_OK;
    int cap = need < 2 * r->spec_cap ? 2 * r->spec_cap : need;
    float *ns = malloc(sizeof(float) * (size_t)r->rows * (size_t)(cap + 1) * r->row_floats);
    if (!ns) return tqkv_fail(TQKV_ENOMEM, "spec round: out of memory for %d recurrent snapshots "
                              "per row (%zu bytes each)", cap, rec_row_bytes(r));
    for (int i = 0; i < r->rows; i++)
        memcpy(ns + (size_t)i * (size_t)(cap + 1) * r->row_floats, snap_slot(r, i, 0),
               sizeof(float) * (size_t)(r->spec_steps[i] + 1) * r->row_floats);
    free(r->snap);
    r->snap = ns;
    r->spec_cap = cap;
    return TQKV_OK;
}

float *rec_spec_slot(const model_recurrent *r, int row, int step) {
    if (!r->spec_active || step > r->spec_cap) return NULL;
    return snap_slot(r, row, step);
}

void rec_advance(model_recurrent *r, const int *len) {
    for (int i = 0; i < r->rows; i++) {
        r->tokens[i] += len[i];
        if (r->spec_active) r->spec_steps[i] += len[i];
    }
}

tqkv_status rec_spec_commit(model_recurrent *r) {
    if (!r || !r->spec_active) return tqkv_fail(TQKV_ESTATE, "rec_spec_commit: no spec round");
    free(r->snap);
    r->snap = NULL;
    r->spec_cap = 0;
    r->spec_active = 0;
    return TQKV_OK;
}

tqkv_status rec_spec_rollback(model_recurrent *r, const int *keep, int n_keep) {
    if (!r || !keep) return tqkv_fail(TQKV_EINVAL, "rec_spec_rollback: NULL argument");
    if (!r->spec_active) return tqkv_fail(TQKV_ESTATE, "rec_spec_rollback: no spec round");
    if (n_keep != 1 && n_keep != r->rows)
        return tqkv_fail(TQKV_EINVAL, "rec_spec_rollback: n_keep must be 1 or rows (%d)", r->rows);
    for (int i = 0; i < r->rows; i++) {
        int k = keep[n_keep == 1 ? 0 : i];
        if (k < 0 || k > r->spec_steps[i])
            return tqkv_fail(TQKV_ERANGE, "rec_spec_rollback: keep[%d] = %d not in [0, %d]", i, k,
                             r->spec_steps[i]);
    }
    for (int i = 0; i < r->rows; i++) {
        int k = keep[n_keep == 1 ? 0 : i];
        memcpy(r->state + (size_t)i * r->row_floats, snap_slot(r, i, k), sizeof(float) * r->row_floats);
        r->tokens[i] -= r->spec_steps[i] - k;
    }
    return rec_spec_commit(r);
}

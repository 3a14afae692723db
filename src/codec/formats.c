/*
 * formats.c - KV format names, sizes and bits per value; head_dim validation;
 * "K/V" format spec parsing.
 * Owns: the public "Formats" section of tqkv.h and tqkv_kv_spec_parse.
 * Must not: encode or decode anything, allocate, or hold state.
 */
#include <stdio.h>
#include <string.h>

#include "codec/codec.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------

static const char *const FORMAT_NAMES[TQKV_FORMAT_COUNT] = {
    [TQKV_F32] = "f32", [TQKV_F16] = "f16", [TQKV_Q8] = "q8",  [TQKV_Q4] = "q4",
    [TQKV_TQ2] = "tq2", [TQKV_TQ3] = "tq3", [TQKV_TQ4] = "tq4",
    [TQKV_FP8] = "fp8", [TQKV_TQ1] = "tq1",
};

/* Parse one name from [s, s+len). Accepts the canonical names and the ggml
 * spellings "q8_0" / "q4_0". Returns 1 on success. */
static int format_lookup(const char *s, size_t len, tqkv_format *out) {
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
        if (strlen(FORMAT_NAMES[f]) == len && !memcmp(s, FORMAT_NAMES[f], len)) {
            *out = (tqkv_format)f;
            return 1;
        }
    }
    if (len == 4 && !memcmp(s, "q8_0", 4)) { *out = TQKV_Q8; return 1; }
    if (len == 4 && !memcmp(s, "q4_0", 4)) { *out = TQKV_Q4; return 1; }
    return 0;
}

#define FORMAT_LIST "f32, f16, q8, q4, tq1, tq2, tq3, tq4, fp8"

tqkv_status tqkv_format_parse(const char *name, tqkv_format *out) {
    if (!name || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_format_parse: NULL argument");
    tqkv_format f;
    if (!format_lookup(name, strlen(name), &f))
        return tqkv_fail(TQKV_EINVAL, "unknown KV format '%.64s' (expected one of " FORMAT_LIST ")",
                         name);
    *out = f;
    return TQKV_OK;
}

const char *tqkv_format_name(tqkv_format f) {
    if ((int)f < 0 || f >= TQKV_FORMAT_COUNT) return "unknown";
    return FORMAT_NAMES[f];
}

int tqkv_format_is_tq(tqkv_format f) {
    return f == TQKV_TQ1 || f == TQKV_TQ2 || f == TQKV_TQ3 || f == TQKV_TQ4;
}

int tqkv_format_tq_bits(tqkv_format f) {
    switch (f) {
    case TQKV_TQ1: return 1;
    case TQKV_TQ2: return 2;
    case TQKV_TQ3: return 3;
    case TQKV_TQ4: return 4;
    default: return 0;
    }
}

// ---------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------

static int dim_ok(int dim) { return dim >= 32 && dim <= 512 && (dim & (dim - 1)) == 0; }

tqkv_status tqkv_check_dim(int dim) {
    if (!dim_ok(dim))
        return tqkv_fail(TQKV_EINVAL,
                         "head_dim %d is not supported: it must be a power of two in [32, 512]",
                         dim);
    return TQKV_OK;
}

/* Payload bytes and fp16 scales per vector; 0 payload if invalid. */
void codec_format_layout(tqkv_format f, int dim, size_t *payload, int *n_scales) {
    size_t p = 0;
    int s = 0;
    if (dim_ok(dim)) {
        size_t d = (size_t)dim;
        switch (f) {
        case TQKV_F32: p = 4 * d; s = 0; break;
        case TQKV_F16: p = 2 * d; s = 0; break;
        case TQKV_Q8: p = d; s = dim / 32; break;
        case TQKV_Q4: p = d / 2; s = dim / 32; break;
        case TQKV_TQ1: p = d / 8; s = 1; break;
        case TQKV_TQ2: p = 2 * d / 8; s = 1; break;
        case TQKV_TQ3: p = 3 * d / 8; s = 1; break;
        case TQKV_TQ4: p = 4 * d / 8; s = 1; break;
        case TQKV_FP8: p = d; s = 1; break;
        default: break;
        }
    }
    if (payload) *payload = p;
    if (n_scales) *n_scales = p ? s : 0;
}

size_t tqkv_format_bytes(tqkv_format f, int dim) {
    size_t p;
    int s;
    codec_format_layout(f, dim, &p, &s);
    return p ? p + 2 * (size_t)s : 0;
}

double tqkv_format_bits_per_value(tqkv_format f, int dim) {
    size_t b = tqkv_format_bytes(f, dim);
    return b ? 8.0 * (double)b / (double)dim : 0.0;
}

// ---------------------------------------------------------------------------
// "K/V" spec
// ---------------------------------------------------------------------------

tqkv_status tqkv_kv_spec_parse(const char *spec, tqkv_format *k, tqkv_format *v) {
    if (!spec || !k || !v) return tqkv_fail(TQKV_EINVAL, "tqkv_kv_spec_parse: NULL argument");
    const char *slash = strchr(spec, '/');
    size_t len = strlen(spec);
    tqkv_format fk, fv;
    if (!slash) {
        if (!format_lookup(spec, len, &fk))
            return tqkv_fail(TQKV_EINVAL,
                             "unknown KV format '%.64s' (expected a format or K/V pair of "
                             FORMAT_LIST ", e.g. 'tq4' or 'tq4/tq3')", spec);
        *k = *v = fk;
        return TQKV_OK;
    }
    size_t kl = (size_t)(slash - spec);
    const char *vs = slash + 1;
    if (strchr(vs, '/'))
        return tqkv_fail(TQKV_EINVAL, "bad KV spec '%.64s': at most one '/' (K/V)", spec);
    if (!format_lookup(spec, kl, &fk))
        return tqkv_fail(TQKV_EINVAL, "bad KV spec '%.64s': unknown K format '%.*s' (expected "
                         FORMAT_LIST ")", spec, (int)(kl > 32 ? 32 : kl), spec);
    if (!format_lookup(vs, strlen(vs), &fv))
        return tqkv_fail(TQKV_EINVAL, "bad KV spec '%.64s': unknown V format '%.32s' (expected "
                         FORMAT_LIST ")", spec, vs);
    *k = fk;
    *v = fv;
    return TQKV_OK;
}

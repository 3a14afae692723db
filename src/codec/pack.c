/*
 * pack.c - bit planes of tq indices (layout fixed by codec.h; see docs/FORMATS.md).
 * Owns: codec_pack_indices / codec_unpack_indices and the plane helpers.
 * Must not: quantize or touch scales.
 *
 * Per 32-value group g:
 *   4-bit plane: 16 bytes; byte 16g+j: low nibble = elem 32g+j, high = elem 32g+16+j
 *   2-bit plane:  8 bytes; byte 8g+j bits [2k, 2k+2) = elem 32g+8k+j
 *   1-bit plane:  4 bytes; bit i of the LE uint32 at 4g = elem 32g+i
 * tq3 = 2-bit plane (dim/4 bytes) then 1-bit plane (dim/8 bytes); tq1 = one 1-bit plane.
 */
#include <string.h>

#include "codec/codec_impl.h"

// ---------------------------------------------------------------------------
// Planes
// ---------------------------------------------------------------------------

void codec_plane4_pack(const uint8_t *idx, int dim, uint8_t *out) {
    // idx: [dim], out: [dim/2]
    for (int g = 0; g < dim / 32; g++)
        for (int j = 0; j < 16; j++)
            out[16 * g + j] =
                (uint8_t)((idx[32 * g + j] & 15) | (idx[32 * g + 16 + j] & 15) << 4);
}

void codec_plane4_unpack(const uint8_t *in, int dim, uint8_t *idx) {
    for (int g = 0; g < dim / 32; g++)
        for (int j = 0; j < 16; j++) {
            uint8_t b = in[16 * g + j];
            idx[32 * g + j] = b & 15;
            idx[32 * g + 16 + j] = b >> 4;
        }
}

static void pack2(const uint8_t *idx, int dim, uint8_t *out) {
    // idx: [dim], out: [dim/4]
    for (int g = 0; g < dim / 32; g++)
        for (int j = 0; j < 8; j++) {
            const uint8_t *e = idx + 32 * g + j;
            out[8 * g + j] = (uint8_t)((e[0] & 3) | (e[8] & 3) << 2 | (e[16] & 3) << 4 |
                                       (e[24] & 3) << 6);
        }
}

static void unpack2(const uint8_t *in, int dim, uint8_t *idx) {
    for (int g = 0; g < dim / 32; g++)
        for (int j = 0; j < 8; j++) {
            uint8_t b = in[8 * g + j];
            uint8_t *e = idx + 32 * g + j;
            e[0] = b & 3;
            e[8] = (b >> 2) & 3;
            e[16] = (b >> 4) & 3;
            e[24] = (b >> 6) & 3;
        }
}

/* 1-bit plane of bit `bit` of each index. */
static void pack1(const uint8_t *idx, int dim, int bit, uint8_t *out) {
    // idx: [dim], out: [dim/8]
    for (int g = 0; g < dim / 32; g++) {
        uint32_t w = 0;
        for (int i = 0; i < 32; i++) w |= (uint32_t)((idx[32 * g + i] >> bit) & 1) << i;
        out[4 * g + 0] = (uint8_t)w;
        out[4 * g + 1] = (uint8_t)(w >> 8);
        out[4 * g + 2] = (uint8_t)(w >> 16);
        out[4 * g + 3] = (uint8_t)(w >> 24);
    }
}

/* OR bit `bit` from the 1-bit plane into idx. */
static void unpack1_or(const uint8_t *in, int dim, int bit, uint8_t *idx) {
    for (int g = 0; g < dim / 32; g++) {
        uint32_t w = (uint32_t)in[4 * g] | (uint32_t)in[4 * g + 1] << 8 |
                     (uint32_t)in[4 * g + 2] << 16 | (uint32_t)in[4 * g + 3] << 24;
        for (int i = 0; i < 32; i++) idx[32 * g + i] |= (uint8_t)(((w >> i) & 1) << bit);
    }
}

// ---------------------------------------------------------------------------
// Public (module) entry points
// ---------------------------------------------------------------------------

void codec_pack_indices(const struct tqkv_codec *c, const uint8_t *idx, uint8_t *payload) {
    const int d = c->dim;
    switch (c->bits) {
    case 4: codec_plane4_pack(idx, d, payload); break;
    case 3:
        pack2(idx, d, payload);
        pack1(idx, d, 2, payload + d / 4);
        break;
    case 2: pack2(idx, d, payload); break;
    case 1: pack1(idx, d, 0, payload); break;
    default: break;
    }
}

void codec_unpack_indices(const struct tqkv_codec *c, const uint8_t *payload, uint8_t *idx) {
    codec_unpack_bits(c->bits, c->dim, payload, idx);
}

void codec_unpack_bits(int bits, int d, const uint8_t *payload, uint8_t *idx) {
    switch (bits) {
    case 4: codec_plane4_unpack(payload, d, idx); break;
    case 3:
        unpack2(payload, d, idx);
        unpack1_or(payload + d / 4, d, 2, idx);
        break;
    case 2: unpack2(payload, d, idx); break;
    case 1:
        memset(idx, 0, (size_t)d);
        unpack1_or(payload, d, 0, idx);
        break;
    default: break;
    }
}

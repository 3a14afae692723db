/*
 * codec.h - internal codec interface: formats, rotation, codebooks, bit packing.
 * Owns: how one vector of head_dim values becomes bytes and back.
 * Must not: know about caches, rows or attention.
 *
 * A vector is stored as two planes so that SIMD and GPU kernels stream aligned data:
 *   payload [payload_bytes]  packed indices / ints / halves / floats
 *   scales  [n_scales]       fp16 scales (tq, fp8: 1 per vector; q8/q4: 1 per 32 values)
 * The public byte form of one vector (tqkv_codec_encode) is payload then scales (LE).
 *
 * Bit packing, per 32-value group g (see docs/FORMATS.md):
 *   4-bit plane (tq4, q4): 16 bytes; byte 16g+j: low nibble = elem 32g+j, high = 32g+16+j
 *   2-bit plane (tq2, tq3 low bits): 8 bytes; byte 8g+j bits [2k,2k+2) = elem 32g+8k+j
 *   1-bit plane (tq3 high bit): 4 bytes; bit i of LE uint32 at 4g = elem 32g+i
 * tq3 payload = 2-bit plane (dim/4 bytes) followed by 1-bit plane (dim/8 bytes);
 * index = low2 | high1 << 2.
 * tq indices address the ascending Lloyd-Max centroids; stored vectors are in the
 * rotated domain: x_hat = scale * R^T c[idx], R = H D / sqrt(dim).
 */
#ifndef TQKV_CODEC_H
#define TQKV_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

struct tqkv_codec {
    tqkv_format format;
    int         dim;
    int         bits;          /* tq bits (2..4), 0 otherwise */
    int         rotated;       /* 1 for tq formats: payload holds rotated-domain indices */
    size_t      payload;       /* payload bytes per vector */
    int         n_scales;      /* fp16 scales per vector */
    uint64_t    seed;
    float       centroids[16]; /* tq: Lloyd-Max N(0,1) centroids / sqrt(dim), ascending */
    float       bounds[15];    /* tq: midpoints between consecutive centroids */
    float      *signs;         /* [dim] +-1 sign flips (tq formats), NULL otherwise */
};

/* fp8 (OCP e4m3, bias 7, max 448, no inf) byte b as the fp16 bits of b's value * 2^-8:
 * sign to bit 15, exponent and mantissa shifted left 7 (e4m3 subnormals become fp16
 * subnormals, exactly). A decoded fp8 value is f16_to_f32(codec_fp8_half(b)) * (s * 256)
 * with s the vector's fp16 scale as float: one float multiply, exact (4 x 11 significant
 * bits). The NaN bytes 0x7f / 0xff are never written (they read as +-480). */
static inline uint16_t codec_fp8_half(uint8_t b) {
    return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
/* e4m3 byte of v (finite), round to nearest even, saturating at +-448; -0 keeps its sign. */
uint8_t codec_e4m3_from_double(double v);

/* Fill a codec in place (no allocation besides signs). Used by caches that embed codecs. */
tqkv_status codec_setup(struct tqkv_codec *c, tqkv_format f, int dim, uint64_t seed);
void        codec_teardown(struct tqkv_codec *c);

/* Gaussian Lloyd-Max centroids for N(0,1), ascending, 2^bits entries (bits 1..4). */
const double *codec_lloyd_max(int bits);

/* Rotation of one vector in place. */
void codec_rotate(const struct tqkv_codec *c, float *x);   /* x <- H D x / sqrt(d) */
void codec_unrotate(const struct tqkv_codec *c, float *x); /* x <- D H x / sqrt(d) */
/* Rotate n vectors [n, dim] in place with the fastest path this CPU has (AVX2 or scalar);
 * bitwise equal to codec_rotate on each vector. No argument checks (internal). */
void codec_rotate_n(const struct tqkv_codec *c, float *x, size_t n);
/* Normalized fast Walsh-Hadamard transform in place (self-inverse), O(d log d). */
void codec_fwht(float *x, int dim);

/* Encode n vectors x [n, dim] (original domain) into planes
 * payload [n, c->payload] and scales [n, c->n_scales]. */
void codec_encode(const struct tqkv_codec *c, const float *x, size_t n, uint8_t *payload,
                  uint16_t *scales);
/* tq only: encode vectors that are already rotated (xr = R x). Same bytes as codec_encode. */
void codec_encode_rotated(const struct tqkv_codec *c, const float *xr, size_t n,
                          uint8_t *payload, uint16_t *scales);
/* Decode n vectors to the original domain. */
void codec_decode(const struct tqkv_codec *c, const uint8_t *payload, const uint16_t *scales,
                  size_t n, float *x);
/* Decode without the inverse rotation (tq: scale * c[idx]); same as codec_decode otherwise. */
void codec_decode_rotated(const struct tqkv_codec *c, const uint8_t *payload,
                          const uint16_t *scales, size_t n, float *x);

/* Unpack the tq indices of one vector: idx [dim] in [0, 2^bits). */
void codec_unpack_indices(const struct tqkv_codec *c, const uint8_t *payload, uint8_t *idx);
/* The same from the bit width alone (bits 2..4), for readers that hold no codec. */
void codec_unpack_bits(int bits, int dim, const uint8_t *payload, uint8_t *idx);
void codec_pack_indices(const struct tqkv_codec *c, const uint8_t *idx, uint8_t *payload);

#endif

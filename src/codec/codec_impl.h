/*
 * codec_impl.h - private helpers shared by the .c files of src/codec only.
 * Owns: declarations that cross file boundaries inside the codec module.
 * Must not: be included from outside src/codec (use codec.h / tqkv.h there).
 */
#ifndef TQKV_CODEC_IMPL_H
#define TQKV_CODEC_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "codec/codec.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tqkv codec assumes a little-endian host (payload halves/floats are stored LE)"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define TQKV_CODEC_X86 1
#else
#define TQKV_CODEC_X86 0
#endif

// ---- formats.c ----
/* Payload bytes and fp16 scales per vector (payload 0 when f/dim is invalid). */
void codec_format_layout(tqkv_format f, int dim, size_t *payload, int *n_scales);

// ---- pack.c ----
/* 4-bit plane (tq4 indices, q4 nibbles): idx [dim] <-> bytes [dim/2]. */
void codec_plane4_pack(const uint8_t *idx, int dim, uint8_t *out);
void codec_plane4_unpack(const uint8_t *in, int dim, uint8_t *idx);

// ---- rotation.c ----
/* Unnormalized Walsh-Hadamard butterflies in place (scalar reference order). */
void codec_fwht_raw(float *x, int dim);
/* 1/sqrt(dim) as the float every rotation path multiplies by. */
float codec_inv_sqrt_dim(int dim);
/* Sign flips for (seed, dim): signs [dim] of +-1.0f. */
void codec_make_signs(uint64_t seed, int dim, float *signs);

// ---- codec_avx2.c (only call when tqkv_cpu_has_avx2()) ----
#if TQKV_CODEC_X86
/* Same butterflies as codec_fwht_raw, bitwise identical results. */
void codec_fwht_raw_avx2(float *x, int dim);
/* Rotate one vector: x[i] *= signs[i]; fwht_raw; x[i] *= inv. Bitwise = scalar. */
void codec_rotate_avx2(const struct tqkv_codec *c, float *x);
/* Unrotate one vector: fwht_raw then x[i] *= signs[i] * inv. Bitwise = scalar. */
void codec_unrotate_avx2(const struct tqkv_codec *c, float *x);
/* Decode one vector without inverse rotation; bitwise equal to the scalar path.
 * payload [c->payload], scales [c->n_scales] -> x [dim]. Not for f32. */
void codec_decode_one_avx2(const struct tqkv_codec *c, const uint8_t *payload,
                           const uint16_t *scales, float *x);
/* tq encode pieces, bitwise equal to the scalar ones in codec.c:
 * sum of x[i]^2 in float64 over four interleaved lanes, then (a0 + a1) + (a2 + a3). */
double codec_norm2_avx2(const float *x, int dim);
/* idx[i] = #bounds < x[i] * inv; returns ||centroids[idx]||^2 (same lanes/order). */
double codec_tq_quantize_avx2(const struct tqkv_codec *c, const float *xr, float inv,
                              uint8_t *idx);
/* f16 payload (LE halves) of x [dim]; NaN -> sign | 0x7e00 like tqkv_f32_to_f16. */
void codec_f16_encode_avx2(int dim, const float *x, uint8_t *payload);
/* q8_0 of one vector (codec.c's q8_encode_one, bit for bit). */
void codec_q8_encode_avx2(int dim, const float *x, uint8_t *payload, uint16_t *scales);
/* fp8 payload of x [dim] at scale s (finite, > 0): bytes equal to codec_e4m3_from_double
 * of the float64 quotients x[i] / s. */
void codec_fp8_encode_avx2(int dim, const float *x, float s, uint8_t *payload);
#endif

#endif

/*
 * ops.h - elementwise and per-vector kernels of the forward pass: RMSNorm, RoPE, SwiGLU,
 * log-softmax. Every kernel works on one vector at a time with a fixed order, so a row's
 * result never depends on the other rows (batch invariance).
 * Owns: these kernels and the RoPE frequency table.
 * Must not: allocate, thread, or know about caches.
 */
#ifndef TQKV_OPS_H
#define TQKV_OPS_H

#include <stddef.h>

#include "tqkv_model.h"

/* out[i] = w[i] * (x[i] * (1 / sqrt(mean(x^2) + eps))); in place allowed. [n] */
void ops_rmsnorm(const float *x, const float *w, float eps, int n, float *out);

/* Inverse frequencies [head_dim / 2] for the config's rope type (HF float32 semantics). */
void ops_rope_freqs(const tqkv_model_config *c, float *inv_freq);
/* cos/sin [half] of angle (float)pos * inv_freq[i] (a float product, as HF computes it). */
void ops_rope_table(int pos, const float *inv_freq, int half, float *cos_t, float *sin_t);
/* NEOX rotation of n_heads vectors x [n_heads, head_dim] in place:
 * x[i] <- x[i] c - x[i+h] s;  x[i+h] <- x[i+h] c + x[i] s   (h = head_dim / 2). */
void ops_rope_apply(float *x, int n_heads, int head_dim, const float *cos_t, const float *sin_t);

/* h[i] = silu(g[i]) * u[i]  (silu(g) = g / (1 + exp(-g))). [n] */
void ops_swiglu(const float *g, const float *u, int n, float *h);

/* Vectorized exp (|rel err| < 2e-7 on [-87, 88]); scalar and AVX2 paths agree bitwise. */
void ops_exp(const float *x, int n, float *out);

#endif

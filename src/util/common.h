/*
 * common.h - small shared helpers: fp16/bf16 conversion, CPU features, checked allocation.
 * Owns: nothing stateful (the thread's error message is error.c's).
 * Must not: hold state that must be one per process (libtqkv-model runs its own hidden
 * copy of this code: docs/ARCHITECTURE.md, "Libraries"); the CPU-feature answers it
 * caches are the same in every copy.
 */
#ifndef TQKV_COMMON_H
#define TQKV_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "tqkv.h"

/* The error slot (tqkv_fail, tqkv_clear_error, tqkv_last_error) is declared in tqkv.h and
 * lives in error.c: public, because libtqkv-model (which carries its own hidden copy of
 * the helpers below) must set the one message per thread that tqkv_last_error() reads.
 * The helpers below are internal: not exported from either shared library. */

/* ---- small helpers every module may use (inline: nothing to export) ---- */

/* Seconds on the monotonic clock. */
static inline double tqkv_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* *p resized to hold n floats (at least one); 0 when out of memory (*p unchanged). */
static inline int tqkv_grow_floats(float **p, size_t n) {
    float *q = (float *)realloc(*p, sizeof(float) * (n ? n : 1));
    if (!q) return 0;
    *p = q;
    return 1;
}

/* ---- fp16 / bf16 (scalar, exact round-to-nearest-even) ---- */
uint16_t tqkv_f32_to_f16(float f);
float    tqkv_f16_to_f32(uint16_t h);
/* bf16 of a finite f, nearest even (a NaN is not kept): the device weights' and the GEMM
 * split's rounding. */
static inline uint16_t tqkv_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float tqkv_bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- CPU features (runtime dispatch) ---- */
/* The one target attribute of every AVX2/FMA/F16C function; callers reach such a function
 * only when tqkv_cpu_has_avx2() says so, and always have a scalar fallback. */
#define TQKV_AVX2 __attribute__((target("avx2,fma,f16c")))
int tqkv_cpu_has_avx2(void); /* AVX2 + FMA + F16C; honours TQKV_NO_SIMD=1 */
/* AVX-512 F/BW/VL/DQ (and, for _bf16, AVX512_BF16) on top of tqkv_cpu_has_avx2(); both
 * honour TQKV_NO_AVX512=1 (the AVX2 kernels then run) and TQKV_NO_SIMD=1. */
#define TQKV_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define TQKV_AVX512_BF16                                                                          \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
int tqkv_cpu_has_avx512(void);
int tqkv_cpu_has_avx512_bf16(void);

/* ---- checked allocation helpers ---- */
void *tqkv_malloc(size_t n);           /* NULL on failure, sets TQKV_ENOMEM message */
void *tqkv_calloc(size_t n, size_t sz);
/* Overflow-checked a*b; returns 0 on overflow (and sets *ok = 0). */
static inline size_t tqkv_mul(size_t a, size_t b, int *ok) {
    if (a && b > SIZE_MAX / a) { *ok = 0; return 0; }
    return a * b;
}

#endif

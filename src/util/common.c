/*
 * common.c - status names, checked allocation, fp16 conversion, CPU feature detection.
 * (The thread's error message is error.c's.)
 */
#include "common.h"

#include <stdlib.h>

/* ------------------------------------------------------------------------- */
/* Status names, allocation                                                   */
/* ------------------------------------------------------------------------- */

const char *tqkv_status_name(tqkv_status s) {
    switch (s) {
    case TQKV_OK: return "ok";
    case TQKV_EINVAL: return "invalid argument";
    case TQKV_ERANGE: return "out of range";
    case TQKV_ESTATE: return "invalid state";
    case TQKV_ENOMEM: return "out of memory";
    case TQKV_ECORRUPT: return "corrupt data";
    case TQKV_EIO: return "i/o error";
    case TQKV_EUNSUPPORTED: return "unsupported";
    case TQKV_EBUSY: return "busy";
    }
    return "unknown status";
}

void *tqkv_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) tqkv_fail(TQKV_ENOMEM, "out of memory allocating %zu bytes", n);
    return p;
}

void *tqkv_calloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) tqkv_fail(TQKV_ENOMEM, "out of memory allocating %zu x %zu bytes", n, sz);
    return p;
}

/* ------------------------------------------------------------------------- */
/* fp16                                                                       */
/* ------------------------------------------------------------------------- */

uint16_t tqkv_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t mant = x & 0x7fffffu;
    int32_t exp = (int32_t)((x >> 23) & 0xffu);
    if (exp == 0xff) /* inf / nan */
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0));
    exp = exp - 127 + 15;
    if (exp >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (exp <= 0) {                                    /* subnormal or zero */
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = 1u << (shift - 1);
        uint32_t rem = mant & ((1u << shift) - 1);
        uint32_t h = mant >> shift;
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++; /* may carry into exp: ok */
    return (uint16_t)(sign | h);
}

float tqkv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t x;
    if (exp == 0) {
        if (mant == 0) {
            x = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400u));
            mant &= 0x3ffu;
            x = sign | ((uint32_t)(127 - 15 - e) << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        x = sign | 0x7f800000u | (mant << 13);
    } else {
        x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* ------------------------------------------------------------------------- */
/* CPU features                                                               */
/* ------------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
static int cpu_avx2_fma_f16c(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!(fma && osxsave && avx && f16c)) return 0;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0)); /* OS saves YMM state? */
    if ((xlo & 6u) != 6u) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 5) & 1; /* AVX2 */
}

/* AVX-512 F/BW/VL/DQ with the OS saving the ZMM state (XCR0 bits 1, 2, 5, 6, 7); with
 * bf16 = 1 also AVX512_BF16 (cpuid 7.1 eax bit 5). Called only when AVX2 is there. */
static int cpu_avx512(int bf16) {
    unsigned a, b, c, d, xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 0xe6u) != 0xe6u || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31); /* F DQ BW VL */
    if ((b & need) != need) return 0;
    if (!bf16) return 1;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1;
}
#endif

/* TQKV_NO_AVX512=1 keeps the AVX2 kernels (A/B and tests); TQKV_NO_SIMD=1 drops both. */
static int avx512_level(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (!tqkv_cpu_has_avx2()) return 0;
    const char *env = getenv("TQKV_NO_AVX512");
    if (env && env[0] == '1') return 0;
    static _Thread_local int cached = -1; /* 0 none, 1 F/BW/VL/DQ, 2 and BF16 */
    if (cached < 0) cached = cpu_avx512(0) ? 1 + cpu_avx512(1) : 0;
    return cached;
#else
    return 0;
#endif
}
int tqkv_cpu_has_avx512(void) { return avx512_level() >= 1; }
int tqkv_cpu_has_avx512_bf16(void) { return avx512_level() >= 2; }

int tqkv_cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    const char *env = getenv("TQKV_NO_SIMD");
    if (env && env[0] == '1') return 0;
    /* cpuid traps to the hypervisor in a VM (~25 us a call): ask once per thread */
    static _Thread_local int cached = -1;
    if (cached < 0) cached = cpu_avx2_fma_f16c();
    return cached;
#else
    return 0;
#endif
}

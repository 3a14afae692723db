/*
 * matmul.c - batch-invariant y = x . w^T for the model (see matmul.h for the exact
 * reduction order every output element follows).
 * Owns: register-blocked AVX2/FMA micro-kernels over (MR rows x NR weight rows) tiles, their
 * scalar twin (fmaf, same order, bitwise equal), the N-split over OpenMP threads, the BLAS path.
 * Must not: let the tile shape, M, the thread split or the SIMD choice change any output bit:
 * each output element has its own 8-lane accumulator, so tiles only decide which elements are
 * computed together, never how one element is summed.
 */
#include "model/ops/matmul.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "model/ops/matmul_avx512.h"
#include "util/common.h"
#include "util/pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MM_X86 1
#endif

// ---------------------------------------------------------------------------
// element access
// ---------------------------------------------------------------------------

static inline float w_elem(const void *w, mm_type t, size_t i) {
    switch (t) {
    case MM_F32: return ((const float *)w)[i];
    case MM_F16: return tqkv_f16_to_f32(((const uint16_t *)w)[i]);
    default: return tqkv_bf16_to_f32(((const uint16_t *)w)[i]);
    }
}

/* Index of element (n, k) in w's storage. Packed bf16: [n/8][k/16][8][16]. */
static inline size_t w_index(const mm_weight *w, int n, int k) {
    if (!w->packed) return (size_t)n * (size_t)w->k + (size_t)k;
    return (((size_t)(n / 8) * (size_t)(w->k / 16) + (size_t)(k / 16)) * 8 + (size_t)(n % 8)) * 16 +
           (size_t)(k % 16);
}

float mm_weight_at(const mm_weight *w, int n, int k) {
    return w_elem(w->data, w->type, w_index(w, n, k));
}

void mm_weight_row(const mm_weight *w, int n, float *out) {
    if (w->type == MM_F32 && !w->packed) {
        memcpy(out, (const float *)w->data + (size_t)n * (size_t)w->k, (size_t)w->k * sizeof(float));
        return;
    }
    for (int k = 0; k < w->k; k++) out[k] = w_elem(w->data, w->type, w_index(w, n, k));
}

int mm_can_f32p(const mm_weight *w) {
    return w->type == MM_BF16 && w->k % 16 == 0 && w->k > 0;
}

void mm_make_f32p(const mm_weight *w, float *dst, int threads) {
    const uint16_t *src = w->data;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int n = 0; n < w->n; n++)
        for (int k = 0; k < w->k; k += 16) {
            const uint16_t *b = src + w_index(w, n, k); /* a 16-block is contiguous in both layouts */
            float *d = dst + (size_t)n * w->k + k;
            for (int j = 0; j < 8; j++) {
                d[j] = tqkv_bf16_to_f32(b[2 * j]);
                d[8 + j] = tqkv_bf16_to_f32(b[2 * j + 1]);
            }
        }
}

int mm_can_pack(const mm_weight *w) {
    return w->type == MM_BF16 && !w->packed && w->n % 8 == 0 && w->k % 16 == 0 && w->k > 0;
}

void mm_pack(const mm_weight *w, uint16_t *dst, int threads) {
    const uint16_t *src = w->data;
    mm_weight pw = *w;
    pw.packed = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int n = 0; n < w->n; n++)
        for (int k = 0; k < w->k; k += 16)
            memcpy(dst + w_index(&pw, n, k), src + (size_t)n * w->k + k, 16 * sizeof(uint16_t));
}

// ---------------------------------------------------------------------------
// scalar kernel: one output element, the canonical order
// ---------------------------------------------------------------------------

static float dot_scalar(const float *x, const mm_weight *w, int n) {
    const void *d = w->data;
    const mm_type t = w->type;
    const int K = w->k;
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int K8;
    if (t == MM_BF16) { /* lane j takes pair (2j, 2j+1) of each 16-block */
        K8 = K & ~15;
        for (int k = 0; k < K8; k += 16)
            for (int j = 0; j < 8; j++) {
                s[j] = fmaf(x[k + 2 * j], w_elem(d, t, w_index(w, n, k + 2 * j)), s[j]);
                s[j] = fmaf(x[k + 2 * j + 1], w_elem(d, t, w_index(w, n, k + 2 * j + 1)), s[j]);
            }
    } else {
        K8 = K & ~7;
        for (int k = 0; k < K8; k += 8)
            for (int j = 0; j < 8; j++) s[j] = fmaf(x[k + j], w_elem(d, t, w_index(w, n, k + j)), s[j]);
    }
    float a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
    float r = (a0 + a2) + (a1 + a3);
    for (int k = K8; k < K; k++) r = fmaf(x[k], w_elem(d, t, w_index(w, n, k)), r);
    return r;
}

/* Columns [n0, n1) of every row. */
static void range_scalar(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                         size_t ldy, int n0, int n1) {
    int K = w->k;
    for (int i = 0; i < m; i++)
        for (int n = n0; n < n1; n++) {
            float r = dot_scalar(x + (size_t)i * K, w, n);
            if (bias) r += bias[n];
            y[(size_t)i * ldy + n] = r;
        }
}

// ---------------------------------------------------------------------------
// AVX2 micro-kernels
// ---------------------------------------------------------------------------
#ifdef MM_X86
#define AINL __attribute__((always_inline)) inline
#define MM_BF16P 3 /* tile type code: bf16 in the packed layout */

static AINL TQKV_AVX2 __m256 ld8(const void *w, size_t i, const int t) {
    if (t == MM_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (t == MM_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static AINL TQKV_AVX2 float ld1(const void *w, size_t i, const int t) {
    if (t == MM_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    if (t == MM_F16) return _cvtsh_ss(h);
    return tqkv_bf16_to_f32(h);
}

/* ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) */
static AINL TQKV_AVX2 float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    __m128 u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    return _mm_cvtss_f32(u);
}

/* One tile: rows x[0..MR) (stride ldx), weight rows w[0..NR) (stride ldw elements),
 * y[i][j] at y + i*ldy + j. MR, NR, T are constants after inlining.
 * bf16: x must be pair-permuted (see permute_pairs); 16 k per step: the even elements of
 * 16 bf16 are (v << 16), the odd ones (v & 0xffff0000), each against its half of x.
 * Register use: NR <= MR keeps the weights in registers and streams x, else the reverse. */
static AINL TQKV_AVX2 void tile(const float *x, size_t ldx, const void *w, size_t ldw, float *y,
                          size_t ldy, int K, const float *bias, const int MR, const int NR,
                          const int T) {
    __m256 acc[4][8];
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    const size_t esz = T == MM_F32 ? 4 : 2;
    const int P = T == MM_BF16P; /* packed: row j's 16-block kb at j*16 + kb*128 */
    const int KB = T == MM_BF16 || P ? 16 : 8;
#define WOFF(j, k) (P ? (size_t)(j) * 16 + (size_t)((k) >> 4) * 128 : (size_t)(j) * ldw + (size_t)(k))
    const int Kb = K / KB * KB;
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < Kb; k += KB) {
        /* fetch the next tile's rows (NR rows on) one cache line per row ahead of use */
        if (!P && NR > MR && ((size_t)k * esz) % 64 == 0) {
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)w + ((size_t)(j + NR) * ldw + (size_t)k) * esz,
                             _MM_HINT_T0);
        }
        if (T == MM_BF16 || P) {
            if (NR <= MR) {
                __m256 we[8], wo[8];
#pragma GCC unroll 8
                for (int j = 0; j < NR; j++) {
                    __m256i v = _mm256_loadu_si256(
                        (const __m256i *)((const uint16_t *)w + WOFF(j, k)));
                    we[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    wo[j] = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
                }
#pragma GCC unroll 4
                for (int i = 0; i < MR; i++) {
                    __m256 xe = _mm256_loadu_ps(x + (size_t)i * ldx + k);
                    __m256 xo = _mm256_loadu_ps(x + (size_t)i * ldx + k + 8);
#pragma GCC unroll 8
                    for (int j = 0; j < NR; j++) {
                        acc[i][j] = _mm256_fmadd_ps(xe, we[j], acc[i][j]);
                        acc[i][j] = _mm256_fmadd_ps(xo, wo[j], acc[i][j]);
                    }
                }
            } else {
                __m256 xe[4], xo[4];
#pragma GCC unroll 4
                for (int i = 0; i < MR; i++) {
                    xe[i] = _mm256_loadu_ps(x + (size_t)i * ldx + k);
                    xo[i] = _mm256_loadu_ps(x + (size_t)i * ldx + k + 8);
                }
#pragma GCC unroll 8
                for (int j = 0; j < NR; j++) {
                    __m256i v = _mm256_loadu_si256(
                        (const __m256i *)((const uint16_t *)w + WOFF(j, k)));
                    __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
#pragma GCC unroll 4
                    for (int i = 0; i < MR; i++) {
                        acc[i][j] = _mm256_fmadd_ps(xe[i], we, acc[i][j]);
                        acc[i][j] = _mm256_fmadd_ps(xo[i], wo, acc[i][j]);
                    }
                }
            }
        } else if (NR <= MR) {
            __m256 wv[8];
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) wv[j] = ld8(w, (size_t)j * ldw + (size_t)k, T);
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                __m256 xv = _mm256_loadu_ps(x + (size_t)i * ldx + k);
#pragma GCC unroll 8
                for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        } else {
            __m256 xv[4];
#pragma GCC unroll 4
            for (int i = 0; i < MR; i++) xv[i] = _mm256_loadu_ps(x + (size_t)i * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) {
                __m256 wv = ld8(w, (size_t)j * ldw + (size_t)k, T);
#pragma GCC unroll 4
                for (int i = 0; i < MR; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) {
            float r = hsum8(acc[i][j]);
            for (int k = Kb; k < K; k++)
                r = fmaf(x[(size_t)i * ldx + k], ld1(w, WOFF(j, k - k % KB) + (size_t)(k % KB), P ? MM_BF16 : T), r);
            if (bias) r += bias[j];
            y[(size_t)i * ldy + j] = r;
        }
#undef WOFF
}

typedef void (*tile_fn)(const float *, size_t, const void *, size_t, float *, size_t, int,
                        const float *);

#define DEF_TILE(MR, NR, T, TN)                                                                   \
    static TQKV_AVX2 void tile_##MR##x##NR##_##TN(const float *x, size_t ldx, const void *w,     \
                                                  size_t ldw, float *y, size_t ldy, int K,       \
                                                  const float *bias) {                           \
        tile(x, ldx, w, ldw, y, ldy, K, bias, MR, NR, T);                                        \
    }
#define DEF_TILES(T, TN)                                                                          \
    DEF_TILE(4, 3, T, TN) DEF_TILE(3, 3, T, TN) DEF_TILE(2, 3, T, TN) DEF_TILE(1, 3, T, TN)       \
    DEF_TILE(3, 4, T, TN) DEF_TILE(2, 6, T, TN) DEF_TILE(1, 8, T, TN) DEF_TILE(4, 1, T, TN)       \
    DEF_TILE(3, 1, T, TN) DEF_TILE(2, 1, T, TN) DEF_TILE(1, 1, T, TN)
DEF_TILES(MM_F32, f32)
DEF_TILES(MM_F16, f16)
/* bf16 holds two weight vectors per step, so its tiles are narrower */
DEF_TILE(4, 2, MM_BF16, bf16) DEF_TILE(3, 2, MM_BF16, bf16) DEF_TILE(2, 2, MM_BF16, bf16)
DEF_TILE(1, 2, MM_BF16, bf16) DEF_TILE(2, 4, MM_BF16, bf16) DEF_TILE(1, 8, MM_BF16, bf16)
DEF_TILE(4, 1, MM_BF16, bf16) DEF_TILE(3, 1, MM_BF16, bf16) DEF_TILE(2, 1, MM_BF16, bf16)
DEF_TILE(1, 1, MM_BF16, bf16)
DEF_TILE(4, 2, MM_BF16P, bf16p) DEF_TILE(3, 2, MM_BF16P, bf16p) DEF_TILE(2, 2, MM_BF16P, bf16p)
DEF_TILE(1, 2, MM_BF16P, bf16p) DEF_TILE(2, 4, MM_BF16P, bf16p) DEF_TILE(1, 8, MM_BF16P, bf16p)
DEF_TILE(4, 1, MM_BF16P, bf16p) DEF_TILE(3, 1, MM_BF16P, bf16p) DEF_TILE(2, 1, MM_BF16P, bf16p)
DEF_TILE(1, 1, MM_BF16P, bf16p)

/* Tile function for (mr, nr) and type. */
static tile_fn pick(int mr, int nr, mm_type t, int packed) {
#define PICK(TN)                                                                                  \
    switch (mr * 16 + nr) {                                                                       \
    case 4 * 16 + 3: return tile_4x3_##TN;                                                        \
    case 3 * 16 + 3: return tile_3x3_##TN;                                                        \
    case 2 * 16 + 3: return tile_2x3_##TN;                                                        \
    case 1 * 16 + 3: return tile_1x3_##TN;                                                        \
    case 3 * 16 + 4: return tile_3x4_##TN;                                                        \
    case 2 * 16 + 6: return tile_2x6_##TN;                                                        \
    case 1 * 16 + 8: return tile_1x8_##TN;                                                        \
    case 4 * 16 + 1: return tile_4x1_##TN;                                                        \
    case 3 * 16 + 1: return tile_3x1_##TN;                                                        \
    case 2 * 16 + 1: return tile_2x1_##TN;                                                        \
    case 1 * 16 + 1: return tile_1x1_##TN;                                                        \
    default: return NULL;                                                                         \
    }
    if (t == MM_F32) { PICK(f32) }
    if (t == MM_F16) { PICK(f16) }
    if (packed) {
        switch (mr * 16 + nr) {
        case 4 * 16 + 2: return tile_4x2_bf16p;
        case 3 * 16 + 2: return tile_3x2_bf16p;
        case 2 * 16 + 2: return tile_2x2_bf16p;
        case 1 * 16 + 2: return tile_1x2_bf16p;
        case 2 * 16 + 4: return tile_2x4_bf16p;
        case 1 * 16 + 8: return tile_1x8_bf16p;
        case 4 * 16 + 1: return tile_4x1_bf16p;
        case 3 * 16 + 1: return tile_3x1_bf16p;
        case 2 * 16 + 1: return tile_2x1_bf16p;
        case 1 * 16 + 1: return tile_1x1_bf16p;
        default: return NULL;
        }
    }
    switch (mr * 16 + nr) {
    case 4 * 16 + 2: return tile_4x2_bf16;
    case 3 * 16 + 2: return tile_3x2_bf16;
    case 2 * 16 + 2: return tile_2x2_bf16;
    case 1 * 16 + 2: return tile_1x2_bf16;
    case 2 * 16 + 4: return tile_2x4_bf16;
    case 1 * 16 + 8: return tile_1x8_bf16;
    case 4 * 16 + 1: return tile_4x1_bf16;
    case 3 * 16 + 1: return tile_3x1_bf16;
    case 2 * 16 + 1: return tile_2x1_bf16;
    case 1 * 16 + 1: return tile_1x1_bf16;
    default: return NULL;
    }
#undef PICK
}

#define MM_MB 64 /* rows per M block (multiple of 4) */

/* Weight rows per tile for a product with m rows. */
static int tile_nr(int m, mm_type t) {
    int MR = m >= 4 ? 4 : m;
    if (t == MM_BF16) return MR >= 3 ? 2 : MR == 2 ? 4 : 8;
    return MR == 4 ? 3 : MR == 3 ? 4 : MR == 2 ? 6 : 8;
}

/* Columns [n0, n1) of every row with AVX2 tiles. */
static void range_avx2(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                       size_t ldy, int n0, int n1) {
    int K = w->k;
    size_t esz = w->type == MM_F32 ? 4 : 2;
    const uint8_t *wb = w->data;
    int MR = m >= 4 ? 4 : m, NR = tile_nr(m, w->type);
    int nfull = n0 + (n1 - n0) / NR * NR;
    for (int mb = 0; mb < m; mb += MM_MB) {
        int me = mb + MM_MB < m ? mb + MM_MB : m;
        for (int n = n0; n < n1;) {
            int nr = n < nfull ? NR : 1;
            for (int i = mb; i < me;) {
                int mr = me - i >= MR ? MR : me - i;
                tile_fn f = pick(mr, nr, w->type, w->packed);
                size_t wo = w->packed ? ((size_t)(n / 8) * (size_t)K * 8 + (size_t)(n % 8) * 16) * esz
                                      : (size_t)n * K * esz;
                f(x + (size_t)i * K, (size_t)K, wb + wo, (size_t)K, y + (size_t)i * ldy + n,
                  ldy, K, bias ? bias + n : NULL);
                i += mr;
            }
            n += nr;
        }
    }
}
/* Few rows on packed bf16 (batched decode): each 8-row group streams from memory once for
 * the first row, then stays in L1 for the others; every element is still a 1x8 tile
 * element, so the bits are those of any other tiling. */
static void range_avx2_rowwise(const float *x, int m, const mm_weight *w, const float *bias,
                               float *y, size_t ldy, int n0, int n1) {
    int K = w->k;
    const uint16_t *wb = w->data;
    for (int n = n0; n < n1; n += 8)
        for (int i = 0; i < m; i++)
            tile_1x8_bf16p(x + (size_t)i * K, (size_t)K, wb + (size_t)n * K, (size_t)K,
                           y + (size_t)i * ldy + n, ldy, K, bias ? bias + n : NULL);
}
#endif /* MM_X86 */

// ---------------------------------------------------------------------------
// drivers
// ---------------------------------------------------------------------------

/* One matmul as a pool loop: item i is columns [i * per, (i + 1) * per) of every row. */
typedef struct {
    mm_range_fn fn;
    const float *x;
    const mm_weight *w;
    const float *bias;
    float *y;
    size_t ldy;
    int m, per;
} split_job;

static void split_item(void *arg, size_t i, int slot) {
    (void)slot;
    const split_job *j = arg;
    int a = (int)i * j->per, b = a + j->per < j->w->n ? a + j->per : j->w->n;
    j->fn(j->x, j->m, j->w, j->bias, j->y, j->ldy, a, b);
}

/* Items of whole units (a unit is the tile width the range function needs), about eight
 * per thread so that a thread the machine takes away holds back little. */
void mm_run_split(mm_range_fn fn, const float *x, int m, const mm_weight *w, const float *bias,
                  float *y, size_t ldy, int threads, int unit) {
    int N = w->n;
    int tiles = (N + unit - 1) / unit;
    if (threads > tiles) threads = tiles;
    if (threads <= 1 || (size_t)m * (size_t)N * (size_t)w->k < 32768) {
        fn(x, m, w, bias, y, ldy, 0, N);
        return;
    }
    int items = threads * 8 < tiles ? threads * 8 : tiles;
    split_job j = {fn, x, w, bias, y, ldy, m, (tiles + items - 1) / items * unit};
    pool_for(threads, (size_t)((N + j.per - 1) / j.per), split_item, &j);
}

void mm_matmul_scalar(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                      int threads) {
    mm_run_split(range_scalar, x, m, w, bias, y, (size_t)w->n, threads, 8);
}

/* bf16 kernels read x with each 16-block split into its even then its odd elements:
 * xp[16b + j] = x[16b + 2j], xp[16b + 8 + j] = x[16b + 2j + 1]; the tail is copied. */
static void permute_pairs(const float *x, int m, int K, float *xp) {
    int K16 = K & ~15;
    for (int i = 0; i < m; i++) {
        const float *a = x + (size_t)i * K;
        float *b = xp + (size_t)i * K;
        for (int k = 0; k < K16; k += 16)
            for (int j = 0; j < 8; j++) {
                b[k + j] = a[k + 2 * j];
                b[k + 8 + j] = a[k + 2 * j + 1];
            }
        for (int k = K16; k < K; k++) b[k] = a[k];
    }
}

void mm_matmul(const float *x, int m, const mm_weight *w, const float *bias, float *y,
               int threads, float *scratch) {
    mm_matmul_ld(x, m, w, bias, y, (size_t)w->n, threads, scratch);
}

void mm_matmul_ld(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                  size_t ldy, int threads, float *scratch) {
    if (m <= 0 || w->n <= 0) return;
#ifdef MM_X86
    if (w->bf16_act && w->packed && tqkv_cpu_has_avx512_bf16() &&
        mm512_matmul_bf16(x, m, w, bias, y, ldy, threads, scratch))
        return;
    if (tqkv_cpu_has_avx2()) {
        float *xp = NULL;
        if (w->type == MM_BF16) {
            xp = scratch ? scratch : malloc(sizeof(float) * (size_t)m * (size_t)w->k);
            if (!xp) { /* no memory for the permuted copy: same bits, slower */
                mm_run_split(range_scalar, x, m, w, bias, y, ldy, threads, 8);
                return;
            }
            permute_pairs(x, m, w->k, xp);
        }
        /* packed bf16 on AVX-512: twice the AVX2 width, faster than the f32p tiles too */
        const int use512 = w->packed && tqkv_cpu_has_avx512();
        mm_weight wf;
        if (xp && w->f32p && m >= MM_F32P_MIN_ROWS && !use512) { /* same order, f32 tiles */
            wf = *w;
            wf.data = w->f32p;
            wf.type = MM_F32;
            wf.packed = 0;
            w = &wf;
        }
        if (use512) { /* same bits */
            mm_run_split(mm512_range_exact, xp, m, w, bias, y, ldy, threads, 8);
        } else if (w->packed && m > 1 && m < MM_F32P_MIN_ROWS) {
            mm_run_split(range_avx2_rowwise, xp, m, w, bias, y, ldy, threads, 8);
        } else {
            int NR = tile_nr(m, w->type);
            int unit = NR * (NR <= 3 ? 4 : 1);
            mm_run_split(range_avx2, xp ? xp : x, m, w, bias, y, ldy, threads, unit);
        }
        if (xp != scratch) free(xp);
        return;
    }
#endif
    mm_run_split(range_scalar, x, m, w, bias, y, ldy, threads, 8);
}

void mm_matmul_blas(const float *x, int m, const mm_weight *w, const float *bias, float *y,
                    size_t ldy, int threads) {
    if (m <= 0 || w->n <= 0) return;
    if (!w->f32) {
        mm_matmul_ld(x, m, w, bias, y, ldy, threads, NULL);
        return;
    }
    openblas_set_num_threads(threads);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, w->n, w->k, 1.0f, x, w->k, w->f32,
                w->k, 0.0f, y, (int)ldy);
    if (bias)
        for (int i = 0; i < m; i++)
            for (int n = 0; n < w->n; n++) y[(size_t)i * ldy + n] += bias[n];
}

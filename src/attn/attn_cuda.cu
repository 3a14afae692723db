/*
 * attn_cuda.cu - decode attention (one query per row) over the device cache, sm_90.
 * Owns: the query preparation (rotation into K's domain, softmax scale and log2(e) folded,
 * fp16/bf16), the split-KV flash-decoding kernel over compressed rows (tq4, tq3, q8 recent
 * window) and over the dense bf16 baseline, and the merge of split partials (log-sum-exp)
 * with the single un-rotation of each output.
 * Must not: mutate the cache, or let a row's result depend on other rows: a row's split
 * size depends only on its own token count, every reduction runs in a fixed order.
 *
 * Kernel shape (persistent: one CTA per SM of NG groups of 4 warps; a group takes work
 * items = (row, kv head, split) in turn; within an item each warp takes every 4th tile of
 * TT tokens of the split, TT = 32 for tq, 16 for bf16; tiles are 16-token subtiles; tq
 * tiles reach shared memory by bulk copies (TMA), ST per warp in flight, across items):
 *   S^T [16 tokens, 8 heads] = K [16, 128] . Q^T [128, 8]    mma.m16n8k16 (fp16/bf16)
 *   O^T [128, 8 heads]     += V^T [128, 16] . P^T [16, 8]    mma.m16n8k16
 * The G <= 8 query heads of the GQA group are the N = 8 columns (unused ones are zero).
 * K fragments are decoded straight from the payload bytes a thread loads (16 bytes per
 * token row for tq4): the head-dim order inside the dot product is permuted per format so
 * that every register pair comes from one byte (kdim()), and Q is loaded in the same
 * order; V^T fragments pair two tokens per register (vdim() is the output order).
 * Dequantization: a lookup byte holding two 4-bit (tq4) or 3-bit (tq3) indices is looked
 * up in a per-lane fp16-pair table in shared memory (Tab, tlook(); tq3 has two tables).
 * The per-token fp16 K scale multiplies the score; the V scale enters the softmax exponent
 * (RESCALE_SLACK). A q8 window token's values are decoded relative to its largest block
 * scale, and that factor (q8_tok_factor) takes the scale's place.
 * Online softmax in base 2 per warp over scores plus log2 of the V factor, with a lazy
 * rescale (RESCALE_SLACK), merged across a
 * group's warps in registers (two rounds through exchange slots in shared memory), and
 * across splits by the merge kernel in split order.
 * Staging runs on warp-uniform values (uni()): one elected lane issues a tile's bulk copies
 * from uniform registers.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"

/* Compile-time variants for A/B runs on the device (-DCMAKE_CUDA_FLAGS=-DTQKV_...=N); the
 * defaults are the kernel as measured last. */
#ifndef TQKV_TQ3_CD
#define TQKV_TQ3_CD 1         /* tq3 tables C / D: K's lookup words without the nibble interleave */
#endif
#ifndef TQKV_COPY_TOK32
#define TQKV_COPY_TOK32 1     /* bulk copies addressed from a 32-bit token index (stage_issue) */
#endif

namespace {

enum { F_TQ4 = 0, F_TQ3 = 1, F_BF16 = 2 };
constexpr int D = CUDA_DIM;
constexpr float LOG2E = 1.4426950408889634f;
/* Online softmax. A token's V values are its factor f (tq: the fp16 V scale; q8 window:
 * q8_tok_factor; bf16: 1) times its fragment values, and its weight in the output is
 * 2^s f / sum 2^s. The softmax runs on s' = s + log2 f: the fp16 P fragments hold
 * 2^(s' - m) (m: the running max of s'), the sum l adds 2^(s' - m) / f = 2^(s - m) in fp32.
 * So the fragments' range does not depend on the V scales: at V norms near 0.01 the weights
 * of p * V scale in fp16 were subnormal below p ~ 0.1, and the many small ones added up to a
 * 4e-3 error (test_cuda, every head dominated); near 17000 they could overflow. f is taken
 * as at least VSCALE_MIN, so that an all-zero token (f = 0) still counts in l (its values are
 * 0 up to 2^-64 of the others'); a NaN or infinite f makes the output NaN (as the CPU's
 * is NaN or infinite).
 * The rescale is lazy: a warp rescales only when some s' exceeds its running max by more
 * than RESCALE_SLACK (log2 units), so the fragments reach 2^RESCALE_SLACK = 16 (fp16 holds
 * that at full precision). */
constexpr float RESCALE_SLACK = 4.0f;
constexpr float VSCALE_MIN = 0x1p-64f;
/* The running max starts finite, below any score s' (log2 units): the first tile with a
 * finite or +inf score rescales (its al = 2^(M_START - m) is 0), a tile of -inf scores gives
 * weights 2^(-inf - M_START) = 0 against it, and no select maps a -inf max to 0 per tile. A
 * split that saw only -inf scores reports M_START with a sum of 0, which the merges weigh by
 * 2^(M_START - M) = 0 (or by 1 next to another such split, adding zeros). */
constexpr float M_START = -0x1p126f;

// ---------------------------------------------------------------------------
// Splits (batch invariance: a function of the row's own token count only)
// ---------------------------------------------------------------------------
__host__ __device__ inline int split_len(int ntok) {
    int s = (ntok + 31) / 32;                 /* aim at <= 32 splits per (row, head) */
    s = (s + 255) / 256 * 256;                /* multiple of 256 tokens */
    return s < 256 ? 256 : s;
}
__host__ __device__ inline int split_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + split_len(ntok) - 1) / split_len(ntok);
}

// ---------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

template <int F>
__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (F == F_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int F> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (F == F_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
}


// ---------------------------------------------------------------------------
// Formats: payload bytes per token (compile-time, so tile loads use immediate offsets)
// ---------------------------------------------------------------------------
template <int F> struct Fmt;
template <> struct Fmt<F_TQ4> { static constexpr int PAY = D / 2; };
template <> struct Fmt<F_TQ3> { static constexpr int PAY = 3 * D / 8; };  /* 2-bit plane, 1-bit plane */
template <> struct Fmt<F_BF16> { static constexpr int PAY = 2 * D; };

__device__ __forceinline__ float ex2(float x) { /* 2^x; -inf -> 0 (denormal results flush to 0) */
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lg2(float x) { /* log2 x of a normal x (NaN -> NaN) */
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------
// Index orders (head-dim permutations; see the file comment)
// ---------------------------------------------------------------------------
/* K: thread column c, register pair p (0..15: k-step p/2, half p&1), element e (0/1).
 * tq3: p / 4 picks one of the four lookup words w of tq3_kwords(), p % 4 its byte j. Tables
 * 0 / 1: dims 8 w + j and 8 w + 4 + j of the lane's 32-dim group; tables C / D (TQKV_TQ3_CD):
 * dims d + j and d + 8 + j, d = 0, 16, 4, 20 for w = 0..3. */
template <int F> __host__ __device__ constexpr int kdim(int c, int p, int e) {
    if constexpr (F == F_TQ4) return 32 * c + p + 16 * e;
#if TQKV_TQ3_CD
    else if constexpr (F == F_TQ3) return 32 * c + 16 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3) + 8 * e;
#else
    else if constexpr (F == F_TQ3) return 32 * c + 8 * (p >> 2) + (p & 3) + 4 * e;
#endif
    else return 32 * c + 2 * p + e;
}
/* V: thread row g, m-tile i (0..7), e = 0 for fragment row g, 1 for row g + 8. */
template <int F> __host__ __device__ constexpr int vdim(int g, int i, int e) {
    if constexpr (F == F_TQ4) return 32 * (g >> 1) + 8 * (g & 1) + i + 16 * e;
    else if constexpr (F == F_TQ3) return 32 * (g >> 1) + 8 * (2 * e + (i >> 2)) + 4 * (g & 1) + (i & 3);
    else return 16 * g + 2 * i + e;
}
/* Both orders are permutations of the D dims (qprep writes Q in kdim order, the merge reads
 * the output in vdim order). */
template <int F> constexpr bool dim_orders_ok() {
    bool k[D] = {}, v[D] = {};
    for (int j = 0; j < D; j++) { /* j: (c, p, e) of kdim, (g, i, e) of vdim */
        const int dk = kdim<F>(j >> 5, (j >> 1) & 15, j & 1), dv = vdim<F>(j >> 4, (j >> 1) & 7, j & 1);
        if (dk < 0 || dk >= D || k[dk] || dv < 0 || dv >= D || v[dv]) return false;
        k[dk] = v[dv] = true;
    }
    return true;
}
static_assert(dim_orders_ok<F_TQ4>() && dim_orders_ok<F_TQ3>() && dim_orders_ok<F_BF16>(),
              "kdim and vdim are permutations of the head dims");

// ---------------------------------------------------------------------------
// Codebook lookup table in shared memory, one column per lane (conflict free)
// ---------------------------------------------------------------------------
/* Entry e (a lookup byte holding two indices) of lane l is an fp16 pair at shared byte
 * offset 256 e + 4 l: bank = l, conflict free. The table is the first thing in the
 * kernel's shared memory (no static __shared__), which starts at shared address TAB_BASE
 * (1 KiB reserved by the driver on sm_90, checked once by attn_cuda_setup) in the CTA's
 * window; the window's upper 16 bits (the CTA rank) ride in L. One byte permute builds the
 * address minus TAB_BASE from the word holding the byte and L = 4 l | window: byte 0 = 4 l,
 * byte 1 = byte k of the word, bytes 2, 3 = the window; the load is LDS [R + TAB_BASE],
 * one instruction, no address add. The table fills bytes [0, 128) of every 256-byte row.
 * tq4: the holes [128, 256) hold the merge's exchange slots (slot_off() in the kernel);
 * tq3: a second table (L + 128), so that lookup bytes can take the index bits where the
 * planes put them (tq3_words):
 *   tq4:          e = (i0 | i1 << 4)                            -> (c[i0], c[i1])
 *   tq3 table 0:  e = (lo0 | hi0 << 2 | x | lo1 << 4 | hi1 << 6 | y) -> (c[lo0 + 4 hi0], c[lo1 + 4 hi1])
 *   tq3 table 1:  e = (x | hi0 << 1 | lo0 << 2 | y | hi1 << 5 | lo1 << 6)
 *   (x, y: ignored bits: 3 and 7 in table 0, 0 and 4 in table 1)
 *   tq3 with TQKV_TQ3_CD, tables C (0) and D (1), two 2-bit fields next to each other:
 *   table C:      e = (lo0 | lo1 << 2 | hi0 << 4 | hi1 << 5 | xx << 6)
 *   table D:      e = (xx | hi0 << 2 | hi1 << 3 | lo0 << 4 | lo1 << 6)
 * The shared address is the CTA's table base (a uniform register) plus the offset, so the
 * load is one LDS [R + UR]. */
constexpr uint32_t TAB_BASE = 1024;
struct Tab {
    uint32_t L;               /* 4 * lane | (window & 0xFFFF0000) */
};
/* entry byte k of w, in table t (tq3: 0 or 1) */
__device__ __forceinline__ uint32_t tlook(const Tab &T, uint32_t w, int k, int t = 0) {
    const uint32_t a = prmt(w, T.L | (uint32_t)(128 * t), 0x7604u | (uint32_t)k << 4);
    uint32_t v;
    /* not volatile, no memory clobber, so the compiler may schedule it freely: its address
     * comes from payload words loaded after the barrier that ends the table build */
    asm("ld.shared.b32 %0, [%1+1024];" : "=r"(v) : "r"(a));
    static_assert(TAB_BASE == 1024, "the immediate above");
    return v;
}
template <int F> __device__ __forceinline__ uint32_t tab_entry(const float *cent, int e, int t) {
    float a, b;
    if constexpr (F == F_TQ4) {
        a = cent[e & 15];
        b = cent[e >> 4];
    } else if (TQKV_TQ3_CD && t == 0) {    /* C */
        a = cent[(e & 3) | ((e >> 2) & 4)];
        b = cent[((e >> 2) & 3) | ((e >> 3) & 4)];
    } else if (TQKV_TQ3_CD) {               /* D */
        a = cent[((e >> 4) & 3) | (e & 4)];
        b = cent[((e >> 6) & 3) | ((e >> 1) & 4)];
    } else if (t == 0) {
        a = cent[e & 7];
        b = cent[(e >> 4) & 7];
    } else {
        a = cent[((e >> 2) & 3) | ((e << 1) & 4)];
        b = cent[((e >> 6) & 3) | ((e >> 3) & 4)];
    }
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}

// ---------------------------------------------------------------------------
// tq3 lookup words (test_cuda checks the attention over them against the CPU kernels)
// ---------------------------------------------------------------------------
/* One LOP3 with truth table L over (a, b, c) = (0xF0, 0xCC, 0xAA). Written out because the
 * compiler, seeing known-zero bits of a shifted operand, otherwise splits a select or a
 * masked xor into two. */
template <uint32_t L> __device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(L));
    return r;
}
/* bits of a where m is set, of b elsewhere */
__device__ __forceinline__ uint32_t bsel(uint32_t a, uint32_t b, uint32_t m) { return lop3<0xE2>(a, m, b); }

/* A group's 1-bit plane word H (bit 8k + j = high bit of dim 8k + j) transposed in 4x4
 * blocks: byte j, bit k = high bit of dim 8k + j; byte j, bit 4 + k = of dim 8k + 4 + j.
 * Two delta swaps, each t = (x ^ x >> s) & m; x ^= t ^ t << s. */
__device__ __forceinline__ uint32_t tq3_hi_t(uint32_t x) {
    uint32_t t = lop3<0x28>(x, x >> 14, 0x0000CCCCu);
    x = lop3<0x96>(x, t, t << 14);
    t = lop3<0x28>(x, x >> 7, 0x00AA00AAu);
    return lop3<0x96>(x, t, t << 7);
}

/* Both K and V build lookup words the same way. Inputs: two 2-bit plane words W0, W1 whose
 * byte j holds fields f = 0..3 (bits 2f, 2f+1), and a transposed high-bit word X whose byte j
 * holds at bit f the high bit of W0's field f and at bit 4 + f that of W1's field f. Word f
 * of the result has in byte j the indices of W0's and W1's field f, for table f & 1 (Tab):
 * two interleaves, two shifts of X and four selects (the select takes the high bits from X:
 * bits 2 and 6 for table 0, 1 and 5 for table 1). (Tables 0 / 1 only.) */
#if !TQKV_TQ3_CD
__device__ __forceinline__ void tq3_words(uint32_t W0, uint32_t W1, uint32_t X, uint32_t y[4]) {
    const uint32_t Z01 = bsel(W0, W1 << 4, 0x0F0F0F0Fu);       /* byte j: W0 f0 f1 | W1 f0 f1 */
    const uint32_t Z23 = bsel(W0 >> 4, W1, 0x0F0F0F0Fu);       /* byte j: W0 f2 f3 | W1 f2 f3 */
    y[0] = bsel(X << 2, Z01, 0x44444444u);
    y[1] = bsel(X, Z01, 0x22222222u);
    y[2] = bsel(X, Z23, 0x44444444u);
    y[3] = bsel(X >> 2, Z23, 0x22222222u);
}
#endif
/* K: the group's 2-bit plane words W0 (bytes 0..3: byte j, field k = low bits of dim 8k + j)
 * and W1 (bytes 4..7: dims 8k + 4 + j), and its 1-bit plane word H. tq3_hi_t(H) is the X
 * that tq3_words wants, so byte j of word w holds dims (8w + j, 8w + 4 + j) (kdim). */
__device__ __forceinline__ void tq3_kwords(uint32_t W0, uint32_t W1, uint32_t H, uint32_t y[4]) {
#if TQKV_TQ3_CD
    /* tables C / D take two neighbouring 2-bit fields where the plane has them, so the words
     * need no interleave: X = tq3_hi_t(H) has in byte j, bit k + 4 h, the high bit of the
     * field k of W_h's byte j, and each word is one select (C: fields 0, 1, high bits at 4, 5;
     * D: fields 2, 3, high bits at 2, 3) */
    const uint32_t X = tq3_hi_t(H);
    y[0] = bsel(X << 4, W0, 0x30303030u);                      /* dims j, 8 + j */
    y[1] = bsel(X, W0, 0x0C0C0C0Cu);                           /* dims 16 + j, 24 + j */
    y[2] = bsel(X, W1, 0x30303030u);                           /* dims 4 + j, 12 + j */
    y[3] = bsel(X >> 4, W1, 0x0C0C0C0Cu);                      /* dims 20 + j, 28 + j */
#else
    tq3_words(W0, W1, tq3_hi_t(H), y);
#endif
}
/* V: two tokens' 2-bit plane words (this lane's half h of the group: byte j, field k = dims
 * 8k + 4h + j) and their 1-bit plane words H0, H1. The half's nibbles of H0 and H1 merged
 * (byte k: token 0 | token 1) and transposed are the X of tq3_words, so byte j of word k
 * holds dim 8k + 4h + j of token 0 (low nibble) and of token 1 (high nibble). */
__device__ __forceinline__ void tq3_vwords(uint32_t W0, uint32_t W1, uint32_t H0, uint32_t H1, uint32_t sh,
                                           uint32_t y[4]) {
#if TQKV_TQ3_CD
    /* Tables C / D want a token pair's high bits next to each other. The half's nibbles go
     * to m with byte 2 k1 + t, nibble k0 (field k = k0 + 2 k1, token t): two byte permutes and
     * the nibble merge. Transposed, byte j of X holds at bit t + 2 k1 + 4 k0 the high bit of
     * token t's field k: fields 0 / 2 / 1 / 3 at bits 0-1 / 2-3 / 4-5 / 6-7. V0 (V1) has
     * fields 0 and 2 (1 and 3) of token 0 / 1 at bits 0-1 / 2-3 and 4-5 / 6-7; each word is
     * one select, C for fields 0, 1 and D for fields 2, 3. y[k] is field k's word. */
    const uint32_t P0 = prmt(H0, H1, 0x6240u), P1 = prmt(H0, H1, 0x7351u);
    const uint32_t X = tq3_hi_t(bsel(P0 >> sh, P1 * (16u >> sh), 0x0F0F0F0Fu));
    const uint32_t V0 = bsel(W0, W1 << 2, 0x33333333u), V1 = bsel(W0 >> 2, W1, 0x33333333u);
    y[0] = bsel(X << 4, V0, 0x30303030u);
    y[1] = bsel(X, V1, 0x30303030u);
    y[2] = bsel(X, V0, 0x0C0C0C0Cu);
    y[3] = bsel(X >> 4, V1, 0x0C0C0C0Cu);
#else
    tq3_words(W0, W1, tq3_hi_t(bsel(H0 >> sh, H1 << (4 - sh), 0x0F0F0F0Fu)), y);
#endif
}

// ---------------------------------------------------------------------------
// Raw tile (registers) and its loads
// ---------------------------------------------------------------------------
template <int F, int S> struct Raw;   /* S: 16-token subtiles per tile */
template <int S> struct Raw<F_TQ4, S> {
    static constexpr int SUB = S;
    uint4 k[SUB][2];          /* [subtile][row A/B]: bytes 16c.. of the token */
    uint2 v[SUB][4];          /* [subtile][token 4c + j]: bytes 8g.. */
    uint32_t ksc, vsc;        /* fp16 scales of token t0 + lane */
};
template <int S> struct Raw<F_TQ3, S> {
    static constexpr int SUB = S;
    uint2 kl[SUB][2];         /* 2-bit plane bytes 8c..8c+7 */
    uint32_t kh[SUB][2];      /* 1-bit plane word of group c */
    uint32_t vl[SUB][4];      /* 2-bit plane bytes 4g..4g+3 */
    uint32_t vh[SUB][4];      /* 1-bit plane word of group g/2 */
    uint32_t ksc, vsc;
};
template <int S> struct Raw<F_BF16, S> {
    static constexpr int SUB = S;
    uint4 k[SUB][2][4];       /* dims 32c..32c+31 */
    uint4 v[SUB][4][2];       /* dims 16g..16g+15 */
    uint32_t ksc, vsc;
};

struct Ctx {
    const uint8_t *kb, *vb;   /* token 0 of (row, head) in the main planes */
    const uint16_t *ksb, *vsb;
};
struct Ring {                 /* the q8 recent window (slow tiles only) */
    const int8_t *kw, *vw;    /* slot 0 of (row, head) in the rings */
    const uint16_t *kws, *vws;
    int ring;
};

/* Token orders inside a 16-token subtile (every formula is a lane part plus a per-load part,
 * so that a load is [lane offset + immediate]):
 *   tq4, bf16: each load instruction of a warp reads one contiguous run of tokens (whole
 *     128-byte lines when loading from global memory):
 *     K / S: fragment row g holds token g, row g + 8 token g + 8 (a K load: 8 tokens);
 *     V / P: thread column c's four k slots (2c, 2c+1, 2c+8, 2c+9) = j 0..3 hold tokens
 *     4j + c (a V load: tokens 4j .. 4j+3).
 *   tq3: the same for even and odd tokens apart, so that the staged tile's 48-byte token rows
 *     are read without bank conflicts (with the tq4 order, the rows of tokens 0 and 3 share
 *     banks): K / S row g holds token 2 (g & 3) + (g >> 2) (+ 8 for row g + 8), V / P slot j
 *     of column c token 8 (j >> 1) + 2c + (j & 1).
 * In both, S row g's token for g = c and g = c + 4 are P's slots (2c, 2c+1) (+ 8 for rows
 * g + 8: slots 2c+8, 2c+9), so one transposition (the shuffles in process) serves both. */
template <int F> __host__ __device__ constexpr int krow_tok(int g, int row) {
    if constexpr (F == F_TQ3) return 2 * (g & 3) + (g >> 2) + 8 * row;
    else return g + 8 * row;
}
template <int F> __host__ __device__ constexpr int vcol_tok(int c, int j) {
    if constexpr (F == F_TQ3) return 8 * (j >> 1) + 2 * c + (j & 1);
    else return 4 * j + c;
}
template <int F> constexpr bool orders_match() {
    for (int c = 0; c < 4; c++)
        for (int row = 0; row < 2; row++)
            if (krow_tok<F>(c, row) != vcol_tok<F>(c, 2 * row) || krow_tok<F>(c + 4, row) != vcol_tok<F>(c, 2 * row + 1))
                return false;
    return true;
}
static_assert(orders_match<F_TQ4>() && orders_match<F_TQ3>() && orders_match<F_BF16>(),
              "S rows c, c + 4 are P's k slots of column c (the transposition in process)");

/* Per-lane byte offsets inside a tile (tokens from the tile's first), so that every load
 * of a tile is [base + lane offset + immediate]. */
struct LaneOff {
    int k, kh, v, vh;
};
template <int F> __device__ __forceinline__ LaneOff lane_off(int g, int c) {
    constexpr int PAY = Fmt<F>::PAY;
    LaneOff o;
    o.k = krow_tok<F>(g, 0) * PAY;
    o.v = vcol_tok<F>(c, 0) * PAY;
    if constexpr (F == F_TQ4) { o.kh = o.k; o.k += 16 * c; o.vh = o.v; o.v += 8 * g; }
    else if constexpr (F == F_TQ3) { o.kh = o.k + 32 + 4 * c; o.k += 8 * c; o.vh = o.v + 32 + 4 * (g >> 1); o.v += 4 * g; }
    else { o.kh = o.k; o.k += 64 * c; o.vh = o.v; o.v += 32 * g; }
    return o;
}

template <int F, int S, bool SLOW>
__device__ __forceinline__ void load_tile(Raw<F, S> &R, const Ctx &x, size_t col, const LaneOff &o, int t0, int lim,
                                          int g, int c, int lane) {
    constexpr int SUB = S, PAY = Fmt<F>::PAY;
    const size_t tt = col + (size_t)t0;     /* the tile's first token in the planes */
    const uint8_t *kt = x.kb + tt * PAY, *vt = x.vb + tt * PAY;
#pragma unroll
    for (int u = 0; u < SUB; u++) {
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const bool ok = !SLOW || t0 + 16 * u + krow_tok<F>(g, row) < lim;
            const int tk = (16 * u + krow_tok<F>(0, row)) * PAY;    /* immediate */
            if constexpr (F == F_TQ4) {
                R.k[u][row] = ok ? __ldg(reinterpret_cast<const uint4 *>(kt + o.k + tk)) : make_uint4(0, 0, 0, 0);
            } else if constexpr (F == F_TQ3) {
                R.kl[u][row] = ok ? __ldg(reinterpret_cast<const uint2 *>(kt + o.k + tk)) : make_uint2(0, 0);
                R.kh[u][row] = ok ? __ldg(reinterpret_cast<const uint32_t *>(kt + o.kh + tk)) : 0u;
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    R.k[u][row][q] = ok ? __ldg(reinterpret_cast<const uint4 *>(kt + o.k + tk) + q) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool ok = !SLOW || t0 + 16 * u + vcol_tok<F>(c, j) < lim;
            const int tv = (16 * u + vcol_tok<F>(0, j)) * PAY;
            if constexpr (F == F_TQ4) {
                R.v[u][j] = ok ? __ldg(reinterpret_cast<const uint2 *>(vt + o.v + tv)) : make_uint2(0, 0);
            } else if constexpr (F == F_TQ3) {
                R.vl[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(vt + o.v + tv)) : 0u;
                R.vh[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(vt + o.vh + tv)) : 0u;
            } else {
#pragma unroll
                for (int q = 0; q < 2; q++)
                    R.v[u][j][q] = ok ? __ldg(reinterpret_cast<const uint4 *>(vt + o.v + tv) + q) : make_uint4(0, 0, 0, 0);
            }
        }
    }
    if constexpr (F != F_BF16) {
        const int t = t0 + lane;
        const bool ok = lane < 16 * SUB && (!SLOW || t < lim);
        R.ksc = ok ? __ldg(x.ksb + tt + lane) : 0u;
        R.vsc = ok ? __ldg(x.vsb + tt + lane) : 0u;
    }
}

// ---------------------------------------------------------------------------
// Warp-uniform values: equal in every lane, and known so to the compiler (a REDUX result
// lives in a uniform register), so that arithmetic on them runs once per warp on the uniform
// datapath and bulk copies take them without a per-lane loop
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t uni(uint32_t v) { return __reduce_or_sync(0xffffffffu, v); }
__device__ __forceinline__ int uni(int v) { return (int)uni((uint32_t)v); }
__device__ __forceinline__ uint64_t uni(uint64_t v) {
    return (uint64_t)uni((uint32_t)v) | (uint64_t)uni((uint32_t)(v >> 32)) << 32;
}
/* true in one lane of the (fully active) warp */
__device__ __forceinline__ bool elect_one() {
    uint32_t p;
    asm volatile("{\n .reg .pred e;\n elect.sync _|e, 0xffffffff;\n selp.u32 %0, 1, 0, e;\n}" : "=r"(p));
    return p != 0;
}

// ---------------------------------------------------------------------------
// Tile staging through shared memory (tq formats): bulk copies (TMA), one mbarrier per stage
// ---------------------------------------------------------------------------
/* One warp's stage holds one fast tile of TT = 32 tokens as the planes store it: K payload,
 * V payload, then the tile's K and V scales, each copied from the 16-byte boundary at or
 * below them (the scales of token tt start (tt & 7) tokens into their 80 bytes). Loads in
 * flight then cost no registers and L2 sees each line once (the L2 prefetch this replaced
 * made it look lines up twice). */
template <int F> struct Stg {
    static constexpr int TT = 32, PAY = Fmt<F>::PAY;
    static constexpr int V_OFF = TT * PAY;
    static constexpr int SC = 80;             /* a tile's scales from their 16-byte floor */
    static constexpr int KS_OFF = 2 * TT * PAY;
    static constexpr int VS_OFF = KS_OFF + SC;
    static constexpr int BYTES = VS_OFF + SC;
    static_assert(SC % 16 == 0 && SC >= 2 * TT + 14, "the tile's scales from any 2-byte offset");
    static_assert(PAY % 16 == 0 && BYTES % 16 == 0, "bulk copies move 16-byte multiples");
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
/* global -> shared, completing `bytes` on the mbarrier; evict-first in L2 (read once) */
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar,
                                         uint64_t pol) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                 "[%0], [%1], %2, [%3], %4;"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}

/* The whole warp (warp-uniform arguments, so the copies' operands sit in uniform registers
 * and one elected thread issues them without a per-lane loop): ask for fast tile t (tokens
 * from the (row, head)'s token 0 at col) into the stage at shared address dst. The warp has
 * finished with the stage (its values are consumed; __syncwarp orders the reads). The scales
 * are copied as 80 bytes from the 16-byte floor at or below them (the allocations have 16
 * bytes of slack for the last tile), so every stage expects the same byte count. */
#if TQKV_COPY_TOK32
/* tt: the tile's first token in the planes, below 2^32 (attend checks it), so that each
 * source address is one 32 x 32 + 64-bit multiply-add on the uniform datapath. */
template <int F>
__device__ __forceinline__ void stage_issue(const Ctx &x, uint32_t tt, uint32_t dst, uint32_t bar, uint64_t pol) {
    using G = Stg<F>;
#else
template <int F>
__device__ __forceinline__ void stage_issue(const Ctx &x, size_t col, int t, uint32_t dst, uint32_t bar,
                                            uint64_t pol) {
    using G = Stg<F>;
    const size_t tt = col + (size_t)t;
#endif
    const uintptr_t ks0 = reinterpret_cast<uintptr_t>(x.ksb + tt) & ~(uintptr_t)15;
    const uintptr_t vs0 = reinterpret_cast<uintptr_t>(x.vsb + tt) & ~(uintptr_t)15;
    if (elect_one()) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* after the warp's reads of the stage */
        mbar_expect(bar, G::BYTES);
        bulk_g2s(dst, x.kb + (size_t)tt * G::PAY, G::TT * G::PAY, bar, pol);
        bulk_g2s(dst + G::V_OFF, x.vb + (size_t)tt * G::PAY, G::TT * G::PAY, bar, pol);
        bulk_g2s(dst + G::KS_OFF, reinterpret_cast<const void *>(ks0), G::SC, bar, pol);
        bulk_g2s(dst + G::VS_OFF, reinterpret_cast<const void *>(vs0), G::SC, bar, pol);
    }
}

/* A staged tile into registers: the same lane offsets and immediates as load_tile. */
template <int F, int S>
__device__ __forceinline__ void load_stage(Raw<F, S> &R, const char *st, const LaneOff &o, int misk, int misv,
                                           int lane) {
    using G = Stg<F>;
    constexpr int PAY = Fmt<F>::PAY;
    static_assert(16 * S == G::TT, "a stage is one tile");
#pragma unroll
    for (int u = 0; u < S; u++) {
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const int tk = (16 * u + krow_tok<F>(0, row)) * PAY;
            if constexpr (F == F_TQ4) {
                R.k[u][row] = *reinterpret_cast<const uint4 *>(st + o.k + tk);
            } else {
                R.kl[u][row] = *reinterpret_cast<const uint2 *>(st + o.k + tk);
                R.kh[u][row] = *reinterpret_cast<const uint32_t *>(st + o.kh + tk);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int tv = G::V_OFF + (16 * u + vcol_tok<F>(0, j)) * PAY;
            if constexpr (F == F_TQ4) {
                R.v[u][j] = *reinterpret_cast<const uint2 *>(st + o.v + tv);
            } else {
                R.vl[u][j] = *reinterpret_cast<const uint32_t *>(st + o.v + tv);
                R.vh[u][j] = *reinterpret_cast<const uint32_t *>(st + o.vh + tv);
            }
        }
    }
    const bool ok = lane < G::TT;
    R.ksc = ok ? reinterpret_cast<const uint16_t *>(st + G::KS_OFF)[misk + lane] : 0u;
    R.vsc = ok ? reinterpret_cast<const uint16_t *>(st + G::VS_OFF)[misv + lane] : 0u;
}

/* K pairs of one row of subtile u. */
template <int F, int S> __device__ __forceinline__ void deq_k(const Raw<F, S> &R, const Tab &T, int u, int row, uint32_t pr[16]) {
    if constexpr (F == F_TQ4) {
        const uint4 w = R.k[u][row];
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int p = 0; p < 16; p++) pr[p] = tlook(T, ws[p >> 2], p & 3);
    } else if constexpr (F == F_TQ3) {
        uint32_t y[4];
        tq3_kwords(R.kl[u][row].x, R.kl[u][row].y, R.kh[u][row], y);
#pragma unroll
        for (int p = 0; p < 16; p++) pr[p] = tlook(T, y[p >> 2], p & 3, (p >> 2) & 1);
    } else {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            pr[4 * q + 0] = R.k[u][row][q].x;
            pr[4 * q + 1] = R.k[u][row][q].y;
            pr[4 * q + 2] = R.k[u][row][q].z;
            pr[4 * q + 3] = R.k[u][row][q].w;
        }
    }
}

/* V^T fragments of subtile u: a[i] = {a0, a1, a2, a3} of m-tile i. */
template <int F, int S> __device__ __forceinline__ void deq_v(const Raw<F, S> &R, const Tab &T, int u, int g, uint32_t a[8][4]) {
#pragma unroll
    for (int hp = 0; hp < 2; hp++) {          /* k slots (2c, 2c+1) or (2c+8, 2c+9): j = 2hp, 2hp+1 */
        const int j0 = 2 * hp, j1 = 2 * hp + 1;
        if constexpr (F == F_BF16) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t w0 = (&R.v[u][j0][i >> 2].x)[i & 3], w1 = (&R.v[u][j1][i >> 2].x)[i & 3];
                a[i][2 * hp + 0] = prmt(w0, w1, 0x5410);
                a[i][2 * hp + 1] = prmt(w0, w1, 0x7632);
            }
        } else if constexpr (F == F_TQ4) {
            const uint32_t n0[2] = {R.v[u][j0].x, R.v[u][j0].y}, n1[2] = {R.v[u][j1].x, R.v[u][j1].y};
            /* byte b of X = (tok0.lo, tok1.lo) of byte b, of Y = (tok0.hi, tok1.hi): the table
             * entry is then the fragment register itself */
#pragma unroll
            for (int wi = 0; wi < 2; wi++) {
                const uint32_t X = bsel(n0[wi], n1[wi] << 4, 0x0F0F0F0Fu);
                const uint32_t Y = bsel(n0[wi] >> 4, n1[wi], 0x0F0F0F0Fu);
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    a[4 * wi + b][2 * hp + 0] = tlook(T, X, b);
                    a[4 * wi + b][2 * hp + 1] = tlook(T, Y, b);
                }
            }
        } else {
            uint32_t vw[4];
            tq3_vwords(R.vl[u][j0], R.vl[u][j1], R.vh[u][j0], R.vh[u][j1], 4u * (uint32_t)(g & 1), vw);
            /* field k, byte j -> m-tile 4 (k & 1) + j, fragment row e = k >> 1 (vdim) */
#pragma unroll
            for (int k = 0; k < 4; k++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook(T, vw[k], j, TQKV_TQ3_CD ? k >> 1 : k & 1);
        }
    }
}

/* Replace half `hi` of a packed fp16 pair. */
__device__ __forceinline__ uint32_t set_half(uint32_t w, int hi, float v) {
    const uint32_t h = __half_as_ushort(__float2half_rn(v));
    return hi ? (w & 0xFFFFu) | (h << 16) : (w & 0xFFFF0000u) | h;
}
__device__ __forceinline__ float q8_at(const int8_t *p, int i) { return (float)p[i]; }
/* A q8 window token's factor: 512 x its largest block scale (about its largest |value| x 4).
 * Its fragments hold q8 x block scale / factor (|.| <= 127 / 512, like the tq codebook's
 * values), and the factor multiplies its score (K) or its softmax weight (V), as a tq token's
 * fp16 scale does. Values near 0.01 or near 65504 stay in fp16's normal range that way (held
 * as q8 x block scale they went subnormal, or could overflow). 0 for an all-zero token. */
__device__ __forceinline__ float q8_tok_factor(const uint16_t *bs4) {
    const uint2 w = *reinterpret_cast<const uint2 *>(bs4);   /* the token's D / 32 = 4 scales */
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&w.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&w.y));
    return 512.0f * fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
}
static_assert(CUDA_DIM / 32 == 4, "q8_tok_factor reads four block scales");
/* block scale / token factor (0 for an all-zero token, whose values are 0) */
__device__ __forceinline__ float q8_rel(float bs, float f) { return f > 0.0f ? bs / f : 0.0f; }

// ---------------------------------------------------------------------------
// The split kernel (persistent: one CTA per SM of NG groups of 4 warps sharing one table;
// each group takes work items (row, kv head, split): first item = its worker number
// (group-major, so the first items land on different SMs), later ones from a counter; an
// item's arithmetic does not depend on which group runs it)
// ---------------------------------------------------------------------------
struct Params {
    Ctx base;                 /* pointers of (row 0, head 0) before offsets */
    Ring ring;
    const cuda_row *rows;
    const uint16_t *q;        /* [rows, qh, D] prepared queries (fp16 / bf16 bits, kdim order) */
    float *po;                /* [rows, qh, nsmax, D] split outputs (unnormalized, V domain) */
    float2 *pml;              /* [rows, qh, nsmax] (max of s + log2 f, sum) in base 2 */
    int nrows, kvh, G, qh, cap;
    int nsmax;                /* split stride of po / pml: >= every row's split_count */
    int *work;                /* [2] counters (next item, groups done), zero between launches */
    cuda_codec kc, vc;
};

constexpr int NW = 4;                         /* warps per group (one work item at a time) */
constexpr int ATTN_MAX_ROWS = CUDA_MAX_ROWS;  /* rows of one decode attention call (s_pre) */
/* Per-warp shared area: tq: ST stages; bf16: an exchange slot of the merge (warps 0, 1). */
template <int F, int ST> __host__ __device__ constexpr int warp_area() {
    if constexpr (F == F_BF16) return CUDA_MAX_G * D * 4;
    else return ST * Stg<F>::BYTES;
}
/* Dynamic shared memory: [table 64 KiB (tq)] [warp areas] [mbarriers] [s_ml] [s_next]
 * [s_pre] [exchange slots (tq3: tq4 keeps them in the table's holes)]. The table is first:
 * it must start at TAB_BASE. */
template <int F, int NG, int ST> __host__ __device__ constexpr int smem_tab() { return F == F_BF16 ? 0 : 256 * 256; }
template <int F, int NG, int ST> __host__ __device__ constexpr int smem_bar() {
    return smem_tab<F, NG, ST>() + NG * NW * warp_area<F, ST>();
}
template <int F, int NG, int ST> __host__ __device__ constexpr int smem_ml() {
    return smem_bar<F, NG, ST>() + (F == F_BF16 ? 0 : NG * NW * ST * 8);
}
template <int F, int NG, int ST> __host__ __device__ constexpr int smem_xs() {
    return (smem_ml<F, NG, ST>() + NG * 2 * 4 * 16 + NG * NW * 4 + (ATTN_MAX_ROWS + 1) * 4 + 15) / 16 * 16;  /* s_ml, s_next, s_pre */
}
template <int F, int NG, int ST> __host__ __device__ constexpr int smem_bytes() {
    return smem_xs<F, NG, ST>() + (F == F_TQ3 ? NG * 2 * 32 * 128 : 0);
}
static_assert(smem_bytes<F_TQ4, 3, 3>() <= 227 * 1024 && smem_bytes<F_TQ3, 3, 3>() <= 227 * 1024,
              "the configurations below fit one CTA per SM");

/* Group barrier (ids 1..NG; 0 is __syncthreads). */
__device__ __forceinline__ void grp_sync(int grp) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "n"(NW * 32) : "memory");
}

/* NG groups of NW warps per CTA, ST stages per warp (tq). bf16: each warp's next tile is
 * loaded into registers (double buffer) while this one is computed. */
template <int F, int NG, int ST>
__global__ void __launch_bounds__(NG * NW * 32, 1) split_kernel(const Params P) {
    constexpr int SUB = F == F_BF16 ? 1 : 2, TT = 16 * SUB;
    using RawT = Raw<F, SUB>;
    static_assert(F != F_BF16 || warp_area<F, ST>() >= CUDA_MAX_G * D * 4, "bf16: exchange slots in the warp areas");
    static_assert(F != F_TQ4 || NG * 2 * 32 <= 256, "tq4: the exchange slots fit the table's holes");
    extern __shared__ __align__(16) uint32_t s_dyn[];
    char *const sbytes = reinterpret_cast<char *>(s_dyn);
    const int lane = threadIdx.x & 31, wc = threadIdx.x >> 5, grp = wc / NW, w = wc % NW;
    const int g = lane >> 2, c = lane & 3;
    const int G = P.G;
    /* after the table, the warp areas and the mbarriers: the merge's (m0, m1, l0, l1) per
     * (group, slot, lane column) */
    float4 *const s_mlg = reinterpret_cast<float4 *>(sbytes + smem_ml<F, NG, ST>());   /* [NG][2][4] */
    int *const s_next = reinterpret_cast<int *>(s_mlg + NG * 2 * 4);   /* [NG * NW] */
    int *const s_pre = s_next + NG * NW;                          /* [rows + 1] */
    /* this warp's area and mbarriers (uniform: the staging arithmetic runs once per warp) */
    char *const wa = sbytes + uni((uint32_t)(smem_tab<F, NG, ST>() + wc * warp_area<F, ST>()));
    const uint32_t win = (uint32_t)__cvta_generic_to_shared(s_dyn);
    const uint32_t wa_s = uni(win + smem_tab<F, NG, ST>() + wc * warp_area<F, ST>());
    const uint32_t bar_s = uni(win + smem_bar<F, NG, ST>() + wc * ST * 8);

    if constexpr (F != F_BF16) {
        for (int i = threadIdx.x; i < (F == F_TQ3 ? 2 : 1) * 256 * 32; i += NG * NW * 32) {
            const int t = i >> 13, e = (i >> 5) & 255;           /* table, entry */
            s_dyn[e * 64 + 32 * t + (i & 31)] = tab_entry<F>(P.kc.cent, e, t);
        }
        if (lane < ST) mbar_init(bar_s + 8 * lane, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if ((win & 0xFFFFu) != TAB_BASE) __trap(); /* a static __shared__ added here would move it */
    const Tab T = {4u * (uint32_t)lane | (win & 0xFFFF0000u)};
    const LaneOff lo = lane_off<F>(g, c);
    uint64_t pol = 0;
    if constexpr (F != F_BF16) {
        /* K/V are read once: evict-first (measured ~1% faster than evict-normal, RESULTS) */
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        pol = uni(pol);
    }

    // ---- the work items: (row, kv head, split) for every split of every row, numbered
    //      row by row (within a row head-major), so none is empty. s_pre[r] = first item
    //      of row r (an exclusive scan of kvh * split_count(ntok) over the row table).
    {
        constexpr int NT = NG * NW * 32;
        const int per = (P.nrows + NT - 1) / NT, r0 = threadIdx.x * per;
        int sum = 0;
        for (int r = r0; r < r0 + per && r < P.nrows; r++) sum += P.kvh * split_count(P.rows[r].ntok);
        int inc = sum;                                         /* inclusive scan in the warp */
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += y;
        }
        if (lane == 31) s_next[wc] = inc;                      /* warp totals (s_next reused) */
        __syncthreads();                                       /* also: the table and mbarriers */
        int base = 0;
        for (int ww = 0; ww < wc; ww++) base += s_next[ww];
        int run = base + inc - sum;
        for (int r = r0; r < r0 + per && r < P.nrows; r++) {
            s_pre[r] = run;
            run += P.kvh * split_count(P.rows[r].ntok);
        }
        if (threadIdx.x == NT - 1) s_pre[P.nrows] = base + inc;
        __syncthreads();
    }
    const int total = s_pre[P.nrows];
    const int workers = (int)gridDim.x * NG;
    /* worker k's first two items are k and k + workers; with more items than that the rest
     * are claimed from the counter (items 2 workers, 2 workers + 1, ...), each claim made
     * an item ahead of its use, so its latency hides behind a whole item. With at most
     * `workers` items no atomic is touched at all. */
    const bool claims = total > workers;
    const int gt = threadIdx.x - grp * NW * 32, wc0 = grp * NW;   /* thread in group, its first warp */
    /* an item's place: (row, head, split), its tokens [a, z), and this warp's tiles
     * t0 = a + (w + NW k) TT, of which the fast ones (fully in the main plane and in range)
     * are k < nf; nf = 0 for no item */
    struct Item {
        int r, h, sp, a, z, fast_end, first, nf;
        size_t rh, col;                                        /* col: token 0 of (row, head) */
        cuda_row row;
    };
    auto locate = [&](int item) {
        Item x;
        if (item >= total) {
            x.nf = 0;
            return x;
        }
        int lo_r = 0, hi_r = P.nrows - 1;                      /* last r with s_pre[r] <= item */
        while (lo_r < hi_r) {
            const int mid = (lo_r + hi_r + 1) >> 1;
            if (s_pre[mid] <= item) lo_r = mid;
            else hi_r = mid - 1;
        }
        x.r = lo_r;
        x.row = P.rows[x.r];
        const int ntok = x.row.ntok;
        const int nsr = split_count(ntok), local = item - s_pre[x.r];
        x.h = local / nsr;
        x.sp = local - x.h * nsr;
        const int seg = split_len(ntok);
        x.a = x.sp * seg;
        x.z = min(ntok, x.a + seg);
        x.rh = (size_t)x.r * P.kvh + x.h;
        x.col = x.rh * P.cap + (size_t)x.row.left_pad;
        x.fast_end = min(x.z, x.row.wstart);
        x.first = x.a + w * TT;
        x.nf = x.first + TT <= x.fast_end ? (x.fast_end - TT - x.first) / (NW * TT) + 1 : 0;
        return x;
    };
    /* The warp's staged tiles form one stream across its items: position k of an item is
     * its fast tile k for k < nf, then the next item's tile k - nf. Stream use q (seq + k)
     * takes stage q % ST with parity (q / ST) & 1; ST positions are in flight, so the next
     * item's first tiles are on their way while this item ends. */
    uint32_t seq = 0;                                          /* stream positions consumed */
    int pre = 0;                                               /* of this item, already issued */
    int item = grp * (int)gridDim.x + (int)blockIdx.x;
    int nxt_item = claims && item + workers < total ? item + workers : total;
    Item cur = locate(item);
    while (item < total) {
        /* the item after the next, published through the merge's barriers */
        int claim = total;
        if (claims && gt == 0) claim = 2 * workers + atomicAdd(P.work, 1);
#if TQKV_COPY_TOK32
        uint32_t nxt_tt;                                       /* the next item's staging needs only these */
        int nxt_nf;
        {
            const Item x = locate(nxt_item);
            nxt_nf = uni(x.nf);                                /* uniform: the staging runs on them */
            nxt_tt = nxt_nf > 0 ? uni((uint32_t)x.col + (uint32_t)x.first) : 0; /* its first tile in the planes */
#else
        size_t nxt_col;                                        /* the next item's staging needs only these */
        int nxt_first, nxt_nf;
        {
            const Item x = locate(nxt_item);
            nxt_nf = uni(x.nf);                                /* uniform: the staging runs on them */
            nxt_col = nxt_nf > 0 ? uni((uint64_t)x.col) : 0;
            nxt_first = nxt_nf > 0 ? uni(x.first) : 0;
#endif
            /* its query (G heads, 2 KiB) into L1 now, so the next item starts without waiting */
            if (x.nf > 0 && lane < 2 * CUDA_MAX_G && lane * 128 < G * D * 2)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(reinterpret_cast<const char *>(
                    P.q + ((size_t)x.r * P.qh + (size_t)x.h * G) * D) + 128 * lane));
        }
        const int r = cur.r, h = cur.h, sp = cur.sp, a = cur.a, z = cur.z, fast_end = cur.fast_end;
        const int nf = uni(cur.nf), first = uni(cur.first);  /* cur is a located item */
        const cuda_row row = cur.row;
        const size_t rh = cur.rh, col = uni((uint64_t)cur.col);
        (void)a;
        /* window slot pointers, built where a slow tile needs them */
        auto ring_of = [&]() {
            Ring y = P.ring;
            y.kw += rh * y.ring * D;
            y.vw += rh * y.ring * D;
            y.kws += rh * y.ring * (D / 32);
            y.vws += rh * y.ring * (D / 32);
            return y;
        };
#if TQKV_COPY_TOK32
        const uint32_t tt0 = (uint32_t)col + (uint32_t)first, ntt0 = nxt_tt - (uint32_t)(nf * NW * TT);
#endif
        /* the whole warp (k uniform): stream position k of this item into its stage */
        auto issue = [&](int k, uint32_t st) {               /* st = (seq + k) % ST */
            if constexpr (F != F_BF16) {
                const uint32_t dst = wa_s + st * Stg<F>::BYTES, bar = bar_s + 8 * st;
#if TQKV_COPY_TOK32
                /* position k: this item's tile k (tt0 + k NW TT) or the next's tile k - nf */
                const uint32_t tt = (k < nf ? tt0 : ntt0) + (uint32_t)k * (NW * TT);
                stage_issue<F>(P.base, tt, dst, bar, pol);
#else
                const bool here = k < nf;
                stage_issue<F>(P.base, here ? col : nxt_col, here ? first + k * NW * TT : nxt_first + (k - nf) * NW * TT,
                               dst, bar, pol);
#endif
            }
        };
        const int avail = nf + nxt_nf;                         /* positions this item can issue */
        if constexpr (F != F_BF16) { /* the first stages' copies fly while the query loads */
            for (int k = pre; k < ST && k < avail; k++) issue(k, (seq + (uint32_t)k) % ST);
        }

        // ---- query fragments (B of QK^T): head g, pairs 2s / 2s+1 (stored in kdim order)
        uint32_t qb[8][2];
        if (g < G) {
            const uint4 *q = reinterpret_cast<const uint4 *>(P.q + ((size_t)r * P.qh + (size_t)h * G + g) * D + 32 * c);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const uint4 v = __ldg(q + k);
                qb[2 * k][0] = v.x; qb[2 * k][1] = v.y; qb[2 * k + 1][0] = v.z; qb[2 * k + 1][1] = v.w;
            }
        } else {
#pragma unroll
            for (int s = 0; s < 8; s++) qb[s][0] = qb[s][1] = 0u;
        }

        float acc[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        float m[2] = {M_START, M_START}, l[2] = {0.0f, 0.0f};

        auto process = [&](const RawT &R, int t0, bool slow) {
            // ---- per-lane token factors (token t0 + lane): K's, log2 of V's and its inverse
            float kf = 1.0f, vl = 0.0f, vi = 1.0f;  /* (see RESCALE_SLACK) */
            float vf = 1.0f;                          /* (the window's V fragments use it) */
            {
                const int t = t0 + lane;
                if constexpr (F != F_BF16) {
                    kf = __half2float(__ushort_as_half((uint16_t)R.ksc));
                    vf = __half2float(__ushort_as_half((uint16_t)R.vsc));
                    if (slow && t >= row.wstart && t < z) {     /* q8_tok_factor */
                        const Ring x = ring_of();
                        const size_t slot = (size_t)(t % x.ring);
                        kf = q8_tok_factor(x.kws + slot * (D / 32));
                        vf = q8_tok_factor(x.vws + slot * (D / 32));
                    }
                    vl = lg2(vf < VSCALE_MIN ? VSCALE_MIN : vf); /* NaN stays NaN */
                    vi = ex2(-vl);
                }
                if (slow && (t >= z || lane >= TT)) { /* masked: a score of -inf below */
                    kf = vl = vi = 0.0f;
                }
            }
            float sc[SUB][4];
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                uint32_t pa[16], pb[16];
                deq_k<F, SUB>(R, T, u, 0, pa);
                deq_k<F, SUB>(R, T, u, 1, pb);
                if constexpr (F != F_BF16) {
                    if (slow) { /* window tokens: q8 values with their block scale */
                        const Ring x = ring_of();
#pragma unroll
                        for (int row2 = 0; row2 < 2; row2++) {
                            const int t = t0 + 16 * u + krow_tok<F>(g, row2);
                            const float tf = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, row2)); /* its factor */
                            if (t >= row.wstart && t < z) {
                                const size_t slot = (size_t)(t % x.ring);
                                const int8_t *qp = x.kw + slot * D;
                                const float bs = q8_rel(__half2float(__ushort_as_half(x.kws[slot * (D / 32) + c])), tf);
                                uint32_t *pr = row2 ? pb : pa;
#pragma unroll
                                for (int p = 0; p < 16; p++)
                                    pr[p] = pack2<F>(q8_at(qp, kdim<F>(c, p, 0)) * bs, q8_at(qp, kdim<F>(c, p, 1)) * bs);
                            }
                        }
                    }
                }
                float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s4b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int s = 0; s < 8; s++) { /* two accumulators: half the dependent chain */
                    const uint32_t af[4] = {pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1]};
                    mma<F>(s & 1 ? s4b : s4, af, qb[s][0], qb[s][1]);
                }
#pragma unroll
                for (int k = 0; k < 4; k++) s4[k] += s4b[k];
                const float fA = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, 0));
                const float fB = __shfl_sync(0xffffffffu, kf, 16 * u + krow_tok<F>(g, 1));
                if constexpr (F == F_BF16) {
                    sc[u][0] = s4[0] * fA; sc[u][1] = s4[1] * fA;
                    sc[u][2] = s4[2] * fB; sc[u][3] = s4[3] * fB;
                } else {
                    const float lA = __shfl_sync(0xffffffffu, vl, 16 * u + krow_tok<F>(g, 0));
                    const float lB = __shfl_sync(0xffffffffu, vl, 16 * u + krow_tok<F>(g, 1));
                    sc[u][0] = fmaf(s4[0], fA, lA); sc[u][1] = fmaf(s4[1], fA, lA);
                    sc[u][2] = fmaf(s4[2], fB, lB); sc[u][3] = fmaf(s4[3], fB, lB);
                }
                if (slow) {
                    if (t0 + 16 * u + krow_tok<F>(g, 0) >= z) sc[u][0] = sc[u][1] = -INFINITY;
                    if (t0 + 16 * u + krow_tok<F>(g, 1) >= z) sc[u][2] = sc[u][3] = -INFINITY;
                }
            }
            // ---- online softmax (heads 2c, 2c+1) ----------------------------------------
            /* this lane's tokens (no -inf start: fmaxf drops a NaN operand, and every use of mx
             * below compares or takes fmaxf, where an all-NaN mx acts as -inf does) */
            float mx[2] = {fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[0][1], sc[0][3])};
#pragma unroll
            for (int u = 1; u < SUB; u++) {
                mx[0] = fmaxf(mx[0], fmaxf(sc[u][0], sc[u][2]));
                mx[1] = fmaxf(mx[1], fmaxf(sc[u][1], sc[u][3]));
            }
            float mu[2];
            /* rescale only when some score exceeds its head's running max by more than
             * RESCALE_SLACK: below that the weights are taken against the stale max, so they
             * reach at most 2^RESCALE_SLACK (fp16 holds them at full precision); m, l
             * and acc stay consistent, whichever max they refer to. So the tile's max over the
             * warp is needed only then. On random data the exact rule rescaled about half the
             * tiles (batch 32 / 64k); this one, 4% (Nsight, RESULTS). */
            /* (a difference, exact near m: m + RESCALE_SLACK would round for |m| >= 2^25;
             * an all-masked tile, -inf - m, does not rescale) */
            /* (columns of unused heads vote too: their s' is the tokens' log2 f, their query
             * being 0, so a V scale 2^4 above the running max's rescales; letting only heads in
             * use vote cost the loop 40 instructions, SASS) */
            if (__any_sync(0xffffffffu, mx[0] - m[0] > RESCALE_SLACK || mx[1] - m[1] > RESCALE_SLACK)) {
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {             /* over the lanes of heads 2c, 2c+1 */
                    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
                    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
                }
                float al[2];
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    const float mn = fmaxf(m[k], mx[k]);
                    mu[k] = mn;                                /* >= M_START: finite or +inf */
                    al[k] = ex2(m[k] - mu[k]);
                    m[k] = mn;
                    l[k] *= al[k];
                }
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    acc[i][0] *= al[0]; acc[i][1] *= al[1];
                    acc[i][2] *= al[0]; acc[i][3] *= al[1];
                }
            } else {
                mu[0] = m[0];
                mu[1] = m[1];
            }
#pragma unroll
            for (int u = 0; u < SUB; u++) {
                float p[4];
#pragma unroll
                for (int k = 0; k < 4; k++) p[k] = ex2(sc[u][k] - mu[k & 1]);
                if constexpr (F == F_BF16) {
                    l[0] += p[0] + p[2];
                    l[1] += p[1] + p[3];
                } else {                      /* 2^(s' - m) / f = 2^(s - m) */
                    const float iA = __shfl_sync(0xffffffffu, vi, 16 * u + krow_tok<F>(g, 0));
                    const float iB = __shfl_sync(0xffffffffu, vi, 16 * u + krow_tok<F>(g, 1));
                    l[0] = fmaf(p[0], iA, fmaf(p[2], iB, l[0]));
                    l[1] = fmaf(p[1], iA, fmaf(p[3], iB, l[1]));
                }
                const uint32_t plo = pack2<F>(p[0], p[1]), phi = pack2<F>(p[2], p[3]);
                // P^T fragment of head g', k slots of column c' (this lane: g' = g, c' = c):
                /* slots 2c, 2c+1 (b0) and 2c+8, 2c+9 (b1): rows A / B of lanes with
                 * g = c and g = 4 + c (orders_match), column g' >> 1 */
                const int src = 4 * c + (g >> 1);
                const uint32_t x0 = __shfl_sync(0xffffffffu, plo, src), x1 = __shfl_sync(0xffffffffu, plo, src + 16);
                const uint32_t x2 = __shfl_sync(0xffffffffu, phi, src), x3 = __shfl_sync(0xffffffffu, phi, src + 16);
                const uint32_t sel = (g & 1) ? 0x7632u : 0x5410u;
                /* (columns g >= G, unused heads, are not zeroed: an mma column depends on its own
                 * B column only, and those heads' outputs are never stored) */
                const uint32_t b0 = prmt(x0, x1, sel), b1 = prmt(x2, x3, sel);
                uint32_t va[8][4];
                deq_v<F, SUB>(R, T, u, g, va);
                if constexpr (F != F_BF16) {
                    if (slow) {
                        const Ring x = ring_of();
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            const int t = t0 + 16 * u + vcol_tok<F>(c, j);
                            const float tf = __shfl_sync(0xffffffffu, vf, 16 * u + vcol_tok<F>(c, j)); /* its factor */
                            if (t >= row.wstart && t < z) {
                                const size_t slot = (size_t)(t % x.ring);
                                const int8_t *qp = x.vw + slot * D;
                                const float bs = q8_rel(__half2float(__ushort_as_half(x.vws[slot * (D / 32) + (g >> 1)])), tf);
#pragma unroll
                                for (int i = 0; i < 8; i++)
#pragma unroll
                                    for (int e = 0; e < 2; e++)
                                        va[i][2 * (j >> 1) + e] = set_half(va[i][2 * (j >> 1) + e], j & 1,
                                                                           q8_at(qp, vdim<F>(g, i, e)) * bs);
                            }
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < 8; i++) mma<F>(acc[i], va[i], b0, b1);
            }
        };

        // ---- fast tiles ------------------------------------------------------------------
        int t0 = first;
        if constexpr (F != F_BF16) {
            /* staged: tile k waits on stage (seq + k) % ST; once tile k is computed (its
             * values consumed) the stage is refilled with tile k + ST. A warp's tiles are NW TT
             * = 128 tokens apart, so their scales' offset in a 16-byte unit is the same for all */
            const int misk = (int)((reinterpret_cast<uintptr_t>(P.base.ksb + col + first) & 15) >> 1);
            const int misv = (int)((reinterpret_cast<uintptr_t>(P.base.vsb + col + first) & 15) >> 1);
            uint32_t st = seq % ST, ph = (seq / ST) & 1;       /* of stream position seq + k */
            for (int k = 0; k < nf; k++, t0 += NW * TT) {
                mbar_wait(bar_s + 8 * st, ph);
                RawT R;
                load_stage<F, SUB>(R, wa + st * Stg<F>::BYTES, lo, misk, misv, lane);
                process(R, t0, false);
                if (k + ST < avail && k + ST >= pre) { /* the stage's values are consumed */
                    __syncwarp();
                    issue(k + ST, st);                         /* position k + ST: the same stage */
                }
                if (++st == ST) {
                    st = 0;
                    ph ^= 1;
                }
            }
            seq += (uint32_t)nf;
            /* positions of the next item issued so far: those below ST + nf (or all) */
            pre = min(max(pre, nf + ST) - nf, nxt_nf);
        } else if (nf > 0) {
            /* two named buffers so that nothing is copied */
            RawT ra, rb;
            load_tile<F, SUB, false>(ra, P.base, col, lo, t0, 0, g, c, lane);
            for (;;) {
                int tn = t0 + NW * TT;
                bool more = tn + TT <= fast_end;
                if (more) load_tile<F, SUB, false>(rb, P.base, col, lo, tn, 0, g, c, lane);
                process(ra, t0, false);
                t0 = tn;
                if (!more) break;
                tn = t0 + NW * TT;
                more = tn + TT <= fast_end;
                if (more) load_tile<F, SUB, false>(ra, P.base, col, lo, tn, 0, g, c, lane);
                process(rb, t0, false);
                t0 = tn;
                if (!more) break;
            }
        }
        // ---- remaining tiles: partial, or reaching into the q8 window --------------------
        for (; t0 < z; t0 += NW * TT) {
            RawT cur;
            load_tile<F, SUB, true>(cur, P.base, col, lo, t0, fast_end, g, c, lane);
            process(cur, t0, true);
        }

        // ---- merge the group's warps: 2 + 3 into 0 + 1, then 1 into 0, in registers ----
        /* exchange slots, lane-major (conflict free): element j = (i, e, k) of lane l. tq4: in
         * the table's holes (the stages hold the next item's tiles); tq3: after s_pre; bf16:
         * the warp areas of warps 0 and 1. */
        auto slot_off = [&](int s_, int j) {
            if constexpr (F == F_BF16) return (wc0 + s_) * warp_area<F, ST>() + (j * 32 + lane) * 4;
            else if constexpr (F == F_TQ3) return smem_xs<F, NG, ST>() + ((grp * 2 + s_) * 32 + j) * 128 + lane * 4;
            else return ((grp * 2 + s_) * 32 + j) * 256 + 128 + lane * 4;
        };
#pragma unroll
        for (int k = 0; k < 2; k++)
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) l[k] += __shfl_xor_sync(0xffffffffu, l[k], o);
        float4 *const s_ml = s_mlg + grp * 2 * 4;             /* [slot][c] */
        /* acc[i][2 e + k] of this lane in slot s_ */
        auto slot = [&](int s_, int i, int e, int k) -> float & {
            return *reinterpret_cast<float *>(sbytes + slot_off(s_, (i * 2 + e) * 2 + k));
        };
        auto put = [&](int s_) {
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int k = 0; k < 2; k++) slot(s_, i, e, k) = acc[i][2 * e + k];
            if (g == 0) s_ml[s_ * 4 + c] = make_float4(m[0], m[1], l[0], l[1]);
        };
        auto take = [&](int s_) {
            const float4 o = s_ml[s_ * 4 + c];
            const float mo[2] = {o.x, o.y}, lo2[2] = {o.z, o.w};
            float fa[2], fb[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const float M = fmaxf(m[k], mo[k]);
                fa[k] = m[k] == -INFINITY ? 0.0f : exp2f(m[k] - M);
                fb[k] = mo[k] == -INFINITY ? 0.0f : exp2f(mo[k] - M);
                m[k] = M;
                l[k] = l[k] * fa[k] + lo2[k] * fb[k];
            }
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int k = 0; k < 2; k++) acc[i][2 * e + k] = acc[i][2 * e + k] * fa[k] + slot(s_, i, e, k) * fb[k];
        };
        if (w >= 2) put(w - 2);
        if (gt == 0) s_next[wc0] = claim;
        grp_sync(grp);
        const int claimed = s_next[wc0];    /* read before the next barrier (then rewritten) */
        if (w < 2) take(w);
        __syncwarp();                       /* s_ml read by the whole warp before lanes 0-3 rewrite it */
        if (w == 1) put(1);                 /* its own slot, just read */
        grp_sync(grp);
        if (w == 0) take(1);
        grp_sync(grp);                /* the slots are read before the next item writes them */
        if (w == 0) {
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const int hd = 2 * c + k;
                if (hd >= G) continue;
                const size_t pi = ((size_t)r * P.qh + (size_t)h * G + hd) * P.nsmax + sp;
                /* 16-byte stores: four consecutive dims of vdim() per store (a quarter of the
                 * L2 sectors of 4-byte stores) */
                float *const dst = P.po + pi * D;
                if constexpr (F == F_BF16) {  /* vdim(g, i, e) = 16 g + 2 i + e */
#pragma unroll
                    for (int i = 0; i < 8; i += 2)
                        *reinterpret_cast<float4 *>(dst + vdim<F>(g, i, 0)) =
                            make_float4(acc[i][k], acc[i][2 + k], acc[i + 1][k], acc[i + 1][2 + k]);
                } else {                      /* vdim(g, 4 q + t, e) = vdim(g, 4 q, e) + t */
#pragma unroll
                    for (int e = 0; e < 2; e++)
#pragma unroll
                        for (int q4 = 0; q4 < 8; q4 += 4)
                            *reinterpret_cast<float4 *>(dst + vdim<F>(g, q4, e)) =
                                make_float4(acc[q4][2 * e + k], acc[q4 + 1][2 * e + k], acc[q4 + 2][2 * e + k],
                                            acc[q4 + 3][2 * e + k]);
                }
                if (g == 0) P.pml[pi] = make_float2(m[k], l[k]);
            }
        }
        item = nxt_item;
        nxt_item = claims ? claimed : total;
        cur = locate(item);
    }
    /* the last group out resets the counters for the next launch (stream order publishes it) */
    if (claims && (threadIdx.x & (NW * 32 - 1)) == 0) {
        __threadfence();
        if (atomicAdd(P.work + 1, 1) == workers - 1) {
            atomicExch(P.work, 0);
            atomicExch(P.work + 1, 0);
        }
    }
}

// ---------------------------------------------------------------------------
// Query preparation and merge (one warp per (row, q head), lane l: dims 4l..4l+3)
// ---------------------------------------------------------------------------
/* The query rotated into K's domain (tq), scaled by softmax scale * log2(e), rounded to
 * fp16 (bf16 for the dense cache) and stored in the split kernel's kdim order: element
 * 32 c + 2 p + e holds dim kdim(c, p, e), so a lane loads its 16 pairs as four uint4. */
template <int F>
__global__ void qprep_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, cuda_codec C,
                             float mul, int n) {
    __shared__ float s_q[4][D];
    const int wv = threadIdx.x >> 5, v = blockIdx.x * 4 + wv, lane = threadIdx.x & 31;
    if (v >= n) return;
    const float4 in = reinterpret_cast<const float4 *>(q + (size_t)v * D)[lane];
    float x[4] = {in.x, in.y, in.z, in.w};
    if constexpr (F != F_BF16) {
        const float s[4] = {C.signs[4 * lane], C.signs[4 * lane + 1], C.signs[4 * lane + 2], C.signs[4 * lane + 3]};
        cw_rotate(x, s, C.inv, lane);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) s_q[wv][4 * lane + k] = x[k];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int o = 4 * lane + k;
        const float y = s_q[wv][kdim<F>(o >> 5, (o & 31) >> 1, o & 1)] * mul;
        out[(size_t)v * D + o] = F == F_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(y))
                                             : __half_as_ushort(__float2half_rn(y));
    }
}

__global__ void merge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                             const cuda_row *__restrict__ rows, float *__restrict__ out, cuda_codec C,
                             int unrotate, int qh, int nsmax, int n) {
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const int r = v / qh;
    const int ns = split_count(rows[r].ntok);
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, pml[(size_t)v * nsmax + s].x);
    float o[4] = {0, 0, 0, 0}, L = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < ns; s++) {
            const float2 ml = pml[(size_t)v * nsmax + s];
            if (ml.x == -INFINITY) continue;
            const float f = exp2f(ml.x - M);
            const float4 p = reinterpret_cast<const float4 *>(po + ((size_t)v * nsmax + s) * D)[lane];
            o[0] += p.x * f; o[1] += p.y * f; o[2] += p.z * f; o[3] += p.w * f;
            L += ml.y * f;
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) o[k] *= inv;
    if (unrotate) {
        const float s[4] = {C.signs[4 * lane], C.signs[4 * lane + 1], C.signs[4 * lane + 2], C.signs[4 * lane + 3]};
        cw_unrotate(o, s, C.inv, lane);
    }
    reinterpret_cast<float4 *>(out + (size_t)v * D)[lane] = make_float4(o[0], o[1], o[2], o[3]);
}

} // namespace

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------
/* The split kernel per format: groups per CTA (NG) x stages per warp (ST). tq: 3 x 3 (12
 * warps per SM at 168 registers, one 64 KiB table, 36 staged tiles); 3 x 2, 2 x 4 and 4 x 2
 * measured slower (bench/RESULTS.md). bf16: 2 groups, no staging. */
struct SplitCfg {
    void (*fn)(Params);
    int ng, st, smem;
    int ctas;                 /* resident CTAs (one per SM), set by the setup */
};
#define SPLIT_CFG(F, NG, ST) {split_kernel<F, NG, ST>, NG, ST, smem_bytes<F, NG, ST>(), 0}
static SplitCfg g_cfg[3] = {SPLIT_CFG(F_TQ4, 3, 3), SPLIT_CFG(F_TQ3, 3, 3), SPLIT_CFG(F_BF16, 2, 1)};
#undef SPLIT_CFG
static int g_setup_done;

__global__ void smem_probe_kernel(uint32_t *out) {
    extern __shared__ __align__(16) uint32_t s_dyn[];
    if (threadIdx.x == 0) *out = (uint32_t)__cvta_generic_to_shared(s_dyn) & 0xFFFFu;
}

/* Allow the split kernels their dynamic shared memory (the tq table is 64 KiB), size
 * their persistent grids, and check where dynamic shared memory starts (TAB_BASE).
 * Idempotent. */
static pthread_mutex_t g_setup_mu = PTHREAD_MUTEX_INITIALIZER;
static tqkv_status attn_cuda_setup_locked(void);

extern "C" tqkv_status tqkv_cuda_attn_setup(void) {
    const tqkv_status pst = cuda_prefill_setup(); /* the masked kernels */
    if (pst) return pst;
    if (__atomic_load_n(&g_setup_done, __ATOMIC_ACQUIRE)) return TQKV_OK;
    pthread_mutex_lock(&g_setup_mu);
    const tqkv_status st = g_setup_done ? TQKV_OK : attn_cuda_setup_locked();
    pthread_mutex_unlock(&g_setup_mu);
    return st;
}

static tqkv_status attn_cuda_setup_locked(void) {
    cudaError_t e = cudaSuccess;
    int dev = 0, sms = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    for (int f = 0; f < 3 && e == cudaSuccess; f++) {
        SplitCfg *k = &g_cfg[f];
        e = cudaFuncSetAttribute(k->fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k->smem);
        int per_sm = 0;
        if (e == cudaSuccess)
            e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k->fn, k->ng * NW * 32, k->smem);
        if (e == cudaSuccess && per_sm < 1)
            return tqkv_fail(TQKV_EUNSUPPORTED, "attention kernels: a %d-warp CTA with %d bytes of shared "
                             "memory does not fit an SM", k->ng * NW, k->smem);
        k->ctas = per_sm * (sms > 0 ? sms : 1);
    }
    tqkv_status st = cuda_check(e, "attention kernel setup");
    if (st) return st;
    uint32_t *d_probe = NULL, probe = 0;
    st = tqkv_cuda_malloc((void **)&d_probe, sizeof *d_probe);
    if (st) return st;
    smem_probe_kernel<<<1, 32, 256>>>(d_probe);
    st = cuda_check(cudaMemcpy(&probe, d_probe, sizeof probe, cudaMemcpyDeviceToHost), "shared memory probe");
    tqkv_cuda_free(d_probe);
    if (st) return st;
    if (probe != TAB_BASE)
        return tqkv_fail(TQKV_EUNSUPPORTED, "attention kernels: dynamic shared memory starts at %u in the CTA's "
                         "window, the lookup table assumes %u (a GPU other than sm_90?)", probe, TAB_BASE);
    __atomic_store_n(&g_setup_done, 1, __ATOMIC_RELEASE);
    return TQKV_OK;
}
/* Workspace layout for rows x q_heads vectors and nsmax splits: partial outputs
 * [nv, nsmax, D] f32, (max, sum) [nv, nsmax] float2, rotated queries [nv, D] fp16. */
static size_t ws_need(size_t nv, int nsmax, size_t *po_b, size_t *pml_b) {
    *po_b = nv * nsmax * D * sizeof(float);
    *pml_b = (nv * nsmax * sizeof(float2) + 255) / 256 * 256; /* the queries after it: 16-byte loads */
    return *po_b + *pml_b + nv * D * sizeof(uint16_t) + 256;
}

/* The split stride for rows of at most n tokens: >= split_count(m) for every m <= n
 * (split_count(m) = ceil(m / 256) up to 8192 tokens, then at most 32), and monotone in n,
 * so the workspace and the launch only change when it does (CUDA graphs key on it). */
static int split_bound(int n) {
    const int s = (n + 255) / 256;
    return s < 1 ? 1 : s > 32 ? 32 : s;
}

extern "C" size_t tqkv_cuda_attend_ws_bytes(int rows, int q_heads, int max_tokens) {
    size_t a, b;
    return ws_need((size_t)rows * q_heads, split_bound(max_tokens), &a, &b);
}

static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          void *ws, size_t ws_bytes);

extern "C" tqkv_status tqkv_cuda_kv_attend_ws(cuda_kv *kv, const float *q, int q_heads, float scale,
                                         float *out, void *ws, size_t ws_bytes) {
    if (!ws) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_ws: NULL workspace");
    /* d = 256: the float32 split kernel and its merge (attn_cuda_prefill.cu) */
    if (kv && kv->d != D) return cuda_attend_decode_wide(kv, q, q_heads, scale, out, ws, ws_bytes);
    return attend(kv, q, q_heads, scale, out, ws, ws_bytes);
}

extern "C" tqkv_status tqkv_cuda_kv_attend(cuda_kv *kv, const float *q, int q_heads, float scale,
                                      float *out) {
    if (kv && kv->d != D) return cuda_attend_decode_wide(kv, q, q_heads, scale, out, NULL, 0);
    return attend(kv, q, q_heads, scale, out, NULL, 0);
}

/* ws == NULL: the cache's own workspace, grown as needed. */
static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          void *ws, size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: q_heads %d must be a multiple of kv_heads %d "
                         "with at most %d query heads per kv head", q_heads, kv->kvh, CUDA_MAX_G);
    if (kv->rows == 0) return TQKV_OK;
    tqkv_status sst = tqkv_cuda_attn_setup(); /* model states run it at init, before any capture */
    if (sst) return sst;
    const int fmt = kv->bf16 ? F_BF16 : kv->kfmt == TQKV_TQ4 ? F_TQ4 : F_TQ3;
    const size_t pay = fmt == F_TQ4 ? Fmt<F_TQ4>::PAY : fmt == F_TQ3 ? Fmt<F_TQ3>::PAY : Fmt<F_BF16>::PAY;
    if (kv->d != D || kv->kpay != pay || kv->vpay != pay || (!kv->bf16 && kv->vfmt != kv->kfmt))
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: the device kernels need d %d and the same "
                         "format for K and V (tq4/tq4, tq3/tq3 or the dense bf16 cache)", D);
    if (kv->rows > ATTN_MAX_ROWS)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows (the decode kernel takes at most %d)",
                         kv->rows, ATTN_MAX_ROWS);
#if TQKV_COPY_TOK32
    /* the staged copies index tokens of a plane in 32 bits (stage_issue): 2^32 tokens would be
     * 192 GiB of tq3 payload per plane, more than a GPU holds, so this never refuses in practice */
    if (fmt != F_BF16 && (uint64_t)kv->rows * (uint64_t)kv->kvh * (uint64_t)kv->cap > 0xFFFFFFFFull)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows x %d heads x %d columns exceed 2^32 "
                         "tokens per plane", kv->rows, kv->kvh, kv->cap);
#endif
    int maxtok = 0;
    for (int r = 0; r < kv->rows; r++) maxtok = kv->h_offset[r] > maxtok ? kv->h_offset[r] : maxtok;
    const int nsmax = split_bound(maxtok);
    const size_t nv = (size_t)kv->rows * q_heads;
    size_t po_b, pml_b;
    const size_t need = ws_need(nv, nsmax, &po_b, &pml_b);
    if (ws && need > ws_bytes)
        return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_ws: workspace of %zu bytes < %zu needed",
                         ws_bytes, need);
    if (!ws && need > kv->ws_bytes) {
        tqkv_cuda_free(kv->ws);
        kv->ws = NULL;
        kv->ws_bytes = 0;
        tqkv_status st = tqkv_cuda_malloc(&kv->ws, need);
        if (st) return st;
        kv->ws_bytes = need;
    }
    if (!ws) ws = kv->ws;
    float *po = (float *)ws;
    float2 *pml = (float2 *)((char *)ws + po_b);
    uint16_t *qp = (uint16_t *)((char *)ws + po_b + pml_b);
    const int nvi = (int)nv;
    const float mul = scale * LOG2E;
    const unsigned qgrid = (unsigned)((nvi + 3) / 4);
    if (fmt == F_TQ4) qprep_kernel<F_TQ4><<<qgrid, 128, 0, kv->stream>>>(q, qp, kv->kc, mul, nvi);
    else if (fmt == F_TQ3) qprep_kernel<F_TQ3><<<qgrid, 128, 0, kv->stream>>>(q, qp, kv->kc, mul, nvi);
    else qprep_kernel<F_BF16><<<qgrid, 128, 0, kv->stream>>>(q, qp, kv->kc, mul, nvi);
    Params P;
    P.base.kb = kv->kd; P.base.vb = kv->vd;
    P.base.ksb = kv->ks; P.base.vsb = kv->vs;
    P.ring.kw = kv->kw; P.ring.vw = kv->vw;
    P.ring.kws = kv->kws; P.ring.vws = kv->vws;
    P.ring.ring = kv->ring;
    P.rows = kv->d_rows;
    P.q = qp;
    P.po = po;
    P.pml = pml;
    P.nrows = kv->rows;
    P.kvh = kv->kvh;
    P.G = q_heads / kv->kvh;
    P.qh = q_heads;
    P.cap = kv->cap;
    P.nsmax = nsmax;
    P.work = kv->d_work;
    P.kc = kv->kc;
    P.vc = kv->vc;
    /* persistent: the resident CTAs, at most one per possible work item (a CTA's groups
     * take items gridDim.x apart, so the first items land on different SMs) */
    const SplitCfg *k = &g_cfg[fmt];
    const long items_ub = (long)kv->rows * kv->kvh * nsmax;
    const unsigned grid = (unsigned)(items_ub < k->ctas ? items_ub : k->ctas);
    k->fn<<<grid, k->ng * NW * 32, k->smem, kv->stream>>>(P);
    merge_kernel<<<qgrid, 128, 0, kv->stream>>>(po, pml, kv->d_rows, out, kv->vc, !kv->bf16, q_heads, nsmax, nvi);
    return cuda_check(cudaGetLastError(), "attention kernel launch");
}

// ---------------------------------------------------------------------------
// Decode attention at an earlier length (speculative verification)
// ---------------------------------------------------------------------------
/* The host mirror's offsets are lowered by `back` for the call and restored after; win_lo
 * is left as it is (it only rose by the appends since, which matters only past the slack). */
extern "C" tqkv_status tqkv_cuda_kv_attend_back(cuda_kv *kv, int back, const float *q, int q_heads,
                                                float scale, float *out, void *ws, size_t ws_bytes) {
    if (!kv || back < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_back: NULL cache or back < 0");
    for (int r = 0; r < kv->rows; r++)
        if (back > kv->h_offset[r])
            return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_back: back = %d exceeds row %d's %d tokens",
                             back, r, kv->h_offset[r]);
    if (back == 0) return tqkv_cuda_kv_attend_ws(kv, q, q_heads, scale, out, ws, ws_bytes);
    for (int r = 0; r < kv->rows; r++) kv->h_offset[r] -= back;
    tqkv_status st = cuda_kv_sync_rows(kv);
    if (!st) st = tqkv_cuda_kv_attend_ws(kv, q, q_heads, scale, out, ws, ws_bytes);
    for (int r = 0; r < kv->rows; r++) kv->h_offset[r] += back;
    const tqkv_status st2 = cuda_kv_sync_rows(kv); /* the row table as it was */
    return st ? st : st2;
}

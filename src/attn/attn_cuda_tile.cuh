/*
 * attn_cuda_tile.cuh - the building blocks of the split-KV decode kernel (attn_cuda_split.cuh),
 * device code shared by its d = 128 and d = 256 instantiations (attn_cuda.cu, attn_cuda_wide.cu).
 * Owns: the format constants (payload bytes per token), the head-dim orders inside the dot
 * products and the output (kdim / vdim / qdim: Q is stored in K's pair order), the token orders
 * of a tile's fragments, the codebook lookup table in shared memory (one column per lane) and
 * its lookups, tq3's lookup words, the tiles' loads (registers, d = 128; in place, d = 256),
 * the staging of tiles through shared memory by bulk copies (TMA) with their mbarriers and the
 * d = 256 stage layout (with its bank-conflict check), the q8 window's per-token factors; the
 * softmax constants.
 * Must not: hold kernel state or host code; change a d = 128 building block's instructions
 * (the tuned kernel's SASS is checked against them: docs/CUDA.md "Device runs").
 *
 * The d = 128 kernel's shape (head dims 128, tiles of 32 tokens = two 16-token subtiles):
 *   S^T [16 tokens, 8 heads] = K [16, 128] . Q^T [128, 8]    mma.m16n8k16 (fp16/bf16)
 *   O^T [128, 8 heads]     += V^T [128, 16] . P^T [16, 8]    mma.m16n8k16
 * The G <= 8 query heads of the GQA group are the N = 8 columns (unused ones are zero).
 * K fragments are decoded straight from the payload bytes a thread loads (16 bytes per
 * token row for tq4): the head-dim order inside the dot product is permuted per format so
 * that every register pair comes from one byte (kdim()), and Q is loaded in the same
 * order; V^T fragments pair two tokens per register (vdim() is the output order).
 * Dequantization: a lookup byte holding two 4-bit (tq4) or 3-bit (tq3) indices is looked
 * up in a per-lane fp16-pair table in shared memory (Tab, tlook(); tq3 has two tables).
 * At d = 256 (tq4, tq3) each thread column covers two 32-dim groups (16 k-steps, K decoded
 * per half so that the transient fragments stay those of d = 128) and each thread row two
 * groups of the output (16 m-tiles); the halves are the d = 128 byte layout shifted by four
 * groups, so the lookups are the same (kdim256, vdim256); tiles are read in place from the
 * stage, in a token order and layout without bank conflicts (ktok256, Stg256).
 */
#ifndef TQKV_ATTN_CUDA_TILE_CUH
#define TQKV_ATTN_CUDA_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "cache/cache_cuda_impl.h"

/* Compile-time variants for A/B runs on the device (-DCMAKE_CUDA_FLAGS=-DTQKV_...=N); the
 * defaults are the kernel as measured last. */
#ifndef TQKV_TQ3_CD
#define TQKV_TQ3_CD 1         /* tq3 tables C / D: K's lookup words without the nibble interleave */
#endif
#ifndef TQKV_COPY_TOK32
#define TQKV_COPY_TOK32 1     /* bulk copies addressed from a 32-bit token index (stage_issue) */
#endif
/* Speed-of-light probes for tq3, timing only: their attention is WRONG (the tests fail), so
 * they are never a default and `attend` says so once on stderr. 1: lookup words as cheap as
 * any tq3 layout could make them (one select per word merges the 1-bit plane's bits in
 * place, no transpose, no shift: K 4 and V 9 instructions per 16 lookup bytes, against 14
 * and 23), i.e. the most a new tq3 byte layout could gain; 2: that and no codebook lookups
 * (the byte permute kept, the shared-memory load dropped), i.e. what the lookups cost. */
#ifndef TQKV_TQ3_SOL
#define TQKV_TQ3_SOL 0
#endif
/* fp8 decode (d = 128): 1: e4m3 -> fp16 by the hardware conversion (cvt.rn.f16x2.e4m3x2); 0: by
 * integer ops, the fp16 h(b) = e4m3 x 2^-8 of docs/FORMATS.md (exact, subnormals included),
 * with the x 256 in the token's factor (4 ops per fp16 pair instead of one conversion: for an
 * A/B run where the conversion's throughput limits). */
#ifndef TQKV_FP8_CVT
#define TQKV_FP8_CVT 1
#endif

namespace {

/* Formats of the kernel's K and V: one format for both (tq4, tq3, the dense bf16 baseline,
 * fp8 = OCP e4m3 with an fp16 scale per vector: d = 128 only, no table, no q8 window) or a
 * pair (d = 128 only): F_TQ42 = tq4 K with tq2 V, F_TQ2 = tq2 for both, F_TQ43 = tq4 K
 * with tq3 V, F_TQ32 = tq3 K with tq2 V. kfmt / vfmt name each side's format; a pair's K-side
 * building blocks are its K format's, its V-side ones its V format's (tq2: tq3's head-dim
 * orders without the 1-bit plane; tq3 in a pair: one table, C, tq3c_kwords / tq3c_vwords). */
enum { F_TQ4 = 0, F_TQ3 = 1, F_BF16 = 2, F_TQ42 = 3, F_TQ2 = 4, F_TQ43 = 5, F_TQ32 = 6, F_FP8 = 7 };
__host__ __device__ constexpr int kfmt(int F) { return F == F_TQ42 || F == F_TQ43 ? F_TQ4 : F == F_TQ32 ? F_TQ3 : F; }
__host__ __device__ constexpr int vfmt(int F) { return F == F_TQ42 || F == F_TQ32 ? F_TQ2 : F == F_TQ43 ? F_TQ3 : F; }
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
// Formats: payload bytes per token at head dim D (compile-time, so tile loads use immediate
// offsets)
// ---------------------------------------------------------------------------
template <int F, int D> struct Fmt;
template <int D> struct Fmt<F_TQ4, D> { static constexpr int PAY = D / 2; };
template <int D> struct Fmt<F_TQ3, D> { static constexpr int PAY = 3 * D / 8; };  /* 2-bit plane, 1-bit plane */
template <int D> struct Fmt<F_BF16, D> { static constexpr int PAY = 2 * D; };
template <int D> struct Fmt<F_TQ2, D> { static constexpr int PAY = D / 4; };      /* 2-bit plane */
template <int D> struct Fmt<F_FP8, D> { static constexpr int PAY = D; };          /* e4m3 bytes */
/* payload bytes per token of K and of V (a pair's sides differ) */
template <int F, int D> __host__ __device__ constexpr int kpay() { return Fmt<kfmt(F), D>::PAY; }
template <int F, int D> __host__ __device__ constexpr int vpay() { return Fmt<vfmt(F), D>::PAY; }

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
    if constexpr (F == F_TQ4 || F == F_TQ42 || F == F_TQ43) return 32 * c + p + 16 * e;
    /* tq2: word w of deq_k_tq2 (the 2-bit plane words and them >> 4), byte j: dims d + j and
     * d + 8 + j, d = 0, 16, 4, 20 for w = 0..3 (tq3's tables C / D order; tq3 K in a pair: the
     * same order, tq3c_kwords) */
    else if constexpr (F == F_TQ2 || F == F_TQ32) return 32 * c + 16 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3) + 8 * e;
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
    else if constexpr (F == F_TQ3 || F == F_TQ42 || F == F_TQ2 || F == F_TQ43 || F == F_TQ32) /* tq2 V: tq3's */
        return 32 * (g >> 1) + 8 * (2 * e + (i >> 2)) + 4 * (g & 1) + (i & 3);
    else return 16 * g + 2 * i + e;
}
/* d = 256 (tq4, tq3): each thread column covers two 32-dim groups, c and c + 4, and each
 * thread row two groups of V's output: half h = p >> 4 (K's pairs 16 h ..) or i >> 3 (V's
 * m-tiles 8 h ..) is the d = 128 order of the groups 4 h .. 4 h + 3, i.e. dims 128 h + that
 * order. In the payload that half's bytes are the d = 128 layout's shifted by four groups (tq4:
 * 64 bytes; tq3: 32 bytes of the 2-bit plane, 16 of the 1-bit plane, whose plane starts at
 * D / 4 = 64), so the d = 128 lookups serve both halves unchanged. */
template <int F> __host__ __device__ constexpr int kdim256(int c, int p, int e) {
    static_assert(F != F_BF16, "the tensor-core d = 256 kernel reads tq4 / tq3");
    return 128 * (p >> 4) + kdim<F>(c, p & 15, e);
}
template <int F> __host__ __device__ constexpr int vdim256(int g, int i, int e) {
    static_assert(F != F_BF16, "the tensor-core d = 256 kernel reads tq4 / tq3");
    return 128 * (i >> 3) + vdim<F>(g, i & 7, e);
}
template <int F, int D> __host__ __device__ constexpr int vdim_of(int g, int i, int e) {
    if constexpr (D == 128) return vdim<F>(g, i, e);
    else return vdim256<F>(g, i, e);
}
/* The prepared query's storage order: element o holds dim qdim(o). d = 128: 32 c + 2 p + e
 * holds kdim(c, p, e), so a lane (column c) loads its 16 pairs as four uint4 from 32 c; d = 256:
 * two such halves, 128 h + 32 c + 2 p + e holding kdim256(c, 16 h + p, e) (four uint4 from
 * 32 c and four from 128 + 32 c). */
template <int F, int D> __host__ __device__ constexpr int qdim(int o) {
    if constexpr (D == 128) return kdim<F>(o >> 5, (o & 31) >> 1, o & 1);
    else return kdim256<F>((o >> 5) & 3, 16 * (o >> 7) + ((o & 31) >> 1), o & 1);
}
/* All orders are permutations of the D dims (qprep writes Q in qdim order, which holds K's
 * kdim pairs; the merge reads the output in vdim order). */
template <int F, int D> constexpr bool dim_orders_ok() {
    bool k[D] = {}, v[D] = {}, q[D] = {};
    for (int j = 0; j < D; j++) { /* j: (c, p, e) of kdim, (g, i, e) of vdim */
        int dk = 0, dv = 0;
        if constexpr (D == 128) {
            dk = kdim<F>(j >> 5, (j >> 1) & 15, j & 1);
            dv = vdim<F>(j >> 4, (j >> 1) & 7, j & 1);
        } else {
            dk = kdim256<F>(j >> 6, (j >> 1) & 31, j & 1);
            dv = vdim256<F>(j >> 5, (j >> 1) & 15, j & 1);
        }
        const int dq = qdim<F, D>(j);
        if (dk < 0 || dk >= D || k[dk] || dv < 0 || dv >= D || v[dv] || dq < 0 || dq >= D || q[dq]) return false;
        k[dk] = v[dv] = q[dq] = true;
    }
    return true;
}
static_assert(dim_orders_ok<F_TQ4, 128>() && dim_orders_ok<F_TQ3, 128>() && dim_orders_ok<F_BF16, 128>() &&
                  dim_orders_ok<F_TQ42, 128>() && dim_orders_ok<F_TQ2, 128>() && dim_orders_ok<F_TQ43, 128>() &&
                  dim_orders_ok<F_TQ32, 128>() && dim_orders_ok<F_FP8, 128>() &&
                  dim_orders_ok<F_TQ4, 256>() && dim_orders_ok<F_TQ3, 256>(),
              "kdim, vdim and qdim are permutations of the head dims");
/* The query pairs a lane loads are K's: at d = 256, element 128 h + 32 c + 2 p + e of the
 * stored query is the dim of K pair 16 h + p of column c (what the kernel's qb[8 h + p / 2]
 * multiplies). */
template <int F> constexpr bool qdim256_is_kdim() {
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++)
            for (int p = 0; p < 16; p++)
                for (int e = 0; e < 2; e++)
                    if (qdim<F, 256>(128 * h + 32 * c + 2 * p + e) != kdim256<F>(c, 16 * h + p, e)) return false;
    return true;
}
static_assert(qdim256_is_kdim<F_TQ4>() && qdim256_is_kdim<F_TQ3>(), "Q's storage order is K's pair order");

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
 *   tq2:          e = (i0 | i1 << 2 | xxxx << 4)                -> (c[i0], c[i1])
 *   (the high nibble ignored: a 2-bit plane word or it >> 4 is looked up as it is). Pairs:
 * tq4/tq2 keeps tq4's table at 0 and tq2's (V's codebook) at 128, its exchange slots after
 * s_pre as tq3's; tq2/tq2 has one table (K's codebook, equal to V's: same bits and dim) and
 * tq4's holes; tq4/tq3: tq4's at 0, tq3's table C (V's codebook) at 128; tq3/tq2: tq3's C (K's
 * codebook) at 0, tq2's at 128 (tq3 in a pair looks up table C only: tq3c_kwords / vwords).
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
/* tq3's lookups (tlook, or under the TQKV_TQ3_SOL=2 probe the byte permute alone) */
__device__ __forceinline__ uint32_t tlook3(const Tab &T, uint32_t w, int k, int t) {
#if TQKV_TQ3_SOL >= 2
    return prmt(w, T.L | (uint32_t)(128 * t), 0x7604u | (uint32_t)k << 4);
#else
    return tlook(T, w, k, t);
#endif
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
/* The pairs' tables (F_TQ42, F_TQ2): entry e of table t from K's codebook kc (tq4's entry) or
 * V's vc (tq2's entry, F_TQ42's table 1; F_TQ2's table 0 from kc, K's and V's codebooks
 * being the same). */
template <int F> __device__ __forceinline__ uint32_t tab_entry_pair(const float *kc, const float *vc, int e, int t) {
    static_assert(F == F_TQ42 || F == F_TQ2 || F == F_TQ43 || F == F_TQ32, "the pairs' tables");
    const int tf = t == 0 ? kfmt(F) : vfmt(F);               /* table t's format */
    const float *c = t == 0 ? kc : vc;
    float a, b;
    if (tf == F_TQ4) {
        a = c[e & 15];
        b = c[e >> 4];
    } else if (tf == F_TQ3) {                                   /* table C */
        a = c[(e & 3) | ((e >> 2) & 4)];
        b = c[((e >> 2) & 3) | ((e >> 3) & 4)];
    } else {                                                    /* tq2 */
        a = c[e & 3];
        b = c[(e >> 2) & 3];
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
#if TQKV_TQ3_SOL
    y[0] = bsel(H, W0, 0x30303030u);  /* probe: the high bits taken where they lie */
    y[1] = bsel(H, W0, 0x0C0C0C0Cu);
    y[2] = bsel(H, W1, 0x30303030u);
    y[3] = bsel(H, W1, 0x0C0C0C0Cu);
#elif TQKV_TQ3_CD
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
#if TQKV_TQ3_SOL
    (void)sh;                          /* probe: the two tokens' fields paired, high bits in place */
    const uint32_t X = H0 ^ H1;
    const uint32_t V0 = bsel(W0, W1 << 2, 0x33333333u), V1 = bsel(W0 >> 2, W1, 0x33333333u);
    y[0] = bsel(X, V0, 0x30303030u);
    y[1] = bsel(X, V1, 0x30303030u);
    y[2] = bsel(X, V0, 0x0C0C0C0Cu);
    y[3] = bsel(X, V1, 0x0C0C0C0Cu);
#elif TQKV_TQ3_CD
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

/* tq3 in a pair (F_TQ43's V, F_TQ32's K): table C only, so that the other side's table fits
 * beside it. The words of tq3_kwords / tq3_vwords (TQKV_TQ3_CD) whose lookups went to table D
 * take their 2-bit fields from the plane word shifted right by 4 and their high bits shifted
 * to bits 4, 5, i.e. table C's places: the same dims per word (kdim, vdim), two shifts more. */
__device__ __forceinline__ void tq3c_kwords(uint32_t W0, uint32_t W1, uint32_t H, uint32_t y[4]) {
    const uint32_t X = tq3_hi_t(H);
    y[0] = bsel(X << 4, W0, 0x30303030u);                      /* dims j, 8 + j */
    y[1] = bsel(X << 2, W0 >> 4, 0x30303030u);                 /* dims 16 + j, 24 + j */
    y[2] = bsel(X, W1, 0x30303030u);                           /* dims 4 + j, 12 + j */
    y[3] = bsel(X >> 2, W1 >> 4, 0x30303030u);                 /* dims 20 + j, 28 + j */
}
__device__ __forceinline__ void tq3c_vwords(uint32_t W0, uint32_t W1, uint32_t H0, uint32_t H1, uint32_t sh,
                                            uint32_t y[4]) {
    const uint32_t P0 = prmt(H0, H1, 0x6240u), P1 = prmt(H0, H1, 0x7351u);
    const uint32_t X = tq3_hi_t(bsel(P0 >> sh, P1 * (16u >> sh), 0x0F0F0F0Fu));
    const uint32_t V0 = bsel(W0, W1 << 2, 0x33333333u), V1 = bsel(W0 >> 2, W1, 0x33333333u);
    y[0] = bsel(X << 4, V0, 0x30303030u);
    y[1] = bsel(X, V1, 0x30303030u);
    y[2] = bsel(X << 2, V0 >> 4, 0x30303030u);
    y[3] = bsel(X >> 2, V1 >> 4, 0x30303030u);
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
template <int S> struct Raw<F_TQ42, S> {  /* tq4 K, tq2 V */
    static constexpr int SUB = S;
    uint4 k[SUB][2];          /* tq4: bytes 16c.. of the token */
    uint32_t vl[SUB][4];      /* tq2: 2-bit plane bytes 4g..4g+3 */
    uint32_t ksc, vsc;
};
template <int S> struct Raw<F_TQ2, S> {
    static constexpr int SUB = S;
    uint2 kl[SUB][2];         /* 2-bit plane bytes 8c..8c+7 */
    uint32_t vl[SUB][4];      /* 2-bit plane bytes 4g..4g+3 */
    uint32_t ksc, vsc;
};
template <int S> struct Raw<F_TQ43, S> {  /* tq4 K, tq3 V */
    static constexpr int SUB = S;
    uint4 k[SUB][2];
    uint32_t vl[SUB][4];
    uint32_t vh[SUB][4];
    uint32_t ksc, vsc;
};
template <int S> struct Raw<F_TQ32, S> {  /* tq3 K, tq2 V */
    static constexpr int SUB = S;
    uint2 kl[SUB][2];
    uint32_t kh[SUB][2];
    uint32_t vl[SUB][4];
    uint32_t ksc, vsc;
};
/* fp8: the tile is read where it is used (in registers it would be 64 of them): pointers to
 * the lane's first K row and V token in the warp's stage (gl = false) or in global memory (gl =
 * true, slow tiles: tokens at or past lim, tile-relative, read as zero bytes). K row: dims
 * 32c..32c+31 (32 bytes) of token krow_tok(g, row); V: dims 16g..16g+15 (16 bytes) of token
 * vcol_tok(c, j). */
template <int S> struct Raw<F_FP8, S> {
    static constexpr int SUB = S;
    const char *k, *v;        /* + lane offset (lane_off<F_FP8>) */
    int ktok, vtok, lim;      /* the lane's first K / V token (tile-relative); valid tokens */
    bool gl;
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
    if constexpr (F == F_TQ3 || F == F_TQ32) return 2 * (g & 3) + (g >> 2) + 8 * row;
    else if constexpr (F == F_FP8) return 4 * (g & 3) + (g >> 2) + 2 * row;
    else return g + 8 * row;
}
/* fp8: column c's slots are the 4 consecutive tokens 4c .. 4c + 3, so that the stage can place
 * each column's tokens in a copy of their own, 32 bytes further along the banks (Stg<F_FP8>):
 * a V load's lanes (4 columns x 2 rows) then read 8 different 16-byte bank groups. */
template <int F> __host__ __device__ constexpr int vcol_tok(int c, int j) {
    if constexpr (F == F_TQ3 || F == F_TQ32) return 8 * (j >> 1) + 2 * c + (j & 1);
    else if constexpr (F == F_FP8) return 4 * c + j;
    else return 4 * j + c;
}
template <int F> constexpr bool orders_match() {
    for (int c = 0; c < 4; c++)
        for (int row = 0; row < 2; row++)
            if (krow_tok<F>(c, row) != vcol_tok<F>(c, 2 * row) || krow_tok<F>(c + 4, row) != vcol_tok<F>(c, 2 * row + 1))
                return false;
    return true;
}
static_assert(orders_match<F_TQ4>() && orders_match<F_TQ3>() && orders_match<F_BF16>() && orders_match<F_TQ42>() &&
                  orders_match<F_TQ2>() && orders_match<F_TQ43>() && orders_match<F_TQ32>() && orders_match<F_FP8>(),
              "S rows c, c + 4 are P's k slots of column c (the transposition in process)");

/* Per-lane byte offsets inside a tile (tokens from the tile's first), so that every load
 * of a tile is [base + lane offset + immediate]. */
struct LaneOff {
    int k, kh, v, vh;
};
template <int F> __device__ __forceinline__ LaneOff lane_off(int g, int c) {
    constexpr int KPAY = kpay<F, 128>(), VPAY = vpay<F, 128>();
    LaneOff o;
    o.k = krow_tok<F>(g, 0) * KPAY;
    o.v = vcol_tok<F>(c, 0) * VPAY;
    if constexpr (F == F_TQ4) { o.kh = o.k; o.k += 16 * c; o.vh = o.v; o.v += 8 * g; }
    else if constexpr (F == F_TQ3) { o.kh = o.k + 32 + 4 * c; o.k += 8 * c; o.vh = o.v + 32 + 4 * (g >> 1); o.v += 4 * g; }
    else if constexpr (F == F_TQ42) { o.kh = o.k; o.k += 16 * c; o.vh = o.v; o.v += 4 * g; }
    else if constexpr (F == F_TQ2) { o.kh = o.k; o.k += 8 * c; o.vh = o.v; o.v += 4 * g; }
    else if constexpr (F == F_TQ43) { o.kh = o.k; o.k += 16 * c; o.vh = o.v + 32 + 4 * (g >> 1); o.v += 4 * g; }
    else if constexpr (F == F_TQ32) { o.kh = o.k + 32 + 4 * c; o.k += 8 * c; o.vh = o.v; o.v += 4 * g; }
    else if constexpr (F == F_FP8) { o.kh = o.k; o.k += 32 * c; o.vh = o.v; o.v += 16 * g; } /* V: the plain layout */
    else { o.kh = o.k; o.k += 64 * c; o.vh = o.v; o.v += 32 * g; }
    return o;
}

template <int F, int S, bool SLOW>
__device__ __forceinline__ void load_tile(Raw<F, S> &R, const Ctx &x, size_t col, const LaneOff &o, int t0, int lim,
                                          int g, int c, int lane) {
    constexpr int SUB = S, KPAY = kpay<F, 128>(), VPAY = vpay<F, 128>();
    const size_t tt = col + (size_t)t0;     /* the tile's first token in the planes */
    const uint8_t *kt = x.kb + tt * KPAY, *vt = x.vb + tt * VPAY;
    if constexpr (F == F_FP8) {               /* read where used (deq_k_fp8 / deq_v_fp8) */
        R.k = reinterpret_cast<const char *>(kt + o.k);
        R.v = reinterpret_cast<const char *>(vt + o.v);
        R.ktok = krow_tok<F>(g, 0);
        R.vtok = vcol_tok<F>(c, 0);
        R.lim = SLOW ? lim - t0 : 16 * SUB;
        R.gl = true;
    }
#pragma unroll
    for (int u = 0; u < SUB && F != F_FP8; u++) {
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const bool ok = !SLOW || t0 + 16 * u + krow_tok<F>(g, row) < lim;
            const int tk = (16 * u + krow_tok<F>(0, row)) * KPAY;   /* immediate */
            if constexpr (F == F_TQ4 || F == F_TQ42 || F == F_TQ43) {
                R.k[u][row] = ok ? __ldg(reinterpret_cast<const uint4 *>(kt + o.k + tk)) : make_uint4(0, 0, 0, 0);
            } else if constexpr (F == F_TQ2) {
                R.kl[u][row] = ok ? __ldg(reinterpret_cast<const uint2 *>(kt + o.k + tk)) : make_uint2(0, 0);
            } else if constexpr (F == F_TQ3 || F == F_TQ32) {
                R.kl[u][row] = ok ? __ldg(reinterpret_cast<const uint2 *>(kt + o.k + tk)) : make_uint2(0, 0);
                R.kh[u][row] = ok ? __ldg(reinterpret_cast<const uint32_t *>(kt + o.kh + tk)) : 0u;
            } else if constexpr (F == F_BF16) {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    R.k[u][row][q] = ok ? __ldg(reinterpret_cast<const uint4 *>(kt + o.k + tk) + q) : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool ok = !SLOW || t0 + 16 * u + vcol_tok<F>(c, j) < lim;
            const int tv = (16 * u + vcol_tok<F>(0, j)) * VPAY;
            if constexpr (F == F_TQ4) {
                R.v[u][j] = ok ? __ldg(reinterpret_cast<const uint2 *>(vt + o.v + tv)) : make_uint2(0, 0);
            } else if constexpr (F == F_TQ42 || F == F_TQ2 || F == F_TQ32) {
                R.vl[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(vt + o.v + tv)) : 0u;
            } else if constexpr (F == F_TQ3 || F == F_TQ43) {
                R.vl[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(vt + o.v + tv)) : 0u;
                R.vh[u][j] = ok ? __ldg(reinterpret_cast<const uint32_t *>(vt + o.vh + tv)) : 0u;
            } else if constexpr (F == F_BF16) {
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
/* fp8's V payload is copied in VCH = 8 pieces of 4 tokens (a column's slots, vcol_tok), piece k
 * at V_OFF + k VSTR, VPAD = 32 bytes after the previous one, so that the lanes of one 16-byte V
 * load (columns 0..3, rows g, g + 1: same in-token bytes of 4 tokens) hit 8 different bank groups
 * (with one copy they hit 2, 4-way). Every other format: one V copy (VCH = 1, VPAD = 0). */
template <int F> struct Stg {
    static constexpr int TT = 32, KPAY = kpay<F, 128>(), VPAY = vpay<F, 128>();
    static constexpr int VCH = F == F_FP8 ? 8 : 1, VPAD = F == F_FP8 ? 32 : 0;
    static constexpr int VCT = TT / VCH, VSTR = VCT * VPAY + VPAD;   /* tokens per V copy, its stride */
    static constexpr int V_OFF = TT * KPAY;
    static constexpr int SC = 80;             /* a tile's scales from their 16-byte floor */
    static constexpr int KS_OFF = V_OFF + VCH * VSTR - VPAD;
    static constexpr int VS_OFF = KS_OFF + SC;
    static constexpr int BYTES = VS_OFF + SC;
    static constexpr int TX = TT * KPAY + TT * VPAY + 2 * SC;        /* what the copies bring */
    /* stage offset of tile token t's V row */
    __host__ __device__ static constexpr int vpos(int t) { return V_OFF + t / VCT * VSTR + t % VCT * VPAY; }
    static_assert(SC % 16 == 0 && SC >= 2 * TT + 14, "the tile's scales from any 2-byte offset");
    static_assert(KPAY % 16 == 0 && VPAY % 16 == 0 && VSTR % 16 == 0 && BYTES % 16 == 0,
                  "bulk copies move 16-byte multiples to 16-byte aligned places");
    static_assert(F == F_FP8 || (KS_OFF == TT * KPAY + TT * VPAY && TX == BYTES), "one V copy: the plain layout");
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
        mbar_expect(bar, G::TX);
        bulk_g2s(dst, x.kb + (size_t)tt * G::KPAY, G::TT * G::KPAY, bar, pol);
        if constexpr (G::VCH == 1) {
            bulk_g2s(dst + G::V_OFF, x.vb + (size_t)tt * G::VPAY, G::TT * G::VPAY, bar, pol);
        } else {
#pragma unroll
            for (int k = 0; k < G::VCH; k++)
                bulk_g2s(dst + G::V_OFF + k * G::VSTR, x.vb + ((size_t)tt + k * G::VCT) * G::VPAY, G::VCT * G::VPAY,
                         bar, pol);
        }
        bulk_g2s(dst + G::KS_OFF, reinterpret_cast<const void *>(ks0), G::SC, bar, pol);
        bulk_g2s(dst + G::VS_OFF, reinterpret_cast<const void *>(vs0), G::SC, bar, pol);
    }
}

/* A staged tile into registers: the same lane offsets and immediates as load_tile. */
template <int F, int S>
__device__ __forceinline__ void load_stage(Raw<F, S> &R, const char *st, const LaneOff &o, int misk, int misv,
                                           int lane) {
    using G = Stg<F>;
    constexpr int KPAY = G::KPAY, VPAY = G::VPAY;
    static_assert(16 * S == G::TT, "a stage is one tile");
    if constexpr (F == F_FP8) {               /* read where used (deq_k_fp8 / deq_v_fp8) */
        R.k = st + o.k;
        R.v = st + G::vpos(vcol_tok<F>(lane & 3, 0)) + 16 * (lane >> 2);   /* V: the stage's pieces */
        R.ktok = 0;                           /* (gl = false: every token is valid) */
        R.vtok = 0;
        R.lim = G::TT;
        R.gl = false;
    }
#pragma unroll
    for (int u = 0; u < S && F != F_FP8; u++) {
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const int tk = (16 * u + krow_tok<F>(0, row)) * KPAY;
            if constexpr (F == F_TQ4 || F == F_TQ42 || F == F_TQ43) {
                R.k[u][row] = *reinterpret_cast<const uint4 *>(st + o.k + tk);
            } else if constexpr (F == F_TQ2) {
                R.kl[u][row] = *reinterpret_cast<const uint2 *>(st + o.k + tk);
            } else if constexpr (F != F_FP8) {
                R.kl[u][row] = *reinterpret_cast<const uint2 *>(st + o.k + tk);
                R.kh[u][row] = *reinterpret_cast<const uint32_t *>(st + o.kh + tk);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int tv = G::V_OFF + (16 * u + vcol_tok<F>(0, j)) * VPAY;
            if constexpr (F == F_TQ4) {
                R.v[u][j] = *reinterpret_cast<const uint2 *>(st + o.v + tv);
            } else if constexpr (F == F_TQ42 || F == F_TQ2 || F == F_TQ32) {
                R.vl[u][j] = *reinterpret_cast<const uint32_t *>(st + o.v + tv);
            } else if constexpr (F != F_FP8) {
                R.vl[u][j] = *reinterpret_cast<const uint32_t *>(st + o.v + tv);
                R.vh[u][j] = *reinterpret_cast<const uint32_t *>(st + o.vh + tv);
            }
        }
    }
    const bool ok = lane < G::TT;
    R.ksc = ok ? reinterpret_cast<const uint16_t *>(st + G::KS_OFF)[misk + lane] : 0u;
    R.vsc = ok ? reinterpret_cast<const uint16_t *>(st + G::VS_OFF)[misv + lane] : 0u;
}

/* The lookups of one K row's 32-dim group (its 16 pairs, kdim order) from the bytes a lane
 * holds: tq4 the group's 16 payload bytes, tq3 its 8 bytes of the 2-bit plane and its word of
 * the 1-bit plane. Used by both head dims (d = 256: once per half). */
__device__ __forceinline__ void deq_k_tq4(uint4 w, const Tab &T, uint32_t pr[16]) {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int p = 0; p < 16; p++) pr[p] = tlook(T, ws[p >> 2], p & 3);
}
__device__ __forceinline__ void deq_k_tq3(uint2 kl, uint32_t kh, const Tab &T, uint32_t pr[16]) {
    uint32_t y[4];
    tq3_kwords(kl.x, kl.y, kh, y);
#pragma unroll
    for (int p = 0; p < 16; p++) pr[p] = tlook3(T, y[p >> 2], p & 3, (p >> 2) & 1);
}
/* tq2 (d = 128): the group's 8 bytes of the 2-bit plane, looked up in table t. Words W0, W0 >> 4,
 * W1, W1 >> 4: byte j's low nibble holds fields (0, 1) or (2, 3) of W's byte j, i.e. dims
 * (j, 8 + j), (16 + j, 24 + j) of W0 (bytes 0..3) and (4 + j, ..) of W1 (kdim<F_TQ2>). */
__device__ __forceinline__ void deq_k_tq2(uint2 kl, const Tab &T, int t, uint32_t pr[16]) {
    const uint32_t y[4] = {kl.x, kl.x >> 4, kl.y, kl.y >> 4};
#pragma unroll
    for (int p = 0; p < 16; p++) pr[p] = tlook(T, y[p >> 2], p & 3, t);
}
/* ... and V: two tokens' 2-bit plane words (this lane's half of the group, as tq3's W0 / W1):
 * V0 byte j = (W0 f0, W1 f0, W0 f2, W1 f2), V1 = (W0 f1, W1 f1, W0 f3, W1 f3) (2 bits each), so
 * field k's word is V0, V1, V0 >> 4, V1 >> 4 (low nibble: the two tokens' indices), placed as
 * deq_v_tq3 places tq3's (vdim). */
__device__ __forceinline__ void deq_v_tq2(uint32_t W0, uint32_t W1, const Tab &T, int t, int hp, uint32_t a[8][4]) {
    const uint32_t V0 = bsel(W0, W1 << 2, 0x33333333u), V1 = bsel(W0 >> 2, W1, 0x33333333u);
    const uint32_t vw[4] = {V0, V1, V0 >> 4, V1 >> 4};
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int j = 0; j < 4; j++) a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook(T, vw[k], j, t);
}
/* tq3 in a pair: deq_k_tq3 / deq_v_tq3 on table C (t) only (tq3c_kwords / tq3c_vwords) */
__device__ __forceinline__ void deq_k_tq3c(uint2 kl, uint32_t kh, const Tab &T, int t, uint32_t pr[16]) {
    uint32_t y[4];
    tq3c_kwords(kl.x, kl.y, kh, y);
#pragma unroll
    for (int p = 0; p < 16; p++) pr[p] = tlook(T, y[p >> 2], p & 3, t);
}
__device__ __forceinline__ void deq_v_tq3c(uint32_t W0, uint32_t W1, uint32_t H0, uint32_t H1, uint32_t sh,
                                           const Tab &T, int t, int hp, uint32_t a[8][4]) {
    uint32_t vw[4];
    tq3c_vwords(W0, W1, H0, H1, sh, vw);
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int j = 0; j < 4; j++) a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook(T, vw[k], j, t);
}
/* V^T fragment registers 2 hp, 2 hp + 1 (k slots j0 = 2 hp, j1 = 2 hp + 1) of 8 m-tiles from two
 * tokens' bytes: tq4 the lane's 8 payload bytes of each (n0, n1), tq3 its 2-bit plane word
 * (W0, W1) and its group's 1-bit plane word (H0, H1) of each; sh = 4 (g & 1) picks the half. */
__device__ __forceinline__ void deq_v_tq4(uint2 v0, uint2 v1, const Tab &T, int hp, uint32_t a[8][4]) {
    const uint32_t n0[2] = {v0.x, v0.y}, n1[2] = {v1.x, v1.y};
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
}
__device__ __forceinline__ void deq_v_tq3(uint32_t W0, uint32_t W1, uint32_t H0, uint32_t H1, uint32_t sh,
                                          const Tab &T, int hp, uint32_t a[8][4]) {
    uint32_t vw[4];
    tq3_vwords(W0, W1, H0, H1, sh, vw);
    /* field k, byte j -> m-tile 4 (k & 1) + j, fragment row e = k >> 1 (vdim) */
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook3(T, vw[k], j, TQKV_TQ3_CD ? k >> 1 : k & 1);
}

/* fp8 (d = 128): e4m3 bytes to fp16 by the hardware conversion (sm_89+), exact: every e4m3
 * value (subnormals included) is an fp16 normal, x_hat / scale = h(b) x 256 (docs/FORMATS.md).
 * Bytes 0, 1 of w become the fp16 pair lo (byte 0 in its low half), bytes 2, 3 the pair hi.
 * (The codes 0x7f / 0xff, never written by the encoder, convert to NaN here; the CPU reads
 * them as +-480.) */
/* The token factor's multiplier of fp8's fragment values: 1 for cvt's (the e4m3 values), 256 for
 * TQKV_FP8_CVT=0's h(b) = e4m3 x 2^-8. */
constexpr float FP8_FACTOR = TQKV_FP8_CVT ? 1.0f : 256.0f;
/* TQKV_FP8_CVT=0: the fp16 pair (h(b1), h(b3)) of bytes 1 and 3 of a (bytes 0 and 2 ignored):
 * h(b) = (b & 0x80) << 8 | (b & 0x7f) << 7, i.e. e4m3 x 2^-8 (exact; e4m3 subnormals are fp16
 * subnormals) */
__device__ __forceinline__ uint32_t fp8_h2(uint32_t a) {
    return lop3<0xF8>((a & 0x7F007F00u) >> 1, a, 0x80008000u);   /* x | (a & sign bits) */
}
__device__ __forceinline__ void e4m3x4_f16(uint32_t w, uint32_t &lo, uint32_t &hi) {
#if TQKV_FP8_CVT
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}"
        : "=r"(lo), "=r"(hi) : "r"(w));
#else
    lo = fp8_h2(prmt(w, 0u, 0x1404u));        /* bytes (0, b0, 0, b1) */
    hi = fp8_h2(prmt(w, 0u, 0x3424u));        /* bytes (0, b2, 0, b3) */
#endif
}
/* A 16-byte word of the fp8 tile: the stage (shared memory) or, for slow tiles, global memory
 * (zero bytes where !ok). */
template <int S> __device__ __forceinline__ uint4 fp8_ld(const Raw<F_FP8, S> &R, const char *p, bool ok) {
    if (R.gl) return ok ? __ldg(reinterpret_cast<const uint4 *>(p)) : make_uint4(0, 0, 0, 0);
    return *reinterpret_cast<const uint4 *>(p);
}
/* K pairs of one row: the 32 bytes of dims 32c.. (kdim<F_FP8>(c, p, e) = 32 c + 2 p + e: pair p
 * is bytes 2p, 2p + 1). */
template <int S> __device__ __forceinline__ void deq_k_fp8(const Raw<F_FP8, S> &R, int u, int row, uint32_t pr[16]) {
    const int tk = 16 * u + krow_tok<F_FP8>(0, row);
    const bool ok = R.ktok + tk < R.lim;
    const uint4 a = fp8_ld(R, R.k + tk * 128, ok), b = fp8_ld(R, R.k + tk * 128 + 16, ok);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int m = 0; m < 8; m++) e4m3x4_f16(w[m], pr[2 * m], pr[2 * m + 1]);
}
/* V^T fragments: tokens j0 = 2 hp, j1 = 2 hp + 1 of column c, 16 bytes each (dims 16g..). Word m
 * of both tokens interleaved by bytes (prmt) gives the (tok j0, tok j1) pairs of dims 16g + 4m ..
 * 16g + 4m + 3, i.e. vdim<F_FP8>(g, 2m + (d >> 1), d & 1) = 16 g + 2 i + e. */
template <int S> __device__ __forceinline__ void deq_v_fp8(const Raw<F_FP8, S> &R, int u, uint32_t a[8][4]) {
    using G = Stg<F_FP8>;
#pragma unroll
    for (int hp = 0; hp < 2; hp++) {
        /* the tokens' places from the lane's first (vcol_tok(c, 0) of subtile 0): plain (global
         * memory) or in the stage's pieces (each column's 4 tokens in one piece) */
        const int t0 = 16 * u + vcol_tok<F_FP8>(0, 2 * hp), t1 = 16 * u + vcol_tok<F_FP8>(0, 2 * hp + 1);
        const int i0 = R.gl ? t0 * 128 : G::vpos(t0) - G::V_OFF, i1 = R.gl ? t1 * 128 : G::vpos(t1) - G::V_OFF;
        const uint4 x0 = fp8_ld(R, R.v + i0, R.vtok + t0 < R.lim);
        const uint4 x1 = fp8_ld(R, R.v + i1, R.vtok + t1 < R.lim);
        const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
#if TQKV_FP8_CVT
#pragma unroll
        for (int m = 0; m < 4; m++) {
            e4m3x4_f16(prmt(w0[m], w1[m], 0x5140u), a[2 * m][2 * hp], a[2 * m][2 * hp + 1]);
            e4m3x4_f16(prmt(w0[m], w1[m], 0x7362u), a[2 * m + 1][2 * hp], a[2 * m + 1][2 * hp + 1]);
        }
#else
#pragma unroll
        for (int m = 0; m < 4; m++)
#pragma unroll
            for (int k = 0; k < 4; k++)           /* byte k of both tokens: bytes 1 and 3 of the permute */
                a[2 * m + (k >> 1)][2 * hp + (k & 1)] = fp8_h2(prmt(w0[m], w1[m], 0x4400u + 0x1111u * (uint32_t)k));
#endif
    }
}

/* K pairs of one row of subtile u (d = 128). */
template <int F, int S> __device__ __forceinline__ void deq_k(const Raw<F, S> &R, const Tab &T, int u, int row, uint32_t pr[16]) {
    if constexpr (F == F_TQ4) {
        deq_k_tq4(R.k[u][row], T, pr);
    } else if constexpr (F == F_TQ3) {
        deq_k_tq3(R.kl[u][row], R.kh[u][row], T, pr);
    } else if constexpr (F == F_TQ42 || F == F_TQ43) {
        deq_k_tq4(R.k[u][row], T, pr);        /* table 0 */
    } else if constexpr (F == F_TQ2) {
        deq_k_tq2(R.kl[u][row], T, 0, pr);
    } else if constexpr (F == F_TQ32) {
        deq_k_tq3c(R.kl[u][row], R.kh[u][row], T, 0, pr);
    } else if constexpr (F == F_FP8) {
        deq_k_fp8(R, u, row, pr);
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

/* V^T fragments of subtile u: a[i] = {a0, a1, a2, a3} of m-tile i (d = 128). */
template <int F, int S> __device__ __forceinline__ void deq_v(const Raw<F, S> &R, const Tab &T, int u, int g, uint32_t a[8][4]) {
    if constexpr (F == F_FP8) deq_v_fp8(R, u, a);
#pragma unroll
    for (int hp = 0; hp < 2 && F != F_FP8; hp++) {   /* k slots (2c, 2c+1) or (2c+8, 2c+9): j = 2hp, 2hp+1 */
        const int j0 = 2 * hp, j1 = 2 * hp + 1;
        if constexpr (F == F_BF16) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t w0 = (&R.v[u][j0][i >> 2].x)[i & 3], w1 = (&R.v[u][j1][i >> 2].x)[i & 3];
                a[i][2 * hp + 0] = prmt(w0, w1, 0x5410);
                a[i][2 * hp + 1] = prmt(w0, w1, 0x7632);
            }
        } else if constexpr (F == F_TQ4) {
            deq_v_tq4(R.v[u][j0], R.v[u][j1], T, hp, a);
        } else if constexpr (F == F_TQ42 || F == F_TQ2 || F == F_TQ32) { /* tq2 V: table 1 beside K's, else 0 */
            deq_v_tq2(R.vl[u][j0], R.vl[u][j1], T, F == F_TQ2 ? 0 : 1, hp, a);
        } else if constexpr (F == F_TQ43) {   /* tq3 V: table C at 1 */
            deq_v_tq3c(R.vl[u][j0], R.vl[u][j1], R.vh[u][j0], R.vh[u][j1], 4u * (uint32_t)(g & 1), T, 1, hp, a);
        } else if constexpr (F == F_TQ3) {
            deq_v_tq3(R.vl[u][j0], R.vl[u][j1], R.vh[u][j0], R.vh[u][j1], 4u * (uint32_t)(g & 1), T, hp, a);
        }
    }
}

/* Replace half `hi` of a packed fp16 pair. */
__device__ __forceinline__ uint32_t set_half(uint32_t w, int hi, float v) {
    const uint32_t h = __half_as_ushort(__float2half_rn(v));
    return hi ? (w & 0xFFFFu) | (h << 16) : (w & 0xFFFF0000u) | h;
}
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
/* The same for a d = 256 token (its 8 block scales). */
__device__ __forceinline__ float q8_tok_factor8(const uint16_t *bs8) {
    const uint4 w = *reinterpret_cast<const uint4 *>(bs8);   /* the token's D / 32 = 8 scales */
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&w.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&w.y));
    const float2 c = __half22float2(*reinterpret_cast<const __half2 *>(&w.z));
    const float2 d = __half22float2(*reinterpret_cast<const __half2 *>(&w.w));
    const float m0 = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
    const float m1 = fmaxf(fmaxf(fabsf(c.x), fabsf(c.y)), fmaxf(fabsf(d.x), fabsf(d.y)));
    return 512.0f * fmaxf(m0, m1);
}
static_assert(CUDA_DIM_WIDE / 32 == 8, "q8_tok_factor8 reads eight block scales");
/* block scale / token factor (0 for an all-zero token, whose values are 0) */
__device__ __forceinline__ float q8_rel(float bs, float f) { return f > 0.0f ? bs / f : 0.0f; }

/* ---- q8 window tokens' fragments from vector loads (tq4, tq3; both head dims) ----
 * A lane's q8 values of one window token are a few short runs of its 128-dim half (d = 256:
 * the half 128 h, the d = 128 orders shifted): K row pairs kdim(c, p, e) are the 32 bytes of
 * group c; V's vdim(g, i, e) sit at fixed offsets from vdim(g, 0, 0). So a token costs two
 * 16-byte (K) or up to four 4-to-8-byte (V) loads, issued before any value is used (the
 * slots are valid for every token of a tile holding a window token: the ring is allocated),
 * where a byte load per value (64 per K row) stalled the warp each tile. The values and
 * their rounding are the byte loads': q8 x (block scale / factor), rounded to fp16 once. */
template <int F> __host__ __device__ constexpr int q8k_off(int p, int e) { return kdim<F>(0, p, e); }
template <int F> __host__ __device__ constexpr int q8v_off(int i, int e) { return vdim<F>(0, i, e) - vdim<F>(0, 0, 0); }
/* the loaded V word holding offset o (tq4: words at 0, 4, 16, 20; tq3: at 0, 8, 16, 24) */
template <int F> __host__ __device__ constexpr int q8v_word(int o) {
    if constexpr (F == F_TQ4) return o < 8 ? o >> 2 : 2 + ((o - 16) >> 2);
    else return o >> 3;
}
template <int F> constexpr bool q8_offs_ok() {
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < 16; p++)
            for (int e = 0; e < 2; e++)
                if (kdim<F>(c, p, e) != 32 * c + q8k_off<F>(p, e) || q8k_off<F>(p, e) >= 32) return false;
    for (int g = 0; g < 8; g++)
        for (int i = 0; i < 8; i++)
            for (int e = 0; e < 2; e++) {
                const int o = q8v_off<F>(i, e), wd = q8v_word<F>(o);
                const int wo = F == F_TQ4 ? (wd & 1) * 4 + (wd >> 1) * 16 : 8 * wd;  /* the word's offset */
                if (vdim<F>(g, i, e) != vdim<F>(g, 0, 0) + o || o < wo || o >= wo + 4) return false;
                if (vdim<F>(g, 0, 0) % (F == F_TQ4 ? 8 : 4) != 0) return false;     /* the loads' alignment */
            }
    return true;
}
static_assert(q8_offs_ok<F_TQ4>() && q8_offs_ok<F_TQ3>() && q8_offs_ok<F_TQ42>() && q8_offs_ok<F_TQ2>() &&
                  q8_offs_ok<F_TQ43>() && q8_offs_ok<F_TQ32>(),
              "the window's fragment loads cover the lane's q8 values");
__device__ __forceinline__ float q8_byte(const uint32_t *w, int o) {
    return (float)((int)(w[o >> 2] << (24 - 8 * (o & 3))) >> 24);   /* sign-extended byte o */
}
/* K row: the 32 bytes of group c of token q (its 128-dim half) */
struct Q8K {
    uint32_t w[8];
};
__device__ __forceinline__ Q8K q8k_load(const int8_t *q, int c) {
    const uint4 a = __ldg(reinterpret_cast<const uint4 *>(q + 32 * c));
    const uint4 b = __ldg(reinterpret_cast<const uint4 *>(q + 32 * c + 16));
    return {{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}
template <int F> __device__ __forceinline__ void q8k_pairs(const Q8K &k, float bs, uint32_t pr[16]) {
#pragma unroll
    for (int p = 0; p < 16; p++) pr[p] = pack2<F>(q8_byte(k.w, q8k_off<F>(p, 0)) * bs, q8_byte(k.w, q8k_off<F>(p, 1)) * bs);
}
/* V: the lane's words of token q (vo = vdim(g, 0, 0)) */
struct Q8V {
    uint32_t w[4];
};
template <int F> __device__ __forceinline__ Q8V q8v_load(const int8_t *q, int vo) {
    if constexpr (F == F_TQ4) {
        const uint2 a = __ldg(reinterpret_cast<const uint2 *>(q + vo));
        const uint2 b = __ldg(reinterpret_cast<const uint2 *>(q + vo + 16));
        return {{a.x, a.y, b.x, b.y}};
    } else {
        const uint32_t *p = reinterpret_cast<const uint32_t *>(q + vo);
        return {{__ldg(p), __ldg(p + 2), __ldg(p + 4), __ldg(p + 6)}};
    }
}
/* the 128-byte line at p into L2 (a hint: no fault, no wait) */
__device__ __forceinline__ void l2_prefetch(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
/* value (i, e) of the loaded words */
template <int F> __device__ __forceinline__ float q8v_at(const Q8V &v, int i, int e) {
    const int o = q8v_off<F>(i, e);
    const uint32_t w = v.w[q8v_word<F>(o)];
    return (float)((int)(w << (24 - 8 * (o & 3))) >> 24);
}

// ---------------------------------------------------------------------------
// d = 256 tiles (tq4, tq3): token order, stage layout, lane offsets, loads
// ---------------------------------------------------------------------------
/* At d = 256 a token's payload is 128 (tq4) or 96 (tq3) bytes, and with d = 128's token orders
 * the lanes of one load instruction would read the staged tile with 2- to 4-way bank conflicts
 * (every tq4 token row starts at the same bank). So:
 *   - token order: S row g (row 0) / g + 8 (row 1) of subtile u holds the tile's token
 *     ktok256(u, g, row) = 8 kap(g) + 2 (g >> 2) + 4 u + row (kap: g's two low bits reversed);
 *     P's k slot j of column c holds vtok256(u, c, j) = ktok256(u, c + 4 (j & 1), j >> 1), the
 *     rule of orders_match, so one transposition (the shuffles in process) serves both. A
 *     subtile is 16 of the tile's 32 tokens, not 16 consecutive ones (the softmax does not care).
 *   - stage layout (Stg256): each plane's 32 tokens are copied in pieces of consecutive tokens
 *     (tq4 K: 2 of 16, tq4 V and tq3 K / V: 4 of 8), piece k placed k x PAD bytes after where
 *     one plain copy would put it. A lane's K tokens all lie in piece kap(g) (V: kap(c)), so the
 *     pad is part of its lane offset, and the lanes of one load (a quarter warp for 16-byte
 *     loads, a half warp for 8-byte ones) read different banks: stage_conflicts below checks
 *     every load of the kernel; tq3's K words of the 1-bit plane are read 2-way (its rows
 *     shift by multiples of 32 bytes only, and 8 rows would need 8 distinct 16-byte shifts).
 * Slow tiles (loaded from global memory) take the same token order with the plain layout. */
__host__ __device__ constexpr int kap(int g) { return ((g & 1) << 1) | ((g >> 1) & 1); }
__host__ __device__ constexpr int ktok256(int u, int g, int row) { return 8 * kap(g) + 2 * (g >> 2) + 4 * u + row; }
__host__ __device__ constexpr int vtok256(int u, int c, int j) { return ktok256(u, c + 4 * (j & 1), j >> 1); }

/* One warp's stage at d = 256: [K pieces][V pieces][K scales 80][V scales 80] (bytes). */
template <int F> struct Stg256 {
    static_assert(F == F_TQ4 || F == F_TQ3, "tq formats");
    static constexpr int TT = 32, PAY = Fmt<F, 256>::PAY;
    static constexpr int KCH = F == F_TQ4 ? 2 : 4, VCH = 4;           /* copies per plane */
    static constexpr int KPAD = F == F_TQ4 ? 64 : 32, VPAD = 32;      /* bytes after each copy */
    static constexpr int KCT = TT / KCH, VCT = TT / VCH;              /* tokens per copy */
    static constexpr int KSTR = KCT * PAY + KPAD, VSTR = VCT * PAY + VPAD;
    static constexpr int V_OFF = KCH * KSTR;
    static constexpr int SC = 80;             /* a tile's scales from their 16-byte floor */
    static constexpr int KS_OFF = V_OFF + VCH * VSTR;
    static constexpr int VS_OFF = KS_OFF + SC;
    static constexpr int BYTES = VS_OFF + SC;
    static constexpr int TX = 2 * TT * PAY + 2 * SC;                  /* what the copies bring */
    /* stage offset of tile token t's K / V row */
    __host__ __device__ static constexpr int kpos(int t) { return t / KCT * KSTR + t % KCT * PAY; }
    __host__ __device__ static constexpr int vpos(int t) { return V_OFF + t / VCT * VSTR + t % VCT * PAY; }
    static_assert(SC % 16 == 0 && SC >= 2 * TT + 14, "the tile's scales from any 2-byte offset");
    static_assert(KSTR % 16 == 0 && VSTR % 16 == 0 && (KCT * PAY) % 16 == 0 && (VCT * PAY) % 16 == 0 &&
                      BYTES % 16 == 0,
                  "bulk copies move 16-byte multiples to 16-byte aligned places");
};

/* In-token byte offsets of a lane's words in half 0 (half h adds H*_STEP h): K's main word
 * (tq4: the group's 16 bytes; tq3: its 8 bytes of the 2-bit plane), K's 1-bit plane word
 * (tq3), V's main word (tq4: 8 bytes; tq3: 4 bytes of the 2-bit plane) and V's 1-bit plane word
 * (tq3), as d = 128's lane_off with tq3's 1-bit plane at D / 4 = 64. */
template <int F> struct Half256 {
    static constexpr int K_STEP = F == F_TQ4 ? 64 : 32, KH_STEP = 16;
    static constexpr int V_STEP = F == F_TQ4 ? 64 : 32, VH_STEP = 16;
    __host__ __device__ static constexpr int k(int c) { return F == F_TQ4 ? 16 * c : 8 * c; }
    __host__ __device__ static constexpr int kh(int c) { return 64 + 4 * c; }
    __host__ __device__ static constexpr int v(int g) { return F == F_TQ4 ? 8 * g : 4 * g; }
    __host__ __device__ static constexpr int vh(int g) { return 64 + 4 * (g >> 1); }
};

/* A lane's offsets: its first K token's (ktok256(0, g, 0)) and first V token's (vtok256(0, c,
 * 0)) place, stage (STAGE) or plain, plus the in-token offsets. Every load adds an immediate:
 * K (4 u + row) PAY + K_STEP h, V vtok256(u, 0, j) PAY + V_STEP h (kimm256 / vimm256). */
template <int F, bool STAGE> __host__ __device__ constexpr LaneOff lane_off256(int g, int c) {
    using G = Stg256<F>;
    using H = Half256<F>;
    const int tk = ktok256(0, g, 0), tv = vtok256(0, c, 0);
    const int bk = STAGE ? G::kpos(tk) : tk * G::PAY, bv = STAGE ? G::vpos(tv) : tv * G::PAY;
    LaneOff o = {0, 0, 0, 0};
    o.k = bk + H::k(c);
    o.kh = F == F_TQ3 ? bk + H::kh(c) : 0;
    o.v = bv + H::v(g);
    o.vh = F == F_TQ3 ? bv + H::vh(g) : 0;
    return o;
}
template <int F> __host__ __device__ constexpr int kimm256(int u, int row) { return (4 * u + row) * Fmt<F, 256>::PAY; }
template <int F> __host__ __device__ constexpr int vimm256(int u, int j) { return vtok256(u, 0, j) * Fmt<F, 256>::PAY; }

/* Orders and layout: both token orders are permutations of the tile, S's rows c, c + 4 are P's
 * slots of column c, every lane offset + immediate is the token's place (its tokens stay in one
 * copy), the copies do not overlap, and the in-token offsets cover the payload. */
template <int F> constexpr bool layout256_ok() {
    using G = Stg256<F>;
    using H = Half256<F>;
    bool sk[32] = {}, sv[32] = {};
    for (int u = 0; u < 2; u++)
        for (int g = 0; g < 8; g++)
            for (int row = 0; row < 2; row++) {
                const int t = ktok256(u, g, row), t0 = ktok256(0, g, 0);
                if (t < 0 || t >= 32 || sk[t]) return false;
                sk[t] = true;
                if (t != t0 + 4 * u + row || G::kpos(t) != G::kpos(t0) + kimm256<F>(u, row)) return false;
            }
    for (int u = 0; u < 2; u++)
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 4; j++) {
                const int t = vtok256(u, c, j), t0 = vtok256(0, c, 0);
                if (t < 0 || t >= 32 || sv[t]) return false;
                sv[t] = true;
                if (t != t0 + vtok256(u, 0, j) || G::vpos(t) != G::vpos(t0) + vimm256<F>(u, j)) return false;
            }
    for (int u = 0; u < 2; u++)
        for (int c = 0; c < 4; c++)
            for (int row = 0; row < 2; row++)
                if (ktok256(u, c, row) != vtok256(u, c, 2 * row) || ktok256(u, c + 4, row) != vtok256(u, c, 2 * row + 1))
                    return false;
    for (int t = 0; t < 32; t++) {
        if (G::kpos(t) + G::PAY > G::V_OFF || G::vpos(t) + G::PAY > G::KS_OFF) return false;
        if (t > 0 && (G::kpos(t) < G::kpos(t - 1) + G::PAY || G::vpos(t) < G::vpos(t - 1) + G::PAY)) return false;
    }
    for (int k = 0; k < G::KCH; k++)
        if (G::kpos(k * G::KCT) != k * G::KSTR) return false;
    for (int k = 0; k < G::VCH; k++)
        if (G::vpos(k * G::VCT) != G::V_OFF + k * G::VSTR) return false;
    /* in-token bytes: K (c, h) and V (g, h) cover [0, PAY) (tq3: the 1-bit plane's V word is
     * shared by the lanes g, g ^ 1) */
    int ck[128] = {}, cv[128] = {};
    for (int h = 0; h < 2; h++) {
        for (int c = 0; c < 4; c++) {
            for (int b = 0; b < (F == F_TQ4 ? 16 : 8); b++) ck[H::k(c) + H::K_STEP * h + b]++;
            for (int b = 0; F == F_TQ3 && b < 4; b++) ck[H::kh(c) + H::KH_STEP * h + b]++;
        }
        for (int g = 0; g < 8; g++) {
            for (int b = 0; b < (F == F_TQ4 ? 8 : 4); b++) cv[H::v(g) + H::V_STEP * h + b]++;
            for (int b = 0; F == F_TQ3 && (g & 1) == 0 && b < 4; b++) cv[H::vh(g) + H::VH_STEP * h + b]++;
        }
    }
    for (int b = 0; b < 128; b++)
        if (ck[b] != (b < G::PAY) || cv[b] != (b < G::PAY)) return false;
    return true;
}
static_assert(layout256_ok<F_TQ4>() && layout256_ok<F_TQ3>(), "d = 256 token orders and stage layout");

/* Bank conflicts of one warp-wide shared-memory load of W bytes per lane (4, 8 or 16) at byte
 * addresses a[lane]: the lanes are served in phases of 128 / W lanes (a quarter warp for 16
 * bytes, a half warp for 8: the model under which d = 128's measured conflicts, tq4's 2-way V
 * reads and none elsewhere, come out); the result is the most distinct 4-byte words one bank
 * serves in one phase (1: conflict free; lanes reading the same word share it). */
constexpr int lds_ways(const int (&a)[32], int W) {
    int worst = 1;
    const int per = 128 / W;
    for (int p0 = 0; p0 < 32; p0 += per)
        for (int bank = 0; bank < 32; bank++) {
            int words[32] = {}, n = 0;
            for (int l = p0; l < p0 + per; l++)
                for (int k = 0; k < W / 4; k++) {
                    const int wd = a[l] / 4 + k;
                    if (wd % 32 != bank) continue;
                    bool seen = false;
                    for (int m = 0; m < n; m++) seen = seen || words[m] == wd;
                    if (!seen) words[n++] = wd;
                }
            worst = n > worst ? n : worst;
        }
    return worst;
}
/* The worst of the kernel's staged loads of one kind: 0 K main words, 1 K 1-bit plane words
 * (tq3), 2 V main words, 3 V 1-bit plane words (tq3); every subtile, row / slot and half. */
template <int F> constexpr int stage_conflicts(int kind) {
    using H = Half256<F>;
    int worst = 1;
    for (int u = 0; u < 2; u++)
        for (int r = 0; r < (kind < 2 ? 2 : 4); r++)
            for (int h = 0; h < 2; h++) {
                int a[32] = {};
                for (int lane = 0; lane < 32; lane++) {
                    const LaneOff o = lane_off256<F, true>(lane >> 2, lane & 3);
                    a[lane] = kind == 0   ? o.k + kimm256<F>(u, r) + H::K_STEP * h
                              : kind == 1 ? o.kh + kimm256<F>(u, r) + H::KH_STEP * h
                              : kind == 2 ? o.v + vimm256<F>(u, r) + H::V_STEP * h
                                          : o.vh + vimm256<F>(u, r) + H::VH_STEP * h;
                }
                const int W = F == F_TQ4 ? (kind == 0 ? 16 : 8) : (kind == 0 ? 8 : 4);
                const int n = lds_ways(a, W);
                worst = n > worst ? n : worst;
            }
    return worst;
}
static_assert(stage_conflicts<F_TQ4>(0) == 1 && stage_conflicts<F_TQ4>(2) == 1,
              "tq4 d = 256: staged K and V reads conflict free");
static_assert(stage_conflicts<F_TQ3>(0) == 1 && stage_conflicts<F_TQ3>(1) == 2 && stage_conflicts<F_TQ3>(2) == 1 &&
                  stage_conflicts<F_TQ3>(3) == 1,
              "tq3 d = 256: staged reads conflict free but K's 1-bit plane words (2-way)");
/* fp8 (d = 128): the worst of its staged 16-byte loads, K (kind 0: rows of 32 bytes, two loads)
 * or V (kind 1: 16 bytes of each slot's token, in the stage's pieces) */
constexpr int fp8_conflicts(int kind) {
    using G = Stg<F_FP8>;
    int worst = 1;
    for (int u = 0; u < 2; u++)
        for (int r = 0; r < 4; r++) {
            int a[32] = {};
            for (int lane = 0; lane < 32; lane++) {
                const int g = lane >> 2, c = lane & 3;
                a[lane] = kind == 0 ? (16 * u + krow_tok<F_FP8>(g, r & 1)) * G::KPAY + 32 * c + 16 * (r >> 1)
                                    : G::vpos(16 * u + vcol_tok<F_FP8>(c, r)) + 16 * g;
            }
            const int n = lds_ways(a, 16);
            worst = n > worst ? n : worst;
        }
    return worst;
}
static_assert(fp8_conflicts(0) == 2 && fp8_conflicts(1) == 1,
              "fp8 staged reads: V conflict free (its pieces), K 2-way (128-byte rows, one copy)");

/* The whole warp (warp-uniform arguments, as stage_issue): ask for the d = 256 fast tile whose
 * first token in the planes is tt into the stage at dst. */
template <int F, class TOK>
__device__ __forceinline__ void stage_issue256(const Ctx &x, TOK tt, uint32_t dst, uint32_t bar, uint64_t pol) {
    using G = Stg256<F>;
    const uintptr_t ks0 = reinterpret_cast<uintptr_t>(x.ksb + tt) & ~(uintptr_t)15;
    const uintptr_t vs0 = reinterpret_cast<uintptr_t>(x.vsb + tt) & ~(uintptr_t)15;
    if (elect_one()) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* after the warp's reads of the stage */
        mbar_expect(bar, G::TX);
        const uint8_t *kp = x.kb + (size_t)tt * G::PAY, *vp = x.vb + (size_t)tt * G::PAY;
#pragma unroll
        for (int k = 0; k < G::KCH; k++) bulk_g2s(dst + k * G::KSTR, kp + k * G::KCT * G::PAY, G::KCT * G::PAY, bar, pol);
#pragma unroll
        for (int k = 0; k < G::VCH; k++)
            bulk_g2s(dst + G::V_OFF + k * G::VSTR, vp + k * G::VCT * G::PAY, G::VCT * G::PAY, bar, pol);
        bulk_g2s(dst + G::KS_OFF, reinterpret_cast<const void *>(ks0), G::SC, bar, pol);
        bulk_g2s(dst + G::VS_OFF, reinterpret_cast<const void *>(vs0), G::SC, bar, pol);
    }
}

/* A d = 256 tile's payload words for this lane, read where they are used (the whole tile in
 * registers would be 56-64 of them): from the warp's stage (GL = false; kb = vb = the stage)
 * or from global memory (GL = true, slow tiles; kb / vb: the tile's first token in the K / V
 * plane; tokens at or past lim, tile-relative, read as zero bytes). */
template <int F, bool GL> struct Tile256 {
    const char *kb, *vb;
    LaneOff o;                /* lane_off256<F, !GL> */
    int lim;
    int g, c;
    __device__ __forceinline__ bool kok(int u, int row) const { return !GL || ktok256(u, g, row) < lim; }
    __device__ __forceinline__ bool vok(int u, int j) const { return !GL || vtok256(u, c, j) < lim; }
    template <class W> __device__ __forceinline__ W ld(const char *p, bool ok) const {
        if constexpr (GL) return ok ? __ldg(reinterpret_cast<const W *>(p)) : W{};
        else return *reinterpret_cast<const W *>(p);
    }
    /* K pairs of row `row` (0: fragment row g, 1: g + 8), half h of subtile u (kdim256 pairs
     * 16 h ..) */
    __device__ __forceinline__ void deq_k(const Tab &T, int u, int row, int h, uint32_t pr[16]) const {
        using H = Half256<F>;
        const int im = kimm256<F>(u, row);
        const bool ok = kok(u, row);
        if constexpr (F == F_TQ4)
            deq_k_tq4(ld<uint4>(kb + o.k + im + H::K_STEP * h, ok), T, pr);
        else
            deq_k_tq3(ld<uint2>(kb + o.k + im + H::K_STEP * h, ok), ld<uint32_t>(kb + o.kh + im + H::KH_STEP * h, ok),
                      T, pr);
    }
    /* V^T fragments of half h of subtile u: a[i] of m-tile 8 h + i (vdim256) */
    __device__ __forceinline__ void deq_v(const Tab &T, int u, int h, uint32_t a[8][4]) const {
        using H = Half256<F>;
#pragma unroll
        for (int hp = 0; hp < 2; hp++) {      /* k slots (2c, 2c+1) or (2c+8, 2c+9): j = 2hp, 2hp+1 */
            const int j0 = 2 * hp, j1 = 2 * hp + 1;
            const int i0 = vimm256<F>(u, j0), i1 = vimm256<F>(u, j1);
            const bool ok0 = vok(u, j0), ok1 = vok(u, j1);
            if constexpr (F == F_TQ4) {
                deq_v_tq4(ld<uint2>(vb + o.v + i0 + H::V_STEP * h, ok0), ld<uint2>(vb + o.v + i1 + H::V_STEP * h, ok1),
                          T, hp, a);
            } else {
                deq_v_tq3(ld<uint32_t>(vb + o.v + i0 + H::V_STEP * h, ok0), ld<uint32_t>(vb + o.v + i1 + H::V_STEP * h, ok1),
                          ld<uint32_t>(vb + o.vh + i0 + H::VH_STEP * h, ok0),
                          ld<uint32_t>(vb + o.vh + i1 + H::VH_STEP * h, ok1), 4u * (uint32_t)(g & 1), T, hp, a);
            }
        }
    }
};

} // namespace

#endif

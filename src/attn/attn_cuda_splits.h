/*
 * attn_cuda_splits.h - how the device decode attention cuts each row into splits (work
 * items of flash decoding), for every decode kernel, and the host-side bounds on the split
 * count that size the workspace and the launch (a decode step's CUDA graph keys on them).
 * Owns: split_len / split_count (d = 128, the tensor-core split kernel), wsplit_* (d = 256,
 * the float32 kernel kept for the A/B and for the dense bf16 cache), tsplit_* (d = 256, the
 * tensor-core split kernel), split_bound / wsplit_bound.
 * Must not: depend on anything but the row's own token count (batch invariance: a row attended
 * alone is bit-identical to the same row in any batch), or let a bound stop being monotone
 * in the longest row or stop covering every row's split count.
 * C++ / CUDA only (host and device inline functions).
 */
#ifndef TQKV_ATTN_CUDA_SPLITS_H
#define TQKV_ATTN_CUDA_SPLITS_H

// ---------------------------------------------------------------------------
// d = 128, the tensor-core split kernel (attn_cuda.cu)
// ---------------------------------------------------------------------------
__host__ __device__ inline int split_len(int ntok) {
    int s = (ntok + 31) / 32;                 /* aim at <= 32 splits per (row, head) */
    s = (s + 255) / 256 * 256;                /* multiple of 256 tokens */
    return s < 256 ? 256 : s;
}
__host__ __device__ inline int split_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + split_len(ntok) - 1) / split_len(ntok);
}
/* The split stride for rows of at most n tokens: >= split_count(m) for every m <= n
 * (split_count(m) = ceil(m / 256) up to 8192 tokens, then at most 32), and monotone in n,
 * so the workspace and the launch only change when it does (CUDA graphs key on it). */
constexpr int split_bound(int n) {
    const int s = (n + 255) / 256;
    return s < 1 ? 1 : s > 32 ? 32 : s;
}

// ---------------------------------------------------------------------------
// d = 256, the float32 split kernel (attn_cuda_wide.cu, wdec_kernel)
// ---------------------------------------------------------------------------
/* A quarter of the d = 128 rule's length, i.e. 64 ceil(ceil(ntok / 32) / 256): 64 tokens up
 * to 8192, then at most 128 splits. */
__host__ __device__ inline int wsplit_len(int ntok) {
    const int s = ((ntok + 31) / 32 + 255) / 256;
    return s < 1 ? 64 : 64 * s;
}
__host__ __device__ inline int wsplit_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + wsplit_len(ntok) - 1) / wsplit_len(ntok);
}

// ---------------------------------------------------------------------------
// d = 256, the tensor-core split kernel (attn_cuda_wide.cu, split_kernel<F, NG, ST, 256>)
// ---------------------------------------------------------------------------
/* max(TC256_MIN, roundup(ceil(ntok / TC256_SPLITS), TC256_MIN)) tokens: with the defaults,
 * 128-token splits (one 32-token tile per warp of a group) up to 4096 tokens, then at most 32
 * splits. A d = 256 token costs a warp about twice a d = 128 one, so a 128-token item is
 * about the work of d = 128's shortest (256 tokens). The knobs are compile-time for A/B runs
 * (-DCMAKE_CUDA_FLAGS=-DTQKV_TC256_SPLIT_MIN=256); both must keep the workspace bound below:
 * tsplit_count(m) <= min(TC256_SPLITS, ceil(m / TC256_MIN)) <= min(128, 4 ceil(m / 256))
 * = wsplit_bound(m) for TC256_MIN >= 64 and TC256_SPLITS <= 128. */
#ifndef TQKV_TC256_SPLIT_MIN
#define TQKV_TC256_SPLIT_MIN 128
#endif
#ifndef TQKV_TC256_SPLITS
#define TQKV_TC256_SPLITS 32
#endif
static_assert(TQKV_TC256_SPLIT_MIN % 32 == 0 && TQKV_TC256_SPLIT_MIN >= 64,
              "d = 256 splits are whole 32-token tiles, at least 64 tokens (the workspace bound)");
static_assert(TQKV_TC256_SPLITS >= 1 && TQKV_TC256_SPLITS <= 128, "at most wsplit_bound's 128 splits");
__host__ __device__ constexpr int tsplit_len(int ntok) {
    constexpr int MIN = TQKV_TC256_SPLIT_MIN;
    int s = (ntok + TQKV_TC256_SPLITS - 1) / TQKV_TC256_SPLITS;
    s = (s + MIN - 1) / MIN * MIN;
    return s < MIN ? MIN : s;
}
__host__ __device__ constexpr int tsplit_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + tsplit_len(ntok) - 1) / tsplit_len(ntok);
}

/* The split stride of both d = 256 kernels for rows of at most n tokens: 4 x the d = 128
 * bound (split_bound: min(32, max(1, ceil(n / 256)))). wsplit_count(m) <= 4 split_count(m)
 * <= 4 split_bound(n) and tsplit_count(m) <= wsplit_bound(n) (above) for m <= n. A strictly
 * increasing function of the d = 128 bound, so tqkv_cuda_attend_ws_bytes_dim at 256 changes
 * exactly where the d = 128 figure does: a graph key taking the larger of both (a model with
 * layers of both dims) changes whenever either launch shape does. */
constexpr int wsplit_bound(int n) { return 4 * split_bound(n); }

/* tsplit's rule against the bound, for every length up to 20000 and a sample beyond: whole
 * tiles, the splits cover the row exactly, and at most wsplit_bound of them. */
constexpr bool tsplit_ok(int n) {
    const int len = tsplit_len(n), cnt = tsplit_count(n);
    return len % 32 == 0 && cnt * len >= n && (cnt - 1) * len < n && cnt <= wsplit_bound(n);
}
constexpr bool tsplit_all_ok() {
    for (int n = 1; n <= 20000; n++)
        if (!tsplit_ok(n)) return false;
    for (int n = 20001; n < (1 << 24); n += 8191)
        if (!tsplit_ok(n)) return false;
    return true;
}
static_assert(tsplit_all_ok(), "the d = 256 tensor-core splits fit the workspace bound");

#endif

/*
 * codec_cuda.cu - GPU encode of the cache formats (the CUDA backend's append).
 * Owns: one launch for both planes of an append, one warp per vector (d = 128 or 256, a
 * template): sign flip + Walsh-Hadamard rotation, the tq2/3/4 quantizer with the
 * norm-corrected fp16 scale, bit packing into the planes of docs/FORMATS.md, and the q8 copy
 * of the rotated vector into the recent-window ring; the bf16 baseline's plain conversion. Bytes equal codec_encode's (same float64 norm
 * order, same comparisons, same rounding): tests/test_cuda.c compares every byte.
 * The per-vector encode (ce_encode_vec) is in codec_cuda_encode.cuh, shared with kernels
 * that encode K and V where they compute them.
 * Must not: run attention, decide row state or know the cache's structs (cache_cuda.cu
 *   fills the kernel's parameters and calls codec_cuda_encode).
 */
#include <cuda_bf16.h>
#include <math.h>

#include "codec/codec_cuda.cuh"
#include "codec/codec_cuda_encode.cuh"
#include "codec/codec_cuda_params.h"
#include "util/cuda_pdl.cuh"

constexpr int CE_WARPS = 4;      /* warps (vectors in flight) per block */

// ---------------------------------------------------------------------------
// Encode kernel: K and V in one launch, one warp per vector (codec_cuda_encode.cuh's
// ce_encode_vec, and the q8 copy)
// ---------------------------------------------------------------------------
/* The q8 copy (ggml q8_0 on 32-value blocks) of the rotated vector xr into wq [D] and its
 * block scales ws [D / 32]. */
template <int D>
__device__ static void ce_q8_store(const float (&xr)[D / 32], int8_t *wq, uint16_t *ws, int lane) {
    constexpr int E = D / 32, LB = 32 / E;   /* LB: lanes per 32-value block (8 or 4) */
    float am = 0.0f;
#pragma unroll
    for (int j = 0; j < E; j += 4) { /* (d = 128: the one tree of four) */
        const float a4 = fmaxf(fmaxf(fabsf(xr[j]), fabsf(xr[j + 1])),
                               fmaxf(fabsf(xr[j + 2]), fabsf(xr[j + 3])));
        am = j ? fmaxf(am, a4) : a4;
    }
#pragma unroll
    for (int m = 1; m < LB; m <<= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, m));
    const float dq = __fdiv_rn(am, 127.0f);
#pragma unroll
    for (int k = 0; k < E; k++) {
        double q = dq != 0.0f ? (double)xr[k] / (double)dq : 0.0;
        if (q != q) q = 0.0;
        q = q < -127.0 ? -127.0 : q > 127.0 ? 127.0 : q;
        wq[E * lane + k] = (int8_t)ce_round_half_away(q);
    }
    if ((lane & (LB - 1)) == 0) ws[lane >> (E == 4 ? 3 : 2)] = cw_f32_to_f16(dq);
}

/* Warp w of 2 * rows * kvh * n * A.roles: vector w / roles, role w % roles (0: the tq part or
 * the bf16 conversion; 1: the q8 copy into the ring or side buffer, on a warp of its own so
 * that it runs beside the tq part's float64 sums; roles = 2 only with a window). Vector u:
 * plane u / (rows kvh n) (0 = K), then (r, h, i) of that plane's x [rows, kvh, n, D];
 * grid-stride. Lane l holds elements E l .. E l + E - 1 (E = D / 32). */
template <int D> __global__ void __launch_bounds__(32 * CE_WARPS) ce_encode_kernel(const ce_args A) {
    constexpr int E = D / 32;
    static_assert(E == 4 || E == 8, "d = 128 or 256");
    __shared__ double s_t[CE_WARPS][D];
    __shared__ uint8_t s_idx[CE_WARPS][D];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    cuda_pdl_wait(); /* programmatic: the kernel that wrote k and v has completed */
    cuda_pdl_trigger();
    const unsigned n = (unsigned)A.n, kvh = (unsigned)A.kvh, roles = (unsigned)A.roles;
    const unsigned vecs = (unsigned)A.nrows * kvh * n;  /* per plane (the launcher checks 2 vecs roles < 2^31) */
    const float cl0 = A.C[0].cent[lane & 15], cl1 = A.C[1].cent[lane & 15];
    for (unsigned w = blockIdx.x * CE_WARPS + wib; w < 2 * vecs * roles; w += gridDim.x * CE_WARPS) {
        const unsigned u = roles == 2 ? w >> 1 : w, role = roles == 2 ? w & 1 : 0;
        const int p = u >= vecs;
        const unsigned v = u - (p ? vecs : 0);
        const ce_plane &P = A.P[p];
        const ce_codec &C = A.C[p];
        const int i = (int)(v % n);
        const int h = (int)((v / n) % kvh);
        const int r = (int)(v / (n * kvh));
        /* only the newest `ring` tokens of this append land in the ring (several tokens
         * share a slot otherwise); the older ones go to the side buffer when it is on */
        const int ring = A.ring;
        const bool to_ring = P.win && i >= (int)n - ring, to_ext = P.win && P.ext && i < (int)n - ring;
        if (role == 1 && !to_ring && !to_ext) continue;
        const cuda_row rw = A.rows[r];
        float xr[E];
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
            const float4 in = reinterpret_cast<const float4 *>(A.x[p] + (size_t)v * D)[(E / 4) * lane + j];
            xr[4 * j] = in.x; xr[4 * j + 1] = in.y; xr[4 * j + 2] = in.z; xr[4 * j + 3] = in.w;
        }
        const size_t slot = ((size_t)r * kvh + h) * A.cap + (size_t)(rw.col0 + i);
        if (role == 0) {
            ce_encode_vec<D>(P, C, p ? cl1 : cl0, slot, xr, s_t[wib], s_idx[wib], lane);
            continue;
        }
        /* role 1, the q8 copy (roles = 2: a window; the bf16 baseline has none) */
        if (P.bf16) continue;
        ce_rotate<D>(C, xr, lane);
        const size_t ws = to_ring ? ((size_t)r * kvh + h) * ring + (size_t)((rw.ntok + i) % ring)
                                  : ((size_t)r * kvh + h) * P.xcap + (size_t)(rw.ntok + i - P.xlo[r]);
        ce_q8_store<D>(xr, (to_ring ? P.win : P.ext) + ws * D, (to_ring ? P.wsc : P.exs) + ws * (D / 32),
                       lane);
    }
}

// ---------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------
template <class CC> static void ce_codec_from(const CC &c, int d, ce_codec *o) {
    for (int i = 0; i < 16; i++) o->cent[i] = c.cent[i];
    for (int i = 0; i < 15; i++) o->bounds[i] = c.bounds[i];
    for (int w = 0; w < CUDA_DIM_WIDE / 32; w++) o->sbits[w] = 0;
    for (int i = 0; i < d; i++) o->sbits[i >> 5] |= (uint32_t)(c.signs[i] < 0.0f) << (i & 31);
    o->inv = c.inv;
    o->bits = c.bits;
}

void codec_cuda_encode_args(const float *k, const float *v, const ce_plane P[2],
                            const cuda_codec &k128, const cuda_codec &v128,
                            const cuda_codec256 &k256, const cuda_codec256 &v256, int d,
                            const cuda_row *rows, int nrows, int kvh, int n, int cap, int ring,
                            ce_args *out) {
    ce_args &A = *out;
    A.x[0] = k;
    A.x[1] = v;
    A.P[0] = P[0];
    A.P[1] = P[1];
    if (d == CUDA_DIM) {
        ce_codec_from(k128, d, &A.C[0]);
        ce_codec_from(v128, d, &A.C[1]);
    } else {
        ce_codec_from(k256, d, &A.C[0]);
        ce_codec_from(v256, d, &A.C[1]);
    }
    A.rows = rows;
    A.nrows = nrows;
    A.kvh = kvh;
    A.n = n;
    A.cap = cap;
    A.ring = ring;
    A.roles = P[0].win || P[1].win ? 2 : 1;
}

cudaError_t codec_cuda_encode(const float *k, const float *v, const ce_plane P[2],
                              const cuda_codec &k128, const cuda_codec &v128,
                              const cuda_codec256 &k256, const cuda_codec256 &v256, int d,
                              const cuda_row *rows, int nrows, int kvh, int n, int cap, int ring,
                              int pdl, cudaStream_t stream) {
    ce_args A;
    codec_cuda_encode_args(k, v, P, k128, v128, k256, v256, d, rows, nrows, kvh, n, cap, ring, &A);
    const long long warps = 2 * (long long)nrows * kvh * n * A.roles;
    if (warps >= (1ll << 31)) return cudaErrorInvalidValue;  /* (the kernel counts warps in 32 bits) */
    const long long want = (warps + CE_WARPS - 1) / CE_WARPS;
    const int blocks = (int)(want < 65536 * 4 ? want : 65536 * 4);
    if (d == CUDA_DIM) cuda_pdl_launch(pdl, ce_encode_kernel<CUDA_DIM>, dim3(blocks), dim3(32 * CE_WARPS), 0, stream, A);
    else cuda_pdl_launch(pdl, ce_encode_kernel<CUDA_DIM_WIDE>, dim3(blocks), dim3(32 * CE_WARPS), 0, stream, A);
    return cudaGetLastError();
}

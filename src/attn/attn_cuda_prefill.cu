/*
 * attn_cuda_prefill.cu - attention of several queries per row (prefill, chunked prefill,
 * speculative verify) over the device cache, with per-(row, query) visible ranges (the
 * tqkv_mask of the CPU: left padding, causal, sliding window); and decode attention at
 * head_dim 256.
 * Owns: a float32 kernel: one CTA per (row, kv head, block of QB queries); tiles of KT
 * tokens are decoded once into shared memory in the stored (rotated) domain and used by all
 * G x QB query vectors of the block (query rotated once, output un-rotated once); online
 * softmax per query vector in a fixed token order.
 * At D = 256 also the decode attention (cuda_attend_decode_wide, one query per row): split-KV
 * in float32, one CTA per (row, kv head, split) over a split length that depends on the
 * row's own length only, partials (max, sum, rotated-domain output) in the caller's
 * workspace, then a merge per (row, q head) in split order that divides by the sum and
 * un-rotates once. The same kernels read the dense bf16 baseline (not rotated: the queries
 * are only scaled and the merge does not un-rotate; no scales, no q8 window). Each row's length comes from the device row table and the host uses
 * only an upper bound on the split count (folded into tqkv_cuda_attend_ws_bytes_dim), so
 * nothing is allocated or waited for and a CUDA graph replay follows the appends.
 * Must not: mutate the cache; let a query's output depend on anything but its own row and
 * range (a tile a query cannot see leaves it unchanged).
 * Templated on the head_dim D (128, 256).
 * Not tuned: plain FMA, no tensor cores (decode at d = 128, n_query == 1, is attn_cuda.cu).
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include <vector>

extern "C" {
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"

namespace {

constexpr int KT = 32;                 /* tokens per tile */
constexpr int QB = 4;                  /* queries per CTA (x G heads = query vectors) */
constexpr int NT = 256;                /* threads per CTA */
constexpr float LOG2E = 1.4426950408889634f;

template <int D> struct PParams {
    const uint8_t *kd, *vd;
    const uint16_t *ks, *vs;
    const int8_t *kw, *vw;
    const uint16_t *kws, *vws;
    size_t kpay, vpay;
    int ring, cap, kvh, G, qh, nq, bf16;
    const cuda_row *rows;
    const int *lo, *hi;                /* [rows, nq] visible tokens [lo, hi); NULL: every
                                        * token the row holds (nq == 1; the d = 256 decode
                                        * was this before its split kernel, unused now) */
    const float *q;                    /* [rows, qh, nq, D] prepared (rotated, scaled) */
    float *out;                        /* [rows, qh, nq, D] (V domain; un-rotated later) */
    typename cuda_codec_of<D>::type kc, vc;
};

/* Dynamic shared memory of prefill_kernel<D>: K and V tiles [KT][D + 1] (padded rows:
 * conflict-free column reads), the block's query vectors [QB * CUDA_MAX_G][D]. */
template <int D> constexpr int prefill_smem() { return (2 * KT * (D + 1) + QB * CUDA_MAX_G * D) * (int)sizeof(float); }
static_assert(prefill_smem<CUDA_DIM_WIDE>() <= 227 * 1024, "the d = 256 tiles fit an SM");

/* Value of element i of token t (row r, head h) of one plane in the stored domain, its
 * per-token scale applied; q8 window tokens when t >= wstart. */
template <int D>
__device__ float elem(const uint8_t *data, const uint16_t *sc, const int8_t *win, const uint16_t *wsc,
                      size_t pay, int bits, const float *cent, int bf16, size_t col, size_t wslot, bool w, int i) {
    if (w) return (float)win[wslot * D + i] * __half2float(__ushort_as_half(wsc[wslot * (D / 32) + i / 32]));
    const uint8_t *p = data + col * pay;
    if (bf16) return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(p)[i] << 16);
    const int g = i >> 5, j = i & 31;
    int idx;
    if (bits == 4) idx = (p[16 * g + (j & 15)] >> (4 * (j >> 4))) & 15;
    else {
        idx = (p[8 * g + (j & 7)] >> (2 * (j >> 3))) & 3;
        if (bits == 3) idx |= ((p[D / 4 + 4 * g + (j >> 3)] >> (j & 7)) & 1) << 2;
    }
    return cent[idx] * __half2float(__ushort_as_half(sc[col]));
}

template <int D>
__global__ void __launch_bounds__(NT) prefill_kernel(const PParams<D> P) {
    constexpr int DP = D + 1;          /* padded smem row */
    constexpr int E = D / 32;          /* dims per lane: E l .. E l + E - 1 */
    extern __shared__ float sm[];
    float *sk = sm;                    /* [KT][DP] */
    float *sv = sk + KT * DP;          /* [KT][DP] */
    float *sq = sv + KT * DP;          /* [QB * G][D] query vectors of the block */
    const int r = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * QB;
    const int G = P.G, nv = QB * G;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const cuda_row row = P.rows[r];
    const size_t rh = (size_t)r * P.kvh + h;
    const bool full = P.lo == nullptr; /* decode: [0, ntok) from the device row table */
    // ---- the block's visible token range -------------------------------------------
    int tlo = 1 << 30, thi = 0;
    if (full) {
        if (row.ntok > 0) { tlo = 0; thi = row.ntok; }
    } else {
        for (int i = 0; i < QB && q0 + i < P.nq; i++) {
            const int lo = P.lo[(size_t)r * P.nq + q0 + i], hi = P.hi[(size_t)r * P.nq + q0 + i];
            if (lo < hi) { tlo = min(tlo, lo); thi = max(thi, hi); }
        }
    }
    // ---- queries into shared memory: vector v = (head gg, query i) -> v = i * G + gg ----
    for (int e = threadIdx.x; e < nv * D; e += NT) {
        const int v = e / D, d = e % D, i = v / G, gg = v % G;
        sq[e] = q0 + i < P.nq ? P.q[(((size_t)r * P.qh + (size_t)h * G + gg) * P.nq + q0 + i) * D + d] : 0.0f;
    }
    // each warp owns query vectors v = w, w + 8, ...; per vector: m, l, acc (lane: dims E l..)
    constexpr int MAXV = CUDA_MAX_G * QB / (NT / 32);
    float m[MAXV], l[MAXV], acc[MAXV][E];
    int vlo[MAXV], vhi[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        m[k] = -INFINITY; l[k] = 0.0f;
#pragma unroll
        for (int c = 0; c < E; c++) acc[k][c] = 0.0f;
        const int v = w + k * (NT / 32), i = v / G;
        vlo[k] = vhi[k] = 0;
        if (v < nv && q0 + i < P.nq) {
            vlo[k] = full ? 0 : P.lo[(size_t)r * P.nq + q0 + i];
            vhi[k] = full ? row.ntok : P.hi[(size_t)r * P.nq + q0 + i];
        }
    }
    for (int t0 = tlo; t0 < thi; t0 += KT) {
        __syncthreads();   /* previous tile fully used (and sq written) */
        for (int e = threadIdx.x; e < KT * D; e += NT) {
            const int tt = e / D, i = e % D, t = t0 + tt;
            float kvv = 0.0f, vvv = 0.0f;
            if (t < thi && t < row.ntok) {
                const bool win = t >= row.wstart;
                const size_t col = rh * P.cap + (size_t)(row.left_pad + t);
                const size_t ws = win ? rh * P.ring + (size_t)(t % P.ring) : 0;
                kvv = elem<D>(P.kd, P.ks, P.kw, P.kws, P.kpay, P.kc.bits, P.kc.cent, P.bf16, col, ws, win, i);
                vvv = elem<D>(P.vd, P.vs, P.vw, P.vws, P.vpay, P.vc.bits, P.vc.cent, P.bf16, col, ws, win, i);
            }
            sk[tt * DP + i] = kvv;
            sv[tt * DP + i] = vvv;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < MAXV; k++) {
            const int v = w + k * (NT / 32);
            if (v >= nv || vlo[k] >= vhi[k] || t0 >= vhi[k] || t0 + KT <= vlo[k]) continue;
            const float *qv = sq + v * D;
            const int t = t0 + lane;   /* KT == 32: one token per lane */
            float s = 0.0f;
            for (int d = 0; d < D; d++) s = fmaf(qv[d], sk[lane * DP + d], s);
            const bool vis = t >= vlo[k] && t < vhi[k];
            s = vis ? s : -INFINITY;
            float mx = s;
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[k], mx);          /* finite: the tile has a visible token */
            const float al = exp2f(m[k] - mn);
            const float p = vis ? exp2f(s - mn) : 0.0f;
            float ps = p;
            for (int o = 16; o; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[k] = l[k] * al + ps;
            m[k] = mn;
#pragma unroll
            for (int c = 0; c < E; c++) acc[k][c] *= al;
            for (int tt = 0; tt < KT; tt++) {
                const float pt = __shfl_sync(0xffffffffu, p, tt);
                const float *vr = sv + tt * DP + E * lane;
#pragma unroll
                for (int c = 0; c < E; c++) acc[k][c] = fmaf(pt, vr[c], acc[k][c]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        const int v = w + k * (NT / 32), i = v / G, gg = v % G;
        if (v >= nv || q0 + i >= P.nq) continue;
        const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
        float o[E];
#pragma unroll
        for (int c = 0; c < E; c++) o[c] = acc[k][c] * inv;
        if (!P.bf16) {
            float sg[E];
#pragma unroll
            for (int c = 0; c < E; c++) sg[c] = P.vc.signs[E * lane + c];
            cw_unrotate_n<E>(o, sg, P.vc.inv, lane);
        }
        float *op = P.out + (((size_t)r * P.qh + (size_t)h * G + gg) * P.nq + q0 + i) * D + E * lane;
#pragma unroll
        for (int c = 0; c < E; c++) op[c] = o[c];
    }
}

/* q [rows, qh, nq, D] -> rotated (K codec) and scaled by scale * log2(e), float. */
template <int D>
__global__ void pqprep_kernel(const float *__restrict__ q, float *__restrict__ out,
                              typename cuda_codec_of<D>::type C, int rotate, float mul, int n) {
    constexpr int E = D / 32;
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    float x[E];
#pragma unroll
    for (int j = 0; j < E / 4; j++) {
        const float4 in = reinterpret_cast<const float4 *>(q + (size_t)v * D + E * lane)[j];
        x[4 * j] = in.x; x[4 * j + 1] = in.y; x[4 * j + 2] = in.z; x[4 * j + 3] = in.w;
    }
    if (rotate) {
        float s[E];
#pragma unroll
        for (int k = 0; k < E; k++) s[k] = C.signs[E * lane + k];
        cw_rotate_n<E>(x, s, C.inv, lane);
    }
#pragma unroll
    for (int j = 0; j < E / 4; j++)
        reinterpret_cast<float4 *>(out + (size_t)v * D + E * lane)[j] =
            make_float4(x[4 * j] * mul, x[4 * j + 1] * mul, x[4 * j + 2] * mul, x[4 * j + 3] * mul);
}

/* The kernels' arguments for kv (lo, hi: device ranges or NULL for whole rows). */
template <int D>
PParams<D> make_params(const cuda_kv *kv, int q_heads, int n_query, const int *lo, const int *hi,
                       const float *qp, float *out, const typename cuda_codec_of<D>::type &kc,
                       const typename cuda_codec_of<D>::type &vc) {
    PParams<D> P;
    P.kd = kv->kd; P.vd = kv->vd; P.ks = kv->ks; P.vs = kv->vs;
    P.kw = kv->kw; P.vw = kv->vw; P.kws = kv->kws; P.vws = kv->vws;
    P.kpay = kv->kpay; P.vpay = kv->vpay; P.ring = kv->ring > 0 ? kv->ring : 1; P.cap = kv->cap;
    P.kvh = kv->kvh; P.G = q_heads / kv->kvh; P.qh = q_heads; P.nq = n_query; P.bf16 = kv->bf16;
    P.rows = kv->d_rows; P.lo = lo; P.hi = hi; P.q = qp; P.out = out; P.kc = kc; P.vc = vc;
    return P;
}

/* Query preparation and the masked kernel on kv->stream (qp: [rows, q_heads, n_query, D]
 * scratch); asynchronous. */
template <int D>
tqkv_status launch(const cuda_kv *kv, const float *q, int n_query, int q_heads, float scale,
                   const int *lo, const int *hi, float *qp, float *out,
                   const typename cuda_codec_of<D>::type &kc, const typename cuda_codec_of<D>::type &vc) {
    const size_t nv = (size_t)kv->rows * q_heads * n_query;
    pqprep_kernel<D><<<(unsigned)((nv + 3) / 4), 128, 0, kv->stream>>>(q, qp, kc, !kv->bf16, scale * LOG2E, (int)nv);
    const PParams<D> P = make_params<D>(kv, q_heads, n_query, lo, hi, qp, out, kc, vc);
    const dim3 grid((unsigned)((n_query + QB - 1) / QB), (unsigned)kv->kvh, (unsigned)kv->rows);
    prefill_kernel<D><<<grid, NT, prefill_smem<D>(), kv->stream>>>(P);
    return cuda_check(cudaGetLastError(), "prefill kernel launch");
}

tqkv_status launch_dim(const cuda_kv *kv, const float *q, int n_query, int q_heads, float scale,
                       const int *lo, const int *hi, float *qp, float *out) {
    if (kv->d == CUDA_DIM) return launch<CUDA_DIM>(kv, q, n_query, q_heads, scale, lo, hi, qp, out, kv->kc, kv->vc);
    return launch<CUDA_DIM_WIDE>(kv, q, n_query, q_heads, scale, lo, hi, qp, out, kv->kc256, kv->vc256);
}

// ---------------------------------------------------------------------------
// Decode attention at d = 256: split-KV (flash decoding) in float32
// ---------------------------------------------------------------------------
constexpr int WD = CUDA_DIM_WIDE;
constexpr int WNW = 4;                 /* warps per CTA (one CTA per work item) */

/* A row's split length: a quarter of the d = 128 split kernel's (attn_cuda.cu split_len:
 * max(256, roundup(ceil(ntok / 32), 256))), i.e. 64 ceil(ceil(ntok / 32) / 256): 64 tokens
 * up to 8192, then at most 128 splits. A function of the row's own length only (batch
 * invariance). */
__host__ __device__ inline int wsplit_len(int ntok) {
    const int s = ((ntok + 31) / 32 + 255) / 256;
    return s < 1 ? 64 : 64 * s;
}
__host__ __device__ inline int wsplit_count(int ntok) {
    return ntok <= 0 ? 0 : (ntok + wsplit_len(ntok) - 1) / wsplit_len(ntok);
}
/* The split stride for rows of at most n tokens: 4 x the d = 128 bound (attn_cuda.cu
 * split_bound: min(32, max(1, ceil(n / 256)))). wsplit_count(m) <= 4 split_count128(m) <=
 * 4 split_bound128(n) for m <= n. A strictly increasing function of the d = 128 bound, so
 * tqkv_cuda_attend_ws_bytes_dim at 256 changes exactly where the d = 128 figure does: a
 * graph key taking the larger of both (a model with layers of both dims) changes whenever
 * either launch shape does. */
inline int wsplit_bound(int n) {
    const int s = (n + 255) / 256;
    return 4 * (s < 1 ? 1 : s > 32 ? 32 : s);
}

/* Workspace for nv query vectors and nsmax splits: partial outputs [nv, nsmax, 256] f32,
 * (max, sum) [nv, nsmax] float2, prepared queries [nv, 256] f32. */
size_t wide_ws(size_t nv, int nsmax, size_t *po_b, size_t *pml_b) {
    *po_b = nv * (size_t)nsmax * WD * sizeof(float);
    *pml_b = (nv * (size_t)nsmax * sizeof(float2) + 255) / 256 * 256; /* the queries after it: 16-byte loads */
    return *po_b + *pml_b + nv * WD * sizeof(float) + 256;
}

struct WParams {
    const uint8_t *kd, *vd;            /* [rows, kvh, cap, pay] (bf16: [.., 256] bf16) */
    const uint16_t *ks, *vs;           /* [rows, kvh, cap] fp16 (bf16: NULL) */
    const int8_t *kw, *vw;             /* [rows, kvh, ring, 256] q8 window */
    const uint16_t *kws, *vws;         /* [rows, kvh, ring, 8] fp16 block scales */
    const cuda_row *rows;              /* [rows] */
    const float *q;                    /* [rows, qh, 256] rotated (tq), scaled by scale * log2(e) */
    float *po;                         /* [rows * qh, nsmax, 256] partial outputs (V domain) */
    float2 *pml;                       /* [rows * qh, nsmax] (running max, sum) */
    float kcent[16], vcent[16];        /* codebooks (ascending) */
    int pay, ring, cap, kvh, G, qh, nsmax;
};

/* The 8 values of lane l (dims 8 l .. 8 l + 7) of one token, before its scale: tq (B bits)
 * from the 8 payload bytes the lane loaded (raw) and, for tq3, its byte of the 1-bit plane
 * (hb); q8 from the lane's 8 window bytes. Payload layout (codec.h): dim 32 g + j has its
 * tq4 nibble j >> 4 in byte 16 g + (j & 15); its tq3 2-bit field j >> 3 in byte 8 g + (j & 7)
 * and its high bit j & 7 in byte D / 4 + 4 g + (j >> 3). */
template <int B>
__device__ __forceinline__ void wdec_tq(uint2 raw, uint32_t hb, int sh, const float *cent, float (&x)[8]) {
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const uint32_t by = ((c < 4 ? raw.x : raw.y) >> (8 * (c & 3))) & 0xFFu;
        const uint32_t idx = B == 4 ? (by >> sh) & 15u : ((by >> sh) & 3u) | (((hb >> c) & 1u) << 2);
        x[c] = cent[idx];
    }
}
__device__ __forceinline__ void wdec_q8(uint2 raw, float (&x)[8]) {
#pragma unroll
    for (int c = 0; c < 8; c++) x[c] = (float)(int8_t)(((c < 4 ? raw.x : raw.y) >> (8 * (c & 3))) & 0xFFu);
}
/* bf16: the lane's 8 values (dims 8 l .. 8 l + 7, little endian pairs), exact in float. */
__device__ __forceinline__ void wdec_bf16(uint2 lo, uint2 hi, float (&x)[8]) {
    const uint32_t w[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
    for (int c = 0; c < 4; c++) {
        x[2 * c] = __uint_as_float(w[c] << 16);
        x[2 * c + 1] = __uint_as_float(w[c] & 0xFFFF0000u);
    }
}

/* The bits argument B of the decode kernels for the dense bf16 baseline. */
constexpr int WB_BF16 = 16;

/* One token's raw bytes for lane l: main plane (tq, bf16) or q8 window. */
struct WRaw {
    uint2 w;                           /* 8 payload / window bytes (bf16: dims 8 l .. + 3) */
    uint2 w2;                          /* bf16: dims 8 l + 4 .. 8 l + 7 */
    uint32_t hb;                       /* tq3: the lane's 1-bit plane byte */
    float sc;                          /* tq: the token's scale; q8: its block scale; bf16: 1 */
    bool win;
};

template <int B>
__device__ __forceinline__ WRaw wload(const uint8_t *base, const uint16_t *sc, const int8_t *wv, const uint16_t *wsc,
                                      int pay, int off, int lane, int t, bool win, size_t slot) {
    WRaw x;
    x.win = win;
    x.hb = 0;
    x.w2 = make_uint2(0, 0);
    if constexpr (B == WB_BF16) { /* 16 bytes per lane, no scale (win is false: no ring) */
        const uint4 u = __ldg(reinterpret_cast<const uint4 *>(base + (size_t)t * pay) + lane);
        x.w = make_uint2(u.x, u.y);
        x.w2 = make_uint2(u.z, u.w);
        x.sc = 1.0f;
    } else if (win) {
        x.w = __ldg(reinterpret_cast<const uint2 *>(wv + slot * WD) + lane);
        x.sc = __half2float(__ushort_as_half(__ldg(wsc + slot * (WD / 32) + (lane >> 2))));
    } else {
        const uint8_t *p = base + (size_t)t * pay;
        x.w = __ldg(reinterpret_cast<const uint2 *>(p + off));
        if (B == 3) x.hb = __ldg(p + WD / 4 + lane);
        x.sc = __half2float(__ushort_as_half(__ldg(sc + t)));
    }
    return x;
}

/* Work item (row blockIdx.z, kv head blockIdx.y, split blockIdx.x); items past the row's
 * split count exit. B: 4 / 3 (tq bits) or WB_BF16 (the dense bf16 cache: the values as
 * stored, scale 1, no q8 window). Warp w takes the split's tokens in runs of U: a + U w + U WNW k ..; lane
 * l holds dims 8 l .. 8 l + 7 of the G query heads (MG slots: G rounded up to 2, 4, 8), their
 * running max / sum / output (float32, base-2 online softmax). The warps' partials merge
 * in warp order through shared memory; the item writes (max, sum, output) per q head. */
template <int B, int MG>
__global__ void __launch_bounds__(WNW * 32) wdec_kernel(const WParams P) {
    constexpr int U = MG >= 8 ? 2 : 4;           /* tokens per warp step (registers at G 8) */
    __shared__ float s_cent[2][16];
    __shared__ float2 s_ml[WNW][MG];
    __shared__ __align__(16) float s_acc[WNW][MG][WD];
    const int sp = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const cuda_row row = P.rows[r];
    const int ntok = row.ntok;
    if (sp >= wsplit_count(ntok)) return;       /* the whole CTA, before any barrier */
    const int seg = wsplit_len(ntok), a = sp * seg, z = min(ntok, a + seg);
    if (threadIdx.x < 32) s_cent[threadIdx.x >> 4][threadIdx.x & 15] =
        threadIdx.x < 16 ? P.kcent[threadIdx.x] : P.vcent[threadIdx.x - 16];
    const int G = P.G;
    const size_t rh = (size_t)r * P.kvh + h, v0 = (size_t)r * P.qh + (size_t)h * G;
    float q[MG][8], acc[MG][8], m[MG], l[MG];
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
        float4 x0 = make_float4(0, 0, 0, 0), x1 = x0;
        if (hd < G) {
            const float4 *qp = reinterpret_cast<const float4 *>(P.q + (v0 + hd) * WD + 8 * lane);
            x0 = qp[0];
            x1 = qp[1];
        }
        q[hd][0] = x0.x; q[hd][1] = x0.y; q[hd][2] = x0.z; q[hd][3] = x0.w;
        q[hd][4] = x1.x; q[hd][5] = x1.y; q[hd][6] = x1.z; q[hd][7] = x1.w;
        m[hd] = -INFINITY;
        l[hd] = 0.0f;
#pragma unroll
        for (int c = 0; c < 8; c++) acc[hd][c] = 0.0f;
    }
    /* the lane's payload bytes: tq4 dims 8 l .. 8 l + 7 are nibble (l >> 1) & 1 of bytes
     * 16 (l >> 2) + 8 (l & 1) ..; tq3 2-bit field l & 3 of bytes 8 (l >> 2) .., high bits in
     * byte D / 4 + l */
    const int off = B == 4 ? 16 * (lane >> 2) + 8 * (lane & 1) : 8 * (lane >> 2);
    const int sh = B == 4 ? 4 * ((lane >> 1) & 1) : 2 * (lane & 3);
    const size_t col0 = rh * P.cap + (size_t)row.left_pad;
    const uint8_t *kb = P.kd + col0 * P.pay, *vb = P.vd + col0 * P.pay;
    const uint16_t *ksb = B == WB_BF16 ? P.ks : P.ks + col0,
                   *vsb = B == WB_BF16 ? P.vs : P.vs + col0;
    const size_t ring0 = rh * P.ring;
    __syncthreads();                             /* s_cent */
    for (int t0 = a + U * w; t0 < z; t0 += U * WNW) {
        WRaw kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int t = min(t0 + u, z - 1);   /* past z: a valid token, masked below */
            const bool win = B != WB_BF16 && t >= row.wstart;
            const size_t slot = win ? ring0 + (size_t)(t % P.ring) : 0;
            kr[u] = wload<B>(kb, ksb, P.kw, P.kws, P.pay, off, lane, t, win, slot);
            vr[u] = wload<B>(vb, vsb, P.vw, P.vws, P.pay, off, lane, t, win, slot);
        }
        // ---- scores s[u][hd] (log2 units): the lane's 8-dim dot, its scale, a butterfly
        float s[U][MG];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[8];
            if constexpr (B == WB_BF16) wdec_bf16(kr[u].w, kr[u].w2, x);
            else if (kr[u].win) wdec_q8(kr[u].w, x);
            else wdec_tq<B>(kr[u].w, kr[u].hb, sh, s_cent[0], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                float d = 0.0f;
#pragma unroll
                for (int c = 0; c < 8; c++) d = fmaf(q[hd][c], x[c], d);
                s[u][hd] = d * kr[u].sc;
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1)
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int hd = 0; hd < MG; hd++) s[u][hd] += __shfl_xor_sync(0xffffffffu, s[u][hd], o);
        // ---- online softmax per head over the U tokens (the first is always in range)
        float p[U][MG];
#pragma unroll
        for (int hd = 0; hd < MG; hd++) {
            float mx = m[hd];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (t0 + u < z) mx = fmaxf(mx, s[u][hd]);
            const float al = exp2f(m[hd] - mx); /* m = -inf: 0 */
            float ps = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                p[u][hd] = t0 + u < z ? exp2f(s[u][hd] - mx) : 0.0f;
                ps += p[u][hd];
            }
            l[hd] = l[hd] * al + ps;
            m[hd] = mx;
#pragma unroll
            for (int c = 0; c < 8; c++) acc[hd][c] *= al;
        }
        // ---- acc += p V (V's scale folded into the weight)
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[8];
            if constexpr (B == WB_BF16) wdec_bf16(vr[u].w, vr[u].w2, x);
            else if (vr[u].win) wdec_q8(vr[u].w, x);
            else wdec_tq<B>(vr[u].w, vr[u].hb, sh, s_cent[1], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                const float pv = p[u][hd] * vr[u].sc;
#pragma unroll
                for (int c = 0; c < 8; c++) acc[hd][c] = fmaf(pv, x[c], acc[hd][c]);
            }
        }
    }
    // ---- the warps' partials, merged in warp order (a warp without tokens: m = -inf)
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
        if (hd >= G) continue;
        float4 *dst = reinterpret_cast<float4 *>(&s_acc[w][hd][8 * lane]);
        dst[0] = make_float4(acc[hd][0], acc[hd][1], acc[hd][2], acc[hd][3]);
        dst[1] = make_float4(acc[hd][4], acc[hd][5], acc[hd][6], acc[hd][7]);
        if (lane == 0) s_ml[w][hd] = make_float2(m[hd], l[hd]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * WD; e += WNW * 32) {
        const int hd = e / WD, d = e % WD;
        float M = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < WNW; ww++) M = fmaxf(M, s_ml[ww][hd].x);
        float o = 0.0f, L = 0.0f;
#pragma unroll
        for (int ww = 0; ww < WNW; ww++) {
            const float2 ml = s_ml[ww][hd];
            if (ml.x == -INFINITY) continue;
            const float f = exp2f(ml.x - M);
            o = fmaf(s_acc[ww][hd][d], f, o);
            L = fmaf(ml.y, f, L);
        }
        const size_t pi = (v0 + hd) * P.nsmax + sp;
        P.po[pi * WD + d] = o;
        if (d == 0) P.pml[pi] = make_float2(M, L);
    }
}

/* Per (row, q head) one warp (lane l: dims 8 l .. 8 l + 7): the row's splits' (max, sum,
 * output) merged in split order, divided by the sum, un-rotated once (V codec; unrotate 0:
 * the bf16 baseline, stored unrotated). */
__global__ void wmerge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                              const cuda_row *__restrict__ rows, float *__restrict__ out, cuda_codec256 C,
                              int unrotate, int qh, int nsmax, int n) {
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const int ns = min(wsplit_count(rows[v / qh].ntok), nsmax);
    const float2 *ml = pml + (size_t)v * nsmax;
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, ml[s].x);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float o8[8] = {0, 0, 0, 0, 0, 0, 0, 0}, L = 0.0f;
    if (M != -INFINITY)
        for (int s0 = 0; s0 < ns; s0 += 4) {  /* 4 splits' loads in flight, added in order */
            float2 mj[4];
            float4 pa[4], pb[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                mj[j] = make_float2(-INFINITY, 0.0f);
                pa[j] = pb[j] = make_float4(0, 0, 0, 0);
                if (s0 + j < ns) {
                    mj[j] = ml[s0 + j];
                    const float4 *p = reinterpret_cast<const float4 *>(po + ((size_t)v * nsmax + s0 + j) * WD + 8 * lane);
                    pa[j] = p[0];
                    pb[j] = p[1];
                }
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (mj[j].x == -INFINITY) continue;
                const float f = exp2f(mj[j].x - M);
                o8[0] += pa[j].x * f; o8[1] += pa[j].y * f; o8[2] += pa[j].z * f; o8[3] += pa[j].w * f;
                o8[4] += pb[j].x * f; o8[5] += pb[j].y * f; o8[6] += pb[j].z * f; o8[7] += pb[j].w * f;
                L += mj[j].y * f;
            }
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int c = 0; c < 8; c++) o8[c] *= inv;
    if (unrotate) {
        float sg[8];
#pragma unroll
        for (int c = 0; c < 8; c++) sg[c] = C.signs[8 * lane + c];
        cw_unrotate_n<8>(o8, sg, C.inv, lane);
    }
    float4 *op = reinterpret_cast<float4 *>(out + (size_t)v * WD + 8 * lane);
    op[0] = make_float4(o8[0], o8[1], o8[2], o8[3]);
    op[1] = make_float4(o8[4], o8[5], o8[6], o8[7]);
}

template <int B>
void wdec_launch(const WParams &P, dim3 grid, cudaStream_t s) {
    if (P.G <= 2) wdec_kernel<B, 2><<<grid, WNW * 32, 0, s>>>(P);
    else if (P.G <= 4) wdec_kernel<B, 4><<<grid, WNW * 32, 0, s>>>(P);
    else wdec_kernel<B, 8><<<grid, WNW * 32, 0, s>>>(P);
}

pthread_mutex_t g_setup_mu = PTHREAD_MUTEX_INITIALIZER;
int g_setup_done;

} // namespace

tqkv_status cuda_prefill_setup(void) {
    if (__atomic_load_n(&g_setup_done, __ATOMIC_ACQUIRE)) return TQKV_OK;
    pthread_mutex_lock(&g_setup_mu);
    tqkv_status st = TQKV_OK;
    if (!g_setup_done) {
        st = cuda_check(cudaFuncSetAttribute(prefill_kernel<CUDA_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             prefill_smem<CUDA_DIM>()), "prefill shared memory");
        if (!st)
            st = cuda_check(cudaFuncSetAttribute(prefill_kernel<CUDA_DIM_WIDE>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 prefill_smem<CUDA_DIM_WIDE>()), "prefill shared memory");
        if (!st) __atomic_store_n(&g_setup_done, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_setup_mu);
    return st;
}

static tqkv_status check_heads(const cuda_kv *kv, int q_heads, const char *fn) {
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "%s: q_heads %d must be a multiple of kv_heads %d with at most %d "
                         "query heads per kv head", fn, q_heads, kv->kvh, CUDA_MAX_G);
    return TQKV_OK;
}

extern "C" size_t tqkv_cuda_attend_ws_bytes_dim(int rows, int q_heads, int max_tokens, int head_dim) {
    if (head_dim == CUDA_DIM) return tqkv_cuda_attend_ws_bytes(rows, q_heads, max_tokens);
    size_t po_b, pml_b;
    const size_t nv = (size_t)(rows > 0 ? rows : 0) * (size_t)(q_heads > 0 ? q_heads : 0);
    return wide_ws(nv, wsplit_bound(max_tokens), &po_b, &pml_b);
}

/* Decode attention at d = 256 (attn_cuda.cu's entry points dispatch here): query prep, the
 * split kernel, the merge, all on kv->stream. ws == NULL: kv's own workspace, grown here. */
tqkv_status cuda_attend_decode_wide(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                                    void *ws, size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    tqkv_status st = check_heads(kv, q_heads, "tqkv_cuda_kv_attend");
    if (st) return st;
    if (kv->d != CUDA_DIM_WIDE ||
        (!kv->bf16 && (kv->kfmt != kv->vfmt || (kv->kfmt != TQKV_TQ4 && kv->kfmt != TQKV_TQ3))))
        return tqkv_fail(TQKV_EUNSUPPORTED,
                         "tqkv_cuda_kv_attend: head_dim %d with these formats (the device "
                         "kernels take %d, or %d with tq4/tq4, tq3/tq3 or the dense bf16 cache)",
                         kv->d, CUDA_DIM, CUDA_DIM_WIDE);
    if (kv->rows == 0) return TQKV_OK;
    if (kv->rows > 65535)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows at head_dim %d (at most 65535)",
                         kv->rows, kv->d);
    int maxtok = 0;
    for (int r = 0; r < kv->rows; r++) maxtok = kv->h_offset[r] > maxtok ? kv->h_offset[r] : maxtok;
    const int nsmax = wsplit_bound(maxtok); /* >= every row's split count; the graph key's */
    const size_t nv = (size_t)kv->rows * q_heads;
    size_t po_b, pml_b;
    const size_t need = wide_ws(nv, nsmax, &po_b, &pml_b);
    if (ws && need > ws_bytes)
        return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_ws: workspace of %zu bytes < %zu needed", ws_bytes, need);
    if (!ws && need > kv->ws_bytes) {
        tqkv_cuda_free(kv->ws);
        kv->ws = NULL;
        kv->ws_bytes = 0;
        st = tqkv_cuda_malloc(&kv->ws, need);
        if (st) return st;
        kv->ws_bytes = need;
    }
    if (!ws) ws = kv->ws;
    float *po = (float *)ws;
    float2 *pml = (float2 *)((char *)ws + po_b);
    float *qp = (float *)((char *)ws + po_b + pml_b);
    const int nvi = (int)nv;
    /* bf16: not rotated (stored as given), so the queries are only scaled */
    pqprep_kernel<CUDA_DIM_WIDE><<<(unsigned)((nv + 3) / 4), 128, 0, kv->stream>>>(
        q, qp, kv->kc256, !kv->bf16, scale * LOG2E, nvi);
    WParams P;
    P.kd = kv->kd; P.vd = kv->vd; P.ks = kv->ks; P.vs = kv->vs;
    P.kw = kv->kw; P.vw = kv->vw; P.kws = kv->kws; P.vws = kv->vws;
    P.rows = kv->d_rows; P.q = qp; P.po = po; P.pml = pml;
    for (int i = 0; i < 16; i++) {
        P.kcent[i] = kv->kc256.cent[i];
        P.vcent[i] = kv->vc256.cent[i];
    }
    P.pay = (int)kv->kpay; P.ring = kv->ring > 0 ? kv->ring : 1; P.cap = kv->cap;
    P.kvh = kv->kvh; P.G = q_heads / kv->kvh; P.qh = q_heads; P.nsmax = nsmax;
    /* every (row, kv head, split) up to the bound; items past a row's count exit at once.
     * Each row's length, split length and count come from d_rows on the device. */
    const dim3 grid((unsigned)nsmax, (unsigned)kv->kvh, (unsigned)kv->rows);
    if (kv->bf16) wdec_launch<WB_BF16>(P, grid, kv->stream);
    else if (kv->kfmt == TQKV_TQ4) wdec_launch<4>(P, grid, kv->stream);
    else wdec_launch<3>(P, grid, kv->stream);
    wmerge_kernel<<<(unsigned)((nv + 3) / 4), 128, 0, kv->stream>>>(
        po, pml, kv->d_rows, out, kv->vc256, !kv->bf16, q_heads, nsmax, nvi);
    return cuda_check(cudaGetLastError(), "d 256 decode attention launch");
}

extern "C" tqkv_status tqkv_cuda_kv_attend_masked(cuda_kv *kv, const float *q, int n_query, int q_heads,
                                             float scale, const int32_t *lo, const int32_t *hi,
                                             float *out) {
    if (!kv || !q || !out || !lo || !hi) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_masked: NULL argument");
    if (n_query < 1 || q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_masked: bad n_query / q_heads");
    if (kv->rows == 0) return TQKV_OK;
    tqkv_status st = cuda_prefill_setup();
    if (st) return st;
    const size_t nrq = (size_t)kv->rows * n_query;
    std::vector<int> tl(nrq), th(nrq);
    for (int r = 0; r < kv->rows; r++)
        for (int i = 0; i < n_query; i++) {
            const size_t k = (size_t)r * n_query + i;
            int a = lo[k] - kv->h_left_pad[r], b = hi[k] - kv->h_left_pad[r];
            if (a < 0) a = 0;
            if (b > kv->h_offset[r]) b = kv->h_offset[r];
            if (lo[k] > hi[k] || b < a) return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_masked: bad range of row %d query %d", r, i);
            tl[k] = a;
            th[k] = b;
        }
    const size_t nv = (size_t)kv->rows * q_heads * n_query;
    int *dlo = NULL, *dhi = NULL;
    float *qp = NULL;
    st = tqkv_cuda_malloc((void **)&dlo, nrq * sizeof(int));
    if (!st) st = tqkv_cuda_malloc((void **)&dhi, nrq * sizeof(int));
    if (!st) st = tqkv_cuda_malloc((void **)&qp, nv * kv->d * sizeof(float));
    /* everything on the cache's stream: the encode of these tokens ran there */
    if (!st) st = cuda_check(cudaMemcpyAsync(dlo, tl.data(), nrq * sizeof(int), cudaMemcpyHostToDevice, kv->stream),
                             "prefill ranges");
    if (!st) st = cuda_check(cudaMemcpyAsync(dhi, th.data(), nrq * sizeof(int), cudaMemcpyHostToDevice, kv->stream),
                             "prefill ranges");
    if (!st) {
        st = launch_dim(kv, q, n_query, q_heads, scale, dlo, dhi, qp, out);
        /* the temporaries are freed below, and the ranges' host copies die here */
        if (!st) st = cuda_check(cudaStreamSynchronize(kv->stream), "prefill attention");
    }
    if (st) (void)cudaStreamSynchronize(kv->stream); /* nothing queued still reads them */
    tqkv_cuda_free(dlo);
    tqkv_cuda_free(dhi);
    tqkv_cuda_free(qp);
    return st;
}

/*
 * attn_cuda_fmt.cu - decode attention (one query per row) over the device cache for the
 * formats the tuned tensor-core kernels do not take: fp8/fp8 at head_dim 256 (at 128 only with
 * TQKV_FP8_TC=0: the tensor-core split kernel takes it); tq2/tq2
 * and tq K and V of different bits (tq4/tq3, tq4/tq2, tq3/tq2) at 256 (at 128 attn_cuda.cu's
 * tensor-core split kernel takes them); with the q8 recent window of the tq formats. attn_cuda.cu's entry points come here when cuda_kv_fmt_generic.
 * Owns: the query preparation (rotated into K's domain when K is tq; fp8 is stored as given),
 * the float32 split kernel fdec_kernel<D, KB, VB, MG> (attn_cuda_wide.cu's wdec_kernel with
 * the head dim, the K format and the V format as template arguments), the merge (split
 * order, divided by the sum, un-rotated once when V is tq) and the dispatch.
 * Splits: d = 128 by split_len / split_count (the tuned kernel's rule, so that
 * tqkv_cuda_attend_ws_bytes holds the partials), d = 256 by wsplit_len / wsplit_count
 * (attn_cuda_splits.h); each row's from its own length on the device.
 * Must not: mutate the cache; let a row's result depend on other rows (per-row splits, fixed
 * reduction orders); allocate, free or wait when a workspace is passed.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" {
#include "util/common.h"
}
#include "attn/attn_cuda_splits.h"
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"

namespace {

constexpr float FLOG2E = 1.4426950408889634f;
constexpr int FNW = 4;                 /* warps per CTA (one CTA per work item) */
constexpr int FB_FP8 = CUDA_BITS_FP8;  /* the format argument of an fp8 plane (tq: its bits) */

template <int D> __host__ __device__ inline int fsplit_len(int ntok) {
    return D == CUDA_DIM ? split_len(ntok) : wsplit_len(ntok);
}
template <int D> __host__ __device__ inline int fsplit_count(int ntok) {
    return D == CUDA_DIM ? split_count(ntok) : wsplit_count(ntok);
}
/* The split stride (workspace and grid) for rows of at most n tokens. */
inline int fsplit_bound(int d, int n) { return d == CUDA_DIM ? split_bound(n) : wsplit_bound(n); }

// ---------------------------------------------------------------------------
// Query preparation: one warp per (row, q head), lane l: dims E l .. E l + E - 1
// ---------------------------------------------------------------------------
/* q [n, D] -> out [n, D] float: rotated by K's codec when `rotate`, times softmax scale x log2(e). */
template <int D>
__global__ void fprep_kernel(const float *__restrict__ q, float *__restrict__ out,
                             typename cuda_codec_of<D>::type C, int rotate, float mul, int n) {
    constexpr int E = D / 32;
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    float x[E];
    cw_load_rotate<E>(q + (size_t)v * D, C, rotate, lane, x);
#pragma unroll
    for (int j = 0; j < E / 4; j++)
        reinterpret_cast<float4 *>(out + (size_t)v * D + E * lane)[j] =
            make_float4(x[4 * j] * mul, x[4 * j + 1] * mul, x[4 * j + 2] * mul, x[4 * j + 3] * mul);
}

// ---------------------------------------------------------------------------
// The float32 split kernel
// ---------------------------------------------------------------------------
struct FParams {
    const uint8_t *kd, *vd;            /* [rows, kvh, cap, kpay / vpay] */
    const uint16_t *ks, *vs;           /* [rows, kvh, cap] fp16 token scales */
    const int8_t *kw, *vw;             /* [rows, kvh, ring, D] q8 window (tq) */
    const uint16_t *kws, *vws;         /* [rows, kvh, ring, D / 32] fp16 block scales */
    const cuda_row *rows;              /* [rows] */
    const float *q;                    /* [rows, qh, D] prepared (fprep_kernel) */
    float *po;                         /* [rows * qh, nsmax, D] partial outputs (V domain) */
    float2 *pml;                       /* [rows * qh, nsmax] (running max, sum), base 2 */
    float kcent[16], vcent[16];        /* tq codebooks (ascending) */
    int kpay, vpay, ring, cap, kvh, G, qh, nsmax;
};

/* Where lane l's E values (dims i0 = E l .. i0 + E - 1) of a token of format B lie
 * (codec.h's planes: dim 32 g + j has its tq4 nibble j >> 4 in byte 16 g + (j & 15); its
 * 2-bit field j >> 3 in byte 8 g + (j & 7), its tq3 high bit j & 7 of byte D / 4 + 4 g +
 * (j >> 3); fp8 byte i): E consecutive payload bytes from off, each value at bit sh of its
 * byte; tq3's high bits from bit hs of byte hoff. */
struct FLane {
    int off, sh, hoff, hs;
};
template <int D, int B> __device__ __forceinline__ FLane flane(int lane) {
    const int i0 = (D / 32) * lane, g = i0 >> 5, j = i0 & 31;
    FLane L;
    if (B == FB_FP8) L = {i0, 0, 0, 0};
    else if (B == 4) L = {16 * g + (j & 15), 4 * (j >> 4), 0, 0};
    else L = {8 * g + (j & 7), 2 * (j >> 3), D / 4 + 4 * g + (j >> 3), j & 7};
    return L;
}

/* One token's bytes for a lane: E payload (or q8 window) bytes, tq3's high-bit byte, the
 * factor of its values (tq: the scale; fp8: scale x 256, codec.h; q8: its block scale). */
template <int E> struct FRaw {
    uint32_t w[E / 4];
    uint32_t hb;
    float sc;
    bool win;
};

template <int D, int B>
__device__ __forceinline__ FRaw<D / 32> fload(const uint8_t *base, const uint16_t *sc, const int8_t *wv,
                                              const uint16_t *wsc, int pay, const FLane &L, int lane, int t,
                                              bool win, size_t slot) {
    constexpr int E = D / 32;
    FRaw<E> x;
    x.win = win;
    x.hb = 0;
    const uint8_t *p = win ? reinterpret_cast<const uint8_t *>(wv) + slot * D + E * lane
                           : base + (size_t)t * pay + L.off;
    if constexpr (E == 4) {
        x.w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
    } else {
        const uint2 u = __ldg(reinterpret_cast<const uint2 *>(p));
        x.w[0] = u.x;
        x.w[1] = u.y;
    }
    if (win) {
        x.sc = __half2float(__ushort_as_half(__ldg(wsc + slot * (D / 32) + ((E * lane) >> 5))));
    } else {
        if (B == 3) x.hb = __ldg(base + (size_t)t * pay + L.hoff);
        const float s = __half2float(__ushort_as_half(__ldg(sc + t)));
        x.sc = B == FB_FP8 ? s * 256.0f : s;
    }
    return x;
}

/* The lane's E values of a token before its factor. */
template <int E, int B>
__device__ __forceinline__ void fdec(const FRaw<E> &x, const FLane &L, const float *cent, float (&v)[E]) {
#pragma unroll
    for (int c = 0; c < E; c++) {
        const uint32_t by = (x.w[c >> 2] >> (8 * (c & 3))) & 0xFFu;
        if (x.win) {
            v[c] = (float)(int8_t)by;
        } else if constexpr (B == FB_FP8) { /* codec_fp8_half: exact in fp16 */
            v[c] = __half2float(__ushort_as_half((uint16_t)(((by & 0x80u) << 8) | ((by & 0x7fu) << 7))));
        } else if constexpr (B == 4) {
            v[c] = cent[(by >> L.sh) & 15u];
        } else {
            uint32_t idx = (by >> L.sh) & 3u;
            if (B == 3) idx |= ((x.hb >> (L.hs + c)) & 1u) << 2;
            v[c] = cent[idx];
        }
    }
}

/* Work item (row blockIdx.z, kv head blockIdx.y, split blockIdx.x); items past the row's split
 * count exit. KB / VB: the K / V format (tq bits 2..4, or FB_FP8). Warp w takes the split's
 * tokens in runs of U: a + U w + U FNW k ..; lane l holds dims E l .. E l + E - 1 of the G
 * query heads (MG slots), their running max / sum / output (float32, base-2 online softmax).
 * The warps' partials merge in warp order through shared memory. */
template <int D, int KB, int VB, int MG>
__global__ void __launch_bounds__(FNW * 32) fdec_kernel(const FParams P) {
    constexpr int E = D / 32;
    constexpr int U = MG * E >= 64 ? 2 : 4;      /* tokens per warp step (registers) */
    constexpr bool TQ = KB != FB_FP8;            /* K and V are both tq or both fp8 */
    __shared__ float s_cent[2][16];
    __shared__ float2 s_ml[FNW][MG];
    __shared__ __align__(16) float s_acc[FNW][MG][D];
    const int sp = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const cuda_row row = P.rows[r];
    const int ntok = row.ntok;
    if (sp >= fsplit_count<D>(ntok)) return;    /* the whole CTA, before any barrier */
    const int seg = fsplit_len<D>(ntok), a = sp * seg, z = min(ntok, a + seg);
    if (threadIdx.x < 32)
        s_cent[threadIdx.x >> 4][threadIdx.x & 15] = threadIdx.x < 16 ? P.kcent[threadIdx.x] : P.vcent[threadIdx.x - 16];
    const int G = P.G;
    const size_t rh = (size_t)r * P.kvh + h, v0 = (size_t)r * P.qh + (size_t)h * G;
    float q[MG][E], acc[MG][E], m[MG], l[MG];
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
#pragma unroll
        for (int j = 0; j < E / 4; j++) {
            float4 x = make_float4(0, 0, 0, 0);
            if (hd < G) x = reinterpret_cast<const float4 *>(P.q + (v0 + hd) * D + E * lane)[j];
            q[hd][4 * j] = x.x; q[hd][4 * j + 1] = x.y; q[hd][4 * j + 2] = x.z; q[hd][4 * j + 3] = x.w;
        }
        m[hd] = -INFINITY;
        l[hd] = 0.0f;
#pragma unroll
        for (int c = 0; c < E; c++) acc[hd][c] = 0.0f;
    }
    const FLane LK = flane<D, KB>(lane), LV = flane<D, VB>(lane);
    const size_t col0 = rh * P.cap + (size_t)row.left_pad;
    const uint8_t *kb = P.kd + col0 * P.kpay, *vb = P.vd + col0 * P.vpay;
    const uint16_t *ksb = P.ks + col0, *vsb = P.vs + col0;
    const size_t ring0 = rh * P.ring;
    __syncthreads();                             /* s_cent */
    for (int t0 = a + U * w; t0 < z; t0 += U * FNW) {
        FRaw<E> kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int t = min(t0 + u, z - 1);   /* past z: a valid token, masked below */
            const bool win = TQ && t >= row.wstart;
            const size_t slot = win ? ring0 + (size_t)(t % P.ring) : 0;
            kr[u] = fload<D, KB>(kb, ksb, P.kw, P.kws, P.kpay, LK, lane, t, win, slot);
            vr[u] = fload<D, VB>(vb, vsb, P.vw, P.vws, P.vpay, LV, lane, t, win, slot);
        }
        // ---- scores s[u][hd] (log2 units): the lane's E-dim dot, its factor, a butterfly
        float s[U][MG];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[E];
            fdec<E, KB>(kr[u], LK, s_cent[0], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                float d = 0.0f;
#pragma unroll
                for (int c = 0; c < E; c++) d = fmaf(q[hd][c], x[c], d);
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
            for (int c = 0; c < E; c++) acc[hd][c] *= al;
        }
        // ---- acc += p V (V's factor folded into the weight)
#pragma unroll
        for (int u = 0; u < U; u++) {
            float x[E];
            fdec<E, VB>(vr[u], LV, s_cent[1], x);
#pragma unroll
            for (int hd = 0; hd < MG; hd++) {
                const float pv = p[u][hd] * vr[u].sc;
#pragma unroll
                for (int c = 0; c < E; c++) acc[hd][c] = fmaf(pv, x[c], acc[hd][c]);
            }
        }
    }
    // ---- the warps' partials, merged in warp order (a warp without tokens: m = -inf)
#pragma unroll
    for (int hd = 0; hd < MG; hd++) {
        if (hd >= G) continue;
#pragma unroll
        for (int j = 0; j < E / 4; j++)
            reinterpret_cast<float4 *>(&s_acc[w][hd][E * lane])[j] =
                make_float4(acc[hd][4 * j], acc[hd][4 * j + 1], acc[hd][4 * j + 2], acc[hd][4 * j + 3]);
        if (lane == 0) s_ml[w][hd] = make_float2(m[hd], l[hd]);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += FNW * 32) {
        const int hd = e / D, d = e % D;
        float M = -INFINITY;
#pragma unroll
        for (int ww = 0; ww < FNW; ww++) M = fmaxf(M, s_ml[ww][hd].x);
        float o = 0.0f, L = 0.0f;
#pragma unroll
        for (int ww = 0; ww < FNW; ww++) {
            const float2 ml = s_ml[ww][hd];
            if (ml.x == -INFINITY) continue;
            const float f = exp2f(ml.x - M);
            o = fmaf(s_acc[ww][hd][d], f, o);
            L = fmaf(ml.y, f, L);
        }
        const size_t pi = (v0 + hd) * P.nsmax + sp;
        P.po[pi * D + d] = o;
        if (d == 0) P.pml[pi] = make_float2(M, L);
    }
}

// ---------------------------------------------------------------------------
// Merge: one warp per (row, q head), lane l: dims E l .. E l + E - 1
// ---------------------------------------------------------------------------
/* The row's splits merged in split order, divided by the sum, un-rotated once by V's codec
 * when `unrotate` (V tq). */
template <int D>
__global__ void fmerge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                              const cuda_row *__restrict__ rows, float *__restrict__ out,
                              typename cuda_codec_of<D>::type C, int unrotate, int qh, int nsmax, int n) {
    constexpr int E = D / 32;
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (v >= n) return;
    const int ns = min(fsplit_count<D>(rows[v / qh].ntok), nsmax);
    const float2 *ml = pml + (size_t)v * nsmax;
    float M = -INFINITY;
    for (int s = lane; s < ns; s += 32) M = fmaxf(M, ml[s].x);
#pragma unroll
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float o[E], L = 0.0f;
#pragma unroll
    for (int c = 0; c < E; c++) o[c] = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < ns; s++) {
            const float2 mj = ml[s];
            if (mj.x == -INFINITY) continue;
            const float f = exp2f(mj.x - M);
            const float4 *p = reinterpret_cast<const float4 *>(po + ((size_t)v * nsmax + s) * D + E * lane);
#pragma unroll
            for (int j = 0; j < E / 4; j++) {
                const float4 x = p[j];
                o[4 * j] += x.x * f; o[4 * j + 1] += x.y * f; o[4 * j + 2] += x.z * f; o[4 * j + 3] += x.w * f;
            }
            L += mj.y * f;
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int c = 0; c < E; c++) o[c] *= inv;
    if (unrotate) {
        float sg[E];
#pragma unroll
        for (int c = 0; c < E; c++) sg[c] = C.signs[E * lane + c];
        cw_unrotate_n<E>(o, sg, C.inv, lane);
    }
    float4 *op = reinterpret_cast<float4 *>(out + (size_t)v * D + E * lane);
#pragma unroll
    for (int j = 0; j < E / 4; j++) op[j] = make_float4(o[4 * j], o[4 * j + 1], o[4 * j + 2], o[4 * j + 3]);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------
template <int D, int KB, int VB>
void fdec_launch(const FParams &P, dim3 grid, cudaStream_t s) {
    if (P.G <= 2) fdec_kernel<D, KB, VB, 2><<<grid, FNW * 32, 0, s>>>(P);
    else if (P.G <= 4) fdec_kernel<D, KB, VB, 4><<<grid, FNW * 32, 0, s>>>(P);
    else fdec_kernel<D, KB, VB, 8><<<grid, FNW * 32, 0, s>>>(P);
}

/* The kernel of K format kb and V format vb (cuda_codec bits); false when none is built. */
template <int D> bool fdec_dispatch(int kb, int vb, const FParams &P, dim3 grid, cudaStream_t s) {
    if (kb == FB_FP8 && vb == FB_FP8) fdec_launch<D, FB_FP8, FB_FP8>(P, grid, s);
    else if (kb == 2 && vb == 2) fdec_launch<D, 2, 2>(P, grid, s);
    else if (kb == 4 && vb == 3) fdec_launch<D, 4, 3>(P, grid, s);
    else if (kb == 4 && vb == 2) fdec_launch<D, 4, 2>(P, grid, s);
    else if (kb == 3 && vb == 2) fdec_launch<D, 3, 2>(P, grid, s);
    else return false;
    return true;
}

/* Workspace for nv query vectors and nsmax splits: partials [nv, nsmax, D] f32, (max, sum)
 * [nv, nsmax] float2 (256-byte rounded), queries [nv, D] f32: within what
 * tqkv_cuda_attend_ws_bytes_dim gives for the same rows, heads and length (attn_cuda.cu's and
 * attn_cuda_wide.cu's layouts, whose queries also take nv * D floats). */
size_t fmt_ws(size_t nv, int nsmax, int d, size_t *po_b, size_t *pml_b) {
    *po_b = nv * (size_t)nsmax * d * sizeof(float);
    *pml_b = (nv * (size_t)nsmax * sizeof(float2) + 255) / 256 * 256;
    return *po_b + *pml_b + nv * d * sizeof(float) + 256;
}

/* Prep, kernel and merge for head dim D on kv->stream. */
template <int D>
tqkv_status fmt_queue(cuda_kv *kv, const typename cuda_codec_of<D>::type &kc,
                      const typename cuda_codec_of<D>::type &vc, const float *q, int q_heads, float scale,
                      float *out, float *po, float2 *pml, float *qp, int nsmax) {
    const int nvi = kv->rows * q_heads;
    const unsigned qgrid = (unsigned)((nvi + 3) / 4);
    const int krot = CUDA_BITS_ROTATED(kc.bits), vrot = CUDA_BITS_ROTATED(vc.bits);
    fprep_kernel<D><<<qgrid, 128, 0, kv->stream>>>(q, qp, kc, krot, scale * FLOG2E, nvi);
    FParams P;
    P.kd = kv->kd; P.vd = kv->vd; P.ks = kv->ks; P.vs = kv->vs;
    P.kw = kv->kw; P.vw = kv->vw; P.kws = kv->kws; P.vws = kv->vws;
    P.rows = kv->d_rows; P.q = qp; P.po = po; P.pml = pml;
    for (int i = 0; i < 16; i++) {
        P.kcent[i] = kc.cent[i];
        P.vcent[i] = vc.cent[i];
    }
    P.kpay = (int)kv->kpay; P.vpay = (int)kv->vpay; P.ring = kv->ring > 0 ? kv->ring : 1;
    P.cap = kv->cap; P.kvh = kv->kvh; P.G = q_heads / kv->kvh; P.qh = q_heads; P.nsmax = nsmax;
    const dim3 grid((unsigned)nsmax, (unsigned)kv->kvh, (unsigned)kv->rows);
    if (!fdec_dispatch<D>(kc.bits, vc.bits, P, grid, kv->stream))
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: no decode kernel for K/V formats %s/%s",
                         tqkv_format_name(kv->kfmt), tqkv_format_name(kv->vfmt));
    fmerge_kernel<D><<<qgrid, 128, 0, kv->stream>>>(po, pml, kv->d_rows, out, vc, vrot, q_heads, nsmax, nvi);
    return cuda_check(cudaGetLastError(), "decode attention launch");
}

} // namespace

/* fp8/fp8 at d = 128 on the tensor-core split kernel: 1 unless the environment's TQKV_FP8_TC
 * is 0 (the float32 kernel, for A/B timings), read once. */
static int fp8_tc(void) {
    static int v = -1;                    /* -1: not read yet (a race reads the same value) */
    int x = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (x < 0) {
        const char *env = getenv("TQKV_FP8_TC");
        x = env && *env ? atoi(env) != 0 : 1;
        __atomic_store_n(&v, x, __ATOMIC_RELAXED);
    }
    return x;
}

int cuda_kv_fmt_generic(const cuda_kv *kv) {
    if (!kv || kv->bf16) return 0;
    if (kv->kfmt == kv->vfmt && (kv->kfmt == TQKV_TQ4 || kv->kfmt == TQKV_TQ3)) return 0;
    /* d = 128: the tensor-core split kernel also takes tq4/tq2, tq2/tq2, tq4/tq3 and tq3/tq2
     * (attn_cuda.cu) */
    const int k = kv->kfmt, v = kv->vfmt;
    if (kv->d == CUDA_DIM && ((v == TQKV_TQ2 && (k == TQKV_TQ4 || k == TQKV_TQ2 || k == TQKV_TQ3)) ||
                              (k == TQKV_TQ4 && v == TQKV_TQ3)))
        return 0;
    /* fp8/fp8 at d = 128 (as tq, at most CUDA_MAX_ROWS rows per call: more are refused, not
     * sent to the float32 kernel, so that a row's bits never depend on its batch's size) */
    if (kv->d == CUDA_DIM && k == TQKV_FP8 && v == TQKV_FP8 && fp8_tc()) return 0;
    return 1;
}

tqkv_status cuda_attend_decode_fmt(cuda_kv *kv, const float *q, int q_heads, float scale, float *out, void *ws,
                                   size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: q_heads %d must be a multiple of kv_heads %d "
                         "with at most %d query heads per kv head", q_heads, kv->kvh, CUDA_MAX_G);
    if (kv->rows == 0) return TQKV_OK;
    if (kv->rows > 65535)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: %d rows (at most 65535)", kv->rows);
    int maxtok = 0;
    for (int r = 0; r < kv->rows; r++) maxtok = kv->h_offset[r] > maxtok ? kv->h_offset[r] : maxtok;
    const int nsmax = fsplit_bound(kv->d, maxtok);
    const size_t nv = (size_t)kv->rows * q_heads;
    size_t po_b, pml_b;
    const size_t need = fmt_ws(nv, nsmax, kv->d, &po_b, &pml_b);
    if (ws && need > ws_bytes)
        return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_ws: workspace of %zu bytes < %zu needed", ws_bytes, need);
    if (!ws && need > kv->ws_bytes) {
        tqkv_cuda_free(kv->ws);
        kv->ws = NULL;
        kv->ws_bytes = 0;
        tqkv_status st = tqkv_cuda_malloc(&kv->ws, need);
        if (st) return st;
        kv->ws_bytes = need;
    }
    if (!ws) ws = kv->ws;
    float *po = (float *)ws;                                   /* [nv, nsmax, d] */
    float2 *pml = (float2 *)((char *)ws + po_b);               /* [nv, nsmax] */
    float *qp = (float *)((char *)ws + po_b + pml_b);          /* [nv, d] */
    if (kv->d == CUDA_DIM)
        return fmt_queue<CUDA_DIM>(kv, kv->kc, kv->vc, q, q_heads, scale, out, po, pml, qp, nsmax);
    return fmt_queue<CUDA_DIM_WIDE>(kv, kv->kc256, kv->vc256, q, q_heads, scale, out, po, pml, qp, nsmax);
}

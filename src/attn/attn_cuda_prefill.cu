/*
 * attn_cuda_prefill.cu - attention of several queries per row (prefill, chunked prefill,
 * speculative verify) over the device cache, with per-(row, query) visible ranges (the
 * tqkv_mask of the CPU: left padding, causal, sliding window), at head_dim 128 and 256.
 * Owns: a float32 kernel: one CTA per (row, kv head, block of QB queries); tiles of KT
 * tokens are decoded once into shared memory in the stored (rotated) domain and used by all
 * G x QB query vectors of the block (query rotated once, output un-rotated once); online
 * softmax per query vector in a fixed token order; the dense bf16 baseline read the same way
 * (not rotated). Its one-time setup (cuda_prefill_setup).
 * Must not: mutate the cache; let a query's output depend on anything but its own row and
 * range (a tile a query cannot see leaves it unchanged).
 * Templated on the head_dim D (128, 256).
 * The float32 kernel here is the reference (TQKV_PREFILL_TC=0, or tqkv_cuda_prefill_tc(0)):
 * plain FMA, no tensor cores. The tensor-core kernels (fp16 / bf16 operands as the decode
 * kernels: attn_cuda.cu at d = 128, attn_cuda_wide.cu at d = 256): the default, 8 warps per
 * CTA with prefetched tiles (attn_cuda_prefill_tc8.cu, TQKV_PREFILL_TC=2), and the 4-warp one
 * it replaced (attn_cuda_prefill_tc.cu, TQKV_PREFILL_TC=1), kept for A/B runs.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

extern "C" {
#include "util/common.h"
}
#include "util/cuda_device.h"
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"
#include "attn/attn_cuda_prefill.cuh"

namespace {

constexpr int KT = 32;                 /* tokens per tile */
constexpr int QB = 4;                  /* queries per CTA (x G heads = query vectors) */
constexpr int NT = 256;                /* threads per CTA */
constexpr float LOG2E = 1.4426950408889634f;

/* Dynamic shared memory of prefill_kernel<D>: K and V tiles [KT][D + 1] (padded rows:
 * conflict-free column reads), the q8 copies of the tokens whose source differs between the
 * block's queries (at most QB - 1) [QB][D + 1] for K and V, the block's query vectors
 * [QB * CUDA_MAX_G][D]. */
template <int D> constexpr int prefill_smem() {
    return (2 * (KT + QB) * (D + 1) + QB * CUDA_MAX_G * D) * (int)sizeof(float);
}
static_assert(prefill_smem<CUDA_DIM_WIDE>() <= 227 * 1024, "the d = 256 tiles fit an SM");

/* Element i of the main-plane vector at column col, its per-token scale applied (rotated
 * domain for tq, original for fp8 and the bf16 baseline). */
template <int D>
__device__ float elem_main(const uint8_t *data, const uint16_t *sc, size_t pay, int bits, const float *cent,
                           int bf16, size_t col, int i) {
    const uint8_t *p = data + col * pay;
    if (bf16) return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t *>(p)[i] << 16);
    if (bits == CUDA_BITS_FP8) { /* codec_fp8_half(b) x (scale x 256), as codec_decode */
        const uint32_t b = p[i];
        const float x = __half2float(__ushort_as_half((uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7))));
        return x * (__half2float(__ushort_as_half(sc[col])) * 256.0f);
    }
    const int g = i >> 5, j = i & 31;
    int idx;
    if (bits == 4) idx = (p[16 * g + (j & 15)] >> (4 * (j >> 4))) & 15;
    else {
        idx = (p[8 * g + (j & 7)] >> (2 * (j >> 3))) & 3;
        if (bits == 3) idx |= ((p[D / 4 + 4 * g + (j >> 3)] >> (j & 7)) & 1) << 2;
    }
    return cent[idx] * __half2float(__ushort_as_half(sc[col]));
}

/* Element i of a q8 copy (slot of the ring or of the side buffer), its block scale applied. */
template <int D>
__device__ float elem_q8(const int8_t *q, const uint16_t *qs, size_t slot, int i) {
    return (float)q[slot * D + i] * __half2float(__ushort_as_half(qs[slot * (D / 32) + i / 32]));
}

template <int D>
__global__ void __launch_bounds__(NT) prefill_kernel(const PParams<D> P) {
    constexpr int DP = D + 1;          /* padded smem row */
    constexpr int E = D / 32;          /* dims per lane: E l .. E l + E - 1 */
    extern __shared__ float sm[];
    float *sk = sm;                    /* [KT][DP] */
    float *sv = sk + KT * DP;          /* [KT][DP] */
    float *sk2 = sv + KT * DP;         /* [QB][DP] q8 copies of tokens [cmin, cmax) */
    float *sv2 = sk2 + QB * DP;        /* [QB][DP] */
    float *sq = sv2 + QB * DP;         /* [QB * G][D] query vectors of the block */
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
    // ---- per-query window: query p reads token t from its q8 copy when t >= c(p) =
    // max(p + 1 - W, q8lo) (a decode step at p reads the same); the block's c span at most
    // QB - 1 tokens: [cmin, cmax) is read from both sources, t >= cmax from the copies only
    const int *xr = P.x;
    const bool xon = xr != nullptr && xr[P.nrows + r] > xr[r];
    const int q8lo = xon ? xr[r] : row.win_lo;
    int cmin = 1 << 30, cmax = 1 << 30;
    if (P.window > 0)
        for (int i = 0; i < QB && q0 + i < P.nq; i++) {
            const int c = max(row.ntok - P.nq + q0 + i + 1 - P.window, q8lo);
            cmin = i ? min(cmin, c) : c;
            cmax = i ? max(cmax, c) : c;
        }
    // ---- queries into shared memory: vector v = (head gg, query i) -> v = i * G + gg ----
    for (int e = threadIdx.x; e < nv * D; e += NT) {
        const int v = e / D, d = e % D, i = v / G, gg = v % G;
        sq[e] = q0 + i < P.nq ? P.q[(((size_t)r * P.qh + (size_t)h * G + gg) * P.nq + q0 + i) * D + d] : 0.0f;
    }
    // each warp owns query vectors v = w, w + 8, ...; per vector: m, l, acc (lane: dims E l..)
    constexpr int MAXV = CUDA_MAX_G * QB / (NT / 32);
    float m[MAXV], l[MAXV], acc[MAXV][E];
    int vlo[MAXV], vhi[MAXV], vc[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; k++) {
        m[k] = -INFINITY; l[k] = 0.0f;
#pragma unroll
        for (int c = 0; c < E; c++) acc[k][c] = 0.0f;
        const int v = w + k * (NT / 32), i = v / G;
        vlo[k] = vhi[k] = 0;
        vc[k] = P.window > 0 ? max(row.ntok - P.nq + q0 + i + 1 - P.window, q8lo) : 1 << 30;
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
                const bool q8 = t >= cmin;   /* some query of the block reads the copy */
                size_t xs = 0;
                const int8_t *kq = P.kw, *vq = P.vw;
                const uint16_t *kqs = P.kws, *vqs = P.vws;
                if (q8 && xon && t < xr[P.nrows + r]) {
                    xs = rh * P.xcap + (size_t)(t - xr[r]);
                    kq = P.kx; vq = P.vx; kqs = P.kxs; vqs = P.vxs;
                } else if (q8) {
                    xs = rh * P.ring + (size_t)(t % P.ring);
                }
                if (t >= cmax) {
                    kvv = elem_q8<D>(kq, kqs, xs, i);
                    vvv = elem_q8<D>(vq, vqs, xs, i);
                } else {
                    const size_t col = rh * P.cap + (size_t)(row.left_pad + t);
                    kvv = elem_main<D>(P.kd, P.ks, P.kpay, P.kc.bits, P.kc.cent, P.bf16, col, i);
                    vvv = elem_main<D>(P.vd, P.vs, P.vpay, P.vc.bits, P.vc.cent, P.bf16, col, i);
                    if (q8) {
                        sk2[(t - cmin) * DP + i] = elem_q8<D>(kq, kqs, xs, i);
                        sv2[(t - cmin) * DP + i] = elem_q8<D>(vq, vqs, xs, i);
                    }
                }
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
            const float *kr = t >= vc[k] && t < cmax ? sk2 + (t - cmin) * DP : sk + lane * DP;
            float s = 0.0f;
            for (int d = 0; d < D; d++) s = fmaf(qv[d], kr[d], s);
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
                const int t2 = t0 + tt;  /* warp-uniform source */
                const float *vr = (t2 >= vc[k] && t2 < cmax ? sv2 + (t2 - cmin) * DP : sv + tt * DP) + E * lane;
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
        if (P.vrot) {
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
    cw_load_rotate<E>(q + (size_t)v * D, C, rotate, lane, x);
#pragma unroll
    for (int j = 0; j < E / 4; j++)
        reinterpret_cast<float4 *>(out + (size_t)v * D + E * lane)[j] =
            make_float4(x[4 * j] * mul, x[4 * j + 1] * mul, x[4 * j + 2] * mul, x[4 * j + 3] * mul);
}

/* 2: the 8-warp tensor-core kernel (the default), 1: the 4-warp one, 0: the float32 one */
int g_tc = 2;

/* The masked kernel tc (g_tc's values) on kv->stream; asynchronous. The tensor-core kernels
 * prepare the queries themselves; the float32 one reads them prepared into qp ([rows,
 * q_heads, n_query, D] scratch, unused by the others). */
template <int D>
tqkv_status launch(const cuda_kv *kv, const float *q, int n_query, int q_heads, float scale,
                   const int *lo, const int *hi, float *qp, float *out,
                   const typename cuda_codec_of<D>::type &kc, const typename cuda_codec_of<D>::type &vc, int tc) {
    if (tc) {
        PParams<D> P = make_params<D>(kv, q_heads, n_query, lo, hi, q, out, kc, vc);
        P.qmul = scale * LOG2E;
        return tc == 2 ? prefill_tc8_launch<D>(P, kv->bf16, kv->stream) : prefill_tc_launch<D>(P, kv->bf16, kv->stream);
    }
    const size_t nv = (size_t)kv->rows * q_heads * n_query;
    const PParams<D> P = make_params<D>(kv, q_heads, n_query, lo, hi, qp, out, kc, vc);
    pqprep_kernel<D><<<(unsigned)((nv + 3) / 4), 128, 0, kv->stream>>>(q, qp, kc, P.krot, scale * LOG2E, (int)nv);
    const dim3 grid((unsigned)((n_query + QB - 1) / QB), (unsigned)kv->kvh, (unsigned)kv->rows);
    prefill_kernel<D><<<grid, NT, prefill_smem<D>(), kv->stream>>>(P);
    return cuda_check(cudaGetLastError(), "prefill kernel launch");
}

tqkv_status launch_dim(const cuda_kv *kv, const float *q, int n_query, int q_heads, float scale,
                       const int *lo, const int *hi, float *qp, float *out, int tc) {
    if (kv->d == CUDA_DIM)
        return launch<CUDA_DIM>(kv, q, n_query, q_heads, scale, lo, hi, qp, out, kv->kc, kv->vc, tc);
    return launch<CUDA_DIM_WIDE>(kv, q, n_query, q_heads, scale, lo, hi, qp, out, kv->kc256, kv->vc256, tc);
}

/* Room for 2 x n ints of ranges in kv's pinned and device buffers, the last copy out of the
 * pinned one done (a no-op wait when it ran long ago). */
tqkv_status ranges_room(cuda_kv *kv, size_t n) {
    if (kv->rng_ev) {
        tqkv_status st = cuda_check(cudaEventSynchronize(kv->rng_ev), "prefill ranges");
        if (st) return st;
    } else if (tqkv_status st = cuda_check(cudaEventCreateWithFlags(&kv->rng_ev, cudaEventDisableTiming),
                                           "prefill ranges event")) {
        return st;
    }
    if (n <= kv->rng_cap) return TQKV_OK;
    const size_t cap = n > 2 * kv->rng_cap ? n : 2 * kv->rng_cap;
    (void)cudaStreamSynchronize(kv->stream); /* the device copy is no longer read */
    if (kv->h_rng) cudaFreeHost(kv->h_rng);
    tqkv_cuda_free(kv->d_rng);
    kv->h_rng = NULL; kv->d_rng = NULL; kv->rng_cap = 0;
    tqkv_status st = cuda_check(cudaMallocHost((void **)&kv->h_rng, 2 * cap * sizeof(int)), "prefill ranges");
    if (!st) st = tqkv_cuda_malloc((void **)&kv->d_rng, 2 * cap * sizeof(int));
    if (!st) kv->rng_cap = cap;
    return st;
}

/* The row-local ranges [a, b) of lo / hi into tl / th (TQKV_ERANGE on a bad one). */
tqkv_status ranges_local(const cuda_kv *kv, int n_query, const int32_t *lo, const int32_t *hi, int *tl, int *th) {
    for (int r = 0; r < kv->rows; r++)
        for (int i = 0; i < n_query; i++) {
            const size_t k = (size_t)r * n_query + i;
            int a = lo[k] - kv->h_left_pad[r], b = hi[k] - kv->h_left_pad[r];
            if (a < 0) a = 0;
            if (b > kv->h_offset[r]) b = kv->h_offset[r];
            if (lo[k] > hi[k] || b < a)
                return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_attend_masked: bad range of row %d query %d", r, i);
            tl[k] = a;
            th[k] = b;
        }
    return TQKV_OK;
}

/* The float32 kernel: temporaries of its own, synchronous. */
tqkv_status attend_f32(cuda_kv *kv, const float *q, int n_query, int q_heads, float scale, const int *tl,
                       const int *th, float *out) {
    const size_t nrq = (size_t)kv->rows * n_query, nv = nrq * q_heads;
    int *dlo = NULL, *dhi = NULL;
    float *qp = NULL;
    tqkv_status st = tqkv_cuda_malloc((void **)&dlo, nrq * sizeof(int));
    if (!st) st = tqkv_cuda_malloc((void **)&dhi, nrq * sizeof(int));
    if (!st) st = tqkv_cuda_malloc((void **)&qp, nv * kv->d * sizeof(float));
    /* everything on the cache's stream: the encode of these tokens ran there */
    if (!st) st = cuda_check(cudaMemcpyAsync(dlo, tl, nrq * sizeof(int), cudaMemcpyHostToDevice, kv->stream),
                             "prefill ranges");
    if (!st) st = cuda_check(cudaMemcpyAsync(dhi, th, nrq * sizeof(int), cudaMemcpyHostToDevice, kv->stream),
                             "prefill ranges");
    if (!st) st = launch_dim(kv, q, n_query, q_heads, scale, dlo, dhi, qp, out, 0);
    (void)cudaStreamSynchronize(kv->stream); /* nothing queued still reads the temporaries */
    tqkv_cuda_free(dlo);
    tqkv_cuda_free(dhi);
    tqkv_cuda_free(qp);
    return st;
}

pthread_mutex_t g_setup_mu = PTHREAD_MUTEX_INITIALIZER;
unsigned g_setup_done; /* bit d: device d's setup ran (kernel attributes are per device) */

} // namespace

tqkv_status cuda_prefill_setup(void) {
    const unsigned bit = cuda_device_bit();
    if (__atomic_load_n(&g_setup_done, __ATOMIC_ACQUIRE) & bit) return TQKV_OK;
    pthread_mutex_lock(&g_setup_mu);
    tqkv_status st = TQKV_OK;
    if (!(g_setup_done & bit)) {
        st = cuda_check(cudaFuncSetAttribute(prefill_kernel<CUDA_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             prefill_smem<CUDA_DIM>()), "prefill shared memory");
        if (!st)
            st = cuda_check(cudaFuncSetAttribute(prefill_kernel<CUDA_DIM_WIDE>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 prefill_smem<CUDA_DIM_WIDE>()), "prefill shared memory");
        if (!st) st = prefill_tc_setup();
        if (!st) st = prefill_tc8_setup();
        const char *e = getenv("TQKV_PREFILL_TC");
        if (e && (!strcmp(e, "0") || !strcmp(e, "1") || !strcmp(e, "2"))) __atomic_store_n(&g_tc, e[0] - '0', __ATOMIC_RELAXED);
        if (!st) __atomic_fetch_or(&g_setup_done, bit, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_setup_mu);
    return st;
}

extern "C" int tqkv_cuda_prefill_tc(int on) {
    if (cuda_prefill_setup()) return -1;
    if (on >= 0) __atomic_store_n(&g_tc, on > 2 ? 2 : on, __ATOMIC_RELAXED);
    return __atomic_load_n(&g_tc, __ATOMIC_RELAXED);
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
    const int tc = __atomic_load_n(&g_tc, __ATOMIC_RELAXED);
    if (!tc) {
        std::vector<int> tl(nrq), th(nrq);
        st = ranges_local(kv, n_query, lo, hi, tl.data(), th.data());
        return st ? st : attend_f32(kv, q, n_query, q_heads, scale, tl.data(), th.data(), out);
    }
    /* the tensor-core kernels: ranges through kv's pinned buffer, no temporaries, no wait */
    if ((st = ranges_room(kv, nrq))) return st;
    if ((st = ranges_local(kv, n_query, lo, hi, kv->h_rng, kv->h_rng + nrq))) return st;
    st = cuda_check(cudaMemcpyAsync(kv->d_rng, kv->h_rng, 2 * nrq * sizeof(int), cudaMemcpyHostToDevice, kv->stream),
                    "prefill ranges");
    if (!st) st = cuda_check(cudaEventRecord(kv->rng_ev, kv->stream), "prefill ranges event");
    if (!st) st = launch_dim(kv, q, n_query, q_heads, scale, kv->d_rng, kv->d_rng + nrq, NULL, out, tc);
    return st;
}

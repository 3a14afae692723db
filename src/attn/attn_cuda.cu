/*
 * attn_cuda.cu - decode attention (one query per row) over the device cache at head_dim 128,
 * sm_90, and the decode entry points of every head dim.
 * Owns: the query preparation (rotation into K's domain, softmax scale and log2(e) folded,
 * fp16/bf16, stored in the split kernel's qdim order), the split kernel's d = 128
 * configurations and launch (split_kernel<F, NG, ST, 128>, attn_cuda_split.cuh: tq4, tq3, tq2
 * and the mixed tq K/V tq4/tq2, tq4/tq3, tq3/tq2, with the q8 recent window, fp8/fp8, the
 * dense bf16 baseline), the merge of split partials (log-sum-exp) with the single un-rotation of each
 * output, the workspace of d = 128, the one-time setup of every decode kernel
 * (tqkv_cuda_attn_setup), the public entry points (d = 256 goes to cuda_attend_decode_wide,
 * attn_cuda_wide.cu; fp8 at d = 256 (or at 128 with TQKV_FP8_TC=0), and tq2 and mixed tq
 * K/V at d = 256 to cuda_attend_decode_fmt, attn_cuda_fmt.cu), attention at an earlier length
 * (tqkv_cuda_kv_attend_back).
 * Must not: mutate the cache, or let a row's result depend on other rows (split sizes from
 * each row's own length, attn_cuda_splits.h; merges in split order); allocate, free or wait
 * inside a decode with a caller's workspace.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
#include "util/cuda_device.h"
}
#include "attn/attn_cuda_split.cuh"
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda.cuh"
#include "util/cuda_split.cuh"

namespace {

constexpr int D = CUDA_DIM;   /* this file's head dim (the split kernel's template argument) */

// ---------------------------------------------------------------------------
// Query preparation and merge (one warp per (row, q head), lane l: dims 4l..4l+3)
// ---------------------------------------------------------------------------
/* The query rotated into K's domain (tq), scaled by softmax scale * log2(e), rounded to
 * fp16 (bf16 for the dense cache) and stored in the split kernel's qdim<F, 128> order: element
 * 32 c + 2 p + e holds dim kdim(c, p, e), so a lane loads its 16 pairs as four uint4. */
template <int F>
__global__ void qprep_kernel(const float *__restrict__ q, uint16_t *__restrict__ out, cw_sbits sb,
                             float cinv, float mul, int n) {
    __shared__ float s_q[4][D];
    cuda_pdl_wait();    /* programmatic (attend, with the cache's switch): the append has completed */
    cuda_pdl_trigger(); /* a programmatic split kernel may start its prologue now (attend) */
    const int wv = threadIdx.x >> 5, v = blockIdx.x * 4 + wv, lane = threadIdx.x & 31;
    if (v >= n) return;
    const float4 in = reinterpret_cast<const float4 *>(q + (size_t)v * D)[lane];
    float x[4] = {in.x, in.y, in.z, in.w};
    if constexpr (F != F_BF16 && F != F_FP8) {   /* fp8 is not rotated */
        float s[4];
        cw_signs_n<4>(sb, lane, s);   /* K's signs (bits: no per-lane parameter reads) */
        cw_rotate(x, s, cinv, lane);
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

/* Per (row, q head) one warp (lane l: dims 4 l .. 4 l + 3): the row's splits' (max, sum,
 * output) merged in split order, divided by the sum, un-rotated once (V's signs sb and
 * 1 / sqrt(d) cinv; unrotate 0: the bf16 baseline). Lane s holds split s's (max, sum) (at
 * most 32 splits: split_count) and its weight 2^(max - M); the partial outputs are loaded 16
 * splits at a time (the first 16 beside the (max, sum) pairs), then added in split order as
 * before (only the row's own splits are read: a workspace slot past them may never have
 * been written). M is the max over the splits' maxima
 * (fmaxf from -inf: a NaN max is dropped, as in the sequential loop). xf (or NULL): the
 * output's GEMM split too (util/cuda_split.cuh: hi at v d + i, lo at n d + v d + i when parts
 * = 2), the next GEMM's input without a kernel between. */
__global__ void merge_kernel(const float *__restrict__ po, const float2 *__restrict__ pml,
                             const cuda_row *__restrict__ rows, float *__restrict__ out, cw_sbits sb,
                             float cinv, int unrotate, int qh, int nsmax, int n,
                             uint16_t *__restrict__ xf, int parts) {
    constexpr int B = 16;             /* splits' loads in flight */
    const int v = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    /* the row table before the wait: the append's launches that wrote it completed before
     * the query prep's wait returned, so before the split kernel (which scans it before its
     * own wait, too) and this grid started */
    const int ns = v < n ? min(split_count(rows[v / qh].ntok), min(nsmax, 32)) : 0;
    cuda_pdl_wait();    /* programmatic (attend): the split kernel's partials */
    cuda_pdl_trigger(); /* the kernel after (a programmatic one waits for this grid) */
    if (v >= n) return;
    const size_t base = (size_t)v * nsmax;
    /* the (max, sum) pairs and the first B partial outputs in one memory round trip (a split
     * whose max is -inf adds nothing below, whatever its output holds) */
    const float2 ml = lane < ns ? pml[base + lane] : make_float2(-INFINITY, 0.0f);
    float4 p[B];
#pragma unroll
    for (int j = 0; j < B; j++)
        if (j < ns) p[j] = reinterpret_cast<const float4 *>(po + (base + j) * D)[lane];
    float M = fmaxf(-INFINITY, ml.x);
#pragma unroll
    for (int m = 16; m; m >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, m));
    const unsigned use = __ballot_sync(0xffffffffu, lane < ns && ml.x != -INFINITY);
    const float fl = exp2f(ml.x - M);  /* split lane's weight (used where `use` has it) */
    float o[4] = {0, 0, 0, 0}, L = 0.0f;
    if (M != -INFINITY)
        for (int s0 = 0; s0 < ns; s0 += B) {
            if (s0) {
#pragma unroll
                for (int j = 0; j < B; j++)
                    if (s0 + j < ns) p[j] = reinterpret_cast<const float4 *>(po + (base + s0 + j) * D)[lane];
            }
#pragma unroll
            for (int j = 0; j < B; j++) {
                const int s = s0 + j;
                if (s >= ns) break;
                const float f = __shfl_sync(0xffffffffu, fl, s), y = __shfl_sync(0xffffffffu, ml.y, s);
                if (!((use >> s) & 1u)) continue;
                o[0] += p[j].x * f; o[1] += p[j].y * f; o[2] += p[j].z * f; o[3] += p[j].w * f;
                L += y * f;
            }
        }
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) o[k] *= inv;
    if (unrotate) {
        float s[4];
        cw_signs_n<4>(sb, lane, s);
        cw_unrotate(o, s, cinv, lane);
    }
    reinterpret_cast<float4 *>(out + (size_t)v * D)[lane] = make_float4(o[0], o[1], o[2], o[3]);
    if (xf) {
        uint16_t hi[4], lo[4];
#pragma unroll
        for (int k = 0; k < 4; k++) hi[k] = cuda_split_hi(o[k]), lo[k] = cuda_split_lo(o[k], hi[k]);
        const size_t i = (size_t)v * D + 4 * lane;
        *reinterpret_cast<uint2 *>(xf + i) = make_uint2(hi[0] | (uint32_t)hi[1] << 16, hi[2] | (uint32_t)hi[3] << 16);
        if (parts == 2)
            *reinterpret_cast<uint2 *>(xf + (size_t)n * D + i) =
                make_uint2(lo[0] | (uint32_t)lo[1] << 16, lo[2] | (uint32_t)lo[3] << 16);
    }
}

} // namespace

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------
/* The split kernel per format (indexed by F): groups per CTA (NG) x stages per warp (ST). tq:
 * 3 x 3 (12 warps per SM at 168 registers, one 64 KiB table, 36 staged tiles); 3 x 2, 2 x 4 and
 * 4 x 2 measured slower (bench/RESULTS.md). bf16: 2 groups, no staging. The pairs take tq4's
 * 3 x 3 (not tuned apart), but tq4/tq3: 3 x 2 (its 112-byte tokens' 36 stages and two tables
 * exceed the 227 KiB). fp8: 2 x 3 (no table, 8.4 KiB stages: 3 x 2 with its exchange slots
 * and the row scans would be 233.7 KiB; not tuned). */
struct SplitCfg {
    void (*fn)(Params<D>);
    int ng, st, smem;
    int ctas;                 /* resident CTAs (one per SM), set by the setup */
};
#define SPLIT_CFG(F, NG, ST) {split_kernel<F, NG, ST, D>, NG, ST, smem_bytes<F, NG, ST, D>(), 0}
constexpr int N_CFG = 8;
static SplitCfg g_cfg[N_CFG] = {SPLIT_CFG(F_TQ4, 3, 3),  SPLIT_CFG(F_TQ3, 3, 3), SPLIT_CFG(F_BF16, 2, 1),
                                SPLIT_CFG(F_TQ42, 3, 3), SPLIT_CFG(F_TQ2, 3, 3), SPLIT_CFG(F_TQ43, 3, 2),
                                SPLIT_CFG(F_TQ32, 3, 3), SPLIT_CFG(F_FP8, 2, 3)};
static_assert(F_TQ4 == 0 && F_TQ3 == 1 && F_BF16 == 2 && F_TQ42 == 3 && F_TQ2 == 4 && F_TQ43 == 5 && F_TQ32 == 6 &&
                  F_FP8 == 7,
              "g_cfg is indexed by F");
#undef SPLIT_CFG
static unsigned g_setup_done; /* bit d: device d's setup ran (kernel attributes are per device) */

__global__ void smem_probe_kernel(uint32_t *out) {
    extern __shared__ __align__(16) uint32_t s_dyn[];
    if (threadIdx.x == 0) *out = (uint32_t)__cvta_generic_to_shared(s_dyn) & 0xFFFFu;
}

/* Allow the split kernels their dynamic shared memory (the tq table is 64 KiB), size
 * their persistent grids (d = 128 here, d = 256 in cuda_wide_setup, which also reads
 * TQKV_WIDE_TC), and check where dynamic shared memory starts (TAB_BASE). Idempotent. */
static pthread_mutex_t g_setup_mu = PTHREAD_MUTEX_INITIALIZER;
static tqkv_status attn_cuda_setup_locked(void);

extern "C" tqkv_status tqkv_cuda_attn_setup(void) {
    const tqkv_status pst = cuda_prefill_setup(); /* the masked kernels */
    if (pst) return pst;
    const unsigned bit = cuda_device_bit();
    if (__atomic_load_n(&g_setup_done, __ATOMIC_ACQUIRE) & bit) return TQKV_OK;
    pthread_mutex_lock(&g_setup_mu);
    const tqkv_status st = (g_setup_done & bit) ? TQKV_OK : attn_cuda_setup_locked();
    pthread_mutex_unlock(&g_setup_mu);
    return st;
}

static tqkv_status attn_cuda_setup_locked(void) {
#if TQKV_TQ3_SOL
    fprintf(stderr, "tqkv: built with the TQKV_TQ3_SOL=%d probe: tq3 decode attention is wrong "
            "(timing only)\n", TQKV_TQ3_SOL);
#endif
    (void)tqkv_cuda_attn_pdl(-1); /* the environment's choice, unless one was made */
    cudaError_t e = cudaSuccess;
    int dev = 0, sms = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    for (int f = 0; f < N_CFG && e == cudaSuccess; f++) {
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
    if (!st) st = cuda_wide_setup(sms > 0 ? sms : 1); /* d = 256 (attn_cuda_wide.cu) */
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
    __atomic_fetch_or(&g_setup_done, cuda_device_bit(), __ATOMIC_RELEASE);
    return TQKV_OK;
}
/* Workspace layout for rows x q_heads vectors and nsmax splits: partial outputs
 * [nv, nsmax, D] f32, (max, sum) [nv, nsmax] float2, rotated queries [nv, D] fp16 (room for
 * [nv, D] f32: the float32 kernel of attn_cuda_fmt.cu, for the other formats, keeps its
 * queries there and its partials in the same split bound). */
static size_t ws_need(size_t nv, int nsmax, size_t *po_b, size_t *pml_b) {
    *po_b = nv * nsmax * D * sizeof(float);
    *pml_b = (nv * nsmax * sizeof(float2) + 255) / 256 * 256; /* the queries after it: 16-byte loads */
    return *po_b + *pml_b + nv * D * sizeof(float) + 256;
}

extern "C" size_t tqkv_cuda_attend_ws_bytes(int rows, int q_heads, int max_tokens) {
    size_t a, b;
    return ws_need((size_t)rows * q_heads, split_bound(max_tokens), &a, &b);
}

static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          uint16_t *xf, int parts, void *ws, size_t ws_bytes);

extern "C" tqkv_status tqkv_cuda_kv_attend_ws(cuda_kv *kv, const float *q, int q_heads, float scale,
                                         float *out, void *ws, size_t ws_bytes) {
    int xf_done;
    return tqkv_cuda_kv_attend_ws_xf(kv, q, q_heads, scale, out, NULL, 1, ws, ws_bytes, &xf_done);
}

extern "C" tqkv_status tqkv_cuda_kv_attend_ws_xf(cuda_kv *kv, const float *q, int q_heads, float scale,
                                            float *out, uint16_t *xf, int parts, void *ws,
                                            size_t ws_bytes, int *xf_done) {
    if (!xf_done) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_ws_xf: NULL xf_done");
    *xf_done = 0;
    if (!ws) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_ws: NULL workspace");
    if (xf && parts != 1 && parts != 2)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend_ws_xf: parts %d (1 or 2)", parts);
    /* fp8, tq2, mixed tq: the float32 kernel of attn_cuda_fmt.cu (both dims) */
    if (cuda_kv_fmt_generic(kv)) return cuda_attend_decode_fmt(kv, q, q_heads, scale, out, ws, ws_bytes);
    /* d = 256: attn_cuda_wide.cu (the tensor-core or the float32 split kernel, the merge) */
    if (kv && kv->d != D) return cuda_attend_decode_wide(kv, q, q_heads, scale, out, ws, ws_bytes);
    const tqkv_status st = attend(kv, q, q_heads, scale, out, xf, parts, ws, ws_bytes);
    *xf_done = !st && xf != NULL;
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_attend(cuda_kv *kv, const float *q, int q_heads, float scale,
                                      float *out) {
    if (cuda_kv_fmt_generic(kv)) return cuda_attend_decode_fmt(kv, q, q_heads, scale, out, NULL, 0);
    if (kv && kv->d != D) return cuda_attend_decode_wide(kv, q, q_heads, scale, out, NULL, 0);
    return attend(kv, q, q_heads, scale, out, NULL, 1, NULL, 0);
}

/* The split kernel's format of cache kv (its K and V formats), -1 for none. */
static int split_fmt(const cuda_kv *kv) {
    if (kv->bf16) return F_BF16;
    if (kv->kfmt == TQKV_TQ4 && kv->vfmt == TQKV_TQ4) return F_TQ4;
    if (kv->kfmt == TQKV_TQ3 && kv->vfmt == TQKV_TQ3) return F_TQ3;
    if (kv->kfmt == TQKV_TQ4 && kv->vfmt == TQKV_TQ2) return F_TQ42;
    if (kv->kfmt == TQKV_TQ2 && kv->vfmt == TQKV_TQ2) return F_TQ2;
    if (kv->kfmt == TQKV_TQ4 && kv->vfmt == TQKV_TQ3) return F_TQ43;
    if (kv->kfmt == TQKV_TQ3 && kv->vfmt == TQKV_TQ2) return F_TQ32;
    if (kv->kfmt == TQKV_FP8 && kv->vfmt == TQKV_FP8) return F_FP8;
    return -1;
}
/* payload bytes per token of K and V, by F (g_cfg's order) */
static const size_t g_kpay[N_CFG] = {kpay<F_TQ4, D>(), kpay<F_TQ3, D>(),  kpay<F_BF16, D>(), kpay<F_TQ42, D>(),
                                     kpay<F_TQ2, D>(), kpay<F_TQ43, D>(), kpay<F_TQ32, D>(), kpay<F_FP8, D>()};
static const size_t g_vpay[N_CFG] = {vpay<F_TQ4, D>(), vpay<F_TQ3, D>(),  vpay<F_BF16, D>(), vpay<F_TQ42, D>(),
                                     vpay<F_TQ2, D>(), vpay<F_TQ43, D>(), vpay<F_TQ32, D>(), vpay<F_FP8, D>()};

/* ws == NULL: the cache's own workspace, grown as needed. xf: the merge also writes the
 * output's GEMM split (parts 1 or 2), or NULL. */
static tqkv_status attend(cuda_kv *kv, const float *q, int q_heads, float scale, float *out,
                          uint16_t *xf, int parts, void *ws, size_t ws_bytes) {
    if (!kv || !q || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: NULL argument");
    if (q_heads < 1 || q_heads % kv->kvh || q_heads / kv->kvh > CUDA_MAX_G)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_attend: q_heads %d must be a multiple of kv_heads %d "
                         "with at most %d query heads per kv head", q_heads, kv->kvh, CUDA_MAX_G);
    if (kv->rows == 0) return TQKV_OK;
    tqkv_status sst = tqkv_cuda_attn_setup(); /* model states run it at init, before any capture */
    if (sst) return sst;
    const int fmt = split_fmt(kv);
    if (fmt < 0 || kv->d != D || kv->kpay != g_kpay[fmt] || kv->vpay != g_vpay[fmt])
        return tqkv_fail(TQKV_EUNSUPPORTED, "tqkv_cuda_kv_attend: the device kernels need d %d and K/V formats "
                         "tq4/tq4, tq3/tq3, tq4/tq2, tq2/tq2, tq4/tq3, tq3/tq2, fp8/fp8 or the dense bf16 cache", D);
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
    const cw_sbits ksb = cw_sbits_of(kv->kc.signs, D);
    void (*prep)(const float *, uint16_t *, cw_sbits, float, float, int) =
        fmt == F_TQ4 ? qprep_kernel<F_TQ4> : fmt == F_TQ3 ? qprep_kernel<F_TQ3>
        : fmt == F_TQ42 ? qprep_kernel<F_TQ42> : fmt == F_TQ2 ? qprep_kernel<F_TQ2>
        : fmt == F_TQ43 ? qprep_kernel<F_TQ43> : fmt == F_TQ32 ? qprep_kernel<F_TQ32>
        : fmt == F_FP8 ? qprep_kernel<F_FP8> : qprep_kernel<F_BF16>;
    cuda_pdl_launch(cuda_attn_pdl_on(), prep, dim3(qgrid), dim3(128), 0, kv->stream, q, qp, ksb,
                    kv->kc.inv, mul, nvi);
    Params<D> P = split_params<D>(kv, kv->kc, kv->vc, qp, po, pml, q_heads, nsmax);
    P.pdl = cuda_attn_pdl_on();
    /* persistent: the resident CTAs, at most one per possible work item (a CTA's groups
     * take items gridDim.x apart, so the first items land on different SMs). pdl: the split
     * kernel's prologue (table, row scans, first copies) overlaps the query prep, the merge's
     * launch the split kernel's end; the bits are the same either way. */
    const SplitCfg *k = &g_cfg[fmt];
    const long items_ub = (long)kv->rows * kv->kvh * nsmax;
    const unsigned grid = (unsigned)(items_ub < k->ctas ? items_ub : k->ctas);
    cuda_pdl_launch(P.pdl, k->fn, dim3(grid), dim3(k->ng * NW * 32), (size_t)k->smem, kv->stream, P);
    cuda_pdl_launch(P.pdl, merge_kernel, dim3(qgrid), dim3(128), 0, kv->stream, (const float *)po,
               (const float2 *)pml, (const cuda_row *)kv->d_rows, out, cw_sbits_of(kv->vc.signs, D),
               kv->vc.inv, (int)(fmt != F_BF16 && fmt != F_FP8), q_heads, nsmax, nvi, xf,
               parts); /* tq: un-rotate */
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


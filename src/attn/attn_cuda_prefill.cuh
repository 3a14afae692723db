/*
 * attn_cuda_prefill.cuh - what the masked prefill kernels share: their arguments
 * (PParams, make_params) and the tensor-core kernels' entry points.
 * attn_cuda_prefill.cu owns the contract, the float32 kernel and the dispatch;
 * attn_cuda_prefill_tc.cu the 4-warp tensor-core kernel (TQKV_PREFILL_TC=1, for A/B runs),
 * attn_cuda_prefill_tc8.cu the 8-warp one (the default, TQKV_PREFILL_TC=2).
 * Must not: hold kernel code or state.
 */
#ifndef TQKV_ATTN_CUDA_PREFILL_CUH
#define TQKV_ATTN_CUDA_PREFILL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"

template <int D> struct PParams {
    const uint8_t *kd, *vd;
    const uint16_t *ks, *vs;
    const int8_t *kw, *vw;             /* q8 ring */
    const uint16_t *kws, *vws;
    const int8_t *kx, *vx;             /* side buffer of the last append */
    const uint16_t *kxs, *vxs;
    const int *x;                      /* [2, rows] side-buffer tokens [xlo, xhi), or NULL */
    size_t kpay, vpay;
    int ring, cap, kvh, G, qh, nq, bf16, nrows, xcap;
    int krot, vrot;                    /* K / V planes hold rotated tq indices (queries are
                                        * rotated by K's codec, outputs un-rotated by V's);
                                        * 0: fp8 and the bf16 baseline, stored as given */
    int window;                        /* q8 window W (0: none): query p reads token t from
                                        * its q8 copy when t >= max(p + 1 - W, q8lo) */
    const cuda_row *rows;
    const int *lo, *hi;                /* [rows, nq] visible tokens [lo, hi); NULL: every
                                        * token the row holds (nq == 1; the d = 256 decode
                                        * was this before its split kernel, unused now) */
    const float *q;                    /* [rows, qh, nq, D]: prepared (rotated, scaled) when
                                        * qmul == 0; else as given, and the tensor-core
                                        * kernel rotates (tq) and multiplies by qmul itself */
    float qmul;
    float *out;                        /* [rows, qh, nq, D] (V domain; un-rotated later) */
    typename cuda_codec_of<D>::type kc, vc;
};


/* The kernels' arguments for kv (lo, hi: device ranges or NULL for whole rows). */
template <int D>
static inline PParams<D> make_params(const cuda_kv *kv, int q_heads, int n_query, const int *lo, const int *hi,
                       const float *qp, float *out, const typename cuda_codec_of<D>::type &kc,
                       const typename cuda_codec_of<D>::type &vc) {
    PParams<D> P;
    P.kd = kv->kd; P.vd = kv->vd; P.ks = kv->ks; P.vs = kv->vs;
    P.kw = kv->kw; P.vw = kv->vw; P.kws = kv->kws; P.vws = kv->vws;
    P.kx = kv->kx; P.vx = kv->vx; P.kxs = kv->kxs; P.vxs = kv->vxs;
    P.x = kv->ring > 0 ? cuda_kv_side_ranges(kv) : nullptr;
    P.xcap = kv->xcap; P.nrows = kv->rows;
    P.window = kv->ring > 0 ? kv->cfg.window : 0;
    P.kpay = kv->kpay; P.vpay = kv->vpay; P.ring = kv->ring > 0 ? kv->ring : 1; P.cap = kv->cap;
    P.kvh = kv->kvh; P.G = q_heads / kv->kvh; P.qh = q_heads; P.nq = n_query; P.bf16 = kv->bf16;
    P.krot = !kv->bf16 && CUDA_BITS_ROTATED(kc.bits);
    P.vrot = !kv->bf16 && CUDA_BITS_ROTATED(vc.bits);
    P.qmul = 0.0f;
    P.rows = kv->d_rows; P.lo = lo; P.hi = hi; P.q = qp; P.out = out; P.kc = kc; P.vc = vc;
    return P;
}


/* The 4-warp tensor-core kernel (attn_cuda_prefill_tc.cu) on P for caches of head dim D, bf16: the
 * dense bf16 baseline; asynchronous on `stream`. Its setup (shared-memory limits) once. */
template <int D> tqkv_status prefill_tc_launch(const PParams<D> &P, int bf16, cudaStream_t stream);
tqkv_status prefill_tc_setup(void);
/* The same for the 8-warp kernel (attn_cuda_prefill_tc8.cu, the default). */
template <int D> tqkv_status prefill_tc8_launch(const PParams<D> &P, int bf16, cudaStream_t stream);
tqkv_status prefill_tc8_setup(void);

#endif

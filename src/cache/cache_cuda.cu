/*
 * cache_cuda.cu - the device cache object of the CUDA backend and small device helpers.
 * Owns: cuda_kv init/free, upload of a host tqkv_batch (byte copies of its planes, rings
 * and row state), download, append (row state; the encode kernel is in codec_cuda.cu),
 * the device availability probe, timers, copy bandwidth and the random fill used by the
 * benchmark, and the switch of the decode chain's programmatic launches (tqkv_cuda_attn_pdl:
 * the append's encode and row advance here, the attention's query prep, split kernel and
 * merge in attn_cuda.cu).
 * Must not: run attention (attn_cuda.cu) or encode (codec_cuda.cu); change the host batch.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

extern "C" {
#include "cache/cache_impl.h"
#include "codec/codec.h"
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"
#include "codec/codec_cuda_encode.cuh"
#include "util/cuda_pdl.cuh"

// ---------------------------------------------------------------------------
// Programmatic launches of a decode step's cache kernels (util/cuda_pdl.cuh)
// ---------------------------------------------------------------------------
/* The append's encode and row advance and the attention's query prep, split kernel and merge
 * (tensor-core path, both head dims): -1 until the first attention setup reads TQKV_ATTN_PDL
 * (0: off; unset or anything else: on) or tqkv_cuda_attn_pdl sets it. */
static int g_attn_pdl = -1;
static void attn_pdl_default(void) { /* the environment's choice, unless one was made */
    const char *env = getenv("TQKV_ATTN_PDL");
    int unset = -1;
    __atomic_compare_exchange_n(&g_attn_pdl, &unset, !(env && !strcmp(env, "0")), false,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
extern "C" int tqkv_cuda_attn_pdl(int on) {
    attn_pdl_default();
    if (on >= 0) return __atomic_exchange_n(&g_attn_pdl, on ? 1 : 0, __ATOMIC_ACQ_REL);
    return __atomic_load_n(&g_attn_pdl, __ATOMIC_ACQUIRE);
}
int cuda_attn_pdl_on(void) { return __atomic_load_n(&g_attn_pdl, __ATOMIC_ACQUIRE) > 0; }

// ---------------------------------------------------------------------------
// Errors and availability
// ---------------------------------------------------------------------------
tqkv_status cuda_check(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return TQKV_OK;
    /* an API error such as an allocation failure is also the runtime's "last error":
     * clear it, or a later launch check would report it again (sticky errors stay) */
    (void)cudaGetLastError();
    const tqkv_status s = e == cudaErrorMemoryAllocation ? TQKV_ENOMEM : TQKV_EUNSUPPORTED;
    return tqkv_fail(s, "CUDA: %s: %s", what, cudaGetErrorString(e));
}

extern "C" int tqkv_cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n > 0;
}

extern "C" tqkv_status tqkv_cuda_device_info(char *name, size_t cap, int *sms, int *mem_clock_khz,
                                        int *bus_bits, int *sm_clock_khz) {
    cudaDeviceProp p;
    tqkv_status st = cuda_check(cudaGetDeviceProperties(&p, 0), "device properties");
    if (st) return st;
    if (name && cap) snprintf(name, cap, "%s", p.name);
    int v = 0;
    if (sms) *sms = p.multiProcessorCount;
    if (mem_clock_khz) *mem_clock_khz = cudaDeviceGetAttribute(&v, cudaDevAttrMemoryClockRate, 0) ? 0 : v;
    if (bus_bits) *bus_bits = cudaDeviceGetAttribute(&v, cudaDevAttrGlobalMemoryBusWidth, 0) ? 0 : v;
    if (sm_clock_khz) *sm_clock_khz = cudaDeviceGetAttribute(&v, cudaDevAttrClockRate, 0) ? 0 : v;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Memory helpers
// ---------------------------------------------------------------------------
extern "C" tqkv_status tqkv_cuda_malloc(void **p, size_t bytes) {
    *p = NULL;
    return cuda_check(cudaMalloc(p, bytes ? bytes : 1), "cudaMalloc");
}
extern "C" void tqkv_cuda_free(void *p) {
    if (p) cudaFree(p);
}
extern "C" tqkv_status tqkv_cuda_h2d(void *dst, const void *src, size_t bytes) {
    return cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
}
extern "C" tqkv_status tqkv_cuda_d2h(void *dst, const void *src, size_t bytes) {
    return cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}
extern "C" tqkv_status tqkv_cuda_sync(void) {
    tqkv_status st = cuda_check(cudaGetLastError(), "kernel launch");
    if (st) return st;
    return cuda_check(cudaDeviceSynchronize(), "synchronize");
}

__device__ static inline uint64_t cf_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* x [n]: Box-Muller pairs from a counter-based splitmix64. */
__global__ void cf_fill_normal_kernel(float *x, size_t n, uint64_t seed, float sd) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; 2 * i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint64_t a = cf_mix(seed + 0x9E3779B97F4A7C15ull * (2 * i + 1));
        const uint64_t b = cf_mix(seed + 0x9E3779B97F4A7C15ull * (2 * i + 2));
        const float u1 = ((float)(a >> 40) + 1.0f) * (1.0f / 16777216.0f);
        const float u2 = (float)(b >> 40) * (1.0f / 16777216.0f);
        const float m = sqrtf(-2.0f * logf(u1)) * sd;
        float s, c;
        sincospif(2.0f * u2, &s, &c);
        x[2 * i] = m * c;
        if (2 * i + 1 < n) x[2 * i + 1] = m * s;
    }
}

extern "C" tqkv_status tqkv_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    size_t f = 0, t = 0;
    tqkv_status st = cuda_check(cudaMemGetInfo(&f, &t), "cudaMemGetInfo");
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return st;
}

extern "C" tqkv_status tqkv_cuda_fill_normal_on(float *x, size_t n, uint64_t seed, float sd,
                                                void *stream) {
    cf_fill_normal_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>(x, n, seed, sd);
    return cuda_check(cudaGetLastError(), "fill kernel launch");
}

extern "C" tqkv_status tqkv_cuda_fill_normal(float *x, size_t n, uint64_t seed, float sd) {
    tqkv_status st = tqkv_cuda_fill_normal_on(x, n, seed, sd, NULL);
    return st ? st : tqkv_cuda_sync();
}

extern "C" tqkv_status tqkv_cuda_stream_create(void **stream) {
    cudaStream_t s = NULL;
    *stream = NULL;
    tqkv_status st = cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create");
    if (!st) *stream = s;
    return st;
}
extern "C" void tqkv_cuda_stream_destroy(void *stream) {
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
}
extern "C" tqkv_status tqkv_cuda_stream_sync(void *stream) {
    return cuda_check(cudaStreamSynchronize((cudaStream_t)stream), "stream synchronize");
}
extern "C" tqkv_status tqkv_cuda_capture_begin(void *stream) {
    return cuda_check(cudaStreamBeginCapture((cudaStream_t)stream, cudaStreamCaptureModeThreadLocal),
                      "begin capture");
}
extern "C" tqkv_status tqkv_cuda_capture_end(void *stream, void **exec) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    *exec = NULL;
    tqkv_status st = cuda_check(cudaStreamEndCapture((cudaStream_t)stream, &g), "end capture");
    if (!st) st = cuda_check(cudaGraphInstantiate(&x, g, 0), "graph instantiate");
    if (g) cudaGraphDestroy(g);
    if (!st) *exec = x;
    return st;
}
extern "C" tqkv_status tqkv_cuda_graph_launch(void *exec, void *stream) {
    return cuda_check(cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream), "graph launch");
}
extern "C" void tqkv_cuda_graph_free(void *exec) {
    if (exec) cudaGraphExecDestroy((cudaGraphExec_t)exec);
}

extern "C" tqkv_status tqkv_cuda_timer_start(void **t) {
    cudaEvent_t *e = (cudaEvent_t *)calloc(2, sizeof(cudaEvent_t));
    if (!e) return tqkv_fail(TQKV_ENOMEM, "timer: out of memory");
    tqkv_status st = cuda_check(cudaEventCreate(&e[0]), "event");
    if (!st) st = cuda_check(cudaEventCreate(&e[1]), "event");
    if (!st) st = cuda_check(cudaEventRecord(e[0]), "event record");
    if (st) {
        free(e);
        return st;
    }
    *t = e;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_timer_stop(void *t, double *ms) {
    cudaEvent_t *e = (cudaEvent_t *)t;
    float f = 0;
    tqkv_status st = cuda_check(cudaEventRecord(e[1]), "event record");
    if (!st) st = cuda_check(cudaEventSynchronize(e[1]), "event sync");
    if (!st) st = cuda_check(cudaEventElapsedTime(&f, e[0], e[1]), "elapsed");
    cudaEventDestroy(e[0]);
    cudaEventDestroy(e[1]);
    free(e);
    *ms = f;
    return st;
}

extern "C" tqkv_status tqkv_cuda_copy_ms(size_t bytes, int reps, double *ms) {
    void *a = NULL, *b = NULL;
    tqkv_status st = tqkv_cuda_malloc(&a, bytes);
    if (!st) st = tqkv_cuda_malloc(&b, bytes);
    if (!st) st = cuda_check(cudaMemset(a, 1, bytes), "memset");
    if (reps < 1) reps = 1;
    std::vector<double> t((size_t)reps); // sized once: no out-of-line growth code (symbols)
    for (int i = -2; !st && i < reps; i++) {
        void *tm = NULL;
        st = tqkv_cuda_timer_start(&tm);
        if (st) break;
        st = cuda_check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "d2d copy");
        double x = 0;
        if (!st) st = tqkv_cuda_timer_stop(tm, &x);
        if (i >= 0) t[(size_t)i] = x;
    }
    tqkv_cuda_free(a);
    tqkv_cuda_free(b);
    if (st) return st;
    std::sort(t.begin(), t.end());
    *ms = t[t.size() / 2];
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Device cache
// ---------------------------------------------------------------------------
/* c->dim == DIM (the signs array's length). */
template <typename CC, int DIM> static void codec_params(const struct tqkv_codec *c, CC *out) {
    static_assert(sizeof(out->signs) == DIM * sizeof(float), "codec parameters of another dim");
    memset(out, 0, sizeof *out);
    out->bits = c->format == TQKV_FP8 ? CUDA_BITS_FP8 : c->bits;
    out->inv = (float)(1.0 / sqrt((double)c->dim));
    for (int i = 0; i < 16; i++) out->cent[i] = c->centroids[i];
    for (int i = 0; i < 15; i++) out->bounds[i] = c->bounds[i];
    for (int i = 0; i < DIM; i++) out->signs[i] = c->signs ? c->signs[i] : 1.0f;
}

extern "C" void tqkv_cuda_kv_free(cuda_kv *kv) {
    if (!kv) return;
    if (kv->stream) cudaStreamSynchronize(kv->stream); /* nothing queued still reads it */
    tqkv_cuda_free(kv->kd); tqkv_cuda_free(kv->vd); tqkv_cuda_free(kv->ks); tqkv_cuda_free(kv->vs);
    tqkv_cuda_free(kv->kw); tqkv_cuda_free(kv->vw); tqkv_cuda_free(kv->kws); tqkv_cuda_free(kv->vws);
    tqkv_cuda_free(kv->d_rows); tqkv_cuda_free(kv->ws); tqkv_cuda_free(kv->d_work);
    tqkv_cuda_free(kv->kx); tqkv_cuda_free(kv->vx); tqkv_cuda_free(kv->kxs); tqkv_cuda_free(kv->vxs);
    tqkv_cuda_free(kv->d_x); tqkv_cuda_free(kv->d_rng);
    if (kv->h_rng) cudaFreeHost(kv->h_rng);
    if (kv->rng_ev) cudaEventDestroy(kv->rng_ev);
    free(kv->h_offset); free(kv->h_left_pad); free(kv->h_win_lo); free(kv->h_spec_base);
    free(kv->h_x_off);
    free(kv);
}

extern "C" size_t tqkv_cuda_kv_bytes(const cuda_kv *kv) {
    const size_t rh = (size_t)kv->row_cap * kv->kvh; /* spare rows included: they are held */
    size_t b = rh * kv->cap * (kv->kpay + kv->vpay + 2 * (size_t)(kv->kns + kv->vns));
    b += (size_t)(kv->kwin + kv->vwin) * rh * kv->ring * (kv->d + 2 * (kv->d / 32));
    return b;
}

/* Storage ids: one per init, never reused in the process. */
static std::atomic<uint64_t> g_storage_ids{0};

extern "C" tqkv_status tqkv_cuda_kv_init(cuda_kv **out, const tqkv_cache_config *cfg, int bf16,
                                    int rows, int cap) {
    return cuda_kv_init_on(out, cfg, bf16, rows, cap, 0);
}

tqkv_status cuda_kv_init_on(cuda_kv **out, const tqkv_cache_config *cfg, int bf16, int rows,
                            int cap, cudaStream_t stream) {
    if (!out || !cfg) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_init: NULL argument");
    *out = NULL;
    tqkv_status st = batch_check_config(cfg);
    if (st) return st;
    if (cfg->window_keys_only)
        return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA cache: a keys-only q8 window "
                         "(window_keys_only) runs on the CPU cache only");
    if (cfg->head_dim != CUDA_DIM && cfg->head_dim != CUDA_DIM_WIDE)
        return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA cache: head_dim %d is not supported (the "
                         "device kernels are built for %d and %d)", cfg->head_dim, CUDA_DIM,
                         CUDA_DIM_WIDE);
    if (!bf16 && !tqkv_cuda_kv_formats_ok(cfg->k_format, cfg->v_format))
        return tqkv_fail(TQKV_EUNSUPPORTED, "CUDA cache: K/V formats %s/%s are not supported "
                         "(tq4/tq4, tq3/tq3, fp8/fp8, tq K and V with K bits >= V bits, or "
                         "the bf16 baseline)",
                         tqkv_format_name(cfg->k_format), tqkv_format_name(cfg->v_format));
    if (rows < 0 || cap < 1) return tqkv_fail(TQKV_EINVAL, "CUDA cache: rows must be >= 0 and cap >= 1");
    cuda_kv *kv = (cuda_kv *)calloc(1, sizeof *kv);
    if (!kv) return tqkv_fail(TQKV_ENOMEM, "CUDA cache: out of memory");
    kv->cfg = *cfg;
    kv->bf16 = bf16 != 0;
    kv->stream = stream;
    kv->storage_id = ++g_storage_ids;
    kv->rows = kv->row_cap = rows;
    kv->cap = cap;
    kv->d = cfg->head_dim;
    kv->kvh = cfg->kv_heads;
    kv->kfmt = cfg->k_format;
    kv->vfmt = cfg->v_format;
    struct tqkv_codec kc, vc;
    memset(&kc, 0, sizeof kc);
    memset(&vc, 0, sizeof vc);
    if (!kv->bf16) {
        st = codec_setup(&kc, cfg->k_format, kv->d, cfg->seed);
        if (!st) st = codec_setup(&vc, cfg->v_format, kv->d, cfg->seed);
        if (st) {
            codec_teardown(&kc);
            free(kv);
            return st;
        }
        kv->kpay = kc.payload; kv->vpay = vc.payload;
        kv->kns = kc.n_scales; kv->vns = vc.n_scales;
        if (kv->d == CUDA_DIM) {
            codec_params<cuda_codec, CUDA_DIM>(&kc, &kv->kc);
            codec_params<cuda_codec, CUDA_DIM>(&vc, &kv->vc);
        } else {
            codec_params<cuda_codec256, CUDA_DIM_WIDE>(&kc, &kv->kc256);
            codec_params<cuda_codec256, CUDA_DIM_WIDE>(&vc, &kv->vc256);
        }
        codec_teardown(&kc);
        codec_teardown(&vc);
        kv->ring = batch_ring_for(cfg); /* 0 for fp8 (K or V tq: both are, formats_ok) */
        kv->kwin = kv->vwin = kv->ring > 0;
    } else {
        kv->kpay = kv->vpay = 2 * (size_t)kv->d;
        kv->kfmt = kv->vfmt = TQKV_F16; /* placeholder: 2 bytes per value */
    }
    const size_t rh = (size_t)rows * kv->kvh;
    const size_t nr = rows > 0 ? (size_t)rows : 1;
    kv->h_offset = (int *)calloc(nr, sizeof(int));
    kv->h_left_pad = (int *)calloc(nr, sizeof(int));
    kv->h_win_lo = (int *)calloc(nr, sizeof(int));
    kv->h_spec_base = (int *)calloc(nr, sizeof(int));
    if (!kv->h_offset || !kv->h_left_pad || !kv->h_win_lo || !kv->h_spec_base) {
        tqkv_cuda_kv_free(kv);
        return tqkv_fail(TQKV_ENOMEM, "CUDA cache: out of memory");
    }
    st = tqkv_cuda_malloc((void **)&kv->kd, rh * cap * kv->kpay);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->vd, rh * cap * kv->vpay);
    /* scales: 16 bytes of slack, as the decode attention copies a tile's scales as 80 bytes
     * from the 16-byte floor at or below them; zeroed, so that those bytes around the tile
     * (left padding, tokens not yet written, the slack) are never uninitialised reads */
    if (!st && kv->kns) st = tqkv_cuda_malloc((void **)&kv->ks, rh * cap * kv->kns * 2 + 16);
    if (!st && kv->vns) st = tqkv_cuda_malloc((void **)&kv->vs, rh * cap * kv->vns * 2 + 16);
    if (!st && kv->kns) st = cuda_check(cudaMemsetAsync(kv->ks, 0, rh * cap * kv->kns * 2 + 16, kv->stream), "scales");
    if (!st && kv->vns) st = cuda_check(cudaMemsetAsync(kv->vs, 0, rh * cap * kv->vns * 2 + 16, kv->stream), "scales");
    if (!st && kv->ring) {
        st = tqkv_cuda_malloc((void **)&kv->kw, rh * kv->ring * kv->d);
        if (!st) st = tqkv_cuda_malloc((void **)&kv->vw, rh * kv->ring * kv->d);
        if (!st) st = tqkv_cuda_malloc((void **)&kv->kws, rh * kv->ring * (kv->d / 32) * 2);
        if (!st) st = tqkv_cuda_malloc((void **)&kv->vws, rh * kv->ring * (kv->d / 32) * 2);
    }
    if (!st) st = tqkv_cuda_malloc((void **)&kv->d_rows, sizeof(cuda_row) * nr);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->d_work, 2 * sizeof(int));
    if (!st) st = cuda_check(cudaMemsetAsync(kv->d_work, 0, 2 * sizeof(int), kv->stream), "attention counters");
    if (!st) st = cuda_kv_sync_rows(kv);
    if (st) {
        tqkv_cuda_kv_free(kv);
        return st;
    }
    *out = kv;
    return TQKV_OK;
}

tqkv_status cuda_kv_sync_rows(cuda_kv *kv) {
    std::vector<cuda_row> h((size_t)kv->rows);
    for (int r = 0; r < kv->rows; r++) {
        cuda_row &w = h[(size_t)r];
        w.ntok = kv->h_offset[r];
        w.left_pad = kv->h_left_pad[r];
        int s = w.ntok;
        if (kv->ring > 0) { /* plane_window_start */
            s = w.ntok - kv->cfg.window;
            if (s < kv->h_win_lo[r]) s = kv->h_win_lo[r];
            if (s < 0) s = 0;
        }
        w.wstart = s;
        w.col0 = w.left_pad + w.ntok;
        w.win_lo = kv->h_win_lo[r];
    }
    /* pageable source: staged before the call returns, so h may go */
    return kv->rows ? cuda_check(cudaMemcpyAsync(kv->d_rows, h.data(), sizeof(cuda_row) * kv->rows,
                                                 cudaMemcpyHostToDevice, kv->stream), "upload row table")
                    : TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_set_stream(cuda_kv *kv, void *stream) {
    if (!kv) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_set_stream: NULL cache");
    if ((cudaStream_t)stream == kv->stream) return TQKV_OK;
    tqkv_status st = cuda_check(cudaStreamSynchronize(kv->stream), "cache stream switch");
    if (!st) kv->stream = (cudaStream_t)stream;
    return st;
}

extern "C" int tqkv_cuda_kv_head_dim(const cuda_kv *kv) { return kv ? kv->d : 0; }

extern "C" uint64_t tqkv_cuda_kv_storage_id(const cuda_kv *kv) { return kv ? kv->storage_id : 0; }

extern "C" const int *tqkv_cuda_kv_offsets(const cuda_kv *kv) { return kv->h_offset; }
extern "C" const int *tqkv_cuda_kv_left_pads(const cuda_kv *kv) { return kv->h_left_pad; }

extern "C" tqkv_status tqkv_cuda_kv_upload(cuda_kv *kv, const struct tqkv_batch *b) {
    if (!kv || !b) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_upload: NULL argument");
    if (kv->bf16) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_upload: a bf16 baseline cache has no host form");
    char what[128];
    if (cache_config_diff(&kv->cfg, &b->cfg, what, sizeof what))
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_upload: config differs (%s)", what);
    if (b->rows > kv->rows) return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_upload: %d rows > %d", b->rows, kv->rows);
    for (int r = 0; r < b->rows; r++)
        if (b->left_pad[r] + b->offset[r] > kv->cap)
            return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_upload: row %d needs %d columns > cap %d", r,
                             b->left_pad[r] + b->offset[r], kv->cap);
    const int H = kv->kvh, cols = b->cap < kv->cap ? b->cap : kv->cap;
    tqkv_status st = TQKV_OK;
    /* on the cache's stream, so its later kernels see the bytes (pageable sources are
     * staged before each call returns) */
#define UP(dst, src, bytes) \
    cuda_check(cudaMemcpyAsync((dst), (src), (bytes), cudaMemcpyHostToDevice, kv->stream), "copy to device")
    for (int r = 0; r < b->rows && !st; r++)
        for (int h = 0; h < H && !st; h++) {
            const size_t ho = ((size_t)r * H + h) * b->cap, dO = ((size_t)r * H + h) * kv->cap;
            st = UP(kv->kd + dO * kv->kpay, b->k.data + ho * kv->kpay, (size_t)cols * kv->kpay);
            if (!st) st = UP(kv->vd + dO * kv->vpay, b->v.data + ho * kv->vpay, (size_t)cols * kv->vpay);
            if (!st) st = UP(kv->ks + dO * kv->kns, b->k.scales + ho * kv->kns, (size_t)cols * kv->kns * 2);
            if (!st) st = UP(kv->vs + dO * kv->vns, b->v.scales + ho * kv->vns, (size_t)cols * kv->vns * 2);
        }
    if (!st && kv->ring) {
        const size_t n = (size_t)b->rows * H * kv->ring;
        st = UP(kv->kw, b->k.win_data, n * kv->d);
        if (!st) st = UP(kv->vw, b->v.win_data, n * kv->d);
        if (!st) st = UP(kv->kws, b->k.win_scales, n * (kv->d / 32) * 2);
        if (!st) st = UP(kv->vws, b->v.win_scales, n * (kv->d / 32) * 2);
    }
#undef UP
    if (st) return st;
    for (int r = 0; r < kv->rows; r++) {
        kv->h_offset[r] = r < b->rows ? b->offset[r] : 0;
        kv->h_left_pad[r] = r < b->rows ? b->left_pad[r] : 0;
        kv->h_win_lo[r] = r < b->rows ? b->win_lo[r] : 0;
        kv->h_spec_base[r] = r < b->rows ? b->spec_base[r] : 0;
    }
    kv->spec_active = b->spec_active;
    kv->x_valid = 0; /* the host batch's side buffer is not uploaded */
    return cuda_kv_sync_rows(kv);
}


extern "C" tqkv_status tqkv_cuda_kv_download(const cuda_kv *kv, uint8_t *kd, uint16_t *ks,
                                        uint8_t *vd, uint16_t *vs, int8_t *kw, uint16_t *kws,
                                        int8_t *vw, uint16_t *vws) {
    const size_t rhc = (size_t)kv->rows * kv->kvh * kv->cap;
    const size_t rhr = (size_t)kv->rows * kv->kvh * kv->ring;
    /* the legacy stream's copies below do not wait for a non-blocking stream */
    tqkv_status st = cuda_check(cudaStreamSynchronize(kv->stream), "download");
    if (!st && kd) st = tqkv_cuda_d2h(kd, kv->kd, rhc * kv->kpay);
    if (!st && vd) st = tqkv_cuda_d2h(vd, kv->vd, rhc * kv->vpay);
    if (!st && ks && kv->kns) st = tqkv_cuda_d2h(ks, kv->ks, rhc * kv->kns * 2);
    if (!st && vs && kv->vns) st = tqkv_cuda_d2h(vs, kv->vs, rhc * kv->vns * 2);
    if (!st && kv->ring) {
        if (kw) st = tqkv_cuda_d2h(kw, kv->kw, rhr * kv->d);
        if (!st && vw) st = tqkv_cuda_d2h(vw, kv->vw, rhr * kv->d);
        if (!st && kws) st = tqkv_cuda_d2h(kws, kv->kws, rhr * (kv->d / 32) * 2);
        if (!st && vws) st = tqkv_cuda_d2h(vws, kv->vws, rhr * (kv->d / 32) * 2);
    }
    return st;
}

/* The host rule of tqkv_cuda_kv_append + cuda_kv_sync_rows for one row, on the device. */
__global__ void advance_rows_kernel(cuda_row *rows, int nrows, int n, int ring, int window) {
    cuda_pdl_wait(); /* programmatic: the encode that read the rows has completed */
    cuda_pdl_trigger();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= nrows) return;
    cuda_row w = rows[r];
    w.ntok += n;
    w.col0 = w.left_pad + w.ntok;
    int s = w.ntok;
    if (ring > 0) {
        if (w.win_lo < w.ntok - ring) w.win_lo = w.ntok - ring;
        s = w.ntok - window;
        if (s < w.win_lo) s = w.win_lo;
        if (s < 0) s = 0;
    }
    w.wstart = s;
    rows[r] = w;
}

tqkv_status cuda_kv_advance_rows(cuda_kv *kv, int n) {
    cuda_pdl_launch(cuda_attn_pdl_on(), advance_rows_kernel, dim3((kv->rows + 127) / 128), dim3(128), 0,
                    kv->stream, kv->d_rows, kv->rows, n, kv->ring, kv->cfg.window);
    return cuda_check(cudaGetLastError(), "advance rows");
}

extern "C" size_t tqkv_cuda_kv_token_bytes(const cuda_kv *kv, size_t *ring_bytes_per_row) {
    if (ring_bytes_per_row)
        *ring_bytes_per_row =
            kv ? (size_t)(kv->kwin + kv->vwin) * kv->kvh * kv->ring * (kv->d + 2 * (kv->d / 32)) : 0;
    return kv ? (size_t)kv->kvh * (kv->kpay + kv->vpay + 2 * (size_t)(kv->kns + kv->vns)) : 0;
}

/* Columns the rows need after an append of n tokens. */
static int append_need(const cuda_kv *kv, int n) {
    int need = 0;
    for (int r = 0; r < kv->rows; r++)
        if (kv->h_left_pad[r] + kv->h_offset[r] + n > need) need = kv->h_left_pad[r] + kv->h_offset[r] + n;
    return need;
}

/* The host mirror's rule of an append of n tokens (advance_rows_kernel's on the device). */
static void advance_host(cuda_kv *kv, int n) {
    for (int r = 0; r < kv->rows; r++) {
        kv->h_offset[r] += n;
        if (kv->ring > 0 && kv->h_win_lo[r] < kv->h_offset[r] - kv->ring)
            kv->h_win_lo[r] = kv->h_offset[r] - kv->ring;
    }
}

// ---------------------------------------------------------------------------
// Side buffer (per-query window of a long append; the CPU's ext_*, batch.h)
// ---------------------------------------------------------------------------

/* Side-buffer tokens [lo, hi) of a row at offset off (ring floor win_lo) for an append of n
 * tokens: the q8 copies the append's queries need ([off - W + 1, ...)) that the ring will
 * not hold after it ([..., off + n - ring)); lo == hi for short appends. */
__host__ __device__ static inline void x_range(int off, int win_lo, int window, int ring, int n,
                                               int *lo, int *hi) {
    int a = off - window + 1;
    if (a < win_lo) a = win_lo;
    if (a < 0) a = 0;
    const int b = off + n - ring;
    *lo = a;
    *hi = b < a ? a : b;
}

/* Slots per row the side buffer needs for an append of n tokens (0: none). */
static int x_need(const cuda_kv *kv, int n) {
    int need = 0;
    for (int r = 0; r < kv->rows && kv->ring > 0 && !kv->bf16; r++) {
        int lo, hi;
        x_range(kv->h_offset[r], kv->h_win_lo[r], kv->cfg.window, kv->ring, n, &lo, &hi);
        if (hi - lo > need) need = hi - lo;
    }
    return need;
}

/* Room for `need` slots per row (grown by a quarter at least; nothing queued reads the old
 * buffer: cudaFree waits for the device). */
static tqkv_status x_reserve(cuda_kv *kv, int need) {
    if (need <= 0 || (kv->xrows == kv->rows && kv->xcap >= need)) return TQKV_OK;
    if (kv->xrows == kv->rows && need < kv->xcap + kv->xcap / 4) need = kv->xcap + kv->xcap / 4;
    tqkv_cuda_free(kv->kx); tqkv_cuda_free(kv->vx); tqkv_cuda_free(kv->kxs); tqkv_cuda_free(kv->vxs);
    tqkv_cuda_free(kv->d_x);
    free(kv->h_x_off);
    kv->kx = kv->vx = NULL; kv->kxs = kv->vxs = NULL; kv->d_x = NULL; kv->h_x_off = NULL;
    kv->xcap = kv->xrows = kv->x_valid = 0;
    const size_t n = (size_t)kv->rows * kv->kvh * need;
    kv->h_x_off = (int *)calloc((size_t)kv->rows, sizeof(int));
    if (!kv->h_x_off) return tqkv_fail(TQKV_ENOMEM, "CUDA cache: out of memory (side buffer)");
    tqkv_status st = tqkv_cuda_malloc((void **)&kv->kx, n * kv->d);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->vx, n * kv->d);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->kxs, n * (kv->d / 32) * 2);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->vxs, n * (kv->d / 32) * 2);
    if (!st) st = tqkv_cuda_malloc((void **)&kv->d_x, 2 * sizeof(int) * (size_t)kv->rows);
    if (st) return st; /* freed with the cache; xcap 0 keeps them unused */
    kv->xcap = need;
    kv->xrows = kv->rows;
    return TQKV_OK;
}

/* Grid (rows, kvh): each row's range into d_x [2, rows] (from the row table before the
 * append) and the ring's q8 copies of [xlo, min(xhi, ntok)) into the side buffer, before the
 * append's encode overwrites them. */
__global__ void x_save_kernel(const cuda_row *__restrict__ rows, int nrows, int kvh, int d, int ring,
                              int window, int n, int xcap, const int8_t *kw, const uint16_t *kws,
                              const int8_t *vw, const uint16_t *vws, int8_t *kx, uint16_t *kxs,
                              int8_t *vx, uint16_t *vxs, int *dx) {
    const int r = blockIdx.x, h = blockIdx.y;
    const cuda_row rw = rows[r];
    int lo, hi;
    x_range(rw.ntok, rw.win_lo, window, ring, n, &lo, &hi);
    if (h == 0 && threadIdx.x == 0) { dx[r] = lo; dx[nrows + r] = hi; }
    const int end = hi < rw.ntok ? hi : rw.ntok;
    const size_t rh = (size_t)r * kvh + h;
    for (int t = lo; t < end; t++) {
        const size_t src = rh * ring + (size_t)(t % ring), dst = rh * xcap + (size_t)(t - lo);
        for (int e = threadIdx.x; e < d; e += blockDim.x) {
            kx[dst * d + e] = kw[src * d + e];
            vx[dst * d + e] = vw[src * d + e];
            if (e < d / 32) {
                kxs[dst * (d / 32) + e] = kws[src * (d / 32) + e];
                vxs[dst * (d / 32) + e] = vws[src * (d / 32) + e];
            }
        }
    }
}

/* Before an append of n tokens: the side buffer on (saved ring copies, host record) when the
 * append needs one, off otherwise. Queued on kv->stream. */
static tqkv_status x_begin(cuda_kv *kv, int n) {
    const int need = x_need(kv, n);
    kv->x_valid = 0;
    if (need <= 0) return TQKV_OK;
    tqkv_status st = x_reserve(kv, need);
    if (st) return st;
    x_save_kernel<<<dim3((unsigned)kv->rows, (unsigned)kv->kvh), 128, 0, kv->stream>>>(
        kv->d_rows, kv->rows, kv->kvh, kv->d, kv->ring, kv->cfg.window, n, kv->xcap, kv->kw,
        kv->kws, kv->vw, kv->vws, kv->kx, kv->kxs, kv->vx, kv->vxs, kv->d_x);
    st = cuda_check(cudaGetLastError(), "side buffer kernel launch");
    if (st) return st;
    for (int r = 0; r < kv->rows; r++) kv->h_x_off[r] = kv->h_offset[r] + n;
    kv->x_valid = 1;
    return TQKV_OK;
}

const int *cuda_kv_side_ranges(const cuda_kv *kv) {
    if (!kv->x_valid || kv->xrows != kv->rows) return NULL;
    for (int r = 0; r < kv->rows; r++)
        if (kv->h_x_off[r] != kv->h_offset[r]) return NULL;
    return kv->d_x;
}

extern "C" tqkv_status tqkv_cuda_kv_reserve_append(cuda_kv *kv, int n) {
    if (!kv || n < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_reserve_append: NULL cache or n < 1");
    tqkv_status st = kv->rows ? cuda_kv_reserve(kv, append_need(kv, n)) : TQKV_OK;
    return st ? st : x_reserve(kv, x_need(kv, n));
}

extern "C" tqkv_status tqkv_cuda_kv_replayed_append(cuda_kv *kv, int n) {
    if (!kv || n < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_replayed_append: NULL cache or n < 1");
    if (append_need(kv, n) > kv->cap)
        return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_replayed_append: %d columns needed > cap %d "
                         "(the replayed append had no room)", append_need(kv, n), kv->cap);
    kv->x_valid = 0; /* (a side buffer in a replayed append is not tracked: never read) */
    advance_host(kv, n);
    return TQKV_OK;
}

/* An append's steps before its encode (room for n more tokens, the window's side buffer)
 * and after it (the rows advance by n, on the device and in the host mirror). d_rows is
 * current: every row operation ends with cuda_kv_sync_rows. */
static tqkv_status append_prepare(cuda_kv *kv, int n) {
    const tqkv_status st = cuda_kv_reserve(kv, append_need(kv, n));
    return st ? st : x_begin(kv, n);
}
static tqkv_status append_finish(cuda_kv *kv, int n) {
    const tqkv_status st = cuda_kv_advance_rows(kv, n);
    if (!st) advance_host(kv, n);
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_append(cuda_kv *kv, const float *k, const float *v, int n) {
    if (!kv || !k || !v) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_append: NULL argument");
    if (n < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_append: n must be >= 1, got %d", n);
    if (kv->rows == 0) return TQKV_OK;
    tqkv_status st = append_prepare(kv, n);
    if (!st) st = codec_cuda_append(kv, k, v, n);
    return st ? st : append_finish(kv, n);
}

// ---------------------------------------------------------------------------
// Encode: both planes in one launch of the codec's kernel on kv->stream (fp8: its own
// kernel per plane, codec_cuda_fp8.cu), asynchronous
// ---------------------------------------------------------------------------
/* The encode kernel's view of kv's K and V planes. */
static void append_planes(const cuda_kv *kv, ce_plane P[2]) {
    for (int p = 0; p < 2; p++) {
        P[p].data = p ? kv->vd : kv->kd;
        P[p].scales = p ? kv->vs : kv->ks;
        P[p].win = p ? (kv->vwin ? kv->vw : NULL) : (kv->kwin ? kv->kw : NULL);
        P[p].wsc = p ? kv->vws : kv->kws;
        P[p].ext = kv->x_valid ? (p ? kv->vx : kv->kx) : NULL;
        P[p].exs = p ? kv->vxs : kv->kxs;
        P[p].xlo = kv->d_x;
        P[p].xcap = kv->xcap;
        P[p].pay = (int)(p ? kv->vpay : kv->kpay);
        P[p].bf16 = kv->bf16;
    }
}

tqkv_status codec_cuda_append(cuda_kv *kv, const float *k, const float *v, int n) {
    ce_plane P[2];
    append_planes(kv, P);
    if (!kv->bf16 && kv->kfmt == TQKV_FP8) { /* fp8 K and V (tqkv_cuda_kv_formats_ok): no ring */
        for (int p = 0; p < 2; p++) {
            const tqkv_status st = cuda_check(
                codec_cuda_encode_fp8(p ? v : k, P[p], kv->d, kv->d_rows, kv->rows, kv->kvh, n,
                                      kv->cap, kv->stream),
                "encode kernel launch");
            if (st) return st;
        }
        return TQKV_OK; /* queued on kv->stream: no wait (a decode step may be being captured) */
    }
    const cudaError_t e = codec_cuda_encode(k, v, P, kv->kc, kv->vc, kv->kc256, kv->vc256, kv->d,
                                            kv->d_rows, kv->rows, kv->kvh, n, kv->cap, kv->ring,
                                            cuda_attn_pdl_on(), kv->stream);
    /* queued on kv->stream: no wait (a decode step may be being captured) */
    return cuda_check(e, "encode kernel launch");
}

extern "C" tqkv_status tqkv_cuda_kv_append_begin(cuda_kv *kv, int n, ce_args *A, int *fused) {
    if (!kv || !A || !fused || n < 1)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_append_begin: NULL argument or n < 1");
    *fused = 0;
    if (kv->rows == 0 || kv->d != CUDA_DIM || kv->ring || kv->kwin || kv->vwin ||
        (!kv->bf16 && kv->kfmt == TQKV_FP8))
        return TQKV_OK;
    const tqkv_status st = append_prepare(kv, n);
    if (st) return st;
    ce_plane P[2];
    append_planes(kv, P);
    codec_cuda_encode_args(NULL, NULL, P, kv->kc, kv->vc, kv->kc256, kv->vc256, kv->d, kv->d_rows,
                           kv->rows, kv->kvh, n, kv->cap, kv->ring, A);
    *fused = 1;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_append_end(cuda_kv *kv, int n) {
    if (!kv || n < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_append_end: NULL cache or n < 1");
    return append_finish(kv, n);
}

/*
 * cache_cuda_slide.cu - sliding-window layers on the device cache (the device form of
 * batch_slide.c): window views for decode attention over each row's newest `window` keys,
 * and tqkv_cuda_kv_drop_oldest, which keeps a sliding layer's cache bounded.
 * Owns: struct cuda_kv_slide (the scratch both need: a view row table, per-row shifts, a
 * rotated copy of one cache's q8 ring, the view itself), the view and ring kernels.
 * Must not: allocate, free or wait inside tqkv_cuda_kv_window_view (a decode step that uses
 * it is captured as a CUDA graph: tqkv_cuda_slide_reserve runs before any capture); call
 * attention (a higher layer: the caller attends over the view).
 *
 * Window views: the decode kernel attends over a row's tokens [0, ntok) read through its
 * row table (cuda_row) and its q8 ring (slot = token % ring). A sliding layer holds up to
 * window + slack (+ the call's) tokens; its decode attention sees the newest `window`: a
 * view is the same cache with a row table whose rows start s = ntok - window tokens later
 * (left_pad + s, ntok - s, the q8 window start moved with them) and, with a q8 window, a
 * copy of the ring rotated by s slots, both built on the device in the caller's stream
 * order. The view's tokens and their order are those of the newest `window` keys whatever
 * the row held before them, so a decode reads the same bits before and after a drop, and a
 * verification window's query j (its view `back` tokens back) those of its single decode.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "cache/cache_cuda_impl.h"

struct cuda_kv_slide {
    int rows;         /* the row count the buffers are sized for */
    cuda_row *d_view; /* device [rows] the view's row table */
    int *d_shift;     /* device [rows] each row's shift (view: tokens skipped; drop: dropped) */
    int *h_view_off;  /* host [rows] the view's token counts (the attention's split bound) */
    int *h_shift;     /* host [rows] a drop's shifts, uploaded from pageable memory */
    uint8_t *ring;    /* device: one cache's q8 ring, rotated (kw | vw | kws | vws) */
    size_t ring_bytes;
    cuda_kv view; /* the last view made (a shallow copy of its cache) */
};

// ---------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------

/* The window view of row table rows [R] as the cache stood `back` tokens ago
 * (cuda_kv_sync_rows' rule for that length, then the newest W tokens): out [R], and each
 * row's shift (the tokens before the view) in shift [R]. ring / qwin: the cache's q8 ring
 * slots and window. grid ceil(R / 128), block 128. */
__global__ void slide_view_kernel(const cuda_row *__restrict__ rows, int R, int W, int back,
                                  int ring, int qwin, cuda_row *__restrict__ out,
                                  int *__restrict__ shift) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= R) return;
    const cuda_row w = rows[r];
    const int ntok = w.ntok - back;
    int ws = ntok;
    if (ring > 0) { /* plane_window_start at that length (attend_back keeps win_lo) */
        ws = ntok - qwin;
        if (ws < w.win_lo) ws = w.win_lo;
        if (ws < 0) ws = 0;
    }
    const int k = ntok < W ? ntok : W, s = ntok - k;
    cuda_row v;
    v.ntok = k;
    v.left_pad = w.left_pad + s;
    ws -= s;
    v.wstart = ws < 0 ? 0 : ws > k ? k : ws;
    v.col0 = w.col0;
    v.win_lo = w.win_lo > s ? w.win_lo - s : 0;
    out[r] = v;
    shift[r] = s;
}

/* dst slot j of every (row, head) ring = src slot (j + shift[row]) % ring, for the int8
 * planes [R, kvh, ring, d] and their scales [R, kvh, ring, d / 32] of K and V (NULL planes
 * skipped). One thread per slot. */
__global__ void slide_ring_kernel(const int8_t *__restrict__ kw, const int8_t *__restrict__ vw,
                                  const uint16_t *__restrict__ kws,
                                  const uint16_t *__restrict__ vws, int8_t *__restrict__ dkw,
                                  int8_t *__restrict__ dvw, uint16_t *__restrict__ dkws,
                                  uint16_t *__restrict__ dvws, int R, int kvh, int ring, int d,
                                  const int *__restrict__ shift) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)R * kvh * ring) return;
    const size_t rh = i / ring;
    const int j = (int)(i % ring), r = (int)(rh / kvh);
    const size_t from = rh * ring + (size_t)((j + shift[r] % ring) % ring);
    const int ns = d / 32;
    if (kw) {
        const int4 *a = reinterpret_cast<const int4 *>(kw + from * d);
        int4 *b = reinterpret_cast<int4 *>(dkw + i * d);
        for (int q = 0; q < d / 16; q++) b[q] = a[q];
        for (int q = 0; q < ns; q++) dkws[i * ns + q] = kws[from * ns + q];
    }
    if (vw) {
        const int4 *a = reinterpret_cast<const int4 *>(vw + from * d);
        int4 *b = reinterpret_cast<int4 *>(dvw + i * d);
        for (int q = 0; q < d / 16; q++) b[q] = a[q];
        for (int q = 0; q < ns; q++) dvws[i * ns + q] = vws[from * ns + q];
    }
}

// ---------------------------------------------------------------------------
// scratch
// ---------------------------------------------------------------------------

/* Bytes of one q8 ring plane of kv: int8 [rows, kvh, ring, d]; its fp16 scales
 * [rows, kvh, ring, d / 32] in *scale_bytes. */
static size_t ring_plane_bytes(const cuda_kv *kv, size_t *scale_bytes) {
    const size_t slots = (size_t)kv->rows * kv->kvh * (kv->ring > 0 ? kv->ring : 0);
    *scale_bytes = slots * (size_t)(kv->d / 32) * 2;
    return slots * (size_t)kv->d;
}

/* Where the rotated ring copies of kv go in s->ring (kw | vw | kws | vws). */
static void ring_parts(const cuda_kv_slide *s, const cuda_kv *kv, int8_t **kw, int8_t **vw,
                       uint16_t **kws, uint16_t **vws) {
    size_t sb = 0;
    const size_t pb = ring_plane_bytes(kv, &sb);
    *kw = kv->kw ? (int8_t *)s->ring : NULL;
    *vw = kv->vw ? (int8_t *)(s->ring + pb) : NULL;
    *kws = kv->kw ? (uint16_t *)(s->ring + 2 * pb) : NULL;
    *vws = kv->vw ? (uint16_t *)(s->ring + 2 * pb + sb) : NULL;
}

static void slide_release(cuda_kv_slide *s) {
    cudaFree(s->d_view);
    cudaFree(s->d_shift);
    cudaFree(s->ring);
    free(s->h_view_off);
    free(s->h_shift);
    s->d_view = NULL;
    s->d_shift = NULL;
    s->ring = NULL;
    s->h_view_off = s->h_shift = NULL;
    s->rows = 0;
    s->ring_bytes = 0;
}

extern "C" tqkv_status tqkv_cuda_slide_init(cuda_kv_slide **out) {
    if (!out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_slide_init: out is NULL");
    *out = (cuda_kv_slide *)calloc(1, sizeof **out);
    return *out ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
}

extern "C" void tqkv_cuda_slide_free(cuda_kv_slide *s) {
    if (!s) return;
    slide_release(s);
    free(s);
}

extern "C" tqkv_status tqkv_cuda_slide_reserve(cuda_kv_slide *s, const cuda_kv *kv, int *moved) {
    if (moved) *moved = 0;
    if (!s || !kv) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_slide_reserve: NULL argument");
    size_t sb = 0;
    const size_t need_ring = 2 * (ring_plane_bytes(kv, &sb) + sb);
    if (s->d_view && s->rows == kv->rows && s->ring_bytes >= need_ring) return TQKV_OK;
    slide_release(s);
    if (moved) *moved = 1;
    const size_t R = (size_t)(kv->rows ? kv->rows : 1);
    s->h_view_off = (int *)calloc(R, sizeof(int));
    s->h_shift = (int *)calloc(R, sizeof(int));
    tqkv_status st =
        s->h_view_off && s->h_shift ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (!st) st = cuda_check(cudaMalloc((void **)&s->d_view, R * sizeof(cuda_row)), "slide rows");
    if (!st) st = cuda_check(cudaMalloc((void **)&s->d_shift, R * sizeof(int)), "slide shifts");
    if (!st && need_ring) st = cuda_check(cudaMalloc((void **)&s->ring, need_ring), "slide ring");
    if (st) {
        slide_release(s);
        return st;
    }
    s->rows = kv->rows;
    s->ring_bytes = need_ring;
    return TQKV_OK;
}

/* The rotated copy of kv's ring into kw..vws by the device shifts s->d_shift. */
static tqkv_status ring_launch(const cuda_kv *kv, const cuda_kv_slide *s, int8_t *kw, int8_t *vw,
                               uint16_t *kws, uint16_t *vws) {
    const size_t slots = (size_t)kv->rows * kv->kvh * kv->ring;
    if (!slots) return TQKV_OK;
    slide_ring_kernel<<<(unsigned)((slots + 127) / 128), 128, 0, kv->stream>>>(
        kv->kw, kv->vw, kv->kws, kv->vws, kw, vw, kws, vws, kv->rows, kv->kvh, kv->ring, kv->d,
        s->d_shift);
    return cuda_check(cudaGetLastError(), "window ring");
}

static tqkv_status slide_check(const cuda_kv *kv, const cuda_kv_slide *s, const char *who) {
    if (!kv || !s) return tqkv_fail(TQKV_EINVAL, "%s: NULL argument", who);
    size_t sb = 0;
    const size_t need_ring = 2 * (ring_plane_bytes(kv, &sb) + sb);
    if (!s->d_view || s->rows != kv->rows || s->ring_bytes < need_ring)
        return tqkv_fail(TQKV_EINVAL,
                         "%s: the scratch is not reserved for this cache (%d rows, "
                         "%zu ring bytes; reserved %d rows, %zu)",
                         who, kv->rows, need_ring, s->rows, s->ring_bytes);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// public
// ---------------------------------------------------------------------------

extern "C" tqkv_status tqkv_cuda_kv_window_view(cuda_kv *kv, cuda_kv_slide *s, int window, int back,
                                                cuda_kv **view) {
    tqkv_status st = slide_check(kv, s, "tqkv_cuda_kv_window_view");
    if (st) return st;
    if (window < 1 || back < 0 || !view)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_window_view: window %d, back %d", window, back);
    const int R = kv->rows;
    for (int r = 0; r < R; r++)
        if (kv->h_offset[r] < back)
            return tqkv_fail(TQKV_ERANGE,
                             "tqkv_cuda_kv_window_view: row %d holds %d tokens, "
                             "%d back",
                             r, kv->h_offset[r], back);
    for (int r = 0; r < R; r++) {
        const int nb = kv->h_offset[r] - back;
        s->h_view_off[r] = nb < window ? nb : window;
    }
    s->view = *kv; /* the same planes and work counters; the view's rows and ring */
    s->view.d_rows = s->d_view;
    s->view.h_offset = s->h_view_off;
    *view = &s->view;
    if (!R) return TQKV_OK;
    slide_view_kernel<<<(unsigned)((R + 127) / 128), 128, 0, kv->stream>>>(
        kv->d_rows, R, window, back, kv->ring, kv->cfg.window, s->d_view, s->d_shift);
    st = cuda_check(cudaGetLastError(), "window view");
    if (!st && kv->ring > 0) {
        ring_parts(s, kv, &s->view.kw, &s->view.vw, &s->view.kws, &s->view.vws);
        st = ring_launch(kv, s, s->view.kw, s->view.vw, s->view.kws, s->view.vws);
    }
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_drop_oldest(cuda_kv *kv, cuda_kv_slide *s, int keep) {
    tqkv_status st = slide_check(kv, s, "tqkv_cuda_kv_drop_oldest");
    if (st) return st;
    if (keep < 1)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_drop_oldest: keep must be >= 1, got %d", keep);
    if (kv->spec_active)
        return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_drop_oldest: a spec round is active");
    const int R = kv->rows;
    int any = 0;
    for (int r = 0; r < R; r++) {
        const int d = kv->h_offset[r] - keep;
        s->h_shift[r] = d > 0 ? d : 0;
        any |= d > 0;
    }
    if (any && kv->ring > 0) { /* rotate into the scratch, then copy back */
        int8_t *kw, *vw;
        uint16_t *kws, *vws;
        ring_parts(s, kv, &kw, &vw, &kws, &vws);
        size_t sb = 0;
        const size_t pb = ring_plane_bytes(kv, &sb);
        st = cuda_check(cudaMemcpyAsync(s->d_shift, s->h_shift, sizeof(int) * (size_t)R,
                                        cudaMemcpyHostToDevice, kv->stream),
                        "drop shifts");
        if (!st) st = ring_launch(kv, s, kw, vw, kws, vws);
        if (!st && kv->kw)
            st = cuda_check(cudaMemcpyAsync(kv->kw, kw, pb, cudaMemcpyDeviceToDevice, kv->stream),
                            "drop ring");
        if (!st && kv->kw)
            st = cuda_check(cudaMemcpyAsync(kv->kws, kws, sb, cudaMemcpyDeviceToDevice, kv->stream),
                            "drop ring");
        if (!st && kv->vw)
            st = cuda_check(cudaMemcpyAsync(kv->vw, vw, pb, cudaMemcpyDeviceToDevice, kv->stream),
                            "drop ring");
        if (!st && kv->vw)
            st = cuda_check(cudaMemcpyAsync(kv->vws, vws, sb, cudaMemcpyDeviceToDevice, kv->stream),
                            "drop ring");
        if (st) return st;
    }
    int min_pad = -1;
    for (int r = 0; r < R; r++) {
        const int d = s->h_shift[r];
        kv->h_left_pad[r] += d;
        kv->h_offset[r] -= d;
        kv->h_win_lo[r] = kv->h_win_lo[r] > d ? kv->h_win_lo[r] - d : 0;
        if (min_pad < 0 || kv->h_left_pad[r] < min_pad) min_pad = kv->h_left_pad[r];
    }
    if (any) st = tqkv_cuda_kv_trim(kv, 0); /* clamps win_lo, uploads the row table */
    if (st || min_pad < keep) return st;    /* batch_slide.c's rule: compact even if none dropped */
    int *all = (int *)malloc(sizeof(int) * (size_t)R);
    if (!all) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int r = 0; r < R; r++) all[r] = r;
    st = tqkv_cuda_kv_filter(kv, all, R); /* the common padding goes (in place: rows shift left) */
    free(all);
    return st;
}

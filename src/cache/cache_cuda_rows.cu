/*
 * cache_cuda_rows.cu - row operations on the device cache, in device memory: trim, rewind,
 * filter, extract, merge, align, speculative rounds (and the decode attention at an earlier
 * length that their verification needs), capacity growth, and state export / restore
 * through host memory (the same bytes as tqkv_batch_export / tqkv_batch_restore).
 * Owns: moving rows between device caches by copying encoded bytes (main planes column by
 * column with a 2-D copy over the kv heads, the q8 ring slot for slot, since slots are
 * indexed by token, not column), with the semantics of src/cache/batch_rows.c and
 * batch_spec.c (tests/test_cuda.c compares exports after the same operations on both).
 * Filter (in an in-place order) and append_rows work inside the storage that holds the
 * rows (a shift kernel moves kept rows' bytes left; joining rows are copied in); they
 * allocate nothing, so they fail only on a CUDA error. Every other reshaping call builds the
 * new storage completely, then installs it: a failure leaves the object as it was.
 * Must not: decode, rotate or requantize anything; launch attention kernels.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "cache/cache_impl.h"
#include "util/common.h"
#include "util/keep_order.h"
}
#include "cache/cache_cuda_impl.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
/* Copy row rs of src into row rd of dst at left pad pd: tokens, ring, row state. The
 * copies are queued on dst's stream (src must not be written by another stream meanwhile:
 * tqkv_cuda_kv_merge waits for its items' streams first). */
static tqkv_status move_row(cuda_kv *dst, int rd, int pd, const cuda_kv *src, int rs) {
    const int n = src->h_offset[rs], ps = src->h_left_pad[rs], H = src->kvh;
    tqkv_status st = TQKV_OK;
    struct { uint8_t *d; const uint8_t *s; size_t per; } pl[4] = {
        {dst->kd, src->kd, src->kpay}, {dst->vd, src->vd, src->vpay},
        {(uint8_t *)dst->ks, (const uint8_t *)src->ks, 2 * (size_t)src->kns},
        {(uint8_t *)dst->vs, (const uint8_t *)src->vs, 2 * (size_t)src->vns}};
    for (int i = 0; i < 4 && !st && n > 0; i++) {
        if (!pl[i].per) continue;
        const size_t per = pl[i].per;
        st = cuda_check(cudaMemcpy2DAsync(pl[i].d + ((size_t)rd * H * dst->cap + pd) * per, dst->cap * per,
                                          pl[i].s + ((size_t)rs * H * src->cap + ps) * per, src->cap * per,
                                          (size_t)n * per, (size_t)H, cudaMemcpyDeviceToDevice, dst->stream),
                        "row copy");
    }
    if (!st && src->ring) {
        const size_t q = (size_t)H * src->ring * src->d, qs = (size_t)H * src->ring * (src->d / 32) * 2;
        cudaStream_t s = dst->stream;
        st = cuda_check(cudaMemcpyAsync(dst->kw + rd * q, src->kw + rs * q, q, cudaMemcpyDeviceToDevice, s), "ring copy");
        if (!st) st = cuda_check(cudaMemcpyAsync(dst->vw + rd * q, src->vw + rs * q, q, cudaMemcpyDeviceToDevice, s), "ring copy");
        if (!st) st = cuda_check(cudaMemcpyAsync((char *)dst->kws + rd * qs, (const char *)src->kws + rs * qs, qs,
                                                 cudaMemcpyDeviceToDevice, s), "ring copy");
        if (!st) st = cuda_check(cudaMemcpyAsync((char *)dst->vws + rd * qs, (const char *)src->vws + rs * qs, qs,
                                                 cudaMemcpyDeviceToDevice, s), "ring copy");
    }
    if (st) return st;
    dst->h_offset[rd] = n;
    dst->h_left_pad[rd] = pd;
    dst->h_win_lo[rd] = src->h_win_lo[rs];
    dst->h_spec_base[rd] = src->h_spec_base[rs];
    return TQKV_OK;
}

/* Take over tmp's storage, rows and storage id (tmp is freed). Keeps kv's attention
 * workspace, masked-attention range buffers and stream; waits for the copies that built tmp (they read kv's old storage,
 * which is freed here). */
static void install(cuda_kv *kv, cuda_kv *tmp) {
    if (tmp->stream != kv->stream) cudaStreamSynchronize(tmp->stream);
    cuda_kv old = *kv;
    const int spec = kv->spec_active;
    *kv = *tmp;
    kv->spec_active = spec;
    kv->ws = old.ws;
    kv->ws_bytes = old.ws_bytes;
    kv->stream = old.stream;
    kv->h_rng = old.h_rng; kv->d_rng = old.d_rng; kv->rng_cap = old.rng_cap; kv->rng_ev = old.rng_ev;
    *tmp = old;
    tmp->ws = NULL;
    tmp->h_rng = NULL; tmp->d_rng = NULL; tmp->rng_cap = 0; tmp->rng_ev = NULL;
    tqkv_cuda_kv_free(tmp);
}

static tqkv_status check_keep(const cuda_kv *kv, const int *keep, int n_keep, const char *fn) {
    if (n_keep < 0 || (n_keep && !keep)) return tqkv_fail(TQKV_EINVAL, "%s: bad keep list", fn);
    if (n_keep > kv->rows) return tqkv_fail(TQKV_ERANGE, "%s: n_keep %d > rows %d", fn, n_keep, kv->rows);
    for (int i = 0; i < n_keep; i++) {
        if (keep[i] < 0 || keep[i] >= kv->rows)
            return tqkv_fail(TQKV_ERANGE, "%s: keep[%d] = %d not in [0, %d)", fn, i, keep[i], kv->rows);
        for (int j = 0; j < i; j++)
            if (keep[j] == keep[i]) return tqkv_fail(TQKV_EINVAL, "%s: row %d listed twice", fn, keep[i]);
    }
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Capacity, trim, spec
// ---------------------------------------------------------------------------
/* Move every row into new storage of exactly `cap` columns and `row_cap` rows (cap >= every
 * row's used columns, row_cap >= rows). */
static tqkv_status regrow(cuda_kv *kv, int cap, int row_cap) {
    cuda_kv *t = NULL;
    tqkv_status st = cuda_kv_init_on(&t, &kv->cfg, kv->bf16, row_cap, cap, kv->stream);
    if (!st) t->rows = kv->rows;
    for (int r = 0; !st && r < kv->rows; r++) st = move_row(t, r, kv->h_left_pad[r], kv, r);
    if (!st) st = cuda_kv_sync_rows(t);
    if (st) {
        tqkv_cuda_kv_free(t);
        return st;
    }
    install(kv, t);
    return TQKV_OK;
}

/* Room for `need` columns: 1.25x the capacity (at least 256 columns more), or need if
 * larger. Not 2x: every row of a batch gets the new columns, and for a long batch a
 * doubling is mostly padding the serving budget must hold (src/engine/engine.c
 * device_peak counts this 1.25). */
tqkv_status cuda_kv_reserve(cuda_kv *kv, int need) {
    if (need <= kv->cap) return TQKV_OK;
    const long grown = (long)kv->cap + (kv->cap / 4 > 256 ? kv->cap / 4 : 256);
    return regrow(kv, grown > need ? (int)(grown < INT32_MAX ? grown : INT32_MAX) : need, kv->row_cap);
}

extern "C" tqkv_status tqkv_cuda_kv_reserve(cuda_kv *kv, int tokens) {
    if (!kv || tokens < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_reserve: NULL cache or tokens < 1");
    int need = 0;
    for (int r = 0; r < kv->rows; r++)
        if (kv->h_left_pad[r] + tokens > need) need = kv->h_left_pad[r] + tokens;
    return need <= kv->cap ? TQKV_OK : regrow(kv, need, kv->row_cap);
}

static void clamp_win_lo(cuda_kv *kv) {
    for (int r = 0; r < kv->rows; r++)
        if (kv->h_win_lo[r] > kv->h_offset[r]) kv->h_win_lo[r] = kv->h_offset[r];
}

extern "C" tqkv_status tqkv_cuda_kv_trim(cuda_kv *kv, int n) {
    if (!kv || n < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_trim: NULL cache or n < 0");
    if (kv->spec_active) return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_trim: a spec round is active");
    for (int r = 0; r < kv->rows; r++)
        if (n > kv->h_offset[r])
            return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_trim: n = %d exceeds row %d's length %d", n, r,
                             kv->h_offset[r]);
    for (int r = 0; r < kv->rows; r++) kv->h_offset[r] -= n;
    clamp_win_lo(kv);
    return cuda_kv_sync_rows(kv);
}

extern "C" tqkv_status tqkv_cuda_kv_spec_begin(cuda_kv *kv) {
    if (!kv) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_spec_begin: NULL cache");
    if (kv->spec_active) return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_spec_begin: a spec round is already active");
    for (int r = 0; r < kv->rows; r++) kv->h_spec_base[r] = kv->h_offset[r];
    kv->spec_active = 1;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_spec_commit(cuda_kv *kv) {
    if (!kv) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_spec_commit: NULL cache");
    if (!kv->spec_active) return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_spec_commit: no spec round is active");
    kv->spec_active = 0;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_spec_rollback(cuda_kv *kv, const int *keep, int n_keep) {
    if (!kv || !keep) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_spec_rollback: NULL argument");
    if (!kv->spec_active) return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_spec_rollback: no spec round is active");
    if (n_keep != 1 && n_keep != kv->rows)
        return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_spec_rollback: n_keep must be 1 or rows (%d)", kv->rows);
    for (int r = 0; r < kv->rows; r++) {
        const int k = keep[n_keep == 1 ? 0 : r], appended = kv->h_offset[r] - kv->h_spec_base[r];
        if (k < 0 || k > appended)
            return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_spec_rollback: keep[%d] = %d not in [0, %d]", r, k, appended);
    }
    for (int r = 0; r < kv->rows; r++) kv->h_offset[r] = kv->h_spec_base[r] + keep[n_keep == 1 ? 0 : r];
    clamp_win_lo(kv);
    kv->spec_active = 0;
    return cuda_kv_sync_rows(kv);
}

extern "C" int tqkv_cuda_kv_spec_active(const cuda_kv *kv) { return kv ? kv->spec_active : 0; }
extern "C" const int *tqkv_cuda_kv_spec_bases(const cuda_kv *kv) { return kv ? kv->h_spec_base : NULL; }

extern "C" tqkv_status tqkv_cuda_kv_rewind(cuda_kv *kv, int n) {
    if (!kv || n < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_rewind: NULL cache or n < 0");
    for (int r = 0; r < kv->rows; r++) {
        const int floor = kv->spec_active ? kv->h_spec_base[r] : 0;
        if (kv->h_offset[r] - n < floor)
            return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_rewind: n = %d takes row %d below %d tokens",
                             n, r, floor);
    }
    for (int r = 0; r < kv->rows; r++) kv->h_offset[r] -= n;
    clamp_win_lo(kv);
    return cuda_kv_sync_rows(kv);
}

// ---------------------------------------------------------------------------
// Filter, align, extract, merge
// ---------------------------------------------------------------------------
extern "C" tqkv_status tqkv_cuda_kv_select(const cuda_kv *kv, const int *keep, int n_keep,
                                      cuda_kv **out) {
    if (!kv || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_select: NULL argument");
    tqkv_status st = check_keep(kv, keep, n_keep, "tqkv_cuda_kv_select");
    if (st) return st;
    int min_pad = 0, need = 1;
    for (int i = 0; i < n_keep; i++)
        if (i == 0 || kv->h_left_pad[keep[i]] < min_pad) min_pad = kv->h_left_pad[keep[i]];
    for (int i = 0; i < n_keep; i++) {
        const int e = kv->h_left_pad[keep[i]] - min_pad + kv->h_offset[keep[i]];
        if (e > need) need = e;
    }
    const int cap = kv->cap - min_pad > need ? kv->cap - min_pad : need;
    cuda_kv *t = NULL;
    st = cuda_kv_init_on(&t, &kv->cfg, kv->bf16, n_keep, cap, kv->stream);
    for (int i = 0; !st && i < n_keep; i++) st = move_row(t, i, kv->h_left_pad[keep[i]] - min_pad, kv, keep[i]);
    if (!st) st = cuda_kv_sync_rows(t);
    if (st) {
        tqkv_cuda_kv_free(t);
        return st;
    }
    t->spec_active = kv->spec_active;
    *out = t;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// In place: rows leave (filter) and join (append_rows) inside the storage that holds them,
// as batch_rows.c does on the host, so a server's running batch is not rebuilt (every row
// copied, the storage allocated twice) each time a request joins or finishes
// ---------------------------------------------------------------------------

/* The planes a shift moves: base pointers [K data, V data, K scales, V scales] (NULL: none)
 * and bytes per token of each. */
struct shift_planes {
    uint8_t *base[4];
    int per[4];
};

/* One (row, kv head, plane) segment per block, moved left in tiles of blockDim x 4 elements
 * of T: every thread loads its part of a tile, the block waits, then stores. Destinations lie
 * left of their sources, so a tile's stores never reach a source byte of a later tile, and
 * the one barrier per tile is all the order an overlapping move needs. */
template <typename T>
__device__ void shift_segment(const T *src, T *dst, size_t n) {
    constexpr int U = 4;
    const size_t tile = (size_t)blockDim.x * U;
    for (size_t t0 = 0; t0 < n; t0 += tile) {
        T v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t i = t0 + (size_t)u * blockDim.x + threadIdx.x;
            if (i < n) v[u] = src[i];
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t i = t0 + (size_t)u * blockDim.x + threadIdx.x;
            if (i < n) dst[i] = v[u];
        }
    }
}

/* grid (rows, kvh, 4 planes): row r's tokens (the row table's left_pad and ntok) move
 * `shift` columns left. A row whose padding is narrower (a row being dropped: the filter's
 * shift is the kept rows' common pad) is left alone. */
__global__ void rows_shift_kernel(const cuda_row *__restrict__ rows, int shift, shift_planes P, int kvh,
                                  int cap) {
    const cuda_row w = rows[blockIdx.x];
    const int p = blockIdx.z;
    if (!P.base[p] || w.ntok <= 0 || shift <= 0 || w.left_pad < shift) return;
    const size_t per = (size_t)P.per[p];
    const size_t seg = ((size_t)blockIdx.x * kvh + blockIdx.y) * cap;
    const uint8_t *src = P.base[p] + (seg + w.left_pad) * per;
    uint8_t *dst = P.base[p] + (seg + w.left_pad - shift) * per;
    const size_t n = (size_t)w.ntok * per;
    const uintptr_t a = (uintptr_t)src | (uintptr_t)dst | n;
    if (!(a & 15)) shift_segment((const uint4 *)src, (uint4 *)dst, n / 16);
    else if (!(a & 3)) shift_segment((const uint32_t *)src, (uint32_t *)dst, n / 4);
    else if (!(a & 1)) shift_segment((const uint16_t *)src, (uint16_t *)dst, n / 2);
    else shift_segment(src, dst, n);
}

/* Rows [0, n) of kv (as the device row table holds them) shifted `shift` columns left in
 * place, in one launch; the row table is the caller's to update. */
static tqkv_status shift_rows(cuda_kv *kv, int n, int shift) {
    if (n == 0 || shift <= 0) return TQKV_OK;
    shift_planes P = {{kv->kd, kv->vd, (uint8_t *)kv->ks, (uint8_t *)kv->vs},
                      {(int)kv->kpay, (int)kv->vpay, 2 * kv->kns, 2 * kv->vns}};
    rows_shift_kernel<<<dim3((unsigned)n, (unsigned)kv->kvh, 4), 256, 0, kv->stream>>>(kv->d_rows, shift, P,
                                                                                        kv->kvh, kv->cap);
    return cuda_check(cudaGetLastError(), "row shifts");
}

/* Filter with keep in an in-place order (util/keep_order.h; `order` its kind): rows that stay
 * where they are shift left by the common pad in one launch (holes filled from the tail: over
 * rows [0, n_keep), as a slot whose row leaves is overwritten after), the others move (few
 * when holes are filled from the tail) in ascending order, each read before anything
 * overwrites it. */
static tqkv_status filter_inplace(cuda_kv *kv, const int *keep, int n_keep, int order) {
    int min_pad = 0, n_shift = n_keep;
    for (int i = 0; i < n_keep; i++)
        if (i == 0 || kv->h_left_pad[keep[i]] < min_pad) min_pad = kv->h_left_pad[keep[i]];
    /* an increasing list: rows past its first move are sources of later moves, so only the
     * rows before it shift in place */
    for (int i = 0; i < n_keep && order == 1; i++)
        if (keep[i] != i) {
            n_shift = i;
            break;
        }
    tqkv_status st = shift_rows(kv, n_shift, min_pad);
    for (int i = 0; i < n_keep && !st; i++) {
        if (keep[i] == i) kv->h_left_pad[i] -= min_pad;
        else st = move_row(kv, i, kv->h_left_pad[keep[i]] - min_pad, kv, keep[i]);
    }
    if (st) return st; /* a CUDA error: the context is lost anyway */
    kv->rows = n_keep;
    kv->x_valid = 0; /* rows moved: the side buffer no longer matches them */
    return cuda_kv_sync_rows(kv);
}

extern "C" tqkv_status tqkv_cuda_kv_filter(cuda_kv *kv, const int *keep, int n_keep) {
    if (!kv) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_filter: NULL cache");
    tqkv_status st = check_keep(kv, keep, n_keep, "tqkv_cuda_kv_filter");
    if (st) return st;
    const int order = keep_in_place(keep, n_keep, kv->rows);
    if (order) {
        if ((st = filter_inplace(kv, keep, n_keep, order))) return st;
        /* most rows gone (a server going idle): give the room back, a quarter spare */
        if (kv->row_cap > 2 * n_keep + 8) (void)regrow(kv, kv->cap, n_keep + n_keep / 4 + 4);
        return TQKV_OK;
    }
    cuda_kv *t = NULL;
    st = tqkv_cuda_kv_select(kv, keep, n_keep, &t);
    if (st) return st;
    install(kv, t);
    return TQKV_OK;
}

/* The checks a join makes of its items (tqkv_cuda_kv_merge's and tqkv_cuda_kv_append_rows'):
 * none NULL, none the target `self` (NULL for a merge), none in a spec round, every one
 * configured as ref (`ref_name` in the message); *rows = base + their rows, *maxlen = the
 * longest of their rows (at least *maxlen's value on entry). */
static tqkv_status items_check(const char *fn, const cuda_kv *ref, const char *ref_name, const cuda_kv *self,
                               cuda_kv *const *items, int n_items, long base, long *rows, int *maxlen) {
    char what[160] = "";
    long total = base;
    for (int i = 0; i < n_items; i++) {
        const cuda_kv *it = items[i];
        if (!it || it == self) return tqkv_fail(TQKV_EINVAL, "%s: item %d is NULL%s", fn, i, self ? " or the target" : "");
        if (it->spec_active) return tqkv_fail(TQKV_ESTATE, "%s: item %d is in a spec round", fn, i);
        if (cache_config_diff(&ref->cfg, &it->cfg, what, sizeof what) || it->bf16 != ref->bf16)
            return tqkv_fail(TQKV_EINVAL, "%s: item %d differs from %s (%s)", fn, i, ref_name, what);
        total += it->rows;
        for (int r = 0; r < it->rows; r++)
            if (it->h_offset[r] > *maxlen) *maxlen = it->h_offset[r];
    }
    *rows = total;
    return TQKV_OK;
}

/* Rows the items add to kv's and the longest of them (items_check, kv as the reference). */
static tqkv_status join_check(const cuda_kv *kv, cuda_kv *const *items, int n_items, int *rows,
                              int *maxlen) {
    static const char fn[] = "tqkv_cuda_kv_append_rows";
    if (!kv || (n_items && !items) || n_items < 0) return tqkv_fail(TQKV_EINVAL, "%s: bad arguments", fn);
    if (kv->spec_active) return tqkv_fail(TQKV_ESTATE, "%s: the cache is in a spec round", fn);
    *maxlen = 0;
    long total = 0;
    const tqkv_status st = items_check(fn, kv, "the cache", kv, items, n_items, kv->rows, &total, maxlen);
    if (st) return st;
    if (total > CUDA_MAX_ROWS) return tqkv_fail(TQKV_EUNSUPPORTED, "%s: %ld rows (at most %d)", fn, total, CUDA_MAX_ROWS);
    *rows = (int)total;
    return TQKV_OK;
}

/* The column a joining row of n tokens ends at: the rows' last end column when it fits (rows
 * end together, as tqkv_cuda_kv_merge lays them out), else n (left_pad 0): batch_rows.c's
 * append_end. */
static int join_end(const cuda_kv *kv, int n) {
    int end = 0;
    for (int r = 0; r < kv->rows; r++)
        if (kv->h_left_pad[r] + kv->h_offset[r] > end) end = kv->h_left_pad[r] + kv->h_offset[r];
    return n <= end ? end : n;
}

extern "C" tqkv_status tqkv_cuda_kv_append_rows_reserve(cuda_kv *kv, cuda_kv *const *items, int n_items) {
    int rows = 0, maxlen = 0;
    tqkv_status st = join_check(kv, items, n_items, &rows, &maxlen);
    if (st) return st;
    const int need = join_end(kv, maxlen);
    if (need <= kv->cap && rows <= kv->row_cap) return TQKV_OK;
    long cap = kv->cap, row_cap = kv->row_cap;
    if (need > cap) { /* cuda_kv_reserve's growth */
        cap += cap / 4 > 256 ? cap / 4 : 256;
        if (cap < need) cap = need;
        if (cap > INT32_MAX) cap = need;
    }
    if (rows > row_cap) { /* an eighth spare: rows join and leave all the time */
        row_cap += row_cap / 8 > 4 ? row_cap / 8 : 4;
        if (row_cap < rows) row_cap = rows;
        if (row_cap > CUDA_MAX_ROWS) row_cap = CUDA_MAX_ROWS;
    }
    return regrow(kv, (int)cap, (int)row_cap);
}

/* Zero row r's planes (its columns start as zeros, as in storage made by init). */
static tqkv_status zero_row(cuda_kv *kv, int r) {
    const size_t seg = (size_t)kv->kvh * kv->cap;
    struct { void *p; size_t per; } pl[4] = {{kv->kd, kv->kpay}, {kv->vd, kv->vpay},
                                             {kv->ks, 2 * (size_t)kv->kns}, {kv->vs, 2 * (size_t)kv->vns}};
    tqkv_status st = TQKV_OK;
    for (int i = 0; i < 4 && !st; i++)
        if (pl[i].p && pl[i].per)
            st = cuda_check(cudaMemsetAsync((uint8_t *)pl[i].p + (size_t)r * seg * pl[i].per, 0, seg * pl[i].per,
                                            kv->stream), "join: zero a row");
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_append_rows_queue(cuda_kv *kv, cuda_kv *const *items, int n_items) {
    tqkv_status st = tqkv_cuda_kv_append_rows_reserve(kv, items, n_items);
    for (int i = 0; i < n_items && !st; i++) /* their queued work (appends) first */
        if (items[i]->stream != kv->stream) st = cuda_check(cudaStreamSynchronize(items[i]->stream), "join");
    if (st) return st;
    const int end = join_end(kv, 0);
    for (int i = 0; i < n_items && !st; i++)
        for (int r = 0; r < items[i]->rows && !st; r++) {
            const int n = items[i]->h_offset[r], dr = kv->rows;
            st = zero_row(kv, dr);
            if (!st) st = move_row(kv, dr, (n <= end ? end : n) - n, items[i], r);
            if (!st) kv->rows++;
        }
    kv->x_valid = 0;
    return st ? st : cuda_kv_sync_rows(kv);
}

extern "C" tqkv_status tqkv_cuda_kv_append_rows(cuda_kv *kv, cuda_kv *const *items, int n_items) {
    tqkv_status st = tqkv_cuda_kv_append_rows_queue(kv, items, n_items);
    /* the copies read the items, which the caller frees next */
    if (!st) st = cuda_check(cudaStreamSynchronize(kv->stream), "join");
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_align(cuda_kv *kv, const int *left_pad) {
    if (!kv || (!left_pad && kv->rows)) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_align: NULL argument");
    int need = 1;
    for (int r = 0; r < kv->rows; r++) {
        if (left_pad[r] < 0) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_align: left_pad[%d] < 0", r);
        if (left_pad[r] + kv->h_offset[r] > need) need = left_pad[r] + kv->h_offset[r];
    }
    const int cap = need > kv->cap ? need : kv->cap;
    cuda_kv *t = NULL;
    tqkv_status st = cuda_kv_init_on(&t, &kv->cfg, kv->bf16, kv->rows, cap, kv->stream);
    for (int r = 0; !st && r < kv->rows; r++) st = move_row(t, r, left_pad[r], kv, r);
    if (!st) st = cuda_kv_sync_rows(t);
    if (st) {
        tqkv_cuda_kv_free(t);
        return st;
    }
    install(kv, t);
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_extract(const cuda_kv *kv, int row, cuda_kv **out) {
    if (!kv || !out) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_extract: NULL argument");
    if (row < 0 || row >= kv->rows) return tqkv_fail(TQKV_ERANGE, "tqkv_cuda_kv_extract: row %d not in [0, %d)", row, kv->rows);
    cuda_kv *t = NULL;
    tqkv_status st = cuda_kv_init_on(&t, &kv->cfg, kv->bf16, 1, kv->h_offset[row] > 0 ? kv->h_offset[row] : 1,
                                     kv->stream);
    if (!st) st = move_row(t, 0, 0, kv, row);
    if (!st) st = cuda_kv_sync_rows(t);
    if (st) {
        tqkv_cuda_kv_free(t);
        return st;
    }
    t->h_spec_base[0] = 0;
    *out = t;
    return TQKV_OK;
}

extern "C" tqkv_status tqkv_cuda_kv_merge(cuda_kv **out, cuda_kv *const *items, int n_items) {
    if (!out || !items || n_items < 1) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_merge: bad arguments");
    long rows = 0; /* the items' rows summed (items_check); the new cache takes it as an int */
    int maxlen = 1;
    tqkv_status st = items_check("tqkv_cuda_kv_merge", items[0], "item 0", NULL, items, n_items, 0, &rows, &maxlen);
    if (st) return st;
    /* the new cache runs on item 0's stream; the other items' queued work finishes first,
     * and the copies finish before returning (the callers free the items) */
    cudaStream_t s0 = items[0]->stream;
    for (int i = 1; i < n_items && !st; i++)
        if (items[i]->stream != s0) st = cuda_check(cudaStreamSynchronize(items[i]->stream), "merge");
    cuda_kv *t = NULL;
    if (!st) st = cuda_kv_init_on(&t, &items[0]->cfg, items[0]->bf16, (int)rows, maxlen, s0);
    for (int i = 0, dr = 0; !st && i < n_items; i++)
        for (int r = 0; !st && r < items[i]->rows; r++, dr++)
            st = move_row(t, dr, maxlen - items[i]->h_offset[r], items[i], r);
    if (!st) st = cuda_kv_sync_rows(t);
    if (!st && n_items > 1) st = cuda_check(cudaStreamSynchronize(s0), "merge");
    if (st) {
        tqkv_cuda_kv_free(t);
        return st;
    }
    *out = t;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// State export / restore through host memory
// ---------------------------------------------------------------------------
extern "C" tqkv_status tqkv_cuda_kv_export(const cuda_kv *kv, uint8_t **out, size_t *len) {
    if (!kv || !out || !len) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_export: NULL argument");
    if (kv->bf16) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_export: the bf16 baseline has no state format");
    if (kv->spec_active) return tqkv_fail(TQKV_ESTATE, "tqkv_cuda_kv_export: a spec round is active");
    struct tqkv_batch *b = NULL;
    tqkv_status st = batch_create(&b, &kv->cfg, kv->rows, kv->cap, 0);
    if (st) return st;
    st = tqkv_cuda_kv_download(kv, b->k.data, b->k.scales, b->v.data, b->v.scales,
                          b->k.has_window ? b->k.win_data : NULL, b->k.has_window ? b->k.win_scales : NULL,
                          b->v.has_window ? b->v.win_data : NULL, b->v.has_window ? b->v.win_scales : NULL);
    if (!st) {
        for (int r = 0; r < kv->rows; r++) {
            b->offset[r] = kv->h_offset[r];
            b->left_pad[r] = kv->h_left_pad[r];
            b->win_lo[r] = kv->h_win_lo[r];
        }
        st = state_export(b, 0, out, len);
    }
    batch_destroy(b);
    return st;
}

extern "C" tqkv_status tqkv_cuda_kv_restore(cuda_kv **out, const uint8_t *buf, size_t len) {
    if (!out || !buf) return tqkv_fail(TQKV_EINVAL, "tqkv_cuda_kv_restore: NULL argument");
    struct tqkv_batch *b = NULL;
    tqkv_status st = state_restore(&b, 0, buf, len);
    if (st) return st;
    cuda_kv *kv = NULL;
    st = tqkv_cuda_kv_init(&kv, &b->cfg, 0, b->rows, b->cap > 0 ? b->cap : 1);
    if (!st) st = tqkv_cuda_kv_upload(kv, b);
    batch_destroy(b);
    if (st) {
        tqkv_cuda_kv_free(kv);
        return st;
    }
    *out = kv;
    return TQKV_OK;
}

/*
 * tp_comm_cuda.cu - the device-local backend of tp_comm.h (every CUDA build) and the
 *   rank-order sum kernel both device backends run.
 * Owns: the device-local communicator (TP_BACKEND_DEVICE): N ranks of this process whose
 *   buffers are device memory, possibly several ranks on one GPU (the single-GPU test of the
 *   sharded forward), where NCCL cannot run (it needs one GPU per rank). The all-reduce
 *   gathers the N buffers by cudaMemcpyAsync (unified addressing) into one staging buffer [N, count] on rank
 *   0's GPU, on rank 0's stream, after every rank's stream reached the call (events), sums it
 *   in rank order (k_sum_rank_order, the NCCL backend's kernel), copies the sum back into
 *   every rank's buffer, and makes every rank's stream wait for that. The all-gather copies
 *   every send buffer into every recv buffer the same way.
 * Must not: reorder a sum (its bits are tp_sum_rank_order's); block the host.
 * NOT RUN: compiled only (no GPU on the machine it was written on; docs/TP.md).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "model/tp/tp_comm_impl.h"

// ---------------------------------------------------------------------------
// the rank-order sum (both device backends)
// ---------------------------------------------------------------------------

/* out[i] = ((g[0][i] + g[1][i]) + ...) + g[n-1][i], g[r] = gather + r * count; the adds are
 * __fadd_rn so no contraction or reassociation can change them. */
__global__ void k_sum_rank_order(const float *gather, int n, size_t count, float *out) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x) {
        float acc = gather[i];
        for (int r = 1; r < n; r++) acc = __fadd_rn(acc, gather[(size_t)r * count + i]);
        out[i] = acc;
    }
}

extern "C" tqkv_status tp_sum_rank_order_queue(const float *gather, int n, size_t count,
                                               float *out, void *stream) {
    if (count == 0) return TQKV_OK;
    const int threads = 256;
    const size_t want = (count + threads - 1) / threads;
    const int blocks = want > 4096 ? 4096 : (int)want;
    k_sum_rank_order<<<blocks, threads, 0, (cudaStream_t)stream>>>(gather, n, count, out);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return tqkv_fail(TQKV_EIO, "tensor parallel: rank-order sum: %s", cudaGetErrorString(e));
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

typedef struct {
    int         device[TP_MAX_RANKS]; /* [n] CUDA device of each rank */
    cudaEvent_t ev[TP_MAX_RANKS];     /* [n] rank i's stream reached the collective */
    cudaEvent_t done;                 /* rank 0's stream finished it (device[0]) */
    float      *stage;                /* device[0] [n, cap] */
    size_t      cap;                  /* floats per rank the staging holds */
} dev_state;

#define CUDA_TRY(x, what)                                                                        \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            (void)cudaGetLastError();                                                            \
            return tqkv_fail(TQKV_EIO, "tensor parallel: %s: %s", what, cudaGetErrorString(e_)); \
        }                                                                                        \
    } while (0)

extern "C" void tp_dev_free(tp_comm *c) {
    dev_state *s = (dev_state *)c->nccl;
    if (!s) return;
    for (int i = 0; i < c->n; i++)
        if (s->ev[i]) {
            cudaSetDevice(s->device[i]);
            cudaEventDestroy(s->ev[i]);
        }
    cudaSetDevice(s->device[0]);
    if (s->done) cudaEventDestroy(s->done);
    cudaFree(s->stage);
    free(s);
    c->nccl = NULL;
}

static tqkv_status dev_init_events(dev_state *s, int n) {
    for (int i = 0; i < n; i++) {
        CUDA_TRY(cudaSetDevice(s->device[i]), "cudaSetDevice");
        CUDA_TRY(cudaEventCreateWithFlags(&s->ev[i], cudaEventDisableTiming), "event");
    }
    CUDA_TRY(cudaSetDevice(s->device[0]), "cudaSetDevice");
    CUDA_TRY(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming), "event");
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_init_device(tp_comm **out, int n, const int *devices) {
    if (!out || n < 1 || n > TP_MAX_RANKS)
        return tqkv_fail(TQKV_EINVAL, "tensor parallel: %d ranks (need 1..%d)", n, TP_MAX_RANKS);
    int have = 0;
    if (cudaGetDeviceCount(&have) != cudaSuccess) { /* no driver, or one too old */
        (void)cudaGetLastError();
        have = 0;
    }
    for (int i = 0; i < n; i++)
        if ((devices ? devices[i] : 0) < 0 || (devices ? devices[i] : 0) >= have)
            return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: rank %d's GPU %d is not among "
                             "the %d visible", i, devices ? devices[i] : 0, have);
    tp_comm *c = (tp_comm *)calloc(1, sizeof *c);
    dev_state *s = (dev_state *)calloc(1, sizeof *s);
    if (!c || !s) {
        free(c);
        free(s);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    c->backend = TP_BACKEND_DEVICE;
    c->n = c->local = n;
    c->threads = 1;
    c->nccl = s; /* the backend's state */
    for (int i = 0; i < n; i++) s->device[i] = devices ? devices[i] : 0;
    tqkv_status rc = dev_init_events(s, n);
    if (rc != TQKV_OK) {
        tp_dev_free(c);
        free(c);
        return rc;
    }
    *out = c;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// collectives
// ---------------------------------------------------------------------------

static cudaStream_t stream_of(void *const *streams, int i) {
    return streams ? (cudaStream_t)streams[i] : (cudaStream_t)0;
}

/* Rank 0's stream waits until every rank's stream reached this point. */
static tqkv_status join_ranks(tp_comm *c, dev_state *s, void *const *streams) {
    for (int i = 0; i < c->n; i++) {
        CUDA_TRY(cudaSetDevice(s->device[i]), "cudaSetDevice");
        CUDA_TRY(cudaEventRecord(s->ev[i], stream_of(streams, i)), "event record");
    }
    CUDA_TRY(cudaSetDevice(s->device[0]), "cudaSetDevice");
    for (int i = 1; i < c->n; i++)
        CUDA_TRY(cudaStreamWaitEvent(stream_of(streams, 0), s->ev[i], 0), "stream wait");
    return TQKV_OK;
}

/* Every rank's stream waits for what rank 0's stream queued so far; device[0] current. */
static tqkv_status release_ranks(tp_comm *c, dev_state *s, void *const *streams) {
    CUDA_TRY(cudaEventRecord(s->done, stream_of(streams, 0)), "event record");
    for (int i = 1; i < c->n; i++) {
        CUDA_TRY(cudaSetDevice(s->device[i]), "cudaSetDevice");
        CUDA_TRY(cudaStreamWaitEvent(stream_of(streams, i), s->done, 0), "stream wait");
    }
    CUDA_TRY(cudaSetDevice(s->device[0]), "cudaSetDevice");
    return TQKV_OK;
}

/* A copy between two ranks' buffers (the same GPU or two: unified addressing tells which),
 * queued on `stream`. cudaMemcpyAsync, not cudaMemcpyPeerAsync: the latter invalidates a
 * stream capture (the sharded decode graph; H100, session 10), this one becomes a copy node. */
static cudaError_t peer_copy(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
}

static tqkv_status ensure_stage(tp_comm *c, dev_state *s, int n, size_t count) {
    if (count <= s->cap) return TQKV_OK;
    c->scratch_gen++; /* a graph holding the old address must not replay (tp_comm.h) */
    CUDA_TRY(cudaSetDevice(s->device[0]), "cudaSetDevice");
    /* the old staging may still be read by queued work: wait for the device first */
    CUDA_TRY(cudaDeviceSynchronize(), "staging regrow");
    cudaFree(s->stage);
    s->stage = NULL;
    s->cap = 0;
    CUDA_TRY(cudaMalloc((void **)&s->stage, sizeof(float) * (size_t)n * count), "staging");
    s->cap = count;
    return TQKV_OK;
}

extern "C" tqkv_status tp_dev_allreduce_sum(tp_comm *c, float *const *bufs, size_t count,
                                            void *const *streams) {
    dev_state *s = (dev_state *)c->nccl;
    if (count == 0) return TQKV_OK;
    const size_t bytes = sizeof(float) * count;
    tqkv_status rc = ensure_stage(c, s, c->n, count);
    if (rc == TQKV_OK) rc = join_ranks(c, s, streams);
    if (rc != TQKV_OK) return rc;
    const cudaStream_t s0 = stream_of(streams, 0);
    for (int i = 0; i < c->n; i++) /* [n, count]: rank i at i * count */
        CUDA_TRY(peer_copy(s->stage + (size_t)i * count, bufs[i], bytes, s0), "gather copy");
    rc = tp_sum_rank_order_queue(s->stage, c->n, count, bufs[0], (void *)s0);
    if (rc != TQKV_OK) return rc;
    for (int i = 1; i < c->n; i++)
        CUDA_TRY(peer_copy(bufs[i], bufs[0], bytes, s0), "broadcast copy");
    return release_ranks(c, s, streams);
}

extern "C" tqkv_status tp_dev_allgather(tp_comm *c, const float *const *send, float *const *recv,
                                        size_t count, void *const *streams) {
    dev_state *s = (dev_state *)c->nccl;
    if (count == 0) return TQKV_OK;
    tqkv_status rc = join_ranks(c, s, streams);
    if (rc != TQKV_OK) return rc;
    const cudaStream_t s0 = stream_of(streams, 0);
    for (int i = 0; i < c->n; i++)
        for (int r = 0; r < c->n; r++)
            CUDA_TRY(peer_copy(recv[i] + (size_t)r * count, send[r], sizeof(float) * count, s0),
                     "gather copy");
    return release_ranks(c, s, streams);
}

// ---------------------------------------------------------------------------
// self-check (n ranks on GPU 0)
// ---------------------------------------------------------------------------

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* host [n, count] random over many binades (a sum's order shows in its bits); every rank's
 * device buffer after the all-reduce must equal tp_sum_rank_order bit for bit, and every
 * rank's all-gather receive buffer [n, count] the n send buffers in rank order. */
static tqkv_status dev_selftest_run(tp_comm *c, int n, size_t count, uint64_t seed, float *host,
                                    float *dev, float *want, float *got, cudaStream_t *st) {
    const size_t bytes = sizeof(float) * count;
    const float *in[TP_MAX_RANKS];
    float *bufs[TP_MAX_RANKS], *recv[TP_MAX_RANKS];
    void *streams[TP_MAX_RANKS];
    for (int r = 0; r < n; r++) {
        float *h = host + (size_t)r * count;
        for (size_t i = 0; i < count; i++) {
            const double u = (double)(splitmix(&seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
            h[i] = (float)ldexp(u, (int)(splitmix(&seed) % 25) - 12);
        }
        in[r] = h;
        bufs[r] = dev + (size_t)r * count;
        recv[r] = dev + (size_t)(n + r * n) * count; /* [n, count] each */
        streams[r] = (void *)st[r];
    }
    CUDA_TRY(cudaMemcpy(dev, host, bytes * (size_t)n, cudaMemcpyHostToDevice), "copy");
    CUDA_TRY(cudaDeviceSynchronize(), "copy"); /* landed before the non-blocking streams read */
    tp_sum_rank_order(in, n, count, want);
    tqkv_status rc = tp_allgather(c, (const float *const *)bufs, recv, count, streams);
    if (rc == TQKV_OK) rc = tp_allreduce_sum(c, bufs, count, streams);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < n; r++) CUDA_TRY(cudaStreamSynchronize(st[r]), "sync");
    for (int r = 0; r < n; r++) {
        CUDA_TRY(cudaMemcpy(got, bufs[r], bytes, cudaMemcpyDeviceToHost), "copy");
        if (memcmp(got, want, bytes))
            return tqkv_fail(TQKV_EIO, "tensor parallel: device all-reduce of rank %d (of %d) "
                             "differs from the rank-order sum", r, n);
        for (int q = 0; q < n; q++) {
            CUDA_TRY(cudaMemcpy(got, recv[r] + (size_t)q * count, bytes, cudaMemcpyDeviceToHost), "copy");
            if (memcmp(got, in[q], bytes))
                return tqkv_fail(TQKV_EIO, "tensor parallel: device all-gather: rank %d's block %d "
                                 "differs", r, q);
        }
    }
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_device_selftest(int n, unsigned long long seed) {
    tp_comm *c = NULL; /* TQKV_EUNSUPPORTED without a visible GPU */
    tqkv_status rc = tp_comm_init_device(&c, n, NULL);
    if (rc != TQKV_OK) return rc;
    const size_t count = 100003; /* not a multiple of any block */
    float *host = (float *)malloc(sizeof(float) * count * (size_t)n);
    float *want = (float *)malloc(sizeof(float) * count), *got = (float *)malloc(sizeof(float) * count);
    float *dev = NULL;
    cudaStream_t st[TP_MAX_RANKS] = {0};
    rc = host && want && got ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (rc == TQKV_OK && cudaMalloc((void **)&dev, sizeof(float) * count * (size_t)(n + n * n)) != cudaSuccess)
        rc = tqkv_fail(TQKV_ENOMEM, "tensor parallel self-check: cudaMalloc");
    for (int r = 0; r < n && rc == TQKV_OK; r++)
        if (cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking) != cudaSuccess)
            rc = tqkv_fail(TQKV_EIO, "tensor parallel self-check: stream");
    if (rc == TQKV_OK) rc = dev_selftest_run(c, n, count, seed, host, dev, want, got, st);
    cudaDeviceSynchronize();
    for (int r = 0; r < n; r++)
        if (st[r]) cudaStreamDestroy(st[r]);
    cudaFree(dev);
    free(host);
    free(want);
    free(got);
    tp_comm_free(c);
    return rc;
}

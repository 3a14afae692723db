/*
 * tp_comm_nccl.cu - the NCCL backend of tp_comm.h (built in a CUDA build where nccl.h was
 *   found: TQKV_HAVE_NCCL). Device buffers.
 * Owns: the NCCL communicators (one per local GPU), each local rank's gather scratch
 *   [N * count] on its GPU (the rank-order sum kernel is tp_comm_cuda.cu's). The all-reduce
 *   is an ncclAllGather of every rank's buffer followed by a local sum in rank order on every
 *   GPU, so its bits are those of tp_sum_rank_order (the CPU backend) whatever NCCL's ring or
 *   tree order would be.
 *   Bootstrap: ncclCommInitAll for one process driving n GPUs; ncclCommInitRank with the id of
 *   tp_comm_nccl_unique_id (shared by tp_bootstrap.h) for one rank per process / host.
 * Must not: call ncclAllReduce (its order is not fixed); use fast math in the sum.
 * NOT RUN: compiled only (no multi-GPU machine was lent when it was written; docs/TP.md).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/common.h"
}
#include "model/tp/tp_comm_impl.h"

// ---------------------------------------------------------------------------
// state
// ---------------------------------------------------------------------------

typedef struct {
    ncclComm_t comm[TP_MAX_RANKS];    /* [local] */
    int        device[TP_MAX_RANKS];  /* [local] CUDA device of each local rank */
    float     *gather[TP_MAX_RANKS];  /* [local] device [n * cap] */
    size_t     cap;                   /* floats per rank the gather scratch holds */
} nccl_state;

#define NCCL_TRY(x, what)                                                                        \
    do {                                                                                         \
        ncclResult_t r_ = (x);                                                                   \
        if (r_ != ncclSuccess)                                                                   \
            return tqkv_fail(TQKV_EIO, "tensor parallel: %s: %s", what, ncclGetErrorString(r_)); \
    } while (0)
#define CUDA_TRY(x, what)                                                                        \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess)                                                                   \
            return tqkv_fail(TQKV_EIO, "tensor parallel: %s: %s", what, cudaGetErrorString(e_)); \
    } while (0)

static tqkv_status make_comm(tp_comm **out, int n, int local, int first, nccl_state **st) {
    tp_comm *c = (tp_comm *)calloc(1, sizeof *c);
    nccl_state *s = (nccl_state *)calloc(1, sizeof *s);
    if (!c || !s) {
        free(c);
        free(s);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    c->backend = TP_BACKEND_NCCL;
    c->n = n;
    c->local = local;
    c->first = first;
    c->threads = 1;
    c->nccl = s;
    *out = c; /* the caller's local, published only once the communicator is up */
    *st = s;
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_init_nccl_local(tp_comm **out, int n, const int *devices) {
    if (!out || n < 1 || n > TP_MAX_RANKS)
        return tqkv_fail(TQKV_EINVAL, "tensor parallel: %d ranks (need 1..%d)", n, TP_MAX_RANKS);
    int have = 0;
    if (cudaGetDeviceCount(&have) != cudaSuccess) { /* no driver or no device: none visible */
        (void)cudaGetLastError();
        have = 0;
    }
    if (have < n)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: %d ranks need %d GPUs, %d visible",
                         n, n, have);
    tp_comm *c = NULL;
    nccl_state *s = NULL;
    tqkv_status rc = make_comm(&c, n, n, 0, &s); /* c: a local until it is up */
    if (rc != TQKV_OK) return rc;
    for (int i = 0; i < n; i++) s->device[i] = devices ? devices[i] : i;
    ncclResult_t r = ncclCommInitAll(s->comm, n, s->device);
    if (r != ncclSuccess) {
        free(s);
        free(c);
        return tqkv_fail(TQKV_EIO, "tensor parallel: ncclCommInitAll: %s", ncclGetErrorString(r));
    }
    *out = c;
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_nccl_unique_id(unsigned char id[TP_ID_BYTES]) {
    ncclUniqueId u;
    NCCL_TRY(ncclGetUniqueId(&u), "ncclGetUniqueId");
    memcpy(id, u.internal, TP_ID_BYTES);
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_init_nccl_rank(tp_comm **out, int n, int rank, int device,
                                              const unsigned char id[TP_ID_BYTES]) {
    if (!out || !id || n < 1 || n > TP_MAX_RANKS || rank < 0 || rank >= n)
        return tqkv_fail(TQKV_EINVAL, "tensor parallel: rank %d of %d", rank, n);
    CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
    tp_comm *c = NULL;
    nccl_state *s = NULL;
    tqkv_status rc = make_comm(&c, n, 1, rank, &s);
    if (rc != TQKV_OK) return rc;
    ncclUniqueId u;
    memcpy(u.internal, id, TP_ID_BYTES);
    s->device[0] = device;
    ncclResult_t r = ncclCommInitRank(&s->comm[0], n, u, rank);
    if (r != ncclSuccess) {
        free(s);
        free(c);
        return tqkv_fail(TQKV_EIO, "tensor parallel: ncclCommInitRank: %s", ncclGetErrorString(r));
    }
    *out = c;
    return TQKV_OK;
}

extern "C" void tp_nccl_free(tp_comm *c) {
    nccl_state *s = (nccl_state *)c->nccl;
    if (!s) return;
    for (int i = 0; i < c->local; i++) {
        cudaSetDevice(s->device[i]);
        cudaFree(s->gather[i]);
        if (s->comm[i]) ncclCommDestroy(s->comm[i]);
    }
    free(s);
    c->nccl = NULL;
}

// ---------------------------------------------------------------------------
// collectives
// ---------------------------------------------------------------------------

static tqkv_status ensure_gather(tp_comm *c, nccl_state *s, size_t count) {
    if (count <= s->cap) return TQKV_OK;
    c->scratch_gen++; /* a graph holding the old addresses must not replay (tp_comm.h) */
    for (int i = 0; i < c->local; i++) {
        CUDA_TRY(cudaSetDevice(s->device[i]), "cudaSetDevice");
        cudaFree(s->gather[i]);
        s->gather[i] = NULL;
        CUDA_TRY(cudaMalloc((void **)&s->gather[i], sizeof(float) * (size_t)c->n * count),
                 "gather scratch");
    }
    s->cap = count;
    return TQKV_OK;
}

static cudaStream_t stream_of(void *const *streams, int i) {
    return streams ? (cudaStream_t)streams[i] : (cudaStream_t)0;
}

extern "C" tqkv_status tp_nccl_allgather(tp_comm *c, const float *const *send,
                                         float *const *recv, size_t count, void *const *streams) {
    nccl_state *s = (nccl_state *)c->nccl;
    NCCL_TRY(ncclGroupStart(), "ncclGroupStart");
    for (int i = 0; i < c->local; i++) {
        ncclResult_t r = ncclAllGather(send[i], recv[i], count, ncclFloat, s->comm[i],
                                       stream_of(streams, i));
        if (r != ncclSuccess) {
            (void)ncclGroupEnd();
            return tqkv_fail(TQKV_EIO, "tensor parallel: ncclAllGather: %s", ncclGetErrorString(r));
        }
    }
    NCCL_TRY(ncclGroupEnd(), "ncclGroupEnd");
    return TQKV_OK;
}

extern "C" tqkv_status tp_nccl_allreduce_sum(tp_comm *c, float *const *bufs, size_t count,
                                             void *const *streams) {
    nccl_state *s = (nccl_state *)c->nccl;
    if (count == 0) return TQKV_OK; /* n == 1 too runs the gather and the sum (a copy): the
                                     * single-GPU check of this path (docs/TP.md) */
    tqkv_status rc = ensure_gather(c, s, count);
    if (rc != TQKV_OK) return rc;
    rc = tp_nccl_allgather(c, (const float *const *)bufs, s->gather, count, streams);
    if (rc != TQKV_OK) return rc;
    for (int i = 0; i < c->local && rc == TQKV_OK; i++) { /* k_sum_rank_order (tp_comm_cuda.cu) */
        CUDA_TRY(cudaSetDevice(s->device[i]), "cudaSetDevice");
        rc = tp_sum_rank_order_queue(s->gather[i], c->n, count, bufs[i], (void *)stream_of(streams, i));
    }
    return rc;
}

// ---------------------------------------------------------------------------
// self-check (single process, n GPUs)
// ---------------------------------------------------------------------------

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* host[r] [count] random per rank; dev[r] their copies; after the all-reduce every dev[r]
 * must equal tp_sum_rank_order(host) bit for bit. */
static tqkv_status selftest_run(tp_comm *c, int n, size_t count, uint64_t seed, float **host,
                                float **dev, float *want, float *got) {
    nccl_state *s = (nccl_state *)c->nccl;
    for (int r = 0; r < n; r++) {
        for (size_t i = 0; i < count; i++)
            host[r][i] = (float)((double)(splitmix(&seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
        CUDA_TRY(cudaSetDevice(s->device[r]), "cudaSetDevice");
        CUDA_TRY(cudaMalloc((void **)&dev[r], sizeof(float) * count), "cudaMalloc");
        CUDA_TRY(cudaMemcpy(dev[r], host[r], sizeof(float) * count, cudaMemcpyHostToDevice), "copy");
    }
    tp_sum_rank_order((const float *const *)host, n, count, want);
    tqkv_status rc = tp_allreduce_sum(c, dev, count, NULL);
    if (rc != TQKV_OK) return rc;
    for (int r = 0; r < n; r++) {
        CUDA_TRY(cudaSetDevice(s->device[r]), "cudaSetDevice");
        CUDA_TRY(cudaMemcpy(got, dev[r], sizeof(float) * count, cudaMemcpyDeviceToHost), "copy");
        if (memcmp(got, want, sizeof(float) * count))
            return tqkv_fail(TQKV_EIO, "tensor parallel: NCCL all-reduce of rank %d differs from "
                             "the rank-order sum", r);
    }
    return TQKV_OK;
}

extern "C" tqkv_status tp_comm_nccl_selftest(int n, unsigned long long seed) {
    tp_comm *c = NULL;
    tqkv_status rc = tp_comm_init_nccl_local(&c, n, NULL);
    if (rc != TQKV_OK) return rc;
    const size_t count = 100003; /* not a multiple of any block */
    float *host[TP_MAX_RANKS] = {0}, *dev[TP_MAX_RANKS] = {0};
    float *want = (float *)malloc(sizeof(float) * count), *got = (float *)malloc(sizeof(float) * count);
    int ok = want && got;
    for (int r = 0; r < n; r++) ok = ok && (host[r] = (float *)malloc(sizeof(float) * count));
    rc = ok ? selftest_run(c, n, count, seed, host, dev, want, got)
            : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int r = 0; r < n; r++) {
        free(host[r]);
        if (dev[r]) {
            cudaSetDevice(((nccl_state *)c->nccl)->device[r]);
            cudaFree(dev[r]);
        }
    }
    free(want);
    free(got);
    tp_comm_free(c);
    return rc;
}

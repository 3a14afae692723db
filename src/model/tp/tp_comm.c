/*
 * tp_comm.c - the communicator's lifecycle and dispatch, and the CPU backend: N ranks in
 *   this process, host buffers, the fixed rank-order sum of tp_comm.h.
 * Must not: reorder a sum (threads split elements only); know the model.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "model/tp/tp_comm_impl.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// the fixed-order sum
// ---------------------------------------------------------------------------

void tp_sum_rank_order(const float *const *in, int n, size_t count, float *out) {
    for (size_t i = 0; i < count; i++) {
        float acc = in[0][i];
        for (int r = 1; r < n; r++) acc += in[r][i]; /* rank 0 + rank 1 + ... + rank n-1 */
        out[i] = acc;
    }
}

// ---------------------------------------------------------------------------
// lifecycle
// ---------------------------------------------------------------------------

tqkv_status tp_comm_init_cpu(tp_comm **out, int n, int threads) {
    if (!out) return tqkv_fail(TQKV_EINVAL, "tp_comm_init_cpu: NULL argument");
    if (n < 1 || n > TP_MAX_RANKS || threads < 1)
        return tqkv_fail(TQKV_EINVAL, "tensor parallel: %d ranks (need 1..%d), threads %d", n,
                         TP_MAX_RANKS, threads);
    tp_comm *c = calloc(1, sizeof *c);
    if (!c) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    c->backend = TP_BACKEND_CPU;
    c->n = c->local = n;
    c->threads = threads;
    *out = c;
    return TQKV_OK;
}

void tp_comm_free(tp_comm *c) {
    if (!c) return;
#ifdef TQKV_HAVE_NCCL
    if (c->backend == TP_BACKEND_NCCL) tp_nccl_free(c);
#endif
#ifdef TQKV_HAVE_CUDA
    if (c->backend == TP_BACKEND_DEVICE) tp_dev_free(c);
#endif
    free(c);
}

int        tp_comm_size(const tp_comm *c) { return c ? c->n : 0; }
int        tp_comm_local(const tp_comm *c) { return c ? c->local : 0; }
int        tp_comm_first_rank(const tp_comm *c) { return c ? c->first : 0; }
tp_backend tp_comm_backend(const tp_comm *c) { return c ? c->backend : TP_BACKEND_CPU; }
unsigned long long tp_comm_scratch_gen(const tp_comm *c) { return c ? c->scratch_gen : 0; }

void tp_comm_set_threads(tp_comm *c, int threads) {
    if (c && threads >= 1) c->threads = threads;
}

#ifndef TQKV_HAVE_CUDA
tqkv_status tp_comm_init_device(tp_comm **out, int n, const int *devices) {
    (void)out, (void)n, (void)devices;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: the device backend needs a CUDA build");
}
tqkv_status tp_comm_device_selftest(int n, unsigned long long seed) {
    (void)n, (void)seed;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: the device backend needs a CUDA build");
}
#endif

#ifndef TQKV_HAVE_NCCL
tqkv_status tp_comm_init_nccl_local(tp_comm **out, int n, const int *devices) {
    (void)out, (void)n, (void)devices;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: NCCL is not built in (a CUDA build "
                     "with nccl.h)");
}
tqkv_status tp_comm_init_nccl_rank(tp_comm **out, int n, int rank, int device,
                                   const unsigned char id[TP_ID_BYTES]) {
    (void)out, (void)n, (void)rank, (void)device, (void)id;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: NCCL is not built in");
}
tqkv_status tp_comm_nccl_unique_id(unsigned char id[TP_ID_BYTES]) {
    (void)id;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: NCCL is not built in");
}
tqkv_status tp_comm_nccl_selftest(int n, unsigned long long seed) {
    (void)n, (void)seed;
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor parallel: NCCL is not built in");
}
#endif

// ---------------------------------------------------------------------------
// collectives
// ---------------------------------------------------------------------------

/* Elements split over threads in fixed blocks; each element's sum is rank order. */
static void cpu_allreduce(tp_comm *c, float *const *bufs, size_t count) {
    const size_t BLK = 4096, nb = (count + BLK - 1) / BLK;
    const int n = c->n;
#pragma omp parallel for num_threads(c->threads) schedule(static) if (nb > 1)
    for (size_t b = 0; b < nb; b++) {
        const size_t i0 = b * BLK, len = i0 + BLK <= count ? BLK : count - i0;
        const float *in[TP_MAX_RANKS];
        for (int r = 0; r < n; r++) in[r] = bufs[r] + i0;
        tp_sum_rank_order(in, n, len, bufs[0] + i0);
        for (int r = 1; r < n; r++) memcpy(bufs[r] + i0, bufs[0] + i0, sizeof(float) * len);
    }
}

tqkv_status tp_allreduce_sum(tp_comm *c, float *const *bufs, size_t count, void *const *streams) {
    if (!c || !bufs) return tqkv_fail(TQKV_EINVAL, "tp_allreduce_sum: NULL argument");
    for (int i = 0; i < c->local; i++)
        if (!bufs[i] && count) return tqkv_fail(TQKV_EINVAL, "tp_allreduce_sum: NULL buffer %d", i);
#ifdef TQKV_HAVE_NCCL
    if (c->backend == TP_BACKEND_NCCL) return tp_nccl_allreduce_sum(c, bufs, count, streams);
#endif
#ifdef TQKV_HAVE_CUDA
    if (c->backend == TP_BACKEND_DEVICE) return tp_dev_allreduce_sum(c, bufs, count, streams);
#endif
    (void)streams;
    if (c->n > 1 && count) cpu_allreduce(c, bufs, count);
    return TQKV_OK;
}

tqkv_status tp_allgather(tp_comm *c, const float *const *send, float *const *recv, size_t count,
                         void *const *streams) {
    if (!c || !send || !recv) return tqkv_fail(TQKV_EINVAL, "tp_allgather: NULL argument");
#ifdef TQKV_HAVE_NCCL
    if (c->backend == TP_BACKEND_NCCL) return tp_nccl_allgather(c, send, recv, count, streams);
#endif
#ifdef TQKV_HAVE_CUDA
    if (c->backend == TP_BACKEND_DEVICE) return tp_dev_allgather(c, send, recv, count, streams);
#endif
    (void)streams;
    for (int i = 0; i < c->local; i++) {
        if (i > 0 && recv[i] == recv[0]) continue; /* one host buffer may serve every rank */
        for (int r = 0; r < c->n; r++)
            if (recv[i] + (size_t)r * count != send[r]) /* in place when it is already there */
                memmove(recv[i] + (size_t)r * count, send[r], sizeof(float) * count);
    }
    return TQKV_OK;
}

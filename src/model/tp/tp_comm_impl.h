/*
 * tp_comm_impl.h - the communicator's layout, shared by the CPU backend (tp_comm.c) and the
 *   NCCL backend (tp_comm_nccl.cu).
 * Must not: be included outside src/model/tp/ and tests.
 */
#ifndef TQKV_TP_COMM_IMPL_H
#define TQKV_TP_COMM_IMPL_H

#include "model/tp/tp_comm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tp_comm {
    tp_backend backend;
    int        n;       /* all ranks */
    int        local;   /* ranks this process drives */
    int        first;   /* global rank of local rank 0 */
    int        threads; /* CPU backend: threads over elements */
    unsigned long long scratch_gen; /* device backends: scratch (re)allocations so far */
    void      *nccl;    /* the NCCL backend's state (tp_comm_nccl.cu) or the device-local
                         * backend's (tp_comm_cuda.cu), NULL for the CPU backend */
};

#ifdef TQKV_HAVE_CUDA
/* tp_comm_cuda.cu: the device-local backend, and the rank-order sum kernel's launch (both
 * device backends): out [count] = the rows of gather [n, count] summed in rank order, on
 * `stream` (a cudaStream_t) of the current device. */
tqkv_status tp_dev_allreduce_sum(tp_comm *c, float *const *bufs, size_t count,
                                 void *const *streams);
tqkv_status tp_dev_allgather(tp_comm *c, const float *const *send, float *const *recv,
                             size_t count, void *const *streams);
void        tp_dev_free(tp_comm *c);
tqkv_status tp_sum_rank_order_queue(const float *gather, int n, size_t count, float *out,
                                    void *stream);
#endif

#ifdef TQKV_HAVE_NCCL
/* tp_comm_nccl.cu: the NCCL backend's collectives and free. */
tqkv_status tp_nccl_allreduce_sum(tp_comm *c, float *const *bufs, size_t count,
                                  void *const *streams);
tqkv_status tp_nccl_allgather(tp_comm *c, const float *const *send, float *const *recv,
                              size_t count, void *const *streams);
void        tp_nccl_free(tp_comm *c);
#endif

#ifdef __cplusplus
}
#endif

#endif

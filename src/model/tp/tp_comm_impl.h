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
    void      *nccl;    /* NCCL backend's state (tp_comm_nccl.cu), NULL otherwise */
};

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

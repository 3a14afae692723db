/*
 * tp_comm.h - the collective layer of tensor parallelism (issue 25): N ranks, one all-reduce
 *   (sum) and one all-gather, with a FIXED addition order.
 * Owns: the communicator's lifecycle and its backends: CPU (every rank in this process, host
 *   buffers; the CPU sharded forward and its tests), NCCL (compiled only in a CUDA build
 *   where nccl.h was found, TQKV_HAVE_NCCL; device buffers): one process driving n GPUs
 *   (ncclCommInitAll) or one rank per process on any host (ncclCommInitRank with a unique id
 *   shared by tp_bootstrap.h), and device-local (every CUDA build; device buffers of ranks
 *   of this process, several possibly on one GPU). Not run on a GPU yet: see docs/TP.md.
 * Must not: know the model; allocate the callers' buffers; reduce in an order that depends
 *   on threads, rows, ring topology or the backend.
 *
 * The reduction order (every backend, every element i independently):
 *     out[i] = (((b_0[i] + b_1[i]) + b_2[i]) + ... ) + b_{N-1}[i]
 * in float32, b_r the buffer of rank r. NCCL's own all-reduce does not promise an order (its
 * ring / tree start differs with the topology), so the NCCL backend all-gathers the N buffers
 * and then sums them locally in rank order (tp_comm_nccl.cu): the same bits as the CPU backend.
 *
 * Buffers are given per LOCAL rank: bufs[i] belongs to the i-th rank this process drives
 * (ranks first .. first + local - 1). The CPU backend and single-process NCCL drive all N
 * (local == N); one rank per process drives one (local == 1), and the call is then a
 * collective every process makes.
 */
#ifndef TQKV_TP_COMM_H
#define TQKV_TP_COMM_H

#include <stddef.h>

#include "tqkv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TP_MAX_RANKS 8
/* bytes of a bootstrap id (NCCL_UNIQUE_ID_BYTES) */
#define TP_ID_BYTES 128

typedef enum { TP_BACKEND_CPU = 0, TP_BACKEND_NCCL, TP_BACKEND_DEVICE } tp_backend;

typedef struct tp_comm tp_comm;

/* The CPU backend: n ranks (1..TP_MAX_RANKS) in this process; threads >= 1 split elements
 * (never the order of a sum). */
tqkv_status tp_comm_init_cpu(tp_comm **out, int n, int threads);
/* NCCL, one process driving n GPUs devices[0..n) (NULL: 0..n-1), ncclCommInitAll. */
tqkv_status tp_comm_init_nccl_local(tp_comm **out, int n, const int *devices);
/* NCCL, rank `rank` of n driven by this process on GPU `device`; id: the bytes rank 0 got
 * from tp_comm_nccl_unique_id and shared (tp_bootstrap.h). ncclCommInitRank. */
tqkv_status tp_comm_init_nccl_rank(tp_comm **out, int n, int rank, int device,
                                   const unsigned char id[TP_ID_BYTES]);
/* The device-local backend (CUDA builds, tp_comm_cuda.cu): n ranks of this process with
 * device buffers on devices[0..n) (NULL: all on GPU 0; several ranks may share a GPU, which
 * NCCL cannot do): gathers by peer copies on rank 0's stream and the same rank-order sum
 * kernel as the NCCL backend. TQKV_EUNSUPPORTED in a build without CUDA. */
tqkv_status tp_comm_init_device(tp_comm **out, int n, const int *devices);
/* rank 0's bootstrap id (ncclGetUniqueId). */
tqkv_status tp_comm_nccl_unique_id(unsigned char id[TP_ID_BYTES]);
void        tp_comm_free(tp_comm *c);

int        tp_comm_size(const tp_comm *c);       /* N, all ranks */
int        tp_comm_local(const tp_comm *c);      /* ranks this process drives */
int        tp_comm_first_rank(const tp_comm *c); /* global rank of local rank 0 */
tp_backend tp_comm_backend(const tp_comm *c);
/* The CPU backend's thread count (threads >= 1; ignored by the device backends): a
 * communicator shared by states of other thread counts (tp_state.h) takes each state's before
 * its forward. */
void       tp_comm_set_threads(tp_comm *c, int threads);
/* How many times the device backends' scratch (NCCL's gather buffers, the device-local
 * staging) was allocated or moved: a CUDA graph that captured a collective holds the
 * scratch's address and must not replay once this changed (0 for the CPU backend). */
unsigned long long tp_comm_scratch_gen(const tp_comm *c);

/* In place: bufs[i] [count] of every local rank i; afterwards each holds the sum over all N
 * ranks in rank order (above). streams[i]: cudaStream_t of local rank i (NCCL; NULL: the
 * default stream), ignored by the CPU backend (may be NULL). */
tqkv_status tp_allreduce_sum(tp_comm *c, float *const *bufs, size_t count, void *const *streams);
/* send[i] [count] of local rank i; recv[i] [N * count] gets every rank r's at r * count (CPU
 * backend: the recv[i] may all be one buffer). */
tqkv_status tp_allgather(tp_comm *c, const float *const *send, float *const *recv, size_t count,
                         void *const *streams);

/* The fixed-order sum of one element range on the host (the CPU backend's and the
 * reference of tests): out[i] = ((in[0][i] + in[1][i]) + ...) + in[n-1][i]; out may alias
 * any in[r]. */
void tp_sum_rank_order(const float *const *in, int n, size_t count, float *out);

/* NCCL backend self-check on this machine's GPUs (n <= visible devices): random buffers,
 * tp_allreduce_sum and tp_allgather through NCCL, compared bit for bit with
 * tp_sum_rank_order on the host. TQKV_EUNSUPPORTED when NCCL is not built in or fewer than
 * n GPUs are visible. */
tqkv_status tp_comm_nccl_selftest(int n, unsigned long long seed);
/* The device-local backend's self check: n ranks (1..TP_MAX_RANKS) on GPU 0, each with its
 * own stream, random buffers; tp_allreduce_sum and tp_allgather compared bit for bit with
 * tp_sum_rank_order and the sent blocks. TQKV_EUNSUPPORTED without CUDA or a GPU. */
tqkv_status tp_comm_device_selftest(int n, unsigned long long seed);

#ifdef __cplusplus
}
#endif

#endif

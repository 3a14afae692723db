/*
 * tp_bootstrap.h - sharing rank 0's communicator id with the other ranks over TCP, for
 *   tensor parallelism with one process per GPU, on one host or several (docs/TP.md).
 * Owns: the exchange: rank 0 listens and answers each peer rank once with the id; a peer
 *   connects (retrying until its deadline) and reads it. Wire format, both ways: magic
 *   "TQKVTP01", then the peer's request: u32 rank, u32 ranks (little endian); the answer:
 *   the TP_ID_BYTES id bytes. A peer with a rank out of range, a repeated rank or another
 *   world size is refused (rank 0 closes it and fails).
 * Must not: know NCCL (the id is opaque bytes: tp_comm_nccl_unique_id makes it,
 *   tp_comm_init_nccl_rank takes it); keep a socket open after a call returns.
 *
 * Rank 0:  tp_comm_nccl_unique_id(id); tp_bootstrap_listen(port, &fd, &bound);
 *          tp_bootstrap_serve(fd, n, id, timeout); tp_comm_init_nccl_rank(&c, n, 0, dev, id)
 * Rank r:  tp_bootstrap_fetch(host, port, r, n, id, timeout); tp_comm_init_nccl_rank(&c, n,
 *          r, dev, id)
 */
#ifndef TQKV_TP_BOOTSTRAP_H
#define TQKV_TP_BOOTSTRAP_H

#include "model/tp/tp_comm.h"

/* A listening socket on every interface at `port` (0: any free port); *bound gets the port. */
tqkv_status tp_bootstrap_listen(int port, int *fd, int *bound);
/* Answer ranks 1 .. n-1 once each with id, then close fd (always closed). Fails on a bad
 * peer or when timeout_ms passes before all have asked. */
tqkv_status tp_bootstrap_serve(int fd, int n, const unsigned char id[TP_ID_BYTES], int timeout_ms);
/* Rank `rank` of n: connect to host:port (retrying while nothing listens yet, until
 * timeout_ms) and read the id. */
tqkv_status tp_bootstrap_fetch(const char *host, int port, int rank, int n,
                               unsigned char id[TP_ID_BYTES], int timeout_ms);

#endif

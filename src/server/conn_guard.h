/*
 * conn_guard.h - connection admission and request deadlines of `tqkv serve` against slow
 * clients (slowloris); internal to src/server (http.c wires it into libmicrohttpd).
 *
 * Model: a connection is a "reader" while it is sending a request (its head, then its
 * body; a kept-alive connection between requests is a reader too) and "busy" once its
 * request has arrived (generation, response). Readers may hold at most
 * max_conns - reserved slots; the reserved slots are for busy connections. A reader
 * past its deadline (head: header_s from the connection or the previous response; body:
 * body_s from the head) is closed by a watchdog thread. A new connection that finds the
 * readers at their cap, or all max_conns slots taken, evicts the reader that has been
 * sending longest; a busy connection is never evicted. So N clients dribbling headers at
 * the connection limit cannot lock out a client that sends its request at once.
 */
#ifndef TQKV_SERVER_CONN_GUARD_H
#define TQKV_SERVER_CONN_GUARD_H

#include <stdint.h>

#include <microhttpd.h>

typedef enum { CG_READING = 0, CG_BODY, CG_BUSY } cg_phase;

typedef struct conn_guard conn_guard;

typedef struct {
    uint64_t timed_out;   /* readers closed at their header / body deadline */
    uint64_t evicted;     /* readers closed to admit a new connection */
    uint64_t refused;     /* connections refused: every slot busy */
    int      readers, busy;
} conn_guard_stats;

/* max_conns >= 1; reserved in [0, max_conns - 1]; header_s / body_s: 0 = no deadline.
 * Starts the watchdog thread. 0 or -1 (out of memory / thread). */
int  conn_guard_init(conn_guard **out, int max_conns, int reserved, int header_s, int body_s);
void conn_guard_free(conn_guard *g);
/* The slots libmicrohttpd itself must allow: max_conns plus room for evicted
 * connections whose threads have not closed yet. */
unsigned conn_guard_hard_limit(const conn_guard *g);

/* libmicrohttpd callbacks: MHD_AcceptPolicyCallback (cls = the guard) and
 * MHD_NotifyConnectionCallback (cls = the guard). */
enum MHD_Result conn_guard_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen);
void conn_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode code);
/* The connection's request moved to phase ph (http.c: head received -> CG_BODY, body
 * received -> CG_BUSY, request finished -> CG_READING). */
void conn_guard_phase(conn_guard *g, struct MHD_Connection *c, cg_phase ph);
void conn_guard_get_stats(conn_guard *g, conn_guard_stats *out);

#endif

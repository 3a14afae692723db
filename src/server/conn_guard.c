/*
 * conn_guard.c - slow-client defence of `tqkv serve` (see conn_guard.h for the model).
 * Owns: the table of live connections (socket, phase, when the phase began) and the
 * watchdog thread that closes readers past their deadline.
 * Must not: close a socket or free a connection (libmicrohttpd does, after its CLOSED
 * notification); parse requests. A socket is only ever shut down (shutdown(2), which
 * makes its connection thread see end of stream and close it) under the guard's lock
 * while its entry exists, and the CLOSED notification removes the entry under the same
 * lock before libmicrohttpd closes the descriptor, so a reused descriptor is never hit.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "server/conn_guard.h"
#include "util/common.h"

/* ------------------------------------------------------------------------- */
/* Types                                                                     */
/* ------------------------------------------------------------------------- */

typedef struct cg_conn {
    struct cg_conn *prev, *next;
    MHD_socket      fd;
    cg_phase        phase;
    double          since;    /* monotonic seconds when the phase began */
    int             closing;  /* shut down by the guard; no longer counted */
} cg_conn;

struct conn_guard {
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    pthread_t       th;
    int             th_started, stop;
    cg_conn        *head;
    int             readers, busy;     /* entries not closing, by phase */
    int             max_conns, reader_cap;
    double          header_s, body_s;  /* 0 = no deadline */
    conn_guard_stats st;
};

/* ------------------------------------------------------------------------- */
/* Table (all with g->mu held)                                               */
/* ------------------------------------------------------------------------- */

static void count(conn_guard *g, const cg_conn *x, int d) {
    if (x->closing) return;
    if (x->phase == CG_BUSY) g->busy += d;
    else g->readers += d;
}

static void shut(conn_guard *g, cg_conn *x) {
    count(g, x, -1);
    x->closing = 1;
    if (x->fd != MHD_INVALID_SOCKET) shutdown(x->fd, SHUT_RDWR);
}

/* The reader that has been sending longest, or NULL. */
static cg_conn *oldest_reader(conn_guard *g) {
    cg_conn *best = NULL;
    for (cg_conn *x = g->head; x; x = x->next)
        if (!x->closing && x->phase != CG_BUSY && (!best || x->since < best->since)) best = x;
    return best;
}

static void expire(conn_guard *g, double t) {
    for (cg_conn *x = g->head; x; x = x->next) {
        if (x->closing || x->phase == CG_BUSY) continue;
        double lim = x->phase == CG_READING ? g->header_s : g->body_s;
        if (lim > 0 && t - x->since > lim) {
            shut(g, x);
            g->st.timed_out++;
        }
    }
}

/* ------------------------------------------------------------------------- */
/* Watchdog                                                                  */
/* ------------------------------------------------------------------------- */

static void *watchdog(void *arg) {
    conn_guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000 * 1000; /* 100 ms: deadlines are seconds */
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        if (!g->stop) expire(g, tqkv_now_s());
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* ------------------------------------------------------------------------- */
/* Public                                                                    */
/* ------------------------------------------------------------------------- */

int conn_guard_init(conn_guard **out, int max_conns, int reserved, int header_s, int body_s) {
    *out = NULL;
    if (max_conns < 1) max_conns = 1;
    if (reserved < 0) reserved = 0;
    if (reserved > max_conns - 1) reserved = max_conns - 1;
    conn_guard *g = calloc(1, sizeof *g);
    if (!g) return -1;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->max_conns = max_conns;
    g->reader_cap = max_conns - reserved;
    g->header_s = header_s > 0 ? header_s : 0;
    g->body_s = body_s > 0 ? body_s : 0;
    if (pthread_create(&g->th, NULL, watchdog, g)) {
        conn_guard_free(g);
        return -1;
    }
    g->th_started = 1;
    *out = g;
    return 0;
}

void conn_guard_free(conn_guard *g) {
    if (!g) return;
    if (g->th_started) {
        pthread_mutex_lock(&g->mu);
        g->stop = 1;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->th, NULL);
    }
    /* entries left (the daemon is stopped first, so none should be) */
    while (g->head) {
        cg_conn *x = g->head;
        g->head = x->next;
        free(x);
    }
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

unsigned conn_guard_hard_limit(const conn_guard *g) {
    int margin = g->max_conns / 4 > 16 ? g->max_conns / 4 : 16;
    return (unsigned)(g->max_conns + margin);
}

/* Accept thread: admit a new connection, evicting the longest-sending reader when the
 * readers are at their cap or every slot is taken; refuse only when all are busy. */
enum MHD_Result conn_guard_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen) {
    (void)addr;
    (void)addrlen;
    conn_guard *g = cls;
    pthread_mutex_lock(&g->mu);
    expire(g, tqkv_now_s());
    enum MHD_Result ok = MHD_YES;
    if (g->readers >= g->reader_cap || g->readers + g->busy >= g->max_conns) {
        cg_conn *victim = oldest_reader(g);
        if (victim) {
            shut(g, victim);
            g->st.evicted++;
        } else {
            g->st.refused++;
            ok = MHD_NO;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

void conn_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                       enum MHD_ConnectionNotificationCode code) {
    conn_guard *g = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        cg_conn *x = calloc(1, sizeof *x);
        *socket_context = x;
        if (!x) return; /* untracked: never evicted or timed out by the guard */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        x->fd = ci ? ci->connect_fd : MHD_INVALID_SOCKET;
        x->phase = CG_READING;
        x->since = tqkv_now_s();
        pthread_mutex_lock(&g->mu);
        x->next = g->head;
        if (g->head) g->head->prev = x;
        g->head = x;
        count(g, x, +1);
        pthread_mutex_unlock(&g->mu);
        return;
    }
    cg_conn *x = *socket_context;
    if (!x) return;
    pthread_mutex_lock(&g->mu);
    count(g, x, -1);
    if (x->prev) x->prev->next = x->next;
    else g->head = x->next;
    if (x->next) x->next->prev = x->prev;
    pthread_mutex_unlock(&g->mu);
    free(x);
    *socket_context = NULL;
}

void conn_guard_phase(conn_guard *g, struct MHD_Connection *c, cg_phase ph) {
    if (!g) return;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    cg_conn *x = ci ? ci->socket_context : NULL;
    if (!x) return;
    pthread_mutex_lock(&g->mu);
    if (x->phase != ph) {
        count(g, x, -1);
        x->phase = ph;
        x->since = tqkv_now_s();
        count(g, x, +1);
    }
    pthread_mutex_unlock(&g->mu);
}

void conn_guard_get_stats(conn_guard *g, conn_guard_stats *out) {
    memset(out, 0, sizeof *out);
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    *out = g->st;
    out->readers = g->readers;
    out->busy = g->busy;
    pthread_mutex_unlock(&g->mu);
}

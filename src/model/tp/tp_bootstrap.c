/*
 * tp_bootstrap.c - the TCP exchange of rank 0's communicator id (tp_bootstrap.h).
 * Must not: know NCCL; leave a socket open; wait past the caller's deadline.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "model/tp/tp_bootstrap.h"
#include "util/common.h"

static const char MAGIC[8] = {'T', 'Q', 'K', 'V', 'T', 'P', '0', '1'};

// ---------------------------------------------------------------------------
// io with a deadline
// ---------------------------------------------------------------------------

static int ms_left(double deadline) {
    const double left = (deadline - tqkv_now_s()) * 1e3;
    return left <= 0 ? 0 : left > 1e9 ? 1000000000 : (int)left;
}

/* Move exactly len bytes (send when out, else receive); 0 or -1 (deadline, error, EOF). */
static int xfer(int fd, void *buf, size_t len, int out, double deadline) {
    unsigned char *p = buf;
    while (len > 0) {
        struct pollfd pf = {fd, (short)(out ? POLLOUT : POLLIN), 0};
        const int w = ms_left(deadline);
        if (w <= 0 || poll(&pf, 1, w) <= 0) return -1;
        ssize_t k = out ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (k <= 0) {
            if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            return -1;
        }
        p += k;
        len -= (size_t)k;
    }
    return 0;
}

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

// ---------------------------------------------------------------------------
// rank 0
// ---------------------------------------------------------------------------

tqkv_status tp_bootstrap_listen(int port, int *fd, int *bound) {
    if (!fd || !bound || port < 0 || port > 65535)
        return tqkv_fail(TQKV_EINVAL, "tp bootstrap: bad port %d or NULL argument", port);
    int s = socket(AF_INET6, SOCK_STREAM, 0), v6 = 1;
    if (s < 0) v6 = 0, s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return tqkv_fail(TQKV_EIO, "tp bootstrap: socket: %s", strerror(errno));
    int one = 1, zero = 0;
    (void)setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_storage a;
    socklen_t al;
    memset(&a, 0, sizeof a);
    if (v6) { /* both families on one socket */
        (void)setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&a;
        a6->sin6_family = AF_INET6;
        a6->sin6_addr = in6addr_any;
        a6->sin6_port = htons((uint16_t)port);
        al = sizeof *a6;
    } else {
        struct sockaddr_in *a4 = (struct sockaddr_in *)&a;
        a4->sin_family = AF_INET;
        a4->sin_addr.s_addr = htonl(INADDR_ANY);
        a4->sin_port = htons((uint16_t)port);
        al = sizeof *a4;
    }
    if (bind(s, (struct sockaddr *)&a, al) || listen(s, TP_MAX_RANKS) ||
        getsockname(s, (struct sockaddr *)&a, &al)) {
        const int e = errno;
        close(s);
        return tqkv_fail(TQKV_EIO, "tp bootstrap: listen on port %d: %s", port, strerror(e));
    }
    *bound = ntohs(v6 ? ((struct sockaddr_in6 *)&a)->sin6_port : ((struct sockaddr_in *)&a)->sin_port);
    *fd = s;
    return TQKV_OK;
}

/* One peer on connection c: its request checked against n and the ranks seen. */
static tqkv_status serve_one(int c, int n, const unsigned char *id, int *seen, double deadline) {
    unsigned char req[16];
    if (xfer(c, req, sizeof req, 0, deadline))
        return tqkv_fail(TQKV_EIO, "tp bootstrap: a peer sent no request before the deadline");
    const uint32_t rank = get_u32(req + 8), ranks = get_u32(req + 12);
    if (memcmp(req, MAGIC, 8))
        return tqkv_fail(TQKV_ECORRUPT, "tp bootstrap: a peer is not a tqkv rank (bad magic)");
    if ((int)ranks != n || rank < 1 || (int)rank >= n || seen[rank])
        return tqkv_fail(TQKV_EINVAL, "tp bootstrap: a peer asked as rank %u of %u (expected "
                         "ranks 1..%d of %d, each once)", rank, ranks, n - 1, n);
    seen[rank] = 1;
    unsigned char ans[8 + TP_ID_BYTES];
    memcpy(ans, MAGIC, 8);
    memcpy(ans + 8, id, TP_ID_BYTES);
    if (xfer(c, ans, sizeof ans, 1, deadline))
        return tqkv_fail(TQKV_EIO, "tp bootstrap: sending the id to rank %u failed", rank);
    return TQKV_OK;
}

tqkv_status tp_bootstrap_serve(int fd, int n, const unsigned char id[TP_ID_BYTES], int timeout_ms) {
    tqkv_status rc = TQKV_OK;
    if (fd < 0 || !id || n < 1 || n > TP_MAX_RANKS || timeout_ms < 0)
        rc = tqkv_fail(TQKV_EINVAL, "tp bootstrap: serve %d ranks: bad argument", n);
    const double deadline = tqkv_now_s() + timeout_ms * 1e-3;
    int seen[TP_MAX_RANKS] = {0};
    int got = 1; /* rank 0 itself */
    while (got < n && rc == TQKV_OK) {
        struct pollfd pf = {fd, POLLIN, 0};
        const int w = ms_left(deadline);
        if (w <= 0 || poll(&pf, 1, w) <= 0) {
            rc = tqkv_fail(TQKV_EIO, "tp bootstrap: %d of %d ranks asked before the deadline "
                           "(%d ms)", got - 1, n - 1, timeout_ms);
            break;
        }
        int c = accept(fd, NULL, NULL);
        if (c < 0) continue; /* interrupted or gone: wait again */
        rc = serve_one(c, n, id, seen, deadline);
        close(c);
        got++;
    }
    if (fd >= 0) close(fd);
    return rc;
}

// ---------------------------------------------------------------------------
// rank r > 0
// ---------------------------------------------------------------------------

/* One connection to host:port, or -1 (nothing listens yet, or no such host). */
static int connect_once(const char *host, int port) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, ps, &hints, &res) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    return fd;
}

tqkv_status tp_bootstrap_fetch(const char *host, int port, int rank, int n,
                               unsigned char id[TP_ID_BYTES], int timeout_ms) {
    if (!host || !id || n < 2 || n > TP_MAX_RANKS || rank < 1 || rank >= n || port < 1 ||
        port > 65535 || timeout_ms < 0)
        return tqkv_fail(TQKV_EINVAL, "tp bootstrap: fetch as rank %d of %d from %s:%d: bad "
                         "argument", rank, n, host ? host : "(null)", port);
    const double deadline = tqkv_now_s() + timeout_ms * 1e-3;
    int fd;
    while ((fd = connect_once(host, port)) < 0) {
        if (ms_left(deadline) <= 0)
            return tqkv_fail(TQKV_EIO, "tp bootstrap: rank 0 at %s:%d did not answer within %d ms",
                             host, port, timeout_ms);
        struct timespec ts = {0, 20 * 1000000L}; /* rank 0 may not listen yet */
        nanosleep(&ts, NULL);
    }
    unsigned char req[16], ans[8 + TP_ID_BYTES];
    memcpy(req, MAGIC, 8);
    put_u32(req + 8, (uint32_t)rank);
    put_u32(req + 12, (uint32_t)n);
    const int bad = xfer(fd, req, sizeof req, 1, deadline) || xfer(fd, ans, sizeof ans, 0, deadline);
    close(fd);
    if (bad || memcmp(ans, MAGIC, 8))
        return tqkv_fail(TQKV_EIO, "tp bootstrap: rank 0 at %s:%d refused rank %d of %d or sent "
                         "no id", host, port, rank, n);
    memcpy(id, ans + 8, TP_ID_BYTES);
    return TQKV_OK;
}

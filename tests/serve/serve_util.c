/*
 * serve_util.c - HTTP test client, SSE parsing and `tqkv serve` process helpers.
 * Owns: test-side sockets and processes. Must not: be linked into tqkv.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "serve_util.h"

/* ------------------------------------------------------------------------- */
/* HTTP                                                                      */
/* ------------------------------------------------------------------------- */

static int dechunk(const char *in, size_t n, char **out, size_t *out_len) {
    char *o = malloc(n + 1);
    if (!o) return -1;
    size_t j = 0, i = 0;
    while (i < n) {
        char *end = NULL;
        unsigned long sz = strtoul(in + i, &end, 16);
        const char *crlf = strstr(in + i, "\r\n");
        if (!crlf || (size_t)(crlf - in) >= n) break;
        i = (size_t)(crlf - in) + 2;
        if (sz == 0) break;
        if (i + sz > n) sz = n - i;
        memcpy(o + j, in + i, sz);
        j += sz;
        i += sz + 2;
    }
    o[j] = 0;
    *out = o;
    *out_len = j;
    return 0;
}

int http_raw(int port, const char *bytes, size_t len, int half_close, http_resp *out) {
    memset(out, 0, sizeof *out);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    size_t sent = 0;
    while (sent < len) {
        ssize_t k = send(fd, bytes + sent, len - sent, MSG_NOSIGNAL);
        if (k <= 0) break;
        sent += (size_t)k;
    }
    if (half_close) shutdown(fd, SHUT_WR);
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t k = recv(fd, buf + n, cap - n - 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        n += (size_t)k;
    }
    close(fd);
    buf[n] = 0;
    char *hend = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) || !hend) {
        out->body = buf;
        out->body_len = n;
        return 0;
    }
    out->status = atoi(buf + 9);
    size_t hl = (size_t)(hend - buf);
    out->headers = strndup(buf, hl);
    const char *b = hend + 4;
    size_t bl = n - hl - 4;
    if (strcasestr(out->headers, "transfer-encoding: chunked")) {
        dechunk(b, bl, &out->body, &out->body_len);
    } else {
        out->body = strndup(b, bl);
        out->body_len = bl;
    }
    free(buf);
    return 0;
}

int http_do(int port, const char *method, const char *path, const char *auth, const char *body,
            http_resp *out) {
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + 512 + (auth ? strlen(auth) : 0);
    char *req = malloc(cap);
    int n = snprintf(req, cap, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s%s"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                     method, path, auth ? "Authorization: Bearer " : "", auth ? auth : "",
                     auth ? "\r\n" : "", bl);
    memcpy(req + n, body ? body : "", bl);
    int rc = http_raw(port, req, (size_t)n + bl, 0, out);
    free(req);
    return rc;
}

void http_resp_free(http_resp *r) {
    free(r->headers);
    free(r->body);
    memset(r, 0, sizeof *r);
}

/* ------------------------------------------------------------------------- */
/* Responses                                                                 */
/* ------------------------------------------------------------------------- */

static char *append(char *s, size_t *n, const char *t) {
    size_t k = strlen(t);
    s = realloc(s, *n + k + 1);
    memcpy(s + *n, t, k + 1);
    *n += k;
    return s;
}

char *sse_collect(const char *body, int chat, char *finish, size_t finish_cap, cJSON **usage,
                  int *n_chunks) {
    size_t n = 0;
    char *text = calloc(1, 1);
    int done = 0, chunks = 0, bad = 0;
    if (finish) finish[0] = 0;
    if (usage) *usage = NULL;
    const char *p = body;
    while (p && *p && !bad) {
        const char *eol = strstr(p, "\n\n");
        if (!eol) {
            bad = 1;
            break;
        }
        if (strncmp(p, "data: ", 6)) {
            bad = 1;
            break;
        }
        if (!strncmp(p + 6, "[DONE]", 6)) {
            done = 1;
            p = eol + 2;
            if (*p) bad = 1; /* nothing after [DONE] */
            break;
        }
        cJSON *j = cJSON_ParseWithLength(p + 6, (size_t)(eol - p - 6));
        if (!j || cJSON_GetObjectItem(j, "error")) {
            bad = 1;
            cJSON_Delete(j);
            break;
        }
        chunks++;
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        if (ch) {
            cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content")
                            : cJSON_GetObjectItem(ch, "text");
            if (cJSON_IsString(t)) text = append(text, &n, t->valuestring);
            cJSON *fr = cJSON_GetObjectItem(ch, "finish_reason");
            if (cJSON_IsString(fr) && finish) snprintf(finish, finish_cap, "%s", fr->valuestring);
        }
        cJSON *u = cJSON_GetObjectItem(j, "usage");
        if (u && usage && !cJSON_IsNull(u)) {
            cJSON_Delete(*usage);
            *usage = cJSON_Duplicate(u, 1);
        }
        cJSON_Delete(j);
        p = eol + 2;
    }
    if (n_chunks) *n_chunks = chunks;
    if (bad || !done) {
        free(text);
        if (usage) {
            cJSON_Delete(*usage);
            *usage = NULL;
        }
        return NULL;
    }
    return text;
}

char *resp_text(const char *body, int chat, char *finish, size_t finish_cap) {
    cJSON *j = cJSON_Parse(body);
    cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *t = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "message"), "content")
                    : cJSON_GetObjectItem(ch, "text");
    char *r = cJSON_IsString(t) ? strdup(t->valuestring) : NULL;
    cJSON *fr = cJSON_GetObjectItem(ch, "finish_reason");
    if (finish) snprintf(finish, finish_cap, "%s", cJSON_IsString(fr) ? fr->valuestring : "");
    cJSON_Delete(j);
    return r;
}

/* ------------------------------------------------------------------------- */
/* Processes                                                                 */
/* ------------------------------------------------------------------------- */

/* Servers spawned and not yet reaped (test-process bookkeeping, one test thread). */
static pid_t g_children[64];

static void child_add(pid_t pid) {
    for (int i = 0; i < 64; i++)
        if (!g_children[i]) {
            g_children[i] = pid;
            return;
        }
}

static void child_remove(pid_t pid) {
    for (int i = 0; i < 64; i++)
        if (g_children[i] == pid) g_children[i] = 0;
}

void serve_kill_all(void) {
    for (int i = 0; i < 64; i++)
        if (g_children[i]) {
            kill(g_children[i], SIGKILL);
            waitpid(g_children[i], NULL, 0);
            g_children[i] = 0;
        }
}

pid_t serve_spawn(const char *const *extra, int *port) {
    char pf[64];
    snprintf(pf, sizeof pf, "/tmp/tqkv-serve-port-%d-%ld", (int)getpid(), (long)random());
    unlink(pf);
    const char *argv[64];
    int n = 0;
    argv[n++] = TQKV_CLI_PATH;
    argv[n++] = "serve";
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "--port-file";
    argv[n++] = pf;
    for (int i = 0; extra && extra[i] && n < 62; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    for (int t = 0; t < 1200; t++) { /* up to 120 s: model load on a loaded machine */
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return -1;
        FILE *f = fopen(pf, "r");
        if (f) {
            int p = 0;
            int ok = fscanf(f, "%d", &p) == 1;
            fclose(f);
            if (ok && p > 0) {
                unlink(pf);
                *port = p;
                child_add(pid);
                return pid;
            }
        }
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

int serve_stop(pid_t pid) {
    if (pid <= 0) return -1;
    kill(pid, SIGTERM);
    int st = 0;
    pid_t w = waitpid(pid, &st, 0);
    child_remove(pid);
    if (w != pid) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

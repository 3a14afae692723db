/*
 * serve_util.h - helpers of the HTTP tests: a minimal HTTP/1.1 client on loopback
 * sockets (raw, so tests can also send malformed and truncated requests), SSE parsing,
 * and starting `tqkv serve` as a child process.
 */
#ifndef TQKV_SERVE_UTIL_H
#define TQKV_SERVE_UTIL_H

#include <stddef.h>
#include <sys/types.h>

#include <cjson/cJSON.h>

typedef struct {
    int    status;   /* HTTP status, 0 if the connection failed or no status line */
    char  *headers;  /* raw header block (malloc'd) */
    char  *body;     /* de-chunked body, NUL-terminated (malloc'd) */
    size_t body_len;
} http_resp;

/* Send raw bytes [len] to 127.0.0.1:port (half_close: then shut the write side, for
 * truncated requests; the server takes a half-close as a client gone), read until the
 * server closes. 0 or -1. */
int  http_raw(int port, const char *bytes, size_t len, int half_close, http_resp *out);
/* A request with Connection: close; auth may be NULL. */
int  http_do(int port, const char *method, const char *path, const char *auth, const char *body,
             http_resp *out);
void http_resp_free(http_resp *r);

/* Concatenated content of an SSE body (chat delta.content or completion text), and
 * finish_reason / usage of the stream. Returns a malloc'd string or NULL if the stream
 * is malformed (no [DONE], bad JSON). *n_chunks counts data chunks before [DONE]. */
char *sse_collect(const char *body, int chat, char *finish, size_t finish_cap,
                  cJSON **usage /* may be NULL; caller frees */, int *n_chunks);
/* Text of a non-streamed response (chat message.content or choices[0].text), malloc'd. */
char *resp_text(const char *body, int chat, char *finish, size_t finish_cap);

/* Start `tqkv serve` with argv extras (NULL-terminated) on a free port; waits until
 * /health answers. Returns the pid (> 0) and *port, or -1. */
pid_t serve_spawn(const char *const *extra, int *port);
/* SIGTERM and wait; returns the exit status (or -1). */
int   serve_stop(pid_t pid);
/* SIGKILL every spawned server not yet stopped (a test teardown: a failed assertion
 * must not leave a server running). */
void  serve_kill_all(void);

#endif

/*
 * file.c - opening and reading input files that must be regular files.
 * Owns: the non-blocking open + fstat check (a FIFO in place of a shard or a JSON file
 * must not hang the loader). Must not: parse contents; keep state.
 */
#include "util/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/common.h"

// ---------------------------------------------------------------------------
// open
// ---------------------------------------------------------------------------

tqkv_status tqkv_file_open_regular(const char *path, int *fd, size_t *size, int *missing) {
    if (missing) *missing = 0;
    if (!path || !fd || !size) return tqkv_fail(TQKV_EINVAL, "file: NULL argument");
    /* O_NONBLOCK: opening a FIFO without a writer returns at once instead of blocking */
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (f < 0) {
        if (missing && errno == ENOENT) *missing = 1;
        return tqkv_fail(TQKV_EIO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(f, &st) != 0) {
        tqkv_status s = tqkv_fail(TQKV_EIO, "%s: cannot stat: %s", path, strerror(errno));
        close(f);
        return s;
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return tqkv_fail(TQKV_EIO, "%s: not a regular file", path);
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        tqkv_status s = tqkv_fail(TQKV_EIO, "%s: fcntl failed: %s", path, strerror(errno));
        close(f);
        return s;
    }
    *fd = f;
    *size = (size_t)st.st_size;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// read
// ---------------------------------------------------------------------------

tqkv_status tqkv_file_read_all(const char *path, size_t max, char **out, size_t *len,
                               int *missing) {
    if (!out || !len) return tqkv_fail(TQKV_EINVAL, "file: NULL argument");
    int fd;
    size_t size;
    tqkv_status rc = tqkv_file_open_regular(path, &fd, &size, missing);
    if (rc != TQKV_OK) return rc;
    if (size > max) {
        close(fd);
        return tqkv_fail(TQKV_ECORRUPT, "%s: %zu bytes, more than the %zu this file may have", path,
                         size, max);
    }
    char *buf = malloc(size + 1); // [size + 1]: contents + NUL
    if (!buf) {
        close(fd);
        return tqkv_fail(TQKV_ENOMEM, "%s: out of memory (%zu bytes)", path, size);
    }
    size_t n = 0;
    while (n < size) {
        ssize_t got = read(fd, buf + n, size - n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        n += (size_t)got;
    }
    close(fd);
    if (n != size) {
        free(buf);
        return tqkv_fail(TQKV_EIO, "%s: short read (%zu of %zu bytes)", path, n, size);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return TQKV_OK;
}

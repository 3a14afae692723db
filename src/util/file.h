/*
 * file.h - opening and reading input files (checkpoint shards, config.json,
 * tokenizer.json) without ever blocking on something that is not a regular file.
 * Owns: the open-nonblocking-then-fstat rule. Must not: parse or interpret contents.
 */
#ifndef TQKV_FILE_H
#define TQKV_FILE_H

#include <stddef.h>

#include "tqkv.h"

/* Open `path` read-only. The open is non-blocking, so a FIFO, socket or device node in
 * place of a file fails at once (TQKV_EIO "not a regular file") instead of blocking for
 * a writer; the descriptor returned is blocking again. *fd: close() it; *size: bytes.
 * A missing file is TQKV_EIO with errno ENOENT kept in *missing (may be NULL). */
tqkv_status tqkv_file_open_regular(const char *path, int *fd, size_t *size, int *missing);

/* Read a whole regular file of at most `max` bytes: *out malloc'd, NUL-terminated,
 * *len bytes without the NUL. Same refusals as tqkv_file_open_regular; larger files are
 * TQKV_ECORRUPT. */
tqkv_status tqkv_file_read_all(const char *path, size_t max, char **out, size_t *len,
                               int *missing);

#endif

/*
 * prefix_file.h - files of the prompt-cache directory (prefix_file.c; src/engine only):
 * the content key of a model directory, one entry's writer and its defensive reader.
 */
#ifndef TQKV_ENGINE_PREFIX_FILE_H
#define TQKV_ENGINE_PREFIX_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

/* 64-bit non-cryptographic hash, streaming (4 lanes over 32-byte blocks). */
typedef struct {
    uint64_t v[4];
    uint64_t total;
    uint8_t  buf[32];
    size_t   nbuf;
} pcf_hash_state;

void     pcf_hash_init(pcf_hash_state *s, uint64_t seed);
void     pcf_hash_update(pcf_hash_state *s, const void *data, size_t n);
uint64_t pcf_hash_final(const pcf_hash_state *s);
uint64_t pcf_hash(uint64_t seed, const void *data, size_t n);

/* Content key of a model directory: name, size and every byte of each regular file the
 * loaders read (*.json, *.safetensors, *.jinja, *.model, *.txt; sorted by name).
 * *bytes_hashed (may be NULL) gets the bytes read. */
tqkv_status pcf_model_key(const char *model_dir, uint64_t *out, size_t *bytes_hashed);

/* Write one entry to path (through path.tmp and a rename). */
tqkv_status pcf_write(const char *path, uint64_t key, const char *desc, const int32_t *tokens,
                      int n, const uint8_t *state, size_t state_len);

typedef struct {
    uint8_t *body;       /* owns tokens and state */
    int32_t *tokens;     /* [n] */
    int      n;
    uint8_t *state;      /* [state_len] tqkv_model_state_export bytes */
    size_t   state_len;
} pcf_entry;

/* Read entry `name` relative to directory fd dfd (AT_FDCWD: a path); `shown` names it in
 * messages. Refuses (TQKV_ECORRUPT; TQKV_EINVAL for another key) anything but a regular
 * file (symlinks, FIFOs, devices), a file over cap bytes, a size that does not match its
 * header, another key, a checksum mismatch; reads only the header of a refused file
 * whose header already tells. */
tqkv_status pcf_read(int dfd, const char *name, const char *shown, uint64_t key,
                     const char *our_desc, size_t cap, pcf_entry *out);
void        pcf_entry_free(pcf_entry *x);

#endif

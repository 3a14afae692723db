/*
 * safetensors.h - read-only, mmapped safetensors archives (one file, or shards listed in
 * model.safetensors.index.json).
 * Owns: header parsing and validation (lengths, offsets, shapes, dtypes), the mappings.
 * Must not: convert or copy tensor data, know about model architectures.
 *
 * File layout: u64 LE header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]}, "__metadata__": {...}}
 * then the data area; a tensor's bytes are data[b, e) with e - b = prod(shape) * elsize.
 */
#ifndef TQKV_SAFETENSORS_H
#define TQKV_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv.h"

typedef enum { ST_F32 = 0, ST_F16, ST_BF16, ST_OTHER } st_dtype;

#define ST_MAX_DIMS 8

typedef struct {
    char          *name;
    st_dtype       dtype;
    char           dtype_name[16];   /* as written in the header */
    int            ndim;
    int64_t        shape[ST_MAX_DIMS];
    const uint8_t *data;             /* into the mapping */
    size_t         nbytes;
    int            file;             /* index into st_archive.files */
} st_tensor;

typedef struct {
    char   *path;
    void   *map;
    size_t  size;
} st_file;

typedef struct {
    st_file   *files;    /* [n_files] */
    int        n_files;
    st_tensor *tensors;  /* [n_tensors], sorted by name */
    int        n_tensors;
} st_archive;

/* Bytes per element; 0 for ST_OTHER. */
size_t st_dtype_size(st_dtype d);

/* Open dir/model.safetensors.index.json (sharded) or else dir/model.safetensors.
 * On failure *a is zeroed and the message names the file (and tensor) at fault. */
tqkv_status st_open_dir(st_archive *a, const char *dir);
/* Open one .safetensors file. */
tqkv_status st_open_file(st_archive *a, const char *path);
void        st_close(st_archive *a);
const st_tensor *st_find(const st_archive *a, const char *name);
const char *st_file_of(const st_archive *a, const st_tensor *t);

#endif

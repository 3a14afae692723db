/*
 * safetensors.c - mmapped safetensors reader with full header validation.
 * Owns: mappings of the archive's files and the tensor table.
 * Must not: touch tensor bytes (no copies, no conversion) or crash on any input file.
 */
#include "model/load/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "util/common.h"
#include "util/file.h"

// ---------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------

size_t st_dtype_size(st_dtype d) {
    switch (d) {
    case ST_F32: return 4;
    case ST_F16: return 2;
    case ST_BF16: return 2;
    default: return 0;
    }
}

static st_dtype dtype_parse(const char *s) {
    if (!strcmp(s, "F32")) return ST_F32;
    if (!strcmp(s, "F16")) return ST_F16;
    if (!strcmp(s, "BF16")) return ST_BF16;
    return ST_OTHER;
}

/* Element size of dtypes we do not compute with but must still validate. */
static size_t dtype_other_size(const char *s) {
    static const struct { const char *n; size_t b; } T[] = {
        {"F64", 8}, {"I64", 8}, {"U64", 8}, {"I32", 4}, {"U32", 4}, {"I16", 2},
        {"U16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (!strcmp(s, T[i].n)) return T[i].b;
    return 0;
}

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

/* Read a whole small file (JSON) into a NUL-terminated buffer. */
static tqkv_status read_text(const char *path, char **out, size_t *len) {
    return tqkv_file_read_all(path, (size_t)1 << 30, out, len, NULL);
}

/* By data start, then end (zero-sized tensors first). */
static int cmp_tensor_data(const void *a, const void *b) {
    const st_tensor *x = a, *y = b;
    if (x->data != y->data) return x->data < y->data ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* The safetensors rule: the tensors' byte ranges tile the data area exactly, with no
 * overlap, hole or trailing byte (t [n], sorted here by data start). A file with no
 * tensors (t may be NULL) must have an empty data area. */
static tqkv_status check_tiling(const char *path, st_tensor *t, int n, const uint8_t *data,
                                size_t data_size) {
    if (n > 0) qsort(t, (size_t)n, sizeof *t, cmp_tensor_data);
    size_t at = 0; /* end of the ranges so far */
    for (int i = 0; i < n; i++) {
        size_t o0 = (size_t)(t[i].data - data), o1 = o0 + t[i].nbytes;
        if (o0 < at)
            return tqkv_fail(TQKV_ECORRUPT,
                             "%s: tensor '%s' data_offsets [%zu, %zu] overlap tensor '%s' "
                             "(ends at %zu)",
                             path, t[i].name, o0, o1, t[i - 1].name, at);
        if (o0 > at)
            return tqkv_fail(TQKV_ECORRUPT, "%s: %zu unused bytes before tensor '%s' (at %zu)",
                             path, o0 - at, t[i].name, at);
        at = o1;
    }
    if (at != data_size)
        return tqkv_fail(TQKV_ECORRUPT, "%s: %zu trailing bytes after the last tensor's data",
                         path, data_size - at);
    return TQKV_OK;
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static void free_tensors(st_tensor *t, int n) {
    for (int i = 0; i < n; i++) free(t[i].name);
    free(t);
}

// ---------------------------------------------------------------------------
// one file
// ---------------------------------------------------------------------------

/* Map one file and append its tensors to (*tensors, *n). On failure nothing is appended
 * and the file is unmapped. */
static tqkv_status open_one(const char *path, int file_index, st_file *fout, st_tensor **tensors,
                            int *n_tensors, int *cap_tensors) {
    memset(fout, 0, sizeof *fout);
    int fd;
    size_t size;
    tqkv_status orc = tqkv_file_open_regular(path, &fd, &size, NULL);
    if (orc != TQKV_OK) return orc;
    if (size < 8) {
        close(fd);
        return tqkv_fail(TQKV_ECORRUPT, "%s: truncated safetensors file (%zu bytes, no header length)",
                         path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return tqkv_fail(TQKV_EIO, "%s: mmap failed: %s", path, strerror(errno));
    const uint8_t *base = map;
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)base[i] << (8 * i);
    tqkv_status rc = TQKV_OK;
    cJSON *root = NULL;
    int n0 = *n_tensors;
    if (hlen > size - 8) {
        rc = tqkv_fail(TQKV_ECORRUPT,
                       "%s: truncated safetensors file: header length %llu beyond file size %zu",
                       path, (unsigned long long)hlen, size);
        goto fail;
    }
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts((const char *)base + 8, (size_t)hlen, &end, 0);
    if (!root || !cJSON_IsObject(root)) {
        long at = end ? (long)(end - ((const char *)base + 8)) : -1;
        rc = tqkv_fail(TQKV_ECORRUPT, "%s: safetensors header is not a valid JSON object (near byte %ld)",
                       path, at);
        goto fail;
    }
    size_t data_size = size - 8 - (size_t)hlen;
    const uint8_t *data = base + 8 + hlen;
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (!it->string) continue;
        if (!strcmp(it->string, "__metadata__")) continue;
        const char *name = it->string;
        const cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *off = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        if (!cJSON_IsObject(it) || !cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off) ||
            cJSON_GetArraySize(off) != 2) {
            rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': header entry needs dtype, shape, data_offsets",
                           path, name);
            goto fail;
        }
        st_tensor t;
        memset(&t, 0, sizeof t);
        t.file = file_index;
        snprintf(t.dtype_name, sizeof t.dtype_name, "%s", dt->valuestring);
        t.dtype = dtype_parse(dt->valuestring);
        size_t el = t.dtype != ST_OTHER ? st_dtype_size(t.dtype) : dtype_other_size(dt->valuestring);
        if (!el) {
            rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': unknown dtype '%s'", path, name,
                           dt->valuestring);
            goto fail;
        }
        int nd = cJSON_GetArraySize(sh);
        if (nd > ST_MAX_DIMS) {
            rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': %d dims (max %d)", path, name, nd,
                           ST_MAX_DIMS);
            goto fail;
        }
        t.ndim = nd;
        int ok = 1;
        size_t count = 1;
        for (int d = 0; d < nd; d++) {
            const cJSON *v = cJSON_GetArrayItem(sh, d);
            if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9.0e15 ||
                v->valuedouble != (double)(int64_t)v->valuedouble) {
                rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': bad shape entry", path, name);
                goto fail;
            }
            t.shape[d] = (int64_t)v->valuedouble;
            count = tqkv_mul(count, (size_t)t.shape[d], &ok);
        }
        size_t nbytes = tqkv_mul(count, el, &ok);
        const cJSON *j0 = cJSON_GetArrayItem(off, 0), *j1 = cJSON_GetArrayItem(off, 1);
        const double b0 = cJSON_IsNumber(j0) ? j0->valuedouble : -1;
        const double b1 = cJSON_IsNumber(j1) ? j1->valuedouble : -1;
        if (!(b0 >= 0 && b1 >= b0 && b1 <= 9.0e15) || b0 != floor(b0) || b1 != floor(b1)) {
            rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': bad data_offsets", path, name);
            goto fail;
        }
        size_t o0 = (size_t)b0, o1 = (size_t)b1;
        if (o1 > data_size) {
            rc = tqkv_fail(TQKV_ECORRUPT,
                           "%s: truncated safetensors file: tensor '%s' data_offsets [%zu, %zu] beyond "
                           "the data area (%zu bytes)",
                           path, name, o0, o1, data_size);
            goto fail;
        }
        if (!ok) {
            char dims[ST_MAX_DIMS * 21 + 1] = "";
            for (int d = 0, k = 0; d < nd; d++)
                k += snprintf(dims + k, sizeof dims - (size_t)k, "%s%lld", d ? ", " : "",
                              (long long)t.shape[d]);
            rc = tqkv_fail(TQKV_ECORRUPT,
                           "%s: tensor '%s': shape [%s] is too large (%s bytes overflow)", path,
                           name, dims, dt->valuestring);
            goto fail;
        }
        if (nbytes != o1 - o0) {
            rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s': %zu bytes in data_offsets, shape needs %zu",
                           path, name, o1 - o0, nbytes);
            goto fail;
        }
        t.data = data + o0;
        t.nbytes = nbytes;
        if (*n_tensors == *cap_tensors) {
            int nc = *cap_tensors ? *cap_tensors * 2 : 256;
            st_tensor *nt = realloc(*tensors, (size_t)nc * sizeof *nt);
            if (!nt) {
                rc = tqkv_fail(TQKV_ENOMEM, "out of memory reading %s", path);
                goto fail;
            }
            *tensors = nt;
            *cap_tensors = nc;
        }
        t.name = strdup(name);
        if (!t.name) {
            rc = tqkv_fail(TQKV_ENOMEM, "out of memory reading %s", path);
            goto fail;
        }
        (*tensors)[(*n_tensors)++] = t;
    }
    /* *tensors is NULL while no file has had a tensor: no offset arithmetic on it then */
    rc = check_tiling(path, *n_tensors > n0 ? *tensors + n0 : NULL, *n_tensors - n0, data,
                      data_size);
    if (rc != TQKV_OK) goto fail;
    cJSON_Delete(root);
    fout->path = strdup(path);
    if (!fout->path) {
        rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
        goto fail;
    }
    fout->map = map;
    fout->size = size;
    return TQKV_OK;
fail:
    for (int i = n0; i < *n_tensors; i++) free((*tensors)[i].name);
    *n_tensors = n0;
    cJSON_Delete(root);
    munmap(map, size);
    return rc;
}

// ---------------------------------------------------------------------------
// archive
// ---------------------------------------------------------------------------

void st_close(st_archive *a) {
    if (!a) return;
    for (int i = 0; i < a->n_files; i++) {
        if (a->files[i].map) munmap(a->files[i].map, a->files[i].size);
        free(a->files[i].path);
    }
    free(a->files);
    free_tensors(a->tensors, a->n_tensors);
    memset(a, 0, sizeof *a);
}

/* Sort and reject duplicate names. */
static tqkv_status finish(st_archive *a) {
    if (a->n_tensors > 0) qsort(a->tensors, (size_t)a->n_tensors, sizeof *a->tensors, cmp_tensor);
    for (int i = 1; i < a->n_tensors; i++)
        if (!strcmp(a->tensors[i].name, a->tensors[i - 1].name))
            return tqkv_fail(TQKV_ECORRUPT, "tensor '%s' appears twice (%s, %s)", a->tensors[i].name,
                             a->files[a->tensors[i - 1].file].path, a->files[a->tensors[i].file].path);
    return TQKV_OK;
}

tqkv_status st_open_file(st_archive *a, const char *path) {
    memset(a, 0, sizeof *a);
    a->files = calloc(1, sizeof *a->files);
    if (!a->files) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    int cap = 0;
    tqkv_status rc = open_one(path, 0, &a->files[0], &a->tensors, &a->n_tensors, &cap);
    if (rc != TQKV_OK) {
        free(a->files);
        free_tensors(a->tensors, a->n_tensors);
        memset(a, 0, sizeof *a);
        return rc;
    }
    a->n_files = 1;
    rc = finish(a);
    if (rc != TQKV_OK) st_close(a);
    return rc;
}

tqkv_status st_open_dir(st_archive *a, const char *dir) {
    memset(a, 0, sizeof *a);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (stat(path, &st) != 0)
            return tqkv_fail(TQKV_EIO, "%s: no model.safetensors or model.safetensors.index.json", dir);
        return st_open_file(a, path);
    }
    char *text = NULL;
    size_t len = 0;
    tqkv_status rc = read_text(path, &text, &len);
    if (rc != TQKV_OK) return rc;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        long at = end ? (long)(end - text) : -1;
        free(text);
        return tqkv_fail(TQKV_ECORRUPT, "%s: JSON syntax error near byte %ld", path, at);
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        free(text);
        return tqkv_fail(TQKV_ECORRUPT, "%s: no \"weight_map\" object", path);
    }
    /* distinct shard names, in first-seen order */
    int n_wm = cJSON_GetArraySize(wm);
    const char **shards = calloc((size_t)(n_wm > 0 ? n_wm : 1), sizeof *shards);
    int n_shards = 0;
    const cJSON *it;
    if (!shards) rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (rc == TQKV_OK) {
        cJSON_ArrayForEach(it, wm) {
            if (!cJSON_IsString(it) || !it->valuestring[0] || strstr(it->valuestring, "..") ||
                strchr(it->valuestring, '/')) {
                rc = tqkv_fail(TQKV_ECORRUPT, "%s: weight_map entry '%s' is not a shard file name",
                               path, it->string ? it->string : "?");
                break;
            }
            int seen = 0;
            for (int i = 0; i < n_shards && !seen; i++) seen = !strcmp(shards[i], it->valuestring);
            if (!seen) shards[n_shards++] = it->valuestring;
        }
    }
    if (rc == TQKV_OK) {
        a->files = calloc((size_t)(n_shards ? n_shards : 1), sizeof *a->files);
        if (!a->files) rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    int cap = 0;
    for (int i = 0; rc == TQKV_OK && i < n_shards; i++) {
        char sp[4096];
        snprintf(sp, sizeof sp, "%s/%s", dir, shards[i]);
        rc = open_one(sp, i, &a->files[i], &a->tensors, &a->n_tensors, &cap);
        if (rc == TQKV_OK) a->n_files++;
    }
    if (rc == TQKV_OK) rc = finish(a);
    /* every mapped name must be in its shard */
    if (rc == TQKV_OK) {
        cJSON_ArrayForEach(it, wm) {
            const st_tensor *t = st_find(a, it->string);
            if (!t || strcmp(strrchr(a->files[t->file].path, '/') + 1, it->valuestring)) {
                rc = tqkv_fail(TQKV_ECORRUPT, "%s: tensor '%s' is mapped to %s but that shard lacks it",
                               path, it->string, it->valuestring);
                break;
            }
        }
    }
    free(shards);
    cJSON_Delete(root);
    free(text);
    if (rc != TQKV_OK) st_close(a);
    return rc;
}

const st_tensor *st_find(const st_archive *a, const char *name) {
    int lo = 0, hi = a->n_tensors - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(a->tensors[mid].name, name);
        if (!c) return &a->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char *st_file_of(const st_archive *a, const st_tensor *t) {
    return a->files[t->file].path;
}

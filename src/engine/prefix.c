/*
 * prefix.c - the engine's prefix cache: 1-row model states of compressed KV rows keyed
 * by the token prefix they hold, LRU eviction inside a byte budget, optionally persisted
 * one file per entry in a directory.
 * Owns: prefix_cache entries and their files.
 * Must not: run the model, decide where prefixes are cut (the scheduler stores entries
 * only at its prefill chunk boundaries, so a hit continues with the same chunks a miss
 * would have run, and its output is bitwise identical).
 *
 * Files: DIR/<hash>-<n>.tqkvp, one per entry; their format, content key and checks are
 * prefix_file.c's.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine_impl.h"
#include "engine/prefix_file.h"
#include "util/common.h"

static uint64_t hash_tokens(const int32_t *t, int n) {
    uint64_t h = 1469598103934665603ull;
    const uint8_t *b = (const uint8_t *)t;
    for (size_t i = 0; i < (size_t)n * sizeof(int32_t); i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

tqkv_status prefix_init(prefix_cache *pc, size_t budget, const char *dir, uint64_t fingerprint,
                        const char *desc) {
    memset(pc, 0, sizeof *pc);
    pc->budget = budget;
    pc->fingerprint = fingerprint;
    snprintf(pc->desc, sizeof pc->desc, "%s", desc ? desc : "");
    if (dir && budget) {
        if (mkdir(dir, 0755) != 0 && errno != EEXIST)
            return tqkv_fail(TQKV_EIO, "prompt cache: cannot create directory %s: %s", dir,
                             strerror(errno));
        size_t n = strlen(dir);
        pc->dir = malloc(n + 1);
        if (!pc->dir) return tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
        memcpy(pc->dir, dir, n + 1);
    }
    return TQKV_OK;
}

static void entry_clear(prefix_entry *x) {
    free(x->tokens);
    tqkv_model_state_free(x->st);
    memset(x, 0, sizeof *x);
}

void prefix_free(prefix_cache *pc) {
    for (int i = 0; i < pc->n; i++) entry_clear(&pc->e[i]);
    free(pc->e);
    free(pc->dir);
    memset(pc, 0, sizeof *pc);
}

prefix_entry *prefix_lookup(prefix_cache *pc, const int32_t *tokens, int n, int max_len) {
    prefix_entry *best = NULL;
    for (int i = 0; i < pc->n; i++) {
        prefix_entry *x = &pc->e[i];
        if (x->n > max_len || x->n > n || (best && x->n <= best->n)) continue;
        if (!memcmp(x->tokens, tokens, sizeof(int32_t) * (size_t)x->n)) best = x;
    }
    if (best) best->used = ++pc->clock;
    return best;
}

static void entry_path(const prefix_cache *pc, uint64_t hash, int n, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%016llx-%d.tqkvp", pc->dir, (unsigned long long)hash, n);
}

static void evict_one(prefix_cache *pc) {
    int lru = 0;
    for (int i = 1; i < pc->n; i++)
        if (pc->e[i].used < pc->e[lru].used) lru = i;
    pc->bytes -= pc->e[lru].bytes;
    if (pc->dir) {
        char path[4096];
        entry_path(pc, pc->e[lru].hash, pc->e[lru].n, path, sizeof path);
        unlink(path);
    }
    entry_clear(&pc->e[lru]);
    pc->e[lru] = pc->e[--pc->n];
}

/* Add an entry that owns tokens and st. */
static tqkv_status add_entry(prefix_cache *pc, int32_t *tokens, int n, tqkv_model_state *st) {
    size_t bytes = tqkv_model_state_kv_bytes_used(st) + sizeof(int32_t) * (size_t)n;
    if (bytes > pc->budget) {
        free(tokens);
        tqkv_model_state_free(st);
        return TQKV_OK; /* does not fit at all: not cached */
    }
    while (pc->n > 0 && pc->bytes + bytes > pc->budget) evict_one(pc);
    if (pc->n == pc->cap) {
        int nc = pc->cap ? pc->cap * 2 : 16;
        prefix_entry *ne = realloc(pc->e, sizeof *ne * (size_t)nc);
        if (!ne) {
            free(tokens);
            tqkv_model_state_free(st);
            return tqkv_fail(TQKV_ENOMEM, "prefix cache: out of memory");
        }
        pc->e = ne;
        pc->cap = nc;
    }
    prefix_entry *x = &pc->e[pc->n++];
    x->tokens = tokens;
    x->n = n;
    x->st = st;
    x->bytes = bytes;
    x->used = ++pc->clock;
    x->hash = hash_tokens(tokens, n);
    pc->bytes += bytes;
    return TQKV_OK;
}

static tqkv_status save_entry(const prefix_cache *pc, const prefix_entry *x) {
    uint8_t *blob = NULL;
    size_t bl = 0;
    tqkv_status rc = tqkv_model_state_export(x->st, &blob, &bl);
    if (rc != TQKV_OK) return rc;
    char path[4096];
    entry_path(pc, x->hash, x->n, path, sizeof path);
    rc = pcf_write(path, pc->fingerprint, pc->desc, x->tokens, x->n, blob, bl);
    free(blob);
    return rc;
}

tqkv_status prefix_insert(prefix_cache *pc, const int32_t *tokens, int n,
                          const tqkv_model_state *st) {
    if (!pc->budget || n < 1) return TQKV_OK;
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    if (!t) return tqkv_fail(TQKV_ENOMEM, "prefix cache: out of memory");
    memcpy(t, tokens, sizeof(int32_t) * (size_t)n);
    tqkv_model_state *copy = NULL;
    tqkv_status rc = tqkv_model_state_extract_row(st, 0, &copy);
    if (rc != TQKV_OK) {
        free(t);
        return rc;
    }
    int before = pc->n;
    rc = add_entry(pc, t, n, copy);
    if (rc == TQKV_OK && pc->dir && pc->n > 0 && pc->n >= before &&
        pc->e[pc->n - 1].tokens == t)
        rc = save_entry(pc, &pc->e[pc->n - 1]);
    return rc;
}

tqkv_status prefix_key_model(prefix_cache *pc, const char *model_dir, int verbose) {
    if (pc->model_keyed) return TQKV_OK;
    uint64_t key = 0;
    size_t bytes = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    tqkv_status rc = pcf_model_key(model_dir, &key, &bytes);
    if (rc != TQKV_OK) return rc;
    pc->fingerprint = pcf_hash(pc->fingerprint, &key, sizeof key);
    pc->model_keyed = 1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (verbose)
        fprintf(stderr, "tqkv engine: prompt cache: model content key %016llx (%zu bytes hashed "
                "in %.3f s)\n", (unsigned long long)key, bytes,
                (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return TQKV_OK;
}

/* The largest entry file read: an entry must fit the budget (its state export carries a
 * little more than the KV bytes; a hybrid model's recurrent rows more), so anything far
 * larger is junk and is refused from its size alone. */
static size_t file_cap(const prefix_cache *pc) { return 2 * pc->budget + ((size_t)64 << 20); }

/* Read, check and import one entry file (dfd/name; shown in messages). */
static tqkv_status load_entry(prefix_cache *pc, const tqkv_model *m,
                              const tqkv_model_state_params *sp, int dfd, const char *name,
                              const char *shown) {
    if (!pc->model_keyed)
        return tqkv_fail(TQKV_ESTATE, "prompt cache: the model's content key is not computed");
    pcf_entry x;
    tqkv_status rc = pcf_read(dfd, name, shown, pc->fingerprint, pc->desc, file_cap(pc), &x);
    if (rc != TQKV_OK) return rc;
    tqkv_model_state *st = NULL;
    tqkv_model_state_params p = *sp;
    p.rows = 1;
    rc = tqkv_model_state_import(&st, m, &p, x.state, x.state_len);
    if (rc != TQKV_OK) {
        pcf_entry_free(&x);
        return rc;
    }
    int off = 0;
    tqkv_model_state_offsets(st, &off);
    if (tqkv_model_state_rows(st) != 1 || off != x.n) {
        tqkv_model_state_free(st);
        pcf_entry_free(&x);
        return tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s holds %d tokens, header %d", shown, off, x.n);
    }
    for (int i = 0; i < pc->n; i++)
        if (pc->e[i].n == x.n && !memcmp(pc->e[i].tokens, x.tokens, 4ull * (size_t)x.n)) {
            tqkv_model_state_free(st); /* already cached */
            pcf_entry_free(&x);
            return TQKV_OK;
        }
    int32_t *tokens = malloc(4ull * (size_t)x.n);
    if (!tokens) {
        tqkv_model_state_free(st);
        pcf_entry_free(&x);
        return tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
    }
    memcpy(tokens, x.tokens, 4ull * (size_t)x.n);
    int n = x.n;
    pcf_entry_free(&x);
    return add_entry(pc, tokens, n, st);
}

tqkv_status prefix_load_file(prefix_cache *pc, const tqkv_model *m,
                             const tqkv_model_state_params *sp, const char *path) {
    tqkv_status rc = load_entry(pc, m, sp, AT_FDCWD, path, path);
    if (rc != TQKV_OK && rc != TQKV_ENOMEM) pc->refused++;
    return rc;
}

void prefix_load_dir(prefix_cache *pc, const tqkv_model *m, const tqkv_model_state_params *sp,
                     int verbose) {
    DIR *d = opendir(pc->dir);
    if (!d) return;
    struct dirent *de;
    int loaded = 0, refused = 0;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        if (nl < 7 || strcmp(de->d_name + nl - 6, ".tqkvp")) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", pc->dir, de->d_name);
        tqkv_status rc = load_entry(pc, m, sp, dirfd(d), de->d_name, path);
        if (rc == TQKV_OK) {
            loaded++;
            continue;
        }
        refused++;
        pc->refused++;
        /* at default verbosity: a refused entry is worth a line (the first 16 by name) */
        if (refused <= 16) fprintf(stderr, "tqkv engine: %s\n", tqkv_last_error());
    }
    closedir(d);
    if (verbose || refused)
        fprintf(stderr, "tqkv engine: prompt cache %s: %d entries loaded, %d refused\n", pc->dir,
                loaded, refused);
}

/* Public: load one prompt-cache file into the engine's prefix cache. */
tqkv_status tqkv_engine_prefix_import(tqkv_engine *e, const char *path) {
    if (!e || !path) return tqkv_fail(TQKV_EINVAL, "engine_prefix_import: NULL argument");
    if (!e->pc.budget)
        return tqkv_fail(TQKV_ESTATE, "engine_prefix_import: the prefix cache is off "
                         "(prefix_cache_bytes = 0)");
    pthread_mutex_lock(&e->mu);
    tqkv_status rc = prefix_key_model(&e->pc, e->model_dir, e->p.verbose);
    if (rc == TQKV_OK) rc = prefix_load_file(&e->pc, e->m, &e->psp, path);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

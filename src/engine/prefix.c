/*
 * prefix.c - the engine's prefix cache: 1-row model states of compressed KV rows keyed
 * by the token prefix they hold, LRU eviction inside a byte budget, optionally persisted
 * one file per entry in a directory.
 * Owns: prefix_cache entries and their files.
 * Must not: run the model, decide where prefixes are cut (the scheduler stores entries
 * only at its prefill chunk boundaries, so a hit continues with the same chunks a miss
 * would have run, and its output is bitwise identical).
 *
 * File format (little endian), DIR/<hash>.tqkvp:
 *   "TQKVPC01" | u64 fingerprint (model + KV parameters) | u32 desc length | desc bytes
 *   (the writer's "model ..., kv ..." for messages) | u32 n tokens | i32 tokens[n] |
 *   u64 state length | tqkv_model_state_export bytes (docs/STATE.md per layer)
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine_impl.h"
#include "util/common.h"

static const char PC_MAGIC[8] = {'T', 'Q', 'K', 'V', 'P', 'C', '0', '1'};

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

static int put(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n; }

static tqkv_status save_entry(const prefix_cache *pc, const prefix_entry *x) {
    uint8_t *blob = NULL;
    size_t bl = 0;
    tqkv_status rc = tqkv_model_state_export(x->st, &blob, &bl);
    if (rc != TQKV_OK) return rc;
    char path[4096], tmp[4200];
    entry_path(pc, x->hash, x->n, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        free(blob);
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot write %s: %s", tmp, strerror(errno));
    }
    uint32_t dl = (uint32_t)strlen(pc->desc), n = (uint32_t)x->n;
    uint64_t fp = pc->fingerprint, l64 = bl;
    int ok = put(f, PC_MAGIC, 8) && put(f, &fp, 8) && put(f, &dl, 4) && put(f, pc->desc, dl) &&
             put(f, &n, 4) && put(f, x->tokens, sizeof(int32_t) * (size_t)x->n) &&
             put(f, &l64, 8) && put(f, blob, bl);
    ok = (fclose(f) == 0) && ok;
    free(blob);
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot write %s", path);
    }
    return TQKV_OK;
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

tqkv_status prefix_load_file(prefix_cache *pc, const tqkv_model *m,
                             const tqkv_model_state_params *sp, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return tqkv_fail(TQKV_EIO, "prompt cache: cannot open %s: %s", path, strerror(errno));
    uint8_t *buf = NULL;
    long len = -1;
    if (fseek(f, 0, SEEK_END) == 0) len = ftell(f);
    if (len >= 0 && fseek(f, 0, SEEK_SET) == 0) buf = malloc((size_t)len + 1);
    size_t got = buf ? fread(buf, 1, (size_t)len, f) : 0;
    fclose(f);
    if (!buf || got != (size_t)len) {
        free(buf);
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot read %s", path);
    }
    tqkv_status rc = TQKV_OK;
    size_t at = 0, L = (size_t)len;
    uint64_t fp = 0, bl = 0;
    uint32_t dl = 0, n = 0;
    char desc[257] = "";
    if (L < 24 || memcmp(buf, PC_MAGIC, 8)) {
        rc = tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s is not a tqkv prompt cache file", path);
        goto out;
    }
    memcpy(&fp, buf + 8, 8);
    memcpy(&dl, buf + 16, 4);
    at = 20;
    if (dl > 256 || L - at < dl + 4) {
        rc = tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s is truncated", path);
        goto out;
    }
    memcpy(desc, buf + at, dl);
    desc[dl] = 0;
    at += dl;
    if (fp != pc->fingerprint) {
        rc = tqkv_fail(TQKV_EINVAL, "prompt cache: %s was written for %s; this engine runs %s "
                       "(another model or KV format): refused", path, desc, pc->desc);
        goto out;
    }
    memcpy(&n, buf + at, 4);
    at += 4;
    if (n < 1 || n > (1u << 24) || (L - at) / 4 < n || L - at - 4ull * n < 8) {
        rc = tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s is truncated", path);
        goto out;
    }
    int32_t *tokens = malloc(4ull * n);
    if (!tokens) {
        rc = tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
        goto out;
    }
    memcpy(tokens, buf + at, 4ull * n);
    at += 4ull * n;
    memcpy(&bl, buf + at, 8);
    at += 8;
    if (bl != L - at) {
        free(tokens);
        rc = tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s: state length %llu, %zu bytes left",
                       path, (unsigned long long)bl, L - at);
        goto out;
    }
    tqkv_model_state *st = NULL;
    tqkv_model_state_params p = *sp;
    p.rows = 1;
    rc = tqkv_model_state_import(&st, m, &p, buf + at, (size_t)bl);
    if (rc == TQKV_OK) {
        int off = 0;
        tqkv_model_state_offsets(st, &off);
        if (tqkv_model_state_rows(st) != 1 || off != (int)n) {
            tqkv_model_state_free(st);
            free(tokens);
            rc = tqkv_fail(TQKV_ECORRUPT, "prompt cache: %s holds %d tokens, header %u", path,
                           off, n);
            goto out;
        }
        for (int i = 0; i < pc->n; i++)
            if (pc->e[i].n == (int)n && !memcmp(pc->e[i].tokens, tokens, 4ull * n)) {
                tqkv_model_state_free(st); /* already cached */
                free(tokens);
                goto out;
            }
        rc = add_entry(pc, tokens, (int)n, st);
    } else {
        free(tokens);
    }
out:
    free(buf);
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
        if (prefix_load_file(pc, m, sp, path) == TQKV_OK) {
            loaded++;
        } else {
            refused++;
            if (verbose) fprintf(stderr, "tqkv engine: %s\n", tqkv_last_error());
        }
    }
    closedir(d);
    if (verbose)
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
    tqkv_status rc = prefix_load_file(&e->pc, e->m, &e->psp, path);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

/*
 * fuzz_restore.c - libFuzzer target for state restore (tqkv_batch_restore, tqkv_cache_restore).
 * Owns: feeding arbitrary bytes to restore twice, as given and with the trailing crc32
 * recomputed (so mutations reach the section parser instead of dying at the checksum), and
 * checking that whatever restores is a usable cache: export -> restore -> export is
 * byte-identical, reads/capture stay in bounds, append/trim/mask work.
 * With TQKV_FUZZ_WRITE_SEEDS=<dir> in the environment it writes a small seed corpus of valid
 * states there and exits (fuzz/run.sh uses that).
 * Must not: depend on anything but the public API (and zlib for the crc).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tqkv.h"

// ---------------------------------------------------------------------------
// Checks on a successfully restored object
// ---------------------------------------------------------------------------

static void die(const char *what) {
    fprintf(stderr, "fuzz_restore: %s (%s)\n", what, tqkv_last_error());
    abort();
}

static void check_batch(tqkv_batch *b) {
    uint8_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    if (tqkv_batch_export(b, &x, &nx) != TQKV_OK) die("export of a restored batch failed");
    /* the export is canonical: a state that restores re-exports to itself unless it held
     * optional sections (dropped), so only check export -> restore -> export */
    tqkv_batch *b2 = NULL;
    if (tqkv_batch_restore(&b2, x, nx) != TQKV_OK) die("re-restore failed");
    if (tqkv_batch_export(b2, &y, &ny) != TQKV_OK) die("re-export failed");
    if (nx != ny || memcmp(x, y, nx)) die("export -> restore -> export differs");
    free(x);
    free(y);
    tqkv_batch_free(b2);

    const tqkv_cache_config *cfg = tqkv_batch_get_config(b);
    int rows = tqkv_batch_rows(b), cols = tqkv_batch_columns(b);
    size_t floats = (size_t)rows * cfg->kv_heads * (size_t)cols * cfg->head_dim;
    if (floats <= ((size_t)1 << 22)) {
        float *k = malloc((floats ? floats : 1) * sizeof(float));
        float *v = malloc((floats ? floats : 1) * sizeof(float));
        if (k && v && tqkv_batch_capture(b, k, v, NULL, NULL) != TQKV_OK) die("capture failed");
        free(k);
        free(v);
    }
    tqkv_mask_lease *l = NULL;
    const tqkv_mask *m = NULL;
    if (tqkv_mask_lease_init(&l) == TQKV_OK) {
        if (cols > 0) (void)tqkv_batch_make_mask(b, l, 1, 3, &m);
        tqkv_mask_lease_free(l);
    }
    size_t tok = (size_t)rows * cfg->kv_heads * cfg->head_dim;
    if (tok <= ((size_t)1 << 22)) {
        float *z = calloc(tok ? tok : 1, sizeof(float));
        if (z) {
            tqkv_status st = tqkv_batch_append(b, z, z, 1);
            if (st != TQKV_OK && st != TQKV_ENOMEM && st != TQKV_ERANGE)
                die("append to a restored batch failed");
            free(z);
        }
    }
    (void)tqkv_batch_trim(b, 1);
    (void)tqkv_batch_bytes_used(b);
}

static void check_cache(tqkv_cache *c) {
    uint8_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    if (tqkv_cache_export(c, &x, &nx) != TQKV_OK) die("export of a restored cache failed");
    tqkv_cache *c2 = NULL;
    if (tqkv_cache_restore(&c2, x, nx) != TQKV_OK) die("re-restore of a cache failed");
    if (tqkv_cache_export(c2, &y, &ny) != TQKV_OK) die("re-export of a cache failed");
    if (nx != ny || memcmp(x, y, nx)) die("cache export -> restore -> export differs");
    free(x);
    free(y);
    tqkv_cache_free(c2);
    const tqkv_cache_config *cfg = tqkv_cache_get_config(c);
    int len = tqkv_cache_length(c);
    size_t floats = (size_t)cfg->kv_heads * (size_t)len * cfg->head_dim;
    if (len > 0 && floats <= ((size_t)1 << 22)) {
        float *k = malloc(floats * sizeof(float)), *v = malloc(floats * sizeof(float));
        if (k && v && tqkv_cache_read(c, 0, len, k, v) != TQKV_OK) die("read failed");
        free(k);
        free(v);
    }
    (void)tqkv_cache_min_reusable_offset(c);
    (void)tqkv_cache_trim(c, len > 0 ? 1 : 0);
}

static void try_restore(const uint8_t *p, size_t n) {
    tqkv_batch *b = NULL;
    if (tqkv_batch_restore(&b, p, n) == TQKV_OK) {
        check_batch(b);
        tqkv_batch_free(b);
    } else if (!tqkv_last_error()[0]) {
        die("failing restore left no message");
    }
    tqkv_cache *c = NULL;
    if (tqkv_cache_restore(&c, p, n) == TQKV_OK) {
        check_cache(c);
        tqkv_cache_free(c);
    } else if (!tqkv_last_error()[0]) {
        die("failing cache restore left no message");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* exact-size heap copies so that ASan flags any read past the end */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    try_restore(buf, size);
    if (size >= 12) { /* same bytes with a valid checksum */
        uLong crc = crc32(crc32(0L, Z_NULL, 0), buf, (uInt)(size - 4));
        for (int i = 0; i < 4; i++) buf[size - 4 + i] = (uint8_t)(crc >> (8 * i));
        try_restore(buf, size);
    }
    free(buf);
    return 0;
}

// ---------------------------------------------------------------------------
// Seed corpus
// ---------------------------------------------------------------------------

static float seed_rand(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void write_file(const char *dir, int idx, const uint8_t *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/seed-%02d.tqkv", dir, idx);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

static void write_seeds(const char *dir) {
    struct { tqkv_format k, v; int heads, dim, window, slack, rows, tokens, pad; } s[] = {
        {TQKV_TQ4, TQKV_TQ3, 1, 32, 4, 2, 2, 6, 1},  {TQKV_TQ2, TQKV_Q8, 2, 32, 3, 1, 1, 4, 0},
        {TQKV_F16, TQKV_F32, 1, 32, 0, 0, 3, 3, 2},  {TQKV_Q4, TQKV_TQ4, 1, 64, 2, 0, 2, 5, 0},
        {TQKV_TQ3, TQKV_TQ3, 1, 32, 0, 4, 0, 0, 0},  {TQKV_F32, TQKV_Q8, 1, 32, 8, 8, 1, 2, 3},
    };
    int idx = 0;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        tqkv_cache_config cfg = tqkv_cache_config_default();
        cfg.k_format = s[i].k;
        cfg.v_format = s[i].v;
        cfg.kv_heads = s[i].heads;
        cfg.head_dim = s[i].dim;
        cfg.window = s[i].window;
        cfg.window_slack = s[i].slack;
        cfg.seed = i * 7 + 1;
        tqkv_batch *b = NULL;
        if (tqkv_batch_init(&b, &cfg, s[i].rows) != TQKV_OK) die("seed init");
        size_t n = (size_t)s[i].rows * s[i].heads * s[i].tokens * s[i].dim;
        float *k = malloc((n ? n : 1) * sizeof(float)), *v = malloc((n ? n : 1) * sizeof(float));
        for (size_t j = 0; j < n; j++) { k[j] = seed_rand(&rng); v[j] = seed_rand(&rng); }
        if (s[i].tokens && tqkv_batch_append(b, k, v, s[i].tokens) != TQKV_OK) die("seed append");
        if (s[i].rows > 1) {
            int ends[8];
            for (int r = 0; r < s[i].rows; r++) ends[r] = s[i].tokens - r;
            if (tqkv_batch_restore_prefill_ends(b, ends) != TQKV_OK) die("seed ends");
        }
        if (s[i].pad) {
            int pads[8];
            for (int r = 0; r < s[i].rows; r++) pads[r] = s[i].pad + r;
            if (tqkv_batch_align(b, pads) != TQKV_OK) die("seed align");
        }
        uint8_t *p = NULL;
        size_t len = 0;
        if (tqkv_batch_export(b, &p, &len) != TQKV_OK) die("seed export");
        write_file(dir, idx++, p, len);
        free(p);
        if (s[i].rows >= 1) { /* the first row as a single cache */
            tqkv_cache *c = NULL;
            if (tqkv_batch_extract(b, 0, &c) != TQKV_OK) die("seed extract");
            if (tqkv_cache_export(c, &p, &len) != TQKV_OK) die("seed cache export");
            write_file(dir, idx++, p, len);
            free(p);
            tqkv_cache_free(c);
        }
        free(k);
        free(v);
        tqkv_batch_free(b);
    }
    fprintf(stderr, "fuzz_restore: wrote %d seeds to %s\n", idx, dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *dir = getenv("TQKV_FUZZ_WRITE_SEEDS");
    if (dir && *dir) {
        write_seeds(dir);
        exit(0);
    }
    return 0;
}

/*
 * prefix_file.c - the files of the prompt-cache directory: the content key of a model
 * directory, writing one entry, and reading one entry defensively.
 * Owns: the on-disk entry format and every check a file must pass before its bytes reach
 * the state importer.
 * Must not: touch the in-memory prefix cache (prefix.c), run the model, follow a
 * symbolic link, open anything but a regular file, or read more of a file than its
 * header says it holds.
 *
 * Entry format (little endian), DIR/<hash>-<n>.tqkvp:
 *   header, 40 bytes: "TQKVPC02" | u64 key | u32 desc length | u32 n tokens |
 *                     u64 state length | u64 checksum
 *   desc bytes (the writer's "model ..., kv ..." for messages) | i32 tokens[n] |
 *   state bytes (tqkv_model_state_export, docs/STATE.md)
 * key: the engine's fingerprint (config, KV spec, prefill chunk, device) folded with the
 * content key of the model directory (pcf_model_key). checksum: pcf_hash over the header
 * with checksum 0, then desc, tokens and state. A file is used only when its size is
 * exactly header + desc + 4 n + state and at most the cap, its key equals the engine's
 * and its checksum matches; so an altered token key, an altered payload, a truncated or
 * extended file, and an entry of changed weights are all refused.
 *
 * The hash is a non-cryptographic 64-bit mix (4 lanes of multiply / rotate over 8-byte
 * words): any accidental change is caught except with probability about 2^-64; it does
 * not stop someone who can write the directory from forging an entry (who can write the
 * cache directory or the model can make the server say anything anyway).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/prefix_file.h"
#include "util/common.h"

static const char PCF_MAGIC[8] = {'T', 'Q', 'K', 'V', 'P', 'C', '0', '2'};
static const char PCF_MAGIC_V1[8] = {'T', 'Q', 'K', 'V', 'P', 'C', '0', '1'};
#define PCF_HEADER 40

/* ------------------------------------------------------------------------- */
/* Hash                                                                      */
/* ------------------------------------------------------------------------- */

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t lane(uint64_t h, uint64_t w) { return rotl(h + w * P2, 31) * P1; }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

void pcf_hash_init(pcf_hash_state *s, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->v[0] = seed + P1 + P2;
    s->v[1] = seed + P2;
    s->v[2] = seed;
    s->v[3] = seed - P1;
}

void pcf_hash_update(pcf_hash_state *s, const void *data, size_t n) {
    const uint8_t *p = data;
    s->total += n;
    if (s->nbuf) { /* complete the pending 32-byte block */
        size_t k = 32 - s->nbuf < n ? 32 - s->nbuf : n;
        memcpy(s->buf + s->nbuf, p, k);
        s->nbuf += k;
        p += k;
        n -= k;
        if (s->nbuf < 32) return;
        for (int l = 0; l < 4; l++) s->v[l] = lane(s->v[l], load64(s->buf + 8 * l));
        s->nbuf = 0;
    }
    uint64_t v0 = s->v[0], v1 = s->v[1], v2 = s->v[2], v3 = s->v[3];
    for (; n >= 32; p += 32, n -= 32) {
        v0 = lane(v0, load64(p));
        v1 = lane(v1, load64(p + 8));
        v2 = lane(v2, load64(p + 16));
        v3 = lane(v3, load64(p + 24));
    }
    s->v[0] = v0, s->v[1] = v1, s->v[2] = v2, s->v[3] = v3;
    memcpy(s->buf, p, n);
    s->nbuf = n;
}

uint64_t pcf_hash_final(const pcf_hash_state *s) {
    uint64_t h = rotl(s->v[0], 1) + rotl(s->v[1], 7) + rotl(s->v[2], 12) + rotl(s->v[3], 18);
    for (int l = 0; l < 4; l++) h = (h ^ lane(0, s->v[l])) * P1 + P3;
    h += s->total;
    for (size_t i = 0; i < s->nbuf; i++) h = rotl(h ^ (s->buf[i] * P3), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

uint64_t pcf_hash(uint64_t seed, const void *data, size_t n) {
    pcf_hash_state s;
    pcf_hash_init(&s, seed);
    pcf_hash_update(&s, data, n);
    return pcf_hash_final(&s);
}

/* ------------------------------------------------------------------------- */
/* Content key of a model directory                                          */
/* ------------------------------------------------------------------------- */

/* The files the loaders read: config / index / tokenizer JSON, weights, templates. */
static int model_file(const char *name) {
    static const char *const ext[] = {".json", ".safetensors", ".jinja", ".model", ".txt"};
    size_t n = strlen(name);
    if (name[0] == '.') return 0;
    for (size_t i = 0; i < sizeof ext / sizeof ext[0]; i++) {
        size_t k = strlen(ext[i]);
        if (n > k && !strcmp(name + n - k, ext[i])) return 1;
    }
    return 0;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Hash name, size and whole content of one regular file into *s. */
static tqkv_status hash_file(int dfd, const char *name, pcf_hash_state *s, uint8_t *buf,
                             size_t cap, size_t *bytes) {
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) close(fd);
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot read model file %s: %s", name,
                         strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) { /* not a file the loader reads either */
        close(fd);
        return TQKV_OK;
    }
    uint64_t size = (uint64_t)st.st_size;
    pcf_hash_update(s, name, strlen(name) + 1);
    pcf_hash_update(s, &size, sizeof size);
    uint64_t got = 0;
    for (;;) {
        ssize_t k = read(fd, buf, cap);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        pcf_hash_update(s, buf, (size_t)k);
        got += (uint64_t)k;
    }
    close(fd);
    if (got != size)
        return tqkv_fail(TQKV_EIO, "prompt cache: model file %s changed while it was hashed", name);
    *bytes += (size_t)got;
    return TQKV_OK;
}

tqkv_status pcf_model_key(const char *model_dir, uint64_t *out, size_t *bytes_hashed) {
    *out = 0;
    if (bytes_hashed) *bytes_hashed = 0;
    DIR *d = opendir(model_dir);
    if (!d)
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot list model directory %s: %s", model_dir,
                         strerror(errno));
    char **names = NULL;
    int n = 0, cap = 0;
    tqkv_status rc = TQKV_OK;
    struct dirent *de;
    while ((de = readdir(d)) && rc == TQKV_OK) {
        if (!model_file(de->d_name)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            char **nn = realloc(names, sizeof *nn * (size_t)cap);
            if (!nn) {
                rc = tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
                break;
            }
            names = nn;
        }
        if (!(names[n] = strdup(de->d_name))) rc = tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
        else n++;
    }
    qsort(names, (size_t)n, sizeof *names, cmp_names); /* readdir order is arbitrary */
    size_t bcap = (size_t)1 << 20, total = 0;
    uint8_t *buf = rc == TQKV_OK ? malloc(bcap) : NULL;
    if (rc == TQKV_OK && !buf) rc = tqkv_fail(TQKV_ENOMEM, "prompt cache: out of memory");
    pcf_hash_state s;
    pcf_hash_init(&s, 0x74716b76ull);
    for (int i = 0; i < n && rc == TQKV_OK; i++) rc = hash_file(dirfd(d), names[i], &s, buf, bcap, &total);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    free(buf);
    closedir(d);
    if (rc != TQKV_OK) return rc;
    *out = pcf_hash_final(&s);
    if (bytes_hashed) *bytes_hashed = total;
    return TQKV_OK;
}

/* ------------------------------------------------------------------------- */
/* Writing                                                                   */
/* ------------------------------------------------------------------------- */

static void put_header(uint8_t h[PCF_HEADER], uint64_t key, uint32_t dl, uint32_t n, uint64_t sl,
                       uint64_t sum) {
    memcpy(h, PCF_MAGIC, 8);
    memcpy(h + 8, &key, 8);
    memcpy(h + 16, &dl, 4);
    memcpy(h + 20, &n, 4);
    memcpy(h + 24, &sl, 8);
    memcpy(h + 32, &sum, 8);
}

static uint64_t entry_sum(const uint8_t h[PCF_HEADER], const char *desc, uint32_t dl,
                          const int32_t *tokens, uint32_t n, const uint8_t *state, uint64_t sl) {
    uint8_t h0[PCF_HEADER];
    memcpy(h0, h, PCF_HEADER);
    memset(h0 + 32, 0, 8);
    pcf_hash_state s;
    pcf_hash_init(&s, 0x70632d73756dull);
    pcf_hash_update(&s, h0, PCF_HEADER);
    pcf_hash_update(&s, desc, dl);
    pcf_hash_update(&s, tokens, 4ull * n);
    pcf_hash_update(&s, state, (size_t)sl);
    return pcf_hash_final(&s);
}

static int put(FILE *f, const void *p, size_t n) { return fwrite(p, 1, n, f) == n; }

tqkv_status pcf_write(const char *path, uint64_t key, const char *desc, const int32_t *tokens,
                      int n, const uint8_t *state, size_t state_len) {
    uint32_t dl = (uint32_t)strlen(desc), nt = (uint32_t)n;
    uint64_t sl = state_len;
    uint8_t h[PCF_HEADER];
    put_header(h, key, dl, nt, sl, 0);
    uint64_t sum = entry_sum(h, desc, dl, tokens, nt, state, sl);
    memcpy(h + 32, &sum, 8);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f) return tqkv_fail(TQKV_EIO, "prompt cache: cannot write %s: %s", tmp, strerror(errno));
    int ok = put(f, h, PCF_HEADER) && put(f, desc, dl) && put(f, tokens, 4ull * nt) &&
             put(f, state, state_len);
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return tqkv_fail(TQKV_EIO, "prompt cache: cannot write %s", path);
    }
    return TQKV_OK;
}

/* ------------------------------------------------------------------------- */
/* Reading                                                                   */
/* ------------------------------------------------------------------------- */

static int read_full(int fd, void *p, size_t n, off_t at) {
    uint8_t *b = p;
    while (n) {
        ssize_t k = pread(fd, b, n, at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        b += k;
        n -= (size_t)k;
        at += k;
    }
    return 0;
}

/* Refusal: TQKV_ECORRUPT (or EINVAL for another model / KV spec) with the reason. */
#define REFUSE(code, ...) do { rc = tqkv_fail(code, __VA_ARGS__); goto out; } while (0)

tqkv_status pcf_read(int dfd, const char *name, const char *shown, uint64_t key,
                     const char *our_desc, size_t cap, pcf_entry *out) {
    memset(out, 0, sizeof *out);
    tqkv_status rc = TQKV_OK;
    uint8_t *body = NULL;
    /* lstat first: a device, FIFO or symlink is refused without being opened at all;
     * then O_NONBLOCK (a FIFO swapped in does not wait for a writer), O_NOFOLLOW (no
     * symlinks, out of the directory or anywhere) and fstat of what was opened (the same
     * regular file) */
    struct stat lst;
    int fd = -1;
    if (fstatat(dfd, name, &lst, AT_SYMLINK_NOFOLLOW) != 0)
        REFUSE(TQKV_EIO, "prompt cache: cannot stat %s: %s", shown, strerror(errno));
    if (S_ISLNK(lst.st_mode)) REFUSE(TQKV_ECORRUPT, "prompt cache: %s is a symbolic link: refused", shown);
    if (!S_ISREG(lst.st_mode)) REFUSE(TQKV_ECORRUPT, "prompt cache: %s is not a regular file: refused", shown);
    fd = openat(dfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP) REFUSE(TQKV_ECORRUPT, "prompt cache: %s is a symbolic link: refused", shown);
        REFUSE(TQKV_EIO, "prompt cache: cannot open %s: %s", shown, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) REFUSE(TQKV_EIO, "prompt cache: cannot stat %s: %s", shown, strerror(errno));
    if (!S_ISREG(st.st_mode) || st.st_ino != lst.st_ino || st.st_dev != lst.st_dev)
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s is not a regular file (or was replaced while "
               "opened): refused", shown);
    uint64_t size = (uint64_t)st.st_size;
    if (size > cap)
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s is %llu bytes, over the %zu-byte cap: refused", shown,
               (unsigned long long)size, cap);
    uint8_t h[PCF_HEADER];
    if (size < PCF_HEADER || read_full(fd, h, PCF_HEADER, 0))
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s is not a tqkv prompt cache file (too short)", shown);
    if (!memcmp(h, PCF_MAGIC_V1, 8))
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s has the old format TQKVPC01 (no content key, no "
               "checksum): refused", shown);
    if (memcmp(h, PCF_MAGIC, 8))
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s is not a tqkv prompt cache file", shown);
    uint64_t fkey, sl, sum;
    uint32_t dl, n;
    memcpy(&fkey, h + 8, 8);
    memcpy(&dl, h + 16, 4);
    memcpy(&n, h + 20, 4);
    memcpy(&sl, h + 24, 8);
    memcpy(&sum, h + 32, 8);
    if (dl > 255 || n < 1 || n > (1u << 24) || sl > cap ||
        size != PCF_HEADER + (uint64_t)dl + 4ull * n + sl)
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s: lengths (desc %u, %u tokens, state %llu) do not "
               "add up to its %llu bytes: refused", shown, dl, n, (unsigned long long)sl,
               (unsigned long long)size);
    char desc[256];
    if (read_full(fd, desc, dl, PCF_HEADER))
        REFUSE(TQKV_EIO, "prompt cache: cannot read %s", shown);
    desc[dl] = 0;
    for (uint32_t i = 0; i < dl; i++)
        if ((unsigned char)desc[i] < 0x20 || (unsigned char)desc[i] > 0x7e) desc[i] = '?';
    if (fkey != key)
        REFUSE(TQKV_EINVAL, "prompt cache: %s was written for %s; this engine runs %s (another "
               "model, other weights or another KV format): refused", shown, desc, our_desc);
    size_t rest = (size_t)(4ull * n + sl);
    body = malloc(rest ? rest : 1);
    if (!body) REFUSE(TQKV_ENOMEM, "prompt cache: out of memory");
    if (read_full(fd, body, rest, PCF_HEADER + dl))
        REFUSE(TQKV_EIO, "prompt cache: cannot read %s", shown);
    int32_t *tokens = (int32_t *)(void *)body;
    if (entry_sum(h, desc, dl, tokens, n, body + 4ull * n, sl) != sum)
        REFUSE(TQKV_ECORRUPT, "prompt cache: %s: checksum mismatch (the file was altered or "
               "damaged): refused", shown);
    out->body = body;
    out->tokens = tokens;
    out->n = (int)n;
    out->state = body + 4ull * n;
    out->state_len = (size_t)sl;
    body = NULL;
out:
    free(body);
    if (fd >= 0) close(fd);
    return rc;
}

void pcf_entry_free(pcf_entry *x) {
    free(x->body);
    memset(x, 0, sizeof *x);
}

/*
 * test_safetensors.c - the mmapped safetensors reader: valid single/sharded archives, and
 * every kind of damage (truncation, header length beyond the file, offsets beyond the file,
 * bad JSON, size/shape mismatch, unknown dtype, duplicate tensors, bad index) gives a clear
 * error naming the file/tensor, never a crash.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/load/safetensors.h"
#include "testutil.h"

// ---------------------------------------------------------------------------
// fixtures
// ---------------------------------------------------------------------------

static char g_dir[256];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/tqkv_st_%d_%llu", (int)getpid(),
             (unsigned long long)(test_seed() % 1000000));
    mkdir(g_dir, 0700);
}

static const char *path_in(const char *name, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", g_dir, name);
    return buf;
}

/* Write a safetensors file: header JSON (as given) then `data_len` bytes of data. */
static void write_st(const char *path, const char *header, const void *data, size_t data_len,
                     long long header_len_override) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t n = header_len_override >= 0 ? (uint64_t)header_len_override : strlen(header);
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n >> (8 * i));
    fwrite(le, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    if (data_len) fwrite(data, 1, data_len, f);
    fclose(f);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static const char *GOOD_HDR =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"
    "\"b\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[24,32]},"
    "\"c\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[32,40]}}";

static void expect_fail(const char *path, tqkv_status want, const char *needle1,
                        const char *needle2) {
    st_archive a;
    tqkv_status rc = st_open_file(&a, path);
    if (rc == TQKV_OK) st_close(&a);
    assert_int_equal(rc, want);
    const char *msg = tqkv_last_error();
    if (needle1 && !strstr(msg, needle1)) fail_msg("message '%s' lacks '%s'", msg, needle1);
    if (needle2 && !strstr(msg, needle2)) fail_msg("message '%s' lacks '%s'", msg, needle2);
}

// ---------------------------------------------------------------------------
// tests
// ---------------------------------------------------------------------------

static void test_valid_single(void **state) {
    (void)state;
    char p[512];
    uint8_t data[40];
    for (int i = 0; i < 40; i++) data[i] = (uint8_t)i;
    write_st(path_in("good.safetensors", p, sizeof p), GOOD_HDR, data, 40, -1);
    st_archive a;
    assert_int_equal(st_open_file(&a, p), TQKV_OK);
    assert_int_equal(a.n_tensors, 3);
    const st_tensor *t = st_find(&a, "a");
    assert_non_null(t);
    assert_int_equal(t->dtype, ST_F32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->nbytes, 24);
    assert_int_equal(t->data[0], 0);
    t = st_find(&a, "b");
    assert_non_null(t);
    assert_int_equal(t->dtype, ST_BF16);
    assert_int_equal(t->data[0], 24);
    t = st_find(&a, "c");
    assert_non_null(t);
    assert_int_equal(t->dtype, ST_OTHER);
    assert_null(st_find(&a, "zz"));
    st_close(&a);
}

static void test_damaged(void **state) {
    (void)state;
    char p[512];
    uint8_t data[40] = {0};
    /* shorter than the 8-byte length */
    write_text(path_in("tiny.safetensors", p, sizeof p), "abc");
    expect_fail(p, TQKV_ECORRUPT, "tiny.safetensors", "truncated");
    /* header length beyond the file */
    write_st(path_in("hlen.safetensors", p, sizeof p), GOOD_HDR, data, 40, 1000000);
    expect_fail(p, TQKV_ECORRUPT, "hlen.safetensors", "header length");
    /* data cut short: offsets beyond the file */
    write_st(path_in("cut.safetensors", p, sizeof p), GOOD_HDR, data, 30, -1);
    expect_fail(p, TQKV_ECORRUPT, "cut.safetensors", "'b' data_offsets [24, 32] beyond");
    /* JSON syntax error */
    write_st(path_in("json.safetensors", p, sizeof p), "{\"a\": {\"dtype\": \"F32\",", data, 0, -1);
    expect_fail(p, TQKV_ECORRUPT, "json.safetensors", "JSON");
    /* size mismatch between shape and offsets */
    write_st(path_in("size.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,4],\"data_offsets\":[0,24]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "shape needs 32");
    /* unknown dtype */
    write_st(path_in("dtype.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,2]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "Q7");
    /* inverted / negative offsets, bad shapes */
    write_st(path_in("inv.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "data_offsets");
    /* non-numeric / fractional offsets (no UB casts, no silent truncation) */
    write_st(path_in("stroff.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "data_offsets");
    write_st(path_in("fracoff.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0.5,4.5]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "data_offsets");
    write_st(path_in("neg.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", "shape");
    write_st(path_in("huge.safetensors", p, sizeof p),
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
             "\"data_offsets\":[0,4]}}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", NULL);
    write_st(path_in("entry.safetensors", p, sizeof p), "{\"a\":5}", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "'a'", NULL);
    write_st(path_in("arr.safetensors", p, sizeof p), "[1,2]", data, 40, -1);
    expect_fail(p, TQKV_ECORRUPT, "arr.safetensors", NULL);
    /* no tensors: bytes after the header are trailing bytes (the fuzz found this path
     * passing NULL to qsort); an empty data area opens as an archive with no tensors */
    write_st(path_in("none.safetensors", p, sizeof p), "{\"__metadata__\":{}}", data, 8, -1);
    expect_fail(p, TQKV_ECORRUPT, "none.safetensors", "8 trailing bytes");
    write_st(path_in("empty.safetensors", p, sizeof p), "{}", data, 0, -1);
    st_archive e;
    assert_int_equal(st_open_file(&e, p), TQKV_OK);
    assert_int_equal(e.n_tensors, 0);
    st_close(&e);
    /* missing file */
    expect_fail(path_in("nope.safetensors", p, sizeof p), TQKV_EIO, "nope.safetensors", NULL);
}

/* Random byte damage anywhere in a valid file: an error or a valid archive, never a crash. */
static void test_fuzz_bytes(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    uint8_t data[40] = {0};
    char p[512];
    path_in("fuzz.safetensors", p, sizeof p);
    size_t hl = strlen(GOOD_HDR), total = 8 + hl + 40;
    uint8_t *buf = malloc(total);
    for (int it = 0; it < 300; it++) {
        write_st(p, GOOD_HDR, data, 40, -1);
        FILE *f = fopen(p, "rb");
        assert_int_equal(fread(buf, 1, total, f), total);
        fclose(f);
        int nflip = 1 + (int)(rng_u64(&r) % 4);
        for (int k = 0; k < nflip; k++) buf[rng_u64(&r) % (8 + hl)] = (uint8_t)rng_u64(&r);
        size_t keep = it % 3 == 0 ? (size_t)(rng_u64(&r) % total) : total;
        f = fopen(p, "wb");
        fwrite(buf, 1, keep, f);
        fclose(f);
        st_archive a;
        if (st_open_file(&a, p) == TQKV_OK) {
            for (int i = 0; i < a.n_tensors; i++) /* every tensor lies inside the mapping */
                assert_true(a.tensors[i].data + a.tensors[i].nbytes <=
                            (const uint8_t *)a.files[0].map + a.files[0].size);
            st_close(&a);
        } else {
            assert_true(strlen(tqkv_last_error()) > 0);
        }
    }
    free(buf);
}

static void test_sharded(void **state) {
    (void)state;
    char p[1024], d[400];
    snprintf(d, sizeof d, "%s/sharded", g_dir);
    mkdir(d, 0700);
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    snprintf(p, sizeof p, "%s/s1.safetensors", d);
    write_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]}}", a, 24, -1);
    snprintf(p, sizeof p, "%s/s2.safetensors", d);
    write_st(p, "{\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,8]}}", b, 8, -1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    write_text(p, "{\"metadata\":{},\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s2.safetensors\"}}");
    st_archive ar;
    assert_int_equal(st_open_dir(&ar, d), TQKV_OK);
    assert_int_equal(ar.n_files, 2);
    const st_tensor *t = st_find(&ar, "b");
    assert_non_null(t);
    assert_int_equal(t->shape[0], 2);
    assert_true(strstr(st_file_of(&ar, t), "s2.safetensors") != NULL);
    st_close(&ar);
    /* index pointing at the wrong shard */
    write_text(p, "{\"weight_map\":{\"a\":\"s2.safetensors\",\"b\":\"s2.safetensors\"}}");
    assert_int_equal(st_open_dir(&ar, d), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "'a'"));
    /* index naming a missing shard */
    write_text(p, "{\"weight_map\":{\"a\":\"s1.safetensors\",\"b\":\"s9.safetensors\"}}");
    assert_int_equal(st_open_dir(&ar, d), TQKV_EIO);
    assert_non_null(strstr(tqkv_last_error(), "s9.safetensors"));
    /* path escape and syntax error */
    write_text(p, "{\"weight_map\":{\"a\":\"../s1.safetensors\"}}");
    assert_int_equal(st_open_dir(&ar, d), TQKV_ECORRUPT);
    write_text(p, "{\"weight_map\":{\"a\":");
    assert_int_equal(st_open_dir(&ar, d), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "model.safetensors.index.json"));
    /* duplicate tensor across shards */
    snprintf(p, sizeof p, "%s/s2.safetensors", d);
    write_st(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]}}", a, 24, -1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    write_text(p, "{\"weight_map\":{\"a\":\"s1.safetensors\",\"x\":\"s2.safetensors\"}}");
    assert_int_equal(st_open_dir(&ar, d), TQKV_ECORRUPT);
    assert_non_null(strstr(tqkv_last_error(), "twice"));
    /* empty dir */
    snprintf(p, sizeof p, "%s/empty", g_dir);
    mkdir(p, 0700);
    assert_int_equal(st_open_dir(&ar, p), TQKV_EIO);
}

/* The real bundled checkpoint opens and holds the expected tensors. */
static void test_real_model(void **state) {
    (void)state;
    char d[512];
    source_path("models/qwen3-code-28m", d, sizeof d);
    struct stat st;
    if (stat(d, &st) != 0) skip();
    st_archive a;
    assert_int_equal(st_open_dir(&a, d), TQKV_OK);
    assert_int_equal(a.n_files, 4);
    const st_tensor *t = st_find(&a, "model.embed_tokens.weight");
    assert_non_null(t);
    assert_int_equal(t->dtype, ST_BF16);
    assert_int_equal(t->shape[0], 8192);
    assert_int_equal(t->shape[1], 512);
    assert_non_null(st_find(&a, "model.layers.7.mlp.down_proj.weight"));
    st_close(&a);
}

static int teardown(void **state) {
    (void)state;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : 0;
}

int main(void) {
    make_dir();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_single), cmocka_unit_test(test_damaged),
        cmocka_unit_test(test_fuzz_bytes),   cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_real_model),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}

/*
 * test_state.c - state export / restore (docs/STATE.md): byte-identical round trips for
 * batched and single caches, and rejection of truncated, corrupted, other-version and
 * crafted states (each with ECORRUPT and a message, never reading out of bounds: run
 * under ASan).
 */
#include <zlib.h>

#include "cache_helpers.h"

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/* Byte offsets of fields in a state (docs/STATE.md). */
enum {
    AT_VERSION = 4,
    AT_CONF = 8,           /* tag, u64 length, 68-byte payload */
    AT_KIND = 20,
    AT_HEADS = 24,
    AT_DIM = 28,
    AT_KFMT = 32,
    AT_WINDOW = 48,
    AT_ROWS_SEC = 88,
    AT_ROWS = 100,         /* i32 rows, then per row: offset, left_pad, win_lo */
};

static void put32(uint8_t *p, uint32_t x) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(x >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void fix_crc(uint8_t *p, size_t n) {
    uint32_t c = (uint32_t)crc32(crc32(0L, Z_NULL, 0), p, (uInt)(n - 4));
    put32(p + n - 4, c);
}

static tqkv_batch *sample_batch(test_rng *r, tqkv_format kf, tqkv_format vf, int window,
                                int R, int maxlen) {
    tqkv_cache_config cfg = cfg_make(kf, vf, rng_int(r, 1, 2), 32 << rng_int(r, 0, 1), window,
                                     3, rng_u64(r));
    tqkv_cache_ref refs[8];
    tqkv_cache *cs[8];
    for (int i = 0; i < R; i++) {
        seq_t s = seq_make(r, cfg.kv_heads, maxlen, cfg.head_dim);
        cs[i] = cache_fresh(&cfg, &s, rng_int(r, 0, maxlen), r);
        if (rng_int(r, 0, 1)) /* trimmed beyond the slack: win_lo clipped */
            assert_int_equal(tqkv_cache_trim(cs[i], rng_int(r, 0, tqkv_cache_length(cs[i]))),
                             TQKV_OK);
        refs[i] = (tqkv_cache_ref){.single = cs[i]};
        seq_free(&s);
    }
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_merge(&b, refs, R), TQKV_OK);
    int pads[8];
    for (int i = 0; i < R; i++) pads[i] = rng_int(r, 0, 4);
    assert_int_equal(tqkv_batch_align(b, pads), TQKV_OK);
    for (int i = 0; i < R; i++) tqkv_cache_free(cs[i]);
    return b;
}

/* restore must fail with `want`, set a message and leave *out untouched */
static void expect_batch_restore_fails(const uint8_t *p, size_t n, tqkv_status want,
                                       const char *needle) {
    tqkv_batch *b = (tqkv_batch *)0x1;
    tqkv_clear_error();
    tqkv_status st = tqkv_batch_restore(&b, p, n);
    if (st != want)
        fail_msg("restore of %zu bytes: got %s (%s), want %s", n, tqkv_status_name(st),
                 tqkv_last_error(), tqkv_status_name(want));
    assert_true(tqkv_last_error()[0] != 0);
    if (needle && !strstr(tqkv_last_error(), needle))
        fail_msg("message '%s' lacks '%s'", tqkv_last_error(), needle);
    assert_ptr_equal(b, (tqkv_batch *)0x1);
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

static void test_batch_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 31);
    const tqkv_format pairs[][2] = {{TQKV_TQ4, TQKV_TQ3}, {TQKV_TQ2, TQKV_Q8}, {TQKV_F32, TQKV_F16},
                                    {TQKV_Q4, TQKV_TQ4}, {TQKV_F16, TQKV_Q4}};
    for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
        for (int window = 0; window <= 6; window += 6) {
            tqkv_batch *b = sample_batch(&r, pairs[p][0], pairs[p][1], window, rng_int(&r, 1, 5), 20);
            blob x = blob_batch(b);
            tqkv_batch *b2 = NULL;
            assert_int_equal(tqkv_batch_restore(&b2, x.p, x.n), TQKV_OK);
            blob y = blob_batch(b2);
            assert_true(blob_eq(x, y));
            assert_string_equal(tqkv_batch_signature(b2), tqkv_batch_signature(b));
            assert_int_equal(tqkv_batch_columns(b2), tqkv_batch_columns(b));
            assert_int_equal(tqkv_batch_bytes_used(b2) <= tqkv_batch_bytes_used(b), 1);
            /* and reads the same as the original (window tokens included) */
            {
                const tqkv_cache_config *c0 = tqkv_batch_get_config(b);
                size_t nf = (size_t)tqkv_batch_rows(b) * c0->kv_heads * tqkv_batch_columns(b) *
                            c0->head_dim + 1;
                float *k1 = malloc(nf * 4), *v1 = malloc(nf * 4), *k2 = malloc(nf * 4),
                      *v2 = malloc(nf * 4);
                assert_int_equal(tqkv_batch_capture(b, k1, v1, NULL, NULL), TQKV_OK);
                assert_int_equal(tqkv_batch_capture(b2, k2, v2, NULL, NULL), TQKV_OK);
                assert_memory_equal(k1, k2, (nf - 1) * 4);
                assert_memory_equal(v1, v2, (nf - 1) * 4);
                free(k1); free(v1); free(k2); free(v2);
            }
            /* both keep behaving the same */
            const tqkv_cache_config *cfg = tqkv_batch_get_config(b);
            int R = tqkv_batch_rows(b);
            size_t n = (size_t)R * cfg->kv_heads * 5 * cfg->head_dim;
            float *k = rand_floats(&r, n), *v = rand_floats(&r, n);
            assert_int_equal(tqkv_batch_append(b, k, v, 5), TQKV_OK);
            assert_int_equal(tqkv_batch_append(b2, k, v, 5), TQKV_OK);
            blob x2 = blob_batch(b), y2 = blob_batch(b2);
            assert_true(blob_eq(x2, y2));
            blob_free(&x2);
            blob_free(&y2);
            free(k);
            free(v);
            /* a batch state is not a single cache state */
            tqkv_cache *c = NULL;
            tqkv_clear_error();
            assert_int_equal(tqkv_cache_restore(&c, x.p, x.n), TQKV_EINVAL);
            assert_true(tqkv_last_error()[0] != 0);
            blob_free(&x);
            blob_free(&y);
            tqkv_batch_free(b);
            tqkv_batch_free(b2);
        }
}

static void test_single_roundtrip(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 32);
    for (int f = 0; f < TQKV_FORMAT_COUNT; f++) {
        tqkv_cache_config cfg = cfg_make((tqkv_format)f, TQKV_TQ3, 2, 64, rng_int(&r, 0, 8), 2, rng_u64(&r));
        seq_t s = seq_make(&r, 2, 30, 64);
        tqkv_cache *c = cache_fresh(&cfg, &s, rng_int(&r, 0, 30), &r);
        if (rng_int(&r, 0, 1)) /* beyond the slack too: the window shrinks */
            assert_int_equal(tqkv_cache_trim(c, rng_int(&r, 0, tqkv_cache_length(c))), TQKV_OK);
        blob x = blob_cache(c);
        tqkv_cache *c2 = NULL;
        assert_int_equal(tqkv_cache_restore(&c2, x.p, x.n), TQKV_OK);
        assert_int_equal(tqkv_cache_length(c2), tqkv_cache_length(c));
        assert_memory_equal(tqkv_cache_get_config(c2), &cfg, sizeof cfg);
        assert_caches_same(c, c2);
        /* reads agree */
        int L = tqkv_cache_length(c);
        if (L > 0) {
            float *k1 = malloc((size_t)2 * L * 64 * 4), *v1 = malloc((size_t)2 * L * 64 * 4);
            float *k2 = malloc((size_t)2 * L * 64 * 4), *v2 = malloc((size_t)2 * L * 64 * 4);
            assert_int_equal(tqkv_cache_read(c, 0, L, k1, v1), TQKV_OK);
            assert_int_equal(tqkv_cache_read(c2, 0, L, k2, v2), TQKV_OK);
            assert_memory_equal(k1, k2, (size_t)2 * L * 64 * 4);
            assert_memory_equal(v1, v2, (size_t)2 * L * 64 * 4);
            free(k1); free(v1); free(k2); free(v2);
        }
        /* a single state is not a batch state */
        tqkv_batch *b = NULL;
        assert_int_equal(tqkv_batch_restore(&b, x.p, x.n), TQKV_EINVAL);
        blob_free(&x);
        tqkv_cache_free(c);
        tqkv_cache_free(c2);
        seq_free(&s);
    }
}

// ---------------------------------------------------------------------------
// Damaged states
// ---------------------------------------------------------------------------

static void test_truncated_every_prefix(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 33);
    tqkv_batch *b = sample_batch(&r, TQKV_TQ4, TQKV_TQ3, 4, 2, 5);
    blob x = blob_batch(b);
    for (size_t n = 0; n < x.n; n++) {
        uint8_t *cp = malloc(n ? n : 1); /* exact-size copy so ASan sees any overread */
        memcpy(cp, x.p, n);
        expect_batch_restore_fails(n ? cp : NULL, n, TQKV_ECORRUPT, NULL);
        tqkv_cache *c = (tqkv_cache *)0x1;
        assert_int_equal(tqkv_cache_restore(&c, cp, n), TQKV_ECORRUPT);
        assert_ptr_equal(c, (tqkv_cache *)0x1);
        free(cp);
    }
    blob_free(&x);
    tqkv_batch_free(b);
}

static void test_corrupted_every_byte(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 34);
    tqkv_batch *b = sample_batch(&r, TQKV_TQ3, TQKV_Q8, 4, 2, 5);
    blob x = blob_batch(b);
    uint8_t *cp = malloc(x.n);
    for (size_t i = 0; i < x.n; i++) {
        memcpy(cp, x.p, x.n);
        cp[i] ^= (uint8_t)rng_int(&r, 1, 255);
        expect_batch_restore_fails(cp, x.n, TQKV_ECORRUPT, NULL);
    }
    free(cp);
    blob_free(&x);
    tqkv_batch_free(b);
}

static void test_version_and_magic(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 35);
    tqkv_batch *b = sample_batch(&r, TQKV_TQ4, TQKV_TQ4, 0, 2, 6);
    blob x = blob_batch(b);
    assert_memory_equal(x.p, "TQKV", 4);
    assert_int_equal(get32(x.p + AT_VERSION), 1);
    uint8_t *cp = malloc(x.n);
    memcpy(cp, x.p, x.n);
    put32(cp + AT_VERSION, 2);
    fix_crc(cp, x.n);
    expect_batch_restore_fails(cp, x.n, TQKV_ECORRUPT, "version");
    memcpy(cp, x.p, x.n);
    cp[0] = 'X';
    fix_crc(cp, x.n);
    expect_batch_restore_fails(cp, x.n, TQKV_ECORRUPT, "magic");
    memcpy(cp, x.p, x.n);
    cp[x.n - 1] ^= 0x40;
    expect_batch_restore_fails(cp, x.n, TQKV_ECORRUPT, "checksum");
    free(cp);
    blob_free(&x);
    tqkv_batch_free(b);
}

/* Crafted states with a valid checksum: the parser itself must catch them. */
static void test_crafted_states(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed() ^ 36);
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ3, 1, 32, 4, 2, 3);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &cfg, 2), TQKV_OK);
    float *k = rand_floats(&r, 2 * 6 * 32), *v = rand_floats(&r, 2 * 6 * 32);
    assert_int_equal(tqkv_batch_append(b, k, v, 6), TQKV_OK);
    blob x = blob_batch(b);
    size_t n = x.n;
    uint8_t *cp = malloc(n + 64);
#define EDIT(stmt, want, needle)                                                               \
    do {                                                                                       \
        memcpy(cp, x.p, n);                                                                    \
        stmt;                                                                                  \
        fix_crc(cp, n);                                                                        \
        expect_batch_restore_fails(cp, n, want, needle);                                       \
    } while (0)
    assert_int_equal(get32(x.p + AT_ROWS), 2);
    EDIT(put32(cp + AT_ROWS + 4, 7), TQKV_ECORRUPT, NULL);          /* offset: sizes disagree */
    EDIT(put32(cp + AT_ROWS + 8, (uint32_t)-1), TQKV_ECORRUPT, "left_pad"); /* negative pad */
    EDIT(put32(cp + AT_ROWS + 12, 0), TQKV_ECORRUPT, "window");     /* win_lo < offset - window */
    EDIT(put32(cp + AT_ROWS + 12, 7), TQKV_ECORRUPT, "window");     /* win_lo > offset */
    EDIT(put32(cp + AT_ROWS, 3), TQKV_ECORRUPT, "rows");            /* row count vs length */
    EDIT(put32(cp + AT_ROWS, 0x7fffffff), TQKV_ECORRUPT, "rows");
    EDIT(put32(cp + AT_KFMT, 99), TQKV_ECORRUPT, "format");
    EDIT(put32(cp + AT_DIM, 48), TQKV_ECORRUPT, "head_dim");
    EDIT(put32(cp + AT_HEADS, 0), TQKV_ECORRUPT, "kv_heads");
    EDIT(put32(cp + AT_HEADS, 2), TQKV_ECORRUPT, NULL);             /* plane sizes disagree */
    EDIT(put32(cp + AT_WINDOW, 0), TQKV_ECORRUPT, NULL);            /* window section unexpected */
    EDIT(put32(cp + AT_CONF + 4, 67), TQKV_ECORRUPT, NULL);         /* config length */
    EDIT(put32(cp + AT_CONF + 8, 1), TQKV_ECORRUPT, NULL);          /* length high bits: huge */
    EDIT(put32(cp + AT_KIND, 5), TQKV_ECORRUPT, "kind");
    EDIT(put32(cp + AT_ROWS_SEC, 1), TQKV_ECORRUPT, "duplicate");   /* rows tag -> config */
    EDIT(put32(cp + AT_ROWS_SEC, 9), TQKV_ECORRUPT, "unknown required section");
    EDIT(put32(cp + AT_KIND, 1), TQKV_EINVAL, "single");            /* kind: single */
    /* an unknown optional section (tag bit 31) is skipped; an unknown required one is not */
    for (int opt = 0; opt < 2; opt++) {
        size_t m = n + 12 + 5;
        uint8_t *big = malloc(m);
        memcpy(big, x.p, n - 4);
        uint8_t *sec = big + n - 4;
        put32(sec, opt ? 0x80000077u : 0x77u);
        put32(sec + 4, 5);
        put32(sec + 8, 0);
        memset(sec + 12, 0xab, 5);
        fix_crc(big, m);
        tqkv_batch *b2 = NULL;
        if (opt) {
            assert_int_equal(tqkv_batch_restore(&b2, big, m), TQKV_OK);
            blob y = blob_batch(b2);
            assert_true(blob_eq(x, y)); /* re-export drops what it does not know */
            blob_free(&y);
            tqkv_batch_free(b2);
        } else {
            expect_batch_restore_fails(big, m, TQKV_ECORRUPT, "unknown required section");
        }
        free(big);
    }
    /* absurd padding (consistent sizes): refused before allocating */
    {
        tqkv_cache_config c2 = cfg_make(TQKV_F32, TQKV_F32, 1, 32, 0, 0, 0);
        tqkv_batch *e = NULL;
        assert_int_equal(tqkv_batch_init(&e, &c2, 1), TQKV_OK);
        blob y = blob_batch(e);
        put32(y.p + AT_ROWS + 8, 1u << 29);
        fix_crc(y.p, y.n);
        expect_batch_restore_fails(y.p, y.n, TQKV_EUNSUPPORTED, "refusing");
        blob_free(&y);
        tqkv_batch_free(e);
    }
    /* a single-cache state with padding: refused by the single reader */
    {
        tqkv_cache *sc = NULL;
        assert_int_equal(tqkv_batch_extract(b, 1, &sc), TQKV_OK);
        blob y = blob_cache(sc);
        assert_int_equal(get32(y.p + AT_ROWS), 1);
        put32(y.p + AT_ROWS + 8, 1);
        fix_crc(y.p, y.n);
        tqkv_cache *c2 = (tqkv_cache *)0x1;
        tqkv_clear_error();
        assert_int_equal(tqkv_cache_restore(&c2, y.p, y.n), TQKV_ECORRUPT);
        assert_non_null(strstr(tqkv_last_error(), "no padding"));
        assert_ptr_equal(c2, (tqkv_cache *)0x1);
        blob_free(&y);
        tqkv_cache_free(sc);
    }
    /* arguments */
    tqkv_batch *b3 = NULL;
    assert_int_equal(tqkv_batch_restore(NULL, x.p, n), TQKV_EINVAL);
    assert_int_equal(tqkv_batch_restore(&b3, NULL, 10), TQKV_EINVAL);
#undef EDIT
    free(cp);
    free(k);
    free(v);
    blob_free(&x);
    tqkv_batch_free(b);
}

static void test_export_refuses_transient_state(void **state) {
    (void)state;
    tqkv_cache_config cfg = cfg_make(TQKV_TQ4, TQKV_TQ3, 1, 32, 0, 0, 3);
    tqkv_batch *b = NULL;
    assert_int_equal(tqkv_batch_init(&b, &cfg, 2), TQKV_OK);
    uint8_t *p = NULL;
    size_t n = 0;
    int lens[2] = {2, 3};
    assert_int_equal(tqkv_batch_prepare_prefill(b, lens), TQKV_OK);
    tqkv_clear_error();
    assert_int_equal(tqkv_batch_export(b, &p, &n), TQKV_ESTATE);
    assert_true(tqkv_last_error()[0] != 0);
    assert_null(p);
    float kv[2 * 3 * 32] = {0};
    assert_int_equal(tqkv_batch_append(b, kv, kv, 3), TQKV_OK);
    assert_int_equal(tqkv_batch_finalize_prefill(b), TQKV_OK);
    assert_int_equal(tqkv_batch_spec_begin(b), TQKV_OK);
    assert_int_equal(tqkv_batch_export(b, &p, &n), TQKV_ESTATE);
    assert_int_equal(tqkv_batch_spec_commit(b), TQKV_OK);
    assert_int_equal(tqkv_batch_export(b, &p, &n), TQKV_OK);
    free(p);
    tqkv_batch_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_roundtrip),
        cmocka_unit_test(test_single_roundtrip),
        cmocka_unit_test(test_truncated_every_prefix),
        cmocka_unit_test(test_corrupted_every_byte),
        cmocka_unit_test(test_version_and_magic),
        cmocka_unit_test(test_crafted_states),
        cmocka_unit_test(test_export_refuses_transient_state),
    };
    test_seed();
    return cmocka_run_group_tests(tests, NULL, NULL);
}

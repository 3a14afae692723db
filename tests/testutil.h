/*
 * testutil.h - helpers shared by the tests: cmocka includes, a seeded RNG that is fresh
 * per run (printed so a failure can be replayed with TQKV_TEST_SEED), float64 error
 * measures, the location of ../shared fixtures, and the bundled model.
 */
#ifndef TQKV_TESTUTIL_H
#define TQKV_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "tqkv.h"

/* ---- skips that ctest sees ----
 * cmocka counts a skipped case as passed and exits 0. Every test file calls skip() and
 * cmocka_run_group_tests() through these wrappers (testutil.h redefines both): skip()
 * is counted, and a group whose cases ALL skipped makes main() return 77, which ctest
 * (SKIP_RETURN_CODE 77) reports as "Skipped" instead of "Passed". */
#define TEST_EXIT_SKIPPED 77
void test_skip_(const char *file, int line);
int  test_run_group_(const char *name, const struct CMUnitTest *tests, size_t n,
                     CMFixtureFunction setup, CMFixtureFunction teardown);
#undef skip
#define skip() test_skip_(__FILE__, __LINE__)
#undef cmocka_run_group_tests
#define cmocka_run_group_tests(group_tests, group_setup, group_teardown)                    \
    test_run_group_(#group_tests, group_tests, sizeof(group_tests) / sizeof((group_tests)[0]), \
                    group_setup, group_teardown)

typedef struct { uint64_t s; } test_rng;

/* Seed from TQKV_TEST_SEED or the clock; prints "seed=N" once per process. */
uint64_t test_seed(void);
void     rng_init(test_rng *r, uint64_t seed);
uint64_t rng_u64(test_rng *r);
double   rng_uniform(test_rng *r);          /* [0, 1) */
double   rng_normal(test_rng *r);
int      rng_int(test_rng *r, int lo, int hi); /* [lo, hi] */
void     rng_fill_normal(test_rng *r, float *x, size_t n, float sd);

/* ||a - b|| / ||b|| in float64. */
double rel_l2(const float *a, const float *b, size_t n);
double rel_l2_d(const float *a, const double *b, size_t n);

/* Absolute path of a fixture under ../shared, or NULL if ../shared is absent
 * (TQKV_SHARED overrides). Returned string is static per call site buffer. */
const char *shared_path(const char *rel, char *buf, size_t cap);
/* Path of a file in the source tree. */
const char *source_path(const char *rel, char *buf, size_t cap);
/* The bundled model's folder (models/qwen3-code-28m) in md [cap], or skip() when it is
 * absent. */
const char *test_bundled_dir(char *md, size_t cap);
/* The bundled model loaded (its folder in md [cap]; the caller frees it with
 * tqkv_model_free), or skip() when it is absent. */
struct tqkv_model *test_load_bundled(char *md, size_t cap);
/* Run `'exe' args` through the shell (stderr discarded): its last stdout line in out [cap]
 * (empty if none), its exit status (-1 when it did not exit normally). */
int test_run_last_line(const char *exe, const char *args, char *out, size_t cap);

#endif

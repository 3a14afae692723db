#include "testutil.h"
#include "tqkv_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

// ---- skips ----------------------------------------------------------------

static int g_skipped; /* skip() calls in this process (cases run one after another) */

void test_skip_(const char *file, int line) {
    g_skipped++;
    _skip(file, line); /* does not return: cmocka jumps out of the case */
}

int test_run_group_(const char *name, const struct CMUnitTest *tests, size_t n,
                    CMFixtureFunction setup, CMFixtureFunction teardown) {
    g_skipped = 0;
    int failed = _cmocka_run_group_tests(name, tests, n, setup, teardown);
    if (failed != 0) return failed;
    if (n > 0 && (size_t)g_skipped >= n) {
        fprintf(stderr, "[test] %s: all %zu cases skipped (fixture absent) -> exit %d\n", name,
                n, TEST_EXIT_SKIPPED);
        return TEST_EXIT_SKIPPED;
    }
    return 0;
}

// ---- seed and random numbers -------------------------------------------------

uint64_t test_seed(void) {
    static uint64_t seed;
    static int done;
    if (!done) {
        const char *e = getenv("TQKV_TEST_SEED");
        if (e) {
            seed = strtoull(e, NULL, 10);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            seed = (uint64_t)ts.tv_sec * 1000003u ^ (uint64_t)ts.tv_nsec;
        }
        fprintf(stderr, "[test] seed=%llu (replay with TQKV_TEST_SEED)\n",
                (unsigned long long)seed);
        done = 1;
    }
    return seed;
}

void rng_init(test_rng *r, uint64_t seed) { r->s = seed * 0x9E3779B97F4A7C15ull + 1; }

uint64_t rng_u64(test_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double rng_uniform(test_rng *r) { return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

double rng_normal(test_rng *r) {
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int rng_int(test_rng *r, int lo, int hi) {
    return lo + (int)(rng_u64(r) % (uint64_t)(hi - lo + 1));
}

void rng_fill_normal(test_rng *r, float *x, size_t n, float sd) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(rng_normal(r) * sd);
}

double rel_l2(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    if (den == 0) return sqrt(num);
    return sqrt(num / den);
}

double rel_l2_d(const float *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    if (den == 0) return sqrt(num);
    return sqrt(num / den);
}

// ---- fixtures and the bundled model ----------------------------------------

const char *shared_path(const char *rel, char *buf, size_t cap) {
    const char *root = getenv("TQKV_SHARED");
    if (!root) root = TQKV_SHARED_DIR;
    snprintf(buf, cap, "%s/%s", root, rel);
    struct stat st;
    if (stat(buf, &st) != 0) return NULL;
    return buf;
}

const char *source_path(const char *rel, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", TQKV_SOURCE_DIR, rel);
    return buf;
}

const char *test_bundled_dir(char *md, size_t cap) {
    source_path("models/qwen3-code-28m", md, cap);
    struct stat st;
    if (stat(md, &st) != 0) skip();
    return md;
}

/* A model that is there but does not load fails the case. */
tqkv_model *test_load_bundled(char *md, size_t cap) {
    test_bundled_dir(md, cap);
    tqkv_model *m = NULL;
    assert_int_equal(tqkv_model_load(&m, md, NULL), TQKV_OK);
    return m;
}

int test_run_last_line(const char *exe, const char *args, char *out, size_t cap) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>/dev/null", exe, args);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    static char line[1 << 16];
    out[0] = 0;
    while (fgets(line, sizeof line, f)) snprintf(out, cap, "%s", line);
    const int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

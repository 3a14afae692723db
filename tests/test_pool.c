/*
 * test_pool.c - the compute pool (src/util/pool.c): every item runs exactly once, on a
 * slot below nth, and its writes are visible when pool_for returns; also with several
 * callers at once (the OpenMP fallback), loops inside items, and workers that sleep
 * between loops (spin budget 0) or spin (the budget picked at random, printed); and the
 * neighbour watch: its verdict rule, and a team that goes solo beside busy threads.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"
#include "util/pool.h"

typedef struct {
    _Atomic int *count;   // [n] times item i ran
    int *value;           // [n] written by item i (plain stores: visibility check)
    _Atomic int bad_slot; // items that saw slot >= nth
    int nth;
    int slow;             // spin a little per item so that workers take some
} loop_ctx;

static void item_count(void *arg, size_t i, int slot) {
    loop_ctx *c = arg;
    if (slot < 0 || slot >= c->nth) atomic_fetch_add(&c->bad_slot, 1);
    atomic_fetch_add(&c->count[i], 1);
    volatile unsigned x = 0;
    for (int k = 0; k < c->slow; k++) x += (unsigned)k;
    c->value[i] = (int)(i * 7 + 3);
}

/* One loop of n items on nth threads, checked; returns the number of failures. */
static int run_checked(size_t n, int nth, int slow) {
    loop_ctx c = {calloc(n ? n : 1, sizeof(_Atomic int)), calloc(n ? n : 1, sizeof(int)), 0, nth, slow};
    pool_for(nth, n, item_count, &c);
    int fail = atomic_load(&c.bad_slot) ? 1 : 0;
    for (size_t i = 0; i < n; i++)
        if (atomic_load(&c.count[i]) != 1 || c.value[i] != (int)(i * 7 + 3)) fail++;
    free((void *)c.count);
    free(c.value);
    return fail;
}

static void test_each_item_once(void **state) {
    (void)state;
    test_rng r;
    rng_init(&r, test_seed());
    for (int t = 0; t < 400; t++) {
        size_t n = (size_t)(rng_u64(&r) % 3000);
        if (t % 5 == 0) n = rng_u64(&r) % 4; /* 0 .. 3 items */
        int nth = 1 + (int)(rng_u64(&r) % 8);
        int fail = run_checked(n, nth, (int)(rng_u64(&r) % 200));
        if (fail) fprintf(stderr, "loop %d: n=%zu nth=%d: %d items wrong\n", t, n, nth, fail);
        assert_int_equal(fail, 0);
    }
}

/* Several threads call pool_for at once: one owns the team, the others run their loops
 * through OpenMP; every loop still runs each item once. */
static void *caller_main(void *arg) {
    int *fail = arg;
    for (int t = 0; t < 60; t++) *fail += run_checked(500 + (size_t)t * 13, 2 + t % 3, 50);
    return NULL;
}

static void test_concurrent_callers(void **state) {
    (void)state;
    enum { NC = 4 };
    pthread_t th[NC];
    int fail[NC] = {0};
    for (int i = 0; i < NC; i++) assert_int_equal(pthread_create(&th[i], NULL, caller_main, &fail[i]), 0);
    for (int i = 0; i < NC; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < NC; i++) assert_int_equal(fail[i], 0);
}

/* An item that runs a loop of its own (the team is busy with the outer one). */
typedef struct {
    _Atomic int inner_fail;
} nest_ctx;

static void item_nested(void *arg, size_t i, int slot) {
    (void)slot;
    nest_ctx *c = arg;
    atomic_fetch_add(&c->inner_fail, run_checked(100 + i, 2, 10));
}

static void test_nested(void **state) {
    (void)state;
    nest_ctx c = {0};
    pool_for(2, 24, item_nested, &c);
    assert_int_equal(atomic_load(&c.inner_fail), 0);
}

/* Loops far apart in time: the workers have gone to sleep on the futex in between. */
static void test_after_sleep(void **state) {
    (void)state;
    for (int t = 0; t < 5; t++) {
        usleep((useconds_t)(2 * pool_spin_ns() / 1000 + 2000));
        assert_int_equal(run_checked(2000, 2, 100), 0);
    }
}

/* The rule: two windows in a row crowded (9 of 10) with the caller waiting >= 30% go solo;
 * solo holds while the windows stay crowded. */
static void test_watch_rule(void **state) {
    (void)state;
    int hot = 0;
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 40), 0); /* one window is not enough */
    assert_int_equal(pool_watch_next(0, &hot, 9, 10, 30), 1);  /* the second in a row */
    assert_int_equal(pool_watch_next(1, &hot, 10, 10, 0), 1);  /* solo: no contention felt */
    assert_int_equal(pool_watch_next(1, &hot, 8, 10, 0), 0);   /* the neighbour left */
    hot = 0;
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 45), 0);
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 29), 0); /* the row breaks */
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 45), 0);
    assert_int_equal(pool_watch_next(0, &hot, 8, 10, 45), 0);  /* not crowded enough */
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 45), 0);
    assert_int_equal(pool_watch_next(0, &hot, 10, 10, 45), 1);
    hot = 0;
    assert_int_equal(pool_watch_next(0, &hot, 0, 0, 90), 0);   /* no samples */
    assert_int_equal(pool_watch_next(0, &hot, 0, 0, 90), 0);
}

static _Atomic int g_spin_on;

static void *busy_main(void *unused) {
    (void)unused;
    volatile unsigned x = 0;
    while (atomic_load_explicit(&g_spin_on, memory_order_relaxed)) x++;
    return NULL;
}

static double secs(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Twice as many busy threads as CPUs (never asleep, not the team's; the caller then waits
 * about half the time whatever the CPU count): within 5 s of loops the watch says solo, and
 * the loops still run every item once. */
static void test_watch_busy(void **state) {
    (void)state;
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    const char *e = getenv("TQKV_POOL_WATCH");
    if (access("/proc/loadavg", R_OK) != 0 || access("/proc/thread-self/schedstat", R_OK) != 0 ||
        (e && !strcmp(e, "0")) || ncpu < 1 || ncpu > 16) {
        printf("neighbour watch: skipped (no /proc/loadavg or schedstat, TQKV_POOL_WATCH=0, or "
               "%ld CPUs)\n", ncpu);
        skip();
    }
    pthread_t th[32];
    const long nb = 2 * ncpu;
    atomic_store(&g_spin_on, 1);
    for (long i = 0; i < nb; i++) assert_int_equal(pthread_create(&th[i], NULL, busy_main, NULL), 0);
    const double t0 = secs();
    int fail = 0;
    while (!pool_solo() && secs() - t0 < 5.0) fail += run_checked(500, 2, 20);
    const double took = secs() - t0;
    const int solo = pool_solo();
    for (int t = 0; t < 20; t++) fail += run_checked(500, 2, 20); /* solo loops */
    atomic_store(&g_spin_on, 0);
    for (long i = 0; i < nb; i++) pthread_join(th[i], NULL);
    printf("neighbour watch: %ld busy threads on %ld CPUs, solo after %.0f ms\n", nb, ncpu, 1e3 * took);
    assert_int_equal(fail, 0);
    if (!solo) fail_msg("the watch did not go solo within 5 s beside %ld busy threads", nb);
}

int main(void) {
    /* the budget is read once, at the team's first loop: pick one per run */
    uint64_t seed = test_seed();
    static const char *spins[] = {"0", "5", "50"};
    const char *spin = getenv("TQKV_SPIN_US");
    if (!spin) setenv("TQKV_SPIN_US", spin = spins[seed % 3], 1);
    printf("TQKV_SPIN_US=%s\n", spin);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_each_item_once),
        cmocka_unit_test(test_concurrent_callers),
        cmocka_unit_test(test_nested),
        cmocka_unit_test(test_after_sleep),
        cmocka_unit_test(test_watch_rule),
        cmocka_unit_test(test_watch_busy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

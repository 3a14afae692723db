/*
 * pool.c - the compute threads (see pool.h).
 * Owns: the team (workers created on first need, never stopped), the current loop, the
 * spin-then-futex waits.
 * Must not: block a caller forever when a worker cannot start (the caller claims every
 * item a worker has not taken and only waits for items already taken).
 *
 * Protocol. The caller owns the team by `lock` (trylock; a second caller goes to OpenMP).
 * It writes the loop (fn, arg, n, nth), resets `next`, opens `state` (OPEN, no workers
 * in), bumps `gen` and wakes sleeping workers. A worker that sees `gen` move enters by a
 * CAS on `state` that succeeds only while OPEN (so it reads the loop only while the caller
 * cannot change it), claims items from `next` until none is left, and leaves (decrements
 * `state`). The caller claims items too; when none is left it closes `state` and waits
 * until no worker is inside. A worker that wakes late finds `state` closed and goes back
 * to waiting: it never touches a finished loop.
 */
#include "util/pool.h"

#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define POOL_FUTEX 1
#else
#define POOL_FUTEX 0
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define POOL_MAX 64          /* threads in a team, the caller included */
#define WATCH_NS 20000000L   /* the neighbour watch samples every 20 ms ... */
#define WATCH_N 10           /* ... and decides every 10 samples (200 ms) */
#define WATCH_DELAY_PCT 30   /* a window the caller waited to run this much of: contended */
#define WATCH_HOT 2          /* windows in a row that go solo */
#define POOL_OPEN 0x80000000u /* state: workers may enter; low bits: workers inside */

/* The neighbour watch (pool.h). */
typedef struct {
    int  fd;      // /proc/loadavg, or -1: the watch is off
    int  ncpu;    // CPUs the process may run on
    long next_ns; // the next sample
    long t0;      // the window's start
    long delay0;  // the caller's run delay (ns) then, or -1
    int  tid;     // the caller then
    int  samples; // in this window
    int  crowded; // of which crowded
    int  hot;     // windows in a row that said "a neighbour" while the team ran
    _Atomic int solo; // loops on the caller alone (written under the lock, read by pool_solo)
} pool_watch;

typedef struct {
    pthread_mutex_t lock;                 // one caller at a time
    pthread_once_t once;
    int nworkers;                         // started so far (slots 1..nworkers)
    _Atomic uint32_t gen;                 // bumped per loop: the workers' wake word
    _Atomic uint32_t state;               // POOL_OPEN | workers inside
    _Atomic int sleepers;                 // workers asleep on gen
    _Atomic int caller_asleep;            // the caller asleep on state
    _Atomic size_t next;                  // the next unclaimed item
    _Atomic int slots;                    // slots handed out in this loop (the caller is 0)
    pool_item_fn fn;                      // the loop: written before OPEN, read inside
    void *arg;
    size_t n;
    int nth;
    long spin_ns;
    pool_watch watch;                     // the caller's (under lock)
} pool_team;

static pool_team T = {.lock = PTHREAD_MUTEX_INITIALIZER, .once = PTHREAD_ONCE_INIT};

// ---------------------------------------------------------------------------
// waits: spin for the budget, then sleep on the word
// ---------------------------------------------------------------------------

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

#if POOL_FUTEX
static void futex_wait(_Atomic uint32_t *w, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *w, int count) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}
#endif

/* Spins while (*w & mask) == val (want 1) or != val (want 0), at most the budget; returns
 * the last value read. */
static uint32_t spin_while(_Atomic uint32_t *w, uint32_t mask, uint32_t val, int want) {
    uint32_t v = atomic_load_explicit(w, memory_order_acquire);
    if (((v & mask) == val) != want || T.spin_ns <= 0) return v;
    const long end = now_ns() + T.spin_ns;
    for (unsigned i = 1;; i++) {
        cpu_relax();
        v = atomic_load_explicit(w, memory_order_acquire);
        if (((v & mask) == val) != want) return v;
        if ((i & 63) == 0 && now_ns() > end) return v;
    }
}

long pool_spin_ns(void) {
    const char *e = getenv("TQKV_SPIN_US");
    long us = e && *e ? strtol(e, NULL, 10) : 50;
    return us < 0 ? 0 : us > 100000 ? 100000000L : us * 1000L;
}

// ---------------------------------------------------------------------------
// the loop's items, run by the caller and the workers alike
// ---------------------------------------------------------------------------

static void run_items(int slot) {
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&T.next, 1, memory_order_relaxed);
        if (i >= T.n) return;
        T.fn(T.arg, i, slot);
    }
}

/* Enters the open loop (1) or finds it closed (0). */
static int worker_enter(void) {
    uint32_t s = atomic_load_explicit(&T.state, memory_order_relaxed);
    while (s & POOL_OPEN)
        if (atomic_compare_exchange_weak_explicit(&T.state, &s, s + 1, memory_order_acquire,
                                                  memory_order_relaxed))
            return 1;
    return 0;
}

static void worker_leave(void) {
    uint32_t s = atomic_fetch_sub_explicit(&T.state, 1, memory_order_seq_cst) - 1;
#if POOL_FUTEX
    if (s == 0 && atomic_load_explicit(&T.caller_asleep, memory_order_seq_cst))
        futex_wake(&T.state, 1);
#else
    (void)s;
#endif
}

static void *worker_main(void *unused) {
    (void)unused;
    uint32_t seen = atomic_load_explicit(&T.gen, memory_order_acquire);
    for (;;) {
        uint32_t g = spin_while(&T.gen, 0xffffffffu, seen, 1);
#if POOL_FUTEX
        while (g == seen) {
            atomic_fetch_add_explicit(&T.sleepers, 1, memory_order_seq_cst);
            if (atomic_load_explicit(&T.gen, memory_order_seq_cst) == seen) futex_wait(&T.gen, seen);
            atomic_fetch_sub_explicit(&T.sleepers, 1, memory_order_seq_cst);
            g = atomic_load_explicit(&T.gen, memory_order_acquire);
        }
#endif
        seen = g;
        if (!worker_enter()) continue;
        /* inside: the loop cannot change until we leave */
        const int slot = atomic_fetch_add_explicit(&T.slots, 1, memory_order_relaxed);
        if (slot < T.nth) run_items(slot);
        worker_leave();
    }
    return NULL;
}

// ---------------------------------------------------------------------------
// the neighbour watch
// ---------------------------------------------------------------------------

int pool_watch_next(int solo, int *hot, int crowded, int samples, int delay_pct) {
    const int full = samples > 0 && 10 * crowded >= 9 * samples; /* others nearly always */
    if (solo) {
        *hot = 0;
        return full;
    }
    *hot = full && delay_pct >= WATCH_DELAY_PCT ? *hot + 1 : 0;
    return *hot >= WATCH_HOT;
}

#if POOL_FUTEX /* Linux: /proc/loadavg, schedstat, the affinity mask */

/* The number after the skip-th space of the file (pread from 0), or -1. */
static long read_field(int fd, int skip) {
    char b[128];
    const ssize_t n = fd < 0 ? -1 : pread(fd, b, sizeof b - 1, 0);
    if (n <= 0) return -1;
    b[n] = 0;
    const char *p = b;
    for (int f = 0; f < skip && p; f++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p ? strtol(p, NULL, 10) : -1;
}

/* The CPUs this process may run on. */
static int watch_cpus(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    return (int)sysconf(_SC_NPROCESSORS_ONLN);
}

static void watch_init(pool_watch *w) {
    const char *e = getenv("TQKV_POOL_WATCH");
    w->ncpu = watch_cpus();
    w->delay0 = -1;
    w->fd = (e && !strcmp(e, "0")) || w->ncpu < 1 ? -1 : open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
}

/* The window's end: the caller's run delay over it (its schedstat: "cpu_ns delay_ns
 * slices"; none when another thread called last time), the next verdict. */
static void watch_window(pool_watch *w, long now) {
    const int tid = (int)syscall(SYS_gettid), fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    const long d = read_field(fd, 1);
    if (fd >= 0) close(fd);
    const int pct = d >= 0 && w->delay0 >= 0 && tid == w->tid && now > w->t0
                        ? (int)(100 * (d - w->delay0) / (now - w->t0)) : 0;
    w->delay0 = d, w->t0 = now, w->tid = tid;
    const int solo = atomic_load_explicit(&w->solo, memory_order_relaxed);
    atomic_store_explicit(&w->solo, pool_watch_next(solo, &w->hot, w->crowded, w->samples, pct),
                          memory_order_relaxed);
    w->samples = w->crowded = 0;
}

/* Whether a loop of nth threads runs on the caller alone: a sample every WATCH_NS (the
 * runnable threads less the caller and the workers awake: others), a verdict every WATCH_N
 * samples. A sample is crowded when others and the team want more CPUs than there are; the
 * team counts as nth, but while solo as the smallest team to go back to (2), so two
 * processes solo beside each other on a larger machine do not keep each other there. */
static int watch_solo(pool_watch *w, int nth) {
    const int solo = atomic_load_explicit(&w->solo, memory_order_relaxed);
    if (w->fd < 0) return 0;
    const long now = now_ns();
    if (now < w->next_ns) return solo;
    w->next_ns = now + WATCH_NS;
    const long run = read_field(w->fd, 3); /* "0.50 0.40 0.30 3/412 999" */
    if (run < 0) return solo;
    const int awake = T.nworkers - atomic_load_explicit(&T.sleepers, memory_order_relaxed);
    const int others = (int)run - 1 - (awake > 0 ? awake : 0);
    int team = solo ? 2 : nth;
    team = team < w->ncpu ? team : w->ncpu;
    w->crowded += others + team > w->ncpu;
    if (++w->samples == WATCH_N) watch_window(w, now);
    return atomic_load_explicit(&w->solo, memory_order_relaxed);
}

#else /* no /proc: the watch is off */
static void watch_init(pool_watch *w) { w->fd = -1; }
static int  watch_solo(pool_watch *w, int nth) {
    (void)w, (void)nth;
    return 0;
}
#endif

int pool_solo(void) { return atomic_load_explicit(&T.watch.solo, memory_order_relaxed); }

// ---------------------------------------------------------------------------
// the caller
// ---------------------------------------------------------------------------

static void team_init(void) {
    T.spin_ns = pool_spin_ns();
    watch_init(&T.watch);
}

/* Starts workers up to want (slots 1..want); returns how many run. */
static int team_grow(int want) {
    if (want > POOL_MAX - 1) want = POOL_MAX - 1;
    while (T.nworkers < want) {
        pthread_t th;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &a, worker_main, NULL);
        pthread_attr_destroy(&a);
        if (rc) break; /* fewer workers: the caller does more items */
        T.nworkers++;
    }
    return T.nworkers;
}

static void caller_wait_empty(void) {
    uint32_t s = spin_while(&T.state, ~POOL_OPEN, 0, 0);
#if POOL_FUTEX
    while (s & ~POOL_OPEN) {
        atomic_store_explicit(&T.caller_asleep, 1, memory_order_seq_cst);
        s = atomic_load_explicit(&T.state, memory_order_seq_cst);
        if (s & ~POOL_OPEN) futex_wait(&T.state, s);
        atomic_store_explicit(&T.caller_asleep, 0, memory_order_seq_cst);
        s = atomic_load_explicit(&T.state, memory_order_acquire);
    }
#else
    while (s & ~POOL_OPEN) s = atomic_load_explicit(&T.state, memory_order_acquire);
#endif
}

static void run_serial(size_t n, pool_item_fn fn, void *arg) {
    for (size_t i = 0; i < n; i++) fn(arg, i, 0);
}

static void run_omp(int nth, size_t n, pool_item_fn fn, void *arg) {
    _Atomic size_t next = 0;
#pragma omp parallel num_threads(nth)
    {
        const int slot = omp_get_thread_num();
        for (size_t i; (i = atomic_fetch_add(&next, 1)) < n;) fn(arg, i, slot);
    }
}

void pool_for(int nth, size_t n, pool_item_fn fn, void *arg) {
    if (n == 0) return;
    if (nth > (int)n) nth = (int)n;
    if (nth <= 1) {
        run_serial(n, fn, arg);
        return;
    }
    if (!POOL_FUTEX || nth > POOL_MAX || pthread_mutex_trylock(&T.lock) != 0) {
        run_omp(nth, n, fn, arg);
        return;
    }
    pthread_once(&T.once, team_init);
    if (watch_solo(&T.watch, nth)) { /* a neighbour keeps a core: joins would wait on it */
        pthread_mutex_unlock(&T.lock);
        run_serial(n, fn, arg);
        return;
    }
    if (team_grow(nth - 1) < 1) {
        pthread_mutex_unlock(&T.lock);
        run_omp(nth, n, fn, arg);
        return;
    }
    T.fn = fn;
    T.arg = arg;
    T.n = n;
    T.nth = nth;
    atomic_store_explicit(&T.next, 0, memory_order_relaxed);
    atomic_store_explicit(&T.slots, 1, memory_order_relaxed);
    atomic_store_explicit(&T.state, POOL_OPEN, memory_order_release);
    atomic_fetch_add_explicit(&T.gen, 1, memory_order_seq_cst);
#if POOL_FUTEX
    if (atomic_load_explicit(&T.sleepers, memory_order_seq_cst) > 0) futex_wake(&T.gen, nth - 1);
#endif
    run_items(0);
    atomic_fetch_and_explicit(&T.state, ~POOL_OPEN, memory_order_seq_cst);
    caller_wait_empty();
    pthread_mutex_unlock(&T.lock);
}

// ---------------------------------------------------------------------------
// blocks of small items
// ---------------------------------------------------------------------------

typedef struct {
    pool_index_fn fn;
    void *arg;
    size_t n, per;
} each_job;

static void each_block(void *arg, size_t b, int slot) {
    (void)slot;
    const each_job *j = arg;
    const size_t a = b * j->per, e = a + j->per < j->n ? a + j->per : j->n;
    for (size_t i = a; i < e; i++) j->fn(j->arg, i);
}

void pool_for_each(int nth, size_t n, size_t min_n, pool_index_fn fn, void *arg) {
    if (nth <= 1 || n < min_n || n < 2) {
        for (size_t i = 0; i < n; i++) fn(arg, i);
        return;
    }
    const size_t blocks = (size_t)nth * 4 < n ? (size_t)nth * 4 : n;
    each_job j = {fn, arg, n, (n + blocks - 1) / blocks};
    pool_for(nth, (n + j.per - 1) / j.per, each_block, &j);
}

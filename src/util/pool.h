/*
 * pool.h - the compute threads: a persistent team that runs parallel loops with cheap
 * fork/joins (issue 21: "both cores busy").
 * Owns: one process-wide team of worker threads (per copy of the core: libtqkv-model runs
 * its own, see docs/ARCHITECTURE.md "Libraries"; two teams cost idle threads, nothing
 * else), their wake-up and their waits.
 * Must not: decide which thread runs which item in a way a result may depend on. Callers
 * must make every item's result independent of the thread that runs it (the matmul's
 * and the attention's items are: tiles of fixed shape), so batch and thread invariance
 * hold whatever the machine's load does to the schedule.
 *
 * Why not OpenMP for these loops: a decode step forks and joins about 50 times (every
 * matmul and the attention of every layer). libgomp's passive waits put a worker to
 * sleep after each join and wake it through a futex, tens of microseconds each on a VM
 * (RESULTS.md, "what two threads buy at 16 rows"), which made two threads slower than one
 * at one row; its active waits spin without bound and collapse when another process
 * takes a core. Here a waiting thread spins for a bounded time (TQKV_SPIN_US, default
 * 50 us), then sleeps on a futex; items are claimed one at a time from a shared counter,
 * so a thread the kernel has descheduled holds back at most the item it is running, and
 * the caller does the rest.
 */
#ifndef TQKV_POOL_H
#define TQKV_POOL_H

#include <stddef.h>

/* fn(arg, i, slot) for one item i; slot in [0, nth) names the thread (the caller is 0),
 * for per-thread scratch. */
typedef void (*pool_item_fn)(void *arg, size_t i, int slot);

/* Runs fn for every i in [0, n) exactly once, on up to nth threads including the caller,
 * and returns when all have finished (their writes are then visible to the caller).
 * nth <= 1 or n <= 1 runs everything on the caller. A second caller while the team is
 * busy (another thread's loop, or a loop inside an item) runs its loop through an OpenMP
 * team instead: the same items, the same results. */
void pool_for(int nth, size_t n, pool_item_fn fn, void *arg);

/* fn(arg, i) for every i in [0, n): on the caller alone when n < min_n, else in blocks of
 * consecutive i (about four per thread) over up to nth threads. For loops whose items are
 * too small to claim one at a time (a norm of one token). */
typedef void (*pool_index_fn)(void *arg, size_t i);
void pool_for_each(int nth, size_t n, size_t min_n, pool_index_fn fn, void *arg);

/* The neighbour watch. Beside a process that keeps a core busy, a team of two on two CPUs
 * shares them three ways and its joins wait for a worker the kernel took away: one thread
 * (a whole core) is faster. The caller of a loop samples every 20 ms the machine's
 * runnable threads (/proc/loadavg) less itself and the workers awake ("others"; crowded
 * when they and the team want more CPUs than are online) and, every 10 samples, the share
 * of the window the caller spent runnable but waiting (its schedstat run delay).
 * Two windows in a row with at least 9 of 10 samples crowded and the caller waiting 30%
 * or more: loops run on the caller alone (the same results: items never depend on the
 * thread) while the samples stay at least 9 of 10 crowded (counting the team as 2 then,
 * so two solo processes on a larger machine go back to teams). CPUs: the affinity mask. A client or our own HTTP
 * threads are runnable part of the time and delay the team now and then; a busy neighbour
 * always is, and delays it a third of the time or more (bench/RESULTS.md, "CPU: the
 * neighbour watch"). TQKV_POOL_WATCH=0 turns it off; off without Linux's /proc. */
int pool_solo(void);
/* The rule: the next solo from this one, the windows in a row so far (*hot, updated), the
 * window's crowded samples and the caller's run delay in percent (for tests). */
int pool_watch_next(int solo, int *hot, int crowded, int samples, int delay_pct);

/* The spin budget in nanoseconds before a waiting thread sleeps (TQKV_SPIN_US * 1000 at
 * the first use; 0 = sleep at once). */
long pool_spin_ns(void);

#endif

/*
 * serve_mem.c - memory policy of the `tqkv serve` process (glibc malloc): few arenas,
 * large buffers on their own mappings (returned to the system when freed), and freed
 * memory trimmed after a burst of requests.
 * Owns: the process-wide malloc settings (a program's choice, so not in the library) and
 * the trimmer thread. Must not: allocate on the engine's behalf or change its behaviour.
 *
 * Why: with glibc's defaults a serving process kept 1.2-1.4 GB of freed KV batches in the
 * engine thread's arena (the dynamic mmap threshold rises to 32 MiB after the first large
 * free, so later batches come from the arena and stay there), and every HTTP thread may
 * get an arena of its own. Settings already given through the environment
 * (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) are left alone.
 */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "serve_mem.h"

void serve_mem_policy(void) {
#ifdef __GLIBC__
    if (!getenv("MALLOC_ARENA_MAX")) mallopt(M_ARENA_MAX, 2);
    /* a fixed threshold (setting it turns the dynamic one off) */
    if (!getenv("MALLOC_MMAP_THRESHOLD_")) mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    if (!getenv("MALLOC_TRIM_THRESHOLD_")) mallopt(M_TRIM_THRESHOLD, 8 * 1024 * 1024);
#endif
}

/* ------------------------------------------------------------------------- */
/* Trimmer: malloc_trim once the engine goes idle after work, and every few seconds  */
/* while it works (returns free pages inside the arenas too, not only their tops).    */
/* ------------------------------------------------------------------------- */

struct serve_trimmer {
    tqkv_engine    *e;
    pthread_t       th;
    pthread_mutex_t mu;
    pthread_cond_t  cv;
    int             stop;
};

static void *trimmer_main(void *arg) {
    serve_trimmer *t = arg;
    uint64_t last_tokens = 0;
    int busy_since_trim = 0, ticks = 0;
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 500 * 1000 * 1000; /* 0.5 s */
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&t->cv, &t->mu, &ts);
        if (t->stop) break;
        pthread_mutex_unlock(&t->mu);
        tqkv_engine_stats st;
        if (tqkv_engine_stats_get(t->e, &st) == TQKV_OK) {
            int active = st.running + st.queued > 0 || st.generated_tokens != last_tokens;
            last_tokens = st.generated_tokens;
            busy_since_trim |= active;
            ticks++;
            /* idle after work, or every 5 s of work */
            if (busy_since_trim && (!active || ticks >= 10)) {
#ifdef __GLIBC__
                malloc_trim(0);
#endif
                busy_since_trim = 0;
                ticks = 0;
            }
        }
        pthread_mutex_lock(&t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

serve_trimmer *serve_trimmer_start(tqkv_engine *e) {
    serve_trimmer *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->e = e;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (pthread_create(&t->th, NULL, trimmer_main, t)) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
        return NULL;
    }
    return t;
}

void serve_trimmer_stop(serve_trimmer *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    t->stop = 1;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->th, NULL);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    free(t);
}

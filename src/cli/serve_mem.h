/*
 * serve_mem.h - memory policy of `tqkv serve` (serve_mem.c): malloc settings for a
 * long-running server and a thread that returns freed memory after bursts.
 */
#ifndef TQKV_CLI_SERVE_MEM_H
#define TQKV_CLI_SERVE_MEM_H

#include "tqkv_engine.h"

/* Call first in the process (before threads): glibc malloc settings. */
void serve_mem_policy(void);

typedef struct serve_trimmer serve_trimmer;
/* NULL if the thread cannot start (the server runs without it). */
serve_trimmer *serve_trimmer_start(tqkv_engine *e);
void           serve_trimmer_stop(serve_trimmer *t);

#endif

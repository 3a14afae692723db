/*
 * error.c - the thread's error message behind tqkv_last_error().
 * Owns: the one message slot per thread of the process. It is in libtqkv only; the
 * hidden copy of the core that libtqkv-model carries leaves this file out and calls
 * libtqkv's tqkv_fail, so a model call's message is the one tqkv_last_error() returns.
 * Must not: hold any other state.
 */
#include <stdarg.h>
#include <stdio.h>

#include "tqkv.h"

static _Thread_local char g_err[512];

tqkv_status tqkv_fail(tqkv_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return s;
}

void tqkv_clear_error(void) { g_err[0] = 0; }

const char *tqkv_last_error(void) { return g_err; }

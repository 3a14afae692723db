/*
 * env_switch.h - an on/off switch that an environment variable sets once and a setter
 * (tests, benchmarks) overrides: the kernels' A/B choices (TQKV_MOE_ROUTE_FAST,
 * TQKV_NORM_REGS, TQKV_PICK_SPLIT, ...).
 * Owns: env_switch (the variable's name and the flag: -1 until the first read of the
 * variable), env_switch_get, env_switch_set. Must not: allocate, take a lock, parse anything
 * but "0" (off) and the rest (on).
 *
 * Header only (static inline, GCC's __atomic builtins on an int), so C and CUDA files include
 * it alike. A race of two first reads reads the same variable and stores the same value.
 */
#ifndef TQKV_ENV_SWITCH_H
#define TQKV_ENV_SWITCH_H

#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name; /* the environment variable: unset or anything but "0" is on */
    int flag;         /* -1: not read yet; 0 off; 1 on (atomic, relaxed) */
} env_switch;

/* A switch named `var`, read at its first use: static env_switch g = ENV_SWITCH("TQKV_X"); */
#define ENV_SWITCH(var) {var, -1}

/* 1 on, 0 off: the setter's choice, else the environment's (read once, then kept). */
static inline int env_switch_get(env_switch *sw) {
    int on = __atomic_load_n(&sw->flag, __ATOMIC_RELAXED);
    if (on < 0) {
        const char *e = getenv(sw->name);
        on = !(e && !strcmp(e, "0"));
        __atomic_store_n(&sw->flag, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* on 1 / 0 forces the switch on / off; on < 0 goes back to the environment's choice (read
 * again at the next use). Returns the flag it replaced (-1: not read yet). */
static inline int env_switch_set(env_switch *sw, int on) {
    return __atomic_exchange_n(&sw->flag, on < 0 ? -1 : on ? 1 : 0, __ATOMIC_RELAXED);
}

#endif

/*
 * args.c - tiny "--name value" option parser shared by the subcommands.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

void args_usage(FILE *f, const char *cmd, const arg_spec *specs, int n_specs) {
    fprintf(f, "usage: tqkv %s [options]\n", cmd);
    for (int i = 0; i < n_specs; i++) {
        const char *meta = specs[i].kind == ARG_FLAG     ? ""
                           : specs[i].kind == ARG_STR    ? " S"
                           : specs[i].kind == ARG_INT    ? " N"
                                                         : " X";
        char left[64];
        snprintf(left, sizeof left, "%s%s", specs[i].name, meta);
        fprintf(f, "  %-20s %s\n", left, specs[i].help);
    }
}

int args_parse(const char *cmd, int argc, char **argv, const arg_spec *specs, int n_specs) {
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            args_usage(stdout, cmd, specs, n_specs);
            exit(0);
        }
        const arg_spec *s = NULL;
        for (int j = 0; j < n_specs; j++)
            if (!strcmp(argv[i], specs[j].name)) s = &specs[j];
        if (!s) {
            fprintf(stderr, "tqkv %s: unknown option '%s'\n", cmd, argv[i]);
            args_usage(stderr, cmd, specs, n_specs);
            return -1;
        }
        if (s->kind == ARG_FLAG) {
            *(int *)s->dest = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "tqkv %s: option %s needs a value\n", cmd, s->name);
            return -1;
        }
        const char *val = argv[++i];
        char *end = NULL;
        errno = 0;
        if (s->kind == ARG_INT) {
            long v = strtol(val, &end, 10);
            if (errno || !end || *end || end == val || v < -2147483647L || v > 2147483647L) {
                fprintf(stderr, "tqkv %s: %s expects an integer, got '%s'\n", cmd, s->name, val);
                return -1;
            }
            *(int *)s->dest = (int)v;
        } else if (s->kind == ARG_DOUBLE) {
            double v = strtod(val, &end);
            if (errno || !end || *end || end == val || !isfinite(v)) {
                fprintf(stderr, "tqkv %s: %s expects a finite number, got '%s'\n", cmd, s->name,
                        val);
                return -1;
            }
            *(double *)s->dest = v;
        } else {
            *(const char **)s->dest = val;
        }
    }
    return 0;
}

/*
 * cli.h - the tqkv command-line tool: subcommands and small argument helpers.
 * Owns: argument parsing and printing. Must not: contain library logic.
 */
#ifndef TQKV_CLI_H
#define TQKV_CLI_H

#include <stdio.h>

/* Each subcommand gets argv after its own name(s); returns a process exit code. */
int cmd_formats(int argc, char **argv);
int cmd_bench_codec(int argc, char **argv);
int cmd_bench_attention(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_ppl(int argc, char **argv);
int cmd_calibrate(int argc, char **argv);
int cmd_kv_error(int argc, char **argv);
int cmd_bench_model(int argc, char **argv);
int cmd_bench_gemm(int argc, char **argv);
int cmd_chat_template(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_bench_engine(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_bench_capacity(int argc, char **argv);

/* ---- argument helpers (args.c) ----
 * Options are "--name value" or "--flag". Unknown options are an error. */
typedef enum { ARG_FLAG, ARG_INT, ARG_DOUBLE, ARG_STR } arg_kind;
typedef struct {
    const char *name;   /* "--ctx" */
    arg_kind    kind;
    void       *dest;   /* int* for FLAG/INT, double* for DOUBLE, const char** for STR */
    const char *help;
} arg_spec;
/* Parses argv against specs; on error prints a message and usage to stderr, returns -1. */
int  args_parse(const char *cmd, int argc, char **argv, const arg_spec *specs, int n_specs);
void args_usage(FILE *f, const char *cmd, const arg_spec *specs, int n_specs);

#endif

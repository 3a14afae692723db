/*
 * model_cli.h - helpers shared by the model subcommands (run, ppl, bench model, tokenize).
 * Owns: model directory resolution, loading with status lines, KV spec / list parsing,
 * file reading, timing. (JSON output: json_out.h.)
 * Must not: contain model or cache logic.
 */
#ifndef TQKV_MODEL_CLI_H
#define TQKV_MODEL_CLI_H

#include <stdio.h>

#include "tqkv.h"
#include "tqkv_model.h"

#define MCLI_DEFAULT_MODEL "models/qwen3-code-28m"
/* The default --kv of run and serve: the best measured preset within 4.25 bits per value
 * (docs/QUALITY.md "The default --kv"). */
#define MCLI_DEFAULT_KV "auto:4.25"

/* --kv when none was given: MCLI_DEFAULT_KV, or tq4 (the format the preset builds on) when
 * the command line asks for what a preset chooses itself or excludes (own_window: --window,
 * --kv-layers, or serve's --draft). */
const char *mcli_default_kv(int own_window);

/* Resolve --model: as given (relative to cwd), else, for a relative path, relative to the
 * executable's directory's parent ("<exe dir>/../DIR"). Returns buf or NULL (message printed). */
const char *mcli_resolve_model(const char *cmd, const char *arg, char *buf, size_t cap);
/* Load with progress lines on stderr; returns 0 or prints the error and returns -1. */
int  mcli_load(const char *cmd, const char *dir, int blas, int f32_weights, int threads,
               tqkv_model **out);
/* Same; device 1 (--device cuda) skips the host-side repacking and f32 prefill copies the
 * CPU forward needs (the device reads the checkpoint's bf16 bytes). */
int  mcli_load_dev(const char *cmd, const char *dir, int blas, int f32_weights, int threads,
                   int device, tqkv_model **out);
/* --exact (every model command): 0 (the default) loads with bf16 activations
 * (tqkv_model_load_params.bf16_act: AVX512_BF16 dot products where the CPU has them),
 * 1 keeps the exact f32 matmuls. Set it before mcli_load / mcli_load_dev. */
extern int mcli_exact;
/* "bf16-act" when the matmuls run with bf16 activations (not --exact and the CPU has
 * AVX512_BF16), else "exact": for the figures' labels. */
const char *mcli_matmul_name(int exact);
#define MCLI_EXACT_HELP "exact f32 matmuls (transformers fp32 numerics); default: bf16 activations with AVX512_BF16 dot products where the CPU has them"
int  mcli_parse_kv(const char *cmd, const char *spec, tqkv_format *k, tqkv_format *v);
int  mcli_parse_kernel(const char *cmd, const char *name, tqkv_kernel *out);
/* --kv-layers SPEC (tqkv_kv_layers_parse) into p; -1 with a message on error. */
int  mcli_parse_kv_layers(const char *cmd, const char *spec, tqkv_model_state_params *p);
/* Bits per stored K/V value at a context of ctx tokens, everything counted: each layer with
 * its own K/V at its formats (per-layer mix), scales, the q8 window ring (window + slack
 * slots), a sliding layer holding only window + slack tokens; averaged over the values held. */
double mcli_kv_bits(const tqkv_model *m, tqkv_model_state *s, int ctx);
/* mcli_kv_bits of state params t (not a state): measured on a CPU state of one row made from
 * t without its device options; -1 when no such state can be made. */
double mcli_params_bits(const tqkv_model *m, const tqkv_model_state_params *t, int ctx);
/* --window W needs a tq K or V format (only tq planes keep a q8 window): 0, or -1 with a
 * message. */
int  mcli_check_window(const char *cmd, int window, tqkv_format k, tqkv_format v);
/* --window-keys-only (keys_only != 0) needs window > 0 (the ring is kept on tq K planes
 * only, whatever the per-layer mix): 0, or -1 with a message. */
int  mcli_check_window_k(const char *cmd, int keys_only, int window);
/* --device: "cpu" -> 0, "cuda" -> 1 (tqkv_model_state_params.device); 0 or -1 (printed). */
int  mcli_parse_device(const char *cmd, const char *name, int *out);
/* --tensor-parallel N (docs/TP.md) into p->tensor_parallel: 0..8 (0, 1 = off); any device
 * (the state refuses what the device cannot shard). 0 or -1 (printed). */
int  mcli_parse_tp(const char *cmd, int n, int device, tqkv_model_state_params *p);
#define MCLI_TP_HELP "ranks of tensor parallelism (Megatron sharding, docs/TP.md), each with its shard of the weights and the cache of its KV heads: on the CPU they run one after another; with --device cuda (every graph) each rank is a device state on GPU rank % visible GPUs; must divide the heads and MLP width (default 1 = off)"
/* Number of online CPUs (>= 1). */
int  mcli_cpus(void);
/* Whole file into a malloc'd NUL-terminated buffer; 0 or -1 (message printed). */
int  mcli_read_file(const char *cmd, const char *path, char **out, size_t *len);
double mcli_now(void);

#endif

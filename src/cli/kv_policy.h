/*
 * kv_policy.h - KV policy files (kv_policy.c): per-layer K/V formats and a window chosen by
 * `tqkv calibrate` from measured per-layer sensitivity, read back by `--kv-policy FILE`
 * (run, ppl, serve) and by `--kv auto:B` when the model directory holds kv-policy-B.txt
 * (device states: kv-policy-B.device.txt first, kv_preset.c).
 * Format (version 1, text, one "key value" a line, '#' starts a comment):
 *
 *     tqkv-kv-policy 1          first line: the format and its version
 *     layers 8                  the model's layer count (a policy for another model is refused)
 *     kv tq4/tq2                default K/V formats (the --kv syntax)
 *     kv-layers 3:q8/tq2;5:tq3  per-layer formats (the --kv-layers syntax; may be empty)
 *     window 30                 newest tokens kept at q8 beside the tq planes (0: none)
 *     window-planes k           optional (session 11): "k" = the window holds keys only
 *                               (values read from their format), "kv" (default) = both
 *     budget 3.25               optional: bits per value the policy must fit at the run's
 *                               context, counted as `tqkv ppl --json` kv_bits_per_value
 *     ctx 2048                  optional, informational: where it was calibrated
 *     bits 3.2489               optional, informational: its bits per value at ctx
 */
#ifndef TQKV_CLI_KV_POLICY_H
#define TQKV_CLI_KV_POLICY_H

#include <stddef.h>
#include <stdio.h>

#include "tqkv_model.h"

#define KVPOL_VERSION 1

typedef struct {
    int    layers;       /* the model's n_layers */
    char   kv[32];       /* "tq4" or "tq4/tq2" */
    char   kv_layers[512];
    int    window;
    int    window_keys_only; /* window-planes k */
    double budget;       /* 0: none */
    int    ctx;          /* 0: not given */
    double bits;         /* 0: not given */
} kv_policy;

/* Parse policy text (NUL-terminated) into *out; -1 with a message "what, line N" in err
 * [cap] (out unchanged) on a bad, unknown, duplicate or missing key or a bad format. */
int kvpol_parse(const char *text, kv_policy *out, char *err, size_t cap);
/* Read and parse file path; -1 with a message on stderr (prefixed "tqkv CMD: "). */
int kvpol_load(const char *cmd, const char *path, kv_policy *out);
/* Write pol as policy text to f (comment: a free text line, may be NULL); 0 or -1. */
int kvpol_write(FILE *f, const kv_policy *pol, const char *comment);
/* Apply pol to p for model m at ctx tokens: formats, per-layer formats, window (slack 0).
 * Checks the layer count, that per-layer formats name only layers of m, the budget at ctx
 * and, for a device state (p->device), that every layer's pair is a device pair (or f32/f32)
 * and the window is not keys-only. desc [cap]: the applied spec and its bits. -1 with a
 * message on stderr, also in desc (p unchanged). */
int kvpol_apply(const char *cmd, const tqkv_model *m, const kv_policy *pol, int ctx,
                tqkv_model_state_params *p, char *desc, size_t cap);
/* Bits per value of params t at ctx tokens (a CPU state of one row, mcli_kv_bits); -1 when
 * no state can be made. */
double kvpol_bits(const tqkv_model *m, const tqkv_model_state_params *t, int ctx);

#endif

/*
 * kv_shipped.h - calibrated KV policies shipped for known checkpoints (kv_shipped.c).
 */
#ifndef TQKV_CLI_KV_SHIPPED_H
#define TQKV_CLI_KV_SHIPPED_H

#include <stddef.h>

/* The checkpoint fingerprint of model_dir: 16 hex digits of FNV-1a 64 over its config.json
 * bytes into out (cap >= 17). -1 when config.json cannot be read. */
int kvship_fingerprint(const char *model_dir, char *out, size_t cap);
/* The shipped folder holding kv-policy-<budget>.txt for model_dir's fingerprint, searched in
 * $TQKV_POLICY_DIR, the source tree's models/policies and the installed share/tqkv/policies,
 * in that order: 0 with the folder in dir [cap], 1 when there is none (or its name does
 * not fit cap). budget as written
 * after "auto:" (e.g. "4.25"). */
int kvship_find(const char *model_dir, const char *budget, char *dir, size_t cap);

/* The folder whose policy files `--kv auto:B` reads: dir when it holds kv-policy-B.txt (or,
 * for a device state, kv-policy-B.device.txt), else the folder shipped for dir's checkpoint
 * (kvship_find, into buf [cap]), else dir. */
const char *kvship_policy_dir(const char *dir, const char *budget, int device, char *buf,
                              size_t cap);

#endif

/*
 * kv_preset.h - `--kv auto:B` presets (kv_preset.c).
 */
#ifndef TQKV_CLI_KV_PRESET_H
#define TQKV_CLI_KV_PRESET_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "tqkv_model.h"

/* Room for a resolved spec (desc below): the spec, the policy file used, the ones not used. */
#define KVP_DESC 768

/* 1 when kv is a preset name "auto:B". */
int kvp_is_preset(const char *kv);
/* Resolve preset kv for model m at ctx tokens into p (k/v formats, per-layer formats,
 * window; p->device decides which candidates qualify). desc: the resolved spec and its
 * bits. -1 with a message when B is malformed or nothing fits. */
int kvp_resolve(const char *cmd, const tqkv_model *m, const char *kv, int ctx,
                tqkv_model_state_params *p, char *desc, size_t cap);
/* kvp_resolve, but a calibrated policy beside the model wins: DIR/kv-policy-B.txt (B as
 * written after "auto:", e.g. kv-policy-4.25.txt; `tqkv calibrate --out-dir DIR` writes
 * them) is applied when present and it fits B at ctx (on a device state: when every layer's
 * pair is a device pair). A device state (p->device) first tries DIR/kv-policy-B.device.txt
 * (`tqkv calibrate --device-formats`); CPU states never read it. A file that does not parse
 * is an error; one that does not apply is skipped with a message on stderr and a note in
 * desc ("... (policy P not used: REASON)"), leaving the choice to the next file, then to
 * the ranked presets. desc names the file used ("policy P: spec"). When DIR holds no such
 * file, the folder shipped for DIR's checkpoint is read instead (kv_shipped.h:
 * models/policies/<config fingerprint>/). */
int kvp_resolve_model(const char *cmd, const tqkv_model *m, const char *dir, const char *kv,
                      int ctx, tqkv_model_state_params *p, char *desc, size_t cap);
/* Append the listed presets (auto:4.25, auto:3.25, auto:2.5) resolved on a generic graph. */
int kvp_list_json(cJSON *arr, int dim);

#endif

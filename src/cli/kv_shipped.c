/*
 * kv_shipped.c - calibrated KV policies shipped with tqkv for known checkpoints
 * (models/policies/<fingerprint>/kv-policy-B.txt, installed to share/tqkv/policies).
 * Owns: the checkpoint fingerprint (FNV-1a 64 of its config.json bytes), the search of the
 * shipped folders for DIR's policy at a budget, and which folder `--kv auto:B` reads.
 * Must not: parse or apply policies (kv_policy.c), or rank presets (kv_preset.c): a policy
 * beside the model always wins over a shipped one (kvp_resolve_model).
 *
 * A fingerprint names a config, not the weights: a fine-tune with the same config.json
 * finds the policy calibrated on the checkpoint listed in models/policies/README.md. The
 * resolved spec names the file used, so that is never silent.
 */
#include "kv_shipped.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef TQKV_POLICY_SRC_DIR
#define TQKV_POLICY_SRC_DIR ""
#endif
#ifndef TQKV_POLICY_INSTALL_DIR
#define TQKV_POLICY_INSTALL_DIR ""
#endif

int kvship_fingerprint(const char *model_dir, char *out, size_t cap) {
    char path[4200];
    if (!model_dir || cap < 17) return -1;
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    uint64_t h = 0xcbf29ce484222325ull; /* the FNV-1a 64 offset basis */
    int c;
    while ((c = fgetc(f)) != EOF) h = (h ^ (uint8_t)c) * 1099511628211ull;
    fclose(f);
    snprintf(out, cap, "%016llx", (unsigned long long)h);
    return 0;
}

int kvship_find(const char *model_dir, const char *budget, char *dir, size_t cap) {
    char fp[32], path[4400];
    if (!budget || kvship_fingerprint(model_dir, fp, sizeof fp)) return 1;
    /* the environment's folder, the source tree's (a build), the installed one */
    const char *roots[3] = {getenv("TQKV_POLICY_DIR"), TQKV_POLICY_SRC_DIR,
                            TQKV_POLICY_INSTALL_DIR};
    for (int i = 0; i < 3; i++) {
        if (!roots[i] || !roots[i][0]) continue;
        snprintf(path, sizeof path, "%s/%s/kv-policy-%s.txt", roots[i], fp, budget);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        fclose(f);
        if ((size_t)snprintf(dir, cap, "%s/%s", roots[i], fp) >= cap) continue; /* too long */
        return 0;
    }
    return 1;
}

const char *kvship_policy_dir(const char *dir, const char *budget, int device, char *buf,
                              size_t cap) {
    char path[4300];
    for (int i = device ? 0 : 1; i < 2; i++) {
        snprintf(path, sizeof path, "%s/kv-policy-%s%s.txt", dir, budget, i ? "" : ".device");
        FILE *f = fopen(path, "r");
        if (f) {
            fclose(f);
            return dir;
        }
    }
    return kvship_find(dir, budget, buf, cap) == 0 ? buf : dir;
}

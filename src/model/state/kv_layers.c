/*
 * kv_layers.c - per-layer KV formats of a model state (tqkv_model_state_params.layer_k /
 * layer_v): the "LAYERS:FMT[/VFMT];..." spec parser and the per-layer lookup the graphs use
 * when they create their caches.
 * Owns: tqkv_kv_layers_parse, tqkv_kv_layer_formats, tqkv_kv_layers_device_check (which
 * layers' pairs a device state can hold: the rule of cache_cuda.h, no device needed).
 * Must not: create caches or know about graphs (the graphs call tqkv_kv_layer_formats).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cuda.h" /* tqkv_cuda_kv_formats_ok (inline: no device code) */
#include "model/arch/arch.h"    /* MODEL_LAYER_KV, MODEL_LAYER_SLIDING */
#include "model/model_impl.h"   /* model_layer_kind_of */
#include "tqkv_model.h"
#include "util/common.h"

void tqkv_kv_layer_formats(const tqkv_model_state_params *p, int layer, tqkv_format *k,
                           tqkv_format *v) {
    *k = p->k_format;
    *v = p->v_format;
    if (layer < 0 || layer >= TQKV_MAX_KV_LAYERS) return;
    if (p->layer_k[layer]) *k = (tqkv_format)(p->layer_k[layer] - 1);
    if (p->layer_v[layer]) *v = (tqkv_format)(p->layer_v[layer] - 1);
}

/* One layer list "a,b-c" of [s, e) into mark[]; 1 on success. */
static int parse_layers(const char *s, const char *e, uint8_t *mark) {
    if (s == e) return 0;
    while (s < e) {
        char *end;
        long a = strtol(s, &end, 10), b = a;
        if (end == s || a < 0 || a >= TQKV_MAX_KV_LAYERS) return 0;
        s = end;
        if (s < e && *s == '-') {
            b = strtol(s + 1, &end, 10);
            if (end == s + 1 || b < a || b >= TQKV_MAX_KV_LAYERS) return 0;
            s = end;
        }
        for (long l = a; l <= b; l++) mark[l] = 1;
        if (s < e) {
            if (*s != ',') return 0;
            s++;
            if (s == e) return 0;
        }
    }
    return 1;
}

tqkv_status tqkv_kv_layers_parse(const char *spec, tqkv_model_state_params *p) {
    if (!p) return tqkv_fail(TQKV_EINVAL, "tqkv_kv_layers_parse: NULL params");
    uint8_t lk[TQKV_MAX_KV_LAYERS] = {0}, lv[TQKV_MAX_KV_LAYERS] = {0};
    const char *s = spec ? spec : "";
    while (*s) {
        const char *semi = strchr(s, ';');
        const char *end = semi ? semi : s + strlen(s);
        const char *colon = memchr(s, ':', (size_t)(end - s));
        uint8_t mark[TQKV_MAX_KV_LAYERS] = {0};
        char fmt[64];
        if (!colon || !parse_layers(s, colon, mark) || (size_t)(end - colon - 1) >= sizeof fmt ||
            end == colon + 1)
            return tqkv_fail(TQKV_EINVAL, "bad per-layer KV spec '%.80s': expected groups "
                             "LAYERS:FMT[/VFMT] joined by ';' (layers 0..%d, e.g. '0,7:q8')",
                             spec, TQKV_MAX_KV_LAYERS - 1);
        memcpy(fmt, colon + 1, (size_t)(end - colon - 1));
        fmt[end - colon - 1] = 0;
        tqkv_format k, v;
        tqkv_status st = tqkv_kv_spec_parse(fmt, &k, &v);
        if (st != TQKV_OK) return st;
        for (int l = 0; l < TQKV_MAX_KV_LAYERS; l++)
            if (mark[l]) {
                lk[l] = (uint8_t)(k + 1);
                lv[l] = (uint8_t)(v + 1);
            }
        s = semi ? semi + 1 : end;
        if (semi && !*s) return tqkv_fail(TQKV_EINVAL, "bad per-layer KV spec '%.80s': "
                                          "trailing ';'", spec);
    }
    memcpy(p->layer_k, lk, sizeof lk);
    memcpy(p->layer_v, lv, sizeof lv);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// Device states: every layer's pair is a device pair or f32/f32 (the dense bf16 cache)
// ---------------------------------------------------------------------------

tqkv_status tqkv_kv_layers_device_check(const tqkv_model *m, const tqkv_model_state_params *p,
                                        int *dense) {
    if (!m || !p) return tqkv_fail(TQKV_EINVAL, "tqkv_kv_layers_device_check: NULL argument");
    int nd = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const int kind = model_layer_kind_of(m, l); /* recurrent and KV-shared: no cache */
        if (kind != MODEL_LAYER_KV && kind != MODEL_LAYER_SLIDING) continue;
        if (l < TQKV_MAX_KV_LAYERS &&
            (p->layer_k[l] > TQKV_FORMAT_COUNT || p->layer_v[l] > TQKV_FORMAT_COUNT))
            return tqkv_fail(TQKV_EINVAL, "model state: invalid per-layer KV format at layer %d", l);
        tqkv_format k, v;
        tqkv_kv_layer_formats(p, l, &k, &v);
        if (k == TQKV_F32 && v == TQKV_F32) {
            nd = 1;
            continue;
        }
        if (!tqkv_cuda_kv_formats_ok(k, v))
            return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: layer %d KV %s/%s (the device "
                             "cache holds, per layer, tq4/tq4, tq3/tq3, fp8/fp8, tq K and V with "
                             "K bits >= V bits or, for f32/f32, dense bf16)", l,
                             tqkv_format_name(k), tqkv_format_name(v));
    }
    if (dense) *dense = nd;
    return TQKV_OK;
}

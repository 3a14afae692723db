/*
 * engine_bind.c - the real serving engine (tqkv_engine.h) as the server's srv_engine.
 * Owns: four one-line adapters. Must not: add behaviour (the server and the engine own it).
 * Built only when the engine's sources are in the tree (see CMakeLists.txt server block).
 */
#include "server/server.h"

static tqkv_status bind_submit(void *ctx, const tqkv_engine_request *r, uint64_t *id) {
    return tqkv_engine_submit(ctx, r, id);
}
static tqkv_status bind_cancel(void *ctx, uint64_t id) { return tqkv_engine_cancel(ctx, id); }
static tqkv_status bind_stats(void *ctx, tqkv_engine_stats *out) { return tqkv_engine_stats_get(ctx, out); }

srv_engine srv_engine_bind(tqkv_engine *e) {
    srv_engine b = {
        .ctx = e,
        .submit = bind_submit,
        .cancel = bind_cancel,
        .stats = bind_stats,
        .lat_buckets = tqkv_engine_latency_buckets(),
        .tok = tqkv_engine_tokenizer(e),
        .model_name = tqkv_engine_model_name(e),
        .context_len = tqkv_engine_context_len(e),
    };
    return b;
}

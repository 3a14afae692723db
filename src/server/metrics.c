/*
 * metrics.c - /metrics in the Prometheus text exposition format (version 0.0.4).
 * Owns: formatting engine statistics and the server's HTTP counters.
 * Must not: read the engine or the server itself (the caller passes snapshots).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

typedef struct {
    char  *s;
    size_t len, cap;
    int    failed;
} mbuf;

static void put(mbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(mbuf *b, const char *fmt, ...) {
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2 + (size_t)n + 1;
        char *ns = realloc(b->s, nc);
        if (!ns) {
            b->failed = 1;
            return;
        }
        b->s = ns;
        b->cap = nc;
    }
}

static void histogram(mbuf *b, const char *name, const char *help, const tqkv_engine_histogram *h,
                      const double *le) {
    put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < TQKV_ENGINE_LAT_BUCKETS; i++)
        put(b, "%s_bucket{le=\"%g\"} %llu\n", name, le ? le[i] : 0.0,
            (unsigned long long)h->bucket[i]);
    put(b, "%s_bucket{le=\"+Inf\"} %llu\n", name,
        (unsigned long long)h->bucket[TQKV_ENGINE_LAT_BUCKETS]);
    put(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

#define COUNTER(name, help, value) \
    put(&b, "# HELP " name " " help "\n# TYPE " name " counter\n" name " %llu\n", \
        (unsigned long long)(value))
#define SECONDS(name, help, value) \
    put(&b, "# HELP " name " " help "\n# TYPE " name " counter\n" name " %.9g\n", (double)(value))
#define GAUGE(name, help, fmt, value) \
    put(&b, "# HELP " name " " help "\n# TYPE " name " gauge\n" name " " fmt "\n", value)

char *srv_metrics_text(const tqkv_engine_stats *st, const double *lat_buckets,
                       const srv_status_count *http_counts, int n_status, int open_requests) {
    mbuf b = {malloc(4096), 0, 4096, 0};
    if (!b.s) return NULL;
    b.s[0] = 0;
    put(&b, "# HELP tqkv_http_requests_total HTTP responses by status code.\n"
            "# TYPE tqkv_http_requests_total counter\n");
    for (int i = 0; i < n_status; i++)
        put(&b, "tqkv_http_requests_total{code=\"%d\"} %llu\n", http_counts[i].status,
            (unsigned long long)http_counts[i].count);
    put(&b, "# HELP tqkv_requests_finished_total Generation requests by finish reason.\n"
            "# TYPE tqkv_requests_finished_total counter\n");
    for (int f = TQKV_FINISH_STOP; f <= TQKV_FINISH_ERROR; f++)
        put(&b, "tqkv_requests_finished_total{reason=\"%s\"} %llu\n", srv_finish_name((tqkv_finish_reason)f),
            (unsigned long long)st->requests_finished[f]);
    COUNTER("tqkv_prompt_tokens_total", "Prompt tokens of admitted requests.", st->prompt_tokens);
    COUNTER("tqkv_prefill_tokens_total", "Prompt tokens run through the model (prefix-cache hits and the shared prompt of n > 1 choices excluded).", st->prefill_tokens);
    COUNTER("tqkv_draft_prefill_tokens_total", "Prompt tokens run through the draft model "
            "(speculative decoding; its catch-up after prefix-cache hits included).",
            st->draft_prefill_tokens);
    COUNTER("tqkv_generated_tokens_total", "Generated tokens.", st->generated_tokens);
    COUNTER("tqkv_engine_steps_total", "Scheduler steps that found work.", st->steps);
    COUNTER("tqkv_engine_decode_steps_total", "Steps that decoded the running rows.",
            st->decode_steps);
    COUNTER("tqkv_engine_decode_rows_total", "Rows decoded, summed over decode steps.",
            st->decode_rows);
    SECONDS("tqkv_engine_prefill_seconds_total", "Wall time in prompt chunks.",
            st->prefill_seconds);
    SECONDS("tqkv_engine_decode_seconds_total", "Wall time decoding the running rows.",
            st->decode_seconds);
    SECONDS("tqkv_engine_merge_seconds_total", "Wall time joining prefilled rows to the batch.",
            st->merge_seconds);
    GAUGE("tqkv_requests_running", "Rows in the running batch.", "%d", st->running);
    GAUGE("tqkv_requests_queued", "Requests waiting for admission.", "%d", st->queued);
    GAUGE("tqkv_http_open_requests", "Generation requests with an open HTTP response.", "%d",
          open_requests);
    GAUGE("tqkv_kv_bytes_used", "Bytes the running rows' KV caches hold.", "%zu", st->kv_bytes_used);
    GAUGE("tqkv_kv_bytes_allocated", "Bytes the running and prefilling rows' KV storage occupies "
          "(padding and spare columns included).", "%zu", st->kv_bytes_allocated);
    GAUGE("tqkv_kv_budget_bytes", "KV budget for running rows and their projected growth.", "%zu",
          st->kv_budget);
    GAUGE("tqkv_kv_bytes_per_token", "KV bytes per token over all layers, K and V.", "%.6g",
          st->kv_bytes_per_token);
    COUNTER("tqkv_prefix_cache_hits_total", "Prefix-cache hits.", st->prefix_hits);
    COUNTER("tqkv_prefix_cache_misses_total", "Prefix-cache misses.", st->prefix_misses);
    COUNTER("tqkv_prefix_cache_tokens_reused_total", "Prompt tokens served from the prefix cache.",
            st->prefix_tokens_reused);
    GAUGE("tqkv_prefix_cache_bytes", "Bytes held by the prefix cache.", "%zu", st->prefix_cache_bytes);
    COUNTER("tqkv_prompt_cache_refused_total",
            "Prompt-cache files refused (another model, weights or KV spec; checksum; not a "
            "regular file; over the size cap).", st->prompt_cache_refused);
    COUNTER("tqkv_spec_rounds_total", "Speculative decoding rounds.", st->spec_rounds);
    COUNTER("tqkv_spec_draft_tokens_total", "Draft tokens proposed.", st->spec_drafted);
    COUNTER("tqkv_spec_accepted_tokens_total", "Draft tokens accepted by the target.", st->spec_accepted);
    GAUGE("tqkv_spec_acceptance_rate", "Accepted / drafted tokens (0 when none drafted).", "%.6g",
          st->spec_drafted ? (double)st->spec_accepted / (double)st->spec_drafted : 0.0);
    histogram(&b, "tqkv_time_to_first_token_seconds", "Submit to first token.", &st->ttft, lat_buckets);
    histogram(&b, "tqkv_inter_token_latency_seconds", "Between consecutive tokens of a request.",
              &st->itl, lat_buckets);
    if (b.failed) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

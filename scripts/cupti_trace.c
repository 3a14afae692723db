/*
 * cupti_trace.c - an LD_PRELOAD kernel tracer for the device runs: every kernel the process
 * runs, including the nodes of replayed CUDA graphs, with its start and end on the GPU's
 * clock (CUPTI's concurrent-kernel activity records: nothing is serialised, unlike Nsight
 * Compute, so a decode step's graph runs as it does untraced, PDL overlap included).
 * A dev tool, not part of the library: cuda_pack.sh builds it where this host has cupti.h
 * (the CUDA toolkit) and carries libcupti with it; cupti_step_table.py folds its CSV.
 *
 *   gcc -shared -fPIC -O2 -I$CUDA/include -o cupti_trace.so scripts/cupti_trace.c \
 *       -L$CUDA/lib -lcupti
 *   CUPTI_TRACE_OUT=trace.csv LD_PRELOAD=./cupti_trace.so ./tqkv bench model ...
 *
 * CSV (one line per kernel, in the order CUPTI hands the records over, not sorted):
 *   start_ns,end_ns,graph_id,graph_node_id,grid,block,name (mangled; the parser demangles)
 * Buffers are flushed every 100 ms and at exit; records still in flight when the CUDA
 * context is torn down first are lost (the tail of a run, not a step in the middle).
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *g_out;

static void CUPTIAPI trace_buffer_request(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = 8u << 20;
    *buf = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI trace_buffer_done(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                       size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *rec = NULL;
    while (g_out && cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
            continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        fprintf(g_out, "%llu,%llu,%u,%llu,%dx%dx%d,%dx%dx%d,%s\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->graphId, (unsigned long long)k->graphNodeId, k->gridX,
                k->gridY, k->gridZ, k->blockX, k->blockY, k->blockZ, k->name ? k->name : "?");
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(NULL, 0, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
    free(buf);
}

static void trace_fini(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (g_out) fclose(g_out);
    g_out = NULL;
}

__attribute__((constructor)) static void trace_init(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    g_out = fopen(path ? path : "cupti_trace.csv", "w");
    if (!g_out) {
        perror("cupti_trace: output");
        return;
    }
    fprintf(g_out, "start_ns,end_ns,graph_id,graph_node_id,grid,block,name\n");
    if (cuptiActivityRegisterCallbacks(trace_buffer_request, trace_buffer_done) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: CUPTI refused the kernel activity\n");
        return;
    }
    cuptiActivityFlushPeriod(100);
    atexit(trace_fini);
}

/*
 * tp_cuda.cu - the tensor-parallel forward on the GPU (issue 25; docs/TP.md): every graph's
 *   Megatron sharding (its arch tp_shard shards the weights, as for the CPU path) run by N
 *   rank states, each a device state (model_cuda) of its rank model on GPU tp->device[r]
 *   (several ranks may share one GPU), with the collectives of tp_comm.h on device buffers.
 * Owns: the ranks' device setup (lm_head slice widths, the o_proj biases on every rank's GPU),
 *   the making of a communicator for the ranks' GPUs (NCCL when they are distinct, else the
 *   device-local backend; the model keeps one per N, shared by its states: tp_state.c)
 *   and the sharded forward, over a graph's pieces (arch.h's model_arch_cuda_tp_ops: the
 *   common device graph's below for the Llama family, Qwen 3.5 and the MoE graphs; Gemma 4's
 *   own from its graph_cuda.cu):
 *     every rank: begin (upload, embed (replicated), layer 0's input norm)
 *     per layer: every rank's mixer (its heads: q/k/v, its KV heads' cache append and
 *       attention, o_proj -> partial tmp [T, H]; a DeltaNet layer: its heads, its recurrent
 *       rows); all-reduce of tmp (rank order); every rank: + o_proj bias, ffn (residual +
 *       norm, its MLP / experts slice -> partial tmp, and a second partial `extra` where the
 *       graph has one: Gemma 4's experts); all-reduce (tmp, then extra); every rank: end
 *       (residual, the next layer's norm)
 *     every rank: head (its vocabulary rows); the slices gathered into the caller's
 *       logits [rows, V] (device-to-host copies into each rank's columns); after the wait,
 *       every rank's mc_forward_finish (recurrent token counts, sliding drops).
 *   Launched directly, or (TQKV_TP_GRAPHS=1, opt in) a decode step as one CUDA graph over
 *   every rank's stream, captured again when the shared communicator's scratch moved; one
 *   wait per rank at the end.
 * Must not: let a row's bits depend on other rows (every piece is the unsharded device
 *   graph's per-token or batch-invariant kernel; the all-reduce is elementwise in rank
 *   order); run for a graph without tp_shard (model_tp_check refuses it).
 * Ran on one H100 (every graph, ranks sharing it; session 10); the shared communicator and
 *   the graphs' scratch check are compiled only.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/model_impl.h"
#include "model/tp/tp_state.h"
#include "util/common.h"
}
#include "model/cuda/model_cuda_impl.h"
#include "model/ops/ops_cuda.cuh"

#define ck mc_ck

typedef struct tp_graph tp_graph;
static void tp_graph_free(model_tp *tp);

// ---------------------------------------------------------------------------
// devices
// ---------------------------------------------------------------------------

extern "C" int model_cuda_device_count(void) {
    if (!tqkv_cuda_available()) return 0; /* no driver, or a driver too old for the runtime */
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" tqkv_status model_cuda_set_device(int device) {
    return ck(cudaSetDevice(device), "cudaSetDevice (tensor parallel rank)");
}

extern "C" void model_cuda_select_device(int device) {
    if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
}

// ---------------------------------------------------------------------------
// setup
// ---------------------------------------------------------------------------

/* tmp [T, H] += bo [H] per token (the o_proj bias, once after the all-reduce, as the CPU's
 * llama_residual adds o + bias). grid mc_grid_elems(T, H), block 256. */
__global__ void tp_bias_kernel(float *__restrict__ tmp, const float *__restrict__ bo, int H) {
    const size_t t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i < H) tmp[t * H + i] = __fadd_rn(tmp[t * H + i], bo[i]);
}

/* Every rank's copy of the o_proj biases [L, H] on its GPU (NULL parts as zeros), when any
 * layer has one. */
static tqkv_status upload_biases(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    const tqkv_model *m = s->m;
    const int L = m->cfg.n_layers, H = m->cfg.hidden_size;
    int any = 0;
    for (int l = 0; l < L; l++) any |= m->layers[l].bo != NULL;
    if (!any) return TQKV_OK;
    const float **parts = (const float **)calloc((size_t)L, sizeof *parts);
    int *lens = (int *)calloc((size_t)L, sizeof *lens);
    tqkv_status st = parts && lens ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        parts[l] = m->layers[l].bo;
        lens[l] = H;
    }
    for (int r = 0; r < tp->n && !st; r++) {
        st = model_cuda_set_device(tp->device[r]);
        if (!st) st = mc_upload_vec(&tp->bo[r], parts, lens, L);
        /* a pageable copy may return before its DMA lands, and the ranks' non-blocking
         * streams do not wait for the legacy stream (as mc_upload_weights) */
        if (!st) st = ck(cudaStreamSynchronize(0), "upload o_proj biases");
    }
    free(parts);
    free(lens);
    return st;
}

extern "C" tqkv_status model_cuda_tp_setup(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    const int N = tp->n;
    for (int r = 0; r < N; r++) {
        int v0, v1, chunk;
        tp_vocab_range(s->m->cfg.vocab_size, N, r, &v0, &v1, &chunk);
        tp->rank[r]->gpu->head_n = v1 - v0; /* its lm_head slice [v1 - v0, H] */
    }
    const tqkv_status st = upload_biases(s);
    if (st) {
        model_cuda_select_device(tp->device[0]);
        return st;
    }
    return model_cuda_set_device(tp->device[0]);
}

extern "C" tqkv_status model_cuda_tp_comm_init(int n, const int *device, tp_comm **out) {
    int distinct = 1; /* NCCL needs one GPU per rank */
    for (int r = 0; r < n; r++)
        for (int q = 0; q < r; q++) distinct &= device[q] != device[r];
#ifdef TQKV_HAVE_NCCL
    tqkv_status st =
        distinct ? tp_comm_init_nccl_local(out, n, device) : tp_comm_init_device(out, n, device);
#else
    (void)distinct;
    tqkv_status st = tp_comm_init_device(out, n, device);
#endif
    if (st) {
        model_cuda_select_device(device[0]);
        return st;
    }
    return model_cuda_set_device(device[0]);
}

extern "C" void model_cuda_tp_free(model_tp *tp) {
    tp_graph_free(tp);
    for (int r = 0; r < tp->n; r++)
        if (tp->bo[r]) {
            model_cuda_select_device(tp->device[r]);
            cudaFree(tp->bo[r]);
            tp->bo[r] = NULL;
        }
    model_cuda_select_device(tp->device[0]);
}

// ---------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------

/* The common device graph's pieces (forward_cuda.cu) as a rank runs them: the Llama family,
 * Qwen 3.5 (its DeltaNet layers through the linear hook, by head) and the MoE graphs (their
 * experts through the ffn hook, by width). */
static tqkv_status common_ffn(model_cuda *g, int l, int T) {
    mc_residual_norm(g, g->w->layers[l].ffn_norm, (size_t)T);
    return mc_layer_ffn(g, l, T);
}

static float *common_extra(model_cuda *g, int l) {
    (void)g;
    (void)l;
    return NULL;
}

static tqkv_status common_end(model_cuda *g, int l, int T) {
    mc_residual_norm(g, mc_next_norm(g, l), (size_t)T);
    return TQKV_OK;
}

static tqkv_status common_head(model_cuda *g, int n, tqkv_logits_mode mode) {
    return mc_head(g, n, mode, NULL, 0);
}

static const model_arch_cuda_tp_ops common_ops = {
    mc_queue_begin, mc_layer_mixer, common_ffn, common_extra, common_end, common_head,
};

/* The pieces rank model m runs: its graph's own, or the common graph's. */
static const model_arch_cuda_tp_ops *tp_ops_of(const tqkv_model *m) {
    const model_arch_cuda_ops *ao = m->ops->cuda;
    return ao && ao->tp ? ao->tp : &common_ops;
}

/* The ranks' device twins and streams, their pieces, and their partial buffers tmp [T, H]
 * (and a layer's second partial, extra). */
typedef struct {
    model_tp   *tp;
    int         N;
    const model_arch_cuda_tp_ops *ops;
    model_cuda *g[TP_MAX_RANKS];
    void       *stream[TP_MAX_RANKS];
    float      *tmp[TP_MAX_RANKS];
    float      *extra[TP_MAX_RANKS];
} tp_ranks;

static tqkv_status allreduce(tp_ranks *k, float **bufs, size_t T) {
    const size_t count = T * (size_t)k->g[0]->m->cfg.hidden_size;
    return tp_allreduce_sum(k->tp->comm, bufs, count, k->stream);
}

/* The feed-forward's partials of layer l summed in rank order: tmp, then the graph's second
 * partial when the layer has one (Gemma 4's experts: normed on their own before they join). */
static tqkv_status allreduce_ffn(tp_ranks *k, int l, size_t T) {
    tqkv_status st = allreduce(k, k->tmp, T);
    if (st || !k->ops->extra(k->g[0], l)) return st;
    for (int r = 0; r < k->N; r++) k->extra[r] = k->ops->extra(k->g[r], l);
    return allreduce(k, k->extra, T);
}

/* Layer l on every rank (see the file comment). done[r]: rank r's layers whose cache took
 * this call's append (or whose recurrent rows changed). */
static tqkv_status tp_layer(tp_ranks *k, int l, int n, int as_decode, int *lin, int *done) {
    const int H = k->g[0]->m->cfg.hidden_size;
    const size_t T = (size_t)k->g[0]->rows * n;
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k->N && !st; r++) {
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st) st = k->ops->mixer(k->g[r], l, n, as_decode, &lin[r], &done[r]);
    }
    if (!st) st = allreduce(k, k->tmp, T); /* the mixer's partials, summed in rank order */
    for (int r = 0; r < k->N && !st; r++) {
        model_cuda *g = k->g[r];
        st = model_cuda_set_device(k->tp->device[r]);
        if (st) break;
        if (k->tp->bo[r] && T)
            tp_bias_kernel<<<mc_grid_elems(T, (size_t)H), 256, 0, g->stream>>>(
                g->tmp, k->tp->bo[r] + (size_t)l * H, H);
        st = k->ops->ffn(g, l, (int)T);
    }
    if (!st) st = allreduce_ffn(k, l, T); /* the feed-forward's partials */
    for (int r = 0; r < k->N && !st; r++) {
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st) st = k->ops->end(k->g[r], l, (int)T);
    }
    return st;
}

/* Every rank's queue: begin, the layers, the heads; the logits' copies into out [M, V]
 * (NULL: none; each rank's slice into its columns). */
static tqkv_status tp_queue(tp_ranks *k, int n, int as_decode, tqkv_logits_mode mode, float *out,
                            int *done) {
    const tqkv_model_config *c = &k->g[0]->m->cfg;
    const int V = c->vocab_size;
    int lin[TP_MAX_RANKS] = {0};
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k->N && !st; r++) {
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st) st = k->ops->begin(k->g[r], n);
    }
    for (int l = 0; l < c->n_layers && !st; l++) st = tp_layer(k, l, n, as_decode, lin, done);
    for (int r = 0; r < k->N && !st; r++) {
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st) st = ck(cudaGetLastError(), "sharded forward kernels");
    }
    if (st || mode == TQKV_LOGITS_NONE) return st;
    const size_t M = mode == TQKV_LOGITS_LAST ? (size_t)k->g[0]->rows : (size_t)k->g[0]->rows * n;
    for (int r = 0; r < k->N && !st; r++) {
        model_cuda *g = k->g[r];
        int v0, v1, chunk;
        tp_vocab_range(V, k->N, r, &v0, &v1, &chunk);
        const size_t w = (size_t)(v1 - v0) * sizeof(float);
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st) st = k->ops->head(g, n, mode); /* g->logits [M, v1 - v0] */
        if (!st && out)
            st = ck(cudaMemcpy2DAsync(out + v0, (size_t)V * sizeof(float), g->logits, w, w, M,
                                      cudaMemcpyDeviceToHost, g->stream), "sharded logits");
    }
    return st;
}

// ---------------------------------------------------------------------------
// the sharded decode step as one CUDA graph (TQKV_TP_GRAPHS=1)
// ---------------------------------------------------------------------------

/* One decode step over every rank's stream, captured from rank 0's (the others forked from
 * it and joined back; the collectives' own event waits and copies, or NCCL calls, inside),
 * as the unsharded decode graph (forward_cuda.cu): a step whose keys (every rank's
 * mc_graph_key) are new runs directly; the next with the same keys is captured and
 * launched; later ones replay. The logits land in pinned staging (a graph's copies need a
 * fixed target), copied out after the wait. */
struct tp_graph {
    cudaGraphExec_t exec;
    mc_graph_key    key[TP_MAX_RANKS];     /* what exec captured */
    mc_graph_key    pending[TP_MAX_RANKS]; /* the last direct step's */
    cudaEvent_t     fork;                  /* on rank 0's GPU */
    cudaEvent_t     join[TP_MAX_RANKS];    /* join[r] on rank r's GPU */
    float          *h_logits;              /* pinned [cap, V] */
    size_t          cap;
    unsigned long long gen;                /* the communicator's scratch generation exec
                                            * captured (tp_comm_scratch_gen): the model's
                                            * communicator is shared, so another state's
                                            * longer prefill may move the scratch */
    int             off;                   /* a capture failed: graphs off for this state */
    uint64_t        captures, replays, direct;
};

static void tp_graph_free(model_tp *tp) {
    tp_graph *G = tp->graph;
    if (!G) return;
    for (int r = 0; r < tp->n; r++) {
        model_cuda_select_device(tp->device[r]);
        if (G->join[r]) cudaEventDestroy(G->join[r]);
        if (r == 0 && G->fork) cudaEventDestroy(G->fork);
        if (r == 0 && G->exec) cudaGraphExecDestroy(G->exec);
    }
    cudaFreeHost(G->h_logits);
    free(G);
    tp->graph = NULL;
}

/* Whether sharded decode graphs are on when TQKV_TP_GRAPHS is unset (docs/TP.md). */
#define TP_GRAPHS_DEFAULT 0

/* Graphs for this step: TQKV_TP_GRAPHS=1 (or unset with TP_GRAPHS_DEFAULT 1; =0 turns
 * them off), every rank's graphs on (params.device_graphs; an experts path that reads back
 * turns them off), none failed before. */
static int tp_graphs_on(const tp_ranks *k) {
    const char *e = getenv("TQKV_TP_GRAPHS");
    const int want = e ? !strcmp(e, "1") : TP_GRAPHS_DEFAULT;
    if (!want || (k->tp->graph && k->tp->graph->off)) return 0;
    for (int r = 0; r < k->N; r++)
        if (!k->g[r]->graph.enabled) return 0;
    return 1;
}

/* k->tp->graph with its events and staging for `rows` rows of logits (made before any
 * capture: nothing may allocate inside one). */
static tqkv_status tp_graph_ready(tp_ranks *k, size_t rows) {
    model_tp *tp = k->tp;
    const size_t V = (size_t)k->g[0]->m->cfg.vocab_size;
    if (!tp->graph && !(tp->graph = (tp_graph *)calloc(1, sizeof(tp_graph))))
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tp_graph *G = tp->graph;
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k->N && !st; r++) {
        st = model_cuda_set_device(tp->device[r]);
        if (!st && !G->join[r])
            st = ck(cudaEventCreateWithFlags(&G->join[r], cudaEventDisableTiming), "graph event");
        if (!st && r == 0 && !G->fork)
            st = ck(cudaEventCreateWithFlags(&G->fork, cudaEventDisableTiming), "graph event");
    }
    if (!st && G->cap < rows) {
        cudaFreeHost(G->h_logits);
        G->h_logits = NULL;
        G->cap = 0;
        st = ck(cudaMallocHost((void **)&G->h_logits, rows * V * sizeof(float)), "graph logits");
        if (!st) G->cap = rows;
    }
    return st;
}

/* Rank r > 0's streams join rank 0's capture (fork) or rank 0's stream waits for theirs
 * (join: before the capture ends). */
static tqkv_status tp_fork_join(tp_ranks *k, int fork) {
    tp_graph *G = k->tp->graph;
    tqkv_status st = model_cuda_set_device(k->tp->device[0]);
    if (!st && fork) st = ck(cudaEventRecord(G->fork, k->g[0]->stream), "graph fork");
    for (int r = 1; r < k->N && !st; r++) {
        st = model_cuda_set_device(k->tp->device[r]);
        if (!st && fork) st = ck(cudaStreamWaitEvent(k->g[r]->stream, G->fork, 0), "graph fork");
        if (!st && !fork) st = ck(cudaEventRecord(G->join[r], k->g[r]->stream), "graph join");
        if (!st && !fork) {
            st = model_cuda_set_device(k->tp->device[0]);
            if (!st) st = ck(cudaStreamWaitEvent(k->g[0]->stream, G->join[r], 0), "graph join");
        }
    }
    return st;
}

/* Capture the step into G->exec (a new executable). On failure every rank's appends of the
 * capture are rewound (nothing ran) and the status says why. */
static tqkv_status tp_capture(tp_ranks *k, tqkv_logits_mode mode, float *out, int *done) {
    tp_graph *G = k->tp->graph;
    cudaGraph_t graph = NULL;
    tqkv_status st = model_cuda_set_device(k->tp->device[0]);
    if (!st) st = ck(cudaStreamBeginCapture(k->g[0]->stream, cudaStreamCaptureModeThreadLocal),
                     "graph capture");
    if (st) return st;
    st = tp_fork_join(k, 1);
    if (!st) st = tp_queue(k, 1, 0, mode, out, done);
    if (!st) st = tp_fork_join(k, 0);
    model_cuda_select_device(k->tp->device[0]);
    const tqkv_status es = ck(cudaStreamEndCapture(k->g[0]->stream, &graph), "graph capture");
    if (!st) st = es;
    if (G->exec) cudaGraphExecDestroy(G->exec);
    G->exec = NULL;
    if (!st) st = ck(cudaGraphInstantiate(&G->exec, graph, 0), "graph instantiate");
    if (graph) cudaGraphDestroy(graph);
    if (!st) return TQKV_OK;
    G->exec = NULL;
    (void)cudaGetLastError();
    for (int r = 0; r < k->N; r++) {
        model_cuda_select_device(k->tp->device[r]);
        if (mc_forward_undo(k->g[r], done[r], 1)) k->g[r]->broken = 1;
        done[r] = 0;
    }
    return st;
}

/* Every rank's caches grown for one more token (no allocation inside a capture) and its
 * key now (aws: the ranks' decode attention workspace needs). */
static tqkv_status tp_keys(tp_ranks *k, const size_t *aws, int logits, mc_graph_key *key) {
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k->N && !st; r++) {
        model_cuda *g = k->g[r];
        st = model_cuda_set_device(k->tp->device[r]);
        for (int l = 0; l < g->m->cfg.n_layers && !st; l++)
            if (g->kv[l]) st = tqkv_cuda_kv_reserve_append(g->kv[l], 1);
        key[r] = mc_graph_key_now(g, logits, aws[r], 0);
    }
    return st;
}

static int tp_keys_same(const tp_ranks *k, const mc_graph_key *a, const mc_graph_key *b) {
    for (int r = 0; r < k->N; r++)
        if (!mc_graph_key_same(&a[r], &b[r])) return 0;
    return 1;
}

/* The executable on rank 0's stream, after what every rank's stream queued before (the
 * last step's sliding drops, a row operation's copies) and before what they queue next. */
static tqkv_status tp_launch(tp_ranks *k) {
    tqkv_status st = tp_fork_join(k, 0);
    if (!st) st = model_cuda_set_device(k->tp->device[0]);
    if (!st) st = ck(cudaGraphLaunch(k->tp->graph->exec, k->g[0]->stream), "sharded graph launch");
    return st ? st : tp_fork_join(k, 1);
}

/* Replay: the launch, every rank's appends' host half by hand. */
static tqkv_status tp_replay(tp_ranks *k) {
    tqkv_status st = tp_launch(k);
    for (int r = 0; r < k->N && !st; r++)
        for (int l = 0; l < k->g[r]->m->cfg.n_layers && !st; l++)
            if (k->g[r]->kv[l]) st = tqkv_cuda_kv_replayed_append(k->g[r]->kv[l], 1);
    if (!st) k->tp->graph->replays++;
    return st;
}

/* One decode step through the graph (see struct tp_graph); *staged: the pinned logits to
 * copy out after the wait, or NULL (written into `out` directly, or none). */
static tqkv_status tp_step_graph(tp_ranks *k, tqkv_logits_mode mode, float *out,
                                 const size_t *aws, int *done, float **staged) {
    const size_t M = (size_t)k->g[0]->rows;
    mc_graph_key key[TP_MAX_RANKS];
    *staged = NULL;
    tqkv_status st = tp_graph_ready(k, M);
    if (!st) st = tp_keys(k, aws, out != NULL, key);
    if (st) return st;
    tp_graph *G = k->tp->graph;
    float *pin = out ? G->h_logits : NULL;
    const unsigned long long gen = tp_comm_scratch_gen(k->tp->comm);
    if (G->exec && tp_keys_same(k, key, G->key) && G->gen == gen) {
        *staged = pin;
        return tp_replay(k);
    }
    /* a new shape: direct, captured if it repeats (the same shape after the scratch moved:
     * captured again, the scratch only grows) */
    if (!tp_keys_same(k, key, G->pending)) {
        G->direct++;
        st = tp_queue(k, 1, 0, mode, out, done);
        if (!st) memcpy(G->pending, key, sizeof key);
        return st;
    }
    if (tp_capture(k, mode, pin, done)) { /* graphs off for this state; the step runs directly */
        G->off = 1;
        fprintf(stderr, "tqkv: CUDA graphs off for a sharded device state (%s); its decode "
                "steps run kernel by kernel\n", tqkv_last_error());
        return tp_queue(k, 1, 0, mode, out, done);
    }
    memcpy(G->key, key, sizeof key);
    G->gen = tp_comm_scratch_gen(k->tp->comm); /* unchanged by the capture: nothing grows */
    G->captures++;
    *staged = pin;
    return tp_launch(k);
}

extern "C" void model_cuda_tp_graph_counts(const tqkv_model_state *s, uint64_t *captures,
                                           uint64_t *replays, uint64_t *direct) {
    const tp_graph *G = s && s->tp ? s->tp->graph : NULL;
    *captures = G ? G->captures : 0;
    *replays = G ? G->replays : 0;
    *direct = G ? G->direct : 0;
}

/* After a forward that ran on every rank: every rank's recurrent token counts and sliding
 * drops (each rank's, even after another's failed: that rank is then broken). */
static tqkv_status tp_finish(tp_ranks *k, int n) {
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k->N; r++) {
        model_cuda_select_device(k->tp->device[r]);
        const tqkv_status fs = mc_forward_finish(k->g[r], n);
        if (!st) st = fs;
    }
    return st;
}

extern "C" tqkv_status model_cuda_tp_forward(tqkv_model_state *s, const int32_t *tokens,
                                             const int *lengths, int n, int prefill,
                                             tqkv_logits_mode mode, float *logits) {
    model_tp_sync(s);
    tp_ranks k;
    memset(&k, 0, sizeof k);
    k.tp = s->tp;
    k.N = s->tp->n;
    k.ops = tp_ops_of(s->m);
    tqkv_status st = TQKV_OK;
    for (int r = 0; r < k.N; r++) {
        k.g[r] = s->tp->rank[r]->gpu;
        if (!k.g[r] || k.g[r]->rows != s->rows)
            return tqkv_fail(TQKV_ESTATE, "forward: tensor-parallel rank %d is not a device state "
                             "of the state's %d rows", r, s->rows);
    }
    /* every rank's host half first: a refusal (bad token, row state) queues nothing */
    size_t aws[TP_MAX_RANKS] = {0}; /* the ranks' decode attention workspace needs */
    for (int r = 0; r < k.N && !st; r++) {
        st = model_cuda_set_device(k.tp->device[r]);
        if (!st) st = mc_forward_prepare(k.g[r], tokens, lengths, n, prefill, mode, &aws[r]);
    }
    if (st) return st;
    for (int r = 0; r < k.N; r++) { /* after prepare: the buffers no longer move */
        k.stream[r] = (void *)k.g[r]->stream;
        k.tmp[r] = k.g[r]->tmp;
    }
    const int as_decode = !prefill && n > 1 && k.g[0]->p.extend_as_decode;
    int done[TP_MAX_RANKS] = {0};
    const tqkv_logits_mode m2 = logits ? mode : TQKV_LOGITS_NONE;
    float *staged = NULL; /* a graph step's pinned logits, copied out after the wait */
    if (n == 1 && tp_graphs_on(&k))
        st = tp_step_graph(&k, m2, m2 == TQKV_LOGITS_NONE ? NULL : logits, aws, done, &staged);
    else st = tp_queue(&k, n, as_decode, m2, logits, done);
    for (int r = 0; r < k.N && st; r++) { /* every rank's appends undone */
        model_cuda_select_device(k.tp->device[r]);
        mc_forward_fail(k.g[r], done[r], n);
    }
    for (int r = 0; r < k.N; r++) { /* one wait per rank: the logits are on the host */
        model_cuda_select_device(k.tp->device[r]);
        const tqkv_status ss = ck(cudaStreamSynchronize(k.g[r]->stream), "sharded forward");
        if (ss) k.g[r]->broken = 1; /* what ran of the step is unknown */
        if (!st) st = ss;
    }
    if (!st) st = tp_finish(&k, n);
    if (!st && staged) memcpy(logits, staged, (size_t)s->rows * s->m->cfg.vocab_size * sizeof(float));
    model_cuda_select_device(k.tp->device[0]);
    return st;
}

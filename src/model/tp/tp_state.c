/*
 * tp_state.c - a tensor-parallel model state's ranks (tp_state.h): the check of a
 *   tensor_parallel value, rank models and rank states, reset, the weight slicing helpers.
 * Must not: compute a graph; name an architecture (it asks m->ops->tp_shard).
 */
#include <stdlib.h>
#include <string.h>

#include "model/arch/arch.h"
#include "model/state/recurrent.h"
#ifdef TQKV_HAVE_CUDA
#include "model/cuda/model_cuda.h"
#endif
#include "model/tp/tp_state.h"
#include "util/common.h"

// ---------------------------------------------------------------------------
// check
// ---------------------------------------------------------------------------

int model_tp_ranks(const tqkv_model_state_params *p) {
    if (p->tensor_parallel > 1) return p->tensor_parallel;
    const char *one = getenv("TQKV_TP_ONE_RANK");
    return p->tensor_parallel == 1 && p->device == 1 && one && !strcmp(one, "1") ? 1 : 0;
}

tqkv_status model_tp_check(const tqkv_model *m, const tqkv_model_state_params *p) {
    const int n = p->tensor_parallel;
    const tqkv_model_config *c = &m->cfg;
    if (n < 0 || n > TP_MAX_RANKS)
        return tqkv_fail(TQKV_EINVAL, "tensor_parallel %d: need 0..%d (0 and 1 = off)", n,
                         TP_MAX_RANKS);
    if (n <= 1 && !model_tp_ranks(p)) return TQKV_OK; /* off (a forced 1-rank state is not) */
    if (!m->ops->tp_shard)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel %d: the %s graph has no sharded "
                         "forward (the Llama family, Gemma 4, Qwen 3.5, Qwen3-MoE and Qwen 3.5 "
                         "MoE have)", n, tqkv_model_graph_name(m));
    if (p->device != 0 && p->device != 1)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel %d: device %d (the CPU or CUDA)", n,
                         p->device);
    /* the sharded device forward (cuda/tp_cuda.cu) runs the common device graph's pieces
     * (with a graph's linear / ffn hooks: Qwen 3.5, the MoE graphs) or, for a graph with a
     * forward queue of its own, the pieces of it its tp hook gives (Gemma 4) */
    const model_arch_cuda_ops *ao = m->ops->cuda;
    if (p->device == 1 && ao && ao->forward_queue && !ao->tp)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel %d with --device cuda: the %s graph "
                         "has no sharded device forward (on the CPU it may)", n,
                         tqkv_model_graph_name(m));
    if (p->blas)
        return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel %d: not with BLAS products (not "
                         "batch invariant)", n);
    tqkv_status rc = tp_check_kv(c->n_kv_heads, n, "KV heads");
    if (rc != TQKV_OK) return rc;
    const struct { const char *what; int v; } d[] = {{"query heads", c->n_heads},
                                                     {"intermediate size", c->intermediate_size}};
    for (int i = 0; i < 2; i++)
        if (d[i].v % n)
            return tqkv_fail(TQKV_EINVAL, "tensor_parallel %d does not divide the model's %s "
                             "(%d): every rank needs whole heads and an equal MLP slice", n,
                             d[i].what, d[i].v);
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// weight slices
// ---------------------------------------------------------------------------

static size_t esize(const mm_weight *w) { return w->type == MM_F32 ? 4 : 2; }

/* Index of element (n, k) in w's storage (matmul.c's layout; packed: [n/8][k/16][8][16]). */
static size_t elem_index(const mm_weight *w, int n, int k) {
    if (!w->packed) return (size_t)n * (size_t)w->k + (size_t)k;
    return (((size_t)(n / 8) * (size_t)(w->k / 16) + (size_t)(k / 16)) * 8 + (size_t)(n % 8)) * 16 +
           (size_t)(k % 16);
}

/* out: the unpacked copy d [rows, cols] of src's type, packed when src was and it can be
 * (with src's activation mode). */
static tqkv_status finish_copy(tqkv_model *owner, const mm_weight *src, unsigned char *d,
                               size_t rows, size_t cols, mm_weight *out) {
    memset(out, 0, sizeof *out);
    out->data = d;
    out->type = src->type;
    out->n = (int)rows;
    out->k = (int)cols;
    if (src->packed && mm_can_pack(out)) {
        uint16_t *pk = model_own(owner, 2 * rows * cols);
        if (!pk) return tqkv_fail(TQKV_ENOMEM, "out of memory packing a weight slice");
        mm_pack(out, pk, 1);
        out->data = pk;
        out->packed = 1;
        out->bf16_act = src->bf16_act;
    }
    return TQKV_OK;
}

/* rows [n0, n1) x cols [k0, k1) of src as an unpacked copy, then packed like src. */
static tqkv_status copy_block(tqkv_model *owner, const mm_weight *src, int n0, int n1, int k0,
                              int k1, mm_weight *out) {
    const size_t es = esize(src), rows = (size_t)(n1 - n0), cols = (size_t)(k1 - k0);
    unsigned char *d = model_own(owner, es * rows * cols);
    if (!d) return tqkv_fail(TQKV_ENOMEM, "out of memory slicing a weight");
    const unsigned char *s = src->data;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < cols; j++)
            memcpy(d + (i * cols + j) * es, s + elem_index(src, n0 + (int)i, k0 + (int)j) * es, es);
    return finish_copy(owner, src, d, rows, cols, out);
}

tqkv_status tp_weight_rows(tqkv_model *owner, const mm_weight *src, int n0, int n1,
                           mm_weight *out) {
    if (n0 < 0 || n1 > src->n || n0 >= n1)
        return tqkv_fail(TQKV_EINVAL, "weight rows [%d, %d) of %d", n0, n1, src->n);
    const int view = !src->packed || (n0 % 8 == 0 && n1 % 8 == 0);
    if (!view) return copy_block(owner, src, n0, n1, 0, src->k, out);
    const size_t off = (size_t)n0 * (size_t)src->k; /* the same in both layouts */
    *out = *src;
    out->data = (const unsigned char *)src->data + off * esize(src);
    out->n = n1 - n0;
    out->f32 = src->f32 ? src->f32 + off : NULL;
    out->f32p = src->f32p ? src->f32p + off : NULL;
    return TQKV_OK;
}

tqkv_status tp_weight_cols(tqkv_model *owner, const mm_weight *src, int k0, int k1,
                           mm_weight *out) {
    if (k0 < 0 || k1 > src->k || k0 >= k1)
        return tqkv_fail(TQKV_EINVAL, "weight columns [%d, %d) of %d", k0, k1, src->k);
    return copy_block(owner, src, 0, src->n, k0, k1, out);
}

tqkv_status tp_shard_attn(tqkv_model *owner, const model_layer *L, int QD, int KD, int q0,
                          int q1, int k0, int k1, int parts, model_layer *S) {
    tqkv_status rc;
    if (L->wqkv.data) { /* rows of the fused matrix: q; k; v */
        if ((rc = tp_weight_rows(owner, &L->wqkv, q0, q1, &S->wq)) ||
            (parts > 1 && (rc = tp_weight_rows(owner, &L->wqkv, QD + k0, QD + k1, &S->wk))) ||
            (parts > 2 &&
             (rc = tp_weight_rows(owner, &L->wqkv, QD + KD + k0, QD + KD + k1, &S->wv))))
            return rc;
    } else if ((rc = tp_weight_rows(owner, &L->wq, q0, q1, &S->wq)) ||
               (parts > 1 && (rc = tp_weight_rows(owner, &L->wk, k0, k1, &S->wk))) ||
               (parts > 2 && (rc = tp_weight_rows(owner, &L->wv, k0, k1, &S->wv)))) {
        return rc;
    }
    return TQKV_OK;
}

tqkv_status tp_weight_gather(tqkv_model *owner, const tp_rows_part *parts, int n_parts,
                             mm_weight *out) {
    const mm_weight *w0 = parts[0].w;
    size_t rows = 0;
    for (int i = 0; i < n_parts; i++) {
        const tp_rows_part *p = &parts[i];
        if (p->w->type != w0->type || p->w->k != w0->k || p->n0 < 0 || p->n1 > p->w->n ||
            p->n0 > p->n1)
            return tqkv_fail(TQKV_EINVAL, "weight rows [%d, %d) of %d (part %d)", p->n0, p->n1,
                             p->w->n, i);
        rows += (size_t)(p->n1 - p->n0);
    }
    const size_t es = esize(w0), k = (size_t)w0->k;
    unsigned char *d = model_own(owner, es * rows * k);
    if (!d) return tqkv_fail(TQKV_ENOMEM, "out of memory gathering weight rows");
    size_t at = 0;
    for (int i = 0; i < n_parts; i++)
        for (int n = parts[i].n0; n < parts[i].n1; n++, at++)
            for (size_t j = 0; j < k; j++)
                memcpy(d + (at * k + j) * es,
                       (const unsigned char *)parts[i].w->data + elem_index(parts[i].w, n, (int)j) * es, es);
    return finish_copy(owner, w0, d, rows, k, out);
}

tqkv_status tp_floats_gather(tqkv_model *owner, const float *src, int width, const int (*ranges)[2],
                             int n_ranges, float **out) {
    size_t rows = 0;
    for (int i = 0; i < n_ranges; i++) rows += (size_t)(ranges[i][1] - ranges[i][0]);
    float *d = model_own(owner, sizeof(float) * (rows ? rows : 1) * (size_t)width);
    if (!d) return tqkv_fail(TQKV_ENOMEM, "out of memory gathering a vector");
    size_t at = 0;
    for (int i = 0; i < n_ranges; i++) {
        const size_t nr = (size_t)(ranges[i][1] - ranges[i][0]);
        memcpy(d + at * width, src + (size_t)ranges[i][0] * width, sizeof(float) * nr * width);
        at += nr;
    }
    *out = d;
    return TQKV_OK;
}

tqkv_status tp_shard_glu(tqkv_model *owner, const model_layer *L, int I, int r, int n,
                         model_layer *S) {
    const int i0 = r * (I / n), i1 = (r + 1) * (I / n);
    tqkv_status rc;
    if (L->wgu.data) {
        if ((rc = tp_weight_rows(owner, &L->wgu, i0, i1, &S->wg)) ||
            (rc = tp_weight_rows(owner, &L->wgu, I + i0, I + i1, &S->wu)))
            return rc;
    } else if ((rc = tp_weight_rows(owner, &L->wg, i0, i1, &S->wg)) ||
               (rc = tp_weight_rows(owner, &L->wu, i0, i1, &S->wu))) {
        return rc;
    }
    return tp_weight_cols(owner, &L->wd, i0, i1, &S->wd);
}

tqkv_status tp_check_moe(const tqkv_model_config *c, int n) {
    const struct { const char *what; int v; } d[] = {
        {"moe_intermediate_size", c->moe_intermediate_size},
        {"shared_expert_intermediate_size", c->moe_shared_intermediate_size}};
    for (int i = 0; i < 2 && c->n_experts > 0; i++)
        if (d[i].v % n)
            return tqkv_fail(TQKV_EINVAL, "tensor_parallel %d does not divide the model's expert "
                             "width %s (%d): every rank needs an equal slice of each expert", n,
                             d[i].what, d[i].v);
    return TQKV_OK;
}

/* One SwiGLU (gu fused or g / u, down) of width I: rank r's slice into g / u views and a down
 * copy (gu of the slice left empty). */
static tqkv_status shard_swiglu(tqkv_model *owner, const mm_weight *gu, const mm_weight *g,
                                const mm_weight *u, const mm_weight *down, int I, int r, int n,
                                mm_weight *sgu, mm_weight *sg, mm_weight *su, mm_weight *sd) {
    model_layer whole = {.wgu = *gu, .wg = *g, .wu = *u, .wd = *down};
    model_layer part;
    memset(&part, 0, sizeof part);
    tqkv_status rc = tp_shard_glu(owner, &whole, I, r, n, &part);
    memset(sgu, 0, sizeof *sgu);
    *sg = part.wg;
    *su = part.wu;
    *sd = part.wd;
    return rc;
}

tqkv_status tp_shard_moe(tqkv_model *owner, const moe_layer *X, const tqkv_model_config *c,
                         int r, int n, moe_layer *S) {
    const int E = c->n_experts;
    memset(S, 0, sizeof *S);
    S->router = X->router; /* [E, hidden]: every rank routes alike */
    S->expert_scale = X->expert_scale;
    S->gu = model_own(owner, sizeof(mm_weight) * (size_t)E);
    S->g = model_own(owner, sizeof(mm_weight) * (size_t)E);
    S->u = model_own(owner, sizeof(mm_weight) * (size_t)E);
    S->down = model_own(owner, sizeof(mm_weight) * (size_t)E);
    if (!S->gu || !S->g || !S->u || !S->down) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_status rc = TQKV_OK;
    for (int e = 0; e < E && rc == TQKV_OK; e++)
        rc = shard_swiglu(owner, &X->gu[e], &X->g[e], &X->u[e], &X->down[e],
                          c->moe_intermediate_size, r, n, &S->gu[e], &S->g[e], &S->u[e],
                          &S->down[e]);
    if (rc != TQKV_OK || !X->sh_down.data) return rc;
    S->sh_gate = X->sh_gate; /* [1, hidden]: the same gate on every rank */
    return shard_swiglu(owner, &X->sh_gu, &X->sh_g, &X->sh_u, &X->sh_down,
                        c->moe_shared_intermediate_size, r, n, &S->sh_gu, &S->sh_g, &S->sh_u,
                        &S->sh_down);
}

tqkv_status tp_check_kv(int kv_heads, int n, const char *what) {
    if (kv_heads % n && n % kv_heads)
        return tqkv_fail(TQKV_EINVAL, "tensor_parallel %d neither divides the model's %d %s "
                         "nor is a multiple of them (a head is split across ranks only whole "
                         "or replicated)", n, kv_heads, what);
    return TQKV_OK;
}

void tp_kv_range(int kv_heads, int n, int r, int *h0, int *hn) {
    *h0 = r * kv_heads / n;
    *hn = kv_heads >= n ? kv_heads / n : 1;
}

void tp_vocab_range(int vocab, int n, int r, int *v0, int *v1, int *chunk) {
    int c = (vocab + n - 1) / n;
    c = (c + 7) / 8 * 8; /* packed heads slice on 8-row groups */
    *chunk = c;
    *v0 = r * c < vocab ? r * c : vocab;
    *v1 = (r + 1) * c < vocab ? (r + 1) * c : vocab;
}

// ---------------------------------------------------------------------------
// rank models and states
// ---------------------------------------------------------------------------

static void rank_model_free(tqkv_model *rm) {
    if (!rm) return;
#ifdef TQKV_HAVE_CUDA
    model_cuda_weights_free(rm->gpu_weights); /* its device states' weights (the GPU current) */
#endif
    for (int i = 0; i < rm->n_owned; i++) free(rm->owned[i]);
    free(rm->owned);
    free(rm->layers);
    free(rm);
}

/* A shallow copy of m (the mapping, embedding, norms shared) with rank r's geometry and
 * the architecture's shard of every layer and of the head. */
static tqkv_status rank_model_make(const tqkv_model *m, int r, int n, tqkv_model **out) {
    tqkv_model *rm = calloc(1, sizeof *rm);
    if (!rm) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    *rm = *m;
    rm->owned = NULL;
    rm->n_owned = rm->cap_owned = 0;
    rm->gpu_weights = NULL;
    rm->tp_models = NULL;
    rm->cfg.n_heads = m->cfg.n_heads / n;
    int h0;
    tp_kv_range(m->cfg.n_kv_heads, n, r, &h0, &rm->cfg.n_kv_heads);
    rm->cfg.intermediate_size = m->cfg.intermediate_size / n;
    rm->layers = calloc((size_t)m->cfg.n_layers, sizeof *rm->layers);
    tqkv_status rc = rm->layers ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    int v0, v1, chunk;
    tp_vocab_range(m->cfg.vocab_size, n, r, &v0, &v1, &chunk);
    if (rc == TQKV_OK && v1 <= v0)
        rc = tqkv_fail(TQKV_EINVAL, "tensor_parallel %d: rank %d gets no vocabulary rows", n, r);
    if (rc == TQKV_OK) rc = tp_weight_rows(rm, &m->lm_head, v0, v1, &rm->lm_head);
    if (rc == TQKV_OK) rc = m->ops->tp_shard(m, r, n, rm);
    if (rc != TQKV_OK) {
        rank_model_free(rm);
        return rc;
    }
    *out = rm;
    return TQKV_OK;
}

/* A model's kept rank models and communicators (tqkv_model.tp_models): set[N] for states
 * of N ranks. */
struct model_tp_models {
    struct {
        int         device[TP_MAX_RANKS];  /* rank r's GPU (its uploaded weights), -1: none */
        tqkv_model *rank[TP_MAX_RANKS];
        tp_comm    *comm[2];               /* [on_device]: shared by every sharded state of
                                            * this N (CPU: the CPU backend; device: NCCL or
                                            * device-local, on the ranks' GPUs) */
        int         users[2];              /* [on_device]: the states holding comm */
    } set[TP_MAX_RANKS + 1];
};

/* A kept communicator freed (the device's with its GPUs current in turn). */
static void tp_comm_drop(tp_comm *c, int on_device) {
    if (!c) return;
    tp_comm_free(c);
#ifdef TQKV_HAVE_CUDA
    if (on_device) model_cuda_select_device(0);
#endif
    (void)on_device;
}

void model_tp_models_free(tqkv_model *m) {
    struct model_tp_models *k = m ? m->tp_models : NULL;
    if (!k) return;
    int gpu = 0; /* a GPU was selected: GPU 0 current again after */
    for (int n = 1; n <= TP_MAX_RANKS; n++)
        for (int r = 0; r < n; r++) {
#ifdef TQKV_HAVE_CUDA
            if (k->set[n].device[r] >= 0) model_cuda_select_device(k->set[n].device[r]);
#endif
            gpu |= k->set[n].device[r] >= 0;
            rank_model_free(k->set[n].rank[r]);
        }
    for (int n = 1; n <= TP_MAX_RANKS; n++) /* left by states freed after the model: none */
        for (int d = 0; d < 2; d++) tp_comm_drop(k->set[n].comm[d], d);
#ifdef TQKV_HAVE_CUDA
    if (gpu) model_cuda_select_device(0);
#endif
    (void)gpu;
    free(k);
    m->tp_models = NULL;
}

/* Rank r's model: the model's kept one for this N, made and kept when missing. */
static tqkv_status rank_model_get(tqkv_model_state *s, int r) {
    model_tp *tp = s->tp;
    tqkv_model *m = (tqkv_model *)s->m; /* its cache of rank models (model_impl.h) */
    if (!m->tp_models) {
        struct model_tp_models *k = calloc(1, sizeof *k);
        if (!k) return tqkv_fail(TQKV_ENOMEM, "out of memory");
        for (int n = 0; n <= TP_MAX_RANKS; n++)
            for (int q = 0; q < TP_MAX_RANKS; q++) k->set[n].device[q] = -1;
        m->tp_models = k;
    }
    struct model_tp_models *k = m->tp_models;
    if (!k->set[tp->n].rank[r]) {
        tqkv_status rc = rank_model_make(s->m, r, tp->n, &k->set[tp->n].rank[r]);
        if (rc != TQKV_OK) return rc;
    }
    tp->model[r] = k->set[tp->n].rank[r];
    if (tp->on_device) k->set[tp->n].device[r] = tp->device[r];
    return TQKV_OK;
}

/* The communicator of the model's sharded states of tp->n ranks on this side (CPU or
 * device) into tp->comm: the kept one, or made and kept; one more user either way. The
 * engine makes a sharded state per newcomer's prefill, extract and prefix-cache entry: they
 * share one communicator (one ncclCommInitAll, one scratch) instead of one each. Sharing is
 * safe because a model's sharded states run from one thread and every forward waits for
 * its ranks' streams before it returns, so two states' collectives never overlap; a decode
 * graph that captured the scratch's address checks tp_comm_scratch_gen before it replays. */
static tqkv_status tp_comm_acquire(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    struct model_tp_models *k = ((tqkv_model *)s->m)->tp_models; /* made by rank_model_get */
    const int d = tp->on_device;
    if (!k->set[tp->n].comm[d]) {
        tp_comm *c = NULL;
        tqkv_status rc = TQKV_EUNSUPPORTED;
        if (!d) rc = tp_comm_init_cpu(&c, tp->n, s->p.threads);
#ifdef TQKV_HAVE_CUDA
        else rc = model_cuda_tp_comm_init(tp->n, tp->device, &c);
#endif
        if (rc != TQKV_OK) return rc;
        k->set[tp->n].comm[d] = c;
    }
    k->set[tp->n].users[d]++;
    tp->comm = k->set[tp->n].comm[d];
    return TQKV_OK;
}

/* tp->comm given back: freed with its last user (the NCCL communicators and the scratch
 * returned to the GPUs while the model has no sharded state of this N). */
static void tp_comm_release(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    struct model_tp_models *k = s->m->tp_models;
    const int d = tp->on_device;
    if (!tp->comm || !k || k->set[tp->n].comm[d] != tp->comm) return;
    tp->comm = NULL;
    if (--k->set[tp->n].users[d] > 0) return;
    tp_comm_drop(k->set[tp->n].comm[d], d);
    k->set[tp->n].comm[d] = NULL;
}

int model_tp_comm_users(const tqkv_model *m, int n, int on_device) {
    const struct model_tp_models *k = m ? m->tp_models : NULL;
    if (!k || n < 1 || n > TP_MAX_RANKS) return 0;
    return k->set[n].users[on_device ? 1 : 0];
}

static void rank_state_free(model_tp *tp, int r) {
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) model_cuda_select_device(tp->device[r]);
#endif
    if (tp->rank[r]) tqkv_model_state_free(tp->rank[r]);
    /* tp->model[r] is the model's (kept until tqkv_model_free) */
    tp->rank[r] = NULL;
    tp->model[r] = NULL;
}

void model_tp_free(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    if (!tp) return;
    if (s->layers == (tp->rank[0] ? tp->rank[0]->layers : NULL)) s->layers = NULL;
    for (int r = 0; r < tp->n; r++) {
        rank_state_free(tp, r);
        free(tp->head_out[r]);
    }
    free(tp->head_all);
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) model_cuda_tp_free(tp);
#endif
    tp_comm_release(s);
#ifdef TQKV_HAVE_CUDA
    if (tp->on_device) model_cuda_select_device(tp->device[0]);
#endif
    free(tp);
    s->tp = NULL;
}

/* The ranks' GPUs (r % visible GPUs) on the device (the communicator is the model's:
 * tp_comm_acquire, once the ranks exist). */
static tqkv_status tp_place(model_tp *tp) {
    if (!tp->on_device) return TQKV_OK;
#ifdef TQKV_HAVE_CUDA
    const int nd = model_cuda_device_count();
    if (nd < 1) return tqkv_fail(TQKV_EUNSUPPORTED, "--device cuda: no CUDA device is available");
    for (int r = 0; r < tp->n; r++) tp->device[r] = r % nd;
    return TQKV_OK;
#else
    return tqkv_fail(TQKV_EUNSUPPORTED, "tensor_parallel on the device: not a CUDA build");
#endif
}

tqkv_status model_tp_init(tqkv_model_state *s) {
    const int n = model_tp_ranks(&s->p);
    tqkv_status rc = model_tp_check(s->m, &s->p);
    if (rc != TQKV_OK || n < 1) return rc;
    model_tp *tp = calloc(1, sizeof *tp);
    if (!tp) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    s->tp = tp;
    tp->n = n;
    tp->on_device = s->p.device == 1;
    int v0, v1;
    tp_vocab_range(s->m->cfg.vocab_size, n, 0, &v0, &v1, &tp->vchunk);
    rc = tp_place(tp);
    tqkv_model_state_params pr = s->p;
    pr.tensor_parallel = 0;
    for (int r = 0; r < n && rc == TQKV_OK; r++) {
#ifdef TQKV_HAVE_CUDA
        if (tp->on_device) rc = model_cuda_set_device(tp->device[r]); /* its weights, caches */
#endif
        if (rc == TQKV_OK) rc = rank_model_get(s, r);
        if (rc == TQKV_OK) rc = tqkv_model_state_init(&tp->rank[r], tp->model[r], &pr);
    }
#ifdef TQKV_HAVE_CUDA
    if (rc == TQKV_OK && tp->on_device) rc = model_cuda_tp_setup(s);
#endif
    if (rc == TQKV_OK) rc = tp_comm_acquire(s);
    if (rc != TQKV_OK) {
        model_tp_free(s);
        return rc;
    }
    s->layers = tp->rank[0]->layers;
    return TQKV_OK;
}

void model_tp_sync(tqkv_model_state *s) {
    model_tp *tp = s->tp;
    for (int r = 0; r < tp->n; r++) {
        tp->rank[r]->rows = s->rows;
        tp->rank[r]->p.threads = s->p.threads;
    }
    tp_comm_set_threads(tp->comm, s->p.threads); /* the model's, shared: this state's threads */
    s->layers = tp->rank[0]->layers;
}

tqkv_status model_tp_head_buffers(model_tp *tp, size_t m) {
    const size_t need = m * (size_t)tp->vchunk;
    if (need <= tp->cap_head) return TQKV_OK;
    int ok = tqkv_grow_floats(&tp->head_all, need * (size_t)tp->n);
    for (int r = 0; r < tp->n && ok; r++) ok = tqkv_grow_floats(&tp->head_out[r], need);
    if (!ok) return tqkv_fail(TQKV_ENOMEM, "out of memory for the sharded logits");
    tp->cap_head = need;
    return TQKV_OK;
}

// ---------------------------------------------------------------------------
// reset
// ---------------------------------------------------------------------------

/* A sharded device state's reset: every rank's own reset (its device caches, then its host
 * layers), then the parent's rows. A failure on rank r > 0 leaves ranks of other row counts:
 * the state is then unusable until a reset succeeds (the device twins cannot build every
 * rank's caches before installing any). */
static tqkv_status tp_reset_device(tqkv_model_state *s, int rows) {
    model_tp *tp = s->tp;
    int *off = calloc((size_t)rows, sizeof(int)), *len = calloc((size_t)rows, sizeof(int));
    tqkv_status rc = off && len ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) {
#ifdef TQKV_HAVE_CUDA
        rc = model_cuda_set_device(tp->device[r]);
#endif
        if (rc == TQKV_OK) rc = tqkv_model_state_reset(tp->rank[r], rows);
    }
#ifdef TQKV_HAVE_CUDA
    model_cuda_select_device(tp->device[0]);
#endif
    if (rc != TQKV_OK) {
        free(off);
        free(len);
        return rc;
    }
    free(s->off);
    free(s->len);
    s->off = off;
    s->len = len;
    s->layers = tp->rank[0]->layers;
    if (rows != s->rows) s->cap_rn = 0;
    s->rows = s->p.rows = rows;
    return TQKV_OK;
}

tqkv_status model_tp_check_device(const tqkv_model_state *s) {
    const model_tp *tp = s->tp;
    const int R = s->rows;
    int *pos0 = malloc(sizeof(int) * (size_t)(R ? R : 1) * 2);
    if (!pos0) return tqkv_fail(TQKV_ENOMEM, "state check: out of memory");
    int *pos = pos0 + (R ? R : 1);
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r < tp->n && rc == TQKV_OK; r++) {
        const tqkv_model_state *q = tp->rank[r];
        if (q->rows != R) {
            rc = tqkv_fail(TQKV_ESTATE, "state: rank %d holds %d rows, the state %d", r, q->rows, R);
            break;
        }
        if ((rc = tqkv_model_state_check(q)) != TQKV_OK) break;
        if (tqkv_model_state_spec_active(q) != tqkv_model_state_spec_active(tp->rank[0])) {
            rc = tqkv_fail(TQKV_ESTATE, "state: rank %d %s in a spec round, rank 0 %s", r,
                           tqkv_model_state_spec_active(q) ? "is" : "is not",
                           tqkv_model_state_spec_active(q) ? "is not" : "is");
            break;
        }
        if ((rc = tqkv_model_state_offsets(q, r ? pos : pos0)) != TQKV_OK) break;
        for (int i = 0; i < R && r; i++)
            if (pos[i] != pos0[i]) {
                rc = tqkv_fail(TQKV_ESTATE, "state: row %d holds %d tokens on rank %d, %d on "
                               "rank 0", i, pos[i], r, pos0[i]);
                break;
            }
    }
    free(pos0);
    return rc;
}

tqkv_status model_tp_reset(tqkv_model_state *s, int rows) {
    model_tp *tp = s->tp;
    if (tp->on_device) return tp_reset_device(s, rows);
    const int L = s->m->cfg.n_layers, N = tp->n;
    tqkv_batch **layers[TP_MAX_RANKS] = {0};
    model_recurrent *rec[TP_MAX_RANKS] = {0}; /* fresh recurrent rows (hybrid graphs) */
    int *off[TP_MAX_RANKS + 1] = {0}, *len[TP_MAX_RANKS + 1] = {0}; /* [rows]; [N]: parent */
    tqkv_status rc = TQKV_OK;
    for (int r = 0; r <= N && rc == TQKV_OK; r++) {
        off[r] = calloc((size_t)rows, sizeof(int));
        len[r] = calloc((size_t)rows, sizeof(int));
        if (!off[r] || !len[r]) rc = tqkv_fail(TQKV_ENOMEM, "out of memory");
        else if (r < N) rc = model_state_make_layers(tp->model[r], &s->p, rows, &layers[r]);
        if (rc == TQKV_OK && r < N && tp->rank[r]->rec)
            rc = rec_init(&rec[r], &tp->model[r]->cfg, rows);
    }
    if (rc != TQKV_OK) {
        for (int r = 0; r <= N; r++) {
            if (r < N) model_state_free_layers(layers[r], L);
            if (r < N) rec_free(rec[r]);
            free(off[r]);
            free(len[r]);
        }
        return rc;
    }
    for (int r = 0; r <= N; r++) {
        tqkv_model_state *q = r < N ? tp->rank[r] : s;
        if (r < N) model_state_free_layers(q->layers, L);
        if (r < N && rec[r]) {
            rec_free(q->rec);
            q->rec = rec[r];
        }
        free(q->off);
        free(q->len);
        q->layers = r < N ? layers[r] : layers[0];
        q->off = off[r];
        q->len = len[r];
        if (rows != q->rows) q->cap_rn = 0; /* row-shaped buffers are re-sized on next use */
        q->rows = q->p.rows = rows;
    }
    return TQKV_OK;
}

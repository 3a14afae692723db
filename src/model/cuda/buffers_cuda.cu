/*
 * buffers_cuda.cu - a device state's storage (model_cuda_impl.h): its per-layer device caches
 * and recurrent rows (made, installed - also by state_cuda.cu's row operations and import -
 * and freed), and its scratch buffers (device and pinned host), grown on demand.
 * Owns: allocation sizes and the generation counter's bumps (every buffer replaced bumps
 * g->gen, so that a captured decode graph holding an old pointer is never replayed).
 * Must not: launch kernels or read the model's weights.
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "model/model_impl.h"
#include "util/common.h"
}
#include "model/ops/gemm_cuda.h"
#include "model/cuda/model_cuda_impl.h"

#define ck      mc_ck
#define dmalloc mc_dmalloc

/* The recurrent rows (Qwen 3.5), after the work queued on them. */
static void free_rec(model_cuda *g) {
    mc_rec *rc = &g->rec;
    if (g->stream) cudaStreamSynchronize(g->stream); /* nothing queued still reads the rows */
    cudaFree(rc->state);
    cudaFree(rc->snap);
    free(rc->tokens);
    free(rc->spec_steps);
    rc->state = rc->snap = NULL;
    rc->tokens = rc->spec_steps = NULL;
    rc->spec_active = rc->spec_cap = 0;
}

void mc_free_caches(model_cuda *g) {
    if (g->kv) {
        for (int l = 0; l < g->m->cfg.n_layers; l++) tqkv_cuda_kv_free(g->kv[l]);
        free(g->kv);
        g->kv = NULL;
    }
    free_rec(g);
    g->broken = 0; /* new rows */
}

void mc_free_cache_array(cuda_kv **kv, int L) {
    if (!kv) return;
    for (int l = 0; l < L; l++) tqkv_cuda_kv_free(kv[l]);
    free(kv);
}

tqkv_status mc_rec_alloc(const model_cuda *g, int rows, float **state, int **tokens) {
    *state = NULL;
    *tokens = NULL;
    if (!g->rec.n_lin) return TQKV_OK;
    const size_t bytes = (size_t)rows * g->rec.row_floats * sizeof(float);
    tqkv_status st = dmalloc((void **)state, bytes);
    /* on g's stream: everything that reads the rows runs there after it */
    if (!st) st = ck(cudaMemsetAsync(*state, 0, bytes ? bytes : 16, g->stream), "recurrent rows");
    if (!st) {
        *tokens = (int *)calloc((size_t)(rows ? rows : 1), sizeof(int));
        if (!*tokens) st = tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    if (st) {
        cudaFree(*state);
        *state = NULL;
    }
    return st;
}

/* Drop the decode step's executable graph (it holds pointers that are about to go stale;
 * the generation bump makes every key taken before unequal to the next ones). */
void mc_graph_drop(model_cuda *g) {
    if (g->graph.exec) {
        cudaGraphExecDestroy(g->graph.exec);
        g->graph.stats.invalidations++;
    }
    g->graph.exec = NULL;
    g->graph.key.valid = g->graph.pending.valid = 0;
    g->gen++;
}

/* What an install of new caches puts into a twin, made before it changes anything (the
 * fallible half: the per-row arrays, the caches moved to the twin's stream). */
struct model_cuda_rows {
    cuda_kv    **kv;          /* [L] new caches (NULL entries: layers without KV) */
    int          L;
    float       *rec_state;   /* [rows, row_floats] device, or NULL */
    int         *rec_tokens;  /* [rows] host, or NULL */
    int         *off, *steps; /* [rows] the twin's offsets, recurrent spec steps (or NULL) */
    int          rows;
    cudaStream_t stream;      /* the twin's: the recurrent rows' zeroing / copies queued there */
};

extern "C" void model_cuda_rows_free(model_cuda_rows *b) {
    if (!b) return;
    mc_free_cache_array(b->kv, b->L);
    if (b->rec_state) cudaStreamSynchronize(b->stream); /* its zeroing / copies may be queued */
    cudaFree(b->rec_state);
    free(b->rec_tokens);
    free(b->off);
    free(b->steps);
    free(b);
}

tqkv_status mc_rows_make(model_cuda *g, cuda_kv **kv, float *rec_state, int *rec_tokens, int rows,
                         model_cuda_rows **out) {
    model_cuda_rows *b = (model_cuda_rows *)calloc(1, sizeof *b);
    const int L = g->m->cfg.n_layers;
    if (!b) { /* take ownership also on failure */
        mc_free_cache_array(kv, L);
        if (rec_state) cudaStreamSynchronize(g->stream);
        cudaFree(rec_state);
        free(rec_tokens);
        return tqkv_fail(TQKV_ENOMEM, "out of memory");
    }
    b->kv = kv;
    b->L = L;
    b->rec_state = rec_state;
    b->rec_tokens = rec_tokens;
    b->rows = rows;
    b->stream = g->stream;
    b->off = (int *)calloc((size_t)(rows ? rows : 1), sizeof(int));
    b->steps = g->rec.n_lin ? (int *)calloc((size_t)(rows ? rows : 1), sizeof(int)) : NULL;
    tqkv_status st = b->off && (b->steps || !g->rec.n_lin) ? TQKV_OK : tqkv_fail(TQKV_ENOMEM, "out of memory");
    if (!st && g->rec.n_lin && (!rec_state || !rec_tokens))
        st = tqkv_fail(TQKV_EINVAL, "device state: install without recurrent rows");
    for (int l = 0; l < L && !st && kv; l++)
        if (kv[l]) st = tqkv_cuda_kv_set_stream(kv[l], g->stream);
    if (st) {
        model_cuda_rows_free(b);
        return st;
    }
    *out = b;
    return TQKV_OK;
}

extern "C" void model_cuda_rows_install(model_cuda *g, model_cuda_rows *b) {
    mc_graph_drop(g);
    if (b->kv) {
        mc_free_caches(g);
        g->kv = b->kv;
    } else {
        free_rec(g); /* the caches changed their rows in place */
    }
    g->rec.state = b->rec_state;
    g->rec.tokens = b->rec_tokens;
    g->rec.spec_steps = b->steps;
    free(g->off);
    g->off = b->off;
    if (b->rows != g->rows) {
        /* row-shaped buffers are sized by capacity (mc_ensure_scratch grows them), so a
         * running batch whose rows come and go keeps them; one that holds 4x the tokens of
         * the new rows (and more than 256) gives them back */
        if (g->cap_t > 4 * (size_t)(b->rows > 64 ? b->rows : 64)) mc_free_scratch(g);
        g->rows = b->rows;
    }
    free(b);
}

tqkv_status mc_install_caches(model_cuda *g, cuda_kv **kv, float *rec_state, int *rec_tokens,
                              int rows) {
    model_cuda_rows *b = NULL;
    const tqkv_status st = mc_rows_make(g, kv, rec_state, rec_tokens, rows, &b);
    if (!st) model_cuda_rows_install(g, b);
    return st;
}

tqkv_status mc_make_caches(model_cuda *g, int rows) {
    const tqkv_model_config *c = &g->m->cfg;
    const tqkv_model_state_params *p = &g->p;
    cuda_kv **kv = (cuda_kv **)calloc((size_t)c->n_layers, sizeof *kv);
    if (!kv) return tqkv_fail(TQKV_ENOMEM, "out of memory");
    tqkv_status st = TQKV_OK;
    for (int l = 0; l < c->n_layers && !st; l++) {
        /* recurrent rows (g->rec), or a KV-shared layer (reads its donor's cache) */
        if (!mc_layer_has_kv(g->m, l)) continue;
        tqkv_layer_info li;
        (void)tqkv_model_layer_info(g->m, l, &li);
        tqkv_cache_config cc = tqkv_cache_config_default();
        cc.kv_heads = li.kv_heads;
        cc.head_dim = li.head_dim;
        tqkv_kv_layer_formats(p, l, &cc.k_format, &cc.v_format); /* layer l's own pair */
        /* f32/f32: the dense bf16 cache, without a window (the CPU's f32 planes have none) */
        const int bf = cc.k_format == TQKV_F32 && cc.v_format == TQKV_F32;
        cc.seed = p->kv_seed + (uint64_t)l;
        cc.window = bf ? 0 : p->window;
        cc.window_slack = p->window_slack;
        st = tqkv_cuda_kv_init(&kv[l], &cc, bf, rows, 256);
    }
    float *rs = NULL;
    int *rt = NULL;
    if (!st) st = mc_rec_alloc(g, rows, &rs, &rt);
    if (st) {
        mc_free_cache_array(kv, c->n_layers);
        return st;
    }
    return mc_install_caches(g, kv, rs, rt, rows);
}

/* Every scratch buffer (device and pinned host); waits for the stream first. */
void mc_free_scratch(model_cuda *g) {
    if (g->stream) cudaStreamSynchronize(g->stream);
    void *d[] = {g->x,  g->xn, g->qkv, g->att, g->gu, g->hh,   g->tmp, g->rope, g->logits, g->tinfo,
                 g->qb, g->ob, g->kb,  g->vb,  g->xf, g->cv,  g->slot, g->ple,    g->pg};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) cudaFree(d[i]);
    g->x = g->xn = g->qkv = g->att = g->gu = g->hh = g->tmp = g->rope = g->logits = NULL;
    g->ple = g->pg = NULL;
    g->cv = NULL;
    g->slot = NULL;
    cudaFreeHost(g->h_slot);
    g->h_slot = NULL;
    g->qb = g->ob = g->kb = g->vb = NULL;
    g->xf = NULL;
    g->tinfo = NULL;
    cudaFree(g->pick_in);
    cudaFree(g->pick_rec);
    g->pick_in = NULL;
    g->pick_rec = NULL;
    cudaFreeHost(g->h_pick_in);
    cudaFreeHost(g->h_pick_rec);
    g->h_pick_in = NULL;
    g->h_pick_rec = NULL;
    g->cap_pick_in = g->cap_pick_rec = 0;
    cudaFreeHost(g->h_rope);
    cudaFreeHost(g->h_tinfo);
    cudaFreeHost(g->h_logits);
    free(g->h_lo);
    free(g->h_hi);
    g->h_rope = g->h_logits = NULL;
    g->h_tinfo = g->h_lo = g->h_hi = NULL;
    g->cap_t = g->cap_rn = g->cap_logits = g->cap_hlogits = 0;
    g->gen++;
}

static tqkv_status pinned_alloc(void **p, size_t bytes) {
    *p = NULL;
    return ck(cudaMallocHost(p, bytes ? bytes : 16), "cudaMallocHost (model)");
}

/* Replace *p (device memory, or pinned host memory) by a new allocation of `bytes` once
 * nothing queued reads it; the generation bump makes graphs holding the old pointer stale.
 * *cap is set to `cap` on success, 0 otherwise. */
tqkv_status mc_regrow(model_cuda *g, void **p, int pinned, size_t bytes, size_t *cap, size_t new_cap) {
    cudaStreamSynchronize(g->stream);
    g->gen++;
    if (pinned) cudaFreeHost(*p);
    else cudaFree(*p);
    *p = NULL;
    *cap = 0;
    const tqkv_status st = pinned ? pinned_alloc(p, bytes) : dmalloc(p, bytes);
    if (!st) *cap = new_cap;
    return st;
}

/* Pinned host staging for decode logits: rows x V floats. */
tqkv_status mc_ensure_hlogits(model_cuda *g, size_t rows) {
    if (rows <= g->cap_hlogits) return TQKV_OK;
    return mc_regrow(g, (void **)&g->h_logits, 1, rows * (size_t)g->m->cfg.vocab_size * 4, &g->cap_hlogits, rows);
}

/* Device logits rows (LOGITS_ALL: T, LAST: rows). */
tqkv_status mc_ensure_logits(model_cuda *g, size_t rows) {
    if (rows <= g->cap_logits) return TQKV_OK;
    return mc_regrow(g, (void **)&g->logits, 0, rows * (size_t)g->m->cfg.vocab_size * 4, &g->cap_logits, rows);
}

/* The pick's upload (in_bytes: device and pinned) and records (rec_words int32: device and
 * pinned), grown geometrically (each regrow bumps the generation). */
tqkv_status mc_ensure_pick(model_cuda *g, size_t in_bytes, size_t rec_words) {
    tqkv_status st = TQKV_OK;
    size_t pinned_cap = 0;
    if (in_bytes > g->cap_pick_in) {
        const size_t cap = in_bytes < 4096 ? 4096 : in_bytes + in_bytes / 2;
        st = mc_regrow(g, &g->pick_in, 0, cap, &g->cap_pick_in, cap);
        if (!st) st = mc_regrow(g, &g->h_pick_in, 1, cap, &pinned_cap, cap);
        if (st) g->cap_pick_in = 0; /* both again next time */
    }
    if (!st && rec_words > g->cap_pick_rec) {
        const size_t cap = rec_words < 1024 ? 1024 : rec_words + rec_words / 2;
        st = mc_regrow(g, (void **)&g->pick_rec, 0, cap * 4, &g->cap_pick_rec, cap);
        if (!st) st = mc_regrow(g, (void **)&g->h_pick_rec, 1, cap * 4, &pinned_cap, cap);
        if (st) g->cap_pick_rec = 0;
    }
    return st;
}

int mc_rope_width(const tqkv_model *m) {
    const model_arch_cuda_ops *ao = m->ops->cuda;
    if (ao && ao->rope_width) return ao->rope_width(m); /* the architecture's own tables */
    return m->cfg.head_dim;
}

tqkv_status mc_ensure_scratch(model_cuda *g, size_t T, size_t RN) {
    const tqkv_model_config *c = &g->m->cfg;
    const model_arch_cuda_ops *ao = g->arch_ops;
    const size_t H = c->hidden_size, I = c->intermediate_size, RW = (size_t)mc_rope_width(g->m),
                 QD = g->max_qd, KD = g->max_kd,
                 P = ao && ao->ple_width ? (size_t)ao->ple_width(g->m) : 0,
                 LP = P * (size_t)c->n_layers;
    /* projection row width: QS (Qwen 3.5: a gate per query) or a linear layer's row */
    const size_t VD = (size_t)c->lin_v_heads * c->lin_v_dim,
                 CD = 2 * (size_t)c->lin_k_heads * c->lin_k_dim + VD;
    size_t PW = (c->attn_output_gate ? 2 * QD : QD) + 2 * KD, AW = QD;
    if (g->rec.n_lin) {
        PW = CD + VD + 2 * (size_t)c->lin_v_heads > PW ? CD + VD + 2 * (size_t)c->lin_v_heads : PW;
        AW = VD > AW ? VD : AW;
    }
    tqkv_status st = TQKV_OK;
    if (T > g->cap_t) {
        const size_t t = T < 32 ? 32 : T;
        mc_free_scratch(g);
        st = dmalloc((void **)&g->x, t * H * 4);
        if (!st) st = dmalloc((void **)&g->xn, t * H * 4);
        if (!st) st = dmalloc((void **)&g->qkv, t * PW * 4);
        if (!st) st = dmalloc((void **)&g->att, t * AW * 4);
        if (!st) st = dmalloc((void **)&g->slot, t * 4);
        if (!st) st = pinned_alloc((void **)&g->h_slot, t * 4);
        if (!st && g->rec.n_lin) st = dmalloc((void **)&g->cv, t * CD * 4);
        if (!st) st = dmalloc((void **)&g->gu, t * 2 * I * 4);
        if (!st) st = dmalloc((void **)&g->hh, t * I * 4);
        if (!st) st = dmalloc((void **)&g->tmp, t * H * 4);
        if (!st) st = dmalloc((void **)&g->rope, t * RW * 4);
        if (!st && P) st = dmalloc((void **)&g->ple, t * LP * 4);
        if (!st && P) st = dmalloc((void **)&g->pg, t * P * 4);
        if (!st) st = dmalloc((void **)&g->tinfo, t * 3 * 4);
        size_t kmax = H > AW ? H : AW;
        kmax = kmax > I ? kmax : I;
        kmax = kmax > P ? kmax : P; /* Gemma 4's per-layer projection */
        const size_t MI = (size_t)c->moe_intermediate_size, MS = (size_t)c->moe_shared_intermediate_size;
        kmax = kmax > MI ? kmax : MI; /* the experts' down projections */
        kmax = kmax > MS ? kmax : MS; /* the shared expert's */
        if (!st) st = dmalloc(&g->xf, tqkv_cuda_gemm_xf_bytes(t, kmax));
        if (!st) st = pinned_alloc((void **)&g->h_rope, t * RW * 4);
        if (!st) st = pinned_alloc((void **)&g->h_tinfo, t * 3 * 4);
        if (st) {
            mc_free_scratch(g);
            return st;
        }
        g->cap_t = t;
    }
    if (RN > g->cap_rn) {
        cudaStreamSynchronize(g->stream);
        g->gen++;
        cudaFree(g->qb); cudaFree(g->ob); cudaFree(g->kb); cudaFree(g->vb);
        g->qb = g->ob = g->kb = g->vb = NULL;
        free(g->h_lo);
        free(g->h_hi);
        g->h_lo = g->h_hi = NULL;
        g->cap_rn = 0;
        st = dmalloc((void **)&g->qb, RN * QD * 4);
        if (!st) st = dmalloc((void **)&g->ob, RN * QD * 4);
        if (!st) st = dmalloc((void **)&g->kb, RN * KD * 4);
        if (!st) st = dmalloc((void **)&g->vb, RN * KD * 4);
        if (!st) {
            g->h_lo = (int32_t *)malloc(RN * 4);
            g->h_hi = (int32_t *)malloc(RN * 4);
            if (!g->h_lo || !g->h_hi) st = tqkv_fail(TQKV_ENOMEM, "out of memory");
        }
        if (st) {
            mc_free_scratch(g);
            return st;
        }
        g->cap_rn = RN;
    }
    return TQKV_OK;
}

/*
 * moe_derive.h - Qwen 3.5 MoE checkpoints derived from the dense Qwen 3.5 golden
 * (tests/golden/qwen35/hybrid) for the tests that need no transformers goldens: the same
 * embedding, mixers, norms and head, with each layer's MLP replaced by a sparse block
 * (router, E experts in the fused or the per-expert layout, a shared expert and its gate).
 * dense_equiv: two experts that are both the dense MLP, top 1 (weight p / p = 1 exactly)
 * and a shared expert whose down projection is zero, so the logits must equal the dense
 * graph's bit for bit; otherwise every new weight is random (bf16, seed given). wrapped:
 * the same checkpoint as the multimodal wrapper's text model.
 * Must not: decide what a test asserts.
 */
#ifndef TQKV_TEST_MOE_DERIVE_H
#define TQKV_TEST_MOE_DERIVE_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model_helpers.h"
#include "testutil.h"

typedef struct {
    int      E, K, I, S;  /* experts, top-k, expert width, shared expert width */
    int      fused;       /* experts.gate_up_proj / down_proj instead of one tensor per expert */
    int      dense_equiv; /* see the top of the file (E = 2, K = 1, I = the dense width) */
    uint64_t seed;
    int      wrapped;     /* as Qwen3_5MoeForConditionalGeneration: text_config, tensors under
                             model.language_model. (the same weights otherwise) */
} derive_spec;

typedef struct {
    char     name[256];
    int      nd;
    int64_t  shape[3];
    int      f32;   /* F32, else BF16 */
    uint8_t *data;  /* (owned) */
    size_t   nbytes;
} dv_tensor;

typedef struct {
    dv_tensor **t;  /* each tensor allocated alone: a pointer dv_add returned stays valid
                       while later adds grow the list */
    int         n, cap;
} dv_list;

static inline dv_tensor *dv_add_t(dv_list *l, const char *name, int nd, const int64_t *shape,
                                  int f32) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->t = realloc(l->t, sizeof(dv_tensor *) * (size_t)l->cap);
        assert_non_null(l->t);
    }
    dv_tensor *t = calloc(1, sizeof *t);
    assert_non_null(t);
    l->t[l->n++] = t;
    snprintf(t->name, sizeof t->name, "%s", name);
    t->nd = nd;
    t->f32 = f32;
    size_t n = 1;
    for (int d = 0; d < nd; d++) n *= (size_t)(t->shape[d] = shape[d]);
    t->nbytes = (f32 ? 4 : 2) * n;
    t->data = calloc(1, t->nbytes);
    assert_non_null(t->data);
    return t;
}

static inline dv_tensor *dv_add(dv_list *l, const char *name, int nd, const int64_t *shape) {
    return dv_add_t(l, name, nd, shape, 0);
}

/* mean + N(0, sd^2) values into t (from byte offset at, n values; bf16 truncated). */
static inline void dv_fill(dv_tensor *t, size_t at, size_t n, float mean, float sd, test_rng *r) {
    for (size_t i = 0; i < n; i++) {
        float f = mean + (float)rng_normal(r) * sd;
        if (t->f32) {
            memcpy(t->data + at + 4 * i, &f, 4);
            continue;
        }
        uint32_t u;
        memcpy(&u, &f, 4);
        uint16_t h = (uint16_t)(u >> 16);
        memcpy(t->data + at + 2 * i, &h, 2);
    }
}

/* Random N(0, sd^2) into t (from byte offset at, n values). */
static inline void dv_random(dv_tensor *t, size_t at, size_t n, float sd, test_rng *r) {
    dv_fill(t, at, n, 0.0f, sd, r);
}

static inline void dv_write(const dv_list *l, const char *path) {
    cJSON *h = cJSON_CreateObject();
    size_t off = 0;
    for (int i = 0; i < l->n; i++) {
        cJSON *e = cJSON_AddObjectToObject(h, l->t[i]->name);
        cJSON_AddStringToObject(e, "dtype", l->t[i]->f32 ? "F32" : "BF16");
        cJSON *sh = cJSON_AddArrayToObject(e, "shape");
        for (int d = 0; d < l->t[i]->nd; d++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)l->t[i]->shape[d]));
        cJSON *o = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + l->t[i]->nbytes)));
        off += l->t[i]->nbytes;
    }
    char *txt = cJSON_PrintUnformatted(h);
    size_t n = strlen(txt), pad = (8 - n % 8) % 8;
    uint64_t hl = n + pad;
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite(&hl, 8, 1, f);
    fwrite(txt, 1, n, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    for (int i = 0; i < l->n; i++) fwrite(l->t[i]->data, 1, l->t[i]->nbytes, f);
    fclose(f);
    free(txt);
    cJSON_Delete(h);
}

/* The source tensor `name` of the dense checkpoint (header h, data base). */
static inline const uint8_t *dv_src(const cJSON *h, const uint8_t *base, const char *name,
                                    size_t *nbytes) {
    const cJSON *e = cJSON_GetObjectItem(h, name);
    assert_non_null(e);
    const cJSON *o = cJSON_GetObjectItem(e, "data_offsets");
    size_t a = (size_t)cJSON_GetArrayItem(o, 0)->valuedouble, b = (size_t)cJSON_GetArrayItem(o, 1)->valuedouble;
    *nbytes = b - a;
    return base + a;
}

/* The tensors of srcdir/model.safetensors into l, except those whose name contains skip
 * (NULL: none), renamed under model.language_model. when wrapped; returns the header
 * (*b: the file, *base: its data) for dv_src. */
static inline cJSON *dv_read(const char *srcdir, const char *skip, int wrapped, dv_list *l,
                             uint8_t **b, const uint8_t **base) {
    char p[1200];
    size_t len = 0;
    snprintf(p, sizeof p, "%s/model.safetensors", srcdir);
    *b = (uint8_t *)slurp(p, &len);
    assert_non_null(*b);
    uint64_t hl;
    memcpy(&hl, *b, 8);
    cJSON *h = cJSON_ParseWithLength((const char *)*b + 8, (size_t)hl), *e;
    assert_non_null(h);
    *base = *b + 8 + hl;
    cJSON_ArrayForEach(e, h) {
        if (!strcmp(e->string, "__metadata__") || (skip && strstr(e->string, skip))) continue;
        const cJSON *sh = cJSON_GetObjectItem(e, "shape"), *v;
        int64_t shape[3];
        int nd = 0;
        cJSON_ArrayForEach(v, sh) shape[nd++] = (int64_t)v->valuedouble;
        const int f32 = !strcmp(cJSON_GetObjectItem(e, "dtype")->valuestring, "F32");
        size_t nb;
        const uint8_t *sdata = dv_src(h, *base, e->string, &nb);
        char nm[256];
        if (wrapped && !strncmp(e->string, "model.", 6))
            snprintf(nm, sizeof nm, "model.language_model.%s", e->string + 6);
        else
            snprintf(nm, sizeof nm, "%s", e->string);
        dv_tensor *t = dv_add_t(l, nm, nd, shape, f32);
        assert_int_equal(t->nbytes, nb);
        memcpy(t->data, sdata, nb);
    }
    return h;
}

/* Layer l's sparse block into out under opre, from the dense MLP under pre
 * ("model.layers.l.mlp."). */
static inline void dv_block(dv_list *out, const cJSON *h, const uint8_t *base, const char *pre,
                            const char *opre, int H, int Id, const derive_spec *d, test_rng *r) {
    char name[200];
    const int E = d->E, I = d->I, S = d->S;
    snprintf(name, sizeof name, "%sgate.weight", opre);
    dv_random(dv_add(out, name, 2, (int64_t[]){E, H}), 0, (size_t)E * H, 1.0f, r);
    size_t gb, ub, db;
    snprintf(name, sizeof name, "%sgate_proj.weight", pre);
    const uint8_t *g0 = dv_src(h, base, name, &gb);
    snprintf(name, sizeof name, "%sup_proj.weight", pre);
    const uint8_t *u0 = dv_src(h, base, name, &ub);
    snprintf(name, sizeof name, "%sdown_proj.weight", pre);
    const uint8_t *d0 = dv_src(h, base, name, &db);
    const size_t gu = (size_t)I * H * 2; /* bytes of one [I, H] */
    dv_tensor *fgu = NULL, *fd = NULL;
    if (d->fused) {
        snprintf(name, sizeof name, "%sexperts.gate_up_proj", opre);
        fgu = dv_add(out, name, 3, (int64_t[]){E, 2 * I, H});
        snprintf(name, sizeof name, "%sexperts.down_proj", opre);
        fd = dv_add(out, name, 3, (int64_t[]){E, H, I});
    }
    for (int e = 0; e < E; e++) {
        dv_tensor *tg = fgu, *tu = fgu, *td = fd;
        size_t ag = 2 * (size_t)e * gu, au = ag + gu, ad = (size_t)e * gu;
        if (!d->fused) {
            snprintf(name, sizeof name, "%sexperts.%d.gate_proj.weight", opre, e);
            tg = dv_add(out, name, 2, (int64_t[]){I, H});
            snprintf(name, sizeof name, "%sexperts.%d.up_proj.weight", opre, e);
            tu = dv_add(out, name, 2, (int64_t[]){I, H});
            snprintf(name, sizeof name, "%sexperts.%d.down_proj.weight", opre, e);
            td = dv_add(out, name, 2, (int64_t[]){H, I});
            ag = au = ad = 0;
        }
        if (d->dense_equiv) {
            assert_int_equal(gb, gu);
            assert_int_equal(I, Id);
            memcpy(tg->data + ag, g0, gb);
            memcpy(tu->data + au, u0, ub);
            memcpy(td->data + ad, d0, db);
        } else {
            dv_random(tg, ag, (size_t)I * H, 1.0f / sqrtf((float)H), r);
            dv_random(tu, au, (size_t)I * H, 1.0f / sqrtf((float)H), r);
            dv_random(td, ad, (size_t)I * H, 1.0f / sqrtf((float)I), r);
        }
    }
    snprintf(name, sizeof name, "%sshared_expert.gate_proj.weight", opre);
    dv_random(dv_add(out, name, 2, (int64_t[]){S, H}), 0, (size_t)S * H, 1.0f / sqrtf((float)H), r);
    snprintf(name, sizeof name, "%sshared_expert.up_proj.weight", opre);
    dv_random(dv_add(out, name, 2, (int64_t[]){S, H}), 0, (size_t)S * H, 1.0f / sqrtf((float)H), r);
    snprintf(name, sizeof name, "%sshared_expert.down_proj.weight", opre);
    dv_tensor *sd = dv_add(out, name, 2, (int64_t[]){H, S});
    if (!d->dense_equiv) dv_random(sd, 0, (size_t)S * H, 1.0f / sqrtf((float)S), r);
    snprintf(name, sizeof name, "%sshared_expert_gate.weight", opre);
    dv_random(dv_add(out, name, 2, (int64_t[]){1, H}), 0, (size_t)H, 1.0f / sqrtf((float)H), r);
}

/* The parsed config.json of the checkpoint at rel (its directory into src). */
static inline cJSON *dv_read_config(const char *rel, char *src, size_t cap) {
    char p[1200];
    source_path(rel, src, cap);
    snprintf(p, sizeof p, "%s/config.json", src);
    char *ctext = slurp(p, NULL);
    assert_non_null(ctext);
    cJSON *c = cJSON_Parse(ctext);
    free(ctext);
    assert_non_null(c);
    return c;
}

/* dst/config.json from c (freed). */
static inline void dv_write_config(const char *dst, cJSON *c) {
    char p[1200];
    char *out = cJSON_Print(c);
    snprintf(p, sizeof p, "%s/config.json", dst);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    fputs(out, f);
    fclose(f);
    free(out);
    cJSON_Delete(c);
}

/* Free every tensor of l and the list. */
static inline void dv_list_free(dv_list *l) {
    for (int i = 0; i < l->n; i++) {
        free(l->t[i]->data);
        free(l->t[i]);
    }
    free(l->t);
    memset(l, 0, sizeof *l);
}

/* dst/model.safetensors from l, then l freed. */
static inline void dv_write_free(const char *dst, dv_list *l) {
    char p[1200];
    snprintf(p, sizeof p, "%s/model.safetensors", dst);
    dv_write(l, p);
    dv_list_free(l);
}

/* dst/model.safetensors from l; frees l, the source header h and file b. */
static inline void dv_finish(const char *dst, dv_list *l, cJSON *h, uint8_t *b) {
    dv_write_free(dst, l);
    cJSON_Delete(h);
    free(b);
}

/* dst/{config.json, model.safetensors}: the derived checkpoint (dst must exist). */
static inline void derive_qwen35moe(const char *dst, const derive_spec *d) {
    char src[1024];
    cJSON *c = dv_read_config("tests/golden/qwen35/hybrid", src, sizeof src);
    const int H = cJSON_GetObjectItem(c, "hidden_size")->valueint,
              Id = cJSON_GetObjectItem(c, "intermediate_size")->valueint,
              NL = cJSON_GetObjectItem(c, "num_hidden_layers")->valueint;
    cJSON_DeleteItemFromObject(c, "architectures");
    cJSON_DeleteItemFromObject(c, "model_type");
    cJSON_DeleteItemFromObject(c, "intermediate_size");
    cJSON *a = cJSON_AddArrayToObject(c, "architectures");
    cJSON_AddItemToArray(a, cJSON_CreateString("Qwen3_5MoeForCausalLM"));
    cJSON_AddStringToObject(c, "model_type", "qwen3_5_moe_text");
    cJSON_AddNumberToObject(c, "num_experts", d->E);
    cJSON_AddNumberToObject(c, "num_experts_per_tok", d->K);
    cJSON_AddNumberToObject(c, "moe_intermediate_size", d->I);
    cJSON_AddNumberToObject(c, "shared_expert_intermediate_size", d->S);
    if (d->wrapped) {
        cJSON *w = cJSON_CreateObject(), *wa = cJSON_AddArrayToObject(w, "architectures");
        cJSON_AddItemToArray(wa, cJSON_CreateString("Qwen3_5MoeForConditionalGeneration"));
        cJSON_AddStringToObject(w, "model_type", "qwen3_5_moe");
        cJSON_AddItemToObject(w, "text_config", c);
        cJSON_AddItemToObject(w, "vision_config", cJSON_CreateObject());
        c = w;
    }
    dv_write_config(dst, c);

    dv_list l = {0};
    uint8_t *b = NULL;
    const uint8_t *base = NULL;
    cJSON *h = dv_read(src, ".mlp.", d->wrapped, &l, &b, &base);
    test_rng r;
    rng_init(&r, d->seed);
    for (int ly = 0; ly < NL; ly++) {
        char pre[64], out_pre[96];
        snprintf(pre, sizeof pre, "model.layers.%d.mlp.", ly);
        snprintf(out_pre, sizeof out_pre, "model.%slayers.%d.mlp.",
                 d->wrapped ? "language_model." : "", ly);
        dv_block(&l, h, base, pre, out_pre, H, Id, d, &r);
    }
    dv_finish(dst, &l, h, b);
}

/* Gemma 4 with MoE blocks derived from tests/golden/gemma4/plain (F32): every layer keeps
 * its MLP and gains router.{proj.weight, scale, per_expert_scale}, experts.{gate_up_proj,
 * down_proj} (fused) and the three block norms. near_dense: post_feedforward_layernorm_2
 * is zero (the experts add nothing) and post_feedforward_layernorm_1 one, so the logits
 * are the dense graph's up to a second RMSNorm of the MLP output. */
typedef struct {
    int      E, K, I;
    int      near_dense;
    uint64_t seed;
} derive_g4_spec;

static inline void derive_gemma4moe(const char *dst, const derive_g4_spec *d) {
    char src[1024];
    cJSON *c = dv_read_config("tests/golden/gemma4/plain", src, sizeof src);
    const int H = cJSON_GetObjectItem(c, "hidden_size")->valueint,
              NL = cJSON_GetObjectItem(c, "num_hidden_layers")->valueint;
    const char *keys[] = {"enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size"};
    for (int i = 0; i < 4; i++) cJSON_DeleteItemFromObject(c, keys[i]);
    cJSON_AddTrueToObject(c, "enable_moe_block");
    cJSON_AddNumberToObject(c, "num_experts", d->E);
    cJSON_AddNumberToObject(c, "top_k_experts", d->K);
    cJSON_AddNumberToObject(c, "moe_intermediate_size", d->I);
    dv_write_config(dst, c);
    dv_list l = {0};
    uint8_t *b = NULL;
    const uint8_t *base = NULL;
    cJSON *h = dv_read(src, NULL, 0, &l, &b, &base);
    test_rng r;
    rng_init(&r, d->seed);
    const int E = d->E, I = d->I;
    for (int ly = 0; ly < NL; ly++) {
        char n[200];
#define T(suffix, nd, ...) \
    (snprintf(n, sizeof n, "model.layers.%d.%s", ly, suffix), dv_add_t(&l, n, nd, (int64_t[]){__VA_ARGS__}, 1))
        dv_fill(T("router.proj.weight", 2, E, H), 0, (size_t)E * H, 0.0f, 2.0f, &r);
        dv_fill(T("router.scale", 1, H), 0, (size_t)H, 1.0f, 0.2f, &r);
        dv_fill(T("router.per_expert_scale", 1, E), 0, (size_t)E, 1.0f, 0.2f, &r);
        dv_fill(T("experts.gate_up_proj", 3, E, 2 * I, H), 0, (size_t)E * 2 * I * H, 0.0f,
                1.0f / sqrtf((float)H), &r);
        dv_fill(T("experts.down_proj", 3, E, H, I), 0, (size_t)E * H * I, 0.0f,
                1.0f / sqrtf((float)I), &r);
        dv_fill(T("pre_feedforward_layernorm_2.weight", 1, H), 0, (size_t)H, 1.0f, 0.2f, &r);
        dv_fill(T("post_feedforward_layernorm_1.weight", 1, H), 0, (size_t)H, 1.0f,
                d->near_dense ? 0.0f : 0.2f, &r);
        dv_fill(T("post_feedforward_layernorm_2.weight", 1, H), 0, (size_t)H,
                d->near_dense ? 0.0f : 1.0f, d->near_dense ? 0.0f : 0.2f, &r);
#undef T
    }
    dv_finish(dst, &l, h, b);
}

/* rm dst/{config.json, model.safetensors} and dst. */
static inline void derive_remove(const char *dst) {
    char p[1200];
    snprintf(p, sizeof p, "%s/config.json", dst);
    remove(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dst);
    remove(p);
    remove(dst);
}

#endif

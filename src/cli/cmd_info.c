/*
 * cmd_info.c - `tqkv info --model DIR [--kv LIST] [--json]`: what a checkpoint's graph is
 * and what its cache costs.
 * Owns: describing any supported graph generically from the loaded config: layer types,
 *   head dims, RoPE, recurrent layers, the kernel set, and per --kv format the bits per
 *   value, KV bytes per token over all layers and the fixed per-row state bytes (measured
 *   on a real one-row state, so they are what `run` / `ppl` / the engine use).
 * Must not: contain model or cache logic.
 *
 * Per-layer columns come from tqkv_model_layer_info(), which knows each graph's layer
 * types, KV-sharing donors and sliding windows.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "kv_shipped.h"
#include "model_cli.h"
#include "tqkv_model.h"

static const char *CMD = "info";

static const char *layer_kind(const tqkv_layer_info *li) {
    if (li->type == TQKV_LAYER_LINEAR) return "linear";
    return li->window ? "sliding" : "full";
}

/* What the layer walk found, for the table. */
typedef struct {
    char map[2 * TQKV_MAX_LAYERS + 1]; /* "F F S f ..." */
    int  n_shared, n_sliding;
} info_layers;

/* The "layers", "recurrent_layers" and "kv_shared_layers" arrays of root; 0 or 1 (failed,
 * message printed). */
static int add_layers(const tqkv_model *m, cJSON *root, info_layers *out) {
    const tqkv_model_config *c = tqkv_model_get_config(m);
    int at = 0;
    cJSON *layers = cJSON_AddArrayToObject(root, "layers");
    cJSON *rec = cJSON_AddArrayToObject(root, "recurrent_layers");
    cJSON *donors = cJSON_AddArrayToObject(root, "kv_shared_layers");
    out->n_shared = out->n_sliding = 0;
    for (int l = 0; l < c->n_layers; l++) {
        tqkv_layer_info li;
        if (tqkv_model_layer_info(m, l, &li) != TQKV_OK) {
            fprintf(stderr, "tqkv info: %s\n", tqkv_last_error());
            return 1;
        }
        const char *kind = layer_kind(&li);
        const int shared = li.kv_from >= 0 && li.kv_from != l;
        out->map[at++] = (char)(shared ? kind[0] : toupper((unsigned char)kind[0])); /* F S L / f s */
        out->map[at++] = l + 1 < c->n_layers ? ' ' : 0;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "layer", l);
        cJSON_AddStringToObject(o, "type", kind);
        if (li.type == TQKV_LAYER_LINEAR) {
            cJSON_AddNumberToObject(o, "key_heads", c->lin_k_heads);
            cJSON_AddNumberToObject(o, "value_heads", c->lin_v_heads);
            cJSON_AddNumberToObject(o, "key_head_dim", c->lin_k_dim);
            cJSON_AddNumberToObject(o, "value_head_dim", c->lin_v_dim);
            cJSON_AddNumberToObject(o, "conv_kernel", c->lin_conv_kernel);
            cJSON_AddItemToArray(rec, cJSON_CreateNumber(l));
        } else {
            out->n_sliding += li.window > 0;
            cJSON_AddNumberToObject(o, "q_heads", li.q_heads);
            cJSON_AddNumberToObject(o, "kv_heads", li.kv_heads);
            cJSON_AddNumberToObject(o, "head_dim", li.head_dim);
            cJSON_AddNumberToObject(o, "rotary_dim", li.rotary_dim);
            cJSON_AddNumberToObject(o, "rope_theta", li.rope_theta);
            cJSON_AddNumberToObject(o, "kv_from", li.kv_from);
            cJSON_AddNumberToObject(o, "window", li.window);
            cJSON_AddBoolToObject(o, "output_gate", c->attn_output_gate);
            cJSON_AddBoolToObject(o, "qk_norm", c->qk_norm);
            if (li.kv_from != l) {
                cJSON *d = cJSON_CreateObject();
                cJSON_AddNumberToObject(d, "layer", l);
                cJSON_AddNumberToObject(d, "donor", li.kv_from);
                cJSON_AddItemToArray(donors, d);
                out->n_shared++;
            }
        }
        cJSON_AddItemToArray(layers, o);
    }
    if (at == 0) out->map[0] = 0;
    return 0;
}

/* The "kv" array: cost per KV spec of kv_list, measured on a one-row state; 0, 1 or 2. */
static int add_kv_costs(const tqkv_model *m, const char *kv_list, cJSON *root) {
    int rc = 0;
    cJSON *kvs = cJSON_AddArrayToObject(root, "kv");
    char *list = strdup(kv_list), *save = NULL;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        tqkv_model_state_params sp = tqkv_model_state_params_default();
        if (mcli_parse_kv(CMD, tok, &sp.k_format, &sp.v_format)) {
            rc = 2;
            break;
        }
        tqkv_model_state *s = NULL;
        if (tqkv_model_state_init(&s, m, &sp) != TQKV_OK) {
            fprintf(stderr, "tqkv info: %s: %s\n", tok, tqkv_last_error());
            rc = 1;
            break;
        }
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kv", tok);
        cJSON_AddNumberToObject(o, "bits_per_value", tqkv_model_state_kv_bits_per_value(s));
        cJSON_AddNumberToObject(o, "kv_bytes_per_token", tqkv_model_state_kv_bytes_per_token(s));
        cJSON_AddNumberToObject(o, "fixed_bytes_per_row", (double)tqkv_model_state_row_fixed_bytes(s));
        cJSON_AddItemToArray(kvs, o);
        tqkv_model_state_free(s);
    }
    free(list);
    return rc;
}

/* The human-readable form of root. */
/* "kv_policy_fingerprint" and "kv_policies" (budget -> the file `--kv auto:B` takes on a CPU
 * state: kvship_policy_dir's folder, models/policies/README.md) of root. */
static void add_policies(const char *dir, cJSON *root) {
    char fp[32], sd[1024], path[4400];
    if (kvship_fingerprint(dir, fp, sizeof fp) == 0)
        cJSON_AddStringToObject(root, "kv_policy_fingerprint", fp);
    cJSON *pol = cJSON_AddObjectToObject(root, "kv_policies");
    static const char *const budgets[] = {"2.5", "3.25", "4.25"};
    for (size_t i = 0; i < sizeof budgets / sizeof budgets[0]; i++) {
        const char *d = kvship_policy_dir(dir, budgets[i], 0, sd, sizeof sd); /* a CPU state's */
        snprintf(path, sizeof path, "%s/kv-policy-%s.txt", d, budgets[i]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        fclose(f);
        cJSON_AddStringToObject(pol, budgets[i], path);
    }
}

static void print_table(const tqkv_model *m, const char *dir, const cJSON *root,
                        const info_layers *il) {
    const tqkv_model_config *c = tqkv_model_get_config(m);
    const cJSON *ks = cJSON_GetObjectItem(root, "kernel_set");
    const char *kset = cJSON_GetObjectItem(ks, "name")->valuestring;
    printf("model        %s\n", dir);
    printf("graph        %s (%s), %.1fM params, %s weights, hidden %d, vocab %d\n",
           tqkv_model_graph_name(m), c->arch_name, (double)tqkv_model_params(m) / 1e6,
           tqkv_model_weight_type(m), c->hidden_size, c->vocab_size);
    const cJSON *mo = cJSON_GetObjectItem(root, "experts");
    if (mo) {
        char shared[64] = "";
        const int sw = cJSON_GetObjectItem(mo, "shared_width")->valueint;
        if (sw > 0) snprintf(shared, sizeof shared, " + a gated shared expert of width %d", sw);
        printf("experts      %d routed, top %d%s, width %d%s, on %d of %d layers; %.1fM active "
               "params per token\n", cJSON_GetObjectItem(mo, "experts")->valueint,
               cJSON_GetObjectItem(mo, "top_k")->valueint,
               cJSON_IsTrue(cJSON_GetObjectItem(mo, "norm_topk_prob")) ? " (renormalised)" : "",
               cJSON_GetObjectItem(mo, "width")->valueint, shared,
               cJSON_GetObjectItem(mo, "moe_layers")->valueint, c->n_layers,
               cJSON_GetObjectItem(mo, "active_params")->valuedouble / 1e6);
    }
    printf("layers       %d: %s\n", c->n_layers, il->map);
    printf("             F = full attention, S = sliding window, L = gated DeltaNet "
           "(recurrent rows); lower case = reads a donor's KV rows\n");
    printf("\n%-5s %-8s %7s %8s %8s %7s %10s %7s %7s\n", "layer", "type", "q_heads",
           "kv_heads", "head_dim", "rotary", "rope_theta", "window", "kv_from");
    const cJSON *lo;
    cJSON_ArrayForEach(lo, cJSON_GetObjectItem(root, "layers")) {
        const char *t = cJSON_GetObjectItem(lo, "type")->valuestring;
        int l = cJSON_GetObjectItem(lo, "layer")->valueint;
        if (!strcmp(t, "linear")) {
            printf("%-5d %-8s %7d %8d %8d %7s %10s %7s %7s   (key heads x dim, value heads "
                   "%d x %d, conv %d)\n", l, t, c->lin_k_heads, c->lin_v_heads, c->lin_k_dim,
                   "-", "-", "-", "-", c->lin_v_heads, c->lin_v_dim, c->lin_conv_kernel);
            continue;
        }
        printf("%-5d %-8s %7d %8d %8d %7d %10g %7d %7d\n", l, t,
               cJSON_GetObjectItem(lo, "q_heads")->valueint,
               cJSON_GetObjectItem(lo, "kv_heads")->valueint,
               cJSON_GetObjectItem(lo, "head_dim")->valueint,
               cJSON_GetObjectItem(lo, "rotary_dim")->valueint,
               cJSON_GetObjectItem(lo, "rope_theta")->valuedouble,
               cJSON_GetObjectItem(lo, "window")->valueint,
               cJSON_GetObjectItem(lo, "kv_from")->valueint);
    }
    printf("\nkv sharing   %d layer%s read a donor's rows; %d sliding layer%s keep only "
           "their window (+ slack) resident\n", il->n_shared, il->n_shared == 1 ? "" : "s",
           il->n_sliding, il->n_sliding == 1 ? "" : "s");
    printf("kernel set   %s (prefill %s, decode %s)\n", kset,
           cJSON_GetObjectItem(ks, "prefill")->valuestring,
           cJSON_GetObjectItem(ks, "decode")->valuestring);
    const cJSON *pol = cJSON_GetObjectItem(root, "kv_policies"), *pe;
    cJSON_ArrayForEach(pe, pol) printf("kv policy    auto:%s -> %s\n", pe->string, pe->valuestring);
    printf("\n%-10s %10s %22s %22s\n", "kv", "bits/value", "KV bytes/token (all)",
           "fixed bytes/row");
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItem(root, "kv")) {
        printf("%-10s %10.3f %22.0f %22.0f\n", cJSON_GetObjectItem(e, "kv")->valuestring,
               cJSON_GetObjectItem(e, "bits_per_value")->valuedouble,
               cJSON_GetObjectItem(e, "kv_bytes_per_token")->valuedouble,
               cJSON_GetObjectItem(e, "fixed_bytes_per_row")->valuedouble);
    }
}

int cmd_info(int argc, char **argv) {
    const char *model_arg = MCLI_DEFAULT_MODEL, *kv_list = "f32,f16,q8,q4,tq4,tq3,tq2";
    int json = 0;
    const arg_spec specs[] = {
        {"--model", ARG_STR, &model_arg, "model directory (default " MCLI_DEFAULT_MODEL ")"},
        {"--kv", ARG_STR, &kv_list, "comma list of KV specs to cost (default f32,f16,q8,q4,tq4,tq3,tq2)"},
        {"--json", ARG_FLAG, &json, "print one JSON object instead of the table"},
    };
    const int n_specs = (int)(sizeof specs / sizeof specs[0]);
    if (args_parse(CMD, argc, argv, specs, n_specs) != 0) return 2;
    char dir[4096];
    if (!mcli_resolve_model(CMD, model_arg, dir, sizeof dir)) return 1;
    tqkv_model *m = NULL;
    tqkv_model_load_params lp = tqkv_model_load_params_default();
    lp.no_pack = 1;          /* nothing runs: read the weights in place */
    lp.no_f32_prefill = 1;
    if (tqkv_model_load(&m, dir, &lp) != TQKV_OK) {
        fprintf(stderr, "tqkv info: %s\n", tqkv_last_error());
        return 1;
    }
    const tqkv_model_config *c = tqkv_model_get_config(m);
    const char *kset = "?";
    tqkv_kernel kp = TQKV_KERNEL_DENSE, kd = TQKV_KERNEL_DENSE;
    tqkv_model_kernel_set(m, &kset, &kp, &kd);

    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", dir);
    cJSON_AddStringToObject(root, "architecture", c->arch_name);
    cJSON_AddStringToObject(root, "graph", tqkv_model_graph_name(m));
    cJSON_AddNumberToObject(root, "params", (double)tqkv_model_params(m));
    cJSON_AddStringToObject(root, "weights", tqkv_model_weight_type(m));
    cJSON_AddNumberToObject(root, "hidden", c->hidden_size);
    cJSON_AddNumberToObject(root, "vocab", c->vocab_size);
    cJSON_AddNumberToObject(root, "rope_theta", c->rope_theta);
    add_policies(dir, root);
    if (c->n_experts > 0) { /* active: all but the routed experts a token does not run (the
                               shared expert always runs) */
        cJSON *mo = cJSON_AddObjectToObject(root, "experts");
        const double idle = (double)c->n_moe_layers * (c->n_experts - c->n_experts_used) * 3.0 *
                            c->hidden_size * c->moe_intermediate_size;
        cJSON_AddNumberToObject(mo, "experts", c->n_experts);
        cJSON_AddNumberToObject(mo, "top_k", c->n_experts_used);
        cJSON_AddBoolToObject(mo, "norm_topk_prob", c->norm_topk_prob);
        cJSON_AddNumberToObject(mo, "width", c->moe_intermediate_size);
        cJSON_AddNumberToObject(mo, "shared_width", c->moe_shared_intermediate_size);
        cJSON_AddNumberToObject(mo, "moe_layers", c->n_moe_layers);
        cJSON_AddNumberToObject(mo, "active_params", (double)tqkv_model_params(m) - idle);
    }
    info_layers il;
    int rc = add_layers(m, root, &il);
    cJSON *ks = cJSON_AddObjectToObject(root, "kernel_set");
    cJSON_AddStringToObject(ks, "name", kset);
    cJSON_AddStringToObject(ks, "prefill", tqkv_kernel_name(kp));
    cJSON_AddStringToObject(ks, "decode", tqkv_kernel_name(kd));
    if (rc == 0) rc = add_kv_costs(m, kv_list, root);
    if (rc == 0 && json) {
        char *text = cJSON_PrintUnformatted(root);
        printf("%s\n", text);
        free(text);
    } else if (rc == 0) {
        print_table(m, dir, root, &il);
    }
    cJSON_Delete(root);
    tqkv_model_free(m);
    return rc;
}

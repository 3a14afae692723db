/*
 * recurrent.h - recurrent state rows of hybrid graphs (Qwen 3.5 gated DeltaNet layers),
 * kept beside the KV rows of the full-attention layers with the same row semantics.
 *
 * Owns: per row and per linear layer the depthwise-conv history (the last conv_kernel - 1
 *   inputs) and the DeltaNet state; row operations (filter, merge, extract), export /
 *   restore, the bytes accounting, and speculative rounds (a snapshot after every token
 *   appended during a round, so a rollback to keep[r] tokens restores the state exactly as
 *   it was after those tokens).
 * Must not: compute the graph (src/model/arch/qwen35/graph.c does), know about KV caches, decode or
 *   requantize anything: every row operation copies bytes.
 *
 * Row layout (floats): for each linear layer j in layer order:
 *   conv [conv_dim, conv_kernel - 1]   oldest input first (conv_dim = 2*k_heads*k_dim + v_heads*v_dim)
 *   ssm  [v_heads, k_dim, v_dim]       HF's recurrent_state layout
 * An empty row is all zeros (exactly HF's initial state); left padding never touches it.
 */
#ifndef TQKV_MODEL_RECURRENT_H
#define TQKV_MODEL_RECURRENT_H

#include <stddef.h>
#include <stdint.h>

#include "tqkv_model.h"

typedef struct model_recurrent {
    int    rows;
    int    n_lin;          /* linear layers */
    int    conv_dim;       /* channels of the conv */
    int    conv_hist;      /* conv_kernel - 1 */
    int    v_heads, k_dim, v_dim;
    size_t conv_floats;    /* conv_dim * conv_hist */
    size_t ssm_floats;     /* v_heads * k_dim * v_dim */
    size_t row_floats;     /* n_lin * (conv_floats + ssm_floats) */
    float *state;          /* [rows, row_floats] */
    int   *tokens;         /* [rows] tokens each row's state has absorbed: must equal the row's
                              KV offset (the forward checks it, so a KV-only trim is refused) */
    int    broken;         /* a forward failed after updating some layers: forwards refuse
                              until reset / restore (the KV rows were rolled back, these not) */
    /* speculative round */
    int    spec_active;
    int    spec_cap;       /* snapshots per row beyond the base */
    int   *spec_steps;     /* [rows] tokens appended since spec_begin */
    float *snap;           /* [rows, spec_cap + 1, row_floats]; slot 0 = state at begin */
} model_recurrent;

/* Empty (zero) rows for a hybrid config (cfg->n_linear > 0). */
tqkv_status rec_init(model_recurrent **out, const tqkv_model_config *cfg, int rows);
void        rec_free(model_recurrent *r);
/* Zero every row (and end any spec round); rows > 0 changes the row count. */
tqkv_status rec_reset(model_recurrent *r, int rows);

/* Row r's state of linear layer j (j counts linear layers only). */
float *rec_conv(const model_recurrent *r, int row, int j);
float *rec_ssm(const model_recurrent *r, int row, int j);
/* Fixed bytes per row (all linear layers, conv + DeltaNet state). */
size_t rec_row_bytes(const model_recurrent *r);

/* Keep rows keep[0..n_keep) in that order (indices distinct); ends a spec round. */
tqkv_status rec_filter(model_recurrent *r, const int *keep, int n_keep);
/* New state whose rows are items[i]'s row rows[i], in order. All items share one shape. */
tqkv_status rec_merge(model_recurrent **out, model_recurrent *const *items, const int *rows,
                      int n_items);
/* New state holding rows keep[0..n_keep) of r in that order (r unchanged; indices distinct). */
tqkv_status rec_select(const model_recurrent *r, const int *keep, int n_keep, model_recurrent **out);
/* New state holding every row of items[0], then of items[1], ... (all unchanged). */
tqkv_status rec_concat(model_recurrent **out, model_recurrent *const *items, int n_items);
/* One-row copy of row `row`. */
tqkv_status rec_extract(const model_recurrent *r, int row, model_recurrent **out);

/* Versioned, checksummed bytes ("TQRS", version 1: header, per-row token counts, floats,
 * crc32; docs/STATE.md). *out is malloc'd. Restore checks the shape against cfg. */
tqkv_status rec_export(const model_recurrent *r, uint8_t **out, size_t *len);
tqkv_status rec_restore(model_recurrent **out, const tqkv_model_config *cfg, const uint8_t *buf,
                        size_t len);

/* Speculative rounds: begin saves slot 0 (the state at begin); during the round the graph
 * writes the row's state after its step-th token of the round (1-based) into
 * rec_spec_slot(row, step), at the same offsets as the live row; rollback restores slot
 * keep[r]. rec_spec_reserve makes room for n more steps per row before a forward. */
tqkv_status rec_spec_begin(model_recurrent *r);
tqkv_status rec_spec_reserve(model_recurrent *r, int n);
/* NULL when no round is active. [row_floats] */
float      *rec_spec_slot(const model_recurrent *r, int row, int step);
/* After a forward: row r absorbed len[r] tokens (spec rounds: every row the same n). */
void        rec_advance(model_recurrent *r, const int *len);
tqkv_status rec_spec_commit(model_recurrent *r);
/* keep: n_keep == 1 (same for all rows) or rows; 0 <= keep[r] <= steps of row r. */
tqkv_status rec_spec_rollback(model_recurrent *r, const int *keep, int n_keep);

#endif

/*
 * cache_basics.c - libtqkv without a model: a 2-row tq4 KV cache for one layer.
 * Encodes a vector with the codec, appends K/V (encoded on the way in), attends with the
 * fused kernel, extracts a row, exports and restores it, and checks that the restored
 * cache attends exactly like the original.
 * Build: cc cache_basics.c $(pkg-config --cflags --libs tqkv) -lm
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tqkv.h>

#define ROWS     2
#define KV_HEADS 2
#define Q_HEADS  4
#define DIM      128
#define TOKENS   64

#define CHECK(call)                                                                                \
    do {                                                                                           \
        if ((call) != TQKV_OK) {                                                                   \
            fprintf(stderr, "%s failed: %s\n", #call, tqkv_last_error());                          \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static float rnd(void) { return (float)rand() / RAND_MAX * 2.0f - 1.0f; }

int main(void) {
    tqkv_cache_config cfg = tqkv_cache_config_default();
    cfg.kv_heads = KV_HEADS;
    cfg.head_dim = DIM;
    cfg.k_format = TQKV_TQ4;
    cfg.v_format = TQKV_TQ4;

    // ---- the codec alone: one vector -> 66 bytes of tq4 -> back ----
    float x[DIM], y[DIM];
    for (int i = 0; i < DIM; i++) x[i] = rnd();
    tqkv_codec *codec;
    CHECK(tqkv_codec_init(&codec, TQKV_TQ4, DIM, 0));
    uint8_t code[DIM]; // >= tqkv_codec_bytes(codec)
    CHECK(tqkv_codec_encode(codec, x, 1, code));
    CHECK(tqkv_codec_decode(codec, code, 1, y));
    double err = 0, nrm = 0;
    for (int i = 0; i < DIM; i++) err += (x[i] - y[i]) * (x[i] - y[i]), nrm += x[i] * x[i];
    printf("tq4: %zu bytes per vector, relative error %.3f\n", tqkv_codec_bytes(codec),
           sqrt(err / nrm));
    tqkv_codec_free(codec);

    // ---- append TOKENS keys/values per row (encoded to tq4 on the way in) ----
    static float k[ROWS * KV_HEADS * TOKENS * DIM], v[ROWS * KV_HEADS * TOKENS * DIM];
    for (size_t i = 0; i < sizeof k / sizeof *k; i++) k[i] = rnd(), v[i] = rnd();
    tqkv_batch *batch;
    CHECK(tqkv_batch_init(&batch, &cfg, ROWS));
    CHECK(tqkv_batch_append(batch, k, v, TOKENS)); // k, v: [rows, kv_heads, tokens, dim]

    // ---- one decode step: append a token, attend with the fused kernel ----
    static float k1[ROWS * KV_HEADS * DIM], v1[ROWS * KV_HEADS * DIM], q[ROWS * Q_HEADS * DIM];
    for (int i = 0; i < ROWS * KV_HEADS * DIM; i++) k1[i] = rnd(), v1[i] = rnd();
    for (int i = 0; i < ROWS * Q_HEADS * DIM; i++) q[i] = rnd();
    CHECK(tqkv_batch_append(batch, k1, v1, 1));
    tqkv_attn_params ap = {
        .q_heads = Q_HEADS, .scale = 1.0f / sqrtf(DIM), .kernel = TQKV_KERNEL_FUSED, .threads = 1};
    static float out[ROWS * Q_HEADS * DIM]; // [rows, q_heads, 1, dim]
    CHECK(tqkv_batch_attend(batch, NULL, q, 1, &ap, out));

    // ---- extract row 1 as a single cache, export it, restore it ----
    tqkv_cache *row, *restored;
    uint8_t *state;
    size_t len;
    CHECK(tqkv_batch_extract(batch, 1, &row));
    CHECK(tqkv_cache_export(row, &state, &len));
    CHECK(tqkv_cache_restore(&restored, state, len));

    // ---- the restored row attends like row 1 of the batch ----
    static float out1[Q_HEADS * DIM];
    CHECK(tqkv_cache_attend(restored, q + Q_HEADS * DIM, 1, &ap, out1));
    double max_diff = 0;
    for (int i = 0; i < Q_HEADS * DIM; i++) {
        double d = fabs((double)out1[i] - out[Q_HEADS * DIM + i]);
        if (d > max_diff) max_diff = d;
    }
    printf("tokens %d, %.1f bytes/token (f32 would be %d), state %zu bytes\n",
           tqkv_cache_length(restored), tqkv_cache_bytes_per_token(restored),
           2 * KV_HEADS * DIM * 4, len);
    printf("restored row vs batch row: max |diff| = %g\n", max_diff);

    free(state);
    tqkv_cache_free(restored);
    tqkv_cache_free(row);
    tqkv_batch_free(batch);
    return max_diff <= 1e-6 ? 0 : 1;
}

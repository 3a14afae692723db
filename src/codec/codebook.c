/*
 * codebook.c - Gaussian Lloyd-Max codebooks for 1..4 bits.
 * Owns: the N(0,1) optimal scalar quantizer centroids (ascending).
 * Must not: scale by head_dim (codec_setup does that) or hold mutable state.
 *
 * Values computed offline by a 50-digit Lloyd iteration (centroid condition
 * c_i = E[X | b_{i-1} < X <= b_i], bounds at the midpoints) run to a fixed point;
 * tests/test_codec.c re-derives them with erf/exp numerics. MSE per coordinate:
 * 1 bit 0.363380, 2 bits 0.117482, 3 bits 0.0345478, 4 bits 0.00950101.
 */
#include "codec/codec.h"

// ---------------------------------------------------------------------------
// Tables (ascending; symmetric around 0)
// ---------------------------------------------------------------------------

static const double LM1[2] = {
    -0.79788456080286535588,
    0.79788456080286535588,
};
static const double LM2[4] = {
    -1.5104176084990954024,
    -0.45278003463649200941,
    0.45278003463649200941,
    1.5104176084990954024,
};
static const double LM3[8] = {
    -2.1519457045369872853,
    -1.3439092785049998752,
    -0.75600528120587727482,
    -0.24509417894422166819,
    0.24509417894422166819,
    0.75600528120587727482,
    1.3439092785049998752,
    2.1519457045369872853,
};
static const double LM4[16] = {
    -2.7325895709951630690,
    -2.0690172265313865796,
    -1.6180463860218826272,
    -1.2562311973471771525,
    -0.94234045648696137093,
    -0.65675911853246338086,
    -0.38804829949029019659,
    -0.12839502985114701005,
    0.12839502985114701005,
    0.38804829949029019659,
    0.65675911853246338086,
    0.94234045648696137093,
    1.2562311973471771525,
    1.6180463860218826272,
    2.0690172265313865796,
    2.7325895709951630690,
};

// ---------------------------------------------------------------------------
// Lookup
// ---------------------------------------------------------------------------

const double *codec_lloyd_max(int bits) {
    switch (bits) {
    case 1: return LM1;
    case 2: return LM2;
    case 3: return LM3;
    case 4: return LM4;
    default: return NULL;
    }
}

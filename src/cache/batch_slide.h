/*
 * batch_slide.h - dropping each row's oldest tokens (sliding-window layers).
 * Owns: the declaration of batch_drop_oldest (batch_slide.c).
 * Must not: be included outside src/cache, src/model and tests.
 */
#ifndef TQKV_BATCH_SLIDE_H
#define TQKV_BATCH_SLIDE_H

#include "tqkv.h"

/* Drop each row's oldest tokens so that it holds at most `keep` (keep >= 1). The dropped
 * columns become left padding (a row's newest column does not move; every remaining
 * token keeps its bytes, its q8 window copy included); once every row's padding reaches
 * `keep`, the common padding is removed, so memory stays bounded by about
 * 2 * (keep + the longest append) columns per row whatever the sequence length.
 * Refused (TQKV_ESTATE) during a prefill or a spec round. The row's offset becomes the
 * number of tokens held, no longer its position: callers keep positions elsewhere. */
tqkv_status batch_drop_oldest(tqkv_batch *b, int keep);

#endif

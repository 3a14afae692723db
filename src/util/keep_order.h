/*
 * keep_order.h - whether a row filter's keep list can run in place (rows moved inside the
 * storage that holds them), shared by the host cache (batch_rows.c), the device cache
 * (cache_cuda_rows.cu) and the model states that decide for all their layers (rows.c).
 * Owns: keep_in_place, keep_fill_tail. Must not: allocate.
 *
 * Row i of the result is row keep[i]. Moving rows in ascending i reads every source before
 * anything overwrites it when keep[i] >= i for every i (distinct). Two orders are accepted
 * (both checked in O(n) without memory):
 *   - strictly increasing (finished rows dropped, the rest slide down);
 *   - holes filled from the tail: keep[i] == i, or keep[i] >= n taken from the rows past the
 *     new end in increasing order (each dropped row's slot takes one of the last rows, so
 *     few rows move; no moved row is another move's source or destination, so the moves
 *     may also run concurrently).
 * Header only, C and CUDA alike.
 */
#ifndef TQKV_KEEP_ORDER_H
#define TQKV_KEEP_ORDER_H

/* 1: strictly increasing; 2: holes filled from the tail (and not increasing); 0: neither
 * (or an index outside [0, rows)). */
static inline int keep_in_place(const int *keep, int n, int rows) {
    int inc = 1, fill = 1, tail = -1;
    for (int i = 0; i < n; i++) {
        const int k = keep[i];
        if (k < 0 || k >= rows) return 0;
        if (i > 0 && k <= keep[i - 1]) inc = 0;
        if (k != i) {
            if (k < n || k <= tail) fill = 0;
            else tail = k;
        }
    }
    return inc ? 1 : fill ? 2 : 0;
}

/* The keep list of the rows whose stay[i] is nonzero, holes filled from the tail: row i
 * stays where it is, a leaving row's slot takes the next staying row past the new end.
 * keep [rows]; returns its length. */
static inline int keep_fill_tail(const unsigned char *stay, int rows, int *keep) {
    int n = 0;
    for (int i = 0; i < rows; i++) n += stay[i] != 0;
    for (int i = 0, t = n; i < n; i++) {
        if (stay[i]) {
            keep[i] = i;
            continue;
        }
        while (!stay[t]) t++; /* n - i staying rows remain past the new end */
        keep[i] = t++;
    }
    return n;
}

#endif

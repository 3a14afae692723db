#!/usr/bin/env python3
"""Bit-level model of the d = 128 split kernel's fp8 tile (attn_cuda_tile.cuh: Raw<F_FP8>,
lane_off<F_FP8>, deq_k_fp8, deq_v_fp8, e4m3x4_f16; the stage layout Stg<F_FP8>), checked
against the mma.m16n8k16 fragment layouts: every K fragment element must be the byte of the
token of its S row (krow_tok) at the dim its query element holds (kdim / qdim), every V^T
fragment element the byte of the token of its P column (vcol_tok) at its output dim (vdim).
Bytes are modelled as (token, dim) tags, so a wrong lane offset, word, byte permute or half
shows up as a mismatch. Run: python3 scripts/attn_fp8_model.py (exit 0: all agree)."""
import sys

KPAY = VPAY = 128
TT = 32
V_OFF = TT * KPAY                       # Stg<F_FP8>::V_OFF


def krow_tok(g, row): return g + 8 * row          # default order (tq4, bf16, fp8)
def vcol_tok(c, j): return 4 * j + c
def kdim(c, p, e): return 32 * c + 2 * p + e      # the default (bf16's) order
def vdim(g, i, e): return 16 * g + 2 * i + e


def stage():
    """byte address -> (plane, token, dim)"""
    m = {}
    for t in range(TT):
        for d in range(128):
            m[t * KPAY + d] = ('K', t, d)
            m[V_OFF + t * VPAY + d] = ('V', t, d)
    return m


def word(mem, a):   # 4 bytes little endian: list of tags, byte 0 first
    return [mem[a + k] for k in range(4)]


def prmt(a, b, sel):
    src = a + b                                   # bytes 0..3 of a, 4..7 of b
    return [src[(sel >> (4 * k)) & 7] for k in range(4)]


def e4m3x4_f16(w):  # bytes 0, 1 -> pair lo (byte 0 in its low half); bytes 2, 3 -> pair hi
    return (w[0], w[1]), (w[2], w[3])


def check(mem, bad):
    errors = 0
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        ok_k = krow_tok(g, 0) * KPAY + 32 * c + (bad == 'koff') * 16
        ok_v = V_OFF + vcol_tok(c, 0) * VPAY + 16 * g
        for u in range(2):
            # K: rows 0 / 1 (pa / pb), 16 pairs each
            pr = {}
            for row in range(2):
                tk = 16 * u + krow_tok(0, row)
                ws = [word(mem, ok_k + tk * 128 + 4 * m) for m in range(8)]
                p = []
                for m in range(8):
                    lo, hi = e4m3x4_f16(ws[m])
                    p += [lo, hi]
                pr[row] = p
            # fragments: af = {pa[2s], pb[2s], pa[2s+1], pb[2s+1]}; A[m][k] rows m = g / g + 8,
            # cols k = 2c + e (regs 0, 1) or 2c + 8 + e (regs 2, 3); B (query of head g,
            # column c): k 2c + e <- qdim pair 2s, 2c + 8 + e <- pair 2s + 1
            for s in range(8):
                regs = [(pr[0][2 * s], 0, 2 * s), (pr[1][2 * s], 1, 2 * s),
                        (pr[0][2 * s + 1], 0, 2 * s + 1), (pr[1][2 * s + 1], 1, 2 * s + 1)]
                for reg, row, pair in regs:
                    for e in range(2):
                        plane, t, d = reg[e]
                        want_t = 16 * u + krow_tok(g, row)
                        want_d = kdim(c, pair, e)
                        if (plane, t, d) != ('K', want_t, want_d):
                            errors += 1
            # V: a[i][2hp + e] halves (tok j0 = 2hp, tok j1 = 2hp + 1) of dim vdim(g, i, e)
            a = [[None] * 4 for _ in range(8)]
            for hp in range(2):
                t0 = 16 * u + vcol_tok(0, 2 * hp)
                t1 = 16 * u + vcol_tok(0, 2 * hp + 1)
                w0 = [word(mem, ok_v + t0 * 128 + 4 * m) for m in range(4)]
                w1 = [word(mem, ok_v + t1 * 128 + 4 * m) for m in range(4)]
                for m in range(4):
                    sx = 0x5140 if bad != 'vperm' else 0x5410
                    x = prmt(w0[m], w1[m], sx)
                    y = prmt(w0[m], w1[m], 0x7362)
                    a[2 * m][2 * hp], a[2 * m][2 * hp + 1] = e4m3x4_f16(x)
                    a[2 * m + 1][2 * hp], a[2 * m + 1][2 * hp + 1] = e4m3x4_f16(y)
            for i in range(8):
                for r in range(4):
                    hp, e = r >> 1, r & 1
                    for h in range(2):   # low half: k slot 2c (+ 8 hp): j = 2 hp; high: 2 hp + 1
                        plane, t, d = a[i][r][h]
                        want_t = 16 * u + vcol_tok(c, 2 * hp + h)
                        want_d = vdim(g, i, e)
                        if (plane, t, d) != ('V', want_t, want_d):
                            errors += 1
    return errors


def perms_ok():
    k = sorted(kdim(c, p, e) for c in range(4) for p in range(16) for e in range(2))
    v = sorted(vdim(g, i, e) for g in range(8) for i in range(8) for e in range(2))
    kt = sorted(krow_tok(g, r) for g in range(8) for r in range(2))
    vt = sorted(vcol_tok(c, j) for c in range(4) for j in range(4))
    return k == list(range(128)) and v == list(range(128)) and kt == list(range(16)) and vt == list(range(16))


def main():
    mem = stage()
    e = check(mem, None)
    print(f"fp8 tile: {e} mismatches (dims and token orders are permutations: {perms_ok()})")
    # the model must catch a wrong lane offset and a wrong byte permute
    ek, ev = check(mem, 'koff'), check(mem, 'vperm')
    print(f"self-check: a K lane offset 16 bytes off -> {ek} mismatches, V permute 0x5410 -> {ev}")
    return 0 if e == 0 and perms_ok() and ek > 0 and ev > 0 else 1


if __name__ == '__main__':
    sys.exit(main())

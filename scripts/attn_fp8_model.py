#!/usr/bin/env python3
"""Bit-level model of the d = 128 split kernel's fp8 tile (attn_cuda_tile.cuh: Raw<F_FP8>,
lane_off<F_FP8>, load_stage / load_tile's pointers, deq_k_fp8, deq_v_fp8, e4m3x4_f16; the stage
layout Stg<F_FP8> with its V pieces), checked against the mma.m16n8k16 fragment layouts: every
K fragment element must be the byte of the token of its S row (krow_tok) at the dim its query
element holds (kdim / qdim), every V^T fragment element the byte of the token of its P column
(vcol_tok) at its output dim (vdim); both from the stage and from global memory (slow tiles:
the plain layout). Bytes are modelled as (token, dim) tags, so a wrong lane offset, immediate,
word, byte permute or half shows up as a mismatch. Also the staged loads' bank conflicts (16-byte
loads served a quarter warp at a time, as lds_ways in attn_cuda_tile.cuh): K 2-way, V none.
Run: python3 scripts/attn_fp8_model.py (exit 0: all agree)."""
import sys

KPAY = VPAY = 128
TT = 32
V_OFF = TT * KPAY                       # Stg<F_FP8>::V_OFF
VCH, VPAD = 8, 32                       # V copies (4 tokens each) and the pad after each
VCT = TT // VCH
VSTR = VCT * VPAY + VPAD


def krow_tok(g, row): return 4 * (g & 3) + (g >> 2) + 2 * row
def vcol_tok(c, j): return 4 * c + j
def kdim(c, p, e): return 32 * c + 2 * p + e      # the default (bf16's) order
def vdim(g, i, e): return 16 * g + 2 * i + e
def vpos(t): return V_OFF + t // VCT * VSTR + t % VCT * VPAY   # Stg<F_FP8>::vpos


def stage():
    """byte address -> (plane, token, dim): the stage (K plain, V in pieces)"""
    m = {}
    for t in range(TT):
        for d in range(128):
            m[t * KPAY + d] = ('K', t, d)
            m[vpos(t) + d] = ('V', t, d)
    return m


def plain():
    """the tile in global memory: K and V planes apart (V at a separate base, modelled at 1 << 20)"""
    m = {}
    for t in range(TT):
        for d in range(128):
            m[t * KPAY + d] = ('K', t, d)
            m[(1 << 20) + t * VPAY + d] = ('V', t, d)
    return m


def word(mem, a):   # 4 bytes little endian: list of tags, byte 0 first
    return [mem.get(a + k, ('?', -1, -1)) for k in range(4)]   # '?': a pad or outside the tile


def prmt(a, b, sel):
    src = a + b                                   # bytes 0..3 of a, 4..7 of b
    return [src[(sel >> (4 * k)) & 7] for k in range(4)]


def e4m3x4_f16(w):  # bytes 0, 1 -> pair lo (byte 0 in its low half); bytes 2, 3 -> pair hi
    if not INT:
        return (w[0], w[1]), (w[2], w[3])
    zero = [('0', -1, -1)] * 4                    # TQKV_FP8_CVT=0: prmt(w, 0, ..), fp8_h2
    return fp8_h2(prmt(w, zero, 0x1404)), fp8_h2(prmt(w, zero, 0x3424))


def fp8_h2(a):      # TQKV_FP8_CVT=0: the pair of bytes 1 and 3 (0 and 2 ignored)
    return (a[1], a[3])


INT = False         # model the TQKV_FP8_CVT=0 build's data movement


def fp8_h2_bits(a):  # fp8_h2 on integers: ((a & 0x7F007F00) >> 1) | (a & 0x80008000)
    return ((a & 0x7F007F00) >> 1) | (a & 0x80008000)


def h_ok():
    """fp8_h2 gives (h(b1), h(b3)), h(b) = (b & 0x80) << 8 | (b & 0x7f) << 7, for every code pair
    (bytes 0 and 2 arbitrary), and h(b) x 256 is the e4m3 value (as fp16 bits -> float)"""
    import struct
    def h(b): return (b & 0x80) << 8 | (b & 0x7f) << 7
    def f16(x): return struct.unpack('<e', struct.pack('<H', x))[0]
    def e4m3(b):
        s, e, m = b >> 7, (b >> 3) & 15, b & 7
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        return -v if s else v
    for b1 in range(256):
        for b3 in range(0, 256, 7):
            a = (b3 << 24) | (0x5A << 16) | (b1 << 8) | 0xA5
            r = fp8_h2_bits(a)
            if r != (h(b3) << 16 | h(b1)):
                return False
        if (b1 & 0x7f) != 0x7f and f16(h(b1)) * 256 != e4m3(b1):
            return False
    return True


def check(mem, bad, gl=False, addrs=None):
    errors = 0
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        ok_k = krow_tok(g, 0) * KPAY + 32 * c + (bad == 'koff') * 16       # lane_off: R.k
        if gl:
            ok_v = (1 << 20) + vcol_tok(c, 0) * VPAY + 16 * g               # lane_off: R.v (global)
        else:
            ok_v = vpos(vcol_tok(c, 0)) + 16 * g                            # load_stage: R.v
        for u in range(2):
            # K: rows 0 / 1 (pa / pb), 16 pairs each
            pr = {}
            for row in range(2):
                tk = 16 * u + krow_tok(0, row)
                if addrs is not None:
                    for h in range(2):
                        addrs.setdefault(('K', u, row, h), {})[lane] = ok_k + tk * 128 + 16 * h
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
                i0 = t0 * 128 if gl else vpos(t0) - V_OFF                      # deq_v_fp8's immediates
                i1 = t1 * 128 if gl else vpos(t1) - V_OFF
                if bad == 'vplain':
                    i0, i1 = t0 * 128, t1 * 128
                if addrs is not None:
                    addrs.setdefault(('V', u, 2 * hp), {})[lane] = ok_v + i0
                    addrs.setdefault(('V', u, 2 * hp + 1), {})[lane] = ok_v + i1
                w0 = [word(mem, ok_v + i0 + 4 * m) for m in range(4)]
                w1 = [word(mem, ok_v + i1 + 4 * m) for m in range(4)]
                for m in range(4):
                    if INT:   # byte k of both tokens: fp8_h2(prmt(w0, w1, 0x4400 + 0x1111 k))
                        for k in range(4):
                            sel = 0x4400 + 0x1111 * k if bad != 'vperm' else 0x4411 + 0x1111 * k
                            a[2 * m + (k >> 1)][2 * hp + (k & 1)] = fp8_h2(prmt(w0[m], w1[m], sel & 0x7777))
                        continue
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


def ways16(a):
    """the most distinct 16-byte words one bank group serves in one quarter-warp phase"""
    worst = 1
    for p0 in range(0, 32, 8):
        for bank in range(32):
            words = {a[l] // 4 + k for l in range(p0, p0 + 8) for k in range(4) if (a[l] // 4 + k) % 32 == bank}
            worst = max(worst, len(words))
    return worst


def orders_match():
    return all(krow_tok(c, r) == vcol_tok(c, 2 * r) and krow_tok(c + 4, r) == vcol_tok(c, 2 * r + 1)
               for c in range(4) for r in range(2))


def perms_ok():
    k = sorted(kdim(c, p, e) for c in range(4) for p in range(16) for e in range(2))
    v = sorted(vdim(g, i, e) for g in range(8) for i in range(8) for e in range(2))
    kt = sorted(krow_tok(g, r) for g in range(8) for r in range(2))
    vt = sorted(vcol_tok(c, j) for c in range(4) for j in range(4))
    return k == list(range(128)) and v == list(range(128)) and kt == list(range(16)) and vt == list(range(16))


def main():
    mem, gmem = stage(), plain()
    addrs = {}
    e = check(mem, None, addrs=addrs)
    eg = check(gmem, None, gl=True)
    print(f"fp8 tile: stage {e} mismatches, global memory {eg} (dims and token orders are permutations: "
          f"{perms_ok()}, S rows c, c + 4 are P's slots of column c: {orders_match()})")
    kw = max(ways16([a[l] for l in range(32)]) for k, a in addrs.items() if k[0] == 'K')
    vw = max(ways16([a[l] for l in range(32)]) for k, a in addrs.items() if k[0] == 'V')
    print(f"staged 16-byte loads: K {kw}-way, V {vw}-way bank conflicts")
    # the model must catch a wrong lane offset, a wrong byte permute, the plain V offsets in the stage
    ek, ev, ep = check(mem, 'koff'), check(mem, 'vperm'), check(mem, 'vplain')
    print(f"self-check: a K lane offset 16 bytes off -> {ek} mismatches, V permute 0x5410 -> {ev}, "
          f"plain V offsets in the stage -> {ep}")
    ok = e == 0 and eg == 0 and perms_ok() and orders_match() and kw == 2 and vw == 1
    ok = ok and ek > 0 and ev > 0 and ep > 0
    global INT
    INT = True      # the TQKV_FP8_CVT=0 build: integer h(b), the same fragments
    ei, eig, eiv = check(mem, None), check(gmem, None, gl=True), check(mem, 'vperm')
    hb = h_ok()
    print(f"TQKV_FP8_CVT=0: stage {ei} mismatches, global memory {eig}; wrong V permute -> {eiv}; "
          f"fp8_h2 = (h(b1), h(b3)) and h(b) x 256 = e4m3(b) for every code: {hb}")
    ok = ok and ei == 0 and eig == 0 and eiv > 0 and hb
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

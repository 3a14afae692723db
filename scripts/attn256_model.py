#!/usr/bin/env python3
"""attn256_model.py - a bit-level model, run on the build host, of the d = 256 tensor-core split
kernel's data path for one 32-token tile (src/attn/attn_cuda_tile.cuh, attn_cuda_split.cuh):
the stage layout of the bulk copies (Stg256: pieces with pads) or global memory's plain layout,
the lane offsets and load immediates (lane_off256, kimm256, vimm256, Half256), the words a lane
loads, the lookup words and table entries (deq_k_tq4 / deq_k_tq3 with tables C / D, deq_v_tq4 /
deq_v_tq3), the mma.m16n8k16 fragment layouts of both products, the P^T transposition shuffles
and the output writes (vdim256).
Checks, for tq4 and tq3, staged and global, random payloads:
  1. every K / V fragment element is the index docs/FORMATS.md gives for the (token, dim) the
     kernel's orders say it holds (ktok256 / vtok256, kdim256 / vdim256);
  2. the same model on d = 128's layout (device-validated) passes (a control of the model);
  3. a whole tile, in exact integers (centroid index - 7 as values, P = S): the S^T fragments
     equal K Q^T and the written output equals V^T P^T per head and dim.
The model copies the header's formulas; change both together. TQKV_TQ3_CD = 1 only.
  python3 scripts/attn256_model.py     (exit status 0: all pass)
"""
import random, sys
M32 = 0xFFFFFFFF
def kap(g): return ((g & 1) << 1) | ((g >> 1) & 1)
def ktok(u, g, row): return 8 * kap(g) + 2 * (g >> 2) + 4 * u + row
def vtok(u, c, j): return ktok(u, c + 4 * (j & 1), j >> 1)
def kdim128(F, c, p, e):
    if F == 'tq4': return 32 * c + p + 16 * e
    return 32 * c + 16 * ((p >> 2) & 1) + 4 * (p >> 3) + (p & 3) + 8 * e   # TQKV_TQ3_CD
def vdim128(F, g, i, e):
    if F == 'tq4': return 32 * (g >> 1) + 8 * (g & 1) + i + 16 * e
    return 32 * (g >> 1) + 8 * (2 * e + (i >> 2)) + 4 * (g & 1) + (i & 3)
def kdim256(F, c, p, e): return 128 * (p >> 4) + kdim128(F, c, p & 15, e)
def vdim256(F, g, i, e): return 128 * (i >> 3) + vdim128(F, g, i & 7, e)
class Stg:
    def __init__(s, F):
        s.TT = 32; s.PAY = 128 if F == 'tq4' else 96
        s.KCH = 2 if F == 'tq4' else 4; s.VCH = 4
        s.KPAD = 64 if F == 'tq4' else 32; s.VPAD = 32
        s.KCT = s.TT // s.KCH; s.VCT = s.TT // s.VCH
        s.KSTR = s.KCT * s.PAY + s.KPAD; s.VSTR = s.VCT * s.PAY + s.VPAD
        s.V_OFF = s.KCH * s.KSTR; s.SC = 80
        s.KS_OFF = s.V_OFF + s.VCH * s.VSTR; s.VS_OFF = s.KS_OFF + s.SC; s.BYTES = s.VS_OFF + s.SC
    def kpos(s, t): return t // s.KCT * s.KSTR + t % s.KCT * s.PAY
    def vpos(s, t): return s.V_OFF + t // s.VCT * s.VSTR + t % s.VCT * s.PAY
class Half:
    def __init__(s, F):
        s.F = F; s.K_STEP = 64 if F == 'tq4' else 32; s.KH_STEP = 16
        s.V_STEP = 64 if F == 'tq4' else 32; s.VH_STEP = 16
    def k(s, c): return 16 * c if s.F == 'tq4' else 8 * c
    def kh(s, c): return 64 + 4 * c
    def v(s, g): return 8 * g if s.F == 'tq4' else 4 * g
    def vh(s, g): return 64 + 4 * (g >> 1)
def lane_off(F, stage, g, c):
    G, H = Stg(F), Half(F)
    tk, tv = ktok(0, g, 0), vtok(0, c, 0)
    bk = G.kpos(tk) if stage else tk * G.PAY
    bv = G.vpos(tv) if stage else tv * G.PAY
    return dict(k=bk + H.k(c), kh=bk + H.kh(c) if F == 'tq3' else 0, v=bv + H.v(g), vh=bv + H.vh(g) if F == 'tq3' else 0)
def kimm(F, u, row): return (4 * u + row) * Stg(F).PAY
def vimm(F, u, j): return vtok(u, 0, j) * Stg(F).PAY
# ---- bit operations as the device does them
def lop3_e2(a, m, b): return ((m & a) | (~m & b)) & M32          # bsel(a, b, m) = lop3<0xE2>(a, m, b)
def bsel(a, b, m): return lop3_e2(a, m, b)
def prmt(a, b, s):
    by = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    r = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 15
        assert sel < 8
        r |= by[sel] << (8 * i)
    return r
def tq3_hi_t(x):
    t = (x ^ (x >> 14)) & 0x0000CCCC; x = x ^ t ^ ((t << 14) & M32)
    t = (x ^ (x >> 7)) & 0x00AA00AA; return (x ^ t ^ ((t << 7) & M32)) & M32
def tq3_kwords(W0, W1, H):
    X = tq3_hi_t(H)
    return [bsel((X << 4) & M32, W0, 0x30303030), bsel(X, W0, 0x0C0C0C0C), bsel(X, W1, 0x30303030), bsel(X >> 4, W1, 0x0C0C0C0C)]
def tq3_vwords(W0, W1, H0, H1, sh):
    P0, P1 = prmt(H0, H1, 0x6240), prmt(H0, H1, 0x7351)
    X = tq3_hi_t(bsel(P0 >> sh, (P1 * (16 >> sh)) & M32, 0x0F0F0F0F))
    V0 = bsel(W0, (W1 << 2) & M32, 0x33333333); V1 = bsel(W0 >> 2, W1, 0x33333333)
    return [bsel((X << 4) & M32, V0, 0x30303030), bsel(X, V1, 0x30303030), bsel(X, V0, 0x0C0C0C0C), bsel(X >> 4, V1, 0x0C0C0C0C)]
def tab_entry(F, cent, e, t):   # the fp16 pair (low, high) as two centroid indices
    if F == 'tq4': return (e & 15, e >> 4)
    if t == 0: return ((e & 3) | ((e >> 2) & 4), ((e >> 2) & 3) | ((e >> 3) & 4))
    return (((e >> 4) & 3) | (e & 4), ((e >> 6) & 3) | ((e >> 1) & 4))
def tlook(F, w, k, t=0): return tab_entry(F, None, (w >> (8 * k)) & 255, t)
def word(buf, off, n=4): return int.from_bytes(bytes(buf[off:off + n]), 'little')
def deq_k(F, buf, o, u, row, h, H):
    im = kimm(F, u, row)
    if F == 'tq4':
        base = o['k'] + im + H.K_STEP * h
        ws = [word(buf, base + 4 * i) for i in range(4)]
        return [tlook(F, ws[p >> 2], p & 3) for p in range(16)]
    kb = o['k'] + im + H.K_STEP * h
    W0, W1 = word(buf, kb), word(buf, kb + 4)
    Hw = word(buf, o['kh'] + im + H.KH_STEP * h)
    y = tq3_kwords(W0, W1, Hw)
    return [tlook(F, y[p >> 2], p & 3, (p >> 2) & 1) for p in range(16)]
def deq_v(F, buf, vbase, o, u, h, g, H):
    a = [[None] * 4 for _ in range(8)]
    for hp in range(2):
        j0, j1 = 2 * hp, 2 * hp + 1
        i0, i1 = vimm(F, u, j0), vimm(F, u, j1)
        if F == 'tq4':
            v0 = [word(buf, vbase + o['v'] + i0 + H.V_STEP * h + 4 * q) for q in range(2)]
            v1 = [word(buf, vbase + o['v'] + i1 + H.V_STEP * h + 4 * q) for q in range(2)]
            for wi in range(2):
                X = bsel(v0[wi], (v1[wi] << 4) & M32, 0x0F0F0F0F)
                Y = bsel(v0[wi] >> 4, v1[wi], 0x0F0F0F0F)
                for b in range(4):
                    a[4 * wi + b][2 * hp + 0] = tlook(F, X, b)
                    a[4 * wi + b][2 * hp + 1] = tlook(F, Y, b)
        else:
            W0 = word(buf, vbase + o['v'] + i0 + H.V_STEP * h); W1 = word(buf, vbase + o['v'] + i1 + H.V_STEP * h)
            H0 = word(buf, vbase + o['vh'] + i0 + H.VH_STEP * h); H1 = word(buf, vbase + o['vh'] + i1 + H.VH_STEP * h)
            vw = tq3_vwords(W0, W1, H0, H1, 4 * (g & 1))
            for k in range(4):
                for j in range(4):
                    a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook(F, vw[k], j, k >> 1)
    return a
# ---- the formats (docs/FORMATS.md), d = 256
def idx(F, pay, d):
    g, j = d >> 5, d & 31
    if F == 'tq4': return (pay[16 * g + (j & 15)] >> (4 * (j >> 4))) & 15
    lo = (pay[8 * g + (j & 7)] >> (2 * (j >> 3))) & 3
    hi = (word(pay, 64 + 4 * g) >> j) & 1
    return lo | (hi << 2)
def run(F, stage, seed):
    rnd = random.Random(seed)
    G = Stg(F); H = Half(F); PAY = G.PAY
    K = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    V = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    if stage:
        buf = [0xEE] * G.BYTES                         # pads poisoned: must never be read as data
        for k in range(G.KCH):                         # the bulk copies of stage_issue256
            for t in range(G.KCT):
                for b in range(PAY): buf[k * G.KSTR + t * PAY + b] = K[k * G.KCT + t][b]
        for k in range(G.VCH):
            for t in range(G.VCT):
                for b in range(PAY): buf[G.V_OFF + k * G.VSTR + t * PAY + b] = V[k * G.VCT + t][b]
        kbuf, vbuf, vbase = buf, buf, 0
    else:
        kbuf = sum(K, []); vbuf = sum(V, []); vbase = 0
    bad = 0; n = 0
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        o = lane_off(F, stage, g, c)
        for u in range(2):
            for h in range(2):
                for row in range(2):
                    pr = deq_k(F, kbuf, o, u, row, h, H)
                    t = ktok(u, g, row)
                    for p in range(16):
                        for e in range(2):
                            n += 1
                            bad += pr[p][e] != idx(F, K[t], kdim256(F, c, 16 * h + p, e))
                a = deq_v(F, vbuf, vbase, o, u, h, g, H)
                for i in range(8):
                    for r in range(4):               # register r = 2 hp + e: row g / g + 8, slots j0, j1
                        hp, e = r >> 1, r & 1
                        for half, j in ((0, 2 * hp), (1, 2 * hp + 1)):
                            n += 1
                            bad += a[i][r][half] != idx(F, V[vtok(u, c, j)], vdim256(F, g, 8 * h + i, e))
    return bad, n


# ---- control: d = 128 (krow_tok / vcol_tok / lane_off of attn_cuda_tile.cuh)
def krow(F, g, row): return 2 * (g & 3) + (g >> 2) + 8 * row if F == 'tq3' else g + 8 * row
def vcol(F, c, j): return 8 * (j >> 1) + 2 * c + (j & 1) if F == 'tq3' else 4 * j + c
def idx128(F, pay, d):
    g, j = d >> 5, d & 31
    if F == 'tq4': return (pay[16 * g + (j & 15)] >> (4 * (j >> 4))) & 15
    lo = (pay[8 * g + (j & 7)] >> (2 * (j >> 3))) & 3
    return lo | (((word(pay, 32 + 4 * g) >> j) & 1) << 2)
def run128(F, seed):
    rnd = random.Random(seed); PAY = 64 if F == 'tq4' else 48
    K = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    V = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    kb, vb = sum(K, []), sum(V, [])
    bad = n = 0
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        ok_ = krow(F, g, 0) * PAY; ov = vcol(F, c, 0) * PAY
        if F == 'tq4': o = dict(k=ok_ + 16 * c, v=ov + 8 * g)
        else: o = dict(k=ok_ + 8 * c, kh=ok_ + 32 + 4 * c, v=ov + 4 * g, vh=ov + 32 + 4 * (g >> 1))
        for u in range(2):
            for row in range(2):
                im = (16 * u + krow(F, 0, row)) * PAY
                if F == 'tq4':
                    ws = [word(kb, o['k'] + im + 4 * i) for i in range(4)]
                    pr = [tlook(F, ws[p >> 2], p & 3) for p in range(16)]
                else:
                    y = tq3_kwords(word(kb, o['k'] + im), word(kb, o['k'] + im + 4), word(kb, o['kh'] + im))
                    pr = [tlook(F, y[p >> 2], p & 3, (p >> 2) & 1) for p in range(16)]
                t = 16 * u + krow(F, g, row)
                for p in range(16):
                    for e in range(2):
                        n += 1; bad += pr[p][e] != idx128(F, K[t], kdim128(F, c, p, e))
            a = [[None] * 4 for _ in range(8)]
            for hp in range(2):
                j0, j1 = 2 * hp, 2 * hp + 1
                i0, i1 = (16 * u + vcol(F, 0, j0)) * PAY, (16 * u + vcol(F, 0, j1)) * PAY
                if F == 'tq4':
                    v0 = [word(vb, o['v'] + i0 + 4 * q) for q in range(2)]; v1 = [word(vb, o['v'] + i1 + 4 * q) for q in range(2)]
                    for wi in range(2):
                        X = bsel(v0[wi], (v1[wi] << 4) & M32, 0x0F0F0F0F); Y = bsel(v0[wi] >> 4, v1[wi], 0x0F0F0F0F)
                        for b in range(4):
                            a[4 * wi + b][2 * hp] = tlook(F, X, b); a[4 * wi + b][2 * hp + 1] = tlook(F, Y, b)
                else:
                    vw = tq3_vwords(word(vb, o['v'] + i0), word(vb, o['v'] + i1), word(vb, o['vh'] + i0), word(vb, o['vh'] + i1), 4 * (g & 1))
                    for k in range(4):
                        for j in range(4): a[4 * (k & 1) + j][2 * hp + (k >> 1)] = tlook(F, vw[k], j, k >> 1)
            for i in range(8):
                for r in range(4):
                    hp, e = r >> 1, r & 1
                    for half, j in ((0, 2 * hp), (1, 2 * hp + 1)):
                        n += 1; bad += a[i][r][half] != idx128(F, V[16 * u + vcol(F, c, j)], vdim128(F, g, i, e))
    return bad, n


# ---- a whole tile: both products, the P^T shuffles, the output writes
def qdim(F, o): return kdim256(F, (o >> 5) & 3, 16 * (o >> 7) + ((o & 31) >> 1), o & 1)
def cv(i): return i - 7                       # a centroid index as a small integer value
def full(F, stage, seed):
    rnd = random.Random(seed)
    G = Stg(F); H = Half(F); PAY = G.PAY
    K = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    V = [[rnd.randrange(256) for _ in range(PAY)] for _ in range(32)]
    Q = [[rnd.randrange(-3, 4) for _ in range(256)] for _ in range(8)]       # 8 heads, natural dims
    if stage:
        buf = [0xEE] * G.BYTES
        for k in range(G.KCH):
            for t in range(G.KCT):
                for b in range(PAY): buf[k * G.KSTR + t * PAY + b] = K[k * G.KCT + t][b]
        for k in range(G.VCH):
            for t in range(G.VCT):
                for b in range(PAY): buf[G.V_OFF + k * G.VSTR + t * PAY + b] = V[k * G.VCT + t][b]
        kbuf = vbuf = buf
    else:
        kbuf, vbuf = sum(K, []), sum(V, [])
    Kv = [[cv(idx(F, K[t], d)) for d in range(256)] for t in range(32)]
    Vv = [[cv(idx(F, V[t], d)) for d in range(256)] for t in range(32)]
    # prepared queries in qdim order; lane (g, c): qb[s][0/1] = pairs (2s, 2s+1) of its 32-pair run
    qst = [[Q[hd][qdim(F, o)] for o in range(256)] for hd in range(8)]
    acc = [[[0] * 4 for _ in range(16)] for _ in range(32)]   # [lane][m-tile][reg]
    lanes = [(l >> 2, l & 3) for l in range(32)]
    offs = [lane_off(F, stage, g, c) for g, c in lanes]
    for u in range(2):
        # ---- S^T = K Q^T: 16 k-steps, C fragment per lane
        C = [[0] * 4 for _ in range(32)]
        for h in range(2):
            pa = [deq_k(F, kbuf, offs[l], u, 0, h, H) for l in range(32)]
            pb = [deq_k(F, kbuf, offs[l], u, 1, h, H) for l in range(32)]
            for s in range(8):
                A = [[None] * 16 for _ in range(16)]; B = [[None] * 8 for _ in range(16)]
                for l, (g, c) in enumerate(lanes):
                    a4 = [pa[l][2 * s], pb[l][2 * s], pa[l][2 * s + 1], pb[l][2 * s + 1]]
                    for e in range(2):
                        A[g][2 * c + e] = cv(a4[0][e]); A[g + 8][2 * c + e] = cv(a4[1][e])
                        A[g][2 * c + 8 + e] = cv(a4[2][e]); A[g + 8][2 * c + 8 + e] = cv(a4[3][e])
                    # qb[8 h + s][0] = fp16 pair at 128 h + 32 c + 2 (2 s) .., [1]: 2 (2 s + 1)
                    base = 128 * h + 32 * c
                    for e in range(2):
                        B[2 * c + e][g] = qst[g][base + 2 * (2 * s) + e]
                        B[2 * c + 8 + e][g] = qst[g][base + 2 * (2 * s + 1) + e]
                for l, (g, c) in enumerate(lanes):
                    for r, (row, col) in enumerate(((g, 2 * c), (g, 2 * c + 1), (g + 8, 2 * c), (g + 8, 2 * c + 1))):
                        C[l][r] += sum(A[row][k] * B[k][col] for k in range(16))
        # check S: row g -> token ktok(u, g, 0), row g + 8 -> ktok(u, g, 1); columns heads
        for l, (g, c) in enumerate(lanes):
            for r in range(4):
                t = ktok(u, g, r >> 1); hd = 2 * c + (r & 1)
                want = sum(Kv[t][d] * Q[hd][d] for d in range(256))
                if C[l][r] != want: return f"S wrong: lane {l} reg {r}"
        # ---- P = S (as integers), the transposition shuffles, O^T += V^T P^T
        plo = [(C[l][0], C[l][1]) for l in range(32)]; phi = [(C[l][2], C[l][3]) for l in range(32)]
        b01 = []
        for l, (g, c) in enumerate(lanes):
            sl = 4 * c + (g >> 1); sel = g & 1
            x0, x1, x2, x3 = plo[sl], plo[sl + 16], phi[sl], phi[sl + 16]
            b01.append(((x0[sel], x1[sel]), (x2[sel], x3[sel])))
        for h in range(2):
            va = [deq_v(F, vbuf, 0, offs[l], u, h, lanes[l][0], H) for l in range(32)]
            for i in range(8):
                A = [[None] * 16 for _ in range(16)]; B = [[None] * 8 for _ in range(16)]
                for l, (g, c) in enumerate(lanes):
                    a4 = va[l][i]
                    for e in range(2):
                        A[g][2 * c + e] = cv(a4[0][e]); A[g + 8][2 * c + e] = cv(a4[1][e])
                        A[g][2 * c + 8 + e] = cv(a4[2][e]); A[g + 8][2 * c + 8 + e] = cv(a4[3][e])
                        B[2 * c + e][g] = b01[l][0][e]; B[2 * c + 8 + e][g] = b01[l][1][e]
                for l, (g, c) in enumerate(lanes):
                    for r, (row, col) in enumerate(((g, 2 * c), (g, 2 * c + 1), (g + 8, 2 * c), (g + 8, 2 * c + 1))):
                        acc[l][8 * h + i][r] += sum(A[row][k] * B[k][col] for k in range(16))
    # ---- the output writes: head 2 c + k, float4 at vdim256(g, q4, e) of acc[q4 + t][2 e + k]
    po = [[None] * 256 for _ in range(8)]
    for l, (g, c) in enumerate(lanes):
        for k in range(2):
            for e in range(2):
                for q4 in range(0, 16, 4):
                    d0 = vdim256(F, g, q4, e)
                    for t in range(4):
                        assert vdim256(F, g, q4 + t, e) == d0 + t
                        if po[2 * c + k][d0 + t] is not None: return "output written twice"
                        po[2 * c + k][d0 + t] = acc[l][q4 + t][2 * e + k]
    S = [[sum(Kv[t][d] * Q[hd][d] for d in range(256)) for hd in range(8)] for t in range(32)]
    for hd in range(8):
        for d in range(256):
            want = sum(Vv[t][d] * S[t][hd] for t in range(32))
            if po[hd][d] != want: return f"O wrong: head {hd} dim {d}"
    return "ok"

def main():
    ok = True
    for F in ('tq4', 'tq3'):
        for stage in (True, False):
            for seed in range(2):
                bad, n = run(F, stage, seed)
                res = full(F, stage, seed)
                print(f"d 256 {F} {'stage ' if stage else 'global'} seed {seed}: {bad} of {n} fragment values wrong; "
                      f"whole tile: {res}")
                ok = ok and bad == 0 and res == 'ok'
        bad, n = run128(F, 1)
        print(f"d 128 {F} (control): {bad} of {n} fragment values wrong")
        ok = ok and bad == 0
    print("all pass" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

#!/usr/bin/env python3
"""attn_pairs_model.py - a bit-level model, run on the build host, of the d = 128 tensor-core split
kernel's staged tile for the K/V pairs (src/attn/attn_cuda_tile.cuh: F_TQ42 = tq4/tq2, F_TQ2 =
tq2/tq2, F_TQ43 = tq4/tq3, F_TQ32 = tq3/tq2): the stage bytes as the bulk copies lay them out
(Stg: K payloads, then V payloads of their own size), each lane's loads (lane_off + the load
immediates of load_stage), the lookup words (deq_k_tq4, deq_k_tq2, tq3c_kwords; deq_v_tq2,
tq3c_vwords) and table entries (tq4; tq3's table C; tq2 keyed by the low nibble).
Checks, random indices: every K pair pr[p] of lane (g, c), subtile u, row is the indices of
token 16 u + krow_tok(g, row) at dims kdim(c, p, 0 / 1), and every V register a[i][2 hp + e] is
the indices of tokens 16 u + vcol_tok(c, 2 hp / 2 hp + 1) at dim vdim(g, i, e): the conventions
the mma / softmax code shared with tq4 and tq3 relies on (attn256_model.py checks those). The
packing is the CPU's (src/codec/pack.c). The model copies the header's formulas; change both
together. TQKV_TQ3_CD = 1 only (the pairs' kdim is tables C / D's).
  python3 scripts/attn_pairs_model.py     (exit status 0: all pass)
"""
import random, sys

# ---- the CPU's packing and the device's bit operations ----
D=128; M=0xFFFFFFFF
def pack2(idx):
    out=[0]*(D//4)
    for g in range(D//32):
        for j in range(8):
            b=0
            for k in range(4): b|=(idx[32*g+8*k+j]&3)<<(2*k)
            out[8*g+j]=b
    return out
def pack1(idx):
    out=[0]*(D//8)
    for g in range(D//32):
        w=0
        for i in range(32): w|=((idx[32*g+i]>>2)&1)<<i
        for b in range(4): out[4*g+b]=(w>>(8*b))&255
    return out
def word(bs,o): return bs[o]|bs[o+1]<<8|bs[o+2]<<16|bs[o+3]<<24
def byte(w,k): return (w>>(8*k))&255
def bsel(a,b,m): return ((a&m)|(b&~m))&M
def prmt(a,b,s):
    bs=[(a>>(8*i))&255 for i in range(4)]+[(b>>(8*i))&255 for i in range(4)]
    r=0
    for i in range(4): r|=bs[(s>>(4*i))&7]<<(8*i)
    return r
def hi_t(x):
    t=(x^(x>>14))&0x0000CCCC; x=x^t^((t<<14)&M)
    t=(x^(x>>7))&0x00AA00AA; return (x^t^((t<<7)&M))&M
def tabC(e): return ((e&3)|((e>>2)&4), ((e>>2)&3)|((e>>3)&4))

# ---- the kernel's tile path ----
def pack4(idx):
    out=[0]*64
    for g in range(4):
        for j in range(16): out[16*g+j]=idx[32*g+j]|idx[32*g+16+j]<<4
    return out
PAY={'tq4':64,'tq3':48,'tq2':32}
def encode(f,idx):
    if f=='tq4': return pack4(idx)
    if f=='tq2': return pack2(idx)
    return pack2(idx)+pack1(idx)
PAIRS={'F_TQ42':('tq4','tq2'),'F_TQ2':('tq2','tq2'),'F_TQ43':('tq4','tq3'),'F_TQ32':('tq3','tq2')}
def tq3order(F): return F=='F_TQ32'
def krow_tok(F,g,row): return 2*(g&3)+(g>>2)+8*row if tq3order(F) else g+8*row
def vcol_tok(F,c,j): return 8*(j>>1)+2*c+(j&1) if tq3order(F) else 4*j+c
def kdim(F,c,p,e):
    if PAIRS[F][0]=='tq4': return 32*c+p+16*e
    return 32*c+16*((p>>2)&1)+4*(p>>3)+(p&3)+8*e
def vdim(F,g,i,e): return 32*(g>>1)+8*(2*e+(i>>2))+4*(g&1)+(i&3)
def lane_off(F,g,c):
    kf,vf=PAIRS[F]
    k=krow_tok(F,g,0)*PAY[kf]; v=vcol_tok(F,c,0)*PAY[vf]
    if kf=='tq4': kh=k; k+=16*c
    elif kf=='tq3': kh=k+32+4*c; k+=8*c
    else: kh=k; k+=8*c
    if vf=='tq3': vh=v+32+4*(g>>1); v+=4*g
    else: vh=v; v+=4*g
    return k,kh,v,vh
def tab(fmt):
    if fmt=='tq4': return lambda e:(e&15,e>>4)
    if fmt=='tq3': return tabC
    return lambda e:(e&3,(e>>2)&3)
def u32(st,o): return word(st,o)
def run(F):
    kf,vf=PAIRS[F]
    K=[[random.randrange(1<<{'tq4':4,'tq3':3,'tq2':2}[kf]) for _ in range(128)] for t in range(32)]
    V=[[random.randrange(1<<{'tq4':4,'tq3':3,'tq2':2}[vf]) for _ in range(128)] for t in range(32)]
    st=[]
    for t in range(32): st+=encode(kf,K[t])
    V_OFF=len(st)
    for t in range(32): st+=encode(vf,V[t])
    tk_t=tab(kf); tv_t=tab(vf)
    ok=True
    for lane in range(32):
        g,c=lane>>2,lane&3
        ok_k,okh,ov,ovh=lane_off(F,g,c)
        for u in range(2):
            for row in range(2):
                tk=(16*u+krow_tok(F,0,row))*PAY[kf]
                if kf=='tq4':
                    ws=[u32(st,ok_k+tk+4*i) for i in range(4)]
                    pr=[tk_t(byte(ws[p>>2],p&3)) for p in range(16)]
                elif kf=='tq2':
                    x=u32(st,ok_k+tk); y=u32(st,ok_k+tk+4)
                    ys=[x,x>>4,y,y>>4]; pr=[tk_t(byte(ys[p>>2],p&3)) for p in range(16)]
                else:
                    W0=u32(st,ok_k+tk); W1=u32(st,ok_k+tk+4); H=u32(st,okh+tk); X=hi_t(H)
                    ys=[bsel((X<<4)&M,W0,0x30303030), bsel((X<<2)&M,W0>>4,0x30303030), bsel(X,W1,0x30303030), bsel(X>>2,W1>>4,0x30303030)]
                    pr=[tk_t(byte(ys[p>>2],p&3)) for p in range(16)]
                tok=16*u+krow_tok(F,g,row)
                for p in range(16):
                    if pr[p]!=(K[tok][kdim(F,c,p,0)],K[tok][kdim(F,c,p,1)]): ok=False
            for hp in range(2):
                j0,j1=2*hp,2*hp+1
                tv0=V_OFF+(16*u+vcol_tok(F,0,j0))*PAY[vf]; tv1=V_OFF+(16*u+vcol_tok(F,0,j1))*PAY[vf]
                W0=u32(st,ov+tv0); W1=u32(st,ov+tv1)
                V0=bsel(W0,(W1<<2)&M,0x33333333); V1=bsel(W0>>2,W1,0x33333333)
                if vf=='tq2': vw=[V0,V1,V0>>4,V1>>4]
                else:
                    H0=u32(st,ovh+tv0); H1=u32(st,ovh+tv1); sh=4*(g&1)
                    P0=prmt(H0,H1,0x6240); P1=prmt(H0,H1,0x7351)
                    X=hi_t(bsel(P0>>sh,(P1*(16>>sh))&M,0x0F0F0F0F))
                    vw=[bsel((X<<4)&M,V0,0x30303030), bsel(X,V1,0x30303030), bsel((X<<2)&M,V0>>4,0x30303030), bsel(X>>2,V1>>4,0x30303030)]
                for k in range(4):
                    for j in range(4):
                        i=4*(k&1)+j; e=k>>1
                        got=tv_t(byte(vw[k],j)); d=vdim(F,g,i,e)
                        t0=16*u+vcol_tok(F,c,j0); t1=16*u+vcol_tok(F,c,j1)
                        if got!=(V[t0][d],V[t1][d]): ok=False
    return ok
bad = 0
for F in PAIRS:
    good = all(run(F) for _ in range(20))
    print(F, "ok" if good else "MISMATCH")
    bad += not good
sys.exit(1 if bad else 0)

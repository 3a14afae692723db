#!/usr/bin/env python3
"""outlier_ppl_table.py PPL.jsonl - table of dev/experiments/outlier_ppl.sh's lines: ppl, delta
against the f32 cache of the same run, the keys' bits per value (every scale counted, averaged
over the layers' stored K values: Gemma 4's sliding layers hold 544 tokens at head_dim 128, its
full layers 2048 at 256), and for the split rows the plain-tq line at the same K bits (linear
between the simulated tq3 / tq4 / tq5 rows: what mixing plain formats gives)."""
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gemma = "gemma4" in sys.argv[1]
# (values held per head_dim) for the K-bits average
mix = {128: 4 * 544 * 128, 256: 2 * 2048 * 256} if gemma else {128: 1}

def bits_d(C, hb, lb, d):
    if C == 0:
        return lb + 16 / d
    return (C * hb + 16 + (d - C) * lb + 16) / d

def kbits(label):
    C, hm, hb, lb = map(int, label.split("_")[-1].split(":"))
    return sum(w * bits_d(C, hb, lb, d) for d, w in mix.items()) / sum(mix.values())

f32 = next(r["ppl"] for r in rows if r["label"] == "f32")

def group(label):  # "K_sim_" (seed offset 0) or "K_sim_sN_": rows of one rotation
    return label[: label.rindex("_") + 1]

def base_of(g):  # plain rows of group g; tq bits missing there come from the default group
    pts = {kbits(r["label"]): 100 * (r["ppl"] / f32 - 1) for r in rows if r["label"].startswith("K_sim_0:")}
    pts.update({kbits(r["label"]): 100 * (r["ppl"] / f32 - 1) for r in rows
                if r["label"].startswith(g + "0:")})
    return sorted(pts.items())

def line(b, base):
    for (b0, e0), (b1, e1) in zip(base, base[1:]):
        if b0 <= b <= b1:
            return e0 + (b - b0) / (b1 - b0) * (e1 - e0)
    return float("nan")

print(f"{'run':22s} {'K bits':>7s} {'ppl':>8s} {'vs f32':>8s} {'tq line':>8s}")
for r in rows:
    lab = r["label"]
    if lab.startswith("kld_"):  # --kld reruns: ppl and KLD against their own f32 pass
        print(f"{lab:22s} {'':7s} {r['ppl']:8.4f} {100 * (r['ppl'] / f32 - 1):+7.3f}% KLD {r['kld']}")
        continue
    d = 100 * (r["ppl"] / f32 - 1)
    if lab.startswith("K_sim_"):
        b = kbits(lab)
        ln = line(b, base_of(group(lab))) if ":0:0:" not in lab[-9:] or not lab.split("_")[-1].startswith("0:") else d
        print(f"{lab:22s} {b:7.4f} {r['ppl']:8.4f} {d:+7.3f}% {ln:+7.3f}%")
    else:
        print(f"{lab:22s} {'':7s} {r['ppl']:8.4f} {d:+7.3f}% (kv {r['kv']}, {r['kv_bits_per_value']:.4f} b)")

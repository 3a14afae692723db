#!/usr/bin/env python3
"""outlier_table.py OUT.json [d] - table of dev/experiments/outlier_split.c's JSON: every
scheme's bits (head_dim d, everything counted) and mean K / V relative MSE, beside the
plain-tq line at the same bits (linear interpolation between tq_b and tq_{b+1}: what mixing
two plain formats across vectors or layers gives) and the ratio. < 1 = better per bit."""
import json, sys

j = json.load(open(sys.argv[1]))
d = sys.argv[2] if len(sys.argv) > 2 else "128"
key = "bits_d" + d
base = {s["scheme"]: s for s in j["schemes"] if s["C"] == 0}
pts = sorted((s[key], s["k_rel_mse_mean"], s["v_rel_mse_mean"]) for s in base.values())

def line(b, col):
    for (b0, *e0), (b1, *e1) in zip(pts, pts[1:]):
        if b0 <= b <= b1:
            t = (b - b0) / (b1 - b0)
            return e0[col] + t * (e1[col] - e0[col])
    return float("nan")

# mean over layers of that head_dim only
layers = [L for L in j["layers"] if str(L["head_dim"]) == d]
idx = [i for i, L in enumerate(j["layers"]) if str(L["head_dim"]) == d]
print(f"{j['model']}  head_dim {d}  layers {[L['layer'] for L in layers]}")
print(f"{'scheme':34s} {'bits':>7s} {'K relMSE':>9s} {'tq line':>9s} {'K ratio':>8s} {'V ratio':>8s}")
rows = []
for s in j["schemes"]:
    if s[key] < 0: continue
    k = sum(s["k_rel_mse"][i] for i in idx) / len(idx)
    rows.append((s[key], s["scheme"], k, s))
# recompute the baseline line on this head_dim's layers
pts = sorted((s[key], sum(s["k_rel_mse"][i] for i in idx) / len(idx), s["v_rel_mse_mean"]) for s in base.values())
for b, name, k, s in sorted(rows):
    lk = line(b, 0)
    lv = line(b, 1)
    print(f"{name:34s} {b:7.4f} {k:9.5f} {lk:9.5f} {k / lk:8.3f} {s['v_rel_mse_mean'] / lv:8.3f}")

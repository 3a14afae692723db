#!/usr/bin/env python3
"""tools/quality_plot.py OUT.png RUNS.jsonl...: docs/QUALITY.md's plot of quality against bits
per value, one panel per (model, context), from the lines tools/quality_runs.sh appends.

Each point is one `tqkv ppl --json` run: x its kv_bits_per_value (everything counted), y its
perplexity over the f32 cache's of the same model, window count and context, in percent (log
scale; a run at or below the f32 perplexity is drawn at the floor). KLD is not plotted (the
table has it). Families: tqkv's presets (auto:B, what they resolved to in the label), plain tq
formats, tq with a window or K/V splits, calibrated per-layer policies (--kv-policy), and the
field's formats (fp8, q8, q4).
Regenerate: tools/quality_report.sh (installs python3-matplotlib as root when missing)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FLOOR = 0.005  # percent: where runs at or under the f32 perplexity are drawn


def load(paths):
    rows = []
    for p in paths:
        for line in open(p):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("res"):
                rows.append(r)
    return rows


def family(args, res):
    kv = res["kv"]
    if "--kv-policy" in args or res.get("kv_policy"):
        return "policy"
    if kv.startswith("auto:"):
        return "preset"
    if kv in ("fp8", "q8", "q4") and "--window" not in args and "--kv-layers" not in args:
        return "field"
    if kv in ("tq2", "tq3", "tq4") and "--window" not in args and "--kv-layers" not in args:
        return "tq"
    return "tq+"


STYLE = {"preset": ("*", "tab:red", "tqkv presets (auto:B)"),
         "tq": ("o", "tab:blue", "tq formats"),
         "tq+": ("s", "tab:cyan", "tq with a window / K-V split / per-layer"),
         "field": ("^", "tab:gray", "fp8, q8, q4"),
         "policy": ("D", "tab:green", "calibrated per-layer policies (tqkv calibrate)")}


def panels(rows):
    base, pts = {}, {}
    for r in rows:
        x = r["res"]
        key = (r["model"], x["windows"], x.get("ctx"))
        if x["kv"] == "f32" and not x.get("kv_resolved"):
            base[key] = x["ppl"]
    for r in rows:
        x = r["res"]
        key = (r["model"], x["windows"], x.get("ctx"))
        if key not in base or x["kv"] == "f32":
            continue
        d = 100.0 * (x["ppl"] / base[key] - 1.0)
        label = x["kv"] + (" = " + x["kv_resolved"].split(" (")[0] if x.get("kv_resolved") else "")
        if x.get("kv_policy"):
            label = "policy " + x["kv_policy"].rsplit("/", 1)[-1].replace(".txt", "")
        pts.setdefault(key, []).append((x["kv_bits_per_value"], max(d, FLOOR), label,
                                        family(r["args"], x)))
    return pts


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    pts = panels(load(sys.argv[2:]))
    keys = sorted(pts, key=lambda k: (k[0], k[2] or 0, k[1]))
    cols = 2
    nrow = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrow, cols, figsize=(12, 4.2 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        seen = set()
        for bits, d, label, fam in sorted(pts[key]):
            m, c, name = STYLE[fam]
            ax.scatter(bits, d, marker=m, color=c, s=80 if fam == "preset" else 36,
                       label=None if fam in seen else name, zorder=3)
            seen.add(fam)
            ax.annotate(label, (bits, d), fontsize=6.5, xytext=(3, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per value (everything counted)")
        ax.set_ylabel("ppl over the f32 cache, %")
        ax.set_title(f"{key[0]}, ctx {key[2] or 2048}, {key[1]} windows", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=90)
    print(f"{sys.argv[1]}: {len(keys)} panels, {sum(len(v) for v in pts.values())} points")


if __name__ == "__main__":
    main()

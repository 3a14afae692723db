#!/usr/bin/env python3
"""ncu_step_table.py - one decode step's kernels from Nsight Compute's text report.

Reads the output of
    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum [--launch-skip S --launch-count C] \
        tqkv bench model --device cuda ...
(scripts/cuda_step_profile.sh runs it), finds the steps (the launches from one `embed_kernel`
to the next: a step starts by embedding its tokens), takes one (--step: the last complete one
by default, past any prefill and warm-up) and prints a table per
kernel: grid, block, microseconds, megabytes read from DRAM, GB/s; then the step's sum and the
same grouped by kernel name. Each kernel ran alone under ncu (serialized, caches flushed,
clocks locked unless --clock-control none): the sum exceeds the step's time in a CUDA graph.

Usage: ncu_step_table.py NCU.txt [--marker embed_kernel] [--step K] [--json]
"""
import argparse
import json
import re
import sys

UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def parse(text):
    """[(name, grid, block, us, bytes)] in launch order."""
    rows = []
    for block in re.split(r"\n  (?=\S)", text):
        head = re.match(r"(?:void )?([\w:<>, ]+?)\(", block)
        dims = re.search(r"\) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)", block)
        dur = re.search(r"gpu__time_duration.sum\s+(\w+)\s+([\d.,]+)", block)
        if not (head and dims and dur):
            continue
        us = float(dur.group(2).replace(",", "")) * {"ns": 1e-3, "us": 1, "ms": 1e3}.get(dur.group(1), 1)
        rd = re.search(r"dram__bytes_read.sum\s+(\w+)\s+([\d.,]+)", block)
        nbytes = float(rd.group(2).replace(",", "")) * UNITS.get(rd.group(1), 1) if rd else 0.0
        g = dims.groups()
        rows.append((head.group(1).strip(), "x".join(g[:3]), "x".join(g[3:]), us, nbytes))
    return rows


def base_name(name):
    """The name without its trailing template arguments: "ns::k<0, 3>" -> "ns::k"."""
    if not name.endswith(">"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {">": 1, "<": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def steps(rows, marker):
    """The complete steps: [rows from one marker launch to the next]."""
    idx = [i for i, r in enumerate(rows) if r[0].startswith(marker)]
    return [rows[a:b] for a, b in zip(idx, idx[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--marker", default="embed_kernel", help="the kernel that starts a step")
    ap.add_argument("--step", type=int, default=-1, help="which complete step (0: the first; -1: the last)")
    ap.add_argument("--json", action="store_true", help="print a JSON object instead of tables")
    a = ap.parse_args()
    rows = parse(open(a.report, errors="replace").read())
    all_steps = steps(rows, a.marker)
    if not -len(all_steps) <= a.step < len(all_steps):
        sys.exit(f"ncu_step_table: {len(rows)} kernels, {len(all_steps)} complete steps (from one "
                 f"'{a.marker}' launch to the next): no step {a.step}; profile more launches "
                 "(--launch-count) or skip fewer (--launch-skip)")
    step = all_steps[a.step]
    total_us = sum(r[3] for r in step)
    total_b = sum(r[4] for r in step)
    by = {}
    for r in step:
        n = base_name(r[0])
        c, us, b = by.get(n, (0, 0.0, 0.0))
        by[n] = (c + 1, us + r[3], b + r[4])
    if a.json:
        print(json.dumps({
            "steps_found": len(all_steps), "step": a.step,
            "kernels": [{"name": r[0], "grid": r[1], "block": r[2], "us": r[3], "dram_read_bytes": r[4]} for r in step],
            "step_us": total_us, "step_dram_read_bytes": total_b,
            "by_name": [{"name": n, "launches": v[0], "us": v[1], "dram_read_bytes": v[2]}
                        for n, v in sorted(by.items(), key=lambda kv: -kv[1][1])]}, indent=1))
        return
    print(f"{'kernel':44} {'grid':>12} {'block':>10} {'us':>9} {'MB':>9} {'GB/s':>7}")
    for r in step:
        gbs = r[4] / r[3] / 1e3 if r[3] else 0.0
        print(f"{r[0][:44]:44} {r[1]:>12} {r[2]:>10} {r[3]:9.2f} {r[4] / 1e6:9.2f} {gbs:7.0f}")
    print(f"\nstep {a.step} of {len(all_steps)} complete: {len(step)} kernels, {total_us:.1f} us, {total_b / 1e6:.1f} MB read "
          f"({total_b / total_us / 1e3 if total_us else 0:.0f} GB/s over the kernels' sum)\n")
    print(f"{'kernel (all launches of the step)':44} {'n':>4} {'us':>9} {'share':>6} {'MB':>9}")
    for n, (c, us, b) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{n[:44]:44} {c:4d} {us:9.1f} {100 * us / total_us:5.1f}% {b / 1e6:9.2f}")


if __name__ == "__main__":
    main()

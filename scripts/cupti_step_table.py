#!/usr/bin/env python3
"""cupti_step_table.py TRACE.csv [N] [--json]: one decode step's kernels as they ran, from
cupti_trace.so's CSV of `tqkv bench model` (graphs on): each forward starts at embed_kernel; the
steps replayed from a CUDA graph (graph_id > 0) are the decode steps. Prints the median span of
those steps, then, for the step nearest that median (the last such one), every kernel in start
order with its start (us after the step's first), its duration, the gap since the kernels before
it ended (negative: they overlapped, PDL) and what it adds to the step (its end less the latest
end before it: with PDL a kernel's duration includes its wait for the one before, so this is its
share of the critical path), and the kernels folded by name: launches, busy us, gap us before
them, us added. With N only the first N kernels of the list. --json: one object."""
import collections, csv, json, re, statistics, subprocess, sys

args = [a for a in sys.argv[1:] if a != "--json"]
as_json = "--json" in sys.argv[1:]
limit = int(args[1]) if len(args) > 1 else None
with open(args[0]) as f:
    rows = [r for r in csv.DictReader(f)]
recs = sorted(((int(r["start_ns"]), int(r["end_ns"]), int(r["graph_id"]), r["grid"], r["block"], r["name"])
               for r in rows), key=lambda x: x[0])


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.split("\n")
        return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def short(n):
    n = n.replace('(anonymous namespace)::', '').replace('<unnamed>::', '')
    n = re.sub(r'^void ', '', n)
    n = re.sub(r'\(.*', '', n)
    return n[:48]


names = demangle(sorted({r[5] for r in recs}))
starts = [i for i, r in enumerate(recs) if 'embed_kernel' in names[r[5]]]
if len(starts) < 2:
    sys.exit(f"cupti_step_table: {len(starts)} forwards among {len(recs)} kernels (not a model run?)")
steps = [recs[a:b] for a, b in zip(starts, starts[1:])]
graphed = [s for s in steps if s[0][2] > 0]
if not graphed:
    sys.exit("cupti_step_table: no forward replayed from a CUDA graph (graphs off?)")
span = lambda s: max(r[1] for r in s) - s[0][0]
spans = [span(s) for s in graphed]
med = statistics.median(spans)
step = min(reversed(graphed), key=lambda s: abs(span(s) - med))
t0 = step[0][0]
listing, prev_end = [], None
for st, en, g, grid, blk, n in step:
    gap = (st - prev_end) if prev_end is not None else 0
    adds = max(0, en - prev_end) if prev_end is not None else en - st
    listing.append({"name": short(names[n]), "start_us": (st - t0) / 1e3, "us": (en - st) / 1e3,
                    "gap_us": gap / 1e3, "adds_us": adds / 1e3, "grid": grid, "block": blk})
    prev_end = en if prev_end is None else max(prev_end, en)
fold = collections.OrderedDict()
for k in listing:
    a = fold.setdefault(k["name"], {"name": k["name"], "launches": 0, "us": 0.0, "gap_us": 0.0,
                                    "adds_us": 0.0})
    a["launches"] += 1
    a["us"] += k["us"]
    a["gap_us"] += k["gap_us"]
    a["adds_us"] += k["adds_us"]
busy = sum(k["us"] for k in listing)
gaps = sum(max(0.0, k["gap_us"]) for k in listing)
summary = {"forwards": len(steps), "graphed_steps": len(graphed), "step_span_us_median": med / 1e3,
           "step_span_us_min": min(spans) / 1e3, "step_kernels": len(step), "busy_us": busy,
           "idle_gap_us": gaps, "by_name": sorted(fold.values(), key=lambda a: -a["us"]),
           "kernels": listing[:limit] if limit else listing}
if as_json:
    print(json.dumps(summary, indent=1))
    sys.exit(0)
print(f"{len(graphed)} graphed steps of {len(steps)} forwards; span median {med / 1e3:.1f} us, "
      f"min {min(spans) / 1e3:.1f}; this step: {len(step)} kernels, busy {busy:.1f} us, idle gaps "
      f"{gaps:.1f} us")
print(f"{'kernel':48} {'n':>4} {'busy us':>9} {'gap us':>8} {'adds us':>8}")
for a in summary["by_name"]:
    print(f"{a['name']:48} {a['launches']:4d} {a['us']:9.1f} {a['gap_us']:8.1f} {a['adds_us']:8.1f}")
print()
print(f"{'kernel':48} {'start':>9} {'us':>7} {'gap':>6} {'adds':>6}  grid / block")
for k in summary["kernels"]:
    print(f"{k['name']:48} {k['start_us']:9.2f} {k['us']:7.2f} {k['gap_us']:6.2f} {k['adds_us']:6.2f}  "
          f"{k['grid']} / {k['block']}")

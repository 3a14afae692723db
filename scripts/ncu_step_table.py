#!/usr/bin/env python3
"""ncu_step_table.py NCU.csv [N] [--json]: the kernels of the last forward in an Nsight Compute CSV
of `tqkv bench model --graphs 0` (cuda_step_profile.sh), folded by kernel name with count, total and
mean time, and, where the CSV has dram__bytes_read.sum, the megabytes read and GB/s; with N, also
the first N kernels of that forward in launch order; --json: the same as one JSON object."""
import collections, csv, json, re, sys
args = [a for a in sys.argv[1:] if a != "--json"]
as_json = "--json" in sys.argv[1:]
rows = list(csv.reader(l for l in open(args[0]) if l.startswith('"')))
hdr = rows[0]; ki = hdr.index("Kernel Name"); ti = hdr.index("gpu__time_duration.sum")
gi = hdr.index("Grid Size"); bi = hdr.index("Block Size")
di = hdr.index("dram__bytes_read.sum") if "dram__bytes_read.sum" in hdr else None
NS = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
tscale = NS.get(rows[1][ti], 1); bscale = BYTES.get(rows[1][di], 1) if di is not None else 0
num = lambda v: float(v.replace(',', ''))
isnum = lambda v: v.replace(',', '').replace('.', '').isdigit()
data = [(r[ki], num(r[ti]) * tscale, r[gi], r[bi], num(r[di]) * bscale if di is not None and isnum(r[di]) else 0.0)
        for r in rows[2:] if len(r) > ti and isnum(r[ti])]
def short(n):
    n = n.replace('(anonymous namespace)::', '').replace('<unnamed>::', '')
    n = re.sub(r'^void ', '', n)
    n = re.sub(r'[<(].*', '', n)
    return n[:40]
# find step boundary: embed_kernel marks the start of each forward
starts = [i for i, d in enumerate(data) if 'embed_kernel' in d[0]]
if not starts:
    sys.exit(f"ncu_step_table: no embed_kernel among {len(data)} kernels (not a model forward?)")
last = data[starts[-1]:]
tot = sum(d[1] for d in last); totb = sum(d[4] for d in last)
agg = collections.OrderedDict()
for n, t, g, b, by in last:
    k = short(n); a = agg.setdefault(k, [0, 0.0, g, b, 0.0]); a[0] += 1; a[1] += t; a[4] += by
folded = sorted(agg.items(), key=lambda x: -x[1][1])
if as_json:
    print(json.dumps({"kernels_profiled": len(data), "forwards_at": starts[-5:], "step_kernels": len(last),
                      "step_ns": tot, "step_dram_read_bytes": totb if di is not None else None,
                      "by_name": [{"name": k, "launches": c, "ns": t, "grid": g, "block": b,
                                   "dram_read_bytes": by if di is not None else None}
                                  for k, (c, t, g, b, by) in folded]}, indent=1))
    sys.exit(0)
print("unit ns kernels", len(data))
print("forwards at", starts[-5:])
print("last step kernels", len(last), "sum", tot, "" if di is None else f"read {totb / 1e6:.1f} MB")
for k, (c, t, g, b, by) in folded:
    mb = "" if di is None else f" MB={by / 1e6:8.2f} GB/s={by / t if t else 0:7.0f}"
    print(f"{k:40s} n={c:4d} total={t:10.1f} mean={t/c:8.2f} grid={g} block={b}{mb}")
if len(args) > 1:
    for n, t, g, b, by in last[:int(args[1])]: print(f"{short(n):40s} {t:8.2f} {g} {b}")

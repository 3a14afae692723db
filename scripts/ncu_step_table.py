#!/usr/bin/env python3
"""ncu_step_table.py NCU.csv [N]: the kernels of the last forward in an Nsight Compute CSV of
`tqkv bench model --graphs 0` (cuda_step_profile.sh), folded by kernel name with count, total and
mean ns; with N, also the first N kernels of that forward in launch order."""
import csv, sys, re, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
hdr = rows[0]; ki = hdr.index("Kernel Name"); ti = hdr.index("gpu__time_duration.sum")
gi = hdr.index("Grid Size"); bi = hdr.index("Block Size")
data = [(r[ki], float(r[ti].replace(',','')), r[gi], r[bi]) for r in rows[2:] if len(r) > ti and r[ti].replace(',','').replace('.','').isdigit()]
unit = rows[1][ti]
print("unit", unit, "kernels", len(data))
def short(n):
    n = n.replace('(anonymous namespace)::', '').replace('<unnamed>::', '')
    n = re.sub(r'^void ', '', n)
    n = re.sub(r'[<(].*', '', n)
    return n[:40]
# find step boundary: embed_kernel marks the start of each forward
starts = [i for i, d in enumerate(data) if 'embed_kernel' in d[0]]
print("forwards at", starts[-5:])
last = data[starts[-1]:]
tot = sum(d[1] for d in last)
print("last step kernels", len(last), "sum", tot)
agg = collections.OrderedDict()
for n, t, g, b in last:
    k = short(n); a = agg.setdefault(k, [0, 0.0, g, b]); a[0] += 1; a[1] += t
for k, (c, t, g, b) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{k:40s} n={c:4d} total={t:10.1f} mean={t/c:8.2f} grid={g} block={b}")
if len(sys.argv) > 2:
    for n, t, g, b in last[:int(sys.argv[2])]: print(f"{short(n):40s} {t:8.2f} {g} {b}")

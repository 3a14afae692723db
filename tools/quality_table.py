#!/usr/bin/env python3
"""tools/quality_table.py RUNS.jsonl: the markdown quality table of docs/QUALITY.md from the
lines tools/quality_runs.sh appends (ppl delta against the same model's f32 run with the
same window count, KLD, bits per value with everything counted)."""
import json, sys

rows = []
for f in sys.argv[1:]:
    for l in open(f):
        try:
            r = json.loads(l)
        except ValueError:  # an interrupted run leaves "res": empty
            continue
        if r.get('res'):
            rows.append(r)
base = {}  # the f32 run of the same model, window count and context
for r in rows:
    if r['res']['kv'] == 'f32' and not r['res'].get('kv_resolved'):
        base[(r['model'], r['res']['windows'], r['res'].get('ctx'))] = r['res']['ppl']
print('| model | windows | --kv | resolved | bits/value | ppl | vs f32 | KLD | top-1 |')
print('|---|---|---|---|---|---|---|---|---|')
for r in rows:
    x = r['res']
    if not x:
        continue
    b = base.get((r['model'], x['windows'], x.get('ctx')))
    d = f"{100 * (x['ppl'] / b - 1):+.3f}%" if b else ''
    kld = '' if x.get('kld') is None else f"{x['kld']:.5f}"
    top = '' if x.get('top1_agreement') is None else f"{x['top1_agreement']:.4f}"
    res = x.get('kv_resolved') or ''
    print(f"| {r['model']} | {x['windows']} | `{r['args'].replace(' --kld', '')}` | {res} | "
          f"{x['kv_bits_per_value']:.3f} | {x['ppl']:.4f} | {d} | {kld} | {top} |")

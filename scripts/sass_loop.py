#!/usr/bin/env python3
"""sass_loop.py - the tile loop of a decode-attention split kernel in a SASS listing.

The split kernels' tile loop is the innermost loop that waits on an mbarrier
(SYNCS.PHASECHK) and holds HMMA instructions. This finds it (the N-th such wait in the
listing; the kernels appear in the order nvdisasm prints them: tq3, then tq4, for
src/attn/attn_cuda.cu (d = 128) and src/attn/attn_cuda_wide.cu (d = 256) today) and prints its
static instruction count by opcode, or the loop
body itself, so a change's cost per tile can be read before it spends device time.

  scripts/sass_local.sh src/attn/attn_cuda.cu NVDISASM > k.sass
  scripts/sass_loop.py k.sass [N] [--body]
"""
import collections
import re
import sys


def loop_body(lines, which):
    waits = [i for i, l in enumerate(lines) if 'PHASECHK' in l]
    if which >= len(waits):
        sys.exit(f"sass_loop: only {len(waits)} mbarrier waits in the listing")
    w = waits[which]
    for i in range(w, -1, -1):  # the nearest label above whose backward branch encloses an HMMA
        m = re.match(r'^(\.L_x_\d+):', lines[i].strip())
        if not m:
            continue
        ends = [j for j, l in enumerate(lines) if '`(' + m.group(1) + ')' in l and j > w]
        if ends and any('HMMA' in l for l in lines[i:max(ends) + 1]):
            return lines[i:max(ends) + 1]
    sys.exit("sass_loop: no loop with HMMA around that wait")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    if not args:
        sys.exit(__doc__)
    lines = open(args[0]).read().split('\n')
    body = loop_body(lines, int(args[1]) if len(args) > 1 else 0)
    ins = [l for l in body if re.search(r'/\*[0-9a-f]{4,}\*/', l)]
    if '--body' in sys.argv:
        for l in body:
            l = re.sub(r'\s*/\* 0x[0-9a-f]+ \*/', '', l).rstrip()
            if l.strip():
                print(l)
        return
    ops = collections.Counter()
    for l in ins:
        op = l.split('*/')[1].strip().rstrip(';').strip()
        if op.startswith('@'):
            op = op.split(None, 1)[1]
        ops[op.split()[0].split('.')[0]] += 1
    print("static loop instructions:", len(ins))
    print(' '.join(f"{k}:{v}" for k, v in ops.most_common()))


if __name__ == '__main__':
    main()

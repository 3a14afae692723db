#!/usr/bin/env python3
"""ncu_sass_summary.py - a compact text summary of one kernel's SASS-level profile.

Input: the CSV of `ncu -i REP.ncu-rep --page source --csv --print-source sass` for a report
taken with `--section SourceCounters --section InstructionStats --section WarpStateStats`.
Prints the warp instructions executed, by opcode (share, stall samples), the warp stall
reasons over the whole kernel, and the instructions by execution count (which finds the
hot loop: its body runs once per tile). Usage: ncu_sass_summary.py SRC.csv [TOKENS]
(TOKENS, the kernel's token x KV-head count, adds instructions per token and head)."""
import collections
import csv
import sys


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    ex_i, src_i = col["Instructions Executed"], col["Source"]
    st_i = col["Warp Stall Sampling (All Samples)"]
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    by_op, st_op, stalls, by_count = collections.Counter(), collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for r in data:
        try:
            ex = int(r[ex_i].replace(",", ""))
        except (ValueError, IndexError):
            continue
        words = r[src_i].split()
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        total += ex
        by_op[op] += ex
        st_op[op] += int(r[st_i] or 0)
        by_count[ex] += 1
        for i in reasons:
            stalls[hdr[i]] += int(r[i] or 0)
    print(f"warp instructions executed: {total}")
    if len(sys.argv) > 2:
        print(f"per token and KV head: {total / float(sys.argv[2]):.2f}")
    print("\nby opcode (executed, share, stall samples):")
    for op, n in by_op.most_common(24):
        print(f"  {op:10s} {n:12d} {100 * n / total:5.1f}%  {st_op[op]:7d}")
    s = sum(stalls.values()) or 1
    print("\nstall reasons (samples, share):")
    for k, v in stalls.most_common(12):
        print(f"  {k:26s} {v:7d} {100 * v / s:5.1f}%")
    print("\ninstructions by execution count (count x instructions = executed):")
    for ex, n in sorted(by_count.items(), key=lambda x: -x[0] * x[1])[:8]:
        print(f"  {ex:10d} x {n:4d} = {ex * n}")


if __name__ == "__main__":
    main()

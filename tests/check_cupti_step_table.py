#!/usr/bin/env python3
"""check_cupti_step_table.py SCRIPT: scripts/cupti_step_table.py on a synthetic trace whose
answer is known. Three forwards run kernel by kernel (graph 0), then five replayed from a graph,
rows shuffled as CUPTI may hand them over. Every forward is embed, norm, gemm, post with fixed
durations; the gaps differ per step (one overlaps: a negative gap), so the step spans are known,
and so is which step is the median's. Exits 1 with the first mismatch, 0 when all hold."""
import csv, io, json, os, random, subprocess, sys, tempfile

KERNELS = [("_Z12embed_kernelPKiPK13__nv_bfloat16iPf", 1000),
           ("_Z14rmsnorm_kernelILi16EEvPfPKfS2_fiS0_Pti", 2500),
           ("_Z11gemm_kernelILi1ELi1ELi1ELi1ELi1ELi16EEvPKtiiS1_iPKfPfm", 10000),
           ("_Z15qkv_post_kernelPKfiiiiiiPKiS0_S0_fS0_iPfS3_S3_", 2000)]
# per forward: the gaps before kernels 2, 3, 4 (ns) and the graph id (0: kernel by kernel).
# Five replayed steps are counted (the last forward has no embed after it, so it is cut); their
# spans are 16.7, 16.3, 17.0, 15.8 and 16.1 us, so the median step is the second, whose gemm
# starts 0.6 us before the norm ends.
STEPS = [((900, 900, 900), 0)] * 3 + [((400, 400, 400), 7), ((400, -600, 1000), 7),
                                      ((500, 500, 500), 7), ((100, 100, 100), 7),
                                      ((200, 200, 200), 7), ((300, 300, 300), 7)]


def trace():
    rows, t = [], 1_000_000
    for gaps, g in STEPS:
        for i, (name, dur) in enumerate(KERNELS):
            if i:
                t += gaps[i - 1]
            rows.append((t, t + dur, g, i + 1, "1x1x1", "128x1x1", name))
            t += dur
        t += 20_000  # the host's work between steps
    random.Random(5).shuffle(rows)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["start_ns", "end_ns", "graph_id", "graph_node_id", "grid", "block", "name"])
    w.writerows(rows)
    return out.getvalue()


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


def main():
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write(trace())
    try:
        r = subprocess.run([sys.executable, sys.argv[1], f.name, "--json"], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    check(r.returncode == 0, f"the script exited {r.returncode}: {r.stderr.strip()}")
    d = json.loads(r.stdout)
    busy = sum(k[1] for k in KERNELS) / 1e3  # 15.5 us
    check(d["forwards"] == 8, f"forwards {d['forwards']}, want 8 (the last one is cut)")
    check(d["graphed_steps"] == 5, f"graphed steps {d['graphed_steps']}, want 5")
    check(abs(d["step_span_us_median"] - 16.3) < 1e-6, f"median span {d['step_span_us_median']}, want 16.3")
    check(abs(d["step_span_us_min"] - 15.8) < 1e-6, f"min span {d['step_span_us_min']}, want 15.8")
    check(d["step_kernels"] == 4, f"step kernels {d['step_kernels']}")
    names = [k["name"] for k in d["kernels"]]
    check(names == ["embed_kernel", "rmsnorm_kernel<16>", "gemm_kernel<1, 1, 1, 1, 1, 16>", "qkv_post_kernel"],
          f"kernel order {names}")
    check(abs(d["busy_us"] - busy) < 1e-6, f"busy {d['busy_us']}, want {busy}")
    gaps = [round(k["gap_us"], 6) for k in d["kernels"]]
    check(gaps == [0.0, 0.4, -0.6, 1.0], f"gaps {gaps}, want the median step's [0, 0.4, -0.6, 1.0]")
    starts = [round(k["start_us"], 6) for k in d["kernels"]]
    check(starts == [0.0, 1.4, 3.3, 14.3], f"starts {starts}")
    check(abs(d["idle_gap_us"] - 1.4) < 1e-6, f"idle gaps {d['idle_gap_us']}, want 1.4 (overlap not counted)")
    adds = [round(k["adds_us"], 6) for k in d["kernels"]]
    check(adds == [1.0, 2.9, 9.4, 3.0], f"adds {adds}, want [1.0, 2.9, 9.4, 3.0] (they sum to the span)")
    by = {a["name"]: a for a in d["by_name"]}
    check(by["gemm_kernel<1, 1, 1, 1, 1, 16>"]["launches"] == 1 and
          abs(by["gemm_kernel<1, 1, 1, 1, 1, 16>"]["us"] - 10.0) < 1e-6, "the fold by name")
    print(f"ok: {d['graphed_steps']} replayed steps, median span {d['step_span_us_median']:.3f} us, "
          f"gaps {gaps}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""cuda_gemm_anchor.py - the reference beside `tqkv bench gemm`: PyTorch's bf16 linear
(cuBLAS / cuBLASLt, bf16 x bf16 with f32 accumulate, the library's own algorithm choice) on
the same shapes and token counts, with the same timing method (a 256 MiB write evicts L2
before each repetition, CUDA events around the call alone, median of --reps).

It also checks what tqkv's GEMM guarantees by construction: is row 0 of a T-token call
bitwise equal to row 0 computed alone (T = 1)? "invariant" records the answer per shape and
T: where it is false, cuBLAS picked a kernel (tile, split-K) whose reduction order depends
on T. Together with `tqkv bench gemm` this is what batch invariance (and keeping
activations at ~16 bits instead of bf16's 8) costs.

    python3 scripts/cuda_gemm_anchor.py --out gemm_anchor.json
"""
import argparse
import json

import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="6144x4096,4096x4096,28672x4096,4096x14336,128256x4096")
    ap.add_argument("--tokens", default="1,8,32,128,512,2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    res = []
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        torch.manual_seed(N * 7 + K)
        w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        tmax = max(int(t) for t in a.tokens.split(","))
        x = torch.randn(tmax, K, device=dev).to(torch.bfloat16)
        alone = F.linear(x[:1], w)
        for T in (int(t) for t in a.tokens.split(",")):
            xs = x[:T].contiguous()
            y = F.linear(xs, w)
            invariant = bool(torch.equal(y[:1], alone))
            ms = []
            for r in range(a.reps + 2):
                flush.fill_(r & 0xFF)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                F.linear(xs, w)
                e.record()
                torch.cuda.synchronize()
                if r >= 2:
                    ms.append(s.elapsed_time(e))
            ms.sort()
            m = ms[len(ms) // 2]
            o = {"n": N, "k": K, "tokens": T, "ms": round(m, 4),
                 "weight_gbps": round(N * K * 2 / (m * 1e6), 1),
                 "tflops": round(2.0 * T * N * K / (m * 1e9), 2), "invariant": invariant}
            print(f"[cublas] {N}x{K} T={T}: {m:.4f} ms, {o['weight_gbps']} GB/s, "
                  f"{o['tflops']} TFLOP/s, row 0 == alone: {invariant}", flush=True)
            res.append(o)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

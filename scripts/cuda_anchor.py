#!/usr/bin/env python3
"""cuda_anchor.py - the anchor of `tqkv bench attention --device cuda`: PyTorch SDPA with the
cuDNN backend on a bf16 KV cache, one decode step (32 query heads, 8 KV heads, d 128).

GQA decode is run the way serving stacks run it: the G = q_heads / kv_heads query heads of
a group are G queries of one KV head (q [B, kvh, G, d], k/v [B, kvh, ctx, d], no mask), so
every K/V byte is read once. Same timing method as the C benchmark: a 256 MiB write evicts
L2 before each repetition, CUDA events around the SDPA call alone, median of --reps.

    python3 scripts/cuda_anchor.py --batches 1,8,32 --ctxs 4096,16384,65536,131072 --out a.json
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctxs", default="4096,16384,65536,131072")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    G, H, D = a.q_heads // a.kv_heads, a.kv_heads, 128
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    res = []
    for B in [int(x) for x in a.batches.split(",")]:
        for N in [int(x) for x in a.ctxs.split(",")]:
            torch.manual_seed(B * 1000003 + N)
            q = torch.randn(B, H, G, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16)
            backend = "cudnn"
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = F.scaled_dot_product_attention(q, k, v)
            except RuntimeError as e:  # record the fallback honestly
                print(f"[anchor] cuDNN SDPA refused B={B} N={N}: {e}; using the default", file=sys.stderr)
                backend = "default"
            def ctx():  # a fresh context manager each time (they are single use)
                return sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if backend == "cudnn" else torch.no_grad()
            # check against a float32 reference once (small slice)
            with ctx():
                o = F.scaled_dot_product_attention(q, k, v)
            ref = torch.softmax((q[:1].float() @ k[:1].float().transpose(-1, -2)) / D ** 0.5, -1) @ v[:1].float()
            err = ((o[:1].float() - ref).norm() / ref.norm()).item()
            times = []
            for rep in range(-3, a.reps):
                flush.random_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with ctx():
                    s.record()
                    o = F.scaled_dot_product_attention(q, k, v)
                    e.record()
                torch.cuda.synchronize()
                if rep >= 0:
                    times.append(s.elapsed_time(e))
            times.sort()
            ms = times[len(times) // 2]
            gb = B * H * N * D * 2 * 2 / 1e9
            res.append({"batch": B, "ctx": N, "ms": ms, "gbps": gb / (ms * 1e-3), "backend": backend,
                        "rel_err_vs_f32": err})
            print(f"[anchor] B={B} N={N} {backend}: {ms:.4f} ms, {gb / (ms * 1e-3):.0f} GB/s, err {err:.2e}",
                  file=sys.stderr)
            del q, k, v, o
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

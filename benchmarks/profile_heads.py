"""Where one training step of each LM head spends its GPU time: kernels by kind, and the host's idle time.

    python benchmarks/profile_heads.py [--shapes gemma2-2b,qwen2.5-0.5b] [--rows fused,token_rl,trl_rl]
    python benchmarks/profile_heads.py --cpu            # dry run on CPU tensors (tiny shape; no kernel table)

The rows are bench_lm_loss.py's (same inputs: bf16, realistic logits, 10% ignored; forward + backward; mode
"train", or "frozen" with --frozen). For each shape and row: the step's median time by CUDA events, then the
kernels of 3 profiled steps (torch.profiler) per step, grouped as

  gemm         cuBLAS / CUTLASS matmuls (names with gemm, nvjet, xmma, cutlass)
  triton       Triton kernels (ours and TRL's), each listed by name
  elementwise  PyTorch's elementwise, reduction, index, copy and fill kernels
  other        the rest

and idle = step time - the sum of kernel times (the GPU waiting for the host, or streams not overlapping).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_lm_loss as bench  # noqa: E402  (its inputs, rows and step)

GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas")
ELEMENTWISE = ("elementwise", "reduce", "index", "copy", "fill", "scatter", "gather", "cat", "where", "nonzero")


def kind(name: str) -> str:
    lower = name.lower()
    if any(k in lower for k in GEMM):
        return "gemm"
    if any(k in lower for k in ELEMENTWISE):
        return "elementwise"
    if lower.startswith("_") or "triton" in lower:
        return "triton"
    return "other"


def profile_row(fn, steps: int = 3) -> dict:
    """Per step: total kernel ms by kind, and the Triton kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kind, by_triton = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time / 1e3 / steps  # (device_time: microseconds)
        k = kind(event.name)
        by_kind[k] += ms
        if k == "triton":
            by_triton[event.name] += ms
    return {"kinds": dict(by_kind), "triton": dict(by_triton.most_common(6))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama3-8b,qwen2.5-7b,gemma2-2b,qwen2.5-0.5b")
    parser.add_argument("--rows", default="fused,token_sft,token_rl,trl_rl")
    parser.add_argument("--frozen", action="store_true", help="frozen lm_head (no weight gradient)")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    bench.DEVICE = "cpu" if args.cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    impls = bench.implementations({}, include_variants=False)
    rows = [name for name in args.rows.split(",") if name in impls]
    mode = "frozen_head" if args.frozen else "train"
    for shape in ("tiny",) if args.cpu else args.shapes.split(","):
        n, h, v = bench.SHAPES[shape]
        x, w, y = bench.make_inputs(n, h, v, dtype=torch.bfloat16)
        x.requires_grad_(True)
        w.requires_grad_(mode == "train")
        floor, _ = bench.floor_fn(x, w, "train" if mode == "train" else "frozen")
        floor_ms = bench.time_cuda(floor, budget_ms=300)[0]
        print(f"\n## {shape} (N={n}, H={h}, V={v}), {mode}: floor {floor_ms:.2f} ms")
        for name in rows:
            fn = bench.step_fn(impls[name], x, w, y, mode, 1.0)
            fn()
            ms = statistics.median(bench.time_cuda(fn, budget_ms=300)[1])
            if args.cpu:
                print(f"{name:10s} {ms:8.2f} ms (CPU: no kernel table)")
                continue
            p = profile_row(fn)
            kernels = sum(p["kinds"].values())
            parts = " · ".join(f"{k} {p['kinds'].get(k, 0.0):.2f}" for k in ("gemm", "triton", "elementwise", "other"))
            print(f"{name:10s} {ms:8.2f} ms ({ms / floor_ms:.2f}× floor) = kernels {kernels:.2f} [{parts}]"
                  f" + idle {ms - kernels:.2f}")
            for kernel, kms in p["triton"].items():
                print(f"{'':12s}{kms:7.3f} ms  {kernel[:90]}")
        del x, w, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

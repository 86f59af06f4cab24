"""Distillation head step: fused_lm_loss.fused_divergence against TRL's ChunkedDivergenceFunction (H200).

One step as TRL's DistillationTrainer runs it on the selected (completion) rows: per-token divergence of the student's
and the teacher's heads, loss = sum / rows, backward to the student (hidden states and lm_head weight: "train"; the
hidden states only: "frozen_head", as with LoRA). Both implementations on the same inputs, alternately:

  fused     fused_lm_loss.fused_divergence(reduction="none", return_entropy=True), summed as TRL's trainer does
  trl       trl.kernels.chunked_divergence.ChunkedDivergenceFunction.apply (TRL 1.16)

Time: median of CUDA-event timings (L2 flushed, as bench_lm_loss.py); extra GiB: peak allocated beyond the inputs
and the returned gradients. Errors: relative L2 error of the loss, dX and dW against a float64 computation of the
same inputs (chunked; closed-form gradients). Data: bf16, student logits std ~4, the teacher's a perturbed copy of
the student's (correlated distributions), the teacher of the same hidden size.

    python benchmarks/bench_distill.py [--shapes llama3-8b,qwen2.5-0.5b] [--beta 0.5] [--budget-ms 800] [--cpu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import bench_lm_loss as bench  # noqa: E402  (its timing: time_cuda, flush, sync)
from fused_lm_loss import fused_divergence  # noqa: E402

SHAPES = {"llama3-8b": (8192, 4096, 128256), "qwen2.5-0.5b": (8192, 896, 151936), "tiny": (256, 64, 1000)}
GiB = 2.0**30


def make_inputs(n, h, v, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = int(n * 0.9)  # the completion rows TRL's trainer passes (10% of positions are prompt / padding)
    hs = torch.randn(rows, h, device=device, generator=gen)
    ws = torch.randn(v, h, device=device, generator=gen) * (4.0 / math.sqrt(h))
    ht = hs + 0.5 * torch.randn(rows, h, device=device, generator=gen)
    wt = ws + 0.5 * torch.randn(v, h, device=device, generator=gen) * (4.0 / math.sqrt(h))
    return [t.to(dtype) for t in (hs, ws, ht, wt)]


def float64_reference(hs, ws, ht, wt, beta, chunk=512):
    """(loss, dX, dW) of sum(div) / rows in float64, chunked; closed-form gradients (divergence.py's formulas)."""
    n = hs.shape[0]
    ws64, wt64 = ws.double(), wt.double()
    loss = torch.zeros((), dtype=torch.float64, device=hs.device)
    dx = torch.empty(hs.shape, dtype=torch.float64, device=hs.device)
    dw = torch.zeros(ws.shape, dtype=torch.float64, device=hs.device)
    for s in range(0, n, chunk):
        h64 = hs[s:s + chunk].double()
        log_ps = torch.log_softmax(h64 @ ws64.T, -1)
        log_pt = torch.log_softmax(ht[s:s + chunk].double() @ wt64.T, -1)
        p_s, p_t = log_ps.exp(), log_pt.exp()
        if beta == 0.0:
            div, g = (p_t * (log_pt - log_ps)).sum(-1), p_s - p_t
        elif beta == 1.0:
            div = (p_s * (log_ps - log_pt)).sum(-1)
            g = p_s * (log_ps - log_pt - div[:, None])
        else:
            log_m = torch.log(beta * p_t + (1 - beta) * p_s)
            kl_s = (p_s * (log_ps - log_m)).sum(-1)
            div = beta * (p_t * (log_pt - log_m)).sum(-1) + (1 - beta) * kl_s
            g = (1 - beta) * p_s * (log_ps - log_m - kl_s[:, None])
        loss += div.sum() / n
        g /= n
        dx[s:s + chunk] = g @ ws64
        dw += g.T @ h64
    return loss, dx, dw


def implementations(beta):
    def fused(hs, ws, ht, wt):
        out = fused_divergence(hs, ws, ht, wt, kind={0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd"),
                               beta=beta if 0 < beta < 1 else None, reduction="none", return_entropy=True)
        return out.divergence.sum() / hs.shape[0]

    impls = {"fused": fused}
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl(hs, ws, ht, wt):
            div, _ = ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, beta)
            return div.sum() / hs.shape[0]

        impls["trl"] = trl
    except Exception as e:  # noqa: BLE001 - not installed here
        print(f"trl unavailable: {type(e).__name__}: {str(e)[:200]}")
    return impls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b,qwen2.5-0.5b")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--budget-ms", type=float, default=800.0)
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU tensors at a tiny shape")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    bench.DEVICE = device
    shapes = ["tiny"] if args.cpu else args.shapes.split(",")
    rows = []
    for shape in shapes:
        n, h, v = SHAPES[shape]
        hs, ws, ht, wt = make_inputs(n, h, v, device, torch.bfloat16)
        ref = float64_reference(hs, ws, ht, wt, args.beta)
        for mode in ("train", "frozen_head"):
            for name, impl in implementations(args.beta).items():
                hs.requires_grad_(True)
                ws.requires_grad_(mode == "train")

                def step():
                    hs.grad = ws.grad = None
                    loss = impl(hs, ws, ht, wt)
                    loss.backward()
                    return loss

                row = dict(shape=shape, mode=mode, beta=args.beta, impl=name)
                try:
                    loss = step()
                    row.update(err_loss=bench.rel_err(loss, ref[0]), err_dx=bench.rel_err(hs.grad, ref[1]))
                    if mode == "train":
                        row["err_dw"] = bench.rel_err(ws.grad, ref[2])
                    hs.grad = ws.grad = None
                    if device == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    ms, _ = bench.time_cuda(step, budget_ms=args.budget_ms)
                    row["ms"] = ms
                    if device == "cuda":
                        grads = hs.numel() * 2 + (ws.numel() * 2 if mode == "train" else 0)
                        row["extra_gib"] = (torch.cuda.max_memory_allocated() - base - grads) / GiB
                except Exception as e:  # noqa: BLE001 - a failure is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                hs.grad = ws.grad = None
                rows.append(row)
                print(json.dumps(row), flush=True)
        hs = ws = ht = wt = ref = None  # (freed before the next shape)
        if device == "cuda":
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "distill.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| shape | mode | impl | ms | fused / trl | extra GiB | err loss | err dX | err dW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        other = next((o for o in rows if o["shape"] == r["shape"] and o["mode"] == r["mode"] and o["impl"] == "trl"),
                     None)
        ratio = f"{r['ms'] / other['ms']:.2f}" if r["impl"] == "fused" and other and "ms" in other and "ms" in r else ""
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) and k in ("ms", "extra_gib") else
                 f"{r[k]:.1e}" if isinstance(r.get(k), float) else str(r.get(k, r.get("error", "")))[:40]
                 for k in ("ms",)]
        print(f"| {r['shape']} | {r['mode']} | {r['impl']} | {cells[0]} | {ratio} | "
              + " | ".join(f"{r[k]:.3f}" if k == "extra_gib" and k in r else f"{r[k]:.1e}" if k in r else ""
                           for k in ("extra_gib", "err_loss", "err_dx", "err_dw")) + " |")


if __name__ == "__main__":
    main()

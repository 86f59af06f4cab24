"""Each per-chunk step of the fused loss alone, at the chunk size the library plans, on the GPU.

    python benchmarks/profile_steps.py [--shapes gemma2-2b,qwen2.5-0.5b] [--rows 1024,2048] [--mode frozen]
    python benchmarks/profile_steps.py --shapes tiny                                   # CPU dry run (torch backend)
    TRITON_INTERPRET=1 FUSED_LM_LOSS_BACKEND=triton python benchmarks/profile_steps.py --shapes tiny   # CPU, kernels

For each shape (bf16, 10% of labels ignored) it prints the plan of one call (``plan.make_plan``: kept rows,
chunks, dtypes), the full-batch cuBLAS floor (x @ W.T, G @ W, G.T @ x; frozen head: the first two) and
one table row per chunk size: the plan's own, then the plans made with ``chunk_size=R`` for each ``--rows``.
Each step is timed alone (``triton.testing.do_bench`` medians) on the first chunk:
  select    chunked.select_rows on the batch's labels (the kept_rows kernel and its one host sync) and
            plan.make_plan: the host work before a call's first matmul, once per call
  logits    LinearHead.logits: the kept rows gathered, h @ W.T into the chunk buffer (cuBLAS), TF/s
  losses    backend.row_losses: loss and lse per row, GB/s of one read of the chunk
  grad      backend.grad_logits: G in place of the logits (as the loop runs it; after the first run it reads
            G, which costs the same), GB/s of a read and a write
  dX        G @ W into the plan's dX dtype, TF/s;  dW: G.T @ h added into the plan's accumulator (written,
            with one chunk), TF/s (train only)
  dX‖dW     LinearHead.backprop: both as the loop runs them (dX on a second stream beside dW on CUDA)
  est.      select + (logits + losses + grad + dX‖dW) x chunks, and that over the floor
"""
from __future__ import annotations

import argparse

import torch

from common import DEVICE, SHAPES, bench, default_shapes, describe, inputs, mm_into, plan_for, tflops


def floor_ms(x, w, mode):
    """The full-batch matmuls a fused step cannot avoid: (total ms, text)."""
    n, v = x.shape[0], w.shape[0]
    full = torch.empty(n, v, device=DEVICE, dtype=x.dtype)
    flop = 2 * n * x.shape[1] * v
    parts = [("x@W.T", bench(lambda: torch.mm(x, w.t(), out=full)))]
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    parts.append(("G@W", bench(lambda: torch.mm(full, w, out=dx))))
    if mode == "train":
        parts.append(("G.T@x", bench(lambda: torch.mm(full.t(), x, out=dw))))
    total = sum(t for _, t in parts)
    return total, " + ".join(f"{label} {t:.2f} ({tflops(flop, t):.0f} TF/s)" for label, t in parts)


def chunk_steps(x, w, y, mode, chunk_size):
    """The table row of one plan: its chunk's steps timed alone."""
    plan, head, rows = plan_for(x, w, y, mode, chunk_size=chunk_size)
    backend = plan.backend
    n_chunks = plan.n_rows / plan.chunk_rows
    end = min(plan.chunk_rows, plan.n_rows)
    t_select = bench(lambda: plan_for(x, w, y, mode, chunk_size=chunk_size))  # select_rows + make_plan (host)
    head.start(plan, rows)
    logits = head.logits(0, end)
    target = rows.target[:end]
    loss = torch.empty(end, dtype=torch.float32, device=DEVICE)
    lse = torch.empty_like(loss)
    h, v = x.shape[1], w.shape[0]
    flop, nbytes = 2 * end * h * v, logits.numel() * logits.element_size()
    times = {"logits": bench(lambda: head.logits(0, end))}
    times["losses"] = bench(lambda: backend.row_losses(logits, target, loss, lse, transform=plan.transform,
                                                       terms=plan.terms))
    grad, grad_lo = head.grad_buffers(0, end)
    times["grad"] = bench(lambda: backend.grad_logits(logits, grad, target, lse, grad_scale=plan.grad_scale,
                                                     row_scale=None, out_lo=grad_lo, transform=plan.transform,
                                                     terms=plan.grad_terms))
    h_rows = rows.gather(x, 0, end)
    dx = torch.empty(end, h, device=DEVICE, dtype=plan.grad_input_dtype)
    times["dX"] = bench(lambda: mm_into(dx, grad, w))
    if plan.needs.weight:
        acc = torch.zeros(w.shape, device=DEVICE, dtype=plan.accum_dtype)
        times["dW"] = bench(lambda: mm_into(acc, grad.t(), h_rows, add=n_chunks > 1))
        acc = None
    times["dX‖dW"] = bench(lambda: head.backprop(0, end))
    head.finish()
    per_chunk = times["logits"] + times["losses"] + times["grad"] + times["dX‖dW"]
    cells = [
        f"{plan.chunk_rows}", f"{n_chunks:.2f}", f"{t_select:.3f}",
        f"{times['logits']:.3f} ({tflops(flop, times['logits']):.0f})",
        f"{times['losses']:.3f} ({nbytes / times['losses'] / 1e6:.0f})",
        f"{times['grad']:.3f} ({2 * nbytes / times['grad'] / 1e6:.0f})",
        f"{times['dX']:.3f} ({tflops(flop, times['dX']):.0f})",
        f"{times['dW']:.3f} ({tflops(flop, times['dW']):.0f})" if "dW" in times else "-",
        f"{times['dX‖dW']:.3f}",
    ]
    return plan, cells, t_select + per_chunk * n_chunks


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"of {','.join(SHAPES)} (default: all but tiny; CPU: tiny)")
    parser.add_argument("--rows", default="", help="chunk_size values to plan with besides the default")
    parser.add_argument("--mode", default="train", choices=("train", "frozen"), help="train: dX and dW; frozen: dX")
    parser.add_argument("--ignore", type=float, default=0.1, help="fraction of labels at -100")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in default_shapes(args.shapes):
        x, w, y = inputs(name, args.ignore)
        n, h, v = SHAPES[name]
        floor, parts = floor_ms(x, w, args.mode)
        print(f"\n## {name} (N={n} H={h} V={v}, {args.mode}, {args.ignore:.0%} ignored): floor {floor:.2f} ms = {parts}")
        rows_list = [None] + [int(r) for r in args.rows.split(",") if r]
        header = ("| chunk rows | chunks | select+plan ms | logits ms (TF/s) | losses ms (GB/s) | grad ms (GB/s) | "
                  "dX ms (TF/s) | dW ms (TF/s) | dX‖dW ms | est. step ms (× floor) |")
        table = [header, "|---" * 10 + "|"]
        for chunk_size in rows_list:
            plan, cells, total = chunk_steps(x, w, y, args.mode, chunk_size)
            if chunk_size is None:
                print(f"plan: {describe(plan)}")
            table.append("| " + " | ".join(cells + [f"{total:.2f} ({total / floor:.3f}×)"]) + " |")
        print("\n".join(table))
        x = w = y = None
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
